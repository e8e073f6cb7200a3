#pragma once
/* Skinny matrix products for decode (kernels/gemm/): few activation rows against a bf16 weight,
 * bound by reading the weight once. Larger products go through cuBLAS in the backend. */
#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest n krk_gemv accepts. */
#define KRK_GEMV_MAX_N 8

/* y[t, r] = sum_c bf16(x[t, c]) * W[r, c] (+ bias[r]) for t < n <= KRK_GEMV_MAX_N, r < rows;
 * fp32 accumulation (x rounded to bf16 like every GEMM operand). */
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
};
#define KRK_GEMV_CONFIGS 5
enum kr_status krk_gemv(const struct krk_gemv_params *p, cudaStream_t stream);

/* y[t, r] += bias[r] for t < n, r < rows (after a cuBLAS product). */
enum kr_status krk_add_bias(float *y, int64_t ldy, const float *bias, int64_t n, int64_t rows, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
