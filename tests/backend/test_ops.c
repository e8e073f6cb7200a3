/* The ops the forward pass fuses explicitly, on the CPU reference (fp32, exact): the RMSNorm that
 * adds the residual first (struct krk_rmsnorm_params.res) equals kr_backend_add followed by the
 * norm bit for bit; the bf16 copies the ops write for the next GEMM (out_bf16) are their fp32
 * outputs rounded to bf16 and leave those outputs unchanged; and a GEMM handed a bf16 operand
 * (struct krk_bf16_in) gives what it gives without one (the reference reads x in fp32). */
#include "backend.h"
#include "dtype.h"

#include <criterion/criterion.h>
#include <string.h>

#define N 5
#define DIM 48
#define LDX 56

static uint64_t rng_s = 0x9e3779b97f4a7c15ULL;

static float uniform(float lo, float hi)
{
    rng_s ^= rng_s << 13;
    rng_s ^= rng_s >> 7;
    rng_s ^= rng_s << 17;
    return lo + (hi - lo) * (float)(rng_s >> 40) / (float)(1 << 24);
}

static void fill(float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++) {
        x[i] = uniform(lo, hi);
    }
}

static void expect_bf16_of(const krk_bf16 *b, const float *x, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(b[i], kr_f32_to_bf16(x[i]), "%s: element %zu", what, i);
    }
}

Test(ops, rmsnorm_with_residual_equals_add_then_norm)
{
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    static float x0[N * LDX], res[N * DIM], w[DIM];
    static float xa[N * LDX], xb[N * LDX], outa[N * DIM], outb[N * DIM];
    static krk_bf16 ob[N * DIM];
    fill(x0, N * LDX, -3.0f, 3.0f);
    fill(res, N * DIM, -2.0f, 2.0f);
    fill(w, DIM, 0.5f, 1.5f);
    memcpy(xa, x0, sizeof xa);
    memcpy(xb, x0, sizeof xb);
    /* unfused: x += res row by row (x has a row stride), then the norm */
    for (int i = 0; i < N; i++) {
        cr_assert_eq(kr_backend_add(be, xa + i * LDX, res + i * DIM, DIM), KR_OK);
    }
    const struct krk_rmsnorm_params pa = {.x = xa, .ldx = LDX, .w = w, .n = N, .dim = DIM, .eps = 1e-5f,
                                          .out = outa};
    cr_assert_eq(kr_backend_rmsnorm(be, &pa), KR_OK);
    /* fused, with the bf16 copy */
    const struct krk_rmsnorm_params pb = {.x = xb, .ldx = LDX, .res = res, .w = w, .n = N, .dim = DIM, .eps = 1e-5f,
                                          .out = outb, .out_bf16 = ob};
    cr_assert_eq(kr_backend_rmsnorm(be, &pb), KR_OK);
    cr_assert(!memcmp(xa, xb, sizeof xa), "the residual stream (all of ldx) is the same bit for bit");
    cr_assert(!memcmp(outa, outb, sizeof outa), "the norm's output is the same bit for bit");
    expect_bf16_of(ob, outb, N * DIM, "rmsnorm out_bf16");
    /* an output aliasing x with a residual is refused */
    const struct krk_rmsnorm_params bad = {.x = xb, .ldx = LDX, .res = res, .w = w, .n = N, .dim = DIM,
                                           .eps = 1e-5f, .out = xb};
    cr_expect_eq(kr_backend_rmsnorm(be, &bad), KR_ERR_INVAL);
    kr_backend_free(be);
}

Test(ops, bf16_copies_are_the_outputs_rounded)
{
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    static float y[N * DIM], z[N * 2 * DIM], w[DIM], g1[N * DIM], g2[N * DIM], a1[N * DIM], a2[N * DIM];
    static krk_bf16 gb[N * DIM], ab[N * DIM];
    fill(y, N * DIM, -2.0f, 2.0f);
    fill(z, N * 2 * DIM, -2.0f, 2.0f);
    fill(w, DIM, 0.5f, 1.5f);
    struct krk_gated_rmsnorm_params gp = {.y = y, .z = z, .ldz = 2 * DIM, .w = w, .n = N, .dim = DIM, .group = 16,
                                          .eps = 1e-5f, .out = g1};
    cr_assert_eq(kr_backend_gated_rmsnorm(be, &gp), KR_OK);
    gp.out = g2;
    gp.out_bf16 = gb;
    cr_assert_eq(kr_backend_gated_rmsnorm(be, &gp), KR_OK);
    cr_assert(!memcmp(g1, g2, sizeof g1));
    expect_bf16_of(gb, g2, N * DIM, "gated rmsnorm out_bf16");
    struct krk_act_params ap = {.act = KR_ACT_SILU, .gate = z, .x = z + DIM, .ld_in = 2 * DIM, .n = N, .width = DIM,
                                .out = a1};
    cr_assert_eq(kr_backend_act(be, &ap), KR_OK);
    ap.out = a2;
    ap.out_bf16 = ab;
    cr_assert_eq(kr_backend_act(be, &ap), KR_OK);
    cr_assert(!memcmp(a1, a2, sizeof a1));
    expect_bf16_of(ab, a2, N * DIM, "act out_bf16");
    kr_backend_free(be);
}

Test(ops, matmul_reads_x_in_fp32_whatever_bf16_operand_it_is_given)
{
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    enum { ROWS = 24 };
    static float x[N * DIM], wf[ROWS * DIM], y1[N * ROWS], y2[N * ROWS], o1[N * ROWS], o2[N * ROWS];
    static krk_bf16 xb[N * DIM], ob[N * ROWS];
    fill(x, N * DIM, -1.0f, 1.0f);
    fill(wf, ROWS * DIM, -1.0f, 1.0f);
    for (size_t i = 0; i < N * DIM; i++) {
        xb[i] = 0x7fc0; /* NaN: a reference reading it would show */
    }
    const struct kr_tensor w = {.data = wf, .dtype = KR_DTYPE_F32, .rows = ROWS, .cols = DIM};
    const struct krk_bf16_in in = {.data = xb, .ld = DIM, .cap = N * DIM, .filled = true};
    cr_assert_eq(kr_backend_matmul(be, x, DIM, N, &w, NULL, y1, ROWS, NULL), KR_OK);
    cr_assert_eq(kr_backend_matmul(be, x, DIM, N, &w, NULL, y2, ROWS, &in), KR_OK);
    cr_assert(!memcmp(y1, y2, sizeof y1));
    /* matmul_act: the activation of y, and its bf16 copy when asked */
    cr_assert_eq(kr_backend_matmul_act(be, x, DIM, N, &w, NULL, y2, ROWS, KR_ACT_RELU2, o2, ob, &in), KR_OK);
    const struct krk_act_params ap = {.act = KR_ACT_RELU2, .x = y1, .ld_in = ROWS, .n = N, .width = ROWS, .out = o1};
    cr_assert_eq(kr_backend_act(be, &ap), KR_OK);
    cr_assert(!memcmp(o1, o2, sizeof o1));
    expect_bf16_of(ob, o2, N * ROWS, "matmul_act out_bf16");
    cr_expect(!kr_backend_bf16_operands(be, 8), "the CPU's GEMMs take fp32 operands");
    kr_backend_free(be);
}
