/* Prompt lookup (engine/ngram.h) against the rule as docs/SPECULATIVE.md states it, written here as a
 * plain scan: for n from nmax down to nmin, every earlier occurrence of the last n tokens is found;
 * at the first n with any, the drafts follow the latest occurrence followed by `max` tokens, else
 * the occurrence followed by most. Sequences grown token by token (the index updated from where it
 * stopped), loops, small and large vocabularies, sequences that shrink, and a reused index. */
#include "ngram.h"

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

/* The rule, by brute force: all occurrences first, then the choice. */
static int32_t rule(const int32_t *toks, int32_t n_toks, int32_t nmin, int32_t nmax, int32_t max, int32_t *out)
{
    for (int32_t g = nmax; g >= nmin; g--) {
        if (g >= n_toks) {
            continue;
        }
        int32_t latest_full = -1, most = -1, most_m = 0;
        for (int32_t p = 0; p + g < n_toks; p++) { /* occurrence toks[p..p+g), followed by toks[p+g..) */
            bool same = true;
            for (int32_t i = 0; i < g && same; i++) {
                same = toks[p + i] == toks[n_toks - g + i];
            }
            if (!same) {
                continue;
            }
            const int32_t m = n_toks - (p + g);
            if (m >= max) {
                latest_full = p; /* p grows: the last one seen is the latest */
            }
            if (m > most_m) {
                most = p;
                most_m = m;
            }
        }
        const int32_t at = latest_full >= 0 ? latest_full : most;
        if (at >= 0) {
            const int32_t m = latest_full >= 0 ? max : most_m;
            memcpy(out, toks + at + g, (size_t)m * sizeof(int32_t));
            return m;
        }
    }
    return 0;
}

static uint32_t g_rng = 12345;
static uint32_t rnd(uint32_t n)
{
    g_rng = g_rng * 1664525u + 1013904223u;
    return (g_rng >> 8) % n;
}

/* A sequence of `len` tokens over `vocab` ids, looping with a random period in stretches; each prefix
 * from 1 token up is looked up with both (the index reused as the sequence grows). */
static void grow_and_compare(int32_t len, uint32_t vocab, int32_t nmin, int32_t nmax, int32_t max)
{
    int32_t *toks = malloc((size_t)len * sizeof *toks);
    cr_assert_not_null(toks);
    struct kr_ngram x = {0};
    int32_t period = 0, drafted = 0;
    for (int32_t n = 0; n < len; n++) {
        if (rnd(64) == 0) {
            period = rnd(3) == 0 ? 0 : 1 + (int32_t)rnd(12); /* a loop starts or ends */
        }
        toks[n] = period > 0 && n >= period && rnd(16) != 0 ? toks[n - period] : (int32_t)rnd(vocab);
        int32_t a[16], b[16];
        const int32_t na = kr_ngram_propose(&x, toks, n + 1, nmin, nmax, max, a);
        const int32_t nb = rule(toks, n + 1, nmin, nmax, max, b);
        cr_assert_eq(na, nb, "length %d (vocab %u, n %d..%d, max %d): %d drafts, the rule %d", n + 1, vocab, nmin,
                     nmax, max, na, nb);
        cr_assert_arr_eq(a, b, (size_t)na * sizeof(int32_t), "length %d: other drafts", n + 1);
        drafted += na > 0;
    }
    cr_expect_gt(drafted, 0, "no prefix of the sequence drafted: the test says nothing");
    kr_ngram_free(&x);
    free(toks);
}

Test(ngram, equals_the_rule_on_growing_sequences)
{
    grow_and_compare(3000, 4, 1, 4, 3);      /* tiny vocabulary: long chains, matches everywhere */
    grow_and_compare(3000, 50, 2, 5, 5);
    grow_and_compare(3000, 131072, 1, 3, 4); /* large vocabulary: loops are the only repeats */
    grow_and_compare(1000, 16, 5, 5, 16);
    grow_and_compare(500, 8, 1, 1, 1);
}

/* The index follows the tokens it is given: a sequence that shrank, and other tokens of the same
 * length (a buffer reused for another sequence after kr_ngram_free) give the rule's drafts. */
Test(ngram, shrinking_and_reused)
{
    int32_t toks[400];
    for (int32_t i = 0; i < 400; i++) {
        toks[i] = (int32_t)rnd(6);
    }
    struct kr_ngram x = {0};
    int32_t a[8], b[8];
    const int32_t lens[] = {400, 123, 300, 2, 1, 399};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
        const int32_t na = kr_ngram_propose(&x, toks, lens[k], 1, 4, 8, a);
        const int32_t nb = rule(toks, lens[k], 1, 4, 8, b);
        cr_assert_eq(na, nb, "length %d: %d drafts, the rule %d", lens[k], na, nb);
        cr_assert_arr_eq(a, b, (size_t)na * sizeof(int32_t));
    }
    kr_ngram_free(&x);
    for (int32_t i = 0; i < 400; i++) {
        toks[i] = (int32_t)rnd(7) + 100;
    }
    const int32_t na = kr_ngram_propose(&x, toks, 400, 1, 4, 8, a);
    const int32_t nb = rule(toks, 400, 1, 4, 8, b);
    cr_assert_eq(na, nb);
    cr_assert_arr_eq(a, b, (size_t)na * sizeof(int32_t));
    cr_expect_eq(kr_ngram_propose(&x, toks, 400, 1, 4, 0, a), 0, "max 0 drafts something");
    kr_ngram_free(&x);
}
