/* One OpenAI request apart from HTTP (session.h): preparation on a worker, submission, engine events
 * into choices (token text, stop strings, logprobs), SSE chunks or one JSON answer, and the
 * /tokenize and /detokenize bodies. */
#include "session.h"

#include "alloc.h"
#include "array.h"
#include "chat.h"
#include "clock.h"
#include "constrain.h"
#include "log.h"
#include "responses.h"
#include "stops.h"
#include "tokenizer.h"
#include "tools.h"

#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- structures ---------------------------------------------------------------------------- */

/* One engine request of a session (a completions request with several prompts has one per
 * prompt). */
struct kr_sess_sub {
    struct kr_sess *s;
    int32_t idx;               /* prompt index */
    uint64_t eng_id;
    bool live;                 /* the engine still owes events */
    int32_t *prompt;           /* [n_prompt] ids */
    int32_t n_prompt;
    int32_t snap_at;           /* chat: where the last user turn begins (a state snapshot is worth
                                  taking there: the next turn resends everything before it), or 0 */
    char *prompt_text;         /* for echo */
    size_t prompt_text_len;
    int32_t n_left;            /* choices not finished */
    struct kr_sess_event **spare; /* [n_spare] nodes set aside for the terminal events (FINISH per
                                     choice, ERROR), so that running out of memory can never lose the
                                     end of a request; taken by the engine thread, the rest freed
                                     with the session */
    int32_t n_spare;
    atomic_int spare_next;
    atomic_bool lost;          /* an event could not be queued (out of memory): the answer says so */
    struct kr_oai_logprob *plp; /* [n_prompt] prompt logprobs (when requested) */
    struct kr_oai_token *plp_top; /* [n_prompt * k] */
    int32_t plp_k;
};

struct choice {
    int32_t index;             /* global choice index */
    struct kr_sess_sub *sub;
    int32_t engine_index;      /* choice index within the engine request */
    char *text;
    size_t len, cap;
    int32_t *ids;
    int32_t n_ids, cap_ids;
    struct kr_oai_logprob *lps;   /* [n_ids] when logprobs were asked */
    struct kr_oai_token *lp_top;  /* [n_ids * k] */
    struct kr_detok *detok;
    bool finished;
    const char *finish;        /* "stop" | "length" | "abort" */
    char *stop_str;
    int32_t stop_id;
    size_t sent;               /* stream: text bytes sent */
    int32_t lp_sent;           /* stream: logprob entries sent */
    bool first_sent;
    bool final_sent;           /* stream: the chunk with finish_reason went out (once) */
    /* tool calls (the session's tools_on): the text parsed so far, each call's id and the bytes of its
     * arguments already streamed, and the finished message's calls */
    struct kr_tool_parse tp;
    struct tcall {
        char id[40];
        bool announced;        /* stream: its first piece (id, name) went out */
        size_t sent;           /* stream: bytes of its arguments that went out */
    } *tc;                     /* [n_tc] */
    int32_t n_tc;
    struct kr_oai_tool_call *tview; /* [tp.n_calls] once finished */
    double t_first, t_last;
};

struct kr_sess {
    struct kr_sess_env *env;
    enum kr_sess_kind kind;    /* KR_SESS_CHAT for a Responses request, with `resp` */
    struct kr_resp *resp;      /* a Responses request: its translation both ways, or NULL */
    int refs;                  /* the transport (until kr_sess_release) + live subs */
    double t_arrival;
    /* preparation (a worker) */
    struct kr_oai_request o;
    bool have_o;
    struct kr_grammar *grammar; /* the compiled output constraint (a reference), or NULL */
    bool tools_on;             /* chat output is parsed for tool calls (env->tool_format) */
    int32_t max_calls;         /* 0: any number; 1 with parallel_tool_calls false */
    bool prep_failed;
    size_t prep_peak;          /* the most memory the preparation held (kr_alloc_limit_end) */
    char *def_body;            /* /tokenize, /detokenize: the answer (jansson's allocator) */
    /* generation (the loop) */
    bool started;              /* kr_sess_start ran */
    char id[48];
    int64_t created;
    int32_t n_sub;
    struct kr_sess_sub *subs;
    int32_t n_choices;
    struct choice *ch;
    struct kr_stops stops;     /* the request's stop strings */
    bool running;              /* counted in env->n_running */
    bool cancelled;            /* the engine was told to cancel (once) */
    bool failed;
    struct kr_oai_error err;
    /* output */
    const struct kr_sess_sink *sink; /* NULL: nobody listens any more */
    void *user;
    bool streaming;            /* stream_begin was called */
    bool ended;                /* done was called (or nobody listens) */
};

/* ---- the engine ------------------------------------------------------------------------------ */

static enum kr_status eng_submit(void *ctx, const struct kr_request_params *p, uint64_t *req_id, struct kr_err *err)
{
    return kr_engine_submit(ctx, p, req_id, err);
}

static void eng_cancel(void *ctx, uint64_t req_id)
{
    if (ctx) {
        kr_engine_cancel(ctx, req_id);
    }
}

static void eng_cancel_choice(void *ctx, uint64_t req_id, int32_t index)
{
    if (ctx) {
        kr_engine_cancel_choice(ctx, req_id, index);
    }
}

static bool eng_failed(void *ctx)
{
    return ctx && kr_engine_failed(ctx);
}

const struct kr_sess_engine_i kr_sess_engine_krait = {
    .submit = eng_submit,
    .cancel = eng_cancel,
    .cancel_choice = eng_cancel_choice,
    .failed = eng_failed,
};

/* The one place where an engine status becomes an error cause (kr_oai_error then gives its HTTP
 * status and OpenAI error object). `device_failed`: the engine reported a lost device
 * (kr_engine_failed). */
static void engine_error(struct kr_oai_error *e, enum kr_status st, bool device_failed, const char *msg,
                         const char *field)
{
    enum kr_oai_cause cause = KR_OAI_INTERNAL;
    const char *param = field ? field : "";
    switch (st) {
    case KR_ERR_BUSY:
        cause = KR_OAI_QUEUE_FULL;
        break;
    case KR_ERR_TOO_LONG:
        cause = KR_OAI_TOO_LONG;
        param = param[0] ? param : "max_tokens";
        break;
    case KR_ERR_INVAL:
        cause = KR_OAI_INVALID;
        break;
    case KR_ERR_CUDA:
        cause = device_failed ? KR_OAI_UNAVAILABLE : KR_OAI_INTERNAL;
        break;
    default:
        break;
    }
    /* an internal error without a message names the status instead */
    kr_oai_error(e, cause, param, "%s", cause == KR_OAI_INTERNAL && !msg[0] ? kr_status_str(st) : msg);
}

/* ---- lifetime -------------------------------------------------------------------------------- */

struct kr_sess *kr_sess_create(struct kr_sess_env *env, enum kr_sess_kind kind, double t_arrival)
{
    struct kr_sess *s = kr_calloc(1, sizeof *s);
    if (!s) {
        return NULL;
    }
    s->env = env;
    s->kind = kind;
    if (kind == KR_SESS_RESPONSES) {
        s->kind = KR_SESS_CHAT;
        s->resp = kr_resp_create();
        if (!s->resp) {
            kr_free(s);
            return NULL;
        }
    }
    s->refs = 1;
    s->t_arrival = t_arrival;
    return s;
}

/* The text of a token whose own could not be allocated: never freed (see free_text). */
static const char no_text[] = "";

static void free_text(const char *t)
{
    if (t != no_text) {
        kr_free((void *)t);
    }
}

atomic_bool kr_sess_trim_wanted;

static void sess_free(struct kr_sess *s)
{
    for (int32_t i = 0; i < s->n_choices; i++) {
        struct choice *c = &s->ch[i];
        kr_free(c->text);
        kr_free(c->ids);
        kr_free(c->stop_str);
        for (int32_t k = 0; c->lps && k < c->n_ids; k++) {
            free_text(c->lps[k].tok.text);
            for (int32_t j = 0; j < c->lps[k].n_top; j++) { /* the alternatives the engine sent, no more */
                free_text(c->lps[k].top[j].text);
            }
        }
        kr_free(c->lps);
        kr_free(c->lp_top);
        kr_detok_destroy(c->detok);
        kr_tool_parse_free(&c->tp);
        kr_free(c->tc);
        kr_free(c->tview);
    }
    for (int32_t i = 0; i < s->n_sub; i++) {
        struct kr_sess_sub *sb = &s->subs[i];
        kr_free(sb->prompt);
        kr_free(sb->prompt_text);
        if (sb->plp) {
            for (int32_t k = 0; k < sb->n_prompt; k++) {
                free_text(sb->plp[k].tok.text);
            }
            for (int32_t k = 0; k < sb->n_prompt * sb->plp_k; k++) {
                free_text(sb->plp_top[k].text);
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
    kr_free(s->ch);
    kr_free(s->subs);
    kr_oai_free(s->def_body);
    if (s->have_o) {
        kr_oai_request_free(&s->o);
    }
    kr_grammar_free(s->grammar);
    kr_resp_free(s->resp);
    const bool big = s->prep_peak > ((size_t)32 << 20);
    kr_free(s);
    if (big) {
        /* a large parse leaves millions of small blocks free in a worker's arena, which glibc keeps
         * resident: the transport hands those pages back (malloc_trim), off the loop thread */
        atomic_store(&kr_sess_trim_wanted, true);
    }
}

static void sess_unref(struct kr_sess *s)
{
    if (--s->refs == 0) {
        sess_free(s);
    }
}

/* Cancels whatever the engine still does for s, once: a cancellation is final, repeating it would
 * only queue duplicates. */
static void cancel_engine(struct kr_sess *s)
{
    if (!s->started || s->cancelled) {
        return;
    }
    s->cancelled = true;
    for (int32_t i = 0; i < s->n_sub; i++) {
        if (s->subs[i].live) {
            s->env->engine->cancel(s->env->engine_ctx, s->subs[i].eng_id);
        }
    }
}

void kr_sess_release(struct kr_sess *s)
{
    if (!s) {
        return;
    }
    cancel_engine(s);
    s->sink = NULL;
    s->ended = true;
    sess_unref(s);
}

const char *kr_sess_id(const struct kr_sess *s)
{
    return s->id;
}

void kr_sess_usage(const struct kr_sess *s, int64_t *prompt_tokens, int64_t *completion_tokens)
{
    int64_t p = 0, c = 0;
    for (int32_t i = 0; s->subs && i < s->n_sub; i++) {
        p += s->subs[i].n_prompt;
    }
    for (int32_t i = 0; s->ch && i < s->n_choices; i++) {
        c += s->ch[i].n_ids;
    }
    *prompt_tokens = p;
    *completion_tokens = c;
}

/* ---- text of tokens -------------------------------------------------------------------------- */

/* The text a logprobs entry shows for `id`: its decoded piece, or "token_id:N" when asked for (or
 * without a tokenizer). kr_malloc'd; NULL when out of memory. */
static char *token_text(const struct kr_sess_env *env, int32_t id, size_t *len)
{
    if (!env->tok || env->return_tokens_as_token_ids) {
        char buf[32];
        int n = snprintf(buf, sizeof buf, "token_id:%d", id);
        *len = (size_t)n;
        return kr_strndup(buf, (size_t)n);
    }
    char *text = NULL;
    if (kr_tokenizer_decode(env->tok, &id, 1, false, &text, len, NULL) != KR_OK) {
        *len = 0;
        return NULL; /* an id the engine produced decodes: only memory can fail */
    }
    return text;
}

/* Fills one logprobs entry. False when its text could not be allocated: the entry then shows ""
 * (no_text) and the caller fails the answer (sess_oom). */
static bool fill_token(const struct kr_sess_env *env, struct kr_oai_token *t, int32_t id, float lp)
{
    size_t len = 0;
    char *text = token_text(env, id, &len);
    t->text = text ? text : no_text;
    t->text_len = text ? len : 0;
    t->bytes = (const unsigned char *)t->text;
    t->n_bytes = t->text_len;
    t->logprob = lp;
    t->id = id;
    return text != NULL;
}

/* ---- output ---------------------------------------------------------------------------------- */

static bool can_emit(const struct kr_sess *s)
{
    return s->sink && !s->ended;
}

/* Memory ran out while the answer was being put together (a token's text, a choice's growth, a
 * stop string, an event the engine thread could not queue): the answer would be wrong without
 * saying so, so it becomes a 500 (a stream: an error event) and the engine's work for it stops. */
static void sess_oom(struct kr_sess *s)
{
    if (!s->failed) {
        s->failed = true;
        kr_oai_error(&s->err, KR_OAI_INTERNAL, "",
                     "the server ran out of memory while producing this response; it is incomplete");
    }
    cancel_engine(s);
}

/* Hands one encoder chunk ("data: {...}\n\n", jansson's allocator, consumed) to the sink as the
 * event's JSON: the transport does the SSE framing. */
static bool emit_chunk(struct kr_sess *s, char *chunk)
{
    if (!chunk) {
        return false;
    }
    const char *json = chunk;
    size_t len = strlen(chunk);
    if (len >= 8 && !strncmp(json, "data: ", 6) && !strcmp(json + len - 2, "\n\n")) {
        json += 6;
        len -= 8;
    }
    const bool ok = s->sink->stream_event(s->user, json, len);
    kr_oai_free(chunk);
    return ok;
}

static void choice_view(struct choice *c, struct kr_oai_choice *v)
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
    if (c->tview) { /* a finished message with tool calls: the text before them is its content */
        v->text_len = c->tp.content_len;
        v->tool_calls = c->tview;
        v->n_tool_calls = c->tp.n_calls;
        v->content_null = c->tp.content_len == 0;
    }
}

/* The ids of c's calls so far (new ones get one). False when out of memory. */
static bool tool_ids(struct choice *c)
{
    if (c->n_tc >= c->tp.n_calls) {
        return true;
    }
    struct tcall *v = kr_realloc(c->tc, (size_t)c->tp.n_calls * sizeof *v);
    if (!v) {
        return false;
    }
    c->tc = v;
    for (; c->n_tc < c->tp.n_calls; c->n_tc++) {
        kr_tool_call_id(v[c->n_tc].id, sizeof v[c->n_tc].id);
        v[c->n_tc].announced = false;
        v[c->n_tc].sent = 0;
    }
    return true;
}

/* Re-parses c's text for tool calls (final once the choice finished). False when out of memory. */
static bool tool_reparse(struct kr_sess *s, struct choice *c, bool final)
{
    struct kr_tool_parse tp;
    if (kr_tool_parse(s->env->tool_format, s->o.tools, c->text, c->len, final, s->max_calls, &tp) != KR_OK) {
        return false;
    }
    kr_tool_parse_free(&c->tp);
    c->tp = tp;
    return tool_ids(c);
}

/* Streams a choice whose text is parsed for tool calls: content up to where a call could begin (and
 * before any stop string), then one chunk per call piece: its first with id, type, name and the
 * arguments so far, later ones with more arguments; the finish_reason in a chunk of its own. */
static void stream_tools(struct kr_sess *s, struct choice *c)
{
    const struct kr_sess_env *env = s->env;
    size_t upto = kr_stops_sendable(&s->stops, c->text, c->len, c->sent, c->finished);
    if (upto > c->tp.content_len) {
        upto = c->tp.content_len > c->sent ? c->tp.content_len : c->sent;
    }
    const bool new_lp = c->lps && c->lp_sent < c->n_ids, new_ids = s->o.return_token_ids && c->lp_sent < c->n_ids;
    struct kr_oai_choice d;
    if (upto > c->sent || new_lp || new_ids) {
        choice_view(c, &d);
        d.tool_calls = NULL;
        d.n_tool_calls = 0;
        d.content_null = false;
        d.text = c->text ? c->text + c->sent : "";
        d.text_len = upto - c->sent;
        d.token_ids = c->ids + c->lp_sent;
        d.n_tokens = c->n_ids - c->lp_sent;
        d.logprobs = c->lps ? c->lps + c->lp_sent : NULL;
        d.n_logprobs = c->lps ? c->n_ids - c->lp_sent : 0;
        d.finish_reason = NULL;
        if (!emit_chunk(s, kr_oai_chat_chunk(s->id, s->created, env->model_name, &d, !c->first_sent))) {
            return;
        }
        c->sent = upto;
        c->lp_sent = c->n_ids;
        c->first_sent = true;
    }
    for (int32_t i = 0; i < c->tp.n_calls && i < c->n_tc; i++) {
        const struct kr_tool_call *k = &c->tp.calls[i];
        struct tcall *t = &c->tc[i];
        const bool fresh = !t->announced;
        if (!fresh && k->args_len <= t->sent) {
            continue;
        }
        const size_t from = fresh ? 0 : t->sent;
        struct kr_oai_tool_call piece = {.index = i, .id = fresh ? t->id : NULL, .name = fresh ? k->name : NULL,
                                         .args = k->args ? k->args + from : "", .args_len = k->args_len - from};
        memset(&d, 0, sizeof d);
        d.index = c->index;
        d.stop_reason_id = -1;
        d.text = "";
        d.tool_calls = &piece;
        d.n_tool_calls = 1;
        if (!emit_chunk(s, kr_oai_chat_chunk(s->id, s->created, env->model_name, &d, !c->first_sent))) {
            return;
        }
        c->first_sent = true;
        t->announced = true;
        t->sent = k->args_len;
    }
    if (c->finished) {
        choice_view(c, &d);
        d.tool_calls = NULL;
        d.n_tool_calls = 0;
        d.content_null = false;
        d.text = "";
        d.text_len = 0;
        d.token_ids = NULL;
        d.logprobs = NULL;
        d.finish_reason = c->finish;
        if (emit_chunk(s, kr_oai_chat_chunk(s->id, s->created, env->model_name, &d, !c->first_sent))) {
            c->first_sent = true;
            c->final_sent = true;
        }
    }
}

/* Sends what c has that may go out now (see kr_stops_sendable) as one delta chunk. */
static void stream_choice(struct kr_sess *s, struct choice *c)
{
    if (!s->streaming || !can_emit(s) || c->final_sent || s->failed) {
        return; /* the stream already ended (cut by the shutdown deadline), or this choice did: a stop
                   string finishes it before the engine's FINISH of the cancelled choice arrives; or
                   the answer failed: its error event ends the stream, no more text goes out */
    }
    if (s->tools_on) {
        stream_tools(s, c);
        return;
    }
    const size_t upto = kr_stops_sendable(&s->stops, c->text, c->len, c->sent, c->finished);
    const bool new_text = upto > c->sent, new_lp = c->lps && c->lp_sent < c->n_ids;
    /* without a tokenizer no text ever comes: each token id goes out as it arrives */
    const bool new_ids = !c->detok && c->lp_sent < c->n_ids;
    const bool final = c->finished;
    if (!new_text && !new_lp && !new_ids && !final && c->first_sent) {
        return;
    }
    const struct kr_sess_env *env = s->env;
    struct kr_oai_choice d;
    choice_view(c, &d);
    char *echo = NULL;
    size_t echo_len = 0;
    if (!c->first_sent && s->o.echo && s->kind == KR_SESS_COMPLETIONS && c->sub->prompt_text) {
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
    struct kr_oai_usage u = {.prompt_tokens = c->sub->n_prompt, .completion_tokens = c->n_ids};
    d.usage = s->o.continuous_usage ? &u : NULL;
    /* completions logprobs text_offset continues from the code points already streamed */
    const int64_t off = (int64_t)(c->first_sent && echo_len == 0 ? kr_oai_utf8_count(c->text, c->sent) : 0) +
                        (int64_t)(c->first_sent && s->o.echo && c->sub->prompt_text
                                      ? kr_oai_utf8_count(c->sub->prompt_text, c->sub->prompt_text_len)
                                      : 0);
    char *chunk = s->kind == KR_SESS_CHAT ? kr_oai_chat_chunk(s->id, s->created, env->model_name, &d, !c->first_sent)
                                          : kr_oai_completion_chunk_at(s->id, s->created, env->model_name, &d, off);
    kr_free(tmp);
    if (emit_chunk(s, chunk)) {
        c->sent = upto;
        c->lp_sent = c->n_ids;
        c->first_sent = true;
        c->final_sent = final;
    }
}

static void usage_of(const struct kr_sess *s, struct kr_oai_usage *u)
{
    int64_t p = 0, c = 0;
    kr_sess_usage(s, &p, &c);
    memset(u, 0, sizeof *u);
    u->prompt_tokens = p;
    u->completion_tokens = c;
}

/* The answer with its status, as a JSON error object when it failed; `done` once. */
static void answer_json(struct kr_sess *s, int status, char *json_jansson)
{
    s->ended = true;
    s->sink->done(s->user, json_jansson ? status : 500, json_jansson, json_jansson ? strlen(json_jansson) : 0);
    kr_oai_free(json_jansson);
}

static void answer_error(struct kr_sess *s, const struct kr_oai_error *e)
{
    answer_json(s, e->http_status, kr_oai_error_json(e));
}

/* The non-streaming answer once every choice has finished. */
static void answer_result(struct kr_sess *s)
{
    const struct kr_sess_env *env = s->env;
    struct kr_oai_choice *cv = kr_calloc((size_t)s->n_choices, sizeof *cv);
    if (!cv) {
        answer_json(s, 500, NULL);
        return;
    }
    struct kr_oai_usage u;
    usage_of(s, &u);
    for (int32_t i = 0; i < s->n_choices; i++) {
        choice_view(&s->ch[i], &cv[i]);
    }
    char *json = NULL;
    if (s->kind == KR_SESS_CHAT) {
        struct kr_oai_completion c = {.id = s->id, .created = s->created, .model = env->model_name, .choices = cv,
                                      .n_choices = s->n_choices, .usage = u,
                                      .prompt_ids = s->subs[0].prompt, .n_prompt_ids = s->subs[0].n_prompt,
                                      .prompt_logprobs = s->subs[0].plp,
                                      .prompt_logprobs_out = s->o.sampling.prompt_logprobs >= 0,
                                      .return_token_ids = s->o.return_token_ids || !env->tok};
        json = kr_oai_chat_json(&c);
    } else {
        /* one response for every prompt, each choice with its own prompt's echo and ids */
        struct kr_oai_completion *per = kr_calloc((size_t)s->n_sub, sizeof *per);
        for (int32_t i = 0; per && i < s->n_sub; i++) {
            const struct kr_sess_sub *sb = &s->subs[i];
            per[i] = (struct kr_oai_completion){.prompt_text = s->o.echo ? (sb->prompt_text ? sb->prompt_text : "") : NULL,
                                                .prompt_text_len = s->o.echo ? sb->prompt_text_len : 0,
                                                .prompt_ids = sb->prompt, .n_prompt_ids = sb->n_prompt,
                                                .prompt_logprobs = sb->plp,
                                                .prompt_logprobs_out = s->o.sampling.prompt_logprobs >= 0,
                                                .return_token_ids = s->o.return_token_ids || !env->tok};
        }
        if (per) {
            struct kr_oai_completion c = {.id = s->id, .created = s->created, .model = env->model_name, .choices = cv,
                                          .n_choices = s->n_choices, .usage = u, .prompts = per,
                                          .choices_per_prompt = s->o.n};
            json = kr_oai_completion_json(&c);
        }
        kr_free(per);
    }
    kr_free(cv);
    answer_json(s, 200, json);
}

/* The end of a stream: the error event when it failed, else the usage event when asked for; the
 * transport then ends the stream. A choice whose last chunk could not go out (out of memory) gets
 * one more try, then the stream fails; an error event that cannot be queued either is the
 * transport's to send (done with 500). */
static void stream_finish(struct kr_sess *s)
{
    for (int32_t i = 0; i < s->n_choices && !s->failed; i++) {
        stream_choice(s, &s->ch[i]);
        if (!s->ch[i].final_sent) {
            sess_oom(s);
        }
    }
    if (!s->failed && s->o.include_usage) {
        struct kr_oai_usage u;
        usage_of(s, &u);
        if (!emit_chunk(s, kr_oai_usage_chunk(s->id, s->created, s->env->model_name, s->kind == KR_SESS_CHAT, &u))) {
            sess_oom(s);
        }
    }
    bool ended_well = true;
    if (s->failed) {
        char *e = kr_oai_error_json(&s->err);
        ended_well = e && s->sink->stream_event(s->user, e, strlen(e));
        kr_oai_free(e);
    }
    s->ended = true;
    s->sink->done(s->user, ended_well ? 200 : 500, NULL, 0);
}

/* Ends the answer (every choice finished, the session failed or was cut): once, and only while
 * somebody listens. */
static void answer(struct kr_sess *s)
{
    if (!can_emit(s)) {
        return;
    }
    if (s->streaming) {
        stream_finish(s);
    } else if (s->failed || s->prep_failed) {
        answer_error(s, &s->err);
    } else if (s->kind == KR_SESS_TOKENIZE || s->kind == KR_SESS_DETOKENIZE) {
        char *body = s->def_body;
        s->def_body = NULL;
        answer_json(s, 200, body);
    } else {
        answer_result(s);
    }
}

/* ---- engine events (engine thread -> carrier -> loop thread) ------------------------------------ */

/* Engine thread: copies the event (its arrays are only borrowed) and hands it to the carrier.
 * Never blocks beyond the carrier's short lock. */
static void on_engine_event(const struct kr_event *ev, void *user)
{
    struct kr_sess_sub *sb = user;
    const struct kr_sess_env *env = sb->s->env;
    struct kr_sess_event *n = kr_calloc(1, sizeof *n);
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
        n->plp_rank = kr_calloc(np, sizeof(int32_t));
        if (!n->plp || !n->plp_ids || !n->plp_top || !n->plp_rank) {
            atomic_store(&sb->lost, true);
        } else {
            memcpy(n->plp, ev->prompt_logprobs, np * sizeof(float));
            if (ev->prompt_ranks) {
                memcpy(n->plp_rank, ev->prompt_ranks, np * sizeof(int32_t));
            }
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
    env->post(env->post_user, n);
}

static void free_node(struct kr_sess_event *n)
{
    kr_free(n->plp);
    kr_free(n->plp_ids);
    kr_free(n->plp_top);
    kr_free(n->plp_rank);
    kr_free(n);
}

/* Checks the text appended to c since byte `from` for a stop string; on a match truncates the
 * text there. */
static bool check_stop(struct kr_sess *s, struct choice *c, size_t from)
{
    size_t at = 0;
    const int32_t i = kr_stops_find(&s->stops, c->text, c->len, from, &at);
    if (i < 0) {
        return false;
    }
    c->len = at;
    c->text[at] = 0;
    c->stop_str = kr_strdup(s->o.stop[i]);
    if (!c->stop_str) {
        sess_oom(s); /* the answer's stop_reason would be null */
    }
    return true;
}

static void finish_choice(struct kr_sess *s, struct choice *c, const char *why)
{
    if (c->finished) {
        return;
    }
    if (c->detok) {
        const char *piece = NULL;
        size_t plen = 0;
        if (kr_detok_flush(c->detok, &piece, &plen, NULL) != KR_OK) {
            sess_oom(s); /* the text's tail is lost */
        } else if (plen) {
            const size_t before = c->len;
            if (!kr_text_append(&c->text, &c->len, &c->cap, piece, plen)) {
                sess_oom(s);
            } else if (check_stop(s, c, before)) {
                why = "stop";
            }
        }
    }
    c->finished = true;
    c->finish = why;
    s->env->met->requests_ok[!strcmp(why, "stop") ? 0 : !strcmp(why, "length") ? 1 : 2]++;
    if (s->tools_on) {
        if (!tool_reparse(s, c, true)) {
            sess_oom(s); /* the calls would be missing */
            return;
        }
        if (c->tp.n_calls > 0) {
            c->tview = kr_calloc((size_t)c->tp.n_calls, sizeof *c->tview);
            if (!c->tview) {
                sess_oom(s);
                return;
            }
            for (int32_t i = 0; i < c->tp.n_calls; i++) {
                const struct kr_tool_call *k = &c->tp.calls[i];
                c->tview[i] = (struct kr_oai_tool_call){.index = i, .id = c->tc[i].id, .name = k->name,
                                                        .args = k->args, .args_len = k->args_len};
            }
            if (!strcmp(why, "stop")) {
                c->finish = "tool_calls"; /* a call ended the turn (OpenAI); "length" stays */
            }
        }
    }
}

/* The engine owes sb nothing more. Returns true when no prompt of s is live any more. */
static bool sub_done(struct kr_sess *s, struct kr_sess_sub *sb)
{
    if (!sb->live) {
        return false;
    }
    sb->live = false;
    bool all = true;
    for (int32_t i = 0; i < s->n_sub; i++) {
        all &= !s->subs[i].live;
    }
    if (all && s->running) {
        s->running = false;
        s->env->n_running--;
        kr_hist_observe(&s->env->met->e2e, kr_clock_s() - s->t_arrival);
    }
    return all;
}

static void on_prompt_logprobs(struct kr_sess *s, struct kr_sess_sub *sb, const struct kr_sess_event *n)
{
    const struct kr_event *ev = &n->ev;
    if (!n->plp || !n->plp_ids || !n->plp_top || !n->plp_rank || sb->plp) {
        return; /* a copy the engine thread could not make set sb->lost */
    }
    const int32_t k = ev->prompt_top_k;
    sb->plp = kr_calloc((size_t)sb->n_prompt, sizeof *sb->plp);
    sb->plp_top = kr_calloc((size_t)sb->n_prompt * (size_t)(k ? k : 1), sizeof *sb->plp_top);
    if (!sb->plp || !sb->plp_top) {
        kr_free(sb->plp);
        kr_free(sb->plp_top);
        sb->plp = NULL;
        sb->plp_top = NULL;
        sess_oom(s);
        return;
    }
    sb->plp_k = k;
    bool ok = true;
    for (int32_t i = 0; i < sb->n_prompt; i++) {
        ok &= fill_token(s->env, &sb->plp[i].tok, sb->prompt[i], n->plp[i]);
        sb->plp[i].tok.rank = n->plp_rank[i];
        if (i > 0 && k > 0) {
            sb->plp[i].n_top = k;
            sb->plp[i].top = sb->plp_top + (size_t)i * (size_t)k;
            for (int32_t j = 0; j < k; j++) {
                const size_t at = (size_t)i * (size_t)k + (size_t)j;
                ok &= fill_token(s->env, &sb->plp_top[at], n->plp_ids[at], n->plp_top[at]);
                sb->plp_top[at].rank = j + 1;
            }
        }
    }
    if (!ok) {
        sess_oom(s);
    }
}

static void on_token(struct kr_sess *s, struct kr_sess_sub *sb, const struct kr_event *ev)
{
    struct kr_sess_env *env = s->env;
    struct choice *c = &s->ch[sb->idx * s->o.n + ev->index];
    if (c->finished || s->failed) {
        return; /* a stop string already ended it, or the answer failed; the engine's cancel is on its way */
    }
    const double t = kr_clock_s();
    if (c->n_ids == 0) {
        c->t_first = t;
        kr_hist_observe(&env->met->ttft, t - s->t_arrival);
        kr_hist_observe(&env->met->queue, ev->queue_s);
    } else {
        kr_hist_observe(&env->met->itl, t - c->t_last);
    }
    c->t_last = t;
    if (c->n_ids == c->cap_ids) {
        int32_t nc = c->cap_ids ? 2 * c->cap_ids : 32;
        int32_t *ni = kr_realloc(c->ids, (size_t)nc * sizeof(int32_t));
        if (!ni) {
            sess_oom(s); /* the token would be missing from the answer */
            return;
        }
        c->ids = ni;
        if (s->o.sampling.logprobs >= 0) {
            struct kr_oai_logprob *nl = kr_realloc(c->lps, (size_t)nc * sizeof *nl);
            if (nl) {
                c->lps = nl;
            }
            const int32_t k = s->o.sampling.logprobs;
            struct kr_oai_token *nt = kr_realloc(c->lp_top, (size_t)nc * (size_t)(k ? k : 1) * sizeof *nt);
            if (nt) {
                /* the entries so far point into the moved array: point them at its new place */
                c->lp_top = nt;
                for (int32_t i = 0; i < c->n_ids; i++) {
                    c->lps[i].top = nt + (size_t)i * (size_t)k;
                }
            }
            if (!nl || !nt) {
                sess_oom(s);
                return;
            }
        }
        c->cap_ids = nc;
    }
    if (c->lps) {
        const int32_t k = s->o.sampling.logprobs;
        struct kr_oai_logprob *lp = &c->lps[c->n_ids];
        memset(lp, 0, sizeof *lp);
        bool ok = fill_token(env, &lp->tok, ev->token, ev->logprob);
        lp->n_top = ev->n_top < k ? ev->n_top : k;
        lp->top = c->lp_top + (size_t)c->n_ids * (size_t)k;
        for (int32_t j = 0; j < lp->n_top; j++) {
            ok &= fill_token(env, &c->lp_top[(size_t)c->n_ids * (size_t)k + (size_t)j], ev->top_ids[j],
                             ev->top_logprobs[j]);
        }
        if (!ok) {
            sess_oom(s); /* the entry is kept (it owns its texts) but the answer fails */
        }
    }
    c->ids[c->n_ids++] = ev->token;
    if (c->detok) {
        const char *piece = NULL;
        size_t plen = 0;
        if (kr_detok_push(c->detok, ev->token, &piece, &plen, NULL) != KR_OK) {
            sess_oom(s); /* the token's text is lost */
        } else if (plen) {
            const size_t before = c->len;
            if (!kr_text_append(&c->text, &c->len, &c->cap, piece, plen)) {
                sess_oom(s);
            } else if (check_stop(s, c, before)) {
                finish_choice(s, c, "stop");
                env->engine->cancel_choice(env->engine_ctx, sb->eng_id, ev->index);
            } else if (s->tools_on) {
                if (!tool_reparse(s, c, false)) {
                    sess_oom(s);
                } else if (c->tp.closed) {
                    /* the calls are over (their section closed, or parallel_tool_calls false and one
                     * was made): what the model would write next is not part of the answer */
                    finish_choice(s, c, "stop");
                    env->engine->cancel_choice(env->engine_ctx, sb->eng_id, ev->index);
                }
            }
        }
    }
    stream_choice(s, c);
}

/* Returns true when sb is done (its reference is then dropped by the caller). */
static bool on_finish(struct kr_sess *s, struct kr_sess_sub *sb, const struct kr_event *ev)
{
    struct choice *c = &s->ch[sb->idx * s->o.n + ev->index];
    if (ev->finish == KR_FINISH_NOMEM) {
        sess_oom(s); /* the engine had to end the choice: its text is incomplete */
    }
    if (!c->finished) {
        const char *why = ev->finish == KR_FINISH_STOP ? "stop" : ev->finish == KR_FINISH_LENGTH ? "length" : "abort";
        c->stop_id = ev->finish == KR_FINISH_STOP ? ev->stop_token : -1;
        finish_choice(s, c, why);
    }
    stream_choice(s, c);
    return --sb->n_left == 0;
}

static void on_error(struct kr_sess *s, struct kr_sess_sub *sb, const struct kr_event *ev)
{
    const struct kr_sess_env *env = s->env;
    if (!s->failed) {
        s->failed = true;
        /* the event says so itself: the engine's flag turns true only after its errors are out */
        const bool lost = ev->status == KR_ERR_CUDA && (ev->device_lost || env->engine->failed(env->engine_ctx));
        char msg[600];
        snprintf(msg, sizeof msg, lost ? "%s" : "generation failed: %s", ev->message);
        /* a step that failed is the server's fault (500) whatever its status, unless the device is lost */
        engine_error(&s->err, lost ? KR_ERR_CUDA : KR_ERR_INTERNAL, lost, msg, NULL);
    }
    for (int32_t i = 0; i < s->o.n; i++) {
        struct choice *c = &s->ch[sb->idx * s->o.n + i];
        if (!c->finished) {
            finish_choice(s, c, "abort");
        }
    }
}

void kr_sess_event_deliver(struct kr_sess_event *n)
{
    struct kr_sess_sub *sb = n->sub;
    struct kr_sess *s = sb->s;
    const struct kr_event *ev = &n->ev;
    bool sub_over = false;
    if (atomic_load(&sb->lost) && s->started) {
        sess_oom(s); /* an event before this one could not be queued: the answer would lack it */
    }
    switch (ev->type) {
    case KR_EVENT_PROMPT_LOGPROBS:
        on_prompt_logprobs(s, sb, n);
        break;
    case KR_EVENT_TOKEN:
        on_token(s, sb, ev);
        break;
    case KR_EVENT_FINISH:
        sub_over = on_finish(s, sb, ev);
        break;
    case KR_EVENT_ERROR:
        on_error(s, sb, ev);
        sub_over = true;
        break;
    }
    free_node(n);
    if (!sub_over) {
        return;
    }
    const bool all = sub_done(s, sb);
    if (all) {
        answer(s);
    }
    sess_unref(s); /* the engine owes this prompt nothing more: s may be gone now */
}

/* ---- preparation (a worker) ------------------------------------------------------------------- */

static enum kr_status prep_fail(struct kr_sess *s, const struct kr_oai_error *e)
{
    s->err = *e;
    s->prep_failed = true;
    return KR_ERR_INVAL;
}

static enum kr_status prep_simple_fail(struct kr_sess *s, enum kr_oai_cause cause, const char *param,
                                       const char *msg)
{
    kr_oai_error(&s->err, cause, param, "%s", msg);
    s->prep_failed = true;
    return cause == KR_OAI_INTERNAL ? KR_ERR_NOMEM : KR_ERR_INVAL;
}

static enum kr_status prep_oom(struct kr_sess *s);

/* A body jansson could not parse (NUL inside strings is allowed where the text reaches no C string):
 * what is wrong and where, as the completion endpoints say it. */
static enum kr_status bad_json(struct kr_sess *s, const json_error_t *je, bool oom)
{
    if (oom) {
        return prep_oom(s);
    }
    kr_oai_error(&s->err, KR_OAI_INVALID, "", "malformed JSON: %s at line %d column %d", je->text, je->line,
                 je->column);
    s->prep_failed = true;
    return KR_ERR_INVAL;
}

static enum kr_status prep_oom(struct kr_sess *s)
{
    return prep_simple_fail(s, KR_OAI_INTERNAL, "", "out of memory");
}

/* Tokenizes text with the loaded tokenizer into sub's prompt. */
static bool tokenize_into(const struct kr_sess_env *env, struct kr_sess_sub *sb, const char *text, size_t len,
                          bool add_special, struct kr_oai_error *e, const char *param)
{
    if (!env->tok) {
        kr_oai_error(e, KR_OAI_INVALID, param,
                     "text prompts need a tokenizer; this server runs with --skip-tokenizer-init: send token ids");
        return false;
    }
    /* a text that cannot fit is refused before the tokenizer spends time on it */
    const size_t per = env->max_bytes_per_token;
    if (per && env->max_model_len > 0 && len / per >= (size_t)env->max_model_len) {
        kr_oai_error(e, KR_OAI_TOO_LONG, param,
                     "the prompt is %zu bytes, so at least %zu tokens (a token of this tokenizer stands for at most "
                     "%zu bytes); this model's maximum context length is %d tokens",
                     len, len / per, per, env->max_model_len);
        return false;
    }
    int32_t *ids = NULL;
    int64_t n = 0;
    struct kr_err err = {0};
    const enum kr_status st = kr_tokenizer_encode(env->tok, text, len, add_special, &ids, &n, &err);
    if (st != KR_OK) {
        /* out of memory is the server's failure, not the prompt's */
        kr_oai_error(e, st == KR_ERR_NOMEM ? KR_OAI_INTERNAL : KR_OAI_INVALID, param, "cannot tokenize: %s",
                     err.msg[0] ? err.msg : kr_status_str(st));
        return false;
    }
    sb->prompt = ids;
    sb->n_prompt = (int32_t)n;
    return true;
}

/* Parsing, the chat template and tokenization of a generation request; errors land in s->err. */
/* Where the chat's last user message begins in sb's prompt: the messages before it rendered
 * without a generation prompt and tokenized, and the length of what that has in common with the
 * prompt (a template may render the tail of a turn differently once it is not the last). 0 when
 * there is nothing before the last user message or the shorter render fails. */
static int32_t last_turn_boundary(const struct kr_sess *s, const struct kr_sess_sub *sb)
{
    const struct kr_sess_env *env = s->env;
    const size_t n = json_array_size(s->o.messages);
    size_t last = n;
    for (size_t i = n; i-- > 0;) {
        const char *role = json_string_value(json_object_get(json_array_get(s->o.messages, i), "role"));
        if (role && strcmp(role, "user") == 0) {
            last = i;
            break;
        }
    }
    if (last == n || last == 0) {
        return 0;
    }
    json_t *head = json_array();
    for (size_t i = 0; head && i < last; i++) {
        if (json_array_append(head, json_array_get(s->o.messages, i)) != 0) {
            json_decref(head);
            head = NULL;
        }
    }
    if (!head) {
        return 0;
    }
    char *text = NULL;
    size_t tlen = 0;
    struct kr_oai_error e = {0};
    int32_t at = 0;
    if (kr_chat_render(env->chat, head, s->o.tools, false, false, s->o.chat_template_kwargs, &text, &tlen, &e) ==
        KR_OK) {
        int32_t *ids = NULL;
        int64_t n_ids = 0;
        struct kr_err err = {0};
        if (kr_tokenizer_encode(env->tok, text, tlen, false, &ids, &n_ids, &err) == KR_OK) {
            while (at < n_ids && at < sb->n_prompt && ids[at] == sb->prompt[at]) {
                at++;
            }
            kr_free(ids);
        }
        kr_free(text);
    }
    json_decref(head);
    return at < sb->n_prompt ? at : 0;
}

/* The request's output constraint compiled, through the server's cache (a repeated schema costs a
 * lookup, and its grammar's mask cache is warm). Errors are the field's: a schema keyword the
 * compiler refuses, a regex construct, a grammar's line and column. */
static enum kr_status compile_constraint(struct kr_sess *s)
{
    const struct kr_sess_env *env = s->env;
    const struct kr_oai_constraint *c = &s->o.constraint;
    if (!env->tok || !env->gvocab || !env->grammars) {
        return prep_simple_fail(s, KR_OAI_INVALID, c->param,
                                "constrained decoding needs the tokenizer's tokens, and this server runs with "
                                "--skip-tokenizer-init");
    }
    const struct kr_grammar_json_opts opts = {.max_ws = c->max_ws};
    struct kr_err err = {0};
    const enum kr_status st =
        kr_grammar_cache_get(env->grammars, c->kind, c->text ? c->text : "", c->len, &opts, &s->grammar, NULL, &err);
    if (st == KR_ERR_NOMEM) {
        return prep_oom(s);
    }
    if (st != KR_OK) {
        kr_oai_error(&s->err, KR_OAI_INVALID, c->param, "invalid '%s': %s", c->param, err.msg);
        s->prep_failed = true;
        return KR_ERR_INVAL;
    }
    return KR_OK;
}

/* tool_choice auto: the output is parsed for calls in the model's format; required or a named
 * function: a grammar forces calls (of that function) with arguments that match their schemas. */
static enum kr_status prepare_tools(struct kr_sess *s)
{
    const struct kr_sess_env *env = s->env;
    const bool forced = s->o.tool_choice == KR_OAI_TOOL_REQUIRED || s->o.tool_choice == KR_OAI_TOOL_NAMED;
    if (env->tool_format == KR_TOOL_FORMAT_NONE) {
        if (!forced) {
            return KR_OK; /* the template may still show the tools; nothing parses calls */
        }
        return prep_simple_fail(s, KR_OAI_INVALID, "tool_choice",
                                "this model has no known tool-call format, so a call cannot be forced");
    }
    s->tools_on = true;
    s->max_calls = s->o.parallel_tool_calls ? 0 : 1;
    if (!forced) {
        return KR_OK;
    }
    if (s->o.constraint.on) {
        kr_oai_error(&s->err, KR_OAI_INVALID, "tool_choice",
                     "tool_choice '%s' cannot be combined with '%s' (both constrain the output)",
                     s->o.tool_choice == KR_OAI_TOOL_NAMED ? "function" : "required", s->o.constraint.param);
        s->prep_failed = true;
        return KR_ERR_INVAL;
    }
    if (!env->tok || !env->gvocab || !env->grammars) {
        return prep_simple_fail(s, KR_OAI_INVALID, "tool_choice",
                                "forcing tool calls needs the tokenizer's tokens (constrained decoding)");
    }
    char *spec = NULL;
    size_t len = 0;
    enum kr_status st = kr_tool_grammar_spec(env->tool_format, s->o.tools,
                                             s->o.tool_choice == KR_OAI_TOOL_NAMED ? s->o.tool_name : NULL,
                                             s->max_calls, &spec, &len);
    if (st != KR_OK) {
        return prep_oom(s);
    }
    struct kr_err err = {0};
    /* arguments as models write them ({"a": 1, "b": 2}): one whitespace byte per gap at most, so that
     * a weak model cannot spend its tokens on whitespace */
    const struct kr_grammar_json_opts opts = {.max_ws = 1};
    st = kr_grammar_cache_get(env->grammars, KR_GRAMMAR_TOOLS, spec, len, &opts, &s->grammar, NULL, &err);
    kr_free(spec);
    if (st == KR_ERR_NOMEM) {
        return prep_oom(s);
    }
    if (st != KR_OK) {
        /* "tools[I].function.parameters: ..." names the field */
        char param[64] = "tools";
        const char *colon = strstr(err.msg, ": ");
        if (!strncmp(err.msg, "tools[", 6) && colon && (size_t)(colon - err.msg) < sizeof param) {
            memcpy(param, err.msg, (size_t)(colon - err.msg));
            param[colon - err.msg] = 0;
        }
        kr_oai_error(&s->err, KR_OAI_INVALID, param, "invalid '%s': %s", param, err.msg);
        s->prep_failed = true;
        return KR_ERR_INVAL;
    }
    return KR_OK;
}

static enum kr_status prepare_generation(struct kr_sess *s, const char *body, size_t len)
{
    const struct kr_sess_env *env = s->env;
    struct kr_oai_error e;
    const enum kr_oai_kind kind = s->kind == KR_SESS_CHAT ? KR_OAI_CHAT : KR_OAI_COMPLETIONS;
    if (kr_oai_parse(kind, body, len, &s->o, &e) != KR_OK) {
        return prep_fail(s, &e);
    }
    s->have_o = true;
    if (s->o.model && strcmp(s->o.model, env->model_name) != 0) {
        kr_oai_error(&e, KR_OAI_MODEL_NOT_FOUND, "model",
                     "The model `%s` does not exist; this server serves `%s`", s->o.model, env->model_name);
        return prep_fail(s, &e);
    }
    if (s->o.constraint.on && compile_constraint(s) != KR_OK) {
        return KR_ERR_INVAL;
    }
    if (kind == KR_OAI_CHAT && s->o.tool_choice != KR_OAI_TOOL_NONE && prepare_tools(s) != KR_OK) {
        return KR_ERR_INVAL;
    }
    if (kind == KR_OAI_COMPLETIONS && (int64_t)s->o.n_prompts * s->o.n > 1024) {
        kr_oai_error(&e, KR_OAI_INVALID, "prompt", "at most 1024 choices per request (%d prompts x n=%d)",
                     s->o.n_prompts, s->o.n);
        return prep_fail(s, &e);
    }
    const int32_t n_sub = kind == KR_OAI_CHAT ? 1 : s->o.n_prompts;
    s->subs = kr_calloc((size_t)n_sub, sizeof *s->subs);
    if (!s->subs) {
        return prep_oom(s); /* n_sub stays 0: nothing to walk when the session is freed */
    }
    s->n_sub = n_sub;
    for (int32_t i = 0; i < s->n_sub; i++) {
        struct kr_sess_sub *sb = &s->subs[i];
        sb->s = s;
        sb->idx = i;
        char param[32];
        if (kind == KR_OAI_CHAT) {
            if (!env->tok || !env->chat) {
                kr_oai_error(&e, KR_OAI_INVALID, "messages",
                             "chat completions need a tokenizer with a chat template (none is loaded)");
                return prep_fail(s, &e);
            }
            char *text = NULL;
            size_t tlen = 0;
            if (kr_chat_render(env->chat, s->o.messages, s->o.tools, s->o.add_generation_prompt,
                               s->o.continue_final_message, s->o.chat_template_kwargs, &text, &tlen, &e) != KR_OK) {
                return prep_fail(s, &e);
            }
            bool ok = tokenize_into(env, sb, text, tlen, false, &e, "messages");
            kr_free(text);
            if (!ok) {
                return prep_fail(s, &e);
            }
            sb->snap_at = env->snapshot_hints ? last_turn_boundary(s, sb) : 0;
        } else {
            const struct kr_oai_prompt *p = &s->o.prompts[i];
            snprintf(param, sizeof param, s->o.n_prompts > 1 ? "prompt[%d]" : "prompt", i);
            if (p->ids) {
                sb->prompt = kr_malloc((size_t)(p->n_ids ? p->n_ids : 1) * sizeof(int32_t));
                if (!sb->prompt) {
                    return prep_oom(s);
                }
                memcpy(sb->prompt, p->ids, (size_t)p->n_ids * sizeof(int32_t));
                sb->n_prompt = p->n_ids;
                for (int32_t k = 0; k < p->n_ids; k++) {
                    if (p->ids[k] < 0 || p->ids[k] >= env->vocab) {
                        kr_oai_error(&e, KR_OAI_INVALID, param,
                                     "token id %d is outside the vocabulary [0, %lld)", p->ids[k],
                                     (long long)env->vocab);
                        return prep_fail(s, &e);
                    }
                }
                /* echo: the prompt's text (without it the answer would silently lack the echo) */
                if (s->o.echo && env->tok &&
                    kr_tokenizer_decode(env->tok, p->ids, p->n_ids, false, &sb->prompt_text, &sb->prompt_text_len,
                                        NULL) != KR_OK) {
                    return prep_oom(s);
                }
            } else {
                if (!tokenize_into(env, sb, p->text, p->text_len, true, &e, param)) {
                    return prep_fail(s, &e);
                }
                sb->prompt_text = kr_strndup(p->text, p->text_len);
                sb->prompt_text_len = p->text_len;
                if (!sb->prompt_text) {
                    return prep_oom(s);
                }
            }
        }
        if (sb->n_prompt == 0) {
            kr_oai_error(&e, KR_OAI_INVALID, kind == KR_OAI_CHAT ? "messages" : "prompt",
                         "the prompt is empty after tokenization");
            return prep_fail(s, &e);
        }
        if (sb->n_prompt >= env->max_model_len) {
            kr_oai_error(&e, KR_OAI_TOO_LONG, kind == KR_OAI_CHAT ? "messages" : "prompt",
                         "This model's maximum context length is %d tokens. However, your request has %d input "
                         "tokens. Please reduce the length of the input.",
                         env->max_model_len, sb->n_prompt);
            return prep_fail(s, &e);
        }
    }
    if (!s->o.max_tokens_given && kind == KR_OAI_CHAT) {
        s->o.sampling.max_tokens = env->max_model_len - s->subs[0].n_prompt;
    }
    for (int32_t i = 0; i < s->n_sub; i++) {
        const int64_t total = (int64_t)s->subs[i].n_prompt + s->o.sampling.max_tokens; /* no 32-bit overflow */
        if (total > env->max_model_len) {
            kr_oai_error(&e, KR_OAI_TOO_LONG, "max_tokens",
                         "This model's maximum context length is %d tokens. However, you requested %lld tokens "
                         "(%d in the messages, %d in the completion). Please reduce the length of the messages or "
                         "completion.",
                         env->max_model_len, (long long)total, s->subs[i].n_prompt, s->o.sampling.max_tokens);
            return prep_fail(s, &e);
        }
    }
    return KR_OK;
}

static enum kr_status prep_json(struct kr_sess *s, json_t *j)
{
    s->def_body = kr_oai_dump(j); /* whole or NULL (json_dumps may truncate when out of memory) */
    return s->def_body ? KR_OK : prep_oom(s);
}

/* POST /tokenize: {"prompt": text} or {"messages": [...]} to token ids. */
static enum kr_status prepare_tokenize(struct kr_sess *s, const char *body, size_t blen)
{
    const struct kr_sess_env *env = s->env;
    json_error_t je;
    bool oom = false;
    json_t *root = kr_oai_json_loadb(body, blen, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je, &oom);
    if (!root) {
        return bad_json(s, &je, oom);
    }
    if (!json_is_object(root)) {
        json_decref(root);
        return prep_simple_fail(s, KR_OAI_INVALID, "", "the body must be a JSON object");
    }
    if (!env->tok) {
        json_decref(root);
        return prep_simple_fail(s, KR_OAI_INVALID, "", "no tokenizer is loaded (--skip-tokenizer-init)");
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
        if (!text) {
            json_decref(root);
            return prep_oom(s);
        }
    } else if (json_is_array(messages)) {
        add_special = false;
        json_t *agp = json_object_get(root, "add_generation_prompt");
        if (!env->chat || kr_chat_render(env->chat, messages, json_object_get(root, "tools"),
                                         agp ? json_is_true(agp) : true, false,
                                         json_object_get(root, "chat_template_kwargs"), &text, &len, &e) != KR_OK) {
            json_decref(root);
            if (!env->chat) {
                return prep_simple_fail(s, KR_OAI_INVALID, "messages", "no chat template is loaded");
            }
            return prep_fail(s, &e);
        }
    } else {
        json_decref(root);
        return prep_simple_fail(s, KR_OAI_INVALID, "prompt",
                                "give \"prompt\" (a string) or \"messages\" (a list of chat messages)");
    }
    if (ast) {
        if (!json_is_boolean(ast)) {
            kr_free(text);
            json_decref(root);
            return prep_simple_fail(s, KR_OAI_INVALID, "add_special_tokens",
                                    "'add_special_tokens' must be a boolean");
        }
        add_special = json_is_true(ast);
    }
    int32_t *ids = NULL;
    int64_t n = 0;
    struct kr_err err = {0};
    enum kr_status st = kr_tokenizer_encode(env->tok, text ? text : "", len, add_special, &ids, &n, &err);
    kr_free(text);
    if (st != KR_OK) {
        json_decref(root);
        if (st == KR_ERR_NOMEM) {
            return prep_oom(s);
        }
        return prep_simple_fail(s, KR_OAI_INVALID, "prompt", err.msg);
    }
    const bool want_strs = json_is_true(json_object_get(root, "return_token_strs"));
    json_decref(root);
    /* every part checked: a missing token would make a whole-looking wrong answer */
    json_t *out = json_object(), *arr = json_array(), *strs = want_strs ? json_array() : json_null();
    json_t *const arr_b = arr, *const strs_b = strs; /* borrowed once out holds them */
    bool ok = out && arr && strs;
    ok = json_object_set_new(out, "count", json_integer(n)) == 0 && ok;
    ok = json_object_set_new(out, "max_model_len", json_integer(env->max_model_len)) == 0 && ok;
    ok = json_object_set_new(out, "tokens", arr) == 0 && ok; /* releases arr when it fails */
    ok = json_object_set_new(out, "token_strs", strs) == 0 && ok;
    for (int64_t i = 0; ok && i < n; i++) {
        ok = json_array_append_new(arr_b, json_integer(ids[i])) == 0;
        if (ok && want_strs) {
            size_t pl = 0;
            const char *piece = kr_tokenizer_id_to_piece(env->tok, ids[i], &pl);
            ok = json_array_append_new(strs_b, piece ? json_stringn(piece, pl) : json_null()) == 0;
        }
    }
    kr_free(ids);
    if (!ok) {
        json_decref(out);
        return prep_oom(s);
    }
    return prep_json(s, out);
}

/* POST /detokenize: {"tokens": [ids]} to text. */
static enum kr_status prepare_detokenize(struct kr_sess *s, const char *body, size_t blen)
{
    const struct kr_sess_env *env = s->env;
    json_error_t je;
    bool oom = false;
    json_t *root = kr_oai_json_loadb(body, blen, JSON_DECODE_ANY, &je, &oom);
    if (!root) {
        return bad_json(s, &je, oom);
    }
    json_t *toks = json_is_object(root) ? json_object_get(root, "tokens") : NULL;
    if (!json_is_array(toks)) {
        json_decref(root);
        return prep_simple_fail(s, KR_OAI_INVALID, "tokens", "\"tokens\" must be a list of token ids");
    }
    if (!env->tok) {
        json_decref(root);
        return prep_simple_fail(s, KR_OAI_INVALID, "", "no tokenizer is loaded (--skip-tokenizer-init)");
    }
    const size_t n = json_array_size(toks);
    int32_t *ids = kr_malloc((n ? n : 1) * sizeof(int32_t));
    for (size_t i = 0; ids && i < n; i++) {
        json_t *v = json_array_get(toks, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= kr_tokenizer_n_vocab(env->tok)) {
            char param[32];
            snprintf(param, sizeof param, "tokens[%zu]", i);
            kr_free(ids);
            json_decref(root);
            return prep_simple_fail(s, KR_OAI_INVALID, param,
                                    "token ids must be integers in the vocabulary");
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    char *text = NULL;
    size_t len = 0;
    enum kr_status st = ids ? kr_tokenizer_decode(env->tok, ids, (int64_t)n, false, &text, &len, NULL) : KR_ERR_NOMEM;
    kr_free(ids);
    json_decref(root);
    if (st != KR_OK) {
        return prep_oom(s);
    }
    json_t *out = json_object();
    const bool ok = json_object_set_new(out, "prompt", json_stringn(text, len)) == 0;
    kr_free(text);
    if (!ok) {
        json_decref(out);
        return prep_oom(s);
    }
    return prep_json(s, out);
}

/* A Responses body: translated into a chat body, prepared as one; errors name the Responses fields. */
static enum kr_status prepare_responses(struct kr_sess *s, const char *body, size_t len)
{
    struct kr_oai_error e;
    char *chat = NULL;
    size_t chat_len = 0;
    enum kr_status st = kr_resp_request(s->resp, body, len, &chat, &chat_len, &e);
    if (st == KR_ERR_NOMEM) {
        return prep_oom(s);
    }
    if (st != KR_OK) {
        return prep_fail(s, &e);
    }
    st = prepare_generation(s, chat, chat_len);
    kr_oai_free(chat);
    if (st != KR_OK && s->prep_failed) {
        kr_resp_error_param(s->resp, &s->err);
    }
    return st;
}

static enum kr_status prepare(struct kr_sess *s, const char *body, size_t len)
{
    switch (s->kind) {
    case KR_SESS_TOKENIZE:
        return prepare_tokenize(s, body, len);
    case KR_SESS_DETOKENIZE:
        return prepare_detokenize(s, body, len);
    case KR_SESS_COMPLETIONS:
    case KR_SESS_CHAT:
    case KR_SESS_RESPONSES:
        break;
    }
    if (s->resp) {
        return prepare_responses(s, body, len);
    }
    return prepare_generation(s, body, len);
}

/* The preparation runs under the request memory limit: a body within the size limit can still cost
 * far more once parsed (about 50 bytes for each id of "[1,1,1,...]"), and every worker may hold one. */
enum kr_status kr_sess_prepare(struct kr_sess *s, const char *body, size_t len)
{
    const size_t limit = s->env->max_request_memory;
    kr_alloc_limit_begin(limit ? limit : SIZE_MAX); /* unbounded: the peak is still measured */
    enum kr_status st = prepare(s, body ? body : "", len);
    if (kr_alloc_limit_end(&s->prep_peak)) {
        /* whatever failed for want of memory, the limit is the reason (the answer below is built
         * after the scope closed) */
        char msg[200];
        snprintf(msg, sizeof msg,
                 "the request needs more than %zu MiB of memory to parse and prepare (the server's "
                 "--max-request-memory): send fewer or shorter values",
                 limit >> 20);
        kr_oai_error(&s->err, KR_OAI_TOO_LARGE, "", "%s", msg);
        s->prep_failed = true;
        st = KR_ERR_INVAL;
    }
    return st;
}

/* ---- start (the loop) -------------------------------------------------------------------------- */

/* Hands every prompt to the engine; a refusal answers with its error and cancels the prompts
 * already queued (they finish as cancelled, holding their references until then). */
static void submit_all(struct kr_sess *s)
{
    const struct kr_sess_env *env = s->env;
    for (int32_t i = 0; i < s->n_sub; i++) {
        struct kr_sess_sub *sb = &s->subs[i];
        struct kr_request_params p = {.prompt = sb->prompt, .n_prompt = sb->n_prompt, .n = s->o.n,
                                      .sampling = s->o.sampling, .cb = on_engine_event, .user = sb,
                                      .cache_salt = s->o.cache_salt, .cache_salt_len = s->o.cache_salt_len,
                                      .snapshot_at = sb->snap_at > 0 ? &sb->snap_at : NULL,
                                      .n_snapshot_at = sb->snap_at > 0 ? 1 : 0};
        struct kr_err err = {0};
        enum kr_status st = KR_OK;
        sb->spare = kr_calloc((size_t)s->o.n + 1, sizeof *sb->spare);
        for (int32_t k = 0; sb->spare && k <= s->o.n; k++) {
            if (!(sb->spare[k] = kr_calloc(1, sizeof **sb->spare))) {
                break;
            }
            sb->n_spare = k + 1;
        }
        if (s->grammar && st == KR_OK) { /* each prompt's request holds the constraint on its own */
            st = kr_constrain_create(s->grammar, env->gvocab, &p.constraint);
        }
        if (st != KR_OK || !sb->spare || sb->n_spare != s->o.n + 1) {
            st = KR_ERR_NOMEM;
            snprintf(err.msg, sizeof err.msg, "out of memory");
        } else {
            st = env->engine->submit(env->engine_ctx, &p, &sb->eng_id, &err);
        }
        if (st != KR_OK && p.constraint.iface) {
            p.constraint.iface->release(p.constraint.ctx); /* a refused request left it with us */
        }
        if (st != KR_OK) {
            cancel_engine(s); /* the prompts already queued */
            engine_error(&s->err, st, st == KR_ERR_CUDA && env->engine->failed(env->engine_ctx), err.msg,
                         err.param);
            s->failed = true;
            answer(s);
            return;
        }
        sb->live = true;
        sb->n_left = s->o.n;
        s->refs++;
        if (!s->running) {
            s->running = true;
            s->env->n_running++;
        }
    }
    if (s->o.stream) {
        s->streaming = true;
        s->sink->stream_begin(s->user);
    }
}

/* Choices, detokenizers, submission. */
static void start_generation(struct kr_sess *s)
{
    const struct kr_sess_env *env = s->env;
    static uint64_t counter;
    s->created = (int64_t)time(NULL);
    snprintf(s->id, sizeof s->id, "%s-%llx%06llx", s->kind == KR_SESS_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)time(NULL), (unsigned long long)(++counter & 0xffffff));
    kr_stops_init(&s->stops, (const char *const *)s->o.stop, s->o.n_stop);
    s->n_choices = s->n_sub * s->o.n;
    s->ch = kr_calloc((size_t)s->n_choices, sizeof *s->ch);
    if (!s->ch) {
        s->n_choices = 0;
        answer_json(s, 500, NULL);
        return;
    }
    for (int32_t i = 0; i < s->n_choices; i++) {
        struct choice *c = &s->ch[i];
        c->index = i;
        c->sub = &s->subs[i / s->o.n];
        c->engine_index = i % s->o.n;
        c->stop_id = -1;
        if (env->tok && kr_detok_create(env->tok, s->o.skip_special_tokens, &c->detok) != KR_OK) {
            answer_json(s, 500, NULL);
            return;
        }
        if (s->o.sampling.logprobs >= 0) {
            c->cap_ids = 32;
            c->ids = kr_malloc(32 * sizeof(int32_t));
            c->lps = kr_malloc(32 * sizeof *c->lps);
            c->lp_top = kr_malloc(32 * (size_t)(s->o.sampling.logprobs ? s->o.sampling.logprobs : 1) * sizeof *c->lp_top);
            if (!c->ids || !c->lps || !c->lp_top) {
                answer_json(s, 500, NULL);
                return;
            }
        }
    }
    if (s->o.echo && s->o.sampling.logprobs >= 0 && s->o.sampling.prompt_logprobs < 0) {
        s->o.sampling.prompt_logprobs = s->o.sampling.logprobs; /* echo + logprobs: OpenAI returns the prompt's */
    }
    submit_all(s);
}

void kr_sess_start(struct kr_sess *s, const struct kr_sess_sink *sink, void *user)
{
    KR_ASSERT(!s->started);
    s->started = true;
    s->sink = sink;
    s->user = user;
    if (s->resp) {
        s->sink = kr_resp_sink(s->resp, sink, user); /* the answer in the Responses shape */
        s->user = s->resp;
    }
    if (s->prep_failed || s->kind == KR_SESS_TOKENIZE || s->kind == KR_SESS_DETOKENIZE) {
        answer(s);
        return;
    }
    start_generation(s);
}

void kr_sess_cancel(struct kr_sess *s, const struct kr_oai_error *why)
{
    if (!s->started) {
        return;
    }
    if (!why) {
        s->sink = NULL; /* the client is gone: nothing more goes out */
        s->ended = true;
    } else if (!s->failed) {
        s->failed = true;
        s->err = *why;
    }
    cancel_engine(s);
    answer(s);
}
