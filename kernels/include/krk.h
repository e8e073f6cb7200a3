#pragma once
/* The whole public surface of kernels/: parameter structs and launchers of the CUDA kernels,
 * callable from C. Only the CUDA backend (and the GPU tests and benchmarks) include this header; a
 * CPU-only build never compiles a launcher. Each kernel family keeps its part in krk/<family>.h.
 *
 * Conventions for every launcher:
 *  - every pointer is device memory unless its comment says "host";
 *  - activations are fp32, weights bf16 (krk_bf16), Mamba SSM states fp32, caches bf16;
 *  - shapes are given as [dims] in the comment of each pointer, strides explicit;
 *  - a launcher takes its op's parameters (struct krk_<op>_params of krk/ops.h, the struct the
 *    engine and the CPU reference use) and a `stream`, or a `struct krk_ctx` (krk/common.h: the
 *    stream, the step's batch, workspace, tuning variants, events) when it needs more than that;
 *  - a launcher validates its parameters (KR_ERR_INVAL, never an abort), launches on its stream,
 *    checks cudaGetLastError (KR_ERR_CUDA) and never synchronizes or allocates, so that every
 *    launcher can be captured into a CUDA graph. */
#include "status.h"

#ifdef KR_WITH_CUDA
#include "krk/common.h"
#include "krk/norm.h"
#include "krk/gemm.h"
#include "krk/mamba2.h"
#include "krk/attention.h"
#include "krk/mla.h"
#include "krk/moe.h"
#include "krk/sampling.h"
#include "krk/comm.h"
#endif
