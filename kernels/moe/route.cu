// DeepSeek-V3 router, one warp per token: scores, group-limited selection and weights, with the
// tie-breaking of cpu_moe_route (groups: higher score first, then lower index; experts: higher
// biased score first, then lower index). The per-token scores live in shared memory.
#include "common/util.cuh"

namespace krk {
namespace {

constexpr int kRouteWarps = 4; // tokens per block

__global__ void __launch_bounds__(kRouteWarps * 32)
    route_kernel(const float *KRK_RESTRICT logits, const float *KRK_RESTRICT bias, int64_t n, int E, int n_used,
                 int n_group, int topk_group, bool norm_topk, float scale, int score_fn, int32_t *KRK_RESTRICT ids,
                 float *KRK_RESTRICT weights)
{
    krk::kernel_prologue();
    extern __shared__ float sm[]; // per warp: score[E], masked[E], gscore[n_group]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t t = (int64_t)blockIdx.x * kRouteWarps + warp;
    if (t >= n) {
        return; // warp-uniform; the kernel has no block-wide barrier
    }
    float *score = sm + (size_t)warp * (2 * E + n_group), *masked = score + E, *gscore = masked + E;
    const float *lg = logits + t * E;

    if (score_fn == 1) { // softmax
        float m = -INFINITY;
        for (int e = lane; e < E; e += 32) {
            m = fmaxf(m, lg[e]);
        }
        m = warp_max(m);
        float s = 0.0f;
        for (int e = lane; e < E; e += 32) {
            const float v = expf(lg[e] - m);
            score[e] = v;
            s += v;
        }
        s = warp_sum(s);
        for (int e = lane; e < E; e += 32) {
            score[e] /= s;
        }
    } else { // sigmoid
        for (int e = lane; e < E; e += 32) {
            score[e] = 1.0f / (1.0f + expf(-lg[e]));
        }
    }
    for (int e = lane; e < E; e += 32) {
        masked[e] = score[e] + (bias ? bias[e] : 0.0f); // selection score
    }
    __syncwarp();

    if (n_group > 1) {
        const int per_group = E / n_group;
        // group score: sum of the group's top-2 selection scores (top-1 for groups of one)
        for (int g = lane; g < n_group; g += 32) {
            float a = -INFINITY, b2 = -INFINITY;
            for (int e = g * per_group; e < (g + 1) * per_group; e++) {
                const float v = masked[e];
                if (v > a) {
                    b2 = a;
                    a = v;
                } else if (v > b2) {
                    b2 = v;
                }
            }
            gscore[g] = per_group > 1 ? a + b2 : a;
        }
        __syncwarp();
        // a group is kept when fewer than topk_group groups precede it in (score desc, index asc)
        // order: the same set the CPU keeps by dropping the worst (highest index on ties) repeatedly
        for (int g = lane; g < n_group; g += 32) {
            const float v = gscore[g];
            int rank = 0;
            for (int o = 0; o < n_group; o++) {
                const float w = gscore[o];
                rank += (w > v || (w == v && o < g)) ? 1 : 0;
            }
            if (rank >= topk_group) {
                for (int e = g * per_group; e < (g + 1) * per_group; e++) {
                    masked[e] = -INFINITY;
                }
            }
        }
        __syncwarp();
    }

    // n_used rounds of argmax (highest value, lowest index on ties); lane k keeps the k-th choice
    int my_id = 0;
    float my_w = 0.0f;
    for (int k = 0; k < n_used; k++) {
        float bv = -INFINITY;
        int bi = -1;
        for (int e = lane; e < E; e += 32) {
            const float v = masked[e];
            if (v != -INFINITY && (bi < 0 || v > bv)) {
                bv = v;
                bi = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == k) {
            // fewer selectable experts than n_used cannot happen after validation; expert 0 with
            // weight 0 keeps the consumers in bounds if it does
            my_id = bi >= 0 ? bi : 0;
            my_w = bi >= 0 ? score[bi] : 0.0f;
        }
        if (bi >= 0 && lane == (bi & 31)) {
            masked[bi] = -INFINITY;
        }
        __syncwarp();
    }
    // weight sum in selection order, as the CPU adds them
    float wsum = 0.0f;
    for (int k = 0; k < n_used; k++) {
        wsum += __shfl_sync(0xffffffffu, my_w, k);
    }
    if (lane < n_used) {
        float w = my_w;
        if (norm_topk) {
            w /= wsum + 1e-20f;
        }
        w *= scale;
        ids[t * n_used + lane] = my_id;
        weights[t * n_used + lane] = w;
    }
}

} // namespace
} // namespace krk

using namespace krk;

extern "C" enum kr_status krk_moe_route(const struct krk_route_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p);
    KRK_REQUIRE(p->n >= 0 && p->n_expert >= 1 && p->n_expert <= 1024 && p->n_used >= 1 && p->n_used <= 32 &&
                p->n_used <= p->n_expert);
    KRK_REQUIRE(p->n_group >= 1 && p->n_expert % p->n_group == 0 && ((int)p->score == 0 || (int)p->score == 1));
    if (p->n_group > 1) {
        KRK_REQUIRE(p->topk_group >= 1 &&
                    (p->topk_group >= p->n_group || p->topk_group * (p->n_expert / p->n_group) >= p->n_used));
    }
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->logits && p->ids && p->weights);
    const int64_t blocks = (p->n + kRouteWarps - 1) / kRouteWarps;
    KRK_REQUIRE(blocks <= INT32_MAX);
    const size_t smem = (size_t)kRouteWarps * (size_t)(2 * p->n_expert + p->n_group) * sizeof(float);
    krk::launch_maybe_pdl(krk::pdl_enabled(), route_kernel, (unsigned)blocks, kRouteWarps * 32, smem, stream, p->logits,
                          p->bias, p->n, (int)p->n_expert, (int)p->n_used, (int)p->n_group,
                          (int)(p->n_group > 1 ? p->topk_group : 1), p->norm_topk, p->scale, (int)p->score, p->ids,
                          p->weights);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}
