// Absorbed MLA attention with every head of a token in one block, on bf16 tensor cores
// (KRK_MLA_ATTN_HEADS), so that each cached latent is read once per token instead of once per head.
// Same semantics as mla_attn_kernel (mla-attention.cu), at bf16 precision of the products:
//   q_abs[h] = W_UK[h]^T q_nope[h]      fp32 on CUDA cores, then rounded to bf16
//   Q[h] = [q_abs[h] | q_pe[h]]          a row of D = R + rope bf16 values; padding heads are zero rows
//   S = Q K^T over tiles of BN keys      K rows are the cached latents [c_kv | k_pe] (bf16), selected by
//                                        idx or every position <= pos
//   online softmax per head (fp32, base 2), P rounded to bf16, O += P V with V = c_kv (first R columns)
//   out[h] = W_UV[h] (O[h] / l[h])       fp32 on CUDA cores
// The flash-attention structure is that of attention/prefill.cu: warps own 16 head rows (and here
// one half of O's R columns, so that a thread holds R/2/8 accumulator tiles; both halves compute
// the same scores), key tiles stream through two cp.async stages.
#include "common/mma.cuh"
#include "mla/mla-common.cuh"

namespace {

constexpr int kBN = 32; // keys per tile

template <int R, int ROPE> struct HeadsShape {
    static constexpr int D = R + ROPE; // score width
    static constexpr int LD = D + 8;   // padded smem rows: ldmatrix rows on distinct banks
    static constexpr int CH = D / 8;   // 16-byte chunks per latent row
};

template <int R, int ROPE> __host__ __device__ size_t heads_smem_bytes(int hg)
{
    using S = HeadsShape<R, ROPE>;
    const size_t tiles = (size_t)(hg * 16 + 2 * kBN) * S::LD * 2; // Q + two key stages, bf16
    const size_t o_buf = (size_t)hg * 16 * R * 4;                  // O rows (fp32) after the loop
    return (tiles > o_buf ? tiles : o_buf) + 2 * kBN * 4;          // + key validity of both stages
}

// Grid: one block per token; blockDim = hg * 64 (hg groups of 16 head rows, two column halves).
template <int R, int ROPE> __global__ void __launch_bounds__(256) mla_heads_kernel(krk_mla_attn_params p, int hg)
{
    using S = HeadsShape<R, ROPE>;
    constexpr int D = S::D, LD = S::LD, CH = S::CH, HALF = R / 2;
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t *sQ = reinterpret_cast<uint16_t *>(smem); // [hg * 16][LD]
    uint16_t *sK = sQ + hg * 16 * LD;                   // [2][kBN][LD]
    float *oBuf = reinterpret_cast<float *>(smem);      // [hg * 16][R] after the loop (aliases Q, K)
    int *sValid = reinterpret_cast<int *>(smem + heads_smem_bytes<R, ROPE>(hg) - 2 * kBN * 4); // [2][kBN]

    const krk_batch &b = p.batch;
    const int64_t t = blockIdx.x;
    const int H = (int)p.n_head, HP = hg * 16;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int nthreads = blockDim.x;
    const int32_t seq = b.tok_seq[t], pos = b.pos[t];
    float *out = p.out + t * H * p.v_dim;
    if (b.seq_slot[seq] < 0) { // padding: read no cache, write zeros
        for (int64_t i = tid; i < (int64_t)H * p.v_dim; i += nthreads) {
            out[i] = 0.0f;
        }
        return;
    }
    const int64_t qd = p.nope + ROPE;
    const float *kv_b = p.kv_b; // per head: W_UK [nope][R], then W_UV [v_dim][R]

    // Q rows: q_abs in fp32, rounded once; q_pe copied; padding rows zero
    for (int64_t e = tid; e < (int64_t)HP * R; e += nthreads) {
        const int h = (int)(e / R), r = (int)(e - (int64_t)h * R);
        float acc = 0.0f;
        if (h < H) {
            const float *qn = p.q + (t * H + h) * qd;
            const float *wk = kv_b + (int64_t)h * (p.nope + p.v_dim) * R + r;
            for (int64_t d = 0; d < p.nope; d++) {
                acc = fmaf(qn[d], wk[d * R], acc);
            }
        }
        sQ[h * LD + r] = krk::f32_to_bf16(acc);
    }
    for (int e = tid; e < HP * (LD - R); e += nthreads) {
        const int h = e / (LD - R), i = e - h * (LD - R);
        const float v = h < H && i < ROPE ? p.q[(t * H + h) * qd + p.nope + i] : 0.0f;
        sQ[h * LD + R + i] = krk::f32_to_bf16(v);
    }

    const int64_t n_cand = p.idx ? p.topk : (int64_t)pos + 1;
    const int n_kt = (int)((n_cand + kBN - 1) / kBN);
    // latent rows of key tile kt into stage st (zeros for masked keys: V must be finite where P is 0)
    auto load_tile = [&](int st, int kt) {
        uint16_t *dk = sK + st * kBN * LD;
        for (int i = tid; i < kBN * CH; i += nthreads) {
            const int jj = i / CH, c = (i - jj * CH) * 8;
            const int64_t j = (int64_t)kt * kBN + jj;
            int32_t key = -1;
            if (j < n_cand) {
                key = p.idx ? p.idx[t * p.topk + j] : (int32_t)j;
            }
            const bool ok = key >= 0 && key <= pos;
            const krk_bf16 *src = p.cache;
            if (ok) {
                src = p.cache + krk::mla::latent_row_off(b, seq, key, p.block_size, p.row) + c;
            }
            krk::cp_async16(dk + jj * LD + c, src, ok ? 16 : 0);
            if (c == 0) {
                sValid[st * kBN + jj] = ok;
            }
        }
    };

    const int rg = warp >> 1, half = warp & 1; // this warp's 16 head rows and half of O's columns
    float o_acc[HALF / 8][4];
#pragma unroll
    for (int n = 0; n < HALF / 8; n++) {
        o_acc[n][0] = o_acc[n][1] = o_acc[n][2] = o_acc[n][3] = 0.0f;
    }
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
    const float scale_log2 = p.scale * 1.4426950408889634f;

    if (n_kt > 0) {
        load_tile(0, 0);
        krk::cp_async_commit();
    }
    for (int kt = 0; kt < n_kt; kt++) {
        if (kt + 1 < n_kt) {
            load_tile((kt + 1) & 1, kt + 1); // that stage was released by the barrier ending kt - 1
            krk::cp_async_commit();
            krk::cp_async_wait<1>();
        } else {
            krk::cp_async_wait<0>();
        }
        __syncthreads(); // (also: the Q rows are written before the first tile is read)
        const uint16_t *cK = sK + (kt & 1) * kBN * LD;
        const int *valid = sValid + (kt & 1) * kBN;

        // S = Q K^T for this warp's 16 rows and the tile's kBN keys
        float sc[kBN / 8][4];
#pragma unroll
        for (int n = 0; n < kBN / 8; n++) {
            sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
        }
#pragma unroll 4
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t qa[4];
            krk::ldmatrix_x4(qa, sQ + (rg * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int nn = 0; nn < kBN / 16; nn++) {
                uint32_t kb[4];
                krk::ldmatrix_x4(kb, cK + (nn * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 +
                                         ((lane >> 3) & 1) * 8);
                krk::mma_bf16(sc[2 * nn], qa, kb[0], kb[1]);
                krk::mma_bf16(sc[2 * nn + 1], qa, kb[2], kb[3]);
            }
        }
        // scale to base 2, mask; then the online softmax of the rows r_lo and r_lo + 8 of the group
#pragma unroll
        for (int n = 0; n < kBN / 8; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int jj = n * 8 + (lane & 3) * 2 + (e & 1);
                sc[n][e] = valid[jj] ? sc[n][e] * scale_log2 : -INFINITY;
            }
        }
        krk::flash_softmax_step(sc, m_r, l_r, o_acc);
        // O[:, half] += P V: two key octets of scores form one A fragment; V = c_kv columns
#pragma unroll
        for (int kk = 0; kk < kBN / 16; kk++) {
            uint32_t pa[4];
            pa[0] = krk::pack_bf16(sc[2 * kk][0], sc[2 * kk][1]);
            pa[1] = krk::pack_bf16(sc[2 * kk][2], sc[2 * kk][3]);
            pa[2] = krk::pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            pa[3] = krk::pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
            for (int nd = 0; nd < HALF / 16; nd++) {
                uint32_t vb[4];
                krk::ldmatrix_x4_trans(vb, cK + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + half * HALF +
                                               nd * 16 + (lane >> 4) * 8);
                krk::mma_bf16(o_acc[2 * nd], pa, vb[0], vb[1]);
                krk::mma_bf16(o_acc[2 * nd + 1], pa, vb[2], vb[3]);
            }
        }
        __syncthreads(); // the stage is read; the next iteration may refill it
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
        l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
    }
    const float inv[2] = {l_r[0] > 0.0f ? 1.0f / l_r[0] : 0.0f, l_r[1] > 0.0f ? 1.0f / l_r[1] : 0.0f};
    __syncthreads(); // Q and the key stages are dead: O rows take their place
    const int r_lo = rg * 16 + (lane >> 2);
#pragma unroll
    for (int n = 0; n < HALF / 8; n++) {
        const int c = half * HALF + n * 8 + (lane & 3) * 2;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float *op = oBuf + (int64_t)(r_lo + r * 8) * R + c;
            op[0] = o_acc[n][2 * r] * inv[r];
            op[1] = o_acc[n][2 * r + 1] * inv[r];
        }
    }
    __syncthreads();
    // out[h][v] = W_UV[h][v] . O[h]: a warp per output, lanes over R
    const int n_warp = nthreads >> 5;
    for (int64_t e = warp; e < (int64_t)H * p.v_dim; e += n_warp) {
        const int h = (int)(e / p.v_dim);
        const int64_t v = e - (int64_t)h * p.v_dim;
        const float *wv = kv_b + ((int64_t)h * (p.nope + p.v_dim) + p.nope + v) * R;
        const float *o = oBuf + (int64_t)h * R;
        float acc = 0.0f;
        for (int r = lane; r < R; r += 32) {
            acc = fmaf(wv[r], o[r], acc);
        }
        acc = krk::warp_sum(acc);
        if (lane == 0) {
            out[e] = acc;
        }
    }
}

template <int R, int ROPE> enum kr_status heads_launch(const krk_mla_attn_params &p, cudaStream_t stream)
{
    const int hg = (int)((p.n_head + 15) / 16);
    const size_t smem = heads_smem_bytes<R, ROPE>(hg);
    KRK_CUDA_TRY(cudaFuncSetAttribute(mla_heads_kernel<R, ROPE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)smem));
    mla_heads_kernel<R, ROPE><<<(unsigned)p.batch.n_tok, (unsigned)(hg * 64), smem, stream>>>(p, hg);
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

} // namespace

// The head-batched kernel runs the DeepSeek-V3.2 latent shape (kv_lora 512, rope 64) with up to 64
// heads per token and 16-byte aligned latent rows; true when it takes `p`.
extern "C" bool krk_mla_heads_fits(const struct krk_mla_attn_params *p)
{
    return p->kv_lora == 512 && p->rope == 64 && p->n_head >= 1 && p->n_head <= 64 && p->row % 8 == 0 &&
           ((uintptr_t)p->cache & 15) == 0 && p->batch.n_tok <= 0x7fffffff;
}

extern "C" enum kr_status krk_mla_heads(const struct krk_mla_attn_params *p, cudaStream_t stream)
{
    return heads_launch<512, 64>(*p, stream);
}
