/* The tokenizer's regexes: PCRE2 with Oniguruma's meaning of \s, \w, \h and of Unicode 15 categories
 * (HF tokenizers uses Oniguruma), compiled from tokenizer.json patterns; the matches of a pattern or
 * a character predicate over a piece, and HF's split behaviors (removed, isolated, merged, contiguous). */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"

#include <utf8proc.h>

#include <pthread.h>
#include <string.h>

/* ---- PCRE2 -------------------------------------------------------------------------------------- */

enum kr_status tok_rx_open(struct rx *x, const struct kr_tokenizer *t, struct kr_err *err)
{
    x->err = err;
    x->md = pcre2_match_data_create(8, t->gctx);
    x->mc = pcre2_match_context_create(t->gctx);
    if (!x->md || !x->mc) {
        return KR_ERR_NOMEM;
    }
    pcre2_set_match_limit(x->mc, REGEX_MATCH_LIMIT);
    return KR_OK;
}

void tok_rx_close(struct rx *x)
{
    pcre2_match_data_free(x->md);
    pcre2_match_context_free(x->mc);
    x->md = NULL;
    x->mc = NULL;
}

void *tok_pcre_malloc(size_t n, void *ud)
{
    (void)ud;
    return kr_malloc(n);
}

void tok_pcre_free(void *p, void *ud)
{
    (void)ud;
    kr_free(p);
}

/* pcre2_compile's error code for "failed to allocate heap memory" (ERR21 in PCRE2's sources; the
 * public header names no compile error). */
#define PCRE2_COMPILE_ERROR_NOMEMORY 121

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
static bool g_new_done; /* the table is complete (a search that ran out of memory is redone) */
static pthread_mutex_t g_new_mu = PTHREAD_MUTEX_INITIALIZER;

/* Fills the table; false when memory ran out (the table is then incomplete). */
static bool find_new_chars(void)
{
    g_n_new_ranges = 0;
    /* All code points that utf8proc assigns, one after the other, searched for \p{Cn}. */
    struct kr_buf_s all = {0};
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp++) {
        if ((cp >= 0xD800 && cp <= 0xDFFF) || utf8proc_category((utf8proc_int32_t)cp) == UTF8PROC_CATEGORY_CN) {
            continue;
        }
        if (kr_bs_put_cp(&all, cp) != KR_OK) {
            kr_bs_free(&all);
            return false;
        }
    }
    int ec;
    PCRE2_SIZE eo;
    pcre2_general_context *gc = pcre2_general_context_create(tok_pcre_malloc, tok_pcre_free, NULL);
    pcre2_compile_context *cc = gc ? pcre2_compile_context_create(gc) : NULL;
    pcre2_code *re = cc ? pcre2_compile((PCRE2_SPTR) "\\p{Cn}", PCRE2_ZERO_TERMINATED, PCRE2_UTF, &ec, &eo, cc) : NULL;
    pcre2_match_data *md = re ? pcre2_match_data_create(1, gc) : NULL;
    size_t off = 0;
    int rc = 0;
    while (md && off < all.len &&
           (rc = pcre2_match(re, (PCRE2_SPTR)all.p, all.len, off, PCRE2_NO_UTF_CHECK, md, NULL)) > 0) {
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
    const bool done = md && (off >= all.len || rc == PCRE2_ERROR_NOMATCH);
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    pcre2_compile_context_free(cc);
    pcre2_general_context_free(gc);
    kr_bs_free(&all);
    return done;
}

/* The table, computed once per process; KR_ERR_NOMEM when that ran out of memory (tried again by
 * the next call: a table left incomplete would change what \p{..} matches for the process's life). */
static enum kr_status new_chars_ready(void)
{
    pthread_mutex_lock(&g_new_mu);
    if (!g_new_done) {
        g_new_done = find_new_chars();
    }
    const bool done = g_new_done;
    pthread_mutex_unlock(&g_new_mu);
    return done ? KR_OK : KR_ERR_NOMEM;
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
    if (b.oom) { /* a pattern missing a piece would compile to another regex */
        kr_bs_free(&b);
    }
    return b.p;
}

enum kr_status tok_compile_regex(struct kr_tokenizer *t, const char *src, size_t n, pcre2_code **out,
                                 const char *where, struct kr_err *err)
{
    if (new_chars_ready() != KR_OK) {
        return kr_err_set(err, KR_ERR_NOMEM, "tokenizer.json: %s: out of memory preparing the regex tables", where);
    }
    /* pass 1: \s \w \h; pass 2: \p{..} (including those pass 1 wrote) */
    char *pat1 = onig_to_pcre(src, n, false);
    char *pat = pat1 ? onig_to_pcre(pat1, strlen(pat1), true) : NULL;
    kr_free(pat1);
    if (!pat) {
        return kr_err_set(err, KR_ERR_NOMEM, "tokenizer.json: %s: out of memory translating a regex", where);
    }
    pcre2_compile_context *cc = pcre2_compile_context_create(t->gctx);
    int ec = 0;
    PCRE2_SIZE eo = 0;
    pcre2_code *re = cc ? pcre2_compile((PCRE2_SPTR)pat, strlen(pat), PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE,
                                        &ec, &eo, cc)
                        : NULL;
    pcre2_compile_context_free(cc);
    kr_free(pat);
    if (!cc || (!re && ec == PCRE2_COMPILE_ERROR_NOMEMORY)) {
        return kr_err_set(err, KR_ERR_NOMEM, "tokenizer.json: %s: out of memory compiling a regex", where);
    }
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
enum kr_status tok_find_matches_pattern(struct rx *x, const struct pattern *p, const char *s, size_t n,
                                        struct ranges *out)
{
    out->n = 0;
    if (n == 0) {
        return tok_ranges_push(out, 0, 0, false);
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
        if (prev != a && tok_ranges_push(out, prev, a, false) != KR_OK) {
            return KR_ERR_NOMEM;
        }
        if (tok_ranges_push(out, a, b, true) != KR_OK) {
            return KR_ERR_NOMEM;
        }
        prev = b;
    }
    if (prev != n) {
        return tok_ranges_push(out, prev, n, false);
    }
    return KR_OK;
}

/* find_matches for a character predicate: every matching character is one match. */
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

enum kr_status tok_find_matches_pred(enum char_pred pred, uint32_t want, const char *s, size_t n,
                                     struct ranges *out)
{
    out->n = 0;
    if (n == 0) {
        return tok_ranges_push(out, 0, 0, false);
    }
    size_t last = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t l = kr_utf8_next(s + i, &cp);
        if (pred_match(pred, want, cp)) {
            if (last < i && tok_ranges_push(out, last, i, false) != KR_OK) {
                return KR_ERR_NOMEM;
            }
            if (tok_ranges_push(out, i, i + l, true) != KR_OK) {
                return KR_ERR_NOMEM;
            }
            last = i + l;
        }
        i += l;
    }
    if (n > last) {
        return tok_ranges_push(out, last, n, false);
    }
    return KR_OK;
}

/* NormalizedString::split: applies a delimiter behavior to the ranges of one piece and pushes
 * the non-empty results. */
enum kr_status tok_apply_behavior(const struct piece *pc, struct ranges *r, enum split_behavior bh, bool invert,
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
        if (tok_pieces_push(out, pc->s + r->v[i].a, r->v[i].b - r->v[i].a, -1, pc->first && r->v[i].a == 0) != KR_OK) {
            return KR_ERR_NOMEM;
        }
    }
    return KR_OK;
}
