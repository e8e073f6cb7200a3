/* Host collectives for tensor-parallel ranks in one process: a generation-counted barrier around
 * shared pointers. all_reduce: every rank posts its buffer; after the barrier each rank sums its
 * own share of the elements over all buffers (rank order) into a shared result; after a second
 * barrier each rank copies the result back; a third keeps the result alive until everyone has
 * copied it. */
#include "comm.h"

#include "alloc.h"

#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#define KR_COMM_MAX 64

struct kr_host_comm {
    int size;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    uint64_t gen;
    bool aborted;
    const float *src[KR_COMM_MAX]; /* posted buffers of the current collective */
    int64_t n[KR_COMM_MAX];        /* their element counts (must agree) */
    float *res;                    /* shared result of all_reduce */
    size_t res_cap;
    bool res_nomem;
};

enum kr_status kr_host_comm_create(int size, struct kr_host_comm **out)
{
    *out = NULL;
    if (size < 1 || size > KR_COMM_MAX) {
        return KR_ERR_INVAL;
    }
    struct kr_host_comm *c = kr_calloc(1, sizeof *c);
    if (!c) {
        return KR_ERR_NOMEM;
    }
    c->size = size;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    *out = c;
    return KR_OK;
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
}

/* Waits until every rank has arrived. `last` runs (under the lock) in the last rank to arrive,
 * before anyone is released. */
static enum kr_status barrier(struct kr_host_comm *c, void (*last)(struct kr_host_comm *))
{
    pthread_mutex_lock(&c->mu);
    if (c->aborted) {
        pthread_mutex_unlock(&c->mu);
        return KR_ERR_CANCELLED;
    }
    const uint64_t gen = c->gen;
    if (++c->arrived == c->size) {
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
    for (int r = 1; r < c->size; r++) {
        if (c->n[r] != c->n[0]) {
            return false;
        }
    }
    return true;
}

enum kr_status kr_host_comm_all_reduce(struct kr_host_comm *c, int rank, float *x, int64_t n)
{
    if (rank < 0 || rank >= c->size || n < 0) {
        return KR_ERR_INVAL;
    }
    if (c->size == 1) {
        return KR_OK;
    }
    c->src[rank] = x;
    c->n[rank] = n;
    KR_TRY(barrier(c, size_result));
    /* everyone reads the same posted state here; nobody writes it until the next barrier */
    const enum kr_status st = !counts_agree(c) ? KR_ERR_INVAL : c->res_nomem ? KR_ERR_NOMEM : KR_OK;
    if (st == KR_OK) {
        const int64_t per = (n + c->size - 1) / c->size, i0 = rank * per, i1 = i0 + per < n ? i0 + per : n;
        for (int64_t i = i0; i < i1; i++) {
            float s = c->src[0][i];
            for (int r = 1; r < c->size; r++) {
                s += c->src[r][i];
            }
            c->res[i] = s;
        }
    }
    KR_TRY(barrier(c, NULL));
    if (st == KR_OK) {
        memcpy(x, c->res, (size_t)n * sizeof(float));
    }
    KR_TRY(barrier(c, NULL));
    return st;
}

enum kr_status kr_host_comm_all_gather(struct kr_host_comm *c, int rank, const float *src, int64_t rows,
                                       int64_t cols, float *dst)
{
    if (rank < 0 || rank >= c->size || rows < 0 || cols < 0) {
        return KR_ERR_INVAL;
    }
    c->src[rank] = src;
    c->n[rank] = rows * cols;
    if (c->size > 1) {
        KR_TRY(barrier(c, NULL));
    }
    const enum kr_status st = counts_agree(c) ? KR_OK : KR_ERR_INVAL;
    if (st == KR_OK) {
        const int64_t width = cols * c->size;
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
