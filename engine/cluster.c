/* The nodes of a multi-node group over TCP (cluster.h): one connection between the leader and each
 * worker, frames as engine/wire.h writes them. Every blocking call polls its socket together with
 * an eventfd that becomes readable when the group is aborted, and has a deadline, so nothing waits
 * on a node that is gone. Each connection has a write lock (one frame at a time); reads on it are
 * made by one thread at a time by construction: the collectives' thread during a step, the engine
 * thread (leader) or the worker's loop between steps. */
#define _GNU_SOURCE /* accept4, POLLRDHUP */
#include "cluster.h"

#include "alloc.h"
#include "clock.h"
#include "file.h"
#include "log.h"
#include "ranks.h"
#include "switches.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#define STEP_TIMEOUT_S  300.0 /* a step waiting this long for another node aborts the group */
#define HELLO_TIMEOUT_S 10.0  /* a connection to the leader must say who it is within this */
#define LOG_EVERY_S     10.0  /* the bootstrap says what it waits for this often */

struct peer {
    int fd;              /* -1: none */
    pthread_mutex_t wmu; /* one frame at a time */
};

struct kr_cluster {
    int nnodes, node, tp, per;
    char addr[256];
    int port;
    double join_timeout_s, step_timeout_s;
    int lfd;                 /* leader: the listening socket until every worker joined; else -1 */
    struct peer *peers;      /* leader: [nnodes] by node ([0] unused); worker: [1], the leader */
    int wake;                /* eventfd, readable from the group's abort on */
    atomic_bool aborted;
    atomic_bool joined;
    pthread_mutex_t why_mu;
    char why[512];           /* the first reason the group was aborted */
    struct kr_comm_link link;
    float *scratch;          /* the link's receive buffer (the collectives' thread only) */
    size_t scratch_cap;
    struct kr_wire_buf plan; /* the leader's step frame, reused */
    void (*on_abort)(void *user); /* kr_cluster_on_abort */
    void *on_abort_user;
};

/* ---- sockets ------------------------------------------------------------------------------------ */

/* Waits until fd is ready for `ev`: KR_OK; KR_ERR_CANCELLED once the group is aborted; KR_ERR_BUSY
 * at the deadline (0: none); KR_ERR_IO when poll fails. */
static enum kr_status wait_fd(struct kr_cluster *c, int fd, short ev, double deadline)
{
    for (;;) {
        if (atomic_load(&c->aborted)) {
            return KR_ERR_CANCELLED;
        }
        int ms = -1;
        if (deadline > 0) {
            const double left = deadline - kr_clock_s();
            if (left <= 0) {
                return KR_ERR_BUSY;
            }
            ms = left > 3600 ? 3600 * 1000 : (int)(left * 1000) + 1;
        }
        struct pollfd p[2] = {{.fd = fd, .events = ev}, {.fd = c->wake, .events = POLLIN}};
        const int r = poll(p, 2, ms);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            return KR_ERR_IO;
        }
        if (p[1].revents) {
            return KR_ERR_CANCELLED;
        }
        if (p[0].revents) {
            return KR_OK;
        }
    }
}

/* Sends n bytes; as wait_fd, KR_ERR_IO when the connection failed. */
static enum kr_status send_all(struct kr_cluster *c, int fd, const void *buf, size_t n, double deadline)
{
    const char *p = buf;
    while (n > 0) {
        const ssize_t k = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
        } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            KR_TRY(wait_fd(c, fd, POLLOUT, deadline));
        } else if (!(k < 0 && errno == EINTR)) {
            return KR_ERR_IO;
        }
    }
    return KR_OK;
}

/* Receives n bytes; as send_all (the peer closing its side is KR_ERR_IO too). */
static enum kr_status recv_all(struct kr_cluster *c, int fd, void *buf, size_t n, double deadline)
{
    char *p = buf;
    while (n > 0) {
        const ssize_t k = recv(fd, p, n, MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
        } else if (k == 0) {
            return KR_ERR_IO;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            KR_TRY(wait_fd(c, fd, POLLIN, deadline));
        } else if (errno != EINTR) {
            return KR_ERR_IO;
        }
    }
    return KR_OK;
}

static void sock_setup(int fd)
{
    const int one = 1, idle = 10, intvl = 5, cnt = 3; /* a silent peer is found dead within ~25 s */
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

/* "the leader" or "node N (ranks a..b)", for messages. */
static const char *node_name(const struct kr_cluster *c, int node, char *buf, size_t cap)
{
    if (node == 0) {
        snprintf(buf, cap, "the leader");
    } else if (c->per == 1) {
        snprintf(buf, cap, "node %d (rank %d)", node, node);
    } else {
        snprintf(buf, cap, "node %d (ranks %d..%d)", node, node * c->per, node * c->per + c->per - 1);
    }
    return buf;
}

/* The connection to `node`: the worker's one connection is to the leader. */
static struct peer *peer_of(struct kr_cluster *c, int node)
{
    return c->node == 0 ? &c->peers[node] : &c->peers[0];
}

/* ---- abort ------------------------------------------------------------------------------------ */

void kr_cluster_abort(struct kr_cluster *c, const char *why)
{
    pthread_mutex_lock(&c->why_mu);
    if (!c->why[0]) {
        snprintf(c->why, sizeof c->why, "%.500s", why); /* bounded: why may be a long message */
    }
    pthread_mutex_unlock(&c->why_mu);
    if (atomic_exchange(&c->aborted, true)) {
        return;
    }
    const uint64_t one = 1;
    (void)!write(c->wake, &one, sizeof one);
    /* tell the peers why, where no frame is being written now; then end the sending side, so that
     * a peer whose frame stopped half-way sees the end of the stream */
    struct kr_wire_buf b = {0};
    kr_wire_put_str(&b, c->why);
    uint8_t h[KR_WIRE_HEADER];
    kr_wire_header_put(h, KR_WIRE_ABORT, b.len);
    const int n = c->node == 0 ? c->nnodes : 1;
    for (int i = 0; i < n; i++) {
        struct peer *p = &c->peers[i];
        if (p->fd < 0) {
            continue;
        }
        if (!b.nomem && pthread_mutex_trylock(&p->wmu) == 0) {
            if (send(p->fd, h, sizeof h, MSG_NOSIGNAL | MSG_DONTWAIT) == (ssize_t)sizeof h) {
                (void)!send(p->fd, b.p, b.len, MSG_NOSIGNAL | MSG_DONTWAIT);
            }
            pthread_mutex_unlock(&p->wmu);
        }
        shutdown(p->fd, SHUT_WR);
    }
    kr_wire_buf_free(&b);
    KR_LOG_ERROR("cluster: node %d leaves the group: %s", c->node, c->why);
    if (c->on_abort) {
        c->on_abort(c->on_abort_user);
    }
}

void kr_cluster_on_abort(struct kr_cluster *c, void (*fn)(void *user), void *user)
{
    c->on_abort = fn;
    c->on_abort_user = user;
}

const char *kr_cluster_why(struct kr_cluster *c)
{
    return atomic_load(&c->aborted) ? c->why : "";
}

/* A failed exchange with `node` (st from the calls above): aborts the group with a reason that
 * says what happened, unless it was aborted already. Returns KR_ERR_CANCELLED with the group's
 * reason in err. */
static enum kr_status lost(struct kr_cluster *c, int node, enum kr_status st, const char *doing, struct kr_err *err)
{
    char who[64], why[256];
    node_name(c, node, who, sizeof who);
    if (st == KR_ERR_BUSY) {
        snprintf(why, sizeof why, "%s did not answer within %.0f s (%s)", who, c->step_timeout_s, doing);
    } else if (st == KR_ERR_IO) {
        snprintf(why, sizeof why, "the connection to %s closed (%s)", who, doing);
    } else if (st == KR_ERR_FORMAT || st == KR_ERR_NOMEM) {
        snprintf(why, sizeof why, "%s: %.150s (%s)", who, err && err->msg[0] ? err->msg : kr_status_str(st), doing);
    } else {
        why[0] = 0;
    }
    if (why[0]) {
        kr_cluster_abort(c, why);
    }
    return kr_err_set(err, KR_ERR_CANCELLED, "%s", c->why[0] ? c->why : "the group was aborted");
}

/* ---- frames ------------------------------------------------------------------------------------ */

/* One frame to `node`: the payload in two parts (either may be empty). */
static enum kr_status send_frame(struct kr_cluster *c, int node, enum kr_wire_type type, const void *a, size_t na,
                                 const void *b, size_t nb, double deadline)
{
    struct peer *p = peer_of(c, node);
    uint8_t h[KR_WIRE_HEADER];
    kr_wire_header_put(h, type, (uint64_t)(na + nb));
    pthread_mutex_lock(&p->wmu);
    enum kr_status st = send_all(c, p->fd, h, sizeof h, deadline);
    if (st == KR_OK && na) {
        st = send_all(c, p->fd, a, na, deadline);
    }
    if (st == KR_OK && nb) {
        st = send_all(c, p->fd, b, nb, deadline);
    }
    pthread_mutex_unlock(&p->wmu);
    return st;
}

/* Reads a frame header from `node` expecting `want`: its payload length in *len. An ABORT frame is
 * read whole and aborts this node too; any other type is a broken peer. */
static enum kr_status recv_expect(struct kr_cluster *c, int node, enum kr_wire_type want, uint64_t *len,
                                  double deadline, struct kr_err *err)
{
    struct peer *p = peer_of(c, node);
    uint8_t h[KR_WIRE_HEADER];
    char what[64];
    snprintf(what, sizeof what, "waiting for %s", kr_wire_type_name(want));
    enum kr_status st = recv_all(c, p->fd, h, sizeof h, deadline);
    if (st != KR_OK) {
        return lost(c, node, st, what, err);
    }
    uint32_t type;
    struct kr_err ferr = {0};
    if ((st = kr_wire_header_get(h, &type, len, &ferr)) != KR_OK) {
        return lost(c, node, KR_ERR_FORMAT, what, &ferr);
    }
    if (type == KR_WIRE_ABORT) {
        char who[64], reason[KR_WIRE_MAX_STR + 1], why[512];
        uint8_t buf[KR_WIRE_MAX_STR + 4];
        reason[0] = 0;
        if (*len <= sizeof buf && recv_all(c, p->fd, buf, (size_t)*len, deadline) == KR_OK) {
            struct kr_wire_rd r = {.p = buf, .len = (size_t)*len};
            kr_wire_get_str(&r, reason, sizeof reason);
        }
        snprintf(why, sizeof why, "%s left the group: %s", node_name(c, node, who, sizeof who),
                 reason[0] ? reason : "no reason given");
        kr_cluster_abort(c, why);
        return kr_err_set(err, KR_ERR_CANCELLED, "%s", c->why);
    }
    if (type != (uint32_t)want) {
        kr_err_set(&ferr, KR_ERR_FORMAT, "a %s frame where %s was expected", kr_wire_type_name(type),
                   kr_wire_type_name(want));
        return lost(c, node, KR_ERR_FORMAT, what, &ferr);
    }
    return KR_OK;
}

/* Reads a control payload of len bytes into a new buffer (*out, caller frees). */
static enum kr_status recv_payload(struct kr_cluster *c, int node, uint64_t len, uint8_t **out, double deadline,
                                   struct kr_err *err)
{
    *out = kr_malloc(len ? (size_t)len : 1);
    if (!*out) {
        kr_err_set(err, KR_ERR_NOMEM, "out of memory for a frame of %llu bytes", (unsigned long long)len);
        return lost(c, node, KR_ERR_NOMEM, "reading a frame", err);
    }
    const enum kr_status st = recv_all(c, peer_of(c, node)->fd, *out, (size_t)len, deadline);
    if (st != KR_OK) {
        kr_free(*out);
        *out = NULL;
        return lost(c, node, st, "reading a frame", err);
    }
    return KR_OK;
}

/* A status and a message (READY, DONE). */
static enum kr_status recv_status(struct kr_cluster *c, int node, enum kr_wire_type want, double deadline,
                                  struct kr_err *err)
{
    uint64_t len;
    uint8_t *buf;
    KR_TRY(recv_expect(c, node, want, &len, deadline, err));
    KR_TRY(recv_payload(c, node, len, &buf, deadline, err));
    struct kr_wire_rd r = {.p = buf, .len = (size_t)len};
    const enum kr_status st = (enum kr_status)kr_wire_get_i32(&r);
    char msg[KR_WIRE_MAX_STR + 1];
    kr_wire_get_str(&r, msg, sizeof msg);
    const bool ok = kr_wire_rd_done(&r);
    kr_free(buf);
    char who[64];
    node_name(c, node, who, sizeof who);
    if (!ok) {
        struct kr_err ferr;
        kr_err_set(&ferr, KR_ERR_FORMAT, "a malformed %s frame", kr_wire_type_name(want));
        return lost(c, node, KR_ERR_FORMAT, "reading its status", &ferr);
    }
    if (st != KR_OK) {
        return kr_err_set(err, st, "%s: %s", who, msg[0] ? msg : kr_status_str(st));
    }
    return KR_OK;
}

static enum kr_status send_status(struct kr_cluster *c, enum kr_wire_type type, enum kr_status st, const char *msg,
                                  double deadline)
{
    struct kr_wire_buf b = {0};
    kr_wire_put_i32(&b, (int32_t)st);
    kr_wire_put_str(&b, msg ? msg : "");
    const enum kr_status sst = b.nomem ? KR_ERR_NOMEM : send_frame(c, 0, type, b.p, b.len, NULL, 0, deadline);
    kr_wire_buf_free(&b);
    return sst;
}

/* ---- the collectives' link ----------------------------------------------------------------------- */

static bool scratch_fit(struct kr_cluster *c, size_t bytes)
{
    if (bytes <= c->scratch_cap) {
        return true;
    }
    float *p = kr_realloc(c->scratch, bytes);
    if (!p) {
        return false;
    }
    c->scratch = p;
    c->scratch_cap = bytes;
    return true;
}

/* Reads a REDUCE or GATHER payload of exactly `bytes` from `node` into dst. */
static enum kr_status recv_data(struct kr_cluster *c, int node, enum kr_wire_type type, void *dst, size_t bytes,
                                double deadline)
{
    uint64_t len;
    struct kr_err err = {0};
    KR_TRY(recv_expect(c, node, type, &len, deadline, &err));
    if (len != bytes) {
        kr_err_set(&err, KR_ERR_FORMAT, "a %s of %llu bytes where the group's is %zu (the nodes disagree on the "
                   "step)", kr_wire_type_name(type), (unsigned long long)len, bytes);
        return lost(c, node, KR_ERR_FORMAT, "a collective", &err);
    }
    const enum kr_status st = recv_all(c, peer_of(c, node)->fd, dst, bytes, deadline);
    return st == KR_OK ? KR_OK : lost(c, node, st, "a collective", NULL);
}

static enum kr_status send_data(struct kr_cluster *c, int node, enum kr_wire_type type, const void *src, size_t bytes,
                                double deadline)
{
    const enum kr_status st = send_frame(c, node, type, src, bytes, NULL, 0, deadline);
    return st == KR_OK ? KR_OK : lost(c, node, st, "a collective", NULL);
}

/* x holds this node's sum: the leader adds the workers' in node order and sends the group's back. */
static enum kr_status link_all_reduce(void *user, float *x, int64_t n)
{
    struct kr_cluster *c = user;
    const size_t bytes = (size_t)n * sizeof(float);
    const double dl = kr_clock_s() + c->step_timeout_s;
    if (c->node != 0) {
        KR_TRY(send_data(c, 0, KR_WIRE_REDUCE, x, bytes, dl));
        return recv_data(c, 0, KR_WIRE_REDUCE, x, bytes, dl);
    }
    if (!scratch_fit(c, bytes)) {
        kr_cluster_abort(c, "the leader is out of memory for an all-reduce");
        return KR_ERR_CANCELLED;
    }
    for (int w = 1; w < c->nnodes; w++) {
        KR_TRY(recv_data(c, w, KR_WIRE_REDUCE, c->scratch, bytes, dl));
        for (int64_t i = 0; i < n; i++) {
            x[i] += c->scratch[i];
        }
    }
    for (int w = 1; w < c->nnodes; w++) {
        KR_TRY(send_data(c, w, KR_WIRE_REDUCE, x, bytes, dl));
    }
    return KR_OK;
}

/* dst [rows, width] holds this node's columns [col0, col0 + ncols): the workers send theirs, the
 * leader puts every node's in place and sends the rows back whole. */
static enum kr_status link_all_gather(void *user, float *dst, int64_t rows, int64_t width, int64_t col0, int64_t ncols)
{
    struct kr_cluster *c = user;
    const size_t part = (size_t)(rows * ncols) * sizeof(float), whole = (size_t)(rows * width) * sizeof(float);
    const double dl = kr_clock_s() + c->step_timeout_s;
    if (!scratch_fit(c, part)) {
        kr_cluster_abort(c, "out of memory for an all-gather");
        return KR_ERR_CANCELLED;
    }
    if (c->node != 0) {
        for (int64_t i = 0; i < rows; i++) {
            memcpy(c->scratch + i * ncols, dst + i * width + col0, (size_t)ncols * sizeof(float));
        }
        KR_TRY(send_data(c, 0, KR_WIRE_GATHER, c->scratch, part, dl));
        return recv_data(c, 0, KR_WIRE_GATHER, dst, whole, dl);
    }
    for (int w = 1; w < c->nnodes; w++) {
        KR_TRY(recv_data(c, w, KR_WIRE_GATHER, c->scratch, part, dl));
        for (int64_t i = 0; i < rows; i++) {
            memcpy(dst + i * width + w * ncols, c->scratch + i * ncols, (size_t)ncols * sizeof(float));
        }
    }
    for (int w = 1; w < c->nnodes; w++) {
        KR_TRY(send_data(c, w, KR_WIRE_GATHER, dst, whole, dl));
    }
    return KR_OK;
}

static void link_abort(void *user)
{
    struct kr_cluster *c = user;
    char why[128];
    snprintf(why, sizeof why, "a rank of node %d failed its step", c->node);
    kr_cluster_abort(c, why);
}

/* ---- create, free ------------------------------------------------------------------------------- */

enum kr_status kr_cluster_create(const struct kr_cluster_opts *o, struct kr_cluster **out, struct kr_err *err)
{
    *out = NULL;
    if (o->nnodes < 2 || o->node_rank < 0 || o->node_rank >= o->nnodes) {
        return kr_err_set(err, KR_ERR_INVAL, "--node-rank %d is not a node of --nnodes %d", o->node_rank, o->nnodes);
    }
    if (o->tp < o->nnodes || o->tp % o->nnodes != 0) {
        return kr_err_set(err, KR_ERR_INVAL,
                          "--tensor-parallel-size %d is not a multiple of --nnodes %d (every node holds the same "
                          "number of ranks)", o->tp, o->nnodes);
    }
    if (o->master_port < 1 || o->master_port > 65535 || !o->master_addr || !o->master_addr[0] ||
        strlen(o->master_addr) >= 256) {
        return kr_err_set(err, KR_ERR_INVAL, "--master-addr and --master-port must name the leader (got '%s':%d)",
                          o->master_addr ? o->master_addr : "", o->master_port);
    }
    struct kr_cluster *c = kr_calloc(1, sizeof *c);
    const int n_peers = o->node_rank == 0 ? o->nnodes : 1;
    if (!c || !(c->peers = kr_calloc((size_t)n_peers, sizeof *c->peers))) {
        kr_free(c);
        return kr_err_set(err, KR_ERR_NOMEM, "out of memory");
    }
    c->nnodes = o->nnodes;
    c->node = o->node_rank;
    c->tp = o->tp;
    c->per = o->tp / o->nnodes;
    snprintf(c->addr, sizeof c->addr, "%s", o->master_addr);
    c->port = o->master_port;
    c->join_timeout_s = o->join_timeout_s > 0 ? o->join_timeout_s : KR_CLUSTER_DEFAULT_TIMEOUT;
    c->step_timeout_s = o->step_timeout_s > 0 ? o->step_timeout_s : STEP_TIMEOUT_S;
    c->lfd = -1;
    for (int i = 0; i < n_peers; i++) {
        c->peers[i].fd = -1;
        pthread_mutex_init(&c->peers[i].wmu, NULL);
    }
    pthread_mutex_init(&c->why_mu, NULL);
    atomic_init(&c->aborted, false);
    atomic_init(&c->joined, false);
    c->link = (struct kr_comm_link){.all_reduce = link_all_reduce, .all_gather = link_all_gather,
                                    .abort = link_abort, .user = c};
    c->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (c->wake < 0) {
        kr_cluster_free(c);
        return kr_err_set(err, KR_ERR_IO, "cluster: eventfd: %s", strerror(errno));
    }
    if (c->node == 0) {
        /* every address, IPv6 with IPv4 mapped where the system allows it, else IPv4 */
        struct sockaddr_in6 a6 = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)c->port),
                                  .sin6_addr = in6addr_any};
        struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons((uint16_t)c->port),
                                 .sin_addr.s_addr = htonl(INADDR_ANY)};
        const int one = 1, zero = 0;
        int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd >= 0) {
            (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
            (void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
            if (bind(fd, (struct sockaddr *)&a6, sizeof a6) != 0) {
                close(fd);
                fd = -1;
            }
        }
        if (fd < 0 && (fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0)) >= 0) {
            (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
            if (bind(fd, (struct sockaddr *)&a4, sizeof a4) != 0) {
                close(fd);
                fd = -1;
            }
        }
        if (fd < 0 || listen(fd, 64) != 0) {
            const int e = errno;
            if (fd >= 0) {
                close(fd);
            }
            kr_cluster_free(c);
            return kr_err_set(err, KR_ERR_IO, "cluster: cannot listen on --master-port %d: %s", o->master_port,
                              strerror(e));
        }
        c->lfd = fd;
    }
    *out = c;
    return KR_OK;
}

void kr_cluster_free(struct kr_cluster *c)
{
    if (!c) {
        return;
    }
    const int n = c->node == 0 ? c->nnodes : 1;
    for (int i = 0; c->peers && i < n; i++) {
        if (c->peers[i].fd >= 0) {
            close(c->peers[i].fd);
        }
        pthread_mutex_destroy(&c->peers[i].wmu);
    }
    if (c->lfd >= 0) {
        close(c->lfd);
    }
    if (c->wake >= 0) {
        close(c->wake);
    }
    pthread_mutex_destroy(&c->why_mu);
    kr_wire_buf_free(&c->plan);
    kr_free(c->scratch);
    kr_free(c->peers);
    kr_free(c);
}

int kr_cluster_node(const struct kr_cluster *c)
{
    return c->node;
}

int kr_cluster_nnodes(const struct kr_cluster *c)
{
    return c->nnodes;
}

int kr_cluster_per_node(const struct kr_cluster *c)
{
    return c->per;
}

int kr_cluster_first_rank(const struct kr_cluster *c)
{
    return c->node * c->per;
}

const struct kr_comm_link *kr_cluster_link(struct kr_cluster *c)
{
    return &c->link;
}

bool kr_cluster_healthy(struct kr_cluster *c)
{
    if (!atomic_load(&c->joined) || atomic_load(&c->aborted)) {
        return false;
    }
    const int n = c->node == 0 ? c->nnodes : 1;
    for (int i = 0; i < n; i++) {
        if (c->peers[i].fd < 0) {
            continue;
        }
        struct pollfd p = {.fd = c->peers[i].fd, .events = POLLRDHUP};
        if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
            return false; /* the peer closed its side (reading nothing: the frames stay queued) */
        }
    }
    return true;
}

/* ---- bootstrap ---------------------------------------------------------------------------------- */

static const struct kr_wire_field *field_find(const struct kr_wire_field *f, int32_t n, const char *name)
{
    for (int32_t i = 0; i < n; i++) {
        if (!strcmp(f[i].name, name)) {
            return &f[i];
        }
    }
    return NULL;
}

static void field_str(const struct kr_wire_field *f, char *buf, size_t cap)
{
    if (!f) {
        snprintf(buf, cap, "(none)");
    } else if (strstr(f->name, "fingerprint")) {
        snprintf(buf, cap, "%016llx", (unsigned long long)f->value);
    } else {
        snprintf(buf, cap, "%lld", (long long)f->value);
    }
}

/* Whether a worker's configuration w[nw] fits the leader's f[nf]: "" or why not in why. */
static void compare(const struct kr_wire_field *f, int32_t nf, const struct kr_wire_field *w, int32_t nw, int node,
                    char *why, size_t cap)
{
    why[0] = 0;
    for (int32_t pass = 0; pass < 2; pass++) {
        const struct kr_wire_field *a = pass == 0 ? f : w;
        for (int32_t i = 0; i < (pass == 0 ? nf : nw); i++) {
            if (!strcmp(a[i].name, "node-rank")) {
                continue;
            }
            const struct kr_wire_field *lf = field_find(f, nf, a[i].name), *wf = field_find(w, nw, a[i].name);
            if (lf && wf && lf->value == wf->value) {
                continue;
            }
            char lv[32], wv[32];
            field_str(lf, lv, sizeof lv);
            field_str(wf, wv, sizeof wv);
            snprintf(why, cap, "%s differs: %s on node %d, %s on the leader", a[i].name, wv, node, lv);
            return;
        }
    }
}

/* Reads a worker's HELLO on a new connection and decides: its node, or -1 with why. */
static int admit(struct kr_cluster *c, int fd, const struct kr_wire_field *f, int32_t nf, char *why, size_t cap)
{
    uint8_t h[KR_WIRE_HEADER];
    const double dl = kr_clock_s() + HELLO_TIMEOUT_S;
    uint32_t type;
    uint64_t len;
    struct kr_err err = {0};
    if (recv_all(c, fd, h, sizeof h, dl) != KR_OK) {
        snprintf(why, cap, "it sent no HELLO within %.0f s", HELLO_TIMEOUT_S);
        return -1;
    }
    if (kr_wire_header_get(h, &type, &len, &err) != KR_OK || type != KR_WIRE_HELLO) {
        snprintf(why, cap, "it did not say HELLO: %.200s", err.msg[0] ? err.msg : kr_wire_type_name(type));
        return -1;
    }
    if (len > 64 * 1024) {
        snprintf(why, cap, "a HELLO of %llu bytes (at most 65536)", (unsigned long long)len);
        return -1;
    }
    uint8_t *buf = kr_malloc(len ? (size_t)len : 1);
    struct kr_wire_field *w = kr_calloc(KR_WIRE_MAX_FIELDS, sizeof *w);
    int32_t nw = 0;
    int node = -1;
    if (!buf || !w) {
        snprintf(why, cap, "out of memory");
    } else if (recv_all(c, fd, buf, (size_t)len, dl) != KR_OK) {
        snprintf(why, cap, "its HELLO was cut short");
    } else {
        struct kr_wire_rd r = {.p = buf, .len = (size_t)len};
        if (kr_wire_get_hello(&r, w, KR_WIRE_MAX_FIELDS, &nw, &err) != KR_OK) {
            snprintf(why, cap, "%.400s", err.msg);
        } else {
            const struct kr_wire_field *nr = field_find(w, nw, "node-rank");
            compare(f, nf, w, nw, nr ? (int)nr->value : -1, why, cap);
            if (why[0]) {
                /* said first: the fields decide whether its node rank means anything */
            } else if (!nr || nr->value < 1 || nr->value >= c->nnodes) {
                snprintf(why, cap, "node-rank %lld is not a worker of --nnodes %d (1..%d)", nr ? (long long)nr->value : -1LL,
                         c->nnodes, c->nnodes - 1);
            } else if (c->peers[nr->value].fd >= 0) {
                snprintf(why, cap, "node-rank %lld has joined already (two workers were given the same --node-rank)",
                         (long long)nr->value);
            } else {
                node = (int)nr->value;
            }
        }
    }
    kr_free(buf);
    kr_free(w);
    return node;
}

static enum kr_status leader_join(struct kr_cluster *c, const struct kr_wire_field *f, int32_t n, struct kr_err *err)
{
    const double t0 = kr_clock_s(), deadline = t0 + c->join_timeout_s;
    int joined = 0;
    KR_LOG_INFO("cluster: leader of %d nodes (%d ranks each), waiting up to %.0f s for %d worker%s on port %d",
                c->nnodes, c->per, c->join_timeout_s, c->nnodes - 1, c->nnodes > 2 ? "s" : "", c->port);
    double next_log = t0 + LOG_EVERY_S;
    while (joined < c->nnodes - 1) {
        const double until = next_log < deadline ? next_log : deadline;
        enum kr_status st = wait_fd(c, c->lfd, POLLIN, until);
        if (st == KR_ERR_BUSY) {
            char missing[256] = "";
            size_t k = 0;
            for (int w = 1; w < c->nnodes && k < sizeof missing - 16; w++) {
                if (c->peers[w].fd < 0) {
                    k += (size_t)snprintf(missing + k, sizeof missing - k, "%s%d", k ? ", " : "", w);
                }
            }
            if (kr_clock_s() >= deadline) {
                return kr_err_set(err, KR_ERR_IO, "cluster: node%s %s did not join within %.0f s (--master-port %d)",
                                  c->nnodes - 1 - joined > 1 ? "s" : "", missing, c->join_timeout_s, c->port);
            }
            KR_LOG_INFO("cluster: waiting for node%s %s to join on port %d (%.0f s left)",
                        c->nnodes - 1 - joined > 1 ? "s" : "", missing, c->port, deadline - kr_clock_s());
            next_log += LOG_EVERY_S;
            continue;
        }
        if (st != KR_OK) {
            return kr_err_set(err, KR_ERR_CANCELLED, "cluster: the bootstrap was cancelled");
        }
        struct sockaddr_storage sa;
        socklen_t sl = sizeof sa;
        const int fd = accept4(c->lfd, (struct sockaddr *)&sa, &sl, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            continue;
        }
        sock_setup(fd);
        char host[INET6_ADDRSTRLEN + 8] = "?";
        if (sa.ss_family == AF_INET6) {
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&sa)->sin6_addr, host, sizeof host);
        } else if (sa.ss_family == AF_INET) {
            inet_ntop(AF_INET, &((struct sockaddr_in *)&sa)->sin_addr, host, sizeof host);
        }
        char why[512];
        const int node = admit(c, fd, f, n, why, sizeof why);
        if (node < 0) {
            KR_LOG_ERROR("cluster: refused a worker from %s: %s", host, why);
            struct kr_wire_buf b = {0};
            kr_wire_put_str(&b, why);
            uint8_t h[KR_WIRE_HEADER];
            kr_wire_header_put(h, KR_WIRE_REFUSE, b.len);
            if (!b.nomem && send_all(c, fd, h, sizeof h, kr_clock_s() + 2) == KR_OK) {
                (void)send_all(c, fd, b.p, b.len, kr_clock_s() + 2);
            }
            kr_wire_buf_free(&b);
            close(fd);
            continue;
        }
        c->peers[node].fd = fd;
        if (send_frame(c, node, KR_WIRE_WELCOME, NULL, 0, NULL, 0, kr_clock_s() + HELLO_TIMEOUT_S) != KR_OK) {
            KR_LOG_WARN("cluster: node %d went away while joining", node);
            close(fd);
            c->peers[node].fd = -1;
            continue;
        }
        joined++;
        char who[64];
        KR_LOG_INFO("cluster: %s joined from %s (%d of %d)", node_name(c, node, who, sizeof who), host, joined,
                    c->nnodes - 1);
    }
    close(c->lfd); /* late connections are refused by the system */
    c->lfd = -1;
    return KR_OK;
}

/* One connection attempt to the leader, up to `deadline`: the socket, or -1. */
static int dial(struct kr_cluster *c, double deadline)
{
    char port[16];
    snprintf(port, sizeof port, "%d", c->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    if (getaddrinfo(c->addr, port, &hints, &ai) != 0) {
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
            continue;
        }
        int e = 0;
        socklen_t el = sizeof e;
        if (connect(fd, a->ai_addr, a->ai_addrlen) != 0 &&
            (errno != EINPROGRESS || wait_fd(c, fd, POLLOUT, deadline) != KR_OK ||
             getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) != 0 || e != 0)) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    return fd;
}

static enum kr_status worker_join(struct kr_cluster *c, const struct kr_wire_field *f, int32_t n, struct kr_err *err)
{
    const double t0 = kr_clock_s(), deadline = t0 + c->join_timeout_s;
    double next_log = t0 + LOG_EVERY_S;
    KR_LOG_INFO("cluster: node %d of %d (ranks %d..%d), joining the leader at %s:%d", c->node, c->nnodes,
                c->node * c->per, c->node * c->per + c->per - 1, c->addr, c->port);
    int fd;
    while ((fd = dial(c, kr_clock_s() + 2 < deadline ? kr_clock_s() + 2 : deadline)) < 0) {
        if (atomic_load(&c->aborted)) {
            return kr_err_set(err, KR_ERR_CANCELLED, "cluster: the bootstrap was cancelled");
        }
        if (kr_clock_s() >= deadline) {
            return kr_err_set(err, KR_ERR_IO, "cluster: cannot reach the leader at %s:%d within %.0f s", c->addr,
                              c->port, c->join_timeout_s);
        }
        if (kr_clock_s() >= next_log) {
            KR_LOG_INFO("cluster: the leader at %s:%d does not answer yet (%.0f s left)", c->addr, c->port,
                        deadline - kr_clock_s());
            next_log += LOG_EVERY_S;
        }
        struct pollfd p = {.fd = c->wake, .events = POLLIN};
        (void)poll(&p, 1, 250);
    }
    sock_setup(fd);
    c->peers[0].fd = fd;
    struct kr_wire_buf b = {0};
    kr_wire_put_hello(&b, f, n);
    enum kr_status st = b.nomem ? KR_ERR_NOMEM : send_frame(c, 0, KR_WIRE_HELLO, b.p, b.len, NULL, 0, deadline);
    kr_wire_buf_free(&b);
    if (st != KR_OK) {
        return kr_err_set(err, KR_ERR_IO, "cluster: the leader at %s:%d closed the connection", c->addr, c->port);
    }
    uint8_t h[KR_WIRE_HEADER];
    uint32_t type;
    uint64_t len;
    if ((st = recv_all(c, fd, h, sizeof h, deadline)) != KR_OK) {
        return kr_err_set(err, KR_ERR_IO, "cluster: the leader at %s:%d did not answer this node's HELLO (%s)",
                          c->addr, c->port, st == KR_ERR_BUSY ? "timeout" : "connection closed");
    }
    KR_TRY(kr_wire_header_get(h, &type, &len, err));
    if (type == KR_WIRE_REFUSE) {
        uint8_t buf[KR_WIRE_MAX_STR + 4];
        char why[KR_WIRE_MAX_STR + 1] = "";
        if (len <= sizeof buf && recv_all(c, fd, buf, (size_t)len, deadline) == KR_OK) {
            struct kr_wire_rd r = {.p = buf, .len = (size_t)len};
            kr_wire_get_str(&r, why, sizeof why);
        }
        return kr_err_set(err, KR_ERR_INVAL, "cluster: the leader refused node %d: %s", c->node, why);
    }
    if (type != KR_WIRE_WELCOME || len != 0) {
        return kr_err_set(err, KR_ERR_FORMAT, "cluster: the leader answered HELLO with %s", kr_wire_type_name(type));
    }
    KR_LOG_INFO("cluster: node %d joined the leader at %s:%d", c->node, c->addr, c->port);
    return KR_OK;
}

enum kr_status kr_cluster_join(struct kr_cluster *c, const struct kr_wire_field *f, int32_t n, struct kr_err *err)
{
    KR_TRY(c->node == 0 ? leader_join(c, f, n, err) : worker_join(c, f, n, err));
    atomic_store(&c->joined, true);
    return KR_OK;
}

enum kr_status kr_cluster_bcast_blob(struct kr_cluster *c, void *data, size_t *len, size_t cap, struct kr_err *err)
{
    const double dl = kr_clock_s() + c->join_timeout_s;
    if (c->node == 0) {
        for (int w = 1; w < c->nnodes; w++) {
            const enum kr_status st = send_frame(c, w, KR_WIRE_BLOB, data, *len, NULL, 0, dl);
            if (st != KR_OK) {
                return lost(c, w, st, "sending the start-up blob", err);
            }
        }
        return KR_OK;
    }
    uint64_t n;
    KR_TRY(recv_expect(c, 0, KR_WIRE_BLOB, &n, dl, err));
    if (n > cap) {
        kr_err_set(err, KR_ERR_FORMAT, "a start-up blob of %llu bytes (room for %zu)", (unsigned long long)n, cap);
        return lost(c, 0, KR_ERR_FORMAT, "receiving the start-up blob", err);
    }
    const enum kr_status st = recv_all(c, c->peers[0].fd, data, (size_t)n, dl);
    if (st != KR_OK) {
        return lost(c, 0, st, "receiving the start-up blob", err);
    }
    *len = (size_t)n;
    return KR_OK;
}

/* ---- the leader's side of the steps ------------------------------------------------------------ */

enum kr_status kr_cluster_start(struct kr_cluster *c, const struct kr_cache_plan *plan, struct kr_err *err)
{
    struct kr_wire_buf b = {0};
    kr_wire_put_plan_cache(&b, plan);
    if (b.nomem) {
        return kr_err_set(err, KR_ERR_NOMEM, "out of memory");
    }
    const double dl = kr_clock_s() + c->join_timeout_s;
    enum kr_status st = KR_OK;
    for (int w = 1; w < c->nnodes && st == KR_OK; w++) {
        if ((st = send_frame(c, w, KR_WIRE_START, b.p, b.len, NULL, 0, dl)) != KR_OK) {
            st = lost(c, w, st, "sending the cache plan", err);
        }
    }
    kr_wire_buf_free(&b);
    for (int w = 1; w < c->nnodes && st == KR_OK; w++) {
        st = recv_status(c, w, KR_WIRE_READY, dl, err);
    }
    if (st == KR_OK) {
        KR_LOG_INFO("cluster: every node's ranks hold caches of the plan (%d slots, %d blocks)", plan->n_slots,
                    plan->n_blocks);
    }
    return st;
}

enum kr_status kr_cluster_step_send(struct kr_cluster *c, const struct kr_wire_copy *ops, int32_t n_ops, bool lost_ops,
                                    const struct kr_batch *b, int mtp, const int32_t *src_row, struct kr_err *err)
{
    c->plan.len = 0;
    c->plan.nomem = false;
    kr_wire_put_step(&c->plan, ops, n_ops, lost_ops, b, mtp, src_row);
    if (c->plan.nomem || c->plan.len > KR_WIRE_MAX_CONTROL) {
        kr_cluster_abort(c, "the leader cannot write a step's plan (out of memory or too large)");
        return kr_err_set(err, KR_ERR_CANCELLED, "%s", c->why);
    }
    const double dl = kr_clock_s() + c->step_timeout_s;
    for (int w = 1; w < c->nnodes; w++) {
        const enum kr_status st = send_frame(c, w, KR_WIRE_PLAN, c->plan.p, c->plan.len, NULL, 0, dl);
        if (st != KR_OK) {
            return lost(c, w, st, "sending a step", err);
        }
    }
    return KR_OK;
}

enum kr_status kr_cluster_step_wait(struct kr_cluster *c, struct kr_err *err)
{
    const double dl = kr_clock_s() + c->step_timeout_s;
    enum kr_status first = KR_OK;
    for (int w = 1; w < c->nnodes; w++) {
        struct kr_err e = {0};
        const enum kr_status st = recv_status(c, w, KR_WIRE_DONE, dl, &e);
        if (st != KR_OK && first == KR_OK) {
            first = st;
            *err = e;
        }
    }
    return first;
}

void kr_cluster_bye(struct kr_cluster *c)
{
    if (atomic_load(&c->aborted) || !atomic_load(&c->joined)) {
        return;
    }
    for (int w = 1; w < c->nnodes; w++) {
        if (c->peers[w].fd >= 0) {
            (void)send_frame(c, w, KR_WIRE_BYE, NULL, 0, NULL, 0, kr_clock_s() + 5);
            shutdown(c->peers[w].fd, SHUT_WR);
        }
    }
}

/* ---- a worker's side ----------------------------------------------------------------------------- */

/* The next frame from the leader between steps (no deadline: an idle group waits; the leader's
 * going away ends the wait): PLAN (payload in *buf), BYE, or an error. */
static enum kr_status next_order(struct kr_cluster *c, uint32_t *type, uint8_t **buf, uint64_t *len, struct kr_err *err)
{
    uint8_t h[KR_WIRE_HEADER];
    *buf = NULL;
    enum kr_status st = recv_all(c, c->peers[0].fd, h, sizeof h, 0);
    if (st != KR_OK) {
        return lost(c, 0, st, "waiting for the next step", err);
    }
    struct kr_err ferr = {0};
    if (kr_wire_header_get(h, type, len, &ferr) != KR_OK) {
        return lost(c, 0, KR_ERR_FORMAT, "waiting for the next step", &ferr);
    }
    if (*type == KR_WIRE_BYE) {
        return KR_OK;
    }
    if (*type == KR_WIRE_ABORT || *type == KR_WIRE_PLAN) {
        KR_TRY(recv_payload(c, 0, *len, buf, kr_clock_s() + c->step_timeout_s, err));
        if (*type == KR_WIRE_PLAN) {
            return KR_OK;
        }
        struct kr_wire_rd r = {.p = *buf, .len = (size_t)*len};
        char reason[KR_WIRE_MAX_STR + 1], why[KR_WIRE_MAX_STR + 64];
        kr_wire_get_str(&r, reason, sizeof reason);
        kr_free(*buf);
        *buf = NULL;
        snprintf(why, sizeof why, "the leader left the group: %s", reason[0] ? reason : "no reason given");
        kr_cluster_abort(c, why);
        return kr_err_set(err, KR_ERR_CANCELLED, "%s", c->why);
    }
    kr_err_set(&ferr, KR_ERR_FORMAT, "a %s frame between steps", kr_wire_type_name(*type));
    return lost(c, 0, KR_ERR_FORMAT, "waiting for the next step", &ferr);
}

/* Receives the cache plan and starts this node's ranks on it; tells the leader how it went. */
static enum kr_status worker_start(struct kr_cluster *c, struct kr_model *const *models, int32_t n,
                                   const struct kr_cluster_reserve *rs, struct kr_ranks **out, struct kr_err *err)
{
    uint64_t len;
    uint8_t *buf;
    KR_TRY(recv_expect(c, 0, KR_WIRE_START, &len, 0, err));
    KR_TRY(recv_payload(c, 0, len, &buf, kr_clock_s() + c->step_timeout_s, err));
    struct kr_wire_rd r = {.p = buf, .len = (size_t)len};
    struct kr_cache_plan plan;
    struct kr_err e = {0};
    enum kr_status st = kr_wire_get_plan_cache(&r, &plan, &e);
    kr_free(buf);
    if (st != KR_OK) {
        return lost(c, 0, st, "reading the cache plan", &e);
    }
    for (int32_t i = 0; i < n && st == KR_OK; i++) {
        models[i]->mtp_keep = models[i]->n_mtp > 0; /* loaded for MTP drafting: steps keep their residual stream */
        if ((st = kr_model_reserve(models[i], rs->n_tok, rs->n_out, rs->n_seq, rs->max_ctx, rs->block_size)) != KR_OK) {
            kr_err_set(&e, st, "rank %d: cannot reserve the forward workspace", c->node * c->per + i);
        }
    }
    if (st == KR_OK) {
        st = kr_ranks_start(models, n, c->node * c->per, &plan, NULL, out, &e);
    }
    const enum kr_status sst = send_status(c, KR_WIRE_READY, st, e.msg, kr_clock_s() + c->step_timeout_s);
    if (st != KR_OK) {
        kr_ranks_stop(*out);
        *out = NULL;
        return kr_err_set(err, st, "%s", e.msg);
    }
    if (sst != KR_OK) {
        kr_ranks_stop(*out);
        *out = NULL;
        return lost(c, 0, sst, "answering the cache plan", err);
    }
    KR_LOG_INFO("cluster: node %d's %d rank%s hold caches of the leader's plan (%d slots, %d blocks)", c->node, n,
                n > 1 ? "s" : "", plan.n_slots, plan.n_blocks);
    return KR_OK;
}

enum kr_status kr_cluster_serve(struct kr_cluster *c, struct kr_model *const *models, int32_t n,
                                const struct kr_cluster_reserve *rs, struct kr_err *err)
{
    struct kr_ranks *g = NULL;
    KR_TRY(worker_start(c, models, n, rs, &g, err));
    kr_ranks_set_cluster(g, c);
    struct kr_switches sw;
    const int first = c->node * c->per;
    if (kr_switches_from_env(&sw, NULL) == KR_OK && sw.fault_step > 0 && sw.fault_rank >= first &&
        sw.fault_rank < first + n) {
        kr_ranks_set_fault(g, sw.fault_rank, sw.fault_step);
        KR_LOG_WARN("KRAIT_FAULT_RANK=%d: rank %d fails step %lld", sw.fault_rank, sw.fault_rank,
                    (long long)sw.fault_step);
    }
    enum kr_status st;
    for (;;) {
        uint32_t type;
        uint8_t *buf;
        uint64_t len;
        if ((st = next_order(c, &type, &buf, &len, err)) != KR_OK || type == KR_WIRE_BYE) {
            break;
        }
        struct kr_wire_rd r = {.p = buf, .len = (size_t)len};
        struct kr_wire_step s;
        struct kr_err e = {0};
        st = kr_wire_get_step(&r, &s, &e);
        kr_free(buf);
        if (st != KR_OK) {
            st = lost(c, 0, st, "reading a step", &e);
            break;
        }
        for (int32_t i = 0; i < s.n_ops; i++) {
            (void)kr_ranks_record_copy(g, s.ops[i].kind, s.ops[i].src, s.ops[i].dst);
        }
        if (s.lost) {
            kr_ranks_lose_copies(g);
        }
        if (s.mtp != KR_WIRE_STEP) {
            kr_ranks_begin_mtp(g, &s.b, s.mtp == KR_WIRE_MTP_FROM_HEAD, s.src_row);
        } else {
            kr_ranks_begin(g, &s.b);
        }
        st = kr_ranks_wait(g, &e);
        kr_wire_step_free(&s);
        if (st != KR_OK) {
            /* the failing rank aborted the group (and the leader heard why) */
            kr_err_set(err, st, "%s", c->why[0] ? c->why : e.msg);
            break;
        }
        const enum kr_status sst = send_status(c, KR_WIRE_DONE, KR_OK, "", kr_clock_s() + c->step_timeout_s);
        if (sst != KR_OK) {
            st = lost(c, 0, sst, "ending a step", err);
            break;
        }
    }
    kr_ranks_stop(g);
    if (st == KR_OK) {
        KR_LOG_INFO("cluster: the leader ended the group");
    }
    return st;
}

/* ---- fingerprints --------------------------------------------------------------------------------- */

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ b[i]) * 0x100000001b3ull;
    }
    return h;
}

#define FNV_SEED 0xcbf29ce484222325ull

enum kr_status kr_cluster_config_fingerprint(const char *model_dir, uint64_t *out, struct kr_err *err)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", model_dir);
    char *text;
    size_t len;
    KR_TRY(kr_file_read(path, (size_t)16 << 20, &text, &len, err));
    *out = fnv(FNV_SEED, text, len);
    kr_free(text);
    return KR_OK;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

enum kr_status kr_cluster_weights_fingerprint(const char *model_dir, uint64_t *out, struct kr_err *err)
{
    DIR *d = opendir(model_dir);
    if (!d) {
        return kr_err_set(err, KR_ERR_IO, "%s: %s", model_dir, strerror(errno));
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    enum kr_status st = KR_OK;
    for (struct dirent *e; (e = readdir(d)) && st == KR_OK;) {
        const size_t l = strlen(e->d_name);
        if (l <= 12 || strcmp(e->d_name + l - 12, ".safetensors") != 0) {
            continue;
        }
        if (n == cap) {
            char **p = kr_realloc(names, (cap ? cap * 2 : 16) * sizeof *p);
            if (!p) {
                st = KR_ERR_NOMEM;
                break;
            }
            names = p;
            cap = cap ? cap * 2 : 16;
        }
        if (!(names[n] = kr_strdup(e->d_name))) {
            st = KR_ERR_NOMEM;
            break;
        }
        n++;
    }
    closedir(d);
    if (st == KR_OK && n == 0) {
        st = kr_err_set(err, KR_ERR_IO, "%s: no *.safetensors files", model_dir);
    } else if (st == KR_ERR_NOMEM) {
        kr_err_set(err, st, "out of memory");
    }
    if (n > 1) {
        qsort(names, n, sizeof *names, cmp_names);
    }
    uint64_t h = FNV_SEED;
    for (size_t i = 0; i < n && st == KR_OK; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", model_dir, names[i]);
        FILE *f = fopen(path, "rb");
        uint8_t lb[8];
        if (!f || fread(lb, 1, 8, f) != 8) {
            st = kr_err_set(err, KR_ERR_IO, "%s: cannot read its header", path);
        } else {
            uint64_t hl = 0;
            for (int k = 0; k < 8; k++) {
                hl |= (uint64_t)lb[k] << (8 * k);
            }
            char *hdr = hl <= ((uint64_t)100 << 20) ? kr_malloc(hl ? (size_t)hl : 1) : NULL;
            if (!hdr || fread(hdr, 1, (size_t)hl, f) != hl) {
                st = kr_err_set(err, KR_ERR_IO, "%s: cannot read its %llu-byte header", path, (unsigned long long)hl);
            } else {
                h = fnv(h, names[i], strlen(names[i]) + 1);
                h = fnv(h, hdr, (size_t)hl);
            }
            kr_free(hdr);
        }
        if (f) {
            fclose(f);
        }
    }
    for (size_t i = 0; i < n; i++) {
        kr_free(names[i]);
    }
    kr_free(names);
    *out = h;
    return st;
}
