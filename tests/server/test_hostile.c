/* Hostile clients against the real `krait serve` (embedded model): connections that never finish
 * their headers or bodies, more waiting connections than the server keeps, one address holding
 * many, bodies that together exceed the shared body budget, a body whose parse would take more
 * memory than a request may, oversized headers. Each test starts its own server with the limit
 * under test set low, and checks both the refusal and that an ordinary request still gets served. */
#include "harness.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MODEL KR_SOURCE_DIR "/models/tiny-hybrid"

TestSuite(hostile, .timeout = 300);

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int dial(const struct srv_proc *p)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)p->port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0, "connect: %s", strerror(errno));
    return fd;
}

/* A connection from source address 127.0.0.<host> (all of 127/8 is this machine's). */
static int dial_from(const struct srv_proc *p, int host)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in src = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000000u | (unsigned)host)};
    cr_assert_eq(bind(fd, (struct sockaddr *)&src, sizeof src), 0, "bind 127.0.0.%d: %s", host, strerror(errno));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)p->port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0, "connect: %s", strerror(errno));
    return fd;
}

static void send_all(int fd, const char *s, size_t n)
{
    while (n) {
        ssize_t k = send(fd, s, n, MSG_NOSIGNAL);
        cr_assert_gt(k, 0, "send: %s", strerror(errno));
        s += k;
        n -= (size_t)k;
    }
}

/* Seconds until the server ends the connection (reading and dropping whatever it sends first), or
 * -1 when it is still open after `wait_s`. */
static double closed_within(int fd, double wait_s)
{
    const double t0 = now();
    char buf[4096];
    for (;;) {
        const double left = wait_s - (now() - t0);
        if (left <= 0) {
            return -1;
        }
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, (int)(left * 1000) + 1) <= 0) {
            continue;
        }
        ssize_t k = recv(fd, buf, sizeof buf, 0);
        if (k <= 0) {
            return now() - t0;
        }
    }
}

static void expect_served(const struct srv_proc *p)
{
    long st = 0;
    json_t *j = post_json(p, "/v1/completions", "{\"prompt\":\"Hello\",\"max_tokens\":1}", &st);
    cr_expect_eq(st, 200, "an ordinary request still gets served");
    json_decref(j);
}

/* A connection that never completes its headers, and a kept-alive one that sends no further
 * request, are closed at --header-timeout. */
Test(hostile, headers_must_arrive_within_the_header_timeout)
{
    struct srv_proc S;
    srv_start(&S, MODEL, "--header-timeout", "1", NULL);
    int slow = dial(&S);
    send_all(slow, "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: a", 40);
    int idle = dial(&S);
    const char *req = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    send_all(idle, req, strlen(req));
    char buf[512];
    cr_assert_gt(recv(idle, buf, sizeof buf, 0), 0, "the first request is answered");
    const double t_slow = closed_within(slow, 5), t_idle = closed_within(idle, 5);
    cr_expect(t_slow > 0.5 && t_slow < 4, "the half-sent headers were cut at %.2f s (timeout 1 s)", t_slow);
    cr_expect(t_idle > 0 && t_idle < 4, "the idle kept-alive connection was closed at %.2f s", t_idle);
    close(slow);
    close(idle);
    expect_served(&S);
    cr_expect_geq(metric(&S, "krait:http_connections_closed_total"), 2);
    cr_expect_eq(srv_stop(&S), 0);
}

/* Headers sent in time, then a body that trickles: closed at --body-timeout. */
Test(hostile, a_body_must_arrive_within_the_body_timeout)
{
    struct srv_proc S;
    srv_start(&S, MODEL, "--body-timeout", "1", NULL);
    int fd = dial(&S);
    const char *head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       "Content-Length: 100\r\n\r\n{\"prompt\":";
    send_all(fd, head, strlen(head));
    const double t = closed_within(fd, 6);
    cr_expect(t > 0.5 && t < 5, "the body was cut at %.2f s (timeout 1 s)", t);
    close(fd);
    expect_served(&S);
    cr_expect_eq(srv_stop(&S), 0);
}

/* --max-connections 16: at most 12 connections may wait for a request; beyond, the one waiting
 * longest is closed, so that a flood of idle connections cannot lock ordinary clients out. */
Test(hostile, beyond_three_quarters_of_the_connections_waiting_the_oldest_is_closed)
{
    struct srv_proc S;
    srv_start(&S, MODEL, "--max-connections", "16", "--header-timeout", "0", NULL);
    enum { N = 20 };
    int fd[N];
    for (int i = 0; i < N; i++) {
        fd[i] = dial(&S);
        send_all(fd[i], "GET /he", 7);
        usleep(20000); /* one after the other: the server sees them in this order */
    }
    for (int i = 0; i < N - 12; i++) {
        cr_expect_gt(closed_within(fd[i], 3), 0, "connection %d (among the oldest) was closed", i);
    }
    for (int i = N - 12; i < N; i++) {
        cr_expect_lt(closed_within(fd[i], 0.2), 0, "connection %d (among the newest 12) is still open", i);
    }
    expect_served(&S);
    for (int i = 0; i < N; i++) {
        close(fd[i]);
    }
    cr_expect_eq(srv_stop(&S), 0);
}

/* The value of krait:http_connections_closed_total{reason="<why>"}; NaN if absent. */
static double closed_by(const struct srv_proc *p, const char *why)
{
    struct http_res r;
    http(p, "GET", "/metrics", NULL, NULL, &r);
    char key[96];
    snprintf(key, sizeof key, "reason=\"%s\"}", why);
    const char *at = r.body ? strstr(r.body, key) : NULL;
    const double v = at ? strtod(at + strlen(key), NULL) : NAN;
    http_free(&r);
    return v;
}

/* --max-connections 16 (12 may wait), no flag about addresses: 127.0.0.2 holds 7 waiting
 * connections, then another address connects. From then on, under pressure (6 or more waiting), a
 * new connection from 127.0.0.2 is refused at accept: its waiting ones and the other address's stay
 * open, nothing is evicted, and the refusal is counted. */
Test(hostile, under_pressure_the_address_holding_most_waiting_connections_is_refused_at_accept)
{
    struct srv_proc S;
    srv_start(&S, MODEL, "--max-connections", "16", "--header-timeout", "0", NULL);
    usleep(300000); /* the start-up's health check connection is gone */
    enum { N = 7 };
    int fd[N];
    for (int i = 0; i < N; i++) {
        fd[i] = dial_from(&S, 2);
        send_all(fd[i], "GET /he", 7);
        usleep(20000);
    }
    const int other = dial_from(&S, 1);
    send_all(other, "GET /he", 7);
    usleep(100000);
    const int late = dial_from(&S, 2);
    cr_expect_gt(closed_within(late, 3), 0, "the new connection of the crowding address is refused");
    /* ... and for the next 2 s its SYNs are dropped at the listening socket: a connection attempt
     * does not complete within 1.5 s (the kernel retries the SYN after 1 s) */
    const int kept = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    struct sockaddr_in src = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000002u)};
    struct sockaddr_in dst = {.sin_family = AF_INET, .sin_port = htons((uint16_t)S.port),
                              .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(bind(kept, (struct sockaddr *)&src, sizeof src), 0);
    cr_assert(connect(kept, (struct sockaddr *)&dst, sizeof dst) != 0 && errno == EINPROGRESS);
    struct pollfd pk = {.fd = kept, .events = POLLOUT};
    cr_expect_eq(poll(&pk, 1, 1500), 0, "the kept-out address's connection is not established");
    close(kept);
    for (int i = 0; i < N; i++) {
        cr_expect_lt(closed_within(fd[i], 0.1), 0, "its waiting connection %d stays", i);
    }
    cr_expect_lt(closed_within(other, 0.1), 0, "the other address's connection stays");
    cr_expect_eq(closed_by(&S, "refused"), 1.0, "one refusal counted (the next attempt never got in)");
    cr_expect_eq(closed_by(&S, "evicted"), 0.0, "nothing evicted");
    expect_served(&S); /* from 127.0.0.1 */
    close(late);
    close(other);
    for (int i = 0; i < N; i++) {
        close(fd[i]);
    }
    cr_expect_eq(srv_stop(&S), 0);
}

/* Clients that share one address cannot be told apart: with no other address in sight, a flood from
 * one address is never refused at accept (its newest connections, an ordinary client's among them,
 * survive by eviction instead). */
Test(hostile, one_address_alone_is_never_refused_at_accept)
{
    struct srv_proc S;
    srv_start(&S, MODEL, "--max-connections", "16", "--header-timeout", "0", NULL);
    usleep(300000);
    enum { N = 14 };
    int fd[N];
    for (int i = 0; i < N; i++) {
        fd[i] = dial_from(&S, 3);
        send_all(fd[i], "GET /he", 7);
        usleep(20000);
    }
    cr_expect_lt(closed_within(fd[N - 1], 0.3), 0, "the newest connection is open");
    cr_expect_gt(closed_within(fd[0], 3), 0, "the oldest was evicted");
    cr_expect_eq(closed_by(&S, "refused"), 0.0, "nothing refused");
    for (int i = 0; i < N; i++) {
        close(fd[i]);
    }
    cr_expect_eq(srv_stop(&S), 0);
}

/* --max-connections-per-ip 3: a fourth connection from the same address is closed at once. */
Test(hostile, the_per_address_connection_limit)
{
    struct srv_proc S;
    srv_start(&S, MODEL, "--max-connections-per-ip", "3", NULL);
    usleep(300000); /* the start-up's health check connection is gone */
    int fd[4];
    for (int i = 0; i < 3; i++) {
        fd[i] = dial(&S);
        send_all(fd[i], "GET /he", 7);
    }
    usleep(100000);
    fd[3] = dial(&S);
    cr_expect_gt(closed_within(fd[3], 3), 0, "the fourth connection is refused");
    for (int i = 0; i < 3; i++) {
        cr_expect_lt(closed_within(fd[i], 0.1), 0, "connection %d stays", i);
        close(fd[i]);
    }
    close(fd[3]);
    usleep(200000);
    expect_served(&S);
    cr_expect_eq(srv_stop(&S), 0);
}

/* Bodies beyond each request's free 256 KiB draw on a pool of four maximum-size bodies: eight 1 MB
 * bodies sent at once (--max-request-bytes 1M) overflow it. Once the pool cannot take a declared
 * Content-Length, the request gets 503 with Retry-After as soon as its headers are in, before its
 * body is sent; the others are read whole (and answered as their content deserves). */
Test(hostile, large_bodies_at_once_share_a_bounded_pool)
{
    struct srv_proc S;
    srv_start(&S, MODEL, "--max-request-bytes", "1M", NULL);
    enum { N = 8, LEN = 1000000 };
    char *body = malloc(LEN + 1);
    cr_assert(body);
    memset(body, 'a', LEN);
    memcpy(body, "{\"prompt\":\"", 11);
    memcpy(body + LEN - 2, "\"}", 2);
    body[LEN] = 0;
    char head[256];
    snprintf(head, sizeof head,
             "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
             "Connection: close\r\n\r\n",
             LEN);
    int fd[N];
    bool early[N];
    int n503 = 0, n400 = 0;
    for (int i = 0; i < N; i++) { /* every body all but its last bytes, so that all are buffered at once */
        fd[i] = dial(&S);
        send_all(fd[i], head, strlen(head));
        struct pollfd pf = {.fd = fd[i], .events = POLLIN};
        early[i] = poll(&pf, 1, 300) == 1; /* answered on its headers */
        if (!early[i]) {
            send_all(fd[i], body, LEN - 16);
        }
    }
    for (int i = 0; i < N; i++) {
        if (!early[i]) {
            send_all(fd[i], body + LEN - 16, 16);
        }
        char resp[2048] = "";
        size_t got = 0;
        ssize_t k;
        while (got < sizeof resp - 1 && (k = recv(fd[i], resp + got, sizeof resp - 1 - got, 0)) > 0) {
            got += (size_t)k;
        }
        resp[got] = 0;
        if (!strncmp(resp, "HTTP/1.1 503", 12)) {
            n503++;
            cr_expect(early[i], "connection %d: the 503 came before the body was sent", i);
            cr_expect(strstr(resp, "Retry-After:") != NULL, "a 503 carries Retry-After");
            cr_expect(strstr(resp, "too many large request bodies") != NULL, "the 503 names the cause: %s", resp);
        } else if (!strncmp(resp, "HTTP/1.1 400", 12)) {
            n400++; /* read whole: a prompt longer than the model's context */
        } else {
            cr_expect(0, "connection %d: unexpected answer: %.200s", i, resp);
        }
        close(fd[i]);
    }
    cr_expect_gt(n503, 0, "some bodies found the pool spent");
    cr_expect_gt(n400, 0, "the pool took some bodies whole");
    free(body);
    expect_served(&S);
    cr_expect_eq(srv_stop(&S), 0);
}

/* A body within the size limit whose parse costs more than --max-request-memory (200,000 token ids,
 * about 50 bytes each once parsed) is a 413 naming the flag; the same body under the default limit
 * is parsed and refused for what it says (longer than the model's context). */
Test(hostile, a_parse_beyond_the_request_memory_limit_is_refused)
{
    const size_t n = 200000;
    char *b = malloc(n * 2 + 64), *p = b;
    cr_assert(b);
    p += sprintf(p, "{\"max_tokens\":1,\"prompt\":[");
    for (size_t i = 0; i < n; i++) {
        p += sprintf(p, i ? ",1" : "1");
    }
    sprintf(p, "]}");
    struct srv_proc S;
    srv_start(&S, MODEL, "--max-request-memory", "4M", NULL);
    long st = 0;
    json_t *j = post_json(&S, "/v1/completions", b, &st);
    cr_expect_eq(st, 413);
    const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    cr_expect(msg && strstr(msg, "--max-request-memory"), "the refusal names the limit: %s", msg ? msg : "(none)");
    json_decref(j);
    expect_served(&S);
    cr_expect_eq(srv_stop(&S), 0);

    srv_start(&S, MODEL, NULL);
    j = post_json(&S, "/v1/completions", b, &st);
    cr_expect_eq(st, 400, "under the default limit the ids are parsed, then refused as too long");
    json_decref(j);
    cr_expect_eq(srv_stop(&S), 0);
    free(b);
}

/* Request headers beyond 32 KiB are answered 431 by the HTTP layer. */
Test(hostile, oversized_headers_get_431)
{
    struct srv_proc S;
    srv_start(&S, MODEL, NULL);
    int fd = dial(&S);
    const size_t n = 40000;
    char *req = malloc(n + 128);
    cr_assert(req);
    int k = sprintf(req, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ");
    memset(req + k, 'a', n);
    strcpy(req + k + n, "\r\n\r\n");
    send_all(fd, req, strlen(req));
    char resp[64] = "";
    cr_expect_gt(recv(fd, resp, sizeof resp - 1, 0), 0);
    cr_expect(!strncmp(resp, "HTTP/1.1 431", 12), "answer: %.40s", resp);
    close(fd);
    free(req);
    expect_served(&S);
    cr_expect_eq(srv_stop(&S), 0);
}
