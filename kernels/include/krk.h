#pragma once
/* The whole public surface of kernels/: parameter structs and launchers of the CUDA kernels,
 * callable from C. Only the CUDA backend includes this header; a CPU-only build never compiles
 * a launcher. Kernel families (one directory each) arrive with the CUDA backend. */
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifdef KR_WITH_CUDA
/* Number of CUDA devices visible to this process (0 when the driver is missing or no device is
 * present; never fails). */
int krk_device_count(void);

/* Fills `name` (at most `n` bytes) with the name of device `dev` and its compute capability
 * ("NVIDIA H200 sm_90"). Returns KR_ERR_CUDA when the device cannot be queried. */
enum kr_status krk_device_describe(int dev, char *name, int n);
#endif

#ifdef __cplusplus
}
#endif
