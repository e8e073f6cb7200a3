#pragma once
/* Single-sequence conveniences over kr_model_forward for the CLI, scripts and tests: prompt
 * log-probabilities with chunked prefill, and greedy generation. They take a cache slot and
 * blocks for the duration of the call and always give them back. */
#include <stdint.h>

#include "cache.h"
#include "model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Runs the prompt ids[0..n) through the model in prefill chunks of at most `chunk` tokens
 * (chunk <= 0: one chunk) and writes the log-probabilities after every position to
 * out [n, vocab] (row t = distribution of the token following ids[0..t]). */
enum kr_status kr_run_prompt_logprobs(struct kr_model *m, struct kr_cache *c, const int32_t *ids, int32_t n,
                                      int32_t chunk, float *out, struct kr_err *err);

/* Greedy decoding: prefills ids[0..n) (in chunks of `chunk`), then appends up to `max_new`
 * argmax tokens (ties: lowest id) to out_ids, with each chosen token's log-probability in
 * out_lp (may be NULL). Stops after an EOS id of the config unless `ignore_eos`. Writes the
 * number of generated tokens to *n_out. */
enum kr_status kr_run_greedy(struct kr_model *m, struct kr_cache *c, const int32_t *ids, int32_t n, int32_t chunk,
                             int32_t max_new, bool ignore_eos, int32_t *out_ids, float *out_lp, int32_t *n_out,
                             struct kr_err *err);

/* Index of the largest value (lowest index on ties). */
int32_t kr_argmax(const float *v, int64_t n);

#ifdef __cplusplus
}
#endif
