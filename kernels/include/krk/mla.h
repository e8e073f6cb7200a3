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

/* Lightning indexer + top-k: for token t at position p, the top min(topk, p+1) positions s <= p by
 * I[t,s] = sum_h w[t,h] relu(iq[t,h] . ik[s]) (ties: lower position first), ascending in
 * idx[t, 0..], -1 padded. When p+1 <= topk every position is taken without scoring. */
struct krk_dsa_index_params {
    const float *iq;        /* [n_tok, n_head*head_dim] */
    const float *w;         /* [n_tok, n_head] */
    int64_t n_head, head_dim;
    const krk_bf16 *cache;  /* latent cache, keys at column key_off of rows of `row` */
    int64_t row, key_off;
    int32_t block_size;
    int32_t topk;
    int32_t *idx;           /* [n_tok, topk] */
    void *workspace;        /* krk_dsa_index_workspace_bytes() bytes */
    size_t workspace_bytes;
    struct krk_batch batch; /* batch.max_ctx must be set */
    int32_t variant;        /* KRK_DSA_SCORE_*: how the scores are computed */
    cudaEvent_t *events;    /* (optional, profiling) [4]: (begin, end) around the scores, then around
                               the top-k, of the first group of tokens */
};
/* Top-k: a radix select, one block per query, 4 passes of 8 bits; its histograms take one shared
 * atomic per key, and the bin of each pass is found by a warp scan. */
/* Score variants: fp32 on CUDA cores (0); bf16 tensor cores (queries rounded to bf16, fp32
 * accumulation; index heads a multiple of 16 up to 64, head_dim a multiple of 16, aligned key rows;
 * otherwise the default runs). */
enum { KRK_DSA_SCORE_FP32 = 0, KRK_DSA_SCORE_MMA = 1 };
/* Workspace for n_tok tokens at contexts up to max_ctx (less still works: tokens go in smaller
 * groups). */
size_t krk_dsa_index_workspace_bytes(int64_t n_tok, int64_t max_ctx);
enum kr_status krk_dsa_index(const struct krk_dsa_index_params *p, cudaStream_t stream);

/* Absorbed MLA attention over selected (idx) or all causal (idx NULL) cached positions. */
struct krk_mla_attn_params {
    const float *q;         /* [n_tok, n_head*(nope+rope)] */
    int64_t n_head, nope, rope, v_dim, kv_lora;
    const float *kv_b;      /* [n_head*(nope+v_dim), kv_lora] fp32: per head W_UK rows then W_UV rows */
    const krk_bf16 *cache;  /* latent cache rows of `row` */
    int64_t row;
    int32_t block_size;
    const int32_t *idx;     /* [n_tok, topk] or NULL */
    int32_t topk;
    float scale;
    float *out;             /* [n_tok, n_head*v_dim] */
    void *workspace;        /* krk_mla_attn_workspace_bytes() bytes */
    size_t workspace_bytes;
    struct krk_batch batch; /* batch.max_ctx must be set when idx is NULL */
    int32_t variant;        /* KRK_MLA_ATTN_*: which kernel */
    cudaEvent_t idx_ready;  /* or NULL: an event recorded after the work that writes idx (on another
                               stream); the launcher makes `stream` wait on it after the kernels that
                               do not read idx (the absorption of the queries) and before the first
                               that does (whenever krk_mla_attention returns KR_OK) */
};
/* Kernels: a block per (token, head), fp32 (default); or all heads of a token in one block on bf16
 * tensor cores, reading each latent once per token, with a token's keys split over several blocks
 * when there are too few tokens to fill the GPU (kv_lora 512, rope 64, up to 64 heads, nope up to
 * 256, v_dim up to 128, aligned rows, workspace of krk_mla_attn_workspace_bytes:
 * krk_mla_heads_fits; otherwise the default runs). Dense attention (idx NULL) with the head-batched kernels sizes its splits by
 * batch.max_ctx. */
enum { KRK_MLA_ATTN_PER_HEAD = 0, KRK_MLA_ATTN_HEADS = 1 };
bool krk_mla_heads_fits(const struct krk_mla_attn_params *p);
size_t krk_mla_attn_workspace_bytes(int64_t n_tok, int64_t n_head, int64_t kv_lora, int64_t max_ctx);
enum kr_status krk_mla_attention(const struct krk_mla_attn_params *p, cudaStream_t stream);

/* FP8 round trip (struct krk_fp8_round_params, krk/ops.h) of indexer rows, bit for bit the CPU
 * reference's cpu_fp8_round; p->hadamard must be set. */
enum kr_status krk_fp8_round(const struct krk_fp8_round_params *p, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
