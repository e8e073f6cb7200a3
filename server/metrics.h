#pragma once
/* Prometheus metrics of the server (loop thread only), rendered in the text exposition format
 * with vLLM-style names under the `krait:` prefix. */
#include <stddef.h>
#include <stdint.h>

#include "engine.h"

#define KR_HIST_MAX_BUCKETS 24

struct kr_hist {
    int n;                               /* buckets */
    const double *le;                    /* [n] upper bounds (seconds) */
    uint64_t count[KR_HIST_MAX_BUCKETS]; /* non-cumulative counts per bucket; +Inf implied */
    uint64_t total;
    double sum;
};

struct kr_metrics {
    struct kr_hist ttft, itl, e2e, queue;
    uint64_t requests_ok[3];    /* finished: stop, length, abort (cancelled or failed) */
    uint64_t http_requests[10]; /* by status: 2xx, 400, 401, 404, 405, 413, 429, 500, 503, other */
    int64_t connections_open;   /* copied from the connection deadlines (conns.h) before rendering */
    uint64_t connections_closed[4]; /* by the server: header_timeout, body_timeout, evicted, refused */
};

void kr_metrics_init(struct kr_metrics *m);
void kr_hist_observe(struct kr_hist *h, double v);

/* Renders the metrics plus the engine's counters. Returns a kr_malloc'd string. */
char *kr_metrics_render(const struct kr_metrics *m, const struct kr_engine_stats *st, const char *model_name,
                        size_t *len);
