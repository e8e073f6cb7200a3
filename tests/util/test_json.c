#define _POSIX_C_SOURCE 200809L

#include "json.h"

#include "alloc.h"

#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Expected values below are the facts written in each JSON text, not outputs of the parser. */

/* ---- helpers --------------------------------------------------------------------------------- */

static size_t g_base; /* kr_alloc_bytes_in_use() before the test */

static void setup(void)
{
    g_base = kr_alloc_bytes_in_use();
}

static void teardown(void)
{
    cr_expect_eq(kr_alloc_bytes_in_use(), g_base, "host memory leaked: %zu bytes",
                 kr_alloc_bytes_in_use() - g_base);
}

TestSuite(json, .init = setup, .fini = teardown);

static struct kr_json *parse_ok_n(const char *text, size_t len)
{
    struct kr_json *v = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_json_parse(text, len, &v, &err);
    cr_assert_eq(st, KR_OK, "parsing %s failed: %s", text, err.msg);
    cr_assert_not_null(v);
    return v;
}

static struct kr_json *parse_ok(const char *text)
{
    return parse_ok_n(text, strlen(text));
}

/* Member `key` of `obj`, asserting that it exists. */
static const struct kr_json *must_get(const struct kr_json *obj, const char *key)
{
    const struct kr_json *m = kr_json_get(obj, key);
    cr_assert_not_null(m, "no member \"%s\"", key);
    return m;
}

/* Parses `len` bytes of `text`, expects KR_ERR_FORMAT with `where` ("line L column C:") and `what`
 * in the message. */
static void expect_error_n(const char *text, size_t len, const char *where, const char *what)
{
    struct kr_json *v = (struct kr_json *)&v; /* poison: must come back NULL */
    struct kr_err err = {0};
    enum kr_status st = kr_json_parse(text, len, &v, &err);
    cr_log_info("%s", err.msg); /* shown with --verbose */
    cr_assert_eq(st, KR_ERR_FORMAT, "parsing \"%s\": expected KR_ERR_FORMAT, got %d", text, st);
    cr_expect_null(v);
    cr_expect(strncmp(err.msg, where, strlen(where)) == 0,
              "\"%s\": message \"%s\" does not start with \"%s\"", text, err.msg, where);
    if (what) {
        cr_expect(strstr(err.msg, what) != NULL, "\"%s\": message \"%s\" lacks \"%s\"", text, err.msg, what);
    }
}

static void expect_error(const char *text, const char *where, const char *what)
{
    expect_error_n(text, strlen(text), where, what);
}

/* ---- values ---------------------------------------------------------------------------------- */

Test(json, parses_literals)
{
    struct kr_json *v = parse_ok("[true, false, null]");
    cr_assert_eq(v->type, KR_JSON_ARRAY);
    cr_assert_eq(v->n, 3);
    cr_expect_eq(v->items[0].type, KR_JSON_BOOL);
    cr_expect(v->items[0].boolean);
    cr_expect_eq(v->items[1].type, KR_JSON_BOOL);
    cr_expect(!v->items[1].boolean);
    cr_expect_eq(v->items[2].type, KR_JSON_NULL);
    kr_json_free(v);

    v = parse_ok("true");
    cr_expect_eq(v->type, KR_JSON_BOOL);
    cr_expect(v->boolean);
    kr_json_free(v);
    v = parse_ok(" null ");
    cr_expect_eq(v->type, KR_JSON_NULL);
    kr_json_free(v);
}

Test(json, parses_integers_as_exact_int64)
{
    struct kr_json *v = parse_ok("[0, -0, 123, -45, 9223372036854775807, -9223372036854775808]");
    cr_assert_eq(v->n, 6);
    const int64_t want[] = {0, 0, 123, -45, INT64_MAX, INT64_MIN};
    for (size_t i = 0; i < 6; i++) {
        cr_expect_eq(v->items[i].type, KR_JSON_NUMBER);
        cr_expect(v->items[i].is_int, "item %zu", i);
        cr_expect_eq(v->items[i].integer, want[i], "item %zu", i);
        cr_expect_eq(v->items[i].number, (double)want[i], "item %zu", i);
    }
    cr_expect(signbit(v->items[1].number), "-0 keeps its sign as a double");
    kr_json_free(v);
}

Test(json, numbers_outside_int64_or_with_fraction_are_not_int)
{
    struct kr_json *v =
        parse_ok("[9223372036854775808, -9223372036854775809, 1.5, 1e3, 2.5E-3, -0.25e+2, 1e400]");
    cr_assert_eq(v->n, 7);
    for (size_t i = 0; i < 7; i++) {
        cr_expect_eq(v->items[i].type, KR_JSON_NUMBER);
        cr_expect(!v->items[i].is_int, "item %zu", i);
    }
    cr_expect_eq(v->items[0].number, 9223372036854775808.0);
    cr_expect_eq(v->items[1].number, -9223372036854775808.0); /* nearest double */
    cr_expect_eq(v->items[2].number, 1.5);
    cr_expect_eq(v->items[3].number, 1000.0);
    cr_expect_eq(v->items[4].number, 0.0025);
    cr_expect_eq(v->items[5].number, -25.0);
    cr_expect(isinf(v->items[6].number) && v->items[6].number > 0);
    kr_json_free(v);
}

Test(json, parses_bare_nonfinite_tokens)
{
    struct kr_json *v = parse_ok("[Infinity, -Infinity, NaN]");
    cr_assert_eq(v->n, 3);
    cr_expect(isinf(v->items[0].number) && v->items[0].number > 0);
    cr_expect(isinf(v->items[1].number) && v->items[1].number < 0);
    cr_expect(isnan(v->items[2].number));
    for (size_t i = 0; i < 3; i++) {
        cr_expect_eq(v->items[i].type, KR_JSON_NUMBER);
        cr_expect(!v->items[i].is_int);
    }
    kr_json_free(v);

    v = parse_ok("{\"rope_theta\": Infinity}");
    cr_expect(isinf(must_get(v, "rope_theta")->number));
    kr_json_free(v);
}

Test(json, parses_strings_and_escapes)
{
    struct kr_json *v =
        parse_ok("[\"\", \"plain\", \"\\\"\\\\\\/\\b\\f\\n\\r\\t\", \"\\u0041\\u00e9\\u20AC\"]");
    cr_assert_eq(v->n, 4);
    for (size_t i = 0; i < 4; i++) {
        cr_expect_eq(v->items[i].type, KR_JSON_STRING);
    }
    cr_expect_eq(v->items[0].str_len, 0);
    cr_expect_str_eq(v->items[0].str, "");
    cr_expect_str_eq(v->items[1].str, "plain");
    cr_expect_eq(v->items[2].str_len, 8);
    cr_expect_str_eq(v->items[2].str, "\"\\/\b\f\n\r\t");
    cr_expect_str_eq(v->items[3].str, "A\xc3\xa9\xe2\x82\xac"); /* U+0041 U+00E9 U+20AC */
    cr_expect_eq(v->items[3].str_len, 6);
    kr_json_free(v);
}

Test(json, decodes_surrogate_pairs_to_utf8)
{
    /* U+1F600 = \ud83d\ude00 = F0 9F 98 80; U+10FFFF = \udbff\udfff = F4 8F BF BF */
    struct kr_json *v = parse_ok("[\"x\\ud83d\\ude00y\", \"\\uDBFF\\uDFFF\"]");
    cr_expect_str_eq(v->items[0].str, "x\xf0\x9f\x98\x80y");
    cr_expect_eq(v->items[0].str_len, 6);
    cr_expect_str_eq(v->items[1].str, "\xf4\x8f\xbf\xbf");
    kr_json_free(v);
}

Test(json, keeps_escaped_nul_inside_string)
{
    struct kr_json *v = parse_ok("\"a\\u0000b\"");
    cr_assert_eq(v->type, KR_JSON_STRING);
    cr_expect_eq(v->str_len, 3);
    cr_expect(memcmp(v->str, "a\0b", 4) == 0);
    kr_json_free(v);
}

Test(json, passes_raw_utf8_through)
{
    struct kr_json *v = parse_ok("\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"");
    cr_expect_str_eq(v->str, "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
    kr_json_free(v);
}

Test(json, parses_nested_containers_in_order)
{
    struct kr_json *v = parse_ok("{\"a\": [1, {\"b\": [true, \"s\", null]}], \"c\": {}, \"d\": []}");
    cr_assert_eq(v->type, KR_JSON_OBJECT);
    cr_assert_eq(v->n, 3);
    cr_expect_str_eq(v->keys[0], "a");
    cr_expect_str_eq(v->keys[1], "c");
    cr_expect_str_eq(v->keys[2], "d");
    const struct kr_json *a = kr_json_get(v, "a");
    cr_assert_not_null(a);
    cr_assert_eq(a->type, KR_JSON_ARRAY);
    cr_assert_eq(a->n, 2);
    cr_expect_eq(a->items[0].integer, 1);
    const struct kr_json *b = kr_json_get(&a->items[1], "b");
    cr_assert_not_null(b);
    cr_assert_eq(b->n, 3);
    cr_expect_eq(b->items[0].type, KR_JSON_BOOL);
    cr_expect_str_eq(b->items[1].str, "s");
    cr_expect_eq(b->items[2].type, KR_JSON_NULL);
    cr_expect_eq(must_get(v, "c")->type, KR_JSON_OBJECT);
    cr_expect_eq(must_get(v, "c")->n, 0);
    cr_expect_eq(must_get(v, "d")->type, KR_JSON_ARRAY);
    cr_expect_eq(must_get(v, "d")->n, 0);
    cr_expect_null(kr_json_get(v, "missing"));
    cr_expect_null(kr_json_get(a, "a"), "kr_json_get on an array");
    cr_expect_null(kr_json_get(NULL, "a"));
    kr_json_free(v);
}

Test(json, accepts_all_json_whitespace)
{
    struct kr_json *v = parse_ok(" \t\r\n{ \"k\" \n:\t[ 1 ,\r\n2 ] } \n");
    cr_expect_eq(must_get(v, "k")->n, 2);
    kr_json_free(v);
}

Test(json, reads_only_len_bytes)
{
    /* Not NUL-terminated: the bytes after len are not part of the text. */
    struct kr_json *v = parse_ok_n("[12]garbage", 4);
    cr_expect_eq(v->items[0].integer, 12);
    kr_json_free(v);
    v = parse_ok_n("123456", 3);
    cr_expect_eq(v->integer, 123);
    kr_json_free(v);
}

Test(json, last_duplicate_key_wins)
{
    struct kr_json *v = parse_ok("{\"a\": 1, \"b\": 2, \"a\": 3}");
    cr_assert_eq(v->n, 3, "all members are kept in order");
    cr_expect_str_eq(v->keys[0], "a");
    cr_expect_str_eq(v->keys[2], "a");
    cr_expect_eq(must_get(v, "a")->integer, 3);
    cr_expect_eq(must_get(v, "b")->integer, 2);
    kr_json_free(v);
}

Test(json, accepts_256_levels_of_nesting)
{
    char text[2 * 256 + 1];
    memset(text, '[', 256);
    memset(text + 256, ']', 256);
    text[512] = 0;
    struct kr_json *v = parse_ok(text);
    const struct kr_json *c = v;
    int depth = 1;
    while (c->n == 1) {
        c = &c->items[0];
        depth++;
    }
    cr_expect_eq(depth, 256);
    kr_json_free(v);
}

Test(json, names_types)
{
    cr_expect_str_eq(kr_json_type_name(KR_JSON_NULL), "null");
    cr_expect_str_eq(kr_json_type_name(KR_JSON_BOOL), "boolean");
    cr_expect_str_eq(kr_json_type_name(KR_JSON_NUMBER), "number");
    cr_expect_str_eq(kr_json_type_name(KR_JSON_STRING), "string");
    cr_expect_str_eq(kr_json_type_name(KR_JSON_ARRAY), "array");
    cr_expect_str_eq(kr_json_type_name(KR_JSON_OBJECT), "object");
}

/* ---- kr_json_as_double / kr_json_as_int ------------------------------------------------------ */

Test(json, as_double_reads_numbers_and_nonfinite_spellings)
{
    struct kr_json *v = parse_ok("[2.5, 7, \"Infinity\", \"-Infinity\", \"inf\", \"-INF\", \"NaN\", \"nan\", "
                                 "{\"__float__\": \"Infinity\"}, {\"__float__\": \"-Infinity\"}, "
                                 "{\"__float__\": 0.5}, NaN]");
    cr_assert_eq(v->n, 12);
    double d;
    cr_assert(kr_json_as_double(&v->items[0], &d));
    cr_expect_eq(d, 2.5);
    cr_assert(kr_json_as_double(&v->items[1], &d));
    cr_expect_eq(d, 7.0);
    cr_assert(kr_json_as_double(&v->items[2], &d));
    cr_expect(isinf(d) && d > 0);
    cr_assert(kr_json_as_double(&v->items[3], &d));
    cr_expect(isinf(d) && d < 0);
    cr_assert(kr_json_as_double(&v->items[4], &d));
    cr_expect(isinf(d) && d > 0);
    cr_assert(kr_json_as_double(&v->items[5], &d));
    cr_expect(isinf(d) && d < 0);
    cr_assert(kr_json_as_double(&v->items[6], &d));
    cr_expect(isnan(d));
    cr_assert(kr_json_as_double(&v->items[7], &d));
    cr_expect(isnan(d));
    cr_assert(kr_json_as_double(&v->items[8], &d));
    cr_expect(isinf(d) && d > 0);
    cr_assert(kr_json_as_double(&v->items[9], &d));
    cr_expect(isinf(d) && d < 0);
    cr_assert(kr_json_as_double(&v->items[10], &d));
    cr_expect_eq(d, 0.5);
    cr_assert(kr_json_as_double(&v->items[11], &d));
    cr_expect(isnan(d));
    kr_json_free(v);
}

Test(json, as_double_rejects_other_values)
{
    struct kr_json *v =
        parse_ok("[\"1.5\", \"infinite\", \"\", true, null, [1], {\"x\": 1}, {\"__float__\": \"big\"}, "
                 "\"inf\\u0000\"]");
    double d = 42.0;
    for (size_t i = 0; i < v->n; i++) {
        cr_expect(!kr_json_as_double(&v->items[i], &d), "item %zu", i);
    }
    cr_expect(!kr_json_as_double(NULL, &d));
    cr_expect_eq(d, 42.0, "out untouched on failure");
    kr_json_free(v);
}

Test(json, as_int_accepts_exact_integers_only)
{
    struct kr_json *v =
        parse_ok("[4, 4.0, -7, 1e3, -9223372036854775808.0, 4.5, 9223372036854775808.0, 1e300, "
                 "\"4\", Infinity, NaN, true]");
    int64_t i = 0;
    cr_assert(kr_json_as_int(&v->items[0], &i));
    cr_expect_eq(i, 4);
    cr_assert(kr_json_as_int(&v->items[1], &i));
    cr_expect_eq(i, 4);
    cr_assert(kr_json_as_int(&v->items[2], &i));
    cr_expect_eq(i, -7);
    cr_assert(kr_json_as_int(&v->items[3], &i));
    cr_expect_eq(i, 1000);
    cr_assert(kr_json_as_int(&v->items[4], &i));
    cr_expect_eq(i, INT64_MIN);
    for (size_t k = 5; k < v->n; k++) {
        cr_expect(!kr_json_as_int(&v->items[k], &i), "item %zu", k);
    }
    cr_expect(!kr_json_as_int(NULL, &i));
    kr_json_free(v);
}

/* ---- errors ---------------------------------------------------------------------------------- */

Test(json, rejects_empty_input)
{
    expect_error("", "line 1 column 1:", "expected a JSON value");
    expect_error_n(NULL, 0, "line 1 column 1:", "expected a JSON value");
    expect_error("  \n ", "line 2 column 2:", "end of input");
}

Test(json, rejects_truncated_input)
{
    expect_error("{\"a\": [1, 2", "line 1 column 12:", "expected ',' or ']'");
    expect_error("{\"a\": ", "line 1 column 7:", "expected a JSON value");
    expect_error("{\"a\"", "line 1 column 5:", "expected ':'");
    expect_error("[\"abc", "line 1 column 6:", "expected '\"' to close the string");
    expect_error("tru", "line 1 column 1:", "expected a JSON value");
    expect_error("[1,\n2", "line 2 column 2:", "end of input");
}

Test(json, rejects_trailing_commas)
{
    expect_error("[1, 2,]", "line 1 column 7:", "expected a JSON value");
    expect_error("{\"a\": 1,}", "line 1 column 9:", "expected '\"' to start an object key");
}

Test(json, rejects_unquoted_keys)
{
    expect_error("{\n  a: 1}", "line 2 column 3:", "expected '\"' to start an object key");
    expect_error("{'a': 1}", "line 1 column 2:", "expected '\"'");
}

Test(json, rejects_bad_escapes)
{
    expect_error("[\"ab\\x\"]", "line 1 column 5:", "invalid escape");
    expect_error("\"\\u12G4\"", "line 1 column 2:", "hex digits");
    expect_error("\"\\u12\"", "line 1 column 2:", "hex digits");
    expect_error("\"\\'\"", "line 1 column 2:", "invalid escape");
}

Test(json, rejects_lone_surrogates)
{
    expect_error("\"\\ud800\"", "line 1 column 2:", "surrogate");
    expect_error("\"ab\\udc00\"", "line 1 column 4:", "surrogate");
    expect_error("\"\\ud800\\u0041\"", "line 1 column 2:", "surrogate");
    expect_error("\"\\ud800\\ud800\"", "line 1 column 2:", "surrogate");
    expect_error("\"\\ud800x\"", "line 1 column 2:", "surrogate");
}

Test(json, rejects_raw_control_characters_in_strings)
{
    expect_error("[\"a\tb\"]", "line 1 column 4:", "control character");
    expect_error("\"line\nbreak\"", "line 1 column 6:", "control character");
    expect_error_n("\"a\0b\"", 5, "line 1 column 3:", "control character");
}

Test(json, rejects_invalid_utf8_in_strings)
{
    expect_error("\"a\xff\"", "line 1 column 3:", "UTF-8");
    expect_error("\"\x80\"", "line 1 column 2:", "UTF-8");             /* stray continuation byte */
    expect_error("\"\xc0\xaf\"", "line 1 column 2:", "UTF-8");         /* overlong '/' */
    expect_error("\"\xe0\x80\xaf\"", "line 1 column 2:", "UTF-8");     /* overlong 3-byte */
    expect_error("\"\xed\xa0\x80\"", "line 1 column 2:", "UTF-8");     /* encoded surrogate U+D800 */
    expect_error("\"\xf4\x90\x80\x80\"", "line 1 column 2:", "UTF-8"); /* above U+10FFFF */
    expect_error("\"x\xe2\x82\"", "line 1 column 3:", "UTF-8");        /* truncated sequence */
}

Test(json, rejects_non_json_numbers)
{
    expect_error("[01]", "line 1 column 2:", "leading zero");
    expect_error("-012", "line 1 column 1:", "leading zero");
    expect_error("+1", "line 1 column 1:", "expected a JSON value");
    expect_error(".5", "line 1 column 1:", "expected a JSON value");
    expect_error("1.", "line 1 column 3:", "expected a digit after '.'");
    expect_error("1e", "line 1 column 3:", "exponent");
    expect_error("1e+", "line 1 column 4:", "exponent");
    expect_error("-", "line 1 column 2:", "expected a digit");
    expect_error("0x10", "line 1 column 2:", "expected end of input");
    expect_error("[nan]", "line 1 column 2:", "expected a JSON value");
    expect_error("-NaN", "line 1 column 2:", "expected a digit");
}

Test(json, rejects_trailing_garbage)
{
    expect_error("{} x", "line 1 column 4:", "expected end of input");
    expect_error("1 2", "line 1 column 3:", "expected end of input");
    expect_error("[1]\n]", "line 2 column 1:", "expected end of input");
    expect_error("truex", "line 1 column 5:", "expected end of input");
}

Test(json, rejects_nesting_deeper_than_256)
{
    char text[2 * 257 + 1];
    memset(text, '[', 257);
    memset(text + 257, ']', 257);
    text[514] = 0;
    expect_error(text, "line 1 column 257:", "256");
    /* Mixed objects/arrays count alike; the error comes before the missing keys are noticed. */
    char mixed[8 * 257 + 1];
    size_t n = 0;
    for (int i = 0; i < 257; i++) {
        n += (size_t)snprintf(mixed + n, sizeof mixed - n, "%s", i % 2 ? "[" : "{\"k\":");
    }
    /* The 257th container (i = 256, an object) starts at byte 128 * 5 + 128 * 1 + 1. */
    expect_error(mixed, "line 1 column 769:", "256");
}

Test(json, reports_oom_without_leaking)
{
    const char *text = "{\"a\": [1, 2.5, \"str\\u00e9\", {\"b\": null, \"c\": [true, false]}], \"d\": \"x\"}";
    for (uint64_t n = 1;; n++) {
        struct kr_json *v = NULL;
        struct kr_err err = {0};
        kr_alloc_fail_at(n, 0);
        enum kr_status st = kr_json_parse(text, strlen(text), &v, &err);
        kr_alloc_fail_at(0, 0);
        if (st == KR_OK) {
            cr_expect_gt(n, 1);
            cr_expect_eq(must_get(v, "d")->str[0], 'x');
            kr_json_free(v);
            break;
        }
        cr_assert_eq(st, KR_ERR_NOMEM, "allocation %llu: %s", (unsigned long long)n, err.msg);
        cr_assert_null(v);
        cr_assert_eq(kr_alloc_bytes_in_use(), g_base, "leak after failing allocation %llu",
                     (unsigned long long)n);
        cr_assert_lt(n, 1000);
    }
}

/* ---- files ----------------------------------------------------------------------------------- */

Test(json, parse_file_reports_missing_path)
{
    const char *path = "/nonexistent-krait-dir/config.json";
    struct kr_json *v = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_json_parse_file(path, &v, &err);
    cr_expect_eq(st, KR_ERR_IO);
    cr_expect_null(v);
    cr_expect(strstr(err.msg, path) == err.msg, "message: %s", err.msg);
    cr_expect(strstr(err.msg, "cannot open") != NULL, "message: %s", err.msg);
    cr_expect(strstr(err.msg, "No such file") != NULL, "message: %s", err.msg);
}

Test(json, parse_file_reads_and_prefixes_errors_with_path)
{
    char path[] = "/tmp/kr_json_test_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    const char good[] = "{\"hidden_size\": 4096,\n \"rope_theta\": 1e6}\n";
    cr_assert_eq(write(fd, good, strlen(good)), (ssize_t)strlen(good));
    close(fd);
    struct kr_json *v = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_json_parse_file(path, &v, &err), KR_OK, "%s", err.msg);
    cr_expect_eq(must_get(v, "hidden_size")->integer, 4096);
    cr_expect_eq(must_get(v, "rope_theta")->number, 1e6);
    kr_json_free(v);

    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("{\"a\": 1,\n \"b\": }", f);
    fclose(f);
    v = NULL;
    cr_expect_eq(kr_json_parse_file(path, &v, &err), KR_ERR_FORMAT);
    cr_expect_null(v);
    char want[256];
    snprintf(want, sizeof want, "%s: line 2 column 7:", path);
    cr_expect(strncmp(err.msg, want, strlen(want)) == 0, "message \"%s\", want prefix \"%s\"", err.msg, want);
    unlink(path);
}

Test(json, parse_file_reads_large_files)
{
    /* Larger than one read buffer: an array of 100000 small integers. */
    char path[] = "/tmp/kr_json_test_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    FILE *f = fdopen(fd, "w");
    cr_assert_not_null(f);
    fputc('[', f);
    for (int i = 0; i < 100000; i++) {
        fprintf(f, "%s%d", i ? "," : "", i);
    }
    fputc(']', f);
    fclose(f);
    struct kr_json *v = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_json_parse_file(path, &v, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(v->n, 100000);
    cr_expect_eq(v->items[99999].integer, 99999);
    kr_json_free(v);
    unlink(path);
}
