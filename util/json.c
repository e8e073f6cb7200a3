#define _POSIX_C_SOURCE 200809L

#include "json.h"

#include "alloc.h"
#include "file.h"
#include "utf8.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* A recursive-descent parser for RFC 8259 JSON plus the bare tokens `Infinity`, `-Infinity` and
 * `NaN` that Python's json module writes. Strings are decoded to UTF-8 (escapes, surrogate pairs)
 * and raw bytes inside strings must be well-formed UTF-8. Errors name a 1-based line and a 1-based
 * column counted in bytes. */

/* The largest file kr_json_parse_file() reads (config.json and safetensors indexes are far smaller). */
#define KR_JSON_FILE_MAX ((size_t)1 << 30)

/* Nesting limit (arrays and objects together); bounds the recursion depth. */
#define KR_JSON_MAX_DEPTH 256

struct json_parser {
    const char *start; /* first byte of the text (line/column origin) */
    const char *p;     /* next unread byte */
    const char *end;   /* one past the last byte */
    int depth;         /* containers currently open */
    struct kr_err *err;
};

static enum kr_status parse_value(struct json_parser *ps, struct kr_json *v);

/* ---- errors ---------------------------------------------------------------------------------- */

/* Writes "line L column C: <message>" for position `at` into ps->err; returns KR_ERR_FORMAT. */
static enum kr_status parse_error(const struct json_parser *ps, const char *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* 1-based line and byte column of `at`. */
static void position(const struct json_parser *ps, const char *at, size_t *line, size_t *col)
{
    const char *line_start = ps->start;
    *line = 1;
    for (const char *c = ps->start; c < at; c++) {
        if (*c == '\n') {
            (*line)++;
            line_start = c + 1;
        }
    }
    *col = (size_t)(at - line_start) + 1;
}

static enum kr_status parse_error(const struct json_parser *ps, const char *at, const char *fmt, ...)
{
    size_t line, col;
    position(ps, at, &line, &col);
    char what[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return kr_err_set(ps->err, KR_ERR_FORMAT, "line %zu column %zu: %s", line, col, what);
}

static enum kr_status oom_error(const struct json_parser *ps)
{
    return kr_err_set(ps->err, KR_ERR_NOMEM, "out of memory while parsing JSON");
}

/* Describes the byte at `at` for messages: "'x'", "byte 0xNN" or "end of input". `buf` holds >= 16. */
static const char *describe(const struct json_parser *ps, const char *at, char *buf, size_t size)
{
    if (at >= ps->end) {
        return "end of input";
    }
    unsigned char c = (unsigned char)*at;
    if (c >= 0x20 && c < 0x7f) {
        snprintf(buf, size, "'%c'", c);
    } else {
        snprintf(buf, size, "byte 0x%02x", c);
    }
    return buf;
}

/* ---- helpers --------------------------------------------------------------------------------- */

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

static void skip_ws(struct json_parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r')) {
        ps->p++;
    }
}

/* True (and consumes it) when the text at ps->p starts with the ASCII word `w`. */
static bool match_word(struct json_parser *ps, const char *w)
{
    size_t n = strlen(w);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, w, n) != 0) {
        return false;
    }
    ps->p += n;
    return true;
}

/* Frees everything `v` owns (not `v` itself) and leaves it a null value. */
static void free_contents(struct kr_json *v)
{
    switch (v->type) {
    case KR_JSON_STRING:
        kr_free(v->str);
        break;
    case KR_JSON_ARRAY:
    case KR_JSON_OBJECT:
        for (size_t i = 0; i < v->n; i++) {
            free_contents(&v->items[i]);
            if (v->keys) {
                kr_free(v->keys[i]);
            }
        }
        kr_free(v->items);
        kr_free(v->keys);
        break;
    default:
        break;
    }
    memset(v, 0, sizeof *v);
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    if (c >= 'A' && c <= 'F') {
        return c - 'A' + 10;
    }
    return -1;
}

/* Reads the 4 hex digits of a "\uXXXX" escape whose backslash is at `at`, bounded by `lim`; false when
 * they are not all hex digits. */
static bool read_u_escape(const char *at, const char *lim, unsigned *out)
{
    unsigned cp = 0;
    for (int i = 0; i < 4; i++) {
        const char *h = at + 2 + i;
        int d = h < lim ? hex_value(*h) : -1;
        if (d < 0) {
            return false;
        }
        cp = cp << 4 | (unsigned)d;
    }
    *out = cp;
    return true;
}

/* ---- values ---------------------------------------------------------------------------------- */

/* Parses a string at ps->p (which is '"') into a new NUL-terminated buffer (caller frees). */
static enum kr_status parse_string(struct json_parser *ps, char **out, size_t *out_len)
{
    const char *open = ps->p;
    const char *q = open + 1;
    /* Find the closing quote first: the decoded string is never longer than its source text, so
     * one allocation of that size suffices. */
    while (q < ps->end && *q != '"') {
        q += (*q == '\\' && ps->end - q >= 2) ? 2 : 1;
    }
    if (q >= ps->end) {
        size_t line, col;
        position(ps, open, &line, &col);
        return parse_error(ps, ps->end,
                           "expected '\"' to close the string that starts at line %zu column %zu", line, col);
    }
    char *buf = kr_malloc((size_t)(q - open));
    if (!buf) {
        return oom_error(ps);
    }
    enum kr_status st = KR_OK;
    size_t n = 0;
    const char *s = open + 1;
    while (s < q) {
        unsigned char c = (unsigned char)*s;
        if (c == '\\') {
            char e = s[1]; /* s + 1 < q: the scan above skipped escaped bytes in pairs */
            static const char esc[] = "\"\\/bfnrt";       /* after the backslash ... */
            static const char repl[] = "\"\\/\b\f\n\r\t"; /* ... stands for this byte */
            const char *simple = e != 0 ? strchr(esc, e) : NULL;
            if (simple) {
                buf[n++] = repl[simple - esc];
                s += 2;
                continue;
            }
            if (e != 'u') {
                char d[16];
                st =
                    parse_error(ps, s,
                                "invalid escape: backslash followed by %s (expected one of \\\" \\\\ \\/ \\b "
                                "\\f \\n \\r \\t \\uXXXX)",
                                describe(ps, s + 1, d, sizeof d));
                goto fail;
            }
            unsigned cp;
            if (!read_u_escape(s, q, &cp)) {
                st = parse_error(ps, s, "expected 4 hex digits after \\u");
                goto fail;
            }
            if (cp >= 0xdc00 && cp <= 0xdfff) {
                st = parse_error(ps, s,
                                 "lone low surrogate \\u%04X (expected a high surrogate \\uD800-\\uDBFF "
                                 "before it)",
                                 cp);
                goto fail;
            }
            if (cp >= 0xd800 && cp <= 0xdbff) {
                unsigned lo = 0;
                const char *t = s + 6;
                if (q - t < 6 || t[0] != '\\' || t[1] != 'u' || !read_u_escape(t, q, &lo) || lo < 0xdc00 ||
                    lo > 0xdfff) {
                    st = parse_error(ps, s,
                                     "lone high surrogate \\u%04X (expected a low surrogate "
                                     "\\uDC00-\\uDFFF after it)",
                                     cp);
                    goto fail;
                }
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                s += 6;
            }
            n += kr_utf8_put(cp, buf + n);
            s += 6;
        } else if (c < 0x20) {
            st = parse_error(ps, s, "control character 0x%02x in string (expected it escaped)", c);
            goto fail;
        } else if (c < 0x80) {
            buf[n++] = (char)c;
            s++;
        } else {
            size_t len;
            uint32_t ch;
            if (kr_utf8_scan((const unsigned char *)s, (size_t)(q - s), &len, &ch) != KR_UTF8_CHAR) {
                st =
                    parse_error(ps, s, "invalid UTF-8 byte 0x%02x in string (expected well-formed UTF-8)", c);
                goto fail;
            }
            memcpy(buf + n, s, len);
            n += len;
            s += len;
        }
    }
    buf[n] = 0;
    ps->p = q + 1;
    *out = buf;
    *out_len = n;
    return KR_OK;
fail:
    kr_free(buf);
    return st;
}

static enum kr_status parse_number(struct json_parser *ps, struct kr_json *v)
{
    const char *s = ps->p;
    const char *p = s;
    char d[16];
    if (*p == '-') {
        p++;
        ps->p = p;
        if (match_word(ps, "Infinity")) {
            v->type = KR_JSON_NUMBER;
            v->number = -INFINITY;
            return KR_OK;
        }
    }
    if (p >= ps->end || !is_digit(*p)) {
        return parse_error(ps, p, "expected a digit after '-', found %s", describe(ps, p, d, sizeof d));
    }
    if (*p == '0') {
        p++;
        if (p < ps->end && is_digit(*p)) {
            return parse_error(ps, s, "expected a number without leading zeros");
        }
    } else {
        while (p < ps->end && is_digit(*p)) {
            p++;
        }
    }
    bool integral = true;
    if (p < ps->end && *p == '.') {
        integral = false;
        p++;
        if (p >= ps->end || !is_digit(*p)) {
            return parse_error(ps, p, "expected a digit after '.', found %s", describe(ps, p, d, sizeof d));
        }
        while (p < ps->end && is_digit(*p)) {
            p++;
        }
    }
    if (p < ps->end && (*p == 'e' || *p == 'E')) {
        integral = false;
        p++;
        if (p < ps->end && (*p == '+' || *p == '-')) {
            p++;
        }
        if (p >= ps->end || !is_digit(*p)) {
            return parse_error(ps, p, "expected a digit in the exponent, found %s",
                               describe(ps, p, d, sizeof d));
        }
        while (p < ps->end && is_digit(*p)) {
            p++;
        }
    }
    /* strtod/strtoll need a NUL-terminated copy; the text need not be terminated. */
    size_t len = (size_t)(p - s);
    char small[64];
    char *buf = small;
    if (len >= sizeof small) {
        buf = kr_malloc(len + 1);
        if (!buf) {
            return oom_error(ps);
        }
    }
    memcpy(buf, s, len);
    buf[len] = 0;
    v->type = KR_JSON_NUMBER;
    v->number = strtod(buf, NULL); /* out of range: +-HUGE_VAL or 0, as Python does */
    if (integral) {
        errno = 0;
        long long ll = strtoll(buf, NULL, 10);
        if (errno != ERANGE) {
            v->is_int = true;
            v->integer = (int64_t)ll;
        }
    }
    if (buf != small) {
        kr_free(buf);
    }
    ps->p = p;
    return KR_OK;
}

/* Enters a container; fails beyond KR_JSON_MAX_DEPTH levels. */
static enum kr_status enter(struct json_parser *ps)
{
    if (ps->depth >= KR_JSON_MAX_DEPTH) {
        return parse_error(ps, ps->p, "expected at most %d levels of nesting", KR_JSON_MAX_DEPTH);
    }
    ps->depth++;
    return KR_OK;
}

/* Grows a container's arrays to hold at least `need` items (keys too when `keys` is non-NULL). */
static enum kr_status grow(struct json_parser *ps, struct kr_json *v, size_t *cap, size_t need, bool keys)
{
    if (need <= *cap) {
        return KR_OK;
    }
    size_t new_cap = *cap ? *cap * 2 : 4;
    if (new_cap > SIZE_MAX / sizeof(struct kr_json)) {
        return oom_error(ps);
    }
    struct kr_json *items = kr_realloc(v->items, new_cap * sizeof *items);
    if (!items) {
        return oom_error(ps);
    }
    v->items = items;
    if (keys) {
        char **k = kr_realloc(v->keys, new_cap * sizeof *k);
        if (!k) {
            return oom_error(ps); /* items is larger than cap: harmless */
        }
        v->keys = k;
    }
    *cap = new_cap;
    return KR_OK;
}

static enum kr_status parse_array(struct json_parser *ps, struct kr_json *v)
{
    enum kr_status st;
    size_t cap = 0;
    char d[16];
    if ((st = enter(ps)) != KR_OK) {
        return st;
    }
    v->type = KR_JSON_ARRAY;
    ps->p++; /* '[' */
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == ']') {
        ps->p++;
        ps->depth--;
        return KR_OK;
    }
    for (;;) {
        if ((st = grow(ps, v, &cap, v->n + 1, false)) != KR_OK) {
            goto fail;
        }
        memset(&v->items[v->n], 0, sizeof v->items[v->n]);
        if ((st = parse_value(ps, &v->items[v->n])) != KR_OK) {
            goto fail;
        }
        v->n++;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            skip_ws(ps);
            continue;
        }
        if (ps->p < ps->end && *ps->p == ']') {
            ps->p++;
            break;
        }
        st = parse_error(ps, ps->p, "expected ',' or ']' after an array element, found %s",
                         describe(ps, ps->p, d, sizeof d));
        goto fail;
    }
    ps->depth--;
    return KR_OK;
fail:
    free_contents(v);
    return st;
}

static enum kr_status parse_object(struct json_parser *ps, struct kr_json *v)
{
    enum kr_status st;
    size_t cap = 0;
    char d[16];
    if ((st = enter(ps)) != KR_OK) {
        return st;
    }
    v->type = KR_JSON_OBJECT;
    ps->p++; /* '{' */
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == '}') {
        ps->p++;
        ps->depth--;
        return KR_OK;
    }
    for (;;) {
        if (ps->p >= ps->end || *ps->p != '"') {
            st = parse_error(ps, ps->p, "expected '\"' to start an object key, found %s",
                             describe(ps, ps->p, d, sizeof d));
            goto fail;
        }
        if ((st = grow(ps, v, &cap, v->n + 1, true)) != KR_OK) {
            goto fail;
        }
        size_t key_len;
        char *key = NULL;
        if ((st = parse_string(ps, &key, &key_len)) != KR_OK) {
            goto fail;
        }
        skip_ws(ps);
        if (ps->p >= ps->end || *ps->p != ':') {
            kr_free(key);
            st = parse_error(ps, ps->p, "expected ':' after an object key, found %s",
                             describe(ps, ps->p, d, sizeof d));
            goto fail;
        }
        ps->p++;
        skip_ws(ps);
        memset(&v->items[v->n], 0, sizeof v->items[v->n]);
        if ((st = parse_value(ps, &v->items[v->n])) != KR_OK) {
            kr_free(key);
            goto fail;
        }
        v->keys[v->n] = key;
        v->n++;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            skip_ws(ps);
            continue;
        }
        if (ps->p < ps->end && *ps->p == '}') {
            ps->p++;
            break;
        }
        st = parse_error(ps, ps->p, "expected ',' or '}' after an object member, found %s",
                         describe(ps, ps->p, d, sizeof d));
        goto fail;
    }
    ps->depth--;
    return KR_OK;
fail:
    free_contents(v);
    return st;
}

/* Parses one value at ps->p (whitespace already skipped) into the zeroed `v`. On failure `v` owns
 * nothing. */
static enum kr_status parse_value(struct json_parser *ps, struct kr_json *v)
{
    char d[16];
    if (ps->p >= ps->end) {
        return parse_error(ps, ps->p, "expected a JSON value, found end of input");
    }
    switch (*ps->p) {
    case '{':
        return parse_object(ps, v);
    case '[':
        return parse_array(ps, v);
    case '"': {
        enum kr_status st = parse_string(ps, &v->str, &v->str_len);
        if (st == KR_OK) {
            v->type = KR_JSON_STRING;
        }
        return st;
    }
    case '-':
    case '0':
    case '1':
    case '2':
    case '3':
    case '4':
    case '5':
    case '6':
    case '7':
    case '8':
    case '9':
        return parse_number(ps, v);
    default:
        break;
    }
    if (match_word(ps, "true")) {
        v->type = KR_JSON_BOOL;
        v->boolean = true;
        return KR_OK;
    }
    if (match_word(ps, "false")) {
        v->type = KR_JSON_BOOL;
        v->boolean = false;
        return KR_OK;
    }
    if (match_word(ps, "null")) {
        v->type = KR_JSON_NULL;
        return KR_OK;
    }
    if (match_word(ps, "NaN")) {
        v->type = KR_JSON_NUMBER;
        v->number = NAN;
        return KR_OK;
    }
    if (match_word(ps, "Infinity")) {
        v->type = KR_JSON_NUMBER;
        v->number = INFINITY;
        return KR_OK;
    }
    return parse_error(ps, ps->p, "expected a JSON value, found %s", describe(ps, ps->p, d, sizeof d));
}

/* ---- public ---------------------------------------------------------------------------------- */

enum kr_status kr_json_parse(const char *text, size_t len, struct kr_json **out, struct kr_err *err)
{
    static const char empty[1] = "";
    struct json_parser ps = {.start = text ? text : empty, .err = err};
    ps.p = ps.start;
    ps.end = ps.start + (text ? len : 0);
    *out = NULL;
    char d[16];
    enum kr_status st;
    struct kr_json *root = kr_calloc(1, sizeof *root);
    if (!root) {
        return oom_error(&ps);
    }
    /* RFC 8259 section 8.1: a parser may ignore a leading byte order mark. */
    if (ps.end - ps.p >= 3 && memcmp(ps.p, "\xef\xbb\xbf", 3) == 0) {
        ps.p += 3;
    }
    skip_ws(&ps);
    if ((st = parse_value(&ps, root)) != KR_OK) {
        goto fail;
    }
    skip_ws(&ps);
    if (ps.p != ps.end) {
        st = parse_error(&ps, ps.p, "expected end of input after the top-level value, found %s",
                         describe(&ps, ps.p, d, sizeof d));
        goto fail;
    }
    *out = root;
    return KR_OK;
fail:
    kr_json_free(root);
    return st;
}

enum kr_status kr_json_parse_file(const char *path, struct kr_json **out, struct kr_err *err)
{
    char *buf;
    size_t len;
    *out = NULL;
    enum kr_status st = kr_file_read(path, KR_JSON_FILE_MAX, &buf, &len, err);
    if (st != KR_OK) {
        return st;
    }
    st = kr_json_parse(buf, len, out, err);
    if (st != KR_OK) {
        kr_err_prefix(err, "%s", path);
    }
    kr_free(buf);
    return st;
}

void kr_json_free(struct kr_json *v)
{
    if (!v) {
        return;
    }
    free_contents(v);
    kr_free(v);
}

const struct kr_json *kr_json_get(const struct kr_json *obj, const char *key)
{
    if (!obj || obj->type != KR_JSON_OBJECT) {
        return NULL;
    }
    for (size_t i = obj->n; i-- > 0;) { /* backwards: the last duplicate wins */
        if (strcmp(obj->keys[i], key) == 0) {
            return &obj->items[i];
        }
    }
    return NULL;
}

/* Numeric value of a string that spells a non-finite float; false for any other string. */
static bool nonfinite_from_string(const struct kr_json *v, double *out)
{
    if (strlen(v->str) != v->str_len) {
        return false; /* embedded NUL */
    }
    if (!strcasecmp(v->str, "infinity") || !strcasecmp(v->str, "inf")) {
        *out = INFINITY;
    } else if (!strcasecmp(v->str, "-infinity") || !strcasecmp(v->str, "-inf")) {
        *out = -INFINITY;
    } else if (!strcasecmp(v->str, "nan")) {
        *out = NAN;
    } else {
        return false;
    }
    return true;
}

bool kr_json_as_double(const struct kr_json *v, double *out)
{
    if (!v) {
        return false;
    }
    if (v->type == KR_JSON_OBJECT) {
        v = kr_json_get(v, "__float__"); /* transformers 5: {"__float__": "Infinity"} */
        if (!v) {
            return false;
        }
    }
    if (v->type == KR_JSON_NUMBER) {
        *out = v->number;
        return true;
    }
    if (v->type == KR_JSON_STRING) {
        return nonfinite_from_string(v, out);
    }
    return false;
}

bool kr_json_as_int(const struct kr_json *v, int64_t *out)
{
    if (!v || v->type != KR_JSON_NUMBER) {
        return false;
    }
    if (v->is_int) {
        *out = v->integer;
        return true;
    }
    /* 2^63 is exactly representable; every double in [-2^63, 2^63) that equals its floor fits. */
    double x = v->number;
    if (isfinite(x) && x == floor(x) && x >= -9223372036854775808.0 && x < 9223372036854775808.0) {
        *out = (int64_t)x;
        return true;
    }
    return false;
}

const char *kr_json_type_name(enum kr_json_type t)
{
    switch (t) {
    case KR_JSON_NULL:
        return "null";
    case KR_JSON_BOOL:
        return "boolean";
    case KR_JSON_NUMBER:
        return "number";
    case KR_JSON_STRING:
        return "string";
    case KR_JSON_ARRAY:
        return "array";
    case KR_JSON_OBJECT:
        return "object";
    }
    return "unknown";
}
