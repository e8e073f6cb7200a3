#include "array.h"

#include "alloc.h"

#include <string.h>

enum kr_status kr_array_reserve(void *arrp, int32_t *cap, int64_t need, size_t elem, int32_t min_cap)
{
    if (need <= *cap) {
        return KR_OK;
    }
    int64_t nc = *cap > 0 ? 2 * (int64_t)*cap : (min_cap > 0 ? min_cap : 1);
    while (nc < need) {
        nc *= 2;
    }
    if (nc > INT32_MAX || (uint64_t)nc > SIZE_MAX / elem) {
        return KR_ERR_NOMEM;
    }
    void *old; /* *arrp is some T *: read and written as bytes, whatever T is */
    memcpy(&old, arrp, sizeof old);
    void *p = kr_realloc(old, (size_t)nc * elem);
    if (!p) {
        return KR_ERR_NOMEM;
    }
    memcpy(arrp, &p, sizeof p);
    *cap = (int32_t)nc;
    return KR_OK;
}

bool kr_text_append(char **p, size_t *len, size_t *cap, const char *src, size_t n)
{
    if (n > SIZE_MAX / 2 - *len - 1) {
        return false;
    }
    if (*len + n + 1 > *cap) {
        const size_t nc = (*len + n + 1) * 2;
        char *np = kr_realloc(*p, nc);
        if (!np) {
            return false;
        }
        *p = np;
        *cap = nc;
    }
    memcpy(*p + *len, src, n);
    *len += n;
    (*p)[*len] = 0;
    return true;
}
