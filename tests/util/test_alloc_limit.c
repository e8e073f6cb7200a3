/* kr_alloc_limit_begin/end: a thread's allocations held at once, net of its frees, stay under the
 * limit; other threads are not counted. */
#include "alloc.h"

#include <criterion/criterion.h>
#include <pthread.h>

Test(alloc_limit, counts_what_the_thread_holds_net_of_frees)
{
    kr_alloc_limit_begin(1000);
    void *a = kr_malloc(600);
    cr_assert_not_null(a);
    cr_expect_null(kr_malloc(500), "600 + 500 held at once exceeds 1000");
    kr_free(a);
    void *b = kr_malloc(900); /* fits once the first block is gone */
    cr_assert_not_null(b);
    void *c = kr_realloc(b, 1000);
    cr_assert_not_null(c, "a realloc counts its new size less its old one");
    cr_expect_null(kr_realloc(c, 1001), "beyond the limit");
    size_t peak = 0;
    cr_expect_eq(kr_alloc_limit_end(&peak), 1, "end reports that an allocation failed for the limit");
    cr_expect_eq(peak, 1000);
    void *d = kr_malloc(5000); /* the scope is over */
    cr_expect_not_null(d);
    kr_free(c);
    kr_free(d);
}

Test(alloc_limit, a_block_from_before_the_scope_freed_in_it_does_not_make_room)
{
    void *old = kr_malloc(4000);
    kr_alloc_limit_begin(100);
    kr_free(old);
    cr_expect_null(kr_malloc(200), "freeing older memory gives no credit");
    void *ok = kr_malloc(100);
    cr_expect_not_null(ok);
    cr_expect_eq(kr_alloc_limit_end(NULL), 1);
    kr_free(ok);
    kr_alloc_limit_begin(100);
    cr_expect_eq(kr_alloc_limit_end(NULL), 0, "nothing refused: end says so");
}

static void *other_thread(void *arg)
{
    (void)arg;
    return kr_malloc(1 << 20);
}

Test(alloc_limit, other_threads_are_not_counted)
{
    kr_alloc_limit_begin(16);
    pthread_t t;
    void *p = NULL;
    pthread_create(&t, NULL, other_thread, NULL);
    pthread_join(t, &p);
    cr_expect_not_null(p);
    cr_expect_eq(kr_alloc_limit_end(NULL), 0);
    kr_free(p);
}
