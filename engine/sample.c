/* The engine's sampling: stop conditions and token events, constrained decoding's masks and
 * matchers, sampling on the host or on the backend (with penalty lists and masks), and the
 * prompt's log-probabilities. */
#include "engine-impl.h"

#include "alloc.h"
#include "array.h"
#include "clock.h"
#include "log.h"
#include "switches.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* ---- constrained decoding ------------------------------------------------------------------------ */

void eng_seq_con_end(struct seq *s)
{
    if (s->cm) {
        s->req->con.iface->stop(s->req->con.ctx, s->cm);
        s->cm = NULL;
    }
}

/* Fills `mask` with the tokens the constraint of s allows next (its matcher made on first use);
 * with ignore_eos the model's end-of-sequence ids are left out as well, so that only the text's
 * completion ends it. KR_ERR_INVAL when no token is left: the text cannot go on. */
static enum kr_status seq_mask(struct kr_engine *e, struct seq *s, uint32_t *mask, struct kr_err *err)
{
    const struct req *r = s->req;
    const struct kr_constraint *c = &r->con;
    const struct kr_model_config *mc = &e->m->cfg;
    if (!s->cm) {
        KR_TRY(c->iface->start(c->ctx, &s->cm, err));
    }
    KR_TRY(c->iface->fill_mask(c->ctx, s->cm, mask, mc->vocab, err));
    for (int32_t i = 0; i < mc->n_eos && r->s.ignore_eos; i++) {
        if (mc->eos_ids[i] >= 0 && mc->eos_ids[i] < mc->vocab) {
            mask[mc->eos_ids[i] >> 5] &= ~(1u << (mc->eos_ids[i] & 31));
        }
    }
    for (int32_t w = 0; w < e->mask_words; w++) {
        if (mask[w]) {
            return KR_OK;
        }
    }
    return kr_err_set(err, KR_ERR_INVAL, "no token of the vocabulary can continue the output under its constraint");
}

/* Room for n output rows and m mask rows (plus the spare one). */
static enum kr_status ensure_masks(struct kr_engine *e, int32_t n, int32_t m)
{
    if (n > e->cap_row_mask) {
        kr_free(e->row_mask);
        e->row_mask = kr_malloc((size_t)(n + 16) * sizeof(int32_t));
        e->cap_row_mask = e->row_mask ? n + 16 : 0;
        if (!e->row_mask) {
            return KR_ERR_NOMEM;
        }
    }
    if (m > e->cap_masks || !e->masks) {
        const int32_t c = m > 2 * e->cap_masks ? m : 2 * e->cap_masks;
        kr_free(e->masks);
        e->masks = kr_malloc((size_t)(c + 1) * (size_t)e->mask_words * sizeof(uint32_t));
        e->cap_masks = e->masks ? c : 0;
        if (!e->masks) {
            return KR_ERR_NOMEM;
        }
    }
    return KR_OK;
}

/* The step's masks: done right after the forward pass is launched, so that on a GPU the host fills
 * them while the device computes the logits (on the CPU backend the forward pass has returned by
 * then, and this is simply the host work before sampling). Only constrained rows cost anything;
 * the others get -1. Filling the masks of step t+1 during step t's forward pass would need the
 * tokens of step t before that pass starts (asynchronous scheduling), and filling them on other
 * threads would take cores from the CPU backend's forward pass: see docs/STRUCTURED_OUTPUTS.md. */
void eng_fill_step_masks(struct kr_engine *e, struct seq **seqs, const int32_t *rows, int32_t n, int32_t n_out)
{
    int32_t n_con = 0;
    for (int32_t i = 0; i < n; i++) {
        n_con += seqs[i]->req->con.iface != NULL && seqs[i]->state != KR_SEQ_DONE;
    }
    const double t0 = n_con > 0 ? kr_clock_us() : 0.0;
    if (ensure_masks(e, n_out, n_con) != KR_OK) {
        for (int32_t i = 0; i < n; i++) {
            if (seqs[i]->req->con.iface && seqs[i]->state != KR_SEQ_DONE) {
                eng_fail_req(e, seqs[i]->req, KR_ERR_NOMEM, "out of memory");
            }
        }
        if (e->row_mask) {
            for (int32_t i = 0; i < n_out && i < e->cap_row_mask; i++) {
                e->row_mask[i] = -1;
            }
        }
        return;
    }
    for (int32_t i = 0; i < n_out; i++) {
        e->row_mask[i] = -1;
    }
    int32_t k = 0;
    for (int32_t i = 0; i < n; i++) {
        struct seq *s = seqs[i];
        if (!s->req->con.iface || s->state == KR_SEQ_DONE) {
            continue;
        }
        struct kr_err err = {0};
        const enum kr_status st = seq_mask(e, s, e->masks + (size_t)k * (size_t)e->mask_words, &err);
        if (st != KR_OK) {
            char msg[sizeof err.msg + 32];
            snprintf(msg, sizeof msg, "constrained decoding: %s", err.msg[0] ? err.msg : kr_status_str(st));
            eng_fail_req(e, s->req, st, msg);
            continue;
        }
        e->row_mask[rows[i]] = k++;
    }
    if (n_con > 0) {
        e->n_masks += (uint64_t)n_con;
        e->mask_us += kr_clock_us() - t0;
    }
}

const uint32_t *eng_row_mask(const struct kr_engine *e, int32_t i)
{
    if (!e->row_mask || i >= e->cap_row_mask || e->row_mask[i] < 0) {
        return NULL;
    }
    return e->masks + (size_t)e->row_mask[i] * (size_t)e->mask_words;
}

/* Advances the matcher of a constrained s by tok; *done when its text is complete. */
static enum kr_status con_accept(struct seq *s, int32_t tok, bool *done, struct kr_err *err)
{
    const struct kr_constraint *c = &s->req->con;
    *done = false;
    if (!c->iface) {
        return KR_OK;
    }
    if (!s->cm) { /* a token sampled without a mask would be a bug */
        return kr_err_set(err, KR_ERR_INTERNAL, "a constrained choice sampled a token without its mask");
    }
    return c->iface->accept(c->ctx, s->cm, tok, done, err);
}

/* ---- sampling and stop conditions ------------------------------------------------------------ */

/* Emits token `tok` of s (logprob and alternatives as the request asked; top holds at least
 * r->s.logprobs entries when that is positive) and finishes the choice when it ends: at an
 * end-of-sequence or stop id, when its constrained text is complete, or at its length limit. */
void eng_emit_token(struct kr_engine *e, struct seq *s, int32_t tok, float logprob, const int32_t *top_ids,
                       const float *top_lps)
{
    struct req *r = s->req;
    const struct kr_model_config *c = &e->m->cfg;
    bool complete = false;
    struct kr_err cerr = {0};
    const enum kr_status cst = con_accept(s, tok, &complete, &cerr);
    if (cst != KR_OK) {
        char msg[sizeof cerr.msg + 32];
        snprintf(msg, sizeof msg, "constrained decoding: %s", cerr.msg[0] ? cerr.msg : kr_status_str(cst));
        eng_fail_req(e, r, cst, msg);
        return;
    }
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
    if (eng_seq_append(s, tok) != KR_OK || kr_token_counts_add(&s->counts, tok, false) != KR_OK) {
        eng_fail_req(e, r, KR_ERR_NOMEM, "out of memory");
        return;
    }
    s->n_gen++;
    e->gen_tokens++;
    eng_emit(e, r, &ev);
    bool stop = !r->s.ignore_eos && is_eos(c, tok);
    for (int32_t i = 0; i < r->s.n_stop_ids && !stop; i++) {
        stop = r->s.stop_ids[i] == tok;
    }
    if (stop && s->n_gen >= r->s.min_tokens) {
        eng_finish_seq(e, s, KR_FINISH_STOP, tok);
    } else if (complete) {
        eng_finish_seq(e, s, KR_FINISH_STOP, -1); /* nothing may follow: the text is whole, even below min_tokens */
    } else if (s->n_gen >= r->s.max_tokens || s->n_toks >= e->cfg.max_model_len) {
        eng_finish_seq(e, s, KR_FINISH_LENGTH, -1);
    }
}

/* Samples the next token of s from `logits` (host memory) and emits it. A constrained s samples
 * under `mask`, made here when the step did not (the n > 1 choices forked from a prompt's row). */
void eng_sample_and_emit(struct kr_engine *e, struct seq *s, const float *logits, const uint32_t *mask)
{
    struct req *r = s->req;
    const struct kr_model_config *c = &e->m->cfg;
    if (r->con.iface && !mask) {
        struct kr_err err = {0};
        const double t0 = kr_clock_us();
        uint32_t *spare = ensure_masks(e, 0, 0) == KR_OK ? e->masks + (size_t)e->cap_masks * (size_t)e->mask_words
                                                         : NULL;
        const enum kr_status st = spare ? seq_mask(e, s, spare, &err) : KR_ERR_NOMEM;
        e->n_masks++;
        e->mask_us += kr_clock_us() - t0;
        if (st != KR_OK) {
            char msg[sizeof err.msg + 32];
            snprintf(msg, sizeof msg, "constrained decoding: %s", err.msg[0] ? err.msg : kr_status_str(st));
            eng_fail_req(e, r, st, msg);
            return;
        }
        mask = spare;
    }
    int32_t tok = 0;
    enum kr_status st = kr_sample(&r->s, logits, mask, c->vocab, &s->counts, s->n_gen, c->eos_ids, c->n_eos, &s->rng,
                                  &e->scratch, &tok);
    if (st != KR_OK) {
        eng_fail_req(e, r, st, "sampling failed");
        return;
    }
    float lp = 0;
    if (r->s.logprobs >= 0) {
        /* vLLM's log-probabilities: the model's logits before any sampling parameter, but after a
         * constraint's mask (its grammar bitmask is applied to the logits before the sampler) */
        kr_log_softmax_masked(logits, mask, e->lp_row, c->vocab);
        lp = e->lp_row[tok];
        if (r->s.logprobs > 0) {
            const int32_t k = r->s.logprobs < c->vocab ? r->s.logprobs : (int32_t)c->vocab;
            kr_top_k_ids(e->lp_row, c->vocab, k, e->top_ids);
            for (int32_t i = 0; i < k; i++) {
                e->top_lps[i] = e->lp_row[e->top_ids[i]];
            }
        }
    }
    eng_emit_token(e, s, tok, lp, e->top_ids, e->top_lps);
}

/* ---- sampling on the backend ------------------------------------------------------------------ */

enum kr_status eng_ensure_sample_buffers(struct kr_engine *e, int32_t n, int64_t n_pen)
{
    if (n > e->cap_srows) {
        const int32_t c = n + 16;
        kr_free(e->s_seqs);
        kr_free(e->s_host);
        kr_free(e->srows);
        kr_free(e->s_out);
        kr_free(e->s_rows);
        kr_free(e->s_lp);
        kr_free(e->s_top_ids);
        kr_free(e->s_top_lp);
        e->s_seqs = kr_malloc((size_t)c * sizeof *e->s_seqs);
        e->s_host = kr_malloc((size_t)c);
        e->srows = kr_malloc((size_t)c * sizeof *e->srows);
        e->s_out = kr_malloc((size_t)c * sizeof(int32_t));
        e->s_rows = kr_malloc((size_t)c * sizeof(int32_t));
        e->s_lp = kr_malloc((size_t)c * sizeof(float));
        e->s_top_ids = kr_malloc((size_t)c * KR_MAX_TOP_LOGPROBS * sizeof(int32_t));
        e->s_top_lp = kr_malloc((size_t)c * KR_MAX_TOP_LOGPROBS * sizeof(float));
        e->cap_srows =
            e->s_seqs && e->s_host && e->srows && e->s_out && e->s_rows && e->s_lp && e->s_top_ids && e->s_top_lp ? c
                                                                                                                : 0;
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
 * non-greedy row). Rows with host[i] set (host may be NULL) are left to the host sampler: the
 * backend takes them greedily with no draw and no penalty, and their result is not used. Results
 * in e->s_out / s_lp / s_top_* (s_lp only when a sequence asked for log-probabilities). */
enum kr_status eng_sample_on_backend(struct kr_engine *e, struct seq **seqs, const uint8_t *host, int32_t n,
                                     int32_t *n_top_out)
{
    int64_t n_pen = 0;
    int32_t n_top = 0;
    bool want_lp = false; /* the chosen tokens' log-probabilities cost a log-sum-exp over each row */
    for (int32_t i = 0; i < n; i++) {
        if (host && host[i]) {
            continue;
        }
        n_pen += pen_bound(e, seqs[i]);
        const int32_t k = seqs[i]->req->s.logprobs;
        n_top = k > n_top ? k : n_top;
        want_lp |= k >= 0;
    }
    n_top = n_top < e->m->cfg.vocab ? n_top : (int32_t)e->m->cfg.vocab;
    KR_TRY(eng_ensure_sample_buffers(e, n, n_pen));
    int64_t at = 0;
    int32_t n_mrows = 0; /* mask rows the constrained rows use: the step's mask rows are in row order */
    for (int32_t i = 0; i < n; i++) {
        struct seq *s = seqs[i];
        const struct kr_sampling *p = &s->req->s;
        if (host && host[i]) {
            e->srows[i] = (struct krk_sample_row){.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f,
                                                 .presence = 0.0f, .frequency = 0.0f, .repetition = 1.0f,
                                                 .pen_off = (int32_t)at, .pen_n = 0, .mask_off = -1, .u = 0.0};
            continue;
        }
        const int64_t k = pen_fill(e, s, at);
        /* a constrained row: its mask, filled while the forward pass ran (eng_fill_step_masks) */
        const int32_t mrow = e->row_mask && i < e->cap_row_mask ? e->row_mask[i] : -1;
        n_mrows = mrow + 1 > n_mrows ? mrow + 1 : n_mrows;
        e->srows[i] = (struct krk_sample_row){.temperature = p->temperature, .top_k = p->top_k, .top_p = p->top_p,
                                             .min_p = p->min_p, .presence = p->presence_penalty,
                                             .frequency = p->frequency_penalty,
                                             .repetition = p->repetition_penalty, .pen_off = (int32_t)at,
                                             .pen_n = (int32_t)k, .mask_off = mrow >= 0 ? mrow * e->mask_words : -1,
                                             .u = p->temperature > 0.0f ? kr_rng_uniform(&s->rng) : 0.0};
        at += k;
    }
    const struct krk_sample_params sp = {.logits = e->m->last_logits, .ld = e->m->cfg.vocab, .n = n,
                                         .vocab = e->m->cfg.vocab, .rows = e->srows, .pen_ids = e->pen_ids,
                                         .pen_count = e->pen_count, .pen_flags = e->pen_flags, .n_pen = at,
                                         .mask = n_mrows > 0 ? e->masks : NULL,
                                         .n_mask = (int64_t)n_mrows * e->mask_words,
                                         .out = e->s_out, .out_logprob = want_lp ? e->s_lp : NULL,
                                         .n_top = n_top, .top_ids = e->s_top_ids, .top_lp = e->s_top_lp};
    *n_top_out = n_top;
    return kr_backend_sample(e->m->be, &sp);
}

/* Accumulates prompt log-probabilities from rows of prompt positions [p0, p0 + n) and emits them
 * once complete. rows hold raw logits. */
void eng_prompt_logprobs_rows(struct kr_engine *e, struct req *r, int32_t p0, int32_t n, const float *rows)
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
        const float lp = e->lp_row[prompt[t + 1]];
        r->plp[t + 1] = lp;
        int32_t rank = 1; /* vLLM's rank: 1 + the tokens strictly likelier */
        for (int64_t v = 0; v < V; v++) {
            rank += e->lp_row[v] > lp;
        }
        r->plp_rank[t + 1] = rank;
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
                              .prompt_ranks = r->plp_rank,
                              .prompt_top_k = k};
        eng_emit(e, r, &ev);
    }
}

