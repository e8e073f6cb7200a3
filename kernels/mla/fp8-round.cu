// FP8 round trip of the DSA indexer's query and key rows (the DeepSeek reference's FP8 path), with
// the semantics of the CPU reference (cpu_fp8_round, model/fp8.c) bit for bit: an orthonormal
// Walsh-Hadamard transform in Sylvester order (butterflies a, b -> a + b, a - b at strides 1, 2, 4,
// ..., then a multiplication by dim^-0.5), per block of `block` elements amax = max(|x|, 1e-4),
// scale = amax * fp32(1/448) or the ue8m0 power of two, e4m3 rounding to nearest even with
// saturation at +-448, and back to fp32 as value * scale.
//
// One warp per row: lane l holds the E = dim/32 consecutive elements [l E, (l + 1) E). Butterfly
// strides below E pair elements of one lane; larger strides pair lane l with lane l ^ (stride / E),
// the lower lane computing a + b and the upper one a - b, the same fp32 operations as the CPU.
#include <cuda_fp8.h>

#include "common/util.cuh"

namespace krk {
namespace {

template <int E>
__global__ void fp8_round_kernel(float *KRK_RESTRICT x, int64_t ld, int64_t n, int block, bool ue8m0,
                                 float hscale)
{
    krk::kernel_prologue();
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= n) {
        return;
    }
    float *xr = x + row * ld + lane * E;
    float v[E];
#pragma unroll
    for (int j = 0; j < E; j++) {
        v[j] = xr[j];
    }
    // strides inside a lane
#pragma unroll
    for (int h = 1; h < E; h *= 2) {
#pragma unroll
        for (int j = 0; j < E; j++) {
            if ((j & h) == 0) {
                const float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
    }
    // strides across lanes
    for (int m = 1; m < 32; m *= 2) {
        const bool upper = (lane & m) != 0;
#pragma unroll
        for (int j = 0; j < E; j++) {
            const float other = __shfl_xor_sync(0xffffffffu, v[j], m);
            v[j] = upper ? other - v[j] : v[j] + other;
        }
    }
#pragma unroll
    for (int j = 0; j < E; j++) {
        v[j] *= hscale;
    }
    // block amax over the lanes of the block (block / E lanes, a power of two)
    float amax = 1e-4f;
#pragma unroll
    for (int j = 0; j < E; j++) {
        amax = fmaxf(amax, fabsf(v[j]));
    }
    const int lanes = block / E; // >= 1: a block holds whole lanes
    for (int m = 1; m < lanes && m < 32; m *= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    }
    float s;
    if (ue8m0) { // the smallest power of two s with s * 448 >= amax (exact)
        int e;
        const float f = frexpf(amax, &e);
        s = ldexpf(1.0f, f <= 0.875f ? e - 9 : e - 8);
    } else {
        s = amax * (1.0f / 448.0f);
    }
#pragma unroll
    for (int j = 0; j < E; j++) {
        const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(v[j] / s, __NV_SATFINITE, __NV_E4M3);
        const __half_raw hr = __nv_cvt_fp8_to_halfraw(q, __NV_E4M3);
        xr[j] = __half2float(__half(hr)) * s;
    }
}

template <int E>
enum kr_status launch(const struct krk_fp8_round_params *p, cudaStream_t stream)
{
    constexpr int kWarps = 8;
    const int64_t blocks = (p->n + kWarps - 1) / kWarps;
    KRK_REQUIRE(blocks <= INT32_MAX);
    const float hscale = (float)(1.0 / sqrt((double)p->dim));
    krk::launch_maybe_pdl(krk::pdl_enabled(), fp8_round_kernel<E>, (unsigned)blocks, kWarps * 32, 0, stream, p->x,
                          p->ld, p->n, (int)p->block, p->ue8m0, hscale);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

} // namespace
} // namespace krk

using namespace krk;

extern "C" enum kr_status krk_fp8_round(const struct krk_fp8_round_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p && p->hadamard);
    KRK_REQUIRE(p->dim >= 32 && p->dim <= 1024 && (p->dim & (p->dim - 1)) == 0);
    KRK_REQUIRE(p->block >= p->dim / 32 && p->block <= p->dim && p->dim % p->block == 0);
    KRK_REQUIRE(p->n >= 0 && p->ld >= p->dim);
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->x);
    switch (p->dim / 32) {
    case 1:
        return launch<1>(p, stream);
    case 2:
        return launch<2>(p, stream);
    case 4:
        return launch<4>(p, stream);
    case 8:
        return launch<8>(p, stream);
    case 16:
        return launch<16>(p, stream);
    default:
        return launch<32>(p, stream);
    }
}
