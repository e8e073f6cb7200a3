// Rotary embedding at the positions of the batch. One block per token: the block computes cos/sin
// of a chunk of frequencies into shared memory once, then rotates that chunk in every vector of
// the token. Angles and products are rounded exactly as cpu_rope computes them (fp32 angle
// pos * inv_freq, fp32 cos/sin, no fused multiply-add), so large positions (128K) agree with the
// CPU up to the last-ulp differences of the cos/sin implementations.
#include "common/util.cuh"

namespace krk {
namespace {

constexpr int kRopeThreads = 128;
constexpr int kRopeChunk = 256; // frequencies per shared-memory chunk

__global__ void rope_kernel(float *x, int64_t ld, int64_t n_vec, int64_t stride, int64_t off, int64_t dim,
                            bool interleaved, const float *KRK_RESTRICT inv_freq, float factor,
                            const int32_t *KRK_RESTRICT pos, int64_t n_tok)
{
    krk::kernel_prologue();
    __shared__ float cs[kRopeChunk], sn[kRopeChunk];
    const int64_t half = dim / 2;
    for (int64_t t = blockIdx.x; t < n_tok; t += gridDim.x) {
        const float p = (float)pos[t];
        float *xt = x + t * ld + off;
        for (int64_t j0 = 0; j0 < half; j0 += kRopeChunk) {
            const int jn = (int)(half - j0 < kRopeChunk ? half - j0 : kRopeChunk);
            for (int i = threadIdx.x; i < jn; i += blockDim.x) {
                const float ang = __fmul_rn(p, inv_freq[j0 + i]);
                float s, c;
                sincosf(ang, &s, &c);
                cs[i] = __fmul_rn(c, factor);
                sn[i] = __fmul_rn(s, factor);
            }
            __syncthreads();
            const int64_t items = n_vec * jn;
            for (int64_t k = threadIdx.x; k < items; k += blockDim.x) {
                const int64_t v = k / jn;
                const int jj = (int)(k - v * jn);
                const int64_t j = j0 + jj;
                float *xv = xt + v * stride;
                const int64_t i0 = interleaved ? 2 * j : j, i1 = interleaved ? 2 * j + 1 : j + half;
                const float a = xv[i0], b = xv[i1];
                xv[i0] = __fsub_rn(__fmul_rn(a, cs[jj]), __fmul_rn(b, sn[jj]));
                xv[i1] = __fadd_rn(__fmul_rn(a, sn[jj]), __fmul_rn(b, cs[jj]));
            }
            __syncthreads(); // the next chunk overwrites cs/sn
        }
    }
}

} // namespace
} // namespace krk

using namespace krk;

extern "C" enum kr_status krk_rope(const struct krk_rope_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p);
    KRK_REQUIRE(p->n_tok >= 0 && p->n_vec >= 0 && p->dim >= 0 && p->dim % 2 == 0 && p->off >= 0);
    if (p->n_tok == 0 || p->n_vec == 0 || p->dim == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->x && p->inv_freq && p->pos);
    const unsigned blocks = (unsigned)(p->n_tok < (1 << 20) ? p->n_tok : (1 << 20));
    krk::launch_maybe_pdl(krk::pdl_enabled(), rope_kernel, blocks, kRopeThreads, 0, stream, p->x, p->ld, p->n_vec,
                          p->stride, p->off, p->dim, p->interleaved, p->inv_freq, p->factor, p->pos, p->n_tok);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}
