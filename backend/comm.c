/* Host collectives for tensor-parallel ranks in one process: a generation-counted barrier around
 * shared pointers. all_reduce: every rank posts its buffer; after the barrier each rank sums its
 * own share of the elements over all buffers (rank order) into a shared result; after a second
 * barrier each rank copies the result back; a third keeps the result alive until everyone has
 * copied it. A group that spans processes puts one more step between the first two of those: the
 * process's first rank hands the local result to the link and gets the group's back. */
#include "comm.h"

#include "alloc.h"

#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#define KR_COMM_MAX 64

struct kr_host_comm {
    int size;                      /* ranks in the group, all processes */
    int first, n_local;            /* this process's ranks: first .. first + n_local - 1 */
    bool has_link;
    struct kr_comm_link link;      /* the other processes (has_link) */
    enum kr_status link_st;        /* of the current collective's link call */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    uint64_t gen;
    bool aborted;
    const float *src[KR_COMM_MAX]; /* posted buffers of the current collective, by local index */
    float *dst[KR_COMM_MAX];       /* all_gather's outputs, by local index (with a link) */
    int64_t n[KR_COMM_MAX];        /* their element counts (must agree) */
    float *res;                    /* shared result of all_reduce */
    size_t res_cap;
    bool res_nomem;
};

enum kr_status kr_host_comm_create_part(int size, int first, int n_local, const struct kr_comm_link *link,
                                        struct kr_host_comm **out)
{
    *out = NULL;
    if (size < 1 || size > KR_COMM_MAX || n_local < 1 || first < 0 || first + n_local > size ||
        (n_local < size && !link)) {
        return KR_ERR_INVAL;
    }
    struct kr_host_comm *c = kr_calloc(1, sizeof *c);
    if (!c) {
        return KR_ERR_NOMEM;
    }
    c->size = size;
    c->first = first;
    c->n_local = n_local;
    if (n_local < size) {
        c->has_link = true;
        c->link = *link;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    *out = c;
    return KR_OK;
}

enum kr_status kr_host_comm_create(int size, struct kr_host_comm **out)
{
    return kr_host_comm_create_part(size, 0, size, NULL, out);
}

void kr_host_comm_free(struct kr_host_comm *c)
{
    if (!c) {
        return;
    }
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    kr_free(c->res);
    kr_free(c);
}

int kr_host_comm_size(const struct kr_host_comm *c)
{
    return c->size;
}

void kr_host_comm_abort(struct kr_host_comm *c)
{
    pthread_mutex_lock(&c->mu);
    c->aborted = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (c->has_link) {
        c->link.abort(c->link.user);
    }
}

/* Waits until every rank of this process has arrived. `last` runs (under the lock) in the last
 * rank to arrive, before anyone is released. */
static enum kr_status barrier(struct kr_host_comm *c, void (*last)(struct kr_host_comm *))
{
    pthread_mutex_lock(&c->mu);
    if (c->aborted) {
        pthread_mutex_unlock(&c->mu);
        return KR_ERR_CANCELLED;
    }
    const uint64_t gen = c->gen;
    if (++c->arrived == c->n_local) {
        if (last) {
            last(c);
        }
        c->arrived = 0;
        c->gen++;
        pthread_cond_broadcast(&c->cv);
    } else {
        while (c->gen == gen && !c->aborted) {
            pthread_cond_wait(&c->cv, &c->mu);
        }
    }
    const bool aborted = c->gen == gen; /* released by abort, not by the last arrival */
    pthread_mutex_unlock(&c->mu);
    return aborted ? KR_ERR_CANCELLED : KR_OK;
}

/* Runs in the last arriving rank: sizes the shared result for the posted count. */
static void size_result(struct kr_host_comm *c)
{
    c->res_nomem = false;
    const size_t need = (size_t)c->n[0] * sizeof(float);
    if (need > c->res_cap) {
        float *r = kr_realloc(c->res, need);
        if (!r) {
            c->res_nomem = true;
            return;
        }
        c->res = r;
        c->res_cap = need;
    }
}

static bool counts_agree(const struct kr_host_comm *c)
{
    for (int r = 1; r < c->n_local; r++) {
        if (c->n[r] != c->n[0]) {
            return false;
        }
    }
    return true;
}

/* The rank's index among this process's ranks, or -1 when it is not one of them. */
static int local_index(const struct kr_host_comm *c, int rank)
{
    return rank >= c->first && rank < c->first + c->n_local ? rank - c->first : -1;
}

enum kr_status kr_host_comm_all_reduce(struct kr_host_comm *c, int rank, float *x, int64_t n)
{
    const int li = local_index(c, rank);
    if (li < 0 || n < 0) {
        return KR_ERR_INVAL;
    }
    if (c->size == 1) {
        return KR_OK;
    }
    c->src[li] = x;
    c->n[li] = n;
    KR_TRY(barrier(c, size_result));
    /* everyone reads the same posted state here; nobody writes it until the next barrier */
    enum kr_status st = !counts_agree(c) ? KR_ERR_INVAL : c->res_nomem ? KR_ERR_NOMEM : KR_OK;
    if (st == KR_OK) {
        const int64_t per = (n + c->n_local - 1) / c->n_local, i0 = li * per, i1 = i0 + per < n ? i0 + per : n;
        for (int64_t i = i0; i < i1; i++) {
            float s = c->src[0][i];
            for (int r = 1; r < c->n_local; r++) {
                s += c->src[r][i];
            }
            c->res[i] = s;
        }
    }
    KR_TRY(barrier(c, NULL));
    if (c->has_link) {
        /* the process's sum crosses to the others; the rest of its ranks wait at the barrier */
        if (li == 0) {
            c->link_st = st == KR_OK ? c->link.all_reduce(c->link.user, c->res, n) : st;
        }
        KR_TRY(barrier(c, NULL));
        st = c->link_st;
    }
    if (st == KR_OK) {
        memcpy(x, c->res, (size_t)n * sizeof(float));
    }
    KR_TRY(barrier(c, NULL));
    return st;
}

enum kr_status kr_host_comm_all_gather(struct kr_host_comm *c, int rank, const float *src, int64_t rows,
                                       int64_t cols, float *dst)
{
    const int li = local_index(c, rank);
    if (li < 0 || rows < 0 || cols < 0) {
        return KR_ERR_INVAL;
    }
    c->src[li] = src;
    c->dst[li] = dst;
    c->n[li] = rows * cols;
    if (c->size > 1) {
        KR_TRY(barrier(c, NULL));
    }
    enum kr_status st = counts_agree(c) ? KR_OK : KR_ERR_INVAL;
    const int64_t width = cols * c->size;
    if (!c->has_link) {
        if (st == KR_OK) {
            for (int r = 0; r < c->size; r++) {
                for (int64_t i = 0; i < rows; i++) {
                    memcpy(dst + i * width + r * cols, c->src[r] + i * cols, (size_t)cols * sizeof(float));
                }
            }
        }
        if (c->size > 1) {
            KR_TRY(barrier(c, NULL)); /* the sources stay valid until every rank has read them */
        }
        return st;
    }
    /* the first local rank fills its dst with this process's columns, the link the others' */
    if (li == 0) {
        if (st == KR_OK) {
            for (int r = 0; r < c->n_local; r++) {
                for (int64_t i = 0; i < rows; i++) {
                    memcpy(dst + i * width + (c->first + r) * cols, c->src[r] + i * cols, (size_t)cols * sizeof(float));
                }
            }
        }
        c->link_st = st == KR_OK ? c->link.all_gather(c->link.user, dst, rows, width, c->first * cols,
                                                      c->n_local * cols)
                                 : st;
    }
    KR_TRY(barrier(c, NULL));
    st = c->link_st;
    if (st == KR_OK && li != 0) {
        memcpy(dst, c->dst[0], (size_t)(rows * width) * sizeof(float));
    }
    KR_TRY(barrier(c, NULL)); /* the first rank's dst stays valid until every rank has copied it */
    return st;
}
