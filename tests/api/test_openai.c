#define _POSIX_C_SOURCE 200809L

#include "openai.h"

#include "alloc.h"

#include <criterion/criterion.h>
#include <jansson.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Expected shapes come from the OpenAI API reference (Completions, Chat Completions, streaming
 * chunk and Models objects, error object) and, for the extensions, from vLLM's protocol models
 * (stop_reason, token_ids, prompt_token_ids, root, max_model_len). U+FFFD replacement expectations
 * were computed with Python's bytes.decode("utf-8", "replace"). Every encoder output is re-parsed
 * with jansson and checked field by field; nothing here compares against a stored krait output. */

static size_t g_base;

static void setup(void)
{
    g_base = kr_alloc_bytes_in_use();
}

static void teardown(void)
{
    kr_alloc_fail_at(0, 0);
    cr_expect_eq(kr_alloc_bytes_in_use(), g_base, "host memory leaked: %zu bytes",
                 kr_alloc_bytes_in_use() - g_base);
}

TestSuite(openai, .init = setup, .fini = teardown, .timeout = 120);

/* ---- helpers --------------------------------------------------------------------------------- */

#define USER_MSG "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]"

static enum kr_status parse_str(enum kr_oai_kind k, const char *body, struct kr_oai_request *r,
                                struct kr_oai_error *e)
{
    memset(e, 0, sizeof *e);
    return kr_oai_parse(k, body, strlen(body), r, e);
}

/* Parses `{<prefix>,<extra>}` (prefix = a valid prompt/messages member) and expects success. */
static void ok_body(enum kr_oai_kind k, const char *body, struct kr_oai_request *r)
{
    struct kr_oai_error e;
    enum kr_status st = parse_str(k, body, r, &e);
    cr_assert_eq(st, KR_OK, "%s: rejected: %s (param %s)", body, e.message, e.param);
}

static void ok_with(enum kr_oai_kind k, const char *extra, struct kr_oai_request *r)
{
    char body[4096];
    snprintf(body, sizeof body, "{%s%s%s}", k == KR_OAI_CHAT ? USER_MSG : "\"prompt\":\"hi\"",
             *extra ? "," : "", extra);
    ok_body(k, body, r);
}

/* Expects a 400 invalid_request_error naming `param`; returns the message for further checks. */
static void bad_body(enum kr_oai_kind k, const char *body, const char *param, char *msg_out, size_t msg_cap)
{
    struct kr_oai_request r;
    struct kr_oai_error e;
    enum kr_status st = parse_str(k, body, &r, &e);
    cr_expect_eq(st, KR_ERR_INVAL, "%s: accepted", body);
    if (st == KR_OK) {
        kr_oai_request_free(&r);
        return;
    }
    cr_expect_eq(e.http_status, 400, "%s: http %d", body, e.http_status);
    cr_expect_str_eq(e.type, "invalid_request_error", "%s", body);
    cr_expect_str_eq(e.param, param, "%s: param '%s', want '%s' (message: %s)", body, e.param, param,
                     e.message);
    cr_expect_str_eq(e.code, "", "%s", body);
    cr_expect_gt(strlen(e.message), 0, "%s: empty message", body);
    cr_expect_null(r.root, "%s: request not reset on failure", body);
    kr_oai_request_free(&r); /* a no-op on the zeroed request */
    if (msg_out) {
        snprintf(msg_out, msg_cap, "%s", e.message);
    }
}

static void bad_with(enum kr_oai_kind k, const char *extra, const char *param)
{
    char body[8192];
    snprintf(body, sizeof body, "{%s,%s}", k == KR_OAI_CHAT ? USER_MSG : "\"prompt\":\"hi\"", extra);
    bad_body(k, body, param, NULL, 0);
}

static json_t *load(const char *s)
{
    cr_assert_not_null(s, "encoder returned NULL");
    json_error_t je;
    json_t *j = json_loads(s, 0, &je);
    cr_assert_not_null(j, "invalid JSON (%s): %s", je.text, s);
    return j;
}

/* An SSE event: "data: " + one line of JSON + a blank line. */
static json_t *load_sse(const char *s)
{
    cr_assert_not_null(s, "encoder returned NULL");
    size_t n = strlen(s);
    cr_assert(n > 8 && strncmp(s, "data: ", 6) == 0, "no 'data: ' prefix: %s", s);
    cr_assert(s[n - 1] == '\n' && s[n - 2] == '\n', "not terminated by a blank line: %s", s);
    cr_assert_null(memchr(s, '\n', n - 2), "the JSON spans several lines: %s", s);
    json_error_t je;
    json_t *j = json_loadb(s + 6, n - 8, 0, &je);
    cr_assert_not_null(j, "invalid JSON (%s): %s", je.text, s);
    return j;
}

/* Walks "a.b.0.c" (numbers index arrays); NULL when a step is missing. */
static json_t *jget(json_t *j, const char *path)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", path);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ".", &save); tok && j; tok = strtok_r(NULL, ".", &save)) {
        if (json_is_array(j)) {
            j = json_array_get(j, (size_t)strtoul(tok, NULL, 10));
        } else {
            j = json_object_get(j, tok);
        }
    }
    return j;
}

static const char *jgets(json_t *j, const char *path)
{
    json_t *v = jget(j, path);
    cr_assert(json_is_string(v), "%s is not a string", path);
    return json_string_value(v);
}

static long long jgeti(json_t *j, const char *path)
{
    json_t *v = jget(j, path);
    cr_assert(json_is_integer(v), "%s is not an integer", path);
    return (long long)json_integer_value(v);
}

static void expect_null(json_t *j, const char *path)
{
    json_t *v = jget(j, path);
    cr_expect(v && json_is_null(v), "%s should be present and null", path);
}

/* The object at `path` has exactly the keys `keys` (NULL-terminated). */
static void expect_keys(json_t *j, const char *path, const char *const *keys)
{
    json_t *o = *path ? jget(j, path) : j;
    cr_assert(json_is_object(o), "'%s' is not an object", path);
    size_t n = 0;
    for (; keys[n]; n++) {
        cr_expect_not_null(json_object_get(o, keys[n]), "'%s' lacks key '%s'", path, keys[n]);
    }
    cr_expect_eq(json_object_size(o), n, "'%s' has %zu keys, expected %zu", path, json_object_size(o), n);
}

/* The float a logprob re-parses to equals the float32 we encoded (round trip). */
static void expect_logprob(json_t *j, const char *path, float want)
{
    json_t *v = jget(j, path);
    cr_assert(json_is_number(v), "%s is not a number", path);
    cr_expect_eq((float)json_number_value(v), want, "%s: %.9g != %.9g", path, json_number_value(v),
                 (double)want);
}

static struct kr_oai_token tok(const char *text, float lp)
{
    struct kr_oai_token t = {.text = text, .text_len = strlen(text), .logprob = lp};
    return t;
}

/* ---- parsing: defaults and every field ------------------------------------------------------- */

Test(openai, completions_defaults_follow_openai)
{
    struct kr_oai_request r;
    ok_body(KR_OAI_COMPLETIONS, "{\"prompt\":\"Hello\"}", &r);
    cr_expect_eq(r.kind, KR_OAI_COMPLETIONS);
    cr_expect_null(r.model);
    cr_expect_eq(r.n_prompts, 1);
    cr_expect_str_eq(r.prompts[0].text, "Hello");
    cr_expect_eq(r.prompts[0].text_len, 5);
    cr_expect_null(r.prompts[0].ids);
    cr_expect_eq(r.n, 1);
    cr_expect_not(r.stream);
    cr_expect_not(r.include_usage);
    cr_expect_not(r.echo);
    cr_expect_not(r.max_tokens_given);
    cr_expect_eq(r.sampling.max_tokens, 16); /* OpenAI's completions default */
    cr_expect_eq(r.sampling.temperature, 1.0f);
    cr_expect_eq(r.sampling.top_p, 1.0f);
    cr_expect_eq(r.sampling.top_k, 0);
    cr_expect_eq(r.sampling.min_p, 0.0f);
    cr_expect_eq(r.sampling.repetition_penalty, 1.0f);
    cr_expect_eq(r.sampling.logprobs, -1);
    cr_expect_eq(r.sampling.prompt_logprobs, -1);
    cr_expect_not(r.sampling.has_seed);
    cr_expect_eq(r.sampling.n_stop_ids, 0);
    cr_expect_eq(r.n_stop, 0);
    cr_expect(r.skip_special_tokens);
    cr_expect_not(r.return_token_ids);
    cr_expect_null(r.user);
    kr_oai_request_free(&r);
}

Test(openai, chat_defaults_follow_openai_and_vllm)
{
    struct kr_oai_request r;
    ok_body(KR_OAI_CHAT, "{" USER_MSG "}", &r);
    cr_expect_eq(r.kind, KR_OAI_CHAT);
    cr_assert(json_is_array(r.messages));
    cr_expect_eq(json_array_size(r.messages), 1);
    cr_expect_null(r.tools);
    cr_expect_null(r.chat_template_kwargs);
    cr_expect(r.add_generation_prompt);
    cr_expect_not(r.continue_final_message);
    cr_expect_not(r.max_tokens_given); /* the server fills the rest of the context */
    cr_expect_eq(r.sampling.logprobs, -1);
    cr_expect_eq(r.n_prompts, 0);
    kr_oai_request_free(&r);
}

Test(openai, completions_parses_every_field)
{
    struct kr_oai_request r;
    ok_body(KR_OAI_COMPLETIONS,
            "{\"model\":\"m1\",\"prompt\":[\"a\",\"bc\"],\"max_tokens\":7,\"temperature\":0.5,\"top_p\":0.9,"
            "\"top_k\":40,\"min_p\":0.05,\"presence_penalty\":-1.5,\"frequency_penalty\":2,"
            "\"repetition_penalty\":1.1,\"seed\":42,\"stop\":[\"\\n\",\"END\"],\"stop_token_ids\":[2,7],"
            "\"n\":3,\"logprobs\":5,\"prompt_logprobs\":0,\"echo\":true,\"stream\":true,"
            "\"stream_options\":{\"include_usage\":true},\"ignore_eos\":true,\"min_tokens\":3,"
            "\"skip_special_tokens\":false,\"return_token_ids\":true,\"user\":\"u-1\",\"unknown_field\":{"
            "\"x\":1}}",
            &r);
    cr_expect_str_eq(r.model, "m1");
    cr_assert_eq(r.n_prompts, 2);
    cr_expect_str_eq(r.prompts[0].text, "a");
    cr_expect_str_eq(r.prompts[1].text, "bc");
    cr_expect_eq(r.prompts[1].text_len, 2);
    cr_expect(r.max_tokens_given);
    cr_expect_eq(r.sampling.max_tokens, 7);
    cr_expect_eq(r.sampling.temperature, 0.5f);
    cr_expect_eq(r.sampling.top_p, 0.9f);
    cr_expect_eq(r.sampling.top_k, 40);
    cr_expect_eq(r.sampling.min_p, 0.05f);
    cr_expect_eq(r.sampling.presence_penalty, -1.5f);
    cr_expect_eq(r.sampling.frequency_penalty, 2.0f);
    cr_expect_eq(r.sampling.repetition_penalty, 1.1f);
    cr_expect(r.sampling.has_seed);
    cr_expect_eq(r.sampling.seed, 42u);
    cr_assert_eq(r.n_stop, 2);
    cr_expect_str_eq(r.stop[0], "\n");
    cr_expect_str_eq(r.stop[1], "END");
    cr_assert_eq(r.sampling.n_stop_ids, 2);
    cr_expect_eq(r.sampling.stop_ids[0], 2);
    cr_expect_eq(r.sampling.stop_ids[1], 7);
    cr_expect_eq(r.n, 3);
    cr_expect_eq(r.sampling.logprobs, 5);
    cr_expect_eq(r.sampling.prompt_logprobs, 0, "0 is allowed with stream (vLLM rejects > 0 only)");
    cr_expect(r.echo);
    cr_expect(r.stream);
    cr_expect(r.include_usage);
    cr_expect(r.sampling.ignore_eos);
    cr_expect_eq(r.sampling.min_tokens, 3);
    cr_expect_not(r.skip_special_tokens);
    cr_expect(r.return_token_ids);
    cr_expect_str_eq(r.user, "u-1");
    kr_oai_request_free(&r);
}

Test(openai, chat_parses_every_field)
{
    struct kr_oai_request r;
    ok_body(
        KR_OAI_CHAT,
        "{\"model\":\"m\",\"messages\":["
        "{\"role\":\"system\",\"content\":\"be brief\"},"
        "{\"role\":\"developer\",\"content\":[{\"type\":\"text\",\"text\":\"dev\"}]},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":"
        "\"b\"}],"
        "\"name\":\"bob\"},"
        "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\","
        "\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},"
        "{\"role\":\"tool\",\"content\":\"42\",\"tool_call_id\":\"c1\"},"
        "{\"role\":\"assistant\",\"content\":\"The answer\"}],"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"description\":\"d\","
        "\"parameters\":{\"type\":\"object\"}}}],\"tool_choice\":\"auto\","
        "\"max_completion_tokens\":9,\"logprobs\":true,\"top_logprobs\":3,\"continue_final_message\":true,"
        "\"chat_template_kwargs\":{\"enable_thinking\":false},\"seed\":-1,\"top_k\":-1}",
        &r);
    cr_expect_str_eq(r.model, "m");
    cr_expect_eq(json_array_size(r.messages), 6);
    cr_assert_not_null(r.tools);
    cr_expect_eq(json_array_size(r.tools), 1);
    cr_expect(r.max_tokens_given);
    cr_expect_eq(r.sampling.max_tokens, 9);
    cr_expect_eq(r.sampling.logprobs, 3);
    cr_expect(r.continue_final_message);
    cr_expect_not(r.add_generation_prompt, "continue_final_message implies no generation prompt");
    cr_assert_not_null(r.chat_template_kwargs);
    cr_expect(json_is_false(json_object_get(r.chat_template_kwargs, "enable_thinking")));
    cr_expect(r.sampling.has_seed);
    cr_expect_eq(r.sampling.seed, UINT64_MAX, "seed -1 is stored as two's complement");
    cr_expect_eq(r.sampling.top_k, -1);
    kr_oai_request_free(&r);
}

Test(openai, max_completion_tokens_wins_over_max_tokens)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_CHAT, "\"max_tokens\":100,\"max_completion_tokens\":5", &r);
    cr_expect_eq(r.sampling.max_tokens, 5);
    cr_expect(r.max_tokens_given);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"max_tokens\":100", &r);
    cr_expect_eq(r.sampling.max_tokens, 100);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_COMPLETIONS, "\"max_completion_tokens\":3,\"max_tokens\":50", &r);
    cr_expect_eq(r.sampling.max_tokens, 3);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"max_tokens\":null", &r);
    cr_expect_not(r.max_tokens_given);
    kr_oai_request_free(&r);
}

Test(openai, huge_max_tokens_is_clamped_for_the_server_to_cap)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_COMPLETIONS, "\"max_tokens\":99999999999", &r);
    cr_expect_eq(r.sampling.max_tokens, INT32_MAX);
    kr_oai_request_free(&r);
}

Test(openai, null_means_absent)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_CHAT,
            "\"model\":null,\"temperature\":null,\"top_p\":null,\"top_k\":null,\"seed\":null,\"stop\":null,"
            "\"n\":null,\"logprobs\":null,\"top_logprobs\":null,\"stream\":null,\"stream_options\":null,"
            "\"tools\":null,\"tool_choice\":null,\"user\":null,\"chat_template_kwargs\":null,\"stop_token_"
            "ids\":null",
            &r);
    cr_expect_null(r.model);
    cr_expect_eq(r.sampling.temperature, 1.0f);
    cr_expect_eq(r.n, 1);
    cr_expect_eq(r.sampling.logprobs, -1);
    cr_expect_not(r.sampling.has_seed);
    cr_expect_null(r.tools);
    kr_oai_request_free(&r);
}

Test(openai, integers_are_numbers_and_integral_reals_are_integers)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_COMPLETIONS,
            "\"temperature\":0,\"top_p\":1,\"repetition_penalty\":2,\"max_tokens\":5.0,\"n\":2.0", &r);
    cr_expect_eq(r.sampling.temperature, 0.0f);
    cr_expect_eq(r.sampling.top_p, 1.0f);
    cr_expect_eq(r.sampling.repetition_penalty, 2.0f);
    cr_expect_eq(r.sampling.max_tokens, 5);
    cr_expect_eq(r.n, 2);
    kr_oai_request_free(&r);
}

Test(openai, range_bounds_are_inclusive_where_openai_says_so)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_COMPLETIONS,
            "\"temperature\":2,\"min_p\":1,\"presence_penalty\":-2,\"frequency_penalty\":-2,\"n\":128,"
            "\"logprobs\":20,"
            "\"top_k\":0,\"min_tokens\":0,\"prompt_logprobs\":0",
            &r);
    cr_expect_eq(r.sampling.temperature, 2.0f);
    cr_expect_eq(r.n, 128);
    cr_expect_eq(r.sampling.logprobs, 20);
    cr_expect_eq(r.sampling.prompt_logprobs, 0);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"logprobs\":true,\"top_logprobs\":20", &r);
    cr_expect_eq(r.sampling.logprobs, 20);
    kr_oai_request_free(&r);
}

Test(openai, chat_logprobs_without_top_logprobs_is_zero)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_CHAT, "\"logprobs\":true", &r);
    cr_expect_eq(r.sampling.logprobs, 0);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"logprobs\":false", &r);
    cr_expect_eq(r.sampling.logprobs, -1);
    kr_oai_request_free(&r);
}

Test(openai, echo_with_logprobs_requests_prompt_logprobs)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_COMPLETIONS, "\"echo\":true,\"logprobs\":2", &r);
    cr_expect_eq(r.sampling.prompt_logprobs, 2, "vLLM: prompt_logprobs defaults to logprobs with echo");
    kr_oai_request_free(&r);
    ok_with(KR_OAI_COMPLETIONS, "\"echo\":true", &r);
    cr_expect_eq(r.sampling.prompt_logprobs, -1);
    kr_oai_request_free(&r);
}

Test(openai, stream_options_include_usage)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_CHAT, "\"stream\":true,\"stream_options\":{\"include_usage\":true}", &r);
    cr_expect(r.stream);
    cr_expect(r.include_usage);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"stream\":true,\"stream_options\":{}", &r);
    cr_expect_not(r.include_usage, "OpenAI: include_usage defaults to false");
    kr_oai_request_free(&r);
}

Test(openai, prompt_forms)
{
    struct kr_oai_request r;
    ok_body(KR_OAI_COMPLETIONS, "{\"prompt\":\"\"}", &r);
    cr_assert_eq(r.n_prompts, 1);
    cr_expect_eq(r.prompts[0].text_len, 0);
    cr_expect_str_eq(r.prompts[0].text, "");
    kr_oai_request_free(&r);

    ok_body(KR_OAI_COMPLETIONS, "{\"prompt\":[1,2,3]}", &r);
    cr_assert_eq(r.n_prompts, 1);
    cr_expect_null(r.prompts[0].text);
    cr_assert_eq(r.prompts[0].n_ids, 3);
    cr_expect_eq(r.prompts[0].ids[0], 1);
    cr_expect_eq(r.prompts[0].ids[2], 3);
    kr_oai_request_free(&r);

    ok_body(KR_OAI_COMPLETIONS, "{\"prompt\":[[5],[6,7]]}", &r);
    cr_assert_eq(r.n_prompts, 2);
    cr_expect_eq(r.prompts[0].n_ids, 1);
    cr_expect_eq(r.prompts[0].ids[0], 5);
    cr_expect_eq(r.prompts[1].n_ids, 2);
    cr_expect_eq(r.prompts[1].ids[1], 7);
    kr_oai_request_free(&r);

    ok_body(KR_OAI_COMPLETIONS, "{\"prompt\":[\"x\",\"\"]}", &r);
    cr_assert_eq(r.n_prompts, 2);
    cr_expect_eq(r.prompts[1].text_len, 0);
    kr_oai_request_free(&r);

    /* "\u0000" is valid JSON: the text keeps it and its length */
    ok_body(KR_OAI_COMPLETIONS, "{\"prompt\":\"a\\u0000b\"}", &r);
    cr_expect_eq(r.prompts[0].text_len, 3);
    cr_expect_eq(memcmp(r.prompts[0].text, "a\0b", 3), 0);
    kr_oai_request_free(&r);
}

Test(openai, single_stop_string)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_COMPLETIONS, "\"stop\":\"###\"", &r);
    cr_assert_eq(r.n_stop, 1);
    cr_expect_str_eq(r.stop[0], "###");
    kr_oai_request_free(&r);
    ok_with(
        KR_OAI_COMPLETIONS,
        "\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\",\"12\",\"13\",\"14\","
        "\"15\",\"16\"]",
        &r);
    cr_expect_eq(r.n_stop, 16);
    cr_expect_str_eq(r.stop[15], "16");
    kr_oai_request_free(&r);
}

Test(openai, tool_choice_forms_are_accepted)
{
    static const char *const ok[] = {
        "\"tool_choice\":\"none\"",
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"required\"",
        ("\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
         "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"f\"}}"),
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        struct kr_oai_request r;
        ok_with(KR_OAI_CHAT, ok[i], &r);
        kr_oai_request_free(&r);
    }
    /* a call cannot be required, or a function named, without tools (OpenAI answers 400 too) */
    bad_with(KR_OAI_CHAT, "\"tool_choice\":\"required\"", "tool_choice");
    bad_with(KR_OAI_CHAT, "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"f\"}}",
             "tool_choice.function.name");
}

/* ---- parsing: errors ------------------------------------------------------------------------- */

Test(openai, malformed_json_names_the_position)
{
    char msg[1024];
    bad_body(KR_OAI_CHAT, "{\"messages\": [}", "", msg, sizeof msg);
    cr_expect(strncmp(msg, "malformed JSON: ", 16) == 0, "%s", msg);
    cr_expect_not_null(strstr(msg, " at line 1 column "), "%s", msg);
    bad_body(KR_OAI_CHAT, "{\n\"a\": 1,\n\"b\" 2}", "", msg, sizeof msg);
    cr_expect_not_null(strstr(msg, "at line 3 column"), "%s", msg);
    bad_body(KR_OAI_CHAT, "", "", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":\"a\"} trailing", "", NULL, 0);
}

Test(openai, body_must_be_an_object)
{
    bad_body(KR_OAI_CHAT, "[]", "", NULL, 0);
    bad_body(KR_OAI_CHAT, "5", "", NULL, 0);
    bad_body(KR_OAI_CHAT, "null", "", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "\"prompt\"", "", NULL, 0);
}

Test(openai, null_body_pointer_is_an_error_not_a_crash)
{
    struct kr_oai_request r;
    struct kr_oai_error e;
    cr_expect_eq(kr_oai_parse(KR_OAI_CHAT, NULL, 0, &r, &e), KR_ERR_INVAL);
    cr_expect_eq(e.http_status, 400);
}

Test(openai, numeric_fields_reject_booleans_and_strings)
{
    static const char *const floats[] = {
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"};
    for (size_t i = 0; i < sizeof floats / sizeof floats[0]; i++) {
        char extra[128], want[128], msg[1024], body[256];
        snprintf(extra, sizeof extra, "\"%s\":true", floats[i]);
        bad_with(KR_OAI_CHAT, extra, floats[i]);
        snprintf(body, sizeof body, "{" USER_MSG ",\"%s\":\"0.5\"}", floats[i]);
        bad_body(KR_OAI_CHAT, body, floats[i], msg, sizeof msg);
        snprintf(want, sizeof want, "'%s' must be a number", floats[i]);
        cr_expect_str_eq(msg, want);
    }
    static const char *const ints[] = {"max_tokens", "max_completion_tokens", "n",       "seed", "top_k",
                                       "min_tokens", "prompt_logprobs",       "logprobs"};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        char extra[128];
        snprintf(extra, sizeof extra, "\"%s\":false", ints[i]);
        bad_with(KR_OAI_COMPLETIONS, extra, ints[i]);
        snprintf(extra, sizeof extra, "\"%s\":\"3\"", ints[i]);
        bad_with(KR_OAI_COMPLETIONS, extra, ints[i]);
        snprintf(extra, sizeof extra, "\"%s\":1.5", ints[i]);
        bad_with(KR_OAI_COMPLETIONS, extra, ints[i]);
    }
}

Test(openai, boolean_and_string_fields_are_type_checked)
{
    static const char *const bools[] = {"stream",
                                        "ignore_eos",
                                        "skip_special_tokens",
                                        "return_token_ids",
                                        "add_generation_prompt",
                                        "continue_final_message"};
    for (size_t i = 0; i < sizeof bools / sizeof bools[0]; i++) {
        char extra[128];
        snprintf(extra, sizeof extra, "\"%s\":1", bools[i]);
        bad_with(KR_OAI_CHAT, extra, bools[i]);
        snprintf(extra, sizeof extra, "\"%s\":\"true\"", bools[i]);
        bad_with(KR_OAI_CHAT, extra, bools[i]);
    }
    bad_with(KR_OAI_COMPLETIONS, "\"echo\":1", "echo");
    bad_with(KR_OAI_CHAT, "\"logprobs\":1", "logprobs");
    bad_with(KR_OAI_CHAT, "\"model\":5", "model");
    bad_with(KR_OAI_CHAT, "\"user\":{}", "user");
    bad_with(KR_OAI_CHAT, "\"chat_template_kwargs\":[]", "chat_template_kwargs");
    bad_with(KR_OAI_CHAT, "\"stream\":true,\"stream_options\":5", "stream_options");
    bad_with(KR_OAI_CHAT, "\"stream\":true,\"stream_options\":{\"include_usage\":\"yes\"}",
             "stream_options.include_usage");
}

Test(openai, out_of_range_values_name_their_field)
{
    static const struct {
        const char *extra, *param;
    } cases[] = {
        {"\"temperature\":2.0001", "temperature"},
        {"\"temperature\":-0.1", "temperature"},
        {"\"top_p\":0", "top_p"},
        {"\"top_p\":1.5", "top_p"},
        {"\"min_p\":1.1", "min_p"},
        {"\"min_p\":-0.1", "min_p"},
        {"\"presence_penalty\":2.1", "presence_penalty"},
        {"\"frequency_penalty\":-2.1", "frequency_penalty"},
        {"\"repetition_penalty\":0", "repetition_penalty"},
        {"\"repetition_penalty\":-1", "repetition_penalty"},
        {"\"top_k\":-2", "top_k"},
        {"\"top_k\":3000000000", "top_k"},
        {"\"n\":0", "n"},
        {"\"n\":129", "n"},
        {"\"max_tokens\":0", "max_tokens"},
        {"\"max_tokens\":-5", "max_tokens"},
        {"\"max_completion_tokens\":0", "max_completion_tokens"},
        {"\"min_tokens\":-1", "min_tokens"},
        {"\"max_tokens\":4,\"min_tokens\":5", "min_tokens"},
        {"\"logprobs\":21", "logprobs"},
        {"\"logprobs\":-1", "logprobs"},
        {"\"prompt_logprobs\":21", "prompt_logprobs"},
        {"\"prompt_logprobs\":-1", "prompt_logprobs"},
        {"\"stream\":true,\"prompt_logprobs\":1", "prompt_logprobs"},
        {"\"seed\":1e30", "seed"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bad_with(KR_OAI_COMPLETIONS, cases[i].extra, cases[i].param);
    }
    bad_with(KR_OAI_CHAT, "\"top_logprobs\":21,\"logprobs\":true", "top_logprobs");
    bad_with(KR_OAI_CHAT, "\"top_logprobs\":-1,\"logprobs\":true", "top_logprobs");
}

Test(openai, top_logprobs_requires_logprobs_true)
{
    bad_with(KR_OAI_CHAT, "\"top_logprobs\":2", "top_logprobs");
    bad_with(KR_OAI_CHAT, "\"top_logprobs\":2,\"logprobs\":false", "top_logprobs");
}

Test(openai, stream_options_require_stream)
{
    char msg[1024];
    bad_body(KR_OAI_CHAT, "{" USER_MSG ",\"stream_options\":{\"include_usage\":true}}", "stream_options", msg,
             sizeof msg);
    /* OpenAI's own wording */
    cr_expect_str_eq(msg, "The 'stream_options' parameter is only allowed when 'stream' is enabled.");
    bad_with(KR_OAI_COMPLETIONS, "\"stream\":false,\"stream_options\":{}", "stream_options");
}

Test(openai, stop_errors)
{
    bad_with(KR_OAI_COMPLETIONS, "\"stop\":5", "stop");
    bad_with(KR_OAI_COMPLETIONS, "\"stop\":\"\"", "stop");
    bad_with(KR_OAI_COMPLETIONS, "\"stop\":[\"a\",\"\"]", "stop[1]");
    bad_with(KR_OAI_COMPLETIONS, "\"stop\":[\"a\",7]", "stop[1]");
    bad_with(KR_OAI_COMPLETIONS, "\"stop\":[\"a\\u0000b\"]", "stop[0]");
    bad_with(
        KR_OAI_COMPLETIONS,
        "\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\",\"12\",\"13\",\"14\","
        "\"15\",\"16\",\"17\"]",
        "stop");
}

Test(openai, stop_token_id_errors)
{
    bad_with(KR_OAI_COMPLETIONS, "\"stop_token_ids\":5", "stop_token_ids");
    bad_with(KR_OAI_COMPLETIONS, "\"stop_token_ids\":[1,-1]", "stop_token_ids[1]");
    bad_with(KR_OAI_COMPLETIONS, "\"stop_token_ids\":[\"a\"]", "stop_token_ids[0]");
    bad_with(KR_OAI_COMPLETIONS, "\"stop_token_ids\":[1,2.5]", "stop_token_ids[1]");
    char extra[1024] = "\"stop_token_ids\":[";
    for (int i = 0; i <= KR_MAX_STOP_IDS; i++) {
        char num[16];
        snprintf(num, sizeof num, "%s%d", i ? "," : "", i);
        strcat(extra, num);
    }
    strcat(extra, "]");
    bad_with(KR_OAI_COMPLETIONS, extra, "stop_token_ids");
}

Test(openai, prompt_errors)
{
    bad_body(KR_OAI_COMPLETIONS, "{}", "prompt", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":null}", "prompt", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":5}", "prompt", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":true}", "prompt", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":{}}", "prompt", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":[]}", "prompt", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":[[]]}", "prompt[0]", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":[[1],[]]}", "prompt[1]", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":[\"a\",\"b\",3]}", "prompt[2]", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":[1,\"a\"]}", "prompt[1]", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":[1,-2]}", "prompt[1]", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":[1,2.0]}", "prompt[1]", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":[1,4294967296]}", "prompt[1]", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":[[1],[2,\"x\"]]}", "prompt[1][1]", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":[[1],\"x\"]}", "prompt[1]", NULL, 0);
    bad_body(KR_OAI_COMPLETIONS, "{\"prompt\":[null]}", "prompt[0]", NULL, 0);
}

Test(openai, message_errors)
{
    static const struct {
        const char *body, *param;
    } cases[] = {
        {"{}", "messages"},
        {"{\"messages\":null}", "messages"},
        {"{\"messages\":{}}", "messages"},
        {"{\"messages\":[]}", "messages"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},5]}", "messages[1]"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"content\":\"b\"}]}", "messages[1].role"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"robot\",\"content\":\"b\"}]}",
         "messages[1].role"},
        {"{\"messages\":[{\"role\":\"function\",\"content\":\"b\"}]}", "messages[0].role"},
        {"{\"messages\":[{\"role\":7,\"content\":\"b\"}]}", "messages[0].role"},
        {"{\"messages\":[{\"role\":\"user\"}]}", "messages[0].content"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":null}]}", "messages[0].content"},
        {"{\"messages\":[{\"role\":\"system\",\"content\":5}]}", "messages[0].content"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[5]}]}", "messages[0].content[0]"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"text\":\"b\"}]"
         "}]}",
         "messages[0].content[1].type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]}",
         "messages[0].content[0].type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}",
         "messages[0].content[0].text"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":3}]}]}",
         "messages[0].content[0].text"},
        {"{\"messages\":[{\"role\":\"tool\",\"content\":\"x\",\"tool_call_id\":5}]}",
         "messages[0].tool_call_id"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"name\":[]}]}", "messages[0].name"},
        {"{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":{}}]}", "messages[0].tool_calls"},
        {"{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"a\"}]}]}",
         "messages[0].tool_calls[0].function"},
        {"{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"arguments\":\"{}\"}}]}]}",
         "messages[0].tool_calls[0].function.name"},
        {"{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":"
         "3}}]}]}",
         "messages[0].tool_calls[0].function.arguments"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bad_body(KR_OAI_CHAT, cases[i].body, cases[i].param, NULL, 0);
    }
}

Test(openai, unknown_role_message_lists_the_roles)
{
    char msg[1024];
    bad_body(KR_OAI_CHAT, "{\"messages\":[{\"role\":\"robot\",\"content\":\"b\"}]}", "messages[0].role", msg,
             sizeof msg);
    cr_expect_not_null(strstr(msg, "'robot'"), "%s", msg);
    cr_expect_not_null(strstr(msg, "'developer'"), "%s", msg);
}

Test(openai, tool_errors)
{
    bad_with(KR_OAI_CHAT, "\"tools\":{}", "tools");
    bad_with(KR_OAI_CHAT, "\"tools\":[5]", "tools[0]");
    bad_with(KR_OAI_CHAT, "\"tools\":[{\"type\":\"function\"}]", "tools[0].function");
    bad_with(KR_OAI_CHAT, "\"tools\":[{\"function\":{\"name\":\"f\"}},{\"function\":{}}]",
             "tools[1].function.name");
    bad_with(KR_OAI_CHAT, "\"tools\":[{\"function\":{\"name\":\"f\",\"parameters\":[]}}]",
             "tools[0].function.parameters");
    bad_with(KR_OAI_CHAT, "\"tool_choice\":\"sometimes\"", "tool_choice");
    bad_with(KR_OAI_CHAT, "\"tool_choice\":5", "tool_choice");
    bad_with(KR_OAI_CHAT, "\"tool_choice\":{\"type\":\"function\"}", "tool_choice.function");
    bad_with(KR_OAI_CHAT, "\"tool_choice\":{\"function\":{\"name\":1}}", "tool_choice.function.name");
}

Test(openai, continue_final_message_conflicts_with_explicit_generation_prompt)
{
    bad_with(KR_OAI_CHAT, "\"continue_final_message\":true,\"add_generation_prompt\":true",
             "continue_final_message");
    struct kr_oai_request r;
    ok_with(KR_OAI_CHAT, "\"continue_final_message\":true,\"add_generation_prompt\":false", &r);
    cr_expect_not(r.add_generation_prompt);
    kr_oai_request_free(&r);
}

/* ---- parsing: hostile input ------------------------------------------------------------------ */

static void expect_no_crash(enum kr_oai_kind k, const char *body, size_t len)
{
    struct kr_oai_request r;
    struct kr_oai_error e;
    enum kr_status st = kr_oai_parse(k, body, len, &r, &e);
    cr_expect(st == KR_OK || st == KR_ERR_INVAL, "status %d", st);
    if (st == KR_OK) {
        kr_oai_request_free(&r);
    } else {
        cr_expect_eq(e.http_status, 400);
        char *j = kr_oai_error_json(&e);
        cr_assert_not_null(j, "error JSON failed for: %s", e.message);
        json_t *p = load(j);
        json_decref(p);
        free(j);
    }
}

Test(openai, deep_nesting_is_rejected_without_overflow)
{
    size_t n = 200000;
    char *body = malloc(n * 2 + 64);
    cr_assert_not_null(body);
    size_t k = (size_t)sprintf(body, "{\"prompt\":\"a\",\"x\":");
    memset(body + k, '[', n);
    memset(body + k + n, ']', n);
    body[k + 2 * n] = '}';
    expect_no_crash(KR_OAI_COMPLETIONS, body, k + 2 * n + 1);
    /* nested inside a field we walk */
    k = (size_t)sprintf(body, "{\"messages\":");
    memset(body + k, '[', n);
    expect_no_crash(KR_OAI_CHAT, body, k + n);
    free(body);
}

Test(openai, huge_and_special_numbers)
{
    static const char *const bodies[] = {
        "{\"prompt\":\"a\",\"temperature\":1e999}",
        "{\"prompt\":\"a\",\"temperature\":-1e999}",
        "{\"prompt\":\"a\",\"max_tokens\":99999999999999999999999}",
        "{\"prompt\":\"a\",\"temperature\":NaN}",
        "{\"prompt\":\"a\",\"temperature\":Infinity}",
        "{\"prompt\":\"a\",\"seed\":-9223372036854775808}",
        "{\"prompt\":\"a\",\"seed\":9223372036854775807}",
        "{\"prompt\":\"a\",\"max_tokens\":1e300}",
        "{\"prompt\":\"a\",\"n\":-0.0}",
        "{\"prompt\":\"a\",\"top_k\":-9223372036854775808}",
        "{\"prompt\":[9223372036854775807]}",
    };
    for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
        expect_no_crash(KR_OAI_COMPLETIONS, bodies[i], strlen(bodies[i]));
    }
    struct kr_oai_request r;
    ok_body(KR_OAI_COMPLETIONS, "{\"prompt\":\"a\",\"seed\":-9223372036854775808}", &r);
    cr_expect_eq(r.sampling.seed, 0x8000000000000000ull);
    kr_oai_request_free(&r);
}

Test(openai, invalid_utf8_bodies_are_rejected)
{
    static const char body[] = "{\"prompt\":\"a\xff\xfe\"}";
    char msg[1024];
    bad_body(KR_OAI_COMPLETIONS, body, "", msg, sizeof msg);
    /* the message quotes the bad bytes, yet the error JSON stays valid */
    struct kr_oai_error e;
    kr_oai_error(&e, KR_OAI_INVALID, "", "%s", msg);
    char *j = kr_oai_error_json(&e);
    json_t *p = load(j);
    json_decref(p);
    free(j);
    static const char body2[] = "{\"messages\":[{\"role\":\"us\xc0\xafr\",\"content\":\"x\"}]}";
    expect_no_crash(KR_OAI_CHAT, body2, sizeof body2 - 1);
}

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

Test(openai, mutated_and_truncated_bodies_never_crash)
{
    static const char *const seeds[2] = {
        "{\"model\":\"m\",\"prompt\":[[1,2],[3]],\"max_tokens\":7,\"temperature\":0.5,\"stop\":[\"a\",\"b\"],"
        "\"logprobs\":3,\"echo\":true,\"stream\":true,\"stream_options\":{\"include_usage\":true},"
        "\"stop_token_ids\":[1,2],\"seed\":-3,\"n\":2}",
        "{\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\",\"content\":[{\"type\":"
        "\"text\","
        "\"text\":\"t\"}]},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c\","
        "\"function\":"
        "{\"name\":\"f\",\"arguments\":\"{}\"}}]},{\"role\":\"tool\",\"content\":\"r\",\"tool_call_id\":"
        "\"c\"}],"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{}}}],\"logprobs\":"
        "true,"
        "\"top_logprobs\":2,\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"f\"}}}",
    };
    static const char alphabet[] = "{}[]\",:0123456789-.eEtruefalsn \\u\xff\x80\xc3";
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (int kind = 0; kind < 2; kind++) {
        const char *seed = seeds[kind];
        size_t n = strlen(seed);
        enum kr_oai_kind k = kind ? KR_OAI_CHAT : KR_OAI_COMPLETIONS;
        struct kr_oai_request r;
        ok_body(k, seed, &r); /* the seeds themselves are valid */
        kr_oai_request_free(&r);
        for (size_t cut = 0; cut < n; cut++) {
            expect_no_crash(k, seed, cut);
        }
        char buf[1024];
        for (int it = 0; it < 4000; it++) {
            memcpy(buf, seed, n);
            int edits = 1 + (int)(rng_next(&s) % 4);
            for (int m = 0; m < edits; m++) {
                buf[rng_next(&s) % n] = alphabet[rng_next(&s) % (sizeof alphabet - 1)];
            }
            expect_no_crash(k, buf, n);
        }
    }
}

Test(openai, parse_survives_every_allocation_failure)
{
    static const char *const bodies[2] = {
        "{\"prompt\":[[1,2],[3],[4,5,6]],\"stop\":[\"a\",\"bb\",\"ccc\"]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stop\":[\"a\",\"b\"]}",
    };
    for (int kind = 0; kind < 2; kind++) {
        enum kr_oai_kind k = kind ? KR_OAI_CHAT : KR_OAI_COMPLETIONS;
        bool done = false;
        for (uint64_t n = 1; n < 100 && !done; n++) {
            struct kr_oai_request r;
            struct kr_oai_error e;
            kr_alloc_fail_at(n, 0);
            enum kr_status st = kr_oai_parse(k, bodies[kind], strlen(bodies[kind]), &r, &e);
            kr_alloc_fail_at(0, 0);
            if (st == KR_OK) {
                kr_oai_request_free(&r);
                done = true;
            } else {
                cr_expect_eq(st, KR_ERR_NOMEM, "fail at %llu: status %d", (unsigned long long)n, st);
                cr_expect_eq(e.http_status, 500);
            }
            cr_expect_eq(kr_alloc_bytes_in_use(), g_base, "leak after failing allocation %llu",
                         (unsigned long long)n);
        }
        cr_expect(done, "never succeeded");
    }
}

/* ---- errors ---------------------------------------------------------------------------------- */

Test(openai, error_json_has_openai_shape)
{
    struct kr_oai_error e;
    enum kr_status st = kr_oai_error(&e, KR_OAI_INVALID, "messages[1].role", "Invalid value: '%s'", "robot");
    cr_expect_eq(st, KR_ERR_INVAL);
    cr_expect_eq(e.http_status, 400);
    char *s = kr_oai_error_json(&e);
    json_t *j = load(s);
    static const char *const top[] = {"error", NULL};
    static const char *const inner[] = {"message", "type", "param", "code", NULL};
    expect_keys(j, "", top);
    expect_keys(j, "error", inner);
    cr_expect_str_eq(jgets(j, "error.message"), "Invalid value: 'robot'");
    cr_expect_str_eq(jgets(j, "error.type"), "invalid_request_error");
    cr_expect_str_eq(jgets(j, "error.param"), "messages[1].role");
    expect_null(j, "error.code");
    json_decref(j);
    free(s);

    kr_oai_error(&e, KR_OAI_TOO_LONG, "", "too long");
    s = kr_oai_error_json(&e);
    j = load(s);
    expect_null(j, "error.param");
    cr_expect_str_eq(jgets(j, "error.code"), "context_length_exceeded");
    json_decref(j);
    free(s);
}

/* The statuses, types and codes clients act on, from OpenAI's API reference and error codes guide,
 * vLLM's server and RFC 9110 (not from krait's table): the OpenAI SDKs pick their exception class
 * from the status (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 429
 * RateLimitError, >= 500 InternalServerError) and retry 429 and 5xx. */
static void expect_cause(enum kr_oai_cause cause, int status, const char *type, const char *code)
{
    struct kr_oai_error e;
    memset(&e, 0x5a, sizeof e);
    cr_expect_eq(kr_oai_error(&e, cause, "p", "m %d", 1), KR_ERR_INVAL);
    cr_expect_eq(e.http_status, status, "cause %d: status %d, want %d", (int)cause, e.http_status, status);
    if (type) {
        cr_expect_str_eq(e.type, type, "cause %d", (int)cause);
    }
    if (code) {
        cr_expect_str_eq(e.code, code, "cause %d", (int)cause);
    }
    cr_expect_str_eq(e.param, "p");
    cr_expect_str_eq(e.message, "m 1");
}

Test(openai, error_causes_follow_openai_and_vllm)
{
    /* a bad parameter: 400 invalid_request_error, code null */
    expect_cause(KR_OAI_INVALID, 400, "invalid_request_error", "");
    /* a prompt over the context: OpenAI's 400 with code context_length_exceeded */
    expect_cause(KR_OAI_TOO_LONG, 400, "invalid_request_error", "context_length_exceeded");
    /* a missing or wrong key: 401, code invalid_api_key */
    expect_cause(KR_OAI_UNAUTHORIZED, 401, "authentication_error", "invalid_api_key");
    /* another model than the one served: 404 (vLLM's NotFoundError) with OpenAI's model_not_found */
    expect_cause(KR_OAI_MODEL_NOT_FOUND, 404, NULL, "model_not_found");
    expect_cause(KR_OAI_NOT_FOUND, 404, NULL, NULL);
    /* RFC 9110: 405 Method Not Allowed, 413 Content Too Large */
    expect_cause(KR_OAI_METHOD, 405, NULL, NULL);
    expect_cause(KR_OAI_TOO_LARGE, 413, NULL, NULL);
    /* a full queue is a rate limit: 429, which clients back off and retry */
    expect_cause(KR_OAI_QUEUE_FULL, 429, "rate_limit_error", NULL);
    /* OpenAI's server_error for a 500 */
    expect_cause(KR_OAI_INTERNAL, 500, "server_error", "");
    /* loading, draining or a lost device: 503, retried by clients and load balancers */
    expect_cause(KR_OAI_UNAVAILABLE, 503, "service_unavailable", "");
}

Test(openai, every_error_cause_has_a_status_and_a_type)
{
    for (int c = 0; c < KR_OAI_CAUSE_COUNT; c++) {
        struct kr_oai_error e;
        memset(&e, 0, sizeof e);
        kr_oai_error(&e, (enum kr_oai_cause)c, NULL, "x");
        cr_expect(e.http_status >= 400 && e.http_status <= 599, "cause %d: status %d", c, e.http_status);
        cr_expect_gt(strlen(e.type), 0, "cause %d: no type", c);
        cr_expect_str_eq(e.param, "", "cause %d: a NULL param is none", c);
    }
    cr_expect_eq(kr_oai_error(NULL, KR_OAI_INTERNAL, "", "nothing to fill"), KR_ERR_INVAL);
}

Test(openai, error_json_survives_invalid_utf8_and_truncation)
{
    struct kr_oai_error e;
    char longmsg[3000];
    memset(longmsg, 'a', sizeof longmsg);
    memcpy(longmsg + 1021, "\xe2\x82\xac", 3); /* a euro sign cut by the 1024-byte buffer */
    longmsg[sizeof longmsg - 1] = 0;
    kr_oai_error(&e, KR_OAI_MODEL_NOT_FOUND, "model", "%s", longmsg);
    char *s = kr_oai_error_json(&e);
    json_t *j = load(s);
    const char *m = jgets(j, "error.message");
    cr_expect_eq(strlen(m), 1021 + 3, "1021 'a' + one U+FFFD for the truncated sequence");
    cr_expect_str_eq(m + 1021, "\xef\xbf\xbd");
    json_decref(j);
    free(s);
}

/* ---- completions encoder --------------------------------------------------------------------- */

/* A completions request with two prompts and n = 2: one response, four choices in order, each with
 * its own prompt's echo and prompt token ids. */
Test(openai, completion_json_of_several_prompts)
{
    struct kr_oai_choice ch[4] = {
        {.index = 0, .text = "a0", .text_len = 2, .finish_reason = "length", .stop_reason_id = -1},
        {.index = 1, .text = "a1", .text_len = 2, .finish_reason = "length", .stop_reason_id = -1},
        {.index = 2, .text = "b0", .text_len = 2, .finish_reason = "stop", .stop_reason_id = 7},
        {.index = 3, .text = "b1", .text_len = 2, .finish_reason = "length", .stop_reason_id = -1},
    };
    const int32_t ids_a[] = {1, 2}, ids_b[] = {3, 4, 5};
    struct kr_oai_completion per[2] = {
        {.prompt_text = "A:", .prompt_text_len = 2, .prompt_ids = ids_a, .n_prompt_ids = 2, .return_token_ids = true},
        {.prompt_text = "Bee:", .prompt_text_len = 4, .prompt_ids = ids_b, .n_prompt_ids = 3, .return_token_ids = true},
    };
    struct kr_oai_completion c = {.id = "cmpl-x", .created = 1, .model = "tiny", .choices = ch, .n_choices = 4,
                                  .usage = {.prompt_tokens = 5, .completion_tokens = 8}, .prompts = per,
                                  .choices_per_prompt = 2};
    char *s = kr_oai_completion_json(&c);
    cr_assert(s);
    json_error_t e;
    json_t *j = json_loads(s, 0, &e);
    cr_assert(j, "%s", e.text);
    cr_assert_eq(json_array_size(jget(j, "choices")), 4);
    cr_expect_str_eq(jgets(j, "choices.0.text"), "A:a0");
    cr_expect_str_eq(jgets(j, "choices.1.text"), "A:a1");
    cr_expect_str_eq(jgets(j, "choices.2.text"), "Bee:b0");
    cr_expect_str_eq(jgets(j, "choices.3.text"), "Bee:b1");
    cr_expect_eq(jgeti(j, "choices.3.index"), 3);
    cr_expect_eq(json_array_size(jget(j, "choices.1.prompt_token_ids")), 2);
    cr_expect_eq(json_array_size(jget(j, "choices.2.prompt_token_ids")), 3);
    cr_expect_eq(jgeti(j, "choices.2.prompt_token_ids.2"), 5);
    cr_expect_eq(jgeti(j, "choices.2.stop_reason"), 7);
    cr_expect_eq(jgeti(j, "usage.prompt_tokens"), 5);
    json_decref(j);
    free(s);
}

Test(openai, completion_json_has_openai_shape)
{
    struct kr_oai_choice ch[2] = {
        {.index = 0, .text = "Hello", .text_len = 5, .finish_reason = "length", .stop_reason_id = -1},
        {.index = 1,
         .text = " world",
         .text_len = 6,
         .finish_reason = "stop",
         .stop_reason_str = "###",
         .stop_reason_id = -1},
    };
    struct kr_oai_completion c = {.id = "cmpl-abc",
                                  .created = 1700000000,
                                  .model = "tiny",
                                  .choices = ch,
                                  .n_choices = 2,
                                  .usage = {.prompt_tokens = 4, .completion_tokens = 7}};
    char *s = kr_oai_completion_json(&c);
    json_t *j = load(s);
    static const char *const top[] = {"id", "object", "created", "model", "choices", "usage", NULL};
    static const char *const choice[] = {"index", "text", "logprobs", "finish_reason", "stop_reason", NULL};
    static const char *const usage[] = {"prompt_tokens", "completion_tokens", "total_tokens", NULL};
    expect_keys(j, "", top);
    cr_expect_str_eq(jgets(j, "id"), "cmpl-abc");
    cr_expect_str_eq(jgets(j, "object"), "text_completion");
    cr_expect_eq(jgeti(j, "created"), 1700000000);
    cr_expect_str_eq(jgets(j, "model"), "tiny");
    cr_assert_eq(json_array_size(jget(j, "choices")), 2);
    expect_keys(j, "choices.0", choice);
    cr_expect_eq(jgeti(j, "choices.0.index"), 0);
    cr_expect_str_eq(jgets(j, "choices.0.text"), "Hello");
    expect_null(j, "choices.0.logprobs");
    cr_expect_str_eq(jgets(j, "choices.0.finish_reason"), "length");
    expect_null(j, "choices.0.stop_reason");
    cr_expect_eq(jgeti(j, "choices.1.index"), 1);
    cr_expect_str_eq(jgets(j, "choices.1.text"), " world");
    cr_expect_str_eq(jgets(j, "choices.1.stop_reason"), "###");
    expect_keys(j, "usage", usage);
    cr_expect_eq(jgeti(j, "usage.prompt_tokens"), 4);
    cr_expect_eq(jgeti(j, "usage.completion_tokens"), 7);
    cr_expect_eq(jgeti(j, "usage.total_tokens"), 11);
    json_decref(j);
    free(s);
}

Test(openai, stop_reason_is_a_token_id_when_a_stop_id_hit)
{
    struct kr_oai_choice ch = {.text = "x", .text_len = 1, .finish_reason = "stop", .stop_reason_id = 128001};
    struct kr_oai_completion c = {.id = "c", .model = "m", .choices = &ch, .n_choices = 1};
    char *s = kr_oai_completion_json(&c);
    json_t *j = load(s);
    cr_expect_eq(jgeti(j, "choices.0.stop_reason"), 128001);
    json_decref(j);
    free(s);
    s = kr_oai_chat_json(&c);
    j = load(s);
    cr_expect_eq(jgeti(j, "choices.0.stop_reason"), 128001);
    json_decref(j);
    free(s);
}

Test(openai, completion_return_token_ids_are_per_choice)
{
    int32_t gen[3] = {10, 11, 12}, prompt[2] = {1, 2};
    struct kr_oai_choice ch = {.text = "abc",
                               .text_len = 3,
                               .token_ids = gen,
                               .n_tokens = 3,
                               .finish_reason = "length",
                               .stop_reason_id = -1};
    struct kr_oai_completion c = {.id = "c",
                                  .model = "m",
                                  .choices = &ch,
                                  .n_choices = 1,
                                  .prompt_ids = prompt,
                                  .n_prompt_ids = 2,
                                  .return_token_ids = true};
    char *s = kr_oai_completion_json(&c);
    json_t *j = load(s);
    cr_assert_eq(json_array_size(jget(j, "choices.0.token_ids")), 3);
    cr_expect_eq(jgeti(j, "choices.0.token_ids.0"), 10);
    cr_expect_eq(jgeti(j, "choices.0.token_ids.2"), 12);
    cr_assert_eq(json_array_size(jget(j, "choices.0.prompt_token_ids")), 2);
    cr_expect_eq(jgeti(j, "choices.0.prompt_token_ids.1"), 2);
    cr_expect_null(jget(j, "prompt_token_ids"), "vLLM puts completions prompt ids on the choice");
    json_decref(j);
    free(s);
}

Test(openai, completion_logprobs_layout_and_text_offsets)
{
    /* "é" is 2 bytes, 1 code point; "日本" 6 bytes, 2 code points */
    struct kr_oai_token top0[2] = {tok("\xc3\xa9", -0.1f), tok("e", -2.5f)};
    struct kr_oai_token top1[1] = {tok("\xe6\x97\xa5\xe6\x9c\xac", -0.7f)};
    struct kr_oai_logprob lps[3] = {
        {.tok = tok("\xc3\xa9", -0.1f), .n_top = 2, .top = top0},
        {.tok = tok("\xe6\x97\xa5\xe6\x9c\xac", -0.7f), .n_top = 1, .top = top1},
        {.tok = tok("!", -INFINITY), .n_top = 0, .top = NULL},
    };
    struct kr_oai_choice ch = {.text = "\xc3\xa9\xe6\x97\xa5\xe6\x9c\xac!",
                               .text_len = 9,
                               .logprobs = lps,
                               .n_logprobs = 3,
                               .finish_reason = "length",
                               .stop_reason_id = -1};
    struct kr_oai_completion c = {.id = "c", .model = "m", .choices = &ch, .n_choices = 1};
    char *s = kr_oai_completion_json(&c);
    json_t *j = load(s);
    static const char *const lp_keys[] = {"tokens", "token_logprobs", "top_logprobs", "text_offset", NULL};
    expect_keys(j, "choices.0.logprobs", lp_keys);
    cr_assert_eq(json_array_size(jget(j, "choices.0.logprobs.tokens")), 3);
    cr_expect_str_eq(jgets(j, "choices.0.logprobs.tokens.0"), "\xc3\xa9");
    cr_expect_str_eq(jgets(j, "choices.0.logprobs.tokens.2"), "!");
    expect_logprob(j, "choices.0.logprobs.token_logprobs.0", -0.1f);
    expect_logprob(j, "choices.0.logprobs.token_logprobs.1", -0.7f);
    cr_expect_eq(json_real_value(jget(j, "choices.0.logprobs.token_logprobs.2")), -9999.0, "-inf -> -9999.0");
    json_t *t0 = jget(j, "choices.0.logprobs.top_logprobs.0");
    cr_assert(json_is_object(t0));
    cr_expect_eq(json_object_size(t0), 2);
    expect_logprob(t0, "\xc3\xa9", -0.1f);
    expect_logprob(t0, "e", -2.5f);
    cr_expect_eq(json_object_size(jget(j, "choices.0.logprobs.top_logprobs.2")), 0);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.text_offset.0"), 0);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.text_offset.1"), 1);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.text_offset.2"), 3);
    json_decref(j);
    free(s);
}

Test(openai, logprobs_round_trip_float32_and_nan_is_null)
{
    static const float vals[] = {-0.1f, -1e-7f, -12.345678f, -0.0f, -3.4028235e38f, -1.17549435e-38f};
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        struct kr_oai_logprob lp = {.tok = tok("a", vals[i])};
        struct kr_oai_choice ch = {
            .text = "a", .text_len = 1, .logprobs = &lp, .n_logprobs = 1, .stop_reason_id = -1};
        struct kr_oai_completion c = {.id = "c", .model = "m", .choices = &ch, .n_choices = 1};
        char *s = kr_oai_completion_json(&c);
        json_t *j = load(s);
        float want = vals[i] < -9999.0f ? -9999.0f : vals[i];
        expect_logprob(j, "choices.0.logprobs.token_logprobs.0", want);
        json_decref(j);
        free(s);
    }
    struct kr_oai_logprob lp = {.tok = tok("a", NAN)};
    struct kr_oai_choice ch = {
        .text = "a", .text_len = 1, .logprobs = &lp, .n_logprobs = 1, .stop_reason_id = -1};
    struct kr_oai_completion c = {.id = "c", .model = "m", .choices = &ch, .n_choices = 1};
    char *s = kr_oai_completion_json(&c);
    json_t *j = load(s);
    expect_null(j, "choices.0.logprobs.token_logprobs.0");
    json_decref(j);
    free(s);
    s = kr_oai_chat_json(&c);
    j = load(s);
    expect_null(j, "choices.0.logprobs.content.0.logprob");
    json_decref(j);
    free(s);
}

Test(openai, echo_with_logprobs_puts_the_prompt_first)
{
    /* prompt "Hi there" = ["Hi", " there"], generated "!" */
    struct kr_oai_token ptop[1] = {tok(" here", -1.5f)};
    struct kr_oai_logprob plp[2] = {
        {.tok = tok("Hi", NAN)},
        {.tok = tok(" there", -0.25f), .n_top = 1, .top = ptop},
    };
    struct kr_oai_token gtop[1] = {tok("!", -0.05f)};
    struct kr_oai_logprob glp[1] = {{.tok = tok("!", -0.05f), .n_top = 1, .top = gtop}};
    int32_t pids[2] = {5, 6};
    struct kr_oai_choice ch = {.text = "!",
                               .text_len = 1,
                               .logprobs = glp,
                               .n_logprobs = 1,
                               .finish_reason = "stop",
                               .stop_reason_id = -1};
    struct kr_oai_completion c = {.id = "c",
                                  .model = "m",
                                  .choices = &ch,
                                  .n_choices = 1,
                                  .prompt_text = "Hi there",
                                  .prompt_text_len = 8,
                                  .prompt_ids = pids,
                                  .n_prompt_ids = 2,
                                  .prompt_logprobs = plp};
    char *s = kr_oai_completion_json(&c);
    json_t *j = load(s);
    cr_expect_str_eq(jgets(j, "choices.0.text"), "Hi there!");
    cr_assert_eq(json_array_size(jget(j, "choices.0.logprobs.tokens")), 3);
    cr_expect_str_eq(jgets(j, "choices.0.logprobs.tokens.0"), "Hi");
    cr_expect_str_eq(jgets(j, "choices.0.logprobs.tokens.1"), " there");
    cr_expect_str_eq(jgets(j, "choices.0.logprobs.tokens.2"), "!");
    expect_null(j, "choices.0.logprobs.token_logprobs.0");
    expect_logprob(j, "choices.0.logprobs.token_logprobs.1", -0.25f);
    expect_logprob(j, "choices.0.logprobs.token_logprobs.2", -0.05f);
    expect_null(j, "choices.0.logprobs.top_logprobs.0");
    expect_logprob(j, "choices.0.logprobs.top_logprobs.1. here", -1.5f);
    expect_logprob(j, "choices.0.logprobs.top_logprobs.2.!", -0.05f);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.text_offset.0"), 0);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.text_offset.1"), 2);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.text_offset.2"), 8);
    json_decref(j);
    free(s);
}

Test(openai, echo_offsets_skip_a_bos_the_text_does_not_hold_and_never_decrease)
{
    /* prompt "Hi there" tokenized with a BOS the echoed text does not show; generated "36" then "4"
     * cut by a stop string ("4"), then an end-of-sequence token: the text is "Hi there36" */
    static const char bos[] = "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
    struct kr_oai_logprob plp[3] = {{.tok = tok(bos, NAN)}, {.tok = tok("Hi", -1.0f)}, {.tok = tok(" there", -2.0f)}};
    struct kr_oai_logprob glp[3] = {{.tok = tok("36", -1.0f)}, {.tok = tok("4", -1.0f)}, {.tok = tok("</s>", -1.0f)}};
    int32_t pids[3] = {0, 5, 6};
    struct kr_oai_choice ch = {.text = "36", .text_len = 2, .logprobs = glp, .n_logprobs = 3,
                               .finish_reason = "stop", .stop_reason_id = -1};
    struct kr_oai_completion c = {.id = "c", .model = "m", .choices = &ch, .n_choices = 1,
                                  .prompt_text = "Hi there", .prompt_text_len = 8,
                                  .prompt_ids = pids, .n_prompt_ids = 3, .prompt_logprobs = plp};
    char *s = kr_oai_completion_json(&c);
    json_t *j = load(s);
    cr_expect_str_eq(jgets(j, "choices.0.text"), "Hi there36");
    static const int want[] = {0, 0, 2, 8, 10, 10};
    for (int i = 0; i < 6; i++) {
        char path[64];
        snprintf(path, sizeof path, "choices.0.logprobs.text_offset.%d", i);
        cr_expect_eq(jgeti(j, path), want[i], "text_offset[%d] is %lld, expected %d", i, (long long)jgeti(j, path),
                     want[i]);
    }
    json_decref(j);
    free(s);
    /* a character split over two tokens: the next whole token still lands on its own code point */
    struct kr_oai_logprob split[3] = {{.tok = tok("\xc3", -1.0f)}, {.tok = tok("\xa9", -1.0f)}, {.tok = tok("x", -1.0f)}};
    struct kr_oai_choice ch2 = {.text = "\xc3\xa9x", .text_len = 3, .logprobs = split, .n_logprobs = 3,
                                .finish_reason = "length", .stop_reason_id = -1};
    struct kr_oai_completion c2 = {.id = "c", .model = "m", .choices = &ch2, .n_choices = 1};
    s = kr_oai_completion_json(&c2);
    j = load(s);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.text_offset.0"), 0);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.text_offset.2"), 1, "\"x\" is the text's second code point");
    json_decref(j);
    free(s);
}

Test(openai, echo_offsets_count_code_points_of_the_prompt)
{
    /* the prompt "ü" (1 code point) decodes from a BOS-less token list; the generated token follows */
    struct kr_oai_logprob glp[1] = {{.tok = tok("x", -1.0f)}};
    struct kr_oai_choice ch = {
        .text = "x", .text_len = 1, .logprobs = glp, .n_logprobs = 1, .stop_reason_id = -1};
    struct kr_oai_completion c = {.id = "c",
                                  .model = "m",
                                  .choices = &ch,
                                  .n_choices = 1,
                                  .prompt_text = "\xc3\xbc",
                                  .prompt_text_len = 2};
    char *s = kr_oai_completion_json(&c);
    json_t *j = load(s);
    cr_expect_str_eq(jgets(j, "choices.0.text"), "\xc3\xbcx");
    cr_assert_eq(json_array_size(jget(j, "choices.0.logprobs.tokens")), 1, "no prompt logprobs were given");
    cr_expect_eq(jgeti(j, "choices.0.logprobs.text_offset.0"), 1);
    json_decref(j);
    free(s);
}

Test(openai, invalid_utf8_becomes_replacement_characters)
{
    /* expected strings from Python: bytes.decode("utf-8", "replace") */
    static const struct {
        const char *in, *want;
    } cases[] = {
        {"a\xff"
         "b",
         "a\xef\xbf\xbd"
         "b"},
        {"\xe2\x82", "\xef\xbf\xbd"},                             /* truncated 3-byte sequence: one */
        {"\xed\xa0\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* surrogate: three */
        {"\xc0\xaf", "\xef\xbf\xbd\xef\xbf\xbd"},                 /* overlong: two */
        {"\xf4\x90\x80\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* > U+10FFFF: four */
        {"a\xf0\x9f\x98x", "a\xef\xbf\xbdx"},                                     /* cut emoji: one */
        {"ok \xf0\x9f\x98\x80", "ok \xf0\x9f\x98\x80"},                           /* valid stays */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct kr_oai_token top[1] = {tok(cases[i].in, -1.0f)};
        struct kr_oai_logprob lp = {.tok = tok(cases[i].in, -1.0f), .n_top = 1, .top = top};
        struct kr_oai_choice ch = {.text = cases[i].in,
                                   .text_len = strlen(cases[i].in),
                                   .logprobs = &lp,
                                   .n_logprobs = 1,
                                   .stop_reason_id = -1};
        struct kr_oai_completion c = {.id = "c", .model = cases[i].in, .choices = &ch, .n_choices = 1};
        char *s = kr_oai_completion_json(&c);
        json_t *j = load(s);
        cr_expect_str_eq(jgets(j, "choices.0.text"), cases[i].want, "case %zu", i);
        cr_expect_str_eq(jgets(j, "model"), cases[i].want, "case %zu", i);
        cr_expect_str_eq(jgets(j, "choices.0.logprobs.tokens.0"), cases[i].want, "case %zu", i);
        cr_expect_not_null(json_object_get(jget(j, "choices.0.logprobs.top_logprobs.0"), cases[i].want),
                           "case %zu", i);
        json_decref(j);
        free(s);
        s = kr_oai_chat_json(&c);
        j = load(s);
        cr_expect_str_eq(jgets(j, "choices.0.message.content"), cases[i].want, "case %zu", i);
        /* "bytes" keeps the raw bytes, not the replacement */
        json_t *b = jget(j, "choices.0.logprobs.content.0.bytes");
        cr_assert_eq(json_array_size(b), strlen(cases[i].in));
        cr_expect_eq(json_integer_value(json_array_get(b, 0)), (unsigned char)cases[i].in[0]);
        json_decref(j);
        free(s);
    }
    cr_expect_eq(kr_oai_utf8_count("\xed\xa0\x80", 3), 3);
    cr_expect_eq(kr_oai_utf8_count("\xc3\xa9t\xc3\xa9", 5), 3);
    cr_expect_eq(kr_oai_utf8_count(NULL, 0), 0);
}

Test(openai, embedded_nul_in_text_is_escaped)
{
    struct kr_oai_choice ch = {.text = "a\0b", .text_len = 3, .stop_reason_id = -1};
    struct kr_oai_completion c = {.id = "c", .model = "m", .choices = &ch, .n_choices = 1};
    char *s = kr_oai_completion_json(&c);
    cr_assert_not_null(s);
    cr_expect_not_null(strstr(s, "a\\u0000b"), "%s", s);
    free(s);
}

/* ---- chat encoder ---------------------------------------------------------------------------- */

Test(openai, chat_json_has_openai_shape)
{
    struct kr_oai_token top[2] = {
        {.text = "Hi", .text_len = 2, .bytes = (const unsigned char *)"Hi", .n_bytes = 2, .logprob = -0.01f},
        {.text = "Hey", .text_len = 3, .logprob = -4.5f}};
    struct kr_oai_logprob lps[1] = {{.tok = {.text = "Hi",
                                             .text_len = 2,
                                             .bytes = (const unsigned char *)"Hi",
                                             .n_bytes = 2,
                                             .logprob = -0.01f},
                                     .n_top = 2,
                                     .top = top}};
    int32_t gen[1] = {9}, prompt[3] = {1, 2, 3};
    struct kr_oai_choice ch = {.index = 0,
                               .text = "Hi",
                               .text_len = 2,
                               .logprobs = lps,
                               .n_logprobs = 1,
                               .token_ids = gen,
                               .n_tokens = 1,
                               .finish_reason = "stop",
                               .stop_reason_id = -1};
    struct kr_oai_completion c = {.id = "chatcmpl-1",
                                  .created = 1710000000,
                                  .model = "tiny",
                                  .choices = &ch,
                                  .n_choices = 1,
                                  .usage = {.prompt_tokens = 3, .completion_tokens = 1},
                                  .prompt_ids = prompt,
                                  .n_prompt_ids = 3,
                                  .return_token_ids = true};
    char *s = kr_oai_chat_json(&c);
    json_t *j = load(s);
    static const char *const top_keys[] = {"id",      "object", "created",          "model",
                                           "choices", "usage",  "prompt_token_ids", NULL};
    static const char *const choice[] = {"index",       "message",   "logprobs", "finish_reason",
                                         "stop_reason", "token_ids", NULL};
    static const char *const msg[] = {"role", "content", NULL};
    static const char *const entry[] = {"token", "logprob", "bytes", "top_logprobs", NULL};
    static const char *const top_entry[] = {"token", "logprob", "bytes", NULL};
    expect_keys(j, "", top_keys);
    cr_expect_str_eq(jgets(j, "id"), "chatcmpl-1");
    cr_expect_str_eq(jgets(j, "object"), "chat.completion");
    cr_expect_eq(jgeti(j, "created"), 1710000000);
    cr_expect_str_eq(jgets(j, "model"), "tiny");
    expect_keys(j, "choices.0", choice);
    expect_keys(j, "choices.0.message", msg);
    cr_expect_str_eq(jgets(j, "choices.0.message.role"), "assistant");
    cr_expect_str_eq(jgets(j, "choices.0.message.content"), "Hi");
    cr_expect_str_eq(jgets(j, "choices.0.finish_reason"), "stop");
    expect_null(j, "choices.0.stop_reason");
    cr_expect_eq(jgeti(j, "choices.0.token_ids.0"), 9);
    cr_expect_eq(json_array_size(jget(j, "prompt_token_ids")), 3);
    cr_expect_eq(jgeti(j, "prompt_token_ids.2"), 3);
    cr_expect_eq(jgeti(j, "usage.total_tokens"), 4);
    static const char *const lp_keys[] = {"content", NULL};
    expect_keys(j, "choices.0.logprobs", lp_keys);
    expect_keys(j, "choices.0.logprobs.content.0", entry);
    cr_expect_str_eq(jgets(j, "choices.0.logprobs.content.0.token"), "Hi");
    expect_logprob(j, "choices.0.logprobs.content.0.logprob", -0.01f);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.content.0.bytes.0"), 'H');
    cr_expect_eq(jgeti(j, "choices.0.logprobs.content.0.bytes.1"), 'i');
    cr_assert_eq(json_array_size(jget(j, "choices.0.logprobs.content.0.top_logprobs")), 2);
    expect_keys(j, "choices.0.logprobs.content.0.top_logprobs.1", top_entry);
    cr_expect_str_eq(jgets(j, "choices.0.logprobs.content.0.top_logprobs.1.token"), "Hey");
    expect_logprob(j, "choices.0.logprobs.content.0.top_logprobs.1.logprob", -4.5f);
    /* no raw bytes given: the text's UTF-8 bytes */
    cr_expect_eq(json_array_size(jget(j, "choices.0.logprobs.content.0.top_logprobs.1.bytes")), 3);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.content.0.top_logprobs.1.bytes.2"), 'y');
    json_decref(j);
    free(s);
}

Test(openai, chat_json_without_extras_has_no_vllm_token_fields)
{
    struct kr_oai_choice ch = {.text = "", .text_len = 0, .finish_reason = "length", .stop_reason_id = -1};
    struct kr_oai_completion c = {.id = "x", .model = "m", .choices = &ch, .n_choices = 1};
    char *s = kr_oai_chat_json(&c);
    json_t *j = load(s);
    cr_expect_null(jget(j, "prompt_token_ids"));
    cr_expect_null(jget(j, "choices.0.token_ids"));
    expect_null(j, "choices.0.logprobs");
    cr_expect_str_eq(jgets(j, "choices.0.message.content"), "");
    json_decref(j);
    free(s);
}

/* ---- streaming ------------------------------------------------------------------------------- */

Test(openai, completion_chunk_shape)
{
    struct kr_oai_choice d = {.index = 2, .text = " wor", .text_len = 4, .stop_reason_id = -1};
    char *s = kr_oai_completion_chunk("cmpl-9", 123, "m", &d);
    json_t *j = load_sse(s);
    static const char *const top[] = {"id", "object", "created", "model", "choices", NULL};
    static const char *const choice[] = {"index", "text", "logprobs", "finish_reason", "stop_reason", NULL};
    expect_keys(j, "", top); /* no "usage" key in delta chunks */
    cr_expect_str_eq(jgets(j, "object"), "text_completion");
    cr_expect_str_eq(jgets(j, "id"), "cmpl-9");
    cr_expect_eq(jgeti(j, "created"), 123);
    cr_assert_eq(json_array_size(jget(j, "choices")), 1);
    expect_keys(j, "choices.0", choice);
    cr_expect_eq(jgeti(j, "choices.0.index"), 2);
    cr_expect_str_eq(jgets(j, "choices.0.text"), " wor");
    expect_null(j, "choices.0.finish_reason");
    expect_null(j, "choices.0.logprobs");
    json_decref(j);
    free(s);

    int32_t ids[2] = {77, 78};
    d = (struct kr_oai_choice){.index = 0,
                               .text = "ld",
                               .text_len = 2,
                               .token_ids = ids,
                               .n_tokens = 2,
                               .finish_reason = "stop",
                               .stop_reason_str = "\n\n",
                               .stop_reason_id = -1};
    s = kr_oai_completion_chunk("cmpl-9", 123, "m", &d);
    j = load_sse(s);
    cr_expect_str_eq(jgets(j, "choices.0.finish_reason"), "stop");
    cr_expect_str_eq(jgets(j, "choices.0.stop_reason"), "\n\n");
    cr_expect_eq(jgeti(j, "choices.0.token_ids.1"), 78);
    json_decref(j);
    free(s);
}

Test(openai, completion_chunk_logprobs_offsets_continue_the_stream)
{
    struct kr_oai_logprob lp[2] = {{.tok = tok("ab", -0.5f)}, {.tok = tok("c", -0.25f)}};
    struct kr_oai_choice d = {
        .text = "abc", .text_len = 3, .logprobs = lp, .n_logprobs = 2, .stop_reason_id = -1};
    char *s = kr_oai_completion_chunk_at("c", 1, "m", &d, 10);
    json_t *j = load_sse(s);
    cr_expect_str_eq(jgets(j, "choices.0.logprobs.tokens.0"), "ab");
    expect_logprob(j, "choices.0.logprobs.token_logprobs.1", -0.25f);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.text_offset.0"), 10);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.text_offset.1"), 12);
    json_decref(j);
    free(s);
    s = kr_oai_completion_chunk("c", 1, "m", &d);
    j = load_sse(s);
    cr_expect_eq(jgeti(j, "choices.0.logprobs.text_offset.0"), 0);
    json_decref(j);
    free(s);
}

Test(openai, chat_chunks_follow_openai_delta_sequence)
{
    static const char *const top[] = {"id", "object", "created", "model", "choices", NULL};
    static const char *const choice[] = {"index", "delta", "logprobs", "finish_reason", "stop_reason", NULL};
    static const char *const first_delta[] = {"role", "content", NULL};
    static const char *const mid_delta[] = {"content", NULL};
    static const char *const no_keys[] = {NULL};

    struct kr_oai_choice d = {.text = "", .text_len = 0, .stop_reason_id = -1};
    char *s = kr_oai_chat_chunk("chatcmpl-1", 5, "m", &d, true);
    json_t *j = load_sse(s);
    expect_keys(j, "", top);
    cr_expect_str_eq(jgets(j, "object"), "chat.completion.chunk");
    expect_keys(j, "choices.0", choice);
    expect_keys(j, "choices.0.delta", first_delta);
    cr_expect_str_eq(jgets(j, "choices.0.delta.role"), "assistant");
    cr_expect_str_eq(jgets(j, "choices.0.delta.content"), "");
    expect_null(j, "choices.0.finish_reason");
    expect_null(j, "choices.0.logprobs");
    json_decref(j);
    free(s);

    d = (struct kr_oai_choice){.text = "Hel", .text_len = 3, .stop_reason_id = -1};
    s = kr_oai_chat_chunk("chatcmpl-1", 5, "m", &d, false);
    j = load_sse(s);
    expect_keys(j, "choices.0.delta", mid_delta);
    cr_expect_str_eq(jgets(j, "choices.0.delta.content"), "Hel");
    json_decref(j);
    free(s);

    struct kr_oai_logprob lp = {.tok = tok("lo", -0.5f)};
    d = (struct kr_oai_choice){
        .text = "lo", .text_len = 2, .logprobs = &lp, .n_logprobs = 1, .stop_reason_id = -1};
    s = kr_oai_chat_chunk("chatcmpl-1", 5, "m", &d, false);
    j = load_sse(s);
    cr_expect_str_eq(jgets(j, "choices.0.logprobs.content.0.token"), "lo");
    expect_logprob(j, "choices.0.logprobs.content.0.logprob", -0.5f);
    cr_expect_eq(json_array_size(jget(j, "choices.0.logprobs.content.0.top_logprobs")), 0);
    json_decref(j);
    free(s);

    d = (struct kr_oai_choice){.text = "", .text_len = 0, .finish_reason = "length", .stop_reason_id = -1};
    s = kr_oai_chat_chunk("chatcmpl-1", 5, "m", &d, false);
    j = load_sse(s);
    expect_keys(j, "choices.0.delta", no_keys);
    cr_expect_str_eq(jgets(j, "choices.0.finish_reason"), "length");
    expect_keys(j, "", top); /* still no "usage" */
    json_decref(j);
    free(s);

    /* a final chunk that still carries text keeps it */
    d = (struct kr_oai_choice){.text = "!", .text_len = 1, .finish_reason = "stop", .stop_reason_id = 2};
    s = kr_oai_chat_chunk("chatcmpl-1", 5, "m", &d, false);
    j = load_sse(s);
    cr_expect_str_eq(jgets(j, "choices.0.delta.content"), "!");
    cr_expect_eq(jgeti(j, "choices.0.stop_reason"), 2);
    json_decref(j);
    free(s);
}

Test(openai, usage_chunk_has_empty_choices)
{
    struct kr_oai_usage u = {.prompt_tokens = 12, .completion_tokens = 30};
    static const char *const top[] = {"id", "object", "created", "model", "choices", "usage", NULL};
    for (int chat = 0; chat < 2; chat++) {
        char *s = kr_oai_usage_chunk("id-1", 99, "m", chat, &u);
        json_t *j = load_sse(s);
        expect_keys(j, "", top);
        cr_expect_str_eq(jgets(j, "object"), chat ? "chat.completion.chunk" : "text_completion");
        cr_assert(json_is_array(jget(j, "choices")));
        cr_expect_eq(json_array_size(jget(j, "choices")), 0);
        cr_expect_eq(jgeti(j, "usage.prompt_tokens"), 12);
        cr_expect_eq(jgeti(j, "usage.completion_tokens"), 30);
        cr_expect_eq(jgeti(j, "usage.total_tokens"), 42);
        json_decref(j);
        free(s);
    }
}

/* ---- models ---------------------------------------------------------------------------------- */

Test(openai, models_json_has_openai_shape_plus_vllm_fields)
{
    char *s = kr_oai_models_json("nemotron-h", 1700000001, 8192);
    json_t *j = load(s);
    static const char *const top[] = {"object", "data", NULL};
    static const char *const model[] = {"id", "object", "created", "owned_by", "root", "max_model_len", NULL};
    expect_keys(j, "", top);
    cr_expect_str_eq(jgets(j, "object"), "list");
    cr_assert_eq(json_array_size(jget(j, "data")), 1);
    expect_keys(j, "data.0", model);
    cr_expect_str_eq(jgets(j, "data.0.id"), "nemotron-h");
    cr_expect_str_eq(jgets(j, "data.0.object"), "model");
    cr_expect_eq(jgeti(j, "data.0.created"), 1700000001);
    cr_expect_str_eq(jgets(j, "data.0.owned_by"), "krait");
    cr_expect_str_eq(jgets(j, "data.0.root"), "nemotron-h");
    cr_expect_eq(jgeti(j, "data.0.max_model_len"), 8192);
    json_decref(j);
    free(s);
}

/* ---- encoders under allocation failure ------------------------------------------------------- */

static uint64_t g_json_fail_at; /* the jansson allocation (1-based) that fails; 0 = none */
static uint64_t g_json_calls;

static void *failing_malloc(size_t n)
{
    if (g_json_fail_at && ++g_json_calls == g_json_fail_at) {
        return NULL;
    }
    return malloc(n);
}

Test(openai, encoders_return_null_or_valid_json_under_allocation_failure)
{
    struct kr_oai_token top[1] = {tok("\xff", -0.5f)};
    struct kr_oai_logprob lp[2] = {{.tok = tok("a\xff", -0.5f), .n_top = 1, .top = top},
                                   {.tok = tok("b", NAN)}};
    int32_t ids[2] = {1, 2};
    struct kr_oai_choice ch = {.text = "a\xff",
                               .text_len = 2,
                               .logprobs = lp,
                               .n_logprobs = 2,
                               .token_ids = ids,
                               .n_tokens = 2,
                               .finish_reason = "stop",
                               .stop_reason_str = "s",
                               .stop_reason_id = -1};
    struct kr_oai_completion c = {.id = "c",
                                  .model = "m",
                                  .choices = &ch,
                                  .n_choices = 1,
                                  .prompt_text = "p",
                                  .prompt_text_len = 1,
                                  .prompt_ids = ids,
                                  .n_prompt_ids = 2,
                                  .prompt_logprobs = lp,
                                  .return_token_ids = true};
    struct kr_oai_usage u = {1, 2};
    struct kr_oai_error e;
    kr_oai_error(&e, KR_OAI_TOO_LONG, "x", "bad \xff"); /* param and code both set */
    json_set_alloc_funcs(failing_malloc, free);
    for (int which = 0; which < 7; which++) {
        bool done = false;
        for (uint64_t n = 1; n < 2000 && !done; n++) {
            g_json_calls = 0;
            g_json_fail_at = n;
            char *s = NULL;
            switch (which) {
            case 0:
                s = kr_oai_completion_json(&c);
                break;
            case 1:
                s = kr_oai_chat_json(&c);
                break;
            case 2:
                s = kr_oai_completion_chunk("i", 1, "m", &ch);
                break;
            case 3:
                s = kr_oai_chat_chunk("i", 1, "m", &ch, true);
                break;
            case 4:
                s = kr_oai_usage_chunk("i", 1, "m", true, &u);
                break;
            case 5:
                s = kr_oai_models_json("m", 1, 2);
                break;
            default:
                s = kr_oai_error_json(&e);
                break;
            }
            g_json_fail_at = 0;
            if (s) {
                /* an answer only when no allocation failed: a swallowed failure could drop fields */
                cr_expect_lt(g_json_calls, n, "encoder %d answered despite failing allocation %llu", which,
                             (unsigned long long)n);
                done = true;
                json_t *j =
                    json_loads(strncmp(s, "data: ", 6) == 0 ? s + 6 : s, JSON_DISABLE_EOF_CHECK, NULL);
                cr_expect_not_null(j, "encoder %d, failure %llu: partial output %s", which,
                                   (unsigned long long)n, s);
                json_decref(j);
                free(s);
            }
        }
        cr_expect(done, "encoder %d never completed", which);
    }
    json_set_alloc_funcs(malloc, free);
}

Test(openai, encoders_fail_cleanly_when_the_utf8_copy_cannot_be_allocated)
{
    struct kr_oai_choice ch = {
        .text = "bad \xff", .text_len = 5, .finish_reason = "stop", .stop_reason_id = -1};
    struct kr_oai_completion c = {.id = "c", .model = "m", .choices = &ch, .n_choices = 1};
    kr_alloc_fail_at(1, 1);
    char *s = kr_oai_completion_json(&c);
    char *t = kr_oai_chat_chunk("i", 1, "m", &ch, false);
    kr_alloc_fail_at(0, 0);
    cr_expect_null(s);
    cr_expect_null(t);
    free(s);
    free(t);
}

/* logit_bias: OpenAI's map of token ids (as strings) to biases in [-100, 100]. */
Test(openai, logit_bias_is_parsed_and_checked)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_CHAT, "\"logit_bias\":{\"50256\":-100,\"7\":2.5,\"0\":100}", &r);
    cr_assert_eq(r.sampling.n_bias, 3);
    bool seen[3] = {false};
    for (int32_t i = 0; i < 3; i++) {
        if (r.sampling.bias_ids[i] == 50256) {
            cr_expect_eq(r.sampling.bias[i], -100.0f);
            seen[0] = true;
        } else if (r.sampling.bias_ids[i] == 7) {
            cr_expect_eq(r.sampling.bias[i], 2.5f);
            seen[1] = true;
        } else if (r.sampling.bias_ids[i] == 0) {
            cr_expect_eq(r.sampling.bias[i], 100.0f);
            seen[2] = true;
        }
    }
    cr_expect(seen[0] && seen[1] && seen[2]);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_COMPLETIONS, "\"logit_bias\":null", &r);
    cr_expect_eq(r.sampling.n_bias, 0);
    kr_oai_request_free(&r);
    bad_with(KR_OAI_COMPLETIONS, "\"logit_bias\":[1,2]", "logit_bias");
    bad_with(KR_OAI_COMPLETIONS, "\"logit_bias\":{\"abc\":1}", "logit_bias");
    bad_with(KR_OAI_COMPLETIONS, "\"logit_bias\":{\"-3\":1}", "logit_bias");
    bad_with(KR_OAI_COMPLETIONS, "\"logit_bias\":{\"12\":101}", "logit_bias");
    bad_with(KR_OAI_COMPLETIONS, "\"logit_bias\":{\"12\":\"1\"}", "logit_bias");
}

/* What krait does not implement is refused by name instead of being silently ignored. */
Test(openai, unsupported_fields_are_refused_by_name)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_CHAT, "\"response_format\":{\"type\":\"text\"}", &r);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_COMPLETIONS, "\"suffix\":\"\",\"best_of\":2,\"n\":2", &r);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_COMPLETIONS, "\"suffix\":null,\"best_of\":null,\"response_format\":null", &r);
    kr_oai_request_free(&r);
    bad_with(KR_OAI_CHAT, "\"response_format\":\"json\"", "response_format");
    bad_with(KR_OAI_COMPLETIONS, "\"suffix\":\" world\"", "suffix");
    bad_with(KR_OAI_COMPLETIONS, "\"suffix\":3", "suffix");
    bad_with(KR_OAI_COMPLETIONS, "\"best_of\":3", "best_of");
    bad_with(KR_OAI_COMPLETIONS, "\"best_of\":0", "best_of");
}

/* Fields of OpenAI's or vLLM's API that krait does not implement: their defaults (asking for
 * nothing) pass, anything more is a 400 naming the field. */
Test(openai, unimplemented_fields_asking_for_something_are_refused_by_name)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_CHAT,
            "\"modalities\":[\"text\"],\"store\":false,\"use_beam_search\":false,\"length_penalty\":1.0,"
            "\"include_stop_str_in_output\":false,\"bad_words\":[],\"priority\":0,\"echo\":false,"
            "\"service_tier\":null,\"reasoning_effort\":null,\"audio\":null",
            &r);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_COMPLETIONS, "\"echo\":true,\"chat_template\":\"x\"", &r); /* chat-only fields */
    kr_oai_request_free(&r);
    static const char *const refused[][2] = {
        {"\"service_tier\":\"auto\"", "service_tier"},
        {"\"service_tier\":\"default\"", "service_tier"},
        {"\"service_tier\":\"flex\"", "service_tier"},
        {"\"reasoning_effort\":\"low\"", "reasoning_effort"},
        {"\"modalities\":[\"text\",\"audio\"]", "modalities"},
        {"\"modalities\":\"audio\"", "modalities"},
        {"\"audio\":{\"voice\":\"alloy\",\"format\":\"wav\"}", "audio"},
        {"\"prediction\":{\"type\":\"content\",\"content\":\"x\"}", "prediction"},
        {"\"web_search_options\":{}", "web_search_options"},
        {"\"store\":true", "store"},
        {"\"use_beam_search\":true", "use_beam_search"},
        {"\"length_penalty\":0.5", "length_penalty"},
        {"\"include_stop_str_in_output\":true", "include_stop_str_in_output"},
        {"\"truncate_prompt_tokens\":5", "truncate_prompt_tokens"},
        {"\"allowed_token_ids\":[1,2]", "allowed_token_ids"},
        {"\"bad_words\":[\"x\"]", "bad_words"},
        {"\"logits_processors\":[\"m.P\"]", "logits_processors"},
        {"\"priority\":1", "priority"},
        {"\"kv_transfer_params\":{}", "kv_transfer_params"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        bad_with(KR_OAI_CHAT, refused[i][0], refused[i][1]);
        bad_with(KR_OAI_COMPLETIONS, refused[i][0], refused[i][1]);
    }
    bad_with(KR_OAI_CHAT, "\"echo\":true", "echo");
    bad_with(KR_OAI_CHAT, "\"chat_template\":\"{{ x }}\"", "chat_template");
    bad_with(KR_OAI_COMPLETIONS, "\"prompt_embeds\":\"AAAA\"", "prompt_embeds");
}

Test(openai, continuous_usage_stats_needs_include_usage_and_puts_usage_on_chunks)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_CHAT, "\"stream\":true,\"stream_options\":{\"include_usage\":true,\"continuous_usage_stats\":true}",
            &r);
    cr_expect(r.include_usage && r.continuous_usage);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"stream\":true,\"stream_options\":{\"continuous_usage_stats\":true}", &r);
    cr_expect(!r.continuous_usage, "as vLLM: without include_usage no chunk carries usage");
    kr_oai_request_free(&r);
    bad_with(KR_OAI_CHAT, "\"stream\":true,\"stream_options\":{\"continuous_usage_stats\":1}",
             "stream_options.continuous_usage_stats");
    const struct kr_oai_usage u = {.prompt_tokens = 7, .completion_tokens = 2};
    struct kr_oai_choice d = {.text = "ab", .text_len = 2, .stop_reason_id = -1, .usage = &u};
    char *s = kr_oai_chat_chunk("c", 1, "m", &d, false);
    json_t *j = load_sse(s);
    cr_expect_eq(jgeti(j, "usage.prompt_tokens"), 7);
    cr_expect_eq(jgeti(j, "usage.completion_tokens"), 2);
    cr_expect_eq(jgeti(j, "usage.total_tokens"), 9);
    json_decref(j);
    free(s);
    s = kr_oai_completion_chunk("c", 1, "m", &d);
    j = load_sse(s);
    cr_expect_eq(jgeti(j, "usage.total_tokens"), 9);
    json_decref(j);
    free(s);
    d.usage = NULL;
    s = kr_oai_chat_chunk("c", 1, "m", &d, false);
    j = load_sse(s);
    cr_expect_null(json_object_get(j, "usage"), "no usage unless asked");
    json_decref(j);
    free(s);
}

Test(openai, a_model_object_is_the_lists_entry)
{
    char *a = kr_oai_models_json("tiny", 5, 4096), *b = kr_oai_model_json("tiny", 5, 4096);
    json_t *ja = load(a), *jb = load(b);
    cr_expect(json_equal(json_array_get(json_object_get(ja, "data"), 0), jb));
    cr_expect_str_eq(jgets(jb, "object"), "model");
    json_decref(ja);
    json_decref(jb);
    free(a);
    free(b);
}

/* Builds `{<head>[<item>,<item>,...]<tail>}` with n items (kr_malloc'd by nothing: plain malloc). */
static char *repeated(const char *head, const char *item, size_t n, const char *tail)
{
    const size_t il = strlen(item), cap = strlen(head) + n * (il + 1) + strlen(tail) + 8;
    char *b = malloc(cap), *p = b;
    cr_assert(b);
    p += sprintf(p, "{%s[", head);
    for (size_t i = 0; i < n; i++) {
        p += sprintf(p, "%s%s", i ? "," : "", item);
    }
    sprintf(p, "]%s}", tail);
    return b;
}

/* How many messages, tools and batch prompts a request may carry: the bound itself is accepted, one
 * more is a 400 naming the field and the limit (docs/RELIABILITY.md). */
Test(openai, counts_of_messages_tools_and_prompts_are_bounded)
{
    static const struct {
        enum kr_oai_kind kind;
        const char *head, *item, *tail, *param;
        size_t limit;
    } cases[] = {
        {KR_OAI_CHAT, "\"messages\":", "{\"role\":\"user\",\"content\":\"hi\"}", "", "messages", 4096},
        {KR_OAI_CHAT, USER_MSG ",\"tools\":",
         "{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\"}}}", "", "tools", 128},
        {KR_OAI_COMPLETIONS, "\"prompt\":", "\"hi\"", "", "prompt", 1024},
        {KR_OAI_COMPLETIONS, "\"prompt\":", "[1,2]", "", "prompt", 1024},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *at = repeated(cases[i].head, cases[i].item, cases[i].limit, cases[i].tail);
        struct kr_oai_request r;
        ok_body(cases[i].kind, at, &r);
        kr_oai_request_free(&r);
        free(at);
        char *over = repeated(cases[i].head, cases[i].item, cases[i].limit + 1, cases[i].tail);
        char msg[256] = "";
        bad_body(cases[i].kind, over, cases[i].param, msg, sizeof msg);
        char want[32];
        snprintf(want, sizeof want, "at most %zu", cases[i].limit);
        cr_expect(strstr(msg, want) != NULL, "%s: the message names the limit: %s", cases[i].param, msg);
        free(over);
    }
}

/* Nesting deeper than jansson's 2048 levels is malformed JSON with the reason (no stack runs out). */
Test(openai, nesting_beyond_2048_levels_is_refused)
{
    const size_t depth = 100000;
    char *b = malloc(depth * 2 + 64), *p = b;
    cr_assert(b);
    p += sprintf(p, "{\"prompt\":\"hi\",\"user\":");
    memset(p, '[', depth);
    memset(p + depth, ']', depth);
    strcpy(p + 2 * depth, "}");
    char msg[256] = "";
    bad_body(KR_OAI_COMPLETIONS, b, "", msg, sizeof msg);
    cr_expect(strstr(msg, "depth") != NULL, "the message says why: %s", msg);
    free(b);
}

/* Output constraints (structured outputs): OpenAI's response_format, vLLM's guided_* fields and its
 * structured_outputs object, each turned into one constraint; two at once, and bad values, are
 * 400s naming the fields. Whether a constraint compiles is the server's check. */
Test(openai, output_constraints_are_parsed_from_every_surface)
{
    struct kr_oai_request r;
    ok_with(KR_OAI_CHAT, "\"response_format\":{\"type\":\"text\"}", &r);
    cr_expect(!r.constraint.on);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"response_format\":{\"type\":\"json_object\"}", &r);
    cr_expect(r.constraint.on && r.constraint.kind == KR_GRAMMAR_JSON_OBJECT && !r.constraint.text);
    cr_expect_str_eq(r.constraint.param, "response_format");
    cr_expect_eq(r.constraint.max_ws, -1);
    kr_oai_request_free(&r);
    /* the schema is written compactly with its members in order */
    ok_with(KR_OAI_COMPLETIONS,
            "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p-1_x\",\"strict\":true,"
            "\"schema\":{\"type\":\"object\",\"properties\":{\"z\":{\"type\":\"integer\"},\"a\":{\"type\":\"string\"}}}}}",
            &r);
    cr_expect(r.constraint.on && r.constraint.kind == KR_GRAMMAR_JSON_SCHEMA);
    cr_expect_str_eq(r.constraint.text,
                     "{\"type\":\"object\",\"properties\":{\"z\":{\"type\":\"integer\"},\"a\":{\"type\":\"string\"}}}");
    cr_expect_eq(r.constraint.len, strlen(r.constraint.text));
    kr_oai_request_free(&r);
    ok_with(KR_OAI_COMPLETIONS, "\"guided_json\":{\"type\":\"array\"}", &r);
    cr_expect(r.constraint.kind == KR_GRAMMAR_JSON_SCHEMA);
    cr_expect_str_eq(r.constraint.text, "{\"type\":\"array\"}");
    cr_expect_str_eq(r.constraint.param, "guided_json");
    kr_oai_request_free(&r);
    ok_with(KR_OAI_COMPLETIONS, "\"guided_json\":\"{\\\"type\\\": \\\"string\\\"}\"", &r);
    cr_expect_str_eq(r.constraint.text, "{\"type\": \"string\"}", "a schema given as a string is taken as it is");
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"guided_regex\":\"[a-z]+\\\\d\"", &r);
    cr_expect(r.constraint.kind == KR_GRAMMAR_REGEX);
    cr_expect_str_eq(r.constraint.text, "[a-z]+\\d");
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"guided_choice\":[\"yes\",\"no\",\"caf\\u00e9\"]", &r);
    cr_expect(r.constraint.kind == KR_GRAMMAR_CHOICE);
    cr_expect_str_eq(r.constraint.text, "[\"yes\",\"no\",\"caf\xc3\xa9\"]");
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"guided_grammar\":\"root ::= \\\"a\\\"+\"", &r);
    cr_expect(r.constraint.kind == KR_GRAMMAR_GBNF);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"structured_outputs\":{\"json\":{\"type\":\"object\"},\"disable_any_whitespace\":true,"
                         "\"disable_fallback\":true}", &r);
    cr_expect(r.constraint.kind == KR_GRAMMAR_JSON_SCHEMA);
    cr_expect_eq(r.constraint.max_ws, 0);
    cr_expect_str_eq(r.constraint.param, "structured_outputs.json");
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"structured_outputs\":{\"json_object\":true}", &r);
    cr_expect(r.constraint.kind == KR_GRAMMAR_JSON_OBJECT);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"structured_outputs\":{\"choice\":[\"a\"]},\"guided_json\":null,\"response_format\":null", &r);
    cr_expect(r.constraint.kind == KR_GRAMMAR_CHOICE);
    kr_oai_request_free(&r);
    ok_with(KR_OAI_CHAT, "\"structured_outputs\":{\"regex\":\"x\"},\"response_format\":{\"type\":\"text\"}", &r);
    cr_expect(r.constraint.kind == KR_GRAMMAR_REGEX, "text is no constraint: no conflict");
    kr_oai_request_free(&r);

    /* two constraints: the second field is named, the message names both */
    char msg[1024];
    char body[1024];
    snprintf(body, sizeof body, "{%s,%s}", USER_MSG,
             "\"response_format\":{\"type\":\"json_object\"},\"guided_regex\":\"a\"");
    bad_body(KR_OAI_CHAT, body, "guided_regex", msg, sizeof msg);
    cr_expect(strstr(msg, "response_format") && strstr(msg, "guided_regex"), "%s", msg);
    bad_with(KR_OAI_CHAT, "\"guided_json\":{},\"guided_choice\":[\"a\"]", "guided_choice");
    bad_with(KR_OAI_CHAT, "\"guided_grammar\":\"root ::= \\\"a\\\"\",\"structured_outputs\":{\"regex\":\"a\"}",
             "structured_outputs.regex");
    bad_with(KR_OAI_CHAT, "\"structured_outputs\":{\"regex\":\"a\",\"choice\":[\"b\"]}", "structured_outputs.choice");
    bad_with(KR_OAI_CHAT, "\"structured_outputs\":{\"json\":{},\"json_object\":true}", "structured_outputs.json_object");

    /* bad values */
    bad_with(KR_OAI_CHAT, "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{}}",
             "response_format.json_schema.name");
    bad_with(KR_OAI_CHAT, "\"response_format\":{\"type\":\"json_schema\"}", "response_format.json_schema");
    bad_with(KR_OAI_CHAT, "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":[]}",
             "response_format.json_schema");
    bad_with(KR_OAI_CHAT, "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\"}}",
             "response_format.json_schema.schema");
    bad_with(KR_OAI_CHAT,
             "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"a b\",\"schema\":{}}}",
             "response_format.json_schema.name");
    bad_with(KR_OAI_CHAT,
             "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":\"{}\"}}",
             "response_format.json_schema.schema");
    bad_with(KR_OAI_CHAT,
             "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{},"
             "\"strict\":\"yes\"}}",
             "response_format.json_schema.strict");
    bad_with(KR_OAI_CHAT, "\"response_format\":{\"type\":\"structural_tag\"}", "response_format.type");
    bad_with(KR_OAI_CHAT, "\"response_format\":{\"type\":3}", "response_format");
    bad_with(KR_OAI_COMPLETIONS, "\"guided_json\":3", "guided_json");
    bad_with(KR_OAI_COMPLETIONS, "\"guided_json\":\"\"", "guided_json");
    bad_with(KR_OAI_COMPLETIONS, "\"guided_regex\":[\"a\"]", "guided_regex");
    bad_with(KR_OAI_COMPLETIONS, "\"guided_regex\":\"a\\u0000b\"", "guided_regex");
    bad_with(KR_OAI_COMPLETIONS, "\"guided_choice\":[]", "guided_choice");
    bad_with(KR_OAI_COMPLETIONS, "\"guided_choice\":\"yes\"", "guided_choice");
    bad_with(KR_OAI_COMPLETIONS, "\"guided_choice\":[\"a\",2]", "guided_choice[1]");
    bad_with(KR_OAI_COMPLETIONS, "\"guided_grammar\":\"\"", "guided_grammar");
    bad_with(KR_OAI_COMPLETIONS, "\"guided_regex\":\"a\",\"guided_whitespace_pattern\":\"[ ]*\"",
             "guided_whitespace_pattern");
    bad_with(KR_OAI_COMPLETIONS, "\"structured_outputs\":[1]", "structured_outputs");
    bad_with(KR_OAI_COMPLETIONS, "\"structured_outputs\":{\"json\":{},\"whitespace_pattern\":\" \"}",
             "structured_outputs.whitespace_pattern");
    bad_with(KR_OAI_COMPLETIONS, "\"structured_outputs\":{\"structural_tag\":\"{}\"}", "structured_outputs.structural_tag");
    bad_with(KR_OAI_COMPLETIONS, "\"structured_outputs\":{\"json\":{},\"disable_additional_properties\":true}",
             "structured_outputs.disable_additional_properties");
    bad_with(KR_OAI_COMPLETIONS, "\"structured_outputs\":{\"json_object\":1}", "structured_outputs.json_object");
    bad_with(KR_OAI_COMPLETIONS, "\"structured_outputs\":{\"regex\":\"a\",\"disable_any_whitespace\":\"no\"}",
             "structured_outputs.disable_any_whitespace");
    /* a long list of choices is bounded */
    char *many = repeated("\"prompt\":\"hi\",\"guided_choice\":", "\"x\"", 4097, "");
    bad_body(KR_OAI_COMPLETIONS, many, "guided_choice", NULL, 0);
    free(many);
}
