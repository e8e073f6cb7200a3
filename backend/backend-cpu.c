/* The CPU reference backend: plain fp32 loops, multi-threaded with OpenMP. It defines what every
 * op of backend-impl.h means; the CUDA backend is tested against it. Each output element is
 * computed by one thread in a fixed order, so results do not depend on the number of threads or
 * on which other sequences share the batch. */
#include "backend-impl.h"

#include "alloc.h"
#include "comm.h"
#include "fp8.h"
#include "log.h"
#include "sampler.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

struct cpu_ctx {
    int n_threads;
    const struct kr_batch *batch; /* borrowed for the current step */
    struct kr_host_comm *comm;    /* borrowed: the tensor-parallel group, NULL alone */
    int rank;
};

static struct cpu_ctx *ctx_of(kr_backend_t be)
{
    return be->ctx;
}

/* ---- memory ------------------------------------------------------------------------------- */

static const char *cpu_name(kr_backend_t be)
{
    return "cpu";
}

static void cpu_free(kr_backend_t be)
{
    kr_free(be->ctx);
    kr_free(be);
}

static size_t cpu_act_size(kr_backend_t be)
{
    return sizeof(float);
}

static enum kr_status cpu_buf_alloc(kr_backend_t be, size_t size, struct kr_buf *out)
{
    out->ptr = kr_calloc(1, size ? size : 1);
    out->size = size;
    return out->ptr ? KR_OK : KR_ERR_NOMEM;
}

static void cpu_buf_free(kr_backend_t be, struct kr_buf *buf)
{
    kr_free(buf->ptr);
    buf->ptr = NULL;
    buf->size = 0;
}

static enum kr_status cpu_upload(kr_backend_t be, const struct kr_tensor *host, bool to_f32, bool src_persistent,
                                 struct kr_tensor *out, struct kr_buf *owned)
{
    memset(owned, 0, sizeof *owned);
    *out = *host;
    size_t n = (size_t)(host->rows * host->cols);
    const size_t esz = kr_dtype_size(host->dtype);
    const bool aligned = (uintptr_t)host->data % esz == 0;
    if (!to_f32 || host->dtype == KR_DTYPE_F32) {
        if (aligned && src_persistent) {
            return KR_OK; /* alias the (mmapped) host memory */
        }
        /* a transient source, or unaligned data (safetensors does not promise alignment): copy */
        enum kr_status st = cpu_buf_alloc(be, n * esz, owned);
        if (st == KR_OK) {
            memcpy(owned->ptr, host->data, n * esz);
            out->data = owned->ptr;
        }
        return st;
    }
    enum kr_status st = cpu_buf_alloc(be, n * sizeof(float), owned);
    if (st != KR_OK) {
        return st;
    }
    kr_convert_to_f32(owned->ptr, host->data, host->dtype, n);
    out->data = owned->ptr;
    out->dtype = KR_DTYPE_F32;
    return KR_OK;
}

static enum kr_status cpu_copy(kr_backend_t be, void *dst, const void *src, size_t n)
{
    if (n) {
        memmove(dst, src, n);
    }
    return KR_OK;
}

static enum kr_status cpu_begin_batch(kr_backend_t be, const struct kr_batch *b)
{
    ctx_of(be)->batch = b;
    return KR_OK;
}

/* ---- elementwise ---------------------------------------------------------------------------- */

static float act_apply(enum kr_act act, float x)
{
    switch (act) {
    case KR_ACT_RELU2: {
        float r = x > 0.0f ? x : 0.0f;
        return r * r;
    }
    case KR_ACT_SILU:
        return x / (1.0f + expf(-x));
    case KR_ACT_GELU:
        return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case KR_ACT_RELU:
        return x > 0.0f ? x : 0.0f;
    }
    return x;
}

static float silu(float x)
{
    return x / (1.0f + expf(-x));
}

/* softplus as the Mamba kernels compute it: identity above 20. */
static float softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

/* The 8 partial sums map onto one AVX2 register (or two SSE ones): every lane does the same
 * operations in the same order either way, so the result does not depend on the clone that runs
 * (ISO C mode keeps floating-point contraction off: no FMA rounding differences). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx2", "default")))
#endif
static float dot(const float *a, const float *b, int64_t n)
{
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int j = 0; j < 8; j++) {
            s[j] += a[i + j] * b[i + j];
        }
    }
    float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; i++) {
        r += a[i] * b[i];
    }
    return r;
}

static enum kr_status cpu_embed(kr_backend_t be, const struct kr_tensor *w, int64_t row0, float *out)
{
    const struct kr_batch *b = ctx_of(be)->batch;
    size_t esz = kr_dtype_size(w->dtype);
    for (int32_t t = 0; t < b->n_tok; t++) {
        const int64_t id = (int64_t)b->tokens[t] - row0;
        float *o = out + (size_t)t * (size_t)w->cols;
        if (id < 0 || id >= w->rows) { /* another rank's row */
            memset(o, 0, (size_t)w->cols * sizeof(float));
            continue;
        }
        const char *row = (const char *)w->data + (size_t)id * (size_t)w->cols * esz;
        kr_convert_to_f32(o, row, w->dtype, (size_t)w->cols);
    }
    return KR_OK;
}

/* The bf16 copy of an op's output (the operand of the GEMM that reads it next; the CPU's GEMMs read
 * the fp32 rows, but the op writes what it is asked for). */
static void write_bf16(krk_bf16 *dst, const float *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        dst[i] = kr_f32_to_bf16(src[i]);
    }
}

/* x += res first when res (the residual stream), then out = rmsnorm(x) * w: exactly an add followed
 * by the norm. */
static enum kr_status cpu_rmsnorm(kr_backend_t be, const struct krk_rmsnorm_params *p)
{
    const int64_t n = p->n, dim = p->dim, ldx = p->ldx;
    const float *w = p->w;
    const float eps = p->eps;
    for (int64_t i = 0; i < n; i++) {
        float *xi = p->x + i * ldx;
        float *oi = p->out + i * dim;
        if (p->res) {
            for (int64_t j = 0; j < dim; j++) {
                xi[j] += p->res[i * dim + j];
            }
        }
        float ss = 0.0f;
        for (int64_t j = 0; j < dim; j++) {
            ss += xi[j] * xi[j];
        }
        float r = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t j = 0; j < dim; j++) {
            oi[j] = xi[j] * r * w[j];
        }
    }
    if (p->out_bf16) {
        write_bf16(p->out_bf16, p->out, n * dim);
    }
    return KR_OK;
}

static enum kr_status cpu_layernorm(kr_backend_t be, const struct krk_layernorm_params *p)
{
    const float *x = p->x, *w = p->w, *b = p->b;
    const int64_t n = p->n, dim = p->dim, ldx = p->ldx;
    const float eps = p->eps;
    float *out = p->out;
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * ldx;
        float *oi = out + i * dim;
        float mean = 0.0f, var = 0.0f;
        for (int64_t j = 0; j < dim; j++) {
            mean += xi[j];
        }
        mean /= (float)dim;
        for (int64_t j = 0; j < dim; j++) {
            var += (xi[j] - mean) * (xi[j] - mean);
        }
        const float r = 1.0f / sqrtf(var / (float)dim + eps);
        for (int64_t j = 0; j < dim; j++) {
            oi[j] = (xi[j] - mean) * r * w[j] + (b ? b[j] : 0.0f);
        }
    }
    return KR_OK;
}

static enum kr_status cpu_scale(kr_backend_t be, float *y, float s, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        y[i] *= s;
    }
    return KR_OK;
}

static enum kr_status cpu_add(kr_backend_t be, float *y, const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        y[i] += x[i];
    }
    return KR_OK;
}

static enum kr_status cpu_act(kr_backend_t be, const struct krk_act_params *p)
{
    const int64_t ld_in = p->ld_in, width = p->width;
    for (int64_t t = 0; t < p->n; t++) {
        for (int64_t j = 0; j < width; j++) {
            float v = p->x[t * ld_in + j];
            p->out[t * width + j] = p->gate ? act_apply(p->act, p->gate[t * ld_in + j]) * v : act_apply(p->act, v);
        }
    }
    if (p->out_bf16) {
        write_bf16(p->out_bf16, p->out, p->n * width);
    }
    return KR_OK;
}

/* ---- matmul ----------------------------------------------------------------------------- */

#define MM_ROWS 8 /* weight rows converted to fp32 at once and reused across all tokens */

/* Multiply-adds (roughly) below which an op runs on one thread. A parallel region costs a few
 * microseconds on idle cores, but when another thread holds one of them (the server's loop under a
 * connection flood, another process) every barrier waits for a time slice: the embedded model's
 * small per-layer ops turned a 2 ms request into 300 ms. Each output is computed by one thread
 * either way, so results do not depend on this. */
#define PAR_MIN_WORK ((int64_t)1 << 20)

/* y[t, r] = x[t, :] . w[r, :] (+ bias[r]); converts weight rows to fp32 on the fly so that bf16 and
 * f16 checkpoints are used in place. Parallel over blocks of weight rows. */
/* The FP8 recipe (model/fp8.h): each row of x quantized per block of the weight's block_c columns
 * (the last one may be shorter; power-of-two scales with w->act_ue8m0), then the reference product
 * with the weight's codes and scales. */
static enum kr_status matmul_fp8(const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w, const float *bias,
                                 float *y, int64_t ldy)
{
    const int64_t rows = w->rows, cols = w->cols, bc = w->block_c, br = w->block_r;
    if (!w->scale || bc < 1 || br < 1) {
        KR_LOG_ERROR("cpu: an FP8 weight [%lld, %lld] without its block scales", (long long)rows, (long long)cols);
        return KR_ERR_INVAL;
    }
    const int64_t nkb = (cols + bc - 1) / bc;
    uint8_t *aq = kr_malloc((size_t)(n * cols));
    float *as = kr_malloc((size_t)(n * nkb) * sizeof(float)), *c = kr_malloc((size_t)(n * rows) * sizeof(float));
    enum kr_status st = aq && as && c ? KR_OK : KR_ERR_NOMEM;
    for (int64_t t = 0; t < n && st == KR_OK; t++) {
        for (int64_t kb = 0; kb < nkb && st == KR_OK; kb++) {
            const int64_t len = cols - kb * bc < bc ? cols - kb * bc : bc;
            st = kr_fp8_act_quant(x + t * ldx + kb * bc, len, len, w->act_ue8m0, aq + t * cols + kb * bc,
                                  as + t * nkb + kb);
        }
    }
    if (st == KR_OK) {
        st = kr_fp8_gemm(aq, as, n, cols, w->data, w->scale, rows, bc, br, c);
    }
    for (int64_t t = 0; t < n && st == KR_OK; t++) {
        for (int64_t r = 0; r < rows; r++) {
            y[t * ldy + r] = bias ? c[t * rows + r] + bias[r] : c[t * rows + r];
        }
    }
    if (st == KR_ERR_INVAL) {
        KR_LOG_ERROR("cpu: an FP8 product's activations are not finite");
    }
    kr_free(aq);
    kr_free(as);
    kr_free(c);
    return st;
}

static enum kr_status matmul_impl(int n_threads, const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w,
                                  const float *bias, float *y, int64_t ldy)
{
    if (w->dtype == KR_DTYPE_F8_E4M3) {
        return matmul_fp8(x, ldx, n, w, bias, y, ldy);
    }
    const int64_t rows = w->rows, cols = w->cols;
    const int64_t n_blk = (rows + MM_ROWS - 1) / MM_ROWS;
    const size_t esz = kr_dtype_size(w->dtype);
    float *scratch = kr_malloc((size_t)n_threads * MM_ROWS * (size_t)cols * sizeof(float));
    if (!scratch) {
        return KR_ERR_NOMEM;
    }
#pragma omp parallel for num_threads(n_threads) schedule(dynamic, 1) if (rows * cols * n >= PAR_MIN_WORK)
    for (int64_t blk = 0; blk < n_blk; blk++) {
        float *wf = scratch + (size_t)omp_get_thread_num() * MM_ROWS * (size_t)cols;
        int64_t r0 = blk * MM_ROWS;
        int64_t nr = rows - r0 < MM_ROWS ? rows - r0 : MM_ROWS;
        const float *wrow = NULL;
        if (w->dtype == KR_DTYPE_F32) {
            wrow = (const float *)w->data + r0 * cols;
        } else {
            kr_convert_to_f32(wf, (const char *)w->data + (size_t)(r0 * cols) * esz, w->dtype, (size_t)(nr * cols));
            wrow = wf;
        }
        for (int64_t t = 0; t < n; t++) {
            const float *xt = x + t * ldx;
            float *yt = y + t * ldy;
            for (int64_t r = 0; r < nr; r++) {
                float v = dot(xt, wrow + r * cols, cols);
                yt[r0 + r] = bias ? v + bias[r0 + r] : v;
            }
        }
    }
    kr_free(scratch);
    return KR_OK;
}

/* The reference GEMM reads x in fp32: a bf16 operand (xb) is never read here. */
static enum kr_status cpu_matmul(kr_backend_t be, const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w,
                                 const float *bias, float *y, int64_t ldy, const struct krk_bf16_in *xb)
{
    (void)xb;
    if (n == 0) {
        return KR_OK;
    }
    return matmul_impl(ctx_of(be)->n_threads, x, ldx, n, w, bias, y, ldy);
}

/* ---- Mamba-2 ------------------------------------------------------------------------------ */

/* Causal depthwise conv + SiLU over each sequence, carrying the last K-1 inputs in the slot. */
static void mamba_conv(const struct kr_batch *b, const struct krk_mamba_params *p, int n_threads)
{
    const int64_t cd = p->d_inner + 2 * p->n_group * p->d_state; /* conv_dim */
    const int64_t K = p->d_conv, H = K - 1;
    float *states = p->conv_state;
#pragma omp parallel for num_threads(n_threads) schedule(static) collapse(2) if ((int64_t)b->n_tok * cd * K >= PAR_MIN_WORK)
    for (int32_t s = 0; s < b->n_seq; s++) {
        for (int64_t c = 0; c < cd; c++) {
            float *st = states + (size_t)b->seq_slot[s] * (size_t)(H * cd); /* [K-1, conv_dim] */
            const int32_t t0 = b->seq_tok0[s], nt = b->seq_tok0[s + 1] - t0;
            const bool fresh = b->seq_pos0[s] == 0;
            const float *w = p->conv_w + c * K;
            float win[64]; /* window of the last K inputs of this channel, oldest first */
            for (int64_t k = 0; k < H; k++) {
                win[k] = fresh ? 0.0f : st[k * cd + c];
            }
            for (int32_t i = 0; i < nt; i++) {
                win[H] = p->zxbcdt[(int64_t)(t0 + i) * p->ld_in + p->d_inner + c];
                float acc = p->conv_b ? p->conv_b[c] : 0.0f;
                for (int64_t k = 0; k < K; k++) {
                    acc += w[k] * win[k];
                }
                p->xbc[(int64_t)(t0 + i) * cd + c] = silu(acc);
                memmove(win, win + 1, (size_t)H * sizeof(float));
                const int32_t keep = b->tok_state_slot ? b->tok_state_slot[t0 + i] : -1;
                if (keep >= 0) { /* the state after this token, kept in its own slot */
                    float *ks = states + (size_t)keep * (size_t)(H * cd);
                    for (int64_t k = 0; k < H; k++) {
                        ks[k * cd + c] = win[k];
                    }
                }
            }
            for (int64_t k = 0; k < H; k++) {
                st[k * cd + c] = win[k];
            }
        }
    }
}

/* One head of one sequence: chunked SSD (several tokens) or the exact recurrence (one token).
 * dt, the state and all sums in fp32. `cum` is scratch of at least `chunk` floats. */
static void mamba_ssd_head(const struct krk_mamba_params *p, int64_t cd, int32_t t0, int32_t nt, int64_t h,
                           float *S /* [P, N] */, float *dtv /* [nt] */, float *cum /* [chunk] */)
{
    const int64_t P = p->head_dim, N = p->d_state;
    const int64_t g = h / (p->n_head / p->n_group);
    const float A = -expf(p->A_log[h]);
    const float Dh = p->D[h];
    for (int32_t i = 0; i < nt; i++) {
        float v = softplus(p->zxbcdt[(int64_t)(t0 + i) * p->ld_in + 2 * p->d_inner + 2 * p->n_group * N + h] +
                           p->dt_bias[h]);
        if (p->dt_min > 0.0f && v < p->dt_min) {
            v = p->dt_min;
        }
        if (isfinite(p->dt_max) && v > p->dt_max) {
            v = p->dt_max;
        }
        dtv[i] = v;
    }
#define XS(i) (p->xbc + (int64_t)(t0 + (i)) * cd + h * P)
#define BS(i) (p->xbc + (int64_t)(t0 + (i)) * cd + p->d_inner + g * N)
#define CS(i) (p->xbc + (int64_t)(t0 + (i)) * cd + p->d_inner + p->n_group * N + g * N)
#define YS(i) (p->y + (int64_t)(t0 + (i)) * p->d_inner + h * P)
    if (nt == 1) {
        /* decode: state = state * exp(dt A) + dt x (x) B;  y = state C + D x */
        const float dA = expf(dtv[0] * A);
        const float *x = XS(0), *B = BS(0), *C = CS(0);
        float *y = YS(0);
        for (int64_t q = 0; q < P; q++) {
            float *Sq = S + q * N;
            const float dx = dtv[0] * x[q];
            for (int64_t n = 0; n < N; n++) {
                Sq[n] = Sq[n] * dA + dx * B[n];
            }
            y[q] = dot(Sq, C, N) + Dh * x[q];
        }
        return;
    }
    for (int32_t c0 = 0; c0 < nt; c0 += (int32_t)p->chunk) {
        const int32_t Q = nt - c0 < p->chunk ? nt - c0 : (int32_t)p->chunk;
        float acc = 0.0f;
        for (int32_t l = 0; l < Q; l++) {
            acc += dtv[c0 + l] * A;
            cum[l] = acc; /* inclusive cumsum of dt*A within the chunk */
        }
        for (int32_t l = 0; l < Q; l++) {
            const float *C = CS(c0 + l), *x = XS(c0 + l);
            float *y = YS(c0 + l);
            const float el = expf(cum[l]);
            for (int64_t q = 0; q < P; q++) {
                y[q] = el * dot(S + q * N, C, N) + Dh * x[q]; /* state from earlier chunks + skip */
            }
            for (int32_t s = 0; s <= l; s++) {
                const float coef = dot(C, BS(c0 + s), N) * expf(cum[l] - cum[s]) * dtv[c0 + s];
                const float *xs = XS(c0 + s);
                for (int64_t q = 0; q < P; q++) {
                    y[q] += coef * xs[q];
                }
            }
        }
        const float decay = expf(cum[Q - 1]);
        for (int64_t q = 0; q < P; q++) {
            float *Sq = S + q * N;
            for (int64_t n = 0; n < N; n++) {
                Sq[n] *= decay;
            }
            for (int32_t s = 0; s < Q; s++) {
                const float f = expf(cum[Q - 1] - cum[s]) * dtv[c0 + s] * XS(c0 + s)[q];
                const float *B = BS(c0 + s);
                for (int64_t n = 0; n < N; n++) {
                    Sq[n] += f * B[n];
                }
            }
        }
    }
#undef XS
#undef BS
#undef CS
#undef YS
}

static enum kr_status cpu_mamba(kr_backend_t be, const struct krk_mamba_params *p)
{
    struct cpu_ctx *ctx = ctx_of(be);
    const struct kr_batch *b = ctx->batch;
    if (p->d_conv > 64 || p->d_conv < 1) {
        return KR_ERR_INVAL;
    }
    mamba_conv(b, p, ctx->n_threads);
    const int64_t cd = p->d_inner + 2 * p->n_group * p->d_state;
    int32_t max_nt = 0;
    for (int32_t s = 0; s < b->n_seq; s++) {
        int32_t nt = b->seq_tok0[s + 1] - b->seq_tok0[s];
        max_nt = nt > max_nt ? nt : max_nt;
    }
    const size_t per_thread = (size_t)max_nt + (size_t)p->chunk;
    float *scratch = kr_malloc((size_t)ctx->n_threads * per_thread * sizeof(float));
    if (!scratch) {
        return KR_ERR_NOMEM;
    }
    const size_t state_sz = (size_t)(p->n_head * p->head_dim * p->d_state);
#pragma omp parallel for num_threads(ctx->n_threads) schedule(dynamic, 1) collapse(2) \
    if ((int64_t)b->n_tok * p->n_head * p->head_dim * p->d_state >= PAR_MIN_WORK)
    for (int32_t s = 0; s < b->n_seq; s++) {
        for (int64_t h = 0; h < p->n_head; h++) {
            float *sc = scratch + (size_t)omp_get_thread_num() * per_thread;
            float *S = p->ssm_state + (size_t)b->seq_slot[s] * state_sz + (size_t)(h * p->head_dim * p->d_state);
            if (b->seq_pos0[s] == 0) {
                memset(S, 0, (size_t)(p->head_dim * p->d_state) * sizeof(float));
            }
            int32_t t0 = b->seq_tok0[s], nt = b->seq_tok0[s + 1] - t0;
            bool keeps = false;
            for (int32_t i = 0; i < nt && b->tok_state_slot && !keeps; i++) {
                keeps = b->tok_state_slot[t0 + i] >= 0;
            }
            if (keeps) {
                /* token by token, as decode steps run it, keeping the states asked for */
                const size_t head_sz = (size_t)(p->head_dim * p->d_state);
                for (int32_t i = 0; i < nt; i++) {
                    mamba_ssd_head(p, cd, t0 + i, 1, h, S, sc, sc + max_nt);
                    const int32_t keep = b->tok_state_slot[t0 + i];
                    if (keep >= 0) {
                        memcpy(p->ssm_state + (size_t)keep * state_sz + (size_t)h * head_sz, S,
                               head_sz * sizeof(float));
                    }
                }
            } else if (nt > 0) {
                mamba_ssd_head(p, cd, t0, nt, h, S, sc, sc + max_nt);
            }
        }
    }
    kr_free(scratch);
    return KR_OK;
}

static enum kr_status cpu_gated_rmsnorm(kr_backend_t be, const struct krk_gated_rmsnorm_params *p)
{
    const float *y = p->y, *z = p->z, *w = p->w;
    const int64_t ldz = p->ldz, n = p->n, dim = p->dim, group = p->group;
    const float eps = p->eps;
    float *out = p->out;
    for (int64_t t = 0; t < n; t++) {
        const float *yt = y + t * dim, *zt = z + t * ldz;
        float *ot = out + t * dim;
        for (int64_t j = 0; j < dim; j++) {
            ot[j] = yt[j] * silu(zt[j]);
        }
        for (int64_t g0 = 0; g0 < dim; g0 += group) {
            float ss = 0.0f;
            for (int64_t j = g0; j < g0 + group; j++) {
                ss += ot[j] * ot[j];
            }
            const float r = 1.0f / sqrtf(ss / (float)group + eps);
            for (int64_t j = g0; j < g0 + group; j++) {
                ot[j] = ot[j] * r * w[j];
            }
        }
    }
    if (p->out_bf16) {
        write_bf16(p->out_bf16, out, n * dim);
    }
    return KR_OK;
}

/* ---- attention ---------------------------------------------------------------------------- */

static float *kv_row(void *cache, const struct kr_batch *b, int32_t s, int32_t pos, int32_t block_size,
                     int64_t row)
{
    int32_t blk = b->block_table[(int64_t)s * b->max_blocks + pos / block_size];
    return (float *)cache + ((int64_t)blk * block_size + pos % block_size) * row;
}

/* --kv-cache-dtype fp8, K/V: each value as e4m3 with the tensor's scale, x -> e4m3(x / s) * s (the
 * encoder saturates at +-448; NaN stays NaN). */
static void fp8_tensor_round(float *x, int64_t n, float s)
{
    for (int64_t i = 0; i < n; i++) {
        x[i] = kr_fp8_e4m3_to_f32(kr_fp8_e4m3_from_f32(x[i] / s)) * s;
    }
}

/* --kv-cache-dtype fp8, the latent (fp8_ds_mla): per block of 128 values (the last may be shorter)
 * the e4m3 codes and fp32 scale of kr_fp8_act_quant, stored back as code x scale. A block with a
 * value that is not finite is left as it is (the step's result is then not finite either). */
static void fp8_block_round(float *x, int64_t n)
{
    uint8_t q[128];
    float s;
    for (int64_t b0 = 0; b0 < n; b0 += 128) {
        const int64_t len = n - b0 < 128 ? n - b0 : 128;
        if (kr_fp8_act_quant(x + b0, len, len, false, q, &s) == KR_OK) {
            for (int64_t i = 0; i < len; i++) {
                x[b0 + i] = kr_fp8_e4m3_to_f32(q[i]) * s;
            }
        }
    }
}

static void bf16_round(float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        x[i] = kr_bf16_to_f32(kr_f32_to_bf16(x[i]));
    }
}

static enum kr_status cpu_attention(kr_backend_t be, const struct krk_attn_params *p)
{
    struct cpu_ctx *ctx = ctx_of(be);
    const struct kr_batch *b = ctx->batch;
    const int64_t hd = p->head_dim, row = p->n_kv_head * hd, group = p->n_head / p->n_kv_head;
    if (p->kv_fp8 && !(p->k_scale > 0.0f && p->v_scale > 0.0f)) {
        KR_LOG_ERROR("cpu: FP8 K/V cache scales must be positive (%g, %g)", (double)p->k_scale, (double)p->v_scale);
        return KR_ERR_INVAL;
    }
    /* 1. write the new keys and values into the paged cache */
    for (int32_t s = 0; s < b->n_seq; s++) {
        for (int32_t t = b->seq_tok0[s]; t < b->seq_tok0[s + 1]; t++) {
            float *kr = kv_row(p->k_cache, b, s, b->pos[t], p->block_size, row);
            float *vr = kv_row(p->v_cache, b, s, b->pos[t], p->block_size, row);
            memcpy(kr, p->k + t * p->ld_qkv, (size_t)row * sizeof(float));
            memcpy(vr, p->v + t * p->ld_qkv, (size_t)row * sizeof(float));
            if (p->kv_fp8) {
                fp8_tensor_round(kr, row, p->k_scale);
                fp8_tensor_round(vr, row, p->v_scale);
            }
        }
    }
    int32_t max_ctx = 1, max_nt = 0;
    for (int32_t t = 0; t < b->n_tok; t++) {
        max_ctx = b->pos[t] + 1 > max_ctx ? b->pos[t] + 1 : max_ctx;
    }
    for (int32_t s = 0; s < b->n_seq; s++) {
        int32_t nt = b->seq_tok0[s + 1] - b->seq_tok0[s];
        max_nt = nt > max_nt ? nt : max_nt;
    }
    float *scratch = kr_malloc((size_t)ctx->n_threads * (size_t)max_ctx * sizeof(float));
    if (!scratch) {
        return KR_ERR_NOMEM;
    }
    /* 2. each (token, head): softmax(q k^T * scale) v over positions 0..pos */
#pragma omp parallel for num_threads(ctx->n_threads) schedule(dynamic, 4) collapse(2) \
    if ((int64_t)b->n_tok * max_ctx * p->n_head * p->head_dim >= PAR_MIN_WORK)
    for (int32_t s = 0; s < b->n_seq; s++) {
        for (int32_t i = 0; i < max_nt; i++) {
            int32_t t = b->seq_tok0[s] + i;
            if (t >= b->seq_tok0[s + 1]) {
                continue;
            }
            float *sc = scratch + (size_t)omp_get_thread_num() * (size_t)max_ctx;
            const int32_t pos = b->pos[t];
            for (int64_t h = 0; h < p->n_head; h++) {
                const int64_t kvh = h / group;
                const float *q = p->q + t * p->ld_qkv + h * hd;
                float m = -INFINITY;
                for (int32_t j = 0; j <= pos; j++) {
                    const float *k = kv_row(p->k_cache, b, s, j, p->block_size, row) + kvh * hd;
                    sc[j] = dot(q, k, hd) * p->scale;
                    m = sc[j] > m ? sc[j] : m;
                }
                float sum = 0.0f;
                for (int32_t j = 0; j <= pos; j++) {
                    sc[j] = expf(sc[j] - m);
                    sum += sc[j];
                }
                float *o = p->out + t * p->n_head * hd + h * hd;
                memset(o, 0, (size_t)hd * sizeof(float));
                for (int32_t j = 0; j <= pos; j++) {
                    const float *v = kv_row(p->v_cache, b, s, j, p->block_size, row) + kvh * hd;
                    const float pj = sc[j] / sum;
                    for (int64_t d = 0; d < hd; d++) {
                        o[d] += pj * v[d];
                    }
                }
            }
        }
    }
    kr_free(scratch);
    return KR_OK;
}

/* ---- MoE ------------------------------------------------------------------------------------ */

static enum kr_status cpu_moe_route(kr_backend_t be, const struct krk_route_params *p)
{
    const int64_t n = p->n;
    const int64_t E = p->n_expert, per_group = E / p->n_group;
    float *buf = kr_malloc((size_t)(3 * E + p->n_group) * sizeof(float));
    if (!buf) {
        return KR_ERR_NOMEM;
    }
    float *score = buf, *sel = buf + E, *masked = buf + 2 * E, *gscore = buf + 3 * E;
    for (int64_t t = 0; t < n; t++) {
        const float *lg = p->logits + t * E;
        if (p->score == KR_ROUTER_SOFTMAX) {
            float m = -INFINITY, sum = 0.0f;
            for (int64_t e = 0; e < E; e++) {
                m = lg[e] > m ? lg[e] : m;
            }
            for (int64_t e = 0; e < E; e++) {
                score[e] = expf(lg[e] - m);
                sum += score[e];
            }
            for (int64_t e = 0; e < E; e++) {
                score[e] /= sum;
            }
        } else {
            for (int64_t e = 0; e < E; e++) {
                score[e] = 1.0f / (1.0f + expf(-lg[e]));
            }
        }
        for (int64_t e = 0; e < E; e++) {
            sel[e] = score[e] + (p->bias ? p->bias[e] : 0.0f);
            masked[e] = sel[e];
        }
        if (p->n_group > 1) {
            /* group score = sum of the group's top-2 selection scores (top-1 for groups of one) */
            for (int64_t g = 0; g < p->n_group; g++) {
                float a = -INFINITY, b2 = -INFINITY;
                for (int64_t e = g * per_group; e < (g + 1) * per_group; e++) {
                    if (sel[e] > a) {
                        b2 = a;
                        a = sel[e];
                    } else if (sel[e] > b2) {
                        b2 = sel[e];
                    }
                }
                gscore[g] = per_group > 1 ? a + b2 : a;
            }
            /* keep the topk_group best groups (ties: lower index); mask the others out */
            for (int64_t k = 0; k < p->n_group - p->topk_group; k++) {
                int64_t worst = -1;
                for (int64_t g = 0; g < p->n_group; g++) {
                    if (gscore[g] != INFINITY && (worst < 0 || gscore[g] <= gscore[worst])) {
                        worst = g; /* <= : among equal scores the highest index is dropped first */
                    }
                }
                gscore[worst] = INFINITY; /* marks a dropped group */
                for (int64_t e = worst * per_group; e < (worst + 1) * per_group; e++) {
                    masked[e] = -INFINITY;
                }
            }
        }
        int32_t *ids = p->ids + t * p->n_used;
        float *w = p->weights + t * p->n_used;
        float wsum = 0.0f;
        for (int64_t k = 0; k < p->n_used; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                if (masked[e] != -INFINITY && (best < 0 || masked[e] > masked[best])) {
                    best = e;
                }
            }
            if (best < 0) { /* fewer selectable experts than n_used: validated at load, never here */
                kr_free(buf);
                return KR_ERR_INTERNAL;
            }
            masked[best] = -INFINITY;
            ids[k] = (int32_t)best;
            w[k] = score[best];
            wsum += w[k];
        }
        for (int64_t k = 0; k < p->n_used; k++) {
            if (p->norm_topk) {
                w[k] /= wsum + 1e-20f;
            }
            w[k] *= p->scale;
        }
    }
    kr_free(buf);
    return KR_OK;
}

static enum kr_status cpu_moe_experts(kr_backend_t be, const struct krk_experts_params *p,
                                      const struct kr_expert_weights *wt)
{
    const int64_t n = p->n;
    struct cpu_ctx *ctx = ctx_of(be);
    enum kr_status st = KR_OK;
    float *xs = NULL, *hu = NULL, *hg = NULL, *ys = NULL;
    int32_t *rows = NULL;
    float *rw = NULL;
    memset(p->out, 0, (size_t)(n * p->d_out) * sizeof(float));
    xs = kr_malloc((size_t)(n * p->d_in) * sizeof(float));
    hu = kr_malloc((size_t)(n * p->d_ffn) * sizeof(float));
    hg = kr_malloc((size_t)(n * p->d_ffn) * sizeof(float));
    ys = kr_malloc((size_t)(n * p->d_out) * sizeof(float));
    rows = kr_malloc((size_t)n * sizeof(int32_t));
    rw = kr_malloc((size_t)n * sizeof(float));
    if (!xs || !hu || !hg || !ys || !rows || !rw) {
        st = KR_ERR_NOMEM;
        goto out;
    }
    /* Expert by expert: gather the tokens routed to it, run its MLP, scatter-add weighted.
     * A token's sum is accumulated in expert-id order, independent of the batch. */
    for (int64_t e = 0; e < p->n_expert; e++) {
        int64_t m = 0;
        for (int64_t t = 0; t < n; t++) {
            for (int64_t k = 0; k < p->n_used; k++) {
                if (p->ids[t * p->n_used + k] == e) {
                    rows[m] = (int32_t)t;
                    rw[m] = p->weights[t * p->n_used + k];
                    memcpy(xs + m * p->d_in, p->x + t * p->d_in, (size_t)p->d_in * sizeof(float));
                    m++;
                }
            }
        }
        if (m == 0) {
            continue;
        }
        if ((st = matmul_impl(ctx->n_threads, xs, p->d_in, m, &wt->up[e], NULL, hu, p->d_ffn)) != KR_OK) {
            goto out;
        }
        if (wt->gate) {
            if ((st = matmul_impl(ctx->n_threads, xs, p->d_in, m, &wt->gate[e], NULL, hg, p->d_ffn)) != KR_OK) {
                goto out;
            }
        }
        const struct krk_act_params ap = {.act = p->act, .gate = wt->gate ? hg : NULL, .x = hu, .ld_in = p->d_ffn,
                                          .n = m, .width = p->d_ffn, .out = hu};
        cpu_act(be, &ap);
        if ((st = matmul_impl(ctx->n_threads, hu, p->d_ffn, m, &wt->down[e], NULL, ys, p->d_out)) != KR_OK) {
            goto out;
        }
        for (int64_t i = 0; i < m; i++) {
            float *o = p->out + (int64_t)rows[i] * p->d_out;
            for (int64_t j = 0; j < p->d_out; j++) {
                o[j] += rw[i] * ys[i * p->d_out + j];
            }
        }
    }
out:
    kr_free(xs);
    kr_free(hu);
    kr_free(hg);
    kr_free(ys);
    kr_free(rows);
    kr_free(rw);
    return st;
}

static enum kr_status cpu_gather_out(kr_backend_t be, const float *src, int64_t width, float *dst)
{
    const struct kr_batch *b = ctx_of(be)->batch;
    for (int32_t i = 0; i < b->n_out; i++) {
        memcpy(dst + (int64_t)i * width, src + (int64_t)b->out_tok[i] * width, (size_t)width * sizeof(float));
    }
    return KR_OK;
}


/* ---- MLA / DSA --------------------------------------------------------------------------------- */

static enum kr_status cpu_rope(kr_backend_t be, const struct krk_rope_params *p)
{
    const struct kr_batch *b = ctx_of(be)->batch;
    const int64_t half = p->dim / 2;
    for (int32_t t = 0; t < b->n_tok; t++) {
        const float pos = (float)b->pos[t];
        for (int64_t j = 0; j < half; j++) {
            const float ang = pos * p->inv_freq[j]; /* fp32 angle, as the references compute it */
            const float c = cosf(ang) * p->factor, sn = sinf(ang) * p->factor;
            for (int64_t v = 0; v < p->n_vec; v++) {
                float *x = p->x + t * p->ld + v * p->stride + p->off;
                const int64_t i0 = p->interleaved ? 2 * j : j, i1 = p->interleaved ? 2 * j + 1 : j + half;
                const float a = x[i0], bb = x[i1];
                x[i0] = a * c - bb * sn;
                x[i1] = a * sn + bb * c;
            }
        }
    }
    return KR_OK;
}

static float *latent_row(const void *cache, const struct kr_batch *b, int32_t s, int32_t pos, int32_t block_size,
                         int64_t row)
{
    int32_t blk = b->block_table[(int64_t)s * b->max_blocks + pos / block_size];
    return (float *)cache + ((int64_t)blk * block_size + pos % block_size) * row;
}

static enum kr_status cpu_mla_cache_write(kr_backend_t be, const struct krk_mla_cache_params *p)
{
    const struct kr_batch *b = ctx_of(be)->batch;
    const int64_t row = p->kv_lora + p->rope + p->idx_dim;
    for (int32_t s = 0; s < b->n_seq; s++) {
        for (int32_t t = b->seq_tok0[s]; t < b->seq_tok0[s + 1]; t++) {
            float *r = latent_row(p->cache, b, s, b->pos[t], p->block_size, row);
            memcpy(r, p->c_kv + t * p->ld_ckv, (size_t)p->kv_lora * sizeof(float));
            memcpy(r + p->kv_lora, p->k_pe + t * p->ld_kpe, (size_t)p->rope * sizeof(float));
            if (p->fp8) {
                fp8_block_round(r, p->kv_lora);
                bf16_round(r + p->kv_lora, p->rope);
            }
            if (p->idx_dim) {
                memcpy(r + p->kv_lora + p->rope, p->ik + t * p->idx_dim, (size_t)p->idx_dim * sizeof(float));
            }
        }
    }
    return KR_OK;
}

/* Sequence of token t (tokens of a sequence are contiguous). */
static int32_t seq_of(const struct kr_batch *b, int32_t t)
{
    int32_t lo = 0, hi = b->n_seq - 1;
    while (lo < hi) {
        int32_t mid = (lo + hi + 1) / 2;
        if (b->seq_tok0[mid] <= t) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

struct scored {
    float score;
    int32_t pos;
};

/* Orders by score descending, then position ascending (deterministic ties). */
static int cmp_scored(const void *a, const void *b)
{
    const struct scored *x = a, *y = b;
    if (x->score != y->score) {
        return x->score > y->score ? -1 : 1;
    }
    return (x->pos > y->pos) - (x->pos < y->pos);
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static enum kr_status cpu_dsa_index(kr_backend_t be, const struct krk_dsa_index_params *p)
{
    struct cpu_ctx *ctx = ctx_of(be);
    const struct kr_batch *b = ctx->batch;
    int32_t max_ctx = 1;
    for (int32_t t = 0; t < b->n_tok; t++) {
        max_ctx = b->pos[t] + 1 > max_ctx ? b->pos[t] + 1 : max_ctx;
    }
    struct scored *scratch = kr_malloc((size_t)ctx->n_threads * (size_t)max_ctx * sizeof *scratch);
    if (!scratch) {
        return KR_ERR_NOMEM;
    }
#pragma omp parallel for num_threads(ctx->n_threads) schedule(dynamic, 1) \
    if ((int64_t)b->n_tok * max_ctx * p->n_head * p->head_dim >= PAR_MIN_WORK)
    for (int32_t t = 0; t < b->n_tok; t++) {
        const int32_t s = seq_of(b, t), pos = b->pos[t];
        int32_t *out = p->idx + (int64_t)t * p->topk;
        const int32_t n_keys = pos + 1;
        if (n_keys <= p->topk) { /* every visible key is selected: no scores needed */
            for (int32_t j = 0; j < p->topk; j++) {
                out[j] = j < n_keys ? j : -1;
            }
            continue;
        }
        struct scored *sc = scratch + (size_t)omp_get_thread_num() * (size_t)max_ctx;
        const float *iq = p->iq + (int64_t)t * p->n_head * p->head_dim;
        const float *w = p->w + (int64_t)t * p->n_head;
        for (int32_t j = 0; j < n_keys; j++) {
            const float *ik = latent_row(p->cache, b, s, j, p->block_size, p->row) + p->key_off;
            float acc = 0.0f;
            for (int64_t h = 0; h < p->n_head; h++) {
                const float d = dot(iq + h * p->head_dim, ik, p->head_dim);
                acc += w[h] * (d > 0.0f || p->no_relu ? d : 0.0f);
            }
            sc[j].score = acc;
            sc[j].pos = j;
        }
        qsort(sc, (size_t)n_keys, sizeof *sc, cmp_scored);
        for (int32_t j = 0; j < p->topk; j++) {
            out[j] = sc[j].pos;
        }
        qsort(out, (size_t)p->topk, sizeof *out, cmp_i32);
    }
    kr_free(scratch);
    return KR_OK;
}

static enum kr_status cpu_mla_attention(kr_backend_t be, const struct krk_mla_attn_params *p)
{
    if (p->select) {
        KR_TRY(cpu_dsa_index(be, p->select));
    }
    struct cpu_ctx *ctx = ctx_of(be);
    const struct kr_batch *b = ctx->batch;
    int32_t max_ctx = 1;
    for (int32_t t = 0; t < b->n_tok; t++) {
        max_ctx = b->pos[t] + 1 > max_ctx ? b->pos[t] + 1 : max_ctx;
    }
    const int64_t R = p->kv_lora, qd = p->nope + p->rope, per_head = p->nope + p->v_dim;
    const size_t per_thread = (size_t)max_ctx * 2 + (size_t)R * 2;
    float *scratch = kr_malloc((size_t)ctx->n_threads * per_thread * sizeof(float));
    if (!scratch) {
        return KR_ERR_NOMEM;
    }
#pragma omp parallel for num_threads(ctx->n_threads) schedule(dynamic, 1) collapse(2) \
    if ((int64_t)b->n_tok * p->n_head * max_ctx * (R + p->rope) >= PAR_MIN_WORK)
    for (int32_t t = 0; t < b->n_tok; t++) {
        for (int64_t h = 0; h < p->n_head; h++) {
            float *sc = scratch + (size_t)omp_get_thread_num() * per_thread;
            int32_t *keys = (int32_t *)(sc + max_ctx);
            float *q_abs = sc + 2 * (size_t)max_ctx, *o_lat = q_abs + R;
            const int32_t s = seq_of(b, t), pos = b->pos[t];
            int32_t n_keys = 0;
            if (p->idx) {
                for (int32_t j = 0; j < p->topk; j++) {
                    const int32_t k = p->idx[(int64_t)t * p->topk + j];
                    if (k >= 0 && k <= pos) {
                        keys[n_keys++] = k;
                    }
                }
            } else {
                for (int32_t j = 0; j <= pos; j++) {
                    keys[n_keys++] = j;
                }
            }
            const float *q = p->q + (int64_t)t * p->n_head * qd + h * qd;
            const float *wkb = p->kv_b + h * per_head * R; /* W_UK[h]: [nope, R]; W_UV[h]: [v_dim, R] */
            /* q_abs = W_UK[h]^T q_nope */
            memset(q_abs, 0, (size_t)R * sizeof(float));
            for (int64_t d = 0; d < p->nope; d++) {
                const float qd_ = q[d];
                const float *wr = wkb + d * R;
                for (int64_t r = 0; r < R; r++) {
                    q_abs[r] += qd_ * wr[r];
                }
            }
            float m = -INFINITY;
            for (int32_t j = 0; j < n_keys; j++) {
                const float *row = latent_row(p->cache, b, s, keys[j], p->block_size, p->row);
                sc[j] = (dot(q_abs, row, R) + dot(q + p->nope, row + R, p->rope)) * p->scale;
                m = sc[j] > m ? sc[j] : m;
            }
            float sum = 0.0f;
            for (int32_t j = 0; j < n_keys; j++) {
                sc[j] = expf(sc[j] - m);
                sum += sc[j];
            }
            memset(o_lat, 0, (size_t)R * sizeof(float));
            for (int32_t j = 0; j < n_keys; j++) {
                const float *row = latent_row(p->cache, b, s, keys[j], p->block_size, p->row);
                const float pj = sc[j] / sum;
                for (int64_t r = 0; r < R; r++) {
                    o_lat[r] += pj * row[r];
                }
            }
            float *o = p->out + (int64_t)t * p->n_head * p->v_dim + h * p->v_dim;
            for (int64_t v = 0; v < p->v_dim; v++) {
                o[v] = dot(wkb + (p->nope + v) * R, o_lat, R);
            }
        }
    }
    kr_free(scratch);
    return KR_OK;
}

/* ---- construction ------------------------------------------------------------------------- */

/* The allowed-token bitmask of sampling row r, NULL when it has none; *bad when its range lies
 * outside the mask array (the row is then refused, as the kernel refuses it). */
static const uint32_t *row_mask(const struct krk_sample_params *p, const struct krk_sample_row *r, bool *bad)
{
    *bad = false;
    if (!p->mask || r->mask_off < 0) {
        return NULL;
    }
    const int64_t words = (p->vocab + 31) / 32;
    if ((int64_t)r->mask_off + words > p->n_mask) {
        *bad = true;
        return NULL;
    }
    return p->mask + r->mask_off;
}

/* Samples each row with the host sampler's selection and the row's given draw. */
static enum kr_status cpu_sample(kr_backend_t be, const struct krk_sample_params *p)
{
    struct kr_sampler_scratch sc = {0};
    float *lp = kr_malloc((size_t)p->vocab * sizeof(float));
    if (!lp) {
        return KR_ERR_NOMEM;
    }
    enum kr_status st = KR_OK;
    for (int64_t i = 0; i < p->n && st == KR_OK; i++) {
        const struct krk_sample_row *r = &p->rows[i];
        const float *row = p->logits + i * p->ld;
        bool bad_mask;
        const uint32_t *mask = row_mask(p, r, &bad_mask);
        int32_t tok = -1;
        if (r->pen_off < 0 || r->pen_n < 0 || (int64_t)r->pen_off + r->pen_n > p->n_pen || bad_mask) {
            p->out[i] = -1;
        } else {
            const int64_t o = r->pen_off;
            st = kr_sample_with_draw(row, mask, p->vocab, r->temperature, r->top_k, r->top_p, r->min_p, r->presence,
                                     r->frequency, r->repetition, p->pen_ids + o, p->pen_count + o,
                                     p->pen_flags + o, r->pen_n, r->u, &sc, &tok);
            if (st == KR_ERR_INTERNAL) { /* every logit masked: the row is refused */
                st = KR_OK;
                tok = -1;
            }
            p->out[i] = tok;
        }
        if (st == KR_OK && (p->out_logprob || p->n_top > 0)) {
            kr_log_softmax_masked(row, mask, lp, p->vocab); /* a constrained row: its masked distribution */
            if (p->out_logprob) {
                p->out_logprob[i] = tok >= 0 ? lp[tok] : NAN;
            }
            if (p->n_top > 0) {
                int32_t *ids = p->top_ids + i * p->n_top;
                kr_top_k_ids(lp, p->vocab, p->n_top, ids);
                for (int32_t k = 0; k < p->n_top; k++) {
                    p->top_lp[i * p->n_top + k] = lp[ids[k]];
                }
            }
        }
    }
    kr_sampler_scratch_free(&sc);
    kr_free(lp);
    return st;
}

/* ---- FP8 indexer path ------------------------------------------------------------------------ */

static enum kr_status cpu_fp8_round(kr_backend_t be, const struct krk_fp8_round_params *p)
{
    if (p->dim < 1 || p->block < 1 || p->dim % p->block != 0 || p->n < 0 || p->ld < p->dim) {
        return KR_ERR_INVAL;
    }
    const int n_threads = ctx_of(be)->n_threads;
    const int64_t per = p->dim + p->dim / p->block; /* row copy + scales, in floats */
    float *scratch = kr_malloc((size_t)n_threads * ((size_t)per * sizeof(float) + (size_t)p->dim));
    if (!scratch) {
        return KR_ERR_NOMEM;
    }
    const float hscale = (float)(1.0 / sqrt((double)p->dim));
    int failed = 0;
#pragma omp parallel for num_threads(n_threads) schedule(static) reduction(| : failed) if (p->n * p->dim * 8 >= PAR_MIN_WORK)
    for (int64_t i = 0; i < p->n; i++) {
        const int t = omp_get_thread_num();
        float *row = scratch + (size_t)t * (size_t)per, *scale = row + p->dim;
        uint8_t *q = (uint8_t *)(scratch + (size_t)n_threads * (size_t)per) + (size_t)t * (size_t)p->dim;
        float *x = p->x + i * p->ld;
        memcpy(row, x, (size_t)p->dim * sizeof(float));
        if ((p->hadamard && kr_fp8_hadamard(row, p->dim, hscale) != KR_OK) ||
            kr_fp8_act_quant(row, p->dim, p->block, p->ue8m0, q, scale) != KR_OK) {
            failed |= 1;
            continue;
        }
        for (int64_t j = 0; j < p->dim; j++) {
            x[j] = kr_fp8_e4m3_to_f32(q[j]) * scale[j / p->block];
        }
    }
    kr_free(scratch);
    return failed ? KR_ERR_INVAL : KR_OK;
}

/* ---- tensor parallelism: ranks are threads of one process sharing a kr_host_comm ------------ */

static enum kr_status cpu_set_tp(kr_backend_t be, int rank, int size, void *comm)
{
    struct cpu_ctx *ctx = ctx_of(be);
    if (size > 1 && (!comm || kr_host_comm_size(comm) != size)) {
        return KR_ERR_INVAL;
    }
    ctx->comm = size > 1 ? comm : NULL;
    ctx->rank = rank;
    return KR_OK;
}

static enum kr_status cpu_all_reduce(kr_backend_t be, float *x, int64_t n)
{
    struct cpu_ctx *ctx = ctx_of(be);
    return ctx->comm ? kr_host_comm_all_reduce(ctx->comm, ctx->rank, x, n) : KR_OK;
}

static enum kr_status cpu_all_gather(kr_backend_t be, const float *src, int64_t rows, int64_t cols, float *dst)
{
    struct cpu_ctx *ctx = ctx_of(be);
    if (!ctx->comm) {
        memmove(dst, src, (size_t)(rows * cols) * sizeof(float));
        return KR_OK;
    }
    return kr_host_comm_all_gather(ctx->comm, ctx->rank, src, rows, cols, dst);
}

static void cpu_tp_abort(kr_backend_t be)
{
    struct cpu_ctx *ctx = ctx_of(be);
    if (ctx->comm) {
        kr_host_comm_abort(ctx->comm);
    }
}

static bool cpu_fp8_matmul(kr_backend_t be)
{
    (void)be;
    return true;
}

static bool cpu_kv_fp8(kr_backend_t be)
{
    (void)be;
    return true;
}

/* Every op of the reference computes a row, a token or a sequence on its own, in a fixed order,
 * whatever the step holds (the hf_models and engine suites compare batched runs with runs alone
 * bit for bit): the mode asks nothing more of it. */
static enum kr_status cpu_set_batch_invariant(kr_backend_t be, bool on, struct kr_err *err)
{
    (void)be;
    (void)on;
    (void)err;
    return KR_OK;
}

static bool cpu_token_states(kr_backend_t be)
{
    (void)be;
    return true;
}

kr_backend_t kr_backend_cpu_create(int n_threads)
{
    kr_backend_t be = kr_calloc(1, sizeof *be);
    struct cpu_ctx *ctx = kr_calloc(1, sizeof *ctx);
    if (!be || !ctx) {
        kr_free(be);
        kr_free(ctx);
        return NULL;
    }
    ctx->n_threads = n_threads > 0 ? n_threads : omp_get_num_procs();
    be->ctx = ctx;
    be->api_version = KR_BACKEND_API_VERSION;
    be->iface = (struct kr_backend_i){
        .name = cpu_name,
        .free = cpu_free,
        .act_size = cpu_act_size,
        .buf_alloc = cpu_buf_alloc,
        .buf_free = cpu_buf_free,
        .upload = cpu_upload,
        .copy_d2h = cpu_copy,
        .copy_h2d = cpu_copy,
        .copy_d2d = cpu_copy,
        .begin_batch = cpu_begin_batch,
        .embed = cpu_embed,
        .rmsnorm = cpu_rmsnorm,
        .add = cpu_add,
        .matmul = cpu_matmul,
        .act = cpu_act,
        .mamba = cpu_mamba,
        .gated_rmsnorm = cpu_gated_rmsnorm,
        .attention = cpu_attention,
        .moe_route = cpu_moe_route,
        .moe_experts = cpu_moe_experts,
        .gather_out = cpu_gather_out,
        .layernorm = cpu_layernorm,
        .scale = cpu_scale,
        .rope = cpu_rope,
        .mla_cache_write = cpu_mla_cache_write,
        .dsa_index = cpu_dsa_index,
        .set_tp = cpu_set_tp,
        .fp8_round = cpu_fp8_round,
        .fp8_matmul = cpu_fp8_matmul,
        .kv_fp8 = cpu_kv_fp8,
        .token_states = cpu_token_states,
        .set_batch_invariant = cpu_set_batch_invariant,
        .all_reduce = cpu_all_reduce,
        .all_gather = cpu_all_gather,
        .tp_abort = cpu_tp_abort,
        .mla_attention = cpu_mla_attention,
        .sample = cpu_sample,
    };
    return be;
}
