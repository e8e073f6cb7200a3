#define _POSIX_C_SOURCE 200809L

#include "grammar.h"

#include "alloc.h"
#include "tokenizer.h"

#include <criterion/criterion.h>
#include <jansson.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* References independent of the code under test: JSON Schema documents are checked with ajv
 * (tests/api/grammar/validate.mjs, through node), regex matches with PCRE2, token masks with a
 * brute-force check of every token against the matcher. */

#define FIX KR_FIXTURES "/tokenizer"

static size_t g_base;

static void setup(void)
{
    g_base = kr_alloc_bytes_in_use();
}

static void teardown(void)
{
    cr_expect_eq(kr_alloc_bytes_in_use(), g_base, "host memory leaked: %zu bytes", kr_alloc_bytes_in_use() - g_base);
}

TestSuite(grammar, .init = setup, .fini = teardown, .timeout = 300);

/* ---- helpers ---------------------------------------------------------------------------------- */

static struct kr_grammar *gbnf(const char *text)
{
    struct kr_grammar *g = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_grammar_from_gbnf(text, strlen(text), NULL, &g, &err);
    cr_assert_eq(st, KR_OK, "GBNF did not compile: %s\n%s", err.msg, text);
    return g;
}

static struct kr_grammar *regex(const char *re)
{
    struct kr_grammar *g = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_grammar_from_regex(re, strlen(re), &g, &err);
    cr_assert_eq(st, KR_OK, "regex did not compile: %s: %s", re, err.msg);
    return g;
}

static struct kr_grammar *schema(const char *json)
{
    struct kr_grammar *g = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_grammar_from_json_schema(json, strlen(json), NULL, &g, &err);
    cr_assert_eq(st, KR_OK, "schema did not compile: %s\n%s", err.msg, json);
    return g;
}

static struct kr_grammar_matcher *matcher(const struct kr_grammar *g)
{
    struct kr_grammar_matcher *m = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_grammar_matcher_create(g, &m, &err), KR_OK, "%s", err.msg);
    return m;
}

/* Whether the grammar matches all of s[0..n). */
static bool matches_n(const struct kr_grammar *g, const char *s, size_t n)
{
    struct kr_grammar_matcher *m = matcher(g);
    bool ok = false;
    struct kr_err err = {0};
    cr_assert_eq(kr_grammar_matcher_accept_bytes(m, s, n, &ok, &err), KR_OK, "%s", err.msg);
    ok = ok && kr_grammar_matcher_can_end(m);
    kr_grammar_matcher_destroy(m);
    return ok;
}

static bool matches(const struct kr_grammar *g, const char *s)
{
    return matches_n(g, s, strlen(s));
}

static void expect_all(const struct kr_grammar *g, const char *const *yes, const char *const *no, const char *what)
{
    for (; yes && *yes; yes++) {
        cr_expect(matches(g, *yes), "%s should match \"%s\"", what, *yes);
    }
    for (; no && *no; no++) {
        cr_expect(!matches(g, *no), "%s should not match \"%s\"", what, *no);
    }
}

/* The seed of a random test: its own, or KR_GRAMMAR_SEED's (to run them with others by hand). */
static uint64_t seed(uint64_t own)
{
    const char *e = getenv("KR_GRAMMAR_SEED");
    return e && *e ? strtoull(e, NULL, 10) * 0x9E3779B97F4A7C15ull + 1 : own;
}

static uint64_t rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* A random text of the grammar: random allowed bytes (ASCII preferred) up to about soft_len bytes,
 * then the bytes that bring the completion closest, until the text can end. */
static size_t generate(const struct kr_grammar *g, uint64_t *rng, size_t soft_len, char *out, size_t cap)
{
    struct kr_grammar_matcher *m = matcher(g);
    struct kr_err err = {0};
    size_t len = 0;
    for (;;) {
        if (kr_grammar_matcher_can_end(m) &&
            (kr_grammar_matcher_is_done(m) || len >= soft_len || rnd(rng) % 16 == 0)) {
            break;
        }
        uint32_t set[8];
        kr_grammar_matcher_next_bytes(m, set);
        int cand[256], n = 0, n_ascii = 0;
        int64_t best = INT64_MAX;
        for (int b = 0; b < 256; b++) {
            if (!((set[b / 32] >> (b % 32)) & 1)) {
                continue;
            }
            if (len < soft_len) {
                cand[n++] = b;
                n_ascii += b < 0x80;
                continue;
            }
            bool ok;
            uint8_t byte = (uint8_t)b;
            cr_assert_eq(kr_grammar_matcher_accept_bytes(m, &byte, 1, &ok, &err), KR_OK, "%s", err.msg);
            cr_assert(ok, "next_bytes allowed byte 0x%02X that the matcher refuses", b);
            int64_t d = kr_grammar_matcher_min_remaining(m);
            cr_assert_eq(kr_grammar_matcher_rollback(m, 1), KR_OK);
            if (d < best) {
                best = d;
                n = 0;
            }
            if (d == best) {
                cand[n++] = b;
            }
        }
        cr_assert_gt(n, 0, "no byte allowed after %zu bytes but the text cannot end", len);
        int pick = cand[rnd(rng) % (uint64_t)n];
        if (len < soft_len && n_ascii > 0 && rnd(rng) % 4 != 0) {
            while (pick >= 0x80) {
                pick = cand[rnd(rng) % (uint64_t)n];
            }
        }
        /* whitespace seldom, where something else may come: else JSON gaps fill up with it */
        bool other = false;
        for (int k = 0; k < n; k++) {
            other |= !strchr(" \t\n\r", cand[k]);
        }
        for (int tries = 0; other && strchr(" \t\n\r", pick) && pick && rnd(rng) % 8 != 0 && tries < 64; tries++) {
            pick = cand[rnd(rng) % (uint64_t)n];
        }
        uint8_t byte = (uint8_t)pick;
        bool ok;
        cr_assert_eq(kr_grammar_matcher_accept_bytes(m, &byte, 1, &ok, &err), KR_OK, "%s", err.msg);
        cr_assert(ok);
        cr_assert_lt(len + 1, cap, "generated text too long");
        out[len++] = (char)byte;
    }
    out[len] = '\0';
    kr_grammar_matcher_destroy(m);
    return len;
}

/* ---- GBNF ------------------------------------------------------------------------------------- */

static const char *const arith_gbnf =
    "# arithmetic over integers\n"
    "root   ::= expr\n"
    "expr   ::= term (ws [-+] ws term)*\n"
    "term   ::= factor (ws [*/] ws factor)*\n"
    "factor ::= number | \"(\" ws expr ws \")\" | \"-\" factor\n"
    "number ::= [0-9]+\n"
    "ws     ::= [ ]?\n";

Test(grammar, gbnf_arithmetic_accepts_and_rejects)
{
    struct kr_grammar *g = gbnf(arith_gbnf);
    const char *yes[] = {"1", "12+3", "(1 + 2) * 3", "-(4/2)", "((((7))))", "1 - -2", NULL};
    const char *no[] = {"", "1+", "(1", "1)", "1 ++ 2", "a", "1  + 2", " 1", NULL};
    expect_all(g, yes, no, "arithmetic");
    kr_grammar_free(g);
}

/* JSON in GBNF, llama.cpp's grammars/json.gbnf shape written afresh. */
static const char *const json_gbnf =
    "root   ::= object\n"
    "value  ::= object | array | string | number | (\"true\" | \"false\" | \"null\") ws\n"
    "object ::=\n"
    "  \"{\" ws (\n"
    "            string \":\" ws value\n"
    "    (\",\" ws string \":\" ws value)*\n"
    "  )? \"}\" ws\n"
    "array  ::= \"[\" ws ( value (\",\" ws value)* )? \"]\" ws\n"
    "string ::= \"\\\"\" ( [^\"\\\\\\x7F\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4}) )* \"\\\"\" ws\n"
    "number ::= (\"-\"? ([0-9] | [1-9] [0-9]{0,15})) (\".\" [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws\n"
    "ws ::= | \" \" | \"\\n\" [ \\t]{0,20}\n";

Test(grammar, gbnf_json_grammar)
{
    struct kr_grammar *g = gbnf(json_gbnf);
    const char *yes[] = {"{}", "{\"a\": 1}", "{\"a\": [1, 2.5, \"x\", {\"b\": null}], \"c\": true}",
                         "{\"k\": \"\\u00e9\\n\"}", "{\"\xC3\xA9\": -0.5e3}", "{\n  \"a\": false\n}", NULL};
    const char *no[] = {"[]", "{\"a\" 1}", "{\"a\": 01x}", "{\"a\": tru}", "{'a': 1}", "{\"a\": \"\x01\"}", NULL};
    expect_all(g, yes, no, "json.gbnf");
    kr_grammar_free(g);
}

Test(grammar, gbnf_features)
{
    struct kr_grammar *g = gbnf("root ::= \"a\"{2,3} x{2} y{1,} z*\nx ::= [b-c]\ny ::= .\nz ::= [^a-y]\n");
    const char *yes[] = {"aabbq", "aaacbzz", "aabc c\xE2\x82\xAC", "aabb\xF0\x9F\x98\x80z", "aabbqaz", NULL};
    const char *no[] = {"abbq", "aaaabbq", "aabq", "aabb", "aab", NULL};
    expect_all(g, yes, no, "repetitions");
    kr_grammar_free(g);
    /* a body continued on the next line, starting with | */
    g = gbnf("root ::= \"a\"\n     | \"b\" # comment\nother ::= \"c\"");
    const char *yes2[] = {"a", "b", NULL};
    const char *no2[] = {"c", "ab", NULL};
    expect_all(g, yes2, no2, "continuation");
    kr_grammar_free(g);
    /* escapes and code points */
    g = gbnf("root ::= \"\\x41\\u00e9\\U0001F600\\t\\\"\" [\\u0100-\\u017F]");
    cr_expect(matches(g, "A\xC3\xA9\xF0\x9F\x98\x80\t\"\xC4\x80"));
    cr_expect(!matches(g, "A\xC3\xA9\xF0\x9F\x98\x80\t\"\xC6\x80"));
    kr_grammar_free(g);
    /* another start rule */
    struct kr_grammar *g2 = NULL;
    struct kr_err err = {0};
    const char *t = "a ::= \"x\" b\nb ::= \"y\"";
    cr_assert_eq(kr_grammar_from_gbnf(t, strlen(t), "a", &g2, &err), KR_OK, "%s", err.msg);
    cr_expect(matches(g2, "xy"));
    kr_grammar_free(g2);
}

static void expect_gbnf_error(const char *text, const char *want)
{
    struct kr_grammar *g = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_grammar_from_gbnf(text, strlen(text), NULL, &g, &err);
    cr_expect_eq(st, KR_ERR_INVAL, "should fail: %s", text);
    cr_expect_null(g);
    cr_expect(strstr(err.msg, want) != NULL, "message \"%s\" lacks \"%s\"", err.msg, want);
    kr_grammar_free(g);
}

Test(grammar, gbnf_errors_name_the_place)
{
    expect_gbnf_error("root ::= a\na ::= b", "line 2 column 7: undefined rule 'b'");
    expect_gbnf_error("root ::= expr\nexpr ::= expr \"+\" \"1\" | \"1\"", "line 2 column 1: rule 'expr' is left-recursive");
    expect_gbnf_error("root ::= a\na ::= b? c\nb ::= \"x\"\nc ::= a \"y\" | \"z\"", "left-recursive");
    expect_gbnf_error("root ::= (\"x\" | root)", "left-recursive");
    expect_gbnf_error("root = \"a\"", "line 1 column 6: expected '::='");
    expect_gbnf_error("root ::= \"abc", "line 1 column 10: unterminated string literal");
    expect_gbnf_error("root ::= [a-", "unterminated character class");
    expect_gbnf_error("root ::= (\"a\"", "line 1 column 10: missing ')'");
    expect_gbnf_error("root ::= \"a\" )", "unmatched ')'");
    expect_gbnf_error("root ::= \"a\"\nroot ::= \"b\"", "line 2 column 1: rule 'root' is defined twice");
    expect_gbnf_error("start ::= \"a\"", "no rule named 'root'");
    expect_gbnf_error("root ::= \"a\"{3,2}", "repetition bounds out of order");
    expect_gbnf_error("root ::= \"a\"{99999}", "repetition bound larger than");
    expect_gbnf_error("root ::= \"\\q\"", "unknown escape \\q");
    expect_gbnf_error("root ::= [z-a]", "range out of order");
    expect_gbnf_error("root ::= \"a\" @", "line 1 column 14: unexpected character '@'");
    expect_gbnf_error("root ::= x\nx ::= \"a\" x", "matches no text at all");
}

Test(grammar, tail_recursion_of_nullable_items_is_fine)
{
    /* (x?)* is a cycle through tail calls only: allowed, and it terminates */
    struct kr_grammar *g = gbnf("root ::= (\"a\"?)* \"b\"\n");
    const char *yes[] = {"b", "ab", "aaaab", NULL};
    const char *no[] = {"", "a", "ba", NULL};
    expect_all(g, yes, no, "(a?)*b");
    kr_grammar_free(g);
}

Test(grammar, dump_round_trips_through_gbnf)
{
    struct kr_grammar *g = gbnf(arith_gbnf);
    char *text;
    size_t len;
    cr_assert_eq(kr_grammar_to_gbnf(g, &text, &len), KR_OK);
    struct kr_grammar *g2 = gbnf(text);
    const char *yes[] = {"1", "(1 + 2) * 3", "-(4/2)", NULL};
    const char *no[] = {"1+", "(1", NULL};
    expect_all(g2, yes, no, "dumped arithmetic");
    kr_free(text);
    kr_grammar_free(g);
    kr_grammar_free(g2);
}

/* ---- regex ------------------------------------------------------------------------------------- */

static pcre2_code *pcre(const char *re)
{
    /* the grammar matches whole texts: anchor the reference the same way */
    char buf[1024];
    snprintf(buf, sizeof(buf), "^(?:%s)$", re);
    int code;
    PCRE2_SIZE off;
    pcre2_code *c = pcre2_compile((PCRE2_SPTR)buf, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_DOLLAR_ENDONLY, &code,
                                  &off, NULL);
    cr_assert_not_null(c, "PCRE2 rejects %s", buf);
    return c;
}

static bool pcre_matches(pcre2_code *c, const char *s, size_t n)
{
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(c, NULL);
    int rc = pcre2_match(c, (PCRE2_SPTR)s, n, 0, 0, md, NULL);
    pcre2_match_data_free(md);
    return rc >= 0;
}

static const char *const regexes[] = {
    "[a-z]+@[a-z]+\\.(com|org)",
    "(\\d{3}-){2}\\d{4}",
    "(?:[A-F0-9]{2}:){5}[A-F0-9]{2}",
    "\\w+\\s\\w+",
    "[^abc]{2,4}x?",
    "a|bc|def|",
    "(ab|a)(bc|c)*",
    ".{3}\xC3\xA9",
    "[\\x{e0}-\\x{ff}]+\\x41",
    "(\\+|-)?[1-9][0-9]{0,3}(\\.[0-9]+)?",
    "\\S\\D\\W",
    "((a|b)*c){1,3}",
    "[-a]+[a-]",
    "[\\]\\[]x\\.",
    "^abc$",
    "(?<year>[0-9]{4})-(?P<m>[01][0-9])",
    "a{2,}?b??c*?",
    "\\{\\}",
    "x{",
    NULL,
};

Test(grammar, regex_random_texts_match_pcre2)
{
    uint64_t rng = seed(0x9E3779B97F4A7C15ull);
    char text[4096];
    for (const char *const *re = regexes; *re; re++) {
        struct kr_grammar *g = regex(*re);
        pcre2_code *c = pcre(*re);
        for (int k = 0; k < 40; k++) {
            size_t n = generate(g, &rng, 1 + rnd(&rng) % 24, text, sizeof(text));
            cr_expect(pcre_matches(c, text, n), "regex %s generated \"%s\", which PCRE2 does not match", *re, text);
            cr_expect(matches_n(g, text, n));
        }
        pcre2_code_free(c);
        kr_grammar_free(g);
    }
}

Test(grammar, regex_accept_reject)
{
    struct {
        const char *re;
        const char *yes[6];
        const char *no[6];
    } cases[] = {
        {"[a-z]+@[a-z]+\\.(com|org)", {"ab@cd.com", "x@y.org"}, {"ab@cd.net", "@cd.com", "AB@cd.com", "ab@cd.com "}},
        {"\\d+(\\.\\d+)?", {"0", "12.5"}, {"1.", ".5", "1.2.3", "\xD9\xA3"}},
        {".*", {"", "abc", "\xE2\x82\xAC"}, {"a\nb", "\r"}},
        {"[^a]", {"b", "\xF0\x9F\x98\x80"}, {"a", "", "bb"}},
        {"\\s", {" ", "\t", "\n", "\v"}, {"\xC2\xA0", "x"}},
        {"(a|b){2}c", {"abc", "bbc"}, {"abbc", "ac", "c"}},
        {"\\x41\\u00e9\\t", {"A\xC3\xA9\t"}, {"A\xC3\xA9"}},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct kr_grammar *g = regex(cases[i].re);
        for (int k = 0; k < 6 && cases[i].yes[k]; k++) {
            cr_expect(matches(g, cases[i].yes[k]), "/%s/ should match \"%s\"", cases[i].re, cases[i].yes[k]);
        }
        for (int k = 0; k < 6 && cases[i].no[k]; k++) {
            cr_expect(!matches(g, cases[i].no[k]), "/%s/ should not match \"%s\"", cases[i].re, cases[i].no[k]);
        }
        kr_grammar_free(g);
    }
}

static void expect_regex_error(const char *re, const char *want)
{
    struct kr_grammar *g = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_grammar_from_regex(re, strlen(re), &g, &err);
    cr_expect_eq(st, KR_ERR_INVAL, "should fail: %s", re);
    cr_expect_null(g);
    cr_expect(strstr(err.msg, want) != NULL, "/%s/: message \"%s\" lacks \"%s\"", re, err.msg, want);
}

Test(grammar, regex_errors_name_the_construct)
{
    expect_regex_error("(a)\\1", "offset 3: backreferences are not supported");
    expect_regex_error("a(?=b)", "offset 1: lookaround assertions are not supported");
    expect_regex_error("a(?<!b)", "lookaround");
    expect_regex_error("a^b", "offset 1: '^' is only supported at the start");
    expect_regex_error("a$b", "offset 1: '$' is only supported at the end");
    expect_regex_error("\\bword", "word boundary");
    expect_regex_error("\\p{L}", "escape \\p is not supported");
    expect_regex_error("(?i)abc", "group flags");
    expect_regex_error("*a", "offset 0: nothing to repeat");
    expect_regex_error("(ab", "missing ')'");
    expect_regex_error("ab)", "offset 2: unmatched ')'");
    expect_regex_error("[abc", "unterminated character class");
    expect_regex_error("[z-a]", "range out of order");
    expect_regex_error("a{5,2}", "bounds out of order");
    expect_regex_error("a{100000}", "larger than");
    expect_regex_error("a*+", "possessive");
    expect_regex_error("[[:alpha:]]", "POSIX classes");
    expect_regex_error("\\x4", "bad hexadecimal escape");
}

Test(grammar, choice)
{
    const char *c[] = {"yes", "no", "maybe so", "\xC3\xA9t\xC3\xA9"};
    size_t l[] = {3, 2, 8, 5};
    struct kr_grammar *g = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_grammar_from_choice(c, l, 4, &g, &err), KR_OK, "%s", err.msg);
    const char *yes[] = {"yes", "no", "maybe so", "\xC3\xA9t\xC3\xA9", NULL};
    const char *no[] = {"", "ye", "yesno", "maybe", NULL};
    expect_all(g, yes, no, "choice");
    kr_grammar_free(g);
    cr_expect_eq(kr_grammar_from_choice(c, l, 0, &g, &err), KR_ERR_INVAL);
}

/* ---- JSON Schema --------------------------------------------------------------------------------- */

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
    snprintf(path, sizeof(path), "%s/node_modules/ajv-formats/package.json", node_dir());
    cr_assert_eq(access(path, R_OK), 0, "ajv is not installed: run `npm ci` in %s", node_dir());
}

/* Runs the validator over cases (an array of {schema, docs}); returns its verdicts (one array of
 * strings per case). */
static json_t *ajv(json_t *cases)
{
    char in[] = "/tmp/krait-grammar-XXXXXX";
    int fd = mkstemp(in);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_assert_eq(json_dump_file(cases, in, JSON_COMPACT), 0);
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), "node %s/validate.mjs %s", node_dir(), in);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    json_error_t je;
    json_t *out = json_loadf(p, 0, &je);
    int rc = pclose(p);
    unlink(in);
    cr_assert_not_null(out, "validator output: %s", je.text);
    cr_assert_eq(rc, 0);
    return out;
}

/* Schemas for the random-document test: nested objects, bounded arrays, enums, anyOf, recursion
 * through $ref, patterns, formats, number bounds. */
static const char *const schemas[] = {
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
    "\"email\":{\"type\":\"string\",\"format\":\"email\"}},\"required\":[\"name\",\"age\"],"
    "\"additionalProperties\":false}",

    "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"object\",\"properties\":{\"b\":{\"type\":\"array\","
    "\"items\":{\"type\":\"number\"},\"minItems\":1,\"maxItems\":3}},\"required\":[\"b\"]},\"c\":{\"type\":"
    "[\"boolean\",\"null\"]}},\"required\":[\"a\"]}",

    "{\"type\":\"array\",\"items\":{\"enum\":[\"red\",\"green\",1,null,{\"x\":[true]}]},\"minItems\":2}",

    "{\"anyOf\":[{\"type\":\"string\",\"maxLength\":5},{\"type\":\"integer\",\"minimum\":-20,\"maximum\":1234},"
    "{\"const\":\"fixed\\\"quote\"}]}",

    "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"value\":{\"type\":\"integer\"},\"children\":"
    "{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"},\"maxItems\":2}},\"required\":[\"value\"],"
    "\"additionalProperties\":false}},\"$ref\":\"#/$defs/node\"}",

    "{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"string\",\"format\":\"uuid\"},\"day\":{\"type\":"
    "\"string\",\"format\":\"date\"},\"at\":{\"type\":\"string\",\"format\":\"date-time\"},\"t\":{\"type\":"
    "\"string\",\"format\":\"time\"},\"ip\":{\"type\":\"string\",\"format\":\"ipv4\"}},\"required\":[\"id\",\"day\","
    "\"at\",\"t\",\"ip\"]}",

    "{\"type\":\"object\",\"properties\":{\"code\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{3}-\\\\d{2,4}$\"},"
    "\"free\":{\"type\":\"string\",\"pattern\":\"ab+c\"},\"q\":{\"type\":\"string\",\"pattern\":\"^\\\"[a\\\\\\\\]\"}},"
    "\"required\":[\"code\",\"free\",\"q\"]}",

    "{\"type\":\"object\",\"properties\":{\"i\":{\"type\":\"integer\",\"exclusiveMinimum\":-1000,\"exclusiveMaximum\":"
    "7},\"p\":{\"type\":\"integer\",\"minimum\":100},\"n\":{\"type\":\"integer\",\"maximum\":-55},\"x\":{\"type\":"
    "\"number\",\"minimum\":-2.5,\"maximum\":3},\"y\":{\"type\":\"number\",\"exclusiveMinimum\":0},\"z\":{\"type\":"
    "\"number\",\"exclusiveMaximum\":10,\"minimum\":-10}},\"required\":[\"i\",\"p\",\"n\",\"x\",\"y\",\"z\"]}",

    "{\"type\":\"object\",\"properties\":{\"known\":{\"type\":\"integer\"},\"k2\":{\"type\":\"boolean\"}},"
    "\"additionalProperties\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":3}}",

    "{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"},{\"type\":\"integer\"}],\"items\":false}",

    "{\"type\":\"object\",\"properties\":{\"opt1\":{\"type\":\"string\"},\"req\":{\"type\":\"null\"},\"opt2\":"
    "{\"oneOf\":[{\"type\":\"boolean\"},{\"type\":\"array\",\"maxItems\":0}]}},\"required\":[\"req\"]}",

    "{\"type\":\"object\"}",

    "{\"definitions\":{\"leaf\":{\"type\":\"string\",\"enum\":[\"a\",\"b\"]}},\"type\":\"object\",\"properties\":"
    "{\"l\":{\"allOf\":[{\"$ref\":\"#/definitions/leaf\"}],\"description\":\"ignored\"}},\"required\":[\"l\"],"
    "\"additionalProperties\":false}",

    "{\"type\":\"string\",\"minLength\":2,\"maxLength\":4}",
    NULL,
};

Test(grammar, schema_random_documents_are_valid_for_ajv)
{
    need_node();
    uint64_t rng = seed(0x2545F4914F6CDD1Dull);
    json_t *cases = json_array();
    char *text = kr_malloc(1 << 16);
    for (const char *const *s = schemas; *s; s++) {
        struct kr_grammar *g = schema(*s);
        json_error_t je;
        json_t *docs = json_array();
        for (int k = 0; k < 30; k++) {
            size_t n = generate(g, &rng, rnd(&rng) % 80, text, 1 << 16);
            if (getenv("KR_GRAMMAR_SHOW")) { /* to look at what the grammars produce */
                printf("schema %zu: %s\n", (size_t)(s - schemas), text);
            }
            json_array_append_new(docs, json_stringn(text, n));
        }
        json_t *sch = json_loads(*s, 0, &je);
        cr_assert_not_null(sch, "%s", je.text);
        json_array_append_new(cases, json_pack("{s:o, s:o}", "schema", sch, "docs", docs));
        kr_grammar_free(g);
    }
    json_t *out = ajv(cases);
    for (size_t i = 0; i < json_array_size(cases); i++) {
        json_t *docs = json_object_get(json_array_get(cases, i), "docs");
        for (size_t k = 0; k < json_array_size(docs); k++) {
            const char *verdict = json_string_value(json_array_get(json_array_get(out, i), k));
            cr_expect_str_eq(verdict, "ok", "schema %zu: document %s: %s", i,
                             json_string_value(json_array_get(docs, k)), verdict);
        }
    }
    kr_free(text);
    json_decref(out);
    json_decref(cases);
}

Test(grammar, schema_rejects_invalid_documents)
{
    struct {
        int schema;
        const char *doc;
    } bad[] = {
        {0, "{\"name\":\"x\"}"},                               /* required age missing */
        {0, "{\"name\":\"x\",\"age\":1.5}"},                   /* not an integer */
        {0, "{\"name\":\"x\",\"age\":1,\"extra\":1}"},         /* no additional properties */
        {0, "{\"name\":\"x\",\"age\":1,\"email\":\"nope\"}"},  /* not an email */
        {1, "{\"a\":{\"b\":[]}}"},                             /* minItems 1 */
        {1, "{\"a\":{\"b\":[1,2,3,4]}}"},                      /* maxItems 3 */
        {2, "[\"red\"]"},                                      /* minItems 2 */
        {2, "[\"red\",\"blue\"]"},                             /* not in enum */
        {3, "\"toolong\""},                                    /* maxLength 5 */
        {3, "-21"},                                            /* minimum -20 */
        {3, "1235"},                                           /* maximum 1234 */
        {4, "{\"value\":1,\"children\":[{\"value\":2},{\"value\":3},{\"value\":4}]}"},
        {4, "{\"value\":1,\"children\":[{}]}"},
        {5, "{\"id\":\"x\",\"day\":\"2024-01-01\",\"at\":\"2024-01-01T00:00:00Z\",\"t\":\"00:00:00Z\",\"ip\":\"1.2.3.4\"}"},
        {5, "{\"id\":\"123e4567-e89b-12d3-a456-426614174000\",\"day\":\"2024-02-30\",\"at\":\"2024-01-01T00:00:00Z\","
            "\"t\":\"00:00:00Z\",\"ip\":\"1.2.3.4\"}"},
        {5, "{\"id\":\"123e4567-e89b-12d3-a456-426614174000\",\"day\":\"2024-01-01\",\"at\":\"2024-01-01T00:00:00Z\","
            "\"t\":\"00:00:00Z\",\"ip\":\"256.2.3.4\"}"},
        {6, "{\"code\":\"AB-12\",\"free\":\"abc\",\"q\":\"\\\"a\"}"},
        {6, "{\"code\":\"ABC-12\",\"free\":\"ac\",\"q\":\"\\\"a\"}"},
        {7, "{\"i\":7,\"p\":100,\"n\":-55,\"x\":0,\"y\":1,\"z\":0}"},
        {7, "{\"i\":0,\"p\":99,\"n\":-55,\"x\":0,\"y\":1,\"z\":0}"},
        {7, "{\"i\":0,\"p\":100,\"n\":-54,\"x\":0,\"y\":1,\"z\":0}"},
        {7, "{\"i\":0,\"p\":100,\"n\":-55,\"x\":3.5,\"y\":1,\"z\":0}"},
        {7, "{\"i\":0,\"p\":100,\"n\":-55,\"x\":0,\"y\":0,\"z\":0}"},
        {7, "{\"i\":0,\"p\":100,\"n\":-55,\"x\":0,\"y\":1,\"z\":10}"},
        {8, "{\"known\":1,\"known\":2}"},                     /* a declared key as an additional one */
        {8, "{\"other\":\"toolong\"}"},
        {9, "[\"a\",1,2]"},                                    /* closed tuple */
        {9, "[1,\"a\"]"},
        {10, "{\"opt1\":\"x\"}"},
        {10, "{\"req\":null,\"opt1\":\"x\"}"},                 /* properties in the schema's order */
        {12, "{\"l\":\"c\"}"},
        {13, "\"a\""},
        {13, "\"abcde\""},
    };
    const char *good[][2] = {
        {"0", "{\"name\":\"x\",\"age\":-3}"},
        {"0", "{ \"name\" : \"x\" ,\n  \"age\": 0, \"email\": \"a.b@c.de\" }"},
        {"3", "\"fixed\\\"quote\""},
        {"4", "{\"value\":1,\"children\":[{\"value\":2,\"children\":[]}]}"},
        {"7", "{\"i\":-999,\"p\":100,\"n\":-55,\"x\":-2,\"y\":0.001,\"z\":9.99}"},
        {"8", "{\"known\":1,\"k2\":true,\"k3\":\"abc\",\"knowns\":\"x\"}"},
        {"8", "{\"kn\":\"x\",\"k\":\"y\"}"},
        {"10", "{\"req\":null,\"opt2\":[]}"},
        {"11", "{\"any\":[1,{\"x\":null}]}"},
        {"13", "\"\\u00e9\\n\""},
    };
    struct kr_grammar *g[16] = {0};
    for (size_t i = 0; schemas[i]; i++) {
        g[i] = schema(schemas[i]);
    }
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_expect(!matches(g[bad[i].schema], bad[i].doc), "schema %d should reject %s", bad[i].schema, bad[i].doc);
    }
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        cr_expect(matches(g[atoi(good[i][0])], good[i][1]), "schema %s should accept %s", good[i][0], good[i][1]);
    }
    for (size_t i = 0; schemas[i]; i++) {
        kr_grammar_free(g[i]);
    }
}

static void expect_schema_error(const char *json, const char *want)
{
    struct kr_grammar *g = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_grammar_from_json_schema(json, strlen(json), NULL, &g, &err);
    cr_expect_eq(st, KR_ERR_INVAL, "should fail: %s", json);
    cr_expect_null(g);
    cr_expect(strstr(err.msg, want) != NULL, "%s: message \"%s\" lacks \"%s\"", json, err.msg, want);
}

Test(grammar, schema_errors_name_keyword_and_pointer)
{
    expect_schema_error("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"multipleOf\":3}}}",
                        "at /properties/a/multipleOf: keyword 'multipleOf' is not supported");
    expect_schema_error("{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"uniqueItems\":true}",
                        "at /uniqueItems: uniqueItems is not supported");
    expect_schema_error("{\"type\":\"object\",\"patternProperties\":{}}", "at /patternProperties");
    expect_schema_error("{\"type\":\"strin\"}", "at /type: unknown type 'strin'");
    expect_schema_error("{\"$ref\":\"#/$defs/missing\"}", "at /$ref: '#/$defs/missing' points to nothing");
    expect_schema_error("{\"$ref\":\"http://x/y.json\"}", "only references within the schema");
    expect_schema_error("{\"allOf\":[{\"type\":\"string\"},{\"minLength\":2}]}", "allOf of 2 schemas");
    expect_schema_error("{\"$defs\":{\"a\":{\"type\":\"string\",\"format\":\"hostname\"}},\"$ref\":\"#/$defs/a\"}",
                        "at /$defs/a/format: format 'hostname' is not supported");
    expect_schema_error("{\"type\":\"string\",\"pattern\":\"(a\"}", "at /pattern: regex: offset 0: missing ')'");
    expect_schema_error("{\"type\":\"string\",\"pattern\":\"a+\",\"maxLength\":3}", "combining pattern");
    expect_schema_error("{\"type\":\"object\",\"properties\":{},\"required\":[\"x\"],\"additionalProperties\":false}",
                        "required property 'x'");
    expect_schema_error("{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}", "no integer lies within");
    expect_schema_error("{\"type\":\"number\",\"minimum\":0.2,\"maximum\":0.8}", "integer-aligned");
    expect_schema_error("{\"type\":\"array\",\"minItems\":3,\"maxItems\":2}", "at /minItems");
    expect_schema_error("{\"type\":\"string\",\"minLength\":-1}", "at /minLength: must be a non-negative integer");
    expect_schema_error("{\"enum\":[1,2],\"minimum\":1}", "at /minimum: 'minimum' next to 'enum'");
    expect_schema_error("{\"$ref\":\"#\"}", "left-recursive");
    expect_schema_error("{\"type\":\"object\",\"properties\":{\"a\":false},\"required\":[\"a\"]}",
                        "at /properties/a: the schema 'false' matches nothing");
    expect_schema_error("{\"type\": ", "json schema: line 1");
    expect_schema_error("[1]", "a schema must be an object or a boolean");
}

Test(grammar, schema_whitespace_is_bounded)
{
    struct kr_grammar_json_opts compact = {.max_ws = 0}, two = {.max_ws = 2};
    const char *s = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"]}";
    struct kr_grammar *g = NULL, *g2 = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_grammar_from_json_schema(s, strlen(s), &compact, &g, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(kr_grammar_from_json_schema(s, strlen(s), &two, &g2, &err), KR_OK, "%s", err.msg);
    cr_expect(matches(g, "{\"a\":1}"));
    cr_expect(!matches(g, "{ \"a\":1}"));
    cr_expect(matches(g2, "{ \"a\" :\n 1\n}"));
    cr_expect(!matches(g2, "{   \"a\":1}"));
    kr_grammar_free(g);
    kr_grammar_free(g2);
}

Test(grammar, json_object_mode)
{
    struct kr_grammar *g = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_grammar_from_json_object(NULL, &g, &err), KR_OK, "%s", err.msg);
    const char *yes[] = {"{}", "{\"a\":[1,{\"b\":\"c\"}],\"a\":null}", "{ \"x\" : -1.5e-3 }", NULL};
    const char *no[] = {"[]", "1", "{\"a\"}", "{\"a\":1,}", "{\"a\":01}", NULL};
    expect_all(g, yes, no, "json_object");
    kr_grammar_free(g);
}

Test(grammar, compiled_grammar_cache)
{
    struct kr_grammar_cache *c = NULL;
    cr_assert_eq(kr_grammar_cache_create(2, &c), KR_OK);
    struct kr_err err = {0};
    struct kr_grammar *a, *a2, *b, *d;
    bool hit;
    const char *s1 = "{\"type\":\"integer\"}", *s2 = "[0-9]+x";
    cr_assert_eq(kr_grammar_cache_get(c, KR_GRAMMAR_JSON_SCHEMA, s1, strlen(s1), NULL, &a, &hit, &err), KR_OK);
    cr_expect(!hit);
    cr_assert_eq(kr_grammar_cache_get(c, KR_GRAMMAR_JSON_SCHEMA, s1, strlen(s1), NULL, &a2, &hit, &err), KR_OK);
    cr_expect(hit && a2 == a);
    struct kr_grammar_json_opts o = {.max_ws = 0};
    cr_assert_eq(kr_grammar_cache_get(c, KR_GRAMMAR_JSON_SCHEMA, s1, strlen(s1), &o, &b, &hit, &err), KR_OK);
    cr_expect(!hit && b != a, "other options, other grammar");
    cr_assert_eq(kr_grammar_cache_get(c, KR_GRAMMAR_REGEX, s2, strlen(s2), NULL, &d, &hit, &err), KR_OK);
    cr_expect(!hit);
    cr_expect(matches(d, "12x"));
    /* the first schema was evicted (least recently used) but lives on in the caller's hands */
    cr_expect(matches(a, "-5"));
    kr_grammar_free(a);
    kr_grammar_free(a2);
    kr_grammar_free(b);
    kr_grammar_free(d);
    cr_expect_eq(kr_grammar_cache_get(c, KR_GRAMMAR_REGEX, "(", 1, NULL, &d, &hit, &err), KR_ERR_INVAL);
    const char *choices = "[\"yes\",\"no\"]";
    cr_assert_eq(kr_grammar_cache_get(c, KR_GRAMMAR_CHOICE, choices, strlen(choices), NULL, &d, &hit, &err), KR_OK);
    cr_expect(matches(d, "no") && !matches(d, "maybe"));
    kr_grammar_free(d);
    cr_expect_eq(kr_grammar_compile(KR_GRAMMAR_CHOICE, "[1]", 3, NULL, &d, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "item 0 is not a string") != NULL, "%s", err.msg);
    kr_grammar_cache_destroy(c);
}

/* ---- the matcher ---------------------------------------------------------------------------------- */

Test(grammar, rollback_clone_and_min_remaining)
{
    struct kr_grammar *g = gbnf(arith_gbnf);
    struct kr_grammar_matcher *m = matcher(g);
    struct kr_err err = {0};
    bool ok;
    cr_expect_eq(kr_grammar_matcher_min_remaining(m), 1);
    cr_assert_eq(kr_grammar_matcher_accept_bytes(m, "(1", 2, &ok, &err), KR_OK);
    cr_assert(ok);
    cr_expect_eq(kr_grammar_matcher_min_remaining(m), 1); /* ")" */
    cr_assert_eq(kr_grammar_matcher_accept_bytes(m, " + (", 4, &ok, &err), KR_OK);
    cr_expect_eq(kr_grammar_matcher_min_remaining(m), 3); /* "1))" */
    struct kr_grammar_matcher *c = NULL;
    cr_assert_eq(kr_grammar_matcher_clone(m, &c, &err), KR_OK);
    cr_assert_eq(kr_grammar_matcher_accept_bytes(m, "x", 1, &ok, &err), KR_OK);
    cr_expect(!ok, "x is not allowed");
    cr_assert_eq(kr_grammar_matcher_accept_bytes(m, "2))", 3, &ok, &err), KR_OK);
    cr_expect(ok && kr_grammar_matcher_can_end(m));
    cr_expect_eq(kr_grammar_matcher_rollback(m, 2), KR_OK);
    cr_expect_eq(kr_grammar_matcher_min_remaining(m), 1);
    cr_expect_eq(kr_grammar_matcher_rollback(m, 2), KR_ERR_INVAL);
    cr_expect_eq(kr_grammar_matcher_rollback(m, 1), KR_OK);
    cr_expect_eq(kr_grammar_matcher_min_remaining(m), 1); /* back at "" */
    cr_expect(!kr_grammar_matcher_can_end(m));
    /* the clone went on from "(1 + (" */
    cr_assert_eq(kr_grammar_matcher_accept_bytes(c, "3))", 3, &ok, &err), KR_OK);
    cr_expect(ok && kr_grammar_matcher_can_end(c));
    cr_assert_eq(kr_grammar_matcher_reset(c, &err), KR_OK);
    cr_expect(!kr_grammar_matcher_can_end(c));
    kr_grammar_matcher_destroy(c);
    kr_grammar_matcher_destroy(m);
    kr_grammar_free(g);
}

Test(grammar, long_texts_keep_memory_flat)
{
    /* a long run through a recursive grammar: unreachable stack frames are collected */
    struct kr_grammar *g = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_grammar_from_json_object(NULL, &g, &err), KR_OK);
    struct kr_grammar_matcher *m = matcher(g);
    bool ok;
    cr_assert_eq(kr_grammar_matcher_accept_bytes(m, "{\"a\":[", 6, &ok, &err), KR_OK);
    size_t peak = 0;
    for (int i = 0; i < 100000; i++) {
        const char *item = i ? ",{\"k\":[1,2,\"x\"]}" : "{\"k\":[1,2,\"x\"]}";
        cr_assert_eq(kr_grammar_matcher_accept_bytes(m, item, strlen(item), &ok, &err), KR_OK, "%s", err.msg);
        cr_assert(ok);
        size_t now = kr_alloc_bytes_in_use();
        peak = now > peak ? now : peak;
        if (i == 1000) {
            cr_expect_lt(peak, g_base + (64u << 20));
        }
    }
    cr_expect_lt(peak, g_base + (64u << 20), "peak %zu bytes", peak - g_base);
    cr_assert_eq(kr_grammar_matcher_accept_bytes(m, "]}", 2, &ok, &err), KR_OK);
    cr_expect(ok && kr_grammar_matcher_is_done(m));
    kr_grammar_matcher_destroy(m);
    kr_grammar_free(g);
}

Test(grammar, pathological_grammars_fail_cleanly)
{
    /* each "a" doubles the stacks (the continuation differs: "b" or "c" later) */
    struct kr_grammar *g = gbnf("root ::= x\nx ::= \"a\" x \"b\" | \"a\" x \"c\" | \"\"\n");
    struct kr_grammar_matcher *m = matcher(g);
    struct kr_err err = {0};
    bool ok = true;
    enum kr_status st = KR_OK;
    for (int i = 0; i < 64 && st == KR_OK; i++) {
        st = kr_grammar_matcher_accept_bytes(m, "a", 1, &ok, &err);
    }
    cr_expect_eq(st, KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "parse stacks") != NULL, "%s", err.msg);
    kr_grammar_matcher_destroy(m);
    kr_grammar_free(g);
    /* nesting beyond the depth limit */
    g = gbnf("root ::= \"(\" root \")\" | \"x\"\n");
    m = matcher(g);
    st = KR_OK;
    for (int i = 0; i < 5000 && st == KR_OK; i++) {
        st = kr_grammar_matcher_accept_bytes(m, "(", 1, &ok, &err);
    }
    cr_expect_eq(st, KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "nested deeper") != NULL, "%s", err.msg);
    kr_grammar_matcher_destroy(m);
    kr_grammar_free(g);
    /* the grammar size limit: repetitions expand to rules of the repeated text */
    const char *big = "root ::= x1 x2 x3 x4\n"
                      "x1 ::= \"1234567890123456789012345678901234567890123456789012345678901\"{0,10000}\n"
                      "x2 ::= \"2234567890123456789012345678901234567890123456789012345678901\"{0,10000}\n"
                      "x3 ::= \"3234567890123456789012345678901234567890123456789012345678901\"{0,10000}\n"
                      "x4 ::= \"4234567890123456789012345678901234567890123456789012345678901\"{0,10000}\n";
    struct kr_grammar *g2 = NULL;
    cr_expect_eq(kr_grammar_from_gbnf(big, strlen(big), NULL, &g2, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "too large") != NULL, "%s", err.msg);
}

/* ---- token masks ------------------------------------------------------------------------------------ */

static struct kr_grammar_vocab *load_vocab(const char *dir, struct kr_tokenizer **tok_out)
{
    struct kr_tokenizer *tok = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_tokenizer_load(dir, NULL, &tok, &err), KR_OK, "%s", err.msg);
    int32_t eos = kr_tokenizer_eos_id(tok);
    struct kr_grammar_vocab *v = NULL;
    cr_assert_eq(kr_grammar_vocab_create(tok, &eos, eos >= 0, &v, &err), KR_OK, "%s", err.msg);
    *tok_out = tok;
    return v;
}

/* The mask by brute force: every token's bytes tried on the matcher (then rolled back). */
static void brute_mask(struct kr_grammar_matcher *m, const struct kr_grammar_vocab *v, uint32_t *mask)
{
    int32_t n = kr_grammar_vocab_n_vocab(v);
    memset(mask, 0, (size_t)kr_grammar_vocab_mask_words(v) * 4);
    struct kr_err err = {0};
    for (int32_t id = 0; id < n; id++) {
        bool ok;
        cr_assert_eq(kr_grammar_matcher_accept_token(m, v, id, &ok, &err), KR_OK, "%s", err.msg);
        if (ok) {
            mask[id / 32] |= 1u << (id % 32);
            cr_assert_eq(kr_grammar_matcher_rollback(m, 1), KR_OK);
        }
    }
}

static void expect_same_mask(const uint32_t *mask, const uint32_t *want, const struct kr_grammar_vocab *v,
                             const char *what, const char *how, int step)
{
    int32_t words = kr_grammar_vocab_mask_words(v);
    for (int32_t w = 0; w < words; w++) {
        if (mask[w] == want[w]) {
            continue;
        }
        for (int b = 0; b < 32; b++) {
            if (((mask[w] ^ want[w]) >> b) & 1) {
                size_t len;
                const char *s = kr_grammar_vocab_token_bytes(v, w * 32 + b, &len);
                cr_expect_fail("%s, step %d, %s: token %d (\"%.*s\") is %s in the mask but %s by brute force", what,
                               step, how, w * 32 + b, (int)len, s ? s : "", ((mask[w] >> b) & 1) ? "set" : "clear",
                               ((want[w] >> b) & 1) ? "allowed" : "refused");
            }
        }
        cr_assert_fail("%s: masks differ at step %d (%s)", what, step, how);
    }
}

/* Walks random tokens allowed by the mask and compares each mask, with and without the adaptive
 * cache, with the brute-force one. */
static void check_masks(const struct kr_grammar *g, const struct kr_grammar_vocab *v, int steps, uint64_t seed,
                        const char *what)
{
    struct kr_grammar_matcher *m = matcher(g);
    int32_t words = kr_grammar_vocab_mask_words(v);
    uint32_t *mask = kr_malloc((size_t)words * 4), *plain = kr_malloc((size_t)words * 4);
    uint32_t *want = kr_malloc((size_t)words * 4);
    struct kr_err err = {0};
    uint64_t rng = seed;
    for (int step = 0; step < steps && !kr_grammar_matcher_is_done(m); step++) {
        kr_grammar_matcher_use_cache(m, true);
        cr_assert_eq(kr_grammar_matcher_fill_mask(m, v, mask, &err), KR_OK, "%s", err.msg);
        kr_grammar_matcher_use_cache(m, false);
        cr_assert_eq(kr_grammar_matcher_fill_mask(m, v, plain, &err), KR_OK, "%s", err.msg);
        brute_mask(m, v, want);
        expect_same_mask(mask, want, v, what, "cached", step);
        expect_same_mask(plain, want, v, what, "trie walk", step);
        int32_t allowed[4096], n_allowed = 0, n_total = 0;
        for (int32_t w = 0; w < words; w++) {
            for (int b = 0; b < 32; b++) {
                if ((mask[w] >> b) & 1) {
                    n_total++;
                    if (n_allowed < 4096) {
                        allowed[n_allowed++] = w * 32 + b;
                    }
                }
            }
        }
        cr_assert_gt(n_total, 0, "%s: nothing allowed at step %d", what, step);
        /* prefer tokens with bytes (not the end token), so that the walk reaches deep states */
        int32_t id = allowed[rnd(&rng) % (uint64_t)n_allowed];
        for (int tries = 0; tries < 8 && n_allowed > 1; tries++) {
            size_t len;
            kr_grammar_vocab_token_bytes(v, id, &len);
            if (len > 0) {
                break;
            }
            id = allowed[rnd(&rng) % (uint64_t)n_allowed];
        }
        bool ok;
        cr_assert_eq(kr_grammar_matcher_accept_token(m, v, id, &ok, &err), KR_OK, "%s", err.msg);
        cr_assert(ok, "%s: token %d from the mask was refused", what, id);
    }
    kr_free(mask);
    kr_free(plain);
    kr_free(want);
    kr_grammar_matcher_destroy(m);
}

static void masks_for_tokenizer(const char *dir, int steps)
{
    struct kr_tokenizer *tok;
    struct kr_grammar_vocab *v = load_vocab(dir, &tok);
    struct kr_grammar *g[6];
    g[0] = schema(schemas[0]);
    g[1] = schema(schemas[4]);
    g[2] = schema(schemas[8]);
    g[3] = regex("(\\d{3}-){2}\\d{4}|[a-z ]+\\.");
    g[4] = gbnf(arith_gbnf);
    struct kr_err err = {0};
    cr_assert_eq(kr_grammar_from_json_object(NULL, &g[5], &err), KR_OK);
    for (int i = 0; i < 6; i++) {
        /* two walks: the second meets cache entries that the first made in other contexts */
        for (int walk = 0; walk < 2; walk++) {
            char what[256];
            snprintf(what, sizeof(what), "%s, grammar %d, walk %d", dir, i, walk);
            check_masks(g[i], v, steps, seed(0x1234567u) + (uint64_t)(i * 2 + walk), what);
        }
        kr_grammar_free(g[i]);
    }
    kr_grammar_vocab_destroy(v);
    kr_tokenizer_free(tok);
}

Test(grammar, masks_match_brute_force_deepseek_v3)
{
    masks_for_tokenizer(FIX "/deepseek_v3", 12);
}

Test(grammar, masks_match_brute_force_llama3)
{
    masks_for_tokenizer(FIX "/llama3", 12);
}

Test(grammar, masks_match_brute_force_llama2)
{
    masks_for_tokenizer(FIX "/llama2", 12);
}

/* Random documents of every schema, tokenized as a model would write them: at each token the
 * cached mask equals the trie walk's (itself checked against brute force above) and allows it. */
Test(grammar, cached_masks_follow_tokenized_documents)
{
    struct kr_tokenizer *tok;
    struct kr_grammar_vocab *v = load_vocab(FIX "/deepseek_v3", &tok);
    int32_t words = kr_grammar_vocab_mask_words(v);
    uint32_t *mask = kr_malloc((size_t)words * 4), *plain = kr_malloc((size_t)words * 4);
    char *text = kr_malloc(1 << 16);
    uint64_t rng = seed(77);
    struct kr_err err = {0};
    for (int i = 0; schemas[i]; i++) {
        struct kr_grammar *g = schema(schemas[i]);
        for (int d = 0; d < 4; d++) {
            size_t n = generate(g, &rng, 20 + rnd(&rng) % 60, text, 1 << 16);
            int32_t *ids;
            int64_t n_ids;
            cr_assert_eq(kr_tokenizer_encode(tok, text, n, false, &ids, &n_ids, &err), KR_OK, "%s", err.msg);
            struct kr_grammar_matcher *m = matcher(g);
            for (int64_t k = 0; k <= n_ids; k++) {
                kr_grammar_matcher_use_cache(m, true);
                cr_assert_eq(kr_grammar_matcher_fill_mask(m, v, mask, &err), KR_OK, "%s", err.msg);
                kr_grammar_matcher_use_cache(m, false);
                cr_assert_eq(kr_grammar_matcher_fill_mask(m, v, plain, &err), KR_OK, "%s", err.msg);
                char what[128];
                snprintf(what, sizeof(what), "schema %d, document \"%.40s\"", i, text);
                expect_same_mask(mask, plain, v, what, "cached vs trie walk", (int)k);
                int32_t id = k < n_ids ? ids[k] : kr_tokenizer_eos_id(tok);
                cr_assert((mask[id / 32] >> (id % 32)) & 1, "%s: token %lld (id %d) not in the mask", what,
                          (long long)k, id);
                bool ok;
                cr_assert_eq(kr_grammar_matcher_accept_token(m, v, id, &ok, &err), KR_OK, "%s", err.msg);
                cr_assert(ok);
            }
            cr_expect(kr_grammar_matcher_is_done(m));
            kr_grammar_matcher_destroy(m);
            kr_free(ids);
        }
        kr_grammar_free(g);
    }
    kr_free(text);
    kr_free(mask);
    kr_free(plain);
    kr_grammar_vocab_destroy(v);
    kr_tokenizer_free(tok);
}

/* Threads filling the same fresh grammar's cache at once (each with its own matcher) get the
 * masks a cache-less pass computes. */
struct mask_job {
    const struct kr_grammar *g;
    const struct kr_grammar_vocab *v;
    const int32_t *ids;
    int64_t n_ids;
    const uint32_t *want; /* [n_ids][words] */
    int bad;
};

static void *mask_thread(void *arg)
{
    struct mask_job *j = arg;
    int32_t words = kr_grammar_vocab_mask_words(j->v);
    uint32_t *mask = kr_malloc((size_t)words * 4);
    struct kr_grammar_matcher *m = NULL;
    struct kr_err err = {0};
    if (!mask || kr_grammar_matcher_create(j->g, &m, &err) != KR_OK) {
        j->bad = -1;
    }
    for (int64_t k = 0; k < j->n_ids && j->bad == 0; k++) {
        bool ok;
        if (kr_grammar_matcher_fill_mask(m, j->v, mask, &err) != KR_OK ||
            memcmp(mask, j->want + k * words, (size_t)words * 4) != 0 ||
            kr_grammar_matcher_accept_token(m, j->v, j->ids[k], &ok, &err) != KR_OK || !ok) {
            j->bad = (int)k + 1;
        }
    }
    kr_grammar_matcher_destroy(m);
    kr_free(mask);
    return NULL;
}

Test(grammar, threads_share_a_grammar_cache)
{
    struct kr_tokenizer *tok;
    struct kr_grammar_vocab *v = load_vocab(FIX "/deepseek_v3", &tok);
    const char *doc = "{\"name\": \"Ada\", \"age\": 36, \"email\": \"ada@example.org\"}";
    int32_t *ids;
    int64_t n_ids;
    struct kr_err err = {0};
    cr_assert_eq(kr_tokenizer_encode(tok, doc, strlen(doc), false, &ids, &n_ids, &err), KR_OK);
    int32_t words = kr_grammar_vocab_mask_words(v);
    uint32_t *want = kr_malloc((size_t)n_ids * (size_t)words * 4);
    struct kr_grammar *ref = schema(schemas[0]), *g = schema(schemas[0]);
    struct kr_grammar_matcher *m = matcher(ref);
    kr_grammar_matcher_use_cache(m, false);
    for (int64_t k = 0; k < n_ids; k++) {
        bool ok;
        cr_assert_eq(kr_grammar_matcher_fill_mask(m, v, want + k * words, &err), KR_OK);
        cr_assert_eq(kr_grammar_matcher_accept_token(m, v, ids[k], &ok, &err), KR_OK);
        cr_assert(ok);
    }
    kr_grammar_matcher_destroy(m);
    enum { N = 4 };
    pthread_t th[N];
    struct mask_job jobs[N];
    for (int i = 0; i < N; i++) {
        jobs[i] = (struct mask_job){g, v, ids, n_ids, want, 0};
        cr_assert_eq(pthread_create(&th[i], NULL, mask_thread, &jobs[i]), 0);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(jobs[i].bad, 0, "thread %d: mask %d differs", i, jobs[i].bad - 1);
    }
    kr_grammar_free(g);
    kr_grammar_free(ref);
    kr_free(want);
    kr_free(ids);
    kr_grammar_vocab_destroy(v);
    kr_tokenizer_free(tok);
}

Test(grammar, token_bytes)
{
    struct kr_tokenizer *tok;
    struct kr_err err = {0};
    cr_assert_eq(kr_tokenizer_load(FIX "/llama2", NULL, &tok, &err), KR_OK, "%s", err.msg);
    struct {
        const char *piece, *bytes;
    } sp[] = {{"\xE2\x96\x81the", " the"}, {"<0x0A>", "\n"}, {"<0xE2>", "\xE2"}, {"ing", "ing"}};
    for (size_t i = 0; i < sizeof(sp) / sizeof(sp[0]); i++) {
        int32_t id = kr_tokenizer_piece_to_id(tok, sp[i].piece, strlen(sp[i].piece));
        cr_assert_geq(id, 0, "%s", sp[i].piece);
        char *b;
        size_t len;
        cr_assert_eq(kr_tokenizer_token_bytes(tok, id, &b, &len, &err), KR_OK);
        cr_expect(len == strlen(sp[i].bytes) && memcmp(b, sp[i].bytes, len) == 0, "%s", sp[i].piece);
        kr_free(b);
    }
    char *b;
    size_t len;
    cr_assert_eq(kr_tokenizer_token_bytes(tok, kr_tokenizer_eos_id(tok), &b, &len, &err), KR_OK);
    cr_expect(b == NULL && len == 0, "special tokens have no bytes");
    kr_tokenizer_free(tok);
    cr_assert_eq(kr_tokenizer_load(FIX "/deepseek_v3", NULL, &tok, &err), KR_OK, "%s", err.msg);
    struct {
        const char *piece, *bytes;
    } bl[] = {{"\xC4\xA0the", " the"}, {"\xC4\x8A", "\n"}, {"\xC3\xA2\xC4\xA2", "\xE2\x80"}};
    for (size_t i = 0; i < sizeof(bl) / sizeof(bl[0]); i++) {
        int32_t id = kr_tokenizer_piece_to_id(tok, bl[i].piece, strlen(bl[i].piece));
        cr_assert_geq(id, 0, "piece %zu", i);
        cr_assert_eq(kr_tokenizer_token_bytes(tok, id, &b, &len, &err), KR_OK);
        cr_expect(len == strlen(bl[i].bytes) && memcmp(b, bl[i].bytes, len) == 0, "piece %zu", i);
        kr_free(b);
    }
    kr_tokenizer_free(tok);
}

/* SentencePiece decoders drop the first space of a text: "\xE2\x96\x81{" first reads "{" to the
 * client, so the grammar sees "{"; a byte-level tokenizer keeps it. */
static void first_space(const char *dir, bool stripped)
{
    struct kr_tokenizer *tok;
    struct kr_grammar_vocab *v = load_vocab(dir, &tok);
    const char *sp = stripped ? "\xE2\x96\x81{" : "\xC4\xA0{";
    int32_t space_brace = kr_tokenizer_piece_to_id(tok, sp, strlen(sp)), brace = kr_tokenizer_piece_to_id(tok, "{", 1);
    cr_assert(space_brace >= 0 && brace >= 0);
    struct kr_grammar *g = regex("\\{ ?[a-z]+\\}");
    struct kr_grammar_matcher *m = matcher(g);
    uint32_t *mask = kr_malloc((size_t)kr_grammar_vocab_mask_words(v) * 4);
    struct kr_err err = {0};
    cr_assert_eq(kr_grammar_matcher_fill_mask(m, v, mask, &err), KR_OK);
    cr_expect((mask[brace / 32] >> (brace % 32)) & 1);
    cr_expect_eq((mask[space_brace / 32] >> (space_brace % 32)) & 1, stripped, "%s", dir);
    bool ok;
    cr_assert_eq(kr_grammar_matcher_accept_token(m, v, space_brace, &ok, &err), KR_OK);
    cr_expect_eq(ok, stripped);
    if (ok) { /* after "{", a space is a space again */
        int32_t space_a = kr_tokenizer_piece_to_id(tok, "\xE2\x96\x81" "a", 4);
        cr_assert_geq(space_a, 0);
        cr_assert_eq(kr_grammar_matcher_fill_mask(m, v, mask, &err), KR_OK);
        cr_expect((mask[space_a / 32] >> (space_a % 32)) & 1);
        cr_assert_eq(kr_grammar_matcher_accept_token(m, v, space_a, &ok, &err), KR_OK);
        cr_expect(ok);
        cr_assert_eq(kr_grammar_matcher_accept_bytes(m, "}", 1, &ok, &err), KR_OK);
        cr_expect(ok && kr_grammar_matcher_can_end(m), "the text is \"{ a}\"");
    }
    kr_free(mask);
    kr_grammar_matcher_destroy(m);
    kr_grammar_free(g);
    kr_grammar_vocab_destroy(v);
    kr_tokenizer_free(tok);
}

Test(grammar, first_token_space_follows_the_decoder)
{
    first_space(FIX "/llama2", true);
    first_space(FIX "/deepseek_v3", false);
}

Test(grammar, raw_vocab_masks_and_end_tokens)
{
    const char *toks[] = {"{", "}", "\"", "a", "\"a\"", ":", "1", "", "{\"a\":", "</s>"};
    size_t lens[10];
    for (int i = 0; i < 10; i++) {
        lens[i] = strlen(toks[i]);
    }
    lens[9] = 0; /* an end token without bytes */
    int32_t end = 9;
    struct kr_grammar_vocab *v = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_grammar_vocab_create_raw(10, toks, lens, &end, 1, &v, &err), KR_OK, "%s", err.msg);
    struct kr_grammar *g = schema("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
                                  "\"required\":[\"a\"]}");
    struct kr_grammar_matcher *m = matcher(g);
    uint32_t mask[1];
    cr_assert_eq(kr_grammar_matcher_fill_mask(m, v, mask, &err), KR_OK);
    cr_expect_eq(mask[0], (1u << 0) | (1u << 8), "mask %x", mask[0]);
    bool ok;
    cr_assert_eq(kr_grammar_matcher_accept_token(m, v, 8, &ok, &err), KR_OK);
    cr_assert(ok);
    cr_assert_eq(kr_grammar_matcher_fill_mask(m, v, mask, &err), KR_OK);
    cr_expect_eq(mask[0], 1u << 6, "mask %x", mask[0]);
    cr_assert_eq(kr_grammar_matcher_accept_token(m, v, 6, &ok, &err), KR_OK);
    cr_assert_eq(kr_grammar_matcher_accept_token(m, v, 1, &ok, &err), KR_OK);
    cr_assert_eq(kr_grammar_matcher_fill_mask(m, v, mask, &err), KR_OK);
    cr_expect_eq(mask[0], 1u << 9, "only the end token: %x", mask[0]);
    cr_assert_eq(kr_grammar_matcher_accept_token(m, v, 9, &ok, &err), KR_OK);
    cr_expect(ok && kr_grammar_matcher_is_done(m));
    cr_assert_eq(kr_grammar_matcher_fill_mask(m, v, mask, &err), KR_OK);
    cr_expect_eq(mask[0], 0);
    cr_expect_eq(kr_grammar_matcher_rollback(m, 1), KR_OK);
    cr_expect(!kr_grammar_matcher_is_done(m) || kr_grammar_matcher_can_end(m));
    cr_expect_eq(kr_grammar_matcher_accept_token(m, v, 10, &ok, &err), KR_ERR_INVAL);
    kr_grammar_matcher_destroy(m);
    kr_grammar_free(g);
    kr_grammar_vocab_destroy(v);
}

/* ---- allocation failures ----------------------------------------------------------------------------- */

/* Runs fn with allocation n failing, n = 1, 2, ... until it succeeds: every failure must be
 * KR_ERR_NOMEM and leave nothing allocated. */
#define FAULT_LOOP(what, call, on_ok)                                                                   \
    for (uint64_t n = 1;; n++) {                                                                        \
        struct kr_err err = {0};                                                                        \
        kr_alloc_fail_at(n, 0);                                                                         \
        enum kr_status st = (call);                                                                     \
        kr_alloc_fail_at(0, 0);                                                                         \
        if (st == KR_OK) {                                                                              \
            on_ok;                                                                                      \
            break;                                                                                      \
        }                                                                                               \
        cr_assert_eq(st, KR_ERR_NOMEM, "%s, allocation %llu: %s (%s)", what, (unsigned long long)n,     \
                     kr_status_str(st), err.msg);                                                       \
        cr_assert_eq(kr_alloc_bytes_in_use(), base, "%s: leak after failing allocation %llu", what,     \
                     (unsigned long long)n);                                                            \
        cr_assert_lt(n, 100000);                                                                        \
    }

Test(grammar, allocation_failures_free_everything)
{
    size_t base = kr_alloc_bytes_in_use();
    struct kr_grammar *g = NULL;
    FAULT_LOOP("gbnf", kr_grammar_from_gbnf(json_gbnf, strlen(json_gbnf), NULL, &g, &err), kr_grammar_free(g));
    const char *re = "(\\d{3}-){2}\\d{4}|[^a-z]+";
    FAULT_LOOP("regex", kr_grammar_from_regex(re, strlen(re), &g, &err), kr_grammar_free(g));
    for (int i = 0; schemas[i]; i++) {
        FAULT_LOOP(schemas[i], kr_grammar_from_json_schema(schemas[i], strlen(schemas[i]), NULL, &g, &err),
                   kr_grammar_free(g));
    }
    FAULT_LOOP("json_object", kr_grammar_from_json_object(NULL, &g, &err), kr_grammar_free(g));
    const char *c[] = {"a", "b"};
    size_t l[] = {1, 1};
    FAULT_LOOP("choice", kr_grammar_from_choice(c, l, 2, &g, &err), kr_grammar_free(g));
    FAULT_LOOP("choice text", kr_grammar_compile(KR_GRAMMAR_CHOICE, "[\"a\",\"b\"]", 9, NULL, &g, &err),
               kr_grammar_free(g));
    struct kr_grammar_cache *gc = NULL;
    FAULT_LOOP("cache", kr_grammar_cache_create(4, &gc), (void)0);
    size_t with_cache = kr_alloc_bytes_in_use();
    base = with_cache;
    FAULT_LOOP("cache get", kr_grammar_cache_get(gc, KR_GRAMMAR_REGEX, "a+", 2, NULL, &g, NULL, &err),
               kr_grammar_free(g));
    kr_grammar_cache_destroy(gc);
    base = kr_alloc_bytes_in_use();
    /* errors found after allocations (an undefined rule, left recursion) free too */
    const char *bad = "root ::= a b\na ::= \"x\" | a \"y\"";
    FAULT_LOOP("left recursion", kr_grammar_from_gbnf(bad, strlen(bad), NULL, &g, &err) == KR_ERR_INVAL
                                     ? KR_OK : KR_ERR_NOMEM, (void)0);

    g = schema(schemas[4]);
    size_t with_g = kr_alloc_bytes_in_use();
    struct kr_grammar_matcher *m = NULL, *m2 = NULL;
    base = with_g;
    FAULT_LOOP("matcher", kr_grammar_matcher_create(g, &m, &err), (void)0);
    const char *doc = "{\"value\":1,\"children\":[{\"value\":2,\"children\":[]}]}";
    bool ok;
    /* a failed step leaves the matcher as it was, and it can go on */
    for (uint64_t n = 1;; n++) {
        struct kr_err err = {0};
        kr_alloc_fail_at(n, 1);
        enum kr_status st = kr_grammar_matcher_accept_bytes(m, doc, strlen(doc), &ok, &err);
        kr_alloc_fail_at(0, 0);
        if (st == KR_OK) {
            cr_expect(ok && kr_grammar_matcher_can_end(m));
            break;
        }
        cr_assert_eq(st, KR_ERR_NOMEM, "%s", err.msg);
        cr_assert_lt(n, 100000);
    }
    base = kr_alloc_bytes_in_use();
    FAULT_LOOP("clone", kr_grammar_matcher_clone(m, &m2, &err), kr_grammar_matcher_destroy(m2));
    const char *toks[] = {"{", "}", "\"value\"", ":", "1", "[", "]", ",", "\"children\""};
    size_t lens[9];
    for (int i = 0; i < 9; i++) {
        lens[i] = strlen(toks[i]);
    }
    struct kr_grammar_vocab *v = NULL;
    FAULT_LOOP("vocab", kr_grammar_vocab_create_raw(9, toks, lens, NULL, 0, &v, &err), (void)0);
    cr_assert_eq(kr_grammar_matcher_reset(m, &(struct kr_err){0}), KR_OK);
    uint32_t mask[1];
    for (uint64_t n = 1;; n++) {
        struct kr_err err = {0};
        kr_alloc_fail_at(n, 0);
        enum kr_status st = kr_grammar_matcher_fill_mask(m, v, mask, &err);
        kr_alloc_fail_at(0, 0);
        if (st == KR_OK) {
            cr_expect_eq(mask[0], 1u);
            break;
        }
        cr_assert_eq(st, KR_ERR_NOMEM, "%s", err.msg);
        cr_assert_lt(n, 100000);
    }
    kr_grammar_vocab_destroy(v);
    kr_grammar_matcher_destroy(m);
    kr_grammar_free(g);
}
