/* The CPU reference forward pass against HF transformers on tiny random-weight checkpoints:
 * nemotron_h (tools/reference/make_nemotron_h_fixtures.py), deepseek_v32 and hybrid Mamba/DSA
 * models (tools/reference/make_dsa_fixtures.py). HF computes in fp32 from the same stored
 * weights, without caches. Tolerances: log-probabilities within 1e-3 absolute of HF
 * at every position and vocabulary entry; our own prefill/decode/chunking variants within 1e-4
 * of each other (fp32 rounding of a different summation order); batch composition bitwise. */
#include "fixture.h"
#include "runner.h"
#include "sampler.h"

#include "alloc.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HF_TOL 1e-3
#define SELF_TOL 1e-4
#define FP8_MIN_OVERLAP 0.85

#define N_FIXTURES FX_N_ALL
static int fixture_idx[N_FIXTURES] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
_Static_assert(sizeof fixture_idx / sizeof fixture_idx[0] == N_FIXTURES, "one index per fixture");

#define FIXTURE_PARAMS(test)                                                                       \
    ParameterizedTestParameters(hf_models, test)                                               \
    {                                                                                              \
        return cr_make_param_array(int, fixture_idx, N_FIXTURES);                                  \
    }

FIXTURE_PARAMS(prompt_logprobs_match_hf)
ParameterizedTest(int *idx, hf_models, prompt_logprobs_match_hf)
{
    const char *const *name = &fx_all[*idx].name;
    struct fx f;
    fx_load(&f, fx_all[*idx].family, *name, 2, 2);
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        float *lp = kr_malloc((size_t)p->n * (size_t)f.vocab * sizeof(float));
        struct kr_err err = {0};
        cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, 0, lp, &err), KR_OK, "%s", err.msg);
        for (int32_t t = 0; t < p->n; t++) {
            double d = max_abs_diff(lp + (size_t)t * f.vocab, p->logprobs + (size_t)t * f.vocab, f.vocab);
            cr_expect_leq(d, HF_TOL, "%s prompt %d (len %d) position %d: max |logprob - HF| = %g", *name, i, p->n, t, d);
        }
        kr_free(lp);
    }
    fx_free(&f);
}

FIXTURE_PARAMS(greedy_matches_hf)
ParameterizedTest(int *idx, hf_models, greedy_matches_hf)
{
    const char *const *name = &fx_all[*idx].name;
    struct fx f;
    fx_load(&f, fx_all[*idx].family, *name, 2, 2);
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        int32_t out[64], n_out = 0;
        struct kr_err err = {0};
        cr_assert_eq(kr_run_greedy(f.m, f.c, p->ids, p->n, 0, p->n_greedy, true, out, NULL, &n_out, &err), KR_OK,
                     "%s", err.msg);
        cr_assert_eq(n_out, p->n_greedy);
        int32_t compared = 0;
        for (int32_t k = 0; k < p->n_greedy; k++) {
            /* beyond the first near-tie of HF's top two, either continuation is legitimate */
            if (p->margin[k] < 1e-3f) {
                break;
            }
            cr_expect_eq(out[k], p->greedy[k], "%s prompt %d: greedy token %d is %d, HF %d", *name, i, k, out[k],
                         p->greedy[k]);
            compared++;
        }
        cr_expect_gt(compared, 0, "%s prompt %d: HF's first greedy margin is a near-tie, nothing compared", *name, i);
    }
    fx_free(&f);
}

FIXTURE_PARAMS(prefill_then_decode_equals_prefill)
ParameterizedTest(int *idx, hf_models, prefill_then_decode_equals_prefill)
{
    const char *const *name = &fx_all[*idx].name;
    struct fx f;
    fx_load(&f, fx_all[*idx].family, *name, 2, 2);
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        if (p->n < 3) {
            continue;
        }
        const int32_t k = p->n / 3 + 1; /* the last k tokens go one by one */
        float *rows = kr_malloc((size_t)p->n * (size_t)f.vocab * sizeof(float));
        /* prefill of n-k tokens, then k single-token decode steps, through kr_model_forward */
        struct kr_seq_cache sc;
        cr_assert_eq(kr_seq_cache_init(f.c, &sc), KR_OK);
        cr_assert_eq(kr_seq_cache_reserve(f.c, &sc, p->n), KR_OK);
        for (int32_t start = 0; start < p->n;) {
            int32_t nt = start == 0 ? p->n - k : 1;
            int32_t pos[256], outs[256], tok0[2] = {0, nt}, pos0 = start;
            for (int32_t j = 0; j < nt; j++) {
                pos[j] = start + j;
                outs[j] = j;
            }
            struct kr_batch b = {.n_tok = nt, .n_seq = 1, .tokens = p->ids + start, .pos = pos, .seq_tok0 = tok0,
                                 .seq_pos0 = &pos0, .seq_slot = &sc.slot, .block_table = sc.blocks,
                                 .max_blocks = sc.n_blocks, .n_out = nt, .out_tok = outs};
            struct kr_err err = {0};
            cr_assert_eq(kr_model_forward(f.m, f.c, &b, rows + (size_t)start * f.vocab, &err), KR_OK, "%s", err.msg);
            for (int32_t j = 0; j < nt; j++) {
                float *row = rows + (size_t)(start + j) * f.vocab;
                kr_log_softmax(row, row, f.vocab);
            }
            start += nt;
        }
        kr_seq_cache_release(f.c, &sc);
        float *one = kr_malloc((size_t)p->n * (size_t)f.vocab * sizeof(float));
        struct kr_err err = {0};
        cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, 0, one, &err), KR_OK);
        for (int32_t t = 0; t < p->n; t++) {
            double d = max_abs_diff(rows + (size_t)t * f.vocab, one + (size_t)t * f.vocab, f.vocab);
            cr_expect_leq(d, SELF_TOL, "%s prompt %d: prefill %d + decode, position %d differs by %g", *name, i,
                          p->n - k, t, d);
            d = max_abs_diff(rows + (size_t)t * f.vocab, p->logprobs + (size_t)t * f.vocab, f.vocab);
            cr_expect_leq(d, HF_TOL, "%s prompt %d: decode path vs HF at position %d: %g", *name, i, t, d);
        }
        kr_free(one);
        kr_free(rows);
    }
    fx_free(&f);
}

FIXTURE_PARAMS(any_chunking_equals_one_shot)
ParameterizedTest(int *idx, hf_models, any_chunking_equals_one_shot)
{
    const char *const *name = &fx_all[*idx].name;
    struct fx f;
    fx_load(&f, fx_all[*idx].family, *name, 2, 2);
    static const int32_t chunks[] = {1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 64};
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        const size_t sz = (size_t)p->n * (size_t)f.vocab;
        float *one = kr_malloc(sz * sizeof(float)), *ch = kr_malloc(sz * sizeof(float));
        struct kr_err err = {0};
        cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, 0, one, &err), KR_OK);
        for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
            if (chunks[c] >= p->n) {
                continue;
            }
            cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, chunks[c], ch, &err), KR_OK, "%s", err.msg);
            double d = max_abs_diff(ch, one, (int64_t)sz);
            cr_expect_leq(d, SELF_TOL, "%s prompt %d (len %d): chunks of %d differ from one-shot by %g", *name, i, p->n,
                          chunks[c], d);
            d = max_abs_diff(ch, p->logprobs, (int64_t)sz);
            cr_expect_leq(d, HF_TOL, "%s prompt %d: chunks of %d vs HF: %g", *name, i, chunks[c], d);
        }
        kr_free(one);
        kr_free(ch);
    }
    fx_free(&f);
}

FIXTURE_PARAMS(mixed_batch_equals_alone)
ParameterizedTest(int *idx, hf_models, mixed_batch_equals_alone)
{
    const char *const *name = &fx_all[*idx].name;
    struct fx f;
    fx_load(&f, fx_all[*idx].family, *name, 2, 16);
    const int32_t ns = f.n_prompts;
    struct drv_seq together[16], alone;
    static const int32_t chunk_of[] = {3, 64, 1, 7, 16, 5};
    const int32_t n_dec = 6;
    for (int32_t i = 0; i < ns; i++) {
        struct fx_prompt *p = &f.prompts[i];
        together[i] = (struct drv_seq){.prompt = p->ids, .n_prompt = p->n, .chunk = chunk_of[i % 6],
                                       .start_step = i % 3, .n_decode = n_dec};
        together[i].rows = kr_malloc((size_t)(p->n + n_dec) * (size_t)f.vocab * sizeof(float));
        together[i].gen = kr_malloc((size_t)n_dec * sizeof(int32_t));
    }
    drv_run(f.m, f.c, together, ns);
    for (int32_t i = 0; i < ns; i++) {
        struct fx_prompt *p = &f.prompts[i];
        alone = together[i];
        alone.start_step = 0;
        alone.rows = kr_malloc((size_t)(p->n + n_dec) * (size_t)f.vocab * sizeof(float));
        alone.gen = kr_malloc((size_t)n_dec * sizeof(int32_t));
        drv_run(f.m, f.c, &alone, 1);
        const size_t nrows = (size_t)(p->n + n_dec - 1);
        cr_expect(memcmp(alone.rows, together[i].rows, nrows * (size_t)f.vocab * sizeof(float)) == 0,
                  "%s prompt %d: results in a mixed batch differ from the same sequence alone (max %g)", *name, i,
                  max_abs_diff(alone.rows, together[i].rows, (int64_t)(nrows * (size_t)f.vocab)));
        cr_expect(memcmp(alone.gen, together[i].gen, (size_t)n_dec * sizeof(int32_t)) == 0,
                  "%s prompt %d: greedy tokens differ between batch and alone", *name, i);
        double d = max_abs_diff(together[i].rows, p->logprobs, (int64_t)p->n * f.vocab);
        cr_expect_leq(d, HF_TOL, "%s prompt %d: mixed batch vs HF: %g", *name, i, d);
        kr_free(alone.rows);
        kr_free(alone.gen);
        kr_free(together[i].rows);
        kr_free(together[i].gen);
    }
    /* every slot and block came back */
    cr_expect_eq(f.c->n_free_slots, f.c->n_slots);
    cr_expect_eq(f.c->n_free_blocks, f.c->n_blocks);
    fx_free(&f);
}

/* ---- DSA-specific checks ------------------------------------------------------------------------ */

static int dsa_fixture_idx[] = {5, 6, 7, 8, 9, 10, 11, 12};
#define N_DSA ((int)(sizeof dsa_fixture_idx / sizeof dsa_fixture_idx[0]))

/* Collects the selections of every D layer of a run, in call order. */
#define CAP_CALLS 256 /* D-layer calls of one run: prompts up to 150 tokens in chunks of 3, two D layers */

struct capture {
    int32_t n_calls;
    int32_t layer[CAP_CALLS];
    int32_t n_tok[CAP_CALLS];
    int32_t pos0[CAP_CALLS];
    int32_t *idx[CAP_CALLS];
    int32_t topk;
};

static void on_index(void *user, int32_t layer, const struct kr_batch *b, const int32_t *idx, int32_t topk)
{
    struct capture *cap = user;
    cr_assert(cap->n_calls < CAP_CALLS && b->n_seq == 1);
    const int32_t i = cap->n_calls++;
    cap->layer[i] = layer;
    cap->n_tok[i] = b->n_tok;
    cap->pos0[i] = b->seq_pos0[0];
    cap->topk = topk;
    cap->idx[i] = kr_malloc((size_t)b->n_tok * (size_t)topk * sizeof(int32_t));
    memcpy(cap->idx[i], idx, (size_t)b->n_tok * (size_t)topk * sizeof(int32_t));
}

/* The ordinal of an indexed D layer among the indexed ones (those sharing a selection have none;
 * calls come per step in layer order). */
static int32_t d_ordinal(const struct kr_model_config *c, int32_t layer)
{
    int32_t ord = 0;
    for (int32_t l = 0; l < layer; l++) {
        ord += c->pattern[l] == KR_LAYER_DSA && kr_model_config_topk_source(c, l) == l;
    }
    return ord;
}

/* HF's selection [K] for query position t of D layer `ord`. */
static const int32_t *hf_set(const struct fx_prompt *p, int32_t ord, int32_t t, int32_t K)
{
    return p->sets + ((size_t)ord * (size_t)p->n + (size_t)t) * (size_t)K;
}

static void capture_free(struct capture *cap)
{
    for (int32_t i = 0; i < cap->n_calls; i++) {
        kr_free(cap->idx[i]);
    }
    memset(cap, 0, sizeof *cap);
}

/* Runs prompt p (in chunks of `chunk`, 0: whole) into lp [p->n, vocab], recording every D layer's
 * selections into cap. */
static void run_capturing(struct fx *f, const struct fx_prompt *p, int32_t chunk, float *lp, struct capture *cap)
{
    memset(cap, 0, sizeof *cap);
    f->m->on_index = on_index;
    f->m->on_index_user = cap;
    struct kr_err err = {0};
    cr_assert_eq(kr_run_prompt_logprobs(f->m, f->c, p->ids, p->n, chunk, lp, &err), KR_OK, "%s", err.msg);
    f->m->on_index = NULL;
}

ParameterizedTestParameters(hf_models, index_sets_match_hf)
{
    return cr_make_param_array(int, dsa_fixture_idx, N_DSA);
}

/* The positions the lightning indexer selects equal HF's for every D layer and query, whether the
 * prompt is prefilled at once or in chunks (queries see every cached key). */
ParameterizedTest(int *idx, hf_models, index_sets_match_hf)
{
    const char *name = fx_all[*idx].name;
    struct fx f;
    fx_load(&f, fx_all[*idx].family, name, 2, 2);
    const int32_t K = (int32_t)f.m->cfg.idx_topk;
    const int32_t n_d = d_ordinal(&f.m->cfg, f.m->cfg.n_layer);
    cr_assert_gt(n_d, 0);
    static const int32_t chunks[] = {0, 3};
    for (size_t ci = 0; ci < 2; ci++) {
        for (int32_t i = 0; i < f.n_prompts; i++) {
            struct fx_prompt *p = &f.prompts[i];
            cr_assert_eq(p->n_dsa, n_d, "%s prompt %d: HF recorded %d D layers, the model has %d", name, i, p->n_dsa,
                         n_d);
            struct capture cap;
            float *lp = kr_malloc((size_t)p->n * (size_t)f.vocab * sizeof(float));
            run_capturing(&f, p, chunks[ci], lp, &cap);
            int32_t mismatches = 0, compared = 0;
            for (int32_t k = 0; k < cap.n_calls; k++) {
                const int32_t ord = d_ordinal(&f.m->cfg, cap.layer[k]);
                for (int32_t j = 0; j < cap.n_tok[k]; j++) {
                    const int32_t t = cap.pos0[k] + j;
                    const int32_t *ours = cap.idx[k] + (size_t)j * K;
                    const int32_t *hf = hf_set(p, ord, t, K);
                    compared++;
                    if (memcmp(ours, hf, (size_t)K * sizeof(int32_t)) != 0) {
                        if (mismatches++ < 3) {
                            cr_expect(0, "%s prompt %d chunk %d: D layer %d (layer %d) query %d selects a different set",
                                      name, i, chunks[ci], ord, cap.layer[k], t);
                        }
                    }
                }
            }
            cr_expect_eq(mismatches, 0, "%s prompt %d: %d of %d selections differ from HF", name, i, mismatches, compared);
            cr_expect_eq(compared, n_d * p->n);
            capture_free(&cap);
            kr_free(lp);
        }
    }
    fx_free(&f);
}

/* Copies fixture `dir` to a fresh temporary directory with index_topk replaced by `topk`. */
static void copy_with_topk(const char *dir, char *out, size_t n, long topk)
{
    snprintf(out, n, "/tmp/krait-dsa-XXXXXX");
    cr_assert(mkdtemp(out));
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "cp -rL '%s'/. '%s'/", dir, out); /* -L: fixtures may link to models/ */
    cr_assert_eq(system(cmd), 0);
    char path[700];
    snprintf(path, sizeof path, "%s/config.json", out);
    FILE *fp = fopen(path, "rb");
    cr_assert(fp);
    char buf[1 << 16];
    size_t len = fread(buf, 1, sizeof buf - 1, fp);
    fclose(fp);
    buf[len] = 0;
    char *k = strstr(buf, "\"index_topk\"");
    cr_assert(k, "%s has no index_topk", path);
    char *colon = strchr(k, ':');
    char *end = colon + 1;
    while (*end == ' ' || (*end >= '0' && *end <= '9')) {
        end++;
    }
    fp = fopen(path, "wb");
    fwrite(buf, 1, (size_t)(colon + 1 - buf), fp);
    fprintf(fp, " %ld", topk);
    fputs(end, fp);
    fclose(fp);
}

ParameterizedTestParameters(hf_models, dsa_equals_dense_mla_when_context_fits)
{
    return cr_make_param_array(int, dsa_fixture_idx, N_DSA);
}

/* A D layer whose context is at most index_topk equals dense MLA exactly: the same checkpoint with
 * an index_topk beyond every prompt gives bitwise the same log-probabilities on short prompts, and
 * different ones on prompts longer than the original index_topk (the selection matters there). */
ParameterizedTest(int *idx, hf_models, dsa_equals_dense_mla_when_context_fits)
{
    const char *name = fx_all[*idx].name;
    struct fx f, dense;
    fx_load(&f, fx_all[*idx].family, name, 2, 2);
    const int64_t K = f.m->cfg.idx_topk;
    char tmp[64];
    copy_with_topk(f.dir, tmp, sizeof tmp, 1000000);
    memset(&dense, 0, sizeof dense);
    dense.be = kr_backend_cpu_create(2);
    struct kr_err err = {0};
    cr_assert_eq(kr_model_load(tmp, dense.be, &dense.m, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(kr_cache_create(dense.m, 1, 64, 16, &dense.c), KR_OK);
    int32_t n_long = 0, n_long_differ = 0;
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        const size_t sz = (size_t)p->n * (size_t)f.vocab;
        float *a = kr_malloc(sz * sizeof(float)), *b = kr_malloc(sz * sizeof(float));
        cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, 0, a, &err), KR_OK, "%s", err.msg);
        cr_assert_eq(kr_run_prompt_logprobs(dense.m, dense.c, p->ids, p->n, 0, b, &err), KR_OK, "%s", err.msg);
        /* rows of positions t with t + 1 <= K saw no selection in any D layer, provided every earlier
         * layer also saw none: only the first min(n, K) rows are compared */
        const int64_t short_rows = p->n < K ? p->n : K;
        cr_expect(memcmp(a, b, (size_t)short_rows * (size_t)f.vocab * sizeof(float)) == 0,
                  "%s prompt %d: the first %lld positions differ between DSA and dense MLA (max %g)", name, i,
                  (long long)short_rows, max_abs_diff(a, b, short_rows * f.vocab));
        if (p->n > K) {
            n_long++;
            n_long_differ += max_abs_diff(a, b, (int64_t)sz) > 1e-6;
        }
        kr_free(a);
        kr_free(b);
    }
    if (n_long) {
        cr_expect_eq(n_long_differ, n_long, "%s: %d of %d prompts longer than index_topk are unaffected by the selection",
                     name, n_long - n_long_differ, n_long);
    }
    kr_cache_free(dense.c);
    kr_model_free(dense.m);
    kr_backend_free(dense.be);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    cr_assert_eq(system(cmd), 0);
    fx_free(&f);
}

/* ---- the FP8 indexer path ------------------------------------------------------------------------ */

/* FP8 checkpoints choose the FP8 indexer by themselves; others keep bf16; FP8 is refused where it
 * cannot run. */
Test(hf_models, fp8_indexer_is_chosen_for_fp8_checkpoints)
{
    static const struct {
        const char *family, *name;
        bool fp8;
    } cases[] = {{"deepseek_v32", "ds_fp8", true}, {"deepseek_v32", "ds_short", false}, {"hybrid", "hy_mdme", false}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char dir[700];
        snprintf(dir, sizeof dir, "%s/%s/%s", fx_root(), cases[i].family, cases[i].name);
        kr_backend_t be = kr_backend_cpu_create(1);
        struct kr_model *m = NULL;
        struct kr_err err = {0};
        cr_assert_eq(kr_model_load(dir, be, &m, &err), KR_OK, "%s", err.msg);
        cr_expect_eq(m->idx_fp8, cases[i].fp8, "%s: FP8 indexer %d, expected %d", cases[i].name, m->idx_fp8,
                     cases[i].fp8);
        cr_expect_eq(kr_model_set_indexer(m, KR_INDEXER_FP8, &err), KR_OK, "%s", err.msg);
        cr_expect(m->idx_fp8);
        kr_model_free(m);
        kr_backend_free(be);
    }
    char dir[700];
    snprintf(dir, sizeof dir, "%s/nemotron_h/nh_moe", fx_root());
    kr_backend_t be = kr_backend_cpu_create(1);
    struct kr_model *m = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_model_load(dir, be, &m, &err), KR_OK, "%s", err.msg);
    cr_expect_eq(kr_model_set_indexer(m, KR_INDEXER_FP8, &err), KR_ERR_UNSUPPORTED);
    cr_expect(strstr(err.msg, "DSA"), "%s", err.msg);
    kr_model_free(m);
    kr_backend_free(be);
    enum kr_indexer mode;
    cr_expect(kr_indexer_parse("fp8", &mode) && mode == KR_INDEXER_FP8);
    cr_expect(!kr_indexer_parse("fp16", &mode));
}

ParameterizedTestParameters(hf_models, fp8_indexer_stays_close_to_hf)
{
    return cr_make_param_array(int, dsa_fixture_idx, N_DSA);
}

/* The FP8 path (Hadamard, e4m3 queries and keys) against HF's unquantized indexer. e4m3 keeps 3
 * mantissa bits, so scores move by a few percent and a selection can swap keys whose scores are
 * that close: at least FP8_MIN_OVERLAP of HF's selected keys are kept over each fixture (measured
 * 0.93-1.0 on these random-weight models, printed). Positions whose context fits in index_topk see
 * no selection, and there the FP8 path must change nothing: HF's log-probabilities within HF_TOL.
 * (Beyond that, one swapped key moves these tiny random models' log-probabilities by whole units,
 * so they bound nothing useful.) */
ParameterizedTest(int *idx, hf_models, fp8_indexer_stays_close_to_hf)
{
    const char *name = fx_all[*idx].name;
    struct fx f;
    fx_load(&f, fx_all[*idx].family, name, 2, 2);
    struct kr_err err = {0};
    cr_assert_eq(kr_model_set_indexer(f.m, KR_INDEXER_FP8, &err), KR_OK, "%s", err.msg);
    const int32_t K = (int32_t)f.m->cfg.idx_topk;
    int64_t kept = 0, total = 0;
    double worst_lp = 0.0, worst_overlap = 1.0;
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        struct capture cap;
        float *lp = kr_malloc((size_t)p->n * (size_t)f.vocab * sizeof(float));
        run_capturing(&f, p, 0, lp, &cap);
        for (int32_t k = 0; k < cap.n_calls; k++) {
            const int32_t ord = d_ordinal(&f.m->cfg, cap.layer[k]);
            for (int32_t j = 0; j < cap.n_tok[k]; j++) {
                const int32_t t = cap.pos0[k] + j;
                const int32_t *ours = cap.idx[k] + (size_t)j * K;
                const int32_t *hf = hf_set(p, ord, t, K);
                int32_t n_sel = 0, n_same = 0;
                for (int32_t a = 0; a < K; a++) {
                    if (hf[a] < 0) {
                        continue;
                    }
                    n_sel++;
                    for (int32_t b = 0; b < K; b++) {
                        n_same += ours[b] == hf[a];
                    }
                }
                kept += n_same;
                total += n_sel;
                const double ov = n_sel ? (double)n_same / n_sel : 1.0;
                worst_overlap = ov < worst_overlap ? ov : worst_overlap;
            }
        }
        const int64_t fit = p->n < K ? p->n : K;
        const double d = max_abs_diff(lp, p->logprobs, fit * f.vocab);
        worst_lp = d > worst_lp ? d : worst_lp;
        capture_free(&cap);
        kr_free(lp);
    }
    const double overlap = total ? (double)kept / (double)total : 1.0;
    cr_log_info("%s FP8 indexer: %.4f of HF's selected keys kept (worst query %.3f); positions within index_topk "
                "differ from HF by up to %.3g",
                name, overlap, worst_overlap, worst_lp);
    cr_expect_geq(overlap, FP8_MIN_OVERLAP, "%s: the FP8 indexer keeps only %.3f of HF's selections", name, overlap);
    cr_expect_leq(worst_lp, HF_TOL, "%s: positions that see no selection differ from HF by %g with the FP8 indexer",
                  name, worst_lp);
    fx_free(&f);
}

ParameterizedTestParameters(hf_models, short_contexts_skip_the_indexer_queries)
{
    return cr_make_param_array(int, dsa_fixture_idx, N_DSA);
}

/* A step whose every query sees at most index_topk keys does not compute the indexer's query side
 * (the selection would be every visible key): the model's count of indexer query rows stays 0 for
 * prompts that fit, grows for longer ones, and both still match HF (prompt_logprobs_match_hf). */
ParameterizedTest(int *idx, hf_models, short_contexts_skip_the_indexer_queries)
{
    const char *name = fx_all[*idx].name;
    struct fx f;
    fx_load(&f, fx_all[*idx].family, name, 2, 2);
    const int64_t K = f.m->cfg.idx_topk;
    const int32_t n_d = d_ordinal(&f.m->cfg, f.m->cfg.n_layer); /* the layers with an indexer */
    int32_t n_short = 0;
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        float *lp = kr_malloc((size_t)p->n * (size_t)f.vocab * sizeof(float));
        struct kr_err err = {0};
        const uint64_t before = f.m->idx_query_rows;
        cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, 0, lp, &err), KR_OK, "%s", err.msg);
        const uint64_t rows = f.m->idx_query_rows - before;
        if (p->n <= K) {
            n_short++;
            cr_expect_eq(rows, 0, "%s prompt %d (len %d <= index_topk %lld): %llu indexer query rows computed", name,
                         i, p->n, (long long)K, (unsigned long long)rows);
        } else {
            cr_expect_eq(rows, (uint64_t)p->n * (uint64_t)n_d, "%s prompt %d (len %d, one step): %llu query rows", name,
                         i, p->n, (unsigned long long)rows);
        }
        kr_free(lp);
    }
    cr_expect_gt(n_short, 0, "%s: no prompt fits in index_topk %lld", name, (long long)K);
    fx_free(&f);
}
