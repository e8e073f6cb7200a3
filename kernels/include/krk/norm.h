#pragma once
/* Elementwise and normalisation kernels (kernels/norm/). */
#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* RMSNorm with an optional residual added first and an optional bf16 copy of the output
 * (struct krk_rmsnorm_params, krk/ops.h). */
enum kr_status krk_rmsnorm(const struct krk_rmsnorm_params *p, cudaStream_t stream);

/* LayerNorm (struct krk_layernorm_params, krk/ops.h). */
enum kr_status krk_layernorm(const struct krk_layernorm_params *p, cudaStream_t stream);

/* Gated grouped RMSNorm of Mamba-2 (struct krk_gated_rmsnorm_params, krk/ops.h). */
enum kr_status krk_gated_rmsnorm(const struct krk_gated_rmsnorm_params *p, cudaStream_t stream);

/* y[i] += x[i] for i < n. */
enum kr_status krk_add(float *y, const float *x, int64_t n, cudaStream_t stream);
/* y[i] *= s for i < n. */
enum kr_status krk_scale(float *y, float s, int64_t n, cudaStream_t stream);

/* out[t, :] = w[tokens[t] - row0, :] as fp32 for t < n, where w holds the vocabulary rows
 * [row0, row0 + rows) (a tensor-parallel rank's share; 0 and the vocabulary when whole); a token
 * outside them gets a row of zeros (the ranks' rows are then summed). */
enum kr_status krk_embed(const krk_bf16 *w /* [rows, dim] */, const int32_t *tokens /* [n] */, int64_t n,
                         int64_t dim, int64_t row0, int64_t rows, float *out /* [n, dim] */, cudaStream_t stream);

/* Activation, gated or not (struct krk_act_params, krk/ops.h). */
enum kr_status krk_act(const struct krk_act_params *p, cudaStream_t stream);

/* dst[i, :] = src[rows[i], :] for i < n (rows of `width` fp32). */
enum kr_status krk_gather_rows(const float *src, int64_t width, const int32_t *rows /* [n] */, int64_t n,
                               float *dst /* [n, width] */, cudaStream_t stream);

/* out[t, c] = bf16(x[t, c]) for t < n, c < cols. */
enum kr_status krk_cast_bf16(const float *x, int64_t ldx, int64_t n, int64_t cols, krk_bf16 *out /* [n, cols] */,
                             cudaStream_t stream);

/* In-place conversion helpers for weight upload: dst[i] = (bf16 | f32) of src[i], where src holds
 * n elements of dtype `src_dtype` (values of enum kr_dtype: 0 f32, 1 f16, 2 bf16). */
enum kr_status krk_convert_bf16(const void *src, int src_dtype, int64_t n, krk_bf16 *dst, cudaStream_t stream);
enum kr_status krk_convert_f32(const void *src, int src_dtype, int64_t n, float *dst, cudaStream_t stream);

/* Rotary embedding (struct krk_rope_params, krk/ops.h) of ctx->batch's tokens at their positions
 * (batch.pos, batch.n_tok), on ctx->stream. */
enum kr_status krk_rope(const struct krk_rope_params *p, const struct krk_ctx *ctx);
/* krk_rope of a, then of b, in one launch: b's vectors must not overlap a's, and the two share
 * frequencies and factor (the same inv_freq pointer, covering both dims; KR_ERR_INVAL otherwise). */
enum kr_status krk_rope_pair(const struct krk_rope_params *a, const struct krk_rope_params *b,
                             const struct krk_ctx *ctx);

#ifdef __cplusplus
}
#endif
