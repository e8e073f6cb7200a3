#pragma once
/* JSON documents printed by the `krait generate` and `krait logprobs` subcommands (for scripts
 * and debugging). Strings returned are owned by the caller (free with kr_free). */
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct kr_generate_result {
    const char *model;          /* checkpoint directory */
    const int32_t *prompt;      /* [n_prompt] */
    int32_t n_prompt;
    const int32_t *tokens;      /* [n_tokens] generated ids */
    const float *logprobs;      /* [n_tokens] log-probability of each generated id */
    int32_t n_tokens;
    const char *finish_reason;  /* "stop" (EOS) or "length" */
    double elapsed_ms;          /* wall time of prefill and decode */
};

/* Encodes a generation result; NULL on OOM. */
char *kr_cli_generate_json(const struct kr_generate_result *r);

/* Encodes prompt log-probabilities: for each position t >= 1 the log-probability of prompt[t]
 * given prompt[0..t) (null for position 0, as OpenAI/vLLM prompt_logprobs), and the top `n_top`
 * (id, logprob) pairs of every row of lp [n_prompt, vocab]; NULL on OOM. */
char *kr_cli_logprobs_json(const char *model, const int32_t *prompt, int32_t n_prompt, const float *lp, int64_t vocab,
                           int32_t n_top);

#ifdef __cplusplus
}
#endif
