/* util/array: the growable array and the growing NUL-terminated text. */
#include "alloc.h"
#include "array.h"

#include <criterion/criterion.h>
#include <string.h>

Test(array, reserve_grows_and_keeps_the_elements)
{
    int32_t *a = NULL, cap = 0;
    for (int32_t i = 0; i < 1000; i++) {
        cr_assert_eq(KR_ARRAY_RESERVE(a, cap, i + 1, 8), KR_OK);
        cr_assert_geq(cap, i + 1);
        a[i] = i * 3;
    }
    for (int32_t i = 0; i < 1000; i++) {
        cr_expect_eq(a[i], i * 3);
    }
    kr_free(a);
}

/* Pieces appended one by one equal the same bytes written at once (strcat as the reference),
 * NUL-terminated after every append; a failed allocation leaves the text as it was. */
Test(array, text_append_equals_concatenation)
{
    char *t = NULL, ref[4096] = "";
    size_t len = 0, cap = 0;
    const char *pieces[] = {"", "a", "bc", "hello, world", "\xe2\x82\xac", "0123456789abcdef"};
    for (int i = 0; i < 200; i++) {
        const char *pc = pieces[i % 6];
        cr_assert(kr_text_append(&t, &len, &cap, pc, strlen(pc)));
        strcat(ref, pc);
        cr_assert_eq(len, strlen(ref));
        cr_assert_str_eq(t, ref);
        cr_assert_gt(cap, len);
    }
    kr_alloc_fail_at(1, 1);
    const size_t before = len;
    bool ok = true;
    for (int i = 0; i < 64 && ok; i++) { /* until the text must grow */
        ok = kr_text_append(&t, &len, &cap, "0123456789abcdef", 16);
        if (ok) {
            strcat(ref, "0123456789abcdef");
        }
    }
    kr_alloc_fail_at(0, 0);
    cr_expect(!ok, "a growth that cannot allocate fails");
    cr_expect_geq(len, before);
    cr_expect_str_eq(t, ref, "a failed append leaves the text as it was");
    kr_free(t);
}
