/* The CUDA backend: bf16 weights, fp32 activations between ops, bf16 GEMM operands with fp32
 * accumulation (cuBLAS, or the skinny krk_gemv kernel for decode), bf16 caches, fp32 SSM states,
 * custom kernels (kernels/, through krk.h) for everything else. All work runs on one stream;
 * device memory is taken at start-up (weights, cache pools, the forward workspace and the op
 * scratch reserved for the largest step), never while serving. Decode steps are captured as CUDA
 * graphs per batch-size bucket and replayed.
 *
 * The ops take the parameter structs of kernels/include/krk/ops.h and hand them to the launchers as
 * they are, with the device's part (stream, batch, scratch, tuning variants, events) in a struct
 * krk_ctx. Three differ on purpose (docs/ARCHITECTURE.md): the matmuls dispatch among krk_gemv,
 * krk_skinny and cuBLAS, the routed experts' weights become device arrays of pointers, and sampling
 * stages the engine's host arrays. No state is carried from one op to the next: the fusions are the
 * forward pass's requests (the residual of krk_rmsnorm_params.res; the bf16 GEMM operand an op writes
 * with out_bf16 and a matmul reads through struct krk_bf16_in).
 * One instance drives one device: a tensor-parallel rank is one instance holding its shard. */
#include "backend-impl.h"
#include "comm-cuda.h"
#include "sampler.h"

#include "alloc.h"
#include "log.h"
#include "switches.h"

#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "krk.h"

#define MAX_GRAPHS 64
#define PROF_MAX_EV 4096

enum prof_cat {
    P_GEMM, P_GEMV, P_NORM, P_ACT, P_CONV, P_SSD, P_ATTN, P_MOE, P_MLA, P_DSA, P_EMBED, P_COMM, P_OTHER,
    /* parts of P_SSD (names start with "ssd:": not to be added to the total again) */
    P_SSD_DECODE, P_SSD_BMM, P_SSD_SCAN, P_DSA_SCORE, P_DSA_SELECT, PROF_N_CAT
};
static const char *const prof_names[PROF_N_CAT] = {
    "gemm (cuBLAS)", "gemv + skinny (tensor cores)", "norm+residual", "activation", "conv1d", "ssd", "attention", "moe",
    "mla attention + latent cache", "dsa indexer (scores, top-k)",
    "embed/gather/rope", "collectives (all-reduce, all-gather)", "other", "ssd: one-token update",
    "ssd: C.B^T", "ssd: chunk scan", "dsa: scores", "dsa: top-k",
};

static const int32_t graph_buckets[] = {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256};

struct graph {
    int32_t key;
    cudaGraphExec_t exec;
};

struct cuda_ctx {
    int dev;
    char desc[160];
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;
    size_t blas_ws_size;
    atomic_bool failed;    /* a sticky CUDA error: the backend refuses further work (read by /health) */
    bool graphs_on;
    int skinny_max;                     /* products of 2..skinny_max rows take krk_skinny (tensor
                                           cores), more take cuBLAS (KRAIT_SKINNY_MAX, 0 = never) */
    struct krk_fixed_lt *tuned;         /* (or NULL: KRAIT_LT_TUNE=0) plain bf16 products of
                                           KRK_TUNED_MIN_N..KRK_TUNED_MAX_N rows: krk_tuned_gemm */
    uint64_t tuned_eager[(KRK_TUNED_MAX_N + 64) / 64]; /* decode buckets that ran eagerly once, so
                                           that their graphs capture the timed algorithms */
    int tuned_logged;                   /* classes timed when last logged */
    void *sk_ws;                        /* krk_skinny's workspace (zeroed when allocated) */
    size_t sk_ws_size;
    void *st_ws;                        /* (or NULL: KRAIT_STREAM_GEMM=0) krk_stream_gemm's workspace
                                           (zeroed when allocated): plain bf16 products of
                                           9..KRK_STREAM_MAX_N rows */
    size_t st_ws_size;
    bool pdl;                           /* every kernel launches as a programmatic dependent of the
                                           one before it (krk_set_pdl), except while profiling;
                                           KRAIT_PDL=0 turns it off */
    int32_t dsa_score;                  /* indexer scores on bf16 tensor cores (KRAIT_DSA_SCORE=fp32: CUDA cores) */
    int32_t mla_attn;                   /* all heads of a token per block, tensor cores, split over keys
                                           (KRAIT_MLA_ATTN=per-head: a block per head, fp32) */
    bool mla_overlap;                   /* a DSA layer's selection runs on `side` while `stream` absorbs
                                           the queries (KRAIT_MLA_OVERLAP=0: one after the other) */
    cudaStream_t side;                  /* second stream of the overlapped selection (forked from and
                                           joined back into `stream` within one op, captured alike) */
    cudaEvent_t ev_fork, ev_join;
    cudaEvent_t ev_meta;   /* the last upload of h_meta: its bytes may be rewritten once it completed */
    bool meta_pending;
    uint64_t n_overlap;                 /* kr_backend_cuda_overlap_count */
    size_t bytes_alloc;    /* device bytes taken through buf_alloc/upload */
    uint64_t n_alloc;      /* device allocations made (kr_backend_cuda_alloc_count) */

    /* the current step */
    const struct kr_batch *hb;
    struct krk_batch batch;
    const int32_t *d_out_tok;
    int32_t *h_meta;       /* pinned staging of the batch arrays */
    int32_t *d_meta;
    size_t meta_cap;       /* int32 elements of both */

    /* scratch: op workspaces (SSD, attention, MLA, expert hidden rows, sampling) */
    void *scratch;
    size_t scratch_size;
    /* staging of a bf16 GEMM operand for callers that give no room of their own (struct
     * krk_bf16_in); allocated on first use (the forward pass always gives room) */
    krk_bf16 *xb;
    size_t xb_cap;         /* elements */
    /* device arrays of expert weight pointers, filled on first use */
    void **ptr_table;      /* device [ptr_cap] */
    size_t ptr_cap, ptr_used;
    struct ptr_entry {
        const struct kr_tensor *host; /* the model's array of expert tensors */
        const void **ptrs;             /* the n pointers the table holds (host copy): a new model (or test)
                                          may reuse the array's address and some of the tensors' */
        int64_t n;
        bool scale;                    /* the table holds the tensors' FP8 block scales */
        size_t off;                    /* its pointers at ptr_table[off..off+n) */
    } *ptr_idx;
    size_t n_ptr_idx, cap_ptr_idx;

    /* per-op timing (eager steps only) */
    struct {
        bool on;
        int n;
        cudaEvent_t ev[2 * PROF_MAX_EV];
        int cat[PROF_MAX_EV];
        int open_cat;
        double ms[PROF_N_CAT];
        int64_t calls[PROF_N_CAT];
    } prof;

    /* sampling: device copies of the rows, penalty lists and results (grown as needed) */
    void *samp_d, *samp_h; /* device buffer and its pinned staging */
    size_t samp_cap;

    /* graphs */
    struct graph graphs[MAX_GRAPHS];
    int n_graphs;
    bool capturing;
    int32_t cap_key;

    /* tensor parallelism: this rank's group (NULL alone) */
    struct kr_cuda_comm *comm;
    int rank;

    /* FP8 weights (kr_backend_set_fp8_weights): cuBLASLt's block-scaled matmul (NULL: none, products
     * take the skinny or CUDA-core kernels), the row count above which it takes over
     * (KRAIT_FP8_SKINNY_MAX), and
     * the staging of the quantized activations (codes, scales or dequantized values) */
    struct krk_fp8_lt *lt;
    int fp8_skinny_max;
    void *f8;
    size_t f8_size;

    /* --batch-invariant (kr_backend_set_batch_invariant): every product takes krk_fixed_gemm (one
     * cuBLASLt algorithm per weight shape for any row count, made at reserve for its steps' rows),
     * attention splits by each token's context, MLA attention runs per head */
    bool invariant;
    struct krk_fixed_lt *fixed;
    int64_t fixed_max_n;
    bool inv_skinny; /* decode rows take krk_skinny (cuda_reserve: at most INV_SKINNY_SEQS sequences) */
    int inv_class;   /* > 0: decode rows take krk_stream_gemm in this token class, in passes of as many
                        rows (cuda_reserve: KRAIT_STREAM_GEMM=1 and at most KRK_STREAM_MAX_N
                        sequences, whose count rounded up to 16 it is); before inv_skinny */
    /* the step's rows by kind (begin_batch; inv_step while a step is open): runs of token rows and of
     * output rows alike, `dec` for rows of sequences with one token in the step (decode rows) */
    struct inv_run {
        int32_t r0, r1;
        bool dec;
    } *inv_tok, *inv_out;
    int32_t n_inv_tok, n_inv_out, inv_cap;
    bool inv_step;
    int32_t mla_attn_sw;   /* the KRAIT_MLA_ATTN choice, back when the mode is turned off */
};

static struct cuda_ctx *ctx_of(kr_backend_t be)
{
    return be->ctx;
}

static void prof_begin(struct cuda_ctx *c, int cat)
{
    if (!c->prof.on || c->capturing || c->prof.n >= PROF_MAX_EV) {
        return;
    }
    cudaEventRecord(c->prof.ev[2 * c->prof.n], c->stream);
    c->prof.open_cat = cat;
}

static void prof_end(struct cuda_ctx *c)
{
    if (!c->prof.on || c->capturing || c->prof.n >= PROF_MAX_EV || c->prof.open_cat < 0) {
        return;
    }
    cudaEventRecord(c->prof.ev[2 * c->prof.n + 1], c->stream);
    c->prof.cat[c->prof.n++] = c->prof.open_cat;
    c->prof.open_cat = -1;
}

/* Phases timed by the launcher itself (profiling): the n event pairs after the next `skip` free ones
 * (skip 1: the op's own pair, which prof_begin takes; 0 for an op timed by its phases alone) go to
 * the kernel launcher (krk_ctx.events), which records (begin, end) around each phase. Returns them
 * in ev[2n], or NULL when not profiling. */
static cudaEvent_t *prof_phases(struct cuda_ctx *c, int skip, int n, cudaEvent_t *ev)
{
    if (!c->prof.on || c->capturing || c->prof.n + skip + n > PROF_MAX_EV) {
        return NULL;
    }
    for (int k = 0; k < 2 * n; k++) {
        ev[k] = c->prof.ev[2 * (c->prof.n + skip) + k];
    }
    return ev;
}

/* After the launch (and the op's prof_end, when it has one): its phases count as categories
 * cats[0..n). */
static void prof_phases_done(struct cuda_ctx *c, const cudaEvent_t *ev, enum kr_status st, const int *cats, int n)
{
    for (int k = 0; ev && st == KR_OK && k < n; k++) {
        c->prof.cat[c->prof.n++] = cats[k];
    }
}

/* Adds the timed ops of the finished step to the totals. */
static void prof_collect(struct cuda_ctx *c)
{
    if (!c->prof.on || c->prof.n == 0) {
        return;
    }
    cudaStreamSynchronize(c->stream);
    for (int i = 0; i < c->prof.n; i++) {
        float ms = 0;
        if (cudaEventElapsedTime(&ms, c->prof.ev[2 * i], c->prof.ev[2 * i + 1]) == cudaSuccess) {
            c->prof.ms[c->prof.cat[i]] += ms;
            c->prof.calls[c->prof.cat[i]]++;
        }
    }
    (void)cudaGetLastError();
    c->prof.n = 0;
}

/* Every CUDA runtime call goes through CU_TRY: the error is logged with file and line and turns
 * into KR_ERR_CUDA; a sticky error marks the backend failed. */
static enum kr_status cu_fail(struct cuda_ctx *c, cudaError_t e, const char *what, const char *file, int line)
{
    KR_LOG_ERROR("cuda: %s:%d: %s: %s", file, line, what, cudaGetErrorString(e));
    if (e == cudaErrorIllegalAddress || e == cudaErrorLaunchFailure || e == cudaErrorIllegalInstruction ||
        e == cudaErrorMisalignedAddress || e == cudaErrorHardwareStackError || e == cudaErrorAssert) {
        c->failed = true;
    }
    return KR_ERR_CUDA;
}

#define CU_TRY(c, expr)                                                                            \
    do {                                                                                           \
        cudaError_t e_ = (expr);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            return cu_fail((c), e_, #expr, __FILE__, __LINE__);                                    \
        }                                                                                          \
    } while (0)

#define BLAS_TRY(expr)                                                                             \
    do {                                                                                           \
        cublasStatus_t s_ = (expr);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
            KR_LOG_ERROR("cuda: %s:%d: %s: cuBLAS status %d", __FILE__, __LINE__, #expr, (int)s_); \
            return KR_ERR_CUDA;                                                                    \
        }                                                                                          \
    } while (0)

/* ---- memory ------------------------------------------------------------------------------- */

static const char *cuda_name(kr_backend_t be)
{
    return ctx_of(be)->desc;
}

static void graphs_clear(struct cuda_ctx *c)
{
    for (int i = 0; i < c->n_graphs; i++) {
        cudaGraphExecDestroy(c->graphs[i].exec);
    }
    c->n_graphs = 0;
}

static void cuda_free(kr_backend_t be)
{
    struct cuda_ctx *c = ctx_of(be);
    if (c) {
        cudaSetDevice(c->dev);
        if (c->stream) {
            cudaStreamSynchronize(c->stream);
        }
        graphs_clear(c);
        if (c->blas) {
            cublasDestroy(c->blas);
        }
        cudaFree(c->blas_ws);
        cudaFree(c->scratch);
        cudaFree(c->xb);
        cudaFree(c->sk_ws);
        cudaFree(c->st_ws);
        krk_fp8_lt_free(c->lt);
        krk_fixed_lt_free(c->fixed);
        krk_fixed_lt_free(c->tuned);
        free(c->inv_tok);
        free(c->inv_out);
        cudaFree(c->f8);
        cudaFree(c->d_meta);
        cudaFree(c->ptr_table);
        cudaFreeHost(c->h_meta);
        cudaFree(c->samp_d);
        cudaFreeHost(c->samp_h);
        for (int i = 0; i < 2 * PROF_MAX_EV && c->prof.ev[i]; i++) {
            cudaEventDestroy(c->prof.ev[i]);
        }
        if (c->ev_fork) {
            cudaEventDestroy(c->ev_fork);
        }
        if (c->ev_meta) {
            cudaEventDestroy(c->ev_meta);
        }
        if (c->ev_join) {
            cudaEventDestroy(c->ev_join);
        }
        if (c->side) {
            cudaStreamSynchronize(c->side);
            cudaStreamDestroy(c->side);
        }
        if (c->stream) {
            cudaStreamDestroy(c->stream);
        }
        for (size_t i = 0; i < c->n_ptr_idx; i++) {
            kr_free(c->ptr_idx[i].ptrs);
        }
        kr_free(c->ptr_idx);
        kr_free(c);
    }
    kr_free(be);
}

static bool cuda_healthy(kr_backend_t be)
{
    struct cuda_ctx *c = ctx_of(be);
    return !atomic_load(&c->failed) && (!c->comm || kr_cuda_comm_ok(c->comm, c->rank));
}

/* Makes the backend's device the calling thread's current one: the ranks of a tensor-parallel group
 * are driven by different threads (and loaded by one), each on its own device. */
static enum kr_status on_device(struct cuda_ctx *c)
{
    if (c->comm) {
        const cudaError_t e = cudaSetDevice(c->dev);
        if (e != cudaSuccess) {
            return cu_fail(c, e, "cudaSetDevice", __FILE__, __LINE__);
        }
    }
    return KR_OK;
}

/* After a synchronization of the stream: whether the rank's collectives of the work before it
 * completed (the group was not aborted, no peer kernel gave up); else the results are garbage. */
static enum kr_status group_after_sync(struct cuda_ctx *c)
{
    if (c->comm && !kr_cuda_comm_ok(c->comm, c->rank)) {
        KR_LOG_ERROR("cuda: rank %d: the tensor-parallel group failed during the step", c->rank);
        return KR_ERR_CANCELLED;
    }
    return KR_OK;
}

/* Synchronizes both streams: a sticky error (an illegal access, a kernel trap) surfaces there
 * whatever call first reported the failure, and marks the backend failed. */
static bool cuda_check(kr_backend_t be)
{
    struct cuda_ctx *c = ctx_of(be);
    (void)on_device(c);
    if (!c->failed) {
        cudaError_t e = c->side ? cudaStreamSynchronize(c->side) : cudaSuccess;
        if (e == cudaSuccess) {
            e = cudaStreamSynchronize(c->stream);
        }
        if (e == cudaSuccess) {
            e = cudaDeviceSynchronize();
        }
        if (e != cudaSuccess) {
            (void)cu_fail(c, e, "checking the device after a failed step", __FILE__, __LINE__);
            (void)cudaGetLastError(); /* a non-sticky error is consumed; a sticky one stays */
        }
    }
    return !c->failed;
}

static enum kr_status cuda_mem_info(kr_backend_t be, size_t *free_b, size_t *total_b)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(on_device(c));
    CU_TRY(c, cudaMemGetInfo(free_b, total_b));
    return KR_OK;
}

static size_t cuda_act_size(kr_backend_t be)
{
    return sizeof(float);
}

static size_t cuda_cache_elt_size(kr_backend_t be)
{
    return sizeof(krk_bf16);
}

static enum kr_status dev_alloc(struct cuda_ctx *c, size_t size, void **out)
{
    *out = NULL;
    if (c->capturing) {
        KR_LOG_ERROR("cuda: device allocation of %zu bytes requested during graph capture", size);
        return KR_ERR_INTERNAL;
    }
    KR_TRY(on_device(c));
    cudaError_t e = cudaMalloc(out, size ? size : 16);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        KR_LOG_ERROR("cuda: out of device memory allocating %zu bytes (%zu held)", size, c->bytes_alloc);
        return KR_ERR_NOMEM;
    }
    CU_TRY(c, e);
    c->bytes_alloc += size;
    c->n_alloc++;
    return KR_OK;
}

static enum kr_status cuda_buf_alloc(kr_backend_t be, size_t size, struct kr_buf *out)
{
    struct cuda_ctx *c = ctx_of(be);
    memset(out, 0, sizeof *out);
    void *p;
    KR_TRY(dev_alloc(c, size, &p));
    cudaError_t e = cudaMemsetAsync(p, 0, size, c->stream);
    if (e == cudaSuccess) {
        e = cudaStreamSynchronize(c->stream);
    }
    if (e != cudaSuccess) {
        cudaFree(p);
        c->bytes_alloc -= size;
        return cu_fail(c, e, "zeroing a new buffer", __FILE__, __LINE__);
    }
    out->ptr = p;
    out->size = size;
    return KR_OK;
}

static void cuda_buf_free(kr_backend_t be, struct kr_buf *buf)
{
    struct cuda_ctx *c = ctx_of(be);
    (void)on_device(c);
    cudaStreamSynchronize(c->stream);
    cudaFree(buf->ptr);
    c->bytes_alloc -= buf->size < c->bytes_alloc ? buf->size : c->bytes_alloc;
    buf->ptr = NULL;
    buf->size = 0;
}

/* Copies n bytes of host memory to the device in the order of the backend's stream and waits for
 * them to land (a plain cudaMemcpy from pageable memory may return before its DMA completes, and the
 * non-blocking stream does not wait for the legacy stream). */
static enum kr_status upload_bytes(struct cuda_ctx *c, void *dst, const void *src, size_t n)
{
    cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess) {
        e = cudaStreamSynchronize(c->stream);
    }
    return e == cudaSuccess ? KR_OK : cu_fail(c, e, "cudaMemcpy (upload)", __FILE__, __LINE__);
}

/* Uploads a weight: an fp32 copy with `to_f32` (vectors, routers, kv_b: what the model computes
 * in fp32), bf16 otherwise (F16 and F32 sources are rounded to bf16; FP8 checkpoints arrive here
 * dequantized to F32 unless the loader keeps FP8 weights, whose E4M3 codes are copied as they are
 * and their block scales as fp32). Conversions run on the host. */
static enum kr_status cuda_upload(kr_backend_t be, const struct kr_tensor *host, bool to_f32, bool src_persistent,
                                  struct kr_tensor *out, struct kr_buf *owned)
{
    struct cuda_ctx *c = ctx_of(be);
    memset(owned, 0, sizeof *owned);
    const size_t n = (size_t)host->rows * (size_t)host->cols;
    const bool f32 = to_f32;
    if (host->dtype == KR_DTYPE_F8_E4M3 && !to_f32) { /* FP8 codes kept as they are */
        struct kr_buf b;
        KR_TRY(cuda_buf_alloc(be, n, &b));
        const enum kr_status st = upload_bytes(c, b.ptr, host->data, n);
        if (st != KR_OK) {
            cuda_buf_free(be, &b);
            return st;
        }
        *out = (struct kr_tensor){.data = b.ptr, .dtype = KR_DTYPE_F8_E4M3, .rows = host->rows, .cols = host->cols};
        *owned = b;
        return KR_OK;
    }
    if (host->dtype != KR_DTYPE_F32 && host->dtype != KR_DTYPE_F16 && host->dtype != KR_DTYPE_BF16) {
        KR_LOG_ERROR("cuda: cannot upload a tensor of dtype %s", kr_dtype_name(host->dtype));
        return KR_ERR_UNSUPPORTED;
    }
    const size_t esz = f32 ? 4 : 2;
    struct kr_buf b;
    KR_TRY(cuda_buf_alloc(be, n * esz, &b));
    enum kr_status st = KR_OK;
    if ((f32 && host->dtype == KR_DTYPE_F32) || (!f32 && host->dtype == KR_DTYPE_BF16)) {
        st = upload_bytes(c, b.ptr, host->data, n * esz);
    } else {
        const size_t slice = (size_t)1 << 22;
        void *tmp = kr_malloc(slice * esz);
        if (!tmp) {
            st = KR_ERR_NOMEM;
        }
        const size_t src_esz = kr_dtype_size(host->dtype);
        for (size_t i = 0; st == KR_OK && i < n; i += slice) {
            const size_t k = n - i < slice ? n - i : slice;
            const char *src = (const char *)host->data + i * src_esz;
            if (f32) {
                kr_convert_to_f32(tmp, src, host->dtype, k);
            } else {
                uint16_t *t = tmp;
                for (size_t j = 0; j < k; j++) {
                    float v;
                    if (host->dtype == KR_DTYPE_F32) {
                        memcpy(&v, src + j * 4, 4);
                    } else {
                        uint16_t h;
                        memcpy(&h, src + j * 2, 2);
                        v = kr_f16_to_f32(h);
                    }
                    t[j] = kr_f32_to_bf16(v);
                }
            }
            st = upload_bytes(c, (char *)b.ptr + i * esz, tmp, k * esz);
        }
        kr_free(tmp);
    }
    if (st != KR_OK) {
        cuda_buf_free(be, &b);
        return st;
    }
    *out = (struct kr_tensor){.data = b.ptr, .dtype = f32 ? KR_DTYPE_F32 : KR_DTYPE_BF16, .rows = host->rows,
                              .cols = host->cols};
    *owned = b;
    (void)src_persistent;
    return KR_OK;
}

static enum kr_status cuda_copy(kr_backend_t be, void *dst, const void *src, size_t n, enum cudaMemcpyKind kind)
{
    struct cuda_ctx *c = ctx_of(be);
    if (n == 0) {
        return KR_OK;
    }
    if (c->capturing) {
        KR_LOG_ERROR("cuda: a synchronous copy was requested during graph capture");
        return KR_ERR_INTERNAL;
    }
    KR_TRY(on_device(c));
    CU_TRY(c, cudaMemcpyAsync(dst, src, n, kind, c->stream));
    CU_TRY(c, cudaStreamSynchronize(c->stream));
    return kind == cudaMemcpyDeviceToHost ? group_after_sync(c) : KR_OK;
}

static enum kr_status cuda_copy_d2h(kr_backend_t be, void *dst, const void *src, size_t n)
{
    return cuda_copy(be, dst, src, n, cudaMemcpyDeviceToHost);
}

static enum kr_status cuda_copy_h2d(kr_backend_t be, void *dst, const void *src, size_t n)
{
    return cuda_copy(be, dst, src, n, cudaMemcpyHostToDevice);
}

static enum kr_status cuda_copy_d2d(kr_backend_t be, void *dst, const void *src, size_t n)
{
    return cuda_copy(be, dst, src, n, cudaMemcpyDeviceToDevice);
}

/* ---- scratch ------------------------------------------------------------------------------ */

static enum kr_status ensure_scratch(struct cuda_ctx *c, size_t bytes)
{
    if (bytes <= c->scratch_size) {
        return KR_OK;
    }
    bytes = (bytes + 255) & ~(size_t)255;
    if (c->stream) {
        CU_TRY(c, cudaStreamSynchronize(c->stream));
    }
    cudaFree(c->scratch);
    c->bytes_alloc -= c->scratch_size;
    c->scratch = NULL;
    c->scratch_size = 0;
    KR_TRY(dev_alloc(c, bytes, &c->scratch));
    c->scratch_size = bytes;
    graphs_clear(c); /* captured graphs point at the old scratch */
    return KR_OK;
}

static enum kr_status ensure_xb(struct cuda_ctx *c, size_t elems)
{
    if (elems <= c->xb_cap) {
        return KR_OK;
    }
    if (c->stream) {
        CU_TRY(c, cudaStreamSynchronize(c->stream));
    }
    cudaFree(c->xb);
    c->bytes_alloc -= c->xb_cap * 2;
    c->xb = NULL;
    c->xb_cap = 0;
    void *p;
    KR_TRY(dev_alloc(c, elems * 2, &p));
    c->xb = p;
    c->xb_cap = elems;
    graphs_clear(c);
    return KR_OK;
}

/* The staging of an FP8 product's quantized activations, at least `bytes`. */
static enum kr_status ensure_f8(struct cuda_ctx *c, size_t bytes)
{
    if (bytes <= c->f8_size) {
        return KR_OK;
    }
    bytes = (bytes + 255) & ~(size_t)255;
    if (c->stream) {
        CU_TRY(c, cudaStreamSynchronize(c->stream));
    }
    cudaFree(c->f8);
    c->bytes_alloc -= c->f8_size;
    c->f8 = NULL;
    c->f8_size = 0;
    KR_TRY(dev_alloc(c, bytes, &c->f8));
    c->f8_size = bytes;
    graphs_clear(c); /* captured graphs point at the old staging */
    return KR_OK;
}

/* krk_skinny's workspace of at least `bytes`, zeroed (it holds counters every product leaves at 0). */
static enum kr_status ensure_skinny_ws(struct cuda_ctx *c, size_t bytes)
{
    if (bytes <= c->sk_ws_size) {
        return KR_OK;
    }
    if (c->stream) {
        CU_TRY(c, cudaStreamSynchronize(c->stream));
    }
    cudaFree(c->sk_ws);
    c->bytes_alloc -= c->sk_ws_size;
    c->sk_ws = NULL;
    c->sk_ws_size = 0;
    KR_TRY(dev_alloc(c, bytes, &c->sk_ws));
    CU_TRY(c, cudaMemsetAsync(c->sk_ws, 0, bytes, c->stream));
    c->sk_ws_size = bytes;
    graphs_clear(c); /* captured graphs point at the old workspace */
    return KR_OK;
}

/* Replaces a device buffer and its pinned host twin of *cap bytes by ones of `bytes` (after the
 * stream is idle: work in flight may still use the old ones). */
static enum kr_status regrow_staging(struct cuda_ctx *c, void **dev, void **host, size_t *cap, size_t bytes)
{
    if (c->stream) {
        CU_TRY(c, cudaStreamSynchronize(c->stream));
    }
    cudaFree(*dev);
    cudaFreeHost(*host);
    c->bytes_alloc -= *cap < c->bytes_alloc ? *cap : c->bytes_alloc;
    *dev = *host = NULL;
    *cap = 0;
    KR_TRY(dev_alloc(c, bytes, dev));
    CU_TRY(c, cudaMallocHost(host, bytes));
    *cap = bytes;
    return KR_OK;
}

static enum kr_status ensure_meta(struct cuda_ctx *c, size_t elems)
{
    if (elems <= c->meta_cap) {
        return KR_OK;
    }
    elems += elems / 2 + 64;
    void *d = c->d_meta, *h = c->h_meta;
    size_t cap = c->meta_cap * 4;
    const enum kr_status st = regrow_staging(c, &d, &h, &cap, elems * 4);
    c->d_meta = d;
    c->h_meta = h;
    c->meta_cap = cap / 4;
    graphs_clear(c); /* captured graphs read the old metadata buffer */
    return st;
}

static int64_t max64(int64_t a, int64_t b)
{
    return a > b ? a : b;
}

/* One staging layout for sampling, host and device alike: rows | pen ids | pen counts | pen flags |
 * masks | out | lp | top ids | top lps. Inputs go over in one copy, results come back in one. */
static size_t align16(size_t v)
{
    return (v + 15) & ~(size_t)15;
}

struct samp_layout {
    size_t o_rows, o_ids, o_cnt, o_flg, o_msk, o_out, o_lp, o_tid, o_tlp, total;
};
/* n rows, np penalty entries, nm mask words, nt top log-probabilities per row */
static struct samp_layout samp_layout(size_t n, size_t np, size_t nm, size_t nt)
{
    struct samp_layout l;
    l.o_rows = 0;
    l.o_ids = align16(l.o_rows + n * sizeof(struct krk_sample_row));
    l.o_cnt = align16(l.o_ids + np * 4);
    l.o_flg = align16(l.o_cnt + np * 4);
    l.o_msk = align16(l.o_flg + np);
    l.o_out = align16(l.o_msk + nm * 4);
    l.o_lp = align16(l.o_out + n * 4);
    l.o_tid = align16(l.o_lp + n * 4);
    l.o_tlp = align16(l.o_tid + n * nt * 4);
    l.total = align16(l.o_tlp + n * nt * 4);
    return l;
}

static enum kr_status ensure_samp(struct cuda_ctx *c, size_t total);

/* Workspaces of the MLA attention and the DSA selection for steps of n_tok tokens and contexts up to
 * max_ctx: what the kernels want, but at most 256 MB unless one token alone needs more (they
 * process their queries in groups that fit). */
static size_t ws_capped(size_t all, size_t one)
{
    const size_t cap = (size_t)256 << 20;
    return all > cap ? (one > cap ? one : cap) : all;
}
static size_t dsa_ws_bytes(const struct cuda_ctx *c, int64_t n_tok, int64_t max_ctx)
{
    return ws_capped(krk_dsa_index_workspace_bytes(n_tok, max_ctx), krk_dsa_index_workspace_bytes(1, max_ctx));
}
static size_t mla_ws_bytes(int64_t n_head, int64_t kv_lora, int64_t n_tok, int64_t max_ctx)
{
    return ws_capped(krk_mla_attn_workspace_bytes(n_tok, n_head, kv_lora, max_ctx),
                     krk_mla_attn_workspace_bytes(1, n_head, kv_lora, max_ctx));
}
static size_t align256(size_t v)
{
    return (v + 255) & ~(size_t)255;
}

/* Sizes the scratch for steps of up to n_tok tokens in n_seq sequences and contexts up to max_ctx in
 * cache blocks of block_size positions (the model has rounded n_seq up to the graph batch size). */
/* Staging of an FP8 product of n rows on cuBLASLt: the codes [n, round16(cols)], then from a
 * 256-byte boundary the scales [ceil(cols / bc), n]. */
static size_t f8_lt_bytes(int64_t n, int64_t cols, int64_t bc)
{
    return align256((size_t)(n * ((cols + 15) / 16 * 16))) + (size_t)(n * ((cols + bc - 1) / bc)) * 4;
}

/* --batch-invariant: the fewest rows the product algorithms are chosen to take (the chunk of 256
 * prompt tokens plus a batch of decodes) */
#define FIXED_MIN_ROWS 512
/* --batch-invariant: the most sequences a step may hold (as reserved first) for decode rows to take
 * krk_skinny. On the Nemotron-H-8B shape (one H100) its decode steps cost +2.5 % at one sequence and
 * -1.4 % at 16 against plain mode, where cuBLASLt's one algorithm costs +11 to +23 % and +4 to +8.5
 * %; at 64 sequences krk_skinny costs +15.5 % (four 16-row tiles of x a stage, three stages) and
 * cuBLASLt +3 % (docs/PERF.md). */
#define INV_SKINNY_SEQS 16

static enum kr_status cuda_reserve(kr_backend_t be, const struct kr_model_config *m, int64_t n_tok, int64_t n_seq,
                                   int64_t max_ctx, int32_t block_size)
{
    struct cuda_ctx *c = ctx_of(be);
    n_tok = max64(n_tok, 1);
    n_seq = max64(n_seq, 1);
    size_t need = 0;
#define NEED(x)                                                                                    \
    do {                                                                                           \
        const size_t v_ = (x);                                                                     \
        need = v_ > need ? v_ : need;                                                              \
    } while (0)
    if (m->m_heads) {
        NEED(krk_ssd_workspace_bytes(n_tok, n_seq, m->m_heads, m->m_head_dim, m->m_groups, m->m_state, m->m_chunk));
    }
    if (m->n_head) {
        NEED(krk_attn_workspace_bytes(n_tok, m->n_head, m->head_dim));
        if (c->invariant) {
            NEED(krk_attn_workspace_bytes_invariant(n_seq, m->n_head, m->head_dim));
        }
    }
    if (m->n_expert) {
        NEED(krk_moe_experts_workspace_bytes(n_tok, m->n_expert_used, m->dim, m->moe_ffn, m->dim, be->fp8_weights));
    }
    if (m->kv_lora) {
        /* MLA / DSA scratch grows with the context; the kernels process queries in groups that fit.
         * With an indexer, the selection and the attention's first kernels may run at once: room
         * for both. */
        const size_t a = dsa_ws_bytes(c, n_tok, max_ctx);
        const size_t b = mla_ws_bytes(m->mla_heads, m->kv_lora, n_tok, max_ctx);
        NEED(m->idx_heads > 0 ? align256(a) + b : (a > b ? a : b));
    }
    NEED(krk_sample_workspace_bytes(n_seq, m->vocab));
#undef NEED
    KR_TRY(ensure_scratch(c, need));
    if (c->invariant && !c->fixed) {
        /* the algorithms are chosen for steps of up to n_tok rows, and at least FIXED_MIN_ROWS: a
         * driver that does not reserve its largest step first (the server does) starts with a
         * small one, and an algorithm chosen for it may not take the later, larger ones */
        const int64_t rows = n_tok > FIXED_MIN_ROWS ? n_tok : FIXED_MIN_ROWS;
        if (!(c->fixed = krk_fixed_lt_create(c->blas_ws, c->blas_ws_size, rows))) {
            KR_LOG_ERROR("cuda: cannot create the cuBLASLt handle of --batch-invariant");
            return KR_ERR_CUDA;
        }
        c->fixed_max_n = rows;
        /* decode rows on krk_stream_gemm (with KRAIT_STREAM_GEMM=1) for servers of up to
         * KRK_STREAM_MAX_N sequences a step, in the smallest token class that holds them all, else
         * on krk_skinny for up to INV_SKINNY_SEQS, chosen here once for the process's life
         * (matmul_fixed) */
        c->inv_class = c->st_ws && n_seq <= KRK_STREAM_MAX_N ? (int)((n_seq + 15) / 16 * 16) : 0;
        c->inv_skinny = !c->inv_class && n_seq <= INV_SKINNY_SEQS;
    } else if (c->invariant && c->fixed_max_n < n_tok) {
        /* a larger step later: the algorithms kept stay (a result must not change mid-process) */
        krk_fixed_lt_grow(c->fixed, n_tok);
        c->fixed_max_n = n_tok;
    }
    int64_t wide = max64(m->dim, m->m_d_inner);
    wide = max64(wide, m->ffn);
    wide = max64(wide, m->shared_ffn);
    wide = max64(wide, m->n_head * m->head_dim);
    wide = max64(wide, m->moe_latent);
    wide = max64(wide, m->moe_ffn);
    wide = max64(wide, m->q_lora);
    wide = max64(wide, m->mla_heads * m->v_head);
    if (c->skinny_max >= 2 || c->invariant) {
        /* counters for products of up to the vocabulary's or 16 activations' rows (a product with
         * more takes cuBLAS), and the partial sums of the resident blocks */
        KR_TRY(ensure_skinny_ws(c, krk_skinny_ws_bytes(max64(m->vocab, 16 * wide) + 4 * 128)));
    }
    if (be->fp8_weights) { /* FP8 products' staging (matmul_fp8, the experts' FP8 path) */
        const int64_t bc = m->fp8_block[1] > 0 ? m->fp8_block[1] : 128;
        size_t f8 = f8_lt_bytes(n_tok, wide, bc);
        /* the CUDA-core path's dequantized rows (weights not in 128-column blocks) for a decode graph's
         * rows; larger products of such weights allocate when they first run, outside any graph */
        const size_t gemv = (size_t)(n_tok < 256 ? n_tok : 256) * (size_t)(wide + 4) * 4;
        f8 = gemv > f8 ? gemv : f8;
        if (m->n_expert) {
            const size_t ex = (size_t)n_tok * (size_t)(m->dim + 4) * 4;
            f8 = ex > f8 ? ex : f8;
        }
        KR_TRY(ensure_f8(c, f8));
    }
    /* sampling staging for every sequence at once: the most top log-probabilities, penalty entries
     * for every distinct token a sequence can hold (its context, at most the vocabulary) and an
     * allowed-token mask per sequence (constrained decoding) */
    const int64_t pen_per_seq = max_ctx < m->vocab ? max_ctx : m->vocab;
    KR_TRY(ensure_samp(c, samp_layout((size_t)n_seq, (size_t)(n_seq * max64(pen_per_seq, 1)),
                                      (size_t)(n_seq * ((m->vocab + 31) / 32)), (size_t)KR_MAX_TOP_LOGPROBS)
                              .total));
    /* batch metadata (cuda_begin_batch): block tables of a sequence's blocks, or in a decode graph
     * rounded up to a power of two of at least 16 (below 2^14, the largest a graph takes) */
    const int64_t bs = block_size > 0 ? block_size : 16;
    const int64_t blocks = (max_ctx + bs - 1) / bs + 1;
    int64_t graph_blocks = 16;
    while (graph_blocks < blocks) {
        graph_blocks *= 2;
    }
    const int64_t bt = graph_blocks < (1 << 14) ? graph_blocks : blocks;
    return ensure_meta(c, (size_t)(4 * n_tok + 3 * n_seq + 1 + n_seq * bt + n_tok + 8));
}

uint64_t kr_backend_cuda_alloc_count(kr_backend_t be)
{
    return ctx_of(be)->n_alloc;
}

uint64_t kr_backend_cuda_overlap_count(kr_backend_t be)
{
    return ctx_of(be)->n_overlap;
}

/* ---- batch -------------------------------------------------------------------------------- */

/* --batch-invariant: the step's token rows and output rows in runs of one kind (matmul_fixed);
 * tok_seq is the token -> sequence map begin_batch stages. A sequence's kind follows from its own
 * chunking, which the engine fixes in this mode (a prompt is cut at multiples of 256 tokens, never
 * one token short of its end; generated tokens run one a step), as the attention's choice of path
 * does. */
static enum kr_status inv_rows(struct cuda_ctx *c, const struct kr_batch *b, const int32_t *tok_seq)
{
    const int32_t need = (b->n_seq > b->n_out ? b->n_seq : b->n_out) + 1;
    if (need > c->inv_cap) {
        struct inv_run *t = realloc(c->inv_tok, (size_t)need * sizeof *t), *o = NULL;
        if (t) {
            c->inv_tok = t;
            o = realloc(c->inv_out, (size_t)need * sizeof *o);
        }
        if (!t || !o) {
            KR_LOG_ERROR("cuda: out of host memory for the step's row kinds");
            return KR_ERR_NOMEM;
        }
        c->inv_out = o;
        c->inv_cap = need;
    }
    c->n_inv_tok = c->n_inv_out = 0;
    for (int32_t s = 0; s < b->n_seq; s++) {
        const int32_t r0 = b->seq_tok0[s], r1 = b->seq_tok0[s + 1];
        const bool dec = r1 - r0 == 1;
        if (r1 == r0) {
            continue;
        }
        if (c->n_inv_tok > 0 && c->inv_tok[c->n_inv_tok - 1].dec == dec) {
            c->inv_tok[c->n_inv_tok - 1].r1 = r1;
        } else {
            c->inv_tok[c->n_inv_tok++] = (struct inv_run){.r0 = r0, .r1 = r1, .dec = dec};
        }
    }
    for (int32_t i = 0; i < b->n_out; i++) {
        const int32_t q = tok_seq[b->out_tok[i]];
        const bool dec = b->seq_tok0[q + 1] - b->seq_tok0[q] == 1;
        if (c->n_inv_out > 0 && c->inv_out[c->n_inv_out - 1].dec == dec) {
            c->inv_out[c->n_inv_out - 1].r1 = i + 1;
        } else {
            c->inv_out[c->n_inv_out++] = (struct inv_run){.r0 = i, .r1 = i + 1, .dec = dec};
        }
    }
    c->inv_step = true;
    return KR_OK;
}

static enum kr_status cuda_begin_batch(kr_backend_t be, const struct kr_batch *b)
{
    struct cuda_ctx *c = ctx_of(be);
    if (c->failed) {
        KR_LOG_ERROR("cuda: the device hit an unrecoverable error earlier; refusing work");
        return KR_ERR_CUDA;
    }
    KR_TRY(on_device(c));
    if (c->comm && !kr_cuda_comm_ok(c->comm, c->rank)) {
        return KR_ERR_CANCELLED; /* the group is finished */
    }
    const size_t nt = (size_t)b->n_tok, ns = (size_t)b->n_seq, bt = ns * (size_t)b->max_blocks;
    const size_t total = 5 * nt + 3 * ns + 1 + bt + (size_t)b->n_out + 8;
    KR_TRY(ensure_meta(c, total));
    /* The previous step's upload from this pinned buffer is asynchronous and waits behind that
     * step's predecessor on the stream. A step with no output rows (a prefill chunk that is not a
     * prompt's last) ends with no synchronization, so the host reaches here while its upload may
     * not have run yet: rewriting the buffer now would hand that step this step's arrays (wrong
     * positions, a shifted layout when the token count differs: state slots read from the wrong
     * place, an illegal address). Wait for it; the host still runs one step ahead. */
    if (c->meta_pending) {
        CU_TRY(c, cudaEventSynchronize(c->ev_meta));
        c->meta_pending = false;
    }
    int32_t *h = c->h_meta;
    size_t off = 0;
    int32_t max_tok = 0, max_ctx = 0;
#define PUT(src, count)                                                                            \
    do {                                                                                           \
        if ((count) > 0) {                                                                         \
            memcpy(h + off, (src), (size_t)(count) * 4);                                           \
        }                                                                                          \
        off += (size_t)(count);                                                                    \
    } while (0)
    const size_t o_tokens = off;
    PUT(b->tokens, nt);
    const size_t o_pos = off;
    PUT(b->pos, nt);
    const size_t o_tok_seq = off;
    for (int32_t s = 0; s < b->n_seq; s++) {
        for (int32_t t = b->seq_tok0[s]; t < b->seq_tok0[s + 1]; t++) {
            h[off + (size_t)t] = s;
        }
        const int32_t len = b->seq_tok0[s + 1] - b->seq_tok0[s];
        max_tok = len > max_tok ? len : max_tok;
        const int32_t ctx = b->seq_pos0[s] + len;
        max_ctx = ctx > max_ctx ? ctx : max_ctx;
    }
    off += nt;
    const size_t o_tok0 = off;
    PUT(b->seq_tok0, ns + 1);
    const size_t o_pos0 = off;
    PUT(b->seq_pos0, ns);
    const size_t o_slot = off;
    PUT(b->seq_slot, ns);
    const size_t o_bt = off;
    PUT(b->block_table, bt);
    const size_t o_out = off;
    PUT(b->out_tok, (size_t)b->n_out);
    const size_t o_keep = off;
    if (b->tok_state_slot) { /* the Mamba states kept per token (speculative decoding's verification) */
        PUT(b->tok_state_slot, nt);
    }
#undef PUT
    if (off) {
        CU_TRY(c, cudaMemcpyAsync(c->d_meta, h, off * 4, cudaMemcpyHostToDevice, c->stream));
        CU_TRY(c, cudaEventRecord(c->ev_meta, c->stream));
        c->meta_pending = true;
    }
    int32_t *d = c->d_meta;
    c->hb = b;
    c->batch = (struct krk_batch){.n_tok = b->n_tok, .n_seq = b->n_seq, .tokens = d + o_tokens, .pos = d + o_pos,
                                  .tok_seq = d + o_tok_seq, .seq_tok0 = d + o_tok0, .seq_pos0 = d + o_pos0,
                                  .seq_slot = d + o_slot, .block_table = d + o_bt, .max_blocks = b->max_blocks,
                                  .max_seq_tok = max_tok, .max_ctx = max_ctx,
                                  .tok_keep = b->tok_state_slot ? d + o_keep : NULL};
    c->d_out_tok = d + o_out;
    return c->invariant && (c->inv_skinny || c->inv_class) ? inv_rows(c, b, h + o_tok_seq) : KR_OK;
}

/* Every op starts here: a backend whose device failed refuses work. */
static enum kr_status op_enter(struct cuda_ctx *c)
{
    return c->failed ? KR_ERR_CUDA : KR_OK;
}

/* The device's part of a launch: the stream, the step's batch, the scratch and the tuning variants
 * (no events: the ops that time phases or overlap add theirs). */
static struct krk_ctx launch_ctx(const struct cuda_ctx *c)
{
    return (struct krk_ctx){.stream = c->stream, .batch = c->batch, .workspace = c->scratch,
                            .workspace_bytes = c->scratch_size, .dsa_score = c->dsa_score,
                            .mla_attn = c->mla_attn, .batch_invariant = c->invariant};
}

/* Rows up to this many take krk_gemv (fp32 x), more take cuBLAS (bf16 x): on an H200 the GEMV reads
 * the decode step's weights faster at n = 1 (3.92 vs 4.28 ms a Nemotron-H-8B step), 1-2 % slower at
 * n = 2 (4.40 vs 4.30) and far slower from n = 3 (bench_gemv, docs/PERF.md). */
#define GEMV_ROWS 1
/* Rows from 2 up to this many take krk_skinny (bf16 tensor cores, each weight streamed once, x from
 * the bf16 copy an op wrote); more take cuBLAS. In decode steps of the Nemotron-H-8B shape it beat
 * cuBLAS by 2.5-3.5 % at 2 rows and was 0.3-1 % slower at 16 (docs/PERF.md). */
#define SKINNY_MAX_DEFAULT 8

/* The switch table (util/switches.h) states the kernel library's bounds and enum values without
 * including krk.h: they must agree. */
_Static_assert(SKINNY_MAX_DEFAULT == KR_SKINNY_MAX_DEFAULT, "KRAIT_SKINNY_MAX default");
_Static_assert(KRK_SKINNY_MAX_N == KR_SKINNY_MAX_N, "KRAIT_SKINNY_MAX range");
_Static_assert((int)KRK_MLA_ATTN_PER_HEAD == (int)KR_MLA_ATTN_PER_HEAD &&
                   (int)KRK_MLA_ATTN_HEADS == (int)KR_MLA_ATTN_HEADS &&
                   (int)KRK_DSA_SCORE_FP32 == (int)KR_DSA_SCORE_FP32 &&
                   (int)KRK_DSA_SCORE_MMA == (int)KR_DSA_SCORE_MMA,
               "KRAIT_MLA_ATTN and KRAIT_DSA_SCORE values");

/* GEMMs of more than GEMV_ROWS rows read bf16 operands: the forward pass asks the ops writing their
 * inputs for the bf16 copies (out_bf16) at those row counts only. */
static bool cuda_bf16_operands(kr_backend_t be, int64_t n)
{
    return n > GEMV_ROWS || ctx_of(be)->invariant;
}

/* ---- ops ---------------------------------------------------------------------------------- */

static enum kr_status cuda_embed_impl(kr_backend_t be, const struct kr_tensor *w, int64_t row0, float *out)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    if (w->dtype != KR_DTYPE_BF16) {
        KR_LOG_ERROR("cuda: the embedding must be bf16 on the device");
        return KR_ERR_UNSUPPORTED;
    }
    return krk_embed(w->data, c->batch.tokens, c->batch.n_tok, w->cols, row0, w->rows, out, c->stream);
}

static enum kr_status cuda_rmsnorm_impl(kr_backend_t be, const struct krk_rmsnorm_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    return krk_rmsnorm(p, c->stream);
}

static enum kr_status cuda_layernorm_impl(kr_backend_t be, const struct krk_layernorm_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    return krk_layernorm(p, c->stream);
}

static enum kr_status cuda_scale_impl(kr_backend_t be, float *y, float s, int64_t n)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    return krk_scale(y, s, n, c->stream);
}

/* The DSA indexer's FP8 path: krk_fp8_round is the CPU reference's fp8_round bit for bit (tested);
 * it always applies the Hadamard transform, as the indexer does. */
static enum kr_status cuda_fp8_round_impl(kr_backend_t be, const struct krk_fp8_round_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    if (!p->hadamard) {
        return KR_ERR_UNSUPPORTED;
    }
    if (p->n < 0 || p->ld < p->dim || p->dim < 32 || p->dim > 1024 || (p->dim & (p->dim - 1)) != 0 ||
        p->block < 1 || p->dim % p->block != 0 || p->block * 32 < p->dim) {
        return KR_ERR_INVAL;
    }
    if (p->n == 0) {
        return KR_OK;
    }
    KR_TRY(op_enter(c));
    return krk_fp8_round(p, c->stream);
}

static enum kr_status cuda_set_batch_invariant(kr_backend_t be, bool on, struct kr_err *err)
{
    struct cuda_ctx *c = ctx_of(be);
    if (on && be->fp8_weights) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED,
                          "--batch-invariant with FP8 weights (--quantization fp8): the GPU's FP8 products choose "
                          "their kernel by the row count; serve the bf16 weights");
    }
    if (on && be->tp_size > 1) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED,
                          "--batch-invariant with tensor parallelism on GPUs: the all-reduces' summation order "
                          "follows the message size (peer kernels or NCCL's algorithm), so the step's size would "
                          "show in the results; serve on one GPU");
    }
    c->invariant = on;
    /* the per-head MLA kernel tiles every token's keys from position 0 whatever the step; the
     * head-batched one splits them by the step's size */
    c->mla_attn = on ? KRK_MLA_ATTN_PER_HEAD : c->mla_attn_sw;
    return KR_OK;
}

/* FP8 weights: products through matmul_fp8, the experts through krk_moe_experts's FP8 path. */
static bool cuda_fp8_matmul(kr_backend_t be)
{
    (void)be;
    return true;
}

static enum kr_status cuda_add(kr_backend_t be, float *y, const float *x, int64_t n)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    return krk_add(y, x, n, c->stream);
}

static bool overlaps(const void *a, size_t an, const void *b, size_t bn)
{
    const char *pa = a, *pb = b;
    return pa < pb + bn && pb < pa + an;
}

/* x as bf16 for a tensor-core product (struct krk_bf16_in): the copy the op that wrote x filled, else a
 * cast of x into the caller's room (or into the backend's staging when there is none). `used` (or
 * NULL) receives the operand read, filled, for the next product of the same x within the op. */
static enum kr_status bf16_x(struct cuda_ctx *c, const float *x, int64_t ldx, int64_t n, int64_t cols,
                             const struct krk_bf16_in *in, const krk_bf16 **xb, int64_t *ldb,
                             struct krk_bf16_in *used)
{
    if (in && in->filled && in->data && in->ld >= cols) {
        *xb = in->data;
        *ldb = in->ld;
    } else {
        krk_bf16 *dst = in && in->data && in->cap >= n * cols ? in->data : NULL;
        if (!dst) {
            KR_TRY(ensure_xb(c, (size_t)(n * cols)));
            dst = c->xb;
        }
        KR_TRY(krk_cast_bf16(x, ldx, n, cols, dst, c->stream));
        *xb = dst;
        *ldb = cols;
    }
    if (used) {
        *used = (struct krk_bf16_in){.data = (krk_bf16 *)*xb, .ld = *ldb, .cap = n * *ldb, .filled = true};
    }
    return KR_OK;
}

/* Weights krk_skinny takes for n rows of x: bf16, 16-byte aligned, columns a multiple of its step. */
static bool skinny_takes(const struct cuda_ctx *c, int64_t n, const struct kr_tensor *w)
{
    return !c->invariant && n >= 2 && n <= c->skinny_max && n <= KRK_SKINNY_MAX_N && w->dtype == KR_DTYPE_BF16 &&
           w->cols % krk_skinny_cols_step(0) == 0 && ((uintptr_t)w->data & 15) == 0;
}

/* One krk_skinny launch over k parts (their weights share cols); KR_ERR_UNSUPPORTED when the
 * workspace is too small for their rows (the caller takes cuBLAS). */
static enum kr_status skinny_run(struct cuda_ctx *c, const float *x, int64_t ldx, int64_t n, int k,
                                 const struct kr_matmul_part *parts, enum kr_act act, float *act_out,
                                 const struct krk_bf16_in *in, struct krk_bf16_in *used)
{
    struct krk_skinny_params p = {.n = n, .cols = parts[0].w->cols, .n_parts = k, .ws = c->sk_ws,
                                  .ws_bytes = c->sk_ws_size, .act_out = act_out, .act = (int)act};
    for (int i = 0; i < k; i++) {
        p.parts[i] = (struct krk_gemv_part){.w = parts[i].w->data, .bias = parts[i].bias, .rows = parts[i].w->rows,
                                            .y = parts[i].y, .ldy = parts[i].ldy};
    }
    p.ld_act = act_out ? parts[0].w->rows : 0;
    if (krk_skinny_ws_bytes(krk_skinny_tile_rows(&p)) > c->sk_ws_size) {
        return KR_ERR_UNSUPPORTED;
    }
    int64_t ldb = 0;
    KR_TRY(bf16_x(c, x, ldx, n, p.cols, in, &p.xb, &ldb, used));
    if (ldb % 8 != 0) {
        return KR_ERR_UNSUPPORTED;
    }
    p.ldxb = ldb;
    return krk_skinny(&p, c->stream);
}

static struct krk_fp8_weight fp8_weight(const struct kr_tensor *w)
{
    return (struct krk_fp8_weight){.q = w->data, .scale = w->scale, .rows = w->rows, .cols = w->cols,
                                   .ld_s = (w->cols + w->block_c - 1) / w->block_c, .block_r = w->block_r,
                                   .block_c = w->block_c};
}

/* Rows [t0, t0 + n) of x quantized per block of the weight's columns (codes into q [.., ldq], scales
 * into s [nkb, n]), then the tensor-core skinny product into the same rows of y. */
static enum kr_status fp8_rows_skinny(struct cuda_ctx *c, const float *x, int64_t ldx, int64_t t0, int64_t n,
                                      const struct krk_fp8_weight *fw, bool ue8m0, const float *bias, float *y,
                                      int64_t ldy, uint8_t *q, int64_t ldq, float *s)
{
    const struct krk_fp8_quant_params qp = {.x = x + t0 * ldx, .ldx = ldx, .n = n, .cols = fw->cols,
                                            .block = fw->block_c, .q = q + t0 * ldq, .ldq = ldq, .scale = s,
                                            .s_ld = n, .ue8m0 = ue8m0};
    KR_TRY(krk_fp8_quant(&qp, c->stream));
    const struct krk_fp8_mm_params mp = {.q = q + t0 * ldq, .ldq = ldq, .scale = s, .s_ld = n, .n = n, .w = *fw,
                                         .bias = bias, .y = y + t0 * ldy, .ldy = ldy};
    return krk_fp8_skinny(&mp, c->stream);
}

/* A product with an FP8 weight (model/fp8.h's recipe): the rows of x quantized per block of the
 * weight's columns, then
 *  - weights in 128-column blocks (krk_fp8_skinny_takes): up to fp8_skinny_max rows on the tensor-core
 *    skinny kernel; more on cuBLASLt's block-scaled matmul in a multiple of 4 rows (the rows its
 *    heuristic takes), the rest on the skinny kernel;
 *  - other blocks: cuBLASLt where it takes the shape (n a multiple of 4), else the CUDA-core kernel
 *    on the dequantized activations (the tiny checkpoints' 64-wide matrices). */
static enum kr_status matmul_fp8(struct cuda_ctx *c, const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w,
                                 const float *bias, float *y, int64_t ldy)
{
    if (!w->scale || w->block_r < 1 || w->block_c < 1) {
        KR_LOG_ERROR("cuda: an FP8 weight [%lld, %lld] without its block scales", (long long)w->rows,
                     (long long)w->cols);
        return KR_ERR_INVAL;
    }
    const struct krk_fp8_weight fw = fp8_weight(w);
    const bool sk = krk_fp8_skinny_takes(&fw);
    int64_t n_lt = n & ~(int64_t)3;
    if (!c->lt || n <= c->fp8_skinny_max || !krk_fp8_lt_takes(&fw, n_lt) || (!sk && n_lt != n)) {
        n_lt = 0;
    }
    if (sk || n_lt > 0) {
        const int64_t ldq = (fw.cols + 15) / 16 * 16;
        KR_TRY(ensure_f8(c, f8_lt_bytes(n, fw.cols, fw.block_c)));
        uint8_t *q = c->f8;
        float *s = (float *)((char *)c->f8 + align256((size_t)(n * ldq)));
        if (n_lt > 0) {
            const struct krk_fp8_quant_params qp = {.x = x, .ldx = ldx, .n = n_lt, .cols = fw.cols,
                                                    .block = fw.block_c, .q = q, .ldq = ldq, .scale = s,
                                                    .s_ld = n_lt, .ue8m0 = w->act_ue8m0};
            KR_TRY(krk_fp8_quant(&qp, c->stream));
            const struct krk_fp8_mm_params mp = {.q = q, .ldq = ldq, .scale = s, .s_ld = n_lt, .n = n_lt, .w = fw,
                                                 .bias = bias, .y = y, .ldy = ldy};
            const enum kr_status st = krk_fp8_gemm_lt(c->lt, &mp, c->stream);
            if (st == KR_ERR_UNSUPPORTED) {
                n_lt = 0; /* no algorithm for the shape: every row on the other kernels */
            } else if (st != KR_OK) {
                return st;
            }
        }
        if (n_lt < n && sk) {
            return fp8_rows_skinny(c, x, ldx, n_lt, n - n_lt, &fw, w->act_ue8m0, bias, y, ldy, q, ldq,
                                   s + (size_t)(fw.ld_s * n_lt));
        }
        if (n_lt == n && n > 0) {
            return KR_OK;
        }
    }
    const int64_t ldxq = (fw.cols + 3) / 4 * 4;
    KR_TRY(ensure_f8(c, (size_t)(n * ldxq) * 4));
    float *xq = c->f8;
    const struct krk_fp8_quant_params qp = {.x = x, .ldx = ldx, .n = n, .cols = fw.cols, .block = fw.block_c,
                                            .xq = xq, .ldxq = ldxq, .ue8m0 = w->act_ue8m0};
    KR_TRY(krk_fp8_quant(&qp, c->stream));
    const struct krk_fp8_gemv_params gp = {.xq = xq, .ldx = ldxq, .n = n, .w = fw, .bias = bias, .y = y, .ldy = ldy};
    return krk_fp8_gemv(&gp, c->stream);
}

/* --batch-invariant: the bf16 weights krk_skinny takes (configuration 0, 256-column steps, 16-byte
 * aligned), by the weight alone. In a process reserved for at most INV_SKINNY_SEQS sequences a
 * step, their decode rows run on it, in passes of up to KRK_SKINNY_MAX_N rows: a row is summed in
 * the same order whatever n (krk/gemm.h) and reads the weights about as fast as a plain decode
 * step's products, where cuBLASLt's one algorithm for every row count streams them 10-20 % slower
 * than the GEMV at one row (docs/PERF.md). Prefill rows (sequences of two tokens or more in the
 * step) stay on krk_fixed_gemm, which reads each weight once for all of them. A row's kind is its
 * sequence's, fixed by the engine's chunking in this mode, so each token always takes the same
 * kernel. */
static bool skinny_fixed_takes(const struct kr_tensor *w)
{
    return w->dtype == KR_DTYPE_BF16 && w->cols >= krk_skinny_cols_step(0) && w->cols % krk_skinny_cols_step(0) == 0 &&
           ((uintptr_t)w->data & 15) == 0;
}

/* --batch-invariant with KRAIT_STREAM_GEMM=1, in a process reserved for at most KRK_STREAM_MAX_N
 * sequences a step: the bf16 weights whose decode rows run on krk_stream_gemm in one token class
 * (inv_class for every n, so a row's bits do not depend on the rows beside it), by the weight
 * alone (x is cast again where its copy does not suit). */
static bool stream_fixed_takes(const struct kr_tensor *w)
{
    return w->dtype == KR_DTYPE_BF16 && krk_stream_takes(w->data, w->rows, w->cols, w->data, w->cols, 1);
}

/* --batch-invariant products: decode rows on krk_stream_gemm or krk_skinny (above), else
 * krk_fixed_gemm for every row count (fp32 weights on fp32 x, bf16 on the bf16 copy of x), so that
 * a row's result does not depend on the rows beside it. */
static enum kr_status matmul_fixed(struct cuda_ctx *c, const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w,
                                   const float *bias, float *y, int64_t ldy, const struct krk_bf16_in *in,
                                   struct krk_bf16_in *used)
{
    if (w->dtype != KR_DTYPE_F32 && w->dtype != KR_DTYPE_BF16) {
        KR_LOG_ERROR("cuda: --batch-invariant products take bf16 or fp32 weights, not %s", kr_dtype_name(w->dtype));
        return KR_ERR_UNSUPPORTED;
    }
    if (!c->fixed || n > c->fixed_max_n) {
        KR_LOG_ERROR("cuda: --batch-invariant product of %lld rows, beyond the %lld reserved", (long long)n,
                     (long long)c->fixed_max_n);
        return KR_ERR_UNSUPPORTED;
    }
    const bool on_stream = c->inv_class > 0 && stream_fixed_takes(w);
    if (on_stream || (c->inv_skinny && skinny_fixed_takes(w))) {
        struct krk_skinny_params sp = {.cols = w->cols, .n_parts = 1, .ws = c->sk_ws, .ws_bytes = c->sk_ws_size};
        sp.parts[0] = (struct krk_gemv_part){.w = w->data, .bias = bias, .rows = w->rows, .ldy = ldy};
        if (!on_stream && (!c->sk_ws || krk_skinny_ws_bytes(krk_skinny_tile_rows(&sp)) > c->sk_ws_size)) {
            KR_LOG_ERROR("cuda: --batch-invariant product of a %lldx%lld weight without its workspace reserved",
                         (long long)w->rows, (long long)w->cols);
            return KR_ERR_INTERNAL;
        }
        const krk_bf16 *xb = NULL;
        int64_t ldb = w->cols;
        KR_TRY(bf16_x(c, x, ldx, n, w->cols, in, &xb, &ldb, used));
        if (ldb % 8 != 0 || ((uintptr_t)xb & 15) != 0) { /* the op's copy does not suit: cast again (same bits) */
            KR_TRY(bf16_x(c, x, ldx, n, w->cols, NULL, &xb, &ldb, NULL));
        }
        /* the step's runs of rows when this product's rows are its tokens or its outputs; prefill
         * rows take krk_fixed_gemm when the runs' offsets keep y's alignment (its algorithm is kept
         * per alignment), else every row takes krk_skinny */
        const struct inv_run all = {.r0 = 0, .r1 = (int32_t)n, .dec = true};
        const struct inv_run *runs = &all;
        int32_t n_runs = 1;
        if (c->inv_step && c->hb && (ldy * 4) % 16 == 0 && c->hb->n_tok > 0) {
            if (n == c->hb->n_tok) {
                runs = c->inv_tok;
                n_runs = c->n_inv_tok;
            } else if (n == c->hb->n_out) {
                runs = c->inv_out;
                n_runs = c->n_inv_out;
            }
        }
        for (int32_t k = 0; k < n_runs; k++) {
            const int64_t a = runs[k].r0, e = runs[k].r1;
            if (!runs[k].dec) {
                const struct krk_fixed_gemm_params fp = {.w = w->data, .x = xb + a * ldb, .ldx = ldb, .y = y + a * ldy,
                                                         .ldy = ldy, .rows = w->rows, .cols = w->cols, .n = e - a};
                KR_TRY(krk_fixed_gemm(c->fixed, &fp, c->stream));
                KR_TRY(bias ? krk_add_bias(y + a * ldy, ldy, bias, e - a, w->rows, c->stream) : KR_OK);
                continue;
            }
            if (on_stream) {
                if (overlaps(y, (size_t)(n * ldy) * 4, xb, (size_t)(n * ldb) * 2)) {
                    KR_LOG_ERROR("cuda: --batch-invariant product whose output overlaps its bf16 input");
                    return KR_ERR_INTERNAL;
                }
                const int64_t pass = c->inv_class;
                for (int64_t r0 = a; r0 < e; r0 += pass) {
                    const struct krk_stream_params stp = {
                        .w = w->data, .x = xb + r0 * ldb, .ldx = ldb, .bias = bias, .y = y + r0 * ldy, .ldy = ldy,
                        .rows = w->rows, .cols = w->cols, .n = e - r0 < pass ? e - r0 : pass, .ws = c->st_ws,
                        .ws_bytes = c->st_ws_size, .n_class = c->inv_class};
                    KR_TRY(krk_stream_gemm(&stp, c->stream));
                }
                continue;
            }
            for (int64_t r0 = a; r0 < e; r0 += KRK_SKINNY_MAX_N) {
                sp.xb = xb + r0 * ldb;
                sp.ldxb = ldb;
                sp.n = e - r0 < KRK_SKINNY_MAX_N ? e - r0 : KRK_SKINNY_MAX_N;
                sp.parts[0].y = y + r0 * ldy;
                KR_TRY(krk_skinny(&sp, c->stream));
            }
        }
        return KR_OK;
    }
    struct krk_fixed_gemm_params p = {.w = w->data, .x = x, .ldx = ldx, .y = y, .ldy = ldy, .rows = w->rows,
                                      .cols = w->cols, .n = n, .f32 = w->dtype == KR_DTYPE_F32};
    if (!p.f32) {
        const krk_bf16 *xb = NULL;
        int64_t ldb = w->cols;
        KR_TRY(bf16_x(c, x, ldx, n, w->cols, in, &xb, &ldb, used));
        p.x = xb;
        p.ldx = ldb;
    }
    KR_TRY(krk_fixed_gemm(c->fixed, &p, c->stream));
    return bias ? krk_add_bias(y, ldy, bias, n, w->rows, c->stream) : KR_OK;
}

/* Fewest rows krk_stream_gemm takes here (with KRAIT_STREAM_GEMM=1); fewer take krk_gemv and
 * krk_skinny (KRAIT_SKINNY_MAX) or cuBLAS. */
#define STREAM_MIN_ROWS 9

/* Whether plain products of n rows try krk_tuned_gemm: single-device backends only (timing
 * synchronizes the stream, which a tensor-parallel rank must not do between its collectives), not
 * under --batch-invariant (whose products keep one algorithm per shape), and not for the counts
 * krk_stream_gemm takes (a weight it refuses then gets cuBLAS's own choice). */
static bool tuned_takes(const struct cuda_ctx *c, int64_t n)
{
    return c->tuned && !c->comm && !c->invariant && n >= KRK_TUNED_MIN_N && n <= KRK_TUNED_MAX_N &&
           !(c->st_ws && n <= KRK_STREAM_MAX_N);
}

/* One product; `used` (or NULL) receives the bf16 operand it read (filled: false when none).
 * The matmul ops are a dispatch rather than a translation of one struct: the engine names a weight
 * tensor, and the kernel is chosen here by rows and weight (fp32 weights: cuBLAS SGEMM; one row:
 * krk_gemv; 2..skinny_max rows: krk_skinny; up to KRK_STREAM_MAX_N rows: krk_stream_gemm where it
 * takes the operands; up to KRK_TUNED_MAX_N rows: krk_tuned_gemm where it
 * takes the weight; more: cuBLAS on bf16 operands), each kernel with a struct
 * of its own (tiling, workspace, parts) that no other backend has. */
static enum kr_status matmul_one(struct cuda_ctx *c, const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w,
                                 const float *bias, float *y, int64_t ldy, const struct krk_bf16_in *in,
                                 struct krk_bf16_in *used)
{
    if (used) {
        used->filled = false;
    }
    if (c->failed) {
        return KR_ERR_CUDA;
    }
    if (n <= 0) {
        return KR_OK;
    }
    const int64_t rows = w->rows, cols = w->cols;
    enum kr_status st = KR_OK;
    if (w->dtype == KR_DTYPE_F32 && !c->invariant) {
        /* full-precision weights (routers of mixed checkpoints): fp32 GEMM, no TF32 */
        const float one = 1.0f, zero = 0.0f;
        BLAS_TRY(cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, (int)n, (int)cols, &one, w->data,
                             (int)cols, x, (int)ldx, &zero, y, (int)ldy));
        st = bias ? krk_add_bias(y, ldy, bias, n, rows, c->stream) : KR_OK;
    } else if (c->invariant) {
        st = matmul_fixed(c, x, ldx, n, w, bias, y, ldy, in, used);
    } else if (w->dtype == KR_DTYPE_F8_E4M3) {
        st = matmul_fp8(c, x, ldx, n, w, bias, y, ldy);
    } else if (w->dtype != KR_DTYPE_BF16) {
        KR_LOG_ERROR("cuda: matmul weight of dtype %s", kr_dtype_name(w->dtype));
        return KR_ERR_UNSUPPORTED;
    } else if (n <= GEMV_ROWS && cols % 8 == 0) { /* (not with c->invariant: taken above) */
        struct krk_gemv_params p = {.x = x, .ldx = ldx, .w = w->data, .bias = bias, .n = n, .rows = rows,
                                    .cols = cols, .y = y, .ldy = ldy};
        st = krk_gemv(&p, c->stream);
    } else {
        if (skinny_takes(c, n, w)) {
            const struct kr_matmul_part part = {.w = w, .bias = bias, .y = y, .ldy = ldy};
            st = skinny_run(c, x, ldx, n, 1, &part, KR_ACT_RELU2, NULL, in, used);
            if (st != KR_ERR_UNSUPPORTED) {
                return st;
            }
            if (used && used->filled) { /* rounded already, but rows the kernel cannot take: cuBLAS */
                in = used;
            }
        }
        const krk_bf16 *xb = NULL;
        int64_t ldb = cols;
        KR_TRY(bf16_x(c, x, ldx, n, cols, in, &xb, &ldb, used));
        if (c->st_ws && n >= STREAM_MIN_ROWS && krk_stream_takes(w->data, rows, cols, xb, ldb, n) &&
            !overlaps(y, (size_t)(n * ldy) * 4, xb, (size_t)(n * ldb) * 2)) {
            /* decode-sized: the weight streamed once through tensor copies into wgmma */
            const struct krk_stream_params sp = {.w = w->data, .x = xb, .ldx = ldb, .bias = bias, .y = y,
                                                 .ldy = ldy, .rows = rows, .cols = cols, .n = n,
                                                 .ws = c->st_ws, .ws_bytes = c->st_ws_size};
            st = krk_stream_gemm(&sp, c->stream);
            if (st != KR_ERR_UNSUPPORTED) {
                return st;
            }
        }
        if (tuned_takes(c, n)) { /* decode-sized: the algorithm timed fastest for the shape and class */
            const struct krk_fixed_gemm_params tp = {.w = w->data, .x = xb, .ldx = ldb, .y = y, .ldy = ldy,
                                                     .rows = rows, .cols = cols, .n = n};
            st = krk_tuned_gemm(c->tuned, &tp, c->stream);
            if (st != KR_ERR_UNSUPPORTED) {
                return st == KR_OK && bias ? krk_add_bias(y, ldy, bias, n, rows, c->stream) : st;
            }
        }
        const float one = 1.0f, zero = 0.0f;
        BLAS_TRY(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, (int)n, (int)cols, &one, w->data,
                              CUDA_R_16BF, (int)cols, xb, CUDA_R_16BF, (int)ldb, &zero, y, CUDA_R_32F, (int)ldy,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        st = bias ? krk_add_bias(y, ldy, bias, n, rows, c->stream) : KR_OK;
    }
    return st;
}

static enum kr_status cuda_matmul_impl(kr_backend_t be, const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w,
                                       const float *bias, float *y, int64_t ldy, const struct krk_bf16_in *xb)
{
    return matmul_one(ctx_of(be), x, ldx, n, w, bias, y, ldy, xb, NULL);
}

/* Weights that one krk_gemv launch can take for n rows of x (bf16, cols a multiple of 8). */
static bool gemv_takes(const struct cuda_ctx *c, int64_t n, const struct kr_tensor *w)
{
    return !c->invariant && n <= GEMV_ROWS && w->dtype == KR_DTYPE_BF16 && w->cols % 8 == 0 && ((uintptr_t)w->data & 15) == 0;
}

/* Decode rows: the products run as one GEMV launch (the small projections of one input then fill the
 * GPU together); otherwise one matmul after the other. */
static enum kr_status cuda_matmul_multi_impl(kr_backend_t be, const float *x, int64_t ldx, int64_t n, int k,
                                             const struct kr_matmul_part *parts, const struct krk_bf16_in *xb)
{
    struct cuda_ctx *c = ctx_of(be);
    if (c->failed) {
        return KR_ERR_CUDA;
    }
    bool fused = n > 0 && k >= 1 && k <= KRK_GEMV_MAX_PARTS, sk = fused;
    for (int i = 0; (fused || sk) && i < k; i++) {
        const struct kr_matmul_part *q = &parts[i];
        const bool ok = q->w->cols == parts[0].w->cols && q->ldy >= q->w->rows &&
                        !overlaps(q->y, (size_t)(n * q->ldy) * 4, x, (size_t)(n * ldx) * 4);
        fused = fused && ok && gemv_takes(c, n, q->w);
        sk = sk && ok && skinny_takes(c, n, q->w);
    }
    struct krk_bf16_in cur = xb ? *xb : (struct krk_bf16_in){0}, used = {0};
    if (sk && k > 1) {
        const enum kr_status st = skinny_run(c, x, ldx, n, k, parts, KR_ACT_RELU2, NULL, &cur, &used);
        if (st != KR_ERR_UNSUPPORTED) {
            return st;
        }
        cur = used.filled ? used : cur;
    }
    if (!fused) { /* one product after the other, x rounded to bf16 once */
        for (int i = 0; i < k; i++) {
            KR_TRY(matmul_one(c, x, ldx, n, parts[i].w, parts[i].bias, parts[i].y, parts[i].ldy, &cur, &used));
            cur = used.filled ? used : cur;
        }
        return KR_OK;
    }
    struct krk_gemv_params p = {.x = x, .ldx = ldx, .w = parts[0].w->data, .bias = parts[0].bias, .n = n,
                                .rows = parts[0].w->rows, .cols = parts[0].w->cols, .y = parts[0].y,
                                .ldy = parts[0].ldy, .n_more = k - 1};
    for (int i = 1; i < k; i++) {
        p.more[i - 1] = (struct krk_gemv_part){.w = parts[i].w->data, .bias = parts[i].bias,
                                               .rows = parts[i].w->rows, .y = parts[i].y, .ldy = parts[i].ldy};
    }
    return krk_gemv(&p, c->stream);
}

static enum kr_status cuda_act_impl(kr_backend_t be, const struct krk_act_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    return krk_act(p, c->stream);
}

/* Decode rows: the activation is written by the GEMV's epilogue from the value it stores in y; a few
 * rows: by the skinny kernel's epilogue, and out_bf16 rounded from out after it (the cast the next
 * product would make). */
static enum kr_status cuda_matmul_act_impl(kr_backend_t be, const float *x, int64_t ldx, int64_t n,
                                           const struct kr_tensor *w, const float *bias, float *y, int64_t ldy,
                                           enum kr_act act, float *out, krk_bf16 *out_bf16,
                                           const struct krk_bf16_in *xb)
{
    struct cuda_ctx *c = ctx_of(be);
    if (c->failed) {
        return KR_ERR_CUDA;
    }
    if (n > 0 && gemv_takes(c, n, w) && ldy >= w->rows && (int)act >= (int)KR_ACT_RELU2 && (int)act <= (int)KR_ACT_RELU &&
        !overlaps(y, (size_t)(n * ldy) * 4, x, (size_t)(n * ldx) * 4) &&
        !overlaps(out, (size_t)(n * w->rows) * 4, x, (size_t)(n * ldx) * 4) &&
        !overlaps(out, (size_t)(n * w->rows) * 4, y, (size_t)(n * ldy) * 4)) {
        struct krk_gemv_params p = {.x = x, .ldx = ldx, .w = w->data, .bias = bias, .n = n, .rows = w->rows,
                                    .cols = w->cols, .y = y, .ldy = ldy, .act_out = out, .ld_act = w->rows,
                                    .act = (int)act};
        KR_TRY(krk_gemv(&p, c->stream));
        return out_bf16 ? krk_cast_bf16(out, w->rows, n, w->rows, out_bf16, c->stream) : KR_OK;
    }
    if (n > 0 && skinny_takes(c, n, w) && ldy >= w->rows && (int)act >= (int)KR_ACT_RELU2 &&
        (int)act <= (int)KR_ACT_RELU && !overlaps(out, (size_t)(n * w->rows) * 4, y, (size_t)(n * ldy) * 4)) {
        const struct kr_matmul_part part = {.w = w, .bias = bias, .y = y, .ldy = ldy};
        struct krk_bf16_in used = {0};
        const enum kr_status st = skinny_run(c, x, ldx, n, 1, &part, act, out, xb, &used);
        if (st == KR_OK && out_bf16) {
            return krk_cast_bf16(out, w->rows, n, w->rows, out_bf16, c->stream);
        }
        if (st != KR_ERR_UNSUPPORTED) {
            return st;
        }
        xb = used.filled ? &used : xb;
    }
    KR_TRY(cuda_matmul_impl(be, x, ldx, n, w, bias, y, ldy, xb));
    const struct krk_act_params a = {.act = act, .x = y, .ld_in = ldy, .n = n, .width = w->rows, .out = out,
                                     .out_bf16 = out_bf16};
    return cuda_act_impl(be, &a);
}

/* Not TIMED: krk_mamba records the conv's and the SSD's times (and the SSD's phases) itself. */
static enum kr_status cuda_mamba(kr_backend_t be, const struct krk_mamba_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    const size_t ws = krk_ssd_workspace_bytes(c->batch.n_tok, c->batch.n_seq, p->n_head, p->head_dim, p->n_group,
                                              p->d_state, p->chunk);
    if (ws > c->scratch_size) {
        KR_TRY(ensure_scratch(c, ws));
    }
    struct krk_ctx k = launch_ctx(c);
    cudaEvent_t phase_ev[10];
    k.events = prof_phases(c, 0, 5, phase_ev);
    const enum kr_status st = krk_mamba(p, &k);
    static const int phase_cats[5] = {P_CONV, P_SSD, P_SSD_DECODE, P_SSD_BMM, P_SSD_SCAN};
    prof_phases_done(c, k.events, st, phase_cats, 5);
    return st;
}

/* The Mamba kernels keep the states after single tokens (struct krk_batch.tok_keep): the conv's
 * state kernel writes their windows, the SSD runs such a sequence token by token. */
static bool cuda_token_states(kr_backend_t be)
{
    (void)be;
    return true;
}

static enum kr_status cuda_gated_rmsnorm_impl(kr_backend_t be, const struct krk_gated_rmsnorm_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    return krk_gated_rmsnorm(p, c->stream);
}

static enum kr_status cuda_attention_impl(kr_backend_t be, const struct krk_attn_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    size_t ws = krk_attn_workspace_bytes(c->batch.n_tok, p->n_head, p->head_dim);
    if (c->invariant) {
        const size_t inv = krk_attn_workspace_bytes_invariant(c->batch.n_seq, p->n_head, p->head_dim);
        ws = inv > ws ? inv : ws;
    }
    if (ws > c->scratch_size) {
        KR_TRY(ensure_scratch(c, ws));
    }
    const struct krk_ctx k = launch_ctx(c);
    return krk_attn(p, &k);
}

static enum kr_status cuda_moe_route_impl(kr_backend_t be, const struct krk_route_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    return krk_moe_route(p, c->stream);
}

/* The device array of the n tensors' data (or with `scale`, their FP8 block scales), made on first
 * use. The tensors must all be bf16, or all FP8 with the same blocks as t[0]. */
static enum kr_status expert_ptrs(struct cuda_ctx *c, const struct kr_tensor *t, int64_t n, bool scale,
                                  const void *const **out)
{
    *out = NULL;
    if (!t) {
        return KR_OK;
    }
    for (size_t i = 0; i < c->n_ptr_idx; i++) {
        const struct ptr_entry *q = &c->ptr_idx[i];
        if (q->host != t || q->n != n || q->scale != scale) {
            continue;
        }
        int64_t e = 0;
        while (e < n && q->ptrs[e] == (scale ? (const void *)t[e].scale : t[e].data)) {
            e++;
        }
        if (e == n) {
            *out = (const void *const *)(c->ptr_table + q->off);
            return KR_OK;
        }
    }
    for (int64_t e = 0; e < n; e++) {
        const bool fp8 = t[0].dtype == KR_DTYPE_F8_E4M3;
        if (t[e].dtype != t[0].dtype || (t[0].dtype != KR_DTYPE_BF16 && !fp8) ||
            (fp8 && (!t[e].scale || t[e].block_r != t[0].block_r || t[e].block_c != t[0].block_c))) {
            KR_LOG_ERROR("cuda: expert weights must be bf16, or FP8 with their block scales, all alike (expert %lld "
                         "is %s)", (long long)e, kr_dtype_name(t[e].dtype));
            return KR_ERR_UNSUPPORTED;
        }
    }
    if (c->capturing) {
        KR_LOG_ERROR("cuda: expert pointer table filled during graph capture");
        return KR_ERR_INTERNAL;
    }
    if (c->ptr_used + (size_t)n > c->ptr_cap) {
        KR_LOG_ERROR("cuda: more than %zu expert weight tensors", c->ptr_cap);
        return KR_ERR_UNSUPPORTED;
    }
    if (c->n_ptr_idx == c->cap_ptr_idx) {
        const size_t cap = c->cap_ptr_idx ? 2 * c->cap_ptr_idx : 64;
        struct ptr_entry *p = kr_realloc(c->ptr_idx, cap * sizeof *p);
        if (!p) {
            return KR_ERR_NOMEM;
        }
        c->ptr_idx = p;
        c->cap_ptr_idx = cap;
    }
    const void **h = kr_malloc((size_t)n * sizeof *h);
    if (!h) {
        return KR_ERR_NOMEM;
    }
    for (int64_t e = 0; e < n; e++) {
        h[e] = scale ? (const void *)t[e].scale : t[e].data;
    }
    cudaError_t err = cudaMemcpyAsync(c->ptr_table + c->ptr_used, h, (size_t)n * sizeof *h, cudaMemcpyHostToDevice,
                                      c->stream);
    if (err == cudaSuccess) {
        err = cudaStreamSynchronize(c->stream);
    }
    if (err != cudaSuccess) {
        kr_free(h);
    }
    CU_TRY(c, err);
    c->ptr_idx[c->n_ptr_idx++] = (struct ptr_entry){.host = t, .ptrs = h, .n = n, .scale = scale, .off = c->ptr_used};
    *out = (const void *const *)(c->ptr_table + c->ptr_used);
    c->ptr_used += (size_t)n;
    return KR_OK;
}

/* The op's parameters go through as they are; only the weights differ: the engine's arrays of
 * tensors become the device arrays of pointers the kernels read (expert_ptrs, made once per array). */
static enum kr_status cuda_moe_experts_impl(kr_backend_t be, const struct krk_experts_params *p,
                                            const struct kr_expert_weights *w)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    struct krk_expert_ptrs d = {0};
    KR_TRY(expert_ptrs(c, w->gate, p->n_expert, false, &d.gate));
    KR_TRY(expert_ptrs(c, w->up, p->n_expert, false, &d.up));
    KR_TRY(expert_ptrs(c, w->down, p->n_expert, false, &d.down));
    const bool fp8 = w->up[0].dtype == KR_DTYPE_F8_E4M3;
    if (fp8 != (w->down[0].dtype == KR_DTYPE_F8_E4M3) || (w->gate && fp8 != (w->gate[0].dtype == KR_DTYPE_F8_E4M3)) ||
        (fp8 && (w->down[0].block_r != w->up[0].block_r || w->down[0].block_c != w->up[0].block_c))) {
        KR_LOG_ERROR("cuda: an MoE layer's expert matrices mix FP8 and other weights, or FP8 blocks");
        return KR_ERR_UNSUPPORTED;
    }
    if (fp8) {
        const void *const *gs, *const *us, *const *ds;
        KR_TRY(expert_ptrs(c, w->gate, p->n_expert, true, &gs));
        KR_TRY(expert_ptrs(c, w->up, p->n_expert, true, &us));
        KR_TRY(expert_ptrs(c, w->down, p->n_expert, true, &ds));
        d.gate_s = (const float *const *)gs;
        d.up_s = (const float *const *)us;
        d.down_s = (const float *const *)ds;
        d.block_r = w->up[0].block_r;
        d.block_c = w->up[0].block_c;
        d.ue8m0 = w->up[0].act_ue8m0;
        KR_TRY(ensure_f8(c, (size_t)(p->n * p->d_in) * 4));
        d.xq = c->f8;
    }
    const size_t ws = krk_moe_experts_workspace_bytes(p->n, p->n_used, p->d_in, p->d_ffn, p->d_out, fp8);
    if (ws > c->scratch_size) {
        KR_TRY(ensure_scratch(c, ws));
    }
    const struct krk_ctx k = launch_ctx(c);
    return krk_moe_experts(p, &d, &k);
}

static enum kr_status cuda_gather_out_impl(kr_backend_t be, const float *src, int64_t width, float *dst)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    return krk_gather_rows(src, width, c->d_out_tok, c->hb->n_out, dst, c->stream);
}

static enum kr_status cuda_rope_impl(kr_backend_t be, const struct krk_rope_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    const struct krk_ctx k = launch_ctx(c);
    return krk_rope(p, &k);
}

/* Two sets of vectors with the same frequencies in one launch (kr_backend_rope_pair checked that
 * they share them). */
static enum kr_status cuda_rope_pair_impl(kr_backend_t be, const struct krk_rope_params *a,
                                          const struct krk_rope_params *b)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    const struct krk_ctx k = launch_ctx(c);
    return krk_rope_pair(a, b, &k);
}

static enum kr_status cuda_mla_cache_write_impl(kr_backend_t be, const struct krk_mla_cache_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    const struct krk_ctx k = launch_ctx(c);
    return krk_mla_cache_write(p, &k);
}

/* --kv-cache-dtype fp8: K/V as e4m3 bytes, latents as packed fp8_ds_mla rows (krk/ops.h). */
static bool cuda_kv_fp8(kr_backend_t be)
{
    (void)be;
    return true;
}

/* The key side of an MLA / DSA layer (and its q latent's norm) as one kernel; the FP8 round trip of
 * the index key and the packed FP8 cache rows run as the individual ops. */
static enum kr_status cuda_mla_prep_impl(kr_backend_t be, const struct krk_mla_prep_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    const int64_t row = p->kv_lora + p->rope + (p->ik ? p->idx_dim : 0);
    if (p->ik_fp8 || p->cache_fp8 || p->n != c->batch.n_tok || row > KRK_MLA_PREP_MAX_ROW ||
        (p->q_norm && p->q_dim > KRK_MLA_PREP_MAX_ROW)) {
        return KR_ERR_UNSUPPORTED;
    }
    KR_TRY(op_enter(c));
    const struct krk_ctx k = launch_ctx(c);
    return krk_mla_prep(p, &k);
}

static enum kr_status cuda_dsa_index(kr_backend_t be, const struct krk_dsa_index_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    const size_t need1 = krk_dsa_index_workspace_bytes(1, c->batch.max_ctx);
    if (need1 > c->scratch_size) {
        KR_TRY(ensure_scratch(c, need1));
    }
    struct krk_ctx k = launch_ctx(c);
    cudaEvent_t phase_ev[4];
    k.events = prof_phases(c, 1, 2, phase_ev);
    prof_begin(c, P_DSA);
    const enum kr_status st = krk_dsa_index(p, &k);
    prof_end(c);
    static const int phase_cats[2] = {P_DSA_SCORE, P_DSA_SELECT};
    prof_phases_done(c, k.events, st, phase_cats, 2);
    return st;
}

/* Where the overlapped selection's workspace starts in the scratch (the attention's is before it), or
 * 0 when the selection runs first: overlap off, profiling (the ops are timed one by one), shapes
 * the head-batched kernels do not take (no attention workspace: the per-head kernel absorbs inside
 * its own blocks, so there is nothing to overlap), or a scratch without room for both. */
static size_t overlap_split(const struct cuda_ctx *c, const struct krk_mla_attn_params *p)
{
    if (!c->mla_overlap || (c->prof.on && !c->capturing) || !c->side) {
        return 0;
    }
    const int64_t n = c->batch.n_tok, ctx = c->batch.max_ctx;
    const size_t a = dsa_ws_bytes(c, n, ctx), b = mla_ws_bytes(p->n_head, p->kv_lora, n, ctx);
    if (a == 0 || b == 0 || a > c->scratch_size) {
        return 0;
    }
    const size_t off = (c->scratch_size - a) & ~(size_t)255; /* the selection's part: the last a bytes */
    return off >= b ? off : 0;
}

static enum kr_status cuda_mla_attention_impl(kr_backend_t be, const struct krk_mla_attn_params *p, size_t split)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    const size_t need1 = krk_mla_attn_workspace_bytes(1, p->n_head, p->kv_lora, c->batch.max_ctx);
    if (split == 0 && need1 > c->scratch_size) {
        KR_TRY(ensure_scratch(c, need1));
    }
    struct krk_ctx k = launch_ctx(c);
    if (split == 0) {
        return krk_mla_attention(p, &k);
    }
    /* fork: the selection on the side stream (its workspace after the attention's) while the
     * attention absorbs the queries; the attention waits for it before its first kernel reading idx */
    k.workspace_bytes = split;
    CU_TRY(c, cudaEventRecord(c->ev_fork, c->stream));
    CU_TRY(c, cudaStreamWaitEvent(c->side, c->ev_fork, 0));
    struct krk_ctx ks = launch_ctx(c);
    ks.stream = c->side;
    ks.workspace = (unsigned char *)c->scratch + split;
    ks.workspace_bytes = c->scratch_size - split;
    const enum kr_status si = krk_dsa_index(p->select, &ks);
    CU_TRY(c, cudaEventRecord(c->ev_join, c->side));
    k.idx_ready = c->ev_join;
    const enum kr_status st = si == KR_OK ? krk_mla_attention(p, &k) : si;
    c->n_overlap += st == KR_OK;
    if (st != KR_OK) { /* join anyway: a capture must not end with the side stream forked */
        cudaStreamWaitEvent(c->stream, c->ev_join, 0);
    }
    return st;
}

/* With a selection: in parallel with the absorption where it may (overlap_split), else first. */
static enum kr_status cuda_mla_attention(kr_backend_t be, const struct krk_mla_attn_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    const size_t split = p->select ? overlap_split(c, p) : 0;
    if (p->select && split == 0) {
        KR_TRY(cuda_dsa_index(be, p->select));
    }
    prof_begin(c, P_MLA);
    const enum kr_status st = cuda_mla_attention_impl(be, p, split);
    prof_end(c);
    return st;
}

/* ---- sampling ----------------------------------------------------------------------------- */

/* Staging for sampling `total` bytes (reserved at start for the largest step; see cuda_reserve). */
static enum kr_status ensure_samp(struct cuda_ctx *c, size_t total)
{
    return total <= c->samp_cap ? KR_OK : regrow_staging(c, &c->samp_d, &c->samp_h, &c->samp_cap, total);
}

/* The engine's struct names host arrays (everything but the logits): they go over in one copy to the
 * device staging, and krk_sample gets the same struct pointing at the staged copies; the results
 * come back in one copy. */
static enum kr_status cuda_sample(kr_backend_t be, const struct krk_sample_params *p)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    if (c->capturing) {
        return KR_ERR_INTERNAL;
    }
    const size_t n = (size_t)p->n, np = (size_t)p->n_pen, nt = (size_t)p->n_top;
    const size_t nm = p->mask ? (size_t)p->n_mask : 0;
    const struct samp_layout lay = samp_layout(n, np, nm, nt);
    const size_t o_rows = lay.o_rows, o_ids = lay.o_ids, o_cnt = lay.o_cnt, o_flg = lay.o_flg, o_msk = lay.o_msk,
                 o_out = lay.o_out, o_lp = lay.o_lp, o_tid = lay.o_tid, o_tlp = lay.o_tlp, total = lay.total;
    KR_TRY(ensure_samp(c, total)); /* within the reservation unless the step exceeds what was reserved */
    const size_t ws = krk_sample_workspace_bytes(p->n, p->vocab);
    if (ws > c->scratch_size) {
        KR_TRY(ensure_scratch(c, ws));
    }
    char *h = c->samp_h, *d = c->samp_d;
    memcpy(h + o_rows, p->rows, n * sizeof(struct krk_sample_row));
    if (np) {
        memcpy(h + o_ids, p->pen_ids, np * 4);
        memcpy(h + o_cnt, p->pen_count, np * 4);
        memcpy(h + o_flg, p->pen_flags, np);
    }
    if (nm) {
        memcpy(h + o_msk, p->mask, nm * 4);
    }
    CU_TRY(c, cudaMemcpyAsync(d, h, o_out, cudaMemcpyHostToDevice, c->stream));
    struct krk_sample_params dp = *p;
    dp.rows = (const struct krk_sample_row *)(d + o_rows);
    dp.pen_ids = np ? (const int32_t *)(d + o_ids) : NULL;
    dp.pen_count = np ? (const int32_t *)(d + o_cnt) : NULL;
    dp.pen_flags = np ? (const uint8_t *)(d + o_flg) : NULL;
    dp.mask = nm ? (const uint32_t *)(d + o_msk) : NULL;
    dp.n_mask = (int64_t)nm;
    dp.out = (int32_t *)(d + o_out);
    dp.out_logprob = p->out_logprob ? (float *)(d + o_lp) : NULL;
    dp.top_ids = nt ? (int32_t *)(d + o_tid) : NULL;
    dp.top_lp = nt ? (float *)(d + o_tlp) : NULL;
    const struct krk_ctx k = launch_ctx(c);
    KR_TRY(krk_sample(&dp, &k));
    CU_TRY(c, cudaMemcpyAsync(h + o_out, d + o_out, total - o_out, cudaMemcpyDeviceToHost, c->stream));
    CU_TRY(c, cudaStreamSynchronize(c->stream));
    KR_TRY(group_after_sync(c));
    memcpy(p->out, h + o_out, n * 4);
    if (p->out_logprob) {
        memcpy(p->out_logprob, h + o_lp, n * 4);
    }
    if (nt && p->top_ids && p->top_lp) {
        memcpy(p->top_ids, h + o_tid, n * nt * 4);
        memcpy(p->top_lp, h + o_tlp, n * nt * 4);
    }
    return KR_OK;
}

/* ---- timed entry points (per-op timing when profiling) --------------------------------------- */

/* The vtable entry NAME runs NAME_impl between two timing events of category CAT. */
#define TIMED(name, cat, params, args)                                                             \
    static enum kr_status name params                                                              \
    {                                                                                              \
        struct cuda_ctx *c = ctx_of(be);                                                           \
        prof_begin(c, cat);                                                                        \
        const enum kr_status st = name##_impl args;                                                \
        prof_end(c);                                                                               \
        return st;                                                                                 \
    }

TIMED(cuda_embed, P_EMBED, (kr_backend_t be, const struct kr_tensor *w, int64_t row0, float *out), (be, w, row0, out))
TIMED(cuda_rmsnorm, P_NORM, (kr_backend_t be, const struct krk_rmsnorm_params *p), (be, p))
TIMED(cuda_layernorm, P_DSA, (kr_backend_t be, const struct krk_layernorm_params *p), (be, p))
TIMED(cuda_scale, P_OTHER, (kr_backend_t be, float *y, float s, int64_t n), (be, y, s, n))
TIMED(cuda_matmul, n <= GEMV_ROWS || n <= ctx_of(be)->skinny_max ? P_GEMV : P_GEMM,
      (kr_backend_t be, const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w, const float *bias,
       float *y, int64_t ldy, const struct krk_bf16_in *xb),
      (be, x, ldx, n, w, bias, y, ldy, xb))
TIMED(cuda_matmul_multi, n <= GEMV_ROWS || n <= ctx_of(be)->skinny_max ? P_GEMV : P_GEMM,
      (kr_backend_t be, const float *x, int64_t ldx, int64_t n, int k, const struct kr_matmul_part *parts,
       const struct krk_bf16_in *xb),
      (be, x, ldx, n, k, parts, xb))
TIMED(cuda_matmul_act, n <= GEMV_ROWS || n <= ctx_of(be)->skinny_max ? P_GEMV : P_GEMM,
      (kr_backend_t be, const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w, const float *bias,
       float *y, int64_t ldy, enum kr_act act, float *out, krk_bf16 *out_bf16, const struct krk_bf16_in *xb),
      (be, x, ldx, n, w, bias, y, ldy, act, out, out_bf16, xb))
TIMED(cuda_act, P_ACT, (kr_backend_t be, const struct krk_act_params *p), (be, p))
TIMED(cuda_gated_rmsnorm, P_NORM, (kr_backend_t be, const struct krk_gated_rmsnorm_params *p), (be, p))
TIMED(cuda_attention, P_ATTN, (kr_backend_t be, const struct krk_attn_params *p), (be, p))
TIMED(cuda_moe_route, P_MOE, (kr_backend_t be, const struct krk_route_params *p), (be, p))
TIMED(cuda_moe_experts, P_MOE,
      (kr_backend_t be, const struct krk_experts_params *p, const struct kr_expert_weights *w), (be, p, w))
TIMED(cuda_gather_out, P_EMBED, (kr_backend_t be, const float *src, int64_t width, float *dst), (be, src, width, dst))
TIMED(cuda_rope, P_EMBED, (kr_backend_t be, const struct krk_rope_params *p), (be, p))
TIMED(cuda_mla_cache_write, P_MLA, (kr_backend_t be, const struct krk_mla_cache_params *p), (be, p))
TIMED(cuda_rope_pair, P_EMBED,
      (kr_backend_t be, const struct krk_rope_params *a, const struct krk_rope_params *b), (be, a, b))
TIMED(cuda_mla_prep, P_MLA, (kr_backend_t be, const struct krk_mla_prep_params *p), (be, p))
TIMED(cuda_fp8_round, P_DSA, (kr_backend_t be, const struct krk_fp8_round_params *p), (be, p))

#undef TIMED

/* ---- graphs ------------------------------------------------------------------------------- */

static int32_t cuda_graph_bucket(kr_backend_t be, int32_t n)
{
    struct cuda_ctx *c = ctx_of(be);
    if (!c->graphs_on || c->prof.on || (c->comm && kr_cuda_comm_one_device(c->comm))) {
        return 0; /* ranks sharing a device meet on the host at each collective (comm-cuda.h) */
    }
    for (size_t i = 0; i < sizeof graph_buckets / sizeof graph_buckets[0]; i++) {
        if (graph_buckets[i] >= n) {
            return graph_buckets[i];
        }
    }
    return 0;
}

static enum kr_status cuda_graph_run(kr_backend_t be, int32_t key, bool *launched)
{
    struct cuda_ctx *c = ctx_of(be);
    *launched = false;
    for (int i = 0; i < c->n_graphs; i++) {
        if (c->graphs[i].key == key) {
            CU_TRY(c, cudaGraphLaunch(c->graphs[i].exec, c->stream));
            *launched = true;
            return KR_OK;
        }
    }
    if (c->n_graphs == MAX_GRAPHS) {
        return KR_OK; /* run eagerly */
    }
    const int32_t bucket = key & 0xffff;
    if (tuned_takes(c, bucket) && !(c->tuned_eager[bucket / 64] >> (bucket % 64) & 1)) {
        /* the bucket's first step runs eagerly, timing its products' algorithms (krk_tuned_gemm
         * cannot time inside a capture); the graph is captured the next time */
        c->tuned_eager[bucket / 64] |= (uint64_t)1 << (bucket % 64);
        return KR_OK;
    }
    /* the captured kernels must not depend on this step's context length: they see no bound (0:
     * attention decode then uses its fixed split-K grid), or the graph shape's bound on every
     * context (MLA layers size their key tiles and score rows by it; each token still stops at its
     * own position, read on the device) */
    c->batch.max_ctx = c->hb ? c->hb->ctx_bound : 0;
    CU_TRY(c, cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    c->capturing = true;
    c->cap_key = key;
    return KR_OK;
}

static enum kr_status cuda_end_batch(kr_backend_t be, bool ok)
{
    struct cuda_ctx *c = ctx_of(be);
    c->inv_step = false;
    if (!c->capturing) {
        float ms = 0;
        const int timed = krk_tuned_info(c->tuned, &ms);
        if (timed != c->tuned_logged) {
            KR_LOG_INFO("cuda: %d decode-sized product classes timed (cuBLASLt algorithms), %.0f ms in all", timed,
                        (double)ms);
            c->tuned_logged = timed;
        }
        prof_collect(c);
        kr_cuda_comm_step_issued(c->comm, c->rank, c->stream);
        return KR_OK;
    }
    c->capturing = false;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    if (e != cudaSuccess || !ok) {
        if (g) {
            cudaGraphDestroy(g);
        }
        (void)cudaGetLastError();
        if (e != cudaSuccess) {
            return cu_fail(c, e, "cudaStreamEndCapture", __FILE__, __LINE__);
        }
        return KR_ERR_INTERNAL;
    }
    cudaGraphExec_t exec = NULL;
    e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    CU_TRY(c, e);
    c->graphs[c->n_graphs++] = (struct graph){.key = c->cap_key, .exec = exec};
    KR_LOG_DEBUG("cuda: captured the decode graph for %d sequences", c->cap_key);
    CU_TRY(c, cudaGraphLaunch(exec, c->stream));
    kr_cuda_comm_step_issued(c->comm, c->rank, c->stream);
    return KR_OK;
}

/* ---- tensor parallelism --------------------------------------------------------------------- */

static enum kr_status cuda_set_tp(kr_backend_t be, int rank, int size, void *comm)
{
    struct cuda_ctx *c = ctx_of(be);
    if (size == 1) {
        c->comm = NULL;
        c->rank = 0;
        return KR_OK;
    }
    if (c->invariant) {
        KR_LOG_ERROR("cuda: --batch-invariant with tensor parallelism on GPUs: the all-reduces' summation order "
                     "follows the message size; serve on one GPU");
        return KR_ERR_UNSUPPORTED;
    }
    if (!comm || kr_cuda_comm_size(comm) != size || kr_cuda_comm_device(comm, rank) != c->dev) {
        KR_LOG_ERROR("cuda: rank %d of %d: the group has another size or puts the rank on another device", rank, size);
        return KR_ERR_INVAL;
    }
    c->comm = comm;
    c->rank = rank;
    return KR_OK;
}

static enum kr_status cuda_all_reduce(kr_backend_t be, float *x, int64_t n)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    prof_begin(c, P_COMM);
    const enum kr_status st = kr_cuda_comm_all_reduce(c->comm, c->rank, x, n, c->stream, 0);
    prof_end(c);
    return st;
}

static enum kr_status cuda_all_gather(kr_backend_t be, const float *src, int64_t rows, int64_t cols, float *dst)
{
    struct cuda_ctx *c = ctx_of(be);
    KR_TRY(op_enter(c));
    prof_begin(c, P_COMM);
    const enum kr_status st = kr_cuda_comm_all_gather(c->comm, c->rank, src, rows, cols, dst, c->stream, 0);
    prof_end(c);
    return st;
}

static void cuda_tp_abort(kr_backend_t be)
{
    kr_cuda_comm_abort(ctx_of(be)->comm);
}

static void cuda_graph_reset(kr_backend_t be)
{
    graphs_clear(ctx_of(be));
}

void kr_backend_cuda_profile(kr_backend_t be, bool on)
{
    struct cuda_ctx *c = ctx_of(be);
    if (on && !c->prof.ev[0]) {
        for (int i = 0; i < 2 * PROF_MAX_EV; i++) {
            if (cudaEventCreate(&c->prof.ev[i]) != cudaSuccess) {
                (void)cudaGetLastError();
                return;
            }
        }
    }
    memset(c->prof.ms, 0, sizeof c->prof.ms);
    memset(c->prof.calls, 0, sizeof c->prof.calls);
    c->prof.n = 0;
    c->prof.open_cat = -1;
    c->prof.on = on;
    krk_set_pdl(c->pdl && !on); /* overlapping kernels would blur the per-op times */
}

int kr_backend_cuda_profile_read(kr_backend_t be, const char **names, double *ms, int64_t *calls, int cap)
{
    struct cuda_ctx *c = ctx_of(be);
    int n = 0;
    for (int i = 0; i < PROF_N_CAT && n < cap; i++, n++) {
        names[n] = prof_names[i];
        ms[n] = c->prof.ms[i];
        calls[n] = c->prof.calls[i];
    }
    return n;
}

/* ---- creation ----------------------------------------------------------------------------- */

int kr_backend_cuda_device_count(void)
{
    return krk_device_count();
}

void kr_backend_cuda_setup(const struct kr_switches *sw)
{
    krk_set_state_streaming(sw->ssd_stream != 0);
    krk_set_pdl(sw->pdl != 0);
}

enum kr_status kr_backend_cuda_create_with(int dev, const struct kr_switches *sw, kr_backend_t *out,
                                           struct kr_err *err)
{
    *out = NULL;
    const int n = krk_device_count();
    if (n <= 0) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED, "cuda: no CUDA device is visible");
    }
    if (dev < 0 || dev >= n) {
        return kr_err_set(err, KR_ERR_INVAL, "cuda: device %d does not exist (%d visible)", dev, n);
    }
    struct kr_backend *be = kr_calloc(1, sizeof *be);
    struct cuda_ctx *c = kr_calloc(1, sizeof *c);
    if (!be || !c) {
        kr_free(be);
        kr_free(c);
        return KR_ERR_NOMEM;
    }
    be->ctx = c;
    be->api_version = KR_BACKEND_API_VERSION;
    be->iface = (struct kr_backend_i){
        .name = cuda_name,
        .free = cuda_free,
        .act_size = cuda_act_size,
        .cache_elt_size = cuda_cache_elt_size,
        .buf_alloc = cuda_buf_alloc,
        .buf_free = cuda_buf_free,
        .upload = cuda_upload,
        .copy_d2h = cuda_copy_d2h,
        .copy_h2d = cuda_copy_h2d,
        .copy_d2d = cuda_copy_d2d,
        .reserve = cuda_reserve,
        .mem_info = cuda_mem_info,
        .healthy = cuda_healthy,
        .check = cuda_check,
        .begin_batch = cuda_begin_batch,
        .end_batch = cuda_end_batch,
        .graph_bucket = cuda_graph_bucket,
        .graph_run = cuda_graph_run,
        .graph_reset = cuda_graph_reset,
        .embed = cuda_embed,
        .rmsnorm = cuda_rmsnorm,
        .add = cuda_add,
        .matmul = cuda_matmul,
        .bf16_operands = cuda_bf16_operands,
        .act = cuda_act,
        .matmul_multi = cuda_matmul_multi,
        .matmul_act = cuda_matmul_act,
        .mla_prep = cuda_mla_prep,
        .rope_pair = cuda_rope_pair,
        .mamba = cuda_mamba,
        .token_states = cuda_token_states,
        .gated_rmsnorm = cuda_gated_rmsnorm,
        .attention = cuda_attention,
        .moe_route = cuda_moe_route,
        .moe_experts = cuda_moe_experts,
        .gather_out = cuda_gather_out,
        .layernorm = cuda_layernorm,
        .scale = cuda_scale,
        .rope = cuda_rope,
        .mla_cache_write = cuda_mla_cache_write,
        .dsa_index = cuda_dsa_index,
        .mla_attention = cuda_mla_attention,
        .fp8_round = cuda_fp8_round,
        .fp8_matmul = cuda_fp8_matmul,
        .set_batch_invariant = cuda_set_batch_invariant,
        .kv_fp8 = cuda_kv_fp8,
        .kv_fp8_packed = cuda_kv_fp8,
        .sample = cuda_sample,
        .set_tp = cuda_set_tp,
        .all_reduce = cuda_all_reduce,
        .all_gather = cuda_all_gather,
        .tp_abort = cuda_tp_abort,
    };
    c->dev = dev;
    c->graphs_on = sw->cuda_graphs != 0;
    c->mla_attn = sw->mla_attn;
    c->mla_attn_sw = sw->mla_attn;
    c->dsa_score = sw->dsa_score;
    c->mla_overlap = sw->mla_overlap != 0;
    c->skinny_max = sw->skinny_max;
    c->fp8_skinny_max = sw->fp8_skinny_max;
    /* the process-wide launch mode and state hints are kr_backend_cuda_setup's, not the device's */
    c->pdl = sw->pdl != 0;
    enum kr_status st = KR_ERR_INVAL;
    if (sw->mla_attn < 0 || sw->mla_attn > KR_MLA_ATTN_HEADS || sw->dsa_score < 0 || sw->dsa_score > KR_DSA_SCORE_MMA ||
        sw->skinny_max < 0 || sw->skinny_max > KRK_SKINNY_MAX_N) {
        kr_err_set(err, st, "cuda: a tuning switch is out of its range (see krait serve --help-env)");
        goto fail;
    }
    char name[128] = "cuda";
    krk_device_describe(dev, name, sizeof name);
    snprintf(c->desc, sizeof c->desc, "cuda:%d (%s)", dev, name);
    st = KR_ERR_CUDA;
    cudaError_t e;
    if ((e = cudaSetDevice(dev)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&c->ev_fork, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&c->ev_join, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&c->ev_meta, cudaEventDisableTiming)) != cudaSuccess) {
        kr_err_set(err, KR_ERR_CUDA, "cuda: cannot initialise device %d: %s", dev, cudaGetErrorString(e));
        goto fail;
    }
    if (cublasCreate(&c->blas) != CUBLAS_STATUS_SUCCESS) {
        kr_err_set(err, KR_ERR_CUDA, "cuda: cannot create the cuBLAS handle on device %d", dev);
        goto fail;
    }
    c->blas_ws_size = (size_t)64 << 20;
    c->ptr_cap = (size_t)1 << 17;
    if ((st = dev_alloc(c, c->blas_ws_size, &c->blas_ws)) != KR_OK ||
        (st = dev_alloc(c, c->ptr_cap * sizeof(void *), (void **)&c->ptr_table)) != KR_OK) {
        kr_err_set(err, st, "cuda: cannot allocate device scratch");
        goto fail;
    }
    if (cublasSetStream(c->blas, c->stream) != CUBLAS_STATUS_SUCCESS ||
        cublasSetWorkspace(c->blas, c->blas_ws, c->blas_ws_size) != CUBLAS_STATUS_SUCCESS ||
        cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH) != CUBLAS_STATUS_SUCCESS) {
        st = KR_ERR_CUDA;
        kr_err_set(err, st, "cuda: cannot configure cuBLAS");
        goto fail;
    }
    /* cuBLASLt shares cuBLAS's workspace: both run on `stream`, one product after the other */
    if (!(c->lt = krk_fp8_lt_create(c->blas_ws, c->blas_ws_size))) {
        KR_LOG_WARN("cuda: no cuBLASLt handle; FP8 products of every size take the CUDA-core kernel");
    }
    if (sw->lt_tune && !(c->tuned = krk_fixed_lt_create(c->blas_ws, c->blas_ws_size, 1))) {
        KR_LOG_WARN("cuda: no cuBLASLt handle; decode-sized products take cuBLAS's own algorithms");
    }
    if (sw->stream_gemm) {
        const size_t b = krk_stream_ws_bytes();
        if ((st = dev_alloc(c, b, &c->st_ws)) != KR_OK) {
            kr_err_set(err, st, "cuda: cannot allocate the decode products' workspace");
            goto fail;
        }
        c->st_ws_size = b;
        if (cudaMemsetAsync(c->st_ws, 0, b, c->stream) != cudaSuccess) {
            st = KR_ERR_CUDA;
            kr_err_set(err, st, "cuda: cannot clear the decode products' workspace");
            goto fail;
        }
    }
    KR_LOG_INFO("cuda: using %s, graphs %s", c->desc, c->graphs_on ? "on" : "off");
    *out = be;
    return KR_OK;
fail:
    cuda_free(be);
    return st;
}

/* n backends on devices[0..n) with the switches `sw`; on failure none is left. */
static enum kr_status create_on(const int *devices, int n, const struct kr_switches *sw, kr_backend_t *be,
                                struct kr_err *err)
{
    enum kr_status st = KR_OK;
    for (int r = 0; r < n && st == KR_OK; r++) {
        st = kr_backend_cuda_create_with(devices[r], sw, &be[r], err);
    }
    if (st != KR_OK) {
        for (int r = 0; r < n; r++) {
            kr_backend_free(be[r]);
            be[r] = NULL;
        }
    }
    return st;
}

/* The devices of n ranks from dev0 (all on dev0 with KRAIT_TP_ONE_DEVICE), checked against what is
 * visible. */
static enum kr_status rank_devices(int dev0, int n, const struct kr_switches *sw, int *devs, struct kr_err *err)
{
    const int visible = krk_device_count();
    const bool one = sw->tp_one_device != 0;
    if (n < 1 || n > KRK_PEER_MAX_RANKS) {
        return kr_err_set(err, KR_ERR_INVAL, "tensor parallel: %d ranks on CUDA devices in one process (1 to %d are "
                          "supported)", n, KRK_PEER_MAX_RANKS);
    }
    if (!one && dev0 + n > visible) {
        return kr_err_set(err, KR_ERR_INVAL,
                          "tensor parallel: %d ranks from CUDA device %d need devices %d..%d, but %d %s visible "
                          "(CUDA_VISIBLE_DEVICES, or a smaller --tensor-parallel-size)",
                          n, dev0, dev0, dev0 + n - 1, visible, visible == 1 ? "is" : "are");
    }
    for (int r = 0; r < n; r++) {
        devs[r] = one ? dev0 : dev0 + r;
    }
    return KR_OK;
}

enum kr_status kr_backend_cuda_create_ranks(int dev0, int n, kr_backend_t *be, struct kr_err *err)
{
    for (int r = 0; r < n; r++) {
        be[r] = NULL;
    }
    struct kr_switches sw;
    KR_TRY(kr_switches_from_env(&sw, err));
    int devs[KRK_PEER_MAX_RANKS];
    KR_TRY(rank_devices(dev0, n, &sw, devs, err));
    kr_backend_cuda_setup(&sw);
    return create_on(devs, n, &sw, be, err);
}

enum kr_status kr_backend_cuda_nccl_id(void *out, size_t cap, size_t *len, struct kr_err *err)
{
    return kr_cuda_comm_unique_id(out, cap, len, err);
}

enum kr_status kr_backend_cuda_join(kr_backend_t *be, int n, int first, int world, const void *nccl_id,
                                    struct kr_cuda_comm **comm, struct kr_err *err)
{
    *comm = NULL;
    struct kr_switches sw;
    KR_TRY(kr_switches_from_env(&sw, err));
    int devs[KRK_PEER_MAX_RANKS];
    if (n < 1 || n > KRK_PEER_MAX_RANKS) {
        return kr_err_set(err, KR_ERR_INVAL, "tensor parallel: %d ranks in one process", n);
    }
    for (int r = 0; r < n; r++) {
        devs[r] = ctx_of(be[r])->dev;
    }
    const struct kr_cuda_comm_opts o = {.size = n, .devices = devs, .nccl_id = nccl_id, .first = first,
                                        .world = world, .peer_max_bytes = (size_t)sw.tp_peer_kb << 10,
                                        .timeout_s = sw.tp_timeout_s};
    KR_TRY(kr_cuda_comm_create(&o, comm, err));
    for (int r = 0; r < n; r++) {
        const enum kr_status st = kr_backend_set_tp(be[r], first + r, world, *comm, err);
        if (st != KR_OK) {
            kr_cuda_comm_free(*comm);
            *comm = NULL;
            return st;
        }
    }
    return KR_OK;
}

void kr_backend_cuda_group_abort(struct kr_cuda_comm *comm)
{
    kr_cuda_comm_abort(comm);
}

enum kr_status kr_backend_cuda_create_group(int dev0, int size, kr_backend_t *be, struct kr_cuda_comm **comm,
                                            struct kr_err *err)
{
    *comm = NULL;
    for (int r = 0; r < size; r++) {
        be[r] = NULL;
    }
    struct kr_switches sw;
    KR_TRY(kr_switches_from_env(&sw, err));
    int devs[KRK_PEER_MAX_RANKS];
    KR_TRY(rank_devices(dev0, size, &sw, devs, err));
    kr_backend_cuda_setup(&sw);
    KR_TRY(create_on(devs, size, &sw, be, err));
    const struct kr_cuda_comm_opts o = {.size = size, .devices = devs, .one_device = sw.tp_one_device != 0,
                                        .peer_max_bytes = (size_t)sw.tp_peer_kb << 10,
                                        .timeout_s = sw.tp_timeout_s};
    enum kr_status st = kr_cuda_comm_create(&o, comm, err);
    for (int r = 0; r < size && st == KR_OK; r++) {
        st = kr_backend_set_tp(be[r], r, size, *comm, err);
    }
    if (st != KR_OK) {
        for (int r = 0; r < size; r++) {
            kr_backend_free(be[r]);
            be[r] = NULL;
        }
        kr_cuda_comm_free(*comm);
        *comm = NULL;
    }
    return st;
}

void kr_backend_cuda_group_free(struct kr_cuda_comm *comm)
{
    kr_cuda_comm_free(comm);
}
