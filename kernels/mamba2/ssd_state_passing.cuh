#pragma once
// SSD phase 2, state passing: walks a sequence's chunks in order, replacing each chunk state of
// the workspace by the state entering that chunk (S_0 = the slot's state, or zeros when fresh;
// S_{c+1} = decay_c S_c + chunk state c), and writes the final state back to the slot.
// Memory bound: one block per (sequence, head, kPassTile elements of the head's state), each
// thread kPassPer elements, with the next chunk's loads issued before the current stores.
#include "mamba2/ssd_common.cuh"

namespace krk {
namespace mamba2 {

constexpr int kPassThreads = 256;
constexpr int kPassPer = 16;
constexpr int kPassTile = kPassThreads * kPassPer;

__global__ void __launch_bounds__(kPassThreads) ssd_state_passing_kernel(SsdArgs a)
{
    krk::kernel_prologue();
    const int s = blockIdx.z, h = blockIdx.y;
    const int t0 = a.batch.seq_tok0[s], nt = a.batch.seq_tok0[s + 1] - t0;
    if (nt < 2) {
        return; // decode path
    }
    const int P = a.head_dim, N = a.d_state;
    const int64_t PN = (int64_t)P * N;
    const int nc = (nt + kChunk - 1) / kChunk;
    const int base = ssd_slot_base(a, s, t0);
    const int slot = a.batch.seq_slot[s];
    const bool fresh = a.batch.seq_pos0[s] == 0 || slot < 0;
    const int64_t e0 = (int64_t)blockIdx.x * kPassTile + threadIdx.x;
    float *st_head = slot >= 0 ? a.state + ((int64_t)slot * a.n_head + h) * PN : nullptr;

    // element e of the workspace's [N, P] chunk state is state[p = e % P][n = e / P]
    float S[kPassPer];
#pragma unroll
    for (int k = 0; k < kPassPer; k++) {
        const int64_t e = e0 + (int64_t)k * kPassThreads;
        S[k] = 0.0f;
        if (!fresh && e < PN) {
            S[k] = st_head[(e % P) * N + e / P];
        }
    }
    float nxt[kPassPer];
    const float *ws0 = a.ws_state + ((int64_t)base * a.n_head + h) * PN;
#pragma unroll
    for (int k = 0; k < kPassPer; k++) {
        const int64_t e = e0 + (int64_t)k * kPassThreads;
        nxt[k] = e < PN ? ws0[e] : 0.0f;
    }
    for (int c = 0; c < nc; c++) {
        float cur[kPassPer];
#pragma unroll
        for (int k = 0; k < kPassPer; k++) {
            cur[k] = nxt[k];
        }
        float *ws = a.ws_state + ((int64_t)(base + c) * a.n_head + h) * PN;
        const float decay = a.ws_decay[(int64_t)(base + c) * a.n_head + h];
        if (c + 1 < nc) {
            const float *wn = ws + (int64_t)a.n_head * PN;
#pragma unroll
            for (int k = 0; k < kPassPer; k++) {
                const int64_t e = e0 + (int64_t)k * kPassThreads;
                nxt[k] = e < PN ? wn[e] : 0.0f;
            }
        }
#pragma unroll
        for (int k = 0; k < kPassPer; k++) {
            const int64_t e = e0 + (int64_t)k * kPassThreads;
            if (e < PN) {
                ws[e] = S[k];
            }
            S[k] = decay * S[k] + cur[k];
        }
    }
    if (slot >= 0) {
#pragma unroll
        for (int k = 0; k < kPassPer; k++) {
            const int64_t e = e0 + (int64_t)k * kPassThreads;
            if (e < PN) {
                st_head[(e % P) * N + e / P] = S[k];
            }
        }
    }
}

} // namespace mamba2
} // namespace krk
