/* GQA attention over the block-paged bf16 K/V cache (kernels/attention/) against the CPU reference
 * (kr_backend_attention over an fp32 cache). Both sides get the same cache prefix (random values
 * rounded to bf16) and the same bf16-rounded q/k/v, so the cache rows our launcher writes must equal
 * the reference bit for bit and the outputs differ only by arithmetic. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "alloc.h"
#include "dtype.h"
#include "gpu-test.h"

#include <criterion/parameterized.h>

/* Error bounds (NMSE, max |got - ref|); outputs are convex combinations of values in [-1, 1].
 * Decode (one token per sequence) is fp32 from the fp32 queries and the bf16 cache: the
 * differences are summation order and exp2 approximation, at rounding level.
 * Prefill rounds queries (already bf16 here, so exactly) and the softmax probabilities to bf16
 * (relative error up to 2^-9 per weight) before the tensor-core P.V product.
 * Measured on H200 over every case below: decode NMSE <= 3.2e-11, max_abs <= 2.4e-7; prefill
 * NMSE <= 3.1e-6, max_abs <= 1.5e-3. */
#define DECODE_NMSE  1e-9
#define DECODE_ABS   1e-5
#define PREFILL_NMSE 2e-5
#define PREFILL_ABS  1e-2

struct attn_shape {
    int64_t n_head, n_kv_head, head_dim;
    int32_t block_size;
};

/* Target model (32 query / 8 KV heads of 128) and a small odd shape (head_dim not a multiple of
 * 16, 3 query heads per KV head), each with two block sizes; then the widest head (256, 8 query
 * heads per KV head) and a narrow multi-head shape with a block size that is not a power of 2. */
static struct attn_shape shapes[] = {
    {32, 8, 128, 16}, {32, 8, 128, 64}, {6, 2, 40, 16}, {6, 2, 40, 64}, {8, 1, 256, 32}, {4, 4, 16, 7},
};
#define N_SHAPES ((int)(sizeof shapes / sizeof shapes[0]))

/* One batch run on both sides: CPU reference caches (fp32) and the bit patterns the device caches
 * must hold. */
struct attn_run {
    struct attn_shape sh;
    struct gt_batch b;
    int32_t pad;             /* padding sequence or -1 */
    int64_t row;             /* n_kv_head * head_dim */
    int64_t ld;              /* row stride of qkv */
    size_t cache_n;          /* elements of one cache */
    float *kc, *vc;          /* [n_block, block_size, n_kv_head, head_dim] CPU caches */
    uint16_t *kbits, *vbits; /* expected device cache contents (0xFFFF never written) */
    krk_bf16 *d_kc, *d_vc;   /* device caches */
    float *qkv;              /* [n_tok, ld] q | k | v, bf16-rounded */
    float *d_qkv, *d_out;    /* device copies, out [n_tok, n_head * head_dim] */
    void *d_ws;
    kr_backend_t be;
};

static size_t cache_off(const struct attn_run *r, int32_t s, int32_t pos)
{
    const int32_t bs = r->sh.block_size;
    const int32_t blk = r->b.block_table[(size_t)s * (size_t)r->b.host.max_blocks + (size_t)(pos / bs)];
    cr_assert(blk >= 0, "position %d of sequence %d has no block", pos, s);
    return ((size_t)blk * (size_t)bs + (size_t)(pos % bs)) * (size_t)r->row;
}

/* Batch of n_seq sequences (seq_len new tokens from pos0), caches filled for positions < fill[s]
 * (pos0 when fill is NULL), new inputs uploaded. */
static void run_init(struct attn_run *r, const struct attn_shape *sh, struct gt_rng *rng, int32_t n_seq,
                     const int32_t *seq_len, const int32_t *pos0, const int32_t *fill, int32_t pad)
{
    memset(r, 0, sizeof *r);
    r->sh = *sh;
    r->pad = pad;
    r->row = sh->n_kv_head * sh->head_dim;
    r->ld = (sh->n_head + 2 * sh->n_kv_head) * sh->head_dim + 8; /* a stride wider than the row */
    int32_t need = 0;
    for (int32_t s = 0; s < n_seq; s++) {
        need += (pos0[s] + seq_len[s] + sh->block_size - 1) / sh->block_size;
    }
    const int32_t n_blocks = need + 3; /* spare blocks nobody may write */
    gt_batch_make(&r->b, rng, n_seq, seq_len, pos0, sh->block_size, n_blocks, n_seq, 1000);
    if (pad >= 0) {
        r->b.seq_slot[pad] = -1;
        cr_assert_eq(
            cudaMemcpy((void *)r->b.dev.seq_slot, r->b.seq_slot, (size_t)n_seq * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
    }
    r->cache_n = (size_t)n_blocks * (size_t)sh->block_size * (size_t)r->row;
    r->kc = kr_calloc(r->cache_n, sizeof(float));
    r->vc = kr_calloc(r->cache_n, sizeof(float));
    r->kbits = kr_malloc(r->cache_n * 2);
    r->vbits = kr_malloc(r->cache_n * 2);
    cr_assert(r->kc && r->vc && r->kbits && r->vbits);
    memset(r->kbits, 0xFF, r->cache_n * 2);
    memset(r->vbits, 0xFF, r->cache_n * 2);
    for (int32_t s = 0; s < n_seq; s++) {
        const int32_t n_fill = fill ? fill[s] : pos0[s];
        for (int32_t j = 0; j < n_fill; j++) {
            const size_t o = cache_off(r, s, j);
            for (int64_t e = 0; e < r->row; e++) {
                r->kbits[o + e] = kr_f32_to_bf16(gt_uniform(rng, -1.0f, 1.0f));
                r->vbits[o + e] = kr_f32_to_bf16(gt_uniform(rng, -1.0f, 1.0f));
                r->kc[o + e] = kr_bf16_to_f32(r->kbits[o + e]);
                r->vc[o + e] = kr_bf16_to_f32(r->vbits[o + e]);
            }
        }
    }
    r->d_kc = gt_dup(r->kbits, r->cache_n * 2);
    r->d_vc = gt_dup(r->vbits, r->cache_n * 2);
    const int32_t n_tok = r->b.host.n_tok;
    r->qkv = kr_malloc((size_t)n_tok * (size_t)r->ld * sizeof(float) + 4);
    cr_assert(r->qkv);
    r->d_qkv = gt_dalloc((size_t)n_tok * (size_t)r->ld * sizeof(float));
    r->d_out = gt_dalloc((size_t)n_tok * (size_t)(sh->n_head * sh->head_dim) * sizeof(float));
    r->d_ws = gt_dalloc(krk_attn_workspace_bytes(n_tok, sh->n_head, sh->head_dim));
    r->be = kr_backend_cpu_create(0);
    cr_assert(r->be);
}

/* Fresh random q (wider range: peakier softmax), k and v, rounded to bf16, uploaded. */
static void run_inputs(struct attn_run *r, struct gt_rng *rng)
{
    const int64_t qn = r->sh.n_head * r->sh.head_dim;
    for (int32_t t = 0; t < r->b.host.n_tok; t++) {
        float *x = r->qkv + (size_t)t * (size_t)r->ld;
        gt_fill(rng, x, (size_t)qn, -2.0f, 2.0f);
        gt_fill(rng, x + qn, (size_t)(r->ld - qn), -1.0f, 1.0f);
    }
    gt_round_bf16(r->qkv, (size_t)r->b.host.n_tok * (size_t)r->ld);
    cr_assert_eq(cudaMemcpy(r->d_qkv, r->qkv, (size_t)r->b.host.n_tok * (size_t)r->ld * sizeof(float),
                            cudaMemcpyHostToDevice),
                 cudaSuccess);
}

static struct krk_attn_params run_params(const struct attn_run *r)
{
    const int64_t hd = r->sh.head_dim;
    return (struct krk_attn_params){
        .q = r->d_qkv,
        .k = r->d_qkv + r->sh.n_head * hd,
        .v = r->d_qkv + (r->sh.n_head + r->sh.n_kv_head) * hd,
        .ld_qkv = r->ld,
        .n_head = r->sh.n_head,
        .n_kv_head = r->sh.n_kv_head,
        .head_dim = hd,
        .scale = 1.0f / sqrtf((float)hd),
        .k_cache = r->d_kc,
        .v_cache = r->d_vc,
        .block_size = r->sh.block_size,
        .out = r->d_out,
    };
}

/* The device's part of a launch: the stream, the batch in device memory and the workspace. */
static struct krk_ctx run_ctx(const struct attn_run *r, cudaStream_t stream)
{
    return (struct krk_ctx){.stream = stream, .batch = r->b.dev, .workspace = r->d_ws};
}

/* Runs the CPU reference on the current inputs and compares the device output (padding rows:
 * finite only) and both device caches (bit for bit, also outside the batch's rows). */
static void run_check(struct attn_run *r, const char *what)
{
    const struct attn_shape *sh = &r->sh;
    const int32_t n_tok = r->b.host.n_tok;
    const int64_t hd = sh->head_dim, on = sh->n_head * hd;
    float *ref = kr_malloc((size_t)n_tok * (size_t)on * sizeof(float) + 4);
    float *got = kr_malloc((size_t)n_tok * (size_t)on * sizeof(float) + 4);
    uint16_t *kdev = kr_malloc(r->cache_n * 2), *vdev = kr_malloc(r->cache_n * 2);
    cr_assert(ref && got && kdev && vdev);

    cr_assert_eq(kr_backend_begin_batch(r->be, &r->b.host), KR_OK);
    const struct krk_attn_params cp = {
        .q = r->qkv,
        .k = r->qkv + sh->n_head * hd,
        .v = r->qkv + (sh->n_head + sh->n_kv_head) * hd,
        .ld_qkv = r->ld,
        .n_head = sh->n_head,
        .n_kv_head = sh->n_kv_head,
        .head_dim = hd,
        .scale = 1.0f / sqrtf((float)hd),
        .k_cache = r->kc,
        .v_cache = r->vc,
        .block_size = sh->block_size,
        .out = ref,
    };
    cr_assert_eq(kr_backend_attention(r->be, &cp), KR_OK);

    gt_down(got, r->d_out, (size_t)n_tok * (size_t)on * sizeof(float));
    gt_down(kdev, r->d_kc, r->cache_n * 2);
    gt_down(vdev, r->d_vc, r->cache_n * 2);

    /* the rows this step writes: every non-padding token's k and v rounded to bf16 */
    for (int32_t s = 0; s < r->b.host.n_seq; s++) {
        if (s == r->pad) {
            continue;
        }
        for (int32_t t = r->b.seq_tok0[s]; t < r->b.seq_tok0[s + 1]; t++) {
            const size_t o = cache_off(r, s, r->b.pos[t]);
            const float *k = r->qkv + (size_t)t * (size_t)r->ld + sh->n_head * hd;
            for (int64_t e = 0; e < r->row; e++) {
                r->kbits[o + e] = kr_f32_to_bf16(k[e]);
                r->vbits[o + e] = kr_f32_to_bf16(k[r->row + e]);
            }
        }
    }
    size_t bad_k = 0, bad_v = 0;
    for (size_t i = 0; i < r->cache_n; i++) {
        bad_k += kdev[i] != r->kbits[i];
        bad_v += vdev[i] != r->vbits[i];
    }
    cr_expect_eq(bad_k, 0, "%s: %zu of %zu K cache elements differ", what, bad_k, r->cache_n);
    cr_expect_eq(bad_v, 0, "%s: %zu of %zu V cache elements differ", what, bad_v, r->cache_n);

    /* outputs of the real sequences, compacted; padding rows must be finite */
    size_t n = 0;
    int64_t bad_pad = 0;
    for (int32_t s = 0; s < r->b.host.n_seq; s++) {
        for (int32_t t = r->b.seq_tok0[s]; t < r->b.seq_tok0[s + 1]; t++) {
            const float *g = got + (size_t)t * (size_t)on;
            if (s == r->pad) {
                for (int64_t i = 0; i < on; i++) {
                    bad_pad += !isfinite(g[i]);
                }
                continue;
            }
            memmove(got + n, g, (size_t)on * sizeof(float));
            memmove(ref + n, ref + (size_t)t * (size_t)on, (size_t)on * sizeof(float));
            n += (size_t)on;
        }
    }
    cr_expect_eq(bad_pad, 0, "%s: %lld non-finite outputs of the padding sequence", what, (long long)bad_pad);
    char name[160];
    snprintf(name, sizeof name, "%s [%lld/%lld x %lld, block %d]", what, (long long)sh->n_head,
             (long long)sh->n_kv_head, (long long)hd, sh->block_size);
    if (r->b.dev.max_seq_tok == 1) {
        gt_expect_close(name, got, ref, n, DECODE_NMSE, DECODE_ABS);
    } else {
        gt_expect_close(name, got, ref, n, PREFILL_NMSE, PREFILL_ABS);
    }
    kr_free(ref);
    kr_free(got);
    kr_free(kdev);
    kr_free(vdev);
}

static void run_free(struct attn_run *r)
{
    kr_backend_free(r->be);
    gt_dfree(r->d_ws);
    gt_dfree(r->d_out);
    gt_dfree(r->d_qkv);
    gt_dfree(r->d_kc);
    gt_dfree(r->d_vc);
    kr_free(r->qkv);
    kr_free(r->kc);
    kr_free(r->vc);
    kr_free(r->kbits);
    kr_free(r->vbits);
    gt_batch_free(&r->b);
}

/* One step on a fresh batch: launch, then compare with the reference. */
static void check_step(const struct attn_shape *sh, uint64_t seed, int32_t n_seq, const int32_t *seq_len,
                       const int32_t *pos0, int32_t pad, const char *what)
{
    struct gt_rng rng = {seed};
    struct attn_run r;
    run_init(&r, sh, &rng, n_seq, seq_len, pos0, NULL, pad);
    run_inputs(&r, &rng);
    const struct krk_attn_params p = run_params(&r);
    const struct krk_ctx k = run_ctx(&r, 0);
    cr_assert_eq(krk_attn(&p, &k), KR_OK, "%s", what);
    gt_sync();
    run_check(&r, what);
    run_free(&r);
}

ParameterizedTestParameters(attention, decode_one_sequence_matches_cpu)
{
    return cr_make_param_array(struct attn_shape, shapes, N_SHAPES);
}

ParameterizedTest(struct attn_shape *sh, attention, decode_one_sequence_matches_cpu)
{
    GT_REQUIRE_GPU();
    static const int32_t ctx[] = {1, 17, 1000, 40000};
    for (int i = 0; i < 4; i++) {
        const int32_t len = 1, pos0 = ctx[i] - 1;
        char what[64];
        snprintf(what, sizeof what, "decode 1 seq, context %d", ctx[i]);
        check_step(sh, 100 + (uint64_t)i, 1, &len, &pos0, -1, what);
    }
}

ParameterizedTestParameters(attention, decode_many_sequences_matches_cpu)
{
    return cr_make_param_array(struct attn_shape, shapes, N_SHAPES);
}

/* 50 sequences (one long, one padding) and 600 (one split per token: no combine). */
ParameterizedTest(struct attn_shape *sh, attention, decode_many_sequences_matches_cpu)
{
    GT_REQUIRE_GPU();
    static const int32_t n_seqs[] = {50, 600};
    static const int32_t max_ctx[] = {1000, 300};
    for (int c = 0; c < 2; c++) {
        const int32_t n_seq = n_seqs[c];
        int32_t len[600], pos0[600];
        struct gt_rng rng = {7 + (uint64_t)c};
        for (int32_t s = 0; s < n_seq; s++) {
            len[s] = 1;
            pos0[s] = (int32_t)gt_uniform(&rng, 0.0f, (float)max_ctx[c]);
        }
        pos0[0] = 0;     /* context 1 */
        pos0[1] = 16;    /* context 17 */
        pos0[3] = 39999; /* context 40000 */
        char what[64];
        snprintf(what, sizeof what, "decode %d seqs", n_seq);
        check_step(sh, 200 + (uint64_t)c, n_seq, len, pos0, 10, what);
    }
}

ParameterizedTestParameters(attention, prefill_matches_cpu)
{
    return cr_make_param_array(struct attn_shape, shapes, N_SHAPES);
}

/* One sequence of 1, 7, 300 and 2500 new tokens, from position 0 and after a cached prefix of 1000. */
ParameterizedTest(struct attn_shape *sh, attention, prefill_matches_cpu)
{
    GT_REQUIRE_GPU();
    static const int32_t lens[] = {1, 7, 300, 2500};
    static const int32_t starts[] = {0, 1000};
    for (int i = 0; i < 4; i++) {
        for (int k = 0; k < 2; k++) {
            char what[64];
            snprintf(what, sizeof what, "prefill %d tokens from %d", lens[i], starts[k]);
            check_step(sh, 300 + (uint64_t)(i * 2 + k), 1, &lens[i], &starts[k], -1, what);
        }
    }
}

ParameterizedTestParameters(attention, mixed_batch_matches_cpu)
{
    return cr_make_param_array(struct attn_shape, shapes, N_SHAPES);
}

/* Prefill chunks (with and without a prefix, tile-ragged lengths), decode tokens and a padding
 * sequence in one step. */
ParameterizedTest(struct attn_shape *sh, attention, mixed_batch_matches_cpu)
{
    GT_REQUIRE_GPU();
    static const int32_t len[] = {300, 1, 77, 5, 1, 64, 130, 1, 3};
    static const int32_t pos0[] = {0, 999, 500, 20, 0, 64, 2000, 40000, 1};
    check_step(sh, 400, 9, len, pos0, 3, "mixed batch");
}

ParameterizedTestParameters(attention, decode_replays_from_graph)
{
    return cr_make_param_array(struct attn_shape, shapes, N_SHAPES);
}

/* A decode step captured once into a CUDA graph and replayed with other positions (contexts from
 * 1 to 5000): the launch must not depend on the context length. */
ParameterizedTest(struct attn_shape *sh, attention, decode_replays_from_graph)
{
    GT_REQUIRE_GPU();
    static const int32_t len[] = {1, 1, 1, 1};
    static const int32_t last[] = {4999, 2999, 99, 1499}; /* largest positions: block tables span them */
    static const int32_t steps[3][4] = {{10, 500, 0, 1200}, {4999, 2999, 99, 1499}, {300, 0, 50, 256}};
    struct gt_rng rng = {500};
    struct attn_run r;
    run_init(&r, sh, &rng, 4, len, last, last, -1);

    cudaStream_t stream;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cr_assert_eq(cudaStreamCreate(&stream), cudaSuccess);
    const struct krk_attn_params p = run_params(&r);
    const struct krk_ctx k = run_ctx(&r, stream);
    cr_assert_eq(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    cr_assert_eq(krk_attn(&p, &k), KR_OK);
    cr_assert_eq(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    cr_assert_eq(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

    for (int i = 0; i < 3; i++) {
        for (int s = 0; s < 4; s++) {
            r.b.pos[s] = steps[i][s];
            r.b.seq_pos0[s] = steps[i][s];
        }
        cr_assert_eq(cudaMemcpy((void *)r.b.dev.pos, r.b.pos, 16, cudaMemcpyHostToDevice), cudaSuccess);
        cr_assert_eq(cudaMemcpy((void *)r.b.dev.seq_pos0, r.b.seq_pos0, 16, cudaMemcpyHostToDevice),
                     cudaSuccess);
        run_inputs(&r, &rng);
        cr_assert_eq(cudaGraphLaunch(exec, stream), cudaSuccess);
        cr_assert_eq(cudaStreamSynchronize(stream), cudaSuccess);
        char what[64];
        snprintf(what, sizeof what, "graph replay %d", i);
        run_check(&r, what);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    run_free(&r);
}

/* Long contexts: prefill chunks of the server's 2048 tokens whose contexts cross 32768 and 65536
 * positions, over a random cached prefix. The first shape has the target model's 32 query and 8 KV
 * heads (narrow heads keep the CPU reference fast): 2048 tokens x 34816 positions x 32 heads is
 * above 2^31, the product a 32-bit index of (token, head, key) would overflow. The last batch is the
 * last chunk of a 40,000-token prompt next to a decode at 100,000 and a chunk crossing 65536. */
static struct attn_shape long_shapes[] = {{32, 8, 8, 16}, {4, 2, 40, 64}};

ParameterizedTestParameters(attention, long_context_prefill_matches_cpu)
{
    return cr_make_param_array(struct attn_shape, long_shapes, sizeof long_shapes / sizeof long_shapes[0]);
}

ParameterizedTest(struct attn_shape *sh, attention, long_context_prefill_matches_cpu, .timeout = 600)
{
    GT_REQUIRE_GPU();
    {
        const int32_t len = 2048, pos0 = 32768 - 1024;
        check_step(sh, 700, 1, &len, &pos0, -1, "prefill 2048 crossing 32768");
    }
    {
        const int32_t len = 2048, pos0 = 65536 - 1024;
        check_step(sh, 701, 1, &len, &pos0, -1, "prefill 2048 crossing 65536");
    }
    {
        static const int32_t len[] = {1088, 1, 300, 1};
        static const int32_t pos0[] = {40000 - 1088, 99999, 65536 - 150, 3};
        check_step(sh, 702, 4, len, pos0, 3, "last chunk of 40000 + decode 100000 + chunk crossing 65536");
    }
}

/* The largest chunk the server takes (--max-num-batched-tokens 16384) crossing 65536: 128 query tiles
 * of one sequence, every one over more than 49,000 keys. */
Test(attention, long_context_largest_chunk_matches_cpu, .timeout = 600)
{
    GT_REQUIRE_GPU();
    static const struct attn_shape sh = {2, 1, 8, 16};
    const int32_t len = 16384, pos0 = 65536 - 8192;
    check_step(&sh, 710, 1, &len, &pos0, -1, "prefill 16384 crossing 65536");
}

Test(attention, rejects_invalid_parameters)
{
    GT_REQUIRE_GPU();
    static const struct attn_shape sh = {32, 8, 128, 16};
    const int32_t len = 1, pos0 = 5;
    struct gt_rng rng = {600};
    struct attn_run r;
    run_init(&r, &sh, &rng, 1, &len, &pos0, NULL, -1);
    struct krk_attn_params p = run_params(&r);
    struct krk_ctx k = run_ctx(&r, 0);
    p.n_kv_head = 5; /* 32 heads not divisible */
    cr_expect_eq(krk_attn(&p, &k), KR_ERR_INVAL);
    p = run_params(&r);
    k = run_ctx(&r, 0);
    p.head_dim = 264;
    p.ld_qkv = 100000;
    cr_expect_eq(krk_attn(&p, &k), KR_ERR_INVAL);
    p = run_params(&r);
    k = run_ctx(&r, 0);
    p.head_dim = 124;
    cr_expect_eq(krk_attn(&p, &k), KR_ERR_INVAL);
    p = run_params(&r);
    k = run_ctx(&r, 0);
    p.block_size = 0;
    cr_expect_eq(krk_attn(&p, &k), KR_ERR_INVAL);
    p = run_params(&r);
    k = run_ctx(&r, 0);
    k.workspace = NULL;
    cr_expect_eq(krk_attn(&p, &k), KR_ERR_INVAL);
    p = run_params(&r);
    k = run_ctx(&r, 0);
    p.k_cache = NULL;
    cr_expect_eq(krk_attn(&p, &k), KR_ERR_INVAL);
    /* contexts beyond what the block tables hold (the kernels would read past a table row) */
    p = run_params(&r);
    k = run_ctx(&r, 0);
    k.batch.max_ctx = k.batch.max_blocks * p.block_size + 1;
    cr_expect_eq(krk_attn(&p, &k), KR_ERR_INVAL, "a context beyond the block tables must be refused");
    /* grid limits: more sequences than gridDim.z, more heads than gridDim.y */
    p = run_params(&r);
    k = run_ctx(&r, 0);
    k.batch.n_seq = 65536;
    cr_expect_eq(krk_attn(&p, &k), KR_ERR_INVAL, "65536 sequences exceed gridDim.z");
    p = run_params(&r);
    k = run_ctx(&r, 0);
    p.n_head = 65536 * 8;
    p.ld_qkv = p.n_head * p.head_dim;
    cr_expect_eq(krk_attn(&p, &k), KR_ERR_INVAL, "524288 heads exceed gridDim.y");
    gt_sync();
    run_free(&r);
}
