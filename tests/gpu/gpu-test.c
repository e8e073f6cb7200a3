#include "gpu-test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "dtype.h"

#define GT_CUDA(expr)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (expr);                                                                   \
        cr_assert(e_ == cudaSuccess, "%s: %s", #expr, cudaGetErrorString(e_));                     \
    } while (0)

bool gt_have_gpu(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return n > 0;
}

const char *gt_fixtures(void)
{
    const char *e = getenv("KR_FIXTURES");
    return e && *e ? e : KR_FIXTURES;
}

void *gt_dalloc(size_t bytes)
{
    void *p = NULL;
    GT_CUDA(cudaMalloc(&p, bytes ? bytes : 16));
    GT_CUDA(cudaMemset(p, 0xFF, bytes ? bytes : 16));
    /* the fill runs on the legacy stream, which kernels on non-blocking streams do not wait for */
    GT_CUDA(cudaDeviceSynchronize());
    return p;
}

void gt_dfree(void *p)
{
    if (p) {
        GT_CUDA(cudaFree(p));
    }
}

void *gt_dup(const void *host, size_t bytes)
{
    void *p = gt_dalloc(bytes);
    if (bytes) {
        GT_CUDA(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
        /* from pageable memory the call may return before the data lands */
        GT_CUDA(cudaDeviceSynchronize());
    }
    return p;
}

void gt_down(void *host, const void *dev, size_t bytes)
{
    GT_CUDA(cudaDeviceSynchronize());
    if (bytes) {
        GT_CUDA(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
    }
}

krk_bf16 *gt_dup_bf16(const float *host, size_t n)
{
    uint16_t *h = malloc(n * 2 + 2);
    cr_assert(h);
    for (size_t i = 0; i < n; i++) {
        h[i] = kr_f32_to_bf16(host[i]);
    }
    krk_bf16 *d = gt_dup(h, n * 2);
    free(h);
    return d;
}

void gt_sync(void)
{
    GT_CUDA(cudaDeviceSynchronize());
    GT_CUDA(cudaGetLastError());
}

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

float gt_uniform(struct gt_rng *r, float lo, float hi)
{
    const double u = (double)(splitmix(&r->s) >> 11) / 9007199254740992.0;
    return (float)(lo + (hi - lo) * u);
}

void gt_fill(struct gt_rng *r, float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++) {
        x[i] = gt_uniform(r, lo, hi);
    }
}

void gt_round_bf16(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        x[i] = kr_bf16_to_f32(kr_f32_to_bf16(x[i]));
    }
}

struct gt_err gt_compare(const float *got, const float *ref, size_t n)
{
    struct gt_err e = {0};
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i]) || !isfinite(ref[i])) {
            e.n_bad++;
            continue;
        }
        const double d = (double)got[i] - (double)ref[i];
        num += d * d;
        den += (double)ref[i] * (double)ref[i];
        if (fabs(d) > e.max_abs) {
            e.max_abs = fabs(d);
        }
    }
    e.nmse = den > 0 ? num / den : num;
    return e;
}

bool gt_expect_close(const char *what, const float *got, const float *ref, size_t n, double nmse_bound,
                     double abs_bound)
{
    const struct gt_err e = gt_compare(got, ref, n);
    const bool ok = e.n_bad == 0 && e.nmse <= nmse_bound && e.max_abs <= abs_bound;
    fprintf(stderr, "  %-40s n=%zu nmse=%.3g (bound %.3g) max_abs=%.3g (bound %.3g) bad=%lld %s\n", what, n, e.nmse,
            nmse_bound, e.max_abs, abs_bound, (long long)e.n_bad, ok ? "ok" : "FAIL");
    cr_expect(ok, "%s: nmse %.3g (bound %.3g), max_abs %.3g (bound %.3g), %lld non-finite", what, e.nmse, nmse_bound,
              e.max_abs, abs_bound, (long long)e.n_bad);
    return ok;
}

void gt_batch_make(struct gt_batch *b, struct gt_rng *r, int32_t n_seq, const int32_t *seq_len,
                   const int32_t *pos0, int32_t block_size, int32_t n_blocks, int32_t n_slots, int32_t vocab)
{
    memset(b, 0, sizeof *b);
    int32_t n_tok = 0, max_tok = 0, max_ctx = 0, max_blocks = 1;
    for (int32_t s = 0; s < n_seq; s++) {
        n_tok += seq_len[s];
        max_tok = seq_len[s] > max_tok ? seq_len[s] : max_tok;
        const int32_t ctx = pos0[s] + seq_len[s];
        max_ctx = ctx > max_ctx ? ctx : max_ctx;
        const int32_t nb = (ctx + block_size - 1) / block_size;
        max_blocks = nb > max_blocks ? nb : max_blocks;
    }
    cr_assert(n_slots >= n_seq, "gt_batch_make: %d slots for %d sequences", n_slots, n_seq);
    b->tokens = calloc((size_t)n_tok + 1, 4);
    b->pos = calloc((size_t)n_tok + 1, 4);
    b->tok_seq = calloc((size_t)n_tok + 1, 4);
    b->seq_tok0 = calloc((size_t)n_seq + 1, 4);
    b->seq_pos0 = calloc((size_t)n_seq + 1, 4);
    b->seq_slot = calloc((size_t)n_seq + 1, 4);
    b->block_table = calloc((size_t)n_seq * (size_t)max_blocks + 1, 4);
    int32_t *perm = calloc((size_t)(n_blocks > n_slots ? n_blocks : n_slots) + 1, 4);
    cr_assert(b->tokens && b->pos && b->tok_seq && b->seq_tok0 && b->seq_pos0 && b->seq_slot && b->block_table &&
              perm);
    /* distinct slots */
    for (int32_t i = 0; i < n_slots; i++) {
        perm[i] = i;
    }
    for (int32_t i = n_slots - 1; i > 0; i--) {
        const int32_t j = (int32_t)(gt_uniform(r, 0, 1) * (float)(i + 1)) % (i + 1);
        const int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int32_t s = 0; s < n_seq; s++) {
        b->seq_slot[s] = perm[s];
    }
    /* distinct blocks across all sequences */
    int32_t need = 0;
    for (int32_t s = 0; s < n_seq; s++) {
        need += (pos0[s] + seq_len[s] + block_size - 1) / block_size;
    }
    cr_assert(need <= n_blocks, "gt_batch_make: %d blocks needed, %d in the pool", need, n_blocks);
    for (int32_t i = 0; i < n_blocks; i++) {
        perm[i] = i;
    }
    for (int32_t i = n_blocks - 1; i > 0; i--) {
        const int32_t j = (int32_t)(gt_uniform(r, 0, 1) * (float)(i + 1)) % (i + 1);
        const int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int32_t used = 0, t = 0;
    for (int32_t s = 0; s < n_seq; s++) {
        b->seq_tok0[s] = t;
        b->seq_pos0[s] = pos0[s];
        const int32_t nb = (pos0[s] + seq_len[s] + block_size - 1) / block_size;
        for (int32_t j = 0; j < max_blocks; j++) {
            b->block_table[(size_t)s * max_blocks + j] = j < nb ? perm[used + j] : -1;
        }
        used += nb;
        for (int32_t i = 0; i < seq_len[s]; i++, t++) {
            b->tokens[t] = (int32_t)(gt_uniform(r, 0, 1) * (float)vocab) % vocab;
            b->pos[t] = pos0[s] + i;
            b->tok_seq[t] = s;
        }
    }
    b->seq_tok0[n_seq] = n_tok;
    free(perm);
    b->host = (struct kr_batch){.n_tok = n_tok, .n_seq = n_seq, .tokens = b->tokens, .pos = b->pos,
                                .seq_tok0 = b->seq_tok0, .seq_pos0 = b->seq_pos0, .seq_slot = b->seq_slot,
                                .block_table = b->block_table, .max_blocks = max_blocks, .n_out = 0,
                                .out_tok = NULL};
    /* one device allocation holding every array */
    const size_t sz[7] = {(size_t)n_tok, (size_t)n_tok, (size_t)n_tok, (size_t)n_seq + 1, (size_t)n_seq,
                          (size_t)n_seq, (size_t)n_seq * (size_t)max_blocks};
    const int32_t *src[7] = {b->tokens, b->pos, b->tok_seq, b->seq_tok0, b->seq_pos0, b->seq_slot, b->block_table};
    size_t total = 0;
    for (int i = 0; i < 7; i++) {
        total += sz[i] + 1;
    }
    b->dmem = gt_dalloc(total * 4);
    int32_t *d = b->dmem;
    const int32_t *dp[7];
    for (int i = 0; i < 7; i++) {
        if (sz[i]) {
            GT_CUDA(cudaMemcpy(d, src[i], sz[i] * 4, cudaMemcpyHostToDevice));
        }
        dp[i] = d;
        d += sz[i] + 1;
    }
    GT_CUDA(cudaDeviceSynchronize()); /* the copies from pageable memory have landed */
    b->dev = (struct krk_batch){.n_tok = n_tok, .n_seq = n_seq, .tokens = dp[0], .pos = dp[1], .tok_seq = dp[2],
                                .seq_tok0 = dp[3], .seq_pos0 = dp[4], .seq_slot = dp[5], .block_table = dp[6],
                                .max_blocks = max_blocks, .max_seq_tok = max_tok, .max_ctx = max_ctx};
}

void gt_batch_free(struct gt_batch *b)
{
    free(b->tokens);
    free(b->pos);
    free(b->tok_seq);
    free(b->seq_tok0);
    free(b->seq_pos0);
    free(b->seq_slot);
    free(b->block_table);
    gt_dfree(b->dmem);
    memset(b, 0, sizeof *b);
}

/* Says once, before any test runs, that the GPU tests will skip on a machine without a GPU. The
 * check looks for the driver's device nodes instead of calling CUDA: the runtime must not be
 * initialised in Criterion's parent process (the tests run in forked children). */
ReportHook(PRE_ALL)(struct criterion_test_set *set)
{
    (void)set;
    if (access("/dev/nvidiactl", F_OK) != 0) {
        fprintf(stderr, "test_cuda: no NVIDIA driver on this machine (/dev/nvidiactl is missing): every GPU test "
                        "is skipped; run tests/gpu/run.sh on a GPU machine\n");
    }
}

/* Criterion's runner, with one difference: on a machine without a GPU a run in which nothing
 * failed exits with GT_SKIPPED, which CTest reports as skipped (SKIP_RETURN_CODE), not passed. */
int main(int argc, char **argv)
{
    struct criterion_test_set *tests = criterion_initialize();
    int result = 0;
    if (criterion_handle_args(argc, argv, true)) {
        result = !criterion_run_all_tests(tests);
    }
    criterion_finalize(tests);
    if (result == 0 && access("/dev/nvidiactl", F_OK) != 0) {
        result = GT_SKIPPED;
    }
    return result;
}
