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
// The three products run on tensor cores (mma m16n8k8) in three-pass TF32 (krk::mma_3xtf32,
// common/mma.cuh): about fp32 accuracy, with fp32 accumulation.
// Warps: in the outputs, warp w owns rows 16 (w % 4) .. + 15 and columns 16 (w / 4) .. + 15; in
// the state update, rows n = 16 w (+ 128 k) .. + 15 and all kScanP columns.
#include "common/mma.cuh"
#include "mamba2/ssd_common.cuh"

namespace krk {
namespace mamba2 {

constexpr int kScanThreads = 256;
constexpr int kScanP = 32;  // head_dim columns per block
constexpr int kScanLdS = 40; // padded rows of S and x: fragment reads (k = t, n = g) on distinct banks

static_assert(kScanThreads == 8 * 32 && kScanP == 32 && kChunk == 64, "warp layout of ssd_scan_kernel");

// d_state padded to whole 16-row tiles (zeros past d_state).
__host__ __device__ constexpr int ssd_scan_np(int d_state)
{
    return (d_state + 15) / 16 * 16;
}
// Row strides of C (read as row-major A fragments: stride = 4 mod 8) and of B (read transposed:
// stride = 8 mod 32), in floats.
__host__ __device__ constexpr int ssd_scan_ldc(int d_state)
{
    return ssd_scan_np(d_state) + 4;
}
__host__ __device__ constexpr int ssd_scan_ldb(int d_state)
{
    return (ssd_scan_np(d_state) + 31) / 32 * 32 + 8;
}

// Dynamic shared memory of ssd_scan_kernel: S [np][kScanLdS], C [kChunk][ldc], B [kChunk][ldb],
// x [kChunk][kScanLdS], dt, cum and w [kChunk].
__host__ __device__ constexpr size_t ssd_scan_smem_bytes(int d_state)
{
    return sizeof(float) * ((size_t)ssd_scan_np(d_state) * kScanLdS + (size_t)kChunk * ssd_scan_ldc(d_state) +
                            (size_t)kChunk * ssd_scan_ldb(d_state) + (size_t)kChunk * kScanLdS + 3 * kChunk);
}

// 4-byte global->shared copy; src_bytes = 0 fills zeros and reads nothing.
__device__ __forceinline__ void cp_async4(float *dst, const float *src, int src_bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}

// NPC: d_state padded (ssd_scan_np) when known at compile time (loops fully unrolled), else 0.
// VEC: 16-byte copies (conv_dim, d_state, head_dim and n_head * head_dim multiples of 4, xbc
// 16-byte aligned).
template <int NPC, bool VEC> __global__ void __launch_bounds__(kScanThreads, 2) ssd_scan_kernel(SsdArgs a)
{
    krk::kernel_prologue();
    const int s = blockIdx.z, h = blockIdx.y, p0 = blockIdx.x * kScanP;
    const int t0 = a.batch.seq_tok0[s], nt = a.batch.seq_tok0[s + 1] - t0;
    if (nt < 2 || ssd_keeps(a, t0, nt)) {
        return; // decode path (token by token for a sequence that keeps its states)
    }
    const int P = a.head_dim, N = a.d_state;
    const int NP = NPC ? NPC : ssd_scan_np(N);
    const int ldc = NP + 4, ldb = (NP + 31) / 32 * 32 + 8; // ssd_scan_ldc / ssd_scan_ldb
    const int g = h / a.heads_per_group;
    const int slot = a.batch.seq_slot[s];
    const bool fresh = a.batch.seq_pos0[s] == 0 || slot < 0;
    float *st_head = slot >= 0 ? a.state + ((int64_t)slot * a.n_head + h) * (int64_t)P * N : nullptr;

    extern __shared__ __align__(16) float ssd_scan_sm[];
    float *S_sh = ssd_scan_sm;                    // [NP][kScanLdS]
    float *C_sh = S_sh + (size_t)NP * kScanLdS;   // [kChunk][ldc]
    float *B_sh = C_sh + (size_t)kChunk * ldc;    // [kChunk][ldb]
    float *x_sh = B_sh + (size_t)kChunk * ldb;    // [kChunk][kScanLdS]
    float *dt_sh = x_sh + kChunk * kScanLdS;      // [kChunk]
    float *cum_sh = dt_sh + kChunk;               // [kChunk]
    float *w_sh = cum_sh + kChunk;                // [kChunk]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int fg = lane >> 2, ft = lane & 3; // fragment row / column of this lane
    const int mt = warp & 3, nh = warp >> 2; // output tile of this warp: rows 16 mt, columns 16 nh
    const int r0 = 16 * mt + fg, r1 = r0 + 8; // output rows of this lane's accumulators

    // entering state, transposed from the slot's [head_dim][d_state] (zeros when fresh, past N and
    // past head_dim)
    for (int e = tid; e < NP * kScanP; e += kScanThreads) {
        const int pc = e / NP, n = e % NP; // n fastest: the slot's rows are read contiguously
        float v = 0.0f;
        if (!fresh && n < N && p0 + pc < P) {
            v = st_head[(int64_t)(p0 + pc) * N + n];
        }
        S_sh[n * kScanLdS + pc] = v;
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
    auto copy_bc = [&](float *dst, int ld, const float *src_seq, int c) {
        const int len = min(kChunk, nt - c * kChunk);
        const float *src = src_seq + (int64_t)c * kChunk * a.conv_dim;
        for (int l = warp; l < kChunk; l += kScanThreads / 32) {
            const bool lin = l < len;
            const float *r = src + (int64_t)(lin ? l : 0) * a.conv_dim;
            if constexpr (VEC) { // lane i: float4s i, i + 32, ... of the row
#pragma unroll
                for (int n = lane * 4; n < NP; n += 128) {
                    const bool in = lin && n < N;
                    cp_async16(&dst[l * ld + n], in ? r + n : src, in ? 16 : 0);
                }
            } else {
#pragma unroll
                for (int n = lane; n < NP; n += 32) {
                    const bool in = lin && n < N;
                    cp_async4(&dst[l * ld + n], in ? r + n : src, in ? 4 : 0);
                }
            }
        }
        cp_async_commit();
    };
    copy_bc(C_sh, ldc, Cseq, 0);
    for (int c = 0; c < nc; c++) {
        const int tc = t0 + c * kChunk, len = min(kChunk, nt - c * kChunk);
        __syncthreads(); // the previous chunk is done with B and x (and the entering state is stored)
        {
            const float *xh = a.xbc + (int64_t)tc * a.conv_dim + (int64_t)h * P + p0;
            if constexpr (VEC) { // 8 float4s a row, 4 rows a warp
#pragma unroll
                for (int e = tid; e < kChunk * kScanP / 4; e += kScanThreads) {
                    const int l = e >> 3, q = (e & 7) * 4;
                    const bool in = l < len && p0 + q < P;
                    cp_async16(&x_sh[l * kScanLdS + q], in ? xh + (int64_t)l * a.conv_dim + q : xh, in ? 16 : 0);
                }
            } else {
#pragma unroll
                for (int l = warp; l < kChunk; l += kScanThreads / 32) {
                    const bool in = l < len && p0 + lane < P;
                    cp_async4(&x_sh[l * kScanLdS + lane], in ? xh + (int64_t)l * a.conv_dim + lane : xh, in ? 4 : 0);
                }
            }
            cp_async_commit();
        }
        copy_bc(B_sh, ldb, Bseq, c);
        // this lane's elements of C.B^T for the intra-chunk product: k-steps ks <= 2 mt + 1 (the
        // columns s <= 16 mt + 15 that rows of this warp can see), at (r0 | r1, 8 ks + ft (+ 4))
        const float *cbg = a.ws_cb + ((int64_t)(base + c) * a.n_group + g) * (kChunk * kChunk);
        float cb[8][4];
#pragma unroll
        for (int ks = 0; ks < 8; ks++) {
            if (ks <= 2 * mt + 1) {
                cb[ks][0] = cbg[r0 * kChunk + 8 * ks + ft];
                cb[ks][1] = cbg[r1 * kChunk + 8 * ks + ft];
                cb[ks][2] = cbg[r0 * kChunk + 8 * ks + ft + 4];
                cb[ks][3] = cbg[r1 * kChunk + 8 * ks + ft + 4];
            }
        }
        ssd_chunk_dt(a, tc, len, h, A, dt_sh, cum_sh); // ends with __syncthreads()
        const float cend = cum_sh[len - 1];
        if (tid < kChunk) {
            w_sh[tid] = tid < len ? expf(cend - cum_sh[tid]) * dt_sh[tid] : 0.0f;
        }
        cp_async_wait<1>(); // this thread's copies of C and x have landed (B may be in flight)
        __syncthreads();

        // outputs: exp(cum_l) C S over the entering state ...
        float acc[2][4] = {};
#pragma unroll
        for (int k0 = 0; k0 < NP; k0 += 8) {
            Tf32A fa;
            fa.set(C_sh[r0 * ldc + k0 + ft], C_sh[r1 * ldc + k0 + ft], C_sh[r0 * ldc + k0 + ft + 4],
                   C_sh[r1 * ldc + k0 + ft + 4]);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int col = 16 * nh + 8 * j + fg;
                mma_3xtf32(acc[j], fa, S_sh[(k0 + ft) * kScanLdS + col], S_sh[(k0 + ft + 4) * kScanLdS + col]);
            }
        }
        {
            const float e0 = expf(cum_sh[r0]), e1 = expf(cum_sh[r1]);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                acc[j][0] *= e0;
                acc[j][1] *= e0;
                acc[j][2] *= e1;
                acc[j][3] *= e1;
            }
        }
        // ... plus M x over this chunk, M[l][s] = (C_l . B_s) exp(cum_l - cum_s) dt_s for s <= l < len
        {
            const float cr0 = cum_sh[r0], cr1 = cum_sh[r1];
            const bool in0 = r0 < len, in1 = r1 < len;
#pragma unroll
            for (int ks = 0; ks < 8; ks++) {
                if (ks > 2 * mt + 1) {
                    break; // warp-uniform
                }
                const int sa = 8 * ks + ft, sb = sa + 4;
                const float da = dt_sh[sa], db = dt_sh[sb], ca = cum_sh[sa], cbv = cum_sh[sb];
                Tf32A fa;
                fa.set(in0 && sa <= r0 ? cb[ks][0] * expf(cr0 - ca) * da : 0.0f,
                       in1 && sa <= r1 ? cb[ks][1] * expf(cr1 - ca) * da : 0.0f,
                       in0 && sb <= r0 ? cb[ks][2] * expf(cr0 - cbv) * db : 0.0f,
                       in1 && sb <= r1 ? cb[ks][3] * expf(cr1 - cbv) * db : 0.0f);
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int col = 16 * nh + 8 * j + fg;
                    mma_3xtf32(acc[j], fa, x_sh[sa * kScanLdS + col], x_sh[sb * kScanLdS + col]);
                }
            }
        }
        // ... plus D x; stored for rows inside the chunk and columns inside head_dim
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int pc = 16 * nh + 8 * j + 2 * ft, p = p0 + pc;
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int l = half ? r1 : r0;
                if (l >= len) {
                    continue;
                }
                const float o0 = acc[j][2 * half] + Dh * x_sh[l * kScanLdS + pc];
                const float o1 = acc[j][2 * half + 1] + Dh * x_sh[l * kScanLdS + pc + 1];
                float *yo = a.y + (int64_t)(tc + l) * ld_y + (int64_t)h * P + p;
                if (a.vec_y) { // p even, P and the row start multiples of 4: one aligned float2
                    if (p < P) {
                        *reinterpret_cast<float2 *>(yo) = make_float2(o0, o1);
                    }
                } else {
                    if (p < P) {
                        yo[0] = o0;
                    }
                    if (p + 1 < P) {
                        yo[1] = o1;
                    }
                }
            }
        }
        __syncthreads(); // every warp has read S and C
        if (c + 1 < nc) {
            copy_bc(C_sh, ldc, Cseq, c + 1);
            cp_async_wait<1>(); // B of this chunk has landed (C of the next may be in flight)
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        // state update: S <- exp(cend) S + (B w)^T x over the chunk's tokens, 16 rows of n a warp
        const float decay = expf(cend);
        const int kend = (len + 7) & ~7; // w is zero past len
        for (int n0 = 16 * warp; n0 < NP; n0 += 16 * (kScanThreads / 32)) {
            float u[4][4] = {};
#pragma unroll
            for (int k0 = 0; k0 < kend; k0 += 8) {
                const float wa = w_sh[k0 + ft], wb = w_sh[k0 + ft + 4];
                const float *ba = B_sh + (k0 + ft) * ldb + n0 + fg, *bb = B_sh + (k0 + ft + 4) * ldb + n0 + fg;
                Tf32A fa;
                fa.set(ba[0] * wa, ba[8] * wa, bb[0] * wb, bb[8] * wb);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    mma_3xtf32(u[j], fa, x_sh[(k0 + ft) * kScanLdS + 8 * j + fg],
                               x_sh[(k0 + ft + 4) * kScanLdS + 8 * j + fg]);
                }
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int pc = 8 * j + 2 * ft;
                float2 *sa = reinterpret_cast<float2 *>(&S_sh[(n0 + fg) * kScanLdS + pc]);
                float2 *sb = reinterpret_cast<float2 *>(&S_sh[(n0 + fg + 8) * kScanLdS + pc]);
                const float2 va = *sa, vb = *sb;
                *sa = make_float2(decay * va.x + u[j][0], decay * va.y + u[j][1]);
                *sb = make_float2(decay * vb.x + u[j][2], decay * vb.y + u[j][3]);
            }
        }
    }
    if (slot < 0) {
        return;
    }
    __syncthreads();
    for (int e = tid; e < NP * kScanP; e += kScanThreads) {
        const int pc = e / NP, n = e % NP;
        if (n < N && p0 + pc < P) {
            st_head[(int64_t)(p0 + pc) * N + n] = S_sh[n * kScanLdS + pc];
        }
    }
}

} // namespace mamba2
} // namespace krk
