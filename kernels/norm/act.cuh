#pragma once
// Activation functions as the CPU reference computes them (backend/backend-cpu.c act_apply), shared
// by the elementwise kernels and the MoE experts.
#include "common/util.cuh"

namespace krk {

__device__ __forceinline__ float act_apply(int act, float x)
{
    switch (act) {
    case KR_ACT_RELU2: {
        const float r = x > 0.0f ? x : 0.0f;
        return r * r;
    }
    case KR_ACT_SILU:
        return x / (1.0f + expf(-x));
    case KR_ACT_GELU:
        return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case KR_ACT_RELU:
        return x > 0.0f ? x : 0.0f;
    }
    return x;
}

__device__ __forceinline__ float silu(float x)
{
    return x / (1.0f + expf(-x));
}

__host__ __device__ inline bool act_valid(int act)
{
    return act >= KR_ACT_RELU2 && act <= KR_ACT_RELU;
}

} // namespace krk
