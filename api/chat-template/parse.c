/* The chat-template parser, after jinja2/parser.py: tokens to the AST (expressions by precedence,
 * statements and their bodies), with every filter and test checked against the supported set;
 * kr_chat_template_compile() and kr_chat_template_free(). */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"

#include <string.h>

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
    struct node *nd = ct_a_alloc(p->arena, sizeof(*nd));
    if (nd) {
        memset(nd, 0, sizeof(*nd));
        nd->k = k;
        nd->line = cur(p)->line;
    }
    return nd;
}

static char *tok_str(struct parser *p, const struct token *t)
{
    char *s = ct_a_alloc(p->arena, t->len + 1);
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
    *out = ct_a_alloc(p->arena, (a->n + 1) * sizeof(**out));
    if (names) {
        *names = ct_a_alloc(p->arena, (a->n + 1) * sizeof(**names));
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
        return ct_syntax_err(p->err, cur(p)->line, "expected '%s', got %s", op, tok_desc(cur(p)));
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
            st = ct_syntax_err(p->err, cur(p)->line, "*args / **kwargs in calls are not supported");
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
            st = ct_syntax_err(p->err, cur(p)->line, "positional argument after keyword argument");
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

const char *const ct_FILTERS[] = {
    "abs", "attr", "capitalize", "count", "d", "default", "dictsort", "e", "escape", "first", "float",
    "forceescape", "indent", "int", "items", "join", "last", "length", "list", "lower", "map", "max", "min",
    "reject", "rejectattr", "replace", "reverse", "round", "safe", "select", "selectattr", "sort", "string",
    "sum", "title", "tojson", "trim", "unique", "upper", "wordcount", NULL};
static const char *const TESTS[] = {
    "defined", "undefined", "none", "boolean", "false", "true", "integer", "float", "number", "string", "mapping",
    "iterable", "sequence", "callable", "even", "odd", "divisibleby", "eq", "equalto", "==", "ne", "!=", "lt",
    "lessthan", "<", "le", "<=", "gt", "greaterthan", ">", "ge", ">=", "in", "sameas", "lower", "upper",
    "escaped", NULL};

bool ct_in_list(const char *const *list, const char *s)
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
                return ct_syntax_err(p->err, cur(p)->line, "expected a filter name after '|'");
            }
            struct node *f = new_node(p, E_FILTER);
            if (!f || !(f->name = tok_str(p, cur(p)))) {
                return KR_ERR_NOMEM;
            }
            p->pos++;
            if (!ct_in_list(ct_FILTERS, f->name)) {
                return ct_syntax_err(p->err, f->line, "no filter named '%s' (not supported)", f->name);
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
                return ct_syntax_err(p->err, cur(p)->line, "expected a test name after 'is'");
            }
            if (!(t->name = tok_str(p, cur(p)))) {
                return KR_ERR_NOMEM;
            }
            p->pos++;
            if (!ct_in_list(TESTS, t->name)) {
                return ct_syntax_err(p->err, t->line, "no test named '%s' (not supported)", t->name);
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
                    return ct_syntax_err(p->err, c->line, "you cannot chain multiple tests with is");
                }
                struct node *arg;
                if ((st = parse_primary(p, &arg)) != KR_OK || (st = parse_postfix(p, &arg)) != KR_OK) {
                    return st;
                }
                t->kids = ct_a_alloc(p->arena, sizeof(*t->kids));
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
                return ct_syntax_err(p->err, cur(p)->line, "expected a name after '.'");
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
                return ct_syntax_err(p->err, g->line, "expected an index inside '[]'");
            }
            g->a = *nd;
            g->b = parts[0];
            g->c = parts[1];
            if (slice) {
                g->kids = ct_a_alloc(p->arena, sizeof(*g->kids));
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
        return ct_syntax_err(p->err, t->line, "expression nested too deeply");
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
        struct jstr *s = nd && st == KR_OK ? ct_a_alloc(p->arena, sizeof(*s) + b.len + 1) : NULL;
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
        st = ct_syntax_err(p->err, t->line, "unexpected %s%s%.*s%s", tok_desc(t), t->t == T_OP ? " '" : "",
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
            return ct_syntax_err(p->err, t->line, "too many chained comparisons");
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
    if (!cmp || !(cmp->ops = ct_a_alloc(p->arena, n * sizeof(int))) || !(cmp->kids = ct_a_alloc(p->arena, n * sizeof(*cmp->kids)))) {
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
            return ct_syntax_err(p->err, nd->line, "expression nested too deeply");
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
        return ct_syntax_err(p->err, cur(p)->line, "expression nested too deeply");
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
                st = ct_syntax_err(p->err, cur(p)->line, "expected a name, got %s", tok_desc(cur(p)));
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
                    st = g ? ct_syntax_err(p->err, cur(p)->line, "expected an attribute name") : KR_ERR_NOMEM;
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
        return ct_syntax_err(p->err, cur(p)->line, "expected end of statement '%%}', got %s", tok_desc(cur(p)));
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
        return ct_syntax_err(p->err, cur(p)->line, "unexpected end of template, expected '%s'", ends[0]);
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
        return ct_syntax_err(p->err, t->line, "expected a statement name, got %s", tok_desc(t));
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
            return ct_syntax_err(p->err, cur(p)->line, "expected 'in' in a for loop");
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
            return ct_syntax_err(p->err, line, "recursive for loops are not supported");
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
        nd->kids = ct_a_alloc(p->arena, 2 * sizeof(*nd->kids));
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
            return cur(p)->t != T_NAME ? ct_syntax_err(p->err, line, "expected a macro name") : KR_ERR_NOMEM;
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
                st = ct_syntax_err(p->err, cur(p)->line, "expected a parameter name");
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
                st = ct_syntax_err(p->err, cur(p)->line, "expected a name in 'with'");
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
            return fn && cur(p)->t != T_NAME ? ct_syntax_err(p->err, line, "expected a filter name") : KR_ERR_NOMEM;
        }
        if (!ct_in_list(ct_FILTERS, fn->name)) {
            return ct_syntax_err(p->err, line, "no filter named '%s' (not supported)", fn->name);
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
    return ct_syntax_err(p->err, line, "unsupported tag '%.*s'", (int)t->len, t->s);
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
        return ct_syntax_err(p->err, cur(p)->line, "blocks nested too deeply");
    }
    for (;;) {
        struct token *t = cur(p);
        struct node *nd = NULL;
        if (t->t == T_EOF) {
            if (ends) {
                st = ct_syntax_err(p->err, t->line, "unexpected end of template, expected '%s'", ends[0]);
            }
            break;
        }
        if (t->t == T_DATA) {
            nd = new_node(p, N_TEXT);
            struct jstr *s = nd ? ct_a_alloc(p->arena, sizeof(*s) + t->len + 1) : NULL;
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
                st = ct_syntax_err(p->err, cur(p)->line, "expected end of print statement '}}', got %s", tok_desc(cur(p)));
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
                st = ct_syntax_err(p->err, nt->line, "unexpected '%.*s'%s%s", (int)nt->len, nt->s,
                                   ends ? ", expected " : "", ends ? ends[0] : "");
                break;
            }
            p->pos++;
            if ((st = parse_statement(p, &nd)) != KR_OK) {
                break;
            }
        } else {
            st = ct_syntax_err(p->err, t->line, "unexpected %s", tok_desc(t));
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
    ct_a_free(&tpl->arena);
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
    char *kept = ct_a_alloc(&tpl->arena, src.len + 1);
    st = KR_ERR_NOMEM;
    if (!kept) {
        goto fail;
    }
    memcpy(kept, src.p, src.len + 1);
    lx.arena = &tpl->arena;
    lx.src = kept;
    lx.n = src.len;
    if ((st = ct_lex(&lx)) != KR_OK) {
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
