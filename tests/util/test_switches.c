/* The KRAIT_* tuning switch table (util/switches.h): every accepted value parses to its meaning,
 * typos and out-of-range values are refused with a message naming the variable, the value and what
 * is accepted, the defaults are the ones the backends had, docs/CUDA.md and `krait serve
 * --help-env` list every switch, and the backend and `krait serve` refuse a bad value. */
#include "backend.h"
#include "switches.h"

#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* ---- a fake environment of one variable ---------------------------------------------------- */

static const char *g_name, *g_value;

static const char *one_var(const char *name)
{
    return g_name && !strcmp(name, g_name) ? g_value : NULL;
}

static enum kr_status parse1(const char *name, const char *value, struct kr_switches *sw, struct kr_err *err)
{
    g_name = name;
    g_value = value;
    return kr_switches_parse(sw, one_var, err);
}

static const struct kr_switch *find(const char *name)
{
    int n;
    const struct kr_switch *t = kr_switches_table(&n);
    for (int i = 0; i < n; i++) {
        if (!strcmp(t[i].name, name)) {
            return &t[i];
        }
    }
    cr_assert_fail("no switch %s in the table", name);
    return NULL;
}

/* The field of `sw` that switch `name` sets (KRAIT_FAULT_STEP: fault_step). */
static int64_t field(const struct kr_switches *sw, const char *name)
{
    static const struct {
        const char *name;
        size_t off;
    } f[] = {
        {"KRAIT_CUDA_GRAPHS", offsetof(struct kr_switches, cuda_graphs)},
        {"KRAIT_MLA_ATTN", offsetof(struct kr_switches, mla_attn)},
        {"KRAIT_DSA_SCORE", offsetof(struct kr_switches, dsa_score)},
        {"KRAIT_MLA_OVERLAP", offsetof(struct kr_switches, mla_overlap)},
        {"KRAIT_SKINNY_MAX", offsetof(struct kr_switches, skinny_max)},
        {"KRAIT_SSD_STREAM", offsetof(struct kr_switches, ssd_stream)},
        {"KRAIT_PDL", offsetof(struct kr_switches, pdl)},
        {"KRAIT_BACKEND_SAMPLING", offsetof(struct kr_switches, backend_sampling)},
        {"KRAIT_FAULT_RANK", offsetof(struct kr_switches, fault_rank)},
        {"KRAIT_TP_PEER_KB", offsetof(struct kr_switches, tp_peer_kb)},
        {"KRAIT_TP_TIMEOUT_S", offsetof(struct kr_switches, tp_timeout_s)},
        {"KRAIT_TP_ONE_DEVICE", offsetof(struct kr_switches, tp_one_device)},
        {"KRAIT_FP8_SKINNY_MAX", offsetof(struct kr_switches, fp8_skinny_max)},
        {"KRAIT_LT_TUNE", offsetof(struct kr_switches, lt_tune)},
        {"KRAIT_STREAM_GEMM", offsetof(struct kr_switches, stream_gemm)},
    };
    if (!strcmp(name, "KRAIT_FAULT_STEP")) {
        return sw->fault_step;
    }
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        if (!strcmp(f[i].name, name)) {
            int32_t v;
            memcpy(&v, (const char *)sw + f[i].off, sizeof v);
            return v;
        }
    }
    cr_assert_fail("the test does not know %s", name);
    return 0;
}

/* ---- the table -------------------------------------------------------------------------------- */

Test(switches, table_lists_the_switches_the_code_had)
{
    static const char *const names[] = {
        "KRAIT_CUDA_GRAPHS", "KRAIT_MLA_ATTN", "KRAIT_DSA_SCORE", "KRAIT_MLA_OVERLAP",      "KRAIT_SKINNY_MAX",
        "KRAIT_SSD_STREAM",  "KRAIT_PDL",      "KRAIT_BACKEND_SAMPLING", "KRAIT_FAULT_STEP",
        "KRAIT_FAULT_RANK",  "KRAIT_TP_PEER_KB", "KRAIT_TP_TIMEOUT_S", "KRAIT_TP_ONE_DEVICE",
        "KRAIT_FP8_SKINNY_MAX", "KRAIT_LT_TUNE", "KRAIT_STREAM_GEMM",
    };
    int n;
    const struct kr_switch *t = kr_switches_table(&n);
    cr_assert_eq(n, (int)(sizeof names / sizeof names[0]));
    for (int i = 0; i < n; i++) {
        cr_expect_str_eq(t[i].name, names[i]);
        cr_expect(t[i].help && *t[i].help && !strchr(t[i].help, '\n'), "%s: one line of help", t[i].name);
        cr_expect_eq(t[i].use == KR_SWITCH_MEASURE, t[i].why != NULL,
                     "%s: a measurement-only switch says why it could go, no other does", t[i].name);
        cr_expect(t[i].def && *t[i].def, "%s: a default", t[i].name);
    }
    cr_expect_eq(find("KRAIT_CUDA_GRAPHS")->use, KR_SWITCH_OPERATOR);
    cr_expect_eq(find("KRAIT_FAULT_STEP")->use, KR_SWITCH_TEST);
    cr_expect_eq(find("KRAIT_FAULT_RANK")->use, KR_SWITCH_TEST);
    cr_expect_eq(find("KRAIT_TP_ONE_DEVICE")->use, KR_SWITCH_TEST);
    cr_expect_eq(find("KRAIT_TP_TIMEOUT_S")->use, KR_SWITCH_OPERATOR);
}

/* Switches removed on 2026-12-02 (their code paths went with them): not in the table, and a value
 * left in the environment changes nothing. */
Test(switches, removed_switches_are_gone)
{
    static const char *const gone[] = {"KRAIT_DSA_SELECT", "KRAIT_GEMV_CONFIG", "KRAIT_SKINNY_CONFIG",
                                       "KRAIT_CUDA_GRAPHS_MLA"};
    int n;
    const struct kr_switch *t = kr_switches_table(&n);
    struct kr_switches d;
    kr_switches_defaults(&d);
    for (size_t g = 0; g < sizeof gone / sizeof gone[0]; g++) {
        for (int i = 0; i < n; i++) {
            cr_expect(strcmp(t[i].name, gone[g]) != 0, "%s is still in the table", gone[g]);
        }
        struct kr_switches sw;
        struct kr_err err = {0};
        cr_assert_eq(parse1(gone[g], "1", &sw, &err), KR_OK, "%s=1: %s", gone[g], err.msg);
        cr_expect_eq(memcmp(&d, &sw, sizeof d), 0, "%s=1 changes nothing", gone[g]);
    }
}

Test(switches, defaults_are_the_backends_former_ones)
{
    struct kr_switches sw;
    struct kr_err err = {0};
    g_name = NULL;
    cr_assert_eq(kr_switches_parse(&sw, one_var, &err), KR_OK, "%s", err.msg);
    cr_expect_eq(sw.cuda_graphs, 1);
    cr_expect_eq(sw.mla_attn, KR_MLA_ATTN_HEADS);
    cr_expect_eq(sw.dsa_score, KR_DSA_SCORE_MMA);
    cr_expect_eq(sw.mla_overlap, 1);
    cr_expect_eq(sw.skinny_max, 8);
    cr_expect_eq(sw.ssd_stream, 1);
    cr_expect_eq(sw.pdl, 1);
    cr_expect_eq(sw.backend_sampling, -1, "unset: the engine config decides");
    cr_expect_eq(sw.fault_step, 0);
    cr_expect_eq(sw.fault_fatal, 0);
    cr_expect_eq(sw.tp_peer_kb, 512);
    cr_expect_eq(sw.tp_timeout_s, 300);
    cr_expect_eq(sw.tp_one_device, 0);
    cr_expect_eq(sw.lt_tune, 1);
    cr_expect_eq(sw.stream_gemm, 0);
    cr_expect_eq(sw.given, 0u);
    struct kr_switches d;
    kr_switches_defaults(&d);
    cr_expect_eq(memcmp(&d, &sw, sizeof d), 0);
}

Test(switches, the_written_default_is_the_default)
{
    int n;
    const struct kr_switch *t = kr_switches_table(&n);
    struct kr_switches d;
    kr_switches_defaults(&d);
    for (int i = 0; i < n; i++) {
        struct kr_switches sw;
        struct kr_err err = {0};
        if (!strcmp(t[i].def, "unset")) {
            cr_expect(!strcmp(t[i].name, "KRAIT_BACKEND_SAMPLING") || !strcmp(t[i].name, "KRAIT_FAULT_STEP"));
            continue;
        }
        cr_assert_eq(parse1(t[i].name, t[i].def, &sw, &err), KR_OK, "%s=%s: %s", t[i].name, t[i].def, err.msg);
        cr_expect_eq(field(&sw, t[i].name), field(&d, t[i].name), "%s: the table's default %s", t[i].name,
                     t[i].def);
    }
}

Test(switches, empty_means_unset)
{
    int n;
    const struct kr_switch *t = kr_switches_table(&n);
    struct kr_switches d;
    kr_switches_defaults(&d);
    for (int i = 0; i < n; i++) {
        struct kr_switches sw;
        struct kr_err err = {0};
        cr_assert_eq(parse1(t[i].name, "", &sw, &err), KR_OK, "%s=''", t[i].name);
        cr_expect_eq(memcmp(&d, &sw, sizeof d), 0, "%s='' gives the defaults", t[i].name);
    }
}

/* ---- every accepted value ------------------------------------------------------------------- */

Test(switches, accepts_every_valid_value)
{
    int n;
    const struct kr_switch *t = kr_switches_table(&n);
    for (int i = 0; i < n; i++) {
        const struct kr_switch *s = &t[i];
        struct kr_switches sw;
        struct kr_err err = {0};
        char v[32];
        switch (s->type) {
        case KR_SWITCH_BOOL:
        case KR_SWITCH_INT: {
            /* every value of a short range; both ends and about a hundred values of a long one */
            const int step = s->hi - s->lo > 256 ? (s->hi - s->lo) / 97 : 1;
            for (int x = s->lo; x <= s->hi; x = x < s->hi && x + step > s->hi ? s->hi : x + step) {
                snprintf(v, sizeof v, "%d", x);
                cr_assert_eq(parse1(s->name, v, &sw, &err), KR_OK, "%s=%s: %s", s->name, v, err.msg);
                cr_expect_eq(field(&sw, s->name), x, "%s=%s", s->name, v);
                cr_expect(kr_switches_given(&sw, s->name));
                if (x == s->hi) {
                    break;
                }
            }
            break;
        }
        case KR_SWITCH_ENUM:
            for (int x = 0; s->names[x]; x++) {
                cr_assert_eq(parse1(s->name, s->names[x], &sw, &err), KR_OK, "%s=%s: %s", s->name, s->names[x],
                             err.msg);
                cr_expect_eq(field(&sw, s->name), x, "%s=%s", s->name, s->names[x]);
            }
            break;
        case KR_SWITCH_STEP:
            cr_assert_eq(parse1(s->name, "1", &sw, &err), KR_OK, "%s", err.msg);
            cr_expect_eq(sw.fault_step, 1);
            cr_expect_eq(sw.fault_fatal, 0);
            cr_assert_eq(parse1(s->name, "37:fatal", &sw, &err), KR_OK, "%s", err.msg);
            cr_expect_eq(sw.fault_step, 37);
            cr_expect_eq(sw.fault_fatal, 1);
            break;
        }
    }
}

Test(switches, enum_values_keep_their_names)
{
    struct kr_switches sw;
    struct kr_err err = {0};
    cr_assert_eq(parse1("KRAIT_MLA_ATTN", "per-head", &sw, &err), KR_OK);
    cr_expect_eq(sw.mla_attn, KR_MLA_ATTN_PER_HEAD);
    cr_assert_eq(parse1("KRAIT_DSA_SCORE", "fp32", &sw, &err), KR_OK);
    cr_expect_eq(sw.dsa_score, KR_DSA_SCORE_FP32);
    cr_assert_eq(parse1("KRAIT_DSA_SCORE", "mma", &sw, &err), KR_OK);
    cr_expect_eq(sw.dsa_score, KR_DSA_SCORE_MMA);
    cr_assert_eq(parse1("KRAIT_MLA_ATTN", "heads", &sw, &err), KR_OK);
    cr_expect_eq(sw.mla_attn, KR_MLA_ATTN_HEADS);
    cr_assert_eq(parse1("KRAIT_BACKEND_SAMPLING", "0", &sw, &err), KR_OK);
    cr_expect_eq(sw.backend_sampling, 0);
    cr_assert_eq(parse1("KRAIT_CUDA_GRAPHS", "0", &sw, &err), KR_OK);
    cr_expect_eq(sw.cuda_graphs, 0);
    cr_expect_eq(sw.pdl, 1, "the other switches keep their defaults");
}

/* ---- refusals ---------------------------------------------------------------------------------- */

static void expect_refused(const char *name, const char *value, const char *accepted)
{
    struct kr_switches sw;
    struct kr_err err = {0};
    cr_assert_eq(parse1(name, value, &sw, &err), KR_ERR_INVAL, "%s=%s was accepted", name, value);
    char want[256];
    snprintf(want, sizeof want, "%s=%s: expected ", name, value);
    cr_expect(strstr(err.msg, want) != NULL, "%s=%s: the message names the variable and value: %s", name, value,
              err.msg);
    cr_expect(strstr(err.msg, accepted) != NULL, "%s=%s: the message says '%s': %s", name, value, accepted, err.msg);
    struct kr_switches d;
    kr_switches_defaults(&d);
    cr_expect_eq(memcmp(&d, &sw, sizeof d), 0, "a refused parse leaves the defaults");
}

Test(switches, refuses_typos_and_out_of_range_values)
{
    expect_refused("KRAIT_DSA_SCORE", "mmma", "fp32 or mma");
    expect_refused("KRAIT_DSA_SCORE", "FP32", "fp32 or mma");
    expect_refused("KRAIT_MLA_ATTN", "perhead", "per-head or heads");
    expect_refused("KRAIT_DSA_SCORE", "fp16", "fp32 or mma");
    expect_refused("KRAIT_SKINNY_MAX", "129", "an integer in 0..128");
    expect_refused("KRAIT_SKINNY_MAX", "-1", "an integer in 0..128");
    expect_refused("KRAIT_SKINNY_MAX", "8x", "an integer in 0..128");
    expect_refused("KRAIT_SKINNY_MAX", "99999999999999999999", "an integer in 0..128");
    expect_refused("KRAIT_SKINNY_MAX", "1.5", "an integer in 0..128");
    expect_refused("KRAIT_PDL", "off", "0 or 1");
    expect_refused("KRAIT_PDL", "2", "0 or 1");
    expect_refused("KRAIT_CUDA_GRAPHS", "false", "0 or 1");
    expect_refused("KRAIT_BACKEND_SAMPLING", "yes", "0 or 1");
    expect_refused("KRAIT_FAULT_STEP", "0", "N or N:fatal with N >= 1");
    expect_refused("KRAIT_FAULT_STEP", "2:fatl", "N or N:fatal with N >= 1");
    expect_refused("KRAIT_FAULT_STEP", ":fatal", "N or N:fatal with N >= 1");
}

Test(switches, every_switch_refuses_a_typo)
{
    int n;
    const struct kr_switch *t = kr_switches_table(&n);
    for (int i = 0; i < n; i++) {
        expect_refused(t[i].name, "nonsense", "expected");
        char v[64];
        switch (t[i].type) {
        case KR_SWITCH_BOOL:
        case KR_SWITCH_INT:
            snprintf(v, sizeof v, "%d", t[i].hi + 1);
            expect_refused(t[i].name, v, "expected");
            snprintf(v, sizeof v, "%d", t[i].lo - 1);
            expect_refused(t[i].name, v, "expected");
            break;
        case KR_SWITCH_ENUM:
            snprintf(v, sizeof v, "%sx", t[i].names[0]);
            expect_refused(t[i].name, v, t[i].names[0]);
            break;
        case KR_SWITCH_STEP:
            expect_refused(t[i].name, "-3", "N >= 1");
            break;
        }
    }
}

Test(switches, reads_the_current_environment)
{
    struct kr_switches sw;
    struct kr_err err = {0};
    setenv("KRAIT_DSA_SCORE", "fp32", 1);
    setenv("KRAIT_SKINNY_MAX", "0", 1);
    cr_assert_eq(kr_switches_from_env(&sw, &err), KR_OK, "%s", err.msg);
    cr_expect_eq(sw.dsa_score, KR_DSA_SCORE_FP32);
    cr_expect_eq(sw.skinny_max, 0);
    cr_expect(kr_switches_given(&sw, "KRAIT_SKINNY_MAX"));
    cr_expect(!kr_switches_given(&sw, "KRAIT_PDL"));
    setenv("KRAIT_DSA_SCORE", "fp16", 1);
    cr_expect_eq(kr_switches_from_env(&sw, &err), KR_ERR_INVAL);
    cr_expect(strstr(err.msg, "KRAIT_DSA_SCORE=fp16") != NULL, "%s", err.msg);
    unsetenv("KRAIT_DSA_SCORE");
    unsetenv("KRAIT_SKINNY_MAX");
}

/* ---- the backends refuse a bad value at creation ----------------------------------------------- */

Test(switches, backend_create_refuses_a_bad_switch)
{
    kr_backend_t be = NULL;
    struct kr_err err = {0};
    setenv("KRAIT_DSA_SCORE", "fp16", 1);
    cr_expect_eq(kr_backend_create("cpu", 1, &be, &err), KR_ERR_INVAL);
    cr_expect_null(be);
    cr_expect(strstr(err.msg, "KRAIT_DSA_SCORE=fp16: expected fp32 or mma") != NULL, "%s", err.msg);
    err.msg[0] = '\0';
    cr_expect_eq(kr_backend_cuda_create(0, true, &be, &err), KR_ERR_INVAL, "the switches are parsed before the device");
    cr_expect(strstr(err.msg, "KRAIT_DSA_SCORE=fp16") != NULL, "%s", err.msg);
    unsetenv("KRAIT_DSA_SCORE");
    cr_assert_eq(kr_backend_create("cpu", 1, &be, &err), KR_OK, "%s", err.msg);
    kr_backend_free(be);
}

/* ---- docs/CUDA.md and krait serve --help-env ------------------------------------------------ */

static char *slurp(FILE *f)
{
    size_t cap = 1 << 16, len = 0;
    char *s = malloc(cap);
    cr_assert(s);
    size_t r;
    while ((r = fread(s + len, 1, cap - len - 1, f)) > 0) {
        len += r;
        if (cap - len < 2) {
            cap *= 2;
            s = realloc(s, cap);
            cr_assert(s);
        }
    }
    s[len] = '\0';
    return s;
}

/* The line of `text` that starts with `start`, copied into line (empty when none). */
static void line_starting(const char *text, const char *start, char *line, size_t cap)
{
    line[0] = '\0';
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        if (!strncmp(p, start, strlen(start))) {
            const char *e = strchr(p, '\n');
            const size_t n = e ? (size_t)(e - p) : strlen(p);
            snprintf(line, cap, "%.*s", (int)(n < cap ? n : cap - 1), p);
            return;
        }
    }
}

static const char *use_word(enum kr_switch_use u)
{
    return u == KR_SWITCH_OPERATOR ? "operator" : u == KR_SWITCH_MEASURE ? "measurement only" : "tests only";
}

Test(switches, docs_cuda_md_has_the_table)
{
    FILE *f = fopen(KR_SOURCE_DIR "/docs/CUDA.md", "r");
    cr_assert(f, "cannot open docs/CUDA.md");
    char *doc = slurp(f);
    fclose(f);
    int n;
    const struct kr_switch *t = kr_switches_table(&n);
    for (int i = 0; i < n; i++) {
        char start[96], line[2048], acc[96], cell[256];
        snprintf(start, sizeof start, "| `%s` |", t[i].name);
        line_starting(doc, start, line, sizeof line);
        cr_expect(line[0], "docs/CUDA.md has no table row for %s", t[i].name);
        if (!line[0]) {
            continue;
        }
        kr_switch_accepted(&t[i], acc, sizeof acc);
        char esc[192]; /* a table cell writes | as \| */
        size_t k = 0;
        for (const char *c = acc; *c && k + 2 < sizeof esc; c++) {
            if (*c == '|') {
                esc[k++] = '\\';
            }
            esc[k++] = *c;
        }
        esc[k] = '\0';
        snprintf(cell, sizeof cell, "| `%s` |", esc);
        cr_expect(strstr(line, cell), "docs/CUDA.md, %s: accepted values %s: %s", t[i].name, esc, line);
        snprintf(cell, sizeof cell, "| %s |", t[i].def);
        cr_expect(strstr(line, cell), "docs/CUDA.md, %s: default %s: %s", t[i].name, t[i].def, line);
        snprintf(cell, sizeof cell, "| %s |", use_word(t[i].use));
        cr_expect(strstr(line, cell), "docs/CUDA.md, %s: %s: %s", t[i].name, use_word(t[i].use), line);
    }
    free(doc);
}

Test(switches, krait_serve_help_env_lists_every_switch)
{
    FILE *p = popen(KR_KRAIT_BIN " serve --help-env", "r");
    cr_assert(p);
    char *out = slurp(p);
    const int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "krait serve --help-env exits 0 (status %d)", st);
    int n;
    const struct kr_switch *t = kr_switches_table(&n);
    for (int i = 0; i < n; i++) {
        char start[96], line[512], acc[96];
        snprintf(start, sizeof start, "  %s ", t[i].name);
        line_starting(out, start, line, sizeof line);
        cr_expect(line[0], "--help-env lists %s:\n%s", t[i].name, out);
        kr_switch_accepted(&t[i], acc, sizeof acc);
        cr_expect(strstr(line, acc) && strstr(line, t[i].def) && strstr(line, use_word(t[i].use)),
                  "%s: values %s, default %s, %s: %s", t[i].name, acc, t[i].def, use_word(t[i].use), line);
        cr_expect(strstr(out, t[i].help), "%s: its help line", t[i].name);
        if (t[i].why) {
            cr_expect(strstr(out, t[i].why), "%s: why it could go", t[i].name);
        }
    }
    free(out);
    p = popen(KR_KRAIT_BIN " serve --help", "r");
    cr_assert(p);
    out = slurp(p);
    pclose(p);
    cr_expect(strstr(out, "--help-env"), "--help names --help-env");
    free(out);
}

Test(switches, krait_serve_exits_2_on_a_bad_switch)
{
    FILE *p = popen("KRAIT_DSA_SCORE=fp16 " KR_KRAIT_BIN " serve " KR_SOURCE_DIR
                    "/models/tiny-hybrid --device cpu --threads 1 --host 127.0.0.1 --port 0 2>&1",
                    "r");
    cr_assert(p);
    char *out = slurp(p);
    const int st = pclose(p);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 2, "exit status 2 (status %d):\n%s", st, out);
    cr_expect(strstr(out, "KRAIT_DSA_SCORE=fp16: expected fp32 or mma"), "the message:\n%s", out);
    free(out);
}
