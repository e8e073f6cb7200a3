// FP8 block-scaled products (DeepSeek's recipe; the CPU reference is model/fp8.h's kr_fp8_act_quant
// and kr_fp8_gemm): weights as E4M3 codes with one fp32 scale per block of block_r x block_c,
// activations quantized per row in blocks of block_c columns, fp32 accumulation.
//
//  - krk_fp8_quant: the activation quantization, bit for bit the CPU's (amax = max(|x|, 1e-4),
//    s = amax * fp32(1/448) or with ue8m0 the smallest power of two with s * 448 >= amax,
//    q = e4m3(x / s) rounded to nearest even and saturated), one warp per
//    (row, block). It writes the codes and scales cuBLASLt reads, and/or the dequantized values
//    xq = e4m3_to_f32(q) * s that the CUDA-core kernels below multiply with the weight codes.
//  - krk_fp8_gemv: decode-shaped products, bound by streaming the codes once. A warp owns RW weight
//    rows; lane l reads 16 codes of each row at column 512 s + 16 l (one 16-byte non-caching load),
//    decodes them (cvt e4m3x2 -> f16x2 -> f32, exact) and multiplies them with the 16 matching xq
//    values of every activation row; the sum over its 16 columns (which lie in one block) is scaled
//    by the block's weight scale and added to the lane's accumulator. The lanes' accumulators are
//    summed at the end. Mathematically this is the reference's sum over blocks of
//    (dot of codes) * a_s * w_s; the rounding differs (fp32 partial sums in another order).
//  - krk_fp8_gemm_lt: larger products through cuBLASLt's block-scaled FP8 matmul (sm_90:
//    CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F for the weight, VEC128_32F for the activations,
//    the tensor cores' partial sums promoted to fp32 per 128-column block), its algorithm chosen once
//    per shape and kept.
#include <cublasLt.h>
#include <cuda_fp8.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/util.cuh"
#include "gemm/fp8-mma.cuh"
#include "krk/gemm.h"

namespace krk {
namespace {

constexpr int kQuantWarps = 8;

__device__ __forceinline__ float e4m3_to_f32(uint8_t b)
{
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
    return __half2float(__half(h));
}

// One warp per (row t, block kb): amax over the block, then codes / dequantized values. xq may be x
// itself (every element is read and then written by the same lane).
__global__ void __launch_bounds__(kQuantWarps * 32)
    fp8_quant_kernel(const float *x, int64_t ldx, int64_t n, int64_t cols, int block, int64_t nkb,
                     uint8_t *KRK_RESTRICT q, int64_t ldq, float *KRK_RESTRICT scale, int64_t s_ld, float *xq,
                     int64_t ldxq, bool ue8m0)
{
    krk::kernel_prologue();
    const int lane = threadIdx.x & 31;
    const int64_t item = (int64_t)blockIdx.x * kQuantWarps + (threadIdx.x >> 5);
    if (item >= n * nkb) {
        return;
    }
    const int64_t t = item / nkb, kb = item % nkb;
    const int64_t c0 = kb * block, c1 = c0 + block < cols ? c0 + block : cols;
    const float *xr = x + t * ldx;
    float amax = 1e-4f; // the reference's floor
    for (int64_t c = c0 + lane; c < c1; c += 32) {
        amax = fmaxf(amax, fabsf(xr[c]));
    }
    amax = warp_max(amax);
    float s = amax * (1.0f / 448.0f);
    if (ue8m0) { // the smallest power of two s with s * 448 >= amax, exactly as the CPU computes it
        int e;
        const float f = frexpf(amax, &e);
        s = ldexpf(1.0f, f <= 0.875f ? e - 9 : e - 8);
    }
    for (int64_t c = c0 + lane; c < c1; c += 32) {
        const __nv_fp8_storage_t code = __nv_cvt_float_to_fp8(xr[c] / s, __NV_SATFINITE, __NV_E4M3);
        if (q) {
            q[t * ldq + c] = (uint8_t)code;
        }
        if (xq) {
            xq[t * ldxq + c] = e4m3_to_f32((uint8_t)code) * s;
        }
    }
    if (scale && lane == 0) {
        scale[kb * s_ld + t] = s;
    }
}

// The 16 codes of v as floats (exact).
__device__ __forceinline__ void decode16(const uint4 v, float (&f)[16])
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[i] & 0xffffu), __NV_E4M3);
        const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[i] >> 16), __NV_E4M3);
        const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
        f[4 * i + 0] = a.x;
        f[4 * i + 1] = a.y;
        f[4 * i + 2] = b.x;
        f[4 * i + 3] = b.y;
    }
}

struct Fp8GemvArgs {
    const float *xq;
    int64_t ldx, n;
    const uint8_t *w;
    const float *ws;
    int64_t rows, cols, ld_s;
    int br, bc;
    const float *bias;
    float *y;
    int64_t ldy;
};

constexpr int kGemvWarps = 8;

// Fast path: cols % 16 == 0, bc % 16 == 0, codes and xq 16-byte aligned (ldx % 4 == 0).
template <int N, int RW>
__global__ void __launch_bounds__(kGemvWarps * 32) fp8_gemv_kernel(const Fp8GemvArgs a, int t0)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row0 = ((int64_t)blockIdx.x * kGemvWarps + warp) * RW;
    const int64_t cols = a.cols;
    const uint8_t *wr[RW];
    const float *sr[RW];
    bool rv[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) {
        rv[r] = row0 + r < a.rows;
        const int64_t row = rv[r] ? row0 + r : 0;
        wr[r] = a.w + row * cols;
        sr[r] = a.ws + (row / a.br) * a.ld_s;
    }
    float acc[RW][N];
#pragma unroll
    for (int r = 0; r < RW; r++) {
#pragma unroll
        for (int t = 0; t < N; t++) {
            acc[r][t] = 0.0f;
        }
    }
    // the first codes go out before waiting for the kernel that wrote xq
    int64_t c = (int64_t)lane * 16;
    uint4 cur[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) {
        cur[r] = c < cols && rv[r] ? ld_stream8(wr[r] + c) : make_uint4(0, 0, 0, 0);
    }
    pdl_trigger();
    pdl_wait();
    const float *xt = a.xq + (int64_t)t0 * a.ldx;
    for (; c < cols; c += 512) {
        uint4 nxt[RW];
        const int64_t cn = c + 512;
#pragma unroll
        for (int r = 0; r < RW; r++) {
            nxt[r] = cn < cols && rv[r] ? ld_stream8(wr[r] + cn) : make_uint4(0, 0, 0, 0);
        }
        float xv[N][16];
#pragma unroll
        for (int t = 0; t < N; t++) {
            const float4 *p = reinterpret_cast<const float4 *>(xt + t * a.ldx + c);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float4 v = __ldg(p + i);
                xv[t][4 * i + 0] = v.x;
                xv[t][4 * i + 1] = v.y;
                xv[t][4 * i + 2] = v.z;
                xv[t][4 * i + 3] = v.w;
            }
        }
        const int64_t kb = c / a.bc;
#pragma unroll
        for (int r = 0; r < RW; r++) {
            float wf[16];
            decode16(cur[r], wf);
            const float s = rv[r] ? __ldg(sr[r] + kb) : 0.0f;
#pragma unroll
            for (int t = 0; t < N; t++) {
                float d = 0.0f;
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    d = fmaf(wf[j], xv[t][j], d);
                }
                acc[r][t] = fmaf(d, s, acc[r][t]);
            }
            cur[r] = nxt[r];
        }
    }
#pragma unroll
    for (int r = 0; r < RW; r++) {
#pragma unroll
        for (int t = 0; t < N; t++) {
            const float v = warp_sum(acc[r][t]);
            if (lane == 0 && rv[r]) {
                a.y[(int64_t)(t0 + t) * a.ldy + row0 + r] = a.bias ? v + a.bias[row0 + r] : v;
            }
        }
    }
}

// Any shape: one warp per (token, row), a code at a time, the block sums kept apart as the
// reference keeps them.
__global__ void __launch_bounds__(kGemvWarps * 32) fp8_gemv_any_kernel(const Fp8GemvArgs a)
{
    krk::kernel_prologue();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t item = (int64_t)blockIdx.x * kGemvWarps + warp;
    if (item >= a.n * a.rows) {
        return;
    }
    const int64_t t = item / a.rows, r = item % a.rows;
    const uint8_t *w = a.w + r * a.cols;
    const float *x = a.xq + t * a.ldx, *s = a.ws + (r / a.br) * a.ld_s;
    float acc = 0.0f;
    for (int64_t c0 = 0; c0 < a.cols; c0 += a.bc) {
        const int64_t c1 = c0 + a.bc < a.cols ? c0 + a.bc : a.cols;
        float d = 0.0f;
        for (int64_t c = c0 + lane; c < c1; c += 32) {
            d = fmaf(e4m3_to_f32(w[c]), x[c], d);
        }
        acc = fmaf(warp_sum(d), s[c0 / a.bc], acc);
    }
    if (lane == 0) {
        a.y[t * a.ldy + r] = a.bias ? acc + a.bias[r] : acc;
    }
}

// ---- the tensor-core skinny product (krk_fp8_skinny) ---------------------------------------------
//
// A block owns 16 weight rows (one m16 tile; block_r % 16 == 0 keeps them in one scale row) and its
// 8 warps share the 128-column blocks of K (warp w takes blocks w, w + 8, ...). Per block a lane
// (g = lane / 4, t = lane % 4) loads 16 codes of rows g and g + 8 at columns 128 kb + 64 h + 16 t
// (h = 0, 1) and the 16 codes of token g of every tile of 8 tokens at the same columns; the 32-bit
// words go to mma.sync m16n8k32 e4m3 (A words 0/2 of row g, 1/3 of row g + 8 as the fragment's
// k-halves): the k order inside a block is permuted, the same way for both operands, which the sum
// does not see. A block's four products accumulate in a fragment that is then added to the lane's
// fp32 accumulators times the weight block's scale and each token's activation scale (the recipe's
// promotion per 128 columns). The weights of the next block are in flight while one is multiplied.
// Up to 16 tokens (two n8 tiles) per pass.
// The warps' accumulators are summed in shared memory in warp order (deterministic).

constexpr int kSkWarps = 8;

struct Fp8SkinnyArgs {
    const uint8_t *q;      // activation codes [n, ldq]
    int64_t ldq;
    const float *as;       // activation scales [nkb, s_ld]
    int64_t s_ld, n;
    const uint8_t *w;      // weight codes [rows, cols]
    const float *ws;       // [ceil(rows / br), ld_s]
    int64_t rows, cols, ld_s;
    int br;
    const float *bias;
    float *y;
    int64_t ldy;
};

template <int NT>
__global__ void __launch_bounds__(kSkWarps * 32) fp8_skinny_kernel(const Fp8SkinnyArgs a, int t0)
{
    __shared__ float red[kSkWarps][NT * 4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int64_t r0 = (int64_t)blockIdx.x * 16;
    const int64_t nkb = a.cols / 128;
    const bool v0 = r0 + g < a.rows, v1 = r0 + g + 8 < a.rows;
    const uint8_t *w0 = a.w + (v0 ? r0 + g : 0) * a.cols + 16 * tg;
    const uint8_t *w1 = a.w + (v1 ? r0 + g + 8 : 0) * a.cols + 16 * tg;
    const float *wsr = a.ws + (r0 / a.br) * a.ld_s;
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            acc[j][i] = 0.0f;
        }
    }
    const uint4 z = make_uint4(0, 0, 0, 0);
    int64_t kb = warp;
    uint4 cur[4];
    if (kb < nkb) {
        cur[0] = v0 ? ld_stream8(w0 + kb * 128) : z;
        cur[1] = v1 ? ld_stream8(w1 + kb * 128) : z;
        cur[2] = v0 ? ld_stream8(w0 + kb * 128 + 64) : z;
        cur[3] = v1 ? ld_stream8(w1 + kb * 128 + 64) : z;
    }
    pdl_trigger();
    pdl_wait(); // the activations come from the kernel before
    for (; kb < nkb; kb += kSkWarps) {
        const int64_t kn = kb + kSkWarps;
        uint4 nxt[4] = {z, z, z, z};
        if (kn < nkb) {
            nxt[0] = v0 ? ld_stream8(w0 + kn * 128) : z;
            nxt[1] = v1 ? ld_stream8(w1 + kn * 128) : z;
            nxt[2] = v0 ? ld_stream8(w0 + kn * 128 + 64) : z;
            nxt[3] = v1 ? ld_stream8(w1 + kn * 128 + 64) : z;
        }
        const float wsc = __ldg(wsr + kb);
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int64_t tok = t0 + j * 8 + g; // the token whose codes this lane feeds to B
            uint4 b0 = z, b1 = z;
            if (tok < a.n) {
                const uint8_t *xr = a.q + tok * a.ldq + kb * 128 + 16 * tg;
                b0 = __ldg(reinterpret_cast<const uint4 *>(xr));
                b1 = __ldg(reinterpret_cast<const uint4 *>(xr + 64));
            }
            float f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_e4m3(f, cur[0].x, cur[1].x, cur[0].y, cur[1].y, b0.x, b0.y);
            mma_e4m3(f, cur[0].z, cur[1].z, cur[0].w, cur[1].w, b0.z, b0.w);
            mma_e4m3(f, cur[2].x, cur[3].x, cur[2].y, cur[3].y, b1.x, b1.y);
            mma_e4m3(f, cur[2].z, cur[3].z, cur[2].w, cur[3].w, b1.z, b1.w);
            // the fragment's columns are tokens t0 + 8 j + 2 tg + (i & 1)
            const int64_t ta = t0 + j * 8 + 2 * tg, tb = ta + 1;
            const float sa = ta < a.n ? __ldg(a.as + kb * a.s_ld + ta) * wsc : 0.0f;
            const float sb = tb < a.n ? __ldg(a.as + kb * a.s_ld + tb) * wsc : 0.0f;
            acc[j][0] = fmaf(f[0], sa, acc[j][0]);
            acc[j][1] = fmaf(f[1], sb, acc[j][1]);
            acc[j][2] = fmaf(f[2], sa, acc[j][2]);
            acc[j][3] = fmaf(f[3], sb, acc[j][3]);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            cur[i] = nxt[i];
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            red[warp][j * 4 + i][lane] = acc[j][i];
        }
    }
    __syncthreads();
    // NT * 4 * 32 sums of kSkWarps values, a thread each (in warp order)
    for (int e = threadIdx.x; e < NT * 4 * 32; e += kSkWarps * 32) {
        const int l = e & 31, ji = e >> 5, j = ji >> 2, i = ji & 3;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < kSkWarps; w++) {
            v += red[w][ji][l];
        }
        const int64_t row = r0 + (l >> 2) + (i >= 2 ? 8 : 0);
        const int64_t tok = t0 + j * 8 + 2 * (l & 3) + (i & 1);
        if (row < a.rows && tok < a.n) {
            a.y[tok * a.ldy + row] = a.bias ? v + a.bias[row] : v;
        }
    }
}

template <int N, int RW>
enum kr_status gemv_launch(const Fp8GemvArgs &a, int t0, cudaStream_t stream)
{
    const int64_t blocks = (a.rows + kGemvWarps * RW - 1) / (kGemvWarps * RW);
    KRK_REQUIRE(blocks <= INT32_MAX);
    krk::launch_maybe_pdl(krk::pdl_enabled(), fp8_gemv_kernel<N, RW>, (unsigned)blocks, kGemvWarps * 32, 0, stream, a,
                          t0);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

bool aligned16(const void *p)
{
    return ((uintptr_t)p & 15) == 0;
}

} // namespace
} // namespace krk

using namespace krk;

extern "C" enum kr_status krk_fp8_quant(const struct krk_fp8_quant_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p && p->n >= 0 && p->cols >= 1 && p->block >= 1 && p->ldx >= p->cols);
    KRK_REQUIRE(p->q || p->scale || p->xq);
    KRK_REQUIRE(!p->q || p->ldq >= p->cols);
    KRK_REQUIRE(!p->xq || p->ldxq >= p->cols);
    KRK_REQUIRE(!p->scale || p->s_ld >= p->n);
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->x);
    const int64_t nkb = (p->cols + p->block - 1) / p->block;
    const int64_t blocks = (p->n * nkb + kQuantWarps - 1) / kQuantWarps;
    KRK_REQUIRE_MSG(blocks <= INT32_MAX, "%lld rows of %lld blocks", (long long)p->n, (long long)nkb);
    krk::launch_maybe_pdl(krk::pdl_enabled(), fp8_quant_kernel, (unsigned)blocks, kQuantWarps * 32, 0, stream, p->x,
                          p->ldx, p->n, p->cols, (int)p->block, nkb, p->q, p->ldq, p->scale, p->s_ld, p->xq, p->ldxq,
                          p->ue8m0);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

static bool weight_valid(const struct krk_fp8_weight *w)
{
    return w->q && w->scale && w->rows >= 1 && w->cols >= 1 && w->block_r >= 1 && w->block_c >= 1 &&
           w->ld_s >= (w->cols + w->block_c - 1) / w->block_c;
}

extern "C" enum kr_status krk_fp8_gemv(const struct krk_fp8_gemv_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p && weight_valid(&p->w) && p->n >= 0 && p->ldx >= p->w.cols && p->ldy >= p->w.rows);
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->xq && p->y);
    const Fp8GemvArgs a = {.xq = p->xq, .ldx = p->ldx, .n = p->n, .w = p->w.q, .ws = p->w.scale, .rows = p->w.rows,
                           .cols = p->w.cols, .ld_s = p->w.ld_s, .br = p->w.block_r, .bc = p->w.block_c,
                           .bias = p->bias, .y = p->y, .ldy = p->ldy};
    const bool fast = p->w.cols % 16 == 0 && p->w.block_c % 16 == 0 && aligned16(p->w.q) && aligned16(p->xq) &&
                      p->ldx % 4 == 0 && !p->any_kernel;
    if (!fast) {
        const int64_t blocks = (p->n * p->w.rows + kGemvWarps - 1) / kGemvWarps;
        KRK_REQUIRE(blocks <= INT32_MAX);
        krk::launch_maybe_pdl(krk::pdl_enabled(), fp8_gemv_any_kernel, (unsigned)blocks, kGemvWarps * 32, 0, stream,
                              a);
        KRK_CHECK_LAUNCH();
        return KR_OK;
    }
    // tokens in groups of up to 4 (more rows of x per weight load only pay while the kernel stays
    // bound by the weight stream)
    for (int64_t t0 = 0; t0 < p->n;) {
        const int64_t left = p->n - t0;
        enum kr_status st;
        int take;
        if (left >= 4) {
            take = 4;
            st = gemv_launch<4, 2>(a, (int)t0, stream);
        } else if (left == 3) {
            take = 3;
            st = gemv_launch<3, 2>(a, (int)t0, stream);
        } else if (left == 2) {
            take = 2;
            st = gemv_launch<2, 4>(a, (int)t0, stream);
        } else {
            take = 1;
            st = gemv_launch<1, 4>(a, (int)t0, stream);
        }
        if (st != KR_OK) {
            return st;
        }
        t0 += take;
    }
    return KR_OK;
}

extern "C" bool krk_fp8_skinny_takes(const struct krk_fp8_weight *w)
{
    return w->block_c == 128 && w->block_r % 16 == 0 && w->cols % 128 == 0 && aligned16(w->q) &&
           w->ld_s >= w->cols / 128;
}

extern "C" enum kr_status krk_fp8_skinny(const struct krk_fp8_mm_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p && weight_valid(&p->w) && p->n >= 0 && p->ldq >= p->w.cols && p->ldq % 16 == 0 &&
                p->ldy >= p->w.rows && p->s_ld >= p->n);
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->q && p->scale && p->y && aligned16(p->q));
    KRK_REQUIRE_MSG(krk_fp8_skinny_takes(&p->w), "FP8 weight [%lld, %lld] in blocks of %dx%d",
                    (long long)p->w.rows, (long long)p->w.cols, (int)p->w.block_r, (int)p->w.block_c);
    const Fp8SkinnyArgs a = {.q = p->q, .ldq = p->ldq, .as = p->scale, .s_ld = p->s_ld, .n = p->n, .w = p->w.q,
                             .ws = p->w.scale, .rows = p->w.rows, .cols = p->w.cols, .ld_s = p->w.ld_s,
                             .br = p->w.block_r, .bias = p->bias, .y = p->y, .ldy = p->ldy};
    const int64_t blocks = (p->w.rows + 15) / 16;
    KRK_REQUIRE(blocks <= INT32_MAX);
    for (int64_t t0 = 0; t0 < p->n; t0 += 16) { /* tokens in groups of 16 (two m16n8 tiles) */
        if (p->n - t0 > 8) {
            krk::launch_maybe_pdl(krk::pdl_enabled(), fp8_skinny_kernel<2>, (unsigned)blocks, kSkWarps * 32, 0,
                                  stream, a, (int)t0);
        } else {
            krk::launch_maybe_pdl(krk::pdl_enabled(), fp8_skinny_kernel<1>, (unsigned)blocks, kSkWarps * 32, 0,
                                  stream, a, (int)t0);
        }
        KRK_CHECK_LAUNCH();
    }
    return KR_OK;
}

/* ---- cuBLASLt ---------------------------------------------------------------------------------- */

namespace {

constexpr int kLtSlots = 128;

struct LtPlan {
    bool used, ok;
    int64_t rows, cols, n, ldq, ldy;
    uint32_t align[3]; // of the weight, the activations and y: part of the key (the heuristic
                       // assumes 256-byte aligned operands unless told)
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
    size_t ws;
};

} // namespace

struct krk_fp8_lt {
    cublasLtHandle_t h;
    void *ws;
    size_t ws_bytes;
    int next;
    LtPlan plan[kLtSlots];
};

static void plan_clear(LtPlan *p)
{
    if (p->op) {
        cublasLtMatmulDescDestroy(p->op);
    }
    if (p->a) {
        cublasLtMatrixLayoutDestroy(p->a);
    }
    if (p->b) {
        cublasLtMatrixLayoutDestroy(p->b);
    }
    if (p->d) {
        cublasLtMatrixLayoutDestroy(p->d);
    }
    memset(p, 0, sizeof *p);
}

extern "C" struct krk_fp8_lt *krk_fp8_lt_create(void *ws, size_t ws_bytes)
{
    struct krk_fp8_lt *lt = static_cast<struct krk_fp8_lt *>(calloc(1, sizeof(struct krk_fp8_lt)));
    if (!lt) {
        return NULL;
    }
    if (cublasLtCreate(&lt->h) != CUBLAS_STATUS_SUCCESS) {
        free(lt);
        return NULL;
    }
    lt->ws = ws;
    lt->ws_bytes = ws_bytes;
    return lt;
}

extern "C" void krk_fp8_lt_free(struct krk_fp8_lt *lt)
{
    if (!lt) {
        return;
    }
    for (int i = 0; i < kLtSlots; i++) {
        plan_clear(&lt->plan[i]);
    }
    cublasLtDestroy(lt->h);
    free(lt);
}

// A plan for y [n, ldy] (column-major rows x n in cuBLAS's terms) = W [rows, cols] (A, transposed)
// times the codes X [n, ldq] (B, cols x n column-major); ok = false when cuBLASLt has no algorithm.
static uint32_t align_of(const void *p)
{
    uint32_t a = 256;
    while (a > 1 && ((uintptr_t)p & (a - 1)) != 0) {
        a >>= 1;
    }
    return a;
}

static LtPlan *plan_for(struct krk_fp8_lt *lt, int64_t rows, int64_t cols, int64_t n, int64_t ldq, int64_t ldy,
                        const uint32_t (&align)[3])
{
    for (int i = 0; i < kLtSlots; i++) {
        LtPlan *p = &lt->plan[i];
        if (p->used && p->rows == rows && p->cols == cols && p->n == n && p->ldq == ldq && p->ldy == ldy &&
            memcmp(p->align, align, sizeof p->align) == 0) {
            return p;
        }
    }
    LtPlan *p = &lt->plan[lt->next];
    lt->next = (lt->next + 1) % kLtSlots;
    plan_clear(p);
    p->used = true;
    p->rows = rows;
    p->cols = cols;
    p->n = n;
    p->ldq = ldq;
    p->ldy = ldy;
    memcpy(p->align, align, sizeof p->align);
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res = {};
    int n_res = 0;
    const size_t ws = lt->ws_bytes;
    bool ok = cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) ==
                  CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) ==
                  CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof a_mode) ==
                  CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof b_mode) ==
                  CUBLAS_STATUS_SUCCESS &&
              cublasLtMatrixLayoutCreate(&p->a, CUDA_R_8F_E4M3, (uint64_t)cols, (uint64_t)rows, cols) ==
                  CUBLAS_STATUS_SUCCESS &&
              cublasLtMatrixLayoutCreate(&p->b, CUDA_R_8F_E4M3, (uint64_t)cols, (uint64_t)n, ldq) ==
                  CUBLAS_STATUS_SUCCESS &&
              cublasLtMatrixLayoutCreate(&p->d, CUDA_R_32F, (uint64_t)rows, (uint64_t)n, ldy) ==
                  CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) ==
                  CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0],
                                                   sizeof align[0]) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1],
                                                   sizeof align[1]) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align[2],
                                                   sizeof align[2]) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align[2],
                                                   sizeof align[2]) == CUBLAS_STATUS_SUCCESS;
    // the scale pointers must be set for the heuristic to consider the scaled kernels; any
    // non-NULL device address serves until the call sets the real ones
    if (ok) {
        const void *any = lt->ws;
        ok = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &any, sizeof any) ==
                 CUBLAS_STATUS_SUCCESS &&
             cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &any, sizeof any) ==
                 CUBLAS_STATUS_SUCCESS &&
             cublasLtMatmulAlgoGetHeuristic(lt->h, p->op, p->a, p->b, p->d, p->d, pref, 1, &res, &n_res) ==
                 CUBLAS_STATUS_SUCCESS &&
             n_res > 0 && res.state == CUBLAS_STATUS_SUCCESS;
    }
    if (pref) {
        cublasLtMatmulPreferenceDestroy(pref);
    }
    p->ok = ok;
    if (ok) {
        p->algo = res.algo;
        p->ws = res.workspaceSize;
    }
    return p;
}

extern "C" bool krk_fp8_lt_takes(const struct krk_fp8_weight *w, int64_t n)
{
    return w->block_r == 128 && w->block_c == 128 && w->cols % 16 == 0 && w->cols >= 128 && w->rows % 128 == 0 &&
           n >= 4 && n % 4 == 0 && w->ld_s == (w->cols + 127) / 128 && aligned16(w->q);
}

extern "C" enum kr_status krk_fp8_gemm_lt(struct krk_fp8_lt *lt, const struct krk_fp8_mm_params *p,
                                          cudaStream_t stream)
{
    KRK_REQUIRE(lt && p && weight_valid(&p->w) && p->n >= 0 && p->ldq >= p->w.cols && p->ldq % 16 == 0 &&
                p->ldy >= p->w.rows && (p->n == 0 || p->s_ld == p->n));
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->q && p->scale && p->y && aligned16(p->q));
    if (!krk_fp8_lt_takes(&p->w, p->n)) {
        return KR_ERR_UNSUPPORTED;
    }
    const uint32_t align[3] = {align_of(p->w.q), align_of(p->q), align_of(p->y)};
    LtPlan *pl = plan_for(lt, p->w.rows, p->w.cols, p->n, p->ldq, p->ldy, align);
    if (!pl->ok) {
        return KR_ERR_UNSUPPORTED;
    }
    const void *as = p->w.scale, *bs = p->scale;
    if (cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &as, sizeof as) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &bs, sizeof bs) !=
            CUBLAS_STATUS_SUCCESS) {
        return KR_ERR_CUDA;
    }
    const float one = 1.0f, zero = 0.0f;
    const cublasStatus_t s = cublasLtMatmul(lt->h, pl->op, &one, p->w.q, pl->a, p->q, pl->b, &zero, p->y, pl->d,
                                            p->y, pl->d, &pl->algo, lt->ws, pl->ws, stream);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "krk: cublasLtMatmul (FP8 block-scaled, %lld x %lld x %lld): status %d\n",
                (long long)p->w.rows, (long long)p->n, (long long)p->w.cols, (int)s);
        return KR_ERR_CUDA;
    }
    return p->bias ? krk_add_bias(p->y, p->ldy, p->bias, p->n, p->w.rows, stream) : KR_OK;
}
