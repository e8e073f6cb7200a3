#pragma once
/* The monotonic clock (CLOCK_MONOTONIC): for durations and timeouts, never for wall time. */
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Seconds since an arbitrary fixed point. */
double kr_clock_s(void);
/* Microseconds since the same point. */
double kr_clock_us(void);
/* Nanoseconds since the same point, as an integer. */
uint64_t kr_clock_ns(void);

#ifdef __cplusplus
}
#endif
