/* FP8 caches on CUDA (--kv-cache-dtype fp8) against the CPU reference's emulation of them.
 *  - GQA attention: the cached e4m3 bytes, decoded as code * scale, equal the CPU's rounded fp32
 *    rows bit for bit (every element of both pools, rows outside the batch included); the outputs
 *    are within the bf16 attention tests' bounds (tests/gpu/test_attention.c: both sides read the
 *    same cached values, so only arithmetic differs).
 *  - MLA / DSA latents: the packed fp8_ds_mla rows (and index keys), decoded, equal the CPU's rows bit
 *    for bit; MLA attention within tests/gpu/test_mla.c's bounds (the per-head fp32 kernel, and the
 *    head-batched tensor-core kernels for the V3.2 latent: codes in bf16, block scales on the partial
 *    scores and on P); the indexer's selection equal to the CPU's (near-ties checked tie-tolerantly;
 *    the tensor-core score variant declines packed keys, so both requests run the fp32 scores).
 *  - End to end on the HF fixtures: CUDA with FP8 caches against the CPU with FP8 caches, and against
 *    HF; the bytes a cached token takes on CUDA equal what `krait plan --kv-cache-dtype fp8` counts;
 *    caches made before the setting are refused at the first step. */
#include "cache.h"
#include "fixture.h"
#include "gpu-test.h"
#include "krk/attention.h"
#include "krk/mla.h"
#include "runner.h"

#include "alloc.h"
#include "dtype.h"
#include "fp8.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

TestSuite(kv_fp8_gpu, .timeout = 600);

/* The bf16 attention tests' bounds (test_attention.c), and test_mla.c's bounds of the per-head fp32
 * MLA kernel (the one FP8 latents take). */
#define DECODE_NMSE 1e-9
#define DECODE_ABS 1e-5
#define PREFILL_NMSE 2e-5
#define PREFILL_ABS 1e-2
#define MLA_NMSE 1e-9
#define MLA_ABS 1e-4

static void *xalloc(size_t bytes)
{
    void *p = kr_calloc(1, bytes ? bytes : 1);
    cr_assert(p, "host allocation of %zu bytes failed", bytes);
    return p;
}

/* Marks the device copy of sequence s as padding (slot -1, block table row -1: a kernel touching its
 * cache faults); the host batch keeps it valid for the CPU, whose rows for it are not compared. */
static void make_pad(struct gt_batch *b, int32_t s)
{
    const int32_t slot = -1;
    cr_assert_eq(cudaMemcpy((int32_t *)b->dev.seq_slot + s, &slot, sizeof slot, cudaMemcpyHostToDevice), cudaSuccess);
    int32_t *row = xalloc((size_t)b->dev.max_blocks * sizeof(int32_t));
    for (int32_t j = 0; j < b->dev.max_blocks; j++) {
        row[j] = -1;
    }
    cr_assert_eq(cudaMemcpy((int32_t *)b->dev.block_table + (int64_t)s * b->dev.max_blocks, row,
                            (size_t)b->dev.max_blocks * sizeof(int32_t), cudaMemcpyHostToDevice),
                 cudaSuccess);
    kr_free(row);
}

/* Row index (slot of the paged pool) of position pos of sequence s. */
static int64_t slot_of(const struct gt_batch *b, int32_t s, int32_t pos, int32_t block_size)
{
    const int32_t blk = b->block_table[(int64_t)s * b->host.max_blocks + pos / block_size];
    return (int64_t)blk * block_size + pos % block_size;
}

/* Marks the pool rows written by the batch's padding sequences (the CPU writes them, CUDA does not). */
static bool *pad_rows(const struct gt_batch *b, const bool *pad, int32_t block_size, int64_t n_rows)
{
    bool *skip = xalloc((size_t)n_rows);
    for (int32_t s = 0; s < b->host.n_seq; s++) {
        for (int32_t t = b->seq_tok0[s]; pad[s] && t < b->seq_tok0[s + 1]; t++) {
            skip[slot_of(b, s, b->pos[t], block_size)] = true;
        }
    }
    return skip;
}

static bool same_bits(float a, float b)
{
    return memcmp(&a, &b, sizeof a) == 0;
}

/* ---- GQA attention ------------------------------------------------------------------------------ */

struct gqa_shape {
    int64_t n_head, n_kv_head, head_dim;
    int32_t block_size;
    float k_scale, v_scale;
};

/* The target shape (32/8 heads of 128) with unit scales; an odd one (head_dim 40, 3 query heads
 * per KV head, block 7) and the widest head (256) with scales that are not powers of two. */
static struct gqa_shape gqa_shapes[] = {
    {32, 8, 128, 16, 1.0f, 1.0f},
    {6, 2, 40, 7, 0.37f, 1.9f},
    {8, 1, 256, 16, 0.05f, 3.0f},
};
#define N_GQA ((int)(sizeof gqa_shapes / sizeof gqa_shapes[0]))

struct gqa_batch {
    const char *name;
    int32_t n_seq;
    int32_t len[6], pos0[6];
    int32_t pad; /* padding sequence or -1 */
};

static const struct gqa_batch gqa_batches[] = {
    {"decode ctx 1", 1, {1}, {0}, -1},
    {"decode ctx 40000", 1, {1}, {39999}, -1},
    {"decode 5 seqs, one padding", 5, {1, 1, 1, 1, 1}, {0, 16, 999, 4100, 63}, 2},
    {"prefill chunks and a decode", 3, {200, 37, 1}, {0, 300, 1500}, -1},
    {"mixed with padding", 4, {17, 1, 130, 5}, {3, 2000, 0, 40}, 1},
};
#define N_GQA_BATCH ((int)(sizeof gqa_batches / sizeof gqa_batches[0]))
static int gqa_ids[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
_Static_assert(sizeof gqa_ids / sizeof gqa_ids[0] == N_GQA * N_GQA_BATCH, "one id per GQA case");

static void gqa_case(const struct gqa_shape *sh, const struct gqa_batch *gb, uint64_t seed)
{
    struct gt_rng rng = {.s = seed};
    const int64_t hd = sh->head_dim, row = sh->n_kv_head * hd, qn = sh->n_head * hd;
    const int64_t ld = qn + 2 * row + 8;
    int32_t need = 0;
    for (int32_t s = 0; s < gb->n_seq; s++) {
        need += (gb->pos0[s] + gb->len[s] + sh->block_size - 1) / sh->block_size;
    }
    const int32_t n_blocks = need + 3;
    struct gt_batch b;
    gt_batch_make(&b, &rng, gb->n_seq, gb->len, gb->pos0, sh->block_size, n_blocks, gb->n_seq, 1000);
    bool pad[6] = {false};
    if (gb->pad >= 0) {
        pad[gb->pad] = true;
        make_pad(&b, gb->pad);
    }
    const int64_t n_rows = (int64_t)n_blocks * sh->block_size;
    const size_t cn = (size_t)n_rows * (size_t)row;
    /* cached prefix: random codes on both sides (the CPU's rows hold code * scale); never-written
     * rows are code 0, value 0 */
    uint8_t *kb = xalloc(cn), *vb = xalloc(cn);
    float *kc = xalloc(cn * sizeof(float)), *vc = xalloc(cn * sizeof(float));
    for (int32_t s = 0; s < gb->n_seq; s++) {
        for (int32_t j = 0; j < gb->pos0[s]; j++) {
            const size_t o = (size_t)slot_of(&b, s, j, sh->block_size) * (size_t)row;
            for (int64_t e = 0; e < row; e++) {
                const uint8_t ck = kr_fp8_e4m3_from_f32(gt_uniform(&rng, -1.0f, 1.0f) / sh->k_scale);
                const uint8_t cv = kr_fp8_e4m3_from_f32(gt_uniform(&rng, -1.0f, 1.0f) / sh->v_scale);
                kb[o + e] = ck;
                vb[o + e] = cv;
                kc[o + e] = kr_fp8_e4m3_to_f32(ck) * sh->k_scale;
                vc[o + e] = kr_fp8_e4m3_to_f32(cv) * sh->v_scale;
            }
        }
    }
    uint8_t *d_kb = gt_dup(kb, cn), *d_vb = gt_dup(vb, cn);
    const int32_t n_tok = b.host.n_tok;
    float *qkv = xalloc((size_t)n_tok * (size_t)ld * sizeof(float));
    for (int32_t t = 0; t < n_tok; t++) {
        gt_fill(&rng, qkv + (size_t)t * (size_t)ld, (size_t)qn, -2.0f, 2.0f);
        gt_fill(&rng, qkv + (size_t)t * (size_t)ld + qn, (size_t)(ld - qn), -1.0f, 1.0f);
    }
    gt_round_bf16(qkv, (size_t)n_tok * (size_t)ld);
    float *d_qkv = gt_dup(qkv, (size_t)n_tok * (size_t)ld * sizeof(float));
    float *d_out = gt_dalloc((size_t)n_tok * (size_t)qn * sizeof(float));
    void *d_ws = gt_dalloc(krk_attn_workspace_bytes(n_tok, sh->n_head, hd));

    const struct krk_attn_params kp = {.q = d_qkv, .k = d_qkv + qn, .v = d_qkv + qn + row, .ld_qkv = ld,
                                       .n_head = sh->n_head, .n_kv_head = sh->n_kv_head, .head_dim = hd,
                                       .scale = 1.0f / sqrtf((float)hd), .k_cache = d_kb, .v_cache = d_vb,
                                       .block_size = sh->block_size, .out = d_out, .kv_fp8 = true,
                                       .k_scale = sh->k_scale, .v_scale = sh->v_scale};
    const struct krk_ctx kx = {.batch = b.dev, .workspace = d_ws};
    cr_assert_eq(krk_attn(&kp, &kx), KR_OK, "%s", gb->name);
    gt_sync();

    kr_backend_t be = kr_backend_cpu_create(0);
    cr_assert(be);
    cr_assert_eq(kr_backend_begin_batch(be, &b.host), KR_OK);
    float *ref = xalloc((size_t)n_tok * (size_t)qn * sizeof(float)), *got = xalloc((size_t)n_tok * (size_t)qn * sizeof(float));
    struct krk_attn_params cp = kp;
    cp.q = qkv;
    cp.k = qkv + qn;
    cp.v = qkv + qn + row;
    cp.k_cache = kc;
    cp.v_cache = vc;
    cp.out = ref;
    cr_assert_eq(kr_backend_attention(be, &cp), KR_OK);

    /* the cached bytes, decoded, against the CPU's rows */
    gt_down(kb, d_kb, cn);
    gt_down(vb, d_vb, cn);
    bool *skip = pad_rows(&b, pad, sh->block_size, n_rows);
    int64_t bad = 0;
    for (size_t i = 0; i < cn; i++) {
        if (!skip[i / (size_t)row]) {
            bad += !same_bits(kr_fp8_e4m3_to_f32(kb[i]) * sh->k_scale, kc[i]) ||
                   !same_bits(kr_fp8_e4m3_to_f32(vb[i]) * sh->v_scale, vc[i]);
        }
    }
    char what[200];
    snprintf(what, sizeof what, "gqa fp8 %s [%lld/%lld x %lld, block %d, scales %g %g]", gb->name,
             (long long)sh->n_head, (long long)sh->n_kv_head, (long long)hd, sh->block_size, (double)sh->k_scale,
             (double)sh->v_scale);
    cr_expect_eq(bad, 0, "%s: %lld cached K/V values decode differently from the CPU's", what, (long long)bad);

    /* outputs of the real sequences, compacted; padding rows finite */
    gt_down(got, d_out, (size_t)n_tok * (size_t)qn * sizeof(float));
    size_t n = 0;
    int64_t bad_pad = 0;
    for (int32_t t = 0; t < n_tok; t++) {
        const float *g = got + (size_t)t * (size_t)qn;
        if (pad[b.tok_seq[t]]) {
            for (int64_t i = 0; i < qn; i++) {
                bad_pad += !isfinite(g[i]);
            }
            continue;
        }
        memmove(got + n, g, (size_t)qn * sizeof(float));
        memmove(ref + n, ref + (size_t)t * (size_t)qn, (size_t)qn * sizeof(float));
        n += (size_t)qn;
    }
    cr_expect_eq(bad_pad, 0, "%s: %lld padding outputs not finite", what, (long long)bad_pad);
    if (b.dev.max_seq_tok == 1) {
        gt_expect_close(what, got, ref, n, DECODE_NMSE, DECODE_ABS);
    } else {
        gt_expect_close(what, got, ref, n, PREFILL_NMSE, PREFILL_ABS);
    }

    kr_backend_free(be);
    kr_free(skip);
    kr_free(ref);
    kr_free(got);
    kr_free(qkv);
    kr_free(kb);
    kr_free(vb);
    kr_free(kc);
    kr_free(vc);
    gt_dfree(d_ws);
    gt_dfree(d_out);
    gt_dfree(d_qkv);
    gt_dfree(d_kb);
    gt_dfree(d_vb);
    gt_batch_free(&b);
}

ParameterizedTestParameters(kv_fp8_gpu, gqa_cache_bytes_and_outputs_match_cpu)
{
    return cr_make_param_array(int, gqa_ids, N_GQA * N_GQA_BATCH);
}

ParameterizedTest(int *ci, kv_fp8_gpu, gqa_cache_bytes_and_outputs_match_cpu)
{
    GT_REQUIRE_GPU();
    gqa_case(&gqa_shapes[*ci / N_GQA_BATCH], &gqa_batches[*ci % N_GQA_BATCH], 5000 + (uint64_t)*ci);
}

/* ---- MLA / DSA latents ------------------------------------------------------------------------- */

struct lat_shape {
    int64_t n_head, kv_lora, rope, nope, v_dim, idx_dim;
    int32_t block_size;
    float scale;
    bool ue8m0; /* the index keys' scales */
};

/* DeepSeek-V3.2's latent and index key; c_kv of 200 (a last block of 72) with ue8m0 key scales;
 * an index key of two blocks. */
static const struct lat_shape lat_shapes[] = {
    {16, 512, 64, 128, 128, 128, 64, 0.5f, false},
    {3, 200, 16, 16, 24, 64, 16, 2.0f, true},
    {4, 256, 8, 32, 32, 256, 16, 1.0f, false},
};
#define N_LAT ((int)(sizeof lat_shapes / sizeof lat_shapes[0]))

struct lat_batch {
    const char *name;
    int32_t topk;
    int32_t n_seq;
    int32_t len[6], pos0[6];
    int32_t pad;
};

static const struct lat_batch lat_batches[] = {
    {"decode ctx 1, 333, 4100", 2048, 3, {1, 1, 1}, {0, 332, 4099}, -1},
    {"prefill chunks to ctx 4100 and 333", 256, 3, {100, 33, 1}, {4000, 300, 0}, -1},
    {"many sequences with padding", 128, 6, {1, 1, 5, 1, 3, 17}, {0, 332, 20, 4099, 100, 64}, 4},
};
#define N_LAT_BATCH ((int)(sizeof lat_batches / sizeof lat_batches[0]))
static int lat_ids[] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
_Static_assert(sizeof lat_ids / sizeof lat_ids[0] == N_LAT * N_LAT_BATCH, "one id per latent case");

/* One packed row and the CPU's fp32 row of the same values: c_kv quantized per block as
 * kr_fp8_act_quant does, k_pe bf16, the index key as the FP8 indexer leaves it (a quantized block's
 * code * scale). */
static void lat_row_fill(struct gt_rng *r, const struct lat_shape *sh, float *f, uint8_t *p)
{
    const int64_t R = sh->kv_lora, Dr = sh->rope, Di = sh->idx_dim, lat = krk_fp8_latent_bytes(R, Dr);
    float x[256];
    uint8_t q[256];
    float s[2];
    for (int64_t b0 = 0; b0 < R; b0 += 128) {
        const int64_t len = R - b0 < 128 ? R - b0 : 128;
        gt_fill(r, x, (size_t)len, -3.0f, 3.0f);
        cr_assert_eq(kr_fp8_act_quant(x, len, len, false, q, s), KR_OK);
        memcpy(p + b0, q, (size_t)len);
        memcpy(p + R + 4 * (b0 / 128), s, 4);
        for (int64_t i = 0; i < len; i++) {
            f[b0 + i] = kr_fp8_e4m3_to_f32(q[i]) * s[0];
        }
    }
    for (int64_t i = 0; i < Dr; i++) {
        const uint16_t h = kr_f32_to_bf16(gt_uniform(r, -1.0f, 1.0f));
        memcpy(p + R + 4 * krk_fp8_cache_blocks(R) + 2 * i, &h, 2);
        f[R + i] = kr_bf16_to_f32(h);
    }
    const int64_t blk = Di < 128 ? Di : 128;
    for (int64_t b0 = 0; b0 < Di; b0 += blk) {
        gt_fill(r, x, (size_t)blk, -2.0f, 2.0f);
        cr_assert_eq(kr_fp8_act_quant(x, blk, blk, sh->ue8m0, q, s), KR_OK);
        memcpy(p + lat + b0, q, (size_t)blk);
        memcpy(p + lat + Di + 4 * (b0 / blk), s, 4);
        for (int64_t i = 0; i < blk; i++) {
            f[R + Dr + b0 + i] = kr_fp8_e4m3_to_f32(q[i]) * s[0];
        }
    }
}

/* A packed row's values as fp32 [R + Dr + Di]. */
static void lat_row_decode(const struct lat_shape *sh, const uint8_t *p, float *f)
{
    const int64_t R = sh->kv_lora, Dr = sh->rope, Di = sh->idx_dim, lat = krk_fp8_latent_bytes(R, Dr);
    for (int64_t i = 0; i < R; i++) {
        float s;
        memcpy(&s, p + R + 4 * (i / 128), 4);
        f[i] = kr_fp8_e4m3_to_f32(p[i]) * s;
    }
    for (int64_t i = 0; i < Dr; i++) {
        uint16_t h;
        memcpy(&h, p + R + 4 * krk_fp8_cache_blocks(R) + 2 * i, 2);
        f[R + i] = kr_bf16_to_f32(h);
    }
    for (int64_t i = 0; i < Di; i++) {
        float s;
        memcpy(&s, p + lat + Di + 4 * (i / 128), 4);
        f[R + Dr + i] = kr_fp8_e4m3_to_f32(p[lat + i]) * s;
    }
}

static int cmp_desc(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* Index scores of token t over positions 0..pos in double from the CPU's rows. */
static void lat_scores(const struct gt_batch *b, int32_t t, const float *rows, int64_t frow, int64_t key_off,
                       int32_t block_size, const float *iq, const float *w, int64_t Hi, int64_t Di, double *out)
{
    const int32_t s = b->tok_seq[t];
    for (int32_t j = 0; j <= b->pos[t]; j++) {
        const float *k = rows + slot_of(b, s, j, block_size) * frow + key_off;
        double acc = 0.0;
        for (int64_t h = 0; h < Hi; h++) {
            const float *q = iq + ((int64_t)t * Hi + h) * Di;
            double d = 0.0;
            for (int64_t i = 0; i < Di; i++) {
                d += (double)q[i] * (double)k[i];
            }
            acc += (double)w[(int64_t)t * Hi + h] * (d > 0.0 ? d : 0.0);
        }
        out[j] = acc;
    }
}

static void lat_case(const struct lat_shape *sh, const struct lat_batch *lb, uint64_t seed)
{
    struct gt_rng rng = {.s = seed};
    const int64_t H = sh->n_head, R = sh->kv_lora, Dr = sh->rope, Dn = sh->nope, Dv = sh->v_dim, Di = sh->idx_dim;
    const int64_t qd = Dn + Dr, frow = R + Dr + Di, lat = krk_fp8_latent_bytes(R, Dr);
    const int64_t brow = lat + krk_fp8_key_bytes(Di), Hi = 4;
    const int32_t bsz = sh->block_size, topk = lb->topk;
    int32_t need = 0;
    for (int32_t s = 0; s < lb->n_seq; s++) {
        need += (lb->pos0[s] + lb->len[s] + bsz - 1) / bsz;
    }
    const int32_t n_blocks = need + 2;
    const int64_t n_rows = (int64_t)n_blocks * bsz;
    struct gt_batch b;
    gt_batch_make(&b, &rng, lb->n_seq, lb->len, lb->pos0, bsz, n_blocks, lb->n_seq, 1000);
    bool pad[6] = {false};
    if (lb->pad >= 0) {
        pad[lb->pad] = true;
        make_pad(&b, lb->pad);
    }
    const int32_t n_tok = b.host.n_tok;
    char name[200];
    snprintf(name, sizeof name, "mla fp8 H%lld R%lld rope %lld idx %lld%s, %s", (long long)H, (long long)R,
             (long long)Dr, (long long)Di, sh->ue8m0 ? " (ue8m0 keys)" : "", lb->name);

    /* every row of the pool filled (the batch's rows are then rewritten by the step) */
    float *rows = xalloc((size_t)n_rows * (size_t)frow * sizeof(float));
    uint8_t *bytes = xalloc((size_t)n_rows * (size_t)brow);
    for (int64_t r = 0; r < n_rows; r++) {
        lat_row_fill(&rng, sh, rows + r * frow, bytes + r * brow);
    }
    uint8_t *d_cache = gt_dup(bytes, (size_t)n_rows * (size_t)brow);

    /* the step's new rows: kva [c_kv | k_pe] and index keys through the CPU's FP8 round trip */
    kr_backend_t be = kr_backend_cpu_create(0);
    cr_assert(be);
    cr_assert_eq(kr_backend_begin_batch(be, &b.host), KR_OK);
    const size_t n_kva = (size_t)n_tok * (size_t)(R + Dr), n_ik = (size_t)n_tok * (size_t)Di;
    float *kva = xalloc(n_kva * sizeof(float)), *ik = xalloc(n_ik * sizeof(float));
    gt_fill(&rng, kva, n_kva, -2.0f, 2.0f);
    gt_fill(&rng, ik, n_ik, -1.0f, 1.0f);
    const struct krk_fp8_round_params fr = {.x = ik, .ld = Di, .n = n_tok, .dim = Di, .block = Di < 128 ? Di : 128,
                                            .hadamard = true, .ue8m0 = sh->ue8m0};
    cr_assert_eq(kr_backend_fp8_round(be, &fr), KR_OK);
    float *d_kva = gt_dup(kva, n_kva * sizeof(float)), *d_ik = gt_dup(ik, n_ik * sizeof(float));
    const struct krk_mla_cache_params cw = {.c_kv = kva, .ld_ckv = R + Dr, .k_pe = kva + R, .ld_kpe = R + Dr,
                                            .ik = ik, .kv_lora = R, .rope = Dr, .idx_dim = Di, .cache = rows,
                                            .block_size = bsz, .fp8 = true};
    cr_assert_eq(kr_backend_mla_cache_write(be, &cw), KR_OK);
    struct krk_mla_cache_params kw = cw;
    kw.c_kv = d_kva;
    kw.k_pe = d_kva + R;
    kw.ik = d_ik;
    kw.cache = d_cache;
    const struct krk_ctx kx0 = {.batch = b.dev};
    cr_assert_eq(krk_mla_cache_write(&kw, &kx0), KR_OK);
    gt_sync();

    /* every row of the pool, decoded, bit for bit the CPU's */
    gt_down(bytes, d_cache, (size_t)n_rows * (size_t)brow);
    bool *skip = pad_rows(&b, pad, bsz, n_rows);
    float *dec = xalloc((size_t)frow * sizeof(float));
    int64_t bad_lat = 0, bad_pe = 0, bad_key = 0;
    for (int64_t r = 0; r < n_rows; r++) {
        if (skip[r]) {
            continue;
        }
        lat_row_decode(sh, bytes + r * brow, dec);
        const float *c = rows + r * frow;
        for (int64_t i = 0; i < frow; i++) {
            const bool ok = same_bits(dec[i], c[i]);
            bad_lat += !ok && i < R;
            bad_pe += !ok && i >= R && i < R + Dr;
            bad_key += !ok && i >= R + Dr;
        }
    }
    fprintf(stderr, "  %s: %lld rows decoded: %lld c_kv, %lld k_pe, %lld index key values differ from the CPU's\n",
            name, (long long)n_rows, (long long)bad_lat, (long long)bad_pe, (long long)bad_key);
    cr_expect_eq(bad_lat + bad_pe + bad_key, 0, "%s: the packed rows do not decode to the CPU's values", name);

    /* the indexer over the packed keys against the CPU's over its rows */
    const size_t n_iq = (size_t)n_tok * (size_t)(Hi * Di), n_idx = (size_t)n_tok * (size_t)topk;
    float *iq = xalloc(n_iq * sizeof(float)), *w = xalloc((size_t)n_tok * (size_t)Hi * sizeof(float));
    gt_fill(&rng, iq, n_iq, -1.0f, 1.0f);
    gt_fill(&rng, w, (size_t)n_tok * (size_t)Hi, 0.0f, 1.0f);
    int32_t *idx = xalloc(n_idx * sizeof(int32_t)), *got_idx = xalloc(n_idx * sizeof(int32_t));
    const struct krk_dsa_index_params ip = {.iq = iq, .w = w, .n_head = Hi, .head_dim = Di, .cache = rows,
                                            .row = frow, .key_off = R + Dr, .block_size = bsz, .topk = topk,
                                            .idx = idx};
    cr_assert_eq(kr_backend_dsa_index(be, &ip), KR_OK);
    float *d_iq = gt_dup(iq, n_iq * sizeof(float)), *d_w = gt_dup(w, (size_t)n_tok * (size_t)Hi * sizeof(float));
    int32_t *d_idx = gt_dalloc(n_idx * sizeof(int32_t));
    const size_t iws = krk_dsa_index_workspace_bytes(n_tok, b.dev.max_ctx);
    void *d_iws = gt_dalloc(iws);
    struct krk_dsa_index_params kip = ip;
    kip.iq = d_iq;
    kip.w = d_w;
    kip.cache = d_cache;
    kip.row = brow;
    kip.key_off = lat;
    kip.idx = d_idx;
    kip.fp8 = true;
    for (int variant = KRK_DSA_SCORE_FP32; variant <= KRK_DSA_SCORE_MMA; variant++) { /* MMA declines FP8 keys */
        const struct krk_ctx kx = {.batch = b.dev, .workspace = d_iws, .workspace_bytes = iws, .dsa_score = variant};
        cr_assert_eq(krk_dsa_index(&kip, &kx), KR_OK);
        gt_down(got_idx, d_idx, n_idx * sizeof(int32_t));
        int64_t differ = 0, near = 0;
        double *sc = xalloc((size_t)b.dev.max_ctx * sizeof(double)), *sorted = xalloc((size_t)b.dev.max_ctx * sizeof(double));
        for (int32_t t = 0; t < n_tok; t++) {
            const int32_t *g = got_idx + (int64_t)t * topk, *r = idx + (int64_t)t * topk;
            if (pad[b.tok_seq[t]] || !memcmp(g, r, (size_t)topk * sizeof(int32_t))) {
                continue;
            }
            /* a different selection is right only at a near-tie of the k-th score: every chosen
             * position scores at least the CPU's k-th less a relative 1e-4 */
            const int32_t n_keys = b.pos[t] + 1;
            lat_scores(&b, t, rows, frow, R + Dr, bsz, iq, w, Hi, Di, sc);
            memcpy(sorted, sc, (size_t)n_keys * sizeof(double));
            qsort(sorted, (size_t)n_keys, sizeof(double), cmp_desc);
            const double v_k = sorted[topk - 1], band = 1e-4 * fabs(v_k) + 1e-12;
            bool ok = n_keys > topk;
            for (int32_t j = 0; ok && j < topk; j++) {
                ok = g[j] >= 0 && g[j] <= b.pos[t] && (j == 0 || g[j] > g[j - 1]) && sc[g[j]] >= v_k - band;
            }
            near += ok;
            differ += !ok;
        }
        fprintf(stderr, "  %s: index (%s) selections: %lld differ from the CPU's at near-ties, %lld otherwise\n", name,
                variant == KRK_DSA_SCORE_MMA ? "mma requested" : "fp32", (long long)near, (long long)differ);
        cr_expect_eq(differ, 0, "%s: %lld selections differ from the CPU's", name, (long long)differ);
        kr_free(sc);
        kr_free(sorted);
    }

    /* MLA attention, sparse (the CPU's selection) and dense, both kernel requests */
    const size_t n_q = (size_t)n_tok * (size_t)(H * qd), n_kvb = (size_t)(H * (Dn + Dv)) * (size_t)R;
    const size_t n_out = (size_t)n_tok * (size_t)(H * Dv);
    float *q = xalloc(n_q * sizeof(float)), *kv_b = xalloc(n_kvb * sizeof(float));
    gt_fill(&rng, q, n_q, -1.0f, 1.0f);
    gt_fill(&rng, kv_b, n_kvb, -0.1f, 0.1f);
    gt_round_bf16(kv_b, n_kvb);
    float *d_q = gt_dup(q, n_q * sizeof(float)), *d_kvb = gt_dup(kv_b, n_kvb * sizeof(float));
    int32_t *d_sel = gt_dup(idx, n_idx * sizeof(int32_t));
    float *ref = xalloc(n_out * sizeof(float)), *got = xalloc(n_out * sizeof(float));
    float *d_out = gt_dalloc(n_out * sizeof(float));
    const size_t aws = krk_mla_attn_workspace_bytes(n_tok, H, R, b.dev.max_ctx);
    void *d_aws = aws ? gt_dalloc(aws) : NULL;
    for (int variant = KRK_MLA_ATTN_PER_HEAD; variant <= KRK_MLA_ATTN_HEADS; variant++) {
        for (int sparse = 1; sparse >= 0; sparse--) {
            const struct krk_mla_attn_params cp = {.q = q, .n_head = H, .nope = Dn, .rope = Dr, .v_dim = Dv,
                                                   .kv_lora = R, .kv_b = kv_b, .cache = rows, .row = frow,
                                                   .block_size = bsz, .idx = sparse ? idx : NULL, .topk = topk,
                                                   .scale = sh->scale, .out = ref};
            struct krk_mla_attn_params kp = cp;
            kp.q = d_q;
            kp.kv_b = d_kvb;
            kp.cache = d_cache;
            kp.row = brow;
            kp.idx = sparse ? d_sel : NULL;
            kp.out = d_out;
            kp.fp8 = true;
            const struct krk_ctx kx = {.batch = b.dev, .workspace = d_aws, .workspace_bytes = aws, .mla_attn = variant};
            if (variant == KRK_MLA_ATTN_HEADS) {
                /* FP8 latents take the per-head kernel (the head-batched kernel's FP8 variant exceeded
                 * its largest-error bound, docs/FP8.md): asking for the heads kernel runs the per-head one,
                 * held to the per-head bounds below */
                cr_expect(!krk_mla_heads_fits(&kp, &kx), "%s: the head-batched kernel takes FP8 latents", name);
            }
            cr_assert_eq(cudaMemset(d_out, 0xFF, n_out * sizeof(float)), cudaSuccess);
            cr_assert_eq(krk_mla_attention(&kp, &kx), KR_OK);
            gt_down(got, d_out, n_out * sizeof(float));
            cr_assert_eq(kr_backend_mla_attention(be, &cp), KR_OK);
            size_t n_cmp = 0;
            int64_t bad_pad = 0;
            for (int32_t t = 0; t < n_tok; t++) {
                const size_t o = (size_t)t * (size_t)(H * Dv);
                if (pad[b.tok_seq[t]]) {
                    for (int64_t i = 0; i < H * Dv; i++) {
                        bad_pad += !isfinite(got[o + (size_t)i]);
                    }
                    continue;
                }
                memmove(ref + n_cmp, ref + o, (size_t)(H * Dv) * sizeof(float));
                memmove(got + n_cmp, got + o, (size_t)(H * Dv) * sizeof(float));
                n_cmp += (size_t)(H * Dv);
            }
            char what[260];
            snprintf(what, sizeof what, "%s, attention %s%s", name, sparse ? "sparse" : "dense",
                     variant == KRK_MLA_ATTN_HEADS ? " (heads requested)" : "");
            const double keys = b.dev.max_ctx > 4096 ? (double)b.dev.max_ctx / 4096.0 : 1.0;
            gt_expect_close(what, got, ref, n_cmp, MLA_NMSE * keys, MLA_ABS);
            cr_expect_eq(bad_pad, 0, "%s: %lld padding outputs not finite", what, (long long)bad_pad);
        }
    }

    kr_backend_free(be);
    gt_dfree(d_aws);
    gt_dfree(d_out);
    gt_dfree(d_sel);
    gt_dfree(d_q);
    gt_dfree(d_kvb);
    gt_dfree(d_iws);
    gt_dfree(d_idx);
    gt_dfree(d_iq);
    gt_dfree(d_w);
    gt_dfree(d_kva);
    gt_dfree(d_ik);
    gt_dfree(d_cache);
    kr_free(ref);
    kr_free(got);
    kr_free(q);
    kr_free(kv_b);
    kr_free(iq);
    kr_free(w);
    kr_free(idx);
    kr_free(got_idx);
    kr_free(dec);
    kr_free(skip);
    kr_free(kva);
    kr_free(ik);
    kr_free(rows);
    kr_free(bytes);
    gt_batch_free(&b);
}

ParameterizedTestParameters(kv_fp8_gpu, mla_cache_bytes_index_and_attention_match_cpu)
{
    return cr_make_param_array(int, lat_ids, N_LAT * N_LAT_BATCH);
}

ParameterizedTest(int *ci, kv_fp8_gpu, mla_cache_bytes_index_and_attention_match_cpu)
{
    GT_REQUIRE_GPU();
    lat_case(&lat_shapes[*ci / N_LAT_BATCH], &lat_batches[*ci % N_LAT_BATCH], 6000 + (uint64_t)*ci);
}

/* ---- end to end ---------------------------------------------------------------------------------- */

/* Mean |logprob| difference bounds: CUDA against the CPU, both with FP8 caches (the GEMM operands'
 * bf16 rounding can move a cached value across an e4m3 rounding boundary, a step of 1/16 relative,
 * so this is looser than the bf16 tests' 0.02 against HF); and against HF, the CPU test's KV8_MEAN
 * (tests/model/test_kv_fp8.c). With routing or selection the worst quarter of positions is left
 * out, as the other model tests do. Not yet measured on a GPU. */
#define KV8_CPU_MEAN 0.05
#define KV8_HF_MEAN 0.15

static const struct fx_id e2e_fixtures[] = {
    {"nemotron_h", "nh_mamba_attn_mlp"},
    {"deepseek_v32", "ds_short"},
    {"hybrid", "hy_mdme"},
    {"hybrid", "hy_plus"},
};
#define N_E2E ((int)(sizeof e2e_fixtures / sizeof e2e_fixtures[0]))
static int e2e_ids[N_E2E] = {0, 1, 2, 3};

/* Loads a fixture on `be` with --kv-cache-dtype fp8 and caches made after the setting. */
static void load_fp8(struct fx *f, const struct fx_id *id, kr_backend_t be)
{
    fx_load_on(f, id->family, id->name, be, 2);
    struct kr_err err = {0};
    cr_assert_eq(kr_model_set_kv_cache_dtype(f->m, KR_KV_CACHE_FP8, &err), KR_OK, "%s", err.msg);
    const int32_t n_slots = f->c->n_slots, n_blocks = f->c->n_blocks, bs = f->c->block_size;
    kr_cache_free(f->c);
    f->c = NULL;
    cr_assert_eq(kr_cache_create(f->m, n_slots, n_blocks, bs, &f->c), KR_OK);
}

/* Mean over positions of mean |a - b| over the vocabulary, the worst quarter left out when `drop`. */
static double mean_dev(const float *a, const float *b, int32_t n, int64_t vocab, bool drop)
{
    double *pos = xalloc((size_t)n * sizeof(double));
    for (int32_t t = 0; t < n; t++) {
        for (int64_t k = 0; k < vocab; k++) {
            pos[t] += fabs((double)a[t * vocab + k] - (double)b[t * vocab + k]) / (double)vocab;
        }
    }
    int32_t kept = n;
    for (int32_t d = drop ? n / 4 : 0; d > 0; d--, kept--) {
        int32_t at = 0;
        for (int32_t t = 1; t < n; t++) {
            at = pos[t] > pos[at] ? t : at;
        }
        pos[at] = -1;
    }
    double m = 0;
    for (int32_t t = 0; t < n; t++) {
        m += pos[t] >= 0 ? pos[t] : 0;
    }
    kr_free(pos);
    return kept ? m / kept : 0;
}

ParameterizedTestParameters(kv_fp8_gpu, models_match_the_cpu)
{
    return cr_make_param_array(int, e2e_ids, N_E2E);
}

ParameterizedTest(int *idx, kv_fp8_gpu, models_match_the_cpu)
{
    GT_REQUIRE_GPU();
    const struct fx_id *id = &e2e_fixtures[*idx];
    struct kr_err err = {0};
    kr_backend_t gbe = NULL;
    cr_assert_eq(kr_backend_cuda_create(0, true, &gbe, &err), KR_OK, "%s", err.msg);
    cr_assert(kr_backend_can_kv_fp8(gbe) && kr_backend_kv_fp8_packed(gbe));
    struct fx g, c;
    load_fp8(&g, id, gbe);
    load_fp8(&c, id, kr_backend_cpu_create(2));
    cr_assert(g.c->fp8 && !c.c->fp8, "packed pools on CUDA only");
    const bool discrete = g.m->cfg.n_expert > 0 || strchr(g.m->cfg.pattern, 'D') != NULL;
    for (int32_t i = 0; i < g.n_prompts; i++) {
        const struct fx_prompt *p = &g.prompts[i];
        const size_t nv = (size_t)p->n * (size_t)g.vocab;
        float *lg = xalloc(nv * sizeof(float)), *lc = xalloc(nv * sizeof(float));
        cr_assert_eq(kr_run_prompt_logprobs(g.m, g.c, p->ids, p->n, 0, lg, &err), KR_OK, "%s", err.msg);
        cr_assert_eq(kr_run_prompt_logprobs(c.m, c.c, p->ids, p->n, 0, lc, &err), KR_OK, "%s", err.msg);
        int64_t bad = 0;
        for (size_t k = 0; k < nv; k++) {
            bad += !isfinite(lg[k]);
        }
        const double cpu = mean_dev(lg, lc, p->n, g.vocab, discrete), hf = mean_dev(lg, p->logprobs, p->n, g.vocab, discrete);
        fprintf(stderr, "  %-18s prompt %d (len %3d): CUDA FP8 caches: mean |lp - CPU FP8| %.4f (bound %.2f), "
                        "mean |lp - HF| %.4f (bound %.2f)%s\n", id->name, i, p->n, cpu, KV8_CPU_MEAN, hf, KV8_HF_MEAN,
                discrete ? " (the worst quarter of positions left out)" : "");
        cr_expect_eq(bad, 0, "%s prompt %d: %lld log-probabilities not finite", id->name, i, (long long)bad);
        cr_expect_leq(cpu, KV8_CPU_MEAN, "%s prompt %d: mean |logprob - CPU| %g", id->name, i, cpu);
        cr_expect_leq(hf, KV8_HF_MEAN, "%s prompt %d: mean |logprob - HF| %g", id->name, i, hf);
        kr_free(lg);
        kr_free(lc);
    }
    fx_free(&g);
    fx_free(&c);
}

/* A cached token's bytes on CUDA are what `krait plan --kv-cache-dtype fp8` counts (server/plan.c:
 * K/V a byte per value, a latent row kv_lora + 4 per 128 + 2 * rope, an index key idx_head_dim + 4),
 * written out here from the model's configuration; and the pools hold that much per block. */
Test(kv_fp8_gpu, memory_per_token_equals_the_plan)
{
    GT_REQUIRE_GPU();
    static const struct fx_id ids[] = {{"nemotron_h", "nh_mamba_attn_mlp"}, {"deepseek_v32", "ds_short"},
                                       {"hybrid", "hy_mdme"}, {"hybrid", "hy_plus"}};
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
        struct kr_err err = {0};
        kr_backend_t be = NULL;
        cr_assert_eq(kr_backend_cuda_create(0, false, &be, &err), KR_OK, "%s", err.msg);
        struct fx f;
        load_fp8(&f, &ids[i], be);
        const struct kr_model_config *c = &f.m->cfg;
        uint64_t kv = (uint64_t)f.m->n_attn * 2 * (uint64_t)(c->n_kv_head * c->head_dim), latent = 0, indexer = 0;
        for (int32_t l = 0; l < c->n_layer; l++) {
            if (c->pattern[l] == KR_LAYER_DSA || c->pattern[l] == KR_LAYER_MLA) {
                latent += (uint64_t)(c->kv_lora + 4 * ((c->kv_lora + 127) / 128) + 2 * c->qk_rope);
            }
            if (c->pattern[l] == KR_LAYER_DSA) {
                indexer += (uint64_t)c->idx_head_dim + 4 * (uint64_t)((c->idx_head_dim + 127) / 128);
            }
        }
        const uint64_t plan = kv + latent + indexer;
        size_t slot_b = 0, block_b = 0;
        kr_cache_unit_bytes(f.m, f.c->block_size, &slot_b, &block_b);
        const struct kr_cache *kc = f.c;
        const uint64_t pooled = (uint64_t)(kc->k.size + kc->v.size + kc->mla.size);
        fprintf(stderr, "  %-18s plan %llu B a token (K/V %llu, latent %llu, index keys %llu); CUDA pools %llu B a "
                        "block of %d, %llu B in %d blocks\n", ids[i].name, (unsigned long long)plan,
                (unsigned long long)kv, (unsigned long long)latent, (unsigned long long)indexer,
                (unsigned long long)block_b, kc->block_size, (unsigned long long)pooled, kc->n_blocks);
        cr_expect(plan > 0, "%s: no paged pool", ids[i].name);
        cr_expect_eq(block_b, (size_t)plan * (size_t)kc->block_size, "%s: %zu B a block, the plan %llu x %d",
                     ids[i].name, block_b, (unsigned long long)plan, kc->block_size);
        cr_expect_eq(pooled, plan * (uint64_t)kc->block_size * (uint64_t)kc->n_blocks, "%s: the pools hold %llu B",
                     ids[i].name, (unsigned long long)pooled);
        fx_free(&f);
    }
}

/* Pools sized before the setting do not fit the FP8 layout: the first step says so. */
Test(kv_fp8_gpu, caches_made_before_the_setting_are_refused)
{
    GT_REQUIRE_GPU();
    struct kr_err err = {0};
    kr_backend_t be = NULL;
    cr_assert_eq(kr_backend_cuda_create(0, false, &be, &err), KR_OK, "%s", err.msg);
    struct fx f;
    fx_load_on(&f, "nemotron_h", "nh_mamba_attn_mlp", be, 2);
    cr_assert_eq(kr_model_set_kv_cache_dtype(f.m, KR_KV_CACHE_FP8, &err), KR_OK, "%s", err.msg);
    cr_assert(f.m->kv_fp8 && !f.c->fp8);
    const struct fx_prompt *p = &f.prompts[0];
    float *lp = xalloc((size_t)p->n * (size_t)f.vocab * sizeof(float));
    cr_expect_neq(kr_run_prompt_logprobs(f.m, f.c, p->ids, p->n, 0, lp, &err), KR_OK);
    cr_expect(strstr(err.msg, "kr_model_set_kv_cache_dtype") != NULL, "%s", err.msg);
    kr_free(lp);
    fx_free(&f);
}
