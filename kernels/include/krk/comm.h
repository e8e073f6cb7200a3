#pragma once
/* Collectives of a tensor-parallel group over memory every rank can address: the ranks' GPUs with
 * peer access between them, or one GPU holding several ranks. One kernel does a whole collective
 * ("one shot"): each rank copies its input into its own exchange buffer, signals every peer, waits
 * for every peer's signal and reads the buffers of all ranks. For the small messages of decode steps
 * this beats a ring (NCCL) whose latency is several hops; larger messages go to NCCL.
 *
 * Sums are taken in rank order 0..size-1 in fp32, so every rank gets the same bits.
 *
 * Synchronization lives in device memory (a per-block call counter of each rank, flags written
 * into the receiver's memory), so the launchers can be captured into CUDA graphs and replayed. The
 * exchange buffer has two slots used alternately: a rank can start call k+1 while a slow peer still
 * reads call k, and cannot start call k+2 before every peer has begun call k+1 (it waits for their
 * signals), by which time they have finished reading call k.
 *
 * A rank that will never join (its step failed) must not leave its peers spinning: they poll a
 * host-mapped abort word, and give up after `timeout_ns` of waiting; either way they set *error and
 * leave the call (its output is then garbage; the group is finished). */
#include <stdint.h>

#include "krk/common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KRK_PEER_MAX_RANKS 8
#define KRK_PEER_MAX_BLOCKS 32

/* What one rank's kernels need: the group's buffers and flags (device addresses valid on this
 * rank's device) and this rank's own counters. */
struct krk_peer {
    int32_t rank, size;                 /* 1 < size <= KRK_PEER_MAX_RANKS */
    float *buf[KRK_PEER_MAX_RANKS];     /* each rank's exchange buffer [2][cap] */
    uint32_t *flag[KRK_PEER_MAX_RANKS]; /* each rank's flags [KRK_PEER_MAX_BLOCKS][KRK_PEER_MAX_RANKS],
                                           zeroed: flag[r][b][p] is the last call in which peer p's
                                           block b had written its part for rank r */
    uint32_t *calls;                    /* this rank's [KRK_PEER_MAX_BLOCKS] call counters, zeroed */
    int32_t *error;                     /* this rank's word: set to 1 when a call gave up (device) */
    const volatile int32_t *abort;      /* host-mapped word: nonzero makes every wait give up */
    int64_t cap;                        /* floats in each slot of a buffer */
    uint64_t timeout_ns;                /* longest wait for a peer (0: forever) */
};

/* x[i] = sum over ranks of x[i], i < n, in place; in launches of at most p->cap elements. Every rank
 * calls it with the same n (the calls' chunking must agree). */
enum kr_status krk_peer_all_reduce(const struct krk_peer *p, float *x, int64_t n, cudaStream_t stream);

/* dst [rows, size * cols] = the ranks' src [rows, cols] side by side (rank r at column r * cols);
 * dst must not overlap src. Launches of at most p->cap / cols rows (cols <= p->cap). */
enum kr_status krk_peer_all_gather(const struct krk_peer *p, const float *src, int64_t rows, int64_t cols, float *dst,
                                   cudaStream_t stream);

/* The reading phase alone, without signals: out from slot `slot` (0 or 1) of every rank's buffer,
 * the rank-order sum (gather 0: out [n]) or the blocks side by side (gather 1: out [n / cols,
 * size * cols], n a multiple of cols). For a group whose ordering comes from elsewhere (events
 * between the ranks' streams): every rank's part of the slot must be written before it runs. */
enum kr_status krk_peer_combine(const struct krk_peer *p, int slot, float *out, int64_t n, int64_t cols, int gather,
                                cudaStream_t stream);

#ifdef __cplusplus
}
#endif
