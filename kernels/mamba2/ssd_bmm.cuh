#pragma once
// SSD phase "bmm": G[l, s] = C_l . B_s for s <= l within one chunk, per group. B and C belong to
// the group, so this is shared by the group's heads (each head only rescales it by its decays
// and dt in the chunk scan). One block per (chunk slot, group); 4x4 register tiles with rows
// l = ty + 16 i and columns s = tx + 16 jj, so that tiles wholly above the diagonal are skipped.
#include "mamba2/ssd_common.cuh"

namespace krk {
namespace mamba2 {

constexpr int kBmmThreads = 256;
constexpr int kBmmK = 32;          // d_state per tile
constexpr int kBmmLd = kBmmK + 4;  // padded row (float4 reads, no bank conflicts)

__global__ void __launch_bounds__(kBmmThreads) ssd_bmm_kernel(SsdArgs a)
{
    krk::kernel_prologue();
    const int j = blockIdx.x, g = blockIdx.y;
    const int N = a.d_state;
    int s, c, t0, len;
    if (!ssd_slot_owner(a, j, s, c, t0, len) ||
        ssd_keeps(a, a.batch.seq_tok0[s], a.batch.seq_tok0[s + 1] - a.batch.seq_tok0[s])) {
        return; // no chunk here, or a sequence the decode kernel runs token by token
    }
    __shared__ __align__(16) float C_sh[kChunk * kBmmLd];
    __shared__ __align__(16) float B_sh[kChunk * kBmmLd];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const float *Bg = a.xbc + (int64_t)t0 * a.conv_dim + (int64_t)a.n_head * a.head_dim + (int64_t)g * N;
    const float *Cg = Bg + (int64_t)a.n_group * N;
    float cb[4][4] = {};
    for (int k0 = 0; k0 < N; k0 += kBmmK) {
#pragma unroll
        for (int r = 0; r < kChunk * kBmmK / kBmmThreads; r++) { // unrolled: all loads in flight
            const int e = tid + r * kBmmThreads;
            const int l = e / kBmmK, k = e % kBmmK;
            const bool in = l < len && k0 + k < N;
            C_sh[l * kBmmLd + k] = in ? Cg[(int64_t)l * a.conv_dim + k0 + k] : 0.0f;
            B_sh[l * kBmmLd + k] = in ? Bg[(int64_t)l * a.conv_dim + k0 + k] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < kBmmK; k += 4) {
            float4 cv[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                cv[i] = *reinterpret_cast<const float4 *>(&C_sh[(ty + 16 * i) * kBmmLd + k]);
                bv[i] = *reinterpret_cast<const float4 *>(&B_sh[(tx + 16 * i) * kBmmLd + k]);
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
#pragma unroll
                for (int jj = 0; jj <= i; jj++) {
                    cb[i][jj] += cv[i].x * bv[jj].x + cv[i].y * bv[jj].y + cv[i].z * bv[jj].z + cv[i].w * bv[jj].w;
                }
            }
        }
        __syncthreads();
    }
    float *out = a.ws_cb + ((int64_t)j * a.n_group + g) * (kChunk * kChunk);
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {
            out[(ty + 16 * i) * kChunk + tx + 16 * jj] = jj <= i ? cb[i][jj] : 0.0f;
        }
    }
}

} // namespace mamba2
} // namespace krk
