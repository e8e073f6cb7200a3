#pragma once
/* Measures shared by the CUDA benchmarks (bench_cuda, bench_gemv). */

/* The median of v[0..n) (sorts v). */
double bench_median(double *v, int n);

/* The device's copy rate in GB/s, the ceiling of every weight-streaming figure they print: a
 * device-to-device copy of 2 GiB, bytes read + written over time, median of 10 (after two warm-up
 * copies), on the current device. Exits with a message when CUDA fails. */
double bench_copy_gbs(void);
