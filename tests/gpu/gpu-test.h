#pragma once
/* Helpers for the GPU tests: device detection (tests skip with a clear message where there is no
 * GPU), device buffers poisoned before use, random inputs, bf16 rounding of references, error
 * metrics, and a random batch described both for the CPU backend (struct kr_batch) and for the
 * kernels (struct krk_batch). CUDA is initialised inside each test, never in Criterion's parent. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <criterion/criterion.h>

#include "backend.h"
#include "krk.h"

/* Skips the current test with a message when no CUDA device is usable. */
#define GT_REQUIRE_GPU()                                                                           \
    do {                                                                                           \
        if (!gt_have_gpu()) {                                                                      \
            cr_skip_test("no CUDA device visible: GPU test skipped (run tests/gpu/run.sh on a GPU machine)"); \
        }                                                                                          \
    } while (0)

bool gt_have_gpu(void);
/* Exit status of test_cuda when it ran on a machine without a GPU (every test skipped). */
#define GT_SKIPPED 77
/* Fixture directory: $KR_FIXTURES when set (the tree moved), else the build-time path. */
const char *gt_fixtures(void);

/* Device memory, filled with 0xFF bytes (NaN for floats) so unwritten outputs show. Asserts. */
void *gt_dalloc(size_t bytes);
void gt_dfree(void *p);
void *gt_dup(const void *host, size_t bytes);          /* device copy of host bytes */
void gt_down(void *host, const void *dev, size_t bytes);
krk_bf16 *gt_dup_bf16(const float *host, size_t n);    /* device bf16 copy (rounded) */
void gt_sync(void);                                    /* synchronize and assert no CUDA error */

/* Deterministic random numbers (per-test seed). */
struct gt_rng {
    uint64_t s;
};
float gt_uniform(struct gt_rng *r, float lo, float hi);
void gt_fill(struct gt_rng *r, float *x, size_t n, float lo, float hi);
/* Rounds every element to bf16 in place (so the CPU reference sees the GPU's inputs). */
void gt_round_bf16(float *x, size_t n);

/* Error of `got` against `ref`: NMSE = sum (g-r)^2 / sum r^2, max |g-r|, NaN/Inf count. */
struct gt_err {
    double nmse, max_abs;
    int64_t n_bad;
};
struct gt_err gt_compare(const float *got, const float *ref, size_t n);
/* cr_expect that the error is within bounds (nmse, max_abs) and no element is NaN/Inf; prints
 * the measured error either way. Returns true when within bounds. */
bool gt_expect_close(const char *what, const float *got, const float *ref, size_t n, double nmse_bound,
                     double abs_bound);

/* A random batch: sequence s has seq_len[s] new tokens starting at position pos0[s], state slot
 * slot[s] and a block table of distinct random blocks out of n_blocks. */
struct gt_batch {
    struct kr_batch host;        /* for kr_backend_begin_batch on the CPU backend */
    struct krk_batch dev;        /* device copy for the launchers */
    int32_t *tokens, *pos, *tok_seq, *seq_tok0, *seq_pos0, *seq_slot, *block_table; /* host arrays */
    void *dmem;                  /* device allocation behind dev */
};
void gt_batch_make(struct gt_batch *b, struct gt_rng *r, int32_t n_seq, const int32_t *seq_len,
                   const int32_t *pos0, int32_t block_size, int32_t n_blocks, int32_t n_slots, int32_t vocab);
void gt_batch_free(struct gt_batch *b);
