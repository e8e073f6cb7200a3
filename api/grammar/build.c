/* Building grammars: the expression arena and constructors, UTF-8 compilation of code-point
 * classes, lowering of expressions to the compiled form (rules of alternatives of byte-set and
 * rule-reference elements), the compile-time checks (left recursion, a root that matches nothing)
 * and the GBNF dump. */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"
#include "utf8.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena and builder ------------------------------------------------------------------------- */

struct gb_arena {
    struct gb_arena *next;
    size_t used, cap;
    _Alignas(16) char data[];
};

void *gb_alloc(struct gb *b, size_t n)
{
    if (b->st != KR_OK) {
        return NULL;
    }
    n = (n + 15) & ~(size_t)15;
    struct gb_arena *a = b->arena;
    if (!a || a->cap - a->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        a = kr_malloc(sizeof(*a) + cap);
        if (!a) {
            gb_fail(b, KR_ERR_NOMEM, "grammar: out of memory");
            return NULL;
        }
        a->next = b->arena;
        a->used = 0;
        a->cap = cap;
        b->arena = a;
    }
    void *p = a->data + a->used;
    a->used += n;
    return p;
}

char *gb_strndup(struct gb *b, const char *s, size_t n)
{
    char *p = gb_alloc(b, n + 1);
    if (p) {
        memcpy(p, s, n);
        p[n] = '\0';
    }
    return p;
}

void gb_init(struct gb *b, struct kr_err *err)
{
    memset(b, 0, sizeof(*b));
    b->err = err;
}

void gb_free(struct gb *b)
{
    for (struct gb_arena *a = b->arena, *next; a; a = next) {
        next = a->next;
        kr_free(a);
    }
    kr_free(b->rules);
    b->arena = NULL;
    b->rules = NULL;
}

enum kr_status gb_fail(struct gb *b, enum kr_status st, const char *fmt, ...)
{
    if (b->st != KR_OK) {
        return b->st;
    }
    b->st = st;
    if (b->err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(b->err->msg, sizeof(b->err->msg), fmt, ap);
        va_end(ap);
    }
    return st;
}

int32_t gb_rule_new(struct gb *b, const char *name)
{
    if (b->st != KR_OK) {
        return -1;
    }
    if ((uint32_t)b->n_rules >= GB_MAX_RULES) {
        gb_fail(b, KR_ERR_INVAL, "grammar: more than %u rules", GB_MAX_RULES);
        return -1;
    }
    if (b->n_rules == b->cap_rules) {
        int32_t cap = b->cap_rules ? b->cap_rules * 2 : 64;
        struct gb_rule *v = kr_realloc(b->rules, (size_t)cap * sizeof(*v));
        if (!v) {
            gb_fail(b, KR_ERR_NOMEM, "grammar: out of memory");
            return -1;
        }
        b->rules = v;
        b->cap_rules = cap;
    }
    char *copy = gb_strndup(b, name, strlen(name));
    if (!copy) {
        return -1;
    }
    int32_t id = b->n_rules++;
    b->rules[id] = (struct gb_rule){.name = copy, .origin = id};
    return id;
}

int32_t gb_rule_find(const struct gb *b, const char *name, size_t len)
{
    for (int32_t i = 0; i < b->n_rules; i++) {
        if (strlen(b->rules[i].name) == len && memcmp(b->rules[i].name, name, len) == 0) {
            return i;
        }
    }
    return -1;
}

void gb_rule_set(struct gb *b, int32_t r, struct gx *body)
{
    if (r >= 0 && body) {
        b->rules[r].body = body;
    }
}

/* ---- expressions ------------------------------------------------------------------------------- */

static struct gx *gx_new(struct gb *b, enum gx_kind kind)
{
    struct gx *x = gb_alloc(b, sizeof(*x));
    if (x) {
        memset(x, 0, sizeof(*x));
        x->kind = kind;
        x->helper = -1;
        x->star = -1;
    }
    return x;
}

struct gx *gx_empty(struct gb *b)
{
    return gx_new(b, GX_EMPTY);
}

struct gx *gx_lit(struct gb *b, const char *s, size_t n)
{
    if (n == 0) {
        return gx_empty(b);
    }
    char *copy = gb_strndup(b, s, n);
    struct gx *x = copy ? gx_new(b, GX_LIT) : NULL;
    if (x) {
        x->lit.s = copy;
        x->lit.n = n;
    }
    return x;
}

struct gx *gx_str(struct gb *b, const char *s)
{
    return gx_lit(b, s, strlen(s));
}

struct gx *gx_char(struct gb *b, uint32_t cp)
{
    uint32_t r[2] = {cp, cp};
    return gx_class(b, r, 1, false);
}

static int cmp_range(const void *a, const void *b)
{
    uint32_t x = ((const uint32_t *)a)[0], y = ((const uint32_t *)b)[0];
    return x < y ? -1 : x > y;
}

size_t gx_ranges_normalize(uint32_t *r, size_t n)
{
    qsort(r, n, 2 * sizeof(uint32_t), cmp_range);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (r[2 * i] > r[2 * i + 1]) {
            continue;
        }
        if (k > 0 && r[2 * i] <= r[2 * (k - 1) + 1] + 1) {
            if (r[2 * i + 1] > r[2 * (k - 1) + 1]) {
                r[2 * (k - 1) + 1] = r[2 * i + 1];
            }
            continue;
        }
        r[2 * k] = r[2 * i];
        r[2 * k + 1] = r[2 * i + 1];
        k++;
    }
    return k;
}

#define CP_MAX 0x10FFFFu

struct gx *gx_class(struct gb *b, const uint32_t *ranges, size_t n, bool negate)
{
    /* room for the ranges, their complement (n + 1) and the surrogate split (one more each) */
    uint32_t *r = gb_alloc(b, (2 * n + 4) * 2 * sizeof(uint32_t));
    if (!r) {
        return NULL;
    }
    if (n) {
        memcpy(r, ranges, n * 2 * sizeof(uint32_t));
    }
    for (size_t i = 0; i < 2 * n; i++) {
        r[i] = r[i] > CP_MAX ? CP_MAX : r[i];
    }
    n = gx_ranges_normalize(r, n);
    if (negate) {
        uint32_t *c = r + 2 * n;
        size_t k = 0;
        uint32_t next = 0;
        for (size_t i = 0; i < n; i++) {
            if (r[2 * i] > next) {
                c[2 * k] = next;
                c[2 * k + 1] = r[2 * i] - 1;
                k++;
            }
            next = r[2 * i + 1] + 1;
        }
        if (next <= CP_MAX) {
            c[2 * k] = next;
            c[2 * k + 1] = CP_MAX;
            k++;
        }
        memmove(r, c, k * 2 * sizeof(uint32_t));
        n = k;
    }
    /* take the surrogates out: they are not characters and have no UTF-8 form */
    size_t k = 0;
    uint32_t *o = r + 2 * (n + 1);
    memmove(o, r, n * 2 * sizeof(uint32_t));
    for (size_t i = 0; i < n; i++) {
        uint32_t lo = o[2 * i], hi = o[2 * i + 1];
        if (lo < 0xD800) {
            r[2 * k] = lo;
            r[2 * k + 1] = hi < 0xD7FF ? hi : 0xD7FF;
            k++;
        }
        if (hi > 0xDFFF) {
            r[2 * k] = lo > 0xE000 ? lo : 0xE000;
            r[2 * k + 1] = hi;
            k++;
        }
    }
    struct gx *x = gx_new(b, GX_CLASS);
    if (x) {
        x->cls.r = r;
        x->cls.n = k;
    }
    return x;
}

struct gx *gx_ref(struct gb *b, int32_t rule)
{
    if (rule < 0) {
        return NULL;
    }
    struct gx *x = gx_new(b, GX_REF);
    if (x) {
        x->ref.rule = rule;
    }
    return x;
}

struct gx *gx_list(struct gb *b, enum gx_kind kind)
{
    return gx_new(b, kind);
}

struct gx *gx_add(struct gb *b, struct gx *list, struct gx *x)
{
    if (!list || !x) {
        return NULL;
    }
    if (list->list.n == list->list.cap) {
        size_t cap = list->list.cap ? list->list.cap * 2 : 4;
        struct gx **v = gb_alloc(b, cap * sizeof(*v));
        if (!v) {
            return NULL;
        }
        if (list->list.n) {
            memcpy(v, list->list.v, list->list.n * sizeof(*v));
        }
        list->list.v = v;
        list->list.cap = cap;
    }
    list->list.v[list->list.n++] = x;
    return list;
}

struct gx *gx_listv(struct gb *b, enum gx_kind kind, struct gx *const *v, size_t n)
{
    struct gx *l = gx_list(b, kind);
    for (size_t i = 0; i < n; i++) {
        l = gx_add(b, l, v[i]);
    }
    return l;
}

struct gx *gx_rep(struct gb *b, struct gx *x, int32_t min, int32_t max)
{
    if (!x) {
        return NULL;
    }
    if (min < 0 || min > GB_MAX_REPEAT || max > GB_MAX_REPEAT || (max >= 0 && max < min)) {
        gb_fail(b, KR_ERR_INVAL, "grammar: repetition {%d,%d} out of range (at most %d)", min, max, GB_MAX_REPEAT);
        return NULL;
    }
    struct gx *r = gx_new(b, GX_REP);
    if (r) {
        r->rep.x = x;
        r->rep.min = min;
        r->rep.max = max;
    }
    return r;
}

/* ---- UTF-8 classes ------------------------------------------------------------------------------ */

/* A class becomes alternatives of byte-set sequences (at most 4 sets each). */
struct bseq {
    uint8_t len;
    uint8_t set[4][32];
};

struct bseqs {
    struct bseq *v;
    size_t n, cap;
};

static void set_range(uint8_t set[32], unsigned lo, unsigned hi)
{
    for (unsigned c = lo; c <= hi; c++) {
        set[c >> 3] |= (uint8_t)(1u << (c & 7));
    }
}

static bool bseqs_push(struct bseqs *s, const uint8_t *lo, const uint8_t *hi, size_t len)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 16;
        struct bseq *v = kr_realloc(s->v, cap * sizeof(*v));
        if (!v) {
            return false;
        }
        s->v = v;
        s->cap = cap;
    }
    struct bseq *q = &s->v[s->n++];
    memset(q, 0, sizeof(*q));
    q->len = (uint8_t)len;
    for (size_t i = 0; i < len; i++) {
        set_range(q->set[i], lo[i], hi[i]);
    }
    return true;
}

/* Splits [lo, hi] (no surrogates inside) until each piece encodes as one sequence of byte ranges:
 * same encoded length, and for each continuation byte either the full 80..BF range or equal
 * prefixes. */
static bool utf8_split(struct bseqs *s, uint32_t lo, uint32_t hi)
{
    static const uint32_t len_max[] = {0x7F, 0x7FF, 0xFFFF};
    if (lo > hi) {
        return true;
    }
    for (int i = 0; i < 3; i++) {
        if (lo <= len_max[i] && hi > len_max[i]) {
            return utf8_split(s, lo, len_max[i]) && utf8_split(s, len_max[i] + 1, hi);
        }
    }
    if (hi < 0x80) {
        uint8_t a = (uint8_t)lo, z = (uint8_t)hi;
        return bseqs_push(s, &a, &z, 1);
    }
    for (int i = 1; i < 4; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                return utf8_split(s, lo, lo | m) && utf8_split(s, (lo | m) + 1, hi);
            }
            if ((hi & m) != m) {
                return utf8_split(s, lo, (hi & ~m) - 1) && utf8_split(s, hi & ~m, hi);
            }
        }
    }
    char a[4], z[4];
    size_t n = kr_utf8_put(lo, a);
    kr_utf8_put(hi, z);
    return bseqs_push(s, (const uint8_t *)a, (const uint8_t *)z, n);
}

/* Merges sequences that differ in one position only ({a}{x}{c} | {a}{y}{c} = {a}{x,y}{c}). */
static void bseqs_merge(struct bseqs *s)
{
    for (bool again = true; again;) {
        again = false;
        for (size_t i = 0; i < s->n; i++) {
            for (size_t j = i + 1; j < s->n; j++) {
                struct bseq *p = &s->v[i], *q = &s->v[j];
                if (p->len != q->len) {
                    continue;
                }
                int diff = -1, n_diff = 0;
                for (int k = 0; k < p->len; k++) {
                    if (memcmp(p->set[k], q->set[k], 32) != 0) {
                        diff = k;
                        n_diff++;
                    }
                }
                if (n_diff > 1) {
                    continue;
                }
                if (diff >= 0) {
                    for (int w = 0; w < 32; w++) {
                        p->set[diff][w] |= q->set[diff][w];
                    }
                }
                s->v[j] = s->v[--s->n];
                again = true;
                j--;
            }
        }
    }
}

/* ---- lowering ------------------------------------------------------------------------------------ */

struct lower {
    struct gb *b;
    struct gelem *elems;
    uint32_t n_elems, cap_elems;
    uint32_t *alt_start;
    uint32_t n_alts, cap_alts;
    struct grule *rules; /* [b->n_rules] as lowered so far */
    uint32_t cap_rules;
    uint8_t (*sets)[32];
    uint32_t n_sets, cap_sets;
    uint32_t *set_table; /* [set_mask + 1] set index + 1, 0 = empty */
    uint32_t set_mask;
    int32_t cur;         /* the rule being lowered */
    int32_t n_helpers;
    struct bseqs tmp;
    uint32_t *loops;     /* elements that are a repetition's self-reference */
    uint32_t n_loops, cap_loops;
};

static uint32_t set_hash(const uint8_t set[32])
{
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < 32; i++) {
        h = (h ^ set[i]) * 1099511628211ull;
    }
    return (uint32_t)(h ^ (h >> 32));
}

static bool sets_grow_table(struct lower *L)
{
    uint32_t cap = L->set_mask ? (L->set_mask + 1) * 2 : 256;
    uint32_t *t = kr_calloc(cap, sizeof(*t));
    if (!t) {
        return false;
    }
    for (uint32_t i = 0; i < L->n_sets; i++) {
        uint32_t h = set_hash(L->sets[i]) & (cap - 1);
        while (t[h]) {
            h = (h + 1) & (cap - 1);
        }
        t[h] = i + 1;
    }
    kr_free(L->set_table);
    L->set_table = t;
    L->set_mask = cap - 1;
    return true;
}

/* The index of byte set `set`, added when new; UINT32_MAX when out of memory. */
static uint32_t set_intern(struct lower *L, const uint8_t set[32])
{
    if ((L->n_sets + 1) * 2 > L->set_mask + 1 && !sets_grow_table(L)) {
        return UINT32_MAX;
    }
    uint32_t h = set_hash(set) & L->set_mask;
    for (; L->set_table[h]; h = (h + 1) & L->set_mask) {
        if (memcmp(L->sets[L->set_table[h] - 1], set, 32) == 0) {
            return L->set_table[h] - 1;
        }
    }
    if (L->n_sets == L->cap_sets) {
        uint32_t cap = L->cap_sets ? L->cap_sets * 2 : 64;
        void *v = kr_realloc(L->sets, (size_t)cap * 32);
        if (!v) {
            return UINT32_MAX;
        }
        L->sets = v;
        L->cap_sets = cap;
    }
    memcpy(L->sets[L->n_sets], set, 32);
    L->set_table[h] = L->n_sets + 1;
    return L->n_sets++;
}

static enum kr_status nomem(struct lower *L)
{
    return gb_fail(L->b, KR_ERR_NOMEM, "grammar: out of memory");
}

static enum kr_status push_elem(struct lower *L, uint32_t kind, uint32_t arg)
{
    if (L->n_elems >= GB_MAX_ELEMS) {
        return gb_fail(L->b, KR_ERR_INVAL, "grammar: too large (more than %u elements after expanding repetitions)",
                       GB_MAX_ELEMS);
    }
    if (L->n_elems == L->cap_elems) {
        uint32_t cap = L->cap_elems ? L->cap_elems * 2 : 256;
        void *v = kr_realloc(L->elems, (size_t)cap * sizeof(*L->elems));
        if (!v) {
            return nomem(L);
        }
        L->elems = v;
        L->cap_elems = cap;
    }
    L->elems[L->n_elems++] = (struct gelem){.kind = kind, .arg = arg};
    return KR_OK;
}

static enum kr_status push_byte(struct lower *L, uint8_t c)
{
    uint8_t set[32] = {0};
    set[c >> 3] = (uint8_t)(1u << (c & 7));
    uint32_t s = set_intern(L, set);
    return s == UINT32_MAX ? nomem(L) : push_elem(L, GE_BYTES, s);
}

/* The alternatives a class lowers to, as GX_BYTES expressions (cached on the class). */
static struct gx *class_alts(struct lower *L, struct gx *c)
{
    if (c->alts) {
        return c->alts;
    }
    L->tmp.n = 0;
    for (size_t i = 0; i < c->cls.n; i++) {
        if (!utf8_split(&L->tmp, c->cls.r[2 * i], c->cls.r[2 * i + 1])) {
            nomem(L);
            return NULL;
        }
    }
    bseqs_merge(&L->tmp);
    struct gx *alt = gx_list(L->b, GX_ALT);
    for (size_t i = 0; i < L->tmp.n && alt; i++) {
        struct gx *x = gx_new(L->b, GX_BYTES);
        uint32_t *sets = gb_alloc(L->b, L->tmp.v[i].len * sizeof(uint32_t));
        if (!x || !sets) {
            return NULL;
        }
        for (int k = 0; k < L->tmp.v[i].len; k++) {
            if ((sets[k] = set_intern(L, L->tmp.v[i].set[k])) == UINT32_MAX) {
                nomem(L);
                return NULL;
            }
        }
        x->bytes.set = sets;
        x->bytes.n = L->tmp.v[i].len;
        alt = gx_add(L->b, alt, x);
    }
    c->alts = alt;
    return alt;
}

/* Alternatives of x, nested alternations and multi-sequence classes spread out. */
static enum kr_status flatten(struct lower *L, struct gx *x, struct gx *out)
{
    if (x->kind == GX_ALT) {
        for (size_t i = 0; i < x->list.n; i++) {
            KR_TRY(flatten(L, x->list.v[i], out));
        }
        return KR_OK;
    }
    if (x->kind == GX_CLASS) {
        struct gx *alts = class_alts(L, x);
        if (!alts) {
            return L->b->st;
        }
        for (size_t i = 0; i < alts->list.n; i++) {
            if (!gx_add(L->b, out, alts->list.v[i])) {
                return L->b->st;
            }
        }
        return KR_OK;
    }
    return gx_add(L->b, out, x) ? KR_OK : L->b->st;
}

/* A helper rule for expression x, made once per expression and named after the rule it serves. */
static int32_t helper_for(struct lower *L, struct gx *x)
{
    if (x->helper >= 0) {
        return x->helper;
    }
    char name[160];
    int32_t origin = L->b->rules[L->cur].origin;
    snprintf(name, sizeof(name), "%.120s-%d", L->b->rules[origin].name, ++L->n_helpers);
    int32_t r = gb_rule_new(L->b, name);
    if (r >= 0) {
        L->b->rules[r].origin = origin;
        L->b->rules[r].body = x;
        x->helper = r;
    }
    return r;
}

/* Whether x lowers to a few elements without a helper rule (so repeating it inline is cheap). */
static bool is_small_inline(struct lower *L, const struct gx *x, int *budget)
{
    switch (x->kind) {
    case GX_EMPTY:
    case GX_REF:
        return --*budget >= 0;
    case GX_LIT:
        return (*budget -= (int)(x->lit.n < 1000 ? x->lit.n : 1000)) >= 0;
    case GX_BYTES:
        return (*budget -= (int)x->bytes.n) >= 0;
    case GX_CLASS: {
        struct gx *alts = class_alts(L, (struct gx *)x);
        return alts && alts->list.n == 1 && (*budget -= (int)alts->list.v[0]->bytes.n) >= 0;
    }
    case GX_SEQ:
        for (size_t i = 0; i < x->list.n; i++) {
            if (!is_small_inline(L, x->list.v[i], budget)) {
                return false;
            }
        }
        return true;
    default:
        return false;
    }
}

static enum kr_status lower_seq(struct lower *L, struct gx *x);

/* x repeated into a rule R ::= x_1 R | x_2 R | ... | e (each alternative of x followed by R, so
 * the recursion is a tail call and the stack does not grow with the count). */
static int32_t star_rule(struct lower *L, struct gx *x)
{
    if (x->star >= 0) {
        return x->star;
    }
    struct gx *alts = gx_list(L->b, GX_ALT);
    if (!alts || flatten(L, x, alts) != KR_OK) {
        return -1;
    }
    struct gx *body = gx_list(L->b, GX_ALT);
    struct gx *self = gx_new(L->b, GX_REF);
    int32_t r = self ? helper_for(L, body) : -1;
    if (r < 0) {
        return -1;
    }
    self->ref.rule = r;
    self->ref.loop = true;
    for (size_t i = 0; i < alts->list.n; i++) {
        body = gx_add(L->b, body, GX_SEQ(L->b, alts->list.v[i], self));
    }
    if (!gx_add(L->b, body, gx_empty(L->b))) {
        return -1;
    }
    x->star = r;
    return r;
}

/* x{min,max}: min copies, then x* or a chain of max - min optional copies
 * C_k ::= x C_{k-1} | e (tail calls again). */
static enum kr_status lower_rep(struct lower *L, struct gx *x, int32_t min, int32_t max)
{
    int budget = 64;
    bool inline_x = is_small_inline(L, x, &budget);
    KR_TRY(L->b->st);
    struct gx *unit = x;
    if (!inline_x) {
        unit = gx_ref(L->b, helper_for(L, x));
        if (!unit) {
            return L->b->st;
        }
    }
    for (int32_t i = 0; i < min; i++) {
        KR_TRY(lower_seq(L, unit));
    }
    if (max < 0) {
        int32_t r = star_rule(L, x);
        return r < 0 ? L->b->st : push_elem(L, GE_RULE, (uint32_t)r);
    }
    if (max == min) {
        return KR_OK;
    }
    struct gx *alts = gx_list(L->b, GX_ALT);
    KR_TRY(flatten(L, unit, alts));
    struct gx *prev = NULL;
    for (int32_t k = 1; k <= max - min; k++) {
        struct gx *body = gx_list(L->b, GX_ALT);
        int32_t r = helper_for(L, body);
        if (r < 0) {
            return L->b->st;
        }
        for (size_t i = 0; i < alts->list.n; i++) {
            body = gx_add(L->b, body, prev ? GX_SEQ(L->b, alts->list.v[i], prev) : alts->list.v[i]);
        }
        body = gx_add(L->b, body, gx_empty(L->b));
        prev = gx_ref(L->b, r);
        if (!prev) {
            return L->b->st;
        }
    }
    return push_elem(L, GE_RULE, (uint32_t)prev->ref.rule);
}

static enum kr_status lower_seq(struct lower *L, struct gx *x)
{
    switch (x->kind) {
    case GX_EMPTY:
        return KR_OK;
    case GX_LIT:
        for (size_t i = 0; i < x->lit.n; i++) {
            KR_TRY(push_byte(L, (uint8_t)x->lit.s[i]));
        }
        return KR_OK;
    case GX_BYTES:
        for (size_t i = 0; i < x->bytes.n; i++) {
            KR_TRY(push_elem(L, GE_BYTES, x->bytes.set[i]));
        }
        return KR_OK;
    case GX_CLASS: {
        struct gx *alts = class_alts(L, x);
        if (!alts) {
            return L->b->st;
        }
        if (alts->list.n == 1) {
            return lower_seq(L, alts->list.v[0]);
        }
        int32_t r = helper_for(L, x);
        return r < 0 ? L->b->st : push_elem(L, GE_RULE, (uint32_t)r);
    }
    case GX_REF:
        if (x->ref.loop) { /* remembered for the left-recursion check */
            if (L->n_loops == L->cap_loops) {
                uint32_t cap = L->cap_loops ? L->cap_loops * 2 : 64;
                void *v = kr_realloc(L->loops, (size_t)cap * sizeof(uint32_t));
                if (!v) {
                    return nomem(L);
                }
                L->loops = v;
                L->cap_loops = cap;
            }
            L->loops[L->n_loops++] = L->n_elems;
        }
        return push_elem(L, GE_RULE, (uint32_t)x->ref.rule);
    case GX_SEQ:
        for (size_t i = 0; i < x->list.n; i++) {
            KR_TRY(lower_seq(L, x->list.v[i]));
        }
        return KR_OK;
    case GX_ALT: {
        if (x->list.n == 1) {
            return lower_seq(L, x->list.v[0]);
        }
        int32_t r = helper_for(L, x);
        return r < 0 ? L->b->st : push_elem(L, GE_RULE, (uint32_t)r);
    }
    case GX_REP:
        return lower_rep(L, x->rep.x, x->rep.min, x->rep.max);
    }
    return gb_fail(L->b, KR_ERR_INTERNAL, "grammar: unknown expression kind %d", (int)x->kind);
}

static enum kr_status lower_rule(struct lower *L, int32_t r)
{
    struct gx *body = L->b->rules[r].body;
    if (!body) {
        return gb_fail(L->b, KR_ERR_INTERNAL, "grammar: rule '%s' has no body", L->b->rules[r].name);
    }
    struct gx *alts = gx_list(L->b, GX_ALT);
    if (!alts) {
        return L->b->st;
    }
    KR_TRY(flatten(L, body, alts));
    if ((uint32_t)r >= L->cap_rules) {
        uint32_t cap = L->cap_rules ? L->cap_rules * 2 : 64;
        while (cap <= (uint32_t)r) {
            cap *= 2;
        }
        void *v = kr_realloc(L->rules, (size_t)cap * sizeof(*L->rules));
        if (!v) {
            return nomem(L);
        }
        L->rules = v;
        L->cap_rules = cap;
    }
    L->cur = r;
    uint32_t first = L->n_alts;
    for (size_t i = 0; i < alts->list.n; i++) {
        if (L->n_alts == L->cap_alts) {
            uint32_t cap = L->cap_alts ? L->cap_alts * 2 : 256;
            void *v = kr_realloc(L->alt_start, (size_t)cap * sizeof(uint32_t));
            if (!v) {
                return nomem(L);
            }
            L->alt_start = v;
            L->cap_alts = cap;
        }
        L->alt_start[L->n_alts++] = L->n_elems;
        KR_TRY(lower_seq(L, alts->list.v[i]));
        KR_TRY(push_elem(L, GE_END, (uint32_t)r));
    }
    L->rules[r] = (struct grule){.alt0 = first, .n_alts = L->n_alts - first, .origin = L->b->rules[r].origin};
    return KR_OK;
}

/* ---- checks ------------------------------------------------------------------------------------- */

static uint32_t add_sat(uint32_t a, uint32_t b)
{
    return a >= GR_INF - b ? GR_INF : a + b;
}

/* Fewest bytes each rule matches: Knuth's generalization of Dijkstra's algorithm to grammars. An
 * alternative's length becomes known once all the rules it references are final; the smallest
 * tentative rule is then final. */
struct heap {
    uint64_t *v; /* (length << 32) | rule */
    size_t n;
};

static void heap_push(struct heap *h, uint64_t x)
{
    size_t i = h->n++;
    while (i > 0 && h->v[(i - 1) / 2] > x) {
        h->v[i] = h->v[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h->v[i] = x;
}

static uint64_t heap_pop(struct heap *h)
{
    uint64_t top = h->v[0], x = h->v[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n) {
            break;
        }
        if (c + 1 < h->n && h->v[c + 1] < h->v[c]) {
            c++;
        }
        if (h->v[c] >= x) {
            break;
        }
        h->v[i] = h->v[c];
        i = c;
    }
    if (h->n) {
        h->v[i] = x;
    }
    return top;
}

static enum kr_status compute_minlen(struct kr_grammar *g)
{
    enum kr_status st = KR_ERR_NOMEM;
    uint32_t *pending = kr_calloc(g->n_alts, sizeof(uint32_t));
    uint32_t *sum = kr_calloc(g->n_alts, sizeof(uint32_t));
    uint32_t *alt_rule = kr_malloc(((size_t)g->n_alts + 1) * sizeof(uint32_t));
    uint32_t *occ_start = kr_calloc((size_t)g->n_rules + 1, sizeof(uint32_t));
    uint32_t *occ = kr_malloc(((size_t)g->n_elems + 1) * sizeof(uint32_t));
    bool *final = kr_calloc((size_t)g->n_rules + 1, sizeof(bool));
    struct heap h = {kr_malloc(((size_t)g->n_alts + g->n_rules + 1) * sizeof(uint64_t)), 0};
    if (!pending || !sum || !alt_rule || !occ_start || !occ || !final || !h.v) {
        goto out;
    }
    for (uint32_t r = 0; r < g->n_rules; r++) {
        g->minlen[r] = GR_INF;
        for (uint32_t a = g->rules[r].alt0; a < g->rules[r].alt0 + g->rules[r].n_alts; a++) {
            alt_rule[a] = r;
            for (uint32_t i = g->alt_start[a]; g->elems[i].kind != GE_END; i++) {
                if (g->elems[i].kind == GE_RULE) {
                    pending[a]++;
                    occ_start[g->elems[i].arg + 1]++;
                } else {
                    sum[a] = add_sat(sum[a], 1);
                }
            }
        }
    }
    for (uint32_t r = 0; r < g->n_rules; r++) {
        occ_start[r + 1] += occ_start[r];
    }
    for (uint32_t a = 0; a < g->n_alts; a++) {
        for (uint32_t i = g->alt_start[a]; g->elems[i].kind != GE_END; i++) {
            if (g->elems[i].kind == GE_RULE) {
                /* occ_start[r] advances while filling, and is restored below */
                occ[occ_start[g->elems[i].arg]++] = a;
            }
        }
    }
    for (uint32_t r = g->n_rules; r > 0; r--) {
        occ_start[r] = occ_start[r - 1];
    }
    occ_start[0] = 0;
    for (uint32_t a = 0; a < g->n_alts; a++) {
        if (pending[a] == 0) {
            heap_push(&h, (uint64_t)sum[a] << 32 | alt_rule[a]);
        }
    }
    while (h.n) {
        uint64_t top = heap_pop(&h);
        uint32_t r = (uint32_t)top, len = (uint32_t)(top >> 32);
        if (final[r]) {
            continue;
        }
        final[r] = true;
        g->minlen[r] = len;
        for (uint32_t k = occ_start[r]; k < occ_start[r + 1]; k++) {
            uint32_t a = occ[k];
            sum[a] = add_sat(sum[a], len);
            if (--pending[a] == 0 && !final[alt_rule[a]] && sum[a] != GR_INF) {
                heap_push(&h, (uint64_t)sum[a] << 32 | alt_rule[a]);
            }
        }
    }
    for (uint32_t a = 0; a < g->n_alts; a++) {
        uint32_t end = g->alt_start[a];
        while (g->elems[end].kind != GE_END) {
            end++;
        }
        g->minrest[end] = 0;
        for (uint32_t i = end; i-- > g->alt_start[a];) {
            uint32_t l = g->elems[i].kind == GE_RULE ? g->minlen[g->elems[i].arg] : 1;
            g->minrest[i] = add_sat(l, g->minrest[i + 1]);
        }
    }
    st = KR_OK;
out:
    kr_free(pending);
    kr_free(sum);
    kr_free(alt_rule);
    kr_free(occ_start);
    kr_free(occ);
    kr_free(final);
    kr_free(h.v);
    return st;
}

/* Left recursion: a rule that can reach itself through references at the start of alternatives
 * (after elements that may match nothing) would make the matcher's stack grow without consuming
 * input. The one exception is the self-reference a repetition x* lowers to (R ::= x R | e): when x
 * may match nothing, R reaches itself, but through a tail call that replaces its frame, and the
 * matcher's shared stacks stop the cycle. Strongly connected components (Tarjan, iterative) of the
 * "can start with" graph find the cycles. */
struct edge {
    uint32_t to;
    bool loop; /* a repetition's self-reference: it replaces its frame, and shared stacks stop it */
};

struct scc {
    const struct kr_grammar *g;
    uint32_t *edge_start; /* [n_rules + 1] */
    struct edge *edges;
    uint32_t *index, *low, *comp, *stack, *call, *call_edge;
};

static void tarjan(struct scc *s)
{
    uint32_t n = s->g->n_rules, counter = 1, sp = 0, n_comp = 0;
    for (uint32_t root = 0; root < n; root++) {
        if (s->index[root]) {
            continue;
        }
        uint32_t depth = 0;
        s->call[depth] = root;
        s->call_edge[depth] = s->edge_start[root];
        s->index[root] = s->low[root] = counter++;
        s->stack[sp++] = root;
        s->comp[root] = UINT32_MAX;
        for (;;) {
            uint32_t v = s->call[depth];
            if (s->call_edge[depth] < s->edge_start[v + 1]) {
                uint32_t w = s->edges[s->call_edge[depth]++].to;
                if (!s->index[w]) {
                    s->index[w] = s->low[w] = counter++;
                    s->stack[sp++] = w;
                    s->comp[w] = UINT32_MAX;
                    depth++;
                    s->call[depth] = w;
                    s->call_edge[depth] = s->edge_start[w];
                } else if (s->comp[w] == UINT32_MAX && s->index[w] < s->low[v]) {
                    s->low[v] = s->index[w];
                }
                continue;
            }
            if (s->low[v] == s->index[v]) {
                uint32_t w;
                do {
                    w = s->stack[--sp];
                    s->comp[w] = n_comp;
                } while (w != v);
                n_comp++;
            }
            if (depth == 0) {
                break;
            }
            depth--;
            uint32_t u = s->call[depth];
            if (s->low[v] < s->low[u]) {
                s->low[u] = s->low[v];
            }
        }
    }
}

static enum kr_status check_left_recursion(struct gb *b, const struct kr_grammar *g, const struct lower *L)
{
    enum kr_status st = KR_ERR_NOMEM;
    struct scc s = {.g = g};
    uint8_t *loop = kr_calloc((size_t)g->n_elems + 1, 1);
    size_t n = g->n_rules;
    s.edge_start = kr_calloc(n + 1, sizeof(uint32_t));
    s.edges = kr_malloc(((size_t)g->n_elems + 1) * sizeof(struct edge));
    s.index = kr_calloc(n, sizeof(uint32_t));
    s.low = kr_calloc(n, sizeof(uint32_t));
    s.comp = kr_calloc(n, sizeof(uint32_t));
    s.stack = kr_calloc(n, sizeof(uint32_t));
    s.call = kr_calloc(n, sizeof(uint32_t));
    s.call_edge = kr_calloc(n, sizeof(uint32_t));
    if (!loop || !s.edge_start || !s.edges || !s.index || !s.low || !s.comp || !s.stack || !s.call || !s.call_edge) {
        gb_fail(b, st, "grammar: out of memory");
        goto out;
    }
    for (uint32_t i = 0; i < L->n_loops; i++) {
        loop[L->loops[i]] = 1;
    }
    uint32_t n_edges = 0;
    for (uint32_t r = 0; r < g->n_rules; r++) {
        s.edge_start[r] = n_edges;
        for (uint32_t a = g->rules[r].alt0; a < g->rules[r].alt0 + g->rules[r].n_alts; a++) {
            for (uint32_t i = g->alt_start[a]; g->elems[i].kind == GE_RULE; i++) {
                uint32_t to = g->elems[i].arg;
                s.edges[n_edges++] = (struct edge){to, loop[i] && to == r};
                if (g->minlen[to] != 0) {
                    break;
                }
            }
        }
    }
    s.edge_start[n] = n_edges;
    tarjan(&s);
    st = KR_OK;
    for (uint32_t r = 0; r < g->n_rules && st == KR_OK; r++) {
        for (uint32_t e = s.edge_start[r]; e < s.edge_start[r + 1]; e++) {
            uint32_t to = s.edges[e].to;
            if (s.edges[e].loop || s.comp[to] != s.comp[r]) {
                continue;
            }
            const struct gb_rule *o = &b->rules[g->rules[r].origin], *t = &b->rules[g->rules[to].origin];
            char where[64] = "";
            if (o->line > 0) {
                snprintf(where, sizeof(where), "line %d column %d: ", o->line, o->col);
            }
            if (o == t) {
                st = gb_fail(b, KR_ERR_INVAL, "grammar: %srule '%s' is left-recursive: it can reach itself before "
                             "matching any character", where, o->name);
            } else {
                st = gb_fail(b, KR_ERR_INVAL, "grammar: %srule '%s' is left-recursive: it can reach itself through "
                             "rule '%s' before matching any character", where, o->name, t->name);
            }
            break;
        }
    }
out:
    kr_free(loop);
    kr_free(s.edge_start);
    kr_free(s.edges);
    kr_free(s.index);
    kr_free(s.low);
    kr_free(s.comp);
    kr_free(s.stack);
    kr_free(s.call);
    kr_free(s.call_edge);
    return st;
}

/* ---- finish ------------------------------------------------------------------------------------ */

struct kr_grammar *kr_grammar_retain(struct kr_grammar *g)
{
    atomic_fetch_add(&g->refs, 1);
    return g;
}

void kr_grammar_free(struct kr_grammar *g)
{
    if (!g || atomic_fetch_sub(&g->refs, 1) > 1) {
        return;
    }
    kr_free(g->elems);
    kr_free(g->alt_start);
    kr_free(g->rules);
    kr_free(g->sets);
    kr_free(g->names);
    kr_free(g->minlen);
    kr_free(g->minrest);
    gm_cache_free(atomic_load(&g->cache));
    kr_free(g);
}

static enum kr_status take_names(struct gb *b, struct kr_grammar *g)
{
    size_t total = 0;
    for (int32_t r = 0; r < b->n_rules; r++) {
        total += strlen(b->rules[r].name) + 1;
    }
    g->names = kr_malloc(total);
    if (!g->names) {
        return KR_ERR_NOMEM;
    }
    size_t off = 0;
    for (int32_t r = 0; r < b->n_rules; r++) {
        size_t l = strlen(b->rules[r].name) + 1;
        memcpy(g->names + off, b->rules[r].name, l);
        g->rules[r].name = (uint32_t)off;
        off += l;
    }
    return KR_OK;
}

enum kr_status gb_finish(struct gb *b, int32_t root, struct kr_grammar **out)
{
    *out = NULL;
    if (b->st != KR_OK) {
        return b->st;
    }
    struct lower L = {.b = b};
    struct kr_grammar *g = NULL;
    for (int32_t r = 0; r < b->n_rules && b->st == KR_OK; r++) { /* helpers are appended while lowering */
        lower_rule(&L, r);
    }
    if (b->st != KR_OK) {
        goto fail;
    }
    g = kr_calloc(1, sizeof(*g));
    if (!g || !(g->minlen = kr_malloc((size_t)b->n_rules * sizeof(uint32_t))) ||
        !(g->minrest = kr_malloc((size_t)L.n_elems * sizeof(uint32_t)))) {
        nomem(&L);
        goto fail;
    }
    g->elems = L.elems;
    g->n_elems = L.n_elems;
    g->alt_start = L.alt_start;
    g->n_alts = L.n_alts;
    g->rules = L.rules;
    g->n_rules = (uint32_t)b->n_rules;
    g->sets = L.sets;
    g->n_sets = L.n_sets;
    g->root = (uint32_t)root;
    atomic_init(&g->refs, 1);
    L.elems = NULL;
    L.alt_start = NULL;
    L.rules = NULL;
    L.sets = NULL;
    if (take_names(b, g) != KR_OK || compute_minlen(g) != KR_OK) {
        gb_fail(b, KR_ERR_NOMEM, "grammar: out of memory");
        goto fail;
    }
    if (check_left_recursion(b, g, &L) != KR_OK) {
        goto fail;
    }
    if (g->minlen[root] == GR_INF) {
        gb_fail(b, KR_ERR_INVAL, "grammar: rule '%s' matches no text at all", b->rules[root].name);
        goto fail;
    }
    kr_free(L.set_table);
    kr_free(L.tmp.v);
    kr_free(L.loops);
    *out = g;
    return KR_OK;
fail:
    kr_grammar_free(g);
    kr_free(L.elems);
    kr_free(L.alt_start);
    kr_free(L.rules);
    kr_free(L.sets);
    kr_free(L.set_table);
    kr_free(L.tmp.v);
    kr_free(L.loops);
    return b->st;
}

/* ---- dump ---------------------------------------------------------------------------------------- */

struct sbuf {
    char *p;
    size_t len, cap;
    bool oom;
};

static void sb_put(struct sbuf *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void sb_put(struct sbuf *s, const char *fmt, ...)
{
    if (s->oom) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(s->p ? s->p + s->len : NULL, s->p ? s->cap - s->len : 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        s->oom = true;
        return;
    }
    if (!s->p || s->len + (size_t)n + 1 > s->cap) {
        size_t cap = s->cap ? s->cap : 256;
        while (cap < s->len + (size_t)n + 1) {
            cap *= 2;
        }
        char *p = kr_realloc(s->p, cap);
        if (!p) {
            s->oom = true;
            return;
        }
        s->p = p;
        s->cap = cap;
        va_start(ap, fmt);
        vsnprintf(s->p + s->len, s->cap - s->len, fmt, ap);
        va_end(ap);
    }
    s->len += (size_t)n;
}

static void put_byte(struct sbuf *s, unsigned c, bool in_class)
{
    if (c >= 0x20 && c < 0x7F && c != '\\' && c != (in_class ? ']' : '"') && !(in_class && c == '-')) {
        sb_put(s, "%c", (char)c);
    } else {
        sb_put(s, "\\x%02X", c);
    }
}

static void dump_set(struct sbuf *s, const uint8_t set[32])
{
    int n = 0, single = -1;
    for (int c = 0; c < 256; c++) {
        if ((set[c >> 3] >> (c & 7)) & 1) {
            n++;
            single = c;
        }
    }
    if (n == 1) {
        sb_put(s, "\"");
        put_byte(s, (unsigned)single, false);
        sb_put(s, "\"");
        return;
    }
    sb_put(s, "[");
    for (int c = 0; c < 256;) {
        if (!((set[c >> 3] >> (c & 7)) & 1)) {
            c++;
            continue;
        }
        int e = c;
        while (e + 1 < 256 && ((set[(e + 1) >> 3] >> ((e + 1) & 7)) & 1)) {
            e++;
        }
        put_byte(s, (unsigned)c, true);
        if (e > c) {
            sb_put(s, "-");
            put_byte(s, (unsigned)e, true);
        }
        c = e + 1;
    }
    sb_put(s, "]");
}

enum kr_status kr_grammar_to_gbnf(const struct kr_grammar *g, char **text, size_t *len)
{
    struct sbuf s = {0};
    for (uint32_t r = 0; r < g->n_rules; r++) {
        sb_put(&s, "%s ::=", gm_rule_name(g, r));
        for (uint32_t a = 0; a < g->rules[r].n_alts; a++) {
            sb_put(&s, a ? " |" : "");
            uint32_t i = g->alt_start[g->rules[r].alt0 + a];
            if (g->elems[i].kind == GE_END) {
                sb_put(&s, " \"\"");
            }
            for (; g->elems[i].kind != GE_END; i++) {
                sb_put(&s, " ");
                if (g->elems[i].kind == GE_RULE) {
                    sb_put(&s, "%s", gm_rule_name(g, g->elems[i].arg));
                } else {
                    dump_set(&s, g->sets[g->elems[i].arg]);
                }
            }
        }
        sb_put(&s, "\n");
    }
    if (s.oom || !s.p) {
        kr_free(s.p);
        *text = NULL;
        *len = 0;
        return KR_ERR_NOMEM;
    }
    *text = s.p;
    *len = s.len;
    return KR_OK;
}
