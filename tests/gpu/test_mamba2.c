/* Mamba-2 kernels (krk_mamba: krk_conv1d then krk_ssd) against the CPU reference backend's
 * kr_backend_mamba, which runs the same conv + SSD step from the same struct krk_mamba_params:
 * decode batches, prefill chunks from empty and from carried states, mixed batches and padding
 * sequences, on the target shape and on odd shapes; the parameter checks of the two parts. */
#include "gpu-test.h"

#include <criterion/parameterized.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"

struct m2_shape {
    int64_t n_head, head_dim, n_group, d_state, d_conv, chunk;
    bool bias;
    float dt_min, dt_max;
};

enum { SHAPE_REAL, SHAPE_ODD, SHAPE_SCALAR, SHAPE_WIDE };

static const struct m2_shape shapes[] = {
    /* the target model: 128 heads x 64, d_state 128, 8 groups, conv 4 (conv_dim 10240) */
    [SHAPE_REAL] = {128, 64, 8, 128, 4, 256, true, 0.0f, INFINITY},
    /* small odd shape: 6 heads x 24, d_state 40, 3 groups, conv 3 */
    [SHAPE_ODD] = {6, 24, 3, 40, 3, 128, false, 0.0f, INFINITY},
    /* d_state and head_dim not multiples of 4 (scalar paths), one group, conv 2, dt clamped */
    [SHAPE_SCALAR] = {5, 18, 1, 33, 2, 64, true, 0.004f, 0.05f},
    /* head_dim over one 64-column tile, the largest d_state, conv 8 */
    [SHAPE_WIDE] = {4, 80, 2, 256, 8, 128, true, 0.0f, INFINITY},
};

#define M2_MAX_SEQ 40

/* One step: sequence s has len[s] tokens from position pos0[s] (0: empty state); sequences in
 * pad_mask are padding (slot -1 on the GPU). decode_n > 0 builds decode_n one-token sequences
 * instead, at nonzero positions except every ninth. */
struct m2_case {
    const char *name;
    int shape;
    int32_t n_seq;
    int32_t len[M2_MAX_SEQ];
    int32_t pos0[M2_MAX_SEQ];
    uint64_t pad_mask;
    int32_t decode_n;
    uint64_t keep_mask; /* sequences keeping their states after each token but the last (tok_keep) */
};

static const struct m2_case cases[] = {
    {"real: decode 1", SHAPE_REAL, 1, {1}, {100}, 0, 0, 0},
    {"real: decode 37", SHAPE_REAL, 0, {0}, {0}, 0, 37, 0},
    {"real: prefill 1 from empty", SHAPE_REAL, 1, {1}, {0}, 0, 0, 0},
    {"real: prefill 5 from empty", SHAPE_REAL, 1, {5}, {0}, 0, 0, 0},
    {"real: prefill 200 from empty", SHAPE_REAL, 1, {200}, {0}, 0, 0, 0},
    {"real: prefill 3000 from empty", SHAPE_REAL, 1, {3000}, {0}, 0, 0, 0},
    {"real: prefill 1 from state", SHAPE_REAL, 1, {1}, {50}, 0, 0, 0},
    {"real: prefill 5 from state", SHAPE_REAL, 1, {5}, {300}, 0, 0, 0},
    {"real: prefill 200 from state", SHAPE_REAL, 1, {200}, {64}, 0, 0, 0},
    {"real: prefill 3000 from state", SHAPE_REAL, 1, {3000}, {1000}, 0, 0, 0},
    {"real: mixed batch", SHAPE_REAL, 7, {1, 300, 1, 2, 129, 1, 64}, {40, 0, 7, 12, 500, 0, 3}, 0, 0, 0},
    {"real: decode with padding", SHAPE_REAL, 5, {1, 1, 1, 1, 1}, {9, 30, 0, 4, 77}, 1u << 2, 0, 0},
    {"real: mixed with padding", SHAPE_REAL, 5, {70, 1, 1, 65, 3}, {0, 9, 5, 33, 0}, (1u << 1) | (1u << 3), 0, 0},
    {"odd: decode 1", SHAPE_ODD, 1, {1}, {11}, 0, 0, 0},
    {"odd: decode 37", SHAPE_ODD, 0, {0}, {0}, 0, 37, 0},
    {"odd: prefill 1 from empty", SHAPE_ODD, 1, {1}, {0}, 0, 0, 0},
    {"odd: prefill 5 from empty", SHAPE_ODD, 1, {5}, {0}, 0, 0, 0},
    {"odd: prefill 200 from empty", SHAPE_ODD, 1, {200}, {0}, 0, 0, 0},
    {"odd: prefill 3000 from empty", SHAPE_ODD, 1, {3000}, {0}, 0, 0, 0},
    {"odd: prefill 5 from state", SHAPE_ODD, 1, {5}, {2}, 0, 0, 0},
    {"odd: prefill 200 from state", SHAPE_ODD, 1, {200}, {129}, 0, 0, 0},
    {"odd: prefill 3000 from state", SHAPE_ODD, 1, {3000}, {4097}, 0, 0, 0},
    {"odd: mixed with padding", SHAPE_ODD, 6, {1, 130, 2, 1, 63, 9}, {5, 0, 0, 0, 1, 2}, 1u << 4, 0, 0},
    {"scalar: decode 37", SHAPE_SCALAR, 0, {0}, {0}, 0, 37, 0},
    {"scalar: prefill 200 from state", SHAPE_SCALAR, 1, {200}, {17}, 0, 0, 0},
    {"scalar: mixed with padding", SHAPE_SCALAR, 5, {1, 67, 1, 2, 128}, {3, 0, 0, 8, 40}, 1u << 2, 0, 0},
    {"wide: decode 37", SHAPE_WIDE, 0, {0}, {0}, 0, 37, 0},
    {"wide: prefill 3000 from state", SHAPE_WIDE, 1, {3000}, {21}, 0, 0, 0},
    {"wide: mixed with padding", SHAPE_WIDE, 4, {1, 257, 1, 7}, {6, 0, 2, 0}, 1u << 2, 0, 0},
    /* long contexts: chunks of the server's 2048 tokens whose positions cross 32768 and 65536 from
     * carried states (the SSD itself does not depend on the position: only whether a state is
     * carried), the last chunk of a 40,000-token prompt next to a decode at 100,000 */
    {"odd: chunk 2048 crossing 32768", SHAPE_ODD, 1, {2048}, {32768 - 1024}, 0, 0, 0},
    {"odd: chunk 2048 crossing 65536 + decode", SHAPE_ODD, 2, {2048, 1}, {65536 - 1024, 99999}, 0, 0, 0},
    {"real: last chunk of 40000 + decode 100000", SHAPE_REAL, 2, {1088, 1}, {40000 - 1088, 99999}, 0, 0, 0},
    /* speculative decoding's verification: sequences of 2..5 tokens keeping the state after each
     * token but their last in slots of their own, run token by token, beside prefill chunks, decodes
     * and padding; from carried states and from empty */
    {"real: verify 4 + prefill 70 + decode", SHAPE_REAL, 3, {4, 70, 1}, {300, 0, 9}, 0, 0, 1u << 0},
    {"real: verify 16 x 4", SHAPE_REAL, 16, {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4},
     {10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160}, 0, 0, 0xffffu},
    {"odd: verify 2 and 5 with padding", SHAPE_ODD, 4, {2, 1, 5, 65}, {10, 4, 7, 0}, 1u << 1, 0, (1u << 0) | (1u << 2)},
    {"scalar: verify 3 from empty + decode", SHAPE_SCALAR, 2, {3, 1}, {0, 5}, 0, 0, 1u << 0},
    {"wide: verify 5 + prefill 257", SHAPE_WIDE, 2, {5, 257}, {33, 0}, 0, 0, 1u << 0},
};
#define N_CASES ((int)(sizeof cases / sizeof cases[0]))

/* Error bounds (each measured error is printed; measured maxima over these cases on an H200 were
 * NMSE 7e-15 / max 1e-6 for the conv output, 3e-12 / 1.2e-5 for y and the states):
 *  - conv output: the same fp32 sums in the same order on both sides, the GPU fusing multiply-adds;
 *    differences are a few ulp: NMSE 1e-12, max |diff| 1e-5 (outputs are O(1)).
 *  - SSD output y and final SSM states: fp32 on the CPU; on the GPU the chunked scan's products run
 *    in three-pass TF32 on tensor cores (each operand split into a TF32 part and its remainder;
 *    about fp32: measured NMSE <= 2.8e-12 on an H200), the chunk length (64) differs from the
 *    model's, so the in-chunk cumulative sums of dt*A (up to ~100 in magnitude) and the decays taken
 *    from them round differently (relative ~1e-6), and sums run in another order: NMSE 1e-10, max
 *    |diff| 2e-4 (y is O(1)..O(10)).
 *  - conv states: copies of inputs rounded to bf16 on the GPU: equal to the CPU's fp32 copies
 *    rounded to bf16 (bound 0). */
#define CONV_NMSE 1e-12
#define CONV_ABS 1e-5
#define SSD_NMSE 1e-10
#define SSD_ABS 2e-4

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    cr_assert(p, "out of memory");
    return p;
}

/* Rows of `src` ([n_tok, width]) belonging to non-padding sequences, packed. */
static size_t pack_rows(float *dst, const float *src, int64_t width, const struct gt_batch *gb, uint64_t pad_mask)
{
    size_t n = 0;
    for (int32_t s = 0; s < gb->host.n_seq; s++) {
        if (pad_mask >> s & 1) {
            continue;
        }
        const int32_t t0 = gb->seq_tok0[s], nt = gb->seq_tok0[s + 1] - t0;
        memcpy(dst + n, src + (size_t)t0 * (size_t)width, (size_t)nt * (size_t)width * sizeof(float));
        n += (size_t)nt * (size_t)width;
    }
    return n;
}

static bool all_finite(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) {
            return false;
        }
    }
    return true;
}

static void run_case(const struct m2_case *tc, uint64_t seed)
{
    const struct m2_shape *sh = &shapes[tc->shape];
    const int64_t H = sh->n_head, P = sh->head_dim, G = sh->n_group, N = sh->d_state, K = sh->d_conv;
    const int64_t di = H * P, cd = di + 2 * G * N, ld_in = di + cd + H + 3;
    struct gt_rng rng = {seed};

    int32_t n_seq = tc->n_seq, len[M2_MAX_SEQ], pos0[M2_MAX_SEQ];
    if (tc->decode_n > 0) {
        n_seq = tc->decode_n;
        for (int32_t s = 0; s < n_seq; s++) {
            len[s] = 1;
            pos0[s] = s % 9 == 4 ? 0 : 1 + 17 * s;
        }
    } else {
        memcpy(len, tc->len, sizeof len);
        memcpy(pos0, tc->pos0, sizeof pos0);
    }
    int32_t n_keep = 0;
    for (int32_t s = 0; s < n_seq; s++) {
        n_keep += tc->keep_mask >> s & 1 ? len[s] - 1 : 0;
    }
    const int32_t block_size = 64, n_slots = n_seq + 3 + n_keep; /* spare slots must stay untouched */
    int32_t n_blocks = 0;
    for (int32_t s = 0; s < n_seq; s++) {
        n_blocks += (pos0[s] + len[s] + block_size - 1) / block_size;
    }
    struct gt_batch gb;
    gt_batch_make(&gb, &rng, n_seq, len, pos0, block_size, n_blocks, n_slots, 100);
    const int64_t n_tok = gb.host.n_tok;
    /* kept states: slots no sequence holds, in order, for the keeping sequences' tokens but their last */
    int32_t *keep = xmalloc((size_t)(n_tok > 0 ? n_tok : 1) * sizeof(int32_t));
    bool *is_keep = calloc((size_t)n_slots, sizeof(bool));
    int32_t *d_keep = NULL;
    if (tc->keep_mask) {
        int32_t next = 0;
        for (int64_t t = 0; t < n_tok; t++) {
            keep[t] = -1;
        }
        for (int32_t s = 0; s < n_seq; s++) {
            for (int32_t i = 0; (tc->keep_mask >> s & 1) && i < len[s] - 1; i++) {
                bool used = true;
                while (used) {
                    used = false;
                    for (int32_t q = 0; q < n_seq; q++) {
                        used |= gb.seq_slot[q] == next;
                    }
                    next += used;
                }
                cr_assert_lt(next, n_slots);
                keep[gb.seq_tok0[s] + i] = next;
                is_keep[next++] = true;
            }
        }
        gb.host.tok_state_slot = keep;
        d_keep = gt_dup(keep, (size_t)n_tok * sizeof(int32_t));
    }
    for (int32_t s = 0; s < n_seq; s++) {
        if (tc->pad_mask >> s & 1) {
            const int32_t minus1 = -1;
            cr_assert_eq(cudaMemcpy((int32_t *)gb.dev.seq_slot + s, &minus1, 4, cudaMemcpyHostToDevice), cudaSuccess);
        }
    }

    /* inputs: z | xBC | dt, weights rounded to bf16 as the checkpoint's would be */
    float *zx = xmalloc((size_t)(n_tok * ld_in) * sizeof(float));
    for (int64_t t = 0; t < n_tok; t++) {
        float *row = zx + t * ld_in;
        gt_fill(&rng, row, (size_t)(di + cd), -1.7f, 1.7f);
        gt_fill(&rng, row + di + cd, (size_t)(H + 3), -0.5f, 0.5f);
    }
    float *conv_w = xmalloc((size_t)(cd * K) * sizeof(float));
    float *conv_b = xmalloc((size_t)cd * sizeof(float));
    gt_fill(&rng, conv_w, (size_t)(cd * K), -0.6f, 0.6f);
    gt_fill(&rng, conv_b, (size_t)cd, -0.2f, 0.2f);
    gt_round_bf16(conv_w, (size_t)(cd * K));
    gt_round_bf16(conv_b, (size_t)cd);
    float *dt_bias = xmalloc((size_t)H * sizeof(float)), *A_log = xmalloc((size_t)H * sizeof(float));
    float *D = xmalloc((size_t)H * sizeof(float));
    for (int64_t h = 0; h < H; h++) {
        dt_bias[h] = logf(expm1f(gt_uniform(&rng, 0.002f, 0.08f))); /* softplus(dt_bias) in 0.002..0.08 */
        A_log[h] = logf(gt_uniform(&rng, 1.0f, 16.0f));
        D[h] = gt_uniform(&rng, 0.5f, 1.5f);
    }
    gt_round_bf16(dt_bias, (size_t)H);
    gt_round_bf16(A_log, (size_t)H);
    gt_round_bf16(D, (size_t)H);

    /* states: every slot filled (fresh sequences must ignore theirs), conv states bf16 values */
    const size_t conv_n = (size_t)n_slots * (size_t)((K - 1) * cd), ssm_n = (size_t)n_slots * (size_t)(H * P * N);
    float *conv_init = xmalloc(conv_n * sizeof(float)), *ssm_init = xmalloc(ssm_n * sizeof(float));
    gt_fill(&rng, conv_init, conv_n, -1.7f, 1.7f);
    gt_round_bf16(conv_init, conv_n);
    gt_fill(&rng, ssm_init, ssm_n, -1.0f, 1.0f);

    /* CPU reference */
    float *cpu_conv = xmalloc(conv_n * sizeof(float)), *cpu_ssm = xmalloc(ssm_n * sizeof(float));
    memcpy(cpu_conv, conv_init, conv_n * sizeof(float));
    memcpy(cpu_ssm, ssm_init, ssm_n * sizeof(float));
    float *cpu_xbc = xmalloc((size_t)(n_tok * cd) * sizeof(float)), *cpu_y = xmalloc((size_t)(n_tok * di) * sizeof(float));
    kr_backend_t cpu = kr_backend_cpu_create(0);
    cr_assert(cpu);
    cr_assert_eq(kr_backend_begin_batch(cpu, &gb.host), KR_OK);
    /* the same parameters on both sides, the GPU's pointing at device copies */
    const struct krk_mamba_params mp = {
        .zxbcdt = zx, .ld_in = ld_in, .d_inner = di, .n_head = H, .head_dim = P, .n_group = G, .d_state = N,
        .d_conv = K, .chunk = sh->chunk, .conv_w = conv_w, .conv_b = sh->bias ? conv_b : NULL, .dt_bias = dt_bias,
        .A_log = A_log, .D = D, .dt_min = sh->dt_min, .dt_max = sh->dt_max, .conv_state = cpu_conv,
        .ssm_state = cpu_ssm, .xbc = cpu_xbc, .y = cpu_y};
    cr_assert_eq(kr_backend_mamba(cpu, &mp), KR_OK);
    kr_backend_free(cpu);

    /* GPU: the layer's step (conv, then SSD on its output) */
    float *d_zx = gt_dup(zx, (size_t)(n_tok * ld_in) * sizeof(float));
    float *d_w = gt_dup(conv_w, (size_t)(cd * K) * sizeof(float)), *d_b = gt_dup(conv_b, (size_t)cd * sizeof(float));
    float *d_dt_bias = gt_dup(dt_bias, (size_t)H * sizeof(float)), *d_A_log = gt_dup(A_log, (size_t)H * sizeof(float));
    float *d_D = gt_dup(D, (size_t)H * sizeof(float));
    krk_bf16 *d_conv = gt_dup_bf16(conv_init, conv_n);
    float *d_ssm = gt_dup(ssm_init, ssm_n * sizeof(float));
    float *d_xbc = gt_dalloc((size_t)(n_tok * cd) * sizeof(float)), *d_y = gt_dalloc((size_t)(n_tok * di) * sizeof(float));
    const size_t ws_bytes = krk_ssd_workspace_bytes(n_tok, n_seq, H, P, G, N, sh->chunk);
    void *d_ws = ws_bytes ? gt_dalloc(ws_bytes) : NULL; /* NaN-poisoned: read-before-write shows */
    struct krk_mamba_params dp = mp;
    dp.zxbcdt = d_zx;
    dp.conv_w = d_w;
    dp.conv_b = sh->bias ? d_b : NULL;
    dp.dt_bias = d_dt_bias;
    dp.A_log = d_A_log;
    dp.D = d_D;
    dp.conv_state = d_conv;
    dp.ssm_state = d_ssm;
    dp.xbc = d_xbc;
    dp.y = d_y;
    struct krk_ctx kc = {.batch = gb.dev, .workspace = d_ws, .workspace_bytes = ws_bytes};
    kc.batch.tok_keep = d_keep;
    cr_assert_eq(krk_mamba(&dp, &kc), KR_OK);
    gt_sync();

    float *gpu_xbc = xmalloc((size_t)(n_tok * cd) * sizeof(float)), *gpu_y = xmalloc((size_t)(n_tok * di) * sizeof(float));
    float *gpu_ssm = xmalloc(ssm_n * sizeof(float));
    uint16_t *gpu_conv16 = xmalloc(conv_n * sizeof(uint16_t));
    gt_down(gpu_xbc, d_xbc, (size_t)(n_tok * cd) * sizeof(float));
    gt_down(gpu_y, d_y, (size_t)(n_tok * di) * sizeof(float));
    gt_down(gpu_ssm, d_ssm, ssm_n * sizeof(float));
    gt_down(gpu_conv16, d_conv, conv_n * sizeof(uint16_t));

    fprintf(stderr, "mamba2 %s: %lld tokens in %d sequences\n", tc->name, (long long)n_tok, n_seq);
    /* outputs of real sequences; padding rows must still be written */
    size_t max_rows = (size_t)(n_tok * (cd > di ? cd : di));
    max_rows = max_rows > ssm_n ? max_rows : ssm_n;
    float *pg = xmalloc(max_rows * sizeof(float)), *pc = xmalloc(max_rows * sizeof(float));
    size_t n = pack_rows(pg, gpu_xbc, cd, &gb, tc->pad_mask);
    pack_rows(pc, cpu_xbc, cd, &gb, tc->pad_mask);
    gt_expect_close("conv output", pg, pc, n, CONV_NMSE, CONV_ABS);
    n = pack_rows(pg, gpu_y, di, &gb, tc->pad_mask);
    pack_rows(pc, cpu_y, di, &gb, tc->pad_mask);
    gt_expect_close("y", pg, pc, n, SSD_NMSE, SSD_ABS);
    cr_expect(all_finite(gpu_xbc, (size_t)(n_tok * cd)), "unwritten conv output rows (padding included)");
    cr_expect(all_finite(gpu_y, (size_t)(n_tok * di)), "unwritten y rows (padding included)");

    /* states: the real sequences' slots match the CPU; every other slot is untouched */
    const size_t ssm_slot = (size_t)(H * P * N), conv_slot = (size_t)((K - 1) * cd);
    float *gpu_conv = xmalloc(conv_n * sizeof(float)), *cpu_conv16 = xmalloc(conv_n * sizeof(float));
    for (size_t i = 0; i < conv_n; i++) {
        gpu_conv[i] = kr_bf16_to_f32(gpu_conv16[i]);
        cpu_conv16[i] = kr_bf16_to_f32(kr_f32_to_bf16(cpu_conv[i]));
    }
    size_t ns = 0, nc = 0;
    for (int32_t slot = 0; slot < n_slots; slot++) {
        int32_t owner = is_keep[slot] ? n_seq : -1; /* a kept state: compared like a sequence's */
        for (int32_t s = 0; s < n_seq; s++) {
            if (gb.seq_slot[s] == slot && !(tc->pad_mask >> s & 1)) {
                owner = s;
            }
        }
        if (owner < 0) {
            cr_expect(memcmp(gpu_ssm + slot * ssm_slot, ssm_init + slot * ssm_slot, ssm_slot * sizeof(float)) == 0,
                      "SSM state of slot %d (no sequence or padding) was written", slot);
            cr_expect(memcmp(gpu_conv + slot * conv_slot, conv_init + slot * conv_slot, conv_slot * sizeof(float)) == 0,
                      "conv state of slot %d (no sequence or padding) was written", slot);
            continue;
        }
        memcpy(pg + ns, gpu_ssm + slot * ssm_slot, ssm_slot * sizeof(float));
        memcpy(pc + ns, cpu_ssm + slot * ssm_slot, ssm_slot * sizeof(float));
        ns += ssm_slot;
        memmove(gpu_conv + nc, gpu_conv + slot * conv_slot, conv_slot * sizeof(float)); /* packs in place */
        memmove(cpu_conv16 + nc, cpu_conv16 + slot * conv_slot, conv_slot * sizeof(float));
        nc += conv_slot;
    }
    gt_expect_close(tc->keep_mask ? "final and kept SSM states" : "final SSM states", pg, pc, ns, SSD_NMSE, SSD_ABS);
    gt_expect_close("conv states (bf16)", gpu_conv, cpu_conv16, nc, 0.0, 0.0);

    free(pg);
    free(pc);
    free(gpu_conv);
    free(cpu_conv16);
    free(gpu_xbc);
    free(gpu_y);
    free(gpu_ssm);
    free(gpu_conv16);
    gt_dfree(d_zx);
    gt_dfree(d_w);
    gt_dfree(d_b);
    gt_dfree(d_dt_bias);
    gt_dfree(d_A_log);
    gt_dfree(d_D);
    gt_dfree(d_conv);
    gt_dfree(d_ssm);
    gt_dfree(d_xbc);
    gt_dfree(d_y);
    gt_dfree(d_ws);
    free(zx);
    free(conv_w);
    free(conv_b);
    free(dt_bias);
    free(A_log);
    free(D);
    free(conv_init);
    free(ssm_init);
    free(cpu_conv);
    free(cpu_ssm);
    free(cpu_xbc);
    free(cpu_y);
    free(keep);
    free(is_keep);
    gt_dfree(d_keep);
    gt_batch_free(&gb);
}

ParameterizedTestParameters(mamba2, matches_the_cpu_reference)
{
    static int idx[N_CASES];
    for (int i = 0; i < N_CASES; i++) {
        idx[i] = i;
    }
    return cr_make_param_array(int, idx, N_CASES);
}

ParameterizedTest(int *idx, mamba2, matches_the_cpu_reference, .timeout = 300)
{
    GT_REQUIRE_GPU();
    run_case(&cases[*idx], 0x6d616d6261ull + (uint64_t)*idx);
}

Test(mamba2, rejects_invalid_parameters)
{
    GT_REQUIRE_GPU();
    {
        /* grid limits: more sequences than gridDim.z of the update and the scan (y of the conv) */
        const struct krk_ssd_params sp = {.conv_dim = 6 * 24 + 2 * 3 * 40, .ld_dt = 6, .n_head = 6, .head_dim = 24,
                                          .n_group = 3, .d_state = 40, .chunk = 128};
        const struct krk_ctx big = {.batch = {.n_seq = 65536, .n_tok = 65536}};
        cr_expect_eq(krk_ssd(&sp, &big), KR_ERR_INVAL, "65536 sequences exceed gridDim.z");
        const struct krk_conv1d_params cp = {.ld_in = 100, .in_off = 0, .conv_dim = 100, .d_conv = 4};
        cr_expect_eq(krk_conv1d(&cp, &big), KR_ERR_INVAL, "65536 sequences exceed gridDim.y");
        const struct krk_mamba_params mp = {.ld_in = 6 * 24 + 6 * 24 + 2 * 3 * 40 + 6, .d_inner = 6 * 24,
                                            .n_head = 6, .head_dim = 24, .n_group = 3, .d_state = 40, .d_conv = 4,
                                            .chunk = 128};
        cr_expect_eq(krk_mamba(&mp, &big), KR_ERR_INVAL, "the step refuses what its conv refuses");
    }
    const struct krk_ctx none = {0};
    struct krk_ssd_params sp = {.conv_dim = 6 * 24 + 2 * 4 * 40, .ld_dt = 6, .n_head = 6, .head_dim = 24,
                                .n_group = 4, .d_state = 40, .chunk = 128};
    cr_expect_eq(krk_ssd(&sp, &none), KR_ERR_INVAL, "n_group must divide n_head");
    sp.n_group = 3;
    sp.conv_dim = 6 * 24 + 2 * 3 * 40;
    sp.d_state = 300;
    cr_expect_eq(krk_ssd(&sp, &none), KR_ERR_INVAL, "d_state above 256");
    sp.d_state = 40;
    sp.conv_dim += 1;
    cr_expect_eq(krk_ssd(&sp, &none), KR_ERR_INVAL, "conv_dim inconsistent with the shape");
    sp.conv_dim -= 1;
    {
        /* a prefill batch (two tokens in one sequence) with less workspace than it needs; the
         * arrays are never read: the check comes first */
        void *d = gt_dalloc(1 << 16);
        const size_t need = krk_ssd_workspace_bytes(2, 1, 6, 24, 3, 40, 128);
        cr_assert_gt(need, 0u);
        sp.xbc = sp.dt = sp.dt_bias = sp.A_log = sp.D = sp.y = d;
        sp.state = d;
        const struct krk_ctx shortws = {.batch = {.n_tok = 2, .n_seq = 1, .seq_tok0 = d, .seq_pos0 = d,
                                                  .seq_slot = d, .max_seq_tok = 2},
                                        .workspace = d, .workspace_bytes = need - 1};
        cr_expect_eq(krk_ssd(&sp, &shortws), KR_ERR_INVAL, "a workspace one byte short");
        gt_sync();
        gt_dfree(d);
    }
    struct krk_conv1d_params cp = {.ld_in = 100, .in_off = 0, .conv_dim = 100, .d_conv = 9};
    cr_expect_eq(krk_conv1d(&cp, &none), KR_ERR_INVAL, "d_conv above 8");
    cp.d_conv = 4;
    cp.ld_in = 99;
    cr_expect_eq(krk_conv1d(&cp, &none), KR_ERR_INVAL, "rows shorter than in_off + conv_dim");
    cr_expect_eq(krk_ssd(NULL, &none), KR_ERR_INVAL);
    cr_expect_eq(krk_conv1d(NULL, &none), KR_ERR_INVAL);
    cr_expect_eq(krk_mamba(NULL, &none), KR_ERR_INVAL);
    cr_expect_eq(krk_ssd(&sp, NULL), KR_ERR_INVAL, "no context");
}

Test(mamba2, needs_no_workspace_for_single_tokens)
{
    GT_REQUIRE_GPU();
    cr_expect_eq(krk_ssd_workspace_bytes(1, 1, 128, 64, 8, 128, 256), 0u);
    cr_expect_gt(krk_ssd_workspace_bytes(2, 1, 128, 64, 8, 128, 256), 0u);
    /* a bigger batch never needs less */
    cr_expect_geq(krk_ssd_workspace_bytes(8192, 64, 128, 64, 8, 128, 256),
                  krk_ssd_workspace_bytes(8000, 63, 128, 64, 8, 128, 256));
}
