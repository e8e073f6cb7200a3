/* Prompt lookup for n-gram drafts (engine/ngram.h): the time of one decode step's lookup for one
 * sequence of a given length, with the index (one token appended, then the lookup: what each step
 * does) against scanning the whole sequence for each n (the lookup before the index).
 *   bench_ngram [--nmin 1] [--nmax 4] [--k 3]
 * Sequences: random ids over 131072 (no loop: the lookup finds little and the scan reads it all),
 * and text-like ids over 4096 with loops of 2 to 12 tokens now and then. */
#include "ngram.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* the lookup as a scan, for each n: every earlier position compared */
static int32_t scan(const int32_t *toks, int32_t n_toks, int32_t nmin, int32_t nmax, int32_t max, int32_t *out)
{
    for (int32_t g = nmax; g >= nmin; g--) {
        if (g >= n_toks) {
            continue;
        }
        const int32_t *tail = toks + n_toks - g;
        int32_t best = -1, best_m = 0;
        for (int32_t p = n_toks - g - 1; p >= 0 && best_m < max; p--) {
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

static uint32_t g_rng = 1;
static uint32_t rnd(uint32_t n)
{
    g_rng = g_rng * 1664525u + 1013904223u;
    return (g_rng >> 8) % n;
}

int main(int argc, char **argv)
{
    int32_t nmin = 1, nmax = 4, k = 3;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--nmin")) {
            nmin = atoi(argv[i + 1]);
        } else if (!strcmp(argv[i], "--nmax")) {
            nmax = atoi(argv[i + 1]);
        } else if (!strcmp(argv[i], "--k")) {
            k = atoi(argv[i + 1]);
        } else {
            fprintf(stderr, "usage: bench_ngram [--nmin 1] [--nmax 4] [--k 3]\n");
            return 2;
        }
    }
    static const int32_t lens[] = {2048, 16384, 131072};
    printf("prompt lookup, n %d..%d, up to %d drafts: ms per decode step and sequence\n", nmin, nmax, k);
    printf("| sequence | tokens | scan | index (append + lookup) | drafted (scan / index) |\n|---|---|---|---|---|\n");
    for (int kind = 0; kind < 2; kind++) {
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
            const int32_t n = lens[li], steps = 200;
            int32_t *toks = malloc((size_t)(n + steps) * sizeof *toks);
            if (!toks) {
                return 1;
            }
            int32_t period = 0;
            for (int32_t i = 0; i < n + steps; i++) {
                if (kind == 1 && rnd(200) == 0) {
                    period = rnd(2) ? 0 : 2 + (int32_t)rnd(11);
                }
                toks[i] = kind == 0 ? (int32_t)rnd(131072)
                                    : (period > 0 && i >= period ? toks[i - period] : (int32_t)rnd(4096));
            }
            int32_t out[16], d_scan = 0, d_index = 0;
            struct kr_ngram x = {0};
            kr_ngram_propose(&x, toks, n, nmin, nmax, k, out); /* the index of the prompt, built once */
            double t0 = now_ms();
            for (int32_t s = 0; s < steps; s++) {
                d_scan += scan(toks, n + s, nmin, nmax, k, out) > 0;
            }
            double t1 = now_ms();
            for (int32_t s = 0; s < steps; s++) {
                d_index += kr_ngram_propose(&x, toks, n + s, nmin, nmax, k, out) > 0;
            }
            double t2 = now_ms();
            printf("| %s | %d | %.4f | %.4f | %d / %d of %d |\n", kind == 0 ? "random ids (131072)" : "loops (4096 ids)",
                   n, (t1 - t0) / steps, (t2 - t1) / steps, d_scan, d_index, steps);
            kr_ngram_free(&x);
            free(toks);
        }
    }
    return 0;
}
