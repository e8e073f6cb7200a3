#define _POSIX_C_SOURCE 200809L
/* Constrained decoding: grammar compile times and token-mask times.
 *
 *   bench_grammar [TOKENIZER_DIR] [ROUNDS]
 *
 * For each grammar (a strict JSON Schema, a recursive one, json_object, a free-text schema, a
 * regex, a GBNF grammar): the compile time (best of 20), then passes over its sample documents:
 * each is tokenized with the tokenizer (default tests/fixtures/tokenizer/deepseek_v3) and fed token
 * by token, timing the mask before every token (and checking that the mask allows it). Three
 * kinds of pass: "cold", the first with a freshly compiled grammar (its adaptive cache fills as
 * positions come up), "warm", ROUNDS (default 5) more with that cache filled, and "walk", one
 * with the cache off (one pass over the token trie per mask). Prints the vocabulary build time and,
 * per grammar and overall, the mean, p50, p99 and largest mask time of each, and the memory the
 * grammar holds with its filled cache. One thread. */
#include "alloc.h"
#include "clock.h"
#include "grammar.h"
#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum kind { SCHEMA, OBJECT, REGEX, GBNF };

struct bench {
    const char *name;
    enum kind kind;
    const char *src;
    const char *docs[4];
};

static const struct bench benches[] = {
    {"strict schema", SCHEMA,
     "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\",\"minimum\":0,"
     "\"maximum\":150},\"email\":{\"type\":\"string\",\"format\":\"email\"},\"tags\":{\"type\":\"array\",\"items\":"
     "{\"type\":\"string\",\"enum\":[\"admin\",\"user\",\"guest\"]},\"maxItems\":3},\"address\":{\"type\":\"object\","
     "\"properties\":{\"street\":{\"type\":\"string\"},\"city\":{\"type\":\"string\"},\"zip\":{\"type\":\"string\","
     "\"pattern\":\"^[0-9]{5}$\"}},\"required\":[\"street\",\"city\",\"zip\"],\"additionalProperties\":false}},"
     "\"required\":[\"name\",\"age\",\"email\",\"tags\",\"address\"],\"additionalProperties\":false}",
     {"{\"name\": \"Ada Lovelace\", \"age\": 36, \"email\": \"ada@analytical.org\", \"tags\": [\"admin\", \"user\"], "
      "\"address\": {\"street\": \"12 St James's Square\", \"city\": \"London\", \"zip\": \"10001\"}}",
      "{\n  \"name\": \"Grace Hopper\",\n  \"age\": 85,\n  \"email\": \"grace.hopper@navy.mil\",\n  \"tags\": [],\n"
      "  \"address\": {\n    \"street\": \"1 Compiler Way\",\n    \"city\": \"Arlington\",\n    \"zip\": \"22201\"\n  }\n}"}},
    {"recursive schema", SCHEMA,
     "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"label\":{\"type\":\"string\"},\"weight\":{\"type\":"
     "\"number\"},\"children\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},\"required\":[\"label\","
     "\"children\"]}},\"$ref\":\"#/$defs/node\"}",
     {"{\"label\": \"root\", \"weight\": 1.5, \"children\": [{\"label\": \"left\", \"children\": [{\"label\": \"leaf\", "
      "\"weight\": -0.25e2, \"children\": []}]}, {\"label\": \"right\", \"children\": []}]}"}},
    {"json_object", OBJECT, NULL,
     {"{\"summary\": \"The quarterly report shows revenue up 12% year over year, driven by cloud services.\", "
      "\"figures\": {\"revenue\": 1234.5, \"growth\": 0.12, \"regions\": [\"EMEA\", \"APAC\", \"AMER\"]}, "
      "\"approved\": true, \"notes\": null}"}},
    {"free text schema", SCHEMA,
     "{\"type\":\"object\",\"properties\":{\"answer\":{\"type\":\"string\"},\"confidence\":{\"type\":\"number\","
     "\"minimum\":0,\"maximum\":1}},\"required\":[\"answer\",\"confidence\"],\"additionalProperties\":false}",
     {"{\"answer\": \"The mitochondria is the powerhouse of the cell: it produces most of the chemical energy needed "
      "to power the cell's biochemical reactions, stored in adenosine triphosphate (ATP). Mitochondria have their own "
      "DNA, and \\\"maternal inheritance\\\" means it is passed down from the mother \\u2014 see ref. [3].\", "
      "\"confidence\": 0.93}"}},
    {"regex", REGEX, "(\\+1 )?\\(?[0-9]{3}\\)?[ -][0-9]{3}-[0-9]{4}|[a-z0-9._]+@[a-z0-9-]+(\\.[a-z]{2,})+",
     {"(555) 867-5309", "+1 212 555-0100", "first.last@example-mail.co.uk"}},
    {"gbnf arithmetic", GBNF,
     "root ::= expr\nexpr ::= term (ws [-+] ws term)*\nterm ::= factor (ws [*/] ws factor)*\n"
     "factor ::= [0-9]+ (\".\" [0-9]+)? | \"(\" ws expr ws \")\" | \"-\" factor\nws ::= [ ]?\n",
     {"(12.5 + 7) * (3 - -4) / 2", "((1+2)*(3+4)*(5+6)) - 1000 * 0.001"}},
};

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static enum kr_status compile(const struct bench *b, struct kr_grammar **g, struct kr_err *err)
{
    switch (b->kind) {
    case SCHEMA:
        return kr_grammar_from_json_schema(b->src, strlen(b->src), NULL, g, err);
    case OBJECT:
        return kr_grammar_from_json_object(NULL, g, err);
    case REGEX:
        return kr_grammar_from_regex(b->src, strlen(b->src), g, err);
    case GBNF:
        return kr_grammar_from_gbnf(b->src, strlen(b->src), NULL, g, err);
    }
    return KR_ERR_INTERNAL;
}

struct times {
    double *v;
    size_t n, cap;
};

static void times_add(struct times *t, double x)
{
    if (t->n == t->cap) {
        t->cap = t->cap ? t->cap * 2 : 1024;
        t->v = kr_realloc(t->v, t->cap * sizeof(double));
    }
    t->v[t->n++] = x;
}

/* mean p50 p99 max of t (sorted in place) */
static void put_stats(struct times *t, bool p50)
{
    qsort(t->v, t->n, sizeof(double), cmp_double);
    double sum = 0;
    for (size_t i = 0; i < t->n; i++) {
        sum += t->v[i];
    }
    size_t n = t->n ? t->n : 1, p99 = (size_t)(0.99 * (double)(n - 1));
    printf(" %7.3f", t->n ? sum / (double)t->n : 0);
    if (p50) {
        printf(" %7.3f", t->n ? t->v[t->n / 2] : 0);
    }
    printf(" %7.3f %7.3f", t->n ? t->v[p99] : 0, t->n ? t->v[t->n - 1] : 0);
}

/* One pass over the bench's documents: every mask's time appended to t. */
static int pass(const struct bench *b, const struct kr_grammar *g, struct kr_tokenizer *tok,
                const struct kr_grammar_vocab *v, int32_t eos, bool cached, uint32_t *mask, struct times *t)
{
    struct kr_err err = {0};
    for (int d = 0; d < 4 && b->docs[d]; d++) {
        int32_t *ids;
        int64_t n_ids;
        struct kr_grammar_matcher *m;
        if (kr_tokenizer_encode(tok, b->docs[d], strlen(b->docs[d]), false, &ids, &n_ids, &err) != KR_OK ||
            kr_grammar_matcher_create(g, &m, &err) != KR_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
        kr_grammar_matcher_use_cache(m, cached);
        for (int64_t i = 0; i <= n_ids; i++) {
            int32_t id = i < n_ids ? ids[i] : eos;
            double m0 = kr_clock_s();
            if (kr_grammar_matcher_fill_mask(m, v, mask, &err) != KR_OK) {
                fprintf(stderr, "%s\n", err.msg);
                return 1;
            }
            times_add(t, (kr_clock_s() - m0) * 1e3);
            if (id < 0) {
                break;
            }
            bool ok;
            if (!((mask[id / 32] >> (id % 32)) & 1) || kr_grammar_matcher_accept_token(m, v, id, &ok, &err) != KR_OK ||
                !ok) {
                fprintf(stderr, "%s: document %d: token %lld (id %d) refused\n", b->name, d, (long long)i, id);
                return 1;
            }
        }
        kr_grammar_matcher_destroy(m);
        kr_free(ids);
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : KR_SOURCE_DIR "/tests/fixtures/tokenizer/deepseek_v3";
    int rounds = argc > 2 ? atoi(argv[2]) : 5;
    struct kr_err err = {0};
    struct kr_tokenizer *tok;
    if (kr_tokenizer_load(dir, NULL, &tok, &err) != KR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    int32_t eos = kr_tokenizer_eos_id(tok);
    struct kr_grammar_vocab *v;
    double t0 = kr_clock_s();
    if (kr_grammar_vocab_create(tok, &eos, eos >= 0, &v, &err) != KR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    printf("tokenizer %s: %d ids, token trie built in %.1f ms\n", dir, kr_grammar_vocab_n_vocab(v),
           (kr_clock_s() - t0) * 1e3);
    printf("%-17s %8s %5s | %-23s | %-31s | %-23s | %s\n", "", "compile", "masks", "cold cache: mean p99 max",
           "warm cache: mean p50 p99 max", "trie walk: mean p99 max", "KB");
    uint32_t *mask = kr_malloc((size_t)kr_grammar_vocab_mask_words(v) * sizeof(uint32_t));
    struct times all[3] = {{0}};
    for (size_t bi = 0; bi < sizeof(benches) / sizeof(benches[0]); bi++) {
        const struct bench *b = &benches[bi];
        struct kr_grammar *g = NULL;
        double best = 1e30;
        for (int r = 0; r < 20; r++) {
            struct kr_grammar *tmp;
            double c0 = kr_clock_s();
            if (compile(b, &tmp, &err) != KR_OK) {
                fprintf(stderr, "%s: %s\n", b->name, err.msg);
                return 1;
            }
            double dt = kr_clock_s() - c0;
            best = dt < best ? dt : best;
            kr_grammar_free(g);
            g = tmp; /* the last one: its cache is empty */
        }
        struct times t[3] = {{0}};
        if (pass(b, g, tok, v, eos, true, mask, &t[0])) {
            return 1;
        }
        for (int r = 0; r < rounds; r++) {
            if (pass(b, g, tok, v, eos, true, mask, &t[1])) {
                return 1;
            }
        }
        if (pass(b, g, tok, v, eos, false, mask, &t[2])) {
            return 1;
        }
        for (int k = 0; k < 3; k++) {
            for (size_t i = 0; i < t[k].n; i++) {
                times_add(&all[k], t[k].v[i]);
            }
        }
        size_t held = kr_alloc_bytes_in_use();
        kr_grammar_free(g);
        held -= kr_alloc_bytes_in_use();
        printf("%-17s %8.1f %5zu |", b->name, best * 1e6, t[0].n);
        put_stats(&t[0], false);
        printf(" |");
        put_stats(&t[1], true);
        printf(" |");
        put_stats(&t[2], false);
        printf(" | %6.0f\n", (double)held / 1024);
        for (int k = 0; k < 3; k++) {
            kr_free(t[k].v);
        }
    }
    printf("%-17s %8s %5zu |", "all", "", all[0].n);
    put_stats(&all[0], false);
    printf(" |");
    put_stats(&all[1], true);
    printf(" |");
    put_stats(&all[2], false);
    printf("\n(compile: best of 20, microseconds; masks: per pass, one per token; times in milliseconds, one thread;\n"
           " KB: the grammar with its mask cache after the passes)\n");
    for (int k = 0; k < 3; k++) {
        kr_free(all[k].v);
    }
    kr_free(mask);
    kr_grammar_vocab_destroy(v);
    kr_tokenizer_free(tok);
    return 0;
}
