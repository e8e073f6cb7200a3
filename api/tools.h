#pragma once
/* Tool calls (OpenAI `tools`, `tool_choice`, `parallel_tool_calls`) in the formats the served model
 * families write them (docs/TOOLS.md):
 *   deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>
 *                 (more calls after a \n) <｜tool▁calls▁end｜>                       DeepSeek-V3, V3-0324, R1
 *   deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
 *                                                                                  DeepSeek-V3.1
 *   deepseek_v32  <｜DSML｜function_calls>\n<｜DSML｜invoke name="NAME">\n<｜DSML｜parameter name="K" string="true|false">
 *                 V</｜DSML｜parameter>\n...</｜DSML｜invoke>\n...</｜DSML｜function_calls>     DeepSeek-V3.2
 *   hermes        <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>      Hermes / Qwen convention
 *   nemotron      <TOOLCALL>[{"name": NAME, "arguments": ARGS}, ...]</TOOLCALL>    Nemotron-H (Nano 2)
 *   qwen3_coder   <tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n...</function>\n</tool_call>
 *                 (more calls after a \n)                            Nemotron 3 (Nano, Super), Qwen3-Coder
 * One module knows each format three ways: the grammar that forces it (tool_choice required or a
 * named function), the parser that finds calls in generated text (whole or as it streams), and the
 * name the documentation uses. jansson based; no I/O. */
#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum kr_tool_format {
    KR_TOOL_FORMAT_NONE = 0, /* the model has no known convention: tools are refused with auto/required */
    KR_TOOL_FORMAT_DEEPSEEK_V3,
    KR_TOOL_FORMAT_DEEPSEEK_V31,
    KR_TOOL_FORMAT_DEEPSEEK_V32,
    KR_TOOL_FORMAT_HERMES,
    KR_TOOL_FORMAT_NEMOTRON,
    KR_TOOL_FORMAT_QWEN3_CODER,
};

/* "deepseek_v3", ... ("none" for KR_TOOL_FORMAT_NONE). */
const char *kr_tool_format_name(enum kr_tool_format f);

/* The format a chat template teaches (by the markers it writes: `<function=` with `<tool_call>` or
 * `<parameter=` is qwen3_coder, ahead of hermes' bare `<tool_call>`), else the model family's
 * (`model_type` of config.json: deepseek_v32 → DSML, deepseek_v3 → deepseek_v3, nemotron_h →
 * nemotron; Nemotron 3, also nemotron_h, ships a template that teaches qwen3_coder), else NONE.
 * Either argument may be NULL. */
enum kr_tool_format kr_tool_format_detect(const char *chat_template, const char *model_type);

/* The grammar specification (kr_grammar_from_tools, KR_GRAMMAR_TOOLS) forcing one call or more of
 * `tools` (the request's array, borrowed) in format f, or only function `only` when not NULL, at
 * most max_calls of them (0: no limit). *spec is compact JSON text the caller frees with kr_free().
 * Returns KR_OK, KR_ERR_NOMEM, or KR_ERR_INVAL for KR_TOOL_FORMAT_NONE. */
enum kr_status kr_tool_grammar_spec(enum kr_tool_format f, const json_t *tools, const char *only, int32_t max_calls,
                                    char **spec, size_t *len);

/* One call found in generated text. */
struct kr_tool_call {
    char *name;        /* NUL-terminated, owned */
    char *args;        /* [args_len] the arguments as JSON text, so far while streaming; owned */
    size_t args_len;
    bool complete;     /* its end was seen (else the text ended inside it, or it is still streaming) */
};

/* What the parser made of a text. */
struct kr_tool_parse {
    size_t content_len;        /* text[0..content_len) is content; while streaming, what may go out */
    struct kr_tool_call *calls; /* [n_calls] owned */
    int32_t n_calls;
    bool closed;               /* nothing more can be a call: the section ended or max_calls were made; the
                                  generation may stop */
};

/* Parses text[0..len) (the whole generation so far) in format f. With final false the text may
 * still grow, and only what no continuation can change is reported: content stops before anything
 * that could start a call, a call appears once its name is complete, and its arguments grow by
 * appending (so each later report extends the earlier ones). With final true the text is all
 * there is: a call section that turns out malformed before its first call is complete is content,
 * text after the calls is dropped, and a call the text ends inside is reported incomplete (its
 * arguments as far as they came). At most max_calls calls (0: no limit). Never fails on any
 * input; returns KR_OK or KR_ERR_NOMEM. Free with kr_tool_parse_free.
 *
 * `tools` (the request's array, borrowed; may be NULL) matters to qwen3_coder only, whose
 * parameter values are raw text that becomes a JSON object {"K": value, ...} in the order written:
 *   - a leading and a trailing newline around the value (the format's layout) are not part of it;
 *   - a parameter whose schema in `tools` (the function's parameters.properties[K]) allows a
 *     string (its "type" is or includes "string", an anyOf/oneOf branch allows one, an enum or
 *     const holds a string, or no type is said), or that the function or its properties do not
 *     declare, is the JSON string of the text;
 *   - any other declared parameter (integer, number, boolean, object, array, null) is the text as
 *     JSON when it parses as JSON (surrounding whitespace aside); else True/False/None (Python's
 *     spelling, any case) are true/false/null; else it is the JSON string of the text;
 *   - with tools NULL, every value is the text as JSON when it parses as a JSON number, boolean,
 *     null, object or array, else the JSON string of the text.
 * While streaming, a string value's JSON string grows as its text arrives (what could still be the
 * closing "\n</parameter>" held back), and any other value appears once its parameter closes. */
enum kr_status kr_tool_parse(enum kr_tool_format f, const json_t *tools, const char *text, size_t len, bool final,
                             int32_t max_calls, struct kr_tool_parse *out);
void kr_tool_parse_free(struct kr_tool_parse *p);

/* Whether `name` is a valid function name (OpenAI's rule: 1 to 64 of a-z A-Z 0-9 _ -). */
bool kr_tool_name_valid(const char *name, size_t len);

/* A new call id, "call_" and 24 hex digits, into buf (at least 32 bytes). Thread-safe. */
void kr_tool_call_id(char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
