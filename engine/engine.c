/* The batching engine: request intake from any thread, cancellations, events, the engine thread
 * and the public API. The scheduler's step is in step.c, sampling in sample.c (engine-impl.h holds
 * what they share). See engine.h for the contract. */
#include "engine-impl.h"
#include "ranks.h"

#include "alloc.h"
#include "array.h"
#include "clock.h"
#include "log.h"
#include "switches.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>

void kr_engine_config_default(struct kr_engine_config *c)
{
    memset(c, 0, sizeof *c);
    c->max_num_seqs = 256;
    c->max_num_batched_tokens = 2048;
    c->block_size = 16;
    c->cache_bytes = (size_t)256 << 20;
    c->backend_sampling = -1;
    c->prefix_caching = true;
    c->prefix_state_interval = 2048;
    c->prefix_snapshots = -1;
}

/* ---- small dynamic arrays ---------------------------------------------------------------------- */

enum kr_status eng_ptr_push(void ***arr, int32_t *n, int32_t *cap, void *p, bool front)
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

void eng_ptr_remove(void **arr, int32_t *n, void *p)
{
    for (int32_t i = 0; i < *n; i++) {
        if (arr[i] == p) {
            memmove(arr + i, arr + i + 1, (size_t)(*n - i - 1) * sizeof(void *));
            (*n)--;
            return;
        }
    }
}


/* Inserts a preempted/forked-out sequence into the waiting queue by arrival (FCFS). */
enum kr_status eng_waiting_insert(struct kr_engine *e, struct seq *s)
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

enum kr_status eng_seq_append(struct seq *s, int32_t tok)
{
    if (KR_ARRAY_RESERVE(s->toks, s->cap_toks, (int64_t)s->n_toks + 1, 64) != KR_OK) {
        return KR_ERR_NOMEM;
    }
    s->toks[s->n_toks++] = tok;
    return KR_OK;
}

/* ---- events ---------------------------------------------------------------------------------- */

/* Delivers the events held in the outbox, in the order they were made. */
void eng_flush_events(struct kr_engine *e)
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
void eng_emit(struct kr_engine *e, struct req *r, struct kr_event *ev)
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
    eng_flush_events(e);
    r->cb(ev, r->user);
}

/* The prefix hashes of s's tokens up to position n_pos (computed as far as needed). */
const uint64_t *eng_seq_hashes(struct kr_engine *e, struct seq *s, int32_t n_pos)
{
    const int32_t nb = n_pos / e->cache->block_size;
    if (s->n_bh < nb + 1) {
        if (KR_ARRAY_RESERVE(s->bh, s->cap_bh, (int64_t)nb + 1, 16) != KR_OK) {
            return NULL;
        }
        if (s->n_bh == 0) {
            s->bh[0] = s->req->seed;
            s->n_bh = 1;
        }
        kr_prefix_hashes(e->cache, s->toks, s->n_bh, nb, s->bh);
        s->n_bh = nb + 1;
    }
    return s->bh;
}

/* keep: the caches are sound (the sequence finished, was cancelled between steps or preempted,
 * never a failed step): the prefix cache keeps what it computed. */
void eng_release_seq(struct kr_engine *e, struct seq *s, bool keep)
{
    eng_spec_end(e, s); /* draft state slots held in a step it leaves */
    if (s->state == KR_SEQ_PREFILL || s->state == KR_SEQ_DECODE) {
        const uint64_t *h = keep && e->cache->prefix ? eng_seq_hashes(e, s, s->cache.n_pos) : NULL;
        if (h) {
            kr_prefix_release(e->cache, &s->cache, s->toks, h);
        } else {
            kr_seq_cache_release(e->cache, &s->cache);
        }
        REMOVE(e, running, s);
    } else if (s->state == KR_SEQ_WAITING) {
        REMOVE(e, waiting, s);
    }
}

void eng_req_free(struct req *r)
{
    if (!r) {
        return;
    }
    for (int32_t i = 0; r->seqs && i < r->n; i++) {
        eng_seq_con_end(&r->seqs[i]);
        kr_free(r->seqs[i].toks);
        kr_free(r->seqs[i].bh);
        kr_ngram_free(&r->seqs[i].ngram);
        kr_token_counts_free(&r->seqs[i].counts);
    }
    if (r->con.iface) {
        r->con.iface->release(r->con.ctx);
    }
    kr_free(r->seqs);
    kr_free(r->plp);
    kr_free(r->plp_ids);
    kr_free(r->plp_top);
    kr_free(r->plp_rank);
    kr_free(r->snap_at);
    kr_free(r);
}

/* A request whose choices all ended: out of the live list now, freed by eng_free_dead() once no
 * pointer of the current step can reach it. */
void eng_retire(struct kr_engine *e, struct req *r)
{
    REMOVE(e, reqs, r);
    KR_ASSERT(e->n_dead < e->cap_dead); /* intake made room for every live request */
    e->dead[e->n_dead++] = r;
}

void eng_free_dead(struct kr_engine *e)
{
    for (int32_t i = 0; i < e->n_dead; i++) {
        eng_req_free(e->dead[i]);
    }
    e->n_dead = 0;
}

/* Ends one choice: frees its caches, sends FINISH, retires the request after its last choice. */
void eng_finish_seq(struct kr_engine *e, struct seq *s, enum kr_finish_reason why, int32_t stop_token)
{
    struct req *r = s->req;
    if (s->state == KR_SEQ_DONE) {
        return;
    }
    eng_release_seq(e, s, true);
    eng_seq_con_end(s);
    s->state = KR_SEQ_DONE;
    struct kr_event ev = {.type = KR_EVENT_FINISH, .index = s->index, .finish = why, .stop_token = stop_token};
    ev.usage.prompt_tokens = r->n_prompt;
    ev.usage.completion_tokens = s->n_gen;
    eng_emit(e, r, &ev);
    if (++r->n_done == r->n) {
        eng_retire(e, r);
    }
}

/* Fails a whole request (a backend error): ERROR event, everything freed. */
static void fail_req(struct kr_engine *e, struct req *r, enum kr_status st, const char *msg, bool lost)
{
    for (int32_t i = 0; i < r->n; i++) {
        struct seq *s = &r->seqs[i];
        if (s->state != KR_SEQ_DONE) {
            eng_release_seq(e, s, false); /* a failed step may have left its caches half written */
            eng_seq_con_end(s);
            s->state = KR_SEQ_DONE;
        }
    }
    struct kr_event ev = {.type = KR_EVENT_ERROR, .status = st, .message = msg, .device_lost = lost};
    eng_emit(e, r, &ev);
    r->n_done = r->n;
    eng_retire(e, r);
}

void eng_fail_req(struct kr_engine *e, struct req *r, enum kr_status st, const char *msg)
{
    fail_req(e, r, st, msg, false);
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
                              .message = e->failed ? e->failed_msg : "out of memory", .device_lost = e->failed};
        eng_emit(e, r, &ev);
        eng_req_free(r);
        return;
    }
    r->seqs[0].arrival = ++e->arrival_counter;
    for (int32_t i = 1; i < r->n; i++) {
        r->seqs[i].arrival = r->seqs[0].arrival;
    }
    if (eng_waiting_insert(e, &r->seqs[0]) != KR_OK) {
        eng_fail_req(e, r, KR_ERR_NOMEM, "out of memory");
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
                eng_finish_seq(e, &r->seqs[j], KR_FINISH_CANCELLED, -1);
                continue;
            }
            if (r->seqs[j].state != KR_SEQ_DONE) {
                eng_finish_seq(e, &r->seqs[j], KR_FINISH_CANCELLED, -1);
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

/* Mid-step (after the forward pass, before sampling): applies the cancellations queued since the
 * step began to the requests the engine already holds, so that a client that left during the step
 * costs no sampling and no token. The queue is left as it is (a cancellation of a request still in
 * the inbox must wait for its intake; applying one twice is harmless): it is only read, into the
 * engine thread's spare array, which the loop does not use until its next swap. */
void eng_apply_pending_cancels(struct kr_engine *e)
{
    pthread_mutex_lock(&e->lock);
    const int32_t n = e->n_cancels;
    if (n == 0 || (n > e->cap_cancels_w && KR_ARRAY_RESERVE(e->cancels_w, e->cap_cancels_w, n, 64) != KR_OK)) {
        pthread_mutex_unlock(&e->lock); /* nothing queued, or no memory for the copy: the loop applies them */
        return;
    }
    memcpy(e->cancels_w, e->cancels, (size_t)n * sizeof *e->cancels_w);
    pthread_mutex_unlock(&e->lock);
    apply_cancels(e, e->cancels_w, n);
}

/* The device failed for good: every request ends with an error naming it, and so will every later
 * one (the server reports itself unhealthy and exits so that it is restarted). */
void eng_fail_everything(struct kr_engine *e, const char *why)
{
    pthread_mutex_lock(&e->lock);
    snprintf(e->failed_msg, sizeof e->failed_msg, "the compute device failed (%.180s); the server must be restarted", why);
    pthread_mutex_unlock(&e->lock);
    KR_LOG_ERROR("%s", e->failed_msg);
    while (e->n_reqs > 0) {
        fail_req(e, e->reqs[0], KR_ERR_CUDA, e->failed_msg, true);
    }
    eng_free_dead(e);
    eng_flush_events(e);
    /* visible only now: a server that sees the failure shuts down and answers what is still open
     * with a message of its own, which must not overtake these requests' errors naming the cause
     * (the server looks at kr_engine_failed after each delivery and on a timer) */
    pthread_mutex_lock(&e->lock);
    e->failed = true;
    pthread_mutex_unlock(&e->lock);
}

static void *engine_main(void *arg)
{
    /* a name for top -H and /proc/PID/task; the OpenMP team this thread starts inherits it */
    prctl(PR_SET_NAME, "kr-engine", 0, 0, 0);
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
                        eng_finish_seq(e, &r->seqs[j], KR_FINISH_CANCELLED, -1);
                    }
                }
            }
            eng_free_dead(e);
            eng_flush_events(e);
            pthread_mutex_lock(&e->lock);
            e->idle = true;
            pthread_cond_broadcast(&e->idle_cv);
            break;
        }
        eng_free_dead(e);
        if (e->n_running > 0 || e->n_waiting > 0) {
            const uint64_t steps = e->steps;
            eng_run_step(e);
            eng_free_dead(e); /* requests a step retired without running (failed while it was planned) */
            if (e->steps == steps) {
                eng_flush_events(e); /* no step ran: nothing else would deliver them soon */
            }
        }
        if (e->n_running == 0 && e->n_waiting == 0) {
            eng_flush_events(e); /* nothing will run: deliver what is held before going idle */
            e->t_step_done = 0;
        }
        if (e->cfg.debug_checks) {
            eng_check_invariants(e);
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
        e->stats.masks = e->n_masks;
        e->stats.spec_drafts = e->spec_drafts;
        e->stats.spec_draft_tokens = e->spec_draft_tokens;
        e->stats.spec_accepted_tokens = e->spec_accepted;
        memcpy(e->stats.spec_accepted_per_pos, e->spec_accepted_pos, sizeof e->spec_accepted_pos);
        e->stats.mask_us_total = e->mask_us;
        e->stats.slots_free = e->cache->n_free_slots;
        e->stats.blocks_free = e->cache->n_free_blocks;
        if (e->cache->prefix) {
            struct kr_prefix_stats ps;
            kr_prefix_get_stats(e->cache, &ps);
            e->stats.prefix_queries = ps.queries;
            e->stats.prefix_hits = ps.hits;
            e->stats.prefix_block_only = ps.block_only;
            e->stats.prefix_snapshots = ps.snapshots;
            e->stats.prefix_evicted_snapshots = ps.evicted_snapshots;
            e->stats.prefix_evicted_blocks = ps.evicted_blocks;
            e->stats.snapshots_used = ps.snaps_used;
            e->stats.blocks_cached = ps.blocks_cached;
        }
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

/* What kr_engine_create_group allocated before a later step of it failed. */
static void create_undo(struct kr_engine *e)
{
    kr_ranks_stop(e->ranks);
    kr_cache_free(e->cache);
    kr_free(e->lp_row);
    kr_free(e->cancels);
    kr_free(e->cancels_w);
    kr_free(e);
}

enum kr_status kr_engine_create(struct kr_model *m, const struct kr_engine_config *cfg_in, struct kr_engine **out,
                                struct kr_err *err)
{
    return kr_engine_create_group(&m, 1, cfg_in, out, err);
}

enum kr_status kr_engine_create_group(struct kr_model *const *ranks, int32_t n_ranks,
                                      const struct kr_engine_config *cfg_in, struct kr_engine **out, struct kr_err *err)
{
    struct kr_model *m = ranks[0];
    struct kr_engine_config cfg = *cfg_in;
    if (cfg.max_num_seqs < 1 || cfg.max_num_batched_tokens < 1 || cfg.block_size < 1 || cfg.max_queued_requests < 0) {
        return kr_err_set(err, KR_ERR_INVAL,
                          "engine: max_num_seqs, max_num_batched_tokens and block_size must be >= 1 (got %d, %d, %d)",
                          cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size);
    }
    if (cfg.max_model_len <= 0 || cfg.max_model_len > m->cfg.max_pos) {
        cfg.max_model_len = (int32_t)(m->cfg.max_pos < INT32_MAX ? m->cfg.max_pos : INT32_MAX);
    }
    const struct kr_spec_config *sp = &cfg.spec;
    if (sp->method != KR_SPEC_OFF) {
        if (sp->method != KR_SPEC_NGRAM && sp->method != KR_SPEC_MTP) {
            return kr_err_set(err, KR_ERR_INVAL, "engine: unknown speculative decoding method %d", (int)sp->method);
        }
        if (sp->method == KR_SPEC_MTP && m->n_mtp == 0) {
            return kr_err_set(err, KR_ERR_INVAL,
                              "engine: MTP drafting needs the model's multi-token-prediction head, which was not loaded "
                              "(%s has num_nextn_predict_layers %d)", m->dir, m->cfg.n_mtp_layers);
        }
        if (sp->k < 1 || sp->k > KR_SPEC_MAX_TOKENS) {
            return kr_err_set(err, KR_ERR_INVAL, "engine: num_speculative_tokens must be in [1, %d] (got %d)",
                              KR_SPEC_MAX_TOKENS, sp->k);
        }
        if (sp->method == KR_SPEC_NGRAM && (sp->ngram_min < 1 || sp->ngram_max < sp->ngram_min)) {
            return kr_err_set(err, KR_ERR_INVAL,
                              "engine: n-gram drafting needs 1 <= prompt_lookup_min <= prompt_lookup_max (got %d and %d)",
                              sp->ngram_min, sp->ngram_max);
        }
        for (int32_t r = 0; sp->method == KR_SPEC_MTP && r < n_ranks; r++) {
            if (ranks[r]->n_mtp == 0) {
                return kr_err_set(err, KR_ERR_INVAL, "engine: rank %d has no MTP head loaded", r);
            }
        }
        if (m->n_mamba > 0 && !kr_backend_can_token_states(m->be)) {
            return kr_err_set(err, KR_ERR_UNSUPPORTED,
                              "engine: speculative decoding on a model with Mamba layers needs the states after each "
                              "draft, which the %s backend does not keep yet (the CPU backend does)",
                              kr_backend_name(m->be));
        }
    }
    if (cfg.batch_invariant) {
        if (sp->method != KR_SPEC_OFF) {
            return kr_err_set(err, KR_ERR_INVAL,
                              "engine: --batch-invariant with speculative decoding: a verification step computes "
                              "tokens as a chunk, plain decoding one at a time, so results would depend on the drafts");
        }
        if (!kr_backend_batch_invariant(m->be)) {
            return kr_err_set(err, KR_ERR_INVAL, "engine: --batch-invariant on a backend not set to it");
        }
        if (cfg.max_num_batched_tokens < KR_INVARIANT_CHUNK + cfg.max_num_seqs) {
            return kr_err_set(err, KR_ERR_INVAL,
                              "engine: --batch-invariant cuts prompts into chunks of %d tokens: "
                              "--max-num-batched-tokens (%d) must be at least that plus --max-num-seqs (%d)",
                              KR_INVARIANT_CHUNK, cfg.max_num_batched_tokens, cfg.max_num_seqs);
        }
        if (cfg.prefix_caching && m->n_mamba > 0) {
            KR_LOG_WARN("--batch-invariant: no prefix caching for a model with Mamba layers (a state snapshot "
                        "taken after decoded tokens is not what a prefill computes)");
            cfg.prefix_caching = false;
        }
    }
    const int32_t n_slots = cfg.n_slots > 0 ? cfg.n_slots : cfg.max_num_seqs;
    /* the step workspace and backend scratch for the largest step, so that serving allocates nothing;
     * a verification step has a logits row per draft too */
    const int64_t step_tok = (int64_t)cfg.max_num_batched_tokens + cfg.max_num_seqs;
    int64_t step_out = (int64_t)cfg.max_num_seqs * (sp->method != KR_SPEC_OFF ? 1 + sp->k : 1);
    step_out = step_out < step_tok ? step_out : step_tok;
    enum kr_status rst = KR_OK;
    for (int32_t r = 0; r < n_ranks && rst == KR_OK; r++) {
        rst = kr_model_reserve(ranks[r], step_tok, step_out, cfg.max_num_seqs, cfg.max_model_len, cfg.block_size);
    }
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
    /* speculative decoding's draft states: k slots per running sequence, or as many as a quarter of
     * the budget left after the running slots holds (a sequence drafts no more than the slots left
     * free; none when there is not one) */
    int32_t spec_slots = 0;
    if (sp->method != KR_SPEC_OFF && m->n_mamba > 0 && slot_bytes > 0) {
        const int64_t want = (int64_t)sp->k * cfg.max_num_seqs;
        const int64_t fit = (int64_t)((cfg.cache_bytes - slots_total) / 4 / slot_bytes);
        spec_slots = (int32_t)(want < fit ? want : fit);
        if (spec_slots < 1) {
            return kr_err_set(err, KR_ERR_INVAL,
                              "engine: no room for the state of one speculative draft (%zu bytes) in the cache budget "
                              "left after %d running slots", slot_bytes, n_slots);
        }
    }
    const size_t spec_total = slot_bytes * (size_t)spec_slots;
    /* the prefix cache's state snapshots: slots of their own, out of the budget left after the
     * running slots (by default an eighth of it); the blocks they pin come from the block pool */
    struct kr_cache_plan plan = {.n_slots = n_slots + spec_slots, .block_size = cfg.block_size,
                                 .prefix = cfg.prefix_caching, .state_interval = cfg.prefix_state_interval};
    if (cfg.prefix_caching && cfg.prefix_state_interval < 0) {
        return kr_err_set(err, KR_ERR_INVAL, "engine: prefix_state_interval must be >= 0 (got %d)",
                          cfg.prefix_state_interval);
    }
    if (cfg.prefix_caching && cfg.prefix_state_interval % cfg.block_size != 0) {
        return kr_err_set(err, KR_ERR_INVAL,
                          "engine: the prefix cache's state interval (%d tokens) must be a multiple of the block size "
                          "(%d tokens)", cfg.prefix_state_interval, cfg.block_size);
    }
    if (cfg.prefix_caching && m->n_mamba > 0 && slot_bytes > 0) {
        const size_t left = cfg.cache_bytes - slots_total - spec_total;
        int64_t ns = cfg.prefix_snapshots;
        if (ns < 0) {
            ns = (int64_t)(left / 8 / slot_bytes);
            ns = ns > 1024 ? 1024 : ns;
        }
        if ((size_t)ns * slot_bytes > left) {
            return kr_err_set(err, KR_ERR_INVAL,
                              "engine: %lld state snapshots need %zu bytes, more than the %zu bytes of cache budget "
                              "left after %d running slots", (long long)ns, (size_t)ns * slot_bytes, left, n_slots);
        }
        plan.n_snaps = (int32_t)ns;
    }
    const size_t snaps_total = slot_bytes * (size_t)plan.n_snaps;
    int64_t n_blocks = 0;
    if (block_bytes) {
        n_blocks = (int64_t)((cfg.cache_bytes - slots_total - spec_total - snaps_total) / block_bytes);
        if (n_blocks > INT32_MAX / 2) {
            n_blocks = INT32_MAX / 2;
        }
        plan.n_blocks = (int32_t)n_blocks;
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
    enum kr_status st = kr_cache_create_plan(m, &plan, &e->cache);
    e->lp_row = kr_malloc((size_t)m->cfg.vocab * sizeof(float));
    e->cancels = kr_malloc(64 * sizeof *e->cancels);
    e->cancels_w = kr_malloc(64 * sizeof *e->cancels_w);
    e->cap_cancels = e->cap_cancels_w = 64;
    if (st != KR_OK || !e->lp_row || !e->cancels || !e->cancels_w) {
        create_undo(e);
        return kr_err_set(err, st != KR_OK ? st : KR_ERR_NOMEM, "engine: cannot allocate the cache pools");
    }
    /* where tokens are drawn: on a GPU backend by default (the logits stay on the device) */
    struct kr_switches sw; /* KRAIT_BACKEND_SAMPLING, KRAIT_FAULT_STEP (util/switches.h) */
    if ((st = kr_switches_from_env(&sw, err)) != KR_OK) {
        create_undo(e);
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
    e->mask_words = (int32_t)((m->cfg.vocab + 31) / 32);
    atomic_init(&e->next_id, 1);
    atomic_init(&e->queued, 0);
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->idle_cv, NULL);
    e->stats.slots_total = n_slots + spec_slots;
    e->stats.blocks_total = (int32_t)n_blocks;
    e->stats.slots_free = n_slots + spec_slots;
    e->stats.spec_slots = spec_slots;
    e->stats.spec_k = sp->method != KR_SPEC_OFF ? sp->k : 0;
    e->spec_slots = spec_slots;
    e->stats.blocks_free = (int32_t)n_blocks;
    e->stats.slot_bytes = slot_bytes;
    e->stats.block_bytes = block_bytes;
    e->stats.prefix_caching = e->cache->prefix != NULL;
    e->stats.snapshots_total = plan.n_snaps;
    e->stats.snapshot_bytes = slot_bytes;
    if (e->cache->prefix) {
        if (m->n_mamba > 0) {
            KR_LOG_INFO("prefix cache: on; %d state snapshots x %zu B = %zu B beside the %d running slots (a "
                        "snapshot every %d prompt tokens, at each prompt's end, at each chat's last user turn and "
                        "when a sequence ends); full blocks shared by content; evicted least recently used",
                        plan.n_snaps, slot_bytes, snaps_total, n_slots, cfg.prefix_state_interval);
        } else {
            KR_LOG_INFO("prefix cache: on; full blocks shared by content and kept until evicted (least recently "
                        "used)");
        }
    } else {
        KR_LOG_INFO("prefix cache: off");
    }
    if (sp->method == KR_SPEC_MTP) {
        for (int32_t r = 0; r < n_ranks; r++) {
            ranks[r]->mtp_keep = true; /* every step keeps its residual stream for the head's pass */
        }
        KR_LOG_INFO("speculative decoding: drafts by the model's multi-token-prediction head (blocks %s, greedy, "
                    "chained), up to %d tokens per step; %d state slots x %zu B for the drafts' Mamba states",
                    m->cfg.mtp_pattern, sp->k, spec_slots, slot_bytes);
    } else if (sp->method != KR_SPEC_OFF) {
        KR_LOG_INFO("speculative decoding: n-gram drafts (prompt lookup, n = %d..%d), up to %d tokens per step; %d "
                    "state slots x %zu B for the drafts' Mamba states", sp->ngram_min, sp->ngram_max, sp->k,
                    spec_slots, slot_bytes);
    }
    KR_LOG_INFO("memory plan: (%d running + %d draft + %d snapshot) state slots x %zu B + %lld blocks x %d tokens x "
                "%zu B = %zu B of %zu B budget (max_num_seqs=%d max_num_batched_tokens=%d max_model_len=%d)",
                n_slots, spec_slots, plan.n_snaps, slot_bytes, (long long)n_blocks, cfg.block_size, block_bytes,
                kr_cache_bytes(e->cache), cfg.cache_bytes, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                cfg.max_model_len);
    if (n_ranks > 1 || cfg.cluster) {
        if ((st = kr_ranks_start(ranks + 1, n_ranks - 1, 1, &plan, cfg.cluster, &e->ranks, err)) != KR_OK) {
            create_undo(e);
            return st;
        }
        e->cache->on_copy = kr_ranks_record_copy;
        e->cache->on_copy_user = e->ranks;
        if (sw.fault_step > 0 && sw.fault_rank > 0 && sw.fault_rank < n_ranks) {
            kr_ranks_set_fault(e->ranks, sw.fault_rank, sw.fault_step);
            e->fault_step = 0; /* that rank fails, not this one */
            KR_LOG_WARN("KRAIT_FAULT_RANK=%d: rank %d fails step %lld", sw.fault_rank, sw.fault_rank,
                        (long long)sw.fault_step);
        }
        KR_LOG_INFO("tensor parallel: %d ranks, each with its shard and caches of this plan", n_ranks);
    }
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        create_undo(e);
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
    e->m->mtp_keep = false;
    eng_flush_events(e);
    e->defer_events = false;
    /* requests submitted after the thread's last look at the inbox */
    for (struct req *r = e->inbox_head; r;) {
        struct req *next = r->next_in;
        struct kr_event ev = {.type = KR_EVENT_FINISH, .finish = KR_FINISH_CANCELLED, .stop_token = -1};
        for (int32_t i = 0; i < r->n; i++) {
            ev.index = i;
            eng_emit(e, r, &ev);
        }
        eng_req_free(r);
        r = next;
    }
    pthread_mutex_destroy(&e->lock);
    pthread_cond_destroy(&e->wake);
    pthread_cond_destroy(&e->idle_cv);
    kr_ranks_stop(e->ranks);
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
    kr_free(e->b_keep);
    kr_free(e->b_tok0);
    kr_free(e->b_pos0);
    kr_free(e->b_slot);
    kr_free(e->b_bt);
    kr_free(e->b_nsched);
    kr_free(e->b_nout);
    kr_free(e->b_seqs);
    kr_free(e->logits);
    kr_free(e->mtp_i);
    kr_free(e->mtp_logits);
    kr_free(e->lp_row);
    kr_free(e->s_seqs);
    kr_free(e->s_host);
    kr_free(e->srows);
    kr_free(e->s_out);
    kr_free(e->s_rows);
    kr_free(e->s_lp);
    kr_free(e->s_top_ids);
    kr_free(e->s_top_lp);
    kr_free(e->pen_ids);
    kr_free(e->pen_count);
    kr_free(e->pen_flags);
    kr_free(e->masks);
    kr_free(e->row_mask);
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
    const struct kr_constraint_i *ci = p->constraint.iface;
    if (ci && (!ci->start || !ci->fill_mask || !ci->accept || !ci->stop || !ci->release)) {
        return kr_err_set(err, KR_ERR_INVAL, "a constraint needs every function of its interface");
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
        eng_req_free(r);
        return KR_ERR_NOMEM;
    }
    if (r->s.prompt_logprobs >= 0) {
        const int32_t k = r->s.prompt_logprobs;
        r->plp = kr_malloc((size_t)p->n_prompt * sizeof(float));
        r->plp_ids = kr_calloc((size_t)p->n_prompt * (size_t)(k ? k : 1), sizeof(int32_t));
        r->plp_top = kr_calloc((size_t)p->n_prompt * (size_t)(k ? k : 1), sizeof(float));
        r->plp_rank = kr_calloc((size_t)p->n_prompt, sizeof(int32_t));
        if (!r->plp || !r->plp_ids || !r->plp_top || !r->plp_rank) {
            eng_req_free(r);
            return KR_ERR_NOMEM;
        }
        r->plp[0] = NAN;
        r->plp_rows = 1;
    }
    r->seed = kr_prefix_seed(e->cache, p->cache_salt, p->cache_salt ? p->cache_salt_len : 0);
    if (p->n_snapshot_at > 0 && p->snapshot_at && e->cache->prefix) {
        r->snap_at = kr_malloc((size_t)p->n_snapshot_at * sizeof(int32_t));
        if (!r->snap_at) {
            eng_req_free(r);
            return KR_ERR_NOMEM;
        }
        for (int32_t i = 0; i < p->n_snapshot_at; i++) { /* inside the prompt, ascending, once each */
            const int32_t q = p->snapshot_at[i];
            if (q > 0 && q < p->n_prompt && (r->n_snap_at == 0 || q > r->snap_at[r->n_snap_at - 1])) {
                r->snap_at[r->n_snap_at++] = q;
            }
        }
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
            if (eng_seq_append(s, p->prompt[j]) != KR_OK ||
                (r->s.repetition_penalty != 1.0f && kr_token_counts_add(&s->counts, p->prompt[j], true) != KR_OK)) {
                eng_req_free(r);
                return KR_ERR_NOMEM;
            }
        }
    }
    r->id = atomic_fetch_add(&e->next_id, 1);
    r->submitted_us = kr_clock_us();
    const uint64_t id = r->id; /* r is the engine thread's once queued: it may end and be freed at once */
    pthread_mutex_lock(&e->lock);
    if (e->stop || e->failed) {
        const bool failed = e->failed;
        char msg[sizeof e->failed_msg];
        snprintf(msg, sizeof msg, "%s", e->failed_msg);
        pthread_mutex_unlock(&e->lock);
        eng_req_free(r);
        return failed ? kr_err_set(err, KR_ERR_CUDA, "%s", msg)
                      : kr_err_set(err, KR_ERR_BUSY, "the engine is shutting down");
    }
    r->con = p->constraint; /* held from here on: every failure above left it with the caller */
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
    *req_id = id;
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

