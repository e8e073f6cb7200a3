/* `krait serve --quantization fp8` over HTTP: the FP8 checkpoint served with its matrices kept in FP8
 * answers each prompt position's log-probability exactly as the FP8 engine run in this process does
 * (the same CPU reference arithmetic, 1e-5), and differently from the server without the flag (by
 * the recipe's activation rounding): the flag reaches the loader. A value other than fp8 or none is
 * refused at start. */
#include "fixture.h"
#include "harness.h"

#include "alloc.h"
#include "runner.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#define FX KR_SOURCE_DIR "/tests/fixtures/"

TestSuite(fp8_http, .timeout = 300);

/* The served log-probability of each prompt token after the first (prompt_logprobs). */
static int served(const struct srv_proc *p, const int32_t *ids, int n, double *lp)
{
    char body[4096];
    size_t k = (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < n; i++) {
        k += (size_t)snprintf(body + k, sizeof body - k, "%s%d", i ? "," : "", ids[i]);
    }
    snprintf(body + k, sizeof body - k, "],\"max_tokens\":1,\"temperature\":0,\"prompt_logprobs\":0}");
    long st = 0;
    json_t *j = post_json(p, "/v1/completions", body, &st);
    cr_assert_eq(st, 200, "status %ld", st);
    json_t *pl = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "prompt_logprobs");
    if (!pl) {
        pl = json_object_get(j, "prompt_logprobs");
    }
    int got = 0;
    for (size_t t = 1; pl && t < json_array_size(pl) && (int)t < n; t++) {
        const char *key;
        json_t *v;
        json_object_foreach(json_array_get(pl, t), key, v) {
            if (json_integer_value(json_object_get(v, "rank")) >= 0 && atoi(key) == ids[t]) {
                lp[t] = json_number_value(json_object_get(v, "logprob"));
                got++;
            }
        }
    }
    json_decref(j);
    return got;
}

Test(fp8_http, the_served_fp8_checkpoint_answers_as_the_fp8_engine)
{
    /* the engine in this process, FP8 on */
    kr_backend_t be = kr_backend_cpu_create(1);
    struct kr_err err = {0};
    cr_assert_eq(kr_backend_set_fp8_weights(be, true, &err), KR_OK, "%s", err.msg);
    struct fx f;
    fx_load_on(&f, "deepseek_v32", "ds_fp8", be, 2);
    const struct fx_prompt *pr = &f.prompts[f.n_prompts - 1];
    const int n = pr->n < 40 ? pr->n : 40;
    float *lp = kr_malloc((size_t)n * (size_t)f.vocab * sizeof(float));
    cr_assert(lp);
    cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, pr->ids, n, 0, lp, &err), KR_OK, "%s", err.msg);
    struct srv_proc fp8, plain;
    /* the fixture loader scores the indexer in bf16 (HF's way): the servers too */
    srv_start(&fp8, FX "deepseek_v32/ds_fp8", "--skip-tokenizer-init", "--device", "cpu", "--quantization", "fp8",
              "--indexer", "bf16", NULL);
    srv_start(&plain, FX "deepseek_v32/ds_fp8", "--skip-tokenizer-init", "--device", "cpu", "--indexer", "bf16", NULL);
    double a[64] = {0}, b[64] = {0};
    cr_assert_eq(served(&fp8, pr->ids, n, a), n - 1, "every position's log-probability came back");
    cr_assert_eq(served(&plain, pr->ids, n, b), n - 1);
    double worst = 0, apart = 0;
    for (int t = 1; t < n; t++) {
        const double want = lp[(size_t)(t - 1) * (size_t)f.vocab + (size_t)pr->ids[t]];
        worst = fmax(worst, fabs(a[t] - want));
        apart = fmax(apart, fabs(b[t] - want));
    }
    fprintf(stderr, "  served FP8 against the FP8 engine: max %.2g; without the flag: max %.3g\n", worst, apart);
    cr_expect_leq(worst, 1e-5, "the FP8 server's log-probabilities differ from the FP8 engine's by %g", worst);
    cr_expect_gt(apart, 1e-3, "the server without --quantization answers as the FP8 engine (%g)", apart);
    cr_expect_eq(srv_stop(&fp8), 0);
    cr_expect_eq(srv_stop(&plain), 0);
    kr_free(lp);
    fx_free(&f);
}

Test(fp8_http, an_unknown_quantization_is_refused_at_start)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "%s serve " FX "deepseek_v32/ds_fp8 --skip-tokenizer-init --device cpu --port 0 --quantization int4 "
             "> fp8q.log 2>&1",
             KR_KRAIT_BIN);
    const int rc = system(cmd);
    cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) == 2, "exit status 2 (rc %d)", rc);
    FILE *fl = fopen("fp8q.log", "r");
    cr_assert(fl);
    char log[4096] = {0};
    (void)!fread(log, 1, sizeof log - 1, fl);
    fclose(fl);
    cr_expect(strstr(log, "--quantization") && strstr(log, "int4"), "the message names the flag and value: %s", log);
}

/* `--kv-cache-dtype fp8` over HTTP: the server answers each prompt position as the engine in this
 * process with FP8 caches does (1e-5), and differently from a server with bf16 (here: fp32) caches
 * and the same FP8 indexer (the flag reaches the caches); `--indexer bf16` with it is refused at
 * start on a DSA model, naming the contradiction; a value other than auto, bf16 or fp8 too. */
Test(fp8_http, the_fp8_kv_cache_is_served_as_the_engine_runs_it)
{
    kr_backend_t be = kr_backend_cpu_create(1);
    struct kr_err err = {0};
    struct fx f;
    fx_load_on(&f, "deepseek_v32", "ds_short", be, 2);
    cr_assert_eq(kr_model_set_kv_cache_dtype(f.m, KR_KV_CACHE_FP8, &err), KR_OK, "%s", err.msg);
    cr_assert(f.m->kv_fp8 && f.m->idx_fp8, "FP8 caches switch the FP8 indexer on");
    const struct fx_prompt *pr = &f.prompts[f.n_prompts - 1];
    const int n = pr->n < 40 ? pr->n : 40;
    float *lp = kr_malloc((size_t)n * (size_t)f.vocab * sizeof(float));
    cr_assert(lp);
    cr_assert_eq(kr_run_prompt_logprobs(f.m, f.c, pr->ids, n, 0, lp, &err), KR_OK, "%s", err.msg);
    struct srv_proc kv8, plain;
    srv_start(&kv8, FX "deepseek_v32/ds_short", "--skip-tokenizer-init", "--device", "cpu", "--kv-cache-dtype", "fp8",
              NULL);
    srv_start(&plain, FX "deepseek_v32/ds_short", "--skip-tokenizer-init", "--device", "cpu", "--indexer", "fp8", NULL);
    double a[64] = {0}, b[64] = {0};
    cr_assert_eq(served(&kv8, pr->ids, n, a), n - 1, "every position's log-probability came back");
    cr_assert_eq(served(&plain, pr->ids, n, b), n - 1);
    double worst = 0, apart = 0;
    for (int t = 1; t < n; t++) {
        const double want = lp[(size_t)(t - 1) * (size_t)f.vocab + (size_t)pr->ids[t]];
        worst = fmax(worst, fabs(a[t] - want));
        apart = fmax(apart, fabs(b[t] - want));
    }
    fprintf(stderr, "  served FP8 caches against the engine's: max %.2g; without the flag: max %.3g\n", worst, apart);
    cr_expect_leq(worst, 1e-5, "the FP8-cache server's log-probabilities differ from the engine's by %g", worst);
    cr_expect_gt(apart, 1e-3, "the server without --kv-cache-dtype answers as the FP8-cache engine (%g)", apart);
    cr_expect_eq(srv_stop(&kv8), 0);
    cr_expect_eq(srv_stop(&plain), 0);
    kr_free(lp);
    fx_free(&f);
    /* refusals at start */
    static const struct {
        const char *args, *needle;
    } bad[] = {{"--kv-cache-dtype fp8 --indexer bf16", "contradicts"}, {"--kv-cache-dtype fp16", "fp16"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd,
                 "%s serve " FX "deepseek_v32/ds_short --skip-tokenizer-init --device cpu --port 0 %s > kvq.log 2>&1",
                 KR_KRAIT_BIN, bad[i].args);
        const int rc = system(cmd);
        cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) != 0, "%s: a non-zero exit (rc %d)", bad[i].args, rc);
        FILE *fl = fopen("kvq.log", "r");
        cr_assert(fl);
        char log[8192] = {0};
        (void)!fread(log, 1, sizeof log - 1, fl);
        fclose(fl);
        cr_expect(strstr(log, bad[i].needle) != NULL, "%s: the message names it: %s", bad[i].args, log);
    }
}

/* `krait plan --kv-cache-dtype fp8` counts the FP8 caches' layout: per D/+ layer and token a latent
 * row of kv_lora e4m3 values, an fp32 scale per 128 of them and the rope part in bf16 (DeepSeek's
 * fp8_ds_mla), per D layer an index key of index_head_dim e4m3 values and an fp32 scale; computed here
 * from the checkpoint's config.json. */
Test(fp8_http, the_plan_counts_fp8_caches)
{
    json_error_t je;
    json_t *cfg = json_load_file(FX "deepseek_v32/ds_short/config.json", 0, &je);
    cr_assert(cfg, "%s", je.text);
    const long long kv_lora = json_integer_value(json_object_get(cfg, "kv_lora_rank")),
                    rope = json_integer_value(json_object_get(cfg, "qk_rope_head_dim")),
                    idx = json_integer_value(json_object_get(cfg, "index_head_dim")),
                    layers = json_integer_value(json_object_get(cfg, "num_hidden_layers"));
    json_decref(cfg);
    cr_assert(kv_lora > 0 && rope > 0 && idx > 0 && layers > 0);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s plan " FX "deepseek_v32/ds_short --kv-cache-dtype fp8 --json > kvplan.json 2> kvplan.err",
             KR_KRAIT_BIN);
    cr_assert_eq(system(cmd), 0);
    json_t *j = json_load_file("kvplan.json", 0, &je);
    cr_assert(j, "%s", je.text);
    json_t *pt = json_object_get(j, "cache_bytes_per_token");
    /* every deepseek_v32 layer has an MLA mixer with an indexer (DSA) */
    const long long lat = layers * (kv_lora + 4 * ((kv_lora + 127) / 128) + 2 * rope), ik = layers * (idx + 4);
    cr_expect_eq(json_integer_value(json_object_get(pt, "latent")), lat);
    cr_expect_eq(json_integer_value(json_object_get(pt, "indexer")), ik);
    cr_expect_eq(json_integer_value(json_object_get(pt, "total")), lat + ik);
    cr_expect_str_eq(json_string_value(json_object_get(j, "kv_cache_dtype")), "fp8");
    json_decref(j);
}
