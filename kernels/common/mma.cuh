#pragma once
// Tensor-core building blocks shared by the kernels that use mma.sync (attention prefill, MLA,
// the DSA indexer, the SSD scan): cp.async copies, ldmatrix fragment loads, the bf16 m16n8k16 product
// and the three-pass TF32 m16n8k8 product of fp32 operands.
#include "common/util.cuh"

namespace krk {

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16-byte global->shared copy; src_bytes = 0 fills the destination with zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
}

// 16-byte global->shared copy of a whole chunk to a shared-space address.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ldmatrix from a shared-space address (kernels that keep their stage offsets as addresses).
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void *p)
{
    ldmatrix_x4(r, smem_addr(p));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// c[16x8] += a[16x16] * b[16x8], bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as bf16x2, the first in the low half (the lower column of an mma fragment).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    return (uint32_t)f32_to_bf16(lo) | ((uint32_t)f32_to_bf16(hi) << 16);
}

// One online-softmax step of flash attention for the two rows a thread holds in m16 accumulator
// tiles (row g = lane / 4 in elements 0-1, row g + 8 in elements 2-3). sc: the key tile's scores in
// base 2, masked keys -inf (NS tiles of 8 keys); m, l: the rows' running max and sum; o: the NO output
// tiles, rescaled to the new max. sc becomes the probabilities, added to l (this thread's share:
// sum l over the 4 lanes of a row at the end).
template <int NS, int NO>
__device__ __forceinline__ void flash_softmax_step(float (&sc)[NS][4], float (&m)[2], float (&l)[2], float (&o)[NO][4])
{
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < NS; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            mx[e >> 1] = fmaxf(mx[e >> 1], sc[n][e]);
        }
    }
    float mref[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        mref[r] = mx[r] == -INFINITY ? 0.0f : mx[r]; // a row with no key yet
        const float corr = exp2_approx(m[r] - mref[r]); // 0 while m is -inf
        m[r] = mx[r];
        l[r] *= corr;
#pragma unroll
        for (int n = 0; n < NO; n++) {
            o[n][2 * r] *= corr;
            o[n][2 * r + 1] *= corr;
        }
    }
#pragma unroll
    for (int n = 0; n < NS; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            sc[n][e] = exp2_approx(sc[n][e] - mref[e >> 1]); // masked: exp2(-inf) = 0
            l[e >> 1] += sc[n][e];
        }
    }
}

// Three-pass TF32 products of fp32 operands: every operand is split into a TF32 high part and a
// remainder (tf32_split), and hi*hi + hi*lo + lo*hi keeps the products to about fp32 accuracy (the
// dropped lo*lo term is below 2^-20 of them), with fp32 accumulation.
// x = hi + lo, hi = x with the low 13 mantissa bits cleared (TF32, exact) and lo = x - hi (exact
// in fp32), which the tensor core reads truncated to TF32: |lo| < 2^-10 |x|, so the truncation
// costs under 2^-20 |x|. Masking and a subtraction run at full rate, where cvt.rna.tf32 would be a
// conversion at a fraction of it.
__device__ __forceinline__ void tf32_split(float x, uint32_t &hi, uint32_t &lo)
{
    hi = __float_as_uint(x) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a b in three TF32 passes; a is the A fragment (rows g, g + 8; columns t, t + 4) and b0, b1
// the B fragment (rows t, t + 4; column g) as fp32.
struct Tf32A {
    uint32_t hi[4], lo[4];
    __device__ __forceinline__ void set(float a0, float a1, float a2, float a3)
    {
        tf32_split(a0, hi[0], lo[0]);
        tf32_split(a1, hi[1], lo[1]);
        tf32_split(a2, hi[2], lo[2]);
        tf32_split(a3, hi[3], lo[3]);
    }
};
// The B fragment split once, for products that share it across several A fragments.
struct Tf32B {
    uint32_t hi[2], lo[2];
    __device__ __forceinline__ void set(float b0, float b1)
    {
        tf32_split(b0, hi[0], lo[0]);
        tf32_split(b1, hi[1], lo[1]);
    }
};
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const Tf32A &a, const Tf32B &b)
{
    mma_tf32(d, a.lo, b.hi[0], b.hi[1]);
    mma_tf32(d, a.hi, b.lo[0], b.lo[1]);
    mma_tf32(d, a.hi, b.hi[0], b.hi[1]);
}
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const Tf32A &a, float b0, float b1)
{
    Tf32B b;
    b.set(b0, b1);
    mma_3xtf32(d, a, b);
}

} // namespace krk
