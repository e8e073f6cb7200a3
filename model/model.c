/* The forward pass, written once against the backend interface. One step runs a flattened
 * batch: every layer is a pre-norm residual block x += mixer(rmsnorm(x)). */
#include "model.h"

#include "cache.h"
#include "alloc.h"
#include "log.h"

#include <assert.h>
#include <math.h>
#include <string.h>

/* ---- workspace ------------------------------------------------------------------------------ */

/* Float offsets of the step's activations inside m->work (all [n_tok, width] row-major). */
struct ws {
    float *x;      /* [n, dim] residual stream */
    float *h;      /* [n, dim] normed input of the current mixer */
    float *o;      /* [n, dim] mixer output */
    float *big;    /* [n, wide] projections: Mamba in_proj, q|k|v, MLP gate/up */
    float *big2;   /* [n, wide] second projection (gated MLP up) */
    float *xbc;    /* [n, conv_dim] */
    float *y;      /* [n, mid] Mamba y / attention out / MLP hidden / MoE latent */
    float *y2;     /* [n, mid] gated-norm output / MoE expert out */
    float *logit;  /* [n, n_expert] router logits */
    float *rw;     /* [n, n_used] routing weights */
    int32_t *ids;  /* [n, n_used] routed experts */
    float *m_cq;   /* [n, q_lora] MLA q latent */
    float *m_kva;  /* [n, kv_lora + rope] MLA kv down projection */
    float *m_ckv;  /* [n, kv_lora] normalised kv latent */
    float *m_ik;   /* [n, idx_dim] indexer keys */
    float *m_w;    /* [n, idx_heads] indexer head weights */
    int32_t *m_idx; /* [n, topk] selected positions */
    float *fin;    /* [n_out, dim] rows kept for the LM head */
    float *lg;     /* [n_out, vocab] logits */
    float *lg_part; /* [n_out, vocab / tp_size] this rank's share of the logits (tensor parallel) */
    krk_bf16 *xb;  /* [n, xb_width] bf16 operand of the GEMM that reads an activation next (struct
                      krk_bf16_in): written by the op producing it when bf16, else room to round into */
    int64_t xb_cap; /* its elements */
    bool bf16;     /* kr_backend_bf16_operands for the step's tokens: ops write the bf16 copies */
    bool dsa_select; /* some context of the step exceeds index_topk: D layers select (see mla_fwd) */
};

static int64_t max64(int64_t a, int64_t b)
{
    return a > b ? a : b;
}

/* Widest activation a GEMM reads (its bf16 operand's row). */
static int64_t xb_width(const struct kr_model_config *c, int64_t mid)
{
    return max64(max64(c->dim, mid), c->q_lora);
}

/* Floats of the bf16 operand's room for n tokens, in whole 256-byte units (it comes first in the
 * workspace: the regions after it keep their alignment). */
static int64_t xb_floats(const struct kr_model_config *c, int64_t n, int64_t mid)
{
    return ((n * xb_width(c, mid) + 1) / 2 + 63) / 64 * 64;
}

/* Every buffer of the step's workspace starts on a multiple of this many floats (256 bytes), so that
 * a buffer's alignment, and with it the kernel variant a launcher picks by alignment (vector widths,
 * cuBLASLt algorithms), does not depend on the step's token count; WS_BUFS: the buffers ws_prepare
 * takes. */
#define WS_ALIGN 64
#define WS_BUFS 21

static size_t ws_floats(const struct kr_model_config *c, int64_t n, int64_t n_out, int64_t *wide, int64_t *mid)
{
    int64_t w = c->dim;
    w = max64(w, c->m_in_proj);
    w = max64(w, (c->n_head + 2 * c->n_kv_head) * c->head_dim);
    w = max64(w, c->ffn);
    w = max64(w, c->shared_ffn);
    w = max64(w, c->mla_heads * (c->qk_nope + c->qk_rope));
    w = max64(w, c->idx_heads * c->idx_head_dim);
    int64_t md = max64(c->dim, c->m_d_inner);
    md = max64(md, c->n_head * c->head_dim);
    md = max64(md, c->ffn);
    md = max64(md, c->shared_ffn);
    md = max64(md, c->moe_latent);
    md = max64(md, c->mla_heads * c->v_head);
    *wide = w;
    *mid = md;
    const int64_t mla = c->q_lora + 2 * c->kv_lora + c->qk_rope + c->idx_head_dim + c->idx_heads + c->idx_topk;
    const int64_t part = c->tp_size > 1 ? c->vocab / c->tp_size : 0;
    return (size_t)(WS_BUFS * WS_ALIGN + xb_floats(c, n, md) +
                    n * (3 * c->dim + 2 * w + c->m_conv_dim + 2 * md + c->n_expert + 2 * c->n_expert_used + mla) +
                    n_out * (c->dim + c->vocab + part));
}

static int32_t batch_max_ctx(const struct kr_batch *b)
{
    int32_t mc = 0;
    for (int32_t s = 0; s < b->n_seq; s++) {
        const int32_t ctx = b->seq_pos0[s] + b->seq_tok0[s + 1] - b->seq_tok0[s];
        mc = ctx > mc ? ctx : mc;
    }
    return mc;
}

/* Grows the workspace and the backend's scratch to cover n_tok tokens (n_out of them output) in
 * n_seq sequences with contexts up to max_ctx. Growth drops the backend's captured graphs. */
static enum kr_status grow(struct kr_model *m, int64_t n_tok, int64_t n_out, int64_t n_seq, int64_t max_ctx)
{
    const struct kr_model_config *c = &m->cfg;
    int64_t wide, mid;
    const size_t need = ws_floats(c, n_tok, n_out, &wide, &mid) * sizeof(float);
    if (need > m->work.size) {
        kr_backend_graph_reset(m->be);
        kr_backend_buf_free(m->be, &m->work);
        enum kr_status st = kr_backend_buf_alloc(m->be, need, &m->work);
        if (st != KR_OK) {
            return st;
        }
        m->work_tokens = (int32_t)n_tok;
    }
    if (n_tok > m->res_tok || n_seq > m->res_seq || max_ctx > m->res_ctx) {
        if (max_ctx > m->res_ctx && m->n_mla) {
            /* the MLA layers of a captured graph take every context up to the one reserved for
             * when it was captured (kr_model_forward's bound), and no further */
            kr_backend_graph_reset(m->be);
        }
        m->res_tok = n_tok > m->res_tok ? n_tok : m->res_tok;
        m->res_seq = n_seq > m->res_seq ? n_seq : m->res_seq;
        m->res_ctx = max_ctx > m->res_ctx ? max_ctx : m->res_ctx;
        return kr_backend_reserve(m->be, c, m->res_tok, m->res_seq, m->res_ctx, m->res_block > 0 ? m->res_block : 16);
    }
    return KR_OK;
}

bool kr_indexer_parse(const char *s, enum kr_indexer *out)
{
    static const char *const names[] = {"auto", "bf16", "fp8"};
    for (int i = 0; i < 3; i++) {
        if (s && !strcmp(s, names[i])) {
            *out = (enum kr_indexer)i;
            return true;
        }
    }
    return false;
}

bool kr_kv_cache_dtype_parse(const char *s, enum kr_kv_cache_dtype *out)
{
    static const char *const names[] = {"auto", "bf16", "fp8"};
    for (int i = 0; i < 3; i++) {
        if (s && !strcmp(s, names[i])) {
            *out = (enum kr_kv_cache_dtype)i;
            return true;
        }
    }
    return false;
}

enum kr_status kr_model_set_kv_cache_dtype(struct kr_model *m, enum kr_kv_cache_dtype mode, struct kr_err *err)
{
    if (mode != KR_KV_CACHE_FP8) {
        m->kv_fp8 = false;
        return KR_OK;
    }
    if (!kr_backend_can_kv_fp8(m->be)) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED,
                          "--kv-cache-dtype fp8: the %s backend has no FP8 caches yet (the CPU reference has)",
                          kr_backend_name(m->be));
    }
    if (kr_model_config_count(&m->cfg, KR_LAYER_DSA) > 0) {
        struct kr_err e2 = {0};
        if (kr_model_set_indexer(m, KR_INDEXER_FP8, &e2) != KR_OK) {
            return kr_err_set(err, KR_ERR_UNSUPPORTED, "--kv-cache-dtype fp8 stores DSA index keys in FP8: %s",
                              e2.msg);
        }
    }
    m->kv_fp8 = true;
    return KR_OK;
}

enum kr_status kr_model_set_indexer(struct kr_model *m, enum kr_indexer mode, struct kr_err *err)
{
    const struct kr_model_config *c = &m->cfg;
    const int64_t Di = c->idx_head_dim;
    /* the Hadamard transform needs a power of two; kernels handle 32..1024 (real models: 128) */
    const bool pow2 = Di >= 32 && Di <= 1024 && (Di & (Di - 1)) == 0;
    const bool has_d = kr_model_config_count(c, KR_LAYER_DSA) > 0;
    if (mode == KR_INDEXER_FP8) {
        if (!has_d) {
            return kr_err_set(err, KR_ERR_UNSUPPORTED, "%s: the FP8 indexer needs DSA (D) layers; this model has none",
                              m->dir);
        }
        if (!kr_backend_can_fp8_round(m->be)) {
            return kr_err_set(err, KR_ERR_UNSUPPORTED, "%s: the %s backend has no FP8 indexer path yet (use bf16)",
                              m->dir, kr_backend_name(m->be));
        }
        if (!pow2) {
            return kr_err_set(err, KR_ERR_UNSUPPORTED,
                              "%s: the FP8 indexer needs index_head_dim a power of two in 32..1024 (Hadamard), not %lld", m->dir,
                              (long long)Di);
        }
        m->idx_fp8 = true;
    } else if (mode == KR_INDEXER_AUTO) {
        /* the DeepSeek reference's FP8 indexer goes with DeepSeek's FP8 checkpoints, not ModelOpt's */
        const bool ds_fp8 = c->fp8_weights && !c->fp8_modelopt;
        m->idx_fp8 = has_d && ds_fp8 && pow2 && kr_backend_can_fp8_round(m->be);
        if (has_d && ds_fp8 && !m->idx_fp8) {
            if (!pow2) {
                KR_LOG_INFO("%s: FP8 checkpoint, but index_head_dim %lld is not a power of two in 32..1024 (the "
                            "FP8 path's Hadamard transform): the indexer scores in bf16",
                            m->dir, (long long)Di);
            } else {
                KR_LOG_INFO("%s: FP8 checkpoint, but the %s backend has no FP8 indexer path: the indexer scores in "
                            "bf16",
                            m->dir, kr_backend_name(m->be));
            }
        }
    } else {
        m->idx_fp8 = false;
    }
    if (m->idx_fp8) {
        KR_LOG_INFO("%s: DSA indexer: FP8 path (Hadamard, e4m3 blocks of %lld, %s scales)", m->dir,
                    (long long)(Di < 128 ? Di : 128), c->fp8_ue8m0 ? "ue8m0" : "fp32");
    }
    return KR_OK;
}

/* `buf` holds at least `bytes` (grown by half again when it must grow). */
static enum kr_status buf_fit(struct kr_model *m, struct kr_buf *buf, size_t bytes)
{
    if (buf->ptr && buf->size >= bytes) {
        return KR_OK;
    }
    kr_backend_buf_free(m->be, buf);
    return kr_backend_buf_alloc(m->be, bytes + bytes / 2 + 64, buf);
}

enum kr_status kr_model_reserve(struct kr_model *m, int64_t n_tok, int64_t n_out, int64_t n_seq, int64_t max_ctx,
                                int32_t block_size)
{
    if (block_size > 0 && (m->res_block == 0 || block_size < m->res_block)) {
        m->res_block = block_size;
        m->res_seq = 0; /* the backend's block-table room depends on it: reserve again */
    }
    /* decode steps of n_seq sequences may run padded to the graph batch size above it */
    const int64_t bucket = n_seq > 0 && n_seq <= INT32_MAX ? kr_backend_graph_bucket(m->be, (int32_t)n_seq) : 0;
    if (bucket > n_seq) {
        n_tok = n_tok > bucket ? n_tok : bucket;
        n_out = n_out > bucket ? n_out : bucket;
        n_seq = bucket;
    }
    KR_TRY(grow(m, n_tok, n_out, n_seq, max_ctx));
    if (m->n_mtp > 0) { /* the head's inputs: a step's residual rows, a pass's final-normed rows */
        const size_t rb = (size_t)m->cfg.dim * kr_backend_act_size(m->be);
        KR_TRY(buf_fit(m, &m->mtp_h, (size_t)n_tok * rb));
        KR_TRY(buf_fit(m, &m->mtp_g, (size_t)n_out * rb));
    }
    return KR_OK;
}

static enum kr_status ws_prepare(struct kr_model *m, const struct kr_batch *b, struct ws *ws)
{
    const struct kr_model_config *c = &m->cfg;
    int64_t wide, mid;
    (void)ws_floats(c, b->n_tok, b->n_out, &wide, &mid);
    const int32_t max_ctx = batch_max_ctx(b);
    /* --batch-invariant: selection on whatever the other sequences' contexts (it takes every key of a
     * shorter one, the same keys as dense attention, but not in the same kernel) */
    ws->dsa_select = max_ctx > c->idx_topk || kr_backend_batch_invariant(m->be);
    enum kr_status st = grow(m, b->n_tok, b->n_out, b->n_seq, max_ctx);
    if (st != KR_OK) {
        return st;
    }
    const int64_t n = b->n_tok;
    float *p = m->work.ptr;
    int n_bufs = 0;
#define TAKE(field, count)                                                                         \
    do {                                                                                           \
        ws->field = (void *)p;                                                                     \
        p += ((count) + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN;                                       \
        n_bufs++;                                                                                  \
    } while (0)
    TAKE(xb, xb_floats(c, n, mid));
    ws->xb_cap = xb_floats(c, n, mid) * 2;
    ws->bf16 = kr_backend_bf16_operands(m->be, n);
    TAKE(x, n * c->dim);
    TAKE(h, n * c->dim);
    TAKE(o, n * c->dim);
    TAKE(big, n * wide);
    TAKE(big2, n * wide);
    TAKE(xbc, n * c->m_conv_dim);
    TAKE(y, n * mid);
    TAKE(y2, n * mid);
    TAKE(logit, n * c->n_expert);
    TAKE(rw, n * c->n_expert_used);
    TAKE(ids, n * c->n_expert_used); /* int32 and float have the same size */
    TAKE(m_cq, n * c->q_lora);
    TAKE(m_kva, n * (c->kv_lora + c->qk_rope));
    TAKE(m_ckv, n * c->kv_lora);
    TAKE(m_ik, n * c->idx_head_dim);
    TAKE(m_w, n * c->idx_heads);
    TAKE(m_idx, n * c->idx_topk); /* int32 and float have the same size */
    TAKE(fin, (int64_t)b->n_out * c->dim);
    TAKE(lg, (int64_t)b->n_out * c->vocab);
    ws->lg_part = c->tp_size > 1 ? p : NULL;
    assert(n_bufs + 1 <= WS_BUFS); /* the last, lg_part, needs no padding after it */
#undef TAKE
    return KR_OK;
}

/* ---- validation of the batch (client-controlled through the engine) ------------------------- */

static enum kr_status validate(const struct kr_model *m, const struct kr_cache *c, const struct kr_batch *b,
                               struct kr_err *err)
{
    if (b->n_tok < 0 || b->n_seq < 0 || b->n_out < 0 || b->n_out > b->n_tok) {
        return kr_err_set(err, KR_ERR_INVAL, "batch: invalid counts n_tok=%d n_seq=%d n_out=%d", b->n_tok, b->n_seq,
                          b->n_out);
    }
    if (b->seq_tok0[0] != 0 || b->seq_tok0[b->n_seq] != b->n_tok) {
        return kr_err_set(err, KR_ERR_INVAL, "batch: sequence offsets must start at 0 and end at n_tok");
    }
    if (kr_backend_kv_fp8_packed(m->be) && c->fp8 != m->kv_fp8) { /* the pools' sizes and layout */
        return kr_err_set(err, KR_ERR_INVAL, "caches made with %s pools for a model with --kv-cache-dtype %s: make "
                          "the caches after kr_model_set_kv_cache_dtype", c->fp8 ? "FP8" : "plain",
                          m->kv_fp8 ? "fp8" : "auto/bf16");
    }
    for (int32_t t = 0; t < b->n_tok; t++) {
        if (b->tokens[t] < 0 || b->tokens[t] >= m->cfg.vocab) {
            return kr_err_set(err, KR_ERR_INVAL, "token id %d at batch index %d is outside the vocabulary [0, %lld)",
                              b->tokens[t], t, (long long)m->cfg.vocab);
        }
    }
    for (int32_t s = 0; s < b->n_seq; s++) {
        const int32_t t0 = b->seq_tok0[s], t1 = b->seq_tok0[s + 1];
        if (t1 < t0) {
            return kr_err_set(err, KR_ERR_INVAL, "batch: sequence %d has a negative token count", s);
        }
        if (b->seq_slot[s] < 0 || b->seq_slot[s] >= c->n_state_slots) {
            return kr_err_set(err, KR_ERR_INVAL, "batch: sequence %d uses state slot %d outside [0, %d)", s,
                              b->seq_slot[s], c->n_state_slots);
        }
        for (int32_t r = 0; r < s; r++) {
            if (b->seq_slot[r] == b->seq_slot[s]) {
                return kr_err_set(err, KR_ERR_INVAL, "batch: sequences %d and %d share state slot %d", r, s,
                                  b->seq_slot[s]);
            }
        }
        if (b->seq_pos0[s] < 0) {
            return kr_err_set(err, KR_ERR_INVAL, "batch: sequence %d has a negative start position", s);
        }
        for (int32_t t = t0; t < t1; t++) {
            if (b->pos[t] != b->seq_pos0[s] + (t - t0)) {
                return kr_err_set(err, KR_ERR_INVAL, "batch: token %d of sequence %d has position %d, expected %d", t,
                                  s, b->pos[t], b->seq_pos0[s] + (t - t0));
            }
        }
        if ((m->n_attn || m->n_mla) && t1 > t0) {
            const int32_t last = b->pos[t1 - 1];
            const int32_t nb = last / c->block_size + 1;
            if (nb > b->max_blocks) {
                return kr_err_set(err, KR_ERR_INVAL, "batch: sequence %d needs %d cache blocks, its table holds %d", s,
                                  nb, b->max_blocks);
            }
            for (int32_t j = 0; j < nb; j++) {
                const int32_t id = b->block_table[(int64_t)s * b->max_blocks + j];
                if (id < 0 || id >= c->n_blocks) {
                    return kr_err_set(err, KR_ERR_INVAL, "batch: sequence %d block %d is %d, outside [0, %d)", s, j,
                                      id, c->n_blocks);
                }
            }
        }
    }
    for (int32_t i = 0; i < b->n_out; i++) {
        if (b->out_tok[i] < 0 || b->out_tok[i] >= b->n_tok) {
            return kr_err_set(err, KR_ERR_INVAL, "batch: output row %d selects token %d outside [0, %d)", i,
                              b->out_tok[i], b->n_tok);
        }
    }
    /* kept states: each in a slot of its own, apart from every sequence's and every other kept one */
    for (int32_t t = 0; b->tok_state_slot && t < b->n_tok; t++) {
        const int32_t k = b->tok_state_slot[t];
        if (k < 0) {
            continue;
        }
        if (k >= c->n_state_slots) {
            return kr_err_set(err, KR_ERR_INVAL, "batch: token %d keeps its state in slot %d outside [0, %d)", t, k,
                              c->n_state_slots);
        }
        for (int32_t s = 0; s < b->n_seq; s++) {
            if (b->seq_slot[s] == k) {
                return kr_err_set(err, KR_ERR_INVAL, "batch: token %d keeps its state in slot %d, sequence %d's", t,
                                  k, s);
            }
        }
        for (int32_t u = 0; u < t; u++) {
            if (b->tok_state_slot[u] == k) {
                return kr_err_set(err, KR_ERR_INVAL, "batch: tokens %d and %d keep their states in one slot %d", u,
                                  t, k);
            }
        }
    }
    return KR_OK;
}

/* ---- mixers ---------------------------------------------------------------------------------- */

/* The bf16 operand of the GEMMs right after an op that wrote its output's copy into ws->xb
 * (out_bf16 = bf16_out(ws)): filled when the step's ops write copies, rows of `ld`. */
static struct krk_bf16_in bf16_filled(const struct ws *ws, int64_t ld)
{
    return (struct krk_bf16_in){.data = ws->xb, .ld = ld, .cap = ws->xb_cap, .filled = ws->bf16};
}

/* Room in ws->xb for a GEMM to round its x into (x was not written with a bf16 copy). */
static struct krk_bf16_in bf16_room(const struct ws *ws)
{
    return (struct krk_bf16_in){.data = ws->xb, .cap = ws->xb_cap};
}

/* Where an op writing a GEMM's input puts its bf16 copy: ws->xb when the backend's GEMMs want it. */
static krk_bf16 *bf16_out(const struct ws *ws)
{
    return ws->bf16 ? ws->xb : NULL;
}

static enum kr_status mamba_fwd(struct kr_model *m, struct kr_cache *cache, const struct kr_layer *L, int64_t n,
                                struct ws *ws)
{
    const struct kr_model_config *c = &m->cfg;
    const struct kr_mamba_w *w = &L->mamba;
    kr_backend_t be = m->be;
    const struct krk_bf16_in hb = bf16_filled(ws, c->dim);
    KR_TRY(kr_backend_matmul(be, ws->h, c->dim, n, &w->in_proj, w->in_proj_b, ws->big, c->m_in_proj, &hb));
    struct krk_mamba_params p = {
        .zxbcdt = ws->big,
        .ld_in = c->m_in_proj,
        .d_inner = c->m_d_inner,
        .n_head = c->m_heads,
        .head_dim = c->m_head_dim,
        .n_group = c->m_groups,
        .d_state = c->m_state,
        .d_conv = c->m_conv,
        .chunk = c->m_chunk,
        .conv_w = w->conv_w,
        .conv_b = w->conv_b,
        .dt_bias = w->dt_bias,
        .A_log = w->A_log,
        .D = w->D,
        .dt_min = c->m_dt_min,
        .dt_max = c->m_dt_max,
        .conv_state = kr_cache_conv_layer(cache, L->cache_idx),
        .ssm_state = kr_cache_ssm_layer(cache, L->cache_idx),
        .xbc = ws->xbc,
        .y = ws->y,
    };
    KR_TRY(kr_backend_mamba(be, &p));
    /* z is the first d_inner columns of the in_proj output */
    const struct krk_gated_rmsnorm_params gn = {.y = ws->y, .z = ws->big, .ldz = c->m_in_proj, .w = w->norm_w,
                                                .n = n, .dim = c->m_d_inner, .group = c->m_d_inner / c->m_groups,
                                                .eps = c->norm_eps, .out = ws->y2, .out_bf16 = bf16_out(ws)};
    KR_TRY(kr_backend_gated_rmsnorm(be, &gn));
    const struct krk_bf16_in yb = bf16_filled(ws, c->m_d_inner);
    return kr_backend_matmul(be, ws->y2, c->m_d_inner, n, &w->out_proj, w->out_proj_b, ws->o, c->dim, &yb);
}

static enum kr_status attn_fwd(struct kr_model *m, struct kr_cache *cache, const struct kr_layer *L, int64_t n,
                               struct ws *ws)
{
    const struct kr_model_config *c = &m->cfg;
    const struct kr_attn_w *w = &L->attn;
    kr_backend_t be = m->be;
    const int64_t qd = c->n_head * c->head_dim, kvd = c->n_kv_head * c->head_dim, ld = qd + 2 * kvd;
    const struct kr_matmul_part qkv[3] = {{&w->q, w->q_b, ws->big, ld},
                                          {&w->k, w->k_b, ws->big + qd, ld},
                                          {&w->v, w->v_b, ws->big + qd + kvd, ld}};
    const struct krk_bf16_in hb = bf16_filled(ws, c->dim), room = bf16_room(ws);
    KR_TRY(kr_backend_matmul_multi(be, ws->h, c->dim, n, 3, qkv, &hb));
    struct krk_attn_params p = {
        .q = ws->big,
        .k = ws->big + qd,
        .v = ws->big + qd + kvd,
        .ld_qkv = ld,
        .n_head = c->n_head,
        .n_kv_head = c->n_kv_head,
        .head_dim = c->head_dim,
        .scale = 1.0f / sqrtf((float)c->head_dim),
        .k_cache = kr_cache_k_layer(cache, L->cache_idx),
        .v_cache = kr_cache_v_layer(cache, L->cache_idx),
        .block_size = cache->block_size,
        .out = ws->y,
        .kv_fp8 = m->kv_fp8,
        .k_scale = w->k_scale,
        .v_scale = w->v_scale,
    };
    KR_TRY(kr_backend_attention(be, &p));
    return kr_backend_matmul(be, ws->y, qd, n, &w->o, w->o_b, ws->o, c->dim, &room);
}


/* MLA (+) or DSA (D) mixer: MODEL_SPEC §1.4-§1.5, absorbed form over the latent cache. */
static enum kr_status mla_fwd(struct kr_model *m, struct kr_cache *cache, const struct kr_layer *L, int32_t layer,
                              const struct kr_batch *b, struct ws *ws)
{
    const struct kr_model_config *c = &m->cfg;
    const struct kr_mla_w *w = &L->mla;
    kr_backend_t be = m->be;
    const int64_t n = b->n_tok, H = c->mla_heads, Dn = c->qk_nope, Dr = c->qk_rope, Rq = c->q_lora,
                  Rkv = c->kv_lora, qd = Dn + Dr;
    float *q = ws->big; /* [n, H * qd] */
    const float *cq = ws->h;
    int64_t ld_cq = c->dim;
    const int64_t Di_blk = c->idx_head_dim < 128 ? c->idx_head_dim : 128;
    const int64_t Hi = c->idx_heads, Di = c->idx_head_dim;
    float *iq = ws->big2;
    /* When no query of the step sees more than index_topk keys, the indexer would select every
     * visible key: its query side (projections, scores, selection) is skipped and the layer attends
     * densely over the same keys. The new keys are still indexed for later queries. */
    const bool select = (w->has_indexer || w->shares_topk) && ws->dsa_select;
    /* a layer sharing a selection attends with the one the last indexed D layer left in ws->m_idx (no
     * layer between them selects); it runs no indexer of its own */
    const bool own = select && w->has_indexer;
    /* every product of the layer input at once: q_a (or q), kv_a, the indexer key and head weights */
    struct kr_matmul_part in[4] = {{&w->q_a, NULL, Rq ? ws->m_cq : q, Rq ? Rq : H * qd},
                                   {&w->kv_a, NULL, ws->m_kva, Rkv + Dr}};
    int n_in = 2;
    if (w->has_indexer) {
        in[n_in++] = (struct kr_matmul_part){&w->idx_wk, NULL, ws->m_ik, Di};
        if (own) {
            in[n_in++] = (struct kr_matmul_part){&w->idx_w, NULL, ws->m_w, Hi};
        }
    }
    const struct krk_bf16_in hb = bf16_filled(ws, c->dim), room = bf16_room(ws);
    KR_TRY(kr_backend_matmul_multi(be, ws->h, c->dim, n, n_in, in, &hb));
    /* the per-token steps of the key side (and the q latent's norm) up to the cache write */
    void *lat = kr_cache_mla_layer(cache, L->cache_idx);
    const int64_t row = cache->mla_row[L->cache_idx];
    const struct krk_fp8_round_params fk = {.x = ws->m_ik, .ld = Di, .n = n, .dim = Di, .block = Di_blk,
                                           .hadamard = true, .ue8m0 = c->fp8_ue8m0};
    const struct krk_mla_prep_params pp = {
        .n = n,
        .q_lat = Rq ? ws->m_cq : NULL,
        .q_dim = Rq,
        .q_norm = Rq ? w->q_a_norm : NULL,
        .kva = ws->m_kva,
        .kv_lora = Rkv,
        .rope = Dr,
        .kv_norm = w->kv_a_norm,
        .ckv = ws->m_ckv,
        .eps = c->mla_eps,
        .inv_freq = m->rope_inv_freq,
        .factor = c->rope_attn_factor,
        .ik = w->has_indexer ? ws->m_ik : NULL,
        .idx_dim = Di,
        .ik_norm_w = w->idx_k_norm_w,
        .ik_norm_b = w->idx_k_norm_b,
        .idx_eps = c->idx_eps,
        .ik_fp8 = w->has_indexer && m->idx_fp8 ? &fk : NULL,
        .w = own ? ws->m_w : NULL,
        .n_w = Hi,
        .w_scale = (float)(1.0 / sqrt((double)Hi) / sqrt((double)Di)),
        .cache = lat,
        .block_size = cache->block_size,
        .cache_fp8 = m->kv_fp8,
    };
    KR_TRY(kr_backend_mla_prep(be, &pp));
    if (Rq) {
        cq = ws->m_cq;
        ld_cq = Rq;
        /* q_b and the indexer's query projection read the same normalised q latent */
        const struct kr_matmul_part qp[2] = {{&w->q_b, NULL, q, H * qd}, {&w->idx_wq_b, NULL, iq, Hi * Di}};
        KR_TRY(kr_backend_matmul_multi(be, cq, Rq, n, own ? 2 : 1, qp, &room));
    } else if (own) {
        KR_TRY(kr_backend_matmul(be, cq, ld_cq, n, &w->idx_wq_b, NULL, iq, Hi * Di, &room));
    }
    /* interleaved RoPE on q_pe (each head's last Dr dims); with the indexer, half-split RoPE on the
     * first Dr dims of every indexer query head alongside */
    const struct krk_rope_params rq = {.x = q, .ld = H * qd, .n_vec = H, .stride = qd, .off = Dn, .dim = Dr,
                                       .interleaved = true, .inv_freq = m->rope_inv_freq,
                                       .factor = c->rope_attn_factor};
    const struct krk_rope_params ri = {.x = iq, .ld = Hi * Di, .n_vec = Hi, .stride = Di, .off = 0, .dim = Dr,
                                       .interleaved = false, .inv_freq = m->rope_inv_freq,
                                       .factor = c->rope_attn_factor};
    KR_TRY(own ? kr_backend_rope_pair(be, &rq, &ri) : kr_backend_rope(be, &rq));
    m->idx_query_rows += own ? (uint64_t)n : 0;
    if (own) {
        if (m->idx_fp8) { /* rotate and quantize queries as the reference's FP8 kernels see them */
            struct krk_fp8_round_params fq = {.x = iq, .ld = Di, .n = n * Hi, .dim = Di, .block = Di_blk,
                                             .hadamard = true, .ue8m0 = c->fp8_ue8m0};
            KR_TRY(kr_backend_fp8_round(be, &fq));
        }
    }
    const int32_t topk = (int32_t)c->idx_topk;
    /* the selection runs as part of the attention (a backend may overlap it with the absorption) */
    const struct krk_dsa_index_params ip = {.iq = iq, .w = ws->m_w, .n_head = Hi, .head_dim = Di, .cache = lat,
                                            .row = row, .key_off = cache->mla_key_off, .block_size = cache->block_size,
                                            .topk = topk, .idx = ws->m_idx, .fp8 = cache->fp8,
                                            .no_relu = !c->idx_relu};
    struct krk_mla_attn_params ap = {.q = q, .n_head = H, .nope = Dn, .rope = Dr, .v_dim = c->v_head, .kv_lora = Rkv,
                                     .kv_b = w->kv_b, .cache = lat, .row = row, .block_size = cache->block_size,
                                     .idx = select ? ws->m_idx : NULL, .topk = topk, .scale = c->mla_scale,
                                     .out = ws->y, .select = own ? &ip : NULL, .fp8 = cache->fp8};
    KR_TRY(kr_backend_mla_attention(be, &ap));
    if (w->has_indexer && m->on_index) {
        const size_t nb = (size_t)n * (size_t)topk * sizeof(int32_t);
        int32_t *host = kr_malloc(nb ? nb : 1);
        if (!host) {
            return KR_ERR_NOMEM;
        }
        enum kr_status st = KR_OK;
        if (select) {
            st = kr_backend_copy_d2h(be, host, ws->m_idx, nb);
        } else { /* what the indexer selects: every visible position, ascending, -1 padded */
            for (int64_t t = 0; t < n; t++) {
                for (int32_t j = 0; j < topk; j++) {
                    host[t * topk + j] = j <= b->pos[t] ? j : -1;
                }
            }
        }
        if (st == KR_OK) {
            m->on_index(m->on_index_user, layer, b, host, topk);
        }
        kr_free(host);
        KR_TRY(st);
    }
    return kr_backend_matmul(be, ws->y, H * c->v_head, n, &w->o, NULL, ws->o, c->dim, &room);
}

/* out = down(act(gate x) * up x) or down(act(up x)); hidden in `hid` [n, ffn]. xb: x's bf16 operand;
 * the activation writes hid's (ws->xb) for the down projection. */
static enum kr_status mlp_fwd(kr_backend_t be, const struct ws *ws, const struct kr_mlp_w *w, enum kr_act act,
                              const float *x, const struct krk_bf16_in *xb, int64_t d_in, int64_t n, float *t1,
                              float *t2, float *hid, float *out, int64_t d_out)
{
    const int64_t F = w->up.rows;
    if (w->gate.data) {
        const struct kr_matmul_part ug[2] = {{&w->up, w->up_b, t1, F}, {&w->gate, w->gate_b, t2, F}};
        KR_TRY(kr_backend_matmul_multi(be, x, d_in, n, 2, ug, xb));
        const struct krk_act_params ap = {.act = act, .gate = t2, .x = t1, .ld_in = F, .n = n, .width = F,
                                          .out = hid, .out_bf16 = bf16_out(ws)};
        KR_TRY(kr_backend_act(be, &ap));
    } else { /* the activation may come out of the up projection's epilogue */
        KR_TRY(kr_backend_matmul_act(be, x, d_in, n, &w->up, w->up_b, t1, F, act, hid, bf16_out(ws), xb));
    }
    const struct krk_bf16_in hb = bf16_filled(ws, F);
    return kr_backend_matmul(be, hid, F, n, &w->down, w->down_b, out, d_out, &hb);
}

static enum kr_status moe_fwd(struct kr_model *m, const struct kr_layer *L, int64_t n, struct ws *ws)
{
    const struct kr_model_config *c = &m->cfg;
    const struct kr_moe_w *w = &L->moe;
    kr_backend_t be = m->be;
    const struct krk_bf16_in hb = bf16_filled(ws, c->dim), room = bf16_room(ws);
    KR_TRY(kr_backend_matmul(be, ws->h, c->dim, n, &w->router, NULL, ws->logit, c->n_expert, &hb));
    struct krk_route_params rp = {
        .logits = ws->logit,
        .n = n,
        .bias = w->router_bias,
        .n_expert = c->n_expert,
        .n_used = c->n_expert_used,
        .n_group = c->n_group,
        .topk_group = c->topk_group,
        .norm_topk = c->norm_topk_prob,
        .scale = c->routed_scale,
        .score = c->router_score,
        .ids = ws->ids,
        .weights = ws->rw,
    };
    KR_TRY(kr_backend_moe_route(be, &rp));
    const float *xe = ws->h;
    int64_t d_e = c->dim;
    if (w->has_latent) {
        d_e = c->moe_latent;
        KR_TRY(kr_backend_matmul(be, ws->h, c->dim, n, &w->fc1_latent, NULL, ws->y, d_e, &room));
        xe = ws->y;
    }
    const struct krk_experts_params ep = {
        .x = xe,
        .n = n,
        .d_in = d_e,
        .d_ffn = c->moe_ffn,
        .d_out = d_e,
        .n_expert = c->n_expert,
        .n_used = c->n_expert_used,
        .ids = ws->ids,
        .weights = ws->rw,
        .act = c->act,
        .out = w->has_latent ? ws->y2 : ws->o,
    };
    const struct kr_expert_weights ew = {.gate = w->gate, .up = w->up, .down = w->down};
    KR_TRY(kr_backend_moe_experts(be, &ep, &ew));
    if (w->has_latent) {
        KR_TRY(kr_backend_matmul(be, ws->y2, d_e, n, &w->fc2_latent, NULL, ws->o, c->dim, &room));
    }
    if (w->has_shared) {
        /* shared expert into xbc-sized scratch: reuse big/big2 for its hidden, y2 for the output */
        KR_TRY(mlp_fwd(be, ws, &w->shared, c->act, ws->h, &room, c->dim, n, ws->big, ws->big2, ws->big, ws->y2,
                       c->dim));
        KR_TRY(kr_backend_add(be, ws->o, ws->y2, n * c->dim));
    }
    return KR_OK;
}

/* ---- the step --------------------------------------------------------------------------------- */

/* A decode-only step (one token per sequence, every token an output) can replay a CUDA graph. */
static bool graphable(const struct kr_model *m, const struct kr_batch *b)
{
    if (m->n_steps == 0 || m->on_index || b->n_tok != b->n_seq || b->n_out != b->n_tok || b->tok_state_slot) {
        return false;
    }
    for (int32_t i = 0; i < b->n_out; i++) {
        if (b->out_tok[i] != i) {
            return false;
        }
    }
    return true;
}

static int32_t pow2_at_least(int32_t v, int32_t lo)
{
    int32_t p = lo;
    while (p < v) {
        p *= 2;
    }
    return p;
}

/* The batch padded to `n` sequences and a block-table width of `mb`: padding sequences have state
 * slot -1 (kernels read and write no state or cache for them), token 0 at position 0, and block
 * tables of zeros. */
static enum kr_status pad_batch(struct kr_model *m, const struct kr_batch *b, int32_t n, int32_t mb,
                                int32_t ctx_bound, struct kr_batch *out)
{
    const size_t need = (size_t)n * 6 + 1 + (size_t)n * (size_t)mb;
    if (need > m->pad_cap) {
        int32_t *p = kr_realloc(m->pad, need * sizeof *p);
        if (!p) {
            return KR_ERR_NOMEM;
        }
        m->pad = p;
        m->pad_cap = need;
    }
    int32_t *tokens = m->pad, *pos = tokens + n, *tok0 = pos + n, *pos0 = tok0 + n + 1, *slot = pos0 + n,
            *out_tok = slot + n, *bt = out_tok + n;
    for (int32_t i = 0; i < n; i++) {
        const bool real = i < b->n_seq;
        tokens[i] = real ? b->tokens[i] : 0;
        pos[i] = real ? b->pos[i] : 0;
        tok0[i] = i;
        pos0[i] = real ? b->seq_pos0[i] : 0;
        slot[i] = real ? b->seq_slot[i] : -1;
        out_tok[i] = i;
        for (int32_t j = 0; j < mb; j++) {
            bt[(size_t)i * mb + j] = real && j < b->max_blocks ? b->block_table[(size_t)i * b->max_blocks + j] : 0;
        }
    }
    tok0[n] = n;
    *out = (struct kr_batch){.n_tok = n, .n_seq = n, .tokens = tokens, .pos = pos, .seq_tok0 = tok0,
                             .seq_pos0 = pos0, .seq_slot = slot, .block_table = bt, .max_blocks = mb, .n_out = n,
                             .out_tok = out_tok, .ctx_bound = ctx_bound};
    return KR_OK;
}

static enum kr_status run_layers(struct kr_model *m, struct kr_cache *cache, const struct kr_batch *b, struct ws *ws,
                                 int32_t i0, int32_t i1);
static enum kr_status lm_head(struct kr_model *m, const struct kr_batch *b, struct ws *ws, bool bf16,
                              const struct kr_tensor *head);

/* The layers, final norm and LM head of one step (the ops a graph replays). */
static enum kr_status run_ops(struct kr_model *m, struct kr_cache *cache, const struct kr_batch *b, struct ws *ws)
{
    const struct kr_model_config *c = &m->cfg;
    kr_backend_t be = m->be;
    const int64_t n = b->n_tok;
    KR_TRY(kr_backend_embed(be, &m->embed, m->embed_row0, ws->x));
    if (kr_backend_tp_size(be) > 1) { /* each rank gave its vocabulary rows, zeros elsewhere */
        KR_TRY(kr_backend_all_reduce(be, ws->x, n * c->dim));
    }
    KR_TRY(run_layers(m, cache, b, ws, 0, c->n_layer));
    if (b->n_out == 0) {
        return KR_OK;
    }
    KR_TRY(kr_backend_gather_out(be, ws->x, c->dim, ws->fin));
    const bool bf16 = kr_backend_bf16_operands(be, b->n_out);
    const struct krk_rmsnorm_params fn = {.x = ws->fin, .ldx = c->dim, .w = m->final_norm, .n = b->n_out,
                                          .dim = c->dim, .eps = c->norm_eps, .out = ws->fin,
                                          .out_bf16 = bf16 ? ws->xb : NULL};
    KR_TRY(kr_backend_rmsnorm(be, &fn));
    return lm_head(m, b, ws, bf16, &m->lm_head);
}

/* Layers [i0, i1) over the residual stream ws->x, which holds their sum at the end. */
static enum kr_status run_layers(struct kr_model *m, struct kr_cache *cache, const struct kr_batch *b, struct ws *ws,
                                 int32_t i0, int32_t i1)
{
    const struct kr_model_config *c = &m->cfg;
    kr_backend_t be = m->be;
    const int64_t n = b->n_tok;
    for (int32_t i = i0; i < i1; i++) {
        const struct kr_layer *L = &m->layers[i];
        /* the previous layer's output joins the residual stream in the same kernel as this norm */
        const struct krk_rmsnorm_params np = {.x = ws->x, .ldx = c->dim, .res = i > i0 ? ws->o : NULL, .w = L->norm,
                                              .n = n, .dim = c->dim, .eps = c->norm_eps, .out = ws->h,
                                              .out_bf16 = bf16_out(ws)};
        KR_TRY(kr_backend_rmsnorm(be, &np));
        enum kr_status st;
        switch (L->type) {
        case KR_LAYER_MAMBA:
            st = mamba_fwd(m, cache, L, n, ws);
            break;
        case KR_LAYER_ATTN:
            st = attn_fwd(m, cache, L, n, ws);
            break;
        case KR_LAYER_MLP: {
            const struct krk_bf16_in hb = bf16_filled(ws, c->dim);
            st = mlp_fwd(be, ws, &L->mlp, c->act, ws->h, &hb, c->dim, n, ws->big, ws->big2, ws->y, ws->o, c->dim);
            break;
        }
        case KR_LAYER_MOE:
            st = moe_fwd(m, L, n, ws);
            break;
        case KR_LAYER_DSA:
        case KR_LAYER_MLA:
            st = mla_fwd(m, cache, L, i, b, ws);
            break;
        default:
            st = KR_ERR_INTERNAL;
        }
        KR_TRY(st);
        /* under tensor parallelism every mixer's output is a partial sum (row-parallel output projection) */
        KR_TRY(kr_backend_all_reduce(be, ws->o, n * c->dim));
    }
    if (i1 > i0) { /* the last layer's output (the others' joined the next layer's norm) */
        KR_TRY(kr_backend_add(be, ws->x, ws->o, n * c->dim));
    }
    return KR_OK;
}

/* The LM head over the final-normed out rows ws->fin (their bf16 operand in ws->xb when `bf16`). */
/* The logits of b's out rows (ws->fin, final-normed) through `head` (m->lm_head, or the MTP head's). */
static enum kr_status lm_head(struct kr_model *m, const struct kr_batch *b, struct ws *ws, bool bf16,
                              const struct kr_tensor *head)
{
    const struct kr_model_config *c = &m->cfg;
    kr_backend_t be = m->be;
    const struct krk_bf16_in fb = {.data = ws->xb, .ld = c->dim, .cap = ws->xb_cap, .filled = bf16};
    if (c->tp_size > 1) { /* this rank's vocabulary rows, then every rank's side by side */
        const int64_t part = c->vocab / c->tp_size;
        KR_TRY(kr_backend_matmul(be, ws->fin, c->dim, b->n_out, head, NULL, ws->lg_part, part, &fb));
        return kr_backend_all_gather(be, ws->lg_part, b->n_out, part, ws->lg);
    }
    return kr_backend_matmul(be, ws->fin, c->dim, b->n_out, head, NULL, ws->lg, c->vocab, &fb);
}

enum kr_status kr_model_forward(struct kr_model *m, struct kr_cache *cache, const struct kr_batch *b, float *logits,
                                struct kr_err *err)
{
    const struct kr_model_config *c = &m->cfg;
    kr_backend_t be = m->be;
    enum kr_status st = validate(m, cache, b, err);
    if (st != KR_OK || b->n_tok == 0) {
        return st;
    }
    struct kr_batch padded;
    const struct kr_batch *run = b;
    int32_t key = 0;
    if (graphable(m, b)) {
        const int32_t bucket = kr_backend_graph_bucket(be, b->n_tok);
        const int32_t mb = pow2_at_least(b->max_blocks, 16);
        /* MLA layers: the graph's kernels are sized for contexts up to what its block tables can
         * hold, within what the scratch is reserved for; and whether the D layers select (some
         * context beyond index_topk) changes the ops, so it is part of the key */
        int32_t bound = 0, selects = 0;
        if (m->n_mla) {
            const int64_t cap = (int64_t)mb * cache->block_size, mc = batch_max_ctx(b);
            /* the bound must hold every context the graph will be replayed with: the contexts
             * reserved for, raised first when this one is beyond them (to a power of two, so that
             * a sequence growing a token a step has its graphs captured again now and then, not
             * every step; raising them drops the graphs captured under the lower bound) */
            if (mc > m->res_ctx && bucket > 0 &&
                (st = grow(m, 0, 0, 0, mc < (1 << 30) ? pow2_at_least((int32_t)mc, 256) : mc)) != KR_OK) {
                return kr_err_set(err, st, "forward pass failed: %s", kr_status_str(st));
            }
            bound = (int32_t)(cap < m->res_ctx ? cap : m->res_ctx);
            selects = mc > c->idx_topk; /* ws->dsa_select of this step (always set without D layers: topk 0) */
        }
        if (bucket > 0 && mb < (1 << 14) && pad_batch(m, b, bucket, mb, bound, &padded) == KR_OK) {
            run = &padded;
            key = bucket | (mb << 16) | (selects << 30);
        }
    }
    struct ws ws;
    bool begun = false, launched = false;
    if ((st = ws_prepare(m, run, &ws)) != KR_OK || (st = kr_backend_begin_batch(be, run)) != KR_OK) {
        goto fail;
    }
    begun = true;
    if (key && (st = kr_backend_graph_run(be, key, &launched)) != KR_OK) {
        goto fail;
    }
    if (!launched && (st = run_ops(m, cache, run, &ws)) != KR_OK) {
        goto fail;
    }
    begun = false;
    if ((st = kr_backend_end_batch(be, true)) != KR_OK) {
        goto fail;
    }
    m->n_steps++;
    if (m->mtp_keep) { /* the residual stream of every row, for the MTP head's pass after sampling */
        const size_t rb = (size_t)c->dim * kr_backend_act_size(be);
        if ((st = buf_fit(m, &m->mtp_h, (size_t)b->n_tok * rb)) != KR_OK ||
            (st = kr_backend_copy_d2d(be, m->mtp_h.ptr, ws.x, (size_t)b->n_tok * rb)) != KR_OK) {
            goto fail;
        }
        m->mtp_h_rows = b->n_tok;
    }
    if (b->n_out > 0 && logits &&
        (st = kr_backend_copy_d2h(be, logits, ws.lg, (size_t)b->n_out * (size_t)c->vocab * sizeof(float))) != KR_OK) {
        goto fail;
    }
    m->last_logits = ws.lg;
    return KR_OK;
fail:
    if (begun) {
        (void)kr_backend_end_batch(be, false);
    }
    kr_backend_tp_abort(be); /* the other ranks must not wait for this one's collectives */
    return kr_err_set(err, st, "forward pass failed: %s", kr_status_str(st));
}

/* ---- the multi-token-prediction head ----------------------------------------------------------- */

static enum kr_status mtp_ops(struct kr_model *m, struct kr_cache *cache, const struct kr_batch *b, struct ws *ws,
                              const struct kr_buf *src, bool src_final, const int32_t *src_row)
{
    const struct kr_model_config *c = &m->cfg;
    const struct kr_mtp_w *w = &m->mtp;
    kr_backend_t be = m->be;
    const int64_t n = b->n_tok;
    const size_t rb = (size_t)c->dim * kr_backend_act_size(be);
    /* the hidden states, gathered in runs of consecutive source rows */
    for (int64_t t = 0; t < n;) {
        int64_t e = t + 1;
        while (e < n && src_row[e] == src_row[e - 1] + 1) {
            e++;
        }
        KR_TRY(kr_backend_copy_d2d(be, (char *)ws->h + (size_t)t * rb, (const char *)src->ptr + (size_t)src_row[t] * rb,
                                   (size_t)(e - t) * rb));
        t = e;
    }
    if (src_final) {
        const struct krk_rmsnorm_params fn = {.x = ws->h, .ldx = c->dim, .w = m->final_norm, .n = n, .dim = c->dim,
                                              .eps = c->norm_eps, .out = ws->h};
        KR_TRY(kr_backend_rmsnorm(be, &fn));
    }
    const struct krk_bf16_in hb = bf16_filled(ws, c->dim);
    const struct krk_rmsnorm_params hn = {.x = ws->h, .ldx = c->dim, .w = w->hnorm, .n = n, .dim = c->dim,
                                          .eps = c->norm_eps, .out = ws->h, .out_bf16 = bf16_out(ws)};
    KR_TRY(kr_backend_rmsnorm(be, &hn));
    KR_TRY(kr_backend_matmul(be, ws->h, c->dim, n, &w->eh_h, NULL, ws->o, c->dim, &hb));
    KR_TRY(kr_backend_embed(be, w->embed.data ? &w->embed : &m->embed, m->embed_row0, ws->x));
    if (kr_backend_tp_size(be) > 1) { /* the main table's vocabulary rows of each rank, as the step's */
        KR_TRY(kr_backend_all_reduce(be, ws->x, n * c->dim));
    }
    const struct krk_rmsnorm_params en = {.x = ws->x, .ldx = c->dim, .w = w->enorm, .n = n, .dim = c->dim,
                                          .eps = c->norm_eps, .out = ws->h, .out_bf16 = bf16_out(ws)};
    KR_TRY(kr_backend_rmsnorm(be, &en));
    KR_TRY(kr_backend_matmul(be, ws->h, c->dim, n, &w->eh_e, NULL, ws->x, c->dim, &hb));
    KR_TRY(kr_backend_add(be, ws->x, ws->o, n * c->dim));
    KR_TRY(run_layers(m, cache, b, ws, c->n_layer, c->n_layer + m->n_mtp));
    if (b->n_out == 0) {
        return KR_OK;
    }
    KR_TRY(kr_backend_gather_out(be, ws->x, c->dim, ws->fin));
    const bool bf16 = kr_backend_bf16_operands(be, b->n_out);
    const struct krk_rmsnorm_params fn = {.x = ws->fin, .ldx = c->dim, .w = w->final_norm, .n = b->n_out,
                                          .dim = c->dim, .eps = c->norm_eps, .out = ws->fin,
                                          .out_bf16 = bf16 ? ws->xb : NULL};
    KR_TRY(kr_backend_rmsnorm(be, &fn));
    KR_TRY(buf_fit(m, &m->mtp_g, (size_t)b->n_out * rb));
    KR_TRY(kr_backend_copy_d2d(be, m->mtp_g.ptr, ws->fin, (size_t)b->n_out * rb));
    return lm_head(m, b, ws, bf16, w->head.data ? &w->head : &m->lm_head);
}

enum kr_status kr_model_mtp_forward(struct kr_model *m, struct kr_cache *cache, const struct kr_batch *b,
                                    const struct kr_buf *src, bool src_final, const int32_t *src_row, float *logits,
                                    struct kr_err *err)
{
    const struct kr_model_config *c = &m->cfg;
    kr_backend_t be = m->be;
    if (m->n_mtp == 0) {
        return kr_err_set(err, KR_ERR_INVAL, "%s: no multi-token-prediction head is loaded", m->dir);
    }
    enum kr_status st = validate(m, cache, b, err);
    if (st != KR_OK || b->n_tok == 0) {
        return st;
    }
    const size_t rb = (size_t)c->dim * kr_backend_act_size(be);
    const int64_t have = src && src->ptr ? (int64_t)(src->size / rb) : 0;
    for (int32_t t = 0; t < b->n_tok; t++) {
        if (src_row[t] < 0 || src_row[t] >= have) {
            return kr_err_set(err, KR_ERR_INVAL, "MTP pass: row %d takes hidden state %d of %lld", t, src_row[t],
                              (long long)have);
        }
    }
    struct ws ws;
    bool begun = false;
    if ((st = ws_prepare(m, b, &ws)) != KR_OK || (st = kr_backend_begin_batch(be, b)) != KR_OK) {
        goto fail;
    }
    begun = true;
    if ((st = mtp_ops(m, cache, b, &ws, src, src_final, src_row)) != KR_OK) {
        goto fail;
    }
    begun = false;
    if ((st = kr_backend_end_batch(be, true)) != KR_OK) {
        goto fail;
    }
    if (b->n_out > 0 && logits &&
        (st = kr_backend_copy_d2h(be, logits, ws.lg, (size_t)b->n_out * (size_t)c->vocab * sizeof(float))) != KR_OK) {
        goto fail;
    }
    return KR_OK;
fail:
    if (begun) {
        (void)kr_backend_end_batch(be, false);
    }
    kr_backend_tp_abort(be); /* the other ranks must not wait for this one's collectives */
    return kr_err_set(err, st, "MTP pass failed: %s", kr_status_str(st));
}
