#pragma once
/* End-to-end harness: starts the real `krait serve` on 127.0.0.1 with an ephemeral port and talks
 * to it with libcurl. */
#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

struct srv_proc {
    pid_t pid;
    int port;
    char port_file[64];
    char host[64];        /* where it listens (--host among the extra arguments, else 127.0.0.1) */
};

/* Starts `krait serve MODEL --port 0 ... extra args (NULL-terminated)` and waits until /health is
 * 200 (cr_assert on failure). The server inherits the environment; its stderr goes to
 * srv_log_path when that is set (a test's own process: Criterion runs each test in one). */
void srv_start(struct srv_proc *p, const char *model, ...);
extern const char *srv_log_path;
/* srv_start in two halves, so that several servers load at once: srv_spawn starts the process,
 * srv_ready waits until it wrote its port and /health is 200 (cr_assert on failure). */
void srv_spawn(struct srv_proc *p, const char *model, ...);
void srv_ready(struct srv_proc *p);
/* SIGTERM and wait; returns the exit status (or -1). */
int srv_stop(struct srv_proc *p);

struct http_res {
    long status;
    char *body;           /* malloc'd, NUL-terminated */
    size_t len;
    char retry_after[32]; /* Retry-After header value, "" if none */
    char content_type[128];
    char allow[64];       /* Allow header value, "" if none */
    char headers[4096];   /* every response header line, "Name: value\n" each (truncated) */
};

/* One request; `body` may be NULL (GET). `auth` adds "Authorization: Bearer <auth>". */
void http(const struct srv_proc *p, const char *method, const char *path, const char *body, const char *auth,
          struct http_res *out);
void http_free(struct http_res *r);
/* As http, with further request headers (a NULL-terminated list of "Name: value"). */
void http_with(const struct srv_proc *p, const char *method, const char *path, const char *body,
               const char *const *headers, struct http_res *out);
/* The value of response header `name` (case-insensitive) in r, copied to buf[cap]; NULL if absent. */
const char *http_header(const struct http_res *r, const char *name, char *buf, size_t cap);
/* POSTs and parses the JSON answer (cr_assert it parses). Caller json_decref()s. */
json_t *post_json(const struct srv_proc *p, const char *path, const char *body, long *status);
/* Streams a POST: returns the raw SSE text; when abort_after > 0 the transfer is aborted after that
 * many bytes. */
char *post_stream(const struct srv_proc *p, const char *path, const char *body, size_t abort_after, long *status);
/* Parses SSE "data: ..." events: returns a JSON array of the parsed objects; *done tells whether the
 * last event was [DONE]. */
json_t *sse_events(const char *text, bool *done);
/* A metric value from /metrics (first sample of `name` with any labels); NaN if absent. */
double metric(const struct srv_proc *p, const char *name);
/* The first sample of `name` whose labels hold `label`, e.g. ("krait:state_slots", "state=\"used\"");
 * NaN if absent. */
double metric_with(const struct srv_proc *p, const char *name, const char *label);
/* Polls until nothing runs or waits and every state slot and cache block is free; returns the
 * seconds it took, or -1 after `limit` seconds. */
double srv_wait_idle(const struct srv_proc *p, double limit);
