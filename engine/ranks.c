#include "ranks.h"

#include "alloc.h"
#include "cluster.h"
#include "log.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <sys/prctl.h>

struct rank {
    struct kr_ranks *g;
    int32_t index;            /* its place in the group (rank number, all nodes) */
    struct kr_model *m;
    struct kr_cache *cache;
    pthread_t thread;
    bool started;
    enum kr_status st;        /* of its last step */
    struct kr_err err;
};

struct kr_ranks {
    int32_t n;
    struct rank *r;           /* [n] */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t gen;             /* steps handed out */
    int32_t n_done;           /* ranks finished with step gen */
    bool stop;
    const struct kr_batch *b; /* the step, or the MTP pass */
    bool mtp;                 /* b is an MTP head pass (kr_model_mtp_forward), not a step */
    bool mtp_from_head;       /* its hidden states: the head's last outputs (else the step's residual stream) */
    const int32_t *mtp_src;   /* its rows' hidden-state rows */
    struct kr_wire_copy *ops;      /* copies since the previous step, in order */
    int32_t n_ops, cap_ops;
    bool ops_lost;            /* a copy could not be recorded: the group's caches differ */
    int32_t fault_rank;       /* KRAIT_FAULT_RANK: this rank's step fault_step fails (0: none) */
    int64_t fault_step;
    struct kr_cluster *remote; /* the leader's workers (NULL: none) */
    enum kr_status remote_st;  /* of handing them the current step */
    struct kr_err remote_err;
    struct kr_cluster *told;   /* a worker's group: told why a rank failed (NULL: none) */
};

static enum kr_status replay(struct rank *k)
{
    const struct kr_ranks *g = k->g;
    for (int32_t i = 0; i < g->n_ops; i++) {
        const struct kr_wire_copy *o = &g->ops[i];
        const int32_t lim = o->kind == 0 ? k->cache->n_blocks : k->cache->n_state_slots;
        if ((o->kind != 0 && o->kind != 1) || o->src < 0 || o->dst < 0 || o->src >= lim || o->dst >= lim) {
            return kr_err_set(&k->err, KR_ERR_INVAL, "rank %d: a cache copy names %s %d -> %d of %d", k->index,
                              o->kind == 0 ? "block" : "slot", o->src, o->dst, lim);
        }
        const enum kr_status st = o->kind == 0 ? kr_cache_block_copy(k->cache, o->src, o->dst)
                                               : kr_cache_slot_copy(k->cache, o->src, o->dst);
        if (st != KR_OK) {
            return kr_err_set(&k->err, st, "rank %d: a cache copy failed: %s", k->index, kr_status_str(st));
        }
    }
    return g->ops_lost ? kr_err_set(&k->err, KR_ERR_NOMEM, "rank %d: a cache copy of rank 0 was not recorded",
                                    k->index)
                       : KR_OK;
}

static void *rank_main(void *arg)
{
    struct rank *k = arg;
    struct kr_ranks *g = k->g;
    char name[16];
    snprintf(name, sizeof name, "kr-rank%d", (int)k->index);
    prctl(PR_SET_NAME, name, 0, 0, 0);
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&g->mu);
        while (!g->stop && g->gen == seen) {
            pthread_cond_wait(&g->go, &g->mu);
        }
        if (g->stop) {
            pthread_mutex_unlock(&g->mu);
            return NULL;
        }
        seen = g->gen;
        pthread_mutex_unlock(&g->mu);
        k->err.msg[0] = 0;
        k->st = replay(k);
        if (k->st == KR_OK && k->index == g->fault_rank && (int64_t)seen == g->fault_step) {
            k->st = kr_err_set(&k->err, KR_ERR_INTERNAL, "rank %d: injected failure of step %lld", k->index,
                               (long long)seen);
        }
        if (k->st != KR_OK) {
            if (g->told) {
                kr_cluster_abort(g->told, k->err.msg); /* the other nodes hear why */
            }
            kr_backend_tp_abort(k->m->be);
        } else if (g->mtp) {
            k->st = kr_model_mtp_forward(k->m, k->cache, g->b, g->mtp_from_head ? &k->m->mtp_g : &k->m->mtp_h,
                                         !g->mtp_from_head, g->mtp_src, NULL, &k->err);
        } else {
            k->st = kr_model_forward(k->m, k->cache, g->b, NULL, &k->err); /* aborts the group on failure */
        }
        pthread_mutex_lock(&g->mu);
        g->n_done++;
        pthread_cond_signal(&g->done);
        pthread_mutex_unlock(&g->mu);
    }
}

enum kr_status kr_ranks_start(struct kr_model *const *models, int32_t n, int32_t first, const struct kr_cache_plan *plan,
                              struct kr_cluster *remote, struct kr_ranks **out, struct kr_err *err)
{
    *out = NULL;
    struct kr_ranks *g = kr_calloc(1, sizeof *g);
    if (!g || !(g->r = kr_calloc((size_t)(n > 0 ? n : 1), sizeof *g->r)) || !(g->ops = kr_malloc(64 * sizeof *g->ops))) {
        if (g) {
            kr_free(g->r);
        }
        kr_free(g);
        return kr_err_set(err, KR_ERR_NOMEM, "out of memory");
    }
    g->n = n;
    g->cap_ops = 64;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->go, NULL);
    pthread_cond_init(&g->done, NULL);
    for (int32_t i = 0; i < n; i++) {
        struct rank *k = &g->r[i];
        k->g = g;
        k->index = first + i;
        k->m = models[i];
        /* storage only (the prefix cache's bookkeeping is rank 0's): the snapshot slots as more
         * slots, so that every state slot id means the same place */
        struct kr_cache_plan p = *plan;
        p.prefix = false;
        p.n_slots = plan->n_slots + (plan->prefix && k->m->n_mamba > 0 ? plan->n_snaps : 0);
        p.n_snaps = 0;
        enum kr_status st = kr_cache_create_plan(k->m, &p, &k->cache);
        if (st != KR_OK || pthread_create(&k->thread, NULL, rank_main, k) != 0) {
            kr_ranks_stop(g);
            return kr_err_set(err, st != KR_OK ? st : KR_ERR_NOMEM, "rank %d: cannot create its caches or thread",
                              (int)(first + i));
        }
        k->started = true;
    }
    if (remote) {
        const enum kr_status st = kr_cluster_start(remote, plan, err);
        if (st != KR_OK) {
            kr_ranks_stop(g);
            return st;
        }
        g->remote = remote;
    }
    *out = g;
    return KR_OK;
}

void kr_ranks_set_cluster(struct kr_ranks *g, struct kr_cluster *c)
{
    g->told = c;
}

void kr_ranks_lose_copies(struct kr_ranks *g)
{
    g->ops_lost = true;
}

void kr_ranks_stop(struct kr_ranks *g)
{
    if (!g) {
        return;
    }
    if (g->remote) {
        kr_cluster_bye(g->remote);
    }
    pthread_mutex_lock(&g->mu);
    g->stop = true;
    pthread_cond_broadcast(&g->go);
    pthread_mutex_unlock(&g->mu);
    for (int32_t i = 0; i < g->n; i++) {
        if (g->r[i].started) {
            pthread_join(g->r[i].thread, NULL);
        }
        kr_cache_free(g->r[i].cache);
    }
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->go);
    pthread_cond_destroy(&g->done);
    kr_free(g->ops);
    kr_free(g->r);
    kr_free(g);
}

enum kr_status kr_ranks_record_copy(void *ranks, int kind, int32_t src, int32_t dst)
{
    struct kr_ranks *g = ranks;
    if (g->n_ops == g->cap_ops) {
        struct kr_wire_copy *o = kr_realloc(g->ops, (size_t)g->cap_ops * 2 * sizeof *o);
        if (!o) {
            g->ops_lost = true;
            return KR_ERR_NOMEM;
        }
        g->ops = o;
        g->cap_ops *= 2;
    }
    g->ops[g->n_ops++] = (struct kr_wire_copy){kind, src, dst};
    return KR_OK;
}

void kr_ranks_set_fault(struct kr_ranks *g, int32_t rank, int64_t step)
{
    g->fault_rank = rank;
    g->fault_step = step;
}

void kr_ranks_begin(struct kr_ranks *g, const struct kr_batch *b)
{
    if (g->remote) {
        /* the workers first: their ranks meet these in the step's first collective. A failure
         * aborted the group, so the local ranks' collectives fail too */
        g->remote_err.msg[0] = 0;
        g->remote_st = kr_cluster_step_send(g->remote, g->ops, g->n_ops, g->ops_lost, b, KR_WIRE_STEP, NULL,
                                            &g->remote_err);
    }
    pthread_mutex_lock(&g->mu);
    g->b = b;
    g->mtp = false;
    g->n_done = 0;
    g->gen++;
    pthread_cond_broadcast(&g->go);
    pthread_mutex_unlock(&g->mu);
}

void kr_ranks_begin_mtp(struct kr_ranks *g, const struct kr_batch *b, bool from_head, const int32_t *src_row)
{
    if (g->remote) { /* as kr_ranks_begin: the workers first */
        g->remote_err.msg[0] = 0;
        g->remote_st = kr_cluster_step_send(g->remote, g->ops, g->n_ops, g->ops_lost, b,
                                            from_head ? KR_WIRE_MTP_FROM_HEAD : KR_WIRE_MTP_FROM_STEP, src_row,
                                            &g->remote_err);
    }
    pthread_mutex_lock(&g->mu);
    g->b = b;
    g->mtp = true;
    g->mtp_from_head = from_head;
    g->mtp_src = src_row;
    g->n_done = 0;
    g->gen++;
    pthread_cond_broadcast(&g->go);
    pthread_mutex_unlock(&g->mu);
}

enum kr_status kr_ranks_wait(struct kr_ranks *g, struct kr_err *err)
{
    pthread_mutex_lock(&g->mu);
    while (g->n_done < g->n) {
        pthread_cond_wait(&g->done, &g->mu);
    }
    pthread_mutex_unlock(&g->mu);
    g->n_ops = 0;
    if (g->remote && g->remote_st == KR_OK) {
        g->remote_st = kr_cluster_step_wait(g->remote, &g->remote_err);
    }
    /* the rank that failed first tells why: one whose error is its own, not the group's abort */
    const struct rank *cancelled = NULL;
    for (int32_t i = 0; i < g->n; i++) {
        const struct rank *k = &g->r[i];
        if (k->st != KR_OK && k->st != KR_ERR_CANCELLED) {
            return kr_err_set(err, k->st, "%s", k->err.msg[0] ? k->err.msg : kr_status_str(k->st));
        }
        cancelled = k->st != KR_OK && !cancelled ? k : cancelled;
    }
    if (g->remote && g->remote_st != KR_OK) {
        /* a worker's failure or the group's abort: the cluster knows which node and why */
        const char *why = kr_cluster_why(g->remote);
        return kr_err_set(err, g->remote_st, "%s", why[0] ? why : g->remote_err.msg);
    }
    if (cancelled) {
        return kr_err_set(err, cancelled->st, "%s", cancelled->err.msg[0] ? cancelled->err.msg : kr_status_str(cancelled->st));
    }
    return KR_OK;
}
