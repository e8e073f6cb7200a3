/* The CPU reference forward pass against HF transformers on tiny random-weight nemotron_h
 * checkpoints (tools/reference/make_nemotron_h_fixtures.py; HF computes in fp32 from the same
 * bf16/f16/f32 weights, without caches). Tolerances: log-probabilities within 1e-3 absolute of HF
 * at every position and vocabulary entry; our own prefill/decode/chunking variants within 1e-4
 * of each other (fp32 rounding of a different summation order); batch composition bitwise. */
#include "fixture.h"
#include "runner.h"

#include "alloc.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <string.h>

#define HF_TOL 1e-3
#define SELF_TOL 1e-4

static const char *const fixtures[] = {
    "nh_mamba_attn_mlp", "nh_moe", "nh_tied_f32", "nh_gated", "nh_long_chunks",
};
#define N_FIXTURES ((int)(sizeof fixtures / sizeof fixtures[0]))
/* Parameters are fixture indices: test processes may be fresh executions of the binary, where
 * pointers from the parent's address space mean nothing. */
static int fixture_idx[N_FIXTURES] = {0, 1, 2, 3, 4};
_Static_assert(sizeof fixture_idx / sizeof fixture_idx[0] == 5, "one index per fixture");

#define FIXTURE_PARAMS(test)                                                                       \
    ParameterizedTestParameters(nemotron_h_hf, test)                                               \
    {                                                                                              \
        return cr_make_param_array(int, fixture_idx, N_FIXTURES);                                  \
    }

FIXTURE_PARAMS(prompt_logprobs_match_hf)
ParameterizedTest(int *idx, nemotron_h_hf, prompt_logprobs_match_hf)
{
    const char *const *name = &fixtures[*idx];
    struct fx f;
    fx_load(&f, "nemotron_h", *name, 2, 2);
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        float *lp = kr_malloc((size_t)p->n * (size_t)f.vocab * sizeof(float));
        struct kr_err err = {{0}};
        cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, 0, lp, &err), KR_OK, "%s", err.msg);
        for (int32_t t = 0; t < p->n; t++) {
            double d = max_abs_diff(lp + (size_t)t * f.vocab, p->logprobs + (size_t)t * f.vocab, f.vocab);
            cr_expect_leq(d, HF_TOL, "%s prompt %d (len %d) position %d: max |logprob - HF| = %g", *name, i, p->n, t, d);
        }
        kr_free(lp);
    }
    fx_free(&f);
}

FIXTURE_PARAMS(greedy_matches_hf)
ParameterizedTest(int *idx, nemotron_h_hf, greedy_matches_hf)
{
    const char *const *name = &fixtures[*idx];
    struct fx f;
    fx_load(&f, "nemotron_h", *name, 2, 2);
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        int32_t out[64], n_out = 0;
        struct kr_err err = {{0}};
        cr_assert_eq(kr_run_greedy(f.m, f.c, p->ids, p->n, 0, p->n_greedy, true, out, NULL, &n_out, &err), KR_OK,
                     "%s", err.msg);
        cr_assert_eq(n_out, p->n_greedy);
        int32_t compared = 0;
        for (int32_t k = 0; k < p->n_greedy; k++) {
            /* beyond the first near-tie of HF's top two, either continuation is legitimate */
            if (p->margin[k] < 1e-3f) {
                break;
            }
            cr_expect_eq(out[k], p->greedy[k], "%s prompt %d: greedy token %d is %d, HF %d", *name, i, k, out[k],
                         p->greedy[k]);
            compared++;
        }
        cr_expect_gt(compared, 0, "%s prompt %d: HF's first greedy margin is a near-tie, nothing compared", *name, i);
    }
    fx_free(&f);
}

FIXTURE_PARAMS(prefill_then_decode_equals_prefill)
ParameterizedTest(int *idx, nemotron_h_hf, prefill_then_decode_equals_prefill)
{
    const char *const *name = &fixtures[*idx];
    struct fx f;
    fx_load(&f, "nemotron_h", *name, 2, 2);
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        if (p->n < 3) {
            continue;
        }
        const int32_t k = p->n / 3 + 1; /* the last k tokens go one by one */
        float *rows = kr_malloc((size_t)p->n * (size_t)f.vocab * sizeof(float));
        /* prefill of n-k tokens, then k single-token decode steps, through kr_model_forward */
        struct kr_seq_cache sc;
        cr_assert_eq(kr_seq_cache_init(f.c, &sc), KR_OK);
        cr_assert_eq(kr_seq_cache_reserve(f.c, &sc, p->n), KR_OK);
        for (int32_t start = 0; start < p->n;) {
            int32_t nt = start == 0 ? p->n - k : 1;
            int32_t pos[256], outs[256], tok0[2] = {0, nt}, pos0 = start;
            for (int32_t j = 0; j < nt; j++) {
                pos[j] = start + j;
                outs[j] = j;
            }
            struct kr_batch b = {.n_tok = nt, .n_seq = 1, .tokens = p->ids + start, .pos = pos, .seq_tok0 = tok0,
                                 .seq_pos0 = &pos0, .seq_slot = &sc.slot, .block_table = sc.blocks,
                                 .max_blocks = sc.n_blocks, .n_out = nt, .out_tok = outs};
            struct kr_err err = {{0}};
            cr_assert_eq(kr_model_forward(f.m, f.c, &b, rows + (size_t)start * f.vocab, &err), KR_OK, "%s", err.msg);
            start += nt;
        }
        kr_seq_cache_release(f.c, &sc);
        float *one = kr_malloc((size_t)p->n * (size_t)f.vocab * sizeof(float));
        struct kr_err err = {{0}};
        cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, 0, one, &err), KR_OK);
        for (int32_t t = 0; t < p->n; t++) {
            double d = max_abs_diff(rows + (size_t)t * f.vocab, one + (size_t)t * f.vocab, f.vocab);
            cr_expect_leq(d, SELF_TOL, "%s prompt %d: prefill %d + decode, position %d differs by %g", *name, i,
                          p->n - k, t, d);
            d = max_abs_diff(rows + (size_t)t * f.vocab, p->logprobs + (size_t)t * f.vocab, f.vocab);
            cr_expect_leq(d, HF_TOL, "%s prompt %d: decode path vs HF at position %d: %g", *name, i, t, d);
        }
        kr_free(one);
        kr_free(rows);
    }
    fx_free(&f);
}

FIXTURE_PARAMS(any_chunking_equals_one_shot)
ParameterizedTest(int *idx, nemotron_h_hf, any_chunking_equals_one_shot)
{
    const char *const *name = &fixtures[*idx];
    struct fx f;
    fx_load(&f, "nemotron_h", *name, 2, 2);
    static const int32_t chunks[] = {1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 64};
    for (int32_t i = 0; i < f.n_prompts; i++) {
        struct fx_prompt *p = &f.prompts[i];
        const size_t sz = (size_t)p->n * (size_t)f.vocab;
        float *one = kr_malloc(sz * sizeof(float)), *ch = kr_malloc(sz * sizeof(float));
        struct kr_err err = {{0}};
        cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, 0, one, &err), KR_OK);
        for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
            if (chunks[c] >= p->n) {
                continue;
            }
            cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, chunks[c], ch, &err), KR_OK, "%s", err.msg);
            double d = max_abs_diff(ch, one, (int64_t)sz);
            cr_expect_leq(d, SELF_TOL, "%s prompt %d (len %d): chunks of %d differ from one-shot by %g", *name, i, p->n,
                          chunks[c], d);
            d = max_abs_diff(ch, p->logprobs, (int64_t)sz);
            cr_expect_leq(d, HF_TOL, "%s prompt %d: chunks of %d vs HF: %g", *name, i, chunks[c], d);
        }
        kr_free(one);
        kr_free(ch);
    }
    fx_free(&f);
}

FIXTURE_PARAMS(mixed_batch_equals_alone)
ParameterizedTest(int *idx, nemotron_h_hf, mixed_batch_equals_alone)
{
    const char *const *name = &fixtures[*idx];
    struct fx f;
    fx_load(&f, "nemotron_h", *name, 2, 16);
    const int32_t ns = f.n_prompts;
    struct drv_seq together[16], alone;
    static const int32_t chunk_of[] = {3, 64, 1, 7, 16, 5};
    const int32_t n_dec = 6;
    for (int32_t i = 0; i < ns; i++) {
        struct fx_prompt *p = &f.prompts[i];
        together[i] = (struct drv_seq){.prompt = p->ids, .n_prompt = p->n, .chunk = chunk_of[i % 6],
                                       .start_step = i % 3, .n_decode = n_dec};
        together[i].rows = kr_malloc((size_t)(p->n + n_dec) * (size_t)f.vocab * sizeof(float));
        together[i].gen = kr_malloc((size_t)n_dec * sizeof(int32_t));
    }
    drv_run(f.m, f.c, together, ns);
    for (int32_t i = 0; i < ns; i++) {
        struct fx_prompt *p = &f.prompts[i];
        alone = together[i];
        alone.start_step = 0;
        alone.rows = kr_malloc((size_t)(p->n + n_dec) * (size_t)f.vocab * sizeof(float));
        alone.gen = kr_malloc((size_t)n_dec * sizeof(int32_t));
        drv_run(f.m, f.c, &alone, 1);
        const size_t nrows = (size_t)(p->n + n_dec - 1);
        cr_expect(memcmp(alone.rows, together[i].rows, nrows * (size_t)f.vocab * sizeof(float)) == 0,
                  "%s prompt %d: results in a mixed batch differ from the same sequence alone (max %g)", *name, i,
                  max_abs_diff(alone.rows, together[i].rows, (int64_t)(nrows * (size_t)f.vocab)));
        cr_expect(memcmp(alone.gen, together[i].gen, (size_t)n_dec * sizeof(int32_t)) == 0,
                  "%s prompt %d: greedy tokens differ between batch and alone", *name, i);
        double d = max_abs_diff(together[i].rows, p->logprobs, (int64_t)p->n * f.vocab);
        cr_expect_leq(d, HF_TOL, "%s prompt %d: mixed batch vs HF: %g", *name, i, d);
        kr_free(alone.rows);
        kr_free(alone.gen);
        kr_free(together[i].rows);
        kr_free(together[i].gen);
    }
    /* every slot and block came back */
    cr_expect_eq(f.c->n_free_slots, f.c->n_slots);
    cr_expect_eq(f.c->n_free_blocks, f.c->n_blocks);
    fx_free(&f);
}
