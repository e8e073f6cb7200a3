#pragma once
/* kr_host_comm: a tensor-parallel group of ranks inside one process, one thread per rank, over
 * host memory (the CPU backend's collectives; NCCL plays this part for CUDA ranks). Every rank
 * calls each collective in the same order. Results are identical on every rank and independent of
 * thread timing: sums are taken in rank order. */
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kr_host_comm;

/* A group of `size` ranks (1..64). *out is owned by the caller (kr_host_comm_free, after every
 * rank has stopped using it). */
enum kr_status kr_host_comm_create(int size, struct kr_host_comm **out);
void kr_host_comm_free(struct kr_host_comm *c);
int kr_host_comm_size(const struct kr_host_comm *c);

/* x[i] = sum over ranks of x[i] (i < n), summed in rank order 0..size-1. Blocks until every rank
 * has called it. KR_ERR_CANCELLED once the group was aborted; KR_ERR_INVAL when the ranks disagree
 * on n (every rank then gets the error). */
enum kr_status kr_host_comm_all_reduce(struct kr_host_comm *c, int rank, float *x, int64_t n);

/* dst [rows, size * cols] = the ranks' src [rows, cols] side by side (rank r's block at column
 * r * cols), on every rank. dst must not overlap src. Same errors as all_reduce. */
enum kr_status kr_host_comm_all_gather(struct kr_host_comm *c, int rank, const float *src, int64_t rows,
                                       int64_t cols, float *dst);

/* Wakes every rank blocked in (or later entering) a collective with KR_ERR_CANCELLED: a rank that
 * fails mid-step calls it so that the others do not wait for it forever. Any thread. */
void kr_host_comm_abort(struct kr_host_comm *c);

#ifdef __cplusplus
}
#endif
