/* End-to-end: the real `krait serve` with the embedded default model (hybrid M/D/-/E layers,
 * DeepSeek-V3 tokenizer) on 127.0.0.1, driven with libcurl: every endpoint, the OpenAI shapes,
 * streaming, disconnects, concurrency and every error class. Expected token ids come from HF
 * tokenizers (tests/fixtures/tokenizer/deepseek_v3/expected.json). */
#include "harness.h"

#include <criterion/criterion.h>
#include <curl/curl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <netinet/in.h>
#include <sys/socket.h>

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

TestSuite(server, .init = start_default, .fini = stop_default, .timeout = 300);

static const char *str(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static void expect_error(json_t *j, long status, long want_status, const char *param)
{
    cr_expect_eq(status, want_status, "status %ld, expected %ld", status, want_status);
    json_t *e = json_object_get(j, "error");
    cr_assert(json_is_object(e), "no error object");
    cr_expect(json_is_string(json_object_get(e, "message")) && strlen(str(e, "message")) > 0);
    cr_expect(json_is_string(json_object_get(e, "type")));
    cr_expect(json_object_get(e, "code") != NULL, "error.code must be present (null allowed)");
    if (param) {
        cr_expect(json_is_string(json_object_get(e, "param")) && !strcmp(str(e, "param"), param),
                  "error.param is %s, expected %s", str(e, "param") ? str(e, "param") : "(null)", param);
    }
}

Test(server, health_models_version_and_unknown_routes)
{
    struct http_res r;
    http(&S, "GET", "/health", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    http_free(&r);
    http(&S, "GET", "/v1/models", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    json_t *j = json_loads(r.body, 0, NULL);
    http_free(&r);
    cr_assert(j);
    cr_expect_str_eq(str(j, "object"), "list");
    json_t *m = json_array_get(json_object_get(j, "data"), 0);
    cr_expect_str_eq(str(m, "id"), "tiny");
    cr_expect_str_eq(str(m, "object"), "model");
    cr_expect(json_is_integer(json_object_get(m, "created")));
    json_decref(j);
    http(&S, "GET", "/v1/nothing", NULL, NULL, &r);
    cr_expect_eq(r.status, 404);
    http_free(&r);
    http(&S, "GET", "/v1/completions", NULL, NULL, &r);
    cr_expect_eq(r.status, 405);
    cr_expect_str_eq(r.allow, "POST", "a 405 names the allowed method");
    http_free(&r);
    http(&S, "POST", "/v1/models", "{}", NULL, &r);
    cr_expect_eq(r.status, 405);
    cr_expect_str_eq(r.allow, "GET");
    http_free(&r);
    http(&S, "GET", "/metrics", NULL, NULL, &r);
    const char *k = "krait:http_requests_total{model_name=\"tiny\",status=\"405\"} ";
    const char *at = strstr(r.body, k);
    cr_assert(at, "no 405 class in /metrics");
    cr_expect_geq(strtod(at + strlen(k), NULL), 2, "405s counted apart");
    http_free(&r);
}

Test(server, a_model_is_retrieved_by_its_id_and_another_id_is_a_404_naming_it)
{
    struct http_res r;
    http(&S, "GET", "/v1/models", NULL, NULL, &r);
    json_t *list = json_loads(r.body, 0, NULL);
    http_free(&r);
    cr_assert(list);
    json_t *want = json_array_get(json_object_get(list, "data"), 0);
    http(&S, "GET", "/v1/models/tiny", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    json_t *m = json_loads(r.body, 0, NULL);
    http_free(&r);
    cr_assert(m);
    cr_expect(json_equal(m, want), "the retrieved model is the list's entry");
    json_decref(m);
    json_decref(list);
    http(&S, "GET", "/v1/models/nope-model", NULL, NULL, &r);
    json_t *e = json_loads(r.body, 0, NULL);
    expect_error(e, r.status, 404, "model");
    cr_expect(strstr(str(json_object_get(e, "error"), "message"), "nope-model"), "the error names the id");
    cr_expect_str_eq(str(json_object_get(e, "error"), "code"), "model_not_found");
    json_decref(e);
    http_free(&r);
    http(&S, "POST", "/v1/models/tiny", "{}", NULL, &r);
    cr_expect_eq(r.status, 405);
    cr_expect_str_eq(r.allow, "GET");
    http_free(&r);
}

/* stream_options.continuous_usage_stats (with include_usage, as vLLM): every chunk carries the
 * usage so far; its completion count matches the tokens streamed up to it (token_ids), the prompt
 * count is /tokenize's, and the last one agrees with the final usage event. */
Test(server, continuous_usage_stats_put_usage_on_every_chunk)
{
    long st;
    json_t *tk = post_json(&S, "/tokenize", "{\"prompt\":\"Count to ten\"}", &st);
    const json_int_t n_prompt = (json_int_t)json_array_size(json_object_get(tk, "tokens"));
    json_decref(tk);
    for (int chat = 0; chat < 2; chat++) {
        const char *body = chat ? "{\"messages\":[{\"role\":\"user\",\"content\":\"Count to ten\"}],\"max_tokens\":5,"
                                  "\"ignore_eos\":true,\"stream\":true,\"return_token_ids\":true,"
                                  "\"stream_options\":{\"include_usage\":true,\"continuous_usage_stats\":true}}"
                                : "{\"prompt\":\"Count to ten\",\"max_tokens\":5,\"ignore_eos\":true,\"stream\":true,"
                                  "\"return_token_ids\":true,"
                                  "\"stream_options\":{\"include_usage\":true,\"continuous_usage_stats\":true}}";
        char *raw = post_stream(&S, chat ? "/v1/chat/completions" : "/v1/completions", body, 0, &st);
        cr_assert_eq(st, 200);
        bool done = false;
        json_t *evs = sse_events(raw, &done);
        cr_expect(done);
        json_int_t seen = 0, last = -1, chat_prompt = -1;
        size_t n_ev = json_array_size(evs);
        cr_assert_geq(n_ev, 2);
        for (size_t i = 0; i < n_ev; i++) {
            json_t *ev = json_array_get(evs, i), *u = json_object_get(ev, "usage");
            cr_assert(json_is_object(u), "event %zu (chat %d) has no usage", i, chat);
            json_t *ch = json_array_get(json_object_get(ev, "choices"), 0);
            seen += (json_int_t)json_array_size(json_object_get(ch, "token_ids"));
            const json_int_t p = json_integer_value(json_object_get(u, "prompt_tokens"));
            const json_int_t c = json_integer_value(json_object_get(u, "completion_tokens"));
            cr_expect_eq(json_integer_value(json_object_get(u, "total_tokens")), p + c);
            if (chat) {
                chat_prompt = chat_prompt < 0 ? p : chat_prompt;
                cr_expect_eq(p, chat_prompt, "the prompt count stays");
            } else {
                cr_expect_eq(p, n_prompt, "the prompt's tokens as /tokenize counts them");
            }
            if (ch) {
                cr_expect_eq(c, seen, "event %zu: %lld completion tokens, %lld streamed", i, (long long)c,
                             (long long)seen);
            }
            cr_expect_geq(c, last, "never decreasing");
            last = c;
        }
        cr_expect_eq(last, 5, "the final usage counts every token");
        json_decref(evs);
        free(raw);
    }
}

/* Fields krait does not implement are refused over HTTP with the field named (what the SDK shows). */
Test(server, unimplemented_fields_are_400s_naming_them)
{
    static const char *const cases[][3] = {
        {"/v1/chat/completions", "\"service_tier\":\"auto\"", "service_tier"},
        {"/v1/chat/completions", "\"reasoning_effort\":\"high\"", "reasoning_effort"},
        {"/v1/chat/completions", "\"modalities\":[\"text\",\"audio\"],\"audio\":{\"voice\":\"alloy\",\"format\":\"wav\"}",
         "modalities"},
        {"/v1/chat/completions", "\"audio\":{\"voice\":\"alloy\",\"format\":\"wav\"}", "audio"},
        {"/v1/completions", "\"use_beam_search\":true", "use_beam_search"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char body[512];
        const bool chat = strstr(cases[i][0], "chat") != NULL;
        snprintf(body, sizeof body, "{%s,\"max_tokens\":2,%s}",
                 chat ? "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]" : "\"prompt\":\"hi\"", cases[i][1]);
        long st;
        json_t *j = post_json(&S, cases[i][0], body, &st);
        expect_error(j, st, 400, cases[i][2]);
        cr_expect(strstr(str(json_object_get(j, "error"), "message"), cases[i][2]), "the message names %s",
                  cases[i][2]);
        json_decref(j);
    }
}

/* A developer message reaches the prompt: DeepSeek-V3's template knows no such role, so it is the
 * system prompt, token for token what a system message gives (prompt ids from return_token_ids),
 * and the prompt differs from the one without it. */
Test(server, a_developer_message_is_the_system_prompt_where_the_template_has_no_developer_role)
{
    const char *sys[3] = {"{\"role\":\"developer\",\"content\":\"Answer in French.\"},",
                          "{\"role\":\"system\",\"content\":\"Answer in French.\"},", ""};
    json_t *ids[3];
    for (int i = 0; i < 3; i++) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"messages\":[%s{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":1,\"temperature\":0,"
                 "\"return_token_ids\":true}",
                 sys[i]);
        long st;
        json_t *j = post_json(&S, "/v1/chat/completions", body, &st);
        cr_assert_eq(st, 200, "%s", body);
        ids[i] = json_incref(json_object_get(j, "prompt_token_ids"));
        cr_assert(json_is_array(ids[i]));
        json_decref(j);
    }
    cr_expect(json_equal(ids[0], ids[1]), "a developer message is the system prompt");
    cr_expect(!json_equal(ids[0], ids[2]), "a developer message is not dropped");
    /* the text is in the prompt: /detokenize of its ids holds it */
    char *dumped = json_dumps(ids[0], JSON_COMPACT);
    char body[4096];
    snprintf(body, sizeof body, "{\"tokens\":%s}", dumped);
    free(dumped);
    long st;
    json_t *d = post_json(&S, "/detokenize", body, &st);
    cr_expect_eq(st, 200);
    cr_expect(strstr(str(d, "prompt"), "Answer in French."), "prompt: %s", str(d, "prompt"));
    json_decref(d);
    for (int i = 0; i < 3; i++) {
        json_decref(ids[i]);
    }
}

Test(server, completion_has_the_openai_shape)
{
    long st;
    json_t *j = post_json(&S, "/v1/completions",
                          "{\"model\":\"tiny\",\"prompt\":\"Hello, world!\",\"max_tokens\":5,\"temperature\":0}", &st);
    cr_assert_eq(st, 200);
    cr_expect(!strncmp(str(j, "id"), "cmpl-", 5));
    cr_expect_str_eq(str(j, "object"), "text_completion");
    cr_expect_str_eq(str(j, "model"), "tiny");
    cr_expect(json_is_integer(json_object_get(j, "created")));
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    cr_expect_eq(json_integer_value(json_object_get(c, "index")), 0);
    cr_expect(json_is_string(json_object_get(c, "text")));
    cr_expect_str_eq(str(c, "finish_reason"), "length");
    cr_expect(json_is_null(json_object_get(c, "logprobs")));
    json_t *u = json_object_get(j, "usage");
    /* the prompt's length as HF tokenizers counts it (corpus text 16, with BOS) */
    json_t *exp = json_load_file(KR_SOURCE_DIR "/tests/fixtures/tokenizer/deepseek_v3/expected.json", 0, NULL);
    json_t *corpus = json_load_file(KR_SOURCE_DIR "/tests/fixtures/tokenizer/corpus.json", 0, NULL);
    cr_assert(exp && corpus);
    cr_assert_str_eq(json_string_value(json_array_get(json_object_get(corpus, "texts"), 16)), "Hello, world!");
    json_int_t n_hf = -1;
    size_t ci;
    json_t *cs;
    json_array_foreach(json_object_get(exp, "cases"), ci, cs)
    {
        if (json_integer_value(json_object_get(cs, "i")) == 16) {
            n_hf = (json_int_t)json_array_size(json_object_get(cs, "ids_special"));
        }
    }
    cr_assert_gt(n_hf, 0);
    cr_expect_eq(json_integer_value(json_object_get(u, "prompt_tokens")), n_hf);
    cr_expect_eq(json_integer_value(json_object_get(u, "completion_tokens")), 5);
    cr_expect_eq(json_integer_value(json_object_get(u, "total_tokens")), n_hf + 5);
    json_decref(exp);
    json_decref(corpus);
    json_decref(j);
}

Test(server, greedy_is_deterministic_and_token_ids_round_trip)
{
    long st;
    const char *body = "{\"prompt\":[0,1000,2000,3000],\"max_tokens\":6,\"temperature\":0,\"return_token_ids\":true}";
    json_t *a = post_json(&S, "/v1/completions", body, &st);
    cr_assert_eq(st, 200);
    json_t *b = post_json(&S, "/v1/completions", body, &st);
    json_t *ca = json_array_get(json_object_get(a, "choices"), 0), *cb = json_array_get(json_object_get(b, "choices"), 0);
    cr_expect(json_equal(json_object_get(ca, "token_ids"), json_object_get(cb, "token_ids")));
    cr_expect_eq(json_array_size(json_object_get(ca, "token_ids")), 6);
    json_t *want = json_loads("[0,1000,2000,3000]", 0, NULL);
    cr_expect(json_equal(json_object_get(ca, "prompt_token_ids"), want), "vLLM puts prompt_token_ids in each choice");
    json_decref(want);
    /* the text is the detokenization of the ids */
    json_t *ids = json_object_get(ca, "token_ids");
    json_t *reqj = json_pack("{s:O}", "tokens", ids);
    char *req = json_dumps(reqj, 0);
    json_decref(reqj);
    json_t *d = post_json(&S, "/detokenize", req, &st);
    free(req);
    cr_expect_eq(st, 200);
    cr_expect_str_eq(str(d, "prompt"), str(ca, "text"));
    json_decref(d);
    json_decref(a);
    json_decref(b);
}

Test(server, array_prompts_and_n_choices)
{
    long st;
    json_t *j = post_json(&S, "/v1/completions",
                          "{\"prompt\":[\"one\",\"two two\"],\"n\":2,\"max_tokens\":3,\"temperature\":0.8,\"seed\":5}",
                          &st);
    cr_assert_eq(st, 200);
    json_t *ch = json_object_get(j, "choices");
    cr_assert_eq(json_array_size(ch), 4);
    for (size_t i = 0; i < 4; i++) {
        cr_expect_eq(json_integer_value(json_object_get(json_array_get(ch, i), "index")), (json_int_t)i);
    }
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 12);
    json_decref(j);
}

Test(server, logprobs_and_echo)
{
    long st;
    json_t *j = post_json(&S, "/v1/completions",
                          "{\"prompt\":\"a b c\",\"max_tokens\":3,\"temperature\":0,\"logprobs\":2,\"echo\":true}", &st);
    cr_assert_eq(st, 200);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    cr_expect(!strncmp(str(c, "text"), "a b c", 5), "echo puts the prompt first: %s", str(c, "text"));
    json_t *lp = json_object_get(c, "logprobs");
    cr_assert(json_is_object(lp));
    json_t *tl = json_object_get(lp, "token_logprobs"), *tops = json_object_get(lp, "top_logprobs");
    json_t *toks = json_object_get(lp, "tokens");
    /* BOS + 3 prompt tokens + 3 generated */
    cr_expect_eq(json_array_size(tl), 7);
    cr_expect_eq(json_array_size(toks), 7);
    cr_expect(json_is_null(json_array_get(tl, 0)), "the first prompt token has no logprob");
    for (size_t i = 1; i < 7; i++) {
        cr_expect(json_is_real(json_array_get(tl, i)) && json_real_value(json_array_get(tl, i)) <= 0.0);
    }
    json_t *last = json_array_get(tops, 6);
    cr_expect_eq(json_object_size(last), 2, "top_logprobs holds the 2 best");
    /* greedy: the chosen token's logprob equals the best alternative's */
    double best = -1e9;
    const char *k;
    json_t *v;
    json_object_foreach(last, k, v)
    {
        best = json_real_value(v) > best ? json_real_value(v) : best;
    }
    cr_expect(fabs(best - json_real_value(json_array_get(tl, 6))) < 1e-5);
    json_decref(j);

    j = post_json(&S, "/v1/chat/completions",
                  "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2,\"temperature\":0,"
                  "\"logprobs\":true,\"top_logprobs\":3}",
                  &st);
    cr_assert_eq(st, 200);
    c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *content = json_object_get(json_object_get(c, "logprobs"), "content");
    cr_assert_eq(json_array_size(content), 2);
    json_t *e0 = json_array_get(content, 0);
    cr_expect(json_is_string(json_object_get(e0, "token")));
    cr_expect(json_is_array(json_object_get(e0, "bytes")));
    cr_expect_eq(json_array_size(json_object_get(e0, "top_logprobs")), 3);
    json_decref(j);
}

/* The content of a special token named in the model's tokenizer_config.json ("bos_token"). */
static char *special_token(const char *key)
{
    json_t *cfg = json_load_file(MODEL "/tokenizer_config.json", 0, NULL);
    cr_assert(cfg);
    json_t *t = json_object_get(cfg, key);
    const char *v = json_is_string(t) ? json_string_value(t) : json_string_value(json_object_get(t, "content"));
    cr_assert(v, "%s in tokenizer_config.json", key);
    char *out = strdup(v);
    json_decref(cfg);
    return out;
}

/* The byte where code point `cp` of UTF-8 text s starts (strlen(s) past the end). */
static size_t cp_to_byte(const char *s, long long cp)
{
    size_t b = 0;
    for (long long i = 0; i < cp && s[b]; i++) {
        b++;
        while (((unsigned char)s[b] & 0xC0) == 0x80) {
            b++;
        }
    }
    return b;
}

Test(server, echo_text_offsets_index_the_returned_text)
{
    /* the prompt's tokens as /tokenize gives them: a BOS the echoed text does not hold, then the text */
    long st;
    json_t *tk = post_json(&S, "/tokenize", "{\"prompt\":\"Hi there, you\"}", &st);
    cr_assert_eq(st, 200);
    const size_t n_prompt = json_array_size(json_object_get(tk, "tokens"));
    json_decref(tk);
    cr_assert_geq(n_prompt, 3);
    char *bos = special_token("bos_token"), *eos = special_token("eos_token");
    for (int sampled = 0; sampled < 2; sampled++) {
        char body[256];
        snprintf(body, sizeof body,
                 "{\"prompt\":\"Hi there, you\",\"max_tokens\":6,\"logprobs\":1,\"echo\":true,%s}",
                 sampled ? "\"temperature\":1,\"seed\":7" : "\"temperature\":0");
        json_t *j = post_json(&S, "/v1/completions", body, &st);
        cr_assert_eq(st, 200);
        json_t *c = json_array_get(json_object_get(j, "choices"), 0);
        const char *text = str(c, "text");
        cr_assert(text && !strncmp(text, "Hi there, you", 13), "echo puts the prompt first: %s", text);
        json_t *lp = json_object_get(c, "logprobs");
        json_t *toks = json_object_get(lp, "tokens"), *offs = json_object_get(lp, "text_offset");
        cr_assert_eq(json_array_size(toks), n_prompt + 6);
        cr_assert_eq(json_array_size(offs), n_prompt + 6);
        cr_expect_str_eq(json_string_value(json_array_get(toks, 0)), bos, "the prompt's first token is the BOS");
        long long prev = 0, n_cp = 0;
        for (const char *q = text; *q; q++) {
            n_cp += ((unsigned char)*q & 0xC0) != 0x80;
        }
        for (size_t i = 0; i < json_array_size(toks); i++) {
            const long long off = json_integer_value(json_array_get(offs, i));
            const char *t = json_string_value(json_array_get(toks, i));
            cr_expect_geq(off, prev, "text_offset[%zu] = %lld goes back from %lld", i, off, prev);
            cr_expect_leq(off, n_cp, "text_offset[%zu] = %lld is past the text's %lld code points", i, off, n_cp);
            prev = off;
            /* special tokens the text skips, and pieces of a character (shown as U+FFFD), aside */
            if (!*t || !strcmp(t, bos) || !strcmp(t, eos) || strstr(t, "\xef\xbf\xbd")) {
                continue;
            }
            cr_expect(!strncmp(text + cp_to_byte(text, off), t, strlen(t)),
                      "token %zu \"%s\" is not at text_offset %lld of \"%s\"", i, t, off, text);
        }
        cr_expect_eq(json_integer_value(json_array_get(offs, n_prompt)), 13,
                     "the first generated token starts right after the echoed prompt");
        json_decref(j);
    }
    free(bos);
    free(eos);
}

/* "[a,b,...]" of a JSON array of ints with `extra` appended (-1: none); caller frees. */
static char *ids_json(json_t *ids, long long extra)
{
    char *out = malloc(16 * (json_array_size(ids) + 2) + 2), *p = out;
    p += sprintf(p, "[");
    for (size_t i = 0; i < json_array_size(ids); i++) {
        p += sprintf(p, "%s%lld", i ? "," : "", (long long)json_integer_value(json_array_get(ids, i)));
    }
    if (extra >= 0) {
        p += sprintf(p, ",%lld", extra);
    }
    sprintf(p, "]");
    return out;
}

/* prompt_logprobs in vLLM's shape, checked against a separate generation: the prompt P extended by
 * the token g that greedy decoding gives after it must report, at g's position, the logprob and the
 * alternatives that generating g reported; every position names its own prompt token; the prefix
 * cache (P was just computed) changes nothing; a bound of 20 as vLLM's max_logprobs. */
Test(server, prompt_logprobs_agree_with_the_generation_logprobs_of_the_same_position)
{
    long st;
    json_t *tk = post_json(&S, "/tokenize", "{\"prompt\":\"The quick brown fox\"}", &st);
    cr_assert_eq(st, 200);
    json_t *P = json_incref(json_object_get(tk, "tokens"));
    json_decref(tk);
    const size_t np = json_array_size(P);
    char *pj = ids_json(P, -1), body[4096];
    snprintf(body, sizeof body,
             "{\"prompt\":%s,\"max_tokens\":1,\"temperature\":0,\"logprobs\":5,\"return_token_ids\":true}", pj);
    json_t *a = post_json(&S, "/v1/completions", body, &st);
    cr_assert_eq(st, 200);
    json_t *ac = json_array_get(json_object_get(a, "choices"), 0);
    const json_int_t g = json_integer_value(json_array_get(json_object_get(ac, "token_ids"), 0));
    json_t *alp = json_object_get(ac, "logprobs");
    const double lg = json_real_value(json_array_get(json_object_get(alp, "token_logprobs"), 0));
    json_t *atop = json_array_get(json_object_get(alp, "top_logprobs"), 0);
    const char *gtext = json_string_value(json_array_get(json_object_get(alp, "tokens"), 0));

    char *pgj = ids_json(P, g);
    snprintf(body, sizeof body, "{\"prompt\":%s,\"max_tokens\":1,\"temperature\":0,\"prompt_logprobs\":5}", pgj);
    json_t *b = post_json(&S, "/v1/completions", body, &st);
    cr_assert_eq(st, 200, "%s", body);
    json_t *plp = json_object_get(json_array_get(json_object_get(b, "choices"), 0), "prompt_logprobs");
    cr_assert(json_is_array(plp), "choices[0].prompt_logprobs is a list");
    cr_assert_eq(json_array_size(plp), np + 1, "one entry per prompt token");
    cr_expect(json_is_null(json_array_get(plp, 0)), "the first has none");
    for (size_t i = 1; i <= np; i++) {
        json_t *d = json_array_get(plp, i);
        char key[16];
        snprintf(key, sizeof key, "%lld", (long long)(i < np ? json_integer_value(json_array_get(P, i)) : g));
        json_t *own = json_object_get(d, key);
        cr_assert(json_is_object(own), "entry %zu names its prompt token %s", i, key);
        cr_expect(json_is_real(json_object_get(own, "logprob")) && json_real_value(json_object_get(own, "logprob")) <= 0);
        const json_int_t rank = json_integer_value(json_object_get(own, "rank"));
        cr_expect_geq(rank, 1);
        cr_expect(json_is_string(json_object_get(own, "decoded_token")));
        cr_expect(json_object_size(d) == 5 || json_object_size(d) == 6, "entry %zu: the token and the 5 likeliest", i);
        if (json_object_size(d) == 5) {
            cr_expect_leq(rank, 5, "entry %zu: the token is among the 5 likeliest", i);
        }
    }
    /* g's position: what generating g said */
    char gkey[16];
    snprintf(gkey, sizeof gkey, "%lld", (long long)g);
    json_t *last = json_array_get(plp, np), *own = json_object_get(last, gkey);
    cr_expect(fabs(json_real_value(json_object_get(own, "logprob")) - lg) < 1e-3, "prompt %g vs generated %g",
              json_real_value(json_object_get(own, "logprob")), lg);
    cr_expect_eq(json_integer_value(json_object_get(own, "rank")), 1, "greedy took the likeliest");
    cr_expect_str_eq(json_string_value(json_object_get(own, "decoded_token")), gtext);
    double want[8], got[8];
    size_t nw = 0, ng = 0;
    const char *k;
    json_t *v;
    json_object_foreach(atop, k, v)
    {
        want[nw++] = json_real_value(v);
    }
    json_object_foreach(last, k, v)
    {
        got[ng++] = json_real_value(json_object_get(v, "logprob"));
    }
    cr_assert_eq(ng, nw, "as many alternatives as the generation reported");
    for (size_t i = 0; i < nw; i++) { /* the same values, whatever the order */
        bool found = false;
        for (size_t j = 0; j < ng; j++) {
            found |= fabs(want[i] - got[j]) < 1e-3;
        }
        cr_expect(found, "alternative %g of the generation is among the prompt's", want[i]);
    }
    /* P alone, its prefix cached by now: the same entries for the same positions */
    snprintf(body, sizeof body, "{\"prompt\":%s,\"max_tokens\":1,\"temperature\":0,\"prompt_logprobs\":5}", pj);
    json_t *c = post_json(&S, "/v1/completions", body, &st);
    json_t *cplp = json_object_get(json_array_get(json_object_get(c, "choices"), 0), "prompt_logprobs");
    cr_assert_eq(json_array_size(cplp), np);
    for (size_t i = 1; i < np; i++) {
        json_t *x = json_array_get(cplp, i), *y = json_array_get(plp, i);
        json_object_foreach(x, k, v)
        {
            json_t *w = json_object_get(y, k);
            cr_expect(w && fabs(json_real_value(json_object_get(v, "logprob")) -
                                json_real_value(json_object_get(w, "logprob"))) < 1e-4,
                      "entry %zu token %s differs with a cached prefix", i, k);
        }
    }
    json_decref(c);
    /* chat: at the top level, one entry per prompt token */
    json_t *ch = post_json(&S, "/v1/chat/completions",
                           "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1,\"prompt_logprobs\":0}",
                           &st);
    cr_assert_eq(st, 200);
    json_t *chp = json_object_get(ch, "prompt_logprobs");
    cr_assert(json_is_array(chp));
    cr_expect_eq((json_int_t)json_array_size(chp),
                 json_integer_value(json_object_get(json_object_get(ch, "usage"), "prompt_tokens")));
    cr_expect(json_is_null(json_array_get(chp, 0)));
    cr_expect_eq(json_object_size(json_array_get(chp, 1)), 1, "prompt_logprobs 0: the prompt token alone");
    json_decref(ch);
    /* bounds */
    json_t *e = post_json(&S, "/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":1,\"prompt_logprobs\":21}", &st);
    expect_error(e, st, 400, "prompt_logprobs");
    json_decref(e);
    e = post_json(&S, "/v1/chat/completions",
                  "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"prompt_logprobs\":2,\"stream\":true}", &st);
    expect_error(e, st, 400, "prompt_logprobs");
    json_decref(e);
    /* not asked: not there */
    json_t *n = post_json(&S, "/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":1}", &st);
    cr_expect_null(json_object_get(json_array_get(json_object_get(n, "choices"), 0), "prompt_logprobs"));
    json_decref(n);
    json_decref(a);
    json_decref(b);
    json_decref(P);
    free(pj);
    free(pgj);
}

/* A choice longer than the server's first allocation for its entries (32 tokens), whole and streamed:
 * every entry keeps its own alternatives, and under greedy decoding the chosen token is the best of
 * them (its logprob equals their maximum and its text is among them). The alternatives of the early
 * tokens used to point into an array that had moved when the choice grew. */
static void expect_greedy_entry(json_t *tl_i, json_t *tok_i, json_t *top_i, size_t want_top, size_t i)
{
    cr_assert(json_is_object(top_i), "entry %zu: top_logprobs is an object", i);
    cr_expect_eq(json_object_size(top_i), want_top, "entry %zu: %zu alternatives", i, json_object_size(top_i));
    double best = -1e30;
    const char *k;
    json_t *v;
    json_object_foreach(top_i, k, v)
    {
        cr_expect(json_is_real(v) && json_real_value(v) <= 0.0, "entry %zu: alternative %s", i, k);
        best = json_real_value(v) > best ? json_real_value(v) : best;
    }
    cr_expect(fabs(best - json_real_value(tl_i)) < 1e-5, "entry %zu: chosen %g, best alternative %g", i,
              json_real_value(tl_i), best);
    cr_expect(json_object_get(top_i, json_string_value(tok_i)) != NULL, "entry %zu: the chosen token %s is among the alternatives", i,
              json_string_value(tok_i));
}

Test(server, logprobs_of_a_long_choice)
{
    long st;
    json_t *j = post_json(&S, "/v1/completions",
                          "{\"prompt\":\"a b c\",\"max_tokens\":150,\"ignore_eos\":true,\"temperature\":0,"
                          "\"logprobs\":3,\"n\":2}",
                          &st);
    cr_assert_eq(st, 200);
    json_t *choices = json_object_get(j, "choices");
    cr_assert_eq(json_array_size(choices), 2);
    for (size_t c = 0; c < 2; c++) {
        json_t *lp = json_object_get(json_array_get(choices, c), "logprobs");
        json_t *tl = json_object_get(lp, "token_logprobs"), *tops = json_object_get(lp, "top_logprobs");
        json_t *toks = json_object_get(lp, "tokens");
        cr_assert_eq(json_array_size(tl), 150);
        cr_assert_eq(json_array_size(tops), 150);
        for (size_t i = 0; i < 150; i++) {
            expect_greedy_entry(json_array_get(tl, i), json_array_get(toks, i), json_array_get(tops, i), 3, i);
        }
    }
    json_decref(j);

    /* the same streamed: the entries arrive spread over the chunks */
    char *raw = post_stream(&S, "/v1/completions",
                            "{\"prompt\":\"a b c\",\"max_tokens\":150,\"ignore_eos\":true,\"temperature\":0,"
                            "\"logprobs\":3,\"stream\":true}",
                            0, &st);
    cr_assert_eq(st, 200);
    bool done = false;
    json_t *evs = sse_events(raw, &done);
    cr_expect(done, "the stream ends with [DONE]");
    size_t n = 0;
    for (size_t e = 0; e < json_array_size(evs); e++) {
        json_t *lp = json_object_get(json_array_get(json_object_get(json_array_get(evs, e), "choices"), 0), "logprobs");
        if (json_is_object(lp)) {
            json_t *tl = json_object_get(lp, "token_logprobs"), *tops = json_object_get(lp, "top_logprobs");
            json_t *toks = json_object_get(lp, "tokens");
            for (size_t i = 0; i < json_array_size(tl); i++, n++) {
                expect_greedy_entry(json_array_get(tl, i), json_array_get(toks, i), json_array_get(tops, i), 3, n);
            }
        }
    }
    cr_expect_eq(n, 150, "%zu entries streamed", n);
    json_decref(evs);
    free(raw);
}

Test(server, chat_completion_and_stream)
{
    long st;
    const char *msgs = "\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":"
                       "\"Say something.\"}]";
    char body[512];
    snprintf(body, sizeof body, "{%s,\"max_tokens\":4,\"temperature\":0}", msgs);
    json_t *j = post_json(&S, "/v1/chat/completions", body, &st);
    cr_assert_eq(st, 200);
    cr_expect(!strncmp(str(j, "id"), "chatcmpl-", 9));
    cr_expect_str_eq(str(j, "object"), "chat.completion");
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *m = json_object_get(c, "message");
    cr_expect_str_eq(str(m, "role"), "assistant");
    const char *full = str(m, "content");
    cr_assert(full);
    char *full_copy = strdup(full);
    json_decref(j);

    snprintf(body, sizeof body,
             "{%s,\"max_tokens\":4,\"temperature\":0,\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
             msgs);
    char *raw = post_stream(&S, "/v1/chat/completions", body, 0, &st);
    cr_assert_eq(st, 200);
    bool done;
    json_t *ev = sse_events(raw, &done);
    cr_expect(done, "the stream ends with data: [DONE]");
    size_t n = json_array_size(ev);
    cr_assert_geq(n, 3);
    json_t *first = json_array_get(ev, 0);
    cr_expect_str_eq(str(first, "object"), "chat.completion.chunk");
    json_t *delta0 = json_object_get(json_array_get(json_object_get(first, "choices"), 0), "delta");
    cr_expect(str(delta0, "role") && !strcmp(str(delta0, "role"), "assistant"), "the first chunk carries the role");
    /* concatenated deltas equal the non-streamed content; the finish reason comes last */
    char acc[4096] = {0};
    const char *finish = NULL;
    for (size_t i = 0; i + 1 < n; i++) {
        json_t *ch = json_array_get(json_object_get(json_array_get(ev, i), "choices"), 0);
        const char *piece = str(json_object_get(ch, "delta"), "content");
        if (piece) {
            strncat(acc, piece, sizeof acc - strlen(acc) - 1);
        }
        if (str(ch, "finish_reason")) {
            cr_expect(!finish, "two finish reasons");
            finish = str(ch, "finish_reason");
        }
    }
    cr_expect_str_eq(acc, full_copy);
    cr_expect(finish && !strcmp(finish, "length"));
    json_t *usage_chunk = json_array_get(ev, n - 1);
    cr_expect_eq(json_array_size(json_object_get(usage_chunk, "choices")), 0);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(usage_chunk, "usage"), "completion_tokens")), 4);
    free(full_copy);
    free(raw);
    json_decref(ev);
}

Test(server, stop_strings_and_stop_token_ids)
{
    long st;
    json_t *j = post_json(&S, "/v1/completions",
                          "{\"prompt\":\"The quick brown fox\",\"max_tokens\":12,\"temperature\":0,\"return_token_ids\":true}",
                          &st);
    cr_assert_eq(st, 200);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    const char *text = str(c, "text");
    json_t *ids = json_object_get(c, "token_ids");
    cr_assert(text && strlen(text) >= 4, "text too short to cut: '%s'", text);
    /* stop at a substring of the greedy text: the output is the text before its first occurrence */
    size_t L = strlen(text);
    char stop[8] = {0};
    memcpy(stop, text + L / 2, 2);
    size_t cut = (size_t)(strstr(text, stop) - text);
    json_t *req = json_pack("{s:s, s:i, s:f, s:[s]}", "prompt", "The quick brown fox", "max_tokens", 12,
                            "temperature", 0.0, "stop", stop);
    char *body = json_dumps(req, 0);
    json_t *k = post_json(&S, "/v1/completions", body, &st);
    free(body);
    json_decref(req);
    json_t *kc = json_array_get(json_object_get(k, "choices"), 0);
    cr_expect_eq(strlen(str(kc, "text")), cut, "stopped text '%s' (stop '%s' in '%s')", str(kc, "text"), stop, text);
    cr_expect(!strncmp(str(kc, "text"), text, cut));
    cr_expect_str_eq(str(kc, "finish_reason"), "stop");
    cr_expect_str_eq(str(kc, "stop_reason"), stop);
    json_decref(k);
    /* the same streamed: the text before the stop string, and exactly one chunk with a finish_reason
     * (the choice ends on the stop string, then again when the engine's cancel comes back) */
    req = json_pack("{s:s, s:i, s:f, s:[s], s:b}", "prompt", "The quick brown fox", "max_tokens", 12, "temperature",
                    0.0, "stop", stop, "stream", 1);
    body = json_dumps(req, 0);
    char *raw = post_stream(&S, "/v1/completions", body, 0, &st);
    free(body);
    json_decref(req);
    bool done = false;
    json_t *evs = sse_events(raw, &done);
    cr_expect(done);
    int finishes = 0;
    size_t streamed = 0;
    for (size_t i = 0; i < json_array_size(evs); i++) {
        json_t *ch = json_array_get(json_object_get(json_array_get(evs, i), "choices"), 0);
        const char *piece = str(ch, "text");
        streamed += piece ? strlen(piece) : 0;
        finishes += json_is_string(json_object_get(ch, "finish_reason"));
    }
    cr_expect_eq(finishes, 1, "%d chunks carry a finish_reason", finishes);
    cr_expect_eq(streamed, cut, "streamed %zu bytes, want the %zu before the stop string", streamed, cut);
    json_decref(evs);
    free(raw);
    /* a stop token id: generation ends on it */
    json_int_t third = json_integer_value(json_array_get(ids, 2));
    req = json_pack("{s:s, s:i, s:f, s:[I]}", "prompt", "The quick brown fox", "max_tokens", 12, "temperature", 0.0,
                    "stop_token_ids", third);
    body = json_dumps(req, 0);
    k = post_json(&S, "/v1/completions", body, &st);
    free(body);
    json_decref(req);
    kc = json_array_get(json_object_get(k, "choices"), 0);
    cr_expect_str_eq(str(kc, "finish_reason"), "stop");
    cr_expect_eq(json_integer_value(json_object_get(kc, "stop_reason")), third);
    cr_expect_leq(json_integer_value(json_object_get(json_object_get(k, "usage"), "completion_tokens")), 3);
    json_decref(k);
    json_decref(j);
}

Test(server, every_error_class)
{
    long st;
    json_t *j = post_json(&S, "/v1/completions", "{\"prompt\": \"x\",", &st);
    expect_error(j, st, 400, NULL);
    json_decref(j);
    j = post_json(&S, "/v1/completions", "{\"prompt\":\"x\",\"temperature\":\"hot\"}", &st);
    expect_error(j, st, 400, "temperature");
    json_decref(j);
    j = post_json(&S, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":0}", &st);
    expect_error(j, st, 400, "max_tokens");
    json_decref(j);
    j = post_json(&S, "/v1/completions", "{\"prompt\":\"x\",\"n\":0}", &st);
    expect_error(j, st, 400, "n");
    json_decref(j);
    j = post_json(&S, "/v1/chat/completions", "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", &st);
    expect_error(j, st, 400, NULL);
    json_decref(j);
    j = post_json(&S, "/v1/completions", "{\"model\":\"gpt-9\",\"prompt\":\"x\"}", &st);
    expect_error(j, st, 404, "model");
    json_decref(j);
    /* longer than max_model_len (4096) */
    size_t n = 4200 * 2 + 64;
    char *big = malloc(n);
    strcpy(big, "{\"prompt\":\"");
    for (int i = 0; i < 4200; i++) {
        strcat(big, "a ");
    }
    strcat(big, "\"}");
    j = post_json(&S, "/v1/completions", big, &st);
    expect_error(j, st, 400, NULL);
    cr_expect_str_eq(str(json_object_get(j, "error"), "code"), "context_length_exceeded");
    json_decref(j);
    free(big);
    j = post_json(&S, "/v1/completions", "{\"prompt\":[1,2,999999]}", &st);
    expect_error(j, st, 400, NULL);
    json_decref(j);
    /* the field at fault is named when the engine finds it */
    j = post_json(&S, "/v1/completions", "{\"prompt\":\"x\",\"logit_bias\":{\"999999999\":1}}", &st);
    expect_error(j, st, 400, "logit_bias");
    json_decref(j);
    j = post_json(&S, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2,\"min_tokens\":5}", &st);
    expect_error(j, st, 400, "min_tokens");
    json_decref(j);
    /* NUL inside names: no model and no role is "x\u0000y" */
    j = post_json(&S, "/v1/completions", "{\"model\":\"tiny\\u0000evil\",\"prompt\":\"x\"}", &st);
    expect_error(j, st, 400, "model");
    json_decref(j);
    j = post_json(&S, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\\u0000x\",\"content\":\"hi\"}]}", &st);
    expect_error(j, st, 400, "messages[0].role");
    json_decref(j);
    /* /tokenize: malformed JSON (an invalid UTF-8 byte) is named as such; a NUL inside the text is text */
    j = post_json(&S, "/tokenize", "{\"prompt\":\"a\xff\"}", &st);
    expect_error(j, st, 400, NULL);
    cr_expect(strstr(str(json_object_get(j, "error"), "message"), "malformed JSON"), "%s",
              str(json_object_get(j, "error"), "message"));
    json_decref(j);
    j = post_json(&S, "/tokenize", "{\"prompt\":\"a\\u0000b\"}", &st);
    cr_expect_eq(st, 200);
    cr_expect_geq(json_integer_value(json_object_get(j, "count")), 3, "the NUL and what follows were tokenized");
    json_decref(j);
    j = post_json(&S, "/detokenize", "[1,2", &st);
    expect_error(j, st, 400, NULL);
    json_decref(j);
    /* 12 MB of text cannot fit in 4096 tokens: refused by its length before it is tokenized, for the
     * completion and the chat endpoint alike */
    const size_t nb = (size_t)12 << 20;
    char *huge = malloc(nb + 128);
    cr_assert(huge);
    for (int chat = 0; chat < 2; chat++) {
        size_t o = (size_t)sprintf(huge, chat ? "{\"messages\":[{\"role\":\"user\",\"content\":\"" : "{\"prompt\":\"");
        for (size_t i = 0; i < nb; i++) {
            huge[o++] = "ab cd"[i % 5];
        }
        strcpy(huge + o, chat ? "\"}]}" : "\"}");
        j = post_json(&S, chat ? "/v1/chat/completions" : "/v1/completions", huge, &st);
        expect_error(j, st, 400, chat ? "messages" : "prompt");
        cr_expect_str_eq(str(json_object_get(j, "error"), "code"), "context_length_exceeded");
        cr_expect(strstr(str(json_object_get(j, "error"), "message"), "bytes"), "%s",
                  str(json_object_get(j, "error"), "message"));
        json_decref(j);
    }
    free(huge);
}

Test(server, tokenize_matches_hf_tokenizers)
{
    /* corpus cases with HF tokenizers' ids (add_special_tokens = true) */
    json_t *corpus = json_load_file(KR_SOURCE_DIR "/tests/fixtures/tokenizer/corpus.json", 0, NULL);
    json_t *exp = json_load_file(KR_SOURCE_DIR "/tests/fixtures/tokenizer/deepseek_v3/expected.json", 0, NULL);
    cr_assert(corpus && exp);
    json_t *texts = json_is_array(corpus) ? corpus : json_object_get(corpus, "texts");
    json_t *cases = json_object_get(exp, "cases");
    cr_assert(json_is_array(texts) && json_is_array(cases));
    int checked = 0;
    for (size_t i = 0; i < json_array_size(cases) && checked < 25; i += 3) {
        json_t *cs = json_array_get(cases, i);
        json_t *t = json_array_get(texts, (size_t)json_integer_value(json_object_get(cs, "i")));
        if (json_is_object(t)) {
            t = json_object_get(t, "text");
        }
        if (!json_is_string(t)) {
            continue;
        }
        json_t *req = json_pack("{s:O}", "prompt", t);
        char *body = json_dumps(req, 0);
        long st;
        json_t *res = post_json(&S, "/tokenize", body, &st);
        cr_expect_eq(st, 200);
        cr_expect(json_equal(json_object_get(res, "tokens"), json_object_get(cs, "ids_special")), "case %zu", i);
        cr_expect_eq(json_integer_value(json_object_get(res, "count")),
                     (json_int_t)json_array_size(json_object_get(cs, "ids_special")));
        free(body);
        json_decref(req);
        json_decref(res);
        checked++;
    }
    cr_expect_gt(checked, 10);
    json_decref(corpus);
    json_decref(exp);
}

struct conc {
    int ok;
};

static void *one_request(void *arg)
{
    struct conc *c = arg;
    struct http_res r;
    http(&S, "POST", "/v1/completions", "{\"prompt\":\"parallel\",\"max_tokens\":8,\"temperature\":0}", NULL, &r);
    c->ok = r.status == 200 && strstr(r.body, "\"finish_reason\":\"length\"") != NULL;
    http_free(&r);
    return NULL;
}

Test(server, many_concurrent_requests)
{
    enum { N = 24 };
    pthread_t th[N];
    struct conc c[N];
    for (int i = 0; i < N; i++) {
        c[i].ok = 0;
        pthread_create(&th[i], NULL, one_request, &c[i]);
    }
    int ok = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        ok += c[i].ok;
    }
    cr_expect_eq(ok, N, "%d of %d concurrent requests succeeded", ok, N);
}

Test(server, disconnect_mid_stream_frees_the_sequence)
{
    long st;
    char *raw = post_stream(&S, "/v1/completions",
                            "{\"prompt\":\"go on\",\"max_tokens\":3000,\"temperature\":1,\"stream\":true,\"ignore_eos\":true}",
                            400, &st);
    free(raw);
    /* the engine must drop the sequence promptly: running goes back to 0 */
    double running = 1;
    for (int i = 0; i < 200 && running != 0; i++) {
        usleep(50000);
        running = metric(&S, "krait:num_requests_running");
    }
    cr_expect_eq(running, 0, "the disconnected request still runs");
    double used = metric(&S, "krait:kv_cache_usage_perc");
    cr_expect_eq(used, 0, "cache blocks still in use after the disconnect");
    cr_expect_gt(metric(&S, "krait:generation_tokens_total"), 0);
}

Test(server, metrics_are_prometheus_text)
{
    long st;
    json_t *j = post_json(&S, "/v1/completions", "{\"prompt\":\"m\",\"max_tokens\":2}", &st);
    json_decref(j);
    struct http_res r;
    http(&S, "GET", "/metrics", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    cr_expect(strstr(r.content_type, "text/plain"));
    static const char *const names[] = {
        "# TYPE krait:num_requests_running gauge", "# TYPE krait:num_requests_waiting gauge",
        "# TYPE krait:prompt_tokens_total counter", "# TYPE krait:generation_tokens_total counter",
        "# TYPE krait:time_to_first_token_seconds histogram", "# TYPE krait:inter_token_latency_seconds histogram",
        "# TYPE krait:e2e_request_latency_seconds histogram", "# TYPE krait:request_queue_time_seconds histogram",
        "# TYPE krait:kv_cache_usage_perc gauge", "# TYPE krait:num_preemptions_total counter",
        "# TYPE krait:engine_steps_total counter", "# TYPE krait:engine_step_host_gap_seconds summary",
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        cr_expect(strstr(r.body, names[i]), "missing %s", names[i]);
    }
    cr_expect(strstr(r.body, "krait:time_to_first_token_seconds_count{model_name=\"tiny\"} "));
    http_free(&r);
    /* the 2-token completion ran back-to-back steps: the gap summary counts them */
    cr_expect_gt(metric(&S, "krait:engine_steps_total"), 1);
    cr_expect_gt(metric(&S, "krait:engine_step_host_gap_seconds_count"), 0);
    cr_expect_geq(metric(&S, "krait:engine_step_host_gap_seconds_sum"), 0);
}

/* The first sample of `name` (any labels) in a /metrics body; NaN if absent. */
static double body_metric(const char *body, const char *name)
{
    char key[160];
    snprintf(key, sizeof key, "\n%s{", name);
    const char *p = strstr(body, key);
    p = p ? strchr(p + 1, '}') : NULL;
    return p ? strtod(p + 1, NULL) : NAN;
}

/* Le values of the buckets of histogram `name` in a /metrics body, in order (without +Inf). */
static int bucket_les(const char *body, const char *name, double *le, int cap)
{
    char key[128];
    snprintf(key, sizeof key, "\n%s_bucket{", name);
    int n = 0;
    for (const char *p = strstr(body, key); p && n < cap; p = strstr(p + 1, key)) {
        const char *q = strstr(p, "le=\"");
        const char *eol = strchr(p + 1, '\n');
        if (!q || (eol && q > eol) || !strncmp(q + 4, "+Inf", 4)) {
            continue;
        }
        le[n++] = strtod(q + 4, NULL);
    }
    return n;
}

/* vLLM's metric names, beside krait's with the same values, so that endpoint pickers (the Gateway API
 * inference extension reads vllm:num_requests_waiting, vllm:num_requests_running,
 * vllm:kv_cache_usage_perc) and vLLM dashboards work unchanged; the histograms with vLLM's buckets as
 * its metrics code defines them (vllm/v1/metrics/loggers.py). */
Test(server, metrics_have_vllm_names)
{
    long st;
    json_t *j = post_json(&S, "/v1/completions", "{\"prompt\":\"v\",\"max_tokens\":3}", &st);
    cr_expect_eq(st, 200);
    json_decref(j);
    static const char *const same[] = {
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
        "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
        "request_success_total", "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count", "request_queue_time_seconds_count", "e2e_request_latency_seconds_sum",
    };
    /* one scrape: other tests' requests may move the values between two */
    struct http_res r;
    http(&S, "GET", "/metrics", NULL, NULL, &r);
    cr_assert_eq(r.status, 200);
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        char k[96], v[96];
        snprintf(k, sizeof k, "krait:%s", same[i]);
        snprintf(v, sizeof v, "vllm:%s", same[i]);
        const double a = body_metric(r.body, k), b = body_metric(r.body, v);
        cr_expect(!isnan(a) && !isnan(b), "%s or %s missing", k, v);
        cr_expect(a == b, "%s = %g, %s = %g", v, b, k, a);
    }
    cr_expect_eq(body_metric(r.body, "vllm:time_per_output_token_seconds_count"),
                 body_metric(r.body, "krait:inter_token_latency_seconds_count"));
    cr_expect_gt(body_metric(r.body, "vllm:generation_tokens_total"), 0);
    static const char *const types[] = {
        "# TYPE vllm:num_requests_running gauge", "# TYPE vllm:num_requests_waiting gauge",
        "# TYPE vllm:kv_cache_usage_perc gauge", "# TYPE vllm:request_success_total counter",
        "# TYPE vllm:time_to_first_token_seconds histogram", "# TYPE vllm:time_per_output_token_seconds histogram",
        "# TYPE vllm:e2e_request_latency_seconds histogram", "# TYPE vllm:request_queue_time_seconds histogram",
        "vllm:request_success_total{model_name=\"tiny\",finished_reason=\"length\"} ",
    };
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        cr_expect(strstr(r.body, types[i]), "missing %s", types[i]);
    }
    /* vLLM's bucket boundaries (seconds) */
    static const double ttft[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,  0.1,   0.25,  0.5,    0.75,
                                  1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
    static const double tpot[] = {0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2,  0.3,  0.4, 0.5,
                                  0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
    static const double lat[] = {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
                                 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
    const struct {
        const char *name;
        const double *le;
        int n;
    } hs[] = {
        {"vllm:time_to_first_token_seconds", ttft, (int)(sizeof ttft / sizeof ttft[0])},
        {"vllm:inter_token_latency_seconds", tpot, (int)(sizeof tpot / sizeof tpot[0])},
        {"vllm:time_per_output_token_seconds", tpot, (int)(sizeof tpot / sizeof tpot[0])},
        {"vllm:e2e_request_latency_seconds", lat, (int)(sizeof lat / sizeof lat[0])},
        {"vllm:request_queue_time_seconds", lat, (int)(sizeof lat / sizeof lat[0])},
    };
    for (size_t i = 0; i < sizeof hs / sizeof hs[0]; i++) {
        double le[64];
        const int n = bucket_les(r.body, hs[i].name, le, 64);
        cr_expect_eq(n, hs[i].n, "%s: %d buckets, vLLM has %d", hs[i].name, n, hs[i].n);
        for (int k = 0; k < n && k < hs[i].n; k++) {
            cr_expect(le[k] == hs[i].le[k], "%s bucket %d: le %g, vLLM's %g", hs[i].name, k, le[k], hs[i].le[k]);
        }
    }
    http_free(&r);
}

/* ---- servers with other flags -------------------------------------------------------------------- */

/* The key guards the /v1/ routes and the tokenizing ones (work a client without the key must not be able
 * to queue); probes and scrapers need none. */
Test(server_flags, api_key_guards_v1_and_tokenizing)
{
    struct srv_proc p;
    srv_start(&p, MODEL, "--api-key", "sekrit", "--api-key", "other", NULL);
    struct http_res r;
    http(&p, "GET", "/v1/models", NULL, NULL, &r);
    cr_expect_eq(r.status, 401);
    cr_expect(strstr(r.body, "\"error\""));
    http_free(&r);
    http(&p, "GET", "/v1/models", NULL, "wrong", &r);
    cr_expect_eq(r.status, 401);
    http_free(&r);
    http(&p, "GET", "/v1/models", NULL, "other", &r);
    cr_expect_eq(r.status, 200);
    http_free(&r);
    http(&p, "GET", "/health", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    http_free(&r);
    http(&p, "GET", "/metrics", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    http_free(&r);
    http(&p, "GET", "/version", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    http_free(&r);
    const char *paths[2] = {"/tokenize", "/detokenize"};
    const char *bodies[2] = {"{\"prompt\":\"hello\"}", "{\"tokens\":[1,2]}"};
    for (int i = 0; i < 2; i++) {
        http(&p, "POST", paths[i], bodies[i], NULL, &r);
        cr_expect_eq(r.status, 401, "%s without the key: %ld", paths[i], r.status);
        cr_expect(r.body && strstr(r.body, "\"error\""));
        http_free(&r);
        http(&p, "POST", paths[i], bodies[i], "sekrit", &r);
        cr_expect_eq(r.status, 200, "%s with the key: %ld %s", paths[i], r.status, r.body ? r.body : "");
        http_free(&r);
    }
    cr_expect_eq(srv_stop(&p), 0);
}

/* Sends only the headers of a POST declaring a body of `declared` bytes, then waits up to 5 s for
 * an answer without sending the body; returns the status line's code, 0 when none came. */
/* CORS with vLLM's defaults: every origin, method and header allowed; a preflight needs no key. */
Test(server_flags, cors_defaults_allow_every_origin_and_preflights_need_no_key)
{
    struct srv_proc p;
    srv_start(&p, MODEL, "--served-model-name", "tiny", "--api-key", "sekrit", NULL);
    struct http_res r;
    char v[512];
    const char *pre[] = {"Origin: https://app.example", "Access-Control-Request-Method: POST",
                         "Access-Control-Request-Headers: authorization, content-type, x-stainless-os", NULL};
    http_with(&p, "OPTIONS", "/v1/chat/completions", NULL, pre, &r);
    cr_expect(r.status == 204 || r.status == 200, "a preflight without the key: %ld", r.status);
    cr_expect_str_eq(http_header(&r, "Access-Control-Allow-Origin", v, sizeof v) ? v : "(none)", "*");
    cr_expect(http_header(&r, "Access-Control-Allow-Methods", v, sizeof v) && strstr(v, "POST"), "methods: %s", v);
    cr_expect(http_header(&r, "Access-Control-Allow-Headers", v, sizeof v) && strstr(v, "authorization") &&
                  strstr(v, "x-stainless-os"),
              "headers: %s", v);
    http_free(&r);
    /* every answer to an allowed origin says so: a 200, a 401, a 404, a stream */
    const char *from[] = {"Origin: https://app.example", "Authorization: Bearer sekrit", NULL};
    http_with(&p, "GET", "/v1/models", NULL, from, &r);
    cr_expect_eq(r.status, 200);
    cr_expect_str_eq(http_header(&r, "Access-Control-Allow-Origin", v, sizeof v) ? v : "(none)", "*");
    http_free(&r);
    const char *nokey[] = {"Origin: https://app.example", NULL};
    http_with(&p, "GET", "/v1/models", NULL, nokey, &r);
    cr_expect_eq(r.status, 401);
    cr_expect(http_header(&r, "Access-Control-Allow-Origin", v, sizeof v) != NULL, "a 401 carries it too");
    http_free(&r);
    http_with(&p, "POST", "/v1/completions",
              "{\"prompt\":\"a\",\"max_tokens\":2,\"stream\":true}", from, &r);
    cr_expect_eq(r.status, 200);
    cr_expect(http_header(&r, "Access-Control-Allow-Origin", v, sizeof v) != NULL, "a stream carries it");
    http_free(&r);
    /* no Origin: no CORS headers */
    http(&p, "GET", "/health", NULL, NULL, &r);
    cr_expect_null(http_header(&r, "Access-Control-Allow-Origin", v, sizeof v));
    http_free(&r);
    cr_expect_eq(srv_stop(&p), 0);
}

Test(server_flags, cors_lists_restrict_origins_methods_and_headers)
{
    struct srv_proc p;
    srv_start(&p, MODEL, "--allowed-origins", "[\"https://good.example\"]", "--allowed-methods", "GET,POST,OPTIONS",
              "--allowed-headers", "[\"Content-Type\", \"Authorization\"]", "--allow-credentials", NULL);
    struct http_res r;
    char v[512];
    const char *good[] = {"Origin: https://good.example", "Access-Control-Request-Method: POST",
                          "Access-Control-Request-Headers: content-type", NULL};
    http_with(&p, "OPTIONS", "/v1/completions", NULL, good, &r);
    cr_expect(r.status == 204 || r.status == 200, "%ld", r.status);
    cr_expect_str_eq(http_header(&r, "Access-Control-Allow-Origin", v, sizeof v) ? v : "(none)",
                     "https://good.example", "with credentials the origin is echoed");
    cr_expect_str_eq(http_header(&r, "Access-Control-Allow-Credentials", v, sizeof v) ? v : "(none)", "true");
    cr_expect_str_eq(http_header(&r, "Access-Control-Allow-Methods", v, sizeof v) ? v : "(none)", "GET, POST, OPTIONS");
    http_free(&r);
    const char *bad_origin[] = {"Origin: https://evil.example", "Access-Control-Request-Method: POST", NULL};
    http_with(&p, "OPTIONS", "/v1/completions", NULL, bad_origin, &r);
    cr_expect_eq(r.status, 400);
    cr_expect_null(http_header(&r, "Access-Control-Allow-Origin", v, sizeof v));
    http_free(&r);
    const char *bad_method[] = {"Origin: https://good.example", "Access-Control-Request-Method: DELETE", NULL};
    http_with(&p, "OPTIONS", "/v1/completions", NULL, bad_method, &r);
    cr_expect_eq(r.status, 400);
    http_free(&r);
    const char *bad_header[] = {"Origin: https://good.example", "Access-Control-Request-Method: POST",
                                "Access-Control-Request-Headers: content-type, x-custom", NULL};
    http_with(&p, "OPTIONS", "/v1/completions", NULL, bad_header, &r);
    cr_expect_eq(r.status, 400);
    cr_expect(strstr(r.body, "x-custom"), "the error names the header: %s", r.body);
    http_free(&r);
    const char *evil[] = {"Origin: https://evil.example", NULL};
    http_with(&p, "GET", "/v1/models", NULL, evil, &r);
    cr_expect_eq(r.status, 200, "CORS is the browser's check: the answer is given, without the header");
    cr_expect_null(http_header(&r, "Access-Control-Allow-Origin", v, sizeof v));
    http_free(&r);
    cr_expect_eq(srv_stop(&p), 0);
}

static int answer_before_body(const struct srv_proc *p, const char *path, const char *auth, size_t declared)
{
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)p->port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    char req[512];
    const int n = snprintf(req, sizeof req,
                           "POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n%s%s%s"
                           "Content-Length: %zu\r\n\r\n",
                           path, auth ? "Authorization: Bearer " : "", auth ? auth : "", auth ? "\r\n" : "", declared);
    cr_assert_eq(send(fd, req, (size_t)n, 0), n);
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char buf[256] = {0};
    const ssize_t got = recv(fd, buf, sizeof buf - 1, 0);
    close(fd);
    int code = 0;
    if (got > 0) {
        sscanf(buf, "HTTP/1.%*d %d", &code);
    }
    return code;
}

/* Refusals that need no body come before the body is read: a client without the key, or one that
 * declares a body over --max-request-bytes, is answered at once and buffers nothing (the server
 * used to read up to the limit first); an authorized request of a size within the limit still
 * waits for its body. */
Test(server_flags, refusals_come_before_the_body)
{
    struct srv_proc p;
    srv_start(&p, MODEL, "--api-key", "sekrit", "--max-request-bytes", "1000000", NULL);
    cr_expect_eq(answer_before_body(&p, "/v1/completions", NULL, 900000), 401, "no key: 401 before the body");
    cr_expect_eq(answer_before_body(&p, "/tokenize", "wrong", 900000), 401, "a wrong key: 401 before the body");
    cr_expect_eq(answer_before_body(&p, "/v1/chat/completions", "sekrit", 50000000), 413,
                 "a declared body over the limit: 413 before the body");
    cr_expect_eq(answer_before_body(&p, "/v1/completions", "sekrit", 1000), 0, "an allowed request waits for its body");
    /* the server goes on serving */
    struct http_res r;
    http(&p, "GET", "/v1/models", NULL, "sekrit", &r);
    cr_expect_eq(r.status, 200);
    http_free(&r);
    cr_expect_eq(srv_stop(&p), 0);
}

Test(server_flags, body_limit_is_413)
{
    struct srv_proc p;
    srv_start(&p, MODEL, "--max-request-bytes", "1K", NULL);
    char body[4096];
    snprintf(body, sizeof body, "{\"prompt\":\"%0*d\"}", 3000, 0);
    struct http_res r;
    http(&p, "POST", "/v1/completions", body, NULL, &r);
    cr_expect_eq(r.status, 413);
    http_free(&r);
    cr_expect_eq(srv_stop(&p), 0);
}

struct bg {
    struct srv_proc *p;
    long status;
};

static void *long_stream(void *arg)
{
    struct bg *b = arg;
    char *raw = post_stream(b->p, "/v1/completions",
                            "{\"prompt\":\"x\",\"max_tokens\":200,\"stream\":true,\"ignore_eos\":true}", 0, &b->status);
    free(raw);
    return NULL;
}

Test(server_flags, full_queue_is_429_with_retry_after_and_sigterm_drains)
{
    struct srv_proc p;
    srv_start(&p, MODEL, "--max-num-seqs", "1", "--max-queued-requests", "1", NULL);
    struct bg a = {.p = &p}, b = {.p = &p};
    pthread_t ta, tb;
    pthread_create(&ta, NULL, long_stream, &a);
    double running = 0;
    for (int i = 0; i < 200 && running < 1; i++) {
        usleep(20000);
        running = metric(&p, "krait:num_requests_running");
    }
    pthread_create(&tb, NULL, long_stream, &b);
    double waiting = 0;
    for (int i = 0; i < 200 && waiting < 1; i++) {
        usleep(20000);
        waiting = metric(&p, "krait:num_requests_waiting");
    }
    struct http_res r;
    http(&p, "POST", "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2}", NULL, &r);
    cr_expect_eq(r.status, 429, "a third request while one runs and one waits: %ld", r.status);
    cr_expect_str_eq(r.retry_after, "1");
    http_free(&r);
    /* SIGTERM: both accepted requests still complete, then the process exits 0 */
    kill(p.pid, SIGTERM);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    cr_expect_eq(a.status, 200);
    cr_expect_eq(b.status, 200);
    cr_expect_eq(srv_stop(&p), 0);
}

/* Signals that keep coming while the server shuts down (a supervisor repeating SIGTERM) end it
 * with its exit status 0, never with a signal status: once the shutdown is under way a further
 * signal is ignored. SIGTERM is sent every 2 ms from the first one until the process is gone. */
Test(server_flags, repeated_sigterm_during_shutdown_exits_0)
{
    struct srv_proc p;
    srv_start(&p, MODEL, NULL);
    int st = 0;
    pid_t r = 0;
    for (int i = 0; i < 30000 && r == 0; i++) { /* up to 60 s under sanitizers */
        kill(p.pid, SIGTERM);
        usleep(2000);
        r = waitpid(p.pid, &st, WNOHANG);
    }
    cr_assert_eq(r, p.pid, "krait serve did not exit");
    p.pid = 0;
    cr_expect(WIFEXITED(st), "krait serve ended by signal %d instead of exiting", WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    unlink(p.port_file);
}

Test(server_flags, skip_tokenizer_init_serves_token_ids)
{
    struct srv_proc p;
    srv_start(&p, MODEL, "--skip-tokenizer-init", NULL);
    long st;
    json_t *j = post_json(&p, "/v1/completions", "{\"prompt\":[5,6,7],\"max_tokens\":3,\"temperature\":0}", &st);
    cr_expect_eq(st, 200);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    cr_expect_eq(json_array_size(json_object_get(c, "token_ids")), 3);
    json_decref(j);
    /* streamed, each token id goes out in its own event as it is made (no text would ever release
     * them), and together they are the whole answer's ids */
    j = post_json(&p, "/v1/completions", "{\"prompt\":[5,6,7],\"max_tokens\":12,\"ignore_eos\":true,\"temperature\":0}",
                  &st);
    cr_assert_eq(st, 200);
    json_t *whole = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids");
    cr_assert_eq(json_array_size(whole), 12);
    char *raw = post_stream(&p, "/v1/completions",
                            "{\"prompt\":[5,6,7],\"max_tokens\":12,\"ignore_eos\":true,\"temperature\":0,\"stream\":true}",
                            0, &st);
    cr_assert_eq(st, 200);
    bool done = false;
    json_t *evs = sse_events(raw, &done);
    cr_expect(done);
    size_t got = 0;
    for (size_t e = 0; e < json_array_size(evs); e++) {
        json_t *ids = json_object_get(json_array_get(json_object_get(json_array_get(evs, e), "choices"), 0), "token_ids");
        cr_expect(json_array_size(ids) <= 1, "event %zu carries %zu token ids: held back instead of streamed", e,
                  json_array_size(ids));
        for (size_t i = 0; i < json_array_size(ids); i++, got++) {
            cr_expect_eq(json_integer_value(json_array_get(ids, i)), json_integer_value(json_array_get(whole, got)),
                         "streamed id %zu", got);
        }
    }
    cr_expect_eq(got, 12);
    json_decref(evs);
    free(raw);
    json_decref(j);
    j = post_json(&p, "/v1/completions", "{\"prompt\":\"text\",\"max_tokens\":3}", &st);
    expect_error(j, st, 400, "prompt");
    json_decref(j);
    cr_expect_eq(srv_stop(&p), 0);
}

Test(server_flags, return_tokens_as_token_ids)
{
    struct srv_proc p;
    srv_start(&p, MODEL, "--return-tokens-as-token-ids", NULL);
    long st;
    json_t *j = post_json(&p, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2,\"logprobs\":1,\"temperature\":0}",
                          &st);
    cr_expect_eq(st, 200);
    json_t *toks = json_object_get(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"),
                                   "tokens");
    cr_assert_eq(json_array_size(toks), 2);
    cr_expect(!strncmp(json_string_value(json_array_get(toks, 0)), "token_id:", 9));
    json_decref(j);
    cr_expect_eq(srv_stop(&p), 0);
}

/* --host takes IPv6 addresses too. Skipped (with the reason) where the machine has no IPv6
 * loopback. */
static bool ipv6_loopback(void)
{
    const int fd = socket(AF_INET6, SOCK_STREAM, 0);
    if (fd < 0) {
        return false;
    }
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    const bool ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

Test(server_ipv6, serves_on_the_ipv6_loopback, .timeout = 300)
{
    if (!ipv6_loopback()) {
        cr_skip_test("this machine cannot bind the IPv6 loopback ::1");
    }
    struct srv_proc p;
    srv_start(&p, MODEL, "--host", "::1", NULL);
    long status = 0;
    json_t *j = post_json(&p, "/v1/completions", "{\"prompt\":\"Hello\",\"max_tokens\":3,\"temperature\":0}", &status);
    cr_expect_eq(status, 200);
    cr_expect(json_is_array(json_object_get(j, "choices")));
    json_decref(j);
    cr_expect_eq(srv_stop(&p), 0);
}

Test(server_ipv6, rejects_a_host_that_is_no_address)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s serve %s --host not-an-address --port 0 2>/dev/null", KR_KRAIT_BIN, MODEL);
    const int st = system(cmd);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 2, "exit status %d", st);
}

/* --indexer: a value that is no precision is a usage error (2); fp8 for a model without DSA layers
 * stops the server at load with a message naming the problem (1); fp8 on the default model (D layers)
 * serves. */
Test(server_flags, indexer_precision)
{
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "%s serve %s --indexer fp16 --port 0 2>/dev/null", KR_KRAIT_BIN, MODEL);
    int st = system(cmd);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 2, "exit status %d", st);
    snprintf(cmd, sizeof cmd,
             "%s serve %s/nemotron_h/nh_moe --skip-tokenizer-init --indexer fp8 --port 0 2>&1 | grep -q 'FP8 indexer "
             "needs DSA'",
             KR_KRAIT_BIN, KR_FIXTURES);
    st = system(cmd);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the load error should name the FP8 indexer and DSA layers");
    struct srv_proc p;
    srv_start(&p, MODEL, "--indexer", "fp8", NULL);
    long status = 0;
    json_t *j = post_json(&p, "/v1/completions", "{\"prompt\":\"Hello\",\"max_tokens\":3,\"temperature\":0}", &status);
    cr_expect_eq(status, 200);
    json_decref(j);
    cr_expect_eq(srv_stop(&p), 0);
}

/* ---- the prefix cache over HTTP ------------------------------------------------------------------- */

static json_t *chat_body(json_t *messages, const char *salt)
{
    json_t *b = json_pack("{s:O, s:i, s:i, s:b}", "messages", messages, "max_tokens", 8, "temperature", 0,
                          "ignore_eos", 1);
    if (salt) {
        json_object_set_new(b, "cache_salt", json_string(salt));
    }
    return b;
}

/* One greedy chat answer's content (strdup'd). */
static char *chat_answer(const struct srv_proc *p, json_t *messages, const char *salt)
{
    json_t *b = chat_body(messages, salt);
    char *body = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    long st;
    json_t *j = post_json(p, "/v1/chat/completions", body, &st);
    free(body);
    cr_assert_eq(st, 200);
    const char *c = json_string_value(
        json_object_get(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message"), "content"));
    cr_assert(c);
    char *out = strdup(c);
    json_decref(j);
    return out;
}

static int64_t prompt_tokens_of(const struct srv_proc *p, json_t *messages)
{
    json_t *b = json_pack("{s:O}", "messages", messages);
    char *body = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    long st;
    json_t *j = post_json(p, "/tokenize", body, &st);
    free(body);
    cr_assert_eq(st, 200);
    const int64_t n = json_integer_value(json_object_get(j, "count"));
    json_decref(j);
    return n;
}

/* A three-turn conversation on a server with the prefix cache and one without: the same greedy
 * answers; each later turn restores at least the previous turn's whole prompt (the snapshot at its
 * end: the conversation resends it); a request with a cache salt restores nothing of what unsalted
 * requests left; an empty salt is a 400 naming it; the metrics and pools of the cache. */
Test(server_flags, prefix_cache_serves_a_conversation_and_keeps_salts_apart, .timeout = 300)
{
    struct srv_proc on, off;
    srv_start(&on, MODEL, "--prefix-cache-state-interval", "32", NULL);
    srv_start(&off, MODEL, "--no-enable-prefix-caching", NULL);
    json_t *msgs = json_pack("[{s:s, s:s}]", "role", "system", "content",
                             "You are a careful assistant. Answer in one short sentence, and never use lists. "
                             "Keep to the facts you are given and say when you do not know.");
    static const char *const turns[] = {"What is a state space model?", "And how does attention differ?",
                                        "Which one is cheaper for long prompts?"};
    int64_t prev_prompt = 0;
    for (int t = 0; t < 3; t++) {
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", turns[t]));
        const double h0 = metric(&on, "krait:prefix_cache_hits_total");
        char *a_on = chat_answer(&on, msgs, NULL);
        char *a_off = chat_answer(&off, msgs, NULL);
        cr_expect_str_eq(a_on, a_off, "turn %d: the cached server answered differently", t);
        const double hit = metric(&on, "krait:prefix_cache_hits_total") - h0;
        if (t > 0) {
            cr_expect_geq(hit, (double)prev_prompt, "turn %d restored %g tokens; the previous prompt had %lld", t, hit,
                          (long long)prev_prompt);
        }
        prev_prompt = prompt_tokens_of(&on, msgs);
        cr_expect_lt(hit, (double)prev_prompt, "a prompt's last token is always computed");
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "assistant", "content", a_on));
        free(a_on);
        free(a_off);
    }
    /* a salted tenant: the same conversation restores nothing, and answers the same */
    json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", "Thanks."));
    const double h0 = metric(&on, "krait:prefix_cache_hits_total");
    char *a_salt = chat_answer(&on, msgs, "tenant-b");
    char *a_off = chat_answer(&off, msgs, NULL);
    cr_expect_str_eq(a_salt, a_off);
    cr_expect_eq(metric(&on, "krait:prefix_cache_hits_total") - h0, 0, "a salted request restored another's prefix");
    free(a_salt);
    free(a_off);
    long st;
    json_t *j = post_json(&on, "/v1/chat/completions",
                          "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"cache_salt\":\"\"}", &st);
    expect_error(j, st, 400, "cache_salt");
    json_decref(j);
    j = post_json(&on, "/v1/completions", "{\"prompt\":\"x\",\"cache_salt\":7}", &st);
    expect_error(j, st, 400, "cache_salt");
    json_decref(j);
    /* metrics: queries, hits, snapshots; the pools; nothing held by sequences at rest */
    cr_expect_gt(metric(&on, "krait:prefix_cache_queries_total"), metric(&on, "krait:prefix_cache_hits_total"));
    cr_expect_gt(metric(&on, "krait:prefix_cache_snapshots_total"), 0);
    cr_expect_eq(metric(&off, "krait:prefix_cache_queries_total"), 0);
    struct http_res r;
    http(&on, "GET", "/metrics", NULL, NULL, &r);
    cr_expect(strstr(r.body, "# TYPE krait:prefix_cache_unusable_block_tokens_total counter"));
    cr_expect(strstr(r.body, "krait:state_snapshots{model_name="));
    cr_expect(strstr(r.body, "pool=\"state_snapshots\"} "));
    cr_expect(strstr(r.body, "state=\"cached\"} "));
    http_free(&r);
    cr_expect_eq(metric(&on, "krait:kv_cache_usage_perc"), 0, "blocks held at rest");
    json_decref(msgs);
    cr_expect_eq(srv_stop(&on), 0);
    cr_expect_eq(srv_stop(&off), 0);
}

/* Flags: the state interval must be a multiple of the block size. */
Test(server_flags, prefix_cache_flags_are_checked)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s serve %s --block-size 16 --prefix-cache-state-interval 20 2>&1", KR_KRAIT_BIN, MODEL);
    FILE *f = popen(cmd, "r");
    cr_assert(f);
    char out[4096] = {0};
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = 0;
    const int rc = pclose(f);
    cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) == 2, "exit status %d", rc);
    cr_expect(strstr(out, "--prefix-cache-state-interval (20) must be a multiple of --block-size (16)"), "%s", out);
}
