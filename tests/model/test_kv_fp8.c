/* FP8 caches on the CPU reference (--kv-cache-dtype fp8, kr_model_set_kv_cache_dtype): the rows a
 * step writes are rounded as the FP8 cache stores them and read back as the dequantized values.
 *  - What is stored: after the fixtures' prompts, every cached K/V value is an e4m3 value (the scale
 *    is 1); every latent row's c_kv, per block of 128 (or the shorter last one), lies on the e4m3 grid
 *    of one scale (the block's largest magnitude over 448, the scale kr_fp8_act_quant chose, to within
 *    the float rounding of that division); its k_pe values are bf16. Checked by this file's own
 *    definitions, over every row of every pool (rows never written are zero and pass trivially; the
 *    test requires written ones).
 *  - In use: the log-probabilities differ from the plain caches' somewhere (by more than 1e-4).
 *  - Against HF (which caches in fp32), mean |logprob - HF| over the vocabulary stays within KV8_MEAN
 *    (routing / selection models: the worst quarter of positions left out, as the GPU tests do):
 *    the rounding of cached rows moves these 64-wide random models by 0.017-0.054 (measured
 *    2026-12-03, printed);
 *    a cache read at the wrong place or with the wrong scale moves them by O(1).
 *  - The planning backend (no FP8 caches) refuses the setting with a message; the parser takes
 *    auto, bf16 and fp8 only. */
#include "fixture.h"

#include "alloc.h"
#include "dtype.h"
#include "fp8.h"
#include "runner.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define KV8_MEAN 0.15

TestSuite(kv_fp8, .timeout = 300);

/* Checks the stored rows of every cache pool of f; returns the count of non-zero rows checked. */
static int64_t check_pools(const struct fx *f, const char *name)
{
    const struct kr_cache *c = f->c;
    const struct kr_model_config *cfg = &f->m->cfg;
    int64_t rows = 0, bad_kv = 0, bad_lat = 0, bad_pe = 0;
    const int64_t slots = (int64_t)c->n_blocks * c->block_size;
    for (int32_t l = 0; l < f->m->n_attn; l++) {
        const float *k = kr_cache_k_layer(c, l), *v = kr_cache_v_layer(c, l);
        const int64_t n = slots * cfg->n_kv_head * cfg->head_dim;
        for (int64_t i = 0; i < n; i++) {
            bad_kv += (double)k[i] != fx_e4m3_nearest(k[i]) || (double)v[i] != fx_e4m3_nearest(v[i]);
        }
        rows += n > 0 && k[0] != 0;
    }
    for (int32_t l = 0; l < f->m->n_mla; l++) {
        const float *lat = kr_cache_mla_layer(c, l);
        const int64_t row = c->mla_row[l];
        for (int64_t r = 0; r < slots; r++) {
            const float *x = lat + r * row;
            bool nonzero = false;
            for (int64_t b0 = 0; b0 < cfg->kv_lora; b0 += 128) {
                const int64_t len = cfg->kv_lora - b0 < 128 ? cfg->kv_lora - b0 : 128;
                double amax = 0;
                for (int64_t i = 0; i < len; i++) {
                    amax = fmax(amax, fabs(x[b0 + i]));
                }
                if (amax == 0) {
                    continue;
                }
                nonzero = true;
                const double s = amax / 448.0;
                for (int64_t i = 0; i < len; i++) {
                    const double q = x[b0 + i] / s;
                    bad_lat += fabs(q - fx_e4m3_nearest(q)) > 1e-5 * fabs(q) + 1e-12;
                }
            }
            for (int64_t i = 0; i < cfg->qk_rope; i++) {
                bad_pe += kr_bf16_to_f32(kr_f32_to_bf16(x[cfg->kv_lora + i])) != x[cfg->kv_lora + i];
            }
            rows += nonzero;
        }
    }
    fprintf(stderr, "  %-18s %lld written rows or K/V layers checked: %lld K/V values off the e4m3 grid, %lld latent "
                    "values off their block's grid, %lld k_pe values not bf16\n",
            name, (long long)rows, (long long)bad_kv, (long long)bad_lat, (long long)bad_pe);
    cr_expect_eq(bad_kv + bad_lat + bad_pe, 0, "%s: cached values are not what an FP8 cache holds", name);
    return rows;
}

static void run(const char *family, const char *name)
{
    struct fx f, p;
    fx_load(&f, family, name, 2, 2);
    fx_load(&p, family, name, 2, 2);
    struct kr_err err = {0};
    cr_assert_eq(kr_model_set_kv_cache_dtype(f.m, KR_KV_CACHE_FP8, &err), KR_OK, "%s", err.msg);
    const bool dsa = kr_model_config_count(&f.m->cfg, KR_LAYER_DSA) > 0;
    if (dsa) { /* the plain run with the same (FP8) indexer: only the caches differ */
        cr_assert(f.m->idx_fp8);
        cr_assert_eq(kr_model_set_indexer(p.m, KR_INDEXER_FP8, &err), KR_OK, "%s", err.msg);
    }
    const bool discrete = f.m->cfg.n_expert > 0 || dsa;
    double apart = 0;
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *pr = &f.prompts[i];
        const size_t nv = (size_t)pr->n * (size_t)f.vocab;
        float *a = kr_malloc(nv * sizeof(float)), *b = kr_malloc(nv * sizeof(float));
        double *pos = kr_calloc((size_t)pr->n, sizeof *pos);
        cr_assert(a && b && pos);
        cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, pr->ids, pr->n, 0, a, &err), KR_OK, "%s", err.msg);
        cr_assert_eq(kr_run_prompt_logprobs(p.m, p.c, pr->ids, pr->n, 0, b, &err), KR_OK, "%s", err.msg);
        for (size_t k = 0; k < nv; k++) {
            apart = fmax(apart, fabs((double)a[k] - (double)b[k]));
            pos[k / (size_t)f.vocab] += fabs((double)a[k] - (double)pr->logprobs[k]) / (double)f.vocab;
        }
        int32_t kept = pr->n;
        for (int32_t d = discrete ? pr->n / 4 : 0; d > 0; d--, kept--) {
            int32_t at = 0;
            for (int32_t t = 1; t < pr->n; t++) {
                at = pos[t] > pos[at] ? t : at;
            }
            pos[at] = -1;
        }
        double mean = 0;
        for (int32_t t = 0; t < pr->n; t++) {
            mean += pos[t] >= 0 ? pos[t] : 0;
        }
        mean /= kept;
        fprintf(stderr, "  %-18s prompt %d (len %3d): FP8 caches, mean |lp - HF| %.4f%s\n", name, i, pr->n, mean,
                discrete ? " (the worst quarter of positions left out)" : "");
        cr_expect_leq(mean, KV8_MEAN, "%s prompt %d: mean |logprob - HF| %g", name, i, mean);
        kr_free(a);
        kr_free(b);
        kr_free(pos);
    }
    fprintf(stderr, "  %-18s FP8 against plain caches: max |dlp| %.3g\n", name, apart);
    cr_expect_gt(apart, 1e-4, "%s: the FP8 caches change nothing", name);
    cr_expect_gt(check_pools(&f, name), 0, "%s: no cached row was written", name);
    fx_free(&f);
    fx_free(&p);
}

Test(kv_fp8, gqa_k_and_v)
{
    run("nemotron_h", "nh_mamba_attn_mlp");
}

Test(kv_fp8, dsa_latents_and_index_keys)
{
    run("deepseek_v32", "ds_short");
}

Test(kv_fp8, hybrid_mla_and_dsa)
{
    run("hybrid", "hy_mdme");
    run("hybrid", "hy_plus");
}

Test(kv_fp8, a_backend_without_fp8_caches_refuses)
{
    kr_backend_t be = kr_backend_plan_create(2, 2);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/nemotron_h/nh_mamba_attn_mlp", fx_root());
    struct kr_model *m = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_model_load(dir, be, &m, &err), KR_OK, "%s", err.msg);
    cr_expect_eq(kr_model_set_kv_cache_dtype(m, KR_KV_CACHE_FP8, &err), KR_ERR_UNSUPPORTED);
    cr_expect(strstr(err.msg, "--kv-cache-dtype fp8") && strstr(err.msg, "no FP8 caches"), "%s", err.msg);
    cr_expect_eq(kr_model_set_kv_cache_dtype(m, KR_KV_CACHE_BF16, &err), KR_OK);
    kr_model_free(m);
    kr_backend_free(be);
    enum kr_kv_cache_dtype d;
    cr_expect(kr_kv_cache_dtype_parse("fp8", &d) && d == KR_KV_CACHE_FP8);
    cr_expect(kr_kv_cache_dtype_parse("auto", &d) && d == KR_KV_CACHE_AUTO);
    cr_expect(!kr_kv_cache_dtype_parse("fp16", &d) && !kr_kv_cache_dtype_parse(NULL, &d));
}
