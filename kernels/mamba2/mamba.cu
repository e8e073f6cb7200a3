// krk_mamba: the Mamba-2 step of a layer (struct krk_mamba_params) as its two launchers, krk_conv1d
// on the xBC columns of the input projection, then krk_ssd on the conv output with the dt columns.
#include "common/util.cuh"

extern "C" enum kr_status krk_mamba(const struct krk_mamba_params *p, const struct krk_ctx *ctx)
{
    KRK_REQUIRE(p != nullptr && ctx != nullptr);
    KRK_REQUIRE(p->d_inner >= 0 && p->n_group >= 0 && p->d_state >= 0);
    const int64_t conv_dim = p->d_inner + 2 * p->n_group * p->d_state;
    // (profiling) events: the conv's pair, the SSD's, then the SSD's phases (krk_ssd records those)
    auto mark = [&](int k) {
        if (ctx->events) {
            cudaEventRecord(ctx->events[k], ctx->stream);
        }
    };
    krk_ctx k = *ctx;
    k.events = nullptr;
    krk_conv1d_params cp = {};
    cp.in = p->zxbcdt;
    cp.ld_in = p->ld_in;
    cp.in_off = p->d_inner;
    cp.conv_dim = conv_dim;
    cp.d_conv = p->d_conv;
    cp.w = p->conv_w;
    cp.b = p->conv_b;
    cp.state = static_cast<krk_bf16 *>(p->conv_state);
    cp.out = p->xbc;
    mark(0);
    const enum kr_status cst = krk_conv1d(&cp, &k);
    mark(1);
    if (cst != KR_OK) {
        return cst;
    }
    krk_ssd_params sp = {};
    sp.xbc = p->xbc;
    sp.conv_dim = conv_dim;
    sp.dt = p->zxbcdt + p->d_inner + conv_dim;
    sp.ld_dt = p->ld_in;
    sp.dt_bias = p->dt_bias;
    sp.A_log = p->A_log;
    sp.D = p->D;
    sp.dt_min = p->dt_min;
    sp.dt_max = p->dt_max;
    sp.n_head = p->n_head;
    sp.head_dim = p->head_dim;
    sp.n_group = p->n_group;
    sp.d_state = p->d_state;
    sp.chunk = p->chunk;
    sp.state = p->ssm_state;
    sp.y = p->y;
    k.events = ctx->events ? ctx->events + 4 : nullptr;
    mark(2);
    const enum kr_status sst = krk_ssd(&sp, &k);
    mark(3);
    return sst;
}
