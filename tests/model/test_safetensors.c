#define _POSIX_C_SOURCE 200809L

#include "safetensors.h"

#include "alloc.h"

#include <criterion/criterion.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Every checkpoint here is written by hand: an 8-byte little-endian header length, the header JSON
 * text and the data bytes. Expected values (offsets, shapes, bytes) are the ones written. */

/* ---- fixture --------------------------------------------------------------------------------- */

static char g_dir[64]; /* fresh temp directory of the test */
static size_t g_base;  /* kr_alloc_bytes_in_use() before the test */

static void rm_tree(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) {
        return;
    }
    const struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) {
            continue;
        }
        char p[512];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        struct stat sb;
        if (lstat(p, &sb) == 0 && S_ISDIR(sb.st_mode)) {
            rm_tree(p);
        } else {
            unlink(p);
        }
    }
    closedir(d);
    rmdir(dir);
}

static void setup(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/kr_st_test_XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
    g_base = kr_alloc_bytes_in_use();
}

/* True when /proc/self/maps still maps a file of the temp directory. */
static bool dir_still_mapped(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) {
        return false;
    }
    char line[1024];
    bool found = false;
    while (fgets(line, sizeof line, f)) {
        if (strstr(line, g_dir)) {
            found = true;
        }
    }
    fclose(f);
    return found;
}

static void teardown(void)
{
    cr_expect_eq(kr_alloc_bytes_in_use(), g_base, "host memory leaked: %zu bytes",
                 kr_alloc_bytes_in_use() - g_base);
    cr_expect(!dir_still_mapped(), "a mapping of %s is left", g_dir);
    rm_tree(g_dir);
}

TestSuite(safetensors, .init = setup, .fini = teardown);

/* ---- writers --------------------------------------------------------------------------------- */

static void path_of(char *buf, size_t size, const char *name)
{
    snprintf(buf, size, "%s/%s", g_dir, name);
}

static void write_raw(const char *name, const void *bytes, size_t n)
{
    char p[256];
    path_of(p, sizeof p, name);
    FILE *f = fopen(p, "wb");
    cr_assert_not_null(f, "cannot create %s", p);
    cr_assert_eq(fwrite(bytes, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

static void put_u64le(unsigned char *dst, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        dst[i] = (unsigned char)(v >> (8 * i));
    }
}

/* Writes a safetensors file whose length field says `hlen` (which may lie), then the header text and
 * `n` data bytes. */
static void write_st_hlen(const char *name, uint64_t hlen, const char *header, const void *data, size_t n)
{
    size_t hl = strlen(header);
    unsigned char *buf = malloc(8 + hl + n + 1);
    cr_assert_not_null(buf);
    put_u64le(buf, hlen);
    memcpy(buf + 8, header, hl);
    if (n) {
        memcpy(buf + 8 + hl, data, n);
    }
    write_raw(name, buf, 8 + hl + n);
    free(buf);
}

static void write_st(const char *name, const char *header, const void *data, size_t n)
{
    write_st_hlen(name, strlen(header), header, data, n);
}

/* n bytes 0, 1, 2, ... (mod 256) */
static unsigned char *pattern(size_t n)
{
    unsigned char *p = malloc(n ? n : 1);
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i++) {
        p[i] = (unsigned char)i;
    }
    return p;
}

static struct kr_st_archive *open_file_ok(const char *name)
{
    char p[256];
    path_of(p, sizeof p, name);
    struct kr_st_archive *ar = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_st_open_file(p, &ar, &err);
    cr_assert_eq(st, KR_OK, "open %s: %s", p, err.msg);
    cr_assert_not_null(ar);
    return ar;
}

/* Opens `name` (kr_st_open_file) or the directory (name == NULL, kr_st_open_dir) and expects status
 * `want` and a message containing each non-NULL needle. */
static void expect_open_error(const char *name, enum kr_status want, const char *n1, const char *n2,
                              const char *n3)
{
    char p[256];
    struct kr_st_archive *ar = (struct kr_st_archive *)&ar; /* poison: must come back NULL */
    struct kr_err err = {0};
    enum kr_status st;
    if (name) {
        path_of(p, sizeof p, name);
        st = kr_st_open_file(p, &ar, &err);
    } else {
        st = kr_st_open_dir(g_dir, &ar, &err);
    }
    cr_log_info("%s", err.msg); /* shown with --verbose */
    cr_expect_null(ar);
    cr_assert_eq(st, want, "got status %d (%s), want %d; message: %s", st, kr_status_str(st), want, err.msg);
    const char *needles[] = {n1, n2, n3};
    for (int i = 0; i < 3; i++) {
        if (needles[i]) {
            cr_expect(strstr(err.msg, needles[i]) != NULL, "message \"%s\" lacks \"%s\"", err.msg,
                      needles[i]);
        }
    }
}

/* Writes bad.safetensors with `header` and `n` pattern bytes, then expects an error naming the file
 * and the tensor (and `what` when non-NULL). */
static void expect_header_error(const char *header, size_t n, enum kr_status want, const char *tensor,
                                const char *what)
{
    unsigned char *data = pattern(n);
    write_st("bad.safetensors", header, data, n);
    free(data);
    expect_open_error("bad.safetensors", want, "bad.safetensors", tensor, what);
}

/* ---- valid files ----------------------------------------------------------------------------- */

/* Header of 3 tensors in a deliberately unsorted order; data area of 28 bytes. */
static const char k_three[] =
    "{\"__metadata__\": {\"format\": \"pt\"}, "
    "\"model.b.weight\": {\"dtype\": \"BF16\", \"shape\": [2, 3], \"data_offsets\": [0, 12]}, "
    "\"model.a.bias\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [12, 24]}, "
    "\"model.c\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [24, 28]}}";

Test(safetensors, opens_single_file_with_bf16_f16_f32)
{
    unsigned char *data = pattern(28);
    const float f32[3] = {1.5f, -2.0f, 3.25f};
    memcpy(data + 12, f32, sizeof f32);
    write_st("model.safetensors", k_three, data, 28);

    struct kr_st_archive *ar = open_file_ok("model.safetensors");
    cr_assert_eq(ar->n_files, 1);
    cr_assert_eq(ar->n_tensors, 3);
    cr_expect_str_eq(ar->tensors[0].name, "model.a.bias", "sorted by name");
    cr_expect_str_eq(ar->tensors[1].name, "model.b.weight");
    cr_expect_str_eq(ar->tensors[2].name, "model.c");
    cr_expect(strstr(ar->files[0].path, "model.safetensors") != NULL);
    cr_expect_eq(ar->files[0].map_size, 8 + strlen(k_three) + 28);
    const char *area = (const char *)ar->files[0].map + 8 + strlen(k_three);

    struct kr_st_tensor *b = kr_st_find(ar, "model.b.weight");
    cr_assert_not_null(b);
    cr_expect_eq(b->dtype, KR_DTYPE_BF16);
    cr_expect_eq(b->n_dim, 2);
    cr_expect_eq(b->shape[0], 2);
    cr_expect_eq(b->shape[1], 3);
    cr_expect_eq(b->n_elem, 6);
    cr_expect_eq(b->nbytes, 12);
    cr_expect_eq(b->data, area + 0);
    cr_expect(memcmp(b->data, data, 12) == 0);
    cr_expect_eq(b->file, &ar->files[0]);
    cr_expect(!b->used);

    struct kr_st_tensor *a = kr_st_find(ar, "model.a.bias");
    cr_assert_not_null(a);
    cr_expect_eq(a->dtype, KR_DTYPE_F32);
    cr_expect_eq(a->n_dim, 1);
    cr_expect_eq(a->shape[0], 3);
    cr_expect_eq(a->nbytes, 12);
    cr_expect_eq(a->data, area + 12);
    float got[3];
    memcpy(got, a->data, sizeof got);
    cr_expect_eq(got[0], 1.5f);
    cr_expect_eq(got[1], -2.0f);
    cr_expect_eq(got[2], 3.25f);

    struct kr_st_tensor *c = kr_st_find(ar, "model.c");
    cr_assert_not_null(c);
    cr_expect_eq(c->dtype, KR_DTYPE_F16);
    cr_expect_eq(c->n_elem, 2);
    cr_expect_eq(c->nbytes, 4);
    cr_expect_eq(c->data, area + 24);
    cr_expect(memcmp(c->data, data + 24, 4) == 0);

    cr_expect_null(kr_st_find(ar, "model.d"));
    cr_expect_null(kr_st_find(ar, "model.a"));
    cr_expect_null(kr_st_find(ar, "__metadata__"));
    cr_expect_null(kr_st_find(ar, ""));
    kr_st_close(ar);
    free(data);
}

Test(safetensors, opens_dir_with_one_file)
{
    unsigned char *data = pattern(28);
    write_st("whatever-name.safetensors", k_three, data, 28);
    write_raw("config.json", "{}", 2);
    struct kr_st_archive *ar = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_st_open_dir(g_dir, &ar, &err), KR_OK, "%s", err.msg);
    cr_expect_eq(ar->n_tensors, 3);
    cr_expect(strstr(ar->files[0].path, "whatever-name.safetensors") != NULL);
    kr_st_close(ar);
    free(data);
}

Test(safetensors, finds_among_many_tensors)
{
    /* 200 F32 scalars named t000..t199 written in reverse order. */
    char header[200 * 80];
    size_t n = (size_t)snprintf(header, sizeof header, "{");
    for (int i = 199; i >= 0; i--) {
        int k = 199 - i; /* position in the data area */
        n += (size_t)snprintf(header + n, sizeof header - n,
                              "%s\"t%03d\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [%d, %d]}",
                              k ? ", " : "", i, 4 * k, 4 * k + 4);
    }
    snprintf(header + n, sizeof header - n, "}");
    unsigned char *data = pattern(800);
    write_st("m.safetensors", header, data, 800);
    struct kr_st_archive *ar = open_file_ok("m.safetensors");
    cr_assert_eq(ar->n_tensors, 200);
    for (int i = 0; i < 200; i++) {
        char name[8];
        snprintf(name, sizeof name, "t%03d", i);
        struct kr_st_tensor *t = kr_st_find(ar, name);
        cr_assert_not_null(t, "%s", name);
        cr_expect_str_eq(t->name, name);
        cr_expect_eq(t, &ar->tensors[i]);
        cr_expect(memcmp(t->data, data + 4 * (199 - i), 4) == 0, "%s", name);
    }
    kr_st_close(ar);
    free(data);
}

Test(safetensors, opens_scalar_tensor)
{
    const float x = 0.5f;
    write_st("s.safetensors", "{\"scale\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [0, 4]}}",
             &x, 4);
    struct kr_st_archive *ar = open_file_ok("s.safetensors");
    struct kr_st_tensor *t = kr_st_find(ar, "scale");
    cr_assert_not_null(t);
    cr_expect_eq(t->n_dim, 0);
    cr_expect_eq(t->n_elem, 1);
    cr_expect_eq(t->nbytes, 4);
    float got;
    memcpy(&got, t->data, 4);
    cr_expect_eq(got, 0.5f);
    kr_st_close(ar);
}

Test(safetensors, opens_other_supported_dtypes_and_empty_tensors)
{
    const char *h = "{\"q\": {\"dtype\": \"F8_E4M3\", \"shape\": [2, 2], \"data_offsets\": [0, 4]}, "
                    "\"i\": {\"dtype\": \"I32\", \"shape\": [1], \"data_offsets\": [4, 8]}, "
                    "\"l\": {\"dtype\": \"I64\", \"shape\": [1], \"data_offsets\": [8, 16]}, "
                    "\"e\": {\"dtype\": \"BF16\", \"shape\": [0, 4], \"data_offsets\": [8, 8]}}";
    unsigned char *data = pattern(16);
    write_st("d.safetensors", h, data, 16);
    struct kr_st_archive *ar = open_file_ok("d.safetensors");
    cr_assert_eq(ar->n_tensors, 4);
    const struct kr_st_tensor *q = kr_st_find(ar, "q"), *i = kr_st_find(ar, "i"), *l = kr_st_find(ar, "l");
    const struct kr_st_tensor *e = kr_st_find(ar, "e");
    cr_assert(q && i && l && e);
    cr_expect_eq(q->dtype, KR_DTYPE_F8_E4M3);
    cr_expect_eq(q->nbytes, 4);
    cr_expect_eq(i->dtype, KR_DTYPE_I32);
    cr_expect_eq(l->dtype, KR_DTYPE_I64);
    cr_expect_eq(l->nbytes, 8);
    cr_expect_eq(e->n_elem, 0);
    cr_expect_eq(e->nbytes, 0);
    cr_expect_eq(e->n_dim, 2);
    cr_expect_eq(e->shape[1], 4);
    kr_st_close(ar);
    free(data);
}

Test(safetensors, opens_zero_tensor_file)
{
    write_st("empty.safetensors", "{}", NULL, 0);
    struct kr_st_archive *ar = open_file_ok("empty.safetensors");
    cr_expect_eq(ar->n_tensors, 0);
    cr_expect_eq(ar->n_files, 1);
    cr_expect_null(kr_st_find(ar, "x"));
    kr_st_close(ar);

    /* Only metadata, header padded with spaces as writers do. */
    write_st("meta.safetensors", "{\"__metadata__\": {\"format\": \"pt\"}}      ", NULL, 0);
    ar = open_file_ok("meta.safetensors");
    cr_expect_eq(ar->n_tensors, 0);
    kr_st_close(ar);
}

Test(safetensors, close_null_is_noop)
{
    kr_st_close(NULL);
    cr_expect_null(kr_st_find(NULL, "x"));
}

/* ---- sharded --------------------------------------------------------------------------------- */

#define SHARD1 "model-00001-of-00002.safetensors"
#define SHARD2 "model-00002-of-00002.safetensors"

static const char k_shard1[] =
    "{\"lm_head.weight\": {\"dtype\": \"BF16\", \"shape\": [2, 2], \"data_offsets\": [0, 8]}, "
    "\"embed.weight\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 16]}}";
static const char k_shard2[] =
    "{\"__metadata__\": {\"format\": \"pt\"}, "
    "\"layers.0.w\": {\"dtype\": \"F16\", \"shape\": [3], \"data_offsets\": [0, 6]}}";

static void write_shards(void)
{
    unsigned char *data = pattern(16);
    write_st(SHARD1, k_shard1, data, 16);
    write_st(SHARD2, k_shard2, data + 8, 6);
    free(data);
}

static void write_index(const char *weight_map)
{
    char buf[4096];
    int n = snprintf(buf, sizeof buf, "{\"metadata\": {\"total_size\": 22}, \"weight_map\": %s}", weight_map);
    write_raw("model.safetensors.index.json", buf, (size_t)n);
}

static const char k_good_map[] = "{\"lm_head.weight\": \"" SHARD1 "\", \"layers.0.w\": \"" SHARD2 "\", "
                                 "\"embed.weight\": \"" SHARD1 "\"}";

Test(safetensors, opens_sharded_dir_with_index)
{
    write_shards();
    write_index(k_good_map);
    struct kr_st_archive *ar = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_st_open_dir(g_dir, &ar, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(ar->n_files, 2);
    cr_assert_eq(ar->n_tensors, 3);
    cr_expect_str_eq(ar->tensors[0].name, "embed.weight");
    cr_expect_str_eq(ar->tensors[1].name, "layers.0.w");
    cr_expect_str_eq(ar->tensors[2].name, "lm_head.weight");

    const struct kr_st_tensor *lm = kr_st_find(ar, "lm_head.weight");
    const struct kr_st_tensor *emb = kr_st_find(ar, "embed.weight");
    const struct kr_st_tensor *w = kr_st_find(ar, "layers.0.w");
    cr_assert(lm && emb && w);
    cr_expect(strstr(lm->file->path, SHARD1) != NULL);
    cr_expect(strstr(emb->file->path, SHARD1) != NULL);
    cr_expect(strstr(w->file->path, SHARD2) != NULL);
    cr_expect_eq(lm->file, emb->file);
    cr_expect_neq(lm->file, w->file);
    cr_expect(lm->file >= ar->files && lm->file < ar->files + 2);
    cr_expect(w->file >= ar->files && w->file < ar->files + 2);
    cr_expect_eq(lm->data, (const char *)lm->file->map + 8 + strlen(k_shard1));
    cr_expect_eq(emb->data, (const char *)emb->file->map + 8 + strlen(k_shard1) + 8);
    cr_expect_eq(w->data, (const char *)w->file->map + 8 + strlen(k_shard2));
    const unsigned char *wd = w->data;
    cr_expect(wd[0] == 8 && wd[5] == 13, "shard 2 holds pattern bytes 8..13");
    cr_expect_eq(w->dtype, KR_DTYPE_F16);
    kr_st_close(ar);
}

Test(safetensors, index_takes_precedence_over_glob_and_trailing_slash_is_fine)
{
    write_shards();
    write_index(k_good_map);
    char dir[128];
    snprintf(dir, sizeof dir, "%s/", g_dir);
    struct kr_st_archive *ar = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_st_open_dir(dir, &ar, &err), KR_OK, "%s", err.msg);
    cr_expect_eq(ar->n_tensors, 3);
    kr_st_close(ar);
}

Test(safetensors, rejects_index_tensor_missing_from_shard)
{
    write_shards();
    write_index("{\"lm_head.weight\": \"" SHARD1 "\", \"layers.0.w\": \"" SHARD2 "\", "
                "\"embed.weight\": \"" SHARD1 "\", \"layers.1.w\": \"" SHARD2 "\"}");
    expect_open_error(NULL, KR_ERR_FORMAT, "layers.1.w", SHARD2, "model.safetensors.index.json");
}

Test(safetensors, rejects_shard_tensor_missing_from_index)
{
    write_shards();
    write_index("{\"lm_head.weight\": \"" SHARD1 "\", \"layers.0.w\": \"" SHARD2 "\"}");
    expect_open_error(NULL, KR_ERR_FORMAT, "embed.weight", SHARD1, "model.safetensors.index.json");
}

Test(safetensors, rejects_tensor_in_other_shard_than_index_says)
{
    write_shards();
    write_index("{\"lm_head.weight\": \"" SHARD1 "\", \"layers.0.w\": \"" SHARD1 "\", "
                "\"embed.weight\": \"" SHARD1 "\"}");
    /* Only SHARD1 is named, so SHARD2 is never opened: layers.0.w is missing from SHARD1. */
    expect_open_error(NULL, KR_ERR_FORMAT, "layers.0.w", SHARD1, NULL);

    write_index("{\"lm_head.weight\": \"" SHARD2 "\", \"layers.0.w\": \"" SHARD2 "\", "
                "\"embed.weight\": \"" SHARD1 "\"}");
    expect_open_error(NULL, KR_ERR_FORMAT, "lm_head.weight", SHARD1, SHARD2);
}

Test(safetensors, rejects_duplicate_tensor_across_shards)
{
    unsigned char *data = pattern(16);
    write_st(SHARD1, k_shard1, data, 16);
    write_st(SHARD2, "{\"embed.weight\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}",
             data, 8);
    free(data);
    write_index("{\"lm_head.weight\": \"" SHARD1 "\", \"embed.weight\": \"" SHARD2 "\"}");
    expect_open_error(NULL, KR_ERR_FORMAT, "embed.weight", SHARD1, SHARD2);
}

Test(safetensors, rejects_missing_shard_file)
{
    write_shards();
    write_index("{\"lm_head.weight\": \"" SHARD1 "\", \"layers.0.w\": \"" SHARD2 "\", "
                "\"embed.weight\": \"" SHARD1 "\", \"x\": \"model-00003-of-00002.safetensors\"}");
    expect_open_error(NULL, KR_ERR_IO, "model-00003-of-00002.safetensors", "cannot open", NULL);
}

Test(safetensors, rejects_path_traversal_in_index)
{
    write_shards();
    write_index("{\"lm_head.weight\": \"../" SHARD1 "\"}");
    expect_open_error(NULL, KR_ERR_FORMAT, "lm_head.weight", "../" SHARD1, "model.safetensors.index.json");
    write_index("{\"lm_head.weight\": \"sub/" SHARD1 "\"}");
    expect_open_error(NULL, KR_ERR_FORMAT, "lm_head.weight", "sub/" SHARD1, NULL);
    write_index("{\"lm_head.weight\": \"/etc/passwd\"}");
    expect_open_error(NULL, KR_ERR_FORMAT, "lm_head.weight", "/etc/passwd", NULL);
    write_index("{\"lm_head.weight\": \"..\"}");
    expect_open_error(NULL, KR_ERR_FORMAT, "lm_head.weight", NULL, NULL);
}

Test(safetensors, rejects_malformed_index)
{
    write_shards();
    write_raw("model.safetensors.index.json", "{\"weight_map\": ", 15);
    expect_open_error(NULL, KR_ERR_FORMAT, "model.safetensors.index.json", "line 1 column 16", NULL);
    write_raw("model.safetensors.index.json", "{\"metadata\": {}}", 16);
    expect_open_error(NULL, KR_ERR_FORMAT, "model.safetensors.index.json", "weight_map", NULL);
    write_index("{\"lm_head.weight\": 3}");
    expect_open_error(NULL, KR_ERR_FORMAT, "model.safetensors.index.json", "lm_head.weight", NULL);
}

Test(safetensors, rejects_dir_without_checkpoint)
{
    write_raw("config.json", "{}", 2);
    expect_open_error(NULL, KR_ERR_IO, g_dir, "no *.safetensors file and no model.safetensors.index.json",
                      NULL);
}

Test(safetensors, rejects_missing_dir)
{
    struct kr_st_archive *ar = NULL;
    struct kr_err err = {0};
    cr_expect_eq(kr_st_open_dir("/nonexistent-krait-dir", &ar, &err), KR_ERR_IO);
    cr_expect_null(ar);
    cr_expect(strstr(err.msg, "/nonexistent-krait-dir") != NULL, "%s", err.msg);
}

Test(safetensors, rejects_several_files_without_index)
{
    write_shards();
    expect_open_error(NULL, KR_ERR_FORMAT, g_dir, "model.safetensors.index.json", NULL);
}

Test(safetensors, reports_oom_without_leaking)
{
    write_shards();
    write_index(k_good_map);
    for (uint64_t n = 1;; n++) {
        struct kr_st_archive *ar = NULL;
        struct kr_err err = {0};
        kr_alloc_fail_at(n, 0);
        enum kr_status st = kr_st_open_dir(g_dir, &ar, &err);
        kr_alloc_fail_at(0, 0);
        if (st == KR_OK) {
            cr_expect_gt(n, 1);
            cr_expect_eq(ar->n_tensors, 3);
            kr_st_close(ar);
            break;
        }
        cr_assert_eq(st, KR_ERR_NOMEM, "allocation %llu: %s", (unsigned long long)n, err.msg);
        cr_assert_null(ar);
        cr_assert_eq(kr_alloc_bytes_in_use(), g_base, "leak after failing allocation %llu",
                     (unsigned long long)n);
        cr_assert(!dir_still_mapped(), "mapping left after failing allocation %llu", (unsigned long long)n);
        cr_assert_lt(n, 1000);
    }
}

/* ---- file-level errors ----------------------------------------------------------------------- */

Test(safetensors, rejects_file_shorter_than_8_bytes)
{
    write_raw("bad.safetensors", "\x02\0\0\0\0", 5);
    expect_open_error("bad.safetensors", KR_ERR_FORMAT, "bad.safetensors", "8", NULL);
    write_raw("bad.safetensors", "", 0);
    expect_open_error("bad.safetensors", KR_ERR_FORMAT, "bad.safetensors", NULL, NULL);
}

Test(safetensors, rejects_missing_file)
{
    expect_open_error("nope.safetensors", KR_ERR_IO, "nope.safetensors", "cannot open", NULL);
}

Test(safetensors, rejects_header_length_beyond_file)
{
    write_st_hlen("bad.safetensors", 100, "{}", NULL, 0);
    expect_open_error("bad.safetensors", KR_ERR_FORMAT, "bad.safetensors", "header length 100", NULL);
}

Test(safetensors, rejects_absurd_header_length)
{
    write_st_hlen("bad.safetensors", UINT64_MAX, "{}", NULL, 0);
    expect_open_error("bad.safetensors", KR_ERR_FORMAT, "bad.safetensors", "header length", NULL);
    write_st_hlen("bad.safetensors", UINT64_MAX - 7, "{}", NULL, 0); /* 8 + N wraps to 0 */
    expect_open_error("bad.safetensors", KR_ERR_FORMAT, "bad.safetensors", "header length", NULL);
}

Test(safetensors, rejects_invalid_json_header)
{
    expect_header_error("{\"w\": {\"dtype\": \"F32\",}}", 0, KR_ERR_FORMAT, "line 1 column 23", NULL);
    expect_header_error("", 0, KR_ERR_FORMAT, "line 1 column 1", NULL);
}

Test(safetensors, rejects_non_object_header)
{
    expect_header_error("[1, 2]", 0, KR_ERR_FORMAT, "array", "object");
}

Test(safetensors, rejects_non_object_entry)
{
    expect_header_error("{\"layer.w\": 5}", 0, KR_ERR_FORMAT, "layer.w", "object");
    expect_header_error("{\"layer.w\": [\"F32\", [1], [0, 4]]}", 4, KR_ERR_FORMAT, "layer.w", "object");
}

Test(safetensors, rejects_entry_without_dtype_shape_or_offsets)
{
    expect_header_error("{\"layer.w\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", 4, KR_ERR_FORMAT,
                        "layer.w", "dtype");
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", 4, KR_ERR_FORMAT,
                        "layer.w", "shape");
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [1]}}", 4, KR_ERR_FORMAT, "layer.w",
                        "data_offsets");
}

Test(safetensors, rejects_wrong_json_types_in_entry)
{
    expect_header_error("{\"layer.w\": {\"dtype\": 4, \"shape\": [1], \"data_offsets\": [0, 4]}}", 4,
                        KR_ERR_FORMAT, "layer.w", "dtype");
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": \"1\", \"data_offsets\": [0, 4]}}", 4,
                        KR_ERR_FORMAT, "layer.w", "shape");
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [\"1\"], \"data_offsets\": [0, 4]}}",
                        4, KR_ERR_FORMAT, "layer.w", "shape");
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}}", 4,
                        KR_ERR_FORMAT, "layer.w", "shape");
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": {\"a\": 0}}}",
                        4, KR_ERR_FORMAT, "layer.w", "data_offsets");
}

Test(safetensors, rejects_unsupported_dtypes)
{
    const char *names[] = {"BOOL", "U8", "I8", "I16", "U16", "F64", "U64", "F8_E5M2", "f32", "XYZ"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char h[256];
        snprintf(h, sizeof h, "{\"layer.w\": {\"dtype\": \"%s\", \"shape\": [8], \"data_offsets\": [0, 8]}}",
                 names[i]);
        expect_header_error(h, 8, KR_ERR_UNSUPPORTED, "layer.w", names[i]);
        expect_header_error(h, 8, KR_ERR_UNSUPPORTED, "layer.w", "F32 F16 BF16 F8_E4M3 I32 I64");
    }
}

Test(safetensors, rejects_negative_dims)
{
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [2, -1], \"data_offsets\": [0, 4]}}",
                        4, KR_ERR_FORMAT, "layer.w", "shape[1]");
}

Test(safetensors, rejects_too_many_dims)
{
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [1, 1, 1, 1, 1, 1, 1, 1, 1], "
                        "\"data_offsets\": [0, 4]}}",
                        4, KR_ERR_UNSUPPORTED, "layer.w", "9 dimensions");
    /* exactly KR_ST_MAX_DIMS is fine */
    const char *ok = "{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [1, 1, 1, 1, 1, 1, 1, 2], "
                     "\"data_offsets\": [0, 8]}}";
    unsigned char *data = pattern(8);
    write_st("ok.safetensors", ok, data, 8);
    free(data);
    struct kr_st_archive *ar = open_file_ok("ok.safetensors");
    cr_expect_eq(ar->tensors[0].n_dim, 8);
    cr_expect_eq(ar->tensors[0].shape[7], 2);
    kr_st_close(ar);
}

Test(safetensors, rejects_element_count_overflow)
{
    /* 2^32 * 2^32 > INT64_MAX */
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], "
                        "\"data_offsets\": [0, 4]}}",
                        4, KR_ERR_FORMAT, "layer.w", "overflow");
    /* fits int64 elements, but not bytes: 2^62 F32 elements */
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [4611686018427387904], "
                        "\"data_offsets\": [0, 4]}}",
                        4, KR_ERR_FORMAT, "layer.w", "overflow");
}

Test(safetensors, rejects_malformed_data_offsets)
{
    const char *offs[] = {"[0]",     "[0, 4, 8]",  "[]",        "[0, 4.5]",
                          "[-1, 4]", "[0, \"4\"]", "[0, null]", "[0, 1e30]"};
    for (size_t i = 0; i < sizeof offs / sizeof offs[0]; i++) {
        char h[256];
        snprintf(h, sizeof h, "{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": %s}}",
                 offs[i]);
        expect_header_error(h, 8, KR_ERR_FORMAT, "layer.w", "data_offsets");
    }
}

Test(safetensors, rejects_begin_after_end)
{
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 4]}}", 8,
                        KR_ERR_FORMAT, "layer.w", "begin 8 > end 4");
}

Test(safetensors, rejects_truncated_file)
{
    expect_header_error(
        "{\"a.ok\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
        "\"layer.w\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [4, 20]}}",
        12, KR_ERR_FORMAT, "layer.w",
        "truncated: tensor \"layer.w\" needs bytes [4, 20) of the data area but the file has only 12");
    /* Short by one byte. */
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 3,
                        KR_ERR_FORMAT, "layer.w", "the file has only 3");
}

Test(safetensors, rejects_byte_size_mismatch)
{
    expect_header_error("{\"layer.w\": {\"dtype\": \"BF16\", \"shape\": [2, 3], \"data_offsets\": [0, 24]}}",
                        24, KR_ERR_FORMAT, "layer.w", "12");
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [0, 0]}}", 4,
                        KR_ERR_FORMAT, "layer.w", "4");
}

Test(safetensors, rejects_overlapping_tensors)
{
    expect_header_error("{\"layer.a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}, "
                        "\"layer.z\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [12, 16]}, "
                        "\"layer.b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}",
                        16, KR_ERR_FORMAT, "layer.a", "layer.b");
    /* Overlapping by a single byte. */
    expect_header_error("{\"layer.p\": {\"dtype\": \"F8_E4M3\", \"shape\": [4], \"data_offsets\": [0, 4]}, "
                        "\"layer.q\": {\"dtype\": \"F8_E4M3\", \"shape\": [4], \"data_offsets\": [3, 7]}}",
                        8, KR_ERR_FORMAT, "layer.p", "layer.q");
    /* Contained entirely in an earlier, longer tensor. */
    expect_header_error("{\"layer.big\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}, "
                        "\"layer.in\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 12]}}",
                        16, KR_ERR_FORMAT, "layer.big", "layer.in");
    /* A later tensor overlapping a long one though not the one just before it. */
    expect_header_error("{\"layer.big\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}, "
                        "\"layer.mid\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}, "
                        "\"layer.end\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [12, 16]}}",
                        16, KR_ERR_FORMAT, "layer.big", "layer.mid");
}

Test(safetensors, allows_adjacent_and_empty_tensors)
{
    const char *h = "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
                    "\"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}, "
                    "\"c\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [4, 4]}, "
                    "\"d\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [2, 2]}}";
    unsigned char *data = pattern(8);
    write_st("ok.safetensors", h, data, 8);
    free(data);
    struct kr_st_archive *ar = open_file_ok("ok.safetensors");
    cr_expect_eq(ar->n_tensors, 4);
    kr_st_close(ar);
}

Test(safetensors, rejects_duplicate_names_in_one_header)
{
    expect_header_error("{\"layer.w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
                        "\"layer.w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
                        8, KR_ERR_FORMAT, "layer.w", "twice");
}
