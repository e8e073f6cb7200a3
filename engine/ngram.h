/* Prompt lookup for n-gram drafts, with an index that grows with the sequence.
 *
 * The rule (docs/SPECULATIVE.md, "Drafting (prompt lookup)"): for n from nmax down to nmin, an
 * earlier occurrence of the sequence's last n tokens; at the first n with one, up to `max` of the
 * tokens that followed it: those after the latest occurrence followed by `max` tokens, else after
 * the occurrence followed by most (inside a loop the latest is followed by a few only).
 *
 * Scanning the sequence for each n costs its length every step (about 0.2 ms per n at 128K tokens,
 * for each drafting sequence). The index chains each position to the previous one holding the same
 * token (prev[]) and maps each token to its latest position, so a lookup visits only the earlier
 * positions of the sequence's last token. It is brought up to date at each lookup from where it
 * stopped (tokens are only appended); a sequence whose tokens shrank is indexed again. */
#ifndef KR_NGRAM_H
#define KR_NGRAM_H

#include <stdint.h>

struct kr_ngram {
    int32_t *prev;           /* [cap] prev[i]: the latest j < i with toks[j] == toks[i], -1 if none */
    int32_t *map_tok;        /* [cap_map] open addressing, token -> its latest position (map_pos) */
    int32_t *map_pos;        /* -1: an empty entry */
    int32_t n, cap;          /* positions indexed */
    int32_t cap_map, n_map;  /* entries (a power of two) and tokens held */
};

/* Up to `max` drafts into out (returns how many; 0 when no n matches or the index could not grow).
 * The index is kept in x (zero-initialised at first). */
int32_t kr_ngram_propose(struct kr_ngram *x, const int32_t *toks, int32_t n_toks, int32_t nmin, int32_t nmax,
                         int32_t max, int32_t *out);

void kr_ngram_free(struct kr_ngram *x);

#endif
