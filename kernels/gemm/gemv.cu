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
// Several weights sharing x (krk_gemv_params.more) run as one grid: consecutive ranges of blocks
// take consecutive weights, so small projections of one input (q, k, v) fill the GPU together
// instead of leaving most SMs idle in launches of their own. An activation of the output can be
// written next to it (act_out), sparing an elementwise kernel after the up projection.
#include "common/util.cuh"
#include "norm/act.cuh"

namespace krk {
namespace {

// The launch's weights: part i takes blocks [blk0[i], blk0[i + 1]).
struct GemvArgs {
    const float *x;
    int64_t ldx, cols;
    int ch, n_parts;
    int blk0[KRK_GEMV_MAX_PARTS + 1];
    const uint16_t *w[KRK_GEMV_MAX_PARTS];
    const float *bias[KRK_GEMV_MAX_PARTS];
    int64_t rows[KRK_GEMV_MAX_PARTS];
    float *y[KRK_GEMV_MAX_PARTS];
    int64_t ldy[KRK_GEMV_MAX_PARTS];
    float *act_out;
    int64_t ld_act;
    int act;
};

constexpr int kGemvWarps = 8;          // default warps per block
constexpr int kGemvSmemFloats = 12288; // 48 KB of staged x

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

// At n = 1 (the decode path) two blocks must fit an SM: the 4096-row products have too few blocks
// to fill the GPU otherwise (the register cap keeps them from falling to one block per SM).
template <int N, int RW, int U, int W>
__global__ void __launch_bounds__(W * 32, N == 1 ? 2 : 1) gemv_kernel(const GemvArgs a)
{
    extern __shared__ float4 xs4[]; // [N][ch / 4], halves of 8-column groups swizzled (see staging)
    float *xs = reinterpret_cast<float *>(xs4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // this block's weight (block-uniform; constant indices keep the arguments in the parameter bank)
    int part = 0;
#pragma unroll
    for (int i = 1; i < KRK_GEMV_MAX_PARTS; i++) {
        part = i < a.n_parts && (int)blockIdx.x >= a.blk0[i] ? i : part;
    }
    const uint16_t *KRK_RESTRICT w = a.w[0];
    const float *KRK_RESTRICT bias = a.bias[0];
    int64_t rows = a.rows[0], ldy = a.ldy[0];
    float *KRK_RESTRICT y = a.y[0];
    int blk = (int)blockIdx.x;
#pragma unroll
    for (int i = 1; i < KRK_GEMV_MAX_PARTS; i++) {
        if (part == i) {
            w = a.w[i];
            bias = a.bias[i];
            rows = a.rows[i];
            ldy = a.ldy[i];
            y = a.y[i];
            blk -= a.blk0[i];
        }
    }
    const float *KRK_RESTRICT x = a.x;
    const int64_t ldx = a.ldx, cols = a.cols;
    const int ch = a.ch;
    const int64_t row0 = ((int64_t)blk * W + warp) * RW;
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
    pdl_wait(); // x and y belong to earlier kernels; the weights above do not
    for (int64_t c0 = 0; c0 < cols; c0 += ch) {
        const int len = (int)(cols - c0 < ch ? cols - c0 : ch); // a multiple of 8
        const int padded = (len + 255) / 256 * 256;             // <= ch
        const int steps = padded / 256;
        __syncthreads(); // the previous chunk's readers are done
                         // Column c goes to c ^ 4 when bit 5 of c is set: lanes with h = 1 then find their first
                         // 4 values in the second float4 of their group, which keeps each quarter warp's 16-byte
                         // reads on distinct banks, and every lane combines x[c..c+3] with weights 0..3.
#pragma unroll
        for (int t = 0; t < N; t++) {
            for (int c = threadIdx.x; c < padded; c += W * 32) {
                // x is rounded to bf16, the operand precision of the cuBLAS path, so that a row's result
                // does not depend on whether its batch takes this kernel or a GEMM
                xs[t * ch + (c ^ (((c >> 5) & 1) << 2))] =
                    c < len ? __bfloat162float(__float2bfloat16_rn(x[t * ldx + c0 + c])) : 0.0f;
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
            float v = warp_sum(acc[r][t]);
            if (lane == t && rv[r]) {
                v = bias ? v + bias[row0 + r] : v;
                y[t * ldy + row0 + r] = v;
                if (a.act_out) { // one weight only (krk_gemv checks)
                    a.act_out[t * a.ld_act + row0 + r] = act_apply(a.act, v);
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
    GemvArgs a = {};
    a.x = p->x;
    a.ldx = p->ldx;
    a.cols = p->cols;
    a.ch = (int)(cols_padded < cap ? cols_padded : cap);
    a.n_parts = 1 + p->n_more;
    a.act_out = p->act_out;
    a.ld_act = p->ld_act;
    a.act = p->act;
    const int64_t rows_per_block = (int64_t)W * RW;
    int64_t blocks = 0;
    for (int i = 0; i < a.n_parts; i++) {
        const struct krk_gemv_part q = i == 0 ? krk_gemv_part{p->w, p->bias, p->rows, p->y, p->ldy} : p->more[i - 1];
        a.blk0[i] = (int)blocks;
        a.w[i] = q.w;
        a.bias[i] = q.bias;
        a.rows[i] = q.rows;
        a.y[i] = q.y;
        a.ldy[i] = q.ldy;
        blocks += (q.rows + rows_per_block - 1) / rows_per_block;
        KRK_REQUIRE(blocks <= INT32_MAX);
    }
    a.blk0[a.n_parts] = (int)blocks;
    const size_t smem = (size_t)N * (size_t)a.ch * sizeof(float);
    KRK_CUDA_TRY(launch_maybe_pdl(p->pdl || pdl_enabled(), gemv_kernel<N, RW, U, W>, dim3((unsigned)blocks),
                                  dim3(W * 32), smem, stream, a));
    return KR_OK;
}

// Rows of all the launch's weights (the tiling is chosen by their sum).
int64_t total_rows(const struct krk_gemv_params *p)
{
    int64_t r = p->rows;
    for (int i = 0; i < p->n_more; i++) {
        r += p->more[i].rows;
    }
    return r;
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
            if (total_rows(p) >= 16384) {
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

} // namespace
} // namespace krk

using namespace krk;

extern "C" enum kr_status krk_gemv(const struct krk_gemv_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p);
    KRK_REQUIRE(p->n >= 0 && p->n <= KRK_GEMV_MAX_N && p->rows >= 1 && p->cols >= 8 && p->cols % 8 == 0);
    KRK_REQUIRE(p->ldx >= p->cols && p->ldy >= p->rows);
    KRK_REQUIRE(p->config >= 0 && p->config < KRK_GEMV_CONFIGS);
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->x && p->w && p->y && ((uintptr_t)p->w & 15) == 0);
    KRK_REQUIRE(p->n_more >= 0 && p->n_more < KRK_GEMV_MAX_PARTS);
    for (int i = 0; i < p->n_more; i++) {
        const struct krk_gemv_part &q = p->more[i];
        KRK_REQUIRE(q.w && q.y && ((uintptr_t)q.w & 15) == 0 && q.rows >= 1 && q.ldy >= q.rows);
    }
    KRK_REQUIRE(p->act_out == nullptr || (p->n_more == 0 && p->ld_act >= p->rows && act_valid(p->act)));
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
