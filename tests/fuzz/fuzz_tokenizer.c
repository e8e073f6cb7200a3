/* libFuzzer harness for the tokenizer (api/tokenizer/).
 *
 * Input: a selector byte, a mode byte, then the payload. The selector picks one of the tokenizers
 * loaded once at start (the fixtures under tests/fixtures/tokenizer and models/tiny-hybrid).
 *   mode bit 0 clear: the payload is text: it is encoded (bit 1: with special tokens), and the ids
 *       it gives are decoded as below.
 *   mode bit 0 set: the payload is little-endian 16-bit ids, taken modulo n_vocab + 8 so that some
 *       name no token.
 * The ids are then decoded in full and through the streaming detokenizer (bit 2: skipping special
 * tokens), and the pieces the stream gives must concatenate to exactly the full decode, each piece
 * whole UTF-8 characters. Each id's token bytes and piece are looked up too.
 *
 * Anything may fail with an error; nothing may crash, leak, or break that property. */
#define _POSIX_C_SOURCE 200809L

#include "tokenizer.h"

#include "alloc.h"
#include "fuzz.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* fuzz-max-len: 512 (tools/fuzz.sh passes it as -max_len) */

#define MAX_IDS 512

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const TOKENIZERS[] = {
    "tests/fixtures/tokenizer/llama2",
    "tests/fixtures/tokenizer/llama3",
    "tests/fixtures/tokenizer/deepseek_v3",
    "models/tiny-hybrid",
    "tests/fixtures/tokenizer/synth/bert_pretok",
    "tests/fixtures/tokenizer/synth/bytelevel_prefix",
    "tests/fixtures/tokenizer/synth/metaspace_first",
    "tests/fixtures/tokenizer/synth/metaspace_never",
    "tests/fixtures/tokenizer/synth/split_empty",
    "tests/fixtures/tokenizer/synth/split_invert",
    "tests/fixtures/tokenizer/synth/split_merged",
    "tests/fixtures/tokenizer/synth/subword",
    "tests/fixtures/tokenizer/synth/whitespace",
};
#define N_TOKENIZERS (sizeof TOKENIZERS / sizeof TOKENIZERS[0])

static struct kr_tokenizer *g_tok[N_TOKENIZERS];
/* one detokenizer per tokenizer and skip flag, reused across inputs (a flush empties it) */
static struct kr_detok *g_detok[N_TOKENIZERS][2];

static void fail(const char *what, size_t which)
{
    fprintf(stderr, "fuzz_tokenizer (%s): %s\n", TOKENIZERS[which], what);
    abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *dir = kr_fuzz_source_dir();
    for (size_t i = 0; i < N_TOKENIZERS; i++) {
        char path[4096];
        struct kr_err err = {0};
        snprintf(path, sizeof path, "%s/%s", dir, TOKENIZERS[i]);
        if (kr_tokenizer_load(path, NULL, &g_tok[i], &err) != KR_OK) {
            fprintf(stderr, "fuzz_tokenizer: %s: %s\n", path, err.msg);
            abort();
        }
        for (int skip = 0; skip < 2; skip++) {
            if (kr_detok_create(g_tok[i], skip, &g_detok[i][skip]) != KR_OK) {
                abort();
            }
        }
    }
    return 0;
}

static bool utf8_whole(const char *s, size_t n)
{
    /* a piece ends on a character boundary: its last lead byte's sequence is complete */
    size_t i = n;
    while (i > 0 && ((unsigned char)s[i - 1] & 0xC0) == 0x80) {
        i--;
    }
    if (i == 0) {
        return n == 0;
    }
    unsigned char c = (unsigned char)s[i - 1];
    size_t want = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return n - (i - 1) == want;
}

static void decode_both(size_t which, const int32_t *ids, int64_t n_ids, bool skip)
{
    const struct kr_tokenizer *tok = g_tok[which];
    struct kr_err err = {0};
    char *full = NULL;
    size_t full_len = 0;
    if (kr_tokenizer_decode(tok, ids, n_ids, skip, &full, &full_len, &err) != KR_OK) {
        return; /* out of memory, or a decoder regex over its limit */
    }
    if (!full || full[full_len] != '\0') {
        fprintf(stderr, "%lld ids gave %s of %zu bytes\n", (long long)n_ids, full ? "text" : "NULL", full_len);
        fail("a decode is not a NUL-terminated text of its length", which);
    }
    struct kr_detok *d = g_detok[which][skip];
    char *streamed = kr_malloc(full_len + 1);
    size_t at = 0;
    bool ok = streamed != NULL;
    for (int64_t i = 0; ok && i <= n_ids; i++) {
        const char *piece;
        size_t len;
        enum kr_status st = i < n_ids ? kr_detok_push(d, ids[i], &piece, &len, &err)
                                      : kr_detok_flush(d, &piece, &len, &err);
        if (st == KR_ERR_NOMEM) {
            ok = false;
            break;
        }
        if (st != KR_OK) {
            fprintf(stderr, "id %lld of %lld: %s\n", (long long)i, (long long)n_ids, err.msg);
            fail("the detokenizer failed where the full decode did not", which);
        }
        if (i < n_ids && !utf8_whole(piece, len)) {
            fail("a streamed piece splits a character", which);
        }
        if (len > full_len - at) {
            fprintf(stderr, "streamed %zu + %zu bytes, the full decode has %zu\n", at, len, full_len);
            fail("the stream gives more text than the full decode", which);
        }
        memcpy(streamed + at, piece, len);
        at += len;
    }
    if (ok && (at != full_len || memcmp(streamed, full, full_len) != 0)) {
        fprintf(stderr, "full:     %.*s\nstreamed: %.*s\n", (int)full_len, full, (int)at, streamed);
        fail("the streamed pieces differ from the full decode", which);
    }
    if (!ok) {
        const char *piece;
        size_t len;
        kr_detok_flush(d, &piece, &len, &err); /* leave it empty for the next input */
    }
    kr_free(streamed);
    kr_free(full);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2) {
        return 0;
    }
    size_t which = data[0] % N_TOKENIZERS;
    uint8_t mode = data[1];
    const struct kr_tokenizer *tok = g_tok[which];
    const char *payload = (const char *)data + 2;
    size_t n = size - 2;
    bool skip = (mode & 4) != 0;
    if (!(mode & 1)) {
        int32_t *ids = NULL;
        int64_t n_ids = 0;
        struct kr_err err = {0};
        enum kr_status st = kr_tokenizer_encode(tok, payload, n, (mode & 2) != 0, &ids, &n_ids, &err);
        if (st == KR_OK) {
            for (int64_t i = 0; i < n_ids; i++) {
                if (ids[i] < 0 || ids[i] >= kr_tokenizer_n_vocab(tok)) {
                    fail("encode gave an id outside the vocabulary", which);
                }
            }
            decode_both(which, ids, n_ids, skip);
        } else if (st != KR_ERR_INVAL && st != KR_ERR_NOMEM) {
            fprintf(stderr, "status %d: %s\n", (int)st, err.msg);
            fail("encode failed with an unexpected status", which);
        }
        kr_free(ids);
        return 0;
    }
    int32_t ids[MAX_IDS];
    int64_t n_ids = 0;
    const int64_t span = (int64_t)kr_tokenizer_n_vocab(tok) + 8;
    for (size_t i = 0; i + 1 < n && n_ids < MAX_IDS; i += 2) {
        uint32_t raw = (uint32_t)(uint8_t)payload[i] | (uint32_t)(uint8_t)payload[i + 1] << 8;
        /* spread 16 bits over the vocabulary: the high ids (special tokens) are reachable too */
        ids[n_ids++] = (int32_t)((int64_t)raw * span / 65536) - 4;
    }
    decode_both(which, ids, n_ids, skip);
    for (int64_t i = 0; i < n_ids && i < 8; i++) {
        char *bytes = NULL;
        size_t len = 0;
        struct kr_err err = {0};
        if (kr_tokenizer_token_bytes(tok, ids[i], &bytes, &len, &err) == KR_OK) {
            kr_free(bytes);
        }
        size_t plen = 0;
        const char *piece = kr_tokenizer_id_to_piece(tok, ids[i], &plen);
        if (piece && kr_tokenizer_piece_to_id(tok, piece, plen) < 0) {
            fail("a token's piece names no token", which);
        }
    }
    return 0;
}
