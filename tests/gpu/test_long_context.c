/* Long prompts as the server runs them, on the CUDA backend end to end: the forward workspace and
 * the backend scratch reserved as kr_engine_create does for `krait serve --max-model-len 131072`
 * (steps of --max-num-batched-tokens + 256 tokens, 256 sequences, contexts up to 131072, cache
 * blocks of 16), then a 70,000-token prompt prefilled in chunks of 2048 tokens, so that the chunks'
 * contexts cross 32768 and 65536 positions, and greedy decode steps (captured graphs) after it.
 *
 * The checkpoints are small in width (written here, random weights) but have every mixer of the two
 * 8B shapes, in two models since GQA and MLA layers cannot share one: Mamba-2 (M) and an MLP (-)
 * in both, GQA attention (*) in one, and in the other a DSA layer with DeepSeek-V3.2's latent shape (kv_lora
 * 512, rope 64: the head-batched MLA kernels, the selection overlapped with the absorption, the
 * tensor-core indexer) and top 2048. The sizes that grow with the context (indexer
 * score rows, block tables, the 256 MB cap on the selection's workspace that puts a 2048-token chunk
 * into several groups beyond 32768 positions) do not depend on the width, so these runs take the
 * paths the 8B models take at these contexts.
 *
 * What is checked: every step succeeds and leaves the device healthy; no device allocation happens
 * after the reservation (the prefill and the decode graphs fit it); the generated tokens'
 * log-probabilities are finite; the D layers did select, alongside the absorption; and the same run
 * with KRAIT_MLA_OVERLAP=0 and with KRAIT_PDL=0 gives bit-identical tokens and log-probabilities (the
 * backend's documented invariants, here at long contexts). The CPU reference is too slow for a
 * 70,000-token prefill; the kernels are compared with it at these contexts in test_attention.c,
 * test_mla.c and test_mamba2.c (chunks crossing 32768 and 65536 over random cached prefixes). */
#include "ckpt-writer.h"
#include "gpu-test.h"
#include "runner.h"

#include "alloc.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* what kr_engine_create reserves for `krait serve --max-model-len 131072` with default limits */
enum { SERVE_SEQS = 256, SERVE_LEN = 131072, SERVE_BLOCK = 16 };
enum { PROMPT = 70000, NEW = 8 };

/* Model dimensions (see the file comment). */
enum {
    H = 64, V = 256, NH = 8, NKV = 2, HD = 16,                        /* GQA: 8 query heads, 2 KV heads */
    QL = 64, KVL = 512, NOPE = 32, ROPE = 64, VD = 32, IH = 16, ID = 64, /* DSA */
    MH = 4, MP = 16, MS = 16, MG = 2, FF = 128,
};
/* GQA ('*') and MLA/DSA layers cannot share a model (they share num_attention_heads): each test
 * runs a DSA pattern and a GQA one. */
#define PATTERN_DSA "MDM-"
#define PATTERN_GQA "M*M-"
static const char *PATTERN = PATTERN_DSA;

static void write_model(const char *dir)
{
    static struct ckw W;
    memset(&W, 0, sizeof W);
    W.fan_in_scale = true;
    const struct ckw_shape d = {.hidden = H, .vocab = V, .heads = NH, .kv_heads = NKV, .head_dim = HD,
                                .q_lora = QL, .kv_lora = KVL, .nope = NOPE, .rope = ROPE, .v_dim = VD,
                                .idx_heads = IH, .idx_dim = ID, .ffn = FF, .m_heads = MH, .m_head_dim = MP,
                                .m_groups = MG, .m_state = MS};
    ckw_hybrid_tensors(&W, PATTERN, &d);
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    ckw_write(&W, path);
    char cfg[4096];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"NemotronHForCausalLM\"], \"model_type\": \"nemotron_h\", \"vocab_size\": %d,\n"
             " \"hidden_size\": %d, \"num_hidden_layers\": %d, \"hybrid_override_pattern\": \"%s\",\n"
             " \"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": %d, \"attention_bias\": false,\n"
             " \"q_lora_rank\": %d, \"kv_lora_rank\": %d, \"qk_nope_head_dim\": %d, \"qk_rope_head_dim\": %d,\n"
             " \"v_head_dim\": %d, \"index_n_heads\": %d, \"index_head_dim\": %d, \"index_topk\": 2048,\n"
             " \"rope_theta\": 10000.0, \"max_position_embeddings\": %d, \"intermediate_size\": %d,\n"
             " \"mlp_hidden_act\": \"relu2\", \"mlp_bias\": false, \"mamba_num_heads\": %d, \"mamba_head_dim\": %d,\n"
             " \"ssm_state_size\": %d, \"n_groups\": %d, \"conv_kernel\": 4, \"chunk_size\": 128,\n"
             " \"use_conv_bias\": true, \"mamba_hidden_act\": \"silu\", \"time_step_min\": 0.001,\n"
             " \"time_step_max\": 0.1, \"time_step_floor\": 0.0001, \"time_step_limit\": [0.0, \"Infinity\"],\n"
             " \"layer_norm_epsilon\": 1e-05, \"use_bias\": false, \"residual_in_fp32\": false,\n"
             " \"rescale_prenorm_residual\": true, \"mamba_ssm_cache_dtype\": \"float32\",\n"
             " \"tie_word_embeddings\": false, \"bos_token_id\": 1, \"eos_token_id\": 2, \"pad_token_id\": 0,\n"
             " \"torch_dtype\": \"bfloat16\"}\n",
             V, H, (int)strlen(PATTERN), PATTERN, NH, NKV, HD, QL, KVL, NOPE, ROPE, VD, IH, ID, SERVE_LEN, FF, MH,
             MP, MS, MG);
    snprintf(path, sizeof path, "%s/config.json", dir);
    ckw_write_text(path, cfg);
}

/* One run's results. */
struct lc_run {
    int32_t ids[NEW];
    float lp[NEW];
    int32_t n;
    uint64_t allocs;      /* device allocations during the prompt and the decode steps */
    uint64_t overlapped;  /* selections run alongside the attention */
    uint64_t selected;    /* indexer query rows (the D layers selected) */
};

/* The prompt through a fresh CUDA backend created with `env`=0 (NULL: the defaults), reserved as
 * the server reserves for steps of `chunk` tokens, in prefill chunks of `chunk` tokens. */
static void lc_serve(const char *dir, const int32_t *prompt, int32_t chunk, const char *env, struct lc_run *r)
{
    memset(r, 0, sizeof *r);
    unsetenv("KRAIT_PDL");
    unsetenv("KRAIT_MLA_OVERLAP");
    unsetenv("KRAIT_CUDA_GRAPHS");
    if (env) {
        setenv(env, "0", 1);
    }
    kr_backend_t be = NULL;
    struct kr_err err = {0};
    cr_assert_eq(kr_backend_cuda_create(0, true, &be, &err), KR_OK, "%s", err.msg);
    if (env) {
        unsetenv(env);
    }
    struct kr_model *m = NULL;
    cr_assert_eq(kr_model_load(dir, be, &m, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(kr_model_set_indexer(m, KR_INDEXER_BF16, &err), KR_OK, "%s", err.msg);
    cr_assert_eq(m->cfg.max_pos, SERVE_LEN);
    /* kr_engine_create's reservation: max_num_batched_tokens + max_num_seqs tokens a step */
    cr_assert_eq(kr_model_reserve(m, chunk + SERVE_SEQS, SERVE_SEQS, SERVE_SEQS, SERVE_LEN, SERVE_BLOCK), KR_OK);
    struct kr_cache *c = NULL;
    const int32_t blocks = (PROMPT + NEW + SERVE_BLOCK) / SERVE_BLOCK + 4;
    cr_assert_eq(kr_cache_create(m, 2, blocks, SERVE_BLOCK, &c), KR_OK);
    const uint64_t before = kr_backend_cuda_alloc_count(be);
    const enum kr_status st =
        kr_run_greedy(m, c, prompt, PROMPT, chunk, NEW, true, r->ids, r->lp, &r->n, &err);
    cr_assert_eq(st, KR_OK, "%d-token prompt in chunks of %d%s%s: %s", PROMPT, chunk, env ? ", " : "",
                 env ? env : "", err.msg);
    cr_assert(kr_backend_healthy(be), "the device failed during the %d-token prompt", PROMPT);
    r->allocs = kr_backend_cuda_alloc_count(be) - before;
    r->overlapped = kr_backend_cuda_overlap_count(be);
    r->selected = m->idx_query_rows;
    cr_assert_eq(r->n, NEW);
    for (int32_t i = 0; i < r->n; i++) {
        cr_expect(isfinite(r->lp[i]) && r->lp[i] <= 0.0f, "token %d: log-probability %g", i, (double)r->lp[i]);
        cr_expect(r->ids[i] >= 0 && r->ids[i] < V, "token %d: id %d", i, r->ids[i]);
    }
    fprintf(stderr, "  long context %s chunk %d: tokens", env ? env : "default", chunk);
    for (int32_t i = 0; i < r->n; i++) {
        fprintf(stderr, " %d (%.4f)", r->ids[i], (double)r->lp[i]);
    }
    fprintf(stderr, "; %llu allocations, %llu overlapped selections, %llu indexer rows\n",
            (unsigned long long)r->allocs, (unsigned long long)r->overlapped, (unsigned long long)r->selected);
    kr_cache_free(c);
    kr_model_free(m);
    kr_backend_free(be);
}

static void make_prompt(int32_t *ids)
{
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int32_t j = 0; j < PROMPT; j++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        ids[j] = (int32_t)(x % (uint64_t)V);
    }
}

static void expect_same(const struct lc_run *a, const struct lc_run *b, const char *what)
{
    cr_expect_eq(a->n, b->n, "%s: %d vs %d tokens", what, a->n, b->n);
    cr_expect(memcmp(a->ids, b->ids, sizeof a->ids) == 0, "%s: the generated tokens differ", what);
    cr_expect(memcmp(a->lp, b->lp, sizeof a->lp) == 0, "%s: the log-probabilities differ bit for bit", what);
}

Test(long_context, serving_chunked_prefill_crosses_32k_and_64k, .timeout = 900)
{
    GT_REQUIRE_GPU();
    char dir[256];
    ckw_tmpdir(dir, sizeof dir);
    PATTERN = PATTERN_DSA;
    write_model(dir);
    int32_t *prompt = kr_malloc((size_t)PROMPT * sizeof(int32_t));
    cr_assert(prompt);
    make_prompt(prompt);

    struct lc_run a, b, c;
    lc_serve(dir, prompt, 2048, NULL, &a);
    cr_expect_eq(a.allocs, 0, "%llu device allocations after the reservation", (unsigned long long)a.allocs);
    cr_expect_gt(a.selected, 0, "the D layer never selected");
    cr_expect_gt(a.overlapped, 0, "no selection ran alongside the attention");
    lc_serve(dir, prompt, 2048, "KRAIT_MLA_OVERLAP", &b);
    cr_expect_eq(b.overlapped, 0, "KRAIT_MLA_OVERLAP=0 selects first");
    expect_same(&a, &b, "overlapped selection vs serial");
    lc_serve(dir, prompt, 2048, "KRAIT_PDL", &c);
    expect_same(&a, &c, "programmatic launch vs plain");

    kr_free(prompt);
    ckw_rmtree(dir);
}

/* The same serving path through GQA attention layers. */
Test(long_context, serving_chunked_prefill_gqa, .timeout = 900)
{
    GT_REQUIRE_GPU();
    char dir[256];
    ckw_tmpdir(dir, sizeof dir);
    PATTERN = PATTERN_GQA;
    write_model(dir);
    int32_t *prompt = kr_malloc((size_t)PROMPT * sizeof(int32_t));
    cr_assert(prompt);
    make_prompt(prompt);
    struct lc_run a, c;
    lc_serve(dir, prompt, 2048, NULL, &a);
    cr_expect_eq(a.allocs, 0, "%llu device allocations after the reservation", (unsigned long long)a.allocs);
    lc_serve(dir, prompt, 2048, "KRAIT_PDL", &c);
    expect_same(&a, &c, "programmatic launch vs plain");
    kr_free(prompt);
    ckw_rmtree(dir);
}

/* The largest step the server takes (--max-num-batched-tokens 16384): the chunks' contexts cross
 * 32768 and 65536 as well, with eight times the tokens per step; DSA and GQA. */
Test(long_context, serving_largest_chunks, .timeout = 900)
{
    GT_REQUIRE_GPU();
    int32_t *prompt = kr_malloc((size_t)PROMPT * sizeof(int32_t));
    cr_assert(prompt);
    make_prompt(prompt);
    const char *patterns[] = {PATTERN_DSA, PATTERN_GQA};
    for (int i = 0; i < 2; i++) {
        char dir[256];
        ckw_tmpdir(dir, sizeof dir);
        PATTERN = patterns[i];
        write_model(dir);
        struct lc_run a;
        lc_serve(dir, prompt, 16384, NULL, &a);
        cr_expect_eq(a.allocs, 0, "%s: %llu device allocations after the reservation", PATTERN,
                     (unsigned long long)a.allocs);
        if (i == 0) {
            cr_expect_gt(a.selected, 0, "the D layer never selected");
        }
        ckw_rmtree(dir);
    }
    kr_free(prompt);
}
