/* The CUDA backend's tensor-parallel group (backend/comm-cuda.h) on one GPU: several ranks on the
 * device (the peer kernels over its memory, as KRAIT_TP_ONE_DEVICE runs them) and the NCCL path
 * with one rank. The references are sums and layouts computed on the host from the same inputs:
 *  - all-reduce: every rank's result equals the host's rank-order fp32 sum bit for bit (the kernels
 *    add in rank order), for sizes from 1 element to past one launch's capacity (chunked);
 *  - all-gather: the ranks' blocks side by side, exactly, also chunked by rows;
 *  - the same collectives captured into CUDA graphs and replayed with new inputs;
 *  - a rank that never joins: the others leave when the group is aborted, and by the watchdog's
 *    timeout when nobody aborts; later collectives are refused;
 *  - NCCL with one rank: the all-reduce leaves x as it is, the all-gather copies;
 *  - the one-device exchange the server's ranks use on one GPU (each rank's thread calls, events order
 *    the streams): the same sums and layouts over many calls, and a rank left alone at a collective is
 *    released by an abort. */
#include "gpu-test.h"

#include "alloc.h"
#include "comm-cuda.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

TestSuite(tp);

struct grp {
    struct kr_cuda_comm *c;
    int size;
    cudaStream_t s[8];
};

static void grp_make(struct grp *g, int size, double timeout_s)
{
    int devs[8] = {0};
    struct kr_cuda_comm_opts o = {.size = size, .devices = devs, .one_device = true, .timeout_s = timeout_s};
    struct kr_err err = {0};
    cr_assert_eq(kr_cuda_comm_create(&o, &g->c, &err), KR_OK, "%s", err.msg);
    g->size = size;
    for (int r = 0; r < size; r++) {
        cr_assert_eq(cudaStreamCreateWithFlags(&g->s[r], cudaStreamNonBlocking), cudaSuccess);
    }
}

static void grp_free(struct grp *g)
{
    for (int r = 0; r < g->size; r++) {
        cudaStreamSynchronize(g->s[r]);
        cudaStreamDestroy(g->s[r]);
    }
    kr_cuda_comm_free(g->c);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* All-reduce of n elements over `size` ranks: each rank's result against the host's sum. */
static void check_all_reduce(struct grp *g, int64_t n, struct gt_rng *rng)
{
    const int size = g->size;
    float *h[8], *d[8];
    float *ref = kr_malloc((size_t)n * sizeof(float)), *got = kr_malloc((size_t)n * sizeof(float));
    cr_assert(ref && got);
    for (int r = 0; r < size; r++) {
        h[r] = kr_malloc((size_t)n * sizeof(float));
        cr_assert(h[r]);
        gt_fill(rng, h[r], (size_t)n, -2.0f, 2.0f);
        d[r] = gt_dup(h[r], (size_t)n * sizeof(float));
    }
    for (int64_t i = 0; i < n; i++) {
        float s = 0.0f;
        for (int r = 0; r < size; r++) {
            s += h[r][i];
        }
        ref[i] = s;
    }
    /* one thread enqueues every rank's part: the launches return at once and the kernels meet on
     * the device */
    for (int r = 0; r < size; r++) {
        cr_assert_eq(kr_cuda_comm_all_reduce(g->c, r, d[r], n, g->s[r], 1), KR_OK, "rank %d", r);
    }
    for (int r = 0; r < size; r++) {
        cr_assert_eq(cudaStreamSynchronize(g->s[r]), cudaSuccess);
        cr_expect(kr_cuda_comm_ok(g->c, r));
        gt_down(got, d[r], (size_t)n * sizeof(float));
        int64_t bad = 0, first = -1;
        for (int64_t i = 0; i < n; i++) {
            if (memcmp(&got[i], &ref[i], sizeof(float)) != 0) {
                first = bad++ ? first : i;
            }
        }
        cr_expect_eq(bad, 0, "%d ranks, n %lld, rank %d: %lld elements differ from the host's sum (first %lld: %g "
                     "against %g)", size, (long long)n, r, (long long)bad, (long long)first,
                     first >= 0 ? got[first] : 0.0, first >= 0 ? ref[first] : 0.0);
        gt_dfree(d[r]);
        kr_free(h[r]);
    }
    kr_free(ref);
    kr_free(got);
}

Test(tp, all_reduce_on_one_device_is_the_rank_order_sum)
{
    GT_REQUIRE_GPU();
    struct gt_rng rng = {11};
    static const int64_t sizes[] = {1, 3, 4, 1000, 4096, 2048 * 33 + 5, (1 << 22) + 7};
    for (int size = 2; size <= 4; size++) {
        struct grp g;
        grp_make(&g, size, 30);
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            check_all_reduce(&g, sizes[k], &rng);
        }
        grp_free(&g);
    }
}

Test(tp, all_gather_on_one_device_puts_the_blocks_side_by_side)
{
    GT_REQUIRE_GPU();
    struct gt_rng rng = {12};
    static const int64_t shapes[][2] = {{1, 1}, {3, 5}, {16, 4096}, {7, 65536}, {130, 65536}};
    for (int size = 2; size <= 4; size += 2) {
        struct grp g;
        grp_make(&g, size, 30);
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            const int64_t rows = shapes[k][0], cols = shapes[k][1], n = rows * cols, w = (int64_t)size * cols;
            float *h[4], *d[4], *dst[4];
            for (int r = 0; r < size; r++) {
                h[r] = kr_malloc((size_t)n * sizeof(float));
                cr_assert(h[r]);
                gt_fill(&rng, h[r], (size_t)n, -1.0f, 1.0f);
                d[r] = gt_dup(h[r], (size_t)n * sizeof(float));
                dst[r] = gt_dalloc((size_t)(rows * w) * sizeof(float));
            }
            for (int r = 0; r < size; r++) {
                cr_assert_eq(kr_cuda_comm_all_gather(g.c, r, d[r], rows, cols, dst[r], g.s[r], 1), KR_OK);
            }
            float *got = kr_malloc((size_t)(rows * w) * sizeof(float));
            cr_assert(got);
            for (int r = 0; r < size; r++) {
                cr_assert_eq(cudaStreamSynchronize(g.s[r]), cudaSuccess);
                gt_down(got, dst[r], (size_t)(rows * w) * sizeof(float));
                int64_t bad = 0;
                for (int64_t i = 0; i < rows; i++) {
                    for (int q = 0; q < size; q++) {
                        bad += memcmp(got + i * w + q * cols, h[q] + i * cols, (size_t)cols * sizeof(float)) != 0;
                    }
                }
                cr_expect_eq(bad, 0, "%d ranks, [%lld, %lld], rank %d: %lld blocks misplaced", size, (long long)rows,
                             (long long)cols, r, (long long)bad);
            }
            kr_free(got);
            for (int r = 0; r < size; r++) {
                gt_dfree(d[r]);
                gt_dfree(dst[r]);
                kr_free(h[r]);
            }
        }
        grp_free(&g);
    }
}

/* Each rank captures a graph of two all-reduces of its buffer, then the graphs are replayed three
 * times with new inputs: the second all-reduce adds the ranks' equal sums, giving size * sum (exact
 * for the small integers used). */
Test(tp, collectives_captured_in_graphs_replay_with_new_inputs)
{
    GT_REQUIRE_GPU();
    enum { SIZE = 3, N = 5000 };
    struct grp g;
    grp_make(&g, SIZE, 30);
    float *d[SIZE];
    cudaGraphExec_t exec[SIZE];
    for (int r = 0; r < SIZE; r++) {
        d[r] = gt_dalloc(N * sizeof(float));
        cudaGraph_t graph;
        cr_assert_eq(cudaStreamBeginCapture(g.s[r], cudaStreamCaptureModeThreadLocal), cudaSuccess);
        cr_assert_eq(kr_cuda_comm_all_reduce(g.c, r, d[r], N, g.s[r], 1), KR_OK);
        cr_assert_eq(kr_cuda_comm_all_reduce(g.c, r, d[r], N, g.s[r], 1), KR_OK);
        cr_assert_eq(cudaStreamEndCapture(g.s[r], &graph), cudaSuccess);
        cr_assert_eq(cudaGraphInstantiate(&exec[r], graph, 0), cudaSuccess);
        cudaGraphDestroy(graph);
    }
    static float h[SIZE][N], got[N];
    for (int round = 0; round < 3; round++) {
        for (int r = 0; r < SIZE; r++) {
            for (int i = 0; i < N; i++) {
                h[r][i] = (float)((i * 7 + r * 13 + round * 31) % 101 - 50);
            }
            cr_assert_eq(cudaMemcpy(d[r], h[r], sizeof h[r], cudaMemcpyHostToDevice), cudaSuccess);
        }
        for (int r = 0; r < SIZE; r++) {
            cr_assert_eq(cudaGraphLaunch(exec[r], g.s[r]), cudaSuccess);
        }
        for (int r = 0; r < SIZE; r++) {
            cr_assert_eq(cudaStreamSynchronize(g.s[r]), cudaSuccess);
            cr_assert_eq(cudaMemcpy(got, d[r], sizeof got, cudaMemcpyDeviceToHost), cudaSuccess);
            int bad = 0;
            for (int i = 0; i < N; i++) {
                const float want = (float)SIZE * (h[0][i] + h[1][i] + h[2][i]);
                bad += got[i] != want;
            }
            cr_expect_eq(bad, 0, "replay %d, rank %d: %d elements wrong", round, r, bad);
        }
    }
    for (int r = 0; r < SIZE; r++) {
        cudaGraphExecDestroy(exec[r]);
        gt_dfree(d[r]);
    }
    grp_free(&g);
}

/* Rank 1 never joins: rank 0's all-reduce waits until the group is aborted (as a failed rank does),
 * then leaves; the group then refuses every collective and reports itself failed. */
Test(tp, an_abort_releases_a_rank_waiting_for_a_peer)
{
    GT_REQUIRE_GPU();
    struct grp g;
    grp_make(&g, 2, 600);
    float *d = gt_dalloc(1024 * sizeof(float));
    cr_assert_eq(kr_cuda_comm_all_reduce(g.c, 0, d, 1024, g.s[0], 1), KR_OK);
    usleep(300 * 1000);
    cr_expect_eq(cudaStreamQuery(g.s[0]), cudaErrorNotReady, "rank 0 waits for its peer");
    const double t0 = now_s();
    kr_cuda_comm_abort(g.c);
    cr_assert_eq(cudaStreamSynchronize(g.s[0]), cudaSuccess);
    const double dt = now_s() - t0;
    cr_expect_lt(dt, 5.0, "rank 0 left its wait %.2f s after the abort", dt);
    cr_expect(!kr_cuda_comm_ok(g.c, 0), "the group reports the failure");
    cr_expect_eq(kr_cuda_comm_all_reduce(g.c, 1, d, 1024, g.s[1], 1), KR_ERR_CANCELLED);
    cr_expect_eq(kr_cuda_comm_all_gather(g.c, 0, d, 2, 8, d + 512, g.s[0], 1), KR_ERR_CANCELLED);
    gt_dfree(d);
    grp_free(&g);
}

/* Nobody aborts: the rank's step, issued and timed by the watchdog (timeout 1 s), is released by
 * the group's timeout (the watchdog's abort or the kernel's own bound, whichever comes first). */
Test(tp, a_peer_that_never_comes_times_out)
{
    GT_REQUIRE_GPU();
    struct grp g;
    grp_make(&g, 2, 1);
    float *d = gt_dalloc(1024 * sizeof(float));
    const double t0 = now_s();
    cr_assert_eq(kr_cuda_comm_all_reduce(g.c, 0, d, 1024, g.s[0], 1), KR_OK);
    kr_cuda_comm_step_issued(g.c, 0, g.s[0]);
    cr_assert_eq(cudaStreamSynchronize(g.s[0]), cudaSuccess);
    const double dt = now_s() - t0;
    cr_expect(dt > 0.9 && dt < 10.0, "released after %.2f s (timeout 1 s)", dt);
    cr_expect(!kr_cuda_comm_ok(g.c, 0), "the rank reports the failure");
    gt_dfree(d);
    grp_free(&g);
}

/* NCCL's path with one rank (NCCL refuses two ranks on one device): a real communicator, the
 * all-reduce leaves x as it is, the all-gather copies through the staging and the layout copies. */
Test(tp, nccl_with_one_rank)
{
    GT_REQUIRE_GPU();
    int dev = 0;
    struct kr_cuda_comm_opts o = {.size = 1, .devices = &dev, .timeout_s = 30};
    struct kr_cuda_comm *c = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_cuda_comm_create(&o, &c, &err), KR_OK, "%s", err.msg);
    if (!kr_cuda_comm_has_nccl(c)) {
        kr_cuda_comm_free(c);
        cr_skip_test("this build has no NCCL");
    }
    cudaStream_t s;
    cr_assert_eq(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    enum { ROWS = 9, COLS = 1000 };
    static float h[ROWS * COLS], got[ROWS * COLS];
    struct gt_rng rng = {13};
    gt_fill(&rng, h, ROWS * COLS, -1.0f, 1.0f);
    float *d = gt_dup(h, sizeof h), *dst = gt_dalloc(sizeof h);
    cr_assert_eq(kr_cuda_comm_all_reduce(c, 0, d, ROWS * COLS, s, 2), KR_OK);
    cr_assert_eq(kr_cuda_comm_all_gather(c, 0, d, ROWS, COLS, dst, s, 2), KR_OK);
    cr_assert_eq(cudaStreamSynchronize(s), cudaSuccess);
    gt_down(got, d, sizeof got);
    cr_expect_eq(memcmp(got, h, sizeof h), 0, "the one-rank all-reduce changed x");
    gt_down(got, dst, sizeof got);
    cr_expect_eq(memcmp(got, h, sizeof h), 0, "the one-rank all-gather is a copy");
    gt_dfree(d);
    gt_dfree(dst);
    cudaStreamDestroy(s);
    kr_cuda_comm_free(c);
}

/* ---- the one-device exchange (force 0 on a one-device group), each rank on its own thread -------- */

struct od_rank {
    struct grp *g;
    int rank;
    float *h[8];      /* every rank's inputs of a call (host), shared */
    int64_t n;
    enum kr_status st;
    float *d, *dst;
};

enum { OD_CALLS = 40, OD_N = 4000, OD_ROWS = 5, OD_COLS = 700 }; /* OD_ROWS * OD_COLS <= OD_N */

static void *od_main(void *arg)
{
    struct od_rank *k = arg;
    cudaSetDevice(0);
    k->st = KR_OK;
    for (int call = 0; call < OD_CALLS && k->st == KR_OK; call++) {
        /* alternate sizes: an all-reduce of n, then an all-gather */
        const int64_t n = call % 2 ? OD_ROWS * OD_COLS : OD_N - call;
        float *in = k->h[k->rank] + (size_t)call * OD_N;
        const cudaError_t e = cudaMemcpyAsync(k->d, in, (size_t)n * sizeof(float), cudaMemcpyHostToDevice,
                                              k->g->s[k->rank]);
        if (e != cudaSuccess) {
            fprintf(stderr, "rank %d call %d: the input's copy: %s\n", k->rank, call, cudaGetErrorString(e));
            k->st = KR_ERR_CUDA;
            break;
        }
        k->st = call % 2 ? kr_cuda_comm_all_gather(k->g->c, k->rank, k->d, OD_ROWS, OD_COLS,
                                                    k->dst + (size_t)call * OD_N * 8, k->g->s[k->rank], 0)
                         : kr_cuda_comm_all_reduce(k->g->c, k->rank, k->d, n, k->g->s[k->rank], 0);
        if (k->st == KR_OK && call % 2 == 0 &&
            cudaMemcpyAsync(k->dst + (size_t)call * OD_N * 8, k->d, (size_t)n * sizeof(float),
                            cudaMemcpyDeviceToDevice, k->g->s[k->rank]) != cudaSuccess) {
            fprintf(stderr, "rank %d call %d: the output's copy\n", k->rank, call);
            k->st = KR_ERR_CUDA;
        }
        if (k->st != KR_OK) {
            fprintf(stderr, "rank %d call %d: status %d\n", k->rank, call, (int)k->st);
        }
    }
    const cudaError_t e = cudaStreamSynchronize(k->g->s[k->rank]);
    if (e != cudaSuccess) {
        fprintf(stderr, "rank %d: the stream: %s\n", k->rank, cudaGetErrorString(e));
        k->st = KR_ERR_CUDA;
    }
    return NULL;
}

Test(tp, the_one_device_exchange_matches_the_host_over_many_calls)
{
    GT_REQUIRE_GPU();
    enum { SIZE = 3 };
    struct grp g;
    grp_make(&g, SIZE, 30);
    struct gt_rng rng = {14};
    struct od_rank k[SIZE];
    float *h[SIZE];
    for (int r = 0; r < SIZE; r++) {
        h[r] = kr_malloc((size_t)OD_CALLS * OD_N * sizeof(float));
        cr_assert(h[r]);
        gt_fill(&rng, h[r], (size_t)OD_CALLS * OD_N, -1.0f, 1.0f);
    }
    pthread_t th[SIZE];
    for (int r = 0; r < SIZE; r++) {
        k[r] = (struct od_rank){.g = &g, .rank = r};
        memcpy(k[r].h, h, sizeof h);
        k[r].d = gt_dalloc((size_t)OD_N * sizeof(float));
        k[r].dst = gt_dalloc((size_t)OD_CALLS * OD_N * 8 * sizeof(float));
    }
    for (int r = 0; r < SIZE; r++) {
        cr_assert_eq(pthread_create(&th[r], NULL, od_main, &k[r]), 0);
    }
    for (int r = 0; r < SIZE; r++) {
        pthread_join(th[r], NULL);
        cr_expect_eq(k[r].st, KR_OK, "rank %d: %d", r, (int)k[r].st);
    }
    float *got = kr_malloc((size_t)OD_CALLS * OD_N * 8 * sizeof(float));
    cr_assert(got);
    for (int r = 0; r < SIZE; r++) {
        gt_down(got, k[r].dst, (size_t)OD_CALLS * OD_N * 8 * sizeof(float));
        int64_t bad = 0;
        for (int call = 0; call < OD_CALLS; call++) {
            const float *o = got + (size_t)call * OD_N * 8;
            if (call % 2 == 0) {
                for (int64_t i = 0; i < OD_N - call; i++) {
                    float s = 0.0f;
                    for (int q = 0; q < SIZE; q++) {
                        s += h[q][(size_t)call * OD_N + (size_t)i];
                    }
                    bad += memcmp(&s, &o[i], sizeof s) != 0;
                }
            } else {
                for (int64_t i = 0; i < OD_ROWS; i++) {
                    for (int q = 0; q < SIZE; q++) {
                        bad += memcmp(o + i * SIZE * OD_COLS + q * OD_COLS,
                                      h[q] + (size_t)call * OD_N + (size_t)(i * OD_COLS), OD_COLS * sizeof(float)) != 0;
                    }
                }
            }
        }
        cr_expect_eq(bad, 0, "rank %d: %lld elements or blocks differ from the host's", r, (long long)bad);
    }
    kr_free(got);
    for (int r = 0; r < SIZE; r++) {
        gt_dfree(k[r].d);
        gt_dfree(k[r].dst);
        kr_free(h[r]);
    }
    grp_free(&g);
}

struct lone {
    struct grp *g;
    float *d;
    enum kr_status st;
};

static void *lone_main(void *arg)
{
    struct lone *l = arg;
    cudaSetDevice(0);
    l->st = kr_cuda_comm_all_reduce(l->g->c, 0, l->d, 100, l->g->s[0], 0);
    return NULL;
}

Test(tp, a_rank_alone_at_a_one_device_collective_is_released_by_an_abort)
{
    GT_REQUIRE_GPU();
    struct grp g;
    grp_make(&g, 2, 600);
    struct lone l = {.g = &g, .d = gt_dalloc(100 * sizeof(float))};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, lone_main, &l), 0);
    usleep(300 * 1000);
    const double t0 = now_s();
    kr_cuda_comm_abort(g.c);
    pthread_join(th, NULL);
    cr_expect_lt(now_s() - t0, 2.0, "released %.2f s after the abort", now_s() - t0);
    cr_expect_eq(l.st, KR_ERR_CANCELLED);
    gt_dfree(l.d);
    grp_free(&g);
}
