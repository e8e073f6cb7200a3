#include "status.h"

const char *kr_status_str(enum kr_status st)
{
    switch (st) {
    case KR_OK:
        return "ok";
    case KR_AGAIN:
        return "try again";
    case KR_ERR_NOMEM:
        return "out of memory";
    case KR_ERR_INVAL:
        return "invalid argument";
    case KR_ERR_IO:
        return "i/o error";
    case KR_ERR_FORMAT:
        return "malformed input";
    case KR_ERR_UNSUPPORTED:
        return "unsupported";
    case KR_ERR_CUDA:
        return "cuda error";
    case KR_ERR_CANCELLED:
        return "cancelled";
    case KR_ERR_INTERNAL:
        return "internal error";
    case KR_ERR_BUSY:
        return "busy";
    case KR_ERR_TOO_LONG:
        return "beyond the context length";
    }
    return "unknown status";
}

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

enum kr_status kr_err_set(struct kr_err *err, enum kr_status st, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return st;
}

enum kr_status kr_err_param(struct kr_err *err, enum kr_status st, const char *param)
{
    if (err) {
        snprintf(err->param, sizeof err->param, "%s", param);
    }
    return st;
}

void kr_err_prefix(struct kr_err *err, const char *fmt, ...)
{
    if (!err) {
        return;
    }
    char head[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(head, sizeof head, fmt, ap);
    va_end(ap);
    char old[sizeof err->msg];
    memcpy(old, err->msg, sizeof old);
    /* "head: old", truncated to the buffer */
    size_t cap = sizeof err->msg - 1, o = 0;
    for (const char *parts[3] = {head, ": ", old}, **p = parts; p < parts + 3; p++) {
        size_t n = strlen(*p);
        n = n < cap - o ? n : cap - o;
        memcpy(err->msg + o, *p, n);
        o += n;
    }
    err->msg[o] = 0;
}
