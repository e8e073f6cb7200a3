/* Tool-call formats: detection, grammar specifications and the parser (tools.h). */
#define _POSIX_C_SOURCE 200809L
#include "tools.h"

#include "alloc.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>

/* ---- formats --------------------------------------------------------------------------------- */

enum body {
    BODY_MARKED, /* NAME and ARGS between fixed markers (DeepSeek-V3, V3.1) */
    BODY_JSON,   /* {"name": NAME, "arguments": ARGS} (hermes, nemotron) */
    BODY_DSML,   /* DeepSeek-V3.2's invoke and parameter elements */
    BODY_XML,    /* <function=NAME> and <parameter=K> elements (qwen3_coder) */
};

struct fmt {
    const char *name;
    enum body body;
    const char *start;      /* what opens the call section in generated text */
    /* the grammar: begin CALL (sep CALL)* end, CALL = prefix NAME mid ARGS suffix */
    const char *g_begin, *g_sep, *g_end, *g_prefix, *g_mid, *g_suffix;
    /* the parser (BODY_MARKED): call_open [type type_end] NAME name_end ARGS args_end; section_end */
    const char *call_open, *type_end, *name_end, *args_end, *section_end;
};

static const struct fmt fmts[] = {
    [KR_TOOL_FORMAT_NONE] = {.name = "none"},
    [KR_TOOL_FORMAT_DEEPSEEK_V3] = {
        .name = "deepseek_v3", .body = BODY_MARKED, .start = "<｜tool▁calls▁begin｜>",
        .g_begin = "<｜tool▁calls▁begin｜>", .g_sep = "\n", .g_end = "<｜tool▁calls▁end｜>",
        .g_prefix = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>", .g_mid = "\n```json\n",
        .g_suffix = "\n```<｜tool▁call▁end｜>",
        .call_open = "<｜tool▁call▁begin｜>", .type_end = "<｜tool▁sep｜>", .name_end = "\n```json\n",
        .args_end = "\n```<｜tool▁call▁end｜>", .section_end = "<｜tool▁calls▁end｜>"},
    [KR_TOOL_FORMAT_DEEPSEEK_V31] = {
        .name = "deepseek_v31", .body = BODY_MARKED, .start = "<｜tool▁calls▁begin｜>",
        .g_begin = "<｜tool▁calls▁begin｜>", .g_sep = "", .g_end = "<｜tool▁calls▁end｜>",
        .g_prefix = "<｜tool▁call▁begin｜>", .g_mid = "<｜tool▁sep｜>", .g_suffix = "<｜tool▁call▁end｜>",
        .call_open = "<｜tool▁call▁begin｜>", .name_end = "<｜tool▁sep｜>", .args_end = "<｜tool▁call▁end｜>",
        .section_end = "<｜tool▁calls▁end｜>"},
    [KR_TOOL_FORMAT_DEEPSEEK_V32] = {
        .name = "deepseek_v32", .body = BODY_DSML, .start = "<｜DSML｜function_calls>",
        .g_begin = "<｜DSML｜function_calls>\n", .g_sep = "", .g_end = "</｜DSML｜function_calls>",
        .g_prefix = "<｜DSML｜invoke name=\"", .g_mid = "\">\n", .g_suffix = "</｜DSML｜invoke>\n"},
    [KR_TOOL_FORMAT_HERMES] = {
        .name = "hermes", .body = BODY_JSON, .start = "<tool_call>",
        .g_begin = "", .g_sep = "\n", .g_end = "", .g_prefix = "<tool_call>\n{\"name\": \"",
        .g_mid = "\", \"arguments\": ", .g_suffix = "}\n</tool_call>"},
    [KR_TOOL_FORMAT_NEMOTRON] = {
        .name = "nemotron", .body = BODY_JSON, .start = "<TOOLCALL>",
        .g_begin = "<TOOLCALL>[", .g_sep = ", ", .g_end = "]</TOOLCALL>", .g_prefix = "{\"name\": \"",
        .g_mid = "\", \"arguments\": ", .g_suffix = "}"},
    [KR_TOOL_FORMAT_QWEN3_CODER] = {
        .name = "qwen3_coder", .body = BODY_XML, .start = "<tool_call>",
        .g_begin = "", .g_sep = "\n", .g_end = "", .g_prefix = "<tool_call>\n<function=", .g_mid = ">\n",
        .g_suffix = "</function>\n</tool_call>"},
};

const char *kr_tool_format_name(enum kr_tool_format f)
{
    return (unsigned)f < sizeof fmts / sizeof fmts[0] ? fmts[f].name : "none";
}

enum kr_tool_format kr_tool_format_detect(const char *tpl, const char *model_type)
{
    if (tpl) {
        if (strstr(tpl, "｜DSML｜")) {
            return KR_TOOL_FORMAT_DEEPSEEK_V32;
        }
        if (strstr(tpl, "<｜tool▁sep｜>")) {
            return strstr(tpl, "```json") ? KR_TOOL_FORMAT_DEEPSEEK_V3 : KR_TOOL_FORMAT_DEEPSEEK_V31;
        }
        if (strstr(tpl, "<TOOLCALL>")) {
            return KR_TOOL_FORMAT_NEMOTRON;
        }
        if (strstr(tpl, "<function=") && (strstr(tpl, "<tool_call>") || strstr(tpl, "<parameter="))) {
            return KR_TOOL_FORMAT_QWEN3_CODER;
        }
        if (strstr(tpl, "<tool_call>")) {
            return KR_TOOL_FORMAT_HERMES;
        }
    }
    if (model_type) {
        if (!strcmp(model_type, "deepseek_v32")) {
            return KR_TOOL_FORMAT_DEEPSEEK_V32;
        }
        if (!strcmp(model_type, "deepseek_v3")) {
            return KR_TOOL_FORMAT_DEEPSEEK_V3;
        }
        if (!strcmp(model_type, "nemotron_h")) {
            return KR_TOOL_FORMAT_NEMOTRON;
        }
    }
    return KR_TOOL_FORMAT_NONE;
}

bool kr_tool_name_valid(const char *name, size_t len)
{
    if (len == 0 || len > 64) {
        return false;
    }
    for (size_t i = 0; i < len; i++) {
        const char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
              ch == '-')) {
            return false;
        }
    }
    return true;
}

void kr_tool_call_id(char *buf, size_t cap)
{
    static atomic_uint_fast64_t state;
    uint64_t seed = atomic_load(&state);
    if (seed == 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t expected = 0;
        atomic_compare_exchange_strong(&state, &expected, ((uint64_t)ts.tv_sec << 30) ^ (uint64_t)ts.tv_nsec);
    }
    uint64_t w[2];
    for (int i = 0; i < 2; i++) { /* splitmix64 over a shared counter: distinct ids across threads */
        uint64_t z = atomic_fetch_add(&state, 0x9e3779b97f4a7c15ull) + 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        w[i] = z ^ (z >> 31);
    }
    snprintf(buf, cap, "call_%016llx%08llx", (unsigned long long)w[0], (unsigned long long)(w[1] & 0xffffffffu));
}

/* ---- grammar specification ------------------------------------------------------------------- */

enum kr_status kr_tool_grammar_spec(enum kr_tool_format f, const json_t *tools, const char *only, int32_t max_calls,
                                    char **spec, size_t *len)
{
    *spec = NULL;
    *len = 0;
    if (f == KR_TOOL_FORMAT_NONE || (unsigned)f >= sizeof fmts / sizeof fmts[0]) {
        return KR_ERR_INVAL;
    }
    const struct fmt *m = &fmts[f];
    json_t *root = json_object(), *fo = json_object(), *list = json_array();
    bool ok = root && fo && list;
    ok = ok && !json_object_set_new(fo, "begin", json_string(m->g_begin)) &&
         !json_object_set_new(fo, "sep", json_string(m->g_sep)) && !json_object_set_new(fo, "end", json_string(m->g_end)) &&
         !json_object_set_new(fo, "prefix", json_string(m->g_prefix)) &&
         !json_object_set_new(fo, "mid", json_string(m->g_mid)) &&
         !json_object_set_new(fo, "suffix", json_string(m->g_suffix)) &&
         !json_object_set_new(fo, "dsml", json_boolean(m->body == BODY_DSML)) &&
         !json_object_set_new(fo, "xml", json_boolean(m->body == BODY_XML));
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        json_t *fn = json_object_get(t, "function");
        json_t *name = json_object_get(fn, "name"), *params = json_object_get(fn, "parameters");
        if (!ok || (only && strcmp(json_string_value(name), only) != 0)) {
            continue;
        }
        json_t *e = json_object();
        ok = e && !json_object_set(e, "name", name) && (!params || !json_object_set(e, "parameters", params)) &&
             !json_array_append_new(list, e);
        if (!ok) {
            json_decref(e);
        }
    }
    ok = ok && !json_object_set(root, "format", fo) && !json_object_set(root, "tools", list) &&
         !json_object_set_new(root, "max_calls", json_integer(max_calls));
    char *text = ok ? json_dumps(root, JSON_COMPACT | JSON_ENSURE_ASCII) : NULL;
    json_decref(fo);
    json_decref(list);
    json_decref(root);
    if (!text) {
        return KR_ERR_NOMEM;
    }
    *len = strlen(text);
    *spec = kr_strndup(text, *len);
    json_malloc_t jmalloc = NULL;
    json_free_t jfree = NULL;
    json_get_alloc_funcs(&jmalloc, &jfree);
    jfree(text); /* jansson's allocator (krait routes it through kr_malloc) */
    return *spec ? KR_OK : KR_ERR_NOMEM;
}

/* ---- parser ---------------------------------------------------------------------------------- */

/* A match step's outcome: matched (the cursor moved), the text ends inside what could still match,
 * or it cannot match. */
enum step { ST_OK, ST_MORE, ST_BAD };

struct cur {
    const char *t;
    size_t len, pos;
};

/* The first occurrence of needle[0..m) in hay[0..n), or NULL. */
static const char *find(const char *hay, size_t n, const char *needle, size_t m)
{
    for (size_t i = 0; m && i + m <= n; i++) {
        if (hay[i] == needle[0] && memcmp(hay + i, needle, m) == 0) {
            return hay + i;
        }
    }
    return NULL;
}

static bool is_ws(char ch)
{
    return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r';
}

static void skip_ws(struct cur *c)
{
    while (c->pos < c->len && is_ws(c->t[c->pos])) {
        c->pos++;
    }
}

/* The literal `lit` at the cursor. */
static enum step lit(struct cur *c, const char *lit)
{
    const size_t n = strlen(lit), have = c->len - c->pos;
    if (memcmp(c->t + c->pos, lit, have < n ? have : n) != 0) {
        return ST_BAD;
    }
    if (have < n) {
        return ST_MORE;
    }
    c->pos += n;
    return ST_OK;
}

/* The longest suffix of t[0..n) that is a proper prefix of `marker`. */
static size_t partial_tail(const char *t, size_t n, const char *marker)
{
    const size_t m = strlen(marker);
    for (size_t k = m - 1 < n ? m - 1 : n; k > 0; k--) {
        if (memcmp(t + n - k, marker, k) == 0) {
            return k;
        }
    }
    return 0;
}

/* Text up to `marker`: *at..*end is the piece. ST_OK past the marker; ST_MORE with *end before
 * any tail that could begin the marker. */
static enum step until(struct cur *c, const char *marker, size_t *at, size_t *end)
{
    *at = c->pos;
    const char *hit = find(c->t + c->pos, c->len - c->pos, marker, strlen(marker));
    if (!hit) {
        *end = c->len - partial_tail(c->t + c->pos, c->len - c->pos, marker);
        return ST_MORE;
    }
    *end = (size_t)(hit - c->t);
    c->pos = *end + strlen(marker);
    return ST_OK;
}

/* Whether t[0..n) can be a function name (model output is checked, not trusted). */
static bool name_ok(const char *t, size_t n)
{
    if (n > 256) {
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        if (t[i] == '\n' || t[i] == '<' || t[i] == '"') {
            return false;
        }
    }
    return true;
}

/* Scans one JSON value at the cursor (its syntax loosely: brackets, strings and escapes; the
 * client parses the arguments). ST_OK past it; ST_MORE when the text ends inside it. */
static enum step json_value(struct cur *c)
{
    size_t p = c->pos;
    if (p >= c->len) {
        return ST_MORE;
    }
    char stack[64];
    int depth = 0;
    bool in_str = false, esc = false;
    const char first = c->t[p];
    if (first != '{' && first != '[' && first != '"') { /* a number or a literal: up to a delimiter */
        while (p < c->len && ((c->t[p] >= '0' && c->t[p] <= '9') || (c->t[p] >= 'a' && c->t[p] <= 'z') ||
                              c->t[p] == '-' || c->t[p] == '+' || c->t[p] == '.' || c->t[p] == 'E')) {
            p++;
        }
        if (p == c->pos) {
            return ST_BAD;
        }
        if (p == c->len) {
            return ST_MORE;
        }
        c->pos = p;
        return ST_OK;
    }
    for (; p < c->len; p++) {
        const char ch = c->t[p];
        if (in_str) {
            if (esc) {
                esc = false;
            } else if (ch == '\\') {
                esc = true;
            } else if (ch == '"') {
                in_str = false;
                if (depth == 0) {
                    c->pos = p + 1;
                    return ST_OK;
                }
            }
            continue;
        }
        if (ch == '"') {
            in_str = true;
        } else if (ch == '{' || ch == '[') {
            if (depth == (int)sizeof stack) {
                return ST_BAD;
            }
            stack[depth++] = ch == '{' ? '}' : ']';
        } else if (ch == '}' || ch == ']') {
            if (depth == 0 || stack[depth - 1] != ch) {
                return ST_BAD;
            }
            if (--depth == 0) {
                c->pos = p + 1;
                return ST_OK;
            }
        }
    }
    return ST_MORE;
}

static enum kr_status add_call(struct kr_tool_parse *o, const char *name, size_t name_len)
{
    struct kr_tool_call *v = kr_realloc(o->calls, (size_t)(o->n_calls + 1) * sizeof *v);
    if (!v) {
        return KR_ERR_NOMEM;
    }
    o->calls = v;
    struct kr_tool_call *k = &v[o->n_calls];
    memset(k, 0, sizeof *k);
    if (!(k->name = kr_strndup(name, name_len))) {
        return KR_ERR_NOMEM;
    }
    o->n_calls++;
    return KR_OK;
}

/* Appends n bytes to the last call's arguments. */
static enum kr_status args_add(struct kr_tool_parse *o, const char *s, size_t n)
{
    struct kr_tool_call *k = &o->calls[o->n_calls - 1];
    char *v = kr_realloc(k->args, k->args_len + n + 1);
    if (!v) {
        return KR_ERR_NOMEM;
    }
    memcpy(v + k->args_len, s, n);
    k->args = v;
    k->args_len += n;
    v[k->args_len] = 0;
    return KR_OK;
}

/* Appends s[0..n) as JSON string content. */
static enum kr_status args_add_escaped(struct kr_tool_parse *o, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const unsigned char ch = (unsigned char)s[i];
        char e[8];
        size_t k = 0;
        if (ch == '"' || ch == '\\') {
            e[k++] = '\\';
            e[k++] = (char)ch;
        } else if (ch == '\n') {
            memcpy(e, "\\n", 2), k = 2;
        } else if (ch == '\r') {
            memcpy(e, "\\r", 2), k = 2;
        } else if (ch == '\t') {
            memcpy(e, "\\t", 2), k = 2;
        } else if (ch < 0x20) {
            k = (size_t)snprintf(e, sizeof e, "\\u%04x", ch);
        } else {
            e[k++] = (char)ch;
        }
        KR_TRY(args_add(o, e, k));
    }
    return KR_OK;
}

/* The calls of one section, from the cursor just past its start marker. Returns the step that
 * stopped it: ST_OK (the section closed), ST_MORE (the text ended) or ST_BAD (malformed). */
static enum step parse_marked(const struct fmt *m, struct cur *c, int32_t max_calls, struct kr_tool_parse *o,
                              enum kr_status *st)
{
    for (;;) {
        if (max_calls && o->n_calls >= max_calls) {
            return ST_OK;
        }
        skip_ws(c);
        enum step s = lit(c, m->section_end);
        if (s == ST_OK) {
            return ST_OK;
        }
        if ((s = lit(c, m->call_open)) != ST_OK) {
            return s == ST_BAD && lit(c, m->section_end) == ST_MORE ? ST_MORE : s;
        }
        size_t at, end;
        if (m->type_end && (s = until(c, m->type_end, &at, &end)) != ST_OK) {
            return s == ST_MORE && !name_ok(c->t + at, end - at) ? ST_BAD : s;
        }
        s = until(c, m->name_end, &at, &end);
        if (!name_ok(c->t + at, end - at) || (s == ST_OK && end == at)) {
            return ST_BAD;
        }
        if (s != ST_OK) {
            return s;
        }
        if ((*st = add_call(o, c->t + at, end - at)) != KR_OK) {
            return ST_BAD;
        }
        s = until(c, m->args_end, &at, &end);
        if ((*st = args_add(o, c->t + at, end - at)) != KR_OK || s != ST_OK) {
            return s;
        }
        o->calls[o->n_calls - 1].complete = true;
    }
}

/* {"name": NAME, "arguments": ARGS} at the cursor (whitespace allowed between tokens). */
static enum step parse_json_call(struct cur *c, struct kr_tool_parse *o, enum kr_status *st)
{
    static const char *const head[] = {"{", "\"name\"", ":", "\""};
    enum step s;
    for (size_t i = 0; i < 4; i++) {
        skip_ws(c);
        if ((s = lit(c, head[i])) != ST_OK) {
            return s;
        }
    }
    size_t at, end;
    s = until(c, "\"", &at, &end);
    if (!name_ok(c->t + at, end - at) || memchr(c->t + at, '\\', end - at) || (s == ST_OK && end == at)) {
        return ST_BAD;
    }
    if (s != ST_OK) {
        return s;
    }
    static const char *const mid[] = {",", "\"arguments\"", ":"};
    const size_t name_at = at, name_len = end - at;
    for (size_t i = 0; i < 3; i++) {
        skip_ws(c);
        if ((s = lit(c, mid[i])) != ST_OK) {
            return s;
        }
    }
    skip_ws(c);
    if ((*st = add_call(o, c->t + name_at, name_len)) != KR_OK) {
        return ST_BAD;
    }
    const size_t v0 = c->pos;
    s = json_value(c);
    if (s == ST_BAD) {
        return ST_BAD;
    }
    if ((*st = args_add(o, c->t + v0, (s == ST_OK ? c->pos : c->len) - v0)) != KR_OK || s != ST_OK) {
        return s;
    }
    skip_ws(c);
    if ((s = lit(c, "}")) != ST_OK) {
        return s;
    }
    o->calls[o->n_calls - 1].complete = true;
    return ST_OK;
}

static enum step parse_json(const struct fmt *m, struct cur *c, int32_t max_calls, bool nemotron,
                            struct kr_tool_parse *o, enum kr_status *st)
{
    enum step s;
    if (nemotron) {
        skip_ws(c);
        if ((s = lit(c, "[")) != ST_OK) {
            return s;
        }
    }
    for (;;) {
        if ((s = parse_json_call(c, o, st)) != ST_OK) {
            return s;
        }
        skip_ws(c);
        if (!nemotron && (s = lit(c, "</tool_call>")) != ST_OK) {
            return s;
        }
        if (max_calls && o->n_calls >= max_calls) {
            return ST_OK;
        }
        skip_ws(c);
        if (nemotron) {
            if ((s = lit(c, ",")) == ST_OK) {
                continue;
            }
            if (s == ST_MORE || (s = lit(c, "]")) != ST_OK) {
                return s;
            }
            skip_ws(c);
            s = lit(c, "</TOOLCALL>");
            return s == ST_BAD ? ST_OK : s; /* what follows the closed list is not ours */
        }
        if ((s = lit(c, m->start)) != ST_OK) {
            return s == ST_MORE ? ST_MORE : ST_OK; /* no further <tool_call>: the section ended */
        }
    }
}

static enum step parse_dsml(struct cur *c, int32_t max_calls, struct kr_tool_parse *o, enum kr_status *st)
{
    for (;;) {
        if (max_calls && o->n_calls >= max_calls) {
            return ST_OK;
        }
        skip_ws(c);
        enum step s = lit(c, "</｜DSML｜function_calls>");
        if (s == ST_OK) {
            return ST_OK;
        }
        if ((s = lit(c, "<｜DSML｜invoke name=\"")) != ST_OK) {
            return s == ST_BAD && lit(c, "</｜DSML｜function_calls>") == ST_MORE ? ST_MORE : s;
        }
        size_t at, end;
        s = until(c, "\"", &at, &end);
        if (!name_ok(c->t + at, end - at) || (s == ST_OK && end == at)) {
            return ST_BAD;
        }
        if (s != ST_OK || (s = lit(c, ">")) != ST_OK) {
            return s;
        }
        if ((*st = add_call(o, c->t + at, end - at)) != KR_OK) {
            return ST_BAD;
        }
        bool any = false;
        for (;;) {
            skip_ws(c);
            if ((s = lit(c, "</｜DSML｜invoke>")) == ST_OK) {
                break;
            }
            if ((s = lit(c, "<｜DSML｜parameter name=\"")) != ST_OK) {
                return s == ST_BAD && lit(c, "</｜DSML｜invoke>") == ST_MORE ? ST_MORE : s;
            }
            size_t kat, kend;
            if ((s = until(c, "\"", &kat, &kend)) != ST_OK) {
                return s;
            }
            skip_ws(c);
            if ((s = lit(c, "string=\"")) != ST_OK) {
                return s;
            }
            bool is_str;
            if ((s = lit(c, "true\"")) == ST_OK) {
                is_str = true;
            } else if (s == ST_MORE || (s = lit(c, "false\"")) != ST_OK) {
                return s;
            } else {
                is_str = false;
            }
            skip_ws(c);
            if ((s = lit(c, ">")) != ST_OK) {
                return s;
            }
            if ((*st = args_add(o, any ? ", \"" : "{\"", 2 + any)) != KR_OK ||
                (*st = args_add_escaped(o, c->t + kat, kend - kat)) != KR_OK ||
                (*st = args_add(o, is_str ? "\": \"" : "\": ", is_str ? 4 : 3)) != KR_OK) {
                return ST_BAD;
            }
            any = true;
            size_t vat, vend;
            s = until(c, "</｜DSML｜parameter>", &vat, &vend);
            *st = is_str ? args_add_escaped(o, c->t + vat, vend - vat) : args_add(o, c->t + vat, vend - vat);
            if (*st != KR_OK || s != ST_OK) {
                return *st != KR_OK ? ST_BAD : s;
            }
            if (is_str && (*st = args_add(o, "\"", 1)) != KR_OK) {
                return ST_BAD;
            }
        }
        if ((*st = args_add(o, any ? "}" : "{}", any ? 1 : 2)) != KR_OK) {
            return ST_BAD;
        }
        o->calls[o->n_calls - 1].complete = true;
    }
}

/* qwen3_coder: how a parameter's raw text becomes a JSON value (kr_tool_parse in tools.h). */
enum xml_kind {
    XK_STRING, /* the JSON string of the text */
    XK_TYPED,  /* the text as JSON (a declared non-string type) */
    XK_GUESS,  /* no tools: JSON unless it is not a number, boolean, null, object or array */
};

/* Whether a parameter's JSON schema allows a string (or says nothing of its type). */
static bool allows_string(const json_t *s, int depth)
{
    if (!json_is_object(s) || depth > 16) {
        return true;
    }
    const json_t *t = json_object_get(s, "type");
    if (json_is_string(t)) {
        return strcmp(json_string_value(t), "string") == 0;
    }
    if (json_is_array(t)) {
        for (size_t i = 0; i < json_array_size(t); i++) {
            const char *v = json_string_value(json_array_get(t, i));
            if (v && !strcmp(v, "string")) {
                return true;
            }
        }
        return false;
    }
    if (t) {
        return true; /* a type this rule does not know */
    }
    bool alts = false;
    static const char *const keys[] = {"anyOf", "oneOf"};
    for (size_t k = 0; k < 2; k++) {
        const json_t *l = json_object_get(s, keys[k]);
        for (size_t i = 0; json_is_array(l) && i < json_array_size(l); i++) {
            alts = true;
            if (allows_string(json_array_get(l, i), depth + 1)) {
                return true;
            }
        }
    }
    if (alts) {
        return false;
    }
    const json_t *e = json_object_get(s, "enum"), *k = json_object_get(s, "const");
    if (json_is_array(e)) {
        for (size_t i = 0; i < json_array_size(e); i++) {
            if (json_is_string(json_array_get(e, i))) {
                return true;
            }
        }
        return false;
    }
    return k ? json_is_string(k) : true;
}

/* The declared properties of function name[0..n) in the request's tools, or NULL. */
static const json_t *xml_props(const json_t *tools, const char *name, size_t n)
{
    for (size_t i = 0; i < json_array_size(tools); i++) {
        const json_t *fn = json_object_get(json_array_get(tools, i), "function");
        const json_t *nm = json_object_get(fn, "name");
        if (json_is_string(nm) && json_string_length(nm) == n && memcmp(json_string_value(nm), name, n) == 0) {
            return json_object_get(json_object_get(fn, "parameters"), "properties");
        }
    }
    return NULL;
}

static enum xml_kind xml_kind(const json_t *tools, const json_t *props, const char *key, size_t n)
{
    if (!tools) {
        return XK_GUESS;
    }
    if (!json_is_object(props) || n > 256) {
        return XK_STRING;
    }
    char k[257];
    memcpy(k, key, n);
    k[n] = 0;
    const json_t *s = json_object_get(props, k);
    return !s || allows_string(s, 0) ? XK_STRING : XK_TYPED;
}

/* Appends a closed non-string parameter's value v[0..n) (kind XK_TYPED or XK_GUESS). */
static enum kr_status xml_value(struct kr_tool_parse *o, enum xml_kind kind, const char *v, size_t n)
{
    size_t a = 0, b = n;
    while (a < b && is_ws(v[a])) {
        a++;
    }
    while (b > a && is_ws(v[b - 1])) {
        b--;
    }
    json_error_t je;
    json_t *j = b > a ? json_loadb(v + a, b - a, JSON_DECODE_ANY | JSON_DECODE_INT_AS_REAL, &je) : NULL;
    const bool as_json = j && (kind == XK_TYPED || !json_is_string(j));
    json_decref(j);
    if (as_json) {
        return args_add(o, v + a, b - a);
    }
    if (kind == XK_TYPED) { /* Python's spelling, as a template's `value | string` writes it */
        static const char *const py[][2] = {{"true", "true"}, {"false", "false"}, {"none", "null"}};
        for (size_t i = 0; i < 3; i++) {
            if (b - a == strlen(py[i][0]) && strncasecmp(v + a, py[i][0], b - a) == 0) {
                return args_add(o, py[i][1], strlen(py[i][1]));
            }
        }
    }
    enum kr_status st = args_add(o, "\"", 1);
    if (st == KR_OK) {
        st = args_add_escaped(o, v, n);
    }
    return st == KR_OK ? args_add(o, "\"", 1) : st;
}

/* The calls from the cursor just past the first <tool_call>. A call is complete at its
 * </function>; its </tool_call> ends it, and a further <tool_call> after whitespace continues the
 * section. */
static enum step parse_xml(const json_t *tools, struct cur *c, int32_t max_calls, struct kr_tool_parse *o,
                           enum kr_status *st)
{
    for (;;) {
        skip_ws(c);
        enum step s = lit(c, "<function=");
        if (s != ST_OK) {
            return s;
        }
        size_t at, end;
        s = until(c, ">", &at, &end);
        if (!name_ok(c->t + at, end - at) || (s == ST_OK && end == at)) {
            return ST_BAD;
        }
        if (s != ST_OK) {
            return s;
        }
        if ((*st = add_call(o, c->t + at, end - at)) != KR_OK) {
            return ST_BAD;
        }
        const json_t *props = xml_props(tools, c->t + at, end - at);
        bool any = false;
        for (;;) {
            skip_ws(c);
            if ((s = lit(c, "</function>")) == ST_OK) {
                break;
            }
            if ((s = lit(c, "<parameter=")) != ST_OK) {
                return s == ST_BAD && lit(c, "</function>") == ST_MORE ? ST_MORE : s;
            }
            size_t kat, kend;
            s = until(c, ">", &kat, &kend);
            if (!name_ok(c->t + kat, kend - kat) || (s == ST_OK && kend == kat)) {
                return ST_BAD;
            }
            if (s != ST_OK) {
                return s;
            }
            const enum xml_kind kind = xml_kind(tools, props, c->t + kat, kend - kat);
            const bool str = kind == XK_STRING;
            if ((*st = args_add(o, any ? ", \"" : "{\"", 2 + any)) != KR_OK ||
                (*st = args_add_escaped(o, c->t + kat, kend - kat)) != KR_OK ||
                (*st = args_add(o, str ? "\": \"" : "\": ", str ? 4 : 3)) != KR_OK) {
                return ST_BAD;
            }
            any = true;
            size_t vat, vend;
            s = until(c, "</parameter>", &vat, &vend);
            /* the newlines around the value are layout; while the text grows, a last newline
             * is held back (it may be the one before </parameter>) */
            if (vat < vend && c->t[vat] == '\n') {
                vat++;
            }
            if (vend > vat && c->t[vend - 1] == '\n') {
                vend--;
            }
            if (str) {
                if ((*st = args_add_escaped(o, c->t + vat, vend - vat)) != KR_OK) {
                    return ST_BAD;
                }
                if (s != ST_OK) {
                    return s;
                }
                *st = args_add(o, "\"", 1);
            } else {
                if (s != ST_OK) {
                    return s;
                }
                *st = xml_value(o, kind, c->t + vat, vend - vat);
            }
            if (*st != KR_OK) {
                return ST_BAD;
            }
        }
        if ((*st = args_add(o, any ? "}" : "{}", any ? 1 : 2)) != KR_OK) {
            return ST_BAD;
        }
        o->calls[o->n_calls - 1].complete = true;
        skip_ws(c);
        if ((s = lit(c, "</tool_call>")) != ST_OK) {
            return s;
        }
        if (max_calls && o->n_calls >= max_calls) {
            return ST_OK;
        }
        skip_ws(c);
        if ((s = lit(c, "<tool_call>")) != ST_OK) {
            return s == ST_MORE ? ST_MORE : ST_OK; /* no further <tool_call>: the section ended */
        }
    }
}

void kr_tool_parse_free(struct kr_tool_parse *p)
{
    for (int32_t i = 0; p && i < p->n_calls; i++) {
        kr_free(p->calls[i].name);
        kr_free(p->calls[i].args);
    }
    if (p) {
        kr_free(p->calls);
        memset(p, 0, sizeof *p);
    }
}

enum kr_status kr_tool_parse(enum kr_tool_format f, const json_t *tools, const char *text, size_t len, bool final,
                             int32_t max_calls, struct kr_tool_parse *out)
{
    memset(out, 0, sizeof *out);
    out->content_len = len;
    if (f == KR_TOOL_FORMAT_NONE || (unsigned)f >= sizeof fmts / sizeof fmts[0] || !text) {
        return KR_OK;
    }
    const struct fmt *m = &fmts[f];
    const char *hit = find(text, len, m->start, strlen(m->start));
    if (!hit) {
        out->content_len = final ? len : len - partial_tail(text, len, m->start);
        return KR_OK;
    }
    out->content_len = (size_t)(hit - text);
    struct cur c = {.t = text, .len = len, .pos = out->content_len};
    enum kr_status st = KR_OK;
    enum step s;
    if (m->body == BODY_JSON) {
        c.pos += strlen(m->start);
        s = parse_json(m, &c, max_calls, f == KR_TOOL_FORMAT_NEMOTRON, out, &st);
    } else if (m->body == BODY_XML) {
        c.pos += strlen(m->start);
        s = parse_xml(tools, &c, max_calls, out, &st);
    } else {
        c.pos += strlen(m->start);
        s = m->body == BODY_DSML ? parse_dsml(&c, max_calls, out, &st) : parse_marked(m, &c, max_calls, out, &st);
    }
    if (st != KR_OK) {
        kr_tool_parse_free(out);
        return st;
    }
    if ((s == ST_BAD || final) && out->n_calls == 0) {
        out->content_len = len; /* no call after all: it was text */
        return KR_OK;
    }
    out->closed = s != ST_MORE;
    return KR_OK;
}
