#pragma once
/* kr_host_comm: a tensor-parallel group of ranks inside one process, one thread per rank, over
 * host memory (the CPU backend's collectives; NCCL plays this part for CUDA ranks). Every rank
 * calls each collective in the same order. Results are identical on every rank and independent of
 * thread timing: sums are taken in rank order.
 *
 * A group may span processes (several nodes): this process then holds a contiguous run of the
 * group's ranks, and a link (struct kr_comm_link, engine/cluster.h over TCP) carries each
 * collective to the other processes. The ranks of this process first combine among themselves
 * (sums in rank order), then one of them hands the process's part to the link, which returns the
 * group's result: sums are taken node by node in node order, each node's partial sum in rank
 * order, so every rank of every process still gets the same bits. */
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kr_host_comm;

/* The part of a group outside this process. Each call is made by one rank of this process per
 * collective, in the group's order, and blocks until the other processes took part.
 *  - all_reduce: x [n] holds this process's sum on entry, the group's on return;
 *  - all_gather: dst [rows, width] holds this process's columns [col0, col0 + ncols) of every row
 *    on entry, every column on return;
 *  - abort: (any thread) leaves the group: every process's collectives return an error.
 * An error from all_reduce or all_gather means the group cannot go on (KR_ERR_CANCELLED). */
struct kr_comm_link {
    enum kr_status (*all_reduce)(void *user, float *x, int64_t n);
    enum kr_status (*all_gather)(void *user, float *dst, int64_t rows, int64_t width, int64_t col0, int64_t ncols);
    void (*abort)(void *user);
    void *user;
};

/* A group of `size` ranks (1..64). *out is owned by the caller (kr_host_comm_free, after every
 * rank has stopped using it). */
enum kr_status kr_host_comm_create(int size, struct kr_host_comm **out);
/* The part of a group of `size` ranks that this process holds: ranks first .. first + n_local - 1,
 * the rest reached through `link` (copied; link->user borrowed, it must outlive the group). The
 * ranks keep their group-wide numbers in every call below. */
enum kr_status kr_host_comm_create_part(int size, int first, int n_local, const struct kr_comm_link *link,
                                        struct kr_host_comm **out);
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
 * fails mid-step calls it so that the others do not wait for it forever. Any thread. A group that
 * spans processes aborts its link too, so that the other processes' ranks are released as well. */
void kr_host_comm_abort(struct kr_host_comm *c);

#ifdef __cplusplus
}
#endif
