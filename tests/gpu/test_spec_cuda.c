/* Speculative decoding on the CUDA backend: the CPU suite (tests/engine/test_spec.c) compiled for the
 * GPU, where verification runs the Mamba layers' per-token states (struct krk_batch.tok_keep) and the
 * MTP head's passes on the device. Bounds: that file's header. */
#define KR_SPEC_ON_CUDA 1
#include "../engine/test_spec.c"
