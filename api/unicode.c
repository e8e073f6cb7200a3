#define _POSIX_C_SOURCE 200809L

#include "unicode.h"

#include "alloc.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <utf8proc.h>

/* ---- character classes ---------------------------------------------------------------------- */

bool kr_uni_is_white_space(uint32_t cp)
{
    /* Unicode 15 PropList.txt, White_Space. */
    return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

bool kr_uni_is_py_space(uint32_t cp)
{
    /* CPython's _PyUnicode_IsWhitespace: bidirectional class WS, B or S, or category Zs. That adds
     * the ASCII information separators U+001C..U+001F to White_Space. */
    return kr_uni_is_white_space(cp) || (cp >= 0x1C && cp <= 0x1F);
}

bool kr_uni_is_alnum(uint32_t cp)
{
    utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
    return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) ||
           (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO);
}

bool kr_uni_is_numeric(uint32_t cp)
{
    utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
    return c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO;
}

bool kr_uni_is_punctuation(uint32_t cp)
{
    if (cp < 0x80) {
        return (cp >= 0x21 && cp <= 0x2F) || (cp >= 0x3A && cp <= 0x40) || (cp >= 0x5B && cp <= 0x60) ||
               (cp >= 0x7B && cp <= 0x7E);
    }
    utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
    return c >= UTF8PROC_CATEGORY_PC && c <= UTF8PROC_CATEGORY_PO;
}

bool kr_uni_is_mark(uint32_t cp)
{
    utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
    return c >= UTF8PROC_CATEGORY_MN && c <= UTF8PROC_CATEGORY_ME;
}

bool kr_uni_is_word(uint32_t cp)
{
    if (cp == 0x200C || cp == 0x200D) {
        return true;
    }
    utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
    return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_ND) || c == UTF8PROC_CATEGORY_NL ||
           c == UTF8PROC_CATEGORY_PC;
}

bool kr_uni_is_printable(uint32_t cp)
{
    if (cp == ' ') {
        return true;
    }
    utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
    return !(c == UTF8PROC_CATEGORY_CN || c >= UTF8PROC_CATEGORY_ZS);
}

uint32_t kr_uni_tolower(uint32_t cp)
{
    return (uint32_t)utf8proc_tolower((utf8proc_int32_t)cp);
}

uint32_t kr_uni_toupper(uint32_t cp)
{
    return (uint32_t)utf8proc_toupper((utf8proc_int32_t)cp);
}

uint32_t kr_uni_totitle(uint32_t cp)
{
    return (uint32_t)utf8proc_totitle((utf8proc_int32_t)cp);
}

/* ---- growable buffer -------------------------------------------------------------------------- */

enum kr_status kr_bs_reserve(struct kr_buf_s *b, size_t extra)
{
    if (b->oom) {
        return KR_ERR_NOMEM;
    }
    if (extra < b->cap && b->len + extra + 1 <= b->cap) {
        return KR_OK;
    }
    if (extra > SIZE_MAX / 2 - b->len || (b->limit && b->len + extra > b->limit)) {
        b->over = b->limit != 0;
        b->oom = true;
        return KR_ERR_NOMEM;
    }
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->len + extra + 1) {
        if (cap > SIZE_MAX / 2) {
            b->oom = true;
            return KR_ERR_NOMEM;
        }
        cap *= 2;
    }
    char *p = kr_realloc(b->p, cap);
    if (!p) {
        b->oom = true;
        return KR_ERR_NOMEM;
    }
    b->p = p;
    b->cap = cap;
    p[b->len] = '\0'; /* the invariant holds from the first reserve: an empty text is "" */
    return KR_OK;
}

enum kr_status kr_bs_append(struct kr_buf_s *b, const void *data, size_t n)
{
    if (kr_bs_reserve(b, n) != KR_OK) {
        return KR_ERR_NOMEM;
    }
    if (n) {
        memcpy(b->p + b->len, data, n);
    }
    b->len += n;
    b->p[b->len] = '\0';
    return KR_OK;
}

enum kr_status kr_bs_putc(struct kr_buf_s *b, char c)
{
    return kr_bs_append(b, &c, 1);
}

enum kr_status kr_bs_put_cp(struct kr_buf_s *b, uint32_t cp)
{
    char tmp[4];
    return kr_bs_append(b, tmp, kr_utf8_put(cp, tmp));
}

enum kr_status kr_bs_printf(struct kr_buf_s *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->oom = true;
    }
    if (n < 0 || kr_bs_reserve(b, (size_t)n) != KR_OK) {
        va_end(ap2);
        return KR_ERR_NOMEM;
    }
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap2);
    va_end(ap2);
    b->len += (size_t)n;
    return KR_OK;
}

void kr_bs_free(struct kr_buf_s *b)
{
    kr_free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
    b->oom = b->over = false;
}

enum kr_status kr_bs_append_lossy(struct kr_buf_s *b, const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, run = 0; /* run: start of the pending valid stretch */
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        size_t len;
        uint32_t cp;
        enum kr_utf8_scan r = kr_utf8_scan(u + i, n - i, &len, &cp);
        if (r == KR_UTF8_CHAR) {
            i += len;
            continue;
        }
        if (kr_bs_append(b, s + run, i - run) != KR_OK || kr_bs_append(b, "\xEF\xBF\xBD", 3) != KR_OK) {
            return KR_ERR_NOMEM;
        }
        i += len;
        run = i;
    }
    return kr_bs_append(b, s + run, n - run);
}

/* ---- normalization ---------------------------------------------------------------------------- */

enum kr_status kr_uni_normalize(enum kr_uni_nf form, const char *s, size_t n, struct kr_buf_s *out)
{
    utf8proc_option_t opt = UTF8PROC_STABLE;
    switch (form) {
    case KR_NF_C:
        opt |= UTF8PROC_COMPOSE;
        break;
    case KR_NF_D:
        opt |= UTF8PROC_DECOMPOSE;
        break;
    case KR_NF_KC:
        opt |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
        break;
    case KR_NF_KD:
        opt |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
        break;
    }
    if (n == 0) {
        return kr_bs_reserve(out, 0);
    }
    if (n > (size_t)INT32_MAX) {
        return KR_ERR_INVAL;
    }
    utf8proc_ssize_t need = utf8proc_decompose((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, NULL, 0, opt);
    if (need < 0) {
        return need == UTF8PROC_ERROR_NOMEM ? KR_ERR_NOMEM : KR_ERR_INVAL;
    }
    /* utf8proc_reencode writes UTF-8 in place over the code point buffer: 4 bytes per code point
     * plus a terminator always fit. */
    utf8proc_int32_t *buf = kr_malloc(((size_t)need + 1) * sizeof(utf8proc_int32_t));
    if (!buf) {
        return KR_ERR_NOMEM;
    }
    utf8proc_ssize_t got =
        utf8proc_decompose((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, buf, need, opt);
    enum kr_status st = KR_ERR_INVAL;
    if (got == need) {
        utf8proc_ssize_t bytes = utf8proc_reencode(buf, got, opt);
        if (bytes >= 0) {
            st = kr_bs_append(out, buf, (size_t)bytes);
        }
    }
    kr_free(buf);
    return st;
}
