/* --batch-invariant through the engine (struct kr_engine_config.batch_invariant, the backend's mode
 * set): every request's tokens and log-probabilities are the same bits whether it runs alone with
 * its whole prompt in one step, or among many requests that take their prompts in chunks cut by a
 * small token budget (at multiples of KR_INVARIANT_CHUNK) and share steps with each other's decodes.
 * The same again in a cache of a little more than the longest request, where sequences are
 * preempted and recompute their prompt and generated tokens when readmitted (the generated ones one
 * a step, as they were decoded: computed in a chunk they would differ, on the CPU too).
 * Prompts of up to a few chunks, greedy and seeded sampling. Also what the mode refuses (drafts, a
 * budget below one chunk beside every running sequence's decode) and that Mamba models then keep no
 * prefix cache. On the CPU the reference is batch-invariant by construction; on the GPU
 * (tests/gpu/test_invariant_cuda.c) it is the mode that makes it so. */
#include "cache.h"
#include "engine.h"
#include "model.h"

#include "log.h"

#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef KR_INVARIANT_ON_CUDA
#include "gpu-test.h"
#define SUITE cuda_invariant
#else
#define SUITE invariant
#endif

#define MAX_GEN 24
#define N_REQ 12

struct out {
    int32_t tok[MAX_GEN];
    float lp[MAX_GEN], top_lp[MAX_GEN][2];
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
        for (int32_t i = 0; i < 2 && i < ev->n_top; i++) {
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

static void load(const char *rel)
{
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    const char *root = getenv("KR_FIXTURES");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/%s", root && *root ? root : KR_FIXTURES, rel);
    struct kr_err err = {0};
#ifdef KR_INVARIANT_ON_CUDA
    GT_REQUIRE_GPU();
    cr_assert_eq(kr_backend_cuda_create(0, true, &g_be, &err), KR_OK, "%s", err.msg);
#else
    g_be = kr_backend_cpu_create(2);
    cr_assert(g_be);
#endif
    cr_assert_eq(kr_backend_set_batch_invariant(g_be, true, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(kr_model_load(dir, g_be, &g_m, &err), KR_OK, "%s: %s", dir, err.msg);
}

static void unload(void)
{
    kr_model_free(g_m);
    kr_backend_free(g_be);
    g_m = NULL;
    g_be = NULL;
}

/* blocks: the cache holds one state slot per sequence and that many blocks (0: 96 MiB in all) */
static struct kr_engine *make_sized(int32_t seqs, int32_t tokens, bool prefix, int32_t blocks)
{
    struct kr_engine_config cfg;
    kr_engine_config_default(&cfg);
    cfg.max_num_seqs = seqs;
    cfg.max_num_batched_tokens = tokens;
    cfg.cache_bytes = (size_t)96 << 20;
    if (blocks > 0) {
        size_t slot = 0, block = 0;
        kr_cache_unit_bytes(g_m, cfg.block_size, &slot, &block);
        cfg.cache_bytes = (size_t)seqs * slot + (size_t)blocks * block;
    }
    cfg.prefix_caching = prefix;
    cfg.batch_invariant = true;
    cfg.debug_checks = true;
    struct kr_engine *e = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_engine_create(g_m, &cfg, &e, &err), KR_OK, "%s", err.msg);
    return e;
}

static struct kr_engine *make(int32_t seqs, int32_t tokens, bool prefix)
{
    return make_sized(seqs, tokens, prefix, 0);
}

static uint32_t g_rng;
static uint32_t rnd(uint32_t n)
{
    g_rng = g_rng * 1664525u + 1013904223u;
    return (g_rng >> 8) % n;
}

/* Prompts of 1 token to a little under the model's context less the generation: short ones, one
 * token past a chunk boundary (KR_INVARIANT_CHUNK + 1: never split so that one token is left), and
 * several chunks long. */
static int32_t *g_prompt[N_REQ], g_len[N_REQ];

static void make_prompts(void)
{
    const int32_t V = (int32_t)(g_m->cfg.vocab < 4000 ? g_m->cfg.vocab : 4000);
    const int32_t room = (int32_t)(g_m->cfg.max_pos < 2048 ? g_m->cfg.max_pos : 2048) - MAX_GEN;
    static const int32_t want[N_REQ] = {1, 7, 40, KR_INVARIANT_CHUNK - 1, KR_INVARIANT_CHUNK,
                                        KR_INVARIANT_CHUNK + 1, KR_INVARIANT_CHUNK + 2, 300, 2 * KR_INVARIANT_CHUNK + 1,
                                        600, 777, 1000};
    g_rng = 4321;
    for (int32_t i = 0; i < N_REQ; i++) {
        g_len[i] = want[i] < room ? want[i] : 1 + (int32_t)rnd((uint32_t)room);
        g_prompt[i] = malloc((size_t)g_len[i] * sizeof(int32_t));
        cr_assert(g_prompt[i]);
        for (int32_t t = 0; t < g_len[i]; t++) {
            g_prompt[i][t] = 3 + (int32_t)rnd((uint32_t)V - 3);
        }
    }
}

static void free_prompts(void)
{
    for (int32_t i = 0; i < N_REQ; i++) {
        free(g_prompt[i]);
    }
}

/* Request i: greedy for even i, seeded sampling at temperature 0.8 for odd i. */
static void submit(struct kr_engine *e, int32_t i, struct out *outs)
{
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = i % 2 ? 0.8f : 0.0f;
    s.seed = 1000 + i;
    s.has_seed = true;
    s.logprobs = 2;
    s.ignore_eos = true;
    s.max_tokens = MAX_GEN;
    struct kr_request_params p = {.prompt = g_prompt[i], .n_prompt = g_len[i], .n = 1, .sampling = s,
                                  .cb = on_event, .user = &outs[i]};
    uint64_t id;
    struct kr_err err = {0};
    cr_assert_eq(kr_engine_submit(e, &p, &id, &err), KR_OK, "%s", err.msg);
}

static void expect_same(const struct out *a, const struct out *b, int32_t i, const char *what)
{
    cr_expect_eq(b->n_finish, 1, "%s: request %d finished %d times", what, i, b->n_finish);
    cr_expect_eq(b->n, a->n, "%s: request %d gave %d tokens, alone %d", what, i, b->n, a->n);
    for (int32_t t = 0; t < a->n && t < b->n; t++) {
        const bool same = a->tok[t] == b->tok[t] && memcmp(&a->lp[t], &b->lp[t], sizeof(float)) == 0 &&
                          memcmp(a->top_lp[t], b->top_lp[t], sizeof a->top_lp[t]) == 0;
        cr_expect(same, "%s: request %d (%d prompt tokens) token %d: %d (lp %.9g) where alone it is %d (lp %.9g)",
                  what, i, g_len[i], t, b->tok[t], (double)b->lp[t], a->tok[t], (double)a->lp[t]);
        if (!same) {
            break;
        }
    }
}

static void alone_and_together(const char *dir)
{
    load(dir);
    make_prompts();
    static struct out alone[N_REQ], together[N_REQ];
    memset(alone, 0, sizeof alone);
    memset(together, 0, sizeof together);
    /* alone: one request at a time, a budget that takes its whole prompt in one step */
    for (int32_t i = 0; i < N_REQ; i++) {
        struct kr_engine *e = make(4, 2048, false);
        struct out tmp[N_REQ];
        memset(tmp, 0, sizeof tmp);
        submit(e, i, tmp);
        kr_engine_wait_idle(e);
        alone[i] = tmp[i];
        kr_engine_free(e);
    }
    /* together: every request at once under a budget of one chunk beside the decodes, so prompts
     * come in chunks and share steps with decodes and with each other */
    struct kr_engine *e = make(N_REQ, KR_INVARIANT_CHUNK + N_REQ, false);
    for (int32_t i = 0; i < N_REQ; i++) {
        submit(e, i, together);
    }
    kr_engine_wait_idle(e);
    struct kr_engine_stats st;
    kr_engine_get_stats(e, &st);
    kr_engine_free(e);
    char what[128];
    snprintf(what, sizeof what, "%s together", dir);
    for (int32_t i = 0; i < N_REQ; i++) {
        cr_expect_eq(alone[i].n_error, 0, "%s: request %d failed alone", dir, i);
        expect_same(&alone[i], &together[i], i, what);
    }
    /* together in a cache of a little more than the longest request: decodes that find no block
     * preempt younger sequences, which recompute their prompt and generated tokens when readmitted */
    static struct out pressed[N_REQ];
    memset(pressed, 0, sizeof pressed);
    int32_t longest = 0;
    for (int32_t i = 0; i < N_REQ; i++) {
        longest = g_len[i] > longest ? g_len[i] : longest;
    }
    struct kr_engine_config dc;
    kr_engine_config_default(&dc);
    const int32_t blocks = (longest + MAX_GEN) / dc.block_size + 8;
    e = make_sized(N_REQ, KR_INVARIANT_CHUNK + N_REQ, false, blocks);
    for (int32_t i = 0; i < N_REQ; i++) {
        submit(e, i, pressed);
    }
    kr_engine_wait_idle(e);
    kr_engine_get_stats(e, &st);
    kr_engine_free(e);
    cr_expect_gt(st.preemptions, 0, "%s: a cache of %d blocks preempted no sequence", dir, blocks);
    snprintf(what, sizeof what, "%s with preemptions (%llu)", dir, (unsigned long long)st.preemptions);
    for (int32_t i = 0; i < N_REQ; i++) {
        expect_same(&alone[i], &pressed[i], i, what);
    }
    free_prompts();
    unload();
}

TestSuite(SUITE, .timeout = 900);

Test(SUITE, alone_equals_together_nemotron_h)
{
    alone_and_together("nemotron_h/nh_gated");
}

Test(SUITE, alone_equals_together_long_chunks)
{
    alone_and_together("nemotron_h/nh_long_chunks");
}

Test(SUITE, alone_equals_together_default_model)
{
    alone_and_together("default/small-hybrid");
}

Test(SUITE, alone_equals_together_hybrid_dsa)
{
    alone_and_together("hybrid/hy_mdme");
}

Test(SUITE, alone_equals_together_deepseek_v32)
{
    alone_and_together("deepseek_v32/ds_yarn");
}

/* What the mode refuses, and the prefix cache it keeps no snapshots for. */
Test(SUITE, refuses_drafts_and_short_budgets)
{
    load("nemotron_h/nh_gated");
    struct kr_engine_config cfg;
    kr_engine_config_default(&cfg);
    cfg.cache_bytes = (size_t)64 << 20;
    cfg.batch_invariant = true;
    cfg.max_num_seqs = 8;
    cfg.max_num_batched_tokens = KR_INVARIANT_CHUNK + 7;
    struct kr_engine *e = NULL;
    struct kr_err err = {0};
    cr_expect_eq(kr_engine_create(g_m, &cfg, &e, &err), KR_ERR_INVAL, "a budget below a chunk plus the decodes");
    cr_expect(strstr(err.msg, "--max-num-batched-tokens") != NULL, "the message names the flag: %s", err.msg);
    cfg.max_num_batched_tokens = 2048;
    cfg.spec = (struct kr_spec_config){.method = KR_SPEC_NGRAM, .k = 2, .ngram_min = 1, .ngram_max = 3};
    memset(&err, 0, sizeof err);
    cr_expect_eq(kr_engine_create(g_m, &cfg, &e, &err), KR_ERR_INVAL, "drafts");
    cr_expect(strstr(err.msg, "speculative") != NULL, "the message names speculative decoding: %s", err.msg);
    unload();
}
