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
 * Loop thread only. */
#include <stdbool.h>
#include <stdint.h>

enum kr_conn_state { KR_CONN_WAITING, KR_CONN_READING, KR_CONN_ACTIVE, KR_CONN_CLOSING };

struct kr_conn {
    struct kr_conn *prev, *next; /* in the list of its state (waiting or reading), oldest first */
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
    uint64_t n_header_timeouts, n_body_timeouts, n_evicted;
};

void kr_conns_init(struct kr_conns *g, int max_waiting, double header_timeout_s, double body_timeout_s);

/* A new connection on descriptor fd (waiting). NULL when out of memory: the connection is then
 * closed by the caller's refusal, or simply not watched. May close the longest-waiting one. */
struct kr_conn *kr_conn_open(struct kr_conns *g, int fd, double now);
/* Its request's headers are in (reading), its body is in (active), its answer was sent and the
 * connection stays open (waiting again). Each ignores a NULL or closing connection. */
void kr_conn_headers_in(struct kr_conns *g, struct kr_conn *c, double now);
void kr_conn_body_in(struct kr_conns *g, struct kr_conn *c);
void kr_conn_answered(struct kr_conns *g, struct kr_conn *c, double now);
/* libmicrohttpd closed it: forget and free c (NULL allowed). */
void kr_conn_closed(struct kr_conns *g, struct kr_conn *c);
/* Shuts down every connection past its deadline. Returns the seconds until the next deadline
 * (a negative value: none). */
double kr_conns_sweep(struct kr_conns *g, double now);
