#include "metrics.h"

#include "alloc.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Buckets as vLLM uses them (seconds). */
static const double ttft_le[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                 1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
static const double itl_le[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
static const double e2e_le[] = {0.3,  0.5,  0.8,  1.0,  1.5,  2.0,   2.5,   5.0,   10.0,  15.0, 20.0,
                                30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

void kr_metrics_init(struct kr_metrics *m)
{
    memset(m, 0, sizeof *m);
    m->ttft.le = ttft_le;
    m->ttft.n = (int)(sizeof ttft_le / sizeof ttft_le[0]);
    m->itl.le = itl_le;
    m->itl.n = (int)(sizeof itl_le / sizeof itl_le[0]);
    m->e2e.le = e2e_le;
    m->e2e.n = (int)(sizeof e2e_le / sizeof e2e_le[0]);
    m->queue.le = e2e_le;
    m->queue.n = m->e2e.n;
}

void kr_hist_observe(struct kr_hist *h, double v)
{
    int i = 0;
    while (i < h->n && v > h->le[i]) {
        i++;
    }
    if (i < h->n) {
        h->count[i]++;
    }
    h->total++;
    h->sum += v;
}

struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
};

static void put(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(struct sbuf *b, const char *fmt, ...)
{
    if (b->oom) {
        return;
    }
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t nc = (b->cap + (size_t)n) * 2;
        char *np = kr_realloc(b->p, nc);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = nc;
    }
}

static void hist(struct sbuf *b, const char *pfx, const char *name, const char *help, const struct kr_hist *h,
                 const char *lbl)
{
    put(b, "# HELP %s:%s %s\n# TYPE %s:%s histogram\n", pfx, name, help, pfx, name);
    uint64_t cum = 0;
    for (int i = 0; i < h->n; i++) {
        cum += h->count[i];
        put(b, "%s:%s_bucket{%s,le=\"%g\"} %llu\n", pfx, name, lbl, h->le[i], (unsigned long long)cum);
    }
    put(b, "%s:%s_bucket{%s,le=\"+Inf\"} %llu\n", pfx, name, lbl, (unsigned long long)h->total);
    put(b, "%s:%s_sum{%s} %.9g\n%s:%s_count{%s} %llu\n", pfx, name, lbl, h->sum, pfx, name, lbl,
        (unsigned long long)h->total);
}

static void gauge(struct sbuf *b, const char *name, const char *lbl, double v)
{
    put(b, "# HELP vllm:%s krait:%s under vLLM's name.\n# TYPE vllm:%s gauge\nvllm:%s{%s} %.9g\n", name, name, name,
        name, lbl, v);
}

static void counter(struct sbuf *b, const char *name, const char *lbl, uint64_t v)
{
    put(b, "# HELP vllm:%s krait:%s under vLLM's name.\n# TYPE vllm:%s counter\nvllm:%s{%s} %llu\n", name, name,
        name, name, lbl, (unsigned long long)v);
}

/* The families an endpoint picker or a dashboard made for vLLM reads, under vLLM's own names
 * (`vllm:`), always beside the `krait:` ones, with the same values: the Gateway API inference
 * extension (llm-d, KServe) scores endpoints by vllm:num_requests_waiting, vllm:num_requests_running
 * and vllm:kv_cache_usage_perc; the latency histograms keep vLLM's buckets (kr_metrics_init), and
 * vllm:time_per_output_token_seconds is the older name vLLM still emits for the inter-token
 * intervals. */
static void vllm_families(struct sbuf *b, const struct kr_metrics *m, const struct kr_engine_stats *st,
                          const char *lbl, double kv)
{
    gauge(b, "num_requests_running", lbl, st->running);
    gauge(b, "num_requests_waiting", lbl, st->waiting);
    gauge(b, "kv_cache_usage_perc", lbl, kv);
    counter(b, "num_preemptions_total", lbl, st->preemptions);
    counter(b, "prompt_tokens_total", lbl, st->prompt_tokens);
    counter(b, "generation_tokens_total", lbl, st->generation_tokens);
    counter(b, "prefix_cache_queries_total", lbl, st->prefix_queries);
    counter(b, "prefix_cache_hits_total", lbl, st->prefix_hits);
    static const char *const reasons[3] = {"stop", "length", "abort"};
    put(b, "# HELP vllm:request_success_total krait:request_success_total under vLLM's name.\n"
           "# TYPE vllm:request_success_total counter\n");
    for (int i = 0; i < 3; i++) {
        put(b, "vllm:request_success_total{%s,finished_reason=\"%s\"} %llu\n", lbl, reasons[i],
            (unsigned long long)m->requests_ok[i]);
    }
    if (st->spec_k > 0) {
        counter(b, "spec_decode_num_drafts_total", lbl, st->spec_drafts);
        counter(b, "spec_decode_num_draft_tokens_total", lbl, st->spec_draft_tokens);
        counter(b, "spec_decode_num_accepted_tokens_total", lbl, st->spec_accepted_tokens);
        put(b, "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total krait:spec_decode_num_accepted_tokens_per_"
               "pos_total under vLLM's name.\n# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter\n");
        for (int32_t i = 0; i < st->spec_k && i < KR_SPEC_MAX_TOKENS; i++) {
            put(b, "vllm:spec_decode_num_accepted_tokens_per_pos_total{%s,position=\"%d\"} %llu\n", lbl, i,
                (unsigned long long)st->spec_accepted_per_pos[i]);
        }
    }
    static const char same[] = "The krait: histogram of the same name under vLLM's name.";
    hist(b, "vllm", "time_to_first_token_seconds", same, &m->ttft, lbl);
    hist(b, "vllm", "inter_token_latency_seconds", same, &m->itl, lbl);
    hist(b, "vllm", "time_per_output_token_seconds",
         "krait:inter_token_latency_seconds under the older vLLM name.", &m->itl, lbl);
    hist(b, "vllm", "e2e_request_latency_seconds", same, &m->e2e, lbl);
    hist(b, "vllm", "request_queue_time_seconds", same, &m->queue, lbl);
}

char *kr_metrics_render(const struct kr_metrics *m, const struct kr_engine_stats *st, const char *model_name,
                        size_t *len)
{
    struct sbuf b = {.p = kr_malloc(8192), .cap = 8192};
    if (!b.p) {
        return NULL;
    }
    b.p[0] = 0;
    char lbl[320];
    /* label values escape backslash, quote and newline */
    size_t o = (size_t)snprintf(lbl, sizeof lbl, "model_name=\"");
    for (const char *c = model_name; *c && o < sizeof lbl - 4; c++) {
        if (*c == '"' || *c == '\\') {
            lbl[o++] = '\\';
            lbl[o++] = *c;
        } else if (*c == '\n') {
            lbl[o++] = '\\';
            lbl[o++] = 'n';
        } else {
            lbl[o++] = *c;
        }
    }
    lbl[o++] = '"';
    lbl[o] = 0;
    put(&b, "# HELP krait:num_requests_running Sequences holding caches and running.\n"
            "# TYPE krait:num_requests_running gauge\nkrait:num_requests_running{%s} %d\n",
        lbl, st->running);
    put(&b, "# HELP krait:num_requests_waiting Sequences waiting for admission (incl. preempted).\n"
            "# TYPE krait:num_requests_waiting gauge\nkrait:num_requests_waiting{%s} %d\n",
        lbl, st->waiting);
    put(&b, "# HELP krait:num_preemptions_total Sequences preempted to free cache (recomputed later).\n"
            "# TYPE krait:num_preemptions_total counter\nkrait:num_preemptions_total{%s} %llu\n",
        lbl, (unsigned long long)st->preemptions);
    put(&b, "# HELP krait:prompt_tokens_total Prompt tokens prefilled.\n"
            "# TYPE krait:prompt_tokens_total counter\nkrait:prompt_tokens_total{%s} %llu\n",
        lbl, (unsigned long long)st->prompt_tokens);
    put(&b, "# HELP krait:generation_tokens_total Tokens generated.\n"
            "# TYPE krait:generation_tokens_total counter\nkrait:generation_tokens_total{%s} %llu\n",
        lbl, (unsigned long long)st->generation_tokens);
    put(&b, "# HELP krait:engine_steps_total Forward steps run by the engine.\n"
            "# TYPE krait:engine_steps_total counter\nkrait:engine_steps_total{%s} %llu\n",
        lbl, (unsigned long long)st->steps);
    put(&b, "# HELP krait:engine_step_host_gap_seconds Host time between back-to-back steps, from a step's "
            "results to the next launch (the device idles meanwhile).\n"
            "# TYPE krait:engine_step_host_gap_seconds summary\n"
            "krait:engine_step_host_gap_seconds_sum{%s} %.9g\nkrait:engine_step_host_gap_seconds_count{%s} %llu\n",
        lbl, st->step_gap_us_total / 1e6, lbl, (unsigned long long)st->step_gaps);
    put(&b, "# HELP krait:structured_output_mask_seconds Host time making the allowed-token masks of constrained "
            "rows (structured outputs), one observation per mask.\n"
            "# TYPE krait:structured_output_mask_seconds summary\n"
            "krait:structured_output_mask_seconds_sum{%s} %.9g\nkrait:structured_output_mask_seconds_count{%s} %llu\n",
        lbl, st->mask_us_total / 1e6, lbl, (unsigned long long)st->masks);
    const int32_t blocks_used = st->blocks_total - st->blocks_free - st->blocks_cached; /* held by sequences */
    const double kv = st->blocks_total ? (double)blocks_used / st->blocks_total : 0.0;
    const double ss = st->slots_total ? 1.0 - (double)st->slots_free / st->slots_total : 0.0;
    put(&b, "# HELP krait:kv_cache_usage_perc Fraction of attention/latent cache blocks held by running "
            "sequences (blocks kept only by the prefix cache are reclaimed on demand and not counted).\n"
            "# TYPE krait:kv_cache_usage_perc gauge\nkrait:kv_cache_usage_perc{%s} %.6g\n",
        lbl, kv);
    put(&b, "# HELP krait:ssm_state_usage_perc Fraction of Mamba state slots in use.\n"
            "# TYPE krait:ssm_state_usage_perc gauge\nkrait:ssm_state_usage_perc{%s} %.6g\n",
        lbl, ss);
    put(&b, "# HELP krait:cache_blocks Cache blocks by state: free, used (held by sequences), cached (kept "
            "only by the prefix cache, reclaimed on demand).\n# TYPE krait:cache_blocks gauge\n"
            "krait:cache_blocks{%s,state=\"free\"} %d\nkrait:cache_blocks{%s,state=\"used\"} %d\n"
            "krait:cache_blocks{%s,state=\"cached\"} %d\n",
        lbl, st->blocks_free, lbl, blocks_used, lbl, st->blocks_cached);
    put(&b, "# HELP krait:state_slots Mamba state slots by state.\n# TYPE krait:state_slots gauge\n"
            "krait:state_slots{%s,state=\"free\"} %d\nkrait:state_slots{%s,state=\"used\"} %d\n",
        lbl, st->slots_free, lbl, st->slots_total - st->slots_free);
    put(&b, "# HELP krait:state_snapshots The prefix cache's Mamba state snapshot slots by state.\n"
            "# TYPE krait:state_snapshots gauge\n"
            "krait:state_snapshots{%s,state=\"free\"} %d\nkrait:state_snapshots{%s,state=\"used\"} %d\n",
        lbl, st->snapshots_total - st->snapshots_used, lbl, st->snapshots_used);
    put(&b, "# HELP krait:cache_pool_bytes Bytes of each cache pool.\n# TYPE krait:cache_pool_bytes gauge\n"
            "krait:cache_pool_bytes{%s,pool=\"blocks\"} %zu\nkrait:cache_pool_bytes{%s,pool=\"state_slots\"} %zu\n"
            "krait:cache_pool_bytes{%s,pool=\"state_snapshots\"} %zu\n",
        lbl, st->block_bytes * (size_t)st->blocks_total, lbl, st->slot_bytes * (size_t)st->slots_total, lbl,
        st->snapshot_bytes * (size_t)st->snapshots_total);
    put(&b, "# HELP krait:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.\n"
            "# TYPE krait:prefix_cache_queries_total counter\nkrait:prefix_cache_queries_total{%s} %llu\n",
        lbl, (unsigned long long)st->prefix_queries);
    put(&b, "# HELP krait:prefix_cache_hits_total Prompt tokens found in the prefix cache (not computed again).\n"
            "# TYPE krait:prefix_cache_hits_total counter\nkrait:prefix_cache_hits_total{%s} %llu\n",
        lbl, (unsigned long long)st->prefix_hits);
    put(&b, "# HELP krait:prefix_cache_unusable_block_tokens_total Prompt tokens that matched cached attention "
            "blocks beyond the deepest Mamba state snapshot (computed again: no state to go on from).\n"
            "# TYPE krait:prefix_cache_unusable_block_tokens_total counter\n"
            "krait:prefix_cache_unusable_block_tokens_total{%s} %llu\n",
        lbl, (unsigned long long)st->prefix_block_only);
    put(&b, "# HELP krait:prefix_cache_snapshots_total Mamba state snapshots taken.\n"
            "# TYPE krait:prefix_cache_snapshots_total counter\nkrait:prefix_cache_snapshots_total{%s} %llu\n",
        lbl, (unsigned long long)st->prefix_snapshots);
    put(&b, "# HELP krait:prefix_cache_evictions_total Cached entries evicted to make room, by kind.\n"
            "# TYPE krait:prefix_cache_evictions_total counter\n"
            "krait:prefix_cache_evictions_total{%s,kind=\"snapshot\"} %llu\n"
            "krait:prefix_cache_evictions_total{%s,kind=\"block\"} %llu\n",
        lbl, (unsigned long long)st->prefix_evicted_snapshots, lbl, (unsigned long long)st->prefix_evicted_blocks);
    if (st->spec_k > 0) {
        put(&b, "# HELP krait:spec_decode_num_drafts_total Steps in which a sequence verified drafted tokens.\n"
                "# TYPE krait:spec_decode_num_drafts_total counter\nkrait:spec_decode_num_drafts_total{%s} %llu\n",
            lbl, (unsigned long long)st->spec_drafts);
        put(&b, "# HELP krait:spec_decode_num_draft_tokens_total Drafted tokens verified.\n"
                "# TYPE krait:spec_decode_num_draft_tokens_total counter\n"
                "krait:spec_decode_num_draft_tokens_total{%s} %llu\n",
            lbl, (unsigned long long)st->spec_draft_tokens);
        put(&b, "# HELP krait:spec_decode_num_accepted_tokens_total Drafted tokens kept (the sampler drew them).\n"
                "# TYPE krait:spec_decode_num_accepted_tokens_total counter\n"
                "krait:spec_decode_num_accepted_tokens_total{%s} %llu\n",
            lbl, (unsigned long long)st->spec_accepted_tokens);
        put(&b, "# HELP krait:spec_decode_num_accepted_tokens_per_pos_total Drafted tokens kept, by their position "
                "among a step's drafts (0: the first).\n"
                "# TYPE krait:spec_decode_num_accepted_tokens_per_pos_total counter\n");
        for (int32_t i = 0; i < st->spec_k && i < KR_SPEC_MAX_TOKENS; i++) {
            put(&b, "krait:spec_decode_num_accepted_tokens_per_pos_total{%s,position=\"%d\"} %llu\n", lbl, i,
                (unsigned long long)st->spec_accepted_per_pos[i]);
        }
    }
    static const char *const reasons[3] = {"stop", "length", "abort"};
    put(&b, "# HELP krait:request_success_total Finished choices by finish reason.\n"
            "# TYPE krait:request_success_total counter\n");
    for (int i = 0; i < 3; i++) {
        put(&b, "krait:request_success_total{%s,finished_reason=\"%s\"} %llu\n", lbl, reasons[i],
            (unsigned long long)m->requests_ok[i]);
    }
    static const char *const classes[10] = {"2xx", "400", "401", "404", "405", "413", "429", "500", "503", "other"};
    put(&b, "# HELP krait:http_requests_total HTTP responses by status (2xx together; \"other\": any status "
            "not named).\n"
            "# TYPE krait:http_requests_total counter\n");
    for (int i = 0; i < 10; i++) {
        put(&b, "krait:http_requests_total{%s,status=\"%s\"} %llu\n", lbl, classes[i],
            (unsigned long long)m->http_requests[i]);
    }
    put(&b, "# HELP krait:http_connections Open HTTP connections.\n"
            "# TYPE krait:http_connections gauge\n"
            "krait:http_connections{%s} %lld\n",
        lbl, (long long)m->connections_open);
    static const char *const why[4] = {"header_timeout", "body_timeout", "evicted", "refused"};
    put(&b, "# HELP krait:http_connections_closed_total Connections the server closed before their request "
            "arrived: headers or body not in time (--header-timeout, --body-timeout), the longest-waiting "
            "connection when too many waited, or a new one refused at accept because its address held most "
            "of the waiting ones.\n"
            "# TYPE krait:http_connections_closed_total counter\n");
    for (int i = 0; i < 4; i++) {
        put(&b, "krait:http_connections_closed_total{%s,reason=\"%s\"} %llu\n", lbl, why[i],
            (unsigned long long)m->connections_closed[i]);
    }
    hist(&b, "krait", "time_to_first_token_seconds", "Time to first token.", &m->ttft, lbl);
    hist(&b, "krait", "inter_token_latency_seconds", "Time between consecutive tokens of a choice.", &m->itl, lbl);
    hist(&b, "krait", "e2e_request_latency_seconds", "End-to-end request latency.", &m->e2e, lbl);
    hist(&b, "krait", "request_queue_time_seconds", "Time from arrival to first admission.", &m->queue, lbl);
    vllm_families(&b, m, st, lbl, kv);
    if (b.oom) {
        kr_free(b.p);
        return NULL;
    }
    *len = b.len;
    return b.p;
}
