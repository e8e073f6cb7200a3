// Prefill path (and mixed batches), bf16 or e4m3 caches: flash-attention tiles on bf16 tensor cores (mma.sync m16n8k16,
// fp32 accumulation). A block takes BM = 128 queries of one sequence and one query head (8 warps of
// 16 rows), streams BN-key tiles of its KV head from the paged cache into shared memory (cp.async,
// two stages) and keeps the online softmax in fp32 registers. Queries are rounded to bf16 and the
// probabilities are rounded to bf16 before the P.V product; scores, sums and outputs stay fp32.
#include "attention/attention-impl.cuh"
#include "common/mma.cuh"

namespace krk {
namespace attn {

constexpr int PF_BM = 128;            // queries per block
constexpr int PF_THREADS = PF_BM * 2; // one warp per 16 queries

template <int DP, int BN> constexpr int prefill_smem_bytes()
{
    // Q tile [BM][DP + 8] and two stages of K and V tiles [BN][DP + 8], bf16; the 8-element row
    // padding keeps ldmatrix rows on distinct banks.
    return (PF_BM + 4 * BN) * (DP + 8) * 2;
}

// DP: head_dim rounded up to a supported tile width (extra columns are zero); BN: keys per tile.
// C: the cache type. e4m3 rows enter the tiles as their codes in bf16 (exact); the key scale is
// folded into the score scale and the value scale into the output.
template <class C, int DP, int BN> __global__ void __launch_bounds__(PF_THREADS) prefill_kernel(Args a)
{
    krk::kernel_prologue();
    constexpr int BM = PF_BM, LD = DP + 8, CH = DP / 8; // CH: 16-byte chunks of a tile row
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t *sQ = reinterpret_cast<uint16_t *>(smem);
    uint16_t *sK = sQ + BM * LD; // [2][BN][LD]
    uint16_t *sV = sK + 2 * BN * LD;
    __shared__ int s_pos[BM];

    const int s = blockIdx.z, h = blockIdx.y;
    const int m0 = (int)(gridDim.x - 1 - blockIdx.x) * BM; // longest tiles first
    const int tok0 = a.b.seq_tok0[s];
    const int ntok = a.b.seq_tok0[s + 1] - tok0;
    if (m0 >= ntok || (a.route && ntok == 1)) { // routed: one-token sequences take the decode path
        return;
    }
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int hd = a.head_dim;
    const int rows = min(BM, ntok - m0);
    const int64_t ld_out = (int64_t)a.n_head * hd;
    float *out0 = a.out + (int64_t)(tok0 + m0) * ld_out + (int64_t)h * hd;

    if (a.b.seq_slot[s] < 0) {
        for (int i = tid; i < rows * hd; i += PF_THREADS) {
            out0[(i / hd) * ld_out + i % hd] = 0.0f;
        }
        return;
    }
    const int g = h / a.group;

    // positions of the tile's queries (-1: past the sequence, attends to nothing) and Q as bf16
    for (int i = tid; i < BM; i += PF_THREADS) {
        s_pos[i] = i < rows ? a.b.pos[tok0 + m0 + i] : -1;
    }
    for (int i = tid; i < BM * CH; i += PF_THREADS) {
        const int r = i / CH, c = (i % CH) * 8;
        uint32_t w[4] = {0, 0, 0, 0};
        if (r < rows && c < hd) {
            const float *qp = a.q + (int64_t)(tok0 + m0 + r) * a.ld_qkv + (int64_t)h * hd + c;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                w[k] = pack_bf16(qp[2 * k], qp[2 * k + 1]);
            }
        }
        *reinterpret_cast<uint4 *>(sQ + r * LD + c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    __syncthreads();

    // keys needed by the tile: 0 .. max position
    int kv_end = 0;
    for (int i = 0; i < rows; i++) {
        kv_end = max(kv_end, s_pos[i] + 1);
    }
    const int n_kt = (kv_end + BN - 1) / BN;

    const int32_t *bt = a.b.block_table + (int64_t)s * a.b.max_blocks;
    const int64_t row_len = (int64_t)a.n_kv_head * hd;
    const typename C::T *kc = static_cast<const typename C::T *>(a.k_cache) + (int64_t)g * hd;
    const typename C::T *vc = static_cast<const typename C::T *>(a.v_cache) + (int64_t)g * hd;
    const float scale_log2 = C::kScaled ? a.scale_log2 * a.k_scale : a.scale_log2;

    // K and V rows of key tile kt into stage st; keys past kv_end and columns past hd are zeros
    // (V must be finite where P is 0). TPK threads per key: each looks its row up in the block table
    // once and copies every TPK-th 16-byte chunk of it.
    constexpr int TPK = PF_THREADS / BN;
    static_assert(PF_THREADS % BN == 0, "whole threads per key of a tile");
    const int kr = tid / TPK, kpart = tid - kr * TPK;
    auto load_kv = [&](int st, int kt) {
        uint16_t *dk = sK + st * BN * LD + kr * LD, *dv = sV + st * BN * LD + kr * LD;
        const int j = kt * BN + kr;
        const int64_t off = j < kv_end ? cache_row(bt, j, a.block_size, row_len) : 0;
        for (int ci = kpart; ci < CH; ci += TPK) {
            const int c = ci * 8;
            const bool in = j < kv_end && c < hd;
            if constexpr (C::kScaled) { // plain loads, converted on the way to shared memory
                uint4 kw = make_uint4(0, 0, 0, 0), vw = make_uint4(0, 0, 0, 0);
                if (in) {
                    kw = e4m3x8_to_bf16x8(__ldg(reinterpret_cast<const uint2 *>(kc + off + c)));
                    vw = e4m3x8_to_bf16x8(__ldg(reinterpret_cast<const uint2 *>(vc + off + c)));
                }
                *reinterpret_cast<uint4 *>(dk + c) = kw;
                *reinterpret_cast<uint4 *>(dv + c) = vw;
            } else {
                cp_async16(dk + c, in ? kc + off + c : kc, in ? 16 : 0);
                cp_async16(dv + c, in ? vc + off + c : vc, in ? 16 : 0);
            }
        }
    };

    const int r_lo = warp * 16 + (lane >> 2); // this thread's rows of the tile: r_lo and r_lo + 8
    const int pos_lo = s_pos[r_lo], pos_hi = s_pos[r_lo + 8];
    int warp_pos = max(pos_lo, pos_hi);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        warp_pos = max(warp_pos, __shfl_xor_sync(0xffffffffu, warp_pos, o));
    }

    float o_acc[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            o_acc[n][e] = 0.0f;
        }
    }
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};

    if (n_kt > 0) {
        load_kv(0, 0);
        cp_async_commit();
    }
    for (int kt = 0; kt < n_kt; kt++) {
        if (kt + 1 < n_kt) {
            load_kv((kt + 1) & 1, kt + 1); // that stage was released by the barrier ending kt - 1
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint16_t *cK = sK + (kt & 1) * BN * LD, *cV = sV + (kt & 1) * BN * LD;

        if (kt * BN <= warp_pos) { // else every key of the tile is masked for this warp's rows
            // S = Q K^T
            float sc[BN / 8][4];
#pragma unroll
            for (int n = 0; n < BN / 8; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    sc[n][e] = 0.0f;
                }
            }
#pragma unroll
            for (int kk = 0; kk < DP / 16; kk++) {
                if (kk * 16 < hd) {
                    uint32_t qa[4];
                    ldmatrix_x4(qa, sQ + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + kk * 16 +
                                        (lane >> 4) * 8);
#pragma unroll
                    for (int nn = 0; nn < BN / 16; nn++) {
                        uint32_t kb[4];
                        ldmatrix_x4(kb, cK + (nn * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 +
                                            ((lane >> 3) & 1) * 8);
                        mma_bf16(sc[2 * nn], qa, kb[0], kb[1]);
                        mma_bf16(sc[2 * nn + 1], qa, kb[2], kb[3]);
                    }
                }
            }
            // scale to base 2, causal mask; then the online softmax
#pragma unroll
            for (int n = 0; n < BN / 8; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int j = kt * BN + n * 8 + (lane & 3) * 2 + (e & 1);
                    const int pq = e < 2 ? pos_lo : pos_hi;
                    sc[n][e] = j <= pq ? sc[n][e] * scale_log2 : -INFINITY;
                }
            }
            flash_softmax_step(sc, m_r, l_r, o_acc);
            // O += P V: the score accumulators of two key octets form one A fragment
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                uint32_t pa[4];
                pa[0] = pack_bf16(sc[2 * kk][0], sc[2 * kk][1]);
                pa[1] = pack_bf16(sc[2 * kk][2], sc[2 * kk][3]);
                pa[2] = pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
                pa[3] = pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
                for (int nd = 0; nd < DP / 16; nd++) {
                    if (nd * 16 < hd) {
                        uint32_t vb[4];
                        ldmatrix_x4_trans(vb, cV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                                                  nd * 16 + (lane >> 4) * 8);
                        mma_bf16(o_acc[2 * nd], pa, vb[0], vb[1]);
                        mma_bf16(o_acc[2 * nd + 1], pa, vb[2], vb[3]);
                    }
                }
            }
        }
        __syncthreads(); // the stage is read; the next iteration may refill it
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
        l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
    }
    // every real row saw key 0, so l > 0 there
    float inv[2] = {l_r[0] > 0.0f ? 1.0f / l_r[0] : 0.0f, l_r[1] > 0.0f ? 1.0f / l_r[1] : 0.0f};
    if constexpr (C::kScaled) {
        inv[0] *= a.v_scale;
        inv[1] *= a.v_scale;
    }
#pragma unroll
    for (int n = 0; n < DP / 8; n++) {
        const int c = n * 8 + (lane & 3) * 2;
        if (c < hd) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int row = r_lo + r * 8;
                if (row < rows) {
                    float *op = out0 + (int64_t)row * ld_out + c;
                    op[0] = o_acc[n][2 * r] * inv[r];
                    op[1] = o_acc[n][2 * r + 1] * inv[r];
                }
            }
        }
    }
}

template <class C, int DP, int BN> static enum kr_status prefill_launch(const Args &a, cudaStream_t stream)
{
    constexpr int smem = prefill_smem_bytes<DP, BN>();
    KRK_CUDA_TRY(
        cudaFuncSetAttribute(prefill_kernel<C, DP, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid((unsigned)((a.b.max_seq_tok + PF_BM - 1) / PF_BM), (unsigned)a.n_head,
                    (unsigned)a.b.n_seq);
    krk::launch_maybe_pdl(krk::pdl_enabled(), prefill_kernel<C, DP, BN>, grid, PF_THREADS, smem, stream, a);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

template <class C> enum kr_status launch_prefill(const Args &a, cudaStream_t stream)
{
    // key tiles: 64 keys up to head_dim 64, 32 above (measured on H200: 130 against 100 TFLOP/s
    // at head_dim 128, 112 against 96 at 64)
    if (a.head_dim <= 32) {
        return prefill_launch<C, 32, 64>(a, stream);
    }
    if (a.head_dim <= 64) {
        return prefill_launch<C, 64, 64>(a, stream);
    }
    if (a.head_dim <= 128) {
        return prefill_launch<C, 128, 32>(a, stream);
    }
    return prefill_launch<C, 256, 32>(a, stream);
}

template enum kr_status launch_prefill<CacheBf16>(const Args &a, cudaStream_t stream);
template enum kr_status launch_prefill<CacheE4m3>(const Args &a, cudaStream_t stream);

} // namespace attn
} // namespace krk
