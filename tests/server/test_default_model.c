/* The trained default model (models/small-hybrid) served by `krait serve`, as a new user meets it:
 * greedy completions over HTTP equal HF transformers' greedy tokens on the reference prompts
 * (tests/fixtures/default/small-hybrid, from tools/default-model/reference.py), a chat request with
 * a tool comes back as that tool's call with the city the question names, and a greeting ends at
 * the model's end-of-turn token. */
#include "harness.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#define MODEL KR_SOURCE_DIR "/models/small-hybrid"
#define REF KR_SOURCE_DIR "/tests/fixtures/default/small-hybrid/reference.json"

static struct srv_proc srv;

static void start(void)
{
    srv_start(&srv, MODEL, "--device", "cpu", "--threads", "2", "--return-tokens-as-token-ids", NULL);
}

static void stop(void)
{
    srv_stop(&srv);
}

TestSuite(default_model, .init = start, .fini = stop, .timeout = 600);

/* HF's 12 greedy tokens after each reference prompt (ids sent as they are, no BOS added), compared
 * up to the first step whose HF top-2 margin is under 1e-3 (none in this reference). */
Test(default_model, greedy_completions_equal_hf_through_http)
{
    json_error_t je;
    json_t *ref = json_load_file(REF, 0, &je);
    cr_assert_not_null(ref, "%s: %s", REF, je.text);
    json_t *prompts = json_object_get(ref, "prompts");
    cr_assert(json_array_size(prompts) >= 4);
    size_t i;
    json_t *p;
    json_array_foreach(prompts, i, p)
    {
        json_t *req = json_pack("{s:O, s:i, s:f, s:b, s:i}", "prompt", json_object_get(p, "ids"), "max_tokens", 12,
                                "temperature", 0.0, "ignore_eos", 1, "logprobs", 0);
        char *body = json_dumps(req, JSON_COMPACT);
        long status = 0;
        json_t *res = post_json(&srv, "/v1/completions", body, &status);
        cr_assert_eq(status, 200, "prompt %zu: status %ld", i, status);
        json_t *toks = json_object_get(json_object_get(json_array_get(json_object_get(res, "choices"), 0), "logprobs"),
                                       "tokens");
        json_t *greedy = json_object_get(p, "greedy"), *margin = json_object_get(p, "greedy_margin");
        cr_assert_eq(json_array_size(toks), json_array_size(greedy), "prompt %zu: %zu tokens", i, json_array_size(toks));
        for (size_t t = 0; t < json_array_size(greedy); t++) {
            int id = -1;
            cr_assert_eq(sscanf(json_string_value(json_array_get(toks, t)), "token_id:%d", &id), 1);
            cr_expect_eq(id, (int)json_integer_value(json_array_get(greedy, t)), "prompt %zu (len %zu) token %zu: %d, HF %d",
                         i, json_array_size(json_object_get(p, "ids")), t, id,
                         (int)json_integer_value(json_array_get(greedy, t)));
            if (id != (int)json_integer_value(json_array_get(greedy, t)) ||
                json_real_value(json_array_get(margin, t)) < 1e-3) {
                break;
            }
        }
        json_decref(res);
        free(body);
        json_decref(req);
    }
    json_decref(ref);
}

/* The model was taught its template's tool-call format: asked for the weather with a weather tool
 * at hand, it answers with that call and the city of the question. */
Test(default_model, a_weather_question_becomes_a_tool_call)
{
    static const char *const cities[] = {"Paris", "Oslo", "Tokyo"};
    for (size_t c = 0; c < sizeof cities / sizeof cities[0]; c++) {
        char body[1024];
        snprintf(body, sizeof body,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"What is the weather in %s?\"}],\"temperature\":0,"
                 "\"max_tokens\":64,\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
                 "\"description\":\"Current weather in a city\",\"parameters\":{\"type\":\"object\",\"properties\":"
                 "{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}}]}",
                 cities[c]);
        long status = 0;
        json_t *res = post_json(&srv, "/v1/chat/completions", body, &status);
        cr_assert_eq(status, 200);
        json_t *ch = json_array_get(json_object_get(res, "choices"), 0);
        cr_expect_str_eq(json_string_value(json_object_get(ch, "finish_reason")), "tool_calls", "%s", cities[c]);
        json_t *call = json_array_get(json_object_get(json_object_get(ch, "message"), "tool_calls"), 0);
        cr_assert_not_null(call, "%s: no tool call", cities[c]);
        json_t *fn = json_object_get(call, "function");
        cr_expect_str_eq(json_string_value(json_object_get(fn, "name")), "get_weather");
        json_t *args = json_loads(json_string_value(json_object_get(fn, "arguments")), 0, NULL);
        cr_assert_not_null(args, "%s: arguments are not JSON", cities[c]);
        cr_expect_str_eq(json_string_value(json_object_get(args, "city")), cities[c]);
        json_decref(args);
        json_decref(res);
    }
}

/* A greeting gets an answer that ends by itself (the end-of-turn token, not max_tokens), in words. */
Test(default_model, a_greeting_gets_an_answer_that_ends)
{
    long status = 0;
    json_t *res = post_json(&srv, "/v1/chat/completions",
                            "{\"messages\":[{\"role\":\"user\",\"content\":\"Hello!\"}],\"temperature\":0,"
                            "\"max_tokens\":100}",
                            &status);
    cr_assert_eq(status, 200);
    json_t *ch = json_array_get(json_object_get(res, "choices"), 0);
    cr_expect_str_eq(json_string_value(json_object_get(ch, "finish_reason")), "stop");
    const char *text = json_string_value(json_object_get(json_object_get(ch, "message"), "content"));
    cr_assert_not_null(text);
    cr_expect_gt(strlen(text), 10, "%s", text);
    cr_expect_null(strstr(text, "<|"), "a special token leaked into the text: %s", text);
    json_decref(res);
}
