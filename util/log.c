#define _POSIX_C_SOURCE 200809L /* gmtime_r */
#include "log.h"

#include <pthread.h>
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
