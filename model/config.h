#pragma once
/* kr_model_config: the read-only hyper-parameters of a model, parsed from a checkpoint's
 * config.json. One internal description for every source layout (MODEL_SPEC §6). */
#include <stdbool.h>
#include <stdint.h>

#include "json.h"
#include "krk/ops.h" /* enum kr_act, enum kr_router_score: shared with the kernels */
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One letter per pre-norm residual layer (Megatron's hybrid pattern grammar). */
enum kr_layer_type {
    KR_LAYER_MAMBA = 'M', /* Mamba-2 mixer */
    KR_LAYER_ATTN = '*',  /* GQA attention (no RoPE in Nemotron-H) */
    KR_LAYER_MLP = '-',   /* dense MLP (non-gated act or gated SwiGLU-style) */
    KR_LAYER_MOE = 'E',   /* DeepSeek-V3-style routed experts + shared expert */
    KR_LAYER_DSA = 'D',   /* MLA + lightning indexer ('S' is an alias) */
    KR_LAYER_MLA = '+',   /* dense MLA */
};

#define KR_MAX_LAYERS 1024
#define KR_MAX_EOS 8
#define KR_MAX_MTP_PATTERN 16

struct kr_model_config {
    char model_type[32];       /* "nemotron_h" */
    int32_t n_layer;           /* number of layers (letters in pattern) */
    char pattern[KR_MAX_LAYERS + 1]; /* one letter per layer, NUL-terminated */
    int64_t vocab;             /* vocab_size */
    int64_t dim;               /* hidden_size */
    float norm_eps;            /* layer_norm_epsilon (block norms, final norm, gated norm) */
    bool tie_embeddings;       /* tie_word_embeddings */
    int64_t max_pos;           /* max_position_embeddings */
    int32_t bos_id;            /* -1 when unset */
    int32_t n_eos;
    int32_t eos_ids[KR_MAX_EOS];
    int32_t pad_id;            /* -1 when unset */

    /* Mamba-2 (M) */
    int64_t m_heads;           /* mamba_num_heads: Hm */
    int64_t m_head_dim;        /* mamba_head_dim: P */
    int64_t m_groups;          /* n_groups: G */
    int64_t m_state;           /* ssm_state_size: N */
    int64_t m_conv;            /* conv_kernel: K */
    int64_t m_chunk;           /* chunk_size: SSD chunk length (rounding only) */
    int64_t m_d_inner;         /* Hm * P */
    int64_t m_conv_dim;        /* d_inner + 2 G N */
    int64_t m_in_proj;         /* 2 d_inner + 2 G N + Hm */
    bool m_conv_bias;          /* use_conv_bias */
    bool m_proj_bias;          /* use_bias: bias of in_proj / out_proj */
    float m_dt_min;            /* time_step_limit[0]: dt clamped below only when > 0 */
    float m_dt_max;            /* time_step_limit[1]: dt clamped above only when finite */

    /* GQA attention (*) */
    int64_t n_head;            /* num_attention_heads */
    int64_t n_kv_head;         /* num_key_value_heads */
    int64_t head_dim;          /* head_dim (legacy attention_head_dim) */
    bool attn_bias;            /* attention_bias */

    /* MLP (-) and experts */
    int64_t ffn;               /* intermediate_size */
    enum kr_act act;           /* mlp_hidden_act: relu2 | silu | gelu | relu */
    bool mlp_bias;             /* mlp_bias */

    /* MoE (E) */
    int64_t n_expert;          /* n_routed_experts */
    int64_t n_expert_used;     /* num_experts_per_tok */
    int64_t moe_ffn;           /* moe_intermediate_size */
    int64_t shared_ffn;        /* width of the shared expert MLP; 0 = none */
    int64_t moe_latent;        /* moe_latent_size; 0 = routed experts work in hidden_size */
    int64_t n_group;           /* n_group */
    int64_t topk_group;        /* topk_group */
    bool norm_topk_prob;       /* norm_topk_prob */
    float routed_scale;        /* routed_scaling_factor */
    enum kr_router_score router_score; /* scoring_func */

    /* MLA (+) and DeepSeek sparse attention (D): MODEL_SPEC §1 */
    int64_t mla_heads;         /* num_attention_heads */
    int64_t q_lora;            /* q_lora_rank; 0 = no q latent (a single q_proj) */
    int64_t kv_lora;           /* kv_lora_rank: Rkv */
    int64_t qk_nope;           /* qk_nope_head_dim: Dn */
    int64_t qk_rope;           /* qk_rope_head_dim: Dr (even) */
    int64_t v_head;            /* v_head_dim: Dv */
    int64_t idx_heads;         /* index_n_heads: Hi */
    int64_t idx_head_dim;      /* index_head_dim: Di (>= Dr) */
    int64_t idx_topk;          /* index_topk: K */
    float mla_eps;             /* eps of the q/kv latent RMSNorms (rms_norm_eps) */
    float idx_eps;             /* eps of the indexer key LayerNorm (1e-6) */
    int64_t idx_topk_freq;     /* index_topk_freq: 1, or D layers share top-k selections (below) */
    int64_t idx_skip_offset;   /* index_skip_topk_offset */
    bool idx_relu;             /* index_scoring_relu: ReLU on each head's q.k before the weighted sum */
    float mla_scale;           /* softmax scale: (Dn+Dr)^-0.5 * mscale(factor, mscale_all_dim)^2 */
    float rope_attn_factor;    /* cos/sin multiplier (YaRN attention factor; 1 without YaRN) */
    float rope_inv_freq[256];  /* [Dr/2] rotary frequencies after YaRN correction */
    bool rope_yarn;            /* rope_scaling type yarn */
    bool dsa_seen;             /* the pattern holds D or + layers */

    /* tensor parallelism: this rank's share (kr_model_config_shard); 0 of 1 unsharded */
    int32_t tp_rank, tp_size;
    int64_t kv_head0;          /* first KV head of this rank (GQA heads replicated when tp > n_kv) */

    /* checkpoint layout */
    int32_t n_mtp_layers;      /* num_nextn_predict_layers: multi-token-prediction layers the checkpoint
                                  carries (loaded only for drafting: struct kr_model_load_opts.mtp) */
    char mtp_pattern[KR_MAX_MTP_PATTERN + 1]; /* the blocks of one MTP layer (e.g. "DE"): nemotron_h's
                                  mtp_hybrid_override_pattern; deepseek_v32's decoder layer after the main ones
                                  (D, then E or - as a main layer there would be); empty when there is none */
    bool fp8_weights;          /* quantization_config fp8 (DeepSeek: block scales) or modelopt FP8 (NVIDIA:
                                  per-tensor, per-channel or block scales), matrices F8_E4M3 */
    bool fp8_modelopt;         /* the modelopt form (scales `<w>_scale`, `input_scale`, KV scales) */
    bool fp8_kv_scales;        /* modelopt kv_cache_quant_algo FP8: the checkpoint carries K/V scales */
    bool fp8_ue8m0;            /* quantization_config.scale_fmt "ue8m0": FP8 activation scales are powers of two */
    int64_t fp8_block[2];      /* weight_block_size [rows, cols] */
};

/* Fills `cfg` from a parsed config.json. `path` is used in error messages only. Accepts every
 * key alias of MODEL_SPEC §4.1 (hybrid_override_pattern / layers_block_type with both
 * vocabularies, mamba_n_groups, mamba_d_conv, mamba_chunk_size, mamba_conv_bias, mamba_dt_limit,
 * attention_head_dim, rms_norm_eps, ...) and non-finite floats written as bare tokens, strings or
 * {"__float__": ...}. Any missing required key, wrong type, inconsistent value or unsupported
 * layer letter is KR_ERR_FORMAT / KR_ERR_UNSUPPORTED with a message naming the file and key. */
enum kr_status kr_model_config_from_json(struct kr_model_config *cfg, const struct kr_json *root,
                                         const char *path, struct kr_err *err);

/* Reads DIR/config.json and calls kr_model_config_from_json. */
enum kr_status kr_model_config_load(struct kr_model_config *cfg, const char *dir, struct kr_err *err);

/* Turns a whole-model config into rank `rank` of `size`'s share (DESIGN.md, Tensor
 * parallelism): Mamba heads and groups, attention heads (KV heads split, or replicated when size is
 * a multiple of num_key_value_heads), MLP and expert intermediate widths, and MLA heads become the
 * rank's; the LM head is split by vocabulary rows; everything else is unchanged. A dimension that
 * the size does not divide is KR_ERR_UNSUPPORTED naming it. size 1 changes nothing. */
enum kr_status kr_model_config_shard(struct kr_model_config *cfg, int32_t rank, int32_t size, struct kr_err *err);

/* Counts of each layer type. */
int32_t kr_model_config_count(const struct kr_model_config *cfg, enum kr_layer_type t);

/* The layer whose indexer selection D layer `layer` (0-based) attends with: itself, or with
 * index_topk_freq > 1 (Megatron's dsa_indexer_topk_freq / skip_topk_offset, layer numbers 1-based
 * over the whole hybrid stack) an earlier D layer whose top-k it reuses; such a layer has no
 * indexer of its own. */
int32_t kr_model_config_topk_source(const struct kr_model_config *cfg, int32_t layer);

const char *kr_act_name(enum kr_act a);

#ifdef __cplusplus
}
#endif
