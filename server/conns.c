#include "conns.h"

#include "alloc.h"
#include "log.h"

#include <sys/socket.h>

static void list_push(struct kr_conn_list *l, struct kr_conn *c)
{
    c->prev = l->tail;
    c->next = NULL;
    if (l->tail) {
        l->tail->next = c;
    } else {
        l->head = c;
    }
    l->tail = c;
    l->n++;
}

static void list_remove(struct kr_conn_list *l, struct kr_conn *c)
{
    if (c->prev) {
        c->prev->next = c->next;
    } else {
        l->head = c->next;
    }
    if (c->next) {
        c->next->prev = c->prev;
    } else {
        l->tail = c->prev;
    }
    c->prev = c->next = NULL;
    l->n--;
}

static struct kr_conn_list *list_of(struct kr_conns *g, const struct kr_conn *c)
{
    return c->state == KR_CONN_WAITING ? &g->waiting : c->state == KR_CONN_READING ? &g->reading : NULL;
}

static void set_state(struct kr_conns *g, struct kr_conn *c, enum kr_conn_state st, double now)
{
    struct kr_conn_list *from = list_of(g, c);
    if (from) {
        list_remove(from, c);
    }
    c->state = st;
    c->since = now;
    struct kr_conn_list *to = list_of(g, c);
    if (to) {
        list_push(to, c);
    }
}

/* Ends the connection: the peer gets a FIN and libmicrohttpd, reading the end of the stream, closes
 * it and calls kr_conn_closed. */
static void shut(struct kr_conns *g, struct kr_conn *c)
{
    set_state(g, c, KR_CONN_CLOSING, 0);
    shutdown(c->fd, SHUT_RDWR);
}

void kr_conns_init(struct kr_conns *g, int max_waiting, double header_timeout_s, double body_timeout_s)
{
    *g = (struct kr_conns){.max_waiting = max_waiting,
                           .header_timeout_s = header_timeout_s,
                           .body_timeout_s = body_timeout_s};
}

struct kr_conn *kr_conn_open(struct kr_conns *g, int fd, double now)
{
    struct kr_conn *c = kr_calloc(1, sizeof *c);
    if (!c) {
        return NULL;
    }
    c->fd = fd;
    c->state = KR_CONN_ACTIVE; /* so that set_state finds no list to leave */
    set_state(g, c, KR_CONN_WAITING, now);
    g->n_open++;
    if (g->max_waiting > 0 && g->waiting.n > g->max_waiting) {
        g->n_evicted++;
        KR_LOG_DEBUG("http: %d connections wait for a request: closing the one waiting longest", g->waiting.n);
        shut(g, g->waiting.head);
    }
    return c;
}

void kr_conn_headers_in(struct kr_conns *g, struct kr_conn *c, double now)
{
    if (c && c->state == KR_CONN_WAITING) {
        set_state(g, c, KR_CONN_READING, now);
    }
}

void kr_conn_body_in(struct kr_conns *g, struct kr_conn *c)
{
    if (c && c->state == KR_CONN_READING) {
        set_state(g, c, KR_CONN_ACTIVE, c->since);
    }
}

void kr_conn_answered(struct kr_conns *g, struct kr_conn *c, double now)
{
    if (c && c->state != KR_CONN_CLOSING) {
        set_state(g, c, KR_CONN_WAITING, now);
    }
}

void kr_conn_closed(struct kr_conns *g, struct kr_conn *c)
{
    if (!c) {
        return;
    }
    struct kr_conn_list *l = list_of(g, c);
    if (l) {
        list_remove(l, c);
    }
    g->n_open--;
    kr_free(c);
}

/* Shuts down the list's connections that have been in their state longer than `limit`; returns the
 * seconds until its next deadline (negative: none). The lists are in the order of `since`. */
static double sweep_list(struct kr_conns *g, struct kr_conn_list *l, double limit, double now, uint64_t *count)
{
    if (limit <= 0) {
        return -1;
    }
    while (l->head && now - l->head->since >= limit) {
        (*count)++;
        shut(g, l->head);
    }
    return l->head ? l->head->since + limit - now : -1;
}

double kr_conns_sweep(struct kr_conns *g, double now)
{
    const double a = sweep_list(g, &g->waiting, g->header_timeout_s, now, &g->n_header_timeouts);
    const double b = sweep_list(g, &g->reading, g->body_timeout_s, now, &g->n_body_timeouts);
    return a < 0 ? b : b < 0 ? a : a < b ? a : b;
}
