#include "alloc.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* Every block carries a 16-byte header with its size, so the accounting is exact. */
#define KR_ALLOC_HDR 16

static atomic_size_t g_in_use;
static atomic_uint_fast64_t g_fail_countdown;
static atomic_int g_fail_sticky;
static atomic_uint_fast64_t g_failures; /* injected failures so far */
static atomic_uint_fast64_t g_calls;    /* allocation calls so far */
static _Thread_local uint64_t t_failed; /* failed allocations on this thread (shielded ones too) */
static _Thread_local int t_shield;      /* kr_alloc_shield depth on this thread */

/* Counts an injected failure; whether the call returns NULL (not inside a shield). */
static int injected(void)
{
    atomic_fetch_add(&g_failures, 1);
    t_failed++;
    return !t_shield;
}

/* the calling thread's limit (kr_alloc_limit_begin) */
static _Thread_local struct {
    int on, hit;
    size_t limit, used, peak;
} t_lim;

void kr_alloc_limit_begin(size_t limit)
{
    t_lim.on = 1;
    t_lim.hit = 0;
    t_lim.limit = limit;
    t_lim.used = t_lim.peak = 0;
}

int kr_alloc_limit_end(size_t *peak)
{
    if (peak) {
        *peak = t_lim.peak;
    }
    t_lim.on = 0;
    return t_lim.hit;
}

/* Counts `grow` more bytes (and `shrink` fewer) against the thread's limit; 0 when over it. A block
 * allocated before the scope and freed in it only brings the count down to zero. */
static int lim_take(size_t grow, size_t shrink)
{
    if (!t_lim.on) {
        return 1;
    }
    size_t u = t_lim.used > shrink ? t_lim.used - shrink : 0;
    if (grow > t_lim.limit || u > t_lim.limit - grow) {
        t_lim.hit = 1;
        return 0;
    }
    t_lim.used = u + grow;
    if (t_lim.used > t_lim.peak) {
        t_lim.peak = t_lim.used;
    }
    return 1;
}

static int should_fail(void)
{
    atomic_fetch_add_explicit(&g_calls, 1, memory_order_relaxed);
    uint_fast64_t c = atomic_load(&g_fail_countdown);
    while (c > 0) {
        if (c == 1 && atomic_load(&g_fail_sticky)) {
            return injected(); /* stays at 1: every later call fails too */
        }
        if (atomic_compare_exchange_weak(&g_fail_countdown, &c, c - 1)) {
            return c == 1 && injected();
        }
    }
    return 0;
}

uint64_t kr_alloc_failures(void)
{
    return atomic_load(&g_failures);
}

uint64_t kr_alloc_thread_failures(void)
{
    return t_failed;
}

void kr_alloc_shield(int on)
{
    t_shield += on ? 1 : -1;
}

uint64_t kr_alloc_calls(void)
{
    return atomic_load_explicit(&g_calls, memory_order_relaxed);
}

void kr_alloc_fail_at(uint64_t n, int sticky)
{
    atomic_store(&g_fail_sticky, sticky);
    atomic_store(&g_fail_countdown, n);
}

size_t kr_alloc_bytes_in_use(void)
{
    return atomic_load(&g_in_use);
}

void *kr_malloc(size_t n)
{
    if (should_fail()) {
        return NULL;
    }
    if (n > SIZE_MAX - KR_ALLOC_HDR || !lim_take(n, 0)) {
        t_failed++;
        return NULL;
    }
    unsigned char *p = malloc(n + KR_ALLOC_HDR);
    if (!p) {
        lim_take(0, n);
        t_failed++;
        return NULL;
    }
    memcpy(p, &n, sizeof n);
    atomic_fetch_add(&g_in_use, n);
    return p + KR_ALLOC_HDR;
}

void *kr_calloc(size_t count, size_t size)
{
    if (size && count > SIZE_MAX / size) {
        t_failed++;
        return NULL;
    }
    void *p = kr_malloc(count * size);
    if (p) {
        memset(p, 0, count * size);
    }
    return p;
}

void *kr_realloc(void *p, size_t n)
{
    if (!p) {
        return kr_malloc(n);
    }
    if (should_fail()) {
        return NULL;
    }
    if (n > SIZE_MAX - KR_ALLOC_HDR) {
        t_failed++;
        return NULL;
    }
    unsigned char *base = (unsigned char *)p - KR_ALLOC_HDR;
    size_t old;
    memcpy(&old, base, sizeof old);
    if (!lim_take(n, old)) {
        t_failed++;
        return NULL;
    }
    unsigned char *q = realloc(base, n + KR_ALLOC_HDR);
    if (!q) {
        lim_take(old, n);
        t_failed++;
        return NULL;
    }
    memcpy(q, &n, sizeof n);
    atomic_fetch_sub(&g_in_use, old);
    atomic_fetch_add(&g_in_use, n);
    return q + KR_ALLOC_HDR;
}

void kr_free(void *p)
{
    if (!p) {
        return;
    }
    unsigned char *base = (unsigned char *)p - KR_ALLOC_HDR;
    size_t n;
    memcpy(&n, base, sizeof n);
    atomic_fetch_sub(&g_in_use, n);
    lim_take(0, n);
    free(base);
}

char *kr_strndup(const char *s, size_t n)
{
    char *d = kr_malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

char *kr_strdup(const char *s)
{
    return kr_strndup(s, strlen(s));
}
