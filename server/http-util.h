#pragma once
/* What the HTTP front end (server.c) decides from a request's bytes before any engine work, apart
 * from libmicrohttpd and its connections, so that each decision can be tested and fuzzed alone:
 * the API key check, which routes the key guards, the declared body length, the route table, and
 * the framing of server-sent events. Pure functions; any thread. */
#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Whether an Authorization header value (NULL: none) carries one of the n_keys keys: "Bearer "
 * (the scheme case-insensitive) followed by exactly that key. Compares in time that depends on the
 * key's length, not on where the first difference is. With no key configured, everything is. */
bool kr_http_authorized(const char *authorization, const char *const *keys, int n_keys);

/* Whether the route of `url` needs the API key: /v1/..., /tokenize and /detokenize (work a client
 * without the key must not queue); /health, /metrics and /version do not. */
bool kr_http_guarded(const char *url);

/* The body length a Content-Length value (NULL: none, 0) declares, read as strtoull does: in *len
 * when it is at most `max`, and true; false (and *len 0) when it is beyond `max` (a 413 before the
 * body is read). A value that is no number declares 0 (libmicrohttpd refuses it first). */
bool kr_http_content_length(const char *value, size_t max, size_t *len);

/* The routes that take a body or answer from the model. */
enum kr_http_route {
    KR_HTTP_ROUTE_NONE = 0,
    KR_HTTP_ROUTE_COMPLETIONS, /* POST /v1/completions */
    KR_HTTP_ROUTE_CHAT,        /* POST /v1/chat/completions */
    KR_HTTP_ROUTE_RESPONSES,   /* POST /v1/responses */
    KR_HTTP_ROUTE_MODELS,      /* GET /v1/models */
    KR_HTTP_ROUTE_MODEL,       /* GET /v1/models/{id} (the id is the rest of the URL, possibly empty) */
    KR_HTTP_ROUTE_TOKENIZE,    /* POST /tokenize */
    KR_HTTP_ROUTE_DETOKENIZE,  /* POST /detokenize */
};

/* The route of `url` (KR_HTTP_ROUTE_NONE: none, a 404). When `method` is not the one it takes,
 * *allow is that method ("GET" or "POST", static: a 405's Allow header), NULL otherwise. */
enum kr_http_route kr_http_route_find(const char *url, const char *method, const char **allow);

/* Appends one server-sent event, "event: " name "\n" (when name is not NULL: the Responses API's
 * named events) then "data: " json "\n\n", whole or not at all, to the buffer *out (len bytes used,
 * cap allocated with kr_malloc; kept NUL-terminated). false (buffer unchanged) when out of memory. */
bool kr_http_sse_append(char **out, size_t *len, size_t *cap, const char *name, const char *json, size_t n);

/* Copies the next bytes of src[*off .. len), at most max, to dst and advances *off; returns how
 * many (0 when src is drained). */
size_t kr_http_drain(const char *src, size_t len, size_t *off, char *dst, size_t max);

#ifdef __cplusplus
}
#endif
