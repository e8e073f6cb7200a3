#define _POSIX_C_SOURCE 200809L
/* Tokenizer throughput: encode (krait vs HF tokenizers on the same text in the same run), then
 * decode and streaming detokenization.
 *
 *   bench_tokenizer [TOKENIZER_DIR] [MB] [--no-hf]
 *
 * Builds MB (default 4) of text by repeating tests/fixtures/tokenizer/corpus.json's texts, encodes
 * it with krait (best of 3 runs, one thread), then runs
 * tools/reference/tokenizer/bench_hf.mjs (HF tokenizers' Rust core through node) on the same text
 * file when node and the npm packages are installed (unless --no-hf), and prints both figures in
 * MB/s. Then the ids are decoded in full (MB/s) and streamed through kr_detok_* as the server does
 * for each generated token of each choice: one stream of all the ids, and streams of 256 ids
 * (create, 256 pushes, flush, destroy), in ns per id; the streamed text must equal the full decode. */
#include "alloc.h"
#include "clock.h"
#include "tokenizer.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Streams ids[0..n) through one detokenizer per `per` ids (0: one for all), appending the pieces to
 * out (n bytes of room, grown as needed). Returns the seconds taken, or -1 on an error. */
static double stream(const struct kr_tokenizer *tok, const int32_t *ids, int64_t n, int64_t per, char **out,
                     size_t *out_len, size_t *out_cap)
{
    struct kr_err err = {0};
    *out_len = 0;
    double t0 = kr_clock_s();
    for (int64_t at = 0; at < n;) {
        int64_t end = per > 0 && at + per < n ? at + per : n;
        struct kr_detok *d;
        if (kr_detok_create(tok, true, &d) != KR_OK) {
            return -1;
        }
        for (int64_t i = at; i <= end; i++) {
            const char *piece;
            size_t plen;
            enum kr_status st = i < end ? kr_detok_push(d, ids[i], &piece, &plen, &err)
                                        : kr_detok_flush(d, &piece, &plen, &err);
            if (st != KR_OK) {
                fprintf(stderr, "detokenizer: %s\n", err.msg);
                kr_detok_destroy(d);
                return -1;
            }
            if (*out_len + plen > *out_cap) {
                size_t cap = (*out_len + plen) * 2;
                char *p = kr_realloc(*out, cap);
                if (!p) {
                    kr_detok_destroy(d);
                    return -1;
                }
                *out = p;
                *out_cap = cap;
            }
            memcpy(*out + *out_len, piece, plen);
            *out_len += plen;
        }
        kr_detok_destroy(d);
        at = end;
    }
    return kr_clock_s() - t0;
}

/* Full decode (MB/s) and streaming (ns per id) of the encoded ids; the streams must give the full
 * decode's text (for per-256 streams, the decodes of those 256-id pieces). */
static int bench_decode(const struct kr_tokenizer *tok, const int32_t *ids, int64_t n_ids)
{
    struct kr_err err = {0};
    char *full = NULL;
    size_t full_len = 0;
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        kr_free(full);
        double t0 = kr_clock_s();
        if (kr_tokenizer_decode(tok, ids, n_ids, true, &full, &full_len, &err) != KR_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
        double dt = kr_clock_s() - t0;
        best = dt < best ? dt : best;
    }
    printf("krait decode: %lld ids -> %.2f MB, %.3f s, %.2f MB/s (best of 3)\n", (long long)n_ids,
           (double)full_len / 1e6, best, (double)full_len / 1e6 / best);
    size_t cap = full_len + 1, got = 0;
    char *out = kr_malloc(cap);
    static const int64_t pers[] = {0, 256};
    for (size_t k = 0; k < sizeof pers / sizeof pers[0]; k++) {
        double dt = 1e30;
        for (int r = 0; r < 3; r++) {
            double t = stream(tok, ids, n_ids, pers[k], &out, &got, &cap);
            if (t < 0) {
                return 1;
            }
            dt = t < dt ? t : dt;
        }
        bool same = got == full_len && memcmp(out, full, full_len) == 0;
        if (pers[k] == 0 && !same) {
            fprintf(stderr, "the streamed text differs from the full decode\n");
            return 1;
        }
        printf("krait stream (%s): %.3f s, %.0f ns/id (best of 3)\n",
               pers[k] == 0 ? "one stream of all ids" : "streams of 256 ids, create to destroy", dt,
               dt * 1e9 / (double)n_ids);
    }
    kr_free(out);
    kr_free(full);
    return 0;
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : KR_SOURCE_DIR "/tests/fixtures/tokenizer/deepseek_v3";
    double mb = argc > 2 ? atof(argv[2]) : 4.0;
    const bool hf = !(argc > 3 && strcmp(argv[3], "--no-hf") == 0);
    json_t *corpus = json_load_file(KR_SOURCE_DIR "/tests/fixtures/tokenizer/corpus.json", 0, NULL);
    if (!corpus) {
        fprintf(stderr, "cannot read corpus.json\n");
        return 1;
    }
    const json_t *texts = json_object_get(corpus, "texts");
    size_t want = (size_t)(mb * 1e6), len = 0;
    char *text = kr_malloc(want + 65536);
    for (size_t i = 0; len < want; i = (i + 1) % json_array_size(texts)) {
        const json_t *t = json_array_get(texts, i);
        memcpy(text + len, json_string_value(t), json_string_length(t));
        len += json_string_length(t);
        text[len++] = '\n';
    }
    const char *path = "/tmp/krait_bench_tokenizer.txt";
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(text, 1, len, f) != len) {
        fprintf(stderr, "cannot write %s\n", path);
        return 1;
    }
    fclose(f);
    struct kr_tokenizer *tok;
    struct kr_err err = {0};
    if (kr_tokenizer_load(dir, NULL, &tok, &err) != KR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    double best = 1e30;
    int64_t n_ids = 0;
    int32_t *ids = NULL;
    for (int r = 0; r < 3; r++) {
        kr_free(ids);
        double t0 = kr_clock_s();
        if (kr_tokenizer_encode(tok, text, len, false, &ids, &n_ids, &err) != KR_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
        double dt = kr_clock_s() - t0;
        best = dt < best ? dt : best;
    }
    printf("text: %.2f MB (%s), tokenizer: %s\n", (double)len / 1e6, path, dir);
    printf("krait: %lld ids, %.3f s, %.2f MB/s (best of 3, 1 thread)\n", (long long)n_ids, best, (double)len / 1e6 / best);
    fflush(stdout);
    if (bench_decode(tok, ids, n_ids) != 0) {
        return 1;
    }
    kr_free(ids);
    if (!hf) {
        kr_tokenizer_free(tok);
        kr_free(text);
        json_decref(corpus);
        return 0;
    }
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), "node %s/tools/reference/tokenizer/bench_hf.mjs %s/tokenizer.json %s", KR_SOURCE_DIR, dir,
             path);
    if (system(cmd) != 0) {
        printf("HF: not measured (needs node and `npm install` in tools/reference/tokenizer)\n");
    }
    kr_tokenizer_free(tok);
    kr_free(text);
    json_decref(corpus);
    return 0;
}
