#pragma once
/* One OpenAI request apart from HTTP: a completions or chat completions request (prepared, handed to
 * the engine, its events turned into choices, stop strings, token text, SSE chunks or one JSON
 * answer), or a /tokenize or /detokenize body. It knows no socket and no event loop: what it
 * produces goes out through a sink the transport implements (h2o generator style), and engine
 * events reach it through a carrier the transport provides (a queue from the engine thread to the
 * loop thread).
 *
 * Threads. kr_sess_prepare runs on any one thread (a worker: parsing, the chat template and
 * tokenization may take long); everything else runs on the loop thread, except the carrier's
 * `post`, which the engine thread calls.
 *
 * Lifetime. The transport holds one reference from kr_sess_create to kr_sess_release; every prompt
 * the engine still owes events holds another. After kr_sess_release (or kr_sess_cancel without an
 * error) the sink is never called again; the session frees itself once the engine's last event for
 * it has been delivered. */
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine.h"
#include "metrics.h"
#include "openai.h"
#include "status.h"
#include "tools.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kr_chat;
struct kr_tokenizer;
struct kr_sess;
struct kr_sess_sub;

enum kr_sess_kind {
    KR_SESS_COMPLETIONS = 0, /* POST /v1/completions */
    KR_SESS_CHAT,            /* POST /v1/chat/completions */
    KR_SESS_TOKENIZE,        /* POST /tokenize */
    KR_SESS_DETOKENIZE,      /* POST /detokenize */
    KR_SESS_RESPONSES,       /* POST /v1/responses: a chat request under another shape (responses.h) */
};

/* The engine as a session uses it: kr_engine_submit, kr_engine_cancel, kr_engine_cancel_choice and
 * kr_engine_failed with the same contracts, on an opaque context (tests put a scripted engine
 * here). */
struct kr_sess_engine_i {
    enum kr_status (*submit)(void *ctx, const struct kr_request_params *p, uint64_t *req_id, struct kr_err *err);
    void (*cancel)(void *ctx, uint64_t req_id);
    void (*cancel_choice)(void *ctx, uint64_t req_id, int32_t index);
    bool (*failed)(void *ctx);
};

/* The kr_engine_* functions, on a struct kr_engine * context. A NULL context (the engine already
 * freed at shutdown) cancels nothing and has not failed. */
extern const struct kr_sess_engine_i kr_sess_engine_krait;

/* One engine event, copied off the engine thread (the engine's arrays are only borrowed there) and
 * carried to the loop thread. `next` belongs to the carrier (an intrusive queue link); the rest
 * belongs to the session module. */
struct kr_sess_event {
    struct kr_sess_event *next;
    struct kr_sess_sub *sub;
    struct kr_event ev;
    int32_t top_ids[KR_MAX_TOP_LOGPROBS];
    float top_lps[KR_MAX_TOP_LOGPROBS];
    float *plp;      /* [n_prompt] (KR_EVENT_PROMPT_LOGPROBS) */
    int32_t *plp_ids; /* [n_prompt * k] */
    float *plp_top;  /* [n_prompt * k] */
    int32_t *plp_rank; /* [n_prompt] */
    char msg[512];   /* KR_EVENT_ERROR's message */
};

/* What every session of one server shares. Set before the first session is created; the
 * session module writes only `met` and `n_running`, on the loop thread. */
struct kr_sess_env {
    const struct kr_sess_engine_i *engine;
    void *engine_ctx;
    const struct kr_tokenizer *tok; /* NULL: token ids only (--skip-tokenizer-init) */
    const struct kr_chat *chat;     /* NULL: no chat template (chat answers 400) */
    enum kr_tool_format tool_format; /* how the model writes tool calls (api/tools.h); NONE: tools are only
                                        rendered, tool_choice required or a named function answers 400 */
    struct kr_grammar_cache *grammars;        /* compiled output constraints (thread-safe); NULL: none */
    const struct kr_grammar_vocab *gvocab;    /* the tokenizer's tokens for masks; NULL: no constrained
                                                 decoding (no tokenizer) */
    int64_t vocab;                  /* token ids in prompts must be below this */
    int32_t max_model_len;
    bool snapshot_hints;            /* the engine takes state snapshots at named positions: worth finding
                                       where a chat's last user turn begins */
    size_t max_bytes_per_token;     /* kr_tokenizer_max_bytes_per_token (0: unbounded): a text longer
                                       than max_model_len times this is refused before tokenizing */
    size_t max_request_memory;      /* bytes one request's preparation may hold (its parsed JSON, rendered
                                       prompt, token ids); more is a 413 (0: unbounded) */
    const char *model_name;
    bool return_tokens_as_token_ids;
    struct kr_metrics *met;         /* finish reasons, TTFT, ITL, queue time, end-to-end latency */
    /* Engine thread: carries ev to the loop thread, which hands it to kr_sess_event_deliver. Must
     * not fail (the node is already allocated) and must not block beyond a short lock. */
    void (*post)(void *user, struct kr_sess_event *ev);
    void *post_user;
    int n_running;                  /* sessions the engine still owes events */
};

/* Where a session's answer goes; implemented by the transport, called on the loop thread only,
 * from kr_sess_start, kr_sess_event_deliver or kr_sess_cancel. Every session calls `done` exactly
 * once unless it was cancelled without an error or released first. */
struct kr_sess_sink {
    /* The answer is an event stream (status 200): called once, before any stream_event. */
    void (*stream_begin)(void *user);
    /* One event of the stream: its data, a JSON object (the transport frames it). Returns false
     * when it could not be taken (out of memory); the session sends that text again later. */
    bool (*stream_event)(void *user, const char *json, size_t len);
    /* Optional: the same, for a named event (SSE "event: <name>" before its data), as the Responses
     * API's streams have; NULL: such events go to stream_event unnamed. */
    bool (*stream_event_named)(void *user, const char *name, const char *json, size_t len);
    /* The end. After stream_begin: the stream is over (body NULL; the transport ends it with
     * "data: [DONE]", or with nothing when body is "", as a Responses stream ends): status
     * 200, or 500 when its last event, an error, could not be taken (out of memory): the transport
     * then sends an out-of-memory error event of its own before the end. Otherwise: the whole answer with its HTTP status (an OpenAI error object from 400 up);
     * body NULL means that building it ran out of memory (the transport answers 500). The body is
     * borrowed for the call. */
    void (*done)(void *user, int status, const char *body, size_t len);
};

/* A new session for one request of `kind` that arrived at `t_arrival` (kr_clock_s). env is
 * borrowed and must outlive the session. Returns NULL when out of memory. Loop thread. */
struct kr_sess *kr_sess_create(struct kr_sess_env *env, enum kr_sess_kind kind, double t_arrival);

/* Parses and validates body[0..len) (borrowed) and prepares the request: the chat template, the
 * prompts' tokens, the limits; for /tokenize and /detokenize the whole answer. Returns KR_OK, or
 * an error whose OpenAI answer kr_sess_start sends. Any one thread, before kr_sess_start. */
enum kr_status kr_sess_prepare(struct kr_sess *s, const char *body, size_t len);

/* Set when a session whose preparation held more than 32 MiB was freed: its memory is worth giving
 * back to the system (malloc_trim), which the transport does off the loop thread and clears this. */
extern atomic_bool kr_sess_trim_wanted;

/* Starts a prepared session with its sink (user is passed to every sink call): a failed
 * preparation or a /tokenize answer goes to `done` at once; a generation is submitted to the
 * engine (`done` with the error if that fails), and then `stream_begin` when it streams. Loop
 * thread; once. */
void kr_sess_start(struct kr_sess *s, const struct kr_sess_sink *sink, void *user);

/* Cancels whatever the engine still does for s (once). With why == NULL (the client is gone) the
 * sink is never called again. With an error (the shutdown deadline, a failed device) the answer
 * ends now with that error, unless it already ended or failed otherwise: a JSON error answer, or an
 * error event and the end of the stream. No effect before kr_sess_start. Loop thread. */
void kr_sess_cancel(struct kr_sess *s, const struct kr_oai_error *why);

/* The transport lets go of s: its engine work is cancelled, the sink is never called again, and s
 * is freed once no engine event for it is outstanding. Not while kr_sess_prepare runs. NULL is a
 * no-op. Loop thread. */
void kr_sess_release(struct kr_sess *s);

/* Delivers one carried event to its session and frees it. Loop thread. */
void kr_sess_event_deliver(struct kr_sess_event *ev);

/* The OpenAI id of the answer ("cmpl-...", "chatcmpl-..."); "" until a generation started. */
const char *kr_sess_id(const struct kr_sess *s);

/* Prompt tokens and completion tokens so far (for the access log). */
void kr_sess_usage(const struct kr_sess *s, int64_t *prompt_tokens, int64_t *completion_tokens);

#ifdef __cplusplus
}
#endif
