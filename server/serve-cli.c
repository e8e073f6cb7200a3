/* `krait serve`: flags named as `vllm serve` has them where one exists, KRAIT_* environment
 * overrides (flags win), then kr_serve_run. */
#include "server.h"

#include "alloc.h"
#include "engine.h"
#include "log.h"
#include "model.h"
#include "switches.h"

#include <errno.h>
#include <jansson.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: krait serve MODEL_DIR [options]\n"
            "\n"
            "Serves MODEL_DIR (config.json + *.safetensors + tokenizer files) with an OpenAI-compatible API.\n"
            "\n"
            "  --host ADDR                     IPv4 address to bind (default 0.0.0.0)       [KRAIT_HOST]\n"
            "  --port N                        port (default 8000; 0 = any free port)      [KRAIT_PORT]\n"
            "  --api-key KEY                   require 'Authorization: Bearer KEY' on /v1/* (repeatable)\n"
            "                                                                              [KRAIT_API_KEY]\n"
            "  --api-key-file FILE             one accepted key per line\n"
            "  --served-model-name NAME        the model name clients use (default MODEL_DIR)\n"
            "  --max-model-len N               context length limit (default: the model's max_position_embeddings;\n"
            "                                  more is refused unless --allow-long-max-model-len)\n"
            "  --allow-long-max-model-len      accept --max-model-len beyond the checkpoint's trained length\n"
            "                                  (positions past it may give poor output)\n"
            "  --max-num-seqs N                sequences running at once (default 256)\n"
            "  --max-num-batched-tokens N      tokens per engine step (default 2048)\n"
            "  --max-queued-requests N         waiting requests before 429 (default: unbounded)\n"
            "  --cache-memory-bytes N          byte budget of the cache pools (K/M/G suffixes; default 512 MiB on\n"
            "                                  the CPU, the GPU memory left under --gpu-memory-utilization on CUDA)\n"
            "  --block-size N                  tokens per cache block (default 16)\n"
            "  --enable-prefix-caching         reuse the caches of prompt prefixes seen before (default on)\n"
            "  --no-enable-prefix-caching      compute every prompt from its first token\n"
            "  --prefix-cache-state-interval N a Mamba state snapshot every N prompt tokens (a multiple of\n"
            "                                  --block-size; default 2048; 0 = only at turn and prompt ends)\n"
            "  --prefix-cache-snapshots N      Mamba state snapshots kept (default: an eighth of the cache\n"
            "                                  budget left after the running sequences' states, at most 1024)\n"
            "  --speculative-config JSON       speculative decoding, as vLLM spells it:\n"
            "                                  '{\"method\":\"ngram\",\"num_speculative_tokens\":K}' drafts up to K\n"
            "                                  (1..16) tokens per step by prompt lookup (\"prompt_lookup_max\",\n"
            "                                  \"prompt_lookup_min\": the n-gram lengths matched, default 5);\n"
            "                                  outputs are distributed exactly as without it (docs/SPECULATIVE.md)\n"
            "  --tokenizer DIR                 tokenizer.json + tokenizer_config.json location (default MODEL_DIR)\n"
            "  --chat-template FILE            Jinja chat template replacing the tokenizer's\n"
            "  --skip-tokenizer-init           no tokenizer: prompts are token ids, outputs carry ids\n"
            "  --return-tokens-as-token-ids    logprobs name tokens as token_id:N\n"
            "  --allowed-origins LIST          CORS: origins browsers may call from, a JSON list as vLLM takes\n"
            "                                  it ('[\"https://app.example\"]') or a comma list (default [\"*\"])\n"
            "  --allowed-methods LIST          CORS: methods a preflight may ask for (default [\"*\"])\n"
            "  --allowed-headers LIST          CORS: request headers a preflight may ask for (default [\"*\"])\n"
            "  --allow-credentials             CORS: Access-Control-Allow-Credentials: true (the origin is echoed)\n"
            "  --max-request-bytes N           request bodies above this get 413 (default 32 MiB)\n"
            "  --max-request-memory N          memory one request may take while it is parsed and prepared;\n"
            "                                  more gets 413 (default 256 MiB)\n"
            "  --max-connections N             open connections (default 4096; at most 3/4 of them may wait\n"
            "                                  for a request, the longest-waiting is closed beyond; past half\n"
            "                                  of that, the address holding most waiting ones is refused at\n"
            "                                  accept while other addresses are being served)\n"
            "  --max-connections-per-ip N      open connections per client address (default 0: no limit; a\n"
            "                                  proxy or gateway puts many clients behind one address)\n"
            "  --header-timeout SECONDS        a new or kept-alive connection must send a request's headers\n"
            "                                  within this (default 30; 0 = no limit)\n"
            "  --body-timeout SECONDS          ... and then the whole body within this (default 60; 0 = no limit)\n"
            "  --shutdown-timeout SECONDS      on SIGTERM, finish in-flight requests for this long (default 30);\n"
            "                                  then they end with a 503 error and the process exits within 5 s\n"
            "  --device DEV                    cpu | cuda | cuda:N | auto (default: a GPU when present) [KRAIT_DEVICE]\n"
            "  --gpu-memory-utilization F      share of GPU memory for weights + caches (default 0.9)\n"
            "  --indexer auto|bf16|fp8         DSA indexer precision (auto: the FP8 path for FP8 checkpoints)\n"
            "  --kv-cache-dtype auto|bf16|fp8  fp8: K/V and MLA latents cached in FP8 (DeepSeek's fp8_ds_mla, with\n"
            "                                  the FP8 indexer; CUDA stores the bytes, the CPU emulates them);\n"
            "                                  auto/bf16: the backend's precision (CPU fp32, CUDA bf16)\n"
            "  --threads N                     CPU threads (default: all cores)              [KRAIT_THREADS]\n"
"  --batch-invariant               a request's outputs do not depend on the requests served beside it\n"
            "                                  (nor on prompt chunking): fixed product algorithms and attention\n"
            "                                  splits, prompts cut at multiples of 256 tokens; greedy and seeded\n"
            "                                  sampling then repeat exactly (docs/CUDA.md; not with FP8 weights or\n"
            "                                  --speculative-config)\n"
            "  --quantization fp8|none         fp8: matrices kept in (FP8 checkpoints) or quantized to FP8 blocks of\n"
            "                                  128x128 at load, activations quantized per block (CPU and CUDA);\n"
            "                                  none (default): bf16/fp32 weights\n"
            "  --tensor-parallel-size N, -tp N ranks the model is split over (default 1), all nodes together;\n"
            "                                  on the CPU, threads of each process sharing its --threads\n"
            "  --nnodes N                      nodes (processes) the ranks are spread over, tp / N ranks each\n"
            "                                  (default 1)                                 [LWS_GROUP_SIZE]\n"
            "  --node-rank R                   this node: 0 is the leader (engine and API), 1.. are workers\n"
            "                                  that run their ranks and serve /health only [LWS_WORKER_INDEX]\n"
            "  --master-addr HOST              the leader's address (default 127.0.0.1)   [LWS_LEADER_ADDRESS]\n"
            "  --master-port P                 the port the leader waits for the workers on (default 29500)\n"
            "  --join-timeout SECONDS          how long the nodes wait for each other at start (default 600)\n"
            "  --log-level LEVEL               debug | info | warn | error                   [KRAIT_LOG_LEVEL]\n"
            "  --port-file FILE                write the bound port there once listening\n"
            "  --help-env                      the KRAIT_* tuning switches: values, defaults, what each does\n"
            "  --defaults-json                 every flag, whether it takes a value, and its default, as JSON\n"
            "                                  (what deployment manifests are checked against)\n"
            "\n"
            "A full waiting queue answers 429 Too Many Requests with Retry-After: 1 (503 means loading or\n"
            "draining). /health and /metrics stay open without an API key. Exit status: 0 after SIGTERM,\n"
            "1 when the model cannot load (or a node was refused or missing at start), 2 for bad flags, 3 when\n"
            "the compute device failed for good or a node of the group was lost (restart the process).\n");
}

/* --speculative-config: vLLM's JSON object. Known keys only, so that a misspelt one is not silently
 * dropped. 0, or 2 after a message on stderr that starts with `prog` ("krait serve"). */
int kr_spec_parse(const char *prog, const char *text, int *method_out, int32_t *k_out, int32_t *nmin_out,
                  int32_t *nmax_out)
{
    json_error_t je;
    json_t *j = json_loads(text, 0, &je);
    int rc = 2;
    if (!json_is_object(j)) {
        fprintf(stderr, "%s: --speculative-config is not a JSON object: %s\n",
                prog, j ? "another JSON value" : je.text);
        goto out;
    }
    const char *key;
    json_t *v;
    const char *method = NULL;
    int32_t k = -1, nmin = -1, nmax = -1;
    json_object_foreach(j, key, v) {
        int32_t *dst = !strcmp(key, "num_speculative_tokens") ? &k
                       : !strcmp(key, "prompt_lookup_min")   ? &nmin
                       : !strcmp(key, "prompt_lookup_max")   ? &nmax
                                                             : NULL;
        if (!strcmp(key, "method")) {
            if (!json_is_string(v)) {
                fprintf(stderr, "%s: --speculative-config: \"method\" must be a string\n", prog);
                goto out;
            }
            method = json_string_value(v);
        } else if (dst) {
            if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > 1024) {
                fprintf(stderr, "%s: --speculative-config: \"%s\" must be a positive integer\n", prog, key);
                goto out;
            }
            *dst = (int32_t)json_integer_value(v);
        } else {
            fprintf(stderr,
                    "%s: --speculative-config: unknown key \"%s\" (known: method, num_speculative_tokens, "
                    "prompt_lookup_max, prompt_lookup_min)\n", prog, key);
            goto out;
        }
    }
    if (!method) {
        fprintf(stderr, "%s: --speculative-config: \"method\" is required (\"ngram\" or \"mtp\")\n", prog);
        goto out;
    }
    const bool mtp = !strcmp(method, "mtp") || !strcmp(method, "deepseek_mtp") || !strcmp(method, "nemotron_h_mtp");
    if (strcmp(method, "ngram") != 0 && !mtp) {
        fprintf(stderr, "%s: --speculative-config: method \"%s\" is unknown; use \"ngram\" or \"mtp\"\n",
                prog, method);
        goto out;
    }
    if (mtp && (nmin >= 0 || nmax >= 0)) {
        fprintf(stderr, "%s: --speculative-config: prompt_lookup_min and prompt_lookup_max apply to method "
                        "\"ngram\", not \"%s\"\n", prog, method);
        goto out;
    }
    if (k < 0) {
        fprintf(stderr, "%s: --speculative-config: \"num_speculative_tokens\" is required\n", prog);
        goto out;
    }
    if (k > KR_SPEC_MAX_TOKENS) {
        fprintf(stderr, "%s: --speculative-config: \"num_speculative_tokens\" %d is more than %d\n", prog, k,
                KR_SPEC_MAX_TOKENS);
        goto out;
    }
    /* vLLM's rule: both unset means 5; one set gives the other its value */
    if (nmin < 0 && nmax < 0) {
        nmin = nmax = 5;
    } else if (nmin < 0) {
        nmin = nmax;
    } else if (nmax < 0) {
        nmax = nmin;
    }
    if (nmin > nmax) {
        fprintf(stderr, "%s: --speculative-config: prompt_lookup_min %d is more than prompt_lookup_max %d\n",
                prog, nmin, nmax);
        goto out;
    }
    *method_out = mtp ? KR_SPEC_MTP : KR_SPEC_NGRAM;
    *k_out = k;
    *nmin_out = nmin;
    *nmax_out = nmax;
    rc = 0;
out:
    json_decref(j);
    return rc;
}

/* --defaults-json: the flags as getopt knows them and the defaults kr_serve_opts_default sets, so that
 * manifests are checked against the binary rather than against a copy of this list (tests/deploy). */
static void print_defaults(const struct option *opts)
{
    struct kr_serve_opts d;
    kr_serve_opts_default(&d);
    json_t *flags = json_object();
    for (const struct option *p = opts; p->name; p++) {
        const bool value = p->has_arg == required_argument;
        json_object_set_new(flags, p->name, json_pack("{s:b,s:n}", "value", value, "default"));
    }
    struct {
        const char *name;
        json_t *v;
    } defs[] = {
        {"host", json_string(d.host)},
        {"port", json_integer(d.port)},
        {"max-num-seqs", json_integer(d.max_num_seqs)},
        {"max-num-batched-tokens", json_integer(d.max_num_batched_tokens)},
        {"block-size", json_integer(d.block_size)},
        {"prefix-cache-state-interval", json_integer(d.prefix_state_interval)},
        {"max-request-bytes", json_integer((json_int_t)d.max_body_bytes)},
        {"max-request-memory", json_integer((json_int_t)d.max_request_memory)},
        {"max-connections", json_integer(d.max_connections)},
        {"max-connections-per-ip", json_integer(d.max_connections_per_ip)},
        {"header-timeout", json_real(d.header_timeout_s)},
        {"body-timeout", json_real(d.body_timeout_s)},
        {"shutdown-timeout", json_real(d.drain_timeout_s)},
        {"device", json_string(d.device)},
        {"gpu-memory-utilization", json_real(d.gpu_mem_util)},
        {"tensor-parallel-size", json_integer(d.tensor_parallel_size)},
        {"nnodes", json_integer(d.nnodes)},
        {"node-rank", json_integer(d.node_rank)},
        {"master-addr", json_string(d.master_addr)},
        {"master-port", json_integer(d.master_port)},
        {"join-timeout", json_real(d.join_timeout_s)},
        {"enable-prefix-caching", json_boolean(d.prefix_caching)},
        {"batch-invariant", json_boolean(d.batch_invariant)},
    };
    for (size_t i = 0; i < sizeof defs / sizeof defs[0]; i++) {
        json_object_set_new(json_object_get(flags, defs[i].name), "default", defs[i].v);
    }
    json_t *root = json_pack("{s:o}", "flags", flags);
    json_dumpf(root, stdout, JSON_INDENT(1) | JSON_SORT_KEYS);
    fputc('\n', stdout);
    json_decref(root);
}

static int parse_size(const char *opt, const char *s, size_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    unsigned long long mul = 1;
    if (*end == 'K' || *end == 'k') {
        mul = 1ull << 10;
        end++;
    } else if (*end == 'M' || *end == 'm') {
        mul = 1ull << 20;
        end++;
    } else if (*end == 'G' || *end == 'g') {
        mul = 1ull << 30;
        end++;
    }
    if (end == s || *end || errno || v == 0 || v > (unsigned long long)SIZE_MAX / mul) {
        fprintf(stderr, "krait serve: %s: expected a positive size such as 512M, got \"%s\"\n", opt, s);
        return -1;
    }
    *out = (size_t)(v * mul);
    return 0;
}

static int parse_i32(const char *opt, const char *s, long lo, long hi, int32_t *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) {
        fprintf(stderr, "krait serve: %s: expected an integer in [%ld, %ld], got \"%s\"\n", opt, lo, hi, s);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

#define MAX_KEYS 64
#define MAX_CORS 64

/* A CORS list flag: a JSON list of strings, as vLLM takes it ('["https://a.example", "*"]'), or
 * a comma-separated one. Entries live for the process (list is static). */
static int parse_cors_list(const char *opt, const char *arg, const char **list, int *n)
{
    *n = 0;
    if (arg[strspn(arg, " \t")] == '[') {
        json_error_t je;
        json_t *j = json_loads(arg, 0, &je);
        size_t i;
        json_t *v;
        if (!json_is_array(j) || json_array_size(j) > MAX_CORS) {
            fprintf(stderr, "krait serve: %s: expected a JSON list of at most %d strings, got '%s'\n", opt, MAX_CORS,
                    arg);
            json_decref(j);
            return -1;
        }
        json_array_foreach(j, i, v)
        {
            char *e = json_is_string(v) && json_string_length(v) ? kr_strdup(json_string_value(v)) : NULL;
            if (!e) {
                fprintf(stderr, "krait serve: %s: entry %zu is not a non-empty string\n", opt, i);
                json_decref(j);
                return -1;
            }
            list[(*n)++] = e;
        }
        json_decref(j);
        return 0;
    }
    for (const char *p = arg; *p;) {
        p += strspn(p, " \t,");
        size_t l = strcspn(p, ",");
        while (l && (p[l - 1] == ' ' || p[l - 1] == '\t')) {
            l--;
        }
        if (l) {
            char *e = *n < MAX_CORS ? kr_strndup(p, l) : NULL;
            if (!e) {
                fprintf(stderr, "krait serve: %s: at most %d entries\n", opt, MAX_CORS);
                return -1;
            }
            list[(*n)++] = e;
        }
        p += strcspn(p, ",");
    }
    return 0;
}

static int add_key(const char **keys, int *n, const char *k)
{
    if (*n >= MAX_KEYS) {
        fprintf(stderr, "krait serve: at most %d API keys\n", MAX_KEYS);
        return -1;
    }
    if (!*k) {
        fprintf(stderr, "krait serve: an API key cannot be empty\n");
        return -1;
    }
    keys[(*n)++] = k;
    return 0;
}

static int read_key_file(const char *path, const char **keys, int *n)
{
    FILE *fp = fopen(path, "r");
    if (!fp) {
        fprintf(stderr, "krait serve: --api-key-file %s: %s\n", path, strerror(errno));
        return -1;
    }
    char line[1024];
    while (fgets(line, sizeof line, fp)) {
        size_t l = strcspn(line, "\r\n");
        line[l] = 0;
        if (l == 0 || line[0] == '#') {
            continue;
        }
        char *k = kr_strdup(line); /* lives for the process */
        if (!k || add_key(keys, n, k) != 0) {
            fclose(fp);
            return -1;
        }
    }
    fclose(fp);
    return 0;
}

int kr_serve_main(int argc, char **argv)
{
    struct kr_serve_opts o;
    kr_serve_opts_default(&o);
    static const char *keys[MAX_KEYS];
    int n_keys = 0;
    int32_t v;
    /* environment first: flags override it */
    const char *env;
    if ((env = getenv("KRAIT_HOST"))) {
        o.host = env;
    }
    if ((env = getenv("KRAIT_PORT")) && parse_i32("KRAIT_PORT", env, 0, 65535, &v) == 0) {
        o.port = v;
    }
    if ((env = getenv("KRAIT_API_KEY")) && *env && add_key(keys, &n_keys, env) != 0) {
        return 2;
    }
    if ((env = getenv("KRAIT_DEVICE")) && *env) {
        o.device = env;
    }
    if ((env = getenv("KRAIT_THREADS")) && parse_i32("KRAIT_THREADS", env, 0, 4096, &v) == 0) {
        o.threads = v;
    }
    /* a LeaderWorkerSet's pod: its group's size, its index in it, the leader's address */
    if ((env = getenv("LWS_GROUP_SIZE")) && *env && parse_i32("LWS_GROUP_SIZE", env, 1, 64, &v) == 0) {
        o.nnodes = v;
    }
    if ((env = getenv("LWS_WORKER_INDEX")) && *env && parse_i32("LWS_WORKER_INDEX", env, 0, 63, &v) == 0) {
        o.node_rank = v;
    }
    if ((env = getenv("LWS_LEADER_ADDRESS")) && *env) {
        o.master_addr = env;
    }
    if ((env = getenv("KRAIT_LOG_LEVEL"))) {
        enum kr_log_level lvl;
        if (kr_log_parse_level(env, &lvl) == 0) {
            kr_log_set_level(lvl);
        }
    }
    enum {
        O_HOST = 256, O_PORT, O_KEY, O_KEYFILE, O_NAME, O_MAXLEN, O_SEQS, O_TOKENS, O_QUEUED, O_CACHE, O_BLOCK,
        O_TOK, O_TPL, O_SKIP, O_TOKIDS, O_BODY, O_SHUTDOWN, O_THREADS, O_LOG, O_PORTFILE, O_HELP, O_DEVICE, O_GPUMEM, O_INDEXER,
        O_ALLOW_LONG, O_HELP_ENV, O_BATCH_INVARIANT, O_PREFIX, O_NO_PREFIX, O_PREFIX_INTERVAL, O_PREFIX_SNAPS,
        O_REQMEM, O_MAXCONN, O_MAXCONN_IP, O_HDR_TIMEOUT, O_BODY_TIMEOUT, O_ORIGINS, O_METHODS, O_HEADERS,
        O_CREDENTIALS, O_TP, O_QUANT, O_KVDT, O_NNODES, O_NODE_RANK, O_MASTER_ADDR, O_MASTER_PORT, O_JOIN_TIMEOUT,
        O_DEFAULTS_JSON, O_SPEC,
    };
    static const char *origins[MAX_CORS], *methods[MAX_CORS], *headers[MAX_CORS];
    static const struct option longopts[] = {
        {"host", required_argument, NULL, O_HOST},
        {"port", required_argument, NULL, O_PORT},
        {"api-key", required_argument, NULL, O_KEY},
        {"api-key-file", required_argument, NULL, O_KEYFILE},
        {"served-model-name", required_argument, NULL, O_NAME},
        {"max-model-len", required_argument, NULL, O_MAXLEN},
        {"allow-long-max-model-len", no_argument, NULL, O_ALLOW_LONG},
        {"max-num-seqs", required_argument, NULL, O_SEQS},
        {"max-num-batched-tokens", required_argument, NULL, O_TOKENS},
        {"max-queued-requests", required_argument, NULL, O_QUEUED},
        {"cache-memory-bytes", required_argument, NULL, O_CACHE},
        {"block-size", required_argument, NULL, O_BLOCK},
        {"enable-prefix-caching", no_argument, NULL, O_PREFIX},
        {"batch-invariant", no_argument, NULL, O_BATCH_INVARIANT},
        {"no-enable-prefix-caching", no_argument, NULL, O_NO_PREFIX},
        {"prefix-cache-state-interval", required_argument, NULL, O_PREFIX_INTERVAL},
        {"prefix-cache-snapshots", required_argument, NULL, O_PREFIX_SNAPS},
        {"tokenizer", required_argument, NULL, O_TOK},
        {"chat-template", required_argument, NULL, O_TPL},
        {"skip-tokenizer-init", no_argument, NULL, O_SKIP},
        {"return-tokens-as-token-ids", no_argument, NULL, O_TOKIDS},
        {"max-request-bytes", required_argument, NULL, O_BODY},
        {"max-request-memory", required_argument, NULL, O_REQMEM},
        {"max-connections", required_argument, NULL, O_MAXCONN},
        {"max-connections-per-ip", required_argument, NULL, O_MAXCONN_IP},
        {"header-timeout", required_argument, NULL, O_HDR_TIMEOUT},
        {"body-timeout", required_argument, NULL, O_BODY_TIMEOUT},
        {"shutdown-timeout", required_argument, NULL, O_SHUTDOWN},
        {"threads", required_argument, NULL, O_THREADS},
        {"tensor-parallel-size", required_argument, NULL, O_TP},
        {"quantization", required_argument, NULL, O_QUANT},
        {"nnodes", required_argument, NULL, O_NNODES},
        {"node-rank", required_argument, NULL, O_NODE_RANK},
        {"master-addr", required_argument, NULL, O_MASTER_ADDR},
        {"master-port", required_argument, NULL, O_MASTER_PORT},
        {"join-timeout", required_argument, NULL, O_JOIN_TIMEOUT},
        {"device", required_argument, NULL, O_DEVICE},
        {"gpu-memory-utilization", required_argument, NULL, O_GPUMEM},
        {"indexer", required_argument, NULL, O_INDEXER},
        {"kv-cache-dtype", required_argument, NULL, O_KVDT},
        {"log-level", required_argument, NULL, O_LOG},
        {"port-file", required_argument, NULL, O_PORTFILE},
        {"allowed-origins", required_argument, NULL, O_ORIGINS},
        {"allowed-methods", required_argument, NULL, O_METHODS},
        {"allowed-headers", required_argument, NULL, O_HEADERS},
        {"allow-credentials", no_argument, NULL, O_CREDENTIALS},
        {"help", no_argument, NULL, O_HELP},
        {"help-env", no_argument, NULL, O_HELP_ENV},
        {"defaults-json", no_argument, NULL, O_DEFAULTS_JSON},
        {"speculative-config", required_argument, NULL, O_SPEC},
        {NULL, 0, NULL, 0},
    };
    for (int i = 2; i < argc; i++) { /* vLLM's short name */
        if (!strcmp(argv[i], "-tp")) {
            argv[i] = (char *)"--tensor-parallel-size";
        } else if (!strncmp(argv[i], "-tp=", 4)) {
            static char buf[64];
            snprintf(buf, sizeof buf, "--tensor-parallel-size=%.40s", argv[i] + 4);
            argv[i] = buf;
        }
    }
    optind = 2;
    int ch;
    while ((ch = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        enum kr_log_level lvl;
        size_t sz;
        switch (ch) {
        case O_HOST:
            o.host = optarg;
            break;
        case O_PORT:
            if (parse_i32("--port", optarg, 0, 65535, &v)) {
                return 2;
            }
            o.port = v;
            break;
        case O_KEY:
            if (add_key(keys, &n_keys, optarg)) {
                return 2;
            }
            break;
        case O_KEYFILE:
            if (read_key_file(optarg, keys, &n_keys)) {
                return 2;
            }
            break;
        case O_NAME:
            o.served_model_name = optarg;
            break;
        case O_MAXLEN:
            if (parse_i32("--max-model-len", optarg, 1, INT32_MAX, &o.max_model_len)) {
                return 2;
            }
            break;
        case O_ALLOW_LONG:
            o.allow_long_max_model_len = true;
            break;
        case O_SEQS:
            if (parse_i32("--max-num-seqs", optarg, 1, 1 << 20, &o.max_num_seqs)) {
                return 2;
            }
            break;
        case O_TOKENS:
            if (parse_i32("--max-num-batched-tokens", optarg, 1, 1 << 24, &o.max_num_batched_tokens)) {
                return 2;
            }
            break;
        case O_QUEUED:
            if (parse_i32("--max-queued-requests", optarg, 0, 1 << 24, &o.max_queued_requests)) {
                return 2;
            }
            break;
        case O_CACHE:
            if (parse_size("--cache-memory-bytes", optarg, &o.cache_bytes)) {
                return 2;
            }
            break;
        case O_BLOCK:
            if (parse_i32("--block-size", optarg, 1, 4096, &o.block_size)) {
                return 2;
            }
            break;
        case O_PREFIX:
            o.prefix_caching = true;
            break;
        case O_BATCH_INVARIANT:
            o.batch_invariant = true;
            break;
        case O_NO_PREFIX:
            o.prefix_caching = false;
            break;
        case O_PREFIX_INTERVAL:
            if (parse_i32("--prefix-cache-state-interval", optarg, 0, 1 << 24, &o.prefix_state_interval)) {
                return 2;
            }
            break;
        case O_PREFIX_SNAPS:
            if (parse_i32("--prefix-cache-snapshots", optarg, 0, 1 << 20, &o.prefix_snapshots)) {
                return 2;
            }
            break;
        case O_TOK:
            o.tokenizer_dir = optarg;
            break;
        case O_TPL:
            o.chat_template_file = optarg;
            break;
        case O_SKIP:
            o.skip_tokenizer_init = true;
            break;
        case O_TOKIDS:
            o.return_tokens_as_token_ids = true;
            break;
        case O_BODY:
            if (parse_size("--max-request-bytes", optarg, &sz)) {
                return 2;
            }
            o.max_body_bytes = sz;
            break;
        case O_REQMEM:
            if (parse_size("--max-request-memory", optarg, &sz)) {
                return 2;
            }
            o.max_request_memory = sz;
            break;
        case O_MAXCONN:
            if (parse_i32("--max-connections", optarg, 16, 1 << 20, &v)) {
                return 2;
            }
            o.max_connections = v;
            break;
        case O_MAXCONN_IP:
            if (parse_i32("--max-connections-per-ip", optarg, 0, 1 << 20, &v)) {
                return 2;
            }
            o.max_connections_per_ip = v;
            break;
        case O_HDR_TIMEOUT:
            if (parse_i32("--header-timeout", optarg, 0, 86400, &v)) {
                return 2;
            }
            o.header_timeout_s = v;
            break;
        case O_BODY_TIMEOUT:
            if (parse_i32("--body-timeout", optarg, 0, 86400, &v)) {
                return 2;
            }
            o.body_timeout_s = v;
            break;
        case O_SHUTDOWN:
            if (parse_i32("--shutdown-timeout", optarg, 0, 86400, &v)) {
                return 2;
            }
            o.drain_timeout_s = v;
            break;
        case O_THREADS:
            if (parse_i32("--threads", optarg, 0, 4096, &v)) {
                return 2;
            }
            o.threads = v;
            break;
        case O_TP:
            if (parse_i32("--tensor-parallel-size", optarg, 1, 64, &v)) {
                return 2;
            }
            o.tensor_parallel_size = v;
            break;
        case O_QUANT:
            if (strcmp(optarg, "fp8") != 0 && strcmp(optarg, "none") != 0) {
                fprintf(stderr, "krait serve: --quantization: \"%s\" (expected fp8 or none)\n", optarg);
                return 2;
            }
            o.fp8_weights = !strcmp(optarg, "fp8");
            break;
        case O_NNODES:
            if (parse_i32("--nnodes", optarg, 1, 64, &v)) {
                return 2;
            }
            o.nnodes = v;
            break;
        case O_NODE_RANK:
            if (parse_i32("--node-rank", optarg, 0, 63, &v)) {
                return 2;
            }
            o.node_rank = v;
            break;
        case O_MASTER_ADDR:
            if (!*optarg || strlen(optarg) > 255) {
                fprintf(stderr, "krait serve: --master-addr: expected a host name or address\n");
                return 2;
            }
            o.master_addr = optarg;
            break;
        case O_MASTER_PORT:
            if (parse_i32("--master-port", optarg, 1, 65535, &v)) {
                return 2;
            }
            o.master_port = v;
            break;
        case O_JOIN_TIMEOUT:
            if (parse_i32("--join-timeout", optarg, 1, 86400, &v)) {
                return 2;
            }
            o.join_timeout_s = v;
            break;
        case O_DEVICE:
            o.device = optarg;
            break;
        case O_KVDT: {
            enum kr_kv_cache_dtype mode;
            if (!kr_kv_cache_dtype_parse(optarg, &mode)) {
                fprintf(stderr, "krait serve: --kv-cache-dtype: expected auto, bf16 or fp8, got '%s'\n", optarg);
                return 2;
            }
            o.kv_cache_dtype = (int)mode;
            break;
        }
        case O_INDEXER: {
            enum kr_indexer mode;
            if (!kr_indexer_parse(optarg, &mode)) {
                fprintf(stderr, "krait serve: --indexer: expected auto, bf16 or fp8, got '%s'\n", optarg);
                return 2;
            }
            o.indexer = (int)mode;
            break;
        }
        case O_GPUMEM: {
            char *end = NULL;
            const double f = strtod(optarg, &end);
            if (!end || *end || !(f > 0.05 && f <= 1.0)) {
                fprintf(stderr, "krait serve: --gpu-memory-utilization: expected a number in (0.05, 1], got '%s'\n",
                        optarg);
                return 2;
            }
            o.gpu_mem_util = f;
            break;
        }
        case O_LOG:
            if (kr_log_parse_level(optarg, &lvl)) {
                fprintf(stderr, "krait serve: --log-level: expected debug, info, warn or error\n");
                return 2;
            }
            kr_log_set_level(lvl);
            break;
        case O_PORTFILE:
            o.port_file = optarg;
            break;
        case O_ORIGINS:
            if (parse_cors_list("--allowed-origins", optarg, origins, &o.n_cors_origins)) {
                return 2;
            }
            o.cors_origins = origins;
            break;
        case O_METHODS:
            if (parse_cors_list("--allowed-methods", optarg, methods, &o.n_cors_methods)) {
                return 2;
            }
            o.cors_methods = methods;
            break;
        case O_HEADERS:
            if (parse_cors_list("--allowed-headers", optarg, headers, &o.n_cors_headers)) {
                return 2;
            }
            o.cors_headers = headers;
            break;
        case O_CREDENTIALS:
            o.cors_credentials = true;
            break;
        case O_HELP:
            usage(stdout);
            return 0;
        case O_HELP_ENV:
            kr_switches_print(stdout);
            return 0;
        case O_DEFAULTS_JSON:
            print_defaults(longopts);
            return 0;
        case O_SPEC:
            if (kr_spec_parse("krait serve", optarg, &o.spec_method, &o.spec_k, &o.spec_ngram_min,
                              &o.spec_ngram_max)) {
                return 2;
            }
            break;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        o.model_dir = argv[optind++];
    } else if ((env = getenv("KRAIT_MODEL"))) {
        o.model_dir = env;
    }
    if (optind < argc) {
        fprintf(stderr, "krait serve: unexpected argument \"%s\"\n", argv[optind]);
        return 2;
    }
    if (!o.model_dir) {
        fprintf(stderr, "krait serve: MODEL_DIR is required\n\n");
        usage(stderr);
        return 2;
    }
    if (o.prefix_caching && o.prefix_state_interval % o.block_size != 0) {
        fprintf(stderr, "krait serve: --prefix-cache-state-interval (%d) must be a multiple of --block-size (%d)\n",
                o.prefix_state_interval, o.block_size);
        return 2;
    }
    if (o.batch_invariant && o.spec_method != 0) {
        fprintf(stderr, "krait serve: --batch-invariant with --speculative-config: a verification step computes "
                        "tokens as a chunk, plain decoding one at a time, so results would depend on the drafts; "
                        "use one or the other\n");
        return 2;
    }
    if (o.node_rank >= o.nnodes) {
        fprintf(stderr, "krait serve: --node-rank %d is not a node of --nnodes %d (0..%d)\n", o.node_rank, o.nnodes,
                o.nnodes - 1);
        return 2;
    }
    if (o.nnodes > 1 && (o.tensor_parallel_size < o.nnodes || o.tensor_parallel_size % o.nnodes != 0)) {
        fprintf(stderr,
                "krait serve: --tensor-parallel-size %d is not a multiple of --nnodes %d: every node holds the same "
                "number of ranks (--tensor-parallel-size counts the ranks of all nodes together)\n",
                o.tensor_parallel_size, o.nnodes);
        return 2;
    }
    o.api_keys = keys;
    o.n_api_keys = n_keys;
    return kr_serve_run(&o);
}
