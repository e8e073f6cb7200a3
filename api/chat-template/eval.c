/* The chat-template evaluator: scopes and lookups (globals, methods, attributes, items, slices),
 * iteration, operators with Python's semantics, expressions, statements, and
 * kr_chat_template_render(). */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include <math.h>
#include <string.h>

/* ---- scopes and lookups ---------------------------------------------------------------------------------- */

static struct value *scope_lookup(struct scope *s, const char *name)
{
    for (; s; s = s->parent) {
        struct value *v = ct_dict_find_str(&s->vars, name);
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
enum kr_status ct_get_attr(struct ev *e, struct value obj, const char *name, struct value *out)
{
    int on = obj.t == V_STR ? 1 : obj.t == V_DICT ? 2 : (obj.t == V_LIST || obj.t == V_TUPLE) ? 3 : 0;
    if (obj.t == V_UNDEF) {
        return ct_rt_err(e, "'%s' is undefined (attribute '%s' of an undefined value)", "value", name);
    }
    for (size_t i = 0; on && i < sizeof(METHODS) / sizeof(METHODS[0]); i++) {
        if (METHODS[i].on == on && strcmp(METHODS[i].name, name) == 0) {
            *out = ct_mk_func(e, METHODS[i].b, obj, METHODS[i].name);
            return out->t == V_FUNC ? KR_OK : ct_oom(e);
        }
    }
    if (obj.t == V_DICT || obj.t == V_NS) {
        struct value *v = ct_dict_find_str(obj.u.d, name);
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
enum kr_status ct_get_item(struct ev *e, struct value obj, struct value key, struct value *out)
{
    *out = v_undef();
    if (obj.t == V_UNDEF) {
        return ct_rt_err(e, "cannot index an undefined value");
    }
    if ((obj.t == V_LIST || obj.t == V_TUPLE) && (key.t == V_INT || key.t == V_BOOL)) {
        size_t k;
        if (py_index(ct_inum(key), obj.u.l->n, &k)) {
            *out = obj.u.l->v[k];
        }
        return KR_OK;
    }
    if (obj.t == V_STR && (key.t == V_INT || key.t == V_BOOL)) {
        size_t k;
        if (!ct_charge(e, ct_bytes_steps(obj.u.s->len))) {
            return e->fault;
        }
        if (py_index(ct_inum(key), ct_u8_count(obj.u.s->s, obj.u.s->len), &k)) {
            size_t a = ct_u8_offset(obj.u.s->s, obj.u.s->len, k), b = ct_u8_offset(obj.u.s->s, obj.u.s->len, k + 1);
            *out = ct_mk_str(e, obj.u.s->s + a, b - a);
        }
        return KR_OK;
    }
    if (obj.t == V_DICT || obj.t == V_NS) {
        struct value *v = ct_dict_find(obj.u.d, key);
        if (v) {
            *out = *v;
            return KR_OK;
        }
    }
    if (key.t == V_STR) {
        return ct_get_attr(e, obj, key.u.s->s, out);
    }
    return KR_OK;
}

static enum kr_status slice(struct ev *e, struct value obj, struct value va, struct value vb, struct value vc,
                            struct value *out)
{
    int64_t step = vc.t == V_NONE || vc.t == V_UNDEF ? 1 : ct_inum(vc);
    if (step == 0) {
        return ct_rt_err(e, "slice step cannot be zero");
    }
    if (step < -INT64_MAX) {
        step = -INT64_MAX; /* as good as any for a slice, and it can be negated */
    }
    bool is_str = obj.t == V_STR;
    if (!is_str && obj.t != V_LIST && obj.t != V_TUPLE) {
        return ct_rt_err(e, "'%s' object is not subscriptable", ct_type_name(obj));
    }
    int64_t n = is_str ? (int64_t)ct_u8_count(obj.u.s->s, obj.u.s->len) : (int64_t)obj.u.l->n;
    int64_t lo, hi;
    bool has_a = va.t != V_NONE && va.t != V_UNDEF, has_b = vb.t != V_NONE && vb.t != V_UNDEF;
    if ((has_a && !(va.t == V_INT || va.t == V_BOOL)) || (has_b && !(vb.t == V_INT || vb.t == V_BOOL))) {
        return ct_rt_err(e, "slice indices must be integers or None");
    }
    if (step > 0) {
        lo = has_a ? ct_inum(va) : 0;
        hi = has_b ? ct_inum(vb) : n;
        if (lo < 0) {
            lo = lo + n < 0 ? 0 : lo + n;
        }
        if (hi < 0) {
            hi = hi + n < 0 ? 0 : hi + n;
        }
        lo = lo > n ? n : lo;
        hi = hi > n ? n : hi;
    } else {
        lo = has_a ? ct_inum(va) : n - 1;
        hi = has_b ? ct_inum(vb) : -1 - n;
        if (lo < 0) {
            lo = lo + n < -1 ? -1 : lo + n;
        }
        if (hi < 0) {
            hi = hi + n < -1 ? -1 : hi + n;
        }
        lo = lo >= n ? n - 1 : lo;
        hi = hi >= n ? n - 1 : hi;
    }
    /* walked once: each item is a step, and a string is walked a code point at a time from the last
     * item (finding each item's offset from the start was quadratic in the string's length) */
    int64_t count = step > 0 ? (hi > lo ? (hi - lo - 1) / step + 1 : 0) : (lo > hi ? (lo - hi - 1) / -step + 1 : 0);
    if (!ct_charge(e, (uint64_t)count + (is_str ? ct_bytes_steps(obj.u.s->len) : 0))) {
        return e->fault;
    }
    if (!is_str) {
        struct value r = ct_mk_list(e, obj.t, (size_t)count);
        if (r.t == V_UNDEF) {
            return ct_oom(e);
        }
        for (int64_t k = 0, i = lo; k < count; k++, i += step) {
            r.u.l->v[k] = obj.u.l->v[i];
        }
        r.u.l->n = (size_t)count;
        *out = r;
        return KR_OK;
    }
    const char *s = obj.u.s->s;
    size_t len = obj.u.s->len, at = count ? ct_u8_offset(s, len, (size_t)lo) : 0;
    struct kr_buf_s b = CT_BUF;
    for (int64_t k = 0; k < count; k++) {
        size_t z = ct_u8_offset(s + at, len - at, 1);
        kr_bs_append(&b, s + at, z);
        if (k + 1 == count) {
            break;
        }
        if (step > 0) { /* forward `step` code points (count bounds how far that can go) */
            at += ct_u8_offset(s + at, len - at, (size_t)step);
        } else {
            for (int64_t m = 0; m < -step && at > 0; m++) {
                at--;
                while (at > 0 && ((unsigned char)s[at] & 0xC0) == 0x80) {
                    at--;
                }
            }
        }
    }
    *out = ct_mk_str_buf(e, &b);
    kr_bs_free(&b);
    return out->t == V_STR ? KR_OK : ct_oom(e);
}

/* ---- iteration ---------------------------------------------------------------------------------------- */

/* Materializes anything iterable as a list (dict -> keys, str -> characters). */
enum kr_status ct_iter_list(struct ev *e, struct value v, struct list **out)
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
        struct value l = ct_mk_list(e, V_LIST, v.u.d->n);
        if (l.t != V_LIST) {
            return ct_oom(e);
        }
        for (size_t i = 0; i < v.u.d->n; i++) {
            l.u.l->v[i] = v.u.d->k[i];
        }
        l.u.l->n = v.u.d->n;
        *out = l.u.l;
        return KR_OK;
    }
    if (v.t == V_STR) {
        struct value l = ct_mk_list(e, V_LIST, v.u.s->len);
        if (l.t != V_LIST) {
            return ct_oom(e);
        }
        for (size_t i = 0; i < v.u.s->len;) {
            uint32_t cp;
            size_t n = kr_utf8_next(v.u.s->s + i, &cp);
            struct value c = ct_mk_str(e, v.u.s->s + i, n);
            if (c.t != V_STR || !ct_list_push(e, l.u.l, c)) {
                return ct_oom(e);
            }
            i += n;
        }
        *out = l.u.l;
        return KR_OK;
    }
    return ct_rt_err(e, "'%s' object is not iterable", ct_type_name(v));
}

/* ---- operators ------------------------------------------------------------------------------------------- */

enum kr_status ct_arith(struct ev *e, int op, struct value a, struct value b, struct value *out)
{
    if (a.t == V_UNDEF || b.t == V_UNDEF) {
        return ct_rt_err(e, "an undefined value was used in arithmetic");
    }
    if (op == OP_ADD && a.t == V_STR && b.t == V_STR) {
        struct kr_buf_s s = CT_BUF;
        kr_bs_append(&s, a.u.s->s, a.u.s->len);
        kr_bs_append(&s, b.u.s->s, b.u.s->len);
        *out = ct_mk_str_buf(e, &s);
        kr_bs_free(&s);
        return out->t == V_STR ? KR_OK : ct_oom(e);
    }
    if (op == OP_ADD && (a.t == V_LIST || a.t == V_TUPLE) && a.t == b.t) {
        struct value l = ct_mk_list(e, a.t, a.u.l->n + b.u.l->n);
        for (size_t i = 0; l.t != V_UNDEF && i < a.u.l->n + b.u.l->n; i++) {
            l.u.l->v[i] = i < a.u.l->n ? a.u.l->v[i] : b.u.l->v[i - a.u.l->n];
        }
        if (l.t == V_UNDEF) {
            return ct_oom(e);
        }
        l.u.l->n = a.u.l->n + b.u.l->n;
        *out = l;
        return KR_OK;
    }
    if (op == OP_MUL && ((a.t == V_STR || a.t == V_LIST) && (b.t == V_INT || b.t == V_BOOL))) {
        int64_t k = ct_inum(b) < 0 ? 0 : ct_inum(b);
        const uint64_t per = a.t == V_STR ? a.u.s->len : a.u.l->n;
        if (per == 0) {
            k = 0; /* repeating nothing: no need to count to k */
        }
        if (per && (uint64_t)k > MAX_BYTES / per) { /* divided: k * per may wrap */
            return ct_oom(e);
        }
        /* a step per copy, as a loop making them would take: 'a' * 10**8 was seconds of appends */
        e->steps += (long)((uint64_t)k * (a.t == V_STR ? 1 : per));
        if (e->steps > MAX_STEPS) {
            return ct_rt_err(e, "template execution exceeded %ld steps", MAX_STEPS);
        }
        if (a.t == V_STR) {
            struct kr_buf_s s = CT_BUF;
            for (int64_t i = 0; i < k; i++) {
                kr_bs_append(&s, a.u.s->s, a.u.s->len);
            }
            *out = ct_mk_str_buf(e, &s);
            kr_bs_free(&s);
            return out->t == V_STR ? KR_OK : ct_oom(e);
        }
        struct value l = ct_mk_list(e, V_LIST, 8);
        for (int64_t i = 0; l.t != V_UNDEF && i < k; i++) {
            for (size_t j = 0; j < a.u.l->n; j++) {
                if (!ct_list_push(e, l.u.l, a.u.l->v[j])) {
                    return ct_oom(e);
                }
            }
        }
        *out = l;
        return l.t != V_UNDEF ? KR_OK : ct_oom(e);
    }
    if (op == OP_MOD && a.t == V_STR) { /* printf-style formatting with %s / %d */
        struct list one = {1, 1, &b};
        struct list *args = b.t == V_TUPLE ? b.u.l : &one;
        struct kr_buf_s s = CT_BUF;
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
                    kr_bs_printf(&s, "%lld", (long long)ct_inum(x));
                } else {
                    ct_py_str(e, x, &s, f == 'r');
                }
            } else {
                kr_bs_free(&s);
                return ct_rt_err(e, "unsupported string formatting");
            }
        }
        *out = ct_mk_str_buf(e, &s);
        kr_bs_free(&s);
        return KR_OK;
    }
    if (!ct_is_num(a) || !ct_is_num(b)) {
        static const char *const names[] = {"+", "-", "*", "/", "//", "%", "**"};
        return ct_rt_err(e, "unsupported operand type(s) for %s: '%s' and '%s'", names[op], ct_type_name(a), ct_type_name(b));
    }
    bool ints = a.t != V_FLOAT && b.t != V_FLOAT;
    int64_t x = ct_inum(a), y = ct_inum(b), r;
    double fx = ct_num(a), fy = ct_num(b);
    switch (op) {
    case OP_ADD:
        if (ints) {
            if (__builtin_add_overflow(x, y, &r)) {
                return ct_rt_err(e, "integer overflow");
            }
            *out = v_int(r);
        } else {
            *out = v_float(fx + fy);
        }
        return KR_OK;
    case OP_SUB:
        if (ints) {
            if (__builtin_sub_overflow(x, y, &r)) {
                return ct_rt_err(e, "integer overflow");
            }
            *out = v_int(r);
        } else {
            *out = v_float(fx - fy);
        }
        return KR_OK;
    case OP_MUL:
        if (ints) {
            if (__builtin_mul_overflow(x, y, &r)) {
                return ct_rt_err(e, "integer overflow");
            }
            *out = v_int(r);
        } else {
            *out = v_float(fx * fy);
        }
        return KR_OK;
    case OP_DIV:
        if (fy == 0.0) {
            return ct_rt_err(e, "division by zero");
        }
        *out = v_float(fx / fy);
        return KR_OK;
    case OP_FLOORDIV:
    case OP_MOD:
        if (ints ? y == 0 : fy == 0.0) {
            return ct_rt_err(e, "integer division or modulo by zero");
        }
        if (ints) {
            if (x == INT64_MIN && y == -1) {
                return ct_rt_err(e, "integer overflow");
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
            /* by squaring: (-1) ** 10**18 counted to 10**18 one multiplication at a time */
            int64_t acc = 1, base = x;
            for (uint64_t k = (uint64_t)y; k; k >>= 1) {
                if ((k & 1) && __builtin_mul_overflow(acc, base, &acc)) {
                    return ct_rt_err(e, "integer overflow");
                }
                if (k > 1 && __builtin_mul_overflow(base, base, &base)) {
                    return ct_rt_err(e, "integer overflow"); /* |x| ** 2 already overflows */
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

enum kr_status ct_contains(struct ev *e, struct value hay, struct value needle, bool *res)
{
    *res = false;
    if (hay.t == V_STR) {
        if (needle.t != V_STR) {
            return ct_rt_err(e, "'in <string>' requires string as left operand, not %s", ct_type_name(needle));
        }
        *res = ct_memfind(e, hay.u.s->s, hay.u.s->len, needle.u.s->s, needle.u.s->len, false) != NULL;
        return e->fault;
    }
    if (hay.t == V_DICT || hay.t == V_NS) {
        *res = ct_dict_find(hay.u.d, needle) != NULL;
        return KR_OK;
    }
    if (hay.t == V_LIST || hay.t == V_TUPLE) {
        for (size_t i = 0; i < hay.u.l->n && !*res && !e->fault; i++) {
            *res = ct_v_eq(e, hay.u.l->v[i], needle); /* a step an item */
        }
        return e->fault;
    }
    if (hay.t == V_UNDEF) {
        return KR_OK;
    }
    return ct_rt_err(e, "argument of type '%s' is not iterable", ct_type_name(hay));
}

static enum kr_status compare(struct ev *e, int op, struct value a, struct value b, bool *res)
{
    int c;
    switch (op) {
    case OP_EQ: *res = ct_v_eq(e, a, b); return e->fault;
    case OP_NE: *res = !ct_v_eq(e, a, b); return e->fault;
    case OP_IN: return ct_contains(e, b, a, res);
    case OP_NOTIN: {
        enum kr_status st = ct_contains(e, b, a, res);
        *res = !*res;
        return st;
    }
    default:
        if (a.t == V_UNDEF || b.t == V_UNDEF) {
            return ct_rt_err(e, "an undefined value was compared");
        }
        if (!ct_v_cmp(e, a, b, &c)) {
            return KR_ERR_INVAL;
        }
        *res = op == OP_LT ? c < 0 : op == OP_LE ? c <= 0 : op == OP_GT ? c > 0 : c >= 0;
        return KR_OK;
    }
}

/* ---- expressions ---------------------------------------------------------------------------------------- */

static enum kr_status eval(struct ev *e, const struct node *nd, struct value *out);

enum kr_status ct_eval(struct ev *e, const struct node *nd, struct value *out)
{
    if (e->fault) {
        return e->fault;
    }
    if (++e->steps > MAX_STEPS) {
        return ct_fault(e, "template execution exceeded %ld steps", MAX_STEPS);
    }
    enum kr_status st = eval(e, nd, out);
    /* a helper that met a limit (steps, nesting, size) returned some value: the fault decides */
    return st == KR_OK && e->fault ? e->fault : st;
}

static enum kr_status eval(struct ev *e, const struct node *nd, struct value *out)
{
    enum kr_status st = KR_OK;
    struct value a, b;
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
                *out = ct_mk_func(e, GLOBALS[i].b, v_none(), GLOBALS[i].name);
                return out->t == V_FUNC ? KR_OK : ct_oom(e);
            }
        }
        *out = v_undef();
        return KR_OK;
    }
    case E_LIST:
    case E_TUPLE: {
        struct value l = ct_mk_list(e, nd->k == E_LIST ? V_LIST : V_TUPLE, nd->n_kids);
        if (l.t == V_UNDEF) {
            return ct_oom(e);
        }
        for (size_t i = 0; i < nd->n_kids; i++) {
            if ((st = ct_eval(e, nd->kids[i], &l.u.l->v[i])) != KR_OK) {
                return st;
            }
        }
        l.u.l->n = nd->n_kids;
        *out = l;
        return KR_OK;
    }
    case E_DICT: {
        struct value d = ct_mk_dict(e, V_DICT);
        if (d.t == V_UNDEF) {
            return ct_oom(e);
        }
        for (size_t i = 0; i < nd->n_kids; i++) {
            if ((st = ct_eval(e, nd->kids[i], &a)) != KR_OK || (st = ct_eval(e, nd->kvals[i], &b)) != KR_OK) {
                return st;
            }
            if (!ct_dict_set(e, d.u.d, a, b)) {
                return ct_oom(e);
            }
        }
        *out = d;
        return KR_OK;
    }
    case E_ATTR:
        if ((st = ct_eval(e, nd->a, &a)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        return ct_get_attr(e, a, nd->name, out);
    case E_ITEM:
        if ((st = ct_eval(e, nd->a, &a)) != KR_OK || (st = ct_eval(e, nd->b, &b)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        return ct_get_item(e, a, b, out);
    case E_SLICE: {
        struct value lo = v_none(), hi = v_none(), step = v_none();
        if ((st = ct_eval(e, nd->a, &a)) != KR_OK || (nd->b && (st = ct_eval(e, nd->b, &lo)) != KR_OK) ||
            (nd->c && (st = ct_eval(e, nd->c, &hi)) != KR_OK) || (nd->kids[0] && (st = ct_eval(e, nd->kids[0], &step)) != KR_OK)) {
            return st;
        }
        e->line = nd->line;
        return slice(e, a, lo, hi, step, out);
    }
    case E_CALL: {
        struct args args;
        if ((st = ct_eval(e, nd->a, &a)) != KR_OK || (st = ct_eval_args(e, nd, &args, 0)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        if (a.t != V_FUNC) {
            return ct_rt_err(e, a.t == V_UNDEF ? "called an undefined value" : "'%s' object is not callable", ct_type_name(a));
        }
        return ct_call_func(e, a.u.fn, &args, out);
    }
    case E_FILTER: {
        struct args args;
        if ((st = ct_eval(e, nd->a, &a)) != KR_OK || (st = ct_eval_args(e, nd, &args, 0)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        return ct_apply_filter(e, nd->name, a, &args, out);
    }
    case E_TEST: {
        struct args args;
        bool r;
        if ((st = ct_eval(e, nd->a, &a)) != KR_OK || (st = ct_eval_args(e, nd, &args, 0)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        if ((st = ct_apply_test(e, nd->name, a, &args, &r)) != KR_OK) {
            return st;
        }
        *out = v_bool(nd->op ? !r : r);
        return KR_OK;
    }
    case E_NOT:
        if ((st = ct_eval(e, nd->a, &a)) != KR_OK) {
            return st;
        }
        *out = v_bool(!ct_truthy(a));
        return KR_OK;
    case E_NEG:
    case E_POS:
        if ((st = ct_eval(e, nd->a, &a)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        if (!ct_is_num(a)) {
            return ct_rt_err(e, "bad operand type for unary %c: '%s'", nd->k == E_NEG ? '-' : '+', ct_type_name(a));
        }
        if (nd->k == E_NEG && a.t == V_INT && a.u.i == INT64_MIN) {
            return ct_rt_err(e, "integer overflow");
        }
        *out = nd->k == E_POS ? (a.t == V_BOOL ? v_int(ct_inum(a)) : a)
                              : a.t == V_FLOAT ? v_float(-a.u.f) : v_int(-ct_inum(a));
        return KR_OK;
    case E_AND:
    case E_OR:
        if ((st = ct_eval(e, nd->a, &a)) != KR_OK) {
            return st;
        }
        if (ct_truthy(a) == (nd->k == E_OR)) {
            *out = a;
            return KR_OK;
        }
        return ct_eval(e, nd->b, out);
    case E_BIN:
        if ((st = ct_eval(e, nd->a, &a)) != KR_OK || (st = ct_eval(e, nd->b, &b)) != KR_OK) {
            return st;
        }
        e->line = nd->line;
        if (nd->op == OP_CAT) {
            struct kr_buf_s s = CT_BUF;
            ct_py_str(e, a, &s, false);
            ct_py_str(e, b, &s, false);
            *out = ct_mk_str_buf(e, &s);
            kr_bs_free(&s);
            return out->t == V_STR ? KR_OK : ct_oom(e);
        }
        return ct_arith(e, nd->op, a, b, out);
    case E_CMP: {
        if ((st = ct_eval(e, nd->a, &a)) != KR_OK) {
            return st;
        }
        bool r = true;
        for (size_t i = 0; i < nd->n_kids && r; i++) {
            if ((st = ct_eval(e, nd->kids[i], &b)) != KR_OK) {
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
        if ((st = ct_eval(e, nd->a, &a)) != KR_OK) {
            return st;
        }
        if (ct_truthy(a)) {
            return ct_eval(e, nd->b, out);
        }
        if (nd->c) {
            return ct_eval(e, nd->c, out);
        }
        *out = v_undef();
        return KR_OK;
    default:
        return ct_rt_err(e, "internal error: statement node in an expression");
    }
}

/* ---- statements ------------------------------------------------------------------------------------------ */

static enum kr_status assign(struct ev *e, struct scope *sc, const struct node *target, struct value v)
{
    if (target->k == E_NAME) {
        return ct_dict_set_str(e, &sc->vars, target->name, v) ? KR_OK : ct_oom(e);
    }
    if (target->k == E_ATTR) {
        struct value *ns = scope_lookup(sc, target->a->name);
        if (!ns || ns->t != V_NS) {
            return ct_rt_err(e, "cannot assign attribute on non-namespace object");
        }
        return ct_dict_set_str(e, ns->u.d, target->name, v) ? KR_OK : ct_oom(e);
    }
    /* tuple unpacking */
    struct list *items;
    enum kr_status st = ct_iter_list(e, v, &items);
    if (st != KR_OK) {
        return st;
    }
    if (items->n != target->n_kids) {
        return ct_rt_err(e, "cannot unpack %zu values into %zu names", items->n, target->n_kids);
    }
    for (size_t i = 0; i < items->n && st == KR_OK; i++) {
        st = assign(e, sc, target->kids[i], items->v[i]);
    }
    return st;
}

static enum kr_status emit(struct ev *e, struct value v)
{
    size_t before = e->out->len;
    ct_py_str(e, v, e->out, false);
    if (e->fault) {
        return e->fault;
    }
    if (e->out->over || e->out->len + e->arena.total > MAX_BYTES) {
        return ct_rt_err(e, "rendered text exceeds %u MiB", MAX_BYTES >> 20);
    }
    return e->out->p || before == e->out->len ? KR_OK : ct_oom(e);
}

static enum kr_status exec_node(struct ev *e, const struct node *nd, struct scope *sc, enum flow *flow)
{
    enum kr_status st = KR_OK;
    struct value v;
    struct scope *saved = e->scope;
    if (e->fault) {
        return e->fault;
    }
    if (++e->steps > MAX_STEPS) {
        return ct_fault(e, "template execution exceeded %ld steps", MAX_STEPS);
    }
    e->scope = sc;
    e->line = nd->line;
    switch (nd->k) {
    case N_BODY:
        st = ct_exec_body(e, nd, sc, flow);
        break;
    case N_TEXT:
        st = kr_bs_append(e->out, nd->v.u.s->s, nd->v.u.s->len) == KR_OK ? KR_OK
             : e->out->over ? ct_rt_err(e, "rendered text exceeds %u MiB", MAX_BYTES >> 20)
                            : ct_oom(e);
        break;
    case N_OUTPUT:
        if ((st = ct_eval(e, nd->a, &v)) == KR_OK) {
            st = emit(e, v);
        }
        break;
    case N_IF:
        for (const struct node *c = nd; c; c = c->c) {
            if (c->k != N_IF) {
                st = ct_exec_body(e, c, sc, flow);
                break;
            }
            if ((st = ct_eval(e, c->a, &v)) != KR_OK) {
                break;
            }
            if (ct_truthy(v)) {
                st = ct_exec_body(e, c->b, sc, flow);
                break;
            }
        }
        break;
    case N_FOR: {
        struct list *items;
        struct value seq;
        if ((st = ct_eval(e, nd->b, &seq)) != KR_OK || (st = ct_iter_list(e, seq, &items)) != KR_OK) {
            break;
        }
        struct scope inner = {.parent = sc};
        /* the `if` filter picks the items first: loop.length and loop.last count only those */
        struct value kept = ct_mk_list(e, V_LIST, items->n + 1);
        if (kept.t == V_UNDEF) {
            st = ct_oom(e);
            break;
        }
        for (size_t i = 0; i < items->n && st == KR_OK; i++) {
            if (nd->c) {
                e->scope = &inner;
                if ((st = assign(e, &inner, nd->a, items->v[i])) != KR_OK || (st = ct_eval(e, nd->c, &v)) != KR_OK) {
                    break;
                }
                if (!ct_truthy(v)) {
                    continue;
                }
            }
            kept.u.l->v[kept.u.l->n++] = items->v[i];
        }
        size_t n = kept.u.l->n;
        for (size_t i = 0; i < n && st == KR_OK; i++) {
            struct value loop = ct_mk_dict(e, V_DICT);
            if (loop.t == V_UNDEF) {
                st = ct_oom(e);
                break;
            }
            struct dict *d = loop.u.d;
            bool ok = ct_dict_set_str(e, d, "index", v_int((int64_t)i + 1)) && ct_dict_set_str(e, d, "index0", v_int((int64_t)i)) &&
                      ct_dict_set_str(e, d, "revindex", v_int((int64_t)(n - i))) &&
                      ct_dict_set_str(e, d, "revindex0", v_int((int64_t)(n - i - 1))) &&
                      ct_dict_set_str(e, d, "first", v_bool(i == 0)) && ct_dict_set_str(e, d, "last", v_bool(i + 1 == n)) &&
                      ct_dict_set_str(e, d, "length", v_int((int64_t)n)) && ct_dict_set_str(e, d, "depth", v_int(1)) &&
                      ct_dict_set_str(e, d, "depth0", v_int(0)) &&
                      ct_dict_set_str(e, d, "previtem", i > 0 ? kept.u.l->v[i - 1] : v_undef()) &&
                      ct_dict_set_str(e, d, "nextitem", i + 1 < n ? kept.u.l->v[i + 1] : v_undef()) &&
                      ct_dict_set_str(e, d, "cycle", ct_mk_func(e, B_CYCLE, v_int((int64_t)i), "cycle"));
            if (!ok) {
                st = ct_oom(e);
                break;
            }
            /* jinja gives each iteration fresh locals: assignments in the body do not carry over */
            ct_dict_clear(&inner.vars);
            if (!ct_dict_set_str(e, &inner.vars, "loop", loop)) {
                st = ct_oom(e);
                break;
            }
            if ((st = assign(e, &inner, nd->a, kept.u.l->v[i])) != KR_OK) {
                break;
            }
            enum flow f = FLOW_NORMAL;
            st = ct_exec_body(e, nd->kids[0], &inner, &f);
            if (f == FLOW_BREAK) {
                break;
            }
        }
        if (st == KR_OK && n == 0 && nd->kids[1]) {
            st = ct_exec_body(e, nd->kids[1], sc, flow);
        }
        break;
    }
    case N_SET:
        if ((st = ct_eval(e, nd->b, &v)) == KR_OK) {
            st = assign(e, sc, nd->a, v);
        }
        break;
    case N_SET_BLOCK:
    case N_FILTER_BLOCK: {
        struct kr_buf_s buf = CT_BUF, *out = e->out;
        e->out = &buf;
        st = ct_exec_body(e, nd->b, sc, flow);
        e->out = out;
        if (st == KR_OK) {
            v = ct_mk_str_buf(e, &buf);
            if (nd->c) { /* filters applied to the captured text */
                const struct node *saved_inj = e->inject_node;
                struct value saved_val = e->inject_val;
                e->inject_node = (const struct node *)nd->name;
                e->inject_val = v;
                st = ct_eval(e, nd->c, &v);
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
        struct value f = ct_mk_func(e, B_MACRO, v_none(), nd->name);
        if (f.t == V_UNDEF) {
            st = ct_oom(e);
            break;
        }
        f.u.fn->macro = nd;
        st = ct_dict_set_str(e, &sc->vars, nd->name, f) ? KR_OK : ct_oom(e);
        break;
    }
    case N_WITH: {
        struct scope inner = {.parent = sc};
        for (size_t i = 0; i < nd->n_kw && st == KR_OK; i++) {
            e->scope = sc;
            if ((st = ct_eval(e, nd->kvals[i], &v)) == KR_OK && !ct_dict_set_str(e, &inner.vars, nd->knames[i], v)) {
                st = ct_oom(e);
            }
        }
        if (st == KR_OK) {
            st = ct_exec_body(e, nd->b, &inner, flow);
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
        st = ct_rt_err(e, "internal error: expression node as a statement");
    }
    e->scope = saved;
    return st == KR_OK && e->fault ? e->fault : st;
}

enum kr_status ct_exec_body(struct ev *e, const struct node *body, struct scope *sc, enum flow *flow)
{
    if (!body) {
        return KR_OK;
    }
    if (body->k != N_BODY) {
        return exec_node(e, body, sc, flow);
    }
    if (++e->depth > MAX_DEPTH) {
        e->depth--;
        return ct_rt_err(e, "blocks nested too deeply");
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
    struct kr_buf_s buf = CT_BUF;
    struct scope root = {0};
    enum kr_status st = KR_OK;
    *out = NULL;
    *out_len = 0;
    e.root = e.scope = &root;
    e.out = &buf;
    struct value msgs = params->messages ? ct_from_json(&e, params->messages) : ct_mk_list(&e, V_LIST, 1);
    struct value tools = params->tools ? ct_from_json(&e, params->tools) : v_none();
    if (msgs.t == V_UNDEF || (params->tools && tools.t == V_UNDEF)) {
        st = ct_oom(&e);
        goto done;
    }
    /* transformers passes messages, tools, documents and add_generation_prompt, then the special
     * tokens and any extra keyword arguments */
    if (!ct_dict_set_str(&e, &root.vars, "messages", msgs) || !ct_dict_set_str(&e, &root.vars, "tools", tools) ||
        !ct_dict_set_str(&e, &root.vars, "documents", v_none()) ||
        !ct_dict_set_str(&e, &root.vars, "add_generation_prompt", v_bool(params->add_generation_prompt)) ||
        (params->bos_token && !ct_dict_set_str(&e, &root.vars, "bos_token", ct_mk_str(&e, params->bos_token, strlen(params->bos_token)))) ||
        (params->eos_token && !ct_dict_set_str(&e, &root.vars, "eos_token", ct_mk_str(&e, params->eos_token, strlen(params->eos_token))))) {
        st = ct_oom(&e);
        goto done;
    }
    if (params->extra && json_is_object(params->extra)) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)params->extra, k, v) {
            struct value x = ct_from_json(&e, v);
            if (x.t == V_UNDEF || !ct_dict_set_str(&e, &root.vars, k, x)) {
                st = ct_oom(&e);
                goto done;
            }
        }
    }
    enum flow flow = FLOW_NORMAL;
    if ((st = kr_bs_reserve(&buf, 0)) != KR_OK || (st = ct_exec_body(&e, tpl->body, &root, &flow)) != KR_OK) {
        goto done;
    }
    if (e.fault || buf.over) {
        st = e.fault ? e.fault : ct_rt_err(&e, "rendered text exceeds %u MiB", MAX_BYTES >> 20);
        goto done;
    }
    if (e.arena.failed || buf.oom) {
        /* an allocation failed where its result was not checked (a string that came out undefined, a
         * piece of the output): the text would silently lack something */
        st = ct_oom(&e);
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
    ct_a_free(&e.arena);
    return st;
}
