/* The tokenizer's encode path: added tokens (a byte trie, HF's lstrip/rstrip/single_word rules), the
 * BPE model (merges by rank through a heap, byte fallback, unknown tokens), the post-processor, and
 * kr_tokenizer_encode(). */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"

#include <string.h>

/* ---- added tokens ------------------------------------------------------------------------------ */

static int32_t trie_add_node(struct trie *tr, unsigned char byte)
{
    if (tr->n == tr->cap) {
        size_t cap = tr->cap ? tr->cap * 2 : 256;
        struct trie_node *v = kr_realloc(tr->nodes, cap * sizeof(*v));
        if (!v) {
            return -1;
        }
        tr->nodes = v;
        tr->cap = cap;
    }
    tr->nodes[tr->n] = (struct trie_node){-1, -1, -1, byte};
    return (int32_t)tr->n++;
}

enum kr_status tok_trie_insert(struct trie *tr, const char *s, size_t n, int32_t token)
{
    if (tr->n == 0 && trie_add_node(tr, 0) < 0) {
        return KR_ERR_NOMEM;
    }
    if (n == 0) {
        return KR_OK;
    }
    tr->first_byte[(unsigned char)s[0]] = true;
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char byte = (unsigned char)s[i];
        int32_t ch = tr->nodes[node].first_child;
        while (ch >= 0 && tr->nodes[ch].byte != byte) {
            ch = tr->nodes[ch].next;
        }
        if (ch < 0) {
            ch = trie_add_node(tr, byte);
            if (ch < 0) {
                return KR_ERR_NOMEM;
            }
            tr->nodes[ch].next = tr->nodes[node].first_child;
            tr->nodes[node].first_child = ch;
        }
        node = ch;
    }
    if (tr->nodes[node].token < 0) { /* the first token with this string wins, as in the aho-corasick build */
        tr->nodes[node].token = token;
    }
    return KR_OK;
}

/* Longest token starting at s[i]: returns its index and sets *end, or -1. */
static int32_t trie_longest(const struct trie *tr, const char *s, size_t n, size_t i, size_t *end)
{
    int32_t node = 0, best = -1;
    for (size_t k = i; k < n; k++) {
        unsigned char byte = (unsigned char)s[k];
        int32_t ch = tr->nodes[node].first_child;
        while (ch >= 0 && tr->nodes[ch].byte != byte) {
            ch = tr->nodes[ch].next;
        }
        if (ch < 0) {
            break;
        }
        node = ch;
        if (tr->nodes[node].token >= 0) {
            best = tr->nodes[node].token;
            *end = k + 1;
        }
    }
    return best;
}

static bool ends_with_word(const char *s, size_t n)
{
    if (n == 0) {
        return false;
    }
    size_t k = n - 1;
    while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80) {
        k--;
    }
    uint32_t cp;
    kr_utf8_next(s + k, &cp);
    return kr_uni_is_word(cp);
}

static bool starts_with_word(const char *s, size_t n)
{
    uint32_t cp;
    return n > 0 && (kr_utf8_next(s, &cp), kr_uni_is_word(cp));
}

/* AddedVocabulary::find_matches + split_with_indices for one piece. */
static enum kr_status split_added(const struct kr_tokenizer *t, const struct trie *tr, const struct piece *pc,
                                  struct pieces *out)
{
    const char *s = pc->s;
    size_t n = pc->len, start_offset = 0;
    if (tr->n > 0) {
        for (size_t i = 0; i < n;) {
            size_t end = 0;
            int32_t k = tr->first_byte[(unsigned char)s[i]] ? trie_longest(tr, s, n, i, &end) : -1;
            if (k < 0) {
                i++;
                continue;
            }
            const struct added_token *at = &t->added[k];
            size_t start = i, stop = end;
            i = end; /* the next search starts after this match, even if it is discarded */
            if (at->single_word) {
                bool start_space = start == 0 || !ends_with_word(s, start);
                bool stop_space = stop == n || !starts_with_word(s + stop, n - stop);
                if (!start_space || !stop_space) {
                    continue;
                }
            }
            if (at->lstrip) {
                size_t ns = start;
                while (ns > 0) {
                    size_t k2 = ns - 1;
                    while (k2 > 0 && ((unsigned char)s[k2] & 0xC0) == 0x80) {
                        k2--;
                    }
                    uint32_t cp;
                    kr_utf8_next(s + k2, &cp);
                    if (!kr_uni_is_white_space(cp)) {
                        break;
                    }
                    ns = k2;
                }
                start = ns > start_offset ? ns : start_offset;
            }
            if (at->rstrip) {
                while (stop < n) {
                    uint32_t cp;
                    size_t l = kr_utf8_next(s + stop, &cp);
                    if (!kr_uni_is_white_space(cp)) {
                        break;
                    }
                    stop += l;
                }
            }
            if (start_offset < start &&
                tok_pieces_push(out, s + start_offset, start - start_offset, -1, pc->first && start_offset == 0) != KR_OK) {
                return KR_ERR_NOMEM;
            }
            if (tok_pieces_push(out, s + start, stop - start, at->id, false) != KR_OK) {
                return KR_ERR_NOMEM;
            }
            start_offset = stop;
            if (i < stop) {
                i = stop;
            }
        }
    }
    if (start_offset < n) {
        return tok_pieces_push(out, s + start_offset, n - start_offset, -1, pc->first && start_offset == 0);
    }
    return KR_OK;
}

/* ---- BPE model ---------------------------------------------------------------------------------- */

struct sym {
    int32_t id;
    int32_t prev, next; /* indices, -1 at the ends */
    bool alive;
};
struct heap_item {
    int32_t rank;
    int32_t pos;    /* left symbol */
    int32_t new_id;
};
struct bpe_scratch {
    struct sym *syms;
    size_t syms_cap;
    struct heap_item *heap;
    size_t heap_n, heap_cap;
    struct kr_buf_s sbuf;
};

static bool heap_less(const struct heap_item *a, const struct heap_item *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static enum kr_status heap_push(struct bpe_scratch *w, struct heap_item it)
{
    if (w->heap_n == w->heap_cap) {
        size_t cap = w->heap_cap ? w->heap_cap * 2 : 64;
        struct heap_item *v = kr_realloc(w->heap, cap * sizeof(*v));
        if (!v) {
            return KR_ERR_NOMEM;
        }
        w->heap = v;
        w->heap_cap = cap;
    }
    size_t i = w->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&it, &w->heap[p])) {
            break;
        }
        w->heap[i] = w->heap[p];
        i = p;
    }
    w->heap[i] = it;
    return KR_OK;
}

static struct heap_item heap_pop(struct bpe_scratch *w)
{
    struct heap_item top = w->heap[0];
    struct heap_item last = w->heap[--w->heap_n];
    size_t i = 0, n = w->heap_n;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const struct heap_item *best = &last;
        if (l < n && heap_less(&w->heap[l], best)) {
            m = l;
            best = &w->heap[l];
        }
        if (r < n && heap_less(&w->heap[r], best)) {
            m = r;
        }
        if (m == i) {
            break;
        }
        w->heap[i] = w->heap[m];
        i = m;
    }
    if (n > 0) {
        w->heap[i] = last;
    }
    return top;
}

static enum kr_status sym_add(struct bpe_scratch *w, size_t *n, int32_t id)
{
    if (*n == w->syms_cap) {
        size_t cap = w->syms_cap ? w->syms_cap * 2 : 64;
        struct sym *v = kr_realloc(w->syms, cap * sizeof(*v));
        if (!v) {
            return KR_ERR_NOMEM;
        }
        w->syms = v;
        w->syms_cap = cap;
    }
    w->syms[*n] = (struct sym){id, (int32_t)*n - 1, -1, true};
    if (*n > 0) {
        w->syms[*n - 1].next = (int32_t)*n;
    }
    (*n)++;
    return KR_OK;
}

static enum kr_status ids_push(int32_t **ids, size_t *n, size_t *cap, int32_t id)
{
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 256;
        int32_t *v = kr_realloc(*ids, c * sizeof(*v));
        if (!v) {
            return KR_ERR_NOMEM;
        }
        *ids = v;
        *cap = c;
    }
    (*ids)[(*n)++] = id;
    return KR_OK;
}

/* BPE::tokenize for one piece (merge_word + Word::merge_all). */
static enum kr_status bpe_word(const struct kr_tokenizer *t, struct bpe_scratch *w, const char *s, size_t len,
                               int32_t **ids, size_t *n_ids, size_t *cap_ids)
{
    int32_t id;
    if (len == 0) {
        return KR_OK;
    }
    if (t->ignore_merges && tok_smap_get(&t->vocab, s, len, &id)) {
        return ids_push(ids, n_ids, cap_ids, id);
    }
    size_t n = 0;
    int32_t unk = -1; /* pending (possibly fused) unknown */
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t l = kr_utf8_next(s + i, &cp);
        bool is_first = i == 0, is_last = i + l == len;
        const char *key = s + i;
        size_t key_len = l;
        if ((!is_first && t->cont_prefix) || (is_last && t->eow_suffix)) {
            w->sbuf.len = 0;
            if (!is_first && t->cont_prefix) {
                kr_bs_append(&w->sbuf, t->cont_prefix, t->cont_prefix_len);
            }
            kr_bs_append(&w->sbuf, s + i, l);
            if (is_last && t->eow_suffix) {
                kr_bs_append(&w->sbuf, t->eow_suffix, t->eow_suffix_len);
            }
            if (w->sbuf.oom || !w->sbuf.p) { /* a key missing a piece would find another token */
                return KR_ERR_NOMEM;
            }
            key = w->sbuf.p;
            key_len = w->sbuf.len;
        }
        i += l;
        if (tok_smap_get(&t->vocab, key, key_len, &id)) {
            if (unk >= 0) {
                if (sym_add(w, &n, unk) != KR_OK) {
                    return KR_ERR_NOMEM;
                }
                unk = -1;
            }
            if (sym_add(w, &n, id) != KR_OK) {
                return KR_ERR_NOMEM;
            }
            continue;
        }
        if (t->byte_fallback) {
            bool all = true;
            for (size_t k = 0; k < key_len; k++) {
                all = all && t->byte_ids[(unsigned char)key[k]] >= 0;
            }
            if (all) {
                for (size_t k = 0; k < key_len; k++) {
                    if (sym_add(w, &n, t->byte_ids[(unsigned char)key[k]]) != KR_OK) {
                        return KR_ERR_NOMEM;
                    }
                }
                continue;
            }
        }
        if (t->unk_id >= 0) {
            if (unk >= 0 && !t->fuse_unk && sym_add(w, &n, unk) != KR_OK) {
                return KR_ERR_NOMEM;
            }
            unk = t->unk_id;
        }
        /* without an unk token an unknown character produces nothing, as in HF */
    }
    if (unk >= 0 && sym_add(w, &n, unk) != KR_OK) {
        return KR_ERR_NOMEM;
    }
    /* Word::merge_all: lowest rank first, leftmost first among equal ranks. */
    w->heap_n = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        int32_t rank, nid;
        if (tok_mmap_get(&t->merges, w->syms[i].id, w->syms[i + 1].id, &rank, &nid) &&
            heap_push(w, (struct heap_item){rank, (int32_t)i, nid}) != KR_OK) {
            return KR_ERR_NOMEM;
        }
    }
    while (w->heap_n > 0) {
        struct heap_item top = heap_pop(w);
        struct sym *a = &w->syms[top.pos];
        if (!a->alive || a->next < 0) {
            continue;
        }
        struct sym *b = &w->syms[a->next];
        int32_t rank, nid;
        if (!tok_mmap_get(&t->merges, a->id, b->id, &rank, &nid) || nid != top.new_id || rank != top.rank) {
            continue;
        }
        a->id = nid;
        b->alive = false;
        a->next = b->next;
        if (b->next >= 0) {
            w->syms[b->next].prev = top.pos;
        }
        if (a->prev >= 0 && tok_mmap_get(&t->merges, w->syms[a->prev].id, a->id, &rank, &nid) &&
            heap_push(w, (struct heap_item){rank, a->prev, nid}) != KR_OK) {
            return KR_ERR_NOMEM;
        }
        if (a->next >= 0 && tok_mmap_get(&t->merges, a->id, w->syms[a->next].id, &rank, &nid) &&
            heap_push(w, (struct heap_item){rank, top.pos, nid}) != KR_OK) {
            return KR_ERR_NOMEM;
        }
    }
    for (int32_t i = n ? 0 : -1; i >= 0; i = w->syms[i].next) {
        if (ids_push(ids, n_ids, cap_ids, w->syms[i].id) != KR_OK) {
            return KR_ERR_NOMEM;
        }
    }
    return KR_OK;
}

/* ---- encode ------------------------------------------------------------------------------------ */

static enum kr_status post_apply(const struct postproc *pp, int32_t **ids, size_t *n, size_t *cap)
{
    if (pp->sub) {
        for (size_t i = 0; i < pp->n_sub; i++) {
            enum kr_status st = post_apply(&pp->sub[i], ids, n, cap);
            if (st != KR_OK) {
                return st;
            }
        }
        return KR_OK;
    }
    if (!pp->is_template) {
        return KR_OK;
    }
    size_t total = 0;
    for (size_t i = 0; i < pp->n_items; i++) {
        total += pp->items[i].is_seq ? *n : pp->items[i].n_ids;
    }
    int32_t *out = kr_malloc((total ? total : 1) * sizeof(*out));
    if (!out) {
        return KR_ERR_NOMEM;
    }
    size_t k = 0;
    for (size_t i = 0; i < pp->n_items; i++) {
        const struct post_item *it = &pp->items[i];
        if (it->is_seq) {
            if (*n) {
                memcpy(out + k, *ids, *n * sizeof(*out));
            }
            k += *n;
        } else if (it->n_ids) {
            memcpy(out + k, it->ids, it->n_ids * sizeof(*out));
            k += it->n_ids;
        }
    }
    kr_free(*ids);
    *ids = out;
    *n = k;
    *cap = total ? total : 1;
    return KR_OK;
}

enum kr_status kr_tokenizer_encode(const struct kr_tokenizer *t, const char *text, size_t len,
                                   bool add_special_tokens, int32_t **ids_out, int64_t *n_out, struct kr_err *err)
{
    *ids_out = NULL;
    *n_out = 0;
    if (!text && len) {
        return kr_err_set(err, KR_ERR_INVAL, "tokenizer: NULL text");
    }
    size_t bad = kr_utf8_validate(text, len);
    if (bad != len) {
        return kr_err_set(err, KR_ERR_INVAL, "tokenizer: input is not valid UTF-8 (byte 0x%02x at offset %zu)",
                          (unsigned char)text[bad], bad);
    }
    struct ctx c = {.t = t, .err = err};
    struct pieces p = {0}, q = {0};
    struct bpe_scratch w = {0};
    int32_t *ids = NULL;
    size_t n_ids = 0, cap_ids = 0;
    enum kr_status st = KR_ERR_NOMEM;
    if (tok_rx_open(&c.rx, t, err) != KR_OK) {
        goto fail;
    }

    struct piece whole = {text ? text : "", len, -1, true};
    /* 1. added tokens matched on the raw text */
    if ((st = split_added(t, &t->trie_raw, &whole, &p)) != KR_OK) {
        goto fail;
    }
    /* 2. normalize the other pieces, then match normalized added tokens */
    for (size_t i = 0; i < p.n; i++) {
        struct piece pc = p.v[i];
        if (pc.id >= 0) {
            if ((st = tok_pieces_push(&q, pc.s, pc.len, pc.id, pc.first)) != KR_OK) {
                goto fail;
            }
            continue;
        }
        if (t->norm && (st = tok_normalize(&c, t->norm, &pc.s, &pc.len)) != KR_OK) {
            goto fail;
        }
        if (pc.len == 0) {
            continue;
        }
        if ((st = split_added(t, &t->trie_norm, &pc, &q)) != KR_OK) {
            goto fail;
        }
    }
    /* 3. pre-tokenize */
    if (t->pretok && (st = tok_pretok_apply(&c, t->pretok, &q)) != KR_OK) {
        goto fail;
    }
    /* 4. model */
    for (size_t i = 0; i < q.n; i++) {
        if (q.v[i].id >= 0) {
            st = ids_push(&ids, &n_ids, &cap_ids, q.v[i].id);
        } else {
            st = bpe_word(t, &w, q.v[i].s, q.v[i].len, &ids, &n_ids, &cap_ids);
        }
        if (st != KR_OK) {
            goto fail;
        }
    }
    /* 5. post-process */
    if (add_special_tokens && t->post && (st = post_apply(t->post, &ids, &n_ids, &cap_ids)) != KR_OK) {
        goto fail;
    }
    *ids_out = ids;
    *n_out = (int64_t)n_ids;
    ids = NULL;
    st = KR_OK;
fail:
    if (st == KR_ERR_NOMEM) {
        kr_err_set(err, st, "tokenizer: out of memory while encoding %zu bytes", len);
    }
    kr_free(ids);
    kr_free(p.v);
    kr_free(q.v);
    kr_free(w.syms);
    kr_free(w.heap);
    kr_bs_free(&w.sbuf);
    kr_free(c.ranges.v);
    kr_bs_free(&c.buf);
    tok_arena_free(&c.arena);
    tok_rx_close(&c.rx);
    return st;
}
