/* Checkpoint loader: maps the tensors of an HF `nemotron_h` checkpoint (Hub layout with the
 * `backbone.` prefix or transformers-5 layout with `model.`; per-expert or fused 3-D expert
 * tensors; `D`/`+` mixers with deepseek_v32 attention names) or of an HF `deepseek_v32` checkpoint
 * (FP8 block-quantized weights dequantized here) onto the internal model description, checking
 * every name, shape and dtype. */
#include "model.h"

#include "alloc.h"
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

struct loader {
    struct kr_model *m;
    kr_progress_cb progress;
    void *progress_user;
    const char *prefix; /* "backbone." or "model." */
    bool deepseek;      /* HF deepseek_v32 naming (layer i -> native 2i, 2i+1) */
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

/* Checks exact shape and dtype (BF16, F16 or F32; F8_E4M3 too when `fp8_ok`) and marks the tensor
 * used. */
static enum kr_status check_any(struct loader *ld, struct kr_st_tensor *t, int n_dim, const int64_t *shape,
                                bool fp8_ok)
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
    if (t->dtype != KR_DTYPE_F32 && t->dtype != KR_DTYPE_F16 && t->dtype != KR_DTYPE_BF16 &&
        !(fp8_ok && t->dtype == KR_DTYPE_F8_E4M3)) {
        return kr_err_set(ld->err, KR_ERR_UNSUPPORTED, "%s: tensor \"%s\" has dtype %s, expected BF16, F16 or F32%s",
                          t->file->path, t->name, kr_dtype_name(t->dtype),
                          fp8_ok ? " (or F8_E4M3 with weight_scale_inv)" : "");
    }
    t->used = true;
    ld->m->n_params += (uint64_t)t->n_elem;
    return KR_OK;
}

static enum kr_status check(struct loader *ld, struct kr_st_tensor *t, int n_dim, const int64_t *shape)
{
    return check_any(ld, t, n_dim, shape, false);
}

/* Dequantizes an F8_E4M3 matrix [rows, cols] (a view at `data`) with its block scales
 * `<name>_scale_inv` ([ceil(rows/B0), ceil(cols/B1)] fp32, one per weight_block_size block) into a
 * new fp32 host buffer (caller frees). The scale tensor `sname` must exist. */
static enum kr_status dequant_fp8(struct loader *ld, const struct kr_st_tensor *t, const void *data, int64_t rows,
                                  int64_t cols, const char *sname, int64_t scale_row0, float **out)
{
    const struct kr_model_config *c = &ld->m->cfg;
    struct kr_st_tensor *sc = find(ld, sname);
    if (!sc) {
        return kr_err_set(ld->err, KR_ERR_FORMAT,
                          "%s: tensor \"%s\" is F8_E4M3 but its block scales \"%s\" are missing", t->file->path,
                          t->name, sname);
    }
    const int64_t B0 = c->fp8_block[0] > 0 ? c->fp8_block[0] : 128, B1 = c->fp8_block[1] > 0 ? c->fp8_block[1] : 128;
    const int64_t sr = (rows + B0 - 1) / B0, scol = (cols + B1 - 1) / B1;
    if (sc->dtype != KR_DTYPE_F32 && sc->dtype != KR_DTYPE_BF16) {
        return kr_err_set(ld->err, KR_ERR_UNSUPPORTED, "%s: scale tensor \"%s\" has dtype %s, expected F32",
                          sc->file->path, sc->name, kr_dtype_name(sc->dtype));
    }
    const int64_t want_rows = sc->n_dim == 3 ? sc->shape[1] : sc->n_dim == 2 ? sc->shape[0] : -1;
    const int64_t want_cols = sc->n_dim >= 2 ? sc->shape[sc->n_dim - 1] : -1;
    if (want_rows != sr || want_cols != scol) {
        char got[128];
        fmt_shape(got, sizeof got, sc->n_dim, sc->shape);
        return kr_err_set(ld->err, KR_ERR_FORMAT,
                          "%s: scale tensor \"%s\" has shape %s, expected [%lld, %lld] (%lldx%lld blocks of %s)",
                          sc->file->path, sc->name, got, (long long)sr, (long long)scol, (long long)B0, (long long)B1,
                          t->name);
    }
    sc->used = true;
    float *w = kr_malloc((size_t)(rows * cols) * sizeof(float));
    float *srow = kr_malloc((size_t)scol * sizeof(float));
    if (!w || !srow) {
        kr_free(w);
        kr_free(srow);
        return KR_ERR_NOMEM;
    }
    const unsigned char *q = data;
    const size_t ssz = kr_dtype_size(sc->dtype);
    for (int64_t r = 0; r < rows; r++) {
        if (r % B0 == 0) {
            kr_convert_to_f32(srow, (const char *)sc->data + (size_t)((scale_row0 + r / B0) * scol) * ssz, sc->dtype,
                              (size_t)scol);
        }
        for (int64_t j = 0; j < cols; j++) {
            w[r * cols + j] = kr_e4m3_to_f32(q[r * cols + j]) * srow[j / B1];
        }
    }
    kr_free(srow);
    *out = w;
    return KR_OK;
}

/* Uploads a transient fp32 host matrix (copied by the backend) and frees it. */
static enum kr_status upload_host_f32(struct loader *ld, float *host, int64_t rows, int64_t cols,
                                      struct kr_tensor *out)
{
    struct kr_tensor h = {.data = host, .dtype = KR_DTYPE_F32, .rows = rows, .cols = cols};
    struct kr_buf owned;
    enum kr_status st = kr_backend_upload(ld->m->be, &h, false, false, out, &owned);
    kr_free(host);
    if (st != KR_OK) {
        return st;
    }
    return own_buf(ld->m, &owned);
}

/* "x.weight" -> "x.weight_scale_inv" */
static void scale_name(char *out, size_t n, const char *wname)
{
    snprintf(out, n, "%s_scale_inv", wname);
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
    enum kr_status st = rows ? check_any(ld, t, 2, (const int64_t[]){rows, cols}, true)
                             : check(ld, t, 1, (const int64_t[]){cols});
    if (st != KR_OK) {
        return st;
    }
    if (t->dtype == KR_DTYPE_F8_E4M3) {
        char sname[600];
        float *w = NULL;
        scale_name(sname, sizeof sname, name);
        if ((st = dequant_fp8(ld, t, t->data, rows, cols, sname, 0, &w)) != KR_OK) {
            return st;
        }
        return upload_host_f32(ld, w, rows, cols, out);
    }
    struct kr_tensor host = {.data = t->data, .dtype = t->dtype, .rows = rows ? rows : 1, .cols = cols};
    struct kr_buf owned;
    if ((st = kr_backend_upload(ld->m->be, &host, false, true, out, &owned)) != KR_OK) {
        return st;
    }
    return own_buf(ld->m, &owned);
}

/* Loads a matrix as an fp32 copy in backend memory (small matrices read per head, e.g. kv_b),
 * straight from the file (FP8 dequantized on the host first). */
static enum kr_status load_mat_f32_t(struct loader *ld, const char *name, int64_t rows, int64_t cols,
                                     const char *what, struct kr_tensor *out)
{
    struct kr_st_tensor *t = find(ld, name);
    if (!t) {
        return missing(ld, name, what);
    }
    enum kr_status st = check_any(ld, t, 2, (const int64_t[]){rows, cols}, true);
    if (st != KR_OK) {
        return st;
    }
    float *deq = NULL;
    struct kr_tensor host = {.data = t->data, .dtype = t->dtype, .rows = rows, .cols = cols}, dev;
    if (t->dtype == KR_DTYPE_F8_E4M3) {
        char sname[600];
        scale_name(sname, sizeof sname, name);
        if ((st = dequant_fp8(ld, t, t->data, rows, cols, sname, 0, &deq)) != KR_OK) {
            return st;
        }
        host.data = deq;
        host.dtype = KR_DTYPE_F32;
    }
    struct kr_buf owned;
    st = kr_backend_upload(ld->m->be, &host, true, deq == NULL, &dev, &owned);
    kr_free(deq);
    if (st != KR_OK) {
        return st;
    }
    *out = dev;
    return own_buf(ld->m, &owned);
}

static enum kr_status load_mat_f32(struct loader *ld, const char *name, int64_t rows, int64_t cols, const char *what,
                                   const float **out)
{
    struct kr_tensor t;
    enum kr_status st = load_mat_f32_t(ld, name, rows, cols, what, &t);
    *out = st == KR_OK ? t.data : NULL;
    return st;
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
    if ((st = kr_backend_upload(ld->m->be, &host, true, true, &dev, &owned)) != KR_OK) {
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
/* ---- layers ----------------------------------------------------------------------------------- */

static enum kr_status load_mamba(struct loader *ld, const char *base, struct kr_mamba_w *w)
{
    const struct kr_model_config *c = &ld->m->cfg;
    char n[512];
    NAME(n, "%sin_proj.weight", base);
    KR_TRY(load_mat(ld, n, c->m_in_proj, c->dim, false, "Mamba in_proj [z,x,B,C,dt] x hidden", &w->in_proj));
    NAME(n, "%sin_proj.bias", base);
    KR_TRY(load_vec(ld, n, c->m_in_proj, !c->m_proj_bias, "Mamba in_proj bias (use_bias)", &w->in_proj_b));
    NAME(n, "%sconv1d.weight", base);
    if (find(ld, n) && find(ld, n)->n_dim == 2) {
        KR_TRY(load_vec_shaped(ld, n, 2, (const int64_t[]){c->m_conv_dim, c->m_conv}, false, "", &w->conv_w));
    } else {
        KR_TRY(load_vec_shaped(ld, n, 3, (const int64_t[]){c->m_conv_dim, 1, c->m_conv}, false,
                            "depthwise conv weight [conv_dim, 1, conv_kernel]", &w->conv_w));
    }
    NAME(n, "%sconv1d.bias", base);
    KR_TRY(load_vec(ld, n, c->m_conv_dim, !c->m_conv_bias, "conv bias (use_conv_bias)", &w->conv_b));
    NAME(n, "%sdt_bias", base);
    KR_TRY(load_vec(ld, n, c->m_heads, false, "dt_bias [mamba_num_heads]", &w->dt_bias));
    NAME(n, "%sA_log", base);
    KR_TRY(load_vec(ld, n, c->m_heads, false, "A_log [mamba_num_heads]", &w->A_log));
    NAME(n, "%sD", base);
    KR_TRY(load_vec(ld, n, c->m_heads, false, "D [mamba_num_heads]", &w->D));
    NAME(n, "%snorm.weight", base);
    KR_TRY(load_vec(ld, n, c->m_d_inner, false, "gated RMSNorm weight [d_inner]", &w->norm_w));
    NAME(n, "%sout_proj.weight", base);
    KR_TRY(load_mat(ld, n, c->dim, c->m_d_inner, false, "Mamba out_proj [hidden, d_inner]", &w->out_proj));
    NAME(n, "%sout_proj.bias", base);
    KR_TRY(load_vec(ld, n, c->dim, !c->m_proj_bias, "Mamba out_proj bias (use_bias)", &w->out_proj_b));
    return KR_OK;
}

static enum kr_status load_attn(struct loader *ld, const char *base, struct kr_attn_w *w)
{
    const struct kr_model_config *c = &ld->m->cfg;
    const int64_t q = c->n_head * c->head_dim, kv = c->n_kv_head * c->head_dim;
    char n[512];
    NAME(n, "%sq_proj.weight", base);
    KR_TRY(load_mat(ld, n, q, c->dim, false, "attention q_proj", &w->q));
    NAME(n, "%sk_proj.weight", base);
    KR_TRY(load_mat(ld, n, kv, c->dim, false, "attention k_proj", &w->k));
    NAME(n, "%sv_proj.weight", base);
    KR_TRY(load_mat(ld, n, kv, c->dim, false, "attention v_proj", &w->v));
    NAME(n, "%so_proj.weight", base);
    KR_TRY(load_mat(ld, n, c->dim, q, false, "attention o_proj", &w->o));
    bool opt = !c->attn_bias;
    NAME(n, "%sq_proj.bias", base);
    KR_TRY(load_vec(ld, n, q, opt, "q_proj bias (attention_bias)", &w->q_b));
    NAME(n, "%sk_proj.bias", base);
    KR_TRY(load_vec(ld, n, kv, opt, "k_proj bias (attention_bias)", &w->k_b));
    NAME(n, "%sv_proj.bias", base);
    KR_TRY(load_vec(ld, n, kv, opt, "v_proj bias (attention_bias)", &w->v_b));
    NAME(n, "%so_proj.bias", base);
    KR_TRY(load_vec(ld, n, c->dim, opt, "o_proj bias (attention_bias)", &w->o_b));
    return KR_OK;
}


static enum kr_status load_mla(struct loader *ld, const char *base, bool indexer, struct kr_mla_w *w)
{
    const struct kr_model_config *c = &ld->m->cfg;
    const int64_t H = c->mla_heads, Dn = c->qk_nope, Dr = c->qk_rope, Dv = c->v_head, Rq = c->q_lora,
                  Rkv = c->kv_lora;
    char n[512];
    if (Rq) {
        NAME(n, "%sq_a_proj.weight", base);
        KR_TRY(load_mat(ld, n, Rq, c->dim, false, "MLA q down projection [q_lora_rank, hidden]", &w->q_a));
        NAME(n, "%sq_a_layernorm.weight", base);
        KR_TRY(load_vec(ld, n, Rq, true, "", &w->q_a_norm));
        NAME(n, "%sq_b_proj.weight", base);
        KR_TRY(load_mat(ld, n, H * (Dn + Dr), Rq, false,
                     "MLA q up projection [num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank]",
                     &w->q_b));
    } else {
        NAME(n, "%sq_proj.weight", base);
        KR_TRY(load_mat(ld, n, H * (Dn + Dr), c->dim, false,
                     "MLA q projection [num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim), hidden]",
                     &w->q_a));
    }
    NAME(n, "%skv_a_proj_with_mqa.weight", base);
    KR_TRY(load_mat(ld, n, Rkv + Dr, c->dim, false, "MLA kv down projection [kv_lora_rank + qk_rope_head_dim, hidden]",
                 &w->kv_a));
    NAME(n, "%skv_a_layernorm.weight", base);
    KR_TRY(load_vec(ld, n, Rkv, true, "", &w->kv_a_norm));
    NAME(n, "%skv_b_proj.weight", base);
    KR_TRY(load_mat_f32(ld, n, H * (Dn + Dv), Rkv,
                     "MLA kv up projection [num_attention_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]",
                     &w->kv_b));
    NAME(n, "%so_proj.weight", base);
    KR_TRY(load_mat(ld, n, c->dim, H * Dv, false, "MLA output projection [hidden, num_attention_heads * v_head_dim]",
                 &w->o));
    w->has_indexer = indexer;
    if (!indexer) {
        return KR_OK;
    }
    const int64_t Hi = c->idx_heads, Di = c->idx_head_dim;
    NAME(n, "%sindexer.wq_b.weight", base);
    KR_TRY(load_mat(ld, n, Hi * Di, Rq ? Rq : c->dim, false,
                 "indexer q projection [index_n_heads * index_head_dim, q_lora_rank]", &w->idx_wq_b));
    NAME(n, "%sindexer.wk.weight", base);
    KR_TRY(load_mat(ld, n, Di, c->dim, false, "indexer k projection [index_head_dim, hidden]", &w->idx_wk));
    NAME(n, "%sindexer.k_norm.weight", base);
    KR_TRY(load_vec(ld, n, Di, false, "indexer key LayerNorm weight [index_head_dim]", &w->idx_k_norm_w));
    NAME(n, "%sindexer.k_norm.bias", base);
    KR_TRY(load_vec(ld, n, Di, false, "indexer key LayerNorm bias [index_head_dim]", &w->idx_k_norm_b));
    NAME(n, "%sindexer.weights_proj.weight", base);
    KR_TRY(load_mat(ld, n, Hi, c->dim, false, "indexer head weights [index_n_heads, hidden]", &w->idx_w));
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
    KR_TRY(load_mat(ld, n, ffn, d_in, false, "MLP up_proj", &w->up));
    NAME(n, "%sgate_proj.weight", base);
    KR_TRY(load_mat(ld, n, ffn, d_in, true, "", &w->gate));
    NAME(n, "%sdown_proj.weight", base);
    KR_TRY(load_mat(ld, n, d_out, ffn, false, "MLP down_proj", &w->down));
    NAME(n, "%sup_proj.bias", base);
    KR_TRY(load_vec(ld, n, ffn, !c->mlp_bias, "up_proj bias (mlp_bias)", &w->up_b));
    if (w->gate.data) {
        NAME(n, "%sgate_proj.bias", base);
        KR_TRY(load_vec(ld, n, ffn, !c->mlp_bias, "gate_proj bias (mlp_bias)", &w->gate_b));
    }
    NAME(n, "%sdown_proj.bias", base);
    KR_TRY(load_vec(ld, n, d_out, !c->mlp_bias, "down_proj bias (mlp_bias)", &w->down_b));
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
    KR_TRY(kr_backend_upload(ld->m->be, host, false, true, out, &owned));
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
    KR_TRY(check(ld, down, 3, (const int64_t[]){E, d_e, F}));
    if (gu) {
        KR_TRY(check(ld, gu, 3, (const int64_t[]){E, 2 * F, d_e}));
        if (up) {
            return kr_err_set(ld->err, KR_ERR_FORMAT, "%s: both \"%sexperts.gate_up_proj\" and \"%s\" are present",
                              up->file->path, base, up->name);
        }
    } else if (up) {
        KR_TRY(check(ld, up, 3, (const int64_t[]){E, F, d_e}));
    } else {
        NAME(n, "%sexperts.up_proj", base);
        return missing(ld, n, "fused expert up projections [n_routed_experts, moe_intermediate_size, d]");
    }
    for (int64_t e = 0; e < E; e++) {
        struct kr_tensor v;
        if (gu) { /* rows [gate (F) | up (F)] per expert */
            v = expert_view(gu, e, 0, F);
            KR_TRY(upload_view(ld, &v, &w->gate[e]));
            v = expert_view(gu, e, F, F);
        } else {
            v = expert_view(up, e, 0, F);
        }
        KR_TRY(upload_view(ld, &v, &w->up[e]));
        v = expert_view(down, e, 0, d_e);
        KR_TRY(upload_view(ld, &v, &w->down[e]));
    }
    return KR_OK;
}

static enum kr_status load_moe(struct loader *ld, const char *base, struct kr_moe_w *w)
{
    struct kr_model *m = ld->m;
    const struct kr_model_config *c = &m->cfg;
    const int64_t E = c->n_expert, F = c->moe_ffn;
    char n[512];
    NAME(n, "%sgate.weight", base);
    /* routers run in fp32 (as HF computes them), whatever the weights' storage */
    KR_TRY(load_mat_f32_t(ld, n, E, c->dim, "MoE router [n_routed_experts, hidden]", &w->router));
    NAME(n, "%sgate.e_score_correction_bias", base);
    KR_TRY(load_vec(ld, n, E, true, "", &w->router_bias));

    int64_t d_e = c->dim;
    if (c->moe_latent) {
        w->has_latent = true;
        d_e = c->moe_latent;
        NAME(n, "%sfc1_latent_proj.weight", base);
        KR_TRY(load_mat(ld, n, c->moe_latent, c->dim, false, "MoE latent down projection", &w->fc1_latent));
        NAME(n, "%sfc2_latent_proj.weight", base);
        KR_TRY(load_mat(ld, n, c->dim, c->moe_latent, false, "MoE latent up projection", &w->fc2_latent));
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
            KR_TRY(load_mat(ld, n, F, d_e, false, "expert up_proj [moe_intermediate_size, d]", &w->up[e]));
            NAME(n, "%sexperts.%lld.down_proj.weight", base, (long long)e);
            KR_TRY(load_mat(ld, n, d_e, F, false, "expert down_proj [d, moe_intermediate_size]", &w->down[e]));
            NAME(n, "%sexperts.%lld.gate_proj.weight", base, (long long)e);
            KR_TRY(load_mat(ld, n, F, d_e, !gated, "expert gate_proj (expert 0 has one)", &w->gate[e]));
        }
        if (!gated) {
            kr_free(w->gate);
            w->gate = NULL;
        }
    } else {
        NAME(n, "%sexperts.gate_up_proj", base);
        const bool gated = find(ld, n) != NULL;
        KR_TRY(load_fused_experts(ld, base, d_e, w));
        if (!gated) {
            kr_free(w->gate);
            w->gate = NULL;
        }
    }
    if (c->shared_ffn) {
        w->has_shared = true;
        NAME(n, "%sshared_experts.", base);
        KR_TRY(load_mlp(ld, n, c->dim, c->shared_ffn, c->dim, &w->shared));
    }
    return KR_OK;
}

/* Native layer i: the name of its pre-norm weight and the prefix of its mixer's tensors. */
static void layer_names(const struct loader *ld, int32_t i, char *norm, size_t nn, char *base, size_t nb)
{
    if (ld->deepseek) { /* HF layer i/2: attention half (even) or MLP half (odd) */
        const int32_t hf = i / 2;
        if (i % 2 == 0) {
            snprintf(norm, nn, "model.layers.%d.input_layernorm.weight", hf);
            snprintf(base, nb, "model.layers.%d.self_attn.", hf);
        } else {
            snprintf(norm, nn, "model.layers.%d.post_attention_layernorm.weight", hf);
            snprintf(base, nb, "model.layers.%d.mlp.", hf);
        }
        return;
    }
    snprintf(norm, nn, "%slayers.%d.norm.weight", ld->prefix, i);
    snprintf(base, nb, "%slayers.%d.mixer.", ld->prefix, i);
}

static enum kr_status load_layers(struct loader *ld)
{
    struct kr_model *m = ld->m;
    const struct kr_model_config *c = &m->cfg;
    char n[512], base[256];
    for (int32_t i = 0; i < c->n_layer; i++) {
        struct kr_layer *L = &m->layers[i];
        L->type = (enum kr_layer_type)c->pattern[i];
        layer_names(ld, i, n, sizeof n, base, sizeof base);
        KR_TRY(load_vec(ld, n, c->dim, false, "block RMSNorm weight [hidden]", &L->norm));
        switch (L->type) {
        case KR_LAYER_MAMBA:
            L->cache_idx = m->n_mamba++;
            KR_TRY(load_mamba(ld, base, &L->mamba));
            break;
        case KR_LAYER_ATTN:
            L->cache_idx = m->n_attn++;
            KR_TRY(load_attn(ld, base, &L->attn));
            break;
        case KR_LAYER_MLP:
            KR_TRY(load_mlp(ld, base, c->dim, c->ffn, c->dim, &L->mlp));
            break;
        case KR_LAYER_MOE:
            KR_TRY(load_moe(ld, base, &L->moe));
            break;
        case KR_LAYER_DSA:
        case KR_LAYER_MLA:
            L->cache_idx = m->n_mla++;
            KR_TRY(load_mla(ld, base, L->type == KR_LAYER_DSA, &L->mla));
            break;
        default:
            return kr_err_set(ld->err, KR_ERR_UNSUPPORTED, "%s: layer %d: unsupported layer type '%c'", m->dir, i,
                              (char)L->type);
        }
        if (ld->progress) {
            ld->progress(ld->progress_user, i + 1, c->n_layer);
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
            KR_LOG_DEBUG("skipping multi-token-prediction tensor %s", t->name);
            continue;
        }
        int hf_layer = -1;
        if (ld->deepseek && sscanf(t->name, "model.layers.%d.", &hf_layer) == 1 &&
            hf_layer >= ld->m->cfg.n_layer / 2 && hf_layer < ld->m->cfg.n_layer / 2 + ld->m->cfg.n_mtp_layers) {
            continue; /* multi-token-prediction layers follow the main layers; not used for decoding */
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
    ld->deepseek = !strcmp(c->model_type, "deepseek_v32");
    for (int p = ld->deepseek ? 1 : 0; p < 2 && !emb; p++) {
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
    KR_TRY(load_mat(ld, emb->name, c->vocab, c->dim, false, "token embedding [vocab, hidden]", &m->embed));
    if (ld->deepseek) {
        NAME(n, "model.norm.weight");
    } else {
        NAME(n, "%snorm_f.weight", ld->prefix);
    }
    KR_TRY(load_vec(ld, n, c->dim, false, "final RMSNorm weight [hidden]", &m->final_norm));
    m->layers = kr_calloc((size_t)c->n_layer, sizeof *m->layers);
    if (!m->layers) {
        return KR_ERR_NOMEM;
    }
    KR_TRY(load_layers(ld));
    if (c->tie_embeddings) {
        m->lm_head = m->embed;
        struct kr_st_tensor *lm = find(ld, "lm_head.weight");
        if (lm) { /* some exports keep the tied copy; it must at least have the right shape */
            KR_TRY(check(ld, lm, 2, (const int64_t[]){c->vocab, c->dim}));
        }
    } else {
        KR_TRY(load_mat(ld, "lm_head.weight", c->vocab, c->dim, false,
                     "output projection [vocab, hidden] (tie_word_embeddings is false)", &m->lm_head));
    }
    if (m->n_mla) {
        struct kr_tensor host = {.data = c->rope_inv_freq, .dtype = KR_DTYPE_F32, .rows = 1, .cols = c->qk_rope / 2}, dev;
        struct kr_buf owned;
        KR_TRY(kr_backend_upload(m->be, &host, true, false, &dev, &owned));
        KR_TRY(own_buf(m, &owned));
        m->rope_inv_freq = dev.data;
    }
    KR_TRY(check_unused(ld));
    if (ld->deepseek && c->n_mtp_layers) {
        KR_LOG_INFO("%s: skipped %d multi-token-prediction layer(s) after layer %d", m->dir, c->n_mtp_layers,
                    c->n_layer / 2 - 1);
    }
    if (c->fp8_weights) {
        KR_LOG_INFO("%s: FP8 block-quantized weights were dequantized to fp32 at load", m->dir);
    }
    return KR_OK;
}

enum kr_status kr_model_load(const char *dir, kr_backend_t be, struct kr_model **out, struct kr_err *err)
{
    return kr_model_load_progress(dir, be, NULL, NULL, out, err);
}

enum kr_status kr_model_load_progress(const char *dir, kr_backend_t be, kr_progress_cb cb, void *user,
                                      struct kr_model **out, struct kr_err *err)
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
    struct loader ld = {.m = m, .err = err, .progress = cb, .progress_user = user};
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
    kr_backend_graph_reset(m->be); /* captured steps point at these weights */
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
    kr_free(m->pad);
    kr_free(m->owned);
    kr_free(m->layers);
    kr_st_close(m->ar);
    kr_free(m->dir);
    kr_free(m);
}
