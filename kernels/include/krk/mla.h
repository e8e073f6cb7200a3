#pragma once
/* MLA and DeepSeek sparse attention over the paged latent cache (kernels/mla/). Semantics are those
 * of the CPU reference (cpu_mla_cache_write, cpu_dsa_index, cpu_mla_attention). */
#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Latent cache write (struct krk_mla_cache_params, krk/ops.h) of ctx->batch's tokens, on ctx->stream;
 * padding sequences write no row. */
enum kr_status krk_mla_cache_write(const struct krk_mla_cache_params *p, const struct krk_ctx *ctx);

/* Largest kv_lora + rope + idx_dim and q_dim krk_mla_prep takes. */
#define KRK_MLA_PREP_MAX_ROW 8192
/* struct krk_mla_prep_params (krk/ops.h) in one launch for ctx->batch's tokens (p->n must be its
 * n_tok; ik_fp8 must be NULL: the FP8 round trip is krk_fp8_round's), on ctx->stream. */
enum kr_status krk_mla_prep(const struct krk_mla_prep_params *p, const struct krk_ctx *ctx);

/* Lightning indexer + top-k (struct krk_dsa_index_params, krk/ops.h) for ctx->batch's tokens, on
 * ctx->stream: the scores of a group of tokens into ctx->workspace (of krk_dsa_index_workspace_bytes(),
 * less makes smaller groups), then the top-k of each; ctx->batch.max_ctx must be set (it sizes the
 * score rows). ctx->dsa_score picks how the scores are computed (below); ctx->events (or NULL) gets
 * [4]: (begin, end) around the scores, then around the top-k, of the first group of tokens.
 * Top-k: a radix select, one block per query, 4 passes of 8 bits; its histograms take one shared
 * atomic per key, and the bin of each pass is found by a warp scan. */
enum kr_status krk_dsa_index(const struct krk_dsa_index_params *p, const struct krk_ctx *ctx);
/* Score variants: fp32 on CUDA cores (0); bf16 tensor cores (queries rounded to bf16, fp32
 * accumulation; index heads a multiple of 16 up to 64, head_dim a multiple of 16, aligned key rows;
 * otherwise the default runs). */
enum { KRK_DSA_SCORE_FP32 = 0, KRK_DSA_SCORE_MMA = 1 };
/* Workspace for n_tok tokens at contexts up to max_ctx (less still works: tokens go in smaller
 * groups). */
size_t krk_dsa_index_workspace_bytes(int64_t n_tok, int64_t max_ctx);

/* Absorbed MLA attention (struct krk_mla_attn_params, krk/ops.h; `select` is ignored) over the
 * selected (idx) or all causal (idx NULL) cached positions of ctx->batch's tokens, on ctx->stream,
 * waiting for ctx->idx_ready (or not) before reading idx. ctx->mla_attn picks the kernels: a block
 * per (token, head), fp32 (default); or all heads of a token in one block on bf16 tensor cores,
 * reading each latent once per token, with a token's keys split over several blocks when there are
 * too few tokens to fill the GPU (kv_lora 512, rope 64, up to 64 heads, nope up to 256, v_dim up to
 * 128, aligned rows, ctx->workspace of krk_mla_attn_workspace_bytes: krk_mla_heads_fits; otherwise
 * the default runs). Dense attention (idx NULL) with the head-batched kernels sizes its splits by
 * ctx->batch.max_ctx, which must then be set. */
enum { KRK_MLA_ATTN_PER_HEAD = 0, KRK_MLA_ATTN_HEADS = 1 };
bool krk_mla_heads_fits(const struct krk_mla_attn_params *p, const struct krk_ctx *ctx);
size_t krk_mla_attn_workspace_bytes(int64_t n_tok, int64_t n_head, int64_t kv_lora, int64_t max_ctx);
enum kr_status krk_mla_attention(const struct krk_mla_attn_params *p, const struct krk_ctx *ctx);

/* FP8 round trip (struct krk_fp8_round_params, krk/ops.h) of indexer rows, bit for bit the CPU
 * reference's cpu_fp8_round; p->hadamard must be set. */
enum kr_status krk_fp8_round(const struct krk_fp8_round_params *p, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
