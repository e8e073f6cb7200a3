/* The engine's step: admission (FCFS, preempted first), preemption by recompute, forking the n > 1
 * choices of a prompt, planning a step under the token budget, running it and handing its results
 * to the sampler; the ownership invariants checked after a step in tests. */
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

/* ---- admission, preemption, fork --------------------------------------------------------------- */

static void preempt(struct kr_engine *e, struct seq *s)
{
    eng_spec_end(e, s);
    s->mtp_at = -1;
    /* its caches stay reusable: re-admitted, it starts from them unless they were evicted meanwhile */
    const uint64_t *h = e->cache->prefix ? eng_seq_hashes(e, s, s->cache.n_pos) : NULL;
    if (h) {
        kr_prefix_release(e->cache, &s->cache, s->toks, h);
    } else {
        kr_seq_cache_release(e->cache, &s->cache);
    }
    REMOVE(e, running, s);
    s->state = KR_SEQ_WAITING;
    s->n_fed = 0;
    e->preemptions++;
    if (eng_waiting_insert(e, s) != KR_OK) { /* cannot queue it again: end it rather than lose it */
        s->state = KR_SEQ_WAITING;
        eng_finish_seq(e, s, KR_FINISH_NOMEM, -1);
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

/* Tokens beyond n_fed that s can hold with its blocks plus the free pool, after evicting cached
 * prefixes that nobody holds to make room for `want` more tokens. */
static int32_t room_for(struct kr_engine *e, const struct seq *s, int32_t want)
{
    struct kr_cache *c = e->cache;
    if (c->n_attn == 0 && c->n_mla == 0) {
        return INT32_MAX;
    }
    const int64_t need = ((int64_t)s->n_fed + want + c->block_size - 1) / c->block_size - s->cache.n_blocks;
    if (need > c->n_free_blocks) {
        kr_prefix_reclaim(c, need > INT32_MAX ? INT32_MAX : (int32_t)need);
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
            if (eng_waiting_insert(e, ch) != KR_OK) {
                eng_finish_seq(e, ch, KR_FINISH_NOMEM, -1);
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

/* ---- the prefix cache's state snapshots ---------------------------------------------------------- */

/* Whether the engine takes state snapshots (a prefix cache over a model with Mamba layers). */
static bool snapshots_on(const struct kr_engine *e)
{
    return e->cache->prefix && e->cache->n_mamba > 0 && e->stats.snapshots_total > 0;
}

/* The first position after s->n_fed, inside its prompt, where the prefix cache wants a state
 * snapshot it does not have (a multiple of the state interval, or a position the request named),
 * or INT32_MAX. A prefill chunk ends there, so that the state after exactly that many tokens
 * exists between two steps. */
static int32_t next_snapshot_point(struct kr_engine *e, struct seq *s)
{
    if (!snapshots_on(e)) {
        return INT32_MAX;
    }
    const struct req *r = s->req;
    const int32_t I = e->cfg.prefix_state_interval, end = r->n_prompt < s->n_toks ? r->n_prompt : s->n_toks;
    int32_t at = s->n_fed, hint = 0;
    for (;;) {
        int32_t q = I > 0 ? (at / I + 1) * I : INT32_MAX;
        while (hint < r->n_snap_at && r->snap_at[hint] <= at) {
            hint++;
        }
        if (hint < r->n_snap_at && r->snap_at[hint] < q) {
            q = r->snap_at[hint];
        }
        if (q >= end) {
            return INT32_MAX;
        }
        const uint64_t *h = eng_seq_hashes(e, s, q);
        if (!h || !kr_prefix_has_snapshot(e->cache, s->toks, q, h)) {
            return q;
        }
        at = q; /* cached already: the next one */
    }
}

/* Tokens s may take this step: at most k, ending at its next snapshot point. */
static int32_t clip_at_snapshot(struct kr_engine *e, struct seq *s, int32_t k)
{
    const int32_t q = next_snapshot_point(e, s);
    return q != INT32_MAX && q - s->n_fed < k ? q - s->n_fed : k;
}

/* After a step fed s up to n_fed: registers its new full blocks and, at a snapshot point or at
 * the end of its prompt, snapshots its state. A failure only loses the reuse. */
static void after_step_cache(struct kr_engine *e, struct seq *s, bool was_prefill)
{
    struct kr_cache *c = e->cache;
    if (!c->prefix) {
        return;
    }
    const uint64_t *h = eng_seq_hashes(e, s, s->n_fed);
    if (!h) {
        return;
    }
    const int32_t full = s->n_fed / c->block_size;
    if ((c->n_attn || c->n_mla) && full > s->n_reg) {
        kr_prefix_register(c, &s->cache, s->n_reg, full, h);
        s->n_reg = full;
    }
    if (!was_prefill || !snapshots_on(e)) {
        return;
    }
    const struct req *r = s->req;
    bool point = s->n_fed == r->n_prompt;
    const int32_t I = e->cfg.prefix_state_interval;
    point |= s->n_fed < r->n_prompt && I > 0 && s->n_fed % I == 0;
    for (int32_t i = 0; i < r->n_snap_at && !point; i++) {
        point = r->snap_at[i] == s->n_fed;
    }
    if (point) {
        const enum kr_status st = kr_prefix_snapshot(c, &s->cache, s->toks, h);
        if (st != KR_OK) {
            KR_LOG_WARN("prefix cache: snapshot at %d tokens failed: %s", s->n_fed, kr_status_str(st));
        }
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
        kr_free(e->b_keep);
        e->b_tokens = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_pos = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_out = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_keep = kr_malloc((size_t)c * sizeof(int32_t));
        e->cap_tok = e->b_tokens && e->b_pos && e->b_out && e->b_keep ? c : 0;
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
        kr_free(e->b_nout);
        kr_free(e->b_seqs);
        e->b_tok0 = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_pos0 = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_slot = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_nsched = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_nout = kr_malloc((size_t)c * sizeof(int32_t));
        e->b_seqs = kr_malloc((size_t)c * sizeof(struct seq *));
        e->cap_seq = e->b_tok0 && e->b_pos0 && e->b_slot && e->b_nsched && e->b_nout && e->b_seqs ? c : 0;
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

/* Fails s's request while a step is planned, because memory ran out for its cache (its block
 * table could not grow): waiting or skipping it would retry forever while memory stays short.
 * Its sequences leave this step's batch (ns, nt, budget follow) and the running list; returns how
 * many of the running list's entries at or before index i went, by which the caller's loop index
 * moves back. */
static int32_t fail_planned(struct kr_engine *e, struct seq *s, int32_t i, int32_t *ns, int32_t *nt, int32_t *budget)
{
    struct req *r = s->req;
    int32_t gone = 0;
    for (int32_t j = 0; j <= i && j < e->n_running; j++) {
        gone += e->running[j]->req == r;
    }
    for (int32_t j = 0; j < *ns;) {
        if (e->b_seqs[j]->req != r) {
            j++;
            continue;
        }
        *nt -= e->b_nsched[j];
        *budget += e->b_nsched[j];
        memmove(e->b_seqs + j, e->b_seqs + j + 1, (size_t)(*ns - j - 1) * sizeof(struct seq *));
        memmove(e->b_nsched + j, e->b_nsched + j + 1, (size_t)(*ns - j - 1) * sizeof(int32_t));
        (*ns)--;
    }
    eng_fail_req(e, r, KR_ERR_NOMEM, "out of memory");
    return gone;
}

/* --batch-invariant: a prefill chunk of k tokens from n_fed ends at the prompt's end, or at a
 * multiple of KR_INVARIANT_CHUNK from its start and never one token short of the prompt's end (that
 * token would run alone, as a decode does); 0: the sequence waits for a step with more room. A
 * sequence preempted by recompute feeds its prompt again in the same chunks, then its generated
 * tokens one a step, as they were decoded: a token computed in a chunk is not the same bits as
 * the token computed alone, and the recomputed caches must be those the decode steps left. */
static int32_t invariant_cut(const struct kr_engine *e, const struct seq *s, int32_t k)
{
    if (!e->cfg.batch_invariant || k <= 0) {
        return k;
    }
    const int32_t np = s->req->n_prompt;
    if (s->n_fed >= np) {
        return 1;
    }
    if (s->n_fed + k >= np) {
        return np - s->n_fed;
    }
    int32_t end = (s->n_fed + k) / KR_INVARIANT_CHUNK * KR_INVARIANT_CHUNK;
    if (np - end == 1) {
        end -= KR_INVARIANT_CHUNK;
    }
    return end > s->n_fed ? end - s->n_fed : 0;
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
        enum kr_status rst = KR_OK;
        while (paged && (rst = kr_seq_cache_reserve(c, &s->cache, s->n_fed + 1)) != KR_OK) {
            if (rst == KR_ERR_NOMEM) {
                break; /* not a want of blocks: preempting others would not help */
            }
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
        if (rst == KR_ERR_NOMEM) {
            i -= fail_planned(e, s, i, &ns, &nt, &budget);
            continue;
        }
        e->b_seqs[ns] = s;
        e->b_nsched[ns++] = 1;
        nt++;
        budget--;
    }
    /* 1b. drafts for the decodes, once every decode has its room: speculation never preempts */
    for (int32_t j = 0; j < ns && budget > 0 && e->cfg.spec.method != KR_SPEC_OFF; j++) {
        const int32_t nd = eng_spec_plan(e, e->b_seqs[j], budget);
        e->b_nsched[j] += nd;
        nt += nd;
        budget -= nd;
    }
    eng_mtp_chain(e, ns); /* the MTP head's drafts after the first */
    /* 2. running prefills, oldest first */
    for (int32_t i = 0; i < e->n_running && budget > 0; i++) {
        struct seq *s = e->running[i];
        if (s->state != KR_SEQ_PREFILL) {
            continue;
        }
        int32_t k = s->n_toks - s->n_fed < budget ? s->n_toks - s->n_fed : budget;
        k = clip_at_snapshot(e, s, k);
        int32_t room = room_for(e, s, k);
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
            room = room_for(e, s, k);
        }
        k = invariant_cut(e, s, k < room ? k : room);
        const enum kr_status rst = k > 0 ? kr_seq_cache_reserve(c, &s->cache, s->n_fed + k) : KR_AGAIN;
        if (rst == KR_ERR_NOMEM) {
            i -= fail_planned(e, s, i, &ns, &nt, &budget);
            continue;
        }
        if (rst != KR_OK) {
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
        /* from the longest cached prefix, unless the request wants the prompt's log-probabilities
         * (they need every row) */
        const struct req *r = s->req;
        const int32_t n_look = s->n_toks - (e->cfg.batch_invariant ? 2 : 1); /* invariant: >= 2 tokens left */
        const bool lookup = c->prefix && n_look > 0 &&
                            !(s->index == 0 && r->s.prompt_logprobs >= 0 && !r->prompt_lp_sent);
        const uint64_t *h = lookup ? eng_seq_hashes(e, s, n_look) : NULL;
        if (paged && c->n_free_blocks == 0) {
            /* a block for its next token (a restored partial block is copied into one, with room left)
             * before anything is restored: a head that cannot start would otherwise restore a snapshot,
             * and count a query, every step */
            kr_prefix_reclaim(c, 1);
            if (c->n_free_blocks == 0) {
                break;
            }
        }
        int32_t hit = 0;
        const enum kr_status ast =
            h ? kr_prefix_admit(c, s->toks, n_look, h, &s->cache, &hit) : kr_seq_cache_init(c, &s->cache);
        if (ast == KR_ERR_NOMEM) {
            eng_fail_req(e, s->req, KR_ERR_NOMEM, "out of memory"); /* the head leaves the queue */
            continue;
        }
        if (ast != KR_OK) {
            break;
        }
        s->n_fed = hit;
        s->cache.n_pos = hit;
        s->n_reg = hit / c->block_size;
        int32_t k = s->n_toks - hit < budget ? s->n_toks - hit : budget;
        k = clip_at_snapshot(e, s, k);
        if (paged) {
            const int32_t room = room_for(e, s, k);
            k = room < k ? room : k;
        }
        k = invariant_cut(e, s, k);
        enum kr_status rst = k > 0 ? kr_seq_cache_reserve(c, &s->cache, hit + k) : KR_AGAIN;
        if (rst == KR_OK) {
            rst = PUSH(e, running, s, false);
        }
        if (rst != KR_OK) {
            kr_seq_cache_release(c, &s->cache);
            s->n_fed = 0;
            if (rst == KR_ERR_NOMEM) {
                eng_fail_req(e, s->req, KR_ERR_NOMEM, "out of memory");
                continue;
            }
            break;
        }
        REMOVE(e, waiting, s);
        s->state = KR_SEQ_PREFILL;
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

void eng_run_step(struct kr_engine *e)
{
    const double t0 = kr_clock_us();
    const int64_t V = e->m->cfg.vocab;
    int32_t max_seqs = e->n_running + e->n_waiting + 1;
    while (ensure_step_buffers(e, 1, max_seqs, 1, 1) != KR_OK) {
        /* no room to plan a step over every sequence: the newest request fails (out of memory) rather
         * than the engine retrying forever while memory stays short */
        struct seq *victim = e->n_waiting > 0   ? e->waiting[e->n_waiting - 1]
                             : e->n_running > 0 ? e->running[e->n_running - 1]
                                                : NULL;
        if (!victim) {
            return;
        }
        eng_fail_req(e, victim->req, KR_ERR_NOMEM, "out of memory");
        eng_free_dead(e);
        max_seqs = e->n_running + e->n_waiting + 1;
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
        e->b_nout[j] = s->spec_n > 0 ? k : wants_prompt_rows(s) ? k : (last ? 1 : 0);
        n_out += e->b_nout[j];
    }
    if (ensure_step_buffers(e, nt, ns, ns * max_blocks, (size_t)(n_out ? n_out : 1) * (size_t)V) != KR_OK) {
        for (int32_t j = 0; j < ns; j++) {
            if (e->b_seqs[j]->state != KR_SEQ_DONE) {
                eng_fail_req(e, e->b_seqs[j]->req, KR_ERR_NOMEM, "out of memory");
            }
        }
        eng_free_dead(e);
        return;
    }
    int32_t t = 0, o = 0;
    bool keeps = false; /* some Mamba state is kept after a draft */
    for (int32_t j = 0; j < ns; j++) {
        struct seq *s = e->b_seqs[j];
        const int32_t k = e->b_nsched[j];
        if (s->spec_n > 0) {
            /* its next token and its drafts, every one an output row, the states after the drafts
             * but the last one kept */
            e->b_tok0[j] = t;
            e->b_pos0[j] = s->n_fed;
            e->b_slot[j] = s->cache.slot;
            memset(e->b_bt + (size_t)j * (size_t)max_blocks, 0, (size_t)max_blocks * sizeof(int32_t));
            memcpy(e->b_bt + (size_t)j * (size_t)max_blocks, s->cache.blocks,
                   (size_t)s->cache.n_blocks * sizeof(int32_t));
            for (int32_t i = 0; i < k; i++) {
                e->b_tokens[t + i] = i == 0 ? s->toks[s->n_fed] : s->spec_draft[i - 1];
                e->b_pos[t + i] = s->n_fed + i;
                e->b_keep[t + i] = i < s->spec_n ? s->spec_held[i] : -1;
                keeps |= e->b_keep[t + i] >= 0;
                e->b_out[o++] = t + i;
            }
            t += k;
            continue;
        }
        for (int32_t i = 0; i < k; i++) {
            e->b_keep[t + i] = -1;
        }
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
                         .max_blocks = max_blocks, .n_out = n_out, .out_tok = e->b_out,
                         .tok_state_slot = keeps ? e->b_keep : NULL};
    const double t1 = kr_clock_us();
    const double gap = e->t_step_done > 0 ? t1 - e->t_step_done : -1.0; /* counted with the step's stats */
    e->t_step_done = 0;
    struct kr_err err = {0};
    /* sampling on the backend when no output row of the step is a prompt log-probability row (a
     * step with some goes to the host sampler whole). A row the device sampler cannot take (an n > 1
     * fork sampling several choices from one row, logit_bias, which it does not apply) and the rows
     * of a sequence verifying drafts (verified on the host, row after row) are copied to the host,
     * the other rows staying on the device: one such request no longer sends every row of every
     * step to the host. */
    bool dev = e->dev_sample && n_out > 0;
    for (int32_t j = 0; j < ns && dev; j++) {
        if (wants_prompt_rows(e->b_seqs[j])) {
            dev = false;
        }
    }
    enum kr_status st = eng_forward(e, &b, dev ? NULL : e->logits, &err);
    if (++e->step_attempts == (uint64_t)e->fault_step && st == KR_OK) {
        st = KR_ERR_CUDA; /* KRAIT_FAULT_STEP: this step fails as a device error would */
        snprintf(err.msg, sizeof err.msg, "injected %s failure of step %lld", e->fault_fatal ? "fatal" : "transient",
                 (long long)e->fault_step);
    }
    /* the device is busy with this step now: deliver the previous step's events meanwhile */
    eng_flush_events(e);
    /* the sequences that sample a token this step, each with its output row (its last one), and the
     * masks of the constrained ones, made while the device computes the logits */
    int32_t n_samp = 0;
    if (st == KR_OK && n_out > 0) {
        if ((st = eng_ensure_sample_buffers(e, n_out, 0)) != KR_OK) {
            snprintf(err.msg, sizeof err.msg, "out of memory");
        }
        for (int32_t j = 0, o2 = 0; j < ns && st == KR_OK; j++) {
            struct seq *s = e->b_seqs[j];
            if (s->spec_n > 0) {
                o2 += e->b_nsched[j]; /* sampled while verified, each row's mask made then */
                continue;
            }
            const bool last = s->n_fed + e->b_nsched[j] == s->n_toks;
            o2 += e->b_nout[j];
            if (last) {
                e->s_seqs[n_samp] = s;
                e->s_rows[n_samp++] = o2 - 1;
            }
        }
        if (st == KR_OK) {
            eng_fill_step_masks(e, e->s_seqs, e->s_rows, n_samp, n_out);
        }
    }
    int32_t n_top = 0;
    if (st == KR_OK && dev) {
        /* every output row in row order, with its sequence (the mask list above is done with). Rows
         * the host samples: a verifying sequence's (all of them), an n > 1 prompt's (its choices
         * fork from it), logit_bias, and the rows of requests that failed while their masks were
         * made (their results are not used) */
        int32_t r = 0;
        for (int32_t j = 0; j < ns && r >= 0; j++) {
            struct seq *s = e->b_seqs[j];
            const int32_t n_rows = e->b_nout[j];
            const bool host = s->spec_n > 0 || (s->state == KR_SEQ_PREFILL && s->index == 0 && s->req->n > 1) ||
                              s->req->s.n_bias > 0 || s->state == KR_SEQ_DONE;
            if (r + n_rows > n_out) {
                r = -1; /* the rows were not counted as the batch was built */
                break;
            }
            for (int32_t i = 0; i < n_rows; i++, r++) {
                e->s_seqs[r] = s;
                e->s_host[r] = host;
            }
        }
        st = r == n_out ? eng_sample_on_backend(e, e->s_seqs, e->s_host, r, &n_top) : KR_ERR_INTERNAL;
        if (st != KR_OK) {
            snprintf(err.msg, sizeof err.msg, "sampling on the backend failed: %s", kr_status_str(st));
        }
        /* the rows left to the host: their logits at the same rows of the host buffer, each run of
         * consecutive rows (a verifying sequence's) in one copy */
        for (int32_t i = 0; i < r && st == KR_OK;) {
            if (!e->s_host[i] || e->s_seqs[i]->state == KR_SEQ_DONE) {
                i++;
                continue;
            }
            int32_t n = 1;
            while (i + n < r && e->s_host[i + n] && e->s_seqs[i + n]->state != KR_SEQ_DONE) {
                n++;
            }
            st = kr_backend_copy_d2h(e->m->be, e->logits + (size_t)i * (size_t)V,
                                     e->m->last_logits + (size_t)i * (size_t)V, (size_t)n * (size_t)V * sizeof(float));
            if (st != KR_OK) {
                snprintf(err.msg, sizeof err.msg, "copying rows' logits to the host failed: %s", kr_status_str(st));
            }
            i += n;
        }
    }
    if (st != KR_OK && (e->ranks || !kr_backend_check(e->m->be) || (e->fault_fatal && e->step_attempts == (uint64_t)e->fault_step))) {
        /* a sticky device error: the context cannot recover, nothing else will run */
        eng_fail_everything(e, err.msg[0] ? err.msg : kr_status_str(st));
        return;
    }
    if (st != KR_OK) {
        /* not sticky: only the requests of this step fail */
        KR_LOG_ERROR("step failed: %s", err.msg);
        for (int32_t j = 0; j < ns; j++) {
            if (e->b_seqs[j]->state != KR_SEQ_DONE) {
                eng_fail_req(e, e->b_seqs[j]->req, st, err.msg[0] ? err.msg : kr_status_str(st));
            }
        }
        eng_free_dead(e);
        return;
    }
    e->steps++;
    e->t_step_done = kr_clock_us();
    eng_apply_pending_cancels(e); /* clients that left during the forward pass: no sampling for them */
    /* results, sequence by sequence, in batch order */
    o = 0;
    for (int32_t j = 0; j < ns; j++) {
        struct seq *s = e->b_seqs[j];
        const int32_t k = e->b_nsched[j];
        if (s->spec_n > 0) {
            const float *rows = e->logits + (size_t)o * (size_t)V;
            o += k;
            if (s->state == KR_SEQ_DECODE) {
                eng_spec_verify(e, s, rows);
            }
            if (s->state == KR_SEQ_DECODE) {
                after_step_cache(e, s, false);
            }
            continue;
        }
        const bool rows = wants_prompt_rows(s), last = s->n_fed + k == s->n_toks;
        /* as the batch was built: a verifying sequence cancelled since (its drafts ended) had k rows */
        const int32_t n_rows = e->b_nout[j];
        const float *first = e->logits + (size_t)o * (size_t)V;
        o += n_rows;
        if (s->state == KR_SEQ_DONE) {
            continue; /* failed above with its request */
        }
        if (s->state == KR_SEQ_PREFILL) {
            e->prompt_tokens += (uint64_t)k;
        }
        if (rows) {
            eng_prompt_logprobs_rows(e, s->req, s->n_fed, k, first);
        }
        s->n_fed += k;
        s->cache.n_pos = s->n_fed;
        after_step_cache(e, s, s->state == KR_SEQ_PREFILL);
        if (!last) {
            continue;
        }
        const int32_t row_i = o - 1; /* this sequence's output row (the last of its rows) */
        const bool on_host = !dev || e->s_host[row_i];
        const float *row = on_host ? first + (size_t)(n_rows - 1) * (size_t)V : NULL;
        struct req *r = s->req;
        if (s->state == KR_SEQ_PREFILL) {
            s->state = KR_SEQ_DECODE;
            if (s->index == 0 && r->n > 1) {
                fork_children(e, s);
                for (int32_t i = 1; i < r->n; i++) {
                    struct seq *ch = &r->seqs[i];
                    if (ch->state == KR_SEQ_DECODE && ch->n_gen == 0 && ch->n_fed == s->n_fed) {
                        eng_sample_and_emit(e, ch, row, NULL); /* a constrained choice makes its own mask */
                    }
                }
            }
        }
        if (s->state == KR_SEQ_DONE) {
            continue;
        }
        if (on_host) {
            eng_sample_and_emit(e, s, row, eng_row_mask(e, row_i));
        } else if (e->s_out[row_i] >= 0) {
            /* s_lp holds this step's values only when a sequence of it asked for log-probabilities */
            eng_emit_token(e, s, e->s_out[row_i], r->s.logprobs >= 0 ? e->s_lp[row_i] : NAN,
                       e->s_top_ids + (size_t)row_i * (size_t)n_top,
                       e->s_top_lp + (size_t)row_i * (size_t)n_top);
        } else {
            /* a row the backend refused (all logits masked, ...): the host sampler says why */
            if (kr_backend_copy_d2h(e->m->be, e->logits, e->m->last_logits + (size_t)row_i * (size_t)V,
                                    (size_t)V * sizeof(float)) != KR_OK) {
                eng_fail_req(e, r, KR_ERR_CUDA, "sampling failed");
            } else {
                eng_sample_and_emit(e, s, e->logits, eng_row_mask(e, row_i));
            }
        }
    }
    eng_mtp_after_step(e, &b, ns);
    eng_free_dead(e);
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

void eng_check_invariants(struct kr_engine *e)
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


enum kr_status eng_forward(struct kr_engine *e, const struct kr_batch *b, float *logits, struct kr_err *err)
{
    if (!e->ranks) {
        return kr_model_forward(e->m, e->cache, b, logits, err);
    }
    kr_ranks_begin(e->ranks, b);
    enum kr_status st = kr_model_forward(e->m, e->cache, b, logits, err);
    struct kr_err rerr = {0};
    const enum kr_status rst = kr_ranks_wait(e->ranks, &rerr);
    /* the rank that failed first tells why; the others only saw the group abort */
    if (rst != KR_OK && (st == KR_OK || st == KR_ERR_CANCELLED || rst != KR_ERR_CANCELLED)) {
        *err = rerr;
        st = rst;
    }
    return st;
}
