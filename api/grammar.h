#pragma once
/* Constrained decoding: grammars that a generated text must match, a matcher that follows the text
 * byte by byte, and token masks (which tokens of a vocabulary may come next).
 *
 * Front ends compile five kinds of constraint to one grammar form (docs/STRUCTURED_OUTPUTS.md):
 *   JSON Schema  the subset OpenAI's strict mode and vLLM use (response_format json_schema)
 *   json_object  any JSON object (response_format json_object)
 *   regex        the ERE/PCRE subset vLLM's guided_regex takes; the whole text must match
 *   choice       one of a list of strings (guided_choice)
 *   GBNF         llama.cpp's grammar text (guided_grammar)
 * Compile errors are KR_ERR_INVAL (KR_ERR_NOMEM when out of memory) with a message that names the
 * place: the JSON pointer and keyword of a schema, the line and column of a grammar, the offset of
 * a regex.
 *
 * Threads: a compiled grammar and a vocabulary are immutable and may be shared by any number of
 * threads (a grammar's mask cache fills lazily, lock-free). A matcher belongs to one thread at a
 * time. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kr_grammar;
struct kr_grammar_matcher;
struct kr_grammar_vocab;
struct kr_tokenizer;

/* ---- compiling --------------------------------------------------------------------------------- */

/* Options of the JSON front ends. */
struct kr_grammar_json_opts {
    /* Whitespace allowed in each gap of a JSON document (after `{` `[` `,` `:`, before `}` `]`,
     * around `:`): at most this many bytes of space, tab, LF and CR. 0 allows only the compact form.
     * Bounded so that a model cannot loop on whitespace; a negative value takes the default (24,
     * enough for pretty-printed JSON nested 10 deep with 2-space indents). */
    int32_t max_ws;
};

/* Compiles the JSON Schema `schema` (len bytes of JSON text, borrowed). Object properties come in
 * the schema's order; a schema without `additionalProperties` allows no other property when it
 * declares `properties` (OpenAI's strict mode) and any when it declares none. Keywords that would
 * change which documents are valid and that we do not compile are errors naming the keyword and
 * its JSON pointer; annotations (title, description, examples, default, $schema, $id, $comment,
 * ...) are ignored. opts may be NULL (defaults). On success *out is a new grammar the caller
 * frees with kr_grammar_free(). */
enum kr_status kr_grammar_from_json_schema(const char *schema, size_t len, const struct kr_grammar_json_opts *opts,
                                           struct kr_grammar **out, struct kr_err *err);

/* Any JSON object (OpenAI's response_format {"type": "json_object"}). */
enum kr_status kr_grammar_from_json_object(const struct kr_grammar_json_opts *opts, struct kr_grammar **out,
                                           struct kr_err *err);

/* Compiles a regular expression (len bytes of UTF-8, borrowed) that the whole text must match:
 * literals, escapes (\t \n \r \f \v \0 \xHH \x{H..} \uHHHH, escaped punctuation), classes with
 * ranges and negation, \d \w \s and their negations (ASCII meanings), `.` (any character but
 * \n \r U+2028 U+2029, as in ECMAScript), groups ((...), (?:...), (?<name>...)), alternation,
 * * + ? {m} {m,} {m,n} (lazy forms match the same texts), and ^ / $ only at the ends. Anything
 * else (backreferences, lookaround, \b, \p{..}, flags) is an error naming it and its offset. */
enum kr_status kr_grammar_from_regex(const char *re, size_t len, struct kr_grammar **out, struct kr_err *err);

/* One of n strings (each lens[i] bytes of UTF-8; both arrays borrowed). n must be at least 1. */
enum kr_status kr_grammar_from_choice(const char *const *choices, const size_t *lens, size_t n,
                                      struct kr_grammar **out, struct kr_err *err);

/* Compiles GBNF text (llama.cpp's form; len bytes, borrowed): `name ::= body` rules, "literals",
 * [classes] (ranges, ^ negation, escapes), `.`, rule references, ( ) groups, | * + ? {m} {m,} {m,n}
 * and # comments. A rule's body may continue on following lines until the next `name ::=`. The
 * text must match the rule named `root` (or `start_rule` when not NULL). Undefined rules, rules
 * defined twice, left recursion and syntax errors name their line and column. */
enum kr_status kr_grammar_from_gbnf(const char *text, size_t len, const char *start_rule, struct kr_grammar **out,
                                    struct kr_err *err);

/* Tool calls in a model's own format (api/tools.h writes the specification), compiled from len
 * bytes of JSON text (borrowed):
 *   {"format": {"begin": B, "sep": S, "end": E, "prefix": P, "mid": M, "suffix": X, "dsml": bool,
 *               "xml": bool},
 *    "tools": [{"name": N, "parameters": schema or absent}, ...], "max_calls": K}
 * The text is B CALL (S CALL)* E with at most K calls (K 0: no limit), each CALL one of the tools:
 * P N M ARGS X. ARGS is a JSON document matching the tool's parameters (any object when it has
 * none), or with dsml DeepSeek-V3.2's parameter elements, one per declared property in schema
 * order (required ones present), each
 *   <｜DSML｜parameter name="K" string="true">raw text</｜DSML｜parameter>\n      (a plain string)
 *   <｜DSML｜parameter name="K" string="false">JSON value</｜DSML｜parameter>\n   (anything else)
 * or with xml qwen3_coder's parameter elements, likewise one per declared property, each
 *   <parameter=K>\nVALUE\n</parameter>\n
 * where VALUE, for a schema that allows a string (or says nothing of its type: the parser's rule,
 * kr_tool_parse in api/tools.h), is one of its enum's (or const's) strings when it has some, else
 * any text in which "</parameter>" does not occur (other string keywords are not enforced on the
 * raw text); for any other schema a JSON value matching it.
 * A schema that does not compile is an error whose message starts with
 * "tools[I].function.parameters: ". */
enum kr_status kr_grammar_from_tools(const char *spec, size_t len, const struct kr_grammar_json_opts *opts,
                                     struct kr_grammar **out, struct kr_err *err);

/* Drops a reference to a grammar (a compiled grammar starts with one), freeing it with the last;
 * NULL is a no-op. Matchers of the grammar must be gone before the last reference. */
void kr_grammar_free(struct kr_grammar *g);

/* Takes one more reference (any thread); returns g. */
struct kr_grammar *kr_grammar_retain(struct kr_grammar *g);

/* Writes the compiled grammar as GBNF text (one rule per line, helper rules named after the rule
 * they come from); *text is a new NUL-terminated string the caller frees with kr_free(). For
 * debugging and documentation. Returns KR_OK or KR_ERR_NOMEM. */
enum kr_status kr_grammar_to_gbnf(const struct kr_grammar *g, char **text, size_t *len);

/* ---- a cache of compiled grammars --------------------------------------------------------------
 * Requests that repeat a constraint (the same schema, tool set or regex) share one compiled
 * grammar, and with it the mask cache that grammar fills (the first masks at each position cost a
 * pass over the token trie; later ones cost microseconds). Keyed by the kind, the exact text and
 * the options; least recently used grammars leave first. Thread-safe. */
enum kr_grammar_kind {
    KR_GRAMMAR_JSON_SCHEMA, /* text: the schema */
    KR_GRAMMAR_JSON_OBJECT, /* text: ignored */
    KR_GRAMMAR_REGEX,       /* text: the regex */
    KR_GRAMMAR_GBNF,        /* text: the grammar (start rule "root") */
    KR_GRAMMAR_CHOICE,      /* text: a JSON array of strings */
    KR_GRAMMAR_TOOLS,       /* text: a tool-call specification (kr_grammar_from_tools) */
};

struct kr_grammar_cache;

/* A cache that keeps at most max_grammars grammars (at least 1). Returns KR_OK or KR_ERR_NOMEM. */
enum kr_status kr_grammar_cache_create(int32_t max_grammars, struct kr_grammar_cache **out);

/* Drops the cache's references (grammars still held by callers live on); NULL is a no-op. */
void kr_grammar_cache_destroy(struct kr_grammar_cache *c);

/* The grammar for (kind, text[0..len), opts), compiled on a miss (compile errors are not cached
 * and come back as from the kr_grammar_from_* function). On success *out is a reference the
 * caller drops with kr_grammar_free(). *hit (may be NULL) tells whether it was cached. */
enum kr_status kr_grammar_cache_get(struct kr_grammar_cache *c, enum kr_grammar_kind kind, const char *text,
                                    size_t len, const struct kr_grammar_json_opts *opts, struct kr_grammar **out,
                                    bool *hit, struct kr_err *err);

/* Compiles (kind, text, opts) without a cache: the kr_grammar_from_* function of that kind. */
enum kr_status kr_grammar_compile(enum kr_grammar_kind kind, const char *text, size_t len,
                                  const struct kr_grammar_json_opts *opts, struct kr_grammar **out, struct kr_err *err);

/* ---- matching ---------------------------------------------------------------------------------- */

/* Limits of a matcher. The matcher follows every parse of the text so far at once (a set of
 * parse stacks); ambiguous grammars can make that set grow exponentially and recursive ones the
 * stacks deep, so both are bounded, and exceeding either is an error (KR_ERR_INVAL) rather than
 * a slow step or unbounded memory. */
#define KR_GRAMMAR_MAX_STACKS 4096  /* parse stacks alive after one byte */
#define KR_GRAMMAR_MAX_DEPTH 2048   /* frames in one stack (nesting of rules) */
#define KR_GRAMMAR_MAX_NODES 4000000 /* stack frames held by one matcher (about 110 MB with their index) */
#define KR_GRAMMAR_MAX_HISTORY 32   /* accepted steps that kr_grammar_matcher_rollback() can undo */

/* Creates a matcher at the start of grammar g (borrowed: it must outlive the matcher). Errors:
 * KR_ERR_NOMEM, KR_ERR_INVAL (a limit). Free with kr_grammar_matcher_destroy(). */
enum kr_status kr_grammar_matcher_create(const struct kr_grammar *g, struct kr_grammar_matcher **out,
                                         struct kr_err *err);

/* Frees a matcher; NULL is a no-op. */
void kr_grammar_matcher_destroy(struct kr_grammar_matcher *m);

/* A copy of m in its current state (history included) that then evolves on its own. */
enum kr_status kr_grammar_matcher_clone(const struct kr_grammar_matcher *m, struct kr_grammar_matcher **out,
                                        struct kr_err *err);

/* Advances by n bytes, all or nothing: *accepted tells whether the grammar allows them; when it
 * does not, the matcher is unchanged. One successful call is one step of history (see rollback).
 * Errors (matcher unchanged): KR_ERR_INVAL when a limit is exceeded, KR_ERR_NOMEM. */
enum kr_status kr_grammar_matcher_accept_bytes(struct kr_grammar_matcher *m, const void *bytes, size_t n,
                                               bool *accepted, struct kr_err *err);

/* Sets bit b of set[b / 32] for every byte b the grammar allows next (exact: each allowed byte can
 * be accepted). */
void kr_grammar_matcher_next_bytes(const struct kr_grammar_matcher *m, uint32_t set[8]);

/* Whether the text so far is a complete match (the generation may end here). */
bool kr_grammar_matcher_can_end(const struct kr_grammar_matcher *m);

/* Whether nothing may follow: the text is complete and no byte can extend it (or an end token was
 * accepted). A decoder stops here. */
bool kr_grammar_matcher_is_done(const struct kr_grammar_matcher *m);

/* The fewest bytes that complete the text so far (0 when it can end), or INT64_MAX when no
 * completion exists. Lets a caller steer towards a complete document when its budget runs out. */
int64_t kr_grammar_matcher_min_remaining(const struct kr_grammar_matcher *m);

/* Undoes the last n successful steps (accept_bytes / accept_token calls). Returns KR_ERR_INVAL,
 * matcher unchanged, when fewer than n are remembered (at most KR_GRAMMAR_MAX_HISTORY), or
 * KR_ERR_NOMEM, matcher unchanged. */
enum kr_status kr_grammar_matcher_rollback(struct kr_grammar_matcher *m, int32_t n);

/* Back to the start of the grammar, history cleared. */
enum kr_status kr_grammar_matcher_reset(struct kr_grammar_matcher *m, struct kr_err *err);

/* ---- token masks ------------------------------------------------------------------------------- */

/* A vocabulary prepared for masks: the raw bytes of every token (kr_tokenizer_token_bytes) in a
 * trie. Special tokens and tokens without bytes never match a grammar. The end ids (EOS and the
 * model's other end-of-turn tokens; n_end may be 0; borrowed) are allowed exactly when the text so
 * far is a complete match. When the tokenizer's decoder drops the first space of a text
 * (SentencePiece), a leading space of the first token is not part of the text the grammar sees,
 * as it is not part of what the client receives. Built once per tokenizer; immutable. Errors:
 * KR_ERR_NOMEM, KR_ERR_INVAL (an end id outside the vocabulary). */
enum kr_status kr_grammar_vocab_create(const struct kr_tokenizer *tok, const int32_t *end_ids, int32_t n_end,
                                       struct kr_grammar_vocab **out, struct kr_err *err);

/* Same from explicit token byte strings: token i is lens[i] bytes at bytes[i] (lens[i] == 0: a
 * token that never matches). For tests and for callers without a kr_tokenizer. All borrowed. */
enum kr_status kr_grammar_vocab_create_raw(int32_t n_vocab, const char *const *bytes, const size_t *lens,
                                           const int32_t *end_ids, int32_t n_end, struct kr_grammar_vocab **out,
                                           struct kr_err *err);

/* Frees a vocabulary; NULL is a no-op. */
void kr_grammar_vocab_destroy(struct kr_grammar_vocab *v);

/* Number of token ids, and the words of a mask: (n_vocab + 31) / 32. */
int32_t kr_grammar_vocab_n_vocab(const struct kr_grammar_vocab *v);
int32_t kr_grammar_vocab_mask_words(const struct kr_grammar_vocab *v);

/* The bytes of token id (borrowed; *len 0 for special tokens and ids without bytes). */
const char *kr_grammar_vocab_token_bytes(const struct kr_grammar_vocab *v, int32_t id, size_t *len);

/* Fills mask[0 .. kr_grammar_vocab_mask_words(v)) with one bit per token id (bit id % 32 of word
 * id / 32): set when the matcher accepts all of the token's bytes from its current state, and for
 * the end ids when the text can end here. The matcher's state does not change. Cost on a 129K
 * vocabulary (docs/STRUCTURED_OUTPUTS.md): about 10 us once the grammar's cache holds the
 * positions involved, about 3 ms for each position met for the first time. Errors: KR_ERR_INVAL
 * (a limit reached while trying tokens), KR_ERR_NOMEM. */
enum kr_status kr_grammar_matcher_fill_mask(struct kr_grammar_matcher *m, const struct kr_grammar_vocab *v,
                                            uint32_t *mask, struct kr_err *err);

/* Whether this matcher's masks use the grammar's adaptive cache (on by default): per grammar
 * position, the tokens accepted whatever lies below that stack frame, computed once per grammar
 * and vocabulary (the first mask at a position pays one pass over the trie) and shared by all
 * matchers and threads. Off, every mask is one pass over the trie. For tests and benchmarks. */
void kr_grammar_matcher_use_cache(struct kr_grammar_matcher *m, bool on);

/* Advances by one token: its bytes, or for an end id the end of the text (then is_done becomes
 * true). *accepted as for accept_bytes; one step of history. */
enum kr_status kr_grammar_matcher_accept_token(struct kr_grammar_matcher *m, const struct kr_grammar_vocab *v,
                                               int32_t id, bool *accepted, struct kr_err *err);

#ifdef __cplusplus
}
#endif
