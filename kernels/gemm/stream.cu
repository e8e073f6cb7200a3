// Decode-sized products on Hopper's asynchronous copy and matrix paths (krk_stream_gemm): 1..64 rows
// of x against a bf16 weight, bound by reading the weight once at the copy rate.
//
// Roles: the weight is wgmma's A operand (m64 blocks of 64 weight rows, K-major, as stored), x its
// B operand (NP = 16, 32, 48 or 64 tokens, rows past n read as zeros), the accumulators are y^T
// (64 weight rows by NP tokens per m64 block) in registers. An iteration is BM weight rows (a tile:
// 64 per m64 block of each of the two consumer warpgroups) by 64 columns (128 bytes, the span of the
// 128-byte swizzle that the tensor copies write and wgmma reads).
//
// Work: the tiles times their column iterations, in order, are cut into equal contiguous ranges,
// one per block, one block per SM (stream-K): every SM streams the same number of weight bytes
// whatever the shape, and its copy pipeline runs on across tile boundaries.
//
// Pipeline: a copy warp (one thread) fills S stages of shared memory, each one iteration's weight
// box (BM x 64) and x box (NP x 64), with tensor copies (cp.async.bulk.tensor) that complete an
// mbarrier per stage; the consumer warpgroups wait on it, issue the iteration's 4 x MW wgmma (k16
// steps of each m64 block), and release the stage to the copy warp once the wgmma of the iteration
// after it were issued and this one's completed (one group in flight). Weight boxes go to L2 with
// an evict-first hint (read once). The first S weight boxes are requested before the programmatic-
// launch wait (weights are written by no kernel); x, y and the workspace only after it.
//
// Results: a block that covers all column iterations of a tile writes y (+ bias) from its
// accumulators. Otherwise each block with a segment of the tile writes its partial sums to the
// workspace (two slots per block: its first tile and its last) and counts itself in on the tile's
// counter; the last to arrive adds the partials in block order (fixed by the shape and the grid, so
// results do not depend on timing), writes y and sets the counter back to zero for the next product.
#include <cuda.h>

#include <atomic>
#include <cstdio>
#include <mutex>

#include "common/mma.cuh"
#include "common/util.cuh"
#include "krk/gemm.h"
#include "krk/stream-plan.h"

namespace krk {
namespace {

constexpr int kStBK = 64;                           // columns of an iteration
constexpr int kStRowBytes = kStBK * 2;              // 128: the swizzle span
constexpr int kStConsumers = 2;                     // warpgroups issuing wgmma
constexpr int kStThreads = kStConsumers * 128 + 32; // and the copy warp
constexpr int kStSmem = 224 * 1024;                 // stages + 1 KB of alignment slack
constexpr int kStMaxStages = 16;
constexpr int kStMaxMW = 2;                         // m64 blocks per consumer warpgroup, at most

struct StArgs {
    CUtensorMap wmap;    // W [rows, cols] in boxes of BM x 64, 128-byte swizzle
    CUtensorMap xmap;    // x [n, cols] in boxes of NP x 64
    float *y;
    int64_t ldy;
    const float *bias;
    int n, rows, kt;     // kt: column iterations of a tile, ceil(cols / 64)
    int64_t iters;       // tiles * kt
    int grid;
    float *part;         // [grid][2][BM * NP]
    int *counters;       // [tiles], zero between products
};

// The cut of the iterations over the blocks (krk/stream-plan.h).
__device__ __forceinline__ int64_t st_begin(const StArgs &a, int64_t b)
{
    return krk_sp_begin(a.iters, a.grid, b);
}
__device__ __forceinline__ int st_block(const StArgs &a, int64_t i)
{
    return krk_sp_block(a.iters, a.grid, i);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Until the phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity)
{
    uint32_t done = 0;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}

// A 2-D box of the tensor map at (column c0, row c1) into shared memory, completing `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void tma_load_hint(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1,
                                              uint64_t policy)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint "
                 "[%0], [%1, {%2, %3}], [%4], %5;"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
                 : "memory");
}

// Shared-memory matrix descriptor of a K-major operand in 128-byte swizzled rows: 8-row groups
// 1024 bytes apart (stride byte offset), the start address stepped by 32 bytes per k16 within the
// swizzle span (the tile itself 1024-byte aligned).
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr)
{
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}
__device__ __forceinline__ void wg_fence()
{
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void wg_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across a wgmma issue or wait.
template <int R> __device__ __forceinline__ void wg_hold(float (&d)[R])
{
#pragma unroll
    for (int i = 0; i < R; i++) {
        asm volatile("" : "+f"(d[i])::"memory");
    }
}

// d (64 x NP fp32, the wgmma accumulator fragment) += A (64 x 16, descriptor a) * B (16 x NP, b);
// d is overwritten instead when accumulate is 0.
template <int NP> struct Wgmma;
template <> struct Wgmma<16> {
    static __device__ __forceinline__ void mma(float (&d)[8], uint64_t a, uint64_t b, int accumulate)
    {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                     : "l"(a), "l"(b), "r"(accumulate));
    }
};
template <> struct Wgmma<32> {
    static __device__ __forceinline__ void mma(float (&d)[16], uint64_t a, uint64_t b, int accumulate)
    {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                     : "l"(a), "l"(b), "r"(accumulate));
    }
};
template <> struct Wgmma<48> {
    static __device__ __forceinline__ void mma(float (&d)[24], uint64_t a, uint64_t b, int accumulate)
    {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23}, %24, %25, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                     : "l"(a), "l"(b), "r"(accumulate));
    }
};
template <> struct Wgmma<64> {
    static __device__ __forceinline__ void mma(float (&d)[32], uint64_t a, uint64_t b, int accumulate)
    {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                     : "l"(a), "l"(b), "r"(accumulate));
    }
};

// Named barrier of the consumer warpgroups (the copy warp leaves early).
__device__ __forceinline__ void consumers_sync()
{
    asm volatile("bar.sync 1, %0;" ::"n"(kStConsumers * 128) : "memory");
}

template <int MW, int NP, int S>
__global__ void __launch_bounds__(kStThreads, 1) stream_kernel(const __grid_constant__ StArgs a)
{
    constexpr int BM = 64 * MW * kStConsumers;
    constexpr int WB = BM * kStRowBytes, XB = NP * kStRowBytes, SB = WB + XB;
    constexpr int NR = NP / 2;                     // accumulators of a thread per m64 block
    constexpr int PART = BM * NP;                  // floats of a partial-sum slot
    static_assert(WB % 1024 == 0 && XB % 1024 == 0, "boxes keep the 1024-byte alignment of the swizzle");
    extern __shared__ unsigned char st_smem[];
    __shared__ __align__(8) uint64_t full[S], empty[S];
    __shared__ int last_flag;
    const uint32_t base = (smem_addr(st_smem) + 1023u) & ~1023u;
    const uint32_t full0 = smem_addr(&full[0]), empty0 = smem_addr(&empty[0]);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = blockIdx.x;
    const int64_t it0 = st_begin(a, b), count = st_begin(a, b + 1) - it0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, kStConsumers);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    pdl_trigger();

    if (warp == kStConsumers * 4) { // the copy warp: one thread issues every copy
        if (lane == 0) {
            uint64_t policy;
            asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
            const int first = count < S ? (int)count : S;
            for (int i = 0; i < first; i++) { // weights before the wait: no kernel writes them
                const int64_t it = it0 + i;
                const int tile = (int)(it / a.kt), k = (int)(it - (int64_t)tile * a.kt);
                mbar_expect_tx(full0 + 8 * i, SB);
                tma_load_hint(base + i * SB, &a.wmap, full0 + 8 * i, k * kStBK, tile * BM, policy);
            }
            pdl_wait();
            for (int i = 0; i < first; i++) {
                const int64_t it = it0 + i;
                const int k = (int)(it % a.kt);
                tma_load(base + i * SB + WB, &a.xmap, full0 + 8 * i, k * kStBK, 0);
            }
            for (int64_t i = first; i < count; i++) {
                const int s = (int)(i % S);
                const uint32_t round = (uint32_t)(i / S);
                mbar_wait(empty0 + 8 * s, (round - 1) & 1); // the consumers' release of round - 1
                const int64_t it = it0 + i;
                const int tile = (int)(it / a.kt), k = (int)(it - (int64_t)tile * a.kt);
                mbar_expect_tx(full0 + 8 * s, SB);
                tma_load_hint(base + s * SB, &a.wmap, full0 + 8 * s, k * kStBK, tile * BM, policy);
                tma_load(base + s * SB + WB, &a.xmap, full0 + 8 * s, k * kStBK, 0);
            }
        }
        return;
    }

    pdl_wait(); // y, the partials and the counters belong to earlier kernels
    const int wg = warp >> 2, tid = threadIdx.x & 127;
    const int g = lane >> 2, t = lane & 3, wrow = (warp & 3) * 16 + g;
    float acc[MW][NR] = {}; // (the first wgmma of a segment overwrites them)
    int64_t i = 0, it = it0;
    const int64_t it_end = it0 + count;
    while (it < it_end) {
        const int tile = (int)(it / a.kt), kb = (int)(it - (int64_t)tile * a.kt);
        const int ke = (int)((int64_t)a.kt < kb + (it_end - it) ? (int64_t)a.kt : kb + (it_end - it));
        int prev = 0;
        for (int k = kb; k < ke; k++, i++) {
            const int s = (int)(i % S);
            mbar_wait(full0 + 8 * s, (uint32_t)(i / S) & 1);
            const uint32_t ws = base + s * SB + (uint32_t)(wg * MW) * 64 * kStRowBytes, xs = base + s * SB + WB;
#pragma unroll
            for (int j = 0; j < MW; j++) {
                wg_hold(acc[j]);
            }
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < kStBK / 16; kk++) {
#pragma unroll
                for (int j = 0; j < MW; j++) {
                    Wgmma<NP>::mma(acc[j], wg_desc(ws + j * 64 * kStRowBytes + kk * 32), wg_desc(xs + kk * 32),
                                   k > kb || kk > 0);
                }
            }
            wg_commit();
#pragma unroll
            for (int j = 0; j < MW; j++) {
                wg_hold(acc[j]);
            }
            if (k > kb) { // the iteration before this one has completed: its stage goes back
                wg_wait<1>();
                if (tid == 0) {
                    mbar_arrive(empty0 + 8 * prev);
                }
            }
            prev = s;
        }
        wg_wait<0>();
#pragma unroll
        for (int j = 0; j < MW; j++) {
            wg_hold(acc[j]);
        }
        if (tid == 0) {
            mbar_arrive(empty0 + 8 * prev);
        }
        it += ke - kb;

        // accumulator d[j][4c + 2h + e]: weight row m0 + j * 64 + 8h, token 8c + 2t + e
        const int m0 = tile * BM + wg * MW * 64 + wrow;
        bool write = kb == 0 && ke == a.kt;
        if (!write) {
            const int slot = krk_sp_slot(a.iters, a.grid, a.kt, b, tile);
            float *p = a.part + ((int64_t)b * 2 + slot) * PART + (int64_t)wg * MW * NR * 128 + tid;
#pragma unroll
            for (int j = 0; j < MW; j++) {
#pragma unroll
                for (int q = 0; q < NR; q++) {
                    __stcg(p + (j * NR + q) * 128, acc[j][q]);
                }
            }
            __threadfence();
            consumers_sync();
            const int64_t t0 = (int64_t)tile * a.kt;
            const int bf = st_block(a, t0), bl = st_block(a, t0 + a.kt - 1);
            if (threadIdx.x == 0) {
                last_flag = atomicAdd(&a.counters[tile], 1) == bl - bf;
            }
            consumers_sync();
            if (last_flag) {
                __threadfence();
#pragma unroll
                for (int j = 0; j < MW; j++) {
#pragma unroll
                    for (int q = 0; q < NR; q++) {
                        float sum = 0.0f;
                        for (int bb = bf; bb <= bl; bb++) {
                            const int sl = krk_sp_slot(a.iters, a.grid, a.kt, bb, tile);
                            sum += bb == b ? acc[j][q]
                                           : __ldcg(a.part + ((int64_t)bb * 2 + sl) * PART +
                                                    (int64_t)wg * MW * NR * 128 + (j * NR + q) * 128 + tid);
                        }
                        acc[j][q] = sum;
                    }
                }
                if (threadIdx.x == 0) {
                    a.counters[tile] = 0;
                }
                write = true;
            }
        }
        if (write) {
#pragma unroll
            for (int j = 0; j < MW; j++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int m = m0 + j * 64 + 8 * h;
                    if (m >= a.rows) {
                        continue;
                    }
                    const float bias = a.bias ? a.bias[m] : 0.0f;
#pragma unroll
                    for (int c = 0; c < NP / 8; c++) {
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const int tok = 8 * c + 2 * t + e;
                            if (tok < a.n) {
                                a.y[(int64_t)tok * a.ldy + m] = acc[j][4 * c + 2 * h + e] + bias;
                            }
                        }
                    }
                }
            }
        }
    }
}

// Stages of MW and NP within the shared-memory budget.
__host__ __device__ constexpr int st_stages(int mw, int np)
{
    return (kStSmem - 1024) / ((64 * mw * kStConsumers + np) * kStRowBytes) < kStMaxStages
               ? (kStSmem - 1024) / ((64 * mw * kStConsumers + np) * kStRowBytes)
               : kStMaxStages;
}

typedef CUresult (*EncodeTiled)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder (a host function; taken through the runtime, no link to libcuda).
EncodeTiled encoder()
{
    static std::once_flag once;
    static EncodeTiled fn = nullptr;
    std::call_once(once, [] {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) ==
                cudaSuccess &&
            q == cudaDriverEntryPointSuccess) {
            fn = reinterpret_cast<EncodeTiled>(p);
        }
    });
    return fn;
}

// A bf16 matrix [rows, cols] (row pitch ld elements) in boxes of box_rows x 64, 128-byte swizzle,
// zeros outside.
bool encode(CUtensorMap *m, const void *p, int64_t rows, int64_t cols, int64_t ld, int box_rows)
{
    const EncodeTiled fn = encoder();
    if (!fn) {
        return false;
    }
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)ld * 2};
    const cuuint32_t box[2] = {(cuuint32_t)kStBK, (cuuint32_t)box_rows};
    const cuuint32_t estr[2] = {1, 1};
    return fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(p), dims, strides, box, estr,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int MW, int NP> enum kr_status launch_stream(const struct krk_stream_params *p, cudaStream_t stream)
{
    constexpr int S = st_stages(MW, NP);
    constexpr int BM = 64 * MW * kStConsumers;
    constexpr size_t smem = (size_t)S * (BM + NP) * kStRowBytes + 1024;
    static_assert(S >= 3 && smem <= 227 * 1024, "stages fit the shared memory of an SM");
    static std::atomic<uint64_t> opted{0}; // the shared-memory opt-in, once per instantiation and device
    KRK_CUDA_TRY(smem_opt_in(opted, stream_kernel<MW, NP, S>, smem));
    StArgs a;
    memset(&a, 0, sizeof a);
    if (!encode(&a.wmap, p->w, p->rows, p->cols, p->cols, BM) || !encode(&a.xmap, p->x, p->n, p->cols, p->ldx, NP)) {
        static std::atomic<bool> said{false};
        if (!said.exchange(true)) {
            fprintf(stderr, "krk: krk_stream_gemm: the driver cannot describe a %lldx%lld weight to the tensor "
                            "copies; such products take another kernel\n", (long long)p->rows, (long long)p->cols);
        }
        return KR_ERR_UNSUPPORTED;
    }
    a.y = p->y;
    a.ldy = p->ldy;
    a.bias = p->bias;
    a.n = (int)p->n;
    a.rows = (int)p->rows;
    a.kt = (int)((p->cols + kStBK - 1) / kStBK);
    const int64_t tiles = (p->rows + BM - 1) / BM;
    a.iters = tiles * a.kt;
    const int64_t g = krk_device_sm_count();
    a.grid = (int)(a.iters < g ? a.iters : g);
    a.counters = static_cast<int *>(p->ws);
    a.part = reinterpret_cast<float *>(static_cast<char *>(p->ws) + krk_stream_counter_bytes());
    if (p->ws_bytes < krk_stream_counter_bytes() + (size_t)a.grid * 2 * BM * NP * sizeof(float) ||
        tiles * (int64_t)sizeof(int) > (int64_t)krk_stream_counter_bytes()) {
        fprintf(stderr, "krk: krk_stream_gemm: workspace of %zu bytes too small\n", p->ws_bytes);
        return KR_ERR_INVAL;
    }
    KRK_CUDA_TRY(launch_maybe_pdl(p->pdl || pdl_enabled(), stream_kernel<MW, NP, S>, dim3((unsigned)a.grid), dim3(kStThreads), smem,
                                  stream, a));
    return KR_OK;
}

template <int MW> enum kr_status launch_mw(const struct krk_stream_params *p, cudaStream_t stream)
{
    const int64_t c = p->n_class ? p->n_class : p->n; // the token class: rows of x a pass reads
    return c <= 16 ? launch_stream<MW, 16>(p, stream)
           : c <= 32 ? launch_stream<MW, 32>(p, stream)
           : c <= 48 ? launch_stream<MW, 48>(p, stream)
                     : launch_stream<MW, 64>(p, stream);
}

} // namespace
} // namespace krk

using namespace krk;

extern "C" size_t krk_stream_counter_bytes(void)
{
    return (size_t)KRK_STREAM_MAX_TILES * sizeof(int);
}

extern "C" size_t krk_stream_ws_bytes(void)
{
    return krk_stream_counter_bytes() +
           (size_t)krk_device_sm_count() * 2 * (64 * kStMaxMW * kStConsumers) * KRK_STREAM_MAX_N * sizeof(float);
}

extern "C" bool krk_stream_takes(const void *w, int64_t rows, int64_t cols, const void *x, int64_t ldx, int64_t n)
{
    return n >= 1 && n <= KRK_STREAM_MAX_N && rows >= 1 && cols >= 1 && cols % 8 == 0 && ldx % 8 == 0 &&
           ldx >= cols && is_aligned(w, 16) && is_aligned(x, 16) && rows <= (int64_t)KRK_STREAM_MAX_TILES * 128 &&
           cols <= ((int64_t)1 << 31) - kStBK && encoder() != nullptr;
}

extern "C" enum kr_status krk_stream_gemm(const struct krk_stream_params *p, cudaStream_t stream)
{
    if (!p || !p->w || !p->x || !p->y || !p->ws ||
        !krk_stream_takes(p->w, p->rows, p->cols, p->x, p->ldx, p->n) || p->ldy < p->rows ||
        p->config < 0 || p->config >= KRK_STREAM_CONFIGS || p->n_class < 0 || p->n_class % 16 != 0 ||
        p->n_class > KRK_STREAM_MAX_N || (p->n_class > 0 && p->n > p->n_class)) {
        return KR_ERR_INVAL;
    }
    return p->config == 0 ? launch_mw<1>(p, stream) : launch_mw<2>(p, stream);
}
