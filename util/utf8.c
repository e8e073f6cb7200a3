#include "utf8.h"

enum kr_utf8_scan kr_utf8_scan(const unsigned char *s, size_t n, size_t *len, uint32_t *cp)
{
    unsigned b0 = s[0];
    if (b0 < 0x80) {
        *len = 1;
        *cp = b0;
        return KR_UTF8_CHAR;
    }
    size_t need;
    unsigned lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    uint32_t c;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
        need = 2;
        c = b0 & 0x1F;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
        need = 3;
        c = b0 & 0x0F;
        if (b0 == 0xE0) {
            lo = 0xA0;
        } else if (b0 == 0xED) {
            hi = 0x9F; /* no surrogates */
        }
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
        need = 4;
        c = b0 & 0x07;
        if (b0 == 0xF0) {
            lo = 0x90;
        } else if (b0 == 0xF4) {
            hi = 0x8F;
        }
    } else {
        *len = 1;
        return KR_UTF8_INVALID;
    }
    for (size_t i = 1; i < need; i++) {
        if (i >= n) {
            *len = n;
            return KR_UTF8_TRUNCATED;
        }
        unsigned b = s[i];
        unsigned l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
        if (b < l || b > h) {
            *len = i;
            return KR_UTF8_INVALID;
        }
        c = (c << 6) | (b & 0x3F);
    }
    *len = need;
    *cp = c;
    return KR_UTF8_CHAR;
}

size_t kr_utf8_validate(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        size_t len;
        uint32_t cp;
        if (kr_utf8_scan(u + i, n - i, &len, &cp) != KR_UTF8_CHAR) {
            return i;
        }
        i += len;
    }
    return n;
}

size_t kr_utf8_next(const char *s, uint32_t *cp)
{
    const unsigned char *u = (const unsigned char *)s;
    if (u[0] < 0x80) {
        *cp = u[0];
        return 1;
    }
    if (u[0] < 0xE0) {
        *cp = ((uint32_t)(u[0] & 0x1F) << 6) | (u[1] & 0x3F);
        return 2;
    }
    if (u[0] < 0xF0) {
        *cp = ((uint32_t)(u[0] & 0x0F) << 12) | ((uint32_t)(u[1] & 0x3F) << 6) | (u[2] & 0x3F);
        return 3;
    }
    *cp = ((uint32_t)(u[0] & 0x07) << 18) | ((uint32_t)(u[1] & 0x3F) << 12) | ((uint32_t)(u[2] & 0x3F) << 6) |
          (u[3] & 0x3F);
    return 4;
}

size_t kr_utf8_put(uint32_t cp, char out[4])
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}
