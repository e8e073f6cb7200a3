#pragma once
/* What `krait serve` serves from, put together at start-up: the compute backend, then on a loader
 * thread the model, the tokenizer and chat template, the step workspace and the engine with its
 * cache budget. No HTTP and no event loop: the server is told through a callback when loading
 * ended. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "chat.h"
#include "cluster.h"
#include "engine.h"
#include "grammar.h"
#include "model.h"
#include "server.h"
#include "status.h"
#include "tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kr_boot {
    struct kr_serve_opts o;        /* borrowed strings: they outlive the server */
    kr_backend_t be;               /* rank 0's */
    struct kr_model *m;            /* rank 0's; NULL until loaded */
    int tp;                        /* tensor-parallel ranks (1: alone) */
    kr_backend_t *rank_be;         /* [tp] every rank's backend ([0] == be); NULL alone */
    struct kr_model **rank_m;      /* [tp] every rank's model ([0] == m) */
    struct kr_host_comm *comm;     /* the ranks' collectives (CPU ranks: threads of this process) */
    struct kr_cluster *cluster;    /* several nodes (--nnodes): the others; NULL on one node. rank_be and
                                      rank_m then hold this node's ranks at [0 .. per), NULL after */
    struct kr_cuda_comm *cuda_comm; /* the ranks' collectives (CUDA ranks) */
    bool cuda_nodes;               /* several nodes with CUDA ranks: cuda_comm is made after the join */
    struct kr_tokenizer *tok;      /* NULL with --skip-tokenizer-init */
    struct kr_chat *chat;          /* NULL without a chat template */
    struct kr_grammar_vocab *gvocab; /* the tokenizer's tokens for constrained decoding (NULL without a
                                        tokenizer), the model's end-of-sequence ids as end ids */
    struct kr_grammar_cache *grammars; /* compiled constraints shared by requests (NULL without a tokenizer) */
    struct kr_engine *eng;
    int32_t max_model_len;         /* what a request may use: --max-model-len, else the model's */
    bool load_failed;              /* the loader logged why */
    pthread_t loader;
    bool loader_running;           /* started and not joined yet */
    void (*loaded)(void *user);    /* loader thread, once, when loading ended either way */
    void *loaded_user;
    /* a worker node (--node-rank > 0): its loop running the leader's steps on its own thread */
    void (*node_ended)(void *user); /* (set before kr_boot_load_start) that thread, once, when the loop
                                       ended: node_st tells how (KR_OK: the leader shut the group down) */
    pthread_t node_thread;
    bool node_running;             /* started and not joined yet */
    atomic_bool node_done;
    enum kr_status node_st;
    struct kr_err node_err;
};

/* Whether this process is a worker node (--node-rank > 0): no engine, no API. */
static inline bool kr_boot_is_worker(const struct kr_boot *b)
{
    return b->o.nnodes > 1 && b->o.node_rank > 0;
}

/* Whether the group of nodes is whole (true on one node). Any thread. */
bool kr_boot_group_healthy(struct kr_boot *b);

/* Wakes a loader waiting for the other nodes (shutdown while starting): it fails at once. */
void kr_boot_cancel(struct kr_boot *b);

/* Checks the options against the checkpoint before anything is loaded (--max-model-len beyond the
 * trained length without --allow-long-max-model-len). Returns 0, or the exit code (2) after
 * logging why. */
int kr_boot_check(const struct kr_serve_opts *o);

/* Starts the compute backend o->device names. KR_OK, or an error in err. */
enum kr_status kr_boot_init(struct kr_boot *b, const struct kr_serve_opts *o, struct kr_err *err);

/* Starts the loader thread; `loaded(user)` is called on it when loading ended (b->load_failed
 * tells how). KR_ERR_INTERNAL when the thread cannot start. */
enum kr_status kr_boot_load_start(struct kr_boot *b, void (*loaded)(void *user), void *user);

/* Waits for the loader thread (after `loaded`, or at shutdown). No-op when none runs. */
void kr_boot_load_join(struct kr_boot *b);

/* Stops the engine: its in-flight requests end as cancelled (their last events are sent before it
 * returns). No-op when none runs. */
void kr_boot_stop_engine(struct kr_boot *b);

/* Stops the engine and frees everything b holds. The loader must have been joined. */
void kr_boot_free(struct kr_boot *b);

#ifdef __cplusplus
}
#endif
