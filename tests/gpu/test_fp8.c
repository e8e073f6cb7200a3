/* FP8 block-scaled products on the GPU (kernels/gemm/fp8.cu, the experts' FP8 path, the CUDA backend
 * with --quantization fp8) against the CPU reference of the recipe (model/fp8.h).
 *
 *  - krk_fp8_quant must equal kr_fp8_act_quant bit for bit (codes, scales, dequantized values).
 *  - The products are checked against kr_fp8_gemm on the same codes and scales. Each output's error
 *    is measured against S = sum_c |a_c w_c| (the dequantized magnitudes), the scale on which
 *    rounding acts:
 *      krk_fp8_gemv (CUDA cores, fp32 sums of 16 products, scaled per block): |err| <= 2^-18 S
 *      (a few ulp of fp32 partial sums; a wrong block scale or a dropped chunk moves results by O(S));
 *      cuBLASLt's block-scaled matmul: the tensor cores add a block's 128 products with a shorter
 *      accumulator before the fp32 promotion (the reason for the recipe's per-128 promotion), so
 *      |err| <= 2^-10 S, still far below the O(S) of a wrong scale layout, which this test exists
 *      to catch (the layouts are cuBLASLt's documented ones, exercised here on the device).
 *  - The CUDA backend with FP8 weights runs the HF fixtures against the CPU reference with FP8
 *    weights: both quantize the same weights at load and every activation per block, so they differ
 *    by the bf16 caches and operands of the other ops plus the activations' codes those differences
 *    tip over; bounds below, measured values printed. */
#include "fixture.h"
#include "gpu-test.h"
#include "krk/gemm.h"
#include "krk/moe.h"

#include "alloc.h"
#include "fp8.h"
#include "runner.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define GEMV_REL 0x1p-18
#define LT_REL 0x1p-10

TestSuite(fp8_gpu, .timeout = 600);

/* A random FP8 weight: codes and scales on the host and the device. Values uniform in [-1, 1] with
 * block magnitudes varying over two decades (so that a misplaced scale shows). */
struct fw {
    int64_t rows, cols, br, bc, sr, sc;
    uint8_t *q;
    float *s;
    uint8_t *dq;
    float *ds;
};
static struct fw fw_make(struct gt_rng *r, int64_t rows, int64_t cols, int64_t br, int64_t bc)
{
    struct fw w = {.rows = rows, .cols = cols, .br = br, .bc = bc, .sr = (rows + br - 1) / br, .sc = (cols + bc - 1) / bc};
    float *v = kr_malloc((size_t)(rows * cols) * sizeof(float));
    w.q = kr_malloc((size_t)(rows * cols));
    w.s = kr_malloc((size_t)(w.sr * w.sc) * sizeof(float));
    cr_assert(v && w.q && w.s);
    gt_fill(r, v, (size_t)(rows * cols), -1.0f, 1.0f);
    for (int64_t i = 0; i < rows; i++) {
        for (int64_t c = 0; c < cols; c++) {
            const int64_t b = (i / br) * w.sc + c / bc;
            v[i * cols + c] *= 0.01f + (float)((b * 7919) % 97) / 97.0f;
        }
    }
    cr_assert_eq(kr_fp8_weight_quant(v, rows, cols, br, bc, w.q, w.s), KR_OK);
    kr_free(v);
    w.dq = gt_dup(w.q, (size_t)(rows * cols));
    w.ds = gt_dup(w.s, (size_t)(w.sr * w.sc) * sizeof(float));
    return w;
}
static void fw_free(struct fw *w)
{
    kr_free(w->q);
    kr_free(w->s);
    gt_dfree(w->dq);
    gt_dfree(w->ds);
}
static struct krk_fp8_weight fw_dev(const struct fw *w)
{
    return (struct krk_fp8_weight){.q = w->dq, .scale = w->ds, .rows = w->rows, .cols = w->cols, .ld_s = w->sc,
                                   .block_r = (int32_t)w->br, .block_c = (int32_t)w->bc};
}

/* Activations [n, cols]: rows with a few large entries, as real ones have. */
static float *act_make(struct gt_rng *r, int64_t n, int64_t cols)
{
    float *x = kr_malloc((size_t)(n * cols) * sizeof(float));
    cr_assert(x);
    gt_fill(r, x, (size_t)(n * cols), -1.0f, 1.0f);
    for (int64_t i = 0; i < n * cols; i += 37) {
        x[i] *= 20.0f;
    }
    return x;
}

/* The CPU reference: codes and scales of x per block, the product, and S per output. */
struct ref {
    uint8_t *aq;
    float *as, *y, *mag;
};
static struct ref ref_make(const float *x, int64_t n, const struct fw *w)
{
    const int64_t nkb = w->sc;
    struct ref f = {.aq = kr_malloc((size_t)(n * w->cols)), .as = kr_malloc((size_t)(n * nkb) * sizeof(float)),
                    .y = kr_malloc((size_t)(n * w->rows) * sizeof(float)),
                    .mag = kr_malloc((size_t)(n * w->rows) * sizeof(float))};
    cr_assert(f.aq && f.as && f.y && f.mag);
    for (int64_t t = 0; t < n; t++) {
        for (int64_t kb = 0; kb < nkb; kb++) {
            const int64_t c0 = kb * w->bc, len = w->cols - c0 < w->bc ? w->cols - c0 : w->bc;
            cr_assert_eq(kr_fp8_act_quant(x + t * w->cols + c0, len, len, false, f.aq + t * w->cols + c0,
                                          f.as + t * nkb + kb), KR_OK);
        }
    }
    cr_assert_eq(kr_fp8_gemm(f.aq, f.as, n, w->cols, w->q, w->s, w->rows, w->bc, w->br, f.y), KR_OK);
    for (int64_t t = 0; t < n; t++) {
        for (int64_t r = 0; r < w->rows; r++) {
            double m = 0;
            for (int64_t c = 0; c < w->cols; c++) {
                const double a = kr_fp8_e4m3_to_f32(f.aq[t * w->cols + c]) * f.as[t * nkb + c / w->bc];
                const double b = kr_fp8_e4m3_to_f32(w->q[r * w->cols + c]) * w->s[(r / w->br) * w->sc + c / w->bc];
                m += fabs(a * b);
            }
            f.mag[t * w->rows + r] = (float)m;
        }
    }
    return f;
}
static void ref_free(struct ref *f)
{
    kr_free(f->aq);
    kr_free(f->as);
    kr_free(f->y);
    kr_free(f->mag);
}

/* Largest |got - ref| / S over the outputs; asserts it is at most `rel` and that nothing is NaN. */
static double expect_rel(const char *what, const float *got, const struct ref *f, int64_t n, int64_t rows, double rel)
{
    double worst = 0;
    int64_t bad = 0;
    for (int64_t i = 0; i < n * rows; i++) {
        if (!isfinite(got[i])) {
            bad++;
            continue;
        }
        const double e = fabs((double)got[i] - (double)f->y[i]) / ((double)f->mag[i] + 1e-30);
        worst = e > worst ? e : worst;
    }
    fprintf(stderr, "  %-44s max |err| / S = %.3g (bound %.3g)%s\n", what, worst, rel, bad ? " NON-FINITE" : "");
    cr_expect_eq(bad, 0, "%s: %lld outputs not finite", what, (long long)bad);
    cr_expect_leq(worst, rel, "%s: max |err| / S = %g over %g", what, worst, rel);
    return worst;
}

/* ---- quantization ----------------------------------------------------------------------------- */

Test(fp8_gpu, quant_equals_the_cpu_bit_for_bit)
{
    GT_REQUIRE_GPU();
    struct gt_rng r = {.s = 11};
    /* a model width, a width whose last block is short, one narrower than a block, a block of 64 */
    static const int64_t shapes[][3] = {{5, 7168, 128}, {3, 300, 128}, {4, 64, 128}, {2, 320, 64}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        const int64_t n = shapes[k][0], cols = shapes[k][1], bc = shapes[k][2], nkb = (cols + bc - 1) / bc;
        const int64_t ldx = cols + 3;
        float *x = kr_malloc((size_t)(n * ldx) * sizeof(float));
        cr_assert(x);
        gt_fill(&r, x, (size_t)(n * ldx), -3.0f, 3.0f);
        x[0] = 0.0f;
        if (cols > 130) {
            for (int64_t c = 0; c < bc; c++) { /* an all-zero block: the 1e-4 floor */
                x[ldx + c] = 0.0f;
            }
        }
        uint8_t *rq = kr_malloc((size_t)(n * cols)), *gq = kr_malloc((size_t)(n * cols));
        float *rs = kr_malloc((size_t)(n * nkb) * 4), *gs = kr_malloc((size_t)(n * nkb) * 4),
              *gx = kr_malloc((size_t)(n * cols) * 4);
        cr_assert(rq && gq && rs && gs && gx);
        for (int64_t t = 0; t < n; t++) {
            for (int64_t kb = 0; kb < nkb; kb++) {
                const int64_t len = cols - kb * bc < bc ? cols - kb * bc : bc;
                cr_assert_eq(kr_fp8_act_quant(x + t * ldx + kb * bc, len, len, false, rq + t * cols + kb * bc,
                                              rs + t * nkb + kb), KR_OK);
            }
        }
        float *dx = gt_dup(x, (size_t)(n * ldx) * 4), *ds = gt_dalloc((size_t)(n * nkb) * 4),
              *dxq = gt_dalloc((size_t)(n * cols) * 4);
        uint8_t *dq = gt_dalloc((size_t)(n * cols));
        const struct krk_fp8_quant_params p = {.x = dx, .ldx = ldx, .n = n, .cols = cols, .block = bc, .q = dq,
                                               .ldq = cols, .scale = ds, .s_ld = n, .xq = dxq, .ldxq = cols};
        cr_assert_eq(krk_fp8_quant(&p, NULL), KR_OK);
        gt_sync();
        gt_down(gq, dq, (size_t)(n * cols));
        gt_down(gs, ds, (size_t)(n * nkb) * 4);
        gt_down(gx, dxq, (size_t)(n * cols) * 4);
        int64_t dq_codes = 0, dq_scales = 0, dq_vals = 0;
        for (int64_t t = 0; t < n; t++) {
            for (int64_t c = 0; c < cols; c++) {
                const float want = kr_fp8_e4m3_to_f32(rq[t * cols + c]) * rs[t * nkb + c / bc];
                dq_codes += gq[t * cols + c] != rq[t * cols + c];
                dq_vals += memcmp(&gx[t * cols + c], &want, 4) != 0;
            }
            for (int64_t kb = 0; kb < nkb; kb++) { /* block-major on the device */
                dq_scales += memcmp(&gs[kb * n + t], &rs[t * nkb + kb], 4) != 0;
            }
        }
        fprintf(stderr, "  quant n %lld cols %lld block %lld: %lld codes, %lld scales, %lld values differ\n",
                (long long)n, (long long)cols, (long long)bc, (long long)dq_codes, (long long)dq_scales,
                (long long)dq_vals);
        cr_expect_eq(dq_codes + dq_scales + dq_vals, 0, "cols %lld: the GPU's quantization differs from the CPU's",
                     (long long)cols);
        gt_dfree(dx);
        gt_dfree(ds);
        gt_dfree(dxq);
        gt_dfree(dq);
        kr_free(x);
        kr_free(rq);
        kr_free(gq);
        kr_free(rs);
        kr_free(gs);
        kr_free(gx);
    }
}

/* ---- products --------------------------------------------------------------------------------- */

struct pshape {
    int64_t rows, cols, br, bc;
};
/* a square projection, an MLP down projection, a DeepSeek-V3.2 q_b (rows not a multiple of the
 * tile), ragged small ones (a short last block; cols not a multiple of 16: the code-at-a-time kernel) */
static const struct pshape pshapes[] = {{4096, 4096, 128, 128}, {4096, 21504, 128, 128}, {24576, 1536, 128, 128},
                                        {300, 400, 128, 128},   {100, 200, 128, 128},    {96, 136, 64, 64}};
#define N_PSHAPES ((int)(sizeof pshapes / sizeof pshapes[0]))
static int pshape_idx[N_PSHAPES] = {0, 1, 2, 3, 4, 5};

/* xq on the device for the gemv (dequantized values, ldx = cols rounded to 4) */
static float *dev_xq(const float *x, int64_t n, int64_t cols, int64_t bc, int64_t *ldx)
{
    *ldx = (cols + 3) / 4 * 4;
    float *dx = gt_dup(x, (size_t)(n * cols) * 4), *xq = gt_dalloc((size_t)(n * *ldx) * 4);
    const struct krk_fp8_quant_params p = {.x = dx, .ldx = cols, .n = n, .cols = cols, .block = bc, .xq = xq,
                                           .ldxq = *ldx};
    cr_assert_eq(krk_fp8_quant(&p, NULL), KR_OK);
    gt_sync();
    gt_dfree(dx);
    return xq;
}

ParameterizedTestParameters(fp8_gpu, gemv_matches_cpu)
{
    return cr_make_param_array(int, pshape_idx, N_PSHAPES);
}
ParameterizedTest(int *idx, fp8_gpu, gemv_matches_cpu)
{
    GT_REQUIRE_GPU();
    const struct pshape *s = &pshapes[*idx];
    struct gt_rng r = {.s = 100 + (uint64_t)*idx};
    struct fw w = fw_make(&r, s->rows, s->cols, s->br, s->bc);
    static const int64_t ns[] = {1, 2, 3, 4, 5, 8};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        const int64_t n = ns[k];
        if (s->rows * s->cols > 50000000 && n > 4) {
            continue; /* the CPU reference's time */
        }
        float *x = act_make(&r, n, s->cols);
        struct ref f = ref_make(x, n, &w);
        int64_t ldx;
        float *xq = dev_xq(x, n, s->cols, s->bc, &ldx);
        float *dy = gt_dalloc((size_t)(n * (s->rows + 1)) * 4), *y = kr_malloc((size_t)(n * (s->rows + 1)) * 4),
              *yc = kr_malloc((size_t)(n * s->rows) * 4);
        cr_assert(y && yc);
        for (int any = 0; any < 2; any++) {
            const struct krk_fp8_gemv_params p = {.xq = xq, .ldx = ldx, .n = n, .w = fw_dev(&w), .y = dy,
                                                  .ldy = s->rows + 1, .any_kernel = any};
            cr_assert_eq(krk_fp8_gemv(&p, NULL), KR_OK);
            gt_sync();
            gt_down(y, dy, (size_t)(n * (s->rows + 1)) * 4);
            for (int64_t t = 0; t < n; t++) {
                memcpy(yc + t * s->rows, y + t * (s->rows + 1), (size_t)s->rows * 4);
            }
            char what[128];
            snprintf(what, sizeof what, "gemv%s %lldx%lld n=%lld", any ? " (any)" : "", (long long)s->rows,
                     (long long)s->cols, (long long)n);
            expect_rel(what, yc, &f, n, s->rows, GEMV_REL);
        }
        gt_dfree(dy);
        gt_dfree(xq);
        kr_free(y);
        kr_free(yc);
        kr_free(x);
        ref_free(&f);
    }
    fw_free(&w);
}

/* cuBLASLt's block-scaled matmul takes 128 x 128 blocks with rows and cols multiples of 16. */
ParameterizedTestParameters(fp8_gpu, cublaslt_matches_cpu)
{
    static int lt_idx[] = {0, 2, 3};
    return cr_make_param_array(int, lt_idx, sizeof lt_idx / sizeof lt_idx[0]);
}
ParameterizedTest(int *idx, fp8_gpu, cublaslt_matches_cpu)
{
    GT_REQUIRE_GPU();
    const struct pshape *s = &pshapes[*idx];
    struct gt_rng r = {.s = 200 + (uint64_t)*idx};
    struct fw w = fw_make(&r, s->rows, s->cols, s->br, s->bc);
    void *ws = gt_dalloc((size_t)32 << 20);
    struct krk_fp8_lt *lt = krk_fp8_lt_create(ws, (size_t)32 << 20);
    cr_assert(lt);
    static const int64_t ns[] = {5, 16, 64, 200};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        const int64_t n = ns[k];
        if (s->rows * s->cols * n > 4000000000LL) {
            continue; /* the CPU reference's time */
        }
        float *x = act_make(&r, n, s->cols);
        struct ref f = ref_make(x, n, &w);
        const int64_t ldq = (s->cols + 15) / 16 * 16, nkb = w.sc;
        float *dx = gt_dup(x, (size_t)(n * s->cols) * 4), *ds = gt_dalloc((size_t)(n * nkb) * 4),
              *dy = gt_dalloc((size_t)(n * s->rows) * 4), *y = kr_malloc((size_t)(n * s->rows) * 4);
        uint8_t *dq = gt_dalloc((size_t)(n * ldq));
        cr_assert(y);
        const struct krk_fp8_quant_params qp = {.x = dx, .ldx = s->cols, .n = n, .cols = s->cols, .block = 128,
                                                .q = dq, .ldq = ldq, .scale = ds, .s_ld = n};
        cr_assert_eq(krk_fp8_quant(&qp, NULL), KR_OK);
        const struct krk_fp8_lt_params lp = {.q = dq, .ldq = ldq, .scale = ds, .n = n, .w = fw_dev(&w), .y = dy,
                                             .ldy = s->rows};
        const enum kr_status st = krk_fp8_gemm_lt(lt, &lp, NULL);
        cr_assert_eq(st, KR_OK, "%lldx%lld n=%lld: cuBLASLt's block-scaled FP8 matmul is not available (status %d)",
                     (long long)s->rows, (long long)s->cols, (long long)n, (int)st);
        gt_sync();
        gt_down(y, dy, (size_t)(n * s->rows) * 4);
        char what[128];
        snprintf(what, sizeof what, "cuBLASLt %lldx%lld n=%lld", (long long)s->rows, (long long)s->cols, (long long)n);
        expect_rel(what, y, &f, n, s->rows, LT_REL);
        gt_dfree(dx);
        gt_dfree(ds);
        gt_dfree(dy);
        gt_dfree(dq);
        kr_free(y);
        kr_free(x);
        ref_free(&f);
    }
    krk_fp8_lt_free(lt);
    gt_dfree(ws);
    fw_free(&w);
}

/* ---- the CUDA backend end to end -------------------------------------------------------------- */

/* Products through kr_backend_matmul on both backends, every row count path (gemv, cuBLASLt) */
Test(fp8_gpu, backend_matmul_matches_cpu)
{
    GT_REQUIRE_GPU();
    kr_backend_t gpu = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_backend_cuda_create(0, false, &gpu, &err), KR_OK, "%s", err.msg);
    struct gt_rng r = {.s = 300};
    const int64_t rows = 2048, cols = 4096;
    struct fw w = fw_make(&r, rows, cols, 128, 128);
    const struct kr_tensor t = {.data = w.dq, .dtype = KR_DTYPE_F8_E4M3, .rows = rows, .cols = cols, .scale = w.ds,
                                .block_r = 128, .block_c = 128};
    float *bias = kr_malloc((size_t)rows * 4);
    cr_assert(bias);
    gt_fill(&r, bias, (size_t)rows, -1.0f, 1.0f);
    float *dbias = gt_dup(bias, (size_t)rows * 4);
    static const int64_t ns[] = {1, 4, 5, 33};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        const int64_t n = ns[k];
        float *x = act_make(&r, n, cols);
        struct ref f = ref_make(x, n, &w);
        for (int64_t i = 0; i < n * rows; i++) {
            f.y[i] += bias[i % rows];
            f.mag[i] += fabsf(bias[i % rows]);
        }
        float *dx = gt_dup(x, (size_t)(n * cols) * 4), *dy = gt_dalloc((size_t)(n * rows) * 4),
              *y = kr_malloc((size_t)(n * rows) * 4);
        cr_assert_eq(kr_backend_matmul(gpu, dx, cols, n, &t, dbias, dy, rows, NULL), KR_OK);
        gt_sync();
        gt_down(y, dy, (size_t)(n * rows) * 4);
        char what[96];
        snprintf(what, sizeof what, "backend matmul %lldx%lld n=%lld", (long long)rows, (long long)cols, (long long)n);
        expect_rel(what, y, &f, n, rows, n > 4 ? LT_REL : GEMV_REL);
        gt_dfree(dx);
        gt_dfree(dy);
        kr_free(y);
        kr_free(x);
        ref_free(&f);
    }
    gt_dfree(dbias);
    kr_free(bias);
    fw_free(&w);
    kr_backend_free(gpu);
}

/* The experts' FP8 path against the CPU backend's experts with the same FP8 weights. */
Test(fp8_gpu, experts_match_cpu)
{
    GT_REQUIRE_GPU();
    kr_backend_t gpu = NULL, cpu = kr_backend_cpu_create(2);
    struct kr_err err = {0};
    cr_assert_eq(kr_backend_cuda_create(0, false, &gpu, &err), KR_OK, "%s", err.msg);
    struct gt_rng r = {.s = 400};
    enum { E = 8, K = 3 };
    enum { n = 6 };
    const int64_t d_in = 512, d_ffn = 384;
    struct fw g[E], u[E], d[E];
    struct kr_tensor tg[E], tu[E], td[E], cg[E], cu[E], cd[E];
    for (int e = 0; e < E; e++) {
        g[e] = fw_make(&r, d_ffn, d_in, 128, 128);
        u[e] = fw_make(&r, d_ffn, d_in, 128, 128);
        d[e] = fw_make(&r, d_in, d_ffn, 128, 128);
#define T(dst, src, dev)                                                                           \
    dst = (struct kr_tensor){.data = dev ? (const void *)src.dq : (const void *)src.q, .dtype = KR_DTYPE_F8_E4M3,  \
                             .rows = src.rows, .cols = src.cols, .scale = dev ? src.ds : src.s, .block_r = 128, \
                             .block_c = 128}
        T(tg[e], g[e], 1);
        T(tu[e], u[e], 1);
        T(td[e], d[e], 1);
        T(cg[e], g[e], 0);
        T(cu[e], u[e], 0);
        T(cd[e], d[e], 0);
#undef T
    }
    float *x = act_make(&r, n, d_in), wts[n * K];
    int32_t ids[n * K];
    for (int i = 0; i < n * K; i++) {
        ids[i] = (int32_t)((i * 5 + i / K) % E);
        wts[i] = 0.2f + 0.1f * (float)(i % 4);
    }
    float *ref = kr_malloc((size_t)(n * d_in) * 4), *got = kr_malloc((size_t)(n * d_in) * 4);
    cr_assert(ref && got);
    const struct krk_experts_params cp = {.x = x, .n = n, .d_in = d_in, .d_ffn = d_ffn, .d_out = d_in, .n_expert = E,
                                          .n_used = K, .ids = ids, .weights = wts, .act = KR_ACT_SILU, .out = ref};
    const struct kr_expert_weights cw = {.gate = cg, .up = cu, .down = cd};
    cr_assert_eq(kr_backend_moe_experts(cpu, &cp, &cw), KR_OK);
    struct krk_experts_params gp = cp;
    gp.x = gt_dup(x, (size_t)(n * d_in) * 4);
    gp.ids = gt_dup(ids, sizeof ids);
    gp.weights = gt_dup(wts, sizeof wts);
    gp.out = gt_dalloc((size_t)(n * d_in) * 4);
    const struct kr_expert_weights gw = {.gate = tg, .up = tu, .down = td};
    cr_assert_eq(kr_backend_moe_experts(gpu, &gp, &gw), KR_OK);
    gt_sync();
    gt_down(got, gp.out, (size_t)(n * d_in) * 4);
    /* the hidden rows are quantized after an fp32 activation on each side: a code may round the other
     * way where the two sides' hidden values straddle a rounding boundary (rare), so the bound is on
     * the error relative to the output's magnitude */
    double scale = 0;
    for (int64_t i = 0; i < n * d_in; i++) {
        scale = fmax(scale, fabs(ref[i]));
    }
    gt_expect_close("FP8 experts GPU vs CPU", got, ref, (size_t)(n * d_in), 1e-6, 1e-3 * scale);
    gt_dfree((void *)gp.x);
    gt_dfree((void *)gp.ids);
    gt_dfree((void *)gp.weights);
    gt_dfree(gp.out);
    for (int e = 0; e < E; e++) {
        fw_free(&g[e]);
        fw_free(&u[e]);
        fw_free(&d[e]);
    }
    kr_free(x);
    kr_free(ref);
    kr_free(got);
    kr_backend_free(gpu);
    kr_backend_free(cpu);
}

/* Whole models: the fixtures with FP8 weights on the GPU against the CPU reference with FP8 weights.
 * Bounds (mean and, after a quarter of flips where routing or selection is discrete, max |lp|
 * difference): FP8_GPU_MEAN, FP8_GPU_MAX. */
#define FP8_GPU_MEAN 0.05
#define FP8_GPU_MAX 0.6

static int model_idx[] = {0, 1, 6, 7, 8}; /* nh_mamba_attn_mlp, nh_moe, ds_fp8 (kept in FP8), ds_short, hy_mdme */
ParameterizedTestParameters(fp8_gpu, models_match_the_cpu_fp8_path)
{
    return cr_make_param_array(int, model_idx, sizeof model_idx / sizeof model_idx[0]);
}
ParameterizedTest(int *idx, fp8_gpu, models_match_the_cpu_fp8_path)
{
    GT_REQUIRE_GPU();
    struct kr_err err = {0};
    kr_backend_t gbe = NULL, cbe = kr_backend_cpu_create(2);
    cr_assert_eq(kr_backend_cuda_create(0, true, &gbe, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(kr_backend_set_fp8_weights(gbe, true, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(kr_backend_set_fp8_weights(cbe, true, &err), KR_OK, "%s", err.msg);
    struct fx g, c;
    fx_load_on(&g, fx_all[*idx].family, fx_all[*idx].name, gbe, 2);
    fx_load_on(&c, fx_all[*idx].family, fx_all[*idx].name, cbe, 2);
    const bool discrete = g.m->cfg.n_expert > 0 || strchr(g.m->cfg.pattern, 'D') != NULL;
    for (int32_t i = 0; i < g.n_prompts; i++) {
        struct fx_prompt *p = &g.prompts[i];
        const size_t nv = (size_t)p->n * (size_t)g.vocab;
        float *lg = kr_malloc(nv * 4), *lc = kr_malloc(nv * 4);
        cr_assert(lg && lc);
        cr_assert_eq(kr_run_prompt_logprobs(g.m, g.c, p->ids, p->n, 0, lg, &err), KR_OK, "%s", err.msg);
        cr_assert_eq(kr_run_prompt_logprobs(c.m, c.c, p->ids, p->n, 0, lc, &err), KR_OK, "%s", err.msg);
        double sum = 0, *worst = kr_calloc((size_t)p->n, sizeof *worst);
        cr_assert(worst);
        for (int32_t t = 0; t < p->n; t++) {
            for (int64_t v = 0; v < g.vocab; v++) {
                const size_t k = (size_t)t * (size_t)g.vocab + (size_t)v;
                const double dd = isfinite(lg[k]) ? fabs((double)lg[k] - (double)lc[k]) : INFINITY;
                sum += dd;
                worst[t] = dd > worst[t] ? dd : worst[t];
            }
        }
        for (int32_t k = 0; discrete && k < (p->n / 4 > 1 ? p->n / 4 : 1); k++) {
            int32_t at = 0;
            for (int32_t t = 1; t < p->n; t++) {
                at = worst[t] > worst[at] ? t : at;
            }
            worst[at] = 0;
        }
        double mx = 0;
        for (int32_t t = 0; t < p->n; t++) {
            mx = worst[t] > mx ? worst[t] : mx;
        }
        const double mean = sum / (double)nv;
        fprintf(stderr, "  %-18s prompt %d (len %d): FP8 GPU vs FP8 CPU mean |dlp| %.4f, max %.3f%s\n",
                fx_all[*idx].name, i, p->n, mean, mx, discrete ? " (after a quarter of flips)" : "");
        cr_expect_leq(mean, FP8_GPU_MEAN, "%s prompt %d: mean %g", fx_all[*idx].name, i, mean);
        cr_expect_leq(mx, FP8_GPU_MAX, "%s prompt %d: max %g", fx_all[*idx].name, i, mx);
        kr_free(worst);
        kr_free(lg);
        kr_free(lc);
    }
    fx_free(&g);
    fx_free(&c);
}
