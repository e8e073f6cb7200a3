/* CUDA backend benchmark (offline, no HTTP): decode ms/step at several batch sizes and prefill
 * tokens/s at several lengths on a checkpoint (the synthetic Nemotron-H-8B shape of
 * tools/bench/synth_model.py), each next to its ceiling measured in the same run:
 *  - copy bandwidth: a device-to-device copy of 2 GiB, bytes read + written over time;
 *  - bf16 GEMM rate: cuBLAS 8192^3 on random bf16 data, fp32 accumulation.
 * A decode step is the forward pass (graph replay) + greedy selection on the GPU + the chosen ids
 * back to the host, timed on the host clock over many steps. Its bytes are every weight matrix
 * once, every sequence's conv and SSM states read and written, its K/V read and new rows written.
 * Prefill is one sequence of L tokens in one step; its FLOPs are the GEMMs' 2 * params * L plus
 * causal attention and the SSD scan. --profile adds a per-kernel-family breakdown (eager steps).
 * Output: a markdown table on stdout and JSON lines (--json FILE). */
#include "cache.h"
#include "model.h"

#include "alloc.h"
#include "clock.h"
#include "log.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "measure.h"
#include "krk.h"

struct gemm_run {
    cublasHandle_t hb;
    void *a, *b, *c;
    int n;
};

static bool gemm_once(void *arg)
{
    const struct gemm_run *g = arg;
    const float one = 1, zero = 0;
    return cublasGemmEx(g->hb, CUBLAS_OP_T, CUBLAS_OP_N, g->n, g->n, g->n, &one, g->a, CUDA_R_16BF, g->n, g->b,
                        CUDA_R_16BF, g->n, &zero, g->c, CUDA_R_16BF, g->n, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
}

/* cuBLAS bf16 GEMM rate in TFLOP/s at m = n = k = 8192 on random data, median of 10. */
static double gemm_rate(void)
{
    const int N = 8192;
    const size_t el = (size_t)N * N;
    uint16_t *h = malloc(el * 2);
    uint32_t s = 1;
    for (size_t i = 0; i < el; i++) {
        s = s * 1664525u + 1013904223u;
        h[i] = kr_f32_to_bf16(((float)(s >> 9) / 8388608.0f - 0.5f));
    }
    void *a, *b, *c;
    BENCH_CK(cudaMalloc(&a, el * 2));
    BENCH_CK(cudaMalloc(&b, el * 2));
    BENCH_CK(cudaMalloc(&c, el * 2));
    BENCH_CK(cudaMemcpy(a, h, el * 2, cudaMemcpyHostToDevice));
    BENCH_CK(cudaMemcpy(b, h, el * 2, cudaMemcpyHostToDevice));
    free(h);
    struct gemm_run g = {.a = a, .b = b, .c = c, .n = N};
    cublasCreate(&g.hb);
    const double ms = bench_events_ms(gemm_once, &g, 3, 10);
    cublasDestroy(g.hb);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    if (ms < 0) {
        fprintf(stderr, "bench_cuda: the bf16 cuBLAS GEMM failed\n");
        return 0;
    }
    return 2.0 * N * (double)N * N / (ms * 1e-3) / 1e12;
}

struct fp8_run {
    bool block;
    struct krk_fp8_lt *lt;
    const struct krk_fp8_mm_params *p;
    cublasLtHandle_t hl;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, ld;
    const cublasLtMatmulAlgo_t *algo;
    void *a, *b, *c, *ws;
    size_t ws_bytes;
};

static bool fp8_once(void *arg)
{
    const struct fp8_run *f = arg;
    const float one = 1, zero = 0;
    if (f->block) {
        return krk_fp8_gemm_lt(f->lt, f->p, 0) == KR_OK;
    }
    return cublasLtMatmul(f->hl, f->op, &one, f->a, f->la, f->b, f->lb, &zero, f->c, f->ld, f->c, f->ld, f->algo,
                          f->ws, f->ws_bytes, 0) == CUBLAS_STATUS_SUCCESS;
}

/* FP8 GEMM rate in TFLOP/s at m = n = k = 8192, median of 10: cuBLASLt's block-scaled matmul as the
 * backend calls it (block = true: 128 x 128 weight scales, activation scales per 128, fp32 out), or
 * its plain FP8 matmul (per-tensor scales of 1, bf16 out): the tensor cores' FP8 rate. */
static double fp8_rate(bool block)
{
    const int N = 8192;
    const size_t el = (size_t)N * N, nkb = N / 128;
    uint8_t *h = malloc(el);
    float *hs = malloc(nkb * N * 4);
    uint32_t s = 3;
    for (size_t i = 0; i < el; i++) {
        s = s * 1664525u + 1013904223u;
        h[i] = (uint8_t)((s >> 24) & 0x77); /* finite codes of both signs below 2^8 */
    }
    for (size_t i = 0; i < nkb * N; i++) {
        hs[i] = 1.0f / 64;
    }
    void *a, *b, *c, *sa, *sb, *ws;
    const size_t wsb = (size_t)32 << 20;
    BENCH_CK(cudaMalloc(&a, el));
    BENCH_CK(cudaMalloc(&b, el));
    BENCH_CK(cudaMalloc(&c, el * 4));
    BENCH_CK(cudaMalloc(&sa, nkb * N * 4));
    BENCH_CK(cudaMalloc(&sb, nkb * N * 4));
    BENCH_CK(cudaMalloc(&ws, wsb));
    BENCH_CK(cudaMemcpy(a, h, el, cudaMemcpyHostToDevice));
    BENCH_CK(cudaMemcpy(b, h, el, cudaMemcpyHostToDevice));
    BENCH_CK(cudaMemcpy(sa, hs, nkb * N * 4, cudaMemcpyHostToDevice));
    BENCH_CK(cudaMemcpy(sb, hs, nkb * N * 4, cudaMemcpyHostToDevice));
    free(h);
    free(hs);
    struct krk_fp8_lt *lt = krk_fp8_lt_create(ws, wsb);
    cublasLtHandle_t hl = NULL;
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
    cublasLtMatmulHeuristicResult_t res = {0};
    if (!block) {
        const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        cublasLtMatmulPreference_t pref;
        int n_res = 0;
        if (cublasLtCreate(&hl) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, N, N, N) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, N, N, N) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, N, N, N) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb) !=
                CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoGetHeuristic(hl, op, la, lb, ld, ld, pref, 1, &res, &n_res) != CUBLAS_STATUS_SUCCESS ||
            n_res < 1) {
            fprintf(stderr, "bench_cuda: no plain FP8 cuBLASLt matmul\n");
            return 0;
        }
        cublasLtMatmulPreferenceDestroy(pref);
    }
    const struct krk_fp8_mm_params p = {.q = b, .ldq = N, .scale = sb, .s_ld = N, .n = N,
                                        .w = {.q = a, .scale = sa, .rows = N, .cols = N, .ld_s = N / 128,
                                              .block_r = 128, .block_c = 128},
                                        .y = c, .ldy = N};
    struct fp8_run f = {.block = block, .lt = lt, .p = &p, .hl = hl, .op = op, .la = la, .lb = lb,
                        .ld = ld, .algo = &res.algo, .a = a, .b = b, .c = c, .ws = ws, .ws_bytes = res.workspaceSize};
    const double ms = bench_events_ms(fp8_once, &f, 3, 10);
    if (!block) {
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(ld);
        cublasLtMatmulDescDestroy(op);
        cublasLtDestroy(hl);
    }
    krk_fp8_lt_free(lt);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    cudaFree(sa);
    cudaFree(sb);
    cudaFree(ws);
    if (ms < 0) {
        fprintf(stderr, "bench_cuda: the %s FP8 matmul failed\n", block ? "block-scaled" : "plain");
        return 0;
    }
    return 2.0 * N * (double)N * N / (ms * 1e-3) / 1e12;
}

/* Bytes of a weight matrix: bf16 elements, or FP8 codes with their fp32 block scales. */
static double mat_bytes(const struct kr_tensor *t)
{
    if (!t->data) {
        return 0;
    }
    const double el = (double)t->rows * (double)t->cols;
    if (t->dtype == KR_DTYPE_F8_E4M3) {
        return el + 4.0 * (double)((t->rows + t->block_r - 1) / t->block_r) *
                        (double)((t->cols + t->block_c - 1) / t->block_c);
    }
    return el * (double)kr_dtype_size(t->dtype);
}

/* Bytes of weight matrices one decode step reads (the embedding gathers rows only), and their
 * elements (*params, for the prefill's FLOPs). */
static double weight_bytes_params(const struct kr_model *m, double *params)
{
    const struct kr_model_config *c = &m->cfg;
    double b = mat_bytes(&m->lm_head), p = (double)m->lm_head.rows * (double)m->lm_head.cols;
#define W(t)                                                                                           do {                                                                                                   b += mat_bytes(&(t));                                                                              p += (t).data ? (double)(t).rows * (double)(t).cols : 0.0;                                     } while (0)
    for (int32_t i = 0; i < c->n_layer; i++) {
        const struct kr_layer *L = &m->layers[i];
        switch (L->type) {
        case KR_LAYER_MAMBA:
            W(L->mamba.in_proj);
            W(L->mamba.out_proj);
            break;
        case KR_LAYER_ATTN:
            W(L->attn.q);
            W(L->attn.k);
            W(L->attn.v);
            W(L->attn.o);
            break;
        case KR_LAYER_MLP:
            W(L->mlp.up);
            W(L->mlp.down);
            W(L->mlp.gate);
            break;
        case KR_LAYER_MOE: { /* the routed experts a token uses, the router, the shared expert */
            if (L->moe.has_shared) {
                W(L->moe.shared.up);
                W(L->moe.shared.down);
                W(L->moe.shared.gate);
            }
            const double per = (double)((L->moe.gate ? 3 : 2) * c->moe_ffn * c->dim);
            const double elt = L->moe.up[0].dtype == KR_DTYPE_F8_E4M3 ? 1.0 + 4.0 / (128.0 * 128.0) : 2.0;
            b += (double)c->n_expert_used * per * elt + 2.0 * (double)(c->n_expert * c->dim);
            p += (double)c->n_expert_used * per + (double)(c->n_expert * c->dim);
            break;
        }
        case KR_LAYER_DSA:
        case KR_LAYER_MLA: {
            const struct kr_mla_w *w = &L->mla;
            W(w->q_a);
            W(w->q_b);
            W(w->kv_a);
            W(w->o);
            b += 4.0 * (double)(c->mla_heads * (c->qk_nope + c->v_head) * c->kv_lora);
            p += (double)(c->mla_heads * (c->qk_nope + c->v_head) * c->kv_lora);
            if (w->has_indexer) {
                W(w->idx_wq_b);
                W(w->idx_wk);
                W(w->idx_w);
            }
            break;
        }
        default:
            break;
        }
    }
#undef W
    if (params) {
        *params = p;
    }
    return b;
}

static double weight_bytes(const struct kr_model *m)
{
    return weight_bytes_params(m, NULL);
}

/* The weight bytes of a decode step of B sequences: weight_bytes() counts n_expert_used routed
 * experts per MoE layer; B tokens touch more, E (1 - (1 - k/E)^B) distinct ones on average when the
 * router picks uniformly and independently (random weights route close to that). */
static double weight_bytes_batch(const struct kr_model *m, int32_t B)
{
    const struct kr_model_config *c = &m->cfg;
    double b = weight_bytes(m);
    for (int32_t i = 0; i < c->n_layer; i++) {
        const struct kr_layer *L = &m->layers[i];
        if (L->type != KR_LAYER_MOE || c->n_expert < 1) {
            continue;
        }
        const double E = (double)c->n_expert, k = (double)c->n_expert_used;
        const double touched = E * (1.0 - pow(1.0 - k / E, (double)B));
        const double per = (double)((L->moe.gate ? 3 : 2) * c->moe_ffn * c->dim);
        const double elt = L->moe.up[0].dtype == KR_DTYPE_F8_E4M3 ? 1.0 + 4.0 / (128.0 * 128.0) : 2.0;
        b += (touched > k ? touched - k : 0.0) * per * elt;
    }
    return b;
}

/* Per-sequence bytes of a decode step at context ctx: states read + written, K/V or latent rows
 * read (the new row written). */
static double seq_bytes(const struct kr_model *m, int64_t ctx)
{
    const struct kr_model_config *c = &m->cfg;
    double b = 0;
    b += (double)m->n_mamba * 2.0 *
         ((double)(c->m_heads * c->m_head_dim * c->m_state) * 4.0 + (double)((c->m_conv - 1) * c->m_conv_dim) * 2.0);
    b += (double)m->n_attn * 2.0 * (double)(c->n_kv_head * c->head_dim) * 2.0 * (double)(ctx + 1);
    for (int32_t i = 0; i < c->n_layer; i++) {
        const double lat = (double)(c->kv_lora + c->qk_rope) * 2.0;
        if (m->layers[i].type == KR_LAYER_DSA) { /* every indexer key, the selected latents */
            const double sel = (double)(ctx + 1 < c->idx_topk ? ctx + 1 : c->idx_topk);
            b += (double)(ctx + 1) * (double)c->idx_head_dim * 2.0 + sel * lat + lat + (double)c->idx_head_dim * 2.0;
        } else if (m->layers[i].type == KR_LAYER_MLA) { /* every latent */
            b += (double)(ctx + 2) * lat;
        }
    }
    return b;
}


/* FLOPs of a prefill of L tokens from empty caches. */
static double prefill_flops(const struct kr_model *m, double L, double *gemm_part)
{
    const struct kr_model_config *c = &m->cfg;
    double params;
    (void)weight_bytes_params(m, &params);
    const double gemm = params * 2.0 * L - 2.0 * (double)m->lm_head.rows * m->lm_head.cols * (L - 1);
    double f = gemm;
    f += (double)m->n_attn * 4.0 * (double)(c->n_head * c->head_dim) * L * L / 2.0;
    const double Q = (double)c->m_chunk, H = (double)c->m_heads, P = (double)c->m_head_dim, N = (double)c->m_state;
    if (m->n_mamba > 0 && c->m_groups > 0) { /* (MLA/DSA attention is not counted: its products only) */
        f += (double)m->n_mamba * 2.0 * L * H * (Q * N / (H / (double)c->m_groups) + Q * P / 2.0 + 2.0 * N * P);
    }
    *gemm_part = gemm;
    return f;
}

struct ctx {
    struct kr_model *m;
    struct kr_cache *c;
    kr_backend_t be;
    void *sample_ws;
    size_t sample_ws_bytes;
    struct krk_sample_row *rows_d;
    int32_t *ids_d;
    FILE *json;
    double bw, tflops;
    bool fill;              /* caches hold random data instead of a real prefill */
};

/* Fills a device buffer with random values: bf16 in [-1, 1] (elt 2) or fp32 in [-0.1, 0.1]. */
static void fill_random(void *dev, size_t bytes, int elt)
{
    const size_t chunk = (size_t)64 << 20;
    void *h = malloc(chunk);
    uint32_t s = 99;
    for (size_t i = 0; i < chunk / 4; i++) {
        s = s * 1664525u + 1013904223u;
        const float f = ((float)(s >> 8) / 16777216.0f * 2.0f - 1.0f);
        if (elt == 2) {
            ((uint16_t *)h)[2 * i] = kr_f32_to_bf16(f);
            ((uint16_t *)h)[2 * i + 1] = kr_f32_to_bf16(-0.5f * f);
        } else {
            ((float *)h)[i] = 0.1f * f;
        }
    }
    for (size_t o = 0; o < bytes; o += chunk) {
        BENCH_CK(cudaMemcpy((char *)dev + o, h, bytes - o < chunk ? bytes - o : chunk, cudaMemcpyHostToDevice));
    }
    free(h);
}

/* Cache bytes per token (K/V and latent rows, all layers) and per sequence (Mamba states). */
static void cache_unit_report(struct ctx *x)
{
    const struct kr_model_config *c = &x->m->cfg;
    double kv = (double)x->m->n_attn * 2.0 * (double)(c->n_kv_head * c->head_dim) * 2.0, lat = 0;
    for (int32_t i = 0; i < c->n_layer; i++) {
        if (x->m->layers[i].type == KR_LAYER_DSA || x->m->layers[i].type == KR_LAYER_MLA) {
            lat += (double)(c->kv_lora + c->qk_rope + (x->m->layers[i].type == KR_LAYER_DSA ? c->idx_head_dim : 0)) * 2.0;
        }
    }
    const double st = (double)x->m->n_mamba * ((double)(c->m_heads * c->m_head_dim * c->m_state) * 4.0 +
                                               (double)((c->m_conv - 1) * c->m_conv_dim) * 2.0);
    printf("cache: K/V %.0f B/token, latent (c_kv | k_pe | indexer key) %.0f B/token, Mamba states %.2f MiB/sequence\n",
           kv, lat, st / (1 << 20));
    if (x->json) {
        fprintf(x->json, "{\"kind\":\"cache\",\"kv_bytes_per_token\":%.0f,\"latent_bytes_per_token\":%.0f,"
                         "\"state_bytes_per_seq\":%.0f}\n", kv, lat, st);
    }
}

/* Greedy ids of the last step's n logits rows, chosen on the GPU, into host ids. */
static void gpu_greedy(struct ctx *x, int32_t n, int32_t *ids)
{
    BENCH_CK(cudaDeviceSynchronize()); /* the step ran on the backend's stream */
    const struct krk_sample_params p = {.logits = x->m->last_logits, .ld = x->m->cfg.vocab, .n = n,
                                        .vocab = x->m->cfg.vocab, .rows = x->rows_d, .out = x->ids_d};
    const struct krk_ctx k = {.workspace = x->sample_ws, .workspace_bytes = x->sample_ws_bytes};
    if (krk_sample(&p, &k) != KR_OK) {
        fprintf(stderr, "bench_cuda: krk_sample failed\n");
        exit(1);
    }
    BENCH_CK(cudaMemcpy(ids, x->ids_d, (size_t)n * 4, cudaMemcpyDeviceToHost));
    for (int32_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= x->m->cfg.vocab) {
            fprintf(stderr, "bench_cuda: greedy id %d of row %d is outside the vocabulary\n", ids[i], i);
            exit(1);
        }
    }
}

static void forward(struct ctx *x, const struct kr_batch *b)
{
    struct kr_err err = {0};
    if (kr_model_forward(x->m, x->c, b, NULL, &err) != KR_OK) {
        fprintf(stderr, "bench_cuda: forward (%d tokens, %d sequences): %s\n", b->n_tok, b->n_seq, err.msg);
        exit(1);
    }
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        fprintf(stderr, "bench_cuda: step of %d tokens in %d sequences: %s\n", b->n_tok, b->n_seq,
                cudaGetErrorString(e));
        exit(1);
    }
}

/* Prefills B sequences with ctx random tokens each, then times `steps` greedy decode steps. With
 * k > 0 each step is a verification step of speculative decoding instead: every sequence feeds 1 + k
 * tokens at consecutive positions, each an output row chosen greedily on the GPU (and, with
 * host_logits, all rows' logits copied to the host, as the engine's host-side verification does);
 * positions advance by 1 + k per step. Such steps have more tokens than sequences: no graph. */
static double bench_decode_k(struct ctx *x, int32_t B, int32_t ctx, int32_t steps, bool quiet, bool profile,
                             int32_t k, bool host_logits)
{
    struct kr_seq_cache *sc = kr_calloc((size_t)B, sizeof *sc);
    const int32_t r = 1 + k; /* rows per sequence and step */
    const int32_t maxb = (ctx + steps * r + 8 * r) / x->c->block_size + 2;
    size_t nt_max = x->fill ? (size_t)B : (size_t)B * (size_t)(ctx < 8192 ? ctx : 8192) + (size_t)B;
    nt_max = nt_max > (size_t)B * (size_t)r ? nt_max : (size_t)B * (size_t)r;
    float *host = host_logits ? kr_malloc((size_t)B * (size_t)r * (size_t)x->m->cfg.vocab * sizeof(float)) : NULL;
    int32_t *tok = kr_malloc(nt_max * 4), *pos = kr_malloc(nt_max * 4);
    int32_t *tok0 = kr_malloc(((size_t)B + 1) * 4), *pos0 = kr_malloc((size_t)B * 4), *slot = kr_malloc((size_t)B * 4);
    int32_t *bt = kr_calloc((size_t)B * (size_t)maxb, 4), *out = kr_malloc(nt_max * 4);
    /* a verification step of a model with Mamba layers keeps the states after every token but each
     * sequence's last (the engine's tok_state_slot), in slots of their own */
    const int32_t n_keep = k > 0 && x->m->n_mamba > 0 ? B * k : 0;
    struct kr_seq_cache *kc = n_keep ? kr_calloc((size_t)n_keep, sizeof *kc) : NULL;
    int32_t *keep = n_keep ? kr_malloc((size_t)B * (size_t)r * 4) : NULL;
    for (int32_t i = 0; i < n_keep; i++) {
        if (kr_seq_cache_init(x->c, &kc[i]) != KR_OK) {
            fprintf(stderr, "bench_cuda: no state slot left for the kept states of batch %d, k %d\n", B, k);
            exit(1);
        }
    }
    for (int32_t i = 0; i < B && keep; i++) {
        for (int32_t j = 0; j < r; j++) {
            keep[i * r + j] = j < k ? kc[i * k + j].slot : -1;
        }
    }
    uint32_t s = 7;
    for (int32_t i = 0; i < B; i++) {
        if (kr_seq_cache_init(x->c, &sc[i]) != KR_OK ||
            kr_seq_cache_reserve(x->c, &sc[i], ctx + (steps + 3) * r + 4) != KR_OK) {
            fprintf(stderr, "bench_cuda: cache too small for batch %d at context %d\n", B, ctx);
            exit(1);
        }
    }
    /* prefill in steps of at most 8192 tokens (whole sequences), unless the caches hold random data */
    const int32_t per_step = 8192 / ctx > 0 ? 8192 / ctx : 1;
    for (int32_t s0 = 0; s0 < B && !x->fill; s0 += per_step) {
        const int32_t ns = B - s0 < per_step ? B - s0 : per_step;
        int32_t nt = 0;
        for (int32_t j = 0; j < ns; j++) {
            const int32_t i = s0 + j;
            tok0[j] = nt;
            pos0[j] = 0;
            slot[j] = sc[i].slot;
            memcpy(bt + (size_t)j * maxb, sc[i].blocks, (size_t)sc[i].n_blocks * 4);
            for (int32_t t = 0; t < ctx; t++, nt++) {
                s = s * 1664525u + 1013904223u;
                tok[nt] = (int32_t)((s >> 8) % (uint32_t)x->m->cfg.vocab);
                pos[nt] = t;
            }
            out[j] = nt - 1;
        }
        tok0[ns] = nt;
        struct kr_batch b = {.n_tok = nt, .n_seq = ns, .tokens = tok, .pos = pos, .seq_tok0 = tok0,
                             .seq_pos0 = pos0, .seq_slot = slot, .block_table = bt, .max_blocks = maxb,
                             .n_out = ns, .out_tok = out};
        forward(x, &b);
    }
    for (int32_t i = 0; i < B; i++) {
        slot[i] = sc[i].slot;
        memcpy(bt + (size_t)i * maxb, sc[i].blocks, (size_t)sc[i].n_blocks * 4);
        tok0[i] = i * r;
    }
    for (int32_t t = 0; t < B * r; t++) {
        out[t] = t;
        tok[t] = (int32_t)(t * 7919 % x->m->cfg.vocab);
    }
    tok0[B] = B * r;
    if (profile) {
        kr_backend_cuda_profile(x->be, true); /* time the decode steps only, not the prefill above */
    }
    const int warm = 3;
    double t0 = 0;
    for (int32_t st = 0; st < warm + steps; st++) {
        if (st == warm) {
            BENCH_CK(cudaDeviceSynchronize());
            t0 = kr_clock_s();
        }
        for (int32_t i = 0; i < B; i++) {
            pos0[i] = ctx + st * r;
            for (int32_t j = 0; j < r; j++) {
                pos[i * r + j] = pos0[i] + j;
            }
        }
        struct kr_batch b = {.n_tok = B * r, .n_seq = B, .tokens = tok, .pos = pos, .seq_tok0 = tok0,
                             .seq_pos0 = pos0, .seq_slot = slot, .block_table = bt, .max_blocks = maxb,
                             .n_out = B * r, .out_tok = out, .tok_state_slot = keep};
        forward(x, &b);
        gpu_greedy(x, B * r, tok);
        if (host) {
            const size_t bytes = (size_t)B * (size_t)r * (size_t)x->m->cfg.vocab * sizeof(float);
            BENCH_CK(cudaMemcpy(host, x->m->last_logits, bytes, cudaMemcpyDeviceToHost));
        }
    }
    const double ms = (kr_clock_s() - t0) / steps * 1e3;
    kr_free(host);
    for (int32_t i = 0; i < B; i++) {
        kr_seq_cache_release(x->c, &sc[i]);
    }
    kr_free(sc);
    for (int32_t i = 0; i < n_keep; i++) {
        kr_seq_cache_release(x->c, &kc[i]);
    }
    kr_free(kc);
    kr_free(keep);
    kr_free(tok);
    kr_free(pos);
    kr_free(tok0);
    kr_free(pos0);
    kr_free(slot);
    kr_free(bt);
    kr_free(out);
    if (!quiet && k == 0) { /* verification steps: the caller (bench_spec) reports them */
        const double bytes = weight_bytes_batch(x->m, B) + (double)B * seq_bytes(x->m, ctx + steps / 2);
        const double ceil_ms = bytes / (x->bw * 1e9) * 1e3;
        printf("| decode | batch %d, context %d | %.3f ms/step | %.0f tok/s | %.2f GB/step | %.3f ms | %.0f%% |\n", B,
               ctx, ms, B / ms * 1e3, bytes / 1e9, ceil_ms, 100.0 * ceil_ms / ms);
        if (x->json) {
            fprintf(x->json,
                    "{\"kind\":\"decode\",\"batch\":%d,\"ctx\":%d,\"ms_per_step\":%.4f,\"tok_per_s\":%.1f,"
                    "\"bytes_per_step\":%.0f,\"ceiling_ms\":%.4f,\"fraction\":%.4f}\n",
                    B, ctx, ms, B / ms * 1e3, bytes, ceil_ms, ceil_ms / ms);
        }
        fflush(stdout);
    }
    return ms;
}

static double bench_decode(struct ctx *x, int32_t B, int32_t ctx, int32_t steps, bool quiet, bool profile)
{
    return bench_decode_k(x, B, ctx, steps, quiet, profile, 0, false);
}

/* The cost side of speculative decoding at batch B: plain decode steps (graphs) against verification
 * steps of 1 + k rows per sequence, as ms per generated token when a step keeps L tokens per
 * sequence on average (L = 1 + accepted drafts: 1.5, 2.5, 3.5, where L <= 1 + k), and the break-even
 * L (the verification step's time over the plain step's). The acceptance is set by construction,
 * not measured: only the time of the steps is. */
static void bench_spec(struct ctx *x, int32_t B, int32_t ctx, int32_t steps, const int32_t *ks, int nk)
{
    const double plain = bench_decode(x, B, ctx, steps, true, false);
    static const double Ls[3] = {1.5, 2.5, 3.5};
    for (int i = 0; i < nk; i++) {
        const int32_t k = ks[i];
        const double ms = bench_decode_k(x, B, ctx, steps, true, false, k, false);
        const double ms_h = bench_decode_k(x, B, ctx, steps, true, false, k, true);
        char per[160] = "";
        size_t o = 0;
        for (int j = 0; j < 3; j++) {
            if (Ls[j] <= 1 + k) {
                o += (size_t)snprintf(per + o, sizeof per - o, "%sL %.1f: %.3f", o ? ", " : "", Ls[j], ms_h / Ls[j]);
            }
        }
        printf("| verify k=%d | batch %d, context %d | %.3f ms/step (%.3f with the logits to the host) | plain %.3f "
               "ms/token | ms/token at %s | break-even L %.2f (%.2f on the device alone) |\n",
               k, B, ctx, ms, ms_h, plain, per, ms_h / plain, ms / plain);
        if (x->json) {
            fprintf(x->json,
                    "{\"kind\":\"spec_verify\",\"batch\":%d,\"ctx\":%d,\"k\":%d,\"ms_per_step\":%.4f,"
                    "\"ms_per_step_host_logits\":%.4f,\"plain_ms_per_step\":%.4f,\"break_even_L\":%.4f,"
                    "\"break_even_L_device\":%.4f}\n",
                    B, ctx, k, ms, ms_h, plain, ms_h / plain, ms / plain);
        }
        fflush(stdout);
    }
}

static double bench_prefill(struct ctx *x, int32_t L, int reps, bool quiet)
{
    int32_t *tok = kr_malloc((size_t)L * 4), *pos = kr_malloc((size_t)L * 4);
    uint32_t s = 11;
    for (int32_t t = 0; t < L; t++) {
        s = s * 1664525u + 1013904223u;
        tok[t] = (int32_t)((s >> 8) % (uint32_t)x->m->cfg.vocab);
        pos[t] = t;
    }
    double t_s[16];
    for (int r = 0; r < reps + 1; r++) {
        struct kr_seq_cache sc;
        if (kr_seq_cache_init(x->c, &sc) != KR_OK || kr_seq_cache_reserve(x->c, &sc, L) != KR_OK) {
            fprintf(stderr, "bench_cuda: cache too small for a prefill of %d\n", L);
            exit(1);
        }
        int32_t tok0[2] = {0, L}, pos0 = 0, out = L - 1;
        struct kr_batch b = {.n_tok = L, .n_seq = 1, .tokens = tok, .pos = pos, .seq_tok0 = tok0, .seq_pos0 = &pos0,
                             .seq_slot = &sc.slot, .block_table = sc.blocks, .max_blocks = sc.n_blocks, .n_out = 1,
                             .out_tok = &out};
        BENCH_CK(cudaDeviceSynchronize());
        const double t0 = kr_clock_s();
        forward(x, &b);
        BENCH_CK(cudaDeviceSynchronize());
        if (r > 0) {
            t_s[r - 1] = kr_clock_s() - t0;
        }
        kr_seq_cache_release(x->c, &sc);
    }
    const double t = bench_median(t_s, reps);
    kr_free(tok);
    kr_free(pos);
    if (!quiet) {
        double gemm;
        const double f = prefill_flops(x->m, L, &gemm);
        const double ceil_s = f / (x->tflops * 1e12);
        printf("| prefill | %d tokens | %.1f ms | %.0f tok/s | %.1f TFLOP | %.1f ms | %.0f%% (GEMMs %.0f TFLOP/s) |\n", L,
               t * 1e3, L / t, f / 1e12, ceil_s * 1e3, 100.0 * ceil_s / t, gemm / t / 1e12);
        if (x->json) {
            fprintf(x->json,
                    "{\"kind\":\"prefill\",\"tokens\":%d,\"ms\":%.3f,\"tok_per_s\":%.1f,\"flops\":%.4g,"
                    "\"ceiling_ms\":%.3f,\"fraction\":%.4f,\"gemm_tflops\":%.1f}\n",
                    L, t * 1e3, L / t, f, ceil_s * 1e3, ceil_s / t, gemm / t / 1e12);
        }
        fflush(stdout);
    }
    return t;
}

/* --logprobs FILE [--logprobs-ref REF]: a prefill of L random tokens (fixed seed) with logits at every
 * position; FILE gets, per position, the log-probability of the next prompt token and the 20 most
 * likely ids with theirs. With REF (such a file from another run: bf16 against FP8) the deviation of
 * this run from it is printed: |delta| of the next-token log-probabilities and of REF's top 20, and
 * how often the most likely id agrees. */
#define LP_TOP 20
struct lp_row {
    float next;
    int32_t id[LP_TOP];
    float lp[LP_TOP];
};

static void logprob_run(struct ctx *x, int32_t L, const char *out_path, const char *ref_path)
{
    const int64_t V = x->m->cfg.vocab;
    int32_t *tok = kr_malloc((size_t)L * 4), *pos = kr_malloc((size_t)L * 4), *outs = kr_malloc((size_t)L * 4);
    float *lg = kr_malloc((size_t)L * (size_t)V * 4);
    struct lp_row *rows = kr_calloc((size_t)L, sizeof *rows), *ref = NULL;
    if (!tok || !pos || !outs || !lg || !rows) {
        fprintf(stderr, "bench_cuda: --logprobs: out of memory\n");
        exit(1);
    }
    uint32_t s = 13;
    for (int32_t t = 0; t < L; t++) {
        s = s * 1664525u + 1013904223u;
        tok[t] = (int32_t)((s >> 8) % (uint32_t)V);
        pos[t] = t;
        outs[t] = t;
    }
    struct kr_seq_cache sc;
    if (kr_seq_cache_init(x->c, &sc) != KR_OK || kr_seq_cache_reserve(x->c, &sc, L) != KR_OK) {
        fprintf(stderr, "bench_cuda: cache too small for a prefill of %d\n", L);
        exit(1);
    }
    int32_t tok0[2] = {0, L}, pos0 = 0;
    struct kr_batch b = {.n_tok = L, .n_seq = 1, .tokens = tok, .pos = pos, .seq_tok0 = tok0, .seq_pos0 = &pos0,
                         .seq_slot = &sc.slot, .block_table = sc.blocks, .max_blocks = sc.n_blocks, .n_out = L,
                         .out_tok = outs};
    struct kr_err err = {0};
    if (kr_model_forward(x->m, x->c, &b, lg, &err) != KR_OK) {
        fprintf(stderr, "bench_cuda: --logprobs forward: %s\n", err.msg);
        exit(1);
    }
    kr_seq_cache_release(x->c, &sc);
    for (int32_t t = 0; t < L; t++) { /* log-softmax in double, the top 20 by selection */
        float *r = lg + (size_t)t * (size_t)V;
        double mx = -INFINITY, sum = 0;
        for (int64_t v = 0; v < V; v++) {
            mx = r[v] > mx ? r[v] : mx;
        }
        for (int64_t v = 0; v < V; v++) {
            sum += exp((double)r[v] - mx);
        }
        const double lse = mx + log(sum);
        for (int64_t v = 0; v < V; v++) {
            r[v] = (float)((double)r[v] - lse);
        }
        struct lp_row *o = &rows[t];
        o->next = t + 1 < L ? r[tok[t + 1]] : 0.0f;
        for (int k = 0; k < LP_TOP; k++) {
            o->id[k] = -1;
            o->lp[k] = -INFINITY;
        }
        for (int64_t v = 0; v < V; v++) {
            if (r[v] <= o->lp[LP_TOP - 1]) {
                continue;
            }
            int k = LP_TOP - 1;
            while (k > 0 && o->lp[k - 1] < r[v]) {
                o->lp[k] = o->lp[k - 1];
                o->id[k] = o->id[k - 1];
                k--;
            }
            o->lp[k] = r[v];
            o->id[k] = (int32_t)v;
        }
    }
    if (ref_path) {
        FILE *f = fopen(ref_path, "rb");
        int32_t hdr[2] = {0, 0};
        ref = kr_calloc((size_t)L, sizeof *ref);
        if (!f || !ref || fread(hdr, 4, 2, f) != 2 || hdr[0] != L || hdr[1] != (int32_t)V ||
            fread(ref, sizeof *ref, (size_t)L, f) != (size_t)L) {
            fprintf(stderr, "bench_cuda: --logprobs-ref %s: not a dump of %d positions over vocab %lld\n", ref_path,
                    L, (long long)V);
            exit(1);
        }
        fclose(f);
        double sn = 0, mn = 0, st = 0, mt = 0;
        int64_t agree = 0, nt = 0;
        for (int32_t t = 0; t < L; t++) {
            const float *r = lg + (size_t)t * (size_t)V;
            if (t + 1 < L) {
                const double d = fabs((double)rows[t].next - ref[t].next);
                sn += d;
                mn = d > mn ? d : mn;
            }
            for (int k = 0; k < LP_TOP; k++) {
                const double d = fabs((double)r[ref[t].id[k]] - ref[t].lp[k]);
                st += d;
                mt = d > mt ? d : mt;
                nt++;
            }
            agree += rows[t].id[0] == ref[t].id[0];
        }
        printf("logprobs against %s (%d positions): next token mean |d| %.4f max %.4f; the reference's top %d "
               "mean |d| %.4f max %.4f; most likely id agrees at %.1f%% of positions\n",
               ref_path, L, sn / (L - 1), mn, LP_TOP, st / (double)nt, mt, 100.0 * (double)agree / L);
        if (x->json) {
            fprintf(x->json,
                    "{\"kind\":\"logprob_dev\",\"positions\":%d,\"next_mean\":%.5f,\"next_max\":%.5f,"
                    "\"top_mean\":%.5f,\"top_max\":%.5f,\"top1_agree\":%.4f}\n",
                    L, sn / (L - 1), mn, st / (double)nt, mt, (double)agree / L);
        }
        kr_free(ref);
    }
    if (out_path) {
        FILE *f = fopen(out_path, "wb");
        const int32_t hdr[2] = {L, (int32_t)V};
        if (!f || fwrite(hdr, 4, 2, f) != 2 || fwrite(rows, sizeof *rows, (size_t)L, f) != (size_t)L || fclose(f)) {
            fprintf(stderr, "bench_cuda: cannot write %s\n", out_path);
            exit(1);
        }
        printf("logprobs of %d positions written to %s\n", L, out_path);
    }
    fflush(stdout);
    kr_free(tok);
    kr_free(pos);
    kr_free(outs);
    kr_free(lg);
    kr_free(rows);
}

static void profile_report(struct ctx *x, const char *what, int steps)
{
    const char *names[32];
    double ms[32];
    int64_t calls[32];
    const int n = kr_backend_cuda_profile_read(x->be, names, ms, calls, 32);
    double tot = 0;
    for (int i = 0; i < n; i++) {
        tot += strchr(names[i], ':') ? 0.0 : ms[i]; /* "ssd: ...", "dsa: ..." rows are parts of a family */
    }
    printf("\n%s: kernel time per step by family (eager, CUDA events around each op)\n\n| family | ms/step | share | launches/step |\n|---|---|---|---|\n", what);
    for (int i = 0; i < n; i++) {
        if (calls[i]) {
            printf("| %s | %.3f | %.0f%% | %.0f |\n", names[i], ms[i] / steps, 100 * ms[i] / tot,
                   (double)calls[i] / steps);
            if (x->json) {
                fprintf(x->json, "{\"kind\":\"profile\",\"what\":\"%s\",\"family\":\"%s\",\"ms_per_step\":%.4f,\"launches\":%.1f}\n",
                        what, names[i], ms[i] / steps, (double)calls[i] / steps);
            }
        }
    }
    printf("| total | %.3f | | |\n", tot / steps);
}

static int parse_list(const char *s, int32_t *v, int cap)
{
    int n = 0;
    while (s && *s && n < cap) {
        v[n++] = (int32_t)strtol(s, (char **)&s, 10);
        if (*s == ',') {
            s++;
        }
    }
    return n;
}

int main(int argc, char **argv)
{
    int32_t batches[16] = {1, 16, 64, 256}, prefills[8] = {2048, 8192}, ctxs[8] = {256};
    int32_t case_b[16], case_ctx[16];
    int nb = 4, np = 2, nc = 1, ncase = 0, steps = 32, ctx = 256, profile = 0, fill = 0, fp8 = 0, nk = 0, invariant = 0;
    int32_t spec_k[8], kmax = 0;
    const char *json = NULL, *lp_out = NULL, *lp_ref = NULL;
    int32_t lp_len = 512;
    static const struct option lo[] = {
        {"batches", required_argument, NULL, 'b'}, {"prefill", required_argument, NULL, 'p'},
        {"steps", required_argument, NULL, 's'},   {"ctx", required_argument, NULL, 'c'},
        {"json", required_argument, NULL, 'j'},    {"profile", no_argument, NULL, 'P'},
        {"ctxs", required_argument, NULL, 'C'},    {"fill", no_argument, NULL, 'F'},
        {"quantization", required_argument, NULL, 'Q'}, {"cases", required_argument, NULL, 'K'},
        {"batch-invariant", no_argument, NULL, 'I'},
        {"logprobs", required_argument, NULL, 'L'}, {"logprobs-ref", required_argument, NULL, 'R'},
        {"logprobs-len", required_argument, NULL, 'N'}, {"spec", required_argument, NULL, 'S'},
        {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0},
    };
    int ch;
    while ((ch = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (ch) {
        case 'b':
            nb = parse_list(optarg, batches, 16);
            break;
        case 'p':
            np = parse_list(optarg, prefills, 8);
            break;
        case 's':
            steps = atoi(optarg);
            break;
        case 'c':
            ctx = atoi(optarg);
            ctxs[0] = ctx;
            nc = 1;
            break;
        case 'C':
            nc = parse_list(optarg, ctxs, 8);
            break;
        case 'F':
            fill = 1;
            break;
        case 'K': { /* B@CTX,B@CTX,... */
            const char *q = optarg;
            ncase = 0;
            while (*q && ncase < 16) {
                char *e;
                case_b[ncase] = (int32_t)strtol(q, &e, 10);
                if (*e != '@') {
                    fprintf(stderr, "bench_cuda: --cases: \"%s\" (expected B@CTX,...)\n", optarg);
                    return 2;
                }
                case_ctx[ncase] = (int32_t)strtol(e + 1, &e, 10);
                if (case_b[ncase] < 1 || case_ctx[ncase] < 1 || (*e && *e != ',')) {
                    fprintf(stderr, "bench_cuda: --cases: \"%s\" (expected B@CTX,...)\n", optarg);
                    return 2;
                }
                ncase++;
                q = *e ? e + 1 : e;
            }
            break;
        }
        case 'Q':
            if (strcmp(optarg, "fp8") && strcmp(optarg, "none")) {
                fprintf(stderr, "bench_cuda: --quantization: \"%s\" (expected fp8 or none)\n", optarg);
                return 2;
            }
            fp8 = !strcmp(optarg, "fp8");
            break;
        case 'j':
            json = optarg;
            break;
        case 'I':
            invariant = 1;
            break;
        case 'L':
            lp_out = optarg;
            break;
        case 'R':
            lp_ref = optarg;
            break;
        case 'N':
            lp_len = atoi(optarg);
            break;
        case 'P':
            profile = 1;
            break;
        case 'S':
            nk = parse_list(optarg, spec_k, 8);
            for (int i = 0; i < nk; i++) {
                if (spec_k[i] < 1 || spec_k[i] > 16) {
                    fprintf(stderr, "bench_cuda: --spec: k from 1 to 16 (got %d)\n", spec_k[i]);
                    return 2;
                }
                kmax = spec_k[i] > kmax ? spec_k[i] : kmax;
            }
            break;
        default:
            fprintf(stderr, "usage: bench_cuda [--batches 1,16,64,256] [--prefill 2048,8192] [--steps N]\n"
                            "                  [--ctx N | --ctxs 2048,16384,...] [--fill] [--profile] [--json FILE]\n"
                            "                  [--quantization fp8|none] [--cases B@CTX,...] MODEL_DIR\n"
                            "  --quantization fp8  matrices quantized to FP8 blocks at load (krait serve's flag); the\n"
                            "                      prefill ceiling is then the block-scaled FP8 GEMM rate\n"
                            "  --batch-invariant  krait serve's flag: one product algorithm per shape, fixed attention\n"
                            "                     splits, MLA attention per head\n"
                            "  --fill  decode over caches holding random data instead of a real prefill (long contexts)\n"
                            "  --cases B@CTX,...  decode these (batch, context) pairs instead of every batch at every\n"
                            "                     context; the caches hold the largest pair\n"
                            "  --logprobs FILE  [--logprobs-ref REF] [--logprobs-len 512]: log-probabilities of a\n"
                            "                   random prompt at every position into FILE; with REF, the deviation\n"
                            "                   from that run (bf16 against FP8)\n"
                            "  --spec 1,2,3  also verification steps of speculative decoding with k drafted tokens\n"
                            "                per sequence at every batch (first context): ms per token at a given\n"
                            "                acceptance length and the break-even acceptance length\n");
            return 2;
        }
    }
    if (ncase > 0) { /* the pairs replace the batch and context lists */
        nb = nc = ncase;
        for (int i = 0; i < ncase; i++) {
            batches[i] = case_b[i];
            ctxs[i] = case_ctx[i];
        }
        ctx = 1;
    }
    for (int i = 0; i < nc; i++) {
        ctx = ctxs[i] > ctx ? ctxs[i] : ctx; /* the largest context sizes the caches */
    }
    if (optind >= argc || steps < 1 || ctx < 1 || nc < 1) {
        fprintf(stderr, "bench_cuda: a model directory is required\n");
        return 2;
    }
    const char *dir = argv[optind];
    struct ctx x = {0};
    x.fill = fill;
    if (json && !(x.json = fopen(json, "w"))) {
        fprintf(stderr, "bench_cuda: cannot write %s\n", json);
        return 1;
    }
    char dev[128] = "?";
    krk_device_describe(0, dev, sizeof dev);
    x.bw = bench_copy_gbs();
    x.tflops = gemm_rate();
    printf("device: %s; measured copy bandwidth %.0f GB/s, bf16 GEMM %.0f TFLOP/s\n", dev, x.bw, x.tflops);
    if (x.json) {
        fprintf(x.json, "{\"kind\":\"ceilings\",\"device\":\"%s\",\"copy_gbs\":%.1f,\"gemm_tflops\":%.1f}\n", dev, x.bw,
                x.tflops);
    }
    if (fp8) {
        const double plain = fp8_rate(false), blk = fp8_rate(true);
        printf("FP8 GEMM 8192^3: plain (per-tensor scales) %.0f TFLOP/s, block-scaled (the recipe's, as served) %.0f "
               "TFLOP/s; the prefill ceiling below is the block-scaled rate\n", plain, blk);
        if (x.json) {
            fprintf(x.json, "{\"kind\":\"fp8_ceilings\",\"plain_tflops\":%.1f,\"block_tflops\":%.1f}\n", plain, blk);
        }
        x.tflops = blk > 0 ? blk : x.tflops;
    }
    struct kr_err err = {0};
    if (kr_backend_create("cuda", 0, &x.be, &err) != KR_OK) { /* KRAIT_CUDA_GRAPHS=0: no graphs */
        fprintf(stderr, "bench_cuda: %s\n", err.msg);
        return 1;
    }
    if (kr_backend_set_fp8_weights(x.be, fp8, &err) != KR_OK ||
        kr_backend_set_batch_invariant(x.be, invariant, &err) != KR_OK) {
        fprintf(stderr, "bench_cuda: %s\n", err.msg);
        return 1;
    }
    double t0 = kr_clock_s();
    if (kr_model_load(dir, x.be, &x.m, &err) != KR_OK) {
        fprintf(stderr, "bench_cuda: %s\n", err.msg);
        return 1;
    }
    printf("model: %s (%s, %.2fB parameters%s) loaded in %.1f s; weights read per decode step %.2f GB\n", dir,
           x.m->cfg.pattern, (double)x.m->n_params / 1e9, fp8 ? ", matrices in FP8 blocks of 128x128" : "",
           kr_clock_s() - t0, weight_bytes(x.m) / 1e9);
    int32_t max_b = 1, max_p = 1;
    for (int i = 0; i < nb; i++) {
        max_b = batches[i] > max_b ? batches[i] : max_b;
    }
    for (int i = 0; i < np; i++) {
        max_p = prefills[i] > max_p ? prefills[i] : max_p;
    }
    const int32_t bs = 64;
    const int32_t span = steps * (1 + kmax) + 16 * (1 + kmax); /* positions the decode steps take */
    int64_t blocks = (int64_t)max_b * ((ctx + span) / bs + 2) + max_p / bs + 4;
    if (ncase > 0) { /* the largest pair, not the largest batch at the largest context */
        blocks = 0;
        for (int i = 0; i < ncase; i++) {
            const int64_t need = (int64_t)case_b[i] * ((case_ctx[i] + span) / bs + 2);
            blocks = need > blocks ? need : blocks;
        }
        blocks += max_p / bs + 4;
    }
    const int32_t keep_slots = kmax > 0 && x.m->n_mamba > 0 ? max_b * kmax : 0; /* verification's kept states */
    if (kr_cache_create(x.m, max_b + 1 + keep_slots, (int32_t)blocks, bs, &x.c) != KR_OK) {
        fprintf(stderr, "bench_cuda: cannot allocate caches for batch %d\n", max_b);
        return 1;
    }
    const int64_t max_tok = fill ? (max_p > max_b ? max_p : max_b)
                                 : (max_p > (int64_t)max_b * ctx ? max_p : (max_b * ctx < 8192 ? max_b * ctx : 8192));
    const int64_t max_rows = (int64_t)max_b * (1 + kmax);
    if (kr_model_reserve(x.m, max_tok > max_rows ? max_tok : max_rows, max_rows, max_b,
                         ctx + span > max_p ? ctx + span : max_p, bs) != KR_OK) {
        fprintf(stderr, "bench_cuda: cannot reserve the workspace\n");
        return 1;
    }
    x.sample_ws_bytes = krk_sample_workspace_bytes((int32_t)max_rows, x.m->cfg.vocab);
    BENCH_CK(cudaMalloc(&x.sample_ws, x.sample_ws_bytes + 16));
    BENCH_CK(cudaMalloc((void **)&x.ids_d, (size_t)max_rows * 4));
    BENCH_CK(cudaMalloc((void **)&x.rows_d, (size_t)max_rows * sizeof(struct krk_sample_row)));
    struct krk_sample_row *rows = kr_calloc((size_t)max_rows, sizeof *rows);
    for (int64_t i = 0; i < max_rows; i++) {
        rows[i] = (struct krk_sample_row){.temperature = 0, .top_k = 0, .top_p = 1, .min_p = 0, .repetition = 1};
    }
    BENCH_CK(cudaMemcpy(x.rows_d, rows, (size_t)max_rows * sizeof *rows, cudaMemcpyHostToDevice));
    kr_free(rows);
    size_t fr, tot;
    BENCH_CK(cudaMemGetInfo(&fr, &tot));
    printf("device memory: %.1f GiB held of %.1f GiB; caches %.1f GiB\n", (double)(tot - fr) / (1 << 30),
           (double)tot / (1 << 30), (double)kr_cache_bytes(x.c) / (1 << 30));
    cache_unit_report(&x);
    if (fill) {
        struct kr_buf *pools[5] = {&x.c->conv, &x.c->ssm, &x.c->k, &x.c->v, &x.c->mla};
        for (int i = 0; i < 5; i++) {
            if (pools[i]->ptr && pools[i]->size) {
                fill_random(pools[i]->ptr, pools[i]->size, i == 1 ? 4 : 2);
            }
        }
        printf("caches filled with random data (decode contexts are not prefilled)\n");
    }
    printf("\n");
    if (lp_out || lp_ref) {
        if (lp_len < 2) {
            fprintf(stderr, "bench_cuda: --logprobs-len: at least 2\n");
            return 2;
        }
        logprob_run(&x, lp_len, lp_out, lp_ref);
    }
    printf("| phase | shape | time | throughput | work | ceiling | of ceiling |\n|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < np; i++) {
        bench_prefill(&x, prefills[i], 3, false);
    }
    for (int k = 0; k < nc; k++) {
        for (int i = 0; i < nb; i++) {
            if (ncase == 0 || i == k) {
                bench_decode(&x, batches[i], ctxs[k], steps, false, false);
            }
        }
    }
    if (nk > 0) {
        printf("\n| steps | shape | time | plain | per token | break-even |\n|---|---|---|---|---|---|\n");
        for (int i = 0; i < nb; i++) {
            bench_spec(&x, batches[i], ctxs[0], steps, spec_k, nk);
        }
    }
    if (profile && nk > 0) { /* where a verification step's time goes: k = the first --spec value */
        for (int i = 0; i < nb; i++) {
            kr_backend_cuda_profile(x.be, true);
            bench_decode_k(&x, batches[i], ctxs[0], 8, true, true, spec_k[0], false);
            char what[64];
            snprintf(what, sizeof what, "verify k=%d batch %d", spec_k[0], batches[i]);
            profile_report(&x, what, 8 + 3);
        }
        kr_backend_cuda_profile(x.be, false);
    }
    if (profile) {
        kr_backend_cuda_profile(x.be, true);
        for (int i = 0; i < nb && i < 2; i++) {
            bench_decode(&x, batches[i], ctxs[0], 8, true, true);
            char what[64];
            snprintf(what, sizeof what, "decode batch %d", batches[i]);
            profile_report(&x, what, 8 + 3);
        }
        kr_backend_cuda_profile(x.be, true);
        bench_prefill(&x, prefills[0], 1, true);
        char what[64];
        snprintf(what, sizeof what, "prefill %d", prefills[0]);
        profile_report(&x, what, 2);
        kr_backend_cuda_profile(x.be, false);
    }
    if (x.json) {
        fclose(x.json);
    }
    kr_cache_free(x.c);
    kr_model_free(x.m);
    kr_backend_free(x.be);
    return 0;
}
