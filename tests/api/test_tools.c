/* Tool-call formats (api/tools.h): each format's parser on texts written by hand in that format
 * (the expected calls are written out here, not computed), the same texts streamed in random splits
 * (the pieces the session would send must add up to the whole parse), malformed texts, and the
 * grammars that force each format (a matcher accepts the hand-written texts, rejects others). */
#include "tools.h"

#include "alloc.h"
#include "grammar.h"

#include <criterion/criterion.h>
#include <jansson.h>

#include <stdlib.h>
#include <string.h>

static size_t g_base;

static void setup(void)
{
    g_base = kr_alloc_bytes_in_use();
}

static void teardown(void)
{
    cr_expect_eq(kr_alloc_bytes_in_use(), g_base, "host memory leaked: %zu bytes", kr_alloc_bytes_in_use() - g_base);
}

TestSuite(tools, .init = setup, .fini = teardown, .timeout = 60);

struct want {
    const char *name, *args;
    bool complete;
};

static void expect_parse_with(enum kr_tool_format f, const json_t *tools, const char *text, int32_t max_calls,
                              const char *content, const struct want *w, int32_t n)
{
    struct kr_tool_parse p;
    cr_assert_eq(kr_tool_parse(f, tools, text, strlen(text), true, max_calls, &p), KR_OK);
    cr_expect_eq(p.content_len, strlen(content), "%s: content %zu bytes, want '%s'", kr_tool_format_name(f),
                 p.content_len, content);
    cr_expect(memcmp(text, content, strlen(content)) == 0);
    cr_expect_eq(p.n_calls, n, "%s: %d calls, want %d in: %s", kr_tool_format_name(f), p.n_calls, n, text);
    for (int32_t i = 0; i < n && i < p.n_calls; i++) {
        cr_expect_str_eq(p.calls[i].name, w[i].name);
        cr_expect_eq(p.calls[i].args_len, strlen(w[i].args), "%s call %d: args '%.*s', want '%s'",
                     kr_tool_format_name(f), i, (int)p.calls[i].args_len, p.calls[i].args ? p.calls[i].args : "",
                     w[i].args);
        cr_expect(p.calls[i].args_len == strlen(w[i].args) && memcmp(p.calls[i].args, w[i].args, p.calls[i].args_len) == 0);
        cr_expect_eq(p.calls[i].complete, w[i].complete, "%s call %d complete", kr_tool_format_name(f), i);
    }
    kr_tool_parse_free(&p);
}

static void expect_parse(enum kr_tool_format f, const char *text, int32_t max_calls, const char *content,
                         const struct want *w, int32_t n)
{
    expect_parse_with(f, NULL, text, max_calls, content, w, n);
}

/* Streams text in random pieces as the session does: content up to content_len, a call once it
 * appears, its arguments as they grow. What was sent must be a prefix of the final parse at every
 * step and equal to it at the end. Seed 0: one byte at a time (every prefix). */
static void expect_stream_matches_with(enum kr_tool_format f, const json_t *tools, const char *text,
                                       int32_t max_calls, unsigned seed)
{
    const size_t len = strlen(text);
    struct kr_tool_parse whole;
    cr_assert_eq(kr_tool_parse(f, tools, text, len, true, max_calls, &whole), KR_OK);
    srand(seed);
    size_t content_sent = 0, args_sent[16] = {0};
    int32_t calls_seen = 0;
    char names[16][128] = {{0}};
    char *args[16] = {0};
    size_t at = 0;
    bool closed = false;
    while (at < len && !closed) {
        at += seed ? 1 + (size_t)(rand() % 7) : 1;
        if (at > len) {
            at = len;
        }
        struct kr_tool_parse p;
        cr_assert_eq(kr_tool_parse(f, tools, text, at, false, max_calls, &p), KR_OK);
        cr_assert_geq(p.content_len, content_sent, "%s: content shrank at %zu", kr_tool_format_name(f), at);
        content_sent = p.content_len;
        cr_assert_geq(p.n_calls, calls_seen);
        for (int32_t i = 0; i < p.n_calls && i < 16; i++) {
            if (i >= calls_seen) {
                snprintf(names[i], sizeof names[i], "%s", p.calls[i].name);
            }
            cr_assert_geq(p.calls[i].args_len, args_sent[i]);
            cr_assert(args_sent[i] == 0 || memcmp(p.calls[i].args, args[i], args_sent[i]) == 0,
                      "%s: call %d's arguments changed what was sent", kr_tool_format_name(f), i);
            args[i] = realloc(args[i], p.calls[i].args_len + 1);
            memcpy(args[i], p.calls[i].args ? p.calls[i].args : "", p.calls[i].args_len);
            args_sent[i] = p.calls[i].args_len;
        }
        calls_seen = p.n_calls;
        closed = p.closed;
        kr_tool_parse_free(&p);
    }
    /* the session stops at a closed section and then parses the text it kept as final */
    struct kr_tool_parse fin;
    cr_assert_eq(kr_tool_parse(f, tools, text, at, true, max_calls, &fin), KR_OK);
    cr_expect_eq(fin.n_calls, whole.n_calls, "%s: %d streamed calls, %d whole", kr_tool_format_name(f), fin.n_calls,
                 whole.n_calls);
    cr_expect_eq(fin.content_len, whole.content_len);
    cr_expect_geq(fin.content_len, content_sent);
    for (int32_t i = 0; i < whole.n_calls && i < fin.n_calls && i < 16; i++) {
        cr_expect_str_eq(fin.calls[i].name, whole.calls[i].name);
        cr_expect(i >= calls_seen || strcmp(names[i], whole.calls[i].name) == 0);
        cr_expect_eq(fin.calls[i].args_len, whole.calls[i].args_len);
        cr_expect(memcmp(fin.calls[i].args, whole.calls[i].args, whole.calls[i].args_len) == 0);
        cr_expect(args_sent[i] <= whole.calls[i].args_len && memcmp(args[i] ? args[i] : "", whole.calls[i].args,
                                                                    args_sent[i]) == 0);
    }
    for (int i = 0; i < 16; i++) {
        free(args[i]);
    }
    kr_tool_parse_free(&fin);
    kr_tool_parse_free(&whole);
}

static void expect_stream_matches(enum kr_tool_format f, const char *text, int32_t max_calls, unsigned seed)
{
    expect_stream_matches_with(f, NULL, text, max_calls, seed);
}

#define V3_CALL(name, args) "<｜tool▁call▁begin｜>function<｜tool▁sep｜>" name "\n```json\n" args "\n```<｜tool▁call▁end｜>"
#define V31_CALL(name, args) "<｜tool▁call▁begin｜>" name "<｜tool▁sep｜>" args "<｜tool▁call▁end｜>"

static const char v3_two[] = "Let me check.<｜tool▁calls▁begin｜>" V3_CALL("get_weather", "{\"city\": \"Paris\"}") "\n"
    V3_CALL("search", "{\"q\": \"météo ```json }\"}") "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>";
static const char v31_two[] = "<｜tool▁calls▁begin｜>" V31_CALL("get_weather", "{\"city\": \"Paris\"}")
    V31_CALL("search", "{\"q\": \"x<y\"}") "<｜tool▁calls▁end｜>";
static const char dsml_two[] = "Sure.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Paris \"centre\"\n</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";
static const char hermes_two[] = "I will call.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"P}\\\"\"}}\n"
    "</tool_call>\n<tool_call>\n{\"name\":\"search\",\"arguments\":{\"q\":[1,{\"a\":null}]}}\n</tool_call>";
/* qwen3_coder as Nemotron 3's chat template writes a turn's calls: each call
 * "<tool_call>\n<function=" NAME ">\n", each argument "<parameter=" K ">\n" V "\n</parameter>\n",
 * then "</function>\n</tool_call>\n" (booleans as Python's `value | string` spells them). */
#define QC_OPEN(name) "<tool_call>\n<function=" name ">\n"
#define QC_PARAM(k, v) "<parameter=" k ">\n" v "\n</parameter>\n"
#define QC_CLOSE "</function>\n</tool_call>\n"
static const char qwen3_two[] = "Let me look.\n" QC_OPEN("get_weather") QC_PARAM("city", "Paris \"centre\"\n2nd line")
    QC_PARAM("days", "3") QC_PARAM("detailed", "True") QC_PARAM("hours", "[9, 12]") QC_CLOSE
    QC_OPEN("search") QC_PARAM("q", "a <b> </para\\ end\n") QC_CLOSE QC_OPEN("now") QC_CLOSE;
static const char nemotron_two[] = "<TOOLCALL>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, "
    "{\"name\": \"search\", \"arguments\": {}}]</TOOLCALL>";

Test(tools, deepseek_v3_calls_and_content)
{
    const struct want w[] = {{"get_weather", "{\"city\": \"Paris\"}", true}, {"search", "{\"q\": \"météo ```json }\"}", true}};
    expect_parse(KR_TOOL_FORMAT_DEEPSEEK_V3, v3_two, 0, "Let me check.", w, 2);
    expect_parse(KR_TOOL_FORMAT_DEEPSEEK_V3, v3_two, 1, "Let me check.", w, 1);
}

Test(tools, deepseek_v31_calls)
{
    const struct want w[] = {{"get_weather", "{\"city\": \"Paris\"}", true}, {"search", "{\"q\": \"x<y\"}", true}};
    expect_parse(KR_TOOL_FORMAT_DEEPSEEK_V31, v31_two, 0, "", w, 2);
}

Test(tools, deepseek_v32_dsml_parameters_become_json)
{
    const struct want w[] = {{"get_weather", "{\"city\": \"Paris \\\"centre\\\"\\n\", \"days\": 3}", true}, {"now", "{}", true}};
    expect_parse(KR_TOOL_FORMAT_DEEPSEEK_V32, dsml_two, 0, "Sure.\n\n", w, 2);
}

Test(tools, hermes_calls)
{
    const struct want w[] = {{"get_weather", "{\"city\": \"P}\\\"\"}", true}, {"search", "{\"q\":[1,{\"a\":null}]}", true}};
    expect_parse(KR_TOOL_FORMAT_HERMES, hermes_two, 0, "I will call.\n", w, 2);
}

Test(tools, nemotron_calls)
{
    const struct want w[] = {{"get_weather", "{\"city\": \"Paris\"}", true}, {"search", "{}", true}};
    expect_parse(KR_TOOL_FORMAT_NEMOTRON, nemotron_two, 0, "", w, 2);
}

Test(tools, streamed_in_random_splits_adds_up_to_the_whole)
{
    const struct {
        enum kr_tool_format f;
        const char *text;
    } cases[] = {{KR_TOOL_FORMAT_DEEPSEEK_V3, v3_two}, {KR_TOOL_FORMAT_DEEPSEEK_V31, v31_two},
                 {KR_TOOL_FORMAT_DEEPSEEK_V32, dsml_two}, {KR_TOOL_FORMAT_HERMES, hermes_two},
                 {KR_TOOL_FORMAT_NEMOTRON, nemotron_two},
                 {KR_TOOL_FORMAT_DEEPSEEK_V3, "plain text with < and <｜tool▁calls and no call"},
                 {KR_TOOL_FORMAT_DEEPSEEK_V3, "<｜tool▁calls▁begin｜>garbage"},
                 {KR_TOOL_FORMAT_HERMES, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (unsigned seed = 1; seed <= 40; seed++) {
            expect_stream_matches(cases[i].f, cases[i].text, 0, seed);
            expect_stream_matches(cases[i].f, cases[i].text, 1, seed);
        }
    }
}

Test(tools, malformed_output_is_content)
{
    expect_parse(KR_TOOL_FORMAT_DEEPSEEK_V3, "<｜tool▁calls▁begin｜>garbage", 0, "<｜tool▁calls▁begin｜>garbage", NULL, 0);
    expect_parse(KR_TOOL_FORMAT_HERMES, "<tool_call>{\"nam\": 1}</tool_call>", 0, "<tool_call>{\"nam\": 1}</tool_call>",
                 NULL, 0);
    expect_parse(KR_TOOL_FORMAT_NEMOTRON, "<TOOLCALL>[", 0, "<TOOLCALL>[", NULL, 0);
    expect_parse(KR_TOOL_FORMAT_DEEPSEEK_V32, "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"a\nb\">", 0,
                 "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"a\nb\">", NULL, 0);
    /* a call the text ends inside is a call, incomplete, with its arguments so far */
    const struct want w[] = {{"f", "{\"a\": [1, 2", false}};
    expect_parse(KR_TOOL_FORMAT_HERMES, "x<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2", 0, "x", w, 1);
    /* no input crashes the parser: every prefix of every sample, every format */
    const char *samples[] = {v3_two, v31_two, dsml_two, hermes_two, nemotron_two, qwen3_two};
    for (int f = KR_TOOL_FORMAT_NONE; f <= KR_TOOL_FORMAT_QWEN3_CODER; f++) {
        for (size_t s = 0; s < 6; s++) {
            for (size_t n = 0; n <= strlen(samples[s]); n++) {
                struct kr_tool_parse p;
                cr_assert_eq(kr_tool_parse((enum kr_tool_format)f, NULL, samples[s], n, n % 2, 0, &p), KR_OK);
                cr_assert_leq(p.content_len, n);
                kr_tool_parse_free(&p);
            }
        }
    }
}

Test(tools, format_detection)
{
    cr_expect_eq(kr_tool_format_detect("...<｜DSML｜function_calls>...", "nemotron_h"), KR_TOOL_FORMAT_DEEPSEEK_V32);
    cr_expect_eq(kr_tool_format_detect("<｜tool▁sep｜>' + name + '\\n```json\\n'", NULL), KR_TOOL_FORMAT_DEEPSEEK_V3);
    cr_expect_eq(kr_tool_format_detect("<｜tool▁sep｜>' + args", NULL), KR_TOOL_FORMAT_DEEPSEEK_V31);
    cr_expect_eq(kr_tool_format_detect("<TOOLCALL>", NULL), KR_TOOL_FORMAT_NEMOTRON);
    cr_expect_eq(kr_tool_format_detect("<tool_call>", NULL), KR_TOOL_FORMAT_HERMES);
    cr_expect_eq(kr_tool_format_detect("{{ messages }}", "deepseek_v32"), KR_TOOL_FORMAT_DEEPSEEK_V32);
    cr_expect_eq(kr_tool_format_detect(NULL, "llama"), KR_TOOL_FORMAT_NONE);
    cr_expect(kr_tool_name_valid("get_weather-2", 13));
    cr_expect(!kr_tool_name_valid("a b", 3));
    cr_expect(!kr_tool_name_valid("", 0));
    char a[40], b[40];
    kr_tool_call_id(a, sizeof a);
    kr_tool_call_id(b, sizeof b);
    cr_expect_eq(strlen(a), 29);
    cr_expect(strncmp(a, "call_", 5) == 0 && strcmp(a, b) != 0);
}

/* ---- grammars ------------------------------------------------------------------------------------ */

static const char tools_json[] =
    "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\", "
    "\"properties\": {\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\"}}, \"required\": [\"city\"]}}},"
    " {\"type\": \"function\", \"function\": {\"name\": \"search\", \"parameters\": {\"type\": \"object\", "
    "\"properties\": {\"q\": {\"type\": \"string\"}}, \"required\": [\"q\"]}}}]";

static bool grammar_accepts_with(const char *tools_text, enum kr_tool_format f, const char *only, int32_t max_calls,
                                 const char *text)
{
    json_error_t je;
    json_t *tools = json_loads(tools_text, 0, &je);
    cr_assert_not_null(tools, "%s", je.text);
    char *spec = NULL;
    size_t len = 0;
    cr_assert_eq(kr_tool_grammar_spec(f, tools, only, max_calls, &spec, &len), KR_OK);
    json_decref(tools);
    struct kr_grammar *g = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_grammar_compile(KR_GRAMMAR_TOOLS, spec, len, NULL, &g, &err), KR_OK, "%s", err.msg);
    kr_free(spec);
    struct kr_grammar_matcher *m = NULL;
    cr_assert_eq(kr_grammar_matcher_create(g, &m, &err), KR_OK);
    bool ok = false;
    cr_assert_eq(kr_grammar_matcher_accept_bytes(m, text, strlen(text), &ok, &err), KR_OK);
    ok = ok && kr_grammar_matcher_can_end(m);
    kr_grammar_matcher_destroy(m);
    kr_grammar_free(g);
    return ok;
}

static bool grammar_accepts(enum kr_tool_format f, const char *only, int32_t max_calls, const char *text)
{
    return grammar_accepts_with(tools_json, f, only, max_calls, text);
}

Test(tools, grammars_force_each_format)
{
    const char *v3 = "<｜tool▁calls▁begin｜>" V3_CALL("get_weather", "{\"city\": \"Paris\", \"days\": 2}") "\n"
                     V3_CALL("search", "{\"q\": \"x\"}") "<｜tool▁calls▁end｜>";
    cr_expect(grammar_accepts(KR_TOOL_FORMAT_DEEPSEEK_V3, NULL, 0, v3));
    cr_expect(!grammar_accepts(KR_TOOL_FORMAT_DEEPSEEK_V3, NULL, 1, v3), "parallel_tool_calls false: one call");
    cr_expect(!grammar_accepts(KR_TOOL_FORMAT_DEEPSEEK_V3, "search", 0, v3), "named: only that function");
    cr_expect(!grammar_accepts(KR_TOOL_FORMAT_DEEPSEEK_V3, NULL, 0,
                               "<｜tool▁calls▁begin｜>" V3_CALL("get_weather", "{\"days\": 2}") "<｜tool▁calls▁end｜>"),
              "a required property is missing");
    cr_expect(!grammar_accepts(KR_TOOL_FORMAT_DEEPSEEK_V3, NULL, 0, "Hello"));
    cr_expect(grammar_accepts(KR_TOOL_FORMAT_DEEPSEEK_V31, "search", 1,
                              "<｜tool▁calls▁begin｜>" V31_CALL("search", "{\"q\": \"x\"}") "<｜tool▁calls▁end｜>"));
    cr_expect(grammar_accepts(KR_TOOL_FORMAT_HERMES, NULL, 0,
                              "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}\n</tool_call>\n"
                              "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"P\"}}\n</tool_call>"));
    cr_expect(grammar_accepts(KR_TOOL_FORMAT_NEMOTRON, NULL, 0,
                              "<TOOLCALL>[{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}]</TOOLCALL>"));
    cr_expect(grammar_accepts(KR_TOOL_FORMAT_DEEPSEEK_V32, "get_weather", 0,
                              "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                              "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
                              "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
                              "</｜DSML｜invoke>\n</｜DSML｜function_calls>"));
    cr_expect(!grammar_accepts(KR_TOOL_FORMAT_DEEPSEEK_V32, "get_weather", 0,
                               "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                               "<｜DSML｜parameter name=\"days\" string=\"false\">x</｜DSML｜parameter>\n"
                               "</｜DSML｜invoke>\n</｜DSML｜function_calls>"));
}

Test(tools, a_schema_that_does_not_compile_names_its_tool)
{
    const char spec[] = "{\"format\": {\"prefix\": \"<\", \"mid\": \">\"}, \"tools\": [{\"name\": \"a\"}, "
                        "{\"name\": \"b\", \"parameters\": {\"type\": \"object\", \"patternProperties\": {}}}]}";
    struct kr_grammar *g = NULL;
    struct kr_err err = {0};
    cr_expect_eq(kr_grammar_compile(KR_GRAMMAR_TOOLS, spec, strlen(spec), NULL, &g, &err), KR_ERR_INVAL);
    cr_expect(strncmp(err.msg, "tools[1].function.parameters: ", 30) == 0, "%s", err.msg);
    cr_expect(strstr(err.msg, "patternProperties") != NULL, "%s", err.msg);
    kr_grammar_free(g);
}

/* ---- qwen3_coder (Nemotron 3, Qwen3-Coder) -------------------------------------------------------- */

static const char qc_tools_json[] =
    "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\", "
    "\"properties\": {\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\"}, "
    "\"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"]}, \"detailed\": {\"type\": \"boolean\"}, "
    "\"hours\": {\"type\": \"array\", \"items\": {\"type\": \"integer\"}}, \"note\": {\"type\": [\"string\", \"null\"]}, "
    "\"limit\": {\"anyOf\": [{\"type\": \"integer\"}, {\"type\": \"null\"}]}}, \"required\": [\"city\", \"days\"]}}},"
    " {\"type\": \"function\", \"function\": {\"name\": \"search\", \"parameters\": {\"type\": \"object\", "
    "\"properties\": {\"q\": {\"type\": \"string\"}}, \"required\": [\"q\"]}}},"
    " {\"type\": \"function\", \"function\": {\"name\": \"now\"}}]";

static json_t *qc_tools(void)
{
    json_error_t je;
    json_t *t = json_loads(qc_tools_json, 0, &je);
    cr_assert_not_null(t, "%s", je.text);
    return t;
}

Test(tools, qwen3_coder_calls_become_json_by_the_schema)
{
    json_t *tools = qc_tools();
    /* one newline after <parameter=K> and one before </parameter> are layout, further ones are text */
    const struct want w[] = {
        {"get_weather", "{\"city\": \"Paris \\\"centre\\\"\\n2nd line\", \"days\": 3, \"detailed\": true, \"hours\": [9, 12]}",
         true},
        {"search", "{\"q\": \"a <b> </para\\\\ end\\n\"}", true},
        {"now", "{}", true}};
    expect_parse_with(KR_TOOL_FORMAT_QWEN3_CODER, tools, qwen3_two, 0, "Let me look.\n", w, 3);
    expect_parse_with(KR_TOOL_FORMAT_QWEN3_CODER, tools, qwen3_two, 1, "Let me look.\n", w, 1);
    json_decref(tools);
}

Test(tools, qwen3_coder_values_by_type)
{
    json_t *tools = qc_tools();
    static const char text[] = QC_OPEN("get_weather") QC_PARAM("city", "42") QC_PARAM("days", "three")
        QC_PARAM("unit", "celsius") QC_PARAM("note", "null") QC_PARAM("limit", " 7 ") QC_PARAM("extra", "{\"a\": 1}")
        QC_CLOSE QC_OPEN("get_weather") QC_PARAM("detailed", "FALSE") QC_PARAM("days", "None")
        QC_PARAM("hours", "[1,") QC_PARAM("limit", "\"5\"") QC_CLOSE QC_OPEN("unknown") QC_PARAM("n", "5") QC_CLOSE;
    /* by the schema: a string (or a type that allows one, or an undeclared parameter or function) is the
     * text; other types are the text as JSON, or Python's True/False/None, else the text */
    const struct want typed[] = {
        {"get_weather", "{\"city\": \"42\", \"days\": \"three\", \"unit\": \"celsius\", \"note\": \"null\", \"limit\": 7, "
                        "\"extra\": \"{\\\"a\\\": 1}\"}", true},
        {"get_weather", "{\"detailed\": false, \"days\": null, \"hours\": \"[1,\", \"limit\": \"5\"}", true},
        {"unknown", "{\"n\": \"5\"}", true}};
    expect_parse_with(KR_TOOL_FORMAT_QWEN3_CODER, tools, text, 0, "", typed, 3);
    /* without tools: JSON when it is a number, boolean, null, object or array; else the text */
    const struct want guessed[] = {
        {"get_weather", "{\"city\": 42, \"days\": \"three\", \"unit\": \"celsius\", \"note\": null, \"limit\": 7, "
                        "\"extra\": {\"a\": 1}}", true},
        {"get_weather", "{\"detailed\": \"FALSE\", \"days\": \"None\", \"hours\": \"[1,\", \"limit\": \"\\\"5\\\"\"}", true},
        {"unknown", "{\"n\": 5}", true}};
    expect_parse_with(KR_TOOL_FORMAT_QWEN3_CODER, NULL, text, 0, "", guessed, 3);
    for (unsigned seed = 0; seed <= 40; seed++) {
        expect_stream_matches_with(KR_TOOL_FORMAT_QWEN3_CODER, tools, text, 0, seed);
        expect_stream_matches_with(KR_TOOL_FORMAT_QWEN3_CODER, NULL, text, 0, seed);
    }
    json_decref(tools);
}

/* The report on a prefix of qwen3_two: its content length and its only call's arguments. */
static void expect_prefix(const json_t *tools, const char *upto, size_t content_len, const char *args)
{
    const char *at = strstr(qwen3_two, upto);
    cr_assert_not_null(at, "%s", upto);
    struct kr_tool_parse p;
    cr_assert_eq(kr_tool_parse(KR_TOOL_FORMAT_QWEN3_CODER, tools, qwen3_two, (size_t)(at - qwen3_two) + strlen(upto),
                               false, 0, &p), KR_OK);
    cr_expect_eq(p.content_len, content_len);
    cr_expect_eq(p.n_calls, args ? 1 : 0);
    if (args && p.n_calls == 1) {
        cr_expect_str_eq(p.calls[0].name, "get_weather");
        cr_expect(p.calls[0].args_len == strlen(args) && (!*args || memcmp(p.calls[0].args, args, strlen(args)) == 0),
                  "args '%.*s', want '%s'", (int)p.calls[0].args_len, p.calls[0].args ? p.calls[0].args : "", args);
        cr_expect(!p.closed);
    }
    kr_tool_parse_free(&p);
}

Test(tools, qwen3_coder_streams_string_values_as_they_come)
{
    json_t *tools = qc_tools();
    expect_prefix(tools, "Let me look.\n<tool_", 13, NULL);
    expect_prefix(tools, "<function=get_wea", 13, NULL);
    expect_prefix(tools, "<function=get_weather>", 13, "");
    expect_prefix(tools, "<parameter=city>\nParis \"cen", 13, "{\"city\": \"Paris \\\"cen");
    /* the newline that may be the one before </parameter> waits, and so does a partial tag */
    expect_prefix(tools, "2nd line\n", 13, "{\"city\": \"Paris \\\"centre\\\"\\n2nd line");
    expect_prefix(tools, "2nd line\n</para", 13, "{\"city\": \"Paris \\\"centre\\\"\\n2nd line");
    expect_prefix(tools, "2nd line\n</parameter>", 13, "{\"city\": \"Paris \\\"centre\\\"\\n2nd line\"");
    /* a value of another type comes once its parameter closes */
    expect_prefix(tools, "<parameter=days>\n3", 13, "{\"city\": \"Paris \\\"centre\\\"\\n2nd line\", \"days\": ");
    expect_prefix(tools, "<parameter=days>\n3\n</parameter>", 13,
                  "{\"city\": \"Paris \\\"centre\\\"\\n2nd line\", \"days\": 3");
    json_decref(tools);
}

Test(tools, qwen3_coder_streamed_in_random_splits_adds_up_to_the_whole)
{
    json_t *tools = qc_tools();
    const char *texts[] = {qwen3_two, "<tool_call>\nhello\n</tool_call>", "a <tool_call> b <tool_c",
                           "x" QC_OPEN("search") QC_PARAM("q", "\n\n<<</parameter") "</function>",
                           QC_OPEN("now") QC_CLOSE "\n" QC_OPEN("search") "<parameter=q>\nab\n\n"};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        for (unsigned seed = 0; seed <= 40; seed++) {
            for (int32_t max = 0; max <= 1; max++) {
                expect_stream_matches_with(KR_TOOL_FORMAT_QWEN3_CODER, tools, texts[i], max, seed);
                expect_stream_matches_with(KR_TOOL_FORMAT_QWEN3_CODER, NULL, texts[i], max, seed);
            }
        }
    }
    json_decref(tools);
}

Test(tools, qwen3_coder_malformed_output_is_content)
{
    json_t *tools = qc_tools();
    const enum kr_tool_format f = KR_TOOL_FORMAT_QWEN3_CODER;
    expect_parse_with(f, tools, "<tool_call>\nhello\n</tool_call>", 0, "<tool_call>\nhello\n</tool_call>", NULL, 0);
    expect_parse_with(f, tools, "<tool_call>\n<function=a\nb>\n</function>", 0, "<tool_call>\n<function=a\nb>\n</function>",
                      NULL, 0);
    expect_parse_with(f, tools, "<tool_call>\n<function=>\n</function>", 0, "<tool_call>\n<function=>\n</function>", NULL,
                      0);
    /* hermes' JSON body is not this format */
    expect_parse_with(f, tools, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", 0,
                      "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", NULL, 0);
    expect_parse_with(f, tools, "I use <tool_call> tags", 0, "I use <tool_call> tags", NULL, 0);
    /* a call the text ends inside: incomplete, its arguments so far */
    const struct want cut[] = {{"search", "{\"q\": \"abc", false}};
    expect_parse_with(f, tools, "x<tool_call>\n<function=search>\n<parameter=q>\nabc\n", 0, "x", cut, 1);
    /* the arguments are complete at </function>; what follows the calls is dropped */
    const struct want now[] = {{"now", "{}", true}};
    expect_parse_with(f, tools, QC_OPEN("now") "</function>\nbye", 0, "", now, 1);
    expect_parse_with(f, tools, QC_OPEN("now") QC_CLOSE "bye " QC_OPEN("now") QC_CLOSE, 0, "", now, 1);
    json_decref(tools);
}

Test(tools, qwen3_coder_detection)
{
    /* Nemotron 3's and Qwen3-Coder's templates write "<tool_call>\n<function=" ~ name ~ ">\n" and
     * "<parameter=" ~ name ~ ">\n"; hermes templates write <tool_call> with JSON inside */
    cr_expect_eq(kr_tool_format_detect("{{- '<tool_call>\\n<function=' ~ tool_call.name ~ '>\\n' -}}"
                                       "{{- '<parameter=' ~ args_name ~ '>\\n' -}}", "nemotron_h"),
                 KR_TOOL_FORMAT_QWEN3_CODER);
    cr_expect_eq(kr_tool_format_detect("<function=' ~ name ~ '><parameter=", NULL), KR_TOOL_FORMAT_QWEN3_CODER);
    cr_expect_eq(kr_tool_format_detect("<tool_call>\\n{\"name\": <function-name>}", NULL), KR_TOOL_FORMAT_HERMES);
    cr_expect_eq(kr_tool_format_detect("<function=x>", NULL), KR_TOOL_FORMAT_NONE);
    cr_expect_eq(kr_tool_format_detect("<TOOLCALL>", "nemotron_h"), KR_TOOL_FORMAT_NEMOTRON);
    cr_expect_eq(kr_tool_format_detect(NULL, "nemotron_h"), KR_TOOL_FORMAT_NEMOTRON);
    cr_expect_str_eq(kr_tool_format_name(KR_TOOL_FORMAT_QWEN3_CODER), "qwen3_coder");
}

Test(tools, qwen3_coder_grammar)
{
    const enum kr_tool_format f = KR_TOOL_FORMAT_QWEN3_CODER;
    const char two[] = QC_OPEN("get_weather") QC_PARAM("city", "Paris <b> </para\n<<") QC_PARAM("days", "3")
        QC_PARAM("unit", "celsius") "</function>\n</tool_call>\n" QC_OPEN("search") QC_PARAM("q", "x")
        "</function>\n</tool_call>";
    cr_expect(grammar_accepts_with(qc_tools_json, f, NULL, 0, two));
    cr_expect(!grammar_accepts_with(qc_tools_json, f, NULL, 1, two), "parallel_tool_calls false: one call");
    cr_expect(!grammar_accepts_with(qc_tools_json, f, "search", 0, two), "named: only that function");
    cr_expect(grammar_accepts_with(qc_tools_json, f, "search", 0, QC_OPEN("search") QC_PARAM("q", "x") "</function>\n</tool_call>"));
    cr_expect(grammar_accepts_with(qc_tools_json, f, NULL, 0, QC_OPEN("now") "</function>\n</tool_call>"));
    cr_expect(grammar_accepts_with(qc_tools_json, f, NULL, 0,
                                   QC_OPEN("get_weather") QC_PARAM("city", "") QC_PARAM("days", "-2")
                                   QC_PARAM("detailed", "false") QC_PARAM("hours", "[1,2]") QC_PARAM("limit", "null")
                                   "</function>\n</tool_call>"));
    cr_expect(!grammar_accepts_with(qc_tools_json, f, NULL, 0,
                                    QC_OPEN("get_wether") QC_PARAM("city", "P") QC_PARAM("days", "3") "</function>\n</tool_call>"),
              "an unknown function");
    cr_expect(!grammar_accepts_with(qc_tools_json, f, NULL, 0,
                                    QC_OPEN("get_weather") QC_PARAM("city", "P") "</function>\n</tool_call>"),
              "a required parameter is missing");
    cr_expect(!grammar_accepts_with(qc_tools_json, f, NULL, 0,
                                    QC_OPEN("get_weather") QC_PARAM("city", "P") QC_PARAM("days", "three")
                                    "</function>\n</tool_call>"),
              "an integer that is not");
    cr_expect(!grammar_accepts_with(qc_tools_json, f, NULL, 0,
                                    QC_OPEN("get_weather") QC_PARAM("city", "P") QC_PARAM("days", "3")
                                    QC_PARAM("unit", "kelvin") "</function>\n</tool_call>"),
              "a string outside the enum");
    cr_expect(!grammar_accepts_with(qc_tools_json, f, NULL, 0,
                                    QC_OPEN("get_weather") QC_PARAM("city", "a</parameter>b") QC_PARAM("days", "3")
                                    "</function>\n</tool_call>"),
              "a string value cannot hold the closing tag");
    cr_expect(!grammar_accepts_with(qc_tools_json, f, NULL, 0, "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"));
    /* what the grammar lets through parses to the calls it spelled */
    json_t *tools = qc_tools();
    const struct want w[] = {{"get_weather", "{\"city\": \"Paris <b> </para\\n<<\", \"days\": 3, \"unit\": \"celsius\"}", true},
                             {"search", "{\"q\": \"x\"}", true}};
    expect_parse_with(f, tools, two, 0, "", w, 2);
    json_decref(tools);
}
