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

/* What a decode keeps between its steps (and a detokenizer between its decodes): the token list a
 * step's output goes into next, and the ByteLevel step's byte buffer. */
struct dec_scratch {
    struct toks spare;
    struct kr_buf_s raw;
};

static void dec_scratch_free(struct dec_scratch *sc)
{
    kr_free(sc->spare.v);
    kr_bs_free(&sc->raw);
    sc->spare = (struct toks){0};
}

static enum kr_status decode_step(struct ctx *c, struct dec_scratch *sc, const struct decoder *d, struct toks *in,
                                  struct toks *out)
{
    enum kr_status st = KR_OK;
    const struct kr_tokenizer *t = c->t;
    out->n = 0;
    switch (d->type) {
    case DEC_SEQUENCE:
        return KR_ERR_INTERNAL;
    case DEC_BYTE_LEVEL: {
        struct kr_buf_s raw = sc->raw;
        raw.len = 0;
        for (size_t i = 0; i < in->n && st == KR_OK; i++) {
            const char *s = in->v[i].s;
            size_t n = in->v[i].len;
            /* a token of n bytes gives at most n bytes: written in place, not byte by byte through
             * the buffer's checks (this loop is most of a streamed token's cost) */
            if ((st = kr_bs_reserve(&raw, n)) != KR_OK) {
                break;
            }
            size_t at = raw.len;
            for (size_t k = 0; k < n;) {
                uint32_t cp;
                k += kr_utf8_next(s + k, &cp);
                if (cp >= 0x144 || t->char_byte[cp] < 0) {
                    at = SIZE_MAX;
                    break;
                }
                raw.p[at++] = (char)t->char_byte[cp];
            }
            if (at == SIZE_MAX) { /* a char outside the byte alphabet: the token's own UTF-8 bytes are used */
                st = kr_bs_append(&raw, s, n);
            } else {
                raw.len = at;
                raw.p[at] = '\0';
            }
        }
        c->buf.len = 0;
        if (st == KR_OK) {
            st = kr_bs_append_lossy(&c->buf, raw.p ? raw.p : "", raw.len);
        }
        if (st == KR_OK) {
            sc->raw = raw;
        } else {
            kr_bs_free(&raw);
            sc->raw = raw;
        }
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

static enum kr_status decode_chain(struct ctx *c, struct dec_scratch *sc, const struct decoder *d, struct toks *in)
{
    if (d->type == DEC_SEQUENCE) {
        for (size_t i = 0; i < d->n_sub; i++) {
            enum kr_status st = decode_chain(c, sc, &d->sub[i], in);
            if (st != KR_OK) {
                return st;
            }
        }
        return KR_OK;
    }
    /* the step writes into the spare list; its input becomes the next spare */
    struct toks out = sc->spare;
    out.n = 0;
    sc->spare = (struct toks){0};
    enum kr_status st = decode_step(c, sc, d, in, &out);
    sc->spare = *in;
    *in = out;
    return st;
}

/* Whether the full decode keeps `id`: it drops ids that name no token and, with skip, special ones. */
static bool id_decoded(const struct kr_tokenizer *t, int32_t id, bool skip)
{
    return id >= 0 && id < t->n_ids && t->id_str[id] && !(skip && t->id_special[id]);
}

/* Decodes ids[0..n_ids) into out (emptied first, NUL-terminated) with decoder dec (NULL: the tokens
 * joined by spaces) and c, whose regex state is open
 * and whose arena, scratch buffer and token list tk are reused from call to call. On failure the
 * reused buffers are freed (a failed growth is sticky) and out holds nothing. */
static enum kr_status decode_ids(struct ctx *c, struct dec_scratch *sc, struct toks *tk, const struct decoder *dec,
                                 const int32_t *ids, size_t n_ids, bool skip, struct kr_buf_s *out)
{
    const struct kr_tokenizer *t = c->t;
    enum kr_status st = KR_OK;
    tok_arena_reset(&c->arena);
    c->buf.len = 0;
    tk->n = 0;
    out->len = 0;
    for (size_t i = 0; i < n_ids && st == KR_OK; i++) {
        if (id_decoded(t, ids[i], skip)) {
            st = toks_push(tk, t->id_str[ids[i]], t->id_len[ids[i]]);
        }
    }
    if (st == KR_OK && dec) {
        st = decode_chain(c, sc, dec, tk);
    }
    if (st == KR_OK) {
        st = kr_bs_reserve(out, 0);
    }
    for (size_t i = 0; i < tk->n && st == KR_OK; i++) {
        if (!dec && i > 0) {
            st = kr_bs_putc(out, ' ');
        }
        if (st == KR_OK) {
            st = kr_bs_append(out, tk->v[i].s, tk->v[i].len);
        }
    }
    if (st != KR_OK) {
        kr_bs_free(out);
        kr_bs_free(&c->buf);
        kr_bs_free(&sc->raw);
    }
    return st;
}

enum kr_status kr_tokenizer_decode(const struct kr_tokenizer *t, const int32_t *ids, int64_t n_ids,
                                   bool skip_special_tokens, char **text, size_t *len, struct kr_err *err)
{
    *text = NULL;
    *len = 0;
    struct ctx c = {.t = t, .err = err};
    struct dec_scratch sc = {0};
    struct toks tk = {0};
    struct kr_buf_s out = {0};
    enum kr_status st = tok_rx_open(&c.rx, t, err);
    if (st == KR_OK) {
        st = decode_ids(&c, &sc, &tk, t->dec, ids, n_ids > 0 ? (size_t)n_ids : 0, skip_special_tokens, &out);
    }
    if (st == KR_OK) {
        *text = out.p;
        *len = out.len;
        out.p = NULL;
    } else if (st == KR_ERR_NOMEM) {
        kr_err_set(err, st, "tokenizer: out of memory while decoding %lld ids", (long long)n_ids);
    }
    kr_bs_free(&out);
    kr_free(tk.v);
    dec_scratch_free(&sc);
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

/* Only the ids the full decode keeps are pushed (see kr_detok_push), so the window below sees what
 * the decoders see. Window mode (HF's DecodeStream, as vLLM runs it): `ids` holds the ids since the
 * start of the previous emission, ids[0..read) decode to `prefix` (with stream_dec), and a push
 * decodes only that window: a few ids, so a stream costs O(n). When steps after the fusing one
 * cannot run on a window (a regex Replace over the whole text), the window decodes up to the fusing
 * step, the text it releases accumulates in `raw`, and those steps (stream_tail) run on all of
 * `raw` when it grows: O(n) bytes of regex a push, no decoding of old ids. Full mode (any other
 * decoder a window cannot reproduce): `ids` holds every id and `prefix` everything emitted. The
 * decode context (regex match data, arena, scratch) is kept from push to push. */
struct kr_detok {
    const struct kr_tokenizer *tok;
    bool skip_special;
    int32_t *ids;           /* [n] see above */
    size_t n, cap;
    size_t read;            /* window mode: ids[0..read) decode to `prefix` */
    struct kr_buf_s prefix; /* window mode: that decode; full mode: everything emitted so far */
    struct kr_buf_s text;   /* scratch: the latest decode */
    struct kr_buf_s piece;  /* the last piece returned */
    struct ctx c;           /* reused decode context; c.rx is open when rx_open */
    bool rx_open;
    struct toks tk;         /* reused token list */
    struct dec_scratch sc;  /* reused between decodes */
    size_t strip_lead;      /* stream_strip: leading characters it may still remove */
    size_t strip_held;      /* stream_strip: its characters held back at the end of the text */
    struct kr_buf_s raw;    /* stream_tail: the text the window released so far */
    struct kr_buf_s sent;   /* stream_tail: what stream_tail made of it that was emitted */
};

enum kr_status kr_detok_create(const struct kr_tokenizer *tok, bool skip_special_tokens, struct kr_detok **out)
{
    struct kr_detok *d = kr_calloc(1, sizeof(*d));
    if (!d) {
        return KR_ERR_NOMEM;
    }
    d->tok = tok;
    d->skip_special = skip_special_tokens;
    d->c.t = tok;
    d->strip_lead = tok->stream_strip ? tok->stream_strip->start : 0;
    *out = d;
    return KR_OK;
}

void kr_detok_destroy(struct kr_detok *d)
{
    if (!d) {
        return;
    }
    kr_free(d->ids);
    kr_bs_free(&d->prefix);
    kr_bs_free(&d->text);
    kr_bs_free(&d->piece);
    kr_bs_free(&d->raw);
    kr_bs_free(&d->sent);
    kr_free(d->tk.v);
    dec_scratch_free(&d->sc);
    kr_free(d->c.ranges.v);
    kr_bs_free(&d->c.buf);
    tok_arena_free(&d->c.arena);
    tok_rx_close(&d->c.rx);
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

/* Decodes ids[0..n) of the detokenizer into d->text. */
static enum kr_status detok_decode(struct kr_detok *d, const int32_t *ids, size_t n, struct kr_err *err)
{
    enum kr_status st = KR_OK;
    d->c.err = err;
    if (!d->rx_open) {
        st = tok_rx_open(&d->c.rx, d->tok, err);
        if (st != KR_OK) {
            tok_rx_close(&d->c.rx);
            return kr_err_set(err, st, "detokenizer: out of memory");
        }
        d->rx_open = true;
    }
    d->c.rx.err = err;
    st = decode_ids(&d->c, &d->sc, &d->tk, d->tok->stream_dec, ids, n, d->skip_special, &d->text);
    if (st == KR_ERR_NOMEM) {
        kr_err_set(err, st, "detokenizer: out of memory");
    }
    return st;
}

/* Makes s[0..n), the text newly decoded by stream_dec, the piece returned through *piece / *len.
 * A Strip cut off the decoder (stream_strip) applies to the whole text, so it is applied here to
 * the stream: up to `start` of its characters at the very beginning are dropped, and a run of them
 * at the end is held back (as a count) until other text follows, or the stream ends (`final`),
 * when all but `stop` of them are released. */
static enum kr_status detok_emit(struct kr_detok *d, const char *s, size_t n, bool final, const char **piece,
                                 size_t *len, struct kr_err *err)
{
    const struct decoder *strip = d->tok->stream_strip;
    char enc[4];
    size_t enc_len = 0, held = 0, run = 0;
    if (strip) {
        enc_len = kr_utf8_put(strip->ch, enc);
        while (d->strip_lead > 0 && n >= enc_len && memcmp(s, enc, enc_len) == 0) {
            s += enc_len;
            n -= enc_len;
            d->strip_lead--;
        }
        if (n > 0) {
            d->strip_lead = 0;
        }
        if (strip->stop > 0) {
            while (n - run * enc_len >= enc_len && memcmp(s + n - (run + 1) * enc_len, enc, enc_len) == 0) {
                run++;
            }
            if (run * enc_len < n) { /* other text: the held characters stay */
                held = d->strip_held;
                d->strip_held = 0;
            }
            d->strip_held += run;
            n -= run * enc_len;
            if (final) {
                held += d->strip_held > strip->stop ? d->strip_held - strip->stop : 0;
                d->strip_held = 0;
            }
        }
    }
    d->piece.len = 0;
    enum kr_status st = kr_bs_reserve(&d->piece, held * enc_len + n);
    for (size_t i = 0; i < held && st == KR_OK; i++) {
        st = kr_bs_append(&d->piece, enc, enc_len);
    }
    if (st == KR_OK) {
        st = kr_bs_append(&d->piece, s, n);
    }
    if (st != KR_OK) {
        kr_bs_free(&d->piece);
        return kr_err_set(err, KR_ERR_NOMEM, "detokenizer: out of memory");
    }
    *piece = d->piece.p;
    *len = d->piece.len;
    return KR_OK;
}

/* Full mode: decode everything, emit what is new, holding back an incomplete character and text a
 * final Strip could still remove. */
static enum kr_status detok_full(struct kr_detok *d, bool final, const char **piece, size_t *len, struct kr_err *err)
{
    enum kr_status st = detok_decode(d, d->ids, d->n, err);
    if (st != KR_OK) {
        return st;
    }
    const char *s = d->text.p;
    size_t n = d->text.len;
    size_t upto = final ? n : without_trailing(s, n, d->tok->stream_hold_cp);
    if (!final && ends_with_replacement(s, upto)) {
        upto = d->prefix.len; /* wait for the next id */
    }
    if (upto < d->prefix.len || memcmp(s, d->prefix.p ? d->prefix.p : "", d->prefix.len) != 0) {
        if (upto < d->prefix.len && !final) {
            return KR_OK;
        }
        return kr_err_set(err, KR_ERR_INTERNAL, "detokenizer: this tokenizer's decoder rewrote text that was "
                          "already streamed");
    }
    st = detok_emit(d, s + d->prefix.len, upto - d->prefix.len, final, piece, len, err);
    if (st == KR_OK && kr_bs_append(&d->prefix, s + d->prefix.len, upto - d->prefix.len) != KR_OK) {
        kr_bs_free(&d->prefix);
        d->n = 0; /* the stream is lost either way; keep the detokenizer consistent */
        *piece = "";
        *len = 0;
        st = kr_err_set(err, KR_ERR_NOMEM, "detokenizer: out of memory");
    }
    return st;
}

/* stream_tail: runs the tail steps on all of d->raw and emits what extends the text sent so far,
 * holding back what full mode holds back. */
static enum kr_status tail_emit(struct kr_detok *d, bool final, const char **piece, size_t *len, struct kr_err *err)
{
    const struct kr_tokenizer *t = d->tok;
    tok_arena_reset(&d->c.arena);
    d->c.err = err;
    d->c.rx.err = err;
    d->tk.n = 0;
    d->text.len = 0;
    enum kr_status st = toks_push(&d->tk, d->raw.p ? d->raw.p : "", d->raw.len);
    if (st == KR_OK) {
        st = decode_chain(&d->c, &d->sc, t->stream_tail, &d->tk);
    }
    if (st == KR_OK) {
        st = kr_bs_reserve(&d->text, 0);
    }
    for (size_t i = 0; i < d->tk.n && st == KR_OK; i++) {
        st = kr_bs_append(&d->text, d->tk.v[i].s, d->tk.v[i].len);
    }
    if (st != KR_OK) {
        kr_bs_free(&d->text);
        kr_bs_free(&d->c.buf);
        kr_bs_free(&d->sc.raw);
        return st == KR_ERR_NOMEM ? kr_err_set(err, st, "detokenizer: out of memory") : st;
    }
    const char *s = d->text.p;
    size_t n = d->text.len;
    size_t upto = final ? n : without_trailing(s, n, t->stream_hold_cp);
    if (!final && ends_with_replacement(s, upto)) {
        upto = d->sent.len;
    }
    if (upto < d->sent.len || memcmp(s, d->sent.p ? d->sent.p : "", d->sent.len) != 0) {
        if (upto < d->sent.len && !final) {
            return KR_OK;
        }
        return kr_err_set(err, KR_ERR_INTERNAL, "detokenizer: this tokenizer's decoder rewrote text that was "
                          "already streamed");
    }
    const size_t lead = d->strip_lead, held = d->strip_held;
    st = detok_emit(d, s + d->sent.len, upto - d->sent.len, final, piece, len, err);
    if (st == KR_OK && kr_bs_append(&d->sent, s + d->sent.len, upto - d->sent.len) != KR_OK) {
        kr_bs_free(&d->sent);
        d->strip_lead = lead;
        d->strip_held = held;
        *piece = "";
        *len = 0;
        st = kr_err_set(err, KR_ERR_NOMEM, "detokenizer: out of memory");
    }
    return st;
}

enum kr_status kr_detok_push(struct kr_detok *d, int32_t id, const char **piece, size_t *len, struct kr_err *err)
{
    *piece = "";
    *len = 0;
    const struct kr_tokenizer *t = d->tok;
    if (!id_decoded(t, id, d->skip_special)) {
        /* The full decode drops this id before its decoders run, so it must not end a run of byte
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
    if (!t->stream_window) {
        return detok_full(d, false, piece, len, err);
    }
    /* HF's DecodeStream::step */
    enum kr_status st = detok_decode(d, d->ids, d->n, err);
    if (st != KR_OK) {
        return st;
    }
    if (d->text.len <= d->prefix.len || ends_with_replacement(d->text.p, d->text.len)) {
        return KR_OK;
    }
    if (d->prefix.len && memcmp(d->text.p, d->prefix.p, d->prefix.len) != 0) {
        return kr_err_set(err, KR_ERR_INTERNAL, "detokenizer: the decoded window no longer starts with its prefix");
    }
    /* release the new text (emit it, or add it to `raw`); the window restarts at the read position,
     * and its decode is the next prefix (on failure nothing changes: the next push releases this
     * text) */
    const size_t lead = d->strip_lead, held = d->strip_held, raw_len = d->raw.len;
    const char *s = d->text.p + d->prefix.len;
    const size_t n = d->text.len - d->prefix.len;
    if (t->stream_tail) {
        if (kr_bs_append(&d->raw, s, n) != KR_OK) {
            kr_bs_free(&d->raw); /* the stream is lost either way; a flush restarts it */
            return kr_err_set(err, KR_ERR_NOMEM, "detokenizer: out of memory");
        }
    } else if ((st = detok_emit(d, s, n, false, piece, len, err)) != KR_OK) {
        return st;
    }
    if ((st = detok_decode(d, d->ids + d->read, d->n - d->read, err)) != KR_OK) {
        d->strip_lead = lead;
        d->strip_held = held;
        d->raw.len = raw_len;
        *piece = "";
        *len = 0;
        return st;
    }
    memmove(d->ids, d->ids + d->read, (d->n - d->read) * sizeof(*d->ids));
    d->n -= d->read;
    d->read = d->n;
    struct kr_buf_s tmp = d->prefix;
    d->prefix = d->text;
    d->text = tmp;
    return t->stream_tail ? tail_emit(d, false, piece, len, err) : KR_OK;
}

enum kr_status kr_detok_flush(struct kr_detok *d, const char **piece, size_t *len, struct kr_err *err)
{
    *piece = "";
    *len = 0;
    enum kr_status st = KR_OK;
    if (!d->tok->stream_window) {
        st = detok_full(d, true, piece, len, err);
    } else {
        st = detok_decode(d, d->ids, d->n, err);
        if (st == KR_OK) {
            size_t from = d->text.len > d->prefix.len ? d->prefix.len : d->text.len;
            if (!d->tok->stream_tail) {
                st = detok_emit(d, d->text.p + from, d->text.len - from, true, piece, len, err);
            } else if (kr_bs_append(&d->raw, d->text.p + from, d->text.len - from) != KR_OK) {
                st = kr_err_set(err, KR_ERR_NOMEM, "detokenizer: out of memory");
            } else {
                st = tail_emit(d, true, piece, len, err);
            }
        }
    }
    d->n = 0;
    d->read = 0;
    d->prefix.len = 0;
    d->raw.len = 0;
    d->sent.len = 0;
    if (d->raw.oom) { /* a failed growth is sticky */
        kr_bs_free(&d->raw);
    }
    if (d->sent.oom) {
        kr_bs_free(&d->sent);
    }
    d->strip_lead = d->tok->stream_strip ? d->tok->stream_strip->start : 0;
    d->strip_held = 0;
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

/* Chooses how kr_detok_* streams t's decoder. A Strip that ends a Sequence after the tokens were
 * fused (ByteLevel, Fuse) acts on the whole text: only at its start and at its end. The stream
 * decodes without it and applies it to the streamed text (detok_emit), which keeps a window exact
 * for Strips of any `start` (a window cannot tell whether its first characters begin the text). */
void tok_stream_setup(struct kr_tokenizer *t)
{
    bool fused = false;
    int32_t hold = -1;
    t->stream_dec = t->dec;
    t->stream_strip = NULL;
    if (t->dec && t->dec->type == DEC_SEQUENCE && t->dec->n_sub > 0 &&
        t->dec->sub[t->dec->n_sub - 1].type == DEC_STRIP) {
        t->stream_dec_cut = *t->dec;
        t->stream_dec_cut.n_sub--;
        tok_decoder_window_safe(&t->stream_dec_cut, &fused, &hold);
        if (fused) {
            t->stream_dec = &t->stream_dec_cut;
            t->stream_strip = &t->dec->sub[t->dec->n_sub - 1];
        }
    }
    fused = false;
    t->stream_hold_cp = -1;
    t->stream_tail = NULL;
    t->stream_window = !t->stream_dec || tok_decoder_window_safe(t->stream_dec, &fused, &t->stream_hold_cp);
    const struct decoder *sd = t->stream_dec;
    if (!t->stream_window && sd->type == DEC_SEQUENCE) {
        /* the steps up to the first fusing one may still be windowed; the rest act on one string */
        size_t f = 0;
        while (f < sd->n_sub && sd->sub[f].type != DEC_BYTE_LEVEL && sd->sub[f].type != DEC_FUSE) {
            f++;
        }
        struct decoder head = *sd;
        head.n_sub = f + 1;
        bool head_fused = false;
        int32_t head_hold = -1;
        if (f < sd->n_sub && tok_decoder_window_safe(&head, &head_fused, &head_hold)) {
            t->stream_tail_seq = *sd;
            t->stream_tail_seq.sub = sd->sub + f + 1;
            t->stream_tail_seq.n_sub = sd->n_sub - (f + 1);
            t->stream_tail = &t->stream_tail_seq;
            t->stream_dec_cut = head;
            t->stream_dec = &t->stream_dec_cut;
            t->stream_window = true;
        }
    }
    t->stream_byte_runs = t->dec && tok_decoder_has(t->dec, DEC_BYTE_FALLBACK);
}

bool tok_decoder_has(const struct decoder *d, enum dec_type type)
{
    bool r = d->type == type;
    for (size_t i = 0; i < d->n_sub; i++) {
        r = r || tok_decoder_has(&d->sub[i], type);
    }
    return r;
}
