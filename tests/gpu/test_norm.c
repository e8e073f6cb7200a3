/* Normalisation and elementwise kernels (kernels/norm/) against the CPU reference backend: every
 * launcher on fresh random inputs, outputs poisoned with NaN beforehand so unwritten elements show.
 *
 * Error bounds. Elementwise ops that round once the same way as the CPU (add, scale, embed, gather,
 * casts, conversions, relu, relu2, the residual add) must match bit for bit. The row
 * normalisations sum in a tree where the CPU sums sequentially: the scale factor differs by a few
 * ulp times sqrt(dim), so NMSE <= 1e-10 and max |err| <= 1e-4 on outputs of magnitude <= ~4.
 * silu, gelu and RoPE differ by the last-ulp errors of expf, erff and sinf/cosf (<= 2 ulp each on
 * both sides): NMSE <= 1e-12, max |err| <= 2e-5 (RoPE 1e-5 on |x| <= 2). bf16 outputs must equal the
 * round-to-nearest-even of the kernel's own fp32 output exactly. */
#include "gpu-test.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "dtype.h"

/* ---- helpers ------------------------------------------------------------------------------ */

/* The CPU reference's RMSNorm and LayerNorm of rows at a stride (struct krk_rmsnorm_params,
 * krk_layernorm_params). */
static enum kr_status ref_rmsnorm(kr_backend_t be, const float *x, int64_t ldx, const float *w, int64_t n, int64_t dim,
                                  float eps, float *out)
{
    const struct krk_rmsnorm_params p = {.x = (float *)x, .ldx = ldx, .w = w, .n = n, .dim = dim, .eps = eps,
                                         .out = out};
    return kr_backend_rmsnorm(be, &p);
}

static enum kr_status ref_layernorm(kr_backend_t be, const float *x, int64_t ldx, const float *w, const float *b,
                                    int64_t n, int64_t dim, float eps, float *out)
{
    const struct krk_layernorm_params p = {.x = x, .ldx = ldx, .w = w, .b = b, .n = n, .dim = dim, .eps = eps,
                                           .out = out};
    return kr_backend_layernorm(be, &p);
}

static float *hrand(struct gt_rng *r, size_t n, float lo, float hi)
{
    float *p = kr_malloc((n ? n : 1) * sizeof(float));
    cr_assert(p);
    gt_fill(r, p, n, lo, hi);
    return p;
}

static float *hdown(const float *d, size_t n)
{
    float *h = kr_malloc((n ? n : 1) * sizeof(float));
    cr_assert(h);
    gt_down(h, d, n * sizeof(float));
    return h;
}

/* Checks that a device bf16 output equals the bf16 rounding of the fp32 values `ref` exactly. */
static void expect_bf16_of(const char *what, const krk_bf16 *d, const float *ref, size_t n)
{
    uint16_t *h = kr_malloc((n ? n : 1) * sizeof(uint16_t));
    cr_assert(h);
    gt_down(h, d, n * sizeof(uint16_t));
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++) {
        if (h[i] != kr_f32_to_bf16(ref[i])) {
            if (!bad++) {
                first = i;
            }
        }
    }
    fprintf(stderr, "  %-40s n=%zu bf16 mismatches=%zu %s\n", what, n, bad, bad ? "FAIL" : "ok");
    cr_expect(bad == 0, "%s: %zu of %zu bf16 values differ (first at %zu: 0x%04x, expected 0x%04x)", what, bad, n,
              first, bad ? h[first] : 0, bad ? kr_f32_to_bf16(ref[first]) : 0);
    kr_free(h);
}

/* Checks two byte ranges are identical (the parts of a buffer a kernel must not touch, or
 * results that must be bit-exact). */
static void expect_same_bytes(const char *what, const void *got, const void *ref, size_t bytes)
{
    const bool ok = memcmp(got, ref, bytes) == 0;
    fprintf(stderr, "  %-40s bytes=%zu %s\n", what, bytes, ok ? "identical" : "FAIL");
    cr_expect(ok, "%s: bytes differ", what);
}

/* Rows x dims of the row kernels: n = 1, 3, 1000 with dims 4096, 8192, 131 and 5; `pad` widens the
 * input row stride (a pad that is not a multiple of 4 forces the scalar path). */
struct row_shape {
    int64_t n, dim, pad;
};
static const struct row_shape row_shapes[] = {
    {1, 4096, 0}, {3, 4096, 4}, {1000, 4096, 0}, {1, 8192, 0}, {3, 8192, 1}, {1000, 8192, 0},
    {1, 131, 0},  {3, 131, 2},  {1000, 131, 5},  {1, 5, 0},    {3, 5, 3},    {1000, 5, 0},
};
#define N_ROW_SHAPES ((int)(sizeof row_shapes / sizeof row_shapes[0]))
/* Parameters are indices: test processes may be fresh executions of the binary. */
static int row_idx[N_ROW_SHAPES] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
_Static_assert(sizeof row_idx / sizeof row_idx[0] == N_ROW_SHAPES, "one index per shape");

#define NORM_NMSE 1e-10
#define NORM_ABS 1e-4

/* ---- RMSNorm ----------------------------------------------------------------------------- */

ParameterizedTestParameters(norm, rmsnorm_matches_cpu)
{
    return cr_make_param_array(int, row_idx, N_ROW_SHAPES);
}

/* Three uses: fused residual add (x written back, fp32 and bf16 outputs), plain with a bf16 output
 * only, and in place (out == x, dense rows). */
ParameterizedTest(int *idx, norm, rmsnorm_matches_cpu)
{
    GT_REQUIRE_GPU();
    const struct row_shape s = row_shapes[*idx];
    const int64_t ldx = s.dim + s.pad;
    const size_t nx = (size_t)(s.n * ldx), no = (size_t)(s.n * s.dim);
    const float eps = 1e-5f;
    struct gt_rng rng = {.s = 1000 + (uint64_t)*idx};
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    fprintf(stderr, "rmsnorm n=%lld dim=%lld ldx=%lld\n", (long long)s.n, (long long)s.dim, (long long)ldx);

    float *x = hrand(&rng, nx, -2.0f, 2.0f), *res = hrand(&rng, no, -1.0f, 1.0f);
    float *w = hrand(&rng, (size_t)s.dim, 0.5f, 1.5f);
    float *ref = kr_malloc(no * sizeof(float)), *xr = kr_malloc(nx * sizeof(float));
    cr_assert(ref && xr);
    float *d_x = gt_dup(x, nx * 4), *d_res = gt_dup(res, no * 4), *d_w = gt_dup(w, (size_t)s.dim * 4);
    float *d_out = gt_dalloc(no * 4);
    krk_bf16 *d_ob = gt_dalloc(no * 2);

    /* fused residual add */
    struct krk_rmsnorm_params p = {.x = d_x, .ldx = ldx, .res = d_res, .w = d_w, .n = s.n, .dim = s.dim, .eps = eps,
                                   .out = d_out, .out_bf16 = d_ob};
    cr_assert_eq(krk_rmsnorm(&p, 0), KR_OK);
    gt_sync();
    memcpy(xr, x, nx * sizeof(float));
    for (int64_t i = 0; i < s.n; i++) {
        cr_assert_eq(kr_backend_add(be, xr + i * ldx, res + i * s.dim, s.dim), KR_OK);
    }
    cr_assert_eq(ref_rmsnorm(be, xr, ldx, w, s.n, s.dim, eps, ref), KR_OK);
    float *xg = hdown(d_x, nx), *og = hdown(d_out, no);
    expect_same_bytes("rmsnorm: x += res written back (all of ldx)", xg, xr, nx * sizeof(float));
    gt_expect_close("rmsnorm fused: out", og, ref, no, NORM_NMSE, NORM_ABS);
    expect_bf16_of("rmsnorm fused: out_bf16", d_ob, og, no);
    kr_free(xg);
    kr_free(og);

    /* plain, bf16 output only */
    gt_dfree(d_ob);
    d_ob = gt_dalloc(no * 2);
    cr_assert_eq(ref_rmsnorm(be, x, ldx, w, s.n, s.dim, eps, ref), KR_OK);
    float *d_x2 = gt_dup(x, nx * 4);
    p = (struct krk_rmsnorm_params){.x = d_x2, .ldx = ldx, .w = d_w, .n = s.n, .dim = s.dim, .eps = eps,
                                    .out_bf16 = d_ob};
    cr_assert_eq(krk_rmsnorm(&p, 0), KR_OK);
    gt_sync();
    {
        uint16_t *hb = kr_malloc(no * sizeof(uint16_t));
        float *hf = kr_malloc(no * sizeof(float));
        cr_assert(hb && hf);
        gt_down(hb, d_ob, no * 2);
        for (size_t i = 0; i < no; i++) {
            hf[i] = kr_bf16_to_f32(hb[i]);
        }
        /* bf16 output against the fp32 reference: half a bf16 ulp (2^-9 relative) plus rounding
         * flips at ties: NMSE <= 1e-5, max |err| <= 2^-8 * max|out| (<= 4) */
        gt_expect_close("rmsnorm plain: out_bf16 only", hf, ref, no, 1e-5, 4.0 / 256.0);
        kr_free(hb);
        kr_free(hf);
    }
    float *x2 = hdown(d_x2, nx);
    expect_same_bytes("rmsnorm plain: x untouched", x2, x, nx * sizeof(float));
    kr_free(x2);
    gt_dfree(d_x2);

    /* in place: out aliases x (dense rows only) */
    if (s.pad == 0) {
        float *d_x3 = gt_dup(x, nx * 4);
        p = (struct krk_rmsnorm_params){.x = d_x3, .ldx = ldx, .w = d_w, .n = s.n, .dim = s.dim, .eps = eps,
                                        .out = d_x3};
        cr_assert_eq(krk_rmsnorm(&p, 0), KR_OK);
        gt_sync();
        float *x3 = hdown(d_x3, no);
        gt_expect_close("rmsnorm in place", x3, ref, no, NORM_NMSE, NORM_ABS);
        kr_free(x3);
        gt_dfree(d_x3);
    }

    gt_dfree(d_x);
    gt_dfree(d_res);
    gt_dfree(d_w);
    gt_dfree(d_out);
    gt_dfree(d_ob);
    kr_free(x);
    kr_free(res);
    kr_free(w);
    kr_free(ref);
    kr_free(xr);
    kr_backend_free(be);
}

Test(norm, rmsnorm_rejects_bad_parameters)
{
    GT_REQUIRE_GPU();
    float *d = gt_dalloc(64 * 4);
    struct krk_rmsnorm_params p = {.x = d, .ldx = 8, .w = d, .n = 2, .dim = 8, .eps = 1e-5f, .out = d + 32};
    cr_expect_eq(krk_rmsnorm(&p, 0), KR_OK);
    p.ldx = 4; /* ldx < dim */
    cr_expect_eq(krk_rmsnorm(&p, 0), KR_ERR_INVAL);
    p.ldx = 8;
    p.res = d + 16;
    p.out = d; /* out aliasing x with a residual */
    cr_expect_eq(krk_rmsnorm(&p, 0), KR_ERR_INVAL);
    p.out = NULL; /* no output at all */
    cr_expect_eq(krk_rmsnorm(&p, 0), KR_ERR_INVAL);
    cr_expect_eq(krk_rmsnorm(NULL, 0), KR_ERR_INVAL);
    gt_sync();
    gt_dfree(d);
}

/* ---- LayerNorm --------------------------------------------------------------------------- */

ParameterizedTestParameters(norm, layernorm_matches_cpu)
{
    return cr_make_param_array(int, row_idx, N_ROW_SHAPES);
}

/* With a bias, without one (the CPU gets zeros) and in place. Inputs have a mean offset so the
 * centring matters. */
ParameterizedTest(int *idx, norm, layernorm_matches_cpu)
{
    GT_REQUIRE_GPU();
    const struct row_shape s = row_shapes[*idx];
    const int64_t ldx = s.dim + s.pad;
    const size_t nx = (size_t)(s.n * ldx), no = (size_t)(s.n * s.dim);
    const float eps = 1e-6f;
    struct gt_rng rng = {.s = 2000 + (uint64_t)*idx};
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    fprintf(stderr, "layernorm n=%lld dim=%lld ldx=%lld\n", (long long)s.n, (long long)s.dim, (long long)ldx);

    float *x = hrand(&rng, nx, -1.0f, 3.0f), *w = hrand(&rng, (size_t)s.dim, 0.5f, 1.5f);
    float *b = hrand(&rng, (size_t)s.dim, -0.5f, 0.5f), *zero = kr_calloc((size_t)s.dim, sizeof(float));
    float *ref = kr_malloc(no * sizeof(float));
    cr_assert(ref && zero);
    float *d_x = gt_dup(x, nx * 4), *d_w = gt_dup(w, (size_t)s.dim * 4), *d_b = gt_dup(b, (size_t)s.dim * 4);
    float *d_out = gt_dalloc(no * 4);

    struct krk_layernorm_params p = {.x = d_x, .ldx = ldx, .w = d_w, .b = d_b, .n = s.n, .dim = s.dim, .eps = eps,
                                     .out = d_out};
    cr_assert_eq(krk_layernorm(&p, 0), KR_OK);
    gt_sync();
    cr_assert_eq(ref_layernorm(be, x, ldx, w, b, s.n, s.dim, eps, ref), KR_OK);
    float *og = hdown(d_out, no);
    gt_expect_close("layernorm with bias", og, ref, no, NORM_NMSE, NORM_ABS);
    kr_free(og);

    gt_dfree(d_out);
    d_out = gt_dalloc(no * 4);
    p.b = NULL;
    p.out = d_out;
    cr_assert_eq(krk_layernorm(&p, 0), KR_OK);
    gt_sync();
    cr_assert_eq(ref_layernorm(be, x, ldx, w, zero, s.n, s.dim, eps, ref), KR_OK);
    og = hdown(d_out, no);
    gt_expect_close("layernorm without bias", og, ref, no, NORM_NMSE, NORM_ABS);
    kr_free(og);

    if (s.pad == 0) {
        p.out = d_x;
        cr_assert_eq(krk_layernorm(&p, 0), KR_OK);
        gt_sync();
        og = hdown(d_x, no);
        gt_expect_close("layernorm in place", og, ref, no, NORM_NMSE, NORM_ABS);
        kr_free(og);
    }

    gt_dfree(d_x);
    gt_dfree(d_w);
    gt_dfree(d_b);
    gt_dfree(d_out);
    kr_free(x);
    kr_free(w);
    kr_free(b);
    kr_free(zero);
    kr_free(ref);
    kr_backend_free(be);
}

/* ---- gated RMSNorm ----------------------------------------------------------------------- */

struct gated_shape {
    int64_t n, dim, group, ldz;
};
static const struct gated_shape gated_shapes[] = {
    {1, 4096, 512, 4096},   {3, 4096, 4096, 9000},  {1000, 4096, 512, 8192}, {1, 8192, 1024, 18560},
    {3, 8192, 8192, 8193},  {1000, 8192, 8192, 8192}, {1, 131, 131, 131},    {1000, 131, 131, 140},
    {3, 5, 5, 7},           {1000, 5, 5, 5},          {3, 136, 17, 136},     {1000, 136, 17, 272},
};
#define N_GATED_SHAPES ((int)(sizeof gated_shapes / sizeof gated_shapes[0]))
static int gated_idx[N_GATED_SHAPES] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
_Static_assert(sizeof gated_idx / sizeof gated_idx[0] == N_GATED_SHAPES, "one index per shape");

ParameterizedTestParameters(norm, gated_rmsnorm_matches_cpu)
{
    return cr_make_param_array(int, gated_idx, N_GATED_SHAPES);
}

ParameterizedTest(int *idx, norm, gated_rmsnorm_matches_cpu)
{
    GT_REQUIRE_GPU();
    const struct gated_shape s = gated_shapes[*idx];
    const size_t ny = (size_t)(s.n * s.dim), nz = (size_t)(s.n * s.ldz);
    const float eps = 1e-5f;
    struct gt_rng rng = {.s = 3000 + (uint64_t)*idx};
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    fprintf(stderr, "gated_rmsnorm n=%lld dim=%lld group=%lld ldz=%lld\n", (long long)s.n, (long long)s.dim,
            (long long)s.group, (long long)s.ldz);

    float *y = hrand(&rng, ny, -2.0f, 2.0f), *z = hrand(&rng, nz, -4.0f, 4.0f);
    float *w = hrand(&rng, (size_t)s.dim, 0.5f, 1.5f);
    float *ref = kr_malloc(ny * sizeof(float));
    cr_assert(ref);
    float *d_y = gt_dup(y, ny * 4), *d_z = gt_dup(z, nz * 4), *d_w = gt_dup(w, (size_t)s.dim * 4);
    float *d_out = gt_dalloc(ny * 4);
    krk_bf16 *d_ob = gt_dalloc(ny * 2);
    struct krk_gated_rmsnorm_params p = {.y = d_y, .z = d_z, .ldz = s.ldz, .w = d_w, .n = s.n, .dim = s.dim,
                                         .group = s.group, .eps = eps, .out = d_out, .out_bf16 = d_ob};
    cr_assert_eq(krk_gated_rmsnorm(&p, 0), KR_OK);
    gt_sync();
    cr_assert_eq(kr_backend_gated_rmsnorm(be, &(struct krk_gated_rmsnorm_params){.y = y, .z = z, .ldz = s.ldz, .w = w, .n = s.n,
                                                                                  .dim = s.dim, .group = s.group,
                                                                                  .eps = eps, .out = ref}), KR_OK);
    float *og = hdown(d_out, ny);
    /* silu's expf adds a few ulp per element to the row-sum difference: same bounds as the norms */
    gt_expect_close("gated_rmsnorm out", og, ref, ny, NORM_NMSE, NORM_ABS);
    expect_bf16_of("gated_rmsnorm out_bf16", d_ob, og, ny);
    kr_free(og);

    p.group = s.dim + 1; /* not a divisor of dim */
    cr_expect_eq(krk_gated_rmsnorm(&p, 0), KR_ERR_INVAL);

    gt_dfree(d_y);
    gt_dfree(d_z);
    gt_dfree(d_w);
    gt_dfree(d_out);
    gt_dfree(d_ob);
    kr_free(y);
    kr_free(z);
    kr_free(w);
    kr_free(ref);
    kr_backend_free(be);
}

/* ---- add, scale ---------------------------------------------------------------------------- */

/* Lengths around the vector width, and misaligned starts (the scalar path). */
Test(elementwise, add_and_scale_match_cpu_exactly)
{
    GT_REQUIRE_GPU();
    static const int64_t lens[] = {1, 3, 4, 5, 4097, 1000 * 4096 + 3};
    struct gt_rng rng = {.s = 4000};
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        for (int shift = 0; shift < 2; shift++) {
            const int64_t n = lens[li];
            const size_t m = (size_t)n + 1;
            float *y = hrand(&rng, m, -3.0f, 3.0f), *x = hrand(&rng, m, -3.0f, 3.0f);
            float *d_y = gt_dup(y, m * 4), *d_x = gt_dup(x, m * 4);
            cr_assert_eq(krk_add(d_y + shift, d_x + shift, n, 0), KR_OK);
            cr_assert_eq(krk_scale(d_y + shift, 0.37f, n, 0), KR_OK);
            gt_sync();
            cr_assert_eq(kr_backend_add(be, y + shift, x + shift, n), KR_OK);
            cr_assert_eq(kr_backend_scale(be, y + shift, 0.37f, n), KR_OK);
            float *g = hdown(d_y, m);
            char what[64];
            snprintf(what, sizeof what, "add+scale n=%lld shift=%d", (long long)n, shift);
            expect_same_bytes(what, g, y, m * sizeof(float)); /* also: nothing outside [shift, shift+n) */
            kr_free(g);
            gt_dfree(d_y);
            gt_dfree(d_x);
            kr_free(y);
            kr_free(x);
        }
    }
    cr_expect_eq(krk_add(NULL, NULL, 0, 0), KR_OK);
    cr_expect_eq(krk_scale(NULL, 1.0f, -1, 0), KR_ERR_INVAL);
    kr_backend_free(be);
}

/* ---- embedding ----------------------------------------------------------------------------- */

/* The whole table, then vocabulary shards of tensor-parallel ranks (rows [row0, row0 + rows)):
 * every token's row is the table's, or zeros when the shard does not hold it. */
Test(elementwise, embed_matches_cpu_exactly)
{
    GT_REQUIRE_GPU();
    static const int64_t dims[] = {4096, 131, 5};
    static const int32_t seq_len[3] = {1, 700, 299}, pos0[3] = {5, 0, 17};
    static const int64_t shard[3][2] = {{0, 1000}, {500, 500}, {250, 300}};
    const int32_t vocab = 1000;
    struct gt_rng rng = {.s = 5000};
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    struct gt_batch b;
    gt_batch_make(&b, &rng, 3, seq_len, pos0, 64, 64, 3, vocab);
    for (int ns = 1; ns <= 3; ns += 2) { /* one token, then the whole batch */
        const int32_t n = ns == 1 ? 1 : b.host.n_tok;
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            const int64_t dim = dims[di];
            const size_t nw = (size_t)(vocab * dim), no = (size_t)n * (size_t)dim;
            float *wf = hrand(&rng, nw, -1.0f, 1.0f);
            uint16_t *wb = kr_malloc(nw * sizeof(uint16_t));
            float *ref = kr_malloc((size_t)b.host.n_tok * (size_t)dim * sizeof(float));
            cr_assert(wb && ref);
            for (size_t i = 0; i < nw; i++) {
                wb[i] = kr_f32_to_bf16(wf[i]);
            }
            krk_bf16 *d_w = gt_dup(wb, nw * 2);
            float *d_out = gt_dalloc(no * 4);
            for (int sh = 0; sh < 3; sh++) {
                const int64_t row0 = shard[sh][0], rows = shard[sh][1];
                cr_assert_eq(krk_embed(d_w + row0 * dim, b.dev.tokens, n, dim, row0, rows, d_out, 0), KR_OK);
                gt_sync();
                const struct kr_tensor t = {.data = wb + row0 * dim, .dtype = KR_DTYPE_BF16, .rows = rows, .cols = dim};
                cr_assert_eq(kr_backend_begin_batch(be, &b.host), KR_OK);
                cr_assert_eq(kr_backend_embed(be, &t, row0, ref), KR_OK);
                float *g = hdown(d_out, no);
                char what[80];
                snprintf(what, sizeof what, "embed n=%d dim=%lld rows [%lld, %lld)", n, (long long)dim,
                         (long long)row0, (long long)(row0 + rows));
                expect_same_bytes(what, g, ref, no * sizeof(float));
                for (int32_t k = 0; k < n; k++) {
                    const int64_t id = b.host.tokens[k];
                    const bool mine = id >= row0 && id < row0 + rows;
                    const float want = mine ? kr_bf16_to_f32(wb[id * dim + dim - 1]) : 0.0f;
                    cr_expect_eq(g[(size_t)k * (size_t)dim + (size_t)dim - 1], want, "%s: token %d (id %lld)", what,
                                 k, (long long)id);
                }
                kr_free(g);
            }
            gt_dfree(d_w);
            gt_dfree(d_out);
            kr_free(wf);
            kr_free(wb);
            kr_free(ref);
        }
    }
    gt_batch_free(&b);
    kr_backend_free(be);
}

/* ---- activations --------------------------------------------------------------------------- */

struct act_shape {
    int64_t n, width, ld_in;
};
static const struct act_shape act_shapes[] = {
    {1, 4096, 8192}, {3, 131, 262}, {1000, 8192, 16384}, {3, 5, 10}, {100, 21504, 43008},
};

/* Every activation, gated (gate and x side by side in one row, as a fused gate|up projection
 * writes them) and not, fp32 and bf16 outputs. */
Test(elementwise, act_matches_cpu)
{
    GT_REQUIRE_GPU();
    static const char *names[4] = {"relu2", "silu", "gelu", "relu"};
    struct gt_rng rng = {.s = 6000};
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    for (size_t si = 0; si < sizeof act_shapes / sizeof act_shapes[0]; si++) {
        const struct act_shape s = act_shapes[si];
        const size_t nin = (size_t)(s.n * s.ld_in), no = (size_t)(s.n * s.width);
        float *in = hrand(&rng, nin, -4.0f, 4.0f), *ref = kr_malloc(no * sizeof(float));
        cr_assert(ref);
        float *d_in = gt_dup(in, nin * 4);
        for (int a = 0; a < 4; a++) {
            for (int gated = 0; gated < 2; gated++) {
                float *d_out = gt_dalloc(no * 4);
                krk_bf16 *d_ob = gt_dalloc(no * 2);
                /* gated: gate = first half of the row, x = second half; else x = first half */
                struct krk_act_params p = {.act = (enum kr_act)a, .gate = gated ? d_in : NULL,
                                           .x = gated ? d_in + s.width : d_in, .ld_in = s.ld_in, .n = s.n,
                                           .width = s.width, .out = d_out, .out_bf16 = d_ob};
                cr_assert_eq(krk_act(&p, 0), KR_OK);
                gt_sync();
                cr_assert_eq(kr_backend_act(be, &(struct krk_act_params){.act = (enum kr_act)a, .gate = gated ? in : NULL,
                                                                            .x = gated ? in + s.width : in,
                                                                            .ld_in = s.ld_in, .n = s.n,
                                                                            .width = s.width, .out = ref}),
                             KR_OK);
                float *g = hdown(d_out, no);
                char what[80];
                snprintf(what, sizeof what, "act %s%s n=%lld width=%lld", gated ? "gated " : "", names[a],
                         (long long)s.n, (long long)s.width);
                if (a == KR_ACT_RELU || a == KR_ACT_RELU2) {
                    expect_same_bytes(what, g, ref, no * sizeof(float));
                } else {
                    gt_expect_close(what, g, ref, no, 1e-12, 2e-5);
                }
                expect_bf16_of("  ... its bf16 output", d_ob, g, no);
                kr_free(g);
                gt_dfree(d_out);
                gt_dfree(d_ob);
            }
        }
        gt_dfree(d_in);
        kr_free(in);
        kr_free(ref);
    }
    kr_backend_free(be);
}

/* ---- gather, casts, conversions ----------------------------------------------------------- */

Test(elementwise, gather_rows_matches_cpu_exactly)
{
    GT_REQUIRE_GPU();
    static const int64_t widths[] = {4096, 131, 5};
    static const int32_t seq_len[2] = {40, 60}, pos0[2] = {0, 9};
    struct gt_rng rng = {.s = 7000};
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    struct gt_batch b;
    gt_batch_make(&b, &rng, 2, seq_len, pos0, 64, 16, 2, 100);
    const int32_t n_out = 37;
    int32_t rows[37];
    for (int32_t i = 0; i < n_out; i++) {
        rows[i] = (int32_t)(gt_uniform(&rng, 0, 1) * (float)b.host.n_tok) % b.host.n_tok;
    }
    b.host.n_out = n_out;
    b.host.out_tok = rows;
    int32_t *d_rows = gt_dup(rows, sizeof rows);
    for (size_t wi = 0; wi < sizeof widths / sizeof widths[0]; wi++) {
        const int64_t width = widths[wi];
        const size_t ns = (size_t)b.host.n_tok * (size_t)width, no = (size_t)n_out * (size_t)width;
        float *src = hrand(&rng, ns, -1.0f, 1.0f), *ref = kr_malloc(no * sizeof(float));
        cr_assert(ref);
        float *d_src = gt_dup(src, ns * 4), *d_dst = gt_dalloc(no * 4);
        cr_assert_eq(krk_gather_rows(d_src, width, d_rows, n_out, d_dst, 0), KR_OK);
        gt_sync();
        cr_assert_eq(kr_backend_begin_batch(be, &b.host), KR_OK);
        cr_assert_eq(kr_backend_gather_out(be, src, width, ref), KR_OK);
        float *g = hdown(d_dst, no);
        char what[64];
        snprintf(what, sizeof what, "gather_rows width=%lld", (long long)width);
        expect_same_bytes(what, g, ref, no * sizeof(float));
        kr_free(g);
        gt_dfree(d_src);
        gt_dfree(d_dst);
        kr_free(src);
        kr_free(ref);
    }
    gt_dfree(d_rows);
    gt_batch_free(&b);
    kr_backend_free(be);
}

/* Random values plus exact rounding ties (low 16 bits 0x8000, both parities of the kept bit),
 * against util/dtype.h's kr_f32_to_bf16. */
Test(elementwise, cast_bf16_rounds_to_nearest_even)
{
    GT_REQUIRE_GPU();
    static const struct {
        int64_t n, cols, ldx;
    } shapes[] = {{1, 4096, 4096}, {3, 131, 135}, {1000, 8192, 8192}, {7, 5, 6}};
    struct gt_rng rng = {.s = 8000};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t n = shapes[si].n, cols = shapes[si].cols, ldx = shapes[si].ldx;
        const size_t nx = (size_t)(n * ldx), no = (size_t)(n * cols);
        float *x = hrand(&rng, nx, -100.0f, 100.0f);
        for (size_t i = 0; i < nx; i += 3) { /* every third value an exact tie */
            uint32_t u;
            memcpy(&u, &x[i], 4);
            u = (u & 0xffff0000u) | 0x8000u;
            memcpy(&x[i], &u, 4);
        }
        float *d_x = gt_dup(x, nx * 4);
        krk_bf16 *d_o = gt_dalloc(no * 2);
        cr_assert_eq(krk_cast_bf16(d_x, ldx, n, cols, d_o, 0), KR_OK);
        gt_sync();
        float *dense = kr_malloc(no * sizeof(float));
        cr_assert(dense);
        for (int64_t t = 0; t < n; t++) {
            memcpy(dense + t * cols, x + t * ldx, (size_t)cols * sizeof(float));
        }
        char what[64];
        snprintf(what, sizeof what, "cast_bf16 n=%lld cols=%lld", (long long)n, (long long)cols);
        expect_bf16_of(what, d_o, dense, no);
        kr_free(dense);
        gt_dfree(d_x);
        gt_dfree(d_o);
        kr_free(x);
    }
}

/* Random bit patterns (NaN, infinities and subnormals included) from f32, f16 and bf16 sources,
 * aligned and at odd byte offsets, against util/dtype.h's conversions bit for bit. */
Test(elementwise, convert_matches_util_dtype_bit_for_bit)
{
    GT_REQUIRE_GPU();
    static const int64_t lens[] = {1, 1001, 1 << 20};
    static const enum kr_dtype dts[] = {KR_DTYPE_F32, KR_DTYPE_F16, KR_DTYPE_BF16};
    struct gt_rng rng = {.s = 9000};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        for (size_t di = 0; di < 3; di++) {
            for (int off = 0; off < 2; off++) {
                const int64_t n = lens[li];
                const enum kr_dtype dt = dts[di];
                const size_t esz = kr_dtype_size(dt), bytes = (size_t)n * esz;
                uint8_t *src = kr_malloc(bytes + 1);
                cr_assert(src);
                for (size_t i = 0; i < bytes + 1; i++) {
                    src[i] = (uint8_t)(gt_uniform(&rng, 0, 256.0f)) & 0xff;
                }
                float *ref = kr_malloc((size_t)n * sizeof(float));
                uint16_t *refb = kr_malloc((size_t)n * sizeof(uint16_t));
                cr_assert(ref && refb);
                kr_convert_to_f32(ref, src + off, dt, (size_t)n);
                for (int64_t i = 0; i < n; i++) {
                    refb[i] = kr_f32_to_bf16(ref[i]);
                }
                uint8_t *d_src = gt_dup(src, bytes + 1);
                float *d_f = gt_dalloc((size_t)n * 4);
                krk_bf16 *d_b = gt_dalloc((size_t)n * 2);
                cr_assert_eq(krk_convert_f32(d_src + off, (int)dt, n, d_f, 0), KR_OK);
                cr_assert_eq(krk_convert_bf16(d_src + off, (int)dt, n, d_b, 0), KR_OK);
                gt_sync();
                float *gf = kr_malloc((size_t)n * sizeof(float));
                uint16_t *gb = kr_malloc((size_t)n * sizeof(uint16_t));
                cr_assert(gf && gb);
                gt_down(gf, d_f, (size_t)n * 4);
                gt_down(gb, d_b, (size_t)n * 2);
                char what[80];
                snprintf(what, sizeof what, "convert %s->f32 n=%lld off=%d", kr_dtype_name(dt), (long long)n, off);
                expect_same_bytes(what, gf, ref, (size_t)n * 4);
                snprintf(what, sizeof what, "convert %s->bf16 n=%lld off=%d", kr_dtype_name(dt), (long long)n, off);
                expect_same_bytes(what, gb, refb, (size_t)n * 2);
                kr_free(gf);
                kr_free(gb);
                gt_dfree(d_src);
                gt_dfree(d_f);
                gt_dfree(d_b);
                kr_free(src);
                kr_free(ref);
                kr_free(refb);
            }
        }
    }
    cr_expect_eq(krk_convert_f32(NULL, 3, 4, NULL, 0), KR_ERR_INVAL);
}

/* ---- RoPE ------------------------------------------------------------------------------------ */

struct rope_shape {
    int64_t n_vec, dim, off, stride, ld;
    bool interleaved;
    float factor;
};
static const struct rope_shape rope_shapes[] = {
    /* q heads of 192 (128 nope + 64 rope), rope at the end of each head, interleaved (MLA) */
    {16, 64, 128, 192, 16 * 192, true, 1.0f},
    /* the same half-split with a YaRN-like cos/sin scale */
    {16, 64, 128, 192, 16 * 192 + 64, false, 0.7f},
    /* GQA q|k heads of 128 rotated whole, half-split */
    {40, 128, 0, 128, 40 * 128, false, 1.0f},
    /* one vector wider than a shared-memory chunk of frequencies (half = 300 > 256) */
    {1, 600, 3, 0, 611, true, 1.0f},
    {2, 600, 1, 605, 1300, false, 1.3f},
};
#define N_ROPE_SHAPES ((int)(sizeof rope_shapes / sizeof rope_shapes[0]))
static int rope_idx[N_ROPE_SHAPES] = {0, 1, 2, 3, 4};
_Static_assert(sizeof rope_idx / sizeof rope_idx[0] == N_ROPE_SHAPES, "one index per shape");

ParameterizedTestParameters(rope, matches_cpu_up_to_128k_positions)
{
    return cr_make_param_array(int, rope_idx, N_ROPE_SHAPES);
}

/* A decode token at position 131071, a prefill chunk ending there, a long prompt from 0 and a
 * mid-range chunk; the parts of each row outside the rotated vectors must stay untouched. */
ParameterizedTest(int *idx, rope, matches_cpu_up_to_128k_positions)
{
    GT_REQUIRE_GPU();
    const struct rope_shape s = rope_shapes[*idx];
    static const int32_t seq_len[4] = {1, 300, 1000, 77}, pos0[4] = {131071, 130772, 0, 65000};
    struct gt_rng rng = {.s = 10000 + (uint64_t)*idx};
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    for (int n_seq = 1; n_seq <= 4; n_seq += 3) { /* decode alone, then the mixed batch */
        struct gt_batch b;
        gt_batch_make(&b, &rng, n_seq, seq_len, pos0, 4096, 256, 4, 10);
        const int32_t n_tok = b.host.n_tok;
        const size_t nx = (size_t)n_tok * (size_t)s.ld;
        const int64_t half = s.dim / 2;
        float *x = hrand(&rng, nx, -2.0f, 2.0f), *inv = kr_malloc((size_t)half * sizeof(float));
        cr_assert(inv);
        for (int64_t j = 0; j < half; j++) { /* theta = 10000, as models build it, in fp32 */
            inv[j] = 1.0f / powf(10000.0f, (float)(2 * j) / (float)s.dim);
        }
        float *d_x = gt_dup(x, nx * 4), *d_inv = gt_dup(inv, (size_t)half * 4);
        /* the same parameters on both sides, the GPU's pointing at device copies */
        const struct krk_rope_params cp = {.x = x, .ld = s.ld, .n_vec = s.n_vec, .stride = s.stride, .off = s.off,
                                           .dim = s.dim, .interleaved = s.interleaved, .inv_freq = inv,
                                           .factor = s.factor};
        struct krk_rope_params p = cp;
        p.x = d_x;
        p.inv_freq = d_inv;
        const struct krk_ctx k = {.batch = b.dev};
        cr_assert_eq(krk_rope(&p, &k), KR_OK);
        gt_sync();
        cr_assert_eq(kr_backend_begin_batch(be, &b.host), KR_OK);
        cr_assert_eq(kr_backend_rope(be, &cp), KR_OK);
        float *g = hdown(d_x, nx);
        char what[96];
        snprintf(what, sizeof what, "rope %s dim=%lld n_vec=%lld n_tok=%d",
                 s.interleaved ? "interleaved" : "half-split", (long long)s.dim, (long long)s.n_vec, n_tok);
        /* whole rows: untouched elements compare exactly equal */
        gt_expect_close(what, g, x, nx, 1e-12, 1e-5);
        kr_free(g);
        gt_dfree(d_x);
        gt_dfree(d_inv);
        kr_free(x);
        kr_free(inv);
        gt_batch_free(&b);
    }
    kr_backend_free(be);
}

/* Two sets of vectors in one launch (krk_rope_pair), as a DSA layer rotates its q_pe
 * (interleaved, the last 64 of each 192) and its indexer queries (half-split, the first 64 of each
 * 128): each against the CPU's rope of that set, same bounds as above; the second set alone (an
 * empty first set) too. */
Test(rope, two_sets_in_one_launch_match_cpu)
{
    GT_REQUIRE_GPU();
    static const int32_t seq_len[3] = {1, 40, 1}, pos0[3] = {131071, 5000, 3};
    struct gt_rng rng = {.s = 10100};
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    struct gt_batch b;
    gt_batch_make(&b, &rng, 3, seq_len, pos0, 4096, 256, 4, 10);
    const int32_t n_tok = b.host.n_tok;
    const int64_t ld_a = 32 * 192, ld_b = 64 * 128 + 5, half = 32;
    const size_t na = (size_t)n_tok * (size_t)ld_a, nb = (size_t)n_tok * (size_t)ld_b;
    float *inv = kr_malloc((size_t)half * sizeof(float));
    cr_assert(inv);
    for (int64_t j = 0; j < half; j++) {
        inv[j] = 1.0f / powf(10000.0f, (float)(2 * j) / 64.0f);
    }
    float *d_inv = gt_dup(inv, (size_t)half * 4);
    for (int first_empty = 0; first_empty < 2; first_empty++) {
        float *xa = hrand(&rng, na, -2.0f, 2.0f), *xb = hrand(&rng, nb, -2.0f, 2.0f);
        float *d_a = gt_dup(xa, na * 4), *d_b = gt_dup(xb, nb * 4);
        const struct krk_rope_params ca = {.x = xa, .ld = ld_a, .n_vec = first_empty ? 0 : 32, .stride = 192,
                                           .off = 128, .dim = 64, .interleaved = true, .inv_freq = inv,
                                           .factor = 0.9f};
        const struct krk_rope_params cb = {.x = xb, .ld = ld_b, .n_vec = 64, .stride = 128, .off = 0, .dim = 64,
                                           .interleaved = false, .inv_freq = inv, .factor = 0.9f};
        struct krk_rope_params pa = ca, pb = cb;
        pa.x = d_a;
        pb.x = d_b;
        pa.inv_freq = pb.inv_freq = d_inv;
        const struct krk_ctx k = {.batch = b.dev};
        cr_assert_eq(krk_rope_pair(&pa, &pb, &k), KR_OK);
        gt_sync();
        if (!first_empty) { /* the pair shares frequencies and factor or is refused */
            pb.factor = 0.8f;
            cr_expect_eq(krk_rope_pair(&pa, &pb, &k), KR_ERR_INVAL, "a pair with two factors");
            pb.factor = 0.9f;
        }
        cr_assert_eq(kr_backend_begin_batch(be, &b.host), KR_OK);
        cr_assert_eq(kr_backend_rope(be, &ca), KR_OK);
        cr_assert_eq(kr_backend_rope(be, &cb), KR_OK);
        float *ga = hdown(d_a, na), *gb = hdown(d_b, nb);
        gt_expect_close(first_empty ? "rope pair (first set empty): q_pe" : "rope pair: q_pe", ga, xa, na, 1e-12,
                        1e-5);
        gt_expect_close(first_empty ? "rope pair (first set empty): indexer q" : "rope pair: indexer q", gb, xb, nb,
                        1e-12, 1e-5);
        kr_free(ga);
        kr_free(gb);
        kr_free(xa);
        kr_free(xb);
        gt_dfree(d_a);
        gt_dfree(d_b);
    }
    gt_dfree(d_inv);
    kr_free(inv);
    gt_batch_free(&b);
    kr_backend_free(be);
}
