/* Speculative decoding (n-gram drafts, and MTP drafts by the trained default model's head) with
 * HF-verified fixture models of every family: greedy outputs and their log-probabilities are bit for
 * bit those of plain decoding in the same batch configuration (Mamba states kept per draft, DSA and
 * attention rows of refused drafts dropped), and equal up to near-ties under chunked prefills,
 * preemption and prefix-cache hits; sampled outputs follow the distribution computed from the
 * model's own log-probabilities (chi-square); drafts are actually verified and kept (counters);
 * cancelling mid-step leaks no slot or block.
 *
 * Built twice: here on the CPU backend (test_spec), and by tests/gpu/test_spec_cuda.c into test_cuda
 * on the CUDA backend (KR_SPEC_ON_CUDA), where a verification step's products run with more rows than
 * a plain step's and so round differently: there greedy outputs must equal plain decoding's up to the
 * first position where plain decoding's top-2 margin is below GPU_MARGIN, and in models with discrete
 * decisions (MoE routing, DSA top-k selection) a quarter of the requests may take another branch
 * earlier, the bound tests/gpu/test_backend.c sets for batch composition. */
#include "engine.h"

#include "alloc.h"
#include "cache.h"
#include "log.h"

#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef KR_SPEC_ON_CUDA
#include "gpu-test.h"
#define SUITE cuda_spec
#define GPU_MARGIN 0.3f
#define SAMPLED_MTP 1 /* the sampled test drafts with the default model's MTP head */
#else
#define SUITE spec
#endif

#define MAX_GEN 48
#define N_REQ 24

struct out {
    int32_t tok[MAX_GEN];
    float lp[MAX_GEN];
    float margin[MAX_GEN];
    int32_t top[MAX_GEN][2];
    float top_lp[MAX_GEN][2];
    int32_t n, n_finish, n_error;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static void on_event(const struct kr_event *ev, void *user)
{
    struct out *o = (struct out *)user + ev->index;
    pthread_mutex_lock(&g_mu);
    if (ev->type == KR_EVENT_TOKEN && o->n < MAX_GEN) {
        o->tok[o->n] = ev->token;
        o->lp[o->n] = ev->logprob;
        o->margin[o->n] = ev->n_top >= 2 ? ev->top_logprobs[0] - ev->top_logprobs[1] : INFINITY;
        for (int32_t i = 0; i < 2 && i < ev->n_top; i++) {
            o->top[o->n][i] = ev->top_ids[i];
            o->top_lp[o->n][i] = ev->top_logprobs[i];
        }
        o->n++;
    } else if (ev->type == KR_EVENT_FINISH) {
        o->n_finish++;
    } else if (ev->type == KR_EVENT_ERROR) {
        o->n_error++;
    }
    pthread_mutex_unlock(&g_mu);
}

static kr_backend_t g_be;
static struct kr_model *g_m;

/* Loads `rel` (a directory under the fixtures, $KR_FIXTURES when set), its multi-token-prediction
 * head too when `mtp`. */
static void load_mtp(const char *rel, bool mtp)
{
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    const char *root = getenv("KR_FIXTURES");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/%s", root && *root ? root : KR_FIXTURES, rel);
    struct kr_err err = {0};
#ifdef KR_SPEC_ON_CUDA
    GT_REQUIRE_GPU();
    cr_assert_eq(kr_backend_cuda_create(0, true, &g_be, &err), KR_OK, "%s", err.msg);
#else
    g_be = kr_backend_cpu_create(2);
#endif
    const struct kr_model_load_opts o = {.mtp = mtp};
    cr_assert_eq(kr_model_load_opts(dir, g_be, &o, &g_m, &err), KR_OK, "%s: %s", dir, err.msg);
}

static enum kr_spec_method g_method = KR_SPEC_NGRAM; /* how run_cfg.k > 0 drafts */

static void unload(void)
{
    kr_model_free(g_m);
    kr_backend_free(g_be);
    g_m = NULL;
    g_be = NULL;
}

struct run_cfg {
    int32_t k;            /* drafted tokens per step (0: plain decoding) */
    int32_t seqs, tokens, block;
    size_t bytes;
    bool prefix;
    bool backend; /* sampling on the backend (struct kr_engine_config.backend_sampling 1) */
};

static struct kr_engine *make(const struct run_cfg *rc)
{
    struct kr_engine_config cfg;
    kr_engine_config_default(&cfg);
    cfg.max_num_seqs = rc->seqs;
    cfg.max_num_batched_tokens = rc->tokens;
    cfg.cache_bytes = rc->bytes;
    cfg.block_size = rc->block;
    cfg.prefix_caching = rc->prefix;
    cfg.prefix_state_interval = rc->block; /* prompts of a few blocks get snapshots to hit */
    cfg.debug_checks = true;
    if (rc->backend) {
        cfg.backend_sampling = 1;
    }
    if (rc->k > 0) {
        cfg.spec = (struct kr_spec_config){.method = g_method, .k = rc->k, .ngram_min = 1, .ngram_max = 3};
    }
    struct kr_engine *e = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_engine_create(g_m, &cfg, &e, &err), KR_OK, "%s", err.msg);
    return e;
}

static void expect_pools_whole(struct kr_engine *e)
{
    struct kr_cache *c = kr_engine_cache(e);
    kr_prefix_clear(c);
    cr_expect_eq(c->n_free_slots, c->n_slots, "slots leaked: %d of %d free", c->n_free_slots, c->n_slots);
    cr_expect_eq(c->n_free_blocks, c->n_blocks, "blocks leaked: %d of %d free", c->n_free_blocks, c->n_blocks);
}

static uint32_t g_rng = 777;
static uint32_t rnd(uint32_t n)
{
    g_rng = g_rng * 1664525u + 1013904223u;
    return (g_rng >> 8) % n;
}

/* Prompts: even ones repeat a short random pattern (a loop the drafts can follow), odd ones are
 * random. Ids from 3 up, below the model's vocabulary. */
static int32_t g_prompt[N_REQ][80], g_len[N_REQ], g_maxt[N_REQ];

static void make_prompts(void)
{
    const int32_t V = (int32_t)(g_m->cfg.vocab < 4000 ? g_m->cfg.vocab : 4000);
    g_rng = 777;
    for (int32_t i = 0; i < N_REQ; i++) {
        g_len[i] = 6 + (int32_t)rnd(60);
        g_maxt[i] = 8 + (int32_t)rnd(MAX_GEN - 8);
        const int32_t period = 2 + (int32_t)rnd(5);
        for (int32_t t = 0; t < g_len[i]; t++) {
            g_prompt[i][t] = (i % 2 == 0 && t >= period) ? g_prompt[i][t - period] : 3 + (int32_t)rnd((uint32_t)V - 3);
        }
    }
}

/* Every prompt submitted at once, greedy with two alternatives' log-probabilities; waits. */
static void run_all(const struct run_cfg *rc, struct out *outs, struct kr_engine_stats *st)
{
    struct kr_engine *e = make(rc);
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.0f;
    s.logprobs = 2;
    s.ignore_eos = true;
    memset(outs, 0, N_REQ * sizeof *outs);
    for (int32_t i = 0; i < N_REQ; i++) {
        s.max_tokens = g_maxt[i];
        struct kr_request_params p = {.prompt = g_prompt[i], .n_prompt = g_len[i], .n = 1, .sampling = s,
                                      .cb = on_event, .user = &outs[i]};
        uint64_t id;
        struct kr_err err = {0};
        cr_assert_eq(kr_engine_submit(e, &p, &id, &err), KR_OK, "%s", err.msg);
    }
    kr_engine_wait_idle(e);
    kr_engine_get_stats(e, st);
    expect_pools_whole(e);
    kr_engine_free(e);
}

/* Greedy tokens of `got` equal `ref`'s up to the first position where ref's top-2 margin is below
 * `margin`, in all but at most `may_diverge` requests (each divergence is printed). */
static void expect_same_greedy_within(const struct out *ref, const struct out *got, const char *what, float margin,
                                      int32_t may_diverge)
{
    int32_t diverged = 0;
    for (int32_t i = 0; i < N_REQ; i++) {
        cr_expect_eq(got[i].n_finish, 1, "%s: request %d finished %d times", what, i, got[i].n_finish);
        int32_t t = 0;
        for (; t < ref[i].n && t < got[i].n && ref[i].margin[t] >= margin; t++) {
            if (got[i].tok[t] != ref[i].tok[t]) {
                fprintf(stderr, "%s: request %d token %d is %d, plain %d (plain margin %.4f)\n", what, i, t,
                        got[i].tok[t], ref[i].tok[t], ref[i].margin[t]);
                diverged++;
                break;
            }
        }
        if (t == ref[i].n) {
            cr_expect_eq(got[i].n, ref[i].n, "%s: request %d generated %d tokens, plain %d", what, i, got[i].n,
                         ref[i].n);
        }
    }
    cr_expect_leq(diverged, may_diverge, "%s: %d requests differ from plain decoding before a near-tie (margin %g)",
                  what, diverged, margin);
}

/* Equal up to the first near-tie of the reference: a margin below 1e-4 on the CPU (chunked
 * prefills round differently), GPU_MARGIN on the GPU. */
static void expect_same_greedy(const struct out *ref, const struct out *got, const char *what)
{
#ifdef KR_SPEC_ON_CUDA
    const bool discrete = g_m->cfg.n_expert > 0 || strchr(g_m->cfg.pattern, 'D') != NULL;
    expect_same_greedy_within(ref, got, what, GPU_MARGIN, discrete ? N_REQ / 4 : 0);
#else
    expect_same_greedy_within(ref, got, what, 1e-4f, 0);
#endif
}

/* The same batch configuration with and without drafts: bit for bit on the CPU; on the GPU, whose
 * products round differently with the rows of a verification step, as expect_same_greedy. */
static void expect_bitwise(const struct out *ref, const struct out *got, const char *what)
{
#ifdef KR_SPEC_ON_CUDA
    expect_same_greedy(ref, got, what);
#else
    for (int32_t i = 0; i < N_REQ; i++) {
        cr_expect_eq(got[i].n_finish, 1, "%s: request %d finished %d times", what, i, got[i].n_finish);
        cr_expect_eq(got[i].n, ref[i].n, "%s: request %d generated %d tokens, plain %d", what, i, got[i].n, ref[i].n);
        for (int32_t t = 0; t < ref[i].n && t < got[i].n; t++) {
            cr_expect(got[i].tok[t] == ref[i].tok[t] && got[i].lp[t] == ref[i].lp[t] &&
                          got[i].top_lp[t][0] == ref[i].top_lp[t][0] && got[i].top_lp[t][1] == ref[i].top_lp[t][1],
                      "%s: request %d token %d: %d (lp %.9g) where plain decoding gave %d (lp %.9g)", what, i, t,
                      got[i].tok[t], got[i].lp[t], ref[i].tok[t], ref[i].lp[t]);
            if (got[i].tok[t] != ref[i].tok[t]) {
                break;
            }
        }
    }
#endif
}

static void greedy_family_by(const char *dir, enum kr_spec_method method)
{
    g_method = method;
    load_mtp(dir, method == KR_SPEC_MTP);
    make_prompts();
    static struct out plain[N_REQ], spec[N_REQ], other[N_REQ], plain_small[N_REQ];
    struct kr_engine_stats st;
    size_t slot_b, block_b;
    kr_cache_unit_bytes(g_m, 4, &slot_b, &block_b);
    /* 64 MiB and room for 16 state slots per sequence (running, drafts' and the prefix cache's) */
    const struct run_cfg big = {.k = 0, .seqs = 32, .tokens = 4096, .block = 16,
                                .bytes = ((size_t)64 << 20) + slot_b * 32 * 16};
    run_all(&big, plain, &st);
    /* the same configuration with drafts: every prompt prefilled alike, so bit for bit */
    for (int32_t k = 1; k <= 5; k += 4) {
        struct run_cfg rc = big;
        rc.k = k;
        run_all(&rc, spec, &st);
        char what[64];
        snprintf(what, sizeof what, "%s k=%d", dir, k);
        expect_bitwise(plain, spec, what);
        cr_expect_gt(st.spec_drafts, 0, "%s: no draft was verified", what);
        cr_expect_gt(st.spec_accepted_tokens, 0, "%s: no draft was kept (%llu drafted)", what,
                     (unsigned long long)st.spec_draft_tokens);
        cr_expect_leq(st.spec_accepted_tokens, st.spec_draft_tokens);
        uint64_t per_pos = 0;
        for (int32_t i = 0; i < KR_SPEC_MAX_TOKENS; i++) {
            per_pos += st.spec_accepted_per_pos[i];
            cr_expect(i == 0 || st.spec_accepted_per_pos[i] <= st.spec_accepted_per_pos[i - 1],
                      "a later draft kept more often than an earlier one");
        }
        cr_expect_eq(per_pos, st.spec_accepted_tokens);
    }
    /* 29-token steps over a cache that preempts, with and without drafts: the same steps cannot
     * be kept (drafts take room), so equal up to near-ties */
    struct run_cfg small = {.k = 0, .seqs = 12, .tokens = 29, .block = 4, .bytes = 0, .prefix = false};
    small.bytes = slot_b * (12 + 4 * 12 / 4) + block_b * 48;
    run_all(&small, plain_small, &st);
    small.k = 4;
    run_all(&small, other, &st);
    expect_same_greedy(plain, other, "small steps and cache, drafts");
    cr_expect_gt(st.spec_accepted_tokens, 0, "%s: small cache: no draft kept", dir);
    /* prefix caching: the prompts again, hitting what the first pass cached */
    struct run_cfg pc = big;
    pc.k = 4;
    pc.prefix = true;
    struct kr_engine *e = make(&pc);
    for (int32_t pass = 0; pass < 2; pass++) {
        struct kr_sampling s;
        kr_sampling_default(&s);
        s.temperature = 0.0f;
        s.logprobs = 2;
        s.ignore_eos = true;
        memset(other, 0, sizeof other);
        for (int32_t i = 0; i < N_REQ; i++) {
            s.max_tokens = g_maxt[i];
            struct kr_request_params p = {.prompt = g_prompt[i], .n_prompt = g_len[i], .n = 1, .sampling = s,
                                          .cb = on_event, .user = &other[i]};
            uint64_t id;
            struct kr_err err = {0};
            cr_assert_eq(kr_engine_submit(e, &p, &id, &err), KR_OK, "%s", err.msg);
        }
        kr_engine_wait_idle(e);
        expect_same_greedy(plain, other, pass ? "prefix cache, second pass" : "prefix cache, first pass");
    }
    kr_engine_get_stats(e, &st);
    cr_expect_gt(st.prefix_hits, 0, "%s: the second pass hit nothing (queries %llu, snapshots %llu, evicted %llu)", dir, (unsigned long long)st.prefix_queries, (unsigned long long)st.prefix_snapshots, (unsigned long long)st.prefix_evicted_snapshots);
    expect_pools_whole(e);
    kr_engine_free(e);
    unload();
    g_method = KR_SPEC_NGRAM;
}

static void greedy_family(const char *dir)
{
    greedy_family_by(dir, KR_SPEC_NGRAM);
}

TestSuite(SUITE, .timeout = 900);

/* hy_share (M and D layers) loaded, the prompts made, plain decoding with sampling on the backend
 * run into plain; the configuration returned drafts 3 tokens with the same batch and cache. */
static struct run_cfg backend_sampling_plain(struct out *plain, struct kr_engine_stats *st)
{
    load_mtp("hybrid/hy_share", false);
    make_prompts();
    size_t slot_b, block_b;
    kr_cache_unit_bytes(g_m, 4, &slot_b, &block_b);
    struct run_cfg rc = {.k = 0, .seqs = 32, .tokens = 4096, .block = 16, .backend = true,
                         .bytes = ((size_t)64 << 20) + slot_b * 32 * 16};
    run_all(&rc, plain, st);
    rc.k = 3;
    return rc;
}

/* Cancellations that land mid-step (after the forward pass, before sampling: the engine applies the
 * ones queued while the device computed, as a client leaving does) end a verifying sequence's drafts;
 * the step's later rows must still reach their own sequences. Every other looping (drafting) request
 * cancels itself at its 10th token: with sampling on the backend, events are delivered while the
 * next step's forward pass runs, so the cancellation is applied inside a step the request may be
 * verifying drafts in. The requests not cancelled answer as plain decoding does (before, a verifying
 * sequence cancelled mid-step was counted with one row instead of its 1 + drafts, and the rows after
 * it went to the wrong sequences: this test failed three times in three). */
static struct out *g_watch; /* the outputs array: a callback's request index */
static struct kr_engine *g_cancel_e;
static uint64_t g_cancel_ids[N_REQ];
static int32_t g_cancel_at[N_REQ], g_n_cancel;

static void on_event_cancelling(const struct kr_event *ev, void *user)
{
    on_event(ev, user);
    struct out *o = (struct out *)user + ev->index;
    pthread_mutex_lock(&g_mu);
    const int32_t at = (int32_t)(o - g_watch);
    const bool now = ev->type == KR_EVENT_TOKEN && o->n == 10;
    pthread_mutex_unlock(&g_mu);
    for (int32_t i = 0; now && i < g_n_cancel; i++) {
        if (g_cancel_at[i] == at) {
            kr_engine_cancel(g_cancel_e, g_cancel_ids[i]);
        }
    }
}

Test(SUITE, drafting_sequences_cancelled_mid_step_leave_the_others_rows_alone)
{
    static struct out plain[N_REQ], spec[N_REQ];
    struct kr_engine_stats st;
    struct run_cfg rc = backend_sampling_plain(plain, &st);
    struct kr_engine *e = make(&rc);
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.0f;
    s.logprobs = 2;
    s.ignore_eos = true;
    memset(spec, 0, sizeof spec);
    g_watch = &spec[0];
    g_cancel_e = e;
    g_n_cancel = 0;
    bool cancelled[N_REQ] = {false};
    for (int32_t i = 0; i < N_REQ; i++) {
        s.max_tokens = MAX_GEN; /* long enough to be running when the cancellations come */
        struct kr_request_params p = {.prompt = g_prompt[i], .n_prompt = g_len[i], .n = 1, .sampling = s,
                                      .cb = on_event_cancelling, .user = &spec[i]};
        uint64_t id;
        struct kr_err err = {0};
        cr_assert_eq(kr_engine_submit(e, &p, &id, &err), KR_OK, "%s", err.msg);
        if (i % 4 == 2) { /* looping prompts draft from the start */
            g_cancel_at[g_n_cancel] = i;
            g_cancel_ids[g_n_cancel++] = id;
            cancelled[i] = true;
        }
    }
    kr_engine_wait_idle(e);
    kr_engine_get_stats(e, &st);
    expect_pools_whole(e);
    kr_engine_free(e);
    cr_expect_gt(st.spec_drafts, 0, "no draft was verified");
    int32_t ended_early = 0;
    for (int32_t i = 0; i < N_REQ; i++) {
        if (cancelled[i]) {
            ended_early += spec[i].n < MAX_GEN;
            spec[i] = plain[i]; /* not compared */
        } else {
            spec[i].n = spec[i].n < plain[i].n ? spec[i].n : plain[i].n; /* plain ran to its own max_tokens */
        }
    }
    cr_expect_gt(ended_early, 0, "no cancellation took effect");
    expect_same_greedy(plain, spec, "hy_share, drafting requests cancelled mid-step");
    unload();
}

/* Sampling on the backend: a step's rows of sequences verifying drafts are copied to the host and
 * verified there while the other rows are sampled on the backend (before, one verifying sequence
 * sent every row of the step to the host). Every row must reach its own sequence: greedy outputs
 * (and on the CPU their log-probabilities) equal plain decoding's with backend sampling, and drafts
 * are verified and kept in steps beside plain rows (N_REQ sequences, half of them drafting from
 * their prompts). */
Test(SUITE, drafts_verified_beside_rows_sampled_on_the_backend)
{
    static struct out plain[N_REQ], spec[N_REQ];
    struct kr_engine_stats st;
    struct run_cfg rc = backend_sampling_plain(plain, &st);
    run_all(&rc, spec, &st);
    expect_same_greedy(plain, spec, "hy_share, backend sampling, k=3");
#ifndef KR_SPEC_ON_CUDA
    /* on the GPU a verification step's products round differently (see the header): tokens only */
    for (int32_t i = 0; i < N_REQ; i++) {
        for (int32_t t = 0; t < plain[i].n && t < spec[i].n && spec[i].tok[t] == plain[i].tok[t]; t++) {
            /* the host's and the backend's log-softmax of the same row (1e-5: their summation orders) */
            cr_expect(fabsf(spec[i].lp[t] - plain[i].lp[t]) <= 1e-5f, "request %d token %d: lp %.9g, plain %.9g", i,
                      t, spec[i].lp[t], plain[i].lp[t]);
        }
    }
#endif
    cr_expect_gt(st.spec_drafts, 0, "no draft was verified");
    cr_expect_gt(st.spec_accepted_tokens, 0, "no draft was kept (%llu drafted)",
                 (unsigned long long)st.spec_draft_tokens);
    unload();
}

/* Drafts by the trained default model's MTP head (its D and E blocks with caches of their own, run
 * after each step and chained for later drafts): the same exactness as n-gram drafts. */
Test(SUITE, greedy_equals_plain_decoding_mtp_default_model)
{
    greedy_family_by("../../models/small-hybrid", KR_SPEC_MTP);
}

/* Drafts by a DeepSeek-V3.2 checkpoint's MTP layer (model.layers.N.*: attention with its indexer, MoE,
 * its own embedding and head; FP8 blocks). */
Test(SUITE, greedy_equals_plain_decoding_mtp_deepseek)
{
    greedy_family_by("deepseek_v32/ds_fp8", KR_SPEC_MTP);
}

/* Drafts by a layer in Nemotron 3's layout (mtp.layers.j.*: GQA attention with a KV cache of its own,
 * then MoE; random weights, so few drafts are kept). */
Test(SUITE, greedy_equals_plain_decoding_mtp_nemotron3)
{
    greedy_family_by("nemotron_h/nh_mtp", KR_SPEC_MTP);
}

Test(SUITE, greedy_equals_plain_decoding_nemotron_h)
{
    greedy_family("nemotron_h/nh_moe");
}

Test(SUITE, greedy_equals_plain_decoding_nemotron_h_long_chunks)
{
    greedy_family("nemotron_h/nh_long_chunks");
}

Test(SUITE, greedy_equals_plain_decoding_hybrid_dsa)
{
    greedy_family("hybrid/hy_share");
}

Test(SUITE, greedy_equals_plain_decoding_hybrid_mla)
{
    greedy_family("hybrid/hy_plus");
}

Test(SUITE, greedy_equals_plain_decoding_deepseek_v32)
{
    greedy_family("deepseek_v32/ds_short");
}

Test(SUITE, greedy_equals_plain_decoding_default_model)
{
    greedy_family("../../models/tiny-hybrid");
}

/* One request on engine e; waits for it. */
static void run_one(struct kr_engine *e, const int32_t *prompt, int32_t n, const struct kr_sampling *s, struct out *o)
{
    memset(o, 0, sizeof *o);
    struct kr_request_params p = {.prompt = prompt, .n_prompt = n, .n = 1, .sampling = *s, .cb = on_event, .user = o};
    uint64_t id;
    struct kr_err err = {0};
    cr_assert_eq(kr_engine_submit(e, &p, &id, &err), KR_OK, "%s", err.msg);
    kr_engine_wait_idle(e);
    cr_assert_eq(o->n_error, 0);
}

/* The exact probability of every outcome of D tokens after prompt[0..n): P(t1..tD) = prod q(t_i | prefix),
 * q the softmax at temperature T over the top two log-probabilities of each prefix, read from plain greedy
 * runs. Leaves are numbered by their choices, the first choice the highest bit. */
enum { D = 4, LEAVES = 1 << D };
static void tree(struct kr_engine *e, int32_t *prompt, int32_t n, int32_t depth, int32_t leaf, double p, double T,
                 int32_t ids[LEAVES][D], double prob[LEAVES])
{
    if (depth == D) {
        memcpy(ids[leaf], prompt + n - D, D * sizeof(int32_t));
        prob[leaf] = p;
        return;
    }
    struct kr_sampling g;
    kr_sampling_default(&g);
    g.temperature = 0.0f;
    g.logprobs = 2;
    g.ignore_eos = true;
    g.max_tokens = 1;
    struct out *o = calloc(1, sizeof *o);
    cr_assert_not_null(o);
    run_one(e, prompt, n, &g, o);
    for (int32_t c = 0; c < 2; c++) {
        const double q = 1.0 / (1.0 + exp((o->top_lp[0][1 - c] - o->top_lp[0][c]) / T));
        prompt[n] = o->top[0][c];
        tree(e, prompt, n + 1, depth + 1, leaf * 2 + c, p * q, T, ids, prob);
    }
    free(o);
}

/* The draws with drafts follow the distribution that temperature 0.8 and top-k 2 make of the model's
 * own log-probabilities: four tokens after a prompt ending in the model's greedy loop (so that the
 * drafts are often drawn and up to two of them verified in one step), 16 outcomes whose probabilities
 * come from plain greedy runs, 300 seeded draws with drafts (3000 pass too, in 12 minutes under the sanitizers), chi-square (p > 0.001). */
Test(SUITE, sampled_outputs_follow_the_models_distribution)
{
#ifdef SAMPLED_MTP
    /* on the GPU, the drafts of the trained default model's MTP head (its passes on the device) */
    g_method = KR_SPEC_MTP;
    load_mtp("../../models/small-hybrid", true);
#else
    load_mtp("../../models/tiny-hybrid", false); /* its greedy continuations fall into loops */
#endif
    const struct run_cfg plain_cfg = {.k = 0, .seqs = 8, .tokens = 4096, .block = 16, .bytes = (size_t)64 << 20};
    struct kr_engine *e = make(&plain_cfg);
    struct kr_sampling g;
    kr_sampling_default(&g);
    g.temperature = 0.0f;
    g.ignore_eos = true;
    /* the prompt: a seed and the model's greedy continuation of it */
    int32_t prompt[48 + D];
    int32_t n = 8;
    for (int32_t i = 0; i < n; i++) {
        prompt[i] = 10 + 7 * i;
    }
    static struct out o;
    g.max_tokens = 40;
    run_one(e, prompt, n, &g, &o);
    cr_assert_eq(o.n, 40);
    memcpy(prompt + n, o.tok, 40 * sizeof(int32_t));
    n += 40;
    const double T = 0.8;
    static int32_t ids[LEAVES][D];
    static double prob[LEAVES];
    tree(e, prompt, n, 0, 0, 1.0, T, ids, prob);
    kr_engine_free(e);
    /* draws with up to three drafts per step */
    enum { N = 300 };
#ifdef SAMPLED_MTP
    /* 256 of the default model's state slots take 142 MB */
    const struct run_cfg spec_cfg = {.k = 3, .seqs = 256, .tokens = 8192, .block = 16, .bytes = (size_t)512 << 20};
#else
    const struct run_cfg spec_cfg = {.k = 3, .seqs = 256, .tokens = 8192, .block = 16, .bytes = (size_t)128 << 20};
#endif
    e = make(&spec_cfg);
    static struct out outs[N];
    memset(outs, 0, sizeof outs);
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = (float)T;
    s.top_k = 2;
    s.max_tokens = D;
    s.ignore_eos = true;
    s.has_seed = true;
    for (int32_t i = 0; i < N; i++) {
        s.seed = 1000u + (uint64_t)i;
        struct kr_request_params p = {.prompt = prompt, .n_prompt = n, .n = 1, .sampling = s, .cb = on_event,
                                      .user = &outs[i]};
        uint64_t id;
        struct kr_err err = {0};
        cr_assert_eq(kr_engine_submit(e, &p, &id, &err), KR_OK, "%s", err.msg);
    }
    kr_engine_wait_idle(e);
    struct kr_engine_stats st;
    kr_engine_get_stats(e, &st);
    expect_pools_whole(e);
    kr_engine_free(e);
    unload();
    g_method = KR_SPEC_NGRAM;
    int32_t count[LEAVES + 1] = {0}; /* [LEAVES]: an outcome outside the tree (top-k 2 makes it impossible) */
    for (int32_t i = 0; i < N; i++) {
        cr_assert_eq(outs[i].n, D, "draw %d: %d tokens", i, outs[i].n);
        int32_t j = 0;
        while (j < LEAVES && memcmp(ids[j], outs[i].tok, sizeof ids[j]) != 0) {
            j++;
        }
        count[j]++;
    }
    cr_expect_eq(count[LEAVES], 0, "%d draws outside the top-2 tree", count[LEAVES]);
    /* outcomes expected fewer than 5 times are pooled */
    double chi2 = 0.0, pooled_e = 0.0;
    int32_t pooled_o = 0, bins = 0;
    for (int32_t j = 0; j < LEAVES; j++) {
        const double ex = prob[j] * N;
        if (ex < 5.0) {
            pooled_e += ex;
            pooled_o += count[j];
            continue;
        }
        chi2 += (count[j] - ex) * (count[j] - ex) / ex;
        bins++;
    }
    if (pooled_e >= 1.0) {
        chi2 += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
        bins++;
    }
    /* the 0.999 quantiles of chi-square with 1..15 degrees of freedom */
    static const double crit[16] = {0,     10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32,
                                    26.12, 27.88, 29.59, 31.26, 32.91, 34.53, 36.12, 37.70};
    cr_assert_gt(bins, 1, "the model's top-2 tree leaves one outcome: nothing to test");
    cr_expect_lt(chi2, crit[bins - 1], "chi-square %.2f over %d bins (limit %.2f): the draws do not follow the "
                 "model's distribution", chi2, bins, crit[bins - 1]);
    /* and drafts were drawn: some kept, the second of a step among them */
    cr_expect_gt(st.spec_accepted_tokens, (uint64_t)N / 4, "drafts kept: %llu of %llu",
                 (unsigned long long)st.spec_accepted_tokens, (unsigned long long)st.spec_draft_tokens);
    cr_expect_gt(st.spec_accepted_per_pos[1], 0, "no second draft was ever kept");
}
