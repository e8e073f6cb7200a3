/* Token masks. A vocabulary keeps every token's bytes in a trie laid out in preorder (each node:
 * its byte, depth, the index just past its subtree and the tokens ending there), so a mask is one
 * pass over an array: a node's state is its parent's state advanced by the node's byte, and a
 * node whose state is dead skips its whole subtree.
 *
 * The pass memoizes transitions: a matcher state is a sorted set of stack ids (match.c), interned
 * per pass, and (state, byte) -> state is looked up before it is computed. Inside a JSON string
 * or a number the state after a character is the state before it, so almost every trie node costs
 * one table lookup; states looked up often get a dense 256-entry row. Speculative stack nodes are
 * dropped at the end of the pass (gm_pool_truncate), leaving the matcher as it was. */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

/* ---- vocabulary ------------------------------------------------------------------------------ */

struct kr_grammar_vocab {
    int32_t n_vocab;
    char *blob;          /* all token bytes */
    size_t *off;         /* [n_vocab + 1] token i is blob[off[i] .. off[i + 1]) */
    bool *is_end;        /* [n_vocab] */
    int32_t *end_ids;    /* [n_end] */
    int32_t n_end;
    /* the trie, preorder; node 0 is the root (depth 0) */
    uint32_t n_nodes;
    uint8_t *byte;       /* [n_nodes] */
    uint16_t *depth;     /* [n_nodes] */
    uint32_t *end;       /* [n_nodes] first index after the subtree */
    int32_t *tok;        /* [n_nodes] first token ending here, -1 */
    int32_t *tok_next;   /* [n_vocab] next token with the same bytes, -1 */
    uint32_t max_depth;
};

#define VOCAB_MAX_TOKEN_BYTES 65535 /* longer tokens (none in practice) never match */

void kr_grammar_vocab_destroy(struct kr_grammar_vocab *v)
{
    if (!v) {
        return;
    }
    kr_free(v->blob);
    kr_free(v->off);
    kr_free(v->is_end);
    kr_free(v->end_ids);
    kr_free(v->byte);
    kr_free(v->depth);
    kr_free(v->end);
    kr_free(v->tok);
    kr_free(v->tok_next);
    kr_free(v);
}

int32_t kr_grammar_vocab_n_vocab(const struct kr_grammar_vocab *v)
{
    return v->n_vocab;
}

int32_t kr_grammar_vocab_mask_words(const struct kr_grammar_vocab *v)
{
    return (v->n_vocab + 31) / 32;
}

const char *kr_grammar_vocab_token_bytes(const struct kr_grammar_vocab *v, int32_t id, size_t *len)
{
    if (id < 0 || id >= v->n_vocab) {
        *len = 0;
        return NULL;
    }
    *len = v->off[id + 1] - v->off[id];
    return v->blob + v->off[id];
}

struct tok_ref {
    const char *s;
    size_t len;
    int32_t id;
};

static int cmp_token(const void *a, const void *b)
{
    const struct tok_ref *x = a, *y = b;
    int c = memcmp(x->s, y->s, x->len < y->len ? x->len : y->len);
    if (c) {
        return c;
    }
    if (x->len != y->len) {
        return x->len < y->len ? -1 : 1;
    }
    return x->id < y->id ? -1 : x->id > y->id;
}

/* The tokens that can match, sorted by their bytes (ties by id). */
static struct tok_ref *sort_tokens(const struct kr_grammar_vocab *v, int32_t *n_out)
{
    struct tok_ref *refs = kr_malloc(((size_t)v->n_vocab + 1) * sizeof(*refs));
    if (!refs) {
        return NULL;
    }
    int32_t n = 0;
    for (int32_t i = 0; i < v->n_vocab; i++) {
        size_t l = v->off[i + 1] - v->off[i];
        if (l > 0 && l <= VOCAB_MAX_TOKEN_BYTES && !v->is_end[i]) {
            refs[n++] = (struct tok_ref){v->blob + v->off[i], l, i};
        }
    }
    qsort(refs, (size_t)n, sizeof(*refs), cmp_token);
    *n_out = n;
    return refs;
}

/* Builds the preorder trie from the tokens sorted by bytes: a token shares with the previous one
 * the nodes of their common prefix, and the nodes of the previous token below it are closed. */
static enum kr_status build_trie(struct kr_grammar_vocab *v)
{
    int32_t n_sorted = 0;
    struct tok_ref *ids = sort_tokens(v, &n_sorted);
    uint32_t *path = kr_malloc((VOCAB_MAX_TOKEN_BYTES + 1) * sizeof(uint32_t));
    size_t cap = 1;
    for (int32_t k = 0; ids && k < n_sorted; k++) {
        cap += ids[k].len;
    }
    if (cap > UINT32_MAX) {
        cap = UINT32_MAX;
    }
    v->byte = kr_malloc(cap);
    v->depth = kr_malloc(cap * sizeof(uint16_t));
    v->end = kr_malloc(cap * sizeof(uint32_t));
    v->tok = kr_malloc(cap * sizeof(int32_t));
    v->tok_next = kr_malloc(((size_t)v->n_vocab + 1) * sizeof(int32_t));
    if (!ids || !path || !v->byte || !v->depth || !v->end || !v->tok || !v->tok_next) {
        kr_free(ids);
        kr_free(path);
        return KR_ERR_NOMEM;
    }
    memset(v->tok_next, 0xFF, (size_t)v->n_vocab * sizeof(int32_t));
    uint32_t n = 1;
    v->byte[0] = 0;
    v->depth[0] = 0;
    v->tok[0] = -1;
    path[0] = 0;
    const char *prev = NULL;
    size_t prev_len = 0;
    for (int32_t k = 0; k < n_sorted; k++) {
        int32_t id = ids[k].id;
        const char *s = ids[k].s;
        size_t len = ids[k].len, lcp = 0;
        while (lcp < len && lcp < prev_len && s[lcp] == prev[lcp]) {
            lcp++;
        }
        for (size_t d = prev_len; d > lcp; d--) {
            v->end[path[d]] = n;
        }
        for (size_t d = lcp + 1; d <= len; d++) {
            v->byte[n] = (uint8_t)s[d - 1];
            v->depth[n] = (uint16_t)d;
            v->tok[n] = -1;
            path[d] = n++;
        }
        uint32_t leaf = path[len];
        if (v->tok[leaf] < 0) {
            v->tok[leaf] = id;
        } else { /* same bytes as an earlier token: chain it */
            int32_t t = v->tok[leaf];
            while (v->tok_next[t] >= 0) {
                t = v->tok_next[t];
            }
            v->tok_next[t] = id;
        }
        v->max_depth = len > v->max_depth ? (uint32_t)len : v->max_depth;
        prev = s;
        prev_len = len;
    }
    for (size_t d = prev_len; d > 0; d--) {
        v->end[path[d]] = n;
    }
    v->end[0] = n;
    v->n_nodes = n;
    kr_free(ids);
    kr_free(path);
    return KR_OK;
}

static enum kr_status vocab_finish(struct kr_grammar_vocab *v, const int32_t *end_ids, int32_t n_end,
                                   struct kr_err *err)
{
    v->is_end = kr_calloc((size_t)v->n_vocab + 1, sizeof(bool));
    v->end_ids = kr_malloc(((size_t)n_end + 1) * sizeof(int32_t));
    if (!v->is_end || !v->end_ids) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory building the token trie");
    }
    for (int32_t i = 0; i < n_end; i++) {
        if (end_ids[i] < 0 || end_ids[i] >= v->n_vocab) {
            return kr_err_set(err, KR_ERR_INVAL, "grammar: end token id %d is outside the vocabulary (%d ids)",
                              end_ids[i], v->n_vocab);
        }
        v->is_end[end_ids[i]] = true;
        v->end_ids[i] = end_ids[i];
    }
    v->n_end = n_end;
    if (build_trie(v) != KR_OK) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory building the token trie");
    }
    return KR_OK;
}

enum kr_status kr_grammar_vocab_create_raw(int32_t n_vocab, const char *const *bytes, const size_t *lens,
                                           const int32_t *end_ids, int32_t n_end, struct kr_grammar_vocab **out,
                                           struct kr_err *err)
{
    *out = NULL;
    if (n_vocab < 0 || n_end < 0) {
        return kr_err_set(err, KR_ERR_INVAL, "grammar: negative vocabulary size");
    }
    struct kr_grammar_vocab *v = kr_calloc(1, sizeof(*v));
    size_t total = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        total += lens[i];
    }
    if (!v || !(v->off = kr_malloc(((size_t)n_vocab + 1) * sizeof(size_t))) || !(v->blob = kr_malloc(total + 1))) {
        kr_grammar_vocab_destroy(v);
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory building the token trie");
    }
    v->n_vocab = n_vocab;
    size_t off = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        v->off[i] = off;
        if (lens[i]) {
            memcpy(v->blob + off, bytes[i], lens[i]);
        }
        off += lens[i];
    }
    v->off[n_vocab] = off;
    enum kr_status st = vocab_finish(v, end_ids, n_end, err);
    if (st != KR_OK) {
        kr_grammar_vocab_destroy(v);
        return st;
    }
    *out = v;
    return KR_OK;
}

enum kr_status kr_grammar_vocab_create(const struct kr_tokenizer *tok, const int32_t *end_ids, int32_t n_end,
                                       struct kr_grammar_vocab **out, struct kr_err *err)
{
    *out = NULL;
    int32_t n_vocab = kr_tokenizer_n_vocab(tok);
    struct kr_grammar_vocab *v = kr_calloc(1, sizeof(*v));
    size_t cap = 1 << 20, off = 0;
    enum kr_status st = KR_OK;
    if (!v || !(v->off = kr_malloc(((size_t)n_vocab + 1) * sizeof(size_t))) || !(v->blob = kr_malloc(cap))) {
        st = kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory building the token trie");
    }
    for (int32_t i = 0; i < n_vocab && st == KR_OK; i++) {
        char *b = NULL;
        size_t len = 0;
        st = kr_tokenizer_token_bytes(tok, i, &b, &len, err);
        if (st == KR_OK && off + len > cap) {
            while (off + len > cap) {
                cap *= 2;
            }
            char *p = kr_realloc(v->blob, cap);
            if (p) {
                v->blob = p;
            } else {
                st = kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory building the token trie");
            }
        }
        if (st == KR_OK) {
            v->off[i] = off;
            if (len) {
                memcpy(v->blob + off, b, len);
            }
            off += len;
        }
        kr_free(b);
    }
    if (st == KR_OK) {
        v->n_vocab = n_vocab;
        v->off[n_vocab] = off;
        st = vocab_finish(v, end_ids, n_end, err);
    }
    if (st != KR_OK) {
        kr_grammar_vocab_destroy(v);
        return st;
    }
    *out = v;
    return KR_OK;
}

/* ---- the walk ---------------------------------------------------------------------------------- */

struct wstate {
    uint32_t off, n; /* tops at ids[off .. off + n) */
    uint32_t hits;   /* transitions asked of this state so far */
    int32_t dense;   /* row in dense[] (-1: none) */
};

struct tslot {
    uint32_t gen;
    uint32_t key;    /* state << 8 | byte */
    int32_t next;    /* state, -1 dead */
};

struct islot {
    uint32_t gen;
    uint32_t state;
};

#define WALK_DENSE_AFTER 16  /* lookups before a state gets a dense row */
#define WALK_DENSE_MAX 4096  /* dense rows per walk (4 MB) */
#define T_UNKNOWN (-2)

struct gm_walk {
    struct wstate *st;
    uint32_t n_st, cap_st;
    uint32_t *ids;           /* tops of all states */
    size_t n_ids, cap_ids;
    struct islot *itab;      /* state interning, by the hash of its tops */
    uint32_t imask;
    struct tslot *ttab;      /* transitions */
    uint32_t tmask, n_trans;
    int32_t *dense;          /* [n_dense * 256] */
    uint32_t n_dense, cap_dense;
    uint32_t gen;
    int32_t *stack;          /* [max depth + 1] state per trie depth */
    uint32_t cap_stack;
};

void gm_walk_free(struct gm_walk *w)
{
    if (!w) {
        return;
    }
    kr_free(w->st);
    kr_free(w->ids);
    kr_free(w->itab);
    kr_free(w->ttab);
    kr_free(w->dense);
    kr_free(w->stack);
    kr_free(w);
}

static uint32_t hash_ids(const uint32_t *v, uint32_t n)
{
    uint64_t h = 0x9E3779B97F4A7C15ull ^ n;
    for (uint32_t i = 0; i < n; i++) {
        h = (h ^ v[i]) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
    }
    return (uint32_t)h;
}

static uint32_t hash_key(uint32_t k)
{
    uint64_t h = (uint64_t)k * 0x9E3779B97F4A7C15ull;
    return (uint32_t)(h >> 32);
}

static bool walk_reset(struct gm_walk *w, uint32_t max_depth)
{
    if (w->cap_stack < max_depth + 1) {
        int32_t *s = kr_realloc(w->stack, ((size_t)max_depth + 1) * sizeof(int32_t));
        if (!s) {
            return false;
        }
        w->stack = s;
        w->cap_stack = max_depth + 1;
    }
    if (!w->itab) {
        if (!(w->itab = kr_calloc(1024, sizeof(*w->itab)))) {
            return false;
        }
        w->imask = 1023;
    }
    if (!w->ttab) {
        if (!(w->ttab = kr_calloc(4096, sizeof(*w->ttab)))) {
            return false;
        }
        w->tmask = 4095;
    }
    if (++w->gen == 0) {
        memset(w->itab, 0, ((size_t)w->imask + 1) * sizeof(*w->itab));
        memset(w->ttab, 0, ((size_t)w->tmask + 1) * sizeof(*w->ttab));
        w->gen = 1;
    }
    w->n_st = 0;
    w->n_ids = 0;
    w->n_trans = 0;
    w->n_dense = 0;
    return true;
}

static bool itab_grow(struct gm_walk *w)
{
    uint32_t size = (w->imask + 1) * 2;
    struct islot *t = kr_calloc(size, sizeof(*t));
    if (!t) {
        return false;
    }
    for (uint32_t s = 0; s < w->n_st; s++) {
        uint32_t h = hash_ids(w->ids + w->st[s].off, w->st[s].n) & (size - 1);
        while (t[h].gen == w->gen) {
            h = (h + 1) & (size - 1);
        }
        t[h] = (struct islot){w->gen, s};
    }
    kr_free(w->itab);
    w->itab = t;
    w->imask = size - 1;
    return true;
}

/* The state of tops v[0..n): its index, added when new; -1 when out of memory. */
static int32_t intern(struct gm_walk *w, const uint32_t *v, uint32_t n)
{
    if ((w->n_st + 1) * 2 > w->imask + 1 && !itab_grow(w)) {
        return -1;
    }
    uint32_t h = hash_ids(v, n) & w->imask;
    for (; w->itab[h].gen == w->gen; h = (h + 1) & w->imask) {
        const struct wstate *s = &w->st[w->itab[h].state];
        if (s->n == n && memcmp(w->ids + s->off, v, (size_t)n * sizeof(uint32_t)) == 0) {
            return (int32_t)w->itab[h].state;
        }
    }
    if (w->n_st == w->cap_st) {
        uint32_t cap = w->cap_st ? w->cap_st * 2 : 256;
        void *p = kr_realloc(w->st, (size_t)cap * sizeof(*w->st));
        if (!p) {
            return -1;
        }
        w->st = p;
        w->cap_st = cap;
    }
    if (w->n_ids + n > w->cap_ids) {
        size_t cap = w->cap_ids ? w->cap_ids * 2 : 4096;
        while (cap < w->n_ids + n) {
            cap *= 2;
        }
        void *p = kr_realloc(w->ids, cap * sizeof(uint32_t));
        if (!p) {
            return -1;
        }
        w->ids = p;
        w->cap_ids = cap;
    }
    memcpy(w->ids + w->n_ids, v, (size_t)n * sizeof(uint32_t));
    w->st[w->n_st] = (struct wstate){.off = (uint32_t)w->n_ids, .n = n, .dense = -1};
    w->n_ids += n;
    w->itab[h] = (struct islot){w->gen, w->n_st};
    return (int32_t)w->n_st++;
}

static bool ttab_grow(struct gm_walk *w)
{
    uint32_t size = (w->tmask + 1) * 2;
    struct tslot *t = kr_calloc(size, sizeof(*t));
    if (!t) {
        return false;
    }
    for (uint32_t i = 0; i <= w->tmask; i++) {
        if (w->ttab[i].gen != w->gen) {
            continue;
        }
        uint32_t h = hash_key(w->ttab[i].key) & (size - 1);
        while (t[h].gen == w->gen) {
            h = (h + 1) & (size - 1);
        }
        t[h] = w->ttab[i];
    }
    kr_free(w->ttab);
    w->ttab = t;
    w->tmask = size - 1;
    return true;
}

static void give_dense_row(struct gm_walk *w, struct wstate *s)
{
    if (w->n_dense == WALK_DENSE_MAX) {
        return;
    }
    if (w->n_dense == w->cap_dense) {
        uint32_t cap = w->cap_dense ? w->cap_dense * 2 : 16;
        int32_t *d = kr_realloc(w->dense, (size_t)cap * 256 * sizeof(int32_t));
        if (!d) {
            return; /* only slower */
        }
        w->dense = d;
        w->cap_dense = cap;
    }
    int32_t *row = w->dense + (size_t)w->n_dense * 256;
    for (int i = 0; i < 256; i++) {
        row[i] = T_UNKNOWN;
    }
    s->dense = (int32_t)w->n_dense++;
}

/* The state after byte b from state s (-1: dead); KR_ERR_* on a limit or out of memory. */
static enum kr_status transition(struct kr_grammar_matcher *m, struct gm_walk *w, int32_t s, uint8_t b,
                                 int32_t *next, struct kr_err *err)
{
    struct wstate *ws = &w->st[s];
    if (ws->dense >= 0) {
        int32_t t = w->dense[(size_t)ws->dense * 256 + b];
        if (t != T_UNKNOWN) {
            *next = t;
            return KR_OK;
        }
    } else if (++ws->hits == WALK_DENSE_AFTER) {
        give_dense_row(w, ws);
    }
    uint32_t key = (uint32_t)s << 8 | b;
    uint32_t h = hash_key(key) & w->tmask;
    for (; w->ttab[h].gen == w->gen; h = (h + 1) & w->tmask) {
        if (w->ttab[h].key == key) {
            *next = w->ttab[h].next;
            goto done;
        }
    }
    KR_TRY(gm_step(m, w->ids + ws->off, ws->n, b, err));
    *next = m->out.n ? intern(w, m->out.v, m->out.n) : -1;
    if (m->out.n && *next < 0) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory computing a token mask");
    }
    if ((w->n_trans + 1) * 2 > w->tmask + 1) {
        if (!ttab_grow(w)) {
            return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory computing a token mask");
        }
        h = hash_key(key) & w->tmask;
        while (w->ttab[h].gen == w->gen) {
            h = (h + 1) & w->tmask;
        }
    }
    w->ttab[h] = (struct tslot){w->gen, key, *next};
    w->n_trans++;
done:
    ws = &w->st[s];
    if (ws->dense >= 0) {
        w->dense[(size_t)ws->dense * 256 + b] = *next;
    }
    return KR_OK;
}

static enum kr_status walk_trie(struct kr_grammar_matcher *m, struct gm_walk *w, const struct kr_grammar_vocab *v,
                                uint32_t *mask, struct kr_err *err)
{
    int32_t root = intern(w, m->tops.v, m->tops.n);
    if (root < 0) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory computing a token mask");
    }
    w->stack[0] = root;
    for (uint32_t i = 1; i < v->n_nodes;) {
        int32_t s;
        KR_TRY(transition(m, w, w->stack[v->depth[i] - 1], v->byte[i], &s, err));
        if (s < 0) {
            i = v->end[i];
            continue;
        }
        w->stack[v->depth[i]] = s;
        for (int32_t t = v->tok[i]; t >= 0; t = v->tok_next[t]) {
            mask[t >> 5] |= 1u << (t & 31);
        }
        i++;
    }
    return KR_OK;
}

enum kr_status kr_grammar_matcher_fill_mask(struct kr_grammar_matcher *m, const struct kr_grammar_vocab *v,
                                            uint32_t *mask, struct kr_err *err)
{
    memset(mask, 0, (size_t)kr_grammar_vocab_mask_words(v) * sizeof(uint32_t));
    if (m->ended) {
        return KR_OK;
    }
    if (!m->walk && !(m->walk = kr_calloc(1, sizeof(*m->walk)))) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory computing a token mask");
    }
    if (!walk_reset(m->walk, v->max_depth)) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory computing a token mask");
    }
    uint32_t mark = m->pool.n;
    enum kr_status st = walk_trie(m, m->walk, v, mask, err);
    gm_pool_truncate(&m->pool, mark);
    if (st != KR_OK) {
        memset(mask, 0, (size_t)kr_grammar_vocab_mask_words(v) * sizeof(uint32_t));
        return st;
    }
    if (kr_grammar_matcher_can_end(m)) {
        for (int32_t i = 0; i < v->n_end; i++) {
            mask[v->end_ids[i] >> 5] |= 1u << (v->end_ids[i] & 31);
        }
    }
    return KR_OK;
}

enum kr_status kr_grammar_matcher_accept_token(struct kr_grammar_matcher *m, const struct kr_grammar_vocab *v,
                                               int32_t id, bool *accepted, struct kr_err *err)
{
    *accepted = false;
    if (id < 0 || id >= v->n_vocab) {
        return kr_err_set(err, KR_ERR_INVAL, "grammar: token id %d is outside the vocabulary (%d ids)", id,
                          v->n_vocab);
    }
    if (m->ended) {
        return KR_OK;
    }
    if (v->is_end[id]) {
        if (!kr_grammar_matcher_can_end(m)) {
            return KR_OK;
        }
        KR_TRY(gm_end(m, err));
        *accepted = true;
        return KR_OK;
    }
    size_t len;
    const char *s = kr_grammar_vocab_token_bytes(v, id, &len);
    if (len == 0) {
        return KR_OK;
    }
    return kr_grammar_matcher_accept_bytes(m, s, len, accepted, err);
}
