#pragma once
/* Skinny matrix products for decode (kernels/gemm/): few activation rows against a bf16 weight,
 * bound by reading the weight once. Larger products go through cuBLAS in the backend. */
#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest n krk_gemv accepts. */
#define KRK_GEMV_MAX_N 8

/* Largest cols of a GEMV with a fused RMSNorm (norm_w): x is staged in one piece at n = 1. */
#define KRK_GEMV_NORM_MAX_COLS 12288

/* y[t, r] = sum_c bf16(x[t, c]) * W[r, c] (+ bias[r]) for t < n <= KRK_GEMV_MAX_N, r < rows;
 * fp32 accumulation (x rounded to bf16 like every GEMM operand).
 *
 * Two fusions for decode, which save the launches of the ops around the product:
 *  - acc (a residual add after it): acc[t, r] += y[t, r] as well, with the value written to y;
 *  - norm_w (the RMSNorm before it, n = 1 only): x is normalised first, as krk_rmsnorm computes it
 *    without residual: x[c] / sqrt(mean(x^2) + norm_eps) * norm_w[c], and the normalised row is
 *    written to norm_out too (fp32) for the ops that read it later. */
struct krk_gemv_params {
    const float *x;         /* [n, ldx] fp32 */
    int64_t ldx;
    const krk_bf16 *w;      /* [rows, cols] bf16, row-major; cols % 8 == 0 and 16-byte aligned */
    const float *bias;      /* [rows] fp32, may be NULL */
    int64_t n, rows, cols;
    float *y;               /* [n, ldy] fp32 */
    int64_t ldy;
    bool pdl;               /* launch as a programmatic dependent of the previous kernel: the first
                               weight loads overlap its tail (x is read only after it completes);
                               also when krk_set_pdl is on */
    int config;             /* 0: the default tiling; 1..KRK_GEMV_CONFIGS - 1: alternative tilings of
                               the n = 1 and n = 2 kernels, for bench_gemv (other n ignore it) */
    float *acc;             /* [n, ldy] fp32, may be NULL: acc += y; overlaps none of x, y, norm_out */
    const float *norm_w;    /* [cols] fp32, may be NULL: normalise x first (n = 1 and
                               cols <= KRK_GEMV_NORM_MAX_COLS) */
    float norm_eps;
    float *norm_out;        /* [cols] fp32, required with norm_w: the normalised x; overlaps neither
                               x nor y */
};
#define KRK_GEMV_CONFIGS 5
enum kr_status krk_gemv(const struct krk_gemv_params *p, cudaStream_t stream);

/* y[t, r] += bias[r] for t < n, r < rows (after a cuBLAS product). */
enum kr_status krk_add_bias(float *y, int64_t ldy, const float *bias, int64_t n, int64_t rows, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
