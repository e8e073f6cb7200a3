#pragma once
/* The ranks of a tensor-parallel group beyond the first, driven by the engine: one thread per rank,
 * each with its model shard and its own caches. The engine (rank 0) plans every step once; each
 * rank runs the same batch on its shard, the forward pass's collectives joining them, and only
 * rank 0 samples (the logits are whole on every rank after the LM head's all-gather).
 *
 * The caches' bookkeeping (slots, blocks, the prefix cache) lives on rank 0 alone. The other
 * ranks' caches are storage with the same plan, so a slot or block id means the same place on every
 * rank; the copies rank 0 makes between steps (forks, snapshots) are recorded through the cache's
 * copy hook and replayed by each rank, in order, before the next step.
 *
 * A rank whose step fails aborts the group's collectives (kr_backend_tp_abort), so that the others
 * leave theirs with an error instead of waiting; the group is then unusable. Engine thread only.
 *
 * Over several nodes (engine/cluster.h) the leader's group also has remote ranks: each step's
 * plan (the copies to replay, then the batch) goes to every worker before the local ranks start,
 * and the step ends when the workers said so too. A worker drives its own ranks with a group of
 * this kind (every local rank a thread) from the plans it receives. */
#include <stdint.h>

#include "batch.h"
#include "cache.h"
#include "model.h"
#include "status.h"

struct kr_ranks;
struct kr_cluster;

/* Starts n ranks as threads (models[i] is rank first + i, already joined to the group and
 * reserved; n may be 0) with caches of `plan`. `remote` (NULL: none) is the leader's link to the
 * workers' ranks: they get the plan now (kr_cluster_start) and every step. */
enum kr_status kr_ranks_start(struct kr_model *const *models, int32_t n, int32_t first, const struct kr_cache_plan *plan,
                              struct kr_cluster *remote, struct kr_ranks **out, struct kr_err *err);
/* A worker's group: a rank that fails its step tells the other nodes why (kr_cluster_abort). */
void kr_ranks_set_cluster(struct kr_ranks *r, struct kr_cluster *c);
/* Stops the threads and frees their caches (the models stay the caller's); a leader's workers are
 * told that the group shuts down. NULL allowed. */
void kr_ranks_stop(struct kr_ranks *r);

/* The cache hook: rank 0 copied a block (kind 0) or a slot (kind 1); replayed before the next step. */
enum kr_status kr_ranks_record_copy(void *ranks, int kind, int32_t src, int32_t dst);
/* A copy could not be recorded (a worker's view of the leader's flag): the next step fails. */
void kr_ranks_lose_copies(struct kr_ranks *r);

/* KRAIT_FAULT_RANK (tests): the step handed out `step`-th (from 1) fails on rank `rank` as if it
 * died there: it leaves the group (aborting its collectives) with an error. */
void kr_ranks_set_fault(struct kr_ranks *r, int32_t rank, int64_t step);

/* Hands step b to every rank (b and what it points to must stay unchanged until kr_ranks_wait). */
void kr_ranks_begin(struct kr_ranks *r, const struct kr_batch *b);
/* Hands an MTP head pass to every rank of this process (kr_model_mtp_forward over each rank's own
 * hidden states: the head's last outputs when from_head, else the step's residual stream; rows
 * src_row): the head's blocks are split like the main stack's. A leader's workers get it as a PLAN
 * too. Ends with kr_ranks_wait. */
void kr_ranks_begin_mtp(struct kr_ranks *r, const struct kr_batch *b, bool from_head, const int32_t *src_row);
/* Waits until every rank finished the step; the first rank's error, with its message in err. */
enum kr_status kr_ranks_wait(struct kr_ranks *r, struct kr_err *err);
