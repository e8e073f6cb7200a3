#include "runner.h"

#include "alloc.h"
#include "sampler.h"

#include <string.h>

int32_t kr_argmax(const float *v, int64_t n)
{
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++) {
        if (v[i] > v[best]) {
            best = i;
        }
    }
    return (int32_t)best;
}

/* One step of one sequence: tokens ids[0..nt) at positions seq->n_pos.., logits of the rows in
 * [want0, nt) written to out. */
static enum kr_status step(struct kr_model *m, struct kr_cache *c, struct kr_seq_cache *seq, const int32_t *ids,
                           int32_t nt, int32_t want0, float *out, struct kr_err *err)
{
    enum kr_status st = kr_seq_cache_reserve(c, seq, seq->n_pos + nt);
    if (st == KR_AGAIN) {
        return kr_err_set(err, KR_ERR_NOMEM, "the cache has no room for %d more tokens (%d blocks of %d free)", nt,
                          c->n_free_blocks, c->block_size);
    }
    if (st != KR_OK) {
        return st;
    }
    int32_t *pos = kr_malloc((size_t)nt * 2 * sizeof(int32_t));
    if (!pos) {
        return KR_ERR_NOMEM;
    }
    int32_t *outs = pos + nt;
    for (int32_t i = 0; i < nt; i++) {
        pos[i] = seq->n_pos + i;
        outs[i] = want0 + i;
    }
    const int32_t tok0[2] = {0, nt};
    const int32_t pos0 = seq->n_pos;
    const int32_t zero_block = 0;
    struct kr_batch b = {
        .n_tok = nt,
        .n_seq = 1,
        .tokens = ids,
        .pos = pos,
        .seq_tok0 = tok0,
        .seq_pos0 = &pos0,
        .seq_slot = &seq->slot,
        .block_table = seq->n_blocks ? seq->blocks : &zero_block,
        .max_blocks = seq->n_blocks,
        .n_out = nt - want0,
        .out_tok = outs,
    };
    st = kr_model_forward(m, c, &b, out, err);
    kr_free(pos);
    if (st == KR_OK) {
        seq->n_pos += nt;
        for (int32_t i = 0; i < nt - want0; i++) { /* logits -> log-probabilities */
            float *row = out + (size_t)i * (size_t)m->cfg.vocab;
            kr_log_softmax(row, row, m->cfg.vocab);
        }
    }
    return st;
}

enum kr_status kr_run_prompt_logprobs(struct kr_model *m, struct kr_cache *c, const int32_t *ids, int32_t n,
                                      int32_t chunk, float *out, struct kr_err *err)
{
    struct kr_seq_cache seq;
    enum kr_status st = kr_seq_cache_init(c, &seq);
    if (st != KR_OK) {
        return kr_err_set(err, st == KR_AGAIN ? KR_ERR_NOMEM : st, "no free state slot");
    }
    if (chunk <= 0) {
        chunk = n;
    }
    for (int32_t i = 0; i < n && st == KR_OK; i += chunk) {
        int32_t nt = n - i < chunk ? n - i : chunk;
        st = step(m, c, &seq, ids + i, nt, 0, out + (size_t)i * (size_t)m->cfg.vocab, err);
    }
    kr_seq_cache_release(c, &seq);
    return st;
}

static bool is_eos(const struct kr_model_config *cfg, int32_t id)
{
    for (int32_t i = 0; i < cfg->n_eos; i++) {
        if (cfg->eos_ids[i] == id) {
            return true;
        }
    }
    return false;
}

enum kr_status kr_run_greedy(struct kr_model *m, struct kr_cache *c, const int32_t *ids, int32_t n, int32_t chunk,
                             int32_t max_new, bool ignore_eos, int32_t *out_ids, float *out_lp, int32_t *n_out,
                             struct kr_err *err)
{
    *n_out = 0;
    if (n < 1) {
        return kr_err_set(err, KR_ERR_INVAL, "the prompt must hold at least one token");
    }
    const int64_t V = m->cfg.vocab;
    float *lp = kr_malloc((size_t)V * sizeof(float));
    if (!lp) {
        return KR_ERR_NOMEM;
    }
    struct kr_seq_cache seq;
    enum kr_status st = kr_seq_cache_init(c, &seq);
    if (st != KR_OK) {
        kr_free(lp);
        return kr_err_set(err, st == KR_AGAIN ? KR_ERR_NOMEM : st, "no free state slot");
    }
    if (chunk <= 0) {
        chunk = n;
    }
    for (int32_t i = 0; i < n && st == KR_OK; i += chunk) {
        int32_t nt = n - i < chunk ? n - i : chunk;
        /* only the last prompt token's logits are needed */
        st = step(m, c, &seq, ids + i, nt, i + nt == n ? nt - 1 : nt, lp, err);
    }
    for (int32_t k = 0; k < max_new && st == KR_OK; k++) {
        int32_t next = kr_argmax(lp, V);
        out_ids[k] = next;
        if (out_lp) {
            out_lp[k] = lp[next];
        }
        *n_out = k + 1;
        if ((!ignore_eos && is_eos(&m->cfg, next)) || k + 1 == max_new) {
            break;
        }
        st = step(m, c, &seq, &next, 1, 0, lp, err);
    }
    kr_seq_cache_release(c, &seq);
    kr_free(lp);
    return st;
}
