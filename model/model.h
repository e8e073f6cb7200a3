#pragma once
/* kr_model: a loaded checkpoint (config + weights on a backend) and the forward pass over a
 * flattened multi-sequence batch, written once against the backend interface. */
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "batch.h"
#include "config.h"
#include "safetensors.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kr_mlp_w {
    struct kr_tensor gate;   /* [ffn, d_in]; data NULL for non-gated MLPs */
    struct kr_tensor up;     /* [ffn, d_in] */
    struct kr_tensor down;   /* [d_out, ffn] */
    const float *gate_b;     /* [ffn] or NULL */
    const float *up_b;       /* [ffn] or NULL */
    const float *down_b;     /* [d_out] or NULL */
};

struct kr_mamba_w {
    struct kr_tensor in_proj;  /* [2 d_inner + 2 G N + Hm, dim]: rows [z, x, B, C, dt] */
    const float *in_proj_b;    /* [in_proj rows] or NULL */
    const float *conv_w;       /* [conv_dim, K] */
    const float *conv_b;       /* [conv_dim] or NULL */
    const float *dt_bias;      /* [Hm] */
    const float *A_log;        /* [Hm] */
    const float *D;            /* [Hm] */
    const float *norm_w;       /* [d_inner] gated RMSNorm weight */
    struct kr_tensor out_proj; /* [dim, d_inner] */
    const float *out_proj_b;   /* [dim] or NULL */
};

struct kr_attn_w {
    struct kr_tensor q, k, v;   /* [n_head*hd, dim], [n_kv*hd, dim], [n_kv*hd, dim] */
    struct kr_tensor o;         /* [dim, n_head*hd] */
    const float *q_b, *k_b, *v_b, *o_b; /* biases or NULL */
    float k_scale, v_scale;     /* FP8 K/V cache scales (ModelOpt's calibrated k_scale / v_scale; 1 when the
                                   checkpoint has none): used with --kv-cache-dtype fp8 */
};

struct kr_moe_w {
    struct kr_tensor router;    /* [n_expert, dim] */
    const float *router_bias;   /* [n_expert] e_score_correction_bias or NULL */
    struct kr_tensor *gate;     /* [n_expert] each [moe_ffn, d_e]; NULL for non-gated experts */
    struct kr_tensor *up;       /* [n_expert] each [moe_ffn, d_e] */
    struct kr_tensor *down;     /* [n_expert] each [d_e, moe_ffn] */
    bool has_shared;
    struct kr_mlp_w shared;     /* shared expert, dim -> dim */
    bool has_latent;
    struct kr_tensor fc1_latent; /* [latent, dim] */
    struct kr_tensor fc2_latent; /* [dim, latent] */
};

/* MLA (+) / DSA (D) layer, HF deepseek_v32 parameter names. */
struct kr_mla_w {
    struct kr_tensor q_a;       /* [q_lora, dim]; or q_proj [H*(Dn+Dr), dim] when q_lora is 0 */
    const float *q_a_norm;      /* [q_lora] latent RMSNorm weight, or NULL when absent */
    struct kr_tensor q_b;       /* [H*(Dn+Dr), q_lora] (unused without q latent) */
    struct kr_tensor kv_a;      /* [kv_lora + Dr, dim]: rows [c_kv | k_pe] */
    const float *kv_a_norm;     /* [kv_lora] or NULL */
    const float *kv_b;          /* [H*(Dn+Dv), kv_lora] fp32: per head [W_UK (Dn rows) | W_UV (Dv rows)] */
    struct kr_tensor o;         /* [dim, H*Dv] */
    bool has_indexer;           /* D layers (but those sharing a selection) */
    bool shares_topk;           /* a D layer attending with the selection of the last D layer with an
                                   indexer (kr_model_config_topk_source) */
    struct kr_tensor idx_wq_b;  /* [Hi*Di, q_lora] (or [Hi*Di, dim] without q latent) */
    struct kr_tensor idx_wk;    /* [Di, dim] */
    const float *idx_k_norm_w;  /* [Di] LayerNorm weight */
    const float *idx_k_norm_b;  /* [Di] LayerNorm bias */
    struct kr_tensor idx_w;     /* [Hi, dim] weights_proj */
};

struct kr_layer {
    enum kr_layer_type type;
    const float *norm;          /* [dim] pre-norm weight */
    int32_t cache_idx;          /* index among layers of the same cache kind (M: state, *: K/V, D/+: latent) */
    struct kr_mamba_w mamba;
    struct kr_attn_w attn;
    struct kr_mlp_w mlp;
    struct kr_moe_w moe;
    struct kr_mla_w mla;
};

/* The multi-token-prediction head (DeepSeek-V3's form, in the hybrid layout's names mtp.layers.0.*):
 * from the main model's final-normed hidden state h_i and the next token t_{i+1},
 * x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]), then its own blocks (layers n_layer ..
 * n_layer + n_mtp - 1 of struct kr_model.layers, with caches of their own), final_norm and the
 * model's LM head: logits for t_{i+2}. */
struct kr_mtp_w {
    const float *enorm;         /* [dim] */
    const float *hnorm;         /* [dim] */
    struct kr_tensor eh_e;      /* [dim, dim]: eh_proj's columns that take the normed embedding */
    struct kr_tensor eh_h;      /* [dim, dim]: those that take the normed hidden state */
    const float *final_norm;    /* [dim] */
    struct kr_tensor embed;     /* (data NULL: the model's) [vocab, dim] a token embedding of its own */
    struct kr_tensor head;      /* (data NULL: the model's) [vocab, dim] an output projection of its own */
};

struct kr_model {
    struct kr_model_config cfg;
    char *dir;                   /* checkpoint directory (owned) */
    kr_backend_t be;             /* borrowed */
    struct kr_st_archive *ar;    /* owned: weights may alias its mappings */
    struct kr_tensor embed;      /* [vocab, dim], or a tensor-parallel rank's rows of it */
    int64_t embed_row0;          /* the first vocabulary row embed holds (0 when whole) */
    struct kr_tensor lm_head;    /* [vocab, dim] (the embedding when tied) */
    const float *final_norm;     /* [dim] */
    struct kr_layer *layers;     /* [n_layer + n_mtp]: the main stack, then the MTP head's blocks */
    int32_t n_mtp;               /* blocks of the MTP head (0: not loaded) */
    struct kr_mtp_w mtp;
    bool mtp_keep;               /* each step keeps its residual stream for kr_model_mtp_forward */
    struct kr_buf mtp_h;         /* [rows, dim] the last step's residual stream (mtp_keep) */
    struct kr_buf mtp_g;         /* [rows, dim] the last MTP pass's final-normed outputs of its out rows */
    int32_t mtp_h_rows;          /* rows of the last step kept in mtp_h */
    int32_t n_mamba, n_attn;     /* layers per cache kind */
    int32_t n_mla;               /* layers with a latent cache (D and +) */
    const float *rope_inv_freq;  /* [qk_rope/2] backend copy of cfg.rope_inv_freq (MLA layers) */
    bool idx_fp8;                /* D layers score with the FP8 indexer path (kr_model_set_indexer) */
    bool kv_fp8;                 /* the caches hold FP8 rows (kr_model_set_kv_cache_dtype) */
    /* (optional) observer of the DSA selection: called after every D layer with the batch's
     * selected positions idx [n_tok, topk] (host memory, -1 padded). Tests use it. */
    void (*on_index)(void *user, int32_t layer, const struct kr_batch *b, const int32_t *idx, int32_t topk);
    void *on_index_user;
    size_t n_owned, cap_owned;
    struct kr_buf *owned;        /* backend buffers made by uploads */
    struct kr_buf work;          /* forward workspace */
    int32_t work_tokens;         /* tokens the workspace is sized for */
    int64_t res_tok, res_seq, res_ctx; /* step size the backend scratch is reserved for */
    int32_t res_block;           /* smallest cache block size reserved for (0: none yet) */
    uint64_t n_steps;            /* forward steps run */
    uint64_t idx_query_rows;     /* token rows for which a D layer computed its indexer queries and scores
                                    (steps whose contexts all fit in index_topk skip them) */
    int32_t *pad;                /* host scratch for graph-padded batches */
    size_t pad_cap;
    const float *last_logits;    /* backend memory: [n_out, vocab] logits of the last step */
    uint64_t n_params;           /* parameters loaded */
};

/* Loads the checkpoint in `dir` (config.json + safetensors) onto backend `be` (borrowed; must
 * outlive the model). Every problem with the checkpoint is a clear error in `err` naming the file,
 * the tensor and what was expected. *out is owned by the caller (kr_model_free). */
enum kr_status kr_model_load(const char *dir, kr_backend_t be, struct kr_model **out, struct kr_err *err);
void kr_model_free(struct kr_model *m);

/* kr_model_load with a progress callback, called with (layers loaded, total layers) after each
 * layer (from the loading thread). */
typedef void (*kr_progress_cb)(void *user, int done, int total);
enum kr_status kr_model_load_progress(const char *dir, kr_backend_t be, kr_progress_cb cb, void *user,
                                      struct kr_model **out, struct kr_err *err);

/* What to load beside the main stack. */
struct kr_model_load_opts {
    kr_progress_cb progress;    /* (optional) called with (layers loaded, total layers) after each layer */
    void *progress_user;
    bool mtp;                   /* the multi-token-prediction head too (speculative drafting): the
                                   checkpoint must have one (num_nextn_predict_layers 1, hybrid layout) */
};
enum kr_status kr_model_load_opts(const char *dir, kr_backend_t be, const struct kr_model_load_opts *o,
                                  struct kr_model **out, struct kr_err *err);

/* Precision of the DSA lightning indexer's scores (D layers). */
enum kr_indexer {
    KR_INDEXER_AUTO = 0, /* FP8 for FP8 checkpoints when the backend has that path, else BF16 */
    KR_INDEXER_BF16 = 1, /* the scores of HF transformers and Megatron (bf16/fp32, no quantization) */
    KR_INDEXER_FP8 = 2,  /* the DeepSeek reference's FP8 path: Hadamard-rotated indexer queries and keys
                            quantized to e4m3 per block (ue8m0 scales when the checkpoint says so) */
};

/* Chooses the indexer path (kr_model_load applies KR_INDEXER_AUTO). Call before caches are created.
 * KR_ERR_UNSUPPORTED with a message when FP8 is asked of a backend without it, or of an index_head_dim
 * that is not a power of two. */
enum kr_status kr_model_set_indexer(struct kr_model *m, enum kr_indexer mode, struct kr_err *err);
/* "auto", "bf16" or "fp8" (what --indexer takes); false for anything else. */
bool kr_indexer_parse(const char *s, enum kr_indexer *out);

/* --kv-cache-dtype. auto and bf16 keep the backend's cache precision (the CPU reference fp32, CUDA
 * bf16). fp8: attention K/V as e4m3 with one scale per tensor (the checkpoint's calibrated k_scale /
 * v_scale where it has them, else 1), MLA/DSA latents as DeepSeek's fp8_ds_mla (c_kv e4m3 in blocks of 128
 * with fp32 scales, k_pe bf16), and D layers' index keys as the FP8 indexer path makes them (the FP8
 * indexer is switched on). Mamba states are not affected. The CPU reference keeps the rounded values
 * in its fp32 rows; CUDA stores the bytes (kr_backend_kv_fp8_packed), so there the caches must be
 * made after this call (a step over caches of the other layout is refused). KR_ERR_UNSUPPORTED with a
 * message on a backend without FP8 caches or when the FP8 indexer cannot serve the model's D layers.
 * Call before caches are made. */
enum kr_kv_cache_dtype { KR_KV_CACHE_AUTO = 0, KR_KV_CACHE_BF16 = 1, KR_KV_CACHE_FP8 = 2 };
enum kr_status kr_model_set_kv_cache_dtype(struct kr_model *m, enum kr_kv_cache_dtype mode, struct kr_err *err);
/* "auto", "bf16" or "fp8" (what --kv-cache-dtype takes); false for anything else. */
bool kr_kv_cache_dtype_parse(const char *s, enum kr_kv_cache_dtype *out);

struct kr_cache;

/* Sizes the forward workspace and the backend's scratch for steps of up to n_tok tokens (n_out of
 * them with logits) in n_seq sequences with contexts up to max_ctx in cache blocks of block_size
 * positions, decode steps padded to a graph's batch size included, so that serving allocates no
 * backend memory. Larger steps still work (the workspace grows). */
enum kr_status kr_model_reserve(struct kr_model *m, int64_t n_tok, int64_t n_out, int64_t n_seq, int64_t max_ctx,
                                int32_t block_size);

/* Runs one step over `b` and writes the raw logits (fp32) of the b->n_out selected tokens to
 * `logits` ([n_out, vocab], host memory; NULL leaves them in backend memory at m->last_logits). Token ids, positions, slots and block tables are validated against the model and cache:
 * invalid input is KR_ERR_INVAL with a message, never a crash. Engine thread only. */
enum kr_status kr_model_forward(struct kr_model *m, struct kr_cache *c, const struct kr_batch *b, float *logits,
                                struct kr_err *err);

/* The MTP head (struct kr_mtp_w) over `b`, a batch laid out as for kr_model_forward whose row t
 * stands at position b->pos[t] with token b->tokens[t] = the token at the next position, and whose
 * hidden state is row src_row[t] of `src` (backend memory, [*, dim]): the main model's residual
 * stream (m->mtp_h, kept by the last kr_model_forward with m->mtp_keep; `src_final`: the model's
 * final norm is applied first) or the final-normed outputs of an earlier MTP pass (m->mtp_g).
 * Writes the MTP blocks' cache rows at b's positions, the logits of b's out rows to `logits`
 * ([n_out, vocab], host) and their final-normed outputs to m->mtp_g rows 0..n_out-1. */
enum kr_status kr_model_mtp_forward(struct kr_model *m, struct kr_cache *c, const struct kr_batch *b,
                                    const struct kr_buf *src, bool src_final, const int32_t *src_row, float *logits,
                                    struct kr_err *err);

#ifdef __cplusplus
}
#endif
