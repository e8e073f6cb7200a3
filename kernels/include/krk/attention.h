#pragma once
/* GQA attention over the block-paged K/V cache (kernels/attention/), prefill and decode. */
#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Writes the batch's new K/V rows into the cache at their positions, then for every query token t
 * of sequence s at position p and head h (KV head h / (n_head / n_kv_head)):
 *   out[t, h] = softmax_j(scale * q[t,h] . K[s, j]) V[s, j] over j = 0..p.
 * Padding sequences write no cache row. Long contexts are split across thread blocks (split-K)
 * with a fixed grid, so the launch does not depend on context length (graph capture). */
struct krk_attn_params {
    const float *q;         /* [n_tok, ld_qkv], head h at h*head_dim */
    const float *k;         /* [n_tok, ld_qkv] new keys [n_kv_head*head_dim] */
    const float *v;         /* [n_tok, ld_qkv] new values */
    int64_t ld_qkv;
    int64_t n_head, n_kv_head, head_dim; /* head_dim <= 256, multiple of 8 */
    float scale;
    krk_bf16 *k_cache;      /* [n_block, block_size, n_kv_head, head_dim] bf16 */
    krk_bf16 *v_cache;      /* [n_block, block_size, n_kv_head, head_dim] bf16 */
    int32_t block_size;
    float *out;             /* [n_tok, n_head*head_dim] */
    void *workspace;        /* scratch of krk_attn_workspace_bytes() bytes */
    struct krk_batch batch;
};
size_t krk_attn_workspace_bytes(int64_t n_tok, int64_t n_head, int64_t head_dim);
enum kr_status krk_attn(const struct krk_attn_params *p, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
