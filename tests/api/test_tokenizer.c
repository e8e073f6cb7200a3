#define _POSIX_C_SOURCE 200809L

#include "tokenizer.h"

#include "alloc.h"
#include "clock.h"
#include "unicode.h"

#include <criterion/criterion.h>
#include <jansson.h>

#include <stdio.h>
#include <string.h>

/* Every expected value in these tests comes from HF tokenizers (tools/reference/tokenizer/
 * make_expected.mjs writes tests/fixtures/tokenizer/<name>/expected.json), never from krait. */

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

TestSuite(tokenizer, .init = setup, .fini = teardown, .timeout = 120);

static json_t *load_json(const char *path)
{
    json_error_t je;
    json_t *j = json_load_file(path, JSON_ALLOW_NUL, &je);
    cr_assert_not_null(j, "%s: %s", path, je.text);
    return j;
}

static struct kr_tokenizer *load_tok(const char *dir)
{
    struct kr_tokenizer *t = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_tokenizer_load(dir, NULL, &t, &err);
    cr_assert_eq(st, KR_OK, "loading %s: %s", dir, err.msg);
    return t;
}

/* Compares ids with a JSON array; reports the first difference. */
static bool ids_equal(const int32_t *ids, int64_t n, const json_t *want, const char *what, size_t text_i)
{
    size_t nw = json_array_size(want);
    size_t m = (size_t)n < nw ? (size_t)n : nw;
    for (size_t k = 0; k < m; k++) {
        if (ids[k] != json_integer_value(json_array_get(want, k))) {
            cr_expect_fail("text %zu (%s): id %zu is %d, HF has %lld (lengths %lld vs %zu)", text_i, what, k, ids[k],
                           (long long)json_integer_value(json_array_get(want, k)), (long long)n, nw);
            return false;
        }
    }
    if ((size_t)n != nw) {
        cr_expect_fail("text %zu (%s): %lld ids, HF has %zu", text_i, what, (long long)n, nw);
        return false;
    }
    return true;
}

static int32_t *json_ids(const json_t *a, int64_t *n)
{
    *n = (int64_t)json_array_size(a);
    int32_t *v = kr_malloc(((size_t)*n + 1) * sizeof(int32_t));
    cr_assert_not_null(v);
    for (int64_t i = 0; i < *n; i++) {
        v[i] = (int32_t)json_integer_value(json_array_get(a, (size_t)i));
    }
    return v;
}

static void expect_decode(const struct kr_tokenizer *t, const int32_t *ids, int64_t n, bool skip, const json_t *want,
                          const char *what, size_t text_i)
{
    char *s = NULL;
    size_t len = 0;
    struct kr_err err = {0};
    cr_assert_eq(kr_tokenizer_decode(t, ids, n, skip, &s, &len, &err), KR_OK, "%s", err.msg);
    cr_expect(len == json_string_length(want) && memcmp(s, json_string_value(want), len) == 0,
              "text %zu (%s): decode differs from HF:\n  krait: %.300s\n  HF:    %.300s", text_i, what, s,
              json_string_value(want));
    kr_free(s);
}

/* Streams ids through a detokenizer: pieces must be valid UTF-8 and concatenate to `want`. */
static void expect_stream(const struct kr_tokenizer *t, const int32_t *ids, int64_t n, bool skip, const json_t *want,
                          size_t text_i)
{
    struct kr_detok *d = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_detok_create(t, skip, &d), KR_OK);
    struct kr_buf_s all = {0};
    kr_bs_reserve(&all, 0);
    for (int64_t i = 0; i <= n; i++) {
        const char *piece;
        size_t len;
        enum kr_status st = i < n ? kr_detok_push(d, ids[i], &piece, &len, &err) : kr_detok_flush(d, &piece, &len, &err);
        cr_assert_eq(st, KR_OK, "%s", err.msg);
        cr_expect_eq(kr_utf8_validate(piece, len), len, "text %zu: streamed piece %lld splits a UTF-8 character",
                     text_i, (long long)i);
        kr_bs_append(&all, piece, len);
    }
    cr_expect(all.len == json_string_length(want) && memcmp(all.p, json_string_value(want), all.len) == 0,
              "text %zu: streamed text differs from the full HF decode:\n  krait: %.300s\n  HF:    %.300s", text_i,
              all.p, json_string_value(want));
    kr_bs_free(&all);
    kr_detok_destroy(d);
}

/* The whole HF comparison for one tokenizer directory. Streams longer than max_stream_ids (0: no
 * limit) are not streamed: decoders that need the quadratic full-history mode would be slow. */
static void check_against_hf(const char *name, bool stream, int64_t max_stream_ids)
{
    char dir[512], path[600];
    snprintf(dir, sizeof(dir), FIX "/%s", name);
    snprintf(path, sizeof(path), "%s/expected.json", dir);
    json_t *corpus = load_json(FIX "/corpus.json");
    json_t *exp = load_json(path);
    const json_t *texts = json_object_get(corpus, "texts"), *cases = json_object_get(exp, "cases");
    cr_assert_eq(json_array_size(cases), json_array_size(texts), "expected.json is stale: rerun make_expected.mjs");
    struct kr_tokenizer *t = load_tok(dir);
    cr_expect_eq(kr_tokenizer_n_vocab(t), json_integer_value(json_object_get(exp, "vocab_size")));
    /* the bound the server refuses long texts by: HF's token count of every text reaches it */
    const size_t per = kr_tokenizer_max_bytes_per_token(t);
    for (size_t i = 0; per && i < json_array_size(cases); i++) {
        const size_t n_hf = json_array_size(json_object_get(json_array_get(cases, i), "ids"));
        const size_t bytes = json_string_length(json_array_get(texts, i));
        cr_expect(n_hf * per >= bytes, "%s text %zu: %zu bytes in %zu HF tokens, more than %zu bytes a token", name, i,
                  bytes, n_hf, per);
    }
    size_t n_bad = 0;
    for (size_t i = 0; i < json_array_size(cases) && n_bad < 10; i++) {
        const json_t *c = json_array_get(cases, i);
        const json_t *text = json_array_get(texts, i);
        int32_t *ids = NULL;
        int64_t n = 0;
        struct kr_err err = {0};
        cr_assert_eq(kr_tokenizer_encode(t, json_string_value(text), json_string_length(text), false, &ids, &n, &err),
                     KR_OK, "text %zu: %s", i, err.msg);
        n_bad += !ids_equal(ids, n, json_object_get(c, "ids"), "no special tokens", i);
        kr_free(ids);
        cr_assert_eq(kr_tokenizer_encode(t, json_string_value(text), json_string_length(text), true, &ids, &n, &err),
                     KR_OK, "text %zu: %s", i, err.msg);
        n_bad += !ids_equal(ids, n, json_object_get(c, "ids_special"), "with special tokens", i);
        kr_free(ids);

        /* decodes of HF's own ids */
        int64_t n1, n2;
        int32_t *a = json_ids(json_object_get(c, "ids"), &n1);
        int32_t *b = json_ids(json_object_get(c, "ids_special"), &n2);
        expect_decode(t, a, n1, false, json_object_get(c, "decode"), "decode", i);
        expect_decode(t, b, n2, true, json_object_get(c, "decode_skip"), "decode skip_special_tokens", i);
        expect_decode(t, b, n2, false, json_object_get(c, "decode_special"), "decode with special tokens", i);
        if (stream && (max_stream_ids == 0 || n2 <= max_stream_ids)) {
            expect_stream(t, b, n2, false, json_object_get(c, "decode_special"), i);
            expect_stream(t, b, n2, true, json_object_get(c, "decode_skip"), i);
        }
        for (int64_t k = 0; k < n1 / 2; k++) {
            int32_t tmp = a[k];
            a[k] = a[n1 - 1 - k];
            a[n1 - 1 - k] = tmp;
        }
        expect_decode(t, a, n1, false, json_object_get(c, "decode_reversed"), "decode of the reversed ids", i);
        if (stream && (max_stream_ids == 0 || n1 <= max_stream_ids)) {
            expect_stream(t, a, n1, false, json_object_get(c, "decode_reversed"), i);
        }
        kr_free(a);
        kr_free(b);
    }
    const json_t *chunks = json_object_get(exp, "chunks");
    for (size_t i = 0; i < json_array_size(chunks); i++) {
        const json_t *c = json_array_get(chunks, i);
        int64_t n;
        int32_t *a = json_ids(json_object_get(c, "ids"), &n);
        expect_decode(t, a, n, false, json_object_get(c, "decode"), "decode of a vocabulary chunk", i);
        expect_decode(t, a, n, true, json_object_get(c, "decode_skip"), "skip-decode of a vocabulary chunk", i);
        if (stream) {
            expect_stream(t, a, n, false, json_object_get(c, "decode"), i);
        }
        kr_free(a);
    }
    kr_tokenizer_free(t);
    json_decref(corpus);
    json_decref(exp);
}

Test(tokenizer, deepseek_v3_matches_hf_on_the_corpus)
{
    check_against_hf("deepseek_v3", true, 0);
}

Test(tokenizer, llama3_matches_hf_on_the_corpus)
{
    check_against_hf("llama3", true, 0);
}

/* the trained default model's own byte-level BPE (4096 tokens, models/small-hybrid) */
Test(tokenizer, small_hybrid_matches_hf_on_the_corpus)
{
    check_against_hf("small_hybrid", true, 0);
}

Test(tokenizer, llama2_metaspace_bpe_matches_hf_on_the_corpus)
{
    check_against_hf("llama2", true, 0);
}

Test(tokenizer, synthetic_metaspace_first_matches_hf)
{
    check_against_hf("synth/metaspace_first", true, 0);
}

Test(tokenizer, synthetic_metaspace_never_matches_hf)
{
    check_against_hf("synth/metaspace_never", true, 0);
}

Test(tokenizer, synthetic_bytelevel_prefix_space_matches_hf)
{
    check_against_hf("synth/bytelevel_prefix", true, 0);
}

Test(tokenizer, synthetic_split_merged_behaviors_match_hf)
{
    check_against_hf("synth/split_merged", false, 0);
}

Test(tokenizer, synthetic_split_invert_contiguous_match_hf)
{
    check_against_hf("synth/split_invert", false, 0);
}

Test(tokenizer, synthetic_split_empty_matches_match_hf)
{
    check_against_hf("synth/split_empty", false, 0);
}

Test(tokenizer, synthetic_whitespace_pretokenizer_matches_hf)
{
    check_against_hf("synth/whitespace", false, 0);
}

Test(tokenizer, synthetic_bert_pretokenizer_matches_hf)
{
    check_against_hf("synth/bert_pretok", true, 0);
}

Test(tokenizer, synthetic_subword_prefix_suffix_matches_hf)
{
    check_against_hf("synth/subword", true, 0);
}

/* Id sequences whose stream once differed from their full decode (the fuzzer found the first: an
 * id that names no token, or a skipped special token, inside a run of <0xXX> byte tokens let the
 * stream release the run's first bytes as text before a later byte turned the whole run into
 * U+FFFD), and a Strip with `stop` after Fuse (synth/strip_stop), which the stream applies to the
 * streamed text. The full decode and the stream must both be HF's decode (streams.json, written by
 * tools/reference/tokenizer/make_streams.mjs). */
Test(tokenizer, streams_match_hf_on_found_and_edge_sequences)
{
    json_t *streams = load_json(FIX "/streams.json");
    const json_t *cases = json_object_get(streams, "cases");
    cr_assert_gt(json_array_size(cases), 0);
    for (size_t i = 0; i < json_array_size(cases); i++) {
        const json_t *c = json_array_get(cases, i);
        char dir[512];
        snprintf(dir, sizeof dir, FIX "/%s", json_string_value(json_object_get(c, "tokenizer")));
        struct kr_tokenizer *t = load_tok(dir);
        const bool skip = json_is_true(json_object_get(c, "skip_special_tokens"));
        int64_t n;
        int32_t *ids = json_ids(json_object_get(c, "ids"), &n);
        expect_decode(t, ids, n, skip, json_object_get(c, "decode"), json_string_value(json_object_get(c, "why")), i);
        expect_stream(t, ids, n, skip, json_object_get(c, "decode"), i);
        kr_free(ids);
        kr_tokenizer_free(t);
    }
    json_decref(streams);
}

/* Which tokenizers bound the bytes a token stands for: byte-level BPE (every byte is in some token)
 * and Metaspace do; pre-tokenizers that drop whitespace do not (a text of spaces is no tokens). */
Test(tokenizer, bytes_per_token_bound_is_given_only_where_it_holds)
{
    static const struct {
        const char *dir;
        bool bounded;
    } cases[] = {
        {"deepseek_v3", true},
        {"llama3", true},
        {"small_hybrid", true},
        {"llama2", true},                    /* Metaspace, Replace(" " -> "▁"), byte fallback */
        {"synth/whitespace", false},         /* drops whitespace */
        {"synth/bert_pretok", false},        /* drops whitespace */
        {"synth/bytelevel_prefix", false},   /* StripAccents, an added token taking whitespace */
        {"synth/metaspace_first", false},    /* fused unknown tokens */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char dir[512];
        snprintf(dir, sizeof dir, FIX "/%s", cases[i].dir);
        struct kr_tokenizer *t = load_tok(dir);
        const size_t per = kr_tokenizer_max_bytes_per_token(t);
        cr_expect_eq(per != 0, cases[i].bounded, "%s: %zu bytes a token", cases[i].dir, per);
        kr_tokenizer_free(t);
    }
}

/* ---- bad input ------------------------------------------------------------------------------ */

Test(tokenizer, invalid_utf8_is_a_clear_error)
{
    struct kr_tokenizer *t = load_tok(FIX "/synth/subword");
    static const char *const bad[] = {"ab\xff", "\xc3", "x\xe2\x82", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xc0\xaf"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int32_t *ids = NULL;
        int64_t n = 0;
        struct kr_err err = {0};
        cr_expect_eq(kr_tokenizer_encode(t, bad[i], strlen(bad[i]), true, &ids, &n, &err), KR_ERR_INVAL);
        cr_expect(strstr(err.msg, "UTF-8") != NULL, "message: %s", err.msg);
        cr_expect_null(ids);
    }
    kr_tokenizer_free(t);
}

static void expect_load_error(const char *json, enum kr_status want, const char *what)
{
    struct kr_tokenizer *t = NULL;
    struct kr_err err = {0};
    cr_expect_eq(kr_tokenizer_load_mem(json, strlen(json), NULL, 0, &t, &err), want, "%s: %s", json, err.msg);
    cr_expect(strstr(err.msg, what) != NULL, "message \"%s\" does not mention \"%s\"", err.msg, what);
    cr_expect_null(t);
}

Test(tokenizer, malformed_or_unsupported_files_are_load_errors)
{
    expect_load_error("{", KR_ERR_FORMAT, "line 1");
    expect_load_error("[]", KR_ERR_FORMAT, "top level");
    expect_load_error("{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}", KR_ERR_UNSUPPORTED, "Unigram");
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a b\"]}}", KR_ERR_FORMAT,
                      "merges[0]");
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": \"x\"}, \"merges\": []}}", KR_ERR_FORMAT,
                      "model.vocab");
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}, \"normalizer\": "
                      "{\"type\": \"Precompiled\"}}", KR_ERR_UNSUPPORTED, "Precompiled");
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}, \"pre_tokenizer\": "
                      "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}, \"behavior\": \"Isolated\"}}",
                      KR_ERR_FORMAT, "cannot compile regex");
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}, \"decoder\": "
                      "{\"type\": \"CTC\"}}", KR_ERR_UNSUPPORTED, "CTC");
}

Test(tokenizer, lookups_follow_the_files)
{
    struct kr_tokenizer *t = load_tok(FIX "/deepseek_v3");
    /* ids as written in deepseek_v3/tokenizer.json and tokenizer_config.json */
    cr_expect_eq(kr_tokenizer_bos_id(t), 0);
    cr_expect_eq(kr_tokenizer_eos_id(t), 1);
    cr_expect_str_eq(kr_tokenizer_bos_token(t), "<｜begin▁of▁sentence｜>");
    cr_expect(kr_tokenizer_is_special(t, 1));
    cr_expect_eq(kr_tokenizer_piece_to_id(t, "<｜end▁of▁sentence｜>", strlen("<｜end▁of▁sentence｜>")), 1);
    cr_expect_not_null(kr_tokenizer_chat_template(t));
    kr_tokenizer_free(t);
}

/* ---- allocation failures ------------------------------------------------------------------------ */

/* SQLite's OOM loop over tokenizer loads: the N-th allocation of a load fails (once, or from there
 * on), until a load completes without reaching it. A failure must be KR_ERR_NOMEM saying out of
 * memory and naming the directory, with nothing left allocated; a load that absorbed a failure
 * (the PCRE2 JIT falls back to the interpreter) must tokenize as the clean one does. jansson
 * allocates with malloc here, so the points are krait's own (reading the files, the vocabulary,
 * merges, added tokens, regexes, normalizer, decoder); `krait serve` also routes jansson's parse
 * through the hook, shielded from injection (kr_alloc_shield; test_faults covers it). The walk
 * takes every point up to `dense`, then every `stride`-th. Returns the point at which the load
 * completed. */
static uint64_t oom_walk(const char *dir, uint64_t dense, uint64_t stride, bool sticky_too)
{
    static const char text[] = "Hello world! ¿Qué tal? 12345 \t tabs\nand  spaces 世界 🙂";
    const double t_start = kr_clock_s();
    struct kr_tokenizer *ref = load_tok(dir);
    int32_t *want = NULL;
    int64_t n_want = 0;
    struct kr_err err = {0};
    cr_assert_eq(kr_tokenizer_encode(ref, text, strlen(text), true, &want, &n_want, &err), KR_OK, "%s", err.msg);
    kr_tokenizer_free(ref);
    const uint64_t c0 = kr_alloc_calls();
    ref = load_tok(dir);
    const uint64_t total = kr_alloc_calls() - c0;
    kr_tokenizer_free(ref);
    const size_t base = kr_alloc_bytes_in_use();
    uint64_t done_at = 0;
    for (int sticky = 0; sticky < (sticky_too ? 2 : 1); sticky++) {
        for (uint64_t n = 1;; n += n < dense ? 1 : stride) {
            cr_assert_lt(n, total + stride + 1, "%s: never loaded", dir);
            struct kr_tokenizer *t = NULL;
            memset(&err, 0, sizeof err);
            const uint64_t f0 = kr_alloc_failures();
            kr_alloc_fail_at(n, sticky);
            const enum kr_status st = kr_tokenizer_load(dir, NULL, &t, &err);
            kr_alloc_fail_at(0, 0);
            const bool fired = kr_alloc_failures() != f0;
            if (st == KR_OK) {
                int32_t *ids = NULL;
                int64_t n_ids = 0;
                cr_assert_eq(kr_tokenizer_encode(t, text, strlen(text), true, &ids, &n_ids, &err), KR_OK);
                cr_assert(n_ids == n_want && !memcmp(ids, want, (size_t)n_ids * sizeof *ids),
                          "%s: loaded although allocation %llu failed, and tokenizes differently", dir,
                          (unsigned long long)n);
                kr_free(ids);
                kr_tokenizer_free(t);
                cr_assert_eq(kr_alloc_bytes_in_use(), base);
                if (!fired) {
                    done_at = n;
                    break;
                }
                continue;
            }
            cr_assert(fired, "%s: failed without an injected failure: %s", dir, err.msg);
            cr_assert_eq(st, KR_ERR_NOMEM, "%s, allocation %llu: status %d: %s", dir, (unsigned long long)n, st,
                         err.msg);
            cr_assert(strstr(err.msg, "out of memory") && strstr(err.msg, dir),
                      "%s, allocation %llu: the message names neither: \"%s\"", dir, (unsigned long long)n, err.msg);
            cr_assert_null(t);
            cr_assert_eq(kr_alloc_bytes_in_use(), base, "%s, allocation %llu: %lld bytes left", dir,
                         (unsigned long long)n, (long long)(kr_alloc_bytes_in_use() - base));
        }
    }
    kr_free(want);
    cr_log_info("%s: %llu allocations; loaded at allocation %llu (%.1f s)", dir, (unsigned long long)total,
                (unsigned long long)done_at, kr_clock_s() - t_start);
    return done_at;
}

Test(tokenizer, every_allocation_failure_of_a_load_is_a_named_error)
{
    static const char *const synth[] = {"bert_pretok",     "bytelevel_prefix", "metaspace_first",
                                        "metaspace_never", "split_empty",      "split_invert",
                                        "split_merged",    "subword",          "whitespace"};
    char dir[256];
    for (size_t i = 0; i < sizeof synth / sizeof synth[0]; i++) {
        snprintf(dir, sizeof dir, "%s/synth/%s", FIX, synth[i]);
        oom_walk(dir, UINT64_MAX, 1, true);
    }
    oom_walk(FIX "/llama2", UINT64_MAX, 1, true);
    /* the embedded model's (a load takes about 0.8 s under the sanitizers): every point up to 8,
     * then every 61st */
    oom_walk(FIX "/deepseek_v3", 8, 61, false);
}

/* The allocation-failure walk over a stream: the N-th allocation from creating a detokenizer to its
 * flush fails (once, or from there on). Each failure must be KR_ERR_NOMEM from the call that met it,
 * and after a flush and destroy nothing may be left allocated; a stream that met no failure must be
 * HF's decode. One tokenizer per detokenizer mode: windowed with byte runs and a cut Strip (llama2,
 * metaspace_never), windowed byte level (llama3), full history (bert_pretok). */
Test(tokenizer, every_allocation_failure_of_a_stream_is_a_clean_error)
{
    static const char *const dirs[] = {"llama2", "synth/metaspace_never", "llama3", "synth/bert_pretok"};
    for (size_t k = 0; k < sizeof dirs / sizeof dirs[0]; k++) {
        char dir[512], path[600];
        snprintf(dir, sizeof dir, FIX "/%s", dirs[k]);
        snprintf(path, sizeof path, "%s/expected.json", dir);
        json_t *exp = load_json(path);
        const json_t *c = json_array_get(json_object_get(exp, "cases"), 3);
        int64_t n;
        int32_t *ids = json_ids(json_object_get(c, "ids_special"), &n);
        const json_t *want = json_object_get(c, "decode_skip");
        struct kr_tokenizer *t = load_tok(dir);
        const size_t base = kr_alloc_bytes_in_use();
        for (int sticky = 0; sticky < 2; sticky++) {
            for (uint64_t at = 1;; at++) {
                cr_assert_lt(at, 100000, "%s: the stream never completed", dirs[k]);
                struct kr_detok *d = NULL;
                struct kr_buf_s all = {0};
                struct kr_err err = {0};
                const uint64_t f0 = kr_alloc_failures();
                kr_alloc_fail_at(at, sticky);
                enum kr_status st = kr_detok_create(t, true, &d);
                for (int64_t i = 0; i <= n && st == KR_OK; i++) {
                    const char *piece;
                    size_t len;
                    st = i < n ? kr_detok_push(d, ids[i], &piece, &len, &err) : kr_detok_flush(d, &piece, &len, &err);
                    if (st == KR_OK) {
                        all.len += len; /* only counted: appending would allocate under the injection */
                    }
                }
                kr_alloc_fail_at(0, 0);
                const bool fired = kr_alloc_failures() != f0;
                if (st != KR_OK) {
                    cr_assert(fired, "%s: failed without an injected failure: %s", dirs[k], err.msg);
                    cr_assert_eq(st, KR_ERR_NOMEM, "%s, allocation %llu: status %d: %s", dirs[k],
                                 (unsigned long long)at, st, err.msg);
                }
                if (d) {
                    const char *piece;
                    size_t len;
                    kr_detok_flush(d, &piece, &len, &err);
                    kr_detok_destroy(d);
                }
                cr_assert_eq(kr_alloc_bytes_in_use(), base, "%s, allocation %llu: %lld bytes left", dirs[k],
                             (unsigned long long)at, (long long)(kr_alloc_bytes_in_use() - base));
                if (!fired) {
                    cr_expect_eq(all.len, json_string_length(want), "%s: the stream's length differs from HF's",
                                 dirs[k]);
                    break;
                }
            }
        }
        kr_tokenizer_free(t);
        kr_free(ids);
        json_decref(exp);
    }
}
