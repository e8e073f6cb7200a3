#pragma once
/* Stop strings over a choice's growing text, as the OpenAI API means them: the text ends before the
 * first occurrence of any stop string, which is not returned; while streaming, a tail that could
 * still become the start of a stop string is held back. Pure functions on byte buffers (no
 * sockets, no engine), so they are tested on their own. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct kr_stops {
    const char *const *s; /* [n] the request's stop strings (borrowed), in the request's order */
    int32_t n;
    size_t max_len;       /* the longest one's length in bytes */
};

void kr_stops_init(struct kr_stops *st, const char *const *strs, int32_t n);

/* After bytes [from, len) were appended to text: the stop string whose occurrence ending after
 * `from` starts earliest (ties: the first in the request's order), so that matches across appends
 * are found, none is found twice, and the text cut there holds no stop string. Returns its index
 * and sets *at to where that occurrence starts; -1 when there is none. Empty stop strings never
 * match. */
int32_t kr_stops_find(const struct kr_stops *st, const char *text, size_t len, size_t from, size_t *at);

/* Bytes of text[0..len) that may be streamed now: all of them once the choice is final, else all
 * but the last max_len - 1 (they could still start a stop string), cut back to a UTF-8 character
 * boundary, and never fewer than `sent` (what already went out). */
size_t kr_stops_sendable(const struct kr_stops *st, const char *text, size_t len, size_t sent, bool final);

#ifdef __cplusplus
}
#endif
