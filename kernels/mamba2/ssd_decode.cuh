#pragma once
// SSD decode: the exact one-step recurrence for sequences with one token this step (and, token by
// token, for sequences that keep their states after each token: struct krk_batch.tok_keep),
//   state[q, :] = exp(dt A) state[q, :] + dt x[q] B;  y[q] = state[q, :] . C + D x[q].
// Memory bound: every state element is read and written once. One block per (sequence, head,
// slice of kDecodeRows rows of head_dim); one warp per row walks d_state with 16-byte accesses,
// and each warp issues the loads of all its rows before using any of them.
#include "mamba2/ssd_common.cuh"

#include <type_traits>

namespace krk {
namespace mamba2 {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeRowsPerWarp = 4;
constexpr int kDecodeRows = kDecodeThreads / 32 * kDecodeRowsPerWarp; // 16
constexpr int kMaxState = 256;

// VEC: d_state % 4 == 0 (16-byte state rows); lane i owns float4 i and i + 32 of a row.
// Otherwise lane i owns elements i, i + 32, ... (d_state <= 256: at most 8). CS: the state is loaded
// and stored with the streaming (evict-first) hints. KEEP: the batch keeps states after single tokens
// (batch.tok_keep set), so a sequence may run several tokens here; without it every sequence this
// kernel runs has one token, and the loop over them compiles to the one-token update alone.
template <typename T> __device__ __forceinline__ T st_load(const T *p, bool cs)
{
    return cs ? __ldcs(p) : *p;
}
template <typename T> __device__ __forceinline__ void st_store(T *p, T v, bool cs)
{
    if (cs) {
        __stcs(p, v);
    } else {
        *p = v;
    }
}

template <bool VEC, bool CS, bool KEEP>
__global__ void __launch_bounds__(kDecodeThreads) ssd_decode_kernel(SsdArgs a)
{
    // Until the wait only what no kernel of this step writes is read: the batch arrays (uploaded
    // before the step's first kernel), A and D, and the sequence's state (written only by this
    // layer's update of an earlier step), so that the state's loads overlap the previous kernel.
    krk::pdl_trigger();
    const int s = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * kDecodeRows;
    const int t = a.batch.seq_tok0[s], nt = a.batch.seq_tok0[s + 1] - t;
    if (nt > 1 && (!KEEP || !ssd_keeps(a, t, nt))) {
        // chunked path. Wait all the same: in a step of prefill chunks only, no block of this grid
        // would reach a wait, the grid could complete before the conv kernels it follows, and the
        // C.B^T kernel (which waits only for this grid) would read xBC while they still write it.
        krk::pdl_wait();
        return;
    }
    const int N = a.d_state, P = a.head_dim;
    const int slot = a.batch.seq_slot[s];
    const bool fresh = a.batch.seq_pos0[s] == 0 || slot < 0;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *st_head = slot >= 0 ? a.state + ((int64_t)slot * a.n_head + h) * (int64_t)P * N : nullptr;
    if (nt == 0) {
        // no token: a fresh sequence still starts from the zero state (as the reference does)
        krk::pdl_wait();
        if (slot >= 0 && a.batch.seq_pos0[s] == 0) {
            for (int q = q0; q < min(q0 + kDecodeRows, P); q++) {
                for (int n = threadIdx.x; n < N; n += kDecodeThreads) {
                    st_head[(int64_t)q * N + n] = 0.0f;
                }
            }
        }
        return;
    }

    __shared__ __align__(16) float B_sh[kMaxState];
    __shared__ __align__(16) float C_sh[kMaxState];
    const int g = h / a.heads_per_group;
    const int qw = q0 + warp * kDecodeRowsPerWarp;
    // the state loads go first: they need nothing from B, C or dt, and their latency dominates
    constexpr int kPer = VEC ? 2 : kMaxState / 32; // float4s or floats per lane and row
    using Vec = typename std::conditional<VEC, float4, float>::type;
    Vec v[kDecodeRowsPerWarp][kPer];
#pragma unroll
    for (int r = 0; r < kDecodeRowsPerWarp; r++) {
#pragma unroll
        for (int k = 0; k < kPer; k++) {
            const int i = lane + 32 * k;
            if constexpr (VEC) {
                v[r][k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (!fresh && qw + r < P && i < (N >> 2)) {
                    v[r][k] = st_load(reinterpret_cast<const float4 *>(st_head + (int64_t)(qw + r) * N) + i, CS);
                }
            } else {
                v[r][k] = 0.0f;
                if (!fresh && qw + r < P && i < N) {
                    v[r][k] = st_load(st_head + (int64_t)(qw + r) * N + i, CS);
                }
            }
        }
    }
    const float A = -expf(a.A_log[h]);
    const float Dh = a.D[h];
    krk::pdl_wait(); // x, B, C and dt come from the previous kernel
    // One token (decode), or a sequence that keeps its states (speculative decoding's verification):
    // its tokens one after another, the state carried in registers and stored after its last token
    // (the sequence's slot) and after each token that keeps one (that token's slot).
    const int n_run = KEEP ? nt : 1;
    for (int j = 0; j < n_run; j++) {
        const int tj = t + j;
        const float *row = a.xbc + (int64_t)tj * a.conv_dim;
        const float *Bg = row + (int64_t)a.n_head * P + (int64_t)g * N;
        const float *Cg = Bg + (int64_t)a.n_group * N;
        float *dst = j == n_run - 1 ? st_head : nullptr, *kept = nullptr;
        if (KEEP && a.batch.tok_keep[tj] >= 0) {
            kept = a.state + ((int64_t)a.batch.tok_keep[tj] * a.n_head + h) * (int64_t)P * N;
        }
        float xq[kDecodeRowsPerWarp];
#pragma unroll
        for (int r = 0; r < kDecodeRowsPerWarp; r++) {
            xq[r] = qw + r < P ? row[(int64_t)h * P + qw + r] : 0.0f;
        }
        if (j > 0) {
            __syncthreads(); // every warp is done with the previous token's B and C
        }
        for (int n = threadIdx.x; n < N; n += kDecodeThreads) {
            B_sh[n] = Bg[n];
            C_sh[n] = Cg[n];
        }
        const float dt = ssd_dt(a, tj, h);
        const float dA = expf(dt * A);
        __syncthreads();

        if constexpr (VEC) {
            const int N4 = N >> 2;
#pragma unroll
            for (int r = 0; r < kDecodeRowsPerWarp; r++) {
                const float dx = dt * xq[r];
                float acc = 0.0f;
#pragma unroll
                for (int k = 0; k < kPer; k++) {
                    const int i = lane + 32 * k;
                    if (i < N4) {
                        const float4 b = reinterpret_cast<const float4 *>(B_sh)[i];
                        const float4 c = reinterpret_cast<const float4 *>(C_sh)[i];
                        float4 u = v[r][k];
                        u.x = u.x * dA + dx * b.x;
                        u.y = u.y * dA + dx * b.y;
                        u.z = u.z * dA + dx * b.z;
                        u.w = u.w * dA + dx * b.w;
                        acc += u.x * c.x + u.y * c.y + u.z * c.z + u.w * c.w;
                        v[r][k] = u;
                        if (dst && qw + r < P) {
                            st_store(reinterpret_cast<float4 *>(dst + (int64_t)(qw + r) * N) + i, u, CS);
                        }
                        if (kept && qw + r < P) {
                            reinterpret_cast<float4 *>(kept + (int64_t)(qw + r) * N)[i] = u;
                        }
                    }
                }
                acc = warp_sum(acc);
                if (lane == 0 && qw + r < P) {
                    a.y[(int64_t)tj * a.n_head * P + (int64_t)h * P + qw + r] = acc + Dh * xq[r];
                }
            }
        } else {
#pragma unroll
            for (int r = 0; r < kDecodeRowsPerWarp; r++) {
                const float dx = dt * xq[r];
                float acc = 0.0f;
#pragma unroll
                for (int k = 0; k < kPer; k++) {
                    const int n = lane + 32 * k;
                    if (n < N) {
                        const float u = v[r][k] * dA + dx * B_sh[n];
                        acc += u * C_sh[n];
                        v[r][k] = u;
                        if (dst && qw + r < P) {
                            st_store(dst + (int64_t)(qw + r) * N + n, u, CS);
                        }
                        if (kept && qw + r < P) {
                            kept[(int64_t)(qw + r) * N + n] = u;
                        }
                    }
                }
                acc = warp_sum(acc);
                if (lane == 0 && qw + r < P) {
                    a.y[(int64_t)tj * a.n_head * P + (int64_t)h * P + qw + r] = acc + Dh * xq[r];
                }
            }
        }
    }
}

} // namespace mamba2
} // namespace krk
