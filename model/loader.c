/* Checkpoint loader: maps the tensors of an HF `nemotron_h` checkpoint (Hub layout with the
 * `backbone.` prefix or transformers-5 layout with `model.`; per-expert or fused 3-D expert
 * tensors; `D`/`+` mixers with deepseek_v32 attention names) or of an HF `deepseek_v32` checkpoint
 * (FP8 block-quantized weights dequantized here) onto the internal model description, checking
 * every name, shape and dtype. */
#include "model.h"

#include "alloc.h"
#include "fp8.h"
#include "log.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

struct loader {
    struct kr_model *m;
    struct kr_model_config full; /* the whole model's config: stored shapes are checked against it */
    int64_t rank, size;          /* tensor-parallel place (m->cfg is this rank's share) */
    kr_progress_cb progress;
    void *progress_user;
    const char *prefix; /* "backbone." or "model." */
    bool deepseek;      /* HF deepseek_v32 naming (layer i -> native 2i, 2i+1) */
    bool whole_precision; /* the embedding and the LM head: never kept as FP8 */
    bool mtp;           /* load the multi-token-prediction head too */
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
    if (!t->used) { /* a tensor loaded in parts (eh_proj's halves) counts once */
        ld->m->n_params += (uint64_t)t->n_elem;
    }
    t->used = true;
    return KR_OK;
}

static enum kr_status check(struct loader *ld, struct kr_st_tensor *t, int n_dim, const int64_t *shape)
{
    return check_any(ld, t, n_dim, shape, false);
}

/* Where an F8_E4M3 matrix's scales come from (weight = code x scale):
 *  - DeepSeek: `<w>_scale_inv` [ceil(R / B0), ceil(C / B1)], blocks of weight_block_size (FP8_BLOCKS);
 *  - NVIDIA ModelOpt: `<w>_scale`, a scalar or [1] (quant_algo FP8: FP8_TENSOR), [R] or [R, 1]
 *    (FP8_PER_CHANNEL_PER_TOKEN: FP8_ROWS), [ceil(R / 128), 1, ceil(C / 128), 1] (FP8_PB_WO:
 *    FP8_BLOCKS of 128). Its `<prefix>.input_scale` (a static activation scale) is consumed and not
 *    used: activations are quantized per block of 128 here, dynamically (finer than one scale per
 *    tensor). */
enum { FP8_BLOCKS, FP8_TENSOR, FP8_ROWS };
struct fp8_src {
    struct kr_st_tensor *sc;
    int kind;
    int64_t br, bc;   /* FP8_BLOCKS: the blocks; the scales are [ceil(R / br), ceil(C / bc)] */
};

/* Finds and checks the scales of F8_E4M3 tensor `name` ([R, C], stored as t); marks them used. */
static enum kr_status fp8_scales(struct loader *ld, const struct kr_st_tensor *t, const char *name, int64_t R,
                                 int64_t C, struct fp8_src *s)
{
    const struct kr_model_config *c = &ld->m->cfg;
    char sname[600];
    memset(s, 0, sizeof *s);
    snprintf(sname, sizeof sname, "%s_scale%s", name, c->fp8_modelopt ? "" : "_inv");
    struct kr_st_tensor *sc = find(ld, sname);
    if (!sc) {
        return kr_err_set(ld->err, KR_ERR_FORMAT, "%s: tensor \"%s\" is F8_E4M3 but its scales \"%s\" are missing",
                          t->file->path, t->name, sname);
    }
    if (sc->dtype != KR_DTYPE_F32 && sc->dtype != KR_DTYPE_BF16) {
        return kr_err_set(ld->err, KR_ERR_UNSUPPORTED, "%s: scale tensor \"%s\" has dtype %s, expected F32",
                          sc->file->path, sc->name, kr_dtype_name(sc->dtype));
    }
    int64_t numel = 1;
    for (int i = 0; i < sc->n_dim; i++) {
        numel *= sc->shape[i];
    }
    s->sc = sc;
    if (c->fp8_modelopt) {
        const int64_t ob = (R + 127) / 128, ib = (C + 127) / 128;
        if (numel == 1 && sc->n_dim <= 1) {
            s->kind = FP8_TENSOR;
        } else if ((sc->n_dim == 1 || (sc->n_dim == 2 && sc->shape[1] == 1)) && sc->shape[0] == R) {
            s->kind = FP8_ROWS;
        } else if (sc->n_dim == 4 && sc->shape[0] == ob && sc->shape[1] == 1 && sc->shape[2] == ib &&
                   sc->shape[3] == 1) {
            s->kind = FP8_BLOCKS;
            s->br = s->bc = 128;
        } else {
            char got[128];
            fmt_shape(got, sizeof got, sc->n_dim, sc->shape);
            return kr_err_set(ld->err, KR_ERR_FORMAT,
                              "%s: scale tensor \"%s\" has shape %s; a modelopt FP8 weight [%lld, %lld] takes a "
                              "scalar (per tensor), [%lld] (per channel) or [%lld, 1, %lld, 1] (blocks of 128)",
                              sc->file->path, sc->name, got, (long long)R, (long long)C, (long long)R, (long long)ob,
                              (long long)ib);
        }
        /* the static activation scale: consumed, not used (see above) */
        const size_t wl = strlen(name);
        if (wl > 7 && !strcmp(name + wl - 7, ".weight")) {
            snprintf(sname, sizeof sname, "%.*s.input_scale", (int)(wl - 7), name);
            struct kr_st_tensor *is = find(ld, sname);
            if (is) {
                is->used = true;
            }
        }
    } else {
        s->kind = FP8_BLOCKS;
        s->br = c->fp8_block[0] > 0 ? c->fp8_block[0] : 128;
        s->bc = c->fp8_block[1] > 0 ? c->fp8_block[1] : 128;
        const int64_t sr = (R + s->br - 1) / s->br, scol = (C + s->bc - 1) / s->bc;
        const int64_t want_rows = sc->n_dim == 3 ? sc->shape[1] : sc->n_dim == 2 ? sc->shape[0] : -1;
        const int64_t want_cols = sc->n_dim >= 2 ? sc->shape[sc->n_dim - 1] : -1;
        if (want_rows != sr || want_cols != scol) {
            char got[128];
            fmt_shape(got, sizeof got, sc->n_dim, sc->shape);
            return kr_err_set(ld->err, KR_ERR_FORMAT,
                              "%s: scale tensor \"%s\" has shape %s, expected [%lld, %lld] (%lldx%lld blocks of %s)",
                              sc->file->path, sc->name, got, (long long)sr, (long long)scol, (long long)s->br,
                              (long long)s->bc, t->name);
        }
    }
    sc->used = true;
    return KR_OK;
}

/* Row r's scales, one per column block: out[j] for columns [j * bc, (j + 1) * bc), bc = s->bc for
 * FP8_BLOCKS and all C columns (one value) otherwise; returns the column block width. */
static int64_t fp8_row_scales(const struct fp8_src *s, int64_t r, int64_t C, float *out)
{
    const size_t ssz = kr_dtype_size(s->sc->dtype);
    const char *d = s->sc->data;
    switch (s->kind) {
    case FP8_TENSOR:
        kr_convert_to_f32(out, d, s->sc->dtype, 1);
        return C;
    case FP8_ROWS:
        kr_convert_to_f32(out, d + (size_t)r * ssz, s->sc->dtype, 1);
        return C;
    default: {
        const int64_t scol = (C + s->bc - 1) / s->bc;
        kr_convert_to_f32(out, d + (size_t)((r / s->br) * scol) * ssz, s->sc->dtype, (size_t)scol);
        return s->bc;
    }
    }
}

/* Dequantizes an F8_E4M3 matrix [rows, cols] (a view at `data`) with its scales into a new fp32
 * host buffer (caller frees). */
static enum kr_status dequant_fp8(struct loader *ld, const struct kr_st_tensor *t, const char *name, const void *data,
                                  int64_t rows, int64_t cols, float **out)
{
    struct fp8_src s;
    KR_TRY(fp8_scales(ld, t, name, rows, cols, &s));
    float *w = kr_malloc((size_t)(rows * cols) * sizeof(float));
    float *srow = kr_malloc((size_t)cols * sizeof(float) + sizeof(float));
    if (!w || !srow) {
        kr_free(w);
        kr_free(srow);
        return KR_ERR_NOMEM;
    }
    const unsigned char *q = data;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t bc = fp8_row_scales(&s, r, cols, srow);
        for (int64_t j = 0; j < cols; j++) {
            w[r * cols + j] = kr_e4m3_to_f32(q[r * cols + j]) * srow[j / bc];
        }
    }
    kr_free(srow);
    *out = w;
    return KR_OK;
}

static enum kr_status missing(struct loader *ld, const char *name, const char *what)
{
    return kr_err_set(ld->err, KR_ERR_FORMAT, "%s: missing tensor \"%s\" (%s)", ld->m->dir, name, what);
}

/* The share of a tensor a rank loads (DESIGN.md, Tensor parallelism): up to five row ranges
 * [r0, r0 + nr) concatenated in order (n_rows 0: every row; a vector's rows are its elements),
 * columns [c0, c0 + nc) (nc 0: every column), or nothing at all (`skip`: a row-parallel output's
 * bias, added by rank 0 only). NULL: the whole tensor. */
struct part {
    int n_rows;
    int64_t r0[5], nr[5];
    int64_t c0, nc;
    bool skip;
};

/* Part `pt` of an [R, C] tensor spelled out: its row segments and columns (NULL: all of it). */
static struct part share_of(const struct part *pt, int64_t R, int64_t C)
{
    struct part s = {.n_rows = 1, .nr = {R}, .nc = C};
    if (pt && pt->n_rows) {
        s.n_rows = pt->n_rows;
        memcpy(s.r0, pt->r0, sizeof s.r0);
        memcpy(s.nr, pt->nr, sizeof s.nr);
    }
    if (pt && pt->nc) {
        s.c0 = pt->c0;
        s.nc = pt->nc;
    }
    return s;
}

/* Appends this rank's 1/size of the `total` rows starting at `off` to p. */
static void add_rows(const struct loader *ld, struct part *p, int64_t off, int64_t total)
{
    const int64_t per = total / ld->size;
    p->r0[p->n_rows] = off + ld->rank * per;
    p->nr[p->n_rows] = per;
    p->n_rows++;
}

static struct part rows_share(const struct loader *ld, int64_t total)
{
    struct part p = {0};
    if (ld->size > 1) {
        add_rows(ld, &p, 0, total);
    }
    return p;
}

static struct part cols_share(const struct loader *ld, int64_t total)
{
    struct part p = {0};
    if (ld->size > 1) {
        p.c0 = ld->rank * (total / ld->size);
        p.nc = total / ld->size;
    }
    return p;
}

static struct part rank0_only(const struct loader *ld)
{
    return (struct part){.skip = ld->rank != 0};
}

/* Part `pt` of matrix `t` ([R, C]) kept as FP8 (kr_backend_set_fp8_weights): an FP8 checkpoint's
 * codes as they are with its scales in the block form the products take (DeepSeek's blocks as
 * stored; a ModelOpt per-tensor scale as blocks of 128 x 128 that all hold it, a per-channel one as
 * blocks of 1 row x 128 columns, both exact), any other matrix quantized by the block recipe
 * (kr_fp8_weight_quant). A block-scaled share must consist of whole blocks (a tensor-parallel split
 * that cuts a block is refused). */
static enum kr_status load_fp8_part(struct loader *ld, struct kr_st_tensor *t, const char *name, int64_t R, int64_t C,
                                    const struct part *pt, struct kr_tensor *out)
{
    const struct kr_model_config *c = &ld->m->cfg;
    struct fp8_src fs = {.kind = FP8_BLOCKS, .br = c->fp8_block[0] > 0 ? c->fp8_block[0] : 128,
                         .bc = c->fp8_block[1] > 0 ? c->fp8_block[1] : 128};
    if (t->dtype == KR_DTYPE_F8_E4M3) {
        KR_TRY(fp8_scales(ld, t, name, R, C, &fs));
    }
    /* the block form kept: blocks of B0 x B1 (per channel: rows of their own) */
    const int64_t B0 = fs.kind == FP8_BLOCKS ? fs.br : fs.kind == FP8_ROWS ? 1 : 128;
    const int64_t B1 = fs.kind == FP8_BLOCKS ? fs.bc : 128;
    const struct part sh = share_of(pt, R, C);
    const int n_seg = sh.n_rows;
    const int64_t *r0 = sh.r0, *nr = sh.nr, c0 = sh.c0, nc = sh.nc;
    int64_t rows = 0, srows = 0;
    bool whole = fs.kind != FP8_BLOCKS || (c0 % B1 == 0 && (nc % B1 == 0 || c0 + nc == C));
    for (int i = 0; i < n_seg; i++) {
        whole = whole && (fs.kind != FP8_BLOCKS || (r0[i] % B0 == 0 && (nr[i] % B0 == 0 || r0[i] + nr[i] == R)));
        rows += nr[i];
        srows += (nr[i] + B0 - 1) / B0;
    }
    if (!whole) {
        return kr_err_set(ld->err, KR_ERR_UNSUPPORTED,
                          "%s: FP8 weights are kept in blocks of %lldx%lld, and this rank's share of \"%s\" [%lld, "
                          "%lld] cuts a block (a smaller --tensor-parallel-size, or no --quantization fp8)",
                          t->file->path, (long long)B0, (long long)B1, name, (long long)R, (long long)C);
    }
    const int64_t scols = (nc + B1 - 1) / B1, scol0 = c0 / B1;
    if (kr_backend_is_plan(ld->m->be)) { /* sizes only: codes of a byte, fp32 scales */
        const struct kr_tensor hc = {.dtype = KR_DTYPE_F8_E4M3, .rows = rows, .cols = nc};
        const struct kr_tensor hs = {.dtype = KR_DTYPE_F32, .rows = srows, .cols = scols};
        struct kr_tensor sd;
        struct kr_buf ob;
        KR_TRY(kr_backend_upload(ld->m->be, &hc, false, false, out, &ob));
        KR_TRY(kr_backend_upload(ld->m->be, &hs, true, false, &sd, &ob));
        out->scale = sd.data;
        out->block_r = (int32_t)B0;
        out->block_c = (int32_t)B1;
        out->act_ue8m0 = ld->m->cfg.fp8_ue8m0;
        return KR_OK;
    }
    uint8_t *codes = kr_malloc((size_t)(rows * nc) + 1);
    float *scales = kr_malloc((size_t)(srows * scols) * sizeof(float) + 1);
    float *tmp = NULL;
    enum kr_status st = codes && scales ? KR_OK : KR_ERR_NOMEM;
    if (st == KR_OK && t->dtype == KR_DTYPE_F8_E4M3) {
        float *srow = kr_malloc((size_t)(C + 1) * sizeof(float));
        if (!srow) {
            st = KR_ERR_NOMEM;
        }
        int64_t o = 0, so = 0;
        for (int i = 0; i < n_seg && st == KR_OK; i++) {
            for (int64_t r = r0[i]; r < r0[i] + nr[i]; r++, o++) {
                memcpy(codes + o * nc, (const uint8_t *)t->data + r * C + c0, (size_t)nc);
            }
            /* the share's block rows (its own: a per-tensor scale's share may start anywhere; a
             * block-scaled one starts on a block, checked above): each one's scales for the share's
             * columns, read at the checkpoint row the block row starts at */
            for (int64_t k = 0; k < (nr[i] + B0 - 1) / B0; k++, so++) {
                const int64_t bc = fp8_row_scales(&fs, r0[i] + k * B0, C, srow);
                for (int64_t j = 0; j < scols; j++) {
                    scales[so * scols + j] = bc == C ? srow[0] : srow[scol0 + j];
                }
            }
        }
        kr_free(srow);
    } else if (st == KR_OK) {
        /* the share in fp32, then the recipe; each segment's blocks are quantized on their own so
         * that its block rows start at the segment's first row, as a checkpoint's would */
        const size_t esz = kr_dtype_size(t->dtype);
        int64_t o = 0, so = 0;
        for (int i = 0; i < n_seg && st == KR_OK; i++) {
            kr_free(tmp);
            tmp = kr_malloc((size_t)(nr[i] * nc) * sizeof(float) + 1);
            if (!tmp) {
                st = KR_ERR_NOMEM;
                break;
            }
            /* rows are independent: over every core, as the quantization below (an 8B model's
             * matrices are billions of values) */
            const int64_t seg_rows = nr[i], seg_r0 = r0[i];
#pragma omp parallel for schedule(static) if (seg_rows * nc >= ((int64_t)1 << 20))
            for (int64_t r = 0; r < seg_rows; r++) {
                kr_convert_to_f32(tmp + r * nc, (const char *)t->data + (size_t)((seg_r0 + r) * C + c0) * esz,
                                  t->dtype, (size_t)nc);
            }
            if (nr[i] > 0 && kr_fp8_weight_quant(tmp, nr[i], nc, B0, B1, codes + o * nc, scales + so * scols) != KR_OK) {
                st = kr_err_set(ld->err, KR_ERR_FORMAT, "%s: \"%s\" has values that are not finite", t->file->path, name);
            }
            o += nr[i];
            so += (nr[i] + B0 - 1) / B0;
        }
    }
    kr_free(tmp);
    struct kr_tensor sc_dev = {0};
    if (st == KR_OK) {
        const struct kr_tensor hc = {.data = codes, .dtype = KR_DTYPE_F8_E4M3, .rows = rows, .cols = nc};
        const struct kr_tensor hs = {.data = scales, .dtype = KR_DTYPE_F32, .rows = srows, .cols = scols};
        struct kr_buf oc, os;
        st = kr_backend_upload(ld->m->be, &hc, false, false, out, &oc);
        if (st == KR_OK && (st = own_buf(ld->m, &oc)) == KR_OK &&
            (st = kr_backend_upload(ld->m->be, &hs, true, false, &sc_dev, &os)) == KR_OK) {
            st = own_buf(ld->m, &os);
        }
    }
    kr_free(codes);
    kr_free(scales);
    if (st == KR_OK) {
        out->scale = sc_dev.data;
        out->block_r = (int32_t)B0;
        out->block_c = (int32_t)B1;
        out->act_ue8m0 = ld->m->cfg.fp8_ue8m0; /* the checkpoint's scale_fmt (DeepSeek's linear() quantizes
                                                  every product's activations with it) */
    }
    return st;
}

/* Loads part `pt` of tensor `name` (NULL: all of it). Its stored shape must be `shape` (n_dim
 * dims); [R, C] is its logical matrix shape (a vector: R elements, C = 1; a conv weight: [conv_dim,
 * K]). `vec`: the result is a row vector. `to_f32`: an fp32 copy. F8_E4M3 matrices (when `fp8_ok`)
 * are dequantized with their block scales first. With `optional`, absence leaves *out zeroed. */
static enum kr_status load_part(struct loader *ld, const char *name, int n_dim, const int64_t *shape, int64_t R,
                                int64_t C, const struct part *pt, bool optional, bool fp8_ok, bool to_f32, bool vec,
                                const char *what, struct kr_tensor *out)
{
    memset(out, 0, sizeof *out);
    struct kr_st_tensor *t = find(ld, name);
    if (!t) {
        return optional ? KR_OK : missing(ld, name, what);
    }
    KR_TRY(check_any(ld, t, n_dim, shape, fp8_ok));
    if (pt && pt->skip) {
        return KR_OK;
    }
    /* FP8 weights kept: the checkpoint's FP8 matrices, and every other matrix quantized at load, except
     * in a ModelOpt checkpoint, whose bf16 matrices are the ones its recipe leaves unquantized */
    if (fp8_ok && !to_f32 && !vec && !ld->whole_precision && kr_backend_fp8_weights(ld->m->be) &&
        !(ld->m->cfg.fp8_modelopt && t->dtype != KR_DTYPE_F8_E4M3)) {
        return load_fp8_part(ld, t, name, R, C, pt, out);
    }
    const void *src = t->data;
    enum kr_dtype dt = t->dtype;
    float *deq = NULL;
    const bool plan = kr_backend_is_plan(ld->m->be); /* sizes only: no byte of the weights is read */
    if (dt == KR_DTYPE_F8_E4M3 && plan) {
        struct fp8_src fs;
        KR_TRY(fp8_scales(ld, t, name, R, C, &fs));
        dt = KR_DTYPE_F32; /* dequantized at load */
    } else if (dt == KR_DTYPE_F8_E4M3) {
        KR_TRY(dequant_fp8(ld, t, name, t->data, R, C, &deq));
        src = deq;
        dt = KR_DTYPE_F32;
    }
    const struct part sh = share_of(pt, R, C);
    const int n_seg = sh.n_rows;
    const int64_t *r0 = sh.r0, *nr = sh.nr, c0 = sh.c0, nc = sh.nc;
    int64_t rows = 0;
    for (int i = 0; i < n_seg; i++) {
        if (r0[i] < 0 || nr[i] < 0 || r0[i] + nr[i] > R) {
            kr_free(deq);
            return kr_err_set(ld->err, KR_ERR_INTERNAL, "%s: row share [%lld, +%lld) outside %lld rows", name,
                              (long long)r0[i], (long long)nr[i], (long long)R);
        }
        rows += nr[i];
    }
    if (c0 < 0 || c0 + nc > C) {
        kr_free(deq);
        return kr_err_set(ld->err, KR_ERR_INTERNAL, "%s: column share outside %lld columns", name, (long long)C);
    }
    const size_t esz = kr_dtype_size(dt);
    void *gathered = NULL;
    const void *data = (const char *)src + (size_t)(r0[0] * C) * esz;
    if ((n_seg > 1 || nc != C) && !plan) { /* copy the share's rows (and columns) together */
        gathered = kr_malloc((size_t)(rows * nc) * esz + 1);
        if (!gathered) {
            kr_free(deq);
            return KR_ERR_NOMEM;
        }
        char *o = gathered;
        for (int i = 0; i < n_seg; i++) {
            for (int64_t r = r0[i]; r < r0[i] + nr[i]; r++) {
                memcpy(o, (const char *)src + (size_t)(r * C + c0) * esz, (size_t)nc * esz);
                o += (size_t)nc * esz;
            }
        }
        data = gathered;
    }
    struct kr_tensor host = {.data = data, .dtype = dt, .rows = vec ? 1 : rows, .cols = vec ? rows * nc : nc};
    struct kr_buf owned;
    enum kr_status st = kr_backend_upload(ld->m->be, &host, to_f32, !deq && !gathered, out, &owned);
    kr_free(gathered);
    kr_free(deq);
    return st == KR_OK ? own_buf(ld->m, &owned) : st;
}

/* A 2-D matrix [rows, cols] under `name` (F8_E4M3 accepted), its part `pt`. */
static enum kr_status load_mat_p(struct loader *ld, const char *name, int64_t rows, int64_t cols,
                                 const struct part *pt, bool optional, const char *what, struct kr_tensor *out)
{
    return load_part(ld, name, 2, (const int64_t[]){rows, cols}, rows, cols, pt, optional, true, false, false, what,
                     out);
}

static enum kr_status load_mat(struct loader *ld, const char *name, int64_t rows, int64_t cols, bool optional,
                               const char *what, struct kr_tensor *out)
{
    return load_mat_p(ld, name, rows, cols, NULL, optional, what, out);
}

/* A matrix as an fp32 copy in backend memory (small matrices read per head, e.g. kv_b). */
static enum kr_status load_mat_f32_p(struct loader *ld, const char *name, int64_t rows, int64_t cols,
                                     const struct part *pt, const char *what, struct kr_tensor *out)
{
    return load_part(ld, name, 2, (const int64_t[]){rows, cols}, rows, cols, pt, false, true, true, false, what, out);
}

static enum kr_status load_mat_f32_t(struct loader *ld, const char *name, int64_t rows, int64_t cols,
                                     const char *what, struct kr_tensor *out)
{
    return load_mat_f32_p(ld, name, rows, cols, NULL, what, out);
}

/* A vector stored with shape `shape` (n_dim dims; conv weights [n, 1, K] or [n, K]: n rows of K)
 * as fp32, its part `pt`; *out NULL when optional and absent or skipped. */
static enum kr_status load_vec_shaped_p(struct loader *ld, const char *name, int n_dim, const int64_t *shape,
                                        const struct part *pt, bool optional, const char *what, const float **out)
{
    const int64_t R = shape[0], C = n_dim > 1 ? shape[n_dim - 1] : 1;
    struct kr_tensor t;
    enum kr_status st = load_part(ld, name, n_dim, shape, R, C, pt, optional, false, true, true, what, &t);
    *out = st == KR_OK ? t.data : NULL;
    return st;
}

static enum kr_status load_vec_p(struct loader *ld, const char *name, int64_t n, const struct part *pt,
                                 bool optional, const char *what, const float **out)
{
    return load_vec_shaped_p(ld, name, 1, (const int64_t[]){n}, pt, optional, what, out);
}

static enum kr_status load_vec(struct loader *ld, const char *name, int64_t n, bool optional, const char *what,
                               const float **out)
{
    return load_vec_p(ld, name, n, NULL, optional, what, out);
}

#define NAME(buf, ...) snprintf(buf, sizeof buf, __VA_ARGS__)
/* ---- layers ----------------------------------------------------------------------------------- */

/* Mamba: this rank's heads and groups. in_proj rows [z | x | B | C | dt] and the conv channels
 * [x | B | C] are taken component by component; out_proj by columns; its bias on rank 0. */
static enum kr_status load_mamba(struct loader *ld, const char *base, struct kr_mamba_w *w)
{
    const struct kr_model_config *c = &ld->full;
    const int64_t d = c->m_d_inner, g = c->m_groups * c->m_state, h = c->m_heads;
    struct part in = {0}, conv = {0}, heads = rows_share(ld, h), inner = rows_share(ld, d);
    if (ld->size > 1) {
        add_rows(ld, &in, 0, d);             /* z */
        add_rows(ld, &in, d, d);             /* x */
        add_rows(ld, &in, 2 * d, g);         /* B */
        add_rows(ld, &in, 2 * d + g, g);     /* C */
        add_rows(ld, &in, 2 * d + 2 * g, h); /* dt */
        add_rows(ld, &conv, 0, d);
        add_rows(ld, &conv, d, g);
        add_rows(ld, &conv, d + g, g);
    }
    const struct part out = cols_share(ld, d), out_b = rank0_only(ld);
    char n[512];
    NAME(n, "%sin_proj.weight", base);
    KR_TRY(load_mat_p(ld, n, c->m_in_proj, c->dim, &in, false, "Mamba in_proj [z,x,B,C,dt] x hidden", &w->in_proj));
    NAME(n, "%sin_proj.bias", base);
    KR_TRY(load_vec_p(ld, n, c->m_in_proj, &in, !c->m_proj_bias, "Mamba in_proj bias (use_bias)", &w->in_proj_b));
    NAME(n, "%sconv1d.weight", base);
    if (find(ld, n) && find(ld, n)->n_dim == 2) {
        KR_TRY(load_vec_shaped_p(ld, n, 2, (const int64_t[]){c->m_conv_dim, c->m_conv}, &conv, false, "",
                                 &w->conv_w));
    } else {
        KR_TRY(load_vec_shaped_p(ld, n, 3, (const int64_t[]){c->m_conv_dim, 1, c->m_conv}, &conv, false,
                                 "depthwise conv weight [conv_dim, 1, conv_kernel]", &w->conv_w));
    }
    NAME(n, "%sconv1d.bias", base);
    KR_TRY(load_vec_p(ld, n, c->m_conv_dim, &conv, !c->m_conv_bias, "conv bias (use_conv_bias)", &w->conv_b));
    NAME(n, "%sdt_bias", base);
    KR_TRY(load_vec_p(ld, n, h, &heads, false, "dt_bias [mamba_num_heads]", &w->dt_bias));
    NAME(n, "%sA_log", base);
    KR_TRY(load_vec_p(ld, n, h, &heads, false, "A_log [mamba_num_heads]", &w->A_log));
    NAME(n, "%sD", base);
    KR_TRY(load_vec_p(ld, n, h, &heads, false, "D [mamba_num_heads]", &w->D));
    NAME(n, "%snorm.weight", base);
    KR_TRY(load_vec_p(ld, n, d, &inner, false, "gated RMSNorm weight [d_inner]", &w->norm_w));
    NAME(n, "%sout_proj.weight", base);
    KR_TRY(load_mat_p(ld, n, c->dim, d, &out, false, "Mamba out_proj [hidden, d_inner]", &w->out_proj));
    NAME(n, "%sout_proj.bias", base);
    KR_TRY(load_vec_p(ld, n, c->dim, &out_b, !c->m_proj_bias, "Mamba out_proj bias (use_bias)", &w->out_proj_b));
    return KR_OK;
}

/* GQA: this rank's query heads and KV heads (a KV head serves several ranks when there are
 * fewer KV heads than ranks); o_proj by columns, its bias on rank 0. */
static enum kr_status load_attn(struct loader *ld, const char *base, struct kr_attn_w *w)
{
    const struct kr_model_config *c = &ld->full, *lc = &ld->m->cfg;
    const int64_t q = c->n_head * c->head_dim, kv = c->n_kv_head * c->head_dim;
    struct part qs = rows_share(ld, q), kvs = {0};
    if (ld->size > 1) {
        kvs.n_rows = 1;
        kvs.r0[0] = lc->kv_head0 * c->head_dim;
        kvs.nr[0] = lc->n_kv_head * c->head_dim;
    }
    const struct part os = cols_share(ld, q), ob = rank0_only(ld);
    char n[512];
    NAME(n, "%sq_proj.weight", base);
    KR_TRY(load_mat_p(ld, n, q, c->dim, &qs, false, "attention q_proj", &w->q));
    NAME(n, "%sk_proj.weight", base);
    KR_TRY(load_mat_p(ld, n, kv, c->dim, &kvs, false, "attention k_proj", &w->k));
    NAME(n, "%sv_proj.weight", base);
    KR_TRY(load_mat_p(ld, n, kv, c->dim, &kvs, false, "attention v_proj", &w->v));
    NAME(n, "%so_proj.weight", base);
    KR_TRY(load_mat_p(ld, n, c->dim, q, &os, false, "attention o_proj", &w->o));
    bool opt = !c->attn_bias;
    NAME(n, "%sq_proj.bias", base);
    KR_TRY(load_vec_p(ld, n, q, &qs, opt, "q_proj bias (attention_bias)", &w->q_b));
    NAME(n, "%sk_proj.bias", base);
    KR_TRY(load_vec_p(ld, n, kv, &kvs, opt, "k_proj bias (attention_bias)", &w->k_b));
    NAME(n, "%sv_proj.bias", base);
    KR_TRY(load_vec_p(ld, n, kv, &kvs, opt, "v_proj bias (attention_bias)", &w->v_b));
    NAME(n, "%so_proj.bias", base);
    KR_TRY(load_vec_p(ld, n, c->dim, &ob, opt, "o_proj bias (attention_bias)", &w->o_b));
    /* the FP8 K/V cache scales a ModelOpt export calibrated (`k_proj.k_scale`, or `k_scale` beside
     * the projections), one per tensor; 1 without them */
    w->k_scale = w->v_scale = 1.0f;
    for (int kv_i = 0; kv_i < 2; kv_i++) {
        static const char *const spell[2][2] = {{"k_proj.k_scale", "k_scale"}, {"v_proj.v_scale", "v_scale"}};
        for (int sp = 0; sp < 2; sp++) {
            NAME(n, "%s%s", base, spell[kv_i][sp]);
            struct kr_st_tensor *t = find(ld, n);
            if (!t) {
                continue;
            }
            float v = 0.0f;
            if (t->n_elem != 1 || (t->dtype != KR_DTYPE_F32 && t->dtype != KR_DTYPE_BF16)) {
                return kr_err_set(ld->err, KR_ERR_FORMAT, "%s: \"%s\" must be one F32 value (a K/V cache scale)",
                                  t->file->path, n);
            }
            kr_convert_to_f32(&v, t->data, t->dtype, 1);
            if (!(v > 0.0f) || !isfinite(v)) {
                return kr_err_set(ld->err, KR_ERR_FORMAT, "%s: K/V cache scale \"%s\" is %g (must be positive)",
                                  t->file->path, n, (double)v);
            }
            t->used = true;
            *(kv_i ? &w->v_scale : &w->k_scale) = v;
        }
    }
    return KR_OK;
}

/* MLA/DSA: this rank's heads of the q up projection, kv_b and o_proj; the latent projections,
 * their norms and the indexer are whole on every rank. */
static enum kr_status load_mla(struct loader *ld, const char *base, bool indexer, struct kr_mla_w *w)
{
    const struct kr_model_config *c = &ld->full;
    const int64_t H = c->mla_heads, Dn = c->qk_nope, Dr = c->qk_rope, Dv = c->v_head, Rq = c->q_lora,
                  Rkv = c->kv_lora;
    const struct part qh = rows_share(ld, H * (Dn + Dr)), kvh = rows_share(ld, H * (Dn + Dv)),
                      oh = cols_share(ld, H * Dv);
    char n[512];
    if (Rq) {
        NAME(n, "%sq_a_proj.weight", base);
        KR_TRY(load_mat(ld, n, Rq, c->dim, false, "MLA q down projection [q_lora_rank, hidden]", &w->q_a));
        NAME(n, "%sq_a_layernorm.weight", base);
        KR_TRY(load_vec(ld, n, Rq, true, "", &w->q_a_norm));
        NAME(n, "%sq_b_proj.weight", base);
        KR_TRY(load_mat_p(ld, n, H * (Dn + Dr), Rq, &qh, false,
                     "MLA q up projection [num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank]",
                     &w->q_b));
    } else {
        NAME(n, "%sq_proj.weight", base);
        KR_TRY(load_mat_p(ld, n, H * (Dn + Dr), c->dim, &qh, false,
                     "MLA q projection [num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim), hidden]",
                     &w->q_a));
    }
    NAME(n, "%skv_a_proj_with_mqa.weight", base);
    KR_TRY(load_mat(ld, n, Rkv + Dr, c->dim, false, "MLA kv down projection [kv_lora_rank + qk_rope_head_dim, hidden]",
                 &w->kv_a));
    NAME(n, "%skv_a_layernorm.weight", base);
    KR_TRY(load_vec(ld, n, Rkv, true, "", &w->kv_a_norm));
    NAME(n, "%skv_b_proj.weight", base);
    struct kr_tensor kv_b;
    KR_TRY(load_mat_f32_p(ld, n, H * (Dn + Dv), Rkv, &kvh,
                     "MLA kv up projection [num_attention_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]",
                     &kv_b));
    w->kv_b = kv_b.data;
    NAME(n, "%so_proj.weight", base);
    KR_TRY(load_mat_p(ld, n, c->dim, H * Dv, &oh, false,
                      "MLA output projection [hidden, num_attention_heads * v_head_dim]", &w->o));
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
 * present (gated), biases per mlp_bias. `ffn` is the whole width: a rank takes its share of the
 * up/gate rows and of the down columns; the down bias lives on rank 0. */
static enum kr_status load_mlp(struct loader *ld, const char *base, int64_t d_in, int64_t ffn, int64_t d_out,
                               struct kr_mlp_w *w)
{
    const struct kr_model_config *c = &ld->full;
    const struct part rows = rows_share(ld, ffn), cols = cols_share(ld, ffn), ob = rank0_only(ld);
    char n[512];
    NAME(n, "%sup_proj.weight", base);
    KR_TRY(load_mat_p(ld, n, ffn, d_in, &rows, false, "MLP up_proj", &w->up));
    NAME(n, "%sgate_proj.weight", base);
    KR_TRY(load_mat_p(ld, n, ffn, d_in, &rows, true, "", &w->gate));
    NAME(n, "%sdown_proj.weight", base);
    KR_TRY(load_mat_p(ld, n, d_out, ffn, &cols, false, "MLP down_proj", &w->down));
    NAME(n, "%sup_proj.bias", base);
    KR_TRY(load_vec_p(ld, n, ffn, &rows, !c->mlp_bias, "up_proj bias (mlp_bias)", &w->up_b));
    if (w->gate.data) {
        NAME(n, "%sgate_proj.bias", base);
        KR_TRY(load_vec_p(ld, n, ffn, &rows, !c->mlp_bias, "gate_proj bias (mlp_bias)", &w->gate_b));
    }
    NAME(n, "%sdown_proj.bias", base);
    KR_TRY(load_vec_p(ld, n, d_out, &ob, !c->mlp_bias, "down_proj bias (mlp_bias)", &w->down_b));
    return KR_OK;
}

/* Uploads rows [r0, r0 + rows) and columns [c0, c0 + nc) (nc 0: every column) of expert e of a
 * fused 3-D tensor [E, R, C]: a view of the file when every column is taken, else a copy. */
static enum kr_status upload_expert(struct loader *ld, const struct kr_st_tensor *t, int64_t e, int64_t r0,
                                    int64_t rows, int64_t c0, int64_t nc, struct kr_tensor *out)
{
    const size_t esz = kr_dtype_size(t->dtype);
    const int64_t C = t->shape[2];
    const char *base = (const char *)t->data + (size_t)(e * t->shape[1] * C) * esz;
    if (!nc) {
        c0 = 0;
        nc = C;
    }
    struct kr_tensor host = {.data = base + (size_t)(r0 * C) * esz, .dtype = t->dtype, .rows = rows, .cols = nc};
    char *g = NULL;
    if (nc != C && !kr_backend_is_plan(ld->m->be)) {
        if (!(g = kr_malloc((size_t)(rows * nc) * esz + 1))) {
            return KR_ERR_NOMEM;
        }
        for (int64_t r = 0; r < rows; r++) {
            memcpy(g + (size_t)(r * nc) * esz, base + (size_t)((r0 + r) * C + c0) * esz, (size_t)nc * esz);
        }
        host.data = g;
    }
    struct kr_buf owned;
    enum kr_status st = kr_backend_upload(ld->m->be, &host, false, g == NULL, out, &owned);
    kr_free(g);
    return st == KR_OK ? own_buf(ld->m, &owned) : st;
}

/* Fused expert tensors (transformers 5 layout): gate_up_proj [E, 2F, d] (rows [gate | up]) or
 * up_proj [E, F, d], and down_proj [E, d, F]; a rank takes its share of F in each. */
static enum kr_status load_fused_experts(struct loader *ld, const char *base, int64_t d_e, struct kr_moe_w *w)
{
    const struct kr_model_config *c = &ld->full;
    const int64_t E = c->n_expert, F = c->moe_ffn, Fl = F / ld->size, f0 = ld->rank * Fl;
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
        if (gu) {
            KR_TRY(upload_expert(ld, gu, e, f0, Fl, 0, 0, &w->gate[e]));
            KR_TRY(upload_expert(ld, gu, e, F + f0, Fl, 0, 0, &w->up[e]));
        } else {
            KR_TRY(upload_expert(ld, up, e, f0, Fl, 0, 0, &w->up[e]));
        }
        KR_TRY(upload_expert(ld, down, e, 0, d_e, f0, ld->size > 1 ? Fl : 0, &w->down[e]));
    }
    return KR_OK;
}

static enum kr_status load_moe(struct loader *ld, const char *base, struct kr_moe_w *w)
{
    const struct kr_model_config *c = &ld->full;
    const int64_t E = c->n_expert, F = c->moe_ffn;
    const struct part rows = rows_share(ld, F), cols = cols_share(ld, F);
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
            KR_TRY(load_mat_p(ld, n, F, d_e, &rows, false, "expert up_proj [moe_intermediate_size, d]", &w->up[e]));
            NAME(n, "%sexperts.%lld.down_proj.weight", base, (long long)e);
            KR_TRY(load_mat_p(ld, n, d_e, F, &cols, false, "expert down_proj [d, moe_intermediate_size]",
                              &w->down[e]));
            NAME(n, "%sexperts.%lld.gate_proj.weight", base, (long long)e);
            KR_TRY(load_mat_p(ld, n, F, d_e, &rows, !gated, "expert gate_proj (expert 0 has one)", &w->gate[e]));
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

/* One block of type L->type: its pre-norm `norm` and the mixer under `base` (`indexer`: a D layer with
 * an indexer of its own). */
static enum kr_status load_block(struct loader *ld, struct kr_layer *L, int32_t i, const char *norm,
                                 const char *base, bool indexer)
{
    struct kr_model *m = ld->m;
    const struct kr_model_config *c = &ld->full;
    KR_TRY(load_vec(ld, norm, c->dim, false, "block RMSNorm weight [hidden]", &L->norm));
    switch (L->type) {
    case KR_LAYER_MAMBA:
        L->cache_idx = m->n_mamba++;
        return load_mamba(ld, base, &L->mamba);
    case KR_LAYER_ATTN:
        L->cache_idx = m->n_attn++;
        return load_attn(ld, base, &L->attn);
    case KR_LAYER_MLP:
        return load_mlp(ld, base, c->dim, c->ffn, c->dim, &L->mlp);
    case KR_LAYER_MOE:
        return load_moe(ld, base, &L->moe);
    case KR_LAYER_DSA:
    case KR_LAYER_MLA:
        L->cache_idx = m->n_mla++;
        /* a D layer reusing an earlier layer's top-k (index_topk_freq) has no indexer */
        KR_TRY(load_mla(ld, base, L->type == KR_LAYER_DSA && indexer, &L->mla));
        L->mla.shares_topk = L->type == KR_LAYER_DSA && !L->mla.has_indexer;
        return KR_OK;
    default:
        return kr_err_set(ld->err, KR_ERR_UNSUPPORTED, "%s: layer %d: unsupported layer type '%c'", m->dir, i,
                          (char)L->type);
    }
}

static enum kr_status load_layers(struct loader *ld)
{
    struct kr_model *m = ld->m;
    const struct kr_model_config *c = &ld->full;
    char n[512], base[256];
    for (int32_t i = 0; i < c->n_layer; i++) {
        struct kr_layer *L = &m->layers[i];
        L->type = (enum kr_layer_type)c->pattern[i];
        layer_names(ld, i, n, sizeof n, base, sizeof base);
        KR_TRY(load_block(ld, L, i, n, base, kr_model_config_topk_source(c, i) == i));
        if (ld->progress) {
            ld->progress(ld->progress_user, i + 1, c->n_layer);
        }
    }
    return KR_OK;
}

/* A table the MTP layer may keep a copy of (DeepSeek's embed_tokens and shared_head.head beside the
 * main model's): NULL when absent or byte for byte the main one (marked used: the main one serves),
 * else the tensor, to be loaded as the head's own. */
static struct kr_st_tensor *own_copy(struct loader *ld, const char *name, const char *main_name)
{
    struct kr_st_tensor *t = find(ld, name), *mt = find(ld, main_name);
    if (!t) {
        return NULL;
    }
    if (mt && mt->dtype == t->dtype && mt->nbytes == t->nbytes && !memcmp(mt->data, t->data, t->nbytes)) {
        t->used = true;
        return NULL;
    }
    return t;
}

/* The multi-token-prediction head, as layers n_layer.. of m->layers. Its blocks use the main stack's
 * hyper-parameters, so each kind must occur there; Mamba blocks are refused (drafting keeps no
 * per-token states for them). Two layouts:
 *   hybrid, nested (Megatron, the default model): mtp.layers.0.{enorm, hnorm, eh_proj [hidden,
 *     2 hidden], the blocks under layers.N. (norm, mixer), final_layernorm}; the main embedding and head;
 *   hybrid, flat (Nemotron 3's released checkpoints): block N of the layer is mtp.layers.N.{norm,
 *     mixer}, the first block carries enorm, hnorm and eh_proj, the last final_layernorm; the main
 *     embedding and head;
 *   deepseek_v32: model.layers.{num_hidden_layers}.{enorm, hnorm, eh_proj, input_layernorm, self_attn
 *     (with its indexer), post_attention_layernorm, mlp, shared_head.norm}, with embed_tokens and
 *     shared_head.head: copies of the main tables in released checkpoints (then those serve), or
 *     tables of their own. */
static enum kr_status load_mtp(struct loader *ld)
{
    struct kr_model *m = ld->m;
    const struct kr_model_config *c = &ld->full;
    if (c->n_mtp_layers != 1) {
        return kr_err_set(ld->err, c->n_mtp_layers ? KR_ERR_UNSUPPORTED : KR_ERR_INVAL,
                          "%s: config.json has num_nextn_predict_layers %d: drafting with MTP needs one MTP layer%s",
                          m->dir, c->n_mtp_layers, c->n_mtp_layers ? " (several are not supported yet)" : "");
    }
    if (!c->mtp_pattern[0]) {
        return kr_err_set(ld->err, KR_ERR_FORMAT,
                          "%s: config.json has no mtp_hybrid_override_pattern or mtp_layers_block_type naming the "
                          "MTP layer's blocks", m->dir);
    }
    const int32_t nb = (int32_t)strlen(c->mtp_pattern);
    for (int32_t j = 0; j < nb; j++) {
        const char t = c->mtp_pattern[j];
        if (t == KR_LAYER_MAMBA || !strchr(c->pattern, t)) {
            return kr_err_set(ld->err, KR_ERR_UNSUPPORTED,
                              "%s: the MTP layer's blocks \"%s\": block '%c' %s", m->dir, c->mtp_pattern, t,
                              t == KR_LAYER_MAMBA ? "(Mamba) is not supported in an MTP layer"
                                                  : "does not occur in the main pattern, whose hyper-parameters it uses");
        }
    }
    char n[512], base[256], p[64];
    bool flat = false;
    if (ld->deepseek) {
        NAME(p, "model.layers.%d.", c->n_layer / 2);
    } else {
        NAME(p, "mtp.layers.0.");
        flat = !find(ld, "mtp.layers.0.layers.0.norm.weight") && find(ld, "mtp.layers.0.norm.weight");
    }
    NAME(n, "%senorm.weight", p);
    KR_TRY(load_vec(ld, n, c->dim, false, "MTP embedding RMSNorm weight [hidden]", &m->mtp.enorm));
    NAME(n, "%shnorm.weight", p);
    KR_TRY(load_vec(ld, n, c->dim, false, "MTP hidden-state RMSNorm weight [hidden]", &m->mtp.hnorm));
    NAME(n, "%seh_proj.weight", p);
    const struct part pe = {.c0 = 0, .nc = c->dim}, ph = {.c0 = c->dim, .nc = c->dim};
    KR_TRY(load_mat_p(ld, n, c->dim, 2 * c->dim, &pe, false, "MTP projection [hidden, 2 hidden]", &m->mtp.eh_e));
    KR_TRY(load_mat_p(ld, n, c->dim, 2 * c->dim, &ph, false, "MTP projection [hidden, 2 hidden]", &m->mtp.eh_h));
    if (ld->deepseek) {
        NAME(n, "%sshared_head.norm.weight", p);
    } else if (flat) {
        NAME(n, "mtp.layers.%d.final_layernorm.weight", nb - 1);
    } else {
        NAME(n, "%sfinal_layernorm.weight", p);
    }
    KR_TRY(load_vec(ld, n, c->dim, false, "MTP final RMSNorm weight [hidden]", &m->mtp.final_norm));
    if (ld->deepseek) {
        ld->whole_precision = true; /* as the main tables */
        NAME(n, "%sembed_tokens.weight", p);
        char hn[512];
        NAME(hn, "%sshared_head.head.weight", p);
        const char *main_head = c->tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
        if (ld->size > 1 && (own_copy(ld, n, "model.embed_tokens.weight") || own_copy(ld, hn, main_head))) {
            return kr_err_set(ld->err, KR_ERR_UNSUPPORTED,
                              "%s: the MTP layer's embedding or LM head differs from the main model's, and tables "
                              "of its own are not split across ranks yet (tensor-parallel size %d)",
                              m->dir, (int)ld->size);
        }
        if (own_copy(ld, n, "model.embed_tokens.weight")) {
            KR_TRY(load_mat(ld, n, c->vocab, c->dim, false, "MTP token embedding [vocab, hidden]", &m->mtp.embed));
        }
        NAME(n, "%sshared_head.head.weight", p);
        if (own_copy(ld, n, c->tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight")) {
            KR_TRY(load_mat(ld, n, c->vocab, c->dim, false, "MTP output projection [vocab, hidden]", &m->mtp.head));
        }
        ld->whole_precision = false;
    }
    for (int32_t j = 0; j < nb; j++) {
        struct kr_layer *L = &m->layers[c->n_layer + j];
        L->type = (enum kr_layer_type)c->mtp_pattern[j];
        if (ld->deepseek) { /* the decoder layer's attention half, then its MLP half */
            NAME(n, "%s%s", p, j == 0 ? "input_layernorm.weight" : "post_attention_layernorm.weight");
            NAME(base, "%s%s", p, j == 0 ? "self_attn." : "mlp.");
        } else if (flat) {
            NAME(n, "mtp.layers.%d.norm.weight", j);
            NAME(base, "mtp.layers.%d.mixer.", j);
        } else {
            NAME(n, "%slayers.%d.norm.weight", p, j);
            NAME(base, "%slayers.%d.mixer.", p, j);
        }
        m->n_mtp++; /* freed with the model from here on, loaded or not */
        KR_TRY(load_block(ld, L, c->n_layer + j, n, base, true));
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
        if (ld->m->cfg.fp8_modelopt && len > 8 &&
            (!strcmp(t->name + len - 8, ".k_scale") || !strcmp(t->name + len - 8, ".v_scale"))) {
            KR_LOG_DEBUG("%s: K/V cache scale %s not used (no attention layer reads it)", ld->m->dir, t->name);
            continue;
        }
        /* multi-token-prediction tensors are skipped unless the head was loaded (then every one of
         * them must have been consumed, as the main model's) */
        if (!ld->m->n_mtp && (!strncmp(t->name, "mtp.", 4) || strstr(t->name, ".mtp."))) {
            KR_LOG_DEBUG("skipping multi-token-prediction tensor %s", t->name);
            continue;
        }
        int hf_layer = -1;
        if (!ld->m->n_mtp && ld->deepseek && sscanf(t->name, "model.layers.%d.", &hf_layer) == 1 &&
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
    /* the embedding and the LM head are split by vocabulary rows (the embedding's ranks each give
     * their rows and zeros for the others, summed by an all-reduce) */
    const struct part vocab_rows = rows_share(ld, c->vocab);
    ld->whole_precision = true; /* a table lookup, not a product; the LM head stays as DeepSeek keeps it */
    KR_TRY(load_mat_p(ld, emb->name, c->vocab, c->dim, &vocab_rows, false, "token embedding [vocab, hidden]",
                      &m->embed));
    ld->whole_precision = false;
    m->embed_row0 = ld->size > 1 ? vocab_rows.r0[0] : 0;
    if (ld->deepseek) {
        NAME(n, "model.norm.weight");
    } else {
        NAME(n, "%snorm_f.weight", ld->prefix);
    }
    KR_TRY(load_vec(ld, n, c->dim, false, "final RMSNorm weight [hidden]", &m->final_norm));
    m->layers = kr_calloc((size_t)c->n_layer + KR_MAX_MTP_PATTERN, sizeof *m->layers);
    if (!m->layers) {
        return KR_ERR_NOMEM;
    }
    KR_TRY(load_layers(ld));
    if (c->tie_embeddings) {
        struct kr_st_tensor *lm = find(ld, "lm_head.weight");
        if (lm) { /* some exports keep the tied copy; it must at least have the right shape */
            KR_TRY(check(ld, lm, 2, (const int64_t[]){c->vocab, c->dim}));
        }
        m->lm_head = m->embed; /* the same rows on every rank */
    } else {
        ld->whole_precision = true;
        KR_TRY(load_mat_p(ld, "lm_head.weight", c->vocab, c->dim, &vocab_rows, false,
                          "output projection [vocab, hidden] (tie_word_embeddings is false)", &m->lm_head));
        ld->whole_precision = false;
    }
    if (ld->mtp) {
        KR_TRY(load_mtp(ld));
    }
    if (m->n_mla) {
        struct kr_tensor host = {.data = c->rope_inv_freq, .dtype = KR_DTYPE_F32, .rows = 1, .cols = c->qk_rope / 2}, dev;
        struct kr_buf owned;
        KR_TRY(kr_backend_upload(m->be, &host, true, false, &dev, &owned));
        KR_TRY(own_buf(m, &owned));
        m->rope_inv_freq = dev.data;
    }
    KR_TRY(check_unused(ld));
    KR_TRY(kr_model_set_indexer(m, KR_INDEXER_AUTO, ld->err));
    if (m->n_mtp) {
        KR_LOG_INFO("%s: multi-token-prediction head loaded (blocks %s) for drafting", m->dir, c->mtp_pattern);
    } else if (ld->deepseek && c->n_mtp_layers) {
        KR_LOG_INFO("%s: skipped %d multi-token-prediction layer(s) after layer %d", m->dir, c->n_mtp_layers,
                    c->n_layer / 2 - 1);
    }
    if (kr_backend_fp8_weights(m->be) && c->fp8_modelopt) {
        KR_LOG_INFO("%s: the ModelOpt FP8 matrices kept in FP8 (their per-tensor or per-channel scales as blocks), "
                    "the others in their precision; products quantize their activations per block of 128 "
                    "(dynamically: the checkpoint's static input scales are not used)%s",
                    m->dir, c->fp8_kv_scales ? "; its K/V cache scales serve --kv-cache-dtype fp8" : "");
    } else if (kr_backend_fp8_weights(m->be)) {
        KR_LOG_INFO("%s: matrices %s FP8 in blocks of %dx%d (the embedding and the LM head excepted); products "
                    "quantize their activations per block",
                    m->dir, c->fp8_weights ? "kept in" : "quantized to",
                    (int)(c->fp8_block[0] > 0 ? c->fp8_block[0] : 128), (int)(c->fp8_block[1] > 0 ? c->fp8_block[1] : 128));
    } else if (c->fp8_weights) {
        KR_LOG_INFO("%s: FP8 weights dequantized at load (--quantization fp8 keeps them): the %s backend holds them "
                    "in its weight precision (%s)",
                    m->dir, kr_backend_name(m->be), kr_backend_cache_elt_size(m->be) == 2 ? "bf16" : "fp32");
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
    const struct kr_model_load_opts o = {.progress = cb, .progress_user = user};
    return kr_model_load_opts(dir, be, &o, out, err);
}

enum kr_status kr_model_load_opts(const char *dir, kr_backend_t be, const struct kr_model_load_opts *o,
                                  struct kr_model **out, struct kr_err *err)
{
    struct kr_model *m = kr_calloc(1, sizeof *m);
    if (!m) {
        return kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory while loading", dir);
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
    const struct kr_model_config full = m->cfg;
    if ((st = kr_model_config_shard(&m->cfg, kr_backend_tp_rank(be), kr_backend_tp_size(be), err)) != KR_OK) {
        kr_err_prefix(err, "%s", dir);
        goto fail;
    }
    if ((st = kr_st_open_dir(dir, &m->ar, err)) != KR_OK) {
        goto fail;
    }
    struct loader ld = {.m = m, .full = full, .rank = m->cfg.tp_rank, .size = m->cfg.tp_size, .err = err,
                        .progress = o->progress, .progress_user = o->progress_user, .mtp = o->mtp};
    if ((st = load_all(&ld)) != KR_OK) {
        goto fail;
    }
    if (m->cfg.tp_size > 1) {
        KR_LOG_INFO("loaded %s: model_type=%s layers=%d pattern=%s hidden=%lld vocab=%lld params=%llu backend=%s "
                    "tensor-parallel rank %d of %d",
                    dir, m->cfg.model_type, m->cfg.n_layer, m->cfg.pattern, (long long)m->cfg.dim,
                    (long long)m->cfg.vocab, (unsigned long long)m->n_params, kr_backend_name(be), m->cfg.tp_rank,
                    m->cfg.tp_size);
    } else {
        KR_LOG_INFO("loaded %s: model_type=%s layers=%d pattern=%s hidden=%lld vocab=%lld params=%llu backend=%s",
                    dir, m->cfg.model_type, m->cfg.n_layer, m->cfg.pattern, (long long)m->cfg.dim,
                    (long long)m->cfg.vocab, (unsigned long long)m->n_params, kr_backend_name(be));
    }
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
        for (int32_t i = 0; i < m->cfg.n_layer + m->n_mtp; i++) {
            kr_free(m->layers[i].moe.gate);
            kr_free(m->layers[i].moe.up);
            kr_free(m->layers[i].moe.down);
        }
    }
    for (size_t i = 0; i < m->n_owned; i++) {
        kr_backend_buf_free(m->be, &m->owned[i]);
    }
    kr_backend_buf_free(m->be, &m->work);
    kr_backend_buf_free(m->be, &m->mtp_h);
    kr_backend_buf_free(m->be, &m->mtp_g);
    kr_free(m->pad);
    kr_free(m->owned);
    kr_free(m->layers);
    kr_st_close(m->ar);
    kr_free(m->dir);
    kr_free(m);
}
