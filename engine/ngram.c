#include "ngram.h"

#include "alloc.h"
#include "array.h"

#include <string.h>

static uint32_t tok_hash(int32_t t)
{
    uint32_t h = (uint32_t)t * 0x9e3779b1u; /* Fibonacci hashing: the high bits are the well mixed ones */
    return h ^ (h >> 15);
}

/* The entry of token t: its own, or the empty one where it would go. */
static int32_t map_find(const struct kr_ngram *x, int32_t t)
{
    const uint32_t mask = (uint32_t)x->cap_map - 1;
    uint32_t i = tok_hash(t) & mask;
    while (x->map_pos[i] >= 0 && x->map_tok[i] != t) {
        i = (i + 1) & mask;
    }
    return (int32_t)i;
}

static bool map_grow(struct kr_ngram *x)
{
    const int32_t cap = x->cap_map ? 2 * x->cap_map : 256;
    int32_t *tok = kr_malloc((size_t)cap * sizeof *tok), *pos = kr_malloc((size_t)cap * sizeof *pos);
    if (!tok || !pos) {
        kr_free(tok);
        kr_free(pos);
        return false;
    }
    for (int32_t i = 0; i < cap; i++) {
        pos[i] = -1;
    }
    struct kr_ngram y = {.map_tok = tok, .map_pos = pos, .cap_map = cap};
    for (int32_t i = 0; i < x->cap_map; i++) {
        if (x->map_pos[i] >= 0) {
            const int32_t j = map_find(&y, x->map_tok[i]);
            tok[j] = x->map_tok[i];
            pos[j] = x->map_pos[i];
        }
    }
    kr_free(x->map_tok);
    kr_free(x->map_pos);
    x->map_tok = tok;
    x->map_pos = pos;
    x->cap_map = cap;
    return true;
}

void kr_ngram_free(struct kr_ngram *x)
{
    kr_free(x->prev);
    kr_free(x->map_tok);
    kr_free(x->map_pos);
    *x = (struct kr_ngram){0};
}

/* Indexes positions [x->n, n_toks); false (the index emptied) when out of memory. */
static bool index_to(struct kr_ngram *x, const int32_t *toks, int32_t n_toks)
{
    if (n_toks < x->n) { /* the tokens shrank: index them again */
        kr_ngram_free(x);
    }
    if (KR_ARRAY_RESERVE(x->prev, x->cap, n_toks, 64) != KR_OK) {
        kr_ngram_free(x);
        return false;
    }
    for (int32_t i = x->n; i < n_toks; i++) {
        if (2 * (x->n_map + 1) > x->cap_map && !map_grow(x)) {
            kr_ngram_free(x);
            return false;
        }
        const int32_t j = map_find(x, toks[i]);
        if (x->map_pos[j] >= 0) {
            x->prev[i] = x->map_pos[j];
        } else {
            x->prev[i] = -1;
            x->map_tok[j] = toks[i];
            x->n_map++;
        }
        x->map_pos[j] = i;
        x->n = i + 1;
    }
    return true;
}

int32_t kr_ngram_propose(struct kr_ngram *x, const int32_t *toks, int32_t n_toks, int32_t nmin, int32_t nmax,
                         int32_t max, int32_t *out)
{
    if (n_toks < 2 || max <= 0 || !index_to(x, toks, n_toks)) {
        return 0;
    }
    for (int32_t g = nmax; g >= nmin; g--) {
        if (g >= n_toks) {
            continue;
        }
        const int32_t *tail = toks + n_toks - g;
        int32_t best = -1, best_m = 0;
        /* q: an earlier position of the last token, latest first; the occurrence is toks[q-g+1..q],
         * followed by the n_toks - 1 - q tokens after q */
        for (int32_t q = x->prev[n_toks - 1]; q >= g - 1 && best_m < max; q = x->prev[q]) {
            if (memcmp(toks + q - g + 1, tail, (size_t)(g - 1) * sizeof(int32_t)) != 0) {
                continue;
            }
            const int32_t m = n_toks - 1 - q;
            if (m > best_m) {
                best = q + 1;
                best_m = m < max ? m : max;
            }
        }
        if (best >= 0) {
            memcpy(out, toks + best, (size_t)best_m * sizeof(int32_t));
            return best_m;
        }
    }
    return 0;
}
