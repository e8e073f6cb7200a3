// Routed expert FFNs in two kernels, one warp per output element:
//   1. hidden[t*n_used + k, j] = act(gate_e[j] . x[t]) * (up_e[j] . x[t])   (or act(up_e[j] . x[t]))
//      for e = ids[t, k]; grid over (token-expert pairs, tiles of 8 hidden rows);
//   2. out[t, o] = sum_k weights[t, k] * (down_e[o] . hidden[t*n_used + k]); grid over (tokens,
//      tiles of 8 outputs), summing over k in selection order.
// Each dot product reads a bf16 weight row with 16-byte loads (8 values) when the row and the fp32
// vector are 16-byte aligned and the length is a multiple of 8, else one value per lane and step.
// Expert ids outside [0, n_expert) contribute zero.
// FP8 experts (krk_expert_ptrs.block_c > 0): x is quantized per block before kernel 1 and the hidden
// rows in place before kernel 2 (krk_fp8_quant's dequantized values), and each dot product reads
// E4M3 codes, 16 per lane and load, the sum over a block scaled by the block's weight scale.
#include <cuda_fp8.h>

#include "common/util.cuh"
#include "krk/gemm.h"
#include "norm/act.cuh"

namespace krk {
namespace {

constexpr int kExpWarps = 8;

// Sum over the warp of w[c] * x[c], c < len; every lane gets the result.
__device__ __forceinline__ float warp_dot(const uint16_t *KRK_RESTRICT w, const float *KRK_RESTRICT x, int64_t len)
{
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    if (len % 8 == 0 && ((uintptr_t)w & 15) == 0 && ((uintptr_t)x & 15) == 0) {
        for (int64_t c = lane * 8; c < len; c += 256) {
            const uint4 q = __ldg(reinterpret_cast<const uint4 *>(w + c));
            const float4 a = __ldg(reinterpret_cast<const float4 *>(x + c));
            const float4 b = __ldg(reinterpret_cast<const float4 *>(x + c + 4));
            acc = fmaf(a.x, __uint_as_float(q.x << 16), acc);
            acc = fmaf(a.y, __uint_as_float(q.x & 0xffff0000u), acc);
            acc = fmaf(a.z, __uint_as_float(q.y << 16), acc);
            acc = fmaf(a.w, __uint_as_float(q.y & 0xffff0000u), acc);
            acc = fmaf(b.x, __uint_as_float(q.z << 16), acc);
            acc = fmaf(b.y, __uint_as_float(q.z & 0xffff0000u), acc);
            acc = fmaf(b.z, __uint_as_float(q.w << 16), acc);
            acc = fmaf(b.w, __uint_as_float(q.w & 0xffff0000u), acc);
        }
    } else {
        for (int64_t c = lane; c < len; c += 32) {
            acc = fmaf(x[c], bf16_to_f32(w[c]), acc);
        }
    }
    return warp_sum(acc);
}

// Sum over the warp of w[c] * x[c], c < len, with w[c] = e4m3(q[c]) * s[c / bc].
__device__ __forceinline__ float warp_dot_fp8(const uint8_t *KRK_RESTRICT q, const float *KRK_RESTRICT s, int bc,
                                              const float *KRK_RESTRICT x, int64_t len)
{
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    if (len % 16 == 0 && bc % 16 == 0 && ((uintptr_t)q & 15) == 0 && ((uintptr_t)x & 15) == 0) {
        for (int64_t c = lane * 16; c < len; c += 512) {
            const uint4 v = __ldg(reinterpret_cast<const uint4 *>(q + c));
            const uint32_t w4[4] = {v.x, v.y, v.z, v.w};
            const float4 *xp = reinterpret_cast<const float4 *>(x + c);
            float d = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w4[i] & 0xffffu), __NV_E4M3);
                const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w4[i] >> 16), __NV_E4M3);
                const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
                const float4 xv = __ldg(xp + i);
                d = fmaf(a.x, xv.x, d);
                d = fmaf(a.y, xv.y, d);
                d = fmaf(b.x, xv.z, d);
                d = fmaf(b.y, xv.w, d);
            }
            acc = fmaf(d, __ldg(s + c / bc), acc);
        }
    } else {
        for (int64_t c = lane; c < len; c += 32) {
            const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q[c], __NV_E4M3);
            acc = fmaf(__half2float(__half(h)) * s[c / bc], x[c], acc);
        }
    }
    return warp_sum(acc);
}

// One row j of expert e: its dot product with x, bf16 or FP8 (block_c > 0).
__device__ __forceinline__ float row_dot(const void *w, const float *ws, int br, int bc, int64_t j, int64_t len,
                                         const float *x)
{
    if (bc > 0) {
        const int64_t ld_s = (len + bc - 1) / bc;
        return warp_dot_fp8(static_cast<const uint8_t *>(w) + j * len, ws + (j / br) * ld_s, bc, x, len);
    }
    return warp_dot(static_cast<const uint16_t *>(w) + j * len, x, len);
}

__global__ void __launch_bounds__(kExpWarps * 32)
    experts_hidden_kernel(const float *KRK_RESTRICT x, int64_t d_in, int64_t d_ffn, int64_t n_expert, int64_t n_used,
                          const int32_t *KRK_RESTRICT ids, const void *const *KRK_RESTRICT gate,
                          const void *const *KRK_RESTRICT up, const float *const *gate_s, const float *const *up_s,
                          int br, int bc, int act, float *KRK_RESTRICT hidden)
{
    krk::kernel_prologue();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t pk = blockIdx.x; // token-expert pair t * n_used + k
    const int64_t j = (int64_t)blockIdx.y * kExpWarps + warp;
    if (j >= d_ffn) {
        return;
    }
    const int64_t t = pk / n_used;
    const int32_t e = ids[pk];
    float h = 0.0f;
    if (e >= 0 && e < n_expert) {
        const float *xt = x + t * d_in;
        const float u = row_dot(up[e], bc ? up_s[e] : nullptr, br, bc, j, d_in, xt);
        if (gate) {
            const float g = row_dot(gate[e], bc ? gate_s[e] : nullptr, br, bc, j, d_in, xt);
            h = act_apply(act, g) * u;
        } else {
            h = act_apply(act, u);
        }
    }
    if (lane == 0) {
        hidden[pk * d_ffn + j] = h;
    }
}

__global__ void __launch_bounds__(kExpWarps * 32)
    experts_out_kernel(const float *KRK_RESTRICT hidden, int64_t d_ffn, int64_t d_out, int64_t n_expert, int64_t n_used,
                       const int32_t *KRK_RESTRICT ids, const float *KRK_RESTRICT weights,
                       const void *const *KRK_RESTRICT down, const float *const *down_s, int br, int bc,
                       float *KRK_RESTRICT out)
{
    krk::kernel_prologue();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t t = blockIdx.x;
    const int64_t o = (int64_t)blockIdx.y * kExpWarps + warp;
    if (o >= d_out) {
        return;
    }
    float acc = 0.0f;
    for (int64_t k = 0; k < n_used; k++) {
        const int64_t pk = t * n_used + k;
        const int32_t e = ids[pk];
        if (e >= 0 && e < n_expert) {
            acc += weights[pk] * row_dot(down[e], bc ? down_s[e] : nullptr, br, bc, o, d_ffn, hidden + pk * d_ffn);
        }
    }
    if (lane == 0) {
        out[t * d_out + o] = acc;
    }
}

} // namespace
} // namespace krk

using namespace krk;

extern "C" size_t krk_moe_experts_workspace_bytes(int64_t n, int64_t n_used, int64_t d_ffn)
{
    if (n <= 0 || n_used <= 0 || d_ffn <= 0) {
        return 0;
    }
    return (size_t)n * (size_t)n_used * (size_t)d_ffn * sizeof(float);
}

extern "C" enum kr_status krk_moe_experts(const struct krk_experts_params *p, const struct krk_expert_ptrs *w,
                                          const struct krk_ctx *ctx)
{
    KRK_REQUIRE(p && w && ctx);
    KRK_REQUIRE(p->n >= 0 && p->d_in >= 1 && p->d_ffn >= 1 && p->d_out >= 1 && p->n_expert >= 1 && p->n_used >= 1);
    KRK_REQUIRE(act_valid(p->act));
    const int64_t ffn_tiles = (p->d_ffn + kExpWarps - 1) / kExpWarps,
                  out_tiles = (p->d_out + kExpWarps - 1) / kExpWarps;
    KRK_REQUIRE(ffn_tiles <= 65535 && out_tiles <= 65535 && p->n * p->n_used <= INT32_MAX);
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->x && p->ids && p->weights && w->up && w->down && ctx->workspace && p->out);
    KRK_REQUIRE(ctx->workspace_bytes >= krk_moe_experts_workspace_bytes(p->n, p->n_used, p->d_ffn));
    float *hidden = static_cast<float *>(ctx->workspace);
    const bool fp8 = w->block_c > 0;
    const float *x = p->x;
    if (fp8) {
        KRK_REQUIRE(w->block_r > 0 && w->up_s && w->down_s && (!w->gate || w->gate_s) && w->xq);
        const struct krk_fp8_quant_params q = {.x = p->x, .ldx = p->d_in, .n = p->n, .cols = p->d_in,
                                               .block = w->block_c, .xq = w->xq, .ldxq = p->d_in};
        const enum kr_status st = krk_fp8_quant(&q, ctx->stream);
        if (st != KR_OK) {
            return st;
        }
        x = w->xq;
    }
    const dim3 g1((unsigned)(p->n * p->n_used), (unsigned)ffn_tiles);
    krk::launch_maybe_pdl(krk::pdl_enabled(), experts_hidden_kernel, g1, kExpWarps * 32, 0, ctx->stream, x, p->d_in,
                          p->d_ffn, p->n_expert, p->n_used, p->ids, w->gate, w->up, w->gate_s, w->up_s,
                          (int)w->block_r, fp8 ? (int)w->block_c : 0, (int)p->act, hidden);
    KRK_CHECK_LAUNCH();
    if (fp8) { /* the hidden rows quantized in place, as the down projection's input */
        const struct krk_fp8_quant_params q = {.x = hidden, .ldx = p->d_ffn, .n = p->n * p->n_used,
                                               .cols = p->d_ffn, .block = w->block_c, .xq = hidden,
                                               .ldxq = p->d_ffn};
        const enum kr_status st = krk_fp8_quant(&q, ctx->stream);
        if (st != KR_OK) {
            return st;
        }
    }
    const dim3 g2((unsigned)p->n, (unsigned)out_tiles);
    krk::launch_maybe_pdl(krk::pdl_enabled(), experts_out_kernel, g2, kExpWarps * 32, 0, ctx->stream, hidden, p->d_ffn,
                          p->d_out, p->n_expert, p->n_used, p->ids, p->weights, w->down, w->down_s, (int)w->block_r,
                          fp8 ? (int)w->block_c : 0, p->out);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}
