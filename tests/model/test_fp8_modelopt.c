/* NVIDIA ModelOpt FP8 checkpoints (the form of the Nemotron-H / Nemotron 3 FP8 releases): config.json
 * "quantization_config": {"quant_method": "modelopt", "quant_algo": ..., "kv_cache_quant_algo":
 * "FP8"}; matrices F8_E4M3 with a `weight_scale` (a scalar: quant_algo FP8; [rows]:
 * FP8_PER_CHANNEL_PER_TOKEN; [rows/128, 1, cols/128, 1]: FP8_PB_WO) and an `input_scale`; K/V
 * scales on the attention layers; the matrices the recipe leaves out stored in bf16.
 *
 * The test writes such checkpoints from the HF fixtures, the export read the other way: every
 * `*_proj.weight` matrix but one (kept bf16, as an excluded module) as codes e4m3(w / s) with
 * s = amax / 448 per tensor, row or block. Then:
 *  - the plain load holds every FP8 matrix as exactly code x scale, the code decoded by the format's
 *    definition written here (not the project's decoder);
 *  - kept in FP8 (--quantization fp8), every FP8 matrix multiplies like its dequantized matrix to
 *    fp32 rounding on inputs that the activation quantization keeps (equal magnitudes in a block),
 *    and the excluded matrix stays bf16;
 *  - the log-probabilities of the plain load against HF's for the original bf16 checkpoint move by
 *    the weights' FP8 rounding only: bound MODELOPT_MEAN on the mean |logprob - HF| over the
 *    vocabulary (measured values printed; a scale applied to the wrong tensor or not at all moves
 *    them by O(1), the weights being off by factors of hundreds; measured 0.08-0.22, 2026-12-03);
 *  - the checkpoint's K/V cache scales reach the attention layers, and with --kv-cache-dtype fp8
 *    the cached keys and values lie on the e4m3 grid of those scales;
 *  - what the loader does not know is refused with a message naming it: quant_algo "NVFP4", a
 *    kv_cache_quant_algo other than FP8, a scale of another shape, a missing scale. */
#include "fixture.h"

#include "alloc.h"
#include "fp8.h"
#include "runner.h"
#include "cache.h"
#include "comm.h"
#include "safetensors.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MODELOPT_MEAN 0.3

TestSuite(fp8_modelopt, .timeout = 300);

enum scheme { PER_TENSOR, PER_CHANNEL, BLOCK128 };
static const char *const algo_names[] = {"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"};

/* ---- a small safetensors writer ---- */

struct out_tensor {
    char name[200];
    const char *dtype; /* "BF16", "F32", "F8_E4M3", ... */
    int n_dim;
    int64_t shape[4];
    void *data;        /* owned */
    size_t nbytes;
};

struct out_ckpt {
    struct out_tensor *t;
    int n, cap;
};

static struct out_tensor *out_add(struct out_ckpt *c, const char *name, const char *dtype, int n_dim,
                                  const int64_t *shape, size_t nbytes)
{
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 64;
        c->t = realloc(c->t, (size_t)c->cap * sizeof *c->t);
        cr_assert(c->t);
    }
    struct out_tensor *t = &c->t[c->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dtype = dtype;
    t->n_dim = n_dim;
    if (n_dim > 0) {
        memcpy(t->shape, shape, (size_t)n_dim * sizeof *shape);
    }
    t->data = calloc(1, nbytes + 1);
    t->nbytes = nbytes;
    cr_assert(t->data);
    return t;
}

static void out_write(const struct out_ckpt *c, const char *path)
{
    size_t cap = 4096 + (size_t)c->n * 300, len = 0, off = 0;
    char *h = malloc(cap);
    cr_assert(h);
    len += (size_t)snprintf(h + len, cap - len, "{");
    for (int i = 0; i < c->n; i++) {
        const struct out_tensor *t = &c->t[i];
        len += (size_t)snprintf(h + len, cap - len, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[", i ? "," : "", t->name,
                                t->dtype);
        for (int d = 0; d < t->n_dim; d++) {
            len += (size_t)snprintf(h + len, cap - len, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        }
        len += (size_t)snprintf(h + len, cap - len, "],\"data_offsets\":[%zu,%zu]}", off, off + t->nbytes);
        off += t->nbytes;
    }
    len += (size_t)snprintf(h + len, cap - len, "}");
    while (len % 8) {
        h[len++] = ' ';
    }
    FILE *f = fopen(path, "wb");
    cr_assert(f, "cannot write %s", path);
    const uint64_t hl = len;
    fwrite(&hl, 8, 1, f);
    fwrite(h, 1, len, f);
    for (int i = 0; i < c->n; i++) {
        fwrite(c->t[i].data, 1, c->t[i].nbytes, f);
    }
    fclose(f);
    free(h);
}

static void out_free(struct out_ckpt *c)
{
    for (int i = 0; i < c->n; i++) {
        free(c->t[i].data);
    }
    free(c->t);
}

static bool ends_with(const char *s, const char *suf)
{
    const size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

static void copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    cr_assert(a && b, "copy %s -> %s", from, to);
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, a)) > 0) {
        cr_assert_eq(fwrite(buf, 1, n, b), n);
    }
    fclose(a);
    fclose(b);
}

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot read %s", path);
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    cr_assert(s && fread(s, 1, (size_t)n, f) == (size_t)n);
    s[n] = 0;
    fclose(f);
    return s;
}

/* The converted fixture: root/<family>/<name> holds the checkpoint and the original's HF references. */
struct conv {
    char root[256], dir[512];
    char excluded[200];   /* the matrix left in bf16 */
    int n_fp8;
};

/* Writes fixture family/name as a ModelOpt FP8 checkpoint of `scheme` under a fresh root.
 * `quant_algo`, `kv_algo`: the config's strings (NULL: the scheme's / "FP8"). `bad_scale`: give the
 * first FP8 matrix a scale of a wrong shape; `drop_scale`: leave its scale out. */
static void convert(struct conv *cv, const char *family, const char *name, enum scheme scheme, const char *quant_algo,
                    const char *kv_algo, bool bad_scale, bool drop_scale)
{
    memset(cv, 0, sizeof *cv);
    snprintf(cv->root, sizeof cv->root, "/tmp/krait-modelopt-XXXXXX");
    cr_assert(mkdtemp(cv->root));
    char p[700];
    snprintf(p, sizeof p, "%s/%s", cv->root, family);
    cr_assert_eq(mkdir(p, 0755), 0);
    snprintf(cv->dir, sizeof cv->dir, "%s/%s/%s", cv->root, family, name);
    cr_assert_eq(mkdir(cv->dir, 0755), 0);
    char src[600];
    snprintf(src, sizeof src, "%s/%s/%s", fx_root(), family, name);
    struct kr_st_archive *ar = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_st_open_dir(src, &ar, &err), KR_OK, "%s", err.msg);
    struct out_ckpt oc = {0};
    bool excluded = false;
    for (size_t i = 0; i < ar->n_tensors; i++) {
        const struct kr_st_tensor *t = &ar->tensors[i];
        const bool mat = t->n_dim == 2 && ends_with(t->name, "_proj.weight") &&
                         (t->dtype == KR_DTYPE_BF16 || t->dtype == KR_DTYPE_F32 || t->dtype == KR_DTYPE_F16);
        bool quantize = mat;
        if (mat && !excluded && ends_with(t->name, "o_proj.weight")) { /* an excluded module: stays bf16 */
            excluded = true;
            quantize = false;
            snprintf(cv->excluded, sizeof cv->excluded, "%s", t->name);
        }
        if (quantize) {
            const int64_t R = t->shape[0], C = t->shape[1];
            float *w = malloc((size_t)(R * C) * sizeof(float));
            cr_assert(w);
            kr_convert_to_f32(w, t->data, t->dtype, (size_t)(R * C));
            /* the scales: per tensor, row or 128 x 128 block */
            const int64_t ob = (R + 127) / 128, ib = (C + 127) / 128;
            const int64_t ns = scheme == PER_TENSOR ? 1 : scheme == PER_CHANNEL ? R : ob * ib;
            float *s = calloc((size_t)ns, sizeof(float));
            cr_assert(s);
            for (int64_t r = 0; r < R; r++) {
                for (int64_t c = 0; c < C; c++) {
                    const int64_t k = scheme == PER_TENSOR ? 0 : scheme == PER_CHANNEL ? r : (r / 128) * ib + c / 128;
                    s[k] = fmaxf(s[k], fabsf(w[r * C + c]));
                }
            }
            for (int64_t k = 0; k < ns; k++) {
                s[k] = fmaxf(s[k], 1e-12f) / 448.0f;
            }
            struct out_tensor *q = out_add(&oc, t->name, "F8_E4M3", 2, (int64_t[]){R, C}, (size_t)(R * C));
            for (int64_t r = 0; r < R; r++) {
                for (int64_t c = 0; c < C; c++) {
                    const int64_t k = scheme == PER_TENSOR ? 0 : scheme == PER_CHANNEL ? r : (r / 128) * ib + c / 128;
                    ((uint8_t *)q->data)[r * C + c] = kr_fp8_e4m3_from_f32(w[r * C + c] / s[k]);
                }
            }
            const bool first = cv->n_fp8 == 0;
            cv->n_fp8++;
            char sn[240];
            snprintf(sn, sizeof sn, "%s_scale", t->name);
            if (!(first && drop_scale)) {
                struct out_tensor *st;
                if (first && bad_scale) {
                    st = out_add(&oc, sn, "F32", 1, (int64_t[]){2}, 8);
                } else if (scheme == PER_TENSOR) {
                    st = out_add(&oc, sn, "F32", 0, NULL, 4);
                } else if (scheme == PER_CHANNEL) {
                    st = out_add(&oc, sn, "F32", 1, (int64_t[]){R}, (size_t)R * 4);
                } else {
                    st = out_add(&oc, sn, "F32", 4, (int64_t[]){ob, 1, ib, 1}, (size_t)(ob * ib) * 4);
                }
                memcpy(st->data, s, st->nbytes < (size_t)ns * 4 ? st->nbytes : (size_t)ns * 4);
            }
            /* the static activation scale ModelOpt exports */
            const size_t pl = strlen(t->name) - strlen(".weight");
            snprintf(sn, sizeof sn, "%.*s.input_scale", (int)pl, t->name);
            struct out_tensor *is = out_add(&oc, sn, "F32", 0, NULL, 4);
            const float one = 0.05f;
            memcpy(is->data, &one, 4);
            /* K/V cache scales on the attention projections */
            if (ends_with(t->name, "k_proj.weight") || ends_with(t->name, "v_proj.weight")) {
                snprintf(sn, sizeof sn, "%.*s.%c_scale", (int)pl, t->name, ends_with(t->name, "k_proj.weight") ? 'k' : 'v');
                struct out_tensor *kv = out_add(&oc, sn, "F32", 0, NULL, 4);
                memcpy(kv->data, &one, 4);
            }
            free(w);
            free(s);
        } else {
            static const char *const names[] = {[KR_DTYPE_F32] = "F32", [KR_DTYPE_F16] = "F16",
                                                [KR_DTYPE_BF16] = "BF16", [KR_DTYPE_F8_E4M3] = "F8_E4M3",
                                                [KR_DTYPE_I32] = "I32", [KR_DTYPE_I64] = "I64"};
            struct out_tensor *o = out_add(&oc, t->name, names[t->dtype], t->n_dim, t->shape, t->nbytes);
            memcpy(o->data, t->data, t->nbytes);
        }
    }
    cr_assert(excluded && cv->n_fp8 > 0, "%s: no o_proj to leave in bf16, or no matrix to quantize", name);
    snprintf(p, sizeof p, "%s/model.safetensors", cv->dir);
    out_write(&oc, p);
    out_free(&oc);
    kr_st_close(ar);
    /* config.json with the quantization_config; the HF references of the original */
    snprintf(p, sizeof p, "%s/config.json", src);
    char *cfg = read_text(p);
    char *brace = strchr(cfg, '{');
    cr_assert(brace);
    snprintf(p, sizeof p, "%s/config.json", cv->dir);
    FILE *f = fopen(p, "w");
    cr_assert(f);
    fprintf(f, "{\"quantization_config\": {\"quant_method\": \"modelopt\", \"quant_algo\": \"%s\"",
            quant_algo ? quant_algo : algo_names[scheme]);
    fprintf(f, ", \"kv_cache_quant_algo\": \"%s\", \"ignore\": [\"%s\"]},%s", kv_algo ? kv_algo : "FP8", cv->excluded,
            brace + 1);
    fclose(f);
    free(cfg);
    static const char *const refs[] = {"reference.json", "reference.bin"};
    for (int i = 0; i < 2; i++) {
        char a[700], b[700];
        snprintf(a, sizeof a, "%s/%s", src, refs[i]);
        snprintf(b, sizeof b, "%s/%s", cv->dir, refs[i]);
        copy_file(a, b);
    }
}

static void conv_free(struct conv *cv)
{
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", cv->root);
    cr_expect_eq(system(cmd), 0);
}

/* The FP8 matrices of the checkpoint in `dir`, with their dequantized values by this file's
 * definition (code x scale); returns how many were checked against `m`'s plain load. */
static int check_plain_weights(const struct conv *cv, const struct kr_model *m, enum scheme scheme)
{
    struct kr_st_archive *ar = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_st_open_dir(cv->dir, &ar, &err), KR_OK, "%s", err.msg);
    /* the loaded matrices, by the loader's order: compare through the products of the CPU backend on
     * unit vectors would be slow; instead each FP8 tensor's dequantized values must appear as some
     * loaded fp32 matrix of the same shape, element for element */
    int checked = 0;
    for (size_t i = 0; i < ar->n_tensors; i++) {
        const struct kr_st_tensor *t = &ar->tensors[i];
        if (t->dtype != KR_DTYPE_F8_E4M3) {
            continue;
        }
        char sn[240];
        snprintf(sn, sizeof sn, "%s_scale", t->name);
        const struct kr_st_tensor *s = kr_st_find(ar, sn);
        cr_assert(s);
        const int64_t R = t->shape[0], C = t->shape[1], ib = (C + 127) / 128;
        /* find the loaded tensor with these values: search the layers' matrices by shape and first row */
        const float *hit = NULL;
        for (int32_t l = 0; l < m->cfg.n_layer && !hit; l++) {
            const struct kr_layer *L = &m->layers[l];
            const struct kr_tensor *cand[] = {&L->mamba.in_proj, &L->mamba.out_proj, &L->attn.q, &L->attn.k,
                                              &L->attn.v, &L->attn.o, &L->mlp.up, &L->mlp.down, &L->mlp.gate,
                                              &L->moe.shared.up, &L->moe.shared.down};
            for (size_t k = 0; k < sizeof cand / sizeof cand[0] && !hit; k++) {
                if (cand[k]->data && cand[k]->dtype == KR_DTYPE_F32 && cand[k]->rows == R && cand[k]->cols == C) {
                    const float *d = cand[k]->data, *sv = s->data;
                    bool same = true;
                    for (int64_t c = 0; c < C && same; c++) { /* row 0: its scale, or its blocks' */
                        const float sc = scheme == BLOCK128 ? sv[c / 128] : sv[0];
                        same = (float)(fx_e4m3(((const uint8_t *)t->data)[c]) * sc) == d[c];
                    }
                    hit = same ? d : NULL;
                }
            }
            for (int64_t e = 0; L->moe.up && e < m->cfg.n_expert && !hit; e++) {
                const struct kr_tensor *ex[] = {&L->moe.up[e], &L->moe.down[e]};
                for (int k = 0; k < 2 && !hit; k++) {
                    if (ex[k]->data && ex[k]->dtype == KR_DTYPE_F32 && ex[k]->rows == R && ex[k]->cols == C) {
                        const float *d = ex[k]->data, *sv = s->data;
                        bool same = true;
                        for (int64_t c = 0; c < C && same; c++) {
                            const float sc = scheme == BLOCK128 ? sv[c / 128] : sv[0];
                            same = (float)(fx_e4m3(((const uint8_t *)t->data)[c]) * sc) == d[c];
                        }
                        hit = same ? d : NULL;
                    }
                }
            }
        }
        cr_assert(hit, "%s: no loaded matrix holds its dequantized first row", t->name);
        int64_t bad = 0;
        const float *sv = s->data;
        for (int64_t r = 0; r < R; r++) {
            for (int64_t c = 0; c < C; c++) {
                const float sc = scheme == PER_TENSOR ? sv[0] : scheme == PER_CHANNEL ? sv[r] : sv[(r / 128) * ib + c / 128];
                bad += (float)(fx_e4m3(((const uint8_t *)t->data)[r * C + c]) * sc) != hit[r * C + c];
            }
        }
        cr_expect_eq(bad, 0, "%s: %lld elements are not code x scale", t->name, (long long)bad);
        checked++;
    }
    kr_st_close(ar);
    return checked;
}

static void run_scheme(const char *family, const char *name, enum scheme scheme)
{
    struct conv cv;
    convert(&cv, family, name, scheme, NULL, NULL, false, false);
    cr_assert_eq(setenv("KR_FIXTURES", cv.root, 1), 0);
    /* plain: dequantized at load (fp32 on the CPU backend) */
    struct fx f;
    fx_load(&f, family, name, 2, 2);
    cr_assert(f.m->cfg.fp8_weights && f.m->cfg.fp8_modelopt);
    const int checked = check_plain_weights(&cv, f.m, scheme);
    cr_expect_eq(checked, cv.n_fp8, "%d of %d FP8 matrices checked", checked, cv.n_fp8);
    struct kr_err err = {0};
    double worst = 0;
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        const size_t nv = (size_t)p->n * (size_t)f.vocab;
        float *lp = kr_malloc(nv * sizeof(float));
        cr_assert(lp);
        cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, 0, lp, &err), KR_OK, "%s", err.msg);
        double sum = 0;
        for (size_t k = 0; k < nv; k++) {
            sum += fabs((double)lp[k] - (double)p->logprobs[k]);
        }
        const double mean = sum / (double)nv;
        worst = mean > worst ? mean : worst;
        fprintf(stderr, "  %-18s %-26s prompt %d (len %3d): mean |lp - HF(bf16)| %.4f\n", name, algo_names[scheme], i,
                p->n, mean);
        cr_expect_leq(mean, MODELOPT_MEAN, "%s %s prompt %d: mean |logprob - HF| %g", name, algo_names[scheme], i, mean);
        kr_free(lp);
    }
    /* the calibrated K/V cache scales reach the attention layers, and with --kv-cache-dtype fp8 the
     * cached keys and values lie on the e4m3 grid of those scales */
    int attn = 0;
    for (int32_t l = 0; l < f.m->cfg.n_layer; l++) {
        if (f.m->layers[l].type == KR_LAYER_ATTN) {
            attn++;
            cr_expect_eq(f.m->layers[l].attn.k_scale, 0.05f);
            cr_expect_eq(f.m->layers[l].attn.v_scale, 0.05f);
        }
    }
    cr_assert_gt(attn, 0);
    cr_assert_eq(kr_model_set_kv_cache_dtype(f.m, KR_KV_CACHE_FP8, &err), KR_OK, "%s", err.msg);
    {
        const struct fx_prompt *p = &f.prompts[f.n_prompts - 1];
        float *lp = kr_malloc((size_t)p->n * (size_t)f.vocab * sizeof(float));
        cr_assert(lp);
        cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, 0, lp, &err), KR_OK, "%s", err.msg);
        kr_free(lp);
        const int64_t nk = (int64_t)f.c->n_blocks * f.c->block_size * f.m->cfg.n_kv_head * f.m->cfg.head_dim;
        int64_t off = 0, nonzero = 0;
        for (int32_t l = 0; l < f.m->n_attn; l++) {
            const float *k = kr_cache_k_layer(f.c, l), *v = kr_cache_v_layer(f.c, l);
            for (int64_t i = 0; i < nk; i++) {
                const double qk = k[i] / 0.05, qv = v[i] / 0.05;
                off += fabs(qk) > 448.5 || fabs(qv) > 448.5 || (float)(fx_e4m3_nearest(qk) * 0.05f) != k[i] ||
                       (float)(fx_e4m3_nearest(qv) * 0.05f) != v[i];
                nonzero += k[i] != 0;
            }
        }
        fprintf(stderr, "  %-18s %-26s FP8 K/V cache with the checkpoint's scales: %lld values off their grid (%lld "
                        "non-zero keys)\n", name, algo_names[scheme], (long long)off, (long long)nonzero);
        cr_expect_eq(off, 0);
        cr_expect_gt(nonzero, 0);
    }
    /* kept in FP8: every FP8 matrix multiplies like the plain load's, the excluded one stays bf16 */
    kr_backend_t be = kr_backend_cpu_create(2);
    cr_assert_eq(kr_backend_set_fp8_weights(be, true, &err), KR_OK, "%s", err.msg);
    struct kr_model *k = NULL;
    cr_assert_eq(kr_model_load(cv.dir, be, &k, &err), KR_OK, "%s", err.msg);
    int kept = 0, bf16 = 0;
    for (int32_t l = 0; l < k->cfg.n_layer; l++) {
        const struct kr_layer *A = &k->layers[l], *B = &f.m->layers[l];
        const struct kr_tensor *ka[] = {&A->mamba.in_proj, &A->mamba.out_proj, &A->attn.q, &A->attn.k, &A->attn.v,
                                        &A->attn.o, &A->mlp.up, &A->mlp.down, &A->moe.shared.up, &A->moe.shared.down};
        const struct kr_tensor *kb[] = {&B->mamba.in_proj, &B->mamba.out_proj, &B->attn.q, &B->attn.k, &B->attn.v,
                                        &B->attn.o, &B->mlp.up, &B->mlp.down, &B->moe.shared.up, &B->moe.shared.down};
        for (size_t j = 0; j < sizeof ka / sizeof ka[0]; j++) {
            if (!ka[j]->data) {
                continue;
            }
            if (ka[j]->dtype != KR_DTYPE_F8_E4M3) {
                bf16++;
                continue;
            }
            kept++;
            cr_expect_eq(ka[j]->block_c, 128);
            cr_expect_eq(ka[j]->block_r, scheme == PER_CHANNEL ? 1 : 128);
            const int64_t n = 3, R = ka[j]->rows, C = ka[j]->cols;
            float *x = kr_malloc((size_t)(n * C) * 4), *y1 = kr_malloc((size_t)(n * R) * 4),
                  *y2 = kr_malloc((size_t)(n * R) * 4);
            cr_assert(x && y1 && y2);
            for (int64_t e = 0; e < n * C; e++) {
                x[e] = ((e * 7919) % 3 == 0 ? -1.0f : 1.0f) * 0.5f; /* equal magnitudes: quantized exactly */
            }
            cr_assert_eq(kr_backend_matmul(be, x, C, n, ka[j], NULL, y1, R, NULL), KR_OK);
            cr_assert_eq(kr_backend_matmul(f.be, x, C, n, kb[j], NULL, y2, R, NULL), KR_OK);
            double mag = 0, diff = 0;
            for (int64_t e = 0; e < n * R; e++) {
                mag = fmax(mag, fabs(y2[e]));
                diff = fmax(diff, fabs((double)y1[e] - (double)y2[e]));
            }
            cr_expect_leq(diff, 1e-5 * (mag + 1e-30), "layer %d matrix %zu: kept FP8 product differs by %g (of %g)", l,
                          j, diff, mag);
            kr_free(x);
            kr_free(y1);
            kr_free(y2);
        }
    }
    fprintf(stderr, "  %-18s %-26s kept in FP8: %d matrices (products as the dequantized ones), %d in bf16\n", name,
            algo_names[scheme], kept, bf16);
    cr_expect_gt(kept, 0);
    cr_expect_geq(bf16, 1, "the excluded %s must stay bf16", cv.excluded);
    kr_model_free(k);
    kr_backend_free(be);
    fx_free(&f);
    conv_free(&cv);
}

Test(fp8_modelopt, per_tensor_scales)
{
    run_scheme("nemotron_h", "nh_mamba_attn_mlp", PER_TENSOR);
}

Test(fp8_modelopt, per_channel_scales)
{
    run_scheme("nemotron_h", "nh_mamba_attn_mlp", PER_CHANNEL);
}

Test(fp8_modelopt, block_scales)
{
    run_scheme("nemotron_h", "nh_mamba_attn_mlp", BLOCK128);
}

/* MoE: the experts' and the shared expert's matrices in FP8 too. */
Test(fp8_modelopt, moe_per_tensor_scales)
{
    run_scheme("nemotron_h", "nh_moe", PER_TENSOR);
}

static void expect_refused(const char *quant_algo, const char *kv_algo, bool bad_scale, bool drop_scale,
                           const char *needle)
{
    struct conv cv;
    convert(&cv, "nemotron_h", "nh_mamba_attn_mlp", PER_TENSOR, quant_algo, kv_algo, bad_scale, drop_scale);
    kr_backend_t be = kr_backend_cpu_create(1);
    struct kr_err err = {0};
    struct kr_model *m = NULL;
    const enum kr_status st = kr_model_load(cv.dir, be, &m, &err);
    cr_expect_neq(st, KR_OK, "a checkpoint with %s loaded", needle);
    cr_expect(strstr(err.msg, needle) != NULL, "the message names %s: %s", needle, err.msg);
    fprintf(stderr, "  refused: %s\n", err.msg);
    kr_model_free(m);
    kr_backend_free(be);
    conv_free(&cv);
}

Test(fp8_modelopt, what_is_not_known_is_refused_by_name)
{
    expect_refused("NVFP4", NULL, false, false, "NVFP4");
    expect_refused(NULL, "INT8", false, false, "INT8");
    expect_refused(NULL, NULL, true, false, "_scale");
    expect_refused(NULL, NULL, false, true, "_scale");
}

/* Kept in FP8 at tensor-parallel size 2: a per-tensor scale serves shares that start anywhere (the
 * GQA and Mamba shares of these 64-wide models do not start on a 128-row block); each rank's scales
 * hold the tensor's one value in every block. */
Test(fp8_modelopt, per_tensor_scales_at_two_ranks)
{
    struct conv cv;
    convert(&cv, "nemotron_h", "nh_mamba_attn_mlp", PER_TENSOR, NULL, NULL, false, false);
    struct kr_host_comm *comm = NULL;
    cr_assert_eq(kr_host_comm_create(2, &comm), KR_OK);
    struct kr_st_archive *ar = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_st_open_dir(cv.dir, &ar, &err), KR_OK, "%s", err.msg);
    int checked = 0;
    for (int r = 0; r < 2; r++) {
        kr_backend_t be = kr_backend_cpu_create(1);
        cr_assert_eq(kr_backend_set_tp(be, r, 2, comm, &err), KR_OK, "%s", err.msg);
        cr_assert_eq(kr_backend_set_fp8_weights(be, true, &err), KR_OK, "%s", err.msg);
        struct kr_model *m = NULL;
        cr_assert_eq(kr_model_load(cv.dir, be, &m, &err), KR_OK, "rank %d: %s", r, err.msg);
        char n[256];
        for (int32_t l = 0; l < m->cfg.n_layer; l++) {
            const struct kr_tensor *t = m->layers[l].type == KR_LAYER_MAMBA ? &m->layers[l].mamba.in_proj
                                        : m->layers[l].type == KR_LAYER_ATTN ? &m->layers[l].attn.k
                                                                               : NULL;
            if (!t || t->dtype != KR_DTYPE_F8_E4M3) {
                continue;
            }
            snprintf(n, sizeof n, "backbone.layers.%d.mixer.%s_scale", l,
                     m->layers[l].type == KR_LAYER_MAMBA ? "in_proj.weight" : "k_proj.weight");
            const struct kr_st_tensor *s = kr_st_find(ar, n);
            cr_assert(s, "%s", n);
            const float want = *(const float *)s->data;
            const int64_t nb = ((t->rows + t->block_r - 1) / t->block_r) * ((t->cols + t->block_c - 1) / t->block_c);
            for (int64_t b = 0; b < nb; b++) {
                cr_expect_eq(t->scale[b], want, "rank %d %s block %lld", r, n, (long long)b);
            }
            checked++;
        }
        kr_model_free(m);
        kr_backend_free(be);
    }
    cr_expect_gt(checked, 0);
    kr_st_close(ar);
    kr_host_comm_free(comm);
    conv_free(&cv);
}
