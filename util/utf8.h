#pragma once
/* UTF-8 as RFC 3629 defines it: overlong forms, surrogates (U+D800..U+DFFF), code points above
 * U+10FFFF and truncated sequences are invalid. The one validator of the project: the JSON reader
 * (util/json.c), the tokenizer, the chat-template interpreter and the OpenAI layer all use it. */
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Outcome of kr_utf8_scan(). */
enum kr_utf8_scan {
    KR_UTF8_CHAR = 1,      /* a valid character of *len bytes */
    KR_UTF8_INVALID = 0,   /* an invalid sequence: its maximal subpart is *len bytes (>= 1) */
    KR_UTF8_TRUNCATED = -1 /* the *len (= n) bytes left are a valid but incomplete prefix */
};

/* Classifies the bytes at s[0..n) (n >= 1) following the Unicode "maximal subpart" rules that
 * Rust's String::from_utf8_lossy and WHATWG decoders use. On KR_UTF8_CHAR *cp is the code point. */
enum kr_utf8_scan kr_utf8_scan(const unsigned char *s, size_t n, size_t *len, uint32_t *cp);

/* Returns the byte offset of the first invalid or truncated sequence in s[0..n), or n when the
 * whole buffer is valid UTF-8 (surrogates and code points above U+10FFFF are invalid). */
size_t kr_utf8_validate(const char *s, size_t n);

/* Decodes the character at s (which must be valid UTF-8 with at least one byte left); returns its
 * length and stores the code point. */
size_t kr_utf8_next(const char *s, uint32_t *cp);

/* Writes the UTF-8 encoding of cp (<= 0x10FFFF) to out and returns its length (1..4). */
size_t kr_utf8_put(uint32_t cp, char out[4]);

#ifdef __cplusplus
}
#endif
