/* Start-up wiring of `krait serve` (boot.h): the backend, then on the loader thread the model,
 * tokenizer, chat template, workspace and engine. */
#include "boot.h"

#include "alloc.h"
#include "clock.h"
#include "comm.h"
#include "log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/prctl.h>
#include <sys/random.h>

int kr_boot_check(const struct kr_serve_opts *o)
{
    if (o->max_model_len > 0) {
        /* beyond the checkpoint's trained length: refused before anything is loaded, unless asked */
        struct kr_model_config mc;
        struct kr_err cerr = {0};
        if (kr_model_config_load(&mc, o->model_dir, &cerr) == KR_OK && o->max_model_len > mc.max_pos) {
            if (!o->allow_long_max_model_len) {
                KR_LOG_ERROR("--max-model-len %d is more than the %lld positions %s/config.json declares "
                             "(max_position_embeddings); lower it, or pass --allow-long-max-model-len to serve "
                             "positions beyond the trained length",
                             o->max_model_len, (long long)mc.max_pos, o->model_dir);
                return 2;
            }
            KR_LOG_WARN("--max-model-len %d is more than the %lld positions the checkpoint was trained for "
                        "(--allow-long-max-model-len): outputs past position %lld may be poor",
                        o->max_model_len, (long long)mc.max_pos, (long long)mc.max_pos);
        }
    }
    return 0;
}

/* ---- several nodes (engine/cluster.h) ---------------------------------------------------------------------- */

/* This node's ranks of a group spread over --nnodes processes: a backend each, joined to a group
 * whose other ranks are reached through the cluster's link. The leader listens already. */
static enum kr_status init_node(struct kr_boot *b, const struct kr_serve_opts *o, struct kr_err *err)
{
    b->tp = o->tensor_parallel_size;
    int cuda_dev;
    KR_TRY(kr_backend_parse_device(o->device, &cuda_dev, err));
    const struct kr_cluster_opts co = {.nnodes = o->nnodes, .node_rank = o->node_rank, .master_addr = o->master_addr,
                                       .master_port = o->master_port, .tp = b->tp, .join_timeout_s = o->join_timeout_s};
    KR_TRY(kr_cluster_create(&co, &b->cluster, err));
    const int per = kr_cluster_per_node(b->cluster), first = kr_cluster_first_rank(b->cluster);
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const int all = o->threads > 0 ? o->threads : (int)(cores > 0 ? cores : 1);
    const int each = all / per > 0 ? all / per : 1;
    /* [tp] entries as on one node, this node's at the front */
    b->rank_be = kr_calloc((size_t)b->tp, sizeof *b->rank_be);
    b->rank_m = kr_calloc((size_t)b->tp, sizeof *b->rank_m);
    if (!b->rank_be || !b->rank_m) {
        return kr_err_set(err, KR_ERR_NOMEM, "out of memory");
    }
    if (cuda_dev >= 0) {
        /* a GPU each; they join the group (NCCL, with the leader's id) once the nodes have met */
        b->cuda_nodes = true;
        KR_TRY(kr_backend_cuda_create_ranks(cuda_dev, per, b->rank_be, err));
        b->be = b->rank_be[0];
        KR_LOG_INFO("tensor parallel: %d ranks over %d nodes; node %d holds ranks %d..%d on CUDA devices %d..%d",
                    b->tp, o->nnodes, o->node_rank, first, first + per - 1, cuda_dev, cuda_dev + per - 1);
        return KR_OK;
    }
    if (kr_host_comm_create_part(b->tp, first, per, kr_cluster_link(b->cluster), &b->comm) != KR_OK) {
        return kr_err_set(err, KR_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < per; i++) {
        KR_TRY(kr_backend_create(o->device, each, &b->rank_be[i], err));
        KR_TRY(kr_backend_set_tp(b->rank_be[i], first + i, b->tp, b->comm, err));
    }
    b->be = b->rank_be[0];
    KR_LOG_INFO("tensor parallel: %d ranks over %d nodes; node %d holds ranks %d..%d on %s, %d threads each", b->tp,
                o->nnodes, o->node_rank, first, first + per - 1, o->device ? o->device : "the default device", each);
    return KR_OK;
}

/* The ranks this process holds. */
static int local_ranks(const struct kr_boot *b)
{
    return b->cluster ? kr_cluster_per_node(b->cluster) : b->tp;
}

/* The cluster's abort hook: NCCL's collectives do not go through the cluster's link, so a node
 * that left would leave them waiting (until the watchdog's timeout). */
static void abort_cuda_group(void *user)
{
    struct kr_boot *b = user;
    kr_backend_cuda_group_abort(b->cuda_comm);
}

/* The bootstrap: this node's configuration, compared with the leader's; then the leader's group id
 * (the start-up blob) to every node, with the NCCL id when the ranks are on GPUs. */
static enum kr_status join_nodes(struct kr_boot *b, struct kr_err *err)
{
    const struct kr_serve_opts *o = &b->o;
    uint64_t cfg_fp = 0, w_fp = 0;
    KR_TRY(kr_cluster_config_fingerprint(o->model_dir, &cfg_fp, err));
    KR_TRY(kr_cluster_weights_fingerprint(o->model_dir, &w_fp, err));
    const struct kr_wire_field f[] = {
        {"protocol", KR_WIRE_VERSION},
        {"node-rank", o->node_rank},
        {"nnodes", o->nnodes},
        {"tensor-parallel-size", o->tensor_parallel_size},
        {"config.json fingerprint", (int64_t)cfg_fp},
        {"weights fingerprint", (int64_t)w_fp},
        {"max-model-len", o->max_model_len},
        {"allow-long-max-model-len", o->allow_long_max_model_len},
        {"max-num-seqs", o->max_num_seqs},
        {"max-num-batched-tokens", o->max_num_batched_tokens},
        {"block-size", o->block_size},
        {"cache-memory-bytes", (int64_t)o->cache_bytes},
        {"enable-prefix-caching", o->prefix_caching},
        {"prefix-cache-state-interval", o->prefix_state_interval},
        {"prefix-cache-snapshots", o->prefix_snapshots},
        {"indexer", o->indexer},
        {"kv-cache-dtype", o->kv_cache_dtype},
        {"CUDA ranks", b->cuda_nodes},
        {"quantization fp8", o->fp8_weights},
        {"batch-invariant", o->batch_invariant},
        {"speculative-config method", o->spec_method}, /* MTP: every node loads its share of the head */
        {"speculative-config num_speculative_tokens", o->spec_k},
    };
    KR_TRY(kr_cluster_join(b->cluster, f, (int32_t)(sizeof f / sizeof f[0]), err));
    /* the blob: a group id of 16 bytes, then (CUDA ranks) the NCCL id the leader made */
    uint8_t id[16 + 512] = {0};
    size_t len = 16;
    if (o->node_rank == 0) {
        if (getrandom(id, 16, 0) != 16) {
            memset(id, 0, 16);
        }
        if (b->cuda_nodes) {
            size_t nlen = 0;
            KR_TRY(kr_backend_cuda_nccl_id(id + 16, sizeof id - 16, &nlen, err));
            len += nlen;
        }
    }
    KR_TRY(kr_cluster_bcast_blob(b->cluster, id, &len, sizeof id, err));
    if (b->cuda_nodes) {
        if (len <= 16) {
            return kr_err_set(err, KR_ERR_FORMAT, "the leader sent no NCCL id: is it serving on CUDA too?");
        }
        KR_TRY(kr_backend_cuda_join(b->rank_be, kr_cluster_per_node(b->cluster), kr_cluster_first_rank(b->cluster),
                                    b->tp, id + 16, &b->cuda_comm, err));
        kr_cluster_on_abort(b->cluster, abort_cuda_group, b); /* a node that left releases NCCL here */
    }
    char hex[33];
    for (size_t i = 0; i < len && i < 16; i++) {
        snprintf(hex + 2 * i, 3, "%02x", id[i]);
    }
    hex[2 * (len < 16 ? len : 16)] = 0;
    KR_LOG_INFO("cluster: group %s: %d nodes joined", hex, o->nnodes);
    return KR_OK;
}

/* A worker's thread: the leader's steps on this node's ranks until the group ends. */
static void *node_main(void *arg)
{
    prctl(PR_SET_NAME, "kr-node", 0, 0, 0);
    struct kr_boot *b = arg;
    const struct kr_serve_opts *o = &b->o;
    const int64_t max_pos = b->m->cfg.max_pos;
    const struct kr_cluster_reserve rs = {
        .n_tok = (int64_t)o->max_num_batched_tokens + o->max_num_seqs, /* as the engine reserves its ranks */
        .n_out = o->max_num_seqs,
        .n_seq = o->max_num_seqs,
        .max_ctx = o->max_model_len > 0 && o->max_model_len <= max_pos ? o->max_model_len : max_pos,
        .block_size = o->block_size,
    };
    b->node_st = kr_cluster_serve(b->cluster, b->rank_m, local_ranks(b), &rs, &b->node_err);
    atomic_store(&b->node_done, true);
    if (b->node_ended) {
        b->node_ended(b->loaded_user);
    }
    return NULL;
}

bool kr_boot_group_healthy(struct kr_boot *b)
{
    return !b->cluster || (kr_cluster_healthy(b->cluster) && !atomic_load(&b->node_done));
}

void kr_boot_cancel(struct kr_boot *b)
{
    if (b->cluster && b->loader_running) {
        kr_cluster_abort(b->cluster, "a node is shutting down while the group starts");
    }
}

/* Stops a worker's loop (it tells the leader when it is still in the group) and frees the cluster. */
static void node_free(struct kr_boot *b)
{
    if (b->node_running) {
        char why[64];
        snprintf(why, sizeof why, "node %d is shutting down", b->o.node_rank);
        if (!atomic_load(&b->node_done)) {
            kr_cluster_abort(b->cluster, why); /* wakes its loop, and the leader hears why */
        }
        pthread_join(b->node_thread, NULL);
        b->node_running = false;
    }
}

enum kr_status kr_boot_init(struct kr_boot *b, const struct kr_serve_opts *o, struct kr_err *err)
{
    memset(b, 0, sizeof *b);
    b->o = *o;
    if (o->tensor_parallel_size > 1) {
        /* before CUDA starts: kernels loaded lazily make the loading thread wait for the whole device,
         * and a rank's collective spinning there for a peer blocked on that load never ends */
        const char *ml = getenv("CUDA_MODULE_LOADING");
        if (ml && strcmp(ml, "EAGER") != 0) {
            KR_LOG_WARN("tensor parallel: CUDA_MODULE_LOADING=%s replaced by EAGER (lazy loading can deadlock ranks)",
                        ml);
        }
        setenv("CUDA_MODULE_LOADING", "EAGER", 1);
    }
    if (o->nnodes > 1) {
        return init_node(b, o, err);
    }
    b->tp = o->tensor_parallel_size > 1 ? o->tensor_parallel_size : 1;
    if (b->tp == 1) {
        return kr_backend_create(o->device, o->threads, &b->be, err);
    }
    int cuda_dev;
    KR_TRY(kr_backend_parse_device(o->device, &cuda_dev, err));
    if (cuda_dev >= 0) { /* CUDA ranks: a device each, NCCL and peer-memory collectives */
        b->rank_be = kr_calloc((size_t)b->tp, sizeof *b->rank_be);
        b->rank_m = kr_calloc((size_t)b->tp, sizeof *b->rank_m);
        if (!b->rank_be || !b->rank_m) {
            return kr_err_set(err, KR_ERR_NOMEM, "out of memory");
        }
        KR_TRY(kr_backend_cuda_create_group(cuda_dev, b->tp, b->rank_be, &b->cuda_comm, err));
        b->be = b->rank_be[0];
        return KR_OK;
    }
    /* one backend per rank, joined to one group; CPU ranks share the threads */
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const int all = o->threads > 0 ? o->threads : (int)(cores > 0 ? cores : 1);
    const int per = all / b->tp > 0 ? all / b->tp : 1;
    b->rank_be = kr_calloc((size_t)b->tp, sizeof *b->rank_be);
    b->rank_m = kr_calloc((size_t)b->tp, sizeof *b->rank_m);
    if (!b->rank_be || !b->rank_m || kr_host_comm_create(b->tp, &b->comm) != KR_OK) {
        return kr_err_set(err, KR_ERR_NOMEM, "out of memory");
    }
    for (int r = 0; r < b->tp; r++) {
        KR_TRY(kr_backend_create(o->device, per, &b->rank_be[r], err));
        KR_TRY(kr_backend_set_tp(b->rank_be[r], r, b->tp, b->comm, err)); /* names the size */
    }
    b->be = b->rank_be[0];
    KR_LOG_INFO("tensor parallel: %d ranks on %s, %d threads each", b->tp, o->device ? o->device : "the default device",
                per);
    return KR_OK;
}

/* --kv-cache-dtype on one rank's model: fp8 stores the DSA index keys in FP8, which an explicit
 * --indexer bf16 contradicts. */
static enum kr_status set_kv_cache_dtype(const struct kr_boot *s, struct kr_model *m, struct kr_err *err)
{
    if (s->o.kv_cache_dtype == KR_KV_CACHE_FP8 && s->o.indexer == KR_INDEXER_BF16 &&
        kr_model_config_count(&m->cfg, KR_LAYER_DSA) > 0) {
        return kr_err_set(err, KR_ERR_INVAL, "--kv-cache-dtype fp8 stores the DSA index keys in FP8, which "
                          "--indexer bf16 contradicts (use --indexer fp8 or auto)");
    }
    return kr_model_set_kv_cache_dtype(m, (enum kr_kv_cache_dtype)s->o.kv_cache_dtype, err);
}

/* Loads ranks 1.. (rank 0 is loaded first, with progress); each fails the load with its rank named. */
static enum kr_status load_other_ranks(struct kr_boot *s, struct kr_err *err)
{
    for (int r = 1; r < local_ranks(s); r++) {
        const struct kr_model_load_opts lo = {.mtp = s->o.spec_method == KR_SPEC_MTP}; /* its share of the head too */
        enum kr_status st = kr_model_load_opts(s->o.model_dir, s->rank_be[r], &lo, &s->rank_m[r], err);
        if (st == KR_OK && s->o.indexer != KR_INDEXER_AUTO) {
            st = kr_model_set_indexer(s->rank_m[r], (enum kr_indexer)s->o.indexer, err);
        }
        if (st == KR_OK) {
            st = set_kv_cache_dtype(s, s->rank_m[r], err);
        }
        if (st != KR_OK) {
            char why[sizeof err->msg];
            snprintf(why, sizeof why, "%s", err->msg);
            return kr_err_set(err, st, "rank %d: %s", r + (s->cluster ? kr_cluster_first_rank(s->cluster) : 0), why);
        }
        if (s->o.max_model_len > s->rank_m[r]->cfg.max_pos && s->o.allow_long_max_model_len) {
            s->rank_m[r]->cfg.max_pos = s->o.max_model_len;
        }
    }
    return KR_OK;
}

/* ---- loading (its own thread: /health answers 503 meanwhile) ------------------------------------------------ */

static void progress(void *user, int done, int total)
{
    (void)user;
    if (!isatty(2)) { /* a log, not a terminal: one line at the end */
        if (done == total) {
            KR_LOG_INFO("loaded weights of %d layers", total);
        }
        return;
    }
    const int width = 40, fill = total ? done * width / total : width;
    char bar[64];
    for (int i = 0; i < width; i++) {
        bar[i] = i < fill ? '#' : '.';
    }
    bar[width] = 0;
    fprintf(stderr, "\rloading weights [%s] %3d%%%s", bar, total ? done * 100 / total : 100, done == total ? "\n" : "");
    fflush(stderr);
}

/* Compiled constraints kept for requests that repeat them (each holds its filled mask cache, a few
 * hundred KB to 2 MB: docs/STRUCTURED_OUTPUTS.md), least recently used out first. */
#define GRAMMAR_CACHE_SIZE 64

/* Constrained decoding: the tokenizer's tokens in a trie for masks, with the ids the engine ends a
 * sequence at (config.json's eos_token_id, which lists a chat model's end-of-turn ids too; the
 * tokenizer's EOS when the config names none) allowed where the text can end; and the cache of
 * compiled grammars. */
static enum kr_status structured_outputs_init(struct kr_boot *s, struct kr_err *err)
{
    const struct kr_model_config *mc = &s->m->cfg;
    const int32_t n_tok = kr_tokenizer_n_vocab(s->tok);
    int32_t ends[KR_MAX_EOS + 1], n_end = 0;
    for (int32_t i = 0; i < mc->n_eos; i++) {
        if (mc->eos_ids[i] >= 0 && mc->eos_ids[i] < n_tok) {
            ends[n_end++] = mc->eos_ids[i];
        }
    }
    if (n_end == 0 && kr_tokenizer_eos_id(s->tok) >= 0 && kr_tokenizer_eos_id(s->tok) < n_tok) {
        ends[n_end++] = kr_tokenizer_eos_id(s->tok);
    }
    const double t0 = kr_clock_s();
    KR_TRY(kr_grammar_vocab_create(s->tok, ends, n_end, &s->gvocab, err));
    if (kr_grammar_cache_create(GRAMMAR_CACHE_SIZE, &s->grammars) != KR_OK) {
        return kr_err_set(err, KR_ERR_NOMEM, "out of memory");
    }
    KR_LOG_INFO("structured outputs: %d token ids in the mask trie (%.0f ms), %d end ids, a cache of %d compiled "
                "constraints", n_tok, (kr_clock_s() - t0) * 1e3, n_end, GRAMMAR_CACHE_SIZE);
    return KR_OK;
}

/* The loader thread: everything that takes long, then `loaded`. */
static void *loader_main(void *arg)
{
    prctl(PR_SET_NAME, "kr-loader", 0, 0, 0); /* a name for top -H and /proc/PID/task */
    struct kr_boot *s = arg;
    struct kr_err err = {0};
    if (s->cluster && join_nodes(s, &err) != KR_OK) {
        KR_LOG_ERROR("cannot join the group of %d nodes: %s", s->o.nnodes, err.msg);
        s->load_failed = true;
        s->loaded(s->loaded_user);
        return NULL;
    }
    /* --quantization and --batch-invariant: every rank of this process, before its weights are read */
    for (int r = 0; r < (s->rank_be ? local_ranks(s) : 1); r++) {
        kr_backend_t rb = s->rank_be ? s->rank_be[r] : s->be;
        if (kr_backend_set_fp8_weights(rb, s->o.fp8_weights, &err) != KR_OK ||
            kr_backend_set_batch_invariant(rb, s->o.batch_invariant, &err) != KR_OK) {
            KR_LOG_ERROR("cannot load the model: %s", err.msg);
            s->load_failed = true;
            s->loaded(s->loaded_user);
            return NULL;
        }
    }
    const struct kr_model_load_opts lo = {.progress = progress, .mtp = s->o.spec_method == KR_SPEC_MTP};
    enum kr_status st = kr_model_load_opts(s->o.model_dir, s->be, &lo, &s->m, &err);
    if (st == KR_OK && s->o.indexer != KR_INDEXER_AUTO) {
        if ((st = kr_model_set_indexer(s->m, (enum kr_indexer)s->o.indexer, &err)) != KR_OK) {
            kr_model_free(s->m);
            s->m = NULL;
        }
    }
    if (st == KR_OK && (st = set_kv_cache_dtype(s, s->m, &err)) != KR_OK) {
        kr_model_free(s->m);
        s->m = NULL;
    }
    if (st == KR_OK && s->tp > 1) {
        s->rank_m[0] = s->m;
        st = load_other_ranks(s, &err);
    }
    if (st != KR_OK) {
        KR_LOG_ERROR("cannot load the model: %s", err.msg[0] ? err.msg : kr_status_str(st));
        s->load_failed = true;
        s->loaded(s->loaded_user);
        return NULL;
    }
    if (s->o.max_model_len > s->m->cfg.max_pos && s->o.allow_long_max_model_len) {
        s->m->cfg.max_pos = s->o.max_model_len; /* accepted at start with a warning */
    }
    if (kr_boot_is_worker(s)) {
        /* no tokenizer, no engine: the leader's steps, on a thread of their own */
        if (pthread_create(&s->node_thread, NULL, node_main, s) != 0) {
            KR_LOG_ERROR("cannot start the node's thread");
            s->load_failed = true;
        } else {
            s->node_running = true;
        }
        s->loaded(s->loaded_user);
        return NULL;
    }
    if (!s->o.skip_tokenizer_init) {
        const char *tdir = s->o.tokenizer_dir ? s->o.tokenizer_dir : s->o.model_dir;
        st = kr_tokenizer_load(tdir, NULL, &s->tok, &err);
        if (st != KR_OK) {
            KR_LOG_ERROR("cannot load the tokenizer from %s: %s (use --skip-tokenizer-init to serve token ids only)",
                         tdir, err.msg);
            s->load_failed = true;
            s->loaded(s->loaded_user);
            return NULL;
        }
        if (kr_chat_load(s->tok, s->o.chat_template_file, &s->chat, &err) != KR_OK) {
            KR_LOG_ERROR("cannot load the chat template: %s", err.msg);
            s->load_failed = true;
            s->loaded(s->loaded_user);
            return NULL;
        }
        if (!s->chat && kr_chat_builtin(s->m->cfg.model_type, &s->chat, &err) != KR_OK) {
            KR_LOG_ERROR("cannot prepare the chat format: %s", err.msg);
            s->load_failed = true;
            s->loaded(s->loaded_user);
            return NULL;
        }
        if (!s->chat) {
            KR_LOG_WARN("the tokenizer has no chat template: /v1/chat/completions will answer 400");
        } else if (!s->o.chat_template_file && !kr_tokenizer_chat_template(s->tok)) {
            KR_LOG_INFO("no chat template: chat prompts are written in %s's own format", s->m->cfg.model_type);
        }
        if (structured_outputs_init(s, &err) != KR_OK) {
            KR_LOG_ERROR("cannot prepare constrained decoding: %s", err.msg);
            s->load_failed = true;
            s->loaded(s->loaded_user);
            return NULL;
        }
    }
    struct kr_engine_config cfg;
    kr_engine_config_default(&cfg);
    cfg.max_num_seqs = s->o.max_num_seqs;
    cfg.max_num_batched_tokens = s->o.max_num_batched_tokens;
    cfg.max_queued_requests = s->o.max_queued_requests;
    cfg.max_model_len = s->o.max_model_len;
    cfg.block_size = s->o.block_size;
    cfg.prefix_caching = s->o.prefix_caching;
    cfg.batch_invariant = s->o.batch_invariant;
    cfg.prefix_state_interval = s->o.prefix_state_interval;
    cfg.prefix_snapshots = s->o.prefix_snapshots;
    cfg.spec = (struct kr_spec_config){.method = (enum kr_spec_method)s->o.spec_method, .k = s->o.spec_k,
                                       .ngram_min = s->o.spec_ngram_min, .ngram_max = s->o.spec_ngram_max};
    cfg.cache_bytes = s->o.cache_bytes;
    cfg.cluster = s->cluster;
    /* the step workspace first, so that the cache budget sees what is left */
    const int64_t max_len = s->o.max_model_len > 0 ? s->o.max_model_len : s->m->cfg.max_pos;
    if (kr_model_reserve(s->m, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_num_seqs, max_len,
                         cfg.block_size) != KR_OK) {
        KR_LOG_ERROR("cannot reserve the forward workspace (%d tokens per step)", cfg.max_num_batched_tokens);
        s->load_failed = true;
        s->loaded(s->loaded_user);
        return NULL;
    }
    if (cfg.cache_bytes == 0) {
        size_t free_b = 0, total_b = 0;
        if (kr_backend_mem_info(s->be, &free_b, &total_b) == KR_OK && total_b > 0) {
            const double keep = (1.0 - s->o.gpu_mem_util) * (double)total_b;
            cfg.cache_bytes = (double)free_b > keep + (double)(256u << 20) ? (size_t)((double)free_b - keep)
                                                                          : (size_t)256 << 20;
            /* ranks sharing rank 0's device (KRAIT_TP_ONE_DEVICE) share its memory: each takes its part */
            int shared = 1;
            for (int r = 1; r < local_ranks(s); r++) {
                shared += !strcmp(kr_backend_name(s->rank_be[r]), kr_backend_name(s->be));
            }
            cfg.cache_bytes /= (size_t)shared;
            KR_LOG_INFO("cache budget %.2f GiB (%.0f%% of %.1f GiB device memory; %.2f GiB free before caches)",
                        (double)cfg.cache_bytes / (1 << 30), s->o.gpu_mem_util * 100, (double)total_b / (1 << 30),
                        (double)free_b / (1 << 30));
        } else {
            cfg.cache_bytes = (size_t)512 << 20;
        }
    }
    if ((s->tp > 1 ? kr_engine_create_group(s->rank_m, local_ranks(s), &cfg, &s->eng, &err)
                   : kr_engine_create(s->m, &cfg, &s->eng, &err)) != KR_OK) {
        KR_LOG_ERROR("cannot start the engine: %s", err.msg);
        s->load_failed = true;
        s->loaded(s->loaded_user);
        return NULL;
    }
    s->max_model_len = s->o.max_model_len > 0 && s->o.max_model_len < s->m->cfg.max_pos ? s->o.max_model_len
                                                                                          : (int32_t)s->m->cfg.max_pos;
    s->loaded(s->loaded_user);
    return NULL;
}


enum kr_status kr_boot_load_start(struct kr_boot *b, void (*loaded)(void *user), void *user)
{
    b->loaded = loaded;
    b->loaded_user = user;
    if (pthread_create(&b->loader, NULL, loader_main, b) != 0) {
        return KR_ERR_INTERNAL;
    }
    b->loader_running = true;
    return KR_OK;
}

void kr_boot_load_join(struct kr_boot *b)
{
    if (b->loader_running) {
        pthread_join(b->loader, NULL);
        b->loader_running = false;
    }
}

void kr_boot_stop_engine(struct kr_boot *b)
{
    kr_engine_free(b->eng);
    b->eng = NULL;
}

void kr_boot_free(struct kr_boot *b)
{
    kr_boot_stop_engine(b); /* the engine's matchers use the vocabulary: they go first */
    node_free(b);
    kr_grammar_cache_destroy(b->grammars);
    kr_grammar_vocab_destroy(b->gvocab);
    kr_chat_free(b->chat);
    kr_tokenizer_free(b->tok);
    if (b->tp > 1) {
        for (int r = 0; b->rank_m && r < b->tp; r++) {
            kr_model_free(b->rank_m[r]); /* [0] is b->m */
        }
        for (int r = 0; b->rank_be && r < b->tp; r++) {
            kr_backend_free(b->rank_be[r]); /* [0] is b->be */
        }
        kr_host_comm_free(b->comm);
        kr_backend_cuda_group_free(b->cuda_comm);
        kr_free(b->rank_m);
        kr_free(b->rank_be);
    } else {
        kr_model_free(b->m);
        kr_backend_free(b->be);
    }
    kr_cluster_free(b->cluster); /* after the ranks: the group's link is the cluster's */
    memset(b, 0, sizeof *b);
}
