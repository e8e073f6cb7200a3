/* Host sampler benchmark: one draw from a vocabulary-sized row of random logits with kr_sample,
 * for temperature alone, top-p, top-k, on a flat (logits in 0..4) and a peaked (0..20) row, next to
 * a greedy draw (one pass over the logits: the floor). Each figure is the mean of DRAWS draws. */
#include "sampler.h"

#include "clock.h"

#include <stdio.h>
#include <stdlib.h>

static double time_draws(struct kr_sampling *s, const float *l, int64_t nv, int n, struct kr_rng *r,
                         struct kr_sampler_scratch *sc)
{
    int32_t out;
    kr_sample(s, l, NULL, nv, NULL, 0, NULL, 0, r, sc, &out); /* warm the scratch */
    const double t0 = kr_clock_s();
    for (int i = 0; i < n; i++) {
        if (kr_sample(s, l, NULL, nv, NULL, 0, NULL, 0, r, sc, &out) != KR_OK) {
            fprintf(stderr, "bench_sampler: kr_sample failed\n");
            exit(1);
        }
    }
    return (kr_clock_s() - t0) / n * 1e3;
}

int main(int argc, char **argv)
{
    const int64_t nv = argc > 1 ? atoll(argv[1]) : 129280;
    const int n = argc > 2 ? atoi(argv[2]) : 50;
    float *l = malloc((size_t)nv * sizeof(float));
    if (!l || nv < 2 || n < 1) {
        fprintf(stderr, "usage: bench_sampler [VOCAB] [DRAWS]\n");
        return 2;
    }
    struct kr_rng r;
    kr_rng_seed(&r, 1);
    struct kr_sampler_scratch sc = {0};
    printf("| logits | sampling | ms/draw |\n|---|---|---|\n");
    for (int shape = 0; shape < 2; shape++) {
        for (int64_t i = 0; i < nv; i++) {
            const double u = kr_rng_uniform(&r);
            l[i] = shape == 0 ? (float)(4 * u * u * u * u) : (float)(20 * u * u * u * u * u * u);
        }
        const char *name = shape == 0 ? "spread 0..4 (flat)" : "spread 0..20 (peaked)";
        struct kr_sampling s;
        kr_sampling_default(&s);
        s.temperature = 0.0f;
        printf("| %s | greedy (one pass) | %.2f |\n", name, time_draws(&s, l, nv, n, &r, &sc));
        s.temperature = 1.0f;
        printf("| %s | temperature 1 | %.2f |\n", name, time_draws(&s, l, nv, n, &r, &sc));
        s.top_p = 0.9f;
        printf("| %s | top-p 0.9 | %.2f |\n", name, time_draws(&s, l, nv, n, &r, &sc));
        s.top_p = 1.0f;
        s.top_k = 50;
        printf("| %s | top-k 50 | %.2f |\n", name, time_draws(&s, l, nv, n, &r, &sc));
    }
    kr_sampler_scratch_free(&sc);
    free(l);
    return 0;
}
