/* Structured outputs end to end: the real `krait serve` with the embedded random-weight model
 * (models/tiny-hybrid, DeepSeek-V3 tokenizer), constrained requests through every surface
 * (response_format json_object / json_schema, guided_json / guided_regex / guided_choice /
 * guided_grammar, structured_outputs), sampled at temperature 1 with several seeds. The references
 * are independent of the grammar code: JSON Schema documents are validated with ajv and
 * ajv-formats (tests/api/grammar/validate.mjs, through node), regex and grammar outputs are matched
 * with PCRE2, JSON objects are parsed with jansson. A random model writes long free strings, so a
 * choice may end at max_tokens ("length", a truncated text); every choice that ends with "stop"
 * must be complete and valid. */
#define _POSIX_C_SOURCE 200809L

#include "harness.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#define MODEL KR_SOURCE_DIR "/models/tiny-hybrid"
#define MAX_TOKENS 200

static struct srv_proc S;

static void start_default(void)
{
    srv_start(&S, MODEL, "--served-model-name", "tiny", NULL);
}

static void stop_default(void)
{
    cr_expect_eq(srv_stop(&S), 0, "krait serve did not exit 0 on SIGTERM");
}

TestSuite(structured, .init = start_default, .fini = stop_default, .timeout = 900);

/* ---- helpers -------------------------------------------------------------------------------------- */

static const char *str(const json_t *o, const char *k)
{
    const json_t *v = json_object_get(o, k);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* One request run on a thread: the body in, the status and parsed answer out (no assertion off
 * the test's own thread: Criterion's asserts end the test from the thread that runs it). */
struct call {
    const char *path;
    char *body;   /* malloc'd (json_dumps) */
    long status;
    json_t *res;  /* the parsed answer, NULL for a stream */
    char *raw;    /* the answer's text (malloc'd) */
};

static void *run_call(void *arg)
{
    struct call *c = arg;
    struct http_res r;
    http(&S, "POST", c->path, c->body, NULL, &r);
    c->status = r.status;
    c->res = json_loads(r.body, 0, NULL);
    c->raw = strdup(r.body ? r.body : "");
    http_free(&r);
    return NULL;
}

/* Runs n calls with at most `width` at once: they share the engine's batches. */
static void run_all(struct call *c, int n, int width)
{
    pthread_t th[32];
    for (int i = 0; i < n; i += width) {
        const int m = n - i < width ? n - i : width;
        for (int k = 0; k < m; k++) {
            cr_assert_eq(pthread_create(&th[k], NULL, run_call, &c[i + k]), 0);
        }
        for (int k = 0; k < m; k++) {
            pthread_join(th[k], NULL);
        }
    }
}

static void free_calls(struct call *c, int n)
{
    for (int i = 0; i < n; i++) {
        free(c[i].body);
        free(c[i].raw);
        json_decref(c[i].res);
    }
}

/* A completions body: prompt "Hi", temperature 1, `seed`, `n` choices, plus the members of extra
 * (a JSON object text: the constraint). */
static char *body_with(const char *extra, int seed, int n, bool stream)
{
    json_t *b = json_pack("{s:s, s:i, s:f, s:i, s:i, s:b}", "prompt", "Hi", "max_tokens", MAX_TOKENS, "temperature",
                          1.0, "seed", seed, "n", n, "stream", stream);
    json_t *x = json_loads(extra, 0, NULL);
    cr_assert(b && x, "bad extra: %s", extra);
    json_object_update(b, x);
    json_decref(x);
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* The text and finish reason of each choice of a completions answer, checked for shape: 200,
 * "stop" or "length", at most MAX_TOKENS tokens in all, exactly that many when "length". */
static size_t choices_of(const struct call *c, int n, const char **text, const char **finish)
{
    cr_assert_eq(c->status, 200, "%s answered %ld", c->body, c->status);
    const json_t *ch = json_object_get(c->res, "choices");
    cr_assert_eq(json_array_size(ch), (size_t)n);
    for (int i = 0; i < n; i++) {
        const json_t *x = json_array_get(ch, (size_t)i);
        text[i] = str(x, "text");
        finish[i] = str(x, "finish_reason");
        cr_assert(text[i] && finish[i]);
        cr_expect(!strcmp(finish[i], "stop") || !strcmp(finish[i], "length"), "finish_reason %s", finish[i]);
    }
    const json_int_t used = json_integer_value(json_object_get(json_object_get(c->res, "usage"), "completion_tokens"));
    cr_expect_leq(used, (json_int_t)n * MAX_TOKENS);
    return (size_t)n;
}

static const char *node_dir(void)
{
    return KR_SOURCE_DIR "/tests/api/grammar";
}

/* Whether node and the validator's packages are there; skips the test without node. */
static void need_node(void)
{
    if (system("node --version > /dev/null 2>&1") != 0) {
        cr_skip_test("node is not installed: the JSON Schema documents are not checked with ajv");
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/node_modules/ajv-formats/package.json", node_dir());
    cr_assert_eq(access(path, R_OK), 0, "ajv is not installed: run `npm ci` in %s", node_dir());
}

/* ajv's verdicts on cases ([{schema, docs: [text]}]): one array of "ok" or a reason per case. */
static json_t *ajv(json_t *cases)
{
    char in[] = "/tmp/krait-structured-XXXXXX";
    int fd = mkstemp(in);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_assert_eq(json_dump_file(cases, in, JSON_COMPACT), 0);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "node %s/validate.mjs %s", node_dir(), in);
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

/* Whether text matches all of regex re (PCRE2, UTF). */
static bool full_match(const char *re, const char *text)
{
    char anchored[1024];
    snprintf(anchored, sizeof anchored, "^(?:%s)$", re);
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *code = pcre2_compile((PCRE2_SPTR)anchored, PCRE2_ZERO_TERMINATED, PCRE2_UTF, &ec, &eo, NULL);
    cr_assert_not_null(code, "PCRE2 cannot compile %s", anchored);
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(code, NULL);
    const int rc = pcre2_match(code, (PCRE2_SPTR)text, strlen(text), 0, 0, md, NULL);
    pcre2_match_data_free(md);
    pcre2_code_free(code);
    return rc >= 0;
}

/* ---- JSON Schema -------------------------------------------------------------------------------------
 * The kinds of tests/api/test_grammar.c's schemas (nested objects, bounded arrays, enums, anyOf and
 * oneOf, $ref recursion, patterns, formats, number bounds, additional properties, tuples, optional
 * members), with strings and numbers bounded where a random model would otherwise write until
 * max_tokens. */
static const char *const schemas[] = {
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":8},\"age\":{\"type\":\"integer\","
    "\"minimum\":0,\"maximum\":120},\"email\":{\"type\":\"string\",\"format\":\"email\"}},\"required\":[\"name\","
    "\"age\"],\"additionalProperties\":false}",

    "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"object\",\"properties\":{\"b\":{\"type\":\"array\","
    "\"items\":{\"type\":\"integer\",\"minimum\":-50,\"maximum\":50},\"minItems\":1,\"maxItems\":3}},\"required\":"
    "[\"b\"]},\"c\":{\"type\":[\"boolean\",\"null\"]}},\"required\":[\"a\"]}",

    "{\"type\":\"array\",\"items\":{\"enum\":[\"red\",\"green\",1,null,{\"x\":[true]}]},\"minItems\":2,\"maxItems\":4}",

    "{\"anyOf\":[{\"type\":\"string\",\"maxLength\":5},{\"type\":\"integer\",\"minimum\":-20,\"maximum\":1234},"
    "{\"const\":\"fixed\\\"quote\"}]}",

    "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"value\":{\"type\":\"integer\",\"minimum\":0,"
    "\"maximum\":9},\"children\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"},\"maxItems\":2}},"
    "\"required\":[\"value\"],\"additionalProperties\":false}},\"$ref\":\"#/$defs/node\"}",

    "{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"string\",\"format\":\"uuid\"},\"day\":{\"type\":"
    "\"string\",\"format\":\"date\"},\"at\":{\"type\":\"string\",\"format\":\"date-time\"},\"t\":{\"type\":"
    "\"string\",\"format\":\"time\"},\"ip\":{\"type\":\"string\",\"format\":\"ipv4\"}},\"required\":[\"id\",\"day\","
    "\"at\",\"t\",\"ip\"]}",

    "{\"type\":\"object\",\"properties\":{\"code\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{3}-\\\\d{2,4}$\"},"
    "\"q\":{\"type\":\"string\",\"pattern\":\"^a[b-d]{1,4}$\"}},\"required\":[\"code\",\"q\"]}",

    "{\"type\":\"object\",\"properties\":{\"i\":{\"type\":\"integer\",\"exclusiveMinimum\":-1000,\"exclusiveMaximum\":"
    "7},\"n\":{\"type\":\"integer\",\"minimum\":-99,\"maximum\":-55},\"x\":{\"type\":\"number\",\"minimum\":-2.5,"
    "\"maximum\":3}},\"required\":[\"i\",\"n\",\"x\"]}",

    "{\"type\":\"object\",\"properties\":{\"known\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":9}},"
    "\"additionalProperties\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":3}}",

    "{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\",\"maxLength\":4},{\"type\":\"integer\",\"minimum\":0,"
    "\"maximum\":9}],\"items\":false}",

    "{\"type\":\"object\",\"properties\":{\"opt1\":{\"type\":\"string\",\"maxLength\":3},\"req\":{\"type\":\"null\"},"
    "\"opt2\":{\"oneOf\":[{\"type\":\"boolean\"},{\"type\":\"array\",\"maxItems\":0}]}},\"required\":[\"req\"]}",

    "{\"type\":\"string\",\"minLength\":2,\"maxLength\":4}",
    NULL,
};

#define N_SEEDS 3

/* Every schema through response_format json_schema, guided_json or structured_outputs.json (with
 * compact whitespace), N_SEEDS seeded requests each, all at once: every "stop" output is valid for
 * ajv. */
Test(structured, json_schema_outputs_validate_with_ajv)
{
    need_node();
    int n_schema = 0;
    while (schemas[n_schema]) {
        n_schema++;
    }
    const int n = n_schema * N_SEEDS;
    struct call *calls = calloc((size_t)n, sizeof *calls);
    cr_assert(calls);
    for (int s = 0; s < n_schema; s++) {
        for (int k = 0; k < N_SEEDS; k++) {
            char extra[4096];
            if (k == 0) {
                snprintf(extra, sizeof extra,
                         "{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"s%d\",\"strict\":"
                         "true,\"schema\":%s}}}",
                         s, schemas[s]);
            } else if (k == 1) {
                snprintf(extra, sizeof extra, "{\"guided_json\":%s}", schemas[s]);
            } else {
                snprintf(extra, sizeof extra, "{\"structured_outputs\":{\"json\":%s,\"disable_any_whitespace\":true}}",
                         schemas[s]);
            }
            calls[s * N_SEEDS + k] = (struct call){.path = "/v1/completions", .body = body_with(extra, 11 + k, 1, false)};
        }
    }
    run_all(calls, n, 8);
    json_t *cases = json_array();
    int n_stop = 0, n_length = 0;
    for (int s = 0; s < n_schema; s++) {
        json_t *docs = json_array();
        for (int k = 0; k < N_SEEDS; k++) {
            const char *text, *finish;
            choices_of(&calls[s * N_SEEDS + k], 1, &text, &finish);
            if (!strcmp(finish, "stop")) {
                json_array_append_new(docs, json_string(text));
                n_stop++;
            } else {
                n_length++;
            }
            if (getenv("KR_STRUCTURED_SHOW")) {
                printf("schema %d seed %d %s: %s\n", s, k, finish, text);
            }
        }
        json_array_append_new(cases, json_pack("{s:o, s:o}", "schema", json_loads(schemas[s], 0, NULL), "docs", docs));
    }
    json_t *verdicts = ajv(cases);
    for (size_t s = 0; s < json_array_size(verdicts); s++) {
        const json_t *v = json_array_get(verdicts, s);
        const json_t *docs = json_object_get(json_array_get(cases, s), "docs");
        for (size_t d = 0; d < json_array_size(v); d++) {
            cr_expect_str_eq(json_string_value(json_array_get(v, d)), "ok", "schema %zu: %s\n%s", s,
                             json_string_value(json_array_get(v, d)), json_string_value(json_array_get(docs, d)));
        }
    }
    fprintf(stderr, "json_schema: %d outputs ended with stop (validated), %d with length\n", n_stop, n_length);
    cr_expect_geq(n_stop, n / 2, "too few complete outputs to validate: %d of %d", n_stop, n);
    json_decref(verdicts);
    json_decref(cases);
    free_calls(calls, n);
    free(calls);
}

/* The schema suite (tests/server/schemas/suite.json, at least 50 schemas written for this test:
 * nested objects, arrays and tuples, enums and consts, anyOf/oneOf, $ref and recursion, patterns,
 * formats, number bounds, optional and additional members): SUITE_SAMPLES outputs of each at
 * temperature 1 (one request with n = SUITE_SAMPLES per schema), each ending in "stop" within
 * max_tokens or in "length" (choices_of), every "stop" output valid for ajv. */
#define SUITE_SAMPLES 20

Test(structured, the_schema_suite_validates_with_ajv, .timeout = 2400)
{
    need_node();
    json_error_t je;
    json_t *suite = json_load_file(KR_SOURCE_DIR "/tests/server/schemas/suite.json", 0, &je);
    cr_assert(json_is_array(suite), "suite.json: %s", je.text);
    const int n_schema = (int)json_array_size(suite);
    cr_assert_geq(n_schema, 50);
    struct call *calls = calloc((size_t)n_schema, sizeof *calls);
    cr_assert(calls);
    for (int s = 0; s < n_schema; s++) {
        char *schema = json_dumps(json_array_get(suite, (size_t)s), JSON_COMPACT);
        char *extra = malloc(strlen(schema) + 128);
        cr_assert(schema && extra);
        /* compact JSON (no whitespace between tokens): a random model otherwise spends most of its
         * budget on the whitespace JSON allows, and the suite's thousand samples on the CPU with it */
        sprintf(extra, "{\"structured_outputs\":{\"json\":%s,\"disable_any_whitespace\":true}}", schema);
        (void)s;
        calls[s] = (struct call){.path = "/v1/completions", .body = body_with(extra, 100 + s, SUITE_SAMPLES, false)};
        free(extra);
        free(schema);
    }
    run_all(calls, n_schema, 4);
    json_t *cases = json_array();
    int n_stop = 0, n_length = 0;
    for (int s = 0; s < n_schema; s++) {
        const char *text[SUITE_SAMPLES], *finish[SUITE_SAMPLES];
        choices_of(&calls[s], SUITE_SAMPLES, text, finish);
        json_t *docs = json_array();
        for (int k = 0; k < SUITE_SAMPLES; k++) {
            if (!strcmp(finish[k], "stop")) {
                json_array_append_new(docs, json_string(text[k]));
                n_stop++;
            } else {
                n_length++;
            }
        }
        json_array_append_new(cases, json_pack("{s:O, s:o}", "schema", json_array_get(suite, (size_t)s), "docs", docs));
    }
    json_t *verdicts = ajv(cases);
    int n_bad = 0;
    for (size_t s = 0; s < json_array_size(verdicts); s++) {
        const json_t *v = json_array_get(verdicts, s);
        const json_t *docs = json_object_get(json_array_get(cases, s), "docs");
        for (size_t d = 0; d < json_array_size(v); d++) {
            if (strcmp(json_string_value(json_array_get(v, d)), "ok") != 0) {
                n_bad++;
                cr_expect_fail("schema %zu: %s\n%s", s, json_string_value(json_array_get(v, d)),
                               json_string_value(json_array_get(docs, d)));
            }
        }
    }
    fprintf(stderr, "schema suite: %d schemas x %d samples: %d ended with stop and were validated (%d invalid), %d with "
                    "length\n", n_schema, SUITE_SAMPLES, n_stop, n_bad, n_length);
    cr_expect_geq(n_stop, n_schema * SUITE_SAMPLES / 2, "too few complete outputs to validate: %d", n_stop);
    json_decref(verdicts);
    json_decref(cases);
    json_decref(suite);
    free_calls(calls, n_schema);
    free(calls);
}

/* n > 1: each choice of a request follows the schema on its own (its own matcher). */
Test(structured, every_choice_of_n_is_valid)
{
    need_node();
    const char *schema = schemas[4]; /* recursion through $ref */
    char extra[2048];
    snprintf(extra, sizeof extra, "{\"guided_json\":%s}", schema);
    struct call c = {.path = "/v1/completions", .body = body_with(extra, 5, 4, false)};
    run_all(&c, 1, 1);
    const char *text[4], *finish[4];
    choices_of(&c, 4, text, finish);
    json_t *docs = json_array();
    for (int i = 0; i < 4; i++) {
        if (!strcmp(finish[i], "stop")) {
            json_array_append_new(docs, json_string(text[i]));
        }
    }
    cr_expect_gt(json_array_size(docs), 0, "no choice completed");
    cr_expect(strcmp(text[0], text[1]) || strcmp(text[1], text[2]), "the choices should differ");
    json_t *cases = json_pack("[{s:o, s:o}]", "schema", json_loads(schema, 0, NULL), "docs", docs);
    json_t *v = ajv(cases);
    for (size_t d = 0; d < json_array_size(json_array_get(v, 0)); d++) {
        cr_expect_str_eq(json_string_value(json_array_get(json_array_get(v, 0), d)), "ok", "%s",
                         json_string_value(json_array_get(docs, d)));
    }
    json_decref(v);
    json_decref(cases);
    free_calls(&c, 1);
}

/* json_object: a complete output parses as a JSON object (chat and completions). */
Test(structured, json_object_outputs_are_objects)
{
    struct call c[4];
    for (int k = 0; k < 4; k++) {
        char *b = body_with("{\"response_format\":{\"type\":\"json_object\"}}", 100 + k, 1, false);
        if (k % 2) { /* the same through chat */
            json_t *j = json_loads(b, 0, NULL);
            json_object_del(j, "prompt");
            json_object_set_new(j, "messages", json_pack("[{s:s, s:s}]", "role", "user", "content", "JSON please"));
            free(b);
            b = json_dumps(j, JSON_COMPACT);
            json_decref(j);
        }
        c[k] = (struct call){.path = k % 2 ? "/v1/chat/completions" : "/v1/completions", .body = b};
    }
    run_all(c, 4, 4);
    int n_stop = 0;
    for (int k = 0; k < 4; k++) {
        cr_assert_eq(c[k].status, 200, "%s", c[k].body);
        const json_t *ch = json_array_get(json_object_get(c[k].res, "choices"), 0);
        const char *text = k % 2 ? str(json_object_get(ch, "message"), "content") : str(ch, "text");
        const char *finish = str(ch, "finish_reason");
        cr_assert(text && finish);
        if (!strcmp(finish, "stop")) {
            json_error_t je;
            json_t *o = json_loads(text, JSON_DECODE_ANY, &je);
            cr_expect(json_is_object(o), "not a JSON object (%s): %s", je.text, text);
            json_decref(o);
            n_stop++;
        } else {
            cr_expect_str_eq(finish, "length");
        }
    }
    fprintf(stderr, "json_object: %d of 4 complete\n", n_stop);
    free_calls(c, 4);
}

/* Regexes, choices and a GBNF grammar (vLLM's guided_* and structured_outputs fields): a complete
 * output matches (PCRE2), a choice is one of the list. */
Test(structured, regex_choice_and_grammar_outputs_match)
{
    static const char *const regexes[] = {
        "[0-9]{3}-[a-z]{2,5}",
        "(yes|no|maybe)!?",
        "[A-Z][a-z]{0,6} [A-Z][a-z]{0,6}",
        "\\d{1,3}(\\.\\d{1,3}){3}",
        "(ab|cd)+x",
        "[\xc3\xa0-\xc3\xbf]{2,4}z", /* U+00E0 to U+00FF */
    };
    const char *gbnf = "root ::= \"(\" num (\" \" op \" \" num){0,3} \")\"\nop ::= \"+\" | \"-\" | \"*\"\n"
                       "num ::= [0-9]{1,3}\n";
    const char *gbnf_re = "\\([0-9]{1,3}( [-+*] [0-9]{1,3}){0,3}\\)";
    const char *choices = "[\"alpha\",\"beta\",\"gamma delta\",\"\\u00e9t\\u00e9\",\"a\\\"quote\"]";
    enum { NR = sizeof regexes / sizeof regexes[0], N = NR * 2 + 2 * 2 };
    struct call c[N];
    int at = 0;
    for (int i = 0; i < NR; i++) {
        for (int k = 0; k < 2; k++) {
            json_t *x = k ? json_pack("{s:{s:s}}", "structured_outputs", "regex", regexes[i])
                          : json_pack("{s:s}", "guided_regex", regexes[i]);
            char *xs = json_dumps(x, JSON_COMPACT);
            c[at++] = (struct call){.path = "/v1/completions", .body = body_with(xs, 7 + k, 1, false)};
            free(xs);
            json_decref(x);
        }
    }
    for (int k = 0; k < 2; k++) {
        json_t *x = k ? json_pack("{s:{s:s}}", "structured_outputs", "grammar", gbnf) : json_pack("{s:s}", "guided_grammar", gbnf);
        char *xs = json_dumps(x, JSON_COMPACT);
        c[at++] = (struct call){.path = "/v1/completions", .body = body_with(xs, 30 + k, 1, false)};
        free(xs);
        json_decref(x);
        char cx[512];
        snprintf(cx, sizeof cx, k ? "{\"structured_outputs\":{\"choice\":%s}}" : "{\"guided_choice\":%s}", choices);
        c[at++] = (struct call){.path = "/v1/completions", .body = body_with(cx, 40 + k, 1, false)};
    }
    run_all(c, N, 8);
    json_t *list = json_loads(choices, 0, NULL);
    int n_stop = 0;
    for (int i = 0; i < N; i++) {
        const char *text, *finish;
        choices_of(&c[i], 1, &text, &finish);
        if (strcmp(finish, "stop") != 0) {
            continue;
        }
        n_stop++;
        const json_t *body = json_loads(c[i].body, 0, NULL);
        const json_t *so = json_object_get(body, "structured_outputs");
        const char *re = str(body, "guided_regex") ? str(body, "guided_regex") : str(so, "regex");
        if (re) {
            cr_expect(full_match(re, text), "\"%s\" does not match %s", text, re);
        } else if (str(body, "guided_grammar") || str(so, "grammar")) {
            cr_expect(full_match(gbnf_re, text), "\"%s\" is not in the grammar's language", text);
        } else {
            bool found = false;
            for (size_t k = 0; k < json_array_size(list); k++) {
                found |= !strcmp(json_string_value(json_array_get(list, k)), text);
            }
            cr_expect(found, "\"%s\" is not one of the choices", text);
        }
        json_decref((json_t *)body);
    }
    cr_expect_geq(n_stop, N / 2, "%d of %d complete", n_stop, N);
    json_decref(list);
    free_calls(c, N);
}

/* Streamed and whole answers of one seed carry the same text and finish reason (completions and
 * chat), the stream ending with [DONE]. */
Test(structured, streamed_and_whole_answers_agree)
{
    for (int chat = 0; chat < 2; chat++) {
        char extra[2048];
        snprintf(extra, sizeof extra, "{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p\","
                                      "\"schema\":%s}}}", schemas[0]);
        char *bodies[2];
        for (int stream = 0; stream < 2; stream++) {
            bodies[stream] = body_with(extra, 77, 1, stream);
            if (chat) {
                json_t *j = json_loads(bodies[stream], 0, NULL);
                json_object_del(j, "prompt");
                json_object_set_new(j, "messages", json_pack("[{s:s, s:s}]", "role", "user", "content", "a person"));
                free(bodies[stream]);
                bodies[stream] = json_dumps(j, JSON_COMPACT);
                json_decref(j);
            }
        }
        const char *path = chat ? "/v1/chat/completions" : "/v1/completions";
        long st;
        json_t *whole = post_json(&S, path, bodies[0], &st);
        cr_assert_eq(st, 200);
        const json_t *ch = json_array_get(json_object_get(whole, "choices"), 0);
        const char *text = chat ? str(json_object_get(ch, "message"), "content") : str(ch, "text");
        const char *finish = str(ch, "finish_reason");
        char *raw = post_stream(&S, path, bodies[1], 0, &st);
        cr_assert_eq(st, 200);
        bool done;
        json_t *evs = sse_events(raw, &done);
        cr_expect(done, "the stream ends with [DONE]");
        size_t cap = 1 << 16, len = 0;
        char *acc = calloc(1, cap);
        const char *sfinish = NULL;
        for (size_t i = 0; i < json_array_size(evs); i++) {
            const json_t *c = json_array_get(json_object_get(json_array_get(evs, i), "choices"), 0);
            const char *piece = chat ? str(json_object_get(c, "delta"), "content") : str(c, "text");
            if (piece && len + strlen(piece) < cap) {
                memcpy(acc + len, piece, strlen(piece));
                len += strlen(piece);
            }
            sfinish = str(c, "finish_reason") ? str(c, "finish_reason") : sfinish;
        }
        cr_expect_str_eq(acc, text, "%s: the stream's text differs", path);
        cr_expect(sfinish && !strcmp(sfinish, finish), "%s: finish %s vs %s", path, sfinish, finish);
        free(acc);
        free(raw);
        json_decref(evs);
        json_decref(whole);
        free(bodies[0]);
        free(bodies[1]);
    }
}

/* Constrained and free requests at once, streamed and whole: all complete, the constrained ones
 * JSON objects when they stop, the free ones their full length; nothing is left running. */
Test(structured, a_batch_mixing_constrained_and_free_requests)
{
    enum { N = 16 };
    struct call c[N];
    for (int i = 0; i < N; i++) {
        const bool con = i % 2 == 0, stream = i % 4 >= 2;
        char *b = con ? body_with("{\"response_format\":{\"type\":\"json_object\"},\"max_tokens\":48}", i, 1, stream)
                      : body_with("{\"ignore_eos\":true,\"max_tokens\":24}", i, 1, stream);
        c[i] = (struct call){.path = "/v1/completions", .body = b};
    }
    run_all(c, N, N);
    for (int i = 0; i < N; i++) {
        cr_assert_eq(c[i].status, 200, "request %d answered %ld", i, c[i].status);
        char *text = NULL;
        const char *finish = NULL;
        json_t *evs = NULL;
        if (i % 4 >= 2) { /* a stream: its deltas put together */
            bool done;
            evs = sse_events(c[i].raw, &done);
            cr_expect(done, "request %d: no [DONE]", i);
            text = calloc(1, strlen(c[i].raw) + 1);
            for (size_t k = 0; k < json_array_size(evs); k++) {
                const json_t *ch = json_array_get(json_object_get(json_array_get(evs, k), "choices"), 0);
                if (str(ch, "text")) {
                    strcat(text, str(ch, "text"));
                }
                finish = str(ch, "finish_reason") ? str(ch, "finish_reason") : finish;
            }
        } else {
            const json_t *ch = json_array_get(json_object_get(c[i].res, "choices"), 0);
            text = strdup(str(ch, "text"));
            finish = str(ch, "finish_reason");
        }
        cr_assert(text && finish, "request %d", i);
        if (i % 2 == 0 && !strcmp(finish, "stop")) {
            json_t *o = json_loads(text, 0, NULL);
            cr_expect(json_is_object(o), "request %d: not a JSON object: %s", i, text);
            json_decref(o);
        } else if (i % 2 == 0) {
            cr_expect_str_eq(finish, "length");
        } else {
            cr_expect_str_eq(finish, "length", "request %d: a free request runs to max_tokens", i);
        }
        free(text);
        json_decref(evs);
    }
    double running = 1;
    for (int k = 0; k < 100 && running != 0; k++) {
        usleep(20000);
        running = metric(&S, "krait:num_requests_running");
    }
    cr_expect_eq(running, 0, "requests still running");
    /* one mask per constrained token at least, and their host time */
    cr_expect_geq(metric(&S, "krait:structured_output_mask_seconds_count"), 8);
    cr_expect_gt(metric(&S, "krait:structured_output_mask_seconds_sum"), 0);
    free_calls(c, N);
}

/* Invalid constraints are 400s naming the field, with the compiler's message. */
Test(structured, invalid_constraints_are_400_naming_the_field)
{
    static const struct {
        const char *extra, *param, *needle;
    } cases[] = {
        {"{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{\"type\":\"integer\","
         "\"multipleOf\":3}}}}",
         "response_format", "multipleOf"},
        {"{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{\"$ref\":"
         "\"#/$defs/missing\"}}}}",
         "response_format", "missing"},
        {"{\"guided_json\":\"{not json\"}", "guided_json", ""},
        {"{\"guided_json\":{\"type\":\"number\",\"minimum\":0.2,\"maximum\":0.8}}", "guided_json", ""},
        {"{\"guided_regex\":\"(a\"}", "guided_regex", ")"},
        {"{\"guided_regex\":\"a(?=b)\"}", "guided_regex", ""},
        {"{\"guided_grammar\":\"root ::= b\"}", "guided_grammar", "'b'"},
        {"{\"guided_grammar\":\"root ::= root \\\"a\\\"\"}", "guided_grammar", "left-recursive"},
        {"{\"structured_outputs\":{\"regex\":\"\\\\p{L}\"}}", "structured_outputs.regex", ""},
        {"{\"structured_outputs\":{\"json\":{\"type\":\"object\",\"not\":{}}}}", "structured_outputs.json", "not"},
        {"{\"response_format\":{\"type\":\"json_object\"},\"guided_choice\":[\"a\"]}", "guided_choice", "response_format"},
        {"{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{}}}}",
         "response_format.json_schema.name", ""},
        {"{\"guided_whitespace_pattern\":\"\\\\s*\",\"guided_json\":{}}", "guided_whitespace_pattern", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (int chat = 0; chat < 2; chat++) {
            char *b = body_with(cases[i].extra, 1, 1, false);
            if (chat) {
                json_t *j = json_loads(b, 0, NULL);
                json_object_del(j, "prompt");
                json_object_set_new(j, "messages", json_pack("[{s:s, s:s}]", "role", "user", "content", "x"));
                free(b);
                b = json_dumps(j, JSON_COMPACT);
                json_decref(j);
            }
            long st;
            json_t *j = post_json(&S, chat ? "/v1/chat/completions" : "/v1/completions", b, &st);
            cr_expect_eq(st, 400, "%s: answered %ld", cases[i].extra, st);
            const json_t *e = json_object_get(j, "error");
            cr_expect(str(e, "param") && !strcmp(str(e, "param"), cases[i].param), "%s: param %s, expected %s",
                      cases[i].extra, str(e, "param") ? str(e, "param") : "(null)", cases[i].param);
            cr_expect(str(e, "message") && strstr(str(e, "message"), cases[i].needle), "%s: message %s",
                      cases[i].extra, str(e, "message"));
            json_decref(j);
            free(b);
        }
    }
}

/* Without the tokenizer (--skip-tokenizer-init) there are no token bytes to constrain: a 400 that
 * says why, naming the field. (A server of its own beside the suite's: a suite of this one test run
 * beside the others made Criterion's parallel runner leak 48 bytes at exit under LeakSanitizer.) */
Test(structured, skip_tokenizer_init_refuses_constraints)
{
    struct srv_proc p;
    srv_start(&p, MODEL, "--skip-tokenizer-init", NULL);
    long st;
    struct http_res r;
    http(&p, "POST", "/v1/completions", "{\"prompt\":[1,2,3],\"max_tokens\":4,\"guided_regex\":\"[a-z]+\"}", NULL, &r);
    cr_expect_eq(r.status, 400);
    json_t *j = json_loads(r.body, 0, NULL);
    const json_t *e = json_object_get(j, "error");
    cr_expect(str(e, "param") && !strcmp(str(e, "param"), "guided_regex"), "param %s", str(e, "param"));
    cr_expect(str(e, "message") && strstr(str(e, "message"), "--skip-tokenizer-init"), "%s", str(e, "message"));
    json_decref(j);
    http_free(&r);
    json_t *ok = post_json(&p, "/v1/completions", "{\"prompt\":[1,2,3],\"max_tokens\":2}", &st);
    cr_expect_eq(st, 200, "free requests still work");
    json_decref(ok);
    cr_expect_eq(srv_stop(&p), 0);
}
