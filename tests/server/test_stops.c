/* Stop strings without a socket: kr_stops_find and kr_stops_sendable against hand-checked cases
 * and against a naive reference (strstr over the whole text after every append) on random
 * streams: what is streamed is always a prefix of the final text, never a byte of a stop string,
 * never half a UTF-8 character, and the final text is the text before the first stop string. */
#include "stops.h"

#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

Test(stops, finds_the_earliest_stop_in_the_text)
{
    const char *s[] = {"o", "lo w", "l"};
    struct kr_stops st;
    kr_stops_init(&st, s, 3);
    cr_expect_eq(st.max_len, 4);
    size_t at = 99;
    /* "l" (index 2) starts at 2, before "lo w" (3) and "o" (4): the cut text "he" holds none */
    cr_expect_eq(kr_stops_find(&st, "hello world", 11, 0, &at), 2);
    cr_expect_eq(at, 2);
    const char *t[] = {"ll", "l"};
    kr_stops_init(&st, t, 2);
    /* a tie at the same start: the request's first */
    cr_expect_eq(kr_stops_find(&st, "hello", 5, 0, &at), 0);
    cr_expect_eq(at, 2);
    cr_expect_eq(kr_stops_find(&st, "hexxo", 5, 0, &at), -1);
}

Test(stops, matches_across_appends_and_not_before_from)
{
    const char *s[] = {"END"};
    struct kr_stops st;
    kr_stops_init(&st, s, 1);
    size_t at = 0;
    /* "EN" came in one append, "D" in the next: found with from = 5 */
    cr_expect_eq(kr_stops_find(&st, "abcENDx", 6, 5, &at), 0);
    cr_expect_eq(at, 3);
    /* an occurrence ending at or before `from` was already seen (and would have ended the text) */
    cr_expect_eq(kr_stops_find(&st, "ENDabc", 6, 4, &at), -1);
}

Test(stops, empty_and_long_stop_strings)
{
    const char *s[] = {"", "abcdef"};
    struct kr_stops st;
    kr_stops_init(&st, s, 2);
    size_t at = 0;
    cr_expect_eq(kr_stops_find(&st, "abc", 3, 0, &at), -1, "an empty stop string never matches");
    cr_expect_eq(kr_stops_find(&st, "xxabcdef", 8, 0, &at), 1);
    cr_expect_eq(at, 2);
}

Test(stops, holds_back_a_possible_start_and_whole_characters)
{
    const char *s[] = {"STOP"};
    struct kr_stops st;
    kr_stops_init(&st, s, 1);
    /* 3 bytes could still start "STOP" */
    cr_expect_eq(kr_stops_sendable(&st, "abcdefg", 7, 0, false), 4);
    cr_expect_eq(kr_stops_sendable(&st, "abcdefg", 7, 0, true), 7);
    cr_expect_eq(kr_stops_sendable(&st, "ab", 2, 0, false), 0);
    cr_expect_eq(kr_stops_sendable(&st, "abcdefg", 7, 5, false), 5, "never less than what was sent");
    /* "a" then U+00E9 (2 bytes) then "bcd": 4 of 6 bytes would end inside the character */
    const char *t = "a\xc3\xa9" "bcd";
    cr_expect_eq(kr_stops_sendable(&st, t, 6, 0, false), 3);
    /* "\xe2\x82\xac" (U+20AC, 3 bytes) then "xyz": the cut at 3 falls on a continuation byte */
    const char *u = "\xe2\x82\xac" "xyz";
    cr_expect_eq(kr_stops_sendable(&st, u, 6, 0, false), 3);
    const char *v = "\xe2\x82\xac" "xy";
    cr_expect_eq(kr_stops_sendable(&st, v, 5, 0, false), 0);
    /* no stop strings, or one of one byte: nothing to hold back */
    struct kr_stops none;
    kr_stops_init(&none, NULL, 0);
    cr_expect_eq(kr_stops_sendable(&none, "abc", 3, 0, false), 3);
    const char *one[] = {"x"};
    kr_stops_init(&st, one, 1);
    cr_expect_eq(kr_stops_sendable(&st, "abc", 3, 0, false), 3);
}

static uint64_t rng_next(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* The reference: the stop string that occurs earliest anywhere in the text (ties: request order). */
static int naive_find(const char *const *s, int n, const char *text, size_t *at)
{
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (!s[i][0]) {
            continue;
        }
        const char *p = strstr(text, s[i]);
        if (p && (best < 0 || (size_t)(p - text) < *at)) {
            *at = (size_t)(p - text);
            best = i;
        }
    }
    return best;
}

Test(stops, random_streams_agree_with_the_naive_reference)
{
    /* a small alphabet (with a 2-byte character) so that stops occur and nearly occur */
    static const char *const pieces[] = {"a", "b", "ab", "ba", "\xc3\xa9", "a\xc3\xa9", "bb", ""};
    uint64_t x = 0x243f6a8885a308d3ull;
    for (int run = 0; run < 3000; run++) {
        char stops_buf[3][8];
        const char *stops[3];
        const int n_stop = 1 + (int)(rng_next(&x) % 3);
        for (int i = 0; i < n_stop; i++) {
            const int l = (int)(rng_next(&x) % 4); /* 0..3 pieces */
            stops_buf[i][0] = 0;
            for (int k = 0; k < l; k++) {
                strcat(stops_buf[i], (const char *[]){"a", "b", "\xc3\xa9"}[rng_next(&x) % 3]);
                if (strlen(stops_buf[i]) > 4) {
                    break;
                }
            }
            stops[i] = stops_buf[i];
        }
        struct kr_stops st;
        kr_stops_init(&st, stops, n_stop);
        char text[256] = "", sent[256] = "";
        size_t len = 0, n_sent = 0;
        bool stopped = false;
        int want = -1;
        size_t want_at = 0;
        for (int step = 0; step < 24 && !stopped; step++) {
            const char *p = pieces[rng_next(&x) % 8];
            const size_t from = len;
            memcpy(text + len, p, strlen(p) + 1);
            len += strlen(p);
            size_t at = 0;
            const int got = kr_stops_find(&st, text, len, from, &at);
            want = naive_find(stops, n_stop, text, &want_at);
            cr_assert_eq(got, want, "run %d: stops found %d, the reference %d in '%s'", run, got, want, text);
            if (got >= 0) {
                cr_assert_eq(at, want_at, "run %d: at %zu, the reference %zu", run, at, want_at);
                len = at;
                text[len] = 0;
                stopped = true;
            }
            const size_t upto = kr_stops_sendable(&st, text, len, n_sent, stopped);
            cr_assert_geq(upto, n_sent);
            cr_assert_leq(upto, len, "run %d: sendable past the text", run);
            memcpy(sent + n_sent, text + n_sent, upto - n_sent);
            n_sent = upto;
            sent[n_sent] = 0;
            cr_assert(n_sent == len || n_sent == 0 || ((unsigned char)text[n_sent] & 0xc0) != 0x80,
                      "run %d: streamed half a character", run);
        }
        const size_t upto = kr_stops_sendable(&st, text, len, n_sent, true);
        memcpy(sent + n_sent, text + n_sent, upto - n_sent);
        n_sent = upto;
        sent[n_sent] = 0;
        cr_assert_str_eq(sent, text, "run %d: what was streamed is not the final text", run);
        size_t at = 0;
        cr_assert_eq(naive_find(stops, n_stop, sent, &at), -1, "run %d: the streamed text holds a stop string", run);
    }
}
