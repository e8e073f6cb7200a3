/* Speculative decoding served: `krait serve --speculative-config` (n-gram drafts, k = 4, on the
 * tiny test model; drafts by the trained default model's MTP head, k = 3) against the same model
 * served without it, the independent reference. The tiny model's greedy output repeats itself (its
 * weights are random: it falls into runs of one token), so that n-gram drafts are proposed and kept. Every request goes to both servers at once; each
 * serves it alone and
 * both get the same requests in the same order (their prefix caches hold the same prompts), so
 * the answers must be equal but for their ids and timestamps:
 *  - greedy completions and chat with log-probabilities (top 5), whole and streamed (the pieces of
 *    a stream concatenate to the whole answer's text and log-probabilities);
 *  - n = 2 sampled with a seed: a step samples its rows in order from the choice's seeded stream,
 *    so the draws are the plain server's draws;
 *  - stop strings completed by a token inside a run of kept drafts (the output cut where the plain
 *    server cuts it), a stop token id, max_tokens ending inside a draft run (finish_reason and
 *    usage exact);
 *  - structured output (json_schema, json_object);
 *  - clients that leave mid-stream while drafts run: the engine idles with every state slot and
 *    cache block back, and the next request still answers as the plain server does;
 *  - the spec_decode counters under krait: and vllm: names;
 *  - a bad --speculative-config exits 2 naming the problem; with tensor parallelism the engine
 *    refuses to start. */
#include "harness.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MODEL KR_SOURCE_DIR "/models/tiny-hybrid"
#define SPEC "{\"method\":\"ngram\",\"num_speculative_tokens\":4}"
/* the trained default model drafting with its multi-token-prediction head */
#define MTP_MODEL KR_SOURCE_DIR "/models/small-hybrid"
#define MTP_SPEC "{\"method\":\"mtp\",\"num_speculative_tokens\":3}"
#define NH_MTP_MODEL KR_SOURCE_DIR "/tests/fixtures/nemotron_h/nh_mtp"
#define DS_MTP_MODEL KR_SOURCE_DIR "/tests/fixtures/deepseek_v32/ds_fp8"
#define MAX_TOKENS 64

static struct srv_proc P, S; /* plain, speculating */
static int SPEC_K = 4;       /* the speculating server's num_speculative_tokens */

/* Both load at once; 64 MiB of cache (plenty here) start sooner under the sanitizers than the
 * default 512 MiB. */
static void start_pair_of(const char *model, const char *spec, int k, const char *cache, bool no_tokenizer)
{
    SPEC_K = k;
    const char *tok = no_tokenizer ? "--skip-tokenizer-init" : NULL;
    srv_spawn(&S, model, "--served-model-name", "tiny", "--cache-memory-bytes", cache, "--speculative-config", spec,
              tok, NULL);
    srv_spawn(&P, model, "--served-model-name", "tiny", "--cache-memory-bytes", cache, tok, NULL);
    srv_ready(&S);
    srv_ready(&P);
}

static void start_pair(void)
{
    start_pair_of(MODEL, SPEC, 4, "67108864", false);
}

/* the default model's Mamba states are larger: 256 MiB */
static void start_pair_mtp(void)
{
    start_pair_of(MTP_MODEL, MTP_SPEC, 3, "268435456", false);
}

/* a checkpoint in Nemotron 3's MTP layout, without a tokenizer: token ids in and out */
static void start_pair_nh_mtp(void)
{
    start_pair_of(NH_MTP_MODEL, MTP_SPEC, 3, "67108864", true);
}

static void stop_pair(void)
{
    if (P.pid > 0) {
        kill(P.pid, SIGTERM); /* both drain at once */
    }
    cr_expect_eq(srv_stop(&S), 0, "the speculating server did not exit 0 on SIGTERM");
    cr_expect_eq(srv_stop(&P), 0, "the plain server did not exit 0 on SIGTERM");
}

TestSuite(spec_http, .timeout = 600);

/* ---- requests to both servers ------------------------------------------------------------------ */

struct call {
    const struct srv_proc *p;
    const char *path, *body;
    bool stream;
    size_t cut;   /* a stream's client leaves after this many bytes (0: reads it all) */
    long status;
    char *raw;    /* the answer's text (malloc'd) */
};

/* No assertion off the test's thread: Criterion's asserts end the test from the thread running it. */
static void *call_run(void *arg)
{
    struct call *c = arg;
    if (c->stream) {
        c->raw = post_stream(c->p, c->path, c->body, c->cut, &c->status);
    } else {
        struct http_res r;
        http(c->p, "POST", c->path, c->body, NULL, &r);
        c->status = r.status;
        c->raw = r.body;
    }
    return NULL;
}

static void run_calls(struct call *c, int n)
{
    pthread_t th[32];
    cr_assert_leq(n, 32);
    for (int i = 0; i < n; i++) {
        cr_assert_eq(pthread_create(&th[i], NULL, call_run, &c[i]), 0);
    }
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
    }
}

/* Sends body to both servers at once; their answers' texts (malloc'd), both 200. */
static void both(const char *path, const char *body, bool stream, char **plain, char **spec)
{
    struct call c[2] = {{.p = &P, .path = path, .body = body, .stream = stream},
                        {.p = &S, .path = path, .body = body, .stream = stream}};
    run_calls(c, 2);
    cr_assert_eq(c[0].status, 200, "the plain server answered %ld to %s: %.300s", c[0].status, body,
                 c[0].raw ? c[0].raw : "");
    cr_assert_eq(c[1].status, 200, "the speculating server answered %ld to %s: %.300s", c[1].status, body,
                 c[1].raw ? c[1].raw : "");
    *plain = c[0].raw;
    *spec = c[1].raw;
}

/* A whole answer without what differs between any two answers (id, created). */
static json_t *whole(const char *raw)
{
    json_error_t je;
    json_t *j = json_loads(raw, 0, &je);
    cr_assert(json_is_object(j), "not a JSON object (%s): %.300s", je.text, raw);
    json_object_del(j, "id");
    json_object_del(j, "created");
    return j;
}

/* The first place where a and b differ, as a JSON path in `path`; false when they are equal. */
static bool first_diff(const json_t *a, const json_t *b, char *path, size_t cap)
{
    if (json_equal(a, b)) {
        return false;
    }
    const size_t at = strlen(path);
    if (json_is_object(a) && json_is_object(b)) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)a, k, v) {
            snprintf(path + at, cap - at, ".%s", k);
            if (first_diff(v, json_object_get(b, k), path, cap)) {
                return true;
            }
        }
        snprintf(path + at, cap - at, " (keys)");
        return true;
    }
    if (json_is_array(a) && json_is_array(b)) {
        for (size_t i = 0; i < json_array_size(a) && i < json_array_size(b); i++) {
            snprintf(path + at, cap - at, "[%zu]", i);
            if (first_diff(json_array_get(a, i), json_array_get(b, i), path, cap)) {
                return true;
            }
        }
        snprintf(path + at, cap - at, " (lengths %zu and %zu)", json_array_size(a), json_array_size(b));
        return true;
    }
    return true;
}

static bool expect_same(const json_t *plain, const json_t *spec, const char *what)
{
    char path[512] = "";
    if (!first_diff(plain, spec, path, sizeof path)) {
        return true;
    }
    char *a = json_dumps(plain, JSON_COMPACT | JSON_ENCODE_ANY), *b = json_dumps(spec, JSON_COMPACT | JSON_ENCODE_ANY);
    cr_expect(0, "%s: the answers differ at %s\n  plain:       %.1500s\n  speculating: %.1500s", what, path, a, b);
    free(a);
    free(b);
    return false;
}

static const char *str(const json_t *o, const char *k)
{
    const json_t *v = json_object_get(o, k);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static json_int_t usage_of(const json_t *j, const char *k)
{
    return json_integer_value(json_object_get(json_object_get(j, "usage"), k));
}

/* ---- streams ------------------------------------------------------------------------------------ */

/* What a choice's pieces add up to: {"text": [per choice], "finish": [...], "lp": [[logprob of each
 * token] per choice], "usage": {...}}, from a whole answer or from a stream's chunks. */
static json_t *summary_new(void)
{
    return json_pack("{s:[],s:[],s:[],s:n}", "text", "finish", "lp", "usage");
}

static void summary_add(json_t *sum, size_t idx, const char *piece, const char *finish, const json_t *lps)
{
    json_t *text = json_object_get(sum, "text"), *fin = json_object_get(sum, "finish"), *lp = json_object_get(sum, "lp");
    while (json_array_size(text) <= idx) {
        json_array_append_new(text, json_string(""));
        json_array_append_new(fin, json_null());
        json_array_append_new(lp, json_array());
    }
    if (piece && *piece) {
        const char *had = json_string_value(json_array_get(text, idx));
        const size_t n = strlen(had), m = strlen(piece);
        char *cat = malloc(n + m + 1);
        cr_assert(cat);
        memcpy(cat, had, n);
        memcpy(cat + n, piece, m + 1);
        json_array_set_new(text, idx, json_string(cat));
        free(cat);
    }
    if (finish) {
        cr_expect(json_is_null(json_array_get(fin, idx)), "choice %zu has two finish reasons", idx);
        json_array_set_new(fin, idx, json_string(finish));
    }
    json_t *to = json_array_get(lp, idx);
    for (size_t i = 0; i < json_array_size(lps); i++) {
        const json_t *x = json_array_get(lps, i);
        json_array_append(to, json_is_object(x) ? json_object_get(x, "logprob") : (json_t *)x);
    }
}

/* A choice's text, finish reason and token log-probabilities (completions: logprobs.token_logprobs;
 * chat: logprobs.content[].logprob); `delta` for a chat stream's chunks. */
static void summary_choice(json_t *sum, const json_t *ch, bool chat, bool delta)
{
    const size_t idx = (size_t)json_integer_value(json_object_get(ch, "index"));
    const json_t *lp = json_object_get(ch, "logprobs");
    const json_t *lps = json_object_get(lp, chat ? "content" : "token_logprobs");
    const char *piece = chat ? str(json_object_get(ch, delta ? "delta" : "message"), "content") : str(ch, "text");
    summary_add(sum, idx, piece, str(ch, "finish_reason"), lps);
}

static json_t *summary_whole(const json_t *j, bool chat)
{
    json_t *sum = summary_new();
    const json_t *chs = json_object_get(j, "choices");
    for (size_t i = 0; i < json_array_size(chs); i++) {
        summary_choice(sum, json_array_get(chs, i), chat, false);
    }
    json_object_set(sum, "usage", json_object_get(j, "usage"));
    return sum;
}

static json_t *summary_stream(const char *raw, bool chat)
{
    bool done = false;
    json_t *ev = sse_events(raw, &done);
    cr_expect(done, "the stream does not end with [DONE]");
    json_t *sum = summary_new();
    for (size_t e = 0; e < json_array_size(ev); e++) {
        const json_t *x = json_array_get(ev, e);
        cr_expect(!json_object_get(x, "error"), "the stream has an error event");
        const json_t *chs = json_object_get(x, "choices");
        for (size_t i = 0; i < json_array_size(chs); i++) {
            summary_choice(sum, json_array_get(chs, i), chat, true);
        }
        if (json_is_object(json_object_get(x, "usage"))) {
            json_object_set(sum, "usage", json_object_get(x, "usage"));
        }
    }
    json_decref(ev);
    return sum;
}

/* ---- one request, both ways --------------------------------------------------------------------- */

/* body (a JSON object text) to both servers whole; both answers equal. Returns the plain one. */
static json_t *same_whole(const char *path, const char *body, const char *what)
{
    char *rp, *rs;
    both(path, body, false, &rp, &rs);
    json_t *a = whole(rp), *b = whole(rs);
    expect_same(a, b, what);
    free(rp);
    free(rs);
    json_decref(b);
    return a;
}

/* body whole and then streamed (with usage), to both servers: the whole answers equal, the streams
 * equal, and each stream adds up to its whole answer. Returns the plain whole answer. */
static json_t *same_whole_and_streamed(const char *path, const char *body, const char *what)
{
    const bool chat = strstr(path, "chat") != NULL;
    json_t *a = same_whole(path, body, what);
    json_t *req = json_loads(body, 0, NULL);
    cr_assert(req, "bad body %s", body);
    json_object_set_new(req, "stream", json_true());
    json_object_set_new(req, "stream_options", json_pack("{s:b}", "include_usage", 1));
    char *sbody = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    char *rp, *rs;
    both(path, sbody, true, &rp, &rs);
    json_t *sp = summary_stream(rp, chat), *ss = summary_stream(rs, chat), *wa = summary_whole(a, chat);
    char w[256];
    snprintf(w, sizeof w, "%s, streamed", what);
    expect_same(sp, ss, w);
    snprintf(w, sizeof w, "%s, the plain server's stream against its whole answer", what);
    expect_same(wa, sp, w);
    snprintf(w, sizeof w, "%s, the speculating server's stream against the whole answer", what);
    expect_same(wa, ss, w);
    json_decref(sp);
    json_decref(ss);
    json_decref(wa);
    free(rp);
    free(rs);
    free(sbody);
    return a;
}

/* A completions body: {"prompt": prompt} and the members of the JSON object text `fmt` (printf
 * style). Caller frees. */
static char *cmpl(const char *prompt, const char *fmt, ...)
{
    char extra[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(extra, sizeof extra, fmt, ap);
    va_end(ap);
    json_error_t je;
    json_t *b = json_loads(extra, 0, &je);
    cr_assert(json_is_object(b), "bad body %s: %s", extra, je.text);
    json_object_set_new(b, "prompt", json_string(prompt));
    char *text = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return text;
}

static double accepted(void)
{
    return metric(&S, "krait:spec_decode_num_accepted_tokens_total");
}

/* ---- greedy ---------------------------------------------------------------------------------------- */

static const char *const prompts[] = {
    "Once upon a time",
    "<html><body><div class=\"x\">",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome. The "
    "capital of Spain is Madrid. The capital of France is Paris. The capital of Germany is Berlin. The capital "
    "of Italy is",
};

static void greedy_both(void)
{
    const double a0 = accepted();
    char body[2048], what[128];
    for (size_t i = 0; i < sizeof prompts / sizeof prompts[0]; i++) {
        char *b = cmpl(prompts[i], "{\"max_tokens\":%d,\"temperature\":0,\"logprobs\":5,\"return_token_ids\":true}",
                       MAX_TOKENS);
        snprintf(what, sizeof what, "completion %zu", i);
        json_decref(same_whole_and_streamed("/v1/completions", b, what));
        free(b);
    }
    static const char *const chats[] = {
        "[{\"role\":\"user\",\"content\":\"Tell me a story about a fox and a dog, please.\"}]",
        "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Say something.\"},"
        "{\"role\":\"assistant\",\"content\":\"Something.\"},{\"role\":\"user\",\"content\":\"Again, twice.\"}]",
    };
    for (size_t i = 0; i < sizeof chats / sizeof chats[0]; i++) {
        snprintf(body, sizeof body,
                 "{\"messages\":%s,\"max_tokens\":%d,\"temperature\":0,\"logprobs\":true,\"top_logprobs\":5}", chats[i],
                 MAX_TOKENS);
        snprintf(what, sizeof what, "chat %zu", i);
        json_decref(same_whole_and_streamed("/v1/chat/completions", body, what));
    }
    cr_expect_gt(accepted() - a0, 0, "no draft was kept: the comparison says nothing about speculation");

    /* the counters, under both prefixes, on the speculating server only */
    const double drafts = metric(&S, "krait:spec_decode_num_drafts_total");
    const double drafted = metric(&S, "krait:spec_decode_num_draft_tokens_total");
    const double kept = accepted();
    cr_expect_gt(drafts, 0);
    cr_expect_gt(kept, 0);
    cr_expect_leq(kept, drafted, "%g drafts kept of %g drafted", kept, drafted);
    cr_expect_leq(drafted, SPEC_K * drafts, "%g tokens drafted in %g steps of at most %d", drafted, drafts, SPEC_K);
    static const char *const names[] = {"spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                                        "spec_decode_num_accepted_tokens_total"};
    struct http_res r;
    http(&S, "GET", "/metrics", NULL, NULL, &r);
    char k[128], v[128];
    for (size_t i = 0; i < sizeof names / sizeof names[0] + 1; i++) {
        const char *name = i < sizeof names / sizeof names[0] ? names[i] : "spec_decode_num_accepted_tokens_per_pos_total";
        for (int pre = 0; pre < 2; pre++) {
            snprintf(k, sizeof k, "# TYPE %s:%s counter\n", pre ? "vllm" : "krait", name);
            cr_expect(strstr(r.body, k), "/metrics has no %s", k);
        }
        if (i == sizeof names / sizeof names[0]) {
            break;
        }
        snprintf(k, sizeof k, "krait:%s", name);
        snprintf(v, sizeof v, "vllm:%s", name);
        cr_expect_eq(metric(&S, k), metric(&S, v), "%s differs from %s", v, k);
        cr_expect(isnan(metric(&P, k)) && isnan(metric(&P, v)), "the plain server shows %s", name);
    }
    http_free(&r);
    double sum = 0, prev = INFINITY;
    for (int i = 0; i <= SPEC_K; i++) {
        char lab[32];
        snprintf(lab, sizeof lab, "position=\"%d\"", i);
        const double x = metric_with(&S, "krait:spec_decode_num_accepted_tokens_per_pos_total", lab);
        const double y = metric_with(&S, "vllm:spec_decode_num_accepted_tokens_per_pos_total", lab);
        if (i == SPEC_K) {
            cr_expect(isnan(x) && isnan(y), "a count for position %d with k = %d", i, SPEC_K);
            break;
        }
        cr_expect(!isnan(x), "no count for position %d", i);
        cr_expect_eq(x, y, "position %d: krait: %g, vllm: %g", i, x, y);
        cr_expect_leq(x, prev, "position %d kept %g drafts, more than position %d's %g", i, x, i - 1, prev);
        sum += x;
        prev = x;
    }
    cr_expect_eq(sum, kept, "the per-position counts add up to %g, not %g", sum, kept);
    cr_expect_geq(srv_wait_idle(&S, 30.0), 0, "the speculating server holds slots or blocks after its answers");
}

Test(spec_http, greedy_answers_whole_and_streamed_equal_plain_decoding, .init = start_pair, .fini = stop_pair)
{
    greedy_both();
}

/* The same with drafts from the trained default model's MTP head (k = 3), then n = 2 sampled with a
 * seed: the plain server's draws. */
Test(spec_http, mtp_greedy_and_seeded_answers_equal_plain_decoding, .init = start_pair_mtp, .fini = stop_pair)
{
    greedy_both();
    const double a0 = accepted();
    char *sb = cmpl(prompts[0], "{\"max_tokens\":%d,\"temperature\":0.7,\"seed\":11,\"n\":2,\"logprobs\":2}",
                    MAX_TOKENS);
    json_decref(same_whole_and_streamed("/v1/completions", sb, "n = 2, seed 11"));
    free(sb);
    cr_expect_gt(accepted() - a0, 0, "n = 2 sampled: no draft was kept");
    cr_expect_geq(srv_wait_idle(&S, 30.0), 0);
}

/* Drafts by a layer in Nemotron 3's layout (tests/fixtures/nemotron_h/nh_mtp: mtp.layers.j.*, GQA
 * attention then MoE, random weights), served without a tokenizer: prompts of token ids from 2 to
 * 3000 long (max_model_len 4096), greedy with log-probabilities, whole and streamed, equal to the
 * plain server's answers. */
Test(spec_http, mtp_nemotron3_layout_answers_equal_plain_decoding, .init = start_pair_nh_mtp, .fini = stop_pair)
{
    const double a0 = accepted();
    static const int lengths[] = {2, 7, 40, 300, 3000};
    uint32_t x = 12345;
    for (size_t i = 0; i < sizeof lengths / sizeof lengths[0]; i++) {
        json_t *ids = json_array();
        for (int t = 0; t < lengths[i]; t++) {
            x = x * 1103515245u + 12345u;
            json_array_append_new(ids, json_integer((x >> 16) % 256));
        }
        json_t *b = json_pack("{s:o,s:i,s:i,s:i,s:b}", "prompt", ids, "max_tokens", 48, "temperature", 0, "logprobs",
                              3, "return_token_ids", 1);
        char *body = json_dumps(b, JSON_COMPACT), what[64];
        json_decref(b);
        snprintf(what, sizeof what, "nh_mtp, a prompt of %d token ids", lengths[i]);
        json_decref(same_whole_and_streamed("/v1/completions", body, what));
        free(body);
    }
    cr_expect_gt(accepted() - a0, 0, "no draft was kept: the comparison says nothing about speculation");
    cr_expect_geq(srv_wait_idle(&S, 30.0), 0, "the speculating server holds slots or blocks after its answers");
}

/* n-gram drafts under tensor parallelism: two ranks (nh_moe splits in two), each keeping its share
 * of the drafts' Mamba states, against the plain server at the same size: periodic prompts of token
 * ids (which random weights partly continue, so drafts are kept and refused), greedy with
 * log-probabilities, whole and streamed, equal. */
#define TP_MODEL KR_SOURCE_DIR "/tests/fixtures/nemotron_h/nh_moe"
#define TP_SPEC "{\"method\":\"ngram\",\"num_speculative_tokens\":4,\"prompt_lookup_min\":2,\"prompt_lookup_max\":4}"

static void start_pair_tp_of(const char *model, const char *spec, int k)
{
    SPEC_K = k;
    srv_spawn(&S, model, "--served-model-name", "tiny", "--cache-memory-bytes", "67108864", "--skip-tokenizer-init",
              "--tensor-parallel-size", "2", "--speculative-config", spec, NULL);
    srv_spawn(&P, model, "--served-model-name", "tiny", "--cache-memory-bytes", "67108864", "--skip-tokenizer-init",
              "--tensor-parallel-size", "2", NULL);
    srv_ready(&S);
    srv_ready(&P);
}

static void start_pair_tp(void)
{
    start_pair_tp_of(TP_MODEL, TP_SPEC, 4);
}

static void start_pair_tp_mtp(void)
{
    start_pair_tp_of(NH_MTP_MODEL, MTP_SPEC, 3);
}

/* Greedy completions of prompts given as token-id lists, ignoring EOS, with log-probabilities, whole
 * and streamed, to both servers: equal. */
static void same_greedy_token_ids(const char *const *prompts_ids, size_t n, int max_tokens, const char *label)
{
    char body[512], what[64];
    for (size_t i = 0; i < n; i++) {
        snprintf(body, sizeof body,
                 "{\"prompt\":%s,\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,\"logprobs\":2,"
                 "\"return_token_ids\":true}",
                 prompts_ids[i], max_tokens);
        snprintf(what, sizeof what, "%s, prompt %zu", label, i);
        json_decref(same_whole_and_streamed("/v1/completions", body, what));
    }
}

/* MTP drafts at two ranks: the head split as the main stack is (its logits against the float64
 * reference at two ranks: tests/model/test_mtp.c), every pass run by both ranks; greedy answers,
 * whole and streamed, equal to the plain server's at the same size. */
Test(spec_http, mtp_drafts_under_tensor_parallelism_equal_plain_decoding, .init = start_pair_tp_mtp, .fini = stop_pair)
{
    static const char *const prompts_tp[] = {"[5,6,7,8,9,10,5,6,7,8,9]", "[100,3,77,100,3,77,100,3,77]"};
    same_greedy_token_ids(prompts_tp, sizeof prompts_tp / sizeof prompts_tp[0], 60, "MTP at two ranks");
    cr_expect_gt(metric(&S, "krait:spec_decode_num_draft_tokens_total"), 0, "no draft was made");
    cr_expect_geq(srv_wait_idle(&S, 30.0), 0, "the speculating server holds slots or blocks after its answers");
}

Test(spec_http, ngram_drafts_under_tensor_parallelism_equal_plain_decoding, .init = start_pair_tp, .fini = stop_pair)
{
    const double a0 = accepted(), d0 = metric(&S, "krait:spec_decode_num_draft_tokens_total");
    static const char *const prompts_tp[] = {"[5,6,7,5,6,7,5,6,7,5,6,7]", "[11,12,13,14,15,11,12,13,14,15,11,12]",
                                             "[40,41,40,41,40,41,40,41]", "[100,3,77,100,3,77,100,3,77]"};
    same_greedy_token_ids(prompts_tp, sizeof prompts_tp / sizeof prompts_tp[0], 160, "two ranks");
    const double kept = accepted() - a0, drafted = metric(&S, "krait:spec_decode_num_draft_tokens_total") - d0;
    cr_expect_gt(kept, 0, "no draft was kept (%g drafted): the comparison says nothing about kept states", drafted);
    cr_expect_gt(drafted, kept, "every draft was kept: the comparison says nothing about refused ones");
    cr_expect_geq(srv_wait_idle(&S, 30.0), 0, "the speculating server holds slots or blocks after its answers");
}

/* ---- sampled, stops, lengths, schemas -------------------------------------------------------------- */

/* Where a greedy output repeats itself: the longest stretch [from, to) of its ids with ids[t] ==
 * ids[t - period] (period 1 to 8: a run of one token, or a phrase said again and again). Drafts are
 * kept inside it from about its 6th token on, once the 5-gram before a token has an earlier
 * occurrence in the stretch followed by that token. */
struct stretch {
    int from, to, period;
};

static struct stretch longest_stretch(const json_t *ids)
{
    struct stretch best = {0, 0, 0};
    const int n = (int)json_array_size(ids);
    for (int p = 1; p <= 8; p++) {
        for (int t = p; t < n;) {
            int e = t;
            while (e < n && json_integer_value(json_array_get(ids, (size_t)e)) ==
                                json_integer_value(json_array_get(ids, (size_t)(e - p)))) {
                e++;
            }
            if (e - t > best.to - best.from) {
                best = (struct stretch){t, e, p};
            }
            t = e > t ? e : t + 1;
        }
    }
    return best;
}

/* A stop string completed by token j of a completion (with logprobs: its tokens' texts) and by no
 * earlier token: the text of its tokens a..j for the largest a whose text first occurs where token a
 * starts. Writes where the stopped text ends (the bytes before token a); false when the tokens'
 * texts do not line up with the text (a character split over tokens). */
static bool stop_at(const json_t *choice, int j, char *stop, size_t cap, size_t *cut)
{
    const char *text = str(choice, "text");
    const json_t *toks = json_object_get(json_object_get(choice, "logprobs"), "tokens");
    size_t off[MAX_TOKENS + 1] = {0};
    cr_assert(j < MAX_TOKENS && j < (int)json_array_size(toks));
    for (int i = 0; i <= j; i++) {
        const char *t = json_string_value(json_array_get(toks, (size_t)i));
        const size_t n = t ? strlen(t) : 0;
        if (!t || strncmp(text + off[i], t, n) != 0) {
            return false;
        }
        off[i + 1] = off[i] + n;
    }
    for (int a = j; a >= 0; a--) {
        const size_t n = off[j + 1] - off[a];
        if (n == 0 || n >= cap) {
            continue;
        }
        memcpy(stop, text + off[a], n);
        stop[n] = 0;
        if (strstr(text, stop) == text + off[a]) {
            *cut = off[a];
            return true;
        }
    }
    return false;
}

Test(spec_http, sampled_stopped_cut_and_constrained_answers_equal_plain_decoding, .init = start_pair,
     .fini = stop_pair)
{
    char body[4096], what[160];
    /* n = 2 sampled with a seed, low enough a temperature for the output to loop */
    double a0 = accepted();
    char *sb = cmpl(prompts[0], "{\"max_tokens\":%d,\"temperature\":0.5,\"seed\":11,\"n\":2,\"logprobs\":2}",
                    MAX_TOKENS);
    json_decref(same_whole_and_streamed("/v1/completions", sb, "n = 2, seed 11"));
    free(sb);
    cr_expect_gt(accepted() - a0, 0, "n = 2 sampled: no draft was kept");

    /* the greedy output that repeats itself longest */
    struct stretch st = {0, 0, 0};
    size_t pi = 0;
    json_t *ref = NULL;
    for (size_t i = 0; i < sizeof prompts / sizeof prompts[0]; i++) {
        char *b = cmpl(prompts[i], "{\"max_tokens\":%d,\"temperature\":0,\"logprobs\":1,\"return_token_ids\":true}",
                       MAX_TOKENS);
        json_t *x = same_whole("/v1/completions", b, "greedy");
        free(b);
        const struct stretch y = longest_stretch(json_object_get(json_array_get(json_object_get(x, "choices"), 0),
                                                                 "token_ids"));
        if (y.to - y.from > st.to - st.from) {
            st = y;
            pi = i;
            json_decref(ref);
            ref = x;
        } else {
            json_decref(x);
        }
    }
    cr_assert(ref && st.to - st.from >= 14, "no greedy output repeats itself for 14 tokens: nothing to stop inside drafts");
    const json_t *ch0 = json_array_get(json_object_get(ref, "choices"), 0);
    cr_log_info("prompt %zu repeats a period of %d tokens from token %d to %d", pi, st.period, st.from - st.period,
                st.to);

    /* stop strings completed by the stretch's 8th, 9th and 11th repeated token: for a run of one
     * token, whose steps keep one draft, then three, then four, these are the first and the second
     * of a step's three kept drafts (the step's later tokens dropped) and the token drawn after them */
    static const int in_stretch[] = {7, 8, 10};
    a0 = accepted();
    for (size_t q = 0; q < sizeof in_stretch / sizeof in_stretch[0]; q++) {
        const int j = st.from + in_stretch[q];
        char stop[1024];
        size_t cut = 0;
        cr_assert(stop_at(ch0, j, stop, sizeof stop, &cut), "no stop string ends at token %d", j);
        json_t *req = json_pack("{s:s, s:i, s:f, s:s, s:i, s:b}", "prompt", prompts[pi], "max_tokens", MAX_TOKENS,
                                "temperature", 0.0, "stop", stop, "logprobs", 1, "return_token_ids", 1);
        char *b = json_dumps(req, JSON_COMPACT);
        json_decref(req);
        snprintf(what, sizeof what, "a stop string ending at token %d", j);
        json_t *x = same_whole_and_streamed("/v1/completions", b, what);
        const json_t *ch = json_array_get(json_object_get(x, "choices"), 0);
        cr_expect_str_eq(str(ch, "finish_reason"), "stop", "%s", what);
        cr_expect_str_eq(str(ch, "stop_reason"), stop, "%s", what);
        cr_expect_eq(usage_of(x, "completion_tokens"), j + 1, "%s: the plain server ended after %lld tokens", what,
                     (long long)usage_of(x, "completion_tokens"));
        cr_expect_eq(strlen(str(ch, "text")), cut, "%s: the text is cut at byte %zu, not %zu", what,
                     strlen(str(ch, "text")), cut);
        json_decref(x);
        free(b);
    }
    cr_expect_gt(accepted() - a0, 0, "no draft was kept under stop strings");

    /* max_tokens ending at those tokens (the last step's drafts cut to fit): "length" with exactly
     * that many tokens */
    for (size_t q = 0; q < sizeof in_stretch / sizeof in_stretch[0]; q++) {
        const int n = st.from + in_stretch[q] + 1;
        char *b = cmpl(prompts[pi], "{\"max_tokens\":%d,\"temperature\":0,\"logprobs\":1,\"return_token_ids\":true}", n);
        snprintf(what, sizeof what, "max_tokens %d", n);
        json_t *x = q == 1 ? same_whole_and_streamed("/v1/completions", b, what) : same_whole("/v1/completions", b, what);
        free(b);
        const json_t *ch = json_array_get(json_object_get(x, "choices"), 0);
        cr_expect_str_eq(str(ch, "finish_reason"), "length", "%s", what);
        cr_expect_eq(usage_of(x, "completion_tokens"), n, "%s", what);
        cr_expect_eq(json_array_size(json_object_get(ch, "token_ids")), (size_t)n, "%s", what);
        json_decref(x);
    }

    /* a stop token id: the token after the stretch, drawn where the stretch's drafts are refused */
    const json_t *ids = json_object_get(ch0, "token_ids");
    if (st.to < (int)json_array_size(ids)) {
        const long long stop_id = (long long)json_integer_value(json_array_get(ids, (size_t)st.to));
        char *b = cmpl(prompts[pi], "{\"max_tokens\":%d,\"temperature\":0,\"logprobs\":1,\"stop_token_ids\":[%lld]}",
                       MAX_TOKENS, stop_id);
        snprintf(what, sizeof what, "stop token id %lld", stop_id);
        json_t *x = same_whole("/v1/completions", b, what);
        free(b);
        cr_expect_str_eq(str(json_array_get(json_object_get(x, "choices"), 0), "finish_reason"), "stop", "%s", what);
        json_decref(x);
    }
    json_decref(ref);

    /* penalties: each row's counts are those of the tokens kept before it */
    char *pb = cmpl(prompts[0], "{\"max_tokens\":%d,\"temperature\":0,\"logprobs\":2,\"presence_penalty\":0.4,"
                                "\"repetition_penalty\":1.1}",
                    MAX_TOKENS);
    json_decref(same_whole("/v1/completions", pb, "penalties"));
    free(pb);

    /* structured outputs: the drafts the grammar forbids are refused, the answer is the plain one */
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"Give me a person.\"}],\"max_tokens\":%d,"
             "\"temperature\":0,\"logprobs\":true,\"top_logprobs\":2,\"response_format\":{\"type\":\"json_schema\","
             "\"json_schema\":{\"name\":\"p\",\"schema\":{\"type\":\"object\",\"properties\":{\"name\":{\"type\":"
             "\"string\",\"maxLength\":40},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":"
             "12},\"maxItems\":6}},\"required\":[\"name\",\"tags\"]}}}}",
             MAX_TOKENS);
    json_decref(same_whole_and_streamed("/v1/chat/completions", body, "json_schema"));
    char *b = cmpl(prompts[0], "{\"max_tokens\":%d,\"temperature\":0,\"logprobs\":1,\"response_format\":{\"type\":"
                               "\"json_object\"}}",
                   MAX_TOKENS);
    json_decref(same_whole("/v1/completions", b, "json_object"));
    free(b);
    cr_expect_geq(srv_wait_idle(&S, 30.0), 0, "the speculating server holds slots or blocks after its answers");
}

/* ---- clients leaving ------------------------------------------------------------------------------- */

/* Eight streams (two of n = 2) of a looping greedy output, their clients leaving after 1 to 8 KiB
 * (from a few tokens to about thirty: drafts run by then), all at once: the engine idles with every
 * slot and block back, /health stays 200, and the next request answers as the plain server does. */
static void leaving_clients(void)
{
    const double a0 = accepted();
    enum { N = 8 };
    struct call c[N];
    char *body[2];
    for (int n = 0; n < 2; n++) {
        body[n] = cmpl(prompts[0], "{\"max_tokens\":2000,\"temperature\":0,\"ignore_eos\":true,\"logprobs\":1,"
                                   "\"n\":%d,\"stream\":true}",
                       n + 1);
    }
    for (int i = 0; i < N; i++) {
        c[i] = (struct call){.p = &S, .path = "/v1/completions", .body = body[i % 4 == 3], .stream = true,
                             .cut = 1024 * (size_t)(i + 1)};
    }
    run_calls(c, N);
    for (int i = 0; i < N; i++) {
        cr_expect_eq(c[i].status, 200, "stream %d: %ld", i, c[i].status);
        free(c[i].raw);
    }
    free(body[0]);
    free(body[1]);
    const double idle = srv_wait_idle(&S, 30.0);
    cr_expect_geq(idle, 0, "the speculating server still holds work 30 s after every client left");
    cr_expect_gt(accepted() - a0, 0, "no draft was kept before the clients left");
    struct http_res r;
    http(&S, "GET", "/health", NULL, NULL, &r);
    cr_expect_eq(r.status, 200, "/health after the clients left: %ld", r.status);
    http_free(&r);
    /* a prompt of its own (no prefix shared with the streams, which only the speculating server saw) */
    char *next = cmpl(prompts[1], "{\"max_tokens\":%d,\"temperature\":0,\"logprobs\":5,\"return_token_ids\":true}",
                      MAX_TOKENS);
    json_decref(same_whole_and_streamed("/v1/completions", next, "after the clients left"));
    free(next);
    cr_expect_geq(srv_wait_idle(&S, 30.0), 0);
}

Test(spec_http, clients_leaving_mid_draft_leave_the_pools_whole, .init = start_pair, .fini = stop_pair)
{
    leaving_clients();
}

Test(spec_http, mtp_clients_leaving_mid_draft_leave_the_pools_whole, .init = start_pair_mtp, .fini = stop_pair)
{
    leaving_clients();
}

/* ---- refusals ------------------------------------------------------------------------------------ */

/* `krait serve MODEL args...`: its exit status, stderr in out[cap]. */
static int run_serve(const char *model, const char *const *args, char *out, size_t cap)
{
    char log[] = "/tmp/krait-spec-XXXXXX";
    const int fd = mkstemp(log);
    cr_assert(fd >= 0);
    const char *argv[16] = {KR_KRAIT_BIN, "serve", model, "--host", "127.0.0.1", "--port", "0"};
    int n = 7;
    for (int i = 0; args[i] && n < 15; i++) {
        argv[n++] = args[i];
    }
    argv[n] = NULL;
    const pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        if (dup2(fd, 2) < 0) {
            _exit(126);
        }
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    int st = 0;
    for (int i = 0; i < 1200 && waitpid(pid, &st, WNOHANG) == 0; i++) { /* 60 s: it must refuse, not serve */
        usleep(50000);
        if (i == 1199) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
        }
    }
    const ssize_t got = pread(fd, out, cap - 1, 0);
    out[got > 0 ? got : 0] = 0;
    close(fd);
    unlink(log);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(spec_http, a_bad_speculative_config_exits_2_naming_the_problem)
{
    static const struct {
        const char *config, *says;
    } cases[] = {
        {"{\"method\":", "not a JSON object"},
        {"[1]", "not a JSON object"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":4,\"draft_model\":\"x\"}", "unknown key \"draft_model\""},
        {"{\"method\":\"mtp\",\"num_speculative_tokens\":2,\"prompt_lookup_max\":3}",
         "prompt_lookup_min and prompt_lookup_max apply to method \"ngram\""},
        {"{\"method\":\"eagle\",\"num_speculative_tokens\":1}", "method \"eagle\" is unknown"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":0}", "\"num_speculative_tokens\" must be a positive"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":17}", "\"num_speculative_tokens\" 17 is more than 16"},
        {"{\"method\":\"ngram\"}", "\"num_speculative_tokens\" is required"},
        {"{\"num_speculative_tokens\":2}", "\"method\" is required"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":2,\"prompt_lookup_min\":4,\"prompt_lookup_max\":2}",
         "prompt_lookup_min 4 is more than prompt_lookup_max 2"},
    };
    char out[4096];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *args[] = {"--speculative-config", cases[i].config, NULL};
        const int rc = run_serve(MODEL, args, out, sizeof out);
        cr_expect_eq(rc, 2, "--speculative-config '%s': exit status %d", cases[i].config, rc);
        cr_expect(strstr(out, "--speculative-config") && strstr(out, cases[i].says),
                  "--speculative-config '%s': stderr does not say \"%s\": %s", cases[i].config, cases[i].says, out);
    }
    /* MTP drafts under tensor parallelism from a layer with tables of its own: refused at load */
    const char *tp[] = {"--skip-tokenizer-init", "--tensor-parallel-size", "2", "--speculative-config", MTP_SPEC, NULL};
    const int rc = run_serve(DS_MTP_MODEL, tp, out, sizeof out);
    cr_expect_neq(rc, 0, "MTP drafting with 2 ranks and the layer's own tables: exit status 0");
    cr_expect(strstr(out, "tables of its own are not split across ranks"), "stderr: %s", out);
    /* MTP drafting with a checkpoint that has no MTP head: the load fails, saying so */
    const char *mtp[] = {"--speculative-config", MTP_SPEC, NULL};
    const int rm = run_serve(MODEL, mtp, out, sizeof out);
    cr_expect_neq(rm, 0, "MTP drafting without an MTP head: exit status 0");
    cr_expect(strstr(out, "num_nextn_predict_layers 0") && strstr(out, "drafting with MTP needs one MTP layer"),
              "stderr: %s", out);
}

/* `krait plan` with --speculative-config, as serve takes it: "mtp" adds the head's weights and, for
 * its D block, a latent row and an index key per token (kv_lora + qk_rope + index_head_dim fp32
 * values on the CPU, from config.json); either method adds num_speculative_tokens Mamba states to a
 * sequence; at two ranks each holds its share of the head; a layer with tables of its own at two
 * ranks and a bad value are refused as serve refuses them. */
static json_t *plan_json(const char *model, const char *extra, int *rc)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s plan %s --device cpu --json %s > spec-plan.json 2> spec-plan.err", KR_KRAIT_BIN,
             model, extra);
    const int st = system(cmd);
    *rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    json_error_t je;
    return *rc == 0 ? json_load_file("spec-plan.json", 0, &je) : NULL;
}

static json_int_t jint(const json_t *j, const char *a, const char *b)
{
    const json_t *v = json_object_get(j, a);
    return json_integer_value(b ? json_object_get(v, b) : v);
}

Test(spec_http, the_plan_counts_the_mtp_head_and_the_drafts_states)
{
    /* config.json spells time_step_limit's bound Infinity, which is not JSON: blanked before parsing */
    char text[16384] = {0};
    FILE *cf = fopen(MTP_MODEL "/config.json", "r");
    cr_assert(cf);
    (void)!fread(text, 1, sizeof text - 1, cf);
    fclose(cf);
    for (char *inf = strstr(text, "Infinity"); inf; inf = strstr(inf, "Infinity")) {
        memcpy(inf, "0       ", 8);
    }
    json_error_t je;
    json_t *cfg = json_loads(text, 0, &je);
    cr_assert(cfg, "%s", je.text);
    const json_int_t kv_lora = json_integer_value(json_object_get(cfg, "kv_lora_rank")),
                     rope = json_integer_value(json_object_get(cfg, "qk_rope_head_dim")),
                     idx = json_integer_value(json_object_get(cfg, "index_head_dim"));
    cr_assert_str_eq(json_string_value(json_object_get(cfg, "mtp_hybrid_override_pattern")), "DE");
    json_decref(cfg);
    int rc;
    json_t *base = plan_json(MTP_MODEL, "", &rc);
    cr_assert(base, "krait plan exited %d", rc);
    cr_expect(json_is_null(json_object_get(base, "speculative")));
    json_t *mtp = plan_json(MTP_MODEL, "--speculative-config '" MTP_SPEC "'", &rc);
    cr_assert(mtp, "krait plan with MTP exited %d", rc);
    const json_int_t state = jint(base, "state_bytes_per_sequence", NULL);
    cr_assert_gt(state, 0);
    cr_expect_eq(jint(mtp, "cache_bytes_per_token", "latent") - jint(base, "cache_bytes_per_token", "latent"),
                 (kv_lora + rope) * 4, "the head's D block: one latent row per token");
    cr_expect_eq(jint(mtp, "cache_bytes_per_token", "indexer") - jint(base, "cache_bytes_per_token", "indexer"),
                 idx * 4, "the head's D block: one index key per token");
    cr_expect_eq(jint(mtp, "cache_bytes_per_token", "total") - jint(base, "cache_bytes_per_token", "total"),
                 (kv_lora + rope + idx) * 4);
    cr_expect_gt(jint(mtp, "weights_bytes_total", NULL), jint(base, "weights_bytes_total", NULL),
                 "the head's weights are counted");
    cr_expect_eq(jint(mtp, "speculative", "draft_state_bytes_per_sequence"), 3 * state);
    cr_expect(json_is_true(json_object_get(json_object_get(mtp, "speculative"), "mtp_head")));
    const json_int_t blocks = (jint(base, "max_model_len", NULL) + 15) / 16;
    cr_expect_eq(jint(mtp, "bytes_per_sequence", NULL),
                 4 * state + blocks * jint(mtp, "block_bytes", NULL), "a sequence: its state, 3 drafts' and its blocks");
    json_t *ng = plan_json(MTP_MODEL, "--speculative-config '" SPEC "'", &rc);
    cr_assert(ng, "krait plan with n-gram drafts exited %d", rc);
    cr_expect_eq(jint(ng, "cache_bytes_per_token", "total"), jint(base, "cache_bytes_per_token", "total"));
    cr_expect_eq(jint(ng, "weights_bytes_total", NULL), jint(base, "weights_bytes_total", NULL));
    cr_expect_eq(jint(ng, "bytes_per_sequence", NULL), jint(base, "bytes_per_sequence", NULL) + 4 * state);
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(ng, "speculative"), "method")), "ngram");
    json_decref(base);
    json_decref(mtp);
    json_decref(ng);
    /* the head split at two ranks: each rank holds less of it than one rank does */
    json_t *one = plan_json(NH_MTP_MODEL, "--speculative-config '" MTP_SPEC "'", &rc);
    cr_assert(one, "krait plan of nh_mtp exited %d", rc);
    json_t *two = plan_json(NH_MTP_MODEL, "-tp 2 --speculative-config '" MTP_SPEC "'", &rc);
    cr_assert(two, "krait plan of nh_mtp at two ranks exited %d", rc);
    cr_expect_lt(jint(two, "weights_bytes_max", NULL), jint(one, "weights_bytes_max", NULL));
    cr_expect(json_is_true(json_object_get(json_object_get(two, "speculative"), "mtp_head")));
    json_decref(one);
    json_decref(two);
    /* refusals: a layer with tables of its own at two ranks; a bad value */
    cr_expect_null(plan_json(DS_MTP_MODEL, "-tp 2 --speculative-config '" MTP_SPEC "'", &rc));
    cr_expect_eq(rc, 1);
    char err[4096] = {0};
    FILE *f = fopen("spec-plan.err", "r");
    cr_assert(f);
    (void)!fread(err, 1, sizeof err - 1, f);
    fclose(f);
    cr_expect(strstr(err, "tables of its own are not split across ranks"), "%s", err);
    cr_expect_null(plan_json(MTP_MODEL, "--speculative-config '{\"method\":\"eagle\",\"num_speculative_tokens\":2}'", &rc));
    cr_expect_eq(rc, 2);
    f = fopen("spec-plan.err", "r");
    cr_assert(f);
    memset(err, 0, sizeof err);
    (void)!fread(err, 1, sizeof err - 1, f);
    fclose(f);
    cr_expect(strstr(err, "krait plan: --speculative-config: method \"eagle\" is unknown"), "%s", err);
}
