#pragma once
/* Measures shared by the CUDA benchmarks (bench_cuda, bench_gemv). */

#include <stdbool.h>

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
