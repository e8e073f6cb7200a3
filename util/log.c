#define _GNU_SOURCE /* gmtime_r, sigaltstack, gettid */
#include "log.h"

#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>
#include <sys/time.h>
#include <time.h>

static kr_log_cb g_cb;
static void *g_user;
static enum kr_log_level g_level = KR_LOG_LEVEL_INFO;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *level_name(enum kr_log_level level)
{
    switch (level) {
    case KR_LOG_LEVEL_DEBUG:
        return "DEBUG";
    case KR_LOG_LEVEL_INFO:
        return "INFO";
    case KR_LOG_LEVEL_WARN:
        return "WARN";
    case KR_LOG_LEVEL_ERROR:
        return "ERROR";
    }
    return "?";
}

void kr_log_set_callback(kr_log_cb cb, void *user)
{
    pthread_mutex_lock(&g_lock);
    g_cb = cb;
    g_user = user;
    pthread_mutex_unlock(&g_lock);
}

void kr_log_set_level(enum kr_log_level level)
{
    g_level = level;
}

enum kr_log_level kr_log_get_level(void)
{
    return g_level;
}

int kr_log_parse_level(const char *s, enum kr_log_level *out)
{
    if (!strcasecmp(s, "debug")) {
        *out = KR_LOG_LEVEL_DEBUG;
    } else if (!strcasecmp(s, "info")) {
        *out = KR_LOG_LEVEL_INFO;
    } else if (!strcasecmp(s, "warn") || !strcasecmp(s, "warning")) {
        *out = KR_LOG_LEVEL_WARN;
    } else if (!strcasecmp(s, "error")) {
        *out = KR_LOG_LEVEL_ERROR;
    } else {
        return -1;
    }
    return 0;
}

void kr_logv(enum kr_log_level level, const char *fmt, va_list ap)
{
    if (level < g_level) {
        return;
    }
    char line[2048];
    vsnprintf(line, sizeof line, fmt, ap);
    pthread_mutex_lock(&g_lock);
    if (g_cb) {
        g_cb(level, line, g_user);
    } else {
        /* "2026-12-01T23:50:01.123Z INFO message": UTC, milliseconds */
        struct timeval tv;
        gettimeofday(&tv, NULL);
        struct tm tm;
        gmtime_r(&tv.tv_sec, &tm);
        fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ %s %s\n", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(tv.tv_usec / 1000), level_name(level), line);
    }
    pthread_mutex_unlock(&g_lock);
}

void kr_log(enum kr_log_level level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kr_logv(level, fmt, ap);
    va_end(ap);
}

void kr_fatal(const char *file, int line, const char *expr)
{
    fprintf(stderr, "FATAL %s:%d: assertion failed: %s\n", file, line, expr);
    fflush(stderr);
    abort();
}

/* ---- fatal signals ---------------------------------------------------------------------------
 * A fault in a server thread would otherwise end the process with nothing in its log. The handler
 * uses only async-signal-safe calls (write, backtrace_symbols_fd; backtrace itself is loaded before
 * any fault, below) and a stack of its own, so that a stack overflow is reported too. */

#if defined(__SANITIZE_ADDRESS__)
#define KR_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KR_ASAN 1
#endif
#endif

#ifndef KR_ASAN
static void put_str(const char *s)
{
    ssize_t r = write(STDERR_FILENO, s, strlen(s));
    (void)r;
}

static void put_num(unsigned long long v, int base)
{
    char b[32];
    int i = (int)sizeof b;
    b[--i] = 0;
    do {
        b[--i] = "0123456789abcdef"[v % (unsigned)base];
        v /= (unsigned)base;
    } while (v && i > 0);
    put_str(b + i);
}

static const char *signal_name(int sig)
{
    switch (sig) {
    case SIGSEGV:
        return "SIGSEGV";
    case SIGBUS:
        return "SIGBUS";
    case SIGFPE:
        return "SIGFPE";
    case SIGILL:
        return "SIGILL";
    case SIGABRT:
        return "SIGABRT";
    }
    return "?";
}

static void on_fatal_signal(int sig, siginfo_t *si, void *uctx)
{
    (void)uctx;
    struct timeval tv;
    gettimeofday(&tv, NULL); /* not listed as async-signal-safe, but a plain vDSO read */
    put_str("FATAL signal ");
    put_num((unsigned long long)sig, 10);
    put_str(" (");
    put_str(signal_name(sig));
    put_str(") at 0x");
    put_num((unsigned long long)(uintptr_t)(si ? si->si_addr : 0), 16);
    put_str(" in thread ");
    put_num((unsigned long long)gettid(), 10);
    put_str(", unix time ");
    put_num((unsigned long long)tv.tv_sec, 10);
    put_str("; stack (binary(+offset): addr2line -e BINARY -f OFFSET):\n");
    void *frames[64];
    const int n = backtrace(frames, 64);
    backtrace_symbols_fd(frames, n, STDERR_FILENO);
    /* SA_RESETHAND put back the default action: the signal ends the process as it would have */
    raise(sig);
}

#endif

void kr_log_install_crash_handler(void)
{
#ifndef KR_ASAN
    static char altstack[64 * 1024];
    stack_t ss = {.ss_sp = altstack, .ss_size = sizeof altstack, .ss_flags = 0};
    sigaltstack(&ss, NULL);
    void *warm[1];
    (void)backtrace(warm, 1); /* loads libgcc's unwinder now, not inside the handler */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fatal_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    const int sigs[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        sigaction(sigs[i], &sa, NULL);
    }
#endif
}
