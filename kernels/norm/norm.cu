// Row normalisations: RMSNorm (with fused residual add), LayerNorm and the gated grouped RMSNorm of
// Mamba-2. One block per row (per group for the gated norm); each thread walks the row in strides
// of the block, in vectors of 4 floats where alignment allows. Rows of up to 4 units per thread
// stay in registers (rmsnorm_reg_kernel); longer ones are read twice (three times for LayerNorm):
// the second pass hits L1/L2, and nothing has to be held in registers, so any dim works.
#include "common/util.cuh"
#include "norm/act.cuh"
#include "norm/vec.cuh"

namespace krk {
namespace {

// x += res (when RES), out = x / sqrt(mean(x^2) + eps) * w. Pass 2 reads back what the same thread
// wrote in pass 1, so no barrier is needed between the residual write and the re-read.
template <int V, bool RES>
__global__ void rmsnorm_kernel(float *x, int64_t ldx, const float *KRK_RESTRICT res, const float *KRK_RESTRICT w,
                               int64_t dim, float eps, float *out, uint16_t *out_bf16)
{
    krk::kernel_prologue();
    __shared__ float sh[32];
    const int64_t row = blockIdx.x;
    float *xr = x + row * ldx;
    const int64_t nv = dim / V;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[V];
        load_f<V>(xr + i * V, v);
        if constexpr (RES) {
            float r[V];
            load_f<V>(res + row * dim + i * V, r);
#pragma unroll
            for (int k = 0; k < V; k++) {
                v[k] += r[k];
            }
            store_f<V>(xr + i * V, v);
        }
#pragma unroll
        for (int k = 0; k < V; k++) {
            ss += v[k] * v[k];
        }
    }
    ss = block_sum(ss, sh);
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[V], g[V];
        load_f<V>(xr + i * V, v);
        load_f<V>(w + i * V, g);
#pragma unroll
        for (int k = 0; k < V; k++) {
            v[k] = v[k] * r * g[k];
        }
        if (out) {
            store_f<V>(out + row * dim + i * V, v);
        }
        if (out_bf16) {
            store_bf16<V>(out_bf16 + row * dim + i * V, v);
        }
    }
}

// Register-resident variants for rows of at most 4 vector units per thread (dim up to 16384 with
// V = 4): every load of the row is issued at once, the weights before the wait for the previous
// kernel (no kernel writes them), and the second pass works on the registers. A decode step runs
// ~50 of these norms on single rows, where the two-pass kernels' chains of dependent loads (unit by
// unit, then again for the second pass) were most of their time. Each thread takes the same units
// in the same order as in the two-pass kernels (i = tid + j * blockDim.x), so the results are
// bit-identical to theirs.
// Units i = tid + j * blockDim.x (those below nv) of src into v[j].
template <int V, int NPT> __device__ __forceinline__ void load_units(const float *src, int64_t nv, float (&v)[NPT][V])
{
#pragma unroll
    for (int j = 0; j < NPT; j++) {
        const int64_t i = threadIdx.x + (int64_t)j * blockDim.x;
        if (i < nv) {
            load_f<V>(src + i * V, v[j]);
        }
    }
}

// The second half of a register-resident norm over n values: the sum of squares of the units (in
// unit order), then v * r * g stored to out and out_bf16 (either may be NULL).
template <int V, int NPT>
__device__ __forceinline__ void reg_norm_store(float (&v)[NPT][V], const float (&g)[NPT][V], int64_t nv, int64_t n,
                                               float eps, float *sh, float *out, uint16_t *out_bf16)
{
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NPT; j++) {
        if (threadIdx.x + (int64_t)j * blockDim.x < nv) {
#pragma unroll
            for (int k = 0; k < V; k++) {
                ss += v[j][k] * v[j][k];
            }
        }
    }
    ss = block_sum(ss, sh);
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma unroll
    for (int j = 0; j < NPT; j++) {
        const int64_t i = threadIdx.x + (int64_t)j * blockDim.x;
        if (i < nv) {
#pragma unroll
            for (int k = 0; k < V; k++) {
                v[j][k] = v[j][k] * r * g[j][k];
            }
            if (out) {
                store_f<V>(out + i * V, v[j]);
            }
            if (out_bf16) {
                store_bf16<V>(out_bf16 + i * V, v[j]);
            }
        }
    }
}

template <int V, int NPT, bool RES>
__global__ void __launch_bounds__(1024)
    rmsnorm_reg_kernel(float *x, int64_t ldx, const float *KRK_RESTRICT res, const float *KRK_RESTRICT w, int64_t dim,
                       float eps, float *out, uint16_t *out_bf16)
{
    __shared__ float sh[32];
    const int64_t row = blockIdx.x;
    const int64_t nv = dim / V;
    float g[NPT][V];
    load_units<V, NPT>(w, nv, g);
    pdl_trigger();
    pdl_wait();
    float *xr = x + row * ldx;
    float v[NPT][V];
    load_units<V, NPT>(xr, nv, v);
    if constexpr (RES) { // x += res, written back: the residual stream
        float rs[NPT][V];
        load_units<V, NPT>(res + row * dim, nv, rs);
#pragma unroll
        for (int j = 0; j < NPT; j++) {
            const int64_t i = threadIdx.x + (int64_t)j * blockDim.x;
            if (i < nv) {
#pragma unroll
                for (int k = 0; k < V; k++) {
                    v[j][k] += rs[j][k];
                }
                store_f<V>(xr + i * V, v[j]);
            }
        }
    }
    reg_norm_store<V, NPT>(v, g, nv, dim, eps, sh, out ? out + row * dim : nullptr,
                           out_bf16 ? out_bf16 + row * dim : nullptr);
}

// out = (x - mean) / sqrt(var + eps) * w + b, mean and (biased) variance in two passes as the CPU
// reference computes them.
template <int V>
__global__ void layernorm_kernel(const float *x, int64_t ldx, const float *KRK_RESTRICT w, const float *KRK_RESTRICT b,
                                 int64_t dim, float eps, float *out)
{
    krk::kernel_prologue();
    __shared__ float sh[32];
    const int64_t row = blockIdx.x;
    const float *xr = x + row * ldx;
    const int64_t nv = dim / V;
    float s = 0.0f;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[V];
        load_f<V>(xr + i * V, v);
#pragma unroll
        for (int k = 0; k < V; k++) {
            s += v[k];
        }
    }
    const float mean = block_sum(s, sh) / (float)dim;
    float q = 0.0f;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[V];
        load_f<V>(xr + i * V, v);
#pragma unroll
        for (int k = 0; k < V; k++) {
            q += (v[k] - mean) * (v[k] - mean);
        }
    }
    // block_sum starts with a barrier, so every thread has read x before any output (which may
    // alias x) is written below.
    const float r = 1.0f / sqrtf(block_sum(q, sh) / (float)dim + eps);
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[V], g[V], bb[V];
        load_f<V>(xr + i * V, v);
        load_f<V>(w + i * V, g);
        if (b) {
            load_f<V>(b + i * V, bb);
        } else {
#pragma unroll
            for (int k = 0; k < V; k++) {
                bb[k] = 0.0f;
            }
        }
#pragma unroll
        for (int k = 0; k < V; k++) {
            v[k] = (v[k] - mean) * r * g[k] + bb[k];
        }
        store_f<V>(out + row * dim + i * V, v);
    }
}

// One block per (row, group): g = y * silu(z), out = g / sqrt(mean(g^2) + eps) * w over the group.
// Pass 2 recomputes g (bit-identical) instead of keeping it.
template <int V>
__global__ void gated_rmsnorm_kernel(const float *KRK_RESTRICT y, const float *KRK_RESTRICT z, int64_t ldz,
                                     const float *KRK_RESTRICT w, int64_t dim, int64_t group, int64_t n_group,
                                     float eps, float *out, uint16_t *out_bf16)
{
    krk::kernel_prologue();
    __shared__ float sh[32];
    const int64_t row = blockIdx.x / n_group, g0 = (blockIdx.x % n_group) * group;
    const float *yr = y + row * dim + g0, *zr = z + row * ldz + g0;
    const int64_t nv = group / V;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
        float a[V], c[V];
        load_f<V>(yr + i * V, a);
        load_f<V>(zr + i * V, c);
#pragma unroll
        for (int k = 0; k < V; k++) {
            const float v = a[k] * silu(c[k]);
            ss += v * v;
        }
    }
    ss = block_sum(ss, sh);
    const float r = 1.0f / sqrtf(ss / (float)group + eps);
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
        float a[V], c[V], g[V];
        load_f<V>(yr + i * V, a);
        load_f<V>(zr + i * V, c);
        load_f<V>(w + g0 + i * V, g);
#pragma unroll
        for (int k = 0; k < V; k++) {
            a[k] = a[k] * silu(c[k]) * r * g[k];
        }
        if (out) {
            store_f<V>(out + row * dim + g0 + i * V, a);
        }
        if (out_bf16) {
            store_bf16<V>(out_bf16 + row * dim + g0 + i * V, a);
        }
    }
}

// The gated norm's register-resident variant (see rmsnorm_reg_kernel).
template <int V, int NPT>
__global__ void __launch_bounds__(1024)
    gated_rmsnorm_reg_kernel(const float *KRK_RESTRICT y, const float *KRK_RESTRICT z, int64_t ldz,
                             const float *KRK_RESTRICT w, int64_t dim, int64_t group, int64_t n_group, float eps,
                             float *out, uint16_t *out_bf16)
{
    __shared__ float sh[32];
    const int64_t row = blockIdx.x / n_group, g0 = (blockIdx.x % n_group) * group;
    const int64_t nv = group / V;
    float g[NPT][V];
    load_units<V, NPT>(w + g0, nv, g);
    pdl_trigger();
    pdl_wait();
    float a[NPT][V], c[NPT][V]; // a = y * silu(z), which the two-pass kernel recomputes (same value)
    load_units<V, NPT>(y + row * dim + g0, nv, a);
    load_units<V, NPT>(z + row * ldz + g0, nv, c);
#pragma unroll
    for (int j = 0; j < NPT; j++) {
        if (threadIdx.x + (int64_t)j * blockDim.x < nv) {
#pragma unroll
            for (int k = 0; k < V; k++) {
                a[j][k] = a[j][k] * silu(c[j][k]);
            }
        }
    }
    reg_norm_store<V, NPT>(a, g, nv, group, eps, sh, out ? out + row * dim + g0 : nullptr,
                           out_bf16 ? out_bf16 + row * dim + g0 : nullptr);
}

// Units per thread of a row of `units` walked by row_threads(units) threads.
inline int units_per_thread(int64_t units)
{
    const int t = row_threads(units);
    return (int)((units + t - 1) / t);
}

// Rows of up to 4 units per thread take a register-resident kernel (3 units run as 4), longer
// ones the two-pass kernel; the kernels of each norm share one parameter list.
template <typename K> K pick_by_units(int64_t units, K one, K two, K four, K two_pass)
{
    switch (units_per_thread(units)) {
    case 1:
        return one;
    case 2:
        return two;
    case 3:
    case 4:
        return four;
    default:
        return two_pass;
    }
}

template <int V, bool RES>
void launch_rmsnorm(const struct krk_rmsnorm_params *p, cudaStream_t stream)
{
    const int64_t nv = p->dim / V;
    const auto kernel = pick_by_units(nv, rmsnorm_reg_kernel<V, 1, RES>, rmsnorm_reg_kernel<V, 2, RES>,
                                      rmsnorm_reg_kernel<V, 4, RES>, rmsnorm_kernel<V, RES>);
    launch_maybe_pdl(pdl_enabled(), kernel, dim3((unsigned)p->n), row_threads(nv), 0, stream, p->x, p->ldx, p->res,
                     p->w, p->dim, p->eps, p->out, p->out_bf16);
}

template <int V> void launch_gated(const struct krk_gated_rmsnorm_params *p, int64_t n_group, cudaStream_t stream)
{
    const int64_t nv = p->group / V;
    const auto kernel = pick_by_units(nv, gated_rmsnorm_reg_kernel<V, 1>, gated_rmsnorm_reg_kernel<V, 2>,
                                      gated_rmsnorm_reg_kernel<V, 4>, gated_rmsnorm_kernel<V>);
    launch_maybe_pdl(pdl_enabled(), kernel, dim3((unsigned)(p->n * n_group)), row_threads(nv), 0, stream, p->y,
                     p->z, p->ldz, p->w, p->dim, p->group, n_group, p->eps, p->out, p->out_bf16);
}

} // namespace
} // namespace krk

using namespace krk;

extern "C" enum kr_status krk_rmsnorm(const struct krk_rmsnorm_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p);
    KRK_REQUIRE(p->n >= 0 && p->n <= INT32_MAX && p->dim >= 1 && p->ldx >= p->dim);
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->x && p->w && (p->out || p->out_bf16));
    // out may alias x only in place, row for row, and never with a residual (x must receive x + res)
    KRK_REQUIRE(p->out != p->x || (!p->res && p->ldx == p->dim));
    KRK_REQUIRE(!p->res || (const float *)p->res != p->out);
    const bool v4 = p->dim % 4 == 0 && p->ldx % 4 == 0 && is_aligned(p->x, 16) && is_aligned(p->w, 16) &&
                    (!p->res || is_aligned(p->res, 16)) && (!p->out || is_aligned(p->out, 16)) &&
                    (!p->out_bf16 || is_aligned(p->out_bf16, 8));
    if (v4) {
        p->res ? launch_rmsnorm<4, true>(p, stream) : launch_rmsnorm<4, false>(p, stream);
    } else {
        p->res ? launch_rmsnorm<1, true>(p, stream) : launch_rmsnorm<1, false>(p, stream);
    }
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

extern "C" enum kr_status krk_layernorm(const struct krk_layernorm_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p);
    KRK_REQUIRE(p->n >= 0 && p->n <= INT32_MAX && p->dim >= 1 && p->ldx >= p->dim);
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->x && p->w && p->out);
    // out may alias x only as the same rows (in place with ldx == dim)
    KRK_REQUIRE((const float *)p->out != p->x || p->ldx == p->dim);
    const bool v4 = p->dim % 4 == 0 && p->ldx % 4 == 0 && is_aligned(p->x, 16) && is_aligned(p->w, 16) &&
                    (!p->b || is_aligned(p->b, 16)) && is_aligned(p->out, 16);
    const dim3 grid((unsigned)p->n);
    if (v4) {
        krk::launch_maybe_pdl(krk::pdl_enabled(), layernorm_kernel<4>, grid, row_threads(p->dim / 4), 0, stream, p->x,
                              p->ldx, p->w, p->b, p->dim, p->eps, p->out);
    } else {
        krk::launch_maybe_pdl(krk::pdl_enabled(), layernorm_kernel<1>, grid, row_threads(p->dim), 0, stream, p->x,
                              p->ldx, p->w, p->b, p->dim, p->eps, p->out);
    }
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

extern "C" enum kr_status krk_gated_rmsnorm(const struct krk_gated_rmsnorm_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p);
    KRK_REQUIRE(p->n >= 0 && p->dim >= 1 && p->group >= 1 && p->dim % p->group == 0 && p->ldz >= p->dim);
    const int64_t n_group = p->dim / p->group;
    KRK_REQUIRE(p->n * n_group <= INT32_MAX);
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->y && p->z && p->w && (p->out || p->out_bf16));
    const bool v4 = p->group % 4 == 0 && p->ldz % 4 == 0 && is_aligned(p->y, 16) && is_aligned(p->z, 16) &&
                    is_aligned(p->w, 16) && (!p->out || is_aligned(p->out, 16)) &&
                    (!p->out_bf16 || is_aligned(p->out_bf16, 8));
    if (v4) {
        launch_gated<4>(p, n_group, stream);
    } else {
        launch_gated<1>(p, n_group, stream);
    }
    KRK_CHECK_LAUNCH();
    return KR_OK;
}
