/* util/utf8: the RFC 3629 validator. The cases are written out from RFC 3629 section 4 (the
 * syntax of UTF-8 octet sequences), its section 10 (overlongs and surrogates) and Unicode 15
 * section 3.9 table 3-8 (maximal subparts), not taken from the implementation. */
#include "utf8.h"

#include <criterion/criterion.h>
#include <string.h>

#define S(lit) lit, sizeof(lit) - 1

static void expect_valid(const char *s, size_t n)
{
    cr_expect_eq(kr_utf8_validate(s, n), n, "expected valid: %zu bytes, first 0x%02x", n,
                 n ? (unsigned char)s[0] : 0);
}

/* `at`: the offset of the first bad byte. */
static void expect_invalid(const char *s, size_t n, size_t at)
{
    cr_expect_eq(kr_utf8_validate(s, n), at, "expected invalid at %zu, got %zu (first 0x%02x)", at,
                 kr_utf8_validate(s, n), (unsigned char)s[0]);
}

Test(utf8, valid_sequences_of_each_length)
{
    expect_valid(S(""));
    expect_valid(S("plain ascii \x01\x7f"));
    expect_valid("\0", 1);                    /* U+0000 is a character */
    expect_valid(S("\xC2\x80"));              /* U+0080, first 2-byte */
    expect_valid(S("\xDF\xBF"));              /* U+07FF, last 2-byte */
    expect_valid(S("\xE0\xA0\x80"));          /* U+0800, first 3-byte */
    expect_valid(S("\xED\x9F\xBF"));          /* U+D7FF, below the surrogates */
    expect_valid(S("\xEE\x80\x80"));          /* U+E000, above the surrogates */
    expect_valid(S("\xEF\xBF\xBD"));          /* U+FFFD */
    expect_valid(S("\xEF\xBF\xBF"));          /* U+FFFF: a noncharacter, still valid */
    expect_valid(S("\xF0\x90\x80\x80"));      /* U+10000, first 4-byte */
    expect_valid(S("\xF4\x8F\xBF\xBF"));      /* U+10FFFF, the last code point */
    expect_valid(S("\x7A\xE6\xB0\xB4\xF0\x9D\x84\x9E")); /* RFC 3629 s. 7: "z", U+6C34, U+1D11E */
    expect_valid(S("\xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4")); /* RFC 3629 s. 7: Korean "hangugeo" */
    expect_valid(S("\xEF\xBB\xBF\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E")); /* BOM + "nihongo" */
}

Test(utf8, lone_and_misplaced_bytes)
{
    expect_invalid(S("\x80"), 0);            /* a continuation byte alone */
    expect_invalid(S("\xBF"), 0);
    expect_invalid(S("a\x80z"), 1);
    expect_invalid(S("\xC0\x80"), 0);        /* C0, C1: never used */
    expect_invalid(S("\xC1\xBF"), 0);
    expect_invalid(S("\xF5\x80\x80\x80"), 0); /* F5..FF: never used */
    expect_invalid(S("\xF8\x88\x80\x80\x80"), 0);
    expect_invalid(S("\xFE"), 0);
    expect_invalid(S("\xFF"), 0);
    expect_invalid(S("\xC2\x41"), 0);        /* a lead byte followed by ASCII */
    expect_invalid(S("\xE1\x80\x41"), 0);
    expect_invalid(S("\xF1\x80\x80\xC0"), 0);
}

Test(utf8, overlong_forms)
{
    expect_invalid(S("\xC0\xAF"), 0);          /* "/" in 2 bytes */
    expect_invalid(S("\xE0\x80\xAF"), 0);      /* "/" in 3 bytes */
    expect_invalid(S("\xF0\x80\x80\xAF"), 0);  /* "/" in 4 bytes */
    expect_invalid(S("\xC1\xBF"), 0);          /* U+007F in 2 bytes */
    expect_invalid(S("\xE0\x9F\xBF"), 0);      /* U+07FF in 3 bytes */
    expect_invalid(S("\xF0\x8F\xBF\xBF"), 0);  /* U+FFFF in 4 bytes */
    expect_invalid(S("\xC0\x80"), 0);          /* U+0000 in 2 bytes ("modified UTF-8") */
    expect_invalid(S("ok\xE0\x80\x80"), 2);
}

Test(utf8, surrogates)
{
    expect_invalid(S("\xED\xA0\x80"), 0);                 /* U+D800 */
    expect_invalid(S("\xED\xAD\xBF"), 0);                 /* U+DB7F */
    expect_invalid(S("\xED\xB0\x80"), 0);                 /* U+DC00 */
    expect_invalid(S("\xED\xBF\xBF"), 0);                 /* U+DFFF */
    expect_invalid(S("\xED\xA0\x80\xED\xB0\x80"), 0);     /* a CESU-8 pair for U+10000 */
    expect_invalid(S("x\xED\xA0\xBD\xED\xB8\x80"), 1);
}

Test(utf8, above_u10ffff)
{
    expect_invalid(S("\xF4\x90\x80\x80"), 0); /* U+110000 */
    expect_invalid(S("\xF4\xBF\xBF\xBF"), 0);
    expect_invalid(S("\xF5\x80\x80\x80"), 0); /* U+140000 */
    expect_invalid(S("\xF7\xBF\xBF\xBF"), 0); /* U+1FFFFF */
}

Test(utf8, truncated_sequences)
{
    expect_invalid(S("\xC2"), 0);
    expect_invalid(S("\xE0\xA0"), 0);
    expect_invalid(S("\xE2"), 0);
    expect_invalid(S("\xF0\x90\x80"), 0);
    expect_invalid(S("\xF4\x8F"), 0);
    expect_invalid(S("abc\xE6\xB0"), 3);
    /* the length bounds the scan: a valid sequence cut by n is truncated */
    expect_invalid("\xE6\xB0\xB4", 2, 0);
    expect_valid("\xE6\xB0\xB4", 3);
}

/* kr_utf8_scan's outcome and length at s[0..n). */
static void expect_scan(const char *s, size_t n, enum kr_utf8_scan want, size_t want_len)
{
    size_t len = 0;
    uint32_t cp = 0;
    enum kr_utf8_scan got = kr_utf8_scan((const unsigned char *)s, n, &len, &cp);
    cr_expect_eq(got, want, "scan of 0x%02x (%zu bytes): %d, want %d", (unsigned char)s[0], n, got, want);
    cr_expect_eq(len, want_len, "scan of 0x%02x (%zu bytes): len %zu, want %zu", (unsigned char)s[0], n, len,
                 want_len);
}

Test(utf8, scan_reports_maximal_subparts)
{
    expect_scan(S("\xF0\x9D\x84\x9E"), KR_UTF8_CHAR, 4);
    expect_scan(S("\x80"), KR_UTF8_INVALID, 1);
    expect_scan(S("\xC0\xAF"), KR_UTF8_INVALID, 1);     /* C0 can start nothing */
    expect_scan(S("\xE0\x80\xAF"), KR_UTF8_INVALID, 1); /* E0 80: the second byte is out of range */
    expect_scan(S("\xED\xA0\x80"), KR_UTF8_INVALID, 1); /* a surrogate: ED A0 is no prefix */
    expect_scan(S("\xF4\x90\x80\x80"), KR_UTF8_INVALID, 1);
    expect_scan(S("\xE1\x80\x41"), KR_UTF8_INVALID, 2); /* E1 80 is a prefix; 41 ends it */
    expect_scan(S("\xF1\x80\x80\x41"), KR_UTF8_INVALID, 3);
    expect_scan(S("\xF1\x80\x80"), KR_UTF8_TRUNCATED, 3);
    expect_scan(S("\xE2"), KR_UTF8_TRUNCATED, 1);

    /* Unicode 15 table 3-8: 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64 decodes to
     * 61 FFFD FFFD FFFD 62 FFFD 63 FFFD FFFD 64. */
    const unsigned char t[] = {0x61, 0xF1, 0x80, 0x80, 0xE1, 0x80, 0xC2, 0x62, 0x80, 0x63, 0x80, 0xBF, 0x64};
    const size_t want_len[] = {1, 3, 2, 1, 1, 1, 1, 1, 1, 1};
    const int want_ok[] = {1, 0, 0, 0, 1, 0, 1, 0, 0, 1};
    size_t i = 0, k = 0;
    while (i < sizeof t) {
        size_t len;
        uint32_t cp;
        enum kr_utf8_scan r = kr_utf8_scan(t + i, sizeof t - i, &len, &cp);
        cr_assert_lt(k, sizeof want_len / sizeof want_len[0]);
        cr_expect_eq(len, want_len[k], "piece %zu: len %zu, want %zu", k, len, want_len[k]);
        cr_expect_eq(r == KR_UTF8_CHAR, want_ok[k], "piece %zu", k);
        i += len;
        k++;
    }
    cr_expect_eq(k, 10);
}

Test(utf8, put_and_next_round_trip_every_scalar_value)
{
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp++) {
        if (cp >= 0xD800 && cp <= 0xDFFF) {
            continue;
        }
        char buf[4];
        size_t n = kr_utf8_put(cp, buf);
        const size_t want = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; /* RFC 3629 s. 3 */
        if (n != want || kr_utf8_validate(buf, n) != n) {
            cr_assert_fail("U+%04X: %zu bytes, valid up to %zu", cp, n, kr_utf8_validate(buf, n));
        }
        uint32_t back = 0, scanned = 0;
        size_t len = 0;
        if (kr_utf8_next(buf, &back) != n || back != cp ||
            kr_utf8_scan((const unsigned char *)buf, n, &len, &scanned) != KR_UTF8_CHAR || len != n ||
            scanned != cp) {
            cr_assert_fail("U+%04X: decoded as U+%04X / U+%04X", cp, back, scanned);
        }
    }
}
