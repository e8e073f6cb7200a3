#include "synth.h"

#include "dtype.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct tdesc {
    char name[256];
    int n_dim;
    int64_t shape[3];
    float scale; /* values uniform in [-scale, scale], plus 1 for norm weights */
    int is_norm;
};

static int add(struct tdesc *t, int n, const char *name, int nd, int64_t a, int64_t b, int64_t c, float scale,
               int is_norm)
{
    snprintf(t[n].name, sizeof t[n].name, "%s", name);
    t[n].n_dim = nd;
    t[n].shape[0] = a;
    t[n].shape[1] = b;
    t[n].shape[2] = c;
    t[n].scale = scale;
    t[n].is_norm = is_norm;
    return n + 1;
}

int synth_write(const char *dir, const struct synth_spec *s)
{
    const int64_t n_layer = (int64_t)strlen(s->pattern);
    struct tdesc *t = calloc((size_t)(16 + n_layer * (16 + 3 * s->n_expert)), sizeof *t);
    if (!t) {
        return -1;
    }
    int n = 0;
    char nm[256];
    const float ws = 1.0f / 32.0f;
    n = add(t, n, "backbone.embeddings.weight", 2, s->vocab, s->dim, 0, 1.0f, 0);
    n = add(t, n, "backbone.norm_f.weight", 1, s->dim, 0, 0, 0.1f, 1);
    n = add(t, n, "lm_head.weight", 2, s->vocab, s->dim, 0, ws, 0);
    const int64_t di = s->m_heads * s->m_head_dim, cd = di + 2 * s->m_groups * s->m_state;
    for (int64_t i = 0; i < n_layer; i++) {
        snprintf(nm, sizeof nm, "backbone.layers.%lld.norm.weight", (long long)i);
        n = add(t, n, nm, 1, s->dim, 0, 0, 0.1f, 1);
        char p[96];
        snprintf(p, sizeof p, "backbone.layers.%lld.mixer.", (long long)i);
#define NM(suffix) (snprintf(nm, sizeof nm, "%s%s", p, suffix), nm)
        switch (s->pattern[i]) {
        case 'M':
            n = add(t, n, NM("in_proj.weight"), 2, 2 * di + 2 * s->m_groups * s->m_state + s->m_heads, s->dim, 0, ws, 0);
            n = add(t, n, NM("conv1d.weight"), 3, cd, 1, s->m_conv, 0.5f, 0);
            n = add(t, n, NM("conv1d.bias"), 1, cd, 0, 0, 0.1f, 0);
            n = add(t, n, NM("dt_bias"), 1, s->m_heads, 0, 0, 1.0f, 0);
            n = add(t, n, NM("A_log"), 1, s->m_heads, 0, 0, 1.0f, 0);
            n = add(t, n, NM("D"), 1, s->m_heads, 0, 0, 0.1f, 1);
            n = add(t, n, NM("norm.weight"), 1, di, 0, 0, 0.1f, 1);
            n = add(t, n, NM("out_proj.weight"), 2, s->dim, di, 0, ws, 0);
            break;
        case '*':
            n = add(t, n, NM("q_proj.weight"), 2, s->n_head * s->head_dim, s->dim, 0, ws, 0);
            n = add(t, n, NM("k_proj.weight"), 2, s->n_kv_head * s->head_dim, s->dim, 0, ws, 0);
            n = add(t, n, NM("v_proj.weight"), 2, s->n_kv_head * s->head_dim, s->dim, 0, ws, 0);
            n = add(t, n, NM("o_proj.weight"), 2, s->dim, s->n_head * s->head_dim, 0, ws, 0);
            break;
        case '-':
            n = add(t, n, NM("up_proj.weight"), 2, s->ffn, s->dim, 0, ws, 0);
            n = add(t, n, NM("down_proj.weight"), 2, s->dim, s->ffn, 0, ws, 0);
            break;
        case 'E':
            n = add(t, n, NM("gate.weight"), 2, s->n_expert, s->dim, 0, ws, 0);
            n = add(t, n, NM("gate.e_score_correction_bias"), 1, s->n_expert, 0, 0, 0.01f, 0);
            for (int64_t e = 0; e < s->n_expert; e++) {
                char en[64];
                snprintf(en, sizeof en, "experts.%lld.up_proj.weight", (long long)e);
                n = add(t, n, NM(en), 2, s->moe_ffn, s->dim, 0, ws, 0);
                snprintf(en, sizeof en, "experts.%lld.down_proj.weight", (long long)e);
                n = add(t, n, NM(en), 2, s->dim, s->moe_ffn, 0, ws, 0);
            }
            n = add(t, n, NM("shared_experts.up_proj.weight"), 2, s->shared_ffn, s->dim, 0, ws, 0);
            n = add(t, n, NM("shared_experts.down_proj.weight"), 2, s->dim, s->shared_ffn, 0, ws, 0);
            break;
        default:
            fprintf(stderr, "synth: unsupported letter %c\n", s->pattern[i]);
            free(t);
            return -1;
        }
#undef NM
    }
    /* header */
    size_t cap = (size_t)n * 256 + 64, o = 0, off = 0;
    char *hdr = malloc(cap);
    if (!hdr) {
        free(t);
        return -1;
    }
    o += (size_t)snprintf(hdr + o, cap - o, "{");
    for (int i = 0; i < n; i++) {
        int64_t ne = 1;
        for (int d = 0; d < t[i].n_dim; d++) {
            ne *= t[i].shape[d];
        }
        o += (size_t)snprintf(hdr + o, cap - o, "%s\"%s\":{\"dtype\":\"BF16\",\"shape\":[", i ? "," : "", t[i].name);
        for (int d = 0; d < t[i].n_dim; d++) {
            o += (size_t)snprintf(hdr + o, cap - o, "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        }
        o += (size_t)snprintf(hdr + o, cap - o, "],\"data_offsets\":[%zu,%zu]}", off, off + (size_t)ne * 2);
        off += (size_t)ne * 2;
    }
    o += (size_t)snprintf(hdr + o, cap - o, "}");
    while (o % 8) {
        hdr[o++] = ' ';
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *fp = fopen(path, "wb");
    if (!fp) {
        perror(path);
        free(hdr);
        free(t);
        return -1;
    }
    uint64_t hl = o;
    fwrite(&hl, 8, 1, fp);
    fwrite(hdr, 1, o, fp);
    uint64_t st = 0x2545f4914f6cdd1dull;
    uint16_t buf[4096];
    for (int i = 0; i < n; i++) {
        int64_t ne = 1;
        for (int d = 0; d < t[i].n_dim; d++) {
            ne *= t[i].shape[d];
        }
        for (int64_t j = 0; j < ne; j += 4096) {
            int64_t k = ne - j < 4096 ? ne - j : 4096;
            for (int64_t q = 0; q < k; q++) {
                st ^= st << 13;
                st ^= st >> 7;
                st ^= st << 17;
                float u = (float)((double)(st >> 11) / 9007199254740992.0) * 2.0f - 1.0f;
                buf[q] = kr_f32_to_bf16(u * t[i].scale + (t[i].is_norm ? 1.0f : 0.0f));
            }
            fwrite(buf, 2, (size_t)k, fp);
        }
    }
    fclose(fp);
    free(hdr);
    free(t);
    snprintf(path, sizeof path, "%s/config.json", dir);
    fp = fopen(path, "w");
    if (!fp) {
        perror(path);
        return -1;
    }
    fprintf(fp,
            "{\"model_type\": \"nemotron_h\", \"hybrid_override_pattern\": \"%s\", \"vocab_size\": %lld,"
            " \"hidden_size\": %lld, \"layer_norm_epsilon\": 1e-5, \"mamba_num_heads\": %lld,"
            " \"mamba_head_dim\": %lld, \"n_groups\": %lld, \"ssm_state_size\": %lld, \"conv_kernel\": %lld,"
            " \"chunk_size\": %lld, \"num_attention_heads\": %lld, \"num_key_value_heads\": %lld,"
            " \"head_dim\": %lld, \"intermediate_size\": %lld, \"n_routed_experts\": %lld,"
            " \"num_experts_per_tok\": %lld, \"moe_intermediate_size\": %lld,"
            " \"moe_shared_expert_intermediate_size\": %lld, \"time_step_limit\": [0.0, Infinity]}\n",
            s->pattern, (long long)s->vocab, (long long)s->dim, (long long)s->m_heads, (long long)s->m_head_dim,
            (long long)s->m_groups, (long long)s->m_state, (long long)s->m_conv, (long long)s->m_chunk,
            (long long)s->n_head, (long long)s->n_kv_head, (long long)s->head_dim, (long long)s->ffn,
            (long long)(s->n_expert ? s->n_expert : 1), (long long)(s->n_used ? s->n_used : 1),
            (long long)(s->moe_ffn ? s->moe_ffn : 1), (long long)s->shared_ffn);
    fclose(fp);
    return 0;
}
