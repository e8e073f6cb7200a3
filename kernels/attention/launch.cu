// GQA attention over the block-paged K/V cache (bf16, or e4m3 codes with a scale per tensor):
// parameter checks, the cache write and the choice between the split-K decode path (decode.cu) and
// the tiled prefill path (prefill.cu).
#include "attention/attention-impl.cuh"

namespace krk {
namespace attn {

constexpr int WRITE_THREADS = 128;

// One block per token: stores the token's new K and V rows [n_kv_head*head_dim] at its position in
// its sequence's cache blocks, rounded to bf16 or encoded as e4m3(x / s) (the CPU reference's
// rounding). Padding sequences write nothing.
template <class C> __global__ void __launch_bounds__(WRITE_THREADS) cache_write_kernel(Args a)
{
    krk::kernel_prologue();
    const int t = blockIdx.x;
    const int s = a.b.tok_seq[t];
    if (a.b.seq_slot[s] < 0) {
        return;
    }
    const int64_t row_len = (int64_t)a.n_kv_head * a.head_dim;
    const int64_t dst =
        cache_row(a.b.block_table + (int64_t)s * a.b.max_blocks, a.b.pos[t], a.block_size, row_len);
    const float *k = a.k + (int64_t)t * a.ld_qkv;
    const float *v = a.v + (int64_t)t * a.ld_qkv;
    typename C::T *kc = static_cast<typename C::T *>(a.k_cache) + dst;
    typename C::T *vc = static_cast<typename C::T *>(a.v_cache) + dst;
    // 8 elements (one chunk) per step; row_len is a multiple of 8 and dst chunk-aligned.
    for (int64_t e = (int64_t)threadIdx.x * 8; e < row_len; e += (int64_t)WRITE_THREADS * 8) {
        if constexpr (C::kScaled) {
            uint32_t kw[2] = {0, 0}, vw[2] = {0, 0};
#pragma unroll
            for (int i = 0; i < 8; i++) {
                kw[i / 4] |= (uint32_t)e4m3_from_f32(__fdiv_rn(k[e + i], a.k_scale)) << (8 * (i % 4));
                vw[i / 4] |= (uint32_t)e4m3_from_f32(__fdiv_rn(v[e + i], a.v_scale)) << (8 * (i % 4));
            }
            *reinterpret_cast<uint2 *>(kc + e) = make_uint2(kw[0], kw[1]);
            *reinterpret_cast<uint2 *>(vc + e) = make_uint2(vw[0], vw[1]);
        } else {
            uint32_t kw[4], vw[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                kw[i] = (uint32_t)f32_to_bf16(k[e + 2 * i]) | ((uint32_t)f32_to_bf16(k[e + 2 * i + 1]) << 16);
                vw[i] = (uint32_t)f32_to_bf16(v[e + 2 * i]) | ((uint32_t)f32_to_bf16(v[e + 2 * i + 1]) << 16);
            }
            *reinterpret_cast<uint4 *>(kc + e) = make_uint4(kw[0], kw[1], kw[2], kw[3]);
            *reinterpret_cast<uint4 *>(vc + e) = make_uint4(vw[0], vw[1], vw[2], vw[3]);
        }
    }
}

} // namespace attn
} // namespace krk

using namespace krk::attn;

// The decode path, the prefill path, or (routed) both: each then skips the other's sequences.
template <class C> static enum kr_status run_paths(const Args &a, bool decode, bool prefill, cudaStream_t stream)
{
    if (decode && (a.route || !prefill)) {
        KR_TRY(launch_decode<C>(a, stream));
    }
    return prefill ? launch_prefill<C>(a, stream) : KR_OK;
}

extern "C" size_t krk_attn_workspace_bytes_invariant(int64_t n_seq, int64_t n_head, int64_t head_dim)
{
    if (n_seq <= 0 || n_head <= 0 || head_dim <= 0) {
        return 0;
    }
    const int64_t n_rows = n_seq * INV_SPLIT;
    return part_acc_bytes(n_rows, n_head, head_dim) + (size_t)(n_rows * n_head) * sizeof(float2);
}

extern "C" size_t krk_attn_workspace_bytes(int64_t n_tok, int64_t n_head, int64_t head_dim)
{
    // Partial rows of a decode step: n_tok * decode_splits(n_tok) <= min(MAX_SPLIT * n_tok,
    // SPLIT_ROWS), a bound that grows with n_tok, so the workspace of the largest step serves every
    // smaller one. Steps of more tokens per sequence use no workspace.
    if (n_tok <= 0 || n_head <= 0 || head_dim <= 0) {
        return 0;
    }
    const int64_t n_rows = n_tok * MAX_SPLIT < SPLIT_ROWS ? n_tok * MAX_SPLIT : SPLIT_ROWS;
    return part_acc_bytes(n_rows, n_head, head_dim) + (size_t)(n_rows * n_head) * sizeof(float2);
}

extern "C" enum kr_status krk_attn(const struct krk_attn_params *p, const struct krk_ctx *ctx)
{
    KRK_REQUIRE(p != nullptr && ctx != nullptr);
    const struct krk_batch &b = ctx->batch;
    const cudaStream_t stream = ctx->stream;
    KRK_REQUIRE(b.n_tok >= 0 && b.n_seq >= 0);
    if (b.n_tok == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->q && p->k && p->v && p->out && p->k_cache && p->v_cache);
    KRK_REQUIRE(b.pos && b.tok_seq && b.seq_tok0 && b.seq_slot && b.block_table);
    KRK_REQUIRE(b.n_seq >= 1 && b.max_blocks >= 1 && b.max_seq_tok >= 1);
    KRK_REQUIRE(p->n_head >= 1 && p->n_kv_head >= 1 && p->n_head % p->n_kv_head == 0);
    // grid limits: the prefill grid is (query tiles, n_head, n_seq), the decode grid's y is at most n_head
    KRK_REQUIRE_MSG(b.n_seq <= 65535, "attention: %d sequences in one step, at most 65535 (gridDim.z)", b.n_seq);
    KRK_REQUIRE_MSG(p->n_head <= 65535, "attention: %lld query heads, at most 65535 (gridDim.y)",
                    (long long)p->n_head);
    KRK_REQUIRE_MSG(p->head_dim >= 8 && p->head_dim <= 256 && p->head_dim % 8 == 0,
                    "attention: head_dim %lld, supported: multiples of 8 in 8..256", (long long)p->head_dim);
    KRK_REQUIRE(p->ld_qkv >= p->n_head * p->head_dim);
    KRK_REQUIRE(p->block_size >= 1);
    // every position a token reads or writes has a block table entry (host-known bound; 0 while a
    // graph is captured, where the engine pads the tables to the widest context they replay)
    KRK_REQUIRE_MSG(b.max_ctx <= (int64_t)b.max_blocks * p->block_size,
                    "attention: contexts up to %d positions, but block tables of %d blocks of %d hold %lld",
                    b.max_ctx, b.max_blocks, p->block_size, (long long)b.max_blocks * p->block_size);
    KRK_REQUIRE(p->scale > 0.0f && p->scale < INFINITY);
    // 16-byte loads and stores of bf16 cache rows (8-byte of e4m3 rows)
    KRK_REQUIRE((uintptr_t)p->k_cache % 16 == 0 && (uintptr_t)p->v_cache % 16 == 0);
    KRK_REQUIRE_MSG(!p->kv_fp8 || (p->k_scale > 0.0f && p->k_scale < INFINITY && p->v_scale > 0.0f &&
                                   p->v_scale < INFINITY),
                    "attention: FP8 K/V cache scales must be positive and finite (%g, %g)", (double)p->k_scale,
                    (double)p->v_scale);

    Args a;
    a.q = p->q;
    a.k = p->k;
    a.v = p->v;
    a.ld_qkv = p->ld_qkv;
    a.n_head = (int)p->n_head;
    a.n_kv_head = (int)p->n_kv_head;
    a.head_dim = (int)p->head_dim;
    a.group = (int)(p->n_head / p->n_kv_head);
    a.scale_log2 = p->scale * LOG2E;
    a.k_cache = p->k_cache;
    a.v_cache = p->v_cache;
    a.k_scale = p->kv_fp8 ? p->k_scale : 1.0f;
    a.v_scale = p->kv_fp8 ? p->v_scale : 1.0f;
    a.block_size = p->block_size;
    a.out = p->out;
    a.part_acc = nullptr;
    a.part_ml = nullptr;
    a.n_split = 1;
    a.b = b;

    // routed (--batch-invariant): the decode path for one-token sequences, the prefill path for the
    // others, in any step
    a.route = ctx->batch_invariant ? 1 : 0;
    const bool decode = b.max_seq_tok == 1 || a.route;
    const bool prefill = b.max_seq_tok > 1;
    if (decode) {
        a.n_split = a.route ? INV_SPLIT : decode_splits(b.n_tok);
        if (a.n_split > 1) {
            const int64_t n_rows = (int64_t)(a.route ? b.n_seq : b.n_tok) * a.n_split;
            KRK_REQUIRE(ctx->workspace != nullptr && (uintptr_t)ctx->workspace % 16 == 0);
            KRK_REQUIRE_MSG(!a.route || ctx->workspace_bytes >= part_acc_bytes(n_rows, p->n_head, p->head_dim) +
                                                        (size_t)(n_rows * p->n_head) * sizeof(float2),
                            "attention: workspace of %zu bytes, the decode splits of %lld rows need more",
                            ctx->workspace_bytes, (long long)n_rows);
            a.part_acc = static_cast<float *>(ctx->workspace);
            a.part_ml = reinterpret_cast<float2 *>(static_cast<char *>(ctx->workspace) +
                                                   part_acc_bytes(n_rows, p->n_head, p->head_dim));
        }
    }

    if (p->kv_fp8) {
        krk::launch_maybe_pdl(krk::pdl_enabled(), cache_write_kernel<CacheE4m3>, b.n_tok, WRITE_THREADS, 0, stream,
                              a);
        KRK_CHECK_LAUNCH();
        return run_paths<CacheE4m3>(a, decode, prefill, stream);
    }
    krk::launch_maybe_pdl(krk::pdl_enabled(), cache_write_kernel<CacheBf16>, b.n_tok, WRITE_THREADS, 0, stream, a);
    KRK_CHECK_LAUNCH();
    return run_paths<CacheBf16>(a, decode, prefill, stream);
}
