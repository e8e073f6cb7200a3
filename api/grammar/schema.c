/* JSON Schema (and json_object, and choice) to grammar expressions.
 *
 * Every document the grammar allows is valid under the schema; where an exact grammar would be
 * large or impossible we allow a documented subset instead (docs/STRUCTURED_OUTPUTS.md): object
 * properties only in the schema's order, no properties beyond the declared ones unless
 * additionalProperties says so, number bounds rounded inwards to integers, February 29 never in a
 * date, strings in one canonical escaping. Keywords that would change validity and that we do not
 * compile are errors naming the keyword and its JSON pointer. */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"
#include "json.h"
#include "utf8.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SC_MAX_DEPTH 64   /* nesting of inline subschemas */
#define SC_DEFAULT_WS 24  /* grammar.h: kr_grammar_json_opts.max_ws */
#define SC_BOUND_MAX 9000000000000000000.0 /* |bounds| we compile (int64) */

struct sc_ref {
    const struct kr_json *target;
    int32_t rule;
};

struct sc {
    struct gb *b;
    const struct kr_json *root;
    int32_t max_ws;
    int32_t r_ws, r_value, r_object, r_array, r_string, r_number, r_integer;
    struct gx *x_char; /* one character of string content */
    struct sc_ref *refs;
    size_t n_refs, cap_refs;
    char path[512];   /* JSON pointer of the schema being compiled */
    size_t path_len;
    int depth;
    int n_rules;      /* names of generated rules */
};

/* ---- errors and pointers ------------------------------------------------------------------------ */

static struct gx *sc_fail(struct sc *c, const char *key, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Fails naming the JSON pointer of the current schema (plus `key` when not NULL). */
static struct gx *sc_fail(struct sc *c, const char *key, const char *fmt, ...)
{
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    if (!c->path_len && !key) {
        gb_fail(c->b, KR_ERR_INVAL, "json schema: at the root: %s", what);
    } else {
        gb_fail(c->b, KR_ERR_INVAL, "json schema: at %s%s%s: %s", c->path, key ? "/" : "", key ? key : "", what);
    }
    return NULL;
}

static size_t path_push(struct sc *c, const char *seg)
{
    size_t saved = c->path_len;
    if (c->path_len + 2 < sizeof(c->path)) {
        c->path[c->path_len++] = '/';
    }
    for (const char *s = seg; *s && c->path_len + 3 < sizeof(c->path); s++) {
        if (*s == '~' || *s == '/') { /* RFC 6901 */
            c->path[c->path_len++] = '~';
            c->path[c->path_len++] = *s == '~' ? '0' : '1';
        } else {
            c->path[c->path_len++] = *s;
        }
    }
    c->path[c->path_len] = '\0';
    return saved;
}

static size_t path_push_index(struct sc *c, size_t i)
{
    char seg[24];
    snprintf(seg, sizeof(seg), "%zu", i);
    return path_push(c, seg);
}

static void path_pop(struct sc *c, size_t saved)
{
    c->path_len = saved;
    c->path[saved] = '\0';
}

static int32_t sc_rule(struct sc *c, const char *kind)
{
    char name[64];
    snprintf(name, sizeof(name), "%s-%d", kind, ++c->n_rules);
    return gb_rule_new(c->b, name);
}

/* ---- JSON text pieces ------------------------------------------------------------------------- */

static struct gx *ws(struct sc *c)
{
    if (c->max_ws == 0) {
        return gx_empty(c->b);
    }
    if (c->r_ws < 0) {
        static const uint32_t sp[] = {'\t', '\n', '\r', '\r', ' ', ' '};
        if ((c->r_ws = gb_rule_new(c->b, "ws")) < 0) { /* out of memory: no rule to recurse into */
            return NULL;
        }
        gb_rule_set(c->b, c->r_ws, gx_rep(c->b, gx_class(c->b, sp, 3, false), 0, c->max_ws));
    }
    return gx_ref(c->b, c->r_ws);
}

static struct gx *sep(struct sc *c)
{
    return GX_SEQ(c->b, ws(c), gx_str(c->b, ","), ws(c));
}

static struct gx *colon(struct sc *c)
{
    return GX_SEQ(c->b, ws(c), gx_str(c->b, ":"), ws(c));
}

/* One character of string content: a raw character, or an escape that stands for one code point
 * (\uXXXX outside the surrogates, so that lengths count code points as validators do). An
 * expression, not a rule: a repetition of it then loops within one stack frame, which is what the
 * mask cache (mask.c) keys on. */
static struct gx *json_char(struct sc *c)
{
    if (!c->x_char) {
        struct gb *b = c->b;
        static const uint32_t raw[] = {0x00, 0x1F, '"', '"', '\\', '\\'};
        static const uint32_t esc[] = {'"', '"', '/', '/', '\\', '\\', 'b', 'b', 'f', 'f', 'n', 'n', 'r', 'r', 't', 't'};
        static const uint32_t hex[] = {'0', '9', 'A', 'F', 'a', 'f'};
        static const uint32_t hex_lo[] = {'0', '9', 'A', 'C', 'E', 'F', 'a', 'c', 'e', 'f'}; /* not D: surrogates */
        static const uint32_t d07[] = {'0', '7'};
        static const uint32_t dD[] = {'D', 'D', 'd', 'd'};
        struct gx *h = gx_class(b, hex, 3, false);
        struct gx *u = GX_ALT(b, GX_SEQ(b, gx_class(b, hex_lo, 5, false), h, h, h),
                              GX_SEQ(b, gx_class(b, dD, 2, false), gx_class(b, d07, 1, false), h, h));
        c->x_char = GX_ALT(b, gx_class(b, raw, 3, true),
                           GX_SEQ(b, gx_str(b, "\\"), GX_ALT(b, gx_class(b, esc, 8, false), GX_SEQ(b, gx_str(b, "u"), u))));
    }
    return c->x_char;
}

static struct gx *string_any(struct sc *c)
{
    if (c->r_string < 0) {
        if ((c->r_string = gb_rule_new(c->b, "string")) < 0) { /* out of memory: no rule to recurse into */
            return NULL;
        }
        gb_rule_set(c->b, c->r_string,
                    GX_SEQ(c->b, gx_str(c->b, "\""), gx_rep(c->b, json_char(c), 0, -1), gx_str(c->b, "\"")));
    }
    return gx_ref(c->b, c->r_string);
}

static struct gx *digits(struct sc *c, int32_t min, int32_t max)
{
    static const uint32_t d[] = {'0', '9'};
    return gx_rep(c->b, gx_class(c->b, d, 1, false), min, max);
}

static struct gx *digit_range(struct sc *c, char lo, char hi)
{
    uint32_t r[] = {(uint32_t)lo, (uint32_t)hi};
    return gx_class(c->b, r, 1, false);
}

/* 0 | [1-9][0-9]* */
static struct gx *uint_any(struct sc *c)
{
    return GX_ALT(c->b, gx_str(c->b, "0"), GX_SEQ(c->b, digit_range(c, '1', '9'), digits(c, 0, -1)));
}

static struct gx *integer_any(struct sc *c)
{
    if (c->r_integer < 0) {
        if ((c->r_integer = gb_rule_new(c->b, "integer")) < 0) { /* out of memory: no rule to recurse into */
            return NULL;
        }
        gb_rule_set(c->b, c->r_integer, GX_SEQ(c->b, gx_rep(c->b, gx_str(c->b, "-"), 0, 1), uint_any(c)));
    }
    return gx_ref(c->b, c->r_integer);
}

static struct gx *number_any(struct sc *c)
{
    if (c->r_number < 0) {
        struct gb *b = c->b;
        static const uint32_t e[] = {'E', 'E', 'e', 'e'};
        static const uint32_t pm[] = {'+', '+', '-', '-'};
        if ((c->r_number = gb_rule_new(b, "number")) < 0) { /* out of memory: no rule to recurse into */
            return NULL;
        }
        gb_rule_set(b, c->r_number,
                    GX_SEQ(b, gx_rep(b, gx_str(b, "-"), 0, 1), uint_any(c),
                           gx_rep(b, GX_SEQ(b, gx_str(b, "."), digits(c, 1, -1)), 0, 1),
                           gx_rep(b, GX_SEQ(b, gx_class(b, e, 2, false), gx_rep(b, gx_class(b, pm, 2, false), 0, 1),
                                            digits(c, 1, -1)), 0, 1)));
    }
    return gx_ref(c->b, c->r_number);
}

static struct gx *value_any(struct sc *c);

static struct gx *object_any(struct sc *c)
{
    if (c->r_object < 0) {
        struct gb *b = c->b;
        if ((c->r_object = gb_rule_new(b, "object")) < 0) { /* out of memory: no rule to recurse into */
            return NULL;
        }
        struct gx *member = GX_SEQ(b, string_any(c), colon(c), value_any(c));
        gb_rule_set(b, c->r_object,
                    GX_SEQ(b, gx_str(b, "{"), ws(c),
                           gx_rep(b, GX_SEQ(b, member, gx_rep(b, GX_SEQ(b, sep(c), member), 0, -1), ws(c)), 0, 1),
                           gx_str(b, "}")));
    }
    return gx_ref(c->b, c->r_object);
}

static struct gx *array_any(struct sc *c)
{
    if (c->r_array < 0) {
        struct gb *b = c->b;
        if ((c->r_array = gb_rule_new(b, "array")) < 0) { /* out of memory: no rule to recurse into */
            return NULL;
        }
        gb_rule_set(b, c->r_array,
                    GX_SEQ(b, gx_str(b, "["), ws(c),
                           gx_rep(b, GX_SEQ(b, value_any(c), gx_rep(b, GX_SEQ(b, sep(c), value_any(c)), 0, -1), ws(c)),
                                  0, 1),
                           gx_str(b, "]")));
    }
    return gx_ref(c->b, c->r_array);
}

static struct gx *value_any(struct sc *c)
{
    if (c->r_value < 0) {
        struct gb *b = c->b;
        if ((c->r_value = gb_rule_new(b, "value")) < 0) { /* out of memory: no rule to recurse into */
            return NULL;
        }
        gb_rule_set(b, c->r_value, GX_ALT(b, object_any(c), array_any(c), string_any(c), number_any(c),
                                          gx_str(b, "true"), gx_str(b, "false"), gx_str(b, "null")));
    }
    return gx_ref(c->b, c->r_value);
}

/* The JSON text of string s[0..n) with our one canonical escaping (raw UTF-8 but for `"`, `\` and
 * control characters). */
static struct gx *string_lit(struct sc *c, const char *s, size_t n)
{
    size_t cap = 2 + 6 * n;
    char *out = kr_malloc(cap + 1);
    if (!out) {
        gb_fail(c->b, KR_ERR_NOMEM, "json schema: out of memory");
        return NULL;
    }
    size_t k = 0;
    out[k++] = '"';
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        static const char hex[] = "0123456789abcdef";
        const char *e = ch == '"' ? "\\\"" : ch == '\\' ? "\\\\" : ch == '\n' ? "\\n" : ch == '\r' ? "\\r"
                      : ch == '\t' ? "\\t" : ch == '\b' ? "\\b" : ch == '\f' ? "\\f" : NULL;
        if (e) {
            memcpy(out + k, e, 2);
            k += 2;
        } else if (ch < 0x20) {
            memcpy(out + k, "\\u00", 4);
            out[k + 4] = hex[ch >> 4];
            out[k + 5] = hex[ch & 15];
            k += 6;
        } else {
            out[k++] = (char)ch;
        }
    }
    out[k++] = '"';
    struct gx *x = gx_lit(c->b, out, k);
    kr_free(out);
    return x;
}

/* A number as JSON text: integers exactly, other values in the shortest form that reads back. */
static bool number_text(const struct kr_json *v, char *buf, size_t cap)
{
    if (v->is_int) {
        snprintf(buf, cap, "%lld", (long long)v->integer);
        return true;
    }
    if (!isfinite(v->number)) {
        return false;
    }
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, cap, "%.*g", p, v->number);
        if (strtod(buf, NULL) == v->number) {
            break;
        }
    }
    return true;
}

/* A JSON value written out (enum and const), whitespace allowed where JSON allows it. */
static struct gx *value_lit(struct sc *c, const struct kr_json *v)
{
    struct gb *b = c->b;
    char num[40];
    switch (v->type) {
    case KR_JSON_NULL:
        return gx_str(b, "null");
    case KR_JSON_BOOL:
        return gx_str(b, v->boolean ? "true" : "false");
    case KR_JSON_NUMBER:
        if (!number_text(v, num, sizeof(num))) {
            return sc_fail(c, NULL, "a non-finite number cannot be written as JSON");
        }
        return gx_str(b, num);
    case KR_JSON_STRING:
        return string_lit(c, v->str, v->str_len);
    case KR_JSON_ARRAY: {
        struct gx *seq = GX_SEQ(b, gx_str(b, "["), ws(c));
        for (size_t i = 0; i < v->n; i++) {
            seq = gx_add(b, seq, i ? GX_SEQ(b, sep(c), value_lit(c, &v->items[i])) : value_lit(c, &v->items[i]));
        }
        return gx_add(b, gx_add(b, seq, v->n ? ws(c) : gx_empty(b)), gx_str(b, "]"));
    }
    case KR_JSON_OBJECT: {
        struct gx *seq = GX_SEQ(b, gx_str(b, "{"), ws(c));
        for (size_t i = 0; i < v->n; i++) {
            struct gx *m = GX_SEQ(b, string_lit(c, v->keys[i], strlen(v->keys[i])), colon(c), value_lit(c, &v->items[i]));
            seq = gx_add(b, seq, i ? GX_SEQ(b, sep(c), m) : m);
        }
        return gx_add(b, gx_add(b, seq, v->n ? ws(c) : gx_empty(b)), gx_str(b, "}"));
    }
    }
    return NULL;
}

/* ---- integer and number ranges ---------------------------------------------------------------- */

/* Digit strings of exactly len digits from a to b (both len digits, a <= b), leading zeros
 * allowed: split on the first digit. */
static struct gx *digits_between(struct sc *c, const char *a, const char *z, size_t len)
{
    struct gb *b = c->b;
    if (len == 0) {
        return gx_empty(b);
    }
    bool a_zeros = true, z_nines = true;
    for (size_t i = 1; i < len; i++) {
        a_zeros &= a[i] == '0';
        z_nines &= z[i] == '9';
    }
    if (a[0] == z[0]) {
        return GX_SEQ(b, digit_range(c, a[0], a[0]), digits_between(c, a + 1, z + 1, len - 1));
    }
    char nines[24], zeros[24];
    memset(nines, '9', sizeof(nines));
    memset(zeros, '0', sizeof(zeros));
    struct gx *alt = gx_list(b, GX_ALT);
    char mid_lo = a[0], mid_hi = z[0];
    if (!a_zeros) {
        alt = gx_add(b, alt, GX_SEQ(b, digit_range(c, a[0], a[0]), digits_between(c, a + 1, nines, len - 1)));
        mid_lo++;
    }
    if (!z_nines) {
        alt = gx_add(b, alt, GX_SEQ(b, digit_range(c, z[0], z[0]), digits_between(c, zeros, z + 1, len - 1)));
        mid_hi--;
    }
    if (mid_lo <= mid_hi) {
        alt = gx_add(b, alt, GX_SEQ(b, digit_range(c, mid_lo, mid_hi), digits(c, (int32_t)len - 1, (int32_t)len - 1)));
    }
    return alt;
}

static int n_digits(uint64_t v)
{
    int n = 1;
    while (v >= 10) {
        v /= 10;
        n++;
    }
    return n;
}

/* Decimal integers from a to z without sign or leading zeros (1 <= a <= z; z_inf: unbounded). */
static struct gx *pos_range(struct sc *c, uint64_t a, uint64_t z, bool z_inf)
{
    struct gb *b = c->b;
    struct gx *alt = gx_list(b, GX_ALT);
    int ka = n_digits(a), kz = z_inf ? ka : n_digits(z);
    uint64_t p = 1;
    for (int i = 1; i < ka; i++) {
        p *= 10;
    }
    for (int k = ka; k <= kz; k++, p = p <= UINT64_MAX / 10 ? p * 10 : UINT64_MAX) {
        uint64_t lo = a > p ? a : p;
        uint64_t top = p <= UINT64_MAX / 10 ? p * 10 - 1 : UINT64_MAX;
        uint64_t hi = z_inf || z > top ? top : z;
        char sa[24], sz[24];
        snprintf(sa, sizeof(sa), "%llu", (unsigned long long)lo);
        snprintf(sz, sizeof(sz), "%llu", (unsigned long long)hi);
        alt = gx_add(b, alt, digits_between(c, sa, sz, (size_t)k));
    }
    if (z_inf) { /* more digits than a has */
        alt = gx_add(b, alt, GX_SEQ(b, digit_range(c, '1', '9'), digits(c, ka, -1)));
    }
    return alt;
}

/* Non-negative integers from a to z (z_inf: unbounded). */
static struct gx *nonneg_range(struct sc *c, uint64_t a, uint64_t z, bool z_inf, struct gx *alt)
{
    if (a == 0) {
        alt = gx_add(c->b, alt, gx_str(c->b, "0"));
        a = 1;
        if (!z_inf && z == 0) {
            return alt;
        }
    }
    return gx_add(c->b, alt, pos_range(c, a, z, z_inf));
}

/* Magnitude of a negative int64 as uint64 (INT64_MIN included). */
static uint64_t neg_mag(int64_t v)
{
    return (uint64_t)(-(v + 1)) + 1;
}

/* Integers in [lo, hi] (bounds optional). */
static struct gx *int_range(struct sc *c, bool lo_set, int64_t lo, bool hi_set, int64_t hi)
{
    struct gb *b = c->b;
    struct gx *alt = gx_list(b, GX_ALT);
    if (!lo_set || lo < 0) { /* negatives: "-" and magnitudes from |min(hi, -1)| to |lo| */
        int64_t neg_hi = hi_set && hi < -1 ? hi : -1;
        alt = gx_add(b, alt, GX_SEQ(b, gx_str(b, "-"), pos_range(c, neg_mag(neg_hi), lo_set ? neg_mag(lo) : 0, !lo_set)));
    }
    if (!hi_set || hi >= 0) {
        uint64_t a = lo_set && lo > 0 ? (uint64_t)lo : 0;
        alt = nonneg_range(c, a, hi_set ? (uint64_t)hi : 0, !hi_set, alt);
    }
    return alt;
}

/* Non-negative decimals y (no sign, no exponent) with a <= y (a < y when a_excl) and y <= z (y < z
 * when z_excl; z_inf: unbounded); a, z integers. */
static struct gx *dec_nonneg(struct sc *c, uint64_t a, bool a_excl, uint64_t z, bool z_inf, bool z_excl)
{
    struct gb *b = c->b;
    struct gx *alt = gx_list(b, GX_ALT);
    struct gx *frac_any = gx_rep(b, GX_SEQ(b, gx_str(b, "."), digits(c, 1, -1)), 0, 1);
    char num[24];
    if (a_excl && (z_inf || z > a)) { /* a < y < a + 1: a nonzero fraction */
        snprintf(num, sizeof(num), "%llu", (unsigned long long)a);
        alt = gx_add(b, alt, GX_SEQ(b, gx_str(b, num), gx_str(b, "."), digits(c, 0, -1), digit_range(c, '1', '9'),
                                    digits(c, 0, -1)));
    }
    uint64_t i_lo = a_excl ? a + 1 : a;
    if (z_inf) {
        return gx_add(b, alt, GX_SEQ(b, nonneg_range(c, i_lo, 0, true, gx_list(b, GX_ALT)), frac_any));
    }
    if (z >= 1 && i_lo <= z - 1) {
        alt = gx_add(b, alt, GX_SEQ(b, nonneg_range(c, i_lo, z - 1, false, gx_list(b, GX_ALT)), frac_any));
    }
    if (!z_excl && z >= i_lo) { /* y = z exactly */
        snprintf(num, sizeof(num), "%llu", (unsigned long long)z);
        alt = gx_add(b, alt, GX_SEQ(b, gx_str(b, num), gx_rep(b, GX_SEQ(b, gx_str(b, "."), gx_rep(b, gx_str(b, "0"), 1, -1)),
                                                             0, 1)));
    }
    return alt;
}

/* Decimals in the range, bounds integers (exclusive or not, optional). */
static struct gx *dec_range(struct sc *c, bool lo_set, int64_t lo, bool lo_excl, bool hi_set, int64_t hi, bool hi_excl)
{
    struct gb *b = c->b;
    struct gx *alt = gx_list(b, GX_ALT);
    if (!hi_set || hi > 0 || (hi == 0 && !hi_excl)) {
        bool from_zero = !lo_set || lo < 0;
        alt = gx_add(b, alt, dec_nonneg(c, from_zero ? 0 : (uint64_t)lo, from_zero ? false : lo_excl,
                                        hi_set ? (uint64_t)hi : 0, !hi_set, hi_excl));
    }
    if (!lo_set || lo < 0) { /* x < 0: "-" and y = -x in (0, -lo], also y >= -hi when hi < 0 */
        bool hi_neg = hi_set && hi < 0;
        alt = gx_add(b, alt, GX_SEQ(b, gx_str(b, "-"),
                                    dec_nonneg(c, hi_neg ? neg_mag(hi) : 0, hi_neg ? hi_excl : true,
                                               lo_set ? neg_mag(lo) : 0, !lo_set, lo_excl)));
    }
    return alt;
}

/* ---- keywords ------------------------------------------------------------------------------------- */

static bool is_one_of(const char *k, const char *const *list)
{
    for (; *list; list++) {
        if (strcmp(k, *list) == 0) {
            return true;
        }
    }
    return false;
}

static const char *const k_annotations[] = {
    "title", "description", "examples", "default", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "$anchor", "contentEncoding", "contentMediaType", "contentSchema", "$defs", "definitions", NULL,
};
static const char *const k_object[] = {"properties", "required", "additionalProperties", NULL};
static const char *const k_array[] = {"items", "prefixItems", "additionalItems", "minItems", "maxItems",
                                      "uniqueItems", NULL};
static const char *const k_string[] = {"minLength", "maxLength", "pattern", "format", NULL};
static const char *const k_number[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", NULL};
static const char *const k_other[] = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", NULL};

static bool is_validation(const char *k)
{
    return is_one_of(k, k_object) || is_one_of(k, k_array) || is_one_of(k, k_string) || is_one_of(k, k_number) ||
           is_one_of(k, k_other);
}

/* The first validation keyword of s other than `except` (NULL when none). */
static const char *other_validation(const struct kr_json *s, const char *except)
{
    for (size_t i = 0; i < s->n; i++) {
        if (strcmp(s->keys[i], except) != 0 && is_validation(s->keys[i])) {
            return s->keys[i];
        }
    }
    return NULL;
}

static bool get_count(struct sc *c, const struct kr_json *s, const char *key, int64_t *out)
{
    const struct kr_json *v = kr_json_get(s, key);
    if (!v) {
        return true;
    }
    if (!kr_json_as_int(v, out) || *out < 0) {
        sc_fail(c, key, "must be a non-negative integer");
        return false;
    }
    return true;
}

enum { T_NULL = 1, T_BOOL = 2, T_OBJECT = 4, T_ARRAY = 8, T_STRING = 16, T_NUMBER = 32, T_INTEGER = 64, T_ALL = 127 };

static int type_bit(const char *name)
{
    static const char *const names[] = {"null", "boolean", "object", "array", "string", "number", "integer"};
    for (int i = 0; i < 7; i++) {
        if (strcmp(name, names[i]) == 0) {
            return 1 << i;
        }
    }
    return 0;
}

/* The types a schema allows: its "type", else those its keywords constrain, else all. */
static bool schema_types(struct sc *c, const struct kr_json *s, int *types)
{
    const struct kr_json *t = kr_json_get(s, "type");
    *types = 0;
    if (t && t->type == KR_JSON_STRING) {
        *types = type_bit(t->str);
        if (!*types) {
            sc_fail(c, "type", "unknown type '%s'", t->str);
            return false;
        }
    } else if (t && t->type == KR_JSON_ARRAY && t->n > 0) {
        for (size_t i = 0; i < t->n; i++) {
            int bit = t->items[i].type == KR_JSON_STRING ? type_bit(t->items[i].str) : 0;
            if (!bit) {
                sc_fail(c, "type", "entry %zu is not a type name", i);
                return false;
            }
            *types |= bit;
        }
    } else if (t) {
        sc_fail(c, "type", "must be a type name or a non-empty array of them");
        return false;
    } else {
        for (size_t i = 0; i < s->n; i++) {
            const char *k = s->keys[i];
            *types |= is_one_of(k, k_object) ? T_OBJECT : is_one_of(k, k_array) ? T_ARRAY
                    : is_one_of(k, k_string) ? T_STRING : is_one_of(k, k_number) ? T_NUMBER : 0;
        }
        if (!*types) {
            *types = T_ALL;
        }
    }
    if ((*types & T_NUMBER) && (*types & T_INTEGER)) { /* integers are numbers */
        *types &= ~T_INTEGER;
    }
    return true;
}

static bool value_has_type(const struct kr_json *v, int types)
{
    switch (v->type) {
    case KR_JSON_NULL: return types & T_NULL;
    case KR_JSON_BOOL: return types & T_BOOL;
    case KR_JSON_OBJECT: return types & T_OBJECT;
    case KR_JSON_ARRAY: return types & T_ARRAY;
    case KR_JSON_STRING: return types & T_STRING;
    case KR_JSON_NUMBER: {
        int64_t i;
        return (types & T_NUMBER) || ((types & T_INTEGER) && kr_json_as_int(v, &i));
    }
    }
    return false;
}

/* ---- schemas -------------------------------------------------------------------------------------- */

static struct gx *sc_schema(struct sc *c, const struct kr_json *s);

static struct gx *sc_sub(struct sc *c, const struct kr_json *s, const char *key)
{
    size_t saved = path_push(c, key);
    struct gx *x = sc_schema(c, s);
    path_pop(c, saved);
    return x;
}

static struct gx *sc_sub_index(struct sc *c, const struct kr_json *s, const char *key, size_t i)
{
    size_t saved = path_push(c, key);
    size_t saved2 = path_push_index(c, i);
    struct gx *x = sc_schema(c, s);
    path_pop(c, saved2);
    path_pop(c, saved);
    return x;
}

/* Resolves a local reference ("#", "#/$defs/x", any "#/..." JSON pointer). */
static const struct kr_json *resolve(struct sc *c, const char *ref)
{
    if (ref[0] != '#') {
        sc_fail(c, "$ref", "only references within the schema (\"#...\") are supported, not '%s'", ref);
        return NULL;
    }
    const struct kr_json *v = c->root;
    const char *p = ref + 1;
    while (*p) {
        if (*p != '/') {
            sc_fail(c, "$ref", "'%s' is not a JSON pointer", ref);
            return NULL;
        }
        p++;
        char seg[256];
        size_t n = 0;
        for (; *p && *p != '/'; p++) {
            char ch = *p;
            if (ch == '~' && (p[1] == '0' || p[1] == '1')) {
                ch = p[1] == '0' ? '~' : '/';
                p++;
            } else if (ch == '%' && p[1] && p[2]) { /* URI fragments may percent-encode */
                char hex[3] = {p[1], p[2], '\0'};
                ch = (char)strtol(hex, NULL, 16);
                p += 2;
            }
            if (n + 1 < sizeof(seg)) {
                seg[n++] = ch;
            }
        }
        seg[n] = '\0';
        if (v->type == KR_JSON_OBJECT) {
            v = kr_json_get(v, seg);
        } else if (v->type == KR_JSON_ARRAY) {
            char *end;
            unsigned long i = strtoul(seg, &end, 10);
            v = *seg && !*end && i < v->n ? &v->items[i] : NULL;
        } else {
            v = NULL;
        }
        if (!v) {
            sc_fail(c, "$ref", "'%s' points to nothing", ref);
            return NULL;
        }
    }
    return v;
}

static struct gx *sc_ref(struct sc *c, const struct kr_json *s)
{
    const struct kr_json *r = kr_json_get(s, "$ref");
    if (r->type != KR_JSON_STRING) {
        return sc_fail(c, "$ref", "must be a string");
    }
    const char *other = other_validation(s, "$ref");
    if (other) {
        return sc_fail(c, other, "'%s' next to '$ref' is not supported", other);
    }
    const struct kr_json *target = resolve(c, r->str);
    if (!target) {
        return NULL;
    }
    for (size_t i = 0; i < c->n_refs; i++) {
        if (c->refs[i].target == target) {
            return gx_ref(c->b, c->refs[i].rule);
        }
    }
    if (c->n_refs == c->cap_refs) {
        size_t cap = c->cap_refs ? c->cap_refs * 2 : 16;
        struct sc_ref *v = kr_realloc(c->refs, cap * sizeof(*v));
        if (!v) {
            gb_fail(c->b, KR_ERR_NOMEM, "json schema: out of memory");
            return NULL;
        }
        c->refs = v;
        c->cap_refs = cap;
    }
    int32_t rule = gb_rule_new(c->b, r->str);
    if (rule < 0) {
        return NULL;
    }
    c->refs[c->n_refs++] = (struct sc_ref){target, rule};
    /* compile the target where it lives, so that errors name its pointer */
    char saved[sizeof(c->path)];
    size_t saved_len = c->path_len;
    memcpy(saved, c->path, sizeof(saved));
    snprintf(c->path, sizeof(c->path), "%s", r->str + 1);
    c->path_len = strlen(c->path);
    int depth = c->depth;
    c->depth = 0;
    gb_rule_set(c->b, rule, sc_schema(c, target));
    c->depth = depth;
    memcpy(c->path, saved, sizeof(saved));
    c->path_len = saved_len;
    return gx_ref(c->b, rule);
}

static struct gx *sc_combinator(struct sc *c, const struct kr_json *s, const char *key)
{
    const struct kr_json *list = kr_json_get(s, key);
    if (list->type != KR_JSON_ARRAY || list->n == 0) {
        return sc_fail(c, key, "must be a non-empty array of schemas");
    }
    const char *other = other_validation(s, key);
    if (other) {
        return sc_fail(c, other, "'%s' next to '%s' is not supported", other, key);
    }
    if (strcmp(key, "allOf") == 0) {
        if (list->n != 1) {
            return sc_fail(c, key, "allOf of %zu schemas is not supported (only of one)", list->n);
        }
        return sc_sub_index(c, &list->items[0], key, 0);
    }
    struct gx *alt = gx_list(c->b, GX_ALT); /* oneOf as anyOf: see the module comment */
    for (size_t i = 0; i < list->n; i++) {
        alt = gx_add(c->b, alt, sc_sub_index(c, &list->items[i], key, i));
    }
    return alt;
}

static struct gx *sc_enum(struct sc *c, const struct kr_json *s, int types)
{
    const struct kr_json *e = kr_json_get(s, "enum"), *k = kr_json_get(s, "const");
    if (e && k) {
        return sc_fail(c, "const", "'const' next to 'enum' is not supported");
    }
    const char *key = e ? "enum" : "const";
    for (size_t i = 0; i < s->n; i++) {
        if (strcmp(s->keys[i], key) != 0 && strcmp(s->keys[i], "type") != 0 && is_validation(s->keys[i])) {
            return sc_fail(c, s->keys[i], "'%s' next to '%s' is not supported", s->keys[i], key);
        }
    }
    if (e && (e->type != KR_JSON_ARRAY || e->n == 0)) {
        return sc_fail(c, "enum", "must be a non-empty array");
    }
    struct gx *alt = gx_list(c->b, GX_ALT);
    size_t n = e ? e->n : 1;
    for (size_t i = 0; i < n; i++) {
        const struct kr_json *v = e ? &e->items[i] : k;
        if (value_has_type(v, types)) {
            alt = gx_add(c->b, alt, value_lit(c, v));
        }
    }
    if (alt && alt->list.n == 0) {
        return sc_fail(c, key, "no value has the schema's type");
    }
    return alt;
}

/* Any JSON string except the given keys (so that an additional property never repeats a declared
 * one): a trie of the keys, where leaving the trie lets anything follow. Written without escapes,
 * so that no escaped spelling can match a key either. */
struct key_trie {
    uint32_t cp;
    int32_t child, next; /* first child, next sibling (-1) */
    bool end;
};

static struct gx *except_keys(struct sc *c, const struct key_trie *t, int32_t node)
{
    struct gb *b = c->b;
    size_t n_child = 0;
    for (int32_t k = t[node].child; k >= 0; k = t[k].next) {
        n_child++;
    }
    static const uint32_t raw_not[] = {0x00, 0x1F, '"', '"', '\\', '\\'};
    uint32_t *holes = gb_alloc(b, (3 + n_child) * 2 * sizeof(uint32_t));
    if (!holes) {
        return NULL;
    }
    memcpy(holes, raw_not, sizeof(raw_not));
    size_t n = 3;
    struct gx *alt = gx_list(b, GX_ALT);
    for (int32_t k = t[node].child; k >= 0 && alt; k = t[k].next) {
        holes[2 * n] = holes[2 * n + 1] = t[k].cp;
        n++;
        alt = gx_add(b, alt, GX_SEQ(b, gx_char(b, t[k].cp), except_keys(c, t, k)));
    }
    /* leave the trie: any other character, then anything */
    alt = gx_add(b, alt, GX_SEQ(b, gx_class(b, holes, n, true), gx_rep(b, gx_class(b, raw_not, 3, true), 0, -1)));
    if (!t[node].end) {
        alt = gx_add(b, alt, gx_empty(b));
    }
    return alt;
}

/* Whether key k can be written without escapes (only such keys can equal an additional one). */
static bool plain_key(const char *k)
{
    for (; *k; k++) {
        if ((unsigned char)*k < 0x20 || *k == '"' || *k == '\\') {
            return false;
        }
    }
    return true;
}

/* The names an additional property must avoid: the declared properties and the required ones. */
static struct gx *additional_key(struct sc *c, const struct kr_json *props, const struct kr_json *req)
{
    struct gb *b = c->b;
    size_t n_names = (props ? props->n : 0) + (req ? req->n : 0), cap = 1;
    const char **names = gb_alloc(b, (n_names + 1) * sizeof(*names));
    if (!names) {
        return NULL;
    }
    n_names = 0;
    for (size_t i = 0; props && i < props->n; i++) {
        names[n_names++] = props->keys[i];
    }
    for (size_t i = 0; req && i < req->n; i++) {
        names[n_names++] = req->items[i].str;
    }
    for (size_t i = 0; i < n_names; i++) {
        cap += strlen(names[i]);
    }
    struct key_trie *t = gb_alloc(b, cap * sizeof(*t));
    if (!t) {
        return NULL;
    }
    int32_t n = 1;
    t[0] = (struct key_trie){.child = -1, .next = -1};
    for (size_t i = 0; i < n_names; i++) {
        int32_t node = 0;
        const char *k = names[i];
        if (!plain_key(k)) {
            continue;
        }
        for (size_t j = 0; k[j];) {
            uint32_t cp;
            j += kr_utf8_next(k + j, &cp);
            int32_t ch = t[node].child;
            while (ch >= 0 && t[ch].cp != cp) {
                ch = t[ch].next;
            }
            if (ch < 0) {
                t[n] = (struct key_trie){.cp = cp, .child = -1, .next = t[node].child};
                t[node].child = n;
                ch = n++;
            }
            node = ch;
        }
        t[node].end = true;
    }
    int32_t r = sc_rule(c, "key");
    gb_rule_set(b, r, GX_SEQ(b, gx_str(b, "\""), except_keys(c, t, 0), gx_str(b, "\"")));
    return gx_ref(b, r);
}

struct member {
    struct gx *x; /* the "key": value text */
    bool required;
};

static bool is_required(const struct kr_json *req, const char *key)
{
    for (size_t i = 0; req && i < req->n; i++) {
        if (strcmp(req->items[i].str, key) == 0) {
            return true;
        }
    }
    return false;
}

static struct gx *sc_object(struct sc *c, const struct kr_json *s)
{
    struct gb *b = c->b;
    const struct kr_json *props = kr_json_get(s, "properties"), *req = kr_json_get(s, "required");
    const struct kr_json *addl = kr_json_get(s, "additionalProperties");
    if (props && props->type != KR_JSON_OBJECT) {
        return sc_fail(c, "properties", "must be an object");
    }
    if (req && req->type != KR_JSON_ARRAY) {
        return sc_fail(c, "required", "must be an array of strings");
    }
    /* additional properties: absent means none when properties are declared (OpenAI's strict
     * mode), any when none are */
    struct gx *addl_value = NULL;
    if (addl ? !(addl->type == KR_JSON_BOOL && !addl->boolean) : !(props && props->n)) {
        addl_value = addl && addl->type != KR_JSON_BOOL ? sc_sub(c, addl, "additionalProperties") : value_any(c);
        if (!addl_value) {
            return NULL;
        }
    }
    for (size_t i = 0; req && i < req->n; i++) {
        if (req->items[i].type != KR_JSON_STRING) {
            return sc_fail(c, "required", "entry %zu is not a string", i);
        }
        if (!kr_json_get(props, req->items[i].str) && !addl_value) {
            return sc_fail(c, "required", "required property '%s' is not among the properties, and no other "
                           "property is allowed", req->items[i].str);
        }
    }
    size_t n = (props ? props->n : 0) + (req ? req->n : 0);
    struct member *m = gb_alloc(b, (n + 1) * sizeof(*m));
    if (!m) {
        return NULL;
    }
    size_t k = 0;
    bool any_required = false;
    for (size_t i = 0; props && i < props->n; i++) {
        size_t saved = path_push(c, "properties");
        struct gx *v = sc_sub(c, &props->items[i], props->keys[i]);
        path_pop(c, saved);
        m[k].required = is_required(req, props->keys[i]);
        m[k++].x = GX_SEQ(b, string_lit(c, props->keys[i], strlen(props->keys[i])), colon(c), v);
        any_required |= m[k - 1].required;
    }
    for (size_t i = 0; req && i < req->n; i++) { /* required but not declared: an additional one */
        bool seen = false;
        for (size_t j = 0; j < i; j++) {
            seen |= strcmp(req->items[j].str, req->items[i].str) == 0;
        }
        if (!seen && !kr_json_get(props, req->items[i].str)) {
            m[k].required = any_required = true;
            m[k++].x = GX_SEQ(b, string_lit(c, req->items[i].str, req->items[i].str_len), colon(c), addl_value);
        }
    }
    struct gx *extra = addl_value ? GX_SEQ(b, additional_key(c, props, req), colon(c), addl_value) : NULL;
    /* R_i: members i.. after one was written (each starts with a comma); S_i: members i.. when none
     * was written yet, at least one (the empty object is the caller's alternative). */
    int32_t r_next = sc_rule(c, "members");
    gb_rule_set(b, r_next, extra ? gx_rep(b, GX_SEQ(b, sep(c), extra), 0, -1) : gx_empty(b));
    struct gx *s_next = extra ? GX_SEQ(b, extra, gx_ref(b, r_next)) : NULL;
    for (size_t i = k; i-- > 0;) {
        struct gx *first = GX_SEQ(b, m[i].x, gx_ref(b, r_next));
        int32_t r = sc_rule(c, "members");
        struct gx *after = GX_SEQ(b, sep(c), m[i].x, gx_ref(b, r_next));
        gb_rule_set(b, r, m[i].required ? after : GX_ALT(b, after, gx_ref(b, r_next)));
        s_next = m[i].required || !s_next ? first : GX_ALT(b, first, s_next);
        r_next = r;
    }
    if (!s_next) { /* nothing may be written: {} */
        return GX_SEQ(b, gx_str(b, "{"), ws(c), gx_str(b, "}"));
    }
    int32_t r_s = sc_rule(c, "object");
    gb_rule_set(b, r_s, s_next);
    struct gx *body = GX_SEQ(b, gx_ref(b, r_s), ws(c));
    return GX_SEQ(b, gx_str(b, "{"), ws(c), any_required ? body : gx_rep(b, body, 0, 1), gx_str(b, "}"));
}

static struct gx *sc_array(struct sc *c, const struct kr_json *s)
{
    struct gb *b = c->b;
    const struct kr_json *items = kr_json_get(s, "items"), *prefix = kr_json_get(s, "prefixItems");
    const struct kr_json *more = kr_json_get(s, "additionalItems"), *uniq = kr_json_get(s, "uniqueItems");
    const char *items_key = "items";
    if (uniq && !(uniq->type == KR_JSON_BOOL && !uniq->boolean)) {
        return sc_fail(c, "uniqueItems", "uniqueItems is not supported");
    }
    if (items && items->type == KR_JSON_ARRAY) { /* drafts before 2020-12: items as a tuple */
        if (prefix) {
            return sc_fail(c, "items", "an array 'items' next to 'prefixItems' is not supported");
        }
        prefix = items;
        items = more;
        items_key = "additionalItems";
    } else if (more) {
        return sc_fail(c, "additionalItems", "additionalItems without an array 'items' is not supported");
    }
    if (prefix && prefix->type != KR_JSON_ARRAY) {
        return sc_fail(c, "prefixItems", "must be an array of schemas");
    }
    int64_t min = 0, max = -1;
    if (!get_count(c, s, "minItems", &min) || !get_count(c, s, "maxItems", &max)) {
        return NULL;
    }
    if (!kr_json_get(s, "maxItems")) {
        max = -1;
    }
    size_t n_prefix = prefix ? prefix->n : 0;
    bool closed = items && items->type == KR_JSON_BOOL && !items->boolean;
    if (closed && (max < 0 || max > (int64_t)n_prefix)) {
        max = (int64_t)n_prefix;
    }
    if (max >= 0 && min > max) {
        return sc_fail(c, "minItems", "no array has between %lld and %lld items", (long long)min, (long long)max);
    }
    if (min > GB_MAX_REPEAT || max > GB_MAX_REPEAT) {
        return sc_fail(c, max > GB_MAX_REPEAT ? "maxItems" : "minItems", "item counts above %d are not supported",
                       GB_MAX_REPEAT);
    }
    struct gx *item = NULL;
    if (!closed) {
        item = items && !(items->type == KR_JSON_BOOL) ? sc_sub(c, items, items_key) : value_any(c);
    }
    int64_t explicit_n = max >= 0 ? max : (min > (int64_t)n_prefix ? min : (int64_t)n_prefix);
    if (explicit_n == 0 && max == 0) {
        return GX_SEQ(b, gx_str(b, "["), ws(c), gx_str(b, "]"));
    }
    if (explicit_n == 0) {
        explicit_n = 1;
    }
    struct gx **e = gb_alloc(b, (size_t)explicit_n * sizeof(*e));
    if (!e) {
        return NULL;
    }
    for (int64_t k = 0; k < explicit_n; k++) {
        e[k] = (size_t)k < n_prefix ? sc_sub_index(c, &prefix->items[k], "prefixItems", (size_t)k) : item;
    }
    /* the items after the first, from the last: T_k = sep e_k T_{k+1}, optional from minItems on */
    struct gx *tail = max < 0 ? gx_rep(b, GX_SEQ(b, sep(c), item), 0, -1) : gx_empty(b);
    for (int64_t k = explicit_n - 1; k >= 1; k--) {
        struct gx *step = GX_SEQ(b, sep(c), e[k], tail);
        tail = k < min ? step : gx_rep(b, step, 0, 1);
    }
    struct gx *body = GX_SEQ(b, e[0], tail, ws(c));
    return GX_SEQ(b, gx_str(b, "["), ws(c), min >= 1 ? body : gx_rep(b, body, 0, 1), gx_str(b, "]"));
}

/* Formats as regexes over the string's value; each allows a subset of what validators accept
 * (a date never has February 29, a time has a time zone and no leap second). */
static const char *format_regex(const char *f)
{
#define DATE "[0-9]{4}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31)"
#define TIME "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
#define OCTET "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
#define LABEL "[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    static const char *const table[][2] = {
        {"date", DATE},
        {"time", TIME},
        {"date-time", DATE "T" TIME},
        {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
        {"email", "[A-Za-z0-9_+-]+(?:\\.[A-Za-z0-9_+-]+)*@" LABEL "(?:\\." LABEL ")+"},
        {"ipv4", OCTET "\\." OCTET "\\." OCTET "\\." OCTET},
    };
#undef DATE
#undef TIME
#undef OCTET
#undef LABEL
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        if (strcmp(f, table[i][0]) == 0) {
            return table[i][1];
        }
    }
    return NULL;
}

static struct gx *sc_string(struct sc *c, const struct kr_json *s)
{
    struct gb *b = c->b;
    const struct kr_json *pattern = kr_json_get(s, "pattern"), *format = kr_json_get(s, "format");
    int64_t min = 0, max = -1;
    if (!get_count(c, s, "minLength", &min) || !get_count(c, s, "maxLength", &max)) {
        return NULL;
    }
    bool lengths = kr_json_get(s, "minLength") || kr_json_get(s, "maxLength");
    if (!kr_json_get(s, "maxLength")) {
        max = -1;
    }
    if ((pattern != NULL) + (format != NULL) + lengths > 1) {
        return sc_fail(c, pattern ? "pattern" : "format", "combining pattern, format and minLength/maxLength is not "
                       "supported");
    }
    char where[600];
    if (pattern) {
        if (pattern->type != KR_JSON_STRING) {
            return sc_fail(c, "pattern", "must be a string");
        }
        snprintf(where, sizeof(where), "json schema: at %s/pattern: ", c->path);
        struct gx_regex_opts o = {.json_string = true, .search = true};
        return GX_SEQ(b, gx_str(b, "\""), gx_regex(b, pattern->str, pattern->str_len, &o, where), gx_str(b, "\""));
    }
    if (format) {
        const char *re = format->type == KR_JSON_STRING ? format_regex(format->str) : NULL;
        if (!re) {
            return sc_fail(c, "format", "format '%s' is not supported (date, time, date-time, uuid, email, ipv4 are)",
                           format->type == KR_JSON_STRING ? format->str : "?");
        }
        snprintf(where, sizeof(where), "json schema: at %s/format: ", c->path);
        struct gx_regex_opts o = {.json_string = true};
        return GX_SEQ(b, gx_str(b, "\""), gx_regex(b, re, strlen(re), &o, where), gx_str(b, "\""));
    }
    if (!lengths) {
        return string_any(c);
    }
    if (max >= 0 && min > max) {
        return sc_fail(c, "minLength", "no string has between %lld and %lld characters", (long long)min, (long long)max);
    }
    if (min > GB_MAX_REPEAT || max > GB_MAX_REPEAT) {
        return sc_fail(c, max > GB_MAX_REPEAT ? "maxLength" : "minLength", "lengths above %d are not supported",
                       GB_MAX_REPEAT);
    }
    return GX_SEQ(b, gx_str(b, "\""), gx_rep(b, json_char(c), (int32_t)min, (int32_t)max), gx_str(b, "\""));
}

/* A bound of "minimum"-like key: false on error; *set when present. */
static bool get_bound(struct sc *c, const struct kr_json *s, const char *key, bool *set, double *v)
{
    const struct kr_json *j = kr_json_get(s, key);
    *set = false;
    if (!j || j->type == KR_JSON_BOOL) {
        return true;
    }
    if (j->type != KR_JSON_NUMBER || !isfinite(j->number)) {
        sc_fail(c, key, "must be a number");
        return false;
    }
    if (fabs(j->number) > SC_BOUND_MAX) {
        sc_fail(c, key, "bounds beyond +-9e18 are not supported");
        return false;
    }
    *set = true;
    *v = j->number;
    return true;
}

static struct gx *sc_number(struct sc *c, const struct kr_json *s, bool integer)
{
    bool min_set, max_set, xmin_set, xmax_set;
    double min = 0, max = 0, xmin = 0, xmax = 0;
    if (!get_bound(c, s, "minimum", &min_set, &min) || !get_bound(c, s, "maximum", &max_set, &max) ||
        !get_bound(c, s, "exclusiveMinimum", &xmin_set, &xmin) || !get_bound(c, s, "exclusiveMaximum", &xmax_set, &xmax)) {
        return NULL;
    }
    /* draft-04: boolean exclusiveMinimum / exclusiveMaximum qualify minimum / maximum */
    const struct kr_json *bx = kr_json_get(s, "exclusiveMinimum");
    if (bx && bx->type == KR_JSON_BOOL && bx->boolean && min_set) {
        xmin_set = true;
        xmin = min;
        min_set = false;
    }
    bx = kr_json_get(s, "exclusiveMaximum");
    if (bx && bx->type == KR_JSON_BOOL && bx->boolean && max_set) {
        xmax_set = true;
        xmax = max;
        max_set = false;
    }
    if (!min_set && !max_set && !xmin_set && !xmax_set) {
        return integer ? integer_any(c) : number_any(c);
    }
    /* the tighter of each pair, rounded inwards to an integer bound (exclusive only when it was an
     * integer already) */
    bool lo_set = min_set || xmin_set, hi_set = max_set || xmax_set, lo_x = false, hi_x = false;
    double lo = 0, hi = 0;
    if (lo_set) {
        bool use_x = xmin_set && (!min_set || xmin >= min);
        lo = use_x ? xmin : min;
        lo_x = use_x && floor(lo) == lo;
        lo = ceil(lo);
    }
    if (hi_set) {
        bool use_x = xmax_set && (!max_set || xmax <= max);
        hi = use_x ? xmax : max;
        hi_x = use_x && floor(hi) == hi;
        hi = floor(hi);
    }
    int64_t ilo = (int64_t)lo, ihi = (int64_t)hi;
    if (integer) {
        ilo += lo_x;
        ihi -= hi_x;
        if (lo_set && hi_set && ilo > ihi) {
            return sc_fail(c, NULL, "no integer lies within the bounds");
        }
        return int_range(c, lo_set, ilo, hi_set, ihi);
    }
    if (lo_set && hi_set && (ilo > ihi || (ilo == ihi && (lo_x || hi_x)))) {
        return sc_fail(c, NULL, "the bounds leave no number once rounded to integers (we only support integer-aligned "
                       "ranges for numbers)");
    }
    return dec_range(c, lo_set, ilo, lo_x, hi_set, ihi, hi_x);
}

static struct gx *sc_schema(struct sc *c, const struct kr_json *s)
{
    struct gb *b = c->b;
    if (b->st != KR_OK) {
        return NULL;
    }
    if (s->type == KR_JSON_BOOL) {
        return s->boolean ? value_any(c) : sc_fail(c, NULL, "the schema 'false' matches nothing");
    }
    if (s->type != KR_JSON_OBJECT) {
        return sc_fail(c, NULL, "a schema must be an object or a boolean");
    }
    if (c->depth >= SC_MAX_DEPTH) {
        return sc_fail(c, NULL, "schemas nested deeper than %d", SC_MAX_DEPTH);
    }
    for (size_t i = 0; i < s->n; i++) {
        const char *k = s->keys[i];
        if (!is_one_of(k, k_annotations) && !is_validation(k)) {
            return sc_fail(c, k, "keyword '%s' is not supported", k);
        }
    }
    if (kr_json_get(s, "$ref")) {
        return sc_ref(c, s);
    }
    static const char *const combinators[] = {"anyOf", "oneOf", "allOf"};
    for (int i = 0; i < 3; i++) {
        if (kr_json_get(s, combinators[i])) {
            c->depth++;
            struct gx *x = sc_combinator(c, s, combinators[i]);
            c->depth--;
            return x;
        }
    }
    int types;
    if (!schema_types(c, s, &types)) {
        return NULL;
    }
    if (kr_json_get(s, "enum") || kr_json_get(s, "const")) {
        return sc_enum(c, s, types);
    }
    if (types == T_ALL) {
        return value_any(c);
    }
    c->depth++;
    struct gx *alt = gx_list(b, GX_ALT);
    if (types & T_OBJECT) {
        alt = gx_add(b, alt, sc_object(c, s));
    }
    if (types & T_ARRAY) {
        alt = gx_add(b, alt, sc_array(c, s));
    }
    if (types & T_STRING) {
        alt = gx_add(b, alt, sc_string(c, s));
    }
    if (types & (T_NUMBER | T_INTEGER)) {
        alt = gx_add(b, alt, sc_number(c, s, !(types & T_NUMBER)));
    }
    if (types & T_BOOL) {
        alt = gx_add(b, alt, GX_ALT(b, gx_str(b, "true"), gx_str(b, "false")));
    }
    if (types & T_NULL) {
        alt = gx_add(b, alt, gx_str(b, "null"));
    }
    c->depth--;
    return alt;
}

/* ---- entry points ----------------------------------------------------------------------------------- */

static void sc_init(struct sc *c, struct gb *b, const struct kr_grammar_json_opts *opts)
{
    memset(c, 0, sizeof(*c));
    c->b = b;
    c->max_ws = opts && opts->max_ws >= 0 ? opts->max_ws : SC_DEFAULT_WS;
    if (c->max_ws > GB_MAX_REPEAT) {
        c->max_ws = GB_MAX_REPEAT;
    }
    c->r_ws = c->r_value = c->r_object = c->r_array = c->r_string = c->r_number = c->r_integer = -1;
}

enum kr_status kr_grammar_from_json_schema(const char *schema, size_t len, const struct kr_grammar_json_opts *opts,
                                           struct kr_grammar **out, struct kr_err *err)
{
    *out = NULL;
    struct kr_json *doc = NULL;
    struct kr_err jerr = {0};
    enum kr_status st = kr_json_parse(schema, len, &doc, &jerr);
    if (st != KR_OK) {
        return kr_err_set(err, st == KR_ERR_NOMEM ? st : KR_ERR_INVAL, "json schema: %s", jerr.msg);
    }
    struct gb b;
    gb_init(&b, err);
    struct sc c;
    sc_init(&c, &b, opts);
    c.root = doc;
    int32_t root = gb_rule_new(&b, "root");
    /* the root may be referenced ("#"): give it its rule first */
    c.refs = kr_malloc(16 * sizeof(*c.refs));
    if (!c.refs) {
        gb_fail(&b, KR_ERR_NOMEM, "json schema: out of memory");
    } else {
        c.cap_refs = 16;
        c.refs[c.n_refs++] = (struct sc_ref){doc, root};
    }
    gb_rule_set(&b, root, sc_schema(&c, doc));
    st = gb_finish(&b, root, out);
    gb_free(&b);
    kr_free(c.refs);
    kr_json_free(doc);
    return st;
}

enum kr_status kr_grammar_from_json_object(const struct kr_grammar_json_opts *opts, struct kr_grammar **out,
                                           struct kr_err *err)
{
    *out = NULL;
    struct gb b;
    gb_init(&b, err);
    struct sc c;
    sc_init(&c, &b, opts);
    int32_t root = gb_rule_new(&b, "root");
    gb_rule_set(&b, root, object_any(&c));
    enum kr_status st = gb_finish(&b, root, out);
    gb_free(&b);
    return st;
}

enum kr_status kr_grammar_from_choice(const char *const *choices, const size_t *lens, size_t n,
                                      struct kr_grammar **out, struct kr_err *err)
{
    *out = NULL;
    if (n == 0) {
        return kr_err_set(err, KR_ERR_INVAL, "choice: the list of choices is empty");
    }
    struct gb b;
    gb_init(&b, err);
    int32_t root = gb_rule_new(&b, "root");
    struct gx *alt = gx_list(&b, GX_ALT);
    for (size_t i = 0; i < n; i++) {
        if (kr_utf8_validate(choices[i], lens[i]) != lens[i]) {
            gb_fail(&b, KR_ERR_INVAL, "choice: choice %zu is not valid UTF-8", i);
            break;
        }
        alt = gx_add(&b, alt, gx_lit(&b, choices[i], lens[i]));
    }
    gb_rule_set(&b, root, alt);
    enum kr_status st = gb_finish(&b, root, out);
    gb_free(&b);
    return st;
}

/* ---- tool calls --------------------------------------------------------------------------------- */

/* A string member of the format object ("" when absent). */
static const char *spec_str(const struct kr_json *fmt, const char *key)
{
    const struct kr_json *v = kr_json_get(fmt, key);
    return v && v->type == KR_JSON_STRING ? v->str : "";
}

/* Whether a property schema is a plain string (written raw, string="true", in DSML): "type":
 * "string" and nothing else that validates. */
static bool dsml_plain_string(const struct kr_json *s)
{
    if (s->type != KR_JSON_OBJECT) {
        return false;
    }
    const struct kr_json *t = kr_json_get(s, "type");
    if (!t || t->type != KR_JSON_STRING || strcmp(t->str, "string") != 0) {
        return false;
    }
    for (size_t i = 0; i < s->n; i++) {
        if (strcmp(s->keys[i], "type") != 0 && is_validation(s->keys[i])) {
            return false;
        }
    }
    return true;
}

/* DeepSeek-V3.2's parameter elements for one tool's object schema `s` (see kr_grammar_from_tools). */
static struct gx *sc_dsml_params(struct sc *c, const struct kr_json *s)
{
    struct gb *b = c->b;
    const struct kr_json *props = s ? kr_json_get(s, "properties") : NULL, *req = s ? kr_json_get(s, "required") : NULL;
    if (props && props->type != KR_JSON_OBJECT) {
        return sc_fail(c, "properties", "must be an object");
    }
    struct gx *seq = gx_list(b, GX_SEQ);
    for (size_t i = 0; props && i < props->n; i++) {
        const bool plain = dsml_plain_string(&props->items[i]);
        struct gx *value;
        if (plain) {
            static const uint32_t lt[] = {'<', '<'};
            value = gx_rep(b, gx_class(b, lt, 1, true), 0, -1); /* raw text up to the closing element */
        } else {
            size_t saved = path_push(c, "properties");
            value = sc_sub(c, &props->items[i], props->keys[i]);
            path_pop(c, saved);
        }
        struct gx *open = GX_SEQ(b, gx_str(b, "<｜DSML｜parameter name=\""), gx_str(b, props->keys[i]),
                                 gx_str(b, plain ? "\" string=\"true\">" : "\" string=\"false\">"));
        struct gx *param = GX_SEQ(b, open, value, gx_str(b, "</｜DSML｜parameter>\n"));
        seq = gx_add(b, seq, is_required(req && req->type == KR_JSON_ARRAY ? req : NULL, props->keys[i])
                                 ? param : gx_rep(b, param, 0, 1));
    }
    return seq;
}

/* qwen3_coder: whether a parameter's schema allows a string (or says nothing of its type), the
 * rule by which the parser (api/tools.c, kr_tool_parse) takes its raw text as a JSON string. */
static bool xml_allows_string(const struct kr_json *s, int depth)
{
    if (s->type != KR_JSON_OBJECT || depth > 16) {
        return true;
    }
    const struct kr_json *t = kr_json_get(s, "type");
    if (t && t->type == KR_JSON_STRING) {
        return strcmp(t->str, "string") == 0;
    }
    if (t && t->type == KR_JSON_ARRAY) {
        for (size_t i = 0; i < t->n; i++) {
            if (t->items[i].type == KR_JSON_STRING && strcmp(t->items[i].str, "string") == 0) {
                return true;
            }
        }
        return false;
    }
    if (t) {
        return true;
    }
    bool alts = false;
    static const char *const keys[] = {"anyOf", "oneOf"};
    for (size_t k = 0; k < 2; k++) {
        const struct kr_json *l = kr_json_get(s, keys[k]);
        for (size_t i = 0; l && l->type == KR_JSON_ARRAY && i < l->n; i++) {
            alts = true;
            if (xml_allows_string(&l->items[i], depth + 1)) {
                return true;
            }
        }
    }
    if (alts) {
        return false;
    }
    const struct kr_json *e = kr_json_get(s, "enum"), *k = kr_json_get(s, "const");
    if (e && e->type == KR_JSON_ARRAY) {
        for (size_t i = 0; i < e->n; i++) {
            if (e->items[i].type == KR_JSON_STRING) {
                return true;
            }
        }
        return false;
    }
    return k ? k->type == KR_JSON_STRING : true;
}

/* Whether "</parameter>" occurs in t[0..n). */
static bool xml_has_close(const char *t, size_t n)
{
    for (size_t i = 0; i + 12 <= n; i++) {
        if (memcmp(t + i, "</parameter>", 12) == 0) {
            return true;
        }
    }
    return false;
}

/* Raw text in which "</parameter>" does not occur: after a '<', the closing tag's next characters
 * may follow as far as a character that breaks it ('<' starts over), or the text may end there. */
static struct gx *xml_raw_text(struct gb *b)
{
    static const char tail[] = "/parameter>"; /* the tag after its '<'; no '<' in it */
    static const uint32_t lt[] = {'<', '<'};
    struct gx *again = gx_list(b, GX_ALT), *out = gx_list(b, GX_ALT), *stop = gx_list(b, GX_ALT);
    for (size_t k = 0; k < sizeof tail - 1; k++) {
        const uint32_t br[] = {'<', '<', (uint32_t)tail[k], (uint32_t)tail[k]};
        again = gx_add(b, again, GX_SEQ(b, gx_lit(b, tail, k), gx_char(b, '<')));
        out = gx_add(b, out, GX_SEQ(b, gx_lit(b, tail, k), gx_class(b, br, 2, true)));
        stop = gx_add(b, stop, gx_lit(b, tail, k));
    }
    struct gx *piece = GX_ALT(b, gx_class(b, lt, 1, true), GX_SEQ(b, gx_char(b, '<'), gx_rep(b, again, 0, -1), out));
    return GX_SEQ(b, gx_rep(b, piece, 0, -1),
                  gx_rep(b, GX_SEQ(b, gx_char(b, '<'), gx_rep(b, again, 0, -1), stop), 0, 1));
}

/* qwen3_coder's parameter elements for one tool's object schema `s` (see kr_grammar_from_tools). */
static struct gx *sc_xml_params(struct sc *c, const struct kr_json *s)
{
    struct gb *b = c->b;
    const struct kr_json *props = s ? kr_json_get(s, "properties") : NULL, *req = s ? kr_json_get(s, "required") : NULL;
    if (props && props->type != KR_JSON_OBJECT) {
        return sc_fail(c, "properties", "must be an object");
    }
    struct gx *seq = gx_list(b, GX_SEQ);
    for (size_t i = 0; props && i < props->n; i++) {
        const struct kr_json *p = &props->items[i];
        struct gx *value = NULL;
        if (xml_allows_string(p, 0)) {
            /* the text is the string: an enum's (or const's) strings, else any raw text */
            const struct kr_json *e = p->type == KR_JSON_OBJECT ? kr_json_get(p, "enum") : NULL;
            const struct kr_json *k = p->type == KR_JSON_OBJECT ? kr_json_get(p, "const") : NULL;
            const bool listed = e && e->type == KR_JSON_ARRAY;
            const struct kr_json *vals = listed ? e->items : k;
            const size_t n = listed ? e->n : k ? 1 : 0;
            struct gx *alt = gx_list(b, GX_ALT);
            bool some = false;
            for (size_t j = 0; j < n; j++) {
                if (vals[j].type == KR_JSON_STRING && !xml_has_close(vals[j].str, vals[j].str_len)) {
                    alt = gx_add(b, alt, gx_lit(b, vals[j].str, vals[j].str_len));
                    some = true;
                }
            }
            value = some ? alt : xml_raw_text(b);
        } else {
            size_t saved = path_push(c, "properties");
            value = sc_sub(c, p, props->keys[i]);
            path_pop(c, saved);
        }
        struct gx *param = GX_SEQ(b, gx_str(b, "<parameter="), gx_str(b, props->keys[i]), gx_str(b, ">\n"), value,
                                  gx_str(b, "\n</parameter>\n"));
        seq = gx_add(b, seq, is_required(req && req->type == KR_JSON_ARRAY ? req : NULL, props->keys[i])
                                 ? param : gx_rep(b, param, 0, 1));
    }
    return seq;
}

enum kr_status kr_grammar_from_tools(const char *spec, size_t len, const struct kr_grammar_json_opts *opts,
                                     struct kr_grammar **out, struct kr_err *err)
{
    *out = NULL;
    struct kr_json *doc = NULL;
    struct kr_err jerr = {0};
    enum kr_status st = kr_json_parse(spec, len, &doc, &jerr);
    if (st != KR_OK) {
        return kr_err_set(err, st == KR_ERR_NOMEM ? st : KR_ERR_INVAL, "tools: %s", jerr.msg);
    }
    const struct kr_json *fmt = kr_json_get(doc, "format"), *tools = kr_json_get(doc, "tools");
    int64_t max_calls = 0;
    const struct kr_json *mc = kr_json_get(doc, "max_calls");
    if (!fmt || fmt->type != KR_JSON_OBJECT || !tools || tools->type != KR_JSON_ARRAY || tools->n == 0 ||
        (mc && !kr_json_as_int(mc, &max_calls)) || max_calls < 0 || max_calls > GB_MAX_REPEAT) {
        kr_json_free(doc);
        return kr_err_set(err, KR_ERR_INVAL, "tools: a malformed tool-call specification");
    }
    const struct kr_json *dsml = kr_json_get(fmt, "dsml");
    const bool is_dsml = dsml && dsml->type == KR_JSON_BOOL && dsml->boolean;
    const struct kr_json *xml = kr_json_get(fmt, "xml");
    const bool is_xml = xml && xml->type == KR_JSON_BOOL && xml->boolean;
    struct gb b;
    gb_init(&b, err);
    struct sc c;
    sc_init(&c, &b, opts);
    int32_t root = gb_rule_new(&b, "root");
    struct gx *alt = gx_list(&b, GX_ALT);
    for (size_t i = 0; i < tools->n && b.st == KR_OK; i++) {
        const struct kr_json *t = &tools->items[i];
        const struct kr_json *name = kr_json_get(t, "name"), *params = kr_json_get(t, "parameters");
        if (!name || name->type != KR_JSON_STRING) {
            gb_fail(&b, KR_ERR_INVAL, "tools[%zu].function.name: missing", i);
            break;
        }
        /* each tool's schema is a document of its own: "#" pointers resolve within it */
        c.root = params;
        c.path_len = 0;
        c.path[0] = '\0';
        struct gx *args;
        if (is_dsml) {
            args = sc_dsml_params(&c, params);
        } else if (is_xml) {
            args = sc_xml_params(&c, params);
        } else if (params) {
            int32_t r = sc_rule(&c, "arguments");
            if (c.n_refs == c.cap_refs) { /* the tool's "#" is its own parameters schema */
                const size_t cap = c.cap_refs ? c.cap_refs * 2 : 16;
                struct sc_ref *v = kr_realloc(c.refs, cap * sizeof(*v));
                if (!v) {
                    gb_fail(&b, KR_ERR_NOMEM, "tools: out of memory");
                    break;
                }
                c.refs = v;
                c.cap_refs = cap;
            }
            c.refs[c.n_refs++] = (struct sc_ref){params, r};
            gb_rule_set(&b, r, sc_schema(&c, params));
            args = gx_ref(&b, r);
        } else {
            args = object_any(&c);
        }
        if (b.st != KR_OK) {
            /* name the tool's field ahead of the schema's own pointer */
            char head[64];
            const int n = snprintf(head, sizeof head, "tools[%zu].function.parameters: ", i);
            const size_t have = strnlen(err->msg, sizeof err->msg - 1);
            const size_t keep = have + (size_t)n < sizeof err->msg ? have : sizeof err->msg - 1 - (size_t)n;
            memmove(err->msg + n, err->msg, keep);
            memcpy(err->msg, head, (size_t)n);
            err->msg[(size_t)n + keep] = '\0';
            break;
        }
        alt = gx_add(&b, alt, GX_SEQ(&b, gx_str(&b, spec_str(fmt, "prefix")), gx_lit(&b, name->str, name->str_len),
                                     gx_str(&b, spec_str(fmt, "mid")), args, gx_str(&b, spec_str(fmt, "suffix"))));
    }
    int32_t r_call = gb_rule_new(&b, "call");
    gb_rule_set(&b, r_call, alt);
    struct gx *more = gx_rep(&b, GX_SEQ(&b, gx_str(&b, spec_str(fmt, "sep")), gx_ref(&b, r_call)), 0,
                             max_calls ? (int32_t)max_calls - 1 : -1);
    gb_rule_set(&b, root, GX_SEQ(&b, gx_str(&b, spec_str(fmt, "begin")), gx_ref(&b, r_call), more,
                                 gx_str(&b, spec_str(fmt, "end"))));
    st = gb_finish(&b, root, out);
    gb_free(&b);
    kr_free(c.refs);
    kr_json_free(doc);
    return st;
}
