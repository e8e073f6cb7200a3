// Decode path (one token per sequence): flash-decoding split-K over the paged cache (bf16 or e4m3). The grid is
// (n_tok, n_kv_head * head chunks, n_split), fixed by host-known sizes (routed, --batch-invariant:
// (n_seq, ..., INV_SPLIT), blocks of sequences with more than one token exit); each block walks its share of
// the token's context, computed from the device-side position, for every query head of one KV head
// (GQA: each K/V row is read once per split), then a combine kernel merges the splits.
#include "attention/attention-impl.cuh"

namespace krk {
namespace attn {

constexpr int DEC_THREADS = 128;
constexpr int COMBINE_THREADS = 128;

// The token of a decode or combine block: blockIdx.x is the token, or routed the sequence, whose
// one token it is (false: the sequence has more this step and takes the prefill path).
__device__ __forceinline__ bool block_token(const Args &a, int *t, int *s)
{
    if (!a.route) {
        *t = blockIdx.x;
        *s = a.b.tok_seq[*t];
        return true;
    }
    *s = blockIdx.x;
    *t = a.b.seq_tok0[*s];
    return a.b.seq_tok0[*s + 1] - *t == 1;
}

// L lanes share one key row (lane i holds elements 8i..8i+7, lanes with 8i >= head_dim idle); HB
// query heads of one KV head per block; KB keys per lane group per step, the next step's rows
// loaded while the current ones are used (loads in flight). Online softmax in base 2 and fp32
// throughout, from fp32 queries and the cache's values (bf16, or e4m3 code * scale: C).
template <class C, int NT, int L, int HB, int KB> __global__ void __launch_bounds__(NT) decode_kernel(Args a)
{
    krk::kernel_prologue();
    constexpr int NG = NT / L;  // lane groups in the block
    constexpr int GPW = 32 / L; // lane groups in a warp
    __shared__ float sh_m[NG][HB], sh_l[NG][HB];
    __shared__ float sh_acc[NG][HB][L * 8];

    // the block's token (routed: its sequence, taken only when it has one token this step) and the
    // row of its partial sums
    int t, s;
    if (!block_token(a, &t, &s)) {
        return;
    }
    const int64_t prow = a.route ? s : t;
    const int n_chunk = (a.group + HB - 1) / HB;
    const int g = blockIdx.y / n_chunk;                       // KV head
    const int h0 = g * a.group + (blockIdx.y % n_chunk) * HB; // first query head of the block
    const int nh = min(HB, g * a.group + a.group - h0);       // query heads of the block
    const int split = blockIdx.z;
    const int hd = a.head_dim;
    const int64_t ld_out = (int64_t)a.n_head * hd;

    if (a.b.seq_slot[s] < 0) {
        // padding: no cache read; with splits the combine writes the zeros
        if (a.n_split == 1) {
            for (int i = threadIdx.x; i < nh * hd; i += NT) {
                a.out[t * ld_out + (int64_t)h0 * hd + i] = 0.0f;
            }
        }
        return;
    }
    const int ctx = a.b.pos[t] + 1;
    const int n_act = active_splits(ctx, a.n_split);
    if (split >= n_act) {
        return;
    }
    const int chunk = (ctx + n_act - 1) / n_act;
    const int j_begin = split * chunk;
    const int j_end = min(ctx, j_begin + chunk);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int li = lane % L;              // lane within the group
    const int gi = warp * GPW + lane / L; // group within the block
    const bool active = li * 8 < hd;

    float q[HB][8];
#pragma unroll
    for (int hh = 0; hh < HB; hh++) {
        const float *qp = a.q + (int64_t)t * a.ld_qkv + (int64_t)(h0 + hh) * hd + li * 8;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            q[hh][i] = (active && hh < nh) ? qp[i] * a.scale_log2 : 0.0f;
        }
    }

    float m[HB], l[HB], acc[HB][8];
#pragma unroll
    for (int hh = 0; hh < HB; hh++) {
        m[hh] = -INFINITY;
        l[hh] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            acc[hh][i] = 0.0f;
        }
    }

    const int32_t *bt = a.b.block_table + (int64_t)s * a.b.max_blocks;
    const int64_t row_len = (int64_t)a.n_kv_head * hd;
    using Chunk = typename C::Chunk;
    const typename C::T *kc = static_cast<const typename C::T *>(a.k_cache) + (int64_t)g * hd + li * 8;
    const typename C::T *vc = static_cast<const typename C::T *>(a.v_cache) + (int64_t)g * hd + li * 8;

    // rows of keys j0 .. j0 + KB - 1 (zeros past j_end)
    auto load = [&](int j0, Chunk kr[KB], Chunk vr[KB]) {
#pragma unroll
        for (int u = 0; u < KB; u++) {
            const int j = j0 + u;
            if (active && j < j_end) {
                const int64_t off = cache_row(bt, j, a.block_size, row_len);
                kr[u] = __ldg(reinterpret_cast<const Chunk *>(kc + off));
                vr[u] = __ldg(reinterpret_cast<const Chunk *>(vc + off));
            } else {
                kr[u] = Chunk{};
                vr[u] = Chunk{};
            }
        }
    };

    // The loop bound depends only on the warp, so every lane of a warp takes part in the shuffles;
    // keys past j_end are masked.
    constexpr int STEP = NG * KB;
    const int jw0 = j_begin + warp * GPW * KB, sub = (lane / L) * KB;
    Chunk kr[KB], vr[KB];
    load(jw0 + sub, kr, vr);
    for (int jw = jw0; jw < j_end; jw += STEP) {
        const int j0 = jw + sub;
        Chunk kn[KB], vn[KB];
        load(jw + STEP + sub, kn, vn); // next step (all zeros past the end)
        float sc[KB][HB];
#pragma unroll
        for (int u = 0; u < KB; u++) {
            float kf[8];
            C::to_f32(kr[u], a.k_scale, kf);
#pragma unroll
            for (int hh = 0; hh < HB; hh++) {
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    d = fmaf(q[hh][i], kf[i], d);
                }
#pragma unroll
                for (int o = L / 2; o > 0; o >>= 1) {
                    d += __shfl_xor_sync(0xffffffffu, d, o);
                }
                sc[u][hh] = j0 + u < j_end ? d : -INFINITY;
            }
        }
#pragma unroll
        for (int hh = 0; hh < HB; hh++) {
            float mx = m[hh];
#pragma unroll
            for (int u = 0; u < KB; u++) {
                mx = fmaxf(mx, sc[u][hh]);
            }
            const float mref = mx == -INFINITY ? 0.0f : mx; // a group that has seen no key yet
            const float corr = exp2_approx(m[hh] - mref);
            m[hh] = mx;
            l[hh] *= corr;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                acc[hh][i] *= corr;
            }
#pragma unroll
            for (int u = 0; u < KB; u++) {
                const float pu = exp2_approx(sc[u][hh] - mref);
                l[hh] += pu;
                float vf[8];
                C::to_f32(vr[u], a.v_scale, vf);
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    acc[hh][i] = fmaf(pu, vf[i], acc[hh][i]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < KB; u++) {
            kr[u] = kn[u];
            vr[u] = vn[u];
        }
    }

    // merge the lane groups of the block
#pragma unroll
    for (int hh = 0; hh < HB; hh++) {
        if (li == 0) {
            sh_m[gi][hh] = m[hh];
            sh_l[gi][hh] = l[hh];
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            sh_acc[gi][hh][li * 8 + i] = acc[hh][i];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < nh * hd; idx += NT) {
        const int hh = idx / hd, d = idx % hd;
        float mx = -INFINITY;
        for (int k = 0; k < NG; k++) {
            mx = fmaxf(mx, sh_m[k][hh]);
        }
        // mx is finite: the split holds at least one key, so some group has seen one
        float sum = 0.0f, num = 0.0f;
        for (int k = 0; k < NG; k++) {
            const float w = exp2_approx(sh_m[k][hh] - mx);
            sum = fmaf(w, sh_l[k][hh], sum);
            num = fmaf(w, sh_acc[k][hh][d], num);
        }
        const int h = h0 + hh;
        if (a.n_split == 1) {
            a.out[t * ld_out + (int64_t)h * hd + d] = num / sum;
        } else {
            const int64_t r = (prow * a.n_split + split) * a.n_head + h;
            a.part_acc[r * hd + d] = num;
            if (d == 0) {
                a.part_ml[r] = make_float2(mx, sum);
            }
        }
    }
}

// One block per (token, query head): merges the active splits' partial sums.
__global__ void __launch_bounds__(COMBINE_THREADS) combine_kernel(Args a)
{
    krk::kernel_prologue();
    const int h = blockIdx.y;
    int t, s;
    if (!block_token(a, &t, &s)) {
        return;
    }
    const int hd = a.head_dim;
    float *o = a.out + (int64_t)t * a.n_head * hd + (int64_t)h * hd;
    if (a.b.seq_slot[s] < 0) {
        for (int d = threadIdx.x; d < hd; d += COMBINE_THREADS) {
            o[d] = 0.0f;
        }
        return;
    }
    const int n_act = active_splits(a.b.pos[t] + 1, a.n_split);
    const int64_t r0 = (int64_t)(a.route ? s : t) * a.n_split * a.n_head + h; // split 0; split i at + i*n_head
    float mx = -INFINITY;
    for (int i = 0; i < n_act; i++) {
        mx = fmaxf(mx, a.part_ml[r0 + (int64_t)i * a.n_head].x);
    }
    float sum = 0.0f;
    for (int i = 0; i < n_act; i++) {
        const float2 ml = a.part_ml[r0 + (int64_t)i * a.n_head];
        sum = fmaf(exp2_approx(ml.x - mx), ml.y, sum);
    }
    const float inv = 1.0f / sum;
    for (int d = threadIdx.x; d < hd; d += COMBINE_THREADS) {
        float num = 0.0f;
        for (int i = 0; i < n_act; i++) {
            const int64_t r = r0 + (int64_t)i * a.n_head;
            num = fmaf(exp2_approx(a.part_ml[r].x - mx), a.part_acc[r * hd + d], num);
        }
        o[d] = num * inv;
    }
}

template <class C, int L, int HB> static void decode_launch(const Args &a, cudaStream_t stream)
{
    // 4 keys per step and lane group, 2 where the per-thread state is large (no spills). Measured
    // on H200 (32/8 heads x 128): 128 threads per block beat 256, 8 keys per step gained nothing
    // overall, and 64 splits no more than 32.
    constexpr int KB = HB >= 8 || HB * L >= 128 ? 2 : 4;
    const int n_chunk = (a.group + HB - 1) / HB;
    const dim3 grid((unsigned)(a.route ? a.b.n_seq : a.b.n_tok), (unsigned)(a.n_kv_head * n_chunk),
                    (unsigned)a.n_split);
    krk::launch_maybe_pdl(krk::pdl_enabled(), decode_kernel<C, DEC_THREADS, L, HB, KB>, grid, DEC_THREADS, 0, stream,
                          a);
}

template <class C, int L> static void decode_launch_heads(const Args &a, cudaStream_t stream)
{
    if (a.group == 1) {
        decode_launch<C, L, 1>(a, stream);
    } else if (a.group == 2) {
        decode_launch<C, L, 2>(a, stream);
    } else if (a.group <= 4) {
        decode_launch<C, L, 4>(a, stream);
    } else {
        decode_launch<C, L, 8>(a, stream);
    }
}

template <class C> enum kr_status launch_decode(const Args &a, cudaStream_t stream)
{
    // grid.y = n_kv_head * head chunks <= n_head <= 65535 (checked by krk_attn)
    const int chunks = a.head_dim / 8; // 8-value chunks of a row
    if (chunks <= 4) {
        decode_launch_heads<C, 4>(a, stream);
    } else if (chunks <= 8) {
        decode_launch_heads<C, 8>(a, stream);
    } else if (chunks <= 16) {
        decode_launch_heads<C, 16>(a, stream);
    } else {
        decode_launch_heads<C, 32>(a, stream);
    }
    KRK_CHECK_LAUNCH();
    if (a.n_split > 1) {
        krk::launch_maybe_pdl(krk::pdl_enabled(), combine_kernel,
                              dim3((unsigned)(a.route ? a.b.n_seq : a.b.n_tok), (unsigned)a.n_head),
                              COMBINE_THREADS, 0, stream, a);
        KRK_CHECK_LAUNCH();
    }
    return KR_OK;
}

template enum kr_status launch_decode<CacheBf16>(const Args &a, cudaStream_t stream);
template enum kr_status launch_decode<CacheE4m3>(const Args &a, cudaStream_t stream);

} // namespace attn
} // namespace krk
