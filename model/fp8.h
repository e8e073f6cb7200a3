#pragma once
/* CPU reference of the FP8 path of the DSA lightning indexer (MODEL_SPEC §1.5), as the DeepSeek-V3.2
 * reference `kernel.py` computes it: an orthonormal Walsh-Hadamard transform of the indexer query and
 * key vectors, per-block quantization to OCP FP8 E4M3 (`act_quant`), and the index score over the
 * cached keys (`fp8_index`). Everything is plain fp32 (fp64 where that makes a result exact), written
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

#ifdef __cplusplus
}
#endif
