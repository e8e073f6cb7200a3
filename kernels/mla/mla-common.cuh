#pragma once
// Helpers shared by the MLA / DSA kernels (kernels/mla/): addressing of the block-paged latent cache.
#include "common/util.cuh"
#include "krk/mla.h"

namespace krk {
namespace mla {

// Element offset of the latent cache row of position `pos` of sequence `seq`: the cache is
// [n_block, block_size, row] and block_table maps the sequence's block pos / block_size to a block id.
__device__ __forceinline__ int64_t latent_row_off(const krk_batch &b, int32_t seq, int32_t pos, int32_t block_size,
                                                  int64_t row)
{
    const int32_t blk = b.block_table[(int64_t)seq * b.max_blocks + pos / block_size];
    return ((int64_t)blk * block_size + pos % block_size) * row;
}

// A batch carries what latent_row_off reads: positions, token sequences, slots and block tables.
inline bool paged_batch_ok(const krk_batch &b)
{
    return b.pos && b.tok_seq && b.seq_slot && b.block_table && b.max_blocks > 0;
}

// Every position the batch's tokens read or write has a block table entry: max_ctx (the host-known
// bound on pos + 1; during a graph capture the bound the padded tables hold) fits the tables.
inline bool paged_ctx_ok(const krk_batch &b, int32_t block_size)
{
    return block_size > 0 && b.max_ctx <= (int64_t)b.max_blocks * block_size;
}

// The MLA attention kernels' argument: the op's parameters with the cache typed (hiding the op's void
// pointer), and the batch and workspace of the launch's krk_ctx.
struct AttnArgs : krk_mla_attn_params {
    const krk_bf16 *cache;
    const uint8_t *cache8; // the same, as bytes (fp8: packed rows of `row` bytes)
    krk_batch batch;
    void *workspace;
    size_t workspace_bytes;
};
inline AttnArgs attn_args(const krk_mla_attn_params &p, const krk_ctx &ctx)
{
    AttnArgs a;
    static_cast<krk_mla_attn_params &>(a) = p;
    a.cache = static_cast<const krk_bf16 *>(p.cache);
    a.cache8 = static_cast<const uint8_t *>(p.cache);
    a.batch = ctx.batch;
    a.workspace = ctx.workspace;
    a.workspace_bytes = ctx.workspace_bytes;
    return a;
}

// The head-batched kernels (mla-heads.cu): whether they take `a`, their launches (waiting for
// idx_ready, or not, before the first kernel that reads idx), and the workspace they want for n_tok
// tokens (0 for shapes they do not take).
bool heads_fits(const AttnArgs &a);
enum kr_status heads_attention(const AttnArgs &a, cudaStream_t stream, cudaEvent_t idx_ready);
size_t heads_workspace_bytes(int64_t n_tok, int64_t n_head, int64_t kv_lora);

} // namespace mla
} // namespace krk
