/* The multi-token-prediction head of the trained default model (models/small-hybrid, MTP blocks "DE")
 * against an independent reference: tests/fixtures/default/small-hybrid/mtp.json, written by
 * tools/default-model/mtp_reference.py in float64 from the stored bf16 weights with the spec model's
 * mixers (and checked there against the PyTorch training code, 2.3e-5). For each reference prompt
 * of T tokens the main model runs over the prompt, then the head over rows 0..T-2 (row i: the main
 * model's hidden state at i and token i+1), teacher-forced, as the engine runs it after each step:
 * once over the whole prompt, and chunk by chunk (each chunk's head pass right after its forward
 * pass, over that chunk's rows). Compared per row: the largest logit and the log-sum-exp (through
 * them, the log-probability scale), the argmax where the reference's top-2 margin leaves room, and
 * the whole last row of logits. Tolerance: 2e-3 on logits where the head's indexer does not select
 * (T - 1 <= index_topk), 2e-2 where it does (the reference notes that one selection at a relative
 * gap of 5e-5, and one of the main model's at 4e-7, each move the logits by about 0.01 when
 * flipped). Also: the head loads only when asked, its cache rows are counted in a block's bytes, and
 * a pass over a model without the head is refused with a message. */
#include "cache.h"
#include "ckpt-writer.h"
#include "comm.h"
#include "model.h"
#include "safetensors.h"

#include "alloc.h"
#include "json.h"
#include "log.h"

#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#ifndef KR_FIXTURES
#define KR_FIXTURES "tests/fixtures"
#endif

static const char *root(void)
{
    const char *e = getenv("KR_FIXTURES");
    return e && *e ? e : KR_FIXTURES;
}

/* The checkpoint under the fixtures' `rel`, its MTP head too when `mtp`. */
static struct kr_model *load_rel(kr_backend_t be, const char *rel, bool mtp)
{
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/%s", root(), rel);
    struct kr_model *m = NULL;
    struct kr_err err = {0};
    const struct kr_model_load_opts o = {.mtp = mtp};
    cr_assert_eq(kr_model_load_opts(dir, be, &o, &m, &err), KR_OK, "%s: %s", dir, err.msg);
    return m;
}

struct ref {
    int32_t ids[512];
    int32_t n;
    int32_t argmax[512];
    double margin[512], top[512], lse[512];
    double last[8192];
};

static void read_ref(struct ref *r, const struct kr_json *p, int64_t vocab)
{
    const struct kr_json *ids = kr_json_get(p, "ids");
    cr_assert(ids && ids->type == KR_JSON_ARRAY && ids->n <= 512);
    r->n = (int32_t)ids->n;
    for (int32_t i = 0; i < r->n; i++) {
        int64_t v;
        cr_assert(kr_json_as_int(&ids->items[i], &v));
        r->ids[i] = (int32_t)v;
    }
    static const char *const keys[] = {"argmax", "margin", "top_logit", "lse"};
    for (int k = 0; k < 4; k++) {
        const struct kr_json *a = kr_json_get(p, keys[k]);
        cr_assert(a && a->type == KR_JSON_ARRAY && (int32_t)a->n == r->n - 1, "%s", keys[k]);
        for (int32_t i = 0; i < r->n - 1; i++) {
            double v;
            cr_assert(kr_json_as_double(&a->items[i], &v));
            if (k == 0) {
                r->argmax[i] = (int32_t)v;
            } else {
                (k == 1 ? r->margin : k == 2 ? r->top : r->lse)[i] = v;
            }
        }
    }
    const struct kr_json *last = kr_json_get(p, "last_logits");
    cr_assert(last && (int64_t)last->n == vocab && vocab <= 8192);
    for (int64_t j = 0; j < vocab; j++) {
        cr_assert(kr_json_as_double(&last->items[j], &r->last[j]));
    }
}

/* Rows [p0, p1) of one sequence: the main model's forward pass over tokens p0..p1-1, then the head
 * over the rows of that chunk whose next token the prompt gives, logits of every such row to
 * lg + p0 * vocab. */
static void chunk(struct kr_model *m, struct kr_cache *c, struct kr_seq_cache *sc, const struct ref *r, int32_t p0,
                  int32_t p1, float *lg)
{
    const int64_t V = m->cfg.vocab;
    int32_t tok[512], pos[512], out[512], src[512], tok0[2] = {0, p1 - p0}, pos0[1] = {p0}, slot[1] = {sc->slot};
    for (int32_t t = p0; t < p1; t++) {
        tok[t - p0] = r->ids[t];
        pos[t - p0] = t;
    }
    struct kr_err err = {0};
    const struct kr_batch b = {.n_tok = p1 - p0, .n_seq = 1, .tokens = tok, .pos = pos, .seq_tok0 = tok0,
                               .seq_pos0 = pos0, .seq_slot = slot, .block_table = sc->blocks,
                               .max_blocks = sc->n_blocks, .n_out = 0, .out_tok = out};
    cr_assert_eq(kr_model_forward(m, c, &b, NULL, &err), KR_OK, "%s", err.msg);
    const int32_t n = (p1 < r->n - 1 ? p1 : r->n - 1) - p0; /* rows with a next token */
    for (int32_t i = 0; i < n; i++) {
        tok[i] = r->ids[p0 + i + 1];
        out[i] = i;
        src[i] = i;
    }
    tok0[1] = n;
    const struct kr_batch mb = {.n_tok = n, .n_seq = 1, .tokens = tok, .pos = pos, .seq_tok0 = tok0,
                                .seq_pos0 = pos0, .seq_slot = slot, .block_table = sc->blocks,
                                .max_blocks = sc->n_blocks, .n_out = n, .out_tok = out};
    cr_assert_eq(kr_model_mtp_forward(m, c, &mb, &m->mtp_h, true, src, lg + (size_t)p0 * (size_t)V, &err), KR_OK,
                 "%s", err.msg);
}

/* Whether one of the head's blocks has an indexer. */
static bool head_indexes(const struct kr_model *m)
{
    for (int32_t j = 0; j < m->n_mtp; j++) {
        const struct kr_layer *L = &m->layers[m->cfg.n_layer + j];
        if ((L->type == KR_LAYER_DSA || L->type == KR_LAYER_MLA) && L->mla.has_indexer) {
            return true;
        }
    }
    return false;
}

static void compare(const struct kr_model *m, const struct ref *r, const float *lg, const char *what)
{
    const int64_t V = m->cfg.vocab;
    const bool selects = head_indexes(m) && r->n - 1 > m->cfg.idx_topk;
    const double tol = selects ? 2e-2 : 2e-3;
    double worst = 0;
    for (int32_t i = 0; i < r->n - 1; i++) {
        const float *x = lg + (size_t)i * (size_t)V;
        int32_t best = 0;
        double mx = x[0];
        for (int64_t j = 1; j < V; j++) {
            if (x[j] > mx) {
                mx = x[j];
                best = (int32_t)j;
            }
        }
        double s = 0;
        for (int64_t j = 0; j < V; j++) {
            s += exp((double)x[j] - mx);
        }
        const double lse = mx + log(s);
        worst = fmax(worst, fmax(fabs(mx - r->top[i]), fabs(lse - r->lse[i])));
        cr_expect(fabs(mx - r->top[i]) <= tol && fabs(lse - r->lse[i]) <= tol,
                  "%s, T %d, row %d: top logit %.6f, log-sum-exp %.6f; reference %.6f, %.6f (tolerance %g)", what,
                  r->n, i, mx, lse, r->top[i], r->lse[i], tol);
        if (r->margin[i] > 2 * tol) {
            cr_expect_eq(best, r->argmax[i], "%s, T %d, row %d: argmax %d, reference %d (margin %.4f)", what, r->n, i,
                         best, r->argmax[i], r->margin[i]);
        }
    }
    const float *x = lg + (size_t)(r->n - 2) * (size_t)V;
    double d = 0;
    for (int64_t j = 0; j < V; j++) {
        d = fmax(d, fabs((double)x[j] - r->last[j]));
    }
    cr_expect_leq(d, tol, "%s, T %d: the last row's logits differ from the reference by up to %g (tolerance %g)",
                  what, r->n, d, tol);
    fprintf(stderr, "%s, T %d: last row max |d| %.3g, per-row top logit / log-sum-exp max |d| %.3g\n", what, r->n, d, worst);
}

static struct kr_model *load(kr_backend_t be, bool mtp)
{
    return load_rel(be, "default/small-hybrid", mtp);
}

TestSuite(mtp, .timeout = 600);

/* The head of the checkpoint under `rel` against rel/mtp.json, each prompt whole and in chunks of
 * `step` tokens. */
static void head_vs_reference(const char *rel, int32_t step)
{
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    kr_backend_t be = kr_backend_cpu_create(2);
    struct kr_model *m = load_rel(be, rel, true);
    cr_assert_eq(m->n_mtp, 2, "the head's blocks: %d", m->n_mtp);
    m->mtp_keep = true;
    struct kr_err err = {0};
    /* the reference's indexer scores unquantized (an FP8 checkpoint would take the FP8 path) */
    cr_assert_eq(kr_model_set_indexer(m, KR_INDEXER_BF16, &err), KR_OK, "%s", err.msg);
    char path[1024], what[64];
    snprintf(path, sizeof path, "%s/%s/mtp.json", root(), rel);
    struct kr_json *j = NULL;
    cr_assert_eq(kr_json_parse_file(path, &j, &err), KR_OK, "%s", err.msg);
    const struct kr_json *ps = kr_json_get(j, "prompts");
    cr_assert(ps && ps->type == KR_JSON_ARRAY && ps->n >= 3, "%s: no prompts", path);
    struct kr_cache *c = NULL;
    cr_assert_eq(kr_cache_create(m, 2, 64, 16, &c), KR_OK);
    static struct ref r;
    const int64_t V = m->cfg.vocab;
    float *lg = kr_malloc((size_t)512 * (size_t)V * sizeof(float));
    int32_t selecting = 0;
    for (size_t p = 0; p < ps->n; p++) {
        read_ref(&r, &ps->items[p], V);
        selecting += head_indexes(m) && r.n - 1 > m->cfg.idx_topk;
        for (int pass = 0; pass < 2; pass++) {
            struct kr_seq_cache sc;
            cr_assert_eq(kr_seq_cache_init(c, &sc), KR_OK);
            cr_assert_eq(kr_seq_cache_reserve(c, &sc, r.n), KR_OK);
            const int32_t n = pass == 0 ? r.n : step; /* whole, or in chunks */
            for (int32_t p0 = 0; p0 < r.n; p0 += n) {
                chunk(m, c, &sc, &r, p0, p0 + n < r.n ? p0 + n : r.n, lg);
            }
            snprintf(what, sizeof what, "%s, %s", rel, pass == 0 ? "whole prompt" : "chunks");
            compare(m, &r, lg, what);
            kr_seq_cache_release(c, &sc);
        }
    }
    if (head_indexes(m)) {
        cr_expect_gt(selecting, 0, "no prompt is long enough for the head's indexer to select");
    }
    kr_free(lg);
    kr_json_free(j);
    kr_cache_free(c);
    kr_model_free(m);
    kr_backend_free(be);
}

/* The trained default model's head (the hybrid layout, mtp.layers.0.*: D and E blocks, tied head). */
Test(mtp, head_matches_the_float64_reference_whole_and_chunked)
{
    head_vs_reference("default/small-hybrid", 37);
}

/* DeepSeek-V3.2's layout (model.layers.N.*: its attention with an indexer, MoE, shared_head), FP8
 * blocks, with an embedding and a head of its own that differ from the main model's (reference:
 * tools/reference/ds_mtp_reference.py). */
Test(mtp, deepseek_layer_matches_the_float64_reference_whole_and_chunked)
{
    head_vs_reference("deepseek_v32/ds_fp8", 7);
}

/* Nemotron 3's layout (block j of the layer under mtp.layers.j.: GQA attention, then the MoE; the
 * main embedding and head), as config.json's mtp_layers_block_type names it (reference:
 * tools/reference/nh_mtp_reference.py, whose float64 main model matches HF's reference.bin to
 * 4.3e-6). */
Test(mtp, nemotron3_layout_matches_the_float64_reference_whole_and_chunked)
{
    head_vs_reference("nemotron_h/nh_mtp", 23);
}

Test(mtp, loaded_only_when_asked_and_counted_in_the_cache)
{
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    kr_backend_t be = kr_backend_cpu_create(1);
    struct kr_model *plain = load(be, false), *mtp = load(be, true);
    cr_expect_eq(plain->n_mtp, 0);
    cr_expect_eq(mtp->n_mla, plain->n_mla + 1, "the head's D block has a latent cache of its own");
    cr_expect_gt(mtp->n_params, plain->n_params);
    size_t sp, bp, sm, bm;
    kr_cache_unit_bytes(plain, 16, &sp, &bp);
    kr_cache_unit_bytes(mtp, 16, &sm, &bm);
    const struct kr_model_config *c = &plain->cfg;
    cr_expect_eq(sm, sp, "the head keeps no state");
    cr_expect_eq(bm - bp, (size_t)16 * (size_t)(c->kv_lora + c->qk_rope + c->idx_head_dim) * sizeof(float),
                 "a block's bytes grow by the head's latent and index-key rows");
    /* a head pass over the model loaded without it */
    int32_t tok[1] = {5}, pos[1] = {0}, tok0[2] = {0, 1}, pos0[1] = {0}, slot[1] = {0}, bt[1] = {0}, out[1] = {0},
            src[1] = {0};
    const struct kr_batch b = {.n_tok = 1, .n_seq = 1, .tokens = tok, .pos = pos, .seq_tok0 = tok0, .seq_pos0 = pos0,
                               .seq_slot = slot, .block_table = bt, .max_blocks = 1, .n_out = 1, .out_tok = out};
    struct kr_cache *cache = NULL;
    cr_assert_eq(kr_cache_create(plain, 1, 4, 16, &cache), KR_OK);
    struct kr_err err = {0};
    cr_expect_eq(kr_model_mtp_forward(plain, cache, &b, &plain->mtp_h, true, src, NULL, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "no multi-token-prediction head is loaded"), "%s", err.msg);
    kr_cache_free(cache);
    kr_model_free(plain);
    kr_model_free(mtp);
    kr_backend_free(be);
}

/* In the checkpoint of `dir` (one safetensors file), the data of tensor `dst_name` overwritten with
 * that of `src_name` (same dtype and shape). */
static void copy_tensor_data(const char *dir, const char *dst_name, const char *src_name)
{
    struct kr_st_archive *ar = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_st_open_dir(dir, &ar, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(ar->n_files, 1);
    const struct kr_st_tensor *d = kr_st_find(ar, dst_name), *s = kr_st_find(ar, src_name);
    cr_assert(d && s && d->nbytes == s->nbytes && d->dtype == s->dtype, "%s, %s", dst_name, src_name);
    FILE *f = fopen(ar->files[0].path, "r+b");
    cr_assert(f);
    cr_assert_eq(fseek(f, (long)((const char *)d->data - (const char *)ar->files[0].map), SEEK_SET), 0);
    cr_assert_eq(fwrite(s->data, 1, s->nbytes, f), s->nbytes);
    fclose(f);
    kr_st_close(ar);
}

/* DeepSeek-V3.2's MTP layer: loaded only when asked (a plain load skips model.layers.N.*); its
 * embedding and head are tables of its own where they differ from the main ones (the fixture) and
 * the main tables where they are copies (released checkpoints); several MTP layers are refused. */
Test(mtp, deepseek_tables_of_its_own_or_the_main_ones)
{
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    kr_backend_t be = kr_backend_cpu_create(1);
    struct kr_model *plain = load_rel(be, "deepseek_v32/ds_fp8", false), *own = load_rel(be, "deepseek_v32/ds_fp8", true);
    cr_expect_eq(plain->n_mtp, 0);
    cr_expect_eq(own->n_mtp, 2);
    cr_expect_str_eq(own->cfg.mtp_pattern, "DE");
    cr_expect(own->mtp.embed.data && own->mtp.head.data, "the layer's own embedding and head are loaded");
    const uint64_t table = (uint64_t)own->cfg.vocab * (uint64_t)own->cfg.dim;
    char src[1024], dir[1024];
    snprintf(src, sizeof src, "%s/deepseek_v32/ds_fp8", root());
    ckw_tmpdir(dir, sizeof dir);
    ckw_copy_edit(src, dir, NULL, NULL, NULL);
    copy_tensor_data(dir, "model.layers.4.embed_tokens.weight", "model.embed_tokens.weight");
    copy_tensor_data(dir, "model.layers.4.shared_head.head.weight", "lm_head.weight");
    struct kr_model *copies = NULL;
    struct kr_err err = {0};
    const struct kr_model_load_opts o = {.mtp = true};
    cr_assert_eq(kr_model_load_opts(dir, be, &o, &copies, &err), KR_OK, "%s", err.msg);
    cr_expect(!copies->mtp.embed.data && !copies->mtp.head.data, "copies of the main tables are not loaded twice");
    cr_expect_eq(copies->n_params + 2 * table, own->n_params);
    kr_model_free(copies);
    ckw_rmtree(dir);
    /* two MTP layers */
    ckw_tmpdir(dir, sizeof dir);
    ckw_copy_edit(src, dir, "config.json", "\"num_nextn_predict_layers\": 1", "\"num_nextn_predict_layers\": 2");
    cr_expect_neq(kr_model_load_opts(dir, be, &o, &copies, &err), KR_OK);
    cr_expect(strstr(err.msg, "num_nextn_predict_layers 2"), "%s", err.msg);
    ckw_rmtree(dir);
    /* a count no checkpoint has: refused, with or without the head asked for */
    ckw_tmpdir(dir, sizeof dir);
    ckw_copy_edit(src, dir, "config.json", "\"num_nextn_predict_layers\": 1", "\"num_nextn_predict_layers\": 100");
    cr_expect_eq(kr_model_load_opts(dir, be, &o, &copies, &err), KR_ERR_FORMAT);
    cr_expect(strstr(err.msg, "num_nextn_predict_layers") && strstr(err.msg, "outside 0..64"), "%s", err.msg);
    cr_expect_eq(kr_model_load(dir, be, &copies, &err), KR_ERR_FORMAT);
    ckw_rmtree(dir);
    kr_model_free(plain);
    kr_model_free(own);
    kr_backend_free(be);
}

/* The hybrid layouts' config keys: mtp_layers_block_type (Nemotron 3's list of type names) or
 * mtp_hybrid_override_pattern (pattern letters), for the flat layout (mtp.layers.j.*, nh_mtp) and the
 * nested one (mtp.layers.0.layers.j.*, the default model); the two keys must agree where both are
 * given; a Mamba block in the head is refused. */
Test(mtp, nemotron3_config_keys_and_both_hybrid_layouts)
{
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    kr_backend_t be = kr_backend_cpu_create(1);
    struct kr_model *plain = load_rel(be, "nemotron_h/nh_mtp", false), *mtp = load_rel(be, "nemotron_h/nh_mtp", true);
    cr_expect_eq(plain->n_mtp, 0, "mtp.layers.* skipped without the head");
    cr_expect_eq(mtp->n_mtp, 2);
    cr_expect_str_eq(mtp->cfg.mtp_pattern, "*E");
    cr_expect_eq(mtp->n_attn, plain->n_attn + 1, "the head's attention block has a KV cache of its own");
    kr_model_free(plain);
    kr_model_free(mtp);
    char src[1024], dir[1024];
    struct kr_model *m = NULL;
    struct kr_err err = {0};
    const struct kr_model_load_opts o = {.mtp = true};
    /* the nested layout named by the list */
    snprintf(src, sizeof src, "%s/default/small-hybrid", root());
    ckw_tmpdir(dir, sizeof dir);
    ckw_copy_edit(src, dir, "config.json", "\"mtp_hybrid_override_pattern\": \"DE\"",
                  "\"mtp_layers_block_type\": [\"dsa\", \"moe\"]");
    cr_assert_eq(kr_model_load_opts(dir, be, &o, &m, &err), KR_OK, "%s", err.msg);
    cr_expect_str_eq(m->cfg.mtp_pattern, "DE");
    cr_expect_eq(m->n_mtp, 2);
    kr_model_free(m);
    ckw_rmtree(dir);
    /* both keys, disagreeing */
    snprintf(src, sizeof src, "%s/nemotron_h/nh_mtp", root());
    ckw_tmpdir(dir, sizeof dir);
    ckw_copy_edit(src, dir, "config.json", "\"mtp_layers_block_type\": [",
                  "\"mtp_hybrid_override_pattern\": \"E*\", \"mtp_layers_block_type\": [");
    cr_expect_eq(kr_model_load_opts(dir, be, &o, &m, &err), KR_ERR_FORMAT);
    cr_expect(strstr(err.msg, "\"mtp_hybrid_override_pattern\" (E*) and \"mtp_layers_block_type\" (*E) disagree"), "%s",
              err.msg);
    ckw_rmtree(dir);
    /* agreeing: loads */
    ckw_tmpdir(dir, sizeof dir);
    ckw_copy_edit(src, dir, "config.json", "\"mtp_layers_block_type\": [",
                  "\"mtp_hybrid_override_pattern\": \"*E\", \"mtp_layers_block_type\": [");
    cr_expect_eq(kr_model_load_opts(dir, be, &o, &m, &err), KR_OK, "%s", err.msg);
    kr_model_free(m);
    ckw_rmtree(dir);
    /* a Mamba block in the head */
    ckw_tmpdir(dir, sizeof dir);
    ckw_copy_edit(src, dir, "config.json", "\"moe\"\n  ]", "\"mamba\"\n  ]");
    cr_expect_eq(kr_model_load_opts(dir, be, &o, &m, &err), KR_ERR_UNSUPPORTED);
    cr_expect(strstr(err.msg, "(Mamba) is not supported in an MTP layer"), "%s", err.msg);
    ckw_rmtree(dir);
    /* an unknown type name */
    ckw_tmpdir(dir, sizeof dir);
    ckw_copy_edit(src, dir, "config.json", "\"moe\"\n  ]", "\"conv\"\n  ]");
    cr_expect_eq(kr_model_load_opts(dir, be, &o, &m, &err), KR_ERR_UNSUPPORTED);
    cr_expect(strstr(err.msg, "mtp_layers_block_type") && strstr(err.msg, "\"conv\""), "%s", err.msg);
    ckw_rmtree(dir);
    kr_backend_free(be);
}

/* The head split across ranks, as the main stack is (tensor parallelism in one process: a host
 * communicator, a thread per rank): nh_mtp at two ranks, each prompt whole and in chunks, every
 * rank's logits against the float64 reference within the single rank's tolerance, and rank 1's
 * equal to rank 0's (the LM head's gather gives each rank the whole rows). DeepSeek's layer with
 * tables of its own (ds_fp8) is refused at two ranks, saying why. */
struct head_rank {
    kr_backend_t be;
    struct kr_model *m;
    struct kr_cache *c;
    const struct ref *r;
    int32_t step;
    float *lg;
    bool ok;
};

static void *head_rank_main(void *arg)
{
    struct head_rank *k = arg;
    struct kr_seq_cache sc;
    k->ok = kr_seq_cache_init(k->c, &sc) == KR_OK && kr_seq_cache_reserve(k->c, &sc, k->r->n) == KR_OK;
    for (int32_t p0 = 0; k->ok && p0 < k->r->n; p0 += k->step) {
        chunk(k->m, k->c, &sc, k->r, p0, p0 + k->step < k->r->n ? p0 + k->step : k->r->n, k->lg);
    }
    kr_seq_cache_release(k->c, &sc);
    return NULL;
}

Test(mtp, nemotron3_head_split_across_two_ranks_matches_the_float64_reference)
{
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    enum { R = 2 };
    char dir[1024], path[1100], what[96];
    snprintf(dir, sizeof dir, "%s/nemotron_h/nh_mtp", root());
    struct kr_host_comm *comm = NULL;
    cr_assert_eq(kr_host_comm_create(R, &comm), KR_OK);
    struct head_rank k[R] = {0};
    struct kr_err err = {0};
    const struct kr_model_load_opts o = {.mtp = true};
    for (int r = 0; r < R; r++) {
        k[r].be = kr_backend_cpu_create(1);
        cr_assert_eq(kr_backend_set_tp(k[r].be, r, R, comm, &err), KR_OK, "%s", err.msg);
        cr_assert_eq(kr_model_load_opts(dir, k[r].be, &o, &k[r].m, &err), KR_OK, "rank %d: %s", r, err.msg);
        cr_assert_eq(k[r].m->n_mtp, 2);
        k[r].m->mtp_keep = true;
        cr_assert_eq(kr_cache_create(k[r].m, 2, 64, 16, &k[r].c), KR_OK);
    }
    const int64_t V = k[0].m->cfg.vocab;
    snprintf(path, sizeof path, "%s/mtp.json", dir);
    struct kr_json *j = NULL;
    cr_assert_eq(kr_json_parse_file(path, &j, &err), KR_OK, "%s", err.msg);
    const struct kr_json *ps = kr_json_get(j, "prompts");
    cr_assert(ps && ps->type == KR_JSON_ARRAY && ps->n >= 3);
    static struct ref ref;
    for (int r = 0; r < R; r++) {
        k[r].lg = kr_malloc((size_t)512 * (size_t)V * sizeof(float));
        k[r].r = &ref;
    }
    for (size_t p = 0; p < ps->n; p++) {
        read_ref(&ref, &ps->items[p], V);
        for (int pass = 0; pass < 2; pass++) {
            pthread_t th[R];
            for (int r = 0; r < R; r++) {
                k[r].step = pass == 0 ? ref.n : 23;
                cr_assert_eq(pthread_create(&th[r], NULL, head_rank_main, &k[r]), 0);
            }
            for (int r = 0; r < R; r++) {
                pthread_join(th[r], NULL);
                cr_assert(k[r].ok, "rank %d: no cache for the prompt", r);
            }
            for (int r = 0; r < R; r++) {
                snprintf(what, sizeof what, "nh_mtp at %d ranks, rank %d, %s", R, r, pass == 0 ? "whole prompt" : "chunks");
                compare(k[r].m, &ref, k[r].lg, what);
            }
            cr_expect(!memcmp(k[1].lg, k[0].lg, (size_t)(ref.n - 1) * (size_t)V * sizeof(float)),
                      "T %d: rank 1's head logits differ from rank 0's", ref.n);
        }
    }
    kr_json_free(j);
    for (int r = 0; r < R; r++) {
        kr_free(k[r].lg);
        kr_cache_free(k[r].c);
        kr_model_free(k[r].m);
        kr_backend_free(k[r].be);
    }
    kr_host_comm_free(comm);
    /* DeepSeek's layer with an embedding and a head of its own: not split yet, refused */
    snprintf(dir, sizeof dir, "%s/deepseek_v32/ds_fp8", root());
    cr_assert_eq(kr_host_comm_create(R, &comm), KR_OK);
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert_eq(kr_backend_set_tp(be, 0, R, comm, &err), KR_OK, "%s", err.msg);
    struct kr_model *m = NULL;
    cr_expect_eq(kr_model_load_opts(dir, be, &o, &m, &err), KR_ERR_UNSUPPORTED);
    cr_expect(strstr(err.msg, "tables of its own are not split across ranks"), "%s", err.msg);
    kr_backend_free(be);
    kr_host_comm_free(comm);
}
