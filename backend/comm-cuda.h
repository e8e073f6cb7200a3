#pragma once
/* kr_cuda_comm: the tensor-parallel group of CUDA ranks in this process (the CUDA backend's
 * collectives; kr_host_comm plays this part for CPU ranks). One rank per device, each rank's work
 * issued by its own thread on its backend's stream:
 *
 *  - messages up to `peer_max_bytes` take the one-shot peer-memory kernels (kernels/include/krk/comm.h)
 *    when every pair of the group's devices has peer access; larger ones, and groups without peer
 *    access, take NCCL (NVLink SHARP / NVLS is turned off: NCCL_NVLS_ENABLE=0 unless set);
 *  - `one_device` (tests): every rank on the same device (NCCL refuses two ranks on one GPU). The
 *    ranks' threads meet at each collective and order their streams with events: each copies its
 *    part into its exchange buffer, and one kernel per rank combines the parts (the peer kernels'
 *    reading phase). Nothing spins on the device: ranks sharing a GPU must not wait for each other
 *    inside kernels, where one rank's device-wide synchronization (an allocation, a lazily loaded
 *    kernel) or a kernel that needs the whole GPU would wait for the spinning one forever. Decode
 *    steps then run without CUDA graphs (the meeting happens on the host); the peer kernels
 *    themselves, graphs included, are tested on one device directly (force = 1).
 *
 * Every collective is asynchronous on the caller's stream and can be captured into a CUDA graph.
 * A group whose rank fails is aborted (kr_cuda_comm_abort): the others leave their collectives
 * (the peer kernels poll the abort word; NCCL communicators are aborted) and every later
 * collective fails with KR_ERR_CANCELLED. A watchdog thread aborts the group when a rank's step has
 * not completed `timeout_s` after it was issued (a peer that hangs or died without aborting), or
 * NCCL reports an asynchronous error. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kr_cuda_comm;

struct kr_cuda_comm_opts {
    int size;               /* ranks in this process (1..8) */
    const int *devices;     /* [size] the CUDA device of each rank */
    const void *nccl_id;    /* several processes: the group's NCCL id (kr_cuda_comm_unique_id on one of
                               them, passed to every other), else NULL */
    int first, world;       /* with nccl_id: this process holds ranks first .. first + size - 1 of
                               world (NCCL carries every collective) */
    bool one_device;        /* every rank on devices[0], peer kernels only (tests) */
    size_t peer_max_bytes;  /* largest message of the peer kernels when NCCL is there (0: NCCL only) */
    double timeout_s;       /* longest a step may take before the group is aborted */
};

/* Creates the group: NCCL communicators (ncclCommInitAll), the peer buffers on each device, peer
 * access between the devices, the watchdog. Errors name what failed. */
enum kr_status kr_cuda_comm_create(const struct kr_cuda_comm_opts *o, struct kr_cuda_comm **out, struct kr_err *err);
/* The group id of NCCL (ncclGetUniqueId), made by one process of a group over several and passed
 * to the others (kr_cuda_comm_opts.nccl_id): out[cap], *len bytes. */
enum kr_status kr_cuda_comm_unique_id(void *out, size_t cap, size_t *len, struct kr_err *err);
/* After every rank stopped using it. NULL allowed. */
void kr_cuda_comm_free(struct kr_cuda_comm *c);
/* Ranks in the whole group; the device of (group-wide) rank `rank` when this process holds it, else -1. */
int kr_cuda_comm_size(const struct kr_cuda_comm *c);
int kr_cuda_comm_device(const struct kr_cuda_comm *c, int rank);
/* Whether NCCL carries (some of) the group's collectives. */
bool kr_cuda_comm_has_nccl(const struct kr_cuda_comm *c);
/* Whether the ranks share one device (their collectives then meet on the host: no CUDA graphs). */
bool kr_cuda_comm_one_device(const struct kr_cuda_comm *c);

/* Rank `rank`'s part (group-wide numbers; this process must hold it) of a collective, enqueued on `stream` (a cudaStream_t of its device):
 * x [n] summed over the ranks in place; dst [rows, size * cols] = the ranks' src [rows, cols] side
 * by side. KR_ERR_CANCELLED once the group was aborted. `force` (tests, benchmarks): 0 chooses (by
 * size; one device: the event-ordered exchange, whose calls must come from the ranks' own threads),
 * 1 the peer kernels, 2 NCCL (KR_ERR_UNSUPPORTED when that path is not there). One group keeps to
 * one path for its calls (the paths count their buffer slots apart). */
enum kr_status kr_cuda_comm_all_reduce(struct kr_cuda_comm *c, int rank, float *x, int64_t n, void *stream,
                                       int force);
enum kr_status kr_cuda_comm_all_gather(struct kr_cuda_comm *c, int rank, const float *src, int64_t rows,
                                       int64_t cols, float *dst, void *stream, int force);

/* Rank `rank` has issued a step on `stream`: the watchdog times its completion. */
void kr_cuda_comm_step_issued(struct kr_cuda_comm *c, int rank, void *stream);
/* Aborts the group (any thread, idempotent): see above. */
void kr_cuda_comm_abort(struct kr_cuda_comm *c);
/* False once the group was aborted, or a peer kernel of `rank` gave up (read after the rank's stream
 * was synchronized). */
bool kr_cuda_comm_ok(struct kr_cuda_comm *c, int rank);

#ifdef __cplusplus
}
#endif
