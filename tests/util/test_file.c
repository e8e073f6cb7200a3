/* util/file: whole-file reads with a size limit and errors that name the path. */
#include "file.h"

#include "alloc.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Writes n bytes of `data` to a new temporary file; returns its path in `path` (>= 32 bytes). */
static void write_temp(char *path, const void *data, size_t n)
{
    strcpy(path, "/tmp/kr_file_test_XXXXXX");
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, (const char *)data + done, n - done);
        cr_assert_gt(w, 0);
        done += (size_t)w;
    }
    close(fd);
}

Test(file, reads_whole_file_nul_terminated)
{
    char path[64];
    const char text[] = "{\"a\": 1}\n\0tail"; /* an embedded NUL is data */
    write_temp(path, text, sizeof text - 1);
    char *buf = NULL;
    size_t len = 0;
    struct kr_err err = {0};
    cr_assert_eq(kr_file_read(path, 1 << 20, &buf, &len, &err), KR_OK, "%s", err.msg);
    cr_expect_eq(len, sizeof text - 1);
    cr_expect(memcmp(buf, text, len) == 0);
    cr_expect_eq(buf[len], 0);
    kr_free(buf);
    unlink(path);
}

Test(file, empty_file_gives_an_empty_buffer)
{
    char path[64];
    write_temp(path, "", 0);
    char *buf = NULL;
    size_t len = 1;
    struct kr_err err = {0};
    cr_assert_eq(kr_file_read(path, 16, &buf, &len, &err), KR_OK, "%s", err.msg);
    cr_expect_eq(len, 0);
    cr_assert_not_null(buf);
    cr_expect_eq(buf[0], 0);
    kr_free(buf);
    unlink(path);
}

Test(file, missing_path_is_named)
{
    const char *path = "/nonexistent-krait-dir/tokenizer.json";
    char *buf = (char *)1;
    size_t len = 0;
    struct kr_err err = {0};
    cr_expect_eq(kr_file_read(path, 1 << 20, &buf, &len, &err), KR_ERR_IO);
    cr_expect_null(buf);
    cr_expect(strstr(err.msg, path) == err.msg, "message: %s", err.msg);
    cr_expect(strstr(err.msg, "cannot open") != NULL, "message: %s", err.msg);
    cr_expect(strstr(err.msg, "No such file") != NULL, "message: %s", err.msg);
}

Test(file, limit_is_inclusive_and_enforced)
{
    char path[64];
    char data[100];
    memset(data, 'x', sizeof data);
    write_temp(path, data, sizeof data);
    char *buf = NULL;
    size_t len = 0;
    struct kr_err err = {0};
    cr_assert_eq(kr_file_read(path, 100, &buf, &len, &err), KR_OK, "%s", err.msg);
    cr_expect_eq(len, 100);
    kr_free(buf);
    buf = (char *)1;
    cr_expect_eq(kr_file_read(path, 99, &buf, &len, &err), KR_ERR_IO);
    cr_expect_null(buf);
    cr_expect(strstr(err.msg, path) == err.msg, "message: %s", err.msg);
    cr_expect(strstr(err.msg, "limit of 99 bytes") != NULL, "message: %s", err.msg);
    unlink(path);
}

Test(file, reads_files_that_report_no_size)
{
    /* /proc files report size 0: the buffer grows as they are read */
    char *buf = NULL;
    size_t len = 0;
    struct kr_err err = {0};
    cr_assert_eq(kr_file_read("/proc/self/status", 1 << 20, &buf, &len, &err), KR_OK, "%s", err.msg);
    cr_expect_gt(len, 0);
    cr_expect(strncmp(buf, "Name:", 5) == 0, "%.20s", buf);
    cr_expect_eq(strlen(buf), len);
    kr_free(buf);
    /* and the limit holds for them too */
    cr_expect_eq(kr_file_read("/proc/self/status", 4, &buf, &len, &err), KR_ERR_IO);
    cr_expect(strstr(err.msg, "limit of 4 bytes") != NULL, "message: %s", err.msg);
}

Test(file, larger_than_one_read_buffer)
{
    char path[64];
    const size_t n = 300000;
    char *data = malloc(n);
    cr_assert_not_null(data);
    for (size_t i = 0; i < n; i++) {
        data[i] = (char)('a' + i % 26);
    }
    write_temp(path, data, n);
    char *buf = NULL;
    size_t len = 0;
    struct kr_err err = {0};
    cr_assert_eq(kr_file_read(path, n, &buf, &len, &err), KR_OK, "%s", err.msg);
    cr_expect_eq(len, n);
    cr_expect(memcmp(buf, data, n) == 0);
    kr_free(buf);
    free(data);
    unlink(path);
}

Test(file, out_of_memory_is_reported_and_leaks_nothing)
{
    char path[64];
    write_temp(path, "abc", 3);
    char *buf = (char *)1;
    size_t len = 0;
    struct kr_err err = {0};
    const size_t before = kr_alloc_bytes_in_use();
    kr_alloc_fail_at(1, 0);
    cr_expect_eq(kr_file_read(path, 16, &buf, &len, &err), KR_ERR_NOMEM);
    kr_alloc_fail_at(0, 0);
    cr_expect_null(buf);
    cr_expect(strstr(err.msg, path) == err.msg, "message: %s", err.msg);
    cr_expect_eq(kr_alloc_bytes_in_use(), before);
    unlink(path);
}
