/* The batching engine: request intake from any thread, a scheduler on the engine thread, and
 * sampling. See engine.h for the contract. */
#include "engine.h"

#include "alloc.h"
#include "array.h"
#include "cache.h"
#include "clock.h"
#include "log.h"
#include "switches.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- sequence state machine --------------------------------------------------------------------
 *
 *   WAITING ──admit──▶ PREFILL ──last token fed──▶ DECODE ──EOS/stop/length──▶ DONE
 *      ▲                  │                          │
 *      └────preempt───────┴──────────────────────────┘   (caches freed; recomputed later)
 *   FORK_WAIT ──choice 0 finished its prefill──▶ DECODE (forked state) or WAITING (no room: recompute)
 *   any state ──cancel──▶ DONE
 *
 * Only the engine thread touches sequences. A sequence holds a state slot and blocks exactly in
 * PREFILL and DECODE. */
enum kr_seq_state {
    KR_SEQ_WAITING = 0, /* queued for admission; holds no cache (new, or preempted) */
    KR_SEQ_FORK_WAIT,   /* choice i > 0 of an n > 1 request, waiting for choice 0's prefill */
    KR_SEQ_PREFILL,     /* admitted; feeding toks[n_fed..n_toks) in chunks */
    KR_SEQ_DECODE,      /* one token per step */
    KR_SEQ_DONE,        /* terminal; holds nothing */
};

struct req;

struct seq {
    struct req *req;
    int32_t index;               /* choice index */
    enum kr_seq_state state;
    struct kr_seq_cache cache;   /* slot, blocks, n_pos (== n_fed while admitted) */
    int32_t *toks;               /* [n_toks] prompt followed by generated tokens */
    int32_t n_toks, cap_toks;
    int32_t n_gen;               /* generated tokens */
    int32_t n_fed;               /* tokens of toks in the caches */
    struct kr_token_counts counts;
    struct kr_rng rng;
    uint64_t admit_seq;          /* admission order (preemption picks the latest) */
    double admitted_us;          /* first admission (0 before) */
    uint64_t arrival;            /* request order (FCFS) */
};

struct req {
    uint64_t id;
    kr_event_cb cb;
    void *user;
    double submitted_us;
    int32_t n_prompt;
    int32_t n;
    struct kr_sampling s;
    struct seq *seqs;            /* [n] */
    int32_t n_done;
    bool prompt_lp_sent;
    float *plp;                  /* [n_prompt] prompt logprobs (when requested) */
    int32_t *plp_ids;            /* [n_prompt, k] */
    float *plp_top;              /* [n_prompt, k] */
    int32_t plp_rows;            /* rows accumulated */
    struct req *next_in;         /* inbox link */
};

struct kr_engine {
    struct kr_model *m;          /* borrowed */
    struct kr_cache *cache;
    struct kr_engine_config cfg;
    size_t slot_bytes, block_bytes;

    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;         /* work arrived or stop */
    pthread_cond_t idle_cv;      /* signalled when the engine becomes idle */
    bool stop;
    bool idle;
    struct req *inbox_head, *inbox_tail; /* submitted, not yet seen by the engine thread */
    struct cancel *cancels;      /* [cap_cancels] cancellations queued by any thread */
    int32_t n_cancels, cap_cancels;
    struct cancel *cancels_w;    /* [cap_cancels_w] the engine thread's batch: swapped with `cancels`
                                    under the lock, so that every pending cancel is taken each
                                    iteration without copying or allocating */
    int32_t cap_cancels_w;
    bool failed;                 /* the device failed for good: every request fails, submit refuses */
    char failed_msg[256];
    int64_t fault_step;          /* KRAIT_FAULT_STEP: the step attempt that fails (0 = none; tests) */
    bool fault_fatal;            /* ... as a device that is lost for good */
    uint64_t step_attempts;
    atomic_uint_fast64_t next_id;
    atomic_int queued;           /* requests submitted and not yet admitted (admission limit) */
    struct kr_engine_stats stats; /* under lock */

    /* engine thread only */
    struct req **reqs;           /* live requests */
    int32_t n_reqs, cap_reqs;
    struct req **dead;           /* retired requests, freed at the end of the step */
    int32_t n_dead, cap_dead;
    struct seq **waiting;        /* FCFS: preempted first, then by arrival */
    int32_t n_waiting, cap_waiting;
    struct seq **running;        /* PREFILL and DECODE, by admission order */
    int32_t n_running, cap_running;
    uint64_t admit_counter, arrival_counter;
    uint64_t preemptions, prompt_tokens, gen_tokens, steps;
    double t_step_done;          /* when the last step's results were back (0: the engine idled since) */
    struct kr_sampler_scratch scratch;
    /* step buffers */
    int32_t cap_tok, cap_seq, cap_bt;
    int32_t *b_tokens, *b_pos, *b_out, *b_tok0, *b_pos0, *b_slot, *b_bt, *b_nsched;
    struct seq **b_seqs;
    float *logits;
    size_t cap_logits;
    float *lp_row;
    int32_t top_ids[KR_MAX_TOP_LOGPROBS];
    float top_lps[KR_MAX_TOP_LOGPROBS];
    /* sampling on the backend (GPU): per-step rows, penalty lists and results */
    bool dev_sample;
    int32_t cap_srows;
    struct seq **s_seqs;           /* [n] the sequence of each output row */
    struct kr_sample_row *srows;
    int32_t *s_out, *s_top_ids;
    float *s_lp, *s_top_lp;
    int64_t cap_pen;
    int32_t *pen_ids, *pen_count;
    uint8_t *pen_flags;
    /* events held back while the device works (see emit) */
    bool defer_events;
    struct pending_ev *outbox;
    int32_t n_outbox, cap_outbox;
};

/* A cancellation: a whole request (index -1) or one choice. */
struct cancel {
    uint64_t id;
    int32_t index;
};

/* An event waiting in the outbox, with copies of what it borrows. */
struct pending_ev {
    struct kr_event ev;
    kr_event_cb cb;
    int32_t top_ids[KR_MAX_TOP_LOGPROBS];
    float top_lps[KR_MAX_TOP_LOGPROBS];
    char msg[512];
};

void kr_engine_config_default(struct kr_engine_config *c)
{
    memset(c, 0, sizeof *c);
    c->max_num_seqs = 256;
    c->max_num_batched_tokens = 2048;
    c->block_size = 16;
    c->cache_bytes = (size_t)256 << 20;
    c->backend_sampling = -1;
}

/* ---- small dynamic arrays ---------------------------------------------------------------------- */

static enum kr_status ptr_push(void ***arr, int32_t *n, int32_t *cap, void *p, bool front)
{
    if (kr_array_reserve(arr, cap, (int64_t)*n + 1, sizeof(void *), 16) != KR_OK) {
        return KR_ERR_NOMEM;
    }
    if (front) {
        memmove(*arr + 1, *arr, (size_t)*n * sizeof(void *));
        (*arr)[0] = p;
    } else {
        (*arr)[*n] = p;
    }
    (*n)++;
    return KR_OK;
}

static void ptr_remove(void **arr, int32_t *n, void *p)
{
    for (int32_t i = 0; i < *n; i++) {
        if (arr[i] == p) {
            memmove(arr + i, arr + i + 1, (size_t)(*n - i - 1) * sizeof(void *));
            (*n)--;
            return;
        }
    }
}

#define PUSH(e, list, p, front) ptr_push((void ***)&(e)->list, &(e)->n_##list, &(e)->cap_##list, (p), (front))
#define REMOVE(e, list, p) ptr_remove((void **)(e)->list, &(e)->n_##list, (p))

/* Inserts a preempted/forked-out sequence into the waiting queue by arrival (FCFS). */
static enum kr_status waiting_insert(struct kr_engine *e, struct seq *s)
{
    enum kr_status st = PUSH(e, waiting, s, false);
    if (st != KR_OK) {
        return st;
    }
    int32_t i = e->n_waiting - 1;
    while (i > 0 && (e->waiting[i - 1]->arrival > s->arrival ||
                     (e->waiting[i - 1]->arrival == s->arrival && e->waiting[i - 1]->index > s->index))) {
        e->waiting[i] = e->waiting[i - 1];
        i--;
    }
    e->waiting[i] = s;
    return KR_OK;
}

static enum kr_status seq_append(struct seq *s, int32_t tok)
{
    if (KR_ARRAY_RESERVE(s->toks, s->cap_toks, (int64_t)s->n_toks + 1, 64) != KR_OK) {
        return KR_ERR_NOMEM;
    }
    s->toks[s->n_toks++] = tok;
    return KR_OK;
}

/* ---- events ---------------------------------------------------------------------------------- */

/* Delivers the events held in the outbox, in the order they were made. */
static void flush_events(struct kr_engine *e)
{
    for (int32_t i = 0; i < e->n_outbox; i++) {
        struct pending_ev *p = &e->outbox[i];
        p->ev.top_ids = p->top_ids;
        p->ev.top_logprobs = p->top_lps;
        if (p->ev.type == KR_EVENT_ERROR) {
            p->ev.message = p->msg;
        }
        p->cb(&p->ev, p->ev.user);
    }
    e->n_outbox = 0;
}

/* Sends an event to the request's callback. When the backend works asynchronously (a GPU), token,
 * finish and error events wait in an outbox until the next step's work has been handed to the
 * device (run_step flushes right after launching it), so that the callbacks run while the device
 * computes instead of between two steps; every decision (finishing, freeing) is still taken at
 * once, only the delivery moves, and the order of events is kept. Prompt log-probabilities go at
 * once (after what is held), as does everything when the outbox cannot grow. */
static void emit(struct kr_engine *e, struct req *r, struct kr_event *ev)
{
    ev->req_id = r->id;
    ev->user = r->user;
    if (e->defer_events && ev->type != KR_EVENT_PROMPT_LOGPROBS && ev->n_top <= KR_MAX_TOP_LOGPROBS) {
        (void)KR_ARRAY_RESERVE(e->outbox, e->cap_outbox, (int64_t)e->n_outbox + 1, 64); /* or deliver now */
        if (e->n_outbox < e->cap_outbox) {
            struct pending_ev *p = &e->outbox[e->n_outbox++];
            p->ev = *ev;
            p->cb = r->cb;
            if (ev->type == KR_EVENT_TOKEN && ev->n_top > 0) {
                memcpy(p->top_ids, ev->top_ids, (size_t)ev->n_top * sizeof(int32_t));
                memcpy(p->top_lps, ev->top_logprobs, (size_t)ev->n_top * sizeof(float));
            }
            if (ev->type == KR_EVENT_ERROR) {
                snprintf(p->msg, sizeof p->msg, "%s", ev->message ? ev->message : kr_status_str(ev->status));
            }
            return;
        }
    }
    flush_events(e);
    r->cb(ev, r->user);
}

static void release_seq(struct kr_engine *e, struct seq *s)
{
    if (s->state == KR_SEQ_PREFILL || s->state == KR_SEQ_DECODE) {
        kr_seq_cache_release(e->cache, &s->cache);
        REMOVE(e, running, s);
    } else if (s->state == KR_SEQ_WAITING) {
        REMOVE(e, waiting, s);
    }
}

static void req_free(struct req *r)
{
    if (!r) {
        return;
    }
    for (int32_t i = 0; r->seqs && i < r->n; i++) {
        kr_free(r->seqs[i].toks);
        kr_token_counts_free(&r->seqs[i].counts);
    }
    kr_free(r->seqs);
    kr_free(r->plp);
    kr_free(r->plp_ids);
    kr_free(r->plp_top);
    kr_free(r);
}

/* A request whose choices all ended: out of the live list now, freed by free_dead() once no
 * pointer of the current step can reach it. */
static void retire(struct kr_engine *e, struct req *r)
{
    REMOVE(e, reqs, r);
    KR_ASSERT(e->n_dead < e->cap_dead); /* intake made room for every live request */
    e->dead[e->n_dead++] = r;
}

static void free_dead(struct kr_engine *e)
{
    for (int32_t i = 0; i < e->n_dead; i++) {
        req_free(e->dead[i]);
    }
    e->n_dead = 0;
}

/* Ends one choice: frees its caches, sends FINISH, retires the request after its last choice. */
static void finish_seq(struct kr_engine *e, struct seq *s, enum kr_finish_reason why, int32_t stop_token)
{
    struct req *r = s->req;
    if (s->state == KR_SEQ_DONE) {
        return;
    }
    release_seq(e, s);
    s->state = KR_SEQ_DONE;
    struct kr_event ev = {.type = KR_EVENT_FINISH, .index = s->index, .finish = why, .stop_token = stop_token};
    ev.usage.prompt_tokens = r->n_prompt;
    ev.usage.completion_tokens = s->n_gen;
    emit(e, r, &ev);
    if (++r->n_done == r->n) {
        retire(e, r);
    }
}

/* Fails a whole request (a backend error): ERROR event, everything freed. */
static void fail_req(struct kr_engine *e, struct req *r, enum kr_status st, const char *msg)
{
    for (int32_t i = 0; i < r->n; i++) {
        struct seq *s = &r->seqs[i];
        if (s->state != KR_SEQ_DONE) {
            release_seq(e, s);
            s->state = KR_SEQ_DONE;
        }
    }
    struct kr_event ev = {.type = KR_EVENT_ERROR, .status = st, .message = msg};
    emit(e, r, &ev);
    r->n_done = r->n;
    retire(e, r);
}

/* ---- admission, preemption, fork --------------------------------------------------------------- */

static void preempt(struct kr_engine *e, struct seq *s)
{
    kr_seq_cache_release(e->cache, &s->cache);
    REMOVE(e, running, s);
    s->state = KR_SEQ_WAITING;
    s->n_fed = 0;
    e->preemptions++;
    if (waiting_insert(e, s) != KR_OK) { /* cannot queue it again: end it rather than lose it */
        s->state = KR_SEQ_WAITING;
        finish_seq(e, s, KR_FINISH_CANCELLED, -1);
    }
    KR_LOG_DEBUG("preempted req=%llu choice=%d tokens=%d", (unsigned long long)s->req->id, s->index, s->n_toks);
}

/* The running sequence admitted last, other than `except`; NULL if none. */
static struct seq *youngest_running(struct kr_engine *e, const struct seq *except)
{
    struct seq *best = NULL;
    for (int32_t i = 0; i < e->n_running; i++) {
        struct seq *s = e->running[i];
        if (s != except && (!best || s->admit_seq > best->admit_seq)) {
            best = s;
        }
    }
    return best;
}

/* Tokens beyond n_fed that s can hold with its blocks plus the free pool (no allocation). */
static int32_t room_for(const struct kr_engine *e, const struct seq *s)
{
    const struct kr_cache *c = e->cache;
    if (c->n_attn == 0 && c->n_mla == 0) {
        return INT32_MAX;
    }
    const int64_t cap = (int64_t)(s->cache.n_blocks + c->n_free_blocks) * c->block_size;
    const int64_t r = cap - s->n_fed;
    return r > INT32_MAX ? INT32_MAX : (int32_t)(r < 0 ? 0 : r);
}

/* Forks choice 0's state into the waiting choices 1..n-1 of its request after its prefill: each
 * takes a slot (copy of the state), shares the full blocks and copies the partial last one. A
 * choice that finds no room is queued to recompute its prompt on its own. */
static void fork_children(struct kr_engine *e, struct seq *leader)
{
    struct req *r = leader->req;
    struct kr_cache *c = e->cache;
    for (int32_t i = 1; i < r->n; i++) {
        struct seq *ch = &r->seqs[i];
        if (ch->state != KR_SEQ_FORK_WAIT) {
            continue;
        }
        bool ok = e->n_running < e->cfg.max_num_seqs &&
                  kr_seq_cache_fork(c, &leader->cache, leader->n_fed, &ch->cache) == KR_OK;
        if (ok && PUSH(e, running, ch, false) != KR_OK) {
            ok = false;
        }
        if (!ok) {
            if (ch->cache.slot >= 0) {
                kr_seq_cache_release(c, &ch->cache);
            }
            ch->state = KR_SEQ_WAITING;
            ch->n_fed = 0;
            if (waiting_insert(e, ch) != KR_OK) {
                finish_seq(e, ch, KR_FINISH_CANCELLED, -1);
            }
            continue;
        }
        ch->n_fed = leader->n_fed;
        ch->state = KR_SEQ_DECODE;
        ch->admit_seq = ++e->admit_counter;
        if (ch->admitted_us == 0) {
            ch->admitted_us = leader->admitted_us;
        }
    }
}

/* ---- sampling and stop conditions ------------------------------------------------------------ */

static bool is_eos(const struct kr_model_config *c, int32_t id)
{
    for (int32_t i = 0; i < c->n_eos; i++) {
        if (c->eos_ids[i] == id) {
            return true;
        }
    }
    return false;
}

/* Emits token `tok` of s (logprob and alternatives as the request asked; top holds at least
 * r->s.logprobs entries when that is positive) and finishes the choice when it ends. */
static void emit_token(struct kr_engine *e, struct seq *s, int32_t tok, float logprob, const int32_t *top_ids,
                       const float *top_lps)
{
    struct req *r = s->req;
    const struct kr_model_config *c = &e->m->cfg;
    struct kr_event ev = {.type = KR_EVENT_TOKEN, .index = s->index, .token = tok};
    if (s->n_gen == 0) {
        ev.queue_s = (s->admitted_us > 0 ? s->admitted_us - r->submitted_us : 0) / 1e6;
    }
    if (r->s.logprobs >= 0) {
        ev.logprob = logprob;
        if (r->s.logprobs > 0) {
            ev.n_top = r->s.logprobs < c->vocab ? r->s.logprobs : (int32_t)c->vocab;
            ev.top_ids = top_ids;
            ev.top_logprobs = top_lps;
        }
    }
    if (seq_append(s, tok) != KR_OK || kr_token_counts_add(&s->counts, tok, false) != KR_OK) {
        fail_req(e, r, KR_ERR_NOMEM, "out of memory");
        return;
    }
    s->n_gen++;
    e->gen_tokens++;
    emit(e, r, &ev);
    bool stop = !r->s.ignore_eos && is_eos(c, tok);
    for (int32_t i = 0; i < r->s.n_stop_ids && !stop; i++) {
        stop = r->s.stop_ids[i] == tok;
    }
    if (stop && s->n_gen >= r->s.min_tokens) {
        finish_seq(e, s, KR_FINISH_STOP, tok);
    } else if (s->n_gen >= r->s.max_tokens || s->n_toks >= e->cfg.max_model_len) {
        finish_seq(e, s, KR_FINISH_LENGTH, -1);
    }
}

/* Samples the next token of s from `logits` (host memory) and emits it. */
static void sample_and_emit(struct kr_engine *e, struct seq *s, const float *logits)
{
    struct req *r = s->req;
    const struct kr_model_config *c = &e->m->cfg;
    int32_t tok = 0;
    enum kr_status st = kr_sample(&r->s, logits, c->vocab, &s->counts, s->n_gen, c->eos_ids, c->n_eos, &s->rng,
                                  &e->scratch, &tok);
    if (st != KR_OK) {
        fail_req(e, r, st, "sampling failed");
        return;
    }
    float lp = 0;
    if (r->s.logprobs >= 0) {
        kr_log_softmax(logits, e->lp_row, c->vocab);
        lp = e->lp_row[tok];
        if (r->s.logprobs > 0) {
            const int32_t k = r->s.logprobs < c->vocab ? r->s.logprobs : (int32_t)c->vocab;
            kr_top_k_ids(e->lp_row, c->vocab, k, e->top_ids);
            for (int32_t i = 0; i < k; i++) {
                e->top_lps[i] = e->lp_row[e->top_ids[i]];
            }
        }
    }
    emit_token(e, s, tok, lp, e->top_ids, e->top_lps);
}

/* ---- sampling on the backend ------------------------------------------------------------------ */

static enum kr_status ensure_sample_buffers(struct kr_engine *e, int32_t n, int64_t n_pen)
{
    if (n > e->cap_srows) {
        const int32_t c = n + 16;
        kr_free(e->s_seqs);
        kr_free(e->srows);
        kr_free(e->s_out);
        kr_free(e->s_lp);
        kr_free(e->s_top_ids);
        kr_free(e->s_top_lp);
        e->s_seqs = kr_malloc((size_t)c * sizeof *e->s_seqs);
        e->srows = kr_malloc((size_t)c * sizeof *e->srows);
        e->s_out = kr_malloc((size_t)c * sizeof(int32_t));
        e->s_lp = kr_malloc((size_t)c * sizeof(float));
        e->s_top_ids = kr_malloc((size_t)c * KR_MAX_TOP_LOGPROBS * sizeof(int32_t));
        e->s_top_lp = kr_malloc((size_t)c * KR_MAX_TOP_LOGPROBS * sizeof(float));
        e->cap_srows = e->s_seqs && e->srows && e->s_out && e->s_lp && e->s_top_ids && e->s_top_lp ? c : 0;
        if (!e->cap_srows) {
            return KR_ERR_NOMEM;
        }
    }
    if (n_pen > e->cap_pen) {
        const int64_t c = n_pen + n_pen / 2 + 256;
        kr_free(e->pen_ids);
        kr_free(e->pen_count);
        kr_free(e->pen_flags);
        e->pen_ids = kr_malloc((size_t)c * sizeof(int32_t));
        e->pen_count = kr_malloc((size_t)c * sizeof(int32_t));
        e->pen_flags = kr_malloc((size_t)c);
        e->cap_pen = e->pen_ids && e->pen_count && e->pen_flags ? c : 0;
        if (!e->cap_pen) {
            return KR_ERR_NOMEM;
        }
    }
    return KR_OK;
}

static bool penalised(const struct kr_sampling *p)
{
    return p->repetition_penalty != 1.0f || p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f;
}

/* Upper bound on the penalty and mask entries of sequence s's row (no pass over its counts). */
static int64_t pen_bound(const struct kr_engine *e, const struct seq *s)
{
    const struct kr_sampling *p = &s->req->s;
    int64_t n = penalised(p) ? s->counts.used : 0;
    if (s->n_gen < p->min_tokens) {
        n += (p->ignore_eos ? 0 : e->m->cfg.n_eos) + p->n_stop_ids;
    }
    return n;
}

/* Writes sequence s's penalty and mask entries at `at`; returns how many. */
static int64_t pen_fill(struct kr_engine *e, const struct seq *s, int64_t at)
{
    const struct kr_sampling *p = &s->req->s;
    const struct kr_model_config *c = &e->m->cfg;
    int64_t n = 0;
    if (penalised(p) && s->counts.cap) {
        for (int32_t i = 0; i < s->counts.cap; i++) {
            const int32_t id = s->counts.ids[i];
            if (id < 0 || (!s->counts.in_prompt[i] && !s->counts.n_out[i])) {
                continue;
            }
            e->pen_ids[at + n] = id;
            e->pen_count[at + n] = s->counts.n_out[i];
            e->pen_flags[at + n] = s->counts.in_prompt[i] ? 1 : 0;
            n++;
        }
    }
    if (s->n_gen < p->min_tokens) {
        for (int32_t i = 0; i < c->n_eos && !p->ignore_eos; i++, n++) {
            e->pen_ids[at + n] = c->eos_ids[i];
            e->pen_count[at + n] = 0;
            e->pen_flags[at + n] = 2;
        }
        for (int32_t i = 0; i < p->n_stop_ids; i++, n++) {
            e->pen_ids[at + n] = p->stop_ids[i];
            e->pen_count[at + n] = 0;
            e->pen_flags[at + n] = 2;
        }
    }
    return n;
}

/* Samples the rows of the step's output on the backend: row i of the model's last logits belongs
 * to seqs[i]. The generator of each sequence advances exactly as on the host path (one draw per
 * non-greedy row). Results in e->s_out / s_lp / s_top_* (s_lp only when a sequence asked for
 * log-probabilities). */
static enum kr_status sample_on_backend(struct kr_engine *e, struct seq **seqs, int32_t n, int32_t *n_top_out)
{
    int64_t n_pen = 0;
    int32_t n_top = 0;
    bool want_lp = false; /* the chosen tokens' log-probabilities cost a log-sum-exp over each row */
    for (int32_t i = 0; i < n; i++) {
        n_pen += pen_bound(e, seqs[i]);
        const int32_t k = seqs[i]->req->s.logprobs;
        n_top = k > n_top ? k : n_top;
        want_lp |= k >= 0;
    }
    n_top = n_top < e->m->cfg.vocab ? n_top : (int32_t)e->m->cfg.vocab;
    KR_TRY(ensure_sample_buffers(e, n, n_pen));
    int64_t at = 0;
    for (int32_t i = 0; i < n; i++) {
        struct seq *s = seqs[i];
        const struct kr_sampling *p = &s->req->s;
        const int64_t k = pen_fill(e, s, at);
        e->srows[i] = (struct kr_sample_row){.temperature = p->temperature, .top_k = p->top_k, .top_p = p->top_p,
                                             .min_p = p->min_p, .presence = p->presence_penalty,
                                             .frequency = p->frequency_penalty,
                                             .repetition = p->repetition_penalty, .pen_off = (int32_t)at,
                                             .pen_n = (int32_t)k,
                                             .u = p->temperature > 0.0f ? kr_rng_uniform(&s->rng) : 0.0};
        at += k;
    }
    struct kr_sample_batch sb = {.logits = e->m->last_logits, .ld = e->m->cfg.vocab, .n = n,
                                 .vocab = e->m->cfg.vocab, .rows = e->srows, .pen_ids = e->pen_ids,
                                 .pen_count = e->pen_count, .pen_flags = e->pen_flags, .n_pen = at,
                                 .out = e->s_out, .out_logprob = want_lp ? e->s_lp : NULL, .n_top = n_top,
                                 .top_ids = e->s_top_ids, .top_lp = e->s_top_lp};
    *n_top_out = n_top;
    return kr_backend_sample(e->m->be, &sb);
}

/* Accumulates prompt log-probabilities from rows of prompt positions [p0, p0 + n) and emits them
 * once complete. rows hold raw logits. */
static void prompt_logprobs_rows(struct kr_engine *e, struct req *r, int32_t p0, int32_t n, const float *rows)
{
    const int64_t V = e->m->cfg.vocab;
    const int32_t k = r->s.prompt_logprobs;
    const int32_t *prompt = r->seqs[0].toks;
    for (int32_t i = 0; i < n; i++) {
        const int32_t t = p0 + i; /* row t predicts prompt[t + 1] */
        if (t + 1 >= r->n_prompt) {
            break;
        }
        kr_log_softmax(rows + (size_t)i * (size_t)V, e->lp_row, V);
        r->plp[t + 1] = e->lp_row[prompt[t + 1]];
        if (k > 0) {
            kr_top_k_ids(e->lp_row, V, k, r->plp_ids + (size_t)(t + 1) * (size_t)k);
            for (int32_t j = 0; j < k; j++) {
                r->plp_top[(size_t)(t + 1) * (size_t)k + (size_t)j] =
                    e->lp_row[r->plp_ids[(size_t)(t + 1) * (size_t)k + (size_t)j]];
            }
        }
        r->plp_rows = t + 2;
    }
    if (r->plp_rows >= r->n_prompt && !r->prompt_lp_sent) {
        r->prompt_lp_sent = true;
        struct kr_event ev = {.type = KR_EVENT_PROMPT_LOGPROBS,
                              .n_prompt = r->n_prompt,
                              .prompt_logprobs = r->plp,
                              .prompt_top_ids = k > 0 ? r->plp_ids : NULL,
                              .prompt_top_logprobs = k > 0 ? r->plp_top : NULL,
                              .prompt_top_k = k};
        emit(e, r, &ev);
    }
}

/* ---- the step ------------------------------------------------------------------------------------ */

static enum kr_status ensure_step_buffers(struct kr_engine *e, int32_t n_tok, int32_t n_seq, int32_t n_bt,
                                          size_t n_logits)
{
    if (n_tok > e->cap_tok) {
        int32_t c = n_tok + 64;
        kr_free(e->b_tokens);
        kr_free(e->b_pos);
        kr_free(e->b_out);
        e->b_tokens = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_pos = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_out = kr_malloc((size_t)c * sizeof(int32_t));
        e->cap_tok = e->b_tokens && e->b_pos && e->b_out ? c : 0;
        if (!e->cap_tok) {
            return KR_ERR_NOMEM;
        }
    }
    if (n_seq + 1 > e->cap_seq) {
        int32_t c = n_seq + 17;
        kr_free(e->b_tok0);
        kr_free(e->b_pos0);
        kr_free(e->b_slot);
        kr_free(e->b_nsched);
        kr_free(e->b_seqs);
        e->b_tok0 = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_pos0 = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_slot = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_nsched = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_seqs = kr_malloc((size_t)c * sizeof(struct seq *));
        e->cap_seq = e->b_tok0 && e->b_pos0 && e->b_slot && e->b_nsched && e->b_seqs ? c : 0;
        if (!e->cap_seq) {
            return KR_ERR_NOMEM;
        }
    }
    if (n_bt > e->cap_bt) {
        kr_free(e->b_bt);
        e->b_bt = kr_malloc((size_t)n_bt * sizeof(int32_t));
        e->cap_bt = e->b_bt ? n_bt : 0;
        if (!e->b_bt) {
            return KR_ERR_NOMEM;
        }
    }
    if (n_logits > e->cap_logits) {
        kr_free(e->logits);
        e->logits = kr_malloc(n_logits * sizeof(float));
        e->cap_logits = e->logits ? n_logits : 0;
        if (!e->logits) {
            return KR_ERR_NOMEM;
        }
    }
    return KR_OK;
}

/* Rows of prompt log-probabilities a chunk [n_fed, n_fed + k) of s contributes (0 if none). */
static bool wants_prompt_rows(const struct seq *s)
{
    const struct req *r = s->req;
    return s->index == 0 && r->s.prompt_logprobs >= 0 && !r->prompt_lp_sent && s->n_fed < r->n_prompt;
}

/* Plans one step: decodes first, then running prefills, then admissions (FCFS). Fills the
 * per-sequence token counts into b_nsched/b_seqs and returns the number of sequences. */
static int32_t plan(struct kr_engine *e, int32_t *n_tok_out)
{
    struct kr_cache *c = e->cache;
    const bool paged = c->n_attn || c->n_mla;
    int32_t budget = e->cfg.max_num_batched_tokens, ns = 0, nt = 0;
    /* 1. decodes, oldest first; a decode that needs a block it cannot get preempts the youngest */
    for (int32_t i = 0; i < e->n_running && budget > 0; i++) {
        struct seq *s = e->running[i];
        if (s->state != KR_SEQ_DECODE) {
            continue;
        }
        bool victim_self = false;
        while (paged && kr_seq_cache_reserve(c, &s->cache, s->n_fed + 1) != KR_OK) {
            struct seq *v = youngest_running(e, NULL);
            victim_self = v == s;
            /* a victim already scheduled this step gives back its tokens */
            for (int32_t j = 0; j < ns; j++) {
                if (e->b_seqs[j] == v) {
                    nt -= e->b_nsched[j];
                    budget += e->b_nsched[j];
                    memmove(e->b_seqs + j, e->b_seqs + j + 1, (size_t)(ns - j - 1) * sizeof(struct seq *));
                    memmove(e->b_nsched + j, e->b_nsched + j + 1, (size_t)(ns - j - 1) * sizeof(int32_t));
                    ns--;
                    break;
                }
            }
            for (int32_t j = 0; j < e->n_running; j++) {
                if (e->running[j] == v && j <= i) {
                    i--; /* the list shifts under the loop */
                    break;
                }
            }
            preempt(e, v);
            if (victim_self) {
                break;
            }
        }
        if (victim_self) {
            continue;
        }
        e->b_seqs[ns] = s;
        e->b_nsched[ns++] = 1;
        nt++;
        budget--;
    }
    /* 2. running prefills, oldest first */
    for (int32_t i = 0; i < e->n_running && budget > 0; i++) {
        struct seq *s = e->running[i];
        if (s->state != KR_SEQ_PREFILL) {
            continue;
        }
        int32_t k = s->n_toks - s->n_fed < budget ? s->n_toks - s->n_fed : budget;
        int32_t room = room_for(e, s);
        while (room == 0) { /* make room by preempting younger sequences, never older ones */
            struct seq *v = youngest_running(e, s);
            if (!v || v->admit_seq < s->admit_seq) {
                break;
            }
            bool scheduled = false;
            for (int32_t j = 0; j < ns; j++) {
                scheduled |= e->b_seqs[j] == v;
            }
            if (scheduled) {
                break; /* its decode is already in this step; wait for the next one */
            }
            preempt(e, v);
            room = room_for(e, s);
        }
        k = k < room ? k : room;
        if (k <= 0 || kr_seq_cache_reserve(c, &s->cache, s->n_fed + k) != KR_OK) {
            continue;
        }
        e->b_seqs[ns] = s;
        e->b_nsched[ns++] = k;
        nt += k;
        budget -= k;
    }
    /* 3. admissions in FCFS order; the head of the queue is never overtaken */
    while (e->n_waiting > 0 && budget > 0 && e->n_running < e->cfg.max_num_seqs) {
        struct seq *s = e->waiting[0];
        if (c->n_free_slots == 0) {
            break;
        }
        int32_t k = s->n_toks < budget ? s->n_toks : budget;
        if (paged) {
            const int64_t room = (int64_t)c->n_free_blocks * c->block_size;
            k = room < k ? (int32_t)room : k;
        }
        if (k <= 0) {
            break;
        }
        if (kr_seq_cache_init(c, &s->cache) != KR_OK) {
            break;
        }
        if (kr_seq_cache_reserve(c, &s->cache, k) != KR_OK || PUSH(e, running, s, false) != KR_OK) {
            kr_seq_cache_release(c, &s->cache);
            break;
        }
        REMOVE(e, waiting, s);
        s->state = KR_SEQ_PREFILL;
        s->n_fed = 0;
        s->admit_seq = ++e->admit_counter;
        if (s->admitted_us == 0) {
            s->admitted_us = kr_clock_us();
        }
        e->b_seqs[ns] = s;
        e->b_nsched[ns++] = k;
        nt += k;
        budget -= k;
    }
    *n_tok_out = nt;
    return ns;
}

static void fail_everything(struct kr_engine *e, const char *why);

static void run_step(struct kr_engine *e)
{
    const double t0 = kr_clock_us();
    const int64_t V = e->m->cfg.vocab;
    const int32_t max_seqs = e->n_running + e->n_waiting + 1;
    if (ensure_step_buffers(e, 1, max_seqs, 1, 1) != KR_OK) {
        return;
    }
    int32_t nt = 0;
    const int32_t ns = plan(e, &nt);
    if (ns == 0) {
        return;
    }
    /* batch arrays */
    int32_t max_blocks = 1, n_out = 0;
    for (int32_t j = 0; j < ns; j++) {
        struct seq *s = e->b_seqs[j];
        max_blocks = s->cache.n_blocks > max_blocks ? s->cache.n_blocks : max_blocks;
        const int32_t k = e->b_nsched[j];
        const bool last = s->n_fed + k == s->n_toks;
        n_out += wants_prompt_rows(s) ? k : (last ? 1 : 0);
    }
    if (ensure_step_buffers(e, nt, ns, ns * max_blocks, (size_t)(n_out ? n_out : 1) * (size_t)V) != KR_OK) {
        for (int32_t j = 0; j < ns; j++) {
            if (e->b_seqs[j]->state != KR_SEQ_DONE) {
                fail_req(e, e->b_seqs[j]->req, KR_ERR_NOMEM, "out of memory");
            }
        }
        free_dead(e);
        return;
    }
    int32_t t = 0, o = 0;
    for (int32_t j = 0; j < ns; j++) {
        struct seq *s = e->b_seqs[j];
        const int32_t k = e->b_nsched[j];
        e->b_tok0[j] = t;
        e->b_pos0[j] = s->n_fed;
        e->b_slot[j] = s->cache.slot;
        memset(e->b_bt + (size_t)j * (size_t)max_blocks, 0, (size_t)max_blocks * sizeof(int32_t));
        memcpy(e->b_bt + (size_t)j * (size_t)max_blocks, s->cache.blocks, (size_t)s->cache.n_blocks * sizeof(int32_t));
        const bool rows = wants_prompt_rows(s), last = s->n_fed + k == s->n_toks;
        for (int32_t i = 0; i < k; i++) {
            e->b_tokens[t + i] = s->toks[s->n_fed + i];
            e->b_pos[t + i] = s->n_fed + i;
            if (rows || (last && i == k - 1)) {
                e->b_out[o++] = t + i;
            }
        }
        t += k;
    }
    e->b_tok0[ns] = t;
    struct kr_batch b = {.n_tok = nt, .n_seq = ns, .tokens = e->b_tokens, .pos = e->b_pos, .seq_tok0 = e->b_tok0,
                         .seq_pos0 = e->b_pos0, .seq_slot = e->b_slot, .block_table = e->b_bt,
                         .max_blocks = max_blocks, .n_out = n_out, .out_tok = e->b_out};
    const double t1 = kr_clock_us();
    const double gap = e->t_step_done > 0 ? t1 - e->t_step_done : -1.0; /* counted with the step's stats */
    e->t_step_done = 0;
    struct kr_err err = {{0}};
    /* sampling on the backend when every output row of the step is one sequence's next token
     * (no prompt log-probability rows, no n > 1 fork sampling several choices from one row, no
     * logit_bias, which the device sampler does not apply) */
    bool dev = e->dev_sample && n_out > 0;
    for (int32_t j = 0; j < ns && dev; j++) {
        struct seq *s = e->b_seqs[j];
        const bool last = s->n_fed + e->b_nsched[j] == s->n_toks;
        if (wants_prompt_rows(s) || (last && s->state == KR_SEQ_PREFILL && s->index == 0 && s->req->n > 1) ||
            s->req->s.n_bias > 0) {
            dev = false; /* host rows, forks and logit_bias take the host sampler */
        }
    }
    enum kr_status st = kr_model_forward(e->m, e->cache, &b, dev ? NULL : e->logits, &err);
    if (++e->step_attempts == (uint64_t)e->fault_step && st == KR_OK) {
        st = KR_ERR_CUDA; /* KRAIT_FAULT_STEP: this step fails as a device error would */
        snprintf(err.msg, sizeof err.msg, "injected %s failure of step %lld", e->fault_fatal ? "fatal" : "transient",
                 (long long)e->fault_step);
    }
    /* the device is busy with this step now: deliver the previous step's events meanwhile */
    flush_events(e);
    int32_t n_top = 0;
    if (st == KR_OK && dev && (st = ensure_sample_buffers(e, n_out, 0)) == KR_OK) {
        /* the sequences of the output rows, in row order */
        int32_t r = 0;
        for (int32_t j = 0; j < ns; j++) {
            struct seq *s = e->b_seqs[j];
            if (s->n_fed + e->b_nsched[j] == s->n_toks) {
                e->s_seqs[r++] = s;
            }
        }
        st = r == n_out ? sample_on_backend(e, e->s_seqs, r, &n_top) : KR_ERR_INTERNAL;
        if (st != KR_OK) {
            snprintf(err.msg, sizeof err.msg, "sampling on the backend failed: %s", kr_status_str(st));
        }
    }
    if (st != KR_OK && (!kr_backend_check(e->m->be) || (e->fault_fatal && e->step_attempts == (uint64_t)e->fault_step))) {
        /* a sticky device error: the context cannot recover, nothing else will run */
        fail_everything(e, err.msg[0] ? err.msg : kr_status_str(st));
        return;
    }
    if (st != KR_OK) {
        /* not sticky: only the requests of this step fail */
        KR_LOG_ERROR("step failed: %s", err.msg);
        for (int32_t j = 0; j < ns; j++) {
            if (e->b_seqs[j]->state != KR_SEQ_DONE) {
                fail_req(e, e->b_seqs[j]->req, st, err.msg[0] ? err.msg : kr_status_str(st));
            }
        }
        free_dead(e);
        return;
    }
    e->steps++;
    e->t_step_done = kr_clock_us();
    /* results, sequence by sequence, in batch order */
    o = 0;
    for (int32_t j = 0; j < ns; j++) {
        struct seq *s = e->b_seqs[j];
        const int32_t k = e->b_nsched[j];
        const bool rows = wants_prompt_rows(s), last = s->n_fed + k == s->n_toks;
        const int32_t n_rows = rows ? k : (last ? 1 : 0);
        const float *first = e->logits + (size_t)o * (size_t)V;
        o += n_rows;
        if (s->state == KR_SEQ_DONE) {
            continue; /* failed above with its request */
        }
        if (s->state == KR_SEQ_PREFILL) {
            e->prompt_tokens += (uint64_t)k;
        }
        if (rows) {
            prompt_logprobs_rows(e, s->req, s->n_fed, k, first);
        }
        s->n_fed += k;
        s->cache.n_pos = s->n_fed;
        if (!last) {
            continue;
        }
        const int32_t row_i = o - 1; /* this sequence's output row (the last of its rows) */
        const float *row = dev ? NULL : first + (size_t)(n_rows - 1) * (size_t)V;
        struct req *r = s->req;
        if (s->state == KR_SEQ_PREFILL) {
            s->state = KR_SEQ_DECODE;
            if (s->index == 0 && r->n > 1) {
                fork_children(e, s);
                for (int32_t i = 1; i < r->n; i++) {
                    struct seq *ch = &r->seqs[i];
                    if (ch->state == KR_SEQ_DECODE && ch->n_gen == 0 && ch->n_fed == s->n_fed) {
                        sample_and_emit(e, ch, row);
                    }
                }
            }
        }
        if (s->state == KR_SEQ_DONE) {
            continue;
        }
        if (!dev) {
            sample_and_emit(e, s, row);
        } else if (e->s_out[row_i] >= 0) {
            /* s_lp holds this step's values only when a sequence of it asked for log-probabilities */
            emit_token(e, s, e->s_out[row_i], r->s.logprobs >= 0 ? e->s_lp[row_i] : NAN,
                       e->s_top_ids + (size_t)row_i * (size_t)n_top,
                       e->s_top_lp + (size_t)row_i * (size_t)n_top);
        } else {
            /* a row the backend refused (all logits masked, ...): the host sampler says why */
            if (kr_backend_copy_d2h(e->m->be, e->logits, e->m->last_logits + (size_t)row_i * (size_t)V,
                                    (size_t)V * sizeof(float)) != KR_OK) {
                fail_req(e, r, KR_ERR_CUDA, "sampling failed");
            } else {
                sample_and_emit(e, s, e->logits);
            }
        }
    }
    free_dead(e);
    pthread_mutex_lock(&e->lock);
    e->stats.step_sched_us_last = t1 - t0;
    e->stats.step_sched_us_total += t1 - t0;
    if (gap >= 0) {
        e->stats.step_gap_us_total += gap;
        e->stats.step_gaps++;
    }
    pthread_mutex_unlock(&e->lock);
}

/* ---- ownership invariants (debug_checks) ------------------------------------------------------------
 * Every slot is either free or held by exactly one admitted sequence; every block's reference count
 * equals the number of block-table entries naming it, and free blocks have none. */
static const struct kr_seq_cache *running_cache(void *user, int32_t i)
{
    return &((const struct kr_engine *)user)->running[i]->cache;
}

static void check_invariants(struct kr_engine *e)
{
    for (int32_t i = 0; i < e->n_running; i++) {
        const struct seq *s = e->running[i];
        KR_ASSERT(s->state == KR_SEQ_PREFILL || s->state == KR_SEQ_DECODE);
        KR_ASSERT(s->n_fed <= s->n_toks);
    }
    kr_cache_check_owners(e->cache, e->n_running, running_cache, e);
    for (int32_t i = 0; i < e->n_waiting; i++) {
        KR_ASSERT(e->waiting[i]->state == KR_SEQ_WAITING);
    }
}

/* ---- intake and cancellation (engine thread) ------------------------------------------------------ */

/* Turns a submitted request into its sequences: choice 0 waits for admission, choices 1..n-1 wait
 * to fork from it. */
static void intake(struct kr_engine *e, struct req *r)
{
    /* the retired list holds at most every live request and the ones retired this step: room for
     * all of them now, so that retiring never allocates */
    const int32_t need_dead = e->n_reqs + e->n_dead + 1;
    if (e->cap_dead < need_dead) {
        const int32_t nc = need_dead > 2 * e->cap_dead ? need_dead : 2 * e->cap_dead;
        struct req **nd = kr_realloc(e->dead, (size_t)nc * sizeof *nd);
        if (nd) {
            e->dead = nd;
            e->cap_dead = nc;
        }
    }
    if (e->failed || e->cap_dead < need_dead || PUSH(e, reqs, r, false) != KR_OK) {
        struct kr_event ev = {.type = KR_EVENT_ERROR, .status = e->failed ? KR_ERR_CUDA : KR_ERR_NOMEM,
                              .message = e->failed ? e->failed_msg : "out of memory"};
        emit(e, r, &ev);
        req_free(r);
        return;
    }
    r->seqs[0].arrival = ++e->arrival_counter;
    for (int32_t i = 1; i < r->n; i++) {
        r->seqs[i].arrival = r->seqs[0].arrival;
    }
    if (waiting_insert(e, &r->seqs[0]) != KR_OK) {
        fail_req(e, r, KR_ERR_NOMEM, "out of memory");
    }
}

static void cancel_id(struct kr_engine *e, uint64_t id, int32_t index)
{
    for (int32_t i = 0; i < e->n_reqs; i++) {
        struct req *r = e->reqs[i];
        if (r->id != id) {
            continue;
        }
        for (int32_t j = 0; j < r->n; j++) {
            if (index >= 0 && j != index) {
                continue;
            }
            if (r->seqs[j].state == KR_SEQ_FORK_WAIT && j > 0) {
                /* it has no state of its own yet: simply never fork it */
                finish_seq(e, &r->seqs[j], KR_FINISH_CANCELLED, -1);
                continue;
            }
            if (r->seqs[j].state != KR_SEQ_DONE) {
                finish_seq(e, &r->seqs[j], KR_FINISH_CANCELLED, -1);
            }
        }
        return;
    }
}

static int cancel_cmp(const void *a, const void *b)
{
    const struct cancel *x = a, *y = b;
    if (x->id != y->id) {
        return x->id < y->id ? -1 : 1;
    }
    return (x->index > y->index) - (x->index < y->index);
}

/* Applies a batch of cancellations: sorted so that repeats of one id cost nothing, each distinct
 * request looked up once. */
static void apply_cancels(struct kr_engine *e, struct cancel *c, int32_t n)
{
    if (n > 1) {
        qsort(c, (size_t)n, sizeof *c, cancel_cmp);
    }
    for (int32_t i = 0; i < n; i++) {
        if (i > 0 && c[i].id == c[i - 1].id && (c[i].index == c[i - 1].index || c[i - 1].index < 0)) {
            continue; /* the same cancellation again, or a choice of a request cancelled whole */
        }
        cancel_id(e, c[i].id, c[i].index);
    }
}

/* The device failed for good: every request ends with an error naming it, and so will every later
 * one (the server reports itself unhealthy and exits so that it is restarted). */
static void fail_everything(struct kr_engine *e, const char *why)
{
    pthread_mutex_lock(&e->lock);
    e->failed = true;
    snprintf(e->failed_msg, sizeof e->failed_msg, "the compute device failed (%.180s); the server must be restarted", why);
    pthread_mutex_unlock(&e->lock);
    KR_LOG_ERROR("%s", e->failed_msg);
    while (e->n_reqs > 0) {
        fail_req(e, e->reqs[0], KR_ERR_CUDA, e->failed_msg);
    }
    free_dead(e);
    flush_events(e);
}

static void *engine_main(void *arg)
{
    struct kr_engine *e = arg;
    pthread_mutex_lock(&e->lock);
    for (;;) {
        struct req *in = e->inbox_head;
        e->inbox_head = e->inbox_tail = NULL;
        /* every pending cancel, by swapping the queue with the engine's own array */
        struct cancel *batch = e->cancels;
        const int32_t n_c = e->n_cancels, cap_c = e->cap_cancels;
        e->cancels = e->cancels_w;
        e->cap_cancels = e->cap_cancels_w;
        e->cancels_w = batch;
        e->cap_cancels_w = cap_c;
        e->n_cancels = 0;
        const bool stop = e->stop;
        pthread_mutex_unlock(&e->lock);

        while (in) {
            struct req *next = in->next_in;
            intake(e, in);
            in = next;
        }
        apply_cancels(e, batch, n_c);
        if (stop) {
            while (e->n_reqs > 0) {
                struct req *r = e->reqs[0];
                for (int32_t j = 0; j < r->n; j++) {
                    if (r->seqs[j].state != KR_SEQ_DONE) {
                        finish_seq(e, &r->seqs[j], KR_FINISH_CANCELLED, -1);
                    }
                }
            }
            free_dead(e);
            flush_events(e);
            pthread_mutex_lock(&e->lock);
            e->idle = true;
            pthread_cond_broadcast(&e->idle_cv);
            break;
        }
        free_dead(e);
        if (e->n_running > 0 || e->n_waiting > 0) {
            const uint64_t steps = e->steps;
            run_step(e);
            if (e->steps == steps) {
                flush_events(e); /* no step ran: nothing else would deliver them soon */
            }
        }
        if (e->n_running == 0 && e->n_waiting == 0) {
            flush_events(e); /* nothing will run: deliver what is held before going idle */
            e->t_step_done = 0;
        }
        if (e->cfg.debug_checks) {
            check_invariants(e);
        }
        pthread_mutex_lock(&e->lock);
        /* the admission queue: requests never admitted yet (in the waiting list or the inbox) */
        int32_t queued = 0;
        for (int32_t i = 0; i < e->n_waiting; i++) {
            queued += e->waiting[i]->index == 0 && e->waiting[i]->n_gen == 0 && e->waiting[i]->admit_seq == 0;
        }
        for (const struct req *r = e->inbox_head; r; r = r->next_in) {
            queued++;
        }
        atomic_store(&e->queued, queued);
        e->stats.running = e->n_running;
        e->stats.waiting = e->n_waiting;
        e->stats.preemptions = e->preemptions;
        e->stats.prompt_tokens = e->prompt_tokens;
        e->stats.generation_tokens = e->gen_tokens;
        e->stats.steps = e->steps;
        e->stats.slots_free = e->cache->n_free_slots;
        e->stats.blocks_free = e->cache->n_free_blocks;
        const bool has_work = e->n_running > 0 || e->n_waiting > 0;
        if (!has_work && !e->inbox_head && e->n_cancels == 0 && !e->stop) {
            e->idle = true;
            pthread_cond_broadcast(&e->idle_cv);
            pthread_cond_wait(&e->wake, &e->lock);
        }
        e->idle = false;
    }
    pthread_mutex_unlock(&e->lock);
    return NULL;
}

/* ---- public API ------------------------------------------------------------------------------------ */

enum kr_status kr_engine_create(struct kr_model *m, const struct kr_engine_config *cfg_in, struct kr_engine **out,
                                struct kr_err *err)
{
    struct kr_engine_config cfg = *cfg_in;
    if (cfg.max_num_seqs < 1 || cfg.max_num_batched_tokens < 1 || cfg.block_size < 1 || cfg.max_queued_requests < 0) {
        return kr_err_set(err, KR_ERR_INVAL,
                          "engine: max_num_seqs, max_num_batched_tokens and block_size must be >= 1 (got %d, %d, %d)",
                          cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size);
    }
    if (cfg.max_model_len <= 0 || cfg.max_model_len > m->cfg.max_pos) {
        cfg.max_model_len = (int32_t)(m->cfg.max_pos < INT32_MAX ? m->cfg.max_pos : INT32_MAX);
    }
    const int32_t n_slots = cfg.n_slots > 0 ? cfg.n_slots : cfg.max_num_seqs;
    /* the step workspace and backend scratch for the largest step, so that serving allocates nothing */
    enum kr_status rst = kr_model_reserve(m, cfg.max_num_batched_tokens + cfg.max_num_seqs, cfg.max_num_seqs,
                                          cfg.max_num_seqs, cfg.max_model_len, cfg.block_size);
    if (rst != KR_OK) {
        return kr_err_set(err, rst, "engine: cannot reserve the forward workspace for %d tokens per step",
                          cfg.max_num_batched_tokens);
    }
    size_t slot_bytes, block_bytes;
    kr_cache_unit_bytes(m, cfg.block_size, &slot_bytes, &block_bytes);
    const size_t slots_total = slot_bytes * (size_t)n_slots;
    if (slots_total > cfg.cache_bytes) {
        return kr_err_set(err, KR_ERR_INVAL,
                          "engine: %d state slots need %zu bytes, more than the cache budget of %zu bytes", n_slots,
                          slots_total, cfg.cache_bytes);
    }
    int64_t n_blocks = 0;
    if (block_bytes) {
        n_blocks = (int64_t)((cfg.cache_bytes - slots_total) / block_bytes);
        if (n_blocks > INT32_MAX / 2) {
            n_blocks = INT32_MAX / 2;
        }
        if (n_blocks < 1) {
            return kr_err_set(err, KR_ERR_INVAL, "engine: the cache budget of %zu bytes leaves no room for one block",
                              cfg.cache_bytes);
        }
    }
    struct kr_engine *e = kr_calloc(1, sizeof *e);
    if (!e) {
        return KR_ERR_NOMEM;
    }
    e->m = m;
    e->cfg = cfg;
    e->slot_bytes = slot_bytes;
    e->block_bytes = block_bytes;
    enum kr_status st = kr_cache_create(m, n_slots, (int32_t)n_blocks, cfg.block_size, &e->cache);
    e->lp_row = kr_malloc((size_t)m->cfg.vocab * sizeof(float));
    e->cancels = kr_malloc(64 * sizeof *e->cancels);
    e->cancels_w = kr_malloc(64 * sizeof *e->cancels_w);
    e->cap_cancels = e->cap_cancels_w = 64;
    if (st != KR_OK || !e->lp_row || !e->cancels || !e->cancels_w) {
        kr_cache_free(e->cache);
        kr_free(e->lp_row);
        kr_free(e->cancels);
        kr_free(e->cancels_w);
        kr_free(e);
        return kr_err_set(err, st != KR_OK ? st : KR_ERR_NOMEM, "engine: cannot allocate the cache pools");
    }
    /* where tokens are drawn: on a GPU backend by default (the logits stay on the device) */
    struct kr_switches sw; /* KRAIT_BACKEND_SAMPLING, KRAIT_FAULT_STEP (util/switches.h) */
    if ((st = kr_switches_from_env(&sw, err)) != KR_OK) {
        kr_cache_free(e->cache);
        kr_free(e->lp_row);
        kr_free(e->cancels);
        kr_free(e->cancels_w);
        kr_free(e);
        return st;
    }
    int32_t where = sw.backend_sampling >= 0 ? sw.backend_sampling : cfg.backend_sampling;
    if (where < 0) {
        size_t fb, tb;
        where = kr_backend_mem_info(m->be, &fb, &tb) == KR_OK;
    }
    e->dev_sample = where && kr_backend_can_sample(m->be);
    if (sw.fault_step > 0) { /* step attempt N fails (tests) */
        e->fault_step = sw.fault_step;
        e->fault_fatal = sw.fault_fatal != 0;
        KR_LOG_WARN("KRAIT_FAULT_STEP=%lld%s: step %lld will fail%s", (long long)sw.fault_step,
                    e->fault_fatal ? ":fatal" : "", (long long)sw.fault_step, e->fault_fatal ? " as a lost device" : "");
    }
    e->defer_events = e->dev_sample; /* the device works while the host delivers events */
    atomic_init(&e->next_id, 1);
    atomic_init(&e->queued, 0);
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->idle_cv, NULL);
    e->stats.slots_total = n_slots;
    e->stats.blocks_total = (int32_t)n_blocks;
    e->stats.slots_free = n_slots;
    e->stats.blocks_free = (int32_t)n_blocks;
    e->stats.slot_bytes = slot_bytes;
    e->stats.block_bytes = block_bytes;
    KR_LOG_INFO("memory plan: %d state slots x %zu B + %lld blocks x %d tokens x %zu B = %zu B of %zu B budget "
                "(max_num_seqs=%d max_num_batched_tokens=%d max_model_len=%d)",
                n_slots, slot_bytes, (long long)n_blocks, cfg.block_size, block_bytes, kr_cache_bytes(e->cache),
                cfg.cache_bytes, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len);
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        kr_cache_free(e->cache);
        kr_free(e->lp_row);
        kr_free(e->cancels);
        kr_free(e->cancels_w);
        kr_free(e);
        return kr_err_set(err, KR_ERR_NOMEM, "engine: cannot start its thread");
    }
    *out = e;
    return KR_OK;
}

void kr_engine_free(struct kr_engine *e)
{
    if (!e) {
        return;
    }
    pthread_mutex_lock(&e->lock);
    e->stop = true;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->lock);
    pthread_join(e->thread, NULL);
    flush_events(e);
    e->defer_events = false;
    /* requests submitted after the thread's last look at the inbox */
    for (struct req *r = e->inbox_head; r;) {
        struct req *next = r->next_in;
        struct kr_event ev = {.type = KR_EVENT_FINISH, .finish = KR_FINISH_CANCELLED, .stop_token = -1};
        for (int32_t i = 0; i < r->n; i++) {
            ev.index = i;
            emit(e, r, &ev);
        }
        req_free(r);
        r = next;
    }
    pthread_mutex_destroy(&e->lock);
    pthread_cond_destroy(&e->wake);
    pthread_cond_destroy(&e->idle_cv);
    kr_cache_free(e->cache);
    kr_sampler_scratch_free(&e->scratch);
    kr_free(e->reqs);
    kr_free(e->dead);
    kr_free(e->waiting);
    kr_free(e->running);
    kr_free(e->cancels);
    kr_free(e->cancels_w);
    kr_free(e->b_tokens);
    kr_free(e->b_pos);
    kr_free(e->b_out);
    kr_free(e->b_tok0);
    kr_free(e->b_pos0);
    kr_free(e->b_slot);
    kr_free(e->b_bt);
    kr_free(e->b_nsched);
    kr_free(e->b_seqs);
    kr_free(e->logits);
    kr_free(e->lp_row);
    kr_free(e->s_seqs);
    kr_free(e->srows);
    kr_free(e->s_out);
    kr_free(e->s_lp);
    kr_free(e->s_top_ids);
    kr_free(e->s_top_lp);
    kr_free(e->pen_ids);
    kr_free(e->pen_count);
    kr_free(e->pen_flags);
    kr_free(e->outbox);
    kr_free(e);
}

enum kr_status kr_engine_submit(struct kr_engine *e, const struct kr_request_params *p, uint64_t *req_id,
                                struct kr_err *err)
{
    const struct kr_model_config *mc = &e->m->cfg;
    enum kr_status st = kr_sampling_validate(&p->sampling, mc->vocab, err);
    if (st != KR_OK) {
        return st;
    }
    if (!p->cb) {
        return kr_err_set(err, KR_ERR_INVAL, "a request needs an event callback");
    }
    if (p->n_prompt < 1 || !p->prompt) {
        return kr_err_set(err, KR_ERR_INVAL, "the prompt must hold at least one token");
    }
    if (p->n < 1 || p->n > e->cfg.max_num_seqs) {
        return kr_err_set(err, KR_ERR_INVAL, "n must be between 1 and %d (max_num_seqs), got %d", e->cfg.max_num_seqs,
                          p->n);
    }
    for (int32_t i = 0; i < p->n_prompt; i++) {
        if (p->prompt[i] < 0 || p->prompt[i] >= mc->vocab) {
            return kr_err_set(err, KR_ERR_INVAL, "prompt token %d at index %d is outside the vocabulary [0, %lld)",
                              p->prompt[i], i, (long long)mc->vocab);
        }
    }
    const int64_t total = (int64_t)p->n_prompt + p->sampling.max_tokens;
    if (p->n_prompt >= e->cfg.max_model_len) {
        return kr_err_set(err, KR_ERR_TOO_LONG,
                          "the prompt has %d tokens; this model's maximum context length is %d tokens", p->n_prompt,
                          e->cfg.max_model_len);
    }
    if (total > e->cfg.max_model_len) {
        return kr_err_set(err, KR_ERR_TOO_LONG,
                          "the prompt (%d tokens) plus max_tokens (%d) exceeds the maximum context length of %d tokens",
                          p->n_prompt, p->sampling.max_tokens, e->cfg.max_model_len);
    }
    const struct kr_cache *c = e->cache;
    if (c->n_attn || c->n_mla) {
        const int64_t need = (total + c->block_size - 1) / c->block_size;
        if (need > c->n_blocks) {
            return kr_err_set(err, KR_ERR_TOO_LONG,
                              "the request needs %lld cache blocks (%lld tokens) but the whole pool holds %d blocks",
                              (long long)need, (long long)total, c->n_blocks);
        }
    }
    if (e->cfg.max_queued_requests > 0 && atomic_load(&e->queued) >= e->cfg.max_queued_requests) {
        return kr_err_set(err, KR_ERR_BUSY, "too many requests are waiting (max_queued_requests=%d)",
                          e->cfg.max_queued_requests);
    }
    struct req *r = kr_calloc(1, sizeof *r);
    if (!r) {
        return KR_ERR_NOMEM;
    }
    r->cb = p->cb;
    r->user = p->user;
    r->n_prompt = p->n_prompt;
    r->n = p->n;
    r->s = p->sampling;
    r->seqs = kr_calloc((size_t)p->n, sizeof *r->seqs);
    if (!r->seqs) {
        req_free(r);
        return KR_ERR_NOMEM;
    }
    if (r->s.prompt_logprobs >= 0) {
        const int32_t k = r->s.prompt_logprobs;
        r->plp = kr_malloc((size_t)p->n_prompt * sizeof(float));
        r->plp_ids = kr_calloc((size_t)p->n_prompt * (size_t)(k ? k : 1), sizeof(int32_t));
        r->plp_top = kr_calloc((size_t)p->n_prompt * (size_t)(k ? k : 1), sizeof(float));
        if (!r->plp || !r->plp_ids || !r->plp_top) {
            req_free(r);
            return KR_ERR_NOMEM;
        }
        r->plp[0] = NAN;
        r->plp_rows = 1;
    }
    uint64_t base_seed = r->s.has_seed ? r->s.seed : 0;
    if (!r->s.has_seed) { /* unseeded: a fresh stream per request */
        const uint64_t ns = kr_clock_ns();
        base_seed = (ns % 1000000000u) ^ ((ns / 1000000000u) << 32) ^ (atomic_load(&e->next_id) * 0x9e3779b97f4a7c15ull);
    }
    for (int32_t i = 0; i < p->n; i++) {
        struct seq *s = &r->seqs[i];
        s->req = r;
        s->index = i;
        s->state = i == 0 ? KR_SEQ_WAITING : KR_SEQ_FORK_WAIT;
        s->cache.slot = -1;
        kr_rng_seed(&s->rng, base_seed + (uint64_t)i);
        kr_token_counts_init(&s->counts);
        for (int32_t j = 0; j < p->n_prompt; j++) {
            if (seq_append(s, p->prompt[j]) != KR_OK ||
                (r->s.repetition_penalty != 1.0f && kr_token_counts_add(&s->counts, p->prompt[j], true) != KR_OK)) {
                req_free(r);
                return KR_ERR_NOMEM;
            }
        }
    }
    r->id = atomic_fetch_add(&e->next_id, 1);
    r->submitted_us = kr_clock_us();
    pthread_mutex_lock(&e->lock);
    if (e->stop || e->failed) {
        const bool failed = e->failed;
        char msg[sizeof e->failed_msg];
        snprintf(msg, sizeof msg, "%s", e->failed_msg);
        pthread_mutex_unlock(&e->lock);
        req_free(r);
        return failed ? kr_err_set(err, KR_ERR_CUDA, "%s", msg)
                      : kr_err_set(err, KR_ERR_BUSY, "the engine is shutting down");
    }
    if (e->inbox_tail) {
        e->inbox_tail->next_in = r;
    } else {
        e->inbox_head = r;
    }
    e->inbox_tail = r;
    atomic_fetch_add(&e->queued, 1);
    e->idle = false;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->lock);
    *req_id = r->id;
    return KR_OK;
}

void kr_engine_cancel_choice(struct kr_engine *e, uint64_t req_id, int32_t index)
{
    pthread_mutex_lock(&e->lock);
    if (KR_ARRAY_RESERVE(e->cancels, e->cap_cancels, (int64_t)e->n_cancels + 1, 64) != KR_OK) {
        pthread_mutex_unlock(&e->lock);
        KR_LOG_ERROR("out of memory queueing the cancellation of request %llu", (unsigned long long)req_id);
        return;
    }
    e->cancels[e->n_cancels++] = (struct cancel){.id = req_id, .index = index};
    e->idle = false;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->lock);
}

void kr_engine_cancel(struct kr_engine *e, uint64_t req_id)
{
    kr_engine_cancel_choice(e, req_id, -1);
}

void kr_engine_wait_idle(struct kr_engine *e)
{
    pthread_mutex_lock(&e->lock);
    while (!e->idle || e->inbox_head || e->n_cancels) {
        pthread_cond_wait(&e->idle_cv, &e->lock);
    }
    pthread_mutex_unlock(&e->lock);
}

void kr_engine_get_stats(struct kr_engine *e, struct kr_engine_stats *s)
{
    pthread_mutex_lock(&e->lock);
    *s = e->stats;
    pthread_mutex_unlock(&e->lock);
}

struct kr_cache *kr_engine_cache(struct kr_engine *e)
{
    return e->cache;
}

bool kr_engine_failed(struct kr_engine *e)
{
    pthread_mutex_lock(&e->lock);
    const bool f = e->failed;
    pthread_mutex_unlock(&e->lock);
    return f;
}
