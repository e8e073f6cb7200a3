/* The tokenizer's text steps before the model: normalizers (Unicode forms, lowercase, strip, strip
 * accents, prepend, append, replace, byte level, sequences) and pre-tokenizers (byte level, split,
 * digits, metaspace, whitespace, punctuation, BERT, char delimiter, sequences). */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"

#include <string.h>

/* ---- normalizers ---------------------------------------------------------------------------- */

static enum kr_status byte_level_map(struct ctx *c, const char *s, size_t n, const char **out, size_t *out_len)
{
    char *p = tok_arena_alloc(&c->arena, n * 2 + 1);
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
enum kr_status tok_take_buf(struct ctx *c, const char **s, size_t *n)
{
    char *p = tok_arena_alloc(&c->arena, c->buf.len + 1);
    if (!p) {
        return KR_ERR_NOMEM;
    }
    memcpy(p, c->buf.p ? c->buf.p : "", c->buf.len);
    *s = p;
    *n = c->buf.len;
    return KR_OK;
}

enum kr_status tok_replace_all(struct ctx *c, const struct pattern *pat, const char *rep, size_t rep_len,
                               const char *s, size_t n, const char **out, size_t *out_len)
{
    enum kr_status st = tok_find_matches_pattern(&c->rx, pat, s, n, &c->ranges);
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
    return tok_take_buf(c, out, out_len);
}

enum kr_status tok_normalize(struct ctx *c, const struct normalizer *nz, const char **s, size_t *n)
{
    enum kr_status st = KR_OK;
    switch (nz->type) {
    case NORM_SEQUENCE:
        for (size_t i = 0; i < nz->n_sub && st == KR_OK; i++) {
            st = tok_normalize(c, &nz->sub[i], s, n);
        }
        return st;
    case NORM_NFC:
    case NORM_NFD:
    case NORM_NFKC:
    case NORM_NFKD: {
        static const enum kr_uni_nf forms[] = {KR_NF_C, KR_NF_D, KR_NF_KC, KR_NF_KD};
        c->buf.len = 0;
        st = kr_uni_normalize(forms[nz->type - NORM_NFC], *s, *n, &c->buf);
        return st == KR_OK ? tok_take_buf(c, s, n) : st;
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
        return st == KR_OK ? tok_take_buf(c, s, n) : st;
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
        return st == KR_OK ? tok_take_buf(c, s, n) : st;
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
        char *p = tok_arena_alloc(&c->arena, *n + nz->str_len + 1);
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
        return tok_replace_all(c, &nz->pat, nz->str, nz->str_len, *s, *n, s, n);
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
        st = tok_find_matches_pattern(&c->rx, &pt->pat, pc->s, pc->len, &c->ranges);
        return st == KR_OK ? tok_apply_behavior(pc, &c->ranges, pt->behavior, pt->invert, out) : st;
    case PT_DIGITS:
        st = tok_find_matches_pred(PRED_NUMERIC, 0, pc->s, pc->len, &c->ranges);
        return st == KR_OK ? tok_apply_behavior(pc, &c->ranges, pt->individual_digits ? SPLIT_ISOLATED : SPLIT_CONTIGUOUS,
                                                false, out)
                           : st;
    case PT_WHITESPACE: {
        struct pattern p = {.re = t->re_whitespace};
        st = tok_find_matches_pattern(&c->rx, &p, pc->s, pc->len, &c->ranges);
        return st == KR_OK ? tok_apply_behavior(pc, &c->ranges, SPLIT_REMOVED, true, out) : st;
    }
    case PT_WHITESPACE_SPLIT:
        st = tok_find_matches_pred(PRED_WHITESPACE, 0, pc->s, pc->len, &c->ranges);
        return st == KR_OK ? tok_apply_behavior(pc, &c->ranges, SPLIT_REMOVED, false, out) : st;
    case PT_PUNCTUATION:
        st = tok_find_matches_pred(PRED_PUNCT, 0, pc->s, pc->len, &c->ranges);
        return st == KR_OK ? tok_apply_behavior(pc, &c->ranges, pt->behavior, false, out) : st;
    case PT_CHAR_DELIMITER:
        st = tok_find_matches_pred(PRED_EQ, pt->ch, pc->s, pc->len, &c->ranges);
        return st == KR_OK ? tok_apply_behavior(pc, &c->ranges, SPLIT_REMOVED, false, out) : st;
    case PT_BERT: {
        struct pieces tmp = {0};
        st = tok_find_matches_pred(PRED_WHITESPACE, 0, pc->s, pc->len, &c->ranges);
        if (st == KR_OK) {
            st = tok_apply_behavior(pc, &c->ranges, SPLIT_REMOVED, false, &tmp);
        }
        for (size_t i = 0; i < tmp.n && st == KR_OK; i++) {
            st = tok_find_matches_pred(PRED_PUNCT, 0, tmp.v[i].s, tmp.v[i].len, &c->ranges);
            if (st == KR_OK) {
                st = tok_apply_behavior(&tmp.v[i], &c->ranges, SPLIT_ISOLATED, false, out);
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
            st = tok_take_buf(c, &np.s, &np.len);
        }
        if (st != KR_OK) {
            return st;
        }
        if (!pt->split) {
            return np.len ? tok_pieces_push(out, np.s, np.len, -1, np.first) : KR_OK;
        }
        st = tok_find_matches_pred(PRED_EQ, pt->ch, np.s, np.len, &c->ranges);
        return st == KR_OK ? tok_apply_behavior(&np, &c->ranges, SPLIT_MERGED_NEXT, false, out) : st;
    }
    case PT_BYTE_LEVEL: {
        struct piece np = *pc;
        if (pt->add_prefix_space && !(pc->len > 0 && pc->s[0] == ' ')) {
            char *p = tok_arena_alloc(&c->arena, pc->len + 2);
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
            st = tok_find_matches_pattern(&c->rx, &p, np.s, np.len, &c->ranges);
            if (st == KR_OK) {
                st = tok_apply_behavior(&np, &c->ranges, SPLIT_ISOLATED, false, out);
            }
        } else {
            st = np.len ? tok_pieces_push(out, np.s, np.len, -1, np.first) : KR_OK;
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
enum kr_status tok_pretok_apply(struct ctx *c, const struct pretok *pt, struct pieces *p)
{
    if (pt->type == PT_SEQUENCE) {
        for (size_t i = 0; i < pt->n_sub; i++) {
            enum kr_status st = tok_pretok_apply(c, &pt->sub[i], p);
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
            st = tok_pieces_push(&out, p->v[i].s, p->v[i].len, p->v[i].id, p->v[i].first);
        } else {
            st = pretok_one(c, pt, &p->v[i], &out);
        }
    }
    kr_free(p->v);
    *p = out;
    return st;
}
