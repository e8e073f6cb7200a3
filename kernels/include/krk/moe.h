#pragma once
/* Mixture-of-experts routing and routed expert FFNs (kernels/moe/). Semantics are those of the CPU
 * reference (cpu_moe_route, cpu_moe_experts). */
#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* DeepSeek-V3 routing (struct krk_route_params, krk/ops.h). */
enum kr_status krk_moe_route(const struct krk_route_params *p, cudaStream_t stream);

/* The routed experts' weights on the device: arrays of n_expert pointers to bf16 matrices (the
 * CUDA backend builds them from the engine's tensors once per model), or with block_c > 0 to FP8
 * codes with their block scales (model/fp8.h's recipe: the tokens' rows and the hidden rows are
 * quantized per block of block_c before their products, as the CPU reference's products do). */
struct krk_expert_ptrs {
    const void *const *gate;            /* [n_expert] -> [d_ffn, d_in], NULL when not gated */
    const void *const *up;              /* [n_expert] -> [d_ffn, d_in] */
    const void *const *down;            /* [n_expert] -> [d_out, d_ffn] */
    /* FP8: each matrix's scales [ceil(rows / block_r), ceil(cols / block_c)] */
    const float *const *gate_s, *const *up_s, *const *down_s;
    int32_t block_r, block_c;           /* 0: bf16 weights */
    float *xq;                          /* FP8: staging of the quantized token rows [n, d_in] */
    bool ue8m0;                         /* FP8: power-of-two activation scales (krk_fp8_quant_params) */
};
/* Workspace of krk_moe_experts: the hidden rows of n tokens' n_used experts; with fp8, room for the
 * grouped FP8 path too (its products' rows, the activations' codes and scales, the sort by expert). */
size_t krk_moe_experts_workspace_bytes(int64_t n, int64_t n_used, int64_t d_in, int64_t d_ffn, int64_t d_out,
                                       bool fp8);
/* Routed experts (struct krk_experts_params, krk/ops.h) with the weights `w`, on ctx->stream, the
 * hidden rows [n * n_used, d_ffn] in ctx->workspace (krk_moe_experts_workspace_bytes()). FP8 experts
 * in 128 x 128 blocks whose widths are whole blocks run as grouped tensor-core products over the
 * pairs sorted by expert (unless p->plain); others one warp per output element. */
enum kr_status krk_moe_experts(const struct krk_experts_params *p, const struct krk_expert_ptrs *w,
                               const struct krk_ctx *ctx);

#ifdef __cplusplus
}
#endif
