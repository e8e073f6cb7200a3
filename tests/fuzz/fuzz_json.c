/* Fuzz harness: util/json.c, the JSON reader of config.json, safetensors headers and the
 * safetensors index (untrusted files of a checkpoint). Besides what the sanitizers see, two
 * checks against jansson (an independent parser) on the same bytes:
 *   - a text jansson accepts (a strict RFC 8259 parser, any value at the top, \u0000 allowed) with
 *     at most 256 levels of nesting is accepted too (kr_json also takes NaN and Infinity); texts with
 *     a raw NUL byte are left out: jansson 2.14 accepts a number followed by one ("2\0"), which
 *     kr_json refuses, rightly;
 *   - when both accept, they read the same value: types, strings byte for byte, integers and
 *     doubles exactly, and each of jansson's object keys finds the same value (last duplicate).
 * Then every accessor runs over the whole tree. */
/* fuzz-max-len: 16384 (tools/fuzz.sh passes it as -max_len) */
#include "fuzz.h"

#include "json.h"

#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Containers nested in j, counting j itself. */
static int depth_of(json_t *j)
{
    int d = 0;
    if (json_is_array(j)) {
        for (size_t i = 0; i < json_array_size(j); i++) {
            int c = depth_of(json_array_get(j, i));
            d = c > d ? c : d;
        }
        return d + 1;
    }
    if (json_is_object(j)) {
        const char *k;
        json_t *v;
        json_object_foreach (j, k, v) {
            int c = depth_of(v);
            d = c > d ? c : d;
        }
        return d + 1;
    }
    return 0;
}

/* Whether kr's value v reads as jansson's j. */
static void same(const struct kr_json *v, json_t *j)
{
    switch (json_typeof(j)) {
    case JSON_NULL:
        KR_FUZZ_CHECK(v->type == KR_JSON_NULL, "null read as %s", kr_json_type_name(v->type));
        break;
    case JSON_TRUE:
    case JSON_FALSE:
        KR_FUZZ_CHECK(v->type == KR_JSON_BOOL && v->boolean == json_is_true(j), "boolean differs");
        break;
    case JSON_INTEGER:
        KR_FUZZ_CHECK(v->type == KR_JSON_NUMBER && v->is_int && v->integer == json_integer_value(j),
                      "integer %lld read as %s %lld", (long long)json_integer_value(j), kr_json_type_name(v->type),
                      (long long)v->integer);
        KR_FUZZ_CHECK(v->number == (double)json_integer_value(j), "integer's double differs");
        break;
    case JSON_REAL:
        KR_FUZZ_CHECK(v->type == KR_JSON_NUMBER && !v->is_int && v->number == json_real_value(j),
                      "real %.17g read as %s %.17g", json_real_value(j), kr_json_type_name(v->type), v->number);
        break;
    case JSON_STRING:
        KR_FUZZ_CHECK(v->type == KR_JSON_STRING && v->str_len == json_string_length(j) &&
                          memcmp(v->str, json_string_value(j), v->str_len) == 0 && v->str[v->str_len] == '\0',
                      "string differs");
        break;
    case JSON_ARRAY:
        KR_FUZZ_CHECK(v->type == KR_JSON_ARRAY && v->n == json_array_size(j), "array differs");
        for (size_t i = 0; i < v->n; i++) {
            same(&v->items[i], json_array_get(j, i));
        }
        break;
    case JSON_OBJECT: {
        KR_FUZZ_CHECK(v->type == KR_JSON_OBJECT && v->n >= json_object_size(j), "object differs");
        const char *k;
        json_t *m;
        json_object_foreach (j, k, m) {
            const struct kr_json *got = kr_json_get(v, k);
            KR_FUZZ_CHECK(got, "key \"%s\" missing", k);
            same(got, m);
        }
        for (size_t i = 0; i < v->n; i++) {
            KR_FUZZ_CHECK(json_object_get(j, v->keys[i]), "key \"%s\" not in jansson's object", v->keys[i]);
        }
        break;
    }
    }
}

/* Every accessor on every node (their results are checked against the node where they can be). */
static void walk(const struct kr_json *v)
{
    KR_FUZZ_CHECK(kr_json_type_name(v->type) != NULL, "no type name");
    double d;
    int64_t i;
    if (kr_json_as_int(v, &i)) {
        KR_FUZZ_CHECK(v->type == KR_JSON_NUMBER && (double)i == v->number, "as_int %lld of %.17g", (long long)i,
                      v->number);
    }
    if (v->type == KR_JSON_NUMBER) {
        KR_FUZZ_CHECK(kr_json_as_double(v, &d) && (d == v->number || (isnan(d) && isnan(v->number))),
                      "as_double of a number");
    } else {
        (void)kr_json_as_double(v, &d);
    }
    if (v->type == KR_JSON_ARRAY || v->type == KR_JSON_OBJECT) {
        for (size_t k = 0; k < v->n; k++) {
            walk(&v->items[k]);
            if (v->type == KR_JSON_OBJECT) {
                KR_FUZZ_CHECK(kr_json_get(v, v->keys[k]) != NULL, "own key \"%s\" not found", v->keys[k]);
            }
        }
    }
    (void)kr_json_get(v, "dtype");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kr_json *v = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_json_parse((const char *)data, size, &v, &err);
    KR_FUZZ_CHECK(st == KR_OK ? v != NULL : v == NULL && err.msg[0], "status %d without its result", (int)st);

    json_error_t je;
    json_t *j = memchr(data, 0, size) ? NULL
                                      : json_loadb((const char *)data, size, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (j && depth_of(j) <= 256) {
        KR_FUZZ_CHECK(st == KR_OK, "jansson accepts what kr_json refuses: %s", err.msg);
        same(v, j);
    }
    json_decref(j);
    if (v) {
        walk(v);
    }
    kr_json_free(v);
    return 0;
}
