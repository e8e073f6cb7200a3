// One-shot collectives over peer-addressable memory (krk/comm.h).
#include "krk.h"
#include "krk/comm.h"

#include "common/util.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int64_t kPerBlockMin = 2048; // elements a block takes at least before another is added

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *p)
{
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t *p, uint32_t v)
{
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Every thread of the block calls it after writing its part of this rank's buffer: signals every
// peer that block b's part of call `call` is written, then waits until every peer has signalled the
// same. False when the wait gave up (abort word or timeout); the whole block then agrees.
__device__ bool exchange(const krk_peer &p, uint32_t call)
{
    volatile __shared__ int gave_up;
    if (threadIdx.x == 0) {
        gave_up = 0;
    }
    __threadfence_system(); // this thread's writes of the buffer before the signal below
    __syncthreads();
    const int b = blockIdx.x;
    if (threadIdx.x < p.size) {
        const int peer = threadIdx.x;
        st_release_sys(p.flag[peer] + b * KRK_PEER_MAX_RANKS + p.rank, call);
        const uint32_t *f = p.flag[p.rank] + b * KRK_PEER_MAX_RANKS + peer;
        uint64_t t0 = 0;
        uint32_t spins = 0;
        while ((int32_t)(ld_acquire_sys(f) - call) < 0) {
            if ((++spins & 255) == 0) {
                if (*p.abort || gave_up) {
                    gave_up = 1;
                    break;
                }
                const uint64_t t = global_ns();
                if (t0 == 0) {
                    t0 = t;
                } else if (p.timeout_ns && t - t0 > p.timeout_ns) {
                    gave_up = 1;
                    break;
                }
            }
        }
    }
    __syncthreads();
    return !gave_up;
}

// gather == 0: out[i] = sum over ranks of in[i] (in == out allowed), i < n.
// gather == 1: out[(i / cols) * size * cols + r * cols + i % cols] = rank r's in[i].
__global__ void __launch_bounds__(kThreads) peer_kernel(const krk_peer p, const float *in, float *out, int64_t n,
                                                         int64_t cols, int gather)
{
    __shared__ uint32_t call_s;
    const int b = blockIdx.x;
    if (threadIdx.x == 0) {
        call_s = p.calls[b] + 1;
        p.calls[b] = call_s;
    }
    __syncthreads();
    const uint32_t call = call_s;
    const int64_t slot = (int64_t)(call & 1) * p.cap;
    // this block's elements [lo, hi): the same on every rank (n and the grid agree)
    int64_t per = (n + gridDim.x - 1) / gridDim.x;
    per = (per + 3) & ~(int64_t)3;
    const int64_t lo = (int64_t)b * per < n ? (int64_t)b * per : n;
    const int64_t hi = lo + per < n ? lo + per : n;
    float *mine = p.buf[p.rank] + slot;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
        __stcg(mine + i, in[i]);
    }
    if (!exchange(p, call)) {
        if (threadIdx.x == 0) {
            *p.error = 1;
        }
        return;
    }
    if (!gather) {
        for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
            float s = 0.0f;
            for (int r = 0; r < p.size; r++) {
                s += __ldcg(p.buf[r] + slot + i);
            }
            out[i] = s;
        }
        return;
    }
    const int64_t width = (int64_t)p.size * cols;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
        const int64_t row = i / cols, col = i - row * cols;
        float *o = out + row * width + col;
        for (int r = 0; r < p.size; r++) {
            o[(int64_t)r * cols] = __ldcg(p.buf[r] + slot + i);
        }
    }
}

__global__ void __launch_bounds__(kThreads) combine_kernel(const krk_peer p, int64_t slot, float *out, int64_t n,
                                                            int64_t cols, int gather)
{
    const int64_t stride = (int64_t)gridDim.x * kThreads;
    const int64_t width = (int64_t)p.size * cols;
    for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < n; i += stride) {
        if (!gather) {
            float s = 0.0f;
            for (int r = 0; r < p.size; r++) {
                s += __ldcg(p.buf[r] + slot + i);
            }
            out[i] = s;
        } else {
            const int64_t row = i / cols, col = i - row * cols;
            for (int r = 0; r < p.size; r++) {
                out[row * width + (int64_t)r * cols + col] = __ldcg(p.buf[r] + slot + i);
            }
        }
    }
}

enum kr_status check_group(const krk_peer *p)
{
    if (!p || p->size < 2 || p->size > KRK_PEER_MAX_RANKS || p->rank < 0 || p->rank >= p->size || p->cap < 4 ||
        !p->calls || !p->error || !p->abort) {
        return KR_ERR_INVAL;
    }
    for (int r = 0; r < p->size; r++) {
        if (!p->buf[r] || !p->flag[r]) {
            return KR_ERR_INVAL;
        }
    }
    return KR_OK;
}

enum kr_status launch(const krk_peer *p, const float *in, float *out, int64_t n, int64_t cols, int gather,
                      cudaStream_t stream)
{
    int64_t nb = (n + kPerBlockMin - 1) / kPerBlockMin;
    nb = nb < 1 ? 1 : nb > KRK_PEER_MAX_BLOCKS ? KRK_PEER_MAX_BLOCKS : nb;
    peer_kernel<<<(unsigned)nb, kThreads, 0, stream>>>(*p, in, out, n, cols, gather);
    KRK_CUDA_TRY(cudaGetLastError());
    return KR_OK;
}

} // namespace

extern "C" enum kr_status krk_peer_all_reduce(const struct krk_peer *p, float *x, int64_t n, cudaStream_t stream)
{
    if (check_group(p) != KR_OK || n < 0 || (n > 0 && !x)) {
        return KR_ERR_INVAL;
    }
    for (int64_t off = 0; off < n; off += p->cap) {
        const int64_t m = n - off < p->cap ? n - off : p->cap;
        enum kr_status st = launch(p, x + off, x + off, m, 1, 0, stream);
        if (st != KR_OK) {
            return st;
        }
    }
    return KR_OK;
}

extern "C" enum kr_status krk_peer_all_gather(const struct krk_peer *p, const float *src, int64_t rows, int64_t cols,
                                              float *dst, cudaStream_t stream)
{
    if (check_group(p) != KR_OK || rows < 0 || cols < 1 || cols > p->cap || (rows > 0 && (!src || !dst))) {
        return KR_ERR_INVAL;
    }
    const int64_t per = p->cap / cols;
    for (int64_t r0 = 0; r0 < rows; r0 += per) {
        const int64_t m = rows - r0 < per ? rows - r0 : per;
        enum kr_status st = launch(p, src + r0 * cols, dst + r0 * p->size * cols, m * cols, cols, 1, stream);
        if (st != KR_OK) {
            return st;
        }
    }
    return KR_OK;
}

extern "C" enum kr_status krk_peer_combine(const struct krk_peer *p, int slot, float *out, int64_t n, int64_t cols,
                                           int gather, cudaStream_t stream)
{
    if (check_group(p) != KR_OK || (slot != 0 && slot != 1) || n < 0 || n > p->cap || cols < 1 ||
        (gather && n % cols != 0) || (n > 0 && !out)) {
        return KR_ERR_INVAL;
    }
    if (n == 0) {
        return KR_OK;
    }
    int64_t nb = (n + kThreads * 4 - 1) / (kThreads * 4);
    nb = nb > 264 ? 264 : nb;
    combine_kernel<<<(unsigned)nb, kThreads, 0, stream>>>(*p, (int64_t)slot * p->cap, out, n, cols, gather);
    KRK_CUDA_TRY(cudaGetLastError());
    return KR_OK;
}
