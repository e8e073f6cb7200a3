#pragma once
/* POST /v1/responses: OpenAI's Responses API, stateless, over a chat completions session.
 *
 * A Responses body is translated into a chat completions body (input items into messages,
 * `instructions` into a leading system message, function tools and tool outputs into the chat
 * forms, `text.format` into `response_format`, `max_output_tokens` into `max_completion_tokens`),
 * which the session then prepares as any chat request. Its answer comes back through a sink that
 * this module puts between the session and the transport: a chat completion becomes a response
 * object, and a stream of chat chunks becomes the Responses stream's events (response.created,
 * response.output_item.added, response.output_text.delta, response.function_call_arguments.delta,
 * ..., response.completed), each with its `event:` name and `sequence_number`, and no `[DONE]`.
 *
 * Nothing is stored: `store: true`, `previous_response_id`, `conversation`, `background: true` and
 * `prompt` are refused by name, as is every other field that is understood but not implemented
 * (non-function tools, image, file and audio inputs, reasoning items, `reasoning`, `include` values
 * other than message.output_text.logprobs). Errors name the Responses field, not the chat one.
 *
 * Threads: kr_resp_request on the preparing thread; the sink on the loop thread. */
#include <stddef.h>

#include "openai.h"
#include "session.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kr_resp;

/* NULL when out of memory. */
struct kr_resp *kr_resp_create(void);
void kr_resp_free(struct kr_resp *r);

/* Translates body[0..len) into a chat completions body (*chat, *chat_len; free with kr_oai_free)
 * and keeps what the answer echoes (instructions, tools, text, metadata, ...). On a bad request:
 * KR_ERR_INVAL with `e` filled (a 400 naming the field); out of memory: KR_ERR_NOMEM. */
enum kr_status kr_resp_request(struct kr_resp *r, const char *body, size_t len, char **chat, size_t *chat_len,
                               struct kr_oai_error *e);

/* Renames the chat field an error names into the Responses field it came from
 * ("max_completion_tokens" -> "max_output_tokens", "response_format" -> "text.format", ...). */
void kr_resp_error_param(const struct kr_resp *r, struct kr_oai_error *e);

/* The sink the session answers through: it translates and forwards to `to` (with `to_user`).
 * Returns the sink; its user pointer is r. */
const struct kr_sess_sink *kr_resp_sink(struct kr_resp *r, const struct kr_sess_sink *to, void *to_user);

#ifdef __cplusplus
}
#endif
