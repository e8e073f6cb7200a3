#pragma once
/* The backend vtable. Only backend implementations and backend.c include this header.
 * Every slot is required unless marked (optional). Ops read the current batch set by
 * begin_batch where they need sequence structure (embed: tokens; mamba and attention: sequences,
 * positions, slots and block tables; gather_out: out_tok). */
#include "backend.h"

struct kr_backend_i {
    const char *(*name)(kr_backend_t be);
    void (*free)(kr_backend_t be);
    size_t (*act_size)(kr_backend_t be);
    /* (optional) bytes per cached element of conv states, K/V and latent rows; act_size when NULL */
    size_t (*cache_elt_size)(kr_backend_t be);
    enum kr_status (*buf_alloc)(kr_backend_t be, size_t size, struct kr_buf *out);
    void (*buf_free)(kr_backend_t be, struct kr_buf *buf);
    enum kr_status (*upload)(kr_backend_t be, const struct kr_tensor *host, bool to_f32, bool src_persistent,
                             struct kr_tensor *out, struct kr_buf *owned);
    enum kr_status (*copy_d2h)(kr_backend_t be, void *dst, const void *src, size_t n);
    enum kr_status (*copy_h2d)(kr_backend_t be, void *dst, const void *src, size_t n);
    /* Copies n bytes between two places of backend memory (ranges do not overlap). */
    enum kr_status (*copy_d2d)(kr_backend_t be, void *dst, const void *src, size_t n);

    /* (optional) false once the device hit an unrecoverable error; any thread may ask */
    bool (*healthy)(kr_backend_t be);
    bool (*check)(kr_backend_t be);
    /* (optional) free and total device memory in bytes */
    enum kr_status (*mem_info)(kr_backend_t be, size_t *free_b, size_t *total_b);
    /* (optional) sizes internal scratch for steps of up to n_tok tokens in n_seq sequences with
     * contexts up to max_ctx in cache blocks of block_size positions, so that no allocation happens
     * while serving */
    enum kr_status (*reserve)(kr_backend_t be, const struct kr_model_config *c, int64_t n_tok, int64_t n_seq,
                              int64_t max_ctx, int32_t block_size);
    enum kr_status (*begin_batch)(kr_backend_t be, const struct kr_batch *b);
    /* (optional) ends the step begun by begin_batch (ok: every op succeeded): timings are collected,
     * a graph being captured is instantiated and launched */
    enum kr_status (*end_batch)(kr_backend_t be, bool ok);
    /* (optional) graphs of decode steps: graph_bucket gives the padded batch size a graph of n
     * single-token sequences runs as (0: no graph); graph_run, called after begin_batch, launches the
     * graph captured for `key` (*launched = true: the ops must not be issued) or starts capturing
     * the ops that follow until end_batch; graph_reset drops every graph (workspace moved). */
    int32_t (*graph_bucket)(kr_backend_t be, int32_t n);
    enum kr_status (*graph_run)(kr_backend_t be, int32_t key, bool *launched);
    void (*graph_reset)(kr_backend_t be);
    /* out[t] = w[tokens[t]] for every token of the batch; w is [vocab, dim]. */
    enum kr_status (*embed)(kr_backend_t be, const struct kr_tensor *w, int64_t row0, float *out);
    /* struct krk_rmsnorm_params: the residual added first when res, the bf16 copy when out_bf16 */
    enum kr_status (*rmsnorm)(kr_backend_t be, const struct krk_rmsnorm_params *p);
    /* y[i] += x[i] for i < n. */
    enum kr_status (*add)(kr_backend_t be, float *y, const float *x, int64_t n);
    /* y[t, :w.rows] = x[t, :w.cols] * w^T (+ bias) for t < n; row strides ldx, ldy; xb (or NULL) the
     * bf16 operand of x (struct krk_bf16_in) */
    enum kr_status (*matmul)(kr_backend_t be, const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w,
                             const float *bias, float *y, int64_t ldy, const struct krk_bf16_in *xb);
    /* (optional) kr_backend_bf16_operands; false when NULL */
    bool (*bf16_operands)(kr_backend_t be, int64_t n);
    /* (optional) kr_backend_matmul_multi / kr_backend_matmul_act (backend.h); when NULL they run
     * as matmul calls and act */
    enum kr_status (*matmul_multi)(kr_backend_t be, const float *x, int64_t ldx, int64_t n, int k,
                                   const struct kr_matmul_part *parts, const struct krk_bf16_in *xb);
    enum kr_status (*matmul_act)(kr_backend_t be, const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w,
                                 const float *bias, float *y, int64_t ldy, enum kr_act act, float *out,
                                 krk_bf16 *out_bf16, const struct krk_bf16_in *xb);
    /* struct krk_act_params */
    enum kr_status (*act)(kr_backend_t be, const struct krk_act_params *p);
    /* Causal depthwise conv (+SiLU) with carried state, then the selective state space update over
     * every sequence of the batch (chunked SSD for several tokens, the exact recurrence for one).
     * A sequence whose seq_pos0 is 0 starts from zero conv and SSM state. Final states are
     * written back to the sequence's slot. */
    enum kr_status (*mamba)(kr_backend_t be, const struct krk_mamba_params *p);
    /* struct krk_gated_rmsnorm_params */
    enum kr_status (*gated_rmsnorm)(kr_backend_t be, const struct krk_gated_rmsnorm_params *p);
    enum kr_status (*attention)(kr_backend_t be, const struct krk_attn_params *p);
    enum kr_status (*moe_route)(kr_backend_t be, const struct krk_route_params *p);
    enum kr_status (*moe_experts)(kr_backend_t be, const struct krk_experts_params *p,
                                  const struct kr_expert_weights *w);
    enum kr_status (*gather_out)(kr_backend_t be, const float *src, int64_t width, float *dst);
    enum kr_status (*layernorm)(kr_backend_t be, const struct krk_layernorm_params *p);
    enum kr_status (*scale)(kr_backend_t be, float *y, float s, int64_t n);
    enum kr_status (*rope)(kr_backend_t be, const struct krk_rope_params *p);
    /* (optional) kr_backend_rope_pair; KR_ERR_UNSUPPORTED: two rope calls */
    enum kr_status (*rope_pair)(kr_backend_t be, const struct krk_rope_params *a, const struct krk_rope_params *b);
    enum kr_status (*mla_cache_write)(kr_backend_t be, const struct krk_mla_cache_params *p);
    enum kr_status (*dsa_index)(kr_backend_t be, const struct krk_dsa_index_params *p);
    enum kr_status (*mla_attention)(kr_backend_t be, const struct krk_mla_attn_params *p);
    /* (optional) samples one token per logits row (struct krk_sample_params, host arrays) */
    enum kr_status (*sample)(kr_backend_t be, const struct krk_sample_params *p);
    /* (optional) tensor parallelism: set_tp joins the group `comm` (the collective object of this
     * backend's kind: struct kr_host_comm for the CPU) as `rank` of `size`; all_reduce sums x over
     * the ranks in place; all_gather puts the ranks' [rows, cols] blocks side by side in dst
     * [rows, size * cols]; tp_abort releases the other ranks from a collective this rank will not
     * join (a failed step). A backend without set_tp runs only as a single rank. */
    enum kr_status (*set_tp)(kr_backend_t be, int rank, int size, void *comm);
    /* (optional) kr_backend_mla_prep in one go; KR_ERR_UNSUPPORTED: run as the individual ops */
    enum kr_status (*mla_prep)(kr_backend_t be, const struct krk_mla_prep_params *p);
    /* (optional) FP8 round trip of indexer rows (struct krk_fp8_round_params) */
    enum kr_status (*fp8_round)(kr_backend_t be, const struct krk_fp8_round_params *p);
    enum kr_status (*all_reduce)(kr_backend_t be, float *x, int64_t n);
    enum kr_status (*all_gather)(kr_backend_t be, const float *src, int64_t rows, int64_t cols, float *dst);
    void (*tp_abort)(kr_backend_t be);
    /* (optional) --batch-invariant: every op computes a token's result the same way whatever else the
     * step holds (kr_backend_set_batch_invariant; be->fp8_weights is current); a backend without it
     * cannot */
    enum kr_status (*set_batch_invariant)(kr_backend_t be, bool on, struct kr_err *err);
    /* (optional) whether matmul takes F8_E4M3 weights with block scales (struct kr_tensor.scale) */
    bool (*fp8_matmul)(kr_backend_t be);
    /* (optional) true when the backend rounds cached rows to FP8 (krk_attn_params.kv_fp8,
     * krk_mla_cache_params.fp8) */
    bool (*kv_fp8)(kr_backend_t be);
    /* (optional) true when those FP8 caches hold the bytes (a byte per K/V value, packed latent rows:
     * krk/ops.h krk_fp8_latent_bytes), so that the pools are sized so; false: the backend keeps the
     * rounded values in its cache element type (the CPU reference) */
    bool (*kv_fp8_packed)(kr_backend_t be);
    /* (optional) true when mamba honours struct kr_batch.tok_state_slot */
    bool (*token_states)(kr_backend_t be);
};

struct kr_backend {
    struct kr_backend_i iface;
    void *ctx;
    int api_version;
    int tp_rank, tp_size; /* this backend's place in its tensor-parallel group (0, 1 alone) */
    bool fp8_weights;     /* kr_backend_set_fp8_weights */
    bool batch_invariant; /* kr_backend_set_batch_invariant */
};

#define KR_BACKEND_API_VERSION 1
