#pragma once
/* kr_cluster: the nodes of a multi-node tensor-parallel group, over TCP. Node 0 (the leader) runs
 * the engine and serves the API; nodes 1.. (workers) each hold `per` ranks of the group (node r:
 * ranks r * per .. r * per + per - 1) and run every step the leader plans on them.
 *
 *  - Bootstrap (kr_cluster_join): the leader listens on the master port and waits, up to the
 *    join timeout, for every worker; a worker connects (retrying until then) and sends its
 *    configuration, which the leader compares field by field: a difference, a node rank out of
 *    range or already taken is refused with a message naming the field and both values (the
 *    worker fails with it; the leader logs it and keeps waiting for a worker that fits).
 *  - kr_cluster_bcast_blob: opaque bytes from the leader to every worker, at start-up.
 *  - The link (kr_cluster_link): the collectives of the CPU backend across processes, a star
 *    through the leader (engine/wire.h has the frames).
 *  - Steps: the leader sends the cache plan once (kr_cluster_start) and each step's plan
 *    (kr_cluster_step_send: the batch and the cache copies since the last one), then collects the
 *    workers' ends (kr_cluster_step_wait); a worker runs kr_cluster_serve until the leader says
 *    goodbye (kr_cluster_bye).
 *
 * Failure: any node's failure aborts the group (an ABORT frame to the peers, then the connection's
 * sending side shut), every blocked call returns within the step timeout at worst, at once when a
 * peer's connection closes, and the group is unusable after. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "batch.h"
#include "cache.h"
#include "comm.h"
#include "model.h"
#include "status.h"
#include "wire.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KR_CLUSTER_DEFAULT_PORT    29500
#define KR_CLUSTER_DEFAULT_TIMEOUT 600.0 /* seconds the bootstrap waits for the other nodes */

struct kr_cluster;

struct kr_cluster_opts {
    int nnodes;              /* >= 2 */
    int node_rank;           /* 0 (leader) .. nnodes - 1 */
    const char *master_addr; /* the leader's address (a name or IPv4/IPv6 literal), borrowed */
    int master_port;         /* the leader listens there (on every address) */
    int tp;                  /* ranks in the group, all nodes; a multiple of nnodes */
    double join_timeout_s;   /* how long the bootstrap waits for the other nodes */
    double step_timeout_s;   /* how long a step may wait for another node (0: 300 s) */
};

/* Checks the options; the leader binds and listens on the master port already (so that a port in
 * use fails at start). *out is the caller's (kr_cluster_free). */
enum kr_status kr_cluster_create(const struct kr_cluster_opts *o, struct kr_cluster **out, struct kr_err *err);
/* Closes every connection. Threads using the cluster must have stopped. NULL allowed. */
void kr_cluster_free(struct kr_cluster *c);

int kr_cluster_node(const struct kr_cluster *c);
int kr_cluster_nnodes(const struct kr_cluster *c);
/* Ranks per node, and the first rank of this node. */
int kr_cluster_per_node(const struct kr_cluster *c);
int kr_cluster_first_rank(const struct kr_cluster *c);

/* The collectives' link to the other nodes (comm.h), valid while c lives. */
const struct kr_comm_link *kr_cluster_link(struct kr_cluster *c);

/* The bootstrap, with this node's configuration f[n] (one field "node-rank" among them is this
 * node's identity; every other field must be equal on every node). Blocks until every node joined
 * (leader) or the leader welcomed this node (worker), the join timeout, or kr_cluster_abort.
 * A refusal is KR_ERR_INVAL with the leader's message. */
enum kr_status kr_cluster_join(struct kr_cluster *c, const struct kr_wire_field *f, int32_t n, struct kr_err *err);

/* Start-up only, after join, every node calling it once in the same order: the leader sends
 * data[*len] to every worker; a worker receives into data[cap] and sets *len. */
enum kr_status kr_cluster_bcast_blob(struct kr_cluster *c, void *data, size_t *len, size_t cap, struct kr_err *err);

/* Leaves the group with a reason: wakes every blocked call (they return KR_ERR_CANCELLED) and
 * tells the peers. Idempotent, any thread. */
void kr_cluster_abort(struct kr_cluster *c, const char *why);
/* Start-up, before the group runs: fn(user) is called once by the first kr_cluster_abort (any
 * thread, after the peers were told), e.g. to abort collectives that do not go through the link
 * (NCCL's, which would otherwise wait for a node that left). */
void kr_cluster_on_abort(struct kr_cluster *c, void (*fn)(void *user), void *user);
/* Whether the group is whole: joined and not aborted (a peer's closed connection is seen too). */
bool kr_cluster_healthy(struct kr_cluster *c);
/* Why the group was aborted ("" when it was not); valid while c lives. */
const char *kr_cluster_why(struct kr_cluster *c);

/* ---- the leader's side of the steps (engine/ranks.c, engine thread) ---------------------------- */

/* Sends the cache plan and waits for every worker's ranks to have their caches. */
enum kr_status kr_cluster_start(struct kr_cluster *c, const struct kr_cache_plan *plan, struct kr_err *err);
/* Sends a step: the copies to replay first (lost: one was not recorded), then the batch. */
enum kr_status kr_cluster_step_send(struct kr_cluster *c, const struct kr_wire_copy *ops, int32_t n_ops, bool lost,
                                    const struct kr_batch *b, int mtp, const int32_t *src_row, struct kr_err *err);
/* Waits for every worker to end the step; the first failure with its node named. */
enum kr_status kr_cluster_step_wait(struct kr_cluster *c, struct kr_err *err);
/* Tells the workers that the group shuts down (they exit 0). No-op once aborted. */
void kr_cluster_bye(struct kr_cluster *c);

/* ---- a worker's side ------------------------------------------------------------------------- */

/* What a worker's ranks reserve for a step (the engine's kr_model_reserve arguments). */
struct kr_cluster_reserve {
    int64_t n_tok, n_out, n_seq, max_ctx;
    int32_t block_size;
};

/* A worker's loop (its own thread): receives the cache plan, starts this node's ranks (models[n],
 * this node's shards, joined to the group) with their caches, then runs every step the leader
 * sends. KR_OK when the leader said goodbye; an error (with why) when the group failed or the
 * leader went away. KRAIT_FAULT_STEP / KRAIT_FAULT_RANK naming a rank of this node apply. */
enum kr_status kr_cluster_serve(struct kr_cluster *c, struct kr_model *const *models, int32_t n,
                                const struct kr_cluster_reserve *rs, struct kr_err *err);

/* ---- fingerprints --------------------------------------------------------------------------- */

/* FNV-1a 64 of a model's config.json, and of its *.safetensors headers (tensor names, dtypes,
 * shapes and offsets; files in name order). */
enum kr_status kr_cluster_config_fingerprint(const char *model_dir, uint64_t *out, struct kr_err *err);
enum kr_status kr_cluster_weights_fingerprint(const char *model_dir, uint64_t *out, struct kr_err *err);

#ifdef __cplusplus
}
#endif
