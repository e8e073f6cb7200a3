// Latent cache write (krk_mla_cache_write): every token's row [c_kv | k_pe | index key] rounded to bf16
// and stored at its position in the block-paged cache, one thread per element; or with p->fp8 the
// packed FP8 row (fp8_ds_mla, then the index key's codes and scales), one block per token.
#include "common/fp8-cache.cuh"
#include "mla/mla-common.cuh"

namespace {

constexpr int kThreads = 256;

// The kernel's argument: the op's parameters with the cache typed (hiding the op's void pointer) and
// the batch.
struct CacheArgs : krk_mla_cache_params {
    krk_bf16 *cache;
    krk_batch batch;
};

__global__ void __launch_bounds__(kThreads) mla_cache_write_kernel(CacheArgs p)
{
    krk::kernel_prologue();
    const int64_t row = p.kv_lora + p.rope + p.idx_dim;
    const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (i >= (int64_t)p.batch.n_tok * row) {
        return;
    }
    const int32_t t = (int32_t)(i / row);
    const int64_t c = i - (int64_t)t * row;
    const int32_t seq = p.batch.tok_seq[t];
    if (p.batch.seq_slot[seq] < 0) {
        return; // padding: no cache row
    }
    float v;
    if (c < p.kv_lora) {
        v = p.c_kv[(int64_t)t * p.ld_ckv + c];
    } else if (c < p.kv_lora + p.rope) {
        v = p.k_pe[(int64_t)t * p.ld_kpe + (c - p.kv_lora)];
    } else {
        v = p.ik[(int64_t)t * p.idx_dim + (c - p.kv_lora - p.rope)];
    }
    const int64_t off = krk::mla::latent_row_off(p.batch, seq, p.batch.pos[t], p.block_size, row);
    p.cache[off + c] = krk::f32_to_bf16(v);
}

// --kv-cache-dtype fp8: one block per token, a thread per value of a 128-value quantization block;
// writes the token's packed row (krk/ops.h: krk_fp8_latent_bytes, krk_fp8_key_bytes).
constexpr int kFp8Threads = KRK_FP8_CACHE_BLOCK;

// The smallest power of two s with s * 448 >= amax (the ue8m0 scale, exact; fp8-round.cu's rule).
__device__ __forceinline__ float ue8m0_scale(float amax)
{
    int e;
    const float f = frexpf(amax, &e);
    return ldexpf(1.0f, f <= 0.875f ? e - 9 : e - 8);
}

// Codes and scale of one block of n values of an index key, thread i holding x (ignored for
// i >= n). The key arrives as the FP8 indexer left it, x = fp32(code * s) with the code and scale of
// its own quantization (fp8-round.cu), which the cache must give back bit for bit; s is found again
// among the scales that can have made the block: act_quant's of x itself (right when the block's amax
// was below the 1e-4 floor, or for an all-zero block), x_max / 448 and its fp32 neighbours (x_max is
// fp32(448 s), so s is within one ulp of x_max / 448), and the power of two of ue8m0 scales. The first
// scale under which every value of the block is code * scale exactly is kept; when none is (a key
// that was not rounded so), act_quant's. Contains __syncthreads: call from every thread.
__device__ float key_quant_block(float x, int n, uint8_t *code, float *sh)
{
    const bool in = (int)threadIdx.x < n;
    const float bad = krk::block_sum(in && !isfinite(x) ? 1.0f : 0.0f, sh);
    const float xmax = krk::block_max(in ? fabsf(x) : 0.0f, sh);
    if (bad != 0.0f) {
        *code = 0x7f;
        return __uint_as_float(0x7fc00000u);
    }
    const float amax = fmaxf(xmax, 1e-4f), s_aq = amax * (1.0f / 448.0f);
    const float s0 = __fdiv_rn(xmax, 448.0f);
    const float cand[7] = {s_aq,
                           s0,
                           nextafterf(s0, INFINITY),
                           nextafterf(s0, 0.0f),
                           nextafterf(nextafterf(s0, INFINITY), INFINITY),
                           nextafterf(nextafterf(s0, 0.0f), 0.0f),
                           ue8m0_scale(amax)};
    for (int k = 0; k < 7; k++) {
        const float s = cand[k];
        uint8_t q = 0;
        bool exact = true;
        if (s > 0.0f && in) {
            q = krk::e4m3_from_f32(__fdiv_rn(x, s));
            exact = __float_as_uint(__fmul_rn(krk::e4m3_to_f32(q), s)) == __float_as_uint(x);
        }
        if (__syncthreads_and(s > 0.0f && exact)) {
            *code = q;
            return s;
        }
    }
    *code = krk::e4m3_from_f32(__fdiv_rn(x, s_aq));
    return s_aq;
}

__global__ void __launch_bounds__(kFp8Threads) mla_cache_write_fp8_kernel(CacheArgs p)
{
    krk::kernel_prologue();
    __shared__ float sh[32];
    const int32_t t = blockIdx.x;
    const int32_t seq = p.batch.tok_seq[t];
    if (p.batch.seq_slot[seq] < 0) {
        return; // padding: no cache row (block-uniform)
    }
    const int i = threadIdx.x;
    const int64_t lat = krk_fp8_latent_bytes(p.kv_lora, p.rope);
    const int64_t row = lat + (p.idx_dim ? krk_fp8_key_bytes(p.idx_dim) : 0);
    uint8_t *r = reinterpret_cast<uint8_t *>(p.cache) +
                 krk::mla::latent_row_off(p.batch, seq, p.batch.pos[t], p.block_size, row);
    float *scales = reinterpret_cast<float *>(r + p.kv_lora);
    uint16_t *pe = reinterpret_cast<uint16_t *>(r + p.kv_lora + 4 * krk_fp8_cache_blocks(p.kv_lora));
    for (int64_t b0 = 0; b0 < p.kv_lora; b0 += KRK_FP8_CACHE_BLOCK) {
        const int n = (int)(p.kv_lora - b0 < KRK_FP8_CACHE_BLOCK ? p.kv_lora - b0 : KRK_FP8_CACHE_BLOCK);
        const float x = i < n ? p.c_kv[(int64_t)t * p.ld_ckv + b0 + i] : 0.0f;
        uint8_t q;
        const float s = krk::act_quant_block(x, n, &q, sh);
        if (i < n) {
            r[b0 + i] = q;
        }
        if (i == 0) {
            scales[b0 / KRK_FP8_CACHE_BLOCK] = s;
        }
    }
    for (int64_t j = i; j < p.rope; j += kFp8Threads) {
        pe[j] = krk::f32_to_bf16(p.k_pe[(int64_t)t * p.ld_kpe + j]);
    }
    if (p.idx_dim) {
        uint8_t *kq = r + lat;
        float *ks = reinterpret_cast<float *>(kq + p.idx_dim);
        const int64_t blk = p.idx_dim < KRK_FP8_CACHE_BLOCK ? p.idx_dim : KRK_FP8_CACHE_BLOCK;
        for (int64_t b0 = 0; b0 < p.idx_dim; b0 += blk) {
            const float x = i < blk ? p.ik[(int64_t)t * p.idx_dim + b0 + i] : 0.0f;
            uint8_t q;
            const float s = key_quant_block(x, (int)blk, &q, sh);
            if (i < blk) {
                kq[b0 + i] = q;
            }
            if (i == 0) {
                ks[b0 / blk] = s;
            }
        }
    }
}

} // namespace

extern "C" enum kr_status krk_mla_cache_write(const struct krk_mla_cache_params *p, const struct krk_ctx *ctx)
{
    KRK_REQUIRE(p != nullptr && ctx != nullptr);
    const krk_batch &b = ctx->batch;
    KRK_REQUIRE(b.n_tok >= 0);
    if (b.n_tok == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->c_kv && p->k_pe && p->cache);
    KRK_REQUIRE(krk::mla::paged_batch_ok(b));
    KRK_REQUIRE(p->kv_lora > 0 && p->rope >= 0 && p->idx_dim >= 0);
    KRK_REQUIRE(p->ld_ckv >= p->kv_lora && p->ld_kpe >= p->rope);
    KRK_REQUIRE(p->idx_dim == 0 || p->ik != nullptr);
    KRK_REQUIRE(p->block_size > 0);
    KRK_REQUIRE_MSG(krk::mla::paged_ctx_ok(b, p->block_size),
                    "mla cache write: contexts up to %d positions, but block tables of %d blocks of %d hold %lld", b.max_ctx,
                    b.max_blocks, p->block_size, (long long)b.max_blocks * p->block_size);
    if (p->fp8) {
        KRK_REQUIRE_MSG(p->kv_lora % 4 == 0 && p->rope % 2 == 0 && p->idx_dim % 4 == 0 &&
                            (p->idx_dim <= KRK_FP8_CACHE_BLOCK || p->idx_dim % KRK_FP8_CACHE_BLOCK == 0),
                        "mla cache write: FP8 rows need kv_lora and idx_dim multiples of 4 (idx_dim up to 128 "
                        "or a multiple of it) and an even rope (%lld, %lld, %lld)",
                        (long long)p->kv_lora, (long long)p->rope, (long long)p->idx_dim);
        CacheArgs args;
        static_cast<krk_mla_cache_params &>(args) = *p;
        args.cache = static_cast<krk_bf16 *>(p->cache);
        args.batch = b;
        krk::launch_maybe_pdl(krk::pdl_enabled(), mla_cache_write_fp8_kernel, (unsigned)b.n_tok, kFp8Threads, 0,
                              ctx->stream, args);
        KRK_CHECK_LAUNCH();
        return KR_OK;
    }
    const int64_t n = (int64_t)b.n_tok * (p->kv_lora + p->rope + p->idx_dim);
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    KRK_REQUIRE_MSG(blocks <= INT32_MAX, "mla cache write: %d tokens of %lld elements need %lld blocks, at most %d",
                    b.n_tok, (long long)(p->kv_lora + p->rope + p->idx_dim), (long long)blocks, INT32_MAX);
    CacheArgs args;
    static_cast<krk_mla_cache_params &>(args) = *p;
    args.cache = static_cast<krk_bf16 *>(p->cache);
    args.batch = b;
    krk::launch_maybe_pdl(krk::pdl_enabled(), mla_cache_write_kernel, (unsigned)blocks, kThreads, 0, ctx->stream,
                          args);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}
