#pragma once
/* Mamba-2 (kernels/mamba2/): causal depthwise conv1d with carried state, and the SSD selective
 * state space update: chunked scan for prefill chunks, the exact one-step recurrence for decode.
 * Semantics are those of the CPU reference (backend/backend-cpu.c, cpu_mamba; MODEL_SPEC §Mamba-2). */
#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The Mamba-2 step of a layer (struct krk_mamba_params, krk/ops.h) for ctx->batch, on ctx->stream:
 * krk_conv1d on the xBC columns of zxbcdt into xbc, then krk_ssd on xbc with the dt columns, with
 * ctx->workspace of krk_ssd_workspace_bytes() bytes. ctx->events (or NULL) gets [10]: (begin, end)
 * around the conv, around the SSD, then the SSD's three phases (krk_ssd's events). */
enum kr_status krk_mamba(const struct krk_mamba_params *p, const struct krk_ctx *ctx);

/* The two parts of krk_mamba, each a launcher of its own (the GPU tests call them alone).
 *
 * Causal depthwise conv over xBC (+ bias) followed by SiLU, per sequence of ctx->batch, with the
 * K-1 previous inputs taken from conv_state (or zeros when the sequence's seq_pos0 is 0); then the
 * sequence's conv_state becomes its last K-1 inputs. Padding sequences (slot < 0) read zeros and
 * write no state. */
struct krk_conv1d_params {
    const float *in;        /* [n_tok, ld_in] rows holding xBC at column in_off */
    int64_t ld_in, in_off;
    int64_t conv_dim;       /* channels: d_inner + 2 * n_group * d_state */
    int64_t d_conv;         /* K (2..8) */
    const float *w;         /* [conv_dim, K] fp32 */
    const float *b;         /* [conv_dim] fp32, may be NULL */
    krk_bf16 *state;        /* [n_slot, K-1, conv_dim] bf16 */
    float *out;             /* [n_tok, conv_dim] SiLU(conv) */
};
enum kr_status krk_conv1d(const struct krk_conv1d_params *p, const struct krk_ctx *ctx);

/* SSD over the conv output: per sequence of ctx->batch and head h (group g = h / (n_head / n_group)):
 *   dt_t = clamp(softplus(dt_raw_t[h] + dt_bias[h]), dt_min, dt_max), A = -exp(A_log[h])
 *   state = exp(dt_t A) state + dt_t * x_t B_t^T;  y_t = state C_t + D[h] x_t
 * starting from ssm_state[slot] (zeros when seq_pos0 is 0) and writing the final state back.
 * Sequences with several tokens use the chunked algorithm (chunk length `chunk`), single tokens
 * the recurrence. Padding sequences write no state. ctx->workspace: krk_ssd_workspace_bytes() bytes
 * (may be NULL when that is 0). ctx->events (or NULL) gets [6]: a (begin, end) pair recorded around
 * each phase: one-token update, C.B^T, chunked scan (a phase that does not run gets both at the
 * same point). */
struct krk_ssd_params {
    const float *xbc;       /* [n_tok, conv_dim]: x [n_head*head_dim] | B [n_group*d_state] | C [n_group*d_state] */
    int64_t conv_dim;
    const float *dt;        /* [n_tok, ld_dt] raw dt, head h at dt[t*ld_dt + h] */
    int64_t ld_dt;
    const float *dt_bias;   /* [n_head] fp32 */
    const float *A_log;     /* [n_head] fp32 */
    const float *D;         /* [n_head] fp32 */
    float dt_min, dt_max;   /* clamp applied only when dt_min > 0 / dt_max finite */
    int64_t n_head, head_dim, n_group, d_state, chunk;
    float *state;           /* [n_slot, n_head, head_dim, d_state] fp32 */
    float *y;               /* [n_tok, n_head * head_dim] (D skip included) */
};
/* Scratch bytes krk_ssd (and krk_mamba) needs for a batch of up to n_tok tokens in up to n_seq
 * sequences. */
size_t krk_ssd_workspace_bytes(int64_t n_tok, int64_t n_seq, int64_t n_head, int64_t head_dim, int64_t n_group,
                               int64_t d_state, int64_t chunk);
enum kr_status krk_ssd(const struct krk_ssd_params *p, const struct krk_ctx *ctx);

#ifdef __cplusplus
}
#endif
