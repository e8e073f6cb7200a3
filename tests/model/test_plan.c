/* The planning backend (`krait plan`): the loader run against it on every HF fixture, at one rank and
 * as 2 (and 4) ranks where the model divides, against the loader run for real on the CPU backend:
 *  - the sharded config and every cache size of a planned rank equal the real rank's (the same
 *    kr_cache_unit_bytes over the real rank's model, with fp32 caches on both sides);
 *  - one rank's planned bytes lie within what its parameter count allows (2 bytes per element for
 *    matrices, 4 for the vectors, norms and the fp32 up-projections kept as fp32), the count being the
 *    real loader's;
 *  - a split moves weights off every rank (each rank holds less than the whole) and no weight is
 *    lost (the ranks together hold at least the whole);
 *  - planning an FP8 checkpoint reads none of its weights: it counts the dequantized bf16 size and
 *    marks the block scales used (the loader refuses unused tensors). */
#include "comm.h"
#include "fixture.h"

#include "cache.h"
#include "model.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

TestSuite(plan);

static uint64_t plan_rank(const char *dir, int rank, int size, size_t elt, struct kr_model **keep)
{
    kr_backend_t be = kr_backend_plan_create(elt, elt);
    cr_assert(be);
    struct kr_err err = {0};
    cr_assert_eq(kr_backend_set_tp(be, rank, size, NULL, &err), KR_OK, "%s", err.msg);
    struct kr_model *m = NULL;
    cr_assert_eq(kr_model_load(dir, be, &m, &err), KR_OK, "%s rank %d of %d: %s", dir, rank, size, err.msg);
    const uint64_t b = kr_backend_plan_bytes(be);
    if (keep) {
        *keep = m;
    } else {
        kr_model_free(m);
        kr_backend_free(be);
    }
    return b;
}

/* Whether the fixture divides into `size` ranks (the real loader's verdict). */
static bool divides(const char *dir, int size)
{
    struct kr_model_config c;
    struct kr_err err = {0};
    cr_assert_eq(kr_model_config_load(&c, dir, &err), KR_OK, "%s", err.msg);
    return kr_model_config_shard(&c, 0, size, &err) == KR_OK;
}

static void check_fixture(int idx)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s/%s", fx_root(), fx_all[idx].family, fx_all[idx].name);
    /* one rank, against the real load's parameter count */
    struct kr_model *pm = NULL;
    const uint64_t whole = plan_rank(dir, 0, 1, 2, &pm);
    kr_backend_t cpu = kr_backend_cpu_create(1);
    struct kr_model *real = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_model_load(dir, cpu, &real, &err), KR_OK, "%s", err.msg);
    cr_expect_eq(pm->n_params, real->n_params, "%s: the plan saw %llu parameters, the loader %llu", dir,
                 (unsigned long long)pm->n_params, (unsigned long long)real->n_params);
    cr_expect(whole >= 2 * real->n_params && whole <= 4 * real->n_params,
              "%s: %llu bytes planned for %llu parameters (2 to 4 bytes each)", dir, (unsigned long long)whole,
              (unsigned long long)real->n_params);
    kr_model_free(real);
    kr_backend_free(cpu);
    kr_backend_t pbe = pm->be;
    kr_model_free(pm);
    kr_backend_free(pbe);
    for (int size = 2; size <= 4; size *= 2) {
        if (!divides(dir, size)) {
            continue;
        }
        uint64_t sum = 0;
        for (int r = 0; r < size; r++) {
            struct kr_model *m = NULL;
            const uint64_t b = plan_rank(dir, r, size, 4, &m);
            sum += b;
            /* the same rank loaded for real (fp32 caches on both sides) */
            struct kr_host_comm *comm = NULL;
            cr_assert_eq(kr_host_comm_create(size, &comm), KR_OK);
            kr_backend_t rbe = kr_backend_cpu_create(1);
            cr_assert_eq(kr_backend_set_tp(rbe, r, size, comm, &err), KR_OK, "%s", err.msg);
            struct kr_model *rm = NULL;
            cr_assert_eq(kr_model_load(dir, rbe, &rm, &err), KR_OK, "%s rank %d of %d: %s", dir, r, size, err.msg);
            cr_expect_eq(memcmp(&m->cfg, &rm->cfg, sizeof m->cfg), 0, "%s rank %d of %d: the planned config differs",
                         dir, r, size);
            size_t ps = 0, pb = 0, rs = 0, rb = 0;
            kr_cache_unit_bytes(m, 16, &ps, &pb);
            kr_cache_unit_bytes(rm, 16, &rs, &rb);
            cr_expect(ps == rs && pb == rb, "%s rank %d of %d: cache sizes %zu / %zu planned, %zu / %zu real", dir, r,
                      size, ps, pb, rs, rb);
            kr_model_free(rm);
            kr_backend_free(rbe);
            kr_host_comm_free(comm);
            kr_backend_t be = m->be;
            kr_model_free(m);
            kr_backend_free(be);
            const uint64_t whole4 = plan_rank(dir, 0, 1, 4, NULL);
            cr_expect_lt(b, whole4, "%s rank %d of %d holds %llu bytes, the whole model %llu", dir, r, size,
                         (unsigned long long)b, (unsigned long long)whole4);
        }
        const uint64_t whole4 = plan_rank(dir, 0, 1, 4, NULL);
        cr_expect_geq(sum, whole4, "%s: %d ranks hold %llu bytes together, less than the whole %llu", dir, size,
                      (unsigned long long)sum, (unsigned long long)whole4);
        fprintf(stderr, "  %-40s %d ranks: %llu bytes together (whole %llu)\n", dir, size, (unsigned long long)sum,
                (unsigned long long)whole4);
    }
}

Test(plan, every_fixture_at_one_two_and_four_ranks)
{
    for (int i = 0; i < FX_N_ALL; i++) {
        check_fixture(i);
    }
}

/* An FP8 checkpoint: every matrix counted at its dequantized bf16 size, the scales accepted as used. */
Test(plan, an_fp8_checkpoint_is_planned_at_its_bf16_size)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s/deepseek_v32/ds_fp8", fx_root());
    struct kr_model *m = NULL;
    const uint64_t b = plan_rank(dir, 0, 1, 2, &m);
    cr_expect(m->cfg.fp8_weights, "the fixture is an FP8 checkpoint");
    cr_expect_geq(b, 2 * m->n_params, "%llu bytes planned for %llu parameters", (unsigned long long)b,
                  (unsigned long long)m->n_params);
    kr_backend_t be = m->be;
    kr_model_free(m);
    kr_backend_free(be);
}

/* FP8 weights planned (`krait plan --quantization fp8`): the matrices' codes take a byte where bf16
 * takes two, and the embedding, the LM head, the vectors and the block scales are unchanged or
 * small: the plan lies between half the bf16 plan and the bf16 plan, on the FP8 checkpoint and on a
 * bf16 one (quantized at load), and a plan made for bf16 refuses FP8. */
static uint64_t plan_fp8(const char *dir)
{
    kr_backend_t be = kr_backend_plan_create(1, 2);
    cr_assert(be);
    struct kr_err err = {0};
    cr_assert_eq(kr_backend_set_fp8_weights(be, true, &err), KR_OK, "%s", err.msg);
    struct kr_model *m = NULL;
    cr_assert_eq(kr_model_load(dir, be, &m, &err), KR_OK, "%s: %s", dir, err.msg);
    const uint64_t b = kr_backend_plan_bytes(be);
    kr_model_free(m);
    kr_backend_free(be);
    return b;
}

Test(plan, fp8_weights_take_about_half)
{
    static const char *const rel[] = {"deepseek_v32/ds_fp8", "nemotron_h/nh_moe", "hybrid/hy_mdme"};
    for (size_t i = 0; i < sizeof rel / sizeof rel[0]; i++) {
        char dir[512];
        snprintf(dir, sizeof dir, "%s/%s", fx_root(), rel[i]);
        const uint64_t f = plan_fp8(dir), b = plan_rank(dir, 0, 1, 2, NULL);
        fprintf(stderr, "  %-24s FP8 %llu bytes, bf16 %llu\n", rel[i], (unsigned long long)f, (unsigned long long)b);
        cr_expect(f < b && 2 * f >= b, "%s: FP8 plan %llu bytes against bf16 %llu", rel[i], (unsigned long long)f,
                  (unsigned long long)b);
    }
    kr_backend_t be = kr_backend_plan_create(2, 2);
    struct kr_err err = {0};
    cr_expect_eq(kr_backend_set_fp8_weights(be, true, &err), KR_ERR_UNSUPPORTED);
    kr_backend_free(be);
}
