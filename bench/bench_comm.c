/* Latency of the tensor-parallel collectives (backend/comm-cuda.h) per message size on the GPUs of
 * this machine:
 *   bench_comm [--ranks N] [--one-device] [--iters K]
 * --one-device puts every rank on device 0 (the peer kernels over one GPU's memory: what a single
 * GPU can show; across GPUs the reads and signals cross NVLink instead). Without it the ranks take
 * devices 0..N-1 and both paths are timed: the one-shot peer kernels and NCCL.
 * Each figure is the mean time of one all-reduce, from CUDA graphs of 20 calls per rank replayed K
 * times (launch overhead out of the way, as in a captured decode step), in microseconds, and the
 * bus bandwidth NCCL's tests report (2 (N-1)/N bytes / time). */
#include "comm-cuda.h"
#include "measure.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CALLS 20

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Mean microseconds of one all-reduce of n floats through `path` (1 peer, 2 NCCL); < 0 when the path
 * is not there. */
static double time_path(struct kr_cuda_comm *c, int ranks, const int *devs, float **x, cudaStream_t *s, int64_t n,
                        int path, int iters)
{
    cudaGraphExec_t exec[8];
    for (int r = 0; r < ranks; r++) {
        BENCH_CK(cudaSetDevice(devs[r]));
        cudaGraph_t g;
        BENCH_CK(cudaStreamBeginCapture(s[r], cudaStreamCaptureModeThreadLocal));
        enum kr_status st = KR_OK;
        for (int k = 0; k < CALLS && st == KR_OK; k++) {
            st = kr_cuda_comm_all_reduce(c, r, x[r], n, s[r], path);
        }
        BENCH_CK(cudaStreamEndCapture(s[r], &g));
        if (st != KR_OK) {
            cudaGraphDestroy(g);
            for (int q = 0; q < r; q++) {
                cudaGraphExecDestroy(exec[q]);
            }
            return -1;
        }
        BENCH_CK(cudaGraphInstantiate(&exec[r], g, 0));
        cudaGraphDestroy(g);
    }
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        for (int r = 0; r < ranks; r++) { /* warm-up */
            BENCH_CK(cudaSetDevice(devs[r]));
            BENCH_CK(cudaGraphLaunch(exec[r], s[r]));
        }
        for (int r = 0; r < ranks; r++) {
            BENCH_CK(cudaStreamSynchronize(s[r]));
        }
        const double t0 = now_s();
        for (int i = 0; i < iters; i++) {
            for (int r = 0; r < ranks; r++) {
                BENCH_CK(cudaSetDevice(devs[r]));
                BENCH_CK(cudaGraphLaunch(exec[r], s[r]));
            }
        }
        for (int r = 0; r < ranks; r++) {
            BENCH_CK(cudaStreamSynchronize(s[r]));
        }
        const double us = (now_s() - t0) * 1e6 / ((double)iters * CALLS);
        best = us < best ? us : best;
    }
    for (int r = 0; r < ranks; r++) {
        cudaGraphExecDestroy(exec[r]);
    }
    return best;
}

int main(int argc, char **argv)
{
    int ranks = 2, one = 0, iters = 50;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ranks") && i + 1 < argc) {
            ranks = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--one-device")) {
            one = 1;
        } else if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
            iters = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: bench_comm [--ranks N] [--one-device] [--iters K]\n");
            return 2;
        }
    }
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1) {
        fprintf(stderr, "bench_comm: no CUDA device\n");
        return 77;
    }
    if (ranks < 1 || ranks > 8 || (!one && ranks > n_dev)) {
        fprintf(stderr, "bench_comm: %d ranks on %d devices (use --one-device)\n", ranks, n_dev);
        return 2;
    }
    int devs[8];
    for (int r = 0; r < ranks; r++) {
        devs[r] = one ? 0 : r;
    }
    const struct kr_cuda_comm_opts o = {.size = ranks, .devices = devs, .one_device = one != 0,
                                        .peer_max_bytes = (size_t)64 << 20, .timeout_s = 60};
    struct kr_cuda_comm *c = NULL;
    struct kr_err err = {0};
    if (kr_cuda_comm_create(&o, &c, &err) != KR_OK) {
        fprintf(stderr, "bench_comm: %s\n", err.msg);
        return 1;
    }
    const int64_t max_n = (int64_t)16 << 20; /* 64 MiB */
    float *x[8];
    cudaStream_t s[8];
    for (int r = 0; r < ranks; r++) {
        BENCH_CK(cudaSetDevice(devs[r]));
        BENCH_CK(cudaMalloc((void **)&x[r], (size_t)max_n * sizeof(float)));
        BENCH_CK(cudaMemset(x[r], 0, (size_t)max_n * sizeof(float)));
        BENCH_CK(cudaStreamCreateWithFlags(&s[r], cudaStreamNonBlocking));
    }
    char name[256] = "?";
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
        snprintf(name, sizeof name, "%s", prop.name);
    }
    printf("all-reduce, %d ranks %s (%s), mean of graphs of %d calls x %d\n", ranks,
           one ? "on one device" : "on one device each", name, CALLS, iters);
    printf("| bytes | fp32 elements | peer kernels us | peer busbw GB/s | NCCL us | NCCL busbw GB/s |\n");
    printf("| ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (int64_t n = 256; n <= max_n; n *= 4) {
        const double p = time_path(c, ranks, devs, x, s, n, 1, iters);
        const double q = one ? -1 : time_path(c, ranks, devs, x, s, n, 2, iters);
        const double bytes = (double)n * 4, f = 2.0 * (ranks - 1) / ranks;
        char a[32] = "-", b[32] = "-", cq[32] = "-", d[32] = "-";
        if (p > 0) {
            snprintf(a, sizeof a, "%.1f", p);
            snprintf(b, sizeof b, "%.1f", f * bytes / p / 1e3);
        }
        if (q > 0) {
            snprintf(cq, sizeof cq, "%.1f", q);
            snprintf(d, sizeof d, "%.1f", f * bytes / q / 1e3);
        }
        printf("| %.0f | %lld | %s | %s | %s | %s |\n", bytes, (long long)n, a, b, cq, d);
        fflush(stdout);
    }
    for (int r = 0; r < ranks; r++) {
        cudaSetDevice(devs[r]);
        cudaFree(x[r]);
        cudaStreamDestroy(s[r]);
    }
    kr_cuda_comm_free(c);
    return 0;
}
