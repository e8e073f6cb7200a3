#pragma once
// Internals of the attention family shared by launch.cu, decode.cu and prefill.cu: the launch
// arguments as the kernels see them, the split-K sizing rule and the per-path launchers.
#include "common/fp8-cache.cuh"
#include "common/util.cuh"

namespace krk {
namespace attn {

// Split-K sizing of the decode path. A decode step of n_tok tokens gets
// n_split = clamp(SPLIT_ROWS / n_tok, 1, MAX_SPLIT) splits per (token, KV head), a number fixed by
// the host-known n_tok so that the grid never depends on the context length (graph replay). A
// split covers at least MIN_SPLIT_KEYS positions, so short contexts use fewer splits (the others
// exit at once and the combine ignores them).
constexpr int MAX_SPLIT = 32;
constexpr int SPLIT_ROWS = 1024;
constexpr int MIN_SPLIT_KEYS = 256;
constexpr float LOG2E = 1.4426950408889634f;

inline int decode_splits(int64_t n_tok)
{
    int64_t s = n_tok > 0 ? SPLIT_ROWS / n_tok : MAX_SPLIT;
    return (int)(s < 1 ? 1 : s > MAX_SPLIT ? MAX_SPLIT : s);
}

// --batch-invariant (krk_ctx.batch_invariant): every one-token sequence takes the decode path with
// this many splits, whatever else the step holds, so that a token's sum over its keys is split the
// same way in every step (the splits in use still depend on its context alone); its partial rows
// are indexed by sequence. Sequences of more tokens take the prefill path, whose tiles start at key
// 0 and hold one query row's arithmetic apart from the others'.
constexpr int INV_SPLIT = 16;

// Splits in use for a context of ctx positions (at least 1, at most n_split); device and host agree.
__host__ __device__ __forceinline__ int active_splits(int ctx, int n_split)
{
    const int want = (ctx + MIN_SPLIT_KEYS - 1) / MIN_SPLIT_KEYS;
    return want < 1 ? 1 : want > n_split ? n_split : want;
}

// The launch as the kernels see it (validated by krk_attn).
struct Args {
    const float *KRK_RESTRICT q; // [n_tok, ld_qkv], head h at h*head_dim
    const float *KRK_RESTRICT k; // [n_tok, ld_qkv] new keys
    const float *KRK_RESTRICT v; // [n_tok, ld_qkv] new values
    int64_t ld_qkv;
    int n_head, n_kv_head, head_dim;
    int group;                      // n_head / n_kv_head: query heads per KV head
    float scale_log2;               // softmax scale * log2(e): scores in base 2
    void *KRK_RESTRICT k_cache; // [n_block, block_size, n_kv_head, head_dim] of the cache type
    void *KRK_RESTRICT v_cache; // [n_block, block_size, n_kv_head, head_dim]
    float k_scale, v_scale;     // e4m3 caches: value = code * scale (bf16: unused)
    int block_size;
    float *KRK_RESTRICT out;      // [n_tok, n_head*head_dim]
    float *KRK_RESTRICT part_acc; // [n_tok, n_split, n_head, head_dim] decode partial sums
    float2 *KRK_RESTRICT part_ml; // [n_tok, n_split, n_head] decode partial (max, sum), base 2
    int n_split;                  // decode splits (1: the decode kernel writes out directly)
    int route;                    // --batch-invariant: decode blocks per sequence, taking one-token
                                  // sequences only; prefill blocks take the others
    struct krk_batch b;
};

// The cache element types the kernels are templated on: 8 consecutive values of a row form one
// Chunk (16 bytes of bf16, 8 bytes of e4m3 codes). to_f32 gives their fp32 values (times the
// tensor's scale for e4m3: code * s, the CPU reference's value); to_bf16 gives bf16 operands of the
// tensor-core path (for e4m3 the codes, exact in bf16: the scale is applied to the products).
struct CacheBf16 {
    using T = uint16_t;
    using Chunk = uint4;
    static constexpr bool kScaled = false;
    __device__ __forceinline__ static void to_f32(const Chunk &w, float s, float f[8])
    {
        (void)s;
        const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = __uint_as_float(u[i] << 16);
            f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        }
    }
};
struct CacheE4m3 {
    using T = uint8_t;
    using Chunk = uint2;
    static constexpr bool kScaled = true;
    __device__ __forceinline__ static void to_f32(const Chunk &w, float s, float f[8])
    {
        e4m3x8_to_f32(w, s, f);
    }
};

// Offset (elements) of the cache row holding position `pos` of the sequence whose block table row
// is `bt`, KV head 0 (int64: caches exceed 2^31 elements).
__device__ __forceinline__ int64_t cache_row(const int32_t *bt, int pos, int block_size, int64_t row_len)
{
    const int blk = bt[pos / block_size];
    return ((int64_t)blk * block_size + pos % block_size) * row_len;
}

// Workspace layout for n_rows = n_tok * n_split partial rows.
inline size_t part_acc_bytes(int64_t n_rows, int64_t n_head, int64_t head_dim)
{
    return (size_t)(n_rows * n_head * head_dim) * sizeof(float);
}

// Instantiated for CacheBf16 and CacheE4m3.
template <class C> enum kr_status launch_decode(const Args &a, cudaStream_t stream);
template <class C> enum kr_status launch_prefill(const Args &a, cudaStream_t stream);

} // namespace attn
} // namespace krk
