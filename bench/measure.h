#pragma once
/* Measures shared by the CUDA benchmarks (bench_cuda, bench_gemv, bench_comm). */

#include <stdbool.h>

/* Exits with "file:line: expr: CUDA's message" when the CUDA runtime call `expr` fails (a benchmark
 * has no figure to give once the device is in error). */
#define BENCH_CK(expr)                                                                             \
    do {                                                                                           \
        const int e_ = (int)(expr);                                                                \
        if (e_ != 0) {                                                                             \
            bench_cuda_die(__FILE__, __LINE__, #expr, e_);                                         \
        }                                                                                          \
    } while (0)
void bench_cuda_die(const char *file, int line, const char *expr, int err);

/* The median of v[0..n) (sorts v). */
double bench_median(double *v, int n);

/* The median milliseconds of run(arg) on the legacy default stream, timed with events over `reps`
 * runs (at most BENCH_MAX_REPS) after `warm` untimed ones; -1 when a run returns false. Exits with a
 * message when CUDA fails. */
#define BENCH_MAX_REPS 32
double bench_events_ms(bool (*run)(void *arg), void *arg, int warm, int reps);

/* The device's copy rate in GB/s, the ceiling of every weight-streaming figure they print: a
 * device-to-device copy of 2 GiB, bytes read + written over time, median of 10 (after two warm-up
 * copies), on the current device. Exits with a message when CUDA fails. */
double bench_copy_gbs(void);
