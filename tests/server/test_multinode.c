/* Several nodes served: two `krait serve` processes on loopback, --nnodes 2, the leader (node 0)
 * serving the API and the worker (node 1) running its ranks of every step, against the same
 * checkpoint served whole by one process. Checked:
 *  - one rank per node (-tp 2) and two per node (-tp 4): greedy tokens equal and generated and
 *    prompt log-probabilities within 5e-5 of TP 1 (test_tp_http's tolerance); n = 2 choices forking
 *    from one prefill and a prompt extended from the prefix cache (the copies replayed on the
 *    worker); four streams at once, each as TP 1 answers it;
 *  - the worker answers /health (200 while the group is whole) and nothing else (404);
 *  - SIGTERM on the leader shuts the group down: both exit 0;
 *  - peers that are not workers (another protocol, a HELLO cut short, a HELLO header claiming
 *    1 GiB) are refused with what was wrong; a worker whose --max-model-len differs is refused with
 *    the field named (it exits non-zero), and so is a second worker claiming a taken node rank;
 *    the leader keeps waiting through all of them;
 *  - a worker killed (SIGKILL) mid-stream: the stream ends with an error event, the worker's
 *    /health is gone and the leader exits 3 within 10 s; the leader killed: the worker exits
 *    non-zero within 10 s;
 *  - --tensor-parallel-size not a multiple of --nnodes is refused at start. */
#include "harness.h"
#include "wire.h" /* KR_WIRE_VERSION */

#include <criterion/criterion.h>
#include <curl/curl.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define FX KR_SOURCE_DIR "/tests/fixtures/"
#define LP_TOL 5e-5

TestSuite(multinode, .timeout = 300);

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A port nobody listens on now (the system's choice for port 0). */
static int free_port(void)
{
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    cr_assert(fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &l) == 0);
    close(fd);
    return ntohs(a.sin_port);
}

/* Starts node `rank` of `nnodes` without waiting for /health (the nodes wait for each other);
 * stderr to `log`. Extra arguments NULL-terminated after the model. */
static void node_start(struct srv_proc *p, const char *log, int master_port, int nnodes, int rank, const char *tp,
                       const char *model, const char *const *extra)
{
    memset(p, 0, sizeof *p);
    snprintf(p->host, sizeof p->host, "127.0.0.1");
    snprintf(p->port_file, sizeof p->port_file, "/tmp/krait-port-XXXXXX");
    const int fd = mkstemp(p->port_file);
    cr_assert(fd >= 0);
    close(fd);
    unlink(p->port_file);
    char mp[16], nn[16], nr[16];
    snprintf(mp, sizeof mp, "%d", master_port);
    snprintf(nn, sizeof nn, "%d", nnodes);
    snprintf(nr, sizeof nr, "%d", rank);
    const char *argv[64] = {KR_KRAIT_BIN, "serve", model, "--host", "127.0.0.1", "--port", "0", "--port-file",
                            p->port_file, "--threads", "1", "--log-level", "info", "--skip-tokenizer-init",
                            "--device", "cpu", "--tensor-parallel-size", tp, "--nnodes", nn, "--node-rank", nr,
                            "--master-addr", "127.0.0.1", "--master-port", mp, "--join-timeout", "60"};
    int n = 0;
    while (argv[n]) {
        n++;
    }
    for (int i = 0; extra && extra[i] && n < 62; i++) {
        argv[n++] = extra[i];
    }
    argv[n] = NULL;
    p->pid = fork();
    cr_assert(p->pid >= 0);
    if (p->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* gone with the test's process (harness.c) */
        if (!freopen(log, "w", stderr)) {
            _exit(126);
        }
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
}

/* Waits for the port file, then for /health 200 (up to 60 s). */
static void node_wait_healthy(struct srv_proc *p)
{
    for (int i = 0; i < 1200; i++) {
        if (!p->port) {
            FILE *fp = fopen(p->port_file, "r");
            if (fp) {
                if (fscanf(fp, "%d", &p->port) != 1) {
                    p->port = 0;
                }
                fclose(fp);
            }
        }
        int st;
        cr_assert_eq(waitpid(p->pid, &st, WNOHANG), 0, "a node exited at start-up");
        if (p->port) {
            struct http_res r;
            http(p, "GET", "/health", NULL, NULL, &r);
            const long status = r.status;
            http_free(&r);
            if (status == 200) {
                return;
            }
        }
        sleep_ms(50);
    }
    cr_assert(0, "a node never became healthy");
}

/* The exit status of p within `secs` (128 + signal when killed; -1: still running, then killed). */
static int wait_exit(struct srv_proc *p, int secs)
{
    int st = 0, code = -1;
    for (int i = 0; i < secs * 50; i++) {
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
            code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
            p->pid = 0;
            break;
        }
        sleep_ms(20);
    }
    if (code == -1) {
        kill(p->pid, SIGKILL);
        waitpid(p->pid, &st, 0);
        p->pid = 0;
    }
    unlink(p->port_file);
    return code;
}

static char *slurp(const char *path)
{
    static char buf[65536];
    FILE *f = fopen(path, "r");
    buf[0] = 0;
    if (f) {
        buf[fread(buf, 1, sizeof buf - 1, f)] = 0;
        fclose(f);
    }
    return buf;
}

/* ---- answers compared with TP 1 (as test_tp_http) ------------------------------------------------ */

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
    int tok[2][160];
    double lp[2][160];
    int n_tok[2];
    double plp[64];
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
    cr_assert_eq(st, 200, "status %ld", st);
    memset(a, 0, sizeof *a);
    json_t *ch = json_object_get(j, "choices");
    a->n_choices = (int)json_array_size(ch);
    for (size_t i = 0; i < json_array_size(ch) && i < 2; i++) {
        json_t *c = json_array_get(ch, i);
        const int idx = (int)json_integer_value(json_object_get(c, "index"));
        cr_assert(idx >= 0 && idx < 2);
        json_t *lps = json_object_get(c, "logprobs");
        json_t *toks = json_object_get(lps, "tokens"), *tlp = json_object_get(lps, "token_logprobs");
        for (size_t t = 0; t < json_array_size(toks) && t < 160; t++) {
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
            cr_expect_leq(fabs(tp->lp[c][t] - whole->lp[c][t]), LP_TOL,
                          "%s: choice %d token %d log-probability %g against %g whole", what, c, t, tp->lp[c][t],
                          whole->lp[c][t]);
        }
    }
    cr_expect_eq(tp->n_plp, whole->n_plp, "%s: prompt log-probabilities", what);
    for (int t = 1; t < whole->n_plp; t++) {
        cr_expect_leq(fabs(tp->plp[t] - whole->plp[t]), LP_TOL, "%s: prompt position %d: %g against %g whole", what,
                      t, tp->plp[t], whole->plp[t]);
    }
}

/* A streamed greedy request: the token ids of its chunks, in order. */
struct stream_job {
    const struct srv_proc *p;
    char prompt[512];
    int tok[16];
    int n_tok;
};

static void *stream_main(void *arg)
{
    struct stream_job *j = arg;
    char body[1024];
    snprintf(body, sizeof body,
             "{\"prompt\":%s,\"max_tokens\":8,\"temperature\":0,\"stream\":true,\"return_tokens_as_token_ids\":true,"
             "\"logprobs\":1}",
             j->prompt);
    long st = 0;
    char *text = post_stream(j->p, "/v1/completions", body, 0, &st);
    bool done = false;
    json_t *ev = sse_events(text ? text : "", &done);
    j->n_tok = 0;
    for (size_t i = 0; i < json_array_size(ev); i++) {
        json_t *toks = json_object_get(json_object_get(json_array_get(json_object_get(json_array_get(ev, i), "choices"), 0),
                                                       "logprobs"),
                                       "tokens");
        for (size_t t = 0; t < json_array_size(toks) && j->n_tok < 16; t++) {
            j->tok[j->n_tok++] = atoi(json_string_value(json_array_get(toks, t)) + strlen("token_id:"));
        }
    }
    json_decref(ev);
    free(text);
    return NULL;
}

/* The group of two nodes at tensor-parallel size tp against one process at TP 1. */
static void check_two_nodes(const char *rel, const char *tp)
{
    char dir[512];
    snprintf(dir, sizeof dir, FX "%s", rel);
    const int mp = free_port();
    struct srv_proc lead, work, whole;
    char llog[64], wlog[64];
    snprintf(llog, sizeof llog, "mn-tp%s-leader.log", tp);
    snprintf(wlog, sizeof wlog, "mn-tp%s-worker.log", tp);
    node_start(&lead, llog, mp, 2, 0, tp, dir, NULL);
    node_start(&work, wlog, mp, 2, 1, tp, dir, NULL);
    srv_start(&whole, dir, "--skip-tokenizer-init", "--device", "cpu", NULL);
    node_wait_healthy(&lead);
    node_wait_healthy(&work);
    /* the worker serves /health only */
    struct http_res r;
    http(&work, "POST", "/v1/completions", "{\"prompt\":[1,2],\"max_tokens\":2}", NULL, &r);
    cr_expect_eq(r.status, 404, "a completion at the worker: %ld", r.status);
    cr_expect(r.body && strstr(r.body, "serves /health only"), "%s", r.body ? r.body : "");
    http_free(&r);
    char p[1024];
    struct answer a, b;
    prompt_json(p, sizeof p, 21, 7);
    ask(&whole, p, 1, 12, true, &a);
    ask(&lead, p, 1, 12, true, &b);
    cr_expect_gt(a.n_plp, 0, "prompt log-probabilities came back");
    expect_same(&a, &b, "greedy");
    prompt_json(p, sizeof p, 9, 11);
    ask(&whole, p, 2, 8, false, &a);
    ask(&lead, p, 2, 8, false, &b);
    expect_same(&a, &b, "n = 2");
    prompt_json(p, sizeof p, 50, 13);
    ask(&whole, p, 1, 6, false, &a);
    ask(&lead, p, 1, 6, false, &b);
    expect_same(&a, &b, "long prompt");
    const double hits0 = metric(&lead, "krait:prefix_cache_hits_total");
    char q[1100];
    snprintf(q, sizeof q, "%.*s,9,8,7,6,5]", (int)strlen(p) - 1, p);
    ask(&whole, q, 1, 6, false, &a);
    ask(&lead, q, 1, 6, false, &b);
    expect_same(&a, &b, "the prompt extended, from the prefix cache");
    cr_expect_gt(metric(&lead, "krait:prefix_cache_hits_total"), hits0, "the extended prompt hit the prefix cache");
    /* four streams at once, each against TP 1 alone */
    enum { J = 4 };
    struct stream_job jobs[J];
    pthread_t th[J];
    for (int i = 0; i < J; i++) {
        jobs[i].p = &lead;
        prompt_json(jobs[i].prompt, sizeof jobs[i].prompt, 5 + 4 * i, 100u + (unsigned)i);
        cr_assert_eq(pthread_create(&th[i], NULL, stream_main, &jobs[i]), 0);
    }
    for (int i = 0; i < J; i++) {
        pthread_join(th[i], NULL);
        ask(&whole, jobs[i].prompt, 1, 8, false, &a);
        cr_expect_eq(jobs[i].n_tok, a.n_tok[0], "stream %d: %d tokens, %d whole", i, jobs[i].n_tok, a.n_tok[0]);
        for (int t = 0; t < a.n_tok[0] && t < jobs[i].n_tok; t++) {
            cr_expect_eq(jobs[i].tok[t], a.tok[0][t], "stream %d token %d", i, t);
        }
    }
    /* SIGTERM on the leader ends the group: both exit 0 */
    cr_expect_eq(srv_stop(&lead), 0, "the leader's exit status");
    cr_expect_eq(wait_exit(&work, 15), 0, "the worker's exit status after the leader's SIGTERM: %s",
                 slurp(wlog));
    cr_expect_eq(srv_stop(&whole), 0);
}

Test(multinode, one_rank_per_node_matches_one_process)
{
    check_two_nodes("hybrid/hy_mdme", "2");
}

Test(multinode, two_ranks_per_node_match_one_process)
{
    check_two_nodes("deepseek_v32/ds_short", "4");
}

/* A worker whose --max-model-len differs is refused with the field named and exits non-zero; the
 * leader logs it and keeps waiting; a second worker claiming node rank 1 is refused too. */
/* n-gram drafts across two nodes (-tp 2): the drafts' kept Mamba states travel in the PLAN to the
 * worker's rank; periodic prompts, whose drafts random weights partly continue, so that steps keep
 * some drafts and refuse others; greedy answers of 160 tokens against one process at TP 1 without
 * drafts (test_tp_http's tolerance). */
Test(multinode, ngram_drafts_across_two_nodes_match_one_process)
{
    const char *dir = FX "nemotron_h/nh_moe";
    const char *spec[] = {"--speculative-config",
                          "{\"method\":\"ngram\",\"num_speculative_tokens\":4,\"prompt_lookup_min\":2,"
                          "\"prompt_lookup_max\":4}",
                          NULL};
    const int mp = free_port();
    struct srv_proc lead, work, whole;
    node_start(&lead, "mn-spec-leader.log", mp, 2, 0, "2", dir, spec);
    node_start(&work, "mn-spec-worker.log", mp, 2, 1, "2", dir, spec);
    srv_start(&whole, dir, "--skip-tokenizer-init", "--device", "cpu", NULL);
    node_wait_healthy(&lead);
    node_wait_healthy(&work);
    static const char *const prompts[] = {"[5,6,7,5,6,7,5,6,7,5,6,7]", "[11,12,13,14,15,11,12,13,14,15,11,12]",
                                          "[40,41,40,41,40,41,40,41]", "[100,3,77,100,3,77,100,3,77]"};
    struct answer a, b;
    char what[64];
    for (size_t i = 0; i < sizeof prompts / sizeof prompts[0]; i++) {
        ask(&whole, prompts[i], 1, 160, false, &a);
        ask(&lead, prompts[i], 1, 160, false, &b);
        snprintf(what, sizeof what, "drafts, prompt %zu", i);
        expect_same(&a, &b, what);
    }
    const double kept = metric(&lead, "krait:spec_decode_num_accepted_tokens_total");
    const double drafted = metric(&lead, "krait:spec_decode_num_draft_tokens_total");
    cr_expect_gt(kept, 0, "no draft was kept (%g drafted): the comparison says nothing about kept states", drafted);
    cr_expect_gt(drafted, kept, "every draft was kept: the comparison says nothing about refused ones");
    cr_expect_eq(srv_stop(&lead), 0, "the leader's exit status");
    cr_expect_eq(wait_exit(&work, 15), 0, "the worker's exit status after the leader's SIGTERM: %s",
                 slurp("mn-spec-worker.log"));
    cr_expect_eq(srv_stop(&whole), 0);
}

/* MTP drafts across two nodes (-tp 2, nh_mtp): each node holds its share of the head and runs every
 * head pass the leader plans (the PLAN says which rows' hidden states it takes); greedy answers
 * against one process at TP 1 without drafts, and as many drafts made and kept as one process
 * drafting alone makes for the same prompts. A worker started without the MTP flag is refused
 * when it joins, naming the field. */
Test(multinode, mtp_drafts_across_two_nodes_match_one_process)
{
    const char *dir = FX "nemotron_h/nh_mtp";
    static const char *const spec[] = {"--speculative-config", "{\"method\":\"mtp\",\"num_speculative_tokens\":3}",
                                       NULL};
    const int mp = free_port();
    struct srv_proc lead, work, whole, alone;
    node_start(&lead, "mn-mtp-leader.log", mp, 2, 0, "2", dir, spec);
    node_start(&work, "mn-mtp-worker.log", mp, 2, 1, "2", dir, spec);
    srv_start(&whole, dir, "--skip-tokenizer-init", "--device", "cpu", NULL);
    srv_start(&alone, dir, "--skip-tokenizer-init", "--device", "cpu", "--speculative-config", spec[1], NULL);
    node_wait_healthy(&lead);
    node_wait_healthy(&work);
    static const char *const prompts[] = {"[5,6,7,8,9,10,5,6,7,8,9]", "[100,3,77,100,3,77,100,3,77]"};
    struct answer a, b, c;
    char what[64];
    for (size_t i = 0; i < sizeof prompts / sizeof prompts[0]; i++) {
        ask(&whole, prompts[i], 1, 60, false, &a);
        ask(&lead, prompts[i], 1, 60, false, &b);
        ask(&alone, prompts[i], 1, 60, false, &c);
        snprintf(what, sizeof what, "MTP drafts, prompt %zu", i);
        expect_same(&a, &b, what);
    }
    static const char *const counters[] = {"krait:spec_decode_num_draft_tokens_total",
                                           "krait:spec_decode_num_accepted_tokens_total"};
    for (int i = 0; i < 2; i++) {
        cr_expect_eq(metric(&lead, counters[i]), metric(&alone, counters[i]), "%s: %g across nodes, %g alone",
                     counters[i], metric(&lead, counters[i]), metric(&alone, counters[i]));
    }
    cr_expect_gt(metric(&lead, counters[0]), 0, "no draft was made");
    cr_expect_eq(srv_stop(&lead), 0, "the leader's exit status");
    cr_expect_eq(wait_exit(&work, 15), 0, "the worker's exit status after the leader's SIGTERM: %s",
                 slurp("mn-mtp-worker.log"));
    cr_expect_eq(srv_stop(&whole), 0);
    cr_expect_eq(srv_stop(&alone), 0);
    /* a worker without the flag */
    const int mp2 = free_port();
    struct srv_proc lead2, bare;
    node_start(&lead2, "mn-mtp-leader2.log", mp2, 2, 0, "2", dir, spec);
    node_start(&bare, "mn-mtp-bare.log", mp2, 2, 1, "2", dir, NULL);
    const int code = wait_exit(&bare, 30);
    cr_expect(code > 0 && code < 128, "the worker without the flag exits with an error (%d)", code);
    const char *log = slurp("mn-mtp-bare.log");
    cr_expect(strstr(log, "speculative-config method"), "the worker says why: %s", log);
    kill(lead2.pid, SIGKILL);
    waitpid(lead2.pid, NULL, 0);
}

Test(multinode, a_worker_that_differs_or_repeats_a_node_rank_is_refused)
{
    const int mp = free_port();
    struct srv_proc lead, bad, w1, dup;
    node_start(&lead, "mn-mm-leader.log", mp, 3, 0, "3", FX "hybrid/hy_mdme", NULL);
    /* a stranger, a HELLO cut short and one too long for a HELLO: each refused, the leader unmoved */
    static const unsigned char hello_hdr[16] = {'K', 'R', 'T', 'W', KR_WIRE_VERSION, 0, 1, 0, 100, 0, 0, 0, 0, 0, 0, 0};
    static const unsigned char huge_hdr[16] = {'K', 'R', 'T', 'W', KR_WIRE_VERSION, 0, 1, 0, 0, 0, 0, 0x40, 0, 0, 0, 0};
    const struct {
        const void *bytes;
        size_t n;
    } peers[] = {{"GET / HTTP/1.0\r\n\r\n", 18}, {hello_hdr, sizeof hello_hdr}, {huge_hdr, sizeof huge_hdr}};
    for (size_t i = 0; i < sizeof peers / sizeof peers[0]; i++) {
        int fd = -1;
        for (int t = 0; t < 500 && fd < 0; t++) {
            struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)mp),
                                    .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
            fd = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
                close(fd);
                fd = -1;
                sleep_ms(20);
            }
        }
        cr_assert(fd >= 0, "the leader listens on the master port");
        cr_expect_eq(write(fd, peers[i].bytes, peers[i].n), (ssize_t)peers[i].n);
        shutdown(fd, SHUT_WR);
        char got[256];
        (void)!read(fd, got, sizeof got); /* the refusal, then the end of the connection */
        close(fd);
    }
    const char *llog = slurp("mn-mm-leader.log");
    cr_expect(strstr(llog, "not a krait frame") && strstr(llog, "its HELLO was cut short") &&
              strstr(llog, "1073741824 bytes"), "the leader names each bad peer: %s", llog);
    static const char *const longer[] = {"--max-model-len", "64", NULL};
    node_start(&bad, "mn-bad.log", mp, 3, 1, "3", FX "hybrid/hy_mdme", longer);
    const int code = wait_exit(&bad, 30);
    cr_expect(code > 0 && code < 128, "the refused worker exits with an error (%d)", code);
    const char *log = slurp("mn-bad.log");
    cr_expect(strstr(log, "max-model-len differs") && strstr(log, "64"), "the worker says why: %s", log);
    node_start(&w1, "mn-w1.log", mp, 3, 1, "3", FX "hybrid/hy_mdme", NULL);
    for (int i = 0; i < 500 && !strstr(slurp("mn-mm-leader.log"), "node 1 (rank 1) joined"); i++) {
        sleep_ms(20);
    }
    node_start(&dup, "mn-dup.log", mp, 3, 1, "3", FX "hybrid/hy_mdme", NULL);
    const int dcode = wait_exit(&dup, 30);
    cr_expect(dcode > 0 && dcode < 128, "the second node 1 exits with an error (%d)", dcode);
    log = slurp("mn-dup.log");
    cr_expect(strstr(log, "has joined already"), "the second node 1 says why: %s", log);
    log = slurp("mn-mm-leader.log");
    cr_expect(strstr(log, "refused a worker") && strstr(log, "max-model-len differs"), "the leader logs it: %s", log);
    int st;
    cr_expect_eq(waitpid(lead.pid, &st, WNOHANG), 0, "the leader keeps waiting");
    kill(lead.pid, SIGTERM);
    cr_expect_neq(wait_exit(&lead, 15), -1, "the leader ends on SIGTERM while it waits");
    kill(w1.pid, SIGTERM);
    wait_exit(&w1, 15);
}

/* ---- failures ----------------------------------------------------------------------------------------- */

struct kill_stream {
    pid_t victim;
    bool killed;
    char text[65536];
    size_t len;
};

static size_t on_chunk(char *ptr, size_t size, size_t nmemb, void *ud)
{
    struct kill_stream *k = ud;
    const size_t n = size * nmemb;
    const size_t room = sizeof k->text - 1 - k->len, take = n < room ? n : room;
    memcpy(k->text + k->len, ptr, take);
    k->len += take;
    k->text[k->len] = 0;
    if (!k->killed && strstr(k->text, "data: ")) {
        kill(k->victim, SIGKILL); /* the worker dies while the leader streams */
        k->killed = true;
    }
    return n;
}

/* The worker killed mid-stream: an error event ends the stream, the worker's /health is gone, the
 * leader answers 503 and exits 3 within 10 s. */
Test(multinode, a_worker_killed_mid_stream_fails_the_leader_cleanly)
{
    const int mp = free_port();
    struct srv_proc lead, work;
    node_start(&lead, "mn-kill-leader.log", mp, 2, 0, "2", FX "hybrid/hy_mdme", NULL);
    node_start(&work, "mn-kill-worker.log", mp, 2, 1, "2", FX "hybrid/hy_mdme", NULL);
    node_wait_healthy(&lead);
    node_wait_healthy(&work);
    struct kill_stream k = {.victim = work.pid};
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/completions", lead.port);
    CURL *c = curl_easy_init();
    cr_assert(c);
    struct curl_slist *hd = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hd);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS,
                     "{\"prompt\":[1,2,3,4,5],\"max_tokens\":100,\"temperature\":0,\"stream\":true,\"ignore_eos\":true}");
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_chunk);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &k);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 30L);
    curl_easy_perform(c);
    curl_slist_free_all(hd);
    curl_easy_cleanup(c);
    cr_expect(k.killed, "the stream started");
    cr_expect(strstr(k.text, "\"error\""), "the stream ends with an error event: %s",
              k.text + (k.len > 600 ? k.len - 600 : 0));
    cr_expect(!strstr(k.text, "[DONE]") || strstr(k.text, "\"error\""), "no clean end without the error");
    cr_expect_eq(wait_exit(&work, 5), 128 + SIGKILL);
    struct http_res r;
    http(&work, "GET", "/health", NULL, NULL, &r);
    cr_expect_eq(r.status, 0, "the dead worker's /health: %ld", r.status);
    http_free(&r);
    http(&lead, "POST", "/v1/completions", "{\"prompt\":[1,2,3],\"max_tokens\":4}", NULL, &r);
    cr_expect(r.status == 503 || r.status == 0, "a request after the loss: %ld", r.status);
    http_free(&r);
    const int code = wait_exit(&lead, 10);
    cr_expect_eq(code, 3, "the leader's exit status %d (want 3; -1: still running after 10 s): %s", code,
                 slurp("mn-kill-leader.log"));
    cr_expect(strstr(slurp("mn-kill-leader.log"), "the connection to node 1 (rank 1) closed"), "the leader names the node");
}

/* The leader killed: the worker sees its connection close and exits non-zero within 10 s. */
/* The worker killed while nothing runs: the leader notices on its own (no request needed), answers
 * /health 503 and exits 3 within 10 s. */
Test(multinode, a_worker_killed_while_idle_fails_the_leader)
{
    const int mp = free_port();
    struct srv_proc lead, work;
    node_start(&lead, "mn-idle-leader.log", mp, 2, 0, "2", FX "hybrid/hy_mdme", NULL);
    node_start(&work, "mn-idle-worker.log", mp, 2, 1, "2", FX "hybrid/hy_mdme", NULL);
    node_wait_healthy(&lead);
    node_wait_healthy(&work);
    kill(work.pid, SIGKILL);
    cr_expect_eq(wait_exit(&work, 5), 128 + SIGKILL);
    const int code = wait_exit(&lead, 10);
    cr_expect_eq(code, 3, "the leader's exit status %d (want 3; -1: still running after 10 s): %s", code,
                 slurp("mn-idle-leader.log"));
    cr_expect(strstr(slurp("mn-idle-leader.log"), "lost a node while idle"), "the leader says why");
}

Test(multinode, the_leader_killed_ends_the_worker)
{
    const int mp = free_port();
    struct srv_proc lead, work;
    node_start(&lead, "mn-lk-leader.log", mp, 2, 0, "2", FX "hybrid/hy_mdme", NULL);
    node_start(&work, "mn-lk-worker.log", mp, 2, 1, "2", FX "hybrid/hy_mdme", NULL);
    node_wait_healthy(&lead);
    node_wait_healthy(&work);
    kill(lead.pid, SIGKILL);
    cr_expect_eq(wait_exit(&lead, 5), 128 + SIGKILL);
    const int code = wait_exit(&work, 10);
    cr_expect(code > 0 && code < 128, "the worker's exit status %d (want an error; -1: still running): %s", code,
              slurp("mn-lk-worker.log"));
}

/* Ranks that do not split evenly over the nodes are refused before anything starts. */
Test(multinode, a_size_not_a_multiple_of_the_nodes_is_refused)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "timeout 60 %s serve " FX "hybrid/hy_mdme --skip-tokenizer-init --device cpu --port 0 "
             "--tensor-parallel-size 3 --nnodes 2 > mn-flags.log 2>&1",
             KR_KRAIT_BIN);
    const int rc = system(cmd);
    cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) == 2, "exits 2 (rc %d)", rc);
    cr_expect(strstr(slurp("mn-flags.log"), "not a multiple of --nnodes 2"), "%s", slurp("mn-flags.log"));
}
