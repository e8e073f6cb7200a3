#pragma once
/* CPU reference of the FP8 recipes of DeepSeek-V3.2 as its reference `kernel.py` computes them: the
 * DSA lightning indexer's path (MODEL_SPEC §1.5: an orthonormal Walsh-Hadamard transform of the
 * indexer query and key vectors, per-block quantization to OCP FP8 E4M3 (`act_quant`), the index
 * score over the cached keys (`fp8_index`)), and the block-scaled weights with their product
 * (`weight_quant` with 128 x 128 scales, `fp8_gemm` over activations quantized per 128 values). Everything is plain fp32 (fp64 where that makes a result exact), written
 * to define what a device kernel has to reproduce. All functions are pure and may be called from any
 * thread; every pointer is borrowed for the duration of the call. */
#include <stdbool.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KR_FP8_E4M3_MAX 448.0f /* largest finite E4M3 value (code 0x7e) */
#define KR_FP8_E4M3_NAN 0x7f   /* the NaN code the encoder produces (0xff is NaN too) */

/* Encodes `x` as E4M3 ("e4m3fn": bias 7, no infinities, S.1111.111 is NaN): round to nearest, ties to
 * even; finite values and infinities beyond ±448 saturate to ±448 (the reference's
 * `x.clamp(-448, 448).to(torch.float8_e4m3fn)`); subnormals down to 2^-9; the sign of zero (and of
 * anything that rounds to zero) is kept; NaN gives 0x7f whatever its sign. */
uint8_t kr_fp8_e4m3_from_f32(float x);

/* Decodes an E4M3 code exactly; 0x7f and 0xff give NaN. Same function as kr_e4m3_to_f32 in
 * util/dtype.h, under this module's name. */
float kr_fp8_e4m3_to_f32(uint8_t b);

/* In-place fast Walsh-Hadamard transform of x [n] followed by a multiplication by `scale`:
 * x <- scale * H_n x with H_n in Sylvester order (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]), the
 * ordering of `fast_hadamard_transform.hadamard_transform(x, scale)`. With scale = n^-0.5 the
 * transform is orthonormal and its own inverse. Returns KR_ERR_INVAL (x untouched) unless n is a
 * power of two >= 1 and x is not NULL. */
enum kr_status kr_fp8_hadamard(float *x, int64_t n, float scale);

/* Per-block FP8 quantization of x [n] (the reference `act_quant`): for each block of `block`
 * consecutive elements, amax = max(max |x|, 1e-4) and
 *   scale[b] = amax * fp32(1/448)                        (ue8m0 false: the kernel multiplies by the
 *                                                          fp32 constant 1/448, which may differ from
 *                                                          amax/448 in the last bit)
 *   scale[b] = 2^ceil(log2(amax / 448)), exact            (ue8m0 true: the smallest power of two s
 *                                                          with s * 448 >= amax)
 *   q[i] = e4m3(clamp(x[i] / scale[b], -448, 448))         (x[i] / scale[b] rounded to fp32 first)
 * so that x[i] ~= e4m3_to_f32(q[i]) * scale[b]. Writes q [n] (E4M3 codes) and scale [n / block]
 * (fp32). Returns KR_ERR_INVAL, writing nothing, when a pointer is NULL, block < 1, n < 0, n is not
 * a multiple of block, or an element of x is not finite. */
enum kr_status kr_fp8_act_quant(const float *x, int64_t n, int64_t block, bool ue8m0, uint8_t *q,
                                float *scale);

/* Index scores of one query against n_kv cached keys (the reference `fp8_index`), with one scale per
 * query head and one per key, i.e. each row quantized as a single block (head_dim = block = 128 in
 * DeepSeek-V3.2):
 *   score[s] = k_scale[s] * Σ_h relu(q[h] · k[s]) * (w[h] * q_scale[h])
 * where q[h] · k[s] is the dot product of the decoded E4M3 values, computed exactly in fp64 (exact
 * for head_dim <= 2^17: every product is a multiple of 2^-18 below 2^18) and rounded once to fp32;
 * the rest is fp32, summed over h in order. The scales are positive, so this equals the fp32
 * formula on the dequantized vectors qd[h] = q_scale[h] * q[h] and kd[s] = k_scale[s] * k[s],
 * score[s] = Σ_h w[h] * relu(qd[h] · kd[s]), up to rounding. `w` is the indexer's head
 * weight with all its constant factors already folded in (Hi^-0.5 * Di^-0.5 in the reference).
 * A NaN code in q or k makes the affected scores NaN.
 *   q       [n_head, head_dim] E4M3 codes    q_scale [n_head]   w [n_head]
 *   k       [n_kv, head_dim]   E4M3 codes    k_scale [n_kv]     score [n_kv] (written)
 * Returns KR_ERR_INVAL when a pointer is NULL, n_head < 1, head_dim < 1 or n_kv < 0. */
enum kr_status kr_fp8_index_score(const uint8_t *q, const float *q_scale, const float *w, int64_t n_head,
                                  int64_t head_dim, const uint8_t *k, const float *k_scale, int64_t n_kv,
                                  float *score);

/* ---- the block-scaled weight recipe (DeepSeek-V3 / V3.2 checkpoints; `--quantization fp8`) ---- */

/* Quantizes w [rows, cols] (fp32) in blocks of [block_r, block_c] (128 x 128 in the checkpoints;
 * edge blocks are smaller): for each block amax = max(max |w|, 1e-4), s = amax * fp32(1/448) and
 * q = e4m3(w / s), the same rule as kr_fp8_act_quant; writes q [rows, cols] (E4M3 codes) and
 * scale_inv [ceil(rows / block_r), ceil(cols / block_c)] = s, the checkpoints' `weight_scale_inv`
 * (w ~= e4m3_to_f32(q) * scale_inv). KR_ERR_INVAL, writing nothing, on a NULL pointer, a size below
 * 1 or a non-finite element. */
enum kr_status kr_fp8_weight_quant(const float *w, int64_t rows, int64_t cols, int64_t block_r, int64_t block_c,
                                   uint8_t *q, float *scale_inv);

/* The reference FP8 product (DeepSeek's `fp8_gemm`): c [m, n] = a [m, k] * b [n, k]^T with a
 * quantized per row in blocks of block_k along k (kr_fp8_act_quant per block: a_s [m, nkb]) and b in
 * blocks of [block_n, block_k] (kr_fp8_weight_quant: b_s [ceil(n / block_n), nkb]), nkb =
 * ceil(k / block_k): the last block along k may be shorter (the reference kernel needs k a multiple
 * of 128; the small test checkpoints are narrower). For each output, over the k blocks in order:
 *   d   = the block's dot product of the decoded E4M3 values, exact in fp64 (every product is a
 *         multiple of 2^-18 below 2^18) and rounded once to fp32
 *   acc = acc + (d * a_s[i, kb]) * b_s[j / block_n, kb]        (fp32, acc from 0)
 * the order of the reference kernel's `acc += dot(a, b) * a_s[:, None] * b_s[None, :]`. KR_ERR_INVAL
 * on a NULL pointer or a bad size. */
enum kr_status kr_fp8_gemm(const uint8_t *a, const float *a_s, int64_t m, int64_t k, const uint8_t *b,
                           const float *b_s, int64_t n, int64_t block_k, int64_t block_n, float *c);

#ifdef __cplusplus
}
#endif
