/* OpenAI requests: parsing /v1/completions and /v1/chat/completions bodies into kr_oai_request
 * (prompt or messages and tools, sampling, stop, logprobs, stream options), and the errors they
 * report (kr_oai_error: the one table from a cause to its HTTP status, OpenAI type and code). The
 * responses are built in openai-encode.c.
 *
 * Request parsing follows OpenAI's API reference and vLLM's pydantic models
 * (vllm/entrypoints/openai/protocol.py): `null` means "absent" for every optional field, unknown
 * fields are ignored, and every client mistake is a 400 invalid_request_error naming the field. */
#define _POSIX_C_SOURCE 200809L

#include "openai.h"

#include "alloc.h"
#include "log.h"
#include "tools.h"

#include <jansson.h>

#include <errno.h>
#include <stdlib.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define OAI_MAX_STOP     16
#define OAI_MAX_LOGPROBS KR_MAX_TOP_LOGPROBS
#define OAI_MAX_N        128
/* Bounds a client can reach (docs/RELIABILITY.md lists them all): OpenAI's own limit of 128 tools,
 * twice its 2,048 messages (a chat template walks every message, some of them more than once) */
#define OAI_MAX_TOOLS    128
#define OAI_MAX_MESSAGES 4096
#define OAI_MAX_PROMPTS  1024 /* a batch's prompts (prompts x n is bounded the same way when it is prepared) */

/* ---- errors ---------------------------------------------------------------------------------- */

/* The status, type and code of each cause: the only such table (see enum kr_oai_cause). */
static const struct {
    int http_status;
    const char *type;
    const char *code;
} oai_causes[KR_OAI_CAUSE_COUNT] = {
    [KR_OAI_INVALID] = {400, "invalid_request_error", ""},
    [KR_OAI_TOO_LONG] = {400, "invalid_request_error", "context_length_exceeded"},
    [KR_OAI_UNAUTHORIZED] = {401, "authentication_error", "invalid_api_key"},
    [KR_OAI_NOT_FOUND] = {404, "not_found_error", ""},
    [KR_OAI_MODEL_NOT_FOUND] = {404, "not_found_error", "model_not_found"},
    [KR_OAI_METHOD] = {405, "invalid_request_error", "method_not_allowed"},
    [KR_OAI_TOO_LARGE] = {413, "invalid_request_error", "request_too_large"},
    [KR_OAI_QUEUE_FULL] = {429, "rate_limit_error", "queue_full"},
    [KR_OAI_INTERNAL] = {500, "server_error", ""},
    [KR_OAI_UNAVAILABLE] = {503, "service_unavailable", ""},
};

static void error_vset(struct kr_oai_error *e, enum kr_oai_cause cause, const char *param, const char *fmt,
                       va_list ap) __attribute__((format(printf, 4, 0)));

static void error_vset(struct kr_oai_error *e, enum kr_oai_cause cause, const char *param, const char *fmt,
                       va_list ap)
{
    KR_ASSERT((unsigned)cause < KR_OAI_CAUSE_COUNT);
    e->http_status = oai_causes[cause].http_status;
    snprintf(e->type, sizeof e->type, "%s", oai_causes[cause].type);
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    snprintf(e->code, sizeof e->code, "%s", oai_causes[cause].code);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
}

enum kr_status kr_oai_error(struct kr_oai_error *e, enum kr_oai_cause cause, const char *param,
                            const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        error_vset(e, cause, param, fmt, ap);
        va_end(ap);
    }
    return KR_ERR_INVAL;
}

/* A 400 invalid_request_error about `param` (a field path, "" for the whole body). */
static enum kr_status bad(struct kr_oai_error *e, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static enum kr_status bad(struct kr_oai_error *e, const char *param, const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        error_vset(e, KR_OAI_INVALID, param, fmt, ap);
        va_end(ap);
    }
    return KR_ERR_INVAL;
}

static enum kr_status oom(struct kr_oai_error *e)
{
    kr_oai_error(e, KR_OAI_INTERNAL, "", "out of memory");
    return KR_ERR_NOMEM;
}

/* ---- request parsing: field helpers ---------------------------------------------------------- */

/* Formats a field path ("messages[3].content[0].text") into dst[cap], truncating if needed (the
 * error's param field is 64 bytes anyway). */
static void pathf(char *dst, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void pathf(char *dst, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, cap, fmt, ap);
    va_end(ap);
}

/* The value of obj[key], or NULL when absent or JSON null (OpenAI and vLLM treat both alike). */
static json_t *opt_get(const json_t *obj, const char *key)
{
    json_t *v = json_object_get(obj, key);
    return v && !json_is_null(v) ? v : NULL;
}

static enum kr_status opt_bool(const json_t *obj, const char *key, const char *param, bool *out,
                               bool *present, struct kr_oai_error *e)
{
    json_t *v = opt_get(obj, key);
    if (present) {
        *present = v != NULL;
    }
    if (!v) {
        return KR_OK;
    }
    if (!json_is_boolean(v)) {
        return bad(e, param, "'%s' must be a boolean", param);
    }
    *out = json_is_true(v);
    return KR_OK;
}

static enum kr_status opt_string(const json_t *obj, const char *key, const char *param, const char **out,
                                 struct kr_oai_error *e)
{
    json_t *v = opt_get(obj, key);
    if (!v) {
        return KR_OK;
    }
    if (!json_is_string(v)) {
        return bad(e, param, "'%s' must be a string", param);
    }
    if (strlen(json_string_value(v)) != json_string_length(v)) { /* a name compared as a C string */
        return bad(e, param, "'%s' must not contain NUL characters", param);
    }
    *out = json_string_value(v);
    return KR_OK;
}

/* cache_salt: a non-empty string (any bytes, NUL included) that keeps a tenant's cached prefixes apart. */
static enum kr_status parse_cache_salt(struct kr_oai_request *r, struct kr_oai_error *e)
{
    json_t *v = opt_get(r->root, "cache_salt");
    if (!v) {
        return KR_OK;
    }
    if (!json_is_string(v) || json_string_length(v) == 0) {
        return bad(e, "cache_salt", "'cache_salt' must be a non-empty string");
    }
    r->cache_salt = json_string_value(v);
    r->cache_salt_len = json_string_length(v);
    return KR_OK;
}

/* A number in [lo, hi] (lo_open/hi_open exclude the bound; hi = INFINITY for none). Integers are
 * accepted where floats are expected; booleans and strings are not. */
static enum kr_status opt_float(const json_t *obj, const char *key, double lo, bool lo_open, double hi,
                                bool hi_open, float *out, struct kr_oai_error *e)
{
    json_t *v = opt_get(obj, key);
    if (!v) {
        return KR_OK;
    }
    if (!json_is_number(v)) {
        return bad(e, key, "'%s' must be a number", key);
    }
    double d = json_number_value(v);
    bool ok = isfinite(d) && (lo_open ? d > lo : d >= lo) && (hi_open ? d < hi : d <= hi);
    if (!ok) {
        if (isinf(hi)) {
            return bad(e, key, "'%s' must be %s %g, got %g", key, lo_open ? "greater than" : "at least", lo,
                       d);
        }
        return bad(e, key, "'%s' must be in %c%g, %g%c, got %g", key, lo_open ? '(' : '[', lo, hi,
                   hi_open ? ')' : ']', d);
    }
    *out = (float)d;
    return KR_OK;
}

/* An integer in [lo, hi]. Reals with an integral value (5.0) are accepted, as pydantic does. */
static enum kr_status opt_int(const json_t *obj, const char *key, const char *param, int64_t lo, int64_t hi,
                              int64_t *out, bool *present, struct kr_oai_error *e)
{
    json_t *v = opt_get(obj, key);
    if (present) {
        *present = false;
    }
    if (!v) {
        return KR_OK;
    }
    int64_t x;
    if (json_is_integer(v)) {
        x = (int64_t)json_integer_value(v);
    } else if (json_is_real(v)) {
        double d = json_real_value(v);
        /* 2^63 is exact in double; anything at or beyond it does not fit in int64 */
        if (!(d == floor(d)) || d >= 9223372036854775808.0 || d < -9223372036854775808.0) {
            return bad(e, param, "'%s' must be an integer", param);
        }
        x = (int64_t)d;
    } else {
        return bad(e, param, "'%s' must be an integer", param);
    }
    if (x < lo || x > hi) {
        if (hi == INT64_MAX) {
            return bad(e, param, "'%s' must be at least %lld, got %lld", param, (long long)lo, (long long)x);
        }
        return bad(e, param, "'%s' must be between %lld and %lld, got %lld", param, (long long)lo,
                   (long long)hi, (long long)x);
    }
    *out = x;
    if (present) {
        *present = true;
    }
    return KR_OK;
}

/* A token id: an integer in [0, INT32_MAX] (the vocabulary bound is checked by the server). */
static enum kr_status token_id(const json_t *v, const char *param, int32_t *out, struct kr_oai_error *e)
{
    if (!json_is_integer(v)) {
        return bad(e, param, "'%s' must be an integer token id", param);
    }
    json_int_t x = json_integer_value(v);
    if (x < 0 || x > INT32_MAX) {
        return bad(e, param, "'%s' must be a token id >= 0, got %lld", param, (long long)x);
    }
    *out = (int32_t)x;
    return KR_OK;
}

/* ---- request parsing: completions prompt ----------------------------------------------------- */

static enum kr_status prompt_text(struct kr_oai_prompt *p, const json_t *v, struct kr_oai_error *e)
{
    size_t n = json_string_length(v);
    p->text = kr_malloc(n + 1);
    if (!p->text) {
        return oom(e);
    }
    memcpy(p->text, json_string_value(v), n);
    p->text[n] = 0;
    p->text_len = n;
    return KR_OK;
}

/* An array of token ids (`param` names it): non-empty, as vLLM requires. */
static enum kr_status prompt_ids(struct kr_oai_prompt *p, const json_t *arr, const char *param,
                                 struct kr_oai_error *e)
{
    size_t n = json_array_size(arr);
    if (n == 0) {
        return bad(e, param, "'%s' must not be an empty token list", param);
    }
    if (n > INT32_MAX) {
        return bad(e, param, "'%s' is too long", param);
    }
    p->ids = kr_malloc(n * sizeof *p->ids);
    if (!p->ids) {
        return oom(e);
    }
    p->n_ids = (int32_t)n;
    for (size_t i = 0; i < n; i++) {
        char path[64];
        pathf(path, sizeof path, "%s[%zu]", param, i);
        enum kr_status st = token_id(json_array_get(arr, i), path, &p->ids[i], e);
        if (st != KR_OK) {
            return st;
        }
    }
    return KR_OK;
}

/* prompt: string | array of strings | array of ints | array of arrays of ints. */
static enum kr_status parse_prompt(struct kr_oai_request *r, struct kr_oai_error *e)
{
    json_t *v = opt_get(r->root, "prompt");
    if (!v) {
        return bad(e, "prompt", "Missing required parameter: 'prompt'");
    }
    if (json_is_string(v)) {
        r->prompts = kr_calloc(1, sizeof *r->prompts);
        if (!r->prompts) {
            return oom(e);
        }
        r->n_prompts = 1;
        return prompt_text(&r->prompts[0], v, e);
    }
    if (!json_is_array(v)) {
        return bad(e, "prompt",
                   "'prompt' must be a string, an array of strings, an array of token ids or an array "
                   "of token id arrays");
    }
    size_t n = json_array_size(v);
    if (n == 0) {
        return bad(e, "prompt", "'prompt' must not be an empty array");
    }
    if (n > INT32_MAX) {
        return bad(e, "prompt", "'prompt' is too long");
    }
    json_t *first = json_array_get(v, 0);
    if (json_is_integer(first)) {
        /* one prompt given as token ids */
        r->prompts = kr_calloc(1, sizeof *r->prompts);
        if (!r->prompts) {
            return oom(e);
        }
        r->n_prompts = 1;
        return prompt_ids(&r->prompts[0], v, "prompt", e);
    }
    /* a batch: every item a string, or every item a token-id array (the first item decides) */
    if (n > OAI_MAX_PROMPTS) {
        return bad(e, "prompt", "a prompt batch accepts at most %d prompts, got %zu", OAI_MAX_PROMPTS, n);
    }
    bool strings = json_is_string(first);
    r->prompts = kr_calloc(n, sizeof *r->prompts);
    if (!r->prompts) {
        return oom(e);
    }
    r->n_prompts = (int32_t)n;
    for (size_t i = 0; i < n; i++) {
        json_t *item = json_array_get(v, i);
        char path[64];
        pathf(path, sizeof path, "prompt[%zu]", i);
        enum kr_status st;
        if (strings && json_is_string(item)) {
            st = prompt_text(&r->prompts[i], item, e);
        } else if (!strings && json_is_array(item)) {
            st = prompt_ids(&r->prompts[i], item, path, e);
        } else if (strings) {
            st = bad(e, path, "'%s' must be a string (all items of a prompt batch share one type)", path);
        } else {
            st = bad(e, path, "'%s' must be an array of token ids", path);
        }
        if (st != KR_OK) {
            return st;
        }
    }
    return KR_OK;
}

/* ---- request parsing: chat messages and tools ------------------------------------------------ */

static bool role_known(const char *role)
{
    static const char *const roles[] = {"system", "user", "assistant", "tool", "developer"};
    for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++) {
        if (strcmp(role, roles[i]) == 0) {
            return true;
        }
    }
    return false;
}

/* An optional string member `key` of `obj`, whose path is "<base>.<key>". */
static enum kr_status opt_member_string(const json_t *obj, const char *base, const char *key,
                                        struct kr_oai_error *e)
{
    json_t *v = opt_get(obj, key);
    if (v && !json_is_string(v)) {
        char path[64];
        pathf(path, sizeof path, "%s.%s", base, key);
        return bad(e, path, "'%s' must be a string", path);
    }
    return KR_OK;
}

/* content: string | array of {"type": "text", "text": string}. */
static enum kr_status parse_content(const json_t *content, const char *base, struct kr_oai_error *e)
{
    char path[64];
    pathf(path, sizeof path, "%s.content", base);
    if (json_is_string(content)) {
        return KR_OK;
    }
    if (!json_is_array(content)) {
        return bad(e, path, "'%s' must be a string or an array of content parts", path);
    }
    for (size_t j = 0; j < json_array_size(content); j++) {
        json_t *part = json_array_get(content, j);
        char ppath[64];
        pathf(ppath, sizeof ppath, "%s[%zu]", path, j);
        if (!json_is_object(part)) {
            return bad(e, ppath, "'%s' must be an object", ppath);
        }
        json_t *type = json_object_get(part, "type");
        char tpath[64];
        pathf(tpath, sizeof tpath, "%s.type", ppath);
        if (!type || json_is_null(type)) {
            return bad(e, tpath, "Missing required parameter: '%s'", tpath);
        }
        if (!json_is_string(type)) {
            return bad(e, tpath, "'%s' must be a string", tpath);
        }
        if (strcmp(json_string_value(type), "text") != 0) {
            return bad(e, tpath, "Invalid value: '%.64s'. Only 'text' content parts are supported",
                       json_string_value(type));
        }
        json_t *text = json_object_get(part, "text");
        pathf(tpath, sizeof tpath, "%s.text", ppath);
        if (!text || json_is_null(text)) {
            return bad(e, tpath, "Missing required parameter: '%s'", tpath);
        }
        if (!json_is_string(text)) {
            return bad(e, tpath, "'%s' must be a string", tpath);
        }
    }
    return KR_OK;
}

/* An assistant message's tool_calls: [{id?, type?, function: {name, arguments?}}]. */
static enum kr_status parse_tool_calls(const json_t *calls, const char *base, struct kr_oai_error *e)
{
    char path[64];
    pathf(path, sizeof path, "%s.tool_calls", base);
    if (!json_is_array(calls)) {
        return bad(e, path, "'%s' must be an array", path);
    }
    for (size_t j = 0; j < json_array_size(calls); j++) {
        json_t *c = json_array_get(calls, j);
        char cpath[64], fpath[64];
        pathf(cpath, sizeof cpath, "%s[%zu]", path, j);
        if (!json_is_object(c)) {
            return bad(e, cpath, "'%s' must be an object", cpath);
        }
        enum kr_status st;
        if ((st = opt_member_string(c, cpath, "id", e)) != KR_OK ||
            (st = opt_member_string(c, cpath, "type", e)) != KR_OK) {
            return st;
        }
        json_t *fn = opt_get(c, "function");
        pathf(fpath, sizeof fpath, "%s.function", cpath);
        if (!json_is_object(fn)) {
            return fn ? bad(e, fpath, "'%s' must be an object", fpath)
                      : bad(e, fpath, "Missing required parameter: '%s'", fpath);
        }
        json_t *name = opt_get(fn, "name");
        if (!json_is_string(name)) {
            char npath[64];
            pathf(npath, sizeof npath, "%s.name", fpath);
            return name ? bad(e, npath, "'%s' must be a string", npath)
                        : bad(e, npath, "Missing required parameter: '%s'", npath);
        }
        /* arguments: a JSON-encoded string per OpenAI; chat templates also accept an object */
        json_t *args = opt_get(fn, "arguments");
        if (args && !json_is_string(args) && !json_is_object(args)) {
            char apath[64];
            pathf(apath, sizeof apath, "%s.arguments", fpath);
            return bad(e, apath, "'%s' must be a string", apath);
        }
    }
    return KR_OK;
}

static enum kr_status parse_messages(struct kr_oai_request *r, struct kr_oai_error *e)
{
    json_t *msgs = opt_get(r->root, "messages");
    if (!msgs) {
        return bad(e, "messages", "Missing required parameter: 'messages'");
    }
    if (!json_is_array(msgs)) {
        return bad(e, "messages", "'messages' must be an array");
    }
    if (json_array_size(msgs) == 0) {
        return bad(e, "messages", "'messages' must contain at least one message");
    }
    if (json_array_size(msgs) > OAI_MAX_MESSAGES) {
        return bad(e, "messages", "'messages' accepts at most %d messages, got %zu", OAI_MAX_MESSAGES,
                   json_array_size(msgs));
    }
    for (size_t i = 0; i < json_array_size(msgs); i++) {
        json_t *m = json_array_get(msgs, i);
        char base[64], path[64];
        pathf(base, sizeof base, "messages[%zu]", i);
        if (!json_is_object(m)) {
            return bad(e, base, "'%s' must be an object", base);
        }
        json_t *role = opt_get(m, "role");
        pathf(path, sizeof path, "%s.role", base);
        if (!role) {
            return bad(e, path, "Missing required parameter: '%s'", path);
        }
        if (!json_is_string(role)) {
            return bad(e, path, "'%s' must be a string", path);
        }
        const char *rs = json_string_value(role);
        if (!role_known(rs) || strlen(rs) != json_string_length(role)) { /* "user\u0000x" is no role */
            return bad(
                e, path,
                "Invalid value: '%.64s'. Supported values are: 'system', 'assistant', 'user', 'tool', and "
                "'developer'",
                rs);
        }
        bool assistant = strcmp(rs, "assistant") == 0;
        json_t *content = opt_get(m, "content");
        enum kr_status st;
        if (content) {
            if ((st = parse_content(content, base, e)) != KR_OK) {
                return st;
            }
        } else if (!assistant) {
            /* only an assistant message may omit content (when it carries tool_calls) */
            pathf(path, sizeof path, "%s.content", base);
            return bad(e, path, "Missing required parameter: '%s'", path);
        }
        if ((st = opt_member_string(m, base, "name", e)) != KR_OK ||
            (st = opt_member_string(m, base, "tool_call_id", e)) != KR_OK) {
            return st;
        }
        json_t *calls = opt_get(m, "tool_calls");
        if (calls && (st = parse_tool_calls(calls, base, e)) != KR_OK) {
            return st;
        }
    }
    r->messages = msgs;
    return KR_OK;
}

static enum kr_status parse_tools(struct kr_oai_request *r, struct kr_oai_error *e)
{
    json_t *tools = opt_get(r->root, "tools");
    if (tools) {
        if (!json_is_array(tools)) {
            return bad(e, "tools", "'tools' must be an array");
        }
        if (json_array_size(tools) > OAI_MAX_TOOLS) {
            return bad(e, "tools", "'tools' accepts at most %d tools, got %zu", OAI_MAX_TOOLS, json_array_size(tools));
        }
        for (size_t i = 0; i < json_array_size(tools); i++) {
            json_t *t = json_array_get(tools, i);
            char path[64], fpath[64], npath[64];
            pathf(path, sizeof path, "tools[%zu]", i);
            if (!json_is_object(t)) {
                return bad(e, path, "'%s' must be an object", path);
            }
            enum kr_status st = opt_member_string(t, path, "type", e);
            if (st != KR_OK) {
                return st;
            }
            json_t *fn = opt_get(t, "function");
            pathf(fpath, sizeof fpath, "%s.function", path);
            if (!json_is_object(fn)) {
                return fn ? bad(e, fpath, "'%s' must be an object", fpath)
                          : bad(e, fpath, "Missing required parameter: '%s'", fpath);
            }
            json_t *name = opt_get(fn, "name");
            pathf(npath, sizeof npath, "%s.name", fpath);
            if (!json_is_string(name)) {
                return name ? bad(e, npath, "'%s' must be a string", npath)
                            : bad(e, npath, "Missing required parameter: '%s'", npath);
            }
            if (!kr_tool_name_valid(json_string_value(name), json_string_length(name))) {
                return bad(e, npath, "Invalid '%s': '%.64s'. A function name is 1 to 64 characters of a-z, A-Z, 0-9, "
                           "underscores and dashes", npath, json_string_value(name));
            }
            if ((st = opt_member_string(fn, fpath, "description", e)) != KR_OK) {
                return st;
            }
            json_t *params = opt_get(fn, "parameters");
            if (params && !json_is_object(params)) {
                pathf(npath, sizeof npath, "%s.parameters", fpath);
                return bad(e, npath, "'%s' must be an object", npath);
            }
        }
        r->tools = tools;
    }
    json_t *ptc = opt_get(r->root, "parallel_tool_calls");
    if (ptc && !json_is_boolean(ptc)) {
        return bad(e, "parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
    }
    r->parallel_tool_calls = !ptc || json_is_true(ptc);
    /* tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}};
     * auto without tools is none */
    r->tool_choice = r->tools && json_array_size(r->tools) ? KR_OAI_TOOL_AUTO : KR_OAI_TOOL_NONE;
    json_t *tc = opt_get(r->root, "tool_choice");
    if (!tc) {
        return KR_OK;
    }
    if (json_is_string(tc)) {
        const char *s = json_string_value(tc);
        if (strcmp(s, "none") != 0 && strcmp(s, "auto") != 0 && strcmp(s, "required") != 0) {
            return bad(e, "tool_choice",
                       "Invalid value: '%.64s'. Supported values are: 'none', 'auto', and 'required'", s);
        }
        if (!strcmp(s, "none")) {
            r->tool_choice = KR_OAI_TOOL_NONE;
        } else if (!strcmp(s, "required")) {
            if (r->tool_choice == KR_OAI_TOOL_NONE) {
                return bad(e, "tool_choice", "'tool_choice' 'required' needs a non-empty 'tools'");
            }
            r->tool_choice = KR_OAI_TOOL_REQUIRED;
        }
        return KR_OK;
    }
    if (!json_is_object(tc)) {
        return bad(e, "tool_choice", "'tool_choice' must be a string or an object");
    }
    json_t *fn = opt_get(tc, "function");
    if (!json_is_object(fn)) {
        return fn ? bad(e, "tool_choice.function", "'tool_choice.function' must be an object")
                  : bad(e, "tool_choice.function", "Missing required parameter: 'tool_choice.function'");
    }
    json_t *name = opt_get(fn, "name");
    if (!json_is_string(name)) {
        return name ? bad(e, "tool_choice.function.name", "'tool_choice.function.name' must be a string")
                    : bad(e, "tool_choice.function.name",
                          "Missing required parameter: 'tool_choice.function.name'");
    }
    json_t *type = opt_get(tc, "type");
    if (type && (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0)) {
        return bad(e, "tool_choice.type", "'tool_choice.type' must be 'function'");
    }
    for (size_t i = 0; i < json_array_size(r->tools); i++) {
        if (json_equal(json_object_get(json_object_get(json_array_get(r->tools, i), "function"), "name"), name)) {
            r->tool_choice = KR_OAI_TOOL_NAMED;
            r->tool_name = json_string_value(name);
            return KR_OK;
        }
    }
    return bad(e, "tool_choice.function.name", "'tool_choice.function.name': no function named '%.64s' is in 'tools'",
               json_string_value(name));
}

/* ---- request parsing: common fields ---------------------------------------------------------- */

static enum kr_status parse_stop(struct kr_oai_request *r, struct kr_oai_error *e)
{
    json_t *v = opt_get(r->root, "stop");
    if (!v) {
        return KR_OK;
    }
    size_t n;
    if (json_is_string(v)) {
        n = 1;
    } else if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > OAI_MAX_STOP) {
            return bad(e, "stop", "'stop' accepts at most %d sequences, got %zu", OAI_MAX_STOP, n);
        }
    } else {
        return bad(e, "stop", "'stop' must be a string or an array of strings");
    }
    if (n == 0) {
        return KR_OK;
    }
    r->stop = kr_calloc(n, sizeof *r->stop);
    if (!r->stop) {
        return oom(e);
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_is_string(v) ? v : json_array_get(v, i);
        char path[64];
        if (json_is_string(v)) {
            pathf(path, sizeof path, "stop");
        } else {
            pathf(path, sizeof path, "stop[%zu]", i);
        }
        if (!json_is_string(s)) {
            return bad(e, path, "'%s' must be a string", path);
        }
        size_t len = json_string_length(s);
        if (len == 0) {
            return bad(e, path, "'%s' must not be an empty string", path); /* vLLM rejects "" */
        }
        if (strlen(json_string_value(s)) != len) {
            return bad(e, path, "'%s' must not contain NUL characters", path);
        }
        r->stop[i] = kr_strndup(json_string_value(s), len);
        if (!r->stop[i]) {
            return oom(e);
        }
        r->n_stop = (int32_t)(i + 1);
    }
    return KR_OK;
}

static enum kr_status parse_stop_ids(struct kr_oai_request *r, struct kr_oai_error *e)
{
    json_t *v = opt_get(r->root, "stop_token_ids");
    if (!v) {
        return KR_OK;
    }
    if (!json_is_array(v)) {
        return bad(e, "stop_token_ids", "'stop_token_ids' must be an array of integers");
    }
    size_t n = json_array_size(v);
    if (n > KR_MAX_STOP_IDS) {
        return bad(e, "stop_token_ids", "'stop_token_ids' accepts at most %d ids, got %zu", KR_MAX_STOP_IDS,
                   n);
    }
    for (size_t i = 0; i < n; i++) {
        char path[64];
        pathf(path, sizeof path, "stop_token_ids[%zu]", i);
        enum kr_status st = token_id(json_array_get(v, i), path, &r->sampling.stop_ids[i], e);
        if (st != KR_OK) {
            return st;
        }
    }
    r->sampling.n_stop_ids = (int32_t)n;
    return KR_OK;
}

/* logit_bias: {"token id": bias in [-100, 100], ...} (OpenAI: keys are token ids as strings). Ids
 * are checked against the vocabulary by the engine. */
static enum kr_status parse_logit_bias(struct kr_oai_request *r, struct kr_oai_error *e)
{
    const json_t *v = json_object_get(r->root, "logit_bias");
    if (!v || json_is_null(v)) {
        return KR_OK;
    }
    if (!json_is_object(v)) {
        return bad(e, "logit_bias", "'logit_bias' must be an object mapping token ids to biases");
    }
    if (json_object_size(v) > KR_MAX_LOGIT_BIAS) {
        return bad(e, "logit_bias", "'logit_bias' accepts at most %d tokens, got %zu", KR_MAX_LOGIT_BIAS,
                   json_object_size(v));
    }
    struct kr_sampling *s = &r->sampling;
    const char *key;
    json_t *val;
    int32_t n = 0;
    json_object_foreach((json_t *)v, key, val)
    {
        char *end = NULL;
        errno = 0;
        const long long id = strtoll(key, &end, 10);
        if (!*key || *end || errno || id < 0 || id > INT32_MAX) {
            return bad(e, "logit_bias", "'logit_bias' keys must be token ids, got \"%.64s\"", key);
        }
        if (!json_is_number(val)) {
            return bad(e, "logit_bias", "'logit_bias[\"%.64s\"]' must be a number", key);
        }
        const double b = json_number_value(val);
        if (!(b >= -100.0 && b <= 100.0)) {
            return bad(e, "logit_bias", "'logit_bias[\"%.64s\"]' must be between -100 and 100, got %g", key, b);
        }
        s->bias_ids[n] = (int32_t)id;
        s->bias[n++] = (float)b;
    }
    s->n_bias = n;
    return KR_OK;
}

/* Fields krait does not implement are refused with a 400 naming them rather than ignored, where
 * ignoring would change what the client gets: a non-empty suffix (no insertion), best_of beyond n
 * (no best-of-n ranking). */
/* Fields of OpenAI's API or vLLM's that krait does not implement. Silently ignoring one would
 * answer something other than what was asked (audio that never comes, a tier never applied), so
 * any value that asks for more than the default is a 400 naming the field. */
enum unimpl_rule {
    UNIMPL_ANY,      /* any value (but null) */
    UNIMPL_TRUE,     /* true */
    UNIMPL_NONEMPTY, /* a non-empty array or object (an empty one asks for nothing) */
    UNIMPL_NOT_NUM,  /* a number other than `num` (or anything not a number) */
};

static const struct {
    const char *name;
    enum unimpl_rule rule;
    double num;
    bool chat_only;
    const char *why;
} k_unimplemented[] = {
    {"service_tier", UNIMPL_ANY, 0, false, "there is one processing tier"},
    {"reasoning_effort", UNIMPL_ANY, 0, false, "the model's reasoning is not configurable"},
    {"audio", UNIMPL_ANY, 0, false, "audio output is not available"},
    {"prediction", UNIMPL_ANY, 0, false, "predicted outputs are not available"},
    {"web_search_options", UNIMPL_ANY, 0, false, "web search is not available"},
    {"store", UNIMPL_TRUE, 0, false, "completions are not stored"},
    {"use_beam_search", UNIMPL_TRUE, 0, false, "beam search is not available"},
    {"length_penalty", UNIMPL_NOT_NUM, 1.0, false, "it applies to beam search, which is not available"},
    {"include_stop_str_in_output", UNIMPL_TRUE, 0, false, "stop strings are always left out"},
    {"truncate_prompt_tokens", UNIMPL_ANY, 0, false, "prompts are never truncated"},
    {"allowed_token_ids", UNIMPL_ANY, 0, false, "use 'logit_bias' or structured outputs"},
    {"bad_words", UNIMPL_NONEMPTY, 0, false, "use 'logit_bias' or structured outputs"},
    {"logits_processors", UNIMPL_ANY, 0, false, "custom logits processors are not available"},
    {"priority", UNIMPL_NOT_NUM, 0.0, false, "requests are served first come, first served"},
    {"kv_transfer_params", UNIMPL_ANY, 0, false, "KV transfer is not available"},
    {"prompt_embeds", UNIMPL_ANY, 0, false, "prompts are text or token ids"},
    {"chat_template", UNIMPL_ANY, 0, true, "the server's chat template (--chat-template) is used"},
    {"echo", UNIMPL_TRUE, 0, true, "chat echo is not available"},
};

/* modalities: ["text"] (or empty) is what krait does; anything else (OpenAI's "audio") is refused. */
static enum kr_status refuse_modalities(const json_t *v, struct kr_oai_error *e)
{
    if (!json_is_array(v)) {
        return bad(e, "modalities", "'modalities' must be an array of strings");
    }
    size_t i;
    json_t *m;
    json_array_foreach(v, i, m)
    {
        if (!json_is_string(m)) {
            return bad(e, "modalities", "'modalities' must be an array of strings");
        }
        if (strcmp(json_string_value(m), "text") != 0) {
            return bad(e, "modalities", "'modalities' may only hold \"text\": the %.32s modality is not supported",
                       json_string_value(m));
        }
    }
    return KR_OK;
}

static enum kr_status refuse_unimplemented(const struct kr_oai_request *r, struct kr_oai_error *e)
{
    json_t *m = opt_get(r->root, "modalities");
    if (m) {
        const enum kr_status st = refuse_modalities(m, e);
        if (st != KR_OK) {
            return st;
        }
    }
    for (size_t i = 0; i < sizeof k_unimplemented / sizeof k_unimplemented[0]; i++) {
        const char *name = k_unimplemented[i].name;
        json_t *v = opt_get(r->root, name);
        if (!v || (k_unimplemented[i].chat_only && r->kind != KR_OAI_CHAT)) {
            continue;
        }
        bool asks;
        switch (k_unimplemented[i].rule) {
        case UNIMPL_TRUE:
            asks = !json_is_false(v);
            break;
        case UNIMPL_NONEMPTY:
            asks = !((json_is_array(v) && json_array_size(v) == 0) || (json_is_object(v) && json_object_size(v) == 0));
            break;
        case UNIMPL_NOT_NUM:
            asks = !json_is_number(v) || json_number_value(v) != k_unimplemented[i].num;
            break;
        case UNIMPL_ANY:
        default:
            asks = true;
            break;
        }
        if (asks) {
            return bad(e, name, "'%s' is not supported: %s", name, k_unimplemented[i].why);
        }
    }
    return KR_OK;
}

static enum kr_status parse_unsupported(struct kr_oai_request *r, struct kr_oai_error *e)
{
    const json_t *o = r->root;
    const char *suffix = NULL;
    enum kr_status st = opt_string(o, "suffix", "suffix", &suffix, e);
    if (st != KR_OK) {
        return st;
    }
    if (suffix && *suffix) {
        return bad(e, "suffix", "'suffix' is not supported");
    }
    int64_t best_of;
    bool has;
    if ((st = opt_int(o, "best_of", "best_of", 1, OAI_MAX_N, &best_of, &has, e)) != KR_OK) {
        return st;
    }
    if (has && best_of > r->n) {
        return bad(e, "best_of", "'best_of' greater than 'n' (%d) is not supported", r->n);
    }
    return refuse_unimplemented(r, e);
}

/* ---- request parsing: output constraints (structured outputs) --------------------------------- */

#define OAI_MAX_CHOICES 4096 /* guided_choice strings (each a branch of one grammar rule) */

/* Sets the request's constraint from the field `param`, or refuses a second one naming both. text
 * (len bytes) is copied; NULL for json_object. */
static enum kr_status set_constraint(struct kr_oai_request *r, const char *param, enum kr_grammar_kind kind,
                                     const char *text, size_t len, struct kr_oai_error *e)
{
    struct kr_oai_constraint *c = &r->constraint;
    if (c->on) {
        return bad(e, param, "'%s' and '%s' cannot be used together: a request takes one output constraint",
                   c->param, param);
    }
    if (text) {
        c->text = kr_strndup(text, len);
        if (!c->text) {
            return oom(e);
        }
        c->len = len;
    }
    c->on = true;
    c->kind = kind;
    snprintf(c->param, sizeof c->param, "%s", param);
    return KR_OK;
}

/* Sets the constraint to JSON value v written compactly (a schema, or a list of choices): members
 * keep their order, which a schema's properties follow. */
static enum kr_status set_constraint_json(struct kr_oai_request *r, const char *param, enum kr_grammar_kind kind,
                                          const json_t *v, struct kr_oai_error *e)
{
    char *text = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!text) {
        return oom(e);
    }
    const enum kr_status st = set_constraint(r, param, kind, text, strlen(text), e);
    kr_oai_free(text);
    return st;
}

/* A string constraint (regex, grammar, schema text): non-empty and without NUL, which no pattern
 * needs (a regex writes it \0 or \x00) and which would cut the text short where it is printed. */
static enum kr_status constraint_string(struct kr_oai_request *r, const json_t *v, const char *param,
                                        enum kr_grammar_kind kind, struct kr_oai_error *e)
{
    if (!json_is_string(v)) {
        return bad(e, param, "'%s' must be a string", param);
    }
    if (json_string_length(v) == 0) {
        return bad(e, param, "'%s' must not be empty", param);
    }
    if (strlen(json_string_value(v)) != json_string_length(v)) {
        return bad(e, param, "'%s' must not contain NUL characters", param);
    }
    return set_constraint(r, param, kind, json_string_value(v), json_string_length(v), e);
}

/* A JSON Schema given as an object, or as a string holding one (vLLM accepts both for guided_json). */
static enum kr_status constraint_schema(struct kr_oai_request *r, const json_t *v, const char *param,
                                        struct kr_oai_error *e)
{
    if (json_is_string(v)) {
        return constraint_string(r, v, param, KR_GRAMMAR_JSON_SCHEMA, e);
    }
    if (!json_is_object(v)) {
        return bad(e, param, "'%s' must be a JSON Schema: an object, or a string holding one", param);
    }
    return set_constraint_json(r, param, KR_GRAMMAR_JSON_SCHEMA, v, e);
}

/* guided_choice / structured_outputs.choice: a non-empty list of strings. */
static enum kr_status constraint_choice(struct kr_oai_request *r, const json_t *v, const char *param,
                                        struct kr_oai_error *e)
{
    if (!json_is_array(v) || json_array_size(v) == 0) {
        return bad(e, param, "'%s' must be a non-empty list of strings", param);
    }
    if (json_array_size(v) > OAI_MAX_CHOICES) {
        return bad(e, param, "'%s' accepts at most %d strings, got %zu", param, OAI_MAX_CHOICES, json_array_size(v));
    }
    for (size_t i = 0; i < json_array_size(v); i++) {
        if (!json_is_string(json_array_get(v, i))) {
            char path[64];
            pathf(path, sizeof path, "%s[%zu]", param, i);
            return bad(e, path, "'%s' must be a string", path);
        }
    }
    return set_constraint_json(r, param, KR_GRAMMAR_CHOICE, v, e);
}

/* response_format: {"type": "text"} (nothing), {"type": "json_object"}, or {"type": "json_schema",
 * "json_schema": {"name", "schema", "strict", "description"}} (OpenAI's shape; strict or not, the
 * schema is enforced: a constrained decoder has no best effort to fall back to). */
static enum kr_status parse_response_format(struct kr_oai_request *r, struct kr_oai_error *e)
{
    const json_t *rf = opt_get(r->root, "response_format");
    if (!rf) {
        return KR_OK;
    }
    const json_t *t = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
    if (!t || !json_is_string(t)) {
        return bad(e, "response_format", "'response_format' must be an object with a string 'type'");
    }
    const char *type = json_string_value(t);
    if (strcmp(type, "text") == 0) {
        return KR_OK;
    }
    if (strcmp(type, "json_object") == 0) {
        return set_constraint(r, "response_format", KR_GRAMMAR_JSON_OBJECT, NULL, 0, e);
    }
    if (strcmp(type, "json_schema") != 0) {
        return bad(e, "response_format.type",
                   "response_format type '%.32s' is not supported; use 'text', 'json_object' or 'json_schema'", type);
    }
    const json_t *js = opt_get(rf, "json_schema");
    if (!js) {
        return bad(e, "response_format.json_schema", "Missing required parameter: 'response_format.json_schema'");
    }
    if (!json_is_object(js)) {
        return bad(e, "response_format.json_schema", "'response_format.json_schema' must be an object");
    }
    const json_t *name = opt_get(js, "name");
    if (!name) {
        return bad(e, "response_format.json_schema.name",
                   "Missing required parameter: 'response_format.json_schema.name'");
    }
    const size_t nl = json_is_string(name) ? json_string_length(name) : 0;
    const char *nv = json_is_string(name) ? json_string_value(name) : "";
    bool name_ok = nl >= 1 && nl <= 64;
    for (size_t i = 0; name_ok && i < nl; i++) { /* OpenAI: a-z, A-Z, 0-9, underscores and dashes */
        const char ch = nv[i];
        name_ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                  ch == '-';
    }
    if (!name_ok) {
        return bad(e, "response_format.json_schema.name",
                   "'response_format.json_schema.name' must be 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'");
    }
    bool strict = false;
    enum kr_status st = opt_bool(js, "strict", "response_format.json_schema.strict", &strict, NULL, e);
    if (st != KR_OK ||
        (st = opt_member_string(js, "response_format.json_schema", "description", e)) != KR_OK) {
        return st;
    }
    const json_t *schema = opt_get(js, "schema");
    if (!schema) {
        return bad(e, "response_format.json_schema.schema",
                   "Missing required parameter: 'response_format.json_schema.schema'");
    }
    if (!json_is_object(schema)) {
        return bad(e, "response_format.json_schema.schema", "'response_format.json_schema.schema' must be an object");
    }
    return set_constraint_json(r, "response_format", KR_GRAMMAR_JSON_SCHEMA, schema, e);
}

/* vLLM's guided_* fields (its older surface). guided_whitespace_pattern is refused by name: JSON
 * output takes a bounded run of spaces, tabs and newlines in each gap, not a pattern. */
static enum kr_status parse_guided(struct kr_oai_request *r, struct kr_oai_error *e)
{
    const json_t *o = r->root;
    const json_t *v;
    enum kr_status st = KR_OK;
    if ((v = opt_get(o, "guided_json")) && (st = constraint_schema(r, v, "guided_json", e)) != KR_OK) {
        return st;
    }
    if ((v = opt_get(o, "guided_regex")) &&
        (st = constraint_string(r, v, "guided_regex", KR_GRAMMAR_REGEX, e)) != KR_OK) {
        return st;
    }
    if ((v = opt_get(o, "guided_choice")) && (st = constraint_choice(r, v, "guided_choice", e)) != KR_OK) {
        return st;
    }
    if ((v = opt_get(o, "guided_grammar")) &&
        (st = constraint_string(r, v, "guided_grammar", KR_GRAMMAR_GBNF, e)) != KR_OK) {
        return st;
    }
    if (opt_get(o, "guided_whitespace_pattern")) {
        return bad(e, "guided_whitespace_pattern",
                   "'guided_whitespace_pattern' is not supported: JSON output allows up to 24 bytes of space, tab, "
                   "CR and LF in each gap");
    }
    return KR_OK;
}

/* vLLM's structured_outputs object: one of json, regex, choice, grammar, json_object; with
 * disable_any_whitespace (compact JSON) and disable_fallback (there is nothing to fall back to).
 * whitespace_pattern, structural_tag and disable_additional_properties change what is allowed in
 * ways the grammar compiler does not follow: refused by name. */
static enum kr_status parse_structured_outputs(struct kr_oai_request *r, struct kr_oai_error *e)
{
    const json_t *so = opt_get(r->root, "structured_outputs");
    if (!so) {
        return KR_OK;
    }
    if (!json_is_object(so)) {
        return bad(e, "structured_outputs", "'structured_outputs' must be an object");
    }
    static const char *const refused[] = {"whitespace_pattern", "structural_tag"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        if (opt_get(so, refused[i])) {
            char path[64];
            pathf(path, sizeof path, "structured_outputs.%s", refused[i]);
            return bad(e, path, "'%s' is not supported", path);
        }
    }
    bool no_ws = false, no_fallback = false, no_extra = false, json_object = false;
    enum kr_status st;
    if ((st = opt_bool(so, "disable_any_whitespace", "structured_outputs.disable_any_whitespace", &no_ws, NULL, e)) !=
            KR_OK ||
        (st = opt_bool(so, "disable_fallback", "structured_outputs.disable_fallback", &no_fallback, NULL, e)) !=
            KR_OK ||
        (st = opt_bool(so, "disable_additional_properties", "structured_outputs.disable_additional_properties",
                       &no_extra, NULL, e)) != KR_OK ||
        (st = opt_bool(so, "json_object", "structured_outputs.json_object", &json_object, NULL, e)) != KR_OK) {
        return st;
    }
    if (no_extra) {
        return bad(e, "structured_outputs.disable_additional_properties",
                   "'structured_outputs.disable_additional_properties' is not supported: write "
                   "\"additionalProperties\": false in the schema");
    }
    const json_t *v;
    if ((v = opt_get(so, "json")) && (st = constraint_schema(r, v, "structured_outputs.json", e)) != KR_OK) {
        return st;
    }
    if ((v = opt_get(so, "regex")) &&
        (st = constraint_string(r, v, "structured_outputs.regex", KR_GRAMMAR_REGEX, e)) != KR_OK) {
        return st;
    }
    if ((v = opt_get(so, "choice")) && (st = constraint_choice(r, v, "structured_outputs.choice", e)) != KR_OK) {
        return st;
    }
    if ((v = opt_get(so, "grammar")) &&
        (st = constraint_string(r, v, "structured_outputs.grammar", KR_GRAMMAR_GBNF, e)) != KR_OK) {
        return st;
    }
    if (json_object &&
        (st = set_constraint(r, "structured_outputs.json_object", KR_GRAMMAR_JSON_OBJECT, NULL, 0, e)) != KR_OK) {
        return st;
    }
    if (no_ws && r->constraint.on) {
        r->constraint.max_ws = 0;
    }
    return KR_OK;
}

static enum kr_status parse_constraint(struct kr_oai_request *r, struct kr_oai_error *e)
{
    r->constraint.max_ws = -1;
    enum kr_status st;
    if ((st = parse_response_format(r, e)) != KR_OK || (st = parse_guided(r, e)) != KR_OK) {
        return st;
    }
    return parse_structured_outputs(r, e);
}

static enum kr_status parse_sampling(struct kr_oai_request *r, struct kr_oai_error *e)
{
    const json_t *o = r->root;
    struct kr_sampling *s = &r->sampling;
    enum kr_status st;
    if ((st = opt_float(o, "temperature", 0.0, false, 2.0, false, &s->temperature, e)) != KR_OK ||
        (st = opt_float(o, "top_p", 0.0, true, 1.0, false, &s->top_p, e)) != KR_OK ||
        (st = opt_float(o, "min_p", 0.0, false, 1.0, false, &s->min_p, e)) != KR_OK ||
        (st = opt_float(o, "presence_penalty", -2.0, false, 2.0, false, &s->presence_penalty, e)) != KR_OK ||
        (st = opt_float(o, "frequency_penalty", -2.0, false, 2.0, false, &s->frequency_penalty, e)) !=
            KR_OK ||
        (st = opt_float(o, "repetition_penalty", 0.0, true, INFINITY, false, &s->repetition_penalty, e)) !=
            KR_OK) {
        return st;
    }
    int64_t x;
    bool has;
    /* top_k: -1 or 0 = off (vLLM), else >= 1 */
    if ((st = opt_int(o, "top_k", "top_k", -1, INT32_MAX, &x, &has, e)) != KR_OK) {
        return st;
    }
    if (has) {
        s->top_k = (int32_t)x;
    }
    if ((st = opt_int(o, "seed", "seed", INT64_MIN, INT64_MAX, &x, &has, e)) != KR_OK) {
        return st;
    }
    if (has) {
        s->has_seed = true;
        s->seed = (uint64_t)x; /* two's complement: -1 -> 2^64 - 1 */
    }
    /* max_tokens / max_completion_tokens (the newer name wins); values beyond int32 are clamped, the
     * server caps them to the context anyway */
    bool has_mt, has_mct;
    int64_t mt = 0, mct = 0;
    if ((st = opt_int(o, "max_tokens", "max_tokens", 1, INT64_MAX, &mt, &has_mt, e)) != KR_OK ||
        (st = opt_int(o, "max_completion_tokens", "max_completion_tokens", 1, INT64_MAX, &mct, &has_mct,
                      e)) != KR_OK) {
        return st;
    }
    if (has_mt || has_mct) {
        int64_t m = has_mct ? mct : mt;
        s->max_tokens = m > INT32_MAX ? INT32_MAX : (int32_t)m;
        r->max_tokens_given = true;
    }
    if ((st = opt_int(o, "min_tokens", "min_tokens", 0, INT32_MAX, &x, &has, e)) != KR_OK) {
        return st;
    }
    if (has) {
        if (r->max_tokens_given && x > s->max_tokens) {
            return bad(e, "min_tokens", "'min_tokens' (%lld) must be less than or equal to 'max_tokens' (%d)",
                       (long long)x, s->max_tokens);
        }
        s->min_tokens = (int32_t)x;
    }
    if ((st = opt_int(o, "n", "n", 1, OAI_MAX_N, &x, &has, e)) != KR_OK) {
        return st;
    }
    if (has) {
        r->n = (int32_t)x;
    }
    if ((st = opt_bool(o, "ignore_eos", "ignore_eos", &s->ignore_eos, NULL, e)) != KR_OK) {
        return st;
    }
    if ((st = parse_stop(r, e)) != KR_OK || (st = parse_logit_bias(r, e)) != KR_OK) {
        return st;
    }
    return parse_stop_ids(r, e);
}

/* logprobs (completions: integer 0..20; chat: boolean + top_logprobs 0..20) and prompt_logprobs. */
static enum kr_status parse_logprobs(struct kr_oai_request *r, struct kr_oai_error *e)
{
    const json_t *o = r->root;
    struct kr_sampling *s = &r->sampling;
    enum kr_status st;
    int64_t x;
    bool has;
    if (r->kind == KR_OAI_COMPLETIONS) {
        if ((st = opt_int(o, "logprobs", "logprobs", 0, OAI_MAX_LOGPROBS, &x, &has, e)) != KR_OK) {
            return st;
        }
        if (has) {
            s->logprobs = (int32_t)x;
        }
    } else {
        bool lp = false;
        if ((st = opt_bool(o, "logprobs", "logprobs", &lp, NULL, e)) != KR_OK ||
            (st = opt_int(o, "top_logprobs", "top_logprobs", 0, OAI_MAX_LOGPROBS, &x, &has, e)) != KR_OK) {
            return st;
        }
        if (has && !lp) {
            return bad(e, "top_logprobs", "'top_logprobs' is only allowed when 'logprobs' is true");
        }
        if (lp) {
            s->logprobs = has ? (int32_t)x : 0;
        }
    }
    if ((st = opt_int(o, "prompt_logprobs", "prompt_logprobs", 0, OAI_MAX_LOGPROBS, &x, &has, e)) != KR_OK) {
        return st;
    }
    if (has) {
        if (r->stream && x > 0) {
            return bad(e, "prompt_logprobs", "'prompt_logprobs' is not available when 'stream' is true");
        }
        s->prompt_logprobs = (int32_t)x;
    } else if (r->kind == KR_OAI_COMPLETIONS && r->echo && s->logprobs >= 0) {
        s->prompt_logprobs = s->logprobs; /* vLLM: echo with logprobs reports the prompt's too */
    }
    return KR_OK;
}

static enum kr_status parse_stream(struct kr_oai_request *r, struct kr_oai_error *e)
{
    enum kr_status st = opt_bool(r->root, "stream", "stream", &r->stream, NULL, e);
    if (st != KR_OK) {
        return st;
    }
    json_t *so = opt_get(r->root, "stream_options");
    if (!so) {
        return KR_OK;
    }
    if (!json_is_object(so)) {
        return bad(e, "stream_options", "'stream_options' must be an object");
    }
    if (!r->stream) {
        return bad(e, "stream_options",
                   "The 'stream_options' parameter is only allowed when 'stream' is enabled.");
    }
    if ((st = opt_bool(so, "include_usage", "stream_options.include_usage", &r->include_usage, NULL, e)) !=
        KR_OK) {
        return st;
    }
    bool cont = false;
    if ((st = opt_bool(so, "continuous_usage_stats", "stream_options.continuous_usage_stats", &cont, NULL, e)) !=
        KR_OK) {
        return st;
    }
    r->continuous_usage = cont && r->include_usage; /* vLLM: usage on every chunk needs both */
    return KR_OK;
}

static enum kr_status parse_chat_extras(struct kr_oai_request *r, struct kr_oai_error *e)
{
    const json_t *o = r->root;
    enum kr_status st;
    bool agp_given;
    if ((st = opt_bool(o, "add_generation_prompt", "add_generation_prompt", &r->add_generation_prompt,
                       &agp_given, e)) != KR_OK ||
        (st = opt_bool(o, "continue_final_message", "continue_final_message", &r->continue_final_message,
                       NULL, e)) != KR_OK) {
        return st;
    }
    if (r->continue_final_message) {
        if (agp_given && r->add_generation_prompt) {
            return bad(e, "continue_final_message",
                       "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true");
        }
        r->add_generation_prompt = false; /* continuing the last message implies no new turn */
    }
    json_t *kw = opt_get(o, "chat_template_kwargs");
    if (kw) {
        if (!json_is_object(kw)) {
            return bad(e, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
        }
        r->chat_template_kwargs = kw;
    }
    return KR_OK;
}

enum kr_status kr_oai_parse(enum kr_oai_kind kind, const char *body, size_t len, struct kr_oai_request *out,
                            struct kr_oai_error *err)
{
    memset(out, 0, sizeof *out);
    out->kind = kind;
    kr_sampling_default(&out->sampling);
    out->n = 1;
    out->skip_special_tokens = true;
    out->add_generation_prompt = true;

    json_error_t je;
    /* JSON_DECODE_ANY so that a scalar body gets the "must be an object" answer rather than a parse
     * error; JSON_ALLOW_NUL because "\u0000" is valid JSON that OpenAI's parser accepts. */
    bool oom_parse = false;
    out->root = kr_oai_json_loadb(body ? body : "", body ? len : 0, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je, &oom_parse);
    if (!out->root) {
        if (oom_parse) {
            return oom(err);
        }
        return bad(err, "", "malformed JSON: %s at line %d column %d", je.text, je.line, je.column);
    }
    enum kr_status st;
    if (!json_is_object(out->root)) {
        st = bad(err, "", "The request body must be a JSON object");
        goto fail;
    }
    const json_t *o = out->root;
    if (kind == KR_OAI_CHAT) {
        if ((st = parse_messages(out, err)) != KR_OK || (st = parse_tools(out, err)) != KR_OK ||
            (st = parse_chat_extras(out, err)) != KR_OK) {
            goto fail;
        }
    } else {
        if ((st = parse_prompt(out, err)) != KR_OK ||
            (st = opt_bool(o, "echo", "echo", &out->echo, NULL, err)) != KR_OK) {
            goto fail;
        }
    }
    if ((st = opt_string(o, "model", "model", &out->model, err)) != KR_OK ||
        (st = opt_string(o, "user", "user", &out->user, err)) != KR_OK ||
        (st = parse_cache_salt(out, err)) != KR_OK ||
        (st = parse_stream(out, err)) != KR_OK || (st = parse_sampling(out, err)) != KR_OK ||
        (st = parse_logprobs(out, err)) != KR_OK || (st = parse_unsupported(out, err)) != KR_OK ||
        (st = parse_constraint(out, err)) != KR_OK ||
        (st = opt_bool(o, "skip_special_tokens", "skip_special_tokens", &out->skip_special_tokens, NULL,
                       err)) != KR_OK ||
        (st = opt_bool(o, "return_token_ids", "return_token_ids", &out->return_token_ids, NULL, err)) !=
            KR_OK) {
        goto fail;
    }
    return KR_OK;

fail:
    kr_oai_request_free(out);
    return st;
}

void kr_oai_request_free(struct kr_oai_request *r)
{
    if (!r) {
        return;
    }
    for (int32_t i = 0; r->prompts && i < r->n_prompts; i++) {
        kr_free(r->prompts[i].text);
        kr_free(r->prompts[i].ids);
    }
    kr_free(r->prompts);
    for (int32_t i = 0; r->stop && i < r->n_stop; i++) {
        kr_free(r->stop[i]);
    }
    kr_free(r->stop);
    kr_free(r->constraint.text);
    json_decref(r->root);
    memset(r, 0, sizeof *r);
}
