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

/* A client's object of 10^5 keys (a message field, chat_template_kwargs) renders: inserting each key
 * scanned the keys before it, so a 1.7 MB body kept a worker busy for minutes. Keys keep their
 * order, and lookups, `in` and |length see every one. */
Test(chat_template, an_object_of_100000_keys_from_a_client_renders)
{
    enum { N = 100000 };
    json_t *big = json_object(), *msgs = json_array(), *msg = json_object(), *extra = json_object();
    for (int i = 0; i < N; i++) {
        char k[16];
        snprintf(k, sizeof k, "k%d", i);
        json_object_set_new(big, k, json_integer(i));
    }
    json_object_set_new(msg, "role", json_string("user"));
    json_object_set(msg, "meta", big);
    json_array_append_new(msgs, msg);
    json_object_set(extra, "kw", big);
    const char *src = "{{ messages[0].meta|length }} {{ messages[0].meta.k99999 }} {{ kw['k123'] }} {{ 'k5' in kw }} "
                      "{{ 'k100000' in kw }} {% for k in kw %}{% if loop.first or loop.last %}{{ k }} {% endif %}{% endfor %}"
                      "{{ (kw|dictsort)[1][0] }} {{ (kw.items()|list)[-1][1] }}";
    struct kr_chat_template *tpl = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_chat_template_compile(src, strlen(src), &tpl, &err), KR_OK, "%s", err.msg);
    struct kr_chat_params p = {.messages = msgs, .extra = extra};
    char *out = NULL;
    size_t len = 0;
    cr_expect_eq(kr_chat_template_render(tpl, &p, &out, &len, &err), KR_OK, "%s", err.msg);
    /* what jinja2 renders for the same template and variables */
    cr_expect_str_eq(out ? out : "", "100000 99999 123 True False k0 k99999 k1 99999");
    kr_free(out);
    kr_chat_template_free(tpl);
    json_decref(extra);
    json_decref(msgs);
    json_decref(big);
}

/* Expects `src` to fail naming one of the words in `why` (a '|'-separated list). */
static void expect_refused(const char *src, const char *why)
{
    struct kr_err err = {0};
    cr_expect_eq(render_src(src, NULL, &err), KR_ERR_INVAL, "%s rendered", src);
    char words[128];
    snprintf(words, sizeof words, "%s", why);
    bool named = false;
    for (char *w = strtok(words, "|"); w; w = strtok(NULL, "|")) {
        named = named || strstr(err.msg, w) != NULL;
    }
    cr_expect(named, "%s: the error names the limit (%s): %s", src, why, err.msg);
}

/* Builtins that loop inside one step of the template (membership, unique, sort, slicing, searching,
 * indexing a long string, equality of big values) pay for each item or each 64 bytes, so a loop
 * around them meets the step limit instead of running for hours. */
Test(chat_template, builtins_are_charged_to_the_step_limit)
{
    static const char *const runaway[] = {
        "{% set l = range(100000)|list %}{% for i in l %}{{ i in l }}{% endfor %}",
        "{% set l = range(100000)|list %}{% for i in range(2000) %}{{ (l|sort(reverse=true))[0] }}{% endfor %}",
        "{% set l = range(100000)|list %}{% for i in range(2000) %}{{ l.index(99999) }}{% endfor %}",
        "{% set l = range(100000)|list %}{% for i in range(2000) %}{{ l == l[:] }}{% endfor %}",
        "{% set l = range(100000)|list %}{% for i in range(2000) %}{{ l[::-1][0] }}{% endfor %}",
        "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s[-1] }}{% endfor %}",
        "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s.find('y') }}{% endfor %}",
        "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s.count('y') }}{% endfor %}",
        "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ 'y' in s }}{% endfor %}",
        "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s|length }}{% endfor %}",
    };
    for (size_t i = 0; i < sizeof runaway / sizeof runaway[0]; i++) {
        expect_refused(runaway[i], "steps");
    }
    /* these make a value each time (a dict of what was seen, a stripped copy): memory may run out first */
    expect_refused("{% set l = range(100000)|list %}{% for i in range(2000) %}{{ l|unique|length }}{% endfor %}",
                   "steps|MiB");
    expect_refused("{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s.strip('y' * 1000)|length }}{% endfor %}",
                   "steps|MiB");
}

/* A string built by replace or join is held to the 256 MiB limit while it grows (a megabyte
 * string joined a thousand times asked for a gigabyte), and searching uses linear-time matching:
 * a long needle that almost matches everywhere is found (or not) at once. */
Test(chat_template, replace_and_join_are_held_to_the_byte_limit)
{
    expect_refused("{{ ('x' * 1000000).replace('', 'y' * 1000)|length }}", "MiB|steps");
    expect_refused("{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|join|length }}", "MiB|steps");
    expect_refused("{% set s = 'x' * 1000000 %}{{ ','.join([s] * 1000)|length }}", "MiB|steps");
    expect_refused("{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|string|length }}", "MiB|steps");
    char *text = NULL;
    struct kr_err err = {0};
    cr_expect_eq(render_src("{% set h = 'a' * 1000000 %}{% set n = 'a' * 100000 ~ 'b' %}{{ n in h }} {{ h.find(n) }} "
                            "{{ h.rfind(n) }} {{ h.count(n) }} {{ (h ~ 'b').rfind(n) }} {{ h.replace(n, '')|length }}",
                            &text, &err),
                 KR_OK, "%s", err.msg);
    cr_expect_str_eq(text ? text : "", "False -1 -1 0 900000 1000000");
    kr_free(text);
}

/* Printing and comparing stop at a depth of 200 with an error (they recursed without bound: a list
 * nested 10^5 deep overflowed the stack), and a value that shares its parts (ten copies of ten
 * copies of ...) costs what printing or comparing it all would. */
Test(chat_template, nesting_and_sharing_are_bounded_when_printing_and_comparing)
{
    const char *deep = "{% set ns = namespace(x=[], y=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}"
                       "{% set ns.y = [ns.y] %}{% endfor %}";
    static const char *const tails[] = {"{{ ns.x }}", "{{ ns.x == ns.y }}", "{{ ns.x < ns.y }}",
                                        "{{ ns.x in [ns.y] }}", "{{ ns.x|tojson }}", "{{ ns.x ~ '' }}"};
    for (size_t i = 0; i < sizeof tails / sizeof tails[0]; i++) {
        char src[512];
        snprintf(src, sizeof src, "%s%s", deep, tails[i]);
        expect_refused(src, "deep|nested");
    }
    const char *wide = "{% set ns = namespace(a=[1, 1, 1, 1, 1, 1, 1, 1, 1, 1], b=[1, 1, 1, 1, 1, 1, 1, 1, 1, 1]) %}"
                       "{% for i in range(12) %}{% set ns.a = [ns.a] * 10 %}{% set ns.b = [ns.b] * 10 %}{% endfor %}";
    static const char *const wide_tails[] = {"{{ ns.a }}", "{{ ns.a == ns.b }}", "{{ ns.a|tojson|length }}"};
    for (size_t i = 0; i < sizeof wide_tails / sizeof wide_tails[0]; i++) {
        char src[512];
        snprintf(src, sizeof src, "%s%s", wide, wide_tails[i]);
        expect_refused(src, "steps|MiB");
    }
}

/* Integers are 64-bit: arithmetic that leaves that range is an error (Python's integers would
 * grow), never C's undefined overflow; a float too big for an integer saturates. */
Test(chat_template, integer_overflow_is_an_error)
{
    static const char *const overflow[] = {
        "{{ 9223372036854775807 + 1 }}",         "{{ -9223372036854775807 - 2 }}",
        "{{ 3037000500 * 3037000500 }}",          "{{ -(-9223372036854775807 - 1) }}",
        "{{ (-9223372036854775807 - 1)|abs }}",  "{{ (-9223372036854775807 - 1) // -1 }}",
        "{{ 3 ** 40 }}",                          "{{ 2 ** 63 }}",
        "{{ (-9223372036854775807 - 1) % -1 }}",
    };
    for (size_t i = 0; i < sizeof overflow / sizeof overflow[0]; i++) {
        expect_refused(overflow[i], "overflow|modulo");
    }
    expect_refused("{{ range(-9223372036854775807 - 1, 9223372036854775807)|length }}", "range");
    char *text = NULL;
    struct kr_err err = {0};
    cr_expect_eq(render_src("{{ 1e300|int }} {{ -1e300|int }} {{ 'nan'|float|int }} "
                            "{{ '%d' % 1e300 }} {{ (-9223372036854775807 - 1) % 1 }} {{ 2 ** 62 }} {{ (-2) ** 63 }}",
                            &text, &err),
                 KR_OK, "%s", err.msg);
    cr_expect_str_eq(text ? text : "",
                     "9223372036854775807 -9223372036854775808 0 9223372036854775807 0 4611686018427387904 "
                     "-9223372036854775808");
    kr_free(text);
}
