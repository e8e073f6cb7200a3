#include "config.h"

#include "log.h"

#include <math.h>

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif
#include <stdio.h>
#include <string.h>
#include <strings.h>

/* ---- typed lookups with aliases ------------------------------------------------------------ */

/* Returns the first present (non-null) value among the NULL-terminated key list, and the key
 * that matched in *which. */
static const struct kr_json *lookup(const struct kr_json *root, const char *const *keys, const char **which)
{
    for (; *keys; keys++) {
        const struct kr_json *v = kr_json_get(root, *keys);
        if (v && v->type != KR_JSON_NULL) {
            if (which) {
                *which = *keys;
            }
            return v;
        }
    }
    return NULL;
}

/* Integer key: absent -> *out = def (or an error when `required`). */
static enum kr_status get_int(const struct kr_json *root, const char *path, const char *const *keys,
                              bool required, int64_t def, int64_t *out, struct kr_err *err)
{
    const char *which = keys[0];
    const struct kr_json *v = lookup(root, keys, &which);
    if (!v) {
        if (required) {
            return kr_err_set(err, KR_ERR_FORMAT, "%s: missing required key \"%s\"", path, keys[0]);
        }
        *out = def;
        return KR_OK;
    }
    if (!kr_json_as_int(v, out)) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"%s\" must be an integer, got %s", path, which,
                          kr_json_type_name(v->type));
    }
    return KR_OK;
}

static enum kr_status get_float(const struct kr_json *root, const char *path, const char *const *keys,
                                double def, double *out, struct kr_err *err)
{
    const char *which = keys[0];
    const struct kr_json *v = lookup(root, keys, &which);
    if (!v) {
        *out = def;
        return KR_OK;
    }
    if (!kr_json_as_double(v, out)) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"%s\" must be a number, got %s", path, which,
                          kr_json_type_name(v->type));
    }
    return KR_OK;
}

static enum kr_status get_bool(const struct kr_json *root, const char *path, const char *const *keys, bool def,
                               bool *out, struct kr_err *err)
{
    const char *which = keys[0];
    const struct kr_json *v = lookup(root, keys, &which);
    if (!v) {
        *out = def;
        return KR_OK;
    }
    if (v->type != KR_JSON_BOOL) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"%s\" must be true or false, got %s", path, which,
                          kr_json_type_name(v->type));
    }
    *out = v->boolean;
    return KR_OK;
}

#define KEYS(...)                                                                                  \
    (const char *const[])                                                                          \
    {                                                                                              \
        __VA_ARGS__, NULL                                                                          \
    }

/* ---- layer pattern ------------------------------------------------------------------------- */

/* Maps one pattern letter to a layer type; 0 for '|' (ignored), -1 when unknown. */
static int letter_type(char c)
{
    switch (c) {
    case 'M':
    case '*':
    case '-':
    case 'E':
        return c;
    case 'D':
    case 'S':
        return KR_LAYER_DSA;
    case '+':
        return KR_LAYER_MLA;
    case '|':
        return 0;
    default:
        return -1;
    }
}

/* Maps a layers_block_type name (both vocabularies) to a letter; 0 when unknown. */
static char name_type(const char *s)
{
    static const struct {
        const char *name;
        char letter;
    } names[] = {
        {"mamba", 'M'},         {"linear_attention", 'M'}, {"attention", '*'}, {"full_attention", '*'},
        {"mlp", '-'},           {"moe", 'E'},              {"dsa", 'D'},       {"deepseek_sparse_attention", 'D'},
        {"indexed_attention", 'D'}, {"mla", '+'},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (!strcmp(s, names[i].name)) {
            return names[i].letter;
        }
    }
    return 0;
}

static enum kr_status parse_pattern_string(struct kr_model_config *cfg, const char *s, const char *path,
                                           const char *key, struct kr_err *err)
{
    int32_t n = 0;
    for (size_t i = 0; s[i]; i++) {
        int t = letter_type(s[i]);
        if (t < 0) {
            return kr_err_set(err, KR_ERR_UNSUPPORTED,
                              "%s: key \"%s\": unsupported layer letter '%c' at index %zu (supported: M * - E, "
                              "D/S + with DSA support, | ignored)",
                              path, key, s[i], i);
        }
        if (t == 0) {
            continue;
        }
        if (n >= KR_MAX_LAYERS) {
            return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"%s\": more than %d layers", path, key, KR_MAX_LAYERS);
        }
        cfg->pattern[n++] = (char)t;
    }
    cfg->pattern[n] = 0;
    cfg->n_layer = n;
    return KR_OK;
}

static enum kr_status parse_pattern_list(struct kr_model_config *cfg, const struct kr_json *list,
                                         const char *path, const char *key, struct kr_err *err)
{
    if (list->type != KR_JSON_ARRAY) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"%s\" must be a list of layer type names, got %s", path,
                          key, kr_json_type_name(list->type));
    }
    if (list->n > KR_MAX_LAYERS) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"%s\": more than %d layers", path, key, KR_MAX_LAYERS);
    }
    for (size_t i = 0; i < list->n; i++) {
        const struct kr_json *it = &list->items[i];
        char c = it->type == KR_JSON_STRING ? name_type(it->str) : 0;
        if (!c) {
            return kr_err_set(err, KR_ERR_UNSUPPORTED,
                              "%s: key \"%s\"[%zu]: unsupported layer type %s%s%s (expected one of mamba, "
                              "linear_attention, attention, full_attention, mlp, moe)",
                              path, key, i, it->type == KR_JSON_STRING ? "\"" : "",
                              it->type == KR_JSON_STRING ? it->str : kr_json_type_name(it->type),
                              it->type == KR_JSON_STRING ? "\"" : "");
        }
        cfg->pattern[i] = c;
    }
    cfg->pattern[list->n] = 0;
    cfg->n_layer = (int32_t)list->n;
    return KR_OK;
}

static enum kr_status parse_act(const struct kr_json *root, const char *path, enum kr_act *out,
                                struct kr_err *err)
{
    const char *which = "mlp_hidden_act";
    const struct kr_json *v = lookup(root, KEYS("mlp_hidden_act", "hidden_act"), &which);
    if (!v) {
        *out = KR_ACT_RELU2;
        return KR_OK;
    }
    if (v->type == KR_JSON_STRING) {
        const char *s = v->str;
        if (!strcmp(s, "relu2")) {
            *out = KR_ACT_RELU2;
            return KR_OK;
        }
        if (!strcmp(s, "silu") || !strcmp(s, "swish")) {
            *out = KR_ACT_SILU;
            return KR_OK;
        }
        if (!strcmp(s, "gelu")) {
            *out = KR_ACT_GELU;
            return KR_OK;
        }
        if (!strcmp(s, "relu")) {
            *out = KR_ACT_RELU;
            return KR_OK;
        }
    }
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "%s: key \"%s\": unsupported activation %s (expected relu2, silu, gelu or relu)",
                      path, which, v->type == KR_JSON_STRING ? v->str : kr_json_type_name(v->type));
}

const char *kr_act_name(enum kr_act a)
{
    switch (a) {
    case KR_ACT_RELU2:
        return "relu2";
    case KR_ACT_SILU:
        return "silu";
    case KR_ACT_GELU:
        return "gelu";
    case KR_ACT_RELU:
        return "relu";
    }
    return "?";
}

int32_t kr_model_config_count(const struct kr_model_config *cfg, enum kr_layer_type t)
{
    int32_t n = 0;
    for (int32_t i = 0; i < cfg->n_layer; i++) {
        n += cfg->pattern[i] == (char)t;
    }
    return n;
}

int32_t kr_model_config_topk_source(const struct kr_model_config *cfg, int32_t layer)
{
    const int64_t freq = cfg->idx_topk_freq > 1 ? cfg->idx_topk_freq : 1;
    const int64_t off = cfg->idx_skip_offset > 1 ? cfg->idx_skip_offset : 1, ln = (int64_t)layer + 1;
    if (freq == 1 || ln <= off) {
        return layer;
    }
    return (int32_t)(ln - (ln - off) % freq - 1);
}

/* Positive-integer check with a message naming the key. */
static enum kr_status need_pos(int64_t v, const char *path, const char *key, struct kr_err *err)
{
    if (v <= 0 || v > (int64_t)1 << 40) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"%s\" must be a positive integer, got %lld", path, key,
                          (long long)v);
    }
    return KR_OK;
}

/* The largest width, head count or expert count a config may give (2^20: the widest released models
 * stay below 2^17). Tensor sizes are products of up to three of them, which then fit an int64 with
 * room to spare; 2^40 each would overflow a product of two. */
#define KR_MAX_DIM ((int64_t)1 << 20)

/* A width, head count or expert count: positive and at most KR_MAX_DIM (or >= 0 when zero_ok). */
static enum kr_status need_dim(int64_t v, bool zero_ok, const char *path, const char *key, struct kr_err *err)
{
    if (v < !zero_ok || v > KR_MAX_DIM) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"%s\" must be a %s integer of at most %lld, got %lld", path,
                          key, zero_ok ? "non-negative" : "positive", (long long)KR_MAX_DIM, (long long)v);
    }
    return KR_OK;
}

static enum kr_status parse_token_ids(struct kr_model_config *cfg, const struct kr_json *root, const char *path,
                                      struct kr_err *err)
{
    int64_t v;
    KR_TRY(get_int(root, path, KEYS("bos_token_id"), false, -1, &v, err));
    cfg->bos_id = (int32_t)v;
    KR_TRY(get_int(root, path, KEYS("pad_token_id"), false, -1, &v, err));
    cfg->pad_id = (int32_t)v;
    cfg->n_eos = 0;
    const struct kr_json *eos = kr_json_get(root, "eos_token_id");
    if (eos && eos->type == KR_JSON_ARRAY) {
        for (size_t i = 0; i < eos->n && cfg->n_eos < KR_MAX_EOS; i++) {
            if (!kr_json_as_int(&eos->items[i], &v)) {
                return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"eos_token_id\"[%zu] must be an integer", path, i);
            }
            cfg->eos_ids[cfg->n_eos++] = (int32_t)v;
        }
    } else if (eos && eos->type != KR_JSON_NULL) {
        if (!kr_json_as_int(eos, &v)) {
            return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"eos_token_id\" must be an integer or a list", path);
        }
        cfg->eos_ids[cfg->n_eos++] = (int32_t)v;
    }
    return KR_OK;
}


/* ---- MLA / DSA and RoPE ---------------------------------------------------------------------- */

/* mscale(s, a) = 1 if s <= 1 else 0.1 a ln(s) + 1 (YaRN; MODEL_SPEC §1.3) */
static double yarn_mscale(double s, double a)
{
    return s <= 1.0 ? 1.0 : 0.1 * a * log(s) + 1.0;
}

/* Dims (out of Dr) below which frequencies are extrapolated / above which interpolated. */
static double yarn_corr_dim(double n_rot, int64_t dim, double base, double orig)
{
    return (double)dim * log(orig / (n_rot * 2.0 * M_PI)) / (2.0 * log(base));
}

static enum kr_status parse_rope(struct kr_model_config *cfg, const struct kr_json *root, const char *path,
                                 struct kr_err *err)
{
    const int64_t Dr = cfg->qk_rope;
    const char *which = "rope_scaling";
    const struct kr_json *rs = lookup(root, KEYS("rope_scaling", "rope_parameters"), &which);
    if (rs && rs->type != KR_JSON_OBJECT) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"%s\" must be an object or null", path, which);
    }
    double theta;
    KR_TRY(get_float(root, path, KEYS("rope_theta"), 10000.0, &theta, err));
    if (rs && kr_json_get(rs, "rope_theta")) {
        KR_TRY(get_float(rs, path, KEYS("rope_theta"), theta, &theta, err));
    }
    if (!(theta > 1.0) || !isfinite(theta)) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: rope_theta must be a finite number > 1, got %g", path, theta);
    }
    const struct kr_json *ty = rs ? lookup(rs, KEYS("rope_type", "type"), NULL) : NULL;
    if (ty && ty->type != KR_JSON_STRING) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: %s.rope_type must be a string", path, which);
    }
    cfg->rope_yarn = ty && !strcmp(ty->str, "yarn");
    if (ty && !cfg->rope_yarn && strcmp(ty->str, "default") != 0) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED, "%s: %s.rope_type \"%s\" is not supported (yarn or default)",
                          path, which, ty->str);
    }
    double scale = 1.0;
    cfg->rope_attn_factor = 1.0f;
    for (int64_t i = 0; i < Dr / 2; i++) {
        cfg->rope_inv_freq[i] = (float)(1.0 / pow(theta, (double)(2 * i) / (double)Dr));
    }
    if (cfg->rope_yarn) {
        double factor, orig, beta_fast, beta_slow, mscale, mscale_all, attn_factor;
        int64_t orig_i;
        KR_TRY(get_float(rs, path, KEYS("factor"), NAN, &factor, err));
        if (!(factor >= 1.0) || !isfinite(factor)) {
            return kr_err_set(err, KR_ERR_FORMAT, "%s: %s.factor must be a finite number >= 1", path, which);
        }
        KR_TRY(get_int(rs, path, KEYS("original_max_position_embeddings"), false, cfg->max_pos, &orig_i, err));
        orig = (double)orig_i;
        KR_TRY(get_float(rs, path, KEYS("beta_fast"), 32.0, &beta_fast, err));
        KR_TRY(get_float(rs, path, KEYS("beta_slow"), 1.0, &beta_slow, err));
        KR_TRY(get_float(rs, path, KEYS("mscale"), 0.0, &mscale, err));
        KR_TRY(get_float(rs, path, KEYS("mscale_all_dim"), 0.0, &mscale_all, err));
        KR_TRY(get_float(rs, path, KEYS("attention_factor"), NAN, &attn_factor, err));
        bool truncate = true;
        KR_TRY(get_bool(rs, path, KEYS("truncate"), true, &truncate, err));
        if (orig < 1) {
            return kr_err_set(err, KR_ERR_FORMAT, "%s: %s.original_max_position_embeddings must be >= 1", path, which);
        }
        double low = yarn_corr_dim(beta_fast, Dr, theta, orig), high = yarn_corr_dim(beta_slow, Dr, theta, orig);
        if (truncate) {
            low = floor(low);
            high = ceil(high);
        }
        low = low > 0 ? low : 0;
        high = high < (double)(Dr - 1) ? high : (double)(Dr - 1);
        if (low == high) {
            high += 0.001; /* avoid a division by zero in the ramp */
        }
        for (int64_t i = 0; i < Dr / 2; i++) {
            double ramp = ((double)i - low) / (high - low);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            const double f = 1.0 / pow(theta, (double)(2 * i) / (double)Dr);
            const double keep = 1.0 - ramp; /* extrapolation weight: high-frequency dims keep f */
            cfg->rope_inv_freq[i] = (float)(f / factor * (1.0 - keep) + f * keep);
        }
        if (isnan(attn_factor)) {
            attn_factor = (mscale != 0 && mscale_all != 0) ? yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                                                           : yarn_mscale(factor, 1.0);
        }
        cfg->rope_attn_factor = (float)attn_factor;
        if (mscale_all != 0) {
            const double m = yarn_mscale(factor, mscale_all);
            scale *= m * m;
        }
    }
    cfg->mla_scale = (float)(scale / sqrt((double)(cfg->qk_nope + cfg->qk_rope)));
    return KR_OK;
}

/* MLA/DSA hyper-parameters with their deepseek_v32 names (at the top level of config.json for both
 * layouts). */
static enum kr_status parse_mla(struct kr_model_config *cfg, const struct kr_json *root, const char *path,
                                struct kr_err *err)
{
    cfg->dsa_seen = true;
    KR_TRY(get_int(root, path, KEYS("num_attention_heads"), true, 0, &cfg->mla_heads, err));
    KR_TRY(need_dim(cfg->mla_heads, false, path, "num_attention_heads", err));
    KR_TRY(get_int(root, path, KEYS("q_lora_rank"), false, 0, &cfg->q_lora, err));
    KR_TRY(need_dim(cfg->q_lora, true, path, "q_lora_rank", err)); /* 0 (or null): no q latent */
    KR_TRY(get_int(root, path, KEYS("kv_lora_rank"), true, 0, &cfg->kv_lora, err));
    KR_TRY(need_dim(cfg->kv_lora, false, path, "kv_lora_rank", err));
    KR_TRY(get_int(root, path, KEYS("qk_nope_head_dim"), true, 0, &cfg->qk_nope, err));
    KR_TRY(need_dim(cfg->qk_nope, false, path, "qk_nope_head_dim", err));
    KR_TRY(get_int(root, path, KEYS("qk_rope_head_dim"), true, 0, &cfg->qk_rope, err));
    KR_TRY(need_dim(cfg->qk_rope, false, path, "qk_rope_head_dim", err));
    KR_TRY(get_int(root, path, KEYS("v_head_dim"), true, 0, &cfg->v_head, err));
    KR_TRY(need_dim(cfg->v_head, false, path, "v_head_dim", err));
    if (cfg->qk_rope % 2 || cfg->qk_rope > 512) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: qk_rope_head_dim (%lld) must be even and at most 512", path,
                          (long long)cfg->qk_rope);
    }
    double d;
    /* the latent norms use DeepSeek's rms_norm_eps (1e-6 when absent), not the hybrid's block eps */
    KR_TRY(get_float(root, path, KEYS("rms_norm_eps"), 1e-6, &d, err));
    if (!(d > 0 && d < 1)) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"rms_norm_eps\" must be in (0, 1), got %g", path, d);
    }
    cfg->mla_eps = (float)d;
    if (kr_model_config_count(cfg, KR_LAYER_DSA)) {
        KR_TRY(get_int(root, path, KEYS("index_n_heads"), true, 0, &cfg->idx_heads, err));
        KR_TRY(need_dim(cfg->idx_heads, false, path, "index_n_heads", err));
        KR_TRY(get_int(root, path, KEYS("index_head_dim"), true, 0, &cfg->idx_head_dim, err));
        KR_TRY(need_dim(cfg->idx_head_dim, false, path, "index_head_dim", err));
        KR_TRY(get_int(root, path, KEYS("index_topk"), true, 0, &cfg->idx_topk, err));
        KR_TRY(need_pos(cfg->idx_topk, path, "index_topk", err));
        if (cfg->idx_head_dim < cfg->qk_rope) {
            return kr_err_set(err, KR_ERR_FORMAT,
                              "%s: index_head_dim (%lld) must be at least qk_rope_head_dim (%lld): the indexer "
                              "rotates its first qk_rope_head_dim dims",
                              path, (long long)cfg->idx_head_dim, (long long)cfg->qk_rope);
        }
        if (cfg->idx_topk > INT32_MAX) {
            return kr_err_set(err, KR_ERR_FORMAT, "%s: index_topk is too large", path);
        }
        KR_TRY(get_float(root, path, KEYS("index_k_norm_eps", "dsa_indexer_k_norm_epsilon"), 1e-6, &d, err));
        cfg->idx_eps = (float)d;
        KR_TRY(get_bool(root, path, KEYS("index_scoring_relu", "dsa_indexer_scoring_relu"), true, &cfg->idx_relu,
                        err));
        KR_TRY(get_int(root, path, KEYS("index_topk_freq", "dsa_indexer_topk_freq"), false, 1, &cfg->idx_topk_freq,
                       err));
        KR_TRY(need_pos(cfg->idx_topk_freq, path, "index_topk_freq", err));
        KR_TRY(get_int(root, path, KEYS("index_skip_topk_offset", "dsa_indexer_skip_topk_offset"), false, 0,
                       &cfg->idx_skip_offset, err));
        KR_TRY(need_dim(cfg->idx_skip_offset, true, path, "index_skip_topk_offset", err));
        /* a layer sharing a selection needs a D layer with an indexer at its source */
        for (int32_t i = 0; i < cfg->n_layer; i++) {
            const int32_t src = kr_model_config_topk_source(cfg, i);
            if (cfg->pattern[i] == KR_LAYER_DSA && src != i && cfg->pattern[src] != KR_LAYER_DSA) {
                return kr_err_set(err, KR_ERR_FORMAT,
                                  "%s: with index_topk_freq %lld and index_skip_topk_offset %lld, D layer %d would "
                                  "reuse the top-k of layer %d, which is not a D layer",
                                  path, (long long)cfg->idx_topk_freq, (long long)cfg->idx_skip_offset, i, src);
            }
        }
    }
    return parse_rope(cfg, root, path, err);
}

/* Routed-expert hyper-parameters (DeepSeek-V3 router), shared by both layouts. */
static enum kr_status parse_moe(struct kr_model_config *cfg, const struct kr_json *root, const char *path,
                               struct kr_err *err)
{
    double d;
    KR_TRY(get_int(root, path, KEYS("n_routed_experts", "num_local_experts"), true, 0, &cfg->n_expert, err));
    KR_TRY(need_dim(cfg->n_expert, false, path, "n_routed_experts", err));
    KR_TRY(get_int(root, path, KEYS("num_experts_per_tok"), true, 0, &cfg->n_expert_used, err));
    KR_TRY(need_dim(cfg->n_expert_used, false, path, "num_experts_per_tok", err));
    KR_TRY(get_int(root, path, KEYS("moe_intermediate_size"), true, 0, &cfg->moe_ffn, err));
    KR_TRY(need_dim(cfg->moe_ffn, false, path, "moe_intermediate_size", err));
    int64_t n_shared;
    KR_TRY(get_int(root, path, KEYS("n_shared_experts"), false, 1, &n_shared, err));
    KR_TRY(need_dim(n_shared, true, path, "n_shared_experts", err));
    KR_TRY(get_int(root, path, KEYS("moe_shared_expert_intermediate_size"), false, n_shared * cfg->moe_ffn,
                &cfg->shared_ffn, err));
    if (n_shared == 0) {
        cfg->shared_ffn = 0;
    }
    KR_TRY(need_dim(cfg->shared_ffn, true, path, "moe_shared_expert_intermediate_size", err));
    KR_TRY(get_int(root, path, KEYS("moe_latent_size"), false, 0, &cfg->moe_latent, err));
    KR_TRY(need_dim(cfg->moe_latent, true, path, "moe_latent_size", err));
    KR_TRY(get_int(root, path, KEYS("n_group"), false, 1, &cfg->n_group, err));
    KR_TRY(need_dim(cfg->n_group, false, path, "n_group", err));
    KR_TRY(get_int(root, path, KEYS("topk_group"), false, 1, &cfg->topk_group, err));
    KR_TRY(need_dim(cfg->topk_group, false, path, "topk_group", err));
    KR_TRY(get_bool(root, path, KEYS("norm_topk_prob"), true, &cfg->norm_topk_prob, err));
    KR_TRY(get_float(root, path, KEYS("routed_scaling_factor"), 1.0, &d, err));
    if (!isfinite(d) || !isfinite((float)d)) { /* 1e300 is a finite double but an infinite float */
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"routed_scaling_factor\" must be a finite float", path);
    }
    cfg->routed_scale = (float)d;
    cfg->router_score = KR_ROUTER_SIGMOID;
    const struct kr_json *sf = kr_json_get(root, "scoring_func");
    if (sf && sf->type == KR_JSON_STRING && !strcmp(sf->str, "softmax")) {
        cfg->router_score = KR_ROUTER_SOFTMAX;
    } else if (sf && !(sf->type == KR_JSON_STRING && !strcmp(sf->str, "sigmoid")) && sf->type != KR_JSON_NULL) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED, "%s: key \"scoring_func\" must be \"sigmoid\" or \"softmax\"", path);
    }
    if (cfg->n_expert_used > cfg->n_expert) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: num_experts_per_tok (%lld) exceeds n_routed_experts (%lld)",
                          path, (long long)cfg->n_expert_used, (long long)cfg->n_expert);
    }
    if (cfg->n_expert % cfg->n_group || cfg->topk_group > cfg->n_group) {
        return kr_err_set(err, KR_ERR_FORMAT,
                          "%s: n_routed_experts (%lld) must be a multiple of n_group (%lld) and topk_group (%lld) "
                          "at most n_group",
                          path, (long long)cfg->n_expert, (long long)cfg->n_group, (long long)cfg->topk_group);
    }
    if (cfg->n_expert_used > cfg->topk_group * (cfg->n_expert / cfg->n_group)) {
        return kr_err_set(err, KR_ERR_FORMAT,
                          "%s: num_experts_per_tok (%lld) exceeds the experts of the topk_group (%lld) selected "
                          "groups",
                          path, (long long)cfg->n_expert_used, (long long)cfg->topk_group);
    }
    return KR_OK;
}

/* ---- nemotron_h ---------------------------------------------------------------------------- */

static enum kr_status parse_layers(struct kr_model_config *cfg, const struct kr_json *root, const char *path,
                                   struct kr_err *err)
{
    const struct kr_json *pat = kr_json_get(root, "hybrid_override_pattern");
    const char *list_key = "layers_block_type";
    const struct kr_json *list = lookup(root, KEYS("layers_block_type", "layer_types"), &list_key);
    if (pat && pat->type != KR_JSON_NULL && pat->type != KR_JSON_STRING) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"hybrid_override_pattern\" must be a string, got %s", path,
                          kr_json_type_name(pat->type));
    }
    if (list) {
        KR_TRY(parse_pattern_list(cfg, list, path, list_key, err));
        if (pat && pat->type == KR_JSON_STRING) {
            struct kr_model_config tmp;
            KR_TRY(parse_pattern_string(&tmp, pat->str, path, "hybrid_override_pattern", err));
            if (strcmp(tmp.pattern, cfg->pattern) != 0) {
                return kr_err_set(err, KR_ERR_FORMAT,
                                  "%s: \"hybrid_override_pattern\" (%s) and \"%s\" (%s) disagree", path,
                                  tmp.pattern, list_key, cfg->pattern);
            }
        }
    } else if (pat && pat->type == KR_JSON_STRING) {
        KR_TRY(parse_pattern_string(cfg, pat->str, path, "hybrid_override_pattern", err));
    } else {
        return kr_err_set(err, KR_ERR_FORMAT,
                          "%s: no layer pattern: expected \"hybrid_override_pattern\" (string) or "
                          "\"layers_block_type\" (list)",
                          path);
    }
    if (cfg->n_layer == 0) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: the layer pattern is empty", path);
    }
    int64_t nl;
    KR_TRY(get_int(root, path, KEYS("num_hidden_layers"), false, cfg->n_layer, &nl, err));
    if (nl != cfg->n_layer) {
        KR_LOG_WARN("%s: num_hidden_layers=%lld does not match the %d layers of the pattern; using the pattern",
                    path, (long long)nl, cfg->n_layer);
    }
    int n_star = kr_model_config_count(cfg, KR_LAYER_ATTN);
    int n_mla = kr_model_config_count(cfg, KR_LAYER_DSA) + kr_model_config_count(cfg, KR_LAYER_MLA);
    if (n_star && n_mla) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED,
                          "%s: the pattern mixes GQA attention ('*') with MLA/DSA ('D', 'S', '+') layers, which "
                          "share num_attention_heads and are not supported together",
                          path);
    }
    return KR_OK;
}

/* Keys both layouts share: vocabulary, width, block-norm eps (the first present of `eps_keys`, default `eps_def`). */
static enum kr_status parse_dims(struct kr_model_config *cfg, const struct kr_json *root, const char *path,
                                 const char *const *eps_keys, double eps_def, struct kr_err *err)
{
    KR_TRY(get_int(root, path, KEYS("vocab_size"), true, 0, &cfg->vocab, err));
    KR_TRY(need_pos(cfg->vocab, path, "vocab_size", err));
    if (cfg->vocab > INT32_MAX) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: vocab_size %lld does not fit token ids", path, (long long)cfg->vocab);
    }
    KR_TRY(get_int(root, path, KEYS("hidden_size"), true, 0, &cfg->dim, err));
    KR_TRY(need_dim(cfg->dim, false, path, "hidden_size", err));
    double d;
    KR_TRY(get_float(root, path, eps_keys, eps_def, &d, err));
    if (!(d > 0 && d < 1)) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"%s\" must be in (0, 1), got %g", path, eps_keys[0], d);
    }
    cfg->norm_eps = (float)d;
    return KR_OK;
}

/* quantization_config (either family): DeepSeek's FP8 block scales ("quant_method": "fp8",
 * weight_block_size, scale_fmt) or NVIDIA ModelOpt's ("quant_method": "modelopt", quant_algo,
 * kv_cache_quant_algo); anything else is refused by name. */
static enum kr_status parse_quant(struct kr_model_config *cfg, const struct kr_json *root, const char *path,
                                  struct kr_err *err)
{
    const struct kr_json *q = kr_json_get(root, "quantization_config");
    const struct kr_json *qm0 = q && q->type == KR_JSON_OBJECT ? kr_json_get(q, "quant_method") : NULL;
    if (qm0 && qm0->type == KR_JSON_STRING && !strcmp(qm0->str, "modelopt")) {
        /* NVIDIA's ModelOpt export (Nemotron FP8 checkpoints): quant_algo names the scales' layout;
         * the matrices it leaves out ("ignore") are stored in bf16 and load as such */
        const struct kr_json *qa = kr_json_get(q, "quant_algo");
        static const char *const algos[] = {"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"};
        bool ok = false;
        for (size_t i = 0; qa && qa->type == KR_JSON_STRING && i < sizeof algos / sizeof algos[0]; i++) {
            ok = ok || !strcasecmp(qa->str, algos[i]);
        }
        if (!ok) {
            return kr_err_set(err, KR_ERR_UNSUPPORTED,
                              "%s: quantization_config.quant_algo %s%s%s of a modelopt checkpoint is not supported "
                              "(FP8, FP8_PER_CHANNEL_PER_TOKEN or FP8_PB_WO)",
                              path, qa && qa->type == KR_JSON_STRING ? "\"" : "",
                              qa && qa->type == KR_JSON_STRING ? qa->str : "(missing)",
                              qa && qa->type == KR_JSON_STRING ? "\"" : "");
        }
        const struct kr_json *kv = kr_json_get(q, "kv_cache_quant_algo");
        if (kv && kv->type == KR_JSON_STRING && strcasecmp(kv->str, "FP8") != 0) {
            return kr_err_set(err, KR_ERR_UNSUPPORTED,
                              "%s: quantization_config.kv_cache_quant_algo \"%s\" is not supported (FP8, or none)", path,
                              kv->str);
        }
        cfg->fp8_kv_scales = kv && kv->type == KR_JSON_STRING;
        cfg->fp8_weights = cfg->fp8_modelopt = true;
        cfg->fp8_block[0] = cfg->fp8_block[1] = 128;
        return KR_OK;
    }
    if (q && q->type == KR_JSON_OBJECT) {
        const struct kr_json *qm = kr_json_get(q, "quant_method");
        if (!qm || qm->type != KR_JSON_STRING || strcmp(qm->str, "fp8") != 0) {
            return kr_err_set(err, KR_ERR_UNSUPPORTED, "%s: quantization_config.quant_method %s%s%s is not supported (fp8, modelopt)",
                              path, qm && qm->type == KR_JSON_STRING ? "\"" : "",
                              qm && qm->type == KR_JSON_STRING ? qm->str : "(missing)",
                              qm && qm->type == KR_JSON_STRING ? "\"" : "");
        }
        const struct kr_json *bs = kr_json_get(q, "weight_block_size");
        cfg->fp8_block[0] = cfg->fp8_block[1] = 128;
        if (bs && (bs->type != KR_JSON_ARRAY || bs->n != 2 || !kr_json_as_int(&bs->items[0], &cfg->fp8_block[0]) ||
                   !kr_json_as_int(&bs->items[1], &cfg->fp8_block[1]) || cfg->fp8_block[0] < 1 ||
                   cfg->fp8_block[1] < 1)) {
            return kr_err_set(err, KR_ERR_FORMAT,
                              "%s: quantization_config.weight_block_size must be two positive integers", path);
        }
        cfg->fp8_weights = true;
        const struct kr_json *sf = kr_json_get(q, "scale_fmt");
        cfg->fp8_ue8m0 = sf && sf->type == KR_JSON_STRING && !strcmp(sf->str, "ue8m0");
    }
    return KR_OK;
}

/* Multi-token prediction in the hybrid layout: num_nextn_predict_layers MTP layers, each made of the
 * blocks named by mtp_hybrid_override_pattern (Megatron's pattern letters) or by mtp_layers_block_type
 * (a list of layer type names, as Nemotron 3's config.json has it: ["attention", "moe"]); where both
 * are given they must agree. */
static enum kr_status parse_mtp(struct kr_model_config *cfg, const struct kr_json *root, const char *path,
                                struct kr_err *err)
{
    int64_t n;
    KR_TRY(get_int(root, path, KEYS("num_nextn_predict_layers"), false, 0, &n, err));
    if (n < 0 || n > 64) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"num_nextn_predict_layers\" = %lld is outside 0..64", path,
                          (long long)n);
    }
    cfg->n_mtp_layers = (int32_t)n;
    const struct kr_json *pat = kr_json_get(root, "mtp_hybrid_override_pattern");
    const struct kr_json *list = kr_json_get(root, "mtp_layers_block_type");
    if (pat && pat->type == KR_JSON_NULL) {
        pat = NULL;
    }
    if (list && list->type == KR_JSON_NULL) {
        list = NULL;
    }
    if (pat && pat->type != KR_JSON_STRING) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"mtp_hybrid_override_pattern\" must be a string", path);
    }
    struct kr_model_config tmp = {0}, other = {0};
    const char *key = list ? "mtp_layers_block_type" : "mtp_hybrid_override_pattern";
    if (list) {
        KR_TRY(parse_pattern_list(&tmp, list, path, "mtp_layers_block_type", err));
        if (pat) {
            KR_TRY(parse_pattern_string(&other, pat->str, path, "mtp_hybrid_override_pattern", err));
            if (strcmp(tmp.pattern, other.pattern) != 0) {
                return kr_err_set(err, KR_ERR_FORMAT,
                                  "%s: \"mtp_hybrid_override_pattern\" (%s) and \"mtp_layers_block_type\" (%s) disagree",
                                  path, other.pattern, tmp.pattern);
            }
        }
    } else if (pat) {
        KR_TRY(parse_pattern_string(&tmp, pat->str, path, "mtp_hybrid_override_pattern", err));
    } else {
        return KR_OK;
    }
    if (tmp.n_layer > KR_MAX_MTP_PATTERN) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED, "%s: key \"%s\" has %d blocks (at most %d)", path, key, tmp.n_layer,
                          KR_MAX_MTP_PATTERN);
    }
    memcpy(cfg->mtp_pattern, tmp.pattern, (size_t)tmp.n_layer + 1);
    return KR_OK;
}

static enum kr_status parse_nemotron_h(struct kr_model_config *cfg, const struct kr_json *root, const char *path,
                                       struct kr_err *err)
{
    KR_TRY(parse_layers(cfg, root, path, err));
    KR_TRY(parse_dims(cfg, root, path, KEYS("layer_norm_epsilon", "rms_norm_eps", "norm_eps"), 1e-5, err));
    KR_TRY(get_bool(root, path, KEYS("tie_word_embeddings"), false, &cfg->tie_embeddings, err));
    KR_TRY(get_int(root, path, KEYS("max_position_embeddings"), false, 4096, &cfg->max_pos, err));
    KR_TRY(need_pos(cfg->max_pos, path, "max_position_embeddings", err));
    KR_TRY(parse_token_ids(cfg, root, path, err));

    if (kr_model_config_count(cfg, KR_LAYER_MAMBA)) {
        KR_TRY(get_int(root, path, KEYS("mamba_num_heads"), true, 0, &cfg->m_heads, err));
        KR_TRY(need_dim(cfg->m_heads, false, path, "mamba_num_heads", err));
        KR_TRY(get_int(root, path, KEYS("mamba_head_dim"), true, 0, &cfg->m_head_dim, err));
        KR_TRY(need_dim(cfg->m_head_dim, false, path, "mamba_head_dim", err));
        KR_TRY(get_int(root, path, KEYS("n_groups", "mamba_n_groups"), false, 8, &cfg->m_groups, err));
        KR_TRY(need_dim(cfg->m_groups, false, path, "n_groups", err));
        KR_TRY(get_int(root, path, KEYS("ssm_state_size", "mamba_d_state"), false, 128, &cfg->m_state, err));
        KR_TRY(need_dim(cfg->m_state, false, path, "ssm_state_size", err));
        KR_TRY(get_int(root, path, KEYS("conv_kernel", "mamba_d_conv"), false, 4, &cfg->m_conv, err));
        KR_TRY(need_pos(cfg->m_conv, path, "conv_kernel", err));
        KR_TRY(get_int(root, path, KEYS("chunk_size", "mamba_chunk_size"), false, 128, &cfg->m_chunk, err));
        KR_TRY(need_pos(cfg->m_chunk, path, "chunk_size", err));
        KR_TRY(get_bool(root, path, KEYS("use_conv_bias", "mamba_conv_bias"), true, &cfg->m_conv_bias, err));
        KR_TRY(get_bool(root, path, KEYS("use_bias"), false, &cfg->m_proj_bias, err));
        if (cfg->m_heads % cfg->m_groups) {
            return kr_err_set(err, KR_ERR_FORMAT, "%s: mamba_num_heads (%lld) must be a multiple of n_groups (%lld)",
                              path, (long long)cfg->m_heads, (long long)cfg->m_groups);
        }
        if (cfg->m_conv > 64) {
            return kr_err_set(err, KR_ERR_UNSUPPORTED, "%s: conv_kernel %lld is larger than 64", path,
                              (long long)cfg->m_conv);
        }
        cfg->m_d_inner = cfg->m_heads * cfg->m_head_dim;
        cfg->m_conv_dim = cfg->m_d_inner + 2 * cfg->m_groups * cfg->m_state;
        cfg->m_in_proj = 2 * cfg->m_d_inner + 2 * cfg->m_groups * cfg->m_state + cfg->m_heads;
        cfg->m_dt_min = 0.0f;
        cfg->m_dt_max = INFINITY;
        const char *which = "time_step_limit";
        const struct kr_json *lim = lookup(root, KEYS("time_step_limit", "mamba_dt_limit"), &which);
        if (lim) {
            double lo, hi;
            if (lim->type != KR_JSON_ARRAY || lim->n != 2 || !kr_json_as_double(&lim->items[0], &lo) ||
                !kr_json_as_double(&lim->items[1], &hi)) {
                return kr_err_set(err, KR_ERR_FORMAT,
                                  "%s: key \"%s\" must be a list of two numbers [min, max] (Infinity allowed)", path,
                                  which);
            }
            if (isnan(lo) || isnan(hi) || lo < 0 || hi < lo) {
                return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"%s\" = [%g, %g] is not a valid range", path, which,
                                  lo, hi);
            }
            cfg->m_dt_min = (float)lo;
            cfg->m_dt_max = (float)hi;
        }
    }
    if (kr_model_config_count(cfg, KR_LAYER_ATTN)) {
        KR_TRY(get_int(root, path, KEYS("num_attention_heads"), true, 0, &cfg->n_head, err));
        KR_TRY(need_dim(cfg->n_head, false, path, "num_attention_heads", err));
        KR_TRY(get_int(root, path, KEYS("num_key_value_heads"), false, cfg->n_head, &cfg->n_kv_head, err));
        KR_TRY(need_dim(cfg->n_kv_head, false, path, "num_key_value_heads", err));
        KR_TRY(get_int(root, path, KEYS("head_dim", "attention_head_dim"), false, cfg->dim / cfg->n_head,
                    &cfg->head_dim, err));
        KR_TRY(need_dim(cfg->head_dim, false, path, "head_dim", err));
        KR_TRY(get_bool(root, path, KEYS("attention_bias"), false, &cfg->attn_bias, err));
        if (cfg->n_head % cfg->n_kv_head) {
            return kr_err_set(err, KR_ERR_FORMAT,
                              "%s: num_attention_heads (%lld) must be a multiple of num_key_value_heads (%lld)", path,
                              (long long)cfg->n_head, (long long)cfg->n_kv_head);
        }
    }
    KR_TRY(parse_act(root, path, &cfg->act, err));
    KR_TRY(get_bool(root, path, KEYS("mlp_bias"), false, &cfg->mlp_bias, err));
    if (kr_model_config_count(cfg, KR_LAYER_MLP)) {
        KR_TRY(get_int(root, path, KEYS("intermediate_size"), true, 0, &cfg->ffn, err));
        KR_TRY(need_dim(cfg->ffn, false, path, "intermediate_size", err));
    }
    if (kr_model_config_count(cfg, KR_LAYER_MOE)) {
        KR_TRY(parse_moe(cfg, root, path, err));
    }
    if (cfg->dsa_seen || kr_model_config_count(cfg, KR_LAYER_DSA) || kr_model_config_count(cfg, KR_LAYER_MLA)) {
        KR_TRY(parse_mla(cfg, root, path, err));
    }
    return parse_mtp(cfg, root, path, err);
}


/* ---- deepseek_v32 -------------------------------------------------------------------------- */

/* HF layer i becomes D then '-' (dense) or 'E' (MoE): mlp_layer_types when given, otherwise
 * MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0. */
static enum kr_status parse_ds_layers(struct kr_model_config *cfg, const struct kr_json *root, const char *path,
                                      struct kr_err *err)
{
    int64_t nl, k_dense, freq;
    KR_TRY(get_int(root, path, KEYS("num_hidden_layers"), true, 0, &nl, err));
    KR_TRY(need_pos(nl, path, "num_hidden_layers", err));
    if (2 * nl > KR_MAX_LAYERS) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: num_hidden_layers %lld is larger than %d", path, (long long)nl,
                          KR_MAX_LAYERS / 2);
    }
    KR_TRY(get_int(root, path, KEYS("first_k_dense_replace"), false, 0, &k_dense, err));
    KR_TRY(get_int(root, path, KEYS("moe_layer_freq"), false, 1, &freq, err));
    KR_TRY(need_pos(freq, path, "moe_layer_freq", err));
    const struct kr_json *types = kr_json_get(root, "mlp_layer_types");
    if (types && types->type != KR_JSON_NULL && (types->type != KR_JSON_ARRAY || (int64_t)types->n != nl)) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"mlp_layer_types\" must be a list of %lld entries", path,
                          (long long)nl);
    }
    for (int64_t i = 0; i < nl; i++) {
        bool moe = i >= k_dense && i % freq == 0;
        if (types && types->type == KR_JSON_ARRAY) {
            const struct kr_json *t = &types->items[i];
            if (t->type != KR_JSON_STRING || (strcmp(t->str, "dense") && strcmp(t->str, "sparse"))) {
                return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"mlp_layer_types\"[%lld] must be \"dense\" or \"sparse\"",
                                  path, (long long)i);
            }
            moe = !strcmp(t->str, "sparse");
        }
        cfg->pattern[2 * i] = KR_LAYER_DSA;
        cfg->pattern[2 * i + 1] = moe ? KR_LAYER_MOE : KR_LAYER_MLP;
    }
    cfg->n_layer = (int32_t)(2 * nl);
    cfg->pattern[cfg->n_layer] = 0;
    /* the first multi-token-prediction layer (HF layer nl), when there is one: its attention half, and
     * its MLP half by the rule above (mlp_layer_types covers the main layers only) */
    int64_t mtp;
    KR_TRY(get_int(root, path, KEYS("num_nextn_predict_layers"), false, 0, &mtp, err));
    if (mtp > 0) {
        cfg->mtp_pattern[0] = KR_LAYER_DSA;
        cfg->mtp_pattern[1] = nl >= k_dense && nl % freq == 0 ? KR_LAYER_MOE : KR_LAYER_MLP;
        cfg->mtp_pattern[2] = 0;
    }
    return KR_OK;
}

static enum kr_status parse_deepseek_v32(struct kr_model_config *cfg, const struct kr_json *root, const char *path,
                                         struct kr_err *err)
{
    KR_TRY(parse_ds_layers(cfg, root, path, err));
    KR_TRY(parse_dims(cfg, root, path, KEYS("rms_norm_eps"), 1e-6, err));
    KR_TRY(get_bool(root, path, KEYS("tie_word_embeddings"), false, &cfg->tie_embeddings, err));
    KR_TRY(get_int(root, path, KEYS("max_position_embeddings"), false, 163840, &cfg->max_pos, err));
    KR_TRY(need_pos(cfg->max_pos, path, "max_position_embeddings", err));
    KR_TRY(parse_token_ids(cfg, root, path, err));
    bool attn_bias = false;
    KR_TRY(get_bool(root, path, KEYS("attention_bias"), false, &attn_bias, err));
    if (attn_bias) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED, "%s: attention_bias true is not supported for MLA", path);
    }
    KR_TRY(parse_act(root, path, &cfg->act, err));
    if (kr_model_config_count(cfg, KR_LAYER_MLP)) {
        KR_TRY(get_int(root, path, KEYS("intermediate_size"), true, 0, &cfg->ffn, err));
        KR_TRY(need_dim(cfg->ffn, false, path, "intermediate_size", err));
    }
    if (kr_model_config_count(cfg, KR_LAYER_MOE)) {
        KR_TRY(parse_moe(cfg, root, path, err));
    }
    int64_t mtp;
    KR_TRY(get_int(root, path, KEYS("num_nextn_predict_layers"), false, 0, &mtp, err));
    if (mtp < 0 || mtp > 64) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: key \"num_nextn_predict_layers\" = %lld is outside 0..64", path,
                          (long long)mtp);
    }
    cfg->n_mtp_layers = (int32_t)mtp;
    KR_TRY(parse_mla(cfg, root, path, err));
    if (cfg->idx_topk_freq > 1) { /* the layer numbering of shared selections is the hybrid stack's */
        return kr_err_set(err, KR_ERR_UNSUPPORTED,
                          "%s: index_topk_freq %lld (D layers sharing top-k selections) is supported in the hybrid "
                          "layout (model_type nemotron_h with D layers), not in deepseek_v32",
                          path, (long long)cfg->idx_topk_freq);
    }
    return KR_OK;
}

enum kr_status kr_model_config_from_json(struct kr_model_config *cfg, const struct kr_json *root,
                                         const char *path, struct kr_err *err)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->tp_size = 1;
    if (!root || root->type != KR_JSON_OBJECT) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: expected a JSON object at the top level", path);
    }
    const struct kr_json *mt = kr_json_get(root, "model_type");
    if (!mt || mt->type != KR_JSON_STRING) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: missing \"model_type\" (string)", path);
    }
    snprintf(cfg->model_type, sizeof cfg->model_type, "%s", mt->str);
    if (!strcmp(mt->str, "nemotron_h")) {
        KR_TRY(parse_nemotron_h(cfg, root, path, err));
        return parse_quant(cfg, root, path, err);
    }
    if (!strcmp(mt->str, "deepseek_v32")) {
        KR_TRY(parse_deepseek_v32(cfg, root, path, err));
        return parse_quant(cfg, root, path, err);
    }
    return kr_err_set(err, KR_ERR_UNSUPPORTED,
                      "%s: unsupported model_type \"%s\" (supported: nemotron_h, deepseek_v32)", path,
                      mt->str);
}

/* Checks that `size` divides `what` = v (when the model has layers that split it). */
static enum kr_status shard_check(int64_t v, int32_t size, bool used, const char *what, struct kr_err *err)
{
    if (used && v % size != 0) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED, "tensor-parallel size %d does not divide %s (%lld)", size, what,
                          (long long)v);
    }
    return KR_OK;
}

enum kr_status kr_model_config_shard(struct kr_model_config *cfg, int32_t rank, int32_t size, struct kr_err *err)
{
    if (size < 1 || rank < 0 || rank >= size) {
        return kr_err_set(err, KR_ERR_INVAL, "tensor parallelism: rank %d of %d is not a valid place", rank, size);
    }
    if (cfg->tp_size > 1) {
        return kr_err_set(err, KR_ERR_INVAL, "tensor parallelism: the config is already a shard");
    }
    cfg->tp_rank = rank;
    cfg->tp_size = size;
    cfg->kv_head0 = 0;
    if (size == 1) {
        return KR_OK;
    }
    const bool mamba = kr_model_config_count(cfg, KR_LAYER_MAMBA) > 0, attn = kr_model_config_count(cfg, KR_LAYER_ATTN) > 0,
               mlp = kr_model_config_count(cfg, KR_LAYER_MLP) > 0, moe = kr_model_config_count(cfg, KR_LAYER_MOE) > 0,
               mla = kr_model_config_count(cfg, KR_LAYER_DSA) + kr_model_config_count(cfg, KR_LAYER_MLA) > 0;
    KR_TRY(shard_check(cfg->m_heads, size, mamba, "mamba_num_heads (Mamba layers are split by heads)", err));
    KR_TRY(shard_check(cfg->m_groups, size, mamba, "n_groups (Mamba layers are split by groups)", err));
    KR_TRY(shard_check(cfg->n_head, size, attn, "num_attention_heads", err));
    if (attn && cfg->n_kv_head % size != 0 && size % cfg->n_kv_head != 0) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED,
                          "tensor-parallel size %d neither divides num_key_value_heads (%lld) nor is a multiple of it",
                          size, (long long)cfg->n_kv_head);
    }
    KR_TRY(shard_check(cfg->mla_heads, size, mla, "num_attention_heads (MLA layers are split by heads)", err));
    KR_TRY(shard_check(cfg->ffn, size, mlp, "intermediate_size (MLP layers are split by columns)", err));
    KR_TRY(shard_check(cfg->moe_ffn, size, moe, "moe_intermediate_size (experts are split by columns)", err));
    KR_TRY(shard_check(cfg->shared_ffn, size, moe, "the shared expert's intermediate size", err));
    KR_TRY(shard_check(cfg->vocab, size, true, "vocab_size (the embedding and the LM head are split by vocabulary rows)", err));
    cfg->m_heads /= size;
    cfg->m_groups /= size;
    cfg->m_d_inner = cfg->m_heads * cfg->m_head_dim;
    cfg->m_conv_dim = cfg->m_d_inner + 2 * cfg->m_groups * cfg->m_state;
    cfg->m_in_proj = 2 * cfg->m_d_inner + 2 * cfg->m_groups * cfg->m_state + cfg->m_heads;
    if (cfg->n_kv_head % size == 0) {
        cfg->n_kv_head /= size;
        cfg->kv_head0 = rank * cfg->n_kv_head;
    } else if (attn) { /* size = k * n_kv: each KV head serves k ranks */
        cfg->kv_head0 = (int64_t)rank * cfg->n_kv_head / size;
        cfg->n_kv_head = 1;
    }
    cfg->n_head /= size;
    cfg->ffn /= size;
    cfg->moe_ffn /= size;
    cfg->shared_ffn /= size;
    cfg->mla_heads /= size;
    return KR_OK;
}

enum kr_status kr_model_config_load(struct kr_model_config *cfg, const char *dir, struct kr_err *err)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    struct kr_json *root = NULL;
    enum kr_status st = kr_json_parse_file(path, &root, err);
    if (st != KR_OK) {
        return st;
    }
    st = kr_model_config_from_json(cfg, root, path, err);
    kr_json_free(root);
    return st;
}
