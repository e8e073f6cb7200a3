/* MoE routing and routed experts (kernels/moe/) against cpu_moe_route and cpu_moe_experts.
 *
 * Routing must choose exactly the CPU's experts in the CPU's order, exact ties included (equal
 * logits, equal biases, whole groups equal): the inputs are built so that every tie is exact and
 * every non-tie is far wider than the last-ulp differences of expf between the two sides. Weights:
 * NMSE <= 1e-12 and max |err| <= 1e-5 (a few ulp of sigmoid/softmax values times scale <= 2.5).
 * Experts: fp32 dot products over <= 264 terms summed in different orders, NMSE <= 1e-10 and
 * max |err| <= 1e-4 on outputs of magnitude ~1. */
#include "gpu-test.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "dtype.h"

static float *hrand(struct gt_rng *r, size_t n, float lo, float hi)
{
    float *p = kr_malloc((n ? n : 1) * sizeof(float));
    cr_assert(p);
    gt_fill(r, p, n, lo, hi);
    return p;
}

/* ---- routing ------------------------------------------------------------------------------ */

struct route_case {
    const char *name;
    int64_t n_expert, n_used, n_group, topk_group;
    bool norm_topk, with_bias;
    float scale;
    int score; /* 0 sigmoid, 1 softmax */
};

/* Logits of token t, cycling through four kinds: random; random with group 5 a copy of group 2
 * (an exact group tie, broken by the lower group, and exact expert ties across the two groups);
 * all equal (everything ties: the lowest groups and experts win); random in equal pairs
 * (expert e + 1 equal to e). With `quantized`, the random values come from a grid of 9 levels,
 * so most experts tie with others. */
static void route_logits(struct gt_rng *r, float *lg, int64_t n, int64_t E, int64_t per_group, bool quantized)
{
    for (int64_t t = 0; t < n; t++) {
        float *l = lg + t * E;
        for (int64_t e = 0; e < E; e++) {
            l[e] = quantized ? -2.0f + 0.5f * (float)((int)gt_uniform(r, 0, 9.0f) % 9) : gt_uniform(r, -4.0f, 4.0f);
        }
        switch (t % 4) {
        case 1:
            if (E >= 6 * per_group) {
                memcpy(l + 5 * per_group, l + 2 * per_group, (size_t)per_group * sizeof(float));
            }
            break;
        case 2:
            for (int64_t e = 0; e < E; e++) {
                l[e] = 0.75f;
            }
            break;
        case 3:
            for (int64_t e = 1; e < E; e += 2) {
                l[e] = l[e - 1];
            }
            break;
        default:
            break;
        }
    }
}

static void run_route_case(const struct route_case *c, int64_t n, uint64_t seed)
{
    struct gt_rng rng = {.s = seed};
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    const int64_t E = c->n_expert, K = c->n_used, per_group = E / c->n_group;
    float *lg = kr_malloc((size_t)(n * E) * sizeof(float));
    cr_assert(lg);
    route_logits(&rng, lg, n, E, per_group, c->score == 1);
    /* correction bias: equal within pairs (e, e + 1), group 5 a copy of group 2 */
    float *bias = hrand(&rng, (size_t)E, -0.1f, 0.1f);
    for (int64_t e = 1; e < E; e += 2) {
        bias[e] = bias[e - 1];
    }
    if (E >= 6 * per_group) {
        memcpy(bias + 5 * per_group, bias + 2 * per_group, (size_t)per_group * sizeof(float));
    }
    float *d_lg = gt_dup(lg, (size_t)(n * E) * 4), *d_bias = gt_dup(bias, (size_t)E * 4);
    int32_t *d_ids = gt_dalloc((size_t)(n * K) * 4);
    float *d_w = gt_dalloc((size_t)(n * K) * 4);
    const struct krk_route_params p = {.logits = d_lg, .bias = c->with_bias ? d_bias : NULL, .n = n, .n_expert = E,
                                       .n_used = K, .n_group = c->n_group, .topk_group = c->topk_group,
                                       .norm_topk = c->norm_topk, .scale = c->scale, .score = c->score, .ids = d_ids,
                                       .weights = d_w};
    cr_assert_eq(krk_moe_route(&p, 0), KR_OK);
    gt_sync();
    int32_t *ids = kr_malloc((size_t)(n * K) * 4), *gids = kr_malloc((size_t)(n * K) * 4);
    float *w = kr_malloc((size_t)(n * K) * 4), *gw = kr_malloc((size_t)(n * K) * 4);
    cr_assert(ids && gids && w && gw);
    const struct krk_route_params cp = {.logits = lg, .n = n, .bias = c->with_bias ? bias : NULL, .n_expert = E, .n_used = K,
                                       .n_group = c->n_group, .topk_group = c->topk_group, .norm_topk = c->norm_topk,
                                       .scale = c->scale, .score = (enum kr_router_score)c->score, .ids = ids,
                                       .weights = w};
    cr_assert_eq(kr_backend_moe_route(be, &cp), KR_OK);
    gt_down(gids, d_ids, (size_t)(n * K) * 4);
    gt_down(gw, d_w, (size_t)(n * K) * 4);
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n * K; i++) {
        if (ids[i] != gids[i] && !bad++) {
            first = i;
        }
    }
    fprintf(stderr, "  route %-28s n=%lld ids mismatches=%lld %s\n", c->name, (long long)n, (long long)bad,
            bad ? "FAIL" : "ok");
    cr_expect(bad == 0, "%s n=%lld: %lld chosen experts differ (first: token %lld slot %lld: %d, CPU %d)", c->name,
              (long long)n, (long long)bad, (long long)(first / K), (long long)(first % K), bad ? gids[first] : 0,
              bad ? ids[first] : 0);
    char what[80];
    snprintf(what, sizeof what, "route %s n=%lld weights", c->name, (long long)n);
    gt_expect_close(what, gw, w, (size_t)(n * K), 1e-12, 1e-5);
    kr_free(lg);
    kr_free(bias);
    kr_free(ids);
    kr_free(gids);
    kr_free(w);
    kr_free(gw);
    gt_dfree(d_lg);
    gt_dfree(d_bias);
    gt_dfree(d_ids);
    gt_dfree(d_w);
    kr_backend_free(be);
}

/* DeepSeek-V3 style: sigmoid, correction bias, 8 groups of 8, 3 groups kept, 6 experts. */
Test(moe, route_sigmoid_bias_groups_matches_cpu)
{
    GT_REQUIRE_GPU();
    const struct route_case c = {"sigmoid+bias+groups", 64, 6, 8, 3, true, true, 2.5f, 0};
    run_route_case(&c, 1, 11);
    run_route_case(&c, 1000, 12);
    const struct route_case big = {"sigmoid+bias 256e/8g/top4", 256, 8, 8, 4, true, true, 2.5f, 0};
    run_route_case(&big, 333, 13);
}

/* Softmax over all experts, no bias, no groups, no normalisation; logits on a coarse grid. */
Test(moe, route_softmax_without_groups_matches_cpu)
{
    GT_REQUIRE_GPU();
    const struct route_case c = {"softmax", 64, 6, 1, 1, false, false, 1.0f, 1};
    run_route_case(&c, 1, 21);
    run_route_case(&c, 1000, 22);
    const struct route_case wide = {"softmax 1000e norm", 1000, 32, 1, 1, true, false, 1.5f, 1};
    run_route_case(&wide, 77, 23);
}

Test(moe, route_rejects_bad_parameters)
{
    GT_REQUIRE_GPU();
    float *d = gt_dalloc(4096);
    struct krk_route_params p = {.logits = d, .n = 1, .n_expert = 64, .n_used = 6, .n_group = 8, .topk_group = 3,
                                 .scale = 1.0f, .ids = (int32_t *)(d + 512), .weights = d + 768};
    cr_expect_eq(krk_moe_route(&p, 0), KR_OK);
    p.n_group = 7; /* does not divide n_expert */
    cr_expect_eq(krk_moe_route(&p, 0), KR_ERR_INVAL);
    p.n_group = 8;
    p.topk_group = 0;
    cr_expect_eq(krk_moe_route(&p, 0), KR_ERR_INVAL);
    p.topk_group = 3;
    p.n_used = 33;
    cr_expect_eq(krk_moe_route(&p, 0), KR_ERR_INVAL);
    p.n_used = 6;
    p.n_expert = 2048;
    cr_expect_eq(krk_moe_route(&p, 0), KR_ERR_INVAL);
    gt_sync();
    gt_dfree(d);
}

/* ---- experts -------------------------------------------------------------------------------- */

struct experts_case {
    const char *name;
    int64_t n_expert, n_used, d_in, d_ffn, d_out;
    bool gated;
    enum kr_act act;
};

static void run_experts_case(const struct experts_case *c, int64_t n, uint64_t seed)
{
    struct gt_rng rng = {.s = seed};
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    const int64_t E = c->n_expert, K = c->n_used;
    const size_t nin = (size_t)(c->d_ffn * c->d_in), nout = (size_t)(c->d_out * c->d_ffn);
    struct kr_tensor *tg = kr_calloc((size_t)E, sizeof *tg), *tu = kr_calloc((size_t)E, sizeof *tu),
                     *td = kr_calloc((size_t)E, sizeof *td);
    uint16_t **hw = kr_calloc((size_t)(3 * E), sizeof *hw);
    const krk_bf16 **dg = kr_calloc((size_t)E, sizeof *dg), **du = kr_calloc((size_t)E, sizeof *du),
                   **dd = kr_calloc((size_t)E, sizeof *dd);
    cr_assert(tg && tu && td && hw && dg && du && dd);
    for (int64_t e = 0; e < E; e++) {
        for (int m = 0; m < 3; m++) { /* gate, up, down */
            const size_t cnt = m == 2 ? nout : nin;
            float *f = hrand(&rng, cnt, -0.2f, 0.2f);
            uint16_t *b = kr_malloc(cnt * sizeof(uint16_t));
            cr_assert(b);
            for (size_t i = 0; i < cnt; i++) {
                b[i] = kr_f32_to_bf16(f[i]);
            }
            kr_free(f);
            hw[3 * e + m] = b;
            krk_bf16 *d = gt_dup(b, cnt * 2);
            if (m == 0) {
                tg[e] = (struct kr_tensor){.data = b, .dtype = KR_DTYPE_BF16, .rows = c->d_ffn, .cols = c->d_in};
                dg[e] = d;
            } else if (m == 1) {
                tu[e] = (struct kr_tensor){.data = b, .dtype = KR_DTYPE_BF16, .rows = c->d_ffn, .cols = c->d_in};
                du[e] = d;
            } else {
                td[e] = (struct kr_tensor){.data = b, .dtype = KR_DTYPE_BF16, .rows = c->d_out, .cols = c->d_ffn};
                dd[e] = d;
            }
        }
    }
    /* distinct random experts per token, positive weights */
    int32_t *ids = kr_malloc((size_t)(n * K) * 4);
    float *w = hrand(&rng, (size_t)(n * K), 0.1f, 1.0f), *x = hrand(&rng, (size_t)(n * c->d_in), -1.0f, 1.0f);
    cr_assert(ids);
    for (int64_t t = 0; t < n; t++) {
        for (int64_t k = 0; k < K; k++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)gt_uniform(&rng, 0, (float)E) % (int32_t)E;
                dup = false;
                for (int64_t j = 0; j < k; j++) {
                    dup |= ids[t * K + j] == e;
                }
            } while (dup);
            ids[t * K + k] = e;
        }
    }
    const krk_bf16 *const *d_gate = gt_dup(dg, (size_t)E * sizeof *dg);
    const krk_bf16 *const *d_up = gt_dup(du, (size_t)E * sizeof *du);
    const krk_bf16 *const *d_down = gt_dup(dd, (size_t)E * sizeof *dd);
    float *d_x = gt_dup(x, (size_t)(n * c->d_in) * 4), *d_wt = gt_dup(w, (size_t)(n * K) * 4);
    int32_t *d_ids = gt_dup(ids, (size_t)(n * K) * 4);
    const size_t ws = krk_moe_experts_workspace_bytes(n, K, c->d_in, c->d_ffn, c->d_out, false);
    cr_assert_eq(ws, (size_t)(n * K * c->d_ffn) * 4, "the hidden rows of every token's experts");
    float *d_hidden = gt_dalloc(ws), *d_out = gt_dalloc((size_t)(n * c->d_out) * 4);
    float *ref = kr_malloc((size_t)(n * c->d_out) * 4), *got = kr_malloc((size_t)(n * c->d_out) * 4);
    cr_assert(ref && got);
    /* the same op parameters on both sides (the GPU's pointing at device copies); the weights are
     * each side's own handles: the CPU's tensors, the device arrays of bf16 pointers */
    const struct krk_experts_params cp = {.x = x, .n = n, .d_in = c->d_in, .d_ffn = c->d_ffn, .d_out = c->d_out,
                                          .n_expert = E, .n_used = K, .ids = ids, .weights = w,
                                          .act = (enum kr_act)c->act, .out = ref};
    struct krk_experts_params p = cp;
    p.x = d_x;
    p.ids = d_ids;
    p.weights = d_wt;
    p.out = d_out;
    const struct krk_expert_ptrs dw = {.gate = c->gated ? (const void *const *)d_gate : NULL,
                                       .up = (const void *const *)d_up, .down = (const void *const *)d_down};
    const struct krk_ctx k = {.workspace = d_hidden, .workspace_bytes = ws};
    cr_assert_eq(krk_moe_experts(&p, &dw, &k), KR_OK);
    gt_sync();
    const struct krk_ctx short_ws = {.workspace = d_hidden, .workspace_bytes = ws - 1};
    cr_expect_eq(krk_moe_experts(&p, &dw, &short_ws), KR_ERR_INVAL, "a workspace one byte short");
    const struct kr_expert_weights cw = {.gate = c->gated ? tg : NULL, .up = tu, .down = td};
    cr_assert_eq(kr_backend_moe_experts(be, &cp, &cw), KR_OK);
    gt_down(got, d_out, (size_t)(n * c->d_out) * 4);
    char what[80];
    snprintf(what, sizeof what, "experts %s n=%lld", c->name, (long long)n);
    gt_expect_close(what, got, ref, (size_t)(n * c->d_out), 1e-10, 1e-4);

    for (int64_t e = 0; e < E; e++) {
        gt_dfree((void *)dg[e]);
        gt_dfree((void *)du[e]);
        gt_dfree((void *)dd[e]);
    }
    for (int64_t i = 0; i < 3 * E; i++) {
        kr_free(hw[i]);
    }
    gt_dfree((void *)d_gate);
    gt_dfree((void *)d_up);
    gt_dfree((void *)d_down);
    gt_dfree(d_x);
    gt_dfree(d_wt);
    gt_dfree(d_ids);
    gt_dfree(d_hidden);
    gt_dfree(d_out);
    kr_free(tg);
    kr_free(tu);
    kr_free(td);
    kr_free(hw);
    kr_free(dg);
    kr_free(du);
    kr_free(dd);
    kr_free(ids);
    kr_free(w);
    kr_free(x);
    kr_free(ref);
    kr_free(got);
    kr_backend_free(be);
}

/* Gated SiLU experts: 16-byte loads for the gate/up rows (d_in % 8 == 0), a ragged d_ffn (scalar
 * path for the down rows) and d_out not a multiple of the 8-row tile. */
Test(moe, experts_gated_silu_match_cpu)
{
    GT_REQUIRE_GPU();
    const struct experts_case c = {"gated silu", 8, 3, 256, 131, 264, true, KR_ACT_SILU};
    run_experts_case(&c, 1, 31);
    run_experts_case(&c, 40, 32);
}

/* Non-gated relu2 experts (Nemotron-H style): odd d_in (scalar path), 16-byte down rows. */
Test(moe, experts_relu2_match_cpu)
{
    GT_REQUIRE_GPU();
    const struct experts_case c = {"relu2", 8, 6, 131, 200, 72, false, KR_ACT_RELU2};
    run_experts_case(&c, 1, 41);
    run_experts_case(&c, 40, 42);
}
