/* Tool calls end to end: the real `krait serve` with the embedded random-weight model
 * (models/tiny-hybrid: DeepSeek-V3 tokenizer, its template writes DeepSeek-V3's tool-call format).
 * A random model never calls a tool on its own, so tool_choice required and a named function
 * (constrained decoding) are where calls come from; their arguments are validated against the
 * tools' schemas with ajv (tests/api/grammar/validate.mjs), independently of the grammar code.
 * auto and none must answer plain text; a stream must add up to the whole answer of the same
 * seed; bad tools and tool_choice values are 400s naming the field. */
#define _POSIX_C_SOURCE 200809L

#include "harness.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MODEL KR_SOURCE_DIR "/models/tiny-hybrid"

static struct srv_proc S;

static void start_default(void)
{
    srv_start(&S, MODEL, "--served-model-name", "tiny", NULL);
}

static void stop_default(void)
{
    cr_expect_eq(srv_stop(&S), 0, "krait serve did not exit 0 on SIGTERM");
}

TestSuite(tools, .init = start_default, .fini = stop_default, .timeout = 900);

/* Bounded schemas: a random model must finish its arguments within max_tokens. */
static const char tools_json[] =
    "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather in a city\", "
    "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", \"maxLength\": 6}, "
    "\"days\": {\"type\": \"integer\", \"minimum\": 1, \"maximum\": 7}}, \"required\": [\"city\", \"days\"], "
    "\"additionalProperties\": false}}},"
    " {\"type\": \"function\", \"function\": {\"name\": \"search\", \"parameters\": {\"type\": \"object\", "
    "\"properties\": {\"q\": {\"enum\": [\"news\", \"sport\", 42]}, \"safe\": {\"type\": \"boolean\"}}, "
    "\"required\": [\"q\"], \"additionalProperties\": false}}}]";

static char *chat_body(const char *extra, int seed, bool stream)
{
    json_error_t je;
    json_t *b = json_pack("{s:[{s:s,s:s}], s:i, s:f, s:i, s:b}", "messages", "role", "user", "content", "Weather?",
                          "max_tokens", 300, "temperature", 1.0, "seed", seed, "stream", stream);
    json_object_set_new(b, "tools", json_loads(tools_json, 0, &je));
    json_t *x = json_loads(extra, 0, &je);
    cr_assert(b && x, "bad extra: %s: %s", extra, je.text);
    json_object_update(b, x);
    json_decref(x);
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* post_json, parsing with JSON_ALLOW_NUL: a random model's text may hold U+0000 (escaped). */
static json_t *post(const char *body, long *status)
{
    struct http_res r;
    http(&S, "POST", "/v1/chat/completions", body, NULL, &r);
    json_error_t je;
    json_t *j = json_loads(r.body, JSON_ALLOW_NUL, &je);
    cr_assert(j, "answered %ld with unparsable JSON (%s): %.300s", r.status, je.text, r.body);
    *status = r.status;
    http_free(&r);
    return j;
}

static const json_t *tool_schema(const char *name)
{
    static json_t *tools;
    if (!tools) {
        tools = json_loads(tools_json, 0, NULL);
    }
    for (size_t i = 0; i < json_array_size(tools); i++) {
        const json_t *fn = json_object_get(json_array_get(tools, i), "function");
        if (!strcmp(json_string_value(json_object_get(fn, "name")), name)) {
            return json_object_get(fn, "parameters");
        }
    }
    return NULL;
}

static void need_node(void)
{
    if (system("node --version > /dev/null 2>&1") != 0) {
        cr_skip_test("node is not installed: the arguments are not checked with ajv");
    }
    cr_assert_eq(access(KR_SOURCE_DIR "/tests/api/grammar/node_modules/ajv/package.json", R_OK), 0,
                 "ajv is not installed: run `npm ci` in tests/api/grammar");
}

/* ajv's verdicts on cases ([{schema, docs: [text]}]). */
static json_t *ajv(json_t *cases)
{
    char in[] = "/tmp/krait-tools-XXXXXX";
    int fd = mkstemp(in);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_assert_eq(json_dump_file(cases, in, JSON_COMPACT), 0);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "node %s/tests/api/grammar/validate.mjs %s", KR_SOURCE_DIR, in);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    json_error_t je;
    json_t *out = json_loadf(p, 0, &je);
    const int rc = pclose(p);
    unlink(in);
    cr_assert_not_null(out, "validator output: %s", je.text);
    cr_assert_eq(rc, 0);
    return out;
}

/* Checks one non-streamed choice that must call tools (of `only` when not NULL, at most max when
 * max > 0); appends each call's (schema, arguments) to cases. Returns the number of calls. */
static size_t check_forced_choice(const json_t *choice, const char *only, size_t max, json_t *cases)
{
    const char *finish = json_string_value(json_object_get(choice, "finish_reason"));
    const json_t *msg = json_object_get(choice, "message");
    const json_t *calls = json_object_get(msg, "tool_calls");
    cr_assert(!strcmp(finish, "tool_calls") || !strcmp(finish, "length"), "a forced call ended with %s", finish);
    if (!strcmp(finish, "length")) {
        return 0; /* the random model chained calls up to max_tokens: the last one is cut */
    }
    cr_expect(json_is_null(json_object_get(msg, "content")), "content must be null before forced calls");
    cr_assert(json_array_size(calls) >= 1);
    cr_expect(max == 0 || json_array_size(calls) <= max, "%zu calls with parallel_tool_calls false",
              json_array_size(calls));
    for (size_t i = 0; i < json_array_size(calls); i++) {
        const json_t *c = json_array_get(calls, i);
        const char *id = json_string_value(json_object_get(c, "id"));
        cr_expect(id && !strncmp(id, "call_", 5) && strlen(id) > 10, "id %s", id ? id : "(none)");
        cr_expect_str_eq(json_string_value(json_object_get(c, "type")), "function");
        const json_t *fn = json_object_get(c, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        const char *args = json_string_value(json_object_get(fn, "arguments"));
        cr_assert(name && args);
        cr_expect(!only || !strcmp(name, only), "called %s, not %s", name, only);
        const json_t *schema = tool_schema(name);
        cr_assert_not_null(schema, "called an unknown function %s", name);
        json_array_append_new(cases, json_pack("{s:O, s:[s]}", "schema", schema, "docs", args));
    }
    return json_array_size(calls);
}

static void expect_all_valid(json_t *cases)
{
    json_t *v = ajv(cases);
    for (size_t i = 0; i < json_array_size(v); i++) {
        const char *verdict = json_string_value(json_array_get(json_array_get(v, i), 0));
        cr_expect_str_eq(verdict, "ok", "arguments %s: %s",
                         json_string_value(json_array_get(json_object_get(json_array_get(cases, i), "docs"), 0)),
                         verdict);
    }
    json_decref(v);
}

Test(tools, required_and_named_calls_have_schema_valid_arguments)
{
    need_node();
    json_t *cases = json_array();
    size_t n_calls = 0;
    for (int seed = 1; seed <= 4; seed++) {
        static const struct {
            const char *extra, *only;
            size_t max;
        } v[] = {{"{\"tool_choice\": \"required\"}", NULL, 0},
                 {"{\"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"search\"}}}", "search", 0},
                 {"{\"tool_choice\": \"required\", \"parallel_tool_calls\": false}", NULL, 1},
                 {"{\"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}, "
                  "\"parallel_tool_calls\": false}", "get_weather", 1}};
        for (size_t k = 0; k < sizeof v / sizeof v[0]; k++) {
            char *body = chat_body(v[k].extra, seed, false);
            long status = 0;
            json_t *res = post(body, &status);
            cr_assert_eq(status, 200, "%s: %s", body, json_dumps(res, 0));
            n_calls += check_forced_choice(json_array_get(json_object_get(res, "choices"), 0), v[k].only, v[k].max,
                                           cases);
            json_decref(res);
            free(body);
        }
    }
    cr_expect_geq(n_calls, 8, "only %zu complete calls in 16 answers", n_calls);
    expect_all_valid(cases);
    json_decref(cases);
}

Test(tools, auto_and_none_answer_text_from_a_random_model)
{
    for (int seed = 1; seed <= 3; seed++) {
        const char *extras[] = {"{\"tool_choice\": \"auto\"}", "{\"tool_choice\": \"none\"}", "{}"};
        for (size_t k = 0; k < 3; k++) {
            char *body = chat_body(extras[k], seed, false);
            long status = 0;
            json_t *res = post(body, &status);
            cr_assert_eq(status, 200, "%s", body);
            const json_t *ch = json_array_get(json_object_get(res, "choices"), 0);
            const char *finish = json_string_value(json_object_get(ch, "finish_reason"));
            cr_expect(!strcmp(finish, "stop") || !strcmp(finish, "length"), "finish %s", finish);
            cr_expect(json_is_string(json_object_get(json_object_get(ch, "message"), "content")));
            cr_expect_null(json_object_get(json_object_get(ch, "message"), "tool_calls"));
            json_decref(res);
            free(body);
        }
    }
}

/* The calls a stream's deltas add up to, as the OpenAI SDKs assemble them: by index, the first
 * piece's id, type and name, the arguments concatenated. *content: the content deltas joined,
 * *finish: the finish_reason. */
static json_t *assemble(const char *sse, char **content, char **finish)
{
    bool done = false;
    json_t *ev = sse_events(sse, &done);
    cr_assert(done, "the stream did not end with [DONE]");
    json_t *calls = json_array();
    size_t clen = 0;
    *content = calloc(1, 1);
    *finish = NULL;
    for (size_t i = 0; i < json_array_size(ev); i++) {
        const json_t *ch = json_array_get(json_object_get(json_array_get(ev, i), "choices"), 0);
        const json_t *d = json_object_get(ch, "delta");
        const char *fr = json_string_value(json_object_get(ch, "finish_reason"));
        if (fr) {
            *finish = strdup(fr);
        }
        const char *c = json_string_value(json_object_get(d, "content"));
        if (c && *c) {
            *content = realloc(*content, clen + strlen(c) + 1);
            strcpy(*content + clen, c);
            clen += strlen(c);
        }
        const json_t *tcs = json_object_get(d, "tool_calls");
        for (size_t k = 0; k < json_array_size(tcs); k++) {
            const json_t *t = json_array_get(tcs, k);
            const size_t idx = (size_t)json_integer_value(json_object_get(t, "index"));
            const json_t *fn = json_object_get(t, "function");
            if (idx == json_array_size(calls)) {
                cr_assert(json_is_string(json_object_get(t, "id")), "a call's first delta has no id");
                cr_assert_str_eq(json_string_value(json_object_get(t, "type")), "function");
                cr_assert(json_is_string(json_object_get(fn, "name")), "a call's first delta has no name");
                json_array_append_new(calls, json_pack("{s:O, s:O, s:s}", "id", json_object_get(t, "id"), "name",
                                                       json_object_get(fn, "name"), "arguments", ""));
            } else {
                cr_assert_lt(idx, json_array_size(calls), "a delta for a call never announced");
                cr_expect_null(json_object_get(fn, "name"), "a later delta repeats the name");
            }
            const char *a = json_string_value(json_object_get(fn, "arguments"));
            json_t *call = json_array_get(calls, idx);
            if (a) {
                const char *had = json_string_value(json_object_get(call, "arguments"));
                char *joined = malloc(strlen(had) + strlen(a) + 1);
                strcpy(joined, had);
                strcat(joined, a);
                json_object_set_new(call, "arguments", json_string(joined));
                free(joined);
            }
        }
    }
    json_decref(ev);
    return calls;
}

Test(tools, a_stream_adds_up_to_the_whole_answer_of_its_seed)
{
    const char *extras[] = {"{\"tool_choice\": \"required\"}",
                            "{\"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}}"};
    for (int seed = 5; seed <= 7; seed++) {
        for (size_t k = 0; k < 2; k++) {
            char *whole_body = chat_body(extras[k], seed, false), *stream_body = chat_body(extras[k], seed, true);
            long status = 0;
            json_t *res = post(whole_body, &status);
            cr_assert_eq(status, 200);
            char *sse = post_stream(&S, "/v1/chat/completions", stream_body, 0, &status);
            cr_assert_eq(status, 200);
            char *content = NULL, *finish = NULL;
            json_t *calls = assemble(sse, &content, &finish);
            const json_t *ch = json_array_get(json_object_get(res, "choices"), 0);
            const json_t *msg = json_object_get(ch, "message");
            cr_expect_str_eq(finish, json_string_value(json_object_get(ch, "finish_reason")));
            const json_t *mc = json_object_get(msg, "content");
            cr_expect_str_eq(content, json_is_string(mc) ? json_string_value(mc) : "");
            const json_t *want = json_object_get(msg, "tool_calls");
            cr_expect_eq(json_array_size(calls), json_array_size(want), "%s", sse);
            for (size_t i = 0; i < json_array_size(want) && i < json_array_size(calls); i++) {
                const json_t *w = json_object_get(json_array_get(want, i), "function"), *g = json_array_get(calls, i);
                cr_expect_str_eq(json_string_value(json_object_get(g, "name")),
                                 json_string_value(json_object_get(w, "name")));
                cr_expect_str_eq(json_string_value(json_object_get(g, "arguments")),
                                 json_string_value(json_object_get(w, "arguments")));
            }
            json_decref(calls);
            json_decref(res);
            free(content);
            free(finish);
            free(sse);
            free(whole_body);
            free(stream_body);
        }
    }
}

Test(tools, history_with_calls_and_results_renders)
{
    const char body[] =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather?\"}, {\"role\": \"assistant\", \"content\": null, "
        "\"tool_calls\": [{\"id\": \"call_1\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
        "\"arguments\": \"{\\\"city\\\": \\\"Paris\\\", \\\"days\\\": 1}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": "
        "\"call_1\", \"content\": \"sunny\"}], \"max_tokens\": 4, \"tools\": [{\"type\": \"function\", \"function\": "
        "{\"name\": \"get_weather\"}}]}";
    long status = 0;
    json_t *res = post(body, &status);
    cr_expect_eq(status, 200, "%s", json_dumps(res, 0));
    json_decref(res);
}

static void expect_400(const char *body, const char *param)
{
    long status = 0;
    json_t *res = post(body, &status);
    cr_expect_eq(status, 400, "%s answered %ld", body, status);
    const char *p = json_string_value(json_object_get(json_object_get(res, "error"), "param"));
    cr_expect(p && !strcmp(p, param), "%s: param %s, want %s", body, p ? p : "(null)", param);
    json_decref(res);
}

Test(tools, bad_tools_and_tool_choice_are_400s_naming_the_field)
{
    const char m[] = "\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_tokens\": 4";
    char b[2048];
    snprintf(b, sizeof b, "{%s, \"tools\": %s, \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": "
             "\"nope\"}}}", m, tools_json);
    expect_400(b, "tool_choice.function.name");
    snprintf(b, sizeof b, "{%s, \"tool_choice\": \"required\"}", m);
    expect_400(b, "tool_choice");
    snprintf(b, sizeof b, "{%s, \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"a b\"}}]}", m);
    expect_400(b, "tools[0].function.name");
    snprintf(b, sizeof b, "{%s, \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"a\"}}, {\"type\": "
             "\"function\", \"function\": {\"name\": \"b\", \"parameters\": {\"type\": \"object\", \"properties\": "
             "{\"x\": {\"type\": \"string\", \"pattern\": \"(?=x)\"}}}}}], \"tool_choice\": \"required\"}", m);
    expect_400(b, "tools[1].function.parameters");
    snprintf(b, sizeof b, "{%s, \"tools\": %s, \"tool_choice\": \"required\", \"response_format\": {\"type\": "
             "\"json_object\"}}", m, tools_json);
    expect_400(b, "tool_choice");
    snprintf(b, sizeof b, "{%s, \"tools\": %s, \"parallel_tool_calls\": 1}", m, tools_json);
    expect_400(b, "parallel_tool_calls");
    /* the server still serves: no slot was leaked by the refusals */
    snprintf(b, sizeof b, "{%s, \"tools\": %s, \"tool_choice\": \"required\"}", m, tools_json);
    long status = 0;
    json_t *res = post(b, &status);
    cr_expect_eq(status, 200);
    json_decref(res);
}
