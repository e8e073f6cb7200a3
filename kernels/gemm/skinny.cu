// Skinny products on tensor cores (krk_skinny): 1..128 activation rows against bf16 weights, bound
// by streaming each weight once. The decode step of two to eight sequences (plain mode), and under
// --batch-invariant the decode rows of servers of up to 16 sequences, in passes of up to 128 rows.
//
// Roles: x (bf16, the tokens) is the mma's A operand (MT m16 x k16 tiles of 16 tokens, MT = 1, 2, 4
// or 8 by n: rows past n are zeros), the weight
// its B operand (k16 x n8: eight weight rows, each a row of W as stored). A work item is R weight
// rows (a tile: 32, 64 or 128 by configuration) by 256 columns (an iteration). The tiles of every
// part, in order, times the column iterations of a tile make one sequence of iterations that is cut
// into equal contiguous ranges, one per block (stream-K), the blocks being resident at once (one
// or two per SM): every block streams the same number of bytes whatever the shape, and its copy
// pipeline runs on across tile boundaries. The 8 warps split a tile as R / 16 row groups times
// 8 / (R / 16) column splits, whose sums are added in a fixed order at the end of a segment.
//
// Pipeline: S stages of shared memory, each one iteration's weight tile (R rows x 512 bytes) and x
// tile (16 MT rows x 512 bytes), filled with cp.async S - 1 iterations ahead; warp w copies rows
// w, w + 8, ..., so each copy instruction reads 512 contiguous bytes of one row (whole rows per
// request matter: tiles of 128 rows x 128 bytes streamed at 2.1-2.8 TB/s, these at 3-4.3). 16-byte
// chunks are stored XOR-swizzled (chunk c of row r at c ^ (r % 8)) so that the 8 rows an ldmatrix
// phase reads hit distinct banks. The first S - 1 weight tiles are requested before the
// programmatic-launch wait (weights are written by no kernel); x only after it.
//
// Results: a block that covers all columns of a tile writes y (+ bias, + activation) from its
// accumulators. Otherwise each block that has a segment of the tile writes its partial sums to the
// workspace (two slots per block: its first tile and its last) and, after its loop, counts itself
// in on the tile's counter; the last to arrive adds the partials in block order (the order of the
// columns, fixed by the shape and the grid: results do not depend on timing, nor a token's on the
// other rows of x), writes y and sets the counter back to zero for the next product.
//
// A token's sum is the same whatever MT: the mma adds the same k16 products of its row in the same
// order, the cut of the iterations over blocks and the column splits depend only on the shape, R
// and the grid (not on MT, nor on the stages, which only set how far the copies run ahead), and
// the partials are added in block order. So a row's bits do not depend on n from 1 to 128, and a
// caller taking every product of a weight through configuration 0 in passes of at most 128 rows
// gets results that do not depend on the row count at all (--batch-invariant).
#include "common/mma.cuh"
#include "common/util.cuh"
#include "norm/act.cuh"

#include <atomic>

namespace krk {
namespace {

constexpr int kSkWarps = 8;
constexpr int kSkThreads = kSkWarps * 32;
constexpr int kSkMaxRows = 128; // largest tile of any configuration

struct sk_cfg {
    int rows;   // weight rows of a tile (16 per row group of warps)
    int stages; // with one 16-token tile of x (MT = 1)
    int per_sm; // resident blocks per SM (the grid is this many per SM)
    int max_mt; // most 16-token tiles of x a pass takes (n <= 16 max_mt)
};
// 0 is the default; the others are alternatives measured by bench_gemv (up to 16 rows).
constexpr sk_cfg kSkCfg[KRK_SKINNY_CONFIGS] = {{64, 5, 1, 8}, {32, 4, 2, 1}, {64, 4, 1, 1}, {128, 3, 1, 1}};
static_assert(kSkCfg[0].max_mt * 16 == KRK_SKINNY_MAX_N, "configuration 0 takes KRK_SKINNY_MAX_N rows");

// Stages of configuration C with MT tiles of x: its own count at MT = 1, else as many as fit 192 KB
// (configuration 0: 4 at MT = 2, 3 at MT = 4, 2 at MT = 8).
__host__ __device__ constexpr int sk_stages(int c, int mt)
{
    return mt == 1 ? kSkCfg[c].stages : (192 * 1024) / ((kSkCfg[c].rows + 16 * mt) * 512);
}

__host__ __device__ constexpr int64_t sk_div_up(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

// Partial-sum slots of the largest grid of any configuration: [grid][2][16 max_mt][rows of its tile]
inline size_t sk_part_bytes()
{
    size_t m = 0;
    for (int i = 0; i < KRK_SKINNY_CONFIGS; i++) {
        const size_t b = (size_t)krk_device_sm_count() * kSkCfg[i].per_sm * 2 * 16 * kSkCfg[i].max_mt *
                         kSkCfg[i].rows * sizeof(float);
        m = b > m ? b : m;
    }
    return (m + 255) / 256 * 256;
}

struct SkArgs {
    const uint16_t *xb;
    int64_t ldxb;
    int n;
    int64_t cols;
    int kc;           // iterations of a tile: cols / K
    int n_parts;
    const uint16_t *w[KRK_GEMV_MAX_PARTS];
    const float *bias[KRK_GEMV_MAX_PARTS];
    float *y[KRK_GEMV_MAX_PARTS];
    int64_t rows[KRK_GEMV_MAX_PARTS], ldy[KRK_GEMV_MAX_PARTS];
    int tile0[KRK_GEMV_MAX_PARTS + 1]; // first tile of each part; tile0[n_parts] = all tiles
    float *act_out;
    int64_t ld_act;
    int act;
    int q;            // iterations per block: q + 1 for the first r blocks, q for the others
    int r;
    unsigned *counters;
    float *part;
};

__device__ __forceinline__ int sk_begin(const SkArgs &a, int b)
{
    return b * a.q + (b < a.r ? b : a.r);
}

// The block whose range holds iteration i.
__device__ __forceinline__ int sk_block_of(const SkArgs &a, int i)
{
    const int big = a.r * (a.q + 1);
    return i < big ? i / (a.q + 1) : a.r + (i - big) / a.q;
}

__device__ __forceinline__ int sk_part_of(const SkArgs &a, int tile)
{
    int p = 0;
#pragma unroll
    for (int i = 1; i < KRK_GEMV_MAX_PARTS; i++) {
        p += (i < a.n_parts && tile >= a.tile0[i]) ? 1 : 0;
    }
    return p;
}

constexpr int kSkK = 256;                  // columns of an iteration: 512 bytes of a row, one
constexpr int kSkRowBytes = kSkK * 2;      // 16-byte chunk per lane of a warp

// Byte offset of 16-byte chunk c of row r in a stage (rows of 512 bytes; the low three bits of the
// chunk XORed with the row's, so that the 8 rows of an ldmatrix phase hit distinct banks).
__device__ __forceinline__ uint32_t sk_swz(int row, int chunk)
{
    return (uint32_t)(row * kSkRowBytes + ((chunk ^ (row & 7)) << 4));
}

// A thread's copy state: warp w copies rows w, w + 8, ... of each weight tile and of x, lane l
// the 16-byte chunk l of each (the warp reads 512 contiguous bytes of a row per copy). Advanced
// one iteration at a time: within a tile only the column offset moves.
struct SkLd {
    int tile, kcol;
    const uint16_t *w;  // this thread's chunk of row `warp` of the tile at column step kcol
    int64_t nvalid;     // rows of the part from row `warp` of the tile on
};

__device__ __forceinline__ void sk_ld_tile(const SkArgs &a, int R, SkLd &l)
{
    const int q = sk_part_of(a, l.tile);
    const int64_t row = (int64_t)(l.tile - a.tile0[q]) * R + (threadIdx.x >> 5);
    l.nvalid = a.rows[q] - row;
    l.w = a.w[q] + row * a.cols + (int64_t)l.kcol * kSkK + (threadIdx.x & 31) * 8;
}

__device__ __forceinline__ void sk_ld_next(const SkArgs &a, int R, SkLd &l)
{
    if (++l.kcol == a.kc) {
        l.kcol = 0;
        l.tile++;
        sk_ld_tile(a, R, l);
    } else {
        l.w += kSkK;
    }
}

// Requests the weight tile at l into stage buffer sw (rows past the part's are not requested: their
// products land only in outputs that are never stored), and x's columns of it after it (rows < n;
// the rows past n stay zero).
template <int R, int MT>
__device__ __forceinline__ void sk_load(const SkArgs &a, const SkLd &l, uint32_t sw, uint32_t soff, bool with_x)
{
    const int64_t stride = 8 * a.cols;
#pragma unroll
    for (int u = 0; u < R / 8; u++) {
        if (8 * u < l.nvalid) {
            cp_async16(sw + soff + u * 8 * kSkRowBytes, l.w + u * stride);
        }
    }
    if (with_x) {
        const int m = threadIdx.x >> 5;
        const uint16_t *xs = a.xb + m * a.ldxb + (int64_t)l.kcol * kSkK + (threadIdx.x & 31) * 8;
#pragma unroll
        for (int u = 0; u < 2 * MT; u++) {
            if (m + 8 * u < a.n) {
                cp_async16(sw + R * kSkRowBytes + soff + u * 8 * kSkRowBytes, xs + u * 8 * a.ldxb);
            }
        }
    }
}

__device__ __forceinline__ void sk_store(const SkArgs &a, int q, int64_t row0, int tok, int64_t row, float v)
{
    if (tok < a.n && row0 + row < a.rows[q]) {
        const int64_t rr = row0 + row;
        v = a.bias[q] ? v + a.bias[q][rr] : v;
        a.y[q][tok * a.ldy[q] + rr] = v;
        if (a.act_out) {
            a.act_out[tok * a.ld_act + rr] = act_apply(a.act, v);
        }
    }
}

// Warps: RG = R / 16 row groups of 16 weight rows times KS = 8 / RG column splits of an iteration;
// each warp's weight fragments serve the MT tiles of x.
template <int R, int S, int MT>
__global__ void __launch_bounds__(kSkThreads) skinny_kernel(const __grid_constant__ SkArgs a)
{
    constexpr int K = kSkK;
    constexpr int RG = R / 16, KS = kSkWarps / RG, KW = K / KS; // columns of an iteration per warp
    constexpr int WB = R * kSkRowBytes, XB = 16 * MT * kSkRowBytes, SB = WB + XB, PART = 16 * MT * R;
    constexpr int NA = 8 * MT; // accumulators of a lane
    static_assert(RG * KS == kSkWarps && KW % 64 == 0 && R % 8 == 0, "tile shape");
    extern __shared__ __align__(128) unsigned char sk_smem[];
    __shared__ float red[(KS - 1) * RG * 32 * NA + 1]; // the column splits' sums, combined in order
    __shared__ unsigned sk_last[2];
    int pend0 = -1, pend1 = -1; // tiles whose partial sums this block left in its two slots
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int rg = warp % RG, ks = warp / RG;
    const int b = blockIdx.x;
    const int it0 = sk_begin(a, b), count = sk_begin(a, b + 1) - it0;
    const uint32_t sbase = smem_addr(sk_smem);
    const uint32_t soff = sk_swz(warp, lane); // this thread's copy destination in row `warp`

    // weights of the first S - 1 iterations, one group each
    SkLd ld;
    ld.tile = it0 / a.kc;
    ld.kcol = it0 - ld.tile * a.kc;
    sk_ld_tile(a, R, ld);
    const SkLd first = ld;
#pragma unroll
    for (int s = 0; s < S - 1; s++) {
        if (s < count) {
            sk_load<R, MT>(a, ld, sbase + s * SB, soff, false);
            sk_ld_next(a, R, ld);
        }
        cp_async_commit();
    }
    pdl_trigger();
    pdl_wait(); // x, y, the counters and the partials belong to earlier kernels

    // x of those iterations, read directly (every load issued before the first store to shared
    // memory, which the compiler would otherwise order them behind); rows past n zero in every stage
    {
        uint4 xv[S - 1][2 * MT];
        SkLd xp = first;
#pragma unroll
        for (int s = 0; s < S - 1; s++) {
#pragma unroll
            for (int u = 0; u < 2 * MT; u++) {
                const int m = warp + 8 * u;
                xv[s][u] = make_uint4(0, 0, 0, 0);
                if (m < a.n && s < count) {
                    xv[s][u] = __ldcg(reinterpret_cast<const uint4 *>(a.xb + m * a.ldxb + (int64_t)xp.kcol * K + lane * 8));
                }
            }
            if (s < count) {
                sk_ld_next(a, R, xp);
            }
        }
#pragma unroll
        for (int s = 0; s < S; s++) {
#pragma unroll
            for (int u = 0; u < 2 * MT; u++) {
                *reinterpret_cast<uint4 *>(sk_smem + s * SB + WB + soff + u * 8 * kSkRowBytes) =
                    s < S - 1 ? xv[s < S - 1 ? s : 0][u] : make_uint4(0, 0, 0, 0);
            }
        }
    }

    // ldmatrix addresses within a stage. Chunk c = ks * KW / 8 + 8 hi + 2 k4 + jb of row r sits at
    // chunk (c & ~7) | ((2 k4 + jb) ^ (r & 7)) = base + 8 hi + ((jb ^ r7) ^ 2 k4): one per k4 = 0..3.
    const int j = lane >> 3, r7 = lane & 7;
    uint32_t offA[4], offB[4];
#pragma unroll
    for (int k4 = 0; k4 < 4; k4++) {
        const int ra = (j & 1) * 8 + r7, rb = rg * 16 + (j >> 1) * 8 + r7;
        offA[k4] = (uint32_t)(WB + ra * kSkRowBytes + (ks * (KW / 8) + (((j >> 1) ^ r7) ^ (2 * k4))) * 16);
        offB[k4] = (uint32_t)(rb * kSkRowBytes + (ks * (KW / 8) + (((j & 1) ^ r7) ^ (2 * k4))) * 16);
    }

    float acc[MT][2][4] = {};
    int cur_tile = first.tile, cur_kcol = first.kcol;
    int seg = it0; // first iteration of the current tile's segment
    for (int i = 0; i < count; i++) {
        cp_async_wait<S - 2>(); // this thread's copies of iteration i have landed
        __syncthreads();        // everyone's; and the stage refilled below is no longer read
        if (i + S - 1 < count) {
            sk_load<R, MT>(a, ld, sbase + ((i + S - 1) % S) * SB, soff, true);
            sk_ld_next(a, R, ld);
        }
        cp_async_commit();
        const uint32_t st = sbase + (i % S) * SB;
#pragma unroll
        for (int kk = 0; kk < KW / 16; kk++) {
            uint32_t bf[4];
            ldmatrix_x4(bf, st + offB[kk & 3] + (kk >> 2) * 128);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                uint32_t af[4];
                ldmatrix_x4(af, st + offA[kk & 3] + (kk >> 2) * 128 + mt * 16 * kSkRowBytes);
                mma_bf16(acc[mt][0], af, bf[0], bf[1]);
                mma_bf16(acc[mt][1], af, bf[2], bf[3]);
            }
        }

        const int it = it0 + i;
        const int tile = cur_tile;
        const bool tile_end = ++cur_kcol == a.kc;
        if (tile_end) {
            cur_kcol = 0;
            cur_tile++;
        }
        if (!tile_end && i != count - 1) {
            continue;
        }
        // the end of this block's segment of the tile: the column splits' sums into split 0
        if (KS > 1) {
            if (ks > 0) {
                float *rp = red + (((ks - 1) * RG + rg) * 32 + lane) * NA;
#pragma unroll
                for (int e = 0; e < NA; e++) {
                    rp[e] = acc[e >> 3][(e >> 2) & 1][e & 3];
                }
            }
            __syncthreads();
            if (ks == 0) {
#pragma unroll
                for (int k2 = 1; k2 < KS; k2++) {
                    const float *rp = red + (((k2 - 1) * RG + rg) * 32 + lane) * NA;
#pragma unroll
                    for (int e = 0; e < NA; e++) {
                        acc[e >> 3][(e >> 2) & 1][e & 3] += rp[e];
                    }
                }
            }
        }
        const int q = sk_part_of(a, tile);
        const int64_t row0 = (int64_t)(tile - a.tile0[q]) * R;
        // acc[mt][jj][e] of split 0: token 16 mt + g + 8 (e >> 1), tile row 16 rg + 8 jj + 2 t + (e & 1)
        const int wr = rg * 16 + 2 * t;
        if (seg == tile * a.kc && tile_end) { // the whole tile
            if (ks == 0) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                    for (int jj = 0; jj < 2; jj++) {
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            sk_store(a, q, row0, 16 * mt + g + 8 * (e >> 1), wr + 8 * jj + (e & 1), acc[mt][jj][e]);
                        }
                    }
                }
            }
        } else { // the partial sums go to the block's slot; counted in after the loop
            const int which = seg == it0 ? 0 : 1; // the block's first tile, or its last
            if (which == 0) {
                pend0 = tile;
            } else {
                pend1 = tile;
            }
            float *mine = a.part + (int64_t)(b * 2 + which) * PART;
            if (ks == 0) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                    for (int jj = 0; jj < 2; jj++) {
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int tok = 16 * mt + g + 8 * (e >> 1);
                            if (tok < a.n) {
                                mine[tok * R + wr + 8 * jj + (e & 1)] = acc[mt][jj][e];
                            }
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int jj = 0; jj < 2; jj++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    acc[mt][jj][e] = 0.0f;
                }
            }
        }
        seg = it + 1;
    }
    if (pend0 < 0 && pend1 < 0) {
        return; // block-uniform
    }
    // count in on the tiles shared with other blocks; the last to arrive adds the partials in block
    // order (fixed for the shape and the grid), writes y and sets the counter back to zero
    __threadfence(); // the partials are visible device-wide before the count
    __syncthreads();
    if (threadIdx.x < 2) {
        const int tile = threadIdx.x == 0 ? pend0 : pend1;
        if (tile >= 0) {
            const int bf = sk_block_of(a, tile * a.kc), bl = sk_block_of(a, tile * a.kc + a.kc - 1);
            sk_last[threadIdx.x] = atomicAdd(&a.counters[tile], 1u) == (unsigned)(bl - bf);
        }
    }
    __syncthreads();
#pragma unroll
    for (int w2 = 0; w2 < 2; w2++) {
        const int tile = w2 == 0 ? pend0 : pend1;
        if (tile < 0 || !sk_last[w2]) {
            continue;
        }
        __threadfence();
        const int bf = sk_block_of(a, tile * a.kc), bl = sk_block_of(a, tile * a.kc + a.kc - 1);
        const int q = sk_part_of(a, tile);
        const int64_t row0 = (int64_t)(tile - a.tile0[q]) * R;
        constexpr int EU = 4; // outputs per thread and pass: their loads in flight together
        for (int e0 = threadIdx.x; e0 < a.n * R; e0 += EU * kSkThreads) {
            float v[EU] = {};
            for (int c = bf; c <= bl; c++) {
                const int wc = sk_begin(a, c) >= tile * a.kc ? 0 : 1; // its first tile, or its last
                const float *src = a.part + (int64_t)(c * 2 + wc) * PART;
#pragma unroll
                for (int u = 0; u < EU; u++) {
                    const int e = e0 + u * kSkThreads;
                    if (e < a.n * R) {
                        v[u] += __ldcg(src + e);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < EU; u++) {
                const int e = e0 + u * kSkThreads;
                if (e < a.n * R) {
                    sk_store(a, q, row0, e / R, e % R, v[u]);
                }
            }
        }
        if (threadIdx.x == 0) {
            a.counters[tile] = 0;
        }
    }
}

template <int R, int S, int PS, int MT>
enum kr_status launch_skinny(const SkArgs &a, int iters, bool pdl, cudaStream_t stream)
{
    constexpr size_t smem = (size_t)S * (R + 16 * MT) * kSkRowBytes;
    constexpr size_t red = (size_t)((kSkWarps / (R / 16) - 1) * (R / 16) * 32 * 8 * MT + 1) * sizeof(float);
    static_assert(S >= 2 && (smem + red) * PS <= 227 * 1024, "stages fit the shared memory of an SM");
    static std::atomic<uint64_t> opted{0}; // the shared-memory opt-in, once per instantiation and device
    KRK_CUDA_TRY(smem_opt_in(opted, skinny_kernel<R, S, MT>, smem));
    SkArgs b = a;
    const int g = krk_device_sm_count() * PS;
    const int grid = iters < g ? iters : g;
    b.q = iters / grid;
    b.r = iters % grid;
    KRK_CUDA_TRY(launch_maybe_pdl(pdl, skinny_kernel<R, S, MT>, dim3((unsigned)grid), dim3(kSkThreads), smem, stream, b));
    return KR_OK;
}

// The kernel of configuration C with MT tiles of x (its tile rows and blocks per SM from the table).
template <int C, int MT> enum kr_status launch_cfg(const SkArgs &a, int iters, bool pdl, cudaStream_t stream)
{
    return launch_skinny<kSkCfg[C].rows, sk_stages(C, MT), kSkCfg[C].per_sm, MT>(a, iters, pdl, stream);
}
static_assert(KRK_SKINNY_CONFIGS == 4, "krk_skinny's switch names every configuration");

} // namespace
} // namespace krk

using namespace krk;

extern "C" size_t krk_skinny_ws_bytes(int64_t tile_rows)
{
    if (tile_rows < 1) {
        return 0;
    }
    // counters for tiles of the smallest rows of any configuration, then the partial slots
    int min_rows = kSkMaxRows;
    for (int i = 0; i < KRK_SKINNY_CONFIGS; i++) {
        min_rows = kSkCfg[i].rows < min_rows ? kSkCfg[i].rows : min_rows;
    }
    const size_t counters = (size_t)sk_div_up(sk_div_up(tile_rows, min_rows) * (int64_t)sizeof(unsigned), 256) * 256;
    return counters + sk_part_bytes();
}

extern "C" int64_t krk_skinny_tile_rows(const struct krk_skinny_params *p)
{
    int64_t r = 0;
    for (int i = 0; i < p->n_parts && i < KRK_GEMV_MAX_PARTS; i++) {
        r += sk_div_up(p->parts[i].rows, kSkMaxRows) * kSkMaxRows;
    }
    return r;
}

extern "C" int krk_skinny_cols_step(int config)
{
    return config >= 0 && config < KRK_SKINNY_CONFIGS ? kSkK : 0;
}

extern "C" enum kr_status krk_skinny(const struct krk_skinny_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p);
    KRK_REQUIRE(p->config >= 0 && p->config < KRK_SKINNY_CONFIGS);
    const sk_cfg cfg = kSkCfg[p->config];
    KRK_REQUIRE(p->n >= 0 && p->n <= 16 * cfg.max_mt && p->cols >= kSkK && p->cols % kSkK == 0);
    KRK_REQUIRE(p->n_parts >= 1 && p->n_parts <= KRK_GEMV_MAX_PARTS);
    KRK_REQUIRE(p->ldxb >= p->cols && p->ldxb % 8 == 0);
    KRK_REQUIRE(p->act_out == nullptr || (p->n_parts == 1 && p->ld_act >= p->parts[0].rows && act_valid(p->act)));
    for (int i = 0; i < p->n_parts; i++) {
        const struct krk_gemv_part &q = p->parts[i];
        KRK_REQUIRE(q.rows >= 1 && q.ldy >= q.rows);
        KRK_REQUIRE(q.w && q.y && ((uintptr_t)q.w & 15) == 0);
    }
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->xb && ((uintptr_t)p->xb & 15) == 0);
    KRK_REQUIRE(p->ws && p->ws_bytes >= krk_skinny_ws_bytes(krk_skinny_tile_rows(p)) && ((uintptr_t)p->ws & 255) == 0);

    SkArgs a = {};
    a.xb = reinterpret_cast<const uint16_t *>(p->xb);
    a.ldxb = p->ldxb;
    a.n = (int)p->n;
    a.cols = p->cols;
    a.kc = (int)(p->cols / kSkK);
    a.n_parts = p->n_parts;
    int64_t tiles = 0;
    for (int i = 0; i < p->n_parts; i++) {
        a.w[i] = reinterpret_cast<const uint16_t *>(p->parts[i].w);
        a.bias[i] = p->parts[i].bias;
        a.y[i] = p->parts[i].y;
        a.rows[i] = p->parts[i].rows;
        a.ldy[i] = p->parts[i].ldy;
        a.tile0[i] = (int)tiles;
        tiles += sk_div_up(p->parts[i].rows, cfg.rows);
    }
    a.tile0[p->n_parts] = (int)tiles;
    KRK_REQUIRE(tiles * a.kc <= INT32_MAX / 2);
    a.act_out = p->act_out;
    a.ld_act = p->ld_act;
    a.act = p->act;
    // the partial slots at the end of the workspace, the counters (one per tile, left at zero by
    // every product) at its start: the same places whatever the shape
    const size_t pb = sk_part_bytes();
    a.counters = static_cast<unsigned *>(p->ws);
    a.part = reinterpret_cast<float *>(static_cast<char *>(p->ws) + ((p->ws_bytes - pb) & ~(size_t)255));
    const int iters = (int)(tiles * a.kc);
    const bool pdl = p->pdl || pdl_enabled();
    switch (p->config) {
    case 1:
        return launch_cfg<1, 1>(a, iters, pdl, stream);
    case 2:
        return launch_cfg<2, 1>(a, iters, pdl, stream);
    case 3:
        return launch_cfg<3, 1>(a, iters, pdl, stream);
    default: // the fewest 16-token tiles that hold n
        if (p->n <= 16) {
            return launch_cfg<0, 1>(a, iters, pdl, stream);
        }
        if (p->n <= 32) {
            return launch_cfg<0, 2>(a, iters, pdl, stream);
        }
        if (p->n <= 64) {
            return launch_cfg<0, 4>(a, iters, pdl, stream);
        }
        return launch_cfg<0, 8>(a, iters, pdl, stream);
    }
}
