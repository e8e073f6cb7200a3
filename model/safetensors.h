#pragma once
/* Read-only access to safetensors checkpoints through mmap: a single `*.safetensors` file or a
 * sharded set listed by `model.safetensors.index.json`. Tensor data stays in the mapping
 * (borrowed pointers valid until kr_st_close()). */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KR_ST_MAX_DIMS 8

struct kr_st_file;

struct kr_st_tensor {
    char *name;                      /* tensor name as stored */
    enum kr_dtype dtype;             /* F32, F16, BF16, F8_E4M3, I32, I64 */
    int n_dim;                       /* 0..KR_ST_MAX_DIMS */
    int64_t shape[KR_ST_MAX_DIMS];   /* outermost first */
    int64_t n_elem;                  /* product of shape (1 for a scalar) */
    const void *data;                /* borrowed: points into the file mapping */
    size_t nbytes;                   /* n_elem * dtype size */
    const struct kr_st_file *file;   /* the file that holds it */
    bool used;                       /* set by the loader that consumed it (unexpected-tensor checks) */
};

struct kr_st_file {
    char *path;      /* as opened */
    void *map;       /* mmap of the whole file */
    size_t map_size; /* file size */
};

/* All tensors of a checkpoint directory, sorted by name. */
struct kr_st_archive {
    size_t n_files;
    struct kr_st_file *files;     /* [n_files] */
    size_t n_tensors;
    struct kr_st_tensor *tensors; /* [n_tensors], sorted by name */
};

/* Opens the checkpoint in directory `dir`: `model.safetensors.index.json` if present (every
 * shard it names must exist and hold exactly the tensors the index assigns to it), otherwise
 * the single `*.safetensors` file of the directory (more than one without an index is an
 * error). Validates every header: 8-byte little-endian header length within the file, JSON
 * object, dtype names, shapes (non-negative, product without overflow), data_offsets
 * [begin, end] within the data area with end - begin == n_elem * dtype size, no two tensors
 * overlapping, no duplicate name across files. `__metadata__` is skipped. On error returns
 * KR_ERR_IO / KR_ERR_FORMAT / KR_ERR_UNSUPPORTED / KR_ERR_NOMEM with a message naming the file
 * and the tensor. *out is owned by the caller (kr_st_close). */
enum kr_status kr_st_open_dir(const char *dir, struct kr_st_archive **out, struct kr_err *err);

/* Opens exactly one safetensors file as an archive (same validation as above). */
enum kr_status kr_st_open_file(const char *path, struct kr_st_archive **out, struct kr_err *err);

/* Binary search by name; NULL when absent. */
struct kr_st_tensor *kr_st_find(const struct kr_st_archive *ar, const char *name);

/* Unmaps and frees everything. NULL is a no-op. */
void kr_st_close(struct kr_st_archive *ar);

#ifdef __cplusplus
}
#endif
