#pragma once
// The RoPE arithmetic every kernel that rotates shares with the CPU reference: the angle pos x
// inv_freq rounded to fp32, sincosf of it, both scaled by the attention factor, and the rotation
// without FMA contraction (each product and sum rounded on its own, as the reference computes).
#include "common/util.cuh"

namespace krk {

__device__ __forceinline__ void rope_cos_sin(float pos, float inv_freq, float factor, float *c, float *s)
{
    float sv, cv;
    sincosf(__fmul_rn(pos, inv_freq), &sv, &cv);
    *c = __fmul_rn(cv, factor);
    *s = __fmul_rn(sv, factor);
}

// (a, b) <- (a c - b s, a s + b c)
__device__ __forceinline__ void rope_rotate(float &a, float &b, float c, float s)
{
    const float a0 = a, b0 = b;
    a = __fsub_rn(__fmul_rn(a0, c), __fmul_rn(b0, s));
    b = __fadd_rn(__fmul_rn(a0, s), __fmul_rn(b0, c));
}

} // namespace krk
