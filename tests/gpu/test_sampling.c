/* GPU sampling (krk_sample) against the host sampler (kr_sample, kr_log_softmax, kr_top_k_ids; with
 * constrained decoding's masks, kr_log_softmax_masked) on the same logits: several rows per launch,
 * the same uniform u on both sides (drawn from a copy of each row's generator, exactly when
 * kr_sample draws). Tokens must be equal, except where the host's
 * cumulative probability at the draw lies within 1e-5 of u: there the order of summation may decide
 * (both sides sum in a different order), and the number of such skipped cases is printed. Log-probs
 * are compared within 1e-5 absolute (both sides compute the log-sum-exp in double and round it once
 * to float; only the last bits of that double may differ). */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu-test.h"
#include "sampler.h"

#define BIG_V 129280
#define DRAW_MARGIN 1e-5
#define LP_TOL 1e-5

/* ---- inputs --------------------------------------------------------------------------------------- */

enum shape {
    SHAPE_PEAKED,    /* gaussian (sd 2) plus a head of tokens raised by 6..10: like a model's logits */
    SHAPE_FLAT,      /* uniform in [-10, 10]: thousands of tokens kept by top-p and min-p */
    SHAPE_TIES,      /* the peaked shape rounded to multiples of 0.5: large groups of equal logits */
    SHAPE_INT_TIES,  /* integers in [-5, 5] */
};

static float gaussian(struct gt_rng *r)
{
    const float a = gt_uniform(r, 1e-7f, 1.0f), b = gt_uniform(r, 0.0f, 1.0f);
    return sqrtf(-2.0f * logf(a)) * cosf(6.2831853f * b);
}

static void fill_row(struct gt_rng *r, float *x, int64_t vocab, enum shape sh)
{
    const int64_t head = vocab >= 4096 ? 256 : 8;
    switch (sh) {
    case SHAPE_FLAT:
        gt_fill(r, x, (size_t)vocab, -10.0f, 10.0f);
        return;
    case SHAPE_INT_TIES:
        for (int64_t i = 0; i < vocab; i++) {
            x[i] = floorf(gt_uniform(r, -5.0f, 6.0f));
        }
        return;
    case SHAPE_PEAKED:
    case SHAPE_TIES:
        for (int64_t i = 0; i < vocab; i++) {
            x[i] = 2.0f * gaussian(r);
        }
        for (int64_t j = 0; j < head; j++) {
            const int64_t i = (int64_t)gt_uniform(r, 0.0f, (float)vocab) % vocab;
            x[i] += vocab >= 4096 ? gt_uniform(r, 6.0f, 10.0f) : gt_uniform(r, 2.0f, 5.0f);
        }
        if (sh == SHAPE_TIES) {
            for (int64_t i = 0; i < vocab; i++) {
                x[i] = roundf(x[i] * 2.0f) / 2.0f;
            }
        }
        return;
    }
}

/* A batch of rows with their host-side sampling state. */
struct batch {
    int64_t n, vocab, ld;
    float *logits;                 /* [n, ld] */
    struct kr_sampling *s;         /* [n] */
    struct kr_token_counts *tc;    /* [n] */
    int32_t *n_gen;                /* [n] */
    struct kr_rng *rng;            /* [n] */
    int32_t eos[2];
    int32_t n_eos;
    int32_t *eos_all;              /* when set: every id is an EOS id (all-masked rows) */
    uint32_t *masks;               /* [n, (vocab + 31) / 32] allowed-token bitmasks, or NULL (add_mask) */
    bool *masked;                  /* [n] the row has its mask (when masks is set) */
};

static int64_t mask_words(const struct batch *b)
{
    return (b->vocab + 31) / 32;
}

/* Row i's allowed-token mask, or NULL. */
static const uint32_t *row_mask(const struct batch *b, int64_t i)
{
    return b->masks && b->masked[i] ? b->masks + i * mask_words(b) : NULL;
}

static void batch_init(struct batch *b, struct gt_rng *r, int64_t n, int64_t vocab, int64_t ld, enum shape sh)
{
    memset(b, 0, sizeof *b);
    b->n = n;
    b->vocab = vocab;
    b->ld = ld;
    b->logits = malloc((size_t)(n * ld) * sizeof(float));
    b->s = calloc((size_t)n, sizeof *b->s);
    b->tc = calloc((size_t)n, sizeof *b->tc);
    b->n_gen = calloc((size_t)n, sizeof *b->n_gen);
    b->rng = calloc((size_t)n, sizeof *b->rng);
    cr_assert(b->logits && b->s && b->tc && b->n_gen && b->rng);
    for (int64_t i = 0; i < n; i++) {
        fill_row(r, b->logits + i * ld, vocab, sh);
        for (int64_t j = vocab; j < ld; j++) {
            b->logits[i * ld + j] = NAN; /* never read */
        }
        kr_sampling_default(&b->s[i]);
        kr_token_counts_init(&b->tc[i]);
        kr_rng_seed(&b->rng[i], 0x5eed0000u + (uint64_t)i * 7919u + (uint64_t)vocab);
    }
    b->eos[0] = (int32_t)(vocab - 1);
    b->eos[1] = 2;
    b->n_eos = 2;
}

static void batch_free(struct batch *b)
{
    for (int64_t i = 0; i < b->n; i++) {
        kr_token_counts_free(&b->tc[i]);
    }
    free(b->logits);
    free(b->s);
    free(b->tc);
    free(b->n_gen);
    free(b->rng);
    free(b->eos_all);
    free(b->masks);
    free(b->masked);
}

/* Gives row i a constrained decoding mask allowing about `density` of the tokens, in words of
 * every kind (all allowed, none, mixed), and never the row's 8 largest logits (so that the mask
 * changes the choice and the top log-probabilities). */
static void add_mask(struct batch *b, struct gt_rng *r, int64_t i, float density)
{
    const int64_t w = mask_words(b);
    if (!b->masks) {
        b->masks = calloc((size_t)(b->n * w), sizeof *b->masks);
        b->masked = calloc((size_t)b->n, sizeof *b->masked);
        cr_assert(b->masks && b->masked);
    }
    uint32_t *m = b->masks + i * w;
    for (int64_t k = 0; k < w; k++) {
        const float kind = gt_uniform(r, 0.0f, 1.0f);
        if (kind < 0.1f) {
            m[k] = kind < 0.05f ? 0xffffffffu : 0u;
            continue;
        }
        m[k] = 0;
        for (int bit = 0; bit < 32; bit++) {
            m[k] |= gt_uniform(r, 0.0f, 1.0f) < density ? 1u << bit : 0u;
        }
    }
    if (b->vocab % 32) {
        m[w - 1] &= (1u << (b->vocab % 32)) - 1u;
    }
    int32_t best[8];
    kr_top_k_ids(b->logits + i * b->ld, b->vocab, 8, best);
    for (int k = 0; k < 8; k++) {
        m[best[k] >> 5] &= ~(1u << (best[k] & 31));
    }
    m[0] |= 1u << 5; /* never empty */
    b->masked[i] = true;
}

/* Output and prompt counts on tokens among the row's largest logits (so that penalties change the
 * choice), with repetition, frequency and presence penalties. */
static void add_penalties(struct batch *b, struct gt_rng *r, int64_t i)
{
    const float *x = b->logits + i * b->ld;
    int32_t best[16];
    kr_top_k_ids(x, b->vocab, 16, best);
    for (int k = 0; k < 16; k++) {
        const int n_out = (int)gt_uniform(r, 0.0f, 4.0f);
        const bool prompt = gt_uniform(r, 0.0f, 1.0f) < 0.5f;
        if (prompt) {
            cr_assert_eq(kr_token_counts_add(&b->tc[i], best[k], true), KR_OK);
        }
        for (int c = 0; c < n_out; c++) {
            cr_assert_eq(kr_token_counts_add(&b->tc[i], best[k], false), KR_OK);
        }
    }
    for (int k = 0; k < 40; k++) { /* and some anywhere */
        const int32_t id = (int32_t)((int64_t)gt_uniform(r, 0.0f, (float)b->vocab) % b->vocab);
        cr_assert_eq(kr_token_counts_add(&b->tc[i], id, gt_uniform(r, 0.0f, 1.0f) < 0.5f), KR_OK);
    }
    b->s[i].repetition_penalty = gt_uniform(r, 0.0f, 1.0f) < 0.8f ? 1.3f : 0.8f;
    b->s[i].frequency_penalty = 0.4f;
    b->s[i].presence_penalty = -0.3f;
}

/* min_tokens masking with the EOS and a stop id placed at the top of the row; the EOS id is also
 * in the output counts, so that it has a penalty entry and a masking entry. */
static void add_min_tokens(struct batch *b, int64_t i)
{
    float *x = b->logits + i * b->ld;
    x[b->eos[0]] = 40.0f;
    x[b->eos[1]] = 39.0f;
    x[7] = 38.0f;
    b->s[i].min_tokens = 3;
    b->s[i].n_stop_ids = 1;
    b->s[i].stop_ids[0] = 7;
    b->n_gen[i] = 1;
    cr_assert_eq(kr_token_counts_add(&b->tc[i], b->eos[0], false), KR_OK);
}

/* ---- the GPU side --------------------------------------------------------------------------------- */

struct gpu_res {
    int32_t *ids;    /* [n] */
    float *lp;       /* [n] */
    int32_t *top;    /* [n, n_top] */
    float *top_lp;   /* [n, n_top] */
    double *u;       /* [n] the uniform given to each row */
};

/* The penalty entries of row i, as the caller builds them (sampling.h). */
static int64_t row_entries(const struct batch *b, int64_t i, int32_t *ids, int32_t *cnt, uint8_t *fl)
{
    int64_t n = 0;
    const struct kr_token_counts *c = &b->tc[i];
    for (int32_t k = 0; k < c->cap; k++) {
        if (c->ids[k] != -1) {
            if (ids) {
                ids[n] = c->ids[k];
                cnt[n] = c->n_out[k];
                fl[n] = c->in_prompt[k] ? 1 : 0;
            }
            n++;
        }
    }
    const struct kr_sampling *s = &b->s[i];
    if (b->n_gen[i] < s->min_tokens) {
        const int32_t n_eos = b->eos_all ? (int32_t)b->vocab : b->n_eos;
        const int32_t *eos = b->eos_all ? b->eos_all : b->eos;
        for (int32_t k = 0; k < n_eos && !s->ignore_eos; k++) {
            if (ids) {
                ids[n] = eos[k];
                cnt[n] = 0;
                fl[n] = 2;
            }
            n++;
        }
        for (int32_t k = 0; k < s->n_stop_ids; k++) {
            if (ids) {
                ids[n] = s->stop_ids[k];
                cnt[n] = 0;
                fl[n] = 2;
            }
            n++;
        }
    }
    return n;
}

/* Fills the launch parameters (device buffers) for the batch; rows_override replaces the row
 * parameters when set. */
struct launch {
    struct krk_sample_params p;
    struct krk_ctx k;            /* the default stream and the workspace */
    struct krk_sample_row *rows; /* host copy */
    void *d_logits, *d_rows, *d_ids, *d_cnt, *d_fl, *d_mask, *d_out, *d_lp, *d_top, *d_top_lp, *d_ws;
};

static void launch_make(struct launch *l, const struct batch *b, int32_t n_top, bool want_lp, double *u)
{
    memset(l, 0, sizeof *l);
    const int64_t n = b->n;
    int64_t n_pen = 0;
    for (int64_t i = 0; i < n; i++) {
        n_pen += row_entries(b, i, NULL, NULL, NULL);
    }
    int32_t *ids = malloc((size_t)n_pen * 4 + 4), *cnt = malloc((size_t)n_pen * 4 + 4);
    uint8_t *fl = malloc((size_t)n_pen + 1);
    l->rows = calloc((size_t)n, sizeof *l->rows);
    cr_assert(ids && cnt && fl && l->rows);
    int64_t off = 0;
    for (int64_t i = 0; i < n; i++) {
        const struct kr_sampling *s = &b->s[i];
        const int64_t m = row_entries(b, i, ids + off, cnt + off, fl + off);
        struct kr_rng c = b->rng[i];
        u[i] = s->temperature != 0.0f ? kr_rng_uniform(&c) : 0.0; /* kr_sample draws for these rows only */
        l->rows[i] = (struct krk_sample_row){
            .temperature = s->temperature,
            .top_k = s->top_k,
            .top_p = s->top_p,
            .min_p = s->min_p,
            .presence = s->presence_penalty,
            .frequency = s->frequency_penalty,
            .repetition = s->repetition_penalty,
            .pen_off = (int32_t)off,
            .pen_n = (int32_t)m,
            .mask_off = row_mask(b, i) ? (int32_t)(i * mask_words(b)) : -1,
            .u = u[i],
        };
        off += m;
    }
    l->d_logits = gt_dup(b->logits, (size_t)(n * b->ld) * sizeof(float));
    l->d_rows = gt_dup(l->rows, (size_t)n * sizeof *l->rows);
    l->d_ids = n_pen ? gt_dup(ids, (size_t)n_pen * 4) : NULL;
    l->d_cnt = n_pen ? gt_dup(cnt, (size_t)n_pen * 4) : NULL;
    l->d_fl = n_pen ? gt_dup(fl, (size_t)n_pen) : NULL;
    l->d_mask = b->masks ? gt_dup(b->masks, (size_t)(n * mask_words(b)) * sizeof(uint32_t)) : NULL;
    l->d_out = gt_dalloc((size_t)n * 4);
    l->d_lp = want_lp ? gt_dalloc((size_t)n * 4) : NULL;
    l->d_top = n_top ? gt_dalloc((size_t)(n * n_top) * 4) : NULL;
    l->d_top_lp = n_top ? gt_dalloc((size_t)(n * n_top) * 4) : NULL;
    const size_t ws = krk_sample_workspace_bytes(n, b->vocab);
    l->d_ws = gt_dalloc(ws);
    l->p = (struct krk_sample_params){
        .logits = l->d_logits,
        .ld = b->ld,
        .n = n,
        .vocab = b->vocab,
        .rows = l->d_rows,
        .pen_ids = l->d_ids,
        .pen_count = l->d_cnt,
        .pen_flags = l->d_fl,
        .n_pen = n_pen,
        .mask = l->d_mask,
        .n_mask = b->masks ? n * mask_words(b) : 0,
        .out = l->d_out,
        .out_logprob = l->d_lp,
        .n_top = n_top,
        .top_ids = l->d_top,
        .top_lp = l->d_top_lp,
    };
    l->k = (struct krk_ctx){.workspace = l->d_ws, .workspace_bytes = ws};
    free(ids);
    free(cnt);
    free(fl);
}

static void launch_free(struct launch *l)
{
    gt_dfree(l->d_logits);
    gt_dfree(l->d_rows);
    gt_dfree(l->d_ids);
    gt_dfree(l->d_cnt);
    gt_dfree(l->d_fl);
    gt_dfree(l->d_mask);
    gt_dfree(l->d_out);
    gt_dfree(l->d_lp);
    gt_dfree(l->d_top);
    gt_dfree(l->d_top_lp);
    gt_dfree(l->d_ws);
    free(l->rows);
}

static void gpu_sample(const struct batch *b, int32_t n_top, bool want_lp, struct gpu_res *g)
{
    const int64_t n = b->n;
    g->ids = malloc((size_t)n * 4);
    g->lp = malloc((size_t)n * 4);
    g->top = malloc((size_t)(n * n_top) * 4 + 4);
    g->top_lp = malloc((size_t)(n * n_top) * 4 + 4);
    g->u = malloc((size_t)n * sizeof(double));
    cr_assert(g->ids && g->lp && g->top && g->top_lp && g->u);
    struct launch l;
    launch_make(&l, b, n_top, want_lp, g->u);
    cr_assert_eq(krk_sample(&l.p, &l.k), KR_OK);
    gt_sync();
    gt_down(g->ids, l.d_out, (size_t)n * 4);
    if (want_lp) {
        gt_down(g->lp, l.d_lp, (size_t)n * 4);
    }
    if (n_top) {
        gt_down(g->top, l.d_top, (size_t)(n * n_top) * 4);
        gt_down(g->top_lp, l.d_top_lp, (size_t)(n * n_top) * 4);
    }
    launch_free(&l);
}

static void gpu_res_free(struct gpu_res *g)
{
    free(g->ids);
    free(g->lp);
    free(g->top);
    free(g->top_lp);
    free(g->u);
}

/* ---- the host side -------------------------------------------------------------------------------- */

struct cand {
    float v;
    int32_t id;
};

/* Descending logit, lower id first on ties: the sampling order. */
static int cand_cmp(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->v != y->v) {
        return x->v > y->v ? -1 : 1;
    }
    return (x->id > y->id) - (x->id < y->id);
}

/* Distance from u to the nearest edge of the host's cumulative-probability interval of `tok`,
 * recomputed here from the processed logits kr_sample leaves in its scratch (sc->v: penalties and
 * masks applied), sorted into the sampling order with the same formulas; negative when u is not
 * inside that interval. */
static double draw_margin(const struct kr_sampling *s, const struct kr_sampler_scratch *sc, int64_t vocab, double u,
                          int32_t tok)
{
    struct cand *c = malloc((size_t)vocab * sizeof *c);
    cr_assert(c);
    int64_t n = 0;
    for (int64_t i = 0; i < vocab; i++) {
        if (sc->v[i] != -INFINITY && !isnan(sc->v[i])) {
            c[n++] = (struct cand){sc->v[i], (int32_t)i};
        }
    }
    qsort(c, (size_t)n, sizeof *c, cand_cmp);
    int64_t keep = n;
    if (s->top_k > 0 && s->top_k < keep) {
        keep = s->top_k;
    }
    const float inv_t = 1.0f / s->temperature;
    const float mx = c[0].v * inv_t;
#define WEIGHT(i) exp((double)c[i].v * inv_t - mx)
    double total = 0.0;
    for (int64_t i = 0; i < keep; i++) {
        total += WEIGHT(i);
    }
    if (s->top_p < 1.0f) {
        double cum = 0.0;
        int64_t k2 = 0;
        while (k2 < keep) {
            cum += WEIGHT(k2) / total;
            k2++;
            if (cum >= s->top_p) {
                break;
            }
        }
        keep = k2;
    }
    if (s->min_p > 0.0f) {
        int64_t k2 = 1;
        while (k2 < keep && WEIGHT(k2) >= s->min_p) {
            k2++;
        }
        keep = k2;
    }
    total = 0.0;
    for (int64_t i = 0; i < keep; i++) {
        total += WEIGHT(i);
    }
    double cum = 0.0, margin = -1.0;
    for (int64_t i = 0; i < keep; i++) {
        const double lo = cum / total;
        cum += WEIGHT(i);
        if (c[i].id == tok) {
            const double hi = i == keep - 1 ? 1.0 : cum / total;
            margin = fmin(u - lo, hi - u);
            break;
        }
    }
#undef WEIGHT
    free(c);
    return margin;
}

struct tally {
    int compared, skipped, mismatched;
};

/* Runs the host sampler on every row and compares with the GPU's tokens. */
static void compare_tokens(const char *what, struct batch *b, const struct gpu_res *g, struct tally *t)
{
    static struct kr_sampler_scratch sc;
    const int32_t n_eos = b->eos_all ? (int32_t)b->vocab : b->n_eos;
    const int32_t *eos = b->eos_all ? b->eos_all : b->eos;
    for (int64_t i = 0; i < b->n; i++) {
        int32_t cpu = -1;
        const enum kr_status st = kr_sample(&b->s[i], b->logits + i * b->ld, row_mask(b, i), b->vocab, &b->tc[i],
                                            b->n_gen[i], eos, n_eos, &b->rng[i], &sc, &cpu);
        if (st != KR_OK) {
            cr_expect_eq(st, KR_ERR_INTERNAL);
            cr_expect_eq(g->ids[i], -1, "%s row %lld: host fails (all masked), GPU chose %d", what, (long long)i,
                         g->ids[i]);
            t->compared++;
            continue;
        }
        if (g->ids[i] == cpu) {
            t->compared++;
            continue;
        }
        double margin = -1.0;
        if (b->s[i].temperature != 0.0f) {
            margin = draw_margin(&b->s[i], &sc, b->vocab, g->u[i], cpu);
            cr_expect_geq(margin, 0.0, "%s row %lld: u = %.17g is outside the host token's interval", what,
                          (long long)i, g->u[i]);
        }
        if (margin >= 0.0 && margin < DRAW_MARGIN) {
            t->skipped++;
            continue;
        }
        t->mismatched++;
        cr_expect_eq(g->ids[i], cpu, "%s row %lld: GPU %d, host %d (u %.17g, margin %.3g)", what, (long long)i,
                     g->ids[i], cpu, g->u[i], margin);
    }
}

static void report(const char *what, const struct tally *t)
{
    fprintf(stderr, "  %-48s rows compared %d, draw-boundary cases skipped %d, mismatched %d\n", what, t->compared,
            t->skipped, t->mismatched);
}

/* Log-probabilities of the chosen tokens and the top n_top, against kr_log_softmax / kr_top_k_ids. */
static void compare_logprobs(const char *what, const struct batch *b, const struct gpu_res *g, int32_t n_top)
{
    float *lp = malloc((size_t)b->vocab * sizeof(float));
    int32_t ids[KR_MAX_TOP_LOGPROBS];
    cr_assert(lp);
    double worst = 0.0;
    int bad_ids = 0;
    for (int64_t i = 0; i < b->n; i++) {
        kr_log_softmax_masked(b->logits + i * b->ld, row_mask(b, i), lp, b->vocab);
        const int32_t tok = g->ids[i];
        if (tok >= 0 && tok < b->vocab) {
            const double d = fabs((double)g->lp[i] - (double)lp[tok]);
            worst = d > worst || isnan(d) ? d : worst;
            cr_expect(d <= LP_TOL, "%s row %lld: logprob %.9g, host %.9g", what, (long long)i, g->lp[i], lp[tok]);
        }
        if (n_top) {
            kr_top_k_ids(lp, b->vocab, n_top, ids);
            for (int32_t k = 0; k < n_top; k++) {
                const int32_t gid = g->top[i * n_top + k];
                bad_ids += gid != ids[k];
                cr_expect_eq(gid, ids[k], "%s row %lld: top %d is id %d, host %d", what, (long long)i, k, gid, ids[k]);
                const double d = fabs((double)g->top_lp[i * n_top + k] - (double)lp[ids[k]]);
                worst = d > worst || isnan(d) ? d : worst;
                cr_expect(d <= LP_TOL, "%s row %lld: top %d logprob %.9g, host %.9g", what, (long long)i, k,
                          g->top_lp[i * n_top + k], lp[ids[k]]);
            }
        }
    }
    fprintf(stderr, "  %-48s logprobs max |err| %.3g (bound %.0e), top-%d ids differing %d\n", what, worst, LP_TOL,
            n_top, bad_ids);
    free(lp);
}

/* ---- tests ---------------------------------------------------------------------------------------- */

TestSuite(sampling);

Test(sampling, greedy_matches_the_host_argmax_with_and_without_penalties)
{
    GT_REQUIRE_GPU();
    const int64_t vocabs[2] = {BIG_V, 1000};
    for (int v = 0; v < 2; v++) {
        struct gt_rng r = {.s = 11 + (uint64_t)v};
        struct batch b;
        batch_init(&b, &r, 16, vocabs[v], vocabs[v] + 3, SHAPE_PEAKED);
        for (int64_t i = 0; i < b.n; i++) {
            b.s[i].temperature = 0.0f;
            if (i % 2) {
                add_penalties(&b, &r, i);
            }
            if (i % 4 == 3) {
                add_min_tokens(&b, i);
            }
            if (i % 3 == 0) { /* NaN logits (a broken checkpoint) count as -inf, the first one too */
                float *row = b.logits + i * b.ld;
                row[0] = NAN;
                for (int64_t j = 1 + i; j < b.vocab; j += 97) {
                    row[j] = NAN;
                }
            }
        }
        struct gpu_res g;
        gpu_sample(&b, 0, false, &g);
        for (int64_t i = 0; i < b.n; i += 3) { /* the chosen logit is the largest non-NaN one */
            const float *row = b.logits + i * b.ld;
            float mx = -INFINITY;
            for (int64_t j = 0; j < b.vocab; j++) {
                mx = isnan(row[j]) || row[j] <= mx ? mx : row[j];
            }
            if (i % 2 == 0) { /* even rows: no penalties, and no min_tokens mask (those rows are odd) */
                cr_expect(g.ids[i] >= 0 && g.ids[i] < b.vocab && row[g.ids[i]] == mx,
                          "greedy row %lld with NaN logits: token %d is not the largest non-NaN logit", (long long)i,
                          g.ids[i]);
            }
        }
        struct tally t = {0};
        char what[64];
        snprintf(what, sizeof what, "greedy, vocab %lld", (long long)b.vocab);
        compare_tokens(what, &b, &g, &t);
        report(what, &t);
        cr_expect_eq(t.skipped, 0, "greedy rows never depend on u");
        gpu_res_free(&g);
        batch_free(&b);
    }
}

struct sample_case {
    float temperature;
    int32_t top_k;
    float top_p, min_p;
    bool penalties;
    int64_t vocab;
};

ParameterizedTestParameters(sampling, draws_the_host_token_for_the_same_u)
{
    static struct sample_case cases[] = {
        {0.7f, 0, 1.0f, 0.0f, false, BIG_V},    {0.7f, 50, 1.0f, 0.0f, false, BIG_V},
        {0.7f, 0, 0.9f, 0.0f, false, BIG_V},    {0.7f, 0, 1.0f, 0.05f, false, BIG_V},
        {0.7f, 50, 0.9f, 0.0f, false, BIG_V},   {0.7f, 50, 1.0f, 0.05f, false, BIG_V},
        {0.7f, 0, 0.9f, 0.05f, false, BIG_V},   {0.7f, 50, 0.9f, 0.05f, false, BIG_V},
        {0.7f, 50, 0.9f, 0.05f, true, BIG_V},   {1.0f, 0, 0.9f, 0.0f, false, BIG_V},
        {1.3f, 0, 1.0f, 0.0f, true, BIG_V},     {0.7f, 1, 1.0f, 0.0f, false, BIG_V},
        {0.7f, 0, 0.01f, 0.0f, false, BIG_V},   {0.7f, 0, 1.0f, 1.0f, false, BIG_V},
        {0.7f, 0, 1.0f, 0.0f, false, 1000},     {0.7f, 50, 1.0f, 0.0f, false, 1000},
        {0.7f, 0, 0.9f, 0.0f, false, 1000},     {0.7f, 0, 1.0f, 0.05f, false, 1000},
        {0.7f, 50, 0.9f, 0.05f, false, 1000},   {0.7f, 50, 0.9f, 0.05f, true, 1000},
        {1.0f, 2000, 0.95f, 0.0f, true, 1000},
    };
    return cr_make_param_array(struct sample_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(struct sample_case *c, sampling, draws_the_host_token_for_the_same_u)
{
    GT_REQUIRE_GPU();
    struct gt_rng r = {.s = 1000u + (uint64_t)(c->temperature * 100) + (uint64_t)c->top_k * 7u +
                            (uint64_t)(c->top_p * 1000) + (uint64_t)(c->min_p * 10000) + (uint64_t)c->vocab};
    struct batch b;
    const int64_t n = c->vocab == BIG_V ? 24 : 64;
    batch_init(&b, &r, n, c->vocab, c->vocab + (c->vocab == BIG_V ? 0 : 5), SHAPE_PEAKED);
    for (int64_t i = 0; i < n; i++) {
        b.s[i].temperature = c->temperature;
        b.s[i].top_k = c->top_k;
        b.s[i].top_p = c->top_p;
        b.s[i].min_p = c->min_p;
        if (c->penalties) {
            add_penalties(&b, &r, i);
            if (i % 3 == 0) {
                add_min_tokens(&b, i);
            }
        }
    }
    struct gpu_res g;
    gpu_sample(&b, 0, false, &g);
    struct tally t = {0};
    char what[96];
    snprintf(what, sizeof what, "t %.2f k %d p %.2f min_p %.2f%s V %lld", c->temperature, c->top_k, c->top_p,
             c->min_p, c->penalties ? " +pen" : "", (long long)c->vocab);
    compare_tokens(what, &b, &g, &t);
    report(what, &t);
    cr_expect_leq(t.skipped, 2, "%s: %d draw-boundary cases (expected ~0)", what, t.skipped);
    gpu_res_free(&g);
    batch_free(&b);
}

Test(sampling, deep_cuts_on_flat_logits_match)
{
    /* Uniform logits: top-p 0.9 and min-p 0.05 keep ~10^4 tokens of probability ~1e-4 each, so
     * u lies within 1e-5 of an edge in about 20% of the rows; those are skipped and counted. */
    GT_REQUIRE_GPU();
    const struct {
        float t, top_p, min_p;
        int32_t top_k;
    } cfg[4] = {{0.7f, 0.9f, 0.0f, 0}, {0.7f, 1.0f, 0.05f, 0}, {1.0f, 0.5f, 0.0f, 20000}, {2.0f, 1.0f, 0.0f, 0}};
    for (int c = 0; c < 4; c++) {
        struct gt_rng r = {.s = 77 + (uint64_t)c};
        struct batch b;
        batch_init(&b, &r, 32, BIG_V, BIG_V, SHAPE_FLAT);
        for (int64_t i = 0; i < b.n; i++) {
            b.s[i].temperature = cfg[c].t;
            b.s[i].top_p = cfg[c].top_p;
            b.s[i].min_p = cfg[c].min_p;
            b.s[i].top_k = cfg[c].top_k;
        }
        struct gpu_res g;
        gpu_sample(&b, 0, false, &g);
        struct tally t = {0};
        char what[96];
        snprintf(what, sizeof what, "flat: t %.1f k %d p %.2f min_p %.2f", cfg[c].t, cfg[c].top_k, cfg[c].top_p,
                 cfg[c].min_p);
        compare_tokens(what, &b, &g, &t);
        report(what, &t);
        cr_expect_geq(t.compared, (int)b.n / 2, "%s: too few rows compared", what);
        gpu_res_free(&g);
        batch_free(&b);
    }
}

Test(sampling, exact_ties_keep_the_lowest_ids_first)
{
    /* Large groups of equal logits: top-k and top-p cuts and draws fall inside tie groups, where the
     * host's order (lowest id first) decides which ids are kept and drawn. */
    GT_REQUIRE_GPU();
    const struct {
        enum shape sh;
        int64_t vocab;
        float t, top_p;
        int32_t top_k;
    } cfg[6] = {
        {SHAPE_TIES, BIG_V, 0.0f, 1.0f, 0},     {SHAPE_TIES, BIG_V, 0.7f, 1.0f, 50}, {SHAPE_TIES, BIG_V, 0.7f, 0.9f, 0},
        {SHAPE_INT_TIES, 1000, 0.0f, 1.0f, 0},  {SHAPE_INT_TIES, 1000, 0.7f, 1.0f, 30},
        {SHAPE_INT_TIES, 1000, 0.7f, 0.9f, 0},
    };
    for (int c = 0; c < 6; c++) {
        struct gt_rng r = {.s = 500 + (uint64_t)c};
        struct batch b;
        batch_init(&b, &r, 32, cfg[c].vocab, cfg[c].vocab, cfg[c].sh);
        for (int64_t i = 0; i < b.n; i++) {
            b.s[i].temperature = cfg[c].t;
            b.s[i].top_k = cfg[c].top_k;
            b.s[i].top_p = cfg[c].top_p;
        }
        struct gpu_res g;
        gpu_sample(&b, 0, false, &g);
        struct tally t = {0};
        char what[96];
        snprintf(what, sizeof what, "ties: V %lld t %.1f k %d p %.2f", (long long)cfg[c].vocab, cfg[c].t, cfg[c].top_k,
                 cfg[c].top_p);
        compare_tokens(what, &b, &g, &t);
        report(what, &t);
        cr_expect_leq(t.skipped, 2, "%s: %d draw-boundary cases (expected ~0)", what, t.skipped);
        gpu_res_free(&g);
        batch_free(&b);
    }
}

Test(sampling, min_tokens_masks_eos_and_stop_ids)
{
    GT_REQUIRE_GPU();
    struct gt_rng r = {.s = 31};
    struct batch b;
    batch_init(&b, &r, 12, BIG_V, BIG_V, SHAPE_PEAKED);
    for (int64_t i = 0; i < b.n; i++) {
        add_min_tokens(&b, i);
        b.s[i].temperature = i % 3 == 0 ? 0.0f : 0.7f;
        b.s[i].top_k = i % 3 == 2 ? 5 : 0;
        if (i >= 8) {
            b.n_gen[i] = 3; /* min_tokens reached: EOS allowed again (and the likely choice) */
        }
        if (i == 5) {
            b.s[i].ignore_eos = true;
        }
    }
    struct gpu_res g;
    gpu_sample(&b, 0, false, &g);
    struct tally t = {0};
    compare_tokens("min_tokens", &b, &g, &t);
    report("min_tokens", &t);
    for (int64_t i = 0; i < 8; i++) {
        if (i != 5) {
            cr_expect(g.ids[i] != b.eos[0] && g.ids[i] != b.eos[1] && g.ids[i] != 7, "row %lld chose a masked id %d",
                      (long long)i, g.ids[i]);
        }
    }
    gpu_res_free(&g);
    batch_free(&b);
}

Test(sampling, a_row_with_every_token_masked_fails_like_the_host)
{
    GT_REQUIRE_GPU();
    struct gt_rng r = {.s = 41};
    struct batch b;
    batch_init(&b, &r, 3, 1000, 1000, SHAPE_PEAKED);
    b.eos_all = malloc(1000 * sizeof(int32_t));
    cr_assert(b.eos_all);
    for (int32_t i = 0; i < 1000; i++) {
        b.eos_all[i] = i;
    }
    for (int64_t i = 0; i < b.n; i++) {
        b.s[i].min_tokens = 1;
        b.s[i].temperature = i == 0 ? 0.0f : 0.7f; /* greedy: host returns id 0; sampling: error */
    }
    struct gpu_res g;
    gpu_sample(&b, 0, true, &g);
    struct tally t = {0};
    compare_tokens("all masked", &b, &g, &t);
    report("all masked", &t);
    cr_expect(isnan(g.lp[1]) && isnan(g.lp[2]), "a failed row's logprob is NaN");
    gpu_res_free(&g);
    batch_free(&b);
}

Test(sampling, logprobs_and_top_logprobs_match_the_host)
{
    GT_REQUIRE_GPU();
    const struct {
        int64_t vocab;
        enum shape sh;
        int32_t n_top;
    } cfg[4] = {{BIG_V, SHAPE_PEAKED, 20}, {BIG_V, SHAPE_TIES, 20}, {1000, SHAPE_INT_TIES, 20}, {1000, SHAPE_FLAT, 1}};
    for (int c = 0; c < 4; c++) {
        struct gt_rng r = {.s = 900 + (uint64_t)c};
        struct batch b;
        batch_init(&b, &r, 16, cfg[c].vocab, cfg[c].vocab + 1, cfg[c].sh);
        for (int64_t i = 0; i < b.n; i++) {
            b.s[i].temperature = i % 2 ? 0.0f : 0.8f;
            b.s[i].top_p = 0.95f;
            if (i % 4 == 1) {
                add_penalties(&b, &r, i);
            }
        }
        struct gpu_res g;
        gpu_sample(&b, cfg[c].n_top, true, &g);
        struct tally t = {0};
        char what[96];
        snprintf(what, sizeof what, "logprobs: V %lld shape %d top %d", (long long)cfg[c].vocab, (int)cfg[c].sh,
                 cfg[c].n_top);
        compare_tokens(what, &b, &g, &t);
        report(what, &t);
        compare_logprobs(what, &b, &g, cfg[c].n_top);
        gpu_res_free(&g);
        batch_free(&b);
    }
}

Test(sampling, a_full_step_of_256_mixed_rows_matches)
{
    GT_REQUIRE_GPU();
    struct gt_rng r = {.s = 256};
    struct batch b;
    batch_init(&b, &r, 256, BIG_V, BIG_V + 16, SHAPE_PEAKED);
    for (int64_t i = 0; i < b.n; i++) {
        const int kind = (int)(i % 8);
        b.s[i].temperature = kind == 0 ? 0.0f : kind < 4 ? 0.7f : 1.0f;
        b.s[i].top_k = kind == 2 || kind == 5 ? 40 : 0;
        b.s[i].top_p = kind == 3 || kind == 5 ? 0.9f : 1.0f;
        b.s[i].min_p = kind == 6 ? 0.05f : 0.0f;
        if (kind == 7 || i % 5 == 0) {
            add_penalties(&b, &r, i);
        }
    }
    struct gpu_res g;
    gpu_sample(&b, 5, true, &g);
    struct tally t = {0};
    compare_tokens("256 mixed rows", &b, &g, &t);
    report("256 mixed rows", &t);
    cr_expect_leq(t.skipped, 3, "%d draw-boundary cases (expected ~0)", t.skipped);
    compare_logprobs("256 mixed rows", &b, &g, 5);
    gpu_res_free(&g);
    batch_free(&b);
}

/* Constrained decoding's masks: masked tokens are -inf before everything (penalties, min_tokens,
 * the cuts and the draw), and the log-probabilities are those of the masked logits, as on the host
 * (kr_sample and kr_log_softmax_masked with the same mask). Unmasked rows of the same launch are
 * untouched; an empty mask on a sampling row and a mask range beyond the array are refused. */
Test(sampling, masked_rows_match_the_host)
{
    GT_REQUIRE_GPU();
    const int64_t vocabs[2] = {BIG_V, 1000};
    for (int v = 0; v < 2; v++) {
        struct gt_rng r = {.s = 4242 + (uint64_t)v};
        struct batch b;
        batch_init(&b, &r, 24, vocabs[v], vocabs[v] + 5, SHAPE_PEAKED);
        for (int64_t i = 0; i < b.n; i++) {
            const int kind = (int)(i % 6);
            b.s[i].temperature = kind == 0 ? 0.0f : 0.9f;
            b.s[i].top_k = kind == 2 ? 30 : 0;
            b.s[i].top_p = kind == 3 ? 0.9f : 1.0f;
            b.s[i].min_p = kind == 4 ? 0.02f : 0.0f;
            if (i % 5 == 1) {
                add_penalties(&b, &r, i);
            }
            if (i % 7 == 3) {
                add_min_tokens(&b, i);
            }
            if (i % 3 != 2) { /* a third of the rows stay free */
                add_mask(&b, &r, i, i % 4 == 0 ? 0.01f : i % 4 == 1 ? 0.5f : 0.95f);
            }
        }
        struct gpu_res g;
        gpu_sample(&b, 5, true, &g);
        for (int64_t i = 0; i < b.n; i++) {
            const uint32_t *m = row_mask(&b, i);
            cr_expect(g.ids[i] >= 0 && (!m || kr_mask_allows(m, g.ids[i])), "row %lld: token %d is masked",
                      (long long)i, g.ids[i]);
        }
        struct tally t = {0};
        char what[64];
        snprintf(what, sizeof what, "masked rows, vocab %lld", (long long)b.vocab);
        compare_tokens(what, &b, &g, &t);
        report(what, &t);
        compare_logprobs(what, &b, &g, 5);
        gpu_res_free(&g);
        batch_free(&b);
    }
    /* an empty mask on a sampling row fails like the host; a mask range beyond the array is refused */
    struct gt_rng r = {.s = 99};
    struct batch b;
    batch_init(&b, &r, 3, 1000, 1000, SHAPE_PEAKED);
    for (int64_t i = 0; i < b.n; i++) {
        b.s[i].temperature = 0.7f;
        add_mask(&b, &r, i, 0.3f);
    }
    memset(b.masks, 0, (size_t)mask_words(&b) * sizeof(uint32_t)); /* row 0: nothing allowed */
    double u[3];
    struct launch l;
    launch_make(&l, &b, 0, true, u);
    l.rows[2].mask_off = (int32_t)(3 * mask_words(&b)); /* past the end */
    gt_dfree(l.d_rows);
    l.d_rows = gt_dup(l.rows, 3 * sizeof *l.rows);
    l.p.rows = l.d_rows;
    cr_assert_eq(krk_sample(&l.p, &l.k), KR_OK);
    gt_sync();
    int32_t out[3];
    gt_down(out, l.d_out, sizeof out);
    cr_expect_eq(out[0], -1, "every token masked: refused");
    cr_expect(out[1] >= 0 && kr_mask_allows(b.masks + mask_words(&b), out[1]));
    cr_expect_eq(out[2], -1, "a mask range beyond the array: refused");
    launch_free(&l);
    batch_free(&b);
}

Test(sampling, invalid_parameters_are_refused)
{
    GT_REQUIRE_GPU();
    struct gt_rng r = {.s = 5};
    struct batch b;
    batch_init(&b, &r, 6, 1000, 1000, SHAPE_PEAKED);
    for (int64_t i = 0; i < b.n; i++) {
        b.s[i].temperature = 0.7f;
    }
    double u[6];
    struct launch l;
    launch_make(&l, &b, 3, true, u);

    /* host-side parameters */
    cr_expect_eq(krk_sample(NULL, &l.k), KR_ERR_INVAL);
    cr_expect_eq(krk_sample(&l.p, NULL), KR_ERR_INVAL, "no context");
    struct krk_sample_params q = l.p;
    q.vocab = 0;
    cr_expect_eq(krk_sample(&q, &l.k), KR_ERR_INVAL, "vocab 0");
    q = l.p;
    q.vocab = (int64_t)1 << 21;
    q.ld = q.vocab;
    cr_expect_eq(krk_sample(&q, &l.k), KR_ERR_INVAL, "vocab too large");
    q = l.p;
    q.ld = q.vocab - 1;
    cr_expect_eq(krk_sample(&q, &l.k), KR_ERR_INVAL, "ld < vocab");
    q = l.p;
    q.n = -1;
    cr_expect_eq(krk_sample(&q, &l.k), KR_ERR_INVAL, "n < 0");
    q = l.p;
    q.n_top = 21;
    cr_expect_eq(krk_sample(&q, &l.k), KR_ERR_INVAL, "n_top 21");
    q = l.p;
    q.top_ids = NULL;
    cr_expect_eq(krk_sample(&q, &l.k), KR_ERR_INVAL, "n_top without top_ids");
    q = l.p;
    q.logits = NULL;
    cr_expect_eq(krk_sample(&q, &l.k), KR_ERR_INVAL, "no logits");
    q = l.p;
    q.rows = NULL;
    cr_expect_eq(krk_sample(&q, &l.k), KR_ERR_INVAL, "no rows");
    struct krk_ctx qk = l.k;
    qk.workspace_bytes -= 1;
    cr_expect_eq(krk_sample(&l.p, &qk), KR_ERR_INVAL, "workspace too small");
    qk = l.k;
    qk.workspace = (char *)qk.workspace + 4;
    cr_expect_eq(krk_sample(&l.p, &qk), KR_ERR_INVAL, "misaligned workspace");
    q = l.p;
    q.n_pen = 4;
    q.pen_ids = NULL;
    cr_expect_eq(krk_sample(&q, &l.k), KR_ERR_INVAL, "penalty entries without ids");
    q = l.p;
    q.n_pen = -1;
    cr_expect_eq(krk_sample(&q, &l.k), KR_ERR_INVAL, "n_pen < 0");
    q = l.p;
    q.n = 0;
    cr_expect_eq(krk_sample(&q, &l.k), KR_OK, "no rows is a no-op");

    /* device-side row parameters: rejected rows answer -1, the others are unaffected */
    l.rows[0].temperature = -1.0f;
    l.rows[1].top_p = 0.0f;
    l.rows[2].u = 1.0;
    l.rows[3].pen_off = 5;
    l.rows[3].pen_n = 1; /* past n_pen = 0 */
    l.rows[4].min_p = NAN;
    gt_dfree(l.d_rows);
    l.d_rows = gt_dup(l.rows, (size_t)b.n * sizeof *l.rows);
    l.p.rows = l.d_rows;
    cr_assert(cudaMemset(l.d_out, 0x7f, (size_t)b.n * 4) == cudaSuccess);
    cr_assert_eq(krk_sample(&l.p, &l.k), KR_OK);
    gt_sync();
    int32_t out[6];
    float lp[6];
    int32_t top[18];
    gt_down(out, l.d_out, sizeof out);
    gt_down(lp, l.d_lp, sizeof lp);
    gt_down(top, l.d_top, sizeof top);
    for (int i = 0; i < 5; i++) {
        cr_expect_eq(out[i], -1, "invalid row %d answered %d", i, out[i]);
        cr_expect(isnan(lp[i]), "invalid row %d logprob %g", i, lp[i]);
    }
    static struct kr_sampler_scratch sc;
    int32_t cpu = -1;
    cr_assert_eq(kr_sample(&b.s[5], b.logits + 5 * b.ld, NULL, b.vocab, &b.tc[5], 0, b.eos, b.n_eos, &b.rng[5], &sc,
                           &cpu),
                 KR_OK);
    cr_expect_eq(out[5], cpu, "the valid row draws %d, host %d", out[5], cpu);
    float *hl = malloc(1000 * sizeof(float));
    int32_t ids[3];
    cr_assert(hl);
    for (int i = 0; i < 6; i++) { /* top log-probabilities do not depend on the row parameters */
        kr_log_softmax(b.logits + i * b.ld, hl, b.vocab);
        kr_top_k_ids(hl, b.vocab, 3, ids);
        cr_expect(memcmp(ids, top + 3 * i, sizeof ids) == 0, "row %d top ids", i);
    }
    free(hl);
    launch_free(&l);
    batch_free(&b);
}
