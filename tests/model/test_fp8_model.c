/* FP8 weights end to end on the CPU reference (kr_backend_set_fp8_weights): the HF fixtures run with
 * their matrices kept as FP8 (the FP8 checkpoint) or quantized to it at load (the bf16 ones), every
 * product quantizing its activations per block (model/fp8.h).
 *  - The kept matrices are the checkpoint's exactly: with inputs that the activations' quantization
 *    keeps (equal magnitudes in a block), every FP8 matrix's product equals the product with the plain
 *    load's dequantized matrix to fp32 rounding (1e-5 of the magnitudes).
 *  - Against HF's reference log-probabilities (HF computes with the dequantized weights and
 *    unquantized activations) the recipe's own error shows: these random 64-wide models quantize a
 *    whole activation row with one scale, so small entries lose most of their bits. Measured
 *    (2026-12-03): mean |logprob - HF| over the vocabulary 0.09-0.63 for the FP8 checkpoint (0 to
 *    1e-5 on its first prompts with the activations left unquantized), 0.11-0.46 for the bf16
 *    fixtures quantized at load. Held to FP8_MEAN = 0.8 (a product wired wrongly, a transposed scale
 *    or the wrong block of it, is caught by the exact check above; this bound guards the whole path).
 *  - A tensor-parallel share that cuts a 128 x 128 block is refused at load with a message; a backend
 *    without the FP8 product refuses the setting. */
#include "fixture.h"

#include "alloc.h"
#include "comm.h"
#include "runner.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define FP8_MEAN 0.8

TestSuite(fp8_model, .timeout = 300);

/* Mean and largest |lp - ref| over the prompt's positions, the largest after leaving out the
 * worst quarter of positions (flips) when `discrete`. */
static void compare(const float *lp, const float *ref, int32_t n, int64_t V, bool discrete, double *mean,
                    double *max_kept)
{
    double *worst = kr_calloc((size_t)n, sizeof *worst);
    cr_assert(worst);
    double sum = 0;
    for (int32_t t = 0; t < n; t++) {
        for (int64_t v = 0; v < V; v++) {
            const double d = fabs((double)lp[(size_t)t * (size_t)V + (size_t)v] - (double)ref[(size_t)t * (size_t)V + (size_t)v]);
            sum += d;
            worst[t] = d > worst[t] ? d : worst[t];
        }
    }
    *mean = sum / ((double)n * (double)V);
    /* drop the allowed flips: the largest n/4 positions when discrete */
    int32_t drop = discrete ? (n / 4 > 1 ? n / 4 : 1) : 0;
    for (int32_t k = 0; k < drop; k++) {
        int32_t at = 0;
        for (int32_t t = 1; t < n; t++) {
            at = worst[t] > worst[at] ? t : at;
        }
        worst[at] = 0;
    }
    *max_kept = 0;
    for (int32_t t = 0; t < n; t++) {
        *max_kept = worst[t] > *max_kept ? worst[t] : *max_kept;
    }
    kr_free(worst);
}

static void run_fixture(const char *family, const char *name, bool fp8, double mean_bound, double max_bound)
{
    kr_backend_t be = kr_backend_cpu_create(2);
    struct kr_err err = {0};
    cr_assert_eq(kr_backend_set_fp8_weights(be, fp8, &err), KR_OK, "%s", err.msg);
    struct fx f;
    fx_load_on(&f, family, name, be, 2);
    const bool discrete = f.m->cfg.n_expert > 0 || strchr(f.m->cfg.pattern, 'D') != NULL;
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        float *lp = kr_malloc((size_t)p->n * (size_t)f.vocab * sizeof(float));
        cr_assert(lp);
        cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, 0, lp, &err), KR_OK, "%s", err.msg);
        double mean, max_kept;
        compare(lp, p->logprobs, p->n, f.vocab, discrete, &mean, &max_kept);
        fprintf(stderr, "  %-18s %s prompt %d (len %d): mean |lp - HF| %.4f, max %.3f%s\n", name,
                fp8 ? "FP8" : "plain", i, p->n, mean, max_kept, discrete ? " (after a quarter of flips)" : "");
        cr_expect_leq(mean, mean_bound, "%s prompt %d: mean |logprob - HF| %g", name, i, mean);
        if (max_bound > 0) {
            cr_expect_leq(max_kept, max_bound, "%s prompt %d: max |logprob - HF| %g", name, i, max_kept);
        }
        kr_free(lp);
    }
    fx_free(&f);
}

/* The FP8 checkpoint: its matrices kept as FP8 (codes and block scales as stored). */
Test(fp8_model, an_fp8_checkpoint_kept_in_fp8_tracks_hf)
{
    run_fixture("deepseek_v32", "ds_fp8", true, FP8_MEAN, 0);
}

/* bf16 checkpoints quantized at load, one per family. */
Test(fp8_model, bf16_checkpoints_quantized_at_load_track_hf)
{
    run_fixture("nemotron_h", "nh_mamba_attn_mlp", true, FP8_MEAN, 0);
    run_fixture("nemotron_h", "nh_moe", true, FP8_MEAN, 0);
    run_fixture("deepseek_v32", "ds_short", true, FP8_MEAN, 0);
    run_fixture("hybrid", "hy_mdme", true, FP8_MEAN, 0);
}

/* A tensor-parallel share must consist of whole blocks: the fixtures' 64-wide matrices split in two
 * cut their one 128 x 128 block. */
Test(fp8_model, a_share_that_cuts_a_block_is_refused)
{
    struct kr_host_comm *comm = NULL;
    cr_assert_eq(kr_host_comm_create(2, &comm), KR_OK);
    kr_backend_t be = kr_backend_cpu_create(1);
    struct kr_err err = {0};
    cr_assert_eq(kr_backend_set_tp(be, 0, 2, comm, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(kr_backend_set_fp8_weights(be, true, &err), KR_OK, "%s", err.msg);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/hybrid/hy_mdme", fx_root());
    struct kr_model *m = NULL;
    cr_expect_eq(kr_model_load(dir, be, &m, &err), KR_ERR_UNSUPPORTED);
    cr_expect(strstr(err.msg, "cuts a block") != NULL, "the message: %s", err.msg);
    kr_model_free(m);
    kr_backend_free(be);
    kr_host_comm_free(comm);
}

/* The backends without an FP8 product refuse the setting with a message (the planning backend has none). */
Test(fp8_model, a_backend_without_the_fp8_product_refuses)
{
    kr_backend_t be = kr_backend_plan_create(2, 2);
    struct kr_err err = {0};
    cr_expect_eq(kr_backend_set_fp8_weights(be, true, &err), KR_ERR_UNSUPPORTED);
    cr_expect(strstr(err.msg, "no FP8 product") != NULL, "%s", err.msg);
    kr_backend_free(be);
}

/* The FP8 matrices as stored: with inputs of equal magnitude in every block (random signs), the
 * activations' quantization is exact but for the last bit of the scale, so the FP8 product equals
 * the product with the plain load's dequantized matrix to fp32 rounding. Checked on every MLA and
 * indexer matrix and every expert of the FP8 checkpoint: codes, block scales and the product's
 * wiring, independently of the recipe's rounding of real activations. */
static void expect_same_product(kr_backend_t fbe, kr_backend_t pbe, const struct kr_tensor *wf,
                                const struct kr_tensor *wp, const char *what, int *checked)
{
    if (!wf->data || wf->dtype != KR_DTYPE_F8_E4M3) {
        return;
    }
    cr_assert_eq(wp->rows, wf->rows);
    cr_assert_eq(wp->cols, wf->cols);
    const int64_t n = 3, R = wf->rows, C = wf->cols;
    float *x = kr_malloc((size_t)(n * C) * sizeof(float)), *yf = kr_malloc((size_t)(n * R) * sizeof(float)),
          *yp = kr_malloc((size_t)(n * R) * sizeof(float));
    cr_assert(x && yf && yp);
    uint64_t s = 12345u + (uint64_t)R * 7u + (uint64_t)C;
    for (int64_t i = 0; i < n * C; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (s >> 63) ? 0.75f : -0.75f;
    }
    cr_assert_eq(kr_backend_matmul(fbe, x, C, n, wf, NULL, yf, R, NULL), KR_OK);
    cr_assert_eq(kr_backend_matmul(pbe, x, C, n, wp, NULL, yp, R, NULL), KR_OK);
    int bad = 0;
    for (int64_t t = 0; t < n; t++) {
        for (int64_t r = 0; r < R; r++) {
            double mag = 0;
            const float *wr = (const float *)wp->data + r * C; /* the plain CPU load holds fp32 */
            for (int64_t k = 0; k < C; k++) {
                mag += fabs((double)wr[k] * 0.75);
            }
            bad += fabs((double)yf[t * R + r] - (double)yp[t * R + r]) > 1e-5 * mag + 1e-30;
        }
    }
    cr_expect_eq(bad, 0, "%s [%lld, %lld]: %d outputs differ from the dequantized product", what, (long long)R,
                 (long long)C, bad);
    (*checked)++;
    kr_free(x);
    kr_free(yf);
    kr_free(yp);
}

/* DeepSeek's linear() quantizes every FP8 product's activations with the checkpoint's scale_fmt:
 * ds_fp8 says "ue8m0", so its kept matrices carry power-of-two activation scales (the product's
 * arithmetic is test_fp8.c's backend_matmul_quantizes_activations_as_the_weight_says); a bf16
 * checkpoint quantized at load (ds_short, no quantization_config) keeps amax / 448. */
Test(fp8_model, the_checkpoints_scale_fmt_reaches_the_products)
{
    const char *names[2] = {"ds_fp8", "ds_short"};
    for (int k = 0; k < 2; k++) {
        char dir[512];
        snprintf(dir, sizeof dir, "%s/deepseek_v32/%s", fx_root(), names[k]);
        kr_backend_t be = kr_backend_cpu_create(1);
        struct kr_err err = {0};
        cr_assert_eq(kr_backend_set_fp8_weights(be, true, &err), KR_OK, "%s", err.msg);
        struct kr_model *m = NULL;
        cr_assert_eq(kr_model_load(dir, be, &m, &err), KR_OK, "%s", err.msg);
        int kept = 0, ue = 0;
        for (int32_t i = 0; i < m->cfg.n_layer; i++) {
            const struct kr_tensor *ts[] = {&m->layers[i].mla.q_a, &m->layers[i].mla.o, &m->layers[i].mlp.up,
                                            m->layers[i].moe.up ? &m->layers[i].moe.up[0] : NULL};
            for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) {
                if (ts[j] && ts[j]->data && ts[j]->dtype == KR_DTYPE_F8_E4M3) {
                    kept++;
                    ue += ts[j]->act_ue8m0;
                }
            }
        }
        cr_expect_gt(kept, 4, "%s: %d FP8 matrices kept", names[k], kept);
        cr_expect_eq(ue, k == 0 ? kept : 0, "%s: %d of %d kept matrices with ue8m0 activation scales", names[k], ue,
                     kept);
        kr_model_free(m);
        kr_backend_free(be);
    }
}

Test(fp8_model, the_kept_fp8_matrices_equal_the_dequantized_ones)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s/deepseek_v32/ds_fp8", fx_root());
    kr_backend_t fbe = kr_backend_cpu_create(1), pbe = kr_backend_cpu_create(1);
    struct kr_err err = {0};
    cr_assert_eq(kr_backend_set_fp8_weights(fbe, true, &err), KR_OK, "%s", err.msg);
    struct kr_model *mf = NULL, *mp = NULL;
    cr_assert_eq(kr_model_load(dir, fbe, &mf, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(kr_model_load(dir, pbe, &mp, &err), KR_OK, "%s", err.msg);
    int checked = 0;
    for (int32_t i = 0; i < mf->cfg.n_layer; i++) {
        const struct kr_mla_w *a = &mf->layers[i].mla, *b = &mp->layers[i].mla;
        expect_same_product(fbe, pbe, &a->q_a, &b->q_a, "q_a", &checked);
        expect_same_product(fbe, pbe, &a->q_b, &b->q_b, "q_b", &checked);
        expect_same_product(fbe, pbe, &a->kv_a, &b->kv_a, "kv_a", &checked);
        expect_same_product(fbe, pbe, &a->o, &b->o, "o", &checked);
        expect_same_product(fbe, pbe, &a->idx_wq_b, &b->idx_wq_b, "indexer wq_b", &checked);
        expect_same_product(fbe, pbe, &a->idx_wk, &b->idx_wk, "indexer wk", &checked);
        const struct kr_moe_w *e = &mf->layers[i].moe, *g = &mp->layers[i].moe;
        for (int64_t x = 0; e->up && x < mf->cfg.n_expert; x++) {
            expect_same_product(fbe, pbe, &e->up[x], &g->up[x], "expert up", &checked);
            expect_same_product(fbe, pbe, &e->down[x], &g->down[x], "expert down", &checked);
            if (e->gate) {
                expect_same_product(fbe, pbe, &e->gate[x], &g->gate[x], "expert gate", &checked);
            }
        }
        expect_same_product(fbe, pbe, &mf->layers[i].mlp.up, &mp->layers[i].mlp.up, "mlp up", &checked);
        expect_same_product(fbe, pbe, &mf->layers[i].mlp.down, &mp->layers[i].mlp.down, "mlp down", &checked);
    }
    fprintf(stderr, "  ds_fp8: %d FP8 matrices checked\n", checked);
    cr_expect_gt(checked, 10, "the checkpoint's FP8 matrices were kept as FP8");
    kr_model_free(mf);
    kr_model_free(mp);
    kr_backend_free(fbe);
    kr_backend_free(pbe);
}
