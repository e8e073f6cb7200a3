#pragma once
/* Host memory. All host allocations of the project go through these functions, which keep
 * accounting and have a test hook that makes the Nth call fail (fault-injection loops).
 * kr_free(NULL) is a no-op. Thread-safe. */
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void *kr_malloc(size_t n);
void *kr_calloc(size_t count, size_t size);
void *kr_realloc(void *p, size_t n);
void kr_free(void *p);
/* Duplicates a NUL-terminated string (caller frees with kr_free); NULL on OOM. */
char *kr_strdup(const char *s);
char *kr_strndup(const char *s, size_t n);

/* Bytes currently allocated through kr_malloc & co. */
size_t kr_alloc_bytes_in_use(void);
/* Test hook: the `n`-th allocation from now (1-based) fails, and every later one too if
 * `sticky`. n = 0 disables injection. */
void kr_alloc_fail_at(uint64_t n, int sticky);
/* Allocations failed by the hook since the process started. A fault loop compares it before and
 * after an operation: an operation that succeeded while the count stayed put ran without reaching
 * the armed failure, so every allocation point of it has been walked. */
uint64_t kr_alloc_failures(void);
/* Allocations that returned NULL on the calling thread so far, injected or not. A caller compares it
 * around a library call whose errors do not say "out of memory" reliably (jansson 2.14 reports a key
 * it could not copy as a syntax error). */
uint64_t kr_alloc_thread_failures(void);
/* Shields the calling thread from injected failures while on (calls nest): an injected failure
 * is counted (kr_alloc_failures, kr_alloc_thread_failures) but the memory is allocated anyway. For
 * a library call that does not survive a failed allocation, whose caller refuses the result when
 * the count moved: jansson 2.14's parser, whose string buffer drops the byte it could not save and
 * then reads past the end when that byte was a closing quote (a heap overflow). A real failure of
 * malloc is not shielded. */
void kr_alloc_shield(int on);
/* Allocation calls (kr_malloc, kr_calloc, kr_realloc, the string copies) since the process started,
 * failed ones included: how many points a loop has to walk. */
uint64_t kr_alloc_calls(void);

/* A memory limit for one piece of work on the calling thread (a client's request while it is parsed,
 * rendered and tokenized): between begin and end, an allocation of this thread that would take the
 * bytes it holds, net of what it frees, beyond `limit` fails like an out-of-memory. end returns true
 * when an allocation failed for that reason, and the peak reached in *peak (when not NULL). Scopes do
 * not nest. */
void kr_alloc_limit_begin(size_t limit);
int kr_alloc_limit_end(size_t *peak);

#ifdef __cplusplus
}
#endif
