#pragma once
/* Mixture-of-experts routing and routed expert FFNs (kernels/moe/). Semantics are those of the CPU
 * reference (cpu_moe_route, cpu_moe_experts). */
#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* DeepSeek-V3 routing (struct krk_route_params, krk/ops.h). */
enum kr_status krk_moe_route(const struct krk_route_params *p, cudaStream_t stream);

/* out[t] = sum_k weights[t,k] * E_{ids[t,k]}(x[t]), E(x) = down(act(gate x) * (up x)) when gate is
 * given, else down(act(up x)). Expert weights are reached through device arrays of pointers. */
struct krk_experts_params {
    const float *x;                     /* [n, d_in] */
    int64_t n, d_in, d_ffn, d_out, n_expert, n_used;
    const int32_t *ids;                 /* [n, n_used] */
    const float *weights;               /* [n, n_used] */
    const krk_bf16 *const *gate;        /* [n_expert] -> [d_ffn, d_in], NULL when not gated */
    const krk_bf16 *const *up;          /* [n_expert] -> [d_ffn, d_in] */
    const krk_bf16 *const *down;        /* [n_expert] -> [d_out, d_ffn] */
    enum kr_act act;
    float *hidden;                      /* [n * n_used, d_ffn] scratch */
    float *out;                         /* [n, d_out] overwritten */
};
enum kr_status krk_moe_experts(const struct krk_experts_params *p, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
