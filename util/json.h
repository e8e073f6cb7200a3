#pragma once
/* A small, read-only JSON DOM for the files a checkpoint brings (config.json, safetensors
 * headers, model.safetensors.index.json). Independent of jansson so that engine/ needs no JSON
 * library. It accepts what Python writes and strict parsers reject: bare `Infinity`, `-Infinity`
 * and `NaN` tokens. Numbers that arrive as the strings "Infinity"/"-Infinity"/"NaN"/"inf" or as
 * transformers-5 objects {"__float__": "Infinity"} are read as numbers by kr_json_as_double().
 * Duplicate object keys: the last one wins in lookups (as Python's json does). */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum kr_json_type {
    KR_JSON_NULL,
    KR_JSON_BOOL,
    KR_JSON_NUMBER,
    KR_JSON_STRING,
    KR_JSON_ARRAY,
    KR_JSON_OBJECT,
};

struct kr_json {
    enum kr_json_type type;
    bool boolean;   /* KR_JSON_BOOL */
    double number;  /* KR_JSON_NUMBER (also set for integers) */
    bool is_int;    /* KR_JSON_NUMBER written without fraction/exponent and within int64 range */
    int64_t integer; /* KR_JSON_NUMBER when is_int */
    char *str;      /* KR_JSON_STRING: NUL-terminated UTF-8 (may contain NUL if escaped \u0000) */
    size_t str_len; /* KR_JSON_STRING: bytes, without the terminator */
    size_t n;       /* KR_JSON_ARRAY / KR_JSON_OBJECT: number of items */
    struct kr_json *items; /* [n] values */
    char **keys;    /* KR_JSON_OBJECT: [n] NUL-terminated keys */
};

/* Parses `len` bytes of `text` (need not be NUL-terminated). On success *out is a new tree the
 * caller frees with kr_json_free(). On failure returns KR_ERR_FORMAT (or KR_ERR_NOMEM) and writes
 * "line L column C: what was expected" into err. Nesting deeper than 256 levels is an error. */
enum kr_status kr_json_parse(const char *text, size_t len, struct kr_json **out, struct kr_err *err);

/* Reads a whole file and parses it; errors are prefixed with the path. */
enum kr_status kr_json_parse_file(const char *path, struct kr_json **out, struct kr_err *err);

/* Frees a tree returned by a parse function. NULL is a no-op. */
void kr_json_free(struct kr_json *v);

/* Object member lookup (last duplicate wins); NULL if `obj` is not an object or has no such key. */
const struct kr_json *kr_json_get(const struct kr_json *obj, const char *key);

/* Numeric value of a number, of a string spelling a non-finite float ("Infinity", "-Infinity",
 * "inf", "-inf", "NaN", "nan", case-insensitive) or of an object {"__float__": <such a string or
 * number>}. Returns false for anything else. */
bool kr_json_as_double(const struct kr_json *v, double *out);

/* Integer value of a number that is an exact integer (e.g. 4 or 4.0); false otherwise. */
bool kr_json_as_int(const struct kr_json *v, int64_t *out);

/* Short name of a type ("null", "boolean", "number", "string", "array", "object"). */
const char *kr_json_type_name(enum kr_json_type t);

#ifdef __cplusplus
}
#endif
