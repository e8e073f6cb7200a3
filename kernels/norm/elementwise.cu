// Elementwise kernels: add, scale, embedding lookup, activations, row gather, bf16 casts and the
// dtype conversions of weight upload. All are bound by memory traffic; each thread handles vectors
// of 4 floats (8 bf16 for the embedding) when every pointer and stride allows it, else scalars.
// Grids are sized from host values only and capped, with grid-stride loops beyond the cap.
#include "common/util.cuh"
#include "norm/act.cuh"
#include "norm/vec.cuh"

namespace krk {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // grid-stride loops beyond this
constexpr int64_t kMaxRowBlocks = 65535; // gridDim.y limit

unsigned blocks_for(int64_t units)
{
    int64_t b = (units + kThreads - 1) / kThreads;
    return (unsigned)(b < 1 ? 1 : b > kMaxBlocks ? kMaxBlocks : b);
}

// Grid of a row kernel: x over the units of a row, y over rows.
dim3 row_grid(int64_t n, int64_t units)
{
    return dim3(blocks_for(units), (unsigned)(n < kMaxRowBlocks ? n : kMaxRowBlocks));
}

// Bit-exact copies of util/dtype.h's conversions.
__device__ __forceinline__ uint16_t f32_to_bf16_exact(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((u >> 16) | 0x40);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__device__ __forceinline__ float f16_to_f32_exact(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { // subnormal: normalize
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    return __uint_as_float(u);
}

template <int V> __global__ void add_kernel(float *KRK_RESTRICT y, const float *KRK_RESTRICT x, int64_t n)
{
    krk::kernel_prologue();
    const int64_t nv = n / V;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nv; i += (int64_t)gridDim.x * blockDim.x) {
        float a[V], b[V];
        load_f<V>(y + i * V, a);
        load_f<V>(x + i * V, b);
#pragma unroll
        for (int k = 0; k < V; k++) {
            a[k] += b[k];
        }
        store_f<V>(y + i * V, a);
    }
    if (V > 1 && blockIdx.x == 0 && threadIdx.x < n % V) { // scalar tail
        const int64_t i = nv * V + threadIdx.x;
        y[i] += x[i];
    }
}

template <int V> __global__ void scale_kernel(float *KRK_RESTRICT y, float s, int64_t n)
{
    krk::kernel_prologue();
    const int64_t nv = n / V;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nv; i += (int64_t)gridDim.x * blockDim.x) {
        float a[V];
        load_f<V>(y + i * V, a);
#pragma unroll
        for (int k = 0; k < V; k++) {
            a[k] *= s;
        }
        store_f<V>(y + i * V, a);
    }
    if (V > 1 && blockIdx.x == 0 && threadIdx.x < n % V) {
        y[nv * V + threadIdx.x] *= s;
    }
}

// V = 8: one 16-byte load of 8 bf16, two 16-byte stores.
template <int V>
__global__ void embed_kernel(const uint16_t *KRK_RESTRICT w, const int32_t *KRK_RESTRICT tokens, int64_t n, int64_t dim,
                             int64_t row0, int64_t rows, float *KRK_RESTRICT out)
{
    krk::kernel_prologue();
    const int64_t nv = dim / V;
    for (int64_t t = blockIdx.y; t < n; t += gridDim.y) {
        const int64_t id = (int64_t)tokens[t] - row0;
        const bool mine = id >= 0 && id < rows; /* another rank's vocabulary row: zeros */
        const uint16_t *row = w + (mine ? id : 0) * dim;
        float *o = out + t * dim;
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nv; i += (int64_t)gridDim.x * blockDim.x) {
            if (!mine) {
                for (int k = 0; k < V; k++) {
                    o[i * V + k] = 0.0f;
                }
            } else if constexpr (V == 8) {
                const uint4 q = *reinterpret_cast<const uint4 *>(row + i * 8);
                const float4 lo = make_float4(__uint_as_float(q.x << 16), __uint_as_float(q.x & 0xffff0000u),
                                              __uint_as_float(q.y << 16), __uint_as_float(q.y & 0xffff0000u));
                const float4 hi = make_float4(__uint_as_float(q.z << 16), __uint_as_float(q.z & 0xffff0000u),
                                              __uint_as_float(q.w << 16), __uint_as_float(q.w & 0xffff0000u));
                reinterpret_cast<float4 *>(o + i * 8)[0] = lo;
                reinterpret_cast<float4 *>(o + i * 8)[1] = hi;
            } else {
                o[i] = bf16_to_f32(row[i]);
            }
        }
    }
}

template <int V, bool GATED>
__global__ void act_kernel(int act, const float *KRK_RESTRICT gate, const float *KRK_RESTRICT x, int64_t ld_in,
                           int64_t n, int64_t width, float *out, uint16_t *out_bf16)
{
    krk::kernel_prologue();
    const int64_t nv = width / V;
    for (int64_t t = blockIdx.y; t < n; t += gridDim.y) {
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nv; i += (int64_t)gridDim.x * blockDim.x) {
            float v[V];
            load_f<V>(x + t * ld_in + i * V, v);
            if constexpr (GATED) {
                float g[V];
                load_f<V>(gate + t * ld_in + i * V, g);
#pragma unroll
                for (int k = 0; k < V; k++) {
                    v[k] = act_apply(act, g[k]) * v[k];
                }
            } else {
#pragma unroll
                for (int k = 0; k < V; k++) {
                    v[k] = act_apply(act, v[k]);
                }
            }
            if (out) {
                store_f<V>(out + t * width + i * V, v);
            }
            if (out_bf16) {
                store_bf16<V>(out_bf16 + t * width + i * V, v);
            }
        }
    }
}

template <int V>
__global__ void gather_rows_kernel(const float *KRK_RESTRICT src, int64_t width, const int32_t *KRK_RESTRICT rows,
                                   int64_t n, float *KRK_RESTRICT dst)
{
    krk::kernel_prologue();
    const int64_t nv = width / V;
    for (int64_t t = blockIdx.y; t < n; t += gridDim.y) {
        const float *s = src + (int64_t)rows[t] * width;
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nv; i += (int64_t)gridDim.x * blockDim.x) {
            float v[V];
            load_f<V>(s + i * V, v);
            store_f<V>(dst + t * width + i * V, v);
        }
    }
}

template <int V>
__global__ void cast_bf16_kernel(const float *KRK_RESTRICT x, int64_t ldx, int64_t n, int64_t cols,
                                 uint16_t *KRK_RESTRICT out)
{
    krk::kernel_prologue();
    const int64_t nv = cols / V;
    for (int64_t t = blockIdx.y; t < n; t += gridDim.y) {
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nv; i += (int64_t)gridDim.x * blockDim.x) {
            float v[V];
            load_f<V>(x + t * ldx + i * V, v);
            store_bf16<V>(out + t * cols + i * V, v);
        }
    }
}

// Element i of a source of dtype SRC (0 f32, 1 f16, 2 bf16) as fp32. Sources need not be aligned
// to their element size (safetensors does not promise it): ALIGNED = false reads bytes.
template <int SRC, bool ALIGNED> __device__ __forceinline__ float load_src(const void *src, int64_t i)
{
    constexpr int esz = SRC == 0 ? 4 : 2;
    uint32_t u = 0;
    if constexpr (ALIGNED) {
        if constexpr (esz == 4) {
            u = static_cast<const uint32_t *>(src)[i];
        } else {
            u = static_cast<const uint16_t *>(src)[i];
        }
    } else {
        const uint8_t *b = static_cast<const uint8_t *>(src) + i * esz;
#pragma unroll
        for (int k = 0; k < esz; k++) {
            u |= (uint32_t)b[k] << (8 * k); // little-endian, as the host
        }
    }
    if constexpr (SRC == 0) {
        return __uint_as_float(u);
    } else if constexpr (SRC == 1) {
        return f16_to_f32_exact((uint16_t)u);
    } else {
        return __uint_as_float(u << 16);
    }
}

template <int SRC, bool ALIGNED, bool TO_BF16>
__global__ void convert_kernel(const void *KRK_RESTRICT src, int64_t n, void *KRK_RESTRICT dst)
{
    krk::kernel_prologue();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        // through fp32 as util/dtype.h does: bf16 -> bf16 keeps every value and quiets NaNs
        const float f = load_src<SRC, ALIGNED>(src, i);
        if constexpr (TO_BF16) {
            static_cast<uint16_t *>(dst)[i] = f32_to_bf16_exact(f);
        } else {
            static_cast<float *>(dst)[i] = f;
        }
    }
}

template <bool TO_BF16>
enum kr_status convert(const void *src, int src_dtype, int64_t n, void *dst, cudaStream_t stream)
{
    KRK_REQUIRE(n >= 0 && src_dtype >= 0 && src_dtype <= 2);
    if (n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(src && dst && is_aligned(dst, TO_BF16 ? 2 : 4));
    const bool al = is_aligned(src, src_dtype == 0 ? 4 : 2);
    const unsigned blocks = blocks_for(n);
    switch (src_dtype * 2 + (al ? 1 : 0)) {
    case 0:
        krk::launch_maybe_pdl(krk::pdl_enabled(), convert_kernel<0, false, TO_BF16>, blocks, kThreads, 0, stream, src,
                              n, dst);
        break;
    case 1:
        krk::launch_maybe_pdl(krk::pdl_enabled(), convert_kernel<0, true, TO_BF16>, blocks, kThreads, 0, stream, src, n,
                              dst);
        break;
    case 2:
        krk::launch_maybe_pdl(krk::pdl_enabled(), convert_kernel<1, false, TO_BF16>, blocks, kThreads, 0, stream, src,
                              n, dst);
        break;
    case 3:
        krk::launch_maybe_pdl(krk::pdl_enabled(), convert_kernel<1, true, TO_BF16>, blocks, kThreads, 0, stream, src, n,
                              dst);
        break;
    case 4:
        krk::launch_maybe_pdl(krk::pdl_enabled(), convert_kernel<2, false, TO_BF16>, blocks, kThreads, 0, stream, src,
                              n, dst);
        break;
    default:
        krk::launch_maybe_pdl(krk::pdl_enabled(), convert_kernel<2, true, TO_BF16>, blocks, kThreads, 0, stream, src, n,
                              dst);
        break;
    }
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

} // namespace
} // namespace krk

using namespace krk;

extern "C" enum kr_status krk_add(float *y, const float *x, int64_t n, cudaStream_t stream)
{
    KRK_REQUIRE(n >= 0);
    if (n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(y && x);
    if (is_aligned(y, 16) && is_aligned(x, 16)) {
        krk::launch_maybe_pdl(krk::pdl_enabled(), add_kernel<4>, blocks_for(n / 4), kThreads, 0, stream, y, x, n);
    } else {
        krk::launch_maybe_pdl(krk::pdl_enabled(), add_kernel<1>, blocks_for(n), kThreads, 0, stream, y, x, n);
    }
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

extern "C" enum kr_status krk_scale(float *y, float s, int64_t n, cudaStream_t stream)
{
    KRK_REQUIRE(n >= 0);
    if (n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(y);
    if (is_aligned(y, 16)) {
        krk::launch_maybe_pdl(krk::pdl_enabled(), scale_kernel<4>, blocks_for(n / 4), kThreads, 0, stream, y, s, n);
    } else {
        krk::launch_maybe_pdl(krk::pdl_enabled(), scale_kernel<1>, blocks_for(n), kThreads, 0, stream, y, s, n);
    }
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

extern "C" enum kr_status krk_embed(const krk_bf16 *w, const int32_t *tokens, int64_t n, int64_t dim, int64_t row0,
                                    int64_t rows, float *out, cudaStream_t stream)
{
    KRK_REQUIRE(n >= 0 && dim >= 1 && row0 >= 0 && rows >= 1);
    if (n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(w && tokens && out);
    if (dim % 8 == 0 && is_aligned(w, 16) && is_aligned(out, 16)) {
        krk::launch_maybe_pdl(krk::pdl_enabled(), embed_kernel<8>, row_grid(n, dim / 8), kThreads, 0, stream, w, tokens,
                              n, dim, row0, rows, out);
    } else {
        krk::launch_maybe_pdl(krk::pdl_enabled(), embed_kernel<1>, row_grid(n, dim), kThreads, 0, stream, w, tokens, n,
                              dim, row0, rows, out);
    }
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

extern "C" enum kr_status krk_act(const struct krk_act_params *p, cudaStream_t stream)
{
    KRK_REQUIRE(p);
    KRK_REQUIRE(act_valid(p->act) && p->n >= 0 && p->width >= 1 && p->ld_in >= p->width);
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->x && (p->out || p->out_bf16));
    const bool v4 = p->width % 4 == 0 && p->ld_in % 4 == 0 && is_aligned(p->x, 16) &&
                    (!p->gate || is_aligned(p->gate, 16)) && (!p->out || is_aligned(p->out, 16)) &&
                    (!p->out_bf16 || is_aligned(p->out_bf16, 8));
    const int a = (int)p->act;
    if (v4) {
        const dim3 grid = row_grid(p->n, p->width / 4);
        if (p->gate) {
            krk::launch_maybe_pdl(krk::pdl_enabled(), act_kernel<4, true>, grid, kThreads, 0, stream, a, p->gate, p->x,
                                  p->ld_in, p->n, p->width, p->out, p->out_bf16);
        } else {
            krk::launch_maybe_pdl(krk::pdl_enabled(), act_kernel<4, false>, grid, kThreads, 0, stream, a, p->gate, p->x,
                                  p->ld_in, p->n, p->width, p->out, p->out_bf16);
        }
    } else {
        const dim3 grid = row_grid(p->n, p->width);
        if (p->gate) {
            krk::launch_maybe_pdl(krk::pdl_enabled(), act_kernel<1, true>, grid, kThreads, 0, stream, a, p->gate, p->x,
                                  p->ld_in, p->n, p->width, p->out, p->out_bf16);
        } else {
            krk::launch_maybe_pdl(krk::pdl_enabled(), act_kernel<1, false>, grid, kThreads, 0, stream, a, p->gate, p->x,
                                  p->ld_in, p->n, p->width, p->out, p->out_bf16);
        }
    }
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

extern "C" enum kr_status krk_gather_rows(const float *src, int64_t width, const int32_t *rows, int64_t n, float *dst,
                                          cudaStream_t stream)
{
    KRK_REQUIRE(n >= 0 && width >= 1);
    if (n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(src && rows && dst);
    if (width % 4 == 0 && is_aligned(src, 16) && is_aligned(dst, 16)) {
        krk::launch_maybe_pdl(krk::pdl_enabled(), gather_rows_kernel<4>, row_grid(n, width / 4), kThreads, 0, stream,
                              src, width, rows, n, dst);
    } else {
        krk::launch_maybe_pdl(krk::pdl_enabled(), gather_rows_kernel<1>, row_grid(n, width), kThreads, 0, stream, src,
                              width, rows, n, dst);
    }
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

extern "C" enum kr_status krk_cast_bf16(const float *x, int64_t ldx, int64_t n, int64_t cols, krk_bf16 *out,
                                        cudaStream_t stream)
{
    KRK_REQUIRE(n >= 0 && cols >= 1 && ldx >= cols);
    if (n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(x && out);
    if (cols % 4 == 0 && ldx % 4 == 0 && is_aligned(x, 16) && is_aligned(out, 8)) {
        krk::launch_maybe_pdl(krk::pdl_enabled(), cast_bf16_kernel<4>, row_grid(n, cols / 4), kThreads, 0, stream, x,
                              ldx, n, cols, out);
    } else {
        krk::launch_maybe_pdl(krk::pdl_enabled(), cast_bf16_kernel<1>, row_grid(n, cols), kThreads, 0, stream, x, ldx,
                              n, cols, out);
    }
    KRK_CHECK_LAUNCH();
    return KR_OK;
}

extern "C" enum kr_status krk_convert_bf16(const void *src, int src_dtype, int64_t n, krk_bf16 *dst,
                                           cudaStream_t stream)
{
    return convert<true>(src, src_dtype, n, dst, stream);
}

extern "C" enum kr_status krk_convert_f32(const void *src, int src_dtype, int64_t n, float *dst, cudaStream_t stream)
{
    return convert<false>(src, src_dtype, n, dst, stream);
}
