// Products whose result for one row of x does not depend on how many rows come with it
// (--batch-invariant): cuBLASLt with one algorithm per weight shape, chosen once and used for every
// row count. cuBLAS picks its algorithm by the row count (split-K for few rows, other tiles for
// many), which changes the order in which a row's sum is accumulated; here the algorithm, its tile,
// its split of K and its reduction scheme are fixed when the shape is first seen, so every row is
// summed the same way whatever n is. The choice (pick) is among the heuristic's algorithms for 1,
// 16, 64 and max_n rows, with their splits of K varied, that take every row count within the
// workspace; the one kept is the fastest over decode- and prefill-sized products, timed on the
// weight when it is first used. The GPU tests check that a row's bits do not change with n (gemm
// suite) and that sequences do not change with the batch (cuda_backend suite).
//
// The same handle serves the plain products of decode-sized steps (krk_tuned_gemm): there the
// algorithm is chosen per shape and class of row counts (the graph buckets from 9 to 256 rows), by
// timing the heuristic's candidates on the call's own operands with the L2 cache overwritten
// before each run, the first time the class runs outside a graph capture. cuBLAS's own choice for
// such counts reads a step's weights 3-5 % slower than the fastest of them (docs/PERF.md).
#include <cublasLt.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/util.cuh"
#include "krk/gemm.h"

namespace {

constexpr int kFixedSlots = 64;    // distinct (weight type, shape, alignment) of one model
constexpr int kCandidates = 16;    // heuristic results examined per shape
constexpr int kTunedSlots = 256;   // (shape, row class, alignment) of krk_tuned_gemm
// krk_tuned_gemm's row classes: n rows take the algorithm timed for the first class >= n (the
// backend's decode-graph buckets, whose steps run exactly these counts)
constexpr int64_t kTunedClass[] = {12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, KRK_TUNED_MAX_N};
constexpr int kTunedClasses = (int)(sizeof kTunedClass / sizeof kTunedClass[0]);

struct FixedAlgo {
    bool used, ok;
    bool f32;
    int64_t rows, cols;
    uint32_t align[3]; // W, x, y: the smaller of the address's alignment and 16 bytes
    cublasLtMatmulAlgo_t algo;
};

struct TunedAlgo {
    bool ok;          // false: no candidate ran (the class takes cuBLAS's own choice)
    int cls;
    int64_t rows, cols;
    uint32_t align[3];
    cublasLtMatmulAlgo_t algo;
};

} // namespace

struct krk_fixed_lt {
    cublasLtHandle_t h;
    void *ws;
    size_t ws_bytes;
    int64_t max_n;
    int n_used;
    FixedAlgo slot[kFixedSlots];
    int n_tuned;
    float tune_ms; // host time spent timing candidates, all classes
    TunedAlgo tuned[kTunedSlots];
};

extern "C" struct krk_fixed_lt *krk_fixed_lt_create(void *ws, size_t ws_bytes, int64_t max_n)
{
    if (max_n < 1) {
        return NULL;
    }
    struct krk_fixed_lt *lt = static_cast<struct krk_fixed_lt *>(calloc(1, sizeof(struct krk_fixed_lt)));
    if (!lt) {
        return NULL;
    }
    if (cublasLtCreate(&lt->h) != CUBLAS_STATUS_SUCCESS) {
        free(lt);
        return NULL;
    }
    lt->ws = ws;
    lt->ws_bytes = ws_bytes;
    lt->max_n = max_n;
    return lt;
}

extern "C" void krk_fixed_lt_grow(struct krk_fixed_lt *lt, int64_t max_n)
{
    if (lt && max_n > lt->max_n) {
        lt->max_n = max_n;
    }
}

extern "C" void krk_fixed_lt_free(struct krk_fixed_lt *lt)
{
    if (lt) {
        cublasLtDestroy(lt->h);
        free(lt);
    }
}

namespace {

uint32_t align16(const void *p)
{
    uint32_t a = 16;
    while (a > 1 && ((uintptr_t)p & (a - 1)) != 0) {
        a >>= 1;
    }
    return a;
}

// The descriptor and layouts of one call: y [n, ldy] (column-major rows x n in cuBLAS's terms) =
// W [rows, cols] (A, transposed) times x [n, ldx] (B, cols x n column-major).
struct Call {
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t a = NULL, b = NULL, d = NULL;
    bool ok = false;

    Call(bool f32, int64_t rows, int64_t cols, int64_t n, int64_t ldx, int64_t ldy)
    {
        const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        const cudaDataType_t t = f32 ? CUDA_R_32F : CUDA_R_16BF;
        ok = cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
             cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) == CUBLAS_STATUS_SUCCESS &&
             cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) == CUBLAS_STATUS_SUCCESS &&
             cublasLtMatrixLayoutCreate(&a, t, (uint64_t)cols, (uint64_t)rows, cols) == CUBLAS_STATUS_SUCCESS &&
             cublasLtMatrixLayoutCreate(&b, t, (uint64_t)cols, (uint64_t)n, ldx) == CUBLAS_STATUS_SUCCESS &&
             cublasLtMatrixLayoutCreate(&d, CUDA_R_32F, (uint64_t)rows, (uint64_t)n, ldy) == CUBLAS_STATUS_SUCCESS;
    }
    ~Call()
    {
        if (op) {
            cublasLtMatmulDescDestroy(op);
        }
        if (a) {
            cublasLtMatrixLayoutDestroy(a);
        }
        if (b) {
            cublasLtMatrixLayoutDestroy(b);
        }
        if (d) {
            cublasLtMatrixLayoutDestroy(d);
        }
    }
};

// Whether algo runs n rows of the shape within the workspace.
bool algo_takes(struct krk_fixed_lt *lt, const cublasLtMatmulAlgo_t &algo, bool f32, int64_t rows, int64_t cols,
                int64_t n)
{
    // leading dimensions as tight as the shape allows: the smallest the calls can have
    Call c(f32, rows, cols, n, cols, rows);
    cublasLtMatmulHeuristicResult_t r = {};
    return c.ok && cublasLtMatmulAlgoCheck(lt->h, c.op, c.a, c.b, c.d, c.d, &algo, &r) == CUBLAS_STATUS_SUCCESS &&
           r.workspaceSize <= lt->ws_bytes;
}

// The heuristic's algorithms for `ref` rows, appended to cand (at most cap), each as it comes and
// with its split of K set to 1, 2, 4 and 8 where it splits K.
int candidates(struct krk_fixed_lt *lt, bool f32, int64_t rows, int64_t cols, int64_t ref, const uint32_t (&align)[3],
               cublasLtMatmulAlgo_t *cand, int n, int cap)
{
    Call c(f32, rows, cols, ref, cols, rows);
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res[kCandidates] = {};
    int n_res = 0;
    const size_t ws = lt->ws_bytes;
    bool ok = c.ok && cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) ==
                  CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0],
                                                   sizeof align[0]) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1],
                                                   sizeof align[1]) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align[2],
                                                   sizeof align[2]) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align[2],
                                                   sizeof align[2]) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulAlgoGetHeuristic(lt->h, c.op, c.a, c.b, c.d, c.d, pref, kCandidates, res, &n_res) ==
                  CUBLAS_STATUS_SUCCESS;
    if (pref) {
        cublasLtMatmulPreferenceDestroy(pref);
    }
    for (int i = 0; ok && i < n_res && n < cap; i++) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS) {
            continue;
        }
        cand[n++] = res[i].algo;
        int32_t sk = 0;
        size_t w = 0;
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk, sizeof sk, &w);
        if (sk <= 1) {
            continue;
        }
        for (int32_t k = 1; k <= 8 && n < cap; k *= 2) {
            if (k != sk) {
                cand[n] = res[i].algo;
                if (cublasLtMatmulAlgoConfigSetAttribute(&cand[n], CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &k, sizeof k) ==
                    CUBLAS_STATUS_SUCCESS) {
                    n++;
                }
            }
        }
    }
    return n;
}

// Whether algo (or the same with its partial sums reduced in place, which it then becomes) takes 1
// and max_n rows within the workspace.
bool usable(struct krk_fixed_lt *lt, cublasLtMatmulAlgo_t *algo, bool f32, int64_t rows, int64_t cols)
{
    if (algo_takes(lt, *algo, f32, rows, cols, 1) && algo_takes(lt, *algo, f32, rows, cols, lt->max_n)) {
        return true;
    }
    cublasLtMatmulAlgo_t a = *algo;
    const int32_t inplace = CUBLASLT_REDUCTION_SCHEME_INPLACE;
    if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &inplace, sizeof inplace) ==
            CUBLAS_STATUS_SUCCESS &&
        algo_takes(lt, a, f32, rows, cols, 1) && algo_takes(lt, a, f32, rows, cols, lt->max_n)) {
        *algo = a;
        return true;
    }
    return false;
}

// Milliseconds of one product of n rows with algo (median of 3 after one warm-up); x [n, ldx] and
// y [n, ldy]; with flush, the workspace is overwritten before each run (outside the timing), which
// evicts the weight from L2 as a decode step finds it; a negative value when it fails.
float time_algo(struct krk_fixed_lt *lt, const cublasLtMatmulAlgo_t &algo, bool f32, const void *w, int64_t rows,
                int64_t cols, int64_t n, const void *x, int64_t ldx, float *y, int64_t ldy, bool flush,
                cudaStream_t stream, cudaEvent_t ev[2])
{
    Call c(f32, rows, cols, n, ldx, ldy);
    cublasLtMatmulHeuristicResult_t r = {};
    if (!c.ok || cublasLtMatmulAlgoCheck(lt->h, c.op, c.a, c.b, c.d, c.d, &algo, &r) != CUBLAS_STATUS_SUCCESS ||
        r.workspaceSize > lt->ws_bytes) {
        return -1.0f;
    }
    const float one = 1.0f, zero = 0.0f;
    float t[3];
    for (int i = -1; i < 3; i++) {
        if (flush && cudaMemsetAsync(lt->ws, i & 0xff, lt->ws_bytes, stream) != cudaSuccess) {
            return -1.0f;
        }
        cudaEventRecord(ev[0], stream);
        if (cublasLtMatmul(lt->h, c.op, &one, w, c.a, x, c.b, &zero, y, c.d, y, c.d, &algo, lt->ws, r.workspaceSize,
                           stream) != CUBLAS_STATUS_SUCCESS) {
            return -1.0f;
        }
        cudaEventRecord(ev[1], stream);
        if (cudaEventSynchronize(ev[1]) != cudaSuccess) {
            return -1.0f;
        }
        if (i >= 0) {
            cudaEventElapsedTime(&t[i], ev[0], ev[1]);
        }
    }
    const float lo = fminf(t[0], fminf(t[1], t[2])), hi = fmaxf(t[0], fmaxf(t[1], t[2]));
    return t[0] + t[1] + t[2] - lo - hi;
}

// Chooses f's algorithm: among the heuristic's candidates for 1, 16, 64 and max_n rows (and their
// splits of K), those that take every row count; timed on the call's weight at 1, 16, 64 and up to
// 512 rows when the stream is not being captured, the one with the least sum of its times relative
// to the fastest candidate's at each count; else (a capture) the first.
void pick(struct krk_fixed_lt *lt, FixedAlgo *f, bool f32, const void *w, int64_t rows, int64_t cols,
          const uint32_t (&align)[3], cudaStream_t stream)
{
    constexpr int kMax = 96;
    cublasLtMatmulAlgo_t cand[kMax];
    int n = 0;
    const int64_t refs[4] = {1, 16, 64, lt->max_n};
    for (int r = 0; r < 4; r++) {
        if (refs[r] <= lt->max_n) {
            n = candidates(lt, f32, rows, cols, refs[r], align, cand, n, kMax);
        }
    }
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (usable(lt, &cand[i], f32, rows, cols)) {
            cand[m++] = cand[i];
        }
    }
    if (m == 0) {
        return;
    }
    f->algo = cand[0];
    f->ok = true;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (m == 1 || cudaStreamIsCapturing(stream, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
        return;
    }
    const int64_t big = lt->max_n < 512 ? lt->max_n : 512;
    const int64_t counts[4] = {1, 16 < big ? 16 : big, 64 < big ? 64 : big, big};
    const size_t elt = f32 ? 4 : 2;
    void *x = NULL, *y = NULL;
    cudaEvent_t ev[2] = {NULL, NULL};
    if (cudaMalloc(&x, (size_t)(big * cols) * elt) != cudaSuccess ||
        cudaMalloc(&y, (size_t)(big * rows) * sizeof(float)) != cudaSuccess ||
        cudaMemsetAsync(x, 0, (size_t)(big * cols) * elt, stream) != cudaSuccess ||
        cudaEventCreate(&ev[0]) != cudaSuccess || cudaEventCreate(&ev[1]) != cudaSuccess) {
        cudaGetLastError(); // (no room to time: the first candidate)
    } else {
        float t[kMax][4];
        float best[4] = {INFINITY, INFINITY, INFINITY, INFINITY};
        for (int i = 0; i < m; i++) {
            for (int j = 0; j < 4; j++) {
                t[i][j] = time_algo(lt, cand[i], f32, w, rows, cols, counts[j], x, cols, static_cast<float *>(y),
                                    rows, false, stream, ev);
                best[j] = t[i][j] > 0 && t[i][j] < best[j] ? t[i][j] : best[j];
            }
        }
        float best_score = INFINITY;
        for (int i = 0; i < m; i++) {
            float score = 0;
            for (int j = 0; j < 4; j++) {
                score += t[i][j] > 0 ? t[i][j] / best[j] : INFINITY;
            }
            if (score < best_score) {
                best_score = score;
                f->algo = cand[i];
            }
        }
    }
    for (int i = 0; i < 2; i++) {
        if (ev[i]) {
            cudaEventDestroy(ev[i]);
        }
    }
    cudaFree(x);
    cudaFree(y);
}

// Runs p with algo: KR_ERR_UNSUPPORTED (nothing launched) when algo does not take p's row count and
// leading dimensions within the workspace; KR_ERR_CUDA when the descriptors cannot be made or the
// matmul fails (a message naming `what`).
enum kr_status run_algo(struct krk_fixed_lt *lt, const cublasLtMatmulAlgo_t &algo,
                        const struct krk_fixed_gemm_params *p, const char *what, cudaStream_t stream)
{
    Call c(p->f32, p->rows, p->cols, p->n, p->ldx, p->ldy);
    if (!c.ok) {
        return KR_ERR_CUDA;
    }
    cublasLtMatmulHeuristicResult_t r = {};
    if (cublasLtMatmulAlgoCheck(lt->h, c.op, c.a, c.b, c.d, c.d, &algo, &r) != CUBLAS_STATUS_SUCCESS ||
        r.workspaceSize > lt->ws_bytes) {
        return KR_ERR_UNSUPPORTED;
    }
    const float one = 1.0f, zero = 0.0f;
    const cublasStatus_t s = cublasLtMatmul(lt->h, c.op, &one, p->w, c.a, p->x, c.b, &zero, p->y, c.d, p->y, c.d,
                                            &algo, lt->ws, r.workspaceSize, stream);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "krk: cublasLtMatmul (%s, %lld x %lld x %lld): status %d\n", what, (long long)p->rows,
                (long long)p->n, (long long)p->cols, (int)s);
        return KR_ERR_CUDA;
    }
    return KR_OK;
}

FixedAlgo *algo_for(struct krk_fixed_lt *lt, bool f32, const void *w, int64_t rows, int64_t cols,
                    const uint32_t (&align)[3], cudaStream_t stream)
{
    for (int i = 0; i < lt->n_used; i++) {
        FixedAlgo *f = &lt->slot[i];
        if (f->f32 == f32 && f->rows == rows && f->cols == cols && memcmp(f->align, align, sizeof f->align) == 0) {
            return f;
        }
    }
    if (lt->n_used == kFixedSlots) {
        return NULL; // never forgotten: a shape's algorithm must stay the same for the process's life
    }
    FixedAlgo *f = &lt->slot[lt->n_used++];
    memset(f, 0, sizeof *f);
    f->used = true;
    f->f32 = f32;
    f->rows = rows;
    f->cols = cols;
    memcpy(f->align, align, sizeof f->align);
    pick(lt, f, f32, w, rows, cols, align, stream);
    return f;
}

} // namespace

extern "C" enum kr_status krk_fixed_gemm(struct krk_fixed_lt *lt, const struct krk_fixed_gemm_params *p,
                                         cudaStream_t stream)
{
    KRK_REQUIRE(lt && p && p->rows >= 1 && p->cols >= 1 && p->n >= 0 && p->ldx >= p->cols && p->ldy >= p->rows);
    if (p->n == 0) {
        return KR_OK;
    }
    KRK_REQUIRE(p->w && p->x && p->y);
    KRK_REQUIRE_MSG(p->n <= lt->max_n, "fixed-order product: %lld rows, at most %lld (the reserved step)",
                    (long long)p->n, (long long)lt->max_n);
    const uint32_t align[3] = {align16(p->w), align16(p->x), align16(p->y)};
    FixedAlgo *f = algo_for(lt, p->f32, p->w, p->rows, p->cols, align, stream);
    if (!f || !f->ok) {
        fprintf(stderr, "krk: no fixed-order cuBLASLt algorithm for a %s %lld x %lld weight (1..%lld rows)\n",
                p->f32 ? "fp32" : "bf16", (long long)p->rows, (long long)p->cols, (long long)lt->max_n);
        return KR_ERR_UNSUPPORTED;
    }
    const enum kr_status st = run_algo(lt, f->algo, p, "fixed order", stream);
    if (st == KR_ERR_UNSUPPORTED) {
        fprintf(stderr, "krk: the fixed-order algorithm of a %lld x %lld weight does not take %lld rows (ldx %lld, "
                "ldy %lld)\n", (long long)p->rows, (long long)p->cols, (long long)p->n, (long long)p->ldx,
                (long long)p->ldy);
    }
    return st;
}

extern "C" int krk_fixed_algo_id(struct krk_fixed_lt *lt, bool f32, int64_t rows, int64_t cols, int *splits)
{
    for (int i = 0; lt && i < lt->n_used; i++) {
        FixedAlgo *f = &lt->slot[i];
        if (f->ok && f->f32 == f32 && f->rows == rows && f->cols == cols) {
            int id = -1, sk = 0;
            size_t w = 0;
            cublasLtMatmulAlgoConfigGetAttribute(&f->algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &w);
            cublasLtMatmulAlgoConfigGetAttribute(&f->algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk, sizeof sk, &w);
            if (splits) {
                *splits = sk;
            }
            return id;
        }
    }
    return -1;
}

// ---- krk_tuned_gemm: the fastest algorithm per shape and row class (plain decode steps) ----------

namespace {

int tuned_class(int64_t n)
{
    for (int i = 0; i < kTunedClasses; i++) {
        if (n <= kTunedClass[i]) {
            return i;
        }
    }
    return -1;
}

// Times the heuristic's candidates for the call's n (and their splits of K) on the call's operands
// and keeps the fastest in f; f->ok stays false when none runs.
void tune(struct krk_fixed_lt *lt, TunedAlgo *f, const struct krk_fixed_gemm_params *p, const uint32_t (&align)[3],
          cudaStream_t stream)
{
    constexpr int kMax = 64;
    cublasLtMatmulAlgo_t cand[kMax];
    const int n = candidates(lt, false, p->rows, p->cols, p->n, align, cand, 0, kMax);
    cudaEvent_t ev[2] = {NULL, NULL};
    if (n == 0 || cudaEventCreate(&ev[0]) != cudaSuccess || cudaEventCreate(&ev[1]) != cudaSuccess) {
        cudaGetLastError();
    } else {
        float best = INFINITY;
        for (int i = 0; i < n; i++) {
            const float t = time_algo(lt, cand[i], false, p->w, p->rows, p->cols, p->n, p->x, p->ldx, p->y, p->ldy,
                                      true, stream, ev);
            if (t > 0 && t < best) {
                best = t;
                f->algo = cand[i];
                f->ok = true;
            }
        }
        cudaGetLastError(); // a candidate that failed to launch leaves nothing behind
    }
    for (int i = 0; i < 2; i++) {
        if (ev[i]) {
            cudaEventDestroy(ev[i]);
        }
    }
}

} // namespace

extern "C" enum kr_status krk_tuned_gemm(struct krk_fixed_lt *lt, const struct krk_fixed_gemm_params *p,
                                         cudaStream_t stream)
{
    KRK_REQUIRE(lt && p && p->rows >= 1 && p->cols >= 1 && p->n >= 0 && p->ldx >= p->cols && p->ldy >= p->rows);
    const int cls = tuned_class(p->n);
    if (p->f32 || p->n < KRK_TUNED_MIN_N || cls < 0 || p->rows * p->cols * 2 < KRK_TUNED_MIN_BYTES) {
        return KR_ERR_UNSUPPORTED;
    }
    KRK_REQUIRE(p->w && p->x && p->y);
    const uint32_t align[3] = {align16(p->w), align16(p->x), align16(p->y)};
    TunedAlgo *f = NULL;
    for (int i = 0; i < lt->n_tuned && !f; i++) {
        TunedAlgo *t = &lt->tuned[i];
        if (t->cls == cls && t->rows == p->rows && t->cols == p->cols && memcmp(t->align, align, sizeof align) == 0) {
            f = t;
        }
    }
    if (!f) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        if (lt->n_tuned == kTunedSlots || cudaStreamIsCapturing(stream, &cs) != cudaSuccess ||
            cs != cudaStreamCaptureStatusNone) {
            cudaGetLastError();
            return KR_ERR_UNSUPPORTED; // nothing can be timed inside a capture: cuBLAS's choice
        }
        f = &lt->tuned[lt->n_tuned++];
        memset(f, 0, sizeof *f);
        f->cls = cls;
        f->rows = p->rows;
        f->cols = p->cols;
        memcpy(f->align, align, sizeof align);
        cudaEvent_t h0 = NULL, h1 = NULL;
        const bool timed = cudaEventCreate(&h0) == cudaSuccess && cudaEventCreate(&h1) == cudaSuccess &&
                           cudaEventRecord(h0, stream) == cudaSuccess;
        tune(lt, f, p, align, stream);
        float ms = 0;
        if (timed && cudaEventRecord(h1, stream) == cudaSuccess && cudaEventSynchronize(h1) == cudaSuccess &&
            cudaEventElapsedTime(&ms, h0, h1) == cudaSuccess) {
            lt->tune_ms += ms;
        }
        cudaGetLastError();
        if (h0) {
            cudaEventDestroy(h0);
        }
        if (h1) {
            cudaEventDestroy(h1);
        }
    }
    if (!f->ok) {
        return KR_ERR_UNSUPPORTED;
    }
    return run_algo(lt, f->algo, p, "tuned", stream); // (unsupported: a count or leading dimensions it does not take)
}

extern "C" int krk_tuned_info(const struct krk_fixed_lt *lt, float *ms)
{
    if (ms) {
        *ms = lt ? lt->tune_ms : 0.0f;
    }
    int n = 0;
    for (int i = 0; lt && i < lt->n_tuned; i++) {
        n += lt->tuned[i].ok;
    }
    return n;
}
