/* --batch-invariant through the engine on the CUDA backend: the CPU suite
 * (tests/engine/test_invariant.c) compiled for the GPU, bit for bit as there. */
#define KR_INVARIANT_ON_CUDA 1
#include "../engine/test_invariant.c"
