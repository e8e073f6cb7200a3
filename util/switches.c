/* The KRAIT_* tuning switches (switches.h): the table, its parser and its listing. */
#include "switches.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

static const char *const mla_attn_names[] = {"per-head", "heads", NULL};     /* KR_MLA_ATTN_* */
static const char *const dsa_score_names[] = {"fp32", "mma", NULL};          /* KR_DSA_SCORE_* */

/* Where each entry of the table lands in struct kr_switches (KR_SWITCH_STEP fills fault_step and
 * fault_fatal). */
static const size_t g_offset[] = {
    offsetof(struct kr_switches, cuda_graphs), offsetof(struct kr_switches, mla_attn),
    offsetof(struct kr_switches, dsa_score),   offsetof(struct kr_switches, mla_overlap),
    offsetof(struct kr_switches, skinny_max),  offsetof(struct kr_switches, ssd_stream),
    offsetof(struct kr_switches, pdl),         offsetof(struct kr_switches, backend_sampling),
    offsetof(struct kr_switches, fault_step),  offsetof(struct kr_switches, fault_rank),
    offsetof(struct kr_switches, tp_peer_kb),  offsetof(struct kr_switches, tp_timeout_s),
    offsetof(struct kr_switches, tp_one_device), offsetof(struct kr_switches, fp8_skinny_max),
    offsetof(struct kr_switches, lt_tune),     offsetof(struct kr_switches, stream_gemm),
};

static const struct kr_switch g_table[] = {
    {"KRAIT_CUDA_GRAPHS", KR_SWITCH_BOOL, 0, 1, NULL, "1", KR_SWITCH_OPERATOR,
     "decode steps replay CUDA graphs; 0 runs every step eagerly (profilers, debugging)",
     NULL},
    {"KRAIT_MLA_ATTN", KR_SWITCH_ENUM, 0, 0, mla_attn_names, "heads", KR_SWITCH_MEASURE,
     "MLA attention: heads (a token's heads in one block, bf16 tensor cores) or per-head (fp32, a "
     "block per token and head)",
     "per-head stays as the path for other shapes; forcing it serves A/B runs only"},
    {"KRAIT_DSA_SCORE", KR_SWITCH_ENUM, 0, 0, dsa_score_names, "mma", KR_SWITCH_MEASURE,
     "DSA indexer scores: mma (bf16 tensor cores where the shape fits) or fp32 (CUDA cores)",
     "fp32 stays as the path for shapes the MMA kernel does not fit; forcing it serves A/B runs only"},
    {"KRAIT_MLA_OVERLAP", KR_SWITCH_BOOL, 0, 1, NULL, "1", KR_SWITCH_MEASURE,
     "the DSA selection runs on a second stream beside the query absorption; 0 runs them in turn",
     "serial against overlapped, bit-identical either way (the GPU tests compare both with it)"},
    {"KRAIT_SKINNY_MAX", KR_SWITCH_INT, 0, KR_SKINNY_MAX_N, NULL, "8", KR_SWITCH_MEASURE,
     "most rows the skinny tensor-core GEMM takes (from 2); more go to cuBLAS; 0 = cuBLAS from 2 rows",
     "moves the skinny/cuBLAS crossover for A/B runs; 8 is the bound measured best (docs/PERF.md)"},
    {"KRAIT_SSD_STREAM", KR_SWITCH_BOOL, 0, 1, NULL, "1", KR_SWITCH_MEASURE,
     "the one-token SSM state update uses streaming cache hints (process-wide); 0 the default hints",
     "an A/B of the cache hints (same results; +1.1 % at batch 64, docs/PERF.md)"},
    {"KRAIT_PDL", KR_SWITCH_BOOL, 0, 1, NULL, "1", KR_SWITCH_MEASURE,
     "kernels launch as programmatic dependents of the one before (process-wide); 0 launches plainly",
     "an A/B of the launch mode, bit-identical either way (the GPU tests compare both with it)"},
    {"KRAIT_BACKEND_SAMPLING", KR_SWITCH_BOOL, 0, 1, NULL, "unset", KR_SWITCH_MEASURE,
     "1 draws tokens on the backend, 0 on the host; unset: on a GPU backend",
     "device against host sampling, same tokens either way; the host path stays for host-logit steps"},
    {"KRAIT_FAULT_STEP", KR_SWITCH_STEP, 0, 0, NULL, "unset", KR_SWITCH_TEST,
     "step attempt N fails as a transient error (N:fatal: as a lost device); reliability tests", NULL},
    {"KRAIT_FAULT_RANK", KR_SWITCH_INT, 0, 63, NULL, "0", KR_SWITCH_TEST,
     "the tensor-parallel rank whose step KRAIT_FAULT_STEP fails (it leaves the group); reliability tests",
     NULL},
    {"KRAIT_TP_PEER_KB", KR_SWITCH_INT, 0, 65536, NULL, "512", KR_SWITCH_MEASURE,
     "tensor parallel on GPUs with peer access: all-reduces up to this many KiB take the one-shot peer "
     "kernels, larger ones NCCL; 0 = NCCL only",
     "moves the peer-kernel/NCCL crossover for A/B runs (docs/TENSOR_PARALLEL.md)"},
    {"KRAIT_TP_TIMEOUT_S", KR_SWITCH_INT, 1, 86400, NULL, "300", KR_SWITCH_OPERATOR,
     "a tensor-parallel step (CUDA) not completed after this many seconds aborts the group (the server "
     "then exits with status 3)",
     NULL},
    {"KRAIT_TP_ONE_DEVICE", KR_SWITCH_BOOL, 0, 1, NULL, "0", KR_SWITCH_TEST,
     "1 puts every CUDA tensor-parallel rank on one device, collectives through its memory; tests",
     NULL},
    {"KRAIT_FP8_SKINNY_MAX", KR_SWITCH_INT, 0, 4096, NULL, "16", KR_SWITCH_MEASURE,
     "FP8 weights: products of up to this many rows take the tensor-core skinny kernel, more cuBLASLt's "
     "block-scaled matmul (its rows in multiples of 4, the rest skinny); 0 = cuBLASLt from 4 rows",
     "moves the crossover for A/B runs; the default is the bound measured best (docs/FP8.md)"},
    {"KRAIT_LT_TUNE", KR_SWITCH_BOOL, 0, 1, NULL, "1", KR_SWITCH_MEASURE,
     "bf16 products of 9..256 rows (weights of 4 MiB or more) take the cuBLASLt algorithm timed fastest "
     "for the shape and row class, timed when the class first runs; 0 = cuBLAS's own choice",
     "an A/B of the timed choice against cuBLAS's (docs/PERF.md)"},
    {"KRAIT_STREAM_GEMM", KR_SWITCH_BOOL, 0, 1, NULL, "0", KR_SWITCH_MEASURE,
     "1: bf16 products of 9..64 rows stream the weight through tensor copies into wgmma (krk_stream_gemm); "
     "0 = the cuBLAS paths",
     "an A/B of the kernel against cuBLAS's products (docs/PERF.md)"},
};
#define N_SWITCHES ((int)(sizeof g_table / sizeof g_table[0]))
_Static_assert(sizeof g_offset / sizeof g_offset[0] == sizeof g_table / sizeof g_table[0],
               "one struct field per table entry");
_Static_assert(sizeof g_table / sizeof g_table[0] <= 64, "kr_switches.given has 64 bits");

const struct kr_switch *kr_switches_table(int *n)
{
    *n = N_SWITCHES;
    return g_table;
}

void kr_switches_defaults(struct kr_switches *sw)
{
    memset(sw, 0, sizeof *sw); /* padding too: two default structs compare equal byte for byte */
    sw->cuda_graphs = 1;
    sw->mla_attn = KR_MLA_ATTN_HEADS;
    sw->dsa_score = KR_DSA_SCORE_MMA;
    sw->mla_overlap = 1;
    sw->skinny_max = KR_SKINNY_MAX_DEFAULT;
    sw->ssd_stream = 1;
    sw->pdl = 1;
    sw->backend_sampling = -1;
    sw->tp_peer_kb = 512;
    sw->tp_timeout_s = 300;
    sw->fp8_skinny_max = 16;
    sw->lt_tune = 1;
    sw->stream_gemm = 0;
    /* the others (faults, KRAIT_TP_ONE_DEVICE, given) are 0 */
}

/* An enum switch's names joined by `sep`, the last two by `last` ("a|b|c", "a, b or c"). */
static void join_names(const struct kr_switch *s, const char *sep, const char *last, char *buf, size_t cap)
{
    int n = 0;
    while (s->names[n]) {
        n++;
    }
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && len < cap; i++) {
        const int w = snprintf(buf + len, cap - len, "%s%s", i == 0 ? "" : i == n - 1 ? last : sep, s->names[i]);
        len += w > 0 ? (size_t)w : 0;
    }
}

void kr_switch_accepted(const struct kr_switch *s, char *buf, size_t cap)
{
    if (!cap) {
        return;
    }
    buf[0] = '\0';
    switch (s->type) {
    case KR_SWITCH_BOOL:
        snprintf(buf, cap, "0|1");
        break;
    case KR_SWITCH_INT:
        snprintf(buf, cap, "%d..%d", (int)s->lo, (int)s->hi);
        break;
    case KR_SWITCH_STEP:
        snprintf(buf, cap, "N|N:fatal");
        break;
    case KR_SWITCH_ENUM:
        join_names(s, "|", "|", buf, cap);
        break;
    }
}

/* "0 or 1", "an integer in 0..16", "fp32 or mma", "N or N:fatal with N >= 1" */
static void expected(const struct kr_switch *s, char *buf, size_t cap)
{
    switch (s->type) {
    case KR_SWITCH_BOOL:
        snprintf(buf, cap, "0 or 1");
        break;
    case KR_SWITCH_INT:
        snprintf(buf, cap, "an integer in %d..%d", (int)s->lo, (int)s->hi);
        break;
    case KR_SWITCH_STEP:
        snprintf(buf, cap, "N or N:fatal with N >= 1");
        break;
    case KR_SWITCH_ENUM:
        join_names(s, ", ", " or ", buf, cap);
        break;
    }
}

/* The value of `v` for switch `s` into *out (and fatal for KR_SWITCH_STEP); false when refused. */
static bool parse_one(const struct kr_switch *s, const char *v, int64_t *out, int32_t *fatal)
{
    char *end = NULL;
    switch (s->type) {
    case KR_SWITCH_BOOL:
        if (!strcmp(v, "0") || !strcmp(v, "1")) {
            *out = v[0] - '0';
            return true;
        }
        return false;
    case KR_SWITCH_INT: {
        errno = 0;
        const long x = strtol(v, &end, 10);
        if (end == v || *end || errno || x < s->lo || x > s->hi) {
            return false;
        }
        *out = x;
        return true;
    }
    case KR_SWITCH_ENUM:
        for (int i = 0; s->names[i]; i++) {
            if (!strcmp(v, s->names[i])) {
                *out = i;
                return true;
            }
        }
        return false;
    case KR_SWITCH_STEP: {
        errno = 0;
        const long long x = strtoll(v, &end, 10);
        if (end == v || errno || x < 1 || (*end && strcmp(end, ":fatal"))) {
            return false;
        }
        *out = x;
        *fatal = *end != 0;
        return true;
    }
    }
    return false;
}

enum kr_status kr_switches_parse(struct kr_switches *sw, const char *(*get)(const char *name), struct kr_err *err)
{
    kr_switches_defaults(sw);
    struct kr_switches r = *sw;
    for (int i = 0; i < N_SWITCHES; i++) {
        const struct kr_switch *s = &g_table[i];
        const char *v = get ? get(s->name) : getenv(s->name);
        if (!v || !*v) {
            continue; /* unset or empty: the default */
        }
        int64_t x = 0;
        int32_t fatal = 0;
        if (!parse_one(s, v, &x, &fatal)) {
            char exp[160];
            expected(s, exp, sizeof exp);
            return kr_err_set(err, KR_ERR_INVAL, "%s=%s: expected %s (unset: %s)", s->name, v, exp, s->def);
        }
        char *field = (char *)&r + g_offset[i];
        if (s->type == KR_SWITCH_STEP) {
            r.fault_step = x;
            r.fault_fatal = fatal;
        } else {
            const int32_t x32 = (int32_t)x;
            memcpy(field, &x32, sizeof x32);
        }
        r.given |= 1ull << i;
    }
    *sw = r;
    return KR_OK;
}

enum kr_status kr_switches_from_env(struct kr_switches *sw, struct kr_err *err)
{
    return kr_switches_parse(sw, NULL, err);
}

bool kr_switches_given(const struct kr_switches *sw, const char *name)
{
    for (int i = 0; i < N_SWITCHES; i++) {
        if (!strcmp(g_table[i].name, name)) {
            return (sw->given >> i) & 1u;
        }
    }
    return false;
}

static const char *use_name(enum kr_switch_use u)
{
    return u == KR_SWITCH_OPERATOR ? "operator" : u == KR_SWITCH_MEASURE ? "measurement only" : "tests only";
}

void kr_switches_print(FILE *f)
{
    fprintf(f, "Tuning switches, read from the environment when a backend or engine is created. Unset or\n"
               "empty means the default; any value not accepted is an error naming the variable\n"
               "(krait serve exits 2). Measurement-only switches exist for A/B runs and could be removed.\n"
               "(KRAIT_HOST, KRAIT_PORT, KRAIT_API_KEY, KRAIT_MODEL, KRAIT_THREADS, KRAIT_DEVICE and\n"
               "KRAIT_LOG_LEVEL stand for flags: see --help.)\n\n");
    fprintf(f, "  %-24s %-18s %-8s %s\n", "switch", "values", "default", "use");
    for (int i = 0; i < N_SWITCHES; i++) {
        const struct kr_switch *s = &g_table[i];
        char acc[96];
        kr_switch_accepted(s, acc, sizeof acc);
        fprintf(f, "  %-24s %-18s %-8s %s\n", s->name, acc, s->def, use_name(s->use));
        fprintf(f, "      %s\n", s->help);
        if (s->why) {
            fprintf(f, "      could go: %s\n", s->why);
        }
    }
}
