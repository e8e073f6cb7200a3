/* bench/measure.c: measures shared by the CUDA benchmarks. */
#include "measure.h"

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

void bench_cuda_die(const char *file, int line, const char *expr, int err)
{
    fprintf(stderr, "%s:%d: %s: %s\n", file, line, expr, cudaGetErrorString((cudaError_t)err));
    exit(1);
}

static int cmp_d(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double bench_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double bench_events_ms(bool (*run)(void *arg), void *arg, int warm, int reps)
{
    if (reps < 1 || reps > BENCH_MAX_REPS) {
        fprintf(stderr, "bench_events_ms: %d repetitions, not 1..%d\n", reps, BENCH_MAX_REPS);
        exit(1);
    }
    cudaEvent_t e0, e1;
    BENCH_CK(cudaEventCreate(&e0));
    BENCH_CK(cudaEventCreate(&e1));
    double t[BENCH_MAX_REPS];
    bool ok = true;
    for (int i = 0; i < warm + reps && ok; i++) {
        BENCH_CK(cudaEventRecord(e0, 0));
        ok = run(arg);
        BENCH_CK(cudaEventRecord(e1, 0));
        BENCH_CK(cudaEventSynchronize(e1));
        float ms;
        BENCH_CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= warm) {
            t[i - warm] = ms;
        }
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return ok ? bench_median(t, reps) : -1.0;
}

struct copy_run {
    void *a, *b;
    size_t n;
    int i;
};

static bool copy_once(void *arg)
{
    struct copy_run *c = arg;
    const int odd = c->i++ % 2;
    BENCH_CK(cudaMemcpyAsync(odd ? c->a : c->b, odd ? c->b : c->a, c->n, cudaMemcpyDeviceToDevice, 0));
    return true;
}

double bench_copy_gbs(void)
{
    struct copy_run c = {.n = (size_t)2 << 30};
    BENCH_CK(cudaMalloc(&c.a, c.n));
    BENCH_CK(cudaMalloc(&c.b, c.n));
    BENCH_CK(cudaMemset(c.a, 0x5A, c.n));
    const double ms = bench_events_ms(copy_once, &c, 2, 10);
    cudaFree(c.a);
    cudaFree(c.b);
    return 2.0 * (double)c.n / (ms * 1e-3) / 1e9;
}
