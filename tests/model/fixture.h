#pragma once
/* Test helpers: HF reference fixtures (tests/fixtures/<family>/<name>/: checkpoint +
 * reference.json + reference.bin written by tools/reference/ scripts) and a driver that runs several
 * sequences through one model with an arbitrary per-step schedule. */
#include <stdbool.h>
#include <stdint.h>

#include "cache.h"
#include "model.h"

struct fx_prompt {
    int32_t *ids;        /* [n] */
    int32_t n;
    float *logprobs;     /* [n, vocab] HF log_softmax after every prompt position */
    int32_t greedy[64];  /* HF greedy continuation (no-cache recompute) */
    float margin[64];    /* HF top1 - top2 log-probability at each greedy step */
    int32_t n_greedy;
    int32_t n_dsa;       /* D layers with recorded index sets (0 when the fixture has none) */
    int32_t *sets;       /* [n_dsa, n, topk] HF's selected positions per D layer and query, ascending,
                            -1 padded */
    /* HF run in bf16 on the same weights (hf_bf16.json, tools/reference/hf_bf16_deviation.py), when
     * the fixture has it: |logprob - logprobs| over every position and vocabulary entry, the largest
     * and the mean, and the largest per position [n] */
    bool has_bf16;
    double bf16_max, bf16_mean;
    float *bf16_pos;
};

struct fx {
    char dir[512];
    kr_backend_t be;
    struct kr_model *m;
    struct kr_cache *c;
    int64_t vocab;
    int32_t n_prompts;
    struct fx_prompt prompts[16];
};

/* Loads fixture `name` of `family` (e.g. "nemotron_h") with a CPU backend of `threads` threads and
 * a cache of `n_slots` slots; aborts the test (cr_assert) on any error. */
void fx_load(struct fx *f, const char *family, const char *name, int threads, int n_slots);
/* The same on backend `be` (owned by the fixture from then on). */
void fx_load_on(struct fx *f, const char *family, const char *name, kr_backend_t be, int n_slots);
/* The fixture directory: $KR_FIXTURES when set (a moved tree), else the build-time path. */
const char *fx_root(void);
void fx_free(struct fx *f);

/* Every HF fixture, in a fixed order: tests parameterized over fixtures take indices into it (test
 * processes may be fresh executions of the binary, where pointers mean nothing). Indices 5..9 have
 * D layers. */
struct fx_id {
    const char *family, *name;
};
#define FX_N_ALL 13
extern const struct fx_id fx_all[FX_N_ALL];

/* E4M3 by the format's definition (bias 7, 3 mantissa bits, exponent field 0 subnormal, S.1111.111
 * NaN), independent of the project's decoder; and the E4M3 value nearest x by a scan of the codes
 * (an exact tie: the smaller magnitude). For tests of what FP8 paths store. */
double fx_e4m3(uint8_t code);
double fx_e4m3_nearest(double x);

/* One sequence for the multi-sequence driver. */
struct drv_seq {
    const int32_t *prompt;   /* [n_prompt] */
    int32_t n_prompt;
    int32_t chunk;           /* prompt tokens per step (>= 1) */
    int32_t start_step;      /* first step this sequence takes part in */
    int32_t n_decode;        /* greedy tokens generated after the prompt */
    float *rows;             /* out: [n_prompt + n_decode, vocab]: rows after every prompt position,
                                then after every generated token except the last */
    int32_t *gen;            /* out: [n_decode] greedy ids */
};

/* Runs all sequences through one model: at each step, every active sequence contributes its
 * next prompt chunk or one decode token, in one flattened batch. Asserts on errors. */
void drv_run(struct kr_model *m, struct kr_cache *c, struct drv_seq *seqs, int32_t n_seq);

/* Largest |a - b| over n floats. */
double max_abs_diff(const float *a, const float *b, int64_t n);
