/* The tokenizer's small containers: the per-call arena, piece and match-range lists, the string -> id
 * hash map (vocabulary, added tokens) and the merge map ((left id, right id) -> (rank, merged id)). */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"

#include <string.h>

/* ---- small containers ------------------------------------------------------------------------ */

void *tok_arena_alloc(struct arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    struct arena_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        /* chunks grow from 1 KiB to 64 KiB: a decode of a few ids (the streaming detokenizer
         * does two per id) asked for 64 KiB each time, most of its cost */
        size_t cap = c ? (c->cap < 32768 ? c->cap * 2 : 65536) : 1024;
        cap = n > cap ? n : cap;
        c = kr_malloc(sizeof(*c) + cap);
        if (!c) {
            return NULL;
        }
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
    }
    void *p = c->data + c->used;
    c->used += n;
    return p;
}

void tok_arena_reset(struct arena *a)
{
    /* keep the newest (largest) chunk for the next call */
    if (a->head) {
        struct arena_chunk *keep = a->head;
        a->head = keep->next;
        tok_arena_free(a);
        keep->next = NULL;
        keep->used = 0;
        a->head = keep;
    }
}

void tok_arena_free(struct arena *a)
{
    while (a->head) {
        struct arena_chunk *n = a->head->next;
        kr_free(a->head);
        a->head = n;
    }
}
enum kr_status tok_pieces_push(struct pieces *p, const char *s, size_t len, int32_t id, bool first)
{
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        struct piece *v = kr_realloc(p->v, cap * sizeof(*v));
        if (!v) {
            return KR_ERR_NOMEM;
        }
        p->v = v;
        p->cap = cap;
    }
    p->v[p->n++] = (struct piece){s, len, id, first};
    return KR_OK;
}

enum kr_status tok_ranges_push(struct ranges *r, size_t a, size_t b, bool m)
{
    if (r->n == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 64;
        struct range *v = kr_realloc(r->v, cap * sizeof(*v));
        if (!v) {
            return KR_ERR_NOMEM;
        }
        r->v = v;
        r->cap = cap;
    }
    r->v[r->n++] = (struct range){a, b, m};
    return KR_OK;
}

/* ---- string -> id map ------------------------------------------------------------------------ */

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a, then a final mix */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 0x100000001b3ull;
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

enum kr_status tok_smap_init(struct smap *m, size_t expect)
{
    size_t cap = 16;
    while (cap < expect * 2) {
        cap *= 2;
    }
    m->slots = kr_calloc(cap, sizeof(*m->slots));
    m->cap = cap;
    m->n = 0;
    return m->slots ? KR_OK : KR_ERR_NOMEM;
}

static struct smap_slot *smap_find(const struct smap *m, const char *key, size_t len)
{
    size_t i = (size_t)hash_bytes(key, len) & (m->cap - 1);
    for (;;) {
        struct smap_slot *s = &m->slots[i];
        if (!s->key || (s->len == len && memcmp(s->key, key, len) == 0)) {
            return s;
        }
        i = (i + 1) & (m->cap - 1);
    }
}

enum kr_status tok_smap_put(struct smap *m, const char *key, size_t len, int32_t val)
{
    if ((m->n + 1) * 2 > m->cap) {
        struct smap old = *m;
        if (tok_smap_init(m, old.cap) != KR_OK) {
            *m = old;
            return KR_ERR_NOMEM;
        }
        for (size_t i = 0; i < old.cap; i++) {
            if (old.slots[i].key) {
                *smap_find(m, old.slots[i].key, old.slots[i].len) = old.slots[i];
                m->n++;
            }
        }
        kr_free(old.slots);
    }
    struct smap_slot *s = smap_find(m, key, len);
    if (!s->key) {
        m->n++;
    }
    *s = (struct smap_slot){key, (uint32_t)len, val};
    return KR_OK;
}

bool tok_smap_get(const struct smap *m, const char *key, size_t len, int32_t *val)
{
    if (!m->slots) {
        return false;
    }
    const struct smap_slot *s = smap_find(m, key, len);
    if (!s->key) {
        return false;
    }
    *val = s->val;
    return true;
}

/* ---- merge map: (left id, right id) -> (rank, merged id) ------------------------------------- */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

struct mmap_slot *tok_mmap_find(const struct mmap *m, uint64_t key)
{
    size_t i = (size_t)mix64(key) & (m->cap - 1);
    while (m->slots[i].key && m->slots[i].key != key) {
        i = (i + 1) & (m->cap - 1);
    }
    return &m->slots[i];
}

bool tok_mmap_get(const struct mmap *m, int32_t a, int32_t b, int32_t *rank, int32_t *id)
{
    if (!m->cap) {
        return false;
    }
    const struct mmap_slot *s = tok_mmap_find(m, (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1);
    if (!s->key) {
        return false;
    }
    *rank = s->rank;
    *id = s->id;
    return true;
}
