/* The chat-template interpreter's values: the bump arena, run-time errors, strings, lists, dicts
 * and functions; Python's conversions (repr/str of floats and containers, truthiness, equality,
 * ordering); JSON in (the render parameters) and out (tojson); string helpers (code points,
 * strip, case mapping, replace, find). */
#define _GNU_SOURCE /* memmem */

#include "impl.h"

#include "alloc.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena ------------------------------------------------------------------------------------- */

void *ct_a_alloc(struct arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > 32768 ? n : 32768;
        if (a->total + cap > MAX_BYTES) {
            a->failed = a->over = true;
            return NULL;
        }
        struct achunk *c = kr_malloc(sizeof(*c) + cap);
        if (!c) {
            a->failed = true;
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

void ct_a_free(struct arena *a)
{
    while (a->head) {
        struct achunk *n = a->head->next;
        kr_free(a->head);
        a->head = n;
    }
    a->total = 0;
}

/* ---- run-time errors, constructors, dicts ------------------------------------------------------- */

enum kr_status ct_rt_err(struct ev *e, const char *fmt, ...)
{
    if (e->fault) { /* the limit met first is the error: what failed after it is its echo */
        return e->fault;
    }
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    return kr_err_set(e->err, KR_ERR_INVAL, "chat template line %d: %s", e->line, msg);
}

enum kr_status ct_oom(struct ev *e)
{
    if (e->fault) {
        return e->fault;
    }
    return kr_err_set(e->err, e->arena.over || e->arena.total + 32768 > MAX_BYTES ? KR_ERR_INVAL : KR_ERR_NOMEM,
                      "chat template line %d: out of memory (limit %u MiB)", e->line, MAX_BYTES >> 20);
}

enum kr_status ct_fault(struct ev *e, const char *fmt, ...)
{
    if (e->fault) {
        return e->fault;
    }
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    e->fault = kr_err_set(e->err, KR_ERR_INVAL, "chat template line %d: %s", e->line, msg);
    return e->fault;
}

bool ct_charge(struct ev *e, uint64_t n)
{
    if (n > (uint64_t)MAX_STEPS || (e->steps += (long)n) > MAX_STEPS) {
        e->steps = MAX_STEPS + 1;
        ct_fault(e, "template execution exceeded %ld steps", MAX_STEPS);
        return false;
    }
    return true;
}

struct value ct_mk_str(struct ev *e, const char *s, size_t n)
{
    struct jstr *j = ct_a_alloc(&e->arena, sizeof(*j) + n + 1);
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

struct value ct_mk_str_buf(struct ev *e, const struct kr_buf_s *b)
{
    if (b->over) {
        ct_fault(e, "a string exceeds %u MiB", MAX_BYTES >> 20);
    }
    if (b->oom) {
        e->arena.failed = true;
        return v_undef();
    }
    return ct_mk_str(e, b->p ? b->p : "", b->len);
}

struct value ct_mk_list(struct ev *e, enum vt t, size_t cap)
{
    struct list *l = ct_a_alloc(&e->arena, sizeof(*l));
    struct value *v = l ? ct_a_alloc(&e->arena, (cap ? cap : 1) * sizeof(*v)) : NULL;
    if (!v) {
        return v_undef();
    }
    *l = (struct list){0, cap ? cap : 1, v};
    return (struct value){.t = t, .u.l = l};
}

bool ct_list_push(struct ev *e, struct list *l, struct value v)
{
    if (l->n == l->cap) {
        struct value *nv = ct_a_alloc(&e->arena, l->cap * 2 * sizeof(*nv));
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

struct value ct_mk_dict(struct ev *e, enum vt t)
{
    struct dict *d = ct_a_alloc(&e->arena, sizeof(*d));
    if (!d) {
        return v_undef();
    }
    memset(d, 0, sizeof(*d));
    return (struct value){.t = t, .u.d = d};
}

/* ---- the dict's hash index ---- */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static uint64_t str_hash(const char *s, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h = (h ^ (unsigned char)s[i]) * 0x100000001b3ULL;
    }
    return mix64(h ^ n);
}

/* A hash that agrees with ct_v_eq: values that compare equal hash alike (1 == 1.0 == True). */
static uint64_t v_hash(struct value v, int depth)
{
    switch (v.t) {
    case V_UNDEF: return 0x9e3779b97f4a7c15ULL;
    case V_NONE: return 0x7f4a7c159e3779b9ULL;
    case V_BOOL:
    case V_INT: return mix64((uint64_t)ct_inum(v));
    case V_FLOAT: {
        double f = v.u.f;
        if (f >= -9223372036854775808.0 && f < 9223372036854775808.0 && f == (double)(int64_t)f) {
            return mix64((uint64_t)(int64_t)f);
        }
        uint64_t u;
        memcpy(&u, &f, sizeof(u));
        return mix64(u ^ 0x5bd1e9955bd1e995ULL);
    }
    case V_STR: return str_hash(v.u.s->s, v.u.s->len);
    case V_LIST:
    case V_TUPLE: {
        /* the length and the first few items (bounded, so that hashing stays cheap) */
        uint64_t h = mix64((uint64_t)v.t * 31 + v.u.l->n);
        for (size_t i = 0; depth < 3 && i < v.u.l->n && i < 4; i++) {
            h = mix64(h ^ v_hash(v.u.l->v[i], depth + 1));
        }
        return h;
    }
    case V_DICT: return mix64(0xd1c7 + v.u.d->n); /* equality ignores order: the size only */
    case V_NS:
    case V_FUNC: return mix64((uint64_t)(uintptr_t)v.u.d); /* equal only to itself */
    }
    return 0;
}

/* Rebuilds the index for d's current capacity. */
static bool dict_reindex(struct ev *e, struct dict *d)
{
    size_t n_slot = 16;
    while (n_slot < 2 * d->cap) {
        n_slot *= 2;
    }
    uint32_t *slot = ct_a_alloc(&e->arena, n_slot * sizeof(*slot));
    if (!slot || d->cap >= UINT32_MAX) {
        return false;
    }
    memset(slot, 0, n_slot * sizeof(*slot));
    for (size_t i = 0; i < d->n; i++) {
        size_t at = (size_t)v_hash(d->k[i], 0) & (n_slot - 1);
        while (slot[at]) {
            at = (at + 1) & (n_slot - 1);
        }
        slot[at] = (uint32_t)i + 1;
    }
    d->slot = slot;
    d->n_slot = n_slot;
    return true;
}

/* The index in d of key k, or -1; *at_out (may be NULL) receives the free slot where k would go. */
static int64_t dict_lookup(const struct dict *d, struct value k, size_t *at_out)
{
    if (!d->slot) {
        for (size_t i = 0; i < d->n; i++) {
            if (ct_v_eq(NULL, d->k[i], k)) {
                return (int64_t)i;
            }
        }
        return -1;
    }
    size_t at = (size_t)v_hash(k, 0) & (d->n_slot - 1);
    for (; d->slot[at]; at = (at + 1) & (d->n_slot - 1)) {
        size_t i = d->slot[at] - 1;
        if (ct_v_eq(NULL, d->k[i], k)) {
            return (int64_t)i;
        }
    }
    if (at_out) {
        *at_out = at;
    }
    return -1;
}

struct value *ct_dict_find(const struct dict *d, struct value k)
{
    int64_t i = dict_lookup(d, k, NULL);
    return i < 0 ? NULL : &d->v[i];
}

struct value *ct_dict_find_str(const struct dict *d, const char *k)
{
    size_t n = strlen(k);
    if (!d->slot) {
        for (size_t i = 0; i < d->n; i++) {
            if (d->k[i].t == V_STR && d->k[i].u.s->len == n && memcmp(d->k[i].u.s->s, k, n) == 0) {
                return &d->v[i];
            }
        }
        return NULL;
    }
    for (size_t at = (size_t)str_hash(k, n) & (d->n_slot - 1); d->slot[at]; at = (at + 1) & (d->n_slot - 1)) {
        size_t i = d->slot[at] - 1;
        if (d->k[i].t == V_STR && d->k[i].u.s->len == n && memcmp(d->k[i].u.s->s, k, n) == 0) {
            return &d->v[i];
        }
    }
    return NULL;
}

void ct_dict_clear(struct dict *d)
{
    d->n = 0;
    if (d->slot) {
        memset(d->slot, 0, d->n_slot * sizeof(*d->slot));
    }
}

bool ct_dict_set(struct ev *e, struct dict *d, struct value k, struct value v)
{
    size_t at = 0;
    int64_t found = dict_lookup(d, k, &at);
    if (found >= 0) {
        d->v[found] = v;
        return true;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 8;
        struct value *nk = ct_a_alloc(&e->arena, cap * sizeof(*nk)), *nv = ct_a_alloc(&e->arena, cap * sizeof(*nv));
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
        if (cap > DICT_INDEX_MIN && !dict_reindex(e, d)) {
            return false;
        }
        if (d->slot) { /* the free slot moved with the new index */
            dict_lookup(d, k, &at);
        }
    }
    d->k[d->n] = k;
    d->v[d->n] = v;
    if (d->slot) {
        d->slot[at] = (uint32_t)d->n + 1;
    }
    d->n++;
    return true;
}

bool ct_dict_set_str(struct ev *e, struct dict *d, const char *k, struct value v)
{
    struct value ks = ct_mk_str(e, k, strlen(k));
    return STR_OK(ks) && ct_dict_set(e, d, ks, v);
}

struct value ct_mk_func(struct ev *e, enum builtin b, struct value self, const char *name)
{
    struct func *f = ct_a_alloc(&e->arena, sizeof(*f));
    if (!f) {
        return v_undef();
    }
    *f = (struct func){b, self, NULL, name};
    return (struct value){.t = V_FUNC, .u.fn = f};
}

const char *ct_type_name(struct value v)
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
        /* a run of printable ASCII in one append (a byte at a time made repr 10x slower) */
        size_t run = i;
        while (run < s->len && s->s[run] >= 0x20 && s->s[run] < 0x7F && s->s[run] != q && s->s[run] != '\\') {
            run++;
        }
        if (run > i) {
            kr_bs_append(b, s->s + i, run - i);
            i = run;
            continue;
        }
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

static void py_str(struct ev *e, struct value v, struct kr_buf_s *b, bool repr, int depth);

static void py_repr_seq(struct ev *e, struct value v, struct kr_buf_s *b, int depth)
{
    if (depth > MAX_DEPTH) {
        ct_fault(e, "a value nested more than %d deep cannot be printed", MAX_DEPTH);
        return;
    }
    if (v.t == V_LIST || v.t == V_TUPLE) {
        kr_bs_putc(b, v.t == V_LIST ? '[' : '(');
        for (size_t i = 0; i < v.u.l->n && !e->fault && !b->oom; i++) {
            if (i) {
                kr_bs_append(b, ", ", 2);
            }
            py_str(e, v.u.l->v[i], b, true, depth + 1);
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
    for (size_t i = 0; i < v.u.d->n && !e->fault && !b->oom; i++) {
        if (i) {
            kr_bs_append(b, ", ", 2);
        }
        py_str(e, v.u.d->k[i], b, true, depth + 1);
        kr_bs_append(b, ": ", 2);
        py_str(e, v.u.d->v[i], b, true, depth + 1);
    }
    kr_bs_append(b, v.t == V_NS ? "}>" : "}", v.t == V_NS ? 2 : 1);
}

/* str(v) (repr=false) or repr(v) (repr=true) as Python prints them. Each value printed is a step
 * (a list holding the same list ten times, ten deep, would print 10^10 items), and a string a step
 * per BYTES_PER_STEP bytes. */
static void py_str(struct ev *e, struct value v, struct kr_buf_s *b, bool repr, int depth)
{
    if (!ct_charge(e, v.t == V_STR ? ct_bytes_steps(v.u.s->len) : 1)) {
        return;
    }
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
    case V_NS: py_repr_seq(e, v, b, depth); break;
    case V_FUNC: kr_bs_printf(b, "<function %s>", v.u.fn->name ? v.u.fn->name : "?"); break;
    }
}

void ct_py_str(struct ev *e, struct value v, struct kr_buf_s *b, bool repr)
{
    py_str(e, v, b, repr, 0);
}

struct value ct_to_str(struct ev *e, struct value v)
{
    if (v.t == V_STR) {
        return v;
    }
    struct kr_buf_s b = CT_BUF;
    ct_py_str(e, v, &b, false);
    struct value r = ct_mk_str_buf(e, &b);
    kr_bs_free(&b);
    return r;
}

bool ct_truthy(struct value v)
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

bool ct_is_num(struct value v)
{
    return v.t == V_INT || v.t == V_FLOAT || v.t == V_BOOL;
}

double ct_num(struct value v)
{
    return v.t == V_FLOAT ? v.u.f : v.t == V_INT ? (double)v.u.i : (double)v.u.b;
}

int64_t ct_f2i(double f)
{
    if (f != f) {
        return 0;
    }
    if (f >= 9223372036854775807.0) {
        return INT64_MAX;
    }
    if (f <= -9223372036854775808.0) {
        return INT64_MIN;
    }
    return (int64_t)f;
}

int64_t ct_inum(struct value v)
{
    return v.t == V_INT ? v.u.i : v.t == V_BOOL ? (int64_t)v.u.b : v.t == V_FLOAT ? ct_f2i(v.u.f) : 0;
}

static bool v_eq(struct ev *e, struct value a, struct value b, int depth)
{
    if (e && !ct_charge(e, a.t == V_STR && b.t == V_STR ? ct_bytes_steps(a.u.s->len) : 1)) {
        return false;
    }
    if (ct_is_num(a) && ct_is_num(b)) {
        if (a.t != V_FLOAT && b.t != V_FLOAT) {
            return ct_inum(a) == ct_inum(b);
        }
        return ct_num(a) == ct_num(b);
    }
    if (a.t != b.t) {
        return false;
    }
    if (depth > MAX_DEPTH && (a.t == V_LIST || a.t == V_TUPLE || a.t == V_DICT)) {
        if (e) {
            ct_fault(e, "values nested more than %d deep cannot be compared", MAX_DEPTH);
        }
        return false;
    }
    switch (a.t) {
    case V_UNDEF:
    case V_NONE: return true;
    case V_STR: return a.u.s->len == b.u.s->len && memcmp(a.u.s->s, b.u.s->s, a.u.s->len) == 0;
    case V_LIST:
    case V_TUPLE:
        if (a.u.l == b.u.l) {
            return true; /* the same list (NaN aside, as Python's identity shortcut) */
        }
        if (a.u.l->n != b.u.l->n) {
            return false;
        }
        for (size_t i = 0; i < a.u.l->n; i++) {
            if (!v_eq(e, a.u.l->v[i], b.u.l->v[i], depth + 1)) {
                return false;
            }
        }
        return true;
    case V_DICT:
        if (a.u.d == b.u.d) {
            return true;
        }
        if (a.u.d->n != b.u.d->n) {
            return false;
        }
        for (size_t i = 0; i < a.u.d->n; i++) {
            struct value *o = ct_dict_find(b.u.d, a.u.d->k[i]);
            if (!o || !v_eq(e, a.u.d->v[i], *o, depth + 1)) {
                return false;
            }
        }
        return true;
    default: return a.u.d == b.u.d;
    }
}

bool ct_v_eq(struct ev *e, struct value a, struct value b)
{
    return v_eq(e, a, b, 0);
}

static bool v_cmp(struct ev *e, struct value a, struct value b, int *res, int depth)
{
    if (ct_is_num(a) && ct_is_num(b)) {
        if (a.t != V_FLOAT && b.t != V_FLOAT) {
            *res = ct_inum(a) < ct_inum(b) ? -1 : ct_inum(a) > ct_inum(b);
        } else {
            *res = ct_num(a) < ct_num(b) ? -1 : ct_num(a) > ct_num(b);
        }
        return true;
    }
    if (a.t == V_STR && b.t == V_STR) {
        size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        if (!ct_charge(e, ct_bytes_steps(n))) {
            return false;
        }
        int c = n ? memcmp(a.u.s->s, b.u.s->s, n) : 0;
        *res = c ? (c < 0 ? -1 : 1) : (a.u.s->len < b.u.s->len ? -1 : a.u.s->len > b.u.s->len);
        return true;
    }
    if ((a.t == V_LIST || a.t == V_TUPLE) && a.t == b.t) {
        if (depth > MAX_DEPTH) {
            ct_fault(e, "values nested more than %d deep cannot be compared", MAX_DEPTH);
            return false;
        }
        for (size_t i = 0; i < a.u.l->n && i < b.u.l->n; i++) {
            if (!ct_charge(e, 1)) {
                return false;
            }
            if (!ct_v_eq(e, a.u.l->v[i], b.u.l->v[i])) {
                return !e->fault && v_cmp(e, a.u.l->v[i], b.u.l->v[i], res, depth + 1);
            }
        }
        *res = a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n;
        return !e->fault;
    }
    ct_rt_err(e, "'<' not supported between instances of '%s' and '%s'", ct_type_name(a), ct_type_name(b));
    return false;
}

/* Python ordering; returns false (with an error) for incomparable types. */
bool ct_v_cmp(struct ev *e, struct value a, struct value b, int *res)
{
    *res = 0;
    return v_cmp(e, a, b, res, 0);
}

/* ---- JSON in and out ---------------------------------------------------------------------------------- */

struct value ct_from_json(struct ev *e, const json_t *j)
{
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        struct value d = ct_mk_dict(e, V_DICT);
        const char *k;
        json_t *v;
        if (d.t != V_DICT) {
            return d;
        }
        json_object_foreach((json_t *)j, k, v) {
            struct value ks = ct_mk_str(e, k, strlen(k)), vs = ct_from_json(e, v);
            if (!STR_OK(ks) || (vs.t == V_UNDEF) || !ct_dict_set(e, d.u.d, ks, vs)) {
                return v_undef();
            }
        }
        return d;
    }
    case JSON_ARRAY: {
        struct value l = ct_mk_list(e, V_LIST, json_array_size(j));
        for (size_t i = 0; l.t == V_LIST && i < json_array_size(j); i++) {
            struct value x = ct_from_json(e, json_array_get(j, i));
            if (x.t == V_UNDEF || !ct_list_push(e, l.u.l, x)) {
                return v_undef();
            }
        }
        return l;
    }
    case JSON_STRING: return ct_mk_str(e, json_string_value(j), json_string_length(j));
    case JSON_INTEGER: return v_int(json_integer_value(j));
    case JSON_REAL: return v_float(json_real_value(j));
    case JSON_TRUE: return v_bool(true);
    case JSON_FALSE: return v_bool(false);
    case JSON_NULL: return v_none();
    }
    return v_undef();
}

static void json_str(const char *s, size_t n, struct kr_buf_s *b)
{
    kr_bs_putc(b, '"');
    for (size_t i = 0; i < n; i++) {
        size_t run = i; /* bytes that need no escape, in one append */
        while (run < n && (unsigned char)s[run] >= 0x20 && s[run] != '"' && s[run] != '\\') {
            run++;
        }
        if (run > i) {
            kr_bs_append(b, s + i, run - i);
            i = run - 1;
            continue;
        }
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
enum kr_status ct_to_json(struct ev *e, struct value v, const struct json_opts *o, int level, struct kr_buf_s *b)
{
    if (level > MAX_DEPTH) {
        return ct_rt_err(e, "tojson: value nested too deeply");
    }
    if (!ct_charge(e, v.t == V_STR ? ct_bytes_steps(v.u.s->len) : 1)) {
        return e->fault;
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
                return ct_oom(e);
            }
            for (size_t i = 0; i < n; i++) {
                if (v.u.d->k[i].t != V_STR) {
                    kr_free(keys);
                    kr_free(order);
                    return ct_rt_err(e, "tojson: sort_keys needs string keys");
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
                struct value val = keys ? *ct_dict_find(v.u.d, k) : v.u.d->v[i];
                if (k.t == V_STR) {
                    json_str(k.u.s->s, k.u.s->len, b);
                } else if (k.t == V_INT || k.t == V_FLOAT || k.t == V_BOOL || k.t == V_NONE) {
                    struct kr_buf_s kb = CT_BUF;
                    st = ct_to_json(e, k, o, level + 1, &kb);
                    if (st == KR_OK && kb.oom) {
                        st = ct_oom(e);
                    }
                    json_str(kb.p ? kb.p : "", kb.len, b);
                    kr_bs_free(&kb);
                } else {
                    st = ct_rt_err(e, "tojson: keys must be str, int, float, bool or None, not %s", ct_type_name(k));
                }
                kr_bs_append(b, o->key_sep, strlen(o->key_sep));
                if (st == KR_OK) {
                    st = ct_to_json(e, val, o, level + 1, b);
                }
            } else {
                st = ct_to_json(e, v.u.l->v[i], o, level + 1, b);
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
        return ct_rt_err(e, "Object of type %s is not JSON serializable", ct_type_name(v));
    }
}

/* ---- strings ---------------------------------------------------------------------------------------- */

size_t ct_u8_count(const char *s, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++) {
        c += ((unsigned char)s[i] & 0xC0) != 0x80;
    }
    return c;
}

/* Byte offset of code point index k. */
size_t ct_u8_offset(const char *s, size_t n, size_t k)
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

struct value ct_py_strip(struct ev *e, const struct jstr *s, const struct jstr *chars, bool left, bool right)
{
    size_t a = 0, b = s->len;
    const uint64_t per_cp = chars ? ct_bytes_steps(chars->len) : 1; /* in_chars scans chars */
    if (!ct_charge(e, ct_bytes_steps(s->len))) {
        return v_undef();
    }
    while (left && a < b) {
        uint32_t cp;
        if (chars && !ct_charge(e, per_cp)) {
            return v_undef();
        }
        size_t l = kr_utf8_next(s->s + a, &cp);
        if (!in_chars(cp, chars)) {
            break;
        }
        a += l;
    }
    while (right && b > a) {
        size_t k = b - 1;
        if (chars && !ct_charge(e, per_cp)) {
            return v_undef();
        }
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
    return ct_mk_str(e, s->s + a, b - a);
}

struct value ct_map_case(struct ev *e, const struct jstr *s, int mode /* 0 lower 1 upper 2 title 3 capitalize */)
{
    struct kr_buf_s b = CT_BUF;
    if (!ct_charge(e, ct_bytes_steps(s->len))) {
        return v_undef();
    }
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
    struct value r = ct_mk_str_buf(e, &b);
    kr_bs_free(&b);
    return r;
}

struct value ct_str_replace(struct ev *e, const struct jstr *s, const struct jstr *old, const struct jstr *new,
                            int64_t count)
{
    struct kr_buf_s b = CT_BUF; /* its limit stops 'a' * 10**6 replaced by a megabyte at 256 MiB */
    size_t i = 0;
    int64_t done = 0;
    if (!ct_charge(e, ct_bytes_steps(s->len))) {
        return v_undef();
    }
    if (old->len == 0) { /* Python inserts `new` between every character */
        for (size_t k = 0; k <= s->len && (count < 0 || done < count) && !b.oom;) {
            if (!ct_charge(e, ct_bytes_steps(new->len))) {
                break;
            }
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
        while (i < s->len && !b.oom) {
            const char *hit = NULL;
            if (count < 0 || done < count) {
                hit = memmem(s->s + i, s->len - i, old->s, old->len);
            }
            if (!hit || !ct_charge(e, ct_bytes_steps(new->len))) {
                break;
            }
            kr_bs_append(&b, s->s + i, (size_t)(hit - (s->s + i)));
            kr_bs_append(&b, new->s, new->len);
            i = (size_t)(hit - s->s) + old->len;
            done++;
        }
        kr_bs_append(&b, s->s + i, s->len - i);
    }
    struct value r = ct_mk_str_buf(e, &b);
    kr_bs_free(&b);
    return r;
}

const char *ct_memfind(struct ev *e, const char *h, size_t hn, const char *n, size_t nn, bool last)
{
    if (!ct_charge(e, ct_bytes_steps(hn) + ct_bytes_steps(nn)) || nn > hn) {
        return NULL;
    }
    if (nn == 0) {
        return last ? h + hn : h;
    }
    if (!last) {
        return memmem(h, hn, n, nn);
    }
    if (nn <= 8) { /* a short needle: a backward scan costs at most 8 compares a byte */
        for (size_t i = hn - nn + 1; i-- > 0;) {
            if (h[i] == n[0] && memcmp(h + i, n, nn) == 0) {
                return h + i;
            }
        }
        return NULL;
    }
    /* the last occurrence is the first one in the reversed text: memmem is linear, a backward
     * scan with a long needle is not ('a' * 10**6 rfind 'a' * 10**5 + 'b') */
    char *rh = kr_malloc(hn + nn);
    if (!rh) {
        e->arena.failed = true;
        return NULL;
    }
    char *rn = rh + hn;
    for (size_t i = 0; i < hn; i++) {
        rh[i] = h[hn - 1 - i];
    }
    for (size_t i = 0; i < nn; i++) {
        rn[i] = n[nn - 1 - i];
    }
    const char *hit = memmem(rh, hn, rn, nn);
    const char *r = hit ? h + (hn - (size_t)(hit - rh) - nn) : NULL;
    kr_free(rh);
    return r;
}

/* ---- json.dumps of a JSON value ------------------------------------------------------------------- */

enum kr_status kr_py_json_dumps(const json_t *v, struct kr_buf_s *b)
{
    switch (json_typeof(v)) {
    case JSON_NULL: kr_bs_append(b, "null", 4); break;
    case JSON_TRUE: kr_bs_append(b, "true", 4); break;
    case JSON_FALSE: kr_bs_append(b, "false", 5); break;
    case JSON_INTEGER: kr_bs_printf(b, "%lld", (long long)json_integer_value(v)); break;
    case JSON_REAL: fmt_float(json_real_value(v), b, true); break;
    case JSON_STRING: json_str(json_string_value(v), json_string_length(v), b); break;
    case JSON_ARRAY: {
        kr_bs_putc(b, '[');
        size_t i;
        const json_t *x;
        json_array_foreach((json_t *)v, i, x)
        {
            if (i) {
                kr_bs_append(b, ", ", 2);
            }
            kr_py_json_dumps(x, b);
        }
        kr_bs_putc(b, ']');
        break;
    }
    case JSON_OBJECT: {
        kr_bs_putc(b, '{');
        bool first = true;
        const char *k;
        const json_t *x;
        json_object_foreach((json_t *)v, k, x)
        {
            if (!first) {
                kr_bs_append(b, ", ", 2);
            }
            first = false;
            json_str(k, strlen(k), b);
            kr_bs_append(b, ": ", 2);
            kr_py_json_dumps(x, b);
        }
        kr_bs_putc(b, '}');
        break;
    }
    }
    return b->oom ? KR_ERR_NOMEM : KR_OK;
}
