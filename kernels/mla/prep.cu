// The per-token steps of an MLA / DSA layer between its input projections and attention, in one
// launch (krk_mla_prep): the q latent's RMSNorm, the c_kv RMSNorm, RoPE on k_pe, the indexer key's
// LayerNorm and RoPE, the indexer head weights' scale and the latent cache write. Grid (n_tok, 3),
// three independent chains per token, each through shared memory: block (t, 0) normalises token t's
// q latent, block (t, 1) takes c_kv and k_pe, block (t, 2) the head weights and the index key; blocks
// 1 and 2 write their columns of the token's cache row.
// Each step computes as its own kernel does (norm.cu, rope.cu, cache-write.cu): fp32 sums over
// the block, the same formulas, rotation without fused multiply-add.
#include "mla/mla-common.cuh"
#include "norm/rope.cuh"

#include <algorithm>

namespace {

constexpr int kThreads = 256;
// the largest row lives in dynamic shared memory without the opt-in above 48 KB
static_assert(KRK_MLA_PREP_MAX_ROW * sizeof(float) <= 48 * 1024, "prep rows fit the default shared memory");

// x <- rmsnorm(x) * w over n values of shared memory (the result may go elsewhere: out)
__device__ void rms_rows(const float *x, int64_t n, const float *KRK_RESTRICT w, float eps, float *out, float *red)
{
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        ss += x[i] * x[i];
    }
    const float r = 1.0f / sqrtf(krk::block_sum(ss, red) / (float)n + eps);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        out[i] = x[i] * r * w[i];
    }
}

// Rotates the pairs of x (interleaved: (2j, 2j + 1); else (j, j + dim / 2)) at position pos.
__device__ void rope_vec(float *x, int64_t dim, bool interleaved, const float *KRK_RESTRICT inv_freq, float factor,
                         float pos)
{
    const int64_t half = dim / 2;
    for (int64_t j = threadIdx.x; j < half; j += blockDim.x) {
        float c, s;
        krk::rope_cos_sin(pos, inv_freq[j], factor, &c, &s);
        const int64_t i0 = interleaved ? 2 * j : j, i1 = interleaved ? 2 * j + 1 : j + half;
        float a = x[i0], b = x[i1];
        krk::rope_rotate(a, b, c, s);
        x[i0] = a;
        x[i1] = b;
    }
}

// The kernel's argument: the op's parameters with the cache typed (hiding the op's void pointer) and
// the batch.
struct PrepArgs : krk_mla_prep_params {
    krk_bf16 *cache;
    krk_batch batch;
};

__global__ void __launch_bounds__(kThreads) mla_prep_kernel(PrepArgs p)
{
    krk::kernel_prologue();
    extern __shared__ float sm[]; // this block's part of the token's row
    __shared__ float red[32];
    const int32_t t = blockIdx.x;
    const int64_t R = p.kv_lora, Dr = p.rope, ld = R + Dr, Di = p.ik ? p.idx_dim : 0, row = ld + Di;
    if (blockIdx.y == 0) { // the q latent's norm
        if (!p.q_norm) {
            return;
        }
        float *q = p.q_lat + (int64_t)t * p.q_dim;
        for (int64_t i = threadIdx.x; i < p.q_dim; i += blockDim.x) {
            sm[i] = q[i];
        }
        rms_rows(sm, p.q_dim, p.q_norm, p.eps, q, red); // block_sum's barrier orders the loads above
        return;
    }
    const int32_t seq = p.batch.tok_seq[t];
    const bool pad = p.batch.seq_slot[seq] < 0; // padding: no cache row
    krk_bf16 *dst = pad ? nullptr : p.cache + krk::mla::latent_row_off(p.batch, seq, p.batch.pos[t], p.block_size, row);
    const float pos = (float)p.batch.pos[t];
    if (blockIdx.y == 1) { // c_kv's norm and k_pe's rotation, and their part of the cache row
        float *kva = p.kva + (int64_t)t * ld;
        for (int64_t i = threadIdx.x; i < ld; i += blockDim.x) {
            sm[i] = kva[i];
        }
        __syncthreads();
        if (p.kv_norm) { // in place in shared memory (each thread rewrites what it read)
            rms_rows(sm, R, p.kv_norm, p.eps, sm, red);
        }
        rope_vec(sm + R, Dr, true, p.inv_freq, p.factor, pos);
        __syncthreads();
        for (int64_t i = threadIdx.x; i < Dr; i += blockDim.x) {
            kva[R + i] = sm[R + i];
        }
        if (p.kv_norm) {
            for (int64_t i = threadIdx.x; i < R; i += blockDim.x) {
                p.ckv[(int64_t)t * R + i] = sm[i];
            }
        }
        for (int64_t i = threadIdx.x; dst && i < ld; i += blockDim.x) {
            dst[i] = krk::f32_to_bf16(sm[i]);
        }
        return;
    }
    // blockIdx.y == 2: the head weights' scale, the index key's LayerNorm (as layernorm_kernel: the
    // mean, then the centred sum of squares) and rotation, and its part of the cache row
    if (p.w) {
        float *w = p.w + (int64_t)t * p.n_w;
        for (int64_t i = threadIdx.x; i < p.n_w; i += blockDim.x) {
            w[i] = w[i] * p.w_scale;
        }
    }
    if (!Di) {
        return;
    }
    float *ik = p.ik + (int64_t)t * Di;
    float s = 0.0f;
    for (int64_t i = threadIdx.x; i < Di; i += blockDim.x) {
        sm[i] = ik[i];
        s += sm[i];
    }
    const float mean = krk::block_sum(s, red) / (float)Di;
    float q = 0.0f;
    for (int64_t i = threadIdx.x; i < Di; i += blockDim.x) {
        q += (sm[i] - mean) * (sm[i] - mean);
    }
    const float r = 1.0f / sqrtf(krk::block_sum(q, red) / (float)Di + p.idx_eps);
    for (int64_t i = threadIdx.x; i < Di; i += blockDim.x) {
        sm[i] = (sm[i] - mean) * r * p.ik_norm_w[i] + p.ik_norm_b[i];
    }
    __syncthreads();
    rope_vec(sm, Dr, false, p.inv_freq, p.factor, pos);
    __syncthreads();
    for (int64_t i = threadIdx.x; i < Di; i += blockDim.x) {
        ik[i] = sm[i];
        if (dst) {
            dst[ld + i] = krk::f32_to_bf16(sm[i]);
        }
    }
}

} // namespace

extern "C" enum kr_status krk_mla_prep(const struct krk_mla_prep_params *p, const struct krk_ctx *ctx)
{
    KRK_REQUIRE(p != nullptr && ctx != nullptr);
    const krk_batch &b = ctx->batch;
    KRK_REQUIRE(b.n_tok >= 0);
    if (b.n_tok == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->kva && p->cache && p->kv_lora >= 1 && p->rope >= 0 && p->rope % 2 == 0);
    KRK_REQUIRE(krk::mla::paged_batch_ok(b) && p->block_size > 0);
    KRK_REQUIRE_MSG(krk::mla::paged_ctx_ok(b, p->block_size),
                    "mla prep: contexts up to %d positions, but block tables of %d blocks of %d hold %lld", b.max_ctx,
                    b.max_blocks, p->block_size, (long long)b.max_blocks * p->block_size);
    KRK_REQUIRE(p->rope == 0 || p->inv_freq);
    KRK_REQUIRE(!p->q_norm || (p->q_lat && p->q_dim >= 1 && p->q_dim <= KRK_MLA_PREP_MAX_ROW));
    KRK_REQUIRE(!p->kv_norm || p->ckv);
    KRK_REQUIRE(!p->ik || (p->idx_dim >= p->rope && p->ik_norm_w && p->ik_norm_b));
    KRK_REQUIRE(!p->w || p->n_w >= 1);
    KRK_REQUIRE(p->n == b.n_tok && !p->ik_fp8);
    const int64_t row = p->kv_lora + p->rope + (p->ik ? p->idx_dim : 0);
    KRK_REQUIRE_MSG(row <= KRK_MLA_PREP_MAX_ROW, "mla prep: cache rows of %lld elements, at most %d", (long long)row,
                    KRK_MLA_PREP_MAX_ROW);
    const int64_t qn = p->q_norm ? p->q_dim : 0, kd = p->kv_lora + p->rope, id = p->ik ? p->idx_dim : 0;
    const int64_t sm_floats = std::max({qn, kd, id}); // the longest of the three chains' rows
    const size_t smem = (size_t)sm_floats * sizeof(float);
    PrepArgs args;
    static_cast<krk_mla_prep_params &>(args) = *p;
    args.cache = static_cast<krk_bf16 *>(p->cache);
    args.batch = b;
    krk::launch_maybe_pdl(krk::pdl_enabled(), mla_prep_kernel, dim3((unsigned)b.n_tok, 3), kThreads, smem, ctx->stream, args);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}
