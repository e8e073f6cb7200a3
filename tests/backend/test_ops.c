/* The ops the forward pass fuses explicitly, on the CPU reference (fp32, exact): the RMSNorm that
 * adds the residual first (struct krk_rmsnorm_params.res) equals kr_backend_add followed by the
 * norm bit for bit; the bf16 copies the ops write for the next GEMM (out_bf16) are their fp32
 * outputs rounded to bf16 and leave those outputs unchanged; a GEMM handed a bf16 operand
 * (struct krk_bf16_in) gives what it gives without one (the reference reads x in fp32); RoPE of two
 * sets (kr_backend_rope_pair) is RoPE of each; and an MLA attention carrying its selection
 * (krk_mla_attn_params.select) is the indexer followed by the attention. */
#include "backend.h"
#include "dtype.h"

#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#define N 5
#define DIM 48
#define LDX 56

static uint64_t rng_s = 0x9e3779b97f4a7c15ULL;

static float uniform(float lo, float hi)
{
    rng_s ^= rng_s << 13;
    rng_s ^= rng_s >> 7;
    rng_s ^= rng_s << 17;
    return lo + (hi - lo) * (float)(rng_s >> 40) / (float)(1 << 24);
}

static void fill(float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++) {
        x[i] = uniform(lo, hi);
    }
}

static void expect_bf16_of(const krk_bf16 *b, const float *x, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(b[i], kr_f32_to_bf16(x[i]), "%s: element %zu", what, i);
    }
}

Test(ops, rmsnorm_with_residual_equals_add_then_norm)
{
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    static float x0[N * LDX], res[N * DIM], w[DIM];
    static float xa[N * LDX], xb[N * LDX], outa[N * DIM], outb[N * DIM];
    static krk_bf16 ob[N * DIM];
    fill(x0, N * LDX, -3.0f, 3.0f);
    fill(res, N * DIM, -2.0f, 2.0f);
    fill(w, DIM, 0.5f, 1.5f);
    memcpy(xa, x0, sizeof xa);
    memcpy(xb, x0, sizeof xb);
    /* unfused: x += res row by row (x has a row stride), then the norm */
    for (int i = 0; i < N; i++) {
        cr_assert_eq(kr_backend_add(be, xa + i * LDX, res + i * DIM, DIM), KR_OK);
    }
    const struct krk_rmsnorm_params pa = {.x = xa, .ldx = LDX, .w = w, .n = N, .dim = DIM, .eps = 1e-5f,
                                          .out = outa};
    cr_assert_eq(kr_backend_rmsnorm(be, &pa), KR_OK);
    /* fused, with the bf16 copy */
    const struct krk_rmsnorm_params pb = {.x = xb, .ldx = LDX, .res = res, .w = w, .n = N, .dim = DIM, .eps = 1e-5f,
                                          .out = outb, .out_bf16 = ob};
    cr_assert_eq(kr_backend_rmsnorm(be, &pb), KR_OK);
    cr_assert(!memcmp(xa, xb, sizeof xa), "the residual stream (all of ldx) is the same bit for bit");
    cr_assert(!memcmp(outa, outb, sizeof outa), "the norm's output is the same bit for bit");
    expect_bf16_of(ob, outb, N * DIM, "rmsnorm out_bf16");
    /* an output aliasing x with a residual is refused */
    const struct krk_rmsnorm_params bad = {.x = xb, .ldx = LDX, .res = res, .w = w, .n = N, .dim = DIM,
                                           .eps = 1e-5f, .out = xb};
    cr_expect_eq(kr_backend_rmsnorm(be, &bad), KR_ERR_INVAL);
    kr_backend_free(be);
}

Test(ops, bf16_copies_are_the_outputs_rounded)
{
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    static float y[N * DIM], z[N * 2 * DIM], w[DIM], g1[N * DIM], g2[N * DIM], a1[N * DIM], a2[N * DIM];
    static krk_bf16 gb[N * DIM], ab[N * DIM];
    fill(y, N * DIM, -2.0f, 2.0f);
    fill(z, N * 2 * DIM, -2.0f, 2.0f);
    fill(w, DIM, 0.5f, 1.5f);
    struct krk_gated_rmsnorm_params gp = {.y = y, .z = z, .ldz = 2 * DIM, .w = w, .n = N, .dim = DIM, .group = 16,
                                          .eps = 1e-5f, .out = g1};
    cr_assert_eq(kr_backend_gated_rmsnorm(be, &gp), KR_OK);
    gp.out = g2;
    gp.out_bf16 = gb;
    cr_assert_eq(kr_backend_gated_rmsnorm(be, &gp), KR_OK);
    cr_assert(!memcmp(g1, g2, sizeof g1));
    expect_bf16_of(gb, g2, N * DIM, "gated rmsnorm out_bf16");
    struct krk_act_params ap = {.act = KR_ACT_SILU, .gate = z, .x = z + DIM, .ld_in = 2 * DIM, .n = N, .width = DIM,
                                .out = a1};
    cr_assert_eq(kr_backend_act(be, &ap), KR_OK);
    ap.out = a2;
    ap.out_bf16 = ab;
    cr_assert_eq(kr_backend_act(be, &ap), KR_OK);
    cr_assert(!memcmp(a1, a2, sizeof a1));
    expect_bf16_of(ab, a2, N * DIM, "act out_bf16");
    kr_backend_free(be);
}

Test(ops, matmul_reads_x_in_fp32_whatever_bf16_operand_it_is_given)
{
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    enum { ROWS = 24 };
    static float x[N * DIM], wf[ROWS * DIM], y1[N * ROWS], y2[N * ROWS], o1[N * ROWS], o2[N * ROWS];
    static krk_bf16 xb[N * DIM], ob[N * ROWS];
    fill(x, N * DIM, -1.0f, 1.0f);
    fill(wf, ROWS * DIM, -1.0f, 1.0f);
    for (size_t i = 0; i < N * DIM; i++) {
        xb[i] = 0x7fc0; /* NaN: a reference reading it would show */
    }
    const struct kr_tensor w = {.data = wf, .dtype = KR_DTYPE_F32, .rows = ROWS, .cols = DIM};
    const struct krk_bf16_in in = {.data = xb, .ld = DIM, .cap = N * DIM, .filled = true};
    cr_assert_eq(kr_backend_matmul(be, x, DIM, N, &w, NULL, y1, ROWS, NULL), KR_OK);
    cr_assert_eq(kr_backend_matmul(be, x, DIM, N, &w, NULL, y2, ROWS, &in), KR_OK);
    cr_assert(!memcmp(y1, y2, sizeof y1));
    /* matmul_act: the activation of y, and its bf16 copy when asked */
    cr_assert_eq(kr_backend_matmul_act(be, x, DIM, N, &w, NULL, y2, ROWS, KR_ACT_RELU2, o2, ob, &in), KR_OK);
    const struct krk_act_params ap = {.act = KR_ACT_RELU2, .x = y1, .ld_in = ROWS, .n = N, .width = ROWS, .out = o1};
    cr_assert_eq(kr_backend_act(be, &ap), KR_OK);
    cr_assert(!memcmp(o1, o2, sizeof o1));
    expect_bf16_of(ob, o2, N * ROWS, "matmul_act out_bf16");
    cr_expect(!kr_backend_bf16_operands(be, 8), "the CPU's GEMMs take fp32 operands");
    kr_backend_free(be);
}

/* One sequence of T tokens at positions P0.. in cache blocks of 4 (for the ops that read positions
 * and the paged latent cache). */
#define T 6
#define P0 2
static const int32_t g_pos[T] = {P0, P0 + 1, P0 + 2, P0 + 3, P0 + 4, P0 + 5};
static const int32_t g_tokens[T] = {1, 2, 3, 4, 5, 6}, g_tok0[2] = {0, T}, g_pos0[1] = {P0}, g_slot[1] = {0},
                     g_blocks[2] = {1, 0};
static const struct kr_batch g_batch = {.n_tok = T, .n_seq = 1, .tokens = g_tokens, .pos = g_pos, .seq_tok0 = g_tok0,
                                        .seq_pos0 = g_pos0, .seq_slot = g_slot, .block_table = g_blocks,
                                        .max_blocks = 2};

/* kr_backend_rope_pair is kr_backend_rope on each set, bit for bit, whether the sets share their
 * frequencies and factor (one launch where a backend fuses them) or not. */
Test(ops, rope_pair_is_two_ropes)
{
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    cr_assert_eq(kr_backend_begin_batch(be, &g_batch), KR_OK);
    enum { LDA = 3 * 12, LDB = 2 * 8 + 3 };
    static float a0[T * LDA], b0[T * LDB], a1[T * LDA], b1[T * LDB], a2[T * LDA], b2[T * LDB], inv[4];
    fill(a0, T * LDA, -2.0f, 2.0f);
    fill(b0, T * LDB, -2.0f, 2.0f);
    for (int j = 0; j < 4; j++) {
        inv[j] = 1.0f / powf(10000.0f, (float)(2 * j) / 8.0f);
    }
    for (int same = 1; same >= 0; same--) {
        memcpy(a1, a0, sizeof a1);
        memcpy(b1, b0, sizeof b1);
        memcpy(a2, a0, sizeof a2);
        memcpy(b2, b0, sizeof b2);
        /* three heads of 12 with the rope at their last 8, interleaved; two of 8 rotated whole, half-split */
        struct krk_rope_params ra = {.x = a1, .ld = LDA, .n_vec = 3, .stride = 12, .off = 4, .dim = 8,
                                     .interleaved = true, .inv_freq = inv, .factor = 0.9f};
        struct krk_rope_params rb = {.x = b1, .ld = LDB, .n_vec = 2, .stride = 8, .off = 0, .dim = 8,
                                     .interleaved = false, .inv_freq = inv, .factor = same ? 0.9f : 1.1f};
        cr_assert_eq(kr_backend_rope(be, &ra), KR_OK);
        cr_assert_eq(kr_backend_rope(be, &rb), KR_OK);
        ra.x = a2;
        rb.x = b2;
        cr_assert_eq(kr_backend_rope_pair(be, &ra, &rb), KR_OK);
        cr_assert(!memcmp(a1, a2, sizeof a1), "first set (same frequencies: %d)", same);
        cr_assert(!memcmp(b1, b2, sizeof b1), "second set (same frequencies: %d)", same);
        cr_assert(memcmp(a0, a2, sizeof a0) != 0, "rotated at all");
    }
    kr_backend_free(be);
}

/* An MLA attention op carrying its selection (krk_mla_attn_params.select) is the indexer op, then
 * the attention over what it selected, bit for bit. */
Test(ops, mla_attention_with_selection_is_index_then_attention)
{
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    cr_assert_eq(kr_backend_begin_batch(be, &g_batch), KR_OK);
    enum { H = 2, NOPE = 4, ROPE = 4, VD = 4, R = 8, HI = 2, DI = 8, ROW = R + ROPE + DI, TOPK = 3 };
    static float cache[8 * ROW], iq[T * HI * DI], iw[T * HI], q[T * H * (NOPE + ROPE)], kv_b[H * (NOPE + VD) * R];
    static float out1[T * H * VD], out2[T * H * VD];
    static int32_t idx1[T * TOPK], idx2[T * TOPK];
    fill(cache, 8 * ROW, -1.0f, 1.0f);
    fill(iq, T * HI * DI, -1.0f, 1.0f);
    fill(iw, T * HI, 0.0f, 1.0f);
    fill(q, T * H * (NOPE + ROPE), -1.0f, 1.0f);
    fill(kv_b, H * (NOPE + VD) * R, -0.5f, 0.5f);
    const struct krk_dsa_index_params ip1 = {.iq = iq, .w = iw, .n_head = HI, .head_dim = DI, .cache = cache,
                                             .row = ROW, .key_off = R + ROPE, .block_size = 4, .topk = TOPK,
                                             .idx = idx1};
    struct krk_mla_attn_params ap = {.q = q, .n_head = H, .nope = NOPE, .rope = ROPE, .v_dim = VD, .kv_lora = R,
                                     .kv_b = kv_b, .cache = cache, .row = ROW, .block_size = 4, .idx = idx1,
                                     .topk = TOPK, .scale = 0.4f, .out = out1};
    cr_assert_eq(kr_backend_dsa_index(be, &ip1), KR_OK);
    cr_assert_eq(kr_backend_mla_attention(be, &ap), KR_OK);
    struct krk_dsa_index_params ip2 = ip1;
    ip2.idx = idx2;
    ap.idx = idx2;
    ap.out = out2;
    ap.select = &ip2;
    cr_assert_eq(kr_backend_mla_attention(be, &ap), KR_OK);
    cr_assert(!memcmp(idx1, idx2, sizeof idx1), "the same selection");
    cr_assert(!memcmp(out1, out2, sizeof out1), "the same attention");
    for (int t = 0; t < T; t++) {
        const int32_t n_keys = g_pos[t] + 1;
        for (int j = 0; j < TOPK; j++) {
            cr_assert(idx1[t * TOPK + j] >= 0 && idx1[t * TOPK + j] < n_keys, "token %d selects visible positions", t);
        }
    }
    kr_backend_free(be);
}
