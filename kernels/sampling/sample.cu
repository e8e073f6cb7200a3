// Logits processing and sampling, one thread block per row, with the semantics of the host sampler
// (engine/sampler.c, kr_sample).
//
// Host order of operations on one row: penalties, min_tokens masking, then either greedy argmax
// (lowest id on ties) or: sort the candidates (logit descending, lowest id first on ties), keep a
// prefix (top-k, then top-p on the weights e_i = exp(v_i * inv_t - mx), then min-p) and walk the
// kept prefix until the cumulative weight exceeds u * total.
//
// Here nothing is sorted. Every cut the host makes is a prefix of that sorted order, and a prefix is
// named by a "cut": the key (order-preserving bits of the logit) of the tie group where it ends, the
// count and weight of everything above that key, and how many of the tie group (lowest ids first)
// it takes. A cut is found by a radix-style select with block-wide histograms of counts and weights:
// level 1 (built once per row over every element) has 2048 bins linear in value below the row's
// maximum, down to where weights quantize to 0, so elements spread over many bins; each cut then
// refines its level-1 bin over the keys, 11 bits per level (one pass over the row per level, usually
// two), counting only the elements of that bin. Weights are summed in 64-bit fixed point (2^S per
// unit, S chosen so that a whole row cannot overflow), so every sum is exact and independent of the
// order of the atomics: a row draws the same token on every run, and each level's bins add up
// exactly to the bin above them. The weights themselves are computed in double as on the host; fixed
// point loses at most 2^-(S+1) per element (S = 45 for 129K tokens).
//
// Three kernels: prep (penalties and masks into the workspace row, maximum, log-sum-exp; finishes
// greedy and rejected rows), draw (the cuts and the draw of the sampling rows) and top-n (the n_top
// best raw log-probabilities, from per-warp sorted candidate lists).
//
// A constrained row (constrained decoding: mask_off >= 0) reads its logits through its allowed-token
// bitmask everywhere, so a token the mask leaves out is -inf before penalties, in the log-sum-exp
// and in the log-probabilities alike (the host's order: the mask first). The mask words are read
// from global memory beside the logits: 32 consecutive ids share one word, so a warp's reads of it
// are one broadcast.
#include "common/util.cuh"
#include "krk/sampling.h"

#include <climits>
#include <cmath>

namespace {

using u32 = uint32_t;
using u64 = unsigned long long;

constexpr int kBlock = 1024;
constexpr int kPrepLoads = 16; // logits loaded at once per thread in prep_kernel
constexpr int kWarps = kBlock / 32;
constexpr int kBins = 2048;                 // radix digit of 11 bits
constexpr int kPer = kBins / kBlock;        // bins per thread in the bin scans
constexpr u32 kFull = 0xffffffffu;
constexpr u32 kKeyValid = 0x00800000u;      // smallest key above that of -inf (0x007fffff)
constexpr int64_t kMaxVocab = int64_t(1) << 20;
constexpr int kRowAlign = 32;               // workspace rows are padded to 32 floats
constexpr double kArgMax = 0.693;           // weight arguments are clamped so that e <= 2

static_assert(kBins % kBlock == 0, "bins must split evenly over the block");
static_assert(sizeof(krk_sample_row) == 48, "krk_sample_row layout shared with C");

enum SelMode { SEL_COUNT, SEL_GE, SEL_GT };
enum RowMode { ROW_BAD, ROW_GREEDY, ROW_SAMPLE };

// Fixed-point weights per bin are summed as two 32-bit words with an exact carry (native shared
// atomics; 64-bit shared atomic adds are compare-and-swap loops, slow under contention).
struct Hist {
    u32 c[kBins];   // elements per bin
    u32 qlo[kBins]; // fixed-point weight per bin: low word
    u32 qhi[kBins]; //                             high word

    __device__ __forceinline__ u64 q(int b) const { return ((u64)qhi[b] << 32) | qlo[b]; }
    __device__ __forceinline__ void clear(int b)
    {
        c[b] = 0;
        qlo[b] = 0;
        qhi[b] = 0;
    }
    __device__ __forceinline__ void add_q(u32 b, u64 q)
    {
        const u32 lo = (u32)q;
        u32 hi = (u32)(q >> 32);
        if (lo) {
            const u32 old = atomicAdd(&qlo[b], lo);
            hi += old + lo < old; // carry out of the low word
        }
        if (hi) {
            atomicAdd(&qhi[b], hi);
        }
    }
};

struct Shared {
    Hist h1;                  // level 1 over the whole processed row
    Hist h;                   // the level being refined
    int32_t lo[kBins];        // lowest id per bin (last level)
    int32_t hi[kBins];        // highest id per bin (last level)
    u64 cand[kBlock];         // top-n candidates: 32 per warp
    u64 red64[kWarps];
    u32 red32[kWarps];
    float redf[kWarps];
    double redd[kWarps];
    u32 scan_c[kWarps];
    u64 scan_q[kWarps];
    u32 nth_cnt[kWarps];
    int32_t nth_id;
    int cross_found;
    u32 cross_bin;
    u32 cross_c;
    u64 cross_q;
};
// followed in dynamic shared memory by the penalty bitmap: u32[ceil(vocab / 32)]

struct Args {
    krk_sample_params p;
    void *workspace; // krk_ctx's: the processed rows, then the rows' RowStat
    int64_t vp;      // workspace row length (floats, multiple of kRowAlign)
    int nbm;         // bitmap words
    double scale;    // 2^S: fixed-point units per unit of weight
    double arg_min;  // weight arguments below this quantize to 0
};

// Order-preserving key of a float: larger value, larger key (-inf -> 0x007fffff).
__device__ __forceinline__ u32 fkey(float v)
{
    const u32 u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Whether row mask m (nullptr: unconstrained) allows token i.
__device__ __forceinline__ bool allows(const u32 *m, int i)
{
    return m == nullptr || ((m[i >> 5] >> (i & 31)) & 1u) != 0u;
}

// Logit i of a row as its mask leaves it: the raw logit, or -inf for a token the mask leaves out.
__device__ __forceinline__ float masked_logit(const float *lrow, const u32 *m, int i)
{
    return allows(m, i) ? lrow[i] : -INFINITY;
}

// Canonical processed logit: NaN counts as -inf, -0 as +0 (the host compares values, not bits).
__device__ __forceinline__ float canon(float v)
{
    if (v != v) {
        return -INFINITY;
    }
    return v == 0.0f ? 0.0f : v;
}

// Weights as on the host: e = exp((double)v * (double)inv_t - (double)mx), mx = float(vmax * inv_t).
// The product of two floats is exact in double, so a fused multiply-add gives the same argument.
struct Weights {
    float inv_t;
    double mx;
    double scale;
    double arg_min;
    float vtop;  // level 1: bins linear in vtop - v, kBins - 1 at the top ...
    float s1;    // ... (kBins - 1) / s1 below it bin 0 (weights there quantize to 0)

    // Level-1 bin: monotone in v (float roundings are monotone), larger values in higher bins.
    __device__ __forceinline__ int lbin(float v) const
    {
        const float d = fminf(fmaxf(__fmul_rn(__fsub_rn(vtop, v), s1), 0.0f), (float)(kBins - 1));
        return kBins - 1 - (int)d;
    }

    __device__ __forceinline__ double arg(float v) const
    {
        return (double)v * (double)inv_t - mx;
    }
    __device__ __forceinline__ double weight(float v) const
    {
        return exp(fmin(arg(v), kArgMax));
    }
    __device__ __forceinline__ u64 quant(float v) const
    {
        const double a = arg(v);
        if (!(a >= arg_min)) {
            return 0;
        }
        return __double2ull_rn(exp(fmin(a, kArgMax)) * scale);
    }
};

// ---- block reductions and scans ------------------------------------------------------------------

struct OpMaxU64 {
    __device__ u64 operator()(u64 a, u64 b) const { return a > b ? a : b; }
};
struct OpSumU64 {
    __device__ u64 operator()(u64 a, u64 b) const { return a + b; }
};
struct OpSumU32 {
    __device__ u32 operator()(u32 a, u32 b) const { return a + b; }
};
struct OpMaxF {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v = op(v, __shfl_xor_sync(kFull, v, o));
    }
    return v;
}

// Every thread gets the result. Contains __syncthreads: call from every thread.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T ident, T *sh)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) {
        sh[wid] = v;
    }
    __syncthreads();
    v = lane < kWarps ? sh[lane] : ident;
    return warp_reduce(v, op);
}

// Running log-sum-exp of one thread: s = sum exp(x - m) over the finite x seen so far.
struct Lse {
    float m;
    double s;
};

__device__ __forceinline__ Lse lse_combine(Lse a, Lse b)
{
    if (a.m == -INFINITY) {
        return b;
    }
    if (b.m == -INFINITY) {
        return a;
    }
    const float m = fmaxf(a.m, b.m);
    return {m, a.s * exp((double)a.m - (double)m) + b.s * exp((double)b.m - (double)m)};
}

__device__ Lse block_lse(Lse v, Shared &sm)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const Lse w = {__shfl_xor_sync(kFull, v.m, o), __shfl_xor_sync(kFull, v.s, o)};
        v = lse_combine(v, w);
    }
    __syncthreads();
    if (lane == 0) {
        sm.redf[wid] = v.m;
        sm.redd[wid] = v.s;
    }
    __syncthreads();
    v = lane < kWarps ? Lse{sm.redf[lane], sm.redd[lane]} : Lse{-INFINITY, 0.0};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const Lse w = {__shfl_xor_sync(kFull, v.m, o), __shfl_xor_sync(kFull, v.s, o)};
        v = lse_combine(v, w);
    }
    return v;
}

// Exclusive scan of (c, q) over the block in thread order.
__device__ void block_excl_scan(u32 c, u64 q, u32 &ec, u64 &eq, Shared &sm)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    u32 ic = c;
    u64 iq = q;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 tc = __shfl_up_sync(kFull, ic, o);
        const u64 tq = __shfl_up_sync(kFull, iq, o);
        if (lane >= o) {
            ic += tc;
            iq += tq;
        }
    }
    __syncthreads();
    if (lane == 31) {
        sm.scan_c[wid] = ic;
        sm.scan_q[wid] = iq;
    }
    __syncthreads();
    if (wid == 0) {
        const u32 wc = lane < kWarps ? sm.scan_c[lane] : 0;
        const u64 wq = lane < kWarps ? sm.scan_q[lane] : 0;
        u32 sc = wc;
        u64 sq = wq;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u32 tc = __shfl_up_sync(kFull, sc, o);
            const u64 tq = __shfl_up_sync(kFull, sq, o);
            if (lane >= o) {
                sc += tc;
                sq += tq;
            }
        }
        if (lane < kWarps) {
            sm.scan_c[lane] = sc - wc;
            sm.scan_q[lane] = sq - wq;
        }
    }
    __syncthreads();
    ec = sm.scan_c[wid] + ic - c;
    eq = sm.scan_q[wid] + iq - q;
}

// ---- histograms -----------------------------------------------------------------------------------

__device__ __forceinline__ float f4_get(const float4 &v, int k)
{
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// Level 1 over every candidate of the row: bins linear in value below the row's maximum, so that
// elements spread over many bins (few conflicting atomics); bin 0 collects the zero-weight tail and
// is counted once per warp.
__device__ void hist_level1(const float4 *w4, int n4, const Weights &wt, Shared &sm)
{
    const int tid = threadIdx.x, lane = tid & 31;
    __syncthreads();
    for (int i = tid; i < kBins; i += kBlock) {
        sm.h1.clear(i);
    }
    __syncthreads();
    for (int base = 0; base < n4; base += kBlock) { // same trip count for every thread
        const int i4 = base + tid;
        const float4 v4 = i4 < n4 ? w4[i4] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float x = f4_get(v4, k);
            const bool ok = x > -INFINITY;
            const int bin = ok ? wt.lbin(x) : -1;
            const u32 tail = __ballot_sync(kFull, bin == 0);
            if (tail && lane == __ffs(tail) - 1) {
                atomicAdd(&sm.h1.c[0], (u32)__popc(tail));
            }
            if (bin > 0) {
                atomicAdd(&sm.h1.c[bin], 1u);
            }
            if (ok) {
                const u64 q = wt.quant(x);
                if (q) {
                    sm.h1.add_q((u32)bin, q);
                }
            }
        }
    }
    __syncthreads();
}

// A refinement level: elements of level-1 bin b1 with key in [klo, khi] into bins (key - klo) >>
// shift; on the last level (shift 0, one key per bin) also the lowest and highest id of each bin.
__device__ void hist_level(const float4 *w4, int n4, int b1, u32 klo, u32 khi, int shift, bool track,
                           const Weights &wt, Shared &sm)
{
    const int tid = threadIdx.x;
    __syncthreads();
    for (int i = tid; i < kBins; i += kBlock) {
        sm.h.clear(i);
        sm.lo[i] = INT_MAX;
        sm.hi[i] = -1;
    }
    __syncthreads();
    const u32 span = khi - klo;
    for (int i4 = tid; i4 < n4; i4 += kBlock) {
        const float4 v4 = w4[i4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float x = f4_get(v4, k);
            const u32 d = fkey(x) - klo; // wraps for keys below klo
            if (d <= span && x > -INFINITY && wt.lbin(x) == b1) {
                const u32 bin = d >> shift;
                atomicAdd(&sm.h.c[bin], 1u);
                const u64 q = wt.quant(x);
                if (q) {
                    sm.h.add_q(bin, q);
                }
                if (track) {
                    atomicMin(&sm.lo[bin], 4 * i4 + k);
                    atomicMax(&sm.hi[bin], 4 * i4 + k);
                }
            }
        }
    }
    __syncthreads();
}

// Count and fixed-point weight of a whole histogram (every thread gets them).
__device__ void hist_totals(const Hist &h, u32 &n, u64 &q, Shared &sm)
{
    u32 tc = 0;
    u64 tq = 0;
    for (int i = threadIdx.x; i < kBins; i += kBlock) {
        tc += h.c[i];
        tq += h.q(i);
    }
    n = block_reduce(tc, OpSumU32(), 0u, sm.red32);
    q = block_reduce(tq, OpSumU64(), 0ull, sm.red64);
}

// ---- cuts ------------------------------------------------------------------------------------------

struct Cross {
    bool found;
    u32 bin;
    u32 c_above; // elements above the bin (including those above the histogram's range)
    u64 q_above;
};

// The bin, scanning from the top, where the cumulative count reaches lc (SEL_COUNT), or the
// cumulative weight first reaches w (SEL_GE: >= w) or exceeds it (SEL_GT: > w). Cumulative sums
// start at (ac, aq); weights compare as doubles of the exact fixed-point sums, so the sequence is
// monotone and at most one bin matches.
__device__ Cross find_cross(const Hist &h, int mode, u32 ac, u64 aq, u32 lc, double w, Shared &sm)
{
    const int tid = threadIdx.x;
    __syncthreads(); // readers of the previous result are done
    if (tid == 0) {
        sm.cross_found = 0;
    }
    u32 tc = 0;
    u64 tq = 0;
#pragma unroll
    for (int k = 0; k < kPer; k++) {
        const int b = kBins - 1 - (tid * kPer + k);
        tc += h.c[b];
        tq += h.q(b);
    }
    u32 cc;
    u64 qq;
    block_excl_scan(tc, tq, cc, qq, sm);
    cc += ac;
    qq += aq;
#pragma unroll
    for (int k = 0; k < kPer; k++) {
        const int b = kBins - 1 - (tid * kPer + k);
        const u32 nc = cc + h.c[b];
        const u64 nq = qq + h.q(b);
        bool hit;
        if (mode == SEL_COUNT) {
            hit = cc < lc && lc <= nc;
        } else if (mode == SEL_GE) {
            hit = (double)qq < w && w <= (double)nq;
        } else {
            hit = (double)qq <= w && w < (double)nq;
        }
        if (hit) {
            sm.cross_found = 1;
            sm.cross_bin = (u32)b;
            sm.cross_c = cc;
            sm.cross_q = qq;
        }
        cc = nc;
        qq = nq;
    }
    __syncthreads();
    return {sm.cross_found != 0, sm.cross_bin, sm.cross_c, sm.cross_q};
}

// A prefix of the sorted candidates: everything with key > key (c_gt elements, weight q_gt) and the
// j lowest ids of the c_eq elements with this key (weight q_each each).
struct Cut {
    bool found;
    u32 key, c_gt, c_eq, j;
    u64 q_gt, q_each;
    int32_t id_lo, id_hi;

    __device__ u32 pos() const { return c_gt + j; }
    __device__ double total() const { return (double)(q_gt + (u64)j * q_each); }
};

__device__ Cut select(int mode, u32 lc, double w, const float4 *w4, int n4, const Weights &wt, Shared &sm)
{
    Cut cut = {};
    Cross x = find_cross(sm.h1, mode, 0, 0, lc, w, sm);
    if (!x.found) {
        return cut;
    }
    // Keys of the level-1 bin: its values lie in (vtop - (kBins - b1) / s1, vtop - (kBins - 1 - b1) /
    // s1], widened for the roundings of lbin; the refinement levels also test lbin, so a range that
    // is too wide only costs levels.
    const int b1 = (int)x.bin;
    const float slack = 1e-5f * (fabsf(wt.vtop) + (float)(kBins - 1) / wt.s1 + 1.0f);
    const float vhi = wt.vtop - (float)(kBins - 1 - b1) / wt.s1 + slack;
    u32 klo = b1 == 0 ? kKeyValid : fkey(wt.vtop - (float)(kBins - b1) / wt.s1 - slack);
    u32 khi = b1 == kBins - 1 ? kFull : fkey(vhi);
    klo = klo < kKeyValid ? kKeyValid : klo;
    u32 ac = x.c_above;
    u64 aq = x.q_above;
    for (;;) {
        const u32 span = khi - klo;
        const int shift = span < (u32)kBins ? 0 : (32 - __clz(span)) - 11;
        hist_level(w4, n4, b1, klo, khi, shift, shift == 0, wt, sm);
        x = find_cross(sm.h, mode, ac, aq, lc, w, sm);
        if (!x.found) {
            return cut;
        }
        ac = x.c_above;
        aq = x.q_above;
        const u32 nlo = klo + (x.bin << shift);
        if (shift == 0) {
            cut.found = true;
            cut.key = nlo;
            cut.c_gt = ac;
            cut.q_gt = aq;
            cut.c_eq = sm.h.c[x.bin];
            cut.q_each = sm.h.q((int)x.bin) / cut.c_eq;
            cut.id_lo = sm.lo[x.bin];
            cut.id_hi = sm.hi[x.bin];
            if (mode == SEL_COUNT) {
                cut.j = lc - ac;
            } else { // smallest j whose prefix reaches (SEL_GE) or exceeds (SEL_GT) w; j = c_eq does
                u32 a = 1, b = cut.c_eq;
                while (a < b) {
                    const u32 m = a + (b - a) / 2;
                    const double s = (double)(aq + (u64)m * cut.q_each);
                    if (mode == SEL_GE ? s >= w : s > w) {
                        b = m;
                    } else {
                        a = m + 1;
                    }
                }
                cut.j = a;
            }
            return cut;
        }
        const u64 top = (u64)nlo + ((1ull << shift) - 1);
        khi = top < (u64)khi ? (u32)top : khi;
        klo = nlo;
    }
}

// The j-th lowest id (1-based) among the elements with this key. Each warp counts its contiguous
// segment; the warp holding the j-th walks its segment in id order.
__device__ int32_t nth_id(u32 key, u32 j, const float4 *w4, int n4, Shared &sm)
{
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int seg = (n4 + kWarps - 1) / kWarps;
    const int b0 = min(n4, wid * seg), b1 = min(n4, b0 + seg);
    u32 cnt = 0;
    for (int i4 = b0 + lane; i4 < b1; i4 += 32) {
        const float4 v4 = w4[i4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            cnt += fkey(f4_get(v4, k)) == key;
        }
    }
    cnt = __reduce_add_sync(kFull, cnt);
    __syncthreads();
    if (lane == 0) {
        sm.nth_cnt[wid] = cnt;
    }
    if (tid == 0) {
        sm.nth_id = -1;
    }
    __syncthreads();
    u32 before = 0;
    int target = -1;
    for (int w = 0; w < kWarps; w++) {
        const u32 cw = sm.nth_cnt[w];
        if (j <= before + cw) {
            target = w;
            break;
        }
        before += cw;
    }
    if (wid == target) {
        u32 rank = j - before; // 1-based within this warp's segment
        for (int base = b0; base < b1; base += 32) {
            const int i4 = base + lane;
            u32 m = 0, bits = 0;
            if (i4 < b1) {
                const float4 v4 = w4[i4];
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    if (fkey(f4_get(v4, k)) == key) {
                        bits |= 1u << k;
                        m++;
                    }
                }
            }
            u32 inc = m;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 t = __shfl_up_sync(kFull, inc, o);
                if (lane >= o) {
                    inc += t;
                }
            }
            const u32 tot = __shfl_sync(kFull, inc, 31);
            if (rank <= tot) {
                if (inc >= rank && inc - m < rank) {
                    u32 need = rank - (inc - m);
                    for (int k = 0; k < 4; k++) {
                        if ((bits >> k) & 1u) {
                            if (--need == 0) {
                                sm.nth_id = 4 * i4 + k;
                                break;
                            }
                        }
                    }
                }
                break;
            }
            rank -= tot;
        }
    }
    __syncthreads();
    return sm.nth_id;
}

__device__ int32_t cut_id(const Cut &c, const float4 *w4, int n4, Shared &sm)
{
    if (c.j == 1) {
        return c.id_lo;
    }
    if (c.j == c.c_eq) {
        return c.id_hi;
    }
    const int32_t id = nth_id(c.key, c.j, w4, n4, sm);
    return id >= 0 ? id : c.id_lo;
}

// Elements whose weight is >= min_p (the host compares exp(...) >= min_p in double). Only
// arguments within 1e-9 of log(min_p) need the exponential.
__device__ u32 count_min_p(const float4 *w4, int n4, float min_p, const Weights &wt, Shared &sm)
{
    const double lmp = log((double)min_p);
    u32 cnt = 0;
    for (int i4 = threadIdx.x; i4 < n4; i4 += kBlock) {
        const float4 v4 = w4[i4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float x = f4_get(v4, k);
            if (x == -INFINITY) {
                continue;
            }
            const double a = wt.arg(x);
            if (a > lmp + 1e-9) {
                cnt++;
            } else if (a >= lmp - 1e-9 && wt.weight(x) >= (double)min_p) {
                cnt++;
            }
        }
    }
    return block_reduce(cnt, OpSumU32(), 0u, sm.red32);
}

// ---- top-n log-probabilities -----------------------------------------------------------------------

// Sorts one value per lane, descending across the warp (bitonic).
__device__ __forceinline__ u64 warp_sort_desc(u64 v)
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
            const u64 o = __shfl_xor_sync(kFull, v, j);
            const bool keep_max = ((lane & k) == 0) == ((lane & j) == 0);
            v = keep_max ? (v > o ? v : o) : (v < o ? v : o);
        }
    }
    return v;
}

// Sorts a bitonic sequence (one value per lane) descending.
__device__ __forceinline__ u64 warp_merge_desc(u64 v)
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 16; j > 0; j >>= 1) {
        const u64 o = __shfl_xor_sync(kFull, v, j);
        v = (lane & j) == 0 ? (v > o ? v : o) : (v < o ? v : o);
    }
    return v;
}

// The n_top largest lp = logits - lse, lowest id first on equal lp (kr_top_k_ids). Keys are
// (key(lp) << 32 | ~id), unique per element, so "larger key" is exactly that order. Each warp keeps
// its 32 best sorted across its lanes and merges a batch of 32 only when one of them beats the
// worst; warp 0 then merges the warps' lists.
__device__ void top_n(const float *lrow, const u32 *mrow, int vocab, float lse, int n_top, int32_t *ids, float *lps,
                      Shared &sm)
{
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    u64 list = 0, worst = 0;
    for (int base = wid * 32; base < vocab; base += 4 * kBlock) { // same trip count within a warp
        float xs[4]; // four loads in flight per lane
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = base + u * kBlock + lane;
            xs[u] = i < vocab ? lrow[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = base + u * kBlock + lane;
            if (mrow != nullptr && i < vocab && !allows(mrow, i)) {
                xs[u] = -INFINITY;
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = base + u * kBlock + lane;
            u64 key = 0;
            if (i < vocab) {
                const float x = xs[u];
                const u32 k = x == x ? fkey(canon(__fsub_rn(x, lse))) : 0u;
                key = ((u64)k << 32) | (u64)(~(u32)i);
            }
            if (__ballot_sync(kFull, key > worst) == 0) {
                continue;
            }
            key = warp_sort_desc(key);
            const u64 other = __shfl_sync(kFull, key, 31 - lane);
            list = warp_merge_desc(list > other ? list : other);
            worst = __shfl_sync(kFull, list, 31);
        }
    }
    __syncthreads();
    sm.cand[wid * 32 + lane] = list;
    __syncthreads();
    if (wid == 0) {
        u64 acc = sm.cand[lane];
        for (int w = 1; w < kWarps; w++) {
            const u64 other = sm.cand[w * 32 + 31 - lane];
            acc = warp_merge_desc(acc > other ? acc : other);
        }
        if (lane < n_top) {
            const int32_t id = (int32_t)~(u32)acc;
            ids[lane] = id;
            lps[lane] = __fsub_rn(masked_logit(lrow, mrow, id), lse);
        }
    }
}

// ---- kernels ---------------------------------------------------------------------------------------

// The allowed-token bitmask of row r, nullptr when it has none (or its range is bad: prep_kernel
// refuses such a row).
__device__ __forceinline__ const u32 *row_mask(const krk_sample_params &p, const krk_sample_row &r, int nbm)
{
    if (p.mask == nullptr || r.mask_off < 0 || (int64_t)r.mask_off + nbm > p.n_mask) {
        return nullptr;
    }
    return p.mask + r.mask_off;
}

// Per-row results of the first kernel, after the processed rows in the workspace.
struct RowStat {
    float vmax;    // maximum processed logit (sampling rows)
    float lse;     // log-sum-exp of the raw logits (when log-probabilities are wanted)
    int32_t mode;  // RowMode
    int32_t pad;
};

__device__ __forceinline__ RowStat *row_stats(const Args &a)
{
    return reinterpret_cast<RowStat *>(reinterpret_cast<float *>(a.workspace) + a.p.n * a.vp);
}

__device__ __forceinline__ u64 greedy_key(float v, int i)
{
    return ((u64)fkey(v) << 32) | (u64)(~(u32)i); // larger value first, then lower id
}

// Host penalty formulas (kr_sample), with the same float roundings (no contraction).
__device__ __forceinline__ float penalize(float x, int32_t cnt, uint8_t flags, const krk_sample_row &r)
{
    if (r.repetition != 1.0f && ((flags & 1u) || cnt != 0)) {
        x = x > 0.0f ? __fdiv_rn(x, r.repetition) : __fmul_rn(x, r.repetition);
    }
    if (cnt != 0) {
        x = __fsub_rn(x, __fadd_rn(__fmul_rn(r.frequency, (float)cnt), r.presence));
    }
    return x;
}

__device__ __forceinline__ bool finitef(float x)
{
    return x - x == 0.0f;
}

// Kernel 1: validates the row, applies penalties and masks into the workspace row, and finishes
// greedy rows, invalid rows and rows with every logit masked.
__global__ void __launch_bounds__(kBlock, 1) prep_kernel(const Args a)
{
    krk::kernel_prologue();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Shared &sm = *reinterpret_cast<Shared *>(smem_raw);
    u32 *bm = reinterpret_cast<u32 *>(smem_raw + sizeof(Shared));

    const krk_sample_params &p = a.p;
    const int tid = threadIdx.x;
    const int64_t row = blockIdx.x;
    const int vocab = (int)p.vocab;
    const float *lrow = p.logits + row * p.ld;
    float *wrow = reinterpret_cast<float *>(a.workspace) + row * a.vp;
    const krk_sample_row r = p.rows[row];
    const bool want_lp = p.out_logprob != nullptr || p.n_top > 0;

    // Row parameters live on the device: an invalid row is answered with -1, never a crash.
    int mode = r.temperature == 0.0f ? ROW_GREEDY : ROW_SAMPLE;
    if (!(r.temperature >= 0.0f) || !finitef(r.temperature) || !(r.top_p > 0.0f && r.top_p <= 1.0f) ||
        !(r.min_p >= 0.0f && r.min_p <= 1.0f) || !(r.repetition > 0.0f) || !finitef(r.repetition) ||
        !finitef(r.presence) || !finitef(r.frequency) || r.pen_off < 0 || r.pen_n < 0 ||
        (int64_t)r.pen_off + r.pen_n > p.n_pen || (mode == ROW_SAMPLE && !(r.u >= 0.0 && r.u < 1.0)) ||
        (p.mask != nullptr && r.mask_off >= 0 && (int64_t)r.mask_off + a.nbm > p.n_mask)) {
        mode = ROW_BAD;
    }
    const u32 *mrow = mode == ROW_BAD ? nullptr : row_mask(p, r, a.nbm);
    const int pen_n = mode == ROW_BAD ? 0 : r.pen_n;
    const int64_t pen_off = r.pen_off;

    // A: bitmap of the ids that have entries (their processed value comes from the entries).
    if (pen_n > 0) {
        for (int i = tid; i < a.nbm; i += kBlock) {
            bm[i] = 0;
        }
        __syncthreads();
        for (int e = tid; e < pen_n; e += kBlock) {
            const int32_t id = p.pen_ids[pen_off + e];
            if (id >= 0 && id < vocab) {
                atomicOr(&bm[id >> 5], 1u << (id & 31));
            }
        }
        __syncthreads();
    }

    // B: one pass over the raw logits: log-sum-exp, workspace copy, maximum / argmax of the rest.
    float vmax = -INFINITY;
    u64 gbest = 0;
    Lse ls = {-INFINITY, 0.0};
    const int vp = (int)a.vp;
    // kPrepLoads loads in flight per thread: one block reads the whole row (a 131072-entry row in 8
    // rounds of memory latency instead of 32 with four)
    const bool plain_greedy = mode == ROW_GREEDY && pen_n == 0 && !want_lp;
    if (plain_greedy) {
        // the argmax alone (the common greedy row): a float compare per logit. A thread's first
        // strictly larger value wins, which keeps its lowest id among equal values (-0 equals +0)
        // and never takes a NaN; its key then enters the block's maximum as in the loop below.
        float best = -INFINITY;
        int besti = tid < vocab ? tid : -1;
        for (int base = 0; base < vocab; base += kPrepLoads * kBlock) {
            float xs[kPrepLoads];
#pragma unroll
            for (int u = 0; u < kPrepLoads; u++) {
                const int i = base + u * kBlock + tid;
                xs[u] = i < vocab ? lrow[i] : -INFINITY;
            }
            if (mrow != nullptr) {
#pragma unroll
                for (int u = 0; u < kPrepLoads; u++) {
                    const int i = base + u * kBlock + tid;
                    if (i < vocab && !allows(mrow, i)) {
                        xs[u] = -INFINITY;
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < kPrepLoads; u++) {
                if (xs[u] > best) {
                    best = xs[u];
                    besti = base + u * kBlock + tid;
                }
            }
        }
        gbest = besti >= 0 ? greedy_key(canon(best), besti) : 0;
    }
    for (int base = 0; !plain_greedy && base < vp; base += kPrepLoads * kBlock) {
        float xs[kPrepLoads];
#pragma unroll
        for (int u = 0; u < kPrepLoads; u++) {
            const int i = base + u * kBlock + tid;
            xs[u] = i < vocab ? lrow[i] : -INFINITY;
        }
        if (mrow != nullptr) {
#pragma unroll
            for (int u = 0; u < kPrepLoads; u++) {
                const int i = base + u * kBlock + tid;
                if (i < vocab && !allows(mrow, i)) {
                    xs[u] = -INFINITY;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < kPrepLoads; u++) {
            const int i = base + u * kBlock + tid;
            const float x = xs[u];
            if (want_lp) {
                if (x > ls.m) {
                    ls.s = ls.s * exp((double)ls.m - (double)x) + 1.0;
                    ls.m = x;
                } else if (x > -INFINITY) {
                    ls.s += exp((double)x - (double)ls.m);
                }
            }
            const bool marked = pen_n > 0 && i < vocab && ((bm[i >> 5] >> (i & 31)) & 1u);
            if (mode == ROW_BAD || marked || i >= vp) {
                continue;
            }
            const float v = canon(x);
            if (mode == ROW_GREEDY) {
                if (i < vocab) {
                    const u64 g = greedy_key(v, i);
                    gbest = g > gbest ? g : gbest;
                }
            } else {
                wrow[i] = v;
                vmax = fmaxf(vmax, v);
            }
        }
    }

    // C: entries. Penalties first, then masks (an id may carry both), then read back.
    if (pen_n > 0) {
        for (int e = tid; e < pen_n; e += kBlock) {
            const int32_t id = p.pen_ids[pen_off + e];
            const uint8_t fl = p.pen_flags[pen_off + e];
            if (id >= 0 && id < vocab && !(fl & 2u)) {
                wrow[id] = canon(penalize(masked_logit(lrow, mrow, id), p.pen_count[pen_off + e], fl, r));
            }
        }
        __syncthreads();
        for (int e = tid; e < pen_n; e += kBlock) {
            const int32_t id = p.pen_ids[pen_off + e];
            if (id >= 0 && id < vocab && (p.pen_flags[pen_off + e] & 2u)) {
                wrow[id] = -INFINITY;
            }
        }
        __syncthreads();
        for (int e = tid; e < pen_n; e += kBlock) {
            const int32_t id = p.pen_ids[pen_off + e];
            if (id >= 0 && id < vocab) {
                const float v = wrow[id];
                vmax = fmaxf(vmax, v);
                const u64 g = greedy_key(v, id);
                gbest = g > gbest ? g : gbest;
            }
        }
    }

    float lse = NAN;
    if (want_lp) {
        const Lse t = block_lse(ls, sm);
        lse = (float)((double)t.m + log(t.s));
    }
    int32_t chosen = -1;
    bool done = true;
    if (mode == ROW_GREEDY) {
        gbest = block_reduce(gbest, OpMaxU64(), 0ull, sm.red64);
        chosen = (int32_t)~(u32)gbest;
    } else if (mode == ROW_SAMPLE) {
        vmax = block_reduce(vmax, OpMaxF(), -INFINITY, sm.redf);
        done = !(vmax > -INFINITY); // every logit masked: kr_sample fails (KR_ERR_INTERNAL)
    }
    if (tid == 0) {
        row_stats(a)[row] = {vmax, lse, done ? ROW_BAD : ROW_SAMPLE, 0};
        if (done) {
            p.out[row] = chosen;
            if (p.out_logprob) {
                p.out_logprob[row] = chosen >= 0 ? __fsub_rn(masked_logit(lrow, mrow, chosen), lse) : NAN;
            }
        }
    }
}

// Kernel 2: the cuts and the draw of the sampling rows left by kernel 1.
__global__ void __launch_bounds__(kBlock, 1) draw_kernel(const Args a)
{
    krk::kernel_prologue();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Shared &sm = *reinterpret_cast<Shared *>(smem_raw);

    const krk_sample_params &p = a.p;
    const int64_t row = blockIdx.x;
    const RowStat st = row_stats(a)[row];
    if (st.mode != ROW_SAMPLE) {
        return;
    }
    const float4 *w4 = reinterpret_cast<const float4 *>(reinterpret_cast<const float *>(a.workspace) + row * a.vp);
    const int n4 = (int)(a.vp / 4);
    const krk_sample_row r = p.rows[row];

    Weights wt;
    wt.inv_t = __fdiv_rn(1.0f, r.temperature);
    wt.mx = (double)__fmul_rn(st.vmax, wt.inv_t);
    wt.scale = a.scale;
    wt.arg_min = a.arg_min;
    // Level 1 spans the values whose weights do not quantize to 0: v >= vmax + arg_min / inv_t.
    wt.vtop = st.vmax;
    wt.s1 = fminf((float)(kBins - 1) / (float)(-a.arg_min / (double)wt.inv_t), 1e30f);
    hist_level1(w4, n4, wt, sm);
    u32 n_cand;
    u64 q_all;
    hist_totals(sm.h1, n_cand, q_all, sm);

    // The kept prefix: k_keep elements of weight `total`, ending at cut ck (have_k) or at the last
    // candidate. Stages: 0 top-k, 1 top-p, 2 min-p, 3 the draw, 4 the draw fell past the prefix
    // (rounding): the host then takes the last kept element.
    Cut ck = {}, cd = {};
    bool have_k = false;
    u32 k_keep = n_cand;
    double total = (double)q_all;
    for (int stage = 0; stage < 5; stage++) {
        int mode = SEL_COUNT;
        u32 lc = 0;
        double w = 0.0;
        if (stage == 0) {
            if (!(r.top_k > 0 && (u32)r.top_k < n_cand)) {
                continue;
            }
            lc = (u32)r.top_k;
        } else if (stage == 1) { // smallest prefix whose weight reaches top_p * total
            if (!(r.top_p < 1.0f)) {
                continue;
            }
            mode = SEL_GE;
            w = (double)r.top_p * total;
        } else if (stage == 2) { // the top element and every later one with weight >= min_p
            if (!(r.min_p > 0.0f)) {
                continue;
            }
            const u32 lm = count_min_p(w4, n4, r.min_p, wt, sm);
            lc = lm > 1u ? lm : 1u;
            if (lc >= k_keep) {
                continue;
            }
        } else if (stage == 3) { // first element whose cumulative weight exceeds u * total
            if (have_k && k_keep == 1) {
                cd = ck;
                break;
            }
            mode = SEL_GT;
            w = r.u * total;
        } else {
            if (have_k) {
                cd = ck;
                break;
            }
            lc = k_keep;
        }
        const Cut c = select(mode, lc, w, w4, n4, wt, sm);
        if (stage == 3) {
            if (c.found && c.pos() <= k_keep) {
                cd = c;
                break;
            }
            continue;
        }
        if (stage == 4) {
            cd = c;
            break;
        }
        if (!(c.found && c.pos() < k_keep)) { // top-p may keep everything
            continue;
        }
        ck = c;
        have_k = true;
        k_keep = c.pos();
        total = c.total();
    }
    const int32_t chosen = cd.found ? cut_id(cd, w4, n4, sm) : -1;
    if (threadIdx.x == 0) {
        p.out[row] = chosen;
        if (p.out_logprob) {
            const float x = chosen >= 0 ? masked_logit(p.logits + row * p.ld, row_mask(p, r, a.nbm), chosen) : 0.0f;
            p.out_logprob[row] = chosen >= 0 ? __fsub_rn(x, st.lse) : NAN;
        }
    }
}

// Kernel 3: the n_top largest raw log-probabilities of every row.
__global__ void __launch_bounds__(kBlock, 1) topn_kernel(const Args a)
{
    krk::kernel_prologue();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Shared &sm = *reinterpret_cast<Shared *>(smem_raw);
    const krk_sample_params &p = a.p;
    const int64_t row = blockIdx.x;
    const krk_sample_row r = p.rows[row];
    top_n(p.logits + row * p.ld, row_mask(p, r, a.nbm), (int)p.vocab, row_stats(a)[row].lse, p.n_top,
          p.top_ids + row * p.n_top, p.top_lp + row * p.n_top, sm);
}

int64_t row_len(int64_t vocab)
{
    return (vocab + kRowAlign - 1) / kRowAlign * kRowAlign;
}

} // namespace

extern "C" size_t krk_sample_workspace_bytes(int64_t n, int64_t vocab)
{
    if (n <= 0 || vocab <= 0) {
        return 0;
    }
    return (size_t)n * ((size_t)row_len(vocab) * sizeof(float) + sizeof(RowStat));
}

extern "C" enum kr_status krk_sample(const struct krk_sample_params *p, const struct krk_ctx *ctx)
{
    KRK_REQUIRE(p != nullptr && ctx != nullptr);
    const cudaStream_t stream = ctx->stream;
    KRK_REQUIRE(p->n >= 0 && p->n <= INT32_MAX);
    KRK_REQUIRE(p->vocab >= 1 && p->vocab <= kMaxVocab);
    KRK_REQUIRE(p->ld >= p->vocab);
    KRK_REQUIRE(p->n_top >= 0 && p->n_top <= 20 && p->n_top <= p->vocab);
    KRK_REQUIRE(p->n_pen >= 0);
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->logits != nullptr && p->rows != nullptr && p->out != nullptr && ctx->workspace != nullptr);
    KRK_REQUIRE(p->n_top == 0 || (p->top_ids != nullptr && p->top_lp != nullptr));
    KRK_REQUIRE(p->n_pen == 0 || (p->pen_ids != nullptr && p->pen_count != nullptr && p->pen_flags != nullptr));
    KRK_REQUIRE(p->mask == nullptr || p->n_mask >= 0);
    KRK_REQUIRE(ctx->workspace_bytes >= krk_sample_workspace_bytes(p->n, p->vocab));
    KRK_REQUIRE(((uintptr_t)ctx->workspace & 15) == 0);

    Args a;
    a.p = *p;
    a.workspace = ctx->workspace;
    a.vp = row_len(p->vocab);
    a.nbm = (int)((p->vocab + 31) / 32);
    // Fixed point: weights are <= 2, so a row sums to at most vocab * 2^(S+1) < 2^64 with
    // S = 62 - ceil(log2(vocab)); arguments below -(S + 2) ln 2 give weights that round to 0.
    int lg = 0;
    while ((int64_t(1) << lg) < p->vocab) {
        lg++;
    }
    const int s = 62 - lg;
    a.scale = ldexp(1.0, s);
    a.arg_min = -(double)(s + 2) * 0.69314718055994530942;

    const unsigned grid = (unsigned)p->n;
    const size_t smem_prep = sizeof(Shared) + (size_t)a.nbm * sizeof(u32);
    KRK_CUDA_TRY(cudaFuncSetAttribute(prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_prep));
    krk::launch_maybe_pdl(krk::pdl_enabled(), prep_kernel, grid, kBlock, smem_prep, stream, a);
    KRK_CHECK_LAUNCH();
    KRK_CUDA_TRY(cudaFuncSetAttribute(draw_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sizeof(Shared)));
    krk::launch_maybe_pdl(krk::pdl_enabled(), draw_kernel, grid, kBlock, sizeof(Shared), stream, a);
    KRK_CHECK_LAUNCH();
    if (p->n_top > 0) {
        KRK_CUDA_TRY(cudaFuncSetAttribute(topn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sizeof(Shared)));
        krk::launch_maybe_pdl(krk::pdl_enabled(), topn_kernel, grid, kBlock, sizeof(Shared), stream, a);
        KRK_CHECK_LAUNCH();
    }
    return KR_OK;
}
