#pragma once
/* Deadlines for the connections of the HTTP front end, against clients that hold connections
 * without finishing a request (slowloris, slow bodies). libmicrohttpd bounds the number of
 * connections and how long one may stay silent, but not how long a request may take to arrive:
 * a client that sends a header byte every few minutes keeps its connection for ever, and a few
 * thousand of them fill the connection table.
 *
 * A connection is in one of three states:
 *
 *   waiting ── headers in ──▶ reading ── body in ──▶ active ── answer sent ──▶ waiting ...
 *   (opened, or kept alive     (the body            (no deadline: answers may
 *    after an answer)           arrives)             take minutes)
 *
 * Waiting connections must bring a request's headers within header_timeout_s, reading ones their
 * whole body within body_timeout_s. When more than max_waiting connections wait, the one waiting
 * longest is closed: a client that opens connections faster than it sends on them pushes out its
 * own, while an ordinary client's headers come within milliseconds of its connection. A closed
 * connection is shut down (shutdown(2)) and left to libmicrohttpd, which sees the end of the
 * stream and releases it as usual.
 *
 * Evicting costs the server a shutdown, and the client may open another connection at once; a
 * client on an address of its own is cheaper to stop at the door. Connections are counted by client
 * address, and under pressure (half of max_waiting or more waiting) a new connection is refused at
 * accept when its address holds more than half of the waiting connections while some other address
 * has opened a connection in the last KR_CONNS_OTHERS_S seconds. Clients that all share one address
 * (behind one proxy or gateway) cannot be told apart: they are left to eviction, which still keeps
 * the newest connections, and the limits belong in the proxy.
 *
 * Refusing still costs an accept and a close, and the refused client's connections wait in the
 * kernel's accept queue ahead of everyone else's. So a refusal also asks the caller, through
 * `door`, to keep that address's new connections out of the queue for KR_CONNS_BLOCK_S seconds (a
 * socket filter on the listening socket dropping its SYNs: the client retries as after a lost
 * packet); the sweep lifts it.
 *
 * Loop thread only. */
#include <stdbool.h>
#include <stdint.h>

enum kr_conn_state { KR_CONN_WAITING, KR_CONN_READING, KR_CONN_ACTIVE, KR_CONN_CLOSING };

/* A client address with open connections. */
struct kr_conn_addr {
    struct kr_conn_addr *next; /* in its hash bucket */
    uint64_t hash;
    uint8_t key[17];           /* family (4 or 6) then the address; IPv4-mapped IPv6 as IPv4 */
    int n_open, n_waiting;
};

#define KR_CONNS_OTHERS_S 60.0
#define KR_CONNS_BLOCK_S 2.0

struct kr_conn {
    struct kr_conn *prev, *next; /* in the list of its state (waiting or reading), oldest first */
    struct kr_conn_addr *addr;   /* NULL: unknown */
    int fd;
    enum kr_conn_state state;
    double since;                /* when it entered its state */
};

struct kr_conn_list {
    struct kr_conn *head, *tail;
    int n;
};

struct kr_conns {
    struct kr_conn_list waiting, reading;
    int n_open;
    int max_waiting;             /* 0: no bound */
    double header_timeout_s;     /* 0: none */
    double body_timeout_s;       /* 0: none */
    uint64_t n_header_timeouts, n_body_timeouts, n_evicted, n_refused;
    struct kr_conn_addr **buckets; /* by address; allocated with the first connection */
    unsigned n_buckets;           /* a power of two */
    struct kr_conn_addr *top;     /* the address that most recently outgrew the one before: when some
                                   * address holds most waiting connections, it is this one */
    double other_seen_s;          /* the last connection opened by an address other than top while
                                   * top held most waiting ones (negative: never) */
    /* keeps one address's new connections out (key) or lets everyone in again (NULL); optional */
    void (*door)(void *user, const uint8_t key[17]);
    void *door_user;
    double blocked_until;         /* 0: nobody kept out */
    uint64_t n_blocks;            /* times an address was kept out */
};

void kr_conns_init(struct kr_conns *g, int max_waiting, double header_timeout_s, double body_timeout_s);
/* Frees what the connections left (call once every connection was closed). */
void kr_conns_free(struct kr_conns *g);

/* Whether a connection from sa (before it is set up) is let in: false refuses it, counts it, and
 * keeps the address out for a while through `door` when one is set. */
bool kr_conns_admit(struct kr_conns *g, const void *sa, unsigned sa_len, double now);
/* A new connection on descriptor fd (waiting), from sa (NULL: unknown). NULL when out of memory:
 * the connection is then closed by the caller's refusal, or simply not watched. May close the
 * longest-waiting one. */
struct kr_conn *kr_conn_open(struct kr_conns *g, int fd, const void *sa, unsigned sa_len, double now);
/* Its request's headers are in (reading), its body is in (active), its answer was sent and the
 * connection stays open (waiting again). Each ignores a NULL or closing connection. */
void kr_conn_headers_in(struct kr_conns *g, struct kr_conn *c, double now);
void kr_conn_body_in(struct kr_conns *g, struct kr_conn *c);
void kr_conn_answered(struct kr_conns *g, struct kr_conn *c, double now);
/* libmicrohttpd closed it: forget and free c (NULL allowed). */
void kr_conn_closed(struct kr_conns *g, struct kr_conn *c);
/* Shuts down every connection past its deadline and lifts an expired block. Returns the seconds
 * until the next deadline (a negative value: none). */
double kr_conns_sweep(struct kr_conns *g, double now);
