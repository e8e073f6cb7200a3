// Latent cache write (krk_mla_cache_write): every token's row [c_kv | k_pe | index key] rounded to bf16
// and stored at its position in the block-paged cache. One thread per element.
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
