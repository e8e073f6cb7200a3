#pragma once
/* GQA attention over the block-paged K/V cache (kernels/attention/), prefill and decode. */
#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

size_t krk_attn_workspace_bytes(int64_t n_tok, int64_t n_head, int64_t head_dim);
/* The workspace of a step of n_seq sequences with krk_ctx.batch_invariant (at least this, and at
 * least krk_attn_workspace_bytes). */
size_t krk_attn_workspace_bytes_invariant(int64_t n_seq, int64_t n_head, int64_t head_dim);
/* GQA attention (struct krk_attn_params, krk/ops.h) on ctx->stream over ctx->batch, with
 * ctx->workspace of krk_attn_workspace_bytes(). Padding sequences write no cache row. Long contexts
 * are split across thread blocks (split-K) with a fixed grid, so the launch does not depend on
 * context length (graph capture). With ctx->batch_invariant every one-token sequence takes the
 * decode path with a fixed split (the keys of each split depend on its context alone) and every
 * longer one the prefill path, in any step: a token's output does not depend on the step's other
 * sequences, nor on how its prompt was cut into chunks. */
enum kr_status krk_attn(const struct krk_attn_params *p, const struct krk_ctx *ctx);

#ifdef __cplusplus
}
#endif
