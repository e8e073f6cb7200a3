#define _POSIX_C_SOURCE 200809L

#include "chat-template.h"

#include "alloc.h"

#include <criterion/criterion.h>
#include <jansson.h>

#include <string.h>

/* Expected renderings come from Python jinja2 configured like HF transformers
 * (tools/reference/tokenizer/render_templates.py -> tests/fixtures/tokenizer/templates/cases.json). */

static size_t g_base;

static void setup(void)
{
    g_base = kr_alloc_bytes_in_use();
}

static void teardown(void)
{
    cr_expect_eq(kr_alloc_bytes_in_use(), g_base, "host memory leaked: %zu bytes", kr_alloc_bytes_in_use() - g_base);
}

TestSuite(chat_template, .init = setup, .fini = teardown, .timeout = 60);

/* Runs every case whose name starts with `prefix`; returns how many ran. */
static size_t run_cases(const char *prefix)
{
    json_error_t je;
    json_t *root = json_load_file(KR_FIXTURES "/tokenizer/templates/cases.json", 0, &je);
    cr_assert_not_null(root, "cases.json: %s", je.text);
    const json_t *cases = json_object_get(root, "cases");
    size_t ran = 0;
    for (size_t i = 0; i < json_array_size(cases); i++) {
        const json_t *c = json_array_get(cases, i);
        const char *name = json_string_value(json_object_get(c, "name"));
        if (strncmp(name, prefix, strlen(prefix)) != 0) {
            continue;
        }
        ran++;
        const json_t *src = json_object_get(c, "template"), *vars = json_object_get(c, "variables");
        const json_t *error = json_object_get(c, "error");
        struct kr_chat_template *tpl = NULL;
        struct kr_err err = {0};
        enum kr_status st = kr_chat_template_compile(json_string_value(src), json_string_length(src), &tpl, &err);
        if (error && strncmp(json_string_value(error), "syntax", 6) == 0) {
            cr_expect_eq(st, KR_ERR_FORMAT, "%s: jinja2 rejects this template (%s) but it compiled", name,
                         json_string_value(error));
            cr_expect(st == KR_OK || strstr(err.msg, "line") != NULL, "%s: error does not name a line: %s", name, err.msg);
            kr_chat_template_free(tpl);
            continue;
        }
        cr_expect_eq(st, KR_OK, "%s: compile failed: %s", name, err.msg);
        if (st != KR_OK) {
            continue;
        }
        json_t *extra = json_object();
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)vars, k, v) {
            if (strcmp(k, "messages") && strcmp(k, "tools") && strcmp(k, "documents") && strcmp(k, "add_generation_prompt") &&
                strcmp(k, "bos_token") && strcmp(k, "eos_token")) {
                json_object_set(extra, k, v);
            }
        }
        const json_t *tools = json_object_get(vars, "tools");
        struct kr_chat_params p = {
            .messages = json_object_get(vars, "messages"),
            .tools = json_is_null(tools) ? NULL : tools,
            .add_generation_prompt = json_is_true(json_object_get(vars, "add_generation_prompt")),
            .bos_token = json_string_value(json_object_get(vars, "bos_token")),
            .eos_token = json_string_value(json_object_get(vars, "eos_token")),
            .extra = extra,
        };
        char *out = NULL;
        size_t len = 0;
        st = kr_chat_template_render(tpl, &p, &out, &len, &err);
        if (error) {
            cr_expect_eq(st, KR_ERR_INVAL, "%s: jinja2 fails (%s) but krait rendered: %s", name,
                         json_string_value(error), out ? out : "");
        } else {
            const json_t *want = json_object_get(c, "expected");
            cr_expect_eq(st, KR_OK, "%s: render failed: %s", name, err.msg);
            cr_expect(st != KR_OK || (len == json_string_length(want) && memcmp(out, json_string_value(want), len) == 0),
                      "%s: rendering differs from jinja2:\n--- krait ---\n%s\n--- jinja2 ---\n%s\n", name, out,
                      json_string_value(want));
        }
        kr_free(out);
        json_decref(extra);
        kr_chat_template_free(tpl);
    }
    json_decref(root);
    return ran;
}

Test(chat_template, deepseek_v3_template_matches_jinja2)
{
    cr_expect_gt(run_cases("deepseek_v3/"), 10);
}

Test(chat_template, tiny_hybrid_tools_template_matches_jinja2)
{
    cr_expect_eq(run_cases("tiny_hybrid/"), 32);
}

Test(chat_template, qwen3_template_matches_jinja2)
{
    cr_expect_gt(run_cases("qwen3/"), 10);
}

Test(chat_template, llama3_template_matches_jinja2)
{
    cr_expect_gt(run_cases("llama3/"), 10);
}

Test(chat_template, jinja_features_match_jinja2)
{
    cr_expect_gt(run_cases("feature/"), 20);
}

Test(chat_template, raise_exception_message_reaches_the_caller)
{
    const char *src = "{{ raise_exception('bad role: ' ~ messages[0].role) }}";
    struct kr_chat_template *tpl = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_chat_template_compile(src, strlen(src), &tpl, &err), KR_OK, "%s", err.msg);
    json_t *msgs = json_loads("[{\"role\": \"robot\", \"content\": \"x\"}]", 0, NULL);
    struct kr_chat_params p = {.messages = msgs};
    char *out = NULL;
    size_t len;
    cr_expect_eq(kr_chat_template_render(tpl, &p, &out, &len, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "bad role: robot") != NULL, "message: %s", err.msg);
    cr_expect_null(out);
    json_decref(msgs);
    kr_chat_template_free(tpl);
}

Test(chat_template, runaway_template_is_stopped)
{
    const char *src = "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{{ '' }}{% endfor %}{% endfor %}";
    struct kr_chat_template *tpl = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_chat_template_compile(src, strlen(src), &tpl, &err), KR_OK, "%s", err.msg);
    struct kr_chat_params p = {0};
    char *out = NULL;
    size_t len;
    cr_expect_eq(kr_chat_template_render(tpl, &p, &out, &len, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "steps") != NULL || strstr(err.msg, "limit") != NULL, "message: %s", err.msg);
    kr_chat_template_free(tpl);
}

/* Renders `src` with one user message; returns the status (and the text in *out when not NULL). */
static enum kr_status render_src(const char *src, char **out, struct kr_err *err)
{
    struct kr_chat_template *tpl = NULL;
    cr_assert_eq(kr_chat_template_compile(src, strlen(src), &tpl, err), KR_OK, "%s", err->msg);
    json_t *msgs = json_loads("[{\"role\":\"user\",\"content\":\"hi\"}]", 0, NULL);
    struct kr_chat_params p = {.messages = msgs};
    char *text = NULL;
    size_t len = 0;
    enum kr_status st = kr_chat_template_render(tpl, &p, &text, &len, err);
    if (out) {
        *out = text;
    } else {
        kr_free(text);
    }
    json_decref(msgs);
    kr_chat_template_free(tpl);
    return st;
}

/* Repetition of a string or list costs a step per copy (found by fuzzing: 'a' * 200000000 took
 * seconds of byte appends), a count that would wrap the size check is refused, and repeating
 * nothing any number of times is nothing, at once. */
Test(chat_template, repetition_is_bounded_by_the_step_and_byte_limits)
{
    static const char *const refused[] = {
        "{{ 'a' * 200000000 }}",
        "{{ ('ab' * 9223372036854775807) | length }}",
        "{{ ([1] * 100000000) | length }}",
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        struct kr_err err = {0};
        cr_expect_neq(render_src(refused[i], NULL, &err), KR_OK, "%s rendered", refused[i]);
        cr_expect(strstr(err.msg, "steps") || strstr(err.msg, "memory") || strstr(err.msg, "MiB"),
                  "%s: the error says which limit: %s", refused[i], err.msg);
    }
    static const struct {
        const char *src, *want;
    } ok[] = {
        {"{{ '' * 9223372036854775807 }}|{{ ([] * 9223372036854775807) | length }}", "|0"},
        {"{{ 'ab' * 3 }}{{ ([1, 2] * 2) | length }}", "ababab4"},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        struct kr_err err = {0};
        char *text = NULL;
        cr_expect_eq(render_src(ok[i].src, &text, &err), KR_OK, "%s: %s", ok[i].src, err.msg);
        cr_expect_str_eq(text ? text : "", ok[i].want, "%s", ok[i].src);
        kr_free(text);
    }
}
