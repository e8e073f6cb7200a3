#pragma once
/* The parameters of the backend ops, defined once for the engine and the kernels. Plain C: no CUDA
 * header, so the engine's backend interface (backend/backend.h), the CPU reference and the forward
 * pass include it in any build, and the CUDA backend hands the engine's struct to the kernel
 * launcher as it is. What only a device needs (the stream, the step's batch in device memory,
 * workspace, tuning variants) travels beside it in struct krk_ctx (krk/common.h).
 *
 * Pointers are backend memory (device memory on CUDA, host memory on the CPU). Activations are
 * fp32; caches are the backend's cache element type (bf16 on CUDA, fp32 on the CPU; with
 * --kv-cache-dtype fp8 on CUDA, e4m3 bytes and scales), hence void. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* bf16 storage as seen from C (the bits of a __nv_bfloat16). */
typedef uint16_t krk_bf16;

/* Activation functions (the model's mlp_hidden_act). */
enum kr_act {
    KR_ACT_RELU2 = 0, /* relu(x)^2 */
    KR_ACT_SILU = 1,  /* x * sigmoid(x) */
    KR_ACT_GELU = 2,  /* exact erf GELU */
    KR_ACT_RELU = 3,
};

/* MoE router scoring (the model's scoring_func). */
enum kr_router_score {
    KR_ROUTER_SIGMOID = 0,
    KR_ROUTER_SOFTMAX = 1,
};

/* RMSNorm with an optional residual added first, rows of `dim`:
 *   if res: x[i] += res[i] (written back to x: the residual stream)
 *   out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w
 * out may alias x only when res is NULL. With out_bf16 the op also writes out rounded to bf16 (the
 * operand of the GEMM that reads out next: struct krk_bf16_in). */
struct krk_rmsnorm_params {
    float *x;               /* [n, ldx] fp32; read, and written when res is given */
    int64_t ldx;
    const float *res;       /* [n, dim] fp32 dense residual to add first, or NULL */
    const float *w;         /* [dim] fp32 */
    int64_t n, dim;
    float eps;
    float *out;             /* [n, dim] fp32 dense (may be NULL on CUDA when out_bf16 is given) */
    krk_bf16 *out_bf16;     /* [n, dim] bf16 dense, or NULL */
};

/* LayerNorm: out[i] = (x[i] - mean) / sqrt(var + eps) * w + b (biased variance); out may alias x. */
struct krk_layernorm_params {
    const float *x;         /* [n, ldx] */
    int64_t ldx;
    const float *w;         /* [dim] fp32 */
    const float *b;         /* [dim] fp32, may be NULL */
    int64_t n, dim;
    float eps;
    float *out;             /* [n, dim] dense */
};

/* Gated grouped RMSNorm (Mamba-2): g = y * silu(z); out = g / sqrt(mean_group(g^2) + eps) * w with the
 * mean over each group of `group` consecutive channels (gate before norm). out_bf16 as in rmsnorm. */
struct krk_gated_rmsnorm_params {
    const float *y;         /* [n, dim] */
    const float *z;         /* [n, ldz] */
    int64_t ldz;
    const float *w;         /* [dim] fp32 */
    int64_t n, dim, group;
    float eps;
    float *out;             /* [n, dim] fp32 */
    krk_bf16 *out_bf16;     /* [n, dim] bf16, or NULL */
};

/* out[t, j] = act(gate[t, j]) * x[t, j] when gate is given, else act(x[t, j]); out_bf16 as in rmsnorm. */
struct krk_act_params {
    enum kr_act act;
    const float *gate;      /* [n, ld_in], may be NULL */
    const float *x;         /* [n, ld_in] */
    int64_t ld_in, n, width;
    float *out;             /* [n, width] fp32 dense */
    krk_bf16 *out_bf16;     /* [n, width] bf16, or NULL */
};

/* The bf16 operand of a GEMM that reads x [n, cols] (a row stride of its own): room in the caller's
 * workspace for x rounded to bf16, and whether the op that wrote x has filled it already (its
 * out_bf16). A backend whose GEMMs round x to bf16 reads a filled copy instead of rounding again,
 * and may round x into the room otherwise; a backend with fp32 GEMMs (the CPU) ignores it. The
 * forward pass marks it filled only for the GEMMs right after the op that wrote it. */
struct krk_bf16_in {
    krk_bf16 *data;         /* [n, ld] bf16 */
    int64_t ld;             /* row stride (>= cols) */
    int64_t cap;            /* elements of room */
    bool filled;            /* data holds bf16(x) for the GEMM's rows and columns */
};

/* DeepSeek-V3 routing: sigmoid or softmax scores, correction bias for selection only, group-limited
 * top-k (groups ranked by the sum of their top-2 biased scores), optional normalisation of the chosen
 * weights, then scaling. */
struct krk_route_params {
    const float *logits;    /* [n, n_expert] router logits */
    const float *bias;      /* [n_expert] e_score_correction_bias, may be NULL */
    int64_t n, n_expert, n_used, n_group, topk_group; /* CUDA: n_expert <= 1024, n_used <= 32 */
    bool norm_topk;
    float scale;            /* routed_scaling_factor */
    enum kr_router_score score;
    int32_t *ids;           /* [n, n_used] out: chosen experts */
    float *weights;         /* [n, n_used] out: their weights */
};

/* Rotary embedding of the current batch's tokens at their positions: for every token t, n_vec
 * vectors at x + t*ld + i*stride, rotating `dim` elements starting at `off` by angles
 * pos * inv_freq[j] (fp32), with cos/sin scaled by `factor`; interleaved pairs (2j, 2j+1) or
 * half-split pairs (j, j + dim/2). The positions are the batch's (krk_ctx.batch on CUDA). */
struct krk_rope_params {
    float *x;
    int64_t ld, n_vec, stride, off, dim;
    bool interleaved;
    const float *inv_freq;  /* [dim / 2] fp32 */
    float factor;
};

/* One Mamba-2 mixer step of a layer over the current batch, after its input projection:
 *   xBC = SiLU(causal depthwise conv(xBC) + conv_b), per sequence, the K-1 previous inputs taken from
 *         its conv state (zeros when the sequence's seq_pos0 is 0); the state becomes its last K-1 inputs
 *   dt_t = clamp(softplus(dt_raw_t[h] + dt_bias[h]), dt_min, dt_max), A = -exp(A_log[h])
 *   state = exp(dt_t A) state + dt_t x_t B_t^T;  y_t = state C_t + D[h] x_t
 * per sequence and head h (group g = h / (n_head / n_group)), from the sequence's SSM state (zeros
 * when seq_pos0 is 0), the final state written back; several tokens take the chunked algorithm
 * (chunks of `chunk`), one the recurrence. States are indexed by the batch's seq_slot (padding
 * sequences, slot < 0: no state read or written, rows unspecified). Activations are [n_tok, ...]. */
struct krk_mamba_params {
    const float *zxbcdt;    /* [n_tok, ld_in] in_proj output: [z | xBC | dt] */
    int64_t ld_in;          /* row stride of zxbcdt (= in_proj rows) */
    int64_t d_inner;        /* heads * head_dim */
    int64_t n_head;         /* SSM heads */
    int64_t head_dim;       /* P */
    int64_t n_group;        /* G */
    int64_t d_state;        /* N */
    int64_t d_conv;         /* K (CUDA: 2..8) */
    int64_t chunk;          /* SSD chunk length */
    const float *conv_w;    /* [conv_dim, K] fp32, conv_dim = d_inner + 2 * n_group * d_state */
    const float *conv_b;    /* [conv_dim] fp32, may be NULL */
    const float *dt_bias;   /* [n_head] fp32 */
    const float *A_log;     /* [n_head] fp32 */
    const float *D;         /* [n_head] fp32 */
    float dt_min, dt_max;   /* dt clamp (applied only when dt_min > 0 / dt_max finite) */
    void *conv_state;       /* [n_slot, K-1, conv_dim] this layer's conv states (cache element type) */
    float *ssm_state;       /* [n_slot, n_head, head_dim, d_state] this layer's SSM states, fp32 */
    float *xbc;             /* [n_tok, conv_dim] workspace: conv output (after SiLU) */
    float *y;               /* [n_tok, d_inner] output: SSD output incl. D skip, before the gated norm */
};

/* Routed experts: out[t] = sum_k weights[t,k] * E_{ids[t,k]}(x[t]) for t < n, with
 * E(x) = down(act(gate x) * (up x)) for gated experts, else down(act(up x)); expert ids outside
 * [0, n_expert) contribute zero. The experts' weights are not part of this struct: they are each
 * backend's own handles, passed beside it (the engine's arrays of weight tensors, struct
 * kr_expert_weights in backend/backend.h; on CUDA, device arrays of bf16 pointers built from them
 * once per model, struct krk_expert_ptrs in krk/moe.h). */
struct krk_experts_params {
    const float *x;         /* [n, d_in] */
    int64_t n, d_in, d_ffn, d_out, n_expert, n_used;
    const int32_t *ids;     /* [n, n_used] */
    const float *weights;   /* [n, n_used] */
    enum kr_act act;
    float *out;             /* [n, d_out] overwritten */
    bool plain;             /* CUDA, FP8 experts: the per-element kernels even where the grouped
                               tensor-core products take the shape (tests) */
};

/* GQA attention for one layer over the block-paged K/V cache: the batch's new K/V rows are written
 * into the cache at their positions first, then for every query token t of sequence s at position p
 * and head h (KV head h / (n_head / n_kv_head)):
 *   out[t, h] = softmax_j(scale * q[t,h] . K[s, j]) V[s, j] over j = 0..p. */
struct krk_attn_params {
    const float *q;         /* [n_tok, ld_qkv] queries, head h at h*head_dim */
    const float *k;         /* [n_tok, ld_qkv] new keys [n_kv_head * head_dim] */
    const float *v;         /* [n_tok, ld_qkv] new values */
    int64_t ld_qkv;         /* row stride of q, k and v */
    int64_t n_head, n_kv_head, head_dim; /* CUDA: head_dim <= 256, a multiple of 8 */
    float scale;            /* softmax scale */
    void *k_cache;          /* [n_block, block_size, n_kv_head, head_dim] this layer's keys */
    void *v_cache;          /* [n_block, block_size, n_kv_head, head_dim] */
    int32_t block_size;
    float *out;             /* [n_tok, n_head * head_dim] */
    bool kv_fp8;            /* --kv-cache-dtype fp8: cached keys and values are e4m3 with one scale per
                               tensor, x -> e4m3(x / s) * s (k_scale, v_scale). The CPU reference keeps
                               the rounded values in its fp32 rows; CUDA stores the e4m3 codes, a byte
                               per value, and reads them back as code * s */
    float k_scale, v_scale;
};

/* --kv-cache-dtype fp8 on a backend that stores the bytes (CUDA): a latent cache row is DeepSeek's
 * fp8_ds_mla row, then (D layers) the index key, all byte offsets from the row's start:
 *   [0, kv_lora)                    c_kv as e4m3 codes, in blocks of KRK_FP8_CACHE_BLOCK (the last may
 *                                   be shorter), each block's codes and scale those of kr_fp8_act_quant
 *   [kv_lora, + 4 * blocks)         the blocks' fp32 scales
 *   [.., + 2 * rope)                k_pe as bf16
 *   [key_off, + idx_dim)            the index key as e4m3 codes (the FP8 indexer's rounding: the key
 *                                   the indexer made, code * scale, bit for bit)
 *   [.., + 4 * key blocks)          its fp32 scales, one per block of min(idx_dim, 128)
 * (656 + 132 bytes a token for DeepSeek-V3.2: kv_lora 512, rope 64, idx_dim 128.) A value is read
 * back as fp32 code * scale, which is what the CPU reference keeps. kv_lora and idx_dim must be
 * multiples of 4 and rope even (4-byte aligned scales). */
#define KRK_FP8_CACHE_BLOCK 128
#ifdef __CUDACC__
#define KRK_HOST_DEVICE __host__ __device__
#else
#define KRK_HOST_DEVICE
#endif
KRK_HOST_DEVICE static inline int64_t krk_fp8_cache_blocks(int64_t n)
{
    return (n + KRK_FP8_CACHE_BLOCK - 1) / KRK_FP8_CACHE_BLOCK;
}
/* Bytes of [c_kv | scales | k_pe]: the offset of the index key. */
KRK_HOST_DEVICE static inline int64_t krk_fp8_latent_bytes(int64_t kv_lora, int64_t rope)
{
    return kv_lora + 4 * krk_fp8_cache_blocks(kv_lora) + 2 * rope;
}
/* Bytes of an index key of idx_dim values (0: none). */
KRK_HOST_DEVICE static inline int64_t krk_fp8_key_bytes(int64_t idx_dim)
{
    return idx_dim + 4 * krk_fp8_cache_blocks(idx_dim);
}

/* MLA/DSA latent cache write: for every token of the batch, its row of this layer's latent cache
 * (block-paged like K/V) becomes [c_kv (kv_lora) | k_pe (rope) | index key (idx_dim, D only)]. */
struct krk_mla_cache_params {
    const float *c_kv;      /* [n_tok, ld_ckv] normalised KV latent */
    int64_t ld_ckv;
    const float *k_pe;      /* [n_tok, ld_kpe] rotated shared key rope part */
    int64_t ld_kpe;
    const float *ik;        /* [n_tok, idx_dim] indexer keys (after LayerNorm and RoPE); NULL for '+' */
    int64_t kv_lora, rope, idx_dim; /* row = kv_lora + rope + idx_dim (idx_dim 0 for '+') */
    void *cache;            /* [n_block, block_size, row] this layer's latent cache */
    int32_t block_size;
    bool fp8;               /* --kv-cache-dtype fp8 (DeepSeek's fp8_ds_mla): c_kv as e4m3 in blocks of 128
                               with an fp32 scale each (kr_fp8_act_quant), k_pe as bf16; the index key as
                               the FP8 indexer path made it. The CPU reference rounds them so on write
                               (fp32 rows of `row` values); CUDA writes the bytes (rows of
                               krk_fp8_latent_bytes + krk_fp8_key_bytes, layout above) */
};

/* Lightning indexer selection (DeepSeek sparse attention): for every token t of the batch at
 * position p, the top min(topk, p+1) cached positions s <= p by
 *   I[t,s] = sum_h w[t,h] relu(iq[t,h] . ik[s])   (ik[s]: the index key in the latent cache row of s)
 * (ties: lower position first), written ascending to idx[t, 0..] and padded with -1. When
 * p+1 <= topk every position is chosen and no score is computed. */
struct krk_dsa_index_params {
    const float *iq;        /* [n_tok, n_head * head_dim] indexer queries (after RoPE) */
    const float *w;         /* [n_tok, n_head] head weights (already scaled) */
    int64_t n_head, head_dim;
    const void *cache;      /* this layer's latent cache, rows of `row`, the index key at column key_off */
    int64_t row, key_off;
    int32_t block_size;
    int32_t topk;
    int32_t *idx;           /* [n_tok, topk] out */
    bool fp8;               /* packed FP8 rows (CUDA, --kv-cache-dtype fp8): row and key_off in bytes, the key
                               head_dim e4m3 codes then their fp32 scales (krk_fp8_key_bytes) */
    bool no_relu;           /* the heads' q.k enter the weighted sum as they are (Megatron's
                               dsa_indexer_scoring_relu false), not through ReLU */
};

/* Absorbed-form MLA attention over the latent cache: per token t at position p and head h,
 * q_abs = W_UK[h]^T q_nope, score(s) = scale (q_abs . c_kv[s] + q_pe . k_pe[s]) over the selected
 * positions (idx, entries outside 0..p skipped) or every position <= p (idx NULL), o_lat = the
 * softmax-weighted sum of c_kv[s], out = W_UV[h] o_lat (no visible position: zeros).
 * With `select` set, the positions are selected first, exactly as the indexer op with *select would
 * (select->idx must be idx, select->topk topk): a backend may overlap that selection with the work
 * on q that does not depend on it. The kernel launcher (krk_mla_attention) ignores `select`: the
 * CUDA backend runs krk_dsa_index itself and tells the launcher through krk_ctx.idx_ready. */
struct krk_mla_attn_params {
    const float *q;         /* [n_tok, n_head * (nope + rope)] queries, rope part rotated */
    int64_t n_head, nope, rope, v_dim, kv_lora;
    const float *kv_b;      /* [n_head * (nope + v_dim), kv_lora] fp32: per head W_UK rows then W_UV rows */
    const void *cache;      /* this layer's latent cache, rows of `row` = [c_kv | k_pe | ...] */
    int64_t row;
    int32_t block_size;
    const int32_t *idx;     /* [n_tok, topk] selected positions (-1 padded) or NULL (dense causal) */
    int32_t topk;
    float scale;
    float *out;             /* [n_tok, n_head * v_dim] */
    const struct krk_dsa_index_params *select; /* or NULL: idx is already filled (or NULL) */
    bool fp8;               /* packed FP8 rows (CUDA, --kv-cache-dtype fp8): row in bytes, the latent as
                               krk_fp8_latent_bytes lays it out */
};

/* FP8 round trip of activation rows (the DSA indexer's FP8 path, MODEL_SPEC §1.5): each of the n rows
 * of `dim` elements at x + i*ld becomes, in place, dequant(e4m3(H x)): an orthonormal Walsh-Hadamard
 * transform (scale dim^-0.5) when `hadamard`, then per block of `block` elements the reference
 * act_quant (amax floored at 1e-4; scale amax/448, or the power of two above it when `ue8m0`) and back
 * to fp32 as e4m3 value x scale. dim must be a power of two and a multiple of block (CUDA: dim in
 * [32, 1024], block at least dim/32, hadamard only). */
struct krk_fp8_round_params {
    float *x;
    int64_t ld, n, dim, block;
    bool hadamard, ue8m0;
};

/* The small per-token steps of an MLA / DSA layer between its input projections and attention, for
 * n tokens of the current batch, in this order (each in place unless said):
 *   q_lat = rmsnorm(q_lat) * q_norm                       (when q_norm; rows of q_dim)
 *   ckv = rmsnorm(kva[:, :kv_lora]) * kv_norm            (when kv_norm; else c_kv is kva's)
 *   kva[:, kv_lora:] = rope_interleaved(k_pe)
 *   ik = rope_half(layernorm(ik) * ik_norm_w + ik_norm_b) on its first `rope` dims (when ik), then
 *        the FP8 round trip of ik_fp8 (when given)
 *   w *= w_scale                                          (when w; rows of n_w)
 *   latent cache rows [c_kv | k_pe | ik] written at each token's position
 * as the individual ops compute them (angles fp32 pos * inv_freq, no fused multiply-add). A backend
 * may run it as one kernel (CUDA: without ik_fp8, rows up to KRK_MLA_PREP_MAX_ROW). */
struct krk_mla_prep_params {
    int64_t n;
    float *q_lat;               /* [n, q_dim] or NULL */
    int64_t q_dim;
    const float *q_norm;
    float *kva;                 /* [n, kv_lora + rope] */
    int64_t kv_lora, rope;
    const float *kv_norm;       /* [kv_lora] or NULL */
    float *ckv;                 /* [n, kv_lora] with kv_norm */
    float eps;
    const float *inv_freq;      /* [rope / 2] */
    float factor;
    float *ik;                  /* [n, idx_dim] or NULL */
    int64_t idx_dim;
    const float *ik_norm_w, *ik_norm_b;
    float idx_eps;
    const struct krk_fp8_round_params *ik_fp8; /* x = ik; NULL: none */
    float *w;                   /* [n, n_w] or NULL */
    int64_t n_w;
    float w_scale;
    void *cache;                /* [n_block, block_size, kv_lora + rope + (ik ? idx_dim : 0)] */
    int32_t block_size;
    bool cache_fp8;             /* the cache rows as krk_mla_cache_params.fp8 */
};

/* One row of token sampling parameters (the host sampler's semantics, engine/sampler.h). */
struct krk_sample_row {
    float temperature;      /* 0 = greedy */
    int32_t top_k;          /* <= 0 off */
    float top_p;            /* 1 off */
    float min_p;            /* 0 off */
    float presence, frequency, repetition;
    int32_t pen_off, pen_n; /* this row's entries in the penalty arrays */
    int32_t mask_off;       /* first word of this row's allowed-token bitmask in `mask`, or -1 (any
                               negative value): unconstrained. Ignored when the params' mask is NULL,
                               so that a zero-initialized row is unconstrained there */
    double u;               /* uniform draw in [0, 1) from the row's generator (unused when greedy) */
};

/* Token sampling for n rows of raw logits (row i at logits + i * ld), the host sampler's semantics
 * (engine/sampler.h; the caller contract in krk/sampling.h). Penalty entries list, per row (its
 * pen_off, pen_n), its distinct counted tokens (count = occurrences in the output, flag bit 0 = in
 * the prompt) and, while below min_tokens, its EOS and stop ids (flag bit 1). A constrained row
 * (mask_off >= 0) has an allowed-token bitmask of ceil(vocab / 32) words at mask + mask_off (bit
 * id % 32 of word id / 32 set: allowed); the tokens it leaves out are -inf before anything else,
 * and the log-probabilities reported for that row are those of the masked logits (the allowed
 * tokens normalized among themselves, the others -inf), as vLLM reports them.
 * Memory: logits are backend memory. The other arrays are host memory when the struct is handed to
 * kr_backend_sample (the CUDA backend stages them to the device and gives krk_sample the same
 * struct pointing at its copies), device memory when it is handed to krk_sample. */
struct krk_sample_params {
    const float *logits;            /* [n, ld] raw logits */
    int64_t ld, n, vocab;
    const struct krk_sample_row *rows; /* [n] */
    const int32_t *pen_ids;         /* [n_pen] token ids with penalties or masks, may be NULL when n_pen is 0 */
    const int32_t *pen_count;       /* [n_pen] occurrences in the output */
    const uint8_t *pen_flags;       /* [n_pen] bit 0: in the prompt; bit 1: masked (min_tokens) */
    int64_t n_pen;                  /* entries in the penalty arrays (bounds every row's range) */
    const uint32_t *mask;           /* [n_mask] allowed-token bitmasks of the constrained rows; NULL: none */
    int64_t n_mask;                 /* words in mask (bounds every row's range) */
    int32_t *out;                   /* [n] chosen ids; -1 where the row's parameters are invalid or
                                       every logit is masked (the host path reports those) */
    float *out_logprob;             /* [n] log_softmax(raw logits, masked)[chosen], may be NULL */
    int32_t n_top;                  /* top log-probabilities wanted per row (0..20, <= vocab) */
    int32_t *top_ids;               /* [n, n_top] largest raw (masked) log-probabilities, descending; may be
                                       NULL when n_top is 0 */
    float *top_lp;                  /* [n, n_top] */
};

#ifdef __cplusplus
}
#endif
