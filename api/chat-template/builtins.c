/* The chat-template builtins: calls (arguments, macros, range/namespace/dict/raise_exception/
 * strftime_now/cycler globals, str/dict/list methods) and Jinja's filters and tests. */
#define _GNU_SOURCE /* memmem */

#include "impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- calls -------------------------------------------------------------------------------------------- */

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

enum kr_status ct_eval_args(struct ev *e, const struct node *nd, struct args *a, size_t skip_first)
{
    (void)skip_first;
    a->n = nd->n_kids;
    a->nk = nd->n_kw;
    a->pos = ct_a_alloc(&e->arena, (a->n + 2) * sizeof(*a->pos));
    a->kv = ct_a_alloc(&e->arena, (a->nk + 1) * sizeof(*a->kv));
    a->kn = (const char **)nd->knames;
    if (!a->pos || !a->kv) {
        return ct_oom(e);
    }
    for (size_t i = 0; i < a->n; i++) {
        enum kr_status st = ct_eval(e, nd->kids[i], &a->pos[i]);
        if (st != KR_OK) {
            return st;
        }
    }
    for (size_t i = 0; i < a->nk; i++) {
        enum kr_status st = ct_eval(e, nd->kvals[i], &a->kv[i]);
        if (st != KR_OK) {
            return st;
        }
    }
    return KR_OK;
}

static enum kr_status need_str(struct ev *e, const struct value *v, const char *what)
{
    if (!v || v->t != V_STR) {
        return ct_rt_err(e, "%s must be a string", what);
    }
    return KR_OK;
}

static enum kr_status call_macro(struct ev *e, const struct node *m, const struct args *a, struct value *out)
{
    struct scope sc = {.parent = e->root};
    enum kr_status st = KR_OK;
    if (a->n > m->n_kw) {
        return ct_rt_err(e, "macro '%s' takes not more than %zu argument(s)", m->name, m->n_kw);
    }
    for (size_t i = 0; i < m->n_kw && st == KR_OK; i++) {
        struct value v;
        struct value *given = i < a->n ? &a->pos[i] : kwarg(a, m->knames[i]);
        if (given) {
            v = *given;
        } else if (m->kvals[i]) {
            st = ct_eval(e, m->kvals[i], &v);
        } else {
            v = v_undef();
        }
        if (st == KR_OK && !ct_dict_set_str(e, &sc.vars, m->knames[i], v)) {
            st = ct_oom(e);
        }
    }
    if (st != KR_OK) {
        return st;
    }
    struct kr_buf_s buf = CT_BUF, *saved = e->out;
    enum flow flow = FLOW_NORMAL;
    e->out = &buf;
    if (++e->depth > MAX_DEPTH) {
        st = ct_rt_err(e, "macro calls nested too deeply");
    } else {
        st = ct_exec_body(e, m->b, &sc, &flow);
    }
    e->depth--;
    e->out = saved;
    if (st == KR_OK) {
        *out = ct_mk_str_buf(e, &buf);
        st = out->t == V_STR ? KR_OK : ct_oom(e);
    }
    kr_bs_free(&buf);
    return st;
}

static enum kr_status split_str(struct ev *e, const struct jstr *s, const struct value *sep, int64_t maxsplit,
                                bool right, struct value *out)
{
    struct value l = ct_mk_list(e, V_LIST, 8);
    if (l.t == V_UNDEF) {
        return ct_oom(e);
    }
    if (sep && sep->t != V_STR && sep->t != V_NONE) {
        return ct_rt_err(e, "must be str or None, not %s", ct_type_name(*sep)); /* split(undefined) */
    }
    if (sep && sep->t == V_STR && sep->u.s->len == 0) {
        return ct_rt_err(e, "empty separator");
    }
    if (!ct_charge(e, ct_bytes_steps(s->len))) {
        return e->fault;
    }
    if (!sep || sep->t == V_NONE) { /* whitespace split */
        size_t i = 0;
        int64_t done = 0;
        while (i < s->len) {
            size_t l1;
            while ((l1 = ct_py_space_len(s->s, s->len, i)) > 0) {
                i += l1;
            }
            if (i >= s->len) {
                break;
            }
            size_t j = i;
            if (maxsplit >= 0 && done >= maxsplit && !right) {
                size_t end = ct_py_rstrip_len(s->s, s->len);
                struct value w = ct_mk_str(e, s->s + i, end - i);
                if (w.t != V_STR || !ct_list_push(e, l.u.l, w)) {
                    return ct_oom(e);
                }
                break;
            }
            while (j < s->len && !ct_py_space_len(s->s, s->len, j)) {
                uint32_t cp;
                j += kr_utf8_next(s->s + j, &cp);
            }
            struct value w = ct_mk_str(e, s->s + i, j - i);
            if (w.t != V_STR || !ct_list_push(e, l.u.l, w)) {
                return ct_oom(e);
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
        struct value parts = ct_mk_list(e, V_LIST, 8);
        if (parts.t == V_UNDEF) {
            return ct_oom(e);
        }
        while (done < maxsplit) {
            const char *hit = ct_memfind(e, s->s, end, p->s, p->len, true);
            if (!hit) {
                break;
            }
            size_t at = (size_t)(hit - s->s);
            if (!ct_list_push(e, parts.u.l, ct_mk_str(e, s->s + at + p->len, end - at - p->len))) {
                return ct_oom(e);
            }
            end = at;
            done++;
        }
        if (!ct_list_push(e, l.u.l, ct_mk_str(e, s->s, end))) {
            return ct_oom(e);
        }
        for (size_t k = parts.u.l->n; k-- > 0;) {
            if (!ct_list_push(e, l.u.l, parts.u.l->v[k])) {
                return ct_oom(e);
            }
        }
        *out = l;
        return KR_OK;
    }
    size_t i = 0;
    int64_t done = 0;
    for (;;) {
        const char *hit =
            maxsplit >= 0 && done >= maxsplit ? NULL : ct_memfind(e, s->s + i, s->len - i, p->s, p->len, false);
        size_t end = hit ? (size_t)(hit - s->s) : s->len;
        struct value w = ct_mk_str(e, s->s + i, end - i);
        if (w.t != V_STR || !ct_list_push(e, l.u.l, w)) {
            return ct_oom(e);
        }
        if (!hit || !ct_charge(e, 1)) {
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

enum kr_status ct_call_func(struct ev *e, const struct func *f, const struct args *a, struct value *out)
{
    struct value self = f->self;
    struct value *x = arg(a, 0, NULL), *y = arg(a, 1, NULL);
    enum kr_status st;
    *out = v_none();
    if (f->b >= M_ISDIGIT && f->b <= M_ISLOWER && !ct_charge(e, ct_bytes_steps(self.u.s->len))) {
        return e->fault;
    }
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
        *out = ct_mk_str(e, buf, n);
        return KR_OK;
    }
    case B_RANGE: {
        int64_t lo = 0, hi, step = 1;
        if (a->n == 0 || a->n > 3) {
            return ct_rt_err(e, "range expected 1 to 3 arguments");
        }
        for (size_t i = 0; i < a->n; i++) {
            if (a->pos[i].t != V_INT && a->pos[i].t != V_BOOL) {
                return ct_rt_err(e, "range arguments must be integers");
            }
        }
        if (a->n == 1) {
            hi = ct_inum(a->pos[0]);
        } else {
            lo = ct_inum(a->pos[0]);
            hi = ct_inum(a->pos[1]);
            if (a->n == 3) {
                step = ct_inum(a->pos[2]);
            }
        }
        if (step == 0) {
            return ct_rt_err(e, "range() arg 3 must not be zero");
        }
        /* the span in unsigned arithmetic: hi - lo wraps int64 for range(-2**63, 2**63 - 1) */
        uint64_t span = step > 0 ? (hi > lo ? (uint64_t)hi - (uint64_t)lo : 0) : (lo > hi ? (uint64_t)lo - (uint64_t)hi : 0);
        uint64_t ustep = step > 0 ? (uint64_t)step : (uint64_t)0 - (uint64_t)step;
        uint64_t ucount = span ? (span - 1) / ustep + 1 : 0;
        if (ucount > MAX_RANGE) {
            return ct_rt_err(e, "range too big (more than %d items)", MAX_RANGE);
        }
        int64_t count = (int64_t)ucount;
        struct value l = ct_mk_list(e, V_LIST, (size_t)count);
        if (l.t == V_UNDEF) {
            return ct_oom(e);
        }
        for (int64_t i = 0; i < count; i++) { /* lo + i * step lies between lo and hi: no overflow */
            l.u.l->v[i] = v_int((int64_t)((uint64_t)lo + (uint64_t)i * (uint64_t)step));
        }
        l.u.l->n = (size_t)count;
        *out = l;
        return KR_OK;
    }
    case B_NAMESPACE:
    case B_DICT: {
        struct value d = ct_mk_dict(e, f->b == B_NAMESPACE ? V_NS : V_DICT);
        if (d.t == V_UNDEF) {
            return ct_oom(e);
        }
        if (x && (x->t == V_DICT || x->t == V_NS)) {
            for (size_t i = 0; i < x->u.d->n; i++) {
                if (!ct_dict_set(e, d.u.d, x->u.d->k[i], x->u.d->v[i])) {
                    return ct_oom(e);
                }
            }
        }
        for (size_t i = 0; i < a->nk; i++) {
            if (!ct_dict_set_str(e, d.u.d, a->kn[i], a->kv[i])) {
                return ct_oom(e);
            }
        }
        *out = d;
        return KR_OK;
    }
    case B_CYCLE:
        if (a->n == 0) {
            return ct_rt_err(e, "no items for cycling given");
        }
        *out = a->pos[ct_inum(self) % (int64_t)a->n];
        return KR_OK;
    case M_STRIP:
    case M_LSTRIP:
    case M_RSTRIP: {
        const struct jstr *chars = x && x->t == V_STR ? x->u.s : NULL;
        *out = ct_py_strip(e, self.u.s, chars, f->b != M_RSTRIP, f->b != M_LSTRIP);
        return out->t == V_STR ? KR_OK : ct_oom(e);
    }
    case M_SPLIT:
    case M_RSPLIT: {
        struct value *sep = arg(a, 0, "sep"), *mx = arg(a, 1, "maxsplit");
        return split_str(e, self.u.s, sep, mx ? ct_inum(*mx) : -1, f->b == M_RSPLIT, out);
    }
    case M_STARTSWITH:
    case M_ENDSWITH: {
        struct list one = {1, 1, x};
        if (!x || (x->t != V_STR && x->t != V_TUPLE)) {
            return ct_rt_err(e, "%s arg must be str or a tuple of str", f->name);
        }
        struct list *cands = x->t == V_TUPLE ? x->u.l : &one;
        bool r = false;
        for (size_t i = 0; i < cands->n && !r; i++) {
            const struct jstr *p = cands->v[i].t == V_STR ? cands->v[i].u.s : NULL;
            if (!p) {
                return ct_rt_err(e, "%s arg must be str or a tuple of str", f->name);
            }
            if (!ct_charge(e, ct_bytes_steps(p->len))) {
                return e->fault;
            }
            r = p->len <= self.u.s->len &&
                memcmp(self.u.s->s + (f->b == M_STARTSWITH ? 0 : self.u.s->len - p->len), p->s, p->len) == 0;
        }
        *out = v_bool(r);
        return KR_OK;
    }
    case M_UPPER: *out = ct_map_case(e, self.u.s, 1); return KR_OK;
    case M_LOWER: *out = ct_map_case(e, self.u.s, 0); return KR_OK;
    case M_TITLE: *out = ct_map_case(e, self.u.s, 2); return KR_OK;
    case M_CAPITALIZE: *out = ct_map_case(e, self.u.s, 3); return KR_OK;
    case M_REPLACE:
        if ((st = need_str(e, x, "replace's old")) != KR_OK || (st = need_str(e, y, "replace's new")) != KR_OK) {
            return st;
        }
        *out = ct_str_replace(e, self.u.s, x->u.s, y->u.s, a->n > 2 ? ct_inum(a->pos[2]) : -1);
        return KR_OK;
    case M_FIND:
    case M_RFIND:
    case M_COUNT: {
        if ((st = need_str(e, x, f->name)) != KR_OK) {
            return st;
        }
        if (f->b == M_COUNT) {
            int64_t c = 0;
            if (!ct_charge(e, ct_bytes_steps(self.u.s->len))) {
                return e->fault;
            }
            if (x->u.s->len == 0) {
                c = (int64_t)ct_u8_count(self.u.s->s, self.u.s->len) + 1;
            } else {
                /* non-overlapping hits: memmem's linear time, where comparing at every byte was not */
                const char *h = self.u.s->s, *end = h + self.u.s->len, *hit;
                while ((hit = memmem(h, (size_t)(end - h), x->u.s->s, x->u.s->len)) != NULL) {
                    c++;
                    h = hit + x->u.s->len;
                }
            }
            *out = v_int(c);
            return KR_OK;
        }
        const char *h = ct_memfind(e, self.u.s->s, self.u.s->len, x->u.s->s, x->u.s->len, f->b == M_RFIND);
        *out = v_int(h ? (int64_t)ct_u8_count(self.u.s->s, (size_t)(h - self.u.s->s)) : -1);
        return e->fault;
    }
    case M_JOIN: {
        struct list *items;
        if (!x || (st = ct_iter_list(e, *x, &items)) != KR_OK) {
            return x ? st : ct_rt_err(e, "join() takes exactly one argument");
        }
        struct kr_buf_s b = CT_BUF;
        for (size_t i = 0; i < items->n; i++) {
            if (items->v[i].t != V_STR) {
                kr_bs_free(&b);
                return ct_rt_err(e, "sequence item %zu: expected str instance, %s found", i, ct_type_name(items->v[i]));
            }
            if (!ct_charge(e, ct_bytes_steps(self.u.s->len + items->v[i].u.s->len))) {
                break;
            }
            if (i) {
                kr_bs_append(&b, self.u.s->s, self.u.s->len);
            }
            kr_bs_append(&b, items->v[i].u.s->s, items->v[i].u.s->len);
        }
        *out = ct_mk_str_buf(e, &b);
        kr_bs_free(&b);
        return e->fault ? e->fault : out->t == V_STR ? KR_OK : ct_oom(e);
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
        struct value l = ct_mk_list(e, V_LIST, self.u.d->n);
        if (l.t == V_UNDEF) {
            return ct_oom(e);
        }
        for (size_t i = 0; i < self.u.d->n; i++) {
            if (f->b == M_ITEMS) {
                struct value t = ct_mk_list(e, V_TUPLE, 2);
                if (t.t == V_UNDEF) {
                    return ct_oom(e);
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
        struct value *v = x ? ct_dict_find(self.u.d, *x) : NULL;
        *out = v ? *v : y ? *y : v_none();
        return KR_OK;
    }
    case M_INDEX:
    case M_LCOUNT: {
        int64_t c = 0, first = -1;
        for (size_t i = 0; x && i < self.u.l->n && !e->fault; i++) {
            if (ct_v_eq(e, self.u.l->v[i], *x)) {
                c++;
                first = first < 0 ? (int64_t)i : first;
            }
        }
        if (f->b == M_INDEX && first < 0) {
            return ct_rt_err(e, "value is not in list");
        }
        *out = v_int(f->b == M_INDEX ? first : c);
        return KR_OK;
    }
    case M_UNSAFE:
        return ct_rt_err(e, "access to attribute '%s' of '%s' object is unsafe", f->name, ct_type_name(self));
    }
    return KR_ERR_INTERNAL;
}

/* ---- filters and tests ------------------------------------------------------------------------------------ */

/* The key jinja's sort, unique, min and max compare: strings lowered unless case_sensitive. */
static enum kr_status sort_key(struct ev *e, struct value v, bool ci, struct value *out)
{
    *out = v;
    if (ci && v.t == V_STR) {
        *out = ct_map_case(e, v.u.s, 0);
        if (out->t != V_STR) {
            return e->fault ? e->fault : ct_oom(e);
        }
    }
    return KR_OK;
}

struct sort_item {
    struct value key, val;
};

/* A stable merge sort (Python's sort is stable; reverse keeps equal items in their order), a step a
 * comparison: the insertion sort it replaces took n^2 / 4 steps uncharged. */
static enum kr_status sort_items(struct ev *e, struct sort_item *it, size_t n, bool desc)
{
    struct sort_item *tmp = n > 1 ? ct_a_alloc(&e->arena, n * sizeof(*tmp)) : NULL;
    if (n > 1 && !tmp) {
        return ct_oom(e);
    }
    for (size_t w = 1; w < n; w *= 2) {
        for (size_t lo = 0; lo < n - w; lo += 2 * w) {
            size_t mid = lo + w, hi = mid + w < n ? mid + w : n, i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                int c;
                if (!ct_charge(e, 1) || !ct_v_cmp(e, it[i].key, it[j].key, &c)) {
                    return e->fault ? e->fault : KR_ERR_INVAL;
                }
                tmp[k++] = (desc ? c >= 0 : c <= 0) ? it[i++] : it[j++];
            }
            while (i < mid) {
                tmp[k++] = it[i++];
            }
            while (j < hi) {
                tmp[k++] = it[j++];
            }
            memcpy(it + lo, tmp + lo, (hi - lo) * sizeof(*it));
        }
        if (w > n / 2) {
            break;
        }
    }
    return KR_OK;
}

static enum kr_status attr_path(struct ev *e, struct value v, const struct jstr *path, struct value *out)
{
    *out = v;
    const char *s = path->s;
    while (*s) {
        const char *dot = strchr(s, '.');
        size_t n = dot ? (size_t)(dot - s) : strlen(s);
        char key[256];
        if (n >= sizeof(key)) {
            return ct_rt_err(e, "attribute name too long");
        }
        memcpy(key, s, n);
        key[n] = '\0';
        struct value k = ct_mk_str(e, key, n);
        bool digits = n > 0 && strspn(key, "0123456789") == n;
        enum kr_status st = ct_get_item(e, *out, digits ? v_int(atoll(key)) : k, out);
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

enum kr_status ct_apply_filter(struct ev *e, const char *name, struct value v, const struct args *a,
                               struct value *out)
{
    struct value *x = arg(a, 0, NULL);
    enum kr_status st = KR_OK;
    struct list *items;
    *out = v_undef();
    if (strcmp(name, "trim") == 0 || strcmp(name, "string") == 0 || strcmp(name, "upper") == 0 ||
        strcmp(name, "lower") == 0 || strcmp(name, "title") == 0 || strcmp(name, "capitalize") == 0 ||
        strcmp(name, "safe") == 0) {
        struct value s = ct_to_str(e, v);
        if (s.t != V_STR) {
            return ct_oom(e);
        }
        switch (name[0]) {
        case 't':
            if (name[1] == 'r') {
                struct value *chars = arg(a, 0, "chars");
                *out = ct_py_strip(e, s.u.s, chars && chars->t == V_STR ? chars->u.s : NULL, true, true);
            } else {
                *out = ct_map_case(e, s.u.s, 2);
            }
            break;
        case 'u': *out = ct_map_case(e, s.u.s, 1); break;
        case 'l': *out = ct_map_case(e, s.u.s, 0); break;
        case 'c': *out = ct_map_case(e, s.u.s, 3); break;
        default: *out = s; break;
        }
        return out->t == V_STR ? KR_OK : ct_oom(e);
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
        o.sort_keys = sk && ct_truthy(*sk);
        struct kr_buf_s b = CT_BUF;
        if ((st = ct_to_json(e, v, &o, 0, &b)) == KR_OK) {
            *out = ct_mk_str_buf(e, &b);
        }
        kr_bs_free(&b);
        return st;
    }
    if (strcmp(name, "length") == 0 || strcmp(name, "count") == 0) {
        if (v.t == V_STR) {
            if (!ct_charge(e, ct_bytes_steps(v.u.s->len))) {
                return e->fault;
            }
            *out = v_int((int64_t)ct_u8_count(v.u.s->s, v.u.s->len));
        } else if (v.t == V_LIST || v.t == V_TUPLE) {
            *out = v_int((int64_t)v.u.l->n);
        } else if (v.t == V_DICT || v.t == V_NS) {
            *out = v_int((int64_t)v.u.d->n);
        } else if (v.t == V_UNDEF) {
            *out = v_int(0);
        } else {
            return ct_rt_err(e, "object of type '%s' has no len()", ct_type_name(v));
        }
        return KR_OK;
    }
    if (strcmp(name, "default") == 0 || strcmp(name, "d") == 0) {
        struct value *bo = arg(a, 1, "boolean");
        bool use_default = v.t == V_UNDEF || (bo && ct_truthy(*bo) && !ct_truthy(v));
        struct value *dv = arg(a, 0, "default_value");
        *out = use_default ? (dv ? *dv : ct_mk_str(e, "", 0)) : v;
        return KR_OK;
    }
    if (strcmp(name, "items") == 0) {
        if (v.t == V_UNDEF) {
            *out = ct_mk_list(e, V_LIST, 1);
            return KR_OK;
        }
        if (v.t != V_DICT && v.t != V_NS) {
            return ct_rt_err(e, "can only get item pairs from a mapping");
        }
        struct func f = {M_ITEMS, v, NULL, "items"};
        return ct_call_func(e, &f, a, out);
    }
    if (strcmp(name, "e") == 0 || strcmp(name, "escape") == 0 || strcmp(name, "forceescape") == 0) {
        struct value s = ct_to_str(e, v);
        if (s.t == V_STR && !ct_charge(e, ct_bytes_steps(s.u.s->len))) {
            return e->fault;
        }
        struct kr_buf_s b = CT_BUF;
        for (size_t i = 0; s.t == V_STR && i < s.u.s->len; i++) {
            char c = s.u.s->s[i];
            const char *r = c == '&' ? "&amp;" : c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '"' ? "&#34;" : c == '\'' ? "&#39;" : NULL;
            if (r) {
                kr_bs_append(&b, r, strlen(r));
            } else {
                kr_bs_putc(&b, c);
            }
        }
        *out = ct_mk_str_buf(e, &b);
        kr_bs_free(&b);
        return KR_OK;
    }
    if (strcmp(name, "abs") == 0) {
        if (!ct_is_num(v)) {
            return ct_rt_err(e, "bad operand type for abs(): '%s'", ct_type_name(v));
        }
        if (v.t != V_FLOAT && ct_inum(v) == INT64_MIN) {
            return ct_rt_err(e, "integer overflow");
        }
        *out = v.t == V_FLOAT ? v_float(fabs(v.u.f)) : v_int(ct_inum(v) < 0 ? -ct_inum(v) : ct_inum(v));
        return KR_OK;
    }
    if (strcmp(name, "int") == 0 || strcmp(name, "float") == 0) {
        bool to_int = name[0] == 'i';
        struct value *def = arg(a, 0, "default");
        double f = 0;
        bool ok = true;
        if (ct_is_num(v)) {
            f = ct_num(v);
            if (to_int && v.t != V_FLOAT) {
                *out = v_int(ct_inum(v));
                return KR_OK;
            }
        } else if (v.t == V_STR) {
            char *end;
            f = strtod(v.u.s->s, &end);
            /* all of it (a NUL inside is not the end), and no hex float: Python reads neither */
            ok = end != v.u.s->s && end == v.u.s->s + v.u.s->len && !memchr(v.u.s->s, 'x', v.u.s->len) &&
                 !memchr(v.u.s->s, 'X', v.u.s->len);
        } else {
            ok = false;
        }
        if (!ok) {
            *out = def ? *def : to_int ? v_int(0) : v_float(0.0);
        } else {
            *out = to_int ? v_int(ct_f2i(f)) : v_float(f); /* saturated: the cast is undefined past int64 */
        }
        return KR_OK;
    }
    if (strcmp(name, "round") == 0) {
        struct value *pr = arg(a, 0, "precision"), *me = arg(a, 1, "method");
        if (!ct_is_num(v)) {
            return ct_rt_err(e, "type %s doesn't define __round__ method", ct_type_name(v));
        }
        int64_t p = pr ? ct_inum(*pr) : 0;
        const char *method = me && me->t == V_STR ? me->u.s->s : "common";
        bool common = strcmp(method, "floor") != 0 && strcmp(method, "ceil") != 0;
        if (common && v.t != V_FLOAT && p >= 0) {
            *out = v_int(ct_inum(v)); /* Python's round(int, n) is that int */
            return KR_OK;
        }
        p = p < -400 ? -400 : p > 400 ? 400 : p; /* past a double's range either way */
        double m = pow(10.0, (double)p), f = ct_num(v), r;
        if (!isfinite(f) || !isfinite(f * m) || m == 0.0) {
            r = m == 0.0 ? 0.0 * f : f;
        } else {
            double fm = f * m;
            /* common: round half to even, as Python's round */
            fm = strcmp(method, "floor") == 0 ? floor(fm) : strcmp(method, "ceil") == 0 ? ceil(fm) : nearbyint(fm);
            r = fm / m;
        }
        *out = v_float(r);
        return KR_OK;
    }
    if (strcmp(name, "indent") == 0) {
        struct value s = ct_to_str(e, v);
        if (s.t != V_STR) {
            return e->fault ? e->fault : ct_oom(e);
        }
        struct value *w = arg(a, 0, "width"), *first = arg(a, 1, "first"), *blank = arg(a, 2, "blank");
        char pad[128] = "    ";
        if (w && w->t == V_STR) {
            snprintf(pad, sizeof(pad), "%s", w->u.s->s);
        } else if (w) {
            int64_t k = ct_inum(*w) < 0 ? 0 : ct_inum(*w) > 120 ? 120 : ct_inum(*w);
            memset(pad, ' ', (size_t)k);
            pad[k] = '\0';
        }
        struct kr_buf_s b = CT_BUF;
        size_t i = 0, line = 0;
        while (i <= s.u.s->len) {
            const char *nl = memchr(s.u.s->s + i, '\n', s.u.s->len - i);
            size_t end = nl ? (size_t)(nl - s.u.s->s) : s.u.s->len;
            bool empty = end == i;
            if ((line > 0 || (first && ct_truthy(*first))) && (!empty || (blank && ct_truthy(*blank)))) {
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
        *out = ct_mk_str_buf(e, &b);
        kr_bs_free(&b);
        return KR_OK;
    }
    if (strcmp(name, "replace") == 0) {
        struct value s = ct_to_str(e, v), *y = arg(a, 1, NULL), *c = arg(a, 2, "count");
        if (s.t != V_STR) {
            return e->fault ? e->fault : ct_oom(e);
        }
        if ((st = need_str(e, x, "replace's old")) != KR_OK || (st = need_str(e, y, "replace's new")) != KR_OK) {
            return st;
        }
        *out = ct_str_replace(e, s.u.s, x->u.s, y->u.s, c && c->t != V_NONE ? ct_inum(*c) : -1);
        return KR_OK;
    }
    if (strcmp(name, "wordcount") == 0) {
        struct value s = ct_to_str(e, v), words;
        if (s.t != V_STR) {
            return e->fault ? e->fault : ct_oom(e);
        }
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
        if ((st = ct_get_attr(e, v, x->u.s->s, out)) == KR_OK && out->t != V_FUNC) {
            *out = v_undef();
        }
        return st;
    }
    /* the rest work on sequences */
    if ((st = ct_iter_list(e, v, &items)) != KR_OK) {
        return st;
    }
    if (strcmp(name, "first") == 0 || strcmp(name, "last") == 0) {
        *out = items->n ? items->v[name[0] == 'f' ? 0 : items->n - 1] : v_undef();
        return KR_OK;
    }
    if (strcmp(name, "join") == 0) {
        struct value *attr = arg(a, 1, "attribute");
        struct kr_buf_s b = CT_BUF;
        for (size_t i = 0; i < items->n && st == KR_OK; i++) {
            struct value it = items->v[i];
            if (attr && attr->t == V_STR) {
                st = attr_path(e, it, attr->u.s, &it);
            }
            if (i && x && x->t == V_STR) {
                if (!ct_charge(e, ct_bytes_steps(x->u.s->len))) {
                    break;
                }
                kr_bs_append(&b, x->u.s->s, x->u.s->len);
            }
            ct_py_str(e, it, &b, false); /* charged by its bytes */
        }
        if (st == KR_OK) {
            *out = ct_mk_str_buf(e, &b);
            st = e->fault ? e->fault : out->t == V_STR ? KR_OK : ct_oom(e);
        }
        kr_bs_free(&b);
        return st;
    }
    struct value l = ct_mk_list(e, V_LIST, items->n + 1);
    if (l.t == V_UNDEF) {
        return ct_oom(e);
    }
    if (!ct_charge(e, items->n)) { /* each filter below looks at each item at least once */
        return e->fault;
    }
    if (strcmp(name, "list") == 0) {
        if (items->n) { /* an empty list's items may be NULL */
            memcpy(l.u.l->v, items->v, items->n * sizeof(*items->v));
        }
        l.u.l->n = items->n;
        *out = l;
        return KR_OK;
    }
    if (strcmp(name, "reverse") == 0) {
        if (v.t == V_STR) {
            struct kr_buf_s b = CT_BUF;
            for (size_t i = items->n; i-- > 0;) {
                kr_bs_append(&b, items->v[i].u.s->s, items->v[i].u.s->len);
            }
            *out = ct_mk_str_buf(e, &b);
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
                st = ct_arith(e, OP_ADD, acc, it, &acc);
                continue;
            }
            struct value *cs = arg(a, 0, "case_sensitive");
            struct value ik, ak;
            int c = 0;
            if ((st = sort_key(e, it, !(cs && ct_truthy(*cs)), &ik)) != KR_OK) {
                break;
            }
            if (acc.t != V_UNDEF && ((st = sort_key(e, acc, !(cs && ct_truthy(*cs)), &ak)) != KR_OK ||
                                     (!ct_v_cmp(e, ik, ak, &c) && (st = e->fault ? e->fault : KR_ERR_INVAL)))) {
                break;
            }
            if (acc.t == V_UNDEF || (name[1] == 'a' ? c > 0 : c < 0)) {
                acc = it;
            }
        }
        *out = acc;
        return st;
    }
    if (strcmp(name, "unique") == 0) {
        /* the keys seen so far in a dict: comparing each item with every kept one was quadratic */
        struct value *cs = arg(a, 0, "case_sensitive"), *attr = arg(a, 1, "attribute");
        struct value seen = ct_mk_dict(e, V_DICT);
        if (seen.t == V_UNDEF) {
            return ct_oom(e);
        }
        for (size_t i = 0; i < items->n; i++) {
            struct value k = items->v[i];
            if ((attr && attr->t == V_STR && (st = attr_path(e, k, attr->u.s, &k)) != KR_OK) ||
                (st = sort_key(e, k, !(cs && ct_truthy(*cs)), &k)) != KR_OK) {
                return st;
            }
            if (!ct_charge(e, k.t == V_STR ? ct_bytes_steps(k.u.s->len) : 1)) {
                return e->fault;
            }
            if (ct_dict_find(seen.u.d, k)) {
                continue;
            }
            if (!ct_dict_set(e, seen.u.d, k, v_none())) {
                return ct_oom(e);
            }
            l.u.l->v[l.u.l->n++] = items->v[i];
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
                return ct_rt_err(e, "dictsort needs a mapping");
            }
            struct func f = {M_ITEMS, v, NULL, "items"};
            struct args none = {0};
            struct value its;
            if ((st = ct_call_func(e, &f, &none, &its)) != KR_OK) {
                return st;
            }
            items = its.u.l;
        }
        bool ci = !(cs && ct_truthy(*cs)), desc = rev && ct_truthy(*rev);
        int kidx = by && by->t == V_STR && strcmp(by->u.s->s, "value") == 0 ? 1 : 0;
        struct sort_item *it = ct_a_alloc(&e->arena, (items->n + 1) * sizeof(*it));
        if (!it) {
            return ct_oom(e);
        }
        /* each key once: lowering strings at every comparison allocated n log n copies */
        for (size_t i = 0; i < items->n; i++) {
            struct value k = dsort ? items->v[i].u.l->v[kidx] : items->v[i];
            if (attr && attr->t == V_STR && (st = attr_path(e, items->v[i], attr->u.s, &k)) != KR_OK) {
                return st;
            }
            if ((st = sort_key(e, k, ci, &it[i].key)) != KR_OK) {
                return st;
            }
            it[i].val = items->v[i];
        }
        if ((st = sort_items(e, it, items->n, desc)) != KR_OK) {
            return st;
        }
        for (size_t i = 0; i < items->n; i++) {
            l.u.l->v[i] = it[i].val;
        }
        l.u.l->n = items->n;
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
            return ct_rt_err(e, "%s: the test name must be a string", name);
        }
        for (size_t i = 0; i < items->n; i++) {
            struct value it = items->v[i];
            if (by_attr && (st = attr_path(e, it, x->u.s, &it)) != KR_OK) {
                return st;
            }
            bool r = ct_truthy(it);
            if (test && (st = ct_apply_test(e, test->u.s->s, it, &targs, &r)) != KR_OK) {
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
                if (!ct_in_list(ct_FILTERS, x->u.s->s)) {
                    return ct_rt_err(e, "no filter named '%s'", x->u.s->s);
                }
                st = ct_apply_filter(e, x->u.s->s, items->v[i], &fa, &it);
            } else {
                return ct_rt_err(e, "map needs a filter name or attribute=");
            }
            if (st != KR_OK) {
                return st;
            }
            l.u.l->v[l.u.l->n++] = it;
        }
        *out = l;
        return KR_OK;
    }
    return ct_rt_err(e, "filter '%s' is not implemented", name);
}

enum kr_status ct_apply_test(struct ev *e, const char *name, struct value v, const struct args *a, bool *res)
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
    if (strcmp(name, "number") == 0) { *res = ct_is_num(v); return KR_OK; }
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
            return ct_rt_err(e, "test '%s' needs an integer", name);
        }
        int64_t d = name[0] == 'd' ? (x ? ct_inum(*x) : 0) : 2;
        if (d == 0) {
            return ct_rt_err(e, "integer division or modulo by zero");
        }
        /* Python's modulo, without C's overflow at INT64_MIN % -1 or m + d */
        int64_t m = d == -1 ? 0 : ct_inum(v) % d;
        if (m != 0 && ((m < 0) != (d < 0))) {
            m += d;
        }
        *res = name[0] == 'o' ? m == 1 : m == 0;
        return KR_OK;
    }
    if (!x) {
        return ct_rt_err(e, "test '%s' needs an argument", name);
    }
    if (strcmp(name, "sameas") == 0) {
        *res = v.t == x->t && (v.t == V_NONE || v.t == V_UNDEF || (v.t == V_BOOL && v.u.b == x->u.b) || ct_v_eq(e, v, *x));
        return KR_OK;
    }
    if (strcmp(name, "in") == 0) {
        return ct_contains(e, *x, v, res);
    }
    if (strcmp(name, "eq") == 0 || strcmp(name, "equalto") == 0 || strcmp(name, "==") == 0) {
        *res = ct_v_eq(e, v, *x);
        return e->fault;
    }
    if (strcmp(name, "ne") == 0 || strcmp(name, "!=") == 0) {
        *res = !ct_v_eq(e, v, *x);
        return e->fault;
    }
    if (!ct_v_cmp(e, v, *x, &c)) {
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
