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
 * only), act_out[t, r] = act(y[t, r]) is written too: the activation of krk_act (enum kr_act) on the same value. */
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
    int act;                /* enum kr_act, with act_out */
};
#define KRK_GEMV_CONFIGS 5
enum kr_status krk_gemv(const struct krk_gemv_params *p, cudaStream_t stream);

/* Skinny products on tensor cores for 1 <= n <= KRK_SKINNY_MAX_N activation rows (the decode step
 * of a few to sixteen sequences; with configuration 0 up to 128 rows, the other configurations 16):
 * y_p[t, r] = sum_c x[t, c] * W_p[r, c] (+ bias_p[r]) for each part
 * p, bf16 products accumulated in fp32 (mma.sync m16n8k16), every weight streamed once. The parts
 * (1..KRK_GEMV_MAX_PARTS weights of the same cols sharing x) run in one launch. The work (tiles of
 * weight rows by column steps) is split evenly over blocks resident at once; a tile that several
 * blocks share is summed by the last of them in a fixed order from partials in `ws`, so results do
 * not depend on timing, nor a token's on the other rows of x nor on n (1..128: the summation order
 * depends only on the shape, the configuration and the device's SM count). With act_out (one part
 * only), act_out[t, r] = act(y[t, r]) too. */
#define KRK_SKINNY_MAX_N 128
struct krk_skinny_params {
    const krk_bf16 *xb;     /* [n, ldxb] bf16; ldxb % 8 == 0, 16-byte aligned */
    int64_t ldxb;
    int64_t n, cols;        /* cols a multiple of the configuration's column step
                               (krk_skinny_cols_step: 256 by default) */
    int n_parts;            /* 1..KRK_GEMV_MAX_PARTS */
    struct krk_gemv_part parts[KRK_GEMV_MAX_PARTS]; /* w 16-byte aligned; outputs must not overlap
                                                      x or each other */
    float *act_out;         /* [n, ld_act] fp32 or NULL */
    int64_t ld_act;
    int act;                /* enum kr_act, with act_out */
    void *ws;               /* krk_skinny_ws_bytes(krk_skinny_tile_rows(p)) bytes or more, 256-byte
                               aligned, zeroed once when allocated (it holds counters every product
                               leaves at zero); one workspace serves products of any shape */
    size_t ws_bytes;
    bool pdl;               /* as krk_gemv_params.pdl */
    int config;             /* 0: default; 1..KRK_SKINNY_CONFIGS - 1: other tile shapes, pipeline
                               depths and blocks per SM, for bench_gemv */
};
#define KRK_SKINNY_CONFIGS 4
/* The parts' rows, each rounded up to the largest tile. */
int64_t krk_skinny_tile_rows(const struct krk_skinny_params *p);
/* Workspace for products of up to tile_rows rows (krk_skinny_tile_rows) on the current device. */
size_t krk_skinny_ws_bytes(int64_t tile_rows);
/* Columns of one step of a configuration (cols must be a multiple); 0 for no such configuration. */
int krk_skinny_cols_step(int config);
enum kr_status krk_skinny(const struct krk_skinny_params *p, cudaStream_t stream);

/* ---- FP8 block-scaled products (kernels/gemm/fp8.cu; the recipe of model/fp8.h) ---- */

/* An FP8 weight: E4M3 codes [rows, cols] row-major, weight = code * scale[(r / block_r) * ld_s +
 * c / block_c], ld_s >= ceil(cols / block_c). */
struct krk_fp8_weight {
    const uint8_t *q;
    const float *scale;
    int64_t rows, cols, ld_s;
    int32_t block_r, block_c;
};

/* The activations' quantization (kr_fp8_act_quant per row, in blocks of `block` columns, the last
 * block possibly shorter), bit for bit: per row t and block kb, s = max(max |x|, 1e-4) * fp32(1/448)
 * and q = e4m3(x / s) (nearest even, saturated). Writes whichever of these is not NULL:
 *   q     [n, ldq] the codes
 *   scale [nkb, s_ld] the scales, scale[kb * s_ld + t] (the block-major layout cuBLASLt's VEC128_32F
 *         mode reads), s_ld >= n
 *   xq    [n, ldxq] fp32 e4m3_to_f32(q) * s: the values the reference's product multiplies (xq may
 *         be x itself, with ldxq == ldx). */
struct krk_fp8_quant_params {
    const float *x;
    int64_t ldx, n, cols, block;
    uint8_t *q;
    int64_t ldq;
    float *scale;
    int64_t s_ld;
    float *xq;
    int64_t ldxq;
    bool ue8m0;             /* power-of-two scales: the smallest 2^k with 2^k * 448 >= amax (the CPU's
                               kr_fp8_act_quant with ue8m0) */
};
enum kr_status krk_fp8_quant(const struct krk_fp8_quant_params *p, cudaStream_t stream);

/* y[t, r] = sum over blocks kb of scale(r, kb) * sum_{c in kb} e4m3_to_f32(q[r, c]) * xq[t, c]
 * (+ bias[r]) for any n, xq from krk_fp8_quant: the reference product (kr_fp8_gemm) up to the order
 * of fp32 rounding. Bound by streaming the codes once (16-byte loads) when cols and block_c are
 * multiples of 16, q and xq 16-byte aligned and ldx % 4 == 0; otherwise a code at a time. */
struct krk_fp8_gemv_params {
    const float *xq;
    int64_t ldx, n;
    struct krk_fp8_weight w;
    const float *bias;      /* [rows] or NULL */
    float *y;               /* [n, ldy] */
    int64_t ldy;
    bool any_kernel;        /* tests: the code-at-a-time kernel whatever the shape */
};
enum kr_status krk_fp8_gemv(const struct krk_fp8_gemv_params *p, cudaStream_t stream);

/* cuBLASLt's block-scaled FP8 matmul (128 x 128 weight blocks, activation blocks of 128 along K,
 * fp32 output): a handle with its workspace (device memory, borrowed) and the algorithms chosen per
 * shape. One thread at a time. */
struct krk_fp8_lt;
struct krk_fp8_lt *krk_fp8_lt_create(void *ws, size_t ws_bytes);
void krk_fp8_lt_free(struct krk_fp8_lt *lt);
/* Whether the weight and row count are ones the matmul takes: blocks of 128 x 128, whole row blocks
 * (rows % 128 == 0), cols >= 128 and a multiple of 16 (a short last column block is taken),
 * ld_s = ceil(cols / 128), codes 16-byte aligned; n a multiple of 4 (the heuristic of CUDA 13.0 has
 * no algorithm for other n; the caller runs the rest of the rows elsewhere). Partial row blocks and
 * matrices narrower than one block are left to the other kernels: they are not what the device tests
 * cover, and a fixture's 40-row prefill through them deviated (docs/FP8.md). */
bool krk_fp8_lt_takes(const struct krk_fp8_weight *w, int64_t n);
/* The activations as codes and scales (krk_fp8_quant with q and scale) against an FP8 weight. */
struct krk_fp8_mm_params {
    const uint8_t *q;       /* [n, ldq] activation codes, ldq % 16 == 0, 16-byte aligned */
    int64_t ldq;
    const float *scale;     /* [ceil(cols / block_c), s_ld] activation scales, scale[kb * s_ld + t] */
    int64_t s_ld;           /* >= n; cuBLASLt: == n */
    int64_t n;
    struct krk_fp8_weight w;
    const float *bias;
    float *y;               /* [n, ldy] fp32 */
    int64_t ldy;
};
/* y = the product; KR_ERR_UNSUPPORTED (nothing launched) when the weight's layout is not one it
 * takes or cuBLASLt has no algorithm for the shape: the caller runs another kernel. */
enum kr_status krk_fp8_gemm_lt(struct krk_fp8_lt *lt, const struct krk_fp8_mm_params *p, cudaStream_t stream);

/* Decode-shaped products on tensor cores (mma.sync m16n8k32 e4m3, fp32 promotion per 128-column
 * block as the recipe does): bound by streaming the weight's codes once for up to 16 rows of x (more
 * run in groups of 16, the weight read again per group). Takes weights in column blocks of 128, row
 * blocks a multiple of 16, cols a multiple of 128 (krk_fp8_skinny_takes); KR_ERR_INVAL otherwise. */
bool krk_fp8_skinny_takes(const struct krk_fp8_weight *w);
enum kr_status krk_fp8_skinny(const struct krk_fp8_mm_params *p, cudaStream_t stream);

/* Products whose rows do not depend on the row count (--batch-invariant): y [n, ldy] = x [n, ldx]
 * times W^T (bf16 x and W, or fp32 both; fp32 accumulation and output) through cuBLASLt with one
 * algorithm per (weight type, shape, operand alignment), chosen the first time the shape is seen
 * and kept: among the heuristic's algorithms (and their splits of K) that take 1 to max_n rows
 * within the workspace, the fastest over 1, 16, 64 and 512 rows timed on that first call's weight
 * (the heuristic's first when the stream is being captured). Row t of y is then the same bits for
 * any n. A handle borrows the workspace (device memory); one thread at a time. */
struct krk_fixed_lt;
struct krk_fixed_lt *krk_fixed_lt_create(void *ws, size_t ws_bytes, int64_t max_n);
/* Steps of up to max_n rows from now on: the algorithms kept stay (a product they cannot take is
 * refused with a message, never run another way); shapes seen from now on are chosen for max_n. */
void krk_fixed_lt_grow(struct krk_fixed_lt *lt, int64_t max_n);
void krk_fixed_lt_free(struct krk_fixed_lt *lt);
struct krk_fixed_gemm_params {
    const void *w;          /* [rows, cols] bf16, or fp32 when f32 */
    const void *x;          /* [n, ldx] of the same type */
    int64_t ldx;
    float *y;               /* [n, ldy] */
    int64_t ldy;
    int64_t rows, cols, n;  /* n <= max_n */
    bool f32;
};
/* KR_ERR_UNSUPPORTED (nothing launched, a message on stderr) when no algorithm takes the shape at
 * every row count, or the one kept does not take this call's leading dimensions. */
enum kr_status krk_fixed_gemm(struct krk_fixed_lt *lt, const struct krk_fixed_gemm_params *p, cudaStream_t stream);
/* The kept algorithm's cuBLASLt id for a shape (-1: none yet) and its split of K (tests, logs). */
int krk_fixed_algo_id(struct krk_fixed_lt *lt, bool f32, int64_t rows, int64_t cols, int *splits);

/* Plain products of KRK_TUNED_MIN_N..KRK_TUNED_MAX_N rows of x (decode steps past the skinny
 * kernels) on bf16 weights of at least KRK_TUNED_MIN_BYTES: cuBLASLt with the algorithm that ran
 * fastest for the shape and class of row counts (12, 16, 24, 32, 48, 64, 96, 128, 160, ..., 256: n
 * takes the first class >= n). The first call of a class outside a graph capture times the
 * heuristic's candidates (and their splits of K) on its own operands, the L2 cache overwritten
 * before each run (some milliseconds, synchronizing the stream), then keeps the fastest for the
 * handle's life. KR_ERR_UNSUPPORTED (nothing launched) for other counts, smaller or fp32 weights, a
 * class not timed yet while the stream is being captured, or a class no candidate ran for: the
 * caller takes cuBLAS's own choice. Results are those of a cuBLAS product (another summation order);
 * which algorithm a class keeps can differ from process to process. */
#define KRK_TUNED_MIN_N 9
#define KRK_TUNED_MAX_N 256
#define KRK_TUNED_MIN_BYTES ((int64_t)4 << 20)
enum kr_status krk_tuned_gemm(struct krk_fixed_lt *lt, const struct krk_fixed_gemm_params *p, cudaStream_t stream);
/* Classes with a kept algorithm, and the milliseconds spent timing (logs, tests). */
int krk_tuned_info(const struct krk_fixed_lt *lt, float *ms);

/* Decode-sized products through the tensor copies and wgmma of sm_90 (kernels/gemm/stream.cu):
 * y[t, r] = sum_c x[t, c] * W[r, c] (+ bias[r]) for t < n <= KRK_STREAM_MAX_N, bf16 x and W, fp32
 * accumulation and output, every weight byte read once. The weight streams through a pipeline of
 * shared-memory stages per SM, the work (tiles of weight rows by 64-column steps) cut evenly over one
 * block per SM; a tile that several blocks share is summed by the last of them in a fixed order from
 * partials in `ws`, so results do not depend on timing (they do depend on n's token class: 16, 32,
 * 48 or 64 tokens a pass, the smallest holding n unless n_class names one). */
#define KRK_STREAM_MAX_N 64
#define KRK_STREAM_MAX_TILES 8192 /* weight rows / 128, at most */
#define KRK_STREAM_CONFIGS 2      /* 0: tiles of 128 weight rows (default); 1: 256 (bench_gemv) */
struct krk_stream_params {
    const krk_bf16 *w;      /* [rows, cols] bf16, cols % 8 == 0, 16-byte aligned */
    const krk_bf16 *x;      /* [n, ldx] bf16, ldx % 8 == 0, 16-byte aligned */
    int64_t ldx;
    const float *bias;      /* [rows] or NULL */
    float *y;               /* [n, ldy] fp32, ldy >= rows; must not overlap x */
    int64_t ldy;
    int64_t rows, cols, n;
    void *ws;               /* krk_stream_ws_bytes() bytes, 256-byte aligned, zeroed once when
                               allocated (its counters are left at zero by every product) */
    size_t ws_bytes;
    bool pdl;               /* as krk_gemv_params.pdl */
    int config;             /* 0..KRK_STREAM_CONFIGS - 1 */
    int n_class;            /* 0: the smallest token class holding n; 16, 32, 48 or 64: that class
                               for every n <= n_class (a larger n is refused), so row t of y is the
                               same bits for any n > t (--batch-invariant decode rows) */
};
/* Whether krk_stream_gemm takes these operands (shape, alignment, the driver's tensor-copy support). */
bool krk_stream_takes(const void *w, int64_t rows, int64_t cols, const void *x, int64_t ldx, int64_t n);
size_t krk_stream_ws_bytes(void);
size_t krk_stream_counter_bytes(void);
/* KR_ERR_INVAL (nothing launched) for operands krk_stream_takes refuses, a small workspace, or an
 * n_class that is not 0, 16, 32, 48 or 64 or is below n;
 * KR_ERR_UNSUPPORTED (nothing launched, said once on stderr) when the driver will not encode the
 * operands' tensor maps: the caller runs another kernel. */
enum kr_status krk_stream_gemm(const struct krk_stream_params *p, cudaStream_t stream);

/* y[t, r] += bias[r] for t < n, r < rows (after a cuBLAS product). */
enum kr_status krk_add_bias(float *y, int64_t ldy, const float *bias, int64_t n, int64_t rows, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
