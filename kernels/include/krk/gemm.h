#pragma once
/* Skinny matrix products for decode (kernels/gemm/): few activation rows against a bf16 weight,
 * bound by reading the weight once. Larger products go through cuBLAS in the backend. */
#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest n krk_gemv accepts. */
#define KRK_GEMV_MAX_N 8
/* Most weights one krk_gemv launch takes (parts sharing x). */
#define KRK_GEMV_MAX_PARTS 4

/* One more weight of a krk_gemv launch: y[t, r] = x[t, :] . w[r, :] (+ bias[r]) for r < rows. */
struct krk_gemv_part {
    const krk_bf16 *w;      /* [rows, cols] bf16, the launch's cols; 16-byte aligned */
    const float *bias;      /* [rows] fp32, may be NULL */
    int64_t rows;
    float *y;               /* [n, ldy] fp32, ldy >= rows */
    int64_t ldy;
};

/* y[t, r] = sum_c bf16(x[t, c]) * W[r, c] (+ bias[r]) for t < n <= KRK_GEMV_MAX_N, r < rows;
 * fp32 accumulation (x rounded to bf16 like every GEMM operand). The products of up to
 * KRK_GEMV_MAX_PARTS - 1 more weights of the same cols (`more`) run in the same launch, each with
 * its own bias and output; outputs must not overlap x or each other. With act_out (one weight
 * only), act_out[t, r] = act(y[t, r]) is written too: the activation of krk_act on the same value. */
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
    int n_more;             /* weights in `more`, 0..KRK_GEMV_MAX_PARTS - 1 */
    struct krk_gemv_part more[KRK_GEMV_MAX_PARTS - 1];
    float *act_out;         /* [n, ld_act] fp32 or NULL */
    int64_t ld_act;         /* >= rows */
    int act;                /* enum krk_act, with act_out */
};
#define KRK_GEMV_CONFIGS 5
enum kr_status krk_gemv(const struct krk_gemv_params *p, cudaStream_t stream);

/* y[t, r] += bias[r] for t < n, r < rows (after a cuBLAS product). */
enum kr_status krk_add_bias(float *y, int64_t ldy, const float *bias, int64_t n, int64_t rows, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
