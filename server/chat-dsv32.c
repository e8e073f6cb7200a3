#include "chat-dsv32.h"

#include "chat-template.h"

#include <string.h>

#define DS_BOS "<｜begin▁of▁sentence｜>"
#define DS_EOS "<｜end▁of▁sentence｜>"
#define DS_USER "<｜User｜>"
#define DS_ASSISTANT "<｜Assistant｜>"
#define DS_THINK "<think>"
#define DS_THINK_END "</think>"
#define DSML "｜DSML｜"

/* The system prompt's tools section; the tools' JSON follows, one a line, then "</functions>\n". */
static const char tools_head[] =
    "## Tools\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    "You can invoke functions by writing a \"<" DSML "function_calls>\" block like the following as part of your "
    "reply to the user:\n"
    "<" DSML "function_calls>\n"
    "<" DSML "invoke name=\"$FUNCTION_NAME\">\n"
    "<" DSML "parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</" DSML "parameter>\n"
    "...\n"
    "</" DSML "invoke>\n"
    "<" DSML "invoke name=\"$FUNCTION_NAME2\">\n"
    "...\n"
    "</" DSML "invoke>\n"
    "</" DSML "function_calls>\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, while lists and "
    "objects should use JSON format. The \"string\" attribute should be set to \"true\" for string type parameters "
    "and \"false\" for other types (numbers, booleans, arrays, objects).\n"
    "If the thinking_mode is enabled, then after function results you should strongly consider outputting a "
    "thinking block. Here is an example:\n"
    "<" DSML "function_calls>\n"
    "...\n"
    "</" DSML "function_calls>\n"
    "<function_results>\n"
    "...\n"
    "</function_results>\n" DS_THINK "...thinking about results" DS_THINK_END "\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n";

static void put(struct kr_buf_s *b, const char *s)
{
    kr_bs_append(b, s, strlen(s));
}

/* A string field's text ("" when absent, null or not a string: the encoder writes `content or ""`). */
static void put_field(struct kr_buf_s *b, const json_t *m, const char *key)
{
    const json_t *v = json_object_get(m, key);
    if (json_is_string(v)) {
        kr_bs_append(b, json_string_value(v), json_string_length(v));
    }
}

static bool nonempty_string(const json_t *v)
{
    return json_is_string(v) && json_string_length(v) > 0;
}

static enum kr_status oom(struct kr_oai_error *e)
{
    kr_oai_error(e, KR_OAI_INTERNAL, "", "out of memory");
    return KR_ERR_NOMEM;
}

static enum kr_status render_tools(const json_t *tools, struct kr_buf_s *b, struct kr_oai_error *e)
{
    put(b, "\n\n");
    put(b, tools_head);
    size_t i;
    const json_t *t;
    json_array_foreach((json_t *)tools, i, t)
    {
        const json_t *fn = json_object_get(t, "function");
        if (!json_is_object(fn)) {
            char param[48];
            snprintf(param, sizeof param, "tools[%zu].function", i);
            kr_oai_error(e, KR_OAI_INVALID, param, "a tool needs a function object");
            return KR_ERR_INVAL;
        }
        if (kr_py_json_dumps(fn, b) != KR_OK) {
            return oom(e);
        }
        put(b, "\n");
    }
    put(b, "</functions>\n");
    return KR_OK;
}

/* One call: `<｜DSML｜invoke name="N">`, a parameter element per argument (strings raw, anything
 * else as JSON), `</｜DSML｜invoke>`. */
static enum kr_status render_call(const json_t *call, const char *param, struct kr_buf_s *b, struct kr_oai_error *e)
{
    const json_t *fn = json_object_get(call, "function");
    const json_t *name = json_object_get(fn, "name");
    const json_t *args = json_object_get(fn, "arguments");
    if (!json_is_string(name)) {
        kr_oai_error(e, KR_OAI_INVALID, param, "a tool call needs function.name");
        return KR_ERR_INVAL;
    }
    json_t *parsed = NULL;
    if (json_is_string(args)) {
        json_error_t je;
        bool failed = false; /* jansson reports some allocation failures as syntax errors */
        parsed = kr_oai_json_loadb(json_string_value(args), json_string_length(args), 0, &je, &failed);
        if (failed) {
            json_decref(parsed);
            return oom(e);
        }
        args = parsed;
    }
    if (!json_is_object(args)) {
        json_decref(parsed);
        kr_oai_error(e, KR_OAI_INVALID, param, "a tool call's function.arguments must be a JSON object");
        return KR_ERR_INVAL;
    }
    put(b, "<" DSML "invoke name=\"");
    kr_bs_append(b, json_string_value(name), json_string_length(name));
    put(b, "\">\n");
    bool first = true;
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)args, k, v)
    {
        if (!first) {
            put(b, "\n");
        }
        first = false;
        put(b, "<" DSML "parameter name=\"");
        put(b, k);
        put(b, json_is_string(v) ? "\" string=\"true\">" : "\" string=\"false\">");
        if (json_is_string(v)) {
            kr_bs_append(b, json_string_value(v), json_string_length(v));
        } else {
            kr_py_json_dumps(v, b);
        }
        put(b, "</" DSML "parameter>");
    }
    put(b, "\n</" DSML "invoke>");
    json_decref(parsed);
    return b->oom ? oom(e) : KR_OK;
}

static const char *role_of(const json_t *m)
{
    const char *r = json_string_value(json_object_get(m, "role"));
    return r ? r : "";
}

enum kr_status kr_dsv32_render(const json_t *messages, const json_t *tools, bool thinking, struct kr_buf_s *b,
                               struct kr_oai_error *e)
{
    const size_t n = json_array_size(messages);
    /* the encoder's turn markers depend on where the last user message is */
    long last_user = -1;
    for (size_t i = 0; i < n; i++) {
        if (!strcmp(role_of(json_array_get(messages, i)), "user")) {
            last_user = (long)i;
        }
    }
    put(b, DS_BOS);
    enum kr_status st;
    if (json_array_size(tools) > 0 && (st = render_tools(tools, b, e)) != KR_OK) {
        return st;
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *m = json_array_get(messages, i);
        const char *role = role_of(m);
        char param[48];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!strcmp(role, "system")) {
            put_field(b, m, "content");
        } else if (!strcmp(role, "user")) {
            put(b, DS_USER);
            put_field(b, m, "content");
            put(b, DS_ASSISTANT);
            put(b, (long)i == last_user && thinking ? DS_THINK : DS_THINK_END);
        } else if (!strcmp(role, "tool")) {
            /* results answer the calls of the assistant message before them, in order */
            size_t a = i;
            while (a > 0 && !strcmp(role_of(json_array_get(messages, a - 1)), "tool")) {
                a--;
            }
            const json_t *calls = a > 0 ? json_object_get(json_array_get(messages, a - 1), "tool_calls") : NULL;
            const size_t order = i - a + 1;
            if (a == 0 || strcmp(role_of(json_array_get(messages, a - 1)), "assistant") ||
                json_array_size(calls) < order) {
                kr_oai_error(e, KR_OAI_INVALID, param,
                             "a tool message must answer a tool call of the assistant message before it");
                return KR_ERR_INVAL;
            }
            if (order == 1) {
                put(b, "\n\n<function_results>");
            }
            put(b, "\n<result>");
            put_field(b, m, "content");
            put(b, "</result>");
            if (order == json_array_size(calls)) {
                put(b, "\n</function_results>\n\n");
                put(b, (long)i >= last_user && thinking ? DS_THINK : DS_THINK_END);
            }
        } else if (!strcmp(role, "assistant")) {
            if (thinking && (long)i > last_user) { /* this turn's reasoning; earlier turns' is dropped */
                const json_t *r = json_object_get(m, "reasoning");
                put_field(b, m, nonempty_string(r) ? "reasoning" : "reasoning_content");
                put(b, DS_THINK_END);
            }
            put_field(b, m, "content");
            const json_t *calls = json_object_get(m, "tool_calls");
            if (json_array_size(calls) > 0) {
                put(b, "\n\n<" DSML "function_calls>\n");
                size_t j;
                const json_t *c;
                json_array_foreach((json_t *)calls, j, c)
                {
                    char cp[64];
                    snprintf(cp, sizeof cp, "messages[%zu].tool_calls[%zu]", i, j);
                    if (j) {
                        put(b, "\n");
                    }
                    if ((st = render_call(c, cp, b, e)) != KR_OK) {
                        return st;
                    }
                }
                put(b, "\n</" DSML "function_calls>");
            }
            put(b, DS_EOS);
        } else {
            kr_oai_error(e, KR_OAI_INVALID, param, "the role \"%s\" has no place in DeepSeek-V3.2's prompt format",
                         role);
            return KR_ERR_INVAL;
        }
    }
    return b->oom ? oom(e) : KR_OK;
}
