#pragma once
// Pieces shared by the SSD phases: dt, the chunk <-> (sequence, chunk) map of the workspace, the
// in-chunk cumulative sum of dt*A, and the parameters every SSD kernel receives.
#include "common/util.cuh"

namespace krk {
namespace mamba2 {

// Chunk length of the chunked SSD inside the kernels. The maths does not depend on it (only
// rounding does), so it need not equal the model's chunk: 64 keeps the intra-chunk work (which
// grows with the chunk) small and two scan blocks' tiles on one SM at d_state 128.
constexpr int kChunk = 64;

// SSD parameters as the kernels see them (copied from krk_ssd_params, with derived sizes).
struct SsdArgs {
    const float *__restrict__ xbc; // [n_tok, conv_dim]
    const float *__restrict__ dt;  // [n_tok, ld_dt]
    const float *__restrict__ dt_bias, *__restrict__ A_log, *__restrict__ D; // [n_head]
    float *__restrict__ state;     // [n_slot, n_head, head_dim, d_state]
    float *__restrict__ y;         // [n_tok, n_head * head_dim]
    float *__restrict__ ws_cb;     // [n_chunk_slot, n_group, kChunk, kChunk] C B^T per chunk and group
    int64_t conv_dim, ld_dt;
    int n_head, head_dim, n_group, d_state;
    int heads_per_group;
    float dt_min, dt_max;
    bool clamp_min, clamp_max;
    bool vec_y; // head_dim % 4 == 0 and y 16-byte aligned: float4 stores of y
    // chunk slot of chunk c of sequence s = s * slot_mul_seq + t0 / kChunk + t0 / 2 * slot_mul_half
    // (t0 = first token of s): see ssd_slot_base.
    int slot_mul_seq, slot_mul_half;
    int n_chunk_slot;
    krk_batch batch;
};

// Whether sequence tokens [t0, t0 + nt) keep a state after any of their tokens (batch.tok_keep): such
// a sequence runs the one-token recurrence token by token (ssd_decode_kernel), never the chunked scan.
__device__ __forceinline__ bool ssd_keeps(const SsdArgs &a, int t0, int nt)
{
    if (!a.batch.tok_keep) {
        return false;
    }
    for (int i = 0; i < nt; i++) {
        if (a.batch.tok_keep[t0 + i] >= 0) {
            return true;
        }
    }
    return false;
}

// softplus(x) = log(1 + e^x), computed as the CPU reference does (x itself above 20), then the
// optional clamp.
__device__ __forceinline__ float ssd_dt(const SsdArgs &a, int64_t t, int h)
{
    const float x = a.dt[t * a.ld_dt + h] + a.dt_bias[h];
    float v = x > 20.0f ? x : log1pf(expf(x));
    if (a.clamp_min && v < a.dt_min) {
        v = a.dt_min;
    }
    if (a.clamp_max && v > a.dt_max) {
        v = a.dt_max;
    }
    return v;
}

// Workspace slot of the first chunk of a sequence starting at token t0 (sequence index s).
// Both forms are non-decreasing in s and advance by at least ceil(n/kChunk) past a sequence of
// n >= 2 tokens, so the chunks of different sequences never share a slot:
//  - s + floor(t0/Q): floor(a/Q) + ceil(b/Q) <= 1 + floor((a+b)/Q);
//  - floor(t0/Q) + floor(t0/2): the same, with floor(t0/2) growing by >= 1 over >= 2 tokens.
// The host takes the one needing fewer slots (ssd_chunk_slots).
__device__ __forceinline__ int ssd_slot_base(const SsdArgs &a, int s, int t0)
{
    return s * a.slot_mul_seq + t0 / kChunk + (t0 / 2) * a.slot_mul_half;
}

// Chunk (sequence s, chunk c of it) held by workspace slot j, found by binary search over the
// sequences (the largest s whose base slot is <= j). Returns false when no chunked sequence
// (>= 2 tokens) owns slot j.
__device__ __forceinline__ bool ssd_slot_owner(const SsdArgs &a, int j, int &s_out, int &c_out, int &t0_out,
                                               int &nt_out)
{
    const int32_t *tok0 = a.batch.seq_tok0;
    int lo = 0, hi = a.batch.n_seq - 1, s = -1;
    while (lo <= hi) {
        const int mid = (lo + hi) >> 1;
        if (ssd_slot_base(a, mid, tok0[mid]) <= j) {
            s = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    if (s < 0) {
        return false;
    }
    const int t0 = tok0[s], nt = tok0[s + 1] - t0;
    const int c = j - ssd_slot_base(a, s, t0);
    if (nt < 2 || c >= (nt + kChunk - 1) / kChunk) {
        return false;
    }
    s_out = s;
    c_out = c;
    t0_out = t0 + c * kChunk;
    nt_out = min(kChunk, nt - c * kChunk);
    return true;
}

// dt_s (zero past the chunk's len tokens) and the inclusive cumulative sum of dt*A of one chunk
// into shared memory. Every block calls it with the same code, so phases agree bit for bit on
// the decays. Call from all threads (>= 64); ends with __syncthreads().
__device__ __forceinline__ void ssd_chunk_dt(const SsdArgs &a, int64_t t0, int len, int h, float A,
                                             float *dt_sh /* [kChunk] */, float *cum_sh /* [kChunk] */)
{
    const int tid = threadIdx.x;
    if (tid < 32) {
        // lane l scans tokens l and 32 + l
        float v0 = tid < len ? ssd_dt(a, t0 + tid, h) : 0.0f;
        float v1 = tid + 32 < len ? ssd_dt(a, t0 + 32 + tid, h) : 0.0f;
        dt_sh[tid] = v0;
        dt_sh[tid + 32] = v1;
        float c0 = v0 * A, c1 = v1 * A;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float u0 = __shfl_up_sync(0xffffffffu, c0, o);
            const float u1 = __shfl_up_sync(0xffffffffu, c1, o);
            if (tid >= o) {
                c0 += u0;
                c1 += u1;
            }
        }
        const float total0 = __shfl_sync(0xffffffffu, c0, 31);
        cum_sh[tid] = c0;
        cum_sh[tid + 32] = total0 + c1;
    }
    __syncthreads();
}

} // namespace mamba2
} // namespace krk
