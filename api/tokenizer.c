#define _POSIX_C_SOURCE 200809L

#include "tokenizer.h"

#include "alloc.h"
#include "file.h"
#include "unicode.h"

#include <utf8proc.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>

#include <errno.h>
#include <pthread.h>
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

    bool stream_window;          /* the decoder allows HF's windowed DecodeStream (see decoder_window_safe) */
    bool stream_byte_runs;       /* ByteFallback: a later <0xXX> token can still change a run's text */
    int32_t stream_hold_cp;      /* a Strip decoder's content removed at the end of the text, or -1 */

    char *bos_token, *eos_token; /* from tokenizer_config.json */
    int32_t bos_id, eos_id;
    char *chat_template;
};

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

/* Characters that the installed PCRE2 does not know yet (its Unicode tables are older than those
 * of utf8proc and of HF's Oniguruma: PCRE2 10.42 has Unicode 14, they have Unicode 15), by general
 * category. \p{..} classes are widened with them so that, e.g., U+1FAE8 (an emoji of Unicode 15)
 * is \p{S} for us as it is for HF. Computed once per process into static storage. */
#define NEW_RANGES_MAX 4096
static struct {
    uint32_t lo, hi;
    uint8_t cat; /* utf8proc category */
} g_new_ranges[NEW_RANGES_MAX];
static size_t g_n_new_ranges;
static pthread_once_t g_new_once = PTHREAD_ONCE_INIT;

static void find_new_chars(void)
{
    /* All code points that utf8proc assigns, one after the other, searched for \p{Cn}. */
    struct kr_buf_s all = {0};
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp++) {
        if ((cp >= 0xD800 && cp <= 0xDFFF) || utf8proc_category((utf8proc_int32_t)cp) == UTF8PROC_CATEGORY_CN) {
            continue;
        }
        if (kr_bs_put_cp(&all, cp) != KR_OK) {
            kr_bs_free(&all);
            return;
        }
    }
    int ec;
    PCRE2_SIZE eo;
    pcre2_general_context *gc = pcre2_general_context_create(pcre_malloc, pcre_free, NULL);
    pcre2_compile_context *cc = gc ? pcre2_compile_context_create(gc) : NULL;
    pcre2_code *re = cc ? pcre2_compile((PCRE2_SPTR) "\\p{Cn}", PCRE2_ZERO_TERMINATED, PCRE2_UTF, &ec, &eo, cc) : NULL;
    pcre2_match_data *md = re ? pcre2_match_data_create(1, gc) : NULL;
    size_t off = 0;
    while (md && off < all.len &&
           pcre2_match(re, (PCRE2_SPTR)all.p, all.len, off, PCRE2_NO_UTF_CHECK, md, NULL) > 0) {
        PCRE2_SIZE at = pcre2_get_ovector_pointer(md)[0];
        uint32_t cp;
        size_t l = kr_utf8_next(all.p + at, &cp);
        uint8_t cat = (uint8_t)utf8proc_category((utf8proc_int32_t)cp);
        size_t k = g_n_new_ranges;
        if (k > 0 && g_new_ranges[k - 1].cat == cat && g_new_ranges[k - 1].hi + 1 == cp) {
            g_new_ranges[k - 1].hi = cp;
        } else if (k < NEW_RANGES_MAX) {
            g_new_ranges[k].lo = g_new_ranges[k].hi = cp;
            g_new_ranges[k].cat = cat;
            g_n_new_ranges++;
        }
        off = at + l;
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    pcre2_compile_context_free(cc);
    pcre2_general_context_free(gc);
    kr_bs_free(&all);
}

/* First letters of the utf8proc categories, indexed by category. */
static const char CAT_NAMES[][3] = {"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No",
                                    "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs",
                                    "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};

/* Appends the new characters of general category `name` (1 or 2 letters) as class ranges. */
static void append_new_chars(struct kr_buf_s *b, const char *name, size_t n)
{
    for (size_t i = 0; i < g_n_new_ranges; i++) {
        const char *cat = CAT_NAMES[g_new_ranges[i].cat < 30 ? g_new_ranges[i].cat : 0];
        if (cat[0] != name[0] || (n == 2 && cat[1] != name[1])) {
            continue;
        }
        kr_bs_printf(b, "\\x{%x}-\\x{%x}", g_new_ranges[i].lo, g_new_ranges[i].hi);
    }
}

/* If src[i..] is \p{X}, \p{Xy}, \pX (or \P), returns its length and the category name. */
static size_t parse_prop(const char *src, size_t n, size_t i, const char **name, size_t *name_len, bool *neg)
{
    if (i + 2 >= n || src[i] != '\\' || (src[i + 1] != 'p' && src[i + 1] != 'P')) {
        return 0;
    }
    *neg = src[i + 1] == 'P';
    if (src[i + 2] != '{') {
        *name = src + i + 2;
        *name_len = 1;
        return strchr("LMNPSZC", src[i + 2]) ? 3 : 0;
    }
    size_t k = i + 3;
    while (k < n && src[k] != '}') {
        k++;
    }
    size_t l = k - (i + 3);
    if (k >= n || l < 1 || l > 2 || !strchr("LMNPSZC", src[i + 3]) || (l == 2 && !(src[i + 4] >= 'a' && src[i + 4] <= 'z'))) {
        return 0;
    }
    *name = src + i + 3;
    *name_len = l;
    return k + 1 - i;
}

/* Rewrites \s \S \w \W \h \H into explicit classes with Oniguruma's meaning (PCRE2's \s adds
 * U+180E, its \w lacks marks and connector punctuation, and its \h is horizontal space, not a hex
 * digit). Inside a character class only the positive forms can be inlined; the negated ones are
 * left alone. Returns a new kr_malloc'd string. */
static char *onig_to_pcre(const char *src, size_t n, bool props)
{
    struct kr_buf_s b = {0};
    bool in_class = false;
    size_t class_start = 0;
    for (size_t i = 0; i < n; i++) {
        char c = src[i];
        const char *pname;
        size_t plen, pl;
        bool pneg;
        if (props && (pl = parse_prop(src, n, i, &pname, &plen, &pneg)) > 0 && (!in_class || !pneg)) {
            if (!in_class) {
                kr_bs_append(&b, pneg ? "[^" : "[", pneg ? 2 : 1);
            }
            kr_bs_append(&b, "\\p{", 3);
            kr_bs_append(&b, pname, plen);
            kr_bs_putc(&b, '}');
            append_new_chars(&b, pname, plen);
            if (!in_class) {
                kr_bs_putc(&b, ']');
            }
            i += pl - 1;
            continue;
        }
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
            if (props) {
                rep = NULL;
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
    pthread_once(&g_new_once, find_new_chars);
    /* pass 1: \s \w \h; pass 2: \p{..} (including those pass 1 wrote) */
    char *pat1 = onig_to_pcre(src, n, false);
    char *pat = pat1 ? onig_to_pcre(pat1, strlen(pat1), true) : NULL;
    kr_free(pat1);
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
        size_t a = 0, b = 0;
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
            if (!kr_uni_is_mark(cp)) {
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
    int32_t *ids;        /* [n] window mode: ids since the start of the previous emission; full mode: all */
    size_t n, cap;
    size_t prefix_index; /* window mode: ids[0..prefix_index) decode to `prefix` */
    char *prefix;        /* window mode: that decode; full mode: everything emitted so far */
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

/* Length of s without a trailing run of `cp` characters (cp < 0: n). */
static size_t without_trailing(const char *s, size_t n, int32_t cp)
{
    if (cp < 0) {
        return n;
    }
    char enc[4];
    size_t l = kr_utf8_put((uint32_t)cp, enc);
    while (n >= l && memcmp(s + n - l, enc, l) == 0) {
        n -= l;
    }
    return n;
}

/* Full mode (decoders whose output a window cannot reproduce): decode everything, emit what is
 * new, holding back an incomplete character and text a final Strip could still remove. */
static enum kr_status detok_full(struct kr_detok *d, bool final, const char **piece, size_t *len, struct kr_err *err)
{
    char *s;
    size_t n;
    enum kr_status st = kr_tokenizer_decode(d->tok, d->ids, (int64_t)d->n, d->skip_special, &s, &n, err);
    if (st != KR_OK) {
        return st;
    }
    size_t upto = final ? n : without_trailing(s, n, d->tok->stream_hold_cp);
    if (!final && ends_with_replacement(s, upto)) {
        upto = d->prefix_len; /* wait for the next id */
    }
    if (upto < d->prefix_len || memcmp(s, d->prefix ? d->prefix : "", d->prefix_len) != 0) {
        kr_free(s);
        if (upto < d->prefix_len && !final) {
            return KR_OK;
        }
        return kr_err_set(err, KR_ERR_INTERNAL, "detokenizer: this tokenizer's decoder rewrote text that was "
                          "already streamed");
    }
    size_t piece_len = upto - d->prefix_len;
    char *p = kr_malloc(piece_len + 1);
    char *np = kr_realloc(d->prefix, upto + 1);
    if (!p || !np) {
        kr_free(p);
        kr_free(s);
        if (np) {
            d->prefix = np;
        }
        return kr_err_set(err, KR_ERR_NOMEM, "detokenizer: out of memory");
    }
    memcpy(p, s + d->prefix_len, piece_len);
    p[piece_len] = '\0';
    memcpy(np, s, upto);
    np[upto] = '\0';
    d->prefix = np;
    d->prefix_len = upto;
    d->piece = p;
    *piece = p;
    *len = piece_len;
    kr_free(s);
    return KR_OK;
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
    const struct kr_tokenizer *t = d->tok;
    if (t->stream_byte_runs && id >= 0 && id < t->n_ids && t->id_str[id] &&
        byte_token_value(t->id_str[id], t->id_len[id]) >= 0) {
        return KR_OK; /* wait until the run of byte tokens ends */
    }
    if (!d->tok->stream_window) {
        return detok_full(d, false, piece, len, err);
    }
    /* HF's DecodeStream::step */
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
    enum kr_status st = KR_OK;
    if (!d->tok->stream_window) {
        st = detok_full(d, true, piece, len, err);
    } else {
        char *s;
        size_t n;
        st = kr_tokenizer_decode(d->tok, d->ids, (int64_t)d->n, d->skip_special, &s, &n, err);
        if (st == KR_OK && n > d->prefix_len) {
            memmove(s, s + d->prefix_len, n - d->prefix_len);
            s[n - d->prefix_len] = '\0';
            *len = n - d->prefix_len;
            d->piece = s;
            *piece = s;
        } else if (st == KR_OK) {
            kr_free(s);
        }
    }
    d->n = 0;
    d->prefix_index = 0;
    kr_free(d->prefix);
    d->prefix = NULL;
    d->prefix_len = 0;
    return st;
}

/* Whether HF's windowed stream reproduces the full decode: true when every step either works
 * token by token (or on runs of byte tokens) or, after the tokens were fused into one string,
 * only strips at most one leading character. Sets *hold to a Strip content removed at the end. */
static bool decoder_window_safe(const struct decoder *d, bool *fused, int32_t *hold)
{
    switch (d->type) {
    case DEC_SEQUENCE: {
        bool ok = true;
        for (size_t i = 0; i < d->n_sub; i++) {
            ok = decoder_window_safe(&d->sub[i], fused, hold) && ok;
        }
        return ok;
    }
    case DEC_BYTE_LEVEL:
    case DEC_FUSE:
        *fused = true;
        return true;
    case DEC_STRIP:
        if (d->stop > 0) {
            *hold = (int32_t)d->ch;
        }
        return !*fused || (d->start <= 1 && d->stop == 0);
    case DEC_REPLACE:
    case DEC_METASPACE:
    case DEC_BPE:
        return !*fused;
    case DEC_BYTE_FALLBACK:
        return true;
    }
    return false;
}

static bool decoder_has(const struct decoder *d, enum dec_type type)
{
    bool r = d->type == type;
    for (size_t i = 0; i < d->n_sub; i++) {
        r = r || decoder_has(&d->sub[i], type);
    }
    return r;
}

/* ---- loading: helpers -------------------------------------------------------------------------- */

static bool jbool(const json_t *o, const char *key, bool def)
{
    const json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : def;
}

/* A string member (NULL when absent or null); anything else is an error. */
static enum kr_status jstr(const json_t *o, const char *key, const char *where, const char **out, size_t *len,
                           bool required, struct kr_err *err)
{
    const json_t *v = json_object_get(o, key);
    *out = NULL;
    if (len) {
        *len = 0;
    }
    if (!v || json_is_null(v)) {
        if (required) {
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing string \"%s\"", where, key);
        }
        return KR_OK;
    }
    if (!json_is_string(v)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: \"%s\" must be a string", where, key);
    }
    *out = json_string_value(v);
    if (len) {
        *len = json_string_length(v);
    }
    return KR_OK;
}

/* A single character member (Metaspace replacement, Strip content, ...). */
static enum kr_status jchar(const json_t *o, const char *key, const char *where, uint32_t def, uint32_t *out,
                            struct kr_err *err)
{
    const char *s;
    size_t n;
    enum kr_status st = jstr(o, key, where, &s, &n, false, err);
    if (st != KR_OK) {
        return st;
    }
    if (!s) {
        *out = def;
        return KR_OK;
    }
    uint32_t cp;
    if (n == 0 || kr_utf8_validate(s, n) != n || kr_utf8_next(s, &cp) != n) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: \"%s\" must be a single character", where, key);
    }
    *out = cp;
    return KR_OK;
}

static enum kr_status jsize(const json_t *o, const char *key, const char *where, size_t *out, struct kr_err *err)
{
    const json_t *v = json_object_get(o, key);
    if (!json_is_integer(v) || json_integer_value(v) < 0) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: \"%s\" must be a non-negative integer", where, key);
    }
    *out = (size_t)json_integer_value(v);
    return KR_OK;
}

static const char *jtype(const json_t *o)
{
    const json_t *v = json_object_get(o, "type");
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static enum kr_status parse_pattern(struct kr_tokenizer *t, const json_t *o, const char *where, struct pattern *p,
                                    struct kr_err *err)
{
    const json_t *pat = json_object_get(o, "pattern");
    const json_t *s = json_object_get(pat, "String"), *r = json_object_get(pat, "Regex");
    if (json_is_string(s)) {
        p->lit_len = json_string_length(s);
        p->lit = kr_strndup(json_string_value(s), p->lit_len);
        return p->lit ? KR_OK : KR_ERR_NOMEM;
    }
    if (json_is_string(r)) {
        return compile_regex(t, json_string_value(r), json_string_length(r), &p->re, where, err);
    }
    return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: \"pattern\" must be {\"String\": ...} or {\"Regex\": ...}",
                      where);
}

static void pattern_free(struct pattern *p)
{
    kr_free(p->lit);
    pcre2_code_free(p->re);
}

static enum kr_status parse_behavior(const json_t *o, const char *where, enum split_behavior def,
                                     enum split_behavior *out, struct kr_err *err)
{
    const json_t *v = json_object_get(o, "behavior");
    if (!v) {
        *out = def;
        return KR_OK;
    }
    static const char *names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
    for (int i = 0; i < 5; i++) {
        if (json_is_string(v) && strcmp(json_string_value(v), names[i]) == 0) {
            *out = (enum split_behavior)i;
            return KR_OK;
        }
    }
    return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: unknown split behavior", where);
}

static enum kr_status parse_prepend_scheme(const json_t *o, const char *where, enum prepend_scheme *out,
                                           struct kr_err *err)
{
    const json_t *v = json_object_get(o, "prepend_scheme");
    if (!v) { /* files older than prepend_scheme carry add_prefix_space */
        *out = jbool(o, "add_prefix_space", true) ? PREPEND_ALWAYS : PREPEND_NEVER;
        return KR_OK;
    }
    const char *s = json_is_string(v) ? json_string_value(v) : "";
    if (strcmp(s, "always") == 0) {
        *out = PREPEND_ALWAYS;
    } else if (strcmp(s, "first") == 0) {
        *out = PREPEND_FIRST;
    } else if (strcmp(s, "never") == 0) {
        *out = PREPEND_NEVER;
    } else {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: unknown prepend_scheme", where);
    }
    return KR_OK;
}

static enum kr_status sub_array(const json_t *o, const char *key, const char *where, const json_t **arr,
                                struct kr_err *err)
{
    *arr = json_object_get(o, key);
    if (!json_is_array(*arr)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: \"%s\" must be an array", where, key);
    }
    return KR_OK;
}

static enum kr_status str_member(const json_t *o, const char *key, const char *where, char **out, size_t *len,
                                 struct kr_err *err)
{
    const char *s;
    enum kr_status st = jstr(o, key, where, &s, len, true, err);
    if (st != KR_OK) {
        return st;
    }
    *out = kr_strndup(s, *len);
    return *out ? KR_OK : KR_ERR_NOMEM;
}

/* ---- loading: normalizers, pre-tokenizers, decoders ---------------------------------------------- */

static void normalizer_clear(struct normalizer *nz)
{
    for (size_t i = 0; i < nz->n_sub; i++) {
        normalizer_clear(&nz->sub[i]);
    }
    kr_free(nz->sub);
    kr_free(nz->str);
    pattern_free(&nz->pat);
}

static enum kr_status parse_normalizer(struct kr_tokenizer *t, const json_t *o, const char *where,
                                       struct normalizer *nz, struct kr_err *err)
{
    const char *type = jtype(o);
    if (!type) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing \"type\"", where);
    }
    static const struct { const char *name; enum norm_type type; } simple[] = {
        {"NFC", NORM_NFC}, {"NFD", NORM_NFD}, {"NFKC", NORM_NFKC}, {"NFKD", NORM_NFKD},
        {"Lowercase", NORM_LOWERCASE}, {"StripAccents", NORM_STRIP_ACCENTS}, {"ByteLevel", NORM_BYTE_LEVEL},
    };
    for (size_t i = 0; i < sizeof(simple) / sizeof(simple[0]); i++) {
        if (strcmp(type, simple[i].name) == 0) {
            nz->type = simple[i].type;
            return KR_OK;
        }
    }
    if (strcmp(type, "Strip") == 0) {
        nz->type = NORM_STRIP;
        nz->left = jbool(o, "strip_left", true);
        nz->right = jbool(o, "strip_right", true);
        return KR_OK;
    }
    if (strcmp(type, "Prepend") == 0 || strcmp(type, "Append") == 0) {
        nz->type = type[0] == 'P' ? NORM_PREPEND : NORM_APPEND;
        return str_member(o, type[0] == 'P' ? "prepend" : "append", where, &nz->str, &nz->str_len, err);
    }
    if (strcmp(type, "Replace") == 0) {
        nz->type = NORM_REPLACE;
        enum kr_status st = str_member(o, "content", where, &nz->str, &nz->str_len, err);
        return st == KR_OK ? parse_pattern(t, o, where, &nz->pat, err) : st;
    }
    if (strcmp(type, "Sequence") == 0) {
        nz->type = NORM_SEQUENCE;
        const json_t *arr;
        enum kr_status st = sub_array(o, "normalizers", where, &arr, err);
        if (st != KR_OK) {
            return st;
        }
        nz->sub = kr_calloc(json_array_size(arr) + 1, sizeof(*nz->sub));
        if (!nz->sub) {
            return KR_ERR_NOMEM;
        }
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char w[512];
            snprintf(w, sizeof(w), "%s.normalizers[%zu]", where, i);
            nz->n_sub = i + 1;
            if ((st = parse_normalizer(t, json_array_get(arr, i), w, &nz->sub[i], err)) != KR_OK) {
                return st;
            }
        }
        return KR_OK;
    }
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: %s: unsupported normalizer type \"%s\"", where, type);
}

static void pretok_clear(struct pretok *pt)
{
    for (size_t i = 0; i < pt->n_sub; i++) {
        pretok_clear(&pt->sub[i]);
    }
    kr_free(pt->sub);
    pattern_free(&pt->pat);
}

static const char GPT2_REGEX[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char WHITESPACE_REGEX[] = "\\w+|[^\\w\\s]+";

static enum kr_status parse_pretok(struct kr_tokenizer *t, const json_t *o, const char *where, struct pretok *pt,
                                   struct kr_err *err)
{
    const char *type = jtype(o);
    enum kr_status st = KR_OK;
    if (!type) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing \"type\"", where);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        pt->type = PT_BYTE_LEVEL;
        pt->add_prefix_space = jbool(o, "add_prefix_space", true);
        pt->use_regex = jbool(o, "use_regex", true);
        if (pt->use_regex && !t->re_gpt2) {
            st = compile_regex(t, GPT2_REGEX, strlen(GPT2_REGEX), &t->re_gpt2, where, err);
        }
        return st;
    }
    if (strcmp(type, "Split") == 0) {
        pt->type = PT_SPLIT;
        pt->invert = jbool(o, "invert", false);
        if ((st = parse_behavior(o, where, SPLIT_ISOLATED, &pt->behavior, err)) != KR_OK) {
            return st;
        }
        if (!json_object_get(o, "behavior")) {
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing \"behavior\"", where);
        }
        return parse_pattern(t, o, where, &pt->pat, err);
    }
    if (strcmp(type, "Digits") == 0) {
        pt->type = PT_DIGITS;
        pt->individual_digits = jbool(o, "individual_digits", false);
        return KR_OK;
    }
    if (strcmp(type, "Metaspace") == 0) {
        pt->type = PT_METASPACE;
        pt->split = jbool(o, "split", true);
        if ((st = jchar(o, "replacement", where, 0x2581, &pt->ch, err)) != KR_OK) {
            return st;
        }
        return parse_prepend_scheme(o, where, &pt->prepend, err);
    }
    if (strcmp(type, "Whitespace") == 0) {
        pt->type = PT_WHITESPACE;
        if (!t->re_whitespace) {
            st = compile_regex(t, WHITESPACE_REGEX, strlen(WHITESPACE_REGEX), &t->re_whitespace, where, err);
        }
        return st;
    }
    if (strcmp(type, "WhitespaceSplit") == 0) {
        pt->type = PT_WHITESPACE_SPLIT;
        return KR_OK;
    }
    if (strcmp(type, "Punctuation") == 0) {
        pt->type = PT_PUNCTUATION;
        return parse_behavior(o, where, SPLIT_ISOLATED, &pt->behavior, err);
    }
    if (strcmp(type, "BertPreTokenizer") == 0) {
        pt->type = PT_BERT;
        return KR_OK;
    }
    if (strcmp(type, "CharDelimiterSplit") == 0) {
        pt->type = PT_CHAR_DELIMITER;
        if (!json_object_get(o, "delimiter")) {
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing \"delimiter\"", where);
        }
        return jchar(o, "delimiter", where, 0, &pt->ch, err);
    }
    if (strcmp(type, "Sequence") == 0) {
        pt->type = PT_SEQUENCE;
        const json_t *arr;
        if ((st = sub_array(o, "pretokenizers", where, &arr, err)) != KR_OK) {
            return st;
        }
        pt->sub = kr_calloc(json_array_size(arr) + 1, sizeof(*pt->sub));
        if (!pt->sub) {
            return KR_ERR_NOMEM;
        }
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char w[512];
            snprintf(w, sizeof(w), "%s.pretokenizers[%zu]", where, i);
            pt->n_sub = i + 1;
            if ((st = parse_pretok(t, json_array_get(arr, i), w, &pt->sub[i], err)) != KR_OK) {
                return st;
            }
        }
        return KR_OK;
    }
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: %s: unsupported pre-tokenizer type \"%s\"", where,
                      type);
}

static void decoder_clear(struct decoder *d)
{
    for (size_t i = 0; i < d->n_sub; i++) {
        decoder_clear(&d->sub[i]);
    }
    kr_free(d->sub);
    kr_free(d->str);
    pattern_free(&d->pat);
}

static enum kr_status parse_decoder(struct kr_tokenizer *t, const json_t *o, const char *where, struct decoder *d,
                                    struct kr_err *err)
{
    const char *type = jtype(o);
    enum kr_status st;
    if (!type) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing \"type\"", where);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        d->type = DEC_BYTE_LEVEL;
        return KR_OK;
    }
    if (strcmp(type, "ByteFallback") == 0) {
        d->type = DEC_BYTE_FALLBACK;
        return KR_OK;
    }
    if (strcmp(type, "Fuse") == 0) {
        d->type = DEC_FUSE;
        return KR_OK;
    }
    if (strcmp(type, "Metaspace") == 0) {
        d->type = DEC_METASPACE;
        if ((st = jchar(o, "replacement", where, 0x2581, &d->ch, err)) != KR_OK) {
            return st;
        }
        return parse_prepend_scheme(o, where, &d->prepend, err);
    }
    if (strcmp(type, "Replace") == 0) {
        d->type = DEC_REPLACE;
        if ((st = str_member(o, "content", where, &d->str, &d->str_len, err)) != KR_OK) {
            return st;
        }
        return parse_pattern(t, o, where, &d->pat, err);
    }
    if (strcmp(type, "Strip") == 0) {
        d->type = DEC_STRIP;
        if ((st = jchar(o, "content", where, ' ', &d->ch, err)) != KR_OK ||
            (st = jsize(o, "start", where, &d->start, err)) != KR_OK) {
            return st;
        }
        return jsize(o, "stop", where, &d->stop, err);
    }
    if (strcmp(type, "BPEDecoder") == 0) {
        d->type = DEC_BPE;
        const char *s;
        size_t n;
        if ((st = jstr(o, "suffix", where, &s, &n, false, err)) != KR_OK) {
            return st;
        }
        d->str = kr_strndup(s ? s : "</w>", s ? n : 4);
        d->str_len = s ? n : 4;
        return d->str ? KR_OK : KR_ERR_NOMEM;
    }
    if (strcmp(type, "Sequence") == 0) {
        d->type = DEC_SEQUENCE;
        const json_t *arr;
        if ((st = sub_array(o, "decoders", where, &arr, err)) != KR_OK) {
            return st;
        }
        d->sub = kr_calloc(json_array_size(arr) + 1, sizeof(*d->sub));
        if (!d->sub) {
            return KR_ERR_NOMEM;
        }
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char w[512];
            snprintf(w, sizeof(w), "%s.decoders[%zu]", where, i);
            d->n_sub = i + 1;
            if ((st = parse_decoder(t, json_array_get(arr, i), w, &d->sub[i], err)) != KR_OK) {
                return st;
            }
        }
        return KR_OK;
    }
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: %s: unsupported decoder type \"%s\"", where, type);
}

/* ---- loading: post-processor ----------------------------------------------------------------------- */

static void post_clear(struct postproc *pp)
{
    for (size_t i = 0; i < pp->n_sub; i++) {
        post_clear(&pp->sub[i]);
    }
    kr_free(pp->sub);
    for (size_t i = 0; i < pp->n_items; i++) {
        kr_free(pp->items[i].ids);
    }
    kr_free(pp->items);
}

static enum kr_status post_add_item(struct postproc *pp, bool is_seq, const int32_t *ids, size_t n)
{
    struct post_item *v = kr_realloc(pp->items, (pp->n_items + 1) * sizeof(*v));
    if (!v) {
        return KR_ERR_NOMEM;
    }
    pp->items = v;
    struct post_item *it = &v[pp->n_items++];
    *it = (struct post_item){is_seq, NULL, n};
    if (n) {
        it->ids = kr_malloc(n * sizeof(int32_t));
        if (!it->ids) {
            it->n_ids = 0;
            return KR_ERR_NOMEM;
        }
        memcpy(it->ids, ids, n * sizeof(int32_t));
    }
    pp->is_template = true;
    return KR_OK;
}

/* ["</s>", 2] pairs of RobertaProcessing / BertProcessing. */
static enum kr_status pair_id(const json_t *o, const char *key, const char *where, int32_t *id, struct kr_err *err)
{
    const json_t *v = json_object_get(o, key);
    const json_t *i = json_array_get(v, 1);
    if (!json_is_array(v) || !json_is_integer(i)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: \"%s\" must be [token, id]", where, key);
    }
    *id = (int32_t)json_integer_value(i);
    return KR_OK;
}

static enum kr_status parse_post(const json_t *o, const char *where, struct postproc *pp, struct kr_err *err)
{
    const char *type = jtype(o);
    enum kr_status st;
    if (!type) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing \"type\"", where);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        return KR_OK;
    }
    if (strcmp(type, "RobertaProcessing") == 0 || strcmp(type, "BertProcessing") == 0) {
        int32_t cls = -1, sep = -1;
        if ((st = pair_id(o, "cls", where, &cls, err)) != KR_OK || (st = pair_id(o, "sep", where, &sep, err)) != KR_OK) {
            return st;
        }
        if ((st = post_add_item(pp, false, &cls, 1)) != KR_OK || (st = post_add_item(pp, true, NULL, 0)) != KR_OK) {
            return st;
        }
        return post_add_item(pp, false, &sep, 1);
    }
    if (strcmp(type, "TemplateProcessing") == 0) {
        const json_t *single, *specials = json_object_get(o, "special_tokens");
        if ((st = sub_array(o, "single", where, &single, err)) != KR_OK) {
            return st;
        }
        for (size_t i = 0; i < json_array_size(single); i++) {
            const json_t *it = json_array_get(single, i);
            const json_t *sp = json_object_get(json_object_get(it, "SpecialToken"), "id");
            if (json_object_get(it, "Sequence")) {
                const json_t *sid = json_object_get(json_object_get(it, "Sequence"), "id");
                if (!json_is_string(sid) || strcmp(json_string_value(sid), "A") != 0) {
                    return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s.single[%zu]: a single-sequence "
                                      "template can only use sequence A", where, i);
                }
                st = post_add_item(pp, true, NULL, 0);
            } else if (json_is_string(sp)) {
                const json_t *def = json_object_get(specials, json_string_value(sp));
                const json_t *ids = json_object_get(def, "ids");
                if (!json_is_array(ids)) {
                    return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: special token \"%s\" is not defined "
                                      "in special_tokens", where, json_string_value(sp));
                }
                size_t n = json_array_size(ids);
                int32_t tmp[64];
                if (n > 64) {
                    return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: %s: special token \"%s\" has more "
                                      "than 64 ids", where, json_string_value(sp));
                }
                for (size_t k = 0; k < n; k++) {
                    const json_t *x = json_array_get(ids, k);
                    if (!json_is_integer(x)) {
                        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: special token \"%s\": ids must "
                                          "be integers", where, json_string_value(sp));
                    }
                    tmp[k] = (int32_t)json_integer_value(x);
                }
                st = post_add_item(pp, false, tmp, n);
            } else {
                return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s.single[%zu]: expected SpecialToken or "
                                  "Sequence", where, i);
            }
            if (st != KR_OK) {
                return st;
            }
        }
        pp->is_template = true;
        return KR_OK;
    }
    if (strcmp(type, "Sequence") == 0) {
        const json_t *arr;
        if ((st = sub_array(o, "processors", where, &arr, err)) != KR_OK) {
            return st;
        }
        pp->sub = kr_calloc(json_array_size(arr) + 1, sizeof(*pp->sub));
        if (!pp->sub) {
            return KR_ERR_NOMEM;
        }
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char w[512];
            snprintf(w, sizeof(w), "%s.processors[%zu]", where, i);
            pp->n_sub = i + 1;
            if ((st = parse_post(json_array_get(arr, i), w, &pp->sub[i], err)) != KR_OK) {
                return st;
            }
        }
        return KR_OK;
    }
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: %s: unsupported post-processor type \"%s\"", where,
                      type);
}

/* ---- loading: model ------------------------------------------------------------------------------ */

static void init_byte_alphabet(struct kr_tokenizer *t)
{
    /* GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the others to 256 + k. */
    int k = 0;
    for (int i = 0; i < 0x144; i++) {
        t->char_byte[i] = -1;
    }
    for (int b = 0; b < 256; b++) {
        bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        uint32_t cp = keep ? (uint32_t)b : (uint32_t)(256 + k++);
        char tmp[4];
        size_t l = kr_utf8_put(cp, tmp);
        memcpy(t->bytes_char[b], tmp, l);
        t->bytes_char_len[b] = (uint8_t)l;
        t->char_byte[cp] = (int16_t)b;
    }
}

static enum kr_status load_bpe(struct kr_tokenizer *t, const json_t *model, struct kr_err *err)
{
    const char *type = jtype(model);
    enum kr_status st;
    if (!json_is_object(model)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: missing \"model\" object");
    }
    if (type ? strcmp(type, "BPE") != 0 : !json_object_get(model, "merges")) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: model: unsupported model type \"%s\" (only BPE "
                          "is implemented)", type ? type : "(untyped)");
    }
    const json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout) && !(json_is_number(dropout) && json_number_value(dropout) == 0.0)) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: model: BPE dropout is a training option and "
                          "is not supported");
    }
    const json_t *vocab = json_object_get(model, "vocab"), *merges = json_object_get(model, "merges");
    if (!json_is_object(vocab)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.vocab: expected an object of token -> id");
    }
    if (!json_is_array(merges)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.merges: expected an array");
    }
    size_t total = 0, n = json_object_size(vocab);
    const char *key;
    const json_t *val;
    int64_t max_id = -1;
    json_object_foreach((json_t *)vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 || json_integer_value(val) >= INT32_MAX) {
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.vocab[\"%.64s\"]: id must be an integer "
                              "in [0, 2^31-1)", key);
        }
        if (json_integer_value(val) > max_id) {
            max_id = json_integer_value(val);
        }
        total += strlen(key) + 1;
    }
    t->pool = kr_malloc(total + 1);
    if (!t->pool || (st = smap_init(&t->vocab, n)) != KR_OK) {
        return KR_ERR_NOMEM;
    }
    char *w = t->pool;
    json_object_foreach((json_t *)vocab, key, val) {
        size_t l = strlen(key);
        memcpy(w, key, l + 1);
        if ((st = smap_put(&t->vocab, w, l, (int32_t)json_integer_value(val))) != KR_OK) {
            return st;
        }
        w += l + 1;
    }
    t->n_ids = (int32_t)(max_id + 1);

    const char *s;
    size_t l;
    t->unk_id = -1;
    if ((st = jstr(model, "unk_token", "model", &s, &l, false, err)) != KR_OK) {
        return st;
    }
    if (s && !smap_get(&t->vocab, s, l, &t->unk_id)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.unk_token \"%.64s\" is not in the vocabulary", s);
    }
    if ((st = jstr(model, "continuing_subword_prefix", "model", &s, &l, false, err)) != KR_OK) {
        return st;
    }
    if (s && !(t->cont_prefix = kr_strndup(s, l))) {
        return KR_ERR_NOMEM;
    }
    t->cont_prefix_len = l;
    if ((st = jstr(model, "end_of_word_suffix", "model", &s, &l, false, err)) != KR_OK) {
        return st;
    }
    if (s && !(t->eow_suffix = kr_strndup(s, l))) {
        return KR_ERR_NOMEM;
    }
    t->eow_suffix_len = l;
    /* merges */
    size_t nm = json_array_size(merges);
    size_t cap = 16;
    while (cap < nm * 2) {
        cap *= 2;
    }
    t->merges.slots = kr_calloc(cap, sizeof(*t->merges.slots));
    if (!t->merges.slots) {
        return KR_ERR_NOMEM;
    }
    t->merges.cap = cap;
    struct kr_buf_s cat = {0};
    for (size_t i = 0; i < nm; i++) {
        const json_t *m = json_array_get(merges, i);
        const char *a, *b;
        size_t la, lb;
        if (json_is_string(m)) {
            a = json_string_value(m);
            const char *sp = memchr(a, ' ', json_string_length(m));
            if (!sp) {
                kr_bs_free(&cat);
                return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.merges[%zu]: \"%.64s\" is not \"a b\"",
                                  i, a);
            }
            la = (size_t)(sp - a);
            b = sp + 1;
            lb = json_string_length(m) - la - 1;
        } else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
                   json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            la = json_string_length(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            lb = json_string_length(json_array_get(m, 1));
        } else {
            kr_bs_free(&cat);
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.merges[%zu]: expected \"a b\" or [a, b]", i);
        }
        int32_t ia, ib, inew;
        cat.len = 0;
        kr_bs_append(&cat, a, la);
        /* HF builds the merged token as a + b[len(continuing_subword_prefix)..] */
        size_t skip = t->cont_prefix_len;
        if (skip > lb) {
            kr_bs_free(&cat);
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.merges[%zu]: \"%.*s\" is shorter than the "
                              "continuing_subword_prefix", i, (int)(lb > 64 ? 64 : lb), b);
        }
        kr_bs_append(&cat, b + skip, lb - skip);
        if (!cat.p) {
            return KR_ERR_NOMEM;
        }
        if (!smap_get(&t->vocab, a, la, &ia) || !smap_get(&t->vocab, b, lb, &ib) ||
            !smap_get(&t->vocab, cat.p, cat.len, &inew)) {
            st = kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.merges[%zu]: \"%.*s\" + \"%.*s\": a token "
                            "of this merge is not in the vocabulary", i, (int)(la > 64 ? 64 : la), a,
                            (int)(lb > 64 ? 64 : lb), b);
            kr_bs_free(&cat);
            return st;
        }
        uint64_t k = (((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib) + 1;
        struct mmap_slot *slot = mmap_find(&t->merges, k);
        if (!slot->key) {
            t->merges.n++;
        }
        *slot = (struct mmap_slot){k, (int32_t)i, inew};
    }
    kr_bs_free(&cat);

    t->fuse_unk = jbool(model, "fuse_unk", false);
    t->byte_fallback = jbool(model, "byte_fallback", false);
    t->ignore_merges = jbool(model, "ignore_merges", false);
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof(name), "<0x%02X>", b);
        if (!smap_get(&t->vocab, name, 6, &t->byte_ids[b])) {
            t->byte_ids[b] = -1;
        }
    }
    return KR_OK;
}

static enum kr_status load_added(struct kr_tokenizer *t, const json_t *arr, struct kr_err *err)
{
    if (!arr || json_is_null(arr)) {
        return KR_OK;
    }
    if (!json_is_array(arr)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: \"added_tokens\" must be an array");
    }
    size_t n = json_array_size(arr);
    t->added = kr_calloc(n + 1, sizeof(*t->added));
    if (!t->added || smap_init(&t->added_map, n) != KR_OK) {
        return KR_ERR_NOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *o = json_array_get(arr, i);
        const json_t *id = json_object_get(o, "id");
        const json_t *content = json_object_get(o, "content");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= INT32_MAX ||
            !json_is_string(content)) {
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: added_tokens[%zu]: needs an integer \"id\" and a "
                              "string \"content\"", i);
        }
        struct added_token *at = &t->added[t->n_added];
        at->len = json_string_length(content);
        if (at->len == 0) {
            continue; /* HF ignores empty added tokens */
        }
        at->content = kr_strndup(json_string_value(content), at->len);
        if (!at->content) {
            return KR_ERR_NOMEM;
        }
        t->n_added++;
        at->special = jbool(o, "special", false);
        at->lstrip = jbool(o, "lstrip", false);
        at->rstrip = jbool(o, "rstrip", false);
        at->single_word = jbool(o, "single_word", false);
        at->normalized = jbool(o, "normalized", !at->special);
        int32_t vid;
        /* HF gives an added token the id its content already has in the vocabulary */
        at->id = smap_get(&t->added_map, at->content, at->len, &vid) ? vid
                 : smap_get(&t->vocab, at->content, at->len, &vid) ? vid
                                                                   : (int32_t)json_integer_value(id);
        if (smap_put(&t->added_map, at->content, at->len, at->id) != KR_OK) {
            return KR_ERR_NOMEM;
        }
        if (at->id >= t->n_ids) {
            t->n_ids = at->id + 1;
        }
    }
    return KR_OK;
}

/* Builds the id tables and the two added-token tries (special tokens first, as HF orders them). */
static enum kr_status build_tables(struct kr_tokenizer *t, struct kr_err *err)
{
    size_t n = (size_t)(t->n_ids > 0 ? t->n_ids : 1);
    t->id_str = kr_calloc(n, sizeof(*t->id_str));
    t->id_len = kr_calloc(n, sizeof(*t->id_len));
    t->id_special = kr_calloc(n, sizeof(*t->id_special));
    if (!t->id_str || !t->id_len || !t->id_special) {
        return KR_ERR_NOMEM;
    }
    for (size_t i = 0; i < t->vocab.cap; i++) {
        const struct smap_slot *s = &t->vocab.slots[i];
        if (s->key) {
            t->id_str[s->val] = s->key;
            t->id_len[s->val] = s->len;
        }
    }
    struct smap special = {0};
    enum kr_status st = smap_init(&special, t->n_added + 1);
    for (size_t i = 0; i < t->n_added && st == KR_OK; i++) {
        const struct added_token *at = &t->added[i];
        t->id_str[at->id] = at->content;
        t->id_len[at->id] = (uint32_t)at->len;
        if (at->special) {
            st = smap_put(&special, at->content, at->len, 1);
        }
    }
    for (int32_t i = 0; i < t->n_ids && st == KR_OK; i++) {
        int32_t one;
        t->id_special[i] = t->id_str[i] && smap_get(&special, t->id_str[i], t->id_len[i], &one);
    }
    kr_free(special.slots);
    if (st != KR_OK) {
        return st;
    }
    /* normalized tokens are matched in their normalized form */
    struct ctx c = {.t = t, .err = err};
    c.rx.err = err;
    c.rx.md = pcre2_match_data_create(8, t->gctx);
    c.rx.mc = pcre2_match_context_create(t->gctx);
    st = c.rx.md && c.rx.mc ? KR_OK : KR_ERR_NOMEM;
    for (int pass = 0; pass < 2 && st == KR_OK; pass++) {
        for (size_t i = 0; i < t->n_added && st == KR_OK; i++) {
            struct added_token *at = &t->added[i];
            if (at->special != (pass == 0)) {
                continue;
            }
            if (!at->normalized) {
                at->match = at->content;
                at->match_len = at->len;
                st = trie_insert(&t->trie_raw, at->match, at->match_len, (int32_t)i);
                continue;
            }
            const char *s = at->content;
            size_t l = at->len;
            if (t->norm) {
                st = normalize(&c, t->norm, &s, &l);
            }
            if (st == KR_OK) {
                at->match = kr_strndup(s, l);
                at->match_len = l;
                st = at->match ? trie_insert(&t->trie_norm, at->match, l, (int32_t)i) : KR_ERR_NOMEM;
            }
        }
    }
    kr_free(c.ranges.v);
    kr_bs_free(&c.buf);
    arena_free(&c.arena);
    pcre2_match_data_free(c.rx.md);
    pcre2_match_context_free(c.rx.mc);
    return st;
}

/* ---- loading: tokenizer_config.json ------------------------------------------------------------- */

static int32_t lookup_id(const struct kr_tokenizer *t, const char *s, size_t n)
{
    int32_t id;
    if (smap_get(&t->added_map, s, n, &id) || smap_get(&t->vocab, s, n, &id)) {
        return id;
    }
    return -1;
}

/* A special token entry of tokenizer_config.json: a string or {"content": ...}; NULL when null. */
static const char *config_token(const json_t *cfg, const char *key)
{
    const json_t *v = json_object_get(cfg, key);
    if (json_is_object(v)) {
        v = json_object_get(v, "content");
    }
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static enum kr_status load_config(struct kr_tokenizer *t, const json_t *cfg, struct kr_err *err)
{
    const char *bos = config_token(cfg, "bos_token"), *eos = config_token(cfg, "eos_token");
    if ((bos && !(t->bos_token = kr_strdup(bos))) || (eos && !(t->eos_token = kr_strdup(eos)))) {
        return KR_ERR_NOMEM;
    }
    t->bos_id = bos ? lookup_id(t, bos, strlen(bos)) : -1;
    t->eos_id = eos ? lookup_id(t, eos, strlen(eos)) : -1;
    const json_t *tpl = json_object_get(cfg, "chat_template");
    if (json_is_array(tpl)) {
        const json_t *found = NULL;
        for (size_t i = 0; i < json_array_size(tpl); i++) {
            const json_t *e = json_array_get(tpl, i);
            const json_t *name = json_object_get(e, "name");
            if (json_is_string(name) && strcmp(json_string_value(name), "default") == 0) {
                found = json_object_get(e, "template");
            }
        }
        tpl = found;
    }
    if (json_is_string(tpl) && !(t->chat_template = kr_strdup(json_string_value(tpl)))) {
        return KR_ERR_NOMEM;
    }
    /* transformers (TokenizersBackend.update_post_processor): an explicit add_bos_token /
     * add_eos_token replaces the post-processor by "[bos] $A [eos]". */
    const json_t *ab = json_object_get(cfg, "add_bos_token"), *ae = json_object_get(cfg, "add_eos_token");
    if (!ab && !ae) {
        return KR_OK;
    }
    bool add_bos = json_is_true(ab) && bos, add_eos = json_is_true(ae) && eos;
    if ((add_bos && t->bos_id < 0) || (add_eos && t->eos_id < 0)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer_config.json: %s \"%s\" is not a token of tokenizer.json",
                          add_bos && t->bos_id < 0 ? "bos_token" : "eos_token",
                          add_bos && t->bos_id < 0 ? bos : eos);
    }
    if (t->post) {
        post_clear(t->post);
        memset(t->post, 0, sizeof(*t->post));
    } else if (!(t->post = kr_calloc(1, sizeof(*t->post)))) {
        return KR_ERR_NOMEM;
    }
    enum kr_status st = KR_OK;
    if (add_bos) {
        st = post_add_item(t->post, false, &t->bos_id, 1);
    }
    if (st == KR_OK) {
        st = post_add_item(t->post, true, NULL, 0);
    }
    if (st == KR_OK && add_eos) {
        st = post_add_item(t->post, false, &t->eos_id, 1);
    }
    return st;
}

/* ---- loading: entry points ---------------------------------------------------------------------- */

void kr_tokenizer_free(struct kr_tokenizer *t)
{
    if (!t) {
        return;
    }
    kr_free(t->pool);
    kr_free(t->vocab.slots);
    kr_free(t->id_str);
    kr_free(t->id_len);
    kr_free(t->id_special);
    kr_free(t->merges.slots);
    kr_free(t->cont_prefix);
    kr_free(t->eow_suffix);
    for (size_t i = 0; i < t->n_added; i++) {
        if (t->added[i].match != t->added[i].content) {
            kr_free(t->added[i].match);
        }
        kr_free(t->added[i].content);
    }
    kr_free(t->added);
    kr_free(t->added_map.slots);
    kr_free(t->trie_raw.nodes);
    kr_free(t->trie_norm.nodes);
    if (t->norm) {
        normalizer_clear(t->norm);
        kr_free(t->norm);
    }
    if (t->pretok) {
        pretok_clear(t->pretok);
        kr_free(t->pretok);
    }
    if (t->dec) {
        decoder_clear(t->dec);
        kr_free(t->dec);
    }
    if (t->post) {
        post_clear(t->post);
        kr_free(t->post);
    }
    pcre2_code_free(t->re_gpt2);
    pcre2_code_free(t->re_whitespace);
    pcre2_general_context_free(t->gctx);
    kr_free(t->bos_token);
    kr_free(t->eos_token);
    kr_free(t->chat_template);
    kr_free(t);
}

static enum kr_status parse_json(const char *text, size_t len, const char *name, size_t flags, json_t **out,
                                 struct kr_err *err)
{
    json_error_t je;
    *out = json_loadb(text, len, JSON_ALLOW_NUL | flags, &je);
    if (!*out) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: line %d column %d: %s", name, je.line, je.column, je.text);
    }
    if (!json_is_object(*out)) {
        json_decref(*out);
        *out = NULL;
        return kr_err_set(err, KR_ERR_FORMAT, "%s: the top level must be an object", name);
    }
    return KR_OK;
}

enum kr_status kr_tokenizer_load_mem(const char *json, size_t len, const char *config_json, size_t config_len,
                                     struct kr_tokenizer **out, struct kr_err *err)
{
    json_t *root = NULL, *cfg = NULL;
    struct kr_tokenizer *t = NULL;
    enum kr_status st;
    *out = NULL;
    if ((st = parse_json(json, len, "tokenizer.json", 0, &root, err)) != KR_OK) {
        goto fail;
    }
    if (config_json && (st = parse_json(config_json, config_len, "tokenizer_config.json",
                                  JSON_DECODE_INT_AS_REAL /* model_max_length can exceed int64 */, &cfg, err)) != KR_OK) {
        goto fail;
    }
    st = KR_ERR_NOMEM;
    t = kr_calloc(1, sizeof(*t));
    if (!t || !(t->gctx = pcre2_general_context_create(pcre_malloc, pcre_free, NULL))) {
        goto fail;
    }
    t->bos_id = t->eos_id = t->unk_id = -1;
    init_byte_alphabet(t);
    if ((st = load_bpe(t, json_object_get(root, "model"), err)) != KR_OK) {
        goto fail;
    }
    const json_t *v = json_object_get(root, "normalizer");
    if (v && !json_is_null(v)) {
        st = KR_ERR_NOMEM;
        if (!(t->norm = kr_calloc(1, sizeof(*t->norm))) || (st = parse_normalizer(t, v, "normalizer", t->norm, err)) != KR_OK) {
            goto fail;
        }
    }
    v = json_object_get(root, "pre_tokenizer");
    if (v && !json_is_null(v)) {
        st = KR_ERR_NOMEM;
        if (!(t->pretok = kr_calloc(1, sizeof(*t->pretok))) ||
            (st = parse_pretok(t, v, "pre_tokenizer", t->pretok, err)) != KR_OK) {
            goto fail;
        }
    }
    v = json_object_get(root, "decoder");
    if (v && !json_is_null(v)) {
        st = KR_ERR_NOMEM;
        if (!(t->dec = kr_calloc(1, sizeof(*t->dec))) || (st = parse_decoder(t, v, "decoder", t->dec, err)) != KR_OK) {
            goto fail;
        }
    }
    v = json_object_get(root, "post_processor");
    if (v && !json_is_null(v)) {
        st = KR_ERR_NOMEM;
        if (!(t->post = kr_calloc(1, sizeof(*t->post))) ||
            (st = parse_post(v, "post_processor", t->post, err)) != KR_OK) {
            goto fail;
        }
    }
    if ((st = load_added(t, json_object_get(root, "added_tokens"), err)) != KR_OK ||
        (st = build_tables(t, err)) != KR_OK) {
        goto fail;
    }
    if (cfg && (st = load_config(t, cfg, err)) != KR_OK) {
        goto fail;
    }
    bool fused = false;
    t->stream_hold_cp = -1;
    t->stream_window = !t->dec || decoder_window_safe(t->dec, &fused, &t->stream_hold_cp);
    t->stream_byte_runs = t->dec && decoder_has(t->dec, DEC_BYTE_FALLBACK);
    json_decref(root);
    json_decref(cfg);
    *out = t;
    return KR_OK;
fail:
    if (st == KR_ERR_NOMEM) {
        kr_err_set(err, st, "tokenizer: out of memory while loading");
    }
    json_decref(root);
    json_decref(cfg);
    kr_tokenizer_free(t);
    return st;
}

/* The largest tokenizer file read (tokenizer.json of large vocabularies is tens of MB; the limit
 * only stops a wrong path from reading something huge). */
#define KR_TOK_FILE_MAX ((size_t)1 << 30)

static bool file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

enum kr_status kr_tokenizer_load(const char *path, const char *config_path, struct kr_tokenizer **out,
                                 struct kr_err *err)
{
    struct stat sb;
    char *tok_path = NULL, *cfg_path = NULL, *tpl_path = NULL, *text = NULL, *cfg = NULL, *tpl = NULL;
    size_t len = 0, cfg_len = 0, tpl_len = 0;
    enum kr_status st = KR_ERR_NOMEM;
    *out = NULL;
    if (stat(path, &sb) != 0) {
        return kr_err_set(err, KR_ERR_IO, "%s: %s", path, strerror(errno));
    }
    size_t pl = strlen(path);
    char *dir = kr_strdup(path);
    if (!dir) {
        goto fail;
    }
    if (S_ISDIR(sb.st_mode)) {
        tok_path = kr_malloc(pl + 32);
        if (!tok_path) {
            goto fail;
        }
        snprintf(tok_path, pl + 32, "%s/tokenizer.json", path);
    } else {
        tok_path = kr_strdup(path);
        char *slash = strrchr(dir, '/');
        if (!tok_path) {
            goto fail;
        }
        if (slash) {
            *slash = '\0';
        } else {
            strcpy(dir, ".");
        }
    }
    if (config_path) {
        cfg_path = kr_strdup(config_path);
    } else {
        cfg_path = kr_malloc(strlen(dir) + 32);
        if (cfg_path) {
            snprintf(cfg_path, strlen(dir) + 32, "%s/tokenizer_config.json", dir);
        }
    }
    tpl_path = kr_malloc(strlen(dir) + 32);
    if (!cfg_path || !tpl_path) {
        goto fail;
    }
    snprintf(tpl_path, strlen(dir) + 32, "%s/chat_template.jinja", dir);
    if ((st = kr_file_read(tok_path, KR_TOK_FILE_MAX, &text, &len, err)) != KR_OK) {
        goto fail;
    }
    if ((config_path || file_exists(cfg_path)) &&
        (st = kr_file_read(cfg_path, KR_TOK_FILE_MAX, &cfg, &cfg_len, err)) != KR_OK) {
        goto fail;
    }
    if ((st = kr_tokenizer_load_mem(text, len, cfg, cfg_len, out, err)) != KR_OK) {
        kr_err_prefix(err, "%s", tok_path);
        goto fail;
    }
    /* transformers >= 4.43 may keep the template in its own file */
    if (!(*out)->chat_template && file_exists(tpl_path)) {
        if ((st = kr_file_read(tpl_path, KR_TOK_FILE_MAX, &tpl, &tpl_len, err)) != KR_OK) {
            kr_tokenizer_free(*out);
            *out = NULL;
            goto fail;
        }
        (*out)->chat_template = tpl;
        tpl = NULL;
    }
    st = KR_OK;
fail:
    if (st == KR_ERR_NOMEM) {
        kr_err_set(err, st, "tokenizer: out of memory");
    }
    kr_free(dir);
    kr_free(tok_path);
    kr_free(cfg_path);
    kr_free(tpl_path);
    kr_free(text);
    kr_free(cfg);
    kr_free(tpl);
    return st;
}

/* ---- lookups ---------------------------------------------------------------------------------------- */

int32_t kr_tokenizer_n_vocab(const struct kr_tokenizer *t)
{
    return t->n_ids;
}

const char *kr_tokenizer_id_to_piece(const struct kr_tokenizer *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_ids || !t->id_str[id]) {
        return NULL;
    }
    if (len) {
        *len = t->id_len[id];
    }
    return t->id_str[id];
}

int32_t kr_tokenizer_piece_to_id(const struct kr_tokenizer *t, const char *piece, size_t len)
{
    return lookup_id(t, piece, len);
}

bool kr_tokenizer_is_special(const struct kr_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_ids && t->id_special[id];
}

int32_t kr_tokenizer_bos_id(const struct kr_tokenizer *t)
{
    return t->bos_id;
}

int32_t kr_tokenizer_eos_id(const struct kr_tokenizer *t)
{
    return t->eos_id;
}

const char *kr_tokenizer_bos_token(const struct kr_tokenizer *t)
{
    return t->bos_token;
}

const char *kr_tokenizer_eos_token(const struct kr_tokenizer *t)
{
    return t->eos_token;
}

const char *kr_tokenizer_chat_template(const struct kr_tokenizer *t)
{
    return t->chat_template;
}
