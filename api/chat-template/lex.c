/* The chat-template lexer, after jinja2/lexer.py (3.1) configured as transformers configures it:
 * template data with the tags' whitespace control (trim_blocks, lstrip_blocks, -, +), {% raw %},
 * comments, and the tokens inside {{ }} and {% %} (names, string literals with Python's escapes,
 * numbers, operators). */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum kr_status ct_syntax_err(struct kr_err *err, int line, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    return kr_err_set(err, KR_ERR_FORMAT, "chat template line %d: %s", line, msg);
}

static enum kr_status push_tok(struct lexer *lx, struct token t)
{
    if (lx->n_toks == lx->cap_toks) {
        size_t cap = lx->cap_toks ? lx->cap_toks * 2 : 256;
        struct token *v = kr_realloc(lx->toks, cap * sizeof(*v));
        if (!v) {
            return KR_ERR_NOMEM;
        }
        lx->toks = v;
        lx->cap_toks = cap;
    }
    t.line = lx->line;
    lx->toks[lx->n_toks++] = t;
    return KR_OK;
}

size_t ct_py_space_len(const char *s, size_t n, size_t i)
{
    uint32_t cp;
    if (i >= n) {
        return 0;
    }
    if ((unsigned char)s[i] < 0x80) {
        return kr_uni_is_py_space((unsigned char)s[i]) ? 1 : 0;
    }
    size_t l = kr_utf8_next(s + i, &cp);
    return kr_uni_is_py_space(cp) ? l : 0;
}

/* Length of s[0..n) without trailing Python whitespace (str.rstrip()). */
size_t ct_py_rstrip_len(const char *s, size_t n)
{
    while (n > 0) {
        size_t k = n - 1;
        while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80) {
            k--;
        }
        if (!ct_py_space_len(s, n, k)) {
            break;
        }
        n = k;
    }
    return n;
}

static size_t skip_py_space(const char *s, size_t n, size_t i)
{
    size_t l;
    while ((l = ct_py_space_len(s, n, i)) > 0) {
        i += l;
    }
    return i;
}

static size_t count_nl(const char *s, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++) {
        c += s[i] == '\n';
    }
    return c;
}

/* Emits template data, applying the begin tag's whitespace control (OptionalLStrip). */
static enum kr_status emit_data(struct lexer *lx, const char *text, size_t n, char sign, bool lstrip_ok,
                                bool line_starting)
{
    size_t keep = n;
    if (sign == '-') {
        keep = ct_py_rstrip_len(text, n);
    } else if (sign != '+' && lstrip_ok) {
        size_t l_pos = n;
        while (l_pos > 0 && text[l_pos - 1] != '\n') {
            l_pos--;
        }
        if ((l_pos > 0 || line_starting) && l_pos < n && skip_py_space(text, n, l_pos) == n) {
            keep = l_pos;
        }
    }
    enum kr_status st = KR_OK;
    if (keep > 0) {
        st = push_tok(lx, (struct token){.t = T_DATA, .s = text, .len = keep});
    }
    lx->line += (int)count_nl(text, n);
    return st;
}

static const char *const OPS[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[", "]", "(",
                                  ")", "{", "}", ">", "<", "=", ".", ":", "|", ",", ";"};

/* Decodes a string literal body with Python's unicode-escape rules. */
static enum kr_status unescape(struct lexer *lx, const char *s, size_t n, struct token *t)
{
    struct kr_buf_s b = {0};
    enum kr_status st = kr_bs_reserve(&b, n);
    for (size_t i = 0; i < n && st == KR_OK; i++) {
        if (s[i] != '\\' || i + 1 >= n) {
            st = kr_bs_putc(&b, s[i]);
            continue;
        }
        char e = s[++i];
        uint32_t cp = 0;
        int digits = 0;
        switch (e) {
        case '\n': continue;
        case '\\': st = kr_bs_putc(&b, '\\'); continue;
        case '\'': st = kr_bs_putc(&b, '\''); continue;
        case '"': st = kr_bs_putc(&b, '"'); continue;
        case 'a': st = kr_bs_putc(&b, '\a'); continue;
        case 'b': st = kr_bs_putc(&b, '\b'); continue;
        case 'f': st = kr_bs_putc(&b, '\f'); continue;
        case 'n': st = kr_bs_putc(&b, '\n'); continue;
        case 'r': st = kr_bs_putc(&b, '\r'); continue;
        case 't': st = kr_bs_putc(&b, '\t'); continue;
        case 'v': st = kr_bs_putc(&b, '\v'); continue;
        case 'x': digits = 2; break;
        case 'u': digits = 4; break;
        case 'U': digits = 8; break;
        default:
            if (e >= '0' && e <= '7') {
                int k = 0;
                for (; k < 3 && i < n && s[i] >= '0' && s[i] <= '7'; k++, i++) {
                    cp = cp * 8 + (uint32_t)(s[i] - '0');
                }
                i--;
                st = kr_bs_put_cp(&b, cp);
            } else {
                st = kr_bs_putc(&b, '\\');
                if (st == KR_OK) {
                    st = kr_bs_putc(&b, e);
                }
            }
            continue;
        }
        for (int k = 0; k < digits; k++) {
            char h = i + 1 + (size_t)k < n ? s[i + 1 + (size_t)k] : 0;
            int v = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
            if (v < 0) {
                kr_bs_free(&b);
                return ct_syntax_err(lx->err, lx->line, "truncated \\%c escape in a string literal", e);
            }
            cp = cp * 16 + (uint32_t)v;
        }
        i += (size_t)digits;
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
            kr_bs_free(&b);
            return ct_syntax_err(lx->err, lx->line, "invalid code point in a string literal escape");
        }
        st = kr_bs_put_cp(&b, cp);
    }
    if (st == KR_OK) {
        char *p = ct_a_alloc(lx->arena, b.len + 1);
        if (!p) {
            st = KR_ERR_NOMEM;
        } else {
            memcpy(p, b.p, b.len + 1);
            t->s = p;
            t->len = b.len;
        }
    }
    kr_bs_free(&b);
    return st;
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

/* Matches jinja's float_re at pos; returns its length or 0. */
static size_t match_float(const char *s, size_t n, size_t i)
{
    if (i > 0 && s[i - 1] == '.') {
        return 0;
    }
    size_t k = i;
    while (k < n && (is_digit(s[k]) || (s[k] == '_' && k + 1 < n && is_digit(s[k + 1]) && k > i))) {
        k++;
    }
    if (k == i) {
        return 0;
    }
    size_t frac = k;
    if (k < n && s[k] == '.' && k + 1 < n && is_digit(s[k + 1])) {
        frac = k + 1;
        while (frac < n && (is_digit(s[frac]) || (s[frac] == '_' && frac + 1 < n && is_digit(s[frac + 1])))) {
            frac++;
        }
    }
    size_t e = frac;
    if (e < n && (s[e] == 'e' || s[e] == 'E')) {
        size_t x = e + 1;
        if (x < n && (s[x] == '+' || s[x] == '-')) {
            x++;
        }
        if (x < n && is_digit(s[x])) {
            while (x < n && (is_digit(s[x]) || (s[x] == '_' && x + 1 < n && is_digit(s[x + 1])))) {
                x++;
            }
            return x - i;
        }
    }
    return frac > k ? frac - i : 0;
}

static enum kr_status lex_tag(struct lexer *lx, bool block, bool *line_starting)
{
    const char *s = lx->src;
    size_t n = lx->n;
    int depth = 0;
    for (;;) {
        size_t i = lx->pos;
        if (i >= n) {
            return ct_syntax_err(lx->err, lx->line, "unexpected end of template, expected '%s'", block ? "%}" : "}}");
        }
        if (depth == 0) {
            if (block && s[i] == '+' && i + 2 < n + 0 && strncmp(s + i, "+%}", 3) == 0) {
                lx->pos = i + 3;
                *line_starting = false;
                return push_tok(lx, (struct token){.t = T_BLOCK_END});
            }
            if (strncmp(s + i, block ? "-%}" : "-}}", 3) == 0) {
                size_t j = skip_py_space(s, n, i + 3);
                lx->line += (int)count_nl(s + i, j - i);
                lx->pos = j;
                *line_starting = j > i + 3 && s[j - 1] == '\n';
                return push_tok(lx, (struct token){.t = block ? T_BLOCK_END : T_VAR_END});
            }
            if (strncmp(s + i, block ? "%}" : "}}", 2) == 0) {
                size_t j = i + 2;
                if (block && j < n && s[j] == '\n') { /* trim_blocks */
                    j++;
                    lx->line++;
                }
                lx->pos = j;
                *line_starting = s[j - 1] == '\n';
                return push_tok(lx, (struct token){.t = block ? T_BLOCK_END : T_VAR_END});
            }
        }
        size_t w = skip_py_space(s, n, i);
        if (w > i) {
            lx->line += (int)count_nl(s + i, w - i);
            lx->pos = w;
            continue;
        }
        size_t l;
        enum kr_status st;
        if ((l = match_float(s, n, i)) > 0) {
            char tmp[128];
            size_t k = 0;
            for (size_t q = i; q < i + l && k + 1 < sizeof(tmp); q++) {
                if (s[q] != '_') {
                    tmp[k++] = s[q];
                }
            }
            tmp[k] = '\0';
            st = push_tok(lx, (struct token){.t = T_FLOAT, .f = strtod(tmp, NULL)});
            lx->pos = i + l;
        } else if (is_digit(s[i])) {
            int base = 10;
            size_t k = i;
            if (s[i] == '0' && i + 1 < n && strchr("xXoObB", s[i + 1])) {
                base = s[i + 1] == 'x' || s[i + 1] == 'X' ? 16 : s[i + 1] == 'o' || s[i + 1] == 'O' ? 8 : 2;
                k += 2;
            }
            int64_t v = 0;
            bool any = false;
            for (; k < n; k++) {
                int d = is_digit(s[k]) ? s[k] - '0' : (s[k] | 0x20) >= 'a' && (s[k] | 0x20) <= 'f' ? (s[k] | 0x20) - 'a' + 10 : -1;
                if (s[k] == '_') {
                    continue;
                }
                if (d < 0 || d >= base) {
                    break;
                }
                if (v > (INT64_MAX - d) / base) {
                    return ct_syntax_err(lx->err, lx->line, "integer literal too large");
                }
                v = v * base + d;
                any = true;
            }
            if (!any) {
                return ct_syntax_err(lx->err, lx->line, "invalid integer literal");
            }
            st = push_tok(lx, (struct token){.t = T_INT, .i = v});
            lx->pos = k;
        } else if (s[i] == '_' || ((s[i] | 0x20) >= 'a' && (s[i] | 0x20) <= 'z')) {
            size_t k = i;
            while (k < n && (s[k] == '_' || is_digit(s[k]) || ((s[k] | 0x20) >= 'a' && (s[k] | 0x20) <= 'z'))) {
                k++;
            }
            st = push_tok(lx, (struct token){.t = T_NAME, .s = s + i, .len = k - i});
            lx->pos = k;
        } else if (s[i] == '\'' || s[i] == '"') {
            size_t k = i + 1;
            while (k < n && s[k] != s[i]) {
                k += s[k] == '\\' ? 2 : 1;
            }
            if (k >= n) {
                return ct_syntax_err(lx->err, lx->line, "unterminated string literal");
            }
            struct token t = {.t = T_STRING};
            if ((st = unescape(lx, s + i + 1, k - i - 1, &t)) != KR_OK) {
                return st;
            }
            st = push_tok(lx, t);
            lx->line += (int)count_nl(s + i, k - i);
            lx->pos = k + 1;
        } else {
            size_t o = 0;
            for (; o < sizeof(OPS) / sizeof(OPS[0]); o++) {
                if (strncmp(s + i, OPS[o], strlen(OPS[o])) == 0) {
                    break;
                }
            }
            if (o == sizeof(OPS) / sizeof(OPS[0])) {
                return ct_syntax_err(lx->err, lx->line, "unexpected character '%c'", s[i]);
            }
            char c = OPS[o][0];
            if (strlen(OPS[o]) == 1 && (c == '(' || c == '[' || c == '{')) {
                depth++;
            } else if (strlen(OPS[o]) == 1 && (c == ')' || c == ']' || c == '}')) {
                if (--depth < 0) {
                    return ct_syntax_err(lx->err, lx->line, "unexpected '%c'", c);
                }
            }
            st = push_tok(lx, (struct token){.t = T_OP, .s = OPS[o], .len = strlen(OPS[o])});
            lx->pos = i + strlen(OPS[o]);
        }
        if (st != KR_OK) {
            return st;
        }
    }
}

/* Matches "{%(-|+|)\s*NAME\s*(-%}\s*|%})" (raw) or with the block-end rule (endraw) at i. */
static size_t match_raw_tag(const char *s, size_t n, size_t i, const char *name, bool end, char *sign)
{
    if (strncmp(s + i, "{%", 2) != 0) {
        return 0;
    }
    size_t k = i + 2;
    *sign = 0;
    if (k < n && (s[k] == '-' || s[k] == '+')) {
        *sign = s[k++];
    }
    k = skip_py_space(s, n, k);
    size_t l = strlen(name);
    if (strncmp(s + k, name, l) != 0) {
        return 0;
    }
    k = skip_py_space(s, n, k + l);
    if (end && strncmp(s + k, "+%}", 3) == 0) {
        return k + 3 - i;
    }
    if (strncmp(s + k, "-%}", 3) == 0) {
        return skip_py_space(s, n, k + 3) - i;
    }
    if (strncmp(s + k, "%}", 2) == 0) {
        return k + 2 + (end && k + 2 < n && s[k + 2] == '\n') - i;
    }
    return 0;
}

enum kr_status ct_lex(struct lexer *lx)
{
    const char *s = lx->src;
    size_t n = lx->n;
    bool line_starting = true;
    enum kr_status st;
    lx->line = 1;
    while (lx->pos < n) {
        size_t i = lx->pos, tag = n;
        for (size_t k = i; k + 1 < n; k++) {
            if (s[k] == '{' && (s[k + 1] == '{' || s[k + 1] == '%' || s[k + 1] == '#')) {
                tag = k;
                break;
            }
        }
        if (tag == n) {
            st = emit_data(lx, s + i, n - i, 0, false, false);
            lx->pos = n;
            if (st != KR_OK) {
                return st;
            }
            break;
        }
        char kind = s[tag + 1];
        char sign = tag + 2 < n && (s[tag + 2] == '-' || s[tag + 2] == '+') ? s[tag + 2] : 0;
        char rsign;
        size_t raw = kind == '%' ? match_raw_tag(s, n, tag, "raw", false, &rsign) : 0;
        if ((st = emit_data(lx, s + i, tag - i, sign, kind != '{', line_starting)) != KR_OK) {
            return st;
        }
        if (raw) {
            size_t k = tag + raw, endlen = 0;
            lx->line += (int)count_nl(s + tag, raw);
            for (; k < n; k++) {
                if ((endlen = match_raw_tag(s, n, k, "endraw", true, &rsign)) > 0) {
                    break;
                }
            }
            if (k >= n) {
                return ct_syntax_err(lx->err, lx->line, "missing end of raw directive");
            }
            if ((st = emit_data(lx, s + tag + raw, k - tag - raw, rsign, true, false)) != KR_OK) {
                return st;
            }
            lx->line += (int)count_nl(s + k, endlen);
            line_starting = s[k + endlen - 1] == '\n';
            lx->pos = k + endlen;
            continue;
        }
        lx->pos = tag + 2 + (sign != 0);
        if (kind == '#') {
            size_t k = lx->pos, end = 0;
            for (; k + 1 < n; k++) {
                if (strncmp(s + k, "+#}", 3) == 0) {
                    end = k + 3;
                } else if (strncmp(s + k, "-#}", 3) == 0) {
                    end = skip_py_space(s, n, k + 3);
                } else if (strncmp(s + k, "#}", 2) == 0) {
                    end = k + 2 + (k + 2 < n && s[k + 2] == '\n');
                }
                if (end) {
                    break;
                }
            }
            if (!end) {
                return ct_syntax_err(lx->err, lx->line, "missing end of comment tag");
            }
            lx->line += (int)count_nl(s + lx->pos, end - lx->pos);
            line_starting = s[end - 1] == '\n';
            lx->pos = end;
            continue;
        }
        bool block = kind == '%';
        if ((st = push_tok(lx, (struct token){.t = block ? T_BLOCK_BEGIN : T_VAR_BEGIN})) != KR_OK) {
            return st;
        }
        line_starting = false;
        if ((st = lex_tag(lx, block, &line_starting)) != KR_OK) {
            return st;
        }
    }
    return push_tok(lx, (struct token){.t = T_EOF});
}
