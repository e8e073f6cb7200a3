#pragma once
/* Tokenizer: HF `tokenizer.json` files (BPE models) turned into token ids and back, exactly as the
 * HF tokenizers library (Rust core, 0.22) does.
 *
 * Supported (anything else is a load error naming the unsupported type):
 *   model          BPE (vocab, merges as "a b" strings or [a, b] pairs, unk_token, fuse_unk,
 *                  byte_fallback, continuing_subword_prefix, end_of_word_suffix, ignore_merges;
 *                  dropout must be null or 0)
 *   normalizer     NFC, NFD, NFKC, NFKD, Lowercase, Strip, StripAccents, Prepend, Append, Replace
 *                  (String or Regex pattern), ByteLevel, Sequence
 *   pre_tokenizer  ByteLevel, Split (String or Regex pattern, all five behaviors, invert), Digits,
 *                  Metaspace (prepend_scheme always/first/never, split), Whitespace,
 *                  WhitespaceSplit, Punctuation, BertPreTokenizer, CharDelimiterSplit, Sequence
 *   post_processor TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing, Sequence
 *   decoder        ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, BPEDecoder, Sequence
 *   added_tokens   matched before pre-tokenization (leftmost-longest), honouring lstrip, rstrip,
 *                  single_word and normalized; `special` drives skip_special_tokens.
 * Regexes run on PCRE2 (UTF, Unicode properties, JIT). HF runs them on Oniguruma; \s, \S, \w, \W
 * and \h are rewritten to Oniguruma's Unicode meaning so that both engines split alike.
 * `truncation` and `padding` sections are ignored (an LLM server never pads a prompt).
 *
 * BOS/EOS follow transformers (v5 TokenizersBackend): when tokenizer_config.json sets
 * `add_bos_token` or `add_eos_token`, the post-processor becomes the template
 * "[bos] $A [eos]" built from its `bos_token` / `eos_token`; otherwise tokenizer.json's
 * post-processor is used as is.
 *
 * Input text must be valid UTF-8: anything else is KR_ERR_INVAL naming the byte offset (HF cannot
 * receive such input at all: its bindings take Unicode strings).
 *
 * A loaded tokenizer is immutable: every function taking a const tokenizer may be called from
 * any number of threads at once. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kr_tokenizer;

/* Loads a tokenizer. `path` is a directory holding tokenizer.json (and, when present,
 * tokenizer_config.json), or the path of a tokenizer.json file, in which case a
 * tokenizer_config.json beside it is read when it exists. `config_path`, when not NULL, names the
 * tokenizer_config.json to use instead (it must exist). On success *out is a new tokenizer the
 * caller frees with kr_tokenizer_free(). Errors: KR_ERR_IO (file), KR_ERR_FORMAT (malformed JSON
 * or a missing/ill-typed field), KR_ERR_UNSUPPORTED (a model, normalizer, pre-tokenizer,
 * post-processor or decoder type we do not implement), KR_ERR_NOMEM; err names the file, the key
 * and what was wrong. */
enum kr_status kr_tokenizer_load(const char *path, const char *config_path, struct kr_tokenizer **out,
                                 struct kr_err *err);

/* Same as kr_tokenizer_load() from memory: `json` (len bytes) is the tokenizer.json text and
 * `config_json` (config_len bytes, may be NULL) the tokenizer_config.json text. Both are borrowed. */
enum kr_status kr_tokenizer_load_mem(const char *json, size_t len, const char *config_json, size_t config_len,
                                     struct kr_tokenizer **out, struct kr_err *err);

/* Frees a tokenizer; NULL is a no-op. */
void kr_tokenizer_free(struct kr_tokenizer *tok);

/* Encodes `len` bytes of UTF-8 `text` (need not be NUL-terminated). With add_special_tokens the
 * post-processor adds its tokens (BOS, ...). On success *ids is a new array of *n_ids ids that the
 * caller frees with kr_free() (it may be NULL when *n_ids is 0). Errors: KR_ERR_INVAL (invalid
 * UTF-8, with the byte offset in err; a regex that exceeded its match limit), KR_ERR_NOMEM. */
enum kr_status kr_tokenizer_encode(const struct kr_tokenizer *tok, const char *text, size_t len,
                                   bool add_special_tokens, int32_t **ids, int64_t *n_ids, struct kr_err *err);

/* Decodes ids into text as HF's Tokenizer::decode does: ids that name no token are skipped, and
 * with skip_special_tokens so are special tokens; byte sequences that are not valid UTF-8 become
 * U+FFFD. On success *text is a new NUL-terminated string of *len bytes that the caller frees with
 * kr_free(). Errors: KR_ERR_NOMEM. */
enum kr_status kr_tokenizer_decode(const struct kr_tokenizer *tok, const int32_t *ids, int64_t n_ids,
                                   bool skip_special_tokens, char **text, size_t *len, struct kr_err *err);

/* The most bytes of input text one token can stand for, or 0 when that is unbounded (a normalizer
 * or pre-tokenizer that may drop text, an added token that takes the whitespace around it, fused
 * unknown tokens). A text of len bytes then encodes to at least len / that many tokens, which lets a
 * caller refuse a text too long for a context before tokenizing it. */
size_t kr_tokenizer_max_bytes_per_token(const struct kr_tokenizer *tok);

/* Number of ids: one more than the largest id of the model vocabulary or the added tokens. */
int32_t kr_tokenizer_n_vocab(const struct kr_tokenizer *tok);

/* The token string of `id` as stored in tokenizer.json (byte-level pieces are not decoded), or
 * NULL when no token has that id. *len (may be NULL) receives its length. Borrowed: valid while
 * the tokenizer lives. */
const char *kr_tokenizer_id_to_piece(const struct kr_tokenizer *tok, int32_t id, size_t *len);

/* The raw bytes that token `id` contributes to generated text, for constrained decoding: the
 * decoder's per-token steps applied to the token alone (byte-level pieces map through the GPT-2
 * byte alphabet, Metaspace and Replace turn U+2581 into a space, ByteFallback's <0xXX> is that
 * byte even when it is not valid UTF-8 alone), without the steps that depend on the token's place
 * in a text (Strip, Metaspace's dropped first space). On success *bytes is a new array of *len
 * bytes that the caller frees with kr_free(); special tokens and ids that name no token give
 * NULL and 0. Errors: KR_ERR_NOMEM, KR_ERR_INVAL (a decoder regex that exceeded its match limit). */
enum kr_status kr_tokenizer_token_bytes(const struct kr_tokenizer *tok, int32_t id, char **bytes, size_t *len,
                                        struct kr_err *err);

/* The id of the token string piece[0..len) (added tokens first, then the model vocabulary), or
 * -1 when there is none. */
int32_t kr_tokenizer_piece_to_id(const struct kr_tokenizer *tok, const char *piece, size_t len);

/* Whether `id` is a special token (skipped by skip_special_tokens). */
bool kr_tokenizer_is_special(const struct kr_tokenizer *tok, int32_t id);

/* BOS / EOS ids from tokenizer_config.json's bos_token / eos_token, or -1 when unset. */
int32_t kr_tokenizer_bos_id(const struct kr_tokenizer *tok);
int32_t kr_tokenizer_eos_id(const struct kr_tokenizer *tok);

/* BOS / EOS token strings from tokenizer_config.json (what chat templates receive as bos_token and
 * eos_token), or NULL when unset. Borrowed. */
const char *kr_tokenizer_bos_token(const struct kr_tokenizer *tok);
const char *kr_tokenizer_eos_token(const struct kr_tokenizer *tok);

/* The `chat_template` of tokenizer_config.json (for a list of named templates, the one named
 * "default"), or NULL. Borrowed. */
const char *kr_tokenizer_chat_template(const struct kr_tokenizer *tok);

/* ---- incremental detokenization ---------------------------------------------------------------
 * A detokenizer turns a stream of ids into text pieces as they arrive. Pieces never split a UTF-8
 * character, and their concatenation (pushes, then the flush) is exactly
 * kr_tokenizer_decode(all ids). It follows HF's DecodeStream: it decodes a short window of ids and
 * emits the new text once it no longer ends in an incomplete character; ids the full decode drops
 * (ids that name no token, special tokens when skipping them) are ignored. One detokenizer belongs
 * to one stream and one thread at a time. */
struct kr_detok;

/* Creates a detokenizer for `tok` (borrowed: it must outlive the detokenizer). Returns KR_OK or
 * KR_ERR_NOMEM. Free with kr_detok_destroy(). */
enum kr_status kr_detok_create(const struct kr_tokenizer *tok, bool skip_special_tokens, struct kr_detok **out);

/* Pushes one id. *piece / *len receive the text that became final (possibly empty); the piece is
 * owned by the detokenizer and valid until its next call. Returns KR_OK or KR_ERR_NOMEM. */
enum kr_status kr_detok_push(struct kr_detok *d, int32_t id, const char **piece, size_t *len, struct kr_err *err);

/* Ends the stream: *piece / *len receive whatever text was held back (an incomplete character
 * becomes U+FFFD, as in a full decode). The detokenizer is then empty and may start a new stream. */
enum kr_status kr_detok_flush(struct kr_detok *d, const char **piece, size_t *len, struct kr_err *err);

/* Frees a detokenizer; NULL is a no-op. */
void kr_detok_destroy(struct kr_detok *d);

#ifdef __cplusplus
}
#endif
