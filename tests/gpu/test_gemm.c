/* Skinny products (kernels/gemm/) against kr_backend_matmul of the CPU reference with the same bf16
 * weights, for every n = 1..8 on the target model's shapes and a ragged small one.
 *
 * Error bound: the kernel rounds x to bf16 (the operand precision of the GEMM path), so x is drawn
 * bf16-exact; both sides then accumulate the same x times W (exact bf16 values) in fp32, in different
 * orders. For x, W uniform in [-1, 1] a dot product over `cols` terms has |y| ~ sqrt(cols) / 3 and
 * a rounding difference of a few ulp of the partial sums (~1e-5 at cols = 21504): NMSE <= 1e-10
 * and max |err| <= 1e-3 leave a wide margin, while a missed or repeated chunk of columns or a
 * wrong row gives errors of order 1. */
#include "gpu-test.h"
#include "krk/norm.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "dtype.h"

#define GEMV_NMSE 1e-10
#define GEMV_ABS 1e-3

struct gemv_shape {
    int64_t rows, cols;
};
/* Mamba in_proj, a square projection, an MLP down projection, and a ragged small one (rows not a
 * multiple of a block's rows, cols not a multiple of 256). */
static const struct gemv_shape gemv_shapes[] = {{4096, 4096}, {18560, 4096}, {4096, 21504}, {131, 264}};
#define N_GEMV_SHAPES ((int)(sizeof gemv_shapes / sizeof gemv_shapes[0]))
static int gemv_idx[N_GEMV_SHAPES] = {0, 1, 2, 3};
_Static_assert(sizeof gemv_idx / sizeof gemv_idx[0] == N_GEMV_SHAPES, "one index per shape");

static float *hrand(struct gt_rng *r, size_t n, float lo, float hi)
{
    float *p = kr_malloc((n ? n : 1) * sizeof(float));
    cr_assert(p);
    gt_fill(r, p, n, lo, hi);
    return p;
}

ParameterizedTestParameters(gemm, gemv_matches_cpu_matmul)
{
    return cr_make_param_array(int, gemv_idx, N_GEMV_SHAPES);
}

/* n = 1..8 with x staged in shared memory, then n = 1, 2 with x read through L1; odd n with a
 * bias; x row strides cols, cols + 1 and cols + 2 (rows not 16-byte aligned); y row stride
 * rows + 3 for even n, whose padding must stay untouched. */
ParameterizedTest(int *idx, gemm, gemv_matches_cpu_matmul)
{
    GT_REQUIRE_GPU();
    const struct gemv_shape s = gemv_shapes[*idx];
    struct gt_rng rng = {.s = 100 + (uint64_t)*idx};
    kr_backend_t be = kr_backend_cpu_create(0); /* results do not depend on the thread count */
    cr_assert(be);
    const size_t nw = (size_t)(s.rows * s.cols);
    float *wf = hrand(&rng, nw, -1.0f, 1.0f);
    uint16_t *wb = kr_malloc(nw * sizeof(uint16_t));
    cr_assert(wb);
    for (size_t i = 0; i < nw; i++) {
        wb[i] = kr_f32_to_bf16(wf[i]);
    }
    kr_free(wf);
    krk_bf16 *d_w = gt_dup(wb, nw * 2);
    const struct kr_tensor t = {.data = wb, .dtype = KR_DTYPE_BF16, .rows = s.rows, .cols = s.cols};
    float *bias = hrand(&rng, (size_t)s.rows, -1.0f, 1.0f);
    float *d_bias = gt_dup(bias, (size_t)s.rows * 4);

    /* n = 1..MAX_N in the default tiling; n = 1, 2 in each alternative tiling (bench_gemv's); n = 1, 4
     * as programmatic dependents of a kernel that writes x (the GEMV must wait for it before
     * reading x) */
    struct gcase {
        int64_t n;
        int config;
        bool pdl;
    } cases[KRK_GEMV_MAX_N + 2 * KRK_GEMV_CONFIGS + 2];
    int n_cases = 0;
    for (int64_t n = 1; n <= KRK_GEMV_MAX_N; n++) {
        cases[n_cases++] = (struct gcase){n, 0, false};
    }
    for (int cfg = 1; cfg < KRK_GEMV_CONFIGS; cfg++) {
        cases[n_cases++] = (struct gcase){1, cfg, false};
        cases[n_cases++] = (struct gcase){2, cfg, false};
    }
    cases[n_cases++] = (struct gcase){1, 0, true};
    cases[n_cases++] = (struct gcase){4, 0, true};
    for (int ci = 0; ci < n_cases; ci++) {
        const int64_t n = cases[ci].n;
        const bool pdl = cases[ci].pdl;
        const int64_t ldx = s.cols + n % 3, ldy = s.rows + (n % 2 ? 0 : 3);
        const bool with_bias = n % 2 == 1;
        const size_t nx = (size_t)(n * ldx), ny = (size_t)(n * ldy);
        float *x = hrand(&rng, nx, -1.0f, 1.0f);
        gt_round_bf16(x, nx); /* the kernel rounds x to bf16 (the GEMM operand precision) */
        float *ref = kr_malloc(ny * sizeof(float)), *got = kr_malloc(ny * sizeof(float));
        cr_assert(ref && got);
        memset(ref, 0xff, ny * sizeof(float)); /* the padding stays NaN on both sides */
        /* with pdl, x goes up halved (exact) at the end of a large buffer that a kernel then
         * doubles: a GEMV that read x before that kernel finished would see halves */
        const size_t lead = pdl ? (size_t)48 << 20 : 0;
        float *d_buf = gt_dalloc((lead + nx) * 4), *d_x = d_buf + lead, *d_y = gt_dalloc(ny * 4);
        for (size_t i = 0; i < nx; i++) {
            x[i] *= pdl ? 0.5f : 1.0f;
        }
        cr_assert_eq(cudaMemcpy(d_x, x, nx * 4, cudaMemcpyHostToDevice), cudaSuccess);
        /* a copy from pageable memory may return before it lands, and the stream below does not
         * wait for the legacy stream */
        gt_sync();
        for (size_t i = 0; i < nx; i++) {
            x[i] *= pdl ? 2.0f : 1.0f;
        }
        cudaStream_t st;
        cr_assert_eq(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
        if (pdl) {
            cr_assert_eq(krk_scale(d_buf, 2.0f, (int64_t)(lead + nx), st), KR_OK);
        }
        const struct krk_gemv_params p = {.x = d_x, .ldx = ldx, .w = d_w, .bias = with_bias ? d_bias : NULL, .n = n,
                                          .rows = s.rows, .cols = s.cols, .y = d_y, .ldy = ldy,
                                          .pdl = pdl, .config = cases[ci].config};
        cr_assert_eq(krk_gemv(&p, st), KR_OK);
        cr_assert_eq(cudaStreamSynchronize(st), cudaSuccess);
        cr_assert_eq(cudaStreamDestroy(st), cudaSuccess);
        gt_sync();
        cr_assert_eq(kr_backend_matmul(be, x, ldx, n, &t, with_bias ? bias : NULL, ref, ldy), KR_OK);
        gt_down(got, d_y, ny * 4);
        /* compare the rows of y, then the padding bytes */
        float *gd = kr_malloc((size_t)(n * s.rows) * sizeof(float));
        float *rd = kr_malloc((size_t)(n * s.rows) * sizeof(float));
        cr_assert(gd && rd);
        for (int64_t i = 0; i < n; i++) {
            memcpy(gd + i * s.rows, got + i * ldy, (size_t)s.rows * sizeof(float));
            memcpy(rd + i * s.rows, ref + i * ldy, (size_t)s.rows * sizeof(float));
        }
        char what[128];
        snprintf(what, sizeof what, "gemv %lldx%lld n=%lld%s ldx=%lld config %d%s", (long long)s.rows,
                 (long long)s.cols, (long long)n, with_bias ? " +bias" : "", (long long)ldx, cases[ci].config,
                 pdl ? " (programmatic dependent)" : "");
        gt_expect_close(what, gd, rd, (size_t)(n * s.rows), GEMV_NMSE, GEMV_ABS);
        bool pad_ok = true;
        for (int64_t i = 0; i < n && pad_ok; i++) {
            const size_t pad = (size_t)(ldy - s.rows) * sizeof(float);
            pad_ok = memcmp(got + i * ldy + s.rows, ref + i * ldy + s.rows, pad) == 0;
        }
        cr_expect(pad_ok, "%s: y written outside its rows", what);
        kr_free(gd);
        kr_free(rd);
        kr_free(x);
        kr_free(ref);
        kr_free(got);
        gt_dfree(d_buf);
        gt_dfree(d_y);
    }
    gt_dfree(d_w);
    gt_dfree(d_bias);
    kr_free(wb);
    kr_free(bias);
    kr_backend_free(be);
}

Test(gemm, gemv_rejects_bad_parameters)
{
    GT_REQUIRE_GPU();
    krk_bf16 *d_w = gt_dalloc(64 * 16 * 2 + 16);
    float *d_x = gt_dalloc(16 * 64 * 4), *d_y = gt_dalloc(16 * 64 * 4);
    struct krk_gemv_params p = {.x = d_x, .ldx = 64, .w = d_w, .n = 1, .rows = 16, .cols = 64, .y = d_y, .ldy = 16};
    cr_expect_eq(krk_gemv(&p, 0), KR_OK);
    p.n = KRK_GEMV_MAX_N + 1;
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    p.n = 1;
    p.config = KRK_GEMV_CONFIGS; /* no such tiling */
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    p.config = -1;
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    p.config = 0;
    p.n = 2;
    p.cols = 60; /* not a multiple of 8 */
    p.ldx = 60;
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    p.cols = 64;
    p.ldx = 64;
    p.w = d_w + 4; /* 8-byte aligned only */
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    p.w = d_w;
    p.ldy = 8; /* ldy < rows */
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    gt_sync();
    gt_dfree(d_w);
    gt_dfree(d_x);
    gt_dfree(d_y);
}

/* y += bias per row, bit for bit the CPU's addition, padding untouched. */
Test(gemm, add_bias_adds_per_row)
{
    GT_REQUIRE_GPU();
    static const struct {
        int64_t n, rows, ldy;
    } shapes[] = {{1, 4096, 4096}, {3, 131, 140}, {1000, 4096, 4100}, {70000, 5, 5}};
    struct gt_rng rng = {.s = 200};
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t n = shapes[si].n, rows = shapes[si].rows, ldy = shapes[si].ldy;
        const size_t ny = (size_t)(n * ldy);
        float *y = hrand(&rng, ny, -1.0f, 1.0f), *bias = hrand(&rng, (size_t)rows, -1.0f, 1.0f);
        float *d_y = gt_dup(y, ny * 4), *d_b = gt_dup(bias, (size_t)rows * 4);
        cr_assert_eq(krk_add_bias(d_y, ldy, d_b, n, rows, 0), KR_OK);
        gt_sync();
        for (int64_t t = 0; t < n; t++) {
            cr_assert_eq(kr_backend_add(be, y + t * ldy, bias, rows), KR_OK);
        }
        float *g = kr_malloc(ny * sizeof(float));
        cr_assert(g);
        gt_down(g, d_y, ny * 4);
        const bool ok = memcmp(g, y, ny * sizeof(float)) == 0;
        fprintf(stderr, "  add_bias n=%lld rows=%lld ldy=%lld %s\n", (long long)n, (long long)rows, (long long)ldy,
                ok ? "identical" : "FAIL");
        cr_expect(ok, "add_bias n=%lld rows=%lld: differs from the CPU", (long long)n, (long long)rows);
        kr_free(g);
        kr_free(y);
        kr_free(bias);
        gt_dfree(d_y);
        gt_dfree(d_b);
    }
    kr_backend_free(be);
}
