#pragma once
/* The HTTP front end: one libuv loop thread owns every connection; libmicrohttpd runs inside it
 * in external-epoll mode (its epoll descriptor watched by a uv_poll_t, its timeouts by a
 * uv_timer_t); the engine thread hands events back through a mutex-protected queue and
 * uv_async_send. Nothing blocks the loop. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct kr_serve_opts {
    const char *model_dir;
    const char *host;              /* default 0.0.0.0 */
    int port;                      /* default 8000; 0 = ephemeral (the bound port is printed) */
    const char **api_keys;         /* [n_api_keys] accepted Bearer tokens; none = open */
    int n_api_keys;
    const char *served_model_name; /* default: the model directory */
    int32_t max_model_len;         /* 0 = the model's max_position_embeddings; more is refused at start */
    bool allow_long_max_model_len; /* ... unless this is set (then a warning) */
    int32_t max_num_seqs;
    int32_t max_num_batched_tokens;
    int32_t max_queued_requests;   /* 0 = unbounded */
    size_t cache_bytes;            /* cache budget; 0 = from gpu_mem_util on CUDA (512 MiB on the CPU) */
    const char *device;            /* cpu | cuda | cuda:N | auto (default: CUDA when a GPU is visible) */
    double gpu_mem_util;           /* fraction of the GPU's memory krait may hold (weights + caches) */
    int indexer;                   /* enum kr_indexer: DSA indexer precision (0 auto, 1 bf16, 2 fp8) */
    int kv_cache_dtype;            /* enum kr_kv_cache_dtype (0 auto, 1 bf16, 2 fp8) */
    int32_t block_size;
    bool prefix_caching;           /* default on (--no-enable-prefix-caching turns it off) */
    int32_t prefix_state_interval; /* tokens between Mamba state snapshots (a multiple of block_size) */
    int32_t prefix_snapshots;      /* state snapshot slots; -1 = automatic */
    int spec_method;               /* enum kr_spec_method (--speculative-config; 0: off) */
    int32_t spec_k, spec_ngram_min, spec_ngram_max;
    const char *tokenizer_dir;     /* default: the model directory */
    const char *chat_template_file;
    bool skip_tokenizer_init;
    bool return_tokens_as_token_ids;
    size_t max_body_bytes;         /* 413 above */
    size_t max_request_memory;     /* a request's preparation (parsed JSON, prompt, ids) may hold this; 413 above */
    int max_connections;           /* open connections (libmicrohttpd refuses more) */
    int max_connections_per_ip;    /* 0 = no per-address limit */
    double header_timeout_s;       /* a connection without a request must bring its headers within this */
    double body_timeout_s;         /* ... and then its whole body within this */
    double drain_timeout_s;        /* SIGTERM: finish in-flight requests for at most this long */
    int threads;                   /* CPU backend threads (0 = all) */
    int tensor_parallel_size;      /* ranks (1: none), all nodes together */
    bool fp8_weights;              /* --quantization fp8 (kr_backend_set_fp8_weights) */
    bool batch_invariant;          /* --batch-invariant (kr_backend_set_batch_invariant, engine chunking) */
    int nnodes;                    /* nodes the ranks are spread over (1: this process holds them all) */
    int node_rank;                 /* this node: 0 leads (engine, API), 1.. run their ranks, /health only */
    const char *master_addr;       /* the leader's address (default 127.0.0.1) */
    int master_port;               /* where the leader waits for the other nodes (default 29500) */
    double join_timeout_s;         /* how long the nodes wait for each other at start (default 600) */
    const char *port_file;         /* when set, the bound port is written there once listening (tests) */
    /* CORS (vLLM's --allowed-origins/-methods/-headers, --allow-credentials): a NULL list is ["*"],
     * everything allowed, as vLLM's defaults; an empty one allows nothing; entries borrowed */
    const char **cors_origins;     /* [n_cors_origins] exact origins ("https://app.example") or "*" */
    int n_cors_origins;
    const char **cors_methods;     /* [n_cors_methods] methods a preflight may ask for, or "*" */
    int n_cors_methods;
    const char **cors_headers;     /* [n_cors_headers] request headers a preflight may ask for, or "*" */
    int n_cors_headers;
    bool cors_credentials;         /* Access-Control-Allow-Credentials: true (the origin is then echoed) */
};

void kr_serve_opts_default(struct kr_serve_opts *o);

/* Loads the model and tokenizer, starts the engine and serves until SIGTERM/SIGINT (drain) —
 * returns the process exit code. Nothing it starts outlives it (the shutdown watchdog included),
 * so a program may run it on a thread and again after it returned (the tests do). One at a time. */
int kr_serve_run(const struct kr_serve_opts *o);

/* `krait serve MODEL_DIR [flags]`: parses flags (vllm serve names) and KRAIT_* environment
 * overrides, then runs. Returns the exit code. */
int kr_serve_main(int argc, char **argv);

/* --speculative-config's JSON text (vLLM's spelling) into its method (enum kr_spec_method), k and
 * n-gram bounds. 0, or 2 after a message on stderr that starts with `prog` ("krait serve"). */
int kr_spec_parse(const char *prog, const char *text, int *method, int32_t *k, int32_t *ngram_min,
                  int32_t *ngram_max);

#ifdef __cplusplus
}
#endif
