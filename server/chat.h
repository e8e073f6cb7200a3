#pragma once
/* Chat prompts: the model's chat template (tokenizer_config.json's, or --chat-template's) applied to
 * OpenAI messages, with the tokenizer's BOS/EOS strings. */
#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "openai.h"
#include "status.h"
#include "tokenizer.h"
#include "tools.h"

struct kr_chat;

/* Compiles the template of `template_file` when given, else the tokenizer's; *out is NULL (and
 * KR_OK) when there is none. A template that does not compile is an error naming the line. */
enum kr_status kr_chat_load(const struct kr_tokenizer *tok, const char *template_file, struct kr_chat **out,
                            struct kr_err *err);
void kr_chat_free(struct kr_chat *c);

/* The prompt format a model family defines in code rather than in a template, for a checkpoint
 * without one: `deepseek_v32` (config.json's model_type) gets DeepSeek-V3.2's encoder
 * (encoding_dsv32.py's format: DSML tool calls, `thinking` / `enable_thinking` in
 * chat_template_kwargs for thinking mode, `developer` as system). *out is NULL for any other
 * family. KR_ERR_NOMEM on allocation failure. */
enum kr_status kr_chat_builtin(const char *model_type, struct kr_chat **out, struct kr_err *err);

/* How the model writes tool calls: the format its template teaches, else its family's (config.json's
 * model_type, may be NULL), else none (kr_tool_format_detect). c may be NULL (no template). */
enum kr_tool_format kr_chat_tool_format(const struct kr_chat *c, const char *model_type);

/* Renders `messages` (content strings or arrays of text parts, joined with newlines) and `tools`.
 * With continue_final_message the text ends right after the last message's content (the
 * assistant turn is left open, as transformers does). Template errors are 400s. *text is
 * kr_malloc'd. */
enum kr_status kr_chat_render(const struct kr_chat *c, json_t *messages, json_t *tools, bool add_generation_prompt,
                              bool continue_final_message, json_t *kwargs, char **text, size_t *len,
                              struct kr_oai_error *e);
