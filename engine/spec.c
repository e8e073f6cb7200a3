/* Speculative decoding (engine.h, struct kr_spec_config): drafting (prompt lookup: ngram.h), the
 * room a draft takes in the step (blocks, and state slots for the Mamba states after each drafted
 * token), and verification, which keeps the drafts the sampler draws and moves the sequence to the
 * state after them. */
#include "engine-impl.h"
#include "ranks.h"
#include "runner.h"

#include "log.h"
#include "alloc.h"

#include <string.h>

/* ---- planning ------------------------------------------------------------------------------------ */

int32_t eng_spec_plan(struct kr_engine *e, struct seq *s, int32_t max)
{
    const struct kr_spec_config *sc = &e->cfg.spec;
    struct kr_cache *c = e->cache;
    const struct req *r = s->req;
    s->spec_n = 0;
    if (sc->method == KR_SPEC_OFF || max <= 0) {
        return 0;
    }
    /* no more than the tokens the choice may still take after its next one, and no position past
     * max_model_len */
    int32_t lim = sc->k < max ? sc->k : max;
    const int32_t left = r->s.max_tokens - s->n_gen - 1, room = e->cfg.max_model_len - s->n_toks;
    lim = left < lim ? left : lim;
    lim = room < lim ? room : lim;
    if (lim <= 0) {
        return 0;
    }
    int32_t d[KR_SPEC_MAX_TOKENS];
    int32_t n;
    if (sc->method == KR_SPEC_MTP) { /* the first draft made after the last step; the others, chained, later */
        const bool fresh = s->mtp_at == s->n_fed && s->mtp_step == e->steps && s->mtp_draft >= 0;
        n = fresh ? lim : 0;
        d[0] = s->mtp_draft;
        for (int32_t i = 1; i < n; i++) {
            d[i] = s->mtp_draft; /* placeholders until eng_mtp_chain */
        }
    } else {
        n = kr_ngram_propose(&s->ngram, s->toks, s->n_toks, sc->ngram_min, sc->ngram_max, lim, d);
    }
    /* a state slot per draft, out of those no waiting sequence may be admitted to this step */
    if (n > 0 && c->n_mamba > 0) {
        const int32_t admit = e->cfg.max_num_seqs - e->n_running;
        const int32_t want = e->n_waiting < admit ? e->n_waiting : admit;
        const int32_t spare = c->n_free_slots - (want > 0 ? want : 0);
        n = spare < n ? spare : n;
    }
    if (n <= 0 || kr_seq_cache_reserve(c, &s->cache, s->n_fed + 1 + n) != KR_OK) {
        kr_seq_cache_trim(c, &s->cache, s->n_fed + 1);
        return 0;
    }
    for (int32_t i = 0; i <= n; i++) {
        s->spec_held[i] = -1;
    }
    if (c->n_mamba > 0) {
        for (int32_t i = 0; i < n; i++) {
            if (kr_cache_slot_alloc(c, &s->spec_held[i]) != KR_OK) { /* counted above: never */
                for (int32_t j = 0; j < i; j++) {
                    kr_cache_slot_free(c, s->spec_held[j]);
                }
                kr_seq_cache_trim(c, &s->cache, s->n_fed + 1);
                return 0;
            }
        }
    }
    s->spec_held[n] = s->cache.slot;
    s->spec_cur = n;
    memcpy(s->spec_draft, d, (size_t)n * sizeof(int32_t));
    s->spec_n = n;
    return n;
}

void eng_spec_end(struct kr_engine *e, struct seq *s)
{
    if (s->spec_n <= 0) {
        return;
    }
    for (int32_t i = 0; i <= s->spec_n; i++) {
        if (i != s->spec_cur && s->spec_held[i] >= 0) {
            kr_cache_slot_free(e->cache, s->spec_held[i]);
        }
        s->spec_held[i] = -1;
    }
    s->spec_n = 0;
}

/* ---- verification -------------------------------------------------------------------------------- */

void eng_spec_verify(struct kr_engine *e, struct seq *s, const float *rows)
{
    const int64_t V = e->m->cfg.vocab;
    struct kr_cache *c = e->cache;
    const int32_t n = s->spec_n, base = s->n_fed;
    int32_t kept = 0;
    for (int32_t i = 0; i <= n; i++) {
        /* the caches now stand for the next token and the i drafts kept so far: the state after
         * them, and as many positions (what a choice that ends here leaves to the prefix cache) */
        if (c->n_mamba > 0) {
            s->spec_cur = i;
            s->cache.slot = s->spec_held[i];
        }
        s->n_fed = base + 1 + i;
        s->cache.n_pos = s->n_fed;
        const int32_t before = s->n_toks;
        eng_sample_and_emit(e, s, rows + (size_t)i * (size_t)V, NULL);
        const bool match = s->n_toks == before + 1 && i < n && s->toks[before] == s->spec_draft[i];
        kept += match;
        if (!match || s->state != KR_SEQ_DECODE) {
            break; /* refused, or the choice ended (or failed) with this token, its caches released */
        }
    }
    e->spec_drafts++;
    e->spec_draft_tokens += (uint64_t)n;
    e->spec_accepted += (uint64_t)kept;
    for (int32_t i = 0; i < kept; i++) {
        e->spec_accepted_pos[i]++;
    }
    const bool live = s->state == KR_SEQ_DECODE;
    eng_spec_end(e, s);
    if (live) {
        kr_seq_cache_trim(c, &s->cache, s->n_toks); /* the refused drafts' rows */
    }
}

/* ---- MTP drafting -------------------------------------------------------------------------------- */

/* Room for an MTP pass of n_tok rows in n_seq sequences (block tables of max_blocks) with n_out
 * logits rows: the batch arrays in e->mtp_i, in the order tokens, pos, out, src, tok0 (n_seq + 1),
 * pos0, slot, block table. */
static enum kr_status mtp_room(struct kr_engine *e, int32_t n_tok, int32_t n_seq, int32_t max_blocks, int32_t n_out)
{
    const size_t ni = (size_t)n_tok * 4 + (size_t)n_seq * 3 + 1 + (size_t)n_seq * (size_t)max_blocks;
    if (ni > e->cap_mtp_i) {
        int32_t *p = kr_realloc(e->mtp_i, ni * sizeof *p);
        if (!p) {
            return KR_ERR_NOMEM;
        }
        e->mtp_i = p;
        e->cap_mtp_i = ni;
    }
    const size_t nl = (size_t)(n_out > 0 ? n_out : 1) * (size_t)e->m->cfg.vocab;
    if (nl > e->cap_mtp_logits) {
        float *p = kr_realloc(e->mtp_logits, nl * sizeof *p);
        if (!p) {
            return KR_ERR_NOMEM;
        }
        e->mtp_logits = p;
        e->cap_mtp_logits = nl;
    }
    return KR_OK;
}

/* Sequence q of an MTP pass: s's state slot and block table (zero-padded to max_blocks). */
static void mtp_put_seq(const struct seq *s, int32_t q, int32_t max_blocks, int32_t *slot, int32_t *bt)
{
    slot[q] = s->cache.slot;
    memset(bt + (size_t)q * (size_t)max_blocks, 0, (size_t)max_blocks * sizeof(int32_t));
    memcpy(bt + (size_t)q * (size_t)max_blocks, s->cache.blocks, (size_t)s->cache.n_blocks * sizeof(int32_t));
}

/* The MTP head over the batch laid out in e->mtp_i (mtp_room's order), hidden states from `src`
 * (the step's residual stream when src_final, else the head's own last outputs), logits of the
 * out rows into e->mtp_logits. False (logged) when the pass failed: no drafts from it. */
static bool mtp_pass(struct kr_engine *e, int32_t n_tok, int32_t n_seq, int32_t max_blocks, int32_t n_out,
                     const struct kr_buf *src, bool src_final)
{
    int32_t *tokens = e->mtp_i, *pos = tokens + n_tok, *out = pos + n_tok, *srow = out + n_tok, *tok0 = srow + n_tok,
            *pos0 = tok0 + n_seq + 1, *slot = pos0 + n_seq, *bt = slot + n_seq;
    tok0[n_seq] = n_tok;
    const struct kr_batch mb = {.n_tok = n_tok, .n_seq = n_seq, .tokens = tokens, .pos = pos, .seq_tok0 = tok0,
                                .seq_pos0 = pos0, .seq_slot = slot, .block_table = bt, .max_blocks = max_blocks,
                                .n_out = n_out, .out_tok = out};
    struct kr_err err = {0};
    if (e->ranks) { /* every rank runs its share of the head's blocks, over its own copy of the rows */
        kr_ranks_begin_mtp(e->ranks, &mb, src == &e->m->mtp_g, srow);
    }
    enum kr_status st = kr_model_mtp_forward(e->m, e->cache, &mb, src, src_final, srow, e->mtp_logits, &err);
    if (e->ranks) {
        struct kr_err rerr = {0};
        const enum kr_status rst = kr_ranks_wait(e->ranks, &rerr);
        if (rst != KR_OK && (st == KR_OK || st == KR_ERR_CANCELLED || rst != KR_ERR_CANCELLED)) {
            err = rerr;
            st = rst;
        }
    }
    if (st != KR_OK) {
        /* alone, a failed pass costs this step's drafts; in a group it also aborted the collectives,
         * so the next step fails and reports it */
        KR_LOG_WARN("MTP drafting: %s; no drafts from this pass", err.msg);
        return false;
    }
    return true;
}

/* The rows of s's step that the MTP head takes: positions [p0, s->n_fed) whose next token is known,
 * of a sequence that is still running (a finished one has given back its caches). */
static int32_t mtp_rows_of(const struct seq *s, int32_t p0)
{
    if (s->state != KR_SEQ_PREFILL && s->state != KR_SEQ_DECODE) {
        return 0;
    }
    const int32_t end = s->n_fed < s->n_toks - 1 ? s->n_fed : s->n_toks - 1;
    return end > p0 ? end - p0 : 0;
}

void eng_mtp_after_step(struct kr_engine *e, const struct kr_batch *b, int32_t ns)
{
    if (e->cfg.spec.method != KR_SPEC_MTP) {
        return;
    }
    int32_t n_tok = 0, n_seq = 0, n_out = 0, max_blocks = 1;
    for (int32_t j = 0; j < ns; j++) {
        struct seq *s = e->b_seqs[j];
        s->mtp_at = -1;
        const int32_t r = mtp_rows_of(s, b->seq_pos0[j]);
        if (r > 0) {
            n_tok += r;
            n_seq++;
            n_out += s->state == KR_SEQ_DECODE;
            max_blocks = s->cache.n_blocks > max_blocks ? s->cache.n_blocks : max_blocks;
        }
    }
    if (n_tok == 0) {
        return;
    }
    if (mtp_room(e, n_tok, n_seq, max_blocks, n_out) != KR_OK) {
        KR_LOG_WARN("MTP drafting: out of memory for a pass of %d rows; no drafts next step", n_tok);
        return;
    }
    int32_t *tokens = e->mtp_i, *pos = tokens + n_tok, *out = pos + n_tok, *src = out + n_tok, *tok0 = src + n_tok,
            *pos0 = tok0 + n_seq + 1, *slot = pos0 + n_seq, *bt = slot + n_seq;
    int32_t t = 0, q = 0, o = 0;
    for (int32_t j = 0; j < ns; j++) {
        struct seq *s = e->b_seqs[j];
        const int32_t p0 = b->seq_pos0[j], r = mtp_rows_of(s, p0);
        if (r <= 0) {
            continue;
        }
        tok0[q] = t;
        pos0[q] = p0;
        mtp_put_seq(s, q, max_blocks, slot, bt);
        for (int32_t i = 0; i < r; i++) {
            tokens[t + i] = s->toks[p0 + i + 1];
            pos[t + i] = p0 + i;
            src[t + i] = b->seq_tok0[j] + i; /* the step's row at that position */
        }
        if (s->state == KR_SEQ_DECODE) {
            out[o] = t + r - 1;
            s->mtp_g_row = o++;
        }
        t += r;
        q++;
    }
    if (!mtp_pass(e, n_tok, n_seq, max_blocks, n_out, &e->m->mtp_h, true)) {
        return;
    }
    const int64_t V = e->m->cfg.vocab;
    for (int32_t j = 0; j < ns; j++) {
        struct seq *s = e->b_seqs[j];
        if (s->state == KR_SEQ_DECODE && mtp_rows_of(s, b->seq_pos0[j]) > 0) {
            s->mtp_draft = kr_argmax(e->mtp_logits + (size_t)s->mtp_g_row * (size_t)V, V);
            s->mtp_at = s->n_fed;
            s->mtp_step = e->steps;
        }
    }
}

void eng_mtp_chain(struct kr_engine *e, int32_t ns)
{
    if (e->cfg.spec.method != KR_SPEC_MTP) {
        return;
    }
    const int64_t V = e->m->cfg.vocab;
    for (int32_t d = 1; d < e->cfg.spec.k; d++) {
        /* pass d: each sequence with more than d drafts, one row at position n_fed + d - 1 taking draft
         * d - 1 (the token there) and the head's own output for the position before */
        int32_t n = 0, max_blocks = 1;
        for (int32_t j = 0; j < ns; j++) {
            const struct seq *s = e->b_seqs[j];
            if (s->spec_n > d) {
                n++;
                max_blocks = s->cache.n_blocks > max_blocks ? s->cache.n_blocks : max_blocks;
            }
        }
        if (n == 0) {
            return;
        }
        if (mtp_room(e, n, n, max_blocks, n) != KR_OK) {
            return; /* the placeholders stay: drafts that are only less likely to be kept */
        }
        int32_t *tokens = e->mtp_i, *pos = tokens + n, *out = pos + n, *src = out + n, *tok0 = src + n,
                *pos0 = tok0 + n + 1, *slot = pos0 + n, *bt = slot + n;
        int32_t q = 0;
        for (int32_t j = 0; j < ns; j++) {
            struct seq *s = e->b_seqs[j];
            if (s->spec_n <= d) {
                continue;
            }
            tokens[q] = s->spec_draft[d - 1];
            pos[q] = s->n_fed + d - 1;
            out[q] = q;
            src[q] = s->mtp_g_row;
            tok0[q] = q;
            pos0[q] = pos[q];
            mtp_put_seq(s, q, max_blocks, slot, bt);
            q++;
        }
        if (!mtp_pass(e, n, n, max_blocks, n, &e->m->mtp_g, false)) {
            return; /* the placeholders stay: drafts that are only less likely to be kept */
        }
        q = 0;
        for (int32_t j = 0; j < ns; j++) {
            struct seq *s = e->b_seqs[j];
            if (s->spec_n <= d) {
                continue;
            }
            s->spec_draft[d] = kr_argmax(e->mtp_logits + (size_t)q * (size_t)V, V);
            for (int32_t i = d + 1; i < s->spec_n; i++) {
                s->spec_draft[i] = s->spec_draft[d];
            }
            s->mtp_g_row = q++;
        }
    }
}
