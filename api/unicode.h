#pragma once
/* UTF-8 and Unicode helpers shared by the tokenizer and the chat-template interpreter (internal to
 * api/). Character properties come from utf8proc; only the small, fixed sets that no library
 * exposes (Python's str.isspace, Unicode White_Space) are spelled out here. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"
#include "utf8.h" /* kr_utf8_scan, kr_utf8_validate, kr_utf8_next, kr_utf8_put */

#ifdef __cplusplus
extern "C" {
#endif

/* Unicode White_Space (Rust's char::is_whitespace, the regex crate's and Oniguruma's \s). */
bool kr_uni_is_white_space(uint32_t cp);
/* Python's str.isspace() for one character (used by str.strip() and friends). */
bool kr_uni_is_py_space(uint32_t cp);
/* General category helpers (utf8proc). */
bool kr_uni_is_alnum(uint32_t cp);       /* Rust char::is_alphanumeric: Alphabetic or N* (approx. L*, Nl, N*) */
bool kr_uni_is_numeric(uint32_t cp);     /* Rust char::is_numeric: Nd, Nl, No */
bool kr_uni_is_punctuation(uint32_t cp); /* P* categories or ASCII punctuation */
bool kr_uni_is_mark(uint32_t cp);         /* M* (Mn, Mc, Me): what HF StripAccents removes */
bool kr_uni_is_word(uint32_t cp);        /* the regex crate's \w: L, M, Nd, Pc, plus Join_Control */
bool kr_uni_is_printable(uint32_t cp);   /* Python's str.isprintable() for one character */
uint32_t kr_uni_tolower(uint32_t cp);
uint32_t kr_uni_toupper(uint32_t cp);
uint32_t kr_uni_totitle(uint32_t cp);

/* A growable byte buffer (kr_malloc-backed). A failed growth is remembered (SQLite's StrAccum
 * accError): every later append fails too, so that a buffer built by many appends is checked once,
 * through `oom`, and never holds a text with a piece missing. kr_bs_free resets it. */
struct kr_buf_s {
    char *p;    /* [cap] bytes; p[len] == '\0' whenever p != NULL */
    size_t len; /* bytes used */
    size_t cap; /* bytes allocated */
    bool oom;   /* an append failed: the contents are incomplete */
    size_t limit; /* 0, or the most bytes it may hold: an append past it fails as a failed growth
                     does, and sets over (kr_bs_free keeps the limit) */
    bool over;    /* an append failed for the limit */
};
enum kr_status kr_bs_reserve(struct kr_buf_s *b, size_t extra);
enum kr_status kr_bs_append(struct kr_buf_s *b, const void *data, size_t n);
enum kr_status kr_bs_putc(struct kr_buf_s *b, char c);
enum kr_status kr_bs_put_cp(struct kr_buf_s *b, uint32_t cp);
enum kr_status kr_bs_printf(struct kr_buf_s *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kr_bs_free(struct kr_buf_s *b);

/* Appends s[0..n) to b with each invalid sequence replaced by U+FFFD, exactly as Rust's
 * String::from_utf8_lossy does (one U+FFFD per maximal subpart, a truncated tail included). */
enum kr_status kr_bs_append_lossy(struct kr_buf_s *b, const char *s, size_t n);

/* Unicode normalization of valid UTF-8 s[0..n) into *out (NFC, NFD, NFKC or NFKD), appended. */
enum kr_uni_nf { KR_NF_C, KR_NF_D, KR_NF_KC, KR_NF_KD };
enum kr_status kr_uni_normalize(enum kr_uni_nf form, const char *s, size_t n, struct kr_buf_s *out);

#ifdef __cplusplus
}
#endif
