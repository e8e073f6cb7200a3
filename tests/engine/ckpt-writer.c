#include "ckpt-writer.h"

#include <criterion/criterion.h>
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
        for (size_t j = 0; j < ne; j++) {
            float v = (float)((double)(rng_next(&seed) >> 11) / 9007199254740992.0 - 0.5) * 0.5f;
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

void ckw_rmtree(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}
