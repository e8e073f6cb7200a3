#pragma once
// E4M3 codes of the FP8 caches (--kv-cache-dtype fp8): the encoder and decoder of the CPU reference
// (model/fp8.c kr_fp8_e4m3_from_f32, util/dtype.h kr_e4m3_to_f32) as device functions, bit for bit,
// and the per-block quantization of kr_fp8_act_quant over one thread block.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common/util.cuh"

namespace krk {

// Round to nearest even; beyond +-448 (infinities included) saturates to +-448; the sign of zero
// is kept; NaN gives 0x7f. The same integer steps as the CPU encoder.
__device__ __forceinline__ uint8_t e4m3_from_f32(float x)
{
    if (isnan(x)) {
        return 0x7f;
    }
    uint32_t u = __float_as_uint(x);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7fffffffu;
    if (u >= 0x43e00000u) {
        return sign | 0x7e;
    }
    if (u < 0x3c800000u) { // below 2^-6: multiples of 2^-9, rounded by one fp32 addition
        const float t = __fadd_rn(__uint_as_float(u), 0x1p14f);
        return sign | (uint8_t)(__float_as_uint(t) - 0x46800000u);
    }
    const uint32_t r = u + 0x7ffffu + ((u >> 20) & 1u);
    return sign | (uint8_t)((r >> 20) - (120u << 3));
}

// Exact decoding; 0x7f and 0xff are NaN.
__device__ __forceinline__ float e4m3_to_f32(uint32_t b)
{
    const uint32_t sign = (b & 0x80u) << 24, e = (b >> 3) & 0xfu, m = b & 7u;
    if ((b & 0x7fu) == 0x7fu) {
        return __uint_as_float(0x7fc00000u);
    }
    if (e == 0) {
        return __uint_as_float(__float_as_uint((float)m * 0x1p-9f) | sign);
    }
    return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// Two codes (the low 16 bits of u) to fp32 by the hardware conversion to f16 (exact: every e4m3 value,
// subnormals included, is an f16 value).
__device__ __forceinline__ float2 e4m3x2_to_f32(uint32_t u)
{
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(u & 0xffffu), __NV_E4M3);
    return __half22float2(__half2(h));
}

// Eight codes (two little-endian words) to fp32 values times `s`.
__device__ __forceinline__ void e4m3x8_to_f32(uint2 w, float s, float f[8])
{
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 v = e4m3x2_to_f32((i < 2 ? w.x : w.y) >> (16 * (i & 1)));
        f[2 * i] = v.x * s;
        f[2 * i + 1] = v.y * s;
    }
}

// Eight codes to bf16 (exact: an e4m3 value has 4 significant bits), packed two a word.
__device__ __forceinline__ uint4 e4m3x8_to_bf16x8(uint2 w)
{
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 v = e4m3x2_to_f32((i < 2 ? w.x : w.y) >> (16 * (i & 1)));
        o[i] = (__float_as_uint(v.x) >> 16) | (__float_as_uint(v.y) & 0xffff0000u);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// kr_fp8_act_quant of one block of n <= blockDim.x values, thread i holding x (ignored for i >= n):
// amax = max(|x|, 1e-4), scale = amax * fp32(1/448), code = e4m3(x / scale). Returns the scale
// (every thread) and sets *code. A block with a value that is not finite gets NaN codes and scale.
// `sh` is __shared__ float[32]; contains __syncthreads: call from every thread.
__device__ __forceinline__ float act_quant_block(float x, int n, uint8_t *code, float *sh)
{
    const bool in = (int)threadIdx.x < n;
    const float bad = block_sum(in && !isfinite(x) ? 1.0f : 0.0f, sh);
    const float amax = fmaxf(block_max(in ? fabsf(x) : 0.0f, sh), 1e-4f);
    if (bad != 0.0f) {
        *code = 0x7f;
        return __uint_as_float(0x7fc00000u);
    }
    const float s = amax * (1.0f / 448.0f);
    *code = e4m3_from_f32(__fdiv_rn(x, s));
    return s;
}

} // namespace krk
