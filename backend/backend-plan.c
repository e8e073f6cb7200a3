/* The planning backend (backend.h, kr_backend_plan_create): uploads count the bytes a device
 * backend would hold and keep nothing, so that the loader, run against it, says what a rank of a
 * checkpoint takes without reading the weights (`krait plan`). It runs no op. */
#include "backend-impl.h"

#include "alloc.h"

#include <string.h>

struct plan_ctx {
    size_t weight_elt, cache_elt;
    uint64_t bytes;  /* uploaded */
    uint64_t n_up;   /* uploads */
};

/* What the loaded tensors point at: never read (plan_backend runs no op). */
static const unsigned char g_nothing[16];

static struct plan_ctx *ctx_of(kr_backend_t be)
{
    return be->ctx;
}

static const char *plan_name(kr_backend_t be)
{
    (void)be;
    return "plan";
}

static void plan_free(kr_backend_t be)
{
    kr_free(be->ctx);
    kr_free(be);
}

static size_t plan_act_size(kr_backend_t be)
{
    (void)be;
    return sizeof(float);
}

static size_t plan_cache_elt_size(kr_backend_t be)
{
    return ctx_of(be)->cache_elt;
}

static enum kr_status plan_buf_alloc(kr_backend_t be, size_t size, struct kr_buf *out)
{
    ctx_of(be)->bytes += size;
    memset(out, 0, sizeof *out); /* nothing to free */
    return KR_OK;
}

static void plan_buf_free(kr_backend_t be, struct kr_buf *buf)
{
    (void)be;
    memset(buf, 0, sizeof *buf);
}

static enum kr_status plan_upload(kr_backend_t be, const struct kr_tensor *host, bool to_f32, bool src_persistent,
                                  struct kr_tensor *out, struct kr_buf *owned)
{
    (void)src_persistent;
    struct plan_ctx *c = ctx_of(be);
    /* FP8 codes are a byte; the matrices the loader keeps in their precision (the embedding, the LM
     * head) are bf16 in an FP8 plan */
    const size_t esz = to_f32                                ? sizeof(float)
                       : host->dtype == KR_DTYPE_F8_E4M3 ? 1
                       : c->weight_elt == 1              ? 2
                                                         : c->weight_elt;
    c->bytes += (uint64_t)host->rows * (uint64_t)host->cols * esz;
    c->n_up++;
    *out = (struct kr_tensor){.data = g_nothing,
                              .dtype = esz == 1 ? KR_DTYPE_F8_E4M3 : to_f32 || esz == 4 ? KR_DTYPE_F32 : KR_DTYPE_BF16,
                              .rows = host->rows, .cols = host->cols};
    memset(owned, 0, sizeof *owned);
    return KR_OK;
}

static enum kr_status plan_no_op(kr_backend_t be)
{
    (void)be;
    return KR_ERR_UNSUPPORTED;
}

static enum kr_status plan_copy(kr_backend_t be, void *dst, const void *src, size_t n)
{
    (void)dst;
    (void)src;
    (void)n;
    return plan_no_op(be);
}

/* A plan made for FP8 weights (weight_elt 1) takes kr_backend_set_fp8_weights: codes of a byte. */
/* Sizes only: the mode changes no byte a plan counts (the CUDA backend's larger attention
 * workspace is scratch, outside the plan). */
static enum kr_status plan_set_batch_invariant(kr_backend_t be, bool on, struct kr_err *err)
{
    (void)be;
    (void)on;
    (void)err;
    return KR_OK;
}

static bool plan_fp8_matmul(kr_backend_t be)
{
    return ctx_of(be)->weight_elt == 1;
}

static enum kr_status plan_set_tp(kr_backend_t be, int rank, int size, void *comm)
{
    (void)be;
    (void)rank;
    (void)size;
    (void)comm; /* a plan needs no collectives: the ranks are planned one at a time */
    return KR_OK;
}

static enum kr_status plan_all_reduce(kr_backend_t be, float *x, int64_t n)
{
    (void)x;
    (void)n;
    return plan_no_op(be);
}

static enum kr_status plan_all_gather(kr_backend_t be, const float *src, int64_t rows, int64_t cols, float *dst)
{
    (void)src;
    (void)rows;
    (void)cols;
    (void)dst;
    return plan_no_op(be);
}

kr_backend_t kr_backend_plan_create(size_t weight_elt, size_t cache_elt)
{
    kr_backend_t be = kr_calloc(1, sizeof *be);
    struct plan_ctx *c = kr_calloc(1, sizeof *c);
    if (!be || !c || (weight_elt != 1 && weight_elt != 2 && weight_elt != 4) || (cache_elt != 2 && cache_elt != 4)) {
        kr_free(be);
        kr_free(c);
        return NULL;
    }
    c->weight_elt = weight_elt;
    c->cache_elt = cache_elt;
    be->ctx = c;
    be->api_version = KR_BACKEND_API_VERSION;
    be->iface = (struct kr_backend_i){
        .name = plan_name,
        .free = plan_free,
        .act_size = plan_act_size,
        .cache_elt_size = plan_cache_elt_size,
        .buf_alloc = plan_buf_alloc,
        .buf_free = plan_buf_free,
        .upload = plan_upload,
        .copy_d2h = plan_copy,
        .copy_h2d = plan_copy,
        .copy_d2d = plan_copy,
        .set_tp = plan_set_tp,
        .all_reduce = plan_all_reduce,
        .all_gather = plan_all_gather,
        .fp8_matmul = plan_fp8_matmul,
        .set_batch_invariant = plan_set_batch_invariant,
    };
    return be;
}

bool kr_backend_is_plan(kr_backend_t be)
{
    return be && be->iface.name == plan_name;
}

uint64_t kr_backend_plan_bytes(kr_backend_t be)
{
    return kr_backend_is_plan(be) ? ctx_of(be)->bytes : 0;
}
