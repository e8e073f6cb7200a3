/* GBNF text (llama.cpp's grammar format) to grammar expressions:
 *
 *     root  ::= expr                  # a comment
 *     expr  ::= term (("+" | "-") term)*
 *     term  ::= [0-9]+ | "(" expr ")"
 *
 * Rules are `name ::= alternatives`; a body runs on across lines until the next `name ::=` (so a
 * continuation line may start with `|`, which llama.cpp does not allow: we accept a superset).
 * Elements: "literal", [class] and [^class] over code points, `.` (any character), rule names,
 * ( groups ), each optionally followed by * + ? {m} {m,} {m,n}. Escapes in literals and classes:
 * \n \r \t \\ \" \' \[ \] \- \^ \/ \xHH \uHHHH \UHHHHHHHH. */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"
#include "utf8.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

struct ep {
    struct gb *b;
    const char *s;
    size_t n, i;
    int depth;
    size_t *ref_at; /* [cap_ref] offset of the first reference to each rule */
    int32_t cap_ref;
};

#define EBNF_MAX_DEPTH 200 /* nesting of groups */

static void line_col(const struct ep *p, size_t at, int *line, int *col)
{
    *line = 1;
    *col = 1;
    for (size_t k = 0; k < at && k < p->n; k++) {
        if (p->s[k] == '\n') {
            (*line)++;
            *col = 1;
        } else if (((unsigned char)p->s[k] & 0xC0) != 0x80) {
            (*col)++;
        }
    }
}

static struct gx *ep_fail(struct ep *p, size_t at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static struct gx *ep_fail(struct ep *p, size_t at, const char *fmt, ...)
{
    int line, col;
    line_col(p, at, &line, &col);
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    gb_fail(p->b, KR_ERR_INVAL, "grammar: line %d column %d: %s", line, col, what);
    return NULL;
}

static bool is_name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

/* Skips spaces, tabs, newlines and comments. */
static void skip_space(struct ep *p)
{
    while (p->i < p->n) {
        char c = p->s[p->i];
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
            p->i++;
        } else if (c == '#') {
            while (p->i < p->n && p->s[p->i] != '\n') {
                p->i++;
            }
        } else {
            break;
        }
    }
}

static size_t name_end(const struct ep *p, size_t i)
{
    while (i < p->n && is_name_char(p->s[i])) {
        i++;
    }
    return i;
}

/* Whether a rule definition (`name ::=`) starts at p->i. */
static bool at_rule_start(const struct ep *p)
{
    size_t e = name_end(p, p->i);
    if (e == p->i) {
        return false;
    }
    while (e < p->n && (p->s[e] == ' ' || p->s[e] == '\t')) {
        e++;
    }
    return p->n - e >= 3 && memcmp(p->s + e, "::=", 3) == 0;
}

/* The rule called s[0..len), made (undefined) at its first mention. */
static int32_t rule_of(struct ep *p, const char *s, size_t len, size_t at)
{
    int32_t r = gb_rule_find(p->b, s, len);
    if (r >= 0) {
        return r;
    }
    char name[128];
    if (len >= sizeof(name)) {
        ep_fail(p, at, "rule name longer than %d bytes", 127);
        return -1;
    }
    memcpy(name, s, len);
    name[len] = '\0';
    r = gb_rule_new(p->b, name);
    if (r < 0) {
        return -1;
    }
    if (r >= p->cap_ref) {
        int32_t cap = p->cap_ref ? p->cap_ref * 2 : 64;
        size_t *v = kr_realloc(p->ref_at, (size_t)cap * sizeof(size_t));
        if (!v) {
            gb_fail(p->b, KR_ERR_NOMEM, "grammar: out of memory");
            return -1;
        }
        p->ref_at = v;
        p->cap_ref = cap;
    }
    p->ref_at[r] = at;
    return r;
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

/* One character of a literal or class at p->i (escapes decoded); false on error (reported). */
static bool ep_char(struct ep *p, uint32_t *cp)
{
    size_t at = p->i;
    if (p->s[p->i] != '\\') {
        p->i += kr_utf8_next(p->s + p->i, cp);
        return true;
    }
    if (++p->i >= p->n) {
        ep_fail(p, at, "%s", "trailing backslash");
        return false;
    }
    char c = p->s[p->i++];
    int digits = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
    if (digits) {
        uint32_t v = 0;
        for (int k = 0; k < digits; k++, p->i++) {
            int h = p->i < p->n ? hexval(p->s[p->i]) : -1;
            if (h < 0) {
                ep_fail(p, at, "%s", "bad hexadecimal escape");
                return false;
            }
            v = v * 16 + (uint32_t)h;
        }
        if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
            ep_fail(p, at, "%s", "escape names no Unicode scalar value");
            return false;
        }
        *cp = v;
        return true;
    }
    switch (c) {
    case 'n': *cp = '\n'; return true;
    case 'r': *cp = '\r'; return true;
    case 't': *cp = '\t'; return true;
    case '\\': case '"': case '\'': case '[': case ']': case '-': case '^': case '/':
        *cp = (unsigned char)c;
        return true;
    default: {
        char esc[3] = {'\\', c, '\0'};
        ep_fail(p, at, "unknown escape %s", esc);
        return false;
    }
    }
}

static struct gx *ep_literal(struct ep *p)
{
    size_t at = p->i++;
    struct gx *seq = gx_list(p->b, GX_SEQ);
    while (seq) {
        if (p->i >= p->n || p->s[p->i] == '\n') {
            return ep_fail(p, at, "%s", "unterminated string literal");
        }
        if (p->s[p->i] == '"') {
            p->i++;
            break;
        }
        uint32_t cp;
        if (!ep_char(p, &cp)) {
            return NULL;
        }
        char u[4];
        seq = gx_add(p->b, seq, gx_lit(p->b, u, kr_utf8_put(cp, u)));
    }
    return seq;
}

static struct gx *ep_class(struct ep *p)
{
    size_t at = p->i++;
    bool negate = p->i < p->n && p->s[p->i] == '^';
    p->i += negate;
    uint32_t *r = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (p->i >= p->n) {
            return ep_fail(p, at, "%s", "unterminated character class");
        }
        if (p->s[p->i] == ']') {
            p->i++;
            break;
        }
        uint32_t lo, hi;
        if (!ep_char(p, &lo)) {
            return NULL;
        }
        hi = lo;
        if (p->i + 1 < p->n && p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
            size_t dash = p->i++;
            if (!ep_char(p, &hi)) {
                return NULL;
            }
            if (hi < lo) {
                return ep_fail(p, dash, "%s", "range out of order in character class");
            }
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 8;
            uint32_t *v = gb_alloc(p->b, cap * 2 * sizeof(uint32_t));
            if (!v) {
                return NULL;
            }
            if (n) {
                memcpy(v, r, n * 2 * sizeof(uint32_t));
            }
            r = v;
        }
        r[2 * n] = lo;
        r[2 * n + 1] = hi;
        n++;
    }
    return gx_class(p->b, r, n, negate);
}

static struct gx *ep_alternatives(struct ep *p, bool nested);

static bool ep_number(struct ep *p, long *v)
{
    size_t k = p->i;
    *v = 0;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        *v = *v * 10 + (p->s[p->i++] - '0');
        if (*v > 1000000) {
            *v = 1000000;
        }
    }
    return p->i > k;
}

static struct gx *ep_postfix(struct ep *p, struct gx *x)
{
    while (x && p->i < p->n) {
        char c = p->s[p->i];
        size_t at = p->i;
        long min, max;
        if (c == '*' || c == '+' || c == '?') {
            min = c == '+';
            max = c == '?' ? 1 : -1;
            p->i++;
        } else if (c == '{') {
            p->i++;
            skip_space(p);
            if (!ep_number(p, &min)) {
                return ep_fail(p, at, "%s", "expected a number after '{'");
            }
            skip_space(p);
            max = min;
            if (p->i < p->n && p->s[p->i] == ',') {
                p->i++;
                skip_space(p);
                if (!ep_number(p, &max)) {
                    max = -1;
                }
                skip_space(p);
            }
            if (p->i >= p->n || p->s[p->i] != '}') {
                return ep_fail(p, at, "%s", "expected '}'");
            }
            p->i++;
            if ((max >= 0 && max < min)) {
                return ep_fail(p, at, "%s", "repetition bounds out of order");
            }
            if (min > GB_MAX_REPEAT || max > GB_MAX_REPEAT) {
                return ep_fail(p, at, "repetition bound larger than %d", GB_MAX_REPEAT);
            }
        } else {
            break;
        }
        x = gx_rep(p->b, x, (int32_t)min, (int32_t)max);
    }
    return x;
}

static struct gx *ep_element(struct ep *p)
{
    char c = p->s[p->i];
    size_t at = p->i;
    if (c == '"') {
        return ep_literal(p);
    }
    if (c == '[') {
        return ep_class(p);
    }
    if (c == '.') {
        p->i++;
        return gx_class(p->b, NULL, 0, true);
    }
    if (c == '(') {
        p->i++;
        if (++p->depth > EBNF_MAX_DEPTH) {
            return ep_fail(p, at, "%s", "groups nested too deeply");
        }
        struct gx *x = ep_alternatives(p, true);
        p->depth--;
        if (x && (p->i >= p->n || p->s[p->i] != ')')) {
            return ep_fail(p, at, "%s", "missing ')'");
        }
        p->i++;
        return x;
    }
    size_t e = name_end(p, p->i);
    if (e > p->i) {
        p->i = e;
        return gx_ref(p->b, rule_of(p, p->s + at, e - at, at));
    }
    char what[8];
    if ((unsigned char)c >= 0x20 && (unsigned char)c < 0x7F) {
        snprintf(what, sizeof(what), "'%c'", c);
    } else {
        snprintf(what, sizeof(what), "0x%02X", (unsigned char)c);
    }
    return ep_fail(p, at, "unexpected character %s", what);
}

static struct gx *ep_alternatives(struct ep *p, bool nested)
{
    struct gx *alt = gx_list(p->b, GX_ALT);
    for (;;) {
        struct gx *seq = gx_list(p->b, GX_SEQ);
        for (;;) {
            skip_space(p);
            if (!seq || p->i >= p->n || p->s[p->i] == '|' || (nested && p->s[p->i] == ')') ||
                (!nested && at_rule_start(p))) {
                break;
            }
            if (!nested && p->s[p->i] == ')') {
                return ep_fail(p, p->i, "%s", "unmatched ')'");
            }
            seq = gx_add(p->b, seq, ep_postfix(p, ep_element(p)));
        }
        alt = gx_add(p->b, alt, seq);
        if (!alt || p->i >= p->n || p->s[p->i] != '|') {
            return alt;
        }
        p->i++;
    }
}

static void ep_parse(struct ep *p)
{
    skip_space(p);
    while (p->i < p->n && p->b->st == KR_OK) {
        size_t at = p->i, e = name_end(p, p->i);
        if (e == at) {
            ep_fail(p, at, "%s", "expected a rule name");
            return;
        }
        p->i = e;
        while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t')) {
            p->i++;
        }
        if (p->n - p->i < 3 || memcmp(p->s + p->i, "::=", 3) != 0) {
            ep_fail(p, p->i, "%s", "expected '::=' after the rule name");
            return;
        }
        p->i += 3;
        int32_t r = rule_of(p, p->s + at, e - at, at);
        if (r < 0) {
            return;
        }
        if (p->b->rules[r].body) {
            ep_fail(p, at, "rule '%s' is defined twice", p->b->rules[r].name);
            return;
        }
        struct gx *body = ep_alternatives(p, false);
        if (!body) {
            return;
        }
        gb_rule_set(p->b, r, body);
        line_col(p, at, &p->b->rules[r].line, &p->b->rules[r].col);
        skip_space(p);
    }
}

enum kr_status kr_grammar_from_gbnf(const char *text, size_t len, const char *start_rule, struct kr_grammar **out,
                                    struct kr_err *err)
{
    *out = NULL;
    struct gb b;
    gb_init(&b, err);
    struct ep p = {.b = &b, .s = text, .n = len};
    size_t bad = kr_utf8_validate(text, len);
    if (bad != len) {
        ep_fail(&p, bad, "%s", "invalid UTF-8");
    } else {
        ep_parse(&p);
    }
    const char *start = start_rule ? start_rule : "root";
    int32_t root = gb_rule_find(&b, start, strlen(start));
    for (int32_t r = 0; r < b.n_rules && b.st == KR_OK; r++) {
        if (!b.rules[r].body) {
            ep_fail(&p, p.ref_at[r], "undefined rule '%s'", b.rules[r].name);
        }
    }
    if (b.st == KR_OK && root < 0) {
        gb_fail(&b, KR_ERR_INVAL, "grammar: no rule named '%s'", start);
    }
    enum kr_status st = gb_finish(&b, root, out);
    kr_free(p.ref_at);
    gb_free(&b);
    return st;
}
