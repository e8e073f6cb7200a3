/* The HTTP server: libmicrohttpd driven from a libuv loop, the OpenAI routes, and the bridge from
 * engine events (engine thread) to responses (loop thread). */
#include "server.h"

#include "alloc.h"
#include "chat.h"
#include "clock.h"
#include "config.h"
#include "engine.h"
#include "log.h"
#include "metrics.h"
#include "model.h"
#include "openai.h"
#include "stops.h"
#include "tokenizer.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <jansson.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

void kr_serve_opts_default(struct kr_serve_opts *o)
{
    memset(o, 0, sizeof *o);
    o->host = "0.0.0.0";
    o->port = 8000;
    o->max_num_seqs = 256;
    o->max_num_batched_tokens = 2048;
    o->cache_bytes = 0;
    o->device = "auto";
    o->gpu_mem_util = 0.9;
    o->block_size = 16;
    o->max_body_bytes = (size_t)32 << 20;
    o->drain_timeout_s = 30.0;
}

/* ---- structures ---------------------------------------------------------------------------- */

struct hreq;

/* One engine request of an HTTP request (a completions request with several prompts has one per
 * prompt). */
struct sub {
    struct hreq *h;
    int32_t idx;               /* prompt index */
    uint64_t eng_id;
    bool submitted;
    bool live;                 /* the engine still owes events */
    int32_t *prompt;           /* [n_prompt] ids */
    int32_t n_prompt;
    char *prompt_text;         /* for echo */
    size_t prompt_text_len;
    int32_t n_left;            /* choices not finished */
    struct evnode **spare;     /* [n_spare] nodes set aside for the terminal events (FINISH per choice,
                                  ERROR), so that running out of memory can never lose the end of a
                                  request; taken by the engine thread, the rest freed with the request */
    int32_t n_spare;
    atomic_int spare_next;
    atomic_bool lost;          /* an event could not be queued (out of memory): the response says so */
    struct kr_oai_logprob *plp; /* [n_prompt] prompt logprobs (when requested) */
    struct kr_oai_token *plp_top; /* [n_prompt * k] */
    int32_t plp_k;
};

struct choice {
    int32_t index;             /* global choice index */
    struct sub *sub;
    int32_t engine_index;      /* choice index within the engine request */
    char *text;
    size_t len, cap;
    int32_t *ids;
    int32_t n_ids, cap_ids;
    struct kr_oai_logprob *lps;   /* [n_ids] when logprobs were asked */
    struct kr_oai_token *lp_top;  /* [n_ids * k] */
    struct kr_detok *detok;
    bool finished;
    const char *finish;        /* "stop" | "length" */
    char *stop_str;
    int32_t stop_id;
    size_t sent;               /* stream: text bytes sent */
    int32_t lp_sent;           /* stream: logprob entries sent */
    bool first_sent;
    bool final_sent;           /* stream: the chunk with finish_reason went out (once) */
    double t_first, t_last;
};

enum route {
    R_NONE = 0,
    R_COMPLETIONS,
    R_CHAT,
    R_MODELS,
    R_HEALTH,
    R_METRICS,
    R_TOKENIZE,
    R_DETOKENIZE,
    R_VERSION,
};

struct srv;

struct hreq {
    struct srv *s;
    struct MHD_Connection *conn;
    struct hreq *prev, *next;  /* in srv->reqs */
    int refs;                  /* MHD connection + live engine subs */
    enum route route;
    bool is_post;
    char *body;
    size_t blen, bcap;
    bool too_big;
    bool responded;            /* a response was queued (or the stream started) */
    /* generation */
    struct kr_oai_request o;
    bool have_o;
    enum { PREP_NONE = 0, PREP_RUNNING, PREP_DONE, PREP_STARTED } prep_state;
    bool prep_failed;
    uv_work_t work;
    char *def_body;            /* a worker's finished JSON answer (malloc'd), sent by the loop */
    char id[48];
    int64_t created;
    int32_t n_sub;
    struct sub *subs;
    int32_t n_choices;
    struct choice *ch;
    struct kr_stops stops;     /* the request's stop strings */
    bool stream;
    bool done;                 /* every choice finished, or failed */
    bool failed;
    struct kr_oai_error err;
    bool suspended;            /* non-stream: waiting for the result; stream: the reader parked */
    char *out;                 /* stream buffer */
    size_t out_len, out_cap, out_off;
    bool out_eof;
    double t_arrival;
    uv_poll_t hup;             /* watches the socket for a hang-up while suspended */
    bool hup_active, hup_init;
    bool gone;                 /* the client hung up: never park again, close at the next chance */
    bool cancelled;            /* the engine was told to cancel (once) */
    bool cut;                  /* ended by the shutdown deadline or a failed device: answers 503 */
    unsigned status;           /* HTTP status sent (0: none yet), for the access log */
    char method[8];
    char path[96];
    char peer[64];             /* client address:port */
};

struct evnode {
    struct evnode *next;
    struct sub *sub;
    struct kr_event ev;
    int32_t top_ids[KR_MAX_TOP_LOGPROBS];
    float top_lps[KR_MAX_TOP_LOGPROBS];
    float *plp;
    int32_t *plp_ids;
    float *plp_top;
    char msg[512];
};

struct srv {
    struct kr_serve_opts o;
    uv_loop_t loop;
    struct MHD_Daemon *d;
    uv_poll_t mhd_poll;
    uv_timer_t mhd_timer;
    uv_async_t wake;
    uv_signal_t sig_term, sig_int;
    uv_timer_t drain_timer;
    bool ready;
    bool load_failed;
    bool draining;
    bool cut_done;             /* the drain deadline passed: what was in flight got its 503 */
    double cut_at;
    bool device_failed;        /* the engine reported a lost device: 503 everywhere, exit 3 */
    bool stopping;             /* stop_everything ran */
    bool gone_close;           /* on_access just closed a connection whose client had left (see mhd_logger) */
    int exit_code;
    kr_backend_t be;
    struct kr_model *m;
    struct kr_engine *eng;
    struct kr_tokenizer *tok;
    struct kr_chat *chat;
    char *model_name;
    int32_t max_model_len;
    pthread_t loader;
    bool loader_joined;
    pthread_mutex_t qmu;
    struct evnode *qh, *qt;
    struct hreq *reqs;
    int n_gen;                 /* requests with live engine work */
    struct kr_metrics met;
    int64_t started;
};

static int g_exit_code; /* the process's exit status, for the shutdown watchdog's _exit */

static double now_s(void)
{
    return kr_clock_s();
}

/* ---- responses ------------------------------------------------------------------------------ */

static void count_status(struct srv *s, unsigned status)
{
    int c = status < 300 ? 0 : status == 400 ? 1 : status == 401 ? 2 : status == 404 ? 3 : status == 413 ? 4 : 5;
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
    if (h->id[0]) {
        MHD_add_response_header(r, "X-Request-Id", h->id);
    }
    enum MHD_Result ret = MHD_queue_response(h->conn, status, r);
    MHD_destroy_response(r);
    h->responded = true;
    h->status = status;
    count_status(h->s, status);
    return ret;
}

static enum MHD_Result send_json_str(struct hreq *h, unsigned status, char *json_malloced)
{
    if (!json_malloced) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,"
                                  "\"code\":null}}";
        return send_body(h, 500, "application/json", oom, sizeof oom - 1, NULL);
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

/* The one place where an engine status becomes an HTTP status and an OpenAI error object.
 * `device_failed`: the engine reported a lost device (kr_engine_failed). */
static void engine_error(struct kr_oai_error *e, enum kr_status st, bool device_failed, const char *msg)
{
    switch (st) {
    case KR_ERR_BUSY:
        kr_oai_error_set(e, 429, "rate_limit_error", "", "queue_full", "%s", msg);
        return;
    case KR_ERR_TOO_LONG:
        kr_oai_error_set(e, 400, "invalid_request_error", "max_tokens", "context_length_exceeded", "%s", msg);
        return;
    case KR_ERR_INVAL:
        kr_oai_error_set(e, 400, "invalid_request_error", "", "", "%s", msg);
        return;
    case KR_ERR_CUDA:
        if (device_failed) {
            kr_oai_error_set(e, 503, "service_unavailable", "", "", "%s", msg);
            return;
        }
        break;
    default:
        break;
    }
    kr_oai_error_set(e, 500, "server_error", "", "", "%s", msg[0] ? msg : kr_status_str(st));
}

static enum MHD_Result send_simple_error(struct hreq *h, int status, const char *type, const char *param,
                                         const char *code, const char *msg)
{
    struct kr_oai_error e;
    kr_oai_error_set(&e, status, type, param, code, "%s", msg);
    return send_error(h, &e);
}

/* ---- request lifetime ------------------------------------------------------------------------ */

static void hup_close_cb(uv_handle_t *hd)
{
    struct hreq *h = hd->data;
    h->hup_init = false;
    kr_free(h);
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
    for (int32_t i = 0; i < h->n_choices; i++) {
        struct choice *c = &h->ch[i];
        kr_free(c->text);
        kr_free(c->ids);
        kr_free(c->stop_str);
        if (c->lps) {
            for (int32_t k = 0; k < c->n_ids; k++) {
                kr_free((void *)c->lps[k].tok.text);
            }
            const int32_t tk = h->o.sampling.logprobs;
            for (int32_t k = 0; k < c->n_ids * tk; k++) {
                kr_free((void *)c->lp_top[k].text);
            }
        }
        kr_free(c->lps);
        kr_free(c->lp_top);
        kr_detok_destroy(c->detok);
    }
    for (int32_t i = 0; i < h->n_sub; i++) {
        struct sub *sb = &h->subs[i];
        kr_free(sb->prompt);
        kr_free(sb->prompt_text);
        if (sb->plp) {
            for (int32_t k = 0; k < sb->n_prompt; k++) {
                kr_free((void *)sb->plp[k].tok.text);
            }
            for (int32_t k = 0; k < sb->n_prompt * sb->plp_k; k++) {
                kr_free((void *)sb->plp_top[k].text);
            }
        }
        kr_free(sb->plp);
        kr_free(sb->plp_top);
        const int32_t used = atomic_load(&sb->spare_next);
        for (int32_t k = used < sb->n_spare ? used : sb->n_spare; k < sb->n_spare; k++) {
            kr_free(sb->spare[k]);
        }
        kr_free(sb->spare);
    }
    kr_free(h->ch);
    kr_free(h->subs);
    kr_free(h->body);
    kr_free(h->out);
    kr_oai_free(h->def_body);
    if (h->have_o) {
        kr_oai_request_free(&h->o);
    }
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

/* Cancels whatever the engine still does for h (client gone, shutdown). Before the request
 * started (its preparation may still be running on a worker) there is nothing to cancel, and its
 * sub-requests must not be read. */
static void hreq_cancel(struct hreq *h)
{
    if (h->prep_state != PREP_STARTED || h->cancelled) {
        return;
    }
    h->cancelled = true; /* once: a cancellation is final, repeating it would only queue duplicates */
    for (int32_t i = 0; i < h->n_sub; i++) {
        if (h->subs[i].live) {
            kr_engine_cancel(h->s->eng, h->subs[i].eng_id);
        }
    }
}

/* ---- text of tokens -------------------------------------------------------------------------- */

/* The text a logprobs entry shows for `id`: its decoded piece, or "token_id:N" when asked for (or
 * without a tokenizer). kr_malloc'd. */
static char *token_text(struct srv *s, int32_t id, size_t *len)
{
    if (!s->tok || s->o.return_tokens_as_token_ids) {
        char buf[32];
        int n = snprintf(buf, sizeof buf, "token_id:%d", id);
        *len = (size_t)n;
        return kr_strndup(buf, (size_t)n);
    }
    char *text = NULL;
    if (kr_tokenizer_decode(s->tok, &id, 1, false, &text, len, NULL) != KR_OK) {
        *len = 0;
        return kr_strdup("");
    }
    return text;
}

static void fill_token(struct srv *s, struct kr_oai_token *t, int32_t id, float lp)
{
    size_t len = 0;
    char *text = token_text(s, id, &len);
    t->text = text ? text : "";
    t->text_len = text ? len : 0;
    t->bytes = (const unsigned char *)t->text;
    t->n_bytes = t->text_len;
    t->logprob = lp;
}

static bool buf_append(char **p, size_t *len, size_t *cap, const char *src, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t nc = (*len + n + 1) * 2;
        char *np = kr_realloc(*p, nc);
        if (!np) {
            return false;
        }
        *p = np;
        *cap = nc;
    }
    memcpy(*p + *len, src, n);
    *len += n;
    (*p)[*len] = 0;
    return true;
}

static bool out_append(struct hreq *h, char *chunk_malloced)
{
    if (!chunk_malloced) {
        return false;
    }
    bool ok = buf_append(&h->out, &h->out_len, &h->out_cap, chunk_malloced, strlen(chunk_malloced));
    kr_oai_free(chunk_malloced);
    return ok;
}

/* ---- streaming output ----------------------------------------------------------------------------- */

static void choice_view(struct hreq *h, struct choice *c, struct kr_oai_choice *v)
{
    memset(v, 0, sizeof *v);
    v->index = c->index;
    v->text = c->text ? c->text : "";
    v->text_len = c->len;
    v->token_ids = c->ids;
    v->n_tokens = c->n_ids;
    v->logprobs = c->lps;
    v->n_logprobs = c->lps ? c->n_ids : 0;
    v->finish_reason = c->finished ? c->finish : NULL;
    v->stop_reason_str = c->stop_str;
    v->stop_reason_id = c->stop_id;
}

/* Bytes of c's text that may be sent now (see kr_stops_sendable). */
static size_t sendable(const struct hreq *h, const struct choice *c)
{
    return kr_stops_sendable(&h->stops, c->text, c->len, c->sent, c->finished);
}

static void stream_choice(struct hreq *h, struct choice *c)
{
    struct srv *s = h->s;
    if (h->out_eof || c->final_sent) {
        return; /* the stream already ended (cut by the shutdown deadline), or this choice did: a stop
                   string finishes it before the engine's FINISH of the cancelled choice arrives */
    }
    const size_t upto = sendable(h, c);
    const bool new_text = upto > c->sent, new_lp = c->lps && c->lp_sent < c->n_ids;
    const bool final = c->finished;
    if (!new_text && !new_lp && !final && c->first_sent) {
        return;
    }
    struct kr_oai_choice d;
    choice_view(h, c, &d);
    char *echo = NULL;
    size_t echo_len = 0;
    if (!c->first_sent && h->o.echo && h->route == R_COMPLETIONS && c->sub->prompt_text) {
        echo = c->sub->prompt_text;
        echo_len = c->sub->prompt_text_len;
    }
    char *tmp = NULL;
    if (echo) {
        tmp = kr_malloc(echo_len + (upto - c->sent) + 1);
        if (!tmp) {
            return;
        }
        memcpy(tmp, echo, echo_len);
        memcpy(tmp + echo_len, c->text + c->sent, upto - c->sent);
        tmp[echo_len + upto - c->sent] = 0;
        d.text = tmp;
        d.text_len = echo_len + upto - c->sent;
    } else {
        d.text = c->text ? c->text + c->sent : "";
        d.text_len = upto - c->sent;
    }
    d.token_ids = c->ids + c->lp_sent;
    d.n_tokens = c->n_ids - c->lp_sent;
    d.logprobs = c->lps ? c->lps + c->lp_sent : NULL;
    d.n_logprobs = c->lps ? c->n_ids - c->lp_sent : 0;
    d.finish_reason = final ? c->finish : NULL;
    /* completions logprobs text_offset continues from the code points already streamed */
    const int64_t off = (int64_t)(c->first_sent && echo_len == 0 ? kr_oai_utf8_count(c->text, c->sent) : 0) +
                        (int64_t)(c->first_sent && h->o.echo && c->sub->prompt_text
                                      ? kr_oai_utf8_count(c->sub->prompt_text, c->sub->prompt_text_len)
                                      : 0);
    char *chunk = h->route == R_CHAT ? kr_oai_chat_chunk(h->id, h->created, s->model_name, &d, !c->first_sent)
                                     : kr_oai_completion_chunk_at(h->id, h->created, s->model_name, &d, off);
    kr_free(tmp);
    if (out_append(h, chunk)) {
        c->sent = upto;
        c->lp_sent = c->n_ids;
        c->first_sent = true;
        c->final_sent = final;
    }
}

static void stream_finish(struct hreq *h)
{
    struct srv *s = h->s;
    if (h->failed) {
        char *e = kr_oai_error_json(&h->err);
        if (e) {
            buf_append(&h->out, &h->out_len, &h->out_cap, "data: ", 6);
            buf_append(&h->out, &h->out_len, &h->out_cap, e, strlen(e));
            buf_append(&h->out, &h->out_len, &h->out_cap, "\n\n", 2);
            kr_oai_free(e);
        }
    } else if (h->o.include_usage) {
        struct kr_oai_usage u = {0};
        for (int32_t i = 0; i < h->n_sub; i++) {
            u.prompt_tokens += h->subs[i].n_prompt;
        }
        for (int32_t i = 0; i < h->n_choices; i++) {
            u.completion_tokens += h->ch[i].n_ids;
        }
        out_append(h, kr_oai_usage_chunk(h->id, h->created, s->model_name, h->route == R_CHAT, &u));
    }
    buf_append(&h->out, &h->out_len, &h->out_cap, "data: [DONE]\n\n", 14);
    h->out_eof = true;
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

/* ---- engine events (engine thread -> loop thread) ------------------------------------------------ */

/* Engine thread: copies the event (its arrays are only borrowed) and wakes the loop. Never blocks
 * beyond a short mutex. */
static void on_engine_event(const struct kr_event *ev, void *user)
{
    struct sub *sb = user;
    struct srv *s = sb->h->s;
    struct evnode *n = kr_calloc(1, sizeof *n);
    if (!n && (ev->type == KR_EVENT_FINISH || ev->type == KR_EVENT_ERROR)) {
        const int32_t i = atomic_fetch_add(&sb->spare_next, 1);
        n = i < sb->n_spare ? sb->spare[i] : NULL;
    }
    if (!n) {
        atomic_store(&sb->lost, true);
        KR_LOG_ERROR("out of memory queueing an engine event; the response will report it");
        return;
    }
    n->sub = sb;
    n->ev = *ev;
    if (ev->type == KR_EVENT_TOKEN && ev->n_top > 0) {
        memcpy(n->top_ids, ev->top_ids, (size_t)ev->n_top * sizeof(int32_t));
        memcpy(n->top_lps, ev->top_logprobs, (size_t)ev->n_top * sizeof(float));
    }
    n->ev.top_ids = n->top_ids;
    n->ev.top_logprobs = n->top_lps;
    if (ev->type == KR_EVENT_PROMPT_LOGPROBS) {
        const size_t np = (size_t)ev->n_prompt, k = (size_t)ev->prompt_top_k;
        n->plp = kr_malloc(np * sizeof(float));
        n->plp_ids = kr_malloc(np * (k ? k : 1) * sizeof(int32_t));
        n->plp_top = kr_malloc(np * (k ? k : 1) * sizeof(float));
        if (!n->plp || !n->plp_ids || !n->plp_top) {
            atomic_store(&sb->lost, true);
        } else {
            memcpy(n->plp, ev->prompt_logprobs, np * sizeof(float));
            if (k) {
                memcpy(n->plp_ids, ev->prompt_top_ids, np * k * sizeof(int32_t));
                memcpy(n->plp_top, ev->prompt_top_logprobs, np * k * sizeof(float));
            }
        }
    }
    if (ev->type == KR_EVENT_ERROR) {
        snprintf(n->msg, sizeof n->msg, "%s", ev->message ? ev->message : kr_status_str(ev->status));
        n->ev.message = n->msg;
    }
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

static void free_node(struct evnode *n)
{
    kr_free(n->plp);
    kr_free(n->plp_ids);
    kr_free(n->plp_top);
    kr_free(n);
}

/* Checks the text appended to c since byte `from` for a stop string; on a match truncates the
 * text there. */
static bool check_stop(struct hreq *h, struct choice *c, size_t from)
{
    size_t at = 0;
    const int32_t i = kr_stops_find(&h->stops, c->text, c->len, from, &at);
    if (i < 0) {
        return false;
    }
    c->len = at;
    c->text[at] = 0;
    c->stop_str = kr_strdup(h->o.stop[i]);
    return true;
}

static void finish_choice(struct hreq *h, struct choice *c, const char *why)
{
    if (c->finished) {
        return;
    }
    if (c->detok) {
        const char *piece = NULL;
        size_t plen = 0;
        if (kr_detok_flush(c->detok, &piece, &plen, NULL) == KR_OK && plen) {
            const size_t before = c->len;
            buf_append(&c->text, &c->len, &c->cap, piece, plen);
            if (check_stop(h, c, before)) {
                why = "stop";
            }
        }
    }
    c->finished = true;
    c->finish = why;
    struct srv *s = h->s;
    s->met.requests_ok[!strcmp(why, "stop") ? 0 : !strcmp(why, "length") ? 1 : 2]++;
}

static void sub_done(struct hreq *h, struct sub *sb)
{
    if (!sb->live) {
        return;
    }
    sb->live = false;
    bool all = true;
    for (int32_t i = 0; i < h->n_sub; i++) {
        all &= !h->subs[i].live;
    }
    if (all) {
        h->done = true;
        h->s->n_gen--;
        kr_hist_observe(&h->s->met.e2e, now_s() - h->t_arrival);
    }
}

static void process_event(struct srv *s, struct evnode *n)
{
    struct sub *sb = n->sub;
    struct hreq *h = sb->h;
    const struct kr_event *ev = &n->ev;
    const double t = now_s();
    switch (ev->type) {
    case KR_EVENT_PROMPT_LOGPROBS: {
        if (!n->plp || sb->plp) {
            break;
        }
        const int32_t k = ev->prompt_top_k;
        sb->plp = kr_calloc((size_t)sb->n_prompt, sizeof *sb->plp);
        sb->plp_top = kr_calloc((size_t)sb->n_prompt * (size_t)(k ? k : 1), sizeof *sb->plp_top);
        if (!sb->plp || !sb->plp_top) {
            break;
        }
        sb->plp_k = k;
        for (int32_t i = 0; i < sb->n_prompt; i++) {
            fill_token(s, &sb->plp[i].tok, sb->prompt[i], n->plp[i]);
            if (i > 0 && k > 0) {
                sb->plp[i].n_top = k;
                sb->plp[i].top = sb->plp_top + (size_t)i * (size_t)k;
                for (int32_t j = 0; j < k; j++) {
                    fill_token(s, &sb->plp_top[(size_t)i * (size_t)k + (size_t)j], n->plp_ids[(size_t)i * (size_t)k + (size_t)j],
                               n->plp_top[(size_t)i * (size_t)k + (size_t)j]);
                }
            }
        }
        break;
    }
    case KR_EVENT_TOKEN: {
        struct choice *c = &h->ch[sb->idx * h->o.n + ev->index];
        if (c->finished) {
            break; /* a stop string already ended it; the engine's cancel is on its way */
        }
        if (c->n_ids == 0) {
            c->t_first = t;
            kr_hist_observe(&s->met.ttft, t - h->t_arrival);
            kr_hist_observe(&s->met.queue, ev->queue_s);
        } else {
            kr_hist_observe(&s->met.itl, t - c->t_last);
        }
        c->t_last = t;
        if (c->n_ids == c->cap_ids) {
            int32_t nc = c->cap_ids ? 2 * c->cap_ids : 32;
            int32_t *ni = kr_realloc(c->ids, (size_t)nc * sizeof(int32_t));
            if (!ni) {
                break;
            }
            c->ids = ni;
            if (h->o.sampling.logprobs >= 0) {
                struct kr_oai_logprob *nl = kr_realloc(c->lps, (size_t)nc * sizeof *nl);
                if (nl) {
                    c->lps = nl;
                }
                const int32_t k = h->o.sampling.logprobs;
                struct kr_oai_token *nt = kr_realloc(c->lp_top, (size_t)nc * (size_t)(k ? k : 1) * sizeof *nt);
                if (nt) {
                    /* the entries so far point into the moved array: point them at its new place */
                    c->lp_top = nt;
                    for (int32_t i = 0; i < c->n_ids; i++) {
                        c->lps[i].top = nt + (size_t)i * (size_t)k;
                    }
                }
                if (!nl || !nt) {
                    break;
                }
            }
            c->cap_ids = nc;
        }
        if (c->lps) {
            const int32_t k = h->o.sampling.logprobs;
            struct kr_oai_logprob *lp = &c->lps[c->n_ids];
            memset(lp, 0, sizeof *lp);
            fill_token(s, &lp->tok, ev->token, ev->logprob);
            lp->n_top = ev->n_top < k ? ev->n_top : k;
            lp->top = c->lp_top + (size_t)c->n_ids * (size_t)k;
            for (int32_t j = 0; j < lp->n_top; j++) {
                fill_token(s, &c->lp_top[(size_t)c->n_ids * (size_t)k + (size_t)j], ev->top_ids[j], ev->top_logprobs[j]);
            }
        }
        c->ids[c->n_ids++] = ev->token;
        if (c->detok) {
            const char *piece = NULL;
            size_t plen = 0;
            if (kr_detok_push(c->detok, ev->token, &piece, &plen, NULL) == KR_OK && plen) {
                const size_t before = c->len;
                buf_append(&c->text, &c->len, &c->cap, piece, plen);
                if (check_stop(h, c, before)) {
                    finish_choice(h, c, "stop");
                    kr_engine_cancel_choice(s->eng, sb->eng_id, ev->index);
                }
            }
        }
        if (h->stream) {
            stream_choice(h, c);
        }
        break;
    }
    case KR_EVENT_FINISH: {
        struct choice *c = &h->ch[sb->idx * h->o.n + ev->index];
        if (atomic_load(&sb->lost) && !h->failed) {
            h->failed = true;
            kr_oai_error_set(&h->err, 500, "server_error", "", "",
                             "the server ran out of memory while producing this response; it is incomplete");
        }
        if (!c->finished) {
            const char *why = ev->finish == KR_FINISH_STOP ? "stop" : ev->finish == KR_FINISH_LENGTH ? "length" : "abort";
            c->stop_id = ev->finish == KR_FINISH_STOP ? ev->stop_token : -1;
            finish_choice(h, c, why);
        }
        if (h->stream) {
            stream_choice(h, c);
        }
        if (--sb->n_left == 0) {
            sub_done(h, sb);
            hreq_unref(h);
            if (h->refs == 0) {
                return; /* the client left and everything is released */
            }
        }
        break;
    }
    case KR_EVENT_ERROR:
        if (!h->failed) {
            h->failed = true;
            const bool lost = ev->status == KR_ERR_CUDA && s->eng && kr_engine_failed(s->eng);
            char msg[600];
            snprintf(msg, sizeof msg, lost ? "%s" : "generation failed: %s", ev->message);
            /* a step that failed is the server's fault (500) whatever its status, unless the device is lost */
            engine_error(&h->err, lost ? KR_ERR_CUDA : KR_ERR_INTERNAL, lost, msg);
        }
        for (int32_t i = 0; i < h->o.n; i++) {
            struct choice *c = &h->ch[sb->idx * h->o.n + i];
            if (!c->finished) {
                finish_choice(h, c, "abort");
            }
        }
        sub_done(h, sb);
        hreq_unref(h);
        if (h->refs == 0) {
            return;
        }
        break;
    }
    if (h->done && h->stream && !h->out_eof) {
        stream_finish(h);
    }
    if (h->stream || h->done) {
        resume(h);
    }
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
    struct evnode *n = s->qh;
    s->qh = s->qt = NULL;
    pthread_mutex_unlock(&s->qmu);
    while (n) {
        struct evnode *next = n->next;
        process_event(s, n);
        free_node(n);
        n = next;
    }
    if (s->eng && !s->device_failed && !s->stopping && kr_engine_failed(s->eng)) {
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
        if (!h->done) {
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
        size_t n = h->out_len - h->out_off < max ? h->out_len - h->out_off : max;
        memcpy(buf, h->out + h->out_off, n);
        h->out_off += n;
        if (h->out_off == h->out_len) {
            h->out_off = h->out_len = 0;
        }
        return (ssize_t)n;
    }
    if (h->out_eof) {
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

static enum MHD_Result submit_all(struct hreq *h)
{
    struct srv *s = h->s;
    for (int32_t i = 0; i < h->n_sub; i++) {
        struct sub *sb = &h->subs[i];
        struct kr_request_params p = {.prompt = sb->prompt, .n_prompt = sb->n_prompt, .n = h->o.n,
                                      .sampling = h->o.sampling, .cb = on_engine_event, .user = sb};
        struct kr_err err = {{0}};
        enum kr_status st = KR_OK;
        sb->spare = kr_calloc((size_t)h->o.n + 1, sizeof *sb->spare);
        for (int32_t k = 0; sb->spare && k <= h->o.n; k++) {
            if (!(sb->spare[k] = kr_calloc(1, sizeof **sb->spare))) {
                break;
            }
            sb->n_spare = k + 1;
        }
        if (!sb->spare || sb->n_spare != h->o.n + 1) {
            st = KR_ERR_NOMEM;
            snprintf(err.msg, sizeof err.msg, "out of memory");
        } else {
            st = kr_engine_submit(s->eng, &p, &sb->eng_id, &err);
        }
        if (st != KR_OK) {
            hreq_cancel(h); /* the prompts already queued */
            struct kr_oai_error e;
            engine_error(&e, st, st == KR_ERR_CUDA && kr_engine_failed(s->eng), err.msg);
            if (i > 0) {
                /* the earlier prompts hold references and will finish as cancelled */
                h->failed = true;
                h->err = e;
            }
            return send_error(h, &e);
        }
        sb->submitted = true;
        sb->live = true;
        sb->n_left = h->o.n;
        h->refs++;
    }
    s->n_gen++;
    if (h->stream) {
        struct MHD_Response *r =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, h, stream_reader_free);
        if (!r) {
            hreq_cancel(h);
            return MHD_NO;
        }
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        MHD_add_response_header(r, "X-Request-Id", h->id);
        enum MHD_Result ret = MHD_queue_response(h->conn, 200, r);
        MHD_destroy_response(r);
        h->responded = true;
        h->status = 200;
        count_status(s, 200);
        return ret;
    }
    park(h);
    return MHD_YES;
}

/* Tokenizes text with the loaded tokenizer into sub's prompt. */
static bool tokenize_into(struct hreq *h, struct sub *sb, const char *text, size_t len, bool add_special,
                          struct kr_oai_error *e, const char *param)
{
    struct srv *s = h->s;
    if (!s->tok) {
        kr_oai_error_set(e, 400, "invalid_request_error", param, "",
                         "text prompts need a tokenizer; this server runs with --skip-tokenizer-init: send token ids");
        return false;
    }
    int32_t *ids = NULL;
    int64_t n = 0;
    struct kr_err err = {{0}};
    if (kr_tokenizer_encode(s->tok, text, len, add_special, &ids, &n, &err) != KR_OK) {
        kr_oai_error_set(e, 400, "invalid_request_error", param, "", "cannot tokenize: %s", err.msg);
        return false;
    }
    sb->prompt = ids;
    sb->n_prompt = (int32_t)n;
    return true;
}

static enum kr_status prep_fail(struct hreq *h, const struct kr_oai_error *e)
{
    h->err = *e;
    return KR_ERR_INVAL;
}

static enum kr_status prep_oom(struct hreq *h)
{
    kr_oai_error_set(&h->err, 500, "server_error", "", "", "out of memory");
    return KR_ERR_NOMEM;
}

/* Worker-thread half of a generation request: parsing, the chat template and tokenization, all of
 * which may take long for big prompts and must not run on the loop. Touches only h and the
 * immutable server state (model config, tokenizer, template). Errors land in h->err. */
static enum kr_status prepare(struct hreq *h)
{
    struct srv *s = h->s;
    struct kr_oai_error e;
    const enum kr_oai_kind kind = h->route == R_CHAT ? KR_OAI_CHAT : KR_OAI_COMPLETIONS;
    if (kr_oai_parse(kind, h->body ? h->body : "", h->blen, &h->o, &e) != KR_OK) {
        return prep_fail(h, &e);
    }
    h->have_o = true;
    if (h->o.model && strcmp(h->o.model, s->model_name) != 0) {
        kr_oai_error_set(&e, 404, "not_found_error", "model", "model_not_found",
                         "The model `%s` does not exist; this server serves `%s`", h->o.model, s->model_name);
        return prep_fail(h, &e);
    }
    if (kind == KR_OAI_COMPLETIONS && (int64_t)h->o.n_prompts * h->o.n > 1024) {
        kr_oai_error_set(&e, 400, "invalid_request_error", "prompt", "",
                         "at most 1024 choices per request (%d prompts x n=%d)", h->o.n_prompts, h->o.n);
        return prep_fail(h, &e);
    }
    h->stream = h->o.stream;
    h->n_sub = kind == KR_OAI_CHAT ? 1 : h->o.n_prompts;
    h->subs = kr_calloc((size_t)h->n_sub, sizeof *h->subs);
    if (!h->subs) {
        return prep_oom(h);
    }
    for (int32_t i = 0; i < h->n_sub; i++) {
        struct sub *sb = &h->subs[i];
        sb->h = h;
        sb->idx = i;
        char param[32];
        if (kind == KR_OAI_CHAT) {
            if (!s->tok || !s->chat) {
                kr_oai_error_set(&e, 400, "invalid_request_error", "messages", "",
                                 "chat completions need a tokenizer with a chat template (none is loaded)");
                return prep_fail(h, &e);
            }
            char *text = NULL;
            size_t len = 0;
            if (kr_chat_render(s->chat, h->o.messages, h->o.tools, h->o.add_generation_prompt,
                               h->o.continue_final_message, h->o.chat_template_kwargs, &text, &len, &e) != KR_OK) {
                return prep_fail(h, &e);
            }
            bool ok = tokenize_into(h, sb, text, len, false, &e, "messages");
            kr_free(text);
            if (!ok) {
                return prep_fail(h, &e);
            }
        } else {
            const struct kr_oai_prompt *p = &h->o.prompts[i];
            snprintf(param, sizeof param, h->o.n_prompts > 1 ? "prompt[%d]" : "prompt", i);
            if (p->ids) {
                sb->prompt = kr_malloc((size_t)(p->n_ids ? p->n_ids : 1) * sizeof(int32_t));
                if (!sb->prompt) {
                    return prep_oom(h);
                }
                memcpy(sb->prompt, p->ids, (size_t)p->n_ids * sizeof(int32_t));
                sb->n_prompt = p->n_ids;
                for (int32_t k = 0; k < p->n_ids; k++) {
                    if (p->ids[k] < 0 || p->ids[k] >= s->m->cfg.vocab) {
                        kr_oai_error_set(&e, 400, "invalid_request_error", param, "",
                                         "token id %d is outside the vocabulary [0, %lld)", p->ids[k],
                                         (long long)s->m->cfg.vocab);
                        return prep_fail(h, &e);
                    }
                }
                if (h->o.echo && s->tok) {
                    kr_tokenizer_decode(s->tok, p->ids, p->n_ids, false, &sb->prompt_text, &sb->prompt_text_len, NULL);
                }
            } else {
                if (!tokenize_into(h, sb, p->text, p->text_len, true, &e, param)) {
                    return prep_fail(h, &e);
                }
                sb->prompt_text = kr_strndup(p->text, p->text_len);
                sb->prompt_text_len = p->text_len;
            }
        }
        if (sb->n_prompt == 0) {
            kr_oai_error_set(&e, 400, "invalid_request_error", kind == KR_OAI_CHAT ? "messages" : "prompt", "",
                             "the prompt is empty after tokenization");
            return prep_fail(h, &e);
        }
        if (sb->n_prompt >= s->max_model_len) {
            kr_oai_error_set(&e, 400, "invalid_request_error", kind == KR_OAI_CHAT ? "messages" : "prompt",
                             "context_length_exceeded",
                             "This model's maximum context length is %d tokens. However, your request has %d input "
                             "tokens. Please reduce the length of the input.",
                             s->max_model_len, sb->n_prompt);
            return prep_fail(h, &e);
        }
    }
    if (!h->o.max_tokens_given && kind == KR_OAI_CHAT) {
        h->o.sampling.max_tokens = s->max_model_len - h->subs[0].n_prompt;
    }
    for (int32_t i = 0; i < h->n_sub; i++) {
        const int64_t total = (int64_t)h->subs[i].n_prompt + h->o.sampling.max_tokens; /* no 32-bit overflow */
        if (total > s->max_model_len) {
            kr_oai_error_set(&e, 400, "invalid_request_error", "max_tokens", "context_length_exceeded",
                             "This model's maximum context length is %d tokens. However, you requested %lld tokens "
                             "(%d in the messages, %d in the completion). Please reduce the length of the messages or "
                             "completion.",
                             s->max_model_len, (long long)total, h->subs[i].n_prompt, h->o.sampling.max_tokens);
            return prep_fail(h, &e);
        }
    }
    return KR_OK;
}

/* Loop half: choices, detokenizers, submission. */
static enum MHD_Result start_generation(struct hreq *h)
{
    struct srv *s = h->s;
    const enum kr_oai_kind kind = h->route == R_CHAT ? KR_OAI_CHAT : KR_OAI_COMPLETIONS;
    static uint64_t counter;
    h->created = (int64_t)time(NULL);
    snprintf(h->id, sizeof h->id, "%s-%llx%06llx", kind == KR_OAI_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)time(NULL), (unsigned long long)(++counter & 0xffffff));
    kr_stops_init(&h->stops, (const char *const *)h->o.stop, h->o.n_stop);
    h->n_choices = h->n_sub * h->o.n;
    h->ch = kr_calloc((size_t)h->n_choices, sizeof *h->ch);
    if (!h->ch) {
        return send_json_str(h, 500, NULL);
    }
    for (int32_t i = 0; i < h->n_choices; i++) {
        struct choice *c = &h->ch[i];
        c->index = i;
        c->sub = &h->subs[i / h->o.n];
        c->engine_index = i % h->o.n;
        c->stop_id = -1;
        if (s->tok && kr_detok_create(s->tok, h->o.skip_special_tokens, &c->detok) != KR_OK) {
            return send_json_str(h, 500, NULL);
        }
        if (h->o.sampling.logprobs >= 0) {
            c->cap_ids = 32;
            c->ids = kr_malloc(32 * sizeof(int32_t));
            c->lps = kr_malloc(32 * sizeof *c->lps);
            c->lp_top = kr_malloc(32 * (size_t)(h->o.sampling.logprobs ? h->o.sampling.logprobs : 1) * sizeof *c->lp_top);
            if (!c->ids || !c->lps || !c->lp_top) {
                return send_json_str(h, 500, NULL);
            }
        }
    }
    if (h->o.echo && h->o.sampling.logprobs >= 0 && h->o.sampling.prompt_logprobs < 0) {
        h->o.sampling.prompt_logprobs = h->o.sampling.logprobs; /* echo + logprobs: OpenAI returns the prompt's */
    }
    return submit_all(h);
}

static int do_tokenize(struct hreq *h);
static int do_detokenize(struct hreq *h);

static void prep_work(uv_work_t *w)
{
    struct hreq *h = w->data;
    if (h->route == R_TOKENIZE) {
        (void)do_tokenize(h);
    } else if (h->route == R_DETOKENIZE) {
        (void)do_detokenize(h);
    } else {
        h->prep_failed = prepare(h) != KR_OK;
    }
}

static void prep_after(uv_work_t *w, int status)
{
    struct hreq *h = w->data;
    (void)status;
    h->prep_state = PREP_DONE;
    if (h->conn) {
        resume(h); /* the access handler answers or submits */
        mhd_kick(h->s);
    }
    hreq_unref(h);
}

/* Parks the connection and prepares the request (or computes the /tokenize answer) on libuv's
 * thread pool. */
static enum MHD_Result handle_generate(struct hreq *h)
{
    h->prep_state = PREP_RUNNING;
    h->work.data = h;
    h->refs++;
    if (uv_queue_work(&h->s->loop, &h->work, prep_work, prep_after) != 0) {
        h->refs--;
        h->prep_state = PREP_NONE;
        return send_simple_error(h, 500, "server_error", "", "", "cannot queue the request");
    }
    park(h);
    return MHD_YES;
}

/* Builds and sends the non-streaming response once every choice has finished. */
static enum MHD_Result send_result(struct hreq *h)
{
    struct srv *s = h->s;
    if (h->failed) {
        return send_error(h, &h->err);
    }
    struct kr_oai_choice *cv = kr_calloc((size_t)h->n_choices, sizeof *cv);
    if (!cv) {
        return send_json_str(h, 500, NULL);
    }
    struct kr_oai_usage u = {0};
    for (int32_t i = 0; i < h->n_sub; i++) {
        u.prompt_tokens += h->subs[i].n_prompt;
    }
    for (int32_t i = 0; i < h->n_choices; i++) {
        choice_view(h, &h->ch[i], &cv[i]);
        u.completion_tokens += h->ch[i].n_ids;
    }
    char *json = NULL;
    if (h->route == R_CHAT) {
        struct kr_oai_completion c = {.id = h->id, .created = h->created, .model = s->model_name, .choices = cv,
                                      .n_choices = h->n_choices, .usage = u,
                                      .prompt_ids = h->subs[0].prompt, .n_prompt_ids = h->subs[0].n_prompt,
                                      .return_token_ids = h->o.return_token_ids || !s->tok};
        json = kr_oai_chat_json(&c);
    } else {
        /* one response for every prompt, each choice with its own prompt's echo and ids */
        struct kr_oai_completion *per = kr_calloc((size_t)h->n_sub, sizeof *per);
        for (int32_t i = 0; per && i < h->n_sub; i++) {
            const struct sub *sb = &h->subs[i];
            per[i] = (struct kr_oai_completion){.prompt_text = h->o.echo ? (sb->prompt_text ? sb->prompt_text : "") : NULL,
                                                .prompt_text_len = h->o.echo ? sb->prompt_text_len : 0,
                                                .prompt_ids = sb->prompt, .n_prompt_ids = sb->n_prompt,
                                                .prompt_logprobs = h->o.echo ? sb->plp : NULL,
                                                .return_token_ids = h->o.return_token_ids || !s->tok};
        }
        if (per) {
            struct kr_oai_completion c = {.id = h->id, .created = h->created, .model = s->model_name, .choices = cv,
                                          .n_choices = h->n_choices, .usage = u, .prompts = per,
                                          .choices_per_prompt = h->o.n};
            json = kr_oai_completion_json(&c);
        }
        kr_free(per);
    }
    kr_free(cv);
    return send_json_str(h, 200, json);
}

/* ---- other routes --------------------------------------------------------------------------------- */

/* /tokenize and /detokenize run on a worker (a big prompt must not stall the loop); their answer
 * waits in h->def_* until the loop sends it. */
static int defer_error(struct hreq *h, const struct kr_oai_error *e)
{
    h->err = *e;
    h->prep_failed = true;
    return -1;
}

static int defer_simple_error(struct hreq *h, int status, const char *type, const char *param, const char *code,
                               const char *msg)
{
    kr_oai_error_set(&h->err, status, type, param, code, "%s", msg);
    h->prep_failed = true;
    return -1;
}

static int defer_oom(struct hreq *h)
{
    return defer_simple_error(h, 500, "server_error", "", "", "out of memory");
}

static int defer_json(struct hreq *h, json_t *j)
{
    h->def_body = j ? json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(9)) : NULL;
    json_decref(j);
    return h->def_body ? 0 : defer_oom(h);
}

static int do_tokenize(struct hreq *h)
{
    struct srv *s = h->s;
    json_error_t je;
    json_t *root = json_loadb(h->body ? h->body : "", h->blen, 0, &je);
    if (!root || !json_is_object(root)) {
        json_decref(root);
        return defer_simple_error(h, 400, "invalid_request_error", "", "", "the body must be a JSON object");
    }
    if (!s->tok) {
        json_decref(root);
        return defer_simple_error(h, 400, "invalid_request_error", "", "", "no tokenizer is loaded (--skip-tokenizer-init)");
    }
    json_t *prompt = json_object_get(root, "prompt"), *messages = json_object_get(root, "messages");
    json_t *ast = json_object_get(root, "add_special_tokens");
    char *text = NULL;
    size_t len = 0;
    bool add_special = true;
    struct kr_oai_error e;
    if (json_is_string(prompt)) {
        text = kr_strndup(json_string_value(prompt), json_string_length(prompt));
        len = json_string_length(prompt);
    } else if (json_is_array(messages)) {
        add_special = false;
        json_t *agp = json_object_get(root, "add_generation_prompt");
        if (!s->chat || kr_chat_render(s->chat, messages, json_object_get(root, "tools"),
                                       agp ? json_is_true(agp) : true, false,
                                       json_object_get(root, "chat_template_kwargs"), &text, &len, &e) != KR_OK) {
            json_decref(root);
            if (!s->chat) {
                return defer_simple_error(h, 400, "invalid_request_error", "messages", "", "no chat template is loaded");
            }
            return defer_error(h, &e);
        }
    } else {
        json_decref(root);
        return defer_simple_error(h, 400, "invalid_request_error", "prompt", "",
                                 "give \"prompt\" (a string) or \"messages\" (a list of chat messages)");
    }
    if (ast) {
        if (!json_is_boolean(ast)) {
            kr_free(text);
            json_decref(root);
            return defer_simple_error(h, 400, "invalid_request_error", "add_special_tokens", "",
                                     "'add_special_tokens' must be a boolean");
        }
        add_special = json_is_true(ast);
    }
    int32_t *ids = NULL;
    int64_t n = 0;
    struct kr_err err = {{0}};
    enum kr_status st = kr_tokenizer_encode(s->tok, text ? text : "", len, add_special, &ids, &n, &err);
    kr_free(text);
    if (st != KR_OK) {
        json_decref(root);
        return defer_simple_error(h, 400, "invalid_request_error", "prompt", "", err.msg);
    }
    json_t *out = json_object(), *arr = json_array(), *strs = NULL;
    const bool want_strs = json_is_true(json_object_get(root, "return_token_strs"));
    if (want_strs) {
        strs = json_array();
    }
    for (int64_t i = 0; i < n; i++) {
        json_array_append_new(arr, json_integer(ids[i]));
        if (strs) {
            size_t pl = 0;
            const char *piece = kr_tokenizer_id_to_piece(s->tok, ids[i], &pl);
            json_array_append_new(strs, piece ? json_stringn(piece, pl) : json_null());
        }
    }
    kr_free(ids);
    json_object_set_new(out, "count", json_integer(n));
    json_object_set_new(out, "max_model_len", json_integer(s->max_model_len));
    json_object_set_new(out, "tokens", arr);
    json_object_set_new(out, "token_strs", strs ? strs : json_null());
    json_decref(root);
    return defer_json(h, out);
}

static int do_detokenize(struct hreq *h)
{
    struct srv *s = h->s;
    json_error_t je;
    json_t *root = json_loadb(h->body ? h->body : "", h->blen, 0, &je);
    json_t *toks = root ? json_object_get(root, "tokens") : NULL;
    if (!json_is_array(toks)) {
        json_decref(root);
        return defer_simple_error(h, 400, "invalid_request_error", "tokens", "", "\"tokens\" must be a list of token ids");
    }
    if (!s->tok) {
        json_decref(root);
        return defer_simple_error(h, 400, "invalid_request_error", "", "", "no tokenizer is loaded (--skip-tokenizer-init)");
    }
    const size_t n = json_array_size(toks);
    int32_t *ids = kr_malloc((n ? n : 1) * sizeof(int32_t));
    for (size_t i = 0; ids && i < n; i++) {
        json_t *v = json_array_get(toks, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= kr_tokenizer_n_vocab(s->tok)) {
            char param[32];
            snprintf(param, sizeof param, "tokens[%zu]", i);
            kr_free(ids);
            json_decref(root);
            return defer_simple_error(h, 400, "invalid_request_error", param, "", "token ids must be integers in the vocabulary");
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    char *text = NULL;
    size_t len = 0;
    enum kr_status st = ids ? kr_tokenizer_decode(s->tok, ids, (int64_t)n, false, &text, &len, NULL) : KR_ERR_NOMEM;
    kr_free(ids);
    json_decref(root);
    if (st != KR_OK) {
        return defer_oom(h);
    }
    json_t *out = json_object();
    json_object_set_new(out, "prompt", json_stringn(text, len));
    kr_free(text);
    return defer_json(h, out);
}

static bool authorized(struct hreq *h)
{
    struct srv *s = h->s;
    if (s->o.n_api_keys == 0) {
        return true;
    }
    const char *a = MHD_lookup_connection_value(h->conn, MHD_HEADER_KIND, "Authorization");
    if (!a || strncasecmp(a, "Bearer ", 7) != 0) {
        return false;
    }
    a += 7;
    for (int i = 0; i < s->o.n_api_keys; i++) {
        const char *k = s->o.api_keys[i];
        const size_t kl = strlen(k), al = strlen(a);
        unsigned diff = (unsigned)(kl ^ al);
        for (size_t j = 0; j < kl; j++) { /* constant time over the key */
            diff |= (unsigned)(k[j] ^ (j < al ? a[j] : 0));
        }
        if (diff == 0) {
            return true;
        }
    }
    return false;
}

static enum MHD_Result dispatch(struct hreq *h, const char *url, const char *method)
{
    struct srv *s = h->s;
    const bool get = !strcmp(method, "GET"), post = !strcmp(method, "POST");
    if (h->too_big) {
        char msg[128];
        snprintf(msg, sizeof msg, "the request body exceeds %zu bytes", s->o.max_body_bytes);
        return send_simple_error(h, 413, "invalid_request_error", "", "request_too_large", msg);
    }
    if (!strcmp(url, "/health") || !strcmp(url, "/ping")) {
        const bool dev_ok = kr_backend_healthy(s->be) && !s->device_failed && !(s->eng && kr_engine_failed(s->eng));
        if (s->ready && !s->draining && dev_ok) {
            return send_body(h, 200, "application/json", "{}", 2, NULL);
        }
        return send_simple_error(h, 503, "service_unavailable", "", "",
                                 !dev_ok ? "the compute device failed; restart the server"
                                 : s->draining ? "the server is shutting down" : "the model is loading");
    }
    if (!strcmp(url, "/metrics") && get) {
        struct kr_engine_stats st = {0};
        if (s->eng) {
            kr_engine_get_stats(s->eng, &st);
        }
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
    const bool v1 = !strncmp(url, "/v1/", 4);
    if (v1 && !authorized(h)) {
        return send_simple_error(h, 401, "authentication_error", "", "invalid_api_key",
                                 "missing or invalid API key (send Authorization: Bearer <key>)");
    }
    const struct {
        const char *url;
        enum route r;
        bool post;
    } routes[] = {
        {"/v1/completions", R_COMPLETIONS, true}, {"/v1/chat/completions", R_CHAT, true},
        {"/v1/models", R_MODELS, false},          {"/tokenize", R_TOKENIZE, true},
        {"/detokenize", R_DETOKENIZE, true},
    };
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        if (strcmp(url, routes[i].url) != 0) {
            continue;
        }
        if (routes[i].post ? !post : !get) {
            return send_simple_error(h, 405, "invalid_request_error", "", "method_not_allowed",
                                     routes[i].post ? "use POST" : "use GET");
        }
        if (!s->ready || s->draining) {
            return send_simple_error(h, 503, "service_unavailable", "", "",
                                     s->device_failed ? "the compute device failed; the server is restarting"
                                     : s->draining    ? "the server is shutting down"
                                                      : "the model is loading");
        }
        h->route = routes[i].r;
        switch (h->route) {
        case R_COMPLETIONS:
        case R_CHAT:
            return handle_generate(h);
        case R_MODELS: {
            char *j = kr_oai_models_json(s->model_name, s->started, s->max_model_len);
            return send_json_str(h, 200, j);
        }
        case R_TOKENIZE:
        case R_DETOKENIZE:
            return handle_generate(h); /* same worker hand-off */
        default:
            break;
        }
    }
    return send_simple_error(h, 404, "not_found_error", "", "", "no such route");
}

/* ---- libmicrohttpd callbacks ------------------------------------------------------------------------- */

static enum MHD_Result on_access(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    struct srv *s = cls;
    struct hreq *h = *con_cls;
    (void)version;
    s->gone_close = false;
    if (!h) { /* headers are in */
        h = kr_calloc(1, sizeof *h);
        if (!h) {
            return MHD_NO;
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
        return MHD_YES;
    }
    if (*upload_size) {
        if (!h->too_big) {
            if (h->blen + *upload_size > s->o.max_body_bytes) {
                h->too_big = true; /* keep reading (and dropping) so the 413 can be sent */
                kr_free(h->body);
                h->body = NULL;
                h->blen = h->bcap = 0;
            } else if (!buf_append(&h->body, &h->blen, &h->bcap, upload, *upload_size)) {
                return MHD_NO;
            }
        }
        *upload_size = 0;
        return MHD_YES;
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
        if (h->prep_failed) {
            return send_error(h, &h->err);
        }
        if (s->cut_done || s->device_failed) {
            /* prepared after the drain deadline or a device failure: never started */
            return send_simple_error(h, 503, "service_unavailable", "", "",
                                     s->device_failed ? "the compute device failed; the server is restarting"
                                                      : "the server shut down before this request could start");
        }
        if (h->route == R_TOKENIZE || h->route == R_DETOKENIZE) {
            char *body = h->def_body;
            h->def_body = NULL;
            return send_json_str(h, 200, body);
        }
        return start_generation(h);
    case PREP_STARTED: /* resumed: the generation is over, or was cut */
        if (h->done || h->cut) {
            return send_result(h);
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
    for (int32_t i = 0; h->subs && i < h->n_sub; i++) {
        prompt += h->subs[i].n_prompt;
    }
    for (int32_t i = 0; h->ch && i < h->n_choices; i++) {
        completion += h->ch[i].n_ids;
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
    struct hreq *h = *con_cls;
    (void)cls;
    (void)conn;
    if (!h) {
        return;
    }
    hup_stop(h);
    h->conn = NULL;
    h->suspended = false;
    const bool early = !h->done && h->prep_state == PREP_STARTED;
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
static void mhd_logger(void *cls, const char *fmt, va_list ap)
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
    uv_timer_stop(&s->drain_timer);
    uv_signal_stop(&s->sig_term);
    uv_signal_stop(&s->sig_int);
    /* the shutdown is under way and bounded (work is cancelled, nothing waits on clients): a further
     * SIGTERM or SIGINT must not kill the process on its way out with a signal status instead of
     * its exit code (uv_signal_stop put back the default action) */
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
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
        if (h->prep_state != PREP_STARTED || h->done || h->cut) {
            continue;
        }
        h->cut = true;
        n++;
        if (!h->failed) {
            h->failed = true;
            kr_oai_error_set(&h->err, 503, "service_unavailable", "", "", "%s", why);
        }
        hreq_cancel(h);
        if (h->stream && h->responded && !h->out_eof) {
            stream_finish(h); /* the error event, then [DONE] */
        }
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
    if (open == 0 && s->n_gen == 0) {
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

static void *watchdog_main(void *arg)
{
    const double deadline = *(const double *)arg;
    for (;;) {
        const double left = deadline - now_s();
        if (left <= 0) {
            break;
        }
        struct timespec ts = {.tv_sec = (time_t)left, .tv_nsec = (long)((left - (double)(time_t)left) * 1e9)};
        nanosleep(&ts, NULL);
    }
    KR_LOG_ERROR("shutdown deadline passed and the process is still running: exiting now");
    _exit(g_exit_code);
}

/* Starts draining: no new work, a deadline for what is in flight and for the process itself. */
static void begin_drain(struct srv *s, double timeout_s)
{
    s->draining = true;
    g_drain_started = now_s();
    static double deadline;
    deadline = g_drain_started + timeout_s + CUT_GRACE_S + 2.5;
    pthread_t wd;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&wd, &at, watchdog_main, &deadline) != 0) {
        KR_LOG_WARN("cannot start the shutdown watchdog");
    }
    pthread_attr_destroy(&at);
    uv_timer_start(&s->drain_timer, on_drain_tick, 0, 50);
}

static void on_signal(uv_signal_t *sig, int signum)
{
    struct srv *s = sig->data;
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

static void progress(void *user, int done, int total)
{
    (void)user;
    if (!isatty(2)) { /* a log, not a terminal: one line at the end */
        if (done == total) {
            KR_LOG_INFO("loaded weights of %d layers", total);
        }
        return;
    }
    const int width = 40, fill = total ? done * width / total : width;
    char bar[64];
    for (int i = 0; i < width; i++) {
        bar[i] = i < fill ? '#' : '.';
    }
    bar[width] = 0;
    fprintf(stderr, "\rloading weights [%s] %3d%%%s", bar, total ? done * 100 / total : 100, done == total ? "\n" : "");
    fflush(stderr);
}

static void *loader_main(void *arg)
{
    struct srv *s = arg;
    struct kr_err err = {{0}};
    enum kr_status st = kr_model_load_progress(s->o.model_dir, s->be, progress, NULL, &s->m, &err);
    if (st == KR_OK && s->o.indexer != KR_INDEXER_AUTO) {
        if ((st = kr_model_set_indexer(s->m, (enum kr_indexer)s->o.indexer, &err)) != KR_OK) {
            kr_model_free(s->m);
            s->m = NULL;
        }
    }
    if (st != KR_OK) {
        KR_LOG_ERROR("cannot load the model: %s", err.msg[0] ? err.msg : kr_status_str(st));
        s->load_failed = true;
        uv_async_send(&g_loaded);
        return NULL;
    }
    if (s->o.max_model_len > s->m->cfg.max_pos && s->o.allow_long_max_model_len) {
        s->m->cfg.max_pos = s->o.max_model_len; /* accepted at start with a warning */
    }
    if (!s->o.skip_tokenizer_init) {
        const char *tdir = s->o.tokenizer_dir ? s->o.tokenizer_dir : s->o.model_dir;
        st = kr_tokenizer_load(tdir, NULL, &s->tok, &err);
        if (st != KR_OK) {
            KR_LOG_ERROR("cannot load the tokenizer from %s: %s (use --skip-tokenizer-init to serve token ids only)",
                         tdir, err.msg);
            s->load_failed = true;
            uv_async_send(&g_loaded);
            return NULL;
        }
        if (kr_chat_load(s->tok, s->o.chat_template_file, &s->chat, &err) != KR_OK) {
            KR_LOG_ERROR("cannot load the chat template: %s", err.msg);
            s->load_failed = true;
            uv_async_send(&g_loaded);
            return NULL;
        }
        if (!s->chat) {
            KR_LOG_WARN("the tokenizer has no chat template: /v1/chat/completions will answer 400");
        }
    }
    struct kr_engine_config cfg;
    kr_engine_config_default(&cfg);
    cfg.max_num_seqs = s->o.max_num_seqs;
    cfg.max_num_batched_tokens = s->o.max_num_batched_tokens;
    cfg.max_queued_requests = s->o.max_queued_requests;
    cfg.max_model_len = s->o.max_model_len;
    cfg.block_size = s->o.block_size;
    cfg.cache_bytes = s->o.cache_bytes;
    /* the step workspace first, so that the cache budget sees what is left */
    const int64_t max_len = s->o.max_model_len > 0 ? s->o.max_model_len : s->m->cfg.max_pos;
    if (kr_model_reserve(s->m, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_num_seqs, max_len,
                         cfg.block_size) != KR_OK) {
        KR_LOG_ERROR("cannot reserve the forward workspace (%d tokens per step)", cfg.max_num_batched_tokens);
        s->load_failed = true;
        uv_async_send(&g_loaded);
        return NULL;
    }
    if (cfg.cache_bytes == 0) {
        size_t free_b = 0, total_b = 0;
        if (kr_backend_mem_info(s->be, &free_b, &total_b) == KR_OK && total_b > 0) {
            const double keep = (1.0 - s->o.gpu_mem_util) * (double)total_b;
            cfg.cache_bytes = (double)free_b > keep + (double)(256u << 20) ? (size_t)((double)free_b - keep)
                                                                          : (size_t)256 << 20;
            KR_LOG_INFO("cache budget %.2f GiB (%.0f%% of %.1f GiB device memory; %.2f GiB free before caches)",
                        (double)cfg.cache_bytes / (1 << 30), s->o.gpu_mem_util * 100, (double)total_b / (1 << 30),
                        (double)free_b / (1 << 30));
        } else {
            cfg.cache_bytes = (size_t)512 << 20;
        }
    }
    if (kr_engine_create(s->m, &cfg, &s->eng, &err) != KR_OK) {
        KR_LOG_ERROR("cannot start the engine: %s", err.msg);
        s->load_failed = true;
        uv_async_send(&g_loaded);
        return NULL;
    }
    s->max_model_len = s->o.max_model_len > 0 && s->o.max_model_len < s->m->cfg.max_pos ? s->o.max_model_len
                                                                                          : (int32_t)s->m->cfg.max_pos;
    uv_async_send(&g_loaded);
    return NULL;
}

static void on_loaded(uv_async_t *a)
{
    struct srv *s = a->data;
    pthread_join(s->loader, NULL);
    s->loader_joined = true;
    if (s->load_failed) {
        s->exit_code = 1;
        stop_everything(s);
        return;
    }
    s->ready = true;
    KR_LOG_INFO("ready: serving %s as \"%s\" (max_model_len=%d)", s->o.model_dir, s->model_name, s->max_model_len);
}

static void close_cb(uv_handle_t *h)
{
    (void)h;
}

/* Releases what kr_serve_run took before it started serving. */
static int start_failed(struct srv *s, bool loop, int code)
{
    if (loop) {
        uv_loop_close(&s->loop);
        pthread_mutex_destroy(&s->qmu);
    }
    kr_backend_free(s->be);
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
    if (o->max_model_len > 0) {
        /* beyond the checkpoint's trained length: refused before anything is loaded, unless asked */
        struct kr_model_config mc;
        struct kr_err cerr = {{0}};
        if (kr_model_config_load(&mc, o->model_dir, &cerr) == KR_OK && o->max_model_len > mc.max_pos) {
            if (!o->allow_long_max_model_len) {
                KR_LOG_ERROR("--max-model-len %d is more than the %lld positions %s/config.json declares "
                             "(max_position_embeddings); lower it, or pass --allow-long-max-model-len to serve "
                             "positions beyond the trained length",
                             o->max_model_len, (long long)mc.max_pos, o->model_dir);
                return 2;
            }
            KR_LOG_WARN("--max-model-len %d is more than the %lld positions the checkpoint was trained for "
                        "(--allow-long-max-model-len): outputs past position %lld may be poor",
                        o->max_model_len, (long long)mc.max_pos, (long long)mc.max_pos);
        }
    }
    struct srv *s = kr_calloc(1, sizeof *s);
    if (!s) {
        return 1;
    }
    s->o = *o;
    s->exit_code = 0;
    kr_metrics_init(&s->met);
    s->started = (int64_t)time(NULL);
    s->model_name = kr_strdup(o->served_model_name ? o->served_model_name : o->model_dir);
    struct kr_err berr = {{0}};
    if (kr_backend_create(o->device, o->threads, &s->be, &berr) != KR_OK) {
        KR_LOG_ERROR("cannot start the compute backend: %s", berr.msg);
        return start_failed(s, false, 2);
    }
    KR_LOG_INFO("backend: %s", kr_backend_name(s->be));
    if (!s->model_name || uv_loop_init(&s->loop) != 0) {
        KR_LOG_ERROR("out of memory at start-up");
        return start_failed(s, false, 1);
    }
    pthread_mutex_init(&s->qmu, NULL);
    s->d = MHD_start_daemon(flags, (uint16_t)o->port, NULL, NULL, on_access, s, MHD_OPTION_EXTERNAL_LOGGER, mhd_logger,
                            s, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_SOCK_ADDR, addr, MHD_OPTION_CONNECTION_TIMEOUT,
                            (unsigned int)600, MHD_OPTION_CONNECTION_LIMIT, (unsigned int)4096, MHD_OPTION_END);
    if (!s->d) {
        KR_LOG_ERROR("cannot listen on %s:%d: %s", o->host, o->port, strerror(errno));
        return start_failed(s, true, 1);
    }
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
    uv_async_init(&s->loop, &s->wake, on_wake);
    s->wake.data = s;
    uv_async_init(&s->loop, &g_loaded, on_loaded);
    g_loaded.data = s;
    uv_signal_init(&s->loop, &s->sig_term);
    s->sig_term.data = s;
    uv_signal_start(&s->sig_term, on_signal, SIGTERM);
    uv_signal_init(&s->loop, &s->sig_int);
    s->sig_int.data = s;
    uv_signal_start(&s->sig_int, on_signal, SIGINT);
    signal(SIGPIPE, SIG_IGN);
    KR_LOG_INFO("listening on http://%s:%d", o->host, port);
    if (o->port_file) {
        FILE *fp = fopen(o->port_file, "w");
        if (fp) {
            fprintf(fp, "%d\n", port);
            fclose(fp);
        }
    }
    if (pthread_create(&s->loader, NULL, loader_main, s) != 0) {
        KR_LOG_ERROR("cannot start the loader thread");
        return 1;
    }
    arm_timer(s);
    uv_run(&s->loop, UV_RUN_DEFAULT);

    /* shutdown: close connections (cancelling their work), stop the engine, settle its last events */
    MHD_stop_daemon(s->d);
    s->d = NULL;
    if (!s->loader_joined) {
        pthread_join(s->loader, NULL); /* a signal during loading: let the loader finish first */
    }
    kr_engine_free(s->eng);
    s->eng = NULL;
    on_wake(&s->wake);
    uv_close((uv_handle_t *)&s->mhd_poll, close_cb);
    uv_close((uv_handle_t *)&s->mhd_timer, close_cb);
    uv_close((uv_handle_t *)&s->drain_timer, close_cb);
    uv_close((uv_handle_t *)&s->wake, close_cb);
    uv_close((uv_handle_t *)&g_loaded, close_cb);
    uv_close((uv_handle_t *)&s->sig_term, close_cb);
    uv_close((uv_handle_t *)&s->sig_int, close_cb);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
    kr_chat_free(s->chat);
    kr_tokenizer_free(s->tok);
    kr_model_free(s->m);
    kr_backend_free(s->be);
    pthread_mutex_destroy(&s->qmu);
    const int code = s->exit_code;
    kr_free(s->model_name);
    kr_free(s);
    return code;
}
