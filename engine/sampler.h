#pragma once
/* Token sampling on the engine side: penalties, temperature, top-k, top-p, min-p and a seeded
 * per-sequence generator, so that a sequence samples the same tokens whatever batch it runs in.
 * Order of operations on the logits of one row: the allowed-token mask of constrained decoding
 * (masked tokens become -inf: nothing after can bring them back, since every later step maps -inf
 * to -inf), logit bias, repetition penalty (prompt and output tokens), frequency and presence
 * penalties (output tokens), EOS/stop-id masking while below min_tokens, then temperature, top-k,
 * top-p (nucleus), min-p, and a draw. Temperature 0 is greedy (argmax, lowest id on ties) after
 * penalties.
 *
 * Masks are bitmasks of (vocab + 31) / 32 words, bit id % 32 of word id / 32 set for an allowed
 * token (the layout of api/grammar.h's token masks); NULL means every token is allowed. */
#include <stdbool.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KR_MAX_STOP_IDS 64
#define KR_MAX_LOGIT_BIAS 300
#define KR_MAX_TOP_LOGPROBS 20

struct kr_sampling {
    float temperature;          /* >= 0; 0 = greedy */
    int32_t top_k;              /* <= 0: off */
    float top_p;                /* (0, 1]; 1 = off */
    float min_p;                /* [0, 1]; 0 = off */
    float presence_penalty;     /* [-2, 2]: subtracted once from tokens present in the output */
    float frequency_penalty;    /* [-2, 2]: subtracted per occurrence in the output */
    float repetition_penalty;   /* > 0; 1 = off: logits of prompt/output tokens divided (>0) or multiplied */
    bool has_seed;
    uint64_t seed;              /* per-request seed (child i of n uses seed + i) */
    int32_t logprobs;           /* -1: none; 0: the chosen token's; k: plus the top k (<= 20) */
    int32_t prompt_logprobs;    /* -1: none; k >= 0 as logprobs, for every prompt position */
    int32_t max_tokens;         /* >= 1 */
    int32_t min_tokens;         /* EOS and stop ids are masked until this many tokens */
    bool ignore_eos;
    int32_t n_stop_ids;
    int32_t stop_ids[KR_MAX_STOP_IDS];
    int32_t n_bias;             /* logit_bias: bias[i] is added to the raw logit of bias_ids[i] first */
    int32_t bias_ids[KR_MAX_LOGIT_BIAS];
    float bias[KR_MAX_LOGIT_BIAS]; /* [-100, 100] */
};

/* Fills the OpenAI/vLLM defaults: temperature 1, top_p 1, top_k off, no penalties, no logprobs,
 * max_tokens 16, no seed. */
void kr_sampling_default(struct kr_sampling *s);

/* Validates client-controlled parameters; KR_ERR_INVAL with a message naming the field. */
enum kr_status kr_sampling_validate(const struct kr_sampling *s, int64_t vocab, struct kr_err *err);

/* A per-sequence random generator (xoshiro256**), seeded with splitmix64. */
struct kr_rng {
    uint64_t s[4];
};
void kr_rng_seed(struct kr_rng *r, uint64_t seed);
/* Uniform in [0, 1) with 53 random bits. */
double kr_rng_uniform(struct kr_rng *r);

/* Token counts of one sequence for the penalties: every distinct token seen in the prompt
 * (repetition penalty) and the output counts (frequency/presence). Sparse: a small open-addressing
 * table, grown as needed. */
struct kr_token_counts {
    int32_t cap;       /* power of two */
    int32_t used;
    int32_t *ids;      /* [cap] -1 empty */
    int32_t *n_out;    /* [cap] occurrences in the output */
    uint8_t *in_prompt;/* [cap] */
};
void kr_token_counts_init(struct kr_token_counts *c);
void kr_token_counts_free(struct kr_token_counts *c);
enum kr_status kr_token_counts_add(struct kr_token_counts *c, int32_t id, bool prompt);
/* Copies (n > 1 children start from the parent's prompt counts). */
enum kr_status kr_token_counts_copy(struct kr_token_counts *dst, const struct kr_token_counts *src);

/* Scratch for one sampling call; reused across calls (engine thread). */
#define KR_SAMPLER_BUCKETS 4096
struct kr_sampler_scratch {
    int64_t cap;
    float *v;        /* [vocab] processed logits */
    uint64_t *order; /* [vocab] candidates as keys (logit, then id) */
    uint64_t *tmp;   /* [2 vocab] one bucket's candidates, sorted, and the radix sort's buffer */
    double *bmass;   /* [KR_SAMPLER_BUCKETS] per bucket of logits: probability mass, */
    double *bwmin;   /* smallest probability */
    int64_t *bcount; /* and number of candidates */
};
void kr_sampler_scratch_free(struct kr_sampler_scratch *s);

/* Samples one token from `logits` ([vocab] raw logits of the row) for a sequence that has
 * generated `n_generated` tokens so far, with its counts and generator. `mask` (may be NULL) lists
 * the allowed tokens; `eos_ids` tell which ids end the sequence (for min_tokens masking). Returns
 * the token id in *out; KR_ERR_INTERNAL when a non-greedy row has every token masked (a greedy one
 * then takes id 0). */
enum kr_status kr_sample(const struct kr_sampling *s, const float *logits, const uint32_t *mask, int64_t vocab,
                         const struct kr_token_counts *counts, int32_t n_generated, const int32_t *eos_ids,
                         int32_t n_eos, struct kr_rng *rng, struct kr_sampler_scratch *scratch, int32_t *out);

/* kr_sample's processing and selection with a given draw u in [0, 1) instead of a generator, the
 * allowed-token mask as a bitmask (may be NULL), and the penalties and min_tokens masks as a list
 * (ids with their output counts; flag bit 0: in the prompt, bit 1: masked). For backends that
 * sample many rows at once. */
enum kr_status kr_sample_with_draw(const float *logits, const uint32_t *mask, int64_t vocab, float temperature,
                                   int32_t top_k, float top_p, float min_p, float presence, float frequency,
                                   float repetition,
                                   const int32_t *pen_ids, const int32_t *pen_count, const uint8_t *pen_flags,
                                   int64_t n_pen, double u, struct kr_sampler_scratch *sc, int32_t *out);

/* Log-softmax of raw logits into `lp` [vocab] (may alias logits). */
void kr_log_softmax(const float *logits, float *lp, int64_t vocab);

/* Log-softmax over the tokens `mask` allows (NULL: all of them, as kr_log_softmax): masked tokens
 * get -inf and the allowed ones are normalized among themselves. lp may alias logits. */
void kr_log_softmax_masked(const float *logits, const uint32_t *mask, float *lp, int64_t vocab);

/* Whether token id is allowed by mask (NULL allows everything). */
static inline bool kr_mask_allows(const uint32_t *mask, int64_t id)
{
    return !mask || ((mask[id >> 5] >> (id & 31)) & 1u);
}

/* The k largest entries of lp (ids descending by value, lowest id first on ties). k <= vocab. */
void kr_top_k_ids(const float *lp, int64_t vocab, int32_t k, int32_t *ids);

#ifdef __cplusplus
}
#endif
