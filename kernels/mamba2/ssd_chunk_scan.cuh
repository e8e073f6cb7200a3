#pragma once
// SSD phase 3, chunk scan: the outputs of one chunk from its entering state S (workspace, after
// state passing), its group's C.B^T (ssd_bmm) and its own tokens:
//   y[l, p] = exp(cum_l) sum_n C_l[n] S[n, p]                                  (earlier chunks)
//           + sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s[p]          (this chunk)
//           + D x_l[p]
// One block per (chunk slot, head, 64 columns of head_dim). C S runs over d_state in tiles of
// kScanK; then the causal matrix M goes to shared memory and multiplies x. Threads own 8x4
// register tiles: rows l = ty + 8 i (so that 8-row blocks above the diagonal are skipped),
// columns p = 4 tx .. 4 tx + 3.
#include "mamba2/ssd_common.cuh"

namespace krk {
namespace mamba2 {

constexpr int kScanThreads = 128;
constexpr int kScanRows = 8;          // rows per thread (row step kScanThreads / 16)
constexpr int kScanP = 64;            // head_dim columns per block
constexpr int kScanK = 32;            // d_state per tile
constexpr int kScanLd = kScanK + 4;   // padded row of the C tile (float4 reads, no bank conflicts)
constexpr int kScanLdM = kChunk + 4;  // padded row of M
constexpr int kScanSmem = kChunk * kScanLdM + kChunk * kScanP; // floats: max(C + S tiles, M + x)
static_assert(kChunk * kScanLd + kScanK * kScanP <= kScanSmem, "scan tiles exceed the shared buffer");
static_assert(kScanThreads / 16 * kScanRows == kChunk, "one row per (ty, i)");

__device__ __forceinline__ float f4(const float4 &v, int i)
{
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__global__ void __launch_bounds__(kScanThreads, 4) ssd_chunk_scan_kernel(SsdArgs a)
{
    krk::kernel_prologue();
    const int j = blockIdx.x, h = blockIdx.y, p0 = blockIdx.z * kScanP;
    const int P = a.head_dim, N = a.d_state;
    int s, c, t0, len;
    if (!ssd_slot_owner(a, j, s, c, t0, len)) {
        return;
    }
    __shared__ float dt_sh[kChunk], cum_sh[kChunk];
    __shared__ __align__(16) float sm[kScanSmem];
    float *C_sh = sm;                       // [token][kScanLd]
    float *S_sh = sm + kChunk * kScanLd;    // [kScanK][kScanP]
    float *M_sh = sm;                       // [l][kScanLdM] after the d_state loop
    float *x_sh = sm + kChunk * kScanLdM;   // [s][kScanP]

    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const float A = -expf(a.A_log[h]);
    ssd_chunk_dt(a, t0, len, h, A, dt_sh, cum_sh);

    const int g = h / a.heads_per_group;
    const float *Cg = a.xbc + (int64_t)t0 * a.conv_dim + (int64_t)a.n_head * P + (int64_t)(a.n_group + g) * N;
    const float *Sg = a.ws_state + ((int64_t)j * a.n_head + h) * (int64_t)N * P + p0;

    float yv[kScanRows][4] = {}; // y[l = ty + 8 i][p = tx * 4 + jj]
    for (int k0 = 0; k0 < N; k0 += kScanK) {
        // fills unrolled so that many loads are in flight before the first store waits on one
#pragma unroll 8
        for (int r = 0; r < kChunk * kScanK / kScanThreads; r++) {
            const int e = tid + r * kScanThreads;
            const int l = e / kScanK, k = e % kScanK;
            C_sh[l * kScanLd + k] = l < len && k0 + k < N ? Cg[(int64_t)l * a.conv_dim + k0 + k] : 0.0f;
        }
#pragma unroll 8
        for (int r = 0; r < kScanK * kScanP / kScanThreads; r++) {
            const int e = tid + r * kScanThreads;
            const int k = e / kScanP, p = e % kScanP;
            S_sh[e] = k0 + k < N && p0 + p < P ? Sg[(int64_t)(k0 + k) * P + p] : 0.0f;
        }
        __syncthreads();
#pragma unroll 2
        for (int k = 0; k < kScanK; k += 4) {
            float4 cv[kScanRows], sv[4];
#pragma unroll
            for (int i = 0; i < kScanRows; i++) {
                cv[i] = *reinterpret_cast<const float4 *>(&C_sh[(ty + 8 * i) * kScanLd + k]);
            }
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                sv[kk] = *reinterpret_cast<const float4 *>(&S_sh[(k + kk) * kScanP + tx * 4]);
            }
#pragma unroll
            for (int i = 0; i < kScanRows; i++) {
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    const float cik = f4(cv[i], kk);
                    yv[i][0] += cik * sv[kk].x;
                    yv[i][1] += cik * sv[kk].y;
                    yv[i][2] += cik * sv[kk].z;
                    yv[i][3] += cik * sv[kk].w;
                }
            }
        }
        __syncthreads();
    }

    // M[l][s] = (C_l . B_s) exp(cum_l - cum_s) dt_s for s <= l < len, else 0; x tile
    const float *cbg = a.ws_cb + ((int64_t)j * a.n_group + g) * (kChunk * kChunk);
    const float *xh = a.xbc + (int64_t)t0 * a.conv_dim + (int64_t)h * P + p0;
#pragma unroll 8
    for (int r = 0; r < kChunk * kChunk / kScanThreads; r++) {
        const int e = tid + r * kScanThreads;
        const int l = e / kChunk, sj = e % kChunk;
        M_sh[l * kScanLdM + sj] = sj <= l && l < len ? cbg[e] * expf(cum_sh[l] - cum_sh[sj]) * dt_sh[sj] : 0.0f;
    }
#pragma unroll 8
    for (int r = 0; r < kChunk * kScanP / kScanThreads; r++) {
        const int e = tid + r * kScanThreads;
        const int l = e / kScanP, p = e % kScanP;
        x_sh[e] = l < len && p0 + p < P ? xh[(int64_t)l * a.conv_dim + p] : 0.0f;
    }
    __syncthreads();

#pragma unroll
    for (int i = 0; i < kScanRows; i++) {
        const float el = expf(cum_sh[ty + 8 * i]);
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {
            yv[i][jj] *= el;
        }
    }
    const int kend = (len + 3) & ~3;
    for (int k = 0; k < kend; k += 4) {
        float4 xv[4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            xv[kk] = *reinterpret_cast<const float4 *>(&x_sh[(k + kk) * kScanP + tx * 4]);
        }
#pragma unroll
        for (int i = 0; i < kScanRows; i++) {
            if (k < 8 * i + 8) { // rows l <= 8 i + 7 see only s <= l
                const float4 mv = *reinterpret_cast<const float4 *>(&M_sh[(ty + 8 * i) * kScanLdM + k]);
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    const float m = f4(mv, kk);
                    yv[i][0] += m * xv[kk].x;
                    yv[i][1] += m * xv[kk].y;
                    yv[i][2] += m * xv[kk].z;
                    yv[i][3] += m * xv[kk].w;
                }
            }
        }
    }

    const float Dh = a.D[h];
    const int64_t ld_y = (int64_t)a.n_head * P;
#pragma unroll
    for (int i = 0; i < kScanRows; i++) {
        const int l = ty + 8 * i;
        if (l >= len) {
            continue;
        }
        const float4 xl = *reinterpret_cast<const float4 *>(&x_sh[l * kScanP + tx * 4]);
        float out[4];
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {
            out[jj] = yv[i][jj] + Dh * f4(xl, jj);
        }
        const int p = p0 + tx * 4;
        float *yo = a.y + (int64_t)(t0 + l) * ld_y + (int64_t)h * P + p;
        if (a.vec_y) { // p and the row start are multiples of 4: one aligned float4
            if (p < P) {
                *reinterpret_cast<float4 *>(yo) = make_float4(out[0], out[1], out[2], out[3]);
            }
        } else {
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                if (p + jj < P) {
                    yo[jj] = out[jj];
                }
            }
        }
    }
}

} // namespace mamba2
} // namespace krk
