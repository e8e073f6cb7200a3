#pragma once
/* Logging: one sink, replaceable callback (tests capture output through it). Each event is
 * one line. The default sink writes "2026-12-01T23:50:01.123Z LEVEL message" (UTC) to stderr. Thread-safe. */
#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

enum kr_log_level { KR_LOG_LEVEL_DEBUG = 0, KR_LOG_LEVEL_INFO = 1, KR_LOG_LEVEL_WARN = 2, KR_LOG_LEVEL_ERROR = 3 };

typedef void (*kr_log_cb)(enum kr_log_level level, const char *line, void *user);

/* Replaces the sink; NULL restores the default stderr sink. Not thread-safe with concurrent logging. */
void kr_log_set_callback(kr_log_cb cb, void *user);
/* Messages below `level` are dropped. Default: INFO. */
void kr_log_set_level(enum kr_log_level level);
enum kr_log_level kr_log_get_level(void);
/* Parses "debug", "info", "warn"/"warning", "error"; returns 0 on success, -1 otherwise. */
int kr_log_parse_level(const char *s, enum kr_log_level *out);

void kr_log(enum kr_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kr_logv(enum kr_log_level level, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

#define KR_LOG_DEBUG(...) kr_log(KR_LOG_LEVEL_DEBUG, __VA_ARGS__)
#define KR_LOG_INFO(...)  kr_log(KR_LOG_LEVEL_INFO, __VA_ARGS__)
#define KR_LOG_WARN(...)  kr_log(KR_LOG_LEVEL_WARN, __VA_ARGS__)
#define KR_LOG_ERROR(...) kr_log(KR_LOG_LEVEL_ERROR, __VA_ARGS__)

/* Always-on assertion for our own invariants (never for client or checkpoint input). */
#define KR_ASSERT(x)                                                                               \
    do {                                                                                           \
        if (!(x)) {                                                                                \
            kr_fatal(__FILE__, __LINE__, #x);                                                      \
        }                                                                                          \
    } while (0)

/* Installs handlers for the signals that end a process on a fault (SIGSEGV, SIGBUS, SIGFPE, SIGILL,
 * SIGABRT): each writes one "FATAL signal N (NAME) at ADDR in thread TID" line and the stack (frames
 * as `binary(+offset)`, for addr2line on the unstripped binary) to stderr with async-signal-safe
 * calls, then lets the signal end the process as it would have (core and status unchanged). Does
 * nothing under AddressSanitizer, whose own reports say more. Call once, early in main. */
void kr_log_install_crash_handler(void);

/* Logs the failed assertion and aborts. The only place outside main() that ends the process. */
void kr_fatal(const char *file, int line, const char *expr) __attribute__((noreturn));

#ifdef __cplusplus
}
#endif
