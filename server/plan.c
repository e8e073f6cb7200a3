/* `krait plan`: the memory plan of a checkpoint at a tensor-parallel size, from its config.json and
 * safetensors headers alone (no weight is read, nothing is allocated on a device): each rank's
 * weights as the loader would place them (its own sharding rules, run against the planning
 * backend), the cache bytes per token of each pool and per sequence of the state pool, and how many
 * sequences of a given length fit in the memory left on each GPU. With --speculative-config, as
 * serve takes it: the MTP head's weights and cache rows, and the drafts' Mamba states. */
#include "plan.h"

#include "alloc.h"
#include "backend.h"
#include "cache.h"
#include "log.h"
#include "engine.h"
#include "model.h"
#include "server.h"

#include <jansson.h>

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What cudaMemGetInfo reports as the total of an H200 (139.8 GiB). */
#define H200_BYTES 150110011392ull

struct plan_opts {
    const char *model;
    int tp;
    int64_t max_len;       /* 0: the model's */
    int32_t block;
    uint64_t gpu_bytes;
    double util;
    bool cpu;              /* fp32 weights and caches, as the CPU backend holds them */
    bool fp8;              /* --quantization fp8: matrices as FP8 codes with block scales */
    bool kv8;              /* --kv-cache-dtype fp8: the FP8 caches' layout (fp8_ds_mla) */
    bool json;
    int spec_method;       /* enum kr_spec_method (0: no --speculative-config) */
    int32_t spec_k;
};

static void plan_usage(FILE *f)
{
    fprintf(f,
            "usage: krait plan MODEL_DIR [options]\n"
            "\n"
            "The memory plan of a checkpoint from its config.json and safetensors headers (no weight is read):\n"
            "the weights each tensor-parallel rank holds, the cache bytes per token and per sequence, and how\n"
            "many sequences of --max-model-len tokens fit on each GPU.\n"
            "\n"
            "options:\n"
            "  --tensor-parallel-size N, -tp N  ranks (default 1)\n"
            "  --max-model-len L                sequence length to fit (default: the model's)\n"
            "  --block-size B                   cache block in tokens (default 16)\n"
            "  --gpu-memory-bytes X             memory of one GPU (default 150110011392: an H200)\n"
            "  --gpu-memory-utilization F       share of it for weights + caches (default 0.9)\n"
            "  --device cuda|cpu                element sizes of that backend (default cuda: bf16)\n"
            "  --quantization fp8|none          fp8: matrices as FP8 codes + 128x128 block scales (as serve's flag)\n"
            "  --kv-cache-dtype auto|bf16|fp8   fp8: K/V of a byte, MLA latents as fp8_ds_mla (kv_lora e4m3 + an fp32\n"
            "                                   scale per 128 + rope bf16), DSA index keys e4m3 + fp32 scales\n"
            "  --speculative-config JSON        as serve takes it: \"mtp\" counts the MTP head's weights and cache rows;\n"
            "                                   either method counts num_speculative_tokens more Mamba states a sequence\n"
            "  --json                           one JSON object instead of the table\n");
}

static int parse_u64(const char *what, const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end = NULL;
    errno = 0;
    const unsigned long long v = strtoull(s, &end, 10);
    if (!*s || *s == '-' || errno || !end || *end || v < lo || v > hi) {
        fprintf(stderr, "krait plan: %s: \"%s\" is not an integer in %llu..%llu\n", what, s, (unsigned long long)lo,
                (unsigned long long)hi);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_opts(int argc, char **argv, struct plan_opts *o)
{
    *o = (struct plan_opts){.tp = 1, .block = 16, .gpu_bytes = H200_BYTES, .util = 0.9};
    /* vLLM's short spelling */
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "-tp")) {
            argv[i] = (char *)"--tensor-parallel-size";
        }
    }
    static const struct option lo[] = {
        {"tensor-parallel-size", required_argument, NULL, 't'},
        {"max-model-len", required_argument, NULL, 'l'},
        {"block-size", required_argument, NULL, 'b'},
        {"gpu-memory-bytes", required_argument, NULL, 'g'},
        {"gpu-memory-utilization", required_argument, NULL, 'u'},
        {"device", required_argument, NULL, 'd'},
        {"quantization", required_argument, NULL, 'q'},
        {"kv-cache-dtype", required_argument, NULL, 'k'},
        {"json", no_argument, NULL, 'j'},
        {"speculative-config", required_argument, NULL, 's'},
        {"help", no_argument, NULL, 'h'},
        {0},
    };
    optind = 2;
    int ch;
    uint64_t v;
    while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (ch) {
        case 't':
            if (parse_u64("--tensor-parallel-size", optarg, 1, 64, &v)) {
                return 2;
            }
            o->tp = (int)v;
            break;
        case 'l':
            if (parse_u64("--max-model-len", optarg, 1, (uint64_t)1 << 24, &v)) {
                return 2;
            }
            o->max_len = (int64_t)v;
            break;
        case 'b':
            if (parse_u64("--block-size", optarg, 1, 1024, &v)) {
                return 2;
            }
            o->block = (int32_t)v;
            break;
        case 'g':
            if (parse_u64("--gpu-memory-bytes", optarg, (uint64_t)1 << 20, (uint64_t)1 << 50, &o->gpu_bytes)) {
                return 2;
            }
            break;
        case 'u': {
            char *end = NULL;
            o->util = strtod(optarg, &end);
            if (!end || *end || !(o->util > 0 && o->util <= 1)) {
                fprintf(stderr, "krait plan: --gpu-memory-utilization: \"%s\" is not a number in (0, 1]\n", optarg);
                return 2;
            }
            break;
        }
        case 'd':
            if (strcmp(optarg, "cuda") && strcmp(optarg, "cpu")) {
                fprintf(stderr, "krait plan: --device: \"%s\" (expected cuda or cpu)\n", optarg);
                return 2;
            }
            o->cpu = !strcmp(optarg, "cpu");
            break;
        case 'q':
            if (strcmp(optarg, "fp8") && strcmp(optarg, "none")) {
                fprintf(stderr, "krait plan: --quantization: \"%s\" (expected fp8 or none)\n", optarg);
                return 2;
            }
            o->fp8 = !strcmp(optarg, "fp8");
            break;
        case 'k':
            if (strcmp(optarg, "fp8") && strcmp(optarg, "bf16") && strcmp(optarg, "auto")) {
                fprintf(stderr, "krait plan: --kv-cache-dtype: \"%s\" (expected auto, bf16 or fp8)\n", optarg);
                return 2;
            }
            o->kv8 = !strcmp(optarg, "fp8");
            break;
        case 'j':
            o->json = true;
            break;
        case 's': {
            int32_t nmin, nmax;
            if (kr_spec_parse("krait plan", optarg, &o->spec_method, &o->spec_k, &nmin, &nmax)) {
                return 2;
            }
            break;
        }
        case 'h':
            plan_usage(stdout);
            return 1;
        default:
            plan_usage(stderr);
            return 2;
        }
    }
    if (optind != argc - 1) {
        fprintf(stderr, "krait plan: expected one checkpoint directory\n\n");
        plan_usage(stderr);
        return 2;
    }
    o->model = argv[optind];
    return 0;
}

/* The cache's parts per token (bytes) of one rank's model `m`, elements of `elt` bytes. */
struct pools {
    uint64_t kv, latent, indexer; /* per token: attention K and V, MLA latent rows, DSA indexer keys */
    uint64_t state;               /* per sequence: Mamba conv + SSM states */
    uint64_t block;               /* per cache block (kr_cache_unit_bytes) */
};

/* kv8: the FP8 caches' layout, as the CUDA backend holds it (krk/ops.h krk_fp8_latent_bytes,
 * krk_fp8_key_bytes): K/V a byte per value (one scale per tensor), a latent row as DeepSeek's
 * fp8_ds_mla (kv_lora e4m3, an fp32 scale per 128 of them, the rope part bf16: 656 B for
 * DeepSeek-V3.2), an index key as e4m3 with an fp32 scale per 128; the Mamba states as they are. */
static struct pools pools_of(const struct kr_model *m, int32_t block, size_t elt, bool kv8)
{
    const struct kr_model_config *c = &m->cfg;
    struct pools p = {0};
    p.kv = (uint64_t)m->n_attn * 2 * (uint64_t)(c->n_kv_head * c->head_dim) * (kv8 ? 1 : elt);
    for (int32_t i = 0; i < c->n_layer; i++) {
        const char t = c->pattern[i];
        if (t == KR_LAYER_DSA || t == KR_LAYER_MLA) {
            p.latent += kv8 ? (uint64_t)krk_fp8_latent_bytes(c->kv_lora, c->qk_rope)
                            : (uint64_t)(c->kv_lora + c->qk_rope) * elt;
        }
        if (t == KR_LAYER_DSA && kr_model_config_topk_source(c, i) == i) { /* layers sharing a selection keep no keys */
            p.indexer += kv8 ? (uint64_t)krk_fp8_key_bytes(c->idx_head_dim) : (uint64_t)c->idx_head_dim * elt;
        }
    }
    for (int32_t j = 0; j < m->n_mtp; j++) { /* the MTP head's attention blocks keep rows of their own */
        const struct kr_layer *L = &m->layers[c->n_layer + j];
        if (L->type == KR_LAYER_DSA || L->type == KR_LAYER_MLA) {
            p.latent += kv8 ? (uint64_t)krk_fp8_latent_bytes(c->kv_lora, c->qk_rope)
                            : (uint64_t)(c->kv_lora + c->qk_rope) * elt;
            if (L->mla.has_indexer) {
                p.indexer += kv8 ? (uint64_t)krk_fp8_key_bytes(c->idx_head_dim) : (uint64_t)c->idx_head_dim * elt;
            }
        }
    }
    size_t slot = 0, blk = 0;
    kr_cache_unit_bytes(m, block, &slot, &blk);
    p.state = slot;
    /* a block holds block tokens of every pool (kr_cache_unit_bytes counts the backend's elements) */
    p.block = kv8 ? (uint64_t)block * (p.kv + p.latent + p.indexer) : blk;
    return p;
}

static double gib(uint64_t b)
{
    return (double)b / (double)(1ull << 30);
}

int kr_plan_main(int argc, char **argv)
{
    struct plan_opts o;
    const int prc = parse_opts(argc, argv, &o);
    if (prc) {
        return prc == 1 ? 0 : prc;
    }
    kr_log_set_level(KR_LOG_LEVEL_WARN); /* the loader's lines are not the plan */
    const size_t welt = o.fp8 ? 1 : o.cpu ? 4 : 2, celt = o.cpu ? 4 : 2;
    uint64_t *w = kr_calloc((size_t)o.tp, sizeof *w);
    if (!w) {
        fprintf(stderr, "krait plan: out of memory\n");
        return 1;
    }
    struct kr_model *m0 = NULL;
    kr_backend_t be0 = NULL;
    uint64_t w_max = 0, w_sum = 0;
    int rc = 0;
    for (int r = 0; r < o.tp && rc == 0; r++) {
        struct kr_err err = {0};
        kr_backend_t be = kr_backend_plan_create(welt, celt);
        struct kr_model *m = NULL;
        if (!be) {
            fprintf(stderr, "krait plan: out of memory\n");
            rc = 1;
            break;
        }
        if (kr_backend_set_tp(be, r, o.tp, NULL, &err) != KR_OK ||
            kr_backend_set_fp8_weights(be, o.fp8, &err) != KR_OK ||
            kr_model_load_opts(o.model, be, &(struct kr_model_load_opts){.mtp = o.spec_method == KR_SPEC_MTP}, &m,
                               &err) != KR_OK) {
            fprintf(stderr, "krait plan: %s (rank %d of %d)\n", err.msg, r, o.tp);
            kr_backend_free(be);
            rc = 1;
            break;
        }
        w[r] = kr_backend_plan_bytes(be);
        w_max = w[r] > w_max ? w[r] : w_max;
        w_sum += w[r];
        if (r == 0) {
            m0 = m;
            be0 = be;
        } else {
            kr_model_free(m);
            kr_backend_free(be);
        }
    }
    if (rc == 0) {
        const struct kr_model_config *c = &m0->cfg;
        const int64_t len = o.max_len > 0 ? o.max_len : c->max_pos;
        const struct pools p = pools_of(m0, o.block, celt, o.kv8);
        const uint64_t per_tok = p.block / (uint64_t)o.block;
        const uint64_t blocks = (uint64_t)((len + o.block - 1) / o.block);
        const uint64_t drafts = o.spec_method ? p.state * (uint64_t)o.spec_k : 0; /* the drafts' Mamba states */
        const uint64_t per_seq = p.state + drafts + blocks * p.block;
        const double usable = (double)o.gpu_bytes * o.util;
        const uint64_t left = usable > (double)w_max ? (uint64_t)(usable - (double)w_max) : 0;
        const uint64_t fit = per_seq ? left / per_seq : 0;
        const char *fits = w_max > (uint64_t)usable ? "no: the weights alone exceed the usable memory" : NULL;
        if (o.json) {
            json_t *ws = json_array();
            for (int r = 0; r < o.tp; r++) {
                json_array_append_new(ws, json_integer((json_int_t)w[r]));
            }
            json_t *j = json_pack("{s:s, s:s, s:s, s:i, s:s, s:s, s:s, s:o, s:I, s:I, s:{s:I, s:I, s:I, s:I}, s:I, s:i, s:I, "
                                  "s:I, s:I, s:I, s:f, s:I, s:I}",
                                  "model", o.model, "model_type", c->model_type, "pattern", c->pattern,
                                  "tensor_parallel_size", o.tp, "device", o.cpu ? "cpu" : "cuda", "quantization",
                                  o.fp8 ? "fp8" : "none", "kv_cache_dtype", o.kv8 ? "fp8" : o.cpu ? "fp32" : "bf16",
                                  "weights_bytes", ws,
                                  "weights_bytes_max", (json_int_t)w_max, "weights_bytes_total", (json_int_t)w_sum,
                                  "cache_bytes_per_token", "kv", (json_int_t)p.kv, "latent", (json_int_t)p.latent,
                                  "indexer", (json_int_t)p.indexer, "total", (json_int_t)per_tok,
                                  "state_bytes_per_sequence", (json_int_t)p.state, "block_size", (int)o.block,
                                  "block_bytes", (json_int_t)p.block, "max_model_len", (json_int_t)len,
                                  "bytes_per_sequence", (json_int_t)per_seq, "gpu_memory_bytes",
                                  (json_int_t)o.gpu_bytes, "gpu_memory_utilization", o.util, "cache_bytes",
                                  (json_int_t)left, "sequences", (json_int_t)fit);
            if (j) {
                json_object_set_new(j, "speculative",
                                    o.spec_method ? json_pack("{s:s, s:i, s:I, s:b}", "method",
                                                              o.spec_method == KR_SPEC_MTP ? "mtp" : "ngram",
                                                              "num_speculative_tokens", (int)o.spec_k,
                                                              "draft_state_bytes_per_sequence", (json_int_t)drafts,
                                                              "mtp_head", m0->n_mtp > 0)
                                                  : json_null());
            }
            char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
            if (!text) {
                fprintf(stderr, "krait plan: out of memory\n");
                rc = 1;
            } else {
                printf("%s\n", text);
            }
            kr_free(text);
            json_decref(j);
        } else {
            printf("%s: %s, %d layers \"%s\", tensor-parallel size %d, %s weights, %s caches\n", o.model,
                   c->model_type, c->n_layer, c->pattern, o.tp,
                   o.fp8 ? "FP8 (codes + 128x128 block scales; embedding and LM head bf16)"
                   : o.cpu ? "fp32 (CPU)"
                           : "bf16 (CUDA)",
                   o.kv8 ? "FP8 (fp8_ds_mla latents, the layout the CUDA backend holds)"
                   : o.cpu ? "fp32"
                           : "bf16");
            printf("weights per rank:      %.2f GiB (largest of %d ranks; %.2f GiB in all%s)\n", gib(w_max), o.tp,
                   gib(w_sum), o.fp8 ? "" : "; FP8 checkpoints are dequantized to bf16 at load");
            printf("cache per token:       %llu B per rank (K/V %llu, MLA latent %llu, DSA indexer keys %llu)\n",
                   (unsigned long long)per_tok, (unsigned long long)p.kv, (unsigned long long)p.latent,
                   (unsigned long long)p.indexer);
            printf("state per sequence:    %llu B per rank (Mamba conv + SSM)\n", (unsigned long long)p.state);
            if (o.spec_method) {
                printf("drafts:                %s, %d tokens a step: %llu B per sequence per rank for their Mamba "
                       "states%s\n",
                       o.spec_method == KR_SPEC_MTP ? "the MTP head" : "n-gram", (int)o.spec_k,
                       (unsigned long long)drafts,
                       m0->n_mtp ? "; the head's weights and cache rows are counted above" : "");
            }
            printf("one sequence of %lld:  %.2f MiB per rank (%llu blocks of %d tokens + its state%s)\n",
                   (long long)len, (double)per_seq / (1 << 20), (unsigned long long)blocks, (int)o.block,
                   drafts ? " + its drafts' states" : "");
            printf("per GPU:               %.2f GiB x %.2f usable, %.2f GiB left for caches\n", gib(o.gpu_bytes),
                   o.util, gib(left));
            if (fits) {
                printf("fits:                  %s\n", fits);
            } else {
                printf("fits:                  %llu sequences of %lld tokens at once (prefix-cache snapshots and "
                       "the step workspace not counted; `krait serve` logs its own plan)\n",
                       (unsigned long long)fit, (long long)len);
            }
        }
    }
    kr_model_free(m0);
    kr_backend_free(be0);
    kr_free(w);
    return rc;
}
