#define _POSIX_C_SOURCE 200809L

#include "file.h"

#include "alloc.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

enum kr_status kr_file_read(const char *path, size_t max_bytes, char **out, size_t *len, struct kr_err *err)
{
    *out = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        return kr_err_set(err, KR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    /* The size of a regular file sizes the buffer at once (one more byte sees the end of file);
     * other files (pipes, /proc) grow it as they are read. */
    struct stat sb;
    size_t cap = 65536;
    if (fstat(fileno(f), &sb) == 0 && S_ISREG(sb.st_mode)) {
        if ((uint64_t)sb.st_size > max_bytes) {
            fclose(f);
            return kr_err_set(err, KR_ERR_IO, "%s: larger than the limit of %zu bytes", path, max_bytes);
        }
        cap = (size_t)sb.st_size + 1;
    }
    enum kr_status st = KR_OK;
    size_t n = 0;
    char *buf = NULL;
    for (;;) {
        if (n == cap || !buf) {
            size_t new_cap = buf ? (cap <= max_bytes / 2 ? cap * 2 : max_bytes + 1) : cap;
            char *nb = new_cap > n ? kr_realloc(buf, new_cap + 1) : NULL; /* + 1: the terminator */
            if (!nb) {
                st = kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory reading the file", path);
                goto fail;
            }
            buf = nb;
            cap = new_cap;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (n > max_bytes) {
            st = kr_err_set(err, KR_ERR_IO, "%s: larger than the limit of %zu bytes", path, max_bytes);
            goto fail;
        }
        if (got == 0) {
            if (ferror(f)) {
                st = kr_err_set(err, KR_ERR_IO, "%s: read error: %s", path, strerror(errno));
                goto fail;
            }
            break;
        }
    }
    fclose(f);
    buf[n] = 0;
    *out = buf;
    *len = n;
    return KR_OK;
fail:
    fclose(f);
    kr_free(buf);
    return st;
}
