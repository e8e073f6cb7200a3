/* Fuzz harness: what krait decides from a request's HTTP side before any engine work
 * (server/http-util.c, called by server/server.c): the API key check on the Authorization
 * header, which routes it guards, the declared Content-Length against the body limit, the route
 * and method table, and the framing of server-sent events. The input is lines ("\n"):
 *   url, method, Authorization value, Content-Length value, then the stream's events, one a line
 *   (a tab splits a named event, as the Responses API sends them: name before it, data after);
 * each byte of the last line (when there are events) is the size of one read of the stream (0: 1).
 * Every decision is checked against a reference written here from the documented behaviour
 * (README "Endpoints", docs/RELIABILITY.md "Refusals before the body"), and the stream, read in
 * pieces of those sizes, must be exactly "data: " event "\n\n" for each event in order. */
/* fuzz-max-len: 4096 (tools/fuzz.sh passes it as -max_len) */
#include "fuzz.h"

#include "alloc.h"
#include "http-util.h"

#include <ctype.h>
#include <stdint.h>
#include <string.h>

#define MAX_LINES 64

/* The keys of the checks (as --api-key gives them). */
static const char *const k_keys[] = {"sk-test-0123456789", "k2", "Bearer x"};

/* Reference: "Bearer " with any case, then exactly one of the keys. */
static bool ref_authorized(const char *a, const char *const *keys, int n)
{
    if (n == 0) {
        return true;
    }
    if (!a || strlen(a) < 7) {
        return false;
    }
    static const char scheme[] = "bearer ";
    for (int i = 0; i < 7; i++) {
        if (tolower((unsigned char)a[i]) != scheme[i]) {
            return false;
        }
    }
    for (int i = 0; i < n; i++) {
        if (!strcmp(a + 7, keys[i])) {
            return true;
        }
    }
    return false;
}

static void check_route(const char *url, const char *method)
{
    static const struct {
        const char *url, *method;
        enum kr_http_route r;
    } api[] = {
        {"/v1/completions", "POST", KR_HTTP_ROUTE_COMPLETIONS}, {"/v1/chat/completions", "POST", KR_HTTP_ROUTE_CHAT},
        {"/v1/responses", "POST", KR_HTTP_ROUTE_RESPONSES},     {"/v1/models", "GET", KR_HTTP_ROUTE_MODELS},
        {"/tokenize", "POST", KR_HTTP_ROUTE_TOKENIZE},          {"/detokenize", "POST", KR_HTTP_ROUTE_DETOKENIZE},
    };
    const char *allow = "unset";
    const enum kr_http_route r = kr_http_route_find(url, method, &allow);
    if (!strncmp(url, "/v1/models/", 11)) { /* GET /v1/models/{id}, any id */
        KR_FUZZ_CHECK(r == KR_HTTP_ROUTE_MODEL, "%s routed to %d", url, (int)r);
        KR_FUZZ_CHECK(!strcmp(method, "GET") ? allow == NULL : allow && !strcmp(allow, "GET"), "%s %s: Allow %s",
                      method, url, allow ? allow : "(none)");
        return;
    }
    for (size_t i = 0; i < sizeof api / sizeof api[0]; i++) {
        if (!strcmp(url, api[i].url)) {
            KR_FUZZ_CHECK(r == api[i].r, "%s routed to %d", url, (int)r);
            if (!strcmp(method, api[i].method)) {
                KR_FUZZ_CHECK(allow == NULL, "%s %s: Allow %s", method, url, allow);
            } else {
                KR_FUZZ_CHECK(allow && !strcmp(allow, api[i].method), "%s %s: Allow %s", method, url,
                              allow ? allow : "(none)");
            }
            return;
        }
    }
    KR_FUZZ_CHECK(r == KR_HTTP_ROUTE_NONE && allow == NULL, "%s routed to %d", url, (int)r);
}

static void check_content_length(const char *v)
{
    static const size_t limits[] = {0, 1, 32u << 20, SIZE_MAX};
    for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
        size_t len = 12345;
        const bool ok = kr_http_content_length(v, limits[i], &len);
        KR_FUZZ_CHECK(ok ? len <= limits[i] : len == 0, "length %zu against %zu", len, limits[i]);
        /* a plain decimal of at most 18 digits is that number */
        size_t nd = 0;
        unsigned long long want = 0;
        while (v && isdigit((unsigned char)v[nd]) && nd < 19) {
            want = want * 10 + (unsigned)(v[nd++] - '0');
        }
        if (v && nd > 0 && nd <= 18 && v[nd] == '\0') {
            KR_FUZZ_CHECK(ok == (want <= limits[i]) && (!ok || len == want), "\"%s\" read as %zu (ok %d)", v, len,
                          (int)ok);
        }
    }
    size_t len = 1;
    KR_FUZZ_CHECK(kr_http_content_length(NULL, 0, &len) && len == 0, "no header declares a body");
}

/* Streams the events through the SSE buffer, read back in pieces of the given sizes as the server's
 * reader does (the buffer is emptied when read to its end), and compares with the framing. */
static void check_sse(char **events, const size_t *lens, size_t n_events, const uint8_t *reads, size_t n_reads)
{
    /* a tab splits a named event: name before it, data after */
    const char *names[MAX_LINES], *datas[MAX_LINES];
    size_t dlens[MAX_LINES], want_len = 0;
    for (size_t i = 0; i < n_events; i++) {
        const char *tab = memchr(events[i], '\t', lens[i]);
        names[i] = tab ? events[i] : NULL;
        if (tab) {
            events[i][tab - events[i]] = '\0'; /* the name ends there (it may hold NUL bytes earlier) */
        }
        datas[i] = tab ? tab + 1 : events[i];
        dlens[i] = tab ? lens[i] - (size_t)(tab + 1 - events[i]) : lens[i];
        want_len += (names[i] ? strlen(names[i]) + 8 : 0) + dlens[i] + 8;
    }
    char *want = kr_malloc(want_len + 1), *got = kr_malloc(want_len + 1);
    KR_FUZZ_CHECK(want && got, "out of memory");
    size_t w = 0;
    for (size_t i = 0; i < n_events; i++) {
        if (names[i]) {
            const size_t nl = strlen(names[i]);
            memcpy(want + w, "event: ", 7);
            memcpy(want + w + 7, names[i], nl);
            want[w + 7 + nl] = '\n';
            w += nl + 8;
        }
        memcpy(want + w, "data: ", 6);
        memcpy(want + w + 6, datas[i], dlens[i]);
        memcpy(want + w + 6 + dlens[i], "\n\n", 2);
        w += dlens[i] + 8;
    }
    char *out = NULL;
    size_t out_len = 0, out_cap = 0, out_off = 0, g = 0, r = 0;
    for (size_t i = 0; i <= n_events; i++) {
        /* a read between events, then the next event */
        const size_t max = n_reads ? (reads[r++ % n_reads] ? reads[(r - 1) % n_reads] : 1) : 4096;
        const size_t n = kr_http_drain(out, out_len, &out_off, got + g, max);
        KR_FUZZ_CHECK(n <= max && g + n <= want_len, "read %zu of at most %zu", n, max);
        g += n;
        if (out_off == out_len) {
            out_off = out_len = 0;
        }
        if (i < n_events) {
            KR_FUZZ_CHECK(kr_http_sse_append(&out, &out_len, &out_cap, names[i], datas[i], dlens[i]), "out of memory");
            KR_FUZZ_CHECK(out[out_len] == '\0', "not NUL-terminated");
        }
    }
    for (size_t n; (n = kr_http_drain(out, out_len, &out_off, got + g, 7)) > 0;) {
        g += n;
    }
    KR_FUZZ_CHECK(g == want_len && memcmp(got, want, want_len) == 0, "stream of %zu bytes, %zu expected", g, want_len);
    kr_free(out);
    kr_free(want);
    kr_free(got);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* the lines, each a NUL-terminated copy (the server sees C strings from libmicrohttpd) */
    char *lines[MAX_LINES];
    size_t lens[MAX_LINES], n = 0, at = 0;
    while (n < MAX_LINES && at <= size) {
        const uint8_t *nl = memchr(data + at, '\n', size - at);
        const size_t len = nl ? (size_t)(nl - (data + at)) : size - at;
        lines[n] = kr_malloc(len + 1);
        KR_FUZZ_CHECK(lines[n], "out of memory");
        memcpy(lines[n], data + at, len);
        lines[n][len] = '\0';
        lens[n++] = len;
        at += len + 1;
        if (!nl) {
            break;
        }
    }
    const char *url = lines[0], *method = n > 1 ? lines[1] : "GET";
    const char *auth = n > 2 ? lines[2] : NULL, *clen = n > 3 ? lines[3] : NULL;

    const bool g = kr_http_guarded(url);
    KR_FUZZ_CHECK(g == (!strncmp(url, "/v1/", 4) || !strcmp(url, "/tokenize") || !strcmp(url, "/detokenize")),
                  "%s guarded: %d", url, (int)g);
    for (int k = 0; k <= 3; k++) {
        const bool a = kr_http_authorized(auth, k_keys, k);
        KR_FUZZ_CHECK(a == ref_authorized(auth, k_keys, k), "\"%s\" with %d keys: %d", auth ? auth : "(none)", k,
                      (int)a);
    }
    check_route(url, method);
    check_content_length(clen);
    if (n > 5) { /* events on lines 4 .. n-2, read sizes on the last line */
        check_sse(lines + 4, lens + 4, n - 5, (const uint8_t *)lines[n - 1], lens[n - 1]);
    }
    for (size_t i = 0; i < n; i++) {
        kr_free(lines[i]);
    }
    return 0;
}
