/* Regular expressions to grammar expressions: the ERE/PCRE subset that vLLM's guided_regex and
 * JSON Schema's `pattern` use (grammar.h lists it). Everything is parsed over code points; in
 * JSON string mode every character is written as JSON string content instead (so that a pattern
 * constrains the decoded value of a JSON string, as JSON Schema defines it). */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "utf8.h"

#include <stdio.h>
#include <string.h>

/* ---- JSON string content ------------------------------------------------------------------------ */

static bool class_has(const struct gx *c, uint32_t cp)
{
    size_t lo = 0, hi = c->cls.n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < c->cls.r[2 * mid]) {
            hi = mid;
        } else if (cp > c->cls.r[2 * mid + 1]) {
            lo = mid + 1;
        } else {
            return true;
        }
    }
    return false;
}

/* The escape we write for a character JSON does not allow raw in a string. */
static void json_escape(uint32_t cp, char out[8])
{
    static const char hex[] = "0123456789abcdef";
    switch (cp) {
    case '"': strcpy(out, "\\\""); return;
    case '\\': strcpy(out, "\\\\"); return;
    case '\b': strcpy(out, "\\b"); return;
    case '\f': strcpy(out, "\\f"); return;
    case '\n': strcpy(out, "\\n"); return;
    case '\r': strcpy(out, "\\r"); return;
    case '\t': strcpy(out, "\\t"); return;
    default:
        memcpy(out, "\\u00", 4);
        out[4] = hex[(cp >> 4) & 15];
        out[5] = hex[cp & 15];
        out[6] = '\0';
        return;
    }
}

struct gx *gx_json_chars(struct gb *b, struct gx *c)
{
    if (!c) {
        return NULL;
    }
    /* the raw part: the class without controls, '"' and '\' */
    uint32_t *raw = gb_alloc(b, (c->cls.n * 3 + 1) * 2 * sizeof(uint32_t));
    if (!raw) {
        return NULL;
    }
    static const uint32_t cut[][2] = {{0x00, 0x1F}, {0x22, 0x22}, {0x5C, 0x5C}};
    size_t n = 0;
    for (size_t i = 0; i < c->cls.n; i++) {
        uint32_t lo = c->cls.r[2 * i], hi = c->cls.r[2 * i + 1];
        for (size_t k = 0; k < 3 && lo <= hi; k++) {
            if (cut[k][1] < lo || cut[k][0] > hi) {
                continue;
            }
            if (cut[k][0] > lo) {
                raw[2 * n] = lo;
                raw[2 * n + 1] = cut[k][0] - 1;
                n++;
            }
            lo = cut[k][1] + 1;
        }
        if (lo <= hi) {
            raw[2 * n] = lo;
            raw[2 * n + 1] = hi;
            n++;
        }
    }
    struct gx *alt = gx_list(b, GX_ALT);
    if (n) {
        alt = gx_add(b, alt, gx_class(b, raw, n, false));
    }
    for (uint32_t cp = 0; cp <= 0x5C && alt; cp++) {
        if ((cp < 0x20 || cp == '"' || cp == '\\') && class_has(c, cp)) {
            char esc[8];
            json_escape(cp, esc);
            alt = gx_add(b, alt, gx_str(b, esc));
        }
    }
    return alt && alt->list.n == 1 ? alt->list.v[0] : alt;
}

/* ---- parser -------------------------------------------------------------------------------------- */

struct rxp {
    struct gb *b;
    const char *s;
    size_t n, i;
    const struct gx_regex_opts *o;
    const char *where;
    int depth;
};

#define RX_MAX_DEPTH 200 /* nesting of groups */

static struct gx *rx_fail(struct rxp *p, size_t at, const char *what)
{
    gb_fail(p->b, KR_ERR_INVAL, "%sregex: offset %zu: %s", p->where, at, what);
    return NULL;
}

/* A character class as an expression: its JSON content form in JSON string mode. */
static struct gx *rx_class(struct rxp *p, const uint32_t *r, size_t n, bool negate)
{
    struct gx *c = gx_class(p->b, r, n, negate);
    return p->o->json_string ? gx_json_chars(p->b, c) : c;
}

static const uint32_t digit_r[] = {'0', '9'};
static const uint32_t word_r[] = {'0', '9', 'A', 'Z', '_', '_', 'a', 'z'};
static const uint32_t space_r[] = {'\t', '\r', ' ', ' '};                 /* \t \n \v \f \r and space */
static const uint32_t dot_not_r[] = {'\n', '\n', '\r', '\r', 0x2028, 0x2029}; /* what `.` excludes */

struct ranges {
    uint32_t *v;
    size_t n, cap;
    struct gb *b;
};

static bool ranges_add(struct ranges *r, uint32_t lo, uint32_t hi)
{
    if (r->n == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 16;
        uint32_t *v = gb_alloc(r->b, cap * 2 * sizeof(uint32_t));
        if (!v) {
            return false;
        }
        if (r->n) {
            memcpy(v, r->v, r->n * 2 * sizeof(uint32_t));
        }
        r->v = v;
        r->cap = cap;
    }
    r->v[2 * r->n] = lo;
    r->v[2 * r->n + 1] = hi;
    r->n++;
    return true;
}

/* Adds set (n pairs) or its complement. */
static bool ranges_add_set(struct ranges *r, const uint32_t *set, size_t n, bool negate)
{
    if (!negate) {
        for (size_t i = 0; i < n; i++) {
            if (!ranges_add(r, set[2 * i], set[2 * i + 1])) {
                return false;
            }
        }
        return true;
    }
    uint32_t next = 0;
    for (size_t i = 0; i < n; i++) {
        if (set[2 * i] > next && !ranges_add(r, next, set[2 * i] - 1)) {
            return false;
        }
        next = set[2 * i + 1] + 1;
    }
    return ranges_add(r, next, 0x10FFFF);
}

static int hexval(char c)
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

/* n hex digits at p->i (or {...} when braces), as a code point; false on error (reported). */
static bool rx_hex(struct rxp *p, int n, bool braces_ok, uint32_t *cp)
{
    size_t at = p->i;
    uint32_t v = 0;
    if (braces_ok && p->i < p->n && p->s[p->i] == '{') {
        p->i++;
        int k = 0;
        for (; p->i < p->n && p->s[p->i] != '}'; p->i++, k++) {
            int h = hexval(p->s[p->i]);
            if (h < 0 || k >= 6) {
                rx_fail(p, at, "bad hexadecimal escape");
                return false;
            }
            v = v * 16 + (uint32_t)h;
        }
        if (p->i >= p->n || k == 0) {
            rx_fail(p, at, "bad hexadecimal escape");
            return false;
        }
        p->i++;
    } else {
        for (int k = 0; k < n; k++, p->i++) {
            int h = p->i < p->n ? hexval(p->s[p->i]) : -1;
            if (h < 0) {
                rx_fail(p, at, "bad hexadecimal escape");
                return false;
            }
            v = v * 16 + (uint32_t)h;
        }
    }
    if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
        rx_fail(p, at, "escape names no Unicode scalar value");
        return false;
    }
    *cp = v;
    return true;
}

/* An escape after '\' (p->i at the letter). A single character sets *cp and returns 1; a class
 * escape (\d \w \s and negations) adds to r and returns 2; 0 on error (reported). */
static int rx_escape(struct rxp *p, struct ranges *r, uint32_t *cp, bool in_class)
{
    size_t at = p->i - 1;
    if (p->i >= p->n) {
        rx_fail(p, at, "trailing backslash");
        return 0;
    }
    char c = p->s[p->i++];
    switch (c) {
    case 'd': case 'D':
        return ranges_add_set(r, digit_r, 1, c == 'D') ? 2 : 0;
    case 'w': case 'W':
        return ranges_add_set(r, word_r, 4, c == 'W') ? 2 : 0;
    case 's': case 'S':
        return ranges_add_set(r, space_r, 2, c == 'S') ? 2 : 0;
    case 't': *cp = '\t'; return 1;
    case 'n': *cp = '\n'; return 1;
    case 'r': *cp = '\r'; return 1;
    case 'f': *cp = '\f'; return 1;
    case 'v': *cp = '\v'; return 1;
    case '0':
        if (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
            rx_fail(p, at, "octal escapes are not supported");
            return 0;
        }
        *cp = 0;
        return 1;
    case 'x':
        return rx_hex(p, 2, true, cp) ? 1 : 0;
    case 'u':
        return rx_hex(p, 4, true, cp) ? 1 : 0;
    case 'b':
        if (in_class) { /* backspace inside a class, as in PCRE and ECMAScript */
            *cp = '\b';
            return 1;
        }
        rx_fail(p, at, "word boundary \\b is not supported");
        return 0;
    default:
        break;
    }
    if ((c >= '0' && c <= '9')) {
        rx_fail(p, at, "backreferences are not supported");
        return 0;
    }
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
        char msg[64];
        snprintf(msg, sizeof(msg), "escape \\%c is not supported", c);
        rx_fail(p, at, msg);
        return 0;
    }
    if ((unsigned char)c >= 0x80) {
        rx_fail(p, at, "escaped non-ASCII character");
        return 0;
    }
    *cp = (unsigned char)c;
    return 1;
}

static struct gx *rx_bracket(struct rxp *p)
{
    size_t at = p->i++;
    bool negate = false;
    if (p->i < p->n && p->s[p->i] == '^') {
        negate = true;
        p->i++;
    }
    struct ranges r = {.b = p->b};
    bool first = true;
    for (;;) {
        if (p->i >= p->n) {
            return rx_fail(p, at, "unterminated character class");
        }
        if (p->s[p->i] == ']' && !first) {
            p->i++;
            break;
        }
        first = false;
        if (p->s[p->i] == '[' && p->i + 1 < p->n && (p->s[p->i + 1] == ':' || p->s[p->i + 1] == '=' ||
                                                      p->s[p->i + 1] == '.')) {
            return rx_fail(p, p->i, "POSIX classes like [:alpha:] are not supported");
        }
        uint32_t lo;
        int kind = 1;
        if (p->s[p->i] == '\\') {
            p->i++;
            kind = rx_escape(p, &r, &lo, true);
            if (kind == 0) {
                return NULL;
            }
            if (kind == 2) {
                continue;
            }
        } else {
            p->i += kr_utf8_next(p->s + p->i, &lo);
        }
        uint32_t hi = lo;
        if (p->i + 1 < p->n && p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
            size_t dash = p->i++;
            if (p->s[p->i] == '\\') {
                p->i++;
                struct ranges tmp = {.b = p->b};
                int k = rx_escape(p, &tmp, &hi, true);
                if (k == 0) {
                    return NULL;
                }
                if (k == 2) {
                    return rx_fail(p, dash, "a class escape cannot end a range");
                }
            } else {
                p->i += kr_utf8_next(p->s + p->i, &hi);
            }
            if (hi < lo) {
                return rx_fail(p, dash, "range out of order in character class");
            }
        }
        if (!ranges_add(&r, lo, hi)) {
            return NULL;
        }
    }
    return rx_class(p, r.v, r.n, negate);
}

static struct gx *rx_alt(struct rxp *p, bool top);

static struct gx *rx_group(struct rxp *p)
{
    size_t at = p->i++;
    if (p->i < p->n && p->s[p->i] == '?') {
        size_t q = p->i + 1;
        if (q < p->n && p->s[q] == ':') {
            p->i = q + 1;
        } else if (q < p->n && (p->s[q] == '<' || (p->s[q] == 'P' && q + 1 < p->n && p->s[q + 1] == '<')) &&
                   !(p->s[q] == '<' && q + 1 < p->n && (p->s[q + 1] == '=' || p->s[q + 1] == '!'))) {
            size_t k = p->s[q] == 'P' ? q + 2 : q + 1; /* a named group: the name does not matter */
            while (k < p->n && p->s[k] != '>') {
                k++;
            }
            if (k >= p->n) {
                return rx_fail(p, at, "unterminated group name");
            }
            p->i = k + 1;
        } else if (q < p->n && (p->s[q] == '=' || p->s[q] == '!' || p->s[q] == '<')) {
            return rx_fail(p, at, "lookaround assertions are not supported");
        } else {
            return rx_fail(p, at, "group flags and extensions (?...) are not supported");
        }
    }
    if (++p->depth > RX_MAX_DEPTH) {
        return rx_fail(p, at, "groups nested too deeply");
    }
    struct gx *x = rx_alt(p, false);
    p->depth--;
    if (!x) {
        return NULL;
    }
    if (p->i >= p->n || p->s[p->i] != ')') {
        return rx_fail(p, at, "missing ')'");
    }
    p->i++;
    return x;
}

/* {m}, {m,}, {m,n} or {,n} at p->i: true with the bounds, false (p->i unchanged) when the brace is
 * a literal. */
static bool rx_braces(struct rxp *p, long *min, long *max)
{
    size_t k = p->i + 1;
    long a = -1, c = -1;
    bool comma = false;
    for (; k < p->n && p->s[k] >= '0' && p->s[k] <= '9'; k++) {
        a = (a < 0 ? 0 : a) * 10 + (p->s[k] - '0');
        if (a > 1000000) {
            a = 1000000;
        }
    }
    if (k < p->n && p->s[k] == ',') {
        comma = true;
        for (k++; k < p->n && p->s[k] >= '0' && p->s[k] <= '9'; k++) {
            c = (c < 0 ? 0 : c) * 10 + (p->s[k] - '0');
            if (c > 1000000) {
                c = 1000000;
            }
        }
    }
    if (k >= p->n || p->s[k] != '}' || (a < 0 && c < 0)) {
        return false;
    }
    *min = a < 0 ? 0 : a;
    *max = comma ? c : a;
    p->i = k + 1;
    return true;
}

static struct gx *rx_atom(struct rxp *p)
{
    char c = p->s[p->i];
    if (c == '(') {
        return rx_group(p);
    }
    if (c == '[') {
        return rx_bracket(p);
    }
    if (c == '.') {
        p->i++;
        return rx_class(p, dot_not_r, 3, true);
    }
    if (c == '*' || c == '+' || c == '?') {
        return rx_fail(p, p->i, "nothing to repeat");
    }
    uint32_t cp;
    if (c == '\\') {
        struct ranges r = {.b = p->b};
        p->i++;
        int k = rx_escape(p, &r, &cp, false);
        if (k == 0) {
            return NULL;
        }
        if (k == 2) {
            return rx_class(p, r.v, r.n, false);
        }
    } else {
        p->i += kr_utf8_next(p->s + p->i, &cp);
    }
    uint32_t one[2] = {cp, cp};
    return rx_class(p, one, 1, false);
}

static struct gx *rx_quantified(struct rxp *p)
{
    struct gx *x = rx_atom(p);
    while (x && p->i < p->n) {
        char c = p->s[p->i];
        long min, max;
        size_t q = p->i;
        if (c == '*' || c == '+' || c == '?') {
            min = c == '+';
            max = c == '?' ? 1 : -1;
            p->i++;
        } else if (c == '{' && rx_braces(p, &min, &max)) {
            if (max >= 0 && max < min) {
                return rx_fail(p, q, "repetition bounds out of order");
            }
            if (min > GB_MAX_REPEAT || max > GB_MAX_REPEAT) {
                char msg[96];
                snprintf(msg, sizeof(msg), "repetition bound larger than %d", GB_MAX_REPEAT);
                return rx_fail(p, q, msg);
            }
        } else {
            break;
        }
        if (p->i < p->n && p->s[p->i] == '+') {
            return rx_fail(p, p->i, "possessive quantifiers are not supported");
        }
        if (p->i < p->n && p->s[p->i] == '?') { /* lazy: same language */
            p->i++;
        }
        x = gx_rep(p->b, x, (int32_t)min, (int32_t)max);
    }
    return x;
}

/* One alternative. At the top level, ^ may open it and $ close it. */
static struct gx *rx_seq(struct rxp *p, bool top, bool *anchor_start, bool *anchor_end)
{
    struct gx *seq = gx_list(p->b, GX_SEQ);
    *anchor_start = *anchor_end = false;
    if (top && p->i < p->n && p->s[p->i] == '^') {
        *anchor_start = true;
        p->i++;
    }
    while (seq && p->i < p->n && p->s[p->i] != '|' && p->s[p->i] != ')') {
        char c = p->s[p->i];
        if (c == '$') {
            size_t k = p->i + 1;
            if (top && (k == p->n || p->s[k] == '|')) {
                *anchor_end = true;
                p->i++;
                break;
            }
            return rx_fail(p, p->i, "'$' is only supported at the end of the pattern");
        }
        if (c == '^') {
            return rx_fail(p, p->i, "'^' is only supported at the start of the pattern");
        }
        seq = gx_add(p->b, seq, rx_quantified(p));
    }
    return seq;
}

static struct gx *rx_any(struct rxp *p)
{
    uint32_t all[2] = {0, 0x10FFFF};
    return gx_rep(p->b, rx_class(p, all, 1, false), 0, -1);
}

static struct gx *rx_alt(struct rxp *p, bool top)
{
    struct gx *alt = gx_list(p->b, GX_ALT);
    for (;;) {
        bool s, e;
        struct gx *x = rx_seq(p, top, &s, &e);
        if (x && top && p->o->search) { /* unanchored ends match anything */
            x = GX_SEQ(p->b, s ? gx_empty(p->b) : rx_any(p), x, e ? gx_empty(p->b) : rx_any(p));
        }
        alt = gx_add(p->b, alt, x);
        if (!alt || p->i >= p->n || p->s[p->i] != '|') {
            break;
        }
        p->i++;
    }
    return alt;
}

struct gx *gx_regex(struct gb *b, const char *re, size_t len, const struct gx_regex_opts *o, const char *where)
{
    struct rxp p = {.b = b, .s = re, .n = len, .o = o, .where = where ? where : ""};
    size_t bad = kr_utf8_validate(re, len);
    if (bad != len) {
        return rx_fail(&p, bad, "invalid UTF-8");
    }
    struct gx *x = rx_alt(&p, true);
    if (x && p.i < p.n) {
        return rx_fail(&p, p.i, "unmatched ')'");
    }
    return x;
}

enum kr_status kr_grammar_from_regex(const char *re, size_t len, struct kr_grammar **out, struct kr_err *err)
{
    *out = NULL;
    struct gb b;
    gb_init(&b, err);
    struct gx_regex_opts o = {0};
    int32_t root = gb_rule_new(&b, "root");
    gb_rule_set(&b, root, gx_regex(&b, re, len, &o, ""));
    enum kr_status st = gb_finish(&b, root, out);
    gb_free(&b);
    return st;
}
