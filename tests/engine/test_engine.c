/* The batching engine on the CPU backend with an HF-verified fixture model: batch composition,
 * prefill chunking and preemption do not change greedy outputs; seeded sampling is reproducible
 * across batch compositions; n > 1 choices equal independent seeded runs; admission limits,
 * never-fitting requests, cancellation from any state; and a randomized property test of the
 * slot/block ownership with thousands of operations. */
#include "engine.h"

#include "alloc.h"
#include "cache.h"
#include "log.h"
#include "runner.h"

#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define MAX_REQ 4096
#define MAX_GEN 64

/* What one choice received. */
struct choice {
    int32_t tokens[MAX_GEN];
    float margin[MAX_GEN]; /* top1 - top2 log-probability at each step (needs logprobs >= 2) */
    float lp[MAX_GEN];     /* log-probability of each token (needs logprobs >= 0) */
    int32_t top0[MAX_GEN]; /* the most likely alternative (needs logprobs >= 1) */
    int32_t n;
    int32_t n_finish;
    enum kr_finish_reason finish;
    bool after_finish;     /* an event arrived after FINISH */
};

struct rec {
    struct choice ch[4];
    int32_t n_error;
    int32_t n_prompt_lp;
    float plp[256];
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct rec *g_recs;

static void on_event(const struct kr_event *ev, void *user)
{
    struct rec *r = user;
    pthread_mutex_lock(&g_mu);
    if (ev->type == KR_EVENT_ERROR) {
        r->n_error++;
    } else if (ev->type == KR_EVENT_PROMPT_LOGPROBS) {
        r->n_prompt_lp++;
        for (int32_t i = 0; i < ev->n_prompt && i < 256; i++) {
            r->plp[i] = ev->prompt_logprobs[i];
        }
    } else {
        struct choice *c = &r->ch[ev->index];
        if (c->n_finish) {
            c->after_finish = true;
        }
        if (ev->type == KR_EVENT_TOKEN && c->n < MAX_GEN) {
            c->tokens[c->n] = ev->token;
            c->margin[c->n] = ev->n_top >= 2 ? ev->top_logprobs[0] - ev->top_logprobs[1] : INFINITY;
            c->lp[c->n] = ev->logprob;
            c->top0[c->n] = ev->n_top >= 1 ? ev->top_ids[0] : -1;
            c->n++;
        } else if (ev->type == KR_EVENT_FINISH) {
            c->n_finish++;
            c->finish = ev->finish;
        }
    }
    pthread_mutex_unlock(&g_mu);
}

static kr_backend_t g_be;
static struct kr_model *g_m;

static void load_model(const char *family, const char *name)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s/%s", KR_FIXTURES, family, name);
    g_be = kr_backend_cpu_create(2);
    struct kr_err err = {0};
    cr_assert_eq(kr_model_load(dir, g_be, &g_m, &err), KR_OK, "%s", err.msg);
    g_recs = kr_calloc(MAX_REQ, sizeof *g_recs);
    cr_assert(g_recs);
    kr_log_set_level(KR_LOG_LEVEL_WARN);
}

static void setup(void)
{
    load_model("nemotron_h", "nh_moe");
}

static void teardown(void)
{
    kr_model_free(g_m);
    kr_backend_free(g_be);
    kr_free(g_recs);
}

static int32_t g_backend_sampling = -1;

static struct kr_engine *make_engine(int32_t max_seqs, int32_t max_tokens, size_t cache_bytes, int32_t block)
{
    struct kr_engine_config cfg;
    kr_engine_config_default(&cfg);
    cfg.max_num_seqs = max_seqs;
    cfg.max_num_batched_tokens = max_tokens;
    cfg.cache_bytes = cache_bytes;
    cfg.block_size = block;
    cfg.debug_checks = true;
    cfg.backend_sampling = g_backend_sampling;
    struct kr_engine *e = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_engine_create(g_m, &cfg, &e, &err), KR_OK, "%s", err.msg);
    return e;
}

static uint32_t g_rng = 12345;
static uint32_t rnd(uint32_t n)
{
    g_rng = g_rng * 1664525u + 1013904223u;
    return (g_rng >> 8) % n;
}

static void random_prompt(int32_t *ids, int32_t n)
{
    for (int32_t i = 0; i < n; i++) {
        ids[i] = 3 + (int32_t)rnd(250); /* avoid the EOS id 2 in prompts */
    }
}

static uint64_t submit(struct kr_engine *e, const int32_t *ids, int32_t n, struct kr_sampling *s, int32_t n_choices,
                       struct rec *r)
{
    struct kr_request_params p = {.prompt = ids, .n_prompt = n, .n = n_choices, .sampling = *s, .cb = on_event,
                                  .user = r};
    uint64_t id = 0;
    struct kr_err err = {0};
    cr_assert_eq(kr_engine_submit(e, &p, &id, &err), KR_OK, "%s", err.msg);
    return id;
}

static void expect_pools_full(struct kr_engine *e)
{
    struct kr_cache *c = kr_engine_cache(e);
    kr_prefix_clear(c); /* what the prefix cache keeps is held by nobody: evicted, the pools are whole */
    cr_expect_eq(c->n_free_slots, c->n_slots, "slots leaked: %d of %d free", c->n_free_slots, c->n_slots);
    cr_expect_eq(c->n_free_blocks, c->n_blocks, "blocks leaked: %d of %d free", c->n_free_blocks, c->n_blocks);
    for (int32_t b = 0; b < c->n_blocks; b++) {
        cr_expect_eq(c->block_ref[b], 0, "block %d still referenced", b);
    }
}

/* Compares greedy runs up to the first step where the reference's top-2 margin is a near-tie
 * (below 1e-4, where fp32 rounding of a different prefill chunking may legitimately flip it). */
static void expect_same_greedy(const struct choice *ref, const struct choice *got, const char *what, int32_t i)
{
    cr_expect_eq(got->n_finish, 1, "%s: request %d finished %d times", what, i, got->n_finish);
    int32_t n = ref->n < got->n ? ref->n : got->n;
    for (int32_t k = 0; k < n; k++) {
        if (ref->margin[k] < 1e-4f) {
            return;
        }
        cr_expect_eq(got->tokens[k], ref->tokens[k], "%s: request %d token %d is %d, alone %d", what, i, k,
                     got->tokens[k], ref->tokens[k]);
        if (got->tokens[k] != ref->tokens[k]) {
            return;
        }
    }
    cr_expect_eq(got->n, ref->n, "%s: request %d generated %d tokens, alone %d", what, i, got->n, ref->n);
}

TestSuite(engine, .init = setup, .fini = teardown, .timeout = 600);

Test(engine, greedy_outputs_do_not_depend_on_batching_chunking_or_preemption)
{
    enum { N = 64 };
    static int32_t prompts[N][96];
    int32_t len[N], maxt[N];
    for (int32_t i = 0; i < N; i++) {
        len[i] = 1 + (int32_t)rnd(80);
        maxt[i] = 1 + (int32_t)rnd(12);
        random_prompt(prompts[i], len[i]);
    }
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.0f;
    s.logprobs = 2;
    s.ignore_eos = true;
    /* alone: one request at a time, whole prompt in one chunk */
    struct kr_engine *e = make_engine(4, 4096, 64 << 20, 16);
    for (int32_t i = 0; i < N; i++) {
        s.max_tokens = maxt[i];
        submit(e, prompts[i], len[i], &s, 1, &g_recs[i]);
        kr_engine_wait_idle(e);
    }
    expect_pools_full(e);
    kr_engine_free(e);
    /* three batched configurations: all at once with a big budget; a 37-token budget (chunked
     * prefills mixed with decodes); and a cache so small that sequences are preempted */
    struct {
        int32_t seqs, tokens, block;
        size_t bytes;
        const char *what;
    } cfgs[] = {
        {64, 4096, 16, (size_t)64 << 20, "batch of 64"},
        {64, 37, 8, (size_t)64 << 20, "37-token steps"},
        {24, 61, 4, 0, "preempting cache"},
    };
    size_t slot_b, block_b;
    kr_cache_unit_bytes(g_m, 4, &slot_b, &block_b);
    cfgs[2].bytes = slot_b * 24 + block_b * 60; /* 240 tokens for up to 24 sequences of up to 92 */
    for (size_t c = 0; c < 3; c++) {
        struct rec *recs = g_recs + (c + 1) * N;
        e = make_engine(cfgs[c].seqs, cfgs[c].tokens, cfgs[c].bytes, cfgs[c].block);
        for (int32_t i = 0; i < N; i++) {
            s.max_tokens = maxt[i];
            submit(e, prompts[i], len[i], &s, 1, &recs[i]);
        }
        kr_engine_wait_idle(e);
        struct kr_engine_stats st;
        kr_engine_get_stats(e, &st);
        if (c == 2) {
            cr_expect_gt(st.preemptions, 0, "the small cache never preempted");
        }
        for (int32_t i = 0; i < N; i++) {
            expect_same_greedy(&g_recs[i].ch[0], &recs[i].ch[0], cfgs[c].what, i);
            cr_expect_eq(recs[i].ch[0].n, maxt[i]);
        }
        expect_pools_full(e);
        kr_engine_free(e);
    }
}

Test(engine, seeded_sampling_is_reproducible_across_batch_compositions)
{
    enum { N = 24 };
    static int32_t prompts[N][64];
    int32_t len[N];
    for (int32_t i = 0; i < N; i++) {
        len[i] = 1 + (int32_t)rnd(60);
        random_prompt(prompts[i], len[i]);
    }
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.9f;
    s.top_p = 0.95f;
    s.top_k = 50;
    s.presence_penalty = 0.3f;
    s.frequency_penalty = 0.2f;
    s.repetition_penalty = 1.1f;
    s.has_seed = true;
    s.max_tokens = 10;
    s.ignore_eos = true;
    struct kr_engine *e = make_engine(4, 4096, 32 << 20, 16);
    for (int32_t i = 0; i < N; i++) {
        s.seed = 1000 + (uint64_t)i;
        submit(e, prompts[i], len[i], &s, 1, &g_recs[i]);
        kr_engine_wait_idle(e);
    }
    kr_engine_free(e);
    e = make_engine(32, 4096, 32 << 20, 16);
    for (int32_t i = 0; i < N; i++) {
        s.seed = 1000 + (uint64_t)i;
        submit(e, prompts[i], len[i], &s, 1, &g_recs[N + i]);
    }
    kr_engine_wait_idle(e);
    int32_t distinct = 0;
    for (int32_t i = 0; i < N; i++) {
        cr_expect_eq(g_recs[N + i].ch[0].n, 10);
        cr_expect(memcmp(g_recs[i].ch[0].tokens, g_recs[N + i].ch[0].tokens, 10 * sizeof(int32_t)) == 0,
                  "request %d: seeded samples differ between alone and batched", i);
        distinct += memcmp(g_recs[i].ch[0].tokens, g_recs[0].ch[0].tokens, 10 * sizeof(int32_t)) != 0;
    }
    cr_expect_gt(distinct, N / 2, "different prompts and seeds should give different samples");
    expect_pools_full(e);
    kr_engine_free(e);
}

Test(engine, n_choices_equal_independent_seeded_runs)
{
    int32_t prompt[37];
    random_prompt(prompt, 37);
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 1.0f;
    s.has_seed = true;
    s.seed = 77;
    s.max_tokens = 12;
    s.ignore_eos = true;
    s.logprobs = 0;
    struct kr_engine *e = make_engine(8, 4096, 32 << 20, 16);
    submit(e, prompt, 37, &s, 3, &g_recs[0]);
    kr_engine_wait_idle(e);
    for (int32_t i = 0; i < 3; i++) {
        s.seed = 77 + (uint64_t)i;
        submit(e, prompt, 37, &s, 1, &g_recs[1 + i]);
        kr_engine_wait_idle(e);
    }
    for (int32_t i = 0; i < 3; i++) {
        cr_expect_eq(g_recs[0].ch[i].n, 12);
        cr_expect_eq(g_recs[0].ch[i].n_finish, 1);
        cr_expect(memcmp(g_recs[0].ch[i].tokens, g_recs[1 + i].ch[0].tokens, 12 * sizeof(int32_t)) == 0,
                  "choice %d differs from an independent run with seed + %d", i, i);
    }
    cr_expect(memcmp(g_recs[0].ch[0].tokens, g_recs[0].ch[1].tokens, 12 * sizeof(int32_t)) != 0,
              "choices with different seeds should differ");
    struct kr_engine_stats st;
    kr_engine_get_stats(e, &st);
    /* the prompt was prefilled once for the three choices, then three times independently */
    cr_expect_eq(st.prompt_tokens, 4 * 37, "prompt tokens prefilled: %llu", (unsigned long long)st.prompt_tokens);
    expect_pools_full(e);
    kr_engine_free(e);
}

Test(engine, prompt_logprobs_match_the_forward_pass)
{
    int32_t prompt[20];
    random_prompt(prompt, 20);
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.0f;
    s.max_tokens = 1;
    s.prompt_logprobs = 1;
    struct kr_engine *e = make_engine(4, 7, 32 << 20, 16); /* chunks of 7 */
    submit(e, prompt, 20, &s, 1, &g_recs[0]);
    kr_engine_wait_idle(e);
    kr_engine_free(e);
    cr_assert_eq(g_recs[0].n_prompt_lp, 1);
    /* independent: the model's own prompt log-probabilities through the runner */
    struct kr_cache *c = NULL;
    cr_assert_eq(kr_cache_create(g_m, 1, 4, 16, &c), KR_OK);
    float *lp = kr_malloc(20 * 256 * sizeof(float));
    struct kr_err err = {0};
    cr_assert_eq(kr_run_prompt_logprobs(g_m, c, prompt, 20, 7, lp, &err), KR_OK);
    cr_expect(isnan(g_recs[0].plp[0]));
    for (int32_t t = 1; t < 20; t++) {
        cr_expect_float_eq(g_recs[0].plp[t], lp[(t - 1) * 256 + prompt[t]], 1e-6, "position %d", t);
    }
    kr_free(lp);
    kr_cache_free(c);
}

Test(engine, rejects_requests_that_can_never_fit)
{
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.max_tokens = 100;
    size_t slot_b, block_b;
    kr_cache_unit_bytes(g_m, 16, &slot_b, &block_b);
    struct kr_engine *e = make_engine(4, 256, slot_b * 4 + block_b * 8, 16); /* 128 tokens of cache */
    int32_t prompt[64];
    random_prompt(prompt, 64);
    struct kr_request_params p = {.prompt = prompt, .n_prompt = 64, .n = 1, .sampling = s, .cb = on_event,
                                  .user = &g_recs[0]};
    uint64_t id;
    struct kr_err err = {0};
    cr_expect_eq(kr_engine_submit(e, &p, &id, &err), KR_ERR_TOO_LONG);
    cr_expect(strstr(err.msg, "blocks"), "%s", err.msg);
    p.sampling.max_tokens = 5000; /* beyond max_position_embeddings (4096) */
    cr_expect_eq(kr_engine_submit(e, &p, &id, &err), KR_ERR_TOO_LONG);
    cr_expect(strstr(err.msg, "context length"), "%s", err.msg);
    p.sampling.max_tokens = 8;
    p.sampling.temperature = -1.0f;
    cr_expect_eq(kr_engine_submit(e, &p, &id, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "temperature"), "%s", err.msg);
    p.sampling.temperature = 0.0f;
    prompt[3] = 256;
    cr_expect_eq(kr_engine_submit(e, &p, &id, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "vocabulary"), "%s", err.msg);
    prompt[3] = 5;
    cr_expect_eq(kr_engine_submit(e, &p, &id, &err), KR_OK, "%s", err.msg);
    kr_engine_wait_idle(e);
    cr_expect_eq(g_recs[0].ch[0].n, 8);
    kr_engine_free(e);
}

Test(engine, admission_limit_says_busy)
{
    struct kr_engine_config cfg;
    kr_engine_config_default(&cfg);
    cfg.max_num_seqs = 1;
    cfg.max_queued_requests = 2;
    cfg.cache_bytes = 32 << 20;
    struct kr_engine *e = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_engine_create(g_m, &cfg, &e, &err), KR_OK);
    int32_t prompt[8];
    random_prompt(prompt, 8);
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.0f;
    s.max_tokens = 3000;
    s.ignore_eos = true;
    uint64_t a = submit(e, prompt, 8, &s, 1, &g_recs[0]);
    struct kr_engine_stats st;
    do { /* wait until the first request runs */
        usleep(1000);
        kr_engine_get_stats(e, &st);
    } while (st.running == 0);
    uint64_t b = submit(e, prompt, 8, &s, 1, &g_recs[1]);
    uint64_t c = submit(e, prompt, 8, &s, 1, &g_recs[2]);
    struct kr_request_params p = {.prompt = prompt, .n_prompt = 8, .n = 1, .sampling = s, .cb = on_event,
                                  .user = &g_recs[3]};
    uint64_t d;
    cr_expect_eq(kr_engine_submit(e, &p, &d, &err), KR_ERR_BUSY);
    cr_expect(strstr(err.msg, "max_queued_requests"), "%s", err.msg);
    kr_engine_cancel(e, a);
    kr_engine_cancel(e, b);
    kr_engine_cancel(e, c);
    kr_engine_wait_idle(e);
    for (int i = 0; i < 3; i++) {
        cr_expect_eq(g_recs[i].ch[0].n_finish, 1);
        cr_expect_eq(g_recs[i].ch[0].finish, KR_FINISH_CANCELLED);
    }
    expect_pools_full(e);
    kr_engine_free(e);
}

struct canceller {
    struct kr_engine *e;
    uint64_t *ids;
    int32_t n;
};

static void *cancel_thread(void *arg)
{
    struct canceller *c = arg;
    for (int32_t i = 0; i < c->n; i += 3) {
        kr_engine_cancel(c->e, c->ids[i]);
        usleep(200);
    }
    return NULL;
}

Test(engine, cancellation_from_another_thread_frees_everything)
{
    enum { N = 60 };
    static int32_t prompts[N][40];
    uint64_t ids[N];
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.5f;
    s.max_tokens = 20;
    s.ignore_eos = true;
    size_t slot_b, block_b;
    kr_cache_unit_bytes(g_m, 8, &slot_b, &block_b);
    struct kr_engine *e = make_engine(16, 48, slot_b * 16 + block_b * 40, 8);
    for (int32_t i = 0; i < N; i++) {
        random_prompt(prompts[i], 1 + i % 39);
        ids[i] = submit(e, prompts[i], 1 + i % 39, &s, 1 + i % 2, &g_recs[i]);
    }
    struct canceller c = {.e = e, .ids = ids, .n = N};
    pthread_t th;
    pthread_create(&th, NULL, cancel_thread, &c);
    pthread_join(th, NULL);
    kr_engine_wait_idle(e);
    for (int32_t i = 0; i < N; i++) {
        for (int32_t k = 0; k < 1 + i % 2; k++) {
            const struct choice *ch = &g_recs[i].ch[k];
            cr_expect_eq(ch->n_finish, 1, "request %d choice %d: %d finish events", i, k, ch->n_finish);
            cr_expect(!ch->after_finish, "request %d choice %d: events after its finish", i, k);
            if (i % 3 != 0) {
                cr_expect_eq(ch->finish, KR_FINISH_LENGTH);
                cr_expect_eq(ch->n, 20);
            }
        }
    }
    expect_pools_full(e);
    kr_engine_free(e);
}

/* Random submissions, cancellations and pauses under heavy preemption; with `backend_sampling` the
 * engine samples through the backend and holds events back until the next step is launched (as on
 * a GPU), which must change neither what is delivered nor its order. */
static void randomized_operations(int backend_sampling, int32_t n_ops)
{
    g_backend_sampling = backend_sampling;
    size_t slot_b, block_b;
    kr_cache_unit_bytes(g_m, 4, &slot_b, &block_b);
    struct kr_engine *e = make_engine(12, 29, slot_b * 12 + block_b * 30, 4); /* 120 tokens: heavy preemption */
    struct kr_sampling s;
    kr_sampling_default(&s);
    static uint64_t ids[MAX_REQ];
    static int32_t nch[MAX_REQ];
    static int32_t prompt[64];
    int32_t n_req = 0;
    for (int32_t op = 0; op < n_ops && n_req < MAX_REQ; op++) {
        const uint32_t kind = rnd(10);
        if (kind < 6) {
            const int32_t len = 1 + (int32_t)rnd(40);
            random_prompt(prompt, len);
            s.temperature = rnd(2) ? 0.0f : 0.8f;
            s.max_tokens = 1 + (int32_t)rnd(8);
            s.min_tokens = (int32_t)rnd((uint32_t)s.max_tokens + 1);
            s.ignore_eos = rnd(2);
            s.has_seed = true;
            s.seed = op;
            nch[n_req] = 1 + (int32_t)rnd(3);
            ids[n_req] = submit(e, prompt, len, &s, nch[n_req], &g_recs[n_req]);
            n_req++;
        } else if (kind < 9 && n_req > 0) {
            kr_engine_cancel(e, ids[rnd((uint32_t)n_req)]);
        } else {
            usleep(rnd(500));
        }
        if (op % 500 == 499) {
            kr_engine_wait_idle(e);
            expect_pools_full(e);
        }
    }
    kr_engine_wait_idle(e);
    struct kr_engine_stats st;
    kr_engine_get_stats(e, &st);
    cr_expect_gt(st.preemptions, 0, "the workload should have forced preemptions");
    int32_t finished = 0, cancelled = 0;
    for (int32_t i = 0; i < n_req; i++) {
        cr_expect_eq(g_recs[i].n_error, 0);
        for (int32_t k = 0; k < nch[i]; k++) {
            const struct choice *ch = &g_recs[i].ch[k];
            cr_expect_eq(ch->n_finish, 1, "request %d choice %d ended %d times", i, k, ch->n_finish);
            cr_expect(!ch->after_finish);
            finished += ch->finish != KR_FINISH_CANCELLED;
            cancelled += ch->finish == KR_FINISH_CANCELLED;
        }
    }
    cr_expect_gt(finished, 0);
    cr_expect_gt(cancelled, 0);
    expect_pools_full(e);
    kr_engine_free(e);
}

Test(engine, randomized_operations_never_leak_or_double_own)
{
    randomized_operations(0, 3000);
}

Test(engine, randomized_operations_with_deferred_events)
{
    randomized_operations(1, 1000);
    g_backend_sampling = -1;
}

/* Sampling on the backend (one call per step for every output row, with the generators' draws
 * made on the host) gives exactly what the host sampler gives: the same tokens, log-probabilities
 * and alternatives, for greedy and seeded requests with penalties, top-k/p, min-p, min_tokens
 * masking and logprobs; steps with prompt log-probabilities go to the host whole, while the row of
 * an n > 1 fork or of a request with logit_bias is sampled on the host beside the backend's rows.
 * The two runs batch the requests as they arrive; the CPU backend's rows do not
 * depend on the other rows of a step, and a token budget above every prompt keeps each prompt in
 * one prefill chunk whatever arrives beside it, so both runs see bitwise the same logits. */
Test(engine, backend_sampling_equals_host_sampling)
{
    enum { N = 16 };
    static int32_t prompts[N][64];
    int32_t len[N];
    for (int32_t i = 0; i < N; i++) {
        len[i] = 1 + (int32_t)rnd(60);
        random_prompt(prompts[i], len[i]);
    }
    for (int pass = 0; pass < 2; pass++) {
        g_backend_sampling = pass; /* 0: host, 1: backend */
        struct kr_engine *e = make_engine(8, 4096, 32 << 20, 16); /* no prompt is ever split */
        for (int32_t i = 0; i < N; i++) {
            struct kr_sampling s;
            kr_sampling_default(&s);
            s.max_tokens = 12;
            s.has_seed = true;
            s.seed = 77 + (uint64_t)i;
            s.temperature = i % 4 == 0 ? 0.0f : 0.6f + 0.1f * (float)(i % 5);
            s.top_k = i % 3 == 0 ? 20 : 0;
            s.top_p = i % 2 ? 0.9f : 1.0f;
            s.min_p = i % 5 == 1 ? 0.05f : 0.0f;
            s.repetition_penalty = i % 3 == 1 ? 1.3f : 1.0f;
            s.frequency_penalty = i % 4 == 2 ? 0.5f : 0.0f;
            s.presence_penalty = i % 4 == 3 ? 0.4f : 0.0f;
            s.logprobs = i % 2 ? 3 : 0;
            s.min_tokens = i % 6 == 5 ? 6 : 0;
            s.n_stop_ids = i % 6 == 5 ? 2 : 0;
            s.stop_ids[0] = 17;
            s.stop_ids[1] = 42;
            s.prompt_logprobs = i == 7 ? 2 : -1;
            if (i == 11 || i == 12) { /* logit_bias: this row is sampled on the host, beside the others */
                s.n_bias = 2;
                s.bias_ids[0] = prompts[i][0];
                s.bias[0] = 5.0f;
                s.bias_ids[1] = 3;
                s.bias[1] = -100.0f;
            }
            submit(e, prompts[i], len[i], &s, i == 9 ? 2 : 1, &g_recs[pass * N + i]);
        }
        kr_engine_wait_idle(e);
        struct kr_engine_stats st;
        kr_engine_get_stats(e, &st);
        /* a recomputed sequence would see its logits from another prefill: not the point here */
        cr_assert_eq(st.preemptions, 0, "the comparison needs runs without preemption");
        expect_pools_full(e);
        kr_engine_free(e);
    }
    g_backend_sampling = -1;
    int32_t compared = 0;
    for (int32_t i = 0; i < N; i++) {
        for (int32_t c = 0; c < (i == 9 ? 2 : 1); c++) {
            const struct choice *h = &g_recs[i].ch[c], *b = &g_recs[N + i].ch[c];
            cr_expect_eq(b->n, h->n, "request %d choice %d: %d tokens on the backend, %d on the host", i, c, b->n,
                         h->n);
            for (int32_t k = 0; k < h->n && k < b->n; k++) {
                cr_expect_eq(b->tokens[k], h->tokens[k], "request %d token %d: %d vs %d", i, k, b->tokens[k],
                             h->tokens[k]);
                cr_expect(b->lp[k] == h->lp[k], "request %d token %d: logprob %.9g vs %.9g", i, k, b->lp[k],
                          h->lp[k]);
                cr_expect_eq(b->top0[k], h->top0[k], "request %d token %d: top alternative %d vs %d", i, k,
                             b->top0[k], h->top0[k]);
                compared++;
            }
            cr_expect_eq(b->n_finish, 1);
        }
    }
    cr_expect_gt(compared, N * 6, "too few tokens compared (%d)", compared);
}

/* An attention op that carries its selection must read the buffer the selection writes: anything
 * else is refused with an error before a backend sees it. */
Test(engine, attention_refuses_a_selection_it_would_not_read)
{
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    int32_t idx[8], other[8];
    const struct krk_dsa_index_params sel = {.topk = 8, .idx = idx};
    struct krk_mla_attn_params ap = {.idx = other, .topk = 8, .select = &sel};
    cr_expect_eq(kr_backend_mla_attention(be, &ap), KR_ERR_INVAL, "selection into another buffer");
    ap.idx = idx;
    ap.topk = 4;
    cr_expect_eq(kr_backend_mla_attention(be, &ap), KR_ERR_INVAL, "selection of another size");
    ap.idx = NULL;
    ap.topk = 8;
    cr_expect_eq(kr_backend_mla_attention(be, &ap), KR_ERR_INVAL, "selection for a dense attention");
    kr_backend_free(be);
}

/* ---- constrained decoding --------------------------------------------------------------------------
 * A toy constraint over token ids: each token lies in (last, last + 30] (the first in (2, 32]),
 * EOS (2) may come from the third token on, and the text is complete after six tokens. */
#define TOY_EOS 2
#define TOY_LEN 6

struct toy {
    atomic_int started, stopped, released, masks;
    int32_t fail_mask_at; /* the nth mask of this constraint fails (0: never) */
};

struct toy_m {
    int32_t last, n;
};

static bool toy_allows(const struct toy_m *t, int32_t id)
{
    return id == TOY_EOS ? t->n >= 2 : id > t->last && id <= t->last + 30;
}

static enum kr_status toy_start(void *ctx, void **m, struct kr_err *err)
{
    struct toy_m *t = kr_calloc(1, sizeof *t);
    if (!t) {
        return kr_err_set(err, KR_ERR_NOMEM, "out of memory");
    }
    t->last = TOY_EOS;
    atomic_fetch_add(&((struct toy *)ctx)->started, 1);
    *m = t;
    return KR_OK;
}

static enum kr_status toy_fill(void *ctx, void *m, uint32_t *mask, int64_t vocab, struct kr_err *err)
{
    struct toy *c = ctx;
    if (atomic_fetch_add(&c->masks, 1) + 1 == c->fail_mask_at) {
        return kr_err_set(err, KR_ERR_INVAL, "toy limit reached");
    }
    memset(mask, 0, (size_t)(vocab + 31) / 32 * sizeof *mask);
    for (int32_t id = 0; id < vocab; id++) {
        if (toy_allows(m, id)) {
            mask[id >> 5] |= 1u << (id & 31);
        }
    }
    return KR_OK;
}

static enum kr_status toy_accept(void *ctx, void *m, int32_t token, bool *done, struct kr_err *err)
{
    struct toy_m *t = m;
    if (!toy_allows(t, token)) {
        return kr_err_set(err, KR_ERR_INVAL, "token %d is not allowed after %d", token, t->last);
    }
    *done = token == TOY_EOS || t->n + 1 == TOY_LEN;
    t->last = token == TOY_EOS ? t->last : token;
    t->n++;
    return KR_OK;
}

static void toy_stop(void *ctx, void *m)
{
    if (m) {
        atomic_fetch_add(&((struct toy *)ctx)->stopped, 1);
        kr_free(m);
    }
}

static void toy_release(void *ctx)
{
    atomic_fetch_add(&((struct toy *)ctx)->released, 1);
}

static const struct kr_constraint_i toy_i = {.start = toy_start, .fill_mask = toy_fill, .accept = toy_accept,
                                             .stop = toy_stop, .release = toy_release};

static uint64_t submit_con(struct kr_engine *e, const int32_t *ids, int32_t n, struct kr_sampling *s,
                           int32_t n_choices, struct rec *r, struct toy *t)
{
    struct kr_request_params p = {.prompt = ids, .n_prompt = n, .n = n_choices, .sampling = *s, .cb = on_event,
                                  .user = r, .constraint = {.iface = t ? &toy_i : NULL, .ctx = t}};
    uint64_t id = 0;
    struct kr_err err = {0};
    cr_assert_eq(kr_engine_submit(e, &p, &id, &err), KR_OK, "%s", err.msg);
    return id;
}

/* Checks that a finished choice follows the toy constraint; returns whether it ended at EOS. */
static bool expect_toy_text(const struct choice *c, const char *what, int32_t i, bool may_eos)
{
    struct toy_m t = {.last = TOY_EOS};
    bool eos = false;
    for (int32_t k = 0; k < c->n; k++) {
        cr_expect(toy_allows(&t, c->tokens[k]), "%s %d: token %d (%d) breaks the constraint after %d", what, i, k,
                  c->tokens[k], t.last);
        eos |= c->tokens[k] == TOY_EOS;
        cr_expect(c->tokens[k] != TOY_EOS || k == c->n - 1, "%s %d: tokens after EOS", what, i);
        t.last = c->tokens[k] == TOY_EOS ? t.last : c->tokens[k];
        t.n++;
    }
    cr_expect(may_eos || !eos, "%s %d: EOS with ignore_eos", what, i);
    if (c->finish != KR_FINISH_CANCELLED && c->n_finish == 1) {
        const bool complete = eos || c->n == TOY_LEN;
        cr_expect_eq(c->finish, complete ? KR_FINISH_STOP : KR_FINISH_LENGTH,
                     "%s %d: finish %d after %d tokens", what, i, c->finish, c->n);
    }
    return eos;
}

/* Constrained and free requests in the same batches, sampled on the host and through the backend:
 * every constrained token is one the mask allowed (EOS only where the text can end, never with
 * ignore_eos or below min_tokens), a complete text finishes with STOP, the free requests draw
 * exactly what they draw alone, both paths draw the same tokens and log-probabilities, and every
 * matcher is freed. Reported log-probabilities are those of the masked distribution: the top
 * alternatives are allowed tokens. */
Test(engine, constrained_choices_follow_their_masks_beside_free_ones)
{
    enum { N = 12 };
    static int32_t prompts[N][48];
    int32_t len[N];
    for (int32_t i = 0; i < N; i++) {
        len[i] = 1 + (int32_t)rnd(40);
        random_prompt(prompts[i], len[i]);
    }
    static struct toy toys[3][N];
    memset(toys, 0, sizeof toys);
    for (int pass = 0; pass < 3; pass++) { /* 0: host, 1: backend, 2: the free requests alone */
        g_backend_sampling = pass == 1;
        struct kr_engine *e = make_engine(8, 4096, 32 << 20, 16);
        for (int32_t i = 0; i < N; i++) {
            const bool con = i % 2 == 0;
            if (pass == 2 && con) {
                continue;
            }
            struct kr_sampling s;
            kr_sampling_default(&s);
            s.max_tokens = i % 5 == 4 ? 3 : 10;
            s.has_seed = true;
            s.seed = 300 + (uint64_t)i;
            s.temperature = i % 6 == 0 ? 0.0f : 1.0f;
            s.logprobs = i % 3 == 0 ? 3 : -1;
            s.ignore_eos = i == 2;
            s.min_tokens = i == 4 ? 3 : 0;
            s.top_k = i == 8 ? 5 : 0;
            if (i == 10) { /* logit_bias sends the row to the host sampler beside the backend's rows */
                s.n_bias = 1;
                s.bias_ids[0] = 40;
                s.bias[0] = 8.0f;
            }
            if (i == 8) { /* EOS made likely: it must still wait until the text can end (third token) */
                s.n_bias = 1;
                s.bias_ids[0] = TOY_EOS;
                s.bias[0] = 20.0f;
            }
            submit_con(e, prompts[i], len[i], &s, i == 6 ? 3 : 1, &g_recs[pass * N + i], con ? &toys[pass][i] : NULL);
        }
        kr_engine_wait_idle(e);
        struct kr_engine_stats st;
        kr_engine_get_stats(e, &st);
        cr_assert_eq(st.preemptions, 0, "the comparison needs runs without preemption");
        expect_pools_full(e);
        kr_engine_free(e);
    }
    g_backend_sampling = -1;
    int32_t n_eos = 0;
    for (int32_t i = 0; i < N; i++) {
        const int32_t nch = i == 6 ? 3 : 1;
        for (int32_t c = 0; c < nch; c++) {
            const struct choice *h = &g_recs[i].ch[c], *b = &g_recs[N + i].ch[c];
            cr_expect_eq(g_recs[i].n_error + g_recs[N + i].n_error, 0);
            cr_expect_eq(h->n_finish, 1);
            cr_expect_eq(b->n_finish, 1);
            cr_expect_eq(b->n, h->n, "request %d choice %d: %d tokens on the backend, %d on the host", i, c, b->n, h->n);
            for (int32_t k = 0; k < h->n && k < b->n; k++) {
                cr_expect_eq(b->tokens[k], h->tokens[k], "request %d token %d: %d vs %d", i, k, b->tokens[k],
                             h->tokens[k]);
                cr_expect(b->lp[k] == h->lp[k] || (i % 3), "request %d token %d: logprob %.9g vs %.9g", i, k, b->lp[k],
                          h->lp[k]);
            }
            if (i % 2) {
                const struct choice *alone = &g_recs[2 * N + i].ch[c];
                cr_expect_eq(alone->n, h->n);
                cr_expect(memcmp(alone->tokens, h->tokens, (size_t)h->n * sizeof(int32_t)) == 0,
                          "free request %d draws other tokens beside constrained ones", i);
                continue;
            }
            n_eos += expect_toy_text(h, "request", i, i != 2);
            if (i == 8) {
                cr_expect(h->n == 3 && h->tokens[2] == TOY_EOS, "request 8: EOS should come as soon as allowed");
            }
            if (i == 4) {
                for (int32_t k = 0; k < h->n && k < 3; k++) {
                    cr_expect_neq(h->tokens[k], TOY_EOS, "EOS below min_tokens");
                }
            }
            struct toy_m t = {.last = TOY_EOS};
            for (int32_t k = 0; k < h->n && i % 3 == 0; k++) { /* logprobs of the masked distribution */
                cr_expect(h->lp[k] <= 0.0f && isfinite(h->lp[k]));
                cr_expect(toy_allows(&t, h->top0[k]), "request %d token %d: top alternative %d is masked", i, k,
                          h->top0[k]);
                t.last = h->tokens[k] == TOY_EOS ? t.last : h->tokens[k];
                t.n++;
            }
        }
        for (int pass = 0; pass < 2 && i % 2 == 0; pass++) {
            const struct toy *t = &toys[pass][i];
            cr_expect_eq(atomic_load(&t->started), nch, "request %d: %d matchers for %d choices", i,
                         atomic_load(&t->started), nch);
            cr_expect_eq(atomic_load(&t->stopped), atomic_load(&t->started), "request %d: matchers not freed", i);
            cr_expect_eq(atomic_load(&t->released), 1);
        }
    }
    cr_expect_gt(n_eos, 0, "some constrained choice should have ended at EOS");
}

/* Constrained requests under heavy preemption, n > 1 forks, cancellations from any state and
 * random min_tokens / ignore_eos: every token respects the constraint (a preempted choice keeps
 * its matcher in step with the tokens it keeps), and every matcher and constraint is let go. */
Test(engine, constrained_matchers_survive_preemption_forks_and_cancellation)
{
    g_backend_sampling = 0;
    size_t slot_b, block_b;
    kr_cache_unit_bytes(g_m, 4, &slot_b, &block_b);
    struct kr_engine *e = make_engine(12, 29, slot_b * 12 + block_b * 30, 4);
    enum { NR = 300 };
    static struct toy toys[NR];
    memset(toys, 0, sizeof toys);
    static uint64_t ids[NR];
    static int32_t nch[NR];
    static int32_t prompt[64];
    int32_t n_req = 0;
    for (int32_t op = 0; op < 900 && n_req < NR; op++) {
        const uint32_t kind = rnd(10);
        if (kind < 6) {
            struct kr_sampling s;
            kr_sampling_default(&s);
            const int32_t len = 1 + (int32_t)rnd(40);
            random_prompt(prompt, len);
            s.temperature = rnd(3) ? 1.0f : 0.0f;
            s.max_tokens = 1 + (int32_t)rnd(8);
            s.min_tokens = (int32_t)rnd((uint32_t)s.max_tokens + 1);
            s.ignore_eos = rnd(2);
            s.has_seed = true;
            s.seed = (uint64_t)op;
            nch[n_req] = 1 + (int32_t)rnd(3);
            ids[n_req] = submit_con(e, prompt, len, &s, nch[n_req], &g_recs[n_req], &toys[n_req]);
            n_req++;
        } else if (kind < 8 && n_req > 0) {
            kr_engine_cancel(e, ids[rnd((uint32_t)n_req)]);
        } else {
            usleep(rnd(500));
        }
    }
    kr_engine_wait_idle(e);
    struct kr_engine_stats st;
    kr_engine_get_stats(e, &st);
    cr_expect_gt(st.preemptions, 0, "the workload should have forced preemptions");
    for (int32_t i = 0; i < n_req; i++) {
        cr_expect_eq(g_recs[i].n_error, 0);
        for (int32_t k = 0; k < nch[i]; k++) {
            const struct choice *ch = &g_recs[i].ch[k];
            cr_expect_eq(ch->n_finish, 1, "request %d choice %d ended %d times", i, k, ch->n_finish);
            expect_toy_text(ch, "request", i, true);
        }
        cr_expect_eq(atomic_load(&toys[i].stopped), atomic_load(&toys[i].started), "request %d: %d of %d matchers freed",
                     i, atomic_load(&toys[i].stopped), atomic_load(&toys[i].started));
        cr_expect_leq(atomic_load(&toys[i].started), nch[i]);
        cr_expect_eq(atomic_load(&toys[i].released), 1, "request %d: constraint released %d times", i,
                     atomic_load(&toys[i].released));
    }
    expect_pools_full(e);
    kr_engine_free(e);
    g_backend_sampling = -1;
}

/* A mask that cannot be made (a matcher limit, out of memory) fails its own request with an error
 * event and frees its matchers; the other requests of the step go on. */
Test(engine, a_failing_mask_fails_only_its_request)
{
    for (int pass = 0; pass < 2; pass++) {
        g_backend_sampling = pass;
        struct kr_engine *e = make_engine(8, 4096, 32 << 20, 16);
        int32_t prompt[12];
        random_prompt(prompt, 12);
        struct kr_sampling s;
        kr_sampling_default(&s);
        s.max_tokens = 8;
        s.ignore_eos = true;
        s.has_seed = true;
        s.seed = 5;
        struct toy bad = {.fail_mask_at = 3}, good = {0};
        struct rec *r = &g_recs[pass * 3];
        submit_con(e, prompt, 12, &s, 2, &r[0], &bad);
        submit_con(e, prompt, 12, &s, 1, &r[1], &good);
        submit_con(e, prompt, 12, &s, 1, &r[2], NULL);
        kr_engine_wait_idle(e);
        cr_expect_eq(r[0].n_error, 1, "the failing request ends with an error");
        cr_expect_eq(r[1].n_error + r[2].n_error, 0);
        cr_expect_eq(r[1].ch[0].finish, KR_FINISH_STOP, "the good constrained request completes its text");
        cr_expect_eq(r[1].ch[0].n, TOY_LEN);
        cr_expect_eq(r[2].ch[0].n, 8);
        cr_expect_eq(atomic_load(&bad.stopped), atomic_load(&bad.started));
        cr_expect_eq(atomic_load(&good.stopped), atomic_load(&good.started));
        cr_expect_eq(atomic_load(&bad.released) + atomic_load(&good.released), 2);
        expect_pools_full(e);
        kr_engine_free(e);
    }
    g_backend_sampling = -1;
}

/* A constraint with a missing function is refused at submission, and stays the caller's. */
Test(engine, an_incomplete_constraint_is_refused)
{
    struct kr_engine *e = make_engine(4, 256, 8 << 20, 16);
    int32_t prompt[3] = {5, 6, 7};
    struct kr_sampling s;
    kr_sampling_default(&s);
    struct kr_constraint_i half = toy_i;
    half.accept = NULL;
    struct toy t = {0};
    struct kr_request_params p = {.prompt = prompt, .n_prompt = 3, .n = 1, .sampling = s, .cb = on_event,
                                  .user = &g_recs[0], .constraint = {.iface = &half, .ctx = &t}};
    uint64_t id;
    struct kr_err err = {0};
    cr_expect_eq(kr_engine_submit(e, &p, &id, &err), KR_ERR_INVAL);
    kr_engine_free(e);
    cr_expect_eq(atomic_load(&t.released), 0);
}
