#pragma once
/* kr_backend: the compute backend the forward pass is written against (ggml-backend style).
 * The forward pass (model.c) is a sequence of calls to the kr_backend_* wrappers below; each
 * backend (CPU reference, CUDA) implements the vtable of backend-impl.h. Tensors and buffers are
 * backend memory (host memory for the CPU backend, device memory for CUDA). Activations are
 * fp32 on the CPU backend; kr_backend_act_size() gives their element size.
 * A backend is used by one thread at a time (the engine thread). */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "batch.h"
#include "krk/ops.h"
#include "config.h"
#include "dtype.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kr_backend *kr_backend_t;

/* A 2-D weight view in backend memory: [rows, cols], row-major, cols contiguous. A 1-D vector
 * has rows = 1. Borrowed: its memory is owned by whoever uploaded it (struct kr_buf). */
struct kr_tensor {
    const void *data;
    enum kr_dtype dtype;
    int64_t rows;
    int64_t cols;
    /* F8_E4M3 weights kept as FP8 (kr_backend_set_fp8_weights): the blocks' scales
     * [ceil(rows / block_r), ceil(cols / block_c)] in backend memory (weight = code * scale) */
    const float *scale;
    int32_t block_r, block_c;
    bool act_ue8m0; /* FP8: products quantize their activations with power-of-two (ue8m0) scales, as a
                       DeepSeek checkpoint's quantization_config.scale_fmt "ue8m0" asks; else amax / 448 */
};

/* One product of kr_backend_matmul_multi: y[t, :w->rows] = x[t, :] * w^T (+ bias), row stride ldy. */
struct kr_matmul_part {
    const struct kr_tensor *w;
    const float *bias;
    float *y;
    int64_t ldy;
};

/* A block of backend memory. Owned by the caller of kr_backend_buf_alloc. */
struct kr_buf {
    void *ptr;
    size_t size;
};

/* ---- lifetime and memory ---- */

/* Creates the CPU reference backend using `n_threads` threads (0 = all cores).
 * Returns NULL on OOM. */
kr_backend_t kr_backend_cpu_create(int n_threads);
/* The planning backend: the loader run against it (kr_model_load) reads only the checkpoint's
 * headers, and each upload counts the bytes a device backend would hold: weights of weight_elt
 * bytes (2: bf16 as on CUDA; 1: FP8, after kr_backend_set_fp8_weights, the matrices as codes with
 * their block scales and the embedding and LM head in bf16), fp32 vectors of 4; caches of cache_elt
 * bytes. It runs no op (they fail with KR_ERR_UNSUPPORTED). NULL on a bad size or out of memory. */
kr_backend_t kr_backend_plan_create(size_t weight_elt, size_t cache_elt);
bool kr_backend_is_plan(kr_backend_t be);
/* The bytes uploaded or allocated so far (0 for another backend). */
uint64_t kr_backend_plan_bytes(kr_backend_t be);
void kr_backend_free(kr_backend_t be);
const char *kr_backend_name(kr_backend_t be);
/* Bytes per activation element. */
size_t kr_backend_act_size(kr_backend_t be);

/* Bytes per cached element (conv states, K/V rows, latent rows): 4 on the CPU, 2 (bf16) on CUDA. */
size_t kr_backend_cache_elt_size(kr_backend_t be);

/* The CUDA backend on device `dev` with the tuning switches `sw` (util/switches.h; the backend
 * keeps a copy). Sets no process-wide state: kr_backend_cuda_setup does. Fails with a message when
 * the build has no CUDA or no device is usable. */
struct kr_switches;
enum kr_status kr_backend_cuda_create_with(int dev, const struct kr_switches *sw, kr_backend_t *out,
                                           struct kr_err *err);
/* The kernel library's process-wide settings from `sw` (KRAIT_PDL: programmatic dependent launch,
 * KRAIT_SSD_STREAM: the SSM state's cache hints), set once before the first CUDA backend is created
 * (kr_backend_create and kr_backend_cuda_create do it). A no-op in a build without CUDA. */
void kr_backend_cuda_setup(const struct kr_switches *sw);
/* Parses the tuning switches from the environment now (KR_ERR_INVAL with the message when one is
 * refused), applies the process-wide ones (kr_backend_cuda_setup) and creates the backend on
 * device `dev`, with CUDA graphs for decode steps when `graphs` (in place of KRAIT_CUDA_GRAPHS). */
enum kr_status kr_backend_cuda_create(int dev, bool graphs, kr_backend_t *out, struct kr_err *err);
/* Per-op timing of a CUDA backend's eager steps (graphs are off while it is on): turning it on or
 * off resets the totals; _read fills up to cap categories (name, total ms, launches) and returns
 * how many. */
void kr_backend_cuda_profile(kr_backend_t be, bool on);
/* Device allocations the backend has made so far: serving after start-up makes none (the engine
 * reserves every workspace, cache and staging buffer at creation). */
uint64_t kr_backend_cuda_alloc_count(kr_backend_t be);
/* DSA selections the backend has run alongside the attention's absorption (KRAIT_MLA_OVERLAP), one
 * per D layer of each eager step or captured graph. */
uint64_t kr_backend_cuda_overlap_count(kr_backend_t be);
int kr_backend_cuda_profile_read(kr_backend_t be, const char **names, double *ms, int64_t *calls, int cap);
/* CUDA devices visible (0 in a build without CUDA). */
int kr_backend_cuda_device_count(void);
/* A tensor-parallel group of `size` CUDA ranks (backend/comm-cuda.h): rank r on device dev0 + r
 * (every rank on dev0 with KRAIT_TP_ONE_DEVICE=1, tests), each backend in be[r] already joined to the
 * group *comm as rank r. Fails with a message naming what is missing (devices, NCCL); then nothing
 * is left allocated. The caller frees the backends, then the group (kr_backend_cuda_group_free). */
struct kr_cuda_comm;
enum kr_status kr_backend_cuda_create_group(int dev0, int size, kr_backend_t *be, struct kr_cuda_comm **comm,
                                            struct kr_err *err);
void kr_backend_cuda_group_free(struct kr_cuda_comm *comm);
/* A group over several processes (nodes), built in two steps: the backends of this process's ranks
 * (local rank i on device dev0 + i), then, once the processes have agreed on the group's NCCL id
 * (made by one of them with kr_backend_cuda_nccl_id), kr_backend_cuda_join makes be[0..n) ranks
 * first .. first + n - 1 of `world` (NCCL carries every collective). */
enum kr_status kr_backend_cuda_create_ranks(int dev0, int n, kr_backend_t *be, struct kr_err *err);
enum kr_status kr_backend_cuda_nccl_id(void *out, size_t cap, size_t *len, struct kr_err *err);
enum kr_status kr_backend_cuda_join(kr_backend_t *be, int n, int first, int world, const void *nccl_id,
                                    struct kr_cuda_comm **comm, struct kr_err *err);
/* Aborts the group's collectives (any thread; see comm-cuda.h). NULL allowed. */
void kr_backend_cuda_group_abort(struct kr_cuda_comm *comm);
/* What `device` names (see kr_backend_create): *cuda_dev = the CUDA device, or -1 for the CPU. */
enum kr_status kr_backend_parse_device(const char *device, int *cuda_dev, struct kr_err *err);
/* Creates the backend named by `device`: "cpu", "cuda" or "cuda:N", or "auto" (CUDA device 0 when
 * one is visible, else the CPU). `threads` applies to the CPU backend. The tuning switches are
 * parsed from the environment first (util/switches.h): a refused value fails with KR_ERR_INVAL and
 * a message naming the variable, the value and what is accepted, whatever the device. */
enum kr_status kr_backend_create(const char *device, int threads, kr_backend_t *out, struct kr_err *err);

/* False once the backend's device hit an unrecoverable error (an illegal address: the CUDA
 * context is lost); the server then reports itself unhealthy so that it gets restarted. Any thread. */
bool kr_backend_healthy(kr_backend_t be);

/* After a failed step: waits for the device's queued work and tells whether the failure left the
 * device unusable (then kr_backend_healthy turns false). An error reported by a library call (a
 * cuBLAS status) may be the echo of an illegal access by an earlier kernel; this finds out.
 * Engine thread. True when the device is still usable. */
bool kr_backend_check(kr_backend_t be);

/* FP8 weights (model/fp8.h's block-scaled recipe): with `on`, the loader keeps FP8 checkpoint
 * matrices as E4M3 codes with their block scales instead of dequantizing them, and quantizes the
 * other checkpoints' matrices to it (`--quantization fp8`); the products then quantize their
 * activations per block (kr_fp8_act_quant) and run the reference product (kr_fp8_gemm). Before the
 * model is loaded. KR_ERR_UNSUPPORTED with a message for a backend without that product (today
 * every backend but the CPU reference). */
enum kr_status kr_backend_set_fp8_weights(kr_backend_t be, bool on, struct kr_err *err);
bool kr_backend_fp8_weights(kr_backend_t be);

/* --batch-invariant: a sequence's results (logits, and so its tokens) are the same bits whatever
 * other sequences share its steps and however its prompt is cut into chunks (the engine then cuts
 * them at multiples of KR_INVARIANT_CHUNK). The CPU reference is so already; the CUDA backend then
 * takes one product path per weight shape whatever the row count (cuBLASLt with an algorithm fixed
 * per shape), splits attention by each token's own context, and runs MLA attention per head. Before
 * the model is reserved. KR_ERR_UNSUPPORTED with a message for backends without it, and on CUDA
 * for FP8 weights (their products choose kernels by row count). */
enum kr_status kr_backend_set_batch_invariant(kr_backend_t be, bool on, struct kr_err *err);
bool kr_backend_batch_invariant(kr_backend_t be);

/* Tensor parallelism (DESIGN.md): one backend instance is one rank. kr_backend_set_tp joins the
 * group `comm` as `rank` of `size`, before the model is loaded (the loader then takes only this
 * rank's shard of each weight). For the CPU backend `comm` is a struct kr_host_comm (comm.h) shared
 * by the ranks' threads. KR_ERR_UNSUPPORTED (with a message) for a backend without collectives. */
enum kr_status kr_backend_set_tp(kr_backend_t be, int rank, int size, void *comm, struct kr_err *err);
int kr_backend_tp_rank(kr_backend_t be);
int kr_backend_tp_size(kr_backend_t be);
/* Collectives of the group (no-ops for a single rank): x summed over the ranks in place; the
 * ranks' [rows, cols] blocks side by side in dst [rows, size * cols]. */
enum kr_status kr_backend_all_reduce(kr_backend_t be, float *x, int64_t n);
enum kr_status kr_backend_all_gather(kr_backend_t be, const float *src, int64_t rows, int64_t cols, float *dst);
/* Releases the other ranks from the collectives of a step this rank abandons (no-op alone). */
void kr_backend_tp_abort(kr_backend_t be);

/* Free and total memory of the backend's device; KR_ERR_UNSUPPORTED on the CPU. */
enum kr_status kr_backend_mem_info(kr_backend_t be, size_t *free_b, size_t *total_b);

/* Sizes backend scratch for steps of up to n_tok tokens in n_seq sequences and contexts up to
 * max_ctx in cache blocks of block_size positions (no-op on the CPU). Called at start-up so that
 * serving allocates nothing. */
enum kr_status kr_backend_reserve(kr_backend_t be, const struct kr_model_config *c, int64_t n_tok, int64_t n_seq,
                                  int64_t max_ctx, int32_t block_size);
/* Ends the step begun by kr_backend_begin_batch (`ok`: every op of it succeeded). */
enum kr_status kr_backend_end_batch(kr_backend_t be, bool ok);
/* Decode-step graphs (see backend-impl.h); 0 / no-ops on backends without them. */
int32_t kr_backend_graph_bucket(kr_backend_t be, int32_t n);
enum kr_status kr_backend_graph_run(kr_backend_t be, int32_t key, bool *launched);
void kr_backend_graph_reset(kr_backend_t be);

/* Allocates `size` bytes of zeroed backend memory. */
enum kr_status kr_backend_buf_alloc(kr_backend_t be, size_t size, struct kr_buf *out);
/* Frees a buffer; a zeroed struct is a no-op. */
void kr_backend_buf_free(kr_backend_t be, struct kr_buf *buf);
/* Makes a host tensor usable by the backend. With `to_f32` the result is an fp32 copy (used for
 * small vectors: norms, biases, A_log, ...). When `src_persistent` (a view into a mapping that
 * outlives the model) the backend may alias host memory (CPU) instead of copying; a transient
 * source is always copied. Memory it allocates is returned in *owned (zeroed when nothing was
 * allocated), to be freed with kr_backend_buf_free. */
enum kr_status kr_backend_upload(kr_backend_t be, const struct kr_tensor *host, bool to_f32, bool src_persistent,
                                 struct kr_tensor *out, struct kr_buf *owned);
enum kr_status kr_backend_copy_d2h(kr_backend_t be, void *dst, const void *src, size_t n);
enum kr_status kr_backend_copy_h2d(kr_backend_t be, void *dst, const void *src, size_t n);
enum kr_status kr_backend_copy_d2d(kr_backend_t be, void *dst, const void *src, size_t n);

/* ---- ops (see backend-impl.h for their exact meaning) ---- */

/* Makes the step's batch the current one for the ops that need sequence structure. */
enum kr_status kr_backend_begin_batch(kr_backend_t be, const struct kr_batch *b);

/* The routed experts' weights as the engine holds them, beside struct krk_experts_params (krk/ops.h):
 * arrays of n_expert tensors in backend memory, of the dtypes the backend uploaded (fp32 or bf16 on
 * the CPU, bf16 on CUDA). The CUDA kernels read the experts through device arrays of pointers
 * instead, which the CUDA backend builds from these arrays once per model; hence the weights are
 * the one part of this op's parameters that is not shared with the kernels. */
struct kr_expert_weights {
    const struct kr_tensor *gate; /* [n_expert] each [d_ffn, d_in]; NULL for non-gated experts */
    const struct kr_tensor *up;   /* [n_expert] each [d_ffn, d_in] */
    const struct kr_tensor *down; /* [n_expert] each [d_out, d_ffn] */
};

enum kr_status kr_backend_mla_prep(kr_backend_t be, const struct krk_mla_prep_params *p);

/* True when the backend stores FP8 caches (--kv-cache-dtype fp8: krk_attn_params.kv_fp8,
 * krk_mla_cache_params.fp8). */
bool kr_backend_can_kv_fp8(kr_backend_t be);
/* True when the backend's FP8 caches hold the bytes (CUDA: a byte per K/V value, packed latent rows,
 * krk/ops.h krk_fp8_latent_bytes); false when it keeps the rounded values in its cache elements
 * (the CPU reference) or has no FP8 caches. */
bool kr_backend_kv_fp8_packed(kr_backend_t be);
/* True when the backend has the FP8 indexer path (kr_backend_fp8_round). */
bool kr_backend_can_fp8_round(kr_backend_t be);
enum kr_status kr_backend_fp8_round(kr_backend_t be, const struct krk_fp8_round_params *p);

/* True when the backend's Mamba op keeps the states after chosen tokens (struct
 * kr_batch.tok_state_slot: the verification step of speculative decoding). */
bool kr_backend_can_token_states(kr_backend_t be);
/* True when the backend samples on its own (kr_backend_sample is available). */
bool kr_backend_can_sample(kr_backend_t be);
/* One token per logits row (struct krk_sample_params: logits in backend memory, every other array
 * in host memory). */
enum kr_status kr_backend_sample(kr_backend_t be, const struct krk_sample_params *p);

/* out[t] = the embedding row of the step's token t, w holding the vocabulary rows [row0, row0 +
 * w->rows) (0 and the whole table on one rank); a token outside them gets zeros, so that a sum
 * over the ranks (vocabulary-parallel embedding) gives every row once. */
enum kr_status kr_backend_embed(kr_backend_t be, const struct kr_tensor *w, int64_t row0, float *out);
/* RMSNorm (struct krk_rmsnorm_params): with `res` it adds the residual into x first (the forward pass
 * asks for this in place of an add followed by the norm); with `out_bf16` it also writes the bf16
 * operand of the GEMM that reads out next (asked only when kr_backend_bf16_operands). */
enum kr_status kr_backend_rmsnorm(kr_backend_t be, const struct krk_rmsnorm_params *p);
enum kr_status kr_backend_add(kr_backend_t be, float *y, const float *x, int64_t n);
/* True when the backend's GEMMs round an activation of n rows to bf16: the forward pass then asks
 * the op writing a GEMM input for its bf16 copy (out_bf16) and hands it to the GEMM (struct
 * krk_bf16_in, filled). False on the CPU (fp32 GEMMs). */
bool kr_backend_bf16_operands(kr_backend_t be, int64_t n);
/* y[t, :w.rows] = x[t, :w.cols] * w^T (+ bias) for t < n; row strides ldx, ldy. xb (or NULL): the
 * bf16 operand of x (struct krk_bf16_in): filled by the op that wrote x, or room to round x into. */
enum kr_status kr_backend_matmul(kr_backend_t be, const float *x, int64_t ldx, int64_t n, const struct kr_tensor *w,
                                 const float *bias, float *y, int64_t ldy, const struct krk_bf16_in *xb);
enum kr_status kr_backend_act(kr_backend_t be, const struct krk_act_params *p);
/* The k products of `parts` on the same x (weights of equal cols), as k kr_backend_matmul calls in
 * order; outputs must not overlap x or each other. A backend may run them as one launch. */
enum kr_status kr_backend_matmul_multi(kr_backend_t be, const float *x, int64_t ldx, int64_t n, int k,
                                       const struct kr_matmul_part *parts, const struct krk_bf16_in *xb);
/* kr_backend_matmul, then out[t, j] = act(y[t, j]) for j < w->rows (out [n, w->rows] dense, not
 * overlapping y), as kr_backend_act without a gate, writing out_bf16 (or NULL) as it does. A backend
 * may fuse the two. */
enum kr_status kr_backend_matmul_act(kr_backend_t be, const float *x, int64_t ldx, int64_t n,
                                     const struct kr_tensor *w, const float *bias, float *y, int64_t ldy,
                                     enum kr_act act, float *out, krk_bf16 *out_bf16, const struct krk_bf16_in *xb);
/* The Mamba-2 conv + SSD step of a layer (struct krk_mamba_params). */
enum kr_status kr_backend_mamba(kr_backend_t be, const struct krk_mamba_params *p);
enum kr_status kr_backend_gated_rmsnorm(kr_backend_t be, const struct krk_gated_rmsnorm_params *p);
enum kr_status kr_backend_attention(kr_backend_t be, const struct krk_attn_params *p);
enum kr_status kr_backend_moe_route(kr_backend_t be, const struct krk_route_params *p);
/* Routed experts (struct krk_experts_params) with the weights w. */
enum kr_status kr_backend_moe_experts(kr_backend_t be, const struct krk_experts_params *p,
                                      const struct kr_expert_weights *w);
/* LayerNorm (struct krk_layernorm_params); out may alias x. */
enum kr_status kr_backend_layernorm(kr_backend_t be, const struct krk_layernorm_params *p);
/* RoPE (struct krk_rope_params) at the current batch's positions. */
enum kr_status kr_backend_rope(kr_backend_t be, const struct krk_rope_params *p);
/* kr_backend_rope on a, then on b (vectors that do not overlap a's); a backend may rotate both in
 * one launch when they share frequencies and factor. */
enum kr_status kr_backend_rope_pair(kr_backend_t be, const struct krk_rope_params *a, const struct krk_rope_params *b);
enum kr_status kr_backend_mla_cache_write(kr_backend_t be, const struct krk_mla_cache_params *p);
/* The lightning indexer's selection (struct krk_dsa_index_params). */
enum kr_status kr_backend_dsa_index(kr_backend_t be, const struct krk_dsa_index_params *p);
/* Absorbed MLA attention (struct krk_mla_attn_params), the selection first when it carries one. */
enum kr_status kr_backend_mla_attention(kr_backend_t be, const struct krk_mla_attn_params *p);
/* y[i] *= s for i < n. */
enum kr_status kr_backend_scale(kr_backend_t be, float *y, float s, int64_t n);
/* dst[i] = src[out_tok[i]] for the current batch's out_tok (rows of `width`). */
enum kr_status kr_backend_gather_out(kr_backend_t be, const float *src, int64_t width, float *dst);

#ifdef __cplusplus
}
#endif
