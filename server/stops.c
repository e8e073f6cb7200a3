#include "stops.h"

#include <string.h>

void kr_stops_init(struct kr_stops *st, const char *const *strs, int32_t n)
{
    st->s = strs;
    st->n = n;
    st->max_len = 0;
    for (int32_t i = 0; i < n; i++) {
        const size_t l = strlen(strs[i]);
        st->max_len = l > st->max_len ? l : st->max_len;
    }
}

int32_t kr_stops_find(const struct kr_stops *st, const char *text, size_t len, size_t from, size_t *at)
{
    int32_t best = -1;
    size_t best_at = 0;
    for (int32_t i = 0; i < st->n; i++) {
        const char *s = st->s[i];
        const size_t sl = strlen(s);
        if (sl == 0 || len < sl) {
            continue;
        }
        /* an occurrence that ends after `from` starts at from - (sl - 1) or later */
        const size_t start = from >= sl - 1 ? from - (sl - 1) : 0;
        for (size_t p = start; p + sl <= len && (best < 0 || p < best_at); p++) {
            if (!memcmp(text + p, s, sl)) {
                best = i;
                best_at = p;
                break;
            }
        }
    }
    if (best >= 0) {
        *at = best_at;
    }
    return best;
}

size_t kr_stops_sendable(const struct kr_stops *st, const char *text, size_t len, size_t sent, bool final)
{
    if (final || st->max_len <= 1) {
        return len;
    }
    const size_t keep = st->max_len - 1;
    size_t n = len > keep ? len - keep : 0;
    while (n > 0 && n < len && ((unsigned char)text[n] & 0xc0) == 0x80) {
        n--; /* never split a character */
    }
    return n < sent ? sent : n;
}
