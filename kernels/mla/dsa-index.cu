// Lightning indexer + top-k (krk_dsa_index), in two phases per group of tokens:
//  1. dsa_score_kernel: I[t,s] = sum_h w[t,h] relu(iq[t,h] . ik[s]) (without the ReLU when no_relu)
//     for every cached position
//     s <= pos(t), fp32, into the workspace [group, max_ctx]. Grid (key tiles, tokens); a block
//     loads its tile of 32 keys once and scores it against every head of its token.
//  2. dsa_select_kernel: one block per token finds the exact k-th largest score by a 4-pass radix
//     select on order-preserving 32-bit keys (no sort), then writes, in ascending position order,
//     every position scoring above that threshold and the lowest positions scoring equal to it
//     (ties go to the lower position, as in the CPU reference): threads own contiguous runs of
//     positions, placed by two block scans.
// Tokens whose context fits in topk take every position without scoring.
#include "common/fp8-cache.cuh"
#include "common/mma.cuh"
#include "mla/mla-common.cuh"

#include <algorithm>
#include <cmath>

namespace {

constexpr int kScoreThreads = 256; // 8 warps; heads are split across warps
constexpr int kScoreKeys = 32;     // keys per score block: one per lane
constexpr int kSelectThreads = 512;
constexpr int kSelectCache = 4096; // most keys dsa_select_kernel keeps in shared memory (16 KB)
constexpr int64_t kMaxHeadDim = 256; // keeps the score block's key tile within 48 KB of shared memory

// The kernels' argument: the op's parameters with the cache typed (hiding the op's void pointer) and
// the batch.
struct IndexArgs : krk_dsa_index_params {
    const krk_bf16 *cache;
    krk_batch batch;
};

__global__ void __launch_bounds__(kScoreThreads)
    dsa_score_kernel(IndexArgs p, int32_t t0, float *__restrict__ scores, int64_t ld)
{
    krk::kernel_prologue();
    extern __shared__ float sh[];
    const krk_batch &b = p.batch;
    const int32_t t = t0 + (int32_t)blockIdx.y;
    const int32_t seq = b.tok_seq[t];
    const int64_t n_keys = min((int64_t)b.pos[t] + 1, ld);
    const int64_t s0 = (int64_t)blockIdx.x * kScoreKeys;
    // block-uniform exits: padding, contexts that need no score, tiles past the token's position
    if (b.seq_slot[seq] < 0 || n_keys <= p.topk || s0 >= n_keys) {
        return;
    }
    const int64_t hd = p.head_dim, ldk = hd + 1; // padded rows: lanes read distinct banks
    float *keys = sh;                            // [kScoreKeys, hd + 1]
    float *part = sh + kScoreKeys * ldk;         // [n_warp, kScoreKeys] per-warp partial scores
    for (int64_t e = threadIdx.x; e < kScoreKeys * hd; e += kScoreThreads) {
        const int64_t j = e / hd, d = e - j * hd;
        float v = 0.0f;
        if (s0 + j < n_keys) {
            const int64_t off = krk::mla::latent_row_off(b, seq, (int32_t)(s0 + j), p.block_size, p.row);
            if (p.fp8) { // packed key: code * its block's scale, the fp32 value the CPU reference keeps
                const uint8_t *key = reinterpret_cast<const uint8_t *>(p.cache) + off + p.key_off;
                v = krk::e4m3_to_f32(key[d]) * reinterpret_cast<const float *>(key + hd)[d / KRK_FP8_CACHE_BLOCK];
            } else {
                v = krk::bf16_to_f32(p.cache[off + p.key_off + d]);
            }
        }
        keys[j * ldk + d] = v;
    }
    __syncthreads();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int n_warp = kScoreThreads / 32;
    const float *iq = p.iq + (int64_t)t * p.n_head * hd;
    const float *w = p.w + (int64_t)t * p.n_head;
    const float *k = keys + lane * ldk;
    float acc = 0.0f;
    for (int64_t h = warp; h < p.n_head; h += n_warp) {
        const float *q = iq + h * hd; // same address across the warp: a broadcast load
        float d = 0.0f;
        for (int64_t i = 0; i < hd; i++) {
            d = fmaf(__ldg(q + i), k[i], d);
        }
        acc = fmaf(__ldg(w + h), d > 0.0f || p.no_relu ? d : 0.0f, acc);
    }
    part[warp * kScoreKeys + lane] = acc;
    __syncthreads();
    if (warp == 0 && s0 + lane < n_keys) {
        float s = 0.0f;
        for (int i = 0; i < n_warp; i++) {
            s += part[i * kScoreKeys + lane];
        }
        scores[(int64_t)blockIdx.y * ld + s0 + lane] = s;
    }
}

// Tensor-core variant of the scores (KRK_DSA_SCORE_MMA): a block of 4 warps takes KT tiles of 64
// keys of one token; the token's queries [Hi, Di] are rounded to bf16 once per block and kept in
// shared memory, each tile of keys is copied from the paged cache with 16-byte loads, and warp w
// computes heads [16w, 16w + 16) x 64 keys with mma.sync m16n8k16 (bf16 in, fp32 accumulate). Then
// relu, times w[h], summed over the warp's heads by shuffles and over the warps in order. Needs
// Hi a multiple of 16 up to 64, Di a multiple of 16 up to 256, and 16-byte aligned bf16 key rows
// (packed FP8 keys go to dsa_score_kernel).
constexpr int kMmaWarps = 4;
constexpr int kMmaKeys = 64;  // keys per tile
constexpr int kMmaTiles = 8;  // most tiles per block (512 keys): amortizes the query load

__global__ void __launch_bounds__(kMmaWarps * 32)
    dsa_score_mma_kernel(IndexArgs p, int32_t t0, float *__restrict__ scores, int64_t ld, int tiles)
{
    krk::kernel_prologue();
    extern __shared__ __align__(16) uint16_t smu[];
    const krk_batch &b = p.batch;
    const int32_t t = t0 + (int32_t)blockIdx.y;
    const int32_t seq = b.tok_seq[t];
    const int64_t n_keys = min((int64_t)b.pos[t] + 1, ld);
    const int64_t s_begin = (int64_t)blockIdx.x * kMmaKeys * tiles;
    if (b.seq_slot[seq] < 0 || n_keys <= p.topk || s_begin >= n_keys) {
        return; // block-uniform, as in dsa_score_kernel
    }
    const int Hi = (int)p.n_head, Di = (int)p.head_dim, LD = Di + 8; // padded rows: conflict-free fragments
    uint16_t *qs = smu;                    // [Hi][LD] bf16 queries
    uint16_t *ks = qs + Hi * LD;           // [kMmaKeys][LD] bf16 keys of the current tile
    float *ws = reinterpret_cast<float *>(ks + kMmaKeys * LD);  // [Hi] head weights
    float *part = ws + Hi;                 // [kMmaWarps][kMmaKeys] per-warp sums
    const float *iq = p.iq + (int64_t)t * Hi * Di;
    if ((reinterpret_cast<uintptr_t>(iq) & 15) == 0) {
        // 16-byte loads, sixteen in flight per thread (Di % 16 == 0: a vector stays in one head)
#pragma unroll 16
        for (int e4 = threadIdx.x; e4 < Hi * Di / 4; e4 += blockDim.x) {
            const float4 v = reinterpret_cast<const float4 *>(iq)[e4];
            const int h = 4 * e4 / Di, d = 4 * e4 - h * Di;
            *reinterpret_cast<uint2 *>(qs + h * LD + d) =
                make_uint2(krk::pack_bf16(v.x, v.y), krk::pack_bf16(v.z, v.w));
        }
    } else {
#pragma unroll 16
        for (int e = threadIdx.x; e < Hi * Di; e += blockDim.x) {
            const int h = e / Di, d = e - h * Di;
            qs[h * LD + d] = krk::f32_to_bf16(iq[e]);
        }
    }
    for (int h = threadIdx.x; h < Hi; h += blockDim.x) {
        ws[h] = p.w[(int64_t)t * Hi + h];
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q4 = lane & 3;
    const int chunks = Di / 8; // 16-byte chunks per key row
    for (int tile = 0; tile < tiles; tile++) {
        const int64_t s0 = s_begin + (int64_t)tile * kMmaKeys;
        if (s0 >= n_keys) {
            break; // block-uniform
        }
        __syncthreads(); // the previous tile's readers are done (and the queries are in place)
        {   // two threads a key: each finds the key's row once and copies every other 16-byte chunk
            static_assert(kMmaWarps * 32 == 2 * kMmaKeys, "two threads per key of a tile");
            const int j = threadIdx.x >> 1;
            const bool ok = s0 + j < n_keys;
            const krk_bf16 *src =
                ok ? p.cache + krk::mla::latent_row_off(b, seq, (int32_t)(s0 + j), p.block_size, p.row) + p.key_off
                   : p.cache;
#pragma unroll 8
            for (int c = threadIdx.x & 1; c < chunks; c += 2) {
                const uint4 v = ok ? *reinterpret_cast<const uint4 *>(src + c * 8) : make_uint4(0, 0, 0, 0);
                *reinterpret_cast<uint4 *>(ks + j * LD + c * 8) = v;
            }
        }
        __syncthreads();
        float sum[kMmaKeys / 8][2]; // this lane's two key columns of every 8-key n-tile
#pragma unroll
        for (int n = 0; n < kMmaKeys / 8; n++) {
            sum[n][0] = sum[n][1] = 0.0f;
        }
        for (int h0 = warp * 16; h0 < Hi; h0 += kMmaWarps * 16) {
            float acc[kMmaKeys / 8][4];
#pragma unroll
            for (int n = 0; n < kMmaKeys / 8; n++) {
                acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
            }
            for (int k0 = 0; k0 < Di; k0 += 16) {
                uint32_t a[4];
                const uint16_t *qa = qs + (h0 + g) * LD + k0 + 2 * q4;
                a[0] = *reinterpret_cast<const uint32_t *>(qa);
                a[1] = *reinterpret_cast<const uint32_t *>(qa + 8 * LD);
                a[2] = *reinterpret_cast<const uint32_t *>(qa + 8);
                a[3] = *reinterpret_cast<const uint32_t *>(qa + 8 * LD + 8);
#pragma unroll
                for (int n = 0; n < kMmaKeys / 8; n++) {
                    const uint16_t *kb = ks + (n * 8 + g) * LD + k0 + 2 * q4;
                    krk::mma_bf16(acc[n], a, *reinterpret_cast<const uint32_t *>(kb),
                              *reinterpret_cast<const uint32_t *>(kb + 8));
                }
            }
            // rows h0 + g and h0 + g + 8, columns 2 q4 and 2 q4 + 1 of each n-tile
            const float w0 = ws[h0 + g], w1 = ws[h0 + g + 8];
            const float lo = p.no_relu ? -INFINITY : 0.0f; // ReLU, or the products as they are
#pragma unroll
            for (int n = 0; n < kMmaKeys / 8; n++) {
                sum[n][0] += w0 * fmaxf(acc[n][0], lo) + w1 * fmaxf(acc[n][2], lo);
                sum[n][1] += w0 * fmaxf(acc[n][1], lo) + w1 * fmaxf(acc[n][3], lo);
            }
        }
#pragma unroll
        for (int n = 0; n < kMmaKeys / 8; n++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                float v = sum[n][c];
                v += __shfl_xor_sync(0xffffffffu, v, 4);
                v += __shfl_xor_sync(0xffffffffu, v, 8);
                v += __shfl_xor_sync(0xffffffffu, v, 16);
                if (g == 0) {
                    part[warp * kMmaKeys + n * 8 + 2 * q4 + c] = v;
                }
            }
        }
        __syncthreads();
        for (int j = threadIdx.x; j < kMmaKeys; j += blockDim.x) {
            if (s0 + j < n_keys) {
                float v = 0.0f;
                for (int w = 0; w < kMmaWarps; w++) {
                    v += part[w * kMmaKeys + j];
                }
                scores[(int64_t)blockIdx.y * ld + s0 + j] = v;
            }
        }
    }
}

size_t mma_smem_bytes(int64_t n_head, int64_t head_dim)
{
    return (size_t)(n_head + kMmaKeys) * (size_t)(head_dim + 8) * 2 + (size_t)n_head * 4 +
           (size_t)kMmaWarps * kMmaKeys * 4;
}

bool mma_fits(const krk_dsa_index_params *p)
{
    return !p->fp8 && p->n_head % 16 == 0 && p->n_head <= 64 && p->head_dim % 16 == 0 && p->head_dim <= 256 &&
           p->key_off % 8 == 0 && p->row % 8 == 0 && ((uintptr_t)p->cache & 15) == 0 &&
           mma_smem_bytes(p->n_head, p->head_dim) <= 48 * 1024;
}

// Order-preserving map of a float to uint32 (a > b as floats iff key(a) > key(b)); -0 maps as +0
// so that the two zeros tie, as they compare equal in the reference.
__device__ __forceinline__ uint32_t order_key(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u << 1) == 0) {
        u = 0;
    }
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum of v over the block (blockDim.x a multiple of 32); *total gets the sum.
// `sh` is __shared__ int[32]. Contains __syncthreads: call from every thread.
__device__ __forceinline__ int block_excl_scan(int v, int *sh, int *total)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) {
            x += y;
        }
    }
    if (lane == 31) {
        sh[wid] = x;
    }
    __syncthreads();
    if (wid == 0) {
        int ws = lane < nw ? sh[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, ws, o);
            if (lane >= o) {
                ws += y;
            }
        }
        sh[lane] = ws; // inclusive scan of the warp totals
    }
    __syncthreads();
    const int before = wid > 0 ? sh[wid - 1] : 0;
    *total = sh[nw - 1];
    __syncthreads(); // sh may be reused by the next call
    return before + x - v;
}

// ---- top-k --------------------------------------------------------------------------------

// The k largest of n >= k items (order keys key(i); ties to the lower i) in ascending i:
// emit(o, i) for o = 0..k-1. A radix select of the k-th largest key, 8 bits per pass from the top
// (after the passes `prefix` is that key and `remaining` the number of items equal to it to take),
// then the write-out: each thread owns a contiguous run of items and takes those greater than the
// threshold, and those equal to it while the equal ones before (in earlier runs, then in its own)
// number fewer than `remaining`; two block scans place the runs. Histograms take one shared atomic
// per key; the bin is found by one warp's scan of the 256 counts (a thread walking them one by one
// took ~4 us a pass). Block of kSelectThreads; call from every thread.
struct TopkSmem {
    int hist[256];
    int scan[32];
    uint32_t sel_prefix;
    int sel_remaining;
};
template <class Key, class Emit>
__device__ void block_topk(int32_t n, int32_t k, Key key, Emit emit, TopkSmem &sm)
{
    const int lane = threadIdx.x & 31;
    uint32_t prefix = 0, mask = 0;
    int remaining = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += kSelectThreads) {
            sm.hist[i] = 0;
        }
        __syncthreads();
        for (int32_t i = threadIdx.x; i < n; i += kSelectThreads) {
            const uint32_t kv = key(i);
            if ((kv & mask) == prefix) {
                atomicAdd(&sm.hist[(kv >> shift) & 255u], 1);
            }
        }
        __syncthreads();
        // the bin holding the remaining-th largest key, from the largest; bin 0 takes the rest
        if (threadIdx.x < 32) {
            // lane j holds bins 255 - 8j down to 248 - 8j; the first lane (from the top) whose
            // running count reaches `remaining` holds the bin, found within its eight
            const int hi = 255 - 8 * lane;
            int own = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                own += sm.hist[hi - i];
            }
            int cum = own;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, cum, o);
                cum += lane >= o ? y : 0;
            }
            const unsigned reach = __ballot_sync(0xffffffffu, cum >= remaining);
            const int found = reach ? __ffs(reach) - 1 : 31; // none: bin 0 takes the rest
            if (lane == found) {
                int before = cum - own, bin = hi;
                for (int i = 0; i < 8; i++) {
                    bin = hi - i;
                    if (bin == 0 || before + sm.hist[bin] >= remaining) {
                        break;
                    }
                    before += sm.hist[bin];
                }
                sm.sel_prefix = prefix | ((uint32_t)bin << shift);
                sm.sel_remaining = remaining - before;
            }
        }
        __syncthreads();
        prefix = sm.sel_prefix;
        remaining = sm.sel_remaining;
        mask |= 255u << shift;
        // no barrier needed here: sel_* are rewritten only after the next pass's barriers
    }
    const int32_t per = (n + kSelectThreads - 1) / kSelectThreads;
    const int32_t i0 = min((int32_t)threadIdx.x * per, n), i1 = min(i0 + per, n);
    int eq_c = 0, gt_c = 0;
    for (int32_t i = i0; i < i1; i++) {
        const uint32_t kv = key(i);
        eq_c += kv == prefix;
        gt_c += kv > prefix;
    }
    int tot;
    const int eq_before = block_excl_scan(eq_c, sm.scan, &tot);
    const int take_eq = min(max(remaining - eq_before, 0), eq_c);
    int o = block_excl_scan(gt_c + take_eq, sm.scan, &tot);
    for (int32_t i = i0, taken = 0; i < i1; i++) {
        const uint32_t kv = key(i);
        if (kv > prefix || (kv == prefix && taken < take_eq)) {
            taken += kv == prefix;
            emit(o++, i);
        }
    }
}

// Token t's visible positions (none for padding) into *n_keys; when they fit in topk, writes them
// all, then -1, to out and returns true (the block is done). Call from every thread.
__device__ __forceinline__ bool take_all_positions(const IndexArgs &p, int32_t t, int64_t ld,
                                                   int32_t *out, int32_t *n_keys)
{
    const krk_batch &b = p.batch;
    const int32_t seq = b.tok_seq[t];
    *n_keys = b.seq_slot[seq] < 0 ? 0 : (int32_t)min((int64_t)b.pos[t] + 1, ld);
    if (*n_keys > p.topk) {
        return false;
    }
    for (int32_t j = threadIdx.x; j < p.topk; j += kSelectThreads) {
        out[j] = j < *n_keys ? j : -1;
    }
    return true;
}

// One block per token: every visible position when the context fits in topk (none for padding),
// then -1; otherwise the top-k of its scores.
__global__ void __launch_bounds__(kSelectThreads)
    dsa_select_kernel(IndexArgs p, int32_t t0, const float *__restrict__ scores, int64_t ld)
{
    krk::kernel_prologue();
    __shared__ TopkSmem sm;
    const int32_t t = t0 + (int32_t)blockIdx.x, k = p.topk;
    int32_t *out = p.idx + (int64_t)t * k;
    int32_t n_keys;
    if (take_all_positions(p, t, ld, out, &n_keys)) {
        return;
    }
    const float *sc = scores + (int64_t)blockIdx.x * ld;
    if (n_keys <= kSelectCache) {
        // short contexts: the keys go to shared memory once (all loads in flight together) instead
        // of being read from memory by each of the radix passes and the write-out
        __shared__ uint32_t kc[kSelectCache];
#pragma unroll 8
        for (int32_t i = threadIdx.x; i < n_keys; i += kSelectThreads) {
            kc[i] = order_key(sc[i]);
        }
        __syncthreads();
        block_topk(n_keys, k, [&](int32_t i) { return kc[i]; }, [&](int o, int32_t i) { out[o] = i; }, sm);
        return;
    }
    block_topk(n_keys, k, [&](int32_t i) { return order_key(sc[i]); }, [&](int o, int32_t i) { out[o] = i; }, sm);
}

} // namespace

// Scores of a token take one fp32 row of max_ctx; the launcher processes tokens in groups of as many
// rows as the workspace holds (at least one score row, 4 * max_ctx bytes, is needed when max_ctx >
// topk; none otherwise).
extern "C" size_t krk_dsa_index_workspace_bytes(int64_t n_tok, int64_t max_ctx)
{
    if (n_tok <= 0 || max_ctx <= 0) {
        return 0;
    }
    return (size_t)n_tok * (size_t)max_ctx * sizeof(float);
}

extern "C" enum kr_status krk_dsa_index(const struct krk_dsa_index_params *p, const struct krk_ctx *ctx)
{
    KRK_REQUIRE(p != nullptr && ctx != nullptr);
    const krk_batch &b = ctx->batch;
    const cudaStream_t stream = ctx->stream;
    KRK_REQUIRE(b.n_tok >= 0);
    if (b.n_tok == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->idx && p->topk > 0);
    KRK_REQUIRE(krk::mla::paged_batch_ok(b));
    KRK_REQUIRE(b.max_ctx > 0); // sizes the score grid and the workspace rows
    KRK_REQUIRE_MSG(krk::mla::paged_ctx_ok(b, p->block_size),
                    "dsa index: contexts up to %d positions, but block tables of %d blocks of %d hold %lld",
                    b.max_ctx, b.max_blocks, p->block_size, (long long)b.max_blocks * p->block_size);
    const int64_t ld = b.max_ctx;
    const bool need_scores = ld > p->topk; // otherwise every token takes all its positions
    int64_t group = b.n_tok;
    if (need_scores) {
        KRK_REQUIRE(p->iq && p->w && p->cache);
        KRK_REQUIRE(p->n_head > 0 && p->head_dim > 0);
        KRK_REQUIRE_MSG(p->head_dim <= kMaxHeadDim, "dsa index: index head_dim %lld, at most %lld",
                        (long long)p->head_dim, (long long)kMaxHeadDim);
        KRK_REQUIRE(p->key_off >= 0 && p->row >= p->key_off + p->head_dim && p->block_size > 0);
        KRK_REQUIRE_MSG(!p->fp8 || (p->key_off % 4 == 0 && p->row % 4 == 0 && p->head_dim % 4 == 0 &&
                                    p->row >= p->key_off + krk_fp8_key_bytes(p->head_dim) &&
                                    (p->head_dim <= KRK_FP8_CACHE_BLOCK || p->head_dim % KRK_FP8_CACHE_BLOCK == 0) &&
                                    ((uintptr_t)p->cache & 3) == 0),
                        "dsa index: FP8 keys need 4-byte aligned rows (row %lld, key_off %lld) holding head_dim %lld "
                        "codes and their scales", (long long)p->row, (long long)p->key_off, (long long)p->head_dim);
        KRK_REQUIRE(ctx->workspace && (uintptr_t)ctx->workspace % alignof(float) == 0);
        group = (int64_t)(ctx->workspace_bytes / ((size_t)ld * sizeof(float)));
        KRK_REQUIRE_MSG(group >= 1, "dsa index: a workspace of %zu bytes holds no score row of a %d-position context "
                        "(%zu bytes)", ctx->workspace_bytes, b.max_ctx, (size_t)ld * sizeof(float));
        group = std::min(group, (int64_t)b.n_tok);
        group = std::min(group, (int64_t)65535); // gridDim.y limit of the score kernel
    }
    float *scores = need_scores ? static_cast<float *>(ctx->workspace) : nullptr;
    IndexArgs args;
    static_cast<krk_dsa_index_params &>(args) = *p;
    args.cache = static_cast<const krk_bf16 *>(p->cache);
    args.batch = b;
    const int64_t tiles = (ld + kScoreKeys - 1) / kScoreKeys;
    const size_t score_smem =
        ((size_t)kScoreKeys * (size_t)(p->head_dim + 1) + (size_t)(kScoreThreads / 32) * kScoreKeys) * sizeof(float);
    // (profiling) events around the two phases of the first group
    auto mark = [&](int64_t t0, int k) {
        if (ctx->events && t0 == 0) {
            cudaEventRecord(ctx->events[k], stream);
        }
    };
    for (int64_t t0 = 0; t0 < b.n_tok; t0 += group) {
        const int64_t g = std::min(group, (int64_t)b.n_tok - t0);
        mark(t0, 0);
        if (need_scores && ctx->dsa_score == KRK_DSA_SCORE_MMA && mma_fits(p)) {
            // tiles per block: kMmaTiles, fewer when the grid would not give every SM two blocks
            // (short contexts, few tokens), at least one
            const int64_t key_tiles = (ld + kMmaKeys - 1) / kMmaKeys;
            const int64_t want = std::max((int64_t)1, 2 * (int64_t)krk_device_sm_count() / g);
            const int tiles = (int)std::max((int64_t)1, std::min((int64_t)kMmaTiles, key_tiles / want));
            const int64_t blocks = (key_tiles + tiles - 1) / tiles;
            krk::launch_maybe_pdl(krk::pdl_enabled(), dsa_score_mma_kernel, dim3((unsigned)blocks, (unsigned)g),
                                  kMmaWarps * 32, mma_smem_bytes(p->n_head, p->head_dim), stream, args, (int32_t)t0,
                                  scores, ld, tiles);
            KRK_CHECK_LAUNCH();
        } else if (need_scores) {
            krk::launch_maybe_pdl(krk::pdl_enabled(), dsa_score_kernel, dim3((unsigned)tiles, (unsigned)g),
                                  kScoreThreads, score_smem, stream, args, (int32_t)t0, scores, ld);
            KRK_CHECK_LAUNCH();
        }
        mark(t0, 1);
        mark(t0, 2);
        krk::launch_maybe_pdl(krk::pdl_enabled(), dsa_select_kernel, (unsigned)g, kSelectThreads, 0, stream, args,
                              (int32_t)t0, scores, ld);
        mark(t0, 3);
        KRK_CHECK_LAUNCH();
    }
    return KR_OK;
}
