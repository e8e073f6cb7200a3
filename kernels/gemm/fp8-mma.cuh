// Shared by the FP8 tensor-core kernels (gemm/fp8.cu's skinny product, moe/experts.cu's grouped
// expert products): the 16-byte streaming load of weight codes and the e4m3 mma.
#pragma once

#include <cstdint>

namespace krk {

// 16 weight codes, read once: no L1 allocation, the read-only path.
__device__ __forceinline__ uint4 ld_stream8(const uint8_t *p)
{
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// c += A (16 x 32 e4m3, row) * B (32 x 8 e4m3, col), fp32 accumulators.
__device__ __forceinline__ void mma_e4m3(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

} // namespace krk
