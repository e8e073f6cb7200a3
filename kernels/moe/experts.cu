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
//
// FP8 experts in 128 x 128 blocks with widths in whole blocks (the DeepSeek checkpoints) take grouped
// products on tensor cores instead (krk_moe_experts_grouped below): the (token, expert) pairs sorted
// by expert into chunks of up to 16, and per chunk and 16 weight rows one thread block running the
// skinny kernel's mma.sync m16n8k32 e4m3 loop (gemm/fp8.cu) over the chunk's gathered rows, so an
// expert's weights are read once per chunk of its tokens, not once per token.
#include <cuda_fp8.h>

#include "common/util.cuh"
#include "gemm/fp8-mma.cuh"
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

// ---- grouped FP8 products ------------------------------------------------------------------------

constexpr int kGrWarps = 8;
constexpr int kGrChunk = 16; // rows of a chunk: two n8 tiles

// The (token, expert) pairs pk = t * n_used + k sorted by expert: rowmap[offset[e] .. + count[e]) holds
// expert e's pairs (in no particular order: each pair's row is computed alone, so the order does not
// change a value), and chunks[c] = {e, first sorted position, rows (<= 16)} for c < *n_chunks. One
// block; the counts and offsets in shared memory (n_expert <= kGrMaxExperts).
constexpr int kGrMaxExperts = 2048;
__global__ void __launch_bounds__(1024) experts_sort_kernel(const int32_t *KRK_RESTRICT ids, int64_t n_pairs,
                                                            int64_t n_expert, int32_t *KRK_RESTRICT rowmap,
                                                            int4 *KRK_RESTRICT chunks, int32_t *KRK_RESTRICT n_chunks)
{
    krk::kernel_prologue();
    __shared__ int32_t cnt[kGrMaxExperts], off[kGrMaxExperts];
    for (int64_t e = threadIdx.x; e < n_expert; e += blockDim.x) {
        cnt[e] = 0;
    }
    __syncthreads();
    for (int64_t pk = threadIdx.x; pk < n_pairs; pk += blockDim.x) {
        const int32_t e = ids[pk];
        if (e >= 0 && e < n_expert) {
            atomicAdd(&cnt[e], 1);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t run = 0, nc = 0;
        for (int32_t e = 0; e < (int32_t)n_expert; e++) {
            off[e] = run;
            for (int32_t s0 = 0; s0 < cnt[e]; s0 += kGrChunk) {
                chunks[nc++] = make_int4(e, run + s0, cnt[e] - s0 < kGrChunk ? cnt[e] - s0 : kGrChunk, 0);
            }
            run += cnt[e];
            cnt[e] = 0;
        }
        *n_chunks = nc;
    }
    __syncthreads();
    for (int64_t pk = threadIdx.x; pk < n_pairs; pk += blockDim.x) {
        const int32_t e = ids[pk];
        if (e >= 0 && e < n_expert) {
            rowmap[off[e] + atomicAdd(&cnt[e], 1)] = (int32_t)pk;
        }
    }
}

struct GroupedArgs {
    const uint8_t *q;     // activation codes [.., ldq]: row pk / n_used (by_token) or pk
    int64_t ldq;
    const float *as;      // activation scales [nkb, s_ld]
    int64_t s_ld;
    bool by_token;
    int64_t n_used;
    const int32_t *rowmap;
    const int4 *chunks;
    const int32_t *n_chunks;
    const uint8_t *const *w0;  // per expert: up (first pass) or down; [rows, cols] codes
    const float *const *s0;    // its scales [rows / br, cols / 128]
    const uint8_t *const *w1;  // gate (first pass, NULL when not gated)
    const float *const *s1;
    int64_t rows, cols;
    int br;
    int act;              // first pass: act(gate) * up or act(up); < 0: the plain product
    float *y;             // [pairs, ldy], row pk
    int64_t ldy;
};

// One block: the chunk blockIdx.y's rows against 16 rows (blockIdx.x) of its expert's w0 (and w1),
// the 128-column blocks of K shared by the 8 warps as in the skinny kernel, the fp32 promotion per
// block with the weight's and each row's activation scale, the warps' sums in warp order.
template <bool GATED>
__global__ void __launch_bounds__(kGrWarps * 32) experts_grouped_kernel(const GroupedArgs a)
{
    constexpr int NM = GATED ? 2 : 1;
    __shared__ float red[NM][kGrWarps][8][32];
    pdl_trigger();
    pdl_wait(); // the chunks, the codes and the scales come from the kernels before
    const int c = blockIdx.y;
    if (c >= *a.n_chunks) {
        return;
    }
    const int4 ch = a.chunks[c];
    const int e = ch.x, first = ch.y, nrow = ch.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int64_t r0 = (int64_t)blockIdx.x * 16, nkb = a.cols / 128;
    const bool v0 = r0 + g < a.rows, v1 = r0 + g + 8 < a.rows;
    const uint8_t *wb[NM];
    const float *wsr[NM];
    wb[0] = a.w0[e];
    wsr[0] = a.s0[e] + (r0 / a.br) * nkb;
    if (GATED) {
        wb[NM - 1] = a.w1[e];
        wsr[NM - 1] = a.s1[e] + (r0 / a.br) * nkb;
    }
    // this lane's B rows (row g of each n8 tile) and its fragment columns' rows (2 tg, 2 tg + 1)
    int64_t brow[2], crow[2][2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int tl = j * 8 + g;
        brow[j] = -1;
        if (tl < nrow) {
            const int64_t pk = a.rowmap[first + tl];
            brow[j] = a.by_token ? pk / a.n_used : pk;
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int tc = j * 8 + 2 * tg + i;
            crow[j][i] = -1;
            if (tc < nrow) {
                const int64_t pk = a.rowmap[first + tc];
                crow[j][i] = a.by_token ? pk / a.n_used : pk;
            }
        }
    }
    const int nt = nrow > 8 ? 2 : 1;
    float acc[NM][2][4];
#pragma unroll
    for (int m = 0; m < NM; m++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                acc[m][j][i] = 0.0f;
            }
        }
    }
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (int64_t kb = warp; kb < nkb; kb += kGrWarps) {
        uint4 w[NM][4];
#pragma unroll
        for (int m = 0; m < NM; m++) {
            const uint8_t *p0 = wb[m] + (r0 + g) * a.cols + kb * 128 + 16 * tg;
            const uint8_t *p1 = wb[m] + (r0 + g + 8) * a.cols + kb * 128 + 16 * tg;
            w[m][0] = v0 ? ld_stream8(p0) : z;
            w[m][1] = v1 ? ld_stream8(p1) : z;
            w[m][2] = v0 ? ld_stream8(p0 + 64) : z;
            w[m][3] = v1 ? ld_stream8(p1 + 64) : z;
        }
        float wsc[NM];
#pragma unroll
        for (int m = 0; m < NM; m++) {
            wsc[m] = __ldg(wsr[m] + kb);
        }
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (j >= nt) {
                break;
            }
            uint4 b0 = z, b1 = z;
            if (brow[j] >= 0) {
                const uint8_t *xr = a.q + brow[j] * a.ldq + kb * 128 + 16 * tg;
                b0 = __ldg(reinterpret_cast<const uint4 *>(xr));
                b1 = __ldg(reinterpret_cast<const uint4 *>(xr + 64));
            }
            const float sa0 = crow[j][0] >= 0 ? __ldg(a.as + kb * a.s_ld + crow[j][0]) : 0.0f;
            const float sa1 = crow[j][1] >= 0 ? __ldg(a.as + kb * a.s_ld + crow[j][1]) : 0.0f;
#pragma unroll
            for (int m = 0; m < NM; m++) {
                float f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_e4m3(f, w[m][0].x, w[m][1].x, w[m][0].y, w[m][1].y, b0.x, b0.y);
                mma_e4m3(f, w[m][0].z, w[m][1].z, w[m][0].w, w[m][1].w, b0.z, b0.w);
                mma_e4m3(f, w[m][2].x, w[m][3].x, w[m][2].y, w[m][3].y, b1.x, b1.y);
                mma_e4m3(f, w[m][2].z, w[m][3].z, w[m][2].w, w[m][3].w, b1.z, b1.w);
                acc[m][j][0] = fmaf(f[0], sa0 * wsc[m], acc[m][j][0]);
                acc[m][j][1] = fmaf(f[1], sa1 * wsc[m], acc[m][j][1]);
                acc[m][j][2] = fmaf(f[2], sa0 * wsc[m], acc[m][j][2]);
                acc[m][j][3] = fmaf(f[3], sa1 * wsc[m], acc[m][j][3]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < NM; m++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                red[m][warp][j * 4 + i][lane] = acc[m][j][i];
            }
        }
    }
    __syncthreads();
    for (int el = threadIdx.x; el < 8 * 32; el += kGrWarps * 32) {
        const int l = el & 31, ji = el >> 5, j = ji >> 2, i = ji & 3;
        const int64_t row = r0 + (l >> 2) + (i >= 2 ? 8 : 0);
        const int tl = j * 8 + 2 * (l & 3) + (i & 1);
        if (row >= a.rows || tl >= nrow) {
            continue;
        }
        float v[NM];
#pragma unroll
        for (int m = 0; m < NM; m++) {
            v[m] = 0.0f;
#pragma unroll
            for (int w = 0; w < kGrWarps; w++) {
                v[m] += red[m][w][ji][l];
            }
        }
        float h = v[0];
        if (a.act >= 0) {
            h = GATED ? act_apply(a.act, v[NM - 1]) * v[0] : act_apply(a.act, v[0]);
        }
        a.y[(int64_t)a.rowmap[first + tl] * a.ldy + row] = h;
    }
}

// out[t, o] = sum over k in selection order of weights[t, k] * y[t * n_used + k, o] (valid experts).
__global__ void experts_combine_kernel(const float *KRK_RESTRICT y, int64_t d_out, int64_t n, int64_t n_expert,
                                       int64_t n_used, const int32_t *KRK_RESTRICT ids,
                                       const float *KRK_RESTRICT weights, float *KRK_RESTRICT out)
{
    krk::kernel_prologue();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * d_out) {
        return;
    }
    const int64_t t = i / d_out, o = i % d_out;
    float acc = 0.0f;
    for (int64_t k = 0; k < n_used; k++) {
        const int64_t pk = t * n_used + k;
        const int32_t e = ids[pk];
        if (e >= 0 && e < n_expert) {
            acc += weights[pk] * y[pk * d_out + o];
        }
    }
    out[i] = acc;
}

// The grouped path's workspace: y (fp32, the hidden rows, then the down products), the hidden rows'
// codes and scales, the x rows' codes and scales, the sort.
struct GroupedWs {
    float *y;
    uint8_t *hq, *xq;
    float *hs, *xs;
    int32_t *rowmap, *n_chunks;
    int4 *chunks;
    size_t bytes;
};

size_t al256(size_t b)
{
    return (b + 255) & ~(size_t)255;
}

GroupedWs grouped_ws(void *base, int64_t n, int64_t n_used, int64_t d_in, int64_t d_ffn, int64_t d_out)
{
    const int64_t pairs = n * n_used, wide = d_ffn > d_out ? d_ffn : d_out;
    const int64_t max_chunks = pairs / kGrChunk + (pairs < 4096 ? pairs : 4096) + 1;
    GroupedWs w = {};
    char *p = static_cast<char *>(base);
    size_t o = 0;
    const auto take = [&](size_t b) {
        char *r = p ? p + o : nullptr;
        o += al256(b);
        return r;
    };
    w.y = reinterpret_cast<float *>(take((size_t)(pairs * wide) * 4));
    w.hq = reinterpret_cast<uint8_t *>(take((size_t)(pairs * d_ffn)));
    w.hs = reinterpret_cast<float *>(take((size_t)(pairs * (d_ffn / 128)) * 4));
    w.xq = reinterpret_cast<uint8_t *>(take((size_t)(n * d_in)));
    w.xs = reinterpret_cast<float *>(take((size_t)(n * (d_in / 128)) * 4));
    w.rowmap = reinterpret_cast<int32_t *>(take((size_t)pairs * 4));
    w.chunks = reinterpret_cast<int4 *>(take((size_t)max_chunks * sizeof(int4)));
    w.n_chunks = reinterpret_cast<int32_t *>(take(4));
    w.bytes = o;
    return w;
}

// Chunks the first pass may have: a pair count's worth of full chunks plus one partial per expert.
int64_t grouped_max_chunks(int64_t pairs, int64_t n_expert)
{
    const int64_t a = (pairs + kGrChunk - 1) / kGrChunk + n_expert;
    return a < pairs ? a : pairs;
}

bool grouped_takes(const struct krk_experts_params *p, const struct krk_expert_ptrs *w)
{
    return w->block_c == 128 && w->block_r > 0 && w->block_r % 16 == 0 && p->d_in % 128 == 0 &&
           p->d_ffn % 128 == 0 && p->n_expert <= kGrMaxExperts && p->n * p->n_used <= INT32_MAX &&
           grouped_max_chunks(p->n * p->n_used, p->n_expert) <= 65535;
}

enum kr_status experts_grouped(const struct krk_experts_params *p, const struct krk_expert_ptrs *w,
                               const struct krk_ctx *ctx)
{
    const int64_t pairs = p->n * p->n_used;
    const GroupedWs g = grouped_ws(ctx->workspace, p->n, p->n_used, p->d_in, p->d_ffn, p->d_out);
    KRK_REQUIRE(ctx->workspace_bytes >= g.bytes);
    const int64_t max_chunks = grouped_max_chunks(pairs, p->n_expert);
    KRK_REQUIRE(max_chunks <= pairs / kGrChunk + (pairs < 4096 ? pairs : 4096) + 1);
    krk::launch_maybe_pdl(krk::pdl_enabled(), experts_sort_kernel, 1, 1024, 0, ctx->stream, p->ids, pairs,
                          p->n_expert, g.rowmap, g.chunks, g.n_chunks);
    KRK_CHECK_LAUNCH();
    const struct krk_fp8_quant_params qx = {.x = p->x, .ldx = p->d_in, .n = p->n, .cols = p->d_in, .block = 128,
                                            .q = g.xq, .ldq = p->d_in, .scale = g.xs, .s_ld = p->n, .ue8m0 = w->ue8m0};
    enum kr_status st = krk_fp8_quant(&qx, ctx->stream);
    if (st != KR_OK) {
        return st;
    }
    GroupedArgs a = {.q = g.xq, .ldq = p->d_in, .as = g.xs, .s_ld = p->n, .by_token = true, .n_used = p->n_used,
                     .rowmap = g.rowmap, .chunks = g.chunks, .n_chunks = g.n_chunks,
                     .w0 = reinterpret_cast<const uint8_t *const *>(w->up), .s0 = w->up_s,
                     .w1 = reinterpret_cast<const uint8_t *const *>(w->gate), .s1 = w->gate_s, .rows = p->d_ffn,
                     .cols = p->d_in, .br = (int)w->block_r, .act = (int)p->act, .y = g.y, .ldy = p->d_ffn};
    const dim3 g1((unsigned)((p->d_ffn + 15) / 16), (unsigned)max_chunks);
    if (w->gate) {
        krk::launch_maybe_pdl(krk::pdl_enabled(), experts_grouped_kernel<true>, g1, kGrWarps * 32, 0, ctx->stream, a);
    } else {
        krk::launch_maybe_pdl(krk::pdl_enabled(), experts_grouped_kernel<false>, g1, kGrWarps * 32, 0, ctx->stream,
                              a);
    }
    KRK_CHECK_LAUNCH();
    const struct krk_fp8_quant_params qh = {.x = g.y, .ldx = p->d_ffn, .n = pairs, .cols = p->d_ffn, .block = 128,
                                            .q = g.hq, .ldq = p->d_ffn, .scale = g.hs, .s_ld = pairs,
                                            .ue8m0 = w->ue8m0};
    st = krk_fp8_quant(&qh, ctx->stream);
    if (st != KR_OK) {
        return st;
    }
    a.q = g.hq;
    a.ldq = p->d_ffn;
    a.as = g.hs;
    a.s_ld = pairs;
    a.by_token = false;
    a.w0 = reinterpret_cast<const uint8_t *const *>(w->down);
    a.s0 = w->down_s;
    a.w1 = nullptr;
    a.s1 = nullptr;
    a.rows = p->d_out;
    a.cols = p->d_ffn;
    a.act = -1;
    a.ldy = p->d_out;
    const dim3 g2((unsigned)((p->d_out + 15) / 16), (unsigned)max_chunks);
    krk::launch_maybe_pdl(krk::pdl_enabled(), experts_grouped_kernel<false>, g2, kGrWarps * 32, 0, ctx->stream, a);
    KRK_CHECK_LAUNCH();
    const int64_t n_out = p->n * p->d_out;
    krk::launch_maybe_pdl(krk::pdl_enabled(), experts_combine_kernel, (unsigned)((n_out + 255) / 256), 256, 0,
                          ctx->stream, g.y, p->d_out, p->n, p->n_expert, p->n_used, p->ids, p->weights, p->out);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

} // namespace
} // namespace krk

using namespace krk;

extern "C" size_t krk_moe_experts_workspace_bytes(int64_t n, int64_t n_used, int64_t d_in, int64_t d_ffn,
                                                  int64_t d_out, bool fp8)
{
    if (n <= 0 || n_used <= 0 || d_ffn <= 0) {
        return 0;
    }
    const size_t plain = (size_t)n * (size_t)n_used * (size_t)d_ffn * sizeof(float);
    if (!fp8 || d_in % 128 || d_ffn % 128) {
        return plain;
    }
    const size_t grouped = grouped_ws(nullptr, n, n_used, d_in, d_ffn, d_out).bytes;
    return grouped > plain ? grouped : plain;
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
    const bool fp8 = w->block_c > 0;
    if (fp8 && !p->plain && grouped_takes(p, w)) {
        KRK_REQUIRE(w->up_s && w->down_s && (!w->gate || w->gate_s));
        return experts_grouped(p, w, ctx);
    }
    KRK_REQUIRE(ctx->workspace_bytes >= (size_t)p->n * (size_t)p->n_used * (size_t)p->d_ffn * sizeof(float));
    float *hidden = static_cast<float *>(ctx->workspace);
    const float *x = p->x;
    if (fp8) {
        KRK_REQUIRE(w->block_r > 0 && w->up_s && w->down_s && (!w->gate || w->gate_s) && w->xq);
        const struct krk_fp8_quant_params q = {.x = p->x, .ldx = p->d_in, .n = p->n, .cols = p->d_in,
                                               .block = w->block_c, .xq = w->xq, .ldxq = p->d_in,
                                               .ue8m0 = w->ue8m0};
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
                                               .ldxq = p->d_ffn, .ue8m0 = w->ue8m0};
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
