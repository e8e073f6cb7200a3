/* Skinny products of decode at the weight read rate: every weight shape of the Nemotron-H-8B
 * benchmark model's decode step (tools/bench/synth_model.py, nemotron_h_8b), n activation rows, for
 * each configuration of the GEMV kernels (krk_gemv_params.config) and for cuBLAS (bf16 GEMM on x
 * cast to bf16), the tensor-core skinny kernel (krk_skinny, every configuration, x cast to bf16
 * as for cuBLAS; configuration 0 at every n, the others up to 16) and the tensor-copy / wgmma
 * kernel (krk_stream_gemm, both configurations, x cast likewise). Each launch reads a different copy
 * of the weight from a pool of at least 1 GiB, so that nothing comes from L2; launches are issued
 * back to back (as in a decode step's graph) and timed with events over all repetitions.
 *
 * Output: one markdown row per (kernel, configuration, n): microseconds per product for each
 * shape, the weight read rate (TB/s) for each shape, and the GEMV time of one decode step (each
 * shape times the number of times the step runs it). For n > 1 also cuBLASLt: every algorithm its
 * heuristic offers (up to 16, 32 MiB of workspace) is timed on each shape and the fastest shown,
 * with its index in the heuristic's order and its split-K factor.
 *   bench_gemv [--n 1,16,32] [--reps N] [--json FILE]   (n <= 64; the GEMV runs n <= KRK_GEMV_MAX_N)
 *
 * With --fp8 the same shapes as FP8 weights in 128 x 128 blocks (codes and fp32 scales, each launch
 * on a different copy), n <= 16, for the decode paths of the backend's FP8 products: the activation
 * quantization alone, quantization + the tensor-core skinny kernel, quantization + the CUDA-core
 * gemv; the read rate counts codes and scales. Then the
 * step's FP8 products at n = 1 replayed as one graph (the LM head left out: it stays bf16). */
#include "measure.h"
#include "krk.h"
#include "switches.h"

#include <stdbool.h>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct shape {
    const char *name;
    int64_t rows, cols;
    int per_step; /* how many times a decode step of the 52-layer model runs it */
};

/* hidden 4096; Mamba in_proj 2 * 8192 + 2 * 8 * 128 + 128 rows; MLP 21504 relu2; attention
 * 32 + 2 * 8 heads of 128; vocab 131072; 24 M, 24 -, 4 * layers */
static const struct shape shapes[] = {
    {"in_proj", 18560, 4096, 24}, {"out_proj", 4096, 8192, 24}, {"up", 21504, 4096, 24},
    {"down", 4096, 21504, 24},    {"qkv", 6144, 4096, 4},      {"o", 4096, 4096, 4},
    {"lm_head", 131072, 4096, 1},
    /* the DSA hybrid's D-layer products (not in the Nemotron-H step): q_a, kv_a and the indexer's
     * key and head weights of the layer input; q_b with the indexer's query projection */
    {"dsa_in", 2304, 4096, 0},    {"dsa_qb", 14336, 1536, 0},
};
#define N_SHAPES (int)(sizeof shapes / sizeof shapes[0])

enum kind { K_STAGED, K_CUBLAS, K_LT, K_SKINNY, K_STREAM };
#define LT_ALGOS 16
#define LT_WS ((size_t)32 << 20)

/* A cuBLASLt product y = W x of one shape and n, with the heuristic's candidate algorithms. */
struct lt_plan {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, cd;
    cublasLtMatmulHeuristicResult_t res[LT_ALGOS];
    int n_res, cur;
};
#define MAX_N 64 /* rows of x benchmarked at most (cuBLAS; the GEMV takes KRK_GEMV_MAX_N) */

struct ctx {
    char *pool;       /* weight copies */
    size_t pool_bytes;
    float *x, *y;
    krk_bf16 *xb;
    cublasHandle_t blas;
    cublasLtHandle_t lt;
    void *lt_ws;
    struct lt_plan *plan; /* the K_LT product being timed */
    void *sk_ws;          /* krk_skinny's workspace */
    size_t sk_ws_bytes;
    void *st_ws;          /* krk_stream_gemm's */
    size_t st_ws_bytes;
    cudaStream_t stream;
    int reps;
};

/* One product; the copy of the weight read is `rep` modulo the copies that fit in the pool. */
static int run_one(struct ctx *c, enum kind k, int config, const struct shape *s, int n, int rep)
{
    const size_t wbytes = (size_t)s->rows * (size_t)s->cols * 2;
    const size_t copies = c->pool_bytes / wbytes;
    const krk_bf16 *w = (const krk_bf16 *)(c->pool + (size_t)rep % copies * wbytes);
    if (k == K_LT) {
        if (krk_cast_bf16(c->x, s->cols, n, s->cols, c->xb, c->stream) != KR_OK) {
            return -1;
        }
        const float one = 1.0f, zero = 0.0f;
        const struct lt_plan *p = c->plan;
        return cublasLtMatmul(c->lt, p->op, &one, w, p->a, c->xb, p->b, &zero, c->y, p->cd, c->y, p->cd,
                              &p->res[p->cur].algo, c->lt_ws, LT_WS, c->stream) == CUBLAS_STATUS_SUCCESS
                   ? 0
                   : -1;
    }
    if (k == K_CUBLAS) {
        if (krk_cast_bf16(c->x, s->cols, n, s->cols, c->xb, c->stream) != KR_OK) {
            return -1;
        }
        const float one = 1.0f, zero = 0.0f;
        return cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)s->rows, n, (int)s->cols, &one, w, CUDA_R_16BF,
                            (int)s->cols, c->xb, CUDA_R_16BF, (int)s->cols, &zero, c->y, CUDA_R_32F, (int)s->rows,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS
                   ? 0
                   : -1;
    }
    if (k == K_SKINNY) { /* x cast to bf16 included, as for cuBLAS */
        if (krk_cast_bf16(c->x, s->cols, n, s->cols, c->xb, c->stream) != KR_OK) {
            return -1;
        }
        struct krk_skinny_params p = {.xb = c->xb, .ldxb = s->cols, .n = n, .cols = s->cols, .n_parts = 1,
                                      .ws = c->sk_ws, .ws_bytes = c->sk_ws_bytes, .config = config};
        p.parts[0] = (struct krk_gemv_part){.w = w, .rows = s->rows, .y = c->y, .ldy = s->rows};
        return krk_skinny(&p, c->stream) == KR_OK ? 0 : -1;
    }
    if (k == K_STREAM) { /* x cast to bf16 included, as for cuBLAS */
        if (krk_cast_bf16(c->x, s->cols, n, s->cols, c->xb, c->stream) != KR_OK) {
            return -1;
        }
        const struct krk_stream_params p = {.w = w, .x = c->xb, .ldx = s->cols, .y = c->y, .ldy = s->rows,
                                            .rows = s->rows, .cols = s->cols, .n = n, .ws = c->st_ws,
                                            .ws_bytes = c->st_ws_bytes, .config = config};
        return krk_stream_gemm(&p, c->stream) == KR_OK ? 0 : -1;
    }
    struct krk_gemv_params p = {.x = c->x, .ldx = s->cols, .w = w, .n = n, .rows = s->rows, .cols = s->cols,
                                .y = c->y, .ldy = s->rows, .config = config};
    return krk_gemv(&p, c->stream) == KR_OK ? 0 : -1;
}

/* Microseconds per product (mean over reps after a warm-up), or -1 when the kernel refuses. */
static double time_one(struct ctx *c, enum kind k, int config, const struct shape *s, int n)
{
    for (int r = 0; r < 3; r++) {
        if (run_one(c, k, config, s, n, r) != 0) {
            return -1;
        }
    }
    cudaEvent_t e0, e1;
    BENCH_CK(cudaEventCreate(&e0));
    BENCH_CK(cudaEventCreate(&e1));
    BENCH_CK(cudaEventRecord(e0, c->stream));
    for (int r = 0; r < c->reps; r++) {
        run_one(c, k, config, s, n, r);
    }
    BENCH_CK(cudaEventRecord(e1, c->stream));
    BENCH_CK(cudaEventSynchronize(e1));
    float ms = 0;
    BENCH_CK(cudaEventElapsedTime(&ms, e0, e1));
    BENCH_CK(cudaEventDestroy(e0));
    BENCH_CK(cudaEventDestroy(e1));
    return 1000.0 * ms / c->reps;
}

/* Fastest of the cuBLASLt heuristic's algorithms for y = W x (W [rows, cols] bf16 row-major, x n
 * rows of bf16, y fp32): microseconds, or -1; *best and *split_k describe the algorithm. */
static double time_lt(struct ctx *c, const struct shape *s, int n, int *best, int *split_k)
{
    struct lt_plan p = {0};
    const cublasOperation_t opt = CUBLAS_OP_T;
    double best_us = -1;
    *best = -1;
    *split_k = 0;
    cublasLtMatmulPreference_t pref = NULL;
    const size_t ws = LT_WS;
    if (cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &opt, sizeof opt) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, (uint64_t)s->cols, (uint64_t)s->rows, s->cols) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, (uint64_t)s->cols, (uint64_t)n, s->cols) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&p.cd, CUDA_R_32F, (uint64_t)s->rows, (uint64_t)n, s->rows) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoGetHeuristic(c->lt, p.op, p.a, p.b, p.cd, p.cd, pref, LT_ALGOS, p.res, &p.n_res) !=
            CUBLAS_STATUS_SUCCESS) {
        p.n_res = 0;
    }
    c->plan = &p;
    for (p.cur = 0; p.cur < p.n_res; p.cur++) {
        if (p.res[p.cur].state != CUBLAS_STATUS_SUCCESS) {
            continue;
        }
        const double us = time_one(c, K_LT, 0, s, n);
        if (us > 0 && (best_us < 0 || us < best_us)) {
            best_us = us;
            *best = p.cur;
            int sk = 0;
            size_t got = 0;
            cublasLtMatmulAlgoConfigGetAttribute(&p.res[p.cur].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk, sizeof sk,
                                                 &got);
            *split_k = sk;
        }
    }
    c->plan = NULL;
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.cd);
    cublasLtMatmulDescDestroy(p.op);
    return best_us;
}

/* A captured graph (freed here) replayed: ms per replay, the mean of 10 after a warm-up; -1 when
 * !ok or it does not instantiate. */
static double replay_ms(struct ctx *c, cudaGraph_t g, int ok)
{
    cudaGraphExec_t exec = NULL;
    double ms = -1;
    if (ok && cudaGraphInstantiate(&exec, g, 0) == cudaSuccess) {
        cudaEvent_t e0, e1;
        BENCH_CK(cudaEventCreate(&e0));
        BENCH_CK(cudaEventCreate(&e1));
        BENCH_CK(cudaGraphLaunch(exec, c->stream));
        BENCH_CK(cudaEventRecord(e0, c->stream));
        for (int r = 0; r < 10; r++) {
            BENCH_CK(cudaGraphLaunch(exec, c->stream));
        }
        BENCH_CK(cudaEventRecord(e1, c->stream));
        BENCH_CK(cudaEventSynchronize(e1));
        float f = 0;
        BENCH_CK(cudaEventElapsedTime(&f, e0, e1));
        ms = f / 10.0;
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        cudaGraphExecDestroy(exec);
    }
    if (g) {
        cudaGraphDestroy(g);
    }
    (void)cudaGetLastError();
    return ms;
}

/* The decode step's GEMV sequence of the 52-layer model (pattern below), captured as one CUDA
 * graph: the GEMVs alone, then with `small` small kernels (an elementwise add over 4096 floats,
 * the size of a norm's row) before each GEMV, as a step has its norms, convolutions and
 * activations in between. Weights are taken in order from the pool, so consecutive layers read
 * different memory. Returns ms per replay (mean of 10 after a warm-up), or -1. */
static double time_chain(struct ctx *c, int small, int *n_gemv)
{
    static const char pattern[] = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-";
    float *tmp = NULL;
    BENCH_CK(cudaMalloc((void **)&tmp, 2 * 4096 * sizeof(float)));
    BENCH_CK(cudaMemset(tmp, 0, 2 * 4096 * sizeof(float)));
    BENCH_CK(cudaStreamSynchronize(c->stream));
    cudaGraph_t g = NULL;
    size_t off = 0;
    int ok = 1;
    *n_gemv = 0;
    BENCH_CK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l <= (int)sizeof pattern - 1 && ok; l++) {
        const char t = l < (int)sizeof pattern - 1 ? pattern[l] : 'H';
        const struct shape *sh[2] = {NULL, NULL};
        if (t == 'M') {
            sh[0] = &shapes[0], sh[1] = &shapes[1];
        } else if (t == '-') {
            sh[0] = &shapes[2], sh[1] = &shapes[3];
        } else if (t == '*') {
            sh[0] = &shapes[4], sh[1] = &shapes[5];
        } else {
            sh[0] = &shapes[6];
        }
        for (int k = 0; k < 2 && sh[k]; k++) {
            for (int i = 0; i < small; i++) {
                ok &= krk_add(tmp, tmp + 4096, 4096, c->stream) == KR_OK;
            }
            const size_t wb = (size_t)sh[k]->rows * (size_t)sh[k]->cols * 2;
            if (off + wb > c->pool_bytes) {
                off = 0;
            }
            struct krk_gemv_params p = {.x = c->x, .ldx = sh[k]->cols, .w = (const krk_bf16 *)(c->pool + off),
                                        .n = 1, .rows = sh[k]->rows, .cols = sh[k]->cols, .y = c->y,
                                        .ldy = sh[k]->rows};
            ok &= krk_gemv(&p, c->stream) == KR_OK;
            off += (wb + 255) / 256 * 256;
            ++*n_gemv;
        }
    }
    BENCH_CK(cudaStreamEndCapture(c->stream, &g));
    const double ms = replay_ms(c, g, ok);
    cudaFree(tmp);
    return ms;
}

/* ---- FP8 ---------------------------------------------------------------------------------------- */

enum fp8_kind { F_QUANT, F_SKINNY, F_GEMV2, F_SKINNY_ONLY, F_KINDS };
static const char *const fp8_names[] = {"quantization alone", "quant + skinny (tensor cores)",
                                        "quant + gemv (CUDA cores)", "skinny alone (activations quantized before)"};

static size_t fp8_bytes(const struct shape *s)
{
    return (size_t)s->rows * (size_t)s->cols + (size_t)((s->rows + 127) / 128) * (size_t)(s->cols / 128) * 4;
}

/* One FP8 product of kind k on the copy of the weight at byte offset `off` of the pool; the codes
 * first, the scales after them (256-aligned). */
static int fp8_run(struct ctx *c, enum fp8_kind k, const struct shape *s, int n, size_t off, uint8_t *q, float *as,
                   float *xq)
{
    const size_t codes = ((size_t)s->rows * (size_t)s->cols + 255) / 256 * 256;
    const struct krk_fp8_weight w = {.q = (const uint8_t *)(c->pool + off),
                                     .scale = (const float *)(c->pool + off + codes), .rows = s->rows,
                                     .cols = s->cols, .ld_s = s->cols / 128, .block_r = 128, .block_c = 128};
    if (k == F_SKINNY_ONLY) {
        const struct krk_fp8_mm_params p = {.q = q, .ldq = s->cols, .scale = as, .s_ld = n, .n = n, .w = w,
                                            .y = c->y, .ldy = s->rows};
        return krk_fp8_skinny(&p, c->stream) == KR_OK ? 0 : -1;
    }
    const struct krk_fp8_quant_params qp = {.x = c->x, .ldx = s->cols, .n = n, .cols = s->cols, .block = 128,
                                            .q = k == F_GEMV2 ? NULL : q, .ldq = s->cols,
                                            .scale = k == F_GEMV2 ? NULL : as, .s_ld = n,
                                            .xq = k == F_GEMV2 ? xq : NULL, .ldxq = s->cols};
    if (krk_fp8_quant(&qp, c->stream) != KR_OK) {
        return -1;
    }
    if (k == F_SKINNY) {
        const struct krk_fp8_mm_params p = {.q = q, .ldq = s->cols, .scale = as, .s_ld = n, .n = n, .w = w,
                                            .y = c->y, .ldy = s->rows};
        return krk_fp8_skinny(&p, c->stream) == KR_OK ? 0 : -1;
    }
    if (k == F_GEMV2) {
        const struct krk_fp8_gemv_params p = {.xq = xq, .ldx = s->cols, .n = n, .w = w, .y = c->y, .ldy = s->rows};
        return krk_fp8_gemv(&p, c->stream) == KR_OK ? 0 : -1;
    }
    return 0;
}

static double fp8_time(struct ctx *c, enum fp8_kind k, const struct shape *s, int n, uint8_t *q, float *as, float *xq)
{
    const size_t wb = (fp8_bytes(s) + 512 + 255) / 256 * 256, copies = c->pool_bytes / wb;
    for (int r = 0; r < 3; r++) {
        if (fp8_run(c, k, s, n, (size_t)r % copies * wb, q, as, xq) != 0) {
            return -1;
        }
    }
    cudaEvent_t e0, e1;
    BENCH_CK(cudaEventCreate(&e0));
    BENCH_CK(cudaEventCreate(&e1));
    BENCH_CK(cudaEventRecord(e0, c->stream));
    for (int r = 0; r < c->reps; r++) {
        fp8_run(c, k, s, n, (size_t)r % copies * wb, q, as, xq);
    }
    BENCH_CK(cudaEventRecord(e1, c->stream));
    BENCH_CK(cudaEventSynchronize(e1));
    float ms = 0;
    BENCH_CK(cudaEventElapsedTime(&ms, e0, e1));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return 1000.0 * ms / c->reps;
}

/* The FP8 products of the decode step at n = 1 (shapes as time_chain, without the LM head) as one
 * graph: ms per replay, and the codes and scales read in *bytes. */
static double fp8_chain(struct ctx *c, enum fp8_kind k, uint8_t *q, float *as, float *xq, double *bytes)
{
    static const char pattern[] = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-";
    cudaGraph_t g = NULL;
    size_t off = 0;
    int ok = 1;
    *bytes = 0;
    BENCH_CK(cudaStreamSynchronize(c->stream));
    BENCH_CK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l < (int)sizeof pattern - 1 && ok; l++) {
        const char t = pattern[l];
        const struct shape *sh[2] = {t == 'M' ? &shapes[0] : t == '-' ? &shapes[2] : &shapes[4],
                                     t == 'M' ? &shapes[1] : t == '-' ? &shapes[3] : &shapes[5]};
        for (int i = 0; i < 2; i++) {
            const size_t wb = (fp8_bytes(sh[i]) + 512 + 255) / 256 * 256;
            if (off + wb > c->pool_bytes) {
                off = 0;
            }
            ok &= fp8_run(c, k, sh[i], 1, off, q, as, xq) == 0;
            off += wb;
            *bytes += (double)fp8_bytes(sh[i]);
        }
    }
    BENCH_CK(cudaStreamEndCapture(c->stream, &g));
    const double ms = replay_ms(c, g, ok);
    return ms;
}

static void fp8_bench(struct ctx *c, const int *ns, int n_ns, int64_t max_cols)
{
    uint8_t *q = NULL;
    float *as = NULL, *xq = NULL;
    BENCH_CK(cudaMalloc((void **)&q, (size_t)16 * (size_t)max_cols));
    BENCH_CK(cudaMalloc((void **)&as, (size_t)16 * (size_t)(max_cols / 128) * 4));
    BENCH_CK(cudaMalloc((void **)&xq, (size_t)16 * (size_t)max_cols * 4));
    BENCH_CK(cudaMemset(q, 0x38, (size_t)16 * (size_t)max_cols)); /* codes of 1.0 for the skinny alone */
    BENCH_CK(cudaMemset(as, 0, (size_t)16 * (size_t)(max_cols / 128) * 4));
    /* codes 0x38 (1.0) and scales of 2^-10 in every copy: finite sums whatever the kernel */
    {
        const size_t n = c->pool_bytes / 4;
        float *h = malloc(c->pool_bytes);
        if (!h) {
            fprintf(stderr, "bench_gemv: out of host memory\n");
            exit(1);
        }
        for (size_t i = 0; i < n; i++) {
            h[i] = 0x1p-10f;
        }
        BENCH_CK(cudaMemcpy(c->pool, h, c->pool_bytes, cudaMemcpyHostToDevice));
        free(h);
    }
    printf("\nFP8 weights (128 x 128 blocks; us per product and the read rate of codes + scales):\n\n| kernel | n |");
    for (int i = 0; i < N_SHAPES; i++) {
        printf(" %s |", shapes[i].name);
    }
    printf(" products of a step (no LM head) |\n|---|---|");
    for (int i = 0; i <= N_SHAPES; i++) {
        printf("---|");
    }
    printf("\n");
    for (int in = 0; in < n_ns; in++) {
        const int n = ns[in];
        if (n > 16) {
            continue;
        }
        for (int k = 0; k < F_KINDS; k++) {
            printf("| %s | %d |", fp8_names[k], n);
            double step = 0;
            for (int i = 0; i < N_SHAPES; i++) {
                if (i == 6) { /* the LM head is bf16 in an FP8 model */
                    printf(" - |");
                    continue;
                }
                const double us = fp8_time(c, (enum fp8_kind)k, &shapes[i], n, q, as, xq);
                if (us < 0) {
                    printf(" refused |");
                    continue;
                }
                printf(" %.1f us, %.2f TB/s |", us, (double)fp8_bytes(&shapes[i]) / (us * 1e-6) / 1e12);
                step += us * shapes[i].per_step;
            }
            printf(" %.3f ms |\n", step / 1000.0);
            fflush(stdout);
        }
    }
    printf("\nThe step's FP8 products at n = 1 as one graph:\n\n| kernels | ms per step | TB/s |\n|---|---|---|\n");
    for (int k = F_SKINNY; k < F_KINDS; k++) {
        double bytes = 0;
        const double ms = fp8_chain(c, (enum fp8_kind)k, q, as, xq, &bytes);
        printf("| %s | %.3f | %.2f |\n", fp8_names[k], ms, bytes / (ms * 1e-3) / 1e12);
        fflush(stdout);
    }
    cudaFree(q);
    cudaFree(as);
    cudaFree(xq);
}

int main(int argc, char **argv)
{
    int ns[16] = {1, 16, 32}, n_ns = 3, reps = 40;
    const char *json = NULL;
    static const struct option lo[] = {{"n", required_argument, 0, 'n'},
                                       {"reps", required_argument, 0, 'r'},
                                       {"json", required_argument, 0, 'j'},
                                       {"fp8", no_argument, 0, 'f'},
                                       {0, 0, 0, 0}};
    bool fp8 = false;
    int ch;
    while ((ch = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        if (ch == 'n') {
            n_ns = 0;
            for (char *t = strtok(optarg, ","); t && n_ns < 16; t = strtok(NULL, ",")) {
                ns[n_ns++] = atoi(t);
            }
        } else if (ch == 'r') {
            reps = atoi(optarg);
        } else if (ch == 'j') {
            json = optarg;
        } else if (ch == 'f') {
            fp8 = true;
        } else {
            fprintf(stderr, "usage: bench_gemv [--n 1,16,32] [--reps N] [--json FILE] [--fp8]\n");
            return 2;
        }
    }
    if (reps < 1 || n_ns == 0) {
        fprintf(stderr, "bench_gemv: --reps and --n need positive values\n");
        return 2;
    }
    struct kr_switches sw; /* the KRAIT_* table: a refused value is an error here too */
    struct kr_err serr = {0};
    if (kr_switches_from_env(&sw, &serr) != KR_OK) {
        fprintf(stderr, "bench_gemv: %s\n", serr.msg);
        return 2;
    }
    for (int i = 0; i < n_ns; i++) {
        if (ns[i] < 1 || ns[i] > MAX_N) {
            fprintf(stderr, "bench_gemv: n = %d is outside 1..%d\n", ns[i], MAX_N);
            return 2;
        }
    }
    if (krk_device_count() < 1) {
        fprintf(stderr, "bench_gemv: no CUDA device\n");
        return 1;
    }
    struct ctx c = {.reps = reps};
    int64_t max_rows = 0, max_cols = 0;
    size_t max_w = 0;
    for (int i = 0; i < N_SHAPES; i++) {
        max_rows = shapes[i].rows > max_rows ? shapes[i].rows : max_rows;
        max_cols = shapes[i].cols > max_cols ? shapes[i].cols : max_cols;
        const size_t wb = (size_t)shapes[i].rows * (size_t)shapes[i].cols * 2;
        max_w = wb > max_w ? wb : max_w;
    }
    c.pool_bytes = max_w * 2 > ((size_t)1 << 30) ? max_w * 2 : (size_t)1 << 30;
    BENCH_CK(cudaMalloc((void **)&c.pool, c.pool_bytes));
    BENCH_CK(cudaMemset(c.pool, 0x3c, c.pool_bytes)); /* bf16 0x3c3c: 0.0115 */
    BENCH_CK(cudaMalloc((void **)&c.x, (size_t)MAX_N * (size_t)max_cols * 4));
    BENCH_CK(cudaMemset(c.x, 0, (size_t)MAX_N * (size_t)max_cols * 4));
    BENCH_CK(cudaMalloc((void **)&c.xb, (size_t)MAX_N * (size_t)max_cols * 2));
    BENCH_CK(cudaMalloc((void **)&c.y, (size_t)MAX_N * (size_t)max_rows * 4));
    BENCH_CK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
    void *blas_ws = NULL;
    BENCH_CK(cudaMalloc(&blas_ws, 32u << 20));
    if (cublasCreate(&c.blas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(c.blas, c.stream) != CUBLAS_STATUS_SUCCESS ||
        cublasSetWorkspace(c.blas, blas_ws, 32u << 20) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "bench_gemv: cannot create the cuBLAS handle\n");
        return 1;
    }
    BENCH_CK(cudaMalloc(&c.lt_ws, LT_WS));
    c.sk_ws_bytes = krk_skinny_ws_bytes(max_rows + 128);
    BENCH_CK(cudaMalloc(&c.sk_ws, c.sk_ws_bytes));
    BENCH_CK(cudaMemset(c.sk_ws, 0, c.sk_ws_bytes));
    c.st_ws_bytes = krk_stream_ws_bytes();
    BENCH_CK(cudaMalloc(&c.st_ws, c.st_ws_bytes));
    BENCH_CK(cudaMemset(c.st_ws, 0, c.st_ws_bytes));
    if (cublasLtCreate(&c.lt) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "bench_gemv: cannot create the cuBLASLt handle\n");
        return 1;
    }
    char dev[128] = "cuda";
    krk_device_describe(0, dev, sizeof dev);
    if (fp8) {
        BENCH_CK(cudaMemset(c.x, 0, (size_t)MAX_N * (size_t)max_cols * 4));
        fp8_bench(&c, ns, n_ns, max_cols);
        return 0;
    }
    FILE *jf = json ? fopen(json, "w") : NULL;
    /* the step's weights at the copy rate are the products' ceiling (bench_cuda's measure) */
    const double bw = bench_copy_gbs() * 1e9;
    double step_bytes = 0;
    for (int i = 0; i < N_SHAPES; i++) {
        step_bytes += (double)shapes[i].rows * (double)shapes[i].cols * 2 * shapes[i].per_step;
    }
    printf("device: %s; %d products per figure, each on a different copy of the weight (pool %.1f GiB)%s\n", dev,
           reps, (double)c.pool_bytes / (1u << 30), kr_switches_given(&sw, "KRAIT_PDL") ? "; KRAIT_PDL set" : "");
    printf("copy rate %.0f GB/s (read + written): a step's weights (%.2f GB) in %.3f ms at that rate\n\n", bw / 1e9,
           step_bytes / 1e9, step_bytes / bw * 1e3);
    printf("| kernel | n |");
    for (int i = 0; i < N_SHAPES; i++) {
        printf(" %s %lldx%lld |", shapes[i].name, (long long)shapes[i].rows, (long long)shapes[i].cols);
    }
    printf(" GEMVs of a step |\n|---|---|");
    for (int i = 0; i <= N_SHAPES; i++) {
        printf("---|");
    }
    printf("\n");
    for (int in = 0; in < n_ns; in++) {
        const int n = ns[in];
        static const enum kind kinds[] = {K_STAGED, K_CUBLAS, K_SKINNY, K_STREAM};
        for (int ki = 0; ki < 4; ki++) {
            const enum kind k = kinds[ki];
            /* the skinny kernel's other configurations take up to 16 rows, configuration 0 up to
             * KRK_SKINNY_MAX_N (and n = 1: the --batch-invariant path's decode row) */
            const int n_cfg = k == K_STAGED && n <= 2  ? KRK_GEMV_CONFIGS
                              : k == K_SKINNY && n <= 16 ? KRK_SKINNY_CONFIGS
                              : k == K_STREAM            ? KRK_STREAM_CONFIGS
                                                         : 1;
            if ((k == K_STAGED && n > KRK_GEMV_MAX_N) || (k == K_SKINNY && n > KRK_SKINNY_MAX_N) ||
                (k == K_STREAM && n > KRK_STREAM_MAX_N)) {
                continue;
            }
            static const char *const names[] = {"GEMV", "cuBLAS", "cuBLASLt", "skinny (tensor cores)",
                                                "stream (tensor copies, wgmma)"};
            for (int cfg = 0; cfg < n_cfg; cfg++) {
                char label[64];
                snprintf(label, sizeof label, "%s%s%.0d", names[k], cfg ? " config " : "", cfg);
                printf("| %s | %d |", label, n);
                double step_us = 0;
                bool ok = true;
                for (int i = 0; i < N_SHAPES; i++) {
                    const double us = time_one(&c, k, cfg, &shapes[i], n);
                    const double tbs = (double)shapes[i].rows * (double)shapes[i].cols * 2 / (us * 1e-6) / 1e12;
                    if (us < 0) {
                        printf(" refused |");
                        ok = false;
                        continue;
                    }
                    printf(" %.1f us, %.2f TB/s |", us, tbs);
                    step_us += us * shapes[i].per_step;
                    if (jf) {
                        fprintf(jf,
                                "{\"kernel\": \"%s\", \"config\": %d, \"n\": %d, \"shape\": \"%s\", \"rows\": %lld, "
                                "\"cols\": %lld, \"us\": %.3f, \"tb_s\": %.4f}\n",
                                k == K_CUBLAS   ? "cublas"
                                : k == K_SKINNY ? "skinny"
                                : k == K_STREAM ? "stream"
                                                : "gemv",
                                cfg, n, shapes[i].name,
                                (long long)shapes[i].rows, (long long)shapes[i].cols, us, tbs);
                    }
                }
                if (ok) {
                    printf(" %.3f ms (%.0f %% of copy) |\n", step_us / 1000.0, step_bytes / bw * 1e8 / step_us);
                } else {
                    printf(" - |\n");
                }
                fflush(stdout);
            }
        }
        if (n > 1) {
            printf("| cuBLASLt (fastest of its heuristic's algorithms: index, split-K) | %d |", n);
            double step_us = 0;
            bool ok = true;
            for (int i = 0; i < N_SHAPES; i++) {
                int best = -1, split_k = 0;
                const double us = time_lt(&c, &shapes[i], n, &best, &split_k);
                if (us < 0) {
                    printf(" none |");
                    ok = false;
                    continue;
                }
                const double tbs = (double)shapes[i].rows * (double)shapes[i].cols * 2 / (us * 1e-6) / 1e12;
                printf(" %.1f us, %.2f TB/s (#%d, %d) |", us, tbs, best, split_k);
                step_us += us * shapes[i].per_step;
                if (jf) {
                    fprintf(jf,
                            "{\"kernel\": \"cublaslt\", \"algo\": %d, \"split_k\": %d, \"n\": %d, \"shape\": \"%s\", "
                            "\"rows\": %lld, \"cols\": %lld, \"us\": %.3f, \"tb_s\": %.4f}\n",
                            best, split_k, n, shapes[i].name, (long long)shapes[i].rows, (long long)shapes[i].cols,
                            us, tbs);
                }
            }
            if (ok) {
                printf(" %.3f ms (%.0f %% of copy) |\n", step_us / 1000.0, step_bytes / bw * 1e8 / step_us);
            } else {
                printf(" - |\n");
            }
            fflush(stdout);
        }
    }
    /* the GEMV chain of one decode step at n = 1, alone and with small kernels in between, with and
     * without programmatic dependent launch */
    printf("\nThe decode step's GEMVs (n = 1; q, k and v as one) replayed as one graph, with k small kernels\n"
           "(an add over 4096 floats) before each GEMV:\n\n| GEMVs | small kernels per GEMV | programmatic launch | "
           "ms per step | us per small kernel |\n|---|---|---|---|---|\n");
    for (int pdl = 1; pdl >= 0; pdl--) {
        krk_set_pdl(pdl != 0);
        int n_gemv = 0;
        const double t0 = time_chain(&c, 0, &n_gemv);
        for (int small = 0; small <= 4; small += 2) {
            const double t = small ? time_chain(&c, small, &n_gemv) : t0;
            printf("| %d | %d | %s | %.3f | %s", n_gemv, small, pdl ? "on" : "off", t, small ? "" : "- |\n");
            if (small) {
                printf("%.2f |\n", (t - t0) * 1000.0 / ((double)n_gemv * small));
            }
            if (jf) {
                fprintf(jf, "{\"chain\": true, \"small\": %d, \"pdl\": %d, \"ms\": %.4f}\n", small, pdl, t);
            }
        }
    }
    krk_set_pdl(false);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        fprintf(stderr, "bench_gemv: %s\n", cudaGetErrorString(e));
        return 1;
    }
    if (jf) {
        fclose(jf);
    }
    cublasLtDestroy(c.lt);
    cudaFree(c.lt_ws);
    cudaFree(c.sk_ws);
    cublasDestroy(c.blas);
    cudaFree(blas_ws);
    cudaFree(c.pool);
    cudaFree(c.x);
    cudaFree(c.xb);
    cudaFree(c.y);
    cudaStreamDestroy(c.stream);
    return 0;
}
