#pragma once
/* What the fuzz harnesses share (optional for a harness): where the source tree is, for fixtures. */
#include <stdio.h>
#include <stdlib.h>

/* The source tree: $KR_FUZZ_SOURCE_DIR, or the tree the harness was built from. */
static inline const char *kr_fuzz_source_dir(void)
{
    const char *d = getenv("KR_FUZZ_SOURCE_DIR");
    return d && *d ? d : KR_FUZZ_SOURCE_DIR_DEFAULT;
}

/* Ends the process with a message: a harness found a broken invariant (the fuzzer saves the input). */
#define KR_FUZZ_CHECK(cond, ...)                                                                                  \
    do {                                                                                                          \
        if (!(cond)) {                                                                                            \
            fprintf(stderr, "fuzz check failed: %s: ", #cond);                                                    \
            fprintf(stderr, __VA_ARGS__);                                                                         \
            fputc('\n', stderr);                                                                                  \
            abort();                                                                                              \
        }                                                                                                         \
    } while (0)
