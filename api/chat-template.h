#pragma once
/* Chat templates: the Jinja2 subset that tokenizer_config.json `chat_template`s use, rendered
 * byte for byte as HF transformers renders them (jinja2 ImmutableSandboxedEnvironment with
 * trim_blocks=True, lstrip_blocks=True, the loopcontrols extension, transformers' own `tojson`
 * (json.dumps with ensure_ascii=False, keys in insertion order, optional indent/separators/
 * sort_keys), `raise_exception(msg)` and `strftime_now(fmt)` globals, and `{% generation %}`
 * blocks rendered as their body).
 *
 * Supported: text, {{ }}, {% %}, {# #}, whitespace control (-, +), {% raw %}; statements if/elif/
 * else, for (tuple targets, `if` filter, else, loop.index/index0/revindex/revindex0/first/last/
 * length/previtem/nextitem/cycle), set (names, tuples, namespace attributes, block form), macro
 * (positional/keyword arguments, defaults), with, filter blocks, break/continue, generation;
 * expressions with Python semantics: literals, lists, tuples, dicts, attribute/item access, slices,
 * calls, arithmetic, `~`, comparisons, `in`, and/or/not, conditional expressions, filters and `is`
 * tests; str/dict/list methods (strip, split, startswith, items, get, ...); Jinja's default
 * Undefined (prints as "", iterates empty, fails on attribute access or arithmetic).
 * A template using a construct, filter or test outside this subset fails to compile, naming it.
 *
 * A compiled template is immutable: it may be rendered from any number of threads at once. */
#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kr_chat_template;

/* Compiles `len` bytes of template source. On success *out is a new template the caller frees
 * with kr_chat_template_free(). A syntax error, an unknown filter or test, or an unsupported tag
 * is KR_ERR_FORMAT with "line N: what" in err; KR_ERR_NOMEM on allocation failure. */
enum kr_status kr_chat_template_compile(const char *source, size_t len, struct kr_chat_template **out,
                                        struct kr_err *err);

/* Frees a template; NULL is a no-op. */
void kr_chat_template_free(struct kr_chat_template *tpl);

/* What a template is rendered with (all borrowed). */
struct kr_chat_params {
    const json_t *messages;     /* array of OpenAI-style message objects (role, content, tool_calls with
                                   function.name/arguments, tool_call_id, ...); NULL = empty list */
    const json_t *tools;        /* array of tool definitions, or NULL: the template sees `tools` as none */
    bool add_generation_prompt;
    const char *bos_token;      /* NULL: bos_token is undefined in the template */
    const char *eos_token;      /* NULL: eos_token is undefined */
    const json_t *extra;        /* object of further variables (e.g. enable_thinking), or NULL */
};

/* Renders the template. On success *out is a new NUL-terminated string of *out_len bytes that the
 * caller frees with kr_free(). A template that raises (raise_exception) or fails at run time
 * (undefined attribute, type error, division by zero, ...) returns KR_ERR_INVAL with the message
 * and line in err; runaway templates (more than 10^7 evaluation steps or 256 MiB of working
 * memory) are stopped with KR_ERR_INVAL. */
enum kr_status kr_chat_template_render(const struct kr_chat_template *tpl, const struct kr_chat_params *params,
                                       char **out, size_t *out_len, struct kr_err *err);

struct kr_buf_s;

/* Appends Python's json.dumps(v, ensure_ascii=False) of `v` to b: ", " and ": " between items,
 * keys in their order, floats as Python writes them (the shortest digits that round-trip, 1e+22,
 * 1.0). KR_ERR_NOMEM when b could not grow (b->oom). The depth is jansson's parser's, bounded. */
enum kr_status kr_py_json_dumps(const json_t *v, struct kr_buf_s *b);

#ifdef __cplusplus
}
#endif
