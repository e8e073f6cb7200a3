/* Server overhead: the same work through the engine API and through `krait serve` over HTTP
 * (libcurl on loopback), on the embedded default model. Reports mean latency of a 1-token request
 * and the per-token time of a streamed 256-token generation, both ways; the difference is what the
 * HTTP front end (parsing, tokenization, JSON/SSE encoding, the loop hand-off) costs.
 *   bench_server KRAIT_BINARY MODEL_DIR */
#include "engine.h"

#include "log.h"
#include "alloc.h"
#include "clock.h"
#include "tokenizer.h"

#include <curl/curl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int done_flag;
static double tok_times[4096];
static int n_tok;

static void on_event(const struct kr_event *ev, void *user)
{
    (void)user;
    pthread_mutex_lock(&mu);
    if (ev->type == KR_EVENT_TOKEN && n_tok < 4096) {
        tok_times[n_tok++] = kr_clock_s();
    }
    if (ev->type == KR_EVENT_FINISH || ev->type == KR_EVENT_ERROR) {
        done_flag = 1;
        pthread_cond_signal(&cv);
    }
    pthread_mutex_unlock(&mu);
}

static void run_engine(struct kr_engine *e, const int32_t *prompt, int n, int max_tokens)
{
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0;
    s.max_tokens = max_tokens;
    s.ignore_eos = true;
    struct kr_request_params p = {.prompt = prompt, .n_prompt = n, .n = 1, .sampling = s, .cb = on_event};
    uint64_t id;
    pthread_mutex_lock(&mu);
    done_flag = 0;
    n_tok = 0;
    pthread_mutex_unlock(&mu);
    struct kr_err err = {0};
    if (kr_engine_submit(e, &p, &id, &err) != KR_OK) {
        fprintf(stderr, "submit: %s\n", err.msg);
        exit(1);
    }
    pthread_mutex_lock(&mu);
    while (!done_flag) {
        pthread_cond_wait(&cv, &mu);
    }
    pthread_mutex_unlock(&mu);
}

struct sbuf {
    size_t len;
    int chunks;
    double first, last;
};

static size_t on_data(char *ptr, size_t size, size_t nmemb, void *ud)
{
    struct sbuf *b = ud;
    const double t = kr_clock_s();
    for (size_t i = 0; i + 5 < size * nmemb; i++) {
        if (!memcmp(ptr + i, "data:", 5)) {
            if (!b->chunks++) {
                b->first = t;
            }
            b->last = t;
        }
    }
    b->len += size * nmemb;
    return size * nmemb;
}

static double http_post(int port, const char *body, struct sbuf *b)
{
    CURL *c = curl_easy_init();
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/completions", port);
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, b);
    const double t0 = kr_clock_s();
    curl_easy_perform(c);
    const double dt = kr_clock_s() - t0;
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    return dt;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: bench_server KRAIT_BINARY MODEL_DIR\n");
        return 2;
    }
    const char *krait = argv[1], *dir = argv[2];
    const int reps = 200, gen = 256;
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    /* the same prompt the HTTP requests send, tokenized as the server does (with BOS) */
    static const char text[] = "The quick brown fox jumps over the lazy dog";
    struct kr_tokenizer *tok = NULL;
    struct kr_err terr = {0};
    int32_t *prompt = NULL;
    int64_t n_ids = 0;
    if (kr_tokenizer_load(dir, NULL, &tok, &terr) != KR_OK ||
        kr_tokenizer_encode(tok, text, sizeof text - 1, true, &prompt, &n_ids, &terr) != KR_OK) {
        fprintf(stderr, "%s\n", terr.msg);
        return 1;
    }
    const int np = (int)n_ids;
    kr_backend_t be = kr_backend_cpu_create(1);
    struct kr_model *m = NULL;
    struct kr_err err = {0};
    if (kr_model_load(dir, be, &m, &err) != KR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    struct kr_engine_config cfg;
    kr_engine_config_default(&cfg);
    struct kr_engine *e = NULL;
    if (kr_engine_create(m, &cfg, &e, &err) != KR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    run_engine(e, prompt, np, 1); /* warm-up */
    double t0 = kr_clock_s();
    for (int i = 0; i < reps; i++) {
        run_engine(e, prompt, np, 1);
    }
    const double eng_req = (kr_clock_s() - t0) / reps;
    run_engine(e, prompt, np, gen);
    const double eng_tok = (tok_times[n_tok - 1] - tok_times[0]) / (n_tok - 1);
    kr_engine_free(e);
    kr_model_free(m);
    kr_backend_free(be);
    kr_free(prompt);
    kr_tokenizer_free(tok);

    char port_file[] = "/tmp/krait-bench-port-XXXXXX";
    int fd = mkstemp(port_file);
    close(fd);
    unlink(port_file);
    pid_t pid = fork();
    if (pid == 0) {
        execl(krait, krait, "serve", dir, "--host", "127.0.0.1", "--port", "0", "--port-file", port_file, "--threads",
              "1", "--log-level", "warn", (char *)NULL);
        _exit(127);
    }
    int port = 0;
    for (int i = 0; i < 600 && !port; i++) {
        FILE *fp = fopen(port_file, "r");
        if (fp) {
            if (fscanf(fp, "%d", &port) != 1) {
                port = 0;
            }
            fclose(fp);
        }
        usleep(100000);
    }
    for (int i = 0; i < 600; i++) { /* until /health says the model is loaded */
        CURL *c = curl_easy_init();
        char url[128];
        snprintf(url, sizeof url, "http://127.0.0.1:%d/health", port);
        curl_easy_setopt(c, CURLOPT_URL, url);
        struct sbuf hb = {0};
        curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
        curl_easy_setopt(c, CURLOPT_WRITEDATA, &hb);
        long code = 0;
        if (curl_easy_perform(c) == CURLE_OK) {
            curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
        }
        curl_easy_cleanup(c);
        if (code == 200) {
            break;
        }
        usleep(100000);
    }
    const char *one = "{\"prompt\":\"The quick brown fox jumps over the lazy dog\",\"max_tokens\":1,\"temperature\":0}";
    struct sbuf b = {0};
    http_post(port, one, &b);
    double total = 0;
    for (int i = 0; i < reps; i++) {
        struct sbuf bb = {0};
        total += http_post(port, one, &bb);
    }
    const double http_req = total / reps;
    char body[256];
    snprintf(body, sizeof body,
             "{\"prompt\":\"The quick brown fox jumps over the lazy dog\",\"max_tokens\":%d,\"temperature\":0,"
             "\"stream\":true,\"ignore_eos\":true}",
             gen);
    struct sbuf sb = {0};
    http_post(port, body, &sb);
    /* chunks: one per token, a final one with the finish reason, and [DONE] */
    if (sb.chunks < gen) {
        fprintf(stderr, "bench_server: the stream carried %d chunks for %d tokens\n", sb.chunks, gen);
        return 1;
    }
    const double http_tok = (sb.last - sb.first) / (sb.chunks - 2);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
    printf("| path | 1-token request, mean ms | streamed token, mean ms |\n|---|---|---|\n");
    printf("| engine API | %.3f | %.3f |\n| HTTP (krait serve, loopback) | %.3f | %.3f |\n", eng_req * 1e3,
           eng_tok * 1e3, http_req * 1e3, http_tok * 1e3);
    printf("| overhead | %.3f | %.3f |\n", (http_req - eng_req) * 1e3, (http_tok - eng_tok) * 1e3);
    return 0;
}
