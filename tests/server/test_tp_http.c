/* Tensor parallelism served: `krait serve --tensor-parallel-size N` on the CPU (ranks as threads of
 * one process) against the same checkpoint served whole, over HTTP. Every rank holds its shard and
 * caches; the engine plans each step once and rank 0 samples. Checked per fixture family:
 *  - greedy tokens equal and log-probabilities (generated and prompt) within 5e-5 of TP 1 (the
 *    tolerance tests/backend/test_tp.c holds for the ranks run directly);
 *  - n = 2 choices forking from one prefill (slot and block copies replayed on every rank);
 *  - a prompt, then the same prompt extended: the second is restored from the prefix cache (a state
 *    snapshot's copy on every rank) and must answer as TP 1 does;
 *  - eight requests at once, batched together, each as TP 1 answers it alone;
 *  - a rank count that does not divide the model is refused at start with a message naming it;
 *  - a rank that dies mid-step (KRAIT_FAULT_RANK): the group leaves its collectives, the request
 *    gets an error naming the rank, and the process exits 3 on its own, never hanging. */
#include "harness.h"

#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define FX KR_SOURCE_DIR "/tests/fixtures/"
#define LP_TOL 5e-5

TestSuite(tp_http, .timeout = 600);

/* A prompt of n ids from a seed (ids below the fixtures' vocabulary of 256). */
static void prompt_json(char *out, size_t cap, int n, unsigned seed)
{
    size_t k = (size_t)snprintf(out, cap, "[");
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        k += (size_t)snprintf(out + k, cap - k, "%s%u", i ? "," : "", 1 + (seed >> 16) % 250);
    }
    snprintf(out + k, cap - k, "]");
}

struct answer {
    int n_choices;
    int tok[2][16];
    double lp[2][16];
    int n_tok[2];
    double plp[64];  /* prompt log-probabilities, [0] unused */
    int n_plp;
};

static void ask(const struct srv_proc *p, const char *prompt, int n, int max_tokens, bool plp, struct answer *a)
{
    char body[4096];
    snprintf(body, sizeof body,
             "{\"prompt\":%s,\"max_tokens\":%d,\"temperature\":0,\"logprobs\":1,\"n\":%d,"
             "\"return_tokens_as_token_ids\":true%s}",
             prompt, max_tokens, n, plp ? ",\"prompt_logprobs\":0" : "");
    long st = 0;
    json_t *j = post_json(p, "/v1/completions", body, &st);
    cr_assert_eq(st, 200, "status %ld: %s", st, json_dumps(j, 0));
    memset(a, 0, sizeof *a);
    json_t *ch = json_object_get(j, "choices");
    a->n_choices = (int)json_array_size(ch);
    for (size_t i = 0; i < json_array_size(ch) && i < 2; i++) {
        json_t *c = json_array_get(ch, i);
        const int idx = (int)json_integer_value(json_object_get(c, "index"));
        cr_assert(idx >= 0 && idx < 2);
        json_t *lps = json_object_get(c, "logprobs");
        json_t *toks = json_object_get(lps, "tokens"), *tlp = json_object_get(lps, "token_logprobs");
        for (size_t t = 0; t < json_array_size(toks) && t < 16; t++) {
            a->tok[idx][t] = atoi(json_string_value(json_array_get(toks, t)) + strlen("token_id:"));
            a->lp[idx][t] = json_number_value(json_array_get(tlp, t));
            a->n_tok[idx]++;
        }
        json_t *pl = json_object_get(c, "prompt_logprobs");
        if (!pl) {
            pl = json_object_get(j, "prompt_logprobs");
        }
        for (size_t t = 1; plp && pl && t < json_array_size(pl) && t < 64; t++) {
            const char *key;
            json_t *v;
            json_object_foreach(json_array_get(pl, t), key, v) {
                if (json_integer_value(json_object_get(v, "rank")) >= 0) {
                    a->plp[t] = json_number_value(json_object_get(v, "logprob"));
                    break;
                }
            }
            a->n_plp = (int)t + 1;
        }
    }
    json_decref(j);
}

static void expect_same(const struct answer *whole, const struct answer *tp, const char *what)
{
    cr_assert_eq(tp->n_choices, whole->n_choices, "%s: choices", what);
    for (int c = 0; c < whole->n_choices && c < 2; c++) {
        cr_expect_eq(tp->n_tok[c], whole->n_tok[c], "%s: choice %d length", what, c);
        for (int t = 0; t < whole->n_tok[c]; t++) {
            cr_expect_eq(tp->tok[c][t], whole->tok[c][t], "%s: choice %d token %d: %d against %d whole", what, c, t,
                         tp->tok[c][t], whole->tok[c][t]);
            cr_expect_leq(fabs(tp->lp[c][t] - whole->lp[c][t]), LP_TOL, "%s: choice %d token %d log-probability %g "
                          "against %g whole", what, c, t, tp->lp[c][t], whole->lp[c][t]);
        }
    }
    cr_expect_eq(tp->n_plp, whole->n_plp, "%s: prompt log-probabilities", what);
    for (int t = 1; t < whole->n_plp; t++) {
        cr_expect_leq(fabs(tp->plp[t] - whole->plp[t]), LP_TOL, "%s: prompt position %d: %g against %g whole", what,
                      t, tp->plp[t], whole->plp[t]);
    }
}

struct job {
    const struct srv_proc *p;
    char prompt[1024];
    struct answer a;
};

static void *job_main(void *arg)
{
    struct job *j = arg;
    ask(j->p, j->prompt, 1, 8, false, &j->a);
    return NULL;
}

static void check_family(const char *rel, const char *ranks)
{
    char dir[512];
    snprintf(dir, sizeof dir, FX "%s", rel);
    struct srv_proc whole, tp;
    srv_start(&whole, dir, "--skip-tokenizer-init", "--device", "cpu", "--threads", "2", NULL);
    srv_start(&tp, dir, "--skip-tokenizer-init", "--device", "cpu", "--threads", "2", "--tensor-parallel-size", ranks,
              NULL);
    char p[1024];
    struct answer a, b;
    /* one greedy request with its prompt's log-probabilities */
    prompt_json(p, sizeof p, 21, 7);
    ask(&whole, p, 1, 12, true, &a);
    ask(&tp, p, 1, 12, true, &b);
    cr_expect_gt(a.n_plp, 0, "prompt log-probabilities came back");
    expect_same(&a, &b, "greedy");
    /* two choices forking from one prefill */
    prompt_json(p, sizeof p, 9, 11);
    ask(&whole, p, 2, 8, false, &a);
    ask(&tp, p, 2, 8, false, &b);
    expect_same(&a, &b, "n = 2");
    /* a prompt, then the same prompt extended: the second starts from the first's cached state
     * (a snapshot at its end for Mamba layers, its full blocks for attention) */
    prompt_json(p, sizeof p, 50, 13);
    ask(&whole, p, 1, 6, false, &a);
    ask(&tp, p, 1, 6, false, &b);
    expect_same(&a, &b, "long prompt");
    const double hits0 = metric(&tp, "krait:prefix_cache_hits_total");
    char q[1100];
    snprintf(q, sizeof q, "%.*s,9,8,7,6,5]", (int)strlen(p) - 1, p);
    ask(&whole, q, 1, 6, false, &a);
    ask(&tp, q, 1, 6, false, &b);
    expect_same(&a, &b, "the prompt extended, from the prefix cache");
    cr_expect_gt(metric(&tp, "krait:prefix_cache_hits_total"), hits0, "the extended prompt hit the prefix cache");
    /* eight at once against each alone */
    enum { J = 8 };
    struct job jobs[J];
    pthread_t th[J];
    for (int i = 0; i < J; i++) {
        jobs[i].p = &tp;
        prompt_json(jobs[i].prompt, sizeof jobs[i].prompt, 5 + 4 * i, 100u + (unsigned)i);
        cr_assert_eq(pthread_create(&th[i], NULL, job_main, &jobs[i]), 0);
    }
    for (int i = 0; i < J; i++) {
        pthread_join(th[i], NULL);
        ask(&whole, jobs[i].prompt, 1, 8, false, &a);
        char what[32];
        snprintf(what, sizeof what, "concurrent request %d", i);
        expect_same(&a, &jobs[i].a, what);
    }
    cr_expect_eq(srv_stop(&tp), 0);
    cr_expect_eq(srv_stop(&whole), 0);
}

Test(tp_http, hybrid_dsa_moe_2_ranks)
{
    check_family("hybrid/hy_mdme", "2");
}

Test(tp_http, hybrid_mla_dsa_2_ranks)
{
    check_family("hybrid/hy_plus", "2");
}

/* Megatron's shared top-k selections (skip layers attend with the last indexed layer's) and the
 * ReLU-less indexer score, sharded, batched and restored from the prefix cache as the rest are */
Test(tp_http, hybrid_shared_topk_2_ranks)
{
    check_family("hybrid/hy_share", "2");
}

Test(tp_http, hybrid_relu_less_indexer_2_ranks)
{
    check_family("hybrid/hy_norelu", "2");
}

Test(tp_http, nemotron_h_moe_2_ranks)
{
    check_family("nemotron_h/nh_moe", "2");
}

Test(tp_http, deepseek_v32_2_and_4_ranks)
{
    check_family("deepseek_v32/ds_short", "2");
    check_family("deepseek_v32/ds_short", "4");
}

/* The server's exit status once it exits on its own within `secs` seconds, else -1 (it is then
 * killed); its port file is removed either way. */
static int exit_within(struct srv_proc *p, int secs)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int st = 0, code = -1;
    for (;;) {
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
            code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
            break;
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (t1.tv_sec - t0.tv_sec > secs) {
            kill(p->pid, SIGKILL);
            waitpid(p->pid, &st, 0);
            break;
        }
        usleep(20000);
    }
    unlink(p->port_file);
    return code;
}

/* 3 ranks do not divide the fixture's 4 heads and 2 Mamba groups: the server says so and exits. */
Test(tp_http, an_indivisible_rank_count_is_refused_at_start)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "timeout 120 %s serve " FX "hybrid/hy_mdme --skip-tokenizer-init --device cpu --port 0 "
             "--tensor-parallel-size 3 > tp3.log 2>&1",
             KR_KRAIT_BIN);
    const int rc = system(cmd);
    cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) != 0 && WEXITSTATUS(rc) != 124, "exits with an error (rc %d)", rc);
    FILE *f = fopen("tp3.log", "r");
    cr_assert(f);
    char log[8192] = {0};
    (void)!fread(log, 1, sizeof log - 1, f);
    fclose(f);
    cr_expect(strstr(log, "tensor-parallel size 3 does not divide") != NULL, "the log names the cause: %s", log);
}

/* Rank 1 of 2 fails the third step: the others' collectives are released, the request in flight
 * gets a 503 naming the rank, /health stops answering 200 and the process exits 3 within 10 s. */
Test(tp_http, a_rank_that_dies_mid_step_fails_the_group_cleanly)
{
    setenv("KRAIT_FAULT_STEP", "3", 1);
    setenv("KRAIT_FAULT_RANK", "1", 1);
    struct srv_proc p;
    srv_start(&p, FX "hybrid/hy_mdme", "--skip-tokenizer-init", "--device", "cpu", "--threads", "2",
              "--tensor-parallel-size", "2", NULL);
    struct http_res r;
    http(&p, "POST", "/v1/completions", "{\"prompt\":[1,2,3,4,5],\"max_tokens\":16,\"ignore_eos\":true}", NULL, &r);
    cr_expect_eq(r.status, 503, "the request in flight: %ld", r.status);
    cr_expect(r.body && strstr(r.body, "rank 1") && strstr(r.body, "injected failure"), "body: %s",
              r.body ? r.body : "");
    http_free(&r);
    http(&p, "GET", "/health", NULL, NULL, &r);
    cr_expect(r.status == 503 || r.status == 0, "/health after the group failed: %ld", r.status);
    http_free(&r);
    const int code = exit_within(&p, 10);
    cr_expect_eq(code, 3, "exit status %d (want 3; -1: it did not exit within 10 s)", code);
}

/* ---- CUDA ranks ------------------------------------------------------------------------------ */

/* CUDA ranks on one GPU (KRAIT_TP_ONE_DEVICE=1: every collective through the one-shot peer kernels
 * over device memory, the code several GPUs with peer access run for decode-sized messages) against
 * one rank on the same GPU. The products are bf16 with fp32 sums; split over ranks their partial
 * sums are added in another order, which moves an activation's bf16 rounding now and then: log-
 * probabilities stay within CUDA_LP_TOL (the bound the GPU tests hold against HF, 0.15), except
 * where a discrete decision (MoE routing, DSA top-k) flips on a near-tie, at most a quarter of the
 * prompt's positions. Greedy tokens must agree until the first position where the single rank's top
 * two are within CUDA_MARGIN (a near-tie either side may take); the decode steps run from CUDA
 * graphs with the collectives captured. Skipped where no NVIDIA device is present. */
#define CUDA_LP_TOL 0.15
#define CUDA_MARGIN 0.3

static bool have_gpu(void)
{
    return access("/dev/nvidiactl", F_OK) == 0;
}

struct cuda_answer {
    int n_choices;
    int tok[2][16];
    double lp[2][16], margin[2][16];
    int n_tok[2];
    double plp[64];
    int n_plp;
};

static void ask_cuda(const struct srv_proc *p, const char *prompt, int n, int max_tokens, bool plp,
                     struct cuda_answer *a)
{
    char body[4096];
    snprintf(body, sizeof body,
             "{\"prompt\":%s,\"max_tokens\":%d,\"temperature\":0,\"logprobs\":2,\"n\":%d,"
             "\"return_tokens_as_token_ids\":true%s}",
             prompt, max_tokens, n, plp ? ",\"prompt_logprobs\":0" : "");
    long st = 0;
    json_t *j = post_json(p, "/v1/completions", body, &st);
    cr_assert_eq(st, 200, "status %ld: %s", st, json_dumps(j, 0));
    memset(a, 0, sizeof *a);
    json_t *ch = json_object_get(j, "choices");
    a->n_choices = (int)json_array_size(ch);
    for (size_t i = 0; i < json_array_size(ch) && i < 2; i++) {
        json_t *c = json_array_get(ch, i);
        const int idx = (int)json_integer_value(json_object_get(c, "index"));
        cr_assert(idx >= 0 && idx < 2);
        json_t *lps = json_object_get(c, "logprobs");
        json_t *toks = json_object_get(lps, "tokens"), *tlp = json_object_get(lps, "token_logprobs");
        json_t *top = json_object_get(lps, "top_logprobs");
        for (size_t t = 0; t < json_array_size(toks) && t < 16; t++) {
            a->tok[idx][t] = atoi(json_string_value(json_array_get(toks, t)) + strlen("token_id:"));
            a->lp[idx][t] = json_number_value(json_array_get(tlp, t));
            double l1 = -INFINITY, l2 = -INFINITY;
            const char *key;
            json_t *v;
            json_object_foreach(json_array_get(top, t), key, v) {
                const double x = json_number_value(v);
                if (x > l1) {
                    l2 = l1;
                    l1 = x;
                } else if (x > l2) {
                    l2 = x;
                }
            }
            a->margin[idx][t] = l1 - l2;
            a->n_tok[idx]++;
        }
        json_t *pl = json_object_get(c, "prompt_logprobs");
        if (!pl) {
            pl = json_object_get(j, "prompt_logprobs");
        }
        for (size_t t = 1; pl && t < json_array_size(pl) && t < 64; t++) {
            const char *key;
            json_t *v;
            json_object_foreach(json_array_get(pl, t), key, v) {
                if (json_integer_value(json_object_get(v, "rank")) >= 0) {
                    a->plp[t] = json_number_value(json_object_get(v, "logprob"));
                    break;
                }
            }
            a->n_plp = (int)t + 1;
        }
    }
    json_decref(j);
}

static void expect_close_cuda(const struct cuda_answer *whole, const struct cuda_answer *tp, const char *what)
{
    cr_assert_eq(tp->n_choices, whole->n_choices, "%s: choices", what);
    int over = 0;
    double worst = 0;
    cr_expect_eq(tp->n_plp, whole->n_plp, "%s: prompt log-probabilities", what);
    for (int t = 1; t < whole->n_plp; t++) {
        const double d = fabs(tp->plp[t] - whole->plp[t]);
        worst = d > worst ? d : worst;
        over += d > CUDA_LP_TOL;
    }
    const int allowed = whole->n_plp / 4 > 1 ? whole->n_plp / 4 : 1;
    cr_expect_leq(over, allowed, "%s: %d prompt positions differ by more than %g (max %g)", what, over, CUDA_LP_TOL,
                  worst);
    int compared = 0;
    for (int c = 0; c < whole->n_choices && c < 2; c++) {
        for (int t = 0; t < whole->n_tok[c] && t < tp->n_tok[c]; t++) {
            if (tp->tok[c][t] != whole->tok[c][t]) {
                cr_expect_lt(whole->margin[c][t], CUDA_MARGIN, "%s: choice %d token %d: %d against %d whole, "
                             "whose top two are %g apart", what, c, t, tp->tok[c][t], whole->tok[c][t],
                             whole->margin[c][t]);
                break;
            }
            compared++;
            const double d = fabs(tp->lp[c][t] - whole->lp[c][t]);
            if (d > CUDA_LP_TOL) { /* a flip inside the model: the rest of the choice may differ */
                cr_expect_lt(whole->margin[c][t], CUDA_MARGIN, "%s: choice %d token %d log-probability %g against "
                             "%g whole", what, c, t, tp->lp[c][t], whole->lp[c][t]);
                break;
            }
        }
    }
    fprintf(stderr, "  %s: prompt max |dlp| %.3g (%d over %.2f), %d generated tokens compared\n", what, worst, over,
            CUDA_LP_TOL, compared);
}

static void check_family_cuda(const char *rel, const char *ranks)
{
    char dir[512];
    snprintf(dir, sizeof dir, FX "%s", rel);
    struct srv_proc whole, tp;
    /* a bounded cache for the single rank: the group beside it sizes its caches from what is left */
    srv_start(&whole, dir, "--skip-tokenizer-init", "--device", "cuda", "--cache-memory-bytes", "1073741824", NULL);
    setenv("KRAIT_TP_ONE_DEVICE", "1", 1);
    srv_start(&tp, dir, "--skip-tokenizer-init", "--device", "cuda", "--tensor-parallel-size", ranks, NULL);
    unsetenv("KRAIT_TP_ONE_DEVICE");
    char p[1024], what[96];
    struct cuda_answer a, b;
    snprintf(what, sizeof what, "%s at %s ranks: greedy", rel, ranks);
    prompt_json(p, sizeof p, 40, 7);
    ask_cuda(&whole, p, 1, 16, true, &a);
    ask_cuda(&tp, p, 1, 16, true, &b);
    cr_expect_gt(a.n_plp, 0, "prompt log-probabilities came back");
    expect_close_cuda(&a, &b, what);
    snprintf(what, sizeof what, "%s at %s ranks: n = 2", rel, ranks);
    prompt_json(p, sizeof p, 9, 11);
    ask_cuda(&whole, p, 2, 8, true, &a);
    ask_cuda(&tp, p, 2, 8, true, &b);
    expect_close_cuda(&a, &b, what);
    snprintf(what, sizeof what, "%s at %s ranks: long prompt", rel, ranks);
    prompt_json(p, sizeof p, 50, 13);
    ask_cuda(&whole, p, 1, 6, false, &a); /* prompt log-probabilities would compute every position */
    ask_cuda(&tp, p, 1, 6, false, &b);
    expect_close_cuda(&a, &b, what);
    const double hits0 = metric(&tp, "krait:prefix_cache_hits_total");
    const double whole0 = metric(&whole, "krait:prefix_cache_hits_total");
    char q[1100];
    snprintf(q, sizeof q, "%.*s,9,8,7,6,5]", (int)strlen(p) - 1, p);
    snprintf(what, sizeof what, "%s at %s ranks: from the prefix cache", rel, ranks);
    ask_cuda(&whole, q, 1, 6, false, &a);
    ask_cuda(&tp, q, 1, 6, false, &b);
    expect_close_cuda(&a, &b, what);
    const double hits = metric(&tp, "krait:prefix_cache_hits_total") - hits0;
    const double whole_hits = metric(&whole, "krait:prefix_cache_hits_total") - whole0;
    fprintf(stderr, "  %s: %.0f prompt tokens from the prefix cache (one rank: %.0f)\n", what, hits, whole_hits);
    cr_expect_gt(hits, 0, "%s: the extended prompt hit the prefix cache", what);
    cr_expect_eq(hits, whole_hits, "%s: %.0f prompt tokens from the prefix cache, one rank %.0f", what, hits,
                 whole_hits);
    /* sixteen at once (one decode graph of 16 rows with its collectives) against each alone */
    enum { J = 16 };
    struct job jobs[J];
    pthread_t th[J];
    for (int i = 0; i < J; i++) {
        jobs[i].p = &tp;
        prompt_json(jobs[i].prompt, sizeof jobs[i].prompt, 5 + 3 * i, 200u + (unsigned)i);
        cr_assert_eq(pthread_create(&th[i], NULL, job_main, &jobs[i]), 0);
    }
    for (int i = 0; i < J; i++) {
        pthread_join(th[i], NULL);
        struct answer w;
        ask(&whole, jobs[i].prompt, 1, 8, false, &w);
        int same = 0;
        while (same < w.n_tok[0] && same < jobs[i].a.n_tok[0] && w.tok[0][same] == jobs[i].a.tok[0][same]) {
            same++;
        }
        /* without margins here: the first token must agree unless its log-probability says near-tie */
        cr_expect(same > 0 || w.lp[0][0] < -0.4, "%s at %s ranks: concurrent request %d's first token %d against %d",
                  rel, ranks, i, jobs[i].a.tok[0][0], w.tok[0][0]);
        for (int t = 0; t < same; t++) {
            cr_expect_leq(fabs(jobs[i].a.lp[0][t] - w.lp[0][t]), CUDA_LP_TOL, "%s at %s ranks: concurrent request %d "
                          "token %d log-probability %g against %g", rel, ranks, i, t, jobs[i].a.lp[0][t], w.lp[0][t]);
        }
    }
    cr_expect_eq(srv_stop(&tp), 0);
    cr_expect_eq(srv_stop(&whole), 0);
}

Test(tp_http, cuda_ranks_on_one_device_match_one_rank)
{
    if (!have_gpu()) {
        cr_skip_test("no NVIDIA device (/dev/nvidiactl): the CUDA tensor-parallel test is skipped");
    }
    check_family_cuda("hybrid/hy_mdme", "2");
    check_family_cuda("hybrid/hy_plus", "2");
    check_family_cuda("nemotron_h/nh_moe", "2");
    check_family_cuda("deepseek_v32/ds_short", "2");
    check_family_cuda("deepseek_v32/ds_short", "4");
}

/* The CUDA group's failure path: rank 1 of 2 fails the third step and aborts the group; rank 0's
 * peer kernels leave their waits, the request gets a 503 and the process exits 3. */
Test(tp_http, a_cuda_rank_that_dies_mid_step_fails_the_group_cleanly)
{
    if (!have_gpu()) {
        cr_skip_test("no NVIDIA device (/dev/nvidiactl): the CUDA tensor-parallel test is skipped");
    }
    setenv("KRAIT_FAULT_STEP", "3", 1);
    setenv("KRAIT_FAULT_RANK", "1", 1);
    setenv("KRAIT_TP_ONE_DEVICE", "1", 1);
    struct srv_proc p;
    srv_start(&p, FX "hybrid/hy_mdme", "--skip-tokenizer-init", "--device", "cuda", "--tensor-parallel-size", "2",
              NULL);
    unsetenv("KRAIT_FAULT_STEP");
    unsetenv("KRAIT_FAULT_RANK");
    unsetenv("KRAIT_TP_ONE_DEVICE");
    struct http_res r;
    http(&p, "POST", "/v1/completions", "{\"prompt\":[1,2,3,4,5],\"max_tokens\":16,\"ignore_eos\":true}", NULL, &r);
    cr_expect_eq(r.status, 503, "the request in flight: %ld", r.status);
    cr_expect(r.body && strstr(r.body, "rank 1"), "body: %s", r.body ? r.body : "");
    http_free(&r);
    const int code = exit_within(&p, 20);
    cr_expect_eq(code, 3, "exit status %d (want 3; -1: it did not exit within 20 s)", code);
}
