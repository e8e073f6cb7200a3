#pragma once
/* The OpenAI-compatible API surface: request parsing and validation with field-precise errors,
 * and the response / SSE chunk encoders for /v1/completions, /v1/chat/completions, /v1/models,
 * /tokenize and /detokenize (vLLM shapes where OpenAI has none). jansson based; no I/O, no
 * engine calls: the server feeds it. */
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "grammar.h"
#include "sampler.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Why a request fails, as the client sees it. Each cause has one HTTP status, OpenAI error `type`
 * and `code` (- = null), and kr_oai_error holds the only table of them:
 *   cause                   status type                   code                     when
 *   KR_OAI_INVALID          400    invalid_request_error  -                        a bad field or body
 *   KR_OAI_TOO_LONG         400    invalid_request_error  context_length_exceeded  over max_model_len
 *   KR_OAI_UNAUTHORIZED     401    authentication_error   invalid_api_key          no or a wrong key
 *   KR_OAI_NOT_FOUND        404    not_found_error        -                        no such route
 *   KR_OAI_MODEL_NOT_FOUND  404    not_found_error        model_not_found          another model
 *   KR_OAI_METHOD           405    invalid_request_error  method_not_allowed       GET for POST...
 *   KR_OAI_TOO_LARGE        413    invalid_request_error  request_too_large        a body too big
 *   KR_OAI_QUEUE_FULL       429    rate_limit_error       queue_full               the queue is full
 *   KR_OAI_INTERNAL         500    server_error           -                        out of memory, ...
 *   KR_OAI_UNAVAILABLE      503    service_unavailable    -                        loading, draining */
enum kr_oai_cause {
    KR_OAI_INVALID = 0,
    KR_OAI_TOO_LONG,
    KR_OAI_UNAUTHORIZED,
    KR_OAI_NOT_FOUND,
    KR_OAI_MODEL_NOT_FOUND,
    KR_OAI_METHOD,
    KR_OAI_TOO_LARGE,
    KR_OAI_QUEUE_FULL,
    KR_OAI_INTERNAL,
    KR_OAI_UNAVAILABLE,
    KR_OAI_CAUSE_COUNT, /* not a cause: the number of them */
};

/* An OpenAI error object plus the HTTP status to answer with, as kr_oai_error fills it. */
struct kr_oai_error {
    int http_status;    /* from the cause: 400, 401, 404, 405, 413, 429, 500, 503 */
    char type[48];      /* from the cause: "invalid_request_error", "authentication_error", ... */
    char param[64];     /* the offending field ("max_tokens", "messages[2].content"), "" when none */
    char code[48];      /* from the cause: "context_length_exceeded", "model_not_found", ... "" when none */
    char message[1024];
};

/* The one place where an error's HTTP status, OpenAI type and code are chosen: fills `e` (may be
 * NULL: nothing is written) from `cause` (a KR_OAI_* below KR_OAI_CAUSE_COUNT; anything else is a
 * bug and aborts), with `param` naming the offending field ("" or NULL for none) and the message
 * formatted from `fmt` (truncated to the message buffer). Returns KR_ERR_INVAL whatever the cause,
 * so that parsers can `return kr_oai_error(...)`. Any thread. */
enum kr_status kr_oai_error(struct kr_oai_error *e, enum kr_oai_cause cause, const char *param,
                            const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* {"error": {"message", "type", "param", "code"}} with param/code null when empty. Caller frees
 * (free()). */
char *kr_oai_error_json(const struct kr_oai_error *e);

enum kr_oai_kind {
    KR_OAI_COMPLETIONS = 0,
    KR_OAI_CHAT = 1,
};

/* One prompt of a completions request: text (to tokenize) or token ids. */
struct kr_oai_prompt {
    char *text;         /* UTF-8, NUL-terminated; NULL when ids are given */
    size_t text_len;
    int32_t *ids;       /* [n_ids] when given as token ids */
    int32_t n_ids;
};

/* What a request constrains its output to (structured outputs): one of OpenAI's response_format
 * json_object / json_schema, vLLM's guided_json / guided_regex / guided_choice / guided_grammar, or
 * vLLM's structured_outputs object; at most one per request. The server compiles it (api/grammar.h,
 * through its grammar cache) while preparing the request. */
struct kr_oai_constraint {
    bool on;                   /* a constraint was asked for */
    enum kr_grammar_kind kind;
    char *text;                /* [len] owned, NUL-terminated: the schema (compact JSON), the regex, the GBNF
                                  or the choices (a JSON array of strings); NULL for json_object */
    size_t len;
    int32_t max_ws;            /* JSON whitespace per gap (kr_grammar_json_opts): -1 the default, 0 with
                                  structured_outputs.disable_any_whitespace */
    char param[64];            /* the field it came from ("response_format", "guided_json",
                                  "structured_outputs.regex"): compile errors name it */
};

/* tool_choice (OpenAI): what the model may do with `tools`. */
enum kr_oai_tool_choice {
    KR_OAI_TOOL_AUTO = 0, /* the model may call (the default when tools are given): its output is parsed */
    KR_OAI_TOOL_NONE,     /* no call: the output is text (the default without tools) */
    KR_OAI_TOOL_REQUIRED, /* one call or more, forced by constrained decoding */
    KR_OAI_TOOL_NAMED,    /* {"type": "function", "function": {"name": N}}: a call of N, forced */
};

struct kr_oai_request {
    enum kr_oai_kind kind;
    json_t *root;              /* owned: the parsed body */
    const char *model;         /* borrowed from root; NULL when absent */
    /* completions */
    int32_t n_prompts;
    struct kr_oai_prompt *prompts; /* [n_prompts] owned */
    bool echo;
    /* chat: borrowed from root */
    json_t *messages;          /* array of {role, content (string | array of {type: text, text}), tool_calls, ...} */
    json_t *tools;             /* array or NULL (validated: function names are OpenAI-valid) */
    enum kr_oai_tool_choice tool_choice;
    const char *tool_name;     /* KR_OAI_TOOL_NAMED: the function (borrowed from root) */
    bool parallel_tool_calls;  /* default true; false: at most one call */
    bool add_generation_prompt; /* default true */
    bool continue_final_message;
    json_t *chat_template_kwargs; /* object or NULL */
    /* common */
    struct kr_sampling sampling; /* temperature, top_p, top_k, min_p, penalties, seed, max_tokens, min_tokens,
                                    ignore_eos, stop_token_ids, logprobs (top count or -1), prompt_logprobs */
    bool max_tokens_given;     /* max_tokens or max_completion_tokens present */
    int32_t n;                 /* choices */
    bool stream;
    bool include_usage;        /* stream_options.include_usage */
    bool continuous_usage;     /* stream_options.continuous_usage_stats with include_usage (vLLM needs
                                  both): every delta chunk carries the usage so far */
    bool return_token_ids;     /* vLLM extension */
    bool skip_special_tokens;  /* default true */
    int32_t n_stop;
    char **stop;               /* [n_stop] stop strings, owned */
    const char *user;          /* borrowed */
    const char *cache_salt;    /* borrowed; NULL when absent: requests with different salts share no
                                  cached prefix (vLLM's field) */
    size_t cache_salt_len;
    struct kr_oai_constraint constraint; /* structured outputs (constraint.on false: none) */
};

/* Parses and validates a request body. Every problem is a 400 with `param` naming the field:
 * malformed JSON, wrong types, out-of-range values, unknown roles, empty prompts, two output
 * constraints at once (naming both), and a field of OpenAI's or vLLM's API that krait does not
 * implement set to ask for something (service_tier, reasoning_effort, audio, modalities other than
 * "text", use_beam_search, ...: see k_unimplemented in openai-parse.c). Other unknown fields are
 * ignored. Bounds: n in
 * [1, 128], logprobs (completions) in [0, 20], top_logprobs (chat) in [0, 20] and only with
 * logprobs true, max_tokens >= 1, at most 16 stop strings, at most 4096 guided_choice strings.
 * Whether a constraint compiles is the server's check (it owns the grammar cache). On success the
 * caller frees with kr_oai_request_free. */
enum kr_status kr_oai_parse(enum kr_oai_kind kind, const char *body, size_t len, struct kr_oai_request *out,
                            struct kr_oai_error *err);
void kr_oai_request_free(struct kr_oai_request *r);

/* ---- responses --------------------------------------------------------------------------------- */

/* One token as reported in logprobs: its text (or "token_id:N"), raw bytes and log-probability. */
struct kr_oai_token {
    const char *text;   /* decoded piece (may hold U+FFFD for partial UTF-8) */
    size_t text_len;
    const unsigned char *bytes; /* the token's raw bytes (chat "bytes" field) */
    size_t n_bytes;
    float logprob;
    int32_t id;         /* the token id (prompt_logprobs' keys) */
    int32_t rank;       /* 1 + the tokens likelier in its row (prompt_logprobs), 0 when not known */
};

/* Log-probability information of one sampled (or prompt) token with its alternatives. */
struct kr_oai_logprob {
    struct kr_oai_token tok;
    int32_t n_top;
    const struct kr_oai_token *top; /* [n_top] */
};

struct kr_oai_usage;
/* One tool call of a message, or a piece of one in a stream delta (id and name only in the first
 * delta of a call, NULL after). */
struct kr_oai_tool_call {
    int32_t index;
    const char *id;    /* "call_..." or NULL */
    const char *name;  /* or NULL */
    const char *args;  /* [args_len] JSON text (a fragment in a delta); NULL with 0 */
    size_t args_len;
};

/* A finished or streaming choice as the server accumulated it. */
struct kr_oai_choice {
    int32_t index;
    const char *text;           /* generated text so far (after stop-string truncation) */
    size_t text_len;
    const int32_t *token_ids;   /* [n_tokens] (return_token_ids) */
    int32_t n_tokens;
    const struct kr_oai_logprob *logprobs; /* [n_logprobs] or NULL when not requested */
    int32_t n_logprobs;
    const char *finish_reason;  /* "stop", "length", NULL while streaming */
    const char *stop_reason_str; /* the stop string hit (vLLM "stop_reason"), or NULL */
    int32_t stop_reason_id;     /* the stop token id hit, or -1 */
    const struct kr_oai_usage *usage; /* a delta chunk's usage so far (continuous_usage_stats), or NULL */
    /* chat tool calls: the message's (or a delta's) calls; content null when content_null */
    const struct kr_oai_tool_call *tool_calls; /* [n_tool_calls] */
    int32_t n_tool_calls;
    bool content_null;
};

struct kr_oai_usage {
    int32_t prompt_tokens;
    int32_t completion_tokens;
};

/* Non-streaming completions response. `prompt_*` are used for echo and prompt logprobs:
 * with echo, each choice's text starts with the prompt text and, with logprobs, its logprobs start
 * with the prompt tokens' (the first one null). Caller frees (free()). */
struct kr_oai_completion {
    const char *id;             /* "cmpl-..." */
    int64_t created;
    const char *model;
    const struct kr_oai_choice *choices;
    int32_t n_choices;
    struct kr_oai_usage usage;
    /* echo / prompt logprobs (per choice: the choice's prompt) */
    const char *prompt_text;
    size_t prompt_text_len;
    const int32_t *prompt_ids;
    int32_t n_prompt_ids;
    const struct kr_oai_logprob *prompt_logprobs; /* [n_prompt_ids], [0].tok.logprob NaN = null; or NULL */
    bool prompt_logprobs_out;   /* the request asked for prompt_logprobs: vLLM's "prompt_logprobs" is
                                   written from prompt_logprobs (per completions choice, top level for
                                   chat), each entry the prompt token and its row's alternatives */
    bool return_token_ids;
    /* several prompts (a completions request with a list of them): choice i belongs to
     * prompts[i / choices_per_prompt], whose prompt_* and return_token_ids fields are used for it
     * instead of the ones above; NULL for one prompt */
    const struct kr_oai_completion *prompts;
    int32_t choices_per_prompt;
};
char *kr_oai_completion_json(const struct kr_oai_completion *c);

/* Non-streaming chat response (message role "assistant", content = text). */
char *kr_oai_chat_json(const struct kr_oai_completion *c);

/* One SSE `data: {...}\n\n` chunk for a streaming choice delta. `delta` holds the new text,
 * `first` marks the first chat chunk (role "assistant"). finish_reason set on the last one.
 * Returns a malloc'd string including the "data: " prefix and the blank line. */
char *kr_oai_completion_chunk(const char *id, int64_t created, const char *model, const struct kr_oai_choice *delta);
char *kr_oai_chat_chunk(const char *id, int64_t created, const char *model, const struct kr_oai_choice *delta,
                        bool first);
/* The final usage chunk (choices: []) for stream_options.include_usage. */
char *kr_oai_usage_chunk(const char *id, int64_t created, const char *model, bool chat, const struct kr_oai_usage *u);

/* GET /v1/models: the list, of one model. */
char *kr_oai_models_json(const char *name, int64_t created, int64_t max_model_len);
/* GET /v1/models/{id}: the model object alone (the list's one entry). */
char *kr_oai_model_json(const char *name, int64_t created, int64_t max_model_len);

/* Frees a string an encoder above returned, or one from json_dumps: it comes from jansson's
 * allocator (json_set_alloc_funcs; krait routes it through kr_malloc/kr_free, plain malloc when
 * nothing set it). */
void kr_oai_free(void *p);

/* Serializes j (consumed) as the encoders do, into a string from jansson's allocator (kr_oai_free);
 * NULL when out of memory. Unlike json_dumps, which in jansson 2.14 can return a truncated document
 * when one of its buffer growths fails, the text is whole or absent. */
char *kr_oai_dump(json_t *j);

/* json_loadb that tells a failed allocation apart from a malformed text: NULL with *oom set when
 * memory ran out while parsing. jansson 2.14 says json_error_out_of_memory only in some places: a
 * key it could not copy is a syntax error ("string or '}' expected"), a lexer buffer it could not
 * allocate leaves the error empty, and a string buffer that could not grow drops the byte it was
 * saving, so that the parse succeeds with a string missing characters. The allocations that failed
 * on this thread during the call decide (kr_alloc_thread_failures; jansson allocates through
 * kr_malloc in krait): any such failure makes the result NULL and *oom true. Injected failures are
 * shielded from jansson during the call (kr_alloc_shield: its lexer overflows its buffer when a
 * growth fails) and refuse the result all the same. */
json_t *kr_oai_json_loadb(const char *buf, size_t len, size_t flags, json_error_t *je, bool *oom);

/* Encoder conventions (all encoders above; strings come from jansson's allocator, see kr_oai_free):
 * - Every text (choice text, token texts, top-logprob keys, model, id) may hold arbitrary bytes:
 *   invalid UTF-8 is replaced by U+FFFD per maximal invalid subpart (Python errors="replace").
 * - Log-probabilities are written with 9 significant digits (float32 round trip); -inf and values
 *   below -9999 become -9999.0 (vLLM), NaN becomes null.
 * - Completions: echo is on when `prompt_text` is not NULL. Each choice's logprobs, when
 *   `choice.logprobs` is not NULL, list the prompt's entries first (from `prompt_logprobs`, entry 0
 *   with null logprob and null top_logprobs), then the generated ones; text_offset is where the
 *   token's text starts in the choice text, in UTF-8 code points, generated tokens starting after the
 *   echoed prompt: a token whose bytes are not the text's next ones (a special token the text skips,
 *   such as the prompt's BOS, or one past a stop string) sits where the text has got to and advances
 *   nothing, so offsets never decrease. Completions
 *   top_logprobs entries are {token text: logprob} of `top` as given (vLLM includes the sampled
 *   token there; the server decides); an entry with a NaN logprob and no alternatives gets null
 *   top_logprobs (a streamed first prompt token). With return_token_ids, "token_ids" and "prompt_token_ids" are
 *   per choice for completions (vLLM), "prompt_token_ids" is top level for chat.
 * - Chunks: a delta's "token_ids" is written when `delta->token_ids` is not NULL. "usage" appears
 *   in a delta chunk only when `delta->usage` is not NULL (vLLM's continuous_usage_stats: the
 *   choice's prompt and completion tokens so far); kr_oai_usage_chunk is the separate final event. Chat deltas: {"role": "assistant", "content": text} when `first`, {"content": text}
 *   after, {} on a final chunk (finish_reason set) without text. */

/* As kr_oai_completion_chunk, with the logprobs' text_offset starting at `text_offset`: the UTF-8
 * code points of this choice's text already streamed (kr_oai_utf8_count), so that offsets index the
 * whole choice text as in the non-streaming response. Caller frees (free()). */
char *kr_oai_completion_chunk_at(const char *id, int64_t created, const char *model,
                                 const struct kr_oai_choice *delta, int64_t text_offset);

/* The number of code points in s[0..n) once invalid UTF-8 is replaced (each maximal invalid
 * subpart counts as one U+FFFD). s may be NULL (0). Any thread. */
size_t kr_oai_utf8_count(const char *s, size_t n);

#ifdef __cplusplus
}
#endif
