#pragma once
// SSD phase 1, chunk state: the state each chunk alone would leave, starting from zero,
//   S_c[n, p] = sum_s exp(cum_end - cum_s) dt_s B_s[n] x_s[p],
// and the chunk's decay exp(cum_end). One block per (chunk slot, head, 64x64 tile of [n, p]);
// an outer-product register tile of 8x4 per thread over the chunk's tokens.
#include "mamba2/ssd_common.cuh"

namespace krk {
namespace mamba2 {

constexpr int kStateThreads = 128;
constexpr int kStateTile = 64; // n and p extent of one block's output tile

static_assert(kStateThreads / 16 * 8 == kStateTile, "rows n = ty * 8 + i cover the tile");

__global__ void __launch_bounds__(kStateThreads) ssd_chunk_state_kernel(SsdArgs a)
{
    krk::kernel_prologue();
    const int j = blockIdx.x, h = blockIdx.y;
    const int P = a.head_dim, N = a.d_state;
    const int tiles_p = (P + kStateTile - 1) / kStateTile;
    const int n0 = (int)(blockIdx.z / tiles_p) * kStateTile, p0 = (int)(blockIdx.z % tiles_p) * kStateTile;
    int s, c, t0, len;
    if (!ssd_slot_owner(a, j, s, c, t0, len)) {
        return;
    }
    __shared__ float dt_sh[kChunk], cum_sh[kChunk], w_sh[kChunk];
    __shared__ __align__(16) float B_sh[kChunk * kStateTile]; // [token][n]
    __shared__ __align__(16) float x_sh[kChunk * kStateTile]; // [token][p]
    const int tid = threadIdx.x;
    const float A = -expf(a.A_log[h]);
    ssd_chunk_dt(a, t0, len, h, A, dt_sh, cum_sh);
    const float cend = cum_sh[len - 1];
    if (tid < kChunk) {
        w_sh[tid] = tid < len ? expf(cend - cum_sh[tid]) * dt_sh[tid] : 0.0f;
    }
    __syncthreads();

    const int g = h / a.heads_per_group;
    const float *Bg = a.xbc + (int64_t)t0 * a.conv_dim + (int64_t)a.n_head * P + (int64_t)g * N + n0;
    const float *xh = a.xbc + (int64_t)t0 * a.conv_dim + (int64_t)h * P + p0;
    // fully unrolled so that every load is in flight before the first store waits on one
#pragma unroll
    for (int r = 0; r < kChunk * kStateTile / kStateThreads; r++) {
        const int e = tid + r * kStateThreads;
        const int l = e / kStateTile, k = e % kStateTile;
        const bool in = l < len;
        B_sh[e] = in && n0 + k < N ? w_sh[l] * Bg[(int64_t)l * a.conv_dim + k] : 0.0f;
        x_sh[e] = in && p0 + k < P ? xh[(int64_t)l * a.conv_dim + k] : 0.0f;
    }
    __syncthreads();

    const int tx = tid & 15, ty = tid >> 4; // rows n = ty*8 + i, columns p = tx*4 + jj
    float acc[8][4] = {};
#pragma unroll 4
    for (int l = 0; l < len; l++) {
        const float4 b0 = *reinterpret_cast<const float4 *>(&B_sh[l * kStateTile + ty * 8]);
        const float4 b1 = *reinterpret_cast<const float4 *>(&B_sh[l * kStateTile + ty * 8 + 4]);
        const float4 x = *reinterpret_cast<const float4 *>(&x_sh[l * kStateTile + tx * 4]);
        const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w}, xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int i = 0; i < 8; i++) {
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                acc[i][jj] += bv[i] * xv[jj];
            }
        }
    }

    float *out = a.ws_state + ((int64_t)j * a.n_head + h) * (int64_t)N * P;
    const int p = p0 + tx * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int n = n0 + ty * 8 + i;
        if (n >= N) {
            continue;
        }
        float *o = out + (int64_t)n * P + p;
        if (P % 4 == 0) { // whole float4 in range (p, P multiples of 4), 16-byte aligned
            if (p < P) {
                *reinterpret_cast<float4 *>(o) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
            }
        } else {
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                if (p + jj < P) {
                    o[jj] = acc[i][jj];
                }
            }
        }
    }
    if (blockIdx.z == 0 && tid == 0) {
        a.ws_decay[(int64_t)j * a.n_head + h] = expf(cend);
    }
}

} // namespace mamba2
} // namespace krk
