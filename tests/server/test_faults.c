/* Allocation-failure loops (SQLite's OOM method) over what `krait serve` does, with the allocator's
 * hook (kr_alloc_fail_at) failing the N-th allocation from a point on, once or from then on
 * ("sticky"), for N = 1, 2, ... until the operation completes without reaching the failure:
 *   - loading the chat template of the embedded model's tokenizer;
 *   - preparing requests as the server does on a worker (the OpenAI parse, the chat template,
 *     tokenization, the /tokenize and /detokenize answers), compared with the preparation without
 *     failures;
 *   - whole requests through the real HTTP server, run in this process (kr_serve_run on a thread,
 *     stopped with SIGTERM), driven with libcurl, whose own memory is not ours;
 *   - the shutdown: SIGTERM with streams in flight while every allocation from the N-th on fails.
 * At each N: a clean answer (what the request answers without failures, or a 5xx OpenAI error
 * object; a stream ends with [DONE] after its whole text or an error event), never a crash or a
 * hang; every byte back (kr_alloc_bytes_in_use at its baseline; the build also runs under
 * LeakSanitizer); and the server still answers afterwards. jansson and libuv allocate through the
 * hook here as in `krait serve` (server/main.c). */
#define _GNU_SOURCE

#include "alloc.h"
#include "chat.h"
#include "clock.h"
#include "log.h"
#include "metrics.h"
#include "server.h"
#include "session.h"
#include "tokenizer.h"

#include <criterion/criterion.h>
#include <curl/curl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#define MODEL KR_SOURCE_DIR "/models/tiny-hybrid"

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- the process as `krait serve` sets it up, and a log that keeps its last lines ------------- */

static pthread_mutex_t g_logmu = PTHREAD_MUTEX_INITIALIZER;
static char g_last_log[4][512]; /* the last lines at warn and above, for failure messages */
static int g_n_log;

static void log_keep(enum kr_log_level level, const char *line, void *user)
{
    (void)level;
    (void)user;
    pthread_mutex_lock(&g_logmu);
    if (getenv("KR_FAULTS_VERBOSE")) {
        fprintf(stderr, "LOG %s\n", line);
    }
    snprintf(g_last_log[g_n_log++ % 4], sizeof g_last_log[0], "%s", line);
    pthread_mutex_unlock(&g_logmu);
}

/* The last lines logged, oldest first, into buf. */
static const char *last_log(char *buf, size_t n)
{
    pthread_mutex_lock(&g_logmu);
    size_t at = 0;
    buf[0] = 0;
    for (int i = g_n_log > 4 ? g_n_log - 4 : 0; i < g_n_log && at < n; i++) {
        at += (size_t)snprintf(buf + at, n - at, "\n  log: %s", g_last_log[i % 4]);
    }
    pthread_mutex_unlock(&g_logmu);
    return buf;
}

static void setup(void)
{
    uv_replace_allocator(kr_malloc, kr_realloc, kr_calloc, kr_free); /* before any libuv call */
    json_set_alloc_funcs(kr_malloc, kr_free);
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    kr_log_set_callback(log_keep, NULL);
    curl_global_init(CURL_GLOBAL_DEFAULT);
}

static void teardown(void)
{
    kr_alloc_fail_at(0, 0);
    curl_global_cleanup();
}

TestSuite(faults, .init = setup, .fini = teardown, .timeout = 900); /* the shutdown walks start a server per point */

/* ---- the server, in this process --------------------------------------------------------------- */

struct live {
    struct kr_serve_opts o;
    pthread_t th;
    char port_file[64];
    int port;
    int code;     /* kr_serve_run's exit code */
    bool running;
};

static void *serve_main(void *arg)
{
    struct live *l = arg;
    l->code = kr_serve_run(&l->o);
    return NULL;
}

struct resp {
    atomic_int got_bytes;  /* some of the body came (set from libcurl's callback) */
    long status;        /* 0: no HTTP answer */
    CURLcode cc;
    char *body;         /* malloc'd (libcurl's side), NUL-terminated */
    size_t len;
    char ctype[64];
};

static size_t on_body(char *p, size_t size, size_t nmemb, void *ud)
{
    struct resp *r = ud;
    const size_t n = size * nmemb;
    char *np = realloc(r->body, r->len + n + 1);
    if (!np) {
        return 0;
    }
    r->body = np;
    memcpy(r->body + r->len, p, n);
    r->len += n;
    r->body[r->len] = 0;
    atomic_store(&r->got_bytes, 1);
    return n;
}

static size_t on_header(char *p, size_t size, size_t nmemb, void *ud)
{
    struct resp *r = ud;
    const size_t n = size * nmemb;
    if (n > 14 && !strncasecmp(p, "Content-Type: ", 14)) {
        snprintf(r->ctype, sizeof r->ctype, "%.*s", (int)strcspn(p + 14, "\r\n"), p + 14);
    }
    return n;
}

/* One request on a new connection (POST when body is set); a server that does not answer within
 * the timeout counts as a hang. */
static void fetch(int port, const char *path, const char *body, long timeout_s, struct resp *r)
{
    memset(r, 0, sizeof *r);
    CURL *c = curl_easy_init();
    cr_assert(c);
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
    curl_easy_setopt(c, CURLOPT_URL, url);
    struct curl_slist *hl = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hl);
    if (body) {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    }
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, timeout_s);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_FORBID_REUSE, 1L);
    r->cc = curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
    curl_slist_free_all(hl);
    curl_easy_cleanup(c);
    if (!r->body) {
        r->body = calloc(1, 1);
    }
}

static void resp_free(struct resp *r)
{
    free(r->body);
    r->body = NULL;
}

/* Starts kr_serve_run on models/tiny-hybrid (CPU, one thread, a small cache) and waits until
 * /health answers 200. */
static void live_start(struct live *l, double drain_s, bool prefix_caching)
{
    memset(l, 0, sizeof *l);
    snprintf(l->port_file, sizeof l->port_file, "/tmp/krait-faults-%d.port", (int)getpid());
    unlink(l->port_file);
    kr_serve_opts_default(&l->o);
    l->o.model_dir = MODEL;
    l->o.host = "127.0.0.1";
    l->o.port = 0;
    l->o.port_file = l->port_file;
    l->o.device = "cpu";
    l->o.threads = 1;
    l->o.max_num_seqs = 8;
    l->o.cache_bytes = (size_t)32 << 20;
    l->o.drain_timeout_s = drain_s;
    l->o.prefix_caching = prefix_caching;
    cr_assert_eq(pthread_create(&l->th, NULL, serve_main, l), 0);
    l->running = true;
    for (int i = 0; i < 1200 && !l->port; i++) {
        FILE *fp = fopen(l->port_file, "r");
        if (fp) {
            if (fscanf(fp, "%d", &l->port) != 1) {
                l->port = 0;
            }
            fclose(fp);
        }
        if (!l->port) {
            sleep_ms(50);
        }
    }
    cr_assert_gt(l->port, 0, "the server never wrote its port");
    for (int i = 0; i < 1200; i++) {
        struct resp r;
        fetch(l->port, "/health", NULL, 10, &r);
        const long st = r.status;
        resp_free(&r);
        if (st == 200) {
            return;
        }
        sleep_ms(50);
    }
    cr_assert_fail("the server never became healthy");
}

/* SIGTERM (the server drains and returns); its exit code. */
static int live_stop(struct live *l)
{
    raise(SIGTERM);
    pthread_join(l->th, NULL);
    l->running = false;
    unlink(l->port_file);
    return l->code;
}

/* Waits until the allocations in use are back at `base` (the server releases a request's memory on
 * its own threads once the answer is out); true when they are. */
static bool settle(size_t base, int max_ms)
{
    for (int i = 0; i < max_ms && kr_alloc_bytes_in_use() != base; i++) {
        sleep_ms(1);
    }
    return kr_alloc_bytes_in_use() == base;
}

/* ---- what an answer must be ---------------------------------------------------------------------- */

enum what { W_COMPLETION, W_CHAT, W_TOKENIZE, W_RESPONSES };

struct kind {
    const char *name;
    const char *path;
    const char *body;
    enum what what;
    bool stream;
};

/* Greedy, so that an answer is the same every time; logprobs and echo for more of the session's
 * paths in the plain completion; the usage chunk in the chat stream. */
static const struct kind k_completion = {
    "completion", "/v1/completions",
    "{\"prompt\":\"Hello there, general\",\"max_tokens\":2,\"temperature\":0,\"logprobs\":1,\"echo\":true}",
    W_COMPLETION, false};
static const struct kind k_completion_stream = {
    "completion stream", "/v1/completions",
    "{\"prompt\":\"Hello there, general\",\"max_tokens\":2,\"temperature\":0,\"stream\":true}", W_COMPLETION, true};
static const struct kind k_chat = {
    "chat", "/v1/chat/completions",
    "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi there\"}],"
    "\"max_tokens\":2,\"temperature\":0}",
    W_CHAT, false};
static const struct kind k_chat_stream = {
    "chat stream", "/v1/chat/completions",
    "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi there\"}],\"max_tokens\":2,\"temperature\":0,"
    "\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
    W_CHAT, true};
static const struct kind k_tokenize = {
    "tokenize", "/tokenize",
    "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi there\"}],\"return_token_strs\":true}", W_TOKENIZE, false};

static const struct kind k_responses = {
    "responses", "/v1/responses",
    "{\"instructions\":\"Be brief.\",\"input\":[{\"role\":\"user\",\"content\":\"Hi there\"}],"
    "\"max_output_tokens\":2,\"temperature\":0,\"top_logprobs\":1}",
    W_RESPONSES, false};
static const struct kind k_responses_stream = {
    "responses stream", "/v1/responses",
    "{\"input\":\"Hi there\",\"max_output_tokens\":2,\"temperature\":0,\"stream\":true}", W_RESPONSES, true};

enum verdict { V_WHOLE, V_ERROR, V_BAD };

/* A 5xx OpenAI error object. */
static bool is_error_object(const json_t *j)
{
    const json_t *e = json_object_get(j, "error");
    return json_is_object(e) && json_is_string(json_object_get(e, "message"));
}

/* One choice's entry of a summary: {"text", "finish"} (and the logprobs' tokens when given). */
static json_t *choice_entry(json_t *sum, size_t index)
{
    json_t *cs = json_object_get(sum, "choices");
    while (json_array_size(cs) <= index) {
        json_t *c = json_object();
        json_object_set_new(c, "text", json_string(""));
        json_object_set_new(c, "finish", json_null());
        json_array_append_new(cs, c);
    }
    return json_array_get(cs, index);
}

static void append_text(json_t *c, const char *piece)
{
    if (!piece) {
        return;
    }
    const char *had = json_string_value(json_object_get(c, "text"));
    char *t = kr_malloc(strlen(had) + strlen(piece) + 1);
    cr_assert(t);
    strcpy(t, had);
    strcat(t, piece);
    json_object_set_new(c, "text", json_string(t));
    kr_free(t);
}

/* What a 200 answer of kind k says, reduced to what must not change when allocations fail: each
 * choice's text and finish reason (and its logprobs' tokens), the usage; the tokens of /tokenize.
 * NULL with why when the body is not what such an answer looks like. */
static json_t *summarize_plain(const struct kind *k, const char *body, char *why, size_t wn)
{
    json_error_t je;
    json_t *j = json_loads(body, 0, &je);
    if (!json_is_object(j)) {
        snprintf(why, wn, "a 200 whose body is not a JSON object: %.300s", body);
        json_decref(j);
        return NULL;
    }
    json_t *sum = json_object();
    if (k->what == W_TOKENIZE) {
        json_object_set(sum, "tokens", json_object_get(j, "tokens"));
        json_object_set(sum, "count", json_object_get(j, "count"));
        json_object_set(sum, "token_strs", json_object_get(j, "token_strs"));
        json_decref(j);
        if (json_object_size(sum) != 3) {
            snprintf(why, wn, "a /tokenize answer without tokens, count or token_strs: %.300s", body);
            json_decref(sum);
            return NULL;
        }
        return sum;
    }
    if (k->what == W_RESPONSES) {
        const json_t *part = json_array_get(json_object_get(json_array_get(json_object_get(j, "output"), 0), "content"), 0);
        json_object_set(sum, "text", json_object_get(part, "text"));
        json_object_set(sum, "status", json_object_get(j, "status"));
        json_object_set(sum, "usage", json_object_get(j, "usage"));
        json_decref(j);
        if (json_object_size(sum) != 3) {
            snprintf(why, wn, "a response without output text, status or usage: %.300s", body);
            json_decref(sum);
            return NULL;
        }
        return sum;
    }
    json_object_set_new(sum, "choices", json_array());
    const json_t *cs = json_object_get(j, "choices");
    size_t i;
    const json_t *c;
    json_array_foreach(cs, i, c)
    {
        json_t *e = choice_entry(sum, i);
        const json_t *text = k->what == W_CHAT ? json_object_get(json_object_get(c, "message"), "content")
                                               : json_object_get(c, "text");
        json_object_set(e, "text", (json_t *)text);
        json_object_set(e, "finish", json_object_get(c, "finish_reason"));
        const json_t *lp = json_object_get(c, "logprobs");
        if (json_is_object(lp)) {
            json_object_set(e, "logprob_tokens", json_object_get(lp, "tokens"));
        }
    }
    json_object_set(sum, "usage", json_object_get(j, "usage"));
    json_decref(j);
    return sum;
}

/* The same for a stream: the deltas of each choice concatenated, its finish reason, the usage
 * chunk's usage. *error when an error event came. NULL with why when the stream is malformed or
 * does not end with [DONE]. */
static json_t *summarize_stream(const struct kind *k, const char *body, bool *error, char *why, size_t wn)
{
    *error = false;
    json_t *sum = json_object();
    json_object_set_new(sum, "choices", json_array());
    bool done = false;
    const char *s = body;
    while (*s) {
        if (done) {
            snprintf(why, wn, "events after [DONE]: %.200s", s);
            goto bad;
        }
        if (strncmp(s, "data: ", 6) != 0) {
            snprintf(why, wn, "not an SSE data event: %.200s", s);
            goto bad;
        }
        s += 6;
        const char *e = strstr(s, "\n\n");
        if (!e) {
            snprintf(why, wn, "the stream ends in the middle of an event: %.200s", s);
            goto bad;
        }
        if (e - s == 6 && !strncmp(s, "[DONE]", 6)) {
            done = true;
            s = e + 2;
            continue;
        }
        json_error_t je;
        json_t *j = json_loadb(s, (size_t)(e - s), 0, &je);
        if (!json_is_object(j)) {
            snprintf(why, wn, "an event is not a JSON object: %.*s", (int)(e - s > 200 ? 200 : e - s), s);
            json_decref(j);
            goto bad;
        }
        if (json_object_get(j, "error")) {
            *error = true;
            if (!is_error_object(j)) {
                snprintf(why, wn, "a malformed error event: %.200s", s);
                json_decref(j);
                goto bad;
            }
        }
        size_t i;
        const json_t *c;
        json_array_foreach(json_object_get(j, "choices"), i, c)
        {
            const json_t *ix = json_object_get(c, "index");
            json_t *ent = choice_entry(sum, (size_t)json_integer_value(ix));
            append_text(ent, json_string_value(k->what == W_CHAT ? json_object_get(json_object_get(c, "delta"), "content")
                                                                 : json_object_get(c, "text")));
            const json_t *fin = json_object_get(c, "finish_reason");
            if (json_is_string(fin)) {
                if (!json_is_null(json_object_get(ent, "finish"))) {
                    snprintf(why, wn, "choice %zu finished twice", (size_t)json_integer_value(ix));
                    json_decref(j);
                    goto bad;
                }
                json_object_set(ent, "finish", (json_t *)fin);
            }
        }
        const json_t *u = json_object_get(j, "usage");
        if (json_is_object(u)) {
            json_object_set(sum, "usage", (json_t *)u);
        }
        json_decref(j);
        s = e + 2;
    }
    if (!done) {
        snprintf(why, wn, "the stream ended without [DONE]");
        goto bad;
    }
    return sum;
bad:
    json_decref(sum);
    return NULL;
}

/* The same for a Responses stream ("event: name" and "data: {...}" per event, no [DONE]): the text
 * deltas concatenated, the final event's type, status and usage. *error when an error event came
 * (an out-of-memory end is the chat stream's: an error event and [DONE]). */
static json_t *summarize_responses_stream(const char *body, bool *error, char *why, size_t wn)
{
    *error = strstr(body, "\nevent: error\n") != NULL || !strncmp(body, "event: error\n", 13) ||
             strstr(body, "data: {\"error\"") != NULL;
    if (*error) {
        return json_object();
    }
    json_t *sum = json_object();
    json_object_set_new(sum, "text", json_string(""));
    int64_t seq = 0;
    const char *s = body;
    bool ended = false;
    while (*s) {
        if (ended) {
            snprintf(why, wn, "events after the final one: %.200s", s);
            goto bad;
        }
        const char *nl = strchr(s, '\n');
        if (strncmp(s, "event: ", 7) != 0 || !nl || strncmp(nl + 1, "data: ", 6) != 0) {
            snprintf(why, wn, "not an SSE event with a name and data: %.200s", s);
            goto bad;
        }
        const char *d = nl + 7;
        const char *e = strstr(d, "\n\n");
        if (!e) {
            snprintf(why, wn, "the stream ends in the middle of an event: %.200s", s);
            goto bad;
        }
        json_error_t je;
        json_t *j = json_loadb(d, (size_t)(e - d), 0, &je);
        const char *type = json_string_value(json_object_get(j, "type"));
        if (!type || strncmp(type, s + 7, (size_t)(nl - s - 7)) != 0 ||
            json_integer_value(json_object_get(j, "sequence_number")) != seq++) {
            snprintf(why, wn, "an event whose type or sequence number is wrong: %.200s", s);
            json_decref(j);
            goto bad;
        }
        if (!strcmp(type, "response.output_text.delta")) {
            char buf[4096];
            snprintf(buf, sizeof buf, "%s%s", json_string_value(json_object_get(sum, "text")),
                     json_string_value(json_object_get(j, "delta")));
            json_object_set_new(sum, "text", json_string(buf));
        }
        if (!strcmp(type, "response.completed") || !strcmp(type, "response.incomplete")) {
            const json_t *resp = json_object_get(j, "response");
            json_object_set_new(sum, "final", json_string(type));
            json_object_set(sum, "status", json_object_get(resp, "status"));
            json_object_set(sum, "usage", json_object_get(resp, "usage"));
            ended = true;
        }
        json_decref(j);
        s = e + 2;
    }
    if (!ended) {
        snprintf(why, wn, "the stream ended without response.completed or response.incomplete");
        goto bad;
    }
    return sum;
bad:
    json_decref(sum);
    return NULL;
}

/* Judges one answer of kind k: the whole answer (its summary equal to want), a clean error (a 5xx
 * error object, or a stream that ends with an error event and [DONE]), or anything else (why says
 * what). With want NULL a whole answer's summary is returned in *got. */
static enum verdict judge(const struct kind *k, const struct resp *r, const json_t *want, json_t **got, char *why,
                          size_t wn)
{
    why[0] = 0;
    if (r->cc != CURLE_OK) {
        snprintf(why, wn, "no complete answer: %s (status %ld, %zu bytes: %.200s)", curl_easy_strerror(r->cc),
                 r->status, r->len, r->body);
        return V_BAD;
    }
    if (r->status >= 500) {
        json_error_t je;
        json_t *j = json_loads(r->body, 0, &je);
        const bool ok = is_error_object(j);
        json_decref(j);
        if (!ok) {
            snprintf(why, wn, "a %ld without an error object: %.300s", r->status, r->body);
            return V_BAD;
        }
        return V_ERROR;
    }
    if (r->status != 200) {
        snprintf(why, wn, "status %ld: %.300s", r->status, r->body);
        return V_BAD;
    }
    bool error = false;
    json_t *sum = k->stream && k->what == W_RESPONSES ? summarize_responses_stream(r->body, &error, why, wn)
                  : k->stream                         ? summarize_stream(k, r->body, &error, why, wn)
                                                      : summarize_plain(k, r->body, why, wn);
    if (!sum) {
        return V_BAD;
    }
    if (error) {
        json_decref(sum);
        return V_ERROR;
    }
    if (want && !json_equal(sum, (json_t *)want)) {
        char *a = json_dumps(sum, JSON_COMPACT), *b = json_dumps(want, JSON_COMPACT);
        snprintf(why, wn, "a 200 that differs from the answer without failures:\n  got  %.400s\n  want %.400s",
                 a ? a : "?", b ? b : "?");
        kr_oai_free(a);
        kr_oai_free(b);
        json_decref(sum);
        return V_BAD;
    }
    if (got) {
        *got = sum;
    } else {
        json_decref(sum);
    }
    return V_WHOLE;
}

/* ---- walking a request's allocations through the server -------------------------------------------- */

/* How far one walk went: the allocation points it tried, the last (the first the request did not
 * reach), and how the answers ended. */
struct walk_stats {
    uint64_t tried, last, whole, errors;
};

/* The points a walk through the server takes: every one up to `dense`, then every `stride`-th (a
 * request takes 0.05-0.2 s under the sanitizers and the longest about 400 points; a shutdown
 * starts a server, over a second); KRAIT_FAULTS_STRIDE=1 walks every point. */
static uint64_t next_point(uint64_t n, uint64_t dense, uint64_t stride)
{
    const char *e = getenv("KRAIT_FAULTS_STRIDE");
    if (e && atoi(e) > 0) {
        stride = (uint64_t)atoi(e);
    }
    return n < dense ? n + 1 : n + stride;
}

/* Walks the allocations of one request of kind k through a server running in this process (see
 * next_point), until the request completes without reaching the N-th allocation. At each N the
 * answer must be whole or a clean error, the server must give back every byte the request took
 * (with the prefix cache on, which keeps what a request computed up to where it failed or was
 * cancelled: every byte once the server has stopped), and stay healthy; every 8th N (and at the
 * end) the same request without failures must give the whole answer. */
static void walk(const struct kind *k, int sticky, bool prefix_caching, struct walk_stats *ws)
{
    memset(ws, 0, sizeof *ws);
    const size_t before_server = kr_alloc_bytes_in_use();
    struct live l;
    live_start(&l, 5, prefix_caching);
    char why[1200], logs[2200];
    json_t *want = NULL;
    struct resp r;
    for (int i = 0; i < 2; i++) { /* the second answer is the reference: anything lazy is set up by then */
        json_decref(want);
        want = NULL;
        fetch(l.port, k->path, k->body, 60, &r);
        cr_assert_eq(judge(k, &r, NULL, &want, why, sizeof why), V_WHOLE, "%s without failures: %s", k->name, why);
        resp_free(&r);
    }
    /* the reference answer (this test's, through jansson) is held from here on: part of the baseline */
    sleep_ms(50);
    const size_t base = kr_alloc_bytes_in_use();
    for (uint64_t n = 1;; n = next_point(n, 90, 5)) { /* dense: as many as the shortest request (/tokenize) has */
        cr_assert_lt(n, 200000, "%s: never completed", k->name);
        const uint64_t f0 = kr_alloc_failures();
        kr_alloc_fail_at(n, sticky);
        fetch(l.port, k->path, k->body, 60, &r);
        kr_alloc_fail_at(0, 0);
        const bool fired = kr_alloc_failures() != f0;
        const enum verdict v = judge(k, &r, want, NULL, why, sizeof why);
        cr_assert_neq(v, V_BAD, "%s, allocation %llu failing%s: %s%s", k->name, (unsigned long long)n,
                      sticky ? " and every later one" : "", why, last_log(logs, sizeof logs));
        cr_assert(fired || v == V_WHOLE, "%s, allocation %llu: an error although no allocation failed: %.300s", k->name,
                  (unsigned long long)n, r.body);
        resp_free(&r);
        /* with the prefix cache the server keeps what a request computed, which depends on where it
         * failed or was cancelled: checked once the server is stopped */
        const bool settled = settle(base, prefix_caching ? 20 : 5000) || prefix_caching;
        cr_assert(settled, "%s, allocation %llu failing%s: %lld bytes not given back%s", k->name, (unsigned long long)n,
                  sticky ? " and every later one" : "", (long long)(kr_alloc_bytes_in_use() - base),
                  last_log(logs, sizeof logs));
        ws->tried++;
        ws->whole += v == V_WHOLE;
        ws->errors += v == V_ERROR;
        if (!fired) {
            ws->last = n;
            break;
        }
        /* still serving */
        fetch(l.port, n % 8 ? "/health" : k->path, n % 8 ? NULL : k->body, 60, &r);
        if (n % 8) {
            cr_assert_eq(r.status, 200, "%s, allocation %llu: /health answers %ld afterwards: %s", k->name,
                         (unsigned long long)n, r.status, r.body);
        } else {
            cr_assert_eq(judge(k, &r, want, NULL, why, sizeof why), V_WHOLE,
                         "%s, allocation %llu: the next request without failures: %s", k->name, (unsigned long long)n,
                         why);
        }
        resp_free(&r);
        cr_assert(settle(base, prefix_caching ? 20 : 5000) || prefix_caching,
                  "%s, allocation %llu: the request after it kept %lld bytes", k->name, (unsigned long long)n,
                  (long long)(kr_alloc_bytes_in_use() - base));
    }
    json_decref(want);
    cr_assert_eq(live_stop(&l), 0);
    cr_assert_eq(kr_alloc_bytes_in_use(), before_server, "the server kept %lld bytes after it returned",
                 (long long)(kr_alloc_bytes_in_use() - before_server));
    fprintf(stderr, "%s%s, %s: completed at allocation %llu; %llu points tried (%llu whole answers, %llu errors)\n",
            k->name, prefix_caching ? " (prefix cache)" : "", sticky ? "sticky" : "once", (unsigned long long)ws->last,
            (unsigned long long)ws->tried, (unsigned long long)ws->whole, (unsigned long long)ws->errors);
}

/* ---- the chat template's load ---------------------------------------------------------------------- */

static struct kr_tokenizer *load_model_tokenizer(void)
{
    struct kr_tokenizer *tok = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_tokenizer_load(MODEL, NULL, &tok, &err), KR_OK, "%s", err.msg);
    return tok;
}

/* Renders the same conversation with c (a text the caller frees with kr_free). */
static char *render_reference(const struct kr_chat *c)
{
    json_error_t je;
    json_t *msgs = json_loads("[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\"},"
                              "{\"role\":\"assistant\",\"content\":\"Hello!\"},{\"role\":\"user\",\"content\":\"Why?\"}]",
                              0, &je);
    cr_assert(msgs);
    char *text = NULL;
    size_t len = 0;
    struct kr_oai_error e;
    cr_assert_eq(kr_chat_render(c, msgs, NULL, true, false, NULL, &text, &len, &e), KR_OK, "%s", e.message);
    json_decref(msgs);
    return text;
}

/* kr_chat_load of the model's template (from its tokenizer) and of Qwen3's (a --chat-template
 * file): every allocation failing in turn, once and from there on. A failure is KR_ERR_NOMEM
 * saying so and leaves nothing; the template that loads renders as the clean one does. */
Test(faults, loading_the_chat_template_survives_every_allocation_failure)
{
    struct kr_tokenizer *tok = load_model_tokenizer();
    /* Qwen3's template, into a file as --chat-template takes it */
    json_error_t je;
    json_t *cfg = json_load_file(KR_SOURCE_DIR "/tests/fixtures/tokenizer/qwen3/tokenizer_config.json", 0, &je);
    cr_assert(cfg, "%s", je.text);
    char file[64];
    snprintf(file, sizeof file, "/tmp/krait-faults-%d.jinja", (int)getpid());
    FILE *fp = fopen(file, "w");
    cr_assert(fp);
    fputs(json_string_value(json_object_get(cfg, "chat_template")), fp);
    fclose(fp);
    json_decref(cfg);
    const char *const files[2] = {NULL, file};
    for (int f = 0; f < 2; f++) {
        struct kr_chat *ref = NULL;
        struct kr_err err = {0};
        cr_assert_eq(kr_chat_load(tok, files[f], &ref, &err), KR_OK, "%s", err.msg);
        char *want = render_reference(ref);
        kr_chat_free(ref);
        const size_t base = kr_alloc_bytes_in_use();
        for (int sticky = 0; sticky < 2; sticky++) {
            uint64_t n = 1;
            for (;; n++) {
                cr_assert_lt(n, 100000);
                struct kr_chat *c = NULL;
                memset(&err, 0, sizeof err);
                const uint64_t f0 = kr_alloc_failures();
                kr_alloc_fail_at(n, sticky);
                const enum kr_status st = kr_chat_load(tok, files[f], &c, &err);
                kr_alloc_fail_at(0, 0);
                const bool fired = kr_alloc_failures() != f0;
                if (st == KR_OK) {
                    cr_assert(!fired, "%s: loaded although allocation %llu failed", files[f] ? files[f] : "the model's",
                              (unsigned long long)n);
                    char *got = render_reference(c);
                    cr_expect_str_eq(got, want);
                    kr_free(got);
                    kr_chat_free(c);
                    break;
                }
                cr_assert_eq(st, KR_ERR_NOMEM, "allocation %llu: status %d: %s", (unsigned long long)n, st, err.msg);
                cr_assert(strstr(err.msg, "out of memory"), "allocation %llu: \"%s\"", (unsigned long long)n, err.msg);
                cr_assert_null(c);
                cr_assert_eq(kr_alloc_bytes_in_use(), base, "allocation %llu: %lld bytes left", (unsigned long long)n,
                             (long long)(kr_alloc_bytes_in_use() - base));
            }
            fprintf(stderr, "chat template %s (%s): loaded at allocation %llu\n", files[f] ? "qwen3" : "of the model",
                    sticky ? "sticky" : "once", (unsigned long long)n);
        }
        kr_free(want);
    }
    unlink(file);
    kr_tokenizer_free(tok);
}

/* ---- request preparation -------------------------------------------------------------------------------- */

/* A scripted engine for sessions without a server: it keeps the prompts it is given and refuses
 * them (429), so that a session's preparation ends in an answer without generating. */
#define MAX_PROMPTS 4
static int32_t g_prompts[MAX_PROMPTS][512];
static int32_t g_n_prompt[MAX_PROMPTS];
static int g_n_submits;

static enum kr_status keep_and_refuse(void *ctx, const struct kr_request_params *p, uint64_t *req_id, struct kr_err *err)
{
    (void)ctx;
    (void)req_id;
    cr_assert_lt(g_n_submits, MAX_PROMPTS);
    cr_assert_leq(p->n_prompt, 512);
    memcpy(g_prompts[g_n_submits], p->prompt, (size_t)p->n_prompt * sizeof(int32_t));
    g_n_prompt[g_n_submits++] = p->n_prompt;
    snprintf(err->msg, sizeof err->msg, "refused by the test");
    return KR_ERR_BUSY;
}

static void no_cancel(void *ctx, uint64_t id)
{
    (void)ctx;
    (void)id;
    cr_assert_fail("a refused request was cancelled");
}

static void no_cancel_choice(void *ctx, uint64_t id, int32_t index)
{
    (void)ctx;
    (void)id;
    (void)index;
    cr_assert_fail("a refused request's choice was cancelled");
}

static bool never_failed(void *ctx)
{
    (void)ctx;
    return false;
}

static const struct kr_sess_engine_i refusing_engine = {
    .submit = keep_and_refuse, .cancel = no_cancel, .cancel_choice = no_cancel_choice, .failed = never_failed};

struct answer {
    int n_done;
    int status;
    char body[4096];
};

static void rec_begin(void *user)
{
    (void)user;
    cr_assert_fail("a refused request began a stream");
}

static bool rec_event(void *user, const char *json, size_t len)
{
    (void)user;
    (void)json;
    (void)len;
    cr_assert_fail("a refused request sent an event");
    return false;
}

static void rec_done(void *user, int status, const char *body, size_t len)
{
    struct answer *a = user;
    a->n_done++;
    a->status = status;
    snprintf(a->body, sizeof a->body, "%.*s", (int)len, body ? body : "");
}

static const struct kr_sess_sink recording_sink = {.stream_begin = rec_begin, .stream_event = rec_event, .done = rec_done};

static void no_post(void *user, struct kr_sess_event *ev)
{
    (void)user;
    (void)ev;
    cr_assert_fail("an event from a refused request");
}

/* What one preparation gave: the answer and the prompts handed to the engine. */
struct prepared {
    struct answer a;
    int n_submits;
    int32_t n_prompt[MAX_PROMPTS];
    int32_t prompts[MAX_PROMPTS][512];
};

static void prepare_once(struct kr_sess_env *env, enum kr_sess_kind kind, const char *body, struct prepared *out)
{
    memset(out, 0, sizeof *out);
    g_n_submits = 0;
    struct kr_sess *s = kr_sess_create(env, kind, kr_clock_s());
    if (!s) { /* the transport answers 500 itself */
        out->a.n_done = 1;
        out->a.status = 500;
        return;
    }
    kr_sess_prepare(s, body, strlen(body));
    kr_sess_start(s, &recording_sink, &out->a);
    kr_sess_release(s);
    out->n_submits = g_n_submits;
    memcpy(out->n_prompt, g_n_prompt, sizeof out->n_prompt);
    memcpy(out->prompts, g_prompts, sizeof out->prompts);
}

/* The preparation the server runs on a worker (the OpenAI parse, the chat template with the last
 * user turn's boundary, tokenization, echo's text, the limits; the whole /tokenize and /detokenize
 * answers), then the start (choices, detokenizers, the preallocated event nodes), each allocation
 * failing in turn, once and from there on. Each answer is a 500 error object, or what the request
 * gives without failures: the same prompts handed to the engine (which refuses them: 429), the same
 * /tokenize body; and everything is freed. */
Test(faults, preparing_requests_survives_every_allocation_failure)
{
    static const struct {
        enum kr_sess_kind kind;
        const char *body;
    } reqs[] = {
        {KR_SESS_COMPLETIONS, "{\"prompt\":\"Hello there, general Kenobi\",\"max_tokens\":4,\"echo\":true,\"logprobs\":2,"
                              "\"stop\":[\"x\",\"yz\"]}"},
        {KR_SESS_COMPLETIONS, "{\"prompt\":[[0,5,9,1000],[7,8]],\"echo\":true,\"n\":2,\"max_tokens\":2}"},
        {KR_SESS_CHAT, "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":"
                       "\"Hi\"},{\"role\":\"assistant\",\"content\":\"Hello!\"},{\"role\":\"user\",\"content\":[{\"type\":"
                       "\"text\",\"text\":\"Why\"},{\"type\":\"text\",\"text\":\"not?\"}]}],\"max_tokens\":4,"
                       "\"stop\":\"\\n\",\"logprobs\":true,\"top_logprobs\":2}"},
        {KR_SESS_CHAT, "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Weather?\"},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"get\",\"arguments\":\"{}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"sunny\"}],\"max_completion_tokens\":4}"},
        {KR_SESS_RESPONSES, "{\"instructions\":\"Be brief.\",\"input\":[{\"role\":\"user\",\"content\":[{\"type\":"
                            "\"input_text\",\"text\":\"Weather?\"}]},{\"type\":\"function_call\",\"call_id\":\"c1\","
                            "\"name\":\"get\",\"arguments\":\"{}\"},{\"type\":\"function_call_output\",\"call_id\":"
                            "\"c1\",\"output\":\"sunny\"}],\"max_output_tokens\":4,\"top_logprobs\":1,\"metadata\":"
                            "{\"k\":\"v\"},\"text\":{\"format\":{\"type\":\"text\"}}}"},
        {KR_SESS_TOKENIZE, "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi there\"}],\"return_token_strs\":true}"},
        {KR_SESS_TOKENIZE, "{\"prompt\":\"Hello there, general Kenobi\",\"add_special_tokens\":false}"},
        {KR_SESS_DETOKENIZE, "{\"tokens\":[0,5,9,1000,23166]}"},
    };
    struct kr_tokenizer *tok = load_model_tokenizer();
    struct kr_chat *chat = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_chat_load(tok, NULL, &chat, &err), KR_OK, "%s", err.msg);
    struct kr_metrics met;
    kr_metrics_init(&met);
    struct kr_sess_env env = {.engine = &refusing_engine, .tok = tok, .chat = chat, .vocab = kr_tokenizer_n_vocab(tok),
                              .max_model_len = 4096, .snapshot_hints = true,
                              .max_bytes_per_token = kr_tokenizer_max_bytes_per_token(tok), .model_name = "tiny",
                              .met = &met, .post = no_post};
    static struct prepared want, got;
    for (size_t i = 0; i < sizeof reqs / sizeof reqs[0]; i++) {
        prepare_once(&env, reqs[i].kind, reqs[i].body, &want);
        const bool generation =
            reqs[i].kind == KR_SESS_COMPLETIONS || reqs[i].kind == KR_SESS_CHAT || reqs[i].kind == KR_SESS_RESPONSES;
        cr_assert_eq(want.a.status, generation ? 429 : 200, "request %zu: %d %s", i, want.a.status, want.a.body);
        const size_t base = kr_alloc_bytes_in_use();
        for (int sticky = 0; sticky < 2; sticky++) {
            uint64_t n = 1;
            for (;; n++) {
                cr_assert_lt(n, 100000);
                const uint64_t f0 = kr_alloc_failures();
                kr_alloc_fail_at(n, sticky);
                prepare_once(&env, reqs[i].kind, reqs[i].body, &got);
                kr_alloc_fail_at(0, 0);
                const bool fired = kr_alloc_failures() != f0;
                cr_assert_eq(got.a.n_done, 1, "request %zu, allocation %llu: %d answers", i, (unsigned long long)n,
                             got.a.n_done);
                cr_assert_eq(kr_alloc_bytes_in_use(), base, "request %zu, allocation %llu: %lld bytes left", i,
                             (unsigned long long)n, (long long)(kr_alloc_bytes_in_use() - base));
                if (got.a.status == 500) {
                    cr_assert(fired);
                    json_error_t je;
                    json_t *j = got.a.body[0] ? json_loads(got.a.body, 0, &je) : NULL;
                    cr_assert(!got.a.body[0] || is_error_object(j), "request %zu, allocation %llu: %s", i,
                              (unsigned long long)n, got.a.body);
                    json_decref(j);
                    continue;
                }
                cr_assert_eq(got.a.status, want.a.status, "request %zu, allocation %llu failing%s: %d %s", i,
                             (unsigned long long)n, sticky ? " and every later one" : "", got.a.status, got.a.body);
                cr_assert_str_eq(got.a.body, want.a.body, "request %zu, allocation %llu", i, (unsigned long long)n);
                cr_assert_eq(got.n_submits, want.n_submits, "request %zu, allocation %llu", i, (unsigned long long)n);
                for (int k = 0; k < got.n_submits; k++) {
                    cr_assert(got.n_prompt[k] == want.n_prompt[k] &&
                                  !memcmp(got.prompts[k], want.prompts[k], (size_t)got.n_prompt[k] * sizeof(int32_t)),
                              "request %zu, allocation %llu: prompt %d differs", i, (unsigned long long)n, k);
                }
                if (!fired) {
                    break;
                }
            }
            fprintf(stderr, "preparing request %zu (%s): completed at allocation %llu\n", i, sticky ? "sticky" : "once",
                    (unsigned long long)n);
        }
    }
    kr_chat_free(chat);
    kr_tokenizer_free(tok);
}

/* ---- whole requests through the server --------------------------------------------------------------- */

static void walk_both(const struct kind *k)
{
    struct walk_stats once, sticky;
    walk(k, 0, false, &once);
    walk(k, 1, false, &sticky);
    cr_expect_gt(once.errors, 0);
}

Test(faults, a_completion_survives_every_allocation_failure)
{
    walk_both(&k_completion);
}

Test(faults, a_streamed_completion_survives_every_allocation_failure)
{
    walk_both(&k_completion_stream);
}

Test(faults, a_chat_completion_survives_every_allocation_failure)
{
    walk_both(&k_chat);
}

Test(faults, a_streamed_chat_completion_survives_every_allocation_failure)
{
    walk_both(&k_chat_stream);
}

Test(faults, a_response_survives_every_allocation_failure)
{
    walk_both(&k_responses);
}

Test(faults, a_streamed_response_survives_every_allocation_failure)
{
    walk_both(&k_responses_stream);
}

Test(faults, tokenize_survives_every_allocation_failure)
{
    walk_both(&k_tokenize);
}

/* The same chat with the prefix cache on (the default): the second request finds its prompt's
 * blocks and state snapshot cached, a path with allocations of its own (each failing once). */
Test(faults, a_chat_completion_with_the_prefix_cache_survives_every_allocation_failure)
{
    struct walk_stats ws;
    walk(&k_chat, 0, true, &ws);
}

/* ---- the shutdown ------------------------------------------------------------------------------------- */

struct client {
    int port;
    const char *body;
    struct resp r;
    pthread_t th;
};

static void *client_main(void *arg)
{
    struct client *c = arg;
    fetch(c->port, "/v1/completions", c->body, 60, &c->r);
    return NULL;
}

/* SIGTERM with two streams in flight, every allocation from the N-th after the signal failing, for
 * N = 1, 2, ... (next_point: every one up to 10, then every 8th) until a shutdown completes without
 * reaching it.
 * The server must return its exit code (0), give back every byte it took, and end both streams (no
 * client waits for more). Returns the point at which the shutdown completed. */
static uint64_t walk_shutdown(double drain_s, const char *body)
{
    uint64_t n = 1;
    for (;; n = next_point(n, 10, 8)) {
        cr_assert_lt(n, 100000);
        const size_t before = kr_alloc_bytes_in_use();
        struct live l;
        live_start(&l, drain_s, false);
        struct client c[2];
        for (int i = 0; i < 2; i++) {
            memset(&c[i], 0, sizeof c[i]);
            c[i].port = l.port;
            c[i].body = body;
            cr_assert_eq(pthread_create(&c[i].th, NULL, client_main, &c[i]), 0);
        }
        for (int i = 0; i < 2; i++) {
            for (int w = 0; w < 30000 && !atomic_load(&c[i].r.got_bytes); w++) {
                sleep_ms(1);
            }
            cr_assert(atomic_load(&c[i].r.got_bytes), "stream %d never began", i);
        }
        const uint64_t f0 = kr_alloc_failures();
        kr_alloc_fail_at(n, 1);
        const int code = live_stop(&l);
        kr_alloc_fail_at(0, 0);
        const bool fired = kr_alloc_failures() != f0;
        char logs[2200];
        cr_assert_eq(code, 0, "allocation %llu and every later one failing: exit code %d%s", (unsigned long long)n,
                     code, last_log(logs, sizeof logs));
        for (int i = 0; i < 2; i++) {
            pthread_join(c[i].th, NULL);
            cr_assert_neq(c[i].r.cc, CURLE_OPERATION_TIMEDOUT, "allocation %llu: stream %d was left waiting",
                          (unsigned long long)n, i);
            resp_free(&c[i].r);
        }
        cr_assert_eq(kr_alloc_bytes_in_use(), before, "allocation %llu and every later one failing: %lld bytes kept%s",
                     (unsigned long long)n, (long long)(kr_alloc_bytes_in_use() - before), last_log(logs, sizeof logs));
        if (!fired) {
            break;
        }
    }
    return n;
}

/* --shutdown-timeout 0: the streams are cut at once (an error event and [DONE]), their engine work
 * cancelled, the engine stopped. */
Test(faults, a_shutdown_that_cuts_streams_survives_allocation_failures)
{
    const uint64_t n =
        walk_shutdown(0, "{\"prompt\":\"Hello there\",\"max_tokens\":400,\"temperature\":0,\"stream\":true}");
    fprintf(stderr, "shutdown cutting streams: completed at allocation %llu\n", (unsigned long long)n);
}

/* --shutdown-timeout 5: the streams (2 tokens) end on their own during the drain, then the server
 * stops. */
Test(faults, a_shutdown_that_drains_streams_survives_allocation_failures)
{
    const uint64_t n =
        walk_shutdown(5, "{\"prompt\":\"Hello there\",\"max_tokens\":2,\"temperature\":0,\"stream\":true}");
    fprintf(stderr, "shutdown draining streams: completed at allocation %llu\n", (unsigned long long)n);
}
