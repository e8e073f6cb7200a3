#define _POSIX_C_SOURCE 200809L

#include "tokenizer.h"

#include "alloc.h"
#include "unicode.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* The pipeline follows HF tokenizers' TokenizerImpl::encode_single_sequence:
 *   1. added tokens with normalized=false are cut out of the raw text;
 *   2. every other piece is normalized, then added tokens with normalized=true are cut out;
 *   3. the pre-tokenizer splits (and transforms) the remaining pieces;
 *   4. the model (BPE) turns each piece into ids;
 *   5. the post-processor adds special tokens.
 * Pieces are (pointer, length) views; text that a step rewrites lives in a per-call arena. */

#define REGEX_MATCH_LIMIT 10000000u /* PCRE2 backtracking steps per match: bounds pathological patterns */

/* ---- small containers ------------------------------------------------------------------------ */

struct arena_chunk {
    struct arena_chunk *next;
    size_t used, cap;
    _Alignas(16) char data[];
};
struct arena {
    struct arena_chunk *head;
};

static void *arena_alloc(struct arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    struct arena_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > 65536 ? n : 65536;
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

static void arena_free(struct arena *a)
{
    while (a->head) {
        struct arena_chunk *n = a->head->next;
        kr_free(a->head);
        a->head = n;
    }
}

struct piece {
    const char *s; /* [len] UTF-8 */
    size_t len;
    int32_t id;    /* >= 0: an added token (final); -1: text to tokenize */
    bool first;    /* starts at offset 0 of the original input */
};
struct pieces {
    struct piece *v; /* [n] */
    size_t n, cap;
};

static enum kr_status pieces_push(struct pieces *p, const char *s, size_t len, int32_t id, bool first)
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

/* Match ranges of a pattern over one piece: [a, b) with is_match. */
struct range {
    size_t a, b;
    bool m;
};
struct ranges {
    struct range *v;
    size_t n, cap;
};

static enum kr_status ranges_push(struct ranges *r, size_t a, size_t b, bool m)
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

/* ---- string -> id map -------------------------------------------------------------------------- */

struct smap_slot {
    const char *key; /* borrowed; NULL = empty slot */
    uint32_t len;
    int32_t val;
};
struct smap {
    struct smap_slot *slots; /* [cap] */
    size_t cap, n;
};

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

static enum kr_status smap_init(struct smap *m, size_t expect)
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

static enum kr_status smap_put(struct smap *m, const char *key, size_t len, int32_t val)
{
    if ((m->n + 1) * 2 > m->cap) {
        struct smap old = *m;
        if (smap_init(m, old.cap) != KR_OK) {
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

static bool smap_get(const struct smap *m, const char *key, size_t len, int32_t *val)
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

/* ---- merge map: (left id, right id) -> (rank, merged id) ------------------------------------ */

struct mmap_slot {
    uint64_t key; /* (left << 32 | right) + 1; 0 = empty */
    int32_t rank;
    int32_t id;
};
struct mmap {
    struct mmap_slot *slots;
    size_t cap, n;
};

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static struct mmap_slot *mmap_find(const struct mmap *m, uint64_t key)
{
    size_t i = (size_t)mix64(key) & (m->cap - 1);
    while (m->slots[i].key && m->slots[i].key != key) {
        i = (i + 1) & (m->cap - 1);
    }
    return &m->slots[i];
}

static bool mmap_get(const struct mmap *m, int32_t a, int32_t b, int32_t *rank, int32_t *id)
{
    if (!m->cap) {
        return false;
    }
    const struct mmap_slot *s = mmap_find(m, (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1);
    if (!s->key) {
        return false;
    }
    *rank = s->rank;
    *id = s->id;
    return true;
}

/* ---- component descriptions -------------------------------------------------------------------- */

/* A split/replace pattern: a literal string or a compiled regex. */
struct pattern {
    char *lit;       /* literal (when re == NULL) */
    size_t lit_len;
    pcre2_code *re;
};

enum norm_type {
    NORM_NFC, NORM_NFD, NORM_NFKC, NORM_NFKD, NORM_LOWERCASE, NORM_STRIP, NORM_STRIP_ACCENTS,
    NORM_PREPEND, NORM_APPEND, NORM_REPLACE, NORM_BYTE_LEVEL, NORM_SEQUENCE,
};
struct normalizer {
    enum norm_type type;
    char *str;              /* PREPEND / APPEND / REPLACE content */
    size_t str_len;
    struct pattern pat;     /* REPLACE */
    bool left, right;       /* STRIP */
    struct normalizer *sub; /* SEQUENCE: [n_sub] */
    size_t n_sub;
};

enum split_behavior { SPLIT_REMOVED, SPLIT_ISOLATED, SPLIT_MERGED_PREV, SPLIT_MERGED_NEXT, SPLIT_CONTIGUOUS };
enum pretok_type {
    PT_BYTE_LEVEL, PT_SPLIT, PT_DIGITS, PT_METASPACE, PT_WHITESPACE, PT_WHITESPACE_SPLIT, PT_PUNCTUATION,
    PT_BERT, PT_CHAR_DELIMITER, PT_SEQUENCE,
};
enum prepend_scheme { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER };
struct pretok {
    enum pretok_type type;
    struct pattern pat;           /* SPLIT; WHITESPACE and BYTE_LEVEL use the tokenizer's shared regexes */
    enum split_behavior behavior; /* SPLIT, PUNCTUATION */
    bool invert;                  /* SPLIT */
    bool add_prefix_space;        /* BYTE_LEVEL */
    bool use_regex;               /* BYTE_LEVEL */
    bool individual_digits;       /* DIGITS */
    uint32_t ch;                  /* METASPACE replacement, CHAR_DELIMITER delimiter */
    enum prepend_scheme prepend;  /* METASPACE */
    bool split;                   /* METASPACE */
    struct pretok *sub;           /* SEQUENCE: [n_sub] */
    size_t n_sub;
};

enum dec_type { DEC_BYTE_LEVEL, DEC_METASPACE, DEC_REPLACE, DEC_BYTE_FALLBACK, DEC_FUSE, DEC_STRIP, DEC_BPE, DEC_SEQUENCE };
struct decoder {
    enum dec_type type;
    uint32_t ch;                 /* METASPACE replacement, STRIP content */
    enum prepend_scheme prepend; /* METASPACE */
    struct pattern pat;          /* REPLACE */
    char *str;                   /* REPLACE content, BPE suffix */
    size_t str_len;
    size_t start, stop;          /* STRIP */
    struct decoder *sub;         /* SEQUENCE */
    size_t n_sub;
};

/* A post-processor reduced to what matters for ids: the templates around sequence A. */
struct post_item {
    bool is_seq;     /* $A */
    int32_t *ids;    /* [n_ids] special token ids (when !is_seq) */
    size_t n_ids;
};
struct postproc {
    bool is_template; /* false: no-op (ByteLevel) */
    struct post_item *items;
    size_t n_items;
    struct postproc *sub; /* Sequence: [n_sub] */
    size_t n_sub;
};

struct added_token {
    char *content;        /* as written in tokenizer.json */
    size_t len;
    char *match;          /* what is searched: content, or normalized content when `normalized` */
    size_t match_len;
    int32_t id;
    bool special, lstrip, rstrip, single_word, normalized;
};

/* Byte trie over added-token strings, for leftmost-longest matching. */
struct trie_node {
    int32_t first_child; /* index or -1 */
    int32_t next;        /* next sibling or -1 */
    int32_t token;       /* index into added[] ending here, or -1 */
    unsigned char byte;
};
struct trie {
    struct trie_node *nodes; /* [n]; node 0 is the root */
    size_t n, cap;
    bool first_byte[256];    /* bytes that start some token */
};

struct kr_tokenizer {
    /* model (BPE) */
    char *pool;                  /* all vocab strings, NUL-separated */
    struct smap vocab;           /* token string -> id */
    const char **id_str;         /* [n_ids] token string per id (model vocab or added token), NULL if none */
    uint32_t *id_len;            /* [n_ids] */
    bool *id_special;            /* [n_ids] the string is a special added token's content */
    int32_t n_ids;
    struct mmap merges;
    int32_t unk_id;              /* -1: none */
    char *cont_prefix, *eow_suffix;
    size_t cont_prefix_len, eow_suffix_len;
    bool fuse_unk, byte_fallback, ignore_merges;
    int32_t byte_ids[256];       /* <0xXX> ids for byte_fallback (-1: missing) */

    struct added_token *added;   /* [n_added] */
    size_t n_added;
    struct smap added_map;       /* content -> id */
    struct trie trie_raw, trie_norm;

    struct normalizer *norm;     /* may be NULL */
    struct pretok *pretok;       /* may be NULL */
    struct decoder *dec;         /* may be NULL */
    struct postproc *post;       /* may be NULL */

    pcre2_code *re_gpt2;         /* ByteLevel's built-in regex (compiled when used) */
    pcre2_code *re_whitespace;   /* Whitespace pre-tokenizer's regex (compiled when used) */
    pcre2_general_context *gctx;

    char bytes_char[256][3];     /* byte-level alphabet: UTF-8 of the char for each byte */
    uint8_t bytes_char_len[256];
    int16_t char_byte[0x144];    /* inverse for code points < 0x144, -1 elsewhere */

    char *bos_token, *eos_token; /* from tokenizer_config.json */
    int32_t bos_id, eos_id;
    char *chat_template;
};

/* ---- errors ------------------------------------------------------------------------------------ */

static enum kr_status fmt_err(struct kr_err *err, const char *where, const char *fmt, const char *what)
{
    return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: %s%s", where, fmt, what ? what : "");
}

/* ---- PCRE2 -------------------------------------------------------------------------------------- */

static void *pcre_malloc(size_t n, void *ud)
{
    (void)ud;
    return kr_malloc(n);
}

static void pcre_free(void *p, void *ud)
{
    (void)ud;
    kr_free(p);
}

/* Oniguruma's Unicode meaning of the classes whose PCRE2 (UCP) meaning differs. */
#define ONIG_SPACE "\\t-\\r\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}"
#define ONIG_WORD "\\p{L}\\p{M}\\p{Nd}\\p{Pc}"
#define ONIG_HEX "0-9a-fA-F"

/* Rewrites \s \S \w \W \h \H into explicit classes with Oniguruma's meaning (PCRE2's \s adds
 * U+180E, its \w lacks marks and connector punctuation, and its \h is horizontal space, not a hex
 * digit). Inside a character class only the positive forms can be inlined; the negated ones are
 * left alone. Returns a new kr_malloc'd string. */
static char *onig_to_pcre(const char *src, size_t n)
{
    struct kr_buf_s b = {0};
    bool in_class = false;
    size_t class_start = 0;
    for (size_t i = 0; i < n; i++) {
        char c = src[i];
        if (c == '\\' && i + 1 < n) {
            char e = src[i + 1];
            const char *rep = NULL;
            bool neg = false;
            switch (e) {
            case 's': rep = ONIG_SPACE; break;
            case 'S': rep = ONIG_SPACE; neg = true; break;
            case 'w': rep = ONIG_WORD; break;
            case 'W': rep = ONIG_WORD; neg = true; break;
            case 'h': rep = ONIG_HEX; break;
            case 'H': rep = ONIG_HEX; neg = true; break;
            default: break;
            }
            if (rep && !in_class) {
                kr_bs_append(&b, neg ? "[^" : "[", neg ? 2 : 1);
                kr_bs_append(&b, rep, strlen(rep));
                kr_bs_putc(&b, ']');
            } else if (rep && !neg) {
                kr_bs_append(&b, rep, strlen(rep));
            } else {
                kr_bs_append(&b, src + i, 2);
            }
            i++;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = true;
            class_start = i;
            kr_bs_putc(&b, c);
            if (i + 1 < n && src[i + 1] == '^') {
                kr_bs_putc(&b, '^');
                i++;
            }
            if (i + 1 < n && src[i + 1] == ']') { /* a leading ] is literal */
                kr_bs_putc(&b, ']');
                i++;
            }
            continue;
        }
        if (in_class && c == '[' && i + 1 < n && src[i + 1] == ':') { /* POSIX [:name:] */
            const char *end = strstr(src + i + 2, ":]");
            if (end && (size_t)(end - src) < n) {
                size_t l = (size_t)(end - (src + i)) + 2;
                kr_bs_append(&b, src + i, l);
                i += l - 1;
                continue;
            }
        }
        if (in_class && c == ']' && i > class_start) {
            in_class = false;
        }
        kr_bs_putc(&b, c);
    }
    if (!b.p) {
        kr_bs_reserve(&b, 0);
    }
    return b.p;
}

static enum kr_status compile_regex(struct kr_tokenizer *t, const char *src, size_t n, pcre2_code **out,
                                    const char *where, struct kr_err *err)
{
    char *pat = onig_to_pcre(src, n);
    if (!pat) {
        return KR_ERR_NOMEM;
    }
    pcre2_compile_context *cc = pcre2_compile_context_create(t->gctx);
    int ec = 0;
    PCRE2_SIZE eo = 0;
    pcre2_code *re = cc ? pcre2_compile((PCRE2_SPTR)pat, strlen(pat), PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE,
                                        &ec, &eo, cc)
                        : NULL;
    pcre2_compile_context_free(cc);
    kr_free(pat);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof(msg));
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: cannot compile regex /%.*s/: %s", where,
                          (int)(n > 200 ? 200 : n), src, (const char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* falls back to the interpreter if JIT is unavailable */
    *out = re;
    return KR_OK;
}

/* Per-call regex state. */
struct rx {
    pcre2_match_data *md;
    pcre2_match_context *mc;
    struct kr_err *err;
};

/* Finds the leftmost match of `re` in s[0..n) starting at `from`. Returns 1 with [*a, *b), 0 when
 * there is none, or a negative kr_status. */
static int rx_search(struct rx *x, const pcre2_code *re, const char *s, size_t n, size_t from, size_t *a, size_t *b)
{
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, from, PCRE2_NO_UTF_CHECK, x->md, x->mc);
    if (rc == PCRE2_ERROR_NOMATCH) {
        return 0;
    }
    if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        return kr_err_set(x->err, rc == PCRE2_ERROR_NOMEMORY ? KR_ERR_NOMEM : KR_ERR_INVAL,
                          "tokenizer regex failed on a %zu-byte piece: %s", n, (const char *)msg);
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(x->md);
    *a = ov[0];
    *b = ov[1];
    return 1;
}

static size_t char_len_at(const char *s, size_t n, size_t i)
{
    if (i >= n) {
        return 1;
    }
    uint32_t cp;
    return kr_utf8_next(s + i, &cp);
}

static int pattern_search(struct rx *x, const struct pattern *p, const char *s, size_t n, size_t from, size_t *a,
                          size_t *b)
{
    if (p->re) {
        return rx_search(x, p->re, s, n, from, a, b);
    }
    if (p->lit_len == 0) {
        *a = *b = from;
        return 1;
    }
    for (size_t i = from; i + p->lit_len <= n; i++) {
        if (s[i] == p->lit[0] && memcmp(s + i, p->lit, p->lit_len) == 0) {
            *a = i;
            *b = i + p->lit_len;
            return 1;
        }
    }
    return 0;
}

/* HF's Pattern::find_matches for a regex or literal, iterated like the onig crate's find_iter
 * (an empty match right after the previous match is skipped by advancing one character). */
static enum kr_status find_matches_pattern(struct rx *x, const struct pattern *p, const char *s, size_t n,
                                           struct ranges *out)
{
    out->n = 0;
    if (n == 0) {
        return ranges_push(out, 0, 0, false);
    }
    size_t last_end = 0, prev = 0;
    bool have_last = false;
    size_t last_match_end = 0;
    while (last_end <= n) {
        size_t a, b;
        int r = pattern_search(x, p, s, n, last_end, &a, &b);
        if (r < 0) {
            return (enum kr_status)r;
        }
        if (r == 0) {
            break;
        }
        if (a == b && have_last && last_match_end == b) {
            last_end += char_len_at(s, n, last_end);
            continue;
        }
        last_end = b;
        last_match_end = b;
        have_last = true;
        if (prev != a && ranges_push(out, prev, a, false) != KR_OK) {
            return KR_ERR_NOMEM;
        }
        if (ranges_push(out, a, b, true) != KR_OK) {
            return KR_ERR_NOMEM;
        }
        prev = b;
    }
    if (prev != n) {
        return ranges_push(out, prev, n, false);
    }
    return KR_OK;
}

/* find_matches for a character predicate: every matching character is one match. */
enum char_pred { PRED_NUMERIC, PRED_WHITESPACE, PRED_PUNCT, PRED_EQ };
static bool pred_match(enum char_pred pred, uint32_t want, uint32_t cp)
{
    switch (pred) {
    case PRED_NUMERIC: return kr_uni_is_numeric(cp);
    case PRED_WHITESPACE: return kr_uni_is_white_space(cp);
    case PRED_PUNCT: return kr_uni_is_punctuation(cp);
    case PRED_EQ: return cp == want;
    }
    return false;
}

static enum kr_status find_matches_pred(enum char_pred pred, uint32_t want, const char *s, size_t n,
                                        struct ranges *out)
{
    out->n = 0;
    if (n == 0) {
        return ranges_push(out, 0, 0, false);
    }
    size_t last = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t l = kr_utf8_next(s + i, &cp);
        if (pred_match(pred, want, cp)) {
            if (last < i && ranges_push(out, last, i, false) != KR_OK) {
                return KR_ERR_NOMEM;
            }
            if (ranges_push(out, i, i + l, true) != KR_OK) {
                return KR_ERR_NOMEM;
            }
            last = i + l;
        }
        i += l;
    }
    if (n > last) {
        return ranges_push(out, last, n, false);
    }
    return KR_OK;
}

/* NormalizedString::split: applies a delimiter behavior to the ranges of one piece and pushes
 * the non-empty results. */
static enum kr_status apply_behavior(const struct piece *pc, struct ranges *r, enum split_behavior bh, bool invert,
                                     struct pieces *out)
{
    if (invert) {
        for (size_t i = 0; i < r->n; i++) {
            r->v[i].m = !r->v[i].m;
        }
    }
    size_t n = 0; /* results are compacted in place in r->v */
    switch (bh) {
    case SPLIT_ISOLATED:
        for (size_t i = 0; i < r->n; i++) {
            r->v[i].m = false;
        }
        n = r->n;
        break;
    case SPLIT_REMOVED:
        n = r->n;
        break;
    case SPLIT_CONTIGUOUS: {
        bool prev = false;
        for (size_t i = 0; i < r->n; i++) {
            bool m = r->v[i].m;
            if (m && prev && n > 0) {
                r->v[n - 1].b = r->v[i].b;
            } else {
                r->v[n++] = (struct range){r->v[i].a, r->v[i].b, false};
            }
            prev = m;
        }
        break;
    }
    case SPLIT_MERGED_PREV: {
        bool prev = false;
        for (size_t i = 0; i < r->n; i++) {
            bool m = r->v[i].m;
            if (m && !prev && n > 0) {
                r->v[n - 1].b = r->v[i].b;
            } else {
                r->v[n++] = (struct range){r->v[i].a, r->v[i].b, false};
            }
            prev = m;
        }
        break;
    }
    case SPLIT_MERGED_NEXT: {
        /* Walk backwards, merging a match into the range that follows it; results are built from
         * the end of the array and then moved to the front. */
        bool prev = false;
        size_t w = r->n; /* write position, decreasing */
        for (size_t k = r->n; k-- > 0;) {
            struct range cur = r->v[k];
            if (cur.m && !prev && w < r->n) {
                r->v[w].a = cur.a;
            } else {
                r->v[--w] = (struct range){cur.a, cur.b, false};
            }
            prev = cur.m;
        }
        n = r->n - w;
        memmove(r->v, r->v + w, n * sizeof(*r->v));
        break;
    }
    }
    for (size_t i = 0; i < n; i++) {
        if (r->v[i].m || r->v[i].a == r->v[i].b) {
            continue;
        }
        if (pieces_push(out, pc->s + r->v[i].a, r->v[i].b - r->v[i].a, -1, pc->first && r->v[i].a == 0) != KR_OK) {
            return KR_ERR_NOMEM;
        }
    }
    return KR_OK;
}

/* ---- normalizers ---------------------------------------------------------------------------- */

struct ctx {
    const struct kr_tokenizer *t;
    struct arena arena;
    struct rx rx;
    struct ranges ranges;
    struct kr_buf_s buf; /* scratch */
    struct kr_err *err;
};

static enum kr_status byte_level_map(struct ctx *c, const char *s, size_t n, const char **out, size_t *out_len)
{
    char *p = arena_alloc(&c->arena, n * 2 + 1);
    if (!p) {
        return KR_ERR_NOMEM;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char byte = (unsigned char)s[i];
        memcpy(p + k, c->t->bytes_char[byte], c->t->bytes_char_len[byte]);
        k += c->t->bytes_char_len[byte];
    }
    *out = p;
    *out_len = k;
    return KR_OK;
}

/* Copies the scratch buffer into the arena as the new text of a piece. */
static enum kr_status take_buf(struct ctx *c, const char **s, size_t *n)
{
    char *p = arena_alloc(&c->arena, c->buf.len + 1);
    if (!p) {
        return KR_ERR_NOMEM;
    }
    memcpy(p, c->buf.p ? c->buf.p : "", c->buf.len);
    *s = p;
    *n = c->buf.len;
    return KR_OK;
}

static enum kr_status replace_all(struct ctx *c, const struct pattern *pat, const char *rep, size_t rep_len,
                                  const char *s, size_t n, const char **out, size_t *out_len)
{
    enum kr_status st = find_matches_pattern(&c->rx, pat, s, n, &c->ranges);
    if (st != KR_OK) {
        return st;
    }
    c->buf.len = 0;
    for (size_t i = 0; i < c->ranges.n; i++) {
        const struct range *r = &c->ranges.v[i];
        st = r->m ? kr_bs_append(&c->buf, rep, rep_len) : kr_bs_append(&c->buf, s + r->a, r->b - r->a);
        if (st != KR_OK) {
            return st;
        }
    }
    return take_buf(c, out, out_len);
}

static enum kr_status normalize(struct ctx *c, const struct normalizer *nz, const char **s, size_t *n)
{
    enum kr_status st = KR_OK;
    switch (nz->type) {
    case NORM_SEQUENCE:
        for (size_t i = 0; i < nz->n_sub && st == KR_OK; i++) {
            st = normalize(c, &nz->sub[i], s, n);
        }
        return st;
    case NORM_NFC:
    case NORM_NFD:
    case NORM_NFKC:
    case NORM_NFKD: {
        static const enum kr_uni_nf forms[] = {KR_NF_C, KR_NF_D, KR_NF_KC, KR_NF_KD};
        c->buf.len = 0;
        st = kr_uni_normalize(forms[nz->type - NORM_NFC], *s, *n, &c->buf);
        return st == KR_OK ? take_buf(c, s, n) : st;
    }
    case NORM_LOWERCASE:
        c->buf.len = 0;
        for (size_t i = 0; i < *n && st == KR_OK;) {
            uint32_t cp;
            i += kr_utf8_next(*s + i, &cp);
            if (cp == 0x130) { /* Rust's char::to_lowercase uses the full mapping: U+0130 -> "i\u0307" */
                st = kr_bs_append(&c->buf, "i\xCC\x87", 3);
            } else {
                st = kr_bs_put_cp(&c->buf, kr_uni_tolower(cp));
            }
        }
        return st == KR_OK ? take_buf(c, s, n) : st;
    case NORM_STRIP_ACCENTS:
        c->buf.len = 0;
        for (size_t i = 0; i < *n && st == KR_OK;) {
            uint32_t cp;
            size_t l = kr_utf8_next(*s + i, &cp);
            if (!kr_uni_is_mark_nonspacing(cp)) {
                st = kr_bs_append(&c->buf, *s + i, l);
            }
            i += l;
        }
        return st == KR_OK ? take_buf(c, s, n) : st;
    case NORM_STRIP: {
        size_t a = 0, b = *n;
        while (nz->left && a < b) {
            uint32_t cp;
            size_t l = kr_utf8_next(*s + a, &cp);
            if (!kr_uni_is_white_space(cp)) {
                break;
            }
            a += l;
        }
        while (nz->right && b > a) {
            size_t k = b - 1;
            while (k > a && ((unsigned char)(*s)[k] & 0xC0) == 0x80) {
                k--;
            }
            uint32_t cp;
            kr_utf8_next(*s + k, &cp);
            if (!kr_uni_is_white_space(cp)) {
                break;
            }
            b = k;
        }
        *s += a;
        *n = b - a;
        return KR_OK;
    }
    case NORM_PREPEND:
    case NORM_APPEND: {
        if (*n == 0) {
            return KR_OK;
        }
        char *p = arena_alloc(&c->arena, *n + nz->str_len + 1);
        if (!p) {
            return KR_ERR_NOMEM;
        }
        if (nz->type == NORM_PREPEND) {
            memcpy(p, nz->str, nz->str_len);
            memcpy(p + nz->str_len, *s, *n);
        } else {
            memcpy(p, *s, *n);
            memcpy(p + *n, nz->str, nz->str_len);
        }
        *s = p;
        *n += nz->str_len;
        return KR_OK;
    }
    case NORM_REPLACE:
        return replace_all(c, &nz->pat, nz->str, nz->str_len, *s, *n, s, n);
    case NORM_BYTE_LEVEL:
        return byte_level_map(c, *s, *n, s, n);
    }
    return KR_ERR_INTERNAL;
}

/* ---- pre-tokenizers --------------------------------------------------------------------------- */

static enum kr_status pretok_one(struct ctx *c, const struct pretok *pt, const struct piece *pc, struct pieces *out)
{
    enum kr_status st;
    const struct kr_tokenizer *t = c->t;
    switch (pt->type) {
    case PT_SEQUENCE:
        return KR_ERR_INTERNAL; /* handled by pretok_apply */
    case PT_SPLIT:
        st = find_matches_pattern(&c->rx, &pt->pat, pc->s, pc->len, &c->ranges);
        return st == KR_OK ? apply_behavior(pc, &c->ranges, pt->behavior, pt->invert, out) : st;
    case PT_DIGITS:
        st = find_matches_pred(PRED_NUMERIC, 0, pc->s, pc->len, &c->ranges);
        return st == KR_OK ? apply_behavior(pc, &c->ranges, pt->individual_digits ? SPLIT_ISOLATED : SPLIT_CONTIGUOUS,
                                            false, out)
                           : st;
    case PT_WHITESPACE: {
        struct pattern p = {.re = t->re_whitespace};
        st = find_matches_pattern(&c->rx, &p, pc->s, pc->len, &c->ranges);
        return st == KR_OK ? apply_behavior(pc, &c->ranges, SPLIT_REMOVED, true, out) : st;
    }
    case PT_WHITESPACE_SPLIT:
        st = find_matches_pred(PRED_WHITESPACE, 0, pc->s, pc->len, &c->ranges);
        return st == KR_OK ? apply_behavior(pc, &c->ranges, SPLIT_REMOVED, false, out) : st;
    case PT_PUNCTUATION:
        st = find_matches_pred(PRED_PUNCT, 0, pc->s, pc->len, &c->ranges);
        return st == KR_OK ? apply_behavior(pc, &c->ranges, pt->behavior, false, out) : st;
    case PT_CHAR_DELIMITER:
        st = find_matches_pred(PRED_EQ, pt->ch, pc->s, pc->len, &c->ranges);
        return st == KR_OK ? apply_behavior(pc, &c->ranges, SPLIT_REMOVED, false, out) : st;
    case PT_BERT: {
        struct pieces tmp = {0};
        st = find_matches_pred(PRED_WHITESPACE, 0, pc->s, pc->len, &c->ranges);
        if (st == KR_OK) {
            st = apply_behavior(pc, &c->ranges, SPLIT_REMOVED, false, &tmp);
        }
        for (size_t i = 0; i < tmp.n && st == KR_OK; i++) {
            st = find_matches_pred(PRED_PUNCT, 0, tmp.v[i].s, tmp.v[i].len, &c->ranges);
            if (st == KR_OK) {
                st = apply_behavior(&tmp.v[i], &c->ranges, SPLIT_ISOLATED, false, out);
            }
        }
        kr_free(tmp.v);
        return st;
    }
    case PT_METASPACE: {
        char rep[4];
        size_t rl = kr_utf8_put(pt->ch, rep);
        c->buf.len = 0;
        st = KR_OK;
        bool starts = pc->len > 0 && (pc->s[0] == ' ' || (pc->len >= rl && memcmp(pc->s, rep, rl) == 0));
        if (!starts && (pt->prepend == PREPEND_ALWAYS || (pt->prepend == PREPEND_FIRST && pc->first))) {
            st = kr_bs_append(&c->buf, rep, rl);
        }
        for (size_t i = 0; i < pc->len && st == KR_OK; i++) {
            st = pc->s[i] == ' ' ? kr_bs_append(&c->buf, rep, rl) : kr_bs_putc(&c->buf, pc->s[i]);
        }
        struct piece np = *pc;
        if (st == KR_OK) {
            st = take_buf(c, &np.s, &np.len);
        }
        if (st != KR_OK) {
            return st;
        }
        if (!pt->split) {
            return np.len ? pieces_push(out, np.s, np.len, -1, np.first) : KR_OK;
        }
        st = find_matches_pred(PRED_EQ, pt->ch, np.s, np.len, &c->ranges);
        return st == KR_OK ? apply_behavior(&np, &c->ranges, SPLIT_MERGED_NEXT, false, out) : st;
    }
    case PT_BYTE_LEVEL: {
        struct piece np = *pc;
        if (pt->add_prefix_space && !(pc->len > 0 && pc->s[0] == ' ')) {
            char *p = arena_alloc(&c->arena, pc->len + 2);
            if (!p) {
                return KR_ERR_NOMEM;
            }
            p[0] = ' ';
            memcpy(p + 1, pc->s, pc->len);
            np.s = p;
            np.len = pc->len + 1;
        }
        size_t start = out->n;
        if (pt->use_regex) {
            struct pattern p = {.re = t->re_gpt2};
            st = find_matches_pattern(&c->rx, &p, np.s, np.len, &c->ranges);
            if (st == KR_OK) {
                st = apply_behavior(&np, &c->ranges, SPLIT_ISOLATED, false, out);
            }
        } else {
            st = np.len ? pieces_push(out, np.s, np.len, -1, np.first) : KR_OK;
        }
        for (size_t i = start; i < out->n && st == KR_OK; i++) {
            st = byte_level_map(c, out->v[i].s, out->v[i].len, &out->v[i].s, &out->v[i].len);
        }
        return st;
    }
    }
    return KR_ERR_INTERNAL;
}

/* PreTokenizedString::split semantics: pieces that already carry a token pass through. */
static enum kr_status pretok_apply(struct ctx *c, const struct pretok *pt, struct pieces *p)
{
    if (pt->type == PT_SEQUENCE) {
        for (size_t i = 0; i < pt->n_sub; i++) {
            enum kr_status st = pretok_apply(c, &pt->sub[i], p);
            if (st != KR_OK) {
                return st;
            }
        }
        return KR_OK;
    }
    struct pieces out = {0};
    enum kr_status st = KR_OK;
    for (size_t i = 0; i < p->n && st == KR_OK; i++) {
        if (p->v[i].id >= 0) {
            st = pieces_push(&out, p->v[i].s, p->v[i].len, p->v[i].id, p->v[i].first);
        } else {
            st = pretok_one(c, pt, &p->v[i], &out);
        }
    }
    kr_free(p->v);
    *p = out;
    return st;
}

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

static enum kr_status trie_insert(struct trie *tr, const char *s, size_t n, int32_t token)
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
                pieces_push(out, s + start_offset, start - start_offset, -1, pc->first && start_offset == 0) != KR_OK) {
                return KR_ERR_NOMEM;
            }
            if (pieces_push(out, s + start, stop - start, at->id, false) != KR_OK) {
                return KR_ERR_NOMEM;
            }
            start_offset = stop;
            if (i < stop) {
                i = stop;
            }
        }
    }
    if (start_offset < n) {
        return pieces_push(out, s + start_offset, n - start_offset, -1, pc->first && start_offset == 0);
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
    if (t->ignore_merges && smap_get(&t->vocab, s, len, &id)) {
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
            if (!w->sbuf.p) {
                return KR_ERR_NOMEM;
            }
            key = w->sbuf.p;
            key_len = w->sbuf.len;
        }
        i += l;
        if (smap_get(&t->vocab, key, key_len, &id)) {
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
        if (mmap_get(&t->merges, w->syms[i].id, w->syms[i + 1].id, &rank, &nid) &&
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
        if (!mmap_get(&t->merges, a->id, b->id, &rank, &nid) || nid != top.new_id || rank != top.rank) {
            continue;
        }
        a->id = nid;
        b->alive = false;
        a->next = b->next;
        if (b->next >= 0) {
            w->syms[b->next].prev = top.pos;
        }
        if (a->prev >= 0 && mmap_get(&t->merges, w->syms[a->prev].id, a->id, &rank, &nid) &&
            heap_push(w, (struct heap_item){rank, a->prev, nid}) != KR_OK) {
            return KR_ERR_NOMEM;
        }
        if (a->next >= 0 && mmap_get(&t->merges, a->id, w->syms[a->next].id, &rank, &nid) &&
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
    c.rx.err = err;
    c.rx.md = pcre2_match_data_create(8, t->gctx);
    c.rx.mc = pcre2_match_context_create(t->gctx);
    if (!c.rx.md || !c.rx.mc) {
        goto fail;
    }
    pcre2_set_match_limit(c.rx.mc, REGEX_MATCH_LIMIT);

    struct piece whole = {text ? text : "", len, -1, true};
    /* 1. added tokens matched on the raw text */
    if ((st = split_added(t, &t->trie_raw, &whole, &p)) != KR_OK) {
        goto fail;
    }
    /* 2. normalize the other pieces, then match normalized added tokens */
    for (size_t i = 0; i < p.n; i++) {
        struct piece pc = p.v[i];
        if (pc.id >= 0) {
            if ((st = pieces_push(&q, pc.s, pc.len, pc.id, pc.first)) != KR_OK) {
                goto fail;
            }
            continue;
        }
        if (t->norm && (st = normalize(&c, t->norm, &pc.s, &pc.len)) != KR_OK) {
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
    if (t->pretok && (st = pretok_apply(&c, t->pretok, &q)) != KR_OK) {
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
    arena_free(&c.arena);
    pcre2_match_data_free(c.rx.md);
    pcre2_match_context_free(c.rx.mc);
    return st;
}

/* ---- decode ------------------------------------------------------------------------------------ */

struct toks {
    struct { const char *s; size_t len; } *v;
    size_t n, cap;
};

static enum kr_status toks_push(struct toks *t, const char *s, size_t len)
{
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        void *v = kr_realloc(t->v, cap * sizeof(*t->v));
        if (!v) {
            return KR_ERR_NOMEM;
        }
        t->v = v;
        t->cap = cap;
    }
    t->v[t->n].s = s;
    t->v[t->n].len = len;
    t->n++;
    return KR_OK;
}

static enum kr_status take_buf_tok(struct ctx *c, struct toks *out)
{
    const char *s;
    size_t n;
    enum kr_status st = take_buf(c, &s, &n);
    return st == KR_OK ? toks_push(out, s, n) : st;
}

static int hexval(char ch)
{
    if (ch >= '0' && ch <= '9') {
        return ch - '0';
    }
    if (ch >= 'a' && ch <= 'f') {
        return ch - 'a' + 10;
    }
    if (ch >= 'A' && ch <= 'F') {
        return ch - 'A' + 10;
    }
    return -1;
}

/* u8::from_str_radix(&token[3..5], 16) on a 6-byte "<0x..>" token (a leading '+' is accepted). */
static int byte_token_value(const char *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') {
        return -1;
    }
    if (s[3] == '+') {
        return hexval(s[4]);
    }
    int hi = hexval(s[3]), lo = hexval(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

static enum kr_status decode_step(struct ctx *c, const struct decoder *d, struct toks *in, struct toks *out)
{
    enum kr_status st = KR_OK;
    const struct kr_tokenizer *t = c->t;
    out->n = 0;
    switch (d->type) {
    case DEC_SEQUENCE:
        return KR_ERR_INTERNAL;
    case DEC_BYTE_LEVEL: {
        struct kr_buf_s raw = {0};
        for (size_t i = 0; i < in->n && st == KR_OK; i++) {
            const char *s = in->v[i].s;
            size_t n = in->v[i].len;
            size_t mark = raw.len;
            bool ok = true;
            for (size_t k = 0; k < n && st == KR_OK;) {
                uint32_t cp;
                k += kr_utf8_next(s + k, &cp);
                if (cp >= 0x144 || t->char_byte[cp] < 0) {
                    ok = false;
                    break;
                }
                st = kr_bs_putc(&raw, (char)t->char_byte[cp]);
            }
            if (!ok) { /* a char outside the byte alphabet: the token's own UTF-8 bytes are used */
                raw.len = mark;
                st = kr_bs_append(&raw, s, n);
            }
        }
        c->buf.len = 0;
        if (st == KR_OK) {
            st = kr_bs_append_lossy(&c->buf, raw.p ? raw.p : "", raw.len);
        }
        kr_bs_free(&raw);
        return st == KR_OK ? take_buf_tok(c, out) : st;
    }
    case DEC_METASPACE:
        for (size_t i = 0; i < in->n && st == KR_OK; i++) {
            c->buf.len = 0;
            for (size_t k = 0; k < in->v[i].len && st == KR_OK;) {
                uint32_t cp;
                size_t l = kr_utf8_next(in->v[i].s + k, &cp);
                if (cp == d->ch) {
                    if (!(i == 0 && d->prepend != PREPEND_NEVER)) {
                        st = kr_bs_putc(&c->buf, ' ');
                    }
                } else {
                    st = kr_bs_append(&c->buf, in->v[i].s + k, l);
                }
                k += l;
            }
            if (st == KR_OK) {
                st = take_buf_tok(c, out);
            }
        }
        return st;
    case DEC_REPLACE:
        for (size_t i = 0; i < in->n && st == KR_OK; i++) {
            const char *s;
            size_t n;
            st = replace_all(c, &d->pat, d->str, d->str_len, in->v[i].s, in->v[i].len, &s, &n);
            if (st == KR_OK) {
                st = toks_push(out, s, n);
            }
        }
        return st;
    case DEC_BYTE_FALLBACK: {
        struct kr_buf_s bytes = {0};
        size_t n_bytes = 0;
        for (size_t i = 0; i <= in->n && st == KR_OK; i++) {
            int v = i < in->n ? byte_token_value(in->v[i].s, in->v[i].len) : -1;
            if (v >= 0) {
                st = kr_bs_putc(&bytes, (char)v);
                n_bytes++;
                continue;
            }
            if (n_bytes) {
                if (kr_utf8_validate(bytes.p, bytes.len) == bytes.len) {
                    c->buf.len = 0;
                    st = kr_bs_append(&c->buf, bytes.p, bytes.len);
                    if (st == KR_OK) {
                        st = take_buf_tok(c, out);
                    }
                } else {
                    for (size_t k = 0; k < n_bytes && st == KR_OK; k++) {
                        st = toks_push(out, "\xEF\xBF\xBD", 3);
                    }
                }
                bytes.len = 0;
                n_bytes = 0;
            }
            if (i < in->n && st == KR_OK) {
                st = toks_push(out, in->v[i].s, in->v[i].len);
            }
        }
        kr_bs_free(&bytes);
        return st;
    }
    case DEC_FUSE:
        c->buf.len = 0;
        for (size_t i = 0; i < in->n && st == KR_OK; i++) {
            st = kr_bs_append(&c->buf, in->v[i].s, in->v[i].len);
        }
        return st == KR_OK ? take_buf_tok(c, out) : st;
    case DEC_STRIP:
        for (size_t i = 0; i < in->n && st == KR_OK; i++) {
            const char *s = in->v[i].s;
            size_t n = in->v[i].len, a = 0, b = n;
            for (size_t k = 0; k < d->start && a < n; k++) {
                uint32_t cp;
                size_t l = kr_utf8_next(s + a, &cp);
                if (cp != d->ch) {
                    break;
                }
                a += l;
            }
            for (size_t k = 0; k < d->stop && b > a; k++) {
                size_t j = b - 1;
                while (j > 0 && ((unsigned char)s[j] & 0xC0) == 0x80) {
                    j--;
                }
                uint32_t cp;
                kr_utf8_next(s + j, &cp);
                if (cp != d->ch) {
                    break;
                }
                b = j;
            }
            st = toks_push(out, s + a, b - a);
        }
        return st;
    case DEC_BPE:
        for (size_t i = 0; i < in->n && st == KR_OK; i++) {
            struct pattern p = {.lit = d->str, .lit_len = d->str_len};
            const char *s;
            size_t n;
            bool last = i + 1 == in->n;
            st = replace_all(c, &p, last ? "" : " ", last ? 0 : 1, in->v[i].s, in->v[i].len, &s, &n);
            if (st == KR_OK) {
                st = toks_push(out, s, n);
            }
        }
        return st;
    }
    return KR_ERR_INTERNAL;
}

static enum kr_status decode_chain(struct ctx *c, const struct decoder *d, struct toks *in)
{
    if (d->type == DEC_SEQUENCE) {
        for (size_t i = 0; i < d->n_sub; i++) {
            enum kr_status st = decode_chain(c, &d->sub[i], in);
            if (st != KR_OK) {
                return st;
            }
        }
        return KR_OK;
    }
    struct toks out = {0};
    enum kr_status st = decode_step(c, d, in, &out);
    kr_free(in->v);
    *in = out;
    return st;
}

enum kr_status kr_tokenizer_decode(const struct kr_tokenizer *t, const int32_t *ids, int64_t n_ids,
                                   bool skip_special_tokens, char **text, size_t *len, struct kr_err *err)
{
    *text = NULL;
    *len = 0;
    struct ctx c = {.t = t, .err = err};
    struct toks tk = {0};
    struct kr_buf_s out = {0};
    enum kr_status st = KR_ERR_NOMEM;
    c.rx.err = err;
    c.rx.md = pcre2_match_data_create(8, t->gctx);
    c.rx.mc = pcre2_match_context_create(t->gctx);
    if (!c.rx.md || !c.rx.mc) {
        goto fail;
    }
    pcre2_set_match_limit(c.rx.mc, REGEX_MATCH_LIMIT);
    for (int64_t i = 0; i < n_ids; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_ids || !t->id_str[id] || (skip_special_tokens && t->id_special[id])) {
            continue;
        }
        if ((st = toks_push(&tk, t->id_str[id], t->id_len[id])) != KR_OK) {
            goto fail;
        }
    }
    if (t->dec && (st = decode_chain(&c, t->dec, &tk)) != KR_OK) {
        goto fail;
    }
    st = kr_bs_reserve(&out, 0);
    for (size_t i = 0; i < tk.n && st == KR_OK; i++) {
        if (!t->dec && i > 0) {
            st = kr_bs_putc(&out, ' ');
        }
        if (st == KR_OK) {
            st = kr_bs_append(&out, tk.v[i].s, tk.v[i].len);
        }
    }
    if (st != KR_OK) {
        goto fail;
    }
    *text = out.p;
    *len = out.len;
    out.p = NULL;
fail:
    if (st == KR_ERR_NOMEM) {
        kr_err_set(err, st, "tokenizer: out of memory while decoding %lld ids", (long long)n_ids);
    }
    kr_bs_free(&out);
    kr_free(tk.v);
    kr_free(c.ranges.v);
    kr_bs_free(&c.buf);
    arena_free(&c.arena);
    pcre2_match_data_free(c.rx.md);
    pcre2_match_context_free(c.rx.mc);
    return st;
}

/* ---- incremental detokenizer ------------------------------------------------------------------- */

struct kr_detok {
    const struct kr_tokenizer *tok;
    bool skip_special;
    int32_t *ids;        /* [n] window: ids since the start of the previous emission */
    size_t n, cap;
    size_t prefix_index; /* ids[0..prefix_index) decode to `prefix` */
    char *prefix;        /* decode of ids[0..prefix_index) */
    size_t prefix_len;
    char *piece;         /* the last piece returned */
};

enum kr_status kr_detok_create(const struct kr_tokenizer *tok, bool skip_special_tokens, struct kr_detok **out)
{
    struct kr_detok *d = kr_calloc(1, sizeof(*d));
    if (!d) {
        return KR_ERR_NOMEM;
    }
    d->tok = tok;
    d->skip_special = skip_special_tokens;
    *out = d;
    return KR_OK;
}

void kr_detok_destroy(struct kr_detok *d)
{
    if (!d) {
        return;
    }
    kr_free(d->ids);
    kr_free(d->prefix);
    kr_free(d->piece);
    kr_free(d);
}

static bool ends_with_replacement(const char *s, size_t n)
{
    return n >= 3 && memcmp(s + n - 3, "\xEF\xBF\xBD", 3) == 0;
}

enum kr_status kr_detok_push(struct kr_detok *d, int32_t id, const char **piece, size_t *len, struct kr_err *err)
{
    *piece = "";
    *len = 0;
    kr_free(d->piece);
    d->piece = NULL;
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 16;
        int32_t *v = kr_realloc(d->ids, cap * sizeof(*v));
        if (!v) {
            return kr_err_set(err, KR_ERR_NOMEM, "detokenizer: out of memory");
        }
        d->ids = v;
        d->cap = cap;
    }
    d->ids[d->n++] = id;
    char *s;
    size_t n;
    enum kr_status st = kr_tokenizer_decode(d->tok, d->ids, (int64_t)d->n, d->skip_special, &s, &n, err);
    if (st != KR_OK) {
        return st;
    }
    if (n <= d->prefix_len || ends_with_replacement(s, n)) {
        kr_free(s);
        return KR_OK;
    }
    if (d->prefix_len && memcmp(s, d->prefix, d->prefix_len) != 0) {
        kr_free(s);
        return kr_err_set(err, KR_ERR_INTERNAL, "detokenizer: the decoded window no longer starts with its prefix");
    }
    /* emit the new text; the window restarts at the previous read position */
    size_t new_prefix_index = d->n - d->prefix_index;
    memmove(d->ids, d->ids + d->prefix_index, (d->n - d->prefix_index) * sizeof(*d->ids));
    d->n -= d->prefix_index;
    d->prefix_index = new_prefix_index;
    char *p;
    size_t pn;
    st = kr_tokenizer_decode(d->tok, d->ids, (int64_t)d->n, d->skip_special, &p, &pn, err);
    if (st != KR_OK) {
        kr_free(s);
        return st;
    }
    size_t piece_len = n - d->prefix_len;
    memmove(s, s + d->prefix_len, piece_len);
    s[piece_len] = '\0';
    kr_free(d->prefix);
    d->prefix = p;
    d->prefix_len = pn;
    d->piece = s;
    *piece = s;
    *len = piece_len;
    return KR_OK;
}

enum kr_status kr_detok_flush(struct kr_detok *d, const char **piece, size_t *len, struct kr_err *err)
{
    *piece = "";
    *len = 0;
    kr_free(d->piece);
    d->piece = NULL;
    char *s;
    size_t n;
    enum kr_status st = kr_tokenizer_decode(d->tok, d->ids, (int64_t)d->n, d->skip_special, &s, &n, err);
    if (st != KR_OK) {
        return st;
    }
    if (n > d->prefix_len) {
        memmove(s, s + d->prefix_len, n - d->prefix_len);
        s[n - d->prefix_len] = '\0';
        *len = n - d->prefix_len;
        d->piece = s;
        *piece = s;
    } else {
        kr_free(s);
    }
    d->n = 0;
    d->prefix_index = 0;
    kr_free(d->prefix);
    d->prefix = NULL;
    d->prefix_len = 0;
    return KR_OK;
}
