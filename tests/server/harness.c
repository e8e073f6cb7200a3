#include "harness.h"

#include <criterion/criterion.h>
#include <curl/curl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

const char *srv_log_path;

static void srv_vspawn(struct srv_proc *p, const char *model, va_list ap)
{
    memset(p, 0, sizeof *p);
    snprintf(p->port_file, sizeof p->port_file, "/tmp/krait-port-XXXXXX");
    int fd = mkstemp(p->port_file);
    cr_assert(fd >= 0);
    close(fd);
    unlink(p->port_file);
    const char *argv[64];
    int n = 0;
    argv[n++] = getenv("KR_KRAIT_BIN") ? getenv("KR_KRAIT_BIN") : KR_KRAIT_BIN; /* the binary moved */
    argv[n++] = "serve";
    argv[n++] = model;
    argv[n++] = "--host";
    argv[n++] = "127.0.0.1";
    argv[n++] = "--port";
    argv[n++] = "0";
    argv[n++] = "--port-file";
    argv[n++] = p->port_file;
    argv[n++] = "--threads";
    argv[n++] = "1";
    argv[n++] = "--log-level";
    argv[n++] = "warn";
    const char *a;
    snprintf(p->host, sizeof p->host, "127.0.0.1");
    bool host_next = false;
    while ((a = va_arg(ap, const char *)) && n < 62) {
        argv[n++] = a;
        if (host_next) {
            snprintf(p->host, sizeof p->host, "%s", a);
        }
        host_next = !strcmp(a, "--host");
    }
    argv[n] = NULL;
    p->pid = fork();
    cr_assert(p->pid >= 0);
    if (p->pid == 0) {
        /* a test that fails an assertion ends its process: the server goes with it (else it holds
         * the runner's output open and the suite waits for it) */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (srv_log_path && !freopen(srv_log_path, "w", stderr)) {
            _exit(126);
        }
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
}

void srv_spawn(struct srv_proc *p, const char *model, ...)
{
    va_list ap;
    va_start(ap, model);
    srv_vspawn(p, model, ap);
    va_end(ap);
}

void srv_start(struct srv_proc *p, const char *model, ...)
{
    va_list ap;
    va_start(ap, model);
    srv_vspawn(p, model, ap);
    va_end(ap);
    srv_ready(p);
}

void srv_ready(struct srv_proc *p)
{
    for (int i = 0; i < 600 && !p->port; i++) { /* up to 60 s under sanitizers */
        FILE *fp = fopen(p->port_file, "r");
        if (fp) {
            if (fscanf(fp, "%d", &p->port) != 1) {
                p->port = 0;
            }
            fclose(fp);
        }
        int st;
        cr_assert_eq(waitpid(p->pid, &st, WNOHANG), 0, "krait serve exited at start-up");
        if (!p->port) {
            sleep_ms(100);
        }
    }
    cr_assert(p->port > 0, "krait serve never wrote its port");
    for (int i = 0; i < 1200; i++) {
        struct http_res r;
        http(p, "GET", "/health", NULL, NULL, &r);
        long status = r.status;
        http_free(&r);
        if (status == 200) {
            return;
        }
        cr_assert(status == 503 || status == 0, "/health answered %ld while loading", status);
        sleep_ms(50);
    }
    cr_assert(0, "the server never became healthy");
}

int srv_stop(struct srv_proc *p)
{
    if (p->pid <= 0) {
        return -1;
    }
    kill(p->pid, SIGTERM);
    int st = 0;
    for (int i = 0; i < 600; i++) {
        pid_t r = waitpid(p->pid, &st, WNOHANG);
        if (r == p->pid) {
            unlink(p->port_file);
            p->pid = 0;
            if (WIFSIGNALED(st)) {
                fprintf(stderr, "srv_stop: krait serve was ended by signal %d (%s)\n", WTERMSIG(st),
                        strsignal(WTERMSIG(st)));
                return -1;
            }
            if (WEXITSTATUS(st) != 0) {
                fprintf(stderr, "srv_stop: krait serve exited with status %d\n", WEXITSTATUS(st));
            }
            return WEXITSTATUS(st);
        }
        sleep_ms(100);
    }
    fprintf(stderr, "srv_stop: krait serve was still running 60 s after SIGTERM: killed\n");
    kill(p->pid, SIGKILL);
    waitpid(p->pid, &st, 0);
    p->pid = 0;
    return -1;
}

struct buf {
    char *p;
    size_t len;
    size_t abort_after;
};

static size_t on_data(char *ptr, size_t size, size_t nmemb, void *ud)
{
    struct buf *b = ud;
    size_t n = size * nmemb;
    char *np = realloc(b->p, b->len + n + 1);
    if (!np) {
        return 0;
    }
    b->p = np;
    memcpy(b->p + b->len, ptr, n);
    b->len += n;
    b->p[b->len] = 0;
    if (b->abort_after && b->len >= b->abort_after) {
        return 0; /* the client hangs up */
    }
    return n;
}

struct hdrs {
    char retry_after[32];
    char content_type[128];
    char allow[64];
    char all[4096];
    size_t all_len;
};

static size_t on_header(char *ptr, size_t size, size_t nmemb, void *ud)
{
    struct hdrs *h = ud;
    size_t n = size * nmemb;
    char line[256];
    size_t l = n < sizeof line - 1 ? n : sizeof line - 1;
    memcpy(line, ptr, l);
    line[l] = 0;
    line[strcspn(line, "\r\n")] = 0;
    const size_t ll = strlen(line);
    if (ll && h->all_len + ll + 2 <= sizeof h->all) {
        memcpy(h->all + h->all_len, line, ll);
        h->all_len += ll;
        h->all[h->all_len++] = '\n';
        h->all[h->all_len] = 0;
    }
    if (!strncasecmp(line, "Retry-After: ", 13)) {
        snprintf(h->retry_after, sizeof h->retry_after, "%.31s", line + 13);
    } else if (!strncasecmp(line, "Allow: ", 7)) {
        snprintf(h->allow, sizeof h->allow, "%.63s", line + 7);
    } else if (!strncasecmp(line, "Content-Type: ", 14)) {
        snprintf(h->content_type, sizeof h->content_type, "%.127s", line + 14);
    }
    return n;
}

static long perform_with(const struct srv_proc *p, const char *method, const char *path, const char *body,
                         const char *auth, const char *const *extra, struct buf *b, struct hdrs *h)
{
    CURL *c = curl_easy_init();
    cr_assert(c);
    char url[256];
    if (strchr(p->host, ':')) {
        snprintf(url, sizeof url, "http://[%s]:%d%s", p->host, p->port, path);
    } else {
        snprintf(url, sizeof url, "http://%s:%d%s", p->host, p->port, path);
    }
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    struct curl_slist *hl = NULL;
    hl = curl_slist_append(hl, "Content-Type: application/json");
    char ah[300];
    if (auth) {
        snprintf(ah, sizeof ah, "Authorization: Bearer %s", auth);
        hl = curl_slist_append(hl, ah);
    }
    for (size_t i = 0; extra && extra[i]; i++) {
        hl = curl_slist_append(hl, extra[i]);
    }
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hl);
    if (body) {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    }
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, b);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, h);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 300L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_perform(c);
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    curl_slist_free_all(hl);
    curl_easy_cleanup(c);
    if (!b->p) {
        b->p = calloc(1, 1);
    }
    return status;
}

static long perform(const struct srv_proc *p, const char *method, const char *path, const char *body, const char *auth,
                    struct buf *b, struct hdrs *h)
{
    return perform_with(p, method, path, body, auth, NULL, b, h);
}

static void http_any(const struct srv_proc *p, const char *method, const char *path, const char *body, const char *auth,
                     const char *const *extra, struct http_res *out)
{
    struct buf b = {0};
    struct hdrs h;
    memset(&h, 0, sizeof h);
    out->status = perform_with(p, method, path, body, auth, extra, &b, &h);
    memcpy(out->headers, h.all, sizeof out->headers);
    out->body = b.p;
    out->len = b.len;
    memcpy(out->retry_after, h.retry_after, sizeof out->retry_after);
    memcpy(out->allow, h.allow, sizeof out->allow);
    memcpy(out->content_type, h.content_type, sizeof out->content_type);
}

void http(const struct srv_proc *p, const char *method, const char *path, const char *body, const char *auth,
          struct http_res *out)
{
    http_any(p, method, path, body, auth, NULL, out);
}

void http_with(const struct srv_proc *p, const char *method, const char *path, const char *body,
               const char *const *headers, struct http_res *out)
{
    http_any(p, method, path, body, NULL, headers, out);
}

const char *http_header(const struct http_res *r, const char *name, char *buf, size_t cap)
{
    const size_t n = strlen(name);
    for (const char *l = r->headers; *l; l = strchr(l, '\n') + 1) {
        if (!strncasecmp(l, name, n) && l[n] == ':') {
            const char *v = l + n + 1 + strspn(l + n + 1, " ");
            snprintf(buf, cap, "%.*s", (int)strcspn(v, "\n"), v);
            return buf;
        }
    }
    return NULL;
}

void http_free(struct http_res *r)
{
    free(r->body);
    r->body = NULL;
}

json_t *post_json(const struct srv_proc *p, const char *path, const char *body, long *status)
{
    struct http_res r;
    http(p, "POST", path, body, NULL, &r);
    json_error_t je;
    json_t *j = json_loads(r.body, 0, &je);
    cr_assert(j, "%s answered %ld with unparsable JSON: %.300s", path, r.status, r.body);
    *status = r.status;
    http_free(&r);
    return j;
}

char *post_stream(const struct srv_proc *p, const char *path, const char *body, size_t abort_after, long *status)
{
    struct buf b = {.abort_after = abort_after};
    struct hdrs h;
    memset(&h, 0, sizeof h);
    *status = perform(p, "POST", path, body, NULL, &b, &h);
    return b.p;
}

json_t *sse_events(const char *text, bool *done)
{
    json_t *arr = json_array();
    *done = false;
    const char *s = text;
    while ((s = strstr(s, "data: "))) {
        s += 6;
        const char *e = strstr(s, "\n\n");
        cr_assert(e, "an SSE event is not terminated by a blank line");
        if (!strncmp(s, "[DONE]", 6)) {
            *done = true;
            cr_expect(e[2] == 0, "events after [DONE]");
            break;
        }
        json_error_t je;
        json_t *j = json_loadb(s, (size_t)(e - s), 0, &je);
        cr_assert(j, "an SSE event is not JSON: %.200s", s);
        json_array_append_new(arr, j);
        s = e + 2;
    }
    return arr;
}

double metric(const struct srv_proc *p, const char *name)
{
    struct http_res r;
    http(p, "GET", "/metrics", NULL, NULL, &r);
    double v = NAN;
    char key[160];
    snprintf(key, sizeof key, "\n%s{", name);
    const char *s = strstr(r.body, key);
    if (s) {
        s = strchr(s + 1, '}');
        if (s) {
            v = strtod(s + 1, NULL);
        }
    }
    http_free(&r);
    return v;
}

double metric_with(const struct srv_proc *p, const char *name, const char *label)
{
    struct http_res r;
    http(p, "GET", "/metrics", NULL, NULL, &r);
    double v = NAN;
    const size_t nl = strlen(name);
    for (const char *line = r.body; line && *line;) {
        const char *end = strchr(line, '\n');
        if (!strncmp(line, name, nl) && line[nl] == '{') {
            const char *close = strchr(line, '}');
            const char *lab = strstr(line, label);
            if (close && lab && lab < close && (!end || close < end)) {
                v = strtod(close + 1, NULL);
                break;
            }
        }
        line = end ? end + 1 : NULL;
    }
    http_free(&r);
    return v;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double srv_wait_idle(const struct srv_proc *p, double limit)
{
    const double t0 = now_s();
    while (now_s() - t0 < limit) {
        if (metric(p, "krait:num_requests_running") == 0 && metric(p, "krait:num_requests_waiting") == 0 &&
            metric_with(p, "krait:state_slots", "state=\"used\"") == 0 &&
            metric_with(p, "krait:cache_blocks", "state=\"used\"") == 0) {
            return now_s() - t0;
        }
        sleep_ms(20);
    }
    return -1;
}
