#pragma once
/* The KRAIT_* tuning switches: one table (name, type, accepted values, default, help, and whether
 * a switch is an operator setting, exists only for measurements or only for tests), parsed from
 * the environment into a struct. An unset or empty variable takes the default; any other value
 * must be one the table accepts, else the parse fails with a message that names the variable, the
 * value and what is accepted. The backends and the engine parse at creation time, so that a
 * setenv before kr_backend_create / kr_engine_create takes effect. `krait serve --help-env` prints
 * the table; docs/CUDA.md carries the same table (tests/util/test_switches.c checks both). */
#include "status.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* KRAIT_MLA_ATTN (the values are the kernel library's KRK_MLA_ATTN_*) */
enum { KR_MLA_ATTN_PER_HEAD = 0, KR_MLA_ATTN_HEADS = 1 };
/* KRAIT_DSA_SCORE (KRK_DSA_SCORE_*) */
enum { KR_DSA_SCORE_FP32 = 0, KR_DSA_SCORE_MMA = 1 };
/* Bounds of KRAIT_SKINNY_MAX (the kernel library's KRK_SKINNY_MAX_N; backend/backend-cuda.c asserts
 * that they agree). */
enum { KR_SKINNY_MAX_N = 128, KR_SKINNY_MAX_DEFAULT = 8 };

struct kr_switches {
    int32_t cuda_graphs;      /* KRAIT_CUDA_GRAPHS: 1 = decode steps from CUDA graphs */
    int32_t mla_attn;         /* KRAIT_MLA_ATTN: KR_MLA_ATTN_* */
    int32_t dsa_score;        /* KRAIT_DSA_SCORE: KR_DSA_SCORE_* */
    int32_t mla_overlap;      /* KRAIT_MLA_OVERLAP: 1 = DSA selection on a second stream */
    int32_t skinny_max;       /* KRAIT_SKINNY_MAX: 0..KR_SKINNY_MAX_N (0: cuBLAS) */
    int32_t ssd_stream;       /* KRAIT_SSD_STREAM: 1 = the SSD streams states (process-wide) */
    int32_t pdl;              /* KRAIT_PDL: 1 = programmatic dependent launch (process-wide) */
    int32_t backend_sampling; /* KRAIT_BACKEND_SAMPLING: -1 (unset) = the engine config decides */
    int64_t fault_step;       /* KRAIT_FAULT_STEP: 0 = none, else step attempt N fails (tests) */
    int32_t fault_fatal;      /* KRAIT_FAULT_STEP=N:fatal: that failure is a lost device */
    int32_t fault_rank;       /* KRAIT_FAULT_RANK: the tensor-parallel rank whose step fails (0: rank 0) */
    int32_t tp_peer_kb;       /* KRAIT_TP_PEER_KB: largest all-reduce of the peer kernels, KiB (0: NCCL) */
    int32_t tp_timeout_s;     /* KRAIT_TP_TIMEOUT_S: longest a tensor-parallel step may take */
    int32_t tp_one_device;    /* KRAIT_TP_ONE_DEVICE: every CUDA rank on one device (tests) */
    int32_t fp8_skinny_max;   /* KRAIT_FP8_SKINNY_MAX: FP8 products of up to this many rows take the
                                 tensor-core skinny kernel, more cuBLASLt */
    int32_t lt_tune;          /* KRAIT_LT_TUNE: 1 = decode-sized bf16 products take the cuBLASLt
                                 algorithm timed fastest per shape and row class */
    int32_t stream_gemm;      /* KRAIT_STREAM_GEMM: 1 = bf16 products of 9..64 rows take
                                 krk_stream_gemm */
    uint64_t given;           /* bit i: table entry i was set (non-empty) in the environment */
};

enum kr_switch_type {
    KR_SWITCH_BOOL, /* 0 or 1 */
    KR_SWITCH_INT,  /* a decimal integer in lo..hi */
    KR_SWITCH_ENUM, /* one of names[] (the value is its index) */
    KR_SWITCH_STEP, /* N or N:fatal with N >= 1 (KRAIT_FAULT_STEP) */
};

enum kr_switch_use {
    KR_SWITCH_OPERATOR, /* an operator setting */
    KR_SWITCH_MEASURE,  /* exists for measurements (A/B runs) only; could be removed */
    KR_SWITCH_TEST,     /* exists for tests only */
};

struct kr_switch {
    const char *name;
    enum kr_switch_type type;
    int32_t lo, hi;             /* KR_SWITCH_INT */
    const char *const *names;   /* KR_SWITCH_ENUM, NULL-terminated */
    const char *def;            /* the default as written in the table (what an unset variable means) */
    enum kr_switch_use use;
    const char *help;           /* one line */
    const char *why;            /* measurement-only switches: why it could go (one line); else NULL */
};

/* The table, in a fixed order; *n receives its length. */
const struct kr_switch *kr_switches_table(int *n);
/* The defaults of every switch (what an empty environment gives). */
void kr_switches_defaults(struct kr_switches *sw);
/* Parses every switch with `get` (getenv when NULL): KR_OK, or KR_ERR_INVAL with a message such
 * as "KRAIT_DSA_SCORE=fp16: expected fp32 or mma" (sw then holds the defaults). */
enum kr_status kr_switches_parse(struct kr_switches *sw, const char *(*get)(const char *name), struct kr_err *err);
/* kr_switches_parse from the current environment. */
enum kr_status kr_switches_from_env(struct kr_switches *sw, struct kr_err *err);
/* Whether the switch called `name` was set in the environment sw was parsed from. */
bool kr_switches_given(const struct kr_switches *sw, const char *name);
/* The accepted values of a switch as one string ("0|1", "0..16", "fp32|mma", "N|N:fatal"). */
void kr_switch_accepted(const struct kr_switch *s, char *buf, size_t cap);
/* Prints the table for `krait serve --help-env`. */
void kr_switches_print(FILE *f);

#ifdef __cplusplus
}
#endif
