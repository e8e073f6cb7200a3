// Rotary embedding at the positions of the batch. Blocks per token and range of its vectors: the
// block computes cos/sin of a chunk of frequencies into shared memory once, then rotates that chunk
// in each of its vectors. Angles and products are rounded exactly as cpu_rope computes them (fp32 angle
// pos * inv_freq, fp32 cos/sin, no fused multiply-add), so large positions (128K) agree with the
// CPU up to the last-ulp differences of the cos/sin implementations.
#include "common/util.cuh"
#include "norm/rope.cuh"

namespace krk {
namespace {

constexpr int kRopeThreads = 256;
constexpr int kRopeChunk = 256; // frequencies per shared-memory chunk
constexpr int kRopeItems = 4;   // pairs per thread whose loads are issued together

// Grid (tokens, vector ranges): block (x, y) rotates vectors [y * vpb, (y + 1) * vpb) of its tokens,
// so that a single token's many heads spread over several blocks, and each thread loads all its
// pairs before rotating any (one round of memory latency instead of one per pair).
// Block rows [0, y0) take the first set of vectors, the rest the second (krk_rope_pair).
struct RopeSet {
    float *x;
    int64_t ld, n_vec, vpb, stride, off, dim;
    bool interleaved;
};

__global__ void __launch_bounds__(kRopeThreads)
    rope_kernel(RopeSet s0, RopeSet s1, unsigned y0, const float *KRK_RESTRICT inv_freq, float factor,
                const int32_t *KRK_RESTRICT pos, int64_t n_tok)
{
    const bool second = blockIdx.y >= y0;
    const RopeSet &st = second ? s1 : s0;
    float *x = st.x;
    const int64_t ld = st.ld, n_vec = st.n_vec, vpb = st.vpb, stride = st.stride, off = st.off, dim = st.dim;
    const bool interleaved = st.interleaved;
    const unsigned by = second ? blockIdx.y - y0 : blockIdx.y;
    // The angles depend only on the positions (uploaded before the step's first kernel) and the
    // frequencies: the first chunk's cos/sin are computed before the wait, overlapping the previous
    // kernel; x is read after it.
    krk::pdl_trigger();
    bool waited = false;
    __shared__ float cs[kRopeChunk], sn[kRopeChunk];
    const int64_t half = dim / 2;
    const int64_t v_begin = (int64_t)by * vpb;
    const int64_t nv = n_vec - v_begin < vpb ? n_vec - v_begin : vpb;
    if (nv <= 0) {
        return; // block-uniform
    }
    for (int64_t t = blockIdx.x; t < n_tok; t += gridDim.x) {
        const float p = (float)pos[t];
        float *xt = x + t * ld + off + v_begin * stride;
        for (int64_t j0 = 0; j0 < half; j0 += kRopeChunk) {
            const int jn = (int)(half - j0 < kRopeChunk ? half - j0 : kRopeChunk);
            for (int i = threadIdx.x; i < jn; i += blockDim.x) {
                krk::rope_cos_sin(p, inv_freq[j0 + i], factor, &cs[i], &sn[i]);
            }
            if (!waited) {
                krk::pdl_wait();
                waited = true;
            }
            __syncthreads();
            const int64_t items = nv * jn;
            for (int64_t k0 = threadIdx.x; k0 < items; k0 += (int64_t)kRopeItems * blockDim.x) {
                float a[kRopeItems], b[kRopeItems];
                float *xv[kRopeItems];
                int jj[kRopeItems];
                int64_t i0[kRopeItems], i1[kRopeItems];
#pragma unroll
                for (int u = 0; u < kRopeItems; u++) {
                    const int64_t k = k0 + (int64_t)u * blockDim.x;
                    const int64_t v = k < items ? k / jn : 0;
                    jj[u] = (int)(k - v * jn);
                    const int64_t j = j0 + jj[u];
                    xv[u] = xt + v * stride;
                    i0[u] = interleaved ? 2 * j : j;
                    i1[u] = interleaved ? 2 * j + 1 : j + half;
                    if (k < items) {
                        a[u] = xv[u][i0[u]];
                        b[u] = xv[u][i1[u]];
                    }
                }
#pragma unroll
                for (int u = 0; u < kRopeItems; u++) {
                    if (k0 + (int64_t)u * blockDim.x < items) {
                        krk::rope_rotate(a[u], b[u], cs[jj[u]], sn[jj[u]]);
                        xv[u][i0[u]] = a[u];
                        xv[u][i1[u]] = b[u];
                    }
                }
            }
            __syncthreads(); // the next chunk overwrites cs/sn
        }
    }
}

} // namespace
} // namespace krk

using namespace krk;

namespace {

// p's vectors, and q's (or none) in the same launch with p's frequencies and factor.
enum kr_status rope_launch(const krk_rope_params *p, const krk_rope_params *q, const krk_ctx *ctx)
{
    KRK_REQUIRE(p && ctx);
    const int64_t n_tok = ctx->batch.n_tok;
    const int32_t *pos = ctx->batch.pos;
    KRK_REQUIRE(n_tok >= 0 && p->n_vec >= 0 && p->dim >= 0 && p->dim % 2 == 0 && p->off >= 0);
    if ((p->n_vec == 0 || p->dim == 0) && q) { // only the second set: it becomes the first
        return rope_launch(q, nullptr, ctx);
    }
    if (n_tok == 0 || p->n_vec == 0 || p->dim == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->x && p->inv_freq && pos);
    const unsigned blocks = (unsigned)(n_tok < (1 << 20) ? n_tok : (1 << 20));
    // vectors per block: one round of kRopeItems pairs per thread over a chunk of frequencies
    auto set_of = [](const krk_rope_params &v) {
        const int64_t jn = v.dim / 2 < kRopeChunk ? v.dim / 2 : kRopeChunk;
        int64_t vpb = jn > 0 ? (int64_t)kRopeItems * kRopeThreads / jn : 1;
        vpb = vpb < 1 ? 1 : vpb;
        return RopeSet{v.x, v.ld, v.n_vec, vpb, v.stride, v.off, v.dim, v.interleaved};
    };
    const RopeSet s0 = set_of(*p);
    const int64_t vb0 = (p->n_vec + s0.vpb - 1) / s0.vpb;
    RopeSet s1 = s0;
    int64_t vb1 = 0;
    if (q && q->n_vec > 0 && q->dim > 0) {
        KRK_REQUIRE(q->x && q->dim % 2 == 0 && q->off >= 0);
        s1 = set_of(*q);
        vb1 = (q->n_vec + s1.vpb - 1) / s1.vpb;
    }
    KRK_REQUIRE(vb0 + vb1 <= 65535);
    krk::launch_maybe_pdl(krk::pdl_enabled(), rope_kernel, dim3(blocks, (unsigned)(vb0 + vb1)), kRopeThreads, 0,
                          ctx->stream, s0, s1, (unsigned)vb0, p->inv_freq, p->factor, pos, n_tok);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

} // namespace

extern "C" enum kr_status krk_rope(const struct krk_rope_params *p, const struct krk_ctx *ctx)
{
    return rope_launch(p, nullptr, ctx);
}

extern "C" enum kr_status krk_rope_pair(const struct krk_rope_params *a, const struct krk_rope_params *b,
                                        const struct krk_ctx *ctx)
{
    KRK_REQUIRE(a && b);
    KRK_REQUIRE_MSG(a->inv_freq == b->inv_freq && a->factor == b->factor,
                    "rope pair: the two sets must share frequencies and factor");
    return rope_launch(a, b, ctx);
}
