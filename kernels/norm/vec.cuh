#pragma once
// Vector access helpers of the elementwise and row kernels: V consecutive fp32 values (V = 1 or 4)
// loaded or stored as one access, and V bf16 values stored as one access. The launchers choose
// V = 4 only when every pointer and row stride involved allows 16-byte (fp32) and 8-byte (bf16)
// accesses; otherwise they fall back to V = 1.
#include <cstdint>

#include "common/util.cuh"

namespace krk {

template <int V> __device__ __forceinline__ void load_f(const float *p, float (&v)[V])
{
    if constexpr (V == 4) {
        const float4 q = *reinterpret_cast<const float4 *>(p);
        v[0] = q.x;
        v[1] = q.y;
        v[2] = q.z;
        v[3] = q.w;
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) {
            v[i] = p[i];
        }
    }
}

template <int V> __device__ __forceinline__ void store_f(float *p, const float (&v)[V])
{
    if constexpr (V == 4) {
        *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) {
            p[i] = v[i];
        }
    }
}

template <int V> __device__ __forceinline__ void store_bf16(uint16_t *p, const float (&v)[V])
{
    if constexpr (V == 4) {
        uint2 q;
        q.x = (uint32_t)f32_to_bf16(v[0]) | ((uint32_t)f32_to_bf16(v[1]) << 16);
        q.y = (uint32_t)f32_to_bf16(v[2]) | ((uint32_t)f32_to_bf16(v[3]) << 16);
        *reinterpret_cast<uint2 *>(p) = q;
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) {
            p[i] = f32_to_bf16(v[i]);
        }
    }
}

// Threads of a block that walks one row of `units` vector units: about four units per thread,
// a multiple of 32, between 32 and 1024.
inline int row_threads(int64_t units)
{
    int64_t t = (units + 3) / 4;
    t = (t + 31) / 32 * 32;
    return (int)(t < 32 ? 32 : t > 1024 ? 1024 : t);
}

} // namespace krk
