// krk_ssd: the SSD selective state space update. Sequences with one token take the exact
// recurrence (ssd_decode.cuh); sequences with several take the chunked algorithm: C B^T per chunk
// and group for all chunks at once (ssd_bmm.cuh, into the workspace), then one block per
// (sequence, head, column tile) walks the sequence's chunks carrying the state (ssd_scan.cuh). A
// mixed batch launches both; each kernel skips the other's sequences.
#include "mamba2/ssd_bmm.cuh"
#include "mamba2/ssd_decode.cuh"
#include "mamba2/ssd_scan.cuh"

#include <cmath>

using namespace krk::mamba2;

namespace {

// Workspace chunk slots for a batch of n_tok tokens in n_seq sequences, and which slot map of
// ssd_slot_base gives that many (*per_seq: s + t0/Q, else t0/Q + t0/2).
int64_t ssd_chunk_slots(int64_t n_tok, int64_t n_seq, bool *per_seq)
{
    if (n_tok < 2 || n_seq < 1) {
        *per_seq = true;
        return 0;
    }
    const int64_t by_seq = n_seq + n_tok / kChunk;
    const int64_t by_tok = n_tok / kChunk + n_tok / 2;
    *per_seq = by_seq <= by_tok;
    return *per_seq ? by_seq : by_tok;
}

constexpr size_t kWsAlign = 256;

size_t ws_round(size_t b)
{
    return (b + kWsAlign - 1) / kWsAlign * kWsAlign;
}

// Workspace: C B^T [slots, n_group, kChunk, kChunk].
size_t ssd_cb_bytes(int64_t slots, int64_t n_group)
{
    return ws_round((size_t)slots * (size_t)n_group * kChunk * kChunk * sizeof(float));
}

bool aligned16(const void *p)
{
    return ((uintptr_t)p & 15) == 0;
}

} // namespace

extern "C" size_t krk_ssd_workspace_bytes(int64_t n_tok, int64_t n_seq, int64_t n_head, int64_t head_dim,
                                          int64_t n_group, int64_t d_state, int64_t chunk)
{
    (void)chunk; // the kernels' own chunk length (kChunk) sizes the workspace
    bool per_seq;
    const int64_t slots = ssd_chunk_slots(n_tok, n_seq, &per_seq);
    if (slots == 0) {
        return 0;
    }
    (void)n_head;
    (void)head_dim;
    (void)d_state;
    return ssd_cb_bytes(slots, n_group);
}

extern "C" enum kr_status krk_ssd(const struct krk_ssd_params *p, const struct krk_ctx *ctx)
{
    KRK_REQUIRE(p != nullptr && ctx != nullptr);
    const krk_batch &b = ctx->batch;
    const cudaStream_t stream = ctx->stream;
    KRK_REQUIRE(p->n_head >= 1 && p->head_dim >= 1);
    // grids: (head_dim tiles, n_head, n_seq) for the update and the scan, (chunk slots, n_group) for C.B^T
    KRK_REQUIRE_MSG(p->n_head <= 65535 && p->head_dim <= 4096, "ssd: %lld heads x %lld, at most 65535 heads "
                    "(gridDim.y) of at most 4096", (long long)p->n_head, (long long)p->head_dim);
    KRK_REQUIRE(p->n_group >= 1 && p->n_head % p->n_group == 0);
    KRK_REQUIRE_MSG(p->d_state >= 1 && p->d_state <= kMaxState, "ssd: d_state %lld, supported: 1..%d",
                    (long long)p->d_state, kMaxState);
    KRK_REQUIRE(p->conv_dim == p->n_head * p->head_dim + 2 * p->n_group * p->d_state);
    KRK_REQUIRE(p->conv_dim <= INT32_MAX && p->ld_dt >= p->n_head && p->chunk >= 1);
    KRK_REQUIRE(b.n_tok >= 0 && b.n_seq >= 0);
    KRK_REQUIRE_MSG(b.n_seq <= 65535, "ssd: %d sequences in one step, at most 65535 (gridDim.z)", b.n_seq);
    if (b.n_seq == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(b.seq_tok0 && b.seq_pos0 && b.seq_slot);
    KRK_REQUIRE(b.n_tok == 0 || (b.max_seq_tok >= 1 && p->xbc && p->dt && p->y));
    KRK_REQUIRE(p->dt_bias && p->A_log && p->D && p->state && aligned16(p->state));
    bool per_seq;
    const int64_t slots = b.max_seq_tok > 1 ? ssd_chunk_slots(b.n_tok, b.n_seq, &per_seq) : 0;
    KRK_REQUIRE_MSG(slots <= INT32_MAX, "ssd: %d tokens in %d sequences need %lld chunk slots, at most %d", b.n_tok,
                    b.n_seq, (long long)slots, INT32_MAX);
    KRK_REQUIRE(slots == 0 || (ctx->workspace && aligned16(ctx->workspace)));
    KRK_REQUIRE_MSG(slots == 0 || ctx->workspace_bytes >= ssd_cb_bytes(slots, p->n_group),
                    "ssd: a workspace of %zu bytes, %d tokens in %d sequences need %zu", ctx->workspace_bytes,
                    b.n_tok, b.n_seq, ssd_cb_bytes(slots, p->n_group));

    SsdArgs a;
    a.xbc = p->xbc;
    a.dt = p->dt;
    a.dt_bias = p->dt_bias;
    a.A_log = p->A_log;
    a.D = p->D;
    a.state = p->state;
    a.y = p->y;
    a.ws_cb = static_cast<float *>(ctx->workspace);
    a.conv_dim = p->conv_dim;
    a.ld_dt = p->ld_dt;
    a.n_head = (int)p->n_head;
    a.head_dim = (int)p->head_dim;
    a.n_group = (int)p->n_group;
    a.d_state = (int)p->d_state;
    a.heads_per_group = (int)(p->n_head / p->n_group);
    a.dt_min = p->dt_min;
    a.dt_max = p->dt_max;
    a.clamp_min = p->dt_min > 0.0f;
    a.clamp_max = std::isfinite(p->dt_max);
    a.vec_y = p->head_dim % 4 == 0 && aligned16(p->y);
    a.slot_mul_seq = slots && per_seq ? 1 : 0;
    a.slot_mul_half = slots && !per_seq ? 1 : 0;
    a.n_chunk_slot = (int)slots;
    a.batch = b;

    // (profiling) events around phase k
    auto mark = [&](int k, int end) {
        if (ctx->events) {
            cudaEventRecord(ctx->events[2 * k + end], stream);
        }
    };
    // decode: sequences of at most one token (every sequence when max_seq_tok == 1); none when the
    // step is one sequence of several tokens without kept states (a prompt's prefill)
    mark(0, 0);
    if (!(b.n_seq == 1 && b.n_tok >= 2 && b.tok_keep == nullptr)) {
        const dim3 grid((unsigned)((p->head_dim + kDecodeRows - 1) / kDecodeRows), (unsigned)p->n_head,
                        (unsigned)b.n_seq);
        const bool cs = krk_state_streaming(), keep = b.tok_keep != nullptr;
        // [vec][cs][keep]: the variant of this step (keep: kept states, token by token)
        static void (*const kernels[2][2][2])(SsdArgs) = {
            {{ssd_decode_kernel<false, false, false>, ssd_decode_kernel<false, false, true>},
             {ssd_decode_kernel<false, true, false>, ssd_decode_kernel<false, true, true>}},
            {{ssd_decode_kernel<true, false, false>, ssd_decode_kernel<true, false, true>},
             {ssd_decode_kernel<true, true, false>, ssd_decode_kernel<true, true, true>}}};
        krk::launch_maybe_pdl(krk::pdl_enabled(), kernels[p->d_state % 4 == 0][cs][keep], grid, kDecodeThreads, 0,
                              stream, a);
        KRK_CHECK_LAUNCH();
    }
    mark(0, 1);
    if (slots == 0) {
        for (int k = 1; k < 3; k++) {
            mark(k, 0);
            mark(k, 1);
        }
        return KR_OK;
    }
    // chunked: sequences of two tokens or more
    mark(1, 0);
    krk::launch_maybe_pdl(krk::pdl_enabled(), ssd_bmm_kernel, dim3((unsigned)slots, (unsigned)p->n_group), kBmmThreads,
                          0, stream, a);
    KRK_CHECK_LAUNCH();
    mark(1, 1);
    mark(2, 0);
    const size_t smem = ssd_scan_smem_bytes(a.d_state);
    const dim3 scan_grid((unsigned)((p->head_dim + kScanP - 1) / kScanP), (unsigned)p->n_head, (unsigned)b.n_seq);
    const bool vec = p->conv_dim % 4 == 0 && p->d_state % 4 == 0 && p->head_dim % 4 == 0 &&
                     (p->n_head * p->head_dim) % 4 == 0 && aligned16(p->xbc);
    auto scan = [&](auto kernel) -> enum kr_status {
        KRK_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        // all of the unified L1 as shared memory, so that two blocks fit on an SM at d_state 128
        KRK_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          cudaSharedmemCarveoutMaxShared));
        krk::launch_maybe_pdl(krk::pdl_enabled(), kernel, scan_grid, kScanThreads, smem, stream, a);
        return KR_OK;
    };
    enum kr_status st;
    if (ssd_scan_np(a.d_state) == 128 && vec) {
        st = scan(ssd_scan_kernel<128, true>);
    } else if (vec) {
        st = scan(ssd_scan_kernel<0, true>);
    } else {
        st = scan(ssd_scan_kernel<0, false>);
    }
    if (st != KR_OK) {
        return st;
    }
    KRK_CHECK_LAUNCH();
    mark(2, 1);
    return KR_OK;
}
