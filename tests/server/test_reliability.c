/* End-to-end reliability of `krait serve` (embedded default model, CPU): clients that leave,
 * SIGTERM under load, device failures (injected with KRAIT_FAULT_STEP), the access log and the
 * start-up refusal of a context longer than the checkpoint's. Each test starts its own server. */
#include "harness.h"

#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <regex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MODEL KR_SOURCE_DIR "/models/tiny-hybrid"
#define MODEL_MAX_POS 4096 /* models/tiny-hybrid/config.json max_position_embeddings */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Waits for the process to exit; its status, or -1 after `limit` seconds (then it is killed). */
static int wait_exit(struct srv_proc *p, double limit, double *took)
{
    const double t0 = now_s();
    int st = 0;
    while (now_s() - t0 < limit) {
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
            *took = now_s() - t0;
            p->pid = 0;
            unlink(p->port_file);
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
        usleep(20000);
    }
    *took = limit;
    kill(p->pid, SIGKILL);
    waitpid(p->pid, &st, 0);
    p->pid = 0;
    return -1;
}

struct cut {
    const struct srv_proc *p;
    size_t after;
};

static void *cut_stream(void *arg)
{
    const struct cut *c = arg;
    long st;
    free(post_stream(c->p, "/v1/completions",
                     "{\"prompt\":[1,2,3,4,5],\"max_tokens\":3000,\"ignore_eos\":true,\"stream\":true,\"n\":2}", c->after,
                     &st));
    return NULL;
}

/* Twenty streamed requests of n = 2 whose clients leave after 1 to 900 bytes, all at once: every
 * sequence, slot and block is free again soon after, and a new request is answered. */
Test(reliability, a_disconnect_storm_leaves_the_engine_idle, .timeout = 300)
{
    struct srv_proc p;
    srv_start(&p, MODEL, NULL);
    enum { N = 20 };
    pthread_t th[N];
    struct cut c[N];
    for (int i = 0; i < N; i++) {
        c[i] = (struct cut){.p = &p, .after = 1 + (size_t)i * 47};
        pthread_create(&th[i], NULL, cut_stream, &c[i]);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
    }
    /* one engine step frees them; a few seconds cover the sanitized build's slow steps */
    const double idle = srv_wait_idle(&p, 10.0);
    cr_expect_geq(idle, 0, "the engine still holds work 10 s after every client left");
    long st;
    json_t *j = post_json(&p, "/v1/completions", "{\"prompt\":[1,2,3],\"max_tokens\":4}", &st);
    cr_expect_eq(st, 200, "a request after the storm: %ld", st);
    json_decref(j);
    cr_expect_eq(srv_stop(&p), 0);
}

struct bg {
    const struct srv_proc *p;
    bool stream;
    long status;
    char *raw;
    json_t *json;
};

static void *long_request(void *arg)
{
    struct bg *b = arg;
    if (b->stream) {
        b->raw = post_stream(b->p, "/v1/completions",
                             "{\"prompt\":[1,2,3],\"max_tokens\":4000,\"ignore_eos\":true,\"stream\":true}", 0, &b->status);
    } else {
        b->json = post_json(b->p, "/v1/completions", "{\"prompt\":[1,2,3],\"max_tokens\":4000,\"ignore_eos\":true}",
                            &b->status);
    }
    return NULL;
}

/* SIGTERM with requests that would outlast --shutdown-timeout: /health answers 503 meanwhile, the
 * streams end with an error event and [DONE], the plain request with a 503 error body, and the
 * process exits 0 within the timeout + 5 s. */
Test(reliability, sigterm_under_load_ends_every_request_and_exits_in_time, .timeout = 300)
{
    struct srv_proc p;
    srv_start(&p, MODEL, "--shutdown-timeout", "2", NULL);
    struct bg b[3] = {{.p = &p, .stream = true}, {.p = &p, .stream = true}, {.p = &p, .stream = false}};
    pthread_t th[3];
    for (int i = 0; i < 3; i++) {
        pthread_create(&th[i], NULL, long_request, &b[i]);
    }
    for (int i = 0; i < 500 && metric(&p, "krait:num_requests_running") < 3; i++) {
        usleep(20000);
    }
    cr_assert_eq(metric(&p, "krait:num_requests_running"), 3);
    kill(p.pid, SIGTERM);
    const double t0 = now_s();
    usleep(300000);
    struct http_res r;
    http(&p, "GET", "/health", NULL, NULL, &r);
    cr_expect_eq(r.status, 503, "/health while draining: %ld", r.status);
    http_free(&r);
    http(&p, "POST", "/v1/completions", "{\"prompt\":[1],\"max_tokens\":2}", NULL, &r);
    cr_expect_eq(r.status, 503, "a new request while draining: %ld", r.status);
    http_free(&r);
    double took = 0;
    const int code = wait_exit(&p, 2 + 5 + 1, &took);
    cr_expect_eq(code, 0, "exit status %d", code);
    cr_expect_leq(now_s() - t0, 2 + 5, "exited %.1f s after SIGTERM (limit: the timeout + 5 s)", now_s() - t0);
    for (int i = 0; i < 3; i++) {
        pthread_join(th[i], NULL);
    }
    for (int i = 0; i < 2; i++) {
        cr_expect_eq(b[i].status, 200);
        bool done = false;
        json_t *ev = sse_events(b[i].raw ? b[i].raw : "", &done);
        cr_expect(done, "stream %d does not end with [DONE]", i);
        const size_t n = json_array_size(ev);
        cr_assert_gt(n, 1);
        json_t *err = json_object_get(json_array_get(ev, n - 1), "error");
        cr_expect(json_is_object(err), "stream %d: the last event before [DONE] is no error object", i);
        cr_expect(strstr(json_string_value(json_object_get(err, "message")), "shut down"));
        json_decref(ev);
        free(b[i].raw);
    }
    cr_expect_eq(b[2].status, 503, "the plain request cut by the timeout: %ld", b[2].status);
    cr_expect(json_is_object(json_object_get(b[2].json, "error")), "no error object in the 503 body");
    json_decref(b[2].json);
}

/* A transient step failure fails the requests of that step only; the server stays healthy. */
Test(reliability, a_transient_step_failure_fails_only_its_requests, .timeout = 300)
{
    setenv("KRAIT_FAULT_STEP", "2", 1);
    struct srv_proc p;
    srv_start(&p, MODEL, NULL);
    long st;
    json_t *j = post_json(&p, "/v1/completions", "{\"prompt\":[1,2,3],\"max_tokens\":4}", &st);
    cr_expect_eq(st, 500, "the request of the failing step: %ld", st);
    cr_expect(json_is_object(json_object_get(j, "error")));
    json_decref(j);
    struct http_res r;
    http(&p, "GET", "/health", NULL, NULL, &r);
    cr_expect_eq(r.status, 200, "/health after a transient failure: %ld", r.status);
    http_free(&r);
    j = post_json(&p, "/v1/completions", "{\"prompt\":[1,2,3],\"max_tokens\":4}", &st);
    cr_expect_eq(st, 200, "the next request: %ld", st);
    json_decref(j);
    cr_expect_eq(srv_stop(&p), 0);
}

/* A lost device: the request fails with 503, /health answers 503, and the process exits 3 on its
 * own so that an orchestrator restarts it. */
Test(reliability, a_lost_device_is_reported_and_the_process_exits_3, .timeout = 300)
{
    setenv("KRAIT_FAULT_STEP", "2:fatal", 1);
    struct srv_proc p;
    srv_start(&p, MODEL, NULL);
    struct http_res r;
    http(&p, "POST", "/v1/completions", "{\"prompt\":[1,2,3],\"max_tokens\":4}", NULL, &r);
    cr_expect_eq(r.status, 503, "the request on the lost device: %ld", r.status);
    cr_expect(r.body && strstr(r.body, "compute device failed"), "body: %s", r.body ? r.body : "");
    http_free(&r);
    http(&p, "GET", "/health", NULL, NULL, &r);
    cr_expect(r.status == 503 || r.status == 0, "/health after the device failed: %ld", r.status);
    http_free(&r);
    double took = 0;
    const int code = wait_exit(&p, 10, &took);
    cr_expect_eq(code, 3, "exit status %d (want 3)", code);
}

static int run_krait(const char *log, const char *const *args)
{
    const pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        if (!freopen(log, "w", stderr)) {
            _exit(126);
        }
        execv(KR_KRAIT_BIN, (char *const *)args);
        _exit(127);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert(f, "cannot open %s", path);
    static char buf[1 << 20];
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* --max-model-len beyond max_position_embeddings is refused before loading, naming both numbers;
 * --allow-long-max-model-len serves it with a warning. */
Test(reliability, a_max_model_len_beyond_the_checkpoint_is_refused, .timeout = 300)
{
    char log[] = "/tmp/krait-maxlen-XXXXXX";
    const int fd = mkstemp(log);
    cr_assert(fd >= 0);
    close(fd);
    const char *args[] = {KR_KRAIT_BIN, "serve", MODEL, "--port", "0", "--max-model-len", "999999", NULL};
    cr_expect_eq(run_krait(log, args), 2);
    const char *text = slurp(log);
    cr_expect(strstr(text, "999999") && strstr(text, "4096") && strstr(text, "--allow-long-max-model-len"),
              "the refusal does not name both lengths and the override: %s", text);
    unlink(log);

    struct srv_proc p;
    srv_start(&p, MODEL, "--max-model-len", "8192", "--allow-long-max-model-len", NULL);
    struct http_res r;
    http(&p, "GET", "/v1/models", NULL, NULL, &r);
    cr_expect(r.body && strstr(r.body, "\"max_model_len\":8192"), "/v1/models: %s", r.body ? r.body : "");
    http_free(&r);
    /* a prompt past the checkpoint's 4096 positions is served */
    enum { LONG = MODEL_MAX_POS + 100 };
    static char body[LONG * 8 + 64];
    size_t off = (size_t)snprintf(body, sizeof body, "{\"max_tokens\":4,\"prompt\":[");
    for (int i = 0; i < LONG; i++) {
        off += (size_t)snprintf(body + off, sizeof body - off, "%s%d", i ? "," : "", 1 + i % 1000);
    }
    snprintf(body + off, sizeof body - off, "]}");
    long st;
    json_t *j = post_json(&p, "/v1/completions", body, &st);
    cr_expect_eq(st, 200, "a %d-token prompt with --max-model-len 8192: %ld", LONG, st);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens")), LONG);
    json_decref(j);
    cr_expect_eq(srv_stop(&p), 0);
}

static bool matches(const char *text, const char *pattern)
{
    regex_t re;
    cr_assert_eq(regcomp(&re, pattern, REG_EXTENDED | REG_NEWLINE | REG_NOSUB), 0, "bad pattern %s", pattern);
    const bool m = regexec(&re, text, 0, NULL, 0) == 0;
    regfree(&re);
    return m;
}

/* At info, every request has an access line (address, method, path, status, latency, tokens, id),
 * refusals included; every log line carries a UTC timestamp. */
Test(reliability, access_lines_and_timestamps, .timeout = 300)
{
    char log[] = "/tmp/krait-access-XXXXXX";
    const int fd = mkstemp(log);
    cr_assert(fd >= 0);
    close(fd);
    srv_log_path = log;
    struct srv_proc p;
    srv_start(&p, MODEL, "--log-level", "info", "--api-key", "k", NULL);
    struct http_res r;
    http(&p, "POST", "/v1/completions", "{\"prompt\":[1,2,3],\"max_tokens\":4}", "k", &r);
    cr_expect_eq(r.status, 200);
    http_free(&r);
    http(&p, "GET", "/v1/models", NULL, NULL, &r);
    cr_expect_eq(r.status, 401);
    http_free(&r);
    http(&p, "POST", "/v1/completions", "{\"prompt\":[1,2,3],\"max_tokens\":-1}", "k", &r);
    cr_expect_eq(r.status, 400);
    http_free(&r);
    cr_expect_eq(srv_stop(&p), 0);
    const char *text = slurp(log);
    const char *ts = "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z";
    char pat[512];
    snprintf(pat, sizeof pat,
             "^%s INFO 127\\.0\\.0\\.1:[0-9]+ \"POST /v1/completions\" 200 [0-9]+\\.[0-9]{3}s prompt_tokens=3 "
             "completion_tokens=4 id=cmpl-[0-9a-f]+$",
             ts);
    cr_expect(matches(text, pat), "no access line for the completion in:\n%s", text);
    snprintf(pat, sizeof pat, "^%s INFO 127\\.0\\.0\\.1:[0-9]+ \"GET /v1/models\" 401 ", ts);
    cr_expect(matches(text, pat), "no access line for the 401 in:\n%s", text);
    snprintf(pat, sizeof pat, "^%s INFO 127\\.0\\.0\\.1:[0-9]+ \"POST /v1/completions\" 400 ", ts);
    cr_expect(matches(text, pat), "no access line for the 400 in:\n%s", text);
    /* no line without a timestamp (libmicrohttpd's messages go through the same log) */
    cr_expect(!matches(text, "^([^2]|2[^0])"), "a log line without a timestamp in:\n%s", text);
    unlink(log);
}

/* max_tokens at the top of its range: refused as beyond the context length (400 with the OpenAI
 * code), never an overflow of prompt + max_tokens (the sanitized build aborted there). */
Test(reliability, max_tokens_at_int32_max_is_a_context_length_error, .timeout = 300)
{
    struct srv_proc p;
    srv_start(&p, MODEL, NULL);
    struct http_res r;
    http(&p, "POST", "/v1/completions", "{\"prompt\":[1,2,3],\"max_tokens\":2147483647}", NULL, &r);
    cr_expect_eq(r.status, 400, "status %ld", r.status);
    cr_expect(r.body && strstr(r.body, "context_length_exceeded"), "body: %s", r.body ? r.body : "");
    cr_expect(r.body && strstr(r.body, "2147483650"), "the requested total is not named: %s", r.body ? r.body : "");
    http_free(&r);
    http(&p, "POST", "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2147483647}", NULL, &r);
    cr_expect_eq(r.status, 400, "chat: status %ld", r.status);
    http_free(&r);
    cr_expect_eq(srv_stop(&p), 0);
}
