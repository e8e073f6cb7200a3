#pragma once
// Helpers shared by the kernel families: launch checks, bf16 conversion, warp/block reductions.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdio>

#include "krk.h"

// Returns KR_ERR_INVAL from a launcher when `cond` does not hold (never aborts).
#define KRK_REQUIRE(cond)                                                                          \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "krk: %s:%d: invalid parameters: %s\n", __FILE__, __LINE__, #cond);    \
            return KR_ERR_INVAL;                                                                   \
        }                                                                                          \
    } while (0)

// The same for a shape a launcher cannot handle (a grid or index limit, a workspace too small): the
// message, printf-style, names the shape and the limit.
#define KRK_REQUIRE_MSG(cond, ...)                                                                 \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "krk: %s:%d: unsupported shape: ", __FILE__, __LINE__);                \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            return KR_ERR_INVAL;                                                                   \
        }                                                                                          \
    } while (0)

// Checks the launch just made; KR_ERR_CUDA with the CUDA error logged.
#define KRK_CHECK_LAUNCH()                                                                         \
    do {                                                                                           \
        cudaError_t e_ = cudaGetLastError();                                                       \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "krk: %s:%d: launch failed: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            return KR_ERR_CUDA;                                                                    \
        }                                                                                          \
    } while (0)

#define KRK_CUDA_TRY(expr)                                                                         \
    do {                                                                                           \
        cudaError_t e_ = (expr);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "krk: %s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
            return KR_ERR_CUDA;                                                                \
        }                                                                                          \
    } while (0)

namespace krk {

// Launches kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent of the
// previous kernel in the stream when `pdl` (see pdl_wait).
template <typename... K, typename... A>
cudaError_t launch_maybe_pdl(bool pdl, void (*kernel)(K...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, A... args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<K>(args)...);
}

// Lets `kernel` take `smem` bytes of dynamic shared memory, once per device for the flag set `done`
// (a static of the caller's instantiation; devices past 63 ask every time).
template <typename... K> cudaError_t smem_opt_in(std::atomic<uint64_t> &done, void (*kernel)(K...), size_t smem)
{
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) {
        return e;
    }
    const uint64_t bit = dev >= 0 && dev < 64 ? (uint64_t)1 << dev : 0;
    if (bit != 0 && (done.load(std::memory_order_relaxed) & bit)) {
        return cudaSuccess;
    }
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess) {
        done.fetch_or(bit, std::memory_order_relaxed);
    }
    return e;
}

__device__ __forceinline__ float bf16_to_f32(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

// Round to nearest even (NaN stays NaN), the same rounding as util/dtype.h kr_f32_to_bf16.
__device__ __forceinline__ uint16_t f32_to_bf16(float f)
{
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

// Programmatic dependent launch (sm_90): a kernel launched as a programmatic dependent of the one
// before it (launch_maybe_pdl) may start while that one drains; pdl_wait() blocks until it has
// completed and its writes are visible, so everything before the wait must read only data no
// earlier kernel writes (weights). pdl_trigger() lets the next kernel launch once every block of
// this one has called it or exited. Both are no-ops for kernels launched normally.
__device__ __forceinline__ void pdl_wait()
{
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void pdl_trigger()
{
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// The first statement of every kernel but the GEMVs (which load weights first): lets the next
// kernel launch (it waits the same way) and waits for the kernel before this one. With krk_set_pdl
// off both are no-ops; on, the next kernel becomes resident while this one runs, so that a chain of
// small kernels and GEMVs overlaps launch latency and the GEMVs' first weight loads with the work
// before them. Every kernel launched as a dependent executes the wait in every thread before it
// exits, which keeps completion transitive: a kernel past its wait sees every earlier kernel's
// writes.
__device__ __forceinline__ void kernel_prologue()
{
    pdl_trigger();
    pdl_wait();
}

// Whether launchers launch kernels as programmatic dependents (krk_set_pdl).
inline bool pdl_enabled()
{
    return krk_pdl();
}

// 2^x by the hardware approximation (relative error ~2^-22); exp2(-inf) = +0.
__device__ __forceinline__ float exp2_approx(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `sh` is __shared__ float[32]. Contains __syncthreads: call from every thread.
__device__ __forceinline__ float block_sum(float v, float *sh)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) {
        sh[wid] = v;
    }
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float *sh)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) {
        sh[wid] = v;
    }
    __syncthreads();
    v = lane < nw ? sh[lane] : -INFINITY;
    return warp_max(v);
}

// Whether p is a multiple of bytes (a power of two): the launchers' test for vector accesses.
__host__ __device__ inline bool is_aligned(const void *p, uintptr_t bytes)
{
    return ((uintptr_t)p & (bytes - 1)) == 0;
}

} // namespace krk
