#pragma once
/* krait status codes: 0 is success, negative values are errors, positive values are non-error
 * outcomes (nginx style). Every function that can fail returns one of these. */
#ifdef __cplusplus
extern "C" {
#endif

enum kr_status {
    KR_OK = 0,
    KR_AGAIN = 1,            /* not an error: resources busy this step, retry later */
    KR_ERR_NOMEM = -1,       /* host or device allocation failed */
    KR_ERR_INVAL = -2,       /* invalid argument (client or caller controlled) */
    KR_ERR_IO = -3,          /* file system error */
    KR_ERR_FORMAT = -4,      /* malformed file: JSON, safetensors header, config */
    KR_ERR_UNSUPPORTED = -5, /* well-formed but not supported (dtype, layer type, ...) */
    KR_ERR_CUDA = -6,        /* CUDA runtime / cuBLAS / NCCL failure */
    KR_ERR_CANCELLED = -7,   /* the request was cancelled */
    KR_ERR_INTERNAL = -8,    /* a bug: an invariant did not hold */
    KR_ERR_BUSY = -9,        /* admission limit reached: retry later (HTTP 429/503) */
    KR_ERR_TOO_LONG = -10,   /* a request beyond the context length or the whole cache (HTTP 400,
                                context_length_exceeded) */
};

/* Returns a static, human-readable name of a status ("ok", "out of memory", ...). */
const char *kr_status_str(enum kr_status st);

/* Returns the status of `expr` from the calling function when it is not KR_OK. */
#define KR_TRY(expr)                                                                               \
    do {                                                                                           \
        enum kr_status st_ = (expr);                                                               \
        if (st_ != KR_OK) {                                                                        \
            return st_;                                                                            \
        }                                                                                          \
    } while (0)

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
extern "C" {
#endif
/* A human-readable error message filled in by functions that fail on user or checkpoint input
 * (names the file, the tensor or key, and what was expected). May be passed as NULL. */
struct kr_err {
    char msg[1024];
    char param[64];   /* the request field at fault, "" when none (kr_err_param) */
};

/* Formats into err->msg (no-op when err is NULL). Returns `st` so callers can write
 * `return kr_err_set(err, KR_ERR_FORMAT, "...", ...);`. */
enum kr_status kr_err_set(struct kr_err *err, enum kr_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Names the request field at fault (no-op when err is NULL); returns `st`. */
enum kr_status kr_err_param(struct kr_err *err, enum kr_status st, const char *param);
/* Prepends "prefix: " to an existing message (no-op when err is NULL). */
void kr_err_prefix(struct kr_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#ifdef __cplusplus
}
#endif
