/* FP8 block-scaled products on the GPU (kernels/gemm/fp8.cu, the experts' FP8 path, the CUDA backend
 * with --quantization fp8) against the CPU reference of the recipe (model/fp8.h).
 *
 *  - krk_fp8_quant must equal kr_fp8_act_quant bit for bit (codes, scales, dequantized values).
 *  - The products are checked against kr_fp8_gemm on the same codes and scales. Each output's error
 *    is measured against S = sum_c |a_c w_c| (the dequantized magnitudes), the scale on which
 *    rounding acts:
 *      krk_fp8_gemv (CUDA cores, fp32 sums of 16 products, scaled per block): |err| <= 2^-18 S
 *      (a few ulp of fp32 partial sums; a wrong block scale or a dropped chunk moves results by O(S));
 *      the tensor-core kernels (krk_fp8_skinny's mma.sync, cuBLASLt's block-scaled matmul): the
 *      tensor cores may add a block's 128 products with a shorter accumulator before the fp32
 *      promotion (the reason for the recipe's per-128 promotion), so |err| <= 2^-10 S, still far
 *      below the O(S) of a wrong scale layout or fragment mapping, which these tests exist to catch.
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
    bool ue8m0; /* the activations' scales as powers of two (the matrix's act_ue8m0) */
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
            cr_assert_eq(kr_fp8_act_quant(x + t * w->cols + c0, len, len, w->ue8m0, f.aq + t * w->cols + c0,
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

/* Whether the CPU reference of a product of n rows is quick enough for the suite (it is plain fp64
 * loops): every shape runs with one row, large ones with fewer rows. */
static bool affordable(int64_t rows, int64_t cols, int64_t n)
{
    return n == 1 || rows * cols * n <= 300000000LL;
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
    const size_t n_shapes = sizeof shapes / sizeof shapes[0];
    for (size_t kk = 0; kk < 2 * n_shapes; kk++) { /* amax / 448 scales, then power-of-two (ue8m0) ones */
        const size_t k = kk % n_shapes;
        const bool ue = kk >= n_shapes;
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
                cr_assert_eq(kr_fp8_act_quant(x + t * ldx + kb * bc, len, len, ue, rq + t * cols + kb * bc,
                                              rs + t * nkb + kb), KR_OK);
            }
        }
        float *dx = gt_dup(x, (size_t)(n * ldx) * 4), *ds = gt_dalloc((size_t)(n * nkb) * 4),
              *dxq = gt_dalloc((size_t)(n * cols) * 4);
        uint8_t *dq = gt_dalloc((size_t)(n * cols));
        const struct krk_fp8_quant_params p = {.x = dx, .ldx = ldx, .n = n, .cols = cols, .block = bc, .q = dq,
                                               .ldq = cols, .scale = ds, .s_ld = n, .xq = dxq, .ldxq = cols,
                                               .ue8m0 = ue};
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
        fprintf(stderr, "  quant n %lld cols %lld block %lld%s: %lld codes, %lld scales, %lld values differ\n",
                (long long)n, (long long)cols, (long long)bc, ue ? " ue8m0" : "", (long long)dq_codes,
                (long long)dq_scales, (long long)dq_vals);
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
static const struct pshape pshapes[] = {{4096, 4096, 128, 128}, {1024, 21504, 128, 128}, {24576, 1536, 128, 128},
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
        if (!affordable(s->rows, s->cols, n)) {
            continue;
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

/* cuBLASLt's block-scaled matmul takes 128 x 128 blocks with rows and cols multiples of 16 (a short
 * last block of columns included: 400 = 3 x 128 + 16). */
static const struct pshape ltshapes[] = {{4096, 4096, 128, 128}, {24576, 1536, 128, 128}, {256, 400, 128, 128}};
ParameterizedTestParameters(fp8_gpu, cublaslt_matches_cpu)
{
    static int lt_idx[] = {0, 1, 2};
    return cr_make_param_array(int, lt_idx, sizeof lt_idx / sizeof lt_idx[0]);
}
ParameterizedTest(int *idx, fp8_gpu, cublaslt_matches_cpu)
{
    GT_REQUIRE_GPU();
    const struct pshape *s = &ltshapes[*idx];
    struct gt_rng r = {.s = 200 + (uint64_t)*idx};
    struct fw w = fw_make(&r, s->rows, s->cols, s->br, s->bc);
    void *ws = gt_dalloc((size_t)32 << 20);
    struct krk_fp8_lt *lt = krk_fp8_lt_create(ws, (size_t)32 << 20);
    cr_assert(lt);
    static const int64_t ns[] = {4, 16, 64, 200}; /* cuBLASLt takes multiples of 4 (krk_fp8_lt_takes) */
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        const int64_t n = ns[k];
        if (!affordable(s->rows, s->cols, n)) {
            continue;
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
        const struct krk_fp8_mm_params lp = {.q = dq, .ldq = ldq, .scale = ds, .s_ld = n, .n = n, .w = fw_dev(&w),
                                             .y = dy, .ldy = s->rows};
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

/* The tensor-core skinny kernel: weights in 128-column blocks; 1..70 rows of x (one and two n8 tiles
 * per pass, more than 16 rows in passes of 16), rows of the weight not a multiple of the 16-row tile. */
static const struct pshape skshapes[] = {{2048, 4096, 128, 128}, {1024, 21504, 128, 128}, {24576, 1536, 128, 128},
                                         {300, 384, 128, 128}};
ParameterizedTestParameters(fp8_gpu, skinny_matches_cpu)
{
    static int sk_idx[] = {0, 1, 2, 3};
    return cr_make_param_array(int, sk_idx, sizeof sk_idx / sizeof sk_idx[0]);
}
ParameterizedTest(int *idx, fp8_gpu, skinny_matches_cpu)
{
    GT_REQUIRE_GPU();
    const struct pshape *s = &skshapes[*idx];
    struct gt_rng r = {.s = 500 + (uint64_t)*idx};
    struct fw w = fw_make(&r, s->rows, s->cols, s->br, s->bc);
    cr_assert(krk_fp8_skinny_takes(&(struct krk_fp8_weight){.q = w.dq, .scale = w.ds, .rows = w.rows, .cols = w.cols,
                                                             .ld_s = w.sc, .block_r = 128, .block_c = 128}));
    static const int64_t ns[] = {1, 2, 3, 7, 8, 9, 16, 17, 32, 33, 70};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        const int64_t n = ns[k];
        if (!affordable(s->rows, s->cols, n)) {
            continue;
        }
        float *x = act_make(&r, n, s->cols);
        struct ref f = ref_make(x, n, &w);
        const int64_t ldq = s->cols + 16, nkb = w.sc, ldy = s->rows + 3;
        float *dx = gt_dup(x, (size_t)(n * s->cols) * 4), *ds = gt_dalloc((size_t)(n * nkb) * 4),
              *dy = gt_dalloc((size_t)(n * ldy) * 4), *y = kr_malloc((size_t)(n * ldy) * 4),
              *yc = kr_malloc((size_t)(n * s->rows) * 4);
        uint8_t *dq = gt_dalloc((size_t)(n * ldq));
        cr_assert(y && yc);
        const struct krk_fp8_quant_params qp = {.x = dx, .ldx = s->cols, .n = n, .cols = s->cols, .block = 128,
                                                .q = dq, .ldq = ldq, .scale = ds, .s_ld = n};
        cr_assert_eq(krk_fp8_quant(&qp, NULL), KR_OK);
        const struct krk_fp8_mm_params mp = {.q = dq, .ldq = ldq, .scale = ds, .s_ld = n, .n = n, .w = fw_dev(&w),
                                             .y = dy, .ldy = ldy};
        cr_assert_eq(krk_fp8_skinny(&mp, NULL), KR_OK);
        gt_sync();
        gt_down(y, dy, (size_t)(n * ldy) * 4);
        for (int64_t t = 0; t < n; t++) {
            memcpy(yc + t * s->rows, y + t * ldy, (size_t)s->rows * 4);
        }
        char what[128];
        snprintf(what, sizeof what, "skinny %lldx%lld n=%lld", (long long)s->rows, (long long)s->cols, (long long)n);
        expect_rel(what, yc, &f, n, s->rows, LT_REL);
        gt_dfree(dx);
        gt_dfree(ds);
        gt_dfree(dy);
        gt_dfree(dq);
        kr_free(y);
        kr_free(yc);
        kr_free(x);
        ref_free(&f);
    }
    fw_free(&w);
}

/* ---- the CUDA backend end to end -------------------------------------------------------------- */

/* Products through kr_backend_matmul against the CPU recipe, every row count path: the skinny kernel
 * (up to KRAIT_FP8_SKINNY_MAX = 16 rows), cuBLASLt for a multiple of 4 rows with the rest on the
 * skinny kernel (17, 33, 70), and a weight outside 128-column blocks (the CUDA-core kernel, cuBLASLt). */
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
    static const int64_t ns[] = {1, 4, 5, 16, 17, 33, 70};
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
        expect_rel(what, y, &f, n, rows, LT_REL);
        gt_dfree(dx);
        gt_dfree(dy);
        kr_free(y);
        kr_free(x);
        ref_free(&f);
    }
    gt_dfree(dbias);
    kr_free(bias);
    fw_free(&w);
    /* a weight outside 128-column blocks: the CUDA-core kernel (3 rows), cuBLASLt (20 rows) */
    struct fw w2 = fw_make(&r, 256, 400, 128, 128);
    const struct kr_tensor t2 = {.data = w2.dq, .dtype = KR_DTYPE_F8_E4M3, .rows = 256, .cols = 400, .scale = w2.ds,
                                 .block_r = 128, .block_c = 128};
    for (int64_t n = 3; n <= 20; n += 17) {
        float *x = act_make(&r, n, 400);
        struct ref f = ref_make(x, n, &w2);
        float *dx = gt_dup(x, (size_t)(n * 400) * 4), *dy = gt_dalloc((size_t)(n * 256) * 4),
              *y = kr_malloc((size_t)(n * 256) * 4);
        cr_assert_eq(kr_backend_matmul(gpu, dx, 400, n, &t2, NULL, dy, 256, NULL), KR_OK);
        gt_sync();
        gt_down(y, dy, (size_t)(n * 256) * 4);
        char what[96];
        snprintf(what, sizeof what, "backend matmul 256x400 n=%lld", (long long)n);
        expect_rel(what, y, &f, n, 256, n < 4 ? GEMV_REL : LT_REL);
        gt_dfree(dx);
        gt_dfree(dy);
        kr_free(y);
        kr_free(x);
        ref_free(&f);
    }
    fw_free(&w2);
    kr_backend_free(gpu);
}

/* Each case: tokens, experts, experts per token, widths, gated, every 7th selection invalid (-1). */
struct ecase {
    int n, E, K;
    int64_t d_in, d_ffn;
    bool gated, holes;
};

/* One case's FP8 experts on the GPU against the CPU backend's with the same FP8 weights: the grouped
 * tensor-core products (widths in whole 128-blocks), and the per-element kernels (plain). */
static void experts_case(kr_backend_t cpu, kr_backend_t gpu, const struct ecase *c, uint64_t seed)
{
    struct gt_rng r = {.s = seed};
    const int E = c->E, K = c->K, n = c->n;
    const int64_t d_in = c->d_in, d_ffn = c->d_ffn;
    struct fw *g = kr_calloc((size_t)E, sizeof *g), *u = kr_calloc((size_t)E, sizeof *u),
              *d = kr_calloc((size_t)E, sizeof *d);
    struct kr_tensor *t = kr_calloc((size_t)E * 6, sizeof *t);
    cr_assert(g && u && d && t);
    struct kr_tensor *tg = t, *tu = t + E, *td = t + 2 * E, *cg = t + 3 * E, *cu = t + 4 * E, *cd = t + 5 * E;
    for (int e = 0; e < E; e++) {
        if (c->gated) {
            g[e] = fw_make(&r, d_ffn, d_in, 128, 128);
        }
        u[e] = fw_make(&r, d_ffn, d_in, 128, 128);
        d[e] = fw_make(&r, d_in, d_ffn, 128, 128);
#define T(dst, src, dev)                                                                           \
    dst = (struct kr_tensor){.data = dev ? (const void *)src.dq : (const void *)src.q, .dtype = KR_DTYPE_F8_E4M3,  \
                             .rows = src.rows, .cols = src.cols, .scale = dev ? src.ds : src.s, .block_r = 128, \
                             .block_c = 128}
        if (c->gated) {
            T(tg[e], g[e], 1);
            T(cg[e], g[e], 0);
        }
        T(tu[e], u[e], 1);
        T(td[e], d[e], 1);
        T(cu[e], u[e], 0);
        T(cd[e], d[e], 0);
#undef T
    }
    float *x = act_make(&r, n, d_in), *wts = kr_malloc((size_t)(n * K) * 4);
    int32_t *ids = kr_malloc((size_t)(n * K) * 4);
    cr_assert(wts && ids);
    for (int i = 0; i < n * K; i++) { /* distinct experts per token */
        ids[i] = (int32_t)((i % K + (i / K) * 3 + (i / K) / E) % E);
        if (c->holes && i % 7 == 3) {
            ids[i] = -1;
        }
        wts[i] = 0.2f + 0.1f * (float)(i % 4);
    }
    float *ref = kr_malloc((size_t)(n * d_in) * 4), *got = kr_malloc((size_t)(n * d_in) * 4);
    cr_assert(ref && got);
    const enum kr_act act = c->gated ? KR_ACT_SILU : KR_ACT_RELU2;
    const struct krk_experts_params cp = {.x = x, .n = n, .d_in = d_in, .d_ffn = d_ffn, .d_out = d_in, .n_expert = E,
                                          .n_used = K, .ids = ids, .weights = wts, .act = act, .out = ref};
    const struct kr_expert_weights cw = {.gate = c->gated ? cg : NULL, .up = cu, .down = cd};
    cr_assert_eq(kr_backend_moe_experts(cpu, &cp, &cw), KR_OK);
    /* the hidden rows are quantized after an fp32 activation on each side: a code may round the other
     * way where the two sides' hidden values straddle a rounding boundary (rare), so the bound is on
     * the error relative to the output's magnitude */
    double scale = 0;
    for (int64_t i = 0; i < n * d_in; i++) {
        scale = fmax(scale, fabs(ref[i]));
    }
    for (int plain = 0; plain < 2; plain++) {
        struct krk_experts_params gp = cp;
        gp.x = gt_dup(x, (size_t)(n * d_in) * 4);
        gp.ids = gt_dup(ids, (size_t)(n * K) * 4);
        gp.weights = gt_dup(wts, (size_t)(n * K) * 4);
        gp.out = gt_dalloc((size_t)(n * d_in) * 4);
        gp.plain = plain;
        const struct kr_expert_weights gw = {.gate = c->gated ? tg : NULL, .up = tu, .down = td};
        cr_assert_eq(kr_backend_moe_experts(gpu, &gp, &gw), KR_OK);
        gt_sync();
        gt_down(got, gp.out, (size_t)(n * d_in) * 4);
        char what[128];
        snprintf(what, sizeof what, "FP8 experts %s n=%d E=%d K=%d %lldx%lld%s%s", plain ? "per element" : "grouped",
                 n, E, K, (long long)d_in, (long long)d_ffn, c->gated ? " gated" : "", c->holes ? " holes" : "");
        gt_expect_close(what, got, ref, (size_t)(n * d_in), 1e-6, 1e-3 * scale);
        gt_dfree((void *)gp.x);
        gt_dfree((void *)gp.ids);
        gt_dfree((void *)gp.weights);
        gt_dfree(gp.out);
    }
    for (int e = 0; e < E; e++) {
        if (c->gated) {
            fw_free(&g[e]);
        }
        fw_free(&u[e]);
        fw_free(&d[e]);
    }
    kr_free(g);
    kr_free(u);
    kr_free(d);
    kr_free(t);
    kr_free(x);
    kr_free(wts);
    kr_free(ids);
    kr_free(ref);
    kr_free(got);
}

/* The FP8 experts against the CPU backend: one token per expert chunk and less, chunks of 16 and
 * partial ones (70 tokens x 4 over 16 experts), not gated, invalid selections. */
Test(fp8_gpu, experts_match_cpu)
{
    GT_REQUIRE_GPU();
    kr_backend_t gpu = NULL, cpu = kr_backend_cpu_create(2);
    struct kr_err err = {0};
    cr_assert_eq(kr_backend_cuda_create(0, false, &gpu, &err), KR_OK, "%s", err.msg);
    static const struct ecase cases[] = {
        {6, 8, 3, 512, 384, true, false},
        {1, 8, 3, 512, 384, true, false},
        {70, 16, 4, 384, 256, true, true},
        {40, 8, 2, 256, 640, false, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        experts_case(cpu, gpu, &cases[i], 400 + i);
    }
    kr_backend_free(gpu);
    kr_backend_free(cpu);
}

/* Whole models, the fixtures with FP8 weights (kept from the FP8 checkpoint or quantized at load):
 *  - every FP8 matrix of the GPU's model multiplies like the CPU's (same codes and scales on the
 *    device as on the host: the loader's upload), within the products' bounds above;
 *  - the log-probabilities against HF's hold the CPU recipe's bound (tests/model/test_fp8_model.c:
 *    the tiny 64-wide models quantize a whole activation row with one scale, which moves them by
 *    0.09-0.63 on the CPU; FP8_MEAN = 0.8), the worst quarter of positions left out where routing or
 *    the DSA selection can flip (as the bf16 GPU tests do). The DSA indexer scores in bf16 here on
 *    both sides: its FP8 path quantizes the scores coarsely enough that the GPU and the CPU select
 *    differently at most positions of a 40-token prompt (measured: a mean of 1.14 against HF on
 *    ds_fp8's longest prompt, 1.35 against the CPU), which fp8_indexer_matches_cpu
 *    (test_backend.c) covers on its own; this test is about the weights. The GPU's FP8 run against
 *    the CPU's is printed:
 *    the activations the two quantize differ by the GPU's bf16 caches and operands elsewhere, and a
 *    code tipped over by that moves a 64-wide model visibly, so it is not a tight check. */
#define FP8_MEAN 0.8

/* The FP8 matrices of a model, in a fixed order (the same for two loads of one checkpoint). */
static int fp8_mats(const struct kr_model *m, const struct kr_tensor **out, int cap)
{
    int n = 0;
#define ADD(t)                                                                                     \
    do {                                                                                           \
        if ((t).data && (t).dtype == KR_DTYPE_F8_E4M3 && n < cap) {                                \
            out[n++] = &(t);                                                                       \
        }                                                                                          \
    } while (0)
    for (int32_t i = 0; i < m->cfg.n_layer; i++) {
        const struct kr_layer *L = &m->layers[i];
        ADD(L->mamba.in_proj);
        ADD(L->mamba.out_proj);
        ADD(L->attn.q);
        ADD(L->attn.k);
        ADD(L->attn.v);
        ADD(L->attn.o);
        ADD(L->mlp.up);
        ADD(L->mlp.down);
        ADD(L->mlp.gate);
        ADD(L->moe.shared.up);
        ADD(L->moe.shared.down);
        ADD(L->moe.shared.gate);
        for (int64_t e = 0; L->moe.up && e < m->cfg.n_expert; e++) {
            ADD(L->moe.up[e]);
            ADD(L->moe.down[e]);
            if (L->moe.gate) {
                ADD(L->moe.gate[e]);
            }
        }
        ADD(L->mla.q_a);
        ADD(L->mla.q_b);
        ADD(L->mla.kv_a);
        ADD(L->mla.o);
        ADD(L->mla.idx_wq_b);
        ADD(L->mla.idx_wk);
        ADD(L->mla.idx_w);
    }
#undef ADD
    return n;
}

static int model_idx[] = {0, 1, 6, 7, 8}; /* nh_mamba_attn_mlp, nh_moe, ds_fp8 (kept in FP8), ds_short, hy_mdme */
ParameterizedTestParameters(fp8_gpu, models_match_the_cpu_recipe)
{
    return cr_make_param_array(int, model_idx, sizeof model_idx / sizeof model_idx[0]);
}
ParameterizedTest(int *idx, fp8_gpu, models_match_the_cpu_recipe)
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
    const char *name = fx_all[*idx].name;
    if (g.m->idx_fp8) {
        cr_assert_eq(kr_model_set_indexer(g.m, KR_INDEXER_BF16, &err), KR_OK, "%s", err.msg);
        cr_assert_eq(kr_model_set_indexer(c.m, KR_INDEXER_BF16, &err), KR_OK, "%s", err.msg);
    }
    /* every FP8 matrix: the GPU's product against the CPU's on the same rows */
    const struct kr_tensor *gm[4096], *cm[4096];
    const int ng = fp8_mats(g.m, gm, 4096), nc = fp8_mats(c.m, cm, 4096);
    cr_assert_eq(ng, nc);
    cr_assert_gt(ng, 0, "%s: no FP8 matrix on the GPU", name);
    struct gt_rng r = {.s = 600 + (uint64_t)*idx};
    double worst = 0;
    for (int k = 0; k < ng; k++) {
        const struct kr_tensor *a = gm[k], *b = cm[k];
        cr_assert(a->rows == b->rows && a->cols == b->cols && a->block_r == b->block_r && a->block_c == b->block_c);
        const struct fw h = {.rows = b->rows, .cols = b->cols, .br = b->block_r, .bc = b->block_c,
                             .sr = (b->rows + b->block_r - 1) / b->block_r, .sc = (b->cols + b->block_c - 1) / b->block_c,
                             .q = (uint8_t *)b->data, .s = (float *)b->scale, .ue8m0 = b->act_ue8m0};
        for (int64_t n = 3; n <= 40; n += 37) { /* decode rows; a prefill's (cuBLASLt where it takes them) */
            float *x = act_make(&r, n, h.cols);
            struct ref f = ref_make(x, n, &h);
            float *dx = gt_dup(x, (size_t)(n * h.cols) * 4), *dy = gt_dalloc((size_t)(n * h.rows) * 4),
                  *y = kr_malloc((size_t)(n * h.rows) * 4);
            cr_assert_eq(kr_backend_matmul(gbe, dx, h.cols, n, a, NULL, dy, h.rows, NULL), KR_OK);
            gt_sync();
            gt_down(y, dy, (size_t)(n * h.rows) * 4);
            for (int64_t i = 0; i < n * h.rows; i++) {
                const double e = isfinite(y[i]) ? fabs((double)y[i] - (double)f.y[i]) / ((double)f.mag[i] + 1e-30) : INFINITY;
                worst = e > worst ? e : worst;
            }
            gt_dfree(dx);
            gt_dfree(dy);
            kr_free(y);
            kr_free(x);
            ref_free(&f);
        }
    }
    fprintf(stderr, "  %-18s %d FP8 matrices, 3 and 40 rows: GPU product vs the CPU recipe max |err| / S = %.3g\n",
            name, ng, worst);
    cr_expect_leq(worst, LT_REL, "%s: an FP8 matrix multiplies differently on the GPU (%g)", name, worst);
    /* the log-probabilities */
    const bool discrete = g.m->cfg.n_expert > 0 || strchr(g.m->cfg.pattern, 'D') != NULL;
    for (int32_t i = 0; i < g.n_prompts; i++) {
        struct fx_prompt *p = &g.prompts[i];
        const size_t nv = (size_t)p->n * (size_t)g.vocab;
        float *lg = kr_malloc(nv * 4), *lc = kr_malloc(nv * 4);
        cr_assert(lg && lc);
        cr_assert_eq(kr_run_prompt_logprobs(g.m, g.c, p->ids, p->n, 0, lg, &err), KR_OK, "%s", err.msg);
        cr_assert_eq(kr_run_prompt_logprobs(c.m, c.c, p->ids, p->n, 0, lc, &err), KR_OK, "%s", err.msg);
        /* per position; with routing or selection (discrete), the worst quarter of positions are
         * left out of the mean, as the bf16 tests do (tests/gpu/test_backend.c) */
        double *pos_hf = kr_calloc((size_t)p->n, sizeof *pos_hf), cpu = 0;
        int64_t bad = 0;
        cr_assert(pos_hf);
        for (size_t k = 0; k < nv; k++) {
            bad += !isfinite(lg[k]);
            pos_hf[k / (size_t)g.vocab] += fabs((double)lg[k] - (double)p->logprobs[k]) / (double)g.vocab;
            cpu += fabs((double)lg[k] - (double)lc[k]);
        }
        cpu /= (double)nv;
        int32_t drop = discrete ? p->n / 4 : 0, kept = p->n;
        for (; drop > 0; drop--, kept--) {
            int32_t at = 0;
            for (int32_t t = 1; t < p->n; t++) {
                at = pos_hf[t] > pos_hf[at] ? t : at;
            }
            pos_hf[at] = -1;
        }
        double hf = 0;
        for (int32_t t = 0; t < p->n; t++) {
            hf += pos_hf[t] >= 0 ? pos_hf[t] : 0;
        }
        hf /= kept;
        kr_free(pos_hf);
        fprintf(stderr, "  %-18s prompt %d (len %3d): FP8 on the GPU: mean |lp - HF| %.4f (bound %.2f); against the "
                        "CPU's FP8 run %.4f%s\n", name, i, p->n, hf, FP8_MEAN, cpu,
                discrete ? " (routing/selection: the worst quarter of positions left out)" : "");
        cr_expect_eq(bad, 0, "%s prompt %d: %lld log-probabilities not finite", name, i, (long long)bad);
        cr_expect_leq(hf, FP8_MEAN, "%s prompt %d: mean |logprob - HF| %g", name, i, hf);
        kr_free(lg);
        kr_free(lc);
    }
    fx_free(&g);
    fx_free(&c);
}

/* The CUDA backend takes the FP8 caches (tests/gpu/test_kv_fp8.c checks what they hold): the setting
 * is accepted, stores the bytes and switches the FP8 indexer on for D layers. */
Test(fp8_gpu, fp8_caches_are_taken_on_cuda)
{
    GT_REQUIRE_GPU();
    kr_backend_t be = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_backend_cuda_create(0, false, &be, &err), KR_OK, "%s", err.msg);
    cr_expect(kr_backend_can_kv_fp8(be) && kr_backend_kv_fp8_packed(be));
    struct fx f;
    fx_load_on(&f, "deepseek_v32", "ds_short", be, 2);
    cr_expect_eq(kr_model_set_kv_cache_dtype(f.m, KR_KV_CACHE_FP8, &err), KR_OK, "%s", err.msg);
    cr_expect(f.m->kv_fp8 && f.m->idx_fp8);
    fx_free(&f);
}
