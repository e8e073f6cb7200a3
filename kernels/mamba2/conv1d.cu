// krk_conv1d: causal depthwise conv + SiLU over xBC with the K-1 previous inputs carried in a
// bf16 conv state per sequence. Two kernels so that no output reads a state already replaced:
// conv1d_out_kernel computes every output (reading old states), then conv1d_state_kernel writes
// each sequence's new state (its last K-1 inputs, older state rows where it has fewer tokens).
// Steps of at most one token per sequence (decode) take one kernel instead, conv1d_decode_kernel:
// each thread owns one channel of one sequence, so it can read the old state, write the output and
// then the new state with no other thread involved.
#include "common/util.cuh"

namespace {

constexpr int kConvThreads = 128; // channels per block
// Consecutive tokens per thread (the window slides in registers): 16 for prefill chunks, fewer
// when sequences are short, since every sequence start in a run costs a chain of dependent loads
// (its batch entries, then its state).
constexpr int kConvTokensMax = 16;

struct ConvArgs {
    const float *__restrict__ in;
    int64_t ld_in, in_off, conv_dim;
    const float *__restrict__ w;
    const float *__restrict__ b;
    krk_bf16 *__restrict__ state;
    float *__restrict__ out;
    krk_batch batch;
    // --batch-invariant: earlier inputs of a sequence enter its later outputs rounded to bf16, as the
    // state carries them across steps, so that an output does not depend on where its step began
    bool round_taps;
};

__device__ __forceinline__ float round_bf16(float v)
{
    return krk::bf16_to_f32(krk::f32_to_bf16(v));
}

// Input i of sequence s (i < 0: the state's rows, i = -1 the newest; zeros for a fresh or
// padding sequence).
template <int K>
__device__ __forceinline__ float conv_input(const ConvArgs &a, int64_t c, int t0, int i, int slot, bool fresh)
{
    if (i >= 0) { // an earlier input of the same step
        const float v = a.in[(int64_t)(t0 + i) * a.ld_in + a.in_off + c];
        return a.round_taps ? round_bf16(v) : v;
    }
    if (fresh) {
        return 0.0f;
    }
    return krk::bf16_to_f32(a.state[((int64_t)slot * (K - 1) + (K - 1 + i)) * a.conv_dim + c]);
}

template <int K, int TT>
__global__ void __launch_bounds__(kConvThreads) conv1d_out_kernel(ConvArgs a)
{
    krk::kernel_prologue();
    const int64_t c = (int64_t)blockIdx.y * kConvThreads + threadIdx.x;
    if (c >= a.conv_dim) {
        return;
    }
    const int t_begin = blockIdx.x * TT;
    const int n = min(TT, a.batch.n_tok - t_begin);
    float w[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        w[k] = a.w[c * K + k];
    }
    const float bias = a.b ? a.b[c] : 0.0f;
    // the run's inputs and sequence indices, loaded up front (independent loads in flight)
    float xin[TT];
    int sq[TT];
#pragma unroll
    for (int i = 0; i < TT; i++) {
        if (i < n) {
            xin[i] = a.in[(int64_t)(t_begin + i) * a.ld_in + a.in_off + c];
            sq[i] = a.batch.tok_seq[t_begin + i];
        }
    }
    float win[K]; // the last K inputs, oldest first
    int seq = -1, t0 = 0;
#pragma unroll
    for (int i = 0; i < TT; i++) {
        if (i >= n) {
            break;
        }
        const int t = t_begin + i;
        const int s = sq[i];
        if (s != seq) {
            seq = s;
            t0 = a.batch.seq_tok0[s];
            const int slot = a.batch.seq_slot[s];
            const bool fresh = a.batch.seq_pos0[s] == 0 || slot < 0;
#pragma unroll
            for (int k = 0; k < K - 1; k++) {
                win[k] = conv_input<K>(a, c, t0, t - t0 - (K - 1) + k, slot, fresh);
            }
        } else {
#pragma unroll
            for (int k = 0; k < K - 1; k++) {
                win[k] = win[k + 1];
            }
        }
        win[K - 1] = xin[i];
        float acc = bias;
#pragma unroll
        for (int k = 0; k < K; k++) {
            acc += w[k] * win[k];
        }
        a.out[(int64_t)t * a.conv_dim + c] = acc / (1.0f + expf(-acc));
        if (a.round_taps) {
            win[K - 1] = round_bf16(win[K - 1]); // an earlier input from now on
        }
    }
}

// New state of sequence blockIdx.y: row r (r = 0 oldest .. K-2 newest) is input nt - (K-1) + r.
template <int K>
__global__ void __launch_bounds__(kConvThreads) conv1d_state_kernel(ConvArgs a)
{
    krk::kernel_prologue();
    const int64_t c = (int64_t)blockIdx.x * kConvThreads + threadIdx.x;
    const int s = blockIdx.y;
    const int slot = a.batch.seq_slot[s];
    if (c >= a.conv_dim || slot < 0) {
        return;
    }
    const int t0 = a.batch.seq_tok0[s], nt = a.batch.seq_tok0[s + 1] - t0;
    const bool fresh = a.batch.seq_pos0[s] == 0;
    // the states kept after single tokens (batch.tok_keep): the K-1 inputs ending at that token,
    // into slots of their own, while the sequence's slot still holds its old rows
    if (a.batch.tok_keep) {
        for (int i = 0; i < nt; i++) {
            const int ks = a.batch.tok_keep[t0 + i];
            if (ks < 0) {
                continue;
            }
#pragma unroll
            for (int r = 0; r < K - 1; r++) {
                const float x = conv_input<K>(a, c, t0, i - (K - 2) + r, slot, fresh);
                a.state[((int64_t)ks * (K - 1) + r) * a.conv_dim + c] = krk::f32_to_bf16(x);
            }
        }
    }
    float v[K - 1];
#pragma unroll
    for (int r = 0; r < K - 1; r++) { // every old row is read before any is written
        v[r] = conv_input<K>(a, c, t0, nt - (K - 1) + r, slot, fresh);
    }
#pragma unroll
    for (int r = 0; r < K - 1; r++) {
        a.state[((int64_t)slot * (K - 1) + r) * a.conv_dim + c] = krk::f32_to_bf16(v[r]);
    }
}

// One token per sequence: output and new state of channel c of sequence blockIdx.y, the same
// arithmetic as the two kernels above. The weights are read before the wait for the previous kernel
// (no kernel writes them).
template <int K>
__global__ void __launch_bounds__(kConvThreads) conv1d_decode_kernel(ConvArgs a)
{
    const int64_t c = (int64_t)blockIdx.x * kConvThreads + threadIdx.x;
    const int s = blockIdx.y;
    krk::pdl_trigger();
    // Before the wait: the weights, the batch arrays (uploaded before the step's first kernel) and
    // the sequence's conv state (written only by this layer's conv of an earlier step), so that
    // their loads overlap the previous kernel; the input comes from that kernel, after the wait.
    if (c >= a.conv_dim) {
        return;
    }
    float w[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        w[k] = a.w[c * K + k];
    }
    const float bias = a.b ? a.b[c] : 0.0f;
    const int t0 = a.batch.seq_tok0[s];
    if (a.batch.seq_tok0[s + 1] - t0 != 1) {
        // no token this step (the launcher takes this kernel only when none has more); the wait
        // keeps completion transitive when no sequence has one
        krk::pdl_wait();
        return;
    }
    const int slot = a.batch.seq_slot[s];
    const bool fresh = a.batch.seq_pos0[s] == 0 || slot < 0;
    float win[K]; // oldest first
#pragma unroll
    for (int k = 0; k < K - 1; k++) {
        win[k] = fresh ? 0.0f : krk::bf16_to_f32(a.state[((int64_t)slot * (K - 1) + k) * a.conv_dim + c]);
    }
    krk::pdl_wait();
    win[K - 1] = a.in[(int64_t)t0 * a.ld_in + a.in_off + c];
    float acc = bias;
#pragma unroll
    for (int k = 0; k < K; k++) {
        acc += w[k] * win[k];
    }
    a.out[(int64_t)t0 * a.conv_dim + c] = acc / (1.0f + expf(-acc));
    if (slot >= 0) {
#pragma unroll
        for (int r = 0; r < K - 1; r++) {
            a.state[((int64_t)slot * (K - 1) + r) * a.conv_dim + c] = krk::f32_to_bf16(win[r + 1]);
        }
    }
}

template <int K, int TT>
void conv1d_out_launch(const ConvArgs &a, unsigned cblocks, cudaStream_t stream)
{
    const dim3 grid((unsigned)((a.batch.n_tok + TT - 1) / TT), cblocks);
    krk::launch_maybe_pdl(krk::pdl_enabled(), conv1d_out_kernel<K, TT>, grid, kConvThreads, 0, stream, a);
}

template <int K>
cudaError_t conv1d_launch(const ConvArgs &a, cudaStream_t stream)
{
    const unsigned cblocks = (unsigned)((a.conv_dim + kConvThreads - 1) / kConvThreads);
    if (a.batch.max_seq_tok <= 1 && !a.batch.tok_keep) { /* kept states: the state kernel writes them */
        krk::launch_maybe_pdl(krk::pdl_enabled(), conv1d_decode_kernel<K>, dim3(cblocks, (unsigned)a.batch.n_seq),
                              kConvThreads, 0, stream, a);
        return cudaGetLastError();
    }
    if (a.batch.n_tok > 0) {
        if (a.batch.max_seq_tok >= kConvTokensMax) {
            conv1d_out_launch<K, kConvTokensMax>(a, cblocks, stream);
        } else if (a.batch.max_seq_tok >= 4) {
            conv1d_out_launch<K, 4>(a, cblocks, stream);
        } else {
            conv1d_out_launch<K, 1>(a, cblocks, stream);
        }
    }
    krk::launch_maybe_pdl(krk::pdl_enabled(), conv1d_state_kernel<K>, dim3(cblocks, (unsigned)a.batch.n_seq),
                          kConvThreads, 0, stream, a);
    return cudaGetLastError();
}

} // namespace

extern "C" enum kr_status krk_conv1d(const struct krk_conv1d_params *p, const struct krk_ctx *ctx)
{
    KRK_REQUIRE(p != nullptr && ctx != nullptr);
    const krk_batch &b = ctx->batch;
    const cudaStream_t stream = ctx->stream;
    KRK_REQUIRE(p->d_conv >= 2 && p->d_conv <= 8);
    KRK_REQUIRE(p->conv_dim >= 1 && p->in_off >= 0 && p->ld_in >= p->in_off + p->conv_dim);
    KRK_REQUIRE(b.n_tok >= 0 && b.n_seq >= 0);
    KRK_REQUIRE_MSG(b.n_seq <= 65535, "conv1d: %d sequences in one step, at most 65535 (gridDim.y)", b.n_seq);
    KRK_REQUIRE_MSG(p->conv_dim <= 65535 * (int64_t)kConvThreads, "conv1d: %lld channels, at most %lld (gridDim.y)",
                    (long long)p->conv_dim, 65535 * (long long)kConvThreads);
    if (b.n_seq == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->w && p->state && b.seq_tok0 && b.seq_pos0 && b.seq_slot);
    KRK_REQUIRE(b.n_tok == 0 || (p->in && p->out && b.tok_seq));
    ConvArgs a;
    a.in = p->in;
    a.ld_in = p->ld_in;
    a.in_off = p->in_off;
    a.conv_dim = p->conv_dim;
    a.w = p->w;
    a.b = p->b;
    a.state = p->state;
    a.out = p->out;
    a.batch = b;
    a.round_taps = ctx->batch_invariant;
    cudaError_t e = cudaSuccess;
    switch (p->d_conv) {
    case 2: e = conv1d_launch<2>(a, stream); break;
    case 3: e = conv1d_launch<3>(a, stream); break;
    case 4: e = conv1d_launch<4>(a, stream); break;
    case 5: e = conv1d_launch<5>(a, stream); break;
    case 6: e = conv1d_launch<6>(a, stream); break;
    case 7: e = conv1d_launch<7>(a, stream); break;
    default: e = conv1d_launch<8>(a, stream); break;
    }
    if (e != cudaSuccess) {
        fprintf(stderr, "krk: %s:%d: launch failed: %s\n", __FILE__, __LINE__, cudaGetErrorString(e));
        return KR_ERR_CUDA;
    }
    return KR_OK;
}
