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

/* A random bf16 weight [rows, cols] in [-1, 1]: host copy (the CPU reference's tensor) and device
 * copy. */
struct gemv_weight {
    uint16_t *host;
    krk_bf16 *dev;
    struct kr_tensor t;
};

static void weight_make(struct gemv_weight *w, struct gt_rng *rng, int64_t rows, int64_t cols)
{
    const size_t nw = (size_t)(rows * cols);
    float *wf = hrand(rng, nw, -1.0f, 1.0f);
    w->host = kr_malloc(nw * sizeof(uint16_t));
    cr_assert(w->host);
    for (size_t i = 0; i < nw; i++) {
        w->host[i] = kr_f32_to_bf16(wf[i]);
    }
    kr_free(wf);
    w->dev = gt_dup(w->host, nw * 2);
    w->t = (struct kr_tensor){.data = w->host, .dtype = KR_DTYPE_BF16, .rows = rows, .cols = cols};
}

static void weight_free(struct gemv_weight *w)
{
    gt_dfree(w->dev);
    kr_free(w->host);
}

/* Whether got[i] == a[i] + b[i] in fp32 for every i, bit for bit. */
static bool is_exact_sum(const float *got, const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const float s = a[i] + b[i];
        if (memcmp(&got[i], &s, sizeof s) != 0) {
            return false;
        }
    }
    return true;
}

ParameterizedTestParameters(gemm, gemv_accumulates_residual)
{
    return cr_make_param_array(int, gemv_idx, N_GEMV_SHAPES);
}

/* The fused residual add (acc): y as in gemv_matches_cpu_matmul (same bounds), and acc + y added on
 * the device exactly as the host adds them (one fp32 addition of the value written to y), row
 * padding of y and acc untouched. n = 1 with a bias, n = 2 with a row stride of rows + 3, and n = 1
 * as a programmatic dependent of a kernel that writes acc (the epilogue must read acc after its
 * wait: acc goes up halved at the end of a large buffer that the kernel doubles). */
ParameterizedTest(int *idx, gemm, gemv_accumulates_residual)
{
    GT_REQUIRE_GPU();
    const struct gemv_shape s = gemv_shapes[*idx];
    struct gt_rng rng = {.s = 300 + (uint64_t)*idx};
    kr_backend_t be = kr_backend_cpu_create(0);
    cr_assert(be);
    struct gemv_weight w;
    weight_make(&w, &rng, s.rows, s.cols);
    float *bias = hrand(&rng, (size_t)s.rows, -1.0f, 1.0f);
    float *d_bias = gt_dup(bias, (size_t)s.rows * 4);
    static const struct {
        int64_t n;
        bool pdl;
    } cases[] = {{1, false}, {2, false}, {1, true}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int64_t n = cases[ci].n, ldx = s.cols, ldy = s.rows + (n == 2 ? 3 : 0);
        const bool pdl = cases[ci].pdl, with_bias = n == 1;
        const size_t nx = (size_t)(n * ldx), ny = (size_t)(n * ldy);
        float *x = hrand(&rng, nx, -1.0f, 1.0f);
        gt_round_bf16(x, nx);
        float *acc = hrand(&rng, ny, -1.0f, 1.0f); /* the padding too, which must keep its values */
        float *ref = kr_malloc(ny * sizeof(float)), *got = kr_malloc(ny * sizeof(float));
        float *acc_got = kr_malloc(ny * sizeof(float));
        cr_assert(ref && got && acc_got);
        memset(ref, 0xff, ny * sizeof(float));
        const size_t lead = pdl ? (size_t)48 << 20 : 0;
        float *d_x = gt_dup(x, nx * 4), *d_y = gt_dalloc(ny * 4), *d_buf = gt_dalloc((lead + ny) * 4);
        float *d_acc = d_buf + lead;
        for (size_t i = 0; i < ny; i++) {
            acc[i] *= pdl ? 0.5f : 1.0f;
        }
        cr_assert_eq(cudaMemcpy(d_acc, acc, ny * 4, cudaMemcpyHostToDevice), cudaSuccess);
        gt_sync();
        for (size_t i = 0; i < ny; i++) {
            acc[i] *= pdl ? 2.0f : 1.0f;
        }
        cudaStream_t st;
        cr_assert_eq(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
        if (pdl) {
            cr_assert_eq(krk_scale(d_buf, 2.0f, (int64_t)(lead + ny), st), KR_OK);
        }
        const struct krk_gemv_params p = {.x = d_x, .ldx = ldx, .w = w.dev, .bias = with_bias ? d_bias : NULL,
                                          .n = n, .rows = s.rows, .cols = s.cols, .y = d_y, .ldy = ldy, .pdl = pdl,
                                          .acc = d_acc};
        cr_assert_eq(krk_gemv(&p, st), KR_OK);
        cr_assert_eq(cudaStreamSynchronize(st), cudaSuccess);
        cr_assert_eq(cudaStreamDestroy(st), cudaSuccess);
        gt_sync();
        cr_assert_eq(kr_backend_matmul(be, x, ldx, n, &w.t, with_bias ? bias : NULL, ref, ldy), KR_OK);
        gt_down(got, d_y, ny * 4);
        gt_down(acc_got, d_acc, ny * 4);
        char what[128];
        snprintf(what, sizeof what, "gemv %lldx%lld n=%lld%s with acc%s", (long long)s.rows, (long long)s.cols,
                 (long long)n, with_bias ? " +bias" : "", pdl ? " (programmatic dependent)" : "");
        bool rows_ok = true, pad_ok = true;
        for (int64_t t = 0; t < n; t++) {
            const size_t o = (size_t)(t * ldy), pad = (size_t)(ldy - s.rows);
            gt_expect_close(what, got + o, ref + o, (size_t)s.rows, GEMV_NMSE, GEMV_ABS);
            rows_ok = rows_ok && is_exact_sum(acc_got + o, acc + o, got + o, (size_t)s.rows);
            pad_ok = pad_ok && memcmp(got + o + s.rows, ref + o + s.rows, pad * sizeof(float)) == 0 &&
                     memcmp(acc_got + o + s.rows, acc + o + s.rows, pad * sizeof(float)) == 0;
        }
        cr_expect(rows_ok, "%s: acc is not acc + y", what);
        cr_expect(pad_ok, "%s: y or acc written outside its rows", what);
        kr_free(x);
        kr_free(acc);
        kr_free(ref);
        kr_free(got);
        kr_free(acc_got);
        gt_dfree(d_x);
        gt_dfree(d_y);
        gt_dfree(d_buf);
    }
    weight_free(&w);
    gt_dfree(d_bias);
    kr_free(bias);
    kr_backend_free(be);
}

/* The fused RMSNorm (norm_w, n = 1): the GEMV normalises x as it stages it and writes the normalised
 * row to norm_out, each block its share of the columns.
 *
 * norm_out against the CPU's rmsnorm of the same fp32 x: the two differ only in the summation
 * order of the sum of squares (sequential on the CPU, a block-wide tree on the GPU), a relative
 * difference of ~1e-6 in 1/rms at cols = 12288; with x in [-1, 1] and w in [0.5, 1.5] the values
 * are at most ~2.6, so NMSE <= 1e-10 and max |err| <= 1e-4 leave a wide margin, while a wrong
 * column, weight or scale gives errors of order 1. Columns beyond cols must stay untouched.
 * y against the CPU's product of the GPU's norm_out rounded to bf16 (the operand the kernel
 * stages), with gemv_matches_cpu_matmul's bounds: that checks that the staged x is norm_out.
 * Shapes: cols not a multiple of 256 (264, 8: fewer columns than blocks), rows not a multiple of a
 * block's rows, the 4096-column decode shapes, and the largest row (12288, more 4-column groups
 * than the block has threads); each in every n = 1 tiling, as a programmatic dependent of a
 * kernel that writes half of x (a kernel that read x before its wait would see that half halved,
 * which the norm does not scale away), and with acc as well. Also printed, not asserted: whether
 * norm_out equals krk_rmsnorm's output bit for bit (it should where the block has at least
 * krk_rmsnorm's threads). */
#define NORM_NMSE 1e-10
#define NORM_ABS 1e-4

static const struct gemv_shape norm_shapes[] = {{4096, 4096}, {18560, 4096}, {1000, 12288}, {131, 264}, {77, 8}};
#define N_NORM_SHAPES ((int)(sizeof norm_shapes / sizeof norm_shapes[0]))
static int norm_idx[N_NORM_SHAPES] = {0, 1, 2, 3, 4};
_Static_assert(sizeof norm_idx / sizeof norm_idx[0] == N_NORM_SHAPES, "one index per shape");

ParameterizedTestParameters(gemm, gemv_fuses_rmsnorm)
{
    return cr_make_param_array(int, norm_idx, N_NORM_SHAPES);
}

ParameterizedTest(int *idx, gemm, gemv_fuses_rmsnorm)
{
    GT_REQUIRE_GPU();
    const struct gemv_shape s = norm_shapes[*idx];
    const int64_t cols = s.cols, rows = s.rows;
    const float eps = 1e-5f;
    struct gt_rng rng = {.s = 400 + (uint64_t)*idx};
    kr_backend_t be = kr_backend_cpu_create(0);
    cr_assert(be);
    struct gemv_weight w;
    weight_make(&w, &rng, rows, cols);
    float *bias = hrand(&rng, (size_t)rows, -1.0f, 1.0f), *g = hrand(&rng, (size_t)cols, 0.5f, 1.5f);
    float *d_bias = gt_dup(bias, (size_t)rows * 4), *d_g = gt_dup(g, (size_t)cols * 4);
    struct ncase {
        int config;
        bool pdl, acc;
    } cases[KRK_GEMV_CONFIGS + 2];
    int n_cases = 0;
    for (int cfg = 0; cfg < KRK_GEMV_CONFIGS; cfg++) {
        cases[n_cases++] = (struct ncase){cfg, false, false};
    }
    cases[n_cases++] = (struct ncase){0, true, false};
    cases[n_cases++] = (struct ncase){0, false, true};
    const size_t tail = 8; /* floats after norm_out's row, which must stay untouched */
    for (int ci = 0; ci < n_cases; ci++) {
        const bool pdl = cases[ci].pdl, with_acc = cases[ci].acc, with_bias = cases[ci].config % 2 == 1;
        float *x = hrand(&rng, (size_t)cols, -1.0f, 1.0f), *acc = hrand(&rng, (size_t)rows, -1.0f, 1.0f);
        float *ref_out = kr_malloc((size_t)cols * sizeof(float)), *out = kr_malloc((cols + tail) * sizeof(float));
        float *xr = kr_malloc((size_t)cols * sizeof(float)), *plain = kr_malloc((size_t)cols * sizeof(float));
        float *ref = kr_malloc((size_t)rows * sizeof(float)), *got = kr_malloc((size_t)rows * sizeof(float));
        float *acc_got = kr_malloc((size_t)rows * sizeof(float));
        cr_assert(ref_out && out && xr && plain && ref && got && acc_got);
        /* with pdl, the first half of x goes up halved (exact) at the end of a large buffer, and a
         * kernel doubles everything up to the end of that half */
        const size_t lead = pdl ? (size_t)48 << 20 : 0, half = pdl ? (size_t)cols / 2 : 0;
        float *d_buf = gt_dalloc((lead + (size_t)cols) * 4), *d_x = d_buf + lead;
        for (size_t i = 0; i < half; i++) {
            x[i] *= 0.5f;
        }
        cr_assert_eq(cudaMemcpy(d_x, x, (size_t)cols * 4, cudaMemcpyHostToDevice), cudaSuccess);
        gt_sync();
        for (size_t i = 0; i < half; i++) {
            x[i] *= 2.0f;
        }
        float *d_out = gt_dalloc((cols + tail) * 4), *d_y = gt_dalloc((size_t)rows * 4);
        float *d_acc = with_acc ? gt_dup(acc, (size_t)rows * 4) : NULL, *d_plain = gt_dalloc((size_t)cols * 4);
        cudaStream_t st;
        cr_assert_eq(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
        if (pdl) {
            cr_assert_eq(krk_scale(d_buf, 2.0f, (int64_t)(lead + half), st), KR_OK);
        }
        const struct krk_gemv_params p = {.x = d_x, .ldx = cols, .w = w.dev, .bias = with_bias ? d_bias : NULL,
                                          .n = 1, .rows = rows, .cols = cols, .y = d_y, .ldy = rows, .pdl = pdl,
                                          .config = cases[ci].config, .acc = d_acc, .norm_w = d_g, .norm_eps = eps,
                                          .norm_out = d_out};
        cr_assert_eq(krk_gemv(&p, st), KR_OK);
        /* the unfused kernel on the same x, for the bit-for-bit report */
        const struct krk_rmsnorm_params np = {.x = d_x, .ldx = cols, .w = d_g, .n = 1, .dim = cols, .eps = eps,
                                              .out = d_plain};
        cr_assert_eq(krk_rmsnorm(&np, st), KR_OK);
        cr_assert_eq(cudaStreamSynchronize(st), cudaSuccess);
        cr_assert_eq(cudaStreamDestroy(st), cudaSuccess);
        gt_sync();
        gt_down(out, d_out, (cols + tail) * 4);
        gt_down(got, d_y, (size_t)rows * 4);
        gt_down(plain, d_plain, (size_t)cols * 4);
        char what[160];
        snprintf(what, sizeof what, "gemv %lldx%lld with rmsnorm config %d%s%s%s", (long long)rows, (long long)cols,
                 cases[ci].config, with_bias ? " +bias" : "", with_acc ? " +acc" : "",
                 pdl ? " (programmatic dependent)" : "");
        /* the normalised row */
        cr_assert_eq(kr_backend_rmsnorm(be, x, g, 1, cols, eps, ref_out), KR_OK);
        char what_norm[192];
        snprintf(what_norm, sizeof what_norm, "%s: norm_out", what);
        gt_expect_close(what_norm, out, ref_out, (size_t)cols, NORM_NMSE, NORM_ABS);
        bool tail_ok = true;
        for (size_t i = 0; i < tail; i++) {
            uint32_t b;
            memcpy(&b, &out[cols + (int64_t)i], 4);
            tail_ok = tail_ok && b == 0xffffffffu;
        }
        cr_expect(tail_ok, "%s: norm_out written beyond its row", what);
        fprintf(stderr, "  %s: norm_out %s krk_rmsnorm's\n", what,
                memcmp(out, plain, (size_t)cols * 4) == 0 ? "identical to" : "differs from");
        /* the product of the staged (bf16-rounded) normalised row */
        memcpy(xr, out, (size_t)cols * sizeof(float));
        gt_round_bf16(xr, (size_t)cols);
        cr_assert_eq(kr_backend_matmul(be, xr, cols, 1, &w.t, with_bias ? bias : NULL, ref, rows), KR_OK);
        gt_expect_close(what, got, ref, (size_t)rows, GEMV_NMSE, GEMV_ABS);
        if (with_acc) {
            gt_down(acc_got, d_acc, (size_t)rows * 4);
            cr_expect(is_exact_sum(acc_got, acc, got, (size_t)rows), "%s: acc is not acc + y", what);
            gt_dfree(d_acc);
        }
        kr_free(x);
        kr_free(acc);
        kr_free(ref_out);
        kr_free(out);
        kr_free(xr);
        kr_free(plain);
        kr_free(ref);
        kr_free(got);
        kr_free(acc_got);
        gt_dfree(d_buf);
        gt_dfree(d_out);
        gt_dfree(d_y);
        gt_dfree(d_plain);
    }
    weight_free(&w);
    gt_dfree(d_bias);
    gt_dfree(d_g);
    kr_free(bias);
    kr_free(g);
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
    p.ldy = 16;
    /* the fusions: acc apart from x and y; the norm at n = 1 only, for a row of at most
     * KRK_GEMV_NORM_MAX_COLS, with norm_out apart from x and y */
    p.n = 1;
    p.acc = d_y + 8; /* overlaps y */
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    p.acc = d_x + 32; /* overlaps x */
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    p.acc = d_y + 16; /* apart */
    cr_expect_eq(krk_gemv(&p, 0), KR_OK);
    p.acc = NULL;
    float *d_g = gt_dalloc(64 * 4), *d_out = gt_dalloc(64 * 4);
    p.norm_w = d_g;
    p.norm_eps = 1e-5f;
    p.norm_out = d_out;
    cr_expect_eq(krk_gemv(&p, 0), KR_OK);
    p.acc = d_out; /* overlaps norm_out */
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    p.acc = NULL;
    p.norm_out = NULL;
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    p.norm_out = d_x + 60; /* overlaps x */
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    p.norm_out = d_y; /* overlaps y */
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    p.norm_out = d_out;
    p.n = 2;
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    p.n = 1;
    p.rows = 1;
    p.cols = KRK_GEMV_NORM_MAX_COLS + 8;
    p.ldx = p.cols;
    cr_expect_eq(krk_gemv(&p, 0), KR_ERR_INVAL);
    gt_sync();
    gt_dfree(d_w);
    gt_dfree(d_x);
    gt_dfree(d_y);
    gt_dfree(d_g);
    gt_dfree(d_out);
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
