/* Sampler semantics on hand-made logits, checked against independently computed expectations
 * (softmax probabilities computed here in double precision, the documented penalty formulas). */
#include "sampler.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define V 8

static const float base[V] = {2.0f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 1.5f, -3.0f};

static int32_t draw(struct kr_sampling *s, const float *logits, struct kr_rng *rng, const struct kr_token_counts *tc,
                    int32_t n_gen)
{
    static struct kr_sampler_scratch sc;
    int32_t out = -1;
    const int32_t eos[1] = {3};
    cr_assert_eq(kr_sample(s, logits, NULL, V, tc, n_gen, eos, 1, rng, &sc, &out), KR_OK);
    return out;
}

/* Empirical frequencies of `n` draws. */
static void freqs(struct kr_sampling *s, double *f, int n)
{
    struct kr_rng rng;
    kr_rng_seed(&rng, 42);
    memset(f, 0, V * sizeof *f);
    for (int i = 0; i < n; i++) {
        f[draw(s, base, &rng, NULL, 0)] += 1.0 / n;
    }
}

/* Softmax of base/t restricted to `allowed`, in double. */
static void expected(double t, const int *allowed, double *p)
{
    double z = 0;
    for (int i = 0; i < V; i++) {
        p[i] = allowed[i] ? exp((double)base[i] / t) : 0.0;
        z += p[i];
    }
    for (int i = 0; i < V; i++) {
        p[i] /= z;
    }
}

Test(sampler, greedy_takes_the_argmax_with_lowest_id_on_ties)
{
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.0f;
    struct kr_rng rng;
    kr_rng_seed(&rng, 1);
    cr_expect_eq(draw(&s, base, &rng, NULL, 0), 0);
    float tie[V] = {0, 5, 1, 5, 0, 0, 0, 0};
    cr_expect_eq(draw(&s, tie, &rng, NULL, 0), 1);
    /* NaN counts as -inf wherever it stands (as the GPU sampler's canonical logit) */
    float nan0[V] = {NAN, 1, 3, NAN, 2, 3, 0, -1};
    cr_expect_eq(draw(&s, nan0, &rng, NULL, 0), 2, "a NaN first logit must not win the argmax");
    float nan_mid[V] = {-2, -1, NAN, -3, NAN, -1, -4, -5};
    cr_expect_eq(draw(&s, nan_mid, &rng, NULL, 0), 1);
    float all_low[V] = {NAN, -INFINITY, NAN, -INFINITY, NAN, NAN, -INFINITY, NAN};
    cr_expect_eq(draw(&s, all_low, &rng, NULL, 0), 0, "no finite logit: the lowest id");
}

Test(sampler, temperature_sampling_follows_the_softmax)
{
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.7f;
    double f[V], p[V];
    const int all[V] = {1, 1, 1, 1, 1, 1, 1, 1};
    freqs(&s, f, 200000);
    expected(0.7, all, p);
    for (int i = 0; i < V; i++) {
        /* 200k draws: standard error <= 0.0012; 5 sigma */
        cr_expect(fabs(f[i] - p[i]) < 0.006, "token %d: frequency %.4f, softmax %.4f", i, f[i], p[i]);
    }
}

/* A NaN logit counts as -inf at any temperature too (it was sorted by an inconsistent comparison
 * and could be drawn), in a small vocabulary and in one large enough for the radix sort. */
Test(sampler, temperature_sampling_never_draws_a_nan_logit)
{
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 1.0f;
    struct kr_rng rng;
    kr_rng_seed(&rng, 7);
    float l[V] = {NAN, 1.0f, NAN, 0.5f, NAN, -1.0f, NAN, 0.0f};
    double f[V] = {0}, p[V] = {0}, z = 0;
    for (int i = 0; i < V; i++) {
        p[i] = isnan(l[i]) ? 0.0 : exp((double)l[i]);
        z += p[i];
    }
    for (int i = 0; i < 100000; i++) {
        const int32_t t = draw(&s, l, &rng, NULL, 0);
        cr_assert(t >= 0 && t < V && !isnan(l[t]), "drew token %d, whose logit is NaN", t);
        f[t] += 1e-5;
    }
    for (int i = 0; i < V; i++) {
        /* 100k draws: standard error <= 0.0016; 5 sigma */
        cr_expect(fabs(f[i] - p[i] / z) < 0.008, "token %d: frequency %.4f, softmax %.4f", i, f[i], p[i] / z);
    }
    enum { NV = 65536 };
    float *big = malloc(NV * sizeof(float));
    cr_assert(big);
    for (int32_t i = 0; i < NV; i++) {
        big[i] = i % 3 == 0 ? NAN : (float)(i % 17) * 0.01f;
    }
    struct kr_sampler_scratch sc = {0};
    for (int i = 0; i < 200; i++) {
        int32_t t = -1;
        cr_assert_eq(kr_sample(&s, big, NULL, NV, NULL, 0, NULL, 0, &rng, &sc, &t), KR_OK);
        cr_assert(t >= 0 && t < NV && t % 3 != 0, "drew token %d, whose logit is NaN", t);
    }
    kr_sampler_scratch_free(&sc);
    free(big);
}

Test(sampler, top_k_keeps_the_k_most_likely)
{
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.top_k = 3; /* ids 0 (2.0), 6 (1.5), 1 (1.0) */
    double f[V], p[V];
    const int allowed[V] = {1, 1, 0, 0, 0, 0, 1, 0};
    freqs(&s, f, 100000);
    expected(1.0, allowed, p);
    for (int i = 0; i < V; i++) {
        cr_expect(fabs(f[i] - p[i]) < 0.008, "token %d: %.4f vs %.4f", i, f[i], p[i]);
    }
}

Test(sampler, top_p_keeps_the_smallest_prefix_reaching_p)
{
    /* softmax(base): p0 = .4046, p6 = .2454, p1 = .1488, p2 = .0903, ... ; prefix {0,6} = .6500,
     * {0,6,1} = .7988: top_p = 0.7 keeps {0, 6, 1} (and 0.6 would keep {0, 6}) */
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.top_p = 0.7f;
    double f[V], p[V];
    const int allowed[V] = {1, 1, 0, 0, 0, 0, 1, 0};
    freqs(&s, f, 100000);
    expected(1.0, allowed, p);
    for (int i = 0; i < V; i++) {
        cr_expect(fabs(f[i] - p[i]) < 0.008, "token %d: %.4f vs %.4f", i, f[i], p[i]);
    }
}

Test(sampler, min_p_drops_tokens_below_a_fraction_of_the_top)
{
    /* relative to the top (e^2): e^1.5/e^2 = .61, e^1/e^2 = .37, e^.5/e^2 = .22: min_p .3 keeps {0, 6, 1} */
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.min_p = 0.3f;
    double f[V], p[V];
    const int allowed[V] = {1, 1, 0, 0, 0, 0, 1, 0};
    freqs(&s, f, 100000);
    expected(1.0, allowed, p);
    for (int i = 0; i < V; i++) {
        cr_expect(fabs(f[i] - p[i]) < 0.008, "token %d: %.4f vs %.4f", i, f[i], p[i]);
    }
}

Test(sampler, penalties_follow_their_formulas)
{
    struct kr_token_counts tc;
    kr_token_counts_init(&tc);
    cr_assert_eq(kr_token_counts_add(&tc, 0, true), KR_OK);  /* prompt */
    cr_assert_eq(kr_token_counts_add(&tc, 6, false), KR_OK); /* output twice */
    cr_assert_eq(kr_token_counts_add(&tc, 6, false), KR_OK);
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.0f;
    struct kr_rng rng;
    kr_rng_seed(&rng, 1);
    /* repetition 2: token 0 -> 2.0 / 2 = 1.0, token 6 -> 1.5 / 2 = 0.75; argmax becomes 1 (1.0, lower id
     * than 0? no: 0 has 1.0 too and the lower id wins) */
    s.repetition_penalty = 2.0f;
    cr_expect_eq(draw(&s, base, &rng, &tc, 2), 0);
    s.repetition_penalty = 2.5f; /* token 0 -> 0.8 < 1.0 of token 1 */
    cr_expect_eq(draw(&s, base, &rng, &tc, 2), 1);
    /* frequency 0.1 x 2 + presence 0.3 on token 6: 1.5 - 0.5 = 1.0; with token 0 moved below by
     * repetition 2.5, tokens 1 and 6 tie at 1.0 and the lower id (1) wins */
    s.frequency_penalty = 0.1f;
    s.presence_penalty = 0.3f;
    cr_expect_eq(draw(&s, base, &rng, &tc, 2), 1);
    /* a negative frequency penalty favours repeated tokens: 1.5 + 2 * 0.5 = 2.5 > 2.0 */
    s.repetition_penalty = 1.0f;
    s.presence_penalty = 0.0f;
    s.frequency_penalty = -0.5f;
    cr_expect_eq(draw(&s, base, &rng, &tc, 2), 6);
    kr_token_counts_free(&tc);
}

Test(sampler, min_tokens_masks_eos_and_stop_ids)
{
    float l[V] = {0, 0, 0, 9, 0, 8, 0, 0}; /* EOS (3) is the argmax, stop id 5 the runner-up */
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.0f;
    s.min_tokens = 2;
    s.n_stop_ids = 1;
    s.stop_ids[0] = 5;
    struct kr_rng rng;
    kr_rng_seed(&rng, 1);
    cr_expect_eq(draw(&s, l, &rng, NULL, 1), 0, "below min_tokens neither EOS nor a stop id");
    cr_expect_eq(draw(&s, l, &rng, NULL, 2), 3, "from min_tokens on EOS is allowed");
}

Test(sampler, seeded_generators_repeat_and_differ)
{
    struct kr_rng a, b, c;
    kr_rng_seed(&a, 7);
    kr_rng_seed(&b, 7);
    kr_rng_seed(&c, 8);
    int same = 1, diff = 0;
    for (int i = 0; i < 100; i++) {
        double x = kr_rng_uniform(&a), y = kr_rng_uniform(&b), z = kr_rng_uniform(&c);
        same &= x == y;
        diff += x != z;
        cr_assert(x >= 0.0 && x < 1.0);
    }
    cr_expect(same);
    cr_expect_gt(diff, 95);
}

Test(sampler, validation_names_the_field)
{
    struct kr_sampling s;
    struct kr_err err;
    kr_sampling_default(&s);
    s.top_p = 0.0f;
    cr_expect_eq(kr_sampling_validate(&s, V, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "top_p"));
    kr_sampling_default(&s);
    s.logprobs = 21;
    cr_expect_eq(kr_sampling_validate(&s, V, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "logprobs"));
    kr_sampling_default(&s);
    s.n_stop_ids = 1;
    s.stop_ids[0] = V;
    cr_expect_eq(kr_sampling_validate(&s, V, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "stop_token_ids"));
    kr_sampling_default(&s);
    s.min_tokens = 20;
    cr_expect_eq(kr_sampling_validate(&s, V, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "min_tokens"));
}

/* ---- a large vocabulary against a plain full-sort reference ------------------------------------ */

struct ref_cand {
    float v;
    int32_t id;
};

static int ref_cmp(const void *a, const void *b)
{
    const struct ref_cand *x = a, *y = b;
    if (x->v != y->v) {
        return x->v > y->v ? -1 : 1;
    }
    return x->id - y->id;
}

/* The documented semantics, written the obvious way: sort every candidate, cut by top-k, top-p
 * (smallest prefix reaching p) and min-p, then walk the kept prefix with u times its mass. */
static int32_t ref_draw(const float *logits, int32_t n, float t, int32_t top_k, float top_p, float min_p, double u,
                        struct ref_cand *c)
{
    for (int32_t i = 0; i < n; i++) {
        c[i].v = logits[i];
        c[i].id = i;
    }
    qsort(c, (size_t)n, sizeof *c, ref_cmp);
    int32_t keep = top_k > 0 && top_k < n ? top_k : n;
    const double mx = (double)(c[0].v * (1.0f / t));
    double total = 0;
    for (int32_t i = 0; i < keep; i++) {
        total += exp((double)c[i].v * (1.0f / t) - mx);
    }
    if (top_p < 1.0f) {
        double cum = 0;
        int32_t k = 0;
        while (k < keep) {
            cum += exp((double)c[k].v * (1.0f / t) - mx) / total;
            k++;
            if (cum >= top_p) {
                break;
            }
        }
        keep = k;
    }
    if (min_p > 0.0f) {
        int32_t k = 1;
        while (k < keep && exp((double)c[k].v * (1.0f / t) - mx) >= min_p) {
            k++;
        }
        keep = k;
    }
    total = 0;
    for (int32_t i = 0; i < keep; i++) {
        total += exp((double)c[i].v * (1.0f / t) - mx);
    }
    double cum = 0;
    for (int32_t i = 0; i < keep; i++) {
        cum += exp((double)c[i].v * (1.0f / t) - mx);
        if (u * total < cum) {
            return c[i].id;
        }
    }
    return c[keep - 1].id;
}

/* On 129280 logits (peaked, flat, and with many exact ties), for temperature alone, top-k (small
 * and larger than the chunk the sampler sorts at a time), top-p and min-p, the sampler draws the
 * token the full-sort reference draws for the same u (up to draws within 1e-9 of a boundary,
 * which summation order may tip; counted and bounded). */
Test(sampler, large_vocabulary_matches_a_full_sort)
{
    enum { NV = 129280 };
    float *logits = malloc(NV * sizeof(float));
    struct ref_cand *c = malloc(NV * sizeof *c);
    cr_assert(logits && c);
    struct kr_sampler_scratch sc = {0};
    struct kr_rng rng;
    kr_rng_seed(&rng, 2024);
    const struct {
        float t;
        int32_t k;
        float p, mp;
    } cfg[] = {{1.0f, 0, 1.0f, 0.0f}, {0.7f, 50, 1.0f, 0.0f}, {1.0f, 2000, 1.0f, 0.0f}, {0.9f, 0, 0.9f, 0.0f},
               {1.2f, 0, 1.0f, 0.05f}, {0.8f, 300, 0.95f, 0.01f}, {1.0f, 0, 0.5f, 0.0f}};
    int32_t boundary = 0, draws = 0;
    for (int shape = 0; shape < 3; shape++) {
        for (int32_t i = 0; i < NV; i++) {
            const double r = kr_rng_uniform(&rng);
            logits[i] = shape == 0 ? (float)(8.0 * r * r * r)            /* peaked */
                        : shape == 1 ? (float)(0.01 * r)                 /* nearly flat */
                                     : (float)((int)(r * 16.0)) * 0.25f; /* 16 values: many exact ties */
        }
        for (size_t j = 0; j < sizeof cfg / sizeof cfg[0]; j++) {
            for (int rep = 0; rep < 6; rep++) {
                const double u = kr_rng_uniform(&rng);
                int32_t got = -1;
                cr_assert_eq(kr_sample_with_draw(logits, NULL, NV, cfg[j].t, cfg[j].k, cfg[j].p, cfg[j].mp, 0, 0, 1, NULL,
                                                 NULL, NULL, 0, u, &sc, &got),
                             KR_OK);
                const int32_t want = ref_draw(logits, NV, cfg[j].t, cfg[j].k, cfg[j].p, cfg[j].mp, u, c);
                const int32_t near = ref_draw(logits, NV, cfg[j].t, cfg[j].k, cfg[j].p, cfg[j].mp,
                                              u + 1e-9 < 1 ? u + 1e-9 : u, c);
                draws++;
                if (got != want && got == near) {
                    boundary++; /* u sits within 1e-9 of a boundary */
                    continue;
                }
                cr_expect_eq(got, want, "shape %d config %zu draw %d: token %d, the full sort draws %d", shape, j, rep,
                             got, want);
            }
        }
    }
    cr_expect_leq(boundary, 1, "%d of %d draws sat on a boundary", boundary, draws);
    kr_sampler_scratch_free(&sc);
    free(logits);
    free(c);
}

/* logit_bias is added to the raw logits first: +100 makes a token certain, -100 removes it (up to
 * e^-100), and a small bias shifts the softmax by exactly exp(bias). */
Test(sampler, logit_bias_is_added_to_the_logits)
{
    struct kr_sampling s;
    kr_sampling_default(&s);
    struct kr_rng rng;
    kr_rng_seed(&rng, 9);
    s.n_bias = 1;
    s.bias_ids[0] = 7; /* the least likely token */
    s.bias[0] = 100.0f;
    for (int i = 0; i < 50; i++) {
        cr_expect_eq(draw(&s, base, &rng, NULL, 0), 7);
    }
    s.temperature = 0.0f;
    cr_expect_eq(draw(&s, base, &rng, NULL, 0), 7);
    s.bias_ids[0] = 0; /* the most likely token, banned */
    s.bias[0] = -100.0f;
    cr_expect_eq(draw(&s, base, &rng, NULL, 0), 6, "greedy after the ban takes the second most likely");
    s.temperature = 1.0f;
    for (int i = 0; i < 200; i++) {
        cr_expect_neq(draw(&s, base, &rng, NULL, 0), 0);
    }
    /* a bias of log 4 on token 3 multiplies its odds by 4 */
    s.bias_ids[0] = 3;
    s.bias[0] = logf(4.0f);
    double f[V], p[V];
    const int n = 200000;
    kr_rng_seed(&rng, 10);
    memset(f, 0, sizeof f);
    for (int i = 0; i < n; i++) {
        f[draw(&s, base, &rng, NULL, 0)] += 1.0 / n;
    }
    double z = 0;
    for (int i = 0; i < V; i++) {
        p[i] = exp((double)base[i]) * (i == 3 ? 4.0 : 1.0);
        z += p[i];
    }
    for (int i = 0; i < V; i++) {
        cr_expect(fabs(f[i] - p[i] / z) < 0.005, "token %d: frequency %.4f, expected %.4f", i, f[i], p[i] / z);
    }
    struct kr_err err = {0};
    s.bias[0] = 101.0f;
    cr_expect_eq(kr_sampling_validate(&s, V, &err), KR_ERR_INVAL);
    s.bias[0] = 1.0f;
    s.bias_ids[0] = V;
    cr_expect_eq(kr_sampling_validate(&s, V, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "logit_bias") != NULL, "%s", err.msg);
}

/* ---- allowed-token masks (constrained decoding) ------------------------------------------------- */

/* A one-word mask allowing the ids of `allowed` (V <= 32). */
static uint32_t mask_of(const int *allowed)
{
    uint32_t m = 0;
    for (int i = 0; i < V; i++) {
        m |= allowed[i] ? 1u << i : 0u;
    }
    return m;
}

static int32_t draw_masked(struct kr_sampling *s, const float *logits, const uint32_t *mask, struct kr_rng *rng,
                           const struct kr_token_counts *tc, int32_t n_gen, enum kr_status *st)
{
    static struct kr_sampler_scratch sc;
    int32_t out = -1;
    const int32_t eos[1] = {3};
    *st = kr_sample(s, logits, mask, V, tc, n_gen, eos, 1, rng, &sc, &out);
    return out;
}

/* Masked tokens are impossible and the rest keep their relative odds: the draw follows the softmax
 * restricted to the allowed tokens, greedy takes the best allowed one. */
Test(sampler, a_mask_restricts_the_draw_to_the_allowed_tokens)
{
    const int allowed[V] = {0, 1, 1, 0, 1, 0, 0, 1}; /* the two most likely tokens (0, 6) are out */
    const uint32_t m = mask_of(allowed);
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.8f;
    struct kr_rng rng;
    kr_rng_seed(&rng, 5);
    double f[V] = {0}, p[V];
    const int n = 200000;
    enum kr_status st;
    for (int i = 0; i < n; i++) {
        const int32_t t = draw_masked(&s, base, &m, &rng, NULL, 0, &st);
        cr_assert_eq(st, KR_OK);
        f[t] += 1.0 / n;
    }
    expected(0.8, allowed, p);
    for (int i = 0; i < V; i++) {
        cr_expect(fabs(f[i] - p[i]) < 0.006, "token %d: frequency %.4f, restricted softmax %.4f", i, f[i], p[i]);
        if (!allowed[i]) {
            cr_expect_eq(f[i], 0.0, "masked token %d was drawn", i);
        }
    }
    s.temperature = 0.0f;
    cr_expect_eq(draw_masked(&s, base, &m, &rng, NULL, 0, &st), 1, "greedy: the best allowed token");
    s.temperature = 1.0f;
    s.top_k = 1;
    cr_expect_eq(draw_masked(&s, base, &m, &rng, NULL, 0, &st), 1, "top_k counts allowed tokens only");
}

/* The mask comes first: a bias of +100 or a negative frequency penalty cannot bring a masked token
 * back, and min_tokens masking of EOS adds to the mask. */
Test(sampler, nothing_after_the_mask_re_enables_a_masked_token)
{
    const int allowed[V] = {0, 1, 1, 1, 0, 0, 0, 0};
    const uint32_t m = mask_of(allowed);
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.n_bias = 2;
    s.bias_ids[0] = 7; /* masked: +100 must not matter */
    s.bias[0] = 100.0f;
    s.bias_ids[1] = 2; /* allowed: +100 makes it certain */
    s.bias[1] = 100.0f;
    struct kr_rng rng;
    kr_rng_seed(&rng, 6);
    enum kr_status st;
    for (int i = 0; i < 200; i++) {
        cr_expect_eq(draw_masked(&s, base, &m, &rng, NULL, 0, &st), 2);
    }
    s.temperature = 0.0f;
    cr_expect_eq(draw_masked(&s, base, &m, &rng, NULL, 0, &st), 2);
    /* a negative frequency penalty on a masked repeated token */
    s.n_bias = 0;
    s.frequency_penalty = -2.0f;
    s.presence_penalty = -2.0f;
    s.repetition_penalty = 0.1f; /* would multiply a masked logit's magnitude, never its sign */
    struct kr_token_counts tc;
    kr_token_counts_init(&tc);
    for (int k = 0; k < 40; k++) {
        cr_assert_eq(kr_token_counts_add(&tc, 0, false), KR_OK);
    }
    cr_expect_eq(draw_masked(&s, base, &m, &rng, &tc, 1, &st), 1, "token 0 is masked whatever its penalties");
    kr_token_counts_free(&tc);
    /* EOS (3) allowed by the mask but below min_tokens: masked as well */
    float l[V] = {0, 0, 0, 9, 0, 0, 0, 0};
    s.frequency_penalty = s.presence_penalty = 0.0f;
    s.repetition_penalty = 1.0f;
    s.min_tokens = 2;
    cr_expect_eq(draw_masked(&s, l, &m, &rng, NULL, 0, &st), 1, "EOS below min_tokens, 0 masked: the lowest allowed id");
    cr_expect_eq(draw_masked(&s, l, &m, &rng, NULL, 2, &st), 3);
    /* nothing allowed: a sampling row fails, a greedy one takes id 0 as with every logit -inf */
    const uint32_t none = 0;
    s.temperature = 1.0f;
    draw_masked(&s, base, &none, &rng, NULL, 0, &st);
    cr_expect_eq(st, KR_ERR_INTERNAL);
}

/* The backends' entry point applies the same mask with a given draw. */
Test(sampler, with_draw_applies_the_mask_as_kr_sample_does)
{
    const int allowed[V] = {1, 0, 1, 0, 1, 0, 0, 1};
    const uint32_t m = mask_of(allowed);
    struct kr_sampler_scratch sc = {0};
    for (int i = 0; i < 1000; i++) {
        const double u = (i + 0.5) / 1000.0;
        int32_t got = -1;
        cr_assert_eq(kr_sample_with_draw(base, &m, V, 1.0f, 0, 1.0f, 0.0f, 0, 0, 1, NULL, NULL, NULL, 0, u, &sc, &got),
                     KR_OK);
        cr_expect(allowed[got], "draw %d took masked token %d", i, got);
    }
    int32_t got = -1;
    cr_assert_eq(kr_sample_with_draw(base, &m, V, 0.0f, 0, 1.0f, 0.0f, 0, 0, 1, NULL, NULL, NULL, 0, 0.0, &sc, &got),
                 KR_OK);
    cr_expect_eq(got, 0);
    kr_sampler_scratch_free(&sc);
}

/* The reported log-probabilities of a constrained row: the allowed tokens normalized among
 * themselves (vLLM applies the grammar's mask to the logits before computing them). */
Test(sampler, masked_log_softmax_normalizes_over_the_allowed_tokens)
{
    const int allowed[V] = {0, 1, 1, 0, 1, 0, 1, 0};
    const uint32_t m = mask_of(allowed);
    float lp[V], plain[V];
    kr_log_softmax_masked(base, &m, lp, V);
    kr_log_softmax_masked(base, NULL, plain, V);
    double z = 0;
    for (int i = 0; i < V; i++) {
        z += allowed[i] ? exp((double)base[i]) : 0.0;
    }
    double total = 0;
    for (int i = 0; i < V; i++) {
        if (allowed[i]) {
            cr_expect(fabs(lp[i] - (base[i] - log(z))) < 1e-5, "token %d: %g vs %g", i, lp[i], base[i] - log(z));
            total += exp((double)lp[i]);
        } else {
            cr_expect(isinf(lp[i]) && lp[i] < 0, "masked token %d: %g", i, lp[i]);
        }
    }
    cr_expect(fabs(total - 1.0) < 1e-6);
    float ref[V];
    kr_log_softmax(base, ref, V);
    cr_expect(memcmp(plain, ref, sizeof ref) == 0, "no mask: kr_log_softmax");
    cr_expect(kr_mask_allows(&m, 1) && !kr_mask_allows(&m, 0) && kr_mask_allows(NULL, 5));
}

/* A mask over a large vocabulary, words of every kind (all allowed, none, mixed, a partial last
 * word): the host path masks exactly the ids the bits name. */
Test(sampler, large_masks_follow_their_bits)
{
    enum { NV = 1000 };
    static float logits[NV];
    static uint32_t mask[(NV + 31) / 32];
    struct kr_rng rng;
    kr_rng_seed(&rng, 77);
    for (int32_t i = 0; i < NV; i++) {
        logits[i] = (float)(4.0 * kr_rng_uniform(&rng));
    }
    for (int32_t w = 0; w < (NV + 31) / 32; w++) {
        mask[w] = w % 3 == 0 ? 0xffffffffu : w % 3 == 1 ? 0u : (uint32_t)(kr_rng_uniform(&rng) * 4294967296.0);
    }
    struct kr_sampling s;
    kr_sampling_default(&s);
    struct kr_sampler_scratch sc = {0};
    for (int i = 0; i < 3000; i++) {
        int32_t out = -1;
        cr_assert_eq(kr_sample(&s, logits, mask, NV, NULL, 0, NULL, 0, &rng, &sc, &out), KR_OK);
        cr_expect(kr_mask_allows(mask, out), "token %d is masked", out);
    }
    kr_sampler_scratch_free(&sc);
}
