/* The CUDA backend's tensor-parallel group (comm-cuda.h): NCCL for large messages and groups
 * without peer access, the one-shot peer kernels for small ones, a watchdog for steps that never
 * complete. */
#include "comm-cuda.h"

#include "alloc.h"
#include "krk.h"
#include "krk/comm.h"
#include "log.h"

#include <cuda_runtime_api.h>
#ifdef KR_WITH_NCCL
#include <nccl.h>
#endif
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define GATHER_TMP_BYTES ((size_t)32 << 20) /* NCCL all-gather staging per rank (chunked by rows) */
#define ONE_DEVICE_CAP ((int64_t)1 << 22)   /* floats per slot when the peer kernels carry everything */

struct member {
    int dev;
    struct krk_peer peer;     /* this rank's view of the peer buffers */
    float *buf;               /* its exchange buffer [2][cap] (device) */
    uint32_t *flag, *calls;   /* its flags and counters (device) */
    int32_t *error;           /* its give-up word (host-mapped; the device pointer is in peer) */
    float *tmp;               /* NCCL all-gather staging (device), GATHER_TMP_BYTES */
#ifdef KR_WITH_NCCL
    ncclComm_t nccl;
#endif
    cudaEvent_t ev_put[2], ev_read[2]; /* one device: this rank's part of a slot written / the slot read */
    uint64_t n_calls;         /* one device: collectives this rank has issued (slot = parity) */
    pthread_mutex_t mu;       /* held around an NCCL call of this rank and by the abort */
    cudaEvent_t ev_step;      /* recorded after each issued step */
    double t_step;            /* when (CLOCK_MONOTONIC s); 0: no step outstanding */
};

struct kr_cuda_comm {
    int size;                 /* ranks in this process: m[0 .. size) are ranks first .. first + size - 1 */
    int first, world;         /* of a group of `world` ranks (several processes: NCCL only) */
    bool one_device, peer_ok, nccl_ok;
    size_t peer_max;
    double timeout_s;
    int32_t *abort_word;      /* host-mapped, read by the peer kernels */
    atomic_bool aborted;
    struct member m[KRK_PEER_MAX_RANKS];
    pthread_mutex_t bar_mu;   /* one device: the ranks' threads meet at each collective */
    pthread_cond_t bar_cv;
    int bar_n;
    uint64_t bar_gen;
    pthread_mutex_t wd_mu;
    pthread_cond_t wd_cv;
    bool wd_stop, wd_started;
    pthread_t wd;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define CU_OR_FAIL(expr, what)                                                                     \
    do {                                                                                           \
        cudaError_t e_ = (expr);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            kr_err_set(err, KR_ERR_CUDA, "tensor parallel: %s failed: %s", what, cudaGetErrorString(e_)); \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

/* Aborts the NCCL communicator of rank r unless its thread is stuck inside an NCCL call for more
 * than two seconds (the communicator is then left as it is: the process is ending anyway). */
static void abort_member(struct member *m)
{
#ifdef KR_WITH_NCCL
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 2;
    if (pthread_mutex_timedlock(&m->mu, &dl) != 0) {
        KR_LOG_WARN("tensor parallel: a rank is inside NCCL; its communicator is not aborted");
        return;
    }
    if (m->nccl) {
        ncclCommAbort(m->nccl);
        m->nccl = NULL;
    }
    pthread_mutex_unlock(&m->mu);
#else
    (void)m;
#endif
}

void kr_cuda_comm_abort(struct kr_cuda_comm *c)
{
    if (!c || atomic_exchange(&c->aborted, true)) {
        return;
    }
    *(volatile int32_t *)c->abort_word = 1;
    KR_LOG_ERROR("tensor parallel: the group is aborted");
    pthread_mutex_lock(&c->bar_mu);
    pthread_cond_broadcast(&c->bar_cv);
    pthread_mutex_unlock(&c->bar_mu);
    for (int r = 0; r < c->size; r++) {
        abort_member(&c->m[r]);
    }
}

static void *watchdog_main(void *arg)
{
    struct kr_cuda_comm *c = arg;
    pthread_mutex_lock(&c->wd_mu);
    while (!c->wd_stop) {
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_nsec += 200 * 1000 * 1000;
        if (dl.tv_nsec >= 1000000000L) {
            dl.tv_sec++;
            dl.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->wd_cv, &c->wd_mu, &dl);
        if (c->wd_stop || atomic_load(&c->aborted)) {
            continue;
        }
        const double t = now_s();
        for (int r = 0; r < c->size; r++) {
            struct member *m = &c->m[r];
            if (m->t_step > 0 && t - m->t_step > c->timeout_s) {
                const cudaError_t e = cudaEventQuery(m->ev_step);
                if (e == cudaErrorNotReady) {
                    KR_LOG_ERROR("tensor parallel: rank %d's step has not completed after %.0f s", r, c->timeout_s);
                    pthread_mutex_unlock(&c->wd_mu);
                    kr_cuda_comm_abort(c);
                    pthread_mutex_lock(&c->wd_mu);
                    break;
                }
                (void)cudaGetLastError();
                m->t_step = 0;
            }
#ifdef KR_WITH_NCCL
            ncclResult_t ae = ncclSuccess;
            if (m->nccl && pthread_mutex_trylock(&m->mu) == 0) {
                if (m->nccl && ncclCommGetAsyncError(m->nccl, &ae) == ncclSuccess && ae != ncclSuccess &&
                    ae != ncclInProgress) {
                    KR_LOG_ERROR("tensor parallel: NCCL reports an error on rank %d: %s", r, ncclGetErrorString(ae));
                }
                pthread_mutex_unlock(&m->mu);
            }
            if (ae != ncclSuccess && ae != ncclInProgress) {
                pthread_mutex_unlock(&c->wd_mu);
                kr_cuda_comm_abort(c);
                pthread_mutex_lock(&c->wd_mu);
                break;
            }
#endif
        }
    }
    pthread_mutex_unlock(&c->wd_mu);
    return NULL;
}

/* Peer access from every device of the group to every other (true when all pairs have it). */
static bool enable_peer_access(const struct kr_cuda_comm *c)
{
    for (int i = 0; i < c->size; i++) {
        for (int j = 0; j < c->size; j++) {
            const int a = c->m[i].dev, b = c->m[j].dev;
            int can = 0;
            if (a == b) {
                continue;
            }
            if (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess || !can) {
                (void)cudaGetLastError();
                return false;
            }
            if (cudaSetDevice(a) != cudaSuccess) {
                return false;
            }
            const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
            if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
                (void)cudaGetLastError();
                return false;
            }
            (void)cudaGetLastError();
        }
    }
    return true;
}

enum kr_status kr_cuda_comm_create(const struct kr_cuda_comm_opts *o, struct kr_cuda_comm **out, struct kr_err *err)
{
    *out = NULL;
    const int world = o->nccl_id ? o->world : o->size, first = o->nccl_id ? o->first : 0;
    if (o->size < 1 || o->size > KRK_PEER_MAX_RANKS || world < o->size || first < 0 || first + o->size > world ||
        (o->nccl_id && o->one_device)) {
        return kr_err_set(err, KR_ERR_INVAL,
                          "tensor parallel: ranks %d..%d of %d on CUDA devices (1 to %d in a process are supported)",
                          first, first + o->size - 1, world, KRK_PEER_MAX_RANKS);
    }
    for (int i = 0; i < o->size && !o->one_device; i++) {
        for (int j = 0; j < i; j++) {
            if (o->devices[i] == o->devices[j]) {
                return kr_err_set(err, KR_ERR_INVAL, "tensor parallel: ranks %d and %d both on CUDA device %d", j, i,
                                  o->devices[i]);
            }
        }
    }
#ifndef KR_WITH_NCCL
    if (!o->one_device && world > 1) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED,
                          "tensor parallel: this build has no NCCL (install NCCL and rebuild to serve over several GPUs)");
    }
#endif
    struct kr_cuda_comm *c = kr_calloc(1, sizeof *c);
    if (!c) {
        return kr_err_set(err, KR_ERR_NOMEM, "out of memory");
    }
    enum kr_status st = KR_ERR_CUDA;
    c->size = o->size;
    c->first = first;
    c->world = world;
    c->one_device = o->one_device;
    c->timeout_s = o->timeout_s > 0 ? o->timeout_s : 300;
    atomic_init(&c->aborted, false);
    pthread_mutex_init(&c->wd_mu, NULL);
    pthread_cond_init(&c->wd_cv, NULL);
    pthread_mutex_init(&c->bar_mu, NULL);
    pthread_cond_init(&c->bar_cv, NULL);
    for (int r = 0; r < c->size; r++) {
        c->m[r].dev = o->one_device ? o->devices[0] : o->devices[r];
        pthread_mutex_init(&c->m[r].mu, NULL);
    }
    int cur = 0;
    (void)cudaGetDevice(&cur);
    CU_OR_FAIL(cudaHostAlloc((void **)&c->abort_word, sizeof(int32_t), cudaHostAllocMapped | cudaHostAllocPortable),
               "the abort word's allocation");
    *c->abort_word = 0;
    /* peer memory within one process only: a group over processes takes NCCL for everything */
    c->peer_ok = c->size > 1 && !o->nccl_id && (o->one_device || enable_peer_access(c));
    c->peer_max = o->one_device ? SIZE_MAX : c->peer_ok ? o->peer_max_bytes : 0;
    const int64_t cap = o->one_device ? ONE_DEVICE_CAP : (int64_t)((o->peer_max_bytes / sizeof(float) + 3) & ~(size_t)3);
    if (c->peer_ok && c->peer_max > 0) {
        for (int r = 0; r < c->size; r++) {
            struct member *m = &c->m[r];
            CU_OR_FAIL(cudaSetDevice(m->dev), "selecting a rank's device");
            CU_OR_FAIL(cudaMalloc((void **)&m->buf, 2 * (size_t)cap * sizeof(float)), "the peer buffers' allocation");
            CU_OR_FAIL(cudaMalloc((void **)&m->flag, KRK_PEER_MAX_BLOCKS * KRK_PEER_MAX_RANKS * sizeof(uint32_t)),
                       "the peer flags' allocation");
            CU_OR_FAIL(cudaMalloc((void **)&m->calls, KRK_PEER_MAX_BLOCKS * sizeof(uint32_t)),
                       "the peer counters' allocation");
            CU_OR_FAIL(cudaMemset(m->flag, 0, KRK_PEER_MAX_BLOCKS * KRK_PEER_MAX_RANKS * sizeof(uint32_t)),
                       "clearing the peer flags");
            CU_OR_FAIL(cudaMemset(m->calls, 0, KRK_PEER_MAX_BLOCKS * sizeof(uint32_t)), "clearing the peer counters");
            CU_OR_FAIL(cudaHostAlloc((void **)&m->error, sizeof(int32_t), cudaHostAllocMapped | cudaHostAllocPortable),
                       "a rank's error word");
            *m->error = 0;
        }
        for (int r = 0; r < c->size; r++) {
            struct member *m = &c->m[r];
            struct krk_peer *p = &m->peer;
            p->rank = r;
            p->size = c->size;
            p->cap = cap;
            p->calls = m->calls;
            p->timeout_ns = (uint64_t)(c->timeout_s * 1e9);
            CU_OR_FAIL(cudaHostGetDevicePointer((void **)&p->error, m->error, 0), "mapping a rank's error word");
            void *ab = NULL;
            CU_OR_FAIL(cudaHostGetDevicePointer(&ab, c->abort_word, 0), "mapping the abort word");
            p->abort = ab;
            for (int q = 0; q < c->size; q++) {
                p->buf[q] = c->m[q].buf;
                p->flag[q] = c->m[q].flag;
            }
        }
    }
    for (int r = 0; r < c->size; r++) {
        CU_OR_FAIL(cudaSetDevice(c->m[r].dev), "selecting a rank's device");
        CU_OR_FAIL(cudaEventCreateWithFlags(&c->m[r].ev_step, cudaEventDisableTiming), "creating a rank's event");
        for (int k = 0; k < 2 && o->one_device; k++) {
            CU_OR_FAIL(cudaEventCreateWithFlags(&c->m[r].ev_put[k], cudaEventDisableTiming), "creating a rank's event");
            CU_OR_FAIL(cudaEventCreateWithFlags(&c->m[r].ev_read[k], cudaEventDisableTiming), "creating a rank's event");
        }
    }
#ifdef KR_WITH_NCCL
    if (!o->one_device) {
        setenv("NCCL_NVLS_ENABLE", "0", 0); /* NVLink SHARP stays off unless the operator says otherwise */
        ncclComm_t comms[KRK_PEER_MAX_RANKS] = {0};
        int devs[KRK_PEER_MAX_RANKS];
        for (int r = 0; r < c->size; r++) {
            devs[r] = c->m[r].dev;
        }
        ncclResult_t nr = ncclSuccess;
        if (!o->nccl_id) {
            nr = ncclCommInitAll(comms, c->size, devs);
        } else {
            /* this process's ranks of a group over processes: one communicator per local rank, from
             * the id the leader made (kr_cuda_comm_unique_id), created together */
            ncclUniqueId id;
            memcpy(&id, o->nccl_id, sizeof id);
            nr = ncclGroupStart();
            for (int r = 0; r < c->size && nr == ncclSuccess; r++) {
                if (cudaSetDevice(devs[r]) != cudaSuccess) {
                    nr = ncclUnhandledCudaError;
                    break;
                }
                nr = ncclCommInitRank(&comms[r], world, id, first + r);
            }
            const ncclResult_t ne = ncclGroupEnd();
            nr = nr != ncclSuccess ? nr : ne;
        }
        if (nr != ncclSuccess) {
            kr_err_set(err, KR_ERR_CUDA, "tensor parallel: NCCL could not create ranks %d..%d of a group of %d: %s",
                       first, first + c->size - 1, world, ncclGetErrorString(nr));
            for (int r = 0; r < c->size; r++) {
                if (comms[r]) {
                    ncclCommAbort(comms[r]);
                }
            }
            goto fail;
        }
        for (int r = 0; r < c->size; r++) {
            c->m[r].nccl = comms[r];
            CU_OR_FAIL(cudaSetDevice(c->m[r].dev), "selecting a rank's device");
            CU_OR_FAIL(cudaMalloc((void **)&c->m[r].tmp, GATHER_TMP_BYTES), "the all-gather staging's allocation");
        }
        c->nccl_ok = true;
    }
#endif
    (void)cudaSetDevice(cur);
    if (pthread_create(&c->wd, NULL, watchdog_main, c) != 0) {
        st = kr_err_set(err, KR_ERR_NOMEM, "tensor parallel: cannot start the watchdog thread");
        goto fail;
    }
    c->wd_started = true;
    KR_LOG_INFO("tensor parallel: CUDA ranks %d..%d of %d%s; collectives: %s%s%s", first, first + c->size - 1, world,
                o->one_device ? " on one device (tests)" : "", c->peer_max > 0 ? "peer kernels" : "",
                c->peer_max > 0 && c->nccl_ok ? " up to a size, then " : "", c->nccl_ok ? "NCCL" : "");
    *out = c;
    return KR_OK;
fail:
    (void)cudaSetDevice(cur);
    kr_cuda_comm_free(c);
    return st;
}

void kr_cuda_comm_free(struct kr_cuda_comm *c)
{
    if (!c) {
        return;
    }
    if (c->wd_started) {
        pthread_mutex_lock(&c->wd_mu);
        c->wd_stop = true;
        pthread_cond_signal(&c->wd_cv);
        pthread_mutex_unlock(&c->wd_mu);
        pthread_join(c->wd, NULL);
    }
    int cur = 0;
    (void)cudaGetDevice(&cur);
    for (int r = 0; r < c->size; r++) {
        struct member *m = &c->m[r];
        (void)cudaSetDevice(m->dev);
#ifdef KR_WITH_NCCL
        if (m->nccl) {
            ncclCommDestroy(m->nccl);
        }
#endif
        cudaFree(m->buf);
        cudaFree(m->flag);
        cudaFree(m->calls);
        cudaFree(m->tmp);
        if (m->error) {
            cudaFreeHost(m->error);
        }
        if (m->ev_step) {
            cudaEventDestroy(m->ev_step);
        }
        for (int k = 0; k < 2; k++) {
            if (m->ev_put[k]) {
                cudaEventDestroy(m->ev_put[k]);
            }
            if (m->ev_read[k]) {
                cudaEventDestroy(m->ev_read[k]);
            }
        }
        pthread_mutex_destroy(&m->mu);
    }
    if (c->abort_word) {
        cudaFreeHost(c->abort_word);
    }
    (void)cudaGetLastError();
    (void)cudaSetDevice(cur);
    pthread_mutex_destroy(&c->wd_mu);
    pthread_cond_destroy(&c->wd_cv);
    pthread_mutex_destroy(&c->bar_mu);
    pthread_cond_destroy(&c->bar_cv);
    kr_free(c);
}

int kr_cuda_comm_size(const struct kr_cuda_comm *c)
{
    return c->world;
}

int kr_cuda_comm_device(const struct kr_cuda_comm *c, int rank)
{
    rank -= c->first;
    return rank >= 0 && rank < c->size ? c->m[rank].dev : -1;
}

enum kr_status kr_cuda_comm_unique_id(void *out, size_t cap, size_t *len, struct kr_err *err)
{
#ifdef KR_WITH_NCCL
    ncclUniqueId id;
    if (cap < sizeof id) {
        return kr_err_set(err, KR_ERR_INVAL, "tensor parallel: room for %zu bytes of NCCL id, %zu needed", cap,
                          sizeof id);
    }
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
        return kr_err_set(err, KR_ERR_CUDA, "tensor parallel: NCCL could not make the group's id: %s",
                          ncclGetErrorString(r));
    }
    memcpy(out, &id, sizeof id);
    *len = sizeof id;
    return KR_OK;
#else
    (void)out;
    (void)cap;
    *len = 0;
    return kr_err_set(err, KR_ERR_UNSUPPORTED,
                      "tensor parallel: this build has no NCCL (install NCCL and rebuild to serve over several GPUs)");
#endif
}

bool kr_cuda_comm_has_nccl(const struct kr_cuda_comm *c)
{
    return c->nccl_ok;
}

bool kr_cuda_comm_one_device(const struct kr_cuda_comm *c)
{
    return c->one_device;
}

/* Which path a message of `bytes` takes: 1 the peer kernels, 2 NCCL, 3 the one-device exchange
 * ordered by events, 0 none (refused). */
static int path_for(const struct kr_cuda_comm *c, size_t bytes, int force)
{
    if (force == 1) {
        return c->peer_max > 0 ? 1 : 0;
    }
    if (force == 2) {
        return c->nccl_ok ? 2 : 0;
    }
    if (c->one_device) {
        return 3;
    }
    if (c->peer_max > 0 && (bytes <= c->peer_max || !c->nccl_ok)) {
        return 1;
    }
    return c->nccl_ok ? 2 : 0;
}

/* The ranks' threads meet: KR_OK once every rank arrived; KR_ERR_CANCELLED when the group is (or
 * gets) aborted, or after the timeout (which aborts it). */
static enum kr_status barrier(struct kr_cuda_comm *c)
{
    pthread_mutex_lock(&c->bar_mu);
    const uint64_t gen = c->bar_gen;
    if (++c->bar_n == c->size) {
        c->bar_n = 0;
        c->bar_gen++;
        pthread_cond_broadcast(&c->bar_cv);
        pthread_mutex_unlock(&c->bar_mu);
        return atomic_load(&c->aborted) ? KR_ERR_CANCELLED : KR_OK;
    }
    const double t0 = now_s();
    bool late = false;
    while (gen == c->bar_gen && !atomic_load(&c->aborted)) {
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_nsec += 200 * 1000 * 1000;
        if (dl.tv_nsec >= 1000000000L) {
            dl.tv_sec++;
            dl.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->bar_cv, &c->bar_mu, &dl);
        if (gen == c->bar_gen && now_s() - t0 > c->timeout_s) {
            late = true;
            break;
        }
    }
    const bool ok = gen != c->bar_gen && !atomic_load(&c->aborted);
    pthread_mutex_unlock(&c->bar_mu);
    if (late) {
        KR_LOG_ERROR("tensor parallel: a rank waited %.0f s for its peers at a collective", c->timeout_s);
        kr_cuda_comm_abort(c);
    }
    return ok ? KR_OK : KR_ERR_CANCELLED;
}

/* One device: one chunk (at most cap elements) through this rank's slot of the exchange buffer,
 * ordered by events instead of flags: the rank waits until every rank has read the slot's previous
 * contents, writes its part, tells the others (an event, then the barrier that guarantees they see
 * this call's record), waits for their parts and combines. Nothing spins on the device, so the
 * ranks' kernels never wait for each other's residency, and a device-wide synchronization by one
 * rank (an allocation) cannot deadlock with a peer's wait. */
static enum kr_status cuda_failed(int rank, const char *what, cudaError_t e)
{
    KR_LOG_ERROR("tensor parallel: rank %d: %s: %s", rank, what, cudaGetErrorString(e));
    (void)cudaGetLastError();
    return KR_ERR_CUDA;
}

static enum kr_status exchange_one_device(struct kr_cuda_comm *c, int rank, const float *src, int64_t n, float *out,
                                          int64_t cols, int gather, cudaStream_t s)
{
    struct member *m = &c->m[rank];
    const int slot = (int)(m->n_calls++ & 1);
    cudaError_t e;
    for (int q = 0; q < c->size; q++) {
        if ((e = cudaStreamWaitEvent(s, c->m[q].ev_read[slot], 0)) != cudaSuccess) {
            return cuda_failed(rank, "waiting for the slot's readers", e);
        }
    }
    if ((e = cudaMemcpyAsync(m->buf + (int64_t)slot * m->peer.cap, src, (size_t)n * sizeof(float),
                             cudaMemcpyDeviceToDevice, s)) != cudaSuccess) {
        return cuda_failed(rank, "copying its part", e);
    }
    if ((e = cudaEventRecord(m->ev_put[slot], s)) != cudaSuccess) {
        return cuda_failed(rank, "recording its part", e);
    }
    KR_TRY(barrier(c));
    for (int q = 0; q < c->size; q++) {
        if (q != rank && (e = cudaStreamWaitEvent(s, c->m[q].ev_put[slot], 0)) != cudaSuccess) {
            return cuda_failed(rank, "waiting for a peer's part", e);
        }
    }
    KR_TRY(krk_peer_combine(&m->peer, slot, out, n, cols, gather, s));
    if ((e = cudaEventRecord(m->ev_read[slot], s)) != cudaSuccess) {
        return cuda_failed(rank, "recording its reading", e);
    }
    return KR_OK;
}

enum kr_status kr_cuda_comm_all_reduce(struct kr_cuda_comm *c, int rank, float *x, int64_t n, void *stream,
                                       int force)
{
    rank -= c->first; /* this process's index of the rank */
    if (rank < 0 || rank >= c->size || n < 0) {
        return KR_ERR_INVAL;
    }
    if (atomic_load(&c->aborted)) {
        return KR_ERR_CANCELLED;
    }
    if (n == 0) {
        return KR_OK;
    }
    struct member *m = &c->m[rank];
    if (c->world == 1 && force != 2) {
        return KR_OK;
    }
    switch (path_for(c, (size_t)n * sizeof(float), force)) {
    case 1:
        return krk_peer_all_reduce(&m->peer, x, n, (cudaStream_t)stream);
    case 3:
        for (int64_t off = 0; off < n; off += m->peer.cap) {
            const int64_t k = n - off < m->peer.cap ? n - off : m->peer.cap;
            KR_TRY(exchange_one_device(c, rank, x + off, k, x + off, 1, 0, (cudaStream_t)stream));
        }
        return KR_OK;
#ifdef KR_WITH_NCCL
    case 2: {
        pthread_mutex_lock(&m->mu);
        const ncclResult_t r = m->nccl ? ncclAllReduce(x, x, (size_t)n, ncclFloat, ncclSum, m->nccl, stream)
                                       : ncclInvalidUsage;
        pthread_mutex_unlock(&m->mu);
        if (r != ncclSuccess) {
            KR_LOG_ERROR("tensor parallel: rank %d: ncclAllReduce of %lld floats: %s", rank, (long long)n,
                         ncclGetErrorString(r));
            return atomic_load(&c->aborted) ? KR_ERR_CANCELLED : KR_ERR_CUDA;
        }
        return KR_OK;
    }
#endif
    default:
        return KR_ERR_UNSUPPORTED;
    }
}

enum kr_status kr_cuda_comm_all_gather(struct kr_cuda_comm *c, int rank, const float *src, int64_t rows,
                                       int64_t cols, float *dst, void *stream, int force)
{
    rank -= c->first;
    if (rank < 0 || rank >= c->size || rows < 0 || cols < 1) {
        return KR_ERR_INVAL;
    }
    if (atomic_load(&c->aborted)) {
        return KR_ERR_CANCELLED;
    }
    if (rows == 0) {
        return KR_OK;
    }
    struct member *m = &c->m[rank];
    if (c->world == 1 && force != 2) {
        return cudaMemcpyAsync(dst, src, (size_t)(rows * cols) * sizeof(float), cudaMemcpyDeviceToDevice,
                               (cudaStream_t)stream) == cudaSuccess
                   ? KR_OK
                   : KR_ERR_CUDA;
    }
    int path = path_for(c, (size_t)(rows * cols) * sizeof(float), force);
    if (path == 1 && cols > m->peer.cap) {
        path = c->nccl_ok && force != 1 ? 2 : 0;
    }
    switch (path) {
    case 1:
        return krk_peer_all_gather(&m->peer, src, rows, cols, dst, (cudaStream_t)stream);
    case 3: {
        if (cols > m->peer.cap) {
            return KR_ERR_UNSUPPORTED;
        }
        const int64_t per = m->peer.cap / cols;
        for (int64_t r0 = 0; r0 < rows; r0 += per) {
            const int64_t k = rows - r0 < per ? rows - r0 : per;
            KR_TRY(exchange_one_device(c, rank, src + r0 * cols, k * cols, dst + r0 * c->size * cols, cols, 1,
                                       (cudaStream_t)stream));
        }
        return KR_OK;
    }
#ifdef KR_WITH_NCCL
    case 2: {
        /* NCCL lays the blocks one after another: gather chunks of rows into the staging, then put
         * each rank's block at its columns */
        const int64_t per = (int64_t)(GATHER_TMP_BYTES / sizeof(float)) / ((int64_t)c->world * cols);
        if (per < 1) {
            return KR_ERR_UNSUPPORTED;
        }
        const size_t width = (size_t)c->world * (size_t)cols * sizeof(float);
        for (int64_t r0 = 0; r0 < rows; r0 += per) {
            const int64_t k = rows - r0 < per ? rows - r0 : per;
            pthread_mutex_lock(&m->mu);
            const ncclResult_t r = m->nccl ? ncclAllGather(src + r0 * cols, m->tmp, (size_t)(k * cols), ncclFloat,
                                                           m->nccl, stream)
                                           : ncclInvalidUsage;
            pthread_mutex_unlock(&m->mu);
            if (r != ncclSuccess) {
                KR_LOG_ERROR("tensor parallel: rank %d: ncclAllGather: %s", rank, ncclGetErrorString(r));
                return atomic_load(&c->aborted) ? KR_ERR_CANCELLED : KR_ERR_CUDA;
            }
            for (int q = 0; q < c->world; q++) {
                if (cudaMemcpy2DAsync((char *)(dst + r0 * c->world * cols + (int64_t)q * cols), width,
                                      m->tmp + (int64_t)q * k * cols, (size_t)cols * sizeof(float),
                                      (size_t)cols * sizeof(float), (size_t)k, cudaMemcpyDeviceToDevice,
                                      (cudaStream_t)stream) != cudaSuccess) {
                    return KR_ERR_CUDA;
                }
            }
        }
        return KR_OK;
    }
#endif
    default:
        return KR_ERR_UNSUPPORTED;
    }
}

void kr_cuda_comm_step_issued(struct kr_cuda_comm *c, int rank, void *stream)
{
    if (c) {
        rank -= c->first;
    }
    if (!c || rank < 0 || rank >= c->size) {
        return;
    }
    struct member *m = &c->m[rank];
    pthread_mutex_lock(&c->wd_mu);
    if (cudaEventRecord(m->ev_step, (cudaStream_t)stream) == cudaSuccess) {
        m->t_step = now_s();
    } else {
        (void)cudaGetLastError();
    }
    pthread_mutex_unlock(&c->wd_mu);
}

bool kr_cuda_comm_ok(struct kr_cuda_comm *c, int rank)
{
    rank -= c->first;
    if (atomic_load(&c->aborted) || rank < 0 || rank >= c->size) {
        return false;
    }
    const struct member *m = &c->m[rank];
    return !(m->error && *(volatile int32_t *)m->error);
}
