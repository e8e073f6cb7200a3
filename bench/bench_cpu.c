/* CPU reference backend benchmark: prefill tokens/s and decode ms/token of one sequence, on
 * given checkpoints and on a synthetic checkpoint of realistic width. Decode is reported with
 * its memory-bandwidth ceiling (weight bytes read per step over the measured read bandwidth of
 * this machine), prefill with its achieved GFLOP/s (2 FLOP per weight per token). */
#include "cache.h"
#include "model.h"
#include "runner.h"
#include "synth.h"

#include "alloc.h"
#include "clock.h"
#include "log.h"

#include <getopt.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Read bandwidth of a 1 GiB buffer summed by all threads (GB/s), best of 3. */
static double read_bandwidth(int threads)
{
    const size_t n = (size_t)1 << 28; /* floats */
    float *a = malloc(n * sizeof(float));
    if (!a) {
        return 0;
    }
#pragma omp parallel for num_threads(threads)
    for (size_t i = 0; i < n; i++) {
        a[i] = (float)(i & 7);
    }
    double best = 0, sink = 0;
    for (int r = 0; r < 3; r++) {
        double t0 = kr_clock_s(), s = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : s)
        for (size_t i = 0; i < n; i++) {
            s += a[i];
        }
        double dt = kr_clock_s() - t0;
        sink += s;
        double bw = (double)(n * sizeof(float)) / dt / 1e9;
        best = bw > best ? bw : best;
    }
    free(a);
    return sink < 0 ? 0 : best;
}

/* Bytes of weights read by one decode step: every matrix once (experts: only the routed ones and
 * the shared one), the embedding row negligible. */
static double decode_weight_bytes(const struct kr_model *m)
{
    const struct kr_model_config *c = &m->cfg;
    double b = (double)m->lm_head.rows * (double)m->lm_head.cols * 2.0;
    for (int32_t i = 0; i < c->n_layer; i++) {
        const struct kr_layer *L = &m->layers[i];
        const double e = 2.0; /* bf16 */
        switch (L->type) {
        case KR_LAYER_MAMBA:
            b += e * (double)(L->mamba.in_proj.rows * L->mamba.in_proj.cols + L->mamba.out_proj.rows * L->mamba.out_proj.cols);
            break;
        case KR_LAYER_ATTN:
            b += e * (double)(L->attn.q.rows * L->attn.q.cols + 2 * L->attn.k.rows * L->attn.k.cols + L->attn.o.rows * L->attn.o.cols);
            break;
        case KR_LAYER_MLP:
            b += e * (double)(2 * L->mlp.up.rows * L->mlp.up.cols) * (L->mlp.gate.data ? 1.5 : 1.0);
            break;
        case KR_LAYER_DSA:
        case KR_LAYER_MLA: {
            const struct kr_mla_w *w = &L->mla;
            b += e * (double)(w->q_a.rows * w->q_a.cols + w->q_b.rows * w->q_b.cols + w->kv_a.rows * w->kv_a.cols +
                              w->o.rows * w->o.cols);
            b += 4.0 * (double)(c->mla_heads * (c->qk_nope + c->v_head) * c->kv_lora); /* kv_b, fp32 */
            if (w->has_indexer) {
                b += e * (double)(w->idx_wq_b.rows * w->idx_wq_b.cols + w->idx_wk.rows * w->idx_wk.cols +
                                  w->idx_w.rows * w->idx_w.cols);
            }
            break;
        }
        case KR_LAYER_MOE:
            b += e * (double)(c->n_expert_used * 2 * c->moe_ffn * c->dim + 2 * c->shared_ffn * c->dim + c->n_expert * c->dim);
            break;
        default:
            break;
        }
    }
    return b;
}

static int bench_model(const char *dir, int threads, int32_t n_prefill, int32_t n_decode, double bw)
{
    kr_backend_t be = kr_backend_cpu_create(threads);
    struct kr_model *m = NULL;
    struct kr_cache *c = NULL;
    struct kr_err err = {0};
    if (kr_model_load(dir, be, &m, &err) != KR_OK) {
        fprintf(stderr, "bench: %s\n", err.msg);
        kr_backend_free(be);
        return -1;
    }
    const int32_t bs = 64, total = n_prefill + n_decode + 1;
    if (kr_cache_create(m, 1, (total + bs - 1) / bs, bs, &c) != KR_OK) {
        fprintf(stderr, "bench: cache allocation failed\n");
        return -1;
    }
    int32_t *ids = kr_malloc((size_t)n_prefill * sizeof(int32_t));
    int32_t *out = kr_malloc((size_t)(n_decode + 1) * sizeof(int32_t));
    uint32_t s = 12345;
    for (int32_t i = 0; i < n_prefill; i++) {
        s = s * 1664525u + 1013904223u;
        ids[i] = (int32_t)((s >> 8) % (uint32_t)m->cfg.vocab);
    }
    /* prefill alone (greedy with one new token is prefill + argmax), then prefill + n_decode steps;
     * the decode time is the difference. Best of 3 each, so small models are not timing noise. */
    int32_t n_out = 0;
    enum kr_status st = KR_OK;
    double t_prefill = 1e30, t_total = 1e30;
    for (int rep = 0; rep < 3 && st == KR_OK; rep++) {
        double t0 = kr_clock_s();
        st = kr_run_greedy(m, c, ids, n_prefill, 0, 1, true, out, NULL, &n_out, &err);
        double dt = kr_clock_s() - t0;
        t_prefill = dt < t_prefill ? dt : t_prefill;
        if (st != KR_OK) {
            break;
        }
        t0 = kr_clock_s();
        st = kr_run_greedy(m, c, ids, n_prefill, 0, n_decode + 1, true, out, NULL, &n_out, &err);
        dt = kr_clock_s() - t0;
        t_total = dt < t_total ? dt : t_total;
    }
    if (st != KR_OK) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return -1;
    }
    const double ms_tok = (t_total - t_prefill) / n_decode * 1e3;
    const double wbytes = decode_weight_bytes(m);
    const double ceil_ms = bw > 0 ? wbytes / (bw * 1e9) * 1e3 : 0;
    const double flops = 2.0 * (double)m->n_params * n_prefill;
    printf("| %s | %s | %.2fM | %d | %.1f | %.2f | %d | %.2f | %.2f | %.0f%% |\n", dir, m->cfg.pattern,
           (double)m->n_params / 1e6, n_prefill, n_prefill / t_prefill, flops / t_prefill / 1e9, n_decode, ms_tok,
           ceil_ms, ceil_ms > 0 ? 100.0 * ceil_ms / ms_tok : 0.0);
    fflush(stdout);
    kr_free(ids);
    kr_free(out);
    kr_cache_free(c);
    kr_model_free(m);
    kr_backend_free(be);
    return 0;
}

int main(int argc, char **argv)
{
    int threads = 0, synthetic = 0;
    int32_t n_prefill = 256, n_decode = 32;
    static const struct option longopts[] = {
        {"threads", required_argument, NULL, 'j'}, {"prefill", required_argument, NULL, 'p'},
        {"decode", required_argument, NULL, 'd'},  {"synthetic", no_argument, NULL, 's'},
        {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0},
    };
    int ch;
    while ((ch = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        switch (ch) {
        case 'j':
            threads = atoi(optarg);
            break;
        case 'p':
            n_prefill = atoi(optarg);
            break;
        case 'd':
            n_decode = atoi(optarg);
            break;
        case 's':
            synthetic = 1;
            break;
        default:
            fprintf(stderr,
                    "usage: bench_cpu [--threads N] [--prefill N] [--decode N] [--synthetic] [MODEL_DIR...]\n"
                    "  --synthetic  also build and run a hidden-2048, 8-layer nemotron_h (M-M*M-ME) in /tmp\n");
            return ch == 'h' ? 0 : 2;
        }
    }
    if (n_prefill < 1 || n_decode < 1) {
        fprintf(stderr, "bench_cpu: --prefill and --decode must be >= 1\n");
        return 2;
    }
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    if (threads <= 0) {
        threads = omp_get_num_procs();
    }
    const double bw = read_bandwidth(threads);
    printf("threads %d, measured read bandwidth %.1f GB/s\n\n", threads, bw);
    printf("| model | pattern | params | prefill tokens | prefill tok/s | prefill GFLOP/s | decode steps | decode "
           "ms/token | bandwidth floor ms/token | of ceiling |\n|---|---|---|---|---|---|---|---|---|---|\n");
    int rc = 0;
    for (int i = optind; i < argc; i++) {
        rc |= bench_model(argv[i], threads, n_prefill, n_decode, bw);
    }
    if (synthetic) {
        char dir[] = "/tmp/krait-bench-XXXXXX";
        if (!mkdtemp(dir)) {
            perror("mkdtemp");
            return 1;
        }
        const struct synth_spec s = {
            .pattern = "M-M*M-ME", .vocab = 32000, .dim = 2048,
            .m_heads = 64, .m_head_dim = 64, .m_groups = 8, .m_state = 128, .m_conv = 4, .m_chunk = 128,
            .n_head = 16, .n_kv_head = 4, .head_dim = 128, .ffn = 8192,
            .n_expert = 16, .n_used = 2, .moe_ffn = 1024, .shared_ffn = 2048,
        };
        if (synth_write(dir, &s) != 0) {
            return 1;
        }
        rc |= bench_model(dir, threads, n_prefill, n_decode, bw);
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        if (system(cmd) != 0) {
            fprintf(stderr, "bench_cpu: could not remove %s\n", dir);
        }
    }
    return rc ? 1 : 0;
}
