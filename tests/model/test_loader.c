#define _GNU_SOURCE
/* Loader behaviour on synthetic checkpoints: every config alias and non-finite float spelling is
 * accepted, and every kind of broken checkpoint is a clear error naming the file, the tensor and
 * what was expected. */
#include "ckpt-writer.h"

#include "alloc.h"
#include "cache.h"
#include "model.h"
#include "runner.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static char dir[256];
static struct ckw W;

static void setup(void)
{
    ckw_tmpdir(dir, sizeof dir);
    ckw_tiny_nemotron(&W, "backbone.");
}

static void teardown(void)
{
    ckw_rmtree(dir);
}

static void write_config(const char *pattern_json, const char *limit_hi)
{
    char cfg[4096], path[512];
    ckw_tiny_config(cfg, sizeof cfg, pattern_json, limit_hi);
    snprintf(path, sizeof path, "%s/config.json", dir);
    ckw_write_text(path, cfg);
}

static void write_weights(void)
{
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    ckw_write(&W, path);
}

/* Loads and returns the status; the message lands in err. */
static enum kr_status try_load(struct kr_err *err, struct kr_model **out)
{
    kr_backend_t be = kr_backend_cpu_create(1);
    struct kr_model *m = NULL;
    memset(err, 0, sizeof *err);
    enum kr_status st = kr_model_load(dir, be, &m, err);
    if (out && st == KR_OK) {
        *out = m;
        return st; /* caller frees model and backend through free_loaded */
    }
    kr_model_free(m);
    kr_backend_free(be);
    return st;
}

static void free_loaded(struct kr_model *m)
{
    kr_backend_t be = m->be;
    kr_model_free(m);
    kr_backend_free(be);
}

#define PATTERN "\"hybrid_override_pattern\": \"M*-E\""

static void expect_error(enum kr_status want, const char *s1, const char *s2)
{
    struct kr_err err;
    enum kr_status st = try_load(&err, NULL);
    cr_expect_eq(st, want, "status %d (%s), expected %d; message: %s", st, kr_status_str(st), want, err.msg);
    if (s1) {
        cr_expect(strstr(err.msg, s1), "message \"%s\" does not mention \"%s\"", err.msg, s1);
    }
    if (s2) {
        cr_expect(strstr(err.msg, s2), "message \"%s\" does not mention \"%s\"", err.msg, s2);
    }
}

TestSuite(loader, .init = setup, .fini = teardown);

Test(loader, loads_a_valid_checkpoint_and_runs_it)
{
    write_config(PATTERN, "Infinity");
    write_weights();
    struct kr_err err;
    struct kr_model *m = NULL;
    cr_assert_eq(try_load(&err, &m), KR_OK, "%s", err.msg);
    cr_expect_str_eq(m->cfg.pattern, "M*-E");
    cr_expect_eq(m->cfg.m_d_inner, 16);
    cr_expect_eq(m->cfg.m_conv_dim, 32);
    cr_expect(isinf(m->cfg.m_dt_max));
    cr_expect_eq(m->cfg.shared_ffn, 8);
    cr_expect(m->layers[2].mlp.gate.data == NULL, "relu2 MLP without gate_proj is non-gated");
    struct kr_cache *c = NULL;
    cr_assert_eq(kr_cache_create(m, 1, 4, 4, &c), KR_OK);
    const int32_t ids[5] = {1, 5, 9, 30, 2};
    float lp[5 * 32];
    cr_assert_eq(kr_run_prompt_logprobs(m, c, ids, 5, 0, lp, &err), KR_OK, "%s", err.msg);
    for (int t = 0; t < 5; t++) {
        double sum = 0;
        for (int v = 0; v < 32; v++) {
            cr_assert(isfinite(lp[t * 32 + v]));
            sum += exp(lp[t * 32 + v]);
        }
        cr_expect(fabs(sum - 1.0) < 1e-5, "row %d sums to %g", t, sum);
    }
    kr_cache_free(c);
    free_loaded(m);
}

Test(loader, accepts_every_spelling_of_infinity)
{
    static const char *const spellings[] = {"Infinity", "\"Infinity\"", "{\"__float__\": \"Infinity\"}", "1e309"};
    write_weights();
    for (size_t i = 0; i < sizeof spellings / sizeof spellings[0]; i++) {
        write_config(PATTERN, spellings[i]);
        struct kr_err err;
        struct kr_model *m = NULL;
        cr_assert_eq(try_load(&err, &m), KR_OK, "%s: %s", spellings[i], err.msg);
        cr_expect(isinf(m->cfg.m_dt_max) && m->cfg.m_dt_max > 0, "%s gave %g", spellings[i], m->cfg.m_dt_max);
        free_loaded(m);
    }
}

Test(loader, reads_a_finite_time_step_limit)
{
    write_weights();
    write_config(PATTERN, "0.25");
    struct kr_err err;
    struct kr_model *m = NULL;
    cr_assert_eq(try_load(&err, &m), KR_OK, "%s", err.msg);
    cr_expect_float_eq(m->cfg.m_dt_max, 0.25f, 1e-7);
    free_loaded(m);
}

Test(loader, accepts_both_layer_type_vocabularies)
{
    static const char *const forms[] = {
        "\"layers_block_type\": [\"mamba\", \"attention\", \"mlp\", \"moe\"]",
        "\"layers_block_type\": [\"linear_attention\", \"full_attention\", \"mlp\", \"moe\"]",
        "\"hybrid_override_pattern\": \"M*|-E\"",
    };
    write_weights();
    for (size_t i = 0; i < 3; i++) {
        write_config(forms[i], "Infinity");
        struct kr_err err;
        struct kr_model *m = NULL;
        cr_assert_eq(try_load(&err, &m), KR_OK, "%s: %s", forms[i], err.msg);
        cr_expect_str_eq(m->cfg.pattern, "M*-E", "%s", forms[i]);
        free_loaded(m);
    }
}

Test(loader, accepts_legacy_key_aliases)
{
    write_weights();
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    ckw_write_text(path,
                   "{\"model_type\": \"nemotron_h\", \"hybrid_override_pattern\": \"M*-E\", \"vocab_size\": 32,"
                   " \"hidden_size\": 16, \"rms_norm_eps\": 1e-5, \"mamba_num_heads\": 4, \"mamba_head_dim\": 4,"
                   " \"mamba_n_groups\": 2, \"ssm_state_size\": 4, \"mamba_d_conv\": 4, \"mamba_chunk_size\": 4,"
                   " \"mamba_conv_bias\": true, \"mamba_dt_limit\": [0.0, Infinity], \"num_attention_heads\": 2,"
                   " \"num_key_value_heads\": 1, \"attention_head_dim\": 8, \"intermediate_size\": 24,"
                   " \"num_local_experts\": 4, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 8,"
                   " \"moe_shared_expert_intermediate_size\": 8, \"n_group\": 2, \"topk_group\": 1}");
    struct kr_err err;
    struct kr_model *m = NULL;
    cr_assert_eq(try_load(&err, &m), KR_OK, "%s", err.msg);
    cr_expect_eq(m->cfg.m_groups, 2);
    cr_expect_eq(m->cfg.m_conv, 4);
    cr_expect_eq(m->cfg.m_chunk, 4);
    cr_expect_eq(m->cfg.head_dim, 8);
    cr_expect_eq(m->cfg.n_expert, 4);
    free_loaded(m);
}

Test(loader, loads_the_model_prefix_and_fused_experts)
{
    ckw_tiny_nemotron(&W, "model.");
    char n[160];
    for (int e = 0; e < 4; e++) {
        snprintf(n, sizeof n, "model.layers.3.mixer.experts.%d.up_proj.weight", e);
        cr_assert_eq(ckw_remove(&W, n), 0);
        snprintf(n, sizeof n, "model.layers.3.mixer.experts.%d.down_proj.weight", e);
        cr_assert_eq(ckw_remove(&W, n), 0);
    }
    ckw_add(&W, "model.layers.3.mixer.experts.up_proj", KR_DTYPE_BF16, 3, (const int64_t[]){4, 8, 16});
    ckw_add(&W, "model.layers.3.mixer.experts.down_proj", KR_DTYPE_BF16, 3, (const int64_t[]){4, 16, 8});
    write_weights();
    write_config(PATTERN, "Infinity");
    struct kr_err err;
    struct kr_model *m = NULL;
    cr_assert_eq(try_load(&err, &m), KR_OK, "%s", err.msg);
    /* expert e's up projection is slice e of the fused tensor */
    const char *base = m->layers[3].moe.up[0].data;
    cr_expect_eq((const char *)m->layers[3].moe.up[2].data - base, 2 * 8 * 16 * 2);
    free_loaded(m);
}

Test(loader, rejects_a_missing_tensor)
{
    cr_assert_eq(ckw_remove(&W, "backbone.layers.0.mixer.A_log"), 0);
    write_weights();
    write_config(PATTERN, "Infinity");
    expect_error(KR_ERR_FORMAT, "backbone.layers.0.mixer.A_log", "missing");
}

Test(loader, rejects_an_unexpected_tensor)
{
    ckw_add(&W, "backbone.layers.2.mixer.extra.weight", KR_DTYPE_BF16, 1, (const int64_t[]){4});
    write_weights();
    write_config(PATTERN, "Infinity");
    expect_error(KR_ERR_FORMAT, "backbone.layers.2.mixer.extra.weight", "model.safetensors");
}

Test(loader, rejects_a_wrong_shape)
{
    ckw_get(&W, "backbone.layers.1.mixer.k_proj.weight")->shape[0] = 16;
    write_weights();
    write_config(PATTERN, "Infinity");
    expect_error(KR_ERR_FORMAT, "backbone.layers.1.mixer.k_proj.weight", "expected [8, 16]");
}

Test(loader, rejects_a_wrong_dtype)
{
    ckw_get(&W, "backbone.layers.2.mixer.up_proj.weight")->dt = KR_DTYPE_I32;
    write_weights();
    write_config(PATTERN, "Infinity");
    expect_error(KR_ERR_UNSUPPORTED, "backbone.layers.2.mixer.up_proj.weight", "I32");
}

Test(loader, rejects_fp8_weights_without_block_scales)
{
    ckw_get(&W, "backbone.layers.2.mixer.up_proj.weight")->dt = KR_DTYPE_F8_E4M3;
    write_weights();
    write_config(PATTERN, "Infinity");
    expect_error(KR_ERR_FORMAT, "backbone.layers.2.mixer.up_proj.weight_scale_inv", "missing");
}

Test(loader, rejects_a_truncated_file)
{
    write_weights();
    write_config(PATTERN, "Infinity");
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *fp = fopen(path, "r+b");
    fseek(fp, 0, SEEK_END);
    long sz = ftell(fp);
    fclose(fp);
    cr_assert_eq(truncate(path, sz - 100), 0);
    expect_error(KR_ERR_FORMAT, "model.safetensors", "truncated");
}

Test(loader, rejects_a_header_length_overflow)
{
    write_config(PATTERN, "Infinity");
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *fp = fopen(path, "wb");
    uint64_t huge = UINT64_MAX - 4;
    fwrite(&huge, 8, 1, fp);
    fputs("{}", fp);
    fclose(fp);
    struct kr_err err;
    cr_expect_neq(try_load(&err, NULL), KR_OK);
    cr_expect(strstr(err.msg, "model.safetensors"), "%s", err.msg);
    cr_expect(strstr(err.msg, "header"), "%s", err.msg);
}

Test(loader, rejects_a_malformed_header)
{
    write_config(PATTERN, "Infinity");
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *fp = fopen(path, "wb");
    const char hdr[] = "{\"a\": {\"dtype\": \"BF16\", \"shape\": [2], \"data_offsets\": [0, 4]";
    uint64_t n = sizeof hdr - 1;
    fwrite(&n, 8, 1, fp);
    fwrite(hdr, 1, n, fp);
    fwrite("\0\0\0\0", 1, 4, fp);
    fclose(fp);
    expect_error(KR_ERR_FORMAT, "model.safetensors", NULL);
}

Test(loader, rejects_malformed_config_json)
{
    write_weights();
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    ckw_write_text(path, "{\"model_type\": \"nemotron_h\",\n \"vocab_size\": 32,,}");
    expect_error(KR_ERR_FORMAT, "config.json", "line 2");
}

Test(loader, rejects_an_unsupported_layer_letter)
{
    write_weights();
    write_config("\"hybrid_override_pattern\": \"M*X-E\"", "Infinity");
    expect_error(KR_ERR_UNSUPPORTED, "config.json", "'X'");
}

Test(loader, rejects_an_unknown_layer_type_name)
{
    write_weights();
    write_config("\"layers_block_type\": [\"mamba\", \"attention\", \"conv\", \"moe\"]", "Infinity");
    expect_error(KR_ERR_UNSUPPORTED, "config.json", "\"conv\"");
}

Test(loader, rejects_a_missing_required_key)
{
    write_weights();
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    ckw_write_text(path, "{\"model_type\": \"nemotron_h\", \"hybrid_override_pattern\": \"M*-E\", \"hidden_size\": 16}");
    expect_error(KR_ERR_FORMAT, "config.json", "vocab_size");
}

Test(loader, rejects_an_unsupported_model_type)
{
    write_weights();
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    ckw_write_text(path, "{\"model_type\": \"llama\"}");
    expect_error(KR_ERR_UNSUPPORTED, "config.json", "llama");
}

Test(loader, rejects_a_missing_shard)
{
    write_config(PATTERN, "Infinity");
    char path[512];
    snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", dir);
    ckw_write(&W, path);
    char idx[16384];
    size_t o = (size_t)snprintf(idx, sizeof idx, "{\"metadata\": {}, \"weight_map\": {");
    for (int i = 0; i < W.n; i++) {
        o += (size_t)snprintf(idx + o, sizeof idx - o, "%s\"%s\": \"model-00001-of-00002.safetensors\"", i ? ", " : "",
                              W.t[i].name);
    }
    snprintf(idx + o, sizeof idx - o, ", \"lm_head.bias\": \"model-00002-of-00002.safetensors\"}}");
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    ckw_write_text(path, idx);
    expect_error(KR_ERR_IO, "model-00002-of-00002.safetensors", NULL);
}

Test(loader, loads_a_sharded_checkpoint)
{
    write_config(PATTERN, "Infinity");
    struct ckw a = {.n = 0}, b = {.n = 0};
    for (int i = 0; i < W.n; i++) {
        struct ckw *dst = i % 2 ? &b : &a;
        dst->t[dst->n++] = W.t[i];
    }
    char path[512], idx[16384];
    snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", dir);
    ckw_write(&a, path);
    snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
    ckw_write(&b, path);
    size_t o = (size_t)snprintf(idx, sizeof idx, "{\"metadata\": {\"total_size\": 1}, \"weight_map\": {");
    for (int i = 0; i < W.n; i++) {
        o += (size_t)snprintf(idx + o, sizeof idx - o, "%s\"%s\": \"model-0000%d-of-00002.safetensors\"",
                              i ? ", " : "", W.t[i].name, i % 2 + 1);
    }
    snprintf(idx + o, sizeof idx - o, "}}");
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    ckw_write_text(path, idx);
    struct kr_err err;
    struct kr_model *m = NULL;
    cr_assert_eq(try_load(&err, &m), KR_OK, "%s", err.msg);
    free_loaded(m);
}

Test(loader, rejects_gqa_attention_mixed_with_mla)
{
    write_weights();
    write_config("\"hybrid_override_pattern\": \"M*D-E\"", "Infinity");
    expect_error(KR_ERR_UNSUPPORTED, "config.json", "'*'");
}

Test(loader, rejects_inconsistent_head_counts)
{
    write_weights();
    char cfg[4096], path[512];
    ckw_tiny_config(cfg, sizeof cfg, PATTERN, "Infinity");
    char *p = strstr(cfg, "\"num_key_value_heads\": 1");
    memcpy(p, "\"num_key_value_heads\": 3", strlen("\"num_key_value_heads\": 3"));
    snprintf(path, sizeof path, "%s/config.json", dir);
    ckw_write_text(path, cfg);
    expect_error(KR_ERR_FORMAT, "config.json", "num_key_value_heads");
}

/* ---- DSA checkpoints: broken copies of the HF deepseek_v32 fixtures ------------------------------- */

/* Copies fixture `rel` into the test directory, then replaces the first `from` in `file` with `to`
 * (same length for binary files, so offsets stay valid). */
static void copy_fixture_edit(const char *rel, const char *file, const char *from, const char *to)
{
    char src[512];
    snprintf(src, sizeof src, "%s/%s", KR_FIXTURES, rel);
    ckw_copy_edit(src, dir, file, from, to);
}

Test(loader, loads_the_dsa_fixtures_unchanged)
{
    copy_fixture_edit("deepseek_v32/ds_fp8", NULL, NULL, NULL);
    struct kr_err err;
    struct kr_model *m = NULL;
    cr_assert_eq(try_load(&err, &m), KR_OK, "%s", err.msg);
    cr_expect_str_eq(m->cfg.pattern, "D-DEDEDE");
    cr_expect(m->cfg.fp8_weights);
    cr_expect_eq(m->cfg.n_mtp_layers, 1);
    free_loaded(m);
}

Test(loader, rejects_an_index_head_dim_below_the_rope_dim)
{
    copy_fixture_edit("deepseek_v32/ds_yarn", "config.json", "\"index_head_dim\": 32", "\"index_head_dim\": 8");
    expect_error(KR_ERR_FORMAT, "index_head_dim", "qk_rope_head_dim");
}

Test(loader, rejects_head_counts_that_do_not_match_the_tensors)
{
    copy_fixture_edit("deepseek_v32/ds_yarn", "config.json", "\"num_attention_heads\": 4", "\"num_attention_heads\": 3");
    expect_error(KR_ERR_FORMAT, "q_b_proj.weight", "expected [");
}

Test(loader, rejects_indexer_heads_that_do_not_match_the_tensors)
{
    copy_fixture_edit("hybrid/hy_mdme", "config.json", "\"index_n_heads\": 4", "\"index_n_heads\": 2");
    expect_error(KR_ERR_FORMAT, "indexer.", "expected [");
}

/* Megatron's shared top-k selections: a D layer may only reuse the selection of a D layer with an
 * indexer (offset 1 makes layer 2 reuse layer 1, a Mamba layer), and the DeepSeek layout has no
 * hybrid-stack numbering for them. */
Test(loader, rejects_a_shared_selection_without_a_d_layer_at_its_source)
{
    copy_fixture_edit("hybrid/hy_share", "config.json", "\"index_skip_topk_offset\": 3", "\"index_skip_topk_offset\": 1");
    expect_error(KR_ERR_FORMAT, "index_skip_topk_offset 1", "not a D layer");
}

Test(loader, rejects_shared_selections_in_the_deepseek_layout)
{
    copy_fixture_edit("deepseek_v32/ds_yarn", "config.json", "\"index_topk\": 8", "\"index_topk\": 8, \"index_topk_freq\": 2");
    expect_error(KR_ERR_UNSUPPORTED, "index_topk_freq 2", "hybrid layout");
}

Test(loader, rejects_fp8_weights_whose_scales_are_missing)
{
    copy_fixture_edit("deepseek_v32/ds_fp8", "model.safetensors", "o_proj.weight_scale_inv", "o_proj.weight_scale_inX");
    expect_error(KR_ERR_FORMAT, "o_proj.weight_scale_inv", "missing");
}

Test(loader, rejects_an_unsupported_rope_type)
{
    copy_fixture_edit("deepseek_v32/ds_yarn", "config.json", "\"yarn\"", "\"llama3\"");
    expect_error(KR_ERR_UNSUPPORTED, "rope_type", "llama3");
}

/* ---- allocation failures ------------------------------------------------------------------------ */

/* SQLite's OOM loop over whole loads: the N-th allocation of a load fails (once, then from there
 * on), N = 1, 2, ... until a load completes without reaching it. Every failure must be a load
 * error that says out of memory and names the checkpoint, leave nothing allocated, and never
 * yield a model (a load that absorbed a failure would serve a damaged one); the embedded model
 * and one checkpoint of each fixture family. */
Test(loader, every_allocation_failure_is_a_named_load_error)
{
    static const char *const dirs[] = {
        KR_FIXTURES "/../../models/tiny-hybrid",
        KR_FIXTURES "/nemotron_h/nh_moe",
        KR_FIXTURES "/hybrid/hy_mdme",
        KR_FIXTURES "/deepseek_v32/ds_short",
    };
    kr_backend_t be = kr_backend_cpu_create(1);
    cr_assert(be);
    const size_t base = kr_alloc_bytes_in_use();
    for (size_t d = 0; d < sizeof dirs / sizeof dirs[0]; d++) {
        for (int sticky = 0; sticky < 2; sticky++) {
            uint64_t n = 1;
            for (;; n++) {
                cr_assert_lt(n, 100000, "%s: never loaded", dirs[d]);
                struct kr_model *m = NULL;
                struct kr_err err = {0};
                const uint64_t f0 = kr_alloc_failures();
                kr_alloc_fail_at(n, sticky);
                const enum kr_status st = kr_model_load(dirs[d], be, &m, &err);
                kr_alloc_fail_at(0, 0);
                const bool fired = kr_alloc_failures() != f0;
                if (st == KR_OK) {
                    cr_assert(!fired, "%s: loaded although allocation %llu failed", dirs[d], (unsigned long long)n);
                    cr_expect_gt(m->n_params, 0);
                    kr_model_free(m);
                    cr_assert_eq(kr_alloc_bytes_in_use(), base);
                    break;
                }
                cr_assert(fired, "%s: failed without an injected failure: %s", dirs[d], err.msg);
                cr_assert_eq(st, KR_ERR_NOMEM, "%s, allocation %llu: status %d: %s", dirs[d], (unsigned long long)n,
                             st, err.msg);
                cr_assert(strstr(err.msg, "out of memory") && strstr(err.msg, dirs[d]),
                          "%s, allocation %llu: the message names neither: \"%s\"", dirs[d], (unsigned long long)n,
                          err.msg);
                cr_assert_null(m);
                cr_assert_eq(kr_alloc_bytes_in_use(), base, "%s, allocation %llu: %lld bytes left", dirs[d],
                             (unsigned long long)n, (long long)(kr_alloc_bytes_in_use() - base));
            }
            cr_log_info("%s (%s): loaded at allocation %llu", dirs[d], sticky ? "sticky" : "once",
                        (unsigned long long)n);
        }
    }
    kr_backend_free(be);
}

/* A scaling factor that is finite as a double but overflows the float the router multiplies by
 * (found by fuzzing config.json): refused, naming the key. */
Test(loader, rejects_a_routed_scaling_factor_beyond_float)
{
    copy_fixture_edit("deepseek_v32/ds_short", "config.json", "\"routed_scaling_factor\": 2.5",
                      "\"routed_scaling_factor\": 1e300");
    expect_error(KR_ERR_FORMAT, "routed_scaling_factor", "finite");
}

/* Widths within the old bound of 2^40 whose product overflowed an int64 while the config was read
 * (mamba_num_heads x mamba_head_dim = 2^64, found by fuzzing config.json; undefined behaviour, and
 * tensor sizes computed from garbage): a width, head count or expert count above 2^20 is refused,
 * naming the key and the bound. */
Test(loader, rejects_widths_whose_products_overflow)
{
    copy_fixture_edit("nemotron_h/nh_gated", "config.json", "\"mamba_num_heads\": 8,\n  \"mamba_head_dim\": 16",
                      "\"mamba_num_heads\": 4294967296,\n  \"mamba_head_dim\": 4294967296");
    expect_error(KR_ERR_FORMAT, "mamba_num_heads", "at most 1048576");
}

/* n_shared_experts had no upper bound: times moe_intermediate_size it overflowed (the default of
 * the shared expert's width). */
Test(loader, rejects_a_shared_expert_count_beyond_the_bound)
{
    copy_fixture_edit("deepseek_v32/ds_short", "config.json", "\"n_shared_experts\": 1",
                      "\"n_shared_experts\": 4611686018427387904");
    expect_error(KR_ERR_FORMAT, "n_shared_experts", "at most 1048576");
}
