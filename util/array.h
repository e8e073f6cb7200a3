#pragma once
/* Growable arrays: a pointer, a count and an int32_t capacity kept by the caller; this makes room.
 *
 *     if (KR_ARRAY_RESERVE(s->toks, s->cap_toks, s->n_toks + 1, 64) != KR_OK) {
 *         return KR_ERR_NOMEM;
 *     }
 *     s->toks[s->n_toks++] = tok;
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Makes *arrp (a pointer to the array's pointer, of elements of `elem` bytes, `*cap` of them
 * allocated with kr_malloc) hold at least `need` elements: when need > *cap the capacity becomes
 * min_cap (when it was 0) or twice the old one, doubled until it holds `need`. KR_ERR_NOMEM leaves
 * the array and *cap as they were. */
enum kr_status kr_array_reserve(void *arrp, int32_t *cap, int64_t need, size_t elem, int32_t min_cap);

#define KR_ARRAY_RESERVE(arr, cap, need, min_cap) \
    kr_array_reserve(&(arr), &(cap), (need), sizeof *(arr), (min_cap))

/* Appends n bytes of src to the text *p (len bytes used, cap allocated with kr_malloc), keeping it
 * NUL-terminated; the capacity at least doubles when it grows. false (text unchanged) when out of
 * memory. */
bool kr_text_append(char **p, size_t *len, size_t *cap, const char *src, size_t n);

#ifdef __cplusplus
}
#endif
