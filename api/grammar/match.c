/* The matcher: a nondeterministic pushdown automaton over bytes that follows every parse of the
 * text so far at once, as a set of parse stacks (llama.cpp's approach). A stack is a chain of
 * frames, each a grammar position (the next element of an alternative) and the frame below; all
 * stacks share one tree of frames, hash-consed, so equal stacks are one node, a set of stacks is a
 * sorted array of node ids, and comparing, copying and deduplicating states is cheap. The top of
 * every stack in a state points at a byte set: references are expanded (the closure) right after
 * each byte. A reference that ends its alternative replaces the frame instead of pushing one, so
 * repetitions (lowered to right recursion) run in constant depth; left recursion is refused when
 * compiling. Why not an Earley parser (xgrammar): for the grammars we build (JSON, regexes) the
 * stack sets stay tiny, a state is a few ids that copy and compare in O(1) per stack, and the
 * mask walk memoizes transitions per state (mask.c), which an Earley chart would make costly. */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"

#include <stdlib.h>
#include <string.h>

/* ---- the node pool ---------------------------------------------------------------------------- */

static uint32_t node_hash(uint32_t pos, uint32_t parent)
{
    uint64_t k = ((uint64_t)pos << 32 | parent) * 0x9E3779B97F4A7C15ull;
    return (uint32_t)(k >> 32);
}

/* Fills the hash table from the nodes in ascending ids, so that truncating (newest first) stays
 * an exact undo. */
static void table_fill(struct gm_pool *p)
{
    memset(p->table, 0, ((size_t)p->mask + 1) * sizeof(uint32_t));
    for (uint32_t id = GM_FIRST_NODE; id < p->n; id++) {
        uint32_t h = node_hash(p->nodes[id].pos, p->nodes[id].parent) & p->mask;
        while (p->table[h]) {
            h = (h + 1) & p->mask;
        }
        p->table[h] = id;
        p->nodes[id].slot = h;
    }
}

static enum kr_status pool_rehash(struct gm_pool *p, uint32_t size)
{
    uint32_t *t = kr_malloc((size_t)size * sizeof(uint32_t));
    if (!t) {
        return KR_ERR_NOMEM;
    }
    kr_free(p->table);
    p->table = t;
    p->mask = size - 1;
    table_fill(p);
    return KR_OK;
}

static enum kr_status pool_reserve(struct gm_pool *p, uint32_t cap)
{
    if (cap <= p->cap) {
        return KR_OK;
    }
    struct gm_node *nodes = kr_realloc(p->nodes, (size_t)cap * sizeof(*nodes));
    if (!nodes) {
        return KR_ERR_NOMEM;
    }
    p->nodes = nodes;
    uint32_t *mark = kr_realloc(p->mark, (size_t)cap * sizeof(*mark));
    if (!mark) {
        return KR_ERR_NOMEM;
    }
    memset(mark + p->cap, 0, (size_t)(cap - p->cap) * sizeof(*mark));
    p->mark = mark;
    p->cap = cap;
    return KR_OK;
}

static enum kr_status pool_init(struct gm_pool *p)
{
    memset(p, 0, sizeof(*p));
    KR_TRY(pool_reserve(p, 1024));
    for (uint32_t i = 0; i < GM_FIRST_NODE; i++) {
        p->nodes[i] = (struct gm_node){.pos = UINT32_MAX, .parent = i};
    }
    p->n = GM_FIRST_NODE;
    return pool_rehash(p, 2048);
}

static void pool_free(struct gm_pool *p)
{
    kr_free(p->nodes);
    kr_free(p->table);
    kr_free(p->mark);
    memset(p, 0, sizeof(*p));
}

void gm_pool_truncate(struct gm_pool *p, uint32_t n)
{
    while (p->n > n) {
        p->table[p->nodes[--p->n].slot] = 0;
    }
}

/* The node (pos, parent), made when new. */
static enum kr_status pool_get(struct gm_pool *p, uint32_t pos, uint32_t parent, uint32_t *id, struct kr_err *err)
{
    uint32_t h = node_hash(pos, parent) & p->mask;
    for (uint32_t v; (v = p->table[h]) != 0; h = (h + 1) & p->mask) {
        if (p->nodes[v].pos == pos && p->nodes[v].parent == parent) {
            *id = v;
            return KR_OK;
        }
    }
    uint32_t depth = p->nodes[parent].depth + 1;
    if (depth > KR_GRAMMAR_MAX_DEPTH) {
        return kr_err_set(err, KR_ERR_INVAL, "grammar: rules nested deeper than %d", KR_GRAMMAR_MAX_DEPTH);
    }
    if (p->n >= KR_GRAMMAR_MAX_NODES) {
        return kr_err_set(err, KR_ERR_INVAL, "grammar: more than %d parse stack frames", KR_GRAMMAR_MAX_NODES);
    }
    if (p->n == p->cap && pool_reserve(p, p->cap * 2) != KR_OK) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory");
    }
    if ((p->n + 1) * 2 > p->mask + 1) {
        if (pool_rehash(p, (p->mask + 1) * 2) != KR_OK) {
            return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory");
        }
        h = node_hash(pos, parent) & p->mask;
        while (p->table[h]) {
            h = (h + 1) & p->mask;
        }
    }
    p->nodes[p->n] = (struct gm_node){.pos = pos, .parent = parent, .depth = depth, .slot = h};
    p->table[h] = p->n;
    *id = p->n++;
    return KR_OK;
}

/* ---- closure ----------------------------------------------------------------------------------- */

static enum kr_status tops_reserve(struct gm_tops *t, uint32_t n)
{
    if (n <= t->cap) {
        return KR_OK;
    }
    uint32_t cap = t->cap ? t->cap : 16;
    while (cap < n) {
        cap *= 2;
    }
    uint32_t *v = kr_realloc(t->v, (size_t)cap * sizeof(uint32_t));
    if (!v) {
        return KR_ERR_NOMEM;
    }
    t->v = v;
    t->cap = cap;
    return KR_OK;
}

static void batch_begin(struct kr_grammar_matcher *m)
{
    if (++m->pool.gen == 0) { /* stamps wrapped: forget them all */
        memset(m->pool.mark, 0, (size_t)m->pool.cap * sizeof(uint32_t));
        m->pool.gen = 1;
    }
    m->out.n = 0;
    m->n_work = 0;
}

static enum kr_status work_push(struct kr_grammar_matcher *m, uint32_t id, struct kr_err *err)
{
    if (m->pool.mark[id] == m->pool.gen) {
        return KR_OK;
    }
    m->pool.mark[id] = m->pool.gen;
    if (m->n_work == m->cap_work) {
        uint32_t cap = m->cap_work ? m->cap_work * 2 : 64;
        uint32_t *v = kr_realloc(m->work, (size_t)cap * sizeof(uint32_t));
        if (!v) {
            return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory");
        }
        m->work = v;
        m->cap_work = cap;
    }
    m->work[m->n_work++] = id;
    return KR_OK;
}

static enum kr_status emit(struct kr_grammar_matcher *m, uint32_t id, struct kr_err *err)
{
    if (m->out.n >= KR_GRAMMAR_MAX_STACKS) {
        return kr_err_set(err, KR_ERR_INVAL, "grammar: more than %d parse stacks alive at once (the grammar is too "
                          "ambiguous)", KR_GRAMMAR_MAX_STACKS);
    }
    if (tops_reserve(&m->out, m->out.n + 1) != KR_OK) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory");
    }
    m->out.v[m->out.n++] = id;
    return KR_OK;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static void sort_ids(uint32_t *v, uint32_t n)
{
    if (n > 32) {
        qsort(v, n, sizeof(*v), cmp_u32);
        return;
    }
    for (uint32_t i = 1; i < n; i++) {
        uint32_t x = v[i], j = i;
        for (; j > 0 && v[j - 1] > x; j--) {
            v[j] = v[j - 1];
        }
        v[j] = x;
    }
}

/* Expands the queued nodes until every stack top is a byte set (or a sentinel), into m->out. */
static enum kr_status run_closure(struct kr_grammar_matcher *m, struct kr_err *err)
{
    const struct kr_grammar *g = m->g;
    while (m->n_work) {
        uint32_t id = m->work[--m->n_work];
        if (id < GM_FIRST_NODE) {
            KR_TRY(emit(m, id, err));
            continue;
        }
        uint32_t pos = m->pool.nodes[id].pos, parent = m->pool.nodes[id].parent;
        const struct gelem *e = &g->elems[pos];
        if (e->kind == GE_BYTES) {
            KR_TRY(emit(m, id, err));
        } else if (e->kind == GE_END) {
            KR_TRY(work_push(m, parent, err));
        } else {
            const struct grule *r = &g->rules[e->arg];
            uint32_t base = parent;
            if (g->elems[pos + 1].kind != GE_END) { /* not a tail call: push the continuation */
                KR_TRY(pool_get(&m->pool, pos + 1, parent, &base, err));
            }
            for (uint32_t a = r->alt0; a < r->alt0 + r->n_alts; a++) {
                uint32_t child;
                KR_TRY(pool_get(&m->pool, g->alt_start[a], base, &child, err));
                KR_TRY(work_push(m, child, err));
            }
        }
    }
    sort_ids(m->out.v, m->out.n);
    return KR_OK;
}

enum kr_status gm_node(struct kr_grammar_matcher *m, uint32_t pos, uint32_t parent, uint32_t *id, struct kr_err *err)
{
    return pool_get(&m->pool, pos, parent, id, err);
}

enum kr_status gm_start(struct kr_grammar_matcher *m, uint32_t pos, uint32_t parent, struct kr_err *err)
{
    batch_begin(m);
    uint32_t id;
    KR_TRY(pool_get(&m->pool, pos, parent, &id, err));
    KR_TRY(work_push(m, id, err));
    return run_closure(m, err);
}

static enum kr_status start_root(struct kr_grammar_matcher *m, struct kr_err *err)
{
    const struct kr_grammar *g = m->g;
    const struct grule *r = &g->rules[g->root];
    batch_begin(m);
    for (uint32_t a = r->alt0; a < r->alt0 + r->n_alts; a++) {
        uint32_t id;
        KR_TRY(pool_get(&m->pool, g->alt_start[a], GM_ROOT, &id, err));
        KR_TRY(work_push(m, id, err));
    }
    return run_closure(m, err);
}

enum kr_status gm_step(struct kr_grammar_matcher *m, const uint32_t *in, uint32_t n, uint8_t b, struct kr_err *err)
{
    const struct kr_grammar *g = m->g;
    batch_begin(m);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t t = in[i];
        if (t == GM_ROOT) {
            continue;
        }
        if (t == GM_BOTTOM || t == GM_UNKNOWN) {
            KR_TRY(work_push(m, GM_UNKNOWN, err));
            continue;
        }
        uint32_t pos = m->pool.nodes[t].pos;
        if (gm_set_has(g, g->elems[pos].arg, b)) {
            uint32_t id;
            KR_TRY(pool_get(&m->pool, pos + 1, m->pool.nodes[t].parent, &id, err));
            KR_TRY(work_push(m, id, err));
        }
    }
    return run_closure(m, err);
}

/* ---- the matcher ------------------------------------------------------------------------------- */

static enum kr_status tops_copy(struct gm_tops *dst, const uint32_t *v, uint32_t n)
{
    KR_TRY(tops_reserve(dst, n));
    if (n) {
        memcpy(dst->v, v, (size_t)n * sizeof(uint32_t));
    }
    dst->n = n;
    return KR_OK;
}

void kr_grammar_matcher_destroy(struct kr_grammar_matcher *m)
{
    if (!m) {
        return;
    }
    pool_free(&m->pool);
    kr_free(m->tops.v);
    kr_free(m->out.v);
    kr_free(m->cur.v);
    kr_free(m->work);
    for (int i = 0; i < KR_GRAMMAR_MAX_HISTORY; i++) {
        kr_free(m->hist[i].tops);
    }
    gm_walk_free(m->walk);
    kr_free(m);
}

enum kr_status kr_grammar_matcher_create(const struct kr_grammar *g, struct kr_grammar_matcher **out,
                                         struct kr_err *err)
{
    *out = NULL;
    struct kr_grammar_matcher *m = kr_calloc(1, sizeof(*m));
    if (!m) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory");
    }
    m->g = g;
    m->gc_at = 1u << 16;
    m->use_cache = true;
    m->fresh = true;
    enum kr_status st = pool_init(&m->pool);
    if (st != KR_OK) {
        kr_err_set(err, st, "grammar: out of memory");
    } else if ((st = start_root(m, err)) == KR_OK && tops_copy(&m->tops, m->out.v, m->out.n) != KR_OK) {
        st = kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory");
    }
    if (st != KR_OK) {
        kr_grammar_matcher_destroy(m);
        return st;
    }
    *out = m;
    return KR_OK;
}

enum kr_status kr_grammar_matcher_reset(struct kr_grammar_matcher *m, struct kr_err *err)
{
    gm_pool_truncate(&m->pool, GM_FIRST_NODE);
    m->n_hist = 0;
    m->ended = false;
    m->fresh = true;
    KR_TRY(start_root(m, err));
    if (tops_copy(&m->tops, m->out.v, m->out.n) != KR_OK) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory");
    }
    return KR_OK;
}

static enum kr_status copy_array(void *dst, const void *src, size_t n)
{
    void **d = dst;
    *d = NULL;
    if (!src || n == 0) {
        return KR_OK;
    }
    *d = kr_malloc(n);
    if (!*d) {
        return KR_ERR_NOMEM;
    }
    memcpy(*d, src, n);
    return KR_OK;
}

enum kr_status kr_grammar_matcher_clone(const struct kr_grammar_matcher *m, struct kr_grammar_matcher **out,
                                        struct kr_err *err)
{
    *out = NULL;
    struct kr_grammar_matcher *c = kr_calloc(1, sizeof(*c));
    if (!c) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory");
    }
    c->g = m->g;
    c->ended = m->ended;
    c->fresh = m->fresh;
    c->use_cache = m->use_cache;
    c->hist_head = m->hist_head;
    c->n_hist = m->n_hist;
    c->gc_at = m->gc_at;
    c->pool.n = c->pool.cap = m->pool.n;
    c->pool.mask = m->pool.mask;
    c->pool.gen = 1;
    enum kr_status st = KR_OK;
    if (copy_array(&c->pool.nodes, m->pool.nodes, (size_t)m->pool.n * sizeof(struct gm_node)) != KR_OK ||
        copy_array(&c->pool.table, m->pool.table, ((size_t)m->pool.mask + 1) * sizeof(uint32_t)) != KR_OK ||
        !(c->pool.mark = kr_calloc(m->pool.n, sizeof(uint32_t))) || tops_copy(&c->tops, m->tops.v, m->tops.n) != KR_OK) {
        st = KR_ERR_NOMEM;
    }
    for (int i = 0; i < KR_GRAMMAR_MAX_HISTORY && st == KR_OK; i++) {
        const struct gm_hist *h = &m->hist[i];
        c->hist[i].n = c->hist[i].cap = h->n;
        c->hist[i].ended = h->ended;
        c->hist[i].fresh = h->fresh;
        st = copy_array(&c->hist[i].tops, h->tops, (size_t)h->n * sizeof(uint32_t));
    }
    if (st != KR_OK) {
        kr_grammar_matcher_destroy(c);
        return kr_err_set(err, st, "grammar: out of memory");
    }
    *out = c;
    return KR_OK;
}

/* Drops the nodes no state refers to (the current one and the history), renumbering the rest in
 * their order (a parent is always older than its children). Skipped when out of memory: the pool
 * only stays bigger. */
static void collect(struct kr_grammar_matcher *m)
{
    struct gm_pool *p = &m->pool;
    uint32_t *remap = kr_malloc((size_t)p->n * sizeof(uint32_t));
    if (!remap) {
        return;
    }
    /* entries of the ring that no rollback can reach are emptied first */
    for (int k = m->n_hist; k < KR_GRAMMAR_MAX_HISTORY; k++) {
        m->hist[((m->hist_head - 1 - k) % KR_GRAMMAR_MAX_HISTORY + KR_GRAMMAR_MAX_HISTORY) %
                KR_GRAMMAR_MAX_HISTORY].n = 0;
    }
    memset(remap, 0xFF, (size_t)p->n * sizeof(uint32_t));
    for (uint32_t i = 0; i < GM_FIRST_NODE; i++) {
        remap[i] = i;
    }
    for (int h = -1; h < KR_GRAMMAR_MAX_HISTORY; h++) {
        const struct gm_tops t = h < 0 ? m->tops : (struct gm_tops){m->hist[h].tops, m->hist[h].n, 0};
        for (uint32_t i = 0; i < t.n; i++) {
            for (uint32_t id = t.v[i]; remap[id] == UINT32_MAX; id = p->nodes[id].parent) {
                remap[id] = 0; /* live; numbered below */
            }
        }
    }
    uint32_t k = GM_FIRST_NODE;
    for (uint32_t id = GM_FIRST_NODE; id < p->n; id++) {
        if (remap[id] == UINT32_MAX) {
            continue;
        }
        struct gm_node nd = p->nodes[id];
        nd.parent = remap[nd.parent];
        remap[id] = k;
        p->nodes[k++] = nd;
    }
    p->n = k;
    for (int h = -1; h < KR_GRAMMAR_MAX_HISTORY; h++) {
        uint32_t *v = h < 0 ? m->tops.v : m->hist[h].tops;
        uint32_t n = h < 0 ? m->tops.n : m->hist[h].n;
        for (uint32_t i = 0; i < n; i++) {
            v[i] = remap[v[i]];
        }
    }
    kr_free(remap);
    table_fill(p);
    m->gc_at = 2 * p->n > (1u << 16) ? 2 * p->n : (1u << 16);
}

/* Remembers the current state as one step of history. */
static enum kr_status push_history(struct kr_grammar_matcher *m)
{
    struct gm_hist *h = &m->hist[m->hist_head];
    if (h->cap < m->tops.n) {
        uint32_t *v = kr_realloc(h->tops, (size_t)m->tops.n * sizeof(uint32_t));
        if (!v) {
            return KR_ERR_NOMEM;
        }
        h->tops = v;
        h->cap = m->tops.n;
    }
    if (m->tops.n) {
        memcpy(h->tops, m->tops.v, (size_t)m->tops.n * sizeof(uint32_t));
    }
    h->n = m->tops.n;
    h->ended = m->ended;
    h->fresh = m->fresh;
    m->hist_head = (m->hist_head + 1) % KR_GRAMMAR_MAX_HISTORY;
    if (m->n_hist < KR_GRAMMAR_MAX_HISTORY) {
        m->n_hist++;
    }
    return KR_OK;
}

enum kr_status gm_end(struct kr_grammar_matcher *m, struct kr_err *err)
{
    if (push_history(m) != KR_OK) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory");
    }
    m->ended = true;
    m->fresh = false;
    return KR_OK;
}

enum kr_status kr_grammar_matcher_accept_bytes(struct kr_grammar_matcher *m, const void *bytes, size_t n,
                                               bool *accepted, struct kr_err *err)
{
    *accepted = false;
    if (m->ended) {
        return KR_OK;
    }
    if (m->pool.n > m->gc_at) {
        collect(m);
    }
    const uint8_t *s = bytes;
    uint32_t mark = m->pool.n;
    enum kr_status st = tops_copy(&m->cur, m->tops.v, m->tops.n);
    for (size_t i = 0; i < n && st == KR_OK; i++) {
        st = gm_step(m, m->cur.v, m->cur.n, s[i], err);
        struct gm_tops t = m->cur;
        m->cur = m->out;
        m->out = t;
        if (st == KR_OK && m->cur.n == 0) {
            gm_pool_truncate(&m->pool, mark);
            return KR_OK;
        }
    }
    if (st == KR_OK && push_history(m) != KR_OK) {
        st = KR_ERR_NOMEM;
    }
    if (st != KR_OK) {
        gm_pool_truncate(&m->pool, mark);
        if (st == KR_ERR_NOMEM) {
            kr_err_set(err, st, "grammar: out of memory");
        }
        return st;
    }
    struct gm_tops t = m->tops;
    m->tops = m->cur;
    m->cur = t;
    m->fresh = false;
    *accepted = true;
    return KR_OK;
}

void kr_grammar_matcher_next_bytes(const struct kr_grammar_matcher *m, uint32_t set[8])
{
    memset(set, 0, 8 * sizeof(uint32_t));
    if (m->ended) {
        return;
    }
    for (uint32_t i = 0; i < m->tops.n; i++) {
        uint32_t t = m->tops.v[i];
        if (t < GM_FIRST_NODE) {
            continue;
        }
        const uint8_t *s = m->g->sets[m->g->elems[m->pool.nodes[t].pos].arg];
        for (int w = 0; w < 8; w++) {
            set[w] |= (uint32_t)s[4 * w] | (uint32_t)s[4 * w + 1] << 8 | (uint32_t)s[4 * w + 2] << 16 |
                      (uint32_t)s[4 * w + 3] << 24;
        }
    }
}

bool kr_grammar_matcher_can_end(const struct kr_grammar_matcher *m)
{
    return m->ended || (m->tops.n > 0 && m->tops.v[0] == GM_ROOT);
}

bool kr_grammar_matcher_is_done(const struct kr_grammar_matcher *m)
{
    return m->ended || (m->tops.n == 1 && m->tops.v[0] == GM_ROOT);
}

int64_t kr_grammar_matcher_min_remaining(const struct kr_grammar_matcher *m)
{
    if (m->ended) {
        return 0;
    }
    uint64_t best = UINT64_MAX;
    for (uint32_t i = 0; i < m->tops.n; i++) {
        uint64_t d = 0;
        for (uint32_t id = m->tops.v[i]; id >= GM_FIRST_NODE && d != UINT64_MAX; id = m->pool.nodes[id].parent) {
            uint32_t r = m->g->minrest[m->pool.nodes[id].pos];
            d = r == GR_INF ? UINT64_MAX : d + r;
        }
        best = d < best ? d : best;
    }
    return best >= (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)best;
}

enum kr_status kr_grammar_matcher_rollback(struct kr_grammar_matcher *m, int32_t n)
{
    if (n < 0 || n > m->n_hist) {
        return KR_ERR_INVAL;
    }
    if (n == 0) {
        return KR_OK;
    }
    int32_t head = ((m->hist_head - n) % KR_GRAMMAR_MAX_HISTORY + KR_GRAMMAR_MAX_HISTORY) % KR_GRAMMAR_MAX_HISTORY;
    const struct gm_hist *h = &m->hist[head];
    KR_TRY(tops_copy(&m->tops, h->tops, h->n));
    m->ended = h->ended;
    m->fresh = h->fresh;
    m->hist_head = head;
    m->n_hist -= n;
    return KR_OK;
}
