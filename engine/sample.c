/* The engine's sampling: stop conditions and token events, sampling on the host or on the backend
 * (with penalty lists), and the prompt's log-probabilities. */
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

/* Emits token `tok` of s (logprob and alternatives as the request asked; top holds at least
 * r->s.logprobs entries when that is positive) and finishes the choice when it ends. */
void eng_emit_token(struct kr_engine *e, struct seq *s, int32_t tok, float logprob, const int32_t *top_ids,
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
    } else if (s->n_gen >= r->s.max_tokens || s->n_toks >= e->cfg.max_model_len) {
        eng_finish_seq(e, s, KR_FINISH_LENGTH, -1);
    }
}

/* Samples the next token of s from `logits` (host memory) and emits it. */
void eng_sample_and_emit(struct kr_engine *e, struct seq *s, const float *logits)
{
    struct req *r = s->req;
    const struct kr_model_config *c = &e->m->cfg;
    int32_t tok = 0;
    enum kr_status st = kr_sample(&r->s, logits, c->vocab, &s->counts, s->n_gen, c->eos_ids, c->n_eos, &s->rng,
                                  &e->scratch, &tok);
    if (st != KR_OK) {
        eng_fail_req(e, r, st, "sampling failed");
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
        kr_free(e->s_lp);
        kr_free(e->s_top_ids);
        kr_free(e->s_top_lp);
        e->s_seqs = kr_malloc((size_t)c * sizeof *e->s_seqs);
        e->s_host = kr_malloc((size_t)c);
        e->srows = kr_malloc((size_t)c * sizeof *e->srows);
        e->s_out = kr_malloc((size_t)c * sizeof(int32_t));
        e->s_lp = kr_malloc((size_t)c * sizeof(float));
        e->s_top_ids = kr_malloc((size_t)c * KR_MAX_TOP_LOGPROBS * sizeof(int32_t));
        e->s_top_lp = kr_malloc((size_t)c * KR_MAX_TOP_LOGPROBS * sizeof(float));
        e->cap_srows = e->s_seqs && e->s_host && e->srows && e->s_out && e->s_lp && e->s_top_ids && e->s_top_lp ? c : 0;
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
    for (int32_t i = 0; i < n; i++) {
        struct seq *s = seqs[i];
        const struct kr_sampling *p = &s->req->s;
        if (host && host[i]) {
            e->srows[i] = (struct krk_sample_row){.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f,
                                                 .presence = 0.0f, .frequency = 0.0f, .repetition = 1.0f,
                                                 .pen_off = (int32_t)at, .pen_n = 0, .u = 0.0};
            continue;
        }
        const int64_t k = pen_fill(e, s, at);
        e->srows[i] = (struct krk_sample_row){.temperature = p->temperature, .top_k = p->top_k, .top_p = p->top_p,
                                             .min_p = p->min_p, .presence = p->presence_penalty,
                                             .frequency = p->frequency_penalty,
                                             .repetition = p->repetition_penalty, .pen_off = (int32_t)at,
                                             .pen_n = (int32_t)k,
                                             .u = p->temperature > 0.0f ? kr_rng_uniform(&s->rng) : 0.0};
        at += k;
    }
    const struct krk_sample_params sp = {.logits = e->m->last_logits, .ld = e->m->cfg.vocab, .n = n,
                                         .vocab = e->m->cfg.vocab, .rows = e->srows, .pen_ids = e->pen_ids,
                                         .pen_count = e->pen_count, .pen_flags = e->pen_flags, .n_pen = at,
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
        eng_emit(e, r, &ev);
    }
}

