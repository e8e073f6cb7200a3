/* The HTTP server: libmicrohttpd driven from a libuv loop, routing and auth, health and metrics,
 * SSE framing, the hang-up watch, signals and drain, and the queue that carries engine events
 * (engine thread) to the OpenAI sessions (session.h) on the loop thread. */
#include "server.h"

#include "alloc.h"
#include "array.h"
#include "boot.h"
#include "clock.h"
#include "conns.h"
#include "door.h"
#include "lane.h"
#include "engine.h"
#include "http-util.h"
#include "log.h"
#include "metrics.h"
#include "model.h"
#include "openai.h"
#include "session.h"

#include <arpa/inet.h>
#include <errno.h>
#include <malloc.h>
#include <fcntl.h>
#include <stdarg.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>
#include <sys/prctl.h>

void kr_serve_opts_default(struct kr_serve_opts *o)
{
    memset(o, 0, sizeof *o);
    o->host = "0.0.0.0";
    o->port = 8000;
    o->max_num_seqs = 256;
    o->tensor_parallel_size = 1;
    o->nnodes = 1;
    o->master_addr = "127.0.0.1";
    o->master_port = 29500;
    o->join_timeout_s = 600.0;
    o->max_num_batched_tokens = 2048;
    o->cache_bytes = 0;
    o->device = "auto";
    o->gpu_mem_util = 0.9;
    o->block_size = 16;
    o->prefix_caching = true;
    o->prefix_state_interval = 2048;
    o->prefix_snapshots = -1;
    o->max_body_bytes = (size_t)32 << 20;
    o->max_request_memory = (size_t)256 << 20;
    o->max_connections = 4096;
    o->max_connections_per_ip = 0;
    o->header_timeout_s = 30.0;
    o->body_timeout_s = 60.0;
    o->drain_timeout_s = 30.0;
}

/* ---- structures ---------------------------------------------------------------------------- */

struct srv;

/* One HTTP request. Generation, /tokenize and /detokenize hand their body to an OpenAI session
 * (session.h), which answers through the sink below. */
struct hreq {
    struct srv *s;
    struct MHD_Connection *conn;
    struct hreq *prev, *next;  /* in srv->reqs */
    int refs;                  /* MHD connection + the preparation on a worker */
    enum kr_http_route route;
    char *body;
    size_t blen, bcap;
    bool too_big;
    bool body_busy;            /* the shared body budget was spent: dropped, answered 503 */
    bool body_in;              /* the whole body arrived (the connection's body deadline is off) */
    size_t pooled;             /* bytes of the body buffer drawn from srv->body_pool */
    size_t clen;               /* Content-Length (0: none or chunked) */
    struct kr_lane_work lw;    /* a large body's preparation (lane.h) */
    bool body_oom;             /* the body could not be kept (out of memory): dropped, answered 500 */
    bool responded;            /* a response was queued (or the stream started) */
    /* the session */
    struct kr_sess *sess;
    enum { PREP_NONE = 0, PREP_RUNNING, PREP_DONE, PREP_STARTED } prep_state;
    bool prep_failed;
    uv_work_t work;
    char id[48];
    const char *allow;         /* a 405's Allow header */
    bool stream;               /* the answer is an event stream (the session's stream_begin) */
    bool answered;             /* the session's done came: nothing more will */
    bool ans_ready;            /* not a stream: the answer below waits for the next access call */
    unsigned ans_status;
    char *ans_body;            /* NULL: out of memory (500) */
    size_t ans_len;
    bool suspended;            /* not a stream: waiting for the answer; stream: the reader parked */
    char *out;                 /* stream buffer */
    size_t out_len, out_cap, out_off;
    bool out_eof;              /* the session ended the stream: after out, the tail, then the end */
    const char *tail;          /* static: the stream's last bytes ([DONE]), which need no allocation */
    size_t tail_len, tail_off;
    double t_arrival;
    uv_poll_t hup;             /* watches the socket for a hang-up while suspended */
    bool hup_active, hup_init;
    bool gone;                 /* the client hung up: never park again, close at the next chance */
    bool cut;                  /* ended by the shutdown deadline or a failed device: answers 503 */
    unsigned status;           /* HTTP status sent (0: none yet), for the access log */
    char method[8];
    char path[96];
    char peer[64];             /* client address:port */
};

struct srv {
    struct kr_serve_opts o;
    uv_loop_t loop;
    struct MHD_Daemon *d;
    uv_poll_t mhd_poll;
    uv_timer_t mhd_timer;
    uv_async_t wake;
    int sig_seen;              /* SIGTERM/SIGINT taken so far (see "signals") */
    uv_timer_t drain_timer;
    uv_poll_t reserve;         /* keeps libuv's watcher table grown (reserve_watchers) */
    int reserve_fd;            /* -1: none */
    bool ready;
    bool draining;
    bool cut_done;             /* the drain deadline passed: what was in flight got its 503 */
    double cut_at;
    bool device_failed;        /* the engine reported a lost device: 503 everywhere, exit 3 */
    bool stopping;             /* stop_everything ran */
    bool gone_close;           /* on_access just closed a connection whose client had left (see mhd_logger) */
    int exit_code;
    struct kr_boot rt;         /* backend, model, tokenizer, chat template, engine (boot.h) */
    char *model_name;
    pthread_mutex_t qmu;
    struct kr_sess_event *qh, *qt; /* engine events on their way to the loop thread */
    struct hreq *reqs;
    struct kr_sess_env env;    /* what the sessions share; env.n_running: requests with live engine work */
    struct kr_metrics met;
    struct kr_conns conns;     /* deadlines of connections without a request in progress (conns.h) */
    uv_timer_t conn_timer;
    size_t body_pool;          /* body bytes buffered beyond each request's free share (BODY_FREE) */
    size_t body_pool_max;
    struct kr_lane big;        /* large bodies' preparations, at a lower priority (lane.h) */
    bool big_ok;
    uv_timer_t trim_timer;     /* gives large requests' freed memory back (kr_sess_trim_wanted) */
    struct kr_lane_work trim_work;
    bool trim_queued;
    int64_t started;
};


static int g_exit_code; /* the process's exit status, for the shutdown watchdog's _exit */

static double now_s(void)
{
    return kr_clock_s();
}

/* ---- CORS ----------------------------------------------------------------------------------- */

/* Whether `v` (len bytes) is in list[n] (case-insensitively when `nocase`); a "*" entry or no list
 * (NULL: the default) holds everything, an empty list nothing. */
static bool cors_listed(const char *const *list, int n, const char *v, size_t len, bool nocase)
{
    if (!list) {
        return true;
    }
    for (int i = 0; i < n; i++) {
        if (!strcmp(list[i], "*") || (strlen(list[i]) == len && (nocase ? !strncasecmp(list[i], v, len)
                                                                          : !strncmp(list[i], v, len)))) {
            return true;
        }
    }
    return false;
}

/* Whether list[n] allows everything (no list, or one holding "*"). */
static bool cors_any(const char *const *list, int n)
{
    for (int i = 0; list && i < n; i++) {
        if (!strcmp(list[i], "*")) {
            return true;
        }
    }
    return !list;
}

/* The request's Origin header when it names an allowed origin, else NULL (no CORS headers then). */
static const char *cors_origin(const struct hreq *h)
{
    const struct kr_serve_opts *o = &h->s->o;
    const char *origin = MHD_lookup_connection_value(h->conn, MHD_HEADER_KIND, "Origin");
    return origin && cors_listed(o->cors_origins, o->n_cors_origins, origin, strlen(origin), false) ? origin : NULL;
}

/* Adds Access-Control-Allow-Origin (and -Credentials, Vary) to a response for an allowed origin:
 * "*" when every origin is allowed and credentials are not, else the origin itself (a browser
 * accepts no "*" with credentials). */
static void cors_add(const struct hreq *h, struct MHD_Response *r)
{
    const struct kr_serve_opts *o = &h->s->o;
    const char *origin = cors_origin(h);
    if (!origin) {
        return;
    }
    const bool star = cors_any(o->cors_origins, o->n_cors_origins) && !o->cors_credentials;
    MHD_add_response_header(r, "Access-Control-Allow-Origin", star ? "*" : origin);
    if (!star) {
        MHD_add_response_header(r, "Vary", "Origin");
    }
    if (o->cors_credentials) {
        MHD_add_response_header(r, "Access-Control-Allow-Credentials", "true");
    }
}

/* Joins list[n] with ", " into buf[cap] (truncated); `all` when the list allows everything. */
static void cors_join(char *buf, size_t cap, const char *const *list, int n, const char *all)
{
    if (cors_any(list, n)) {
        snprintf(buf, cap, "%s", all);
        return;
    }
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < n && at < cap; i++) {
        const int w = snprintf(buf + at, cap - at, "%s%s", i ? ", " : "", list[i]);
        at += w > 0 ? (size_t)w : 0;
    }
}

/* ---- responses ------------------------------------------------------------------------------ */

static void count_status(struct srv *s, unsigned status)
{
    static const unsigned classes[] = {400, 401, 404, 405, 413, 429, 500, 503}; /* then 1 + index */
    int c = status < 300 ? 0 : 9; /* 9: any other status */
    for (int i = 0; i < 8 && status >= 300; i++) {
        c = status == classes[i] ? 1 + i : c;
    }
    s->met.http_requests[c]++;
}

static enum MHD_Result send_body(struct hreq *h, unsigned status, const char *ctype, const char *body, size_t len,
                                 const char *retry_after)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!r) {
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", ctype);
    if (retry_after) {
        MHD_add_response_header(r, "Retry-After", retry_after);
    }
    if (status == 401) {
        MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    }
    if (status == 405 && h->allow) {
        MHD_add_response_header(r, "Allow", h->allow);
    }
    if (h->id[0]) {
        MHD_add_response_header(r, "X-Request-Id", h->id);
    }
    cors_add(h, r);
    enum MHD_Result ret = MHD_queue_response(h->conn, status, r);
    MHD_destroy_response(r);
    h->responded = true;
    h->status = status;
    count_status(h->s, status);
    return ret;
}

/* The answer when building an answer ran out of memory: static, so that it needs no allocation of
 * ours (MHD copies it with its own). */
static const char k_oom_body[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,"
                                 "\"code\":null}}";

static enum MHD_Result send_json_str(struct hreq *h, unsigned status, char *json_malloced)
{
    if (!json_malloced) {
        return send_body(h, 500, "application/json", k_oom_body, sizeof k_oom_body - 1, NULL);
    }
    enum MHD_Result r = send_body(h, status, "application/json", json_malloced, strlen(json_malloced), NULL);
    kr_oai_free(json_malloced);
    return r;
}

static enum MHD_Result send_error(struct hreq *h, const struct kr_oai_error *e)
{
    const char *retry = e->http_status == 429 || e->http_status == 503 ? "1" : NULL;
    char *j = kr_oai_error_json(e);
    if (!j) {
        return send_json_str(h, 500, NULL);
    }
    enum MHD_Result r = send_body(h, (unsigned)e->http_status, "application/json", j, strlen(j), retry);
    kr_oai_free(j);
    return r;
}

/* Answers with the error object of `cause` (kr_oai_error chooses its status, type and code). */
static enum MHD_Result send_simple_error(struct hreq *h, enum kr_oai_cause cause, const char *msg)
{
    struct kr_oai_error e;
    kr_oai_error(&e, cause, "", "%s", msg);
    return send_error(h, &e);
}

/* An OPTIONS request, answered before anything else (no API key: a browser's preflight never carries
 * one): 204 with what may be asked, or a 400 naming what the configuration does not allow (the
 * origin, the method, a header), as vLLM's CORS middleware does. */
static enum MHD_Result send_preflight(struct hreq *h)
{
    const struct kr_serve_opts *o = &h->s->o;
    const char *origin = MHD_lookup_connection_value(h->conn, MHD_HEADER_KIND, "Origin");
    const char *method = MHD_lookup_connection_value(h->conn, MHD_HEADER_KIND, "Access-Control-Request-Method");
    const char *hdrs = MHD_lookup_connection_value(h->conn, MHD_HEADER_KIND, "Access-Control-Request-Headers");
    struct kr_oai_error e;
    if (origin && !cors_origin(h)) {
        kr_oai_error(&e, KR_OAI_INVALID, "Origin", "Disallowed CORS origin: %.200s", origin);
        return send_error(h, &e);
    }
    if (origin && method && !cors_listed(o->cors_methods, o->n_cors_methods, method, strlen(method), false)) {
        kr_oai_error(&e, KR_OAI_INVALID, "Access-Control-Request-Method", "Disallowed CORS method: %.64s", method);
        return send_error(h, &e);
    }
    for (const char *p = origin && hdrs ? hdrs : ""; *p;) { /* a comma list of header names */
        p += strspn(p, " \t,");
        const size_t n = strcspn(p, " \t,");
        if (n && !cors_listed(o->cors_headers, o->n_cors_headers, p, n, true)) {
            kr_oai_error(&e, KR_OAI_INVALID, "Access-Control-Request-Headers", "Disallowed CORS header: %.*s",
                         (int)(n < 64 ? n : 64), p);
            return send_error(h, &e);
        }
        p += n;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    if (!r) {
        return MHD_NO;
    }
    MHD_add_response_header(r, "Allow", "GET, POST, OPTIONS");
    if (origin) {
        char buf[512];
        cors_add(h, r);
        cors_join(buf, sizeof buf, o->cors_methods, o->n_cors_methods, "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT");
        MHD_add_response_header(r, "Access-Control-Allow-Methods", buf);
        /* every header allowed: the ones asked for (a "*" is not honoured with credentials) */
        cors_join(buf, sizeof buf, o->cors_headers, o->n_cors_headers, hdrs ? hdrs : "*");
        if (buf[0]) {
            MHD_add_response_header(r, "Access-Control-Allow-Headers", buf);
        }
        MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    }
    enum MHD_Result ret = MHD_queue_response(h->conn, 204, r);
    MHD_destroy_response(r);
    h->responded = true;
    h->status = 204;
    count_status(h->s, 204);
    return ret;
}

/* ---- request lifetime ------------------------------------------------------------------------ */

static void hup_close_cb(uv_handle_t *hd)
{
    struct hreq *h = hd->data;
    h->hup_init = false;
    kr_free(h);
}

/* ---- request bodies ---------------------------------------------------------------------------------
 *
 * Each request may buffer BODY_FREE bytes of body on its own; beyond that it draws on a pool shared
 * by all connections (body_pool_max: four maximum-size bodies). A body that finds the pool spent is
 * answered 503 with Retry-After: as soon as its headers are in when its Content-Length says so,
 * otherwise once it has been read (and dropped). The memory held by bodies in flight stays
 * under connections x BODY_FREE + the pool, and ordinary requests, far below BODY_FREE, never wait
 * for the pool. The body is freed as soon as the request is prepared. */
#define BODY_FREE ((size_t)256 << 10)

static void body_release(struct hreq *h)
{
    h->s->body_pool -= h->pooled;
    h->pooled = 0;
    kr_free(h->body);
    h->body = NULL;
    h->blen = h->bcap = 0;
}

/* Appends a chunk of the body; false when out of memory. A request over its limit or past the
 * pool's is marked and its bytes dropped from then on. */
static bool body_take(struct hreq *h, const char *data, size_t n)
{
    struct srv *s = h->s;
    if (h->too_big || h->body_busy || h->body_oom || h->responded) {
        return true;
    }
    if (h->blen + n > s->o.max_body_bytes) {
        h->too_big = true; /* keep reading (and dropping) so the 413 can be sent */
        body_release(h);
        return true;
    }
    /* the declared length is reserved whole at the first chunk (a doubling buffer would hold up to
     * twice the body) */
    const size_t need = h->blen + n + 1 > h->clen + 1 ? h->blen + n + 1 : h->clen + 1;
    if (need > BODY_FREE && s->body_pool - h->pooled + (need - BODY_FREE) > s->body_pool_max) {
        h->body_busy = true;
        body_release(h);
        return true;
    }
    if (!h->body && h->clen) {
        if (!(h->body = kr_malloc(need))) {
            return false;
        }
        h->bcap = need;
    }
    if (!kr_text_append(&h->body, &h->blen, &h->bcap, data, n)) {
        return false;
    }
    const size_t pooled = h->bcap > BODY_FREE ? h->bcap - BODY_FREE : 0;
    s->body_pool += pooled - h->pooled;
    h->pooled = pooled;
    return true;
}

/* The 503 of a body the pool cannot take. */
static enum MHD_Result send_busy(struct hreq *h)
{
    char msg[200];
    snprintf(msg, sizeof msg,
             "the server is receiving too many large request bodies at once (%zu MiB buffered); retry later",
             h->s->body_pool_max >> 20);
    return send_simple_error(h, KR_OAI_UNAVAILABLE, msg);
}

static void hreq_free(struct hreq *h)
{
    struct srv *s = h->s;
    if (h->prev) {
        h->prev->next = h->next;
    } else if (s->reqs == h) {
        s->reqs = h->next;
    }
    if (h->next) {
        h->next->prev = h->prev;
    }
    kr_sess_release(h->sess); /* lives on until the engine's last event for it */
    body_release(h);
    kr_free(h->out);
    kr_free(h->ans_body);
    if (h->hup_init) {
        uv_close((uv_handle_t *)&h->hup, hup_close_cb); /* frees h once libuv lets go */
        return;
    }
    kr_free(h);
}

static void hreq_unref(struct hreq *h)
{
    if (--h->refs == 0) {
        hreq_free(h);
    }
}

/* Cancels whatever the engine still does for h (client gone, shutdown): its session sends
 * nothing more. Before the request started (its preparation may still be running on a worker)
 * there is nothing to cancel, and the session must not be touched. */
static void hreq_cancel(struct hreq *h)
{
    if (h->prep_state == PREP_STARTED && h->sess) {
        kr_sess_cancel(h->sess, NULL);
    }
}

static void hup_stop(struct hreq *h)
{
    if (h->hup_active) {
        uv_poll_stop(&h->hup);
        h->hup_active = false;
    }
}

/* Wakes a parked connection: MHD acts on a resume at its next run. */
static void resume(struct hreq *h)
{
    if (h->suspended && h->conn) {
        hup_stop(h);
        h->suspended = false;
        MHD_resume_connection(h->conn);
    }
}

/* ---- the session's sink: SSE framing and the parked answer ---------------------------------------- */

static void sink_stream_begin(void *user)
{
    struct hreq *h = user;
    h->stream = true; /* the access handler queues the event-stream response */
}

/* One SSE event, "event: <name>\n" (when named) and "data: <json>\n\n", appended whole or not at
 * all; the reader sends it. */
static bool sink_stream_event_named(void *user, const char *name, const char *json, size_t len)
{
    struct hreq *h = user;
    if (!kr_http_sse_append(&h->out, &h->out_len, &h->out_cap, name, json, len)) {
        return false;
    }
    resume(h);
    return true;
}

static bool sink_stream_event(void *user, const char *json, size_t len)
{
    return sink_stream_event_named(user, NULL, json, len);
}

/* The last bytes of a stream: static, so that its end never waits for memory (a stream that could
 * not be ended would leave its client waiting). The second is for a session whose error event could
 * not be queued. */
static const char k_sse_done[] = "data: [DONE]\n\n";
static const char k_sse_oom_done[] = "data: {\"error\":{\"message\":\"the server ran out of memory while producing this "
                                     "response; it is incomplete\",\"type\":\"server_error\",\"param\":null,"
                                     "\"code\":null}}\n\ndata: [DONE]\n\n";

static void sink_done(void *user, int status, const char *body, size_t len)
{
    struct hreq *h = user;
    h->answered = true;
    if (h->stream) {
        const bool bare = body && len == 0; /* a Responses stream ends without [DONE] */
        h->tail = status == 200 ? (bare ? "" : k_sse_done) : k_sse_oom_done;
        h->tail_len = status == 200 ? (bare ? 0 : sizeof k_sse_done - 1) : sizeof k_sse_oom_done - 1;
        h->out_eof = true;
    } else {
        h->ans_ready = true;
        h->ans_status = (unsigned)status;
        h->ans_body = body ? kr_strndup(body, len) : NULL;
        h->ans_len = len;
    }
    resume(h);
}

static const struct kr_sess_sink sink = {
    .stream_begin = sink_stream_begin,
    .stream_event = sink_stream_event,
    .stream_event_named = sink_stream_event_named,
    .done = sink_done,
};

/* Sends the session's answer (not a stream), with Retry-After on 429 and 503 as every error. */
static enum MHD_Result send_answer(struct hreq *h)
{
    h->ans_ready = false;
    if (!h->ans_body) {
        return send_json_str(h, 500, NULL);
    }
    const char *retry = h->ans_status == 429 || h->ans_status == 503 ? "1" : NULL;
    enum MHD_Result r = send_body(h, h->ans_status, "application/json", h->ans_body, h->ans_len, retry);
    kr_free(h->ans_body);
    h->ans_body = NULL;
    return r;
}

/* ---- engine events (engine thread -> loop thread) ------------------------------------------------ */

/* Engine thread (the sessions' carrier): queues an event and wakes the loop. Never blocks beyond
 * a short mutex. */
static void post_event(void *user, struct kr_sess_event *n)
{
    struct srv *s = user;
    pthread_mutex_lock(&s->qmu);
    if (s->qt) {
        s->qt->next = n;
    } else {
        s->qh = n;
    }
    s->qt = n;
    pthread_mutex_unlock(&s->qmu);
    uv_async_send(&s->wake);
}

static void arm_timer(struct srv *s);

/* Runs MHD and follows its next timeout: a resumed connection may leave work that shows only as
 * a zero timeout (MHD's epoll is edge-triggered), never as a readable epoll descriptor. */
static void mhd_kick(struct srv *s)
{
    if (s->d) {
        MHD_run(s->d);
        arm_timer(s);
    }
}

static void on_device_failed(struct srv *s);

static void on_wake(uv_async_t *a)
{
    struct srv *s = a->data;
    pthread_mutex_lock(&s->qmu);
    struct kr_sess_event *n = s->qh;
    s->qh = s->qt = NULL;
    pthread_mutex_unlock(&s->qmu);
    while (n) {
        struct kr_sess_event *next = n->next;
        kr_sess_event_deliver(n);
        n = next;
    }
    if (s->rt.eng && !s->device_failed && !s->stopping && kr_engine_failed(s->rt.eng)) {
        on_device_failed(s);
    }
    mhd_kick(s);
}

/* ---- hang-up watch for parked connections ------------------------------------------------------- */

static void on_hup(uv_poll_t *p, int status, int events)
{
    struct hreq *h = p->data;
    if (status < 0 || (events & UV_DISCONNECT)) {
        hup_stop(h);
        h->gone = true; /* never parked again: the poll would fire at once on the dead socket */
        KR_LOG_DEBUG("%s: the client hung up", h->id);
        if (!h->answered) {
            hreq_cancel(h); /* the client is gone: free its caches now, not at the end */
        }
        resume(h); /* MHD then closes the connection (the reader or the handler refuses it) */
        mhd_kick(h->s);
    }
}

static void hup_start(struct hreq *h)
{
    if (!h->conn || h->hup_active || h->gone) {
        return;
    }
    if (!h->hup_init) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(h->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (!ci || uv_poll_init(&h->s->loop, &h->hup, ci->connect_fd) != 0) {
            return;
        }
        h->hup.data = h;
        h->hup_init = true;
    }
    if (uv_poll_start(&h->hup, UV_DISCONNECT, on_hup) == 0) {
        h->hup_active = true;
    }
}

static void park(struct hreq *h)
{
    if (!h->suspended && !h->gone) {
        h->suspended = true;
        MHD_suspend_connection(h->conn);
        hup_start(h);
    }
}

/* ---- generation routes --------------------------------------------------------------------------- */

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct hreq *h = cls;
    (void)pos;
    if (h->out_off < h->out_len) {
        const size_t n = kr_http_drain(h->out, h->out_len, &h->out_off, buf, max);
        if (h->out_off == h->out_len) {
            h->out_off = h->out_len = 0;
        }
        return (ssize_t)n;
    }
    if (h->out_eof) {
        if (h->tail_off < h->tail_len) {
            return (ssize_t)kr_http_drain(h->tail, h->tail_len, &h->tail_off, buf, max);
        }
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    if (h->gone) {
        return MHD_CONTENT_READER_END_WITH_ERROR; /* the client left: MHD closes the connection */
    }
    park(h); /* nothing queued: sleep until the next event resumes us (returning 0 alone would spin) */
    return 0;
}

static void stream_reader_free(void *cls)
{
    (void)cls; /* the request's lifetime is counted by its references */
}


/* The session started: its answer is ready, or a stream begins, or the connection waits. */
static enum MHD_Result answer_or_wait(struct hreq *h)
{
    if (h->ans_ready) {
        return send_answer(h);
    }
    if (h->stream && !h->responded) {
        struct MHD_Response *r =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, h, stream_reader_free);
        if (!r) {
            hreq_cancel(h);
            return MHD_NO;
        }
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        MHD_add_response_header(r, "X-Request-Id", h->id);
        cors_add(h, r);
        enum MHD_Result ret = MHD_queue_response(h->conn, 200, r);
        MHD_destroy_response(r);
        h->responded = true;
        h->status = 200;
        count_status(h->s, 200);
        return ret;
    }
    park(h);
    return MHD_YES;
}

static void prep_work(uv_work_t *w)
{
    struct hreq *h = w->data;
    h->prep_failed = kr_sess_prepare(h->sess, h->body, h->blen) != KR_OK;
}

static void prep_done(struct hreq *h, int status)
{
    if (status != 0) { /* cancelled at shutdown before it ran */
        h->prep_failed = true;
    }
    h->prep_state = PREP_DONE;
    body_release(h); /* the session keeps what it needs */
    if (h->conn) {
        resume(h); /* the access handler answers or submits */
        mhd_kick(h->s);
    }
    hreq_unref(h);
}

static void prep_after(uv_work_t *w, int status)
{
    prep_done(w->data, status);
}

static void lane_work(struct kr_lane_work *w)
{
    struct hreq *h = w->data;
    h->prep_failed = kr_sess_prepare(h->sess, h->body, h->blen) != KR_OK;
}

static void lane_after(struct kr_lane_work *w, int status)
{
    prep_done(w->data, status);
}

/* malloc_trim walks every arena holding its lock: on the lane (nice +10), at most every 2 s, never
 * on the loop thread, where a large heap made it a stall of a tenth of a second. */
static void trim_work(struct kr_lane_work *w)
{
    (void)w;
    malloc_trim(0);
}

static void trim_after(struct kr_lane_work *w, int status)
{
    struct srv *s = w->data;
    (void)status;
    s->trim_queued = false;
}

static void on_trim_timer(uv_timer_t *t)
{
    struct srv *s = t->data;
    /* the engine marks itself failed after delivering its requests' errors: when no delivery
     * followed, this is where the server learns of it */
    if (s->rt.eng && !s->device_failed && !s->stopping && kr_engine_failed(s->rt.eng)) {
        on_device_failed(s);
    }
    /* a leader whose worker left while no step ran: nothing would notice until the next request, so
     * the group fails now (exit 3: whoever restarts the leader restarts the group) */
    if (s->ready && s->rt.eng && s->o.nnodes > 1 && !kr_boot_is_worker(&s->rt) && !s->device_failed &&
        !s->stopping && !s->draining && !kr_boot_group_healthy(&s->rt)) {
        KR_LOG_ERROR("the group of %d nodes lost a node while idle", s->o.nnodes);
        on_device_failed(s);
    }
    if (s->big_ok && !s->trim_queued && !s->stopping && atomic_exchange(&kr_sess_trim_wanted, false)) {
        s->trim_queued = true;
        s->trim_work = (struct kr_lane_work){.work = trim_work, .after = trim_after, .data = s};
        kr_lane_submit(&s->big, &s->trim_work);
    }
}

/* Parks the connection and prepares the request's session (parsing, the chat template and
 * tokenization, or the whole /tokenize answer) on libuv's thread pool, or, for a body beyond
 * BODY_FREE, on the lane of large preparations. */
static enum MHD_Result handle_generate(struct hreq *h)
{
    static const enum kr_sess_kind kinds[] = {
        [KR_HTTP_ROUTE_COMPLETIONS] = KR_SESS_COMPLETIONS, [KR_HTTP_ROUTE_CHAT] = KR_SESS_CHAT,
        [KR_HTTP_ROUTE_RESPONSES] = KR_SESS_RESPONSES,     [KR_HTTP_ROUTE_TOKENIZE] = KR_SESS_TOKENIZE,
        [KR_HTTP_ROUTE_DETOKENIZE] = KR_SESS_DETOKENIZE};
    h->sess = kr_sess_create(&h->s->env, kinds[h->route], h->t_arrival);
    if (!h->sess) {
        return send_json_str(h, 500, NULL);
    }
    h->prep_state = PREP_RUNNING;
    h->work.data = h;
    h->refs++;
    if (h->blen > BODY_FREE && h->s->big_ok) {
        h->lw = (struct kr_lane_work){.work = lane_work, .after = lane_after, .data = h};
        kr_lane_submit(&h->s->big, &h->lw);
    } else if (uv_queue_work(&h->s->loop, &h->work, prep_work, prep_after) != 0) {
        h->refs--;
        h->prep_state = PREP_NONE;
        return send_simple_error(h, KR_OAI_INTERNAL, "cannot queue the request");
    }
    park(h);
    return MHD_YES;
}

/* ---- other routes --------------------------------------------------------------------------------- */

static bool authorized(struct hreq *h)
{
    const struct srv *s = h->s;
    return kr_http_authorized(MHD_lookup_connection_value(h->conn, MHD_HEADER_KIND, "Authorization"), s->o.api_keys,
                              s->o.n_api_keys);
}

static enum MHD_Result dispatch(struct hreq *h, const char *url, const char *method)
{
    struct srv *s = h->s;
    const bool get = !strcmp(method, "GET");
    if (h->too_big) {
        char msg[128];
        snprintf(msg, sizeof msg, "the request body exceeds %zu bytes", s->o.max_body_bytes);
        return send_simple_error(h, KR_OAI_TOO_LARGE, msg);
    }
    if (h->body_busy) {
        return send_busy(h);
    }
    if (h->body_oom) {
        return send_json_str(h, 500, NULL);
    }
    if (!strcmp(url, "/health") || !strcmp(url, "/ping")) {
        const bool dev_ok = kr_backend_healthy(s->rt.be) && !s->device_failed && !(s->rt.eng && kr_engine_failed(s->rt.eng));
        const bool group_ok = kr_boot_group_healthy(&s->rt);
        if (s->ready && !s->draining && dev_ok && group_ok) {
            return send_body(h, 200, "application/json", "{}", 2, NULL);
        }
        return send_simple_error(h, KR_OAI_UNAVAILABLE,
                                 !dev_ok       ? "the compute device failed; restart the server"
                                 : !group_ok && s->ready ? "the group of nodes failed; restart it"
                                 : s->draining ? "the server is shutting down"
                                 : s->o.nnodes > 1 ? "the nodes are joining or the model is loading"
                                               : "the model is loading");
    }
    if (kr_boot_is_worker(&s->rt)) {
        char msg[384];
        snprintf(msg, sizeof msg, "this is node %d of a group of %d: it serves /health only; send requests to the "
                 "leader (node 0, %.200s)", s->o.node_rank, s->o.nnodes, s->o.master_addr);
        return send_simple_error(h, KR_OAI_NOT_FOUND, msg);
    }
    if (!strcmp(url, "/metrics") && get) {
        struct kr_engine_stats st = {0};
        if (s->rt.eng) {
            kr_engine_get_stats(s->rt.eng, &st);
        }
        s->met.connections_open = s->conns.n_open;
        s->met.connections_closed[0] = s->conns.n_header_timeouts;
        s->met.connections_closed[1] = s->conns.n_body_timeouts;
        s->met.connections_closed[2] = s->conns.n_evicted;
        s->met.connections_closed[3] = s->conns.n_refused;
        size_t len = 0;
        char *txt = kr_metrics_render(&s->met, &st, s->model_name, &len);
        if (!txt) {
            return send_json_str(h, 500, NULL);
        }
        enum MHD_Result r = send_body(h, 200, "text/plain; version=0.0.4; charset=utf-8", txt, len, NULL);
        kr_free(txt);
        return r;
    }
    if (!strcmp(url, "/version") && get) {
        return send_body(h, 200, "application/json", "{\"version\":\"0.1.0\"}", 19, NULL);
    }
    /* a guarded route without the key was refused when its headers came in (on_access) */
    const char *allow = NULL;
    const enum kr_http_route route = kr_http_route_find(url, method, &allow);
    if (route != KR_HTTP_ROUTE_NONE && allow) {
        h->allow = allow;
        return send_simple_error(h, KR_OAI_METHOD, !strcmp(allow, "POST") ? "use POST" : "use GET");
    }
    /* GET /v1/models/{id} (the SDK's models.retrieve): the model object, or a 404 naming the id */
    if (route == KR_HTTP_ROUTE_MODEL) {
        const char *id = url + strlen("/v1/models/");
        if (!s->ready || s->draining) {
            return send_simple_error(h, KR_OAI_UNAVAILABLE, s->draining ? "the server is shutting down"
                                                                        : "the model is loading");
        }
        if (strcmp(id, s->model_name) != 0) {
            struct kr_oai_error e;
            kr_oai_error(&e, KR_OAI_MODEL_NOT_FOUND, "model", "The model `%.256s` does not exist; this server serves `%.256s`",
                         id, s->model_name);
            return send_error(h, &e);
        }
        return send_json_str(h, 200, kr_oai_model_json(s->model_name, s->started, s->rt.max_model_len));
    }
    if (route != KR_HTTP_ROUTE_NONE) {
        if (!s->ready || s->draining) {
            return send_simple_error(h, KR_OAI_UNAVAILABLE,
                                     s->device_failed ? "the compute device failed; the server is restarting"
                                     : s->draining    ? "the server is shutting down"
                                                      : "the model is loading");
        }
        h->route = route;
        switch (h->route) {
        case KR_HTTP_ROUTE_COMPLETIONS:
        case KR_HTTP_ROUTE_CHAT:
        case KR_HTTP_ROUTE_RESPONSES:
            return handle_generate(h);
        case KR_HTTP_ROUTE_MODELS: {
            char *j = kr_oai_models_json(s->model_name, s->started, s->rt.max_model_len);
            return send_json_str(h, 200, j);
        }
        case KR_HTTP_ROUTE_TOKENIZE:
        case KR_HTTP_ROUTE_DETOKENIZE:
            return handle_generate(h); /* same worker hand-off */
        case KR_HTTP_ROUTE_MODEL: /* answered above */
        case KR_HTTP_ROUTE_NONE:
            break;
        }
    }
    return send_simple_error(h, KR_OAI_NOT_FOUND, "no such route");
}

/* ---- libmicrohttpd callbacks ------------------------------------------------------------------------- */

/* The deadline record of a connection (its socket context; NULL when it could not be allocated). */
static struct kr_conn *conn_of(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci = conn ? MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT) : NULL;
    return ci ? ci->socket_context : NULL;
}

static void arm_conn_timer(struct srv *s, double in_s);

/* A connection changed state: the sweep timer follows the earliest deadline (the sweep itself only
 * looks at the oldest connection of each state). */
static void conn_watch(struct srv *s)
{
    arm_conn_timer(s, kr_conns_sweep(&s->conns, now_s()));
}

static void on_conn_timer(uv_timer_t *t)
{
    struct srv *s = t->data;
    arm_conn_timer(s, kr_conns_sweep(&s->conns, now_s()));
    mhd_kick(s); /* libmicrohttpd reads the ends of the streams shut down */
}

/* The sweep runs at the earliest deadline (a little after, so that it finds it passed). */
static void arm_conn_timer(struct srv *s, double in_s)
{
    if (in_s < 0 || s->stopping) {
        uv_timer_stop(&s->conn_timer);
        return;
    }
    uv_timer_start(&s->conn_timer, on_conn_timer, (uint64_t)(in_s * 1000.0) + 10, 0);
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe)
{
    struct srv *s = cls;
    if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        kr_conn_closed(&s->conns, *socket_context);
        *socket_context = NULL;
        return;
    }
    const union MHD_ConnectionInfo *fi = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    const union MHD_ConnectionInfo *ai = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    const struct sockaddr *sa = ai ? ai->client_addr : NULL;
    const unsigned sa_len = !sa ? 0 : sa->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
    *socket_context = fi ? kr_conn_open(&s->conns, fi->connect_fd, sa, sa_len, now_s()) : NULL;
    conn_watch(s);
}

/* Before a connection is set up: refused when its address crowds the others out (conns.h). */
static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen)
{
    struct srv *s = cls;
    if (kr_conns_admit(&s->conns, addr, (unsigned)addrlen, now_s())) {
        return MHD_YES;
    }
    conn_watch(s); /* the sweep lifts the block it may have begun */
    return MHD_NO;
}

/* conns.h's door: the address `key` kept out of the listening socket, or (NULL) everyone let in. */
static void on_door(void *user, const uint8_t key[17])
{
    struct srv *s = user;
    const union MHD_DaemonInfo *li = s->d ? MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_LISTEN_FD) : NULL;
    if (!li) {
        return;
    }
    if (!key) {
        if (kr_door_open(li->listen_fd) != 0) {
            KR_LOG_WARN("http: cannot remove the listening socket's filter: %s", strerror(errno));
        }
        return;
    }
    char a[INET6_ADDRSTRLEN] = "?";
    inet_ntop(key[0] == 4 ? AF_INET : AF_INET6, key + 1, a, sizeof a);
    if (kr_door_keep_out(li->listen_fd, key) != 0) {
        KR_LOG_WARN("http: cannot keep %s out at the listening socket: %s", a, strerror(errno));
        return;
    }
    KR_LOG_WARN("http: %s holds %d of %d connections waiting for a request: its new connections are dropped "
                "for %.0f s", a, s->conns.top ? s->conns.top->n_waiting : 0, s->conns.waiting.n, KR_CONNS_BLOCK_S);
}

/* The con_cls of a request whose record could not be allocated: it was answered with a 500 when its
 * headers came in; the rest of it (its body) is dropped. */
static char g_no_record;

/* Answers a request that has no record (out of memory) with a 500 that needs no allocation of ours. */
static enum MHD_Result send_oom_bare(struct srv *s, struct MHD_Connection *conn, void **con_cls)
{
    *con_cls = &g_no_record;
    KR_LOG_ERROR("out of memory for a new request: answered 500");
    struct MHD_Response *r = MHD_create_response_from_buffer(sizeof k_oom_body - 1, (void *)k_oom_body,
                                                             MHD_RESPMEM_PERSISTENT);
    if (!r) {
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "application/json");
    enum MHD_Result ret = MHD_queue_response(conn, 500, r);
    MHD_destroy_response(r);
    count_status(s, 500);
    return ret;
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    struct srv *s = cls;
    struct hreq *h = *con_cls;
    (void)version;
    s->gone_close = false;
    if (*con_cls == &g_no_record) {
        *upload_size = 0;
        return MHD_YES;
    }
    if (!h) { /* headers are in */
        h = kr_calloc(1, sizeof *h);
        if (!h) {
            return send_oom_bare(s, conn, con_cls);
        }
        static uint64_t arrivals;
        h->s = s;
        h->conn = conn;
        h->refs = 1;
        h->t_arrival = now_s();
        snprintf(h->id, sizeof h->id, "req-%llx", (unsigned long long)++arrivals); /* generation renames it */
        snprintf(h->method, sizeof h->method, "%s", method);
        snprintf(h->path, sizeof h->path, "%s", url);
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        if (ci && ci->client_addr) {
            char ip[INET6_ADDRSTRLEN] = "?";
            unsigned port = 0;
            if (ci->client_addr->sa_family == AF_INET) {
                const struct sockaddr_in *a = (const struct sockaddr_in *)ci->client_addr;
                inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
                port = ntohs(a->sin_port);
                snprintf(h->peer, sizeof h->peer, "%s:%u", ip, port);
            } else if (ci->client_addr->sa_family == AF_INET6) {
                const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ci->client_addr;
                inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof ip);
                port = ntohs(a->sin6_port);
                snprintf(h->peer, sizeof h->peer, "[%s]:%u", ip, port);
            }
        }
        h->next = s->reqs;
        if (s->reqs) {
            s->reqs->prev = h;
        }
        s->reqs = h;
        *con_cls = h;
        kr_conn_headers_in(&s->conns, conn_of(conn), h->t_arrival);
        conn_watch(s);
        /* refusals that need no body are answered before a byte of it is read: a client without
         * the key, or one declaring a body over the limit, gets no buffer */
        if (!strcmp(method, "OPTIONS")) {
            return send_preflight(h);
        }
        if (kr_http_guarded(url) && !authorized(h)) {
            return send_simple_error(h, KR_OAI_UNAUTHORIZED,
                                     "missing or invalid API key (send Authorization: Bearer <key>)");
        }
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (!kr_http_content_length(cl, s->o.max_body_bytes, &h->clen)) {
            h->too_big = true;
            char msg[128];
            snprintf(msg, sizeof msg, "the request body exceeds %zu bytes", s->o.max_body_bytes);
            return send_simple_error(h, KR_OAI_TOO_LARGE, msg);
        }
        if (h->clen + 1 > BODY_FREE && s->body_pool + (h->clen + 1 - BODY_FREE) > s->body_pool_max) {
            h->body_busy = true; /* the pool cannot take the declared body: refused before it is sent */
            return send_busy(h);
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (!body_take(h, upload, *upload_size)) {
            h->body_oom = true; /* keep reading (and dropping) so that the 500 can be sent */
            body_release(h);
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (!h->body_in) {
        h->body_in = true;
        kr_conn_body_in(&s->conns, conn_of(conn));
    }
    if (h->responded) {
        return MHD_YES;
    }
    if (h->gone) {
        s->gone_close = true; /* MHD logs this close as an internal error: an ordinary disconnect */
        return MHD_NO;        /* the client hung up before its answer: close (on_completed cancels) */
    }
    switch (h->prep_state) {
    case PREP_RUNNING: /* woken early: keep waiting for the worker */
        park(h);
        return MHD_YES;
    case PREP_DONE:
        h->prep_state = PREP_STARTED;
        if (!h->prep_failed && (s->cut_done || s->device_failed)) {
            /* prepared after the drain deadline or a device failure: never started */
            return send_simple_error(h, KR_OAI_UNAVAILABLE,
                                     s->device_failed ? "the compute device failed; the server is restarting"
                                                      : "the server shut down before this request could start");
        }
        kr_sess_start(h->sess, &sink, h); /* a refusal or a /tokenize answer comes back at once */
        if (kr_sess_id(h->sess)[0]) {
            snprintf(h->id, sizeof h->id, "%s", kr_sess_id(h->sess));
        }
        return answer_or_wait(h);
    case PREP_STARTED: /* resumed: the answer is ready (the generation is over, or was cut) */
        if (h->ans_ready) {
            return send_answer(h);
        }
        park(h);
        return MHD_YES;
    case PREP_NONE:
        break;
    }
    return dispatch(h, url, method);
}

static const char *termination_name(enum MHD_RequestTerminationCode toe)
{
    switch (toe) {
    case MHD_REQUEST_TERMINATED_COMPLETED_OK:
        return "completed";
    case MHD_REQUEST_TERMINATED_WITH_ERROR:
        return "write error or closed by the server";
    case MHD_REQUEST_TERMINATED_TIMEOUT_REACHED:
        return "idle timeout";
    case MHD_REQUEST_TERMINATED_DAEMON_SHUTDOWN:
        return "server shutdown";
    case MHD_REQUEST_TERMINATED_READ_ERROR:
        return "read error";
    case MHD_REQUEST_TERMINATED_CLIENT_ABORT:
        return "client closed the connection";
    }
    return "unknown";
}

/* One line per request at info: who, what, the status (499 when the client left before any
 * answer, as nginx logs it), how long, the tokens, the request id and how the connection ended
 * when it did not end cleanly. */
static void access_log(const struct hreq *h, enum MHD_RequestTerminationCode toe)
{
    if (kr_log_get_level() > KR_LOG_LEVEL_INFO) {
        return;
    }
    int64_t prompt = 0, completion = 0;
    if (h->sess) {
        kr_sess_usage(h->sess, &prompt, &completion);
    }
    const bool clean = toe == MHD_REQUEST_TERMINATED_COMPLETED_OK;
    const unsigned status = h->status ? h->status : 499;
    char tail[96] = "";
    if (!clean) {
        snprintf(tail, sizeof tail, " (%s%s)", h->gone ? "the client went away" : termination_name(toe),
                 h->status && h->stream && !h->out_eof ? ", stream cut" : "");
    } else if (h->cut) {
        snprintf(tail, sizeof tail, " (cut by the shutdown)");
    }
    KR_LOG_INFO("%s \"%s %s\" %u %.3fs prompt_tokens=%lld completion_tokens=%lld id=%s%s", h->peer[0] ? h->peer : "-",
                h->method, h->path, status, now_s() - h->t_arrival, (long long)prompt, (long long)completion, h->id,
                tail);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    struct srv *s = cls;
    struct hreq *h = *con_cls;
    if (!h || *con_cls == &g_no_record) {
        *con_cls = NULL;
        return;
    }
    hup_stop(h);
    kr_conn_answered(&s->conns, conn_of(conn), now_s()); /* kept alive: waits for the next headers */
    conn_watch(s);
    h->conn = NULL;
    h->suspended = false;
    const bool early = !h->answered && h->prep_state == PREP_STARTED;
    if (early) {
        if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK) {
            KR_LOG_DEBUG("%s: the client went away (%s): cancelling", h->id, termination_name(toe));
        }
        hreq_cancel(h);
    }
    access_log(h, toe);
    *con_cls = NULL;
    hreq_unref(h);
}

/* libmicrohttpd's own messages, through krait's log. Its logger is not told which connection a
 * message is about; the request id of a connection that ends badly is in the access line that
 * on_completed writes for it. A client that goes away mid-answer is ordinary traffic (debug);
 * anything else is a warning. */
__attribute__((format(printf, 2, 0))) static void mhd_logger(void *cls, const char *fmt, va_list ap)
{
    struct srv *s = cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) {
        line[--n] = 0;
    }
    static const char *const ordinary[] = {"Failed to send", "Failed to receive", "closed", "reset", "disconnect",
                                           "Connection timed out", "timed out",
                                           "application error generating response" /* our reader, client gone */};
    bool debug = false;
    for (size_t i = 0; i < sizeof ordinary / sizeof ordinary[0]; i++) {
        debug |= strstr(line, ordinary[i]) != NULL;
    }
    if (s && s->gone_close && strstr(line, "internal error")) {
        debug = true; /* on_access closed the connection of a client that had left */
        s->gone_close = false;
    }
    /* refusals a client can cause at will (too many connections, headers too big): worth a warning,
     * but one every 10 s at most, or a flood of them would flood the log too */
    static const char *const refusals[] = {"connection limit", "too big", "Closing inbound connection"};
    bool refusal = false;
    for (size_t i = 0; i < sizeof refusals / sizeof refusals[0]; i++) {
        refusal |= strstr(line, refusals[i]) != NULL;
    }
    if (!debug && refusal) {
        static double last;
        static unsigned long held;
        const double t = now_s();
        if (t - last < 10.0) {
            held++;
            return;
        }
        if (held) {
            kr_log(KR_LOG_LEVEL_WARN, "http: %s (and %lu such refusals in the 10 s before)", line, held);
        } else {
            kr_log(KR_LOG_LEVEL_WARN, "http: %s", line);
        }
        last = t;
        held = 0;
        return;
    }
    kr_log(debug ? KR_LOG_LEVEL_DEBUG : KR_LOG_LEVEL_WARN, "http: %s", line);
}

/* ---- the loop ------------------------------------------------------------------------------------------ */

static void on_mhd_poll(uv_poll_t *p, int status, int events)
{
    struct srv *s = p->data;
    (void)status;
    (void)events;
    MHD_run(s->d);
    arm_timer(s);
}

static void on_mhd_timer(uv_timer_t *t)
{
    struct srv *s = t->data;
    MHD_run(s->d);
    arm_timer(s);
}

/* Follows MHD's next timeout (connection timeouts); none pending means no timer. */
static void arm_timer(struct srv *s)
{
    MHD_UNSIGNED_LONG_LONG ms = 0;
    if (s->d && MHD_get_timeout(s->d, &ms) == MHD_YES) {
        uv_timer_start(&s->mhd_timer, on_mhd_timer, ms, 0);
    } else {
        uv_timer_stop(&s->mhd_timer);
    }
}

/* ---- signals -------------------------------------------------------------------------------------------
 *
 * SIGTERM and SIGINT are caught by a handler of our own that counts them and wakes the loop
 * (uv_async_send is async-signal-safe); the loop thread acts on each (on_signal). libuv's uv_signal_t
 * is not used for them: stopping one puts back the default action, and a signal arriving between that
 * and the SIG_IGN set after it killed the process with a signal status in the middle of an orderly
 * shutdown. Here one sigaction swaps the handler for SIG_IGN, so there is no such moment. */

static struct {
    uv_async_t async;
    atomic_int count; /* signals caught */
    atomic_int last;  /* the last one's number */
    atomic_int busy;  /* handlers running now (the async handle is closed once none is) */
} g_sig;

static void signal_caught(int signum)
{
    const int saved = errno;
    atomic_fetch_add(&g_sig.busy, 1);
    atomic_store(&g_sig.last, signum);
    atomic_fetch_add(&g_sig.count, 1);
    uv_async_send(&g_sig.async);
    atomic_fetch_sub(&g_sig.busy, 1);
    errno = saved;
}

static void signals_set(void (*handler)(int))
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sigfillset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
}

static void signals_catch(void)
{
    signals_set(signal_caught);
}

static void signals_ignore(void)
{
    signals_set(SIG_IGN);
}

/* Before the async handle closes: no handler is caught half-way (they are ignored by then). */
static void signals_release(void)
{
    signals_ignore();
    while (atomic_load(&g_sig.busy) > 0) {
        sched_yield();
    }
}

static void stop_everything(struct srv *s)
{
    if (s->stopping) {
        return;
    }
    s->stopping = true;
    /* park nothing: MHD_stop_daemon needs every connection resumed to close it */
    for (struct hreq *h = s->reqs; h; h = h->next) {
        hreq_cancel(h);
        resume(h);
    }
    uv_poll_stop(&s->mhd_poll);
    uv_timer_stop(&s->mhd_timer);
    uv_timer_stop(&s->conn_timer);
    uv_timer_stop(&s->trim_timer);
    uv_timer_stop(&s->drain_timer);
    /* the shutdown is under way and bounded (work is cancelled, nothing waits on clients): a further
     * SIGTERM or SIGINT is ignored from here on */
    signals_ignore();
    uv_stop(&s->loop);
}

/* ---- drain ------------------------------------------------------------------------------------------
 *
 *   SIGTERM ─▶ draining: /health and new /v1 requests answer 503; in-flight requests go on
 *     ├─ every request answered (no connection holds one) ───────────────────────────▶ stop, exit 0
 *     └─ --shutdown-timeout passed ─▶ cut: each unfinished request ends with a 503 (an error event
 *          and [DONE] on a stream), its engine work cancelled; up to CUT_GRACE_S for those
 *          answers to leave ─▶ stop, exit 0
 * A watchdog thread ends the process at --shutdown-timeout + 4.5 s whatever the loop is doing
 * (a client that never reads, a stuck worker), so that SIGTERM always ends within the timeout + 5 s.
 * A failed device takes the same path with no timeout and exit status 3. */
#define CUT_GRACE_S 2.0

static double g_drain_started;

/* Requests whose connection is still open (headers received, the answer not completely sent). */
static int open_requests(const struct srv *s)
{
    int n = 0;
    for (const struct hreq *h = s->reqs; h; h = h->next) {
        n += h->conn != NULL;
    }
    return n;
}

/* Ends every unfinished request with a 503 naming why and cancels its engine work. */
static void cut_all(struct srv *s, const char *why)
{
    int n = 0;
    for (struct hreq *h = s->reqs; h; h = h->next) {
        if (h->prep_state != PREP_STARTED || h->answered || h->cut) {
            continue;
        }
        h->cut = true;
        n++;
        struct kr_oai_error e;
        kr_oai_error(&e, KR_OAI_UNAVAILABLE, "", "%s", why);
        kr_sess_cancel(h->sess, &e); /* the 503, or on a stream the error event and [DONE] */
        resume(h);
    }
    if (n) {
        KR_LOG_WARN("%s: ended %d unfinished request(s) with 503", why, n);
    }
    mhd_kick(s);
}

static void on_drain_tick(uv_timer_t *t)
{
    struct srv *s = t->data;
    const double now = now_s(), waited = now - g_drain_started;
    const int open = open_requests(s);
    if (open == 0 && s->env.n_running == 0) {
        KR_LOG_INFO("shutting down: every request answered (%.1f s into the drain)", waited);
        stop_everything(s);
        return;
    }
    if (!s->cut_done && (waited >= s->o.drain_timeout_s || s->device_failed)) {
        s->cut_done = true;
        s->cut_at = now;
        char why[160];
        if (s->device_failed) {
            snprintf(why, sizeof why, "the compute device failed; the server is restarting");
        } else {
            snprintf(why, sizeof why, "the server shut down before this request finished (--shutdown-timeout %.0f s)",
                     s->o.drain_timeout_s);
        }
        cut_all(s, why);
        return;
    }
    if (s->cut_done && now - s->cut_at >= CUT_GRACE_S) {
        KR_LOG_WARN("shutting down: %d connection(s) still open %.0f s after their 503; closing them", open,
                    CUT_GRACE_S);
        stop_everything(s);
    }
}

/* The shutdown watchdog: a thread that ends the process at its deadline unless kr_serve_run
 * returned first (a server run inside another program, the tests among them, must not be ended
 * by the watchdog of a shutdown that completed). */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    double deadline;           /* kr_clock_s */
    bool stop;                 /* kr_serve_run is returning: nothing left to guard */
    bool running;              /* started and not joined */
    pthread_t th;
} g_wd = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void *watchdog_main(void *arg)
{
    prctl(PR_SET_NAME, "kr-watchdog", 0, 0, 0); /* a name for top -H and /proc/PID/task */
    (void)arg;
    pthread_mutex_lock(&g_wd.mu);
    while (!g_wd.stop) {
        const double left = g_wd.deadline - now_s();
        if (left <= 0) {
            break;
        }
        /* the condition variable's clock is CLOCK_REALTIME: wait until "now + left" on it */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        const double at = (double)ts.tv_nsec / 1e9 + left;
        ts.tv_sec += (time_t)at;
        ts.tv_nsec = (long)((at - (double)(time_t)at) * 1e9);
        pthread_cond_timedwait(&g_wd.cv, &g_wd.mu, &ts);
    }
    const bool stopped = g_wd.stop;
    pthread_mutex_unlock(&g_wd.mu);
    if (!stopped) {
        KR_LOG_ERROR("shutdown deadline passed and the process is still running: exiting now");
        _exit(g_exit_code);
    }
    return NULL;
}

/* kr_serve_run is returning: the watchdog, if one runs, ends without acting. */
static void watchdog_stop(void)
{
    if (!g_wd.running) {
        return;
    }
    pthread_mutex_lock(&g_wd.mu);
    g_wd.stop = true;
    pthread_cond_signal(&g_wd.cv);
    pthread_mutex_unlock(&g_wd.mu);
    pthread_join(g_wd.th, NULL);
    g_wd.running = false;
}

/* Starts draining: no new work, a deadline for what is in flight and for the process itself. */
static void begin_drain(struct srv *s, double timeout_s)
{
    s->draining = true;
    g_drain_started = now_s();
    pthread_mutex_lock(&g_wd.mu);
    g_wd.deadline = g_drain_started + timeout_s + CUT_GRACE_S + 2.5;
    g_wd.stop = false;
    pthread_mutex_unlock(&g_wd.mu);
    if (!g_wd.running && pthread_create(&g_wd.th, NULL, watchdog_main, NULL) == 0) {
        g_wd.running = true;
    } else if (!g_wd.running) {
        KR_LOG_WARN("cannot start the shutdown watchdog");
    }
    uv_timer_start(&s->drain_timer, on_drain_tick, 0, 50);
}

static void on_signal(struct srv *s, int signum)
{
    if (s->draining) {
        KR_LOG_WARN("second signal: stopping now");
        cut_all(s, "the server was stopped before this request finished");
        stop_everything(s);
        return;
    }
    KR_LOG_INFO("signal %d: draining (/health answers 503, no new requests; in-flight ones get up to %.0f s)", signum,
                s->o.drain_timeout_s);
    if (!s->ready) {
        /* still loading: nothing is in flight */
        begin_drain(s, 0);
        return;
    }
    begin_drain(s, s->o.drain_timeout_s);
}

/* The loop's side of signal_caught: each signal caught since the last call, in turn. */
static void on_signal_async(uv_async_t *a)
{
    struct srv *s = a->data;
    const int n = atomic_load(&g_sig.count);
    while (s->sig_seen < n && !s->stopping) {
        s->sig_seen++;
        on_signal(s, atomic_load(&g_sig.last));
    }
}

/* The engine lost its device: every request failed with 503; report unhealthy and exit 3 so that
 * the process is restarted. */
static void on_device_failed(struct srv *s)
{
    s->device_failed = true;
    s->exit_code = 3;
    g_exit_code = 3;
    KR_LOG_ERROR("the compute device failed for good: failing every request with 503 and exiting with status 3 "
                 "(restart the process)");
    if (!s->draining) {
        begin_drain(s, 0);
    }
}

/* ---- loading (its own thread: /health answers 503 meanwhile) ------------------------------------------------ */

static uv_async_t g_loaded;

/* Loader thread: loading ended, either way. */
static void loaded(void *user)
{
    (void)user;
    uv_async_send(&g_loaded);
}

static void on_loaded(uv_async_t *a)
{
    struct srv *s = a->data;
    kr_boot_load_join(&s->rt);
    if (s->rt.load_failed) {
        s->exit_code = 1;
        g_exit_code = 1;
        stop_everything(s);
        return;
    }
    if (kr_boot_is_worker(&s->rt)) {
        s->ready = true;
        KR_LOG_INFO("ready: node %d of %d runs its ranks of %s; the leader at %s serves the API", s->o.node_rank,
                    s->o.nnodes, s->o.model_dir, s->o.master_addr);
        return;
    }
    s->env.engine_ctx = s->rt.eng;
    s->env.tok = s->rt.tok;
    s->env.chat = s->rt.chat;
    s->env.tool_format = kr_chat_tool_format(s->rt.chat, s->rt.m->cfg.model_type);
    s->env.grammars = s->rt.grammars;
    s->env.gvocab = s->rt.gvocab;
    s->env.vocab = s->rt.m->cfg.vocab;
    s->env.max_model_len = s->rt.max_model_len;
    s->env.max_bytes_per_token = s->rt.tok ? kr_tokenizer_max_bytes_per_token(s->rt.tok) : 0;
    struct kr_engine_stats est;
    kr_engine_get_stats(s->rt.eng, &est);
    s->env.snapshot_hints = est.snapshots_total > 0; /* a prefix cache that keeps Mamba state snapshots */
    s->ready = true;
    KR_LOG_INFO("ready: serving %s as \"%s\" (max_model_len=%d)", s->o.model_dir, s->model_name, s->rt.max_model_len);
}

/* ---- a worker node: its loop ended (boot.h) --------------------------------------------------------------- */

static uv_async_t g_node_end;

/* The worker's loop thread: the group ended, either way. */
static void node_ended(void *user)
{
    (void)user;
    uv_async_send(&g_node_end);
}

/* The leader shut the group down (exit 0), or the group failed or the leader went away (exit 3, for
 * an orchestrator to restart the group). */
static void on_node_end(uv_async_t *a)
{
    struct srv *s = a->data;
    if (!atomic_load(&s->rt.node_done)) {
        return;
    }
    if (s->rt.node_st == KR_OK) {
        KR_LOG_INFO("the leader shut the group down: exiting");
    } else {
        KR_LOG_ERROR("the group of nodes failed: %s; exiting with status 3", s->rt.node_err.msg);
        s->exit_code = 3;
        g_exit_code = 3;
    }
    stop_everything(s);
}

static void close_cb(uv_handle_t *h)
{
    (void)h;
}

static void on_reserve(uv_poll_t *p, int status, int events)
{
    (void)p;
    (void)status;
    (void)events;
}

/* libuv grows its table of watched descriptors when a descriptor above all earlier ones is watched,
 * and abort()s when that growth cannot be allocated (uv__io_start): a hang-up watch on a new
 * connection would end the process when memory is short. The table is grown once at start-up to
 * the highest descriptor the server can watch (the connection limit and what the process holds
 * besides, or the descriptor limit when lower), by watching a descriptor placed there; it stays
 * open, unwatched, until the end. */
static void reserve_watchers(struct srv *s, unsigned connection_limit)
{
    s->reserve_fd = -1;
    int top = (int)connection_limit + 64;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < (rlim_t)top) {
        top = (int)rl.rlim_cur;
    }
    const int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd < 0) {
        return;
    }
    const int fd = fcntl(efd, F_DUPFD_CLOEXEC, top - 1); /* the lowest free descriptor from top - 1 */
    close(efd);
    if (fd < 0) {
        KR_LOG_WARN("cannot reserve libuv's watcher table (descriptor %d): %s", top - 1, strerror(errno));
        return;
    }
    if (uv_poll_init(&s->loop, &s->reserve, fd) != 0) {
        close(fd);
        return;
    }
    if (uv_poll_start(&s->reserve, UV_READABLE, on_reserve) == 0) {
        uv_poll_stop(&s->reserve);
    }
    s->reserve_fd = fd;
}

/* Releases what kr_serve_run took before it started serving. */
static int start_failed(struct srv *s, bool loop, int code)
{
    if (loop) {
        uv_loop_close(&s->loop);
        pthread_mutex_destroy(&s->qmu);
    }
    kr_boot_free(&s->rt);
    kr_free(s->model_name);
    kr_free(s);
    return code;
}

int kr_serve_run(const struct kr_serve_opts *o)
{
    /* the address first, so that a bad --host costs nothing to undo. IPv4 or IPv6 (brackets
     * optional); "::" also accepts IPv4 where the system allows dual stack */
    struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons((uint16_t)o->port)};
    struct sockaddr_in6 a6 = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)o->port)};
    char host6[64] = "";
    const size_t hl = strlen(o->host);
    if (hl >= 2 && hl < sizeof host6 + 2 && o->host[0] == '[' && o->host[hl - 1] == ']') {
        memcpy(host6, o->host + 1, hl - 2);
        host6[hl - 2] = 0;
    } else {
        snprintf(host6, sizeof host6, "%s", o->host);
    }
    struct sockaddr *addr = NULL;
    unsigned int flags = MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    if (inet_pton(AF_INET, o->host, &a4.sin_addr) == 1) {
        addr = (struct sockaddr *)&a4;
    } else if (inet_pton(AF_INET6, host6, &a6.sin6_addr) == 1) {
        addr = (struct sockaddr *)&a6;
        flags |= IN6_IS_ADDR_UNSPECIFIED(&a6.sin6_addr) ? MHD_USE_DUAL_STACK : MHD_USE_IPv6;
    } else {
        KR_LOG_ERROR("--host %s is not an IPv4 or IPv6 address", o->host);
        return 2;
    }
    const int bad = kr_boot_check(o);
    if (bad) {
        return bad;
    }
    struct srv *s = kr_calloc(1, sizeof *s);
    if (!s) {
        KR_LOG_ERROR("out of memory at start-up");
        return 1;
    }
    s->o = *o;
    s->exit_code = 0;
    g_exit_code = 0;
    kr_metrics_init(&s->met);
    s->started = (int64_t)time(NULL);
    s->model_name = kr_strdup(o->served_model_name ? o->served_model_name : o->model_dir);
    struct kr_err berr = {0};
    if (kr_boot_init(&s->rt, o, &berr) != KR_OK) {
        KR_LOG_ERROR("cannot start the compute backend: %s", berr.msg);
        return start_failed(s, false, 2);
    }
    KR_LOG_INFO("backend: %s", kr_backend_name(s->rt.be));
    if (!s->model_name || uv_loop_init(&s->loop) != 0) {
        KR_LOG_ERROR("out of memory at start-up");
        return start_failed(s, false, 1);
    }
    pthread_mutex_init(&s->qmu, NULL);
    s->env = (struct kr_sess_env){.engine = &kr_sess_engine_krait,
                                  .max_request_memory = o->max_request_memory,
                                  .model_name = s->model_name,
                                  .return_tokens_as_token_ids = o->return_tokens_as_token_ids,
                                  .met = &s->met,
                                  .post = post_event,
                                  .post_user = s};
    /* every connection is a descriptor: more than the process may open would fail in accept(2) */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        (rlim_t)s->o.max_connections + 64 > rl.rlim_cur) {
        const int fit = rl.rlim_cur > 64 + 16 ? (int)(rl.rlim_cur - 64) : 16;
        KR_LOG_WARN("--max-connections %d does not fit the process's descriptor limit (ulimit -n %llu): using %d",
                    s->o.max_connections, (unsigned long long)rl.rlim_cur, fit);
        s->o.max_connections = fit;
    }
    o = &s->o;
    /* three quarters of the connections at most may wait for a request (conns.h): the rest stay
     * for connections with a request in progress */
    kr_conns_init(&s->conns, o->max_connections - o->max_connections / 4, o->header_timeout_s, o->body_timeout_s);
    s->conns.door = on_door;
    s->conns.door_user = s;
    s->body_pool_max = 4 * o->max_body_bytes;
    s->d = MHD_start_daemon(flags, (uint16_t)o->port, on_accept, s, on_access, s, MHD_OPTION_EXTERNAL_LOGGER, mhd_logger,
                            s, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
                            MHD_OPTION_SOCK_ADDR, addr, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)600,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned int)o->max_connections,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned int)o->max_connections_per_ip, MHD_OPTION_END);
    const unsigned connection_limit = (unsigned)o->max_connections;
    if (!s->d) {
        KR_LOG_ERROR("cannot listen on %s:%d: %s", o->host, o->port, strerror(errno));
        return start_failed(s, true, 1);
    }
    reserve_watchers(s, connection_limit);
    const union MHD_DaemonInfo *ei = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_EPOLL_FD);
    const union MHD_DaemonInfo *pi = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    const int port = pi ? pi->port : o->port;
    uv_poll_init(&s->loop, &s->mhd_poll, ei->epoll_fd);
    s->mhd_poll.data = s;
    uv_poll_start(&s->mhd_poll, UV_READABLE, on_mhd_poll);
    uv_timer_init(&s->loop, &s->mhd_timer);
    s->mhd_timer.data = s;
    uv_timer_init(&s->loop, &s->drain_timer);
    s->drain_timer.data = s;
    uv_timer_init(&s->loop, &s->conn_timer);
    s->conn_timer.data = s;
    uv_async_init(&s->loop, &s->wake, on_wake);
    s->wake.data = s;
    s->big_ok = kr_lane_start(&s->big, &s->loop, 2, 10) == 0;
    if (!s->big_ok) {
        KR_LOG_WARN("cannot start the threads for large requests: they share libuv's pool");
    }
    uv_timer_init(&s->loop, &s->trim_timer);
    s->trim_timer.data = s;
    uv_timer_start(&s->trim_timer, on_trim_timer, 2000, 2000);
    uv_unref((uv_handle_t *)&s->trim_timer);
    uv_async_init(&s->loop, &g_loaded, on_loaded);
    g_loaded.data = s;
    uv_async_init(&s->loop, &g_node_end, on_node_end);
    g_node_end.data = s;
    s->rt.node_ended = node_ended;
    uv_async_init(&s->loop, &g_sig.async, on_signal_async);
    g_sig.async.data = s;
    signals_catch();
    signal(SIGPIPE, SIG_IGN);
    KR_LOG_INFO("listening on http://%s:%d", o->host, port);
    if (o->port_file) {
        FILE *fp = fopen(o->port_file, "w");
        if (fp) {
            fprintf(fp, "%d\n", port);
            fclose(fp);
        }
    }
    if (kr_boot_load_start(&s->rt, loaded, s) != KR_OK) {
        KR_LOG_ERROR("cannot start the loader thread");
        s->exit_code = 1;
        stop_everything(s); /* the loop returns at once and the shutdown below releases everything */
    }
    arm_timer(s);
    uv_run(&s->loop, UV_RUN_DEFAULT);

    /* shutdown: close connections (cancelling their work), stop the engine, settle its last events */
    MHD_stop_daemon(s->d);
    s->d = NULL;
    kr_conns_free(&s->conns);
    kr_boot_cancel(&s->rt);    /* a signal while the nodes join: they stop waiting */
    kr_boot_load_join(&s->rt); /* a signal during loading: let the loader finish first */
    if (s->big_ok) {
        kr_lane_stop(&s->big); /* queued preparations cancelled, running ones finished */
    }
    kr_boot_stop_engine(&s->rt);
    s->env.engine_ctx = NULL; /* the last events' sessions cancel nothing more */
    on_wake(&s->wake);
    uv_close((uv_handle_t *)&s->mhd_poll, close_cb);
    uv_close((uv_handle_t *)&s->mhd_timer, close_cb);
    uv_close((uv_handle_t *)&s->drain_timer, close_cb);
    uv_close((uv_handle_t *)&s->conn_timer, close_cb);
    uv_close((uv_handle_t *)&s->trim_timer, close_cb);
    uv_close((uv_handle_t *)&s->wake, close_cb);
    uv_close((uv_handle_t *)&g_loaded, close_cb);
    uv_close((uv_handle_t *)&g_node_end, close_cb);
    signals_release();
    uv_close((uv_handle_t *)&g_sig.async, close_cb);
    if (s->reserve_fd >= 0) {
        uv_close((uv_handle_t *)&s->reserve, close_cb);
    }
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
    if (s->reserve_fd >= 0) {
        close(s->reserve_fd);
    }
    kr_boot_free(&s->rt);
    pthread_mutex_destroy(&s->qmu);
    const int code = s->exit_code;
    kr_free(s->model_name);
    kr_free(s);
    watchdog_stop();
    return code;
}
