#include "cli.h"

#include "alloc.h"
#include "cache.h"
#include "cli-output.h"
#include "clock.h"
#include "log.h"
#include "model.h"
#include "plan.h"
#include "runner.h"
#include "server.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KR_CLI_MAX_PROMPT (1 << 20)

static void usage(FILE *f)
{
    fprintf(f,
            "usage: krait <command> [options]\n"
            "\n"
            "commands:\n"
            "  serve      OpenAI-compatible HTTP server (krait serve --help)\n"
            "  generate   greedy generation from token ids, printed as JSON\n"
            "  logprobs   log-probabilities of every prompt token, printed as JSON\n"
            "  plan       a checkpoint's memory plan per GPU from its headers (krait plan --help)\n"
            "  help       this text\n"
            "\n"
            "options:\n"
            "  --model DIR          checkpoint directory (config.json + *.safetensors)\n"
            "  --prompt-ids LIST    comma-separated token ids, e.g. 1,2,3\n"
            "  --max-tokens N       tokens to generate (generate; default 16)\n"
            "  --ignore-eos         do not stop at the model's EOS ids (generate)\n"
            "  --top N              top-N alternatives per position (logprobs; default 0)\n"
            "  --chunk N            prefill chunk size in tokens (default: whole prompt)\n"
            "  --threads N          CPU threads (default: all cores)\n"
            "  --device DEV         cpu (default) | cuda | cuda:N | auto\n"
            "  --log-level LEVEL    debug | info | warn | error (default info)\n");
}

/* Parses "1,2,3" into a new array (caller frees). Returns 0, or -1 with a message on stderr. */
static int parse_ids(const char *s, int32_t **out, int32_t *n)
{
    size_t cap = 16;
    int32_t *ids = kr_malloc(cap * sizeof *ids);
    *n = 0;
    if (!ids) {
        return -1;
    }
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr, "krait: --prompt-ids: \"%s\" is not a comma-separated list of token ids\n", s);
            kr_free(ids);
            return -1;
        }
        if ((size_t)*n == cap) {
            if (cap >= KR_CLI_MAX_PROMPT) {
                fprintf(stderr, "krait: --prompt-ids: more than %d ids\n", KR_CLI_MAX_PROMPT);
                kr_free(ids);
                return -1;
            }
            int32_t *ni = kr_realloc(ids, 2 * cap * sizeof *ids);
            if (!ni) {
                kr_free(ids);
                return -1;
            }
            ids = ni;
            cap *= 2;
        }
        ids[(*n)++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    if (*n == 0) {
        fprintf(stderr, "krait: --prompt-ids: at least one id is needed\n");
        kr_free(ids);
        return -1;
    }
    *out = ids;
    return 0;
}

static int parse_int(const char *opt, const char *s, long lo, long hi, int32_t *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) {
        fprintf(stderr, "krait: %s: expected an integer in [%ld, %ld], got \"%s\"\n", opt, lo, hi, s);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

struct opts {
    const char *model;
    const char *ids;
    int32_t max_tokens, top, chunk, threads;
    const char *device;
    bool ignore_eos;
};

static int run(const char *cmd, const struct opts *o)
{
    int rc = 1;
    int32_t *ids = NULL, n = 0;
    kr_backend_t be = NULL;
    struct kr_model *m = NULL;
    struct kr_cache *c = NULL;
    float *lp = NULL;
    int32_t *gen = NULL;
    char *json = NULL;
    struct kr_err err = {0};
    enum kr_status st;

    if (parse_ids(o->ids, &ids, &n) != 0) {
        goto out;
    }
    if ((st = kr_backend_create(o->device, o->threads, &be, &err)) != KR_OK) {
        fprintf(stderr, "krait: %s\n", err.msg[0] ? err.msg : kr_status_str(st));
        goto out;
    }
    if ((st = kr_model_load(o->model, be, &m, &err)) != KR_OK) {
        fprintf(stderr, "krait: cannot load model: %s\n", err.msg[0] ? err.msg : kr_status_str(st));
        goto out;
    }
    const bool gen_cmd = !strcmp(cmd, "generate");
    const int32_t total = n + (gen_cmd ? o->max_tokens : 0);
    const int32_t bs = 64;
    if ((st = kr_cache_create(m, 1, (total + bs - 1) / bs, bs, &c)) != KR_OK) {
        fprintf(stderr, "krait: cannot allocate caches: %s\n", kr_status_str(st));
        goto out;
    }
    const int64_t V = m->cfg.vocab;
    if (gen_cmd) {
        gen = kr_malloc((size_t)(o->max_tokens ? o->max_tokens : 1) * sizeof *gen);
        lp = kr_malloc((size_t)(o->max_tokens ? o->max_tokens : 1) * sizeof *lp);
        if (!gen || !lp) {
            goto out;
        }
        int32_t n_gen = 0;
        double t0 = kr_clock_s() * 1e3;
        st = kr_run_greedy(m, c, ids, n, o->chunk, o->max_tokens, o->ignore_eos, gen, lp, &n_gen, &err);
        double t1 = kr_clock_s() * 1e3;
        if (st != KR_OK) {
            fprintf(stderr, "krait: generation failed: %s\n", err.msg[0] ? err.msg : kr_status_str(st));
            goto out;
        }
        struct kr_generate_result r = {
            .model = o->model,
            .prompt = ids,
            .n_prompt = n,
            .tokens = gen,
            .logprobs = lp,
            .n_tokens = n_gen,
            .finish_reason = n_gen < o->max_tokens ? "stop" : "length",
            .elapsed_ms = t1 - t0,
        };
        json = kr_cli_generate_json(&r);
    } else {
        lp = kr_malloc((size_t)n * (size_t)V * sizeof *lp);
        if (!lp) {
            fprintf(stderr, "krait: out of memory for %d x %lld log-probabilities\n", n, (long long)V);
            goto out;
        }
        if ((st = kr_run_prompt_logprobs(m, c, ids, n, o->chunk, lp, &err)) != KR_OK) {
            fprintf(stderr, "krait: forward pass failed: %s\n", err.msg[0] ? err.msg : kr_status_str(st));
            goto out;
        }
        json = kr_cli_logprobs_json(o->model, ids, n, lp, V, o->top);
    }
    if (!json) {
        fprintf(stderr, "krait: out of memory\n");
        goto out;
    }
    printf("%s\n", json);
    rc = 0;
out:
    kr_free(json);
    kr_free(gen);
    kr_free(lp);
    kr_cache_free(c);
    kr_model_free(m);
    kr_backend_free(be);
    kr_free(ids);
    return rc;
}

int kr_cli_main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "help") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "serve")) {
        return kr_serve_main(argc, argv);
    }
    if (!strcmp(cmd, "plan")) {
        return kr_plan_main(argc, argv);
    }
    if (strcmp(cmd, "generate") != 0 && strcmp(cmd, "logprobs") != 0) {
        fprintf(stderr, "krait: unknown command \"%s\"\n\n", cmd);
        usage(stderr);
        return 2;
    }
    struct opts o = {.max_tokens = 16, .top = 0, .chunk = 0, .threads = 0, .device = "cpu"};
    static const struct option longopts[] = {
        {"model", required_argument, NULL, 'm'},  {"prompt-ids", required_argument, NULL, 'p'},
        {"max-tokens", required_argument, NULL, 'n'}, {"top", required_argument, NULL, 't'},
        {"chunk", required_argument, NULL, 'c'},  {"threads", required_argument, NULL, 'j'},
        {"device", required_argument, NULL, 'd'},
        {"ignore-eos", no_argument, NULL, 'e'},   {"log-level", required_argument, NULL, 'l'},
        {"help", no_argument, NULL, 'h'},         {NULL, 0, NULL, 0},
    };
    optind = 2;
    int ch;
    while ((ch = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        enum kr_log_level lvl;
        switch (ch) {
        case 'm':
            o.model = optarg;
            break;
        case 'p':
            o.ids = optarg;
            break;
        case 'n':
            if (parse_int("--max-tokens", optarg, 0, 1 << 20, &o.max_tokens)) {
                return 2;
            }
            break;
        case 't':
            if (parse_int("--top", optarg, 0, 1 << 16, &o.top)) {
                return 2;
            }
            break;
        case 'c':
            if (parse_int("--chunk", optarg, 0, 1 << 24, &o.chunk)) {
                return 2;
            }
            break;
        case 'j':
            if (parse_int("--threads", optarg, 0, 4096, &o.threads)) {
                return 2;
            }
            break;
        case 'd':
            o.device = optarg;
            break;
        case 'e':
            o.ignore_eos = true;
            break;
        case 'l':
            if (kr_log_parse_level(optarg, &lvl)) {
                fprintf(stderr, "krait: --log-level: expected debug, info, warn or error\n");
                return 2;
            }
            kr_log_set_level(lvl);
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "krait: unexpected argument \"%s\"\n", argv[optind]);
        return 2;
    }
    if (!o.model || !o.ids) {
        fprintf(stderr, "krait %s: --model and --prompt-ids are required\n", cmd);
        return 2;
    }
    return run(cmd, &o);
}
