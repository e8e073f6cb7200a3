/* Token masks. A vocabulary keeps every token's bytes in a trie laid out in preorder (each node:
 * its byte, depth, the index just past its subtree and the tokens ending there), so a mask is one
 * pass over an array: a node's state is its parent's state advanced by the node's byte, and a
 * node whose state is dead skips its whole subtree.
 *
 * The pass memoizes transitions: a matcher state is a sorted set of stack ids (match.c), interned
 * per pass, and (state, byte) -> state is looked up before it is computed. Inside a JSON string
 * or a number the state after a character is the state before it, so almost every trie node costs
 * one table lookup; states looked up often get a dense 256-entry row. Speculative stack nodes are
 * dropped at the end of the pass (gm_pool_truncate), leaving the matcher as it was.
 *
 * On top of that, an adaptive cache (xgrammar's idea): a stack's top frame alone decides most
 * tokens. For each grammar position that tops a stack, one pass from that frame over a context
 * placeholder (GM_BOTTOM) sorts the vocabulary into tokens accepted whatever lies below the frame,
 * tokens refused whatever lies below, and the few that pop the frame with bytes left, which depend
 * on the frames below. A mask is then, per stack top, the cached accepted set plus a walk over
 * the dependent tokens only, from the real stack. Entries are kept in the grammar, per vocabulary,
 * and shared by all its matchers and threads. */
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
    uint64_t hash;       /* of the token bytes and end ids: which vocabulary a grammar's cache is for */
    bool strip_first_space; /* the decoder drops the first space of a text (SentencePiece) */
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
    /* FNV-1a over the lengths, the bytes and the end ids */
    uint64_t h = 1469598103934665603ull;
    for (int32_t i = 0; i <= v->n_vocab; i++) {
        h = (h ^ v->off[i]) * 1099511628211ull;
    }
    for (size_t i = 0; i < v->off[v->n_vocab]; i++) {
        h = (h ^ (uint8_t)v->blob[i]) * 1099511628211ull;
    }
    for (int32_t i = 0; i < n_end; i++) {
        h = (h ^ (uint32_t)end_ids[i]) * 1099511628211ull;
    }
    v->hash = h;
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

/* Whether the tokenizer's decoder drops the first space of a text (SentencePiece's Metaspace and
 * Strip decoders do): then a leading space of a text's first token is not in what the client
 * receives, and the grammar must not see it either. Found by decoding one space-led token alone. */
static enum kr_status detect_first_space(struct kr_grammar_vocab *v, const struct kr_tokenizer *tok,
                                         struct kr_err *err)
{
    for (int32_t id = 0; id < v->n_vocab; id++) {
        size_t len = v->off[id + 1] - v->off[id];
        const char *b = v->blob + v->off[id];
        if (len < 2 || b[0] != ' ' || b[1] == ' ' || v->is_end[id]) {
            continue;
        }
        char *text;
        size_t n;
        KR_TRY(kr_tokenizer_decode(tok, &id, 1, false, &text, &n, err));
        v->strip_first_space = n == len - 1 && memcmp(text, b + 1, n) == 0;
        kr_free(text);
        break;
    }
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
    if (st == KR_OK) {
        st = detect_first_space(v, tok, err);
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
    int32_t *acc;            /* cache entry under construction: accepted ids */
    uint32_t n_acc, cap_acc;
    uint32_t *unc;           /* ... and trie nodes of the tokens that depend on the frames below */
    uint16_t *unc_lcp;
    uint32_t n_unc, cap_unc;
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
    kr_free(w->acc);
    kr_free(w->unc);
    kr_free(w->unc_lcp);
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

/* The plain pass over the trie. skip_space: a first token's leading space is not part of the text
 * (strip_first_space), so the root's ' ' edge leaves the state as it is. */
static enum kr_status walk_trie(struct kr_grammar_matcher *m, struct gm_walk *w, const struct kr_grammar_vocab *v,
                                bool skip_space, uint32_t *mask, struct kr_err *err)
{
    int32_t root = intern(w, m->tops.v, m->tops.n);
    if (root < 0) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory computing a token mask");
    }
    w->stack[0] = root;
    for (uint32_t i = 1; i < v->n_nodes;) {
        int32_t s = root;
        if (!(skip_space && v->depth[i] == 1 && v->byte[i] == ' ')) {
            KR_TRY(transition(m, w, w->stack[v->depth[i] - 1], v->byte[i], &s, err));
        }
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

/* ---- the adaptive cache ---------------------------------------------------------------------- */

struct gm_entry {
    uint32_t parent;    /* second level: the position of the frame below (first level: UINT32_MAX) */
    _Atomic(struct gm_entry *) next; /* second level: the next entry of the same top position */
    uint32_t *acc_bits; /* [mask words] tokens accepted whatever lies below the frame (or NULL) */
    int32_t *acc_ids;   /* the same as a list, when there are few (or NULL) */
    uint32_t n_acc;
    uint32_t *unc;      /* [n_unc] trie nodes (preorder) of the tokens that depend on the frames below */
    uint16_t *unc_lcp;  /* [n_unc] bytes each shares with the previous one */
    uint32_t n_unc;
};

struct gm_cache {
    uint64_t vocab;                      /* kr_grammar_vocab.hash */
    uint32_t n;
    _Atomic(struct gm_entry *) *entries; /* [n] by grammar position, NULL until computed */
    _Atomic(struct gm_entry *) *deep;    /* [n] by top position: list of second-level entries */
};

/* A top position whose frame leaves more tokens than this to the frames below also gets entries
 * keyed by the position of the frame below (the probe then starts from two frames). Small frames,
 * such as the whitespace between JSON tokens, pop at once: with the next frame's continuation,
 * ` "key"` and ` the` are decided without the real context. */
#define CACHE_DEEP_AFTER 1024

static void entry_free(struct gm_entry *e)
{
    if (e) {
        kr_free(e->acc_bits);
        kr_free(e->acc_ids);
        kr_free(e->unc);
        kr_free(e->unc_lcp);
        kr_free(e);
    }
}

void gm_cache_free(struct gm_cache *c)
{
    if (!c) {
        return;
    }
    for (uint32_t i = 0; i < c->n; i++) {
        entry_free(atomic_load(&c->entries[i]));
        for (struct gm_entry *e = atomic_load(&c->deep[i]), *next; e; e = next) {
            next = atomic_load(&e->next);
            entry_free(e);
        }
    }
    kr_free(c->entries);
    kr_free(c->deep);
    kr_free(c);
}

/* The grammar's cache for vocabulary v, made on first use; NULL when it holds another
 * vocabulary's entries or when out of memory (masks are then computed without it). */
static struct gm_cache *cache_for(const struct kr_grammar *g, const struct kr_grammar_vocab *v)
{
    struct gm_cache *c = atomic_load(&g->cache);
    if (!c) {
        struct gm_cache *mine = kr_calloc(1, sizeof(*mine));
        if (!mine || !(mine->entries = kr_calloc(g->n_elems, sizeof(*mine->entries))) ||
            !(mine->deep = kr_calloc(g->n_elems, sizeof(*mine->deep)))) {
            if (mine) {
                kr_free(mine->entries);
            }
            kr_free(mine);
            return NULL;
        }
        mine->vocab = v->hash;
        mine->n = g->n_elems;
        /* the cache is the one part of a grammar that changes after compiling: the grammar was
         * allocated non-const, and the field is atomic */
        struct kr_grammar *mg = (struct kr_grammar *)g;
        if (atomic_compare_exchange_strong(&mg->cache, &c, mine)) {
            c = mine;
        } else {
            gm_cache_free(mine);
        }
    }
    return c->vocab == v->hash ? c : NULL;
}

static bool grow_u32(uint32_t **v, uint32_t *cap, uint32_t need)
{
    if (need <= *cap) {
        return true;
    }
    uint32_t c = *cap ? *cap * 2 : 1024;
    while (c < need) {
        c *= 2;
    }
    void *p = kr_realloc(*v, (size_t)c * sizeof(**v));
    if (!p) {
        return false;
    }
    *v = p;
    *cap = c;
    return true;
}

/* Bytes two tokens (trie nodes) share at their start. */
static uint32_t node_lcp(const struct kr_grammar_vocab *v, uint32_t a, uint32_t b)
{
    const char *x = v->blob + v->off[v->tok[a]], *y = v->blob + v->off[v->tok[b]];
    uint32_t n = v->depth[a] < v->depth[b] ? v->depth[a] : v->depth[b], k = 0;
    while (k < n && x[k] == y[k]) {
        k++;
    }
    return k;
}

/* Sorts the tokens for a stack whose top frame is at position pos: a pass over the trie from the
 * single frame (pos, GM_BOTTOM), or from the two frames (pos, (parent, GM_BOTTOM)) when parent is
 * not UINT32_MAX. A token ending in a state that is only GM_UNKNOWN popped the
 * frame with bytes left: it depends on the frames below. Any other live state accepted it within
 * the frame (or popped it exactly at its end), so it is accepted whatever lies below. */
static enum kr_status entry_build(struct kr_grammar_matcher *m, struct gm_walk *w, const struct kr_grammar_vocab *v,
                                  uint32_t pos, uint32_t parent, struct gm_entry **out, struct kr_err *err)
{
    *out = NULL;
    uint32_t below = GM_BOTTOM;
    if (parent != UINT32_MAX) {
        KR_TRY(gm_node(m, parent, GM_BOTTOM, &below, err));
    }
    KR_TRY(gm_start(m, pos, below, err));
    int32_t root = intern(w, m->out.v, m->out.n);
    if (root < 0) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory computing a token mask");
    }
    w->n_acc = w->n_unc = 0;
    w->stack[0] = root;
    for (uint32_t i = 1; i < v->n_nodes;) {
        int32_t s;
        KR_TRY(transition(m, w, w->stack[v->depth[i] - 1], v->byte[i], &s, err));
        if (s < 0) {
            i = v->end[i];
            continue;
        }
        w->stack[v->depth[i]] = s;
        if (v->tok[i] >= 0) {
            const struct wstate *ws = &w->st[s];
            if (ws->n == 1 && w->ids[ws->off] == GM_UNKNOWN) {
                if (w->n_unc == w->cap_unc) {
                    uint32_t cap = w->cap_unc;
                    uint16_t *lcp = kr_realloc(w->unc_lcp, (cap ? cap * 2 : 1024) * sizeof(uint16_t));
                    if (lcp) {
                        w->unc_lcp = lcp;
                    }
                    if (!lcp || !grow_u32(&w->unc, &w->cap_unc, cap ? cap * 2 : 1024)) {
                        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory computing a token mask");
                    }
                }
                w->unc_lcp[w->n_unc] = (uint16_t)(w->n_unc ? node_lcp(v, w->unc[w->n_unc - 1], i) : 0);
                w->unc[w->n_unc++] = i;
            } else {
                for (int32_t t = v->tok[i]; t >= 0; t = v->tok_next[t]) {
                    if (!grow_u32((uint32_t **)&w->acc, &w->cap_acc, w->n_acc + 1)) {
                        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory computing a token mask");
                    }
                    w->acc[w->n_acc++] = t;
                }
            }
        }
        i++;
    }
    struct gm_entry *e = kr_calloc(1, sizeof(*e));
    uint32_t words = (uint32_t)kr_grammar_vocab_mask_words(v);
    bool as_bits = w->n_acc > words; /* a list costs more than the bitmask beyond that */
    if (e && as_bits && (e->acc_bits = kr_calloc(words, sizeof(uint32_t)))) {
        for (uint32_t k = 0; k < w->n_acc; k++) {
            e->acc_bits[w->acc[k] >> 5] |= 1u << (w->acc[k] & 31);
        }
    } else if (e && !as_bits && w->n_acc && (e->acc_ids = kr_malloc(w->n_acc * sizeof(int32_t)))) {
        memcpy(e->acc_ids, w->acc, w->n_acc * sizeof(int32_t));
    }
    if (e && w->n_unc && (e->unc = kr_malloc(w->n_unc * sizeof(uint32_t))) &&
        (e->unc_lcp = kr_malloc(w->n_unc * sizeof(uint16_t)))) {
        memcpy(e->unc, w->unc, w->n_unc * sizeof(uint32_t));
        memcpy(e->unc_lcp, w->unc_lcp, w->n_unc * sizeof(uint16_t));
    }
    if (!e || (as_bits && !e->acc_bits) || (!as_bits && w->n_acc && !e->acc_ids) ||
        (w->n_unc && (!e->unc || !e->unc_lcp))) {
        entry_free(e);
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory computing a token mask");
    }
    e->n_acc = w->n_acc;
    e->n_unc = w->n_unc;
    e->parent = parent;
    *out = e;
    return KR_OK;
}

/* The entry for a stack whose top t is at position pos (and, for many dependent tokens, whose
 * frame below is at position parent_pos), built and published when missing. */
static enum kr_status entry_get(struct kr_grammar_matcher *m, struct gm_walk *w, const struct kr_grammar_vocab *v,
                                struct gm_cache *c, uint32_t t, const struct gm_entry **out, struct kr_err *err)
{
    uint32_t pos = m->pool.nodes[t].pos, parent = m->pool.nodes[t].parent;
    struct gm_entry *e = atomic_load(&c->entries[pos]);
    if (!e) {
        struct gm_entry *mine;
        KR_TRY(entry_build(m, w, v, pos, UINT32_MAX, &mine, err));
        if (atomic_compare_exchange_strong(&c->entries[pos], &e, mine)) {
            e = mine;
        } else { /* another thread was first: its entry is the same */
            entry_free(mine);
        }
    }
    *out = e;
    if (e->n_unc <= CACHE_DEEP_AFTER || parent < GM_FIRST_NODE) {
        return KR_OK;
    }
    uint32_t ppos = m->pool.nodes[parent].pos;
    struct gm_entry *head = atomic_load(&c->deep[pos]);
    for (struct gm_entry *d = head; d; d = atomic_load(&d->next)) {
        if (d->parent == ppos) {
            *out = d;
            return KR_OK;
        }
    }
    struct gm_entry *mine;
    KR_TRY(entry_build(m, w, v, pos, ppos, &mine, err));
    /* push at the head; a racing thread may add the same entry too, which only costs memory */
    do {
        atomic_store(&mine->next, head);
    } while (!atomic_compare_exchange_weak(&c->deep[pos], &head, mine));
    *out = mine;
    return KR_OK;
}

/* The dependent tokens of entry e, tried from the real stack top t: a walk over just those trie
 * paths (in preorder, so each token reuses the states of the prefix it shares with the one
 * before). */
static enum kr_status walk_dependent(struct kr_grammar_matcher *m, struct gm_walk *w, const struct kr_grammar_vocab *v,
                                     const struct gm_entry *e, uint32_t t, uint32_t *mask, struct kr_err *err)
{
    int32_t start = intern(w, &t, 1);
    if (start < 0) {
        return kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory computing a token mask");
    }
    w->stack[0] = start;
    uint32_t valid = 0; /* w->stack[0 .. valid] hold the states of the previous token's path */
    for (uint32_t k = 0; k < e->n_unc; k++) {
        uint32_t node = e->unc[k], len = v->depth[node];
        const char *bytes = v->blob + v->off[v->tok[node]];
        uint32_t d = e->unc_lcp[k] < valid ? e->unc_lcp[k] : valid;
        bool dead = false;
        for (; d < len; d++) {
            int32_t s;
            KR_TRY(transition(m, w, w->stack[d], (uint8_t)bytes[d], &s, err));
            if (s < 0) {
                dead = true;
                break;
            }
            w->stack[d + 1] = s;
        }
        valid = d;
        if (!dead) {
            for (int32_t id = v->tok[node]; id >= 0; id = v->tok_next[id]) {
                mask[id >> 5] |= 1u << (id & 31);
            }
            continue;
        }
        /* the first d + 1 bytes lead nowhere: so do the tokens after it that share them */
        while (k + 1 < e->n_unc && e->unc_lcp[k + 1] > d) {
            k++;
        }
    }
    return KR_OK;
}

static enum kr_status fill_cached(struct kr_grammar_matcher *m, struct gm_walk *w, const struct kr_grammar_vocab *v,
                                  struct gm_cache *c, uint32_t *mask, struct kr_err *err)
{
    uint32_t words = (uint32_t)kr_grammar_vocab_mask_words(v);
    for (uint32_t i = 0; i < m->tops.n; i++) {
        uint32_t t = m->tops.v[i];
        if (t < GM_FIRST_NODE) {
            continue;
        }
        const struct gm_entry *e;
        KR_TRY(entry_get(m, w, v, c, t, &e, err));
        if (e->acc_bits) {
            for (uint32_t k = 0; k < words; k++) {
                mask[k] |= e->acc_bits[k];
            }
        } else {
            for (uint32_t k = 0; k < e->n_acc; k++) {
                mask[e->acc_ids[k] >> 5] |= 1u << (e->acc_ids[k] & 31);
            }
        }
        KR_TRY(walk_dependent(m, w, v, e, t, mask, err));
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
    bool skip_space = v->strip_first_space && m->fresh; /* one mask per text: no cache for it */
    struct gm_cache *c = m->use_cache && !skip_space ? cache_for(m->g, v) : NULL;
    enum kr_status st = c ? fill_cached(m, m->walk, v, c, mask, err) : walk_trie(m, m->walk, v, skip_space, mask, err);
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

void kr_grammar_matcher_use_cache(struct kr_grammar_matcher *m, bool on)
{
    m->use_cache = on;
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
    if (v->strip_first_space && m->fresh && s[0] == ' ') { /* not part of the text */
        s++;
        len--;
    }
    return kr_grammar_matcher_accept_bytes(m, s, len, accepted, err);
}
