#define _POSIX_C_SOURCE 200809L

#include "safetensors.h"

#include "alloc.h"
#include "json.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Layout of a safetensors file: an 8-byte little-endian u64 N, N bytes of a JSON object header
 * {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {..}},
 * then the data area; data_offsets are relative to the start of the data area (byte 8 + N). */

/* Same cap as the reference implementation (safetensors' MAX_HEADER_SIZE): a larger header is
 * taken as corruption rather than parsed. */
#define KR_ST_MAX_HEADER_SIZE 100000000u

#define KR_ST_INDEX_NAME "model.safetensors.index.json"
#define KR_ST_SUFFIX     ".safetensors"
#define KR_ST_SUPPORTED  "F32 F16 BF16 F8_E4M3 I32 I64"

/* ---- archive bookkeeping ------------------------------------------------------------------- */

/* A new archive with `n_files` zeroed file slots (unmapped) and no tensors; NULL on OOM. */
static struct kr_st_archive *archive_new(size_t n_files)
{
    struct kr_st_archive *ar = kr_calloc(1, sizeof *ar);
    if (!ar) {
        return NULL;
    }
    ar->files = kr_calloc(n_files ? n_files : 1, sizeof *ar->files);
    if (!ar->files) {
        kr_free(ar);
        return NULL;
    }
    ar->n_files = n_files;
    return ar;
}

/* Handles partially built archives too: unmapped files have map == NULL and only the first
 * n_tensors tensors own a name. */
void kr_st_close(struct kr_st_archive *ar)
{
    if (!ar) {
        return;
    }
    for (size_t i = 0; i < ar->n_tensors; i++) {
        kr_free(ar->tensors[i].name);
    }
    kr_free(ar->tensors);
    for (size_t i = 0; ar->files && i < ar->n_files; i++) {
        if (ar->files[i].map) {
            munmap(ar->files[i].map, ar->files[i].map_size);
        }
        kr_free(ar->files[i].path);
    }
    kr_free(ar->files);
    kr_free(ar);
}

/* "dir/name" in a new buffer (caller frees); NULL on OOM. */
static char *path_join(const char *dir, const char *name)
{
    size_t dl = strlen(dir), nl = strlen(name);
    while (dl > 1 && dir[dl - 1] == '/') {
        dl--;
    }
    char *p = kr_malloc(dl + 1 + nl + 1);
    if (p) {
        memcpy(p, dir, dl);
        p[dl] = '/';
        memcpy(p + dl + 1, name, nl + 1);
    }
    return p;
}

static int cmp_tensor_name(const void *a, const void *b)
{
    const struct kr_st_tensor *x = a, *y = b;
    return strcmp(x->name, y->name);
}

static int cmp_tensor_data(const void *a, const void *b)
{
    const struct kr_st_tensor *x = a, *y = b;
    const char *px = x->data, *py = y->data;
    if (px != py) {
        return px < py ? -1 : 1;
    }
    return (x->nbytes > y->nbytes) - (x->nbytes < y->nbytes);
}

/* ---- one file -------------------------------------------------------------------------------- */

/* Maps `f->path` read-only into `f`. */
static enum kr_status map_file(struct kr_st_file *f, struct kr_err *err)
{
    struct stat sb;
    int fd = open(f->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return kr_err_set(err, KR_ERR_IO, "%s: cannot open: %s", f->path, strerror(errno));
    }
    enum kr_status st = KR_OK;
    if (fstat(fd, &sb) != 0) {
        st = kr_err_set(err, KR_ERR_IO, "%s: cannot stat: %s", f->path, strerror(errno));
        goto done;
    }
    if (!S_ISREG(sb.st_mode)) {
        st = kr_err_set(err, KR_ERR_IO, "%s: not a regular file", f->path);
        goto done;
    }
    if (sb.st_size < 8) {
        st = kr_err_set(err, KR_ERR_FORMAT,
                        "%s: file is %lld bytes, shorter than the 8-byte header length of a safetensors file",
                        f->path, (long long)sb.st_size);
        goto done;
    }
    if ((unsigned long long)sb.st_size > SIZE_MAX) {
        st = kr_err_set(err, KR_ERR_IO, "%s: file too large to map", f->path);
        goto done;
    }
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
        st = kr_err_set(err, KR_ERR_IO, "%s: cannot mmap %lld bytes: %s", f->path, (long long)sb.st_size,
                        strerror(errno));
        goto done;
    }
    f->map = m;
    f->map_size = (size_t)sb.st_size;
done:
    close(fd);
    return st;
}

/* Formats a shape as "[2, 3]" into buf. */
static const char *shape_str(const struct kr_st_tensor *t, char *buf, size_t size)
{
    size_t n = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < t->n_dim && n < size; i++) {
        n += (size_t)snprintf(buf + n, size - n, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    }
    if (n < size) {
        snprintf(buf + n, size - n, "]");
    }
    return buf;
}

/* Reads one header entry `val` named `name` of file `f` into `t` (name not set). `data` is the
 * start of the data area, `data_size` its length in bytes. */
static enum kr_status parse_entry(const struct kr_st_file *f, const char *name, const struct kr_json *val,
                                  const char *data, size_t data_size, struct kr_st_tensor *t,
                                  struct kr_err *err)
{
    if (val->type != KR_JSON_OBJECT) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: tensor \"%s\": expected an object, found %s", f->path,
                          name, kr_json_type_name(val->type));
    }
    const struct kr_json *dtype = kr_json_get(val, "dtype");
    const struct kr_json *shape = kr_json_get(val, "shape");
    const struct kr_json *offs = kr_json_get(val, "data_offsets");
    if (!dtype || dtype->type != KR_JSON_STRING) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: tensor \"%s\": expected a string \"dtype\", found %s",
                          f->path, name, dtype ? kr_json_type_name(dtype->type) : "none");
    }
    if (!shape || shape->type != KR_JSON_ARRAY) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: tensor \"%s\": expected an array \"shape\", found %s",
                          f->path, name, shape ? kr_json_type_name(shape->type) : "none");
    }
    if (!offs || offs->type != KR_JSON_ARRAY) {
        return kr_err_set(err, KR_ERR_FORMAT,
                          "%s: tensor \"%s\": expected an array \"data_offsets\", found %s", f->path, name,
                          offs ? kr_json_type_name(offs->type) : "none");
    }
    if (kr_dtype_parse(dtype->str, &t->dtype) != 0) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED,
                          "%s: tensor \"%s\": dtype \"%s\" is not supported (supported: %s)", f->path, name,
                          dtype->str, KR_ST_SUPPORTED);
    }
    if (shape->n > KR_ST_MAX_DIMS) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED,
                          "%s: tensor \"%s\": %zu dimensions, at most %d are supported", f->path, name,
                          shape->n, KR_ST_MAX_DIMS);
    }
    t->n_dim = (int)shape->n;
    t->n_elem = 1;
    for (size_t i = 0; i < shape->n; i++) {
        const struct kr_json *d = &shape->items[i];
        if (d->type != KR_JSON_NUMBER || !d->is_int || d->integer < 0) {
            return kr_err_set(err, KR_ERR_FORMAT,
                              "%s: tensor \"%s\": shape[%zu] is not a non-negative integer", f->path, name,
                              i);
        }
        t->shape[i] = d->integer;
        if (d->integer != 0 && t->n_elem > INT64_MAX / d->integer) {
            return kr_err_set(err, KR_ERR_FORMAT, "%s: tensor \"%s\": element count of the shape overflows",
                              f->path, name);
        }
        t->n_elem *= d->integer;
    }
    size_t esize = kr_dtype_size(t->dtype);
    if ((uint64_t)t->n_elem > SIZE_MAX / esize) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: tensor \"%s\": byte size of the shape overflows", f->path,
                          name);
    }
    t->nbytes = (size_t)t->n_elem * esize;
    if (offs->n != 2 || offs->items[0].type != KR_JSON_NUMBER || !offs->items[0].is_int ||
        offs->items[0].integer < 0 || offs->items[1].type != KR_JSON_NUMBER || !offs->items[1].is_int ||
        offs->items[1].integer < 0) {
        return kr_err_set(
            err, KR_ERR_FORMAT,
            "%s: tensor \"%s\": expected \"data_offsets\" to be two non-negative integers [begin, end]",
            f->path, name);
    }
    uint64_t begin = (uint64_t)offs->items[0].integer, end = (uint64_t)offs->items[1].integer;
    if (begin > end) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: tensor \"%s\": data_offsets begin %llu > end %llu",
                          f->path, name, (unsigned long long)begin, (unsigned long long)end);
    }
    if (end > data_size) {
        return kr_err_set(
            err, KR_ERR_FORMAT,
            "%s: truncated: tensor \"%s\" needs bytes [%llu, %llu) of the data area but the file has "
            "only %zu",
            f->path, name, (unsigned long long)begin, (unsigned long long)end, data_size);
    }
    if (end - begin != t->nbytes) {
        char sh[256];
        return kr_err_set(
            err, KR_ERR_FORMAT,
            "%s: tensor \"%s\": data_offsets [%llu, %llu) hold %llu bytes but shape %s of %s needs %zu",
            f->path, name, (unsigned long long)begin, (unsigned long long)end,
            (unsigned long long)(end - begin), shape_str(t, sh, sizeof sh), kr_dtype_name(t->dtype),
            t->nbytes);
    }
    t->data = data + begin;
    t->file = f;
    return KR_OK;
}

/* Maps file `ar->files[fi]` (whose path is set), validates its header and appends its tensors to
 * ar->tensors (with ar->file pointers into ar->files). */
static enum kr_status load_file(struct kr_st_archive *ar, size_t fi, struct kr_err *err)
{
    struct kr_st_file *f = &ar->files[fi];
    struct kr_json *hdr = NULL;
    enum kr_status st;
    if ((st = map_file(f, err)) != KR_OK) {
        return st;
    }
    const unsigned char *m = f->map;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) {
        n = n << 8 | m[i];
    }
    if (n > KR_ST_MAX_HEADER_SIZE) {
        return kr_err_set(err, KR_ERR_FORMAT,
                          "%s: header length %llu is above the %u-byte limit (corrupt file?)", f->path,
                          (unsigned long long)n, KR_ST_MAX_HEADER_SIZE);
    }
    if (n > f->map_size - 8) {
        return kr_err_set(
            err, KR_ERR_FORMAT,
            "%s: header length %llu exceeds the %zu bytes that follow the length field (truncated file?)",
            f->path, (unsigned long long)n, f->map_size - 8);
    }
    if ((st = kr_json_parse((const char *)m + 8, (size_t)n, &hdr, err)) != KR_OK) {
        kr_err_prefix(err, "%s: invalid JSON header", f->path);
        return st;
    }
    if (hdr->type != KR_JSON_OBJECT) {
        st = kr_err_set(err, KR_ERR_FORMAT, "%s: header is a JSON %s, expected an object", f->path,
                        kr_json_type_name(hdr->type));
        goto fail;
    }
    const char *data = (const char *)m + 8 + n;
    size_t data_size = f->map_size - 8 - (size_t)n;
    size_t first = ar->n_tensors;
    if (hdr->n > 0) {
        if (hdr->n > SIZE_MAX / sizeof *ar->tensors - first) {
            st = kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", f->path);
            goto fail;
        }
        struct kr_st_tensor *ts = kr_realloc(ar->tensors, (first + hdr->n) * sizeof *ts);
        if (!ts) {
            st = kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", f->path);
            goto fail;
        }
        ar->tensors = ts;
    }
    for (size_t i = 0; i < hdr->n; i++) {
        const char *name = hdr->keys[i];
        if (!strcmp(name, "__metadata__")) {
            continue;
        }
        struct kr_st_tensor *t = &ar->tensors[ar->n_tensors];
        memset(t, 0, sizeof *t);
        if ((st = parse_entry(f, name, &hdr->items[i], data, data_size, t, err)) != KR_OK) {
            goto fail;
        }
        if (!(t->name = kr_strdup(name))) {
            st = kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", f->path);
            goto fail;
        }
        ar->n_tensors++;
    }
    /* Overlap check: sort this file's tensors by start; empty tensors occupy no bytes. */
    size_t cnt = ar->n_tensors - first;
    if (cnt > 1) {
        struct kr_st_tensor *ts = ar->tensors + first;
        qsort(ts, cnt, sizeof *ts, cmp_tensor_data);
        const struct kr_st_tensor *prev = NULL;
        for (size_t i = 0; i < cnt; i++) {
            if (ts[i].nbytes == 0) {
                continue;
            }
            if (prev && (const char *)prev->data + prev->nbytes > (const char *)ts[i].data) {
                const char *pd = prev->data, *cd = ts[i].data;
                st =
                    kr_err_set(err, KR_ERR_FORMAT,
                               "%s: tensors \"%s\" [%zu, %zu) and \"%s\" [%zu, %zu) overlap in the data area",
                               f->path, prev->name, (size_t)(pd - data), (size_t)(pd - data) + prev->nbytes,
                               ts[i].name, (size_t)(cd - data), (size_t)(cd - data) + ts[i].nbytes);
                goto fail;
            }
            if (!prev || (const char *)ts[i].data + ts[i].nbytes > (const char *)prev->data + prev->nbytes) {
                prev = &ts[i];
            }
        }
    }
    kr_json_free(hdr);
    return KR_OK;
fail:
    kr_json_free(hdr);
    return st;
}

/* Sorts the tensors by name and rejects duplicate names. */
static enum kr_status finish(struct kr_st_archive *ar, struct kr_err *err)
{
    if (ar->n_tensors > 1) {
        qsort(ar->tensors, ar->n_tensors, sizeof *ar->tensors, cmp_tensor_name);
    }
    for (size_t i = 1; i < ar->n_tensors; i++) {
        const struct kr_st_tensor *a = &ar->tensors[i - 1], *b = &ar->tensors[i];
        if (!strcmp(a->name, b->name)) {
            if (a->file == b->file) {
                return kr_err_set(err, KR_ERR_FORMAT, "%s: tensor \"%s\" appears twice in the header",
                                  a->file->path, a->name);
            }
            return kr_err_set(err, KR_ERR_FORMAT, "tensor \"%s\" appears in both %s and %s", a->name,
                              a->file->path, b->file->path);
        }
    }
    return KR_OK;
}

enum kr_status kr_st_open_file(const char *path, struct kr_st_archive **out, struct kr_err *err)
{
    enum kr_status st;
    *out = NULL;
    struct kr_st_archive *ar = archive_new(1);
    if (!ar || !(ar->files[0].path = kr_strdup(path))) {
        st = kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", path);
        goto fail;
    }
    if ((st = load_file(ar, 0, err)) != KR_OK || (st = finish(ar, err)) != KR_OK) {
        goto fail;
    }
    *out = ar;
    return KR_OK;
fail:
    kr_st_close(ar);
    return st;
}

struct kr_st_tensor *kr_st_find(const struct kr_st_archive *ar, const char *name)
{
    if (!ar) {
        return NULL;
    }
    size_t lo = 0, hi = ar->n_tensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(ar->tensors[mid].name, name);
        if (c == 0) {
            return &ar->tensors[mid];
        }
        if (c < 0) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return NULL;
}

/* ---- sharded checkpoints ------------------------------------------------------------------- */

/* One weight_map entry of the index. */
struct index_entry {
    const char *tensor; /* borrowed from the index JSON */
    const char *shard;  /* borrowed from the index JSON */
    size_t order;       /* position in weight_map (later duplicates win) */
    size_t file;        /* index into ar->files */
};

static int cmp_entry_tensor(const void *a, const void *b)
{
    const struct index_entry *x = a, *y = b;
    int c = strcmp(x->tensor, y->tensor);
    if (c) {
        return c;
    }
    return (x->order > y->order) - (x->order < y->order);
}

static int cmp_entry_shard(const void *a, const void *b)
{
    const struct index_entry *x = a, *y = b;
    return strcmp(x->shard, y->shard);
}

static const struct index_entry *find_entry(const struct index_entry *e, size_t n, const char *tensor)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(e[mid].tensor, tensor);
        if (c == 0) {
            return &e[mid];
        }
        if (c < 0) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return NULL;
}

/* Opens the shards named by the index at `index_path` (in directory `dir`). */
static enum kr_status open_indexed(const char *dir, const char *index_path, struct kr_st_archive **out,
                                   struct kr_err *err)
{
    enum kr_status st;
    struct kr_json *idx = NULL;
    struct index_entry *ents = NULL;
    struct kr_st_archive *ar = NULL;
    const char **shard_names = NULL;
    size_t n = 0;

    if ((st = kr_json_parse_file(index_path, &idx, err)) != KR_OK) {
        goto fail;
    }
    const struct kr_json *wm = kr_json_get(idx, "weight_map");
    if (idx->type != KR_JSON_OBJECT || !wm || wm->type != KR_JSON_OBJECT) {
        st = kr_err_set(err, KR_ERR_FORMAT, "%s: expected an object with an object \"weight_map\"",
                        index_path);
        goto fail;
    }
    if (wm->n > 0 && !(ents = kr_calloc(wm->n, sizeof *ents))) {
        st = kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", index_path);
        goto fail;
    }
    for (size_t i = 0; i < wm->n; i++) {
        const struct kr_json *s = &wm->items[i];
        if (s->type != KR_JSON_STRING) {
            st = kr_err_set(err, KR_ERR_FORMAT,
                            "%s: weight_map[\"%s\"]: expected a file name string, found %s", index_path,
                            wm->keys[i], kr_json_type_name(s->type));
            goto fail;
        }
        /* The shard is opened as DIR/NAME: keep it inside DIR. */
        if (s->str_len == 0 || strlen(s->str) != s->str_len || strchr(s->str, '/') || strstr(s->str, "..")) {
            st = kr_err_set(err, KR_ERR_FORMAT,
                            "%s: weight_map[\"%s\"]: shard file name \"%s\" must be a plain file name in the "
                            "checkpoint directory (no '/' or '..')",
                            index_path, wm->keys[i], s->str);
            goto fail;
        }
        ents[i] = (struct index_entry){.tensor = wm->keys[i], .shard = s->str, .order = i};
    }
    /* Sort by tensor name; for duplicate keys keep only the last one (as Python's json does). */
    if (wm->n > 1) {
        qsort(ents, wm->n, sizeof *ents, cmp_entry_tensor);
    }
    for (size_t i = 0; i < wm->n; i++) {
        if (i + 1 < wm->n && !strcmp(ents[i].tensor, ents[i + 1].tensor)) {
            continue;
        }
        ents[n++] = ents[i];
    }
    /* Distinct shards: sort a copy of the names. */
    if (n > 0 && !(shard_names = kr_calloc(n, sizeof *shard_names))) {
        st = kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", index_path);
        goto fail;
    }
    size_t n_shards = 0;
    {
        struct index_entry *by_shard = NULL;
        if (n > 0 && !(by_shard = kr_calloc(n, sizeof *by_shard))) {
            st = kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", index_path);
            goto fail;
        }
        if (n > 0) {
            memcpy(by_shard, ents, n * sizeof *ents);
            qsort(by_shard, n, sizeof *by_shard, cmp_entry_shard);
        }
        for (size_t i = 0; i < n; i++) {
            if (i == 0 || strcmp(by_shard[i].shard, by_shard[i - 1].shard)) {
                shard_names[n_shards++] = by_shard[i].shard;
            }
        }
        kr_free(by_shard);
    }
    /* Map each entry to its shard slot (binary search over the sorted distinct names). */
    for (size_t i = 0; i < n; i++) {
        size_t lo = 0, hi = n_shards;
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            if (strcmp(shard_names[mid], ents[i].shard) < 0) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        ents[i].file = lo;
    }
    if (!(ar = archive_new(n_shards))) {
        st = kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", index_path);
        goto fail;
    }
    for (size_t i = 0; i < n_shards; i++) {
        if (!(ar->files[i].path = path_join(dir, shard_names[i]))) {
            st = kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", index_path);
            goto fail;
        }
        if ((st = load_file(ar, i, err)) != KR_OK) {
            if (st == KR_ERR_IO && err) { /* e.g. a missing shard: say who asked for it */
                size_t ml = strlen(err->msg);
                snprintf(err->msg + ml, sizeof err->msg - ml, " (listed in %s)", index_path);
            }
            goto fail;
        }
    }
    if ((st = finish(ar, err)) != KR_OK) {
        goto fail;
    }
    /* Every tensor of each shard must be listed in the index with that shard ... */
    for (size_t i = 0; i < ar->n_tensors; i++) {
        const struct kr_st_tensor *t = &ar->tensors[i];
        const struct index_entry *e = find_entry(ents, n, t->name);
        if (!e) {
            st = kr_err_set(err, KR_ERR_FORMAT, "%s: tensor \"%s\" is not listed in %s", t->file->path,
                            t->name, index_path);
            goto fail;
        }
        if (&ar->files[e->file] != t->file) {
            st = kr_err_set(err, KR_ERR_FORMAT, "%s: tensor \"%s\" is stored here but %s assigns it to %s",
                            t->file->path, t->name, index_path, e->shard);
            goto fail;
        }
    }
    /* ... and every tensor the index lists must be present (in its shard, given the check above). */
    for (size_t i = 0; i < n; i++) {
        if (!kr_st_find(ar, ents[i].tensor)) {
            st = kr_err_set(err, KR_ERR_FORMAT,
                            "%s: tensor \"%s\" is assigned to %s but %s does not contain it", index_path,
                            ents[i].tensor, ents[i].shard, ar->files[ents[i].file].path);
            goto fail;
        }
    }
    kr_free(shard_names);
    kr_free(ents);
    kr_json_free(idx);
    *out = ar;
    return KR_OK;
fail:
    kr_st_close(ar);
    kr_free(shard_names);
    kr_free(ents);
    kr_json_free(idx);
    return st;
}

/* Finds the only *.safetensors file of `dir` and opens it. */
static enum kr_status open_single(const char *dir, struct kr_st_archive **out, struct kr_err *err)
{
    enum kr_status st;
    char *found = NULL;
    char *path = NULL;
    size_t count = 0;
    DIR *d = opendir(dir);
    if (!d) {
        return kr_err_set(err, KR_ERR_IO, "%s: cannot open directory: %s", dir, strerror(errno));
    }
    size_t sl = strlen(KR_ST_SUFFIX);
    const struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        size_t l = strlen(de->d_name);
        if (de->d_name[0] == '.' || l <= sl || strcmp(de->d_name + l - sl, KR_ST_SUFFIX) != 0) {
            continue; /* like the shell glob, skip hidden files */
        }
        if (++count == 1) {
            if (!(found = kr_strdup(de->d_name))) {
                st = kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", dir);
                goto fail;
            }
        }
    }
    closedir(d);
    d = NULL;
    if (count == 0) {
        st = kr_err_set(err, KR_ERR_IO, "%s: no *%s file and no %s", dir, KR_ST_SUFFIX, KR_ST_INDEX_NAME);
        goto fail;
    }
    if (count > 1) {
        st = kr_err_set(err, KR_ERR_FORMAT, "%s: %zu *%s files (sharded checkpoint) but no %s", dir, count,
                        KR_ST_SUFFIX, KR_ST_INDEX_NAME);
        goto fail;
    }
    if (!(path = path_join(dir, found))) {
        st = kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", dir);
        goto fail;
    }
    st = kr_st_open_file(path, out, err);
fail:
    if (d) {
        closedir(d);
    }
    kr_free(path);
    kr_free(found);
    return st;
}

enum kr_status kr_st_open_dir(const char *dir, struct kr_st_archive **out, struct kr_err *err)
{
    *out = NULL;
    char *index_path = path_join(dir, KR_ST_INDEX_NAME);
    if (!index_path) {
        return kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", dir);
    }
    struct stat sb;
    enum kr_status st;
    /* Any existing index (or one we cannot stat for another reason than absence) is authoritative:
     * its errors are reported rather than silently falling back to the directory listing. */
    if (stat(index_path, &sb) == 0 || errno != ENOENT) {
        st = open_indexed(dir, index_path, out, err);
    } else {
        st = open_single(dir, out, err);
    }
    kr_free(index_path);
    return st;
}
