/* The main of a fuzz harness outside libFuzzer: every file named on the command line, and every
 * regular file of every directory named there (not recursively), is passed once to
 * LLVMFuzzerTestOneInput. LLVMFuzzerInitialize runs first when the harness defines it. The test
 * build links each tests/fuzz/fuzz_<name>.c with this file and runs it over corpus/<name>/, so that
 * an input that once crashed, hung or leaked fails the test suite if it does again (the sanitizers
 * of the test build do the checking). Exits 0 when every input ran, 1 when a file could not be
 * read or no input was found. */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

/* Reads the whole file at `path` and runs it. Returns 0, or -1 when it cannot be read. */
static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) {
            break;
        }
        uint8_t *nb = realloc(buf, cap * 2);
        if (!nb) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = nb;
        cap *= 2;
    }
    int bad = ferror(f) || !buf;
    fclose(f);
    if (bad) {
        fprintf(stderr, "replay: %s: cannot read\n", path);
        free(buf);
        return -1;
    }
    /* An exact-size copy, so that ASan sees a read past the input's end as the fuzzer would. */
    uint8_t *exact = malloc(n ? n : 1);
    if (!exact) {
        free(buf);
        return -1;
    }
    memcpy(exact, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
    return 0;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Runs every regular file of directory `dir` in name order; *count gets the number run. */
static int run_dir(const char *dir, size_t *count)
{
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "replay: %s: %s\n", dir, strerror(errno));
        return -1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    const struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') {
            continue;
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            char **nn = realloc(names, cap * sizeof *nn);
            if (!nn) {
                rc = -1;
                break;
            }
            names = nn;
        }
        size_t len = strlen(dir) + 1 + strlen(de->d_name) + 1;
        if (!(names[n] = malloc(len))) {
            rc = -1;
            break;
        }
        snprintf(names[n++], len, "%s/%s", dir, de->d_name);
    }
    closedir(d);
    if (n > 1) {
        qsort(names, n, sizeof *names, cmp_str);
    }
    for (size_t i = 0; i < n; i++) {
        struct stat sb;
        if (rc == 0 && stat(names[i], &sb) == 0 && S_ISREG(sb.st_mode)) {
            if (run_file(names[i]) != 0) {
                rc = -1;
            } else {
                (*count)++;
            }
        }
        free(names[i]);
    }
    free(names);
    return rc;
}

int main(int argc, char **argv)
{
    if (LLVMFuzzerInitialize) {
        LLVMFuzzerInitialize(&argc, &argv);
    }
    size_t count = 0;
    int rc = 0;
    for (int i = 1; i < argc; i++) {
        struct stat sb;
        if (stat(argv[i], &sb) != 0) {
            fprintf(stderr, "replay: %s: %s\n", argv[i], strerror(errno));
            rc = 1;
        } else if (S_ISDIR(sb.st_mode)) {
            rc |= run_dir(argv[i], &count) != 0;
        } else {
            const int r = run_file(argv[i]);
            rc |= r != 0;
            count += r == 0;
        }
    }
    if (count == 0) {
        fprintf(stderr, "replay: no input found\n");
        return 1;
    }
    printf("replay: %zu inputs ran\n", count);
    return rc;
}
