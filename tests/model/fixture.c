#include "fixture.h"

#include "alloc.h"
#include "json.h"
#include "runner.h"
#include "sampler.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float *read_bin(const char *path, size_t *n_bytes)
{
    FILE *fp = fopen(path, "rb");
    cr_assert(fp, "cannot open %s", path);
    fseek(fp, 0, SEEK_END);
    long sz = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    float *buf = kr_malloc((size_t)sz + 1);
    cr_assert(buf);
    cr_assert(fread(buf, 1, (size_t)sz, fp) == (size_t)sz);
    fclose(fp);
    *n_bytes = (size_t)sz;
    return buf;
}

const char *fx_root(void)
{
    const char *e = getenv("KR_FIXTURES");
    return e && *e ? e : KR_FIXTURES;
}

void fx_load(struct fx *f, const char *family, const char *name, int threads, int n_slots)
{
    kr_backend_t be = kr_backend_cpu_create(threads);
    cr_assert(be);
    fx_load_on(f, family, name, be, n_slots);
}

/* hf_bf16.json when the fixture has one (fx_prompt.has_bf16); its prompts must be reference.json's. */
static void load_bf16(struct fx *f)
{
    char path[600];
    snprintf(path, sizeof path, "%s/hf_bf16.json", f->dir);
    FILE *probe = fopen(path, "rb");
    if (!probe) {
        return;
    }
    fclose(probe);
    struct kr_json *doc = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_json_parse_file(path, &doc, &err), KR_OK, "%s", err.msg);
    const struct kr_json *ps = kr_json_get(doc, "prompts");
    cr_assert(ps && ps->type == KR_JSON_ARRAY && (int32_t)ps->n == f->n_prompts, "%s: %d prompts expected", path,
              f->n_prompts);
    for (int32_t i = 0; i < f->n_prompts; i++) {
        struct fx_prompt *p = &f->prompts[i];
        const struct kr_json *e = &ps->items[i], *pos = kr_json_get(e, "per_position_max");
        int64_t n;
        cr_assert(kr_json_as_int(kr_json_get(e, "n"), &n) && n == p->n, "%s: prompt %d length", path, i);
        cr_assert(kr_json_as_double(kr_json_get(e, "max"), &p->bf16_max), "%s: prompt %d max", path, i);
        cr_assert(kr_json_as_double(kr_json_get(e, "mean"), &p->bf16_mean), "%s: prompt %d mean", path, i);
        cr_assert(pos && pos->type == KR_JSON_ARRAY && (int32_t)pos->n == p->n, "%s: prompt %d per_position_max",
                  path, i);
        p->bf16_pos = kr_malloc((size_t)p->n * sizeof(float));
        cr_assert(p->bf16_pos);
        for (int32_t t = 0; t < p->n; t++) {
            double d;
            cr_assert(kr_json_as_double(&pos->items[t], &d));
            p->bf16_pos[t] = (float)d;
        }
        p->has_bf16 = true;
    }
    kr_json_free(doc);
}

void fx_load_on(struct fx *f, const char *family, const char *name, kr_backend_t be, int n_slots)
{
    memset(f, 0, sizeof *f);
    snprintf(f->dir, sizeof f->dir, "%s/%s/%s", fx_root(), family, name);
    f->be = be;
    struct kr_err err = {0};
    enum kr_status st = kr_model_load(f->dir, f->be, &f->m, &err);
    cr_assert_eq(st, KR_OK, "loading %s: %s", f->dir, err.msg);
    /* HF scores the DSA indexer without FP8: compare like with like (the FP8 path has its own tests) */
    cr_assert_eq(kr_model_set_indexer(f->m, KR_INDEXER_BF16, &err), KR_OK, "%s", err.msg);
    f->vocab = f->m->cfg.vocab;

    char path[600];
    snprintf(path, sizeof path, "%s/reference.json", f->dir);
    struct kr_json *ref = NULL;
    st = kr_json_parse_file(path, &ref, &err);
    cr_assert_eq(st, KR_OK, "%s", err.msg);
    snprintf(path, sizeof path, "%s/reference.bin", f->dir);
    size_t nbytes;
    float *bin = read_bin(path, &nbytes);

    int64_t v;
    cr_assert(kr_json_as_int(kr_json_get(ref, "vocab_size"), &v) && v == f->vocab);
    const struct kr_json *ps = kr_json_get(ref, "prompts");
    cr_assert(ps && ps->type == KR_JSON_ARRAY && ps->n <= 16);
    f->n_prompts = (int32_t)ps->n;
    int32_t max_len = 0;
    for (size_t i = 0; i < ps->n; i++) {
        struct fx_prompt *p = &f->prompts[i];
        const struct kr_json *ids = kr_json_get(&ps->items[i], "ids");
        p->n = (int32_t)ids->n;
        p->ids = kr_malloc((size_t)p->n * sizeof(int32_t));
        for (int32_t j = 0; j < p->n; j++) {
            cr_assert(kr_json_as_int(&ids->items[j], &v));
            p->ids[j] = (int32_t)v;
        }
        int64_t off, rows;
        cr_assert(kr_json_as_int(kr_json_get(&ps->items[i], "logprobs_offset"), &off));
        cr_assert(kr_json_as_int(kr_json_get(&ps->items[i], "n_rows"), &rows));
        cr_assert_eq(rows, p->n);
        cr_assert((size_t)off + (size_t)(rows * f->vocab) * 4 <= nbytes, "reference.bin too short");
        p->logprobs = kr_malloc((size_t)(rows * f->vocab) * sizeof(float));
        memcpy(p->logprobs, (char *)bin + off, (size_t)(rows * f->vocab) * sizeof(float));
        const struct kr_json *g = kr_json_get(&ps->items[i], "greedy");
        const struct kr_json *mg = kr_json_get(&ps->items[i], "greedy_margin");
        cr_assert(g && mg && g->n == mg->n && g->n <= 64);
        p->n_greedy = (int32_t)g->n;
        for (size_t j = 0; j < g->n; j++) {
            double d;
            cr_assert(kr_json_as_int(&g->items[j], &v));
            cr_assert(kr_json_as_double(&mg->items[j], &d));
            p->greedy[j] = (int32_t)v;
            p->margin[j] = (float)d;
        }
        max_len = p->n + p->n_greedy > max_len ? p->n + p->n_greedy : max_len;
        /* index_sets[prompt][D layer][position] at the top level (per-prompt "index_sets" also read) */
        const struct kr_json *all_sets = kr_json_get(ref, "index_sets");
        const struct kr_json *sets = kr_json_get(&ps->items[i], "index_sets");
        if (!sets && all_sets && all_sets->type == KR_JSON_ARRAY && i < all_sets->n) {
            sets = &all_sets->items[i];
        }
        if (sets && sets->type == KR_JSON_ARRAY) {
            const int64_t K = f->m->cfg.idx_topk;
            p->n_dsa = (int32_t)sets->n;
            p->sets = kr_malloc((size_t)p->n_dsa * (size_t)p->n * (size_t)K * sizeof(int32_t) + 1);
            cr_assert(p->sets);
            for (int32_t l = 0; l < p->n_dsa; l++) {
                const struct kr_json *L = &sets->items[l];
                cr_assert(L->type == KR_JSON_ARRAY && (int32_t)L->n == p->n, "index_sets[%d] has %zu rows, prompt %d",
                          l, L->n, p->n);
                for (int32_t t = 0; t < p->n; t++) {
                    const struct kr_json *row = &L->items[t];
                    const int64_t want = t + 1 < K ? t + 1 : K;
                    cr_assert(row->type == KR_JSON_ARRAY && (int64_t)row->n == want,
                              "index_sets[%d][%d] holds %zu positions, expected %lld", l, t, row->n, (long long)want);
                    int32_t *dst = p->sets + ((size_t)l * (size_t)p->n + (size_t)t) * (size_t)K;
                    for (int64_t j = 0; j < K; j++) {
                        dst[j] = -1;
                        if (j < (int64_t)row->n) {
                            cr_assert(kr_json_as_int(&row->items[j], &v));
                            dst[j] = (int32_t)v;
                        }
                    }
                    for (int64_t j = 1; j < (int64_t)row->n; j++) {
                        cr_assert(dst[j - 1] < dst[j], "index_sets rows must be ascending");
                    }
                }
            }
        }
    }
    kr_free(bin);
    kr_json_free(ref);
    load_bf16(f);
    const int32_t bs = 16;
    const int32_t blocks = n_slots * ((max_len + 64) / bs + 1);
    st = kr_cache_create(f->m, n_slots, blocks, bs, &f->c);
    cr_assert_eq(st, KR_OK);
}

void fx_free(struct fx *f)
{
    for (int32_t i = 0; i < f->n_prompts; i++) {
        kr_free(f->prompts[i].ids);
        kr_free(f->prompts[i].logprobs);
        kr_free(f->prompts[i].sets);
        kr_free(f->prompts[i].bf16_pos);
    }
    kr_cache_free(f->c);
    kr_model_free(f->m);
    kr_backend_free(f->be);
}

double max_abs_diff(const float *a, const float *b, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > m || isnan(d)) {
            m = isnan(d) ? INFINITY : d;
        }
    }
    return m;
}

/* ---- multi-sequence driver ------------------------------------------------------------------ */

void drv_run(struct kr_model *m, struct kr_cache *c, struct drv_seq *seqs, int32_t n_seq)
{
    const int64_t V = m->cfg.vocab;
    struct kr_seq_cache *sc = kr_calloc((size_t)n_seq, sizeof *sc);
    int32_t *done = kr_calloc((size_t)n_seq, sizeof *done);    /* prompt tokens consumed */
    int32_t *ngen = kr_calloc((size_t)n_seq, sizeof *ngen);    /* tokens generated */
    int32_t *rows_done = kr_calloc((size_t)n_seq, sizeof *rows_done);
    bool *started = kr_calloc((size_t)n_seq, sizeof *started);
    cr_assert(sc && done && ngen && rows_done && started);
    int32_t cap_tok = 0;
    for (int32_t s = 0; s < n_seq; s++) {
        cap_tok += seqs[s].n_prompt + 1;
    }
    int32_t *tokens = kr_malloc((size_t)cap_tok * sizeof(int32_t)), *pos = kr_malloc((size_t)cap_tok * sizeof(int32_t));
    int32_t *out_tok = kr_malloc((size_t)cap_tok * sizeof(int32_t)), *tok0 = kr_malloc((size_t)(n_seq + 1) * sizeof(int32_t));
    int32_t *pos0 = kr_malloc((size_t)n_seq * sizeof(int32_t)), *slot = kr_malloc((size_t)n_seq * sizeof(int32_t));
    int32_t *who = kr_malloc((size_t)n_seq * sizeof(int32_t));
    float *lp = kr_malloc((size_t)cap_tok * (size_t)V * sizeof(float));
    int32_t max_blocks = 1;
    for (int32_t s = 0; s < n_seq; s++) {
        int32_t need = (seqs[s].n_prompt + seqs[s].n_decode + c->block_size) / c->block_size;
        max_blocks = need > max_blocks ? need : max_blocks;
    }
    int32_t *bt = kr_calloc((size_t)n_seq * (size_t)max_blocks, sizeof(int32_t));
    cr_assert(tokens && pos && out_tok && tok0 && pos0 && slot && who && lp && bt);

    for (int32_t stepi = 0;; stepi++) {
        int32_t nt = 0, ns = 0, active = 0;
        for (int32_t s = 0; s < n_seq; s++) {
            struct drv_seq *q = &seqs[s];
            const bool finished = done[s] == q->n_prompt && ngen[s] >= q->n_decode;
            if (finished) {
                continue;
            }
            active++;
            if (stepi < q->start_step) {
                continue;
            }
            if (!started[s]) {
                cr_assert_eq(kr_seq_cache_init(c, &sc[s]), KR_OK);
                started[s] = true;
            }
            int32_t k;
            const int32_t *src;
            int32_t next_tok;
            if (done[s] < q->n_prompt) {
                k = q->n_prompt - done[s] < q->chunk ? q->n_prompt - done[s] : q->chunk;
                src = q->prompt + done[s];
            } else {
                next_tok = q->gen[ngen[s] - 1];
                k = 1;
                src = &next_tok;
            }
            cr_assert_eq(kr_seq_cache_reserve(c, &sc[s], sc[s].n_pos + k), KR_OK);
            tok0[ns] = nt;
            pos0[ns] = sc[s].n_pos;
            slot[ns] = sc[s].slot;
            memcpy(bt + (size_t)ns * (size_t)max_blocks, sc[s].blocks, (size_t)sc[s].n_blocks * sizeof(int32_t));
            for (int32_t i = 0; i < k; i++) {
                tokens[nt + i] = src[i];
                pos[nt + i] = sc[s].n_pos + i;
                out_tok[nt + i] = nt + i;
            }
            who[ns] = s;
            nt += k;
            ns++;
        }
        if (active == 0) {
            break;
        }
        if (ns == 0) {
            continue;
        }
        tok0[ns] = nt;
        struct kr_batch b = {
            .n_tok = nt, .n_seq = ns, .tokens = tokens, .pos = pos, .seq_tok0 = tok0, .seq_pos0 = pos0,
            .seq_slot = slot, .block_table = bt, .max_blocks = max_blocks, .n_out = nt, .out_tok = out_tok,
        };
        struct kr_err err = {0};
        enum kr_status st = kr_model_forward(m, c, &b, lp, &err);
        cr_assert_eq(st, KR_OK, "forward: %s", err.msg);
        for (int32_t j = 0; j < ns; j++) {
            const int32_t s = who[j];
            struct drv_seq *q = &seqs[s];
            const int32_t k = tok0[j + 1] - tok0[j];
            const bool prompt_phase = done[s] < q->n_prompt;
            for (int32_t i = 0; i < k; i++) {
                float *row = lp + (size_t)(tok0[j] + i) * (size_t)V;
                kr_log_softmax(row, row, V);
                if (rows_done[s] < q->n_prompt + q->n_decode) {
                    memcpy(q->rows + (size_t)rows_done[s] * (size_t)V, row, (size_t)V * sizeof(float));
                    rows_done[s]++;
                }
            }
            sc[s].n_pos += k;
            if (prompt_phase) {
                done[s] += k;
            }
            if (done[s] == q->n_prompt && ngen[s] < q->n_decode) {
                /* the last row computed is the distribution of the next token */
                q->gen[ngen[s]++] = kr_argmax(lp + (size_t)(tok0[j + 1] - 1) * (size_t)V, V);
            }
            if (done[s] == q->n_prompt && ngen[s] >= q->n_decode) {
                kr_seq_cache_release(c, &sc[s]);
            }
        }
    }
    kr_free(sc);
    kr_free(done);
    kr_free(ngen);
    kr_free(rows_done);
    kr_free(started);
    kr_free(tokens);
    kr_free(pos);
    kr_free(out_tok);
    kr_free(tok0);
    kr_free(pos0);
    kr_free(slot);
    kr_free(who);
    kr_free(lp);
    kr_free(bt);
}

const struct fx_id fx_all[FX_N_ALL] = {
    {"nemotron_h", "nh_mamba_attn_mlp"}, {"nemotron_h", "nh_moe"},       {"nemotron_h", "nh_tied_f32"},
    {"nemotron_h", "nh_gated"},          {"nemotron_h", "nh_long_chunks"}, {"deepseek_v32", "ds_yarn"},
    {"deepseek_v32", "ds_fp8"},          {"deepseek_v32", "ds_short"},   {"hybrid", "hy_mdme"},
    {"hybrid", "hy_plus"},             {"hybrid", "hy_share"},         {"hybrid", "hy_norelu"},
    {"default", "small-hybrid"}, /* the trained default model (links to models/small-hybrid) */
};

double fx_e4m3(uint8_t b)
{
    const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) {
        return NAN;
    }
    const double v = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, e - 7);
    return s ? -v : v;
}

double fx_e4m3_nearest(double x)
{
    double best = 0, bd = INFINITY;
    for (int c = 0; c < 0x7f; c++) {
        const double v = fx_e4m3((uint8_t)c), d = fabs(v - fabs(x));
        if (d < bd) {
            bd = d;
            best = v;
        }
    }
    return x < 0 ? -best : best;
}
