#include "backend.h"

#include "backend-impl.h"
#include "log.h"
#include "switches.h"

#include <stdlib.h>
#include <string.h>

/* Thin wrappers: the forward pass calls these, never the vtable directly. */

void kr_backend_free(kr_backend_t be)
{
    if (be) {
        be->iface.free(be);
    }
}

const char *kr_backend_name(kr_backend_t be)
{
    return be->iface.name(be);
}

size_t kr_backend_act_size(kr_backend_t be)
{
    return be->iface.act_size(be);
}

size_t kr_backend_cache_elt_size(kr_backend_t be)
{
    return be->iface.cache_elt_size ? be->iface.cache_elt_size(be) : be->iface.act_size(be);
}

bool kr_backend_check(kr_backend_t be)
{
    return be->iface.check ? be->iface.check(be) : kr_backend_healthy(be);
}

bool kr_backend_healthy(kr_backend_t be)
{
    return !be->iface.healthy || be->iface.healthy(be);
}

bool kr_backend_can_kv_fp8(kr_backend_t be)
{
    return be->iface.kv_fp8 && be->iface.kv_fp8(be);
}

bool kr_backend_kv_fp8_packed(kr_backend_t be)
{
    return kr_backend_can_kv_fp8(be) && be->iface.kv_fp8_packed && be->iface.kv_fp8_packed(be);
}

bool kr_backend_can_fp8_round(kr_backend_t be)
{
    return be->iface.fp8_round != NULL;
}

enum kr_status kr_backend_fp8_round(kr_backend_t be, const struct krk_fp8_round_params *p)
{
    return be->iface.fp8_round ? be->iface.fp8_round(be, p) : KR_ERR_UNSUPPORTED;
}

enum kr_status kr_backend_set_tp(kr_backend_t be, int rank, int size, void *comm, struct kr_err *err)
{
    if (size < 1 || rank < 0 || rank >= size) {
        return kr_err_set(err, KR_ERR_INVAL, "tensor parallelism: rank %d of %d is not a valid place", rank, size);
    }
    if (size > 1 && (!be->iface.set_tp || !be->iface.all_reduce || !be->iface.all_gather)) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED,
                          "tensor parallelism: the %s backend has no collectives yet (tensor-parallel size %d)",
                          kr_backend_name(be), size);
    }
    if (be->iface.set_tp) {
        enum kr_status st = be->iface.set_tp(be, rank, size, comm);
        if (st != KR_OK) {
            return kr_err_set(err, st, "tensor parallelism: the %s backend cannot join as rank %d of %d: %s",
                              kr_backend_name(be), rank, size, kr_status_str(st));
        }
    }
    be->tp_rank = rank;
    be->tp_size = size;
    return KR_OK;
}

enum kr_status kr_backend_set_fp8_weights(kr_backend_t be, bool on, struct kr_err *err)
{

    if (on && !(be->iface.fp8_matmul && be->iface.fp8_matmul(be))) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED,
                          "FP8 weights (--quantization fp8): the %s backend has no FP8 product yet (the CPU "
                          "reference has)", kr_backend_name(be));
    }
    const bool was = be->fp8_weights;
    be->fp8_weights = on;
    if (be->batch_invariant) { /* the invariant mode may not take FP8 products on this backend */
        const enum kr_status st = be->iface.set_batch_invariant(be, true, err);
        if (st != KR_OK) {
            be->fp8_weights = was;
            return st;
        }
    }
    return KR_OK;
}

bool kr_backend_fp8_weights(kr_backend_t be)
{
    return be->fp8_weights;
}

enum kr_status kr_backend_set_batch_invariant(kr_backend_t be, bool on, struct kr_err *err)
{
    if (on && !be->iface.set_batch_invariant) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED, "--batch-invariant: the %s backend has no batch-invariant mode",
                          kr_backend_name(be));
    }
    if (be->iface.set_batch_invariant) {
        KR_TRY(be->iface.set_batch_invariant(be, on, err));
    }
    be->batch_invariant = on;
    return KR_OK;
}

bool kr_backend_batch_invariant(kr_backend_t be)
{
    return be->batch_invariant;
}

int kr_backend_tp_rank(kr_backend_t be)
{
    return be->tp_size > 1 ? be->tp_rank : 0;
}

int kr_backend_tp_size(kr_backend_t be)
{
    return be->tp_size > 1 ? be->tp_size : 1;
}

enum kr_status kr_backend_all_reduce(kr_backend_t be, float *x, int64_t n)
{
    return be->tp_size > 1 ? be->iface.all_reduce(be, x, n) : KR_OK;
}

enum kr_status kr_backend_all_gather(kr_backend_t be, const float *src, int64_t rows, int64_t cols, float *dst)
{
    if (be->tp_size > 1) {
        return be->iface.all_gather(be, src, rows, cols, dst);
    }
    return src == dst ? KR_OK : kr_backend_copy_d2d(be, dst, src, (size_t)(rows * cols) * sizeof(float));
}

void kr_backend_tp_abort(kr_backend_t be)
{
    if (be->tp_size > 1 && be->iface.tp_abort) {
        be->iface.tp_abort(be);
    }
}

enum kr_status kr_backend_mem_info(kr_backend_t be, size_t *free_b, size_t *total_b)
{
    *free_b = *total_b = 0;
    return be->iface.mem_info ? be->iface.mem_info(be, free_b, total_b) : KR_ERR_UNSUPPORTED;
}

enum kr_status kr_backend_reserve(kr_backend_t be, const struct kr_model_config *c, int64_t n_tok, int64_t n_seq,
                                  int64_t max_ctx, int32_t block_size)
{
    return be->iface.reserve ? be->iface.reserve(be, c, n_tok, n_seq, max_ctx, block_size) : KR_OK;
}

enum kr_status kr_backend_end_batch(kr_backend_t be, bool ok)
{
    return be->iface.end_batch ? be->iface.end_batch(be, ok) : KR_OK;
}

int32_t kr_backend_graph_bucket(kr_backend_t be, int32_t n)
{
    return be->iface.graph_bucket && be->iface.graph_run ? be->iface.graph_bucket(be, n) : 0;
}

enum kr_status kr_backend_graph_run(kr_backend_t be, int32_t key, bool *launched)
{
    *launched = false;
    return be->iface.graph_run ? be->iface.graph_run(be, key, launched) : KR_OK;
}

void kr_backend_graph_reset(kr_backend_t be)
{
    if (be && be->iface.graph_reset) {
        be->iface.graph_reset(be);
    }
}

enum kr_status kr_backend_buf_alloc(kr_backend_t be, size_t size, struct kr_buf *out)
{
    return be->iface.buf_alloc(be, size, out);
}

void kr_backend_buf_free(kr_backend_t be, struct kr_buf *buf)
{
    if (buf && buf->ptr) {
        be->iface.buf_free(be, buf);
    }
}

enum kr_status kr_backend_upload(kr_backend_t be, const struct kr_tensor *host, bool to_f32, bool src_persistent,
                                 struct kr_tensor *out, struct kr_buf *owned)
{
    return be->iface.upload(be, host, to_f32, src_persistent, out, owned);
}

enum kr_status kr_backend_copy_d2h(kr_backend_t be, void *dst, const void *src, size_t n)
{
    return be->iface.copy_d2h(be, dst, src, n);
}

enum kr_status kr_backend_copy_h2d(kr_backend_t be, void *dst, const void *src, size_t n)
{
    return be->iface.copy_h2d(be, dst, src, n);
}

enum kr_status kr_backend_copy_d2d(kr_backend_t be, void *dst, const void *src, size_t n)
{
    return be->iface.copy_d2d(be, dst, src, n);
}

enum kr_status kr_backend_begin_batch(kr_backend_t be, const struct kr_batch *b)
{
    if (b->tok_state_slot && !kr_backend_can_token_states(be)) {
        return KR_ERR_UNSUPPORTED; /* it would drop the states asked for */
    }
    return be->iface.begin_batch(be, b);
}

bool kr_backend_can_token_states(kr_backend_t be)
{
    return be->iface.token_states && be->iface.token_states(be);
}

bool kr_backend_can_sample(kr_backend_t be)
{
    return be->iface.sample != NULL;
}

enum kr_status kr_backend_sample(kr_backend_t be, const struct krk_sample_params *p)
{
    return be->iface.sample ? be->iface.sample(be, p) : KR_ERR_UNSUPPORTED;
}

enum kr_status kr_backend_embed(kr_backend_t be, const struct kr_tensor *w, int64_t row0, float *out)
{
    return be->iface.embed(be, w, row0, out);
}

enum kr_status kr_backend_rmsnorm(kr_backend_t be, const struct krk_rmsnorm_params *p)
{
    if (p->ldx < p->dim || (p->res && p->out == p->x) || !p->out) {
        KR_LOG_ERROR("rmsnorm: inconsistent parameters (row stride %lld for rows of %lld, no output, or an output "
                     "aliasing x while a residual is added)",
                     (long long)p->ldx, (long long)p->dim);
        return KR_ERR_INVAL;
    }
    return be->iface.rmsnorm(be, p);
}

bool kr_backend_bf16_operands(kr_backend_t be, int64_t n)
{
    return be->iface.bf16_operands && be->iface.bf16_operands(be, n);
}

enum kr_status kr_backend_add(kr_backend_t be, float *y, const float *x, int64_t n)
{
    return be->iface.add(be, y, x, n);
}

enum kr_status kr_backend_matmul(kr_backend_t be, const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w,
                                 const float *bias, float *y, int64_t ldy, const struct krk_bf16_in *xb)
{
    return be->iface.matmul(be, x, ldx, n, w, bias, y, ldy, xb);
}

enum kr_status kr_backend_act(kr_backend_t be, const struct krk_act_params *p)
{
    return be->iface.act(be, p);
}

enum kr_status kr_backend_matmul_multi(kr_backend_t be, const float *x, int64_t ldx, int64_t n, int k,
                                       const struct kr_matmul_part *parts, const struct krk_bf16_in *xb)
{
    if (k < 0 || (k > 0 && !parts)) {
        return KR_ERR_INVAL;
    }
    if (be->iface.matmul_multi && k > 1) {
        return be->iface.matmul_multi(be, x, ldx, n, k, parts, xb);
    }
    for (int i = 0; i < k; i++) {
        KR_TRY(be->iface.matmul(be, x, ldx, n, parts[i].w, parts[i].bias, parts[i].y, parts[i].ldy, xb));
    }
    return KR_OK;
}

enum kr_status kr_backend_matmul_act(kr_backend_t be, const float *x, int64_t ldx, int64_t n,
                                     const struct kr_tensor *w, const float *bias, float *y, int64_t ldy,
                                     enum kr_act act, float *out, krk_bf16 *out_bf16, const struct krk_bf16_in *xb)
{
    if (be->iface.matmul_act) {
        return be->iface.matmul_act(be, x, ldx, n, w, bias, y, ldy, act, out, out_bf16, xb);
    }
    KR_TRY(be->iface.matmul(be, x, ldx, n, w, bias, y, ldy, xb));
    const struct krk_act_params a = {.act = act, .x = y, .ld_in = ldy, .n = n, .width = w->rows, .out = out,
                                     .out_bf16 = out_bf16};
    return be->iface.act(be, &a);
}

enum kr_status kr_backend_mla_prep(kr_backend_t be, const struct krk_mla_prep_params *p)
{
    if (!p || p->n < 0 || !p->kva || p->kv_lora < 1 || p->rope < 0 || p->rope % 2 || !p->cache ||
        (p->q_norm && (!p->q_lat || p->q_dim < 1)) || (p->kv_norm && !p->ckv) || (p->rope && !p->inv_freq) ||
        (p->ik && (p->idx_dim < p->rope || !p->ik_norm_w || !p->ik_norm_b)) || (p->w && p->n_w < 1) ||
        (p->ik_fp8 && (!p->ik || p->ik_fp8->x != p->ik))) {
        KR_LOG_ERROR("mla_prep: inconsistent parameters (n %lld, kv_lora %lld, rope %lld, q_dim %lld, idx_dim %lld, "
                     "n_w %lld, or a missing buffer)",
                     p ? (long long)p->n : -1LL, p ? (long long)p->kv_lora : -1LL, p ? (long long)p->rope : -1LL,
                     p ? (long long)p->q_dim : -1LL, p ? (long long)p->idx_dim : -1LL, p ? (long long)p->n_w : -1LL);
        return KR_ERR_INVAL;
    }
    if (be->iface.mla_prep) {
        const enum kr_status st = be->iface.mla_prep(be, p);
        if (st != KR_ERR_UNSUPPORTED) {
            return st;
        }
    }
    const int64_t n = p->n, ld = p->kv_lora + p->rope;
    if (p->q_norm) {
        const struct krk_rmsnorm_params qn = {.x = p->q_lat, .ldx = p->q_dim, .w = p->q_norm, .n = n, .dim = p->q_dim,
                                              .eps = p->eps, .out = p->q_lat};
        KR_TRY(be->iface.rmsnorm(be, &qn));
    }
    if (p->kv_norm) {
        const struct krk_rmsnorm_params kn = {.x = p->kva, .ldx = ld, .w = p->kv_norm, .n = n, .dim = p->kv_lora,
                                              .eps = p->eps, .out = p->ckv};
        KR_TRY(be->iface.rmsnorm(be, &kn));
    }
    const struct krk_rope_params rk = {.x = p->kva, .ld = ld, .n_vec = 1, .stride = 0, .off = p->kv_lora,
                                       .dim = p->rope, .interleaved = true, .inv_freq = p->inv_freq,
                                       .factor = p->factor};
    KR_TRY(be->iface.rope(be, &rk));
    if (p->ik) {
        const struct krk_layernorm_params ln = {.x = p->ik, .ldx = p->idx_dim, .w = p->ik_norm_w, .b = p->ik_norm_b,
                                                .n = n, .dim = p->idx_dim, .eps = p->idx_eps, .out = p->ik};
        KR_TRY(be->iface.layernorm(be, &ln));
        const struct krk_rope_params ri = {.x = p->ik, .ld = p->idx_dim, .n_vec = 1, .stride = 0, .off = 0,
                                           .dim = p->rope, .interleaved = false, .inv_freq = p->inv_freq,
                                           .factor = p->factor};
        KR_TRY(be->iface.rope(be, &ri));
        if (p->ik_fp8) {
            KR_TRY(kr_backend_fp8_round(be, p->ik_fp8));
        }
    }
    if (p->w) {
        KR_TRY(be->iface.scale(be, p->w, p->w_scale, n * p->n_w));
    }
    const struct krk_mla_cache_params cw = {.c_kv = p->kv_norm ? p->ckv : p->kva, .ld_ckv = p->kv_norm ? p->kv_lora : ld,
                                           .k_pe = p->kva + p->kv_lora, .ld_kpe = ld, .ik = p->ik,
                                           .kv_lora = p->kv_lora, .rope = p->rope,
                                           .idx_dim = p->ik ? p->idx_dim : 0, .cache = p->cache,
                                           .block_size = p->block_size, .fp8 = p->cache_fp8};
    return be->iface.mla_cache_write(be, &cw);
}

enum kr_status kr_backend_mamba(kr_backend_t be, const struct krk_mamba_params *p)
{
    return be->iface.mamba(be, p);
}

enum kr_status kr_backend_gated_rmsnorm(kr_backend_t be, const struct krk_gated_rmsnorm_params *p)
{
    return be->iface.gated_rmsnorm(be, p);
}

enum kr_status kr_backend_attention(kr_backend_t be, const struct krk_attn_params *p)
{
    return be->iface.attention(be, p);
}

enum kr_status kr_backend_moe_route(kr_backend_t be, const struct krk_route_params *p)
{
    return be->iface.moe_route(be, p);
}

enum kr_status kr_backend_moe_experts(kr_backend_t be, const struct krk_experts_params *p,
                                      const struct kr_expert_weights *w)
{
    return be->iface.moe_experts(be, p, w);
}

enum kr_status kr_backend_gather_out(kr_backend_t be, const float *src, int64_t width, float *dst)
{
    return be->iface.gather_out(be, src, width, dst);
}

enum kr_status kr_backend_layernorm(kr_backend_t be, const struct krk_layernorm_params *p)
{
    return be->iface.layernorm(be, p);
}

enum kr_status kr_backend_scale(kr_backend_t be, float *y, float s, int64_t n)
{
    return be->iface.scale(be, y, s, n);
}

enum kr_status kr_backend_rope(kr_backend_t be, const struct krk_rope_params *p)
{
    return be->iface.rope(be, p);
}

enum kr_status kr_backend_rope_pair(kr_backend_t be, const struct krk_rope_params *a, const struct krk_rope_params *b)
{
    if (!a || !b) {
        return KR_ERR_INVAL;
    }
    if (be->iface.rope_pair && a->inv_freq == b->inv_freq && a->factor == b->factor) {
        const enum kr_status st = be->iface.rope_pair(be, a, b);
        if (st != KR_ERR_UNSUPPORTED) {
            return st;
        }
    }
    KR_TRY(kr_backend_rope(be, a));
    return kr_backend_rope(be, b);
}

enum kr_status kr_backend_mla_cache_write(kr_backend_t be, const struct krk_mla_cache_params *p)
{
    return be->iface.mla_cache_write(be, p);
}

enum kr_status kr_backend_dsa_index(kr_backend_t be, const struct krk_dsa_index_params *p)
{
    return be->iface.dsa_index(be, p);
}

enum kr_status kr_backend_mla_attention(kr_backend_t be, const struct krk_mla_attn_params *p)
{
    if (p->select && (p->select->idx != p->idx || p->select->topk != p->topk || !p->idx)) {
        KR_LOG_ERROR("mla attention: the selection writes %p (top %d) but the attention reads %p (top %d)",
                     (void *)p->select->idx, (int)p->select->topk, (const void *)p->idx, (int)p->topk);
        return KR_ERR_INVAL;
    }
    return be->iface.mla_attention(be, p);
}

#ifndef KR_WITH_CUDA
enum kr_status kr_backend_cuda_create_with(int dev, const struct kr_switches *sw, kr_backend_t *out,
                                           struct kr_err *err)
{
    (void)dev;
    (void)sw;
    *out = NULL;
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "this build of krait has no CUDA support (rebuild with CUDA)");
}

void kr_backend_cuda_setup(const struct kr_switches *sw)
{
    (void)sw;
}

int kr_backend_cuda_device_count(void)
{
    return 0;
}

enum kr_status kr_backend_cuda_create_group(int dev0, int size, kr_backend_t *be, struct kr_cuda_comm **comm,
                                            struct kr_err *err)
{
    (void)dev0;
    for (int r = 0; r < size; r++) {
        be[r] = NULL;
    }
    *comm = NULL;
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "this build of krait has no CUDA support (rebuild with CUDA)");
}

void kr_backend_cuda_group_free(struct kr_cuda_comm *comm)
{
    (void)comm;
}

enum kr_status kr_backend_cuda_create_ranks(int dev0, int n, kr_backend_t *be, struct kr_err *err)
{
    (void)dev0;
    for (int r = 0; r < n; r++) {
        be[r] = NULL;
    }
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "this build of krait has no CUDA support (rebuild with CUDA)");
}

enum kr_status kr_backend_cuda_nccl_id(void *out, size_t cap, size_t *len, struct kr_err *err)
{
    (void)out;
    (void)cap;
    *len = 0;
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "this build of krait has no CUDA support (rebuild with CUDA)");
}

enum kr_status kr_backend_cuda_join(kr_backend_t *be, int n, int first, int world, const void *nccl_id,
                                    struct kr_cuda_comm **comm, struct kr_err *err)
{
    (void)be;
    (void)n;
    (void)first;
    (void)world;
    (void)nccl_id;
    *comm = NULL;
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "this build of krait has no CUDA support (rebuild with CUDA)");
}

void kr_backend_cuda_group_abort(struct kr_cuda_comm *comm)
{
    (void)comm;
}
#endif

enum kr_status kr_backend_cuda_create(int dev, bool graphs, kr_backend_t *out, struct kr_err *err)
{
    *out = NULL;
    struct kr_switches sw;
    KR_TRY(kr_switches_from_env(&sw, err));
    sw.cuda_graphs = graphs;
    kr_backend_cuda_setup(&sw);
    return kr_backend_cuda_create_with(dev, &sw, out, err);
}

enum kr_status kr_backend_parse_device(const char *device, int *cuda_dev, struct kr_err *err)
{
    *cuda_dev = -1;
    if (!device || !strcmp(device, "auto")) {
        *cuda_dev = kr_backend_cuda_device_count() > 0 ? 0 : -1;
        return KR_OK;
    }
    if (!strcmp(device, "cpu")) {
        return KR_OK;
    }
    if (!strncmp(device, "cuda", 4)) {
        int dev = 0;
        if (device[4] == ':') {
            char *end = NULL;
            const long v = strtol(device + 5, &end, 10);
            if (!end || *end || end == device + 5 || v < 0 || v > 1024) {
                return kr_err_set(err, KR_ERR_INVAL, "invalid device '%s' (expected cpu, cuda, cuda:N or auto)",
                                  device);
            }
            dev = (int)v;
        } else if (device[4]) {
            return kr_err_set(err, KR_ERR_INVAL, "invalid device '%s' (expected cpu, cuda, cuda:N or auto)", device);
        }
        *cuda_dev = dev;
        return KR_OK;
    }
    return kr_err_set(err, KR_ERR_INVAL, "invalid device '%s' (expected cpu, cuda, cuda:N or auto)", device);
}

enum kr_status kr_backend_create(const char *device, int threads, kr_backend_t *out, struct kr_err *err)
{
    *out = NULL;
    struct kr_switches sw;
    KR_TRY(kr_switches_from_env(&sw, err));
    int dev;
    KR_TRY(kr_backend_parse_device(device, &dev, err));
    if (dev < 0) {
        *out = kr_backend_cpu_create(threads);
        return *out ? KR_OK : kr_err_set(err, KR_ERR_NOMEM, "out of memory creating the CPU backend");
    }
    kr_backend_cuda_setup(&sw);
    return kr_backend_cuda_create_with(dev, &sw, out, err);
}
