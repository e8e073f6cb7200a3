/* The OpenAI session without a socket: a session driven through its sink by a scripted engine
 * (events made up here, fed from token ids of the embedded model's tokenizer) and once by the real
 * engine on models/tiny-hybrid. The checks are about behaviour, each against something the test
 * knows independently of the session: the text it fed, the events it sent, the engine calls it saw.
 *   - streamed deltas, concatenated per choice, are the non-streamed text for the same events;
 *   - exactly one finish_reason per choice, and every choice index once, in its own prompt's order;
 *   - a stop string ends its choice with the text before it and appears in no delta;
 *   - usage counts the prompt tokens submitted and the tokens delivered;
 *   - a refused or cancelled session says nothing more, cancels the engine's work and frees
 *     everything (kr_alloc_bytes_in_use back where it was). */
#include "session.h"

#include "alloc.h"
#include "backend.h"
#include "chat.h"
#include "log.h"
#include "model.h"
#include "tokenizer.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MODEL KR_SOURCE_DIR "/models/tiny-hybrid"

/* ---- the carrier: events from the (scripted or real) engine thread to this thread ------------- */

static pthread_mutex_t g_qmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_qcv = PTHREAD_COND_INITIALIZER;
static struct kr_sess_event *g_qh, *g_qt;
static int64_t g_n_tokens_posted; /* KR_EVENT_TOKEN events carried so far */

static void post(void *user, struct kr_sess_event *n)
{
    (void)user;
    pthread_mutex_lock(&g_qmu);
    g_n_tokens_posted += n->ev.type == KR_EVENT_TOKEN;
    if (g_qt) {
        g_qt->next = n;
    } else {
        g_qh = n;
    }
    g_qt = n;
    pthread_cond_signal(&g_qcv);
    pthread_mutex_unlock(&g_qmu);
}

/* Delivers everything queued; returns how many events. */
static int drain(void)
{
    pthread_mutex_lock(&g_qmu);
    struct kr_sess_event *n = g_qh;
    g_qh = g_qt = NULL;
    pthread_mutex_unlock(&g_qmu);
    int k = 0;
    while (n) {
        struct kr_sess_event *next = n->next;
        kr_sess_event_deliver(n);
        n = next;
        k++;
    }
    return k;
}

/* ---- a scripted engine -------------------------------------------------------------------------- */

#define MAX_REQS 16

struct fake_req {
    struct kr_request_params p;
    uint64_t id;
    bool cancelled;
    int32_t choice_cancels[8];  /* per choice: kr_engine_cancel_choice calls */
};

static struct fake_req g_reqs[MAX_REQS];
static int g_n_reqs;
static int g_refuse_at = -1;    /* the submission (0-based) that is refused with KR_ERR_BUSY */

static enum kr_status fake_submit(void *ctx, const struct kr_request_params *p, uint64_t *req_id, struct kr_err *err)
{
    (void)ctx;
    if (g_n_reqs == g_refuse_at) {
        snprintf(err->msg, sizeof err->msg, "the queue is full");
        return KR_ERR_BUSY;
    }
    cr_assert_lt(g_n_reqs, MAX_REQS);
    struct fake_req *r = &g_reqs[g_n_reqs];
    memset(r, 0, sizeof *r);
    r->p = *p;
    r->p.prompt = NULL; /* borrowed by the call only */
    r->id = 1000 + (uint64_t)g_n_reqs;
    *req_id = r->id;
    g_n_reqs++;
    return KR_OK;
}

static struct fake_req *fake_find(uint64_t id)
{
    for (int i = 0; i < g_n_reqs; i++) {
        if (g_reqs[i].id == id) {
            return &g_reqs[i];
        }
    }
    cr_assert_fail("the session named engine request %llu, never submitted", (unsigned long long)id);
    return NULL;
}

static void fake_cancel(void *ctx, uint64_t id)
{
    (void)ctx;
    fake_find(id)->cancelled = true;
}

static void fake_cancel_choice(void *ctx, uint64_t id, int32_t index)
{
    (void)ctx;
    cr_assert(index >= 0 && index < 8);
    fake_find(id)->choice_cancels[index]++;
}

static bool fake_failed(void *ctx)
{
    (void)ctx;
    return false;
}

static const struct kr_sess_engine_i fake_engine = {
    .submit = fake_submit,
    .cancel = fake_cancel,
    .cancel_choice = fake_cancel_choice,
    .failed = fake_failed,
};

/* The engine's events for request r (as the engine thread would send them). */
static void ev_token(int r, int32_t choice, int32_t token)
{
    struct kr_event ev = {.type = KR_EVENT_TOKEN, .req_id = g_reqs[r].id, .user = g_reqs[r].p.user,
                          .index = choice, .token = token, .logprob = -0.25f};
    g_reqs[r].p.cb(&ev, g_reqs[r].p.user);
}

static void ev_finish(int r, int32_t choice, enum kr_finish_reason why)
{
    struct kr_event ev = {.type = KR_EVENT_FINISH, .req_id = g_reqs[r].id, .user = g_reqs[r].p.user,
                          .index = choice, .finish = why, .stop_token = -1};
    g_reqs[r].p.cb(&ev, g_reqs[r].p.user);
}

/* ---- the environment ------------------------------------------------------------------------------ */

static struct kr_tokenizer *g_tok;
static struct kr_chat *g_chat; /* the model's template; the environment has none unless a test sets it */
static struct kr_metrics g_met;
static struct kr_sess_env g_env;

static void setup(void)
{
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    struct kr_err err = {0};
    cr_assert_eq(kr_tokenizer_load(MODEL, NULL, &g_tok, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(kr_chat_load(g_tok, NULL, &g_chat, &err), KR_OK, "%s", err.msg);
    cr_assert(g_chat);
    kr_metrics_init(&g_met);
    g_env = (struct kr_sess_env){.engine = &fake_engine, .tok = g_tok, .vocab = kr_tokenizer_n_vocab(g_tok),
                                 .max_model_len = 4096, .model_name = "tiny", .met = &g_met, .post = post};
    g_n_reqs = 0;
    g_refuse_at = -1;
}

static void teardown(void)
{
    kr_chat_free(g_chat);
    kr_tokenizer_free(g_tok);
}

TestSuite(session, .init = setup, .fini = teardown, .timeout = 120);

/* Token ids of text (no special tokens), fed to choice `choice` of request r one by one. */
static int32_t feed(int r, int32_t choice, const char *text)
{
    int32_t *ids = NULL;
    int64_t n = 0;
    struct kr_err err = {0};
    cr_assert_eq(kr_tokenizer_encode(g_tok, text, strlen(text), false, &ids, &n, &err), KR_OK, "%s", err.msg);
    for (int64_t i = 0; i < n; i++) {
        ev_token(r, choice, ids[i]);
    }
    kr_free(ids);
    return (int32_t)n;
}

/* ---- a recording sink ------------------------------------------------------------------------------ */

struct rec {
    int calls;          /* every sink call */
    bool begun;
    json_t *events;     /* the stream's events, parsed */
    int n_done;
    int status;
    json_t *body;       /* the answer, parsed (not a stream) */
    bool body_null;
};

static void rec_begin(void *user)
{
    struct rec *r = user;
    r->calls++;
    cr_expect(!r->begun, "stream_begin twice");
    cr_expect(!json_array_size(r->events), "stream_begin after an event");
    r->begun = true;
}

static bool rec_event(void *user, const char *json, size_t len)
{
    struct rec *r = user;
    r->calls++;
    cr_expect(r->begun, "an event before stream_begin");
    cr_expect_eq(r->n_done, 0, "an event after done");
    json_error_t je;
    json_t *j = json_loadb(json, len, 0, &je);
    cr_assert(j, "an event that is not one JSON object: %.*s", (int)len, json);
    json_array_append_new(r->events, j);
    return true;
}

static void rec_done(void *user, int status, const char *body, size_t len)
{
    struct rec *r = user;
    r->calls++;
    r->n_done++;
    r->status = status;
    r->body_null = body == NULL;
    if (body) {
        json_error_t je;
        r->body = json_loadb(body, len, 0, &je);
        cr_assert(r->body, "an answer that is not JSON: %.*s", (int)len, body);
    }
}

static const struct kr_sess_sink rec_sink = {.stream_begin = rec_begin, .stream_event = rec_event, .done = rec_done};

static void rec_init(struct rec *r)
{
    memset(r, 0, sizeof *r);
    r->events = json_array();
}

static void rec_free(struct rec *r)
{
    json_decref(r->events);
    json_decref(r->body);
}

/* A prepared and started session for `body`. */
static struct kr_sess *start(enum kr_sess_kind kind, const char *body, struct rec *r)
{
    struct kr_sess *s = kr_sess_create(&g_env, kind, 0);
    cr_assert(s);
    kr_sess_prepare(s, body, strlen(body));
    kr_sess_start(s, &rec_sink, r);
    return s;
}

/* The text of a streamed event's choice: completions "text", chat delta "content". */
static const char *delta_text(json_t *c)
{
    json_t *t = json_object_get(c, "text");
    if (!t) {
        t = json_object_get(json_object_get(c, "delta"), "content");
    }
    return json_is_string(t) ? json_string_value(t) : "";
}

#define MAXC 16

/* Concatenates the stream's deltas per choice index and counts each index's finish_reasons. */
static void stream_collect(const struct rec *r, char texts[MAXC][512], int finishes[MAXC], char reasons[MAXC][16])
{
    memset(texts, 0, MAXC * 512);
    memset(finishes, 0, MAXC * sizeof(int));
    memset(reasons, 0, MAXC * 16);
    size_t i;
    json_t *ev;
    json_array_foreach(r->events, i, ev)
    {
        size_t k;
        json_t *c;
        json_array_foreach(json_object_get(ev, "choices"), k, c)
        {
            const json_int_t idx = json_integer_value(json_object_get(c, "index"));
            cr_assert(idx >= 0 && idx < MAXC, "choice index %lld", (long long)idx);
            cr_expect_eq(finishes[idx], 0, "choice %lld has a delta after its finish_reason", (long long)idx);
            strncat(texts[idx], delta_text(c), 511 - strlen(texts[idx]));
            json_t *fr = json_object_get(c, "finish_reason");
            if (json_is_string(fr)) {
                finishes[idx]++;
                snprintf(reasons[idx], 16, "%s", json_string_value(fr));
            }
        }
    }
}

static const char *answer_text(json_t *c)
{
    json_t *t = json_object_get(c, "text");
    if (!t) {
        t = json_object_get(json_object_get(c, "message"), "content");
    }
    return json_is_string(t) ? json_string_value(t) : "";
}

/* ---- tests ---------------------------------------------------------------------------------------- */

static const char *const TEXT0 = "The quick brown fox jumps over the lazy dog.";
static const char *const TEXT1 = "Pack my box with five dozen liquor jugs!";

/* Runs one completions request (n = 2) on the same scripted events, streamed or not: choice 0
 * gets TEXT0, choice 1 TEXT1, their tokens interleaved. Returns the number of tokens fed. */
static int32_t run_two_choices(enum kr_sess_kind kind, bool stream, struct rec *r)
{
    char body[256];
    if (kind == KR_SESS_CHAT) {
        snprintf(body, sizeof body,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"n\":2,\"max_tokens\":64,\"stream\":%s}",
                 stream ? "true" : "false");
    } else {
        snprintf(body, sizeof body, "{\"prompt\":[5,6,7],\"n\":2,\"max_tokens\":64,\"stream\":%s}",
                 stream ? "true" : "false");
    }
    g_n_reqs = 0;
    struct kr_sess *s = start(kind, body, r);
    cr_assert_eq(g_n_reqs, 1, "one prompt, one engine request");
    cr_assert_eq(g_reqs[0].p.n, 2);
    cr_expect_eq(r->begun, stream);
    int32_t n = 0;
    /* interleave: half of choice 1, all of choice 0, the rest of choice 1 */
    n += feed(0, 1, "Pack my box ");
    drain();
    n += feed(0, 0, TEXT0);
    drain();
    n += feed(0, 1, "with five dozen liquor jugs!");
    ev_finish(0, 1, KR_FINISH_LENGTH);
    ev_finish(0, 0, KR_FINISH_STOP);
    drain();
    cr_expect_eq(r->n_done, 1, "done exactly once");
    kr_sess_release(s);
    return n;
}

Test(session, streamed_deltas_concatenate_to_the_non_streamed_text)
{
    const enum kr_sess_kind kinds[] = {KR_SESS_COMPLETIONS, KR_SESS_CHAT};
    for (int k = 0; k < 2; k++) {
        g_env.chat = g_chat;
        struct rec a, b;
        rec_init(&a);
        rec_init(&b);
        run_two_choices(kinds[k], false, &a);
        run_two_choices(kinds[k], true, &b);
        cr_assert_eq(a.status, 200);
        cr_assert(a.body);
        json_t *ch = json_object_get(a.body, "choices");
        cr_assert_eq(json_array_size(ch), 2);
        char texts[MAXC][512], reasons[MAXC][16];
        int fin[MAXC];
        stream_collect(&b, texts, fin, reasons);
        for (size_t i = 0; i < 2; i++) {
            json_t *c = json_array_get(ch, i);
            const json_int_t idx = json_integer_value(json_object_get(c, "index"));
            cr_expect_str_eq(texts[idx], answer_text(c), "choice %lld: streamed and whole texts differ", (long long)idx);
            cr_expect_str_eq(reasons[idx], json_string_value(json_object_get(c, "finish_reason")));
        }
        /* and both are the text that was fed */
        cr_expect_str_eq(texts[0], TEXT0);
        cr_expect_str_eq(texts[1], TEXT1);
        rec_free(&a);
        rec_free(&b);
    }
}

Test(session, exactly_one_finish_reason_per_choice_and_the_stream_ends_once)
{
    struct rec r;
    rec_init(&r);
    run_two_choices(KR_SESS_COMPLETIONS, true, &r);
    char texts[MAXC][512], reasons[MAXC][16];
    int fin[MAXC];
    stream_collect(&r, texts, fin, reasons);
    cr_expect_eq(fin[0], 1, "choice 0: %d finish_reasons", fin[0]);
    cr_expect_eq(fin[1], 1, "choice 1: %d finish_reasons", fin[1]);
    cr_expect_str_eq(reasons[0], "stop");
    cr_expect_str_eq(reasons[1], "length");
    cr_expect_eq(r.n_done, 1);
    cr_expect_eq(r.status, 200);
    cr_expect(r.body_null, "a stream's end carries no body");
    rec_free(&r);
}

/* "dozen" is split across tokens and across events: the choice ends right before it, no delta
 * holds it, the engine is told to stop that choice (and only that one), and the tokens the engine
 * sends before its cancel lands change nothing. */
Test(session, a_stop_string_ends_its_choice_with_the_text_before_it)
{
    for (int stream = 0; stream < 2; stream++) {
        struct rec r;
        rec_init(&r);
        g_n_reqs = 0;
        char body[256];
        snprintf(body, sizeof body, "{\"prompt\":[5,6,7],\"n\":2,\"stop\":[\"zzz\",\"dozen\"],\"stream\":%s}",
                 stream ? "true" : "false");
        struct kr_sess *s = start(KR_SESS_COMPLETIONS, body, &r);
        feed(0, 0, "Pack my box with five doz");
        drain();
        feed(0, 1, TEXT0);
        drain();
        feed(0, 0, "en liquor jugs!");
        drain();
        cr_expect_eq(g_reqs[0].choice_cancels[0], 1, "the stopped choice is cancelled once");
        cr_expect_eq(g_reqs[0].choice_cancels[1], 0, "the other choice goes on");
        feed(0, 0, " more text after the stop");
        ev_finish(0, 0, KR_FINISH_CANCELLED);
        ev_finish(0, 1, KR_FINISH_LENGTH);
        drain();
        cr_assert_eq(r.n_done, 1);
        if (stream) {
            char texts[MAXC][512], reasons[MAXC][16];
            int fin[MAXC];
            stream_collect(&r, texts, fin, reasons);
            cr_expect_str_eq(texts[0], "Pack my box with five ");
            cr_expect_str_eq(reasons[0], "stop");
            cr_expect_str_eq(texts[1], TEXT0);
            size_t i;
            json_t *ev;
            json_array_foreach(r.events, i, ev)
            {
                const char *d = delta_text(json_array_get(json_object_get(ev, "choices"), 0));
                cr_expect(!strstr(d, "doz") && !strstr(d, "en") && !strstr(d, "liquor"), "a delta past the stop: %s", d);
            }
        } else {
            json_t *c0 = json_array_get(json_object_get(r.body, "choices"), 0);
            cr_expect_str_eq(answer_text(c0), "Pack my box with five ");
            cr_expect_str_eq(json_string_value(json_object_get(c0, "finish_reason")), "stop");
        }
        kr_sess_release(s);
        rec_free(&r);
    }
}

/* Three prompts, n = 2: three engine requests; their events arrive out of order, yet every choice
 * index 0..5 appears once, index p*n + i holding prompt p's choice i. */
Test(session, several_prompts_keep_each_choice_index_once_in_prompt_order)
{
    const char *words[3][2] = {{"alpha one", "alpha two"}, {"beta one", "beta two"}, {"gamma one", "gamma two"}};
    for (int stream = 0; stream < 2; stream++) {
        struct rec r;
        rec_init(&r);
        g_n_reqs = 0;
        char body[256];
        snprintf(body, sizeof body, "{\"prompt\":[\"a b\",\"c d e\",\"f\"],\"n\":2,\"stream\":%s}",
                 stream ? "true" : "false");
        struct kr_sess *s = start(KR_SESS_COMPLETIONS, body, &r);
        cr_assert_eq(g_n_reqs, 3, "one engine request per prompt");
        const int order[] = {2, 0, 1};
        for (int k = 0; k < 3; k++) {
            const int p = order[k];
            feed(p, 1, words[p][1]);
            feed(p, 0, words[p][0]);
            drain();
        }
        for (int k = 0; k < 3; k++) {
            ev_finish(order[k], 0, KR_FINISH_LENGTH);
            ev_finish(order[k], 1, KR_FINISH_LENGTH);
        }
        drain();
        cr_assert_eq(r.n_done, 1);
        if (stream) {
            char texts[MAXC][512], reasons[MAXC][16];
            int fin[MAXC];
            stream_collect(&r, texts, fin, reasons);
            for (int i = 0; i < 6; i++) {
                cr_expect_eq(fin[i], 1, "choice %d: %d finish_reasons", i, fin[i]);
                cr_expect_str_eq(texts[i], words[i / 2][i % 2], "choice %d", i);
            }
            cr_expect_eq(fin[6], 0);
        } else {
            json_t *ch = json_object_get(r.body, "choices");
            cr_assert_eq(json_array_size(ch), 6);
            int seen[6] = {0};
            for (size_t i = 0; i < 6; i++) {
                json_t *c = json_array_get(ch, i);
                const json_int_t idx = json_integer_value(json_object_get(c, "index"));
                cr_assert(idx >= 0 && idx < 6);
                seen[idx]++;
                cr_expect_eq(idx, (json_int_t)i, "choices in index order");
                cr_expect_str_eq(answer_text(c), words[idx / 2][idx % 2], "choice %lld", (long long)idx);
            }
            for (int i = 0; i < 6; i++) {
                cr_expect_eq(seen[i], 1, "choice %d appears %d times", i, seen[i]);
            }
        }
        kr_sess_release(s);
        rec_free(&r);
    }
}

/* usage: the prompt tokens handed to the engine, and every token it delivered (the stopped
 * choice's tokens count as generated, whatever the text kept). */
Test(session, usage_counts_the_tokens_submitted_and_delivered)
{
    for (int stream = 0; stream < 2; stream++) {
        struct rec r;
        rec_init(&r);
        g_n_reqs = 0;
        char body[256];
        snprintf(body, sizeof body, "{\"prompt\":[[1,2,3,4],[9,8]],\"n\":1%s}",
                 stream ? ",\"stream\":true,\"stream_options\":{\"include_usage\":true}" : "");
        struct kr_sess *s = start(KR_SESS_COMPLETIONS, body, &r);
        cr_assert_eq(g_n_reqs, 2);
        const int32_t prompt = g_reqs[0].p.n_prompt + g_reqs[1].p.n_prompt;
        cr_expect_eq(prompt, 6);
        int32_t gen = feed(0, 0, TEXT0) + feed(1, 0, TEXT1);
        ev_token(1, 0, 7);
        gen++;
        ev_finish(0, 0, KR_FINISH_LENGTH);
        ev_finish(1, 0, KR_FINISH_STOP);
        drain();
        cr_assert_eq(r.n_done, 1);
        json_t *usage = NULL;
        if (stream) {
            json_t *last = json_array_get(r.events, json_array_size(r.events) - 1);
            cr_expect_eq(json_array_size(json_object_get(last, "choices")), 0, "the usage event has no choices");
            usage = json_object_get(last, "usage");
        } else {
            usage = json_object_get(r.body, "usage");
        }
        cr_assert(usage, "no usage");
        cr_expect_eq(json_integer_value(json_object_get(usage, "prompt_tokens")), prompt);
        cr_expect_eq(json_integer_value(json_object_get(usage, "completion_tokens")), gen);
        int64_t up = 0, uc = 0;
        kr_sess_usage(s, &up, &uc);
        cr_expect_eq(up, prompt);
        cr_expect_eq(uc, gen);
        kr_sess_release(s);
        rec_free(&r);
    }
}

/* The client goes away mid-stream: the engine is told, nothing more reaches the sink (the
 * engine's last events included), the session lives until those events and then frees all. */
Test(session, a_cancelled_session_says_nothing_more_and_frees_everything)
{
    const size_t before = kr_alloc_bytes_in_use();
    struct rec r;
    rec_init(&r);
    struct kr_sess *s = start(KR_SESS_COMPLETIONS, "{\"prompt\":[[1,2],[3]],\"n\":2,\"stream\":true,\"logprobs\":2}", &r);
    cr_assert_eq(g_n_reqs, 2);
    feed(0, 0, "Hello there");
    feed(1, 1, "General");
    drain();
    cr_assert_gt(r.calls, 1, "deltas went out before the cancel");
    const int calls = r.calls;
    kr_sess_cancel(s, NULL);
    cr_expect(g_reqs[0].cancelled && g_reqs[1].cancelled, "every engine request is cancelled");
    cr_expect_eq(r.calls, calls, "cancel itself says nothing");
    kr_sess_release(s); /* the transport lets go first: the engine still owes events */
    feed(0, 0, " and more");
    for (int p = 0; p < 2; p++) {
        ev_finish(p, 0, KR_FINISH_CANCELLED);
        drain();
        cr_expect_eq(r.calls, calls, "a sink call after the cancel");
        ev_finish(p, 1, KR_FINISH_CANCELLED);
    }
    drain(); /* the last event frees the session */
    cr_expect_eq(r.calls, calls, "a sink call after the cancel");
    cr_expect_eq(g_env.n_running, 0, "still counted as running");
    rec_free(&r);
    cr_expect_eq(kr_alloc_bytes_in_use(), before, "%zu bytes leaked", kr_alloc_bytes_in_use() - before);
}

/* The shutdown deadline cuts a stream: one error event, then the end, and nothing after. */
Test(session, a_cut_stream_ends_with_one_error_event)
{
    struct rec r;
    rec_init(&r);
    struct kr_sess *s = start(KR_SESS_COMPLETIONS, "{\"prompt\":[1,2],\"stream\":true}", &r);
    feed(0, 0, "Hello");
    drain();
    const size_t n_before = json_array_size(r.events);
    struct kr_oai_error e;
    kr_oai_error(&e, KR_OAI_UNAVAILABLE, "", "the server shut down");
    kr_sess_cancel(s, &e);
    cr_expect(g_reqs[0].cancelled);
    cr_assert_eq(r.n_done, 1);
    cr_assert_eq(json_array_size(r.events), n_before + 1, "one error event");
    json_t *err = json_object_get(json_array_get(r.events, n_before), "error");
    cr_expect_str_eq(json_string_value(json_object_get(err, "message")), "the server shut down");
    const int calls = r.calls;
    ev_finish(0, 0, KR_FINISH_CANCELLED);
    drain();
    kr_sess_cancel(s, &e);
    cr_expect_eq(r.calls, calls, "nothing after the end");
    kr_sess_release(s);
    rec_free(&r);
}

/* An engine error: a lost device answers 503 as soon as its error event says so, before the
 * engine's own flag turns (the scripted engine's never does); any other step failure is 500. */
Test(session, a_lost_device_answers_503_from_its_event_alone)
{
    for (int lost = 0; lost < 2; lost++) {
        g_n_reqs = 0;
        struct rec r;
        rec_init(&r);
        struct kr_sess *s = start(KR_SESS_COMPLETIONS, "{\"prompt\":[1,2]}", &r);
        feed(0, 0, "Hello");
        struct kr_event ev = {.type = KR_EVENT_ERROR, .req_id = g_reqs[0].id, .user = g_reqs[0].p.user,
                              .status = KR_ERR_CUDA, .message = "the compute device failed (test)",
                              .device_lost = lost != 0};
        g_reqs[0].p.cb(&ev, g_reqs[0].p.user);
        drain();
        cr_assert_eq(r.n_done, 1);
        cr_expect_eq(r.status, lost ? 503 : 500, "device_lost %d: status %d", lost, r.status);
        const char *msg = json_string_value(json_object_get(json_object_get(r.body, "error"), "message"));
        cr_expect(msg && strstr(msg, "compute device failed"), "message: %s", msg ? msg : "(none)");
        kr_sess_release(s);
        rec_free(&r);
    }
}

/* The second prompt is refused (queue full): one 429 answer, the first prompt cancelled, and its
 * later events neither answer again nor leave the session counted as running. */
Test(session, a_refused_prompt_answers_once_and_cancels_the_others)
{
    g_refuse_at = 1;
    struct rec r;
    rec_init(&r);
    struct kr_sess *s = start(KR_SESS_COMPLETIONS, "{\"prompt\":[[1,2],[3,4]],\"stream\":true}", &r);
    cr_assert_eq(r.n_done, 1);
    cr_expect_eq(r.status, 429);
    cr_expect(!r.begun, "a refusal is not a stream");
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(r.body, "error"), "code")), "queue_full");
    cr_assert_eq(g_n_reqs, 1);
    cr_expect(g_reqs[0].cancelled, "the prompt already queued is cancelled");
    ev_finish(0, 0, KR_FINISH_CANCELLED);
    drain();
    cr_expect_eq(r.n_done, 1);
    cr_expect_eq(g_env.n_running, 0, "n_running %d after every prompt ended", g_env.n_running);
    kr_sess_release(s);
    rec_free(&r);
}

/* A request the engine never sees: an invalid body, an unknown model, a chat request without a
 * template; each answers once with its OpenAI error and submits nothing. */
Test(session, invalid_requests_answer_with_their_error_and_submit_nothing)
{
    const struct {
        enum kr_sess_kind kind;
        const char *body;
        int status;
        const char *param;
    } cases[] = {
        {KR_SESS_COMPLETIONS, "{\"prompt\":[1,2],\"max_tokens\":0}", 400, "max_tokens"},
        {KR_SESS_COMPLETIONS, "{\"prompt\":[1,2],\"model\":\"other\"}", 404, "model"},
        {KR_SESS_COMPLETIONS, "{\"prompt\":[1,99999999]}", 400, "prompt"},
        {KR_SESS_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", 400, "messages"},
        {KR_SESS_DETOKENIZE, "{\"tokens\":[-1]}", 400, "tokens[0]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct rec r;
        rec_init(&r);
        g_n_reqs = 0;
        struct kr_sess *s = start(cases[i].kind, cases[i].body, &r);
        cr_expect_eq(r.n_done, 1, "case %zu", i);
        cr_expect_eq(r.status, cases[i].status, "case %zu: %d", i, r.status);
        cr_expect_str_eq(json_string_value(json_object_get(json_object_get(r.body, "error"), "param")),
                         cases[i].param, "case %zu", i);
        cr_expect_eq(g_n_reqs, 0, "case %zu reached the engine", i);
        cr_expect_str_eq(kr_sess_id(s), "", "case %zu has an answer id", i);
        kr_sess_release(s);
        rec_free(&r);
    }
}

/* /tokenize then /detokenize give back the text. */
Test(session, tokenize_and_detokenize_round_trip)
{
    struct rec a, b;
    rec_init(&a);
    rec_init(&b);
    char body[256];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"add_special_tokens\":false}", TEXT0);
    struct kr_sess *s = start(KR_SESS_TOKENIZE, body, &a);
    cr_assert_eq(a.status, 200);
    json_t *toks = json_object_get(a.body, "tokens");
    cr_expect_eq((size_t)json_integer_value(json_object_get(a.body, "count")), json_array_size(toks));
    json_t *req = json_pack("{sO}", "tokens", toks);
    char *dbody = json_dumps(req, 0);
    struct kr_sess *t = start(KR_SESS_DETOKENIZE, dbody, &b);
    cr_assert_eq(b.status, 200);
    cr_expect_str_eq(json_string_value(json_object_get(b.body, "prompt")), TEXT0);
    free(dbody);
    json_decref(req);
    kr_sess_release(s);
    kr_sess_release(t);
    rec_free(&a);
    rec_free(&b);
}

/* ---- the real engine ---------------------------------------------------------------------------------- */

/* Greedy decoding of the same prompt on the real engine, streamed and not: the same text, the same
 * usage, one finish_reason. */
Test(session, the_real_engine_streams_what_it_answers_whole)
{
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    struct kr_model *m = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_model_load(MODEL, be, &m, &err), KR_OK, "%s", err.msg);
    struct kr_engine_config cfg;
    kr_engine_config_default(&cfg);
    cfg.max_num_seqs = 4;
    cfg.max_num_batched_tokens = 256;
    cfg.max_model_len = 512;
    cfg.cache_bytes = (size_t)64 << 20;
    cr_assert_eq(kr_model_reserve(m, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_num_seqs, 512, cfg.block_size),
                 KR_OK);
    struct kr_engine *eng = NULL;
    cr_assert_eq(kr_engine_create(m, &cfg, &eng, &err), KR_OK, "%s", err.msg);
    g_env.engine = &kr_sess_engine_krait;
    g_env.engine_ctx = eng;
    g_env.vocab = m->cfg.vocab;
    g_env.max_model_len = 512;
    struct rec r[2];
    int64_t posted[2];
    for (int stream = 0; stream < 2; stream++) {
        g_n_tokens_posted = 0;
        rec_init(&r[stream]);
        char body[256];
        snprintf(body, sizeof body,
                 "{\"prompt\":\"Once upon a time\",\"max_tokens\":12,\"temperature\":0%s}",
                 stream ? ",\"stream\":true,\"stream_options\":{\"include_usage\":true}" : "");
        struct kr_sess *s = start(KR_SESS_COMPLETIONS, body, &r[stream]);
        while (r[stream].n_done == 0) {
            pthread_mutex_lock(&g_qmu);
            while (!g_qh) {
                pthread_cond_wait(&g_qcv, &g_qmu);
            }
            pthread_mutex_unlock(&g_qmu);
            drain();
        }
        posted[stream] = g_n_tokens_posted;
        kr_sess_release(s);
    }
    kr_engine_free(eng);
    drain();
    char *dump = r[0].body ? json_dumps(r[0].body, 0) : NULL;
    cr_assert_eq(r[0].status, 200, "%s", dump ? dump : "");
    free(dump);
    json_t *c = json_array_get(json_object_get(r[0].body, "choices"), 0);
    char texts[MAXC][512], reasons[MAXC][16];
    int fin[MAXC];
    stream_collect(&r[1], texts, fin, reasons);
    cr_expect_str_eq(texts[0], answer_text(c));
    cr_expect_eq(fin[0], 1);
    cr_expect_str_eq(reasons[0], json_string_value(json_object_get(c, "finish_reason")));
    json_t *u0 = json_object_get(r[0].body, "usage");
    json_t *u1 = json_object_get(json_array_get(r[1].events, json_array_size(r[1].events) - 1), "usage");
    cr_expect(json_equal(u0, u1), "usage differs");
    cr_expect_eq(json_integer_value(json_object_get(u0, "completion_tokens")), posted[0]);
    cr_expect_eq(json_integer_value(json_object_get(u1, "completion_tokens")), posted[1]);
    cr_expect_gt(posted[0], 0);
    rec_free(&r[0]);
    rec_free(&r[1]);
    kr_model_free(m);
    kr_backend_free(be);
}

/* An allocation that fails while tokens arrive (the event's copy, a token's text, the choice's
 * growth, the answer), once or from then on, ends the request with one answer, whole or a 500,
 * and frees everything, for a request with logprobs. A token whose text could not be allocated
 * used to be freed as if it had been. */
Test(session, an_allocation_failure_while_tokens_arrive_ends_cleanly)
{
    int32_t *ids = NULL;
    int64_t n = 0;
    struct kr_err err = {0};
    const char *text = "Hello there, general: the quick brown fox jumps over the lazy dog again and again";
    cr_assert_eq(kr_tokenizer_encode(g_tok, text, strlen(text), false, &ids, &n, &err), KR_OK, "%s", err.msg);
    cr_assert_gt(n, 8);
    for (uint64_t t = 2; t <= 160; t++) {
        const uint64_t k = t / 2;
        const int sticky = (int)(t % 2);
        g_n_reqs = 0;
        const size_t before = kr_alloc_bytes_in_use();
        struct rec r;
        rec_init(&r);
        struct kr_sess *s = start(KR_SESS_COMPLETIONS, "{\"prompt\":[1,2],\"logprobs\":0,\"max_tokens\":200}", &r);
        cr_assert_eq(g_n_reqs, 1);
        kr_alloc_fail_at(k, sticky); /* the k-th allocation from here fails (and every later one) */
        for (int64_t i = 0; i < n; i++) {
            ev_token(0, 0, ids[i]);
        }
        drain();
        kr_alloc_fail_at(0, 0);
        ev_finish(0, 0, KR_FINISH_LENGTH);
        drain();
        cr_expect_eq(r.n_done, 1, "failure at allocation %llu: %d answers", (unsigned long long)k, r.n_done);
        cr_expect(r.status == 200 || r.status == 500, "failure at allocation %llu: status %d", (unsigned long long)k,
                  r.status);
        kr_sess_release(s);
        rec_free(&r);
        cr_expect_eq(kr_alloc_bytes_in_use(), before, "failure at allocation %llu: %zu bytes leaked",
                     (unsigned long long)k, kr_alloc_bytes_in_use() - before);
    }
    kr_free(ids);
}

/* kr_chat_render of messages (JSON text) with template `tpl` (NULL: the model's); caller frees. */
static char *render_with(const char *tpl, const char *messages)
{
    char path[] = "/tmp/krait-tpl-XXXXXX";
    struct kr_chat *c = g_chat;
    struct kr_err err = {0};
    if (tpl) {
        int fd = mkstemp(path);
        cr_assert(fd >= 0);
        FILE *fp = fdopen(fd, "w");
        fputs(tpl, fp);
        fclose(fp);
        cr_assert_eq(kr_chat_load(g_tok, path, &c, &err), KR_OK, "%s", err.msg);
        unlink(path);
    }
    json_t *m = json_loads(messages, 0, NULL);
    cr_assert(m);
    char *text = NULL;
    size_t len = 0;
    struct kr_oai_error e;
    cr_assert_eq(kr_chat_render(c, m, NULL, true, false, NULL, &text, &len, &e), KR_OK, "%s", e.message);
    json_decref(m);
    if (tpl) {
        kr_chat_free(c);
    }
    char *out = strdup(text);
    kr_free(text);
    return out;
}

/* A template that writes qwen3_coder calls (as Nemotron 3's and Qwen3-Coder's do) iterates
 * `arguments|items`: the JSON string OpenAI sends reaches it as the object it spells. Other
 * templates get the string as it came. */
Test(session, qwen3_coder_templates_get_call_arguments_as_objects)
{
    const char *tpl = "{%- for m in messages %}{%- if m.tool_calls %}{%- for tc in m.tool_calls %}"
                      "{{- '<tool_call>\\n<function=' ~ tc.function.name ~ '>\\n' -}}"
                      "{%- for k, v in tc.function.arguments|items %}"
                      "{{- '<parameter=' ~ k ~ '>\\n' ~ (v | tojson if v is mapping else v | string) ~ '\\n</parameter>\\n' -}}"
                      "{%- endfor %}{{- '</function>\\n</tool_call>\\n' -}}{%- endfor %}"
                      "{%- else %}{{ m.content }}{%- endif %}{%- endfor %}";
    const char *msgs = "[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":["
                       "{\"id\":\"a\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
                       "\"arguments\":\"{\\\"city\\\": \\\"Paris\\\", \\\"days\\\": 3, \\\"detailed\\\": true}\"}},"
                       "{\"id\":\"b\",\"type\":\"function\",\"function\":{\"name\":\"now\",\"arguments\":\"\"}}]}]";
    char *a = render_with(tpl, msgs);
    cr_expect_str_eq(a, "Hi<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                        "<parameter=days>\n3\n</parameter>\n<parameter=detailed>\nTrue\n</parameter>\n</function>\n"
                        "</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>\n");
    free(a);
    char *b = render_with("{%- for m in messages %}{%- if m.tool_calls %}<tool_call>{{ m.tool_calls[0].function.arguments }}"
                          "{%- else %}{{ m.content }}{%- endif %}{%- endfor %}",
                          msgs);
    cr_expect_str_eq(b, "Hi<tool_call>{\"city\": \"Paris\", \"days\": 3, \"detailed\": true}");
    free(b);
}

Test(session, a_developer_message_is_a_system_message_unless_the_template_knows_the_role)
{
    const char *dev = "[{\"role\":\"developer\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\"}]";
    const char *sys = "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\"}]";
    /* the model's template (DeepSeek-V3's) has no developer role: the message is its system prompt */
    char *a = render_with(NULL, dev), *b = render_with(NULL, sys);
    cr_expect(strstr(a, "Be brief.") != NULL, "the developer message is in the prompt: %s", a);
    cr_expect_str_eq(a, b);
    free(a);
    free(b);
    /* a template that has no developer role either */
    const char *plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}";
    a = render_with(plain, dev);
    cr_expect_str_eq(a, "<system>Be brief.<user>Hi");
    free(a);
    /* a template that names the role sees it as it came */
    const char *knows = "{% for m in messages %}{% if m.role == 'developer' %}!{% endif %}<{{ m.role }}>{{ m.content }}"
                        "{% endfor %}";
    a = render_with(knows, dev);
    cr_expect_str_eq(a, "!<developer>Be brief.<user>Hi");
    free(a);
}
