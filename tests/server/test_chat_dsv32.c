/* DeepSeek-V3.2's prompt format (server/chat-dsv32.c) against the prompts DeepSeek's own encoder
 * writes (tests/fixtures/deepseek_v32/chat/reference.json, made by make_reference.py there): byte
 * for byte, through kr_chat_render as a chat request reaches it; bad conversations are 400s; every
 * allocation failure is a clean 500 that leaves nothing. */
#include <criterion/criterion.h>
#include <string.h>

#include "alloc.h"
#include "chat.h"

#define REFERENCE KR_SOURCE_DIR "/tests/fixtures/deepseek_v32/chat/reference.json"

static json_t *g_ref;
static struct kr_chat *g_chat;

static void setup(void)
{
    json_set_alloc_funcs(kr_malloc, kr_free); /* as krait does: jansson's allocations fail in the walk too */
    json_error_t je;
    g_ref = json_load_file(REFERENCE, 0, &je);
    cr_assert(g_ref, "%s: %s", REFERENCE, je.text);
    struct kr_err err = {0};
    cr_assert_eq(kr_chat_builtin("deepseek_v32", &g_chat, &err), KR_OK, "%s", err.msg);
    cr_assert(g_chat);
}

static void teardown(void)
{
    kr_chat_free(g_chat);
    json_decref(g_ref);
}

TestSuite(chat_dsv32, .init = setup, .fini = teardown, .timeout = 120);

static enum kr_status render(const json_t *c, bool cont, char **text, size_t *len, struct kr_oai_error *e)
{
    return kr_chat_render(g_chat, json_object_get(c, "messages"), json_object_get(c, "tools"), true, cont,
                          json_object_get(c, "chat_template_kwargs"), text, len, e);
}

Test(chat_dsv32, renders_every_reference_conversation_as_the_encoder_does)
{
    size_t i;
    json_t *c;
    cr_assert_geq(json_array_size(json_object_get(g_ref, "cases")), 16);
    json_array_foreach(json_object_get(g_ref, "cases"), i, c)
    {
        const char *name = json_string_value(json_object_get(c, "name"));
        const json_t *want = json_object_get(c, "text");
        char *text = NULL;
        size_t len = 0;
        struct kr_oai_error e = {0};
        cr_assert_eq(render(c, false, &text, &len, &e), KR_OK, "%s: %s", name, e.message);
        cr_expect_eq(len, json_string_length(want), "%s: %zu bytes, want %zu", name, len, json_string_length(want));
        cr_expect(len == json_string_length(want) && !memcmp(text, json_string_value(want), len),
                  "%s:\n--- got\n%s\n--- want\n%s", name, text, json_string_value(want));
        kr_free(text);
    }
}

Test(chat_dsv32, is_the_format_of_deepseek_v32_only_and_writes_dsml_calls)
{
    struct kr_chat *c = (struct kr_chat *)1;
    struct kr_err err = {0};
    cr_assert_eq(kr_chat_builtin("nemotron_h", &c, &err), KR_OK);
    cr_assert_null(c);
    cr_assert_eq(kr_chat_builtin(NULL, &c, &err), KR_OK);
    cr_assert_null(c);
    cr_expect_eq(kr_chat_tool_format(g_chat, "deepseek_v32"), KR_TOOL_FORMAT_DEEPSEEK_V32);
    cr_expect_eq(kr_chat_tool_format(g_chat, NULL), KR_TOOL_FORMAT_DEEPSEEK_V32);
}

static json_t *loads(const char *s)
{
    json_error_t je;
    json_t *j = json_loads(s, 0, &je);
    cr_assert(j, "%s: %s", s, je.text);
    return j;
}

Test(chat_dsv32, continues_a_final_assistant_message_and_takes_arguments_as_objects)
{
    json_t *m = loads("[{\"role\":\"user\",\"content\":\"Say hi\"},{\"role\":\"assistant\",\"content\":\"Hi the\"}]");
    char *text = NULL;
    size_t len = 0;
    struct kr_oai_error e = {0};
    cr_assert_eq(kr_chat_render(g_chat, m, NULL, true, true, NULL, &text, &len, &e), KR_OK, "%s", e.message);
    cr_expect_str_eq(text, "<｜begin▁of▁sentence｜><｜User｜>Say hi<｜Assistant｜></think>Hi the");
    kr_free(text);
    json_decref(m);
    /* arguments as an object (krait accepts it as the templates do) render as the JSON string would */
    m = loads("[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":["
              "{\"id\":\"a\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":{\"x\":[1.5,\"é\"],\"y\":\"s\"}}}]},"
              "{\"role\":\"tool\",\"tool_call_id\":\"a\",\"content\":[{\"type\":\"text\",\"text\":\"r1\"},{\"type\":\"text\",\"text\":\"r2\"}]}]");
    cr_assert_eq(kr_chat_render(g_chat, m, NULL, true, false, NULL, &text, &len, &e), KR_OK, "%s", e.message);
    cr_expect_str_eq(text, "<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜></think>\n\n<｜DSML｜function_calls>\n"
                           "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"x\" string=\"false\">[1.5, \"é\"]</｜DSML｜parameter>\n"
                           "<｜DSML｜parameter name=\"y\" string=\"true\">s</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                           "</｜DSML｜function_calls><｜end▁of▁sentence｜>\n\n<function_results>\n<result>r1\nr2</result>\n"
                           "</function_results>\n\n</think>");
    kr_free(text);
    json_decref(m);
}

Test(chat_dsv32, answers_400_for_what_the_format_cannot_write)
{
    static const struct {
        const char *messages, *tools, *param;
    } bad[] = {
        {"[{\"role\":\"narrator\",\"content\":\"x\"}]", NULL, "messages[0]"},
        {"[{\"role\":\"tool\",\"content\":\"x\"}]", NULL, "messages[0]"},
        {"[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"tool\",\"content\":\"x\"}]", NULL, "messages[1]"},
        {"[{\"role\":\"assistant\",\"content\":\"a\"},{\"role\":\"tool\",\"content\":\"x\"}]", NULL, "messages[1]"},
        {"[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},"
         "{\"role\":\"tool\",\"content\":\"x\"},{\"role\":\"tool\",\"content\":\"y\"}]",
         NULL, "messages[2]"},
        {"[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\":\"}}]}]", NULL,
         "messages[0].tool_calls[0]"},
        {"[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"[1]\"}}]}]", NULL,
         "messages[0].tool_calls[0]"},
        {"[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"arguments\":\"{}\"}}]}]", NULL,
         "messages[0].tool_calls[0]"},
        {"[{\"role\":\"assistant\",\"tool_calls\":[7]}]", NULL, "messages[0].tool_calls[0]"},
        {"[{\"role\":\"user\",\"content\":\"q\"}]", "[{\"type\":\"function\"}]", "tools[0].function"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_t *m = loads(bad[i].messages), *t = bad[i].tools ? loads(bad[i].tools) : NULL;
        char *text = NULL;
        size_t len = 0;
        struct kr_oai_error e = {0};
        cr_expect_eq(kr_chat_render(g_chat, m, t, true, false, NULL, &text, &len, &e), KR_ERR_INVAL, "case %zu", i);
        cr_expect_eq(e.http_status, 400, "case %zu", i);
        cr_expect_str_eq(e.param, bad[i].param, "case %zu: %s", i, e.message);
        cr_expect_null(text);
        json_decref(m);
        json_decref(t);
    }
}

Test(chat_dsv32, every_allocation_failure_is_a_clean_500)
{
    size_t i;
    json_t *c;
    json_array_foreach(json_object_get(g_ref, "cases"), i, c)
    {
        const char *name = json_string_value(json_object_get(c, "name"));
        for (int sticky = 0; sticky < 2; sticky++) {
            for (uint64_t n = 1;; n++) {
                cr_assert_lt(n, 100000);
                const size_t base = kr_alloc_bytes_in_use();
                char *text = NULL;
                size_t len = 0;
                struct kr_oai_error e = {0};
                const uint64_t f0 = kr_alloc_failures();
                kr_alloc_fail_at(n, sticky);
                const enum kr_status st = render(c, false, &text, &len, &e);
                kr_alloc_fail_at(0, 0);
                const bool fired = kr_alloc_failures() != f0;
                if (st == KR_OK) {
                    cr_assert(!fired, "%s: rendered although allocation %llu failed", name, (unsigned long long)n);
                    cr_expect_str_eq(text, json_string_value(json_object_get(c, "text")), "%s", name);
                    kr_free(text);
                    break;
                }
                cr_assert_eq(st, KR_ERR_NOMEM, "%s: allocation %llu: status %d: %s", name, (unsigned long long)n, st,
                             e.message);
                cr_assert_eq(e.http_status, 500, "%s", name);
                cr_assert_null(text);
                cr_assert_eq(kr_alloc_bytes_in_use(), base, "%s: allocation %llu: %lld bytes left", name,
                             (unsigned long long)n, (long long)(kr_alloc_bytes_in_use() - base));
            }
        }
    }
}
