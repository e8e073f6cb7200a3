/* The FP8 recipes (model/fp8.h) against references written here from the definitions alone: E4M3
 * values from the format's formula, encoding by a nearest-value scan, the Hadamard transform as an
 * explicit Sylvester matrix product, scales from their formulas, index scores in fp64 on dequantized
 * and on unquantized vectors, block-scaled weights checked code by code against a scan, and the
 * reference product against the fp64 sum of its scaled blocks and against the unquantized product. */
#include "backend.h"
#include "fp8.h"

#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ------------------------------------------------------------------------------- */

/* splitmix64: a fixed, seeded stream for reproducible data. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1). */
static double rng_uniform(uint64_t *s)
{
    return (double)(rng_next(s) >> 11) * 0x1p-53;
}

/* Standard normal (Box-Muller). */
static double rng_gauss(uint64_t *s)
{
    const double u = 1.0 - rng_uniform(s), v = rng_uniform(s);
    return sqrt(-2.0 * log(u)) * cos(2.0 * M_PI * v);
}

/* E4M3 value of a code from the format's definition: (-1)^s * 2^(e-7) * (1 + m/8) for e >= 1,
 * (-1)^s * 2^-6 * m/8 for e = 0, NaN for S.1111.111. */
static double spec_e4m3(int code)
{
    const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7) {
        return NAN;
    }
    const double mag = e == 0 ? pow(2.0, -6) * (m / 8.0) : pow(2.0, e - 7) * (1.0 + m / 8.0);
    return s ? -mag : mag;
}

/* The reference conversion clamp(x, -448, 448) -> e4m3 by brute force: among the finite codes with
 * x's sign, the one nearest to the clamped |x|, ties to the even code (even mantissa). */
static uint8_t brute_encode(float x)
{
    if (isnan(x)) {
        return 0x7f;
    }
    const int sign = signbit(x) ? 0x80 : 0;
    const double a = fmin(fabs((double)x), 448.0);
    int best = -1;
    double best_d = INFINITY;
    for (int c = 0; c < 128; c++) {
        if (c == 0x7f) {
            continue;
        }
        const double d = fabs(a - fabs(spec_e4m3(c)));
        if (d < best_d || (d == best_d && (c & 1) == 0)) {
            best = c;
            best_d = d;
        }
    }
    return (uint8_t)(sign | best);
}

/* The spacing of E4M3 values around |y| (subnormal spacing below 2^-6). */
static double e4m3_ulp(double y)
{
    const double a = fabs(y);
    const int E = a < 0x1p-6 ? -6 : (int)floor(log2(a));
    return ldexp(1.0, (E < -6 ? -6 : E) - 3);
}

/* The reference kernel's ue8m0 scale, bit for bit: fast_pow2(fast_log2_ceil(amax * fp8_max_inv)). */
static float kernel_ue8m0_scale(float amax)
{
    const float v = amax * (1.0f / 448.0f);
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    const int32_t e = (int32_t)((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
    const uint32_t out = (uint32_t)(e + 127) << 23;
    float s;
    memcpy(&s, &out, sizeof s);
    return s;
}

/* ---- E4M3 ---------------------------------------------------------------------------------- */

Test(fp8, decodes_all_256_codes_as_the_format_defines)
{
    for (int c = 0; c < 256; c++) {
        const double want = spec_e4m3(c);
        const float got = kr_fp8_e4m3_to_f32((uint8_t)c);
        if (isnan(want)) {
            cr_expect(isnan(got), "code 0x%02x must be NaN, got %g", c, (double)got);
        } else {
            cr_expect((double)got == want && !signbit(got) == !signbit(want), "code 0x%02x: got %a, want %a",
                      c, (double)got, want);
        }
    }
    cr_expect_eq(kr_fp8_e4m3_to_f32(0x7e), 448.0f);
    cr_expect_eq(kr_fp8_e4m3_to_f32(0x01), 0x1p-9f);
}

/* Checks one value, counting and reporting (the first few) mismatches. */
static void check_encode(float x, int *n_bad)
{
    const uint8_t want = brute_encode(x), got = kr_fp8_e4m3_from_f32(x);
    if (got != want) {
        if (++*n_bad <= 10) {
            cr_log_error("e4m3(%a = %g): got 0x%02x, want 0x%02x", (double)x, (double)x, got, want);
        }
    }
}

Test(fp8, encodes_like_a_nearest_value_scan_with_ties_to_even)
{
    int n_bad = 0, n = 0;
    /* Every finite value, every midpoint between neighbours (an exact tie) and the floats next to it. */
    for (int c = 0; c < 0x7e; c++) {
        const float lo = (float)spec_e4m3(c), hi = (float)spec_e4m3(c + 1);
        const float mid = (float)(((double)lo + (double)hi) / 2.0); /* exact: a few significant bits */
        const float cases[] = {lo, hi, mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY)};
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            check_encode(cases[i], &n_bad);
            check_encode(-cases[i], &n_bad);
            n += 2;
        }
    }
    /* Saturation, signed zeros, NaN, the float subnormal range. */
    const float special[] = {0.0f,     -0.0f,    448.0f,    nextafterf(448.0f, INFINITY),
                             464.0f,   480.0f,   1e4f,      FLT_MAX,
                             INFINITY, NAN,      1e-45f,    FLT_MIN,
                             0x1p-10f, 0x1p-9f,  0x1.8p-9f, 0x1p-11f,
                             3e-3f,    0x1.fp-7f};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++) {
        check_encode(special[i], &n_bad);
        check_encode(-special[i], &n_bad);
        n += 2;
    }
    /* Random floats: all 23 mantissa bits, binades 2^-14 (below half the smallest subnormal) to 2^12. */
    uint64_t seed = 1;
    for (int i = 0; i < 500000; i++) {
        const uint64_t r = rng_next(&seed);
        const int E = -14 + (int)(r % 27);
        const float m = 1.0f + (float)((r >> 8) & 0x7fffff) * 0x1p-23f;
        check_encode(((r >> 40) & 1) ? -ldexpf(m, E) : ldexpf(m, E), &n_bad);
        n++;
    }
    cr_expect_eq(n_bad, 0, "%d of %d encodings differ from the nearest-value scan", n_bad, n);
    /* Spot checks written out: ties to even, saturation, canonical NaN. */
    cr_expect_eq(kr_fp8_e4m3_from_f32(0x1p-10f), 0x00);  /* 2^-10: tie between 0 and 2^-9 -> 0 */
    cr_expect_eq(kr_fp8_e4m3_from_f32(0x1.8p-9f), 0x02); /* 1.5 * 2^-9: tie 2^-9 / 2^-8 -> 2^-8 */
    cr_expect_eq(kr_fp8_e4m3_from_f32(1.0625f), 0x38);   /* tie 1 / 1.125 -> 1 */
    cr_expect_eq(kr_fp8_e4m3_from_f32(1.1875f), 0x3a);   /* tie 1.125 / 1.25 -> 1.25 */
    cr_expect_eq(kr_fp8_e4m3_from_f32(-1e9f), 0xfe);
    cr_expect_eq(kr_fp8_e4m3_from_f32(-0.0f), 0x80);
    cr_expect_eq(kr_fp8_e4m3_from_f32(-NAN), 0x7f);
}

/* ---- Hadamard ------------------------------------------------------------------------------ */

/* H_n [n, n] by the Sylvester recursion H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]. */
static void sylvester(double *H, int n)
{
    H[0] = 1.0;
    for (int m = 1; m < n; m *= 2) {
        for (int i = 0; i < m; i++) {
            for (int j = 0; j < m; j++) {
                const double v = H[i * n + j];
                H[i * n + j + m] = v;
                H[(i + m) * n + j] = v;
                H[(i + m) * n + j + m] = -v;
            }
        }
    }
}

Test(fp8, hadamard_equals_the_sylvester_matrix_product)
{
    enum { N_MAX = 256 };
    static double H[N_MAX * N_MAX];
    float x[N_MAX], x0[N_MAX];
    uint64_t seed = 2;
    double worst = 0.0; /* largest error / bound over the float inputs */
    for (int n = 1; n <= N_MAX; n *= 2) {
        sylvester(H, n);
        /* Small integers: every partial sum is an integer below 2^24, so with scale 1 the result is exact. */
        for (int i = 0; i < n; i++) {
            x[i] = x0[i] = (float)((int)(rng_next(&seed) % 2001) - 1000);
        }
        cr_assert_eq(kr_fp8_hadamard(x, n, 1.0f), KR_OK);
        for (int i = 0; i < n; i++) {
            double y = 0.0;
            for (int j = 0; j < n; j++) {
                y += H[i * n + j] * x0[j];
            }
            cr_expect_eq((double)x[i], y, "n=%d row %d: got %g, want %g", n, i, (double)x[i], y);
        }
        /* Gaussian floats with the orthonormal scale. Each of the log2(n) stages and the final scaling
         * add at most 2^-24 relative to a sum bounded by Σ|x|, so the bound asserted is
         * (log2(n) + 2) * 2^-24 * scale * Σ|x|. */
        const float scale = (float)(1.0 / sqrt((double)n));
        double sum_abs = 0.0;
        for (int i = 0; i < n; i++) {
            x[i] = x0[i] = (float)rng_gauss(&seed);
            sum_abs += fabs((double)x0[i]);
        }
        cr_assert_eq(kr_fp8_hadamard(x, n, scale), KR_OK);
        const double bound = (log2((double)n) + 2.0) * 0x1p-24 * scale * sum_abs;
        for (int i = 0; i < n; i++) {
            double y = 0.0;
            for (int j = 0; j < n; j++) {
                y += H[i * n + j] * x0[j];
            }
            y *= scale;
            const double err = fabs((double)x[i] - y);
            worst = fmax(worst, err / bound);
            cr_expect_leq(err, bound, "n=%d row %d: |%g - %g| > %g", n, i, (double)x[i], y, bound);
        }
    }
    cr_log_info("hadamard: largest error / bound = %.3f", worst);
}

Test(fp8, hadamard_with_scale_n_pow_minus_half_is_its_own_inverse)
{
    uint64_t seed = 3;
    for (int n = 1; n <= 256; n *= 2) {
        float x[256], x0[256];
        for (int i = 0; i < n; i++) {
            x[i] = x0[i] = (float)rng_gauss(&seed);
        }
        const float scale = (float)(1.0 / sqrt((double)n));
        cr_assert_eq(kr_fp8_hadamard(x, n, scale), KR_OK);
        cr_assert_eq(kr_fp8_hadamard(x, n, scale), KR_OK);
        double d2 = 0.0, x2 = 0.0;
        for (int i = 0; i < n; i++) {
            d2 += ((double)x[i] - x0[i]) * ((double)x[i] - x0[i]);
            x2 += (double)x0[i] * x0[i];
        }
        cr_expect_leq(sqrt(d2), 1e-6 * sqrt(x2), "n=%d: |H(H(x)) - x| / |x| = %g", n, sqrt(d2 / x2));
    }
}

Test(fp8, hadamard_rejects_lengths_that_are_not_powers_of_two)
{
    float x[300];
    for (int i = 0; i < 300; i++) {
        x[i] = (float)i;
    }
    const int64_t bad[] = {0, -1, -4, 3, 6, 12, 100, 255, 257};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_expect_eq(kr_fp8_hadamard(x, bad[i], 1.0f), KR_ERR_INVAL, "n=%lld", (long long)bad[i]);
    }
    for (int i = 0; i < 300; i++) {
        cr_expect_eq(x[i], (float)i, "x[%d] was modified", i);
    }
    cr_expect_eq(kr_fp8_hadamard(NULL, 4, 1.0f), KR_ERR_INVAL);
}

/* ---- act_quant ----------------------------------------------------------------------------- */

/* max(max |x|, 1e-4) of one block, as the reference computes it. */
static float block_amax(const float *x, int64_t block)
{
    float a = 1e-4f;
    for (int64_t i = 0; i < block; i++) {
        a = fmaxf(a, fabsf(x[i]));
    }
    return a;
}

/* Checks one quantized block: its scale against the formula, each element within half an E4M3 ulp
 * of x/s (plus the fp32 rounding of x/s when s is not a power of two), the block maximum at the top
 * of the range. */
static void check_block(const float *x, int64_t block, bool ue8m0, const uint8_t *q, float s)
{
    const float amax = block_amax(x, block);
    if (ue8m0) {
        int e;
        cr_expect_eq(frexpf(s, &e), 0.5f, "ue8m0 scale %a is not a power of two", (double)s);
        cr_expect((double)s * 448.0 >= amax, "scale %a too small for amax %a", (double)s, (double)amax);
        cr_expect((double)s * 224.0 < amax, "scale %a not the smallest for amax %a", (double)s, (double)amax);
        cr_expect_eq(s, kernel_ue8m0_scale(amax), "scale %a differs from the kernel's %a for amax %a",
                     (double)s, (double)kernel_ue8m0_scale(amax), (double)amax);
    } else {
        cr_expect_eq(s, amax * (1.0f / 448.0f), "scale %a for amax %a", (double)s, (double)amax);
        const double exact = amax / 448.0;
        cr_expect_leq(fabs(s - exact), 0x1p-23 * exact, "scale %a vs amax/448 = %a", (double)s, exact);
    }
    double top = 0.0;
    for (int64_t i = 0; i < block; i++) {
        const double y = fmin(fmax((double)x[i] / s, -448.0), 448.0);
        const double d = kr_fp8_e4m3_to_f32(q[i]);
        const double tol = 0.5 * e4m3_ulp(y) + (ue8m0 ? 0.0 : 0x1p-23 * fabs(y));
        cr_expect_leq(fabs(d - y), tol, "x=%a s=%a: code 0x%02x = %g, x/s = %g", (double)x[i], (double)s,
                      q[i], d, y);
        cr_expect_leq(fabs(d * s - x[i]), tol * s);
        top = fmax(top, fabs(d));
    }
    if (amax > 1e-4f) {
        if (ue8m0) {
            /* amax / s is in (224, 448], and E4M3 rounding keeps it in [224, 448] */
            cr_expect(top >= 224.0 && top <= 448.0, "block maximum decodes to %g", top);
        } else {
            cr_expect_eq(top, 448.0, "block maximum decodes to %g", top);
        }
    }
}

Test(fp8, act_quant_scales_and_values_follow_the_formulas)
{
    enum { BLOCK = 128, NB = 4, N = BLOCK * NB };
    float x[N], s[NB];
    uint8_t q[N];
    uint64_t seed = 4;
    for (int it = 0; it < 300; it++) {
        for (int b = 0; b < NB; b++) {
            const double mag = pow(10.0, -7.0 + 12.0 * rng_uniform(&seed)); /* 1e-7 .. 1e5 */
            for (int i = 0; i < BLOCK; i++) {
                x[b * BLOCK + i] = (float)(mag * rng_gauss(&seed));
            }
        }
        for (int ue = 0; ue < 2; ue++) {
            cr_assert_eq(kr_fp8_act_quant(x, N, BLOCK, ue, q, s), KR_OK);
            for (int b = 0; b < NB; b++) {
                check_block(x + b * BLOCK, BLOCK, ue, q + b * BLOCK, s[b]);
            }
        }
    }
}

Test(fp8, act_quant_ue8m0_scale_at_and_around_powers_of_two)
{
    enum { BLOCK = 128 };
    float x[BLOCK], s;
    uint8_t q[BLOCK];
    uint64_t seed = 5;
    /* amax = 448 * 2^k gives exactly 2^k and a maximum of ±448; one float above gives 2^(k+1). */
    for (int k = -22; k <= 40; k++) {
        const float edge = ldexpf(448.0f, k);
        const float amaxes[] = {edge, nextafterf(edge, 0.0f), nextafterf(edge, INFINITY)};
        const float want[] = {ldexpf(1.0f, k), ldexpf(1.0f, k), ldexpf(1.0f, k + 1)};
        for (int c = 0; c < 3; c++) {
            for (int i = 0; i < BLOCK; i++) {
                x[i] = (float)(0.5 * amaxes[c] * (2.0 * rng_uniform(&seed) - 1.0));
            }
            x[17] = -amaxes[c];
            cr_assert_eq(kr_fp8_act_quant(x, BLOCK, BLOCK, true, q, &s), KR_OK);
            cr_expect_eq(s, want[c], "k=%d case %d: scale %a, want %a", k, c, (double)s, (double)want[c]);
            check_block(x, BLOCK, true, q, s);
            if (c == 0) {
                cr_expect_eq(q[17], 0xfe, "k=%d: -448 * 2^k encodes as 0x%02x", k, q[17]);
            }
        }
    }
}

Test(fp8, act_quant_all_zero_and_tiny_blocks_use_the_1e_minus_4_floor)
{
    enum { BLOCK = 128 };
    float x[2 * BLOCK], s[2];
    uint8_t q[2 * BLOCK];
    for (int i = 0; i < BLOCK; i++) {
        x[i] = (i & 1) ? -0.0f : 0.0f;
        x[BLOCK + i] = (float)(1e-6 * sin(i + 1.0)); /* |x| < 1e-4 */
    }
    cr_assert_eq(kr_fp8_act_quant(x, 2 * BLOCK, BLOCK, false, q, s), KR_OK);
    cr_expect_eq(s[0], 1e-4f * (1.0f / 448.0f));
    cr_expect_eq(s[1], 1e-4f * (1.0f / 448.0f));
    cr_assert_eq(kr_fp8_act_quant(x, 2 * BLOCK, BLOCK, true, q, s), KR_OK);
    cr_expect_eq(s[0], 0x1p-22f); /* 448 * 2^-22 = 1.07e-4 >= 1e-4 > 448 * 2^-23 */
    cr_expect_eq(s[1], 0x1p-22f);
    for (int i = 0; i < BLOCK; i++) {
        cr_expect_eq(q[i], (i & 1) ? 0x80 : 0x00, "zero %d encodes as 0x%02x", i, q[i]);
    }
    check_block(x + BLOCK, BLOCK, true, q + BLOCK, s[1]);
}

Test(fp8, act_quant_rejects_bad_arguments)
{
    float x[256] = {0}, s[2];
    uint8_t q[256];
    cr_expect_eq(kr_fp8_act_quant(x, 200, 128, false, q, s), KR_ERR_INVAL);
    cr_expect_eq(kr_fp8_act_quant(x, 256, 0, false, q, s), KR_ERR_INVAL);
    cr_expect_eq(kr_fp8_act_quant(x, -128, 128, false, q, s), KR_ERR_INVAL);
    cr_expect_eq(kr_fp8_act_quant(NULL, 256, 128, false, q, s), KR_ERR_INVAL);
    cr_expect_eq(kr_fp8_act_quant(x, 256, 128, false, NULL, s), KR_ERR_INVAL);
    cr_expect_eq(kr_fp8_act_quant(x, 256, 128, false, q, NULL), KR_ERR_INVAL);
    x[200] = NAN;
    cr_expect_eq(kr_fp8_act_quant(x, 256, 128, true, q, s), KR_ERR_INVAL);
    x[200] = -INFINITY;
    cr_expect_eq(kr_fp8_act_quant(x, 256, 128, true, q, s), KR_ERR_INVAL);
    x[200] = 0.0f;
    cr_expect_eq(kr_fp8_act_quant(x, 0, 128, true, q, s), KR_OK);
}

/* ---- index score --------------------------------------------------------------------------- */

Test(fp8, index_score_of_a_hand_computed_example)
{
    /* Dots: q0.k0 = 2, q1.k0 = 2.5, q0.k1 = -0.5 (relu -> 0), q1.k1 = 1.5.
     * score0 = 1 * (2 * 0.25 * 2 + 2.5 * -1 * 0.5) = -0.25; score1 = 4 * (1.5 * -1 * 0.5) = -3. */
    const float qf[2][4] = {{1, 2, 0, -1}, {0.5f, 0, 1, 1}}, kf[2][4] = {{1, 1, 1, 1}, {-1, 0.25f, 2, 0}};
    const float q_scale[2] = {2.0f, 0.5f}, w[2] = {0.25f, -1.0f}, k_scale[2] = {1.0f, 4.0f};
    uint8_t q[8], k[8];
    for (int i = 0; i < 8; i++) {
        q[i] = kr_fp8_e4m3_from_f32(qf[i / 4][i % 4]);
        k[i] = kr_fp8_e4m3_from_f32(kf[i / 4][i % 4]);
    }
    float score[2];
    cr_assert_eq(kr_fp8_index_score(q, q_scale, w, 2, 4, k, k_scale, 2, score), KR_OK);
    cr_expect_eq(score[0], -0.25f);
    cr_expect_eq(score[1], -3.0f);
    cr_expect_eq(kr_fp8_index_score(q, q_scale, w, 2, 4, k, k_scale, 0, score), KR_OK);
    cr_expect_eq(kr_fp8_index_score(q, q_scale, w, 0, 4, k, k_scale, 2, score), KR_ERR_INVAL);
    cr_expect_eq(kr_fp8_index_score(q, q_scale, w, 2, 0, k, k_scale, 2, score), KR_ERR_INVAL);
    cr_expect_eq(kr_fp8_index_score(q, q_scale, w, 2, 4, k, k_scale, -1, score), KR_ERR_INVAL);
    cr_expect_eq(kr_fp8_index_score(q, q_scale, NULL, 2, 4, k, k_scale, 2, score), KR_ERR_INVAL);
}

enum { HI = 64, DI = 128, NKV = 512 };

/* One query and NKV keys of Gaussian data (each key row with its own magnitude), and head weights
 * with the reference's Hi^-0.5 * Di^-0.5. */
struct index_case {
    float q[HI * DI];  /* [HI, DI] */
    float k[NKV * DI]; /* [NKV, DI] */
    float w[HI];       /* [HI] */
};

static void index_case_fill(struct index_case *c, uint64_t seed)
{
    for (int i = 0; i < HI * DI; i++) {
        c->q[i] = (float)rng_gauss(&seed);
    }
    for (int s = 0; s < NKV; s++) {
        const double mag = pow(10.0, -1.0 + 2.0 * rng_uniform(&seed));
        for (int i = 0; i < DI; i++) {
            c->k[s * DI + i] = (float)(mag * rng_gauss(&seed));
        }
    }
    for (int h = 0; h < HI; h++) {
        c->w[h] = (float)(rng_gauss(&seed) / sqrt((double)HI) / sqrt((double)DI));
    }
}

/* Σ_h w[h] relu(q[h] . k[s]) in fp64, and Σ_h |w[h]| relu(q[h] . k[s]), the scale of the rounding
 * errors of the sum (the score itself can cancel to near zero). */
static void score_f64(const double *q, const double *k, const float *w, double *score, double *cond)
{
    for (int s = 0; s < NKV; s++) {
        score[s] = cond[s] = 0.0;
        for (int h = 0; h < HI; h++) {
            double dot = 0.0;
            for (int i = 0; i < DI; i++) {
                dot += q[h * DI + i] * k[s * DI + i];
            }
            score[s] += w[h] * fmax(dot, 0.0);
            cond[s] += fabs(w[h]) * fmax(dot, 0.0);
        }
    }
}

Test(fp8, index_score_equals_the_fp32_formula_on_dequantized_values)
{
    static struct index_case c;
    static uint8_t q8[HI * DI], k8[NKV * DI];
    static float q_scale[HI], k_scale[NKV], score[NKV];
    static double qd[HI * DI], kd[NKV * DI], ref[NKV], cond[NKV];
    index_case_fill(&c, 6);
    for (int ue = 0; ue < 2; ue++) {
        cr_assert_eq(kr_fp8_act_quant(c.q, HI * DI, DI, ue, q8, q_scale), KR_OK);
        cr_assert_eq(kr_fp8_act_quant(c.k, NKV * DI, DI, ue, k8, k_scale), KR_OK);
        for (int i = 0; i < HI * DI; i++) {
            qd[i] = (double)spec_e4m3(q8[i]) * q_scale[i / DI];
        }
        for (int i = 0; i < NKV * DI; i++) {
            kd[i] = (double)spec_e4m3(k8[i]) * k_scale[i / DI];
        }
        score_f64(qd, kd, c.w, ref, cond);
        cr_assert_eq(kr_fp8_index_score(q8, q_scale, c.w, HI, DI, k8, k_scale, NKV, score), KR_OK);
        double worst = 0.0;
        for (int s = 0; s < NKV; s++) {
            const double err = fabs(score[s] - ref[s]);
            worst = fmax(worst, err / cond[s]);
            cr_expect_leq(err, 1e-5 * cond[s], "ue8m0=%d key %d: %g vs %g (cond %g)", ue, s, (double)score[s],
                          ref[s], cond[s]);
        }
        cr_log_info("index score vs dequantized fp64 (ue8m0=%d): max |err| / Σ|w| relu = %.3g", ue, worst);
    }
}

/* The full FP8 path (Hadamard, act_quant, index score) against the fp64 score of the unquantized
 * vectors. E4M3 keeps 3 mantissa bits: an element's relative rounding error has an RMS of about 0.026,
 * so a dot product of two quantized vectors is off by about sqrt(2) * 0.026 of its size, an expected
 * NMSE near 1.4e-3. Measured on this data (seed 7): NMSE 9.4e-4 (plain scale) / 1.0e-3 (ue8m0), largest
 * per-key error 0.035 / 0.042 of Σ_h |w| relu(q.k); over seeds 100..119 the NMSE ranged up to 2.8e-3
 * and the per-key error up to 0.066. Asserted, with margin: NMSE < 3e-3 and per-key error
 * < 0.15 Σ_h |w| relu(q.k). A Hadamard transform of the queries alone (keys left as they are) breaks
 * the score, and must fail the NMSE bound by far. */
Test(fp8, index_score_after_hadamard_tracks_the_unquantized_score)
{
    static struct index_case c;
    static float qh[HI * DI], kh[NKV * DI], q_scale[HI], k_scale[NKV], score[NKV];
    static uint8_t q8[HI * DI], k8[NKV * DI];
    static double qd[HI * DI], kd[NKV * DI], ref[NKV], cond[NKV];
    index_case_fill(&c, 7);
    for (int i = 0; i < HI * DI; i++) {
        qd[i] = c.q[i];
    }
    for (int i = 0; i < NKV * DI; i++) {
        kd[i] = c.k[i];
    }
    score_f64(qd, kd, c.w, ref, cond);
    memcpy(qh, c.q, sizeof qh);
    memcpy(kh, c.k, sizeof kh);
    const float scale = (float)(1.0 / sqrt((double)DI));
    for (int h = 0; h < HI; h++) {
        cr_assert_eq(kr_fp8_hadamard(qh + h * DI, DI, scale), KR_OK);
    }
    for (int s = 0; s < NKV; s++) {
        cr_assert_eq(kr_fp8_hadamard(kh + s * DI, DI, scale), KR_OK);
    }
    for (int ue = 0; ue < 2; ue++) {
        cr_assert_eq(kr_fp8_act_quant(qh, HI * DI, DI, ue, q8, q_scale), KR_OK);
        cr_assert_eq(kr_fp8_act_quant(kh, NKV * DI, DI, ue, k8, k_scale), KR_OK);
        cr_assert_eq(kr_fp8_index_score(q8, q_scale, c.w, HI, DI, k8, k_scale, NKV, score), KR_OK);
        double se = 0.0, sr = 0.0, worst = 0.0;
        for (int s = 0; s < NKV; s++) {
            const double err = fabs(score[s] - ref[s]);
            se += err * err;
            sr += ref[s] * ref[s];
            worst = fmax(worst, err / cond[s]);
            cr_expect_leq(err, 0.15 * cond[s], "ue8m0=%d key %d: %g vs %g (cond %g)", ue, s, (double)score[s],
                          ref[s], cond[s]);
        }
        cr_expect_lt(se / sr, 3e-3, "ue8m0=%d: NMSE %g", ue, se / sr);
        cr_log_info("fp8 path vs unquantized (ue8m0=%d): NMSE %.3g, max |err| / Σ|w| relu = %.3g", ue,
                    se / sr, worst);
    }
    /* The negative control: keys quantized without their Hadamard transform. */
    cr_assert_eq(kr_fp8_act_quant(c.k, NKV * DI, DI, true, k8, k_scale), KR_OK);
    cr_assert_eq(kr_fp8_index_score(q8, q_scale, c.w, HI, DI, k8, k_scale, NKV, score), KR_OK);
    double se = 0.0, sr = 0.0;
    for (int s = 0; s < NKV; s++) {
        se += (score[s] - ref[s]) * (score[s] - ref[s]);
        sr += ref[s] * ref[s];
    }
    cr_expect_gt(se / sr, 0.1, "without the keys' Hadamard transform: NMSE %g", se / sr);
    cr_log_info("negative control (keys not transformed): NMSE %.3g", se / sr);
}

/* The CPU backend's FP8 round trip (what the model runs on indexer queries and keys) is the
 * Hadamard transform, act_quant and decode above, row by row: strided rows, one block per row and
 * several blocks per row, with and without ue8m0, bit for bit. Bad shapes are refused. */
Test(fp8, backend_round_trip_is_hadamard_then_act_quant_per_row)
{
    kr_backend_t be = kr_backend_cpu_create(2);
    cr_assert(be);
    cr_assert(kr_backend_can_fp8_round(be));
    static const struct {
        int64_t dim, block, ld, n;
        bool ue8m0;
    } cases[] = {{32, 32, 32, 7, true}, {128, 128, 160, 5, false}, {256, 128, 256, 3, true}, {64, 32, 100, 4, false}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int64_t dim = cases[c].dim, ld = cases[c].ld, n = cases[c].n, block = cases[c].block;
        float *x = malloc((size_t)(n * ld) * sizeof(float)), *want = malloc((size_t)(n * ld) * sizeof(float));
        uint64_t st = 1234 + c;
        for (int64_t i = 0; i < n * ld; i++) {
            x[i] = (float)rng_gauss(&st) * (i % 17 == 0 ? 30.0f : 1.0f);
        }
        memcpy(want, x, (size_t)(n * ld) * sizeof(float));
        for (int64_t r = 0; r < n; r++) {
            float *row = want + r * ld, sc[4];
            uint8_t q[256];
            cr_assert_eq(kr_fp8_hadamard(row, dim, (float)(1.0 / sqrt((double)dim))), KR_OK);
            cr_assert_eq(kr_fp8_act_quant(row, dim, block, cases[c].ue8m0, q, sc), KR_OK);
            for (int64_t j = 0; j < dim; j++) {
                row[j] = kr_fp8_e4m3_to_f32(q[j]) * sc[j / block];
            }
        }
        struct krk_fp8_round_params p = {.x = x, .ld = ld, .n = n, .dim = dim, .block = block, .hadamard = true,
                                        .ue8m0 = cases[c].ue8m0};
        cr_assert_eq(kr_backend_fp8_round(be, &p), KR_OK);
        cr_expect(!memcmp(x, want, (size_t)(n * ld) * sizeof(float)),
                  "case %zu: the backend's rows differ from the reference composition (or it touched the row gaps)", c);
        free(x);
        free(want);
    }
    float y[48] = {0};
    struct krk_fp8_round_params bad = {.x = y, .ld = 48, .n = 1, .dim = 48, .block = 48, .hadamard = true};
    cr_expect_eq(kr_backend_fp8_round(be, &bad), KR_ERR_INVAL, "48 is not a power of two");
    bad.dim = 32;
    bad.block = 24;
    cr_expect_eq(kr_backend_fp8_round(be, &bad), KR_ERR_INVAL, "32 is not a multiple of 24");
    kr_backend_free(be);
}

/* ---- the block-scaled weight recipe and the reference product ------------------------------------ */

/* The distance from v to the nearest finite E4M3 value (a scan of every code). */
static double nearest_e4m3_dist(double v)
{
    double best = INFINITY;
    for (int c = 0; c < 256; c++) {
        const double e = spec_e4m3(c);
        if (!isnan(e) && fabs(v - e) < best) {
            best = fabs(v - e);
        }
    }
    return best;
}

/* Blocks of 128 x 128 with edges (300 x 200: blocks of 44 rows and 72 columns at the edges), each
 * block of another magnitude, one all zero: the scale is the formula's, every code is a nearest value
 * of w / scale (a scan of all codes), and the dequantized weight is within half an E4M3 step. */
Test(fp8, weight_quant_scales_and_codes_follow_the_formulas)
{
    enum { R = 300, C = 200, B = 128 };
    const int64_t sr = (R + B - 1) / B, sc = (C + B - 1) / B;
    float *w = malloc(R * C * sizeof *w), *s = malloc((size_t)(sr * sc) * sizeof *s);
    uint8_t *q = malloc(R * C);
    cr_assert(w && s && q);
    uint64_t seed = 77;
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < C; c++) {
            const int blk = (int)((r / B) * sc + c / B);
            w[r * C + c] = blk == 1 ? 0.0f : (float)(rng_gauss(&seed) * pow(10.0, blk - 3));
        }
    }
    cr_assert_eq(kr_fp8_weight_quant(w, R, C, B, B, q, s), KR_OK);
    int bad_scale = 0, bad_code = 0;
    for (int64_t br = 0; br < sr; br++) {
        for (int64_t bc = 0; bc < sc; bc++) {
            float amax = 1e-4f;
            for (int64_t r = br * B; r < R && r < (br + 1) * B; r++) {
                for (int64_t c = bc * B; c < C && c < (bc + 1) * B; c++) {
                    amax = fmaxf(amax, fabsf(w[r * C + c]));
                }
            }
            const float want = amax * (1.0f / 448.0f);
            bad_scale += memcmp(&want, &s[br * sc + bc], sizeof want) != 0;
            for (int64_t r = br * B; r < R && r < (br + 1) * B; r++) {
                for (int64_t c = bc * B; c < C && c < (bc + 1) * B; c++) {
                    const double v = (double)(w[r * C + c] / want);
                    const double got = spec_e4m3(q[r * C + c]);
                    bad_code += fabs(v - got) > nearest_e4m3_dist(v);
                }
            }
        }
    }
    cr_expect_eq(bad_scale, 0, "%d block scales differ from max(amax, 1e-4) * fp32(1/448)", bad_scale);
    cr_expect_eq(bad_code, 0, "%d codes are not a nearest E4M3 value of w / scale", bad_code);
    free(w);
    free(s);
    free(q);
}

/* The reference product against the same sum in fp64 (dequantized values, the block scales): only
 * fp32 rounding may differ, a few units in the last place of the sum of the blocks' magnitudes. */
Test(fp8, gemm_equals_the_fp64_sum_of_scaled_block_products)
{
    /* K = 320: two blocks of 128 and a last one of 64 */
    enum { M = 5, K = 320, N = 200, B = 128, NKB = (K + B - 1) / B };
    static float a[M * K], b[N * K], as[M * NKB], bs[((N + B - 1) / B) * NKB], c[M * N];
    static uint8_t aq[M * K], bq[N * K];
    uint64_t seed = 5;
    for (int i = 0; i < M * K; i++) {
        a[i] = (float)rng_gauss(&seed);
    }
    for (int i = 0; i < N * K; i++) {
        b[i] = (float)(rng_gauss(&seed) * 0.02);
    }
    for (int i = 0; i < M; i++) {
        for (int kb = 0; kb < NKB; kb++) {
            const int len = K - kb * B < B ? K - kb * B : B;
            cr_assert_eq(kr_fp8_act_quant(a + i * K + kb * B, len, len, false, aq + i * K + kb * B, as + i * NKB + kb),
                         KR_OK);
        }
    }
    cr_assert_eq(kr_fp8_weight_quant(b, N, K, B, B, bq, bs), KR_OK);
    cr_assert_eq(kr_fp8_gemm(aq, as, M, K, bq, bs, N, B, B, c), KR_OK);
    int bad = 0;
    double worst = 0;
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) {
            double ref = 0, mag = 0;
            for (int kb = 0; kb < NKB; kb++) {
                double d = 0;
                for (int t = kb * B; t < (kb + 1) * B && t < K; t++) {
                    d += spec_e4m3(aq[i * K + t]) * spec_e4m3(bq[j * K + t]);
                }
                const double term = d * as[i * NKB + kb] * bs[(j / B) * NKB + kb];
                ref += term;
                mag += fabs(term);
            }
            const double err = fabs((double)c[i * N + j] - ref);
            worst = fmax(worst, err / mag);
            bad += err > 8 * FLT_EPSILON * mag;
        }
    }
    cr_expect_eq(bad, 0, "%d outputs beyond 8 ulp of the blocks' magnitude (worst %.3g)", bad, worst);
}

/* An FP8 weight's products on the CPU backend quantize their activations as the weight says: amax / 448
 * scales, or with act_ue8m0 (a DeepSeek checkpoint's scale_fmt "ue8m0", as its linear() does) the
 * reference kernel's power-of-two scale. Held to the fp64 sum of block products over activations
 * quantized here by the definitions (brute-force encoding), 8 ulp of the blocks' magnitude. */
Test(fp8, backend_matmul_quantizes_activations_as_the_weight_says)
{
    enum { M = 3, K = 320, N = 130, B = 128, NKB = (K + B - 1) / B };
    static float x[M * K], w[N * K], ws[((N + B - 1) / B) * NKB], y[2][M * N];
    static uint8_t wq[N * K];
    uint64_t seed = 11;
    for (int i = 0; i < M * K; i++) {
        x[i] = (float)(rng_gauss(&seed) * (i % 37 == 0 ? 30.0 : 1.0));
    }
    for (int i = 0; i < N * K; i++) {
        w[i] = (float)(rng_gauss(&seed) * 0.05);
    }
    cr_assert_eq(kr_fp8_weight_quant(w, N, K, B, B, wq, ws), KR_OK);
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    for (int ue = 0; ue < 2; ue++) {
        const struct kr_tensor t = {.data = wq, .dtype = KR_DTYPE_F8_E4M3, .rows = N, .cols = K, .scale = ws,
                                    .block_r = B, .block_c = B, .act_ue8m0 = ue};
        cr_assert_eq(kr_backend_matmul(be, x, K, M, &t, NULL, y[ue], N, NULL), KR_OK);
        int bad = 0;
        for (int i = 0; i < M; i++) {
            double as[NKB];
            static uint8_t aq[K];
            for (int kb = 0; kb < NKB; kb++) {
                const int t0 = kb * B, t1 = t0 + B < K ? t0 + B : K;
                float amax = 1e-4f;
                for (int c = t0; c < t1; c++) {
                    amax = fmaxf(amax, fabsf(x[i * K + c]));
                }
                float sc = amax * (1.0f / 448.0f);
                if (ue) { /* the smallest power of two with 448 s >= amax */
                    double p2 = 0x1p-140;
                    while (p2 * 448.0 < amax) {
                        p2 *= 2.0;
                    }
                    sc = (float)p2;
                }
                as[kb] = sc;
                for (int c = t0; c < t1; c++) {
                    aq[c] = brute_encode(x[i * K + c] / sc);
                }
            }
            for (int j = 0; j < N; j++) {
                double ref = 0, mag = 0;
                for (int kb = 0; kb < NKB; kb++) {
                    double d = 0;
                    for (int c = kb * B; c < (kb + 1) * B && c < K; c++) {
                        d += spec_e4m3(aq[c]) * spec_e4m3(wq[j * K + c]);
                    }
                    const double term = d * as[kb] * ws[(j / B) * NKB + kb];
                    ref += term;
                    mag += fabs(term);
                }
                bad += fabs((double)y[ue][i * N + j] - ref) > 8 * FLT_EPSILON * mag;
            }
        }
        cr_expect_eq(bad, 0, "%d outputs (act_ue8m0 %d) beyond 8 ulp of the blocks' magnitude", bad, ue);
    }
    int differ = 0;
    for (int i = 0; i < M * N; i++) {
        differ += y[0][i] != y[1][i];
    }
    cr_expect_gt(differ, 0, "power-of-two activation scales changed no output");
    kr_backend_free(be);
}

/* Against the unquantized product (fp64 of the original fp32 values): E4M3 keeps 3 mantissa bits,
 * so each product is off by up to about 2 x 2^-4 relative and the errors of a dot product of random
 * signs add up like a random walk; the normalized error of the whole output stays near 2^-4 / sqrt(3)
 * per factor. Held to 0.08. */
Test(fp8, gemm_tracks_the_unquantized_product)
{
    enum { M = 8, K = 512, N = 256, B = 128 };
    static float a[M * K], b[N * K], as[M * (K / B)], bs[(N / B) * (K / B)], c[M * N];
    static uint8_t aq[M * K], bq[N * K];
    uint64_t seed = 9;
    for (int i = 0; i < M * K; i++) {
        a[i] = (float)rng_gauss(&seed);
    }
    for (int i = 0; i < N * K; i++) {
        b[i] = (float)(rng_gauss(&seed) * 0.05);
    }
    for (int i = 0; i < M; i++) {
        cr_assert_eq(kr_fp8_act_quant(a + i * K, K, B, false, aq + i * K, as + i * (K / B)), KR_OK);
    }
    cr_assert_eq(kr_fp8_weight_quant(b, N, K, B, B, bq, bs), KR_OK);
    cr_assert_eq(kr_fp8_gemm(aq, as, M, K, bq, bs, N, B, B, c), KR_OK);
    double num = 0, den = 0;
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) {
            double ref = 0;
            for (int t = 0; t < K; t++) {
                ref += (double)a[i * K + t] * (double)b[j * K + t];
            }
            num += (c[i * N + j] - ref) * (c[i * N + j] - ref);
            den += ref * ref;
        }
    }
    const double rel = sqrt(num / den);
    fprintf(stderr, "  fp8 product against the unquantized one: normalized error %.4f\n", rel);
    cr_expect_lt(rel, 0.08, "normalized error %.4f", rel);
}

Test(fp8, weight_quant_and_gemm_reject_bad_arguments)
{
    float w[4] = {1, 2, 3, NAN}, s[4];
    uint8_t q[4];
    cr_expect_eq(kr_fp8_weight_quant(w, 2, 2, 128, 128, q, s), KR_ERR_INVAL, "a NaN weight");
    cr_expect_eq(kr_fp8_weight_quant(w, 0, 2, 128, 128, q, s), KR_ERR_INVAL, "no rows");
    cr_expect_eq(kr_fp8_weight_quant(NULL, 1, 1, 128, 128, q, s), KR_ERR_INVAL);
    float c[1];
    cr_expect_eq(kr_fp8_gemm(q, s, 1, 0, q, s, 1, 2, 128, c), KR_ERR_INVAL, "k of 0");
    cr_expect_eq(kr_fp8_gemm(q, s, 1, 2, NULL, s, 1, 2, 128, c), KR_ERR_INVAL);
}
