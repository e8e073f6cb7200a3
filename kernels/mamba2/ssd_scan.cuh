#pragma once
// SSD chunked scan: one block walks all chunks of one sequence in order for one head and kScanP
// columns of head_dim, carrying the state S [d_state, kScanP] in shared memory. Per chunk (tokens
// l, s < len; cum the in-chunk cumulative sum of dt*A, cend = cum[len-1]):
//   y[l, p] = exp(cum_l) sum_n C_l[n] S[n, p]                                 (earlier chunks)
//           + sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s[p]         (this chunk)
//           + D x_l[p]
//   S[n, p] <- exp(cend) S[n, p] + sum_s exp(cend - cum_s) dt_s B_s[n] x_s[p]
// starting from the slot's state (zeros when fresh) and writing the final S back to the slot.
// C.B^T comes from ssd_bmm (per group, shared by the group's heads). Nothing but y and the final
// state leaves the block, so the chunk states never go through memory; the chunks of one
// sequence run one after another, and the parallelism is sequences x heads x column tiles.
//
// Threads: tx = tid % 8 owns columns 4 tx .. 4 tx + 3 of the tile; ty = tid / 8 owns rows ty and
// ty + 32 of the chunk's outputs, and state rows 4 ty + 128 k .. + 3 in the update.
#include "common/mma.cuh"
#include "mamba2/ssd_common.cuh"

namespace krk {
namespace mamba2 {

constexpr int kScanThreads = 256;
constexpr int kScanP = 32;             // head_dim columns per block
constexpr int kScanLdM = kChunk + 4;   // padded row of M (float4 reads, no bank conflicts)

static_assert(kScanThreads == 8 * 32 && kScanP == 8 * 4 && kChunk == 64, "thread layout of ssd_scan_kernel");

// Floats of one row of the C and B tiles: d_state rounded up to 4, plus 4 of padding so that the
// rows ty .. ty + 3 read by one warp fall on distinct banks.
// 4-byte global->shared copy; src_bytes = 0 fills zeros and reads nothing.
__device__ __forceinline__ void cp_async4(float *dst, const float *src, int src_bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}

__host__ __device__ constexpr int ssd_scan_ldbc(int d_state)
{
    return (d_state + 3) / 4 * 4 + 4;
}

// Dynamic shared memory of ssd_scan_kernel: S [N4][kScanP], C and B [kChunk][ldbc], x
// [kChunk][kScanP], M [kChunk][kScanLdM], dt, cum and w [kChunk].
__host__ __device__ constexpr size_t ssd_scan_smem_bytes(int d_state)
{
    return sizeof(float) * ((size_t)(d_state + 3) / 4 * 4 * kScanP + 2 * (size_t)kChunk * ssd_scan_ldbc(d_state) +
                            (size_t)kChunk * kScanP + (size_t)kChunk * kScanLdM + 3 * kChunk);
}

__global__ void __launch_bounds__(kScanThreads, 2) ssd_scan_kernel(SsdArgs a)
{
    krk::kernel_prologue();
    const int s = blockIdx.z, h = blockIdx.y, p0 = blockIdx.x * kScanP;
    const int t0 = a.batch.seq_tok0[s], nt = a.batch.seq_tok0[s + 1] - t0;
    if (nt < 2) {
        return; // decode path
    }
    const int P = a.head_dim, N = a.d_state, N4 = (N + 3) / 4 * 4, ldbc = ssd_scan_ldbc(N);
    const int g = h / a.heads_per_group;
    const int slot = a.batch.seq_slot[s];
    const bool fresh = a.batch.seq_pos0[s] == 0 || slot < 0;
    float *st_head = slot >= 0 ? a.state + ((int64_t)slot * a.n_head + h) * (int64_t)P * N : nullptr;

    extern __shared__ __align__(16) float ssd_scan_sm[];
    float *S_sh = ssd_scan_sm;                   // [N4][kScanP]
    float *C_sh = S_sh + (size_t)N4 * kScanP;    // [kChunk][ldbc]
    float *B_sh = C_sh + (size_t)kChunk * ldbc;  // [kChunk][ldbc]
    float *x_sh = B_sh + (size_t)kChunk * ldbc;  // [kChunk][kScanP]
    float *M_sh = x_sh + kChunk * kScanP;        // [kChunk][kScanLdM]
    float *dt_sh = M_sh + kChunk * kScanLdM;     // [kChunk]
    float *cum_sh = dt_sh + kChunk;              // [kChunk]
    float *w_sh = cum_sh + kChunk;               // [kChunk]

    const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3, warp = tid >> 5, lane = tid & 31;
    const int pl = tx * 4; // this thread's first column in the tile

    // entering state, transposed from the slot's [head_dim][d_state] (zeros when fresh, past N and
    // past head_dim)
    for (int e = tid; e < N4 * kScanP; e += kScanThreads) {
        const int pc = e / N4, n = e % N4; // n fastest: the slot's rows are read contiguously
        float v = 0.0f;
        if (!fresh && n < N && p0 + pc < P) {
            v = st_head[(int64_t)(p0 + pc) * N + n];
        }
        S_sh[n * kScanP + pc] = v;
    }

    const float A = -expf(a.A_log[h]);
    const float Dh = a.D[h];
    const int64_t ld_y = (int64_t)a.n_head * P;
    const int nc = (nt + kChunk - 1) / kChunk;
    const int base = ssd_slot_base(a, s, t0);
    // Tile copies go through cp.async (zero-filled past the chunk's tokens, d_state and head_dim),
    // warp w taking rows w, w + 8, ... and lane i columns i, i + 32, ... (coalesced row reads).
    // C of chunk c + 1 is copied while chunk c updates the state, B of chunk c while chunk c
    // computes its outputs; only x waits with dt and C.B^T.
    const float *const Bseq = a.xbc + (int64_t)t0 * a.conv_dim + (int64_t)a.n_head * P + (int64_t)g * N;
    const float *const Cseq = Bseq + (int64_t)a.n_group * N;
    auto copy_bc = [&](float *dst, const float *src_seq, int c) {
        const int len = min(kChunk, nt - c * kChunk);
        const float *src = src_seq + (int64_t)c * kChunk * a.conv_dim;
        for (int l = warp; l < kChunk; l += kScanThreads / 32) {
            const bool lin = l < len;
            const float *r = src + (int64_t)(lin ? l : 0) * a.conv_dim;
            for (int n = lane; n < N4; n += 32) {
                const bool in = lin && n < N;
                cp_async4(&dst[l * ldbc + n], in ? r + n : src, in ? 4 : 0);
            }
        }
        cp_async_commit();
    };
    copy_bc(C_sh, Cseq, 0);
    for (int c = 0; c < nc; c++) {
        const int tc = t0 + c * kChunk, len = min(kChunk, nt - c * kChunk);
        __syncthreads(); // the previous chunk is done with B and x (and the entering state is stored)
        {
            const float *xh = a.xbc + (int64_t)tc * a.conv_dim + (int64_t)h * P + p0;
            static_assert(kScanP == 32, "one lane per column of x");
#pragma unroll
            for (int l = warp; l < kChunk; l += kScanThreads / 32) {
                const bool in = l < len && p0 + lane < P;
                cp_async4(&x_sh[l * kScanP + lane], in ? xh + (int64_t)l * a.conv_dim + lane : xh, in ? 4 : 0);
            }
            cp_async_commit();
        }
        copy_bc(B_sh, Bseq, c);
        const float *cbg = a.ws_cb + ((int64_t)(base + c) * a.n_group + g) * (kChunk * kChunk);
        float cb[kChunk * kChunk / kScanThreads];
#pragma unroll
        for (int r = 0; r < kChunk * kChunk / kScanThreads; r++) {
            cb[r] = cbg[tid + r * kScanThreads];
        }
        ssd_chunk_dt(a, tc, len, h, A, dt_sh, cum_sh); // ends with __syncthreads()
        const float cend = cum_sh[len - 1];
        if (tid < kChunk) {
            w_sh[tid] = tid < len ? expf(cend - cum_sh[tid]) * dt_sh[tid] : 0.0f;
        }
        // M[l][s] = (C_l . B_s) exp(cum_l - cum_s) dt_s for s <= l < len, else 0
#pragma unroll
        for (int r = 0; r < kChunk * kChunk / kScanThreads; r++) {
            const int e = tid + r * kScanThreads;
            const int l = e / kChunk, sj = e % kChunk;
            M_sh[l * kScanLdM + sj] = sj <= l && l < len ? cb[r] * expf(cum_sh[l] - cum_sh[sj]) * dt_sh[sj] : 0.0f;
        }
        cp_async_wait<1>(); // this thread's copies of C and x have landed (B may be in flight)
        __syncthreads();

        // outputs of rows l0 = ty and l1 = ty + 32: C S over the entering state ...
        const int l0 = ty, l1 = ty + 32;
        float y0[4] = {}, y1[4] = {};
#pragma unroll 4
        for (int n = 0; n < N4; n += 4) {
            const float4 c0 = *reinterpret_cast<const float4 *>(&C_sh[l0 * ldbc + n]);
            const float4 c1 = *reinterpret_cast<const float4 *>(&C_sh[l1 * ldbc + n]);
            const float ca[4] = {c0.x, c0.y, c0.z, c0.w}, cc[4] = {c1.x, c1.y, c1.z, c1.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float4 sv = *reinterpret_cast<const float4 *>(&S_sh[(n + k) * kScanP + pl]);
                y0[0] += ca[k] * sv.x;
                y0[1] += ca[k] * sv.y;
                y0[2] += ca[k] * sv.z;
                y0[3] += ca[k] * sv.w;
                y1[0] += cc[k] * sv.x;
                y1[1] += cc[k] * sv.y;
                y1[2] += cc[k] * sv.z;
                y1[3] += cc[k] * sv.w;
            }
        }
        const float e0 = expf(cum_sh[l0]), e1 = expf(cum_sh[l1]);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            y0[j] *= e0;
            y1[j] *= e1;
        }
        // ... plus M x over this chunk (M is zero above the diagonal: groups of 4 columns up to
        // the one holding the row's own column suffice)
        const int end0 = (l0 & ~3) + 4, end1 = (l1 & ~3) + 4;
        for (int sj = 0; sj < end1; sj += 4) {
            const float4 m1 = *reinterpret_cast<const float4 *>(&M_sh[l1 * kScanLdM + sj]);
            const float mb[4] = {m1.x, m1.y, m1.z, m1.w};
            float ma[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const bool row0_in = sj < end0;
            if (row0_in) {
                const float4 m0 = *reinterpret_cast<const float4 *>(&M_sh[l0 * kScanLdM + sj]);
                ma[0] = m0.x;
                ma[1] = m0.y;
                ma[2] = m0.z;
                ma[3] = m0.w;
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float4 xv = *reinterpret_cast<const float4 *>(&x_sh[(sj + k) * kScanP + pl]);
                y0[0] += ma[k] * xv.x;
                y0[1] += ma[k] * xv.y;
                y0[2] += ma[k] * xv.z;
                y0[3] += ma[k] * xv.w;
                y1[0] += mb[k] * xv.x;
                y1[1] += mb[k] * xv.y;
                y1[2] += mb[k] * xv.z;
                y1[3] += mb[k] * xv.w;
            }
        }
        // ... plus D x; stored for rows inside the chunk and columns inside head_dim
        const int p = p0 + pl;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int l = i == 0 ? l0 : l1;
            if (l >= len) {
                continue;
            }
            const float *yv = i == 0 ? y0 : y1;
            const float4 xl = *reinterpret_cast<const float4 *>(&x_sh[l * kScanP + pl]);
            const float out[4] = {yv[0] + Dh * xl.x, yv[1] + Dh * xl.y, yv[2] + Dh * xl.z, yv[3] + Dh * xl.w};
            float *yo = a.y + (int64_t)(tc + l) * ld_y + (int64_t)h * P + p;
            if (a.vec_y) { // p and the row start are multiples of 4: one aligned float4
                if (p < P) {
                    *reinterpret_cast<float4 *>(yo) = make_float4(out[0], out[1], out[2], out[3]);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    if (p + j < P) {
                        yo[j] = out[j];
                    }
                }
            }
        }
        __syncthreads(); // every row has read S and C
        if (c + 1 < nc) {
            copy_bc(C_sh, Cseq, c + 1);
            cp_async_wait<1>(); // B of this chunk has landed (C of the next may be in flight)
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        // state update: S <- exp(cend) S + sum_s w_s B_s x_s^T, rows n = 4 ty + 128 k .. + 3
        const float decay = expf(cend);
        for (int n = 4 * ty; n < N4; n += 4 * 32) {
            float acc[4][4] = {};
#pragma unroll 4
            for (int l = 0; l < len; l++) {
                const float wl = w_sh[l];
                const float4 bv = *reinterpret_cast<const float4 *>(&B_sh[l * ldbc + n]);
                const float4 xv = *reinterpret_cast<const float4 *>(&x_sh[l * kScanP + pl]);
                const float bw[4] = {bv.x * wl, bv.y * wl, bv.z * wl, bv.w * wl};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    acc[i][0] += bw[i] * xv.x;
                    acc[i][1] += bw[i] * xv.y;
                    acc[i][2] += bw[i] * xv.z;
                    acc[i][3] += bw[i] * xv.w;
                }
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float4 *sp = reinterpret_cast<float4 *>(&S_sh[(n + i) * kScanP + pl]);
                const float4 sv = *sp;
                *sp = make_float4(decay * sv.x + acc[i][0], decay * sv.y + acc[i][1], decay * sv.z + acc[i][2],
                                  decay * sv.w + acc[i][3]);
            }
        }
    }
    if (slot < 0) {
        return;
    }
    __syncthreads();
    for (int e = tid; e < N4 * kScanP; e += kScanThreads) {
        const int pc = e / N4, n = e % N4;
        if (n < N && p0 + pc < P) {
            st_head[(int64_t)(p0 + pc) * N + n] = S_sh[n * kScanP + pc];
        }
    }
}

} // namespace mamba2
} // namespace krk
