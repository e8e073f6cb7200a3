// Skinny products on tensor cores (krk_skinny): n = 2..32 activation rows against a bf16 weight,
// bound by streaming the weight once. The decode step of a few to a few dozen sequences.
//
// Roles: the weight is the mma's B operand (k16 x n8: eight weight rows), x its A operand (m16 x
// k16: sixteen tokens; rows past n are zeros), so one mma.m16n8k16 multiplies 16 tokens by 8 rows
// over 16 columns. A block of 8 warps owns 128 weight rows (16 per warp) and `krb` columns; the
// columns of one row range are split over blocks when the matrix is wide (blockIdx.y).
//
// Column order inside a 32-column step: lane (g = lane / 4, t = lane % 4) loads 8 consecutive
// bf16 of weight rows g and g + 8 at column 8 t with one 16-byte load each (the warp covers 64
// contiguous bytes of 16 rows per step). Those 8 columns are taken as the lane's k = 2t, 2t+1,
// 2t+8, 2t+9 of two successive k16 products (the first four, then the last four): a permutation of
// k that is the same for A and B, so the products are the plain dot products. The matching A
// fragment is then 16 contiguous bytes of x per token row, which x's staging in shared memory (bf16,
// rows padded by 64 bytes so that the 8 lanes of a 16-byte phase hit distinct banks) serves with
// one load per token row pair.
//
// Pipeline: each warp keeps U steps of weights in flight in registers (a ring: the loads of step
// s + U are issued as step s is consumed); the first U go out before the programmatic-launch wait,
// since weights are written by no kernel.
//
// Reduction: with one column block the results go straight to y (+ bias). Otherwise each block
// stores its partial sums in the workspace, counts itself in on its row range's counter, and the
// last block to arrive adds the partials in column-block order (deterministic) and resets the
// counter for the next product.
#include "common/mma.cuh"
#include "common/util.cuh"

namespace krk {
namespace {

constexpr int kSkWarps = 8;
constexpr int kSkRows = kSkWarps * 16; // weight rows per block
constexpr int kSkPad = 32;             // bf16 of padding per staged token row (64 bytes)
constexpr size_t kSkCounterBytes = 256;

struct sk_cfg {
    int krb; // columns per block (a multiple of 64)
    int u;   // steps of 32 columns in flight per warp
};
// 0 is the default; the others are alternatives measured by bench_gemv.
constexpr sk_cfg kSkCfg[KRK_SKINNY_CONFIGS] = {{1024, 8}, {2048, 8}, {512, 8}, {1024, 4}};

__host__ __device__ constexpr int64_t sk_div_up(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

// Columns per block for this shape: the configuration's, unless the matrix is narrower.
inline int sk_krb(int64_t cols, int config)
{
    const int64_t c64 = sk_div_up(cols, 64) * 64;
    return (int)(c64 < kSkCfg[config].krb ? c64 : kSkCfg[config].krb);
}

inline size_t sk_counter_region(int64_t rows)
{
    const size_t b = (size_t)sk_div_up(rows, kSkRows) * sizeof(unsigned);
    return (b + kSkCounterBytes - 1) / kSkCounterBytes * kSkCounterBytes;
}

__device__ __forceinline__ uint4 sk_pack8(float4 a, float4 b)
{
    return make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y), pack_bf16(b.z, b.w));
}

template <int NT, int U>
__global__ void __launch_bounds__(kSkWarps * 32)
    skinny_kernel(const float *KRK_RESTRICT x, int64_t ldx, const uint16_t *KRK_RESTRICT xb, int64_t ldxb,
                  const uint16_t *KRK_RESTRICT w, const float *KRK_RESTRICT bias, int n, int64_t rows, int64_t cols,
                  int krb, int kblocks, float *KRK_RESTRICT y, int64_t ldy, unsigned *counters, float *part)
{
    constexpr int MT = NT > 16 ? 2 : 1; // m16 tiles of tokens
    extern __shared__ uint4 xs4[];      // [NT][krb + kSkPad] bf16
    uint16_t *xs = reinterpret_cast<uint16_t *>(xs4);
    const int stride = krb + kSkPad;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int64_t rb = blockIdx.x;
    const int kb = blockIdx.y;
    const int64_t row_w = rb * kSkRows + warp * 16;
    const int64_t c_begin = (int64_t)kb * krb;
    const int len = (int)(cols - c_begin < krb ? cols - c_begin : krb); // > 0, a multiple of 8
    const int steps = (len + 31) / 32;
    const bool v0 = row_w + g < rows, v1 = row_w + 8 + g < rows;
    const uint16_t *w0 = w + (v0 ? row_w + g : 0) * cols + c_begin + 8 * t;
    const uint16_t *w1 = w + (v1 ? row_w + 8 + g : 0) * cols + c_begin + 8 * t;
    const uint4 zero = make_uint4(0, 0, 0, 0);

    uint4 buf[U][2];
#pragma unroll
    for (int u = 0; u < U; u++) {
        const bool ok = u < steps && u * 32 + 8 * t < len;
        buf[u][0] = ok && v0 ? ld_stream(w0 + u * 32) : zero;
        buf[u][1] = ok && v1 ? ld_stream(w1 + u * 32) : zero;
    }
    pdl_trigger();
    pdl_wait(); // x, y, the counters and the partials belong to earlier kernels

    // stage x[0..NT) of this block's columns as bf16 (zeros past n and past the matrix)
    const int groups = krb / 8;
    const bool xvec = xb == nullptr && (ldx % 4) == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
    for (int i = threadIdx.x; i < NT * groups; i += blockDim.x) {
        const int tok = i / groups, c = (i - tok * groups) * 8;
        uint4 v = zero;
        if (tok < n && c < len) {
            if (xb) {
                v = *reinterpret_cast<const uint4 *>(xb + tok * ldxb + c_begin + c);
            } else if (xvec) {
                const float4 *p = reinterpret_cast<const float4 *>(x + tok * ldx + c_begin + c);
                v = sk_pack8(p[0], p[1]);
            } else {
                const float *p = x + tok * ldx + c_begin + c;
                v = sk_pack8(make_float4(p[0], p[1], p[2], p[3]), make_float4(p[4], p[5], p[6], p[7]));
            }
        }
        *reinterpret_cast<uint4 *>(xs + tok * stride + c) = v;
    }
    __syncthreads();

    float acc[MT][2][4];
#pragma unroll
    for (int m = 0; m < MT; m++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                acc[m][r][e] = 0.0f;
            }
        }
    }
    if (row_w < rows) { // warp-uniform
        for (int s = 0; s < steps; s += U) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (s + u < steps) {
                    const int c = (s + u) * 32 + 8 * t;
                    uint4 alo[MT], ahi[MT];
#pragma unroll
                    for (int m = 0; m < MT; m++) {
                        alo[m] = *reinterpret_cast<const uint4 *>(xs + (16 * m + g) * stride + c);
                        ahi[m] = NT > 8 ? *reinterpret_cast<const uint4 *>(xs + (16 * m + 8 + g) * stride + c) : zero;
                    }
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        const uint4 b = buf[u][r];
#pragma unroll
                        for (int m = 0; m < MT; m++) {
                            const uint32_t a0[4] = {alo[m].x, ahi[m].x, alo[m].y, ahi[m].y};
                            const uint32_t a1[4] = {alo[m].z, ahi[m].z, alo[m].w, ahi[m].w};
                            mma_bf16(acc[m][r], a0, b.x, b.y);
                            mma_bf16(acc[m][r], a1, b.z, b.w);
                        }
                    }
                    const int sn = s + u + U;
                    const bool ok = sn < steps && sn * 32 + 8 * t < len;
                    buf[u][0] = ok && v0 ? ld_stream(w0 + sn * 32) : zero;
                    buf[u][1] = ok && v1 ? ld_stream(w1 + sn * 32) : zero;
                }
            }
        }
    }

    // acc[m][r][e]: token 16 m + g (+ 8 for e >= 2), row row_w + 8 r + 2 t (+ 1 for odd e)
    if (kblocks == 1) {
#pragma unroll
        for (int m = 0; m < MT; m++) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int tok = 16 * m + g + (e >= 2 ? 8 : 0);
                    const int64_t row = row_w + 8 * r + 2 * t + (e & 1);
                    if (tok < n && row < rows) {
                        y[tok * ldy + row] = bias ? acc[m][r][e] + bias[row] : acc[m][r][e];
                    }
                }
            }
        }
        return;
    }
#pragma unroll
    for (int m = 0; m < MT; m++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int tok = 16 * m + g + (e >= 2 ? 8 : 0);
                const int64_t row = row_w + 8 * r + 2 * t + (e & 1);
                if (tok < n && row < rows) {
                    part[((int64_t)kb * n + tok) * rows + row] = acc[m][r][e];
                }
            }
        }
    }
    __shared__ unsigned last;
    __threadfence(); // the partials are visible device-wide before the count
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&counters[rb], 1u) == (unsigned)kblocks - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    const int64_t r_end = rows - rb * kSkRows < kSkRows ? rows - rb * kSkRows : kSkRows;
    for (int i = threadIdx.x; i < n * kSkRows; i += blockDim.x) {
        const int tok = i / kSkRows;
        const int64_t row = rb * kSkRows + (i - tok * kSkRows);
        if (row - rb * kSkRows >= r_end) {
            continue;
        }
        float v = 0.0f;
        for (int k = 0; k < kblocks; k++) {
            v += __ldcg(part + ((int64_t)k * n + tok) * rows + row);
        }
        y[tok * ldy + row] = bias ? v + bias[row] : v;
    }
    if (threadIdx.x == 0) {
        counters[rb] = 0;
    }
}

template <int NT, int U> enum kr_status launch_skinny(const struct krk_skinny_params *p, cudaStream_t stream)
{
    const int krb = sk_krb(p->cols, p->config);
    const int64_t kblocks = sk_div_up(p->cols, krb);
    const int64_t rblocks = sk_div_up(p->rows, kSkRows);
    KRK_REQUIRE(rblocks <= INT32_MAX && kblocks <= 65535);
    const size_t smem = (size_t)NT * (size_t)(krb + kSkPad) * 2;
    static bool smem_set = false; // one opt-in per instantiation (the largest size any config asks)
    if (!smem_set) {
        KRK_CUDA_TRY(cudaFuncSetAttribute(skinny_kernel<NT, U>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          NT * (2048 + kSkPad) * 2));
        smem_set = true;
    }
    unsigned *counters = static_cast<unsigned *>(p->ws);
    float *part = kblocks > 1 ? reinterpret_cast<float *>(static_cast<char *>(p->ws) + sk_counter_region(p->rows))
                              : nullptr;
    const uint16_t *xb = reinterpret_cast<const uint16_t *>(p->xb);
    KRK_CUDA_TRY(launch_maybe_pdl(p->pdl || pdl_enabled(), skinny_kernel<NT, U>,
                                  dim3((unsigned)rblocks, (unsigned)kblocks), dim3(kSkWarps * 32), smem, stream, p->x,
                                  p->ldx, xb, p->ldxb, reinterpret_cast<const uint16_t *>(p->w), p->bias, (int)p->n,
                                  p->rows, p->cols, krb, (int)kblocks, p->y, p->ldy, counters, part));
    return KR_OK;
}

template <int NT> enum kr_status launch_skinny_u(const struct krk_skinny_params *p, cudaStream_t stream)
{
    switch (kSkCfg[p->config].u) {
    case 4:
        return launch_skinny<NT, 4>(p, stream);
    default:
        return launch_skinny<NT, 8>(p, stream);
    }
}

} // namespace
} // namespace krk

using namespace krk;

extern "C" size_t krk_skinny_ws_bytes(int64_t n, int64_t rows, int64_t cols, int config)
{
    if (n < 1 || rows < 1 || cols < 8 || config < 0 || config >= KRK_SKINNY_CONFIGS) {
        return 0;
    }
    const int64_t kblocks = sk_div_up(cols, sk_krb(cols, config));
    if (kblocks == 1) {
        return 0;
    }
    return sk_counter_region(rows) + (size_t)kblocks * (size_t)n * (size_t)rows * sizeof(float);
}

extern "C" enum kr_status krk_skinny(const struct krk_skinny_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p);
    KRK_REQUIRE(p->n >= 0 && p->n <= KRK_SKINNY_MAX_N && p->rows >= 1 && p->cols >= 8 && p->cols % 8 == 0);
    KRK_REQUIRE(p->ldy >= p->rows && p->config >= 0 && p->config < KRK_SKINNY_CONFIGS);
    KRK_REQUIRE(p->xb ? (p->ldxb >= p->cols && p->ldxb % 8 == 0 && ((uintptr_t)p->xb & 15) == 0)
                      : (p->ldx >= p->cols));
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE((p->x || p->xb) && p->w && p->y && ((uintptr_t)p->w & 15) == 0);
    const size_t need = krk_skinny_ws_bytes(p->n, p->rows, p->cols, p->config);
    KRK_REQUIRE(need == 0 || (p->ws && p->ws_bytes >= need && ((uintptr_t)p->ws & 15) == 0));
    if (p->n <= 8) {
        return launch_skinny_u<8>(p, stream);
    }
    if (p->n <= 16) {
        return launch_skinny_u<16>(p, stream);
    }
    return launch_skinny_u<32>(p, stream);
}
