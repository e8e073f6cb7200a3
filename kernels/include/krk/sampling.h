#pragma once
/* Logits processing and sampling on the GPU (kernels/sampling/). The semantics are those of the
 * engine's host sampler (engine/sampler.h, kr_sample): penalties, min_tokens masking, temperature,
 * top-k, top-p, min-p and a draw with a uniform number taken from the sequence's own generator on
 * the host, so that a sequence draws the same tokens on either path. */
#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Parameters of one row (device array [n]). */
struct krk_sample_row {
    float temperature;      /* 0 = greedy */
    int32_t top_k;          /* <= 0 off */
    float top_p;            /* 1 off */
    float min_p;            /* 0 off */
    float presence, frequency, repetition;
    int32_t pen_off, pen_n; /* this row's entries in the penalty arrays */
    double u;               /* uniform draw in [0, 1) from the row's generator (unused when greedy) */
};

struct krk_sample_params {
    const float *logits;            /* [n, ld] raw logits */
    int64_t ld, n, vocab;
    const struct krk_sample_row *rows;  /* [n] */
    const int32_t *pen_ids;         /* [sum pen_n] token ids with penalties or masks, may be NULL */
    const int32_t *pen_count;       /* [sum pen_n] occurrences in the output */
    const uint8_t *pen_flags;       /* [sum pen_n] bit 0: in the prompt; bit 1: masked (min_tokens) */
    int32_t *out;                   /* [n] chosen ids */
    float *out_logprob;             /* [n] log_softmax(raw logits)[chosen], may be NULL */
    int32_t n_top;                  /* top log-probabilities wanted per row (0..20) */
    int32_t *top_ids;               /* [n, n_top], may be NULL when n_top is 0 */
    float *top_lp;                  /* [n, n_top] */
    void *workspace;                /* krk_sample_workspace_bytes() bytes */
    size_t workspace_bytes;
};
size_t krk_sample_workspace_bytes(int64_t n, int64_t vocab);
enum kr_status krk_sample(const struct krk_sample_params *p, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
