#define _GNU_SOURCE /* memmem */
#include "ckpt-writer.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct ckw_tensor *ckw_add(struct ckw *w, const char *name, enum kr_dtype dt, int n_dim, const int64_t *shape)
{
    cr_assert(w->n < CKW_MAX);
    struct ckw_tensor *t = &w->t[w->n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dt = dt;
    t->n_dim = n_dim;
    memcpy(t->shape, shape, (size_t)n_dim * sizeof(int64_t));
    return t;
}

struct ckw_tensor *ckw_get(struct ckw *w, const char *name)
{
    for (int i = 0; i < w->n; i++) {
        if (!strcmp(w->t[i].name, name)) {
            return &w->t[i];
        }
    }
    return NULL;
}

int ckw_remove(struct ckw *w, const char *name)
{
    struct ckw_tensor *t = ckw_get(w, name);
    if (!t) {
        return -1;
    }
    memmove(t, t + 1, (size_t)(w->t + w->n - (t + 1)) * sizeof *t);
    w->n--;
    return 0;
}

#define D1(a) 1, (const int64_t[]){a}
#define D2(a, b) 2, (const int64_t[]){a, b}
#define D3(a, b, c) 3, (const int64_t[]){a, b, c}

/* dims of CKW_TINY: hidden 16, vocab 32, mamba heads 4 x 4, groups 2, state 4, conv 4;
 * attention 2 heads, 1 kv head, head_dim 8; ffn 24; experts 4 (2 used), moe_ffn 8, shared 8 */
void ckw_tiny_nemotron(struct ckw *w, const char *p)
{
    char n[160];
    w->n = 0;
    const enum kr_dtype bf = KR_DTYPE_BF16;
    snprintf(n, sizeof n, "%sembeddings.weight", p);
    ckw_add(w, n, bf, D2(32, 16));
    snprintf(n, sizeof n, "%snorm_f.weight", p);
    ckw_add(w, n, bf, D1(16));
    ckw_add(w, "lm_head.weight", bf, D2(32, 16));
    for (int i = 0; i < 4; i++) {
        snprintf(n, sizeof n, "%slayers.%d.norm.weight", p, i);
        ckw_add(w, n, bf, D1(16));
    }
    /* layer 0: M. in_proj rows 2*16 + 2*2*4 + 4 = 52, conv_dim 16 + 16 = 32 */
    const char *m = "layers.0.mixer.";
    snprintf(n, sizeof n, "%s%sin_proj.weight", p, m);
    ckw_add(w, n, bf, D2(52, 16));
    snprintf(n, sizeof n, "%s%sconv1d.weight", p, m);
    ckw_add(w, n, bf, D3(32, 1, 4));
    snprintf(n, sizeof n, "%s%sconv1d.bias", p, m);
    ckw_add(w, n, bf, D1(32));
    snprintf(n, sizeof n, "%s%sdt_bias", p, m);
    ckw_add(w, n, KR_DTYPE_F32, D1(4));
    snprintf(n, sizeof n, "%s%sA_log", p, m);
    ckw_add(w, n, KR_DTYPE_F32, D1(4));
    snprintf(n, sizeof n, "%s%sD", p, m);
    ckw_add(w, n, KR_DTYPE_F32, D1(4));
    snprintf(n, sizeof n, "%s%snorm.weight", p, m);
    ckw_add(w, n, bf, D1(16));
    snprintf(n, sizeof n, "%s%sout_proj.weight", p, m);
    ckw_add(w, n, bf, D2(16, 16));
    /* layer 1: * */
    static const char *const qkvo[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    static const int64_t qkvo_shape[4][2] = {{16, 16}, {8, 16}, {8, 16}, {16, 16}};
    for (int j = 0; j < 4; j++) {
        snprintf(n, sizeof n, "%slayers.1.mixer.%s.weight", p, qkvo[j]);
        ckw_add(w, n, bf, 2, qkvo_shape[j]);
    }
    /* layer 2: - (relu2) */
    snprintf(n, sizeof n, "%slayers.2.mixer.up_proj.weight", p);
    ckw_add(w, n, bf, D2(24, 16));
    snprintf(n, sizeof n, "%slayers.2.mixer.down_proj.weight", p);
    ckw_add(w, n, bf, D2(16, 24));
    /* layer 3: E */
    snprintf(n, sizeof n, "%slayers.3.mixer.gate.weight", p);
    ckw_add(w, n, bf, D2(4, 16));
    snprintf(n, sizeof n, "%slayers.3.mixer.gate.e_score_correction_bias", p);
    ckw_add(w, n, KR_DTYPE_F32, D1(4));
    for (int e = 0; e < 4; e++) {
        snprintf(n, sizeof n, "%slayers.3.mixer.experts.%d.up_proj.weight", p, e);
        ckw_add(w, n, bf, D2(8, 16));
        snprintf(n, sizeof n, "%slayers.3.mixer.experts.%d.down_proj.weight", p, e);
        ckw_add(w, n, bf, D2(16, 8));
    }
    snprintf(n, sizeof n, "%slayers.3.mixer.shared_experts.up_proj.weight", p);
    ckw_add(w, n, bf, D2(8, 16));
    snprintf(n, sizeof n, "%slayers.3.mixer.shared_experts.down_proj.weight", p);
    ckw_add(w, n, bf, D2(16, 8));
}

void ckw_tiny_config(char *out, size_t n, const char *pattern_json, const char *limit_hi)
{
    snprintf(out, n,
             "{\"model_type\": \"nemotron_h\", \"architectures\": [\"NemotronHForCausalLM\"],\n"
             " %s,\n"
             " \"vocab_size\": 32, \"hidden_size\": 16, \"layer_norm_epsilon\": 1e-5,\n"
             " \"mamba_num_heads\": 4, \"mamba_head_dim\": 4, \"n_groups\": 2, \"ssm_state_size\": 4,\n"
             " \"conv_kernel\": 4, \"chunk_size\": 4, \"use_conv_bias\": true, \"use_bias\": false,\n"
             " \"time_step_limit\": [0.0, %s],\n"
             " \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 8,\n"
             " \"intermediate_size\": 24, \"mlp_hidden_act\": \"relu2\",\n"
             " \"n_routed_experts\": 4, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 8,\n"
             " \"moe_shared_expert_intermediate_size\": 8, \"n_group\": 2, \"topk_group\": 1,\n"
             " \"routed_scaling_factor\": 2.5, \"norm_topk_prob\": true,\n"
             " \"tie_word_embeddings\": false, \"eos_token_id\": 2, \"bos_token_id\": 1}\n",
             pattern_json, limit_hi);
}

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

void ckw_write(const struct ckw *w, const char *path)
{
    char *hdr = malloc(1 << 16);
    cr_assert(hdr);
    size_t o = 0, off = 0;
    o += (size_t)snprintf(hdr + o, (1 << 16) - o, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < w->n; i++) {
        const struct ckw_tensor *t = &w->t[i];
        size_t ne = 1;
        o += (size_t)snprintf(hdr + o, (1 << 16) - o, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t->name,
                              kr_dtype_name(t->dt));
        for (int d = 0; d < t->n_dim; d++) {
            ne *= (size_t)t->shape[d];
            o += (size_t)snprintf(hdr + o, (1 << 16) - o, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        }
        size_t nb = ne * kr_dtype_size(t->dt);
        o += (size_t)snprintf(hdr + o, (1 << 16) - o, "],\"data_offsets\":[%zu,%zu]}", off, off + nb);
        off += nb;
    }
    o += (size_t)snprintf(hdr + o, (1 << 16) - o, "}");
    FILE *fp = fopen(path, "wb");
    cr_assert(fp, "cannot write %s", path);
    uint64_t hl = o;
    fwrite(&hl, 8, 1, fp);
    fwrite(hdr, 1, o, fp);
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < w->n; i++) {
        const struct ckw_tensor *t = &w->t[i];
        size_t ne = 1;
        for (int d = 0; d < t->n_dim; d++) {
            ne *= (size_t)t->shape[d];
        }
        /* uniform on [-0.25, 0.25] (standard deviation 0.25 / sqrt(3)), or scaled to 1/sqrt(columns) */
        float scale = 0.5f;
        if (w->fan_in_scale && t->n_dim == 2 && !strstr(t->name, "embed")) {
            scale = (float)(sqrt(12.0) / sqrt((double)t->shape[1]));
        }
        for (size_t j = 0; j < ne; j++) {
            float v = (float)((double)(rng_next(&seed) >> 11) / 9007199254740992.0 - 0.5) * scale;
            if (strstr(t->name, "norm")) {
                v += 1.0f;
            }
            if (t->dt == KR_DTYPE_F32) {
                fwrite(&v, 4, 1, fp);
            } else if (t->dt == KR_DTYPE_BF16 || t->dt == KR_DTYPE_F16) {
                uint16_t h = kr_f32_to_bf16(v); /* F16 tensors in these tests only need valid bits */
                fwrite(&h, 2, 1, fp);
            } else {
                uint8_t zero[8] = {0};
                fwrite(zero, kr_dtype_size(t->dt), 1, fp);
            }
        }
    }
    fclose(fp);
    free(hdr);
}

void ckw_write_text(const char *path, const char *text)
{
    FILE *fp = fopen(path, "wb");
    cr_assert(fp, "cannot write %s", path);
    fputs(text, fp);
    fclose(fp);
}

void ckw_tmpdir(char *out, size_t n)
{
    snprintf(out, n, "/tmp/krait-test-XXXXXX");
    cr_assert(mkdtemp(out));
}

void ckw_copy_edit(const char *src, const char *dst, const char *file, const char *from, const char *to)
{
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "cp -rL '%s'/. '%s'/", src, dst); /* -L: fixtures may link to models/ */
    cr_assert_eq(system(cmd), 0);
    if (!file) {
        return;
    }
    char path[700];
    snprintf(path, sizeof path, "%s/%s", dst, file);
    FILE *fp = fopen(path, "rb");
    cr_assert(fp, "cannot read %s", path);
    fseek(fp, 0, SEEK_END);
    const long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    cr_assert(buf && fread(buf, 1, (size_t)n, fp) == (size_t)n);
    fclose(fp);
    buf[n] = 0;
    char *hit = memmem(buf, (size_t)n, from, strlen(from));
    cr_assert(hit, "%s has no \"%s\"", file, from);
    fp = fopen(path, "wb");
    cr_assert(fp);
    fwrite(buf, 1, (size_t)(hit - buf), fp);
    fputs(to, fp);
    const char *rest = hit + strlen(from);
    fwrite(rest, 1, (size_t)(buf + n - rest), fp);
    fclose(fp);
    free(buf);
}

void ckw_rmtree(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

void ckw_hybrid_tensors(struct ckw *w, const char *pattern, const struct ckw_shape *d)
{
    const int64_t H = d->hidden, V = d->vocab, NH = d->heads, NKV = d->kv_heads, HD = d->head_dim;
    const int64_t QL = d->q_lora, KVL = d->kv_lora, NOPE = d->nope, ROPE = d->rope, VD = d->v_dim;
    const int64_t IH = d->idx_heads, ID = d->idx_dim, FF = d->ffn;
    const int64_t MH = d->m_heads, DI = MH * d->m_head_dim, MG = d->m_groups, MS = d->m_state;
    const int64_t CONV = DI + 2 * MG * MS;
#define T1(name, a) ckw_add(w, name, KR_DTYPE_BF16, 1, (const int64_t[]){a})
#define T2(name, a, b) ckw_add(w, name, KR_DTYPE_BF16, 2, (const int64_t[]){a, b})
    T2("backbone.embeddings.weight", V, H);
    char n[160];
    for (int l = 0; pattern[l]; l++) {
        const char type = pattern[l];
#define L(suffix) (snprintf(n, sizeof n, "backbone.layers.%d.%s", l, suffix), n)
        T1(L("norm.weight"), H);
        if (type == 'M') {
            T1(L("mixer.A_log"), MH);
            T1(L("mixer.D"), MH);
            T1(L("mixer.dt_bias"), MH);
            T1(L("mixer.conv1d.bias"), CONV);
            ckw_add(w, L("mixer.conv1d.weight"), KR_DTYPE_BF16, 3, (const int64_t[]){CONV, 1, 4});
            T2(L("mixer.in_proj.weight"), 2 * DI + 2 * MG * MS + MH, H);
            T1(L("mixer.norm.weight"), DI);
            T2(L("mixer.out_proj.weight"), H, DI);
        } else if (type == '*') {
            T2(L("mixer.q_proj.weight"), NH * HD, H);
            T2(L("mixer.k_proj.weight"), NKV * HD, H);
            T2(L("mixer.v_proj.weight"), NKV * HD, H);
            T2(L("mixer.o_proj.weight"), H, NH * HD);
        } else if (type == 'D') {
            T2(L("mixer.q_a_proj.weight"), QL, H);
            T1(L("mixer.q_a_layernorm.weight"), QL);
            T2(L("mixer.q_b_proj.weight"), NH * (NOPE + ROPE), QL);
            T2(L("mixer.kv_a_proj_with_mqa.weight"), KVL + ROPE, H);
            T1(L("mixer.kv_a_layernorm.weight"), KVL);
            T2(L("mixer.kv_b_proj.weight"), NH * (NOPE + VD), KVL);
            T2(L("mixer.o_proj.weight"), H, NH * VD);
            T2(L("mixer.indexer.wq_b.weight"), IH * ID, QL);
            T2(L("mixer.indexer.wk.weight"), ID, H);
            T1(L("mixer.indexer.k_norm.weight"), ID);
            T1(L("mixer.indexer.k_norm.bias"), ID);
            T2(L("mixer.indexer.weights_proj.weight"), IH, H);
        } else {
            T2(L("mixer.up_proj.weight"), FF, H);
            T2(L("mixer.down_proj.weight"), H, FF);
        }
#undef L
    }
    T1("backbone.norm_f.weight", H);
    T2("lm_head.weight", V, H);
#undef T1
#undef T2
}

void ckw_dsa_real_shapes(const char *dir)
{
    static struct ckw W;
    memset(&W, 0, sizeof W);
    W.fan_in_scale = true;
    const struct ckw_shape d = {.hidden = 256, .vocab = 512, .heads = 16, .kv_heads = 16, .head_dim = 16,
                                .q_lora = 256, .kv_lora = 512, .nope = 128, .rope = 64, .v_dim = 128,
                                .idx_heads = 16, .idx_dim = 128, .ffn = 512, .m_heads = 8, .m_head_dim = 32,
                                .m_groups = 4, .m_state = 64};
    ckw_hybrid_tensors(&W, "MD-D", &d);
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    ckw_write(&W, path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    ckw_write_text(path,
        "{\"architectures\": [\"NemotronHForCausalLM\"], \"model_type\": \"nemotron_h\", \"vocab_size\": 512,\n"
        " \"hidden_size\": 256, \"num_hidden_layers\": 4, \"hybrid_override_pattern\": \"MD-D\",\n"
        " \"num_attention_heads\": 16, \"num_key_value_heads\": 16, \"attention_bias\": false,\n"
        " \"q_lora_rank\": 256, \"kv_lora_rank\": 512, \"qk_nope_head_dim\": 128, \"qk_rope_head_dim\": 64,\n"
        " \"v_head_dim\": 128, \"index_n_heads\": 16, \"index_head_dim\": 128, \"index_topk\": 64,\n"
        " \"rope_theta\": 10000.0, \"max_position_embeddings\": 4096, \"intermediate_size\": 512,\n"
        " \"mlp_hidden_act\": \"relu2\", \"mlp_bias\": false, \"mamba_num_heads\": 8, \"mamba_head_dim\": 32,\n"
        " \"ssm_state_size\": 64, \"n_groups\": 4, \"conv_kernel\": 4, \"chunk_size\": 32, \"use_conv_bias\": true,\n"
        " \"mamba_hidden_act\": \"silu\", \"time_step_min\": 0.001, \"time_step_max\": 0.1,\n"
        " \"time_step_floor\": 0.0001, \"time_step_limit\": [0.0, \"Infinity\"], \"layer_norm_epsilon\": 1e-05,\n"
        " \"use_bias\": false, \"residual_in_fp32\": false, \"rescale_prenorm_residual\": true,\n"
        " \"mamba_ssm_cache_dtype\": \"float32\", \"tie_word_embeddings\": false, \"bos_token_id\": 1,\n"
        " \"eos_token_id\": 2, \"pad_token_id\": 0, \"torch_dtype\": \"bfloat16\"}\n");
}
