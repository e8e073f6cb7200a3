/* Checkpoint loader: maps the tensors of an HF `nemotron_h` checkpoint (Hub layout with the
 * `backbone.` prefix or transformers-5 layout with `model.`; per-expert or fused 3-D expert
 * tensors) onto the internal model description, checking every name, shape and dtype. */
#include "model.h"

#include "alloc.h"
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

struct loader {
    struct kr_model *m;
    const char *prefix; /* "backbone." or "model." */
    struct kr_err *err;
};

/* ---- helpers ------------------------------------------------------------------------------ */

static enum kr_status own_buf(struct kr_model *m, struct kr_buf *b)
{
    if (!b->ptr) {
        return KR_OK;
    }
    if (m->n_owned == m->cap_owned) {
        size_t cap = m->cap_owned ? 2 * m->cap_owned : 64;
        struct kr_buf *nb = kr_realloc(m->owned, cap * sizeof *nb);
        if (!nb) {
            kr_backend_buf_free(m->be, b);
            return KR_ERR_NOMEM;
        }
        m->owned = nb;
        m->cap_owned = cap;
    }
    m->owned[m->n_owned++] = *b;
    return KR_OK;
}

static void fmt_shape(char *buf, size_t n, int n_dim, const int64_t *shape)
{
    size_t o = 0;
    o += (size_t)snprintf(buf + o, n - o, "[");
    for (int i = 0; i < n_dim && o < n; i++) {
        o += (size_t)snprintf(buf + o, n - o, "%s%lld", i ? ", " : "", (long long)shape[i]);
    }
    if (o < n) {
        snprintf(buf + o, n - o, "]");
    }
}

/* Finds tensor `name` (already prefixed as needed). NULL when absent (no error set). */
static struct kr_st_tensor *find(struct loader *ld, const char *name)
{
    return kr_st_find(ld->m->ar, name);
}

/* Checks dtype (a float type the CPU reads) and exact shape, and marks the tensor used. */
static enum kr_status check(struct loader *ld, struct kr_st_tensor *t, int n_dim, const int64_t *shape)
{
    bool ok = t->n_dim == n_dim;
    for (int i = 0; ok && i < n_dim; i++) {
        ok = t->shape[i] == shape[i];
    }
    if (!ok) {
        char want[128], got[128];
        fmt_shape(want, sizeof want, n_dim, shape);
        fmt_shape(got, sizeof got, t->n_dim, t->shape);
        return kr_err_set(ld->err, KR_ERR_FORMAT, "%s: tensor \"%s\" has shape %s, expected %s", t->file->path,
                          t->name, got, want);
    }
    if (t->dtype != KR_DTYPE_F32 && t->dtype != KR_DTYPE_F16 && t->dtype != KR_DTYPE_BF16) {
        return kr_err_set(ld->err, KR_ERR_UNSUPPORTED,
                          "%s: tensor \"%s\" has dtype %s, expected BF16, F16 or F32", t->file->path, t->name,
                          kr_dtype_name(t->dtype));
    }
    t->used = true;
    ld->m->n_params += (uint64_t)t->n_elem;
    return KR_OK;
}

static enum kr_status missing(struct loader *ld, const char *name, const char *what)
{
    return kr_err_set(ld->err, KR_ERR_FORMAT, "%s: missing tensor \"%s\" (%s)", ld->m->dir, name, what);
}

/* Loads a 2-D matrix [rows, cols] (or a 1-D vector when rows == 0) under `name`.
 * `what` describes the tensor for the missing-tensor message. With `optional`, absence leaves
 * *out zeroed and is not an error. */
static enum kr_status load_mat(struct loader *ld, const char *name, int64_t rows, int64_t cols, bool optional,
                               const char *what, struct kr_tensor *out)
{
    memset(out, 0, sizeof *out);
    struct kr_st_tensor *t = find(ld, name);
    if (!t) {
        return optional ? KR_OK : missing(ld, name, what);
    }
    enum kr_status st =
        rows ? check(ld, t, 2, (const int64_t[]){rows, cols}) : check(ld, t, 1, (const int64_t[]){cols});
    if (st != KR_OK) {
        return st;
    }
    struct kr_tensor host = {.data = t->data, .dtype = t->dtype, .rows = rows ? rows : 1, .cols = cols};
    struct kr_buf owned;
    if ((st = kr_backend_upload(ld->m->be, &host, false, out, &owned)) != KR_OK) {
        return st;
    }
    return own_buf(ld->m, &owned);
}

/* Loads a vector of n elements as fp32; *out NULL when optional and absent. Accepts a [n, 1, K]
 * style shape through `shape`/`n_dim` when given (conv weights), else [n]. */
static enum kr_status load_vec_shaped(struct loader *ld, const char *name, int n_dim, const int64_t *shape,
                                      bool optional, const char *what, const float **out)
{
    *out = NULL;
    struct kr_st_tensor *t = find(ld, name);
    if (!t) {
        return optional ? KR_OK : missing(ld, name, what);
    }
    enum kr_status st = check(ld, t, n_dim, shape);
    if (st != KR_OK) {
        return st;
    }
    struct kr_tensor host = {.data = t->data, .dtype = t->dtype, .rows = 1, .cols = t->n_elem}, dev;
    struct kr_buf owned;
    if ((st = kr_backend_upload(ld->m->be, &host, true, &dev, &owned)) != KR_OK) {
        return st;
    }
    *out = dev.data;
    return own_buf(ld->m, &owned);
}

static enum kr_status load_vec(struct loader *ld, const char *name, int64_t n, bool optional, const char *what,
                               const float **out)
{
    return load_vec_shaped(ld, name, 1, (const int64_t[]){n}, optional, what, out);
}

#define NAME(buf, ...) snprintf(buf, sizeof buf, __VA_ARGS__)
#define TRY(expr)                                                                                  \
    do {                                                                                           \
        enum kr_status st_ = (expr);                                                               \
        if (st_ != KR_OK) {                                                                        \
            return st_;                                                                            \
        }                                                                                          \
    } while (0)

/* ---- layers ----------------------------------------------------------------------------------- */

static enum kr_status load_mamba(struct loader *ld, int32_t i, struct kr_mamba_w *w)
{
    const struct kr_model_config *c = &ld->m->cfg;
    char n[512];
    const char *p = ld->prefix;
    NAME(n, "%slayers.%d.mixer.in_proj.weight", p, i);
    TRY(load_mat(ld, n, c->m_in_proj, c->dim, false, "Mamba in_proj [z,x,B,C,dt] x hidden", &w->in_proj));
    NAME(n, "%slayers.%d.mixer.in_proj.bias", p, i);
    TRY(load_vec(ld, n, c->m_in_proj, !c->m_proj_bias, "Mamba in_proj bias (use_bias)", &w->in_proj_b));
    NAME(n, "%slayers.%d.mixer.conv1d.weight", p, i);
    if (find(ld, n) && find(ld, n)->n_dim == 2) {
        TRY(load_vec_shaped(ld, n, 2, (const int64_t[]){c->m_conv_dim, c->m_conv}, false, "", &w->conv_w));
    } else {
        TRY(load_vec_shaped(ld, n, 3, (const int64_t[]){c->m_conv_dim, 1, c->m_conv}, false,
                            "depthwise conv weight [conv_dim, 1, conv_kernel]", &w->conv_w));
    }
    NAME(n, "%slayers.%d.mixer.conv1d.bias", p, i);
    TRY(load_vec(ld, n, c->m_conv_dim, !c->m_conv_bias, "conv bias (use_conv_bias)", &w->conv_b));
    NAME(n, "%slayers.%d.mixer.dt_bias", p, i);
    TRY(load_vec(ld, n, c->m_heads, false, "dt_bias [mamba_num_heads]", &w->dt_bias));
    NAME(n, "%slayers.%d.mixer.A_log", p, i);
    TRY(load_vec(ld, n, c->m_heads, false, "A_log [mamba_num_heads]", &w->A_log));
    NAME(n, "%slayers.%d.mixer.D", p, i);
    TRY(load_vec(ld, n, c->m_heads, false, "D [mamba_num_heads]", &w->D));
    NAME(n, "%slayers.%d.mixer.norm.weight", p, i);
    TRY(load_vec(ld, n, c->m_d_inner, false, "gated RMSNorm weight [d_inner]", &w->norm_w));
    NAME(n, "%slayers.%d.mixer.out_proj.weight", p, i);
    TRY(load_mat(ld, n, c->dim, c->m_d_inner, false, "Mamba out_proj [hidden, d_inner]", &w->out_proj));
    NAME(n, "%slayers.%d.mixer.out_proj.bias", p, i);
    TRY(load_vec(ld, n, c->dim, !c->m_proj_bias, "Mamba out_proj bias (use_bias)", &w->out_proj_b));
    return KR_OK;
}

static enum kr_status load_attn(struct loader *ld, int32_t i, struct kr_attn_w *w)
{
    const struct kr_model_config *c = &ld->m->cfg;
    const int64_t q = c->n_head * c->head_dim, kv = c->n_kv_head * c->head_dim;
    char n[512];
    const char *p = ld->prefix;
    NAME(n, "%slayers.%d.mixer.q_proj.weight", p, i);
    TRY(load_mat(ld, n, q, c->dim, false, "attention q_proj", &w->q));
    NAME(n, "%slayers.%d.mixer.k_proj.weight", p, i);
    TRY(load_mat(ld, n, kv, c->dim, false, "attention k_proj", &w->k));
    NAME(n, "%slayers.%d.mixer.v_proj.weight", p, i);
    TRY(load_mat(ld, n, kv, c->dim, false, "attention v_proj", &w->v));
    NAME(n, "%slayers.%d.mixer.o_proj.weight", p, i);
    TRY(load_mat(ld, n, c->dim, q, false, "attention o_proj", &w->o));
    bool opt = !c->attn_bias;
    NAME(n, "%slayers.%d.mixer.q_proj.bias", p, i);
    TRY(load_vec(ld, n, q, opt, "q_proj bias (attention_bias)", &w->q_b));
    NAME(n, "%slayers.%d.mixer.k_proj.bias", p, i);
    TRY(load_vec(ld, n, kv, opt, "k_proj bias (attention_bias)", &w->k_b));
    NAME(n, "%slayers.%d.mixer.v_proj.bias", p, i);
    TRY(load_vec(ld, n, kv, opt, "v_proj bias (attention_bias)", &w->v_b));
    NAME(n, "%slayers.%d.mixer.o_proj.bias", p, i);
    TRY(load_vec(ld, n, c->dim, opt, "o_proj bias (attention_bias)", &w->o_b));
    return KR_OK;
}

/* An MLP under `base` ("...mixer." or "...mixer.shared_experts."): up/down, gate_proj when
 * present (gated), biases per mlp_bias. */
static enum kr_status load_mlp(struct loader *ld, const char *base, int64_t d_in, int64_t ffn, int64_t d_out,
                               struct kr_mlp_w *w)
{
    const struct kr_model_config *c = &ld->m->cfg;
    char n[512];
    NAME(n, "%sup_proj.weight", base);
    TRY(load_mat(ld, n, ffn, d_in, false, "MLP up_proj", &w->up));
    NAME(n, "%sgate_proj.weight", base);
    TRY(load_mat(ld, n, ffn, d_in, true, "", &w->gate));
    NAME(n, "%sdown_proj.weight", base);
    TRY(load_mat(ld, n, d_out, ffn, false, "MLP down_proj", &w->down));
    NAME(n, "%sup_proj.bias", base);
    TRY(load_vec(ld, n, ffn, !c->mlp_bias, "up_proj bias (mlp_bias)", &w->up_b));
    if (w->gate.data) {
        NAME(n, "%sgate_proj.bias", base);
        TRY(load_vec(ld, n, ffn, !c->mlp_bias, "gate_proj bias (mlp_bias)", &w->gate_b));
    }
    NAME(n, "%sdown_proj.bias", base);
    TRY(load_vec(ld, n, d_out, !c->mlp_bias, "down_proj bias (mlp_bias)", &w->down_b));
    return KR_OK;
}

/* Views expert e of a fused 3-D tensor [E, rows, cols] (rows offset `r0` within each expert). */
static struct kr_tensor expert_view(const struct kr_st_tensor *t, int64_t e, int64_t r0, int64_t rows)
{
    const size_t esz = kr_dtype_size(t->dtype);
    const int64_t per = t->shape[1] * t->shape[2];
    return (struct kr_tensor){
        .data = (const char *)t->data + (size_t)(e * per + r0 * t->shape[2]) * esz,
        .dtype = t->dtype,
        .rows = rows,
        .cols = t->shape[2],
    };
}

static enum kr_status upload_view(struct loader *ld, const struct kr_tensor *host, struct kr_tensor *out)
{
    struct kr_buf owned;
    TRY(kr_backend_upload(ld->m->be, host, false, out, &owned));
    return own_buf(ld->m, &owned);
}

static enum kr_status load_fused_experts(struct loader *ld, const char *base, int64_t d_e, struct kr_moe_w *w)
{
    const struct kr_model_config *c = &ld->m->cfg;
    const int64_t E = c->n_expert, F = c->moe_ffn;
    char n[512];
    NAME(n, "%sexperts.gate_up_proj", base);
    struct kr_st_tensor *gu = find(ld, n);
    NAME(n, "%sexperts.up_proj", base);
    struct kr_st_tensor *up = find(ld, n);
    NAME(n, "%sexperts.down_proj", base);
    struct kr_st_tensor *down = find(ld, n);
    if (!down) {
        return missing(ld, n, "fused expert down projections [n_routed_experts, d, moe_intermediate_size]");
    }
    TRY(check(ld, down, 3, (const int64_t[]){E, d_e, F}));
    if (gu) {
        TRY(check(ld, gu, 3, (const int64_t[]){E, 2 * F, d_e}));
        if (up) {
            return kr_err_set(ld->err, KR_ERR_FORMAT, "%s: both \"%sexperts.gate_up_proj\" and \"%s\" are present",
                              up->file->path, base, up->name);
        }
    } else if (up) {
        TRY(check(ld, up, 3, (const int64_t[]){E, F, d_e}));
    } else {
        NAME(n, "%sexperts.up_proj", base);
        return missing(ld, n, "fused expert up projections [n_routed_experts, moe_intermediate_size, d]");
    }
    for (int64_t e = 0; e < E; e++) {
        struct kr_tensor v;
        if (gu) { /* rows [gate (F) | up (F)] per expert */
            v = expert_view(gu, e, 0, F);
            TRY(upload_view(ld, &v, &w->gate[e]));
            v = expert_view(gu, e, F, F);
        } else {
            v = expert_view(up, e, 0, F);
        }
        TRY(upload_view(ld, &v, &w->up[e]));
        v = expert_view(down, e, 0, d_e);
        TRY(upload_view(ld, &v, &w->down[e]));
    }
    return KR_OK;
}

static enum kr_status load_moe(struct loader *ld, int32_t i, struct kr_moe_w *w)
{
    struct kr_model *m = ld->m;
    const struct kr_model_config *c = &m->cfg;
    const int64_t E = c->n_expert, F = c->moe_ffn;
    char base[256], n[512];
    NAME(base, "%slayers.%d.mixer.", ld->prefix, i);
    NAME(n, "%sgate.weight", base);
    TRY(load_mat(ld, n, E, c->dim, false, "MoE router [n_routed_experts, hidden]", &w->router));
    NAME(n, "%sgate.e_score_correction_bias", base);
    TRY(load_vec(ld, n, E, true, "", &w->router_bias));

    int64_t d_e = c->dim;
    if (c->moe_latent) {
        w->has_latent = true;
        d_e = c->moe_latent;
        NAME(n, "%sfc1_latent_proj.weight", base);
        TRY(load_mat(ld, n, c->moe_latent, c->dim, false, "MoE latent down projection", &w->fc1_latent));
        NAME(n, "%sfc2_latent_proj.weight", base);
        TRY(load_mat(ld, n, c->dim, c->moe_latent, false, "MoE latent up projection", &w->fc2_latent));
    }
    w->up = kr_calloc((size_t)E, sizeof *w->up);
    w->down = kr_calloc((size_t)E, sizeof *w->down);
    w->gate = kr_calloc((size_t)E, sizeof *w->gate);
    if (!w->up || !w->down || !w->gate) {
        return KR_ERR_NOMEM;
    }
    NAME(n, "%sexperts.0.up_proj.weight", base);
    if (find(ld, n)) { /* per-expert tensors (Hub layout) */
        NAME(n, "%sexperts.0.gate_proj.weight", base);
        const bool gated = find(ld, n) != NULL;
        for (int64_t e = 0; e < E; e++) {
            NAME(n, "%sexperts.%lld.up_proj.weight", base, (long long)e);
            TRY(load_mat(ld, n, F, d_e, false, "expert up_proj [moe_intermediate_size, d]", &w->up[e]));
            NAME(n, "%sexperts.%lld.down_proj.weight", base, (long long)e);
            TRY(load_mat(ld, n, d_e, F, false, "expert down_proj [d, moe_intermediate_size]", &w->down[e]));
            NAME(n, "%sexperts.%lld.gate_proj.weight", base, (long long)e);
            TRY(load_mat(ld, n, F, d_e, !gated, "expert gate_proj (expert 0 has one)", &w->gate[e]));
        }
        if (!gated) {
            kr_free(w->gate);
            w->gate = NULL;
        }
    } else {
        NAME(n, "%sexperts.gate_up_proj", base);
        const bool gated = find(ld, n) != NULL;
        TRY(load_fused_experts(ld, base, d_e, w));
        if (!gated) {
            kr_free(w->gate);
            w->gate = NULL;
        }
    }
    if (c->shared_ffn) {
        w->has_shared = true;
        NAME(n, "%sshared_experts.", base);
        TRY(load_mlp(ld, n, c->dim, c->shared_ffn, c->dim, &w->shared));
    }
    return KR_OK;
}

static enum kr_status load_layers(struct loader *ld)
{
    struct kr_model *m = ld->m;
    const struct kr_model_config *c = &m->cfg;
    char n[512];
    for (int32_t i = 0; i < c->n_layer; i++) {
        struct kr_layer *L = &m->layers[i];
        L->type = (enum kr_layer_type)c->pattern[i];
        NAME(n, "%slayers.%d.norm.weight", ld->prefix, i);
        TRY(load_vec(ld, n, c->dim, false, "block RMSNorm weight [hidden]", &L->norm));
        switch (L->type) {
        case KR_LAYER_MAMBA:
            L->cache_idx = m->n_mamba++;
            TRY(load_mamba(ld, i, &L->mamba));
            break;
        case KR_LAYER_ATTN:
            L->cache_idx = m->n_attn++;
            TRY(load_attn(ld, i, &L->attn));
            break;
        case KR_LAYER_MLP: {
            char base[256];
            NAME(base, "%slayers.%d.mixer.", ld->prefix, i);
            TRY(load_mlp(ld, base, c->dim, c->ffn, c->dim, &L->mlp));
            break;
        }
        case KR_LAYER_MOE:
            TRY(load_moe(ld, i, &L->moe));
            break;
        default:
            return kr_err_set(ld->err, KR_ERR_UNSUPPORTED, "%s: layer %d: unsupported layer type '%c'", m->dir, i,
                              (char)L->type);
        }
    }
    return KR_OK;
}

/* Every tensor of the checkpoint must have been consumed; a few known extras are skipped. */
static enum kr_status check_unused(struct loader *ld)
{
    const struct kr_st_archive *ar = ld->m->ar;
    for (size_t i = 0; i < ar->n_tensors; i++) {
        const struct kr_st_tensor *t = &ar->tensors[i];
        if (t->used) {
            continue;
        }
        size_t len = strlen(t->name);
        static const char inv[] = "rotary_emb.inv_freq";
        if (len >= sizeof inv - 1 && !strcmp(t->name + len - (sizeof inv - 1), inv)) {
            continue; /* recomputed buffers some exporters save */
        }
        if (!strncmp(t->name, "mtp.", 4) || strstr(t->name, ".mtp.")) {
            KR_LOG_INFO("skipping multi-token-prediction tensor %s", t->name);
            continue;
        }
        return kr_err_set(ld->err, KR_ERR_FORMAT,
                          "%s: unexpected tensor \"%s\" (not part of a %s model with layer pattern \"%s\")",
                          t->file->path, t->name, ld->m->cfg.model_type, ld->m->cfg.pattern);
    }
    return KR_OK;
}

static enum kr_status load_all(struct loader *ld)
{
    struct kr_model *m = ld->m;
    const struct kr_model_config *c = &m->cfg;
    char n[512];
    static const char *const prefixes[] = {"backbone.", "model."};
    static const char *const embeds[] = {"embeddings.weight", "embedding.weight", "embed_tokens.weight"};
    struct kr_st_tensor *emb = NULL;
    for (int p = 0; p < 2 && !emb; p++) {
        for (int e = 0; e < 3 && !emb; e++) {
            NAME(n, "%s%s", prefixes[p], embeds[e]);
            if ((emb = find(ld, n))) {
                ld->prefix = prefixes[p];
            }
        }
    }
    if (!emb) {
        return kr_err_set(ld->err, KR_ERR_FORMAT,
                          "%s: missing the token embedding: expected \"backbone.embeddings.weight\" (or "
                          "\"model.embeddings.weight\", \"backbone.embedding.weight\")",
                          m->dir);
    }
    TRY(load_mat(ld, emb->name, c->vocab, c->dim, false, "token embedding [vocab, hidden]", &m->embed));
    NAME(n, "%snorm_f.weight", ld->prefix);
    TRY(load_vec(ld, n, c->dim, false, "final RMSNorm weight [hidden]", &m->final_norm));
    m->layers = kr_calloc((size_t)c->n_layer, sizeof *m->layers);
    if (!m->layers) {
        return KR_ERR_NOMEM;
    }
    TRY(load_layers(ld));
    if (c->tie_embeddings) {
        m->lm_head = m->embed;
        struct kr_st_tensor *lm = find(ld, "lm_head.weight");
        if (lm) { /* some exports keep the tied copy; it must at least have the right shape */
            TRY(check(ld, lm, 2, (const int64_t[]){c->vocab, c->dim}));
        }
    } else {
        TRY(load_mat(ld, "lm_head.weight", c->vocab, c->dim, false,
                     "output projection [vocab, hidden] (tie_word_embeddings is false)", &m->lm_head));
    }
    return check_unused(ld);
}

enum kr_status kr_model_load(const char *dir, kr_backend_t be, struct kr_model **out, struct kr_err *err)
{
    struct kr_model *m = kr_calloc(1, sizeof *m);
    if (!m) {
        return KR_ERR_NOMEM;
    }
    enum kr_status st;
    m->be = be;
    m->dir = kr_strdup(dir);
    if (!m->dir) {
        st = KR_ERR_NOMEM;
        goto fail;
    }
    if ((st = kr_model_config_load(&m->cfg, dir, err)) != KR_OK) {
        goto fail;
    }
    if ((st = kr_st_open_dir(dir, &m->ar, err)) != KR_OK) {
        goto fail;
    }
    struct loader ld = {.m = m, .err = err};
    if ((st = load_all(&ld)) != KR_OK) {
        goto fail;
    }
    KR_LOG_INFO("loaded %s: model_type=%s layers=%d pattern=%s hidden=%lld vocab=%lld params=%llu backend=%s", dir,
                m->cfg.model_type, m->cfg.n_layer, m->cfg.pattern, (long long)m->cfg.dim, (long long)m->cfg.vocab,
                (unsigned long long)m->n_params, kr_backend_name(be));
    *out = m;
    return KR_OK;
fail:
    if (st == KR_ERR_NOMEM && err) {
        kr_err_set(err, st, "%s: out of memory while loading", dir);
    }
    kr_model_free(m);
    return st;
}

void kr_model_free(struct kr_model *m)
{
    if (!m) {
        return;
    }
    if (m->layers) {
        for (int32_t i = 0; i < m->cfg.n_layer; i++) {
            kr_free(m->layers[i].moe.gate);
            kr_free(m->layers[i].moe.up);
            kr_free(m->layers[i].moe.down);
        }
    }
    for (size_t i = 0; i < m->n_owned; i++) {
        kr_backend_buf_free(m->be, &m->owned[i]);
    }
    kr_backend_buf_free(m->be, &m->work);
    kr_free(m->owned);
    kr_free(m->layers);
    kr_st_close(m->ar);
    kr_free(m->dir);
    kr_free(m);
}
