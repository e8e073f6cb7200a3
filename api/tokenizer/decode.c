/* The tokenizer's decode path: decoders (byte level, metaspace, replace, byte fallback, fuse, strip,
 * BPE suffix, sequences), kr_tokenizer_decode(), and the incremental detokenizer (kr_detok_*), which
 * releases text as HF's DecodeStream does. */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"

#include <string.h>

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
    enum kr_status st = tok_take_buf(c, &s, &n);
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
            st = tok_replace_all(c, &d->pat, d->str, d->str_len, in->v[i].s, in->v[i].len, &s, &n);
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
            st = tok_replace_all(c, &p, last ? "" : " ", last ? 0 : 1, in->v[i].s, in->v[i].len, &s, &n);
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
    if (tok_rx_open(&c.rx, t, err) != KR_OK) {
        goto fail;
    }
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
    tok_arena_free(&c.arena);
    tok_rx_close(&c.rx);
    return st;
}

/* ---- one token's bytes ------------------------------------------------------------------------- */

/* Applies the per-token part of decoder d to the token text *s / *n. *final: a ByteFallback byte,
 * which no later step changes. */
static enum kr_status token_bytes_step(struct ctx *c, const struct decoder *d, const char **s, size_t *n,
                                       bool *final)
{
    const struct kr_tokenizer *t = c->t;
    enum kr_status st = KR_OK;
    if (*final) {
        return KR_OK;
    }
    switch (d->type) {
    case DEC_SEQUENCE:
        for (size_t i = 0; i < d->n_sub && st == KR_OK; i++) {
            st = token_bytes_step(c, &d->sub[i], s, n, final);
        }
        return st;
    case DEC_BYTE_LEVEL:
        c->buf.len = 0;
        for (size_t k = 0; k < *n && st == KR_OK;) {
            uint32_t cp;
            k += kr_utf8_next(*s + k, &cp);
            if (cp >= 0x144 || t->char_byte[cp] < 0) { /* outside the alphabet: the text itself */
                return KR_OK;
            }
            st = kr_bs_putc(&c->buf, (char)t->char_byte[cp]);
        }
        return st == KR_OK ? tok_take_buf(c, s, n) : st;
    case DEC_METASPACE:
        c->buf.len = 0;
        for (size_t k = 0; k < *n && st == KR_OK;) {
            uint32_t cp;
            size_t l = kr_utf8_next(*s + k, &cp);
            st = cp == d->ch ? kr_bs_putc(&c->buf, ' ') : kr_bs_append(&c->buf, *s + k, l);
            k += l;
        }
        return st == KR_OK ? tok_take_buf(c, s, n) : st;
    case DEC_REPLACE:
        return tok_replace_all(c, &d->pat, d->str, d->str_len, *s, *n, s, n);
    case DEC_BYTE_FALLBACK: {
        int v = byte_token_value(*s, *n);
        if (v >= 0) {
            c->buf.len = 0;
            *final = true;
            st = kr_bs_putc(&c->buf, (char)v);
            return st == KR_OK ? tok_take_buf(c, s, n) : st;
        }
        return KR_OK;
    }
    case DEC_BPE: {
        struct pattern p = {.lit = d->str, .lit_len = d->str_len};
        return tok_replace_all(c, &p, " ", 1, *s, *n, s, n);
    }
    case DEC_FUSE:
    case DEC_STRIP:
        return KR_OK;
    }
    return KR_ERR_INTERNAL;
}

enum kr_status kr_tokenizer_token_bytes(const struct kr_tokenizer *t, int32_t id, char **bytes, size_t *len,
                                        struct kr_err *err)
{
    *bytes = NULL;
    *len = 0;
    if (id < 0 || id >= t->n_ids || !t->id_str[id] || t->id_special[id]) {
        return KR_OK;
    }
    const char *s = t->id_str[id];
    size_t n = t->id_len[id];
    bool final = false;
    struct ctx c = {.t = t, .err = err};
    enum kr_status st = KR_OK;
    if (t->dec) {
        st = tok_rx_open(&c.rx, t, err);
        if (st == KR_OK) {
            st = token_bytes_step(&c, t->dec, &s, &n, &final);
        }
    }
    if (st == KR_OK && n > 0) {
        *bytes = kr_malloc(n);
        if (*bytes) {
            memcpy(*bytes, s, n);
            *len = n;
        } else {
            st = KR_ERR_NOMEM;
        }
    }
    if (st == KR_ERR_NOMEM) {
        kr_err_set(err, st, "tokenizer: out of memory while reading the bytes of token %d", id);
    }
    kr_free(c.ranges.v);
    kr_bs_free(&c.buf);
    tok_arena_free(&c.arena);
    tok_rx_close(&c.rx);
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
    const struct kr_tokenizer *t = d->tok;
    if (id < 0 || id >= t->n_ids || !t->id_str[id] || (d->skip_special && t->id_special[id])) {
        /* The full decode drops this id before its decoder runs, so it must not end a run of byte
         * tokens (or anything else) here either: it is as if it never came. */
        return KR_OK;
    }
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
    if (t->stream_byte_runs && byte_token_value(t->id_str[id], t->id_len[id]) >= 0) {
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
bool tok_decoder_window_safe(const struct decoder *d, bool *fused, int32_t *hold)
{
    switch (d->type) {
    case DEC_SEQUENCE: {
        bool ok = true;
        for (size_t i = 0; i < d->n_sub; i++) {
            ok = tok_decoder_window_safe(&d->sub[i], fused, hold) && ok;
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

bool tok_decoder_has(const struct decoder *d, enum dec_type type)
{
    bool r = d->type == type;
    for (size_t i = 0; i < d->n_sub; i++) {
        r = r || tok_decoder_has(&d->sub[i], type);
    }
    return r;
}
