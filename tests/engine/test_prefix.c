/* The prefix cache through the engine, on the CPU backend with HF-verified fixture models of every
 * family (Nemotron-H hybrids, Mamba + DSA hybrids, DeepSeek-V3.2 attention only): outputs with the
 * cache equal the outputs of an engine without it (greedy tokens equal, log-probabilities within the
 * tolerance that a different prefill chunking already needs) for prefixes that end anywhere relative
 * to the block and snapshot grids; each request restores exactly the deepest prefix the rules allow
 * (counted by the engine's prefix statistics); hinted positions, n > 1, cancellation and cache salts;
 * and outputs under a cache so small that everything cached is evicted while sequences run and are
 * preempted. Pools are whole once the cache is cleared. */
#include "engine.h"

#include "alloc.h"
#include "cache.h"
#include "log.h"

#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <stdint.h>
#include <unistd.h>

#define MAX_GEN 16
#define BS 4        /* block size */
#define INTERVAL 8  /* state snapshot grid */

struct choice {
    int32_t tokens[MAX_GEN];
    float lp[MAX_GEN];
    float margin[MAX_GEN];
    int32_t n, n_finish;
    enum kr_finish_reason finish;
};

struct rec {
    struct choice ch[2];
    int32_t n_error;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static void on_event(const struct kr_event *ev, void *user)
{
    struct rec *r = user;
    pthread_mutex_lock(&g_mu);
    if (ev->type == KR_EVENT_ERROR) {
        r->n_error++;
    } else if (ev->type == KR_EVENT_TOKEN && r->ch[ev->index].n < MAX_GEN) {
        struct choice *c = &r->ch[ev->index];
        c->tokens[c->n] = ev->token;
        c->lp[c->n] = ev->logprob;
        c->margin[c->n] = ev->n_top >= 2 ? ev->top_logprobs[0] - ev->top_logprobs[1] : INFINITY;
        c->n++;
    } else if (ev->type == KR_EVENT_FINISH) {
        r->ch[ev->index].n_finish++;
        r->ch[ev->index].finish = ev->finish;
    }
    pthread_mutex_unlock(&g_mu);
}

static kr_backend_t g_be;
static struct kr_model *g_m;

static void load(const char *family, const char *name)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s/%s", KR_FIXTURES, family, name);
    g_be = kr_backend_cpu_create(2);
    struct kr_err err = {0};
    cr_assert_eq(kr_model_load(dir, g_be, &g_m, &err), KR_OK, "%s: %s", dir, err.msg);
    kr_log_set_level(KR_LOG_LEVEL_WARN);
}

static void unload(void)
{
    kr_model_free(g_m);
    kr_backend_free(g_be);
    g_m = NULL;
    g_be = NULL;
}

static struct kr_engine *engine(bool prefix, int32_t max_seqs, int32_t max_tokens, size_t bytes, int32_t snaps)
{
    struct kr_engine_config cfg;
    kr_engine_config_default(&cfg);
    cfg.max_num_seqs = max_seqs;
    cfg.max_num_batched_tokens = max_tokens;
    cfg.cache_bytes = bytes;
    cfg.block_size = BS;
    cfg.debug_checks = true;
    cfg.prefix_caching = prefix;
    cfg.prefix_state_interval = INTERVAL;
    cfg.prefix_snapshots = snaps;
    struct kr_engine *e = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_engine_create(g_m, &cfg, &e, &err), KR_OK, "%s", err.msg);
    return e;
}

static uint32_t g_rng = 4242;
static int32_t tok(void)
{
    g_rng = g_rng * 1664525u + 1013904223u;
    return 3 + (int32_t)((g_rng >> 8) % 250);
}

struct req_spec {
    int32_t ids[96];
    int32_t n;
    int32_t hint;   /* snapshot position the request names, or 0 */
    const char *salt;
    int32_t n_choices;
};

static uint64_t submit(struct kr_engine *e, const struct req_spec *q, struct rec *r, int32_t max_tokens)
{
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.0f;
    s.max_tokens = max_tokens;
    s.ignore_eos = true;
    s.logprobs = 2;
    struct kr_request_params p = {.prompt = q->ids, .n_prompt = q->n, .n = q->n_choices ? q->n_choices : 1,
                                  .sampling = s, .cb = on_event, .user = r, .cache_salt = q->salt,
                                  .cache_salt_len = q->salt ? strlen(q->salt) : 0,
                                  .snapshot_at = q->hint ? &q->hint : NULL, .n_snapshot_at = q->hint ? 1 : 0};
    uint64_t id = 0;
    struct kr_err err = {0};
    cr_assert_eq(kr_engine_submit(e, &p, &id, &err), KR_OK, "%s", err.msg);
    return id;
}

static uint64_t hits(struct kr_engine *e, uint64_t *block_only)
{
    struct kr_engine_stats st;
    kr_engine_get_stats(e, &st);
    if (block_only) {
        *block_only = st.prefix_block_only;
    }
    return st.prefix_hits;
}

/* Greedy tokens equal up to the first near-tie of the reference (a top-2 margin below 1e-4, where
 * the rounding of another chunking may flip the choice), log-probabilities within 5e-4. */
static void expect_same(const struct choice *ref, const struct choice *got, const char *what, int32_t i)
{
    cr_expect_eq(got->n_finish, 1, "%s: request %d finished %d times", what, i, got->n_finish);
    cr_expect_eq(got->n, ref->n, "%s: request %d: %d tokens, uncached %d", what, i, got->n, ref->n);
    for (int32_t k = 0; k < ref->n && k < got->n; k++) {
        cr_expect_eq(got->tokens[k], ref->tokens[k], "%s: request %d token %d is %d, uncached %d", what, i, k,
                     got->tokens[k], ref->tokens[k]);
        if (got->tokens[k] != ref->tokens[k] || ref->margin[k] < 1e-4f) {
            return;
        }
        cr_expect(fabsf(got->lp[k] - ref->lp[k]) <= 5e-4f, "%s: request %d token %d log-probability %g, uncached %g",
                  what, i, k, got->lp[k], ref->lp[k]);
    }
}

static void expect_pools_whole(struct kr_engine *e)
{
    struct kr_cache *c = kr_engine_cache(e);
    kr_prefix_clear(c);
    cr_expect_eq(c->n_free_slots, c->n_slots, "slots: %d of %d free", c->n_free_slots, c->n_slots);
    cr_expect_eq(c->n_free_blocks, c->n_blocks, "blocks: %d of %d free", c->n_free_blocks, c->n_blocks);
    struct kr_prefix_stats ps;
    kr_prefix_get_stats(c, &ps);
    cr_expect_eq(ps.snaps_used, 0);
    cr_expect_eq(ps.blocks_cached, 0);
}

/* A base prompt P of 37 tokens; requests P[0..L) + a tail whose first token differs from P[L], for
 * prefix lengths L on both sides of every block and snapshot boundary, then the repeat of P, a
 * request that names a snapshot position (hint), its follower, an n = 2 request and a salted one. */
enum { P_LEN = 37, N_L = 14 };
static const int32_t g_L[N_L] = {1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 33, 37};

static int32_t make_requests(struct req_spec *q)
{
    static int32_t P[P_LEN + 1];
    for (int32_t i = 0; i <= P_LEN; i++) {
        P[i] = tok();
    }
    int32_t n = 0;
    memset(q, 0, 40 * sizeof *q);
    /* 0: the warm-up: P and a tail */
    memcpy(q[n].ids, P, P_LEN * sizeof(int32_t));
    q[n].ids[P_LEN] = tok();
    q[n].n = P_LEN + 1;
    n++;
    for (int32_t i = 0; i < N_L; i++) {
        const int32_t L = g_L[i], t = 1 + i % 3;
        memcpy(q[n].ids, P, (size_t)L * sizeof(int32_t));
        for (int32_t j = 0; j < t; j++) {
            q[n].ids[L + j] = tok();
        }
        if (L < P_LEN + 1 && q[n].ids[L] == P[L]) {
            q[n].ids[L] = P[L] == 3 ? 4 : 3;
        }
        if (L == P_LEN && q[n].ids[L] == q[0].ids[L]) { /* diverge from the warm-up's tail too */
            q[n].ids[L] = q[0].ids[L] == 3 ? 4 : 3;
        }
        q[n].n = L + t;
        n++;
    }
    /* the warm-up's prompt again, exactly */
    q[n] = q[0];
    n++;
    /* a prompt naming position 13, then one sharing its first 13 tokens only */
    for (int32_t j = 0; j < 30; j++) {
        q[n].ids[j] = tok();
    }
    q[n].n = 30;
    q[n].hint = 13;
    n++;
    q[n] = q[n - 1];
    q[n].hint = 0;
    q[n].ids[13] = q[n - 1].ids[13] == 3 ? 4 : 3;
    q[n].n = 20;
    n++;
    /* n = 2 over P[0..20) */
    memcpy(q[n].ids, P, 20 * sizeof(int32_t));
    q[n].ids[20] = P[20] == 3 ? 4 : 3;
    q[n].n = 22;
    q[n].n_choices = 2;
    n++;
    /* salted: shares P but never another tenant's cache */
    q[n] = q[n - 1];
    q[n].n_choices = 1;
    q[n].salt = "tenant-b";
    n++;
    return n;
}

/* Longest common prefix of two token lists. */
static int32_t common(const struct req_spec *a, const struct req_spec *b)
{
    if ((a->salt == NULL) != (b->salt == NULL) || (a->salt && strcmp(a->salt, b->salt) != 0)) {
        return 0;
    }
    int32_t i = 0;
    while (i < a->n && i < b->n && a->ids[i] == b->ids[i]) {
        i++;
    }
    return i;
}

/* What request j may restore after requests 0..j-1 ran alone, each generating `gen` tokens: Mamba
 * models the deepest snapshot position (grid, hint, end of a prompt, end of a sequence) on its
 * path, attention-only models whole blocks; both at most n - 1 tokens. */
static int32_t expected_hit(const struct req_spec *q, int32_t j, bool mamba)
{
    const int32_t limit = q[j].n - 1;
    int32_t best = 0;
    for (int32_t i = 0; i < j; i++) {
        const int32_t c = common(&q[i], &q[j]), reach = c < limit ? c : limit;
        if (!mamba) {
            best = reach / BS * BS > best ? reach / BS * BS : best;
            continue;
        }
        /* snapshots request i left on the shared path: grid points inside its prompt, its hint and
         * its prompt's end (its own end lies off every later path: the tails differ) */
        for (int32_t g = INTERVAL; g < q[i].n; g += INTERVAL) {
            best = g <= reach && g > best ? g : best;
        }
        best = q[i].hint && q[i].hint <= reach && q[i].hint > best ? q[i].hint : best;
        best = q[i].n <= reach && q[i].n > best ? q[i].n : best;
    }
    return best;
}

static void run_family(const char *family, const char *name)
{
    load(family, name);
    const bool mamba = g_m->n_mamba > 0;
    static struct req_spec q[40];
    const int32_t n = make_requests(q);
    static struct rec ref[40], got[40];
    memset(ref, 0, sizeof ref);
    memset(got, 0, sizeof got);
    const int32_t gen = 6;
    /* the reference: no prefix cache, one request at a time */
    struct kr_engine *e = engine(false, 4, 4096, 16 << 20, 0);
    for (int32_t j = 0; j < n; j++) {
        submit(e, &q[j], &ref[j], gen);
        kr_engine_wait_idle(e);
    }
    kr_engine_free(e);
    /* cached, one at a time: each request restores exactly what the rules say */
    e = engine(true, 4, 4096, 16 << 20, 64);
    for (int32_t j = 0; j < n; j++) {
        uint64_t bo0, bo1;
        const uint64_t h0 = hits(e, &bo0);
        submit(e, &q[j], &got[j], gen);
        kr_engine_wait_idle(e);
        const int64_t hit = (int64_t)(hits(e, &bo1) - h0);
        const int32_t want = expected_hit(q, j, mamba);
        cr_expect_eq(hit, want, "%s/%s request %d (%d tokens): restored %lld tokens, expected %d", family, name, j,
                     q[j].n, (long long)hit, want);
        for (int32_t k = 0; k < (q[j].n_choices ? q[j].n_choices : 1); k++) {
            expect_same(&ref[j].ch[0], &got[j].ch[k], name, j);
        }
    }
    struct kr_engine_stats st;
    kr_engine_get_stats(e, &st);
    if (mamba) {
        cr_expect_gt(st.prefix_block_only, 0, "%s: blocks past the deepest snapshot were never counted", name);
    }
    expect_pools_whole(e);
    kr_engine_free(e);
    /* cached, all at once with 11-token steps: entries are taken while others restore from them */
    memset(got, 0, sizeof got);
    e = engine(true, 8, 11, 16 << 20, 64);
    for (int32_t j = 0; j < n; j++) {
        submit(e, &q[j], &got[j], gen);
    }
    kr_engine_wait_idle(e);
    for (int32_t j = 0; j < n; j++) {
        for (int32_t k = 0; k < (q[j].n_choices ? q[j].n_choices : 1); k++) {
            expect_same(&ref[j].ch[0], &got[j].ch[k], "batched", j);
        }
    }
    expect_pools_whole(e);
    kr_engine_free(e);
    /* a cache so small that snapshots and blocks are evicted under running sequences, which are
     * preempted too: outputs unchanged */
    memset(got, 0, sizeof got);
    size_t slot_b, block_b;
    kr_cache_unit_bytes(g_m, BS, &slot_b, &block_b);
    e = engine(true, 6, 13, slot_b * 6 + slot_b * 3 + block_b * 30, 3);
    for (int32_t j = 0; j < n; j++) {
        submit(e, &q[j], &got[j], gen);
    }
    kr_engine_wait_idle(e);
    for (int32_t j = 0; j < n; j++) {
        cr_expect_eq(got[j].n_error, 0);
        for (int32_t k = 0; k < (q[j].n_choices ? q[j].n_choices : 1); k++) {
            expect_same(&ref[j].ch[0], &got[j].ch[k], "small cache", j);
        }
    }
    kr_engine_get_stats(e, &st);
    cr_expect_gt(st.prefix_evicted_snapshots + st.prefix_evicted_blocks, 0, "%s: the small cache evicted nothing",
                 name);
    expect_pools_whole(e);
    kr_engine_free(e);
    unload();
}

TestSuite(prefix, .timeout = 600);

Test(prefix, nemotron_h_moe_hybrid)
{
    run_family("nemotron_h", "nh_moe");
}

Test(prefix, nemotron_h_mamba_attention_mlp)
{
    run_family("nemotron_h", "nh_mamba_attn_mlp");
}

Test(prefix, mamba_dsa_hybrid)
{
    run_family("hybrid", "hy_mdme");
}

Test(prefix, mamba_mla_hybrid)
{
    run_family("hybrid", "hy_plus");
}

Test(prefix, deepseek_v32_attention_only)
{
    run_family("deepseek_v32", "ds_short");
}

/* A cancelled request's caches stay reusable: its prompt's end and the point it reached are
 * snapshots (Mamba) or registered blocks (attention) that the next request on its path restores. */
Test(prefix, a_cancelled_request_leaves_its_prefix_cached)
{
    load("nemotron_h", "nh_moe");
    struct kr_engine *e = engine(true, 4, 4096, 16 << 20, 16);
    static struct req_spec q[2];
    memset(q, 0, sizeof q);
    for (int32_t j = 0; j < 21; j++) {
        q[0].ids[j] = tok();
    }
    q[0].n = 21;
    static struct rec r[2];
    memset(r, 0, sizeof r);
    const uint64_t id = submit(e, &q[0], &r[0], 1000);
    for (int i = 0; i < 2000; i++) {
        pthread_mutex_lock(&g_mu);
        const int32_t got = r[0].ch[0].n;
        pthread_mutex_unlock(&g_mu);
        if (got >= 3) {
            break;
        }
        usleep(1000);
    }
    kr_engine_cancel(e, id);
    kr_engine_wait_idle(e);
    cr_expect_eq(r[0].ch[0].finish, KR_FINISH_CANCELLED);
    q[1] = q[0];
    q[1].ids[21] = tok();
    q[1].ids[22] = tok();
    q[1].n = 23;
    const uint64_t h0 = hits(e, NULL);
    submit(e, &q[1], &r[1], 2);
    kr_engine_wait_idle(e);
    cr_expect_geq(hits(e, NULL) - h0, 21, "the cancelled request's prompt was not reused");
    expect_pools_whole(e);
    kr_engine_free(e);
    unload();
}

/* The cache's own check of slot and block ownership runs after every step (debug_checks) while
 * requests with shared prefixes, salts and hints arrive, are cancelled and preempted at random. */
Test(prefix, randomized_operations_keep_ownership_whole)
{
    load("hybrid", "hy_mdme");
    size_t slot_b, block_b;
    kr_cache_unit_bytes(g_m, BS, &slot_b, &block_b);
    struct kr_engine *e = engine(true, 8, 23, slot_b * 8 + slot_b * 5 + block_b * 36, 5);
    static int32_t base[4][40];
    for (int32_t i = 0; i < 4; i++) {
        for (int32_t j = 0; j < 40; j++) {
            base[i][j] = tok();
        }
    }
    static struct rec recs[600];
    static uint64_t ids[600];
    memset(recs, 0, sizeof recs);
    int32_t n_req = 0;
    static struct req_spec q;
    for (int32_t op = 0; op < 900 && n_req < 600; op++) {
        const uint32_t kind = (uint32_t)tok() % 10;
        if (kind < 6) {
            memset(&q, 0, sizeof q);
            const int32_t shared = (int32_t)((uint32_t)tok() % 36), tail = 1 + (int32_t)((uint32_t)tok() % 10);
            memcpy(q.ids, base[tok() % 4], (size_t)shared * sizeof(int32_t));
            for (int32_t j = 0; j < tail; j++) {
                q.ids[shared + j] = tok();
            }
            q.n = shared + tail;
            q.hint = tok() % 3 == 0 ? 1 + tok() % q.n : 0;
            q.salt = tok() % 5 == 0 ? "s" : NULL;
            q.n_choices = 1 + tok() % 2;
            ids[n_req] = submit(e, &q, &recs[n_req], 1 + tok() % 6);
            n_req++;
        } else if (kind < 8 && n_req > 0) {
            kr_engine_cancel(e, ids[(uint32_t)tok() % (uint32_t)n_req]);
        } else {
            usleep((useconds_t)((uint32_t)tok() % 300));
        }
        if (op % 300 == 299) {
            kr_engine_wait_idle(e);
            expect_pools_whole(e);
        }
    }
    kr_engine_wait_idle(e);
    struct kr_engine_stats st;
    kr_engine_get_stats(e, &st);
    cr_expect_gt(st.prefix_hits, 0);
    cr_expect_gt(st.preemptions, 0, "the workload should preempt");
    for (int32_t i = 0; i < n_req; i++) {
        cr_expect_eq(recs[i].n_error, 0);
    }
    expect_pools_whole(e);
    kr_engine_free(e);
    unload();
}

/* A request asking for its prompt's log-probabilities computes every row (no restore) and gets the
 * rows an uncached engine gives; it still leaves its prefix for the next request. */
static float g_plp[2][64];
static int32_t g_nplp[2];

static void on_plp(const struct kr_event *ev, void *user)
{
    const int i = (int)(intptr_t)user;
    if (ev->type == KR_EVENT_PROMPT_LOGPROBS) {
        for (int32_t t = 0; t < ev->n_prompt && t < 64; t++) {
            g_plp[i][t] = ev->prompt_logprobs[t];
        }
        g_nplp[i] = ev->n_prompt;
    }
}

Test(prefix, prompt_logprobs_are_computed_not_restored)
{
    load("nemotron_h", "nh_moe");
    static struct req_spec q;
    memset(&q, 0, sizeof q);
    for (int32_t j = 0; j < 40; j++) {
        q.ids[j] = tok();
    }
    q.n = 40;
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.0f;
    s.max_tokens = 2;
    s.prompt_logprobs = 1;
    for (int pass = 0; pass < 2; pass++) {
        /* pass 0: uncached; pass 1: the same prompt after a warm-up that cached its prefix */
        struct kr_engine *e = engine(pass == 1, 4, 4096, 16 << 20, 16);
        if (pass == 1) {
            static struct rec warm;
            memset(&warm, 0, sizeof warm);
            submit(e, &q, &warm, 3);
            kr_engine_wait_idle(e);
        }
        const uint64_t h0 = hits(e, NULL);
        struct kr_request_params p = {.prompt = q.ids, .n_prompt = q.n, .n = 1, .sampling = s, .cb = on_plp,
                                      .user = (void *)(intptr_t)pass};
        uint64_t id;
        struct kr_err err = {0};
        cr_assert_eq(kr_engine_submit(e, &p, &id, &err), KR_OK, "%s", err.msg);
        kr_engine_wait_idle(e);
        cr_expect_eq(hits(e, NULL) - h0, 0, "prompt log-probabilities from restored rows");
        if (pass == 1) {
            static struct rec after;
            memset(&after, 0, sizeof after);
            const uint64_t h1 = hits(e, NULL);
            submit(e, &q, &after, 1);
            kr_engine_wait_idle(e);
            cr_expect_gt(hits(e, NULL) - h1, 0, "the prefix was not left for the next request");
        }
        expect_pools_whole(e);
        kr_engine_free(e);
    }
    cr_assert_eq(g_nplp[0], 40);
    cr_assert_eq(g_nplp[1], 40);
    for (int32_t t = 1; t < 40; t++) {
        cr_expect(fabsf(g_plp[0][t] - g_plp[1][t]) <= 1e-5f, "position %d: %g uncached, %g after caching", t,
                  g_plp[0][t], g_plp[1][t]);
    }
    unload();
}
