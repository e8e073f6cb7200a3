#pragma once
/* DeepSeek-V3.2's prompt format, rendered as its encoder (encoding_dsv32.py, shipped with the
 * checkpoint in place of a chat template) writes it. */
#include <stdbool.h>

#include <jansson.h>

#include "openai.h"
#include "unicode.h"

/* Appends the prompt of `messages` (contents already strings or null; roles system, user,
 * assistant, tool) and `tools` (OpenAI's tool objects, or NULL) to b: BOS, the tools block as a
 * leading system prompt, each turn in the model's markers, and after the last user turn or tool
 * results `</think>` (or `<think>` with `thinking`). A message the format cannot write (an unknown
 * role, a tool result without an assistant call before it, call arguments that are not a JSON
 * object) is KR_ERR_INVAL with a 400 in e naming it; a failed allocation is KR_ERR_NOMEM with a
 * 500. */
enum kr_status kr_dsv32_render(const json_t *messages, const json_t *tools, bool thinking, struct kr_buf_s *b,
                               struct kr_oai_error *e);
