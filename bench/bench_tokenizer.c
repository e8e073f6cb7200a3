#define _POSIX_C_SOURCE 200809L
/* Tokenizer encode throughput: krait vs HF tokenizers on the same text in the same run.
 *
 *   bench_tokenizer [TOKENIZER_DIR] [MB]
 *
 * Builds MB (default 4) of text by repeating tests/fixtures/tokenizer/corpus.json's texts, encodes
 * it with krait (best of 3 runs, one thread), then runs
 * tools/reference/tokenizer/bench_hf.mjs (HF tokenizers' Rust core through node) on the same text
 * file when node and the npm packages are installed, and prints both figures in MB/s. */
#include "alloc.h"
#include "clock.h"
#include "tokenizer.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : KR_SOURCE_DIR "/tests/fixtures/tokenizer/deepseek_v3";
    double mb = argc > 2 ? atof(argv[2]) : 4.0;
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
    for (int r = 0; r < 3; r++) {
        int32_t *ids;
        double t0 = kr_clock_s();
        if (kr_tokenizer_encode(tok, text, len, false, &ids, &n_ids, &err) != KR_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
        double dt = kr_clock_s() - t0;
        best = dt < best ? dt : best;
        kr_free(ids);
    }
    printf("text: %.2f MB (%s), tokenizer: %s\n", (double)len / 1e6, path, dir);
    printf("krait: %lld ids, %.3f s, %.2f MB/s (best of 3, 1 thread)\n", (long long)n_ids, best, (double)len / 1e6 / best);
    fflush(stdout);
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
