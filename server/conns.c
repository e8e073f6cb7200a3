#include "conns.h"

#include "alloc.h"
#include "log.h"

#include <netinet/in.h>
#include <string.h>
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

/* The address's key: its family and bytes, an IPv4-mapped IPv6 address as the IPv4 one. False for
 * anything else (a Unix socket, a short length). */
static bool addr_key(const void *sa, unsigned len, uint8_t key[17])
{
    memset(key, 0, 17);
    if (!sa || len < sizeof(sa_family_t)) {
        return false;
    }
    const sa_family_t fam = ((const struct sockaddr *)sa)->sa_family;
    if (fam == AF_INET && len >= sizeof(struct sockaddr_in)) {
        key[0] = 4;
        memcpy(key + 1, &((const struct sockaddr_in *)sa)->sin_addr, 4);
        return true;
    }
    if (fam == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_V4MAPPED(a)) {
            key[0] = 4;
            memcpy(key + 1, a->s6_addr + 12, 4);
        } else {
            key[0] = 6;
            memcpy(key + 1, a->s6_addr, 16);
        }
        return true;
    }
    return false;
}

static uint64_t key_hash(const uint8_t key[17])
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (int i = 0; i < 17; i++) {
        h = (h ^ key[i]) * 1099511628211ull;
    }
    return h;
}

static struct kr_conn_addr *addr_find(const struct kr_conns *g, const uint8_t key[17], uint64_t h)
{
    if (!g->buckets) {
        return NULL;
    }
    for (struct kr_conn_addr *a = g->buckets[h & (g->n_buckets - 1)]; a; a = a->next) {
        if (a->hash == h && memcmp(a->key, key, 17) == 0) {
            return a;
        }
    }
    return NULL;
}

/* The entry of sa's address with one more open connection; NULL when unknown or out of memory (the
 * connection is then not counted by address). */
static struct kr_conn_addr *addr_ref(struct kr_conns *g, const void *sa, unsigned len)
{
    uint8_t key[17];
    if (!addr_key(sa, len, key)) {
        return NULL;
    }
    if (!g->buckets) {
        unsigned n = 64;
        while (n < (unsigned)(g->max_waiting > 0 ? g->max_waiting : 1024) && n < (1u << 20)) {
            n <<= 1;
        }
        g->buckets = kr_calloc(n, sizeof *g->buckets);
        if (!g->buckets) {
            return NULL;
        }
        g->n_buckets = n;
    }
    const uint64_t h = key_hash(key);
    struct kr_conn_addr *a = addr_find(g, key, h);
    if (!a) {
        a = kr_calloc(1, sizeof *a);
        if (!a) {
            return NULL;
        }
        a->hash = h;
        memcpy(a->key, key, 17);
        struct kr_conn_addr **b = &g->buckets[h & (g->n_buckets - 1)];
        a->next = *b;
        *b = a;
    }
    a->n_open++;
    return a;
}

static void addr_unref(struct kr_conns *g, struct kr_conn_addr *a)
{
    if (!a || --a->n_open > 0) {
        return;
    }
    struct kr_conn_addr **p = &g->buckets[a->hash & (g->n_buckets - 1)];
    while (*p != a) {
        p = &(*p)->next;
    }
    *p = a->next;
    if (g->top == a) {
        g->top = NULL;
    }
    kr_free(a);
}

/* Whether top holds more than half of the waiting connections. */
static bool top_holds_most(const struct kr_conns *g)
{
    return g->top && g->top->n_waiting * 2 > g->waiting.n;
}

static void set_state(struct kr_conns *g, struct kr_conn *c, enum kr_conn_state st, double now)
{
    struct kr_conn_list *from = list_of(g, c);
    if (from) {
        list_remove(from, c);
        if (from == &g->waiting && c->addr) {
            c->addr->n_waiting--;
        }
    }
    c->state = st;
    c->since = now;
    struct kr_conn_list *to = list_of(g, c);
    if (to) {
        list_push(to, c);
        if (to == &g->waiting && c->addr) {
            struct kr_conn_addr *a = c->addr;
            a->n_waiting++;
            if (!g->top || a->n_waiting > g->top->n_waiting) {
                g->top = a;
            }
        }
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
                           .body_timeout_s = body_timeout_s,
                           .other_seen_s = -1};
}

void kr_conns_free(struct kr_conns *g)
{
    for (unsigned i = 0; g->buckets && i < g->n_buckets; i++) {
        for (struct kr_conn_addr *a = g->buckets[i], *next; a; a = next) {
            next = a->next;
            kr_free(a);
        }
    }
    kr_free(g->buckets);
    g->buckets = NULL;
    g->top = NULL;
}

bool kr_conns_admit(struct kr_conns *g, const void *sa, unsigned sa_len, double now)
{
    if (g->max_waiting <= 0 || g->waiting.n * 2 < g->max_waiting || !top_holds_most(g) || g->other_seen_s < 0 ||
        now - g->other_seen_s > KR_CONNS_OTHERS_S) {
        return true;
    }
    uint8_t key[17];
    if (!addr_key(sa, sa_len, key) || addr_find(g, key, key_hash(key)) != g->top) {
        return true;
    }
    g->n_refused++;
    if (g->door && g->blocked_until == 0) {
        g->blocked_until = now + KR_CONNS_BLOCK_S;
        g->n_blocks++;
        g->door(g->door_user, key);
    }
    return false;
}

struct kr_conn *kr_conn_open(struct kr_conns *g, int fd, const void *sa, unsigned sa_len, double now)
{
    struct kr_conn *c = kr_calloc(1, sizeof *c);
    if (!c) {
        return NULL;
    }
    c->addr = addr_ref(g, sa, sa_len);
    if (c->addr && c->addr != g->top && top_holds_most(g)) {
        g->other_seen_s = now;
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
        set_state(g, c, KR_CONN_CLOSING, 0);
    }
    addr_unref(g, c->addr);
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

static double earliest(double a, double b)
{
    return a < 0 ? b : b < 0 ? a : a < b ? a : b;
}

double kr_conns_sweep(struct kr_conns *g, double now)
{
    const double a = sweep_list(g, &g->waiting, g->header_timeout_s, now, &g->n_header_timeouts);
    const double b = sweep_list(g, &g->reading, g->body_timeout_s, now, &g->n_body_timeouts);
    if (g->blocked_until > 0 && now >= g->blocked_until) {
        g->blocked_until = 0;
        g->door(g->door_user, NULL);
    }
    return earliest(earliest(a, b), g->blocked_until > 0 ? g->blocked_until - now : -1);
}
