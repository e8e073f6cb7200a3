#include "http-util.h"

#include "alloc.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

bool kr_http_authorized(const char *authorization, const char *const *keys, int n_keys)
{
    if (n_keys == 0) {
        return true;
    }
    const char *a = authorization;
    if (!a || strncasecmp(a, "Bearer ", 7) != 0) {
        return false;
    }
    a += 7;
    const size_t al = strlen(a);
    for (int i = 0; i < n_keys; i++) {
        const char *k = keys[i];
        const size_t kl = strlen(k);
        unsigned diff = (unsigned)(kl ^ al);
        for (size_t j = 0; j < kl; j++) { /* constant time over the key */
            diff |= (unsigned)(k[j] ^ (j < al ? a[j] : 0));
        }
        if (diff == 0) {
            return true;
        }
    }
    return false;
}

bool kr_http_guarded(const char *url)
{
    return !strncmp(url, "/v1/", 4) || !strcmp(url, "/tokenize") || !strcmp(url, "/detokenize");
}

bool kr_http_content_length(const char *value, size_t max, size_t *len)
{
    const unsigned long long v = value ? strtoull(value, NULL, 10) : 0;
    if (v > (unsigned long long)max) {
        *len = 0;
        return false;
    }
    *len = (size_t)v;
    return true;
}

enum kr_http_route kr_http_route_find(const char *url, const char *method, const char **allow)
{
    static const struct {
        const char *url;
        enum kr_http_route r;
        bool post;
    } routes[] = {
        {"/v1/completions", KR_HTTP_ROUTE_COMPLETIONS, true}, {"/v1/chat/completions", KR_HTTP_ROUTE_CHAT, true},
        {"/v1/responses", KR_HTTP_ROUTE_RESPONSES, true},     {"/v1/models", KR_HTTP_ROUTE_MODELS, false},
        {"/tokenize", KR_HTTP_ROUTE_TOKENIZE, true},          {"/detokenize", KR_HTTP_ROUTE_DETOKENIZE, true},
    };
    static const char k_model_prefix[] = "/v1/models/";
    *allow = NULL;
    if (!strncmp(url, k_model_prefix, sizeof k_model_prefix - 1)) {
        if (strcmp(method, "GET") != 0) {
            *allow = "GET";
        }
        return KR_HTTP_ROUTE_MODEL;
    }
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        if (strcmp(url, routes[i].url) != 0) {
            continue;
        }
        const char *want = routes[i].post ? "POST" : "GET";
        if (strcmp(method, want) != 0) {
            *allow = want;
        }
        return routes[i].r;
    }
    return KR_HTTP_ROUTE_NONE;
}

bool kr_http_sse_append(char **out, size_t *len, size_t *cap, const char *name, const char *json, size_t n)
{
    const size_t nl = name ? strlen(name) + 8 : 0; /* "event: " name "\n" */
    if (*len + nl + n + 9 > *cap) {
        const size_t nc = (*len + nl + n + 9) * 2;
        char *np = kr_realloc(*out, nc);
        if (!np) {
            return false;
        }
        *out = np;
        *cap = nc;
    }
    if (name) {
        memcpy(*out + *len, "event: ", 7);
        memcpy(*out + *len + 7, name, nl - 8);
        (*out)[*len + nl - 1] = '\n';
        *len += nl;
    }
    memcpy(*out + *len, "data: ", 6);
    memcpy(*out + *len + 6, json, n);
    memcpy(*out + *len + 6 + n, "\n\n", 3);
    *len += n + 8;
    return true;
}

size_t kr_http_drain(const char *src, size_t len, size_t *off, char *dst, size_t max)
{
    if (*off >= len) {
        return 0;
    }
    const size_t n = len - *off < max ? len - *off : max;
    memcpy(dst, src + *off, n);
    *off += n;
    return n;
}
