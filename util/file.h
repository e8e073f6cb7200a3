#pragma once
/* Whole-file reads for the small files a checkpoint brings (config.json, tokenizer.json, the
 * safetensors index, chat templates). Weights are mapped by model/safetensors.c, not read here. */
#include <stddef.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reads the file at `path` into a new kr_malloc'd buffer *out (caller frees with kr_free), NUL
 * terminated for convenience; *len is the byte count without the terminator. A file of more than
 * `max_bytes` bytes is refused. Errors name the path: KR_ERR_IO ("PATH: cannot open: REASON",
 * "PATH: read error: REASON", "PATH: larger than the limit of N bytes") or KR_ERR_NOMEM
 * ("PATH: out of memory reading the file"). On error *out is NULL. */
enum kr_status kr_file_read(const char *path, size_t max_bytes, char **out, size_t *len, struct kr_err *err);

#ifdef __cplusplus
}
#endif
