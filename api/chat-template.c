#define _POSIX_C_SOURCE 200809L

#include "chat-template.h"

#include "alloc.h"
#include "unicode.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The lexer follows jinja2/lexer.py (3.1) configured as transformers configures it; the parser
 * follows jinja2/parser.py (precedence: conditional < or < and < not < comparisons < + - < ~ <
 * * / // % < ** < unary -/+ < postfix (attribute, item, call) and filters/tests); the evaluator
 * implements Python's semantics for the values JSON can bring. */

#define MAX_STEPS 10000000L
#define MAX_BYTES (256u << 20)
#define MAX_DEPTH 200
#define MAX_RANGE 100000 /* jinja2.sandbox.MAX_RANGE */

/* ==== arena =================================================================================== */

struct achunk {
    struct achunk *next;
    size_t used, cap;
    _Alignas(16) char data[];
};
struct arena {
    struct achunk *head;
    size_t total;
};

static void *a_alloc(struct arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > 32768 ? n : 32768;
        if (a->total + cap > MAX_BYTES) {
            return NULL;
        }
        struct achunk *c = kr_malloc(sizeof(*c) + cap);
        if (!c) {
            return NULL;
        }
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
        a->total += cap;
    }
    void *p = a->head->data + a->head->used;
    a->head->used += n;
    return p;
}

static void a_free(struct arena *a)
{
    while (a->head) {
        struct achunk *n = a->head->next;
        kr_free(a->head);
        a->head = n;
    }
    a->total = 0;
}

/* ==== values ==================================================================================== */

enum vt { V_UNDEF, V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_LIST, V_TUPLE, V_DICT, V_NS, V_FUNC };

struct jstr {
    size_t len;
    char s[]; /* NUL-terminated */
};
struct list;
struct dict;
struct func;
struct value {
    enum vt t;
    union {
        bool b;
        int64_t i;
        double f;
        struct jstr *s;
        struct list *l;   /* V_LIST, V_TUPLE */
        struct dict *d;   /* V_DICT, V_NS */
        struct func *fn;
    } u;
};
struct list {
    size_t n, cap;
    struct value *v;
};
struct dict {
    size_t n, cap;
    struct value *k, *v;
};

enum builtin {
    B_RANGE, B_NAMESPACE, B_DICT, B_RAISE, B_STRFTIME, B_CYCLE, B_MACRO,
    /* str methods */
    M_STRIP, M_LSTRIP, M_RSTRIP, M_SPLIT, M_RSPLIT, M_STARTSWITH, M_ENDSWITH, M_UPPER, M_LOWER, M_TITLE,
    M_CAPITALIZE, M_REPLACE, M_FIND, M_RFIND, M_COUNT, M_JOIN, M_ISDIGIT, M_ISALPHA, M_ISALNUM, M_ISSPACE,
    M_ISUPPER, M_ISLOWER,
    /* dict methods */
    M_ITEMS, M_KEYS, M_VALUES, M_GET,
    /* list methods */
    M_INDEX, M_LCOUNT,
    M_UNSAFE, /* a mutating method: calling it is a sandbox violation */
};
struct node;
struct func {
    enum builtin b;
    struct value self;        /* bound object for methods; the list for cycle */
    const struct node *macro; /* B_MACRO */
    const char *name;
};

static struct value v_undef(void)
{
    return (struct value){.t = V_UNDEF};
}
static struct value v_none(void)
{
    return (struct value){.t = V_NONE};
}
static struct value v_bool(bool b)
{
    return (struct value){.t = V_BOOL, .u.b = b};
}
static struct value v_int(int64_t i)
{
    return (struct value){.t = V_INT, .u.i = i};
}
static struct value v_float(double f)
{
    return (struct value){.t = V_FLOAT, .u.f = f};
}

/* ==== AST ========================================================================================= */

enum nk {
    /* statements */
    N_TEXT, N_OUTPUT, N_IF, N_FOR, N_SET, N_SET_BLOCK, N_MACRO, N_BREAK, N_CONTINUE, N_WITH, N_FILTER_BLOCK,
    N_BODY,
    /* expressions */
    E_CONST, E_NAME, E_LIST, E_TUPLE, E_DICT, E_ATTR, E_ITEM, E_SLICE, E_CALL, E_FILTER, E_TEST, E_NOT, E_NEG,
    E_POS, E_BIN, E_AND, E_OR, E_CMP, E_COND,
};
enum op { OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CAT, OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT,
          OP_GE, OP_IN, OP_NOTIN };

struct node {
    enum nk k;
    int line;
    int op;                  /* E_BIN, E_CMP ops[0]; N_FOR: has else; E_TEST: negated */
    struct value v;          /* E_CONST; N_TEXT text */
    const char *name;        /* E_NAME, E_ATTR, E_FILTER, E_TEST, N_MACRO, N_SET target attr */
    struct node *a, *b, *c;  /* children */
    struct node **kids;      /* list items, call args, bodies, elif chains */
    size_t n_kids;
    const char **knames;     /* keyword argument names / targets / macro params, parallel to kvals */
    struct node **kvals;
    size_t n_kw;
    int *ops;                /* E_CMP: one per comparison */
};

struct kr_chat_template {
    struct arena arena; /* owns every node */
    struct node *body;
};

/* ==== lexer ========================================================================================= */

enum tt { T_DATA, T_VAR_BEGIN, T_VAR_END, T_BLOCK_BEGIN, T_BLOCK_END, T_NAME, T_STRING, T_INT, T_FLOAT, T_OP,
          T_EOF };
struct token {
    enum tt t;
    int line;
    const char *s; /* T_DATA/T_STRING: processed text (arena); T_NAME/T_OP: source text */
    size_t len;
    int64_t i;
    double f;
};
struct lexer {
    struct arena *arena;
    struct kr_err *err;
    const char *src; /* newline-normalized source */
    size_t n, pos;
    int line;
    struct token *toks;
    size_t n_toks, cap_toks;
};

static enum kr_status syntax_err(struct kr_err *err, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static enum kr_status syntax_err(struct kr_err *err, int line, const char *fmt, ...)
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

static size_t py_space_len(const char *s, size_t n, size_t i)
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
static size_t py_rstrip_len(const char *s, size_t n)
{
    while (n > 0) {
        size_t k = n - 1;
        while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80) {
            k--;
        }
        if (!py_space_len(s, n, k)) {
            break;
        }
        n = k;
    }
    return n;
}

static size_t skip_py_space(const char *s, size_t n, size_t i)
{
    size_t l;
    while ((l = py_space_len(s, n, i)) > 0) {
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
        keep = py_rstrip_len(text, n);
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
                return syntax_err(lx->err, lx->line, "truncated \\%c escape in a string literal", e);
            }
            cp = cp * 16 + (uint32_t)v;
        }
        i += (size_t)digits;
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
            kr_bs_free(&b);
            return syntax_err(lx->err, lx->line, "invalid code point in a string literal escape");
        }
        st = kr_bs_put_cp(&b, cp);
    }
    if (st == KR_OK) {
        char *p = a_alloc(lx->arena, b.len + 1);
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
            return syntax_err(lx->err, lx->line, "unexpected end of template, expected '%s'", block ? "%}" : "}}");
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
                    return syntax_err(lx->err, lx->line, "integer literal too large");
                }
                v = v * base + d;
                any = true;
            }
            if (!any) {
                return syntax_err(lx->err, lx->line, "invalid integer literal");
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
                return syntax_err(lx->err, lx->line, "unterminated string literal");
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
                return syntax_err(lx->err, lx->line, "unexpected character '%c'", s[i]);
            }
            char c = OPS[o][0];
            if (strlen(OPS[o]) == 1 && (c == '(' || c == '[' || c == '{')) {
                depth++;
            } else if (strlen(OPS[o]) == 1 && (c == ')' || c == ']' || c == '}')) {
                if (--depth < 0) {
                    return syntax_err(lx->err, lx->line, "unexpected '%c'", c);
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

static enum kr_status lex(struct lexer *lx)
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
                return syntax_err(lx->err, lx->line, "missing end of raw directive");
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
                return syntax_err(lx->err, lx->line, "missing end of comment tag");
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

/* ==== parser ========================================================================================= */

struct parser {
    struct arena *arena;
    struct kr_err *err;
    struct token *t;
    size_t n, pos;
    int depth;
};

static struct token *cur(struct parser *p)
{
    return &p->t[p->pos];
}

static bool is_name(const struct token *t, const char *name)
{
    return t->t == T_NAME && t->len == strlen(name) && memcmp(t->s, name, t->len) == 0;
}

static bool is_op(const struct token *t, const char *op)
{
    return t->t == T_OP && t->len == strlen(op) && memcmp(t->s, op, t->len) == 0;
}

static const char *tok_desc(const struct token *t)
{
    switch (t->t) {
    case T_DATA: return "template data";
    case T_VAR_BEGIN: return "'{{'";
    case T_VAR_END: return "'}}'";
    case T_BLOCK_BEGIN: return "'{%'";
    case T_BLOCK_END: return "'%}'";
    case T_NAME: return "a name";
    case T_STRING: return "a string";
    case T_INT: return "an integer";
    case T_FLOAT: return "a float";
    case T_OP: return "an operator";
    case T_EOF: return "end of template";
    }
    return "?";
}

static struct node *new_node(struct parser *p, enum nk k)
{
    struct node *nd = a_alloc(p->arena, sizeof(*nd));
    if (nd) {
        memset(nd, 0, sizeof(*nd));
        nd->k = k;
        nd->line = cur(p)->line;
    }
    return nd;
}

static char *tok_str(struct parser *p, const struct token *t)
{
    char *s = a_alloc(p->arena, t->len + 1);
    if (s) {
        memcpy(s, t->s, t->len);
        s[t->len] = '\0';
    }
    return s;
}

/* Growable node-pointer arrays built in kr_malloc'd scratch, then copied into the arena. */
struct nvec {
    struct node **v;
    const char **names;
    size_t n, cap;
};

static enum kr_status nvec_push(struct nvec *a, struct node *nd, const char *name)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 8;
        struct node **v = kr_realloc(a->v, cap * sizeof(*v));
        if (!v) {
            return KR_ERR_NOMEM;
        }
        a->v = v;
        const char **nm = kr_realloc(a->names, cap * sizeof(*nm));
        if (!nm) {
            return KR_ERR_NOMEM;
        }
        a->names = nm;
        a->cap = cap;
    }
    a->v[a->n] = nd;
    a->names[a->n] = name;
    a->n++;
    return KR_OK;
}

static enum kr_status nvec_take(struct parser *p, struct nvec *a, struct node ***out, const char ***names, size_t *n)
{
    *n = a->n;
    *out = a_alloc(p->arena, (a->n + 1) * sizeof(**out));
    if (names) {
        *names = a_alloc(p->arena, (a->n + 1) * sizeof(**names));
    }
    enum kr_status st = *out && (!names || *names) ? KR_OK : KR_ERR_NOMEM;
    if (st == KR_OK && a->n) {
        memcpy(*out, a->v, a->n * sizeof(**out));
        if (names) {
            memcpy(*names, a->names, a->n * sizeof(**names));
        }
    }
    kr_free(a->v);
    kr_free(a->names);
    a->v = NULL;
    a->names = NULL;
    a->n = a->cap = 0;
    return st;
}

static enum kr_status expect_op(struct parser *p, const char *op)
{
    if (!is_op(cur(p), op)) {
        return syntax_err(p->err, cur(p)->line, "expected '%s', got %s", op, tok_desc(cur(p)));
    }
    p->pos++;
    return KR_OK;
}

static enum kr_status parse_expr(struct parser *p, struct node **out, bool with_cond);
static enum kr_status parse_unary(struct parser *p, struct node **out, bool with_filter);
static enum kr_status parse_primary(struct parser *p, struct node **out);
static enum kr_status parse_postfix(struct parser *p, struct node **nd);

/* Call arguments after '(' : positional, then name=value. */
static enum kr_status parse_call_args(struct parser *p, struct node *call)
{
    struct nvec args = {0}, kw = {0};
    enum kr_status st = expect_op(p, "(");
    while (st == KR_OK && !is_op(cur(p), ")")) {
        if (args.n + kw.n > 0 && (st = expect_op(p, ",")) != KR_OK) {
            break;
        }
        if (is_op(cur(p), ")")) {
            break;
        }
        if (is_op(cur(p), "*") || is_op(cur(p), "**")) {
            st = syntax_err(p->err, cur(p)->line, "*args / **kwargs in calls are not supported");
            break;
        }
        struct node *v;
        if (cur(p)->t == T_NAME && is_op(&p->t[p->pos + 1], "=")) {
            const char *name = tok_str(p, cur(p));
            p->pos += 2;
            if ((st = parse_expr(p, &v, true)) == KR_OK) {
                st = name ? nvec_push(&kw, v, name) : KR_ERR_NOMEM;
            }
        } else if (kw.n > 0) {
            st = syntax_err(p->err, cur(p)->line, "positional argument after keyword argument");
        } else if ((st = parse_expr(p, &v, true)) == KR_OK) {
            st = nvec_push(&args, v, NULL);
        }
    }
    if (st == KR_OK) {
        st = expect_op(p, ")");
    }
    if (st == KR_OK) {
        st = nvec_take(p, &args, &call->kids, NULL, &call->n_kids);
    }
    if (st == KR_OK) {
        st = nvec_take(p, &kw, &call->kvals, &call->knames, &call->n_kw);
    }
    kr_free(args.v);
    kr_free(args.names);
    kr_free(kw.v);
    kr_free(kw.names);
    return st;
}

static const char *const FILTERS[] = {
    "abs", "attr", "capitalize", "count", "d", "default", "dictsort", "e", "escape", "first", "float",
    "forceescape", "indent", "int", "items", "join", "last", "length", "list", "lower", "map", "max", "min",
    "reject", "rejectattr", "replace", "reverse", "round", "safe", "select", "selectattr", "sort", "string",
    "sum", "title", "tojson", "trim", "unique", "upper", "wordcount", NULL};
static const char *const TESTS[] = {
    "defined", "undefined", "none", "boolean", "false", "true", "integer", "float", "number", "string", "mapping",
    "iterable", "sequence", "callable", "even", "odd", "divisibleby", "eq", "equalto", "==", "ne", "!=", "lt",
    "lessthan", "<", "le", "<=", "gt", "greaterthan", ">", "ge", ">=", "in", "sameas", "lower", "upper",
    "escaped", NULL};

static bool in_list(const char *const *list, const char *s)
{
    for (size_t i = 0; list[i]; i++) {
        if (strcmp(list[i], s) == 0) {
            return true;
        }
    }
    return false;
}

/* `| name(args)` chains, and `is [not] test args`. */
static enum kr_status parse_filter_tail(struct parser *p, struct node **nd)
{
    enum kr_status st = KR_OK;
    for (;;) {
        if (is_op(cur(p), "|")) {
            p->pos++;
            if (cur(p)->t != T_NAME) {
                return syntax_err(p->err, cur(p)->line, "expected a filter name after '|'");
            }
            struct node *f = new_node(p, E_FILTER);
            if (!f || !(f->name = tok_str(p, cur(p)))) {
                return KR_ERR_NOMEM;
            }
            p->pos++;
            if (!in_list(FILTERS, f->name)) {
                return syntax_err(p->err, f->line, "no filter named '%s' (not supported)", f->name);
            }
            f->a = *nd;
            if (is_op(cur(p), "(") && (st = parse_call_args(p, f)) != KR_OK) {
                return st;
            }
            *nd = f;
        } else if (is_name(cur(p), "is")) {
            p->pos++;
            struct node *t = new_node(p, E_TEST);
            if (!t) {
                return KR_ERR_NOMEM;
            }
            if (is_name(cur(p), "not")) {
                t->op = 1;
                p->pos++;
            }
            if (cur(p)->t != T_NAME) {
                return syntax_err(p->err, cur(p)->line, "expected a test name after 'is'");
            }
            if (!(t->name = tok_str(p, cur(p)))) {
                return KR_ERR_NOMEM;
            }
            p->pos++;
            if (!in_list(TESTS, t->name)) {
                return syntax_err(p->err, t->line, "no test named '%s' (not supported)", t->name);
            }
            t->a = *nd;
            struct token *c = cur(p);
            if (is_op(c, "(")) {
                if ((st = parse_call_args(p, t)) != KR_OK) {
                    return st;
                }
            } else if ((c->t == T_NAME || c->t == T_STRING || c->t == T_INT || c->t == T_FLOAT || is_op(c, "[") ||
                        is_op(c, "{")) &&
                       !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
                if (is_name(c, "is")) {
                    return syntax_err(p->err, c->line, "you cannot chain multiple tests with is");
                }
                struct node *arg;
                if ((st = parse_primary(p, &arg)) != KR_OK || (st = parse_postfix(p, &arg)) != KR_OK) {
                    return st;
                }
                t->kids = a_alloc(p->arena, sizeof(*t->kids));
                if (!t->kids) {
                    return KR_ERR_NOMEM;
                }
                t->kids[0] = arg;
                t->n_kids = 1;
            }
            *nd = t;
        } else if (is_op(cur(p), "(")) {
            struct node *call = new_node(p, E_CALL);
            if (!call) {
                return KR_ERR_NOMEM;
            }
            call->a = *nd;
            if ((st = parse_call_args(p, call)) != KR_OK) {
                return st;
            }
            *nd = call;
        } else {
            return KR_OK;
        }
    }
}

static enum kr_status parse_postfix(struct parser *p, struct node **nd)
{
    enum kr_status st;
    for (;;) {
        if (is_op(cur(p), ".")) {
            p->pos++;
            struct node *g;
            if (cur(p)->t == T_NAME) {
                g = new_node(p, E_ATTR);
                if (!g || !(g->name = tok_str(p, cur(p)))) {
                    return KR_ERR_NOMEM;
                }
            } else if (cur(p)->t == T_INT) {
                g = new_node(p, E_ITEM);
                struct node *idx = new_node(p, E_CONST);
                if (!g || !idx) {
                    return KR_ERR_NOMEM;
                }
                idx->v = v_int(cur(p)->i);
                g->b = idx;
            } else {
                return syntax_err(p->err, cur(p)->line, "expected a name after '.'");
            }
            p->pos++;
            g->a = *nd;
            *nd = g;
        } else if (is_op(cur(p), "[")) {
            p->pos++;
            struct node *parts[3] = {NULL, NULL, NULL};
            bool slice = false;
            for (int k = 0; k < 3; k++) {
                if (!is_op(cur(p), ":") && !is_op(cur(p), "]") && (st = parse_expr(p, &parts[k], true)) != KR_OK) {
                    return st;
                }
                if (!is_op(cur(p), ":")) {
                    break;
                }
                slice = true;
                p->pos++;
            }
            if ((st = expect_op(p, "]")) != KR_OK) {
                return st;
            }
            struct node *g = new_node(p, slice ? E_SLICE : E_ITEM);
            if (!g) {
                return KR_ERR_NOMEM;
            }
            if (!slice && !parts[0]) {
                return syntax_err(p->err, g->line, "expected an index inside '[]'");
            }
            g->a = *nd;
            g->b = parts[0];
            g->c = parts[1];
            if (slice) {
                g->kids = a_alloc(p->arena, sizeof(*g->kids));
                if (!g->kids) {
                    return KR_ERR_NOMEM;
                }
                g->kids[0] = parts[2];
                g->n_kids = 1;
            }
            *nd = g;
        } else if (is_op(cur(p), "(")) {
            struct node *call = new_node(p, E_CALL);
            if (!call) {
                return KR_ERR_NOMEM;
            }
            call->a = *nd;
            if ((st = parse_call_args(p, call)) != KR_OK) {
                return st;
            }
            *nd = call;
        } else {
            return KR_OK;
        }
    }
}

/* (a, b) tuples, [list], {dict} and parenthesized expressions. */
static enum kr_status parse_seq(struct parser *p, struct node **out, const char *close, enum nk kind)
{
    struct nvec items = {0}, vals = {0};
    enum kr_status st = KR_OK;
    bool comma = false;
    struct node *nd = new_node(p, kind);
    if (!nd) {
        return KR_ERR_NOMEM;
    }
    p->pos++;
    while (st == KR_OK && !is_op(cur(p), close)) {
        if (items.n > 0 && (st = expect_op(p, ",")) != KR_OK) {
            break;
        }
        if (items.n > 0) {
            comma = true;
        }
        if (is_op(cur(p), close)) {
            break;
        }
        struct node *e;
        if ((st = parse_expr(p, &e, true)) != KR_OK || (st = nvec_push(&items, e, NULL)) != KR_OK) {
            break;
        }
        if (kind == E_DICT) {
            if ((st = expect_op(p, ":")) != KR_OK || (st = parse_expr(p, &e, true)) != KR_OK ||
                (st = nvec_push(&vals, e, NULL)) != KR_OK) {
                break;
            }
        }
    }
    if (st == KR_OK) {
        st = expect_op(p, close);
    }
    if (st == KR_OK && kind == E_TUPLE && items.n == 1 && !comma && !is_op(&p->t[p->pos - 2], ",")) {
        *out = items.v[0]; /* a parenthesized expression */
        kr_free(items.v);
        kr_free(items.names);
        return KR_OK;
    }
    if (st == KR_OK) {
        st = nvec_take(p, &items, &nd->kids, NULL, &nd->n_kids);
    }
    if (st == KR_OK && kind == E_DICT) {
        st = nvec_take(p, &vals, &nd->kvals, NULL, &nd->n_kw);
    }
    kr_free(items.v);
    kr_free(items.names);
    kr_free(vals.v);
    kr_free(vals.names);
    *out = nd;
    return st;
}

static enum kr_status parse_primary(struct parser *p, struct node **out)
{
    struct token *t = cur(p);
    struct node *nd = NULL;
    if (++p->depth > MAX_DEPTH) {
        return syntax_err(p->err, t->line, "expression nested too deeply");
    }
    enum kr_status st = KR_OK;
    if (t->t == T_NAME) {
        nd = new_node(p, E_CONST);
        if (!nd) {
            return KR_ERR_NOMEM;
        }
        if (is_name(t, "true") || is_name(t, "True")) {
            nd->v = v_bool(true);
        } else if (is_name(t, "false") || is_name(t, "False")) {
            nd->v = v_bool(false);
        } else if (is_name(t, "none") || is_name(t, "None")) {
            nd->v = v_none();
        } else {
            nd->k = E_NAME;
            if (!(nd->name = tok_str(p, t))) {
                return KR_ERR_NOMEM;
            }
        }
        p->pos++;
    } else if (t->t == T_STRING) {
        /* adjacent string literals concatenate */
        struct kr_buf_s b = {0};
        while (st == KR_OK && cur(p)->t == T_STRING) {
            st = kr_bs_append(&b, cur(p)->s, cur(p)->len);
            p->pos++;
        }
        nd = new_node(p, E_CONST);
        struct jstr *s = nd && st == KR_OK ? a_alloc(p->arena, sizeof(*s) + b.len + 1) : NULL;
        if (!s) {
            kr_bs_free(&b);
            return KR_ERR_NOMEM;
        }
        s->len = b.len;
        memcpy(s->s, b.p ? b.p : "", b.len);
        s->s[b.len] = '\0';
        kr_bs_free(&b);
        nd->v = (struct value){.t = V_STR, .u.s = s};
    } else if (t->t == T_INT || t->t == T_FLOAT) {
        nd = new_node(p, E_CONST);
        if (!nd) {
            return KR_ERR_NOMEM;
        }
        nd->v = t->t == T_INT ? v_int(t->i) : v_float(t->f);
        p->pos++;
    } else if (is_op(t, "(")) {
        st = parse_seq(p, &nd, ")", E_TUPLE);
    } else if (is_op(t, "[")) {
        st = parse_seq(p, &nd, "]", E_LIST);
    } else if (is_op(t, "{")) {
        st = parse_seq(p, &nd, "}", E_DICT);
    } else {
        st = syntax_err(p->err, t->line, "unexpected %s%s%.*s%s", tok_desc(t), t->t == T_OP ? " '" : "",
                        t->t == T_OP ? (int)t->len : 0, t->s ? t->s : "", t->t == T_OP ? "'" : "");
    }
    p->depth--;
    *out = nd;
    return st;
}

static enum kr_status parse_unary(struct parser *p, struct node **out, bool with_filter)
{
    enum kr_status st;
    if (is_op(cur(p), "-") || is_op(cur(p), "+")) {
        struct node *nd = new_node(p, is_op(cur(p), "-") ? E_NEG : E_POS);
        if (!nd) {
            return KR_ERR_NOMEM;
        }
        p->pos++;
        if ((st = parse_unary(p, &nd->a, false)) != KR_OK) {
            return st;
        }
        *out = nd;
    } else if ((st = parse_primary(p, out)) != KR_OK) {
        return st;
    }
    if ((st = parse_postfix(p, out)) != KR_OK) {
        return st;
    }
    return with_filter ? parse_filter_tail(p, out) : KR_OK;
}

static struct node *bin(struct parser *p, enum nk k, int op, struct node *a, struct node *b)
{
    struct node *nd = new_node(p, k);
    if (nd) {
        nd->op = op;
        nd->a = a;
        nd->b = b;
    }
    return nd;
}

static enum kr_status parse_pow(struct parser *p, struct node **out)
{
    enum kr_status st = parse_unary(p, out, true);
    while (st == KR_OK && is_op(cur(p), "**")) {
        p->pos++;
        struct node *r;
        if ((st = parse_unary(p, &r, true)) == KR_OK && !(*out = bin(p, E_BIN, OP_POW, *out, r))) {
            st = KR_ERR_NOMEM;
        }
    }
    return st;
}

static enum kr_status parse_math2(struct parser *p, struct node **out)
{
    enum kr_status st = parse_pow(p, out);
    for (;;) {
        int op = is_op(cur(p), "*") ? OP_MUL : is_op(cur(p), "/") ? OP_DIV : is_op(cur(p), "//") ? OP_FLOORDIV
                 : is_op(cur(p), "%") ? OP_MOD : -1;
        if (st != KR_OK || op < 0) {
            return st;
        }
        p->pos++;
        struct node *r;
        if ((st = parse_pow(p, &r)) == KR_OK && !(*out = bin(p, E_BIN, op, *out, r))) {
            st = KR_ERR_NOMEM;
        }
    }
}

static enum kr_status parse_concat(struct parser *p, struct node **out)
{
    enum kr_status st = parse_math2(p, out);
    while (st == KR_OK && is_op(cur(p), "~")) {
        p->pos++;
        struct node *r;
        if ((st = parse_math2(p, &r)) == KR_OK && !(*out = bin(p, E_BIN, OP_CAT, *out, r))) {
            st = KR_ERR_NOMEM;
        }
    }
    return st;
}

static enum kr_status parse_math1(struct parser *p, struct node **out)
{
    enum kr_status st = parse_concat(p, out);
    for (;;) {
        int op = is_op(cur(p), "+") ? OP_ADD : is_op(cur(p), "-") ? OP_SUB : -1;
        if (st != KR_OK || op < 0) {
            return st;
        }
        p->pos++;
        struct node *r;
        if ((st = parse_concat(p, &r)) == KR_OK && !(*out = bin(p, E_BIN, op, *out, r))) {
            st = KR_ERR_NOMEM;
        }
    }
}

static enum kr_status parse_compare(struct parser *p, struct node **out)
{
    enum kr_status st = parse_math1(p, out);
    if (st != KR_OK) {
        return st;
    }
    struct node *cmp = NULL;
    int ops[64];
    struct node *rhs[64];
    size_t n = 0;
    for (;;) {
        struct token *t = cur(p);
        int op = is_op(t, "==") ? OP_EQ : is_op(t, "!=") ? OP_NE : is_op(t, "<") ? OP_LT : is_op(t, "<=") ? OP_LE
                 : is_op(t, ">") ? OP_GT : is_op(t, ">=") ? OP_GE : is_name(t, "in") ? OP_IN : -1;
        if (op < 0 && is_name(t, "not") && is_name(&p->t[p->pos + 1], "in")) {
            op = OP_NOTIN;
            p->pos++;
        }
        if (op < 0) {
            break;
        }
        if (n == 64) {
            return syntax_err(p->err, t->line, "too many chained comparisons");
        }
        p->pos++;
        if ((st = parse_math1(p, &rhs[n])) != KR_OK) {
            return st;
        }
        ops[n++] = op;
    }
    if (n == 0) {
        return KR_OK;
    }
    cmp = new_node(p, E_CMP);
    if (!cmp || !(cmp->ops = a_alloc(p->arena, n * sizeof(int))) || !(cmp->kids = a_alloc(p->arena, n * sizeof(*cmp->kids)))) {
        return KR_ERR_NOMEM;
    }
    memcpy(cmp->ops, ops, n * sizeof(int));
    memcpy(cmp->kids, rhs, n * sizeof(*rhs));
    cmp->n_kids = n;
    cmp->a = *out;
    *out = cmp;
    return KR_OK;
}

static enum kr_status parse_not(struct parser *p, struct node **out)
{
    if (is_name(cur(p), "not")) {
        struct node *nd = new_node(p, E_NOT);
        if (!nd) {
            return KR_ERR_NOMEM;
        }
        p->pos++;
        *out = nd;
        if (++p->depth > MAX_DEPTH) {
            return syntax_err(p->err, nd->line, "expression nested too deeply");
        }
        enum kr_status st = parse_not(p, &nd->a);
        p->depth--;
        return st;
    }
    return parse_compare(p, out);
}

static enum kr_status parse_and(struct parser *p, struct node **out)
{
    enum kr_status st = parse_not(p, out);
    while (st == KR_OK && is_name(cur(p), "and")) {
        p->pos++;
        struct node *r;
        if ((st = parse_not(p, &r)) == KR_OK && !(*out = bin(p, E_AND, 0, *out, r))) {
            st = KR_ERR_NOMEM;
        }
    }
    return st;
}

static enum kr_status parse_or(struct parser *p, struct node **out)
{
    enum kr_status st = parse_and(p, out);
    while (st == KR_OK && is_name(cur(p), "or")) {
        p->pos++;
        struct node *r;
        if ((st = parse_and(p, &r)) == KR_OK && !(*out = bin(p, E_OR, 0, *out, r))) {
            st = KR_ERR_NOMEM;
        }
    }
    return st;
}

static enum kr_status parse_expr(struct parser *p, struct node **out, bool with_cond)
{
    if (++p->depth > MAX_DEPTH) {
        return syntax_err(p->err, cur(p)->line, "expression nested too deeply");
    }
    enum kr_status st = parse_or(p, out);
    while (st == KR_OK && with_cond && is_name(cur(p), "if")) {
        p->pos++;
        struct node *c = new_node(p, E_COND);
        if (!c) {
            st = KR_ERR_NOMEM;
            break;
        }
        c->b = *out;
        if ((st = parse_or(p, &c->a)) != KR_OK) {
            break;
        }
        if (is_name(cur(p), "else")) {
            p->pos++;
            st = parse_expr(p, &c->c, true);
        }
        *out = c;
    }
    p->depth--;
    return st;
}

/* An expression or an unparenthesized tuple (`a, b`), as in `for` targets and `set`. */
static enum kr_status parse_tuple(struct parser *p, struct node **out, bool names_only)
{
    struct nvec items = {0};
    enum kr_status st = KR_OK;
    bool comma = false;
    for (;;) {
        struct node *e;
        if (names_only) {
            if (cur(p)->t != T_NAME) {
                st = syntax_err(p->err, cur(p)->line, "expected a name, got %s", tok_desc(cur(p)));
                break;
            }
            if (!(e = new_node(p, E_NAME)) || !(e->name = tok_str(p, cur(p)))) {
                st = KR_ERR_NOMEM;
                break;
            }
            p->pos++;
            if (is_op(cur(p), ".")) { /* namespace attribute target */
                p->pos++;
                struct node *g = new_node(p, E_ATTR);
                if (!g || cur(p)->t != T_NAME) {
                    st = g ? syntax_err(p->err, cur(p)->line, "expected an attribute name") : KR_ERR_NOMEM;
                    break;
                }
                g->a = e;
                if (!(g->name = tok_str(p, cur(p)))) {
                    st = KR_ERR_NOMEM;
                    break;
                }
                p->pos++;
                e = g;
            }
        } else if ((st = parse_expr(p, &e, true)) != KR_OK) {
            break;
        }
        if ((st = nvec_push(&items, e, NULL)) != KR_OK) {
            break;
        }
        if (!is_op(cur(p), ",")) {
            break;
        }
        comma = true;
        p->pos++;
        if (cur(p)->t == T_BLOCK_END || cur(p)->t == T_VAR_END || is_op(cur(p), "=") || is_name(cur(p), "in")) {
            break;
        }
    }
    if (st == KR_OK && !comma) {
        *out = items.v[0];
        kr_free(items.v);
        kr_free(items.names);
        return KR_OK;
    }
    struct node *t = st == KR_OK ? new_node(p, E_TUPLE) : NULL;
    if (st == KR_OK && !t) {
        st = KR_ERR_NOMEM;
    }
    if (st == KR_OK) {
        st = nvec_take(p, &items, &t->kids, NULL, &t->n_kids);
        *out = t;
    }
    kr_free(items.v);
    kr_free(items.names);
    return st;
}

static enum kr_status expect_block_end(struct parser *p)
{
    if (cur(p)->t != T_BLOCK_END) {
        return syntax_err(p->err, cur(p)->line, "expected end of statement '%%}', got %s", tok_desc(cur(p)));
    }
    p->pos++;
    return KR_OK;
}

static enum kr_status parse_body(struct parser *p, struct node **out, const char *const *ends);

/* Parses the body of a block until one of `ends` ({% end... %} names) and consumes that name. */
static enum kr_status parse_until(struct parser *p, struct node **body, const char *const *ends, const char **which)
{
    enum kr_status st = parse_body(p, body, ends);
    if (st != KR_OK) {
        return st;
    }
    if (cur(p)->t != T_NAME) {
        return syntax_err(p->err, cur(p)->line, "unexpected end of template, expected '%s'", ends[0]);
    }
    *which = tok_str(p, cur(p));
    p->pos++;
    return *which ? KR_OK : KR_ERR_NOMEM;
}

static enum kr_status parse_statement(struct parser *p, struct node **out)
{
    struct token *t = cur(p);
    enum kr_status st;
    const char *which;
    if (t->t != T_NAME) {
        return syntax_err(p->err, t->line, "expected a statement name, got %s", tok_desc(t));
    }
    int line = t->line;
    if (is_name(t, "if")) {
        struct node *nd = new_node(p, N_IF);
        if (!nd) {
            return KR_ERR_NOMEM;
        }
        p->pos++;
        *out = nd;
        struct node *cond = nd;
        for (;;) {
            static const char *const ends[] = {"elif", "else", "endif", NULL};
            if ((st = parse_expr(p, &cond->a, true)) != KR_OK || (st = expect_block_end(p)) != KR_OK ||
                (st = parse_until(p, &cond->b, ends, &which)) != KR_OK) {
                return st;
            }
            if (strcmp(which, "elif") == 0) {
                struct node *e = new_node(p, N_IF);
                if (!e) {
                    return KR_ERR_NOMEM;
                }
                cond->c = e;
                cond = e;
                continue;
            }
            if (strcmp(which, "else") == 0) {
                static const char *const ends2[] = {"endif", NULL};
                if ((st = expect_block_end(p)) != KR_OK || (st = parse_until(p, &cond->c, ends2, &which)) != KR_OK) {
                    return st;
                }
            }
            return expect_block_end(p);
        }
    }
    if (is_name(t, "for")) {
        static const char *const ends[] = {"endfor", "else", NULL};
        struct node *nd = new_node(p, N_FOR);
        if (!nd) {
            return KR_ERR_NOMEM;
        }
        p->pos++;
        *out = nd;
        if ((st = parse_tuple(p, &nd->a, true)) != KR_OK) {
            return st;
        }
        if (!is_name(cur(p), "in")) {
            return syntax_err(p->err, cur(p)->line, "expected 'in' in a for loop");
        }
        p->pos++;
        if ((st = parse_expr(p, &nd->b, false)) != KR_OK) { /* jinja: parse_tuple(with_condexpr=False) */
            return st;
        }
        if (is_name(cur(p), "if")) {
            p->pos++;
            if ((st = parse_expr(p, &nd->c, true)) != KR_OK) {
                return st;
            }
        }
        if (is_name(cur(p), "recursive")) {
            return syntax_err(p->err, line, "recursive for loops are not supported");
        }
        struct node *body, *els = NULL;
        if ((st = expect_block_end(p)) != KR_OK || (st = parse_until(p, &body, ends, &which)) != KR_OK) {
            return st;
        }
        if (strcmp(which, "else") == 0) {
            static const char *const ends2[] = {"endfor", NULL};
            if ((st = expect_block_end(p)) != KR_OK || (st = parse_until(p, &els, ends2, &which)) != KR_OK) {
                return st;
            }
        }
        nd->kids = a_alloc(p->arena, 2 * sizeof(*nd->kids));
        if (!nd->kids) {
            return KR_ERR_NOMEM;
        }
        nd->kids[0] = body;
        nd->kids[1] = els;
        nd->n_kids = 2;
        return expect_block_end(p);
    }
    if (is_name(t, "set")) {
        p->pos++;
        struct node *target;
        if ((st = parse_tuple(p, &target, true)) != KR_OK) {
            return st;
        }
        if (is_op(cur(p), "=")) {
            struct node *nd = new_node(p, N_SET);
            if (!nd) {
                return KR_ERR_NOMEM;
            }
            p->pos++;
            nd->a = target;
            *out = nd;
            if ((st = parse_tuple(p, &nd->b, false)) != KR_OK) {
                return st;
            }
            return expect_block_end(p);
        }
        static const char *const ends[] = {"endset", NULL};
        struct node *nd = new_node(p, N_SET_BLOCK);
        if (!nd) {
            return KR_ERR_NOMEM;
        }
        nd->a = target;
        *out = nd;
        struct node *holder = NULL;
        if (is_op(cur(p), "|")) { /* {% set x | filter %} */
            holder = new_node(p, E_CONST);
            struct node *f = holder;
            if (!holder || (st = parse_filter_tail(p, &f)) != KR_OK) {
                return holder ? st : KR_ERR_NOMEM;
            }
            nd->c = f;
            nd->v.t = V_NONE;
            nd->op = 1;
            nd->name = (const char *)holder; /* the placeholder the body value replaces */
        }
        if ((st = expect_block_end(p)) != KR_OK || (st = parse_until(p, &nd->b, ends, &which)) != KR_OK) {
            return st;
        }
        return expect_block_end(p);
    }
    if (is_name(t, "macro")) {
        static const char *const ends[] = {"endmacro", NULL};
        struct node *nd = new_node(p, N_MACRO);
        if (!nd) {
            return KR_ERR_NOMEM;
        }
        p->pos++;
        *out = nd;
        if (cur(p)->t != T_NAME || !(nd->name = tok_str(p, cur(p)))) {
            return cur(p)->t != T_NAME ? syntax_err(p->err, line, "expected a macro name") : KR_ERR_NOMEM;
        }
        p->pos++;
        struct nvec params = {0};
        if ((st = expect_op(p, "(")) != KR_OK) {
            return st;
        }
        while (st == KR_OK && !is_op(cur(p), ")")) {
            if (params.n > 0 && (st = expect_op(p, ",")) != KR_OK) {
                break;
            }
            if (cur(p)->t != T_NAME) {
                st = syntax_err(p->err, cur(p)->line, "expected a parameter name");
                break;
            }
            const char *pn = tok_str(p, cur(p));
            p->pos++;
            struct node *def = NULL;
            if (is_op(cur(p), "=")) {
                p->pos++;
                st = parse_expr(p, &def, true);
            }
            if (st == KR_OK) {
                st = pn ? nvec_push(&params, def, pn) : KR_ERR_NOMEM;
            }
        }
        if (st == KR_OK) {
            st = expect_op(p, ")");
        }
        if (st == KR_OK) {
            st = nvec_take(p, &params, &nd->kvals, &nd->knames, &nd->n_kw);
        }
        kr_free(params.v);
        kr_free(params.names);
        if (st != KR_OK || (st = expect_block_end(p)) != KR_OK || (st = parse_until(p, &nd->b, ends, &which)) != KR_OK) {
            return st;
        }
        return expect_block_end(p);
    }
    if (is_name(t, "break") || is_name(t, "continue")) {
        struct node *nd = new_node(p, is_name(t, "break") ? N_BREAK : N_CONTINUE);
        if (!nd) {
            return KR_ERR_NOMEM;
        }
        p->pos++;
        *out = nd;
        return expect_block_end(p);
    }
    if (is_name(t, "with")) {
        static const char *const ends[] = {"endwith", NULL};
        struct node *nd = new_node(p, N_WITH);
        struct nvec asg = {0};
        if (!nd) {
            return KR_ERR_NOMEM;
        }
        p->pos++;
        *out = nd;
        st = KR_OK;
        while (st == KR_OK && cur(p)->t != T_BLOCK_END) {
            if (asg.n > 0 && (st = expect_op(p, ",")) != KR_OK) {
                break;
            }
            if (cur(p)->t != T_NAME) {
                st = syntax_err(p->err, cur(p)->line, "expected a name in 'with'");
                break;
            }
            const char *nm = tok_str(p, cur(p));
            p->pos++;
            struct node *v;
            if ((st = expect_op(p, "=")) == KR_OK && (st = parse_expr(p, &v, true)) == KR_OK) {
                st = nvec_push(&asg, v, nm);
            }
        }
        if (st == KR_OK) {
            st = nvec_take(p, &asg, &nd->kvals, &nd->knames, &nd->n_kw);
        }
        kr_free(asg.v);
        kr_free(asg.names);
        if (st != KR_OK || (st = expect_block_end(p)) != KR_OK || (st = parse_until(p, &nd->b, ends, &which)) != KR_OK) {
            return st;
        }
        return expect_block_end(p);
    }
    if (is_name(t, "filter")) {
        static const char *const ends[] = {"endfilter", NULL};
        struct node *nd = new_node(p, N_FILTER_BLOCK);
        struct node *holder = new_node(p, E_CONST);
        if (!nd || !holder) {
            return KR_ERR_NOMEM;
        }
        holder->v.t = V_NONE;
        *out = nd;
        p->pos++;
        /* the filter name follows directly: reuse the `|` chain parser by pretending one is there */
        struct node *f = holder;
        struct node *fn = new_node(p, E_FILTER);
        if (!fn || cur(p)->t != T_NAME || !(fn->name = tok_str(p, cur(p)))) {
            return fn && cur(p)->t != T_NAME ? syntax_err(p->err, line, "expected a filter name") : KR_ERR_NOMEM;
        }
        if (!in_list(FILTERS, fn->name)) {
            return syntax_err(p->err, line, "no filter named '%s' (not supported)", fn->name);
        }
        p->pos++;
        fn->a = holder;
        if (is_op(cur(p), "(") && (st = parse_call_args(p, fn)) != KR_OK) {
            return st;
        }
        f = fn;
        if ((st = parse_filter_tail(p, &f)) != KR_OK) {
            return st;
        }
        nd->c = f;
        nd->name = (const char *)holder;
        if ((st = expect_block_end(p)) != KR_OK || (st = parse_until(p, &nd->b, ends, &which)) != KR_OK) {
            return st;
        }
        return expect_block_end(p);
    }
    if (is_name(t, "generation")) {
        static const char *const ends[] = {"endgeneration", NULL};
        p->pos++;
        if ((st = expect_block_end(p)) != KR_OK || (st = parse_until(p, out, ends, &which)) != KR_OK) {
            return st;
        }
        return expect_block_end(p);
    }
    return syntax_err(p->err, line, "unsupported tag '%.*s'", (int)t->len, t->s);
}

static enum kr_status parse_body(struct parser *p, struct node **out, const char *const *ends)
{
    struct nvec items = {0};
    enum kr_status st = KR_OK;
    struct node *body = new_node(p, N_BODY);
    if (!body) {
        return KR_ERR_NOMEM;
    }
    if (++p->depth > MAX_DEPTH) {
        return syntax_err(p->err, cur(p)->line, "blocks nested too deeply");
    }
    for (;;) {
        struct token *t = cur(p);
        struct node *nd = NULL;
        if (t->t == T_EOF) {
            if (ends) {
                st = syntax_err(p->err, t->line, "unexpected end of template, expected '%s'", ends[0]);
            }
            break;
        }
        if (t->t == T_DATA) {
            nd = new_node(p, N_TEXT);
            struct jstr *s = nd ? a_alloc(p->arena, sizeof(*s) + t->len + 1) : NULL;
            if (!s) {
                st = KR_ERR_NOMEM;
                break;
            }
            s->len = t->len;
            memcpy(s->s, t->s, t->len);
            s->s[t->len] = '\0';
            nd->v = (struct value){.t = V_STR, .u.s = s};
            p->pos++;
        } else if (t->t == T_VAR_BEGIN) {
            p->pos++;
            nd = new_node(p, N_OUTPUT);
            if (!nd) {
                st = KR_ERR_NOMEM;
                break;
            }
            if ((st = parse_tuple(p, &nd->a, false)) != KR_OK) {
                break;
            }
            if (cur(p)->t != T_VAR_END) {
                st = syntax_err(p->err, cur(p)->line, "expected end of print statement '}}', got %s", tok_desc(cur(p)));
                break;
            }
            p->pos++;
        } else if (t->t == T_BLOCK_BEGIN) {
            struct token *nt = &p->t[p->pos + 1];
            bool is_end = false;
            for (size_t i = 0; ends && ends[i]; i++) {
                is_end = is_end || is_name(nt, ends[i]);
            }
            if (is_end) {
                p->pos++;
                break;
            }
            if (nt->t == T_NAME && nt->len >= 3 && (memcmp(nt->s, "end", 3) == 0 || is_name(nt, "elif") ||
                                                      is_name(nt, "else"))) {
                st = syntax_err(p->err, nt->line, "unexpected '%.*s'%s%s", (int)nt->len, nt->s,
                                ends ? ", expected " : "", ends ? ends[0] : "");
                break;
            }
            p->pos++;
            if ((st = parse_statement(p, &nd)) != KR_OK) {
                break;
            }
        } else {
            st = syntax_err(p->err, t->line, "unexpected %s", tok_desc(t));
            break;
        }
        if ((st = nvec_push(&items, nd, NULL)) != KR_OK) {
            break;
        }
    }
    p->depth--;
    if (st == KR_OK) {
        st = nvec_take(p, &items, &body->kids, NULL, &body->n_kids);
    }
    kr_free(items.v);
    kr_free(items.names);
    *out = body;
    return st;
}

void kr_chat_template_free(struct kr_chat_template *tpl)
{
    if (!tpl) {
        return;
    }
    a_free(&tpl->arena);
    kr_free(tpl);
}

enum kr_status kr_chat_template_compile(const char *source, size_t len, struct kr_chat_template **out,
                                        struct kr_err *err)
{
    *out = NULL;
    if (!source) {
        return kr_err_set(err, KR_ERR_INVAL, "chat template: no source");
    }
    if (kr_utf8_validate(source, len) != len) {
        return kr_err_set(err, KR_ERR_FORMAT, "chat template: not valid UTF-8 (offset %zu)",
                          kr_utf8_validate(source, len));
    }
    struct kr_chat_template *tpl = kr_calloc(1, sizeof(*tpl));
    struct kr_buf_s src = {0};
    struct lexer lx = {.err = err};
    enum kr_status st = KR_ERR_NOMEM;
    if (!tpl) {
        goto fail;
    }
    /* jinja splits lines on \r\n, \r and \n, joins them with \n, and drops one trailing newline */
    for (size_t i = 0; i < len; i++) {
        if (source[i] == '\r') {
            st = kr_bs_putc(&src, '\n');
            i += i + 1 < len && source[i + 1] == '\n';
        } else {
            st = kr_bs_putc(&src, source[i]);
        }
        if (st != KR_OK) {
            goto fail;
        }
    }
    if (src.len > 0 && src.p[src.len - 1] == '\n') {
        src.len--;
    }
    if ((st = kr_bs_reserve(&src, 0)) != KR_OK) {
        goto fail;
    }
    /* the source must outlive the tokens that point into it: keep it in the arena */
    char *kept = a_alloc(&tpl->arena, src.len + 1);
    st = KR_ERR_NOMEM;
    if (!kept) {
        goto fail;
    }
    memcpy(kept, src.p, src.len + 1);
    lx.arena = &tpl->arena;
    lx.src = kept;
    lx.n = src.len;
    if ((st = lex(&lx)) != KR_OK) {
        goto fail;
    }
    struct parser p = {.arena = &tpl->arena, .err = err, .t = lx.toks, .n = lx.n_toks};
    if ((st = parse_body(&p, &tpl->body, NULL)) != KR_OK) {
        goto fail;
    }
    kr_free(lx.toks);
    kr_bs_free(&src);
    *out = tpl;
    return KR_OK;
fail:
    if (st == KR_ERR_NOMEM) {
        kr_err_set(err, st, "chat template: out of memory while compiling");
    }
    kr_free(lx.toks);
    kr_bs_free(&src);
    kr_chat_template_free(tpl);
    return st;
}

/* ==== evaluator ======================================================================================= */

struct scope {
    struct dict vars;
    struct scope *parent;
};
enum flow { FLOW_NORMAL, FLOW_BREAK, FLOW_CONTINUE };
struct ev {
    struct arena arena;
    struct kr_err *err;
    struct kr_buf_s *out;
    long steps;
    int depth;
    struct scope *root;
    struct scope *scope;            /* innermost scope */
    const struct node *inject_node; /* set/filter blocks: this placeholder evaluates to inject_val */
    struct value inject_val;
    int line;
};

static enum kr_status rt_err(struct ev *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static enum kr_status rt_err(struct ev *e, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    return kr_err_set(e->err, KR_ERR_INVAL, "chat template line %d: %s", e->line, msg);
}

static enum kr_status oom(struct ev *e)
{
    return kr_err_set(e->err, e->arena.total + 32768 > MAX_BYTES ? KR_ERR_INVAL : KR_ERR_NOMEM,
                      "chat template line %d: out of memory (limit %u MiB)", e->line, MAX_BYTES >> 20);
}

static struct value mk_str(struct ev *e, const char *s, size_t n)
{
    struct jstr *j = a_alloc(&e->arena, sizeof(*j) + n + 1);
    if (!j) {
        return v_undef();
    }
    j->len = n;
    if (n) {
        memcpy(j->s, s, n);
    }
    j->s[n] = '\0';
    return (struct value){.t = V_STR, .u.s = j};
}
#define STR_OK(v) ((v).t == V_STR)

static struct value mk_list(struct ev *e, enum vt t, size_t cap)
{
    struct list *l = a_alloc(&e->arena, sizeof(*l));
    struct value *v = l ? a_alloc(&e->arena, (cap ? cap : 1) * sizeof(*v)) : NULL;
    if (!v) {
        return v_undef();
    }
    *l = (struct list){0, cap ? cap : 1, v};
    return (struct value){.t = t, .u.l = l};
}

static bool list_push(struct ev *e, struct list *l, struct value v)
{
    if (l->n == l->cap) {
        struct value *nv = a_alloc(&e->arena, l->cap * 2 * sizeof(*nv));
        if (!nv) {
            return false;
        }
        memcpy(nv, l->v, l->n * sizeof(*nv));
        l->v = nv;
        l->cap *= 2;
    }
    l->v[l->n++] = v;
    return true;
}

static struct value mk_dict(struct ev *e, enum vt t)
{
    struct dict *d = a_alloc(&e->arena, sizeof(*d));
    if (!d) {
        return v_undef();
    }
    memset(d, 0, sizeof(*d));
    return (struct value){.t = t, .u.d = d};
}

static bool v_eq(struct value a, struct value b);

static struct value *dict_find(const struct dict *d, struct value k)
{
    for (size_t i = 0; i < d->n; i++) {
        if (v_eq(d->k[i], k)) {
            return &d->v[i];
        }
    }
    return NULL;
}

static struct value *dict_find_str(const struct dict *d, const char *k)
{
    size_t n = strlen(k);
    for (size_t i = 0; i < d->n; i++) {
        if (d->k[i].t == V_STR && d->k[i].u.s->len == n && memcmp(d->k[i].u.s->s, k, n) == 0) {
            return &d->v[i];
        }
    }
    return NULL;
}

static bool dict_set(struct ev *e, struct dict *d, struct value k, struct value v)
{
    struct value *slot = dict_find(d, k);
    if (slot) {
        *slot = v;
        return true;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 8;
        struct value *nk = a_alloc(&e->arena, cap * sizeof(*nk)), *nv = a_alloc(&e->arena, cap * sizeof(*nv));
        if (!nk || !nv) {
            return false;
        }
        if (d->n) {
            memcpy(nk, d->k, d->n * sizeof(*nk));
            memcpy(nv, d->v, d->n * sizeof(*nv));
        }
        d->k = nk;
        d->v = nv;
        d->cap = cap;
    }
    d->k[d->n] = k;
    d->v[d->n] = v;
    d->n++;
    return true;
}

static bool dict_set_str(struct ev *e, struct dict *d, const char *k, struct value v)
{
    struct value ks = mk_str(e, k, strlen(k));
    return STR_OK(ks) && dict_set(e, d, ks, v);
}

static struct value mk_func(struct ev *e, enum builtin b, struct value self, const char *name)
{
    struct func *f = a_alloc(&e->arena, sizeof(*f));
    if (!f) {
        return v_undef();
    }
    *f = (struct func){b, self, NULL, name};
    return (struct value){.t = V_FUNC, .u.fn = f};
}

static const char *type_name(struct value v)
{
    static const char *const names[] = {"Undefined", "NoneType", "bool", "int", "float", "str", "list", "tuple",
                                        "dict", "Namespace", "function"};
    return names[v.t];
}

/* ---- Python conversions ---------------------------------------------------------------------------- */

/* repr(float) / json.dumps of a float: the shortest digits that round-trip, Python's layout. */
static void fmt_float(double x, struct kr_buf_s *b, bool json)
{
    if (isnan(x)) {
        kr_bs_append(b, json ? "NaN" : "nan", 3);
        return;
    }
    if (isinf(x)) {
        const char *s = x > 0 ? (json ? "Infinity" : "inf") : (json ? "-Infinity" : "-inf");
        kr_bs_append(b, s, strlen(s));
        return;
    }
    char buf[64];
    int prec = 1;
    for (; prec <= 17; prec++) {
        snprintf(buf, sizeof(buf), "%.*e", prec - 1, x);
        if (strtod(buf, NULL) == x) {
            break;
        }
    }
    /* buf = [-]d.ddde[+-]XX : split into digits and exponent */
    char digits[32];
    int nd = 0, exp10;
    const char *q = buf;
    bool neg = *q == '-';
    if (neg) {
        q++;
    }
    for (; *q && *q != 'e'; q++) {
        if (*q != '.') {
            digits[nd++] = *q;
        }
    }
    exp10 = atoi(q + 1);
    while (nd > 1 && digits[nd - 1] == '0') {
        nd--;
    }
    int decpt = exp10 + 1; /* value = 0.digits * 10^decpt */
    if (neg) {
        kr_bs_putc(b, '-');
    }
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            kr_bs_append(b, "0.", 2);
            for (int i = 0; i < -decpt; i++) {
                kr_bs_putc(b, '0');
            }
            kr_bs_append(b, digits, (size_t)nd);
        } else if (nd <= decpt) {
            kr_bs_append(b, digits, (size_t)nd);
            for (int i = nd; i < decpt; i++) {
                kr_bs_putc(b, '0');
            }
            kr_bs_append(b, ".0", 2);
        } else {
            kr_bs_append(b, digits, (size_t)decpt);
            kr_bs_putc(b, '.');
            kr_bs_append(b, digits + decpt, (size_t)(nd - decpt));
        }
    } else {
        kr_bs_putc(b, digits[0]);
        if (nd > 1) {
            kr_bs_putc(b, '.');
            kr_bs_append(b, digits + 1, (size_t)(nd - 1));
        }
        kr_bs_printf(b, "e%c%02d", decpt - 1 < 0 ? '-' : '+', abs(decpt - 1));
    }
}

static void py_repr_str(const struct jstr *s, struct kr_buf_s *b)
{
    bool has_sq = memchr(s->s, '\'', s->len) != NULL, has_dq = memchr(s->s, '"', s->len) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    kr_bs_putc(b, q);
    for (size_t i = 0; i < s->len;) {
        uint32_t cp;
        size_t l = kr_utf8_next(s->s + i, &cp);
        if (cp == (uint32_t)q || cp == '\\') {
            kr_bs_putc(b, '\\');
            kr_bs_putc(b, (char)cp);
        } else if (cp == '\n') {
            kr_bs_append(b, "\\n", 2);
        } else if (cp == '\r') {
            kr_bs_append(b, "\\r", 2);
        } else if (cp == '\t') {
            kr_bs_append(b, "\\t", 2);
        } else if (cp < 0x20 || cp == 0x7F) {
            kr_bs_printf(b, "\\x%02x", cp);
        } else if (cp >= 0x80 && !kr_uni_is_printable(cp)) {
            if (cp <= 0xFF) {
                kr_bs_printf(b, "\\x%02x", cp);
            } else if (cp <= 0xFFFF) {
                kr_bs_printf(b, "\\u%04x", cp);
            } else {
                kr_bs_printf(b, "\\U%08x", cp);
            }
        } else {
            kr_bs_append(b, s->s + i, l);
        }
        i += l;
    }
    kr_bs_putc(b, q);
}

static void py_str(struct value v, struct kr_buf_s *b, bool repr);

static void py_repr_seq(struct value v, struct kr_buf_s *b)
{
    if (v.t == V_LIST || v.t == V_TUPLE) {
        kr_bs_putc(b, v.t == V_LIST ? '[' : '(');
        for (size_t i = 0; i < v.u.l->n; i++) {
            if (i) {
                kr_bs_append(b, ", ", 2);
            }
            py_str(v.u.l->v[i], b, true);
        }
        if (v.t == V_TUPLE && v.u.l->n == 1) {
            kr_bs_putc(b, ',');
        }
        kr_bs_putc(b, v.t == V_LIST ? ']' : ')');
        return;
    }
    if (v.t == V_NS) {
        kr_bs_append(b, "<Namespace {", 12);
    } else {
        kr_bs_putc(b, '{');
    }
    for (size_t i = 0; i < v.u.d->n; i++) {
        if (i) {
            kr_bs_append(b, ", ", 2);
        }
        py_str(v.u.d->k[i], b, true);
        kr_bs_append(b, ": ", 2);
        py_str(v.u.d->v[i], b, true);
    }
    kr_bs_append(b, v.t == V_NS ? "}>" : "}", v.t == V_NS ? 2 : 1);
}

/* str(v) (repr=false) or repr(v) (repr=true) as Python prints them. */
static void py_str(struct value v, struct kr_buf_s *b, bool repr)
{
    switch (v.t) {
    case V_UNDEF: break;
    case V_NONE: kr_bs_append(b, "None", 4); break;
    case V_BOOL: kr_bs_append(b, v.u.b ? "True" : "False", v.u.b ? 4 : 5); break;
    case V_INT: kr_bs_printf(b, "%lld", (long long)v.u.i); break;
    case V_FLOAT: fmt_float(v.u.f, b, false); break;
    case V_STR:
        if (repr) {
            py_repr_str(v.u.s, b);
        } else {
            kr_bs_append(b, v.u.s->s, v.u.s->len);
        }
        break;
    case V_LIST:
    case V_TUPLE:
    case V_DICT:
    case V_NS: py_repr_seq(v, b); break;
    case V_FUNC: kr_bs_printf(b, "<function %s>", v.u.fn->name ? v.u.fn->name : "?"); break;
    }
}

static struct value to_str(struct ev *e, struct value v)
{
    if (v.t == V_STR) {
        return v;
    }
    struct kr_buf_s b = {0};
    py_str(v, &b, false);
    struct value r = mk_str(e, b.p ? b.p : "", b.len);
    kr_bs_free(&b);
    return r;
}

static bool truthy(struct value v)
{
    switch (v.t) {
    case V_UNDEF:
    case V_NONE: return false;
    case V_BOOL: return v.u.b;
    case V_INT: return v.u.i != 0;
    case V_FLOAT: return v.u.f != 0.0;
    case V_STR: return v.u.s->len > 0;
    case V_LIST:
    case V_TUPLE: return v.u.l->n > 0;
    case V_DICT: return v.u.d->n > 0;
    case V_NS:
    case V_FUNC: return true;
    }
    return false;
}

static bool is_num(struct value v)
{
    return v.t == V_INT || v.t == V_FLOAT || v.t == V_BOOL;
}

static double num(struct value v)
{
    return v.t == V_FLOAT ? v.u.f : v.t == V_INT ? (double)v.u.i : (double)v.u.b;
}

static int64_t inum(struct value v)
{
    return v.t == V_INT ? v.u.i : v.t == V_BOOL ? (int64_t)v.u.b : v.t == V_FLOAT ? (int64_t)v.u.f : 0;
}

static bool v_eq(struct value a, struct value b)
{
    if (is_num(a) && is_num(b)) {
        if (a.t != V_FLOAT && b.t != V_FLOAT) {
            return inum(a) == inum(b);
        }
        return num(a) == num(b);
    }
    if (a.t != b.t) {
        return (a.t == V_LIST && b.t == V_TUPLE) ? false : false;
    }
    switch (a.t) {
    case V_UNDEF:
    case V_NONE: return true;
    case V_STR: return a.u.s->len == b.u.s->len && memcmp(a.u.s->s, b.u.s->s, a.u.s->len) == 0;
    case V_LIST:
    case V_TUPLE:
        if (a.u.l->n != b.u.l->n) {
            return false;
        }
        for (size_t i = 0; i < a.u.l->n; i++) {
            if (!v_eq(a.u.l->v[i], b.u.l->v[i])) {
                return false;
            }
        }
        return true;
    case V_DICT:
        if (a.u.d->n != b.u.d->n) {
            return false;
        }
        for (size_t i = 0; i < a.u.d->n; i++) {
            struct value *o = dict_find(b.u.d, a.u.d->k[i]);
            if (!o || !v_eq(a.u.d->v[i], *o)) {
                return false;
            }
        }
        return true;
    default: return a.u.d == b.u.d;
    }
}

/* Python ordering; returns false (with an error) for incomparable types. */
static bool v_cmp(struct ev *e, struct value a, struct value b, int *res)
{
    if (is_num(a) && is_num(b)) {
        if (a.t != V_FLOAT && b.t != V_FLOAT) {
            *res = inum(a) < inum(b) ? -1 : inum(a) > inum(b);
        } else {
            *res = num(a) < num(b) ? -1 : num(a) > num(b);
        }
        return true;
    }
    if (a.t == V_STR && b.t == V_STR) {
        size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        int c = memcmp(a.u.s->s, b.u.s->s, n);
        *res = c ? (c < 0 ? -1 : 1) : (a.u.s->len < b.u.s->len ? -1 : a.u.s->len > b.u.s->len);
        return true;
    }
    if ((a.t == V_LIST || a.t == V_TUPLE) && a.t == b.t) {
        for (size_t i = 0; i < a.u.l->n && i < b.u.l->n; i++) {
            if (!v_eq(a.u.l->v[i], b.u.l->v[i])) {
                return v_cmp(e, a.u.l->v[i], b.u.l->v[i], res);
            }
        }
        *res = a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n;
        return true;
    }
    rt_err(e, "'<' not supported between instances of '%s' and '%s'", type_name(a), type_name(b));
    return false;
}

/* ---- JSON in and out ---------------------------------------------------------------------------------- */

static struct value from_json(struct ev *e, const json_t *j)
{
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        struct value d = mk_dict(e, V_DICT);
        const char *k;
        json_t *v;
        if (d.t != V_DICT) {
            return d;
        }
        json_object_foreach((json_t *)j, k, v) {
            struct value ks = mk_str(e, k, strlen(k)), vs = from_json(e, v);
            if (!STR_OK(ks) || (vs.t == V_UNDEF) || !dict_set(e, d.u.d, ks, vs)) {
                return v_undef();
            }
        }
        return d;
    }
    case JSON_ARRAY: {
        struct value l = mk_list(e, V_LIST, json_array_size(j));
        for (size_t i = 0; l.t == V_LIST && i < json_array_size(j); i++) {
            struct value x = from_json(e, json_array_get(j, i));
            if (x.t == V_UNDEF || !list_push(e, l.u.l, x)) {
                return v_undef();
            }
        }
        return l;
    }
    case JSON_STRING: return mk_str(e, json_string_value(j), json_string_length(j));
    case JSON_INTEGER: return v_int(json_integer_value(j));
    case JSON_REAL: return v_float(json_real_value(j));
    case JSON_TRUE: return v_bool(true);
    case JSON_FALSE: return v_bool(false);
    case JSON_NULL: return v_none();
    }
    return v_undef();
}

struct json_opts {
    const char *indent; /* NULL: single line */
    const char *item_sep, *key_sep;
    bool sort_keys;
};

static void json_str(const char *s, size_t n, struct kr_buf_s *b)
{
    kr_bs_putc(b, '"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '"': kr_bs_append(b, "\\\"", 2); break;
        case '\\': kr_bs_append(b, "\\\\", 2); break;
        case '\n': kr_bs_append(b, "\\n", 2); break;
        case '\r': kr_bs_append(b, "\\r", 2); break;
        case '\t': kr_bs_append(b, "\\t", 2); break;
        case '\b': kr_bs_append(b, "\\b", 2); break;
        case '\f': kr_bs_append(b, "\\f", 2); break;
        default:
            if (c < 0x20) {
                kr_bs_printf(b, "\\u%04x", c);
            } else {
                kr_bs_putc(b, (char)c);
            }
        }
    }
    kr_bs_putc(b, '"');
}

static int key_order(const void *pa, const void *pb)
{
    const struct value *a = pa, *b = pb;
    size_t n = a->u.s->len < b->u.s->len ? a->u.s->len : b->u.s->len;
    int c = memcmp(a->u.s->s, b->u.s->s, n);
    return c ? c : (a->u.s->len > b->u.s->len) - (a->u.s->len < b->u.s->len);
}

/* json.dumps(v, ensure_ascii=False, ...) */
static enum kr_status to_json(struct ev *e, struct value v, const struct json_opts *o, int level, struct kr_buf_s *b)
{
    if (level > MAX_DEPTH) {
        return rt_err(e, "tojson: value nested too deeply");
    }
    switch (v.t) {
    case V_NONE: kr_bs_append(b, "null", 4); return KR_OK;
    case V_BOOL: kr_bs_append(b, v.u.b ? "true" : "false", v.u.b ? 4 : 5); return KR_OK;
    case V_INT: kr_bs_printf(b, "%lld", (long long)v.u.i); return KR_OK;
    case V_FLOAT: fmt_float(v.u.f, b, true); return KR_OK;
    case V_STR: json_str(v.u.s->s, v.u.s->len, b); return KR_OK;
    case V_LIST:
    case V_TUPLE:
    case V_DICT: {
        bool is_dict = v.t == V_DICT;
        size_t n = is_dict ? v.u.d->n : v.u.l->n;
        kr_bs_putc(b, is_dict ? '{' : '[');
        if (n == 0) {
            kr_bs_putc(b, is_dict ? '}' : ']');
            return KR_OK;
        }
        size_t *order = NULL;
        struct value *keys = NULL;
        if (is_dict && o->sort_keys) {
            keys = kr_malloc(n * sizeof(*keys));
            order = kr_malloc(n * sizeof(*order));
            if (!keys || !order) {
                kr_free(keys);
                kr_free(order);
                return oom(e);
            }
            for (size_t i = 0; i < n; i++) {
                if (v.u.d->k[i].t != V_STR) {
                    kr_free(keys);
                    kr_free(order);
                    return rt_err(e, "tojson: sort_keys needs string keys");
                }
                keys[i] = v.u.d->k[i];
            }
            qsort(keys, n, sizeof(*keys), key_order);
        }
        enum kr_status st = KR_OK;
        for (size_t i = 0; i < n && st == KR_OK; i++) {
            if (i) {
                kr_bs_append(b, o->item_sep, strlen(o->item_sep));
            }
            if (o->indent) {
                kr_bs_putc(b, '\n');
                for (int k = 0; k <= level; k++) {
                    kr_bs_append(b, o->indent, strlen(o->indent));
                }
            }
            if (is_dict) {
                struct value k = keys ? keys[i] : v.u.d->k[i];
                struct value val = keys ? *dict_find(v.u.d, k) : v.u.d->v[i];
                if (k.t == V_STR) {
                    json_str(k.u.s->s, k.u.s->len, b);
                } else if (k.t == V_INT || k.t == V_FLOAT || k.t == V_BOOL || k.t == V_NONE) {
                    struct kr_buf_s kb = {0};
                    st = to_json(e, k, o, level + 1, &kb);
                    json_str(kb.p ? kb.p : "", kb.len, b);
                    kr_bs_free(&kb);
                } else {
                    st = rt_err(e, "tojson: keys must be str, int, float, bool or None, not %s", type_name(k));
                }
                kr_bs_append(b, o->key_sep, strlen(o->key_sep));
                if (st == KR_OK) {
                    st = to_json(e, val, o, level + 1, b);
                }
            } else {
                st = to_json(e, v.u.l->v[i], o, level + 1, b);
            }
        }
        kr_free(keys);
        kr_free(order);
        if (o->indent) {
            kr_bs_putc(b, '\n');
            for (int k = 0; k < level; k++) {
                kr_bs_append(b, o->indent, strlen(o->indent));
            }
        }
        kr_bs_putc(b, is_dict ? '}' : ']');
        return st;
    }
    default:
        return rt_err(e, "Object of type %s is not JSON serializable", type_name(v));
    }
}

/* ---- strings ---------------------------------------------------------------------------------------- */

static size_t u8_count(const char *s, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++) {
        c += ((unsigned char)s[i] & 0xC0) != 0x80;
    }
    return c;
}

/* Byte offset of code point index k. */
static size_t u8_offset(const char *s, size_t n, size_t k)
{
    size_t i = 0;
    while (i < n && k > 0) {
        i++;
        while (i < n && ((unsigned char)s[i] & 0xC0) == 0x80) {
            i++;
        }
        k--;
    }
    return i;
}

/* Is cp one of `chars` (NULL: Python whitespace)? */
static bool in_chars(uint32_t cp, const struct jstr *chars)
{
    if (!chars) {
        return kr_uni_is_py_space(cp);
    }
    for (size_t i = 0; i < chars->len;) {
        uint32_t c;
        i += kr_utf8_next(chars->s + i, &c);
        if (c == cp) {
            return true;
        }
    }
    return false;
}

static struct value py_strip(struct ev *e, const struct jstr *s, const struct jstr *chars, bool left, bool right)
{
    size_t a = 0, b = s->len;
    while (left && a < b) {
        uint32_t cp;
        size_t l = kr_utf8_next(s->s + a, &cp);
        if (!in_chars(cp, chars)) {
            break;
        }
        a += l;
    }
    while (right && b > a) {
        size_t k = b - 1;
        while (k > a && ((unsigned char)s->s[k] & 0xC0) == 0x80) {
            k--;
        }
        uint32_t cp;
        kr_utf8_next(s->s + k, &cp);
        if (!in_chars(cp, chars)) {
            break;
        }
        b = k;
    }
    return mk_str(e, s->s + a, b - a);
}

static struct value map_case(struct ev *e, const struct jstr *s, int mode /* 0 lower 1 upper 2 title 3 capitalize */)
{
    struct kr_buf_s b = {0};
    bool prev_cased = false;
    size_t idx = 0;
    for (size_t i = 0; i < s->len; idx++) {
        uint32_t cp;
        i += kr_utf8_next(s->s + i, &cp);
        uint32_t o = cp;
        if (mode == 0) {
            o = kr_uni_tolower(cp);
        } else if (mode == 1) {
            o = kr_uni_toupper(cp);
        } else if (mode == 2) {
            o = prev_cased ? kr_uni_tolower(cp) : kr_uni_totitle(cp);
        } else {
            o = idx == 0 ? kr_uni_totitle(cp) : kr_uni_tolower(cp);
        }
        bool cased = kr_uni_tolower(cp) != cp || kr_uni_toupper(cp) != cp || kr_uni_totitle(cp) != cp;
        prev_cased = cased;
        kr_bs_put_cp(&b, o);
    }
    struct value r = mk_str(e, b.p ? b.p : "", b.len);
    kr_bs_free(&b);
    return r;
}

static struct value str_replace(struct ev *e, const struct jstr *s, const struct jstr *old, const struct jstr *new,
                                int64_t count)
{
    struct kr_buf_s b = {0};
    size_t i = 0;
    int64_t done = 0;
    if (old->len == 0) { /* Python inserts `new` between every character */
        for (size_t k = 0; k <= s->len && (count < 0 || done < count);) {
            kr_bs_append(&b, new->s, new->len);
            done++;
            if (k == s->len) {
                k++;
                i = s->len;
                break;
            }
            uint32_t cp;
            size_t l = kr_utf8_next(s->s + k, &cp);
            kr_bs_append(&b, s->s + k, l);
            k += l;
            i = k;
        }
        kr_bs_append(&b, s->s + i, s->len - i);
    } else {
        while (i < s->len) {
            const char *hit = NULL;
            if (count < 0 || done < count) {
                for (size_t k = i; k + old->len <= s->len; k++) {
                    if (memcmp(s->s + k, old->s, old->len) == 0) {
                        hit = s->s + k;
                        break;
                    }
                }
            }
            if (!hit) {
                break;
            }
            kr_bs_append(&b, s->s + i, (size_t)(hit - (s->s + i)));
            kr_bs_append(&b, new->s, new->len);
            i = (size_t)(hit - s->s) + old->len;
            done++;
        }
        kr_bs_append(&b, s->s + i, s->len - i);
    }
    struct value r = mk_str(e, b.p ? b.p : "", b.len);
    kr_bs_free(&b);
    return r;
}

static const char *memfind(const char *h, size_t hn, const char *n, size_t nn, bool last)
{
    if (nn > hn) {
        return NULL;
    }
    const char *found = NULL;
    for (size_t i = 0; i + nn <= hn; i++) {
        if (memcmp(h + i, n, nn) == 0) {
            found = h + i;
            if (!last) {
                break;
            }
        }
    }
    return found;
}

/* ---- scopes and lookups ---------------------------------------------------------------------------------- */

static struct value *scope_lookup(struct scope *s, const char *name)
{
    for (; s; s = s->parent) {
        struct value *v = dict_find_str(&s->vars, name);
        if (v) {
            return v;
        }
    }
    return NULL;
}

static const struct { const char *name; enum builtin b; } GLOBALS[] = {
    {"range", B_RANGE}, {"namespace", B_NAMESPACE}, {"dict", B_DICT}, {"raise_exception", B_RAISE},
    {"strftime_now", B_STRFTIME},
};

static const struct { const char *name; enum builtin b; int on; /* 1 str, 2 dict, 3 list */ } METHODS[] = {
    {"strip", M_STRIP, 1}, {"lstrip", M_LSTRIP, 1}, {"rstrip", M_RSTRIP, 1}, {"split", M_SPLIT, 1},
    {"rsplit", M_RSPLIT, 1}, {"startswith", M_STARTSWITH, 1}, {"endswith", M_ENDSWITH, 1}, {"upper", M_UPPER, 1},
    {"lower", M_LOWER, 1}, {"title", M_TITLE, 1}, {"capitalize", M_CAPITALIZE, 1}, {"replace", M_REPLACE, 1},
    {"find", M_FIND, 1}, {"rfind", M_RFIND, 1}, {"count", M_COUNT, 1}, {"join", M_JOIN, 1},
    {"isdigit", M_ISDIGIT, 1}, {"isalpha", M_ISALPHA, 1}, {"isalnum", M_ISALNUM, 1}, {"isspace", M_ISSPACE, 1},
    {"isupper", M_ISUPPER, 1}, {"islower", M_ISLOWER, 1},
    {"items", M_ITEMS, 2}, {"keys", M_KEYS, 2}, {"values", M_VALUES, 2}, {"get", M_GET, 2},
    {"pop", M_UNSAFE, 2}, {"update", M_UNSAFE, 2}, {"setdefault", M_UNSAFE, 2}, {"clear", M_UNSAFE, 2},
    {"popitem", M_UNSAFE, 2}, {"copy", M_UNSAFE, 2},
    {"index", M_INDEX, 3}, {"count", M_LCOUNT, 3}, {"append", M_UNSAFE, 3}, {"extend", M_UNSAFE, 3},
    {"insert", M_UNSAFE, 3}, {"pop", M_UNSAFE, 3}, {"remove", M_UNSAFE, 3}, {"sort", M_UNSAFE, 3},
    {"reverse", M_UNSAFE, 3}, {"clear", M_UNSAFE, 3},
};

/* jinja's getattr: an attribute (method) first, then an item. */
static enum kr_status get_attr(struct ev *e, struct value obj, const char *name, struct value *out)
{
    int on = obj.t == V_STR ? 1 : obj.t == V_DICT ? 2 : (obj.t == V_LIST || obj.t == V_TUPLE) ? 3 : 0;
    if (obj.t == V_UNDEF) {
        return rt_err(e, "'%s' is undefined (attribute '%s' of an undefined value)", "value", name);
    }
    for (size_t i = 0; on && i < sizeof(METHODS) / sizeof(METHODS[0]); i++) {
        if (METHODS[i].on == on && strcmp(METHODS[i].name, name) == 0) {
            *out = mk_func(e, METHODS[i].b, obj, METHODS[i].name);
            return out->t == V_FUNC ? KR_OK : oom(e);
        }
    }
    if (obj.t == V_DICT || obj.t == V_NS) {
        struct value *v = dict_find_str(obj.u.d, name);
        *out = v ? *v : v_undef();
        return KR_OK;
    }
    *out = v_undef();
    return KR_OK;
}

static bool py_index(int64_t i, size_t n, size_t *out)
{
    if (i < 0) {
        i += (int64_t)n;
    }
    if (i < 0 || (uint64_t)i >= n) {
        return false;
    }
    *out = (size_t)i;
    return true;
}

/* jinja's getitem: obj[key], then getattr for string keys; missing -> undefined. */
static enum kr_status get_item(struct ev *e, struct value obj, struct value key, struct value *out)
{
    *out = v_undef();
    if (obj.t == V_UNDEF) {
        return rt_err(e, "cannot index an undefined value");
    }
    if ((obj.t == V_LIST || obj.t == V_TUPLE) && (key.t == V_INT || key.t == V_BOOL)) {
        size_t k;
        if (py_index(inum(key), obj.u.l->n, &k)) {
            *out = obj.u.l->v[k];
        }
        return KR_OK;
    }
    if (obj.t == V_STR && (key.t == V_INT || key.t == V_BOOL)) {
        size_t k;
        if (py_index(inum(key), u8_count(obj.u.s->s, obj.u.s->len), &k)) {
            size_t a = u8_offset(obj.u.s->s, obj.u.s->len, k), b = u8_offset(obj.u.s->s, obj.u.s->len, k + 1);
            *out = mk_str(e, obj.u.s->s + a, b - a);
        }
        return KR_OK;
    }
    if (obj.t == V_DICT || obj.t == V_NS) {
        struct value *v = dict_find(obj.u.d, key);
        if (v) {
            *out = *v;
            return KR_OK;
        }
    }
    if (key.t == V_STR) {
        return get_attr(e, obj, key.u.s->s, out);
    }
    return KR_OK;
}

static enum kr_status slice(struct ev *e, struct value obj, struct value va, struct value vb, struct value vc,
                            struct value *out)
{
    int64_t step = vc.t == V_NONE || vc.t == V_UNDEF ? 1 : inum(vc);
    if (step == 0) {
        return rt_err(e, "slice step cannot be zero");
    }
    bool is_str = obj.t == V_STR;
    if (!is_str && obj.t != V_LIST && obj.t != V_TUPLE) {
        return rt_err(e, "'%s' object is not subscriptable", type_name(obj));
    }
    int64_t n = is_str ? (int64_t)u8_count(obj.u.s->s, obj.u.s->len) : (int64_t)obj.u.l->n;
    int64_t lo, hi;
    bool has_a = va.t != V_NONE && va.t != V_UNDEF, has_b = vb.t != V_NONE && vb.t != V_UNDEF;
    if ((has_a && !(va.t == V_INT || va.t == V_BOOL)) || (has_b && !(vb.t == V_INT || vb.t == V_BOOL))) {
        return rt_err(e, "slice indices must be integers or None");
    }
    if (step > 0) {
        lo = has_a ? inum(va) : 0;
        hi = has_b ? inum(vb) : n;
        if (lo < 0) {
            lo = lo + n < 0 ? 0 : lo + n;
        }
        if (hi < 0) {
            hi = hi + n < 0 ? 0 : hi + n;
        }
        lo = lo > n ? n : lo;
        hi = hi > n ? n : hi;
    } else {
        lo = has_a ? inum(va) : n - 1;
        hi = has_b ? inum(vb) : -1 - n;
        if (lo < 0) {
            lo = lo + n < -1 ? -1 : lo + n;
        }
        if (hi < 0) {
            hi = hi + n < -1 ? -1 : hi + n;
        }
        lo = lo >= n ? n - 1 : lo;
        hi = hi >= n ? n - 1 : hi;
    }
    struct value r = is_str ? v_undef() : mk_list(e, obj.t, 8);
    struct kr_buf_s b = {0};
    for (int64_t i = lo; step > 0 ? i < hi : i > hi; i += step) {
        if (is_str) {
            size_t a = u8_offset(obj.u.s->s, obj.u.s->len, (size_t)i);
            size_t z = u8_offset(obj.u.s->s + a, obj.u.s->len - a, 1);
            kr_bs_append(&b, obj.u.s->s + a, z);
        } else if (r.t == V_UNDEF || !list_push(e, r.u.l, obj.u.l->v[i])) {
            return oom(e);
        }
    }
    if (is_str) {
        r = mk_str(e, b.p ? b.p : "", b.len);
        kr_bs_free(&b);
        if (r.t != V_STR) {
            return oom(e);
        }
    }
    *out = r;
    return KR_OK;
}

/* ---- iteration ---------------------------------------------------------------------------------------- */

/* Materializes anything iterable as a list (dict -> keys, str -> characters). */
static enum kr_status iter_list(struct ev *e, struct value v, struct list **out)
{
    static struct list empty;
    if (v.t == V_LIST || v.t == V_TUPLE) {
        *out = v.u.l;
        return KR_OK;
    }
    if (v.t == V_UNDEF) {
        *out = &empty;
        return KR_OK;
    }
    if (v.t == V_DICT) {
        struct value l = mk_list(e, V_LIST, v.u.d->n);
        if (l.t != V_LIST) {
            return oom(e);
        }
        for (size_t i = 0; i < v.u.d->n; i++) {
            l.u.l->v[i] = v.u.d->k[i];
        }
        l.u.l->n = v.u.d->n;
        *out = l.u.l;
        return KR_OK;
    }
    if (v.t == V_STR) {
        struct value l = mk_list(e, V_LIST, v.u.s->len);
        if (l.t != V_LIST) {
            return oom(e);
        }
        for (size_t i = 0; i < v.u.s->len;) {
            uint32_t cp;
            size_t n = kr_utf8_next(v.u.s->s + i, &cp);
            struct value c = mk_str(e, v.u.s->s + i, n);
            if (c.t != V_STR || !list_push(e, l.u.l, c)) {
                return oom(e);
            }
            i += n;
        }
        *out = l.u.l;
        return KR_OK;
    }
    return rt_err(e, "'%s' object is not iterable", type_name(v));
}

/* ---- operators ------------------------------------------------------------------------------------------- */

static enum kr_status eval(struct ev *e, const struct node *nd, struct value *out);
static enum kr_status exec_body(struct ev *e, const struct node *body, struct scope *sc, enum flow *flow);

static enum kr_status arith(struct ev *e, int op, struct value a, struct value b, struct value *out)
{
    if (a.t == V_UNDEF || b.t == V_UNDEF) {
        return rt_err(e, "an undefined value was used in arithmetic");
    }
    if (op == OP_ADD && a.t == V_STR && b.t == V_STR) {
        struct kr_buf_s s = {0};
        kr_bs_append(&s, a.u.s->s, a.u.s->len);
        kr_bs_append(&s, b.u.s->s, b.u.s->len);
        *out = mk_str(e, s.p ? s.p : "", s.len);
        kr_bs_free(&s);
        return out->t == V_STR ? KR_OK : oom(e);
    }
    if (op == OP_ADD && (a.t == V_LIST || a.t == V_TUPLE) && a.t == b.t) {
        struct value l = mk_list(e, a.t, a.u.l->n + b.u.l->n);
        for (size_t i = 0; l.t != V_UNDEF && i < a.u.l->n + b.u.l->n; i++) {
            l.u.l->v[i] = i < a.u.l->n ? a.u.l->v[i] : b.u.l->v[i - a.u.l->n];
        }
        if (l.t == V_UNDEF) {
            return oom(e);
        }
        l.u.l->n = a.u.l->n + b.u.l->n;
        *out = l;
        return KR_OK;
    }
    if (op == OP_MUL && ((a.t == V_STR || a.t == V_LIST) && (b.t == V_INT || b.t == V_BOOL))) {
        int64_t k = inum(b) < 0 ? 0 : inum(b);
        if (a.t == V_STR) {
            if ((uint64_t)k * a.u.s->len > MAX_BYTES) {
                return oom(e);
            }
            struct kr_buf_s s = {0};
            for (int64_t i = 0; i < k; i++) {
                kr_bs_append(&s, a.u.s->s, a.u.s->len);
            }
            *out = mk_str(e, s.p ? s.p : "", s.len);
            kr_bs_free(&s);
            return out->t == V_STR ? KR_OK : oom(e);
        }
        struct value l = mk_list(e, V_LIST, 8);
        for (int64_t i = 0; l.t != V_UNDEF && i < k; i++) {
            for (size_t j = 0; j < a.u.l->n; j++) {
                if (!list_push(e, l.u.l, a.u.l->v[j])) {
                    return oom(e);
                }
            }
        }
        *out = l;
        return l.t != V_UNDEF ? KR_OK : oom(e);
    }
    if (op == OP_MOD && a.t == V_STR) { /* printf-style formatting with %s / %d */
        struct list one = {1, 1, &b};
        struct list *args = b.t == V_TUPLE ? b.u.l : &one;
        struct kr_buf_s s = {0};
        size_t k = 0;
        for (size_t i = 0; i < a.u.s->len; i++) {
            char c = a.u.s->s[i];
            if (c != '%' || i + 1 >= a.u.s->len) {
                kr_bs_putc(&s, c);
                continue;
            }
            char f = a.u.s->s[++i];
            if (f == '%') {
                kr_bs_putc(&s, '%');
            } else if ((f == 's' || f == 'd' || f == 'r') && k < args->n) {
                struct value x = args->v[k++];
                if (f == 'd') {
                    kr_bs_printf(&s, "%lld", (long long)(x.t == V_FLOAT ? (int64_t)x.u.f : inum(x)));
                } else {
                    py_str(x, &s, f == 'r');
                }
            } else {
                kr_bs_free(&s);
                return rt_err(e, "unsupported string formatting");
            }
        }
        *out = mk_str(e, s.p ? s.p : "", s.len);
        kr_bs_free(&s);
        return KR_OK;
    }
    if (!is_num(a) || !is_num(b)) {
        static const char *const names[] = {"+", "-", "*", "/", "//", "%", "**"};
        return rt_err(e, "unsupported operand type(s) for %s: '%s' and '%s'", names[op], type_name(a), type_name(b));
    }
    bool ints = a.t != V_FLOAT && b.t != V_FLOAT;
    int64_t x = inum(a), y = inum(b), r;
    double fx = num(a), fy = num(b);
    switch (op) {
    case OP_ADD:
        if (ints) {
            if (__builtin_add_overflow(x, y, &r)) {
                return rt_err(e, "integer overflow");
            }
            *out = v_int(r);
        } else {
            *out = v_float(fx + fy);
        }
        return KR_OK;
    case OP_SUB:
        if (ints) {
            if (__builtin_sub_overflow(x, y, &r)) {
                return rt_err(e, "integer overflow");
            }
            *out = v_int(r);
        } else {
            *out = v_float(fx - fy);
        }
        return KR_OK;
    case OP_MUL:
        if (ints) {
            if (__builtin_mul_overflow(x, y, &r)) {
                return rt_err(e, "integer overflow");
            }
            *out = v_int(r);
        } else {
            *out = v_float(fx * fy);
        }
        return KR_OK;
    case OP_DIV:
        if (fy == 0.0) {
            return rt_err(e, "division by zero");
        }
        *out = v_float(fx / fy);
        return KR_OK;
    case OP_FLOORDIV:
    case OP_MOD:
        if (ints ? y == 0 : fy == 0.0) {
            return rt_err(e, "integer division or modulo by zero");
        }
        if (ints) {
            if (x == INT64_MIN && y == -1) {
                return rt_err(e, "integer overflow");
            }
            int64_t q = x / y, m = x % y;
            if (m != 0 && ((m < 0) != (y < 0))) {
                q--;
                m += y;
            }
            *out = v_int(op == OP_FLOORDIV ? q : m);
        } else {
            double m = fmod(fx, fy);
            if (m != 0 && ((m < 0) != (fy < 0))) {
                m += fy;
            }
            *out = v_float(op == OP_FLOORDIV ? floor(fx / fy) : m);
        }
        return KR_OK;
    case OP_POW:
        if (ints && y >= 0) {
            int64_t acc = 1;
            for (int64_t i = 0; i < y; i++) {
                if (__builtin_mul_overflow(acc, x, &acc)) {
                    return rt_err(e, "integer overflow");
                }
                if (acc == 0 || acc == 1) {
                    break;
                }
            }
            *out = v_int(acc);
        } else {
            *out = v_float(pow(fx, fy));
        }
        return KR_OK;
    }
    return KR_ERR_INTERNAL;
}

static enum kr_status contains(struct ev *e, struct value hay, struct value needle, bool *res)
{
    *res = false;
    if (hay.t == V_STR) {
        if (needle.t != V_STR) {
            return rt_err(e, "'in <string>' requires string as left operand, not %s", type_name(needle));
        }
        *res = memfind(hay.u.s->s, hay.u.s->len, needle.u.s->s, needle.u.s->len, false) != NULL;
        return KR_OK;
    }
    if (hay.t == V_DICT || hay.t == V_NS) {
        *res = dict_find(hay.u.d, needle) != NULL;
        return KR_OK;
    }
    if (hay.t == V_LIST || hay.t == V_TUPLE) {
        for (size_t i = 0; i < hay.u.l->n && !*res; i++) {
            *res = v_eq(hay.u.l->v[i], needle);
        }
        return KR_OK;
    }
    if (hay.t == V_UNDEF) {
        return KR_OK;
    }
    return rt_err(e, "argument of type '%s' is not iterable", type_name(hay));
}

static enum kr_status compare(struct ev *e, int op, struct value a, struct value b, bool *res)
{
    int c;
    switch (op) {
    case OP_EQ: *res = v_eq(a, b); return KR_OK;
    case OP_NE: *res = !v_eq(a, b); return KR_OK;
    case OP_IN: return contains(e, b, a, res);
    case OP_NOTIN: {
        enum kr_status st = contains(e, b, a, res);
        *res = !*res;
        return st;
    }
    default:
        if (a.t == V_UNDEF || b.t == V_UNDEF) {
            return rt_err(e, "an undefined value was compared");
        }
        if (!v_cmp(e, a, b, &c)) {
            return KR_ERR_INVAL;
        }
        *res = op == OP_LT ? c < 0 : op == OP_LE ? c <= 0 : op == OP_GT ? c > 0 : c >= 0;
        return KR_OK;
    }
}

/* ---- calls -------------------------------------------------------------------------------------------- */

struct args {
    struct value *pos;
    size_t n;
    const char **kn;
    struct value *kv;
    size_t nk;
};

static struct value *kwarg(const struct args *a, const char *name)
{
    for (size_t i = 0; i < a->nk; i++) {
        if (strcmp(a->kn[i], name) == 0) {
            return &a->kv[i];
        }
    }
    return NULL;
}

/* Argument `i` (positional) or `name` (keyword), or NULL. */
static struct value *arg(const struct args *a, size_t i, const char *name)
{
    return i < a->n ? &a->pos[i] : name ? kwarg(a, name) : NULL;
}

static enum kr_status eval_args(struct ev *e, const struct node *nd, struct args *a, size_t skip_first)
{
    (void)skip_first;
    a->n = nd->n_kids;
    a->nk = nd->n_kw;
    a->pos = a_alloc(&e->arena, (a->n + 2) * sizeof(*a->pos));
    a->kv = a_alloc(&e->arena, (a->nk + 1) * sizeof(*a->kv));
    a->kn = (const char **)nd->knames;
    if (!a->pos || !a->kv) {
        return oom(e);
    }
    for (size_t i = 0; i < a->n; i++) {
        enum kr_status st = eval(e, nd->kids[i], &a->pos[i]);
        if (st != KR_OK) {
            return st;
        }
    }
    for (size_t i = 0; i < a->nk; i++) {
        enum kr_status st = eval(e, nd->kvals[i], &a->kv[i]);
        if (st != KR_OK) {
            return st;
        }
    }
    return KR_OK;
}

static enum kr_status need_str(struct ev *e, const struct value *v, const char *what)
{
    if (!v || v->t != V_STR) {
        return rt_err(e, "%s must be a string", what);
    }
    return KR_OK;
}

static enum kr_status call_macro(struct ev *e, const struct node *m, const struct args *a, struct value *out)
{
    struct scope sc = {.parent = e->root};
    enum kr_status st = KR_OK;
    if (a->n > m->n_kw) {
        return rt_err(e, "macro '%s' takes not more than %zu argument(s)", m->name, m->n_kw);
    }
    for (size_t i = 0; i < m->n_kw && st == KR_OK; i++) {
        struct value v;
        struct value *given = i < a->n ? &a->pos[i] : kwarg(a, m->knames[i]);
        if (given) {
            v = *given;
        } else if (m->kvals[i]) {
            st = eval(e, m->kvals[i], &v);
        } else {
            v = v_undef();
        }
        if (st == KR_OK && !dict_set_str(e, &sc.vars, m->knames[i], v)) {
            st = oom(e);
        }
    }
    if (st != KR_OK) {
        return st;
    }
    struct kr_buf_s buf = {0}, *saved = e->out;
    enum flow flow = FLOW_NORMAL;
    e->out = &buf;
    if (++e->depth > MAX_DEPTH) {
        st = rt_err(e, "macro calls nested too deeply");
    } else {
        st = exec_body(e, m->b, &sc, &flow);
    }
    e->depth--;
    e->out = saved;
    if (st == KR_OK) {
        *out = mk_str(e, buf.p ? buf.p : "", buf.len);
        st = out->t == V_STR ? KR_OK : oom(e);
    }
    kr_bs_free(&buf);
    return st;
}

static enum kr_status split_str(struct ev *e, const struct jstr *s, const struct value *sep, int64_t maxsplit,
                                bool right, struct value *out)
{
    struct value l = mk_list(e, V_LIST, 8);
    if (l.t == V_UNDEF) {
        return oom(e);
    }
    if (sep && sep->t == V_STR && sep->u.s->len == 0) {
        return rt_err(e, "empty separator");
    }
    struct list tmp = {0, 0, NULL};
    (void)tmp;
    if (!sep || sep->t == V_NONE) { /* whitespace split */
        size_t i = 0;
        int64_t done = 0;
        if (right) {
            /* collect words from the left, then merge from the left if maxsplit limits */
        }
        while (i < s->len) {
            size_t l1;
            while ((l1 = py_space_len(s->s, s->len, i)) > 0) {
                i += l1;
            }
            if (i >= s->len) {
                break;
            }
            size_t j = i;
            if (maxsplit >= 0 && done >= maxsplit && !right) {
                size_t end = py_rstrip_len(s->s, s->len);
                struct value w = mk_str(e, s->s + i, end - i);
                if (!list_push(e, l.u.l, w)) {
                    return oom(e);
                }
                break;
            }
            while (j < s->len && !py_space_len(s->s, s->len, j)) {
                uint32_t cp;
                j += kr_utf8_next(s->s + j, &cp);
            }
            struct value w = mk_str(e, s->s + i, j - i);
            if (w.t != V_STR || !list_push(e, l.u.l, w)) {
                return oom(e);
            }
            done++;
            i = j;
        }
        *out = l;
        return KR_OK;
    }
    const struct jstr *p = sep->u.s;
    if (right && maxsplit >= 0) {
        /* rsplit with a limit: split from the right */
        size_t end = s->len;
        int64_t done = 0;
        struct value parts = mk_list(e, V_LIST, 8);
        while (done < maxsplit) {
            const char *hit = memfind(s->s, end, p->s, p->len, true);
            if (!hit) {
                break;
            }
            size_t at = (size_t)(hit - s->s);
            if (!list_push(e, parts.u.l, mk_str(e, s->s + at + p->len, end - at - p->len))) {
                return oom(e);
            }
            end = at;
            done++;
        }
        if (!list_push(e, l.u.l, mk_str(e, s->s, end))) {
            return oom(e);
        }
        for (size_t k = parts.u.l->n; k-- > 0;) {
            if (!list_push(e, l.u.l, parts.u.l->v[k])) {
                return oom(e);
            }
        }
        *out = l;
        return KR_OK;
    }
    size_t i = 0;
    int64_t done = 0;
    for (;;) {
        const char *hit = maxsplit >= 0 && done >= maxsplit ? NULL : memfind(s->s + i, s->len - i, p->s, p->len, false);
        size_t end = hit ? (size_t)(hit - s->s) : s->len;
        struct value w = mk_str(e, s->s + i, end - i);
        if (w.t != V_STR || !list_push(e, l.u.l, w)) {
            return oom(e);
        }
        if (!hit) {
            break;
        }
        i = end + p->len;
        done++;
    }
    *out = l;
    return KR_OK;
}

static bool str_all(const struct jstr *s, int kind)
{
    if (s->len == 0) {
        return false;
    }
    bool any_cased = false;
    for (size_t i = 0; i < s->len;) {
        uint32_t cp;
        i += kr_utf8_next(s->s + i, &cp);
        bool ok = true;
        switch (kind) {
        case 0: ok = kr_uni_is_numeric(cp) && cp >= '0' && (cp <= '9' || cp > 0x7F); break;
        case 1: ok = kr_uni_is_alnum(cp) && !kr_uni_is_numeric(cp); break;
        case 2: ok = kr_uni_is_alnum(cp); break;
        case 3: ok = kr_uni_is_py_space(cp); break;
        case 4:
        case 5: {
            bool up = kr_uni_tolower(cp) != cp, low = kr_uni_toupper(cp) != cp;
            if (up || low) {
                any_cased = true;
            }
            ok = kind == 4 ? !low : !up;
            break;
        }
        }
        if (!ok) {
            return false;
        }
    }
    return kind >= 4 ? any_cased : true;
}

static enum kr_status call_func(struct ev *e, const struct func *f, const struct args *a, struct value *out)
{
    struct value self = f->self;
    struct value *x = arg(a, 0, NULL), *y = arg(a, 1, NULL);
    enum kr_status st;
    *out = v_none();
    switch (f->b) {
    case B_MACRO: return call_macro(e, f->macro, a, out);
    case B_RAISE:
        return kr_err_set(e->err, KR_ERR_INVAL, "chat template raised an exception: %s",
                          x && x->t == V_STR ? x->u.s->s : "(no message)");
    case B_STRFTIME: {
        if ((st = need_str(e, x, "strftime_now's format")) != KR_OK) {
            return st;
        }
        time_t now = time(NULL);
        struct tm tm;
        char buf[256];
        localtime_r(&now, &tm);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
        size_t n = strftime(buf, sizeof(buf), x->u.s->s, &tm); /* the template's own format */
#pragma GCC diagnostic pop
        *out = mk_str(e, buf, n);
        return KR_OK;
    }
    case B_RANGE: {
        int64_t lo = 0, hi, step = 1;
        if (a->n == 0 || a->n > 3) {
            return rt_err(e, "range expected 1 to 3 arguments");
        }
        for (size_t i = 0; i < a->n; i++) {
            if (a->pos[i].t != V_INT && a->pos[i].t != V_BOOL) {
                return rt_err(e, "range arguments must be integers");
            }
        }
        if (a->n == 1) {
            hi = inum(a->pos[0]);
        } else {
            lo = inum(a->pos[0]);
            hi = inum(a->pos[1]);
            if (a->n == 3) {
                step = inum(a->pos[2]);
            }
        }
        if (step == 0) {
            return rt_err(e, "range() arg 3 must not be zero");
        }
        int64_t count = step > 0 ? (hi > lo ? (hi - lo + step - 1) / step : 0) : (lo > hi ? (lo - hi - step - 1) / -step : 0);
        if (count > MAX_RANGE) {
            return rt_err(e, "range too big (more than %d items)", MAX_RANGE);
        }
        struct value l = mk_list(e, V_LIST, (size_t)count);
        if (l.t == V_UNDEF) {
            return oom(e);
        }
        for (int64_t i = 0; i < count; i++) {
            l.u.l->v[i] = v_int(lo + i * step);
        }
        l.u.l->n = (size_t)count;
        *out = l;
        return KR_OK;
    }
    case B_NAMESPACE:
    case B_DICT: {
        struct value d = mk_dict(e, f->b == B_NAMESPACE ? V_NS : V_DICT);
        if (d.t == V_UNDEF) {
            return oom(e);
        }
        if (x && (x->t == V_DICT || x->t == V_NS)) {
            for (size_t i = 0; i < x->u.d->n; i++) {
                if (!dict_set(e, d.u.d, x->u.d->k[i], x->u.d->v[i])) {
                    return oom(e);
                }
            }
        }
        for (size_t i = 0; i < a->nk; i++) {
            if (!dict_set_str(e, d.u.d, a->kn[i], a->kv[i])) {
                return oom(e);
            }
        }
        *out = d;
        return KR_OK;
    }
    case B_CYCLE:
        if (a->n == 0) {
            return rt_err(e, "no items for cycling given");
        }
        *out = a->pos[inum(self) % (int64_t)a->n];
        return KR_OK;
    case M_STRIP:
    case M_LSTRIP:
    case M_RSTRIP: {
        const struct jstr *chars = x && x->t == V_STR ? x->u.s : NULL;
        *out = py_strip(e, self.u.s, chars, f->b != M_RSTRIP, f->b != M_LSTRIP);
        return out->t == V_STR ? KR_OK : oom(e);
    }
    case M_SPLIT:
    case M_RSPLIT: {
        struct value *sep = arg(a, 0, "sep"), *mx = arg(a, 1, "maxsplit");
        return split_str(e, self.u.s, sep, mx ? inum(*mx) : -1, f->b == M_RSPLIT, out);
    }
    case M_STARTSWITH:
    case M_ENDSWITH: {
        struct list one = {1, 1, x};
        if (!x || (x->t != V_STR && x->t != V_TUPLE)) {
            return rt_err(e, "%s arg must be str or a tuple of str", f->name);
        }
        struct list *cands = x->t == V_TUPLE ? x->u.l : &one;
        bool r = false;
        for (size_t i = 0; i < cands->n && !r; i++) {
            const struct jstr *p = cands->v[i].t == V_STR ? cands->v[i].u.s : NULL;
            if (!p) {
                return rt_err(e, "%s arg must be str or a tuple of str", f->name);
            }
            r = p->len <= self.u.s->len &&
                memcmp(self.u.s->s + (f->b == M_STARTSWITH ? 0 : self.u.s->len - p->len), p->s, p->len) == 0;
        }
        *out = v_bool(r);
        return KR_OK;
    }
    case M_UPPER: *out = map_case(e, self.u.s, 1); return KR_OK;
    case M_LOWER: *out = map_case(e, self.u.s, 0); return KR_OK;
    case M_TITLE: *out = map_case(e, self.u.s, 2); return KR_OK;
    case M_CAPITALIZE: *out = map_case(e, self.u.s, 3); return KR_OK;
    case M_REPLACE:
        if ((st = need_str(e, x, "replace's old")) != KR_OK || (st = need_str(e, y, "replace's new")) != KR_OK) {
            return st;
        }
        *out = str_replace(e, self.u.s, x->u.s, y->u.s, a->n > 2 ? inum(a->pos[2]) : -1);
        return KR_OK;
    case M_FIND:
    case M_RFIND:
    case M_COUNT: {
        if ((st = need_str(e, x, f->name)) != KR_OK) {
            return st;
        }
        if (f->b == M_COUNT) {
            int64_t c = 0;
            if (x->u.s->len == 0) {
                c = (int64_t)u8_count(self.u.s->s, self.u.s->len) + 1;
            } else {
                for (size_t i = 0; i + x->u.s->len <= self.u.s->len;) {
                    if (memcmp(self.u.s->s + i, x->u.s->s, x->u.s->len) == 0) {
                        c++;
                        i += x->u.s->len;
                    } else {
                        i++;
                    }
                }
            }
            *out = v_int(c);
            return KR_OK;
        }
        const char *h = memfind(self.u.s->s, self.u.s->len, x->u.s->s, x->u.s->len, f->b == M_RFIND);
        *out = v_int(h ? (int64_t)u8_count(self.u.s->s, (size_t)(h - self.u.s->s)) : -1);
        return KR_OK;
    }
    case M_JOIN: {
        struct list *items;
        if (!x || (st = iter_list(e, *x, &items)) != KR_OK) {
            return x ? st : rt_err(e, "join() takes exactly one argument");
        }
        struct kr_buf_s b = {0};
        for (size_t i = 0; i < items->n; i++) {
            if (items->v[i].t != V_STR) {
                kr_bs_free(&b);
                return rt_err(e, "sequence item %zu: expected str instance, %s found", i, type_name(items->v[i]));
            }
            if (i) {
                kr_bs_append(&b, self.u.s->s, self.u.s->len);
            }
            kr_bs_append(&b, items->v[i].u.s->s, items->v[i].u.s->len);
        }
        *out = mk_str(e, b.p ? b.p : "", b.len);
        kr_bs_free(&b);
        return KR_OK;
    }
    case M_ISDIGIT: *out = v_bool(str_all(self.u.s, 0)); return KR_OK;
    case M_ISALPHA: *out = v_bool(str_all(self.u.s, 1)); return KR_OK;
    case M_ISALNUM: *out = v_bool(str_all(self.u.s, 2)); return KR_OK;
    case M_ISSPACE: *out = v_bool(str_all(self.u.s, 3)); return KR_OK;
    case M_ISUPPER: *out = v_bool(str_all(self.u.s, 4)); return KR_OK;
    case M_ISLOWER: *out = v_bool(str_all(self.u.s, 5)); return KR_OK;
    case M_ITEMS:
    case M_KEYS:
    case M_VALUES: {
        struct value l = mk_list(e, V_LIST, self.u.d->n);
        if (l.t == V_UNDEF) {
            return oom(e);
        }
        for (size_t i = 0; i < self.u.d->n; i++) {
            if (f->b == M_ITEMS) {
                struct value t = mk_list(e, V_TUPLE, 2);
                if (t.t == V_UNDEF) {
                    return oom(e);
                }
                t.u.l->v[0] = self.u.d->k[i];
                t.u.l->v[1] = self.u.d->v[i];
                t.u.l->n = 2;
                l.u.l->v[i] = t;
            } else {
                l.u.l->v[i] = f->b == M_KEYS ? self.u.d->k[i] : self.u.d->v[i];
            }
        }
        l.u.l->n = self.u.d->n;
        *out = l;
        return KR_OK;
    }
    case M_GET: {
        struct value *v = x ? dict_find(self.u.d, *x) : NULL;
        *out = v ? *v : y ? *y : v_none();
        return KR_OK;
    }
    case M_INDEX:
    case M_LCOUNT: {
        int64_t c = 0, first = -1;
        for (size_t i = 0; x && i < self.u.l->n; i++) {
            if (v_eq(self.u.l->v[i], *x)) {
                c++;
                first = first < 0 ? (int64_t)i : first;
            }
        }
        if (f->b == M_INDEX && first < 0) {
            return rt_err(e, "value is not in list");
        }
        *out = v_int(f->b == M_INDEX ? first : c);
        return KR_OK;
    }
    case M_UNSAFE:
        return rt_err(e, "access to attribute '%s' of '%s' object is unsafe", f->name, type_name(self));
    }
    return KR_ERR_INTERNAL;
}

/* ---- filters and tests ------------------------------------------------------------------------------------ */

static int cmp_for_sort(struct ev *e, struct value a, struct value b, bool ci)
{
    int c = 0;
    if (ci && a.t == V_STR && b.t == V_STR) {
        struct value la = map_case(e, a.u.s, 0), lb = map_case(e, b.u.s, 0);
        if (la.t == V_STR && lb.t == V_STR) {
            v_cmp(e, la, lb, &c);
            return c;
        }
    }
    v_cmp(e, a, b, &c);
    return c;
}

static enum kr_status apply_test(struct ev *e, const char *name, struct value v, const struct args *a, bool *res);

static enum kr_status attr_path(struct ev *e, struct value v, const struct jstr *path, struct value *out)
{
    *out = v;
    const char *s = path->s;
    while (*s) {
        const char *dot = strchr(s, '.');
        size_t n = dot ? (size_t)(dot - s) : strlen(s);
        char key[256];
        if (n >= sizeof(key)) {
            return rt_err(e, "attribute name too long");
        }
        memcpy(key, s, n);
        key[n] = '\0';
        struct value k = mk_str(e, key, n);
        bool digits = n > 0 && strspn(key, "0123456789") == n;
        enum kr_status st = get_item(e, *out, digits ? v_int(atoll(key)) : k, out);
        if (st != KR_OK) {
            return st;
        }
        s += n + (dot ? 1 : 0);
        if (!dot) {
            break;
        }
    }
    return KR_OK;
}

static enum kr_status apply_filter(struct ev *e, const char *name, struct value v, const struct args *a,
                                   struct value *out)
{
    struct value *x = arg(a, 0, NULL);
    enum kr_status st = KR_OK;
    struct list *items;
    *out = v_undef();
    if (strcmp(name, "trim") == 0 || strcmp(name, "string") == 0 || strcmp(name, "upper") == 0 ||
        strcmp(name, "lower") == 0 || strcmp(name, "title") == 0 || strcmp(name, "capitalize") == 0 ||
        strcmp(name, "safe") == 0) {
        struct value s = to_str(e, v);
        if (s.t != V_STR) {
            return oom(e);
        }
        switch (name[0]) {
        case 't':
            if (name[1] == 'r') {
                struct value *chars = arg(a, 0, "chars");
                *out = py_strip(e, s.u.s, chars && chars->t == V_STR ? chars->u.s : NULL, true, true);
            } else {
                *out = map_case(e, s.u.s, 2);
            }
            break;
        case 'u': *out = map_case(e, s.u.s, 1); break;
        case 'l': *out = map_case(e, s.u.s, 0); break;
        case 'c': *out = map_case(e, s.u.s, 3); break;
        default: *out = s; break;
        }
        return out->t == V_STR ? KR_OK : oom(e);
    }
    if (strcmp(name, "tojson") == 0) {
        struct json_opts o = {NULL, ", ", ": ", false};
        struct value *ind = arg(a, 1, "indent"), *sk = arg(a, 3, "sort_keys"), *sep = arg(a, 2, "separators");
        char spaces[64];
        if (ind && ind->t == V_INT) {
            int64_t k = ind->u.i < 0 ? 0 : ind->u.i > 60 ? 60 : ind->u.i;
            memset(spaces, ' ', (size_t)k);
            spaces[k] = '\0';
            o.indent = spaces;
        } else if (ind && ind->t == V_STR) {
            o.indent = ind->u.s->s;
        }
        if (o.indent) {
            o.item_sep = ",";
        }
        if (sep && (sep->t == V_TUPLE || sep->t == V_LIST) && sep->u.l->n == 2 && sep->u.l->v[0].t == V_STR &&
            sep->u.l->v[1].t == V_STR) {
            o.item_sep = sep->u.l->v[0].u.s->s;
            o.key_sep = sep->u.l->v[1].u.s->s;
        }
        o.sort_keys = sk && truthy(*sk);
        struct kr_buf_s b = {0};
        if ((st = to_json(e, v, &o, 0, &b)) == KR_OK) {
            *out = mk_str(e, b.p ? b.p : "", b.len);
        }
        kr_bs_free(&b);
        return st;
    }
    if (strcmp(name, "length") == 0 || strcmp(name, "count") == 0) {
        if (v.t == V_STR) {
            *out = v_int((int64_t)u8_count(v.u.s->s, v.u.s->len));
        } else if (v.t == V_LIST || v.t == V_TUPLE) {
            *out = v_int((int64_t)v.u.l->n);
        } else if (v.t == V_DICT || v.t == V_NS) {
            *out = v_int((int64_t)v.u.d->n);
        } else if (v.t == V_UNDEF) {
            *out = v_int(0);
        } else {
            return rt_err(e, "object of type '%s' has no len()", type_name(v));
        }
        return KR_OK;
    }
    if (strcmp(name, "default") == 0 || strcmp(name, "d") == 0) {
        struct value *bo = arg(a, 1, "boolean");
        bool use_default = v.t == V_UNDEF || (bo && truthy(*bo) && !truthy(v));
        struct value *dv = arg(a, 0, "default_value");
        *out = use_default ? (dv ? *dv : mk_str(e, "", 0)) : v;
        return KR_OK;
    }
    if (strcmp(name, "items") == 0) {
        if (v.t == V_UNDEF) {
            *out = mk_list(e, V_LIST, 1);
            return KR_OK;
        }
        if (v.t != V_DICT && v.t != V_NS) {
            return rt_err(e, "can only get item pairs from a mapping");
        }
        struct func f = {M_ITEMS, v, NULL, "items"};
        return call_func(e, &f, a, out);
    }
    if (strcmp(name, "e") == 0 || strcmp(name, "escape") == 0 || strcmp(name, "forceescape") == 0) {
        struct value s = to_str(e, v);
        struct kr_buf_s b = {0};
        for (size_t i = 0; s.t == V_STR && i < s.u.s->len; i++) {
            char c = s.u.s->s[i];
            const char *r = c == '&' ? "&amp;" : c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '"' ? "&#34;" : c == '\'' ? "&#39;" : NULL;
            if (r) {
                kr_bs_append(&b, r, strlen(r));
            } else {
                kr_bs_putc(&b, c);
            }
        }
        *out = mk_str(e, b.p ? b.p : "", b.len);
        kr_bs_free(&b);
        return KR_OK;
    }
    if (strcmp(name, "abs") == 0) {
        if (!is_num(v)) {
            return rt_err(e, "bad operand type for abs(): '%s'", type_name(v));
        }
        *out = v.t == V_FLOAT ? v_float(fabs(v.u.f)) : v_int(inum(v) < 0 ? -inum(v) : inum(v));
        return KR_OK;
    }
    if (strcmp(name, "int") == 0 || strcmp(name, "float") == 0) {
        bool to_int = name[0] == 'i';
        struct value *def = arg(a, 0, "default");
        double f = 0;
        bool ok = true;
        if (is_num(v)) {
            f = num(v);
            if (to_int && v.t != V_FLOAT) {
                *out = v_int(inum(v));
                return KR_OK;
            }
        } else if (v.t == V_STR) {
            char *end;
            f = strtod(v.u.s->s, &end);
            ok = end != v.u.s->s && *end == '\0';
        } else {
            ok = false;
        }
        if (!ok) {
            *out = def ? *def : to_int ? v_int(0) : v_float(0.0);
        } else {
            *out = to_int ? v_int((int64_t)f) : v_float(f);
        }
        return KR_OK;
    }
    if (strcmp(name, "round") == 0) {
        struct value *pr = arg(a, 0, "precision"), *me = arg(a, 1, "method");
        int64_t p = pr ? inum(*pr) : 0;
        double m = pow(10.0, (double)p), f = num(v);
        const char *method = me && me->t == V_STR ? me->u.s->s : "common";
        double r = strcmp(method, "floor") == 0 ? floor(f * m) / m : strcmp(method, "ceil") == 0 ? ceil(f * m) / m
                                                                                                  : round(f * m) / m;
        *out = v_float(r);
        return KR_OK;
    }
    if (strcmp(name, "indent") == 0) {
        struct value s = to_str(e, v);
        struct value *w = arg(a, 0, "width"), *first = arg(a, 1, "first"), *blank = arg(a, 2, "blank");
        char pad[128] = "    ";
        if (w && w->t == V_STR) {
            snprintf(pad, sizeof(pad), "%s", w->u.s->s);
        } else if (w) {
            int64_t k = inum(*w) < 0 ? 0 : inum(*w) > 120 ? 120 : inum(*w);
            memset(pad, ' ', (size_t)k);
            pad[k] = '\0';
        }
        struct kr_buf_s b = {0};
        size_t i = 0, line = 0;
        while (i <= s.u.s->len) {
            const char *nl = memchr(s.u.s->s + i, '\n', s.u.s->len - i);
            size_t end = nl ? (size_t)(nl - s.u.s->s) : s.u.s->len;
            bool empty = end == i;
            if ((line > 0 || (first && truthy(*first))) && (!empty || (blank && truthy(*blank)))) {
                kr_bs_append(&b, pad, strlen(pad));
            }
            kr_bs_append(&b, s.u.s->s + i, end - i);
            if (!nl) {
                break;
            }
            kr_bs_putc(&b, '\n');
            i = end + 1;
            line++;
        }
        *out = mk_str(e, b.p ? b.p : "", b.len);
        kr_bs_free(&b);
        return KR_OK;
    }
    if (strcmp(name, "replace") == 0) {
        struct value s = to_str(e, v), *y = arg(a, 1, NULL), *c = arg(a, 2, "count");
        if ((st = need_str(e, x, "replace's old")) != KR_OK || (st = need_str(e, y, "replace's new")) != KR_OK) {
            return st;
        }
        *out = str_replace(e, s.u.s, x->u.s, y->u.s, c && c->t != V_NONE ? inum(*c) : -1);
        return KR_OK;
    }
    if (strcmp(name, "wordcount") == 0) {
        struct value s = to_str(e, v), words;
        if ((st = split_str(e, s.u.s, NULL, -1, false, &words)) != KR_OK) {
            return st;
        }
        *out = v_int((int64_t)words.u.l->n);
        return KR_OK;
    }
    if (strcmp(name, "attr") == 0) {
        if ((st = need_str(e, x, "attr's name")) != KR_OK) {
            return st;
        }
        /* getattr() only: a dict's keys are not attributes */
        if ((st = get_attr(e, v, x->u.s->s, out)) == KR_OK && out->t != V_FUNC) {
            *out = v_undef();
        }
        return st;
    }
    /* the rest work on sequences */
    if ((st = iter_list(e, v, &items)) != KR_OK) {
        return st;
    }
    if (strcmp(name, "first") == 0 || strcmp(name, "last") == 0) {
        *out = items->n ? items->v[name[0] == 'f' ? 0 : items->n - 1] : v_undef();
        return KR_OK;
    }
    if (strcmp(name, "join") == 0) {
        struct value *attr = arg(a, 1, "attribute");
        struct kr_buf_s b = {0};
        for (size_t i = 0; i < items->n && st == KR_OK; i++) {
            struct value it = items->v[i];
            if (attr && attr->t == V_STR) {
                st = attr_path(e, it, attr->u.s, &it);
            }
            if (i && x && x->t == V_STR) {
                kr_bs_append(&b, x->u.s->s, x->u.s->len);
            }
            py_str(it, &b, false);
        }
        if (st == KR_OK) {
            *out = mk_str(e, b.p ? b.p : "", b.len);
        }
        kr_bs_free(&b);
        return st;
    }
    struct value l = mk_list(e, V_LIST, items->n + 1);
    if (l.t == V_UNDEF) {
        return oom(e);
    }
    if (strcmp(name, "list") == 0) {
        memcpy(l.u.l->v, items->v, items->n * sizeof(*items->v));
        l.u.l->n = items->n;
        *out = l;
        return KR_OK;
    }
    if (strcmp(name, "reverse") == 0) {
        if (v.t == V_STR) {
            struct kr_buf_s b = {0};
            for (size_t i = items->n; i-- > 0;) {
                kr_bs_append(&b, items->v[i].u.s->s, items->v[i].u.s->len);
            }
            *out = mk_str(e, b.p ? b.p : "", b.len);
            kr_bs_free(&b);
            return KR_OK;
        }
        for (size_t i = 0; i < items->n; i++) {
            l.u.l->v[i] = items->v[items->n - 1 - i];
        }
        l.u.l->n = items->n;
        *out = l;
        return KR_OK;
    }
    if (strcmp(name, "sum") == 0 || strcmp(name, "max") == 0 || strcmp(name, "min") == 0) {
        struct value *attr = arg(a, name[0] == 's' ? 0 : 1, "attribute");
        struct value acc = name[0] == 's' ? (arg(a, 1, "start") ? *arg(a, 1, "start") : v_int(0)) : v_undef();
        for (size_t i = 0; i < items->n && st == KR_OK; i++) {
            struct value it = items->v[i];
            if (attr && attr->t == V_STR) {
                st = attr_path(e, it, attr->u.s, &it);
            }
            if (st != KR_OK) {
                break;
            }
            if (name[0] == 's') {
                st = arith(e, OP_ADD, acc, it, &acc);
            } else if (acc.t == V_UNDEF || (name[1] == 'a' ? cmp_for_sort(e, it, acc, true) > 0 : cmp_for_sort(e, it, acc, true) < 0)) {
                acc = it;
            }
        }
        *out = acc;
        return st;
    }
    if (strcmp(name, "unique") == 0) {
        for (size_t i = 0; i < items->n; i++) {
            bool seen = false;
            for (size_t k = 0; k < l.u.l->n && !seen; k++) {
                seen = v_eq(l.u.l->v[k], items->v[i]);
            }
            if (!seen) {
                l.u.l->v[l.u.l->n++] = items->v[i];
            }
        }
        *out = l;
        return KR_OK;
    }
    if (strcmp(name, "sort") == 0 || strcmp(name, "dictsort") == 0) {
        bool dsort = name[0] == 'd';
        struct value *rev = arg(a, dsort ? 2 : 0, "reverse"), *cs = arg(a, dsort ? 0 : 1, "case_sensitive");
        struct value *attr = dsort ? NULL : arg(a, 2, "attribute"), *by = dsort ? arg(a, 1, "by") : NULL;
        if (dsort) {
            if (v.t != V_DICT) {
                return rt_err(e, "dictsort needs a mapping");
            }
            struct func f = {M_ITEMS, v, NULL, "items"};
            struct args none = {0};
            struct value its;
            if ((st = call_func(e, &f, &none, &its)) != KR_OK) {
                return st;
            }
            items = its.u.l;
        }
        memcpy(l.u.l->v, items->v, items->n * sizeof(*items->v));
        l.u.l->n = items->n;
        bool ci = !(cs && truthy(*cs)), desc = rev && truthy(*rev);
        int kidx = by && by->t == V_STR && strcmp(by->u.s->s, "value") == 0 ? 1 : 0;
        /* stable insertion sort (Python's sort is stable) */
        for (size_t i = 1; i < l.u.l->n; i++) {
            struct value cur_v = l.u.l->v[i];
            struct value ck = dsort ? cur_v.u.l->v[kidx] : cur_v;
            if (attr && attr->t == V_STR && (st = attr_path(e, cur_v, attr->u.s, &ck)) != KR_OK) {
                return st;
            }
            size_t j = i;
            while (j > 0) {
                struct value pk = dsort ? l.u.l->v[j - 1].u.l->v[kidx] : l.u.l->v[j - 1];
                if (attr && attr->t == V_STR && (st = attr_path(e, l.u.l->v[j - 1], attr->u.s, &pk)) != KR_OK) {
                    return st;
                }
                int c = cmp_for_sort(e, pk, ck, ci);
                if (desc ? c >= 0 : c <= 0) {
                    break;
                }
                l.u.l->v[j] = l.u.l->v[j - 1];
                j--;
            }
            l.u.l->v[j] = cur_v;
        }
        *out = l;
        return KR_OK;
    }
    bool sel = strcmp(name, "select") == 0 || strcmp(name, "selectattr") == 0;
    bool rej = strcmp(name, "reject") == 0 || strcmp(name, "rejectattr") == 0;
    if (sel || rej) {
        bool by_attr = strchr(name, 'a') && strstr(name, "attr");
        size_t ti = by_attr ? 1 : 0;
        struct value *test = arg(a, ti, NULL);
        struct args targs = {a->pos + ti + 1, a->n > ti + 1 ? a->n - ti - 1 : 0, NULL, NULL, 0};
        if (by_attr && (st = need_str(e, x, "the attribute name")) != KR_OK) {
            return st;
        }
        if (test && test->t != V_STR) {
            return rt_err(e, "%s: the test name must be a string", name);
        }
        for (size_t i = 0; i < items->n; i++) {
            struct value it = items->v[i];
            if (by_attr && (st = attr_path(e, it, x->u.s, &it)) != KR_OK) {
                return st;
            }
            bool r = truthy(it);
            if (test && (st = apply_test(e, test->u.s->s, it, &targs, &r)) != KR_OK) {
                return st;
            }
            if (r == sel) {
                l.u.l->v[l.u.l->n++] = items->v[i];
            }
        }
        *out = l;
        return KR_OK;
    }
    if (strcmp(name, "map") == 0) {
        struct value *attr = kwarg(a, "attribute"), *def = kwarg(a, "default");
        for (size_t i = 0; i < items->n; i++) {
            struct value it = items->v[i];
            if (attr && attr->t == V_STR) {
                st = attr_path(e, it, attr->u.s, &it);
                if (it.t == V_UNDEF && def) {
                    it = *def;
                }
            } else if (x && x->t == V_STR) {
                struct args fa = {a->pos + 1, a->n - 1, a->kn, a->kv, a->nk};
                if (!in_list(FILTERS, x->u.s->s)) {
                    return rt_err(e, "no filter named '%s'", x->u.s->s);
                }
                st = apply_filter(e, x->u.s->s, items->v[i], &fa, &it);
            } else {
                return rt_err(e, "map needs a filter name or attribute=");
            }
            if (st != KR_OK) {
                return st;
            }
            l.u.l->v[l.u.l->n++] = it;
        }
        *out = l;
        return KR_OK;
    }
    return rt_err(e, "filter '%s' is not implemented", name);
}

static enum kr_status apply_test(struct ev *e, const char *name, struct value v, const struct args *a, bool *res)
{
    struct value *x = arg(a, 0, NULL);
    int c;
    if (strcmp(name, "defined") == 0) { *res = v.t != V_UNDEF; return KR_OK; }
    if (strcmp(name, "undefined") == 0) { *res = v.t == V_UNDEF; return KR_OK; }
    if (strcmp(name, "none") == 0) { *res = v.t == V_NONE; return KR_OK; }
    if (strcmp(name, "boolean") == 0) { *res = v.t == V_BOOL; return KR_OK; }
    if (strcmp(name, "false") == 0) { *res = v.t == V_BOOL && !v.u.b; return KR_OK; }
    if (strcmp(name, "true") == 0) { *res = v.t == V_BOOL && v.u.b; return KR_OK; }
    if (strcmp(name, "integer") == 0) { *res = v.t == V_INT; return KR_OK; }
    if (strcmp(name, "float") == 0) { *res = v.t == V_FLOAT; return KR_OK; }
    if (strcmp(name, "number") == 0) { *res = is_num(v); return KR_OK; }
    if (strcmp(name, "string") == 0) { *res = v.t == V_STR; return KR_OK; }
    if (strcmp(name, "mapping") == 0) { *res = v.t == V_DICT; return KR_OK; }
    if (strcmp(name, "iterable") == 0) {
        *res = v.t == V_STR || v.t == V_LIST || v.t == V_TUPLE || v.t == V_DICT || v.t == V_UNDEF;
        return KR_OK;
    }
    if (strcmp(name, "sequence") == 0) {
        *res = v.t == V_STR || v.t == V_LIST || v.t == V_TUPLE || v.t == V_DICT || v.t == V_UNDEF;
        return KR_OK;
    }
    if (strcmp(name, "callable") == 0) { *res = v.t == V_FUNC; return KR_OK; }
    if (strcmp(name, "escaped") == 0) { *res = false; return KR_OK; }
    if (strcmp(name, "lower") == 0 || strcmp(name, "upper") == 0) {
        *res = v.t == V_STR && str_all(v.u.s, name[0] == 'l' ? 5 : 4);
        return KR_OK;
    }
    if (strcmp(name, "even") == 0 || strcmp(name, "odd") == 0 || strcmp(name, "divisibleby") == 0) {
        if (v.t != V_INT && v.t != V_BOOL) {
            return rt_err(e, "test '%s' needs an integer", name);
        }
        int64_t d = name[0] == 'd' ? (x ? inum(*x) : 0) : 2;
        if (d == 0) {
            return rt_err(e, "integer division or modulo by zero");
        }
        int64_t m = ((inum(v) % d) + d) % d;
        *res = name[0] == 'o' ? m == 1 : m == 0;
        return KR_OK;
    }
    if (!x) {
        return rt_err(e, "test '%s' needs an argument", name);
    }
    if (strcmp(name, "sameas") == 0) {
        *res = v.t == x->t && (v.t == V_NONE || v.t == V_UNDEF || (v.t == V_BOOL && v.u.b == x->u.b) || v_eq(v, *x));
        return KR_OK;
    }
    if (strcmp(name, "in") == 0) {
        return contains(e, *x, v, res);
    }
    if (strcmp(name, "eq") == 0 || strcmp(name, "equalto") == 0 || strcmp(name, "==") == 0) {
        *res = v_eq(v, *x);
        return KR_OK;
    }
    if (strcmp(name, "ne") == 0 || strcmp(name, "!=") == 0) {
        *res = !v_eq(v, *x);
        return KR_OK;
    }
    if (!v_cmp(e, v, *x, &c)) {
        return KR_ERR_INVAL;
    }
    if (strcmp(name, "lt") == 0 || strcmp(name, "lessthan") == 0 || strcmp(name, "<") == 0) {
        *res = c < 0;
    } else if (strcmp(name, "le") == 0 || strcmp(name, "<=") == 0) {
        *res = c <= 0;
    } else if (strcmp(name, "gt") == 0 || strcmp(name, "greaterthan") == 0 || strcmp(name, ">") == 0) {
        *res = c > 0;
    } else {
        *res = c >= 0;
    }
    return KR_OK;
}

/* ---- expressions ---------------------------------------------------------------------------------------- */

static enum kr_status eval(struct ev *e, const struct node *nd, struct value *out)
{
    enum kr_status st = KR_OK;
    struct value a, b;
    if (++e->steps > MAX_STEPS) {
        return rt_err(e, "template execution exceeded %ld steps", MAX_STEPS);
    }
    if (nd == e->inject_node) {
        *out = e->inject_val;
        return KR_OK;
    }
    e->line = nd->line;
    switch (nd->k) {
    case E_CONST:
        *out = nd->v;
        return KR_OK;
    case E_NAME: {
        struct value *v = scope_lookup(e->scope, nd->name);
        if (v) {
            *out = *v;
            return KR_OK;
        }
        for (size_t i = 0; i < sizeof(GLOBALS) / sizeof(GLOBALS[0]); i++) {
            if (strcmp(GLOBALS[i].name, nd->name) == 0) {
                *out = mk_func(e, GLOBALS[i].b, v_none(), GLOBALS[i].name);
                return out->t == V_FUNC ? KR_OK : oom(e);
            }
        }
        *out = v_undef();
        return KR_OK;
    }
    case E_LIST:
    case E_TUPLE: {
        struct value l = mk_list(e, nd->k == E_LIST ? V_LIST : V_TUPLE, nd->n_kids);
        if (l.t == V_UNDEF) {
            return oom(e);
        }
        for (size_t i = 0; i < nd->n_kids; i++) {
            if ((st = eval(e, nd->kids[i], &l.u.l->v[i])) != KR_OK) {
                return st;
            }
        }
        l.u.l->n = nd->n_kids;
        *out = l;
        return KR_OK;
    }
    case E_DICT: {
        struct value d = mk_dict(e, V_DICT);
        if (d.t == V_UNDEF) {
            return oom(e);
        }
        for (size_t i = 0; i < nd->n_kids; i++) {
            if ((st = eval(e, nd->kids[i], &a)) != KR_OK || (st = eval(e, nd->kvals[i], &b)) != KR_OK) {
                return st;
            }
            if (!dict_set(e, d.u.d, a, b)) {
                return oom(e);
            }
        }
        *out = d;
        return KR_OK;
    }
    case E_ATTR:
        if ((st = eval(e, nd->a, &a)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        return get_attr(e, a, nd->name, out);
    case E_ITEM:
        if ((st = eval(e, nd->a, &a)) != KR_OK || (st = eval(e, nd->b, &b)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        return get_item(e, a, b, out);
    case E_SLICE: {
        struct value lo = v_none(), hi = v_none(), step = v_none();
        if ((st = eval(e, nd->a, &a)) != KR_OK || (nd->b && (st = eval(e, nd->b, &lo)) != KR_OK) ||
            (nd->c && (st = eval(e, nd->c, &hi)) != KR_OK) || (nd->kids[0] && (st = eval(e, nd->kids[0], &step)) != KR_OK)) {
            return st;
        }
        e->line = nd->line;
        return slice(e, a, lo, hi, step, out);
    }
    case E_CALL: {
        struct args args;
        if ((st = eval(e, nd->a, &a)) != KR_OK || (st = eval_args(e, nd, &args, 0)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        if (a.t != V_FUNC) {
            return rt_err(e, a.t == V_UNDEF ? "called an undefined value" : "'%s' object is not callable", type_name(a));
        }
        return call_func(e, a.u.fn, &args, out);
    }
    case E_FILTER: {
        struct args args;
        if ((st = eval(e, nd->a, &a)) != KR_OK || (st = eval_args(e, nd, &args, 0)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        return apply_filter(e, nd->name, a, &args, out);
    }
    case E_TEST: {
        struct args args;
        bool r;
        if ((st = eval(e, nd->a, &a)) != KR_OK || (st = eval_args(e, nd, &args, 0)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        if ((st = apply_test(e, nd->name, a, &args, &r)) != KR_OK) {
            return st;
        }
        *out = v_bool(nd->op ? !r : r);
        return KR_OK;
    }
    case E_NOT:
        if ((st = eval(e, nd->a, &a)) != KR_OK) {
            return st;
        }
        *out = v_bool(!truthy(a));
        return KR_OK;
    case E_NEG:
    case E_POS:
        if ((st = eval(e, nd->a, &a)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        if (!is_num(a)) {
            return rt_err(e, "bad operand type for unary %c: '%s'", nd->k == E_NEG ? '-' : '+', type_name(a));
        }
        *out = nd->k == E_POS ? (a.t == V_BOOL ? v_int(inum(a)) : a)
                              : a.t == V_FLOAT ? v_float(-a.u.f) : v_int(-inum(a));
        return KR_OK;
    case E_AND:
    case E_OR:
        if ((st = eval(e, nd->a, &a)) != KR_OK) {
            return st;
        }
        if (truthy(a) == (nd->k == E_OR)) {
            *out = a;
            return KR_OK;
        }
        return eval(e, nd->b, out);
    case E_BIN:
        if ((st = eval(e, nd->a, &a)) != KR_OK || (st = eval(e, nd->b, &b)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        if (nd->op == OP_CAT) {
            struct kr_buf_s s = {0};
            py_str(a, &s, false);
            py_str(b, &s, false);
            *out = mk_str(e, s.p ? s.p : "", s.len);
            kr_bs_free(&s);
            return out->t == V_STR ? KR_OK : oom(e);
        }
        return arith(e, nd->op, a, b, out);
    case E_CMP: {
        if ((st = eval(e, nd->a, &a)) != KR_OK) {
            return st;
        }
        bool r = true;
        for (size_t i = 0; i < nd->n_kids && r; i++) {
            if ((st = eval(e, nd->kids[i], &b)) != KR_OK) {
                return st;
            }
            e->line = nd->line;
            if ((st = compare(e, nd->ops[i], a, b, &r)) != KR_OK) {
                return st;
            }
            a = b;
        }
        *out = v_bool(r);
        return KR_OK;
    }
    case E_COND:
        if ((st = eval(e, nd->a, &a)) != KR_OK) {
            return st;
        }
        if (truthy(a)) {
            return eval(e, nd->b, out);
        }
        if (nd->c) {
            return eval(e, nd->c, out);
        }
        *out = v_undef();
        return KR_OK;
    default:
        return rt_err(e, "internal error: statement node in an expression");
    }
}

/* ---- statements ------------------------------------------------------------------------------------------ */

static enum kr_status assign(struct ev *e, struct scope *sc, const struct node *target, struct value v)
{
    if (target->k == E_NAME) {
        return dict_set_str(e, &sc->vars, target->name, v) ? KR_OK : oom(e);
    }
    if (target->k == E_ATTR) {
        struct value *ns = scope_lookup(sc, target->a->name);
        if (!ns || ns->t != V_NS) {
            return rt_err(e, "cannot assign attribute on non-namespace object");
        }
        return dict_set_str(e, ns->u.d, target->name, v) ? KR_OK : oom(e);
    }
    /* tuple unpacking */
    struct list *items;
    enum kr_status st = iter_list(e, v, &items);
    if (st != KR_OK) {
        return st;
    }
    if (items->n != target->n_kids) {
        return rt_err(e, "cannot unpack %zu values into %zu names", items->n, target->n_kids);
    }
    for (size_t i = 0; i < items->n && st == KR_OK; i++) {
        st = assign(e, sc, target->kids[i], items->v[i]);
    }
    return st;
}

static enum kr_status emit(struct ev *e, struct value v)
{
    size_t before = e->out->len;
    py_str(v, e->out, false);
    if (e->out->len + e->arena.total > MAX_BYTES) {
        return rt_err(e, "rendered text exceeds %u MiB", MAX_BYTES >> 20);
    }
    return e->out->p || before == e->out->len ? KR_OK : oom(e);
}

static enum kr_status exec_node(struct ev *e, const struct node *nd, struct scope *sc, enum flow *flow)
{
    enum kr_status st = KR_OK;
    struct value v;
    struct scope *saved = e->scope;
    if (++e->steps > MAX_STEPS) {
        return rt_err(e, "template execution exceeded %ld steps", MAX_STEPS);
    }
    e->scope = sc;
    e->line = nd->line;
    switch (nd->k) {
    case N_BODY:
        st = exec_body(e, nd, sc, flow);
        break;
    case N_TEXT:
        st = kr_bs_append(e->out, nd->v.u.s->s, nd->v.u.s->len) == KR_OK ? KR_OK : oom(e);
        break;
    case N_OUTPUT:
        if ((st = eval(e, nd->a, &v)) == KR_OK) {
            st = emit(e, v);
        }
        break;
    case N_IF:
        for (const struct node *c = nd; c; c = c->c) {
            if (c->k != N_IF) {
                st = exec_body(e, c, sc, flow);
                break;
            }
            if ((st = eval(e, c->a, &v)) != KR_OK) {
                break;
            }
            if (truthy(v)) {
                st = exec_body(e, c->b, sc, flow);
                break;
            }
        }
        break;
    case N_FOR: {
        struct list *items;
        struct value seq;
        if ((st = eval(e, nd->b, &seq)) != KR_OK || (st = iter_list(e, seq, &items)) != KR_OK) {
            break;
        }
        struct scope inner = {.parent = sc};
        /* the `if` filter picks the items first: loop.length and loop.last count only those */
        struct value kept = mk_list(e, V_LIST, items->n + 1);
        if (kept.t == V_UNDEF) {
            st = oom(e);
            break;
        }
        for (size_t i = 0; i < items->n && st == KR_OK; i++) {
            if (nd->c) {
                e->scope = &inner;
                if ((st = assign(e, &inner, nd->a, items->v[i])) != KR_OK || (st = eval(e, nd->c, &v)) != KR_OK) {
                    break;
                }
                if (!truthy(v)) {
                    continue;
                }
            }
            kept.u.l->v[kept.u.l->n++] = items->v[i];
        }
        size_t n = kept.u.l->n;
        for (size_t i = 0; i < n && st == KR_OK; i++) {
            struct value loop = mk_dict(e, V_DICT);
            if (loop.t == V_UNDEF) {
                st = oom(e);
                break;
            }
            struct dict *d = loop.u.d;
            bool ok = dict_set_str(e, d, "index", v_int((int64_t)i + 1)) && dict_set_str(e, d, "index0", v_int((int64_t)i)) &&
                      dict_set_str(e, d, "revindex", v_int((int64_t)(n - i))) &&
                      dict_set_str(e, d, "revindex0", v_int((int64_t)(n - i - 1))) &&
                      dict_set_str(e, d, "first", v_bool(i == 0)) && dict_set_str(e, d, "last", v_bool(i + 1 == n)) &&
                      dict_set_str(e, d, "length", v_int((int64_t)n)) && dict_set_str(e, d, "depth", v_int(1)) &&
                      dict_set_str(e, d, "depth0", v_int(0)) &&
                      dict_set_str(e, d, "previtem", i > 0 ? kept.u.l->v[i - 1] : v_undef()) &&
                      dict_set_str(e, d, "nextitem", i + 1 < n ? kept.u.l->v[i + 1] : v_undef()) &&
                      dict_set_str(e, d, "cycle", mk_func(e, B_CYCLE, v_int((int64_t)i), "cycle"));
            if (!ok) {
                st = oom(e);
                break;
            }
            /* jinja gives each iteration fresh locals: assignments in the body do not carry over */
            inner.vars.n = 0;
            if (!dict_set_str(e, &inner.vars, "loop", loop)) {
                st = oom(e);
                break;
            }
            if ((st = assign(e, &inner, nd->a, kept.u.l->v[i])) != KR_OK) {
                break;
            }
            enum flow f = FLOW_NORMAL;
            st = exec_body(e, nd->kids[0], &inner, &f);
            if (f == FLOW_BREAK) {
                break;
            }
        }
        if (st == KR_OK && n == 0 && nd->kids[1]) {
            st = exec_body(e, nd->kids[1], sc, flow);
        }
        break;
    }
    case N_SET:
        if ((st = eval(e, nd->b, &v)) == KR_OK) {
            st = assign(e, sc, nd->a, v);
        }
        break;
    case N_SET_BLOCK:
    case N_FILTER_BLOCK: {
        struct kr_buf_s buf = {0}, *out = e->out;
        e->out = &buf;
        st = exec_body(e, nd->b, sc, flow);
        e->out = out;
        if (st == KR_OK) {
            v = mk_str(e, buf.p ? buf.p : "", buf.len);
            if (nd->c) { /* filters applied to the captured text */
                const struct node *saved_inj = e->inject_node;
                struct value saved_val = e->inject_val;
                e->inject_node = (const struct node *)nd->name;
                e->inject_val = v;
                st = eval(e, nd->c, &v);
                e->inject_node = saved_inj;
                e->inject_val = saved_val;
            }
        }
        kr_bs_free(&buf);
        if (st == KR_OK) {
            st = nd->k == N_SET_BLOCK ? assign(e, sc, nd->a, v) : emit(e, v);
        }
        break;
    }
    case N_MACRO: {
        struct value f = mk_func(e, B_MACRO, v_none(), nd->name);
        if (f.t == V_UNDEF) {
            st = oom(e);
            break;
        }
        f.u.fn->macro = nd;
        st = dict_set_str(e, &sc->vars, nd->name, f) ? KR_OK : oom(e);
        break;
    }
    case N_WITH: {
        struct scope inner = {.parent = sc};
        for (size_t i = 0; i < nd->n_kw && st == KR_OK; i++) {
            e->scope = sc;
            if ((st = eval(e, nd->kvals[i], &v)) == KR_OK && !dict_set_str(e, &inner.vars, nd->knames[i], v)) {
                st = oom(e);
            }
        }
        if (st == KR_OK) {
            st = exec_body(e, nd->b, &inner, flow);
        }
        break;
    }
    case N_BREAK:
        *flow = FLOW_BREAK;
        break;
    case N_CONTINUE:
        *flow = FLOW_CONTINUE;
        break;
    default:
        st = rt_err(e, "internal error: expression node as a statement");
    }
    e->scope = saved;
    return st;
}

static enum kr_status exec_body(struct ev *e, const struct node *body, struct scope *sc, enum flow *flow)
{
    if (!body) {
        return KR_OK;
    }
    if (body->k != N_BODY) {
        return exec_node(e, body, sc, flow);
    }
    if (++e->depth > MAX_DEPTH) {
        e->depth--;
        return rt_err(e, "blocks nested too deeply");
    }
    enum kr_status st = KR_OK;
    for (size_t i = 0; i < body->n_kids && st == KR_OK && *flow == FLOW_NORMAL; i++) {
        st = exec_node(e, body->kids[i], sc, flow);
    }
    e->depth--;
    return st;
}

enum kr_status kr_chat_template_render(const struct kr_chat_template *tpl, const struct kr_chat_params *params,
                                       char **out, size_t *out_len, struct kr_err *err)
{
    struct ev e = {.err = err};
    struct kr_buf_s buf = {0};
    struct scope root = {0};
    enum kr_status st = KR_OK;
    *out = NULL;
    *out_len = 0;
    e.root = e.scope = &root;
    e.out = &buf;
    struct value msgs = params->messages ? from_json(&e, params->messages) : mk_list(&e, V_LIST, 1);
    struct value tools = params->tools ? from_json(&e, params->tools) : v_none();
    if (msgs.t == V_UNDEF || (params->tools && tools.t == V_UNDEF)) {
        st = oom(&e);
        goto done;
    }
    /* transformers passes messages, tools, documents and add_generation_prompt, then the special
     * tokens and any extra keyword arguments */
    if (!dict_set_str(&e, &root.vars, "messages", msgs) || !dict_set_str(&e, &root.vars, "tools", tools) ||
        !dict_set_str(&e, &root.vars, "documents", v_none()) ||
        !dict_set_str(&e, &root.vars, "add_generation_prompt", v_bool(params->add_generation_prompt)) ||
        (params->bos_token && !dict_set_str(&e, &root.vars, "bos_token", mk_str(&e, params->bos_token, strlen(params->bos_token)))) ||
        (params->eos_token && !dict_set_str(&e, &root.vars, "eos_token", mk_str(&e, params->eos_token, strlen(params->eos_token))))) {
        st = oom(&e);
        goto done;
    }
    if (params->extra && json_is_object(params->extra)) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)params->extra, k, v) {
            struct value x = from_json(&e, v);
            if (x.t == V_UNDEF || !dict_set_str(&e, &root.vars, k, x)) {
                st = oom(&e);
                goto done;
            }
        }
    }
    enum flow flow = FLOW_NORMAL;
    if ((st = kr_bs_reserve(&buf, 0)) != KR_OK || (st = exec_body(&e, tpl->body, &root, &flow)) != KR_OK) {
        goto done;
    }
    *out = buf.p;
    *out_len = buf.len;
    buf.p = NULL;
done:
    if (st == KR_ERR_NOMEM && err && !err->msg[0]) {
        kr_err_set(err, st, "chat template: out of memory");
    }
    kr_bs_free(&buf);
    a_free(&e.arena);
    return st;
}
