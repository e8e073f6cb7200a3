/* Compiling by kind, and a cache of compiled grammars: a small table searched linearly under a
 * mutex (a server keeps tens of distinct constraints, and a hit costs one hash and one compare of
 * the text), least recently used out first. */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"
#include "json.h"

#include <pthread.h>
#include <string.h>

enum kr_status kr_grammar_compile(enum kr_grammar_kind kind, const char *text, size_t len,
                                  const struct kr_grammar_json_opts *opts, struct kr_grammar **out, struct kr_err *err)
{
    *out = NULL;
    switch (kind) {
    case KR_GRAMMAR_JSON_SCHEMA:
        return kr_grammar_from_json_schema(text, len, opts, out, err);
    case KR_GRAMMAR_JSON_OBJECT:
        return kr_grammar_from_json_object(opts, out, err);
    case KR_GRAMMAR_REGEX:
        return kr_grammar_from_regex(text, len, out, err);
    case KR_GRAMMAR_GBNF:
        return kr_grammar_from_gbnf(text, len, NULL, out, err);
    case KR_GRAMMAR_TOOLS:
        return kr_grammar_from_tools(text, len, opts, out, err);
    case KR_GRAMMAR_CHOICE:
        break;
    default:
        return kr_err_set(err, KR_ERR_INVAL, "grammar: unknown kind %d", (int)kind);
    }
    struct kr_json *list = NULL;
    struct kr_err jerr = {0};
    enum kr_status st = kr_json_parse(text, len, &list, &jerr);
    if (st != KR_OK) {
        return kr_err_set(err, st == KR_ERR_NOMEM ? st : KR_ERR_INVAL, "choice: %s", jerr.msg);
    }
    const char **s = NULL;
    size_t *l = NULL;
    if (list->type != KR_JSON_ARRAY) {
        st = kr_err_set(err, KR_ERR_INVAL, "choice: not a JSON array of strings");
    } else if (!(s = kr_malloc((list->n + 1) * sizeof(*s))) || !(l = kr_malloc((list->n + 1) * sizeof(*l)))) {
        st = kr_err_set(err, KR_ERR_NOMEM, "choice: out of memory");
    }
    for (size_t i = 0; st == KR_OK && i < list->n; i++) {
        if (list->items[i].type != KR_JSON_STRING) {
            st = kr_err_set(err, KR_ERR_INVAL, "choice: item %zu is not a string", i);
            break;
        }
        s[i] = list->items[i].str;
        l[i] = list->items[i].str_len;
    }
    if (st == KR_OK) {
        st = kr_grammar_from_choice(s, l, list->n, out, err);
    }
    kr_free(s);
    kr_free(l);
    kr_json_free(list);
    return st;
}

struct centry {
    uint64_t hash;
    enum kr_grammar_kind kind;
    int32_t max_ws;
    char *text; /* [len] */
    size_t len;
    struct kr_grammar *g;
    uint64_t used; /* tick of the last hit */
};

struct kr_grammar_cache {
    pthread_mutex_t lock;
    struct centry *v; /* [cap] */
    int32_t n, cap;
    uint64_t tick;
};

enum kr_status kr_grammar_cache_create(int32_t max_grammars, struct kr_grammar_cache **out)
{
    *out = NULL;
    struct kr_grammar_cache *c = kr_calloc(1, sizeof(*c));
    int32_t cap = max_grammars > 0 ? max_grammars : 1;
    if (!c || !(c->v = kr_calloc((size_t)cap, sizeof(*c->v)))) {
        kr_free(c);
        return KR_ERR_NOMEM;
    }
    if (pthread_mutex_init(&c->lock, NULL) != 0) {
        kr_free(c->v);
        kr_free(c);
        return KR_ERR_NOMEM;
    }
    c->cap = cap;
    *out = c;
    return KR_OK;
}

void kr_grammar_cache_destroy(struct kr_grammar_cache *c)
{
    if (!c) {
        return;
    }
    for (int32_t i = 0; i < c->n; i++) {
        kr_grammar_free(c->v[i].g);
        kr_free(c->v[i].text);
    }
    pthread_mutex_destroy(&c->lock);
    kr_free(c->v);
    kr_free(c);
}

static uint64_t key_hash(enum kr_grammar_kind kind, int32_t max_ws, const char *text, size_t len)
{
    uint64_t h = 1469598103934665603ull;
    h = (h ^ (uint64_t)kind) * 1099511628211ull;
    h = (h ^ (uint32_t)max_ws) * 1099511628211ull;
    for (size_t i = 0; i < len; i++) {
        h = (h ^ (uint8_t)text[i]) * 1099511628211ull;
    }
    return h;
}

enum kr_status kr_grammar_cache_get(struct kr_grammar_cache *c, enum kr_grammar_kind kind, const char *text,
                                    size_t len, const struct kr_grammar_json_opts *opts, struct kr_grammar **out,
                                    bool *hit, struct kr_err *err)
{
    *out = NULL;
    if (hit) {
        *hit = false;
    }
    if (kind == KR_GRAMMAR_JSON_OBJECT) { /* the text plays no part */
        len = 0;
    }
    int32_t max_ws = opts ? opts->max_ws : -1;
    if (kind != KR_GRAMMAR_JSON_SCHEMA && kind != KR_GRAMMAR_JSON_OBJECT && kind != KR_GRAMMAR_TOOLS) {
        max_ws = -1;
    }
    uint64_t h = key_hash(kind, max_ws, text, len);
    pthread_mutex_lock(&c->lock);
    c->tick++;
    for (int32_t i = 0; i < c->n; i++) {
        struct centry *e = &c->v[i];
        if (e->hash == h && e->kind == kind && e->max_ws == max_ws && e->len == len &&
            (len == 0 || memcmp(e->text, text, len) == 0)) {
            e->used = c->tick;
            *out = kr_grammar_retain(e->g);
            pthread_mutex_unlock(&c->lock);
            if (hit) {
                *hit = true;
            }
            return KR_OK;
        }
    }
    /* compiled under the lock: compiling takes microseconds, and a second request for the same
     * text then finds it */
    struct kr_grammar *g = NULL;
    enum kr_status st = kr_grammar_compile(kind, text, len, opts, &g, err);
    char *copy = st == KR_OK ? kr_malloc(len + 1) : NULL;
    if (st == KR_OK && !copy) {
        kr_grammar_free(g);
        st = kr_err_set(err, KR_ERR_NOMEM, "grammar: out of memory");
    }
    if (st != KR_OK) {
        pthread_mutex_unlock(&c->lock);
        return st;
    }
    if (len) {
        memcpy(copy, text, len);
    }
    int32_t slot = c->n;
    if (c->n == c->cap) { /* full: the least recently used leaves */
        slot = 0;
        for (int32_t i = 1; i < c->n; i++) {
            slot = c->v[i].used < c->v[slot].used ? i : slot;
        }
        kr_grammar_free(c->v[slot].g);
        kr_free(c->v[slot].text);
    } else {
        c->n++;
    }
    c->v[slot] = (struct centry){.hash = h, .kind = kind, .max_ws = max_ws, .text = copy, .len = len, .g = g,
                                 .used = c->tick};
    *out = kr_grammar_retain(g);
    pthread_mutex_unlock(&c->lock);
    return KR_OK;
}
