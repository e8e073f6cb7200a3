#include "fp8.h"

#include "dtype.h"

#include <math.h>
#include <string.h>

/* ---- E4M3 ---------------------------------------------------------------------------------- */

uint8_t kr_fp8_e4m3_from_f32(float x)
{
    if (isnan(x)) {
        return KR_FP8_E4M3_NAN;
    }
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7fffffffu; /* |x| */
    if (u >= 0x43e00000u) { /* |x| >= 448 (infinities included): saturate */
        return sign | 0x7e;
    }
    if (u < 0x3c800000u) {
        /* |x| < 2^-6: multiples of 2^-9 (the subnormals, and 2^-6 itself, which is code 8). Adding
         * 2^14, whose floats are spaced 2^-9, rounds |x| to one of them, ties to even, in one
         * operation; the difference of the bit patterns counts the steps. */
        float a;
        memcpy(&a, &u, 4);
        const float t = a + 0x1p14f;
        uint32_t tb;
        memcpy(&tb, &t, 4);
        return sign | (uint8_t)(tb - 0x46800000u);
    }
    /* Normal: keep 3 of the 23 mantissa bits, rounding to nearest even (a carry moves into the
     * exponent); then rebias the exponent from 127 to 7. |x| < 448 keeps the result at or below 0x7e. */
    const uint32_t r = u + 0x7ffffu + ((u >> 20) & 1u);
    return sign | (uint8_t)((r >> 20) - (120u << 3));
}

float kr_fp8_e4m3_to_f32(uint8_t b)
{
    return kr_e4m3_to_f32(b);
}

/* ---- Hadamard ------------------------------------------------------------------------------ */

enum kr_status kr_fp8_hadamard(float *x, int64_t n, float scale)
{
    if (!x || n < 1 || (n & (n - 1)) != 0) {
        return KR_ERR_INVAL;
    }
    /* Butterflies a, b -> a + b, a - b at strides 1, 2, 4, ...: stage h turns blocks of h into blocks
     * of 2h as H_2h = [[H_h, H_h], [H_h, -H_h]] does. */
    for (int64_t h = 1; h < n; h *= 2) {
        for (int64_t i = 0; i < n; i += 2 * h) {
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
    }
    for (int64_t i = 0; i < n; i++) {
        x[i] *= scale;
    }
    return KR_OK;
}

/* ---- act_quant ----------------------------------------------------------------------------- */

/* The smallest power of two s with s * 448 >= amax (amax > 0, finite), computed exactly: with
 * amax = f * 2^e, f in [0.5, 1), and 448 = 0.875 * 2^9, s = 2^k needs 0.875 * 2^(k+9) >= f * 2^e,
 * i.e. k = e - 9 when f <= 0.875 and k = e - 8 otherwise. amax = 448 * 2^k exactly gives 2^k (the
 * block's maximum then encodes as ±448). */
static float ue8m0_scale(float amax)
{
    int e;
    const float f = frexpf(amax, &e);
    return ldexpf(1.0f, f <= 0.875f ? e - 9 : e - 8);
}

enum kr_status kr_fp8_act_quant(const float *x, int64_t n, int64_t block, bool ue8m0, uint8_t *q,
                                float *scale)
{
    if (!x || !q || !scale || block < 1 || n < 0 || n % block != 0) {
        return KR_ERR_INVAL;
    }
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) {
            return KR_ERR_INVAL;
        }
    }
    for (int64_t b = 0; b < n / block; b++) {
        const float *xb = x + b * block;
        float amax = 1e-4f; /* the reference's floor, so an all-zero block gets a usable scale */
        for (int64_t i = 0; i < block; i++) {
            amax = fmaxf(amax, fabsf(xb[i]));
        }
        /* The kernel computes amax * fp8_max_inv with fp8_max_inv = 1/448 as an fp32 constant. */
        const float s = ue8m0 ? ue8m0_scale(amax) : amax * (1.0f / KR_FP8_E4M3_MAX);
        scale[b] = s;
        for (int64_t i = 0; i < block; i++) {
            /* The encoder saturates at ±448, which is the reference's clamp. */
            q[b * block + i] = kr_fp8_e4m3_from_f32(xb[i] / s);
        }
    }
    return KR_OK;
}

/* ---- index score --------------------------------------------------------------------------- */

enum kr_status kr_fp8_index_score(const uint8_t *q, const float *q_scale, const float *w, int64_t n_head,
                                  int64_t head_dim, const uint8_t *k, const float *k_scale, int64_t n_kv,
                                  float *score)
{
    if (!q || !q_scale || !w || !k || !k_scale || !score || n_head < 1 || head_dim < 1 || n_kv < 0) {
        return KR_ERR_INVAL;
    }
    for (int64_t s = 0; s < n_kv; s++) {
        const uint8_t *ks = k + s * head_dim; /* [head_dim] */
        float acc = 0.0f;
        for (int64_t h = 0; h < n_head; h++) {
            const uint8_t *qh = q + h * head_dim; /* [head_dim] */
            double dot = 0.0;                     /* exact: see fp8.h */
            for (int64_t i = 0; i < head_dim; i++) {
                dot += (double)kr_e4m3_to_f32(qh[i]) * (double)kr_e4m3_to_f32(ks[i]);
            }
            const float logit = (float)dot;
            const float relu = logit < 0.0f ? 0.0f : logit; /* NaN passes through */
            acc += relu * (w[h] * q_scale[h]);
        }
        score[s] = acc * k_scale[s];
    }
    return KR_OK;
}

/* ---- the block-scaled weight recipe ------------------------------------------------------------ */

enum kr_status kr_fp8_weight_quant(const float *w, int64_t rows, int64_t cols, int64_t block_r, int64_t block_c,
                                   uint8_t *q, float *scale_inv)
{
    if (!w || !q || !scale_inv || rows < 1 || cols < 1 || block_r < 1 || block_c < 1) {
        return KR_ERR_INVAL;
    }
    for (int64_t i = 0; i < rows * cols; i++) {
        if (!isfinite(w[i])) {
            return KR_ERR_INVAL;
        }
    }
    const int64_t sr = (rows + block_r - 1) / block_r, sc = (cols + block_c - 1) / block_c;
    /* block rows are independent: spread over the cores (a model quantized at load has billions of
     * values); each value's code depends only on its block, so the result does not depend on it */
#pragma omp parallel for schedule(dynamic, 1) if (rows * cols >= ((int64_t)1 << 20))
    for (int64_t br = 0; br < sr; br++) {
        const int64_t r0 = br * block_r, r1 = r0 + block_r < rows ? r0 + block_r : rows;
        for (int64_t bc = 0; bc < sc; bc++) {
            const int64_t c0 = bc * block_c, c1 = c0 + block_c < cols ? c0 + block_c : cols;
            float amax = 1e-4f;
            for (int64_t r = r0; r < r1; r++) {
                for (int64_t c = c0; c < c1; c++) {
                    amax = fmaxf(amax, fabsf(w[r * cols + c]));
                }
            }
            const float s = amax * (1.0f / KR_FP8_E4M3_MAX);
            scale_inv[br * sc + bc] = s;
            for (int64_t r = r0; r < r1; r++) {
                for (int64_t c = c0; c < c1; c++) {
                    q[r * cols + c] = kr_fp8_e4m3_from_f32(w[r * cols + c] / s);
                }
            }
        }
    }
    return KR_OK;
}

enum kr_status kr_fp8_gemm(const uint8_t *a, const float *a_s, int64_t m, int64_t k, const uint8_t *b,
                           const float *b_s, int64_t n, int64_t block_k, int64_t block_n, float *c)
{
    if (!a || !a_s || !b || !b_s || !c || m < 0 || n < 0 || k < 1 || block_k < 1 || block_n < 1) {
        return KR_ERR_INVAL;
    }
    const int64_t nkb = (k + block_k - 1) / block_k;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int64_t kb = 0; kb < nkb; kb++) {
                double dot = 0.0; /* exact: see fp8.h */
                for (int64_t t = kb * block_k; t < (kb + 1) * block_k && t < k; t++) {
                    dot += (double)kr_e4m3_to_f32(a[i * k + t]) * (double)kr_e4m3_to_f32(b[j * k + t]);
                }
                acc += ((float)dot * a_s[i * nkb + kb]) * b_s[(j / block_n) * nkb + kb];
            }
            c[i * n + j] = acc;
        }
    }
    return KR_OK;
}
