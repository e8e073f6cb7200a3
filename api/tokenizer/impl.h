#pragma once
/* The tokenizer's insides, shared by its six files: tables.c (the per-call arena, piece and match
 * lists, the string -> id and merge hash maps), regex.c (PCRE2 with Oniguruma's classes, pattern
 * and predicate matches, HF's split behaviors), normalize.c (normalizers and pre-tokenizers),
 * encode.c (added tokens, the BPE model, the post-processor and kr_tokenizer_encode), decode.c
 * (decoders, kr_tokenizer_decode and the incremental detokenizer) and load.c (tokenizer.json and
 * tokenizer_config.json, and the lookups). Only these files include it; tokenizer.h is the
 * interface. The functions they share are prefixed tok_. */
#include "tokenizer.h"

#include "unicode.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The pipeline follows HF tokenizers' TokenizerImpl::encode_single_sequence:
 *   1. added tokens with normalized=false are cut out of the raw text;
 *   2. every other piece is normalized, then added tokens with normalized=true are cut out;
 *   3. the pre-tokenizer splits (and transforms) the remaining pieces;
 *   4. the model (BPE) turns each piece into ids;
 *   5. the post-processor adds special tokens.
 * Pieces are (pointer, length) views; text that a step rewrites lives in a per-call arena. */

#define REGEX_MATCH_LIMIT 10000000u /* PCRE2 backtracking steps per match: bounds pathological patterns */

/* ---- small containers ------------------------------------------------------------------------ */

struct arena_chunk {
    struct arena_chunk *next;
    size_t used, cap;
    _Alignas(16) char data[];
};
struct arena {
    struct arena_chunk *head;
};

struct piece {
    const char *s; /* [len] UTF-8 */
    size_t len;
    int32_t id;    /* >= 0: an added token (final); -1: text to tokenize */
    bool first;    /* starts at offset 0 of the original input */
};
struct pieces {
    struct piece *v; /* [n] */
    size_t n, cap;
};

/* Match ranges of a pattern over one piece: [a, b) with is_match. */
struct range {
    size_t a, b;
    bool m;
};
struct ranges {
    struct range *v;
    size_t n, cap;
};

/* ---- string -> id map -------------------------------------------------------------------------- */

struct smap_slot {
    const char *key; /* borrowed; NULL = empty slot */
    uint32_t len;
    int32_t val;
};
struct smap {
    struct smap_slot *slots; /* [cap] */
    size_t cap, n;
};

/* ---- merge map: (left id, right id) -> (rank, merged id) ------------------------------------ */

struct mmap_slot {
    uint64_t key; /* (left << 32 | right) + 1; 0 = empty */
    int32_t rank;
    int32_t id;
};
struct mmap {
    struct mmap_slot *slots;
    size_t cap, n;
};

/* ---- component descriptions -------------------------------------------------------------------- */

/* A split/replace pattern: a literal string or a compiled regex. */
struct pattern {
    char *lit;       /* literal (when re == NULL) */
    size_t lit_len;
    pcre2_code *re;
};

enum norm_type {
    NORM_NFC, NORM_NFD, NORM_NFKC, NORM_NFKD, NORM_LOWERCASE, NORM_STRIP, NORM_STRIP_ACCENTS,
    NORM_PREPEND, NORM_APPEND, NORM_REPLACE, NORM_BYTE_LEVEL, NORM_SEQUENCE,
};
struct normalizer {
    enum norm_type type;
    char *str;              /* PREPEND / APPEND / REPLACE content */
    size_t str_len;
    struct pattern pat;     /* REPLACE */
    bool left, right;       /* STRIP */
    struct normalizer *sub; /* SEQUENCE: [n_sub] */
    size_t n_sub;
};

enum split_behavior { SPLIT_REMOVED, SPLIT_ISOLATED, SPLIT_MERGED_PREV, SPLIT_MERGED_NEXT, SPLIT_CONTIGUOUS };
enum pretok_type {
    PT_BYTE_LEVEL, PT_SPLIT, PT_DIGITS, PT_METASPACE, PT_WHITESPACE, PT_WHITESPACE_SPLIT, PT_PUNCTUATION,
    PT_BERT, PT_CHAR_DELIMITER, PT_SEQUENCE,
};
enum prepend_scheme { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER };
struct pretok {
    enum pretok_type type;
    struct pattern pat;           /* SPLIT; WHITESPACE and BYTE_LEVEL use the tokenizer's shared regexes */
    enum split_behavior behavior; /* SPLIT, PUNCTUATION */
    bool invert;                  /* SPLIT */
    bool add_prefix_space;        /* BYTE_LEVEL */
    bool use_regex;               /* BYTE_LEVEL */
    bool individual_digits;       /* DIGITS */
    uint32_t ch;                  /* METASPACE replacement, CHAR_DELIMITER delimiter */
    enum prepend_scheme prepend;  /* METASPACE */
    bool split;                   /* METASPACE */
    struct pretok *sub;           /* SEQUENCE: [n_sub] */
    size_t n_sub;
};

enum dec_type { DEC_BYTE_LEVEL, DEC_METASPACE, DEC_REPLACE, DEC_BYTE_FALLBACK, DEC_FUSE, DEC_STRIP, DEC_BPE, DEC_SEQUENCE };
struct decoder {
    enum dec_type type;
    uint32_t ch;                 /* METASPACE replacement, STRIP content */
    enum prepend_scheme prepend; /* METASPACE */
    struct pattern pat;          /* REPLACE */
    char *str;                   /* REPLACE content, BPE suffix */
    size_t str_len;
    size_t start, stop;          /* STRIP */
    struct decoder *sub;         /* SEQUENCE */
    size_t n_sub;
};

/* A post-processor reduced to what matters for ids: the templates around sequence A. */
struct post_item {
    bool is_seq;     /* $A */
    int32_t *ids;    /* [n_ids] special token ids (when !is_seq) */
    size_t n_ids;
};
struct postproc {
    bool is_template; /* false: no-op (ByteLevel) */
    struct post_item *items;
    size_t n_items;
    struct postproc *sub; /* Sequence: [n_sub] */
    size_t n_sub;
};

struct added_token {
    char *content;        /* as written in tokenizer.json */
    size_t len;
    char *match;          /* what is searched: content, or normalized content when `normalized` */
    size_t match_len;
    int32_t id;
    bool special, lstrip, rstrip, single_word, normalized;
};

/* Byte trie over added-token strings, for leftmost-longest matching. */
struct trie_node {
    int32_t first_child; /* index or -1 */
    int32_t next;        /* next sibling or -1 */
    int32_t token;       /* index into added[] ending here, or -1 */
    unsigned char byte;
};
struct trie {
    struct trie_node *nodes; /* [n]; node 0 is the root */
    size_t n, cap;
    bool first_byte[256];    /* bytes that start some token */
};

struct kr_tokenizer {
    /* model (BPE) */
    char *pool;                  /* all vocab strings, NUL-separated */
    struct smap vocab;           /* token string -> id */
    const char **id_str;         /* [n_ids] token string per id (model vocab or added token), NULL if none */
    uint32_t *id_len;            /* [n_ids] */
    bool *id_special;            /* [n_ids] the string is a special added token's content */
    int32_t n_ids;
    struct mmap merges;
    int32_t unk_id;              /* -1: none */
    char *cont_prefix, *eow_suffix;
    size_t cont_prefix_len, eow_suffix_len;
    bool fuse_unk, byte_fallback, ignore_merges;
    int32_t byte_ids[256];       /* <0xXX> ids for byte_fallback (-1: missing) */

    struct added_token *added;   /* [n_added] */
    size_t n_added;
    struct smap added_map;       /* content -> id */
    struct trie trie_raw, trie_norm;

    struct normalizer *norm;     /* may be NULL */
    struct pretok *pretok;       /* may be NULL */
    struct decoder *dec;         /* may be NULL */
    struct postproc *post;       /* may be NULL */

    pcre2_code *re_gpt2;         /* ByteLevel's built-in regex (compiled when used) */
    pcre2_code *re_whitespace;   /* Whitespace pre-tokenizer's regex (compiled when used) */
    pcre2_general_context *gctx;

    char bytes_char[256][3];     /* byte-level alphabet: UTF-8 of the char for each byte */
    uint8_t bytes_char_len[256];
    int16_t char_byte[0x144];    /* inverse for code points < 0x144, -1 elsewhere */

    /* the streaming detokenizer's view of the decoder (tok_stream_setup) */
    const struct decoder *stream_dec;   /* what it decodes with: dec, or &stream_dec_cut */
    struct decoder stream_dec_cut;      /* dec without its final Strip (a shallow copy, owning nothing) */
    const struct decoder *stream_strip; /* that Strip, applied to the streamed text as a whole, or NULL */
    const struct decoder *stream_tail;  /* steps after the fusing one that a window cannot run, run on the
                                           whole text stream_dec released so far; or NULL */
    struct decoder stream_tail_seq;     /* what stream_tail points at (a shallow copy, owning nothing) */
    bool stream_window;          /* stream_dec allows HF's windowed DecodeStream (see decoder_window_safe) */
    bool stream_byte_runs;       /* ByteFallback: a later <0xXX> token can still change a run's text */
    int32_t stream_hold_cp;      /* a Strip inside stream_dec removing its content at the end, or -1 */

    char *bos_token, *eos_token; /* from tokenizer_config.json */
    int32_t bos_id, eos_id;
    char *chat_template;
};

/* ---- per-call state ------------------------------------------------------------------------------ */

/* Per-call regex state. */
struct rx {
    pcre2_match_data *md;
    pcre2_match_context *mc;
    struct kr_err *err;
};

/* find_matches for a character predicate */
enum char_pred { PRED_NUMERIC, PRED_WHITESPACE, PRED_PUNCT, PRED_EQ };

/* an encode or decode call: its arena, regex state and scratch */
struct ctx {
    const struct kr_tokenizer *t;
    struct arena arena;
    struct rx rx;
    struct ranges ranges;
    struct kr_buf_s buf; /* scratch */
    struct kr_err *err;
};

/* ==== functions shared between the files ========================================================= */

/* ---- tables.c: small containers, the string -> id map, the merge map ------------------------- */

void *tok_arena_alloc(struct arena *a, size_t n);
void tok_arena_free(struct arena *a);
void tok_arena_reset(struct arena *a); /* empties it, keeping its newest chunk */
enum kr_status tok_pieces_push(struct pieces *p, const char *s, size_t len, int32_t id, bool first);
enum kr_status tok_ranges_push(struct ranges *r, size_t a, size_t b, bool m);
enum kr_status tok_smap_init(struct smap *m, size_t expect);
enum kr_status tok_smap_put(struct smap *m, const char *key, size_t len, int32_t val);
bool tok_smap_get(const struct smap *m, const char *key, size_t len, int32_t *val);
struct mmap_slot *tok_mmap_find(const struct mmap *m, uint64_t key);
bool tok_mmap_get(const struct mmap *m, int32_t a, int32_t b, int32_t *rank, int32_t *id);

/* ---- regex.c: PCRE2, Oniguruma patterns, matches, split behaviors ---------------------------- */

/* A call's regex state: match data and a context with REGEX_MATCH_LIMIT (KR_ERR_NOMEM; close it
 * either way). */
enum kr_status tok_rx_open(struct rx *x, const struct kr_tokenizer *t, struct kr_err *err);
void tok_rx_close(struct rx *x);
void *tok_pcre_malloc(size_t n, void *ud);
void tok_pcre_free(void *p, void *ud);
enum kr_status tok_compile_regex(struct kr_tokenizer *t, const char *src, size_t n, pcre2_code **out,
                                 const char *where, struct kr_err *err);
enum kr_status tok_find_matches_pattern(struct rx *x, const struct pattern *p, const char *s, size_t n,
                                        struct ranges *out);
enum kr_status tok_find_matches_pred(enum char_pred pred, uint32_t want, const char *s, size_t n,
                                     struct ranges *out);
enum kr_status tok_apply_behavior(const struct piece *pc, struct ranges *r, enum split_behavior bh, bool invert,
                                  struct pieces *out);

/* ---- normalize.c: normalizers and pre-tokenizers --------------------------------------------- */

enum kr_status tok_take_buf(struct ctx *c, const char **s, size_t *n);
enum kr_status tok_replace_all(struct ctx *c, const struct pattern *pat, const char *rep, size_t rep_len,
                               const char *s, size_t n, const char **out, size_t *out_len);
enum kr_status tok_normalize(struct ctx *c, const struct normalizer *nz, const char **s, size_t *n);
enum kr_status tok_pretok_apply(struct ctx *c, const struct pretok *pt, struct pieces *p);

/* ---- encode.c: added tokens, BPE, encode ----------------------------------------------------- */

enum kr_status tok_trie_insert(struct trie *tr, const char *s, size_t n, int32_t token);

/* ---- decode.c: decode, incremental detokenizer ----------------------------------------------- */

bool tok_decoder_window_safe(const struct decoder *d, bool *fused, int32_t *hold);
void tok_stream_setup(struct kr_tokenizer *t);
bool tok_decoder_has(const struct decoder *d, enum dec_type type);
