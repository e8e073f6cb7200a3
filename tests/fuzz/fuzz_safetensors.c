/* Fuzz harness: opening a safetensors checkpoint (model/safetensors.c): the 8-byte header length,
 * the JSON header, every tensor entry, and the sharded layout's model.safetensors.index.json with
 * its shards. The input is written as files of a private temporary directory and opened with
 * kr_st_open_dir, as `krait serve DIR` opens a checkpoint:
 *   - an input whose first byte is even is one file, DIR/model.safetensors: the bytes after the
 *     first;
 *   - otherwise the bytes after the first are split at each "\n#shard\n": the first part is
 *     DIR/model.safetensors.index.json, the next ones (at most 4) DIR/s1.safetensors,
 *     DIR/s2.safetensors, ... (an index names them so).
 * An archive that opens must keep its promises: tensors sorted by name without duplicates, each
 * found by kr_st_find, each inside its file's data area with nbytes = n_elem * dtype size. */
#define _POSIX_C_SOURCE 200809L

/* fuzz-max-len: 16384 (tools/fuzz.sh passes it as -max_len) */
#include "fuzz.h"

#include "dtype.h"
#include "log.h"
#include "safetensors.h"

#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define MAX_SHARDS 4

static const char k_sep[] = "\n#shard\n";
static char g_dir[256];

/* Removes the directory at exit (the files are removed after each input). */
static void remove_dir(void)
{
    rmdir(g_dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kr_log_set_level(KR_LOG_LEVEL_ERROR);
    /* /dev/shm when present: one write and one mmap per input, in memory */
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    snprintf(g_dir, sizeof g_dir, "%s/kr-fuzz-st-XXXXXX", base);
    if (!mkdtemp(g_dir)) {
        perror("fuzz_safetensors: mkdtemp");
        abort();
    }
    atexit(remove_dir);
    return 0;
}

static void path_of(char *buf, size_t size, const char *name)
{
    snprintf(buf, size, "%s/%s", g_dir, name);
}

static void write_file(const char *name, const uint8_t *p, size_t n)
{
    char path[512];
    path_of(path, sizeof path, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    KR_FUZZ_CHECK(fd >= 0, "cannot create %s", path);
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        KR_FUZZ_CHECK(w > 0, "cannot write %s", path);
        p += w;
        n -= (size_t)w;
    }
    close(fd);
}

static const char *const k_names[] = {"model.safetensors", "model.safetensors.index.json", "s1.safetensors",
                                      "s2.safetensors",    "s3.safetensors",               "s4.safetensors"};

static void clear_dir(void)
{
    char path[512];
    for (size_t i = 0; i < sizeof k_names / sizeof k_names[0]; i++) {
        path_of(path, sizeof path, k_names[i]);
        unlink(path);
    }
}

/* Where the separator starts in p[0..n), or NULL. */
static const uint8_t *find_sep(const uint8_t *p, size_t n)
{
    const size_t sl = sizeof k_sep - 1;
    for (size_t i = 0; i + sl <= n; i++) {
        if (memcmp(p + i, k_sep, sl) == 0) {
            return p + i;
        }
    }
    return NULL;
}

static void check_archive(const struct kr_st_archive *ar)
{
    for (size_t i = 0; i < ar->n_tensors; i++) {
        const struct kr_st_tensor *t = &ar->tensors[i];
        KR_FUZZ_CHECK(i == 0 || strcmp(ar->tensors[i - 1].name, t->name) < 0, "tensors not sorted or repeated");
        KR_FUZZ_CHECK(kr_st_find(ar, t->name) == t, "\"%s\" not found", t->name);
        KR_FUZZ_CHECK(t->n_dim >= 0 && t->n_dim <= KR_ST_MAX_DIMS, "n_dim %d", t->n_dim);
        int64_t n_elem = 1;
        for (int d = 0; d < t->n_dim; d++) {
            KR_FUZZ_CHECK(t->shape[d] >= 0, "negative dimension");
            n_elem *= t->shape[d]; /* cannot overflow: the reader refused shapes whose product does */
        }
        KR_FUZZ_CHECK(n_elem == t->n_elem && t->nbytes == (size_t)n_elem * kr_dtype_size(t->dtype), "sizes of \"%s\"",
                      t->name);
        const struct kr_st_file *f = t->file;
        KR_FUZZ_CHECK(f >= ar->files && f < ar->files + ar->n_files, "file of \"%s\"", t->name);
        const char *lo = (const char *)f->map + 8, *hi = (const char *)f->map + f->map_size;
        const char *d = t->data;
        KR_FUZZ_CHECK(d >= lo && d <= hi && t->nbytes <= (size_t)(hi - d), "\"%s\" outside its file", t->name);
        if (t->nbytes) { /* touch both ends */
            volatile char x = d[0];
            x = d[t->nbytes - 1];
            (void)x;
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) {
        return 0;
    }
    clear_dir();
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    if ((data[0] & 1) == 0) {
        write_file("model.safetensors", p, n);
    } else {
        for (int part = 0; part <= MAX_SHARDS; part++) {
            const uint8_t *sep = find_sep(p, n);
            size_t len = sep ? (size_t)(sep - p) : n;
            write_file(k_names[part == 0 ? 1 : part + 1], p, len);
            if (!sep) {
                break;
            }
            p = sep + sizeof k_sep - 1;
            n -= len + sizeof k_sep - 1;
        }
    }
    struct kr_st_archive *ar = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_st_open_dir(g_dir, &ar, &err);
    KR_FUZZ_CHECK(st == KR_OK ? ar != NULL : ar == NULL && err.msg[0], "status %d without its result", (int)st);
    if (ar) {
        check_archive(ar);
    }
    kr_st_close(ar);
    clear_dir();
    return 0;
}
