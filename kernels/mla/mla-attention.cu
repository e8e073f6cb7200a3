// Absorbed-form MLA attention (krk_mla_attention): one block per (token, head), over bf16 or packed
// FP8 latent rows.
//   q_abs = W_UK[h]^T q_nope                       (kv_lora, in shared memory)
//   score(s) = scale (q_abs . c_kv[s] + q_pe . k_pe[s])   over the selected positions (idx) or all
//                                                  positions <= pos (idx NULL)
//   o_lat = softmax-weighted sum of c_kv[s]       (online softmax over tiles of keys, so dense
//                                                  contexts of any length need no score storage)
//   out = W_UV[h] o_lat
#include "common/fp8-cache.cuh"
#include "mla/mla-common.cuh"

namespace {

constexpr int kThreads = 256; // 8 warps
constexpr int kTile = 64;     // keys scored per step of the online softmax
constexpr size_t kMaxSmem = 48 * 1024;

size_t attn_smem_bytes(int64_t nope, int64_t rope, int64_t kv_lora)
{
    return kTile * sizeof(int64_t) + (size_t)(2 * kTile + nope + rope + 2 * kv_lora) * sizeof(float);
}

// FP8: the latent rows are packed (krk_fp8_latent_bytes): c_kv[r] = code * its block's scale and k_pe
// bf16, read as the fp32 values the CPU reference keeps.
template <bool FP8> __global__ void __launch_bounds__(kThreads) mla_attn_kernel(krk::mla::AttnArgs p)
{
    krk::kernel_prologue();
    extern __shared__ __align__(16) unsigned char smem[];
    const int64_t R = p.kv_lora, qd = p.nope + p.rope;
    int64_t *rowoff = reinterpret_cast<int64_t *>(smem); // [kTile] cache row offsets, -1: masked
    float *sc = reinterpret_cast<float *>(rowoff + kTile); // [kTile] scaled scores
    float *pr = sc + kTile;                                // [kTile] exp(score - running max)
    float *qv = pr + kTile;                                // [nope + rope] this head's query
    float *q_abs = qv + qd;                                // [R]
    float *o_lat = q_abs + R;                              // [R] unnormalised latent output

    const krk_batch &b = p.batch;
    const int64_t t = blockIdx.x / p.n_head, h = blockIdx.x % p.n_head;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int n_warp = kThreads / 32;
    float *out = p.out + t * p.n_head * p.v_dim + h * p.v_dim;
    const int32_t seq = b.tok_seq[t], pos = b.pos[t];
    if (b.seq_slot[seq] < 0) { // padding: read no cache, write zeros
        for (int64_t v = threadIdx.x; v < p.v_dim; v += kThreads) {
            out[v] = 0.0f;
        }
        return;
    }
    const float *q = p.q + t * p.n_head * qd + h * qd;
    for (int64_t i = threadIdx.x; i < qd; i += kThreads) {
        qv[i] = q[i];
    }
    __syncthreads();
    const float *wk = p.kv_b + h * (p.nope + p.v_dim) * R; // W_UK[h]: [nope, R], then W_UV[h]: [v_dim, R]
    for (int64_t r = threadIdx.x; r < R; r += kThreads) {
        float acc = 0.0f;
        for (int64_t d = 0; d < p.nope; d++) {
            acc = fmaf(qv[d], wk[d * R + r], acc);
        }
        q_abs[r] = acc;
        o_lat[r] = 0.0f;
    }
    __syncthreads();

    // Every thread keeps the same running max m and denominator l (computed from the same shared
    // values in the same order); thread-owned elements of o_lat are rescaled as the max grows.
    const int64_t n_cand = p.idx ? p.topk : (int64_t)pos + 1;
    float m = -INFINITY, l = 0.0f;
    for (int64_t j0 = 0; j0 < n_cand; j0 += kTile) {
        if (threadIdx.x < kTile) {
            const int64_t j = j0 + threadIdx.x;
            int32_t key = -1;
            if (j < n_cand) {
                key = p.idx ? p.idx[t * p.topk + j] : (int32_t)j;
            }
            rowoff[threadIdx.x] =
                key >= 0 && key <= pos ? krk::mla::latent_row_off(b, seq, key, p.block_size, p.row) : -1;
        }
        __syncthreads();
        for (int jj = warp; jj < kTile; jj += n_warp) { // a warp per key
            const int64_t off = rowoff[jj];
            float acc = -INFINITY;
            if (off >= 0) {
                float d = 0.0f;
                if constexpr (FP8) {
                    const uint8_t *row = p.cache8 + off;
                    const float *rs = reinterpret_cast<const float *>(row + R);
                    const krk_bf16 *pe = reinterpret_cast<const krk_bf16 *>(row + R + 4 * krk_fp8_cache_blocks(R));
                    for (int64_t r = lane; r < R; r += 32) {
                        d = fmaf(q_abs[r], krk::e4m3_to_f32(row[r]) * rs[r / KRK_FP8_CACHE_BLOCK], d);
                    }
                    for (int64_t i = lane; i < p.rope; i += 32) {
                        d = fmaf(qv[p.nope + i], krk::bf16_to_f32(pe[i]), d);
                    }
                } else {
                    const krk_bf16 *row = p.cache + off;
                    for (int64_t r = lane; r < R; r += 32) {
                        d = fmaf(q_abs[r], krk::bf16_to_f32(row[r]), d);
                    }
                    for (int64_t i = lane; i < p.rope; i += 32) {
                        d = fmaf(qv[p.nope + i], krk::bf16_to_f32(row[R + i]), d);
                    }
                }
                acc = krk::warp_sum(d) * p.scale;
            }
            if (lane == 0) {
                sc[jj] = acc;
            }
        }
        __syncthreads();
        float m_tile = -INFINITY;
        for (int jj = 0; jj < kTile; jj++) {
            m_tile = fmaxf(m_tile, sc[jj]);
        }
        const float m_new = fmaxf(m, m_tile);
        if (m_new != -INFINITY) { // block-uniform: false only while no key has been seen
            if (threadIdx.x < kTile) {
                pr[threadIdx.x] = rowoff[threadIdx.x] >= 0 ? expf(sc[threadIdx.x] - m_new) : 0.0f;
            }
            const float alpha = m == -INFINITY ? 0.0f : expf(m - m_new);
            __syncthreads();
            float psum = 0.0f;
            for (int jj = 0; jj < kTile; jj++) {
                psum += pr[jj];
            }
            l = l * alpha + psum;
            m = m_new;
            for (int64_t r = threadIdx.x; r < R; r += kThreads) {
                float acc = o_lat[r] * alpha;
                for (int jj = 0; jj < kTile; jj++) {
                    if (rowoff[jj] >= 0) {
                        float v;
                        if constexpr (FP8) {
                            const uint8_t *row = p.cache8 + rowoff[jj];
                            v = krk::e4m3_to_f32(row[r]) *
                                reinterpret_cast<const float *>(row + R)[r / KRK_FP8_CACHE_BLOCK];
                        } else {
                            v = krk::bf16_to_f32(p.cache[rowoff[jj] + r]);
                        }
                        acc = fmaf(pr[jj], v, acc);
                    }
                }
                o_lat[r] = acc;
            }
        }
        __syncthreads(); // rowoff, sc, pr and o_lat are rewritten / read whole in the next step
    }

    const float inv = l > 0.0f ? 1.0f / l : 0.0f; // no visible key: zero output, as the reference
    for (int64_t v = warp; v < p.v_dim; v += n_warp) { // a warp per output element
        const float *wv = wk + (p.nope + v) * R;
        float acc = 0.0f;
        for (int64_t r = lane; r < R; r += 32) {
            acc = fmaf(wv[r], o_lat[r], acc);
        }
        acc = krk::warp_sum(acc);
        if (lane == 0) {
            out[v] = acc * inv;
        }
    }
}

} // namespace

// The per-head kernel keeps q_abs, o_lat and one tile of scores in shared memory and needs no
// workspace; the head-batched kernels keep Q rows and per-split partial results there (a fixed
// amount: tokens beyond what fits run in groups, long contexts in fewer, longer splits).
extern "C" size_t krk_mla_attn_workspace_bytes(int64_t n_tok, int64_t n_head, int64_t kv_lora, int64_t max_ctx)
{
    (void)max_ctx;
    return krk::mla::heads_workspace_bytes(n_tok, n_head, kv_lora);
}

extern "C" enum kr_status krk_mla_attention(const struct krk_mla_attn_params *p, const struct krk_ctx *ctx)
{
    KRK_REQUIRE(p != nullptr && ctx != nullptr);
    const krk_batch &b = ctx->batch;
    const cudaStream_t stream = ctx->stream;
    KRK_REQUIRE(b.n_tok >= 0);
    if (b.n_tok == 0) {
        if (ctx->idx_ready) {
            KRK_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->idx_ready, 0));
        }
        return KR_OK;
    }
    KRK_REQUIRE(p->q && p->kv_b && p->cache && p->out);
    KRK_REQUIRE(krk::mla::paged_batch_ok(b));
    KRK_REQUIRE(p->n_head > 0 && p->nope > 0 && p->rope >= 0 && p->v_dim > 0 && p->kv_lora > 0);
    KRK_REQUIRE(p->row >= p->kv_lora + p->rope && p->block_size > 0);
    KRK_REQUIRE_MSG(krk::mla::paged_ctx_ok(b, p->block_size),
                    "mla attention: contexts up to %d positions, but block tables of %d blocks of %d hold %lld",
                    b.max_ctx, b.max_blocks, p->block_size, (long long)b.max_blocks * p->block_size);
    KRK_REQUIRE(p->idx == nullptr || p->topk > 0);
    KRK_REQUIRE_MSG(!p->fp8 || (p->kv_lora % 4 == 0 && p->rope % 2 == 0 && p->row % 4 == 0 &&
                                p->row >= krk_fp8_latent_bytes(p->kv_lora, p->rope) && ((uintptr_t)p->cache & 3) == 0),
                    "mla attention: FP8 rows need kv_lora a multiple of 4, an even rope and 4-byte aligned rows of at "
                    "least %lld bytes (row %lld)", (long long)krk_fp8_latent_bytes(p->kv_lora, p->rope),
                    (long long)p->row);
    const krk::mla::AttnArgs args = krk::mla::attn_args(*p, *ctx);
    if (ctx->mla_attn == KRK_MLA_ATTN_HEADS && krk::mla::heads_fits(args)) {
        return krk::mla::heads_attention(args, stream, ctx->idx_ready);
    }
    const size_t smem = attn_smem_bytes(p->nope, p->rope, p->kv_lora);
    KRK_REQUIRE_MSG(smem <= kMaxSmem, "mla attention: kv_lora %lld with nope %lld and rope %lld needs %zu bytes of "
                    "shared memory, at most %zu", (long long)p->kv_lora, (long long)p->nope, (long long)p->rope, smem,
                    kMaxSmem); // kv_lora up to about 5800 with nope + rope = 192
    const int64_t blocks = (int64_t)b.n_tok * p->n_head;
    KRK_REQUIRE_MSG(blocks <= INT32_MAX, "mla attention: %d tokens x %lld heads = %lld blocks, at most %d", b.n_tok,
                    (long long)p->n_head, (long long)blocks, INT32_MAX);
    if (ctx->idx_ready) { // this kernel absorbs each head's query itself: nothing to overlap
        KRK_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->idx_ready, 0));
    }
    if (p->fp8) {
        krk::launch_maybe_pdl(krk::pdl_enabled(), mla_attn_kernel<true>, (unsigned)blocks, kThreads, smem, stream,
                              args);
    } else {
        krk::launch_maybe_pdl(krk::pdl_enabled(), mla_attn_kernel<false>, (unsigned)blocks, kThreads, smem, stream,
                              args);
    }
    KRK_CHECK_LAUNCH();
    return KR_OK;
}
