/* Speculative decoding (engine.h, struct kr_spec_config): drafting, the room a draft takes in the
 * step (blocks, and state slots for the Mamba states after each drafted token), and verification,
 * which keeps the drafts the sampler draws and moves the sequence to the state after them. */
#include "engine-impl.h"

#include "log.h"

#include <string.h>

/* ---- drafting ------------------------------------------------------------------------------------ */

/* Prompt lookup: an earlier occurrence of the last n tokens of toks[0..n_toks), for n from nmax
 * down to nmin, and up to `max` of the tokens that followed it: the latest occurrence followed by
 * `max` tokens, else the one followed by most (in a loop the latest is followed by a few only). */
static int32_t ngram_propose(const int32_t *toks, int32_t n_toks, int32_t nmin, int32_t nmax, int32_t max,
                             int32_t *out)
{
    for (int32_t g = nmax; g >= nmin; g--) {
        if (g >= n_toks) {
            continue;
        }
        const int32_t *tail = toks + n_toks - g;
        int32_t best = -1, best_m = 0;
        for (int32_t p = n_toks - g - 1; p >= 0 && best_m < max; p--) { /* at p, followed by toks[p + g] */
            if (toks[p + g - 1] != tail[g - 1] || memcmp(toks + p, tail, (size_t)g * sizeof(int32_t)) != 0) {
                continue;
            }
            const int32_t m = n_toks - (p + g);
            if (m > best_m) {
                best = p;
                best_m = m < max ? m : max;
            }
        }
        if (best >= 0) {
            memcpy(out, toks + best + g, (size_t)best_m * sizeof(int32_t));
            return best_m;
        }
    }
    return 0;
}

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
    int32_t n = ngram_propose(s->toks, s->n_toks, sc->ngram_min, sc->ngram_max, lim, d);
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
