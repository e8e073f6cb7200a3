// Skinny products for decode: y[t, r] = x[t, :] . W[r, :] for n <= 8 activation rows against a bf16
// weight, bound by streaming W once at memory bandwidth.
//
// Layout: blocks of W warps; each warp owns RW consecutive weight rows and keeps all N x RW
// accumulators in registers. The columns are processed in chunks of x staged in shared memory
// (fp32, zero-padded to a multiple of 256 columns, at most 48 KB so no opt-in is needed and several
// blocks fit on an SM). In a chunk, lane l of a warp reads 8 bf16 of each of its rows at column
// 256 s + 8 l with one 16-byte non-caching load, and the matching 8 x values of every activation
// row from shared memory as two 16-byte loads. The weights of the next U steps are loaded while
// the current U steps are computed (software pipeline, across chunk boundaries too). x is stored
// with the two halves of every other 8-column group swapped, and lanes 4..7 of each quarter warp
// read their second float4 first, so that each 16-byte shared-memory phase covers 32 distinct
// banks.
//
// Fusions (krk_gemv_params): with `acc` the epilogue also adds each result into acc (the residual
// add that follows an output projection); with `norm_w` (n = 1, x in one chunk) x is RMS-normalised
// while it is staged, every block computing the sum of squares itself, and each block writes its
// share of the normalised row to norm_out for the later readers of the norm's output.
#include "common/util.cuh"
#include "norm/vec.cuh"

namespace krk {
namespace {

constexpr int kGemvWarps = 8;          // default warps per block
constexpr int kGemvSmemFloats = 12288; // 48 KB of staged x
static_assert(KRK_GEMV_NORM_MAX_COLS <= kGemvSmemFloats / 256 * 256, "a normalised x is staged in one chunk at n = 1");

// The fused RMSNorm of an n = 1 GEMV (norm_w in krk_gemv_params); threads is krk_rmsnorm's block
// size for the row (row_threads of its 4-column groups), whose summation order the sum of squares
// follows.
struct gemv_norm {
    const float *w; // [cols] fp32
    float eps;
    float *out;     // [cols] fp32
    int threads;
};

// Where column c of a chunk sits in shared memory: c ^ 4 when bit 5 of c is set. Lanes with h = 1
// then find their first 4 values in the second float4 of their group, which keeps each quarter
// warp's 16-byte reads on distinct banks, and every lane combines x[c..c+3] with weights 0..3.
__device__ __forceinline__ int staged(int c)
{
    return c ^ (((c >> 5) & 1) << 2);
}

__device__ __forceinline__ float round_bf16(float v)
{
    return __bfloat162float(__float2bfloat16_rn(v));
}

// Stages the one row of x (cols <= the chunk, zero-padded to `padded`) normalised and rounded to
// bf16, and writes this block's share of the fp32 normalised values (columns [b k, (b + 1) k) of
// block b, k = ceil(cols / blocks)) to nm.out. Pass 1 stages x raw and sums its squares the way
// krk_rmsnorm's vector kernel does (thread t of T = nm.threads takes the 4-column groups t, t + T,
// ... in order, then a block sum): with T <= the block's threads, whose extra threads add zeros,
// the sum is that kernel's bit for bit (when it takes its vector path: 16-byte aligned rows); with
// more, a thread takes several of its threads' groups and only the summation order differs. Pass 2 scales in place, v * r * w as krk_rmsnorm does.
// Contains barriers: every thread of the block calls it.
template <int W>
__device__ __forceinline__ void stage_norm(float *xs, const float *KRK_RESTRICT x, int cols, int padded,
                                           const gemv_norm &nm)
{
    __shared__ float red[32];
    float ss = 0.0f;
    for (int t = threadIdx.x; t < nm.threads; t += W * 32) {
        for (int g = t; g < cols / 4; g += nm.threads) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float v = x[4 * g + k];
                xs[staged(4 * g + k)] = v;
                ss += v * v;
            }
        }
    }
    for (int c = cols + threadIdx.x; c < padded; c += W * 32) {
        xs[staged(c)] = 0.0f;
    }
    // block_sum starts with a barrier: every raw value is staged before pass 2 reads it
    const float r = 1.0f / sqrtf(block_sum(ss, red) / (float)cols + nm.eps);
    const int64_t share = (cols + (int64_t)gridDim.x - 1) / (int64_t)gridDim.x;
    const int64_t lo = (int64_t)blockIdx.x * share, hi = lo + share;
    for (int c = threadIdx.x; c < cols; c += W * 32) {
        const float v = xs[staged(c)] * r * nm.w[c];
        if (c >= lo && c < hi) {
            nm.out[c] = v;
        }
        xs[staged(c)] = round_bf16(v);
    }
}

__device__ __forceinline__ uint4 ld_stream(const uint16_t *p)
{
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// Loads the weights of steps s..s+U-1 of a chunk (zeros past the chunk or the matrix). The test
// is done once for the whole group when it lies inside the chunk and the matrix (all_rows).
template <int RW, int U>
__device__ __forceinline__ void load_steps(uint4 (&wv)[U][RW], const uint16_t *const (&wr)[RW], const bool (&rv)[RW],
                                           bool all_rows, int64_t c0, int s, int steps, int len, int lane)
{
    if (all_rows && (s + U) * 256 <= len) {
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int r = 0; r < RW; r++) {
                wv[u][r] = ld_stream(wr[r] + c0 + (s + u) * 256 + lane * 8);
            }
        }
        return;
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int c = (s + u) * 256 + lane * 8;
#pragma unroll
        for (int r = 0; r < RW; r++) {
            wv[u][r] = (s + u < steps && c < len && rv[r]) ? ld_stream(wr[r] + c0 + c) : make_uint4(0, 0, 0, 0);
        }
    }
}

// NORM: x is one row (N = 1) in one chunk, normalised while staged (stage_norm).
template <int N, int RW, int U, int W, bool NORM>
__global__ void __launch_bounds__(W * 32)
    gemv_kernel(const float *KRK_RESTRICT x, int64_t ldx, const uint16_t *KRK_RESTRICT w,
                const float *KRK_RESTRICT bias, int64_t rows, int64_t cols, int ch, float *KRK_RESTRICT y, int64_t ldy,
                float *KRK_RESTRICT res, gemv_norm nm)
{
    static_assert(!NORM || N == 1, "the fused norm takes one row");
    extern __shared__ float4 xs4[]; // [N][ch / 4], halves of 8-column groups swizzled (staged())
    float *xs = reinterpret_cast<float *>(xs4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row0 = ((int64_t)blockIdx.x * W + warp) * RW;
    const int h = (lane >> 2) & 1; // which float4 of its 8 values this lane reads first
    const int ch4 = ch / 4;

    float acc[RW][N];
#pragma unroll
    for (int r = 0; r < RW; r++) {
#pragma unroll
        for (int t = 0; t < N; t++) {
            acc[r][t] = 0.0f;
        }
    }
    const uint16_t *wr[RW];
    bool rv[RW];
    const bool all_rows = row0 + RW <= rows;
#pragma unroll
    for (int r = 0; r < RW; r++) {
        rv[r] = row0 + r < rows;
        wr[r] = w + (rv[r] ? row0 + r : 0) * cols;
    }

    // Software pipeline: the weights of the next U steps (of this chunk or the next) are in flight
    // while the current ones are used. The first ones go out before x is staged.
    uint4 cur[U][RW], nxt[U][RW];
    {
        const int len = (int)(cols < ch ? cols : ch);
        load_steps<RW, U>(cur, wr, rv, all_rows, 0, 0, (len + 255) / 256, len, lane);
    }
    pdl_trigger();
    pdl_wait(); // x, y, res and norm_out belong to earlier kernels; the weights above do not
    for (int64_t c0 = 0; c0 < cols; c0 += ch) {
        const int len = (int)(cols - c0 < ch ? cols - c0 : ch); // a multiple of 8
        const int padded = (len + 255) / 256 * 256;             // <= ch
        const int steps = padded / 256;
        __syncthreads(); // the previous chunk's readers are done
        if constexpr (NORM) {
            stage_norm<W>(xs, x, len, padded, nm); // len == cols: one chunk
        } else {
#pragma unroll
            for (int t = 0; t < N; t++) {
                for (int c = threadIdx.x; c < padded; c += W * 32) {
                    // x is rounded to bf16, the operand precision of the cuBLAS path, so that a row's
                    // result does not depend on whether its batch takes this kernel or a GEMM
                    xs[t * ch + staged(c)] = c < len ? round_bf16(x[t * ldx + c0 + c]) : 0.0f;
                }
            }
        }
        __syncthreads();
        if (row0 >= rows) {
            continue; // warp-uniform; the warp still takes part in the barriers
        }
        for (int s = 0; s < steps; s += U) {
            if (s + U < steps) {
                load_steps<RW, U>(nxt, wr, rv, all_rows, c0, s + U, steps, len, lane);
            } else if (c0 + ch < cols) {
                const int nlen = (int)(cols - c0 - ch < ch ? cols - c0 - ch : ch);
                load_steps<RW, U>(nxt, wr, rv, all_rows, c0 + ch, 0, (nlen + 255) / 256, nlen, lane);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (s + u >= steps) {
                    break;
                }
                const int c4 = (s + u) * 64 + lane * 2; // float4 index of this lane's 8 values
                float wf[RW][8];
#pragma unroll
                for (int r = 0; r < RW; r++) {
                    const uint4 q = cur[u][r];
                    wf[r][0] = __uint_as_float(q.x << 16);
                    wf[r][1] = __uint_as_float(q.x & 0xffff0000u);
                    wf[r][2] = __uint_as_float(q.y << 16);
                    wf[r][3] = __uint_as_float(q.y & 0xffff0000u);
                    wf[r][4] = __uint_as_float(q.z << 16);
                    wf[r][5] = __uint_as_float(q.z & 0xffff0000u);
                    wf[r][6] = __uint_as_float(q.w << 16);
                    wf[r][7] = __uint_as_float(q.w & 0xffff0000u);
                }
#pragma unroll
                for (int t = 0; t < N; t++) {
                    const float4 xa = xs4[t * ch4 + c4 + h], xb = xs4[t * ch4 + c4 + (h ^ 1)];
#pragma unroll
                    for (int r = 0; r < RW; r++) {
                        float a = acc[r][t];
                        a = fmaf(xa.x, wf[r][0], a);
                        a = fmaf(xa.y, wf[r][1], a);
                        a = fmaf(xa.z, wf[r][2], a);
                        a = fmaf(xa.w, wf[r][3], a);
                        a = fmaf(xb.x, wf[r][4], a);
                        a = fmaf(xb.y, wf[r][5], a);
                        a = fmaf(xb.z, wf[r][6], a);
                        a = fmaf(xb.w, wf[r][7], a);
                        acc[r][t] = a;
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
#pragma unroll
                for (int r = 0; r < RW; r++) {
                    cur[u][r] = nxt[u][r];
                }
            }
        }
    }
    if (row0 >= rows) {
        return;
    }
#pragma unroll
    for (int r = 0; r < RW; r++) {
#pragma unroll
        for (int t = 0; t < N; t++) {
            const float v = warp_sum(acc[r][t]);
            if (lane == t && rv[r]) {
                const float o = bias ? v + bias[row0 + r] : v;
                y[t * ldy + row0 + r] = o;
                if (res) {
                    res[t * ldy + row0 + r] += o; // krk_gemv_params.acc; the row is this lane's alone
                }
            }
        }
    }
}

template <int N, int RW, int U, int W = kGemvWarps>
enum kr_status launch_gemv_cfg(const struct krk_gemv_params *p, cudaStream_t stream)
{
    constexpr int cap = kGemvSmemFloats / N / 256 * 256;
    const int64_t cols_padded = (p->cols + 255) / 256 * 256;
    const int ch = (int)(cols_padded < cap ? cols_padded : cap);
    const int64_t rows_per_block = (int64_t)W * RW;
    const int64_t blocks = (p->rows + rows_per_block - 1) / rows_per_block;
    KRK_REQUIRE(blocks <= INT32_MAX);
    const size_t smem = (size_t)N * (size_t)ch * sizeof(float);
    auto kernel = gemv_kernel<N, RW, U, W, false>;
    gemv_norm nm = {};
    if constexpr (N == 1) {
        if (p->norm_w) {
            KRK_REQUIRE(p->cols <= ch); // one chunk
            kernel = gemv_kernel<N, RW, U, W, true>;
            nm = gemv_norm{p->norm_w, p->norm_eps, p->norm_out, row_threads(p->cols / 4)};
        }
    }
    KRK_CUDA_TRY(launch_maybe_pdl(p->pdl || pdl_enabled(), kernel, dim3((unsigned)blocks), dim3(W * 32), smem, stream,
                                  p->x, p->ldx, p->w, p->bias, p->rows, p->cols, ch, p->y, p->ldy, p->acc, nm));
    return KR_OK;
}

// Rows per warp RW, steps in flight U, warps per block W. Each lane reads 32 N bytes of x from
// shared memory per 16 bytes of weight and row; RW rows share those reads, which keeps them within
// the shared-memory bandwidth as N grows, at the price of fewer blocks. Chosen by measurement on
// an H200 (bench_gemv, each product on weights not in L2): at n = 1, 16 warps of one row each read
// 3.4-3.7 TB/s on the 4096-row decode shapes, and 8 warps with 8 steps in flight 3.9-4.0 TB/s on the
// 18560-21504-row ones and 4.6 TB/s on the 131072-row head (3.92 ms for the GEMVs of a
// Nemotron-H-8B step; 8 warps with 4 steps everywhere: 4.29 ms). From n = 2 cuBLAS reads as fast or
// faster (n = 2: 4.30 vs 4.40 ms a step; n = 4: 4.34 vs 5.44; n = 8 is bound by the FMA issue rate
// here), so the CUDA backend takes this kernel only for n = 1; n <= KRK_GEMV_MAX_N stay supported.
template <int N> enum kr_status launch_gemv(const struct krk_gemv_params *p, cudaStream_t stream)
{
    if constexpr (N == 1) {
        switch (p->config) { // alternatives measured against the default by bench_gemv
        case 1:
            return launch_gemv_cfg<N, 1, 4, 8>(p, stream);
        case 2:
            return launch_gemv_cfg<N, 1, 8, 8>(p, stream);
        case 3:
            return launch_gemv_cfg<N, 2, 4, 8>(p, stream);
        case 4:
            return launch_gemv_cfg<N, 1, 4, 16>(p, stream);
        default: // tall weights (the Mamba input, MLP up and output heads) stream best with more
                 // steps in flight per warp, the 4096-row ones with more warps per staged x
            if (p->rows >= 16384) {
                return launch_gemv_cfg<N, 1, 8, 8>(p, stream);
            }
            return launch_gemv_cfg<N, 1, 4, 16>(p, stream);
        }
    } else if constexpr (N == 2) {
        switch (p->config) { // alternatives measured against the default by bench_gemv
        case 1:
            return launch_gemv_cfg<N, 1, 4, 16>(p, stream);
        case 2:
            return launch_gemv_cfg<N, 2, 2, 16>(p, stream);
        case 3:
            return launch_gemv_cfg<N, 1, 4, 8>(p, stream);
        case 4:
            return launch_gemv_cfg<N, 2, 4, 8>(p, stream);
        default:
            return launch_gemv_cfg<N, 2, 2, 8>(p, stream);
        }
    } else if constexpr (N <= 4) {
        return launch_gemv_cfg<N, 2, 2, 8>(p, stream);
    } else if constexpr (N <= 6) {
        return launch_gemv_cfg<N, 2, 2, 16>(p, stream);
    } else {
        return launch_gemv_cfg<N, 4, 1, 8>(p, stream);
    }
}

__global__ void add_bias_kernel(float *KRK_RESTRICT y, int64_t ldy, const float *KRK_RESTRICT bias, int64_t n,
                                int64_t rows)
{
    krk::kernel_prologue();
    for (int64_t t = blockIdx.y; t < n; t += gridDim.y) {
        for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows;
             r += (int64_t)gridDim.x * blockDim.x) {
            y[t * ldy + r] += bias[r];
        }
    }
}

// Whether the byte ranges [a, a + an) and [b, b + bn) share a byte.
bool overlaps(const void *a, size_t an, const void *b, size_t bn)
{
    const char *pa = static_cast<const char *>(a), *pb = static_cast<const char *>(b);
    return pa < pb + bn && pb < pa + an;
}

} // namespace
} // namespace krk

using namespace krk;

extern "C" enum kr_status krk_gemv(const struct krk_gemv_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p);
    KRK_REQUIRE(p->n >= 0 && p->n <= KRK_GEMV_MAX_N && p->rows >= 1 && p->cols >= 8 && p->cols % 8 == 0);
    KRK_REQUIRE(p->ldx >= p->cols && p->ldy >= p->rows);
    KRK_REQUIRE(p->config >= 0 && p->config < KRK_GEMV_CONFIGS);
    KRK_REQUIRE(!p->norm_w || (p->n == 1 && p->cols <= KRK_GEMV_NORM_MAX_COLS));
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->x && p->w && p->y && ((uintptr_t)p->w & 15) == 0);
    // other blocks still read x (and, with the norm, write norm_out) while a block writes its results
    const size_t x_bytes = (size_t)((p->n - 1) * p->ldx + p->cols) * sizeof(float);
    const size_t y_bytes = (size_t)((p->n - 1) * p->ldy + p->rows) * sizeof(float);
    const size_t row_bytes = (size_t)p->cols * sizeof(float);
    KRK_REQUIRE(!p->norm_w || (p->norm_out && !overlaps(p->norm_out, row_bytes, p->x, x_bytes) &&
                               !overlaps(p->norm_out, row_bytes, p->y, y_bytes)));
    KRK_REQUIRE(!p->acc || (!overlaps(p->acc, y_bytes, p->x, x_bytes) && !overlaps(p->acc, y_bytes, p->y, y_bytes) &&
                            !(p->norm_w && overlaps(p->acc, y_bytes, p->norm_out, row_bytes))));
    switch (p->n) {
    case 1:
        return launch_gemv<1>(p, stream);
    case 2:
        return launch_gemv<2>(p, stream);
    case 3:
        return launch_gemv<3>(p, stream);
    case 4:
        return launch_gemv<4>(p, stream);
    case 5:
        return launch_gemv<5>(p, stream);
    case 6:
        return launch_gemv<6>(p, stream);
    case 7:
        return launch_gemv<7>(p, stream);
    default:
        return launch_gemv<8>(p, stream);
    }
}

extern "C" enum kr_status krk_add_bias(float *y, int64_t ldy, const float *bias, int64_t n, int64_t rows,
                                       cudaStream_t stream)
{
    KRK_REQUIRE(n >= 0 && rows >= 1 && ldy >= rows);
    if (n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(y && bias);
    int64_t bx = (rows + 255) / 256;
    bx = bx > 65535 ? 65535 : bx;
    const dim3 grid((unsigned)bx, (unsigned)(n < 65535 ? n : 65535));
    krk::launch_maybe_pdl(krk::pdl_enabled(), add_bias_kernel, grid, dim3(256), 0, stream, y, ldy, bias, n, rows);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}
