#pragma once
/* Logits processing and sampling on the GPU (kernels/sampling/). The semantics are those of the
 * engine's host sampler (engine/sampler.h, kr_sample): penalties, min_tokens masking, temperature,
 * top-k, top-p, min-p and a draw with a uniform number taken from the sequence's own generator on
 * the host, so that a sequence draws the same tokens on either path.
 *
 * Caller contract:
 *  - u: kr_sample draws exactly one kr_rng_uniform for a row with temperature > 0 and none for a
 *    greedy row (temperature 0). Draw u from the sequence's generator for every non-greedy row and
 *    for no greedy row; the generators then stay in step with the host path.
 *  - penalty entries: the entries of a row list its token counts (one entry per distinct id of
 *    kr_token_counts: pen_count = n_out, bit 0 = in_prompt) plus, while n_generated < min_tokens,
 *    one entry with bit 1 for each EOS id (unless ignore_eos) and each stop id. An id carries
 *    penalty information in at most one entry of its row; masking entries (bit 1) may repeat an id
 *    that also has a penalty entry (masking is applied after the penalties, as on the host).
 *    Ids outside [0, vocab) are skipped, as on the host.
 *  - outputs per row: out = the chosen id; -1 for a row whose parameters are invalid (temperature
 *    not finite or < 0, top_p outside (0, 1], min_p outside [0, 1], repetition not finite or <= 0,
 *    non-finite presence/frequency, u outside [0, 1) on a non-greedy row, a penalty range outside
 *    [0, n_pen)) and for a non-greedy row whose logits are all masked (-inf), where kr_sample fails
 *    with KR_ERR_INTERNAL. out_logprob is NaN for such rows; top_ids/top_lp are still written.
 *  - NaN logits count as -inf; -0 equals +0 (as in the host's comparisons).
 * Limits: 1 <= vocab <= 2^20; workspace 16-byte aligned. The kernel reads no row beyond vocab. */
#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of workspace for n rows of vocab logits: the processed logits, one padded fp32 row each. */
size_t krk_sample_workspace_bytes(int64_t n, int64_t vocab);
/* Samples one token per row (struct krk_sample_params, krk/ops.h; every array device memory) on
 * ctx->stream, with ctx->workspace of krk_sample_workspace_bytes() bytes, 16-byte aligned.
 * KR_ERR_INVAL on invalid host-side parameters, KR_ERR_CUDA when the launch fails; row parameters
 * live on the device and are checked there (see above). */
enum kr_status krk_sample(const struct krk_sample_params *p, const struct krk_ctx *ctx);

#ifdef __cplusplus
}
#endif
