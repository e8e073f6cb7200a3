#pragma once
/* kr_cache: the per-sequence caches of a model in backend memory, planned once at creation.
 *  - a slot pool for Mamba layers: per slot and M layer, the conv state [K-1, conv_dim] and the
 *    fp32 SSM state [Hm, P, N];
 *  - a block pool for attention layers: fixed-size blocks of `block_size` token rows, per block
 *    and * layer K and V rows [block_size, n_kv_head, head_dim], and per D/+ layer latent rows
 *    [block_size, kv_lora + rope (+ index_head_dim for D)]. A sequence owns one block table that
 *    indexes every layer's pool.
 * Allocation is LIFO free lists; the scheduler decides who gets what. Engine thread only. */
#include <stdint.h>

#include "backend.h"
#include "model.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kr_cache {
    kr_backend_t be;          /* borrowed */
    int32_t n_slots;          /* Mamba state slots */
    int32_t n_blocks;         /* K/V blocks */
    int32_t block_size;       /* tokens per block */
    int32_t n_mamba, n_attn;  /* layers with state / with K/V */
    size_t conv_layer_bytes;  /* per M layer: n_slots * (K-1) * conv_dim * act size */
    size_t ssm_layer_bytes;   /* per M layer: n_slots * Hm * P * N * 4 */
    size_t kv_layer_bytes;    /* per * layer, for K (same for V): n_blocks * block_size * n_kv * hd * act */
    struct kr_buf conv;       /* [n_mamba][n_slots][K-1][conv_dim] */
    struct kr_buf ssm;        /* [n_mamba][n_slots][Hm][P][N] fp32 */
    struct kr_buf k, v;       /* [n_attn][n_blocks][block_size][n_kv][hd] */
    int32_t n_mla;            /* layers with a latent cache (D, +) */
    int64_t *mla_row;         /* [n_mla] floats per cached token of each latent layer */
    size_t *mla_off;          /* [n_mla] byte offset of each layer's pool in `mla` */
    struct kr_buf mla;        /* per latent layer [n_blocks][block_size][mla_row] */
    int32_t *free_slots;      /* [n_slots] stack */
    int32_t n_free_slots;
    int32_t *free_blocks;     /* [n_blocks] stack */
    int32_t n_free_blocks;
    int32_t *block_ref;       /* [n_blocks] holders of each block (0 = free) */
    size_t act;               /* bytes per cached activation element */
    size_t conv_slot_bytes;   /* one slot of one M layer */
    size_t ssm_slot_bytes;
};

/* Bytes one state slot and one block cost across all layers of model `m` with blocks of
 * `block_size` tokens (what the memory plan divides a budget by). */
void kr_cache_unit_bytes(const struct kr_model *m, int32_t block_size, size_t *slot_bytes, size_t *block_bytes);

/* Creates caches for `m` with `n_slots` state slots and `n_blocks` blocks of `block_size` tokens
 * (block_size >= 1; pools a model does not need are empty). */
enum kr_status kr_cache_create(const struct kr_model *m, int32_t n_slots, int32_t n_blocks, int32_t block_size,
                               struct kr_cache **out);
void kr_cache_free(struct kr_cache *c);

/* Bytes of backend memory held by the pools. */
size_t kr_cache_bytes(const struct kr_cache *c);

/* Takes one state slot; KR_AGAIN when none is free. */
enum kr_status kr_cache_slot_alloc(struct kr_cache *c, int32_t *slot);
void kr_cache_slot_free(struct kr_cache *c, int32_t slot);
/* Takes `n` blocks into ids[0..n) with one reference each; all or nothing; KR_AGAIN when fewer
 * are free. */
enum kr_status kr_cache_blocks_alloc(struct kr_cache *c, int32_t n, int32_t *ids);
/* Drops one reference from each block; a block returns to the pool when none is left. */
void kr_cache_blocks_free(struct kr_cache *c, int32_t n, const int32_t *ids);
/* Adds one reference to a block (prefix sharing between sequences). */
void kr_cache_block_ref(struct kr_cache *c, int32_t id);
/* Copies the cached rows of block `src` into block `dst` for every paged layer. */
enum kr_status kr_cache_block_copy(struct kr_cache *c, int32_t src, int32_t dst);
/* Copies the Mamba conv and SSM states of slot `src` into slot `dst` for every M layer. */
enum kr_status kr_cache_slot_copy(struct kr_cache *c, int32_t src, int32_t dst);

/* Pointers to one layer's pools (backend memory). */
void *kr_cache_conv_layer(const struct kr_cache *c, int32_t mamba_idx);
float *kr_cache_ssm_layer(const struct kr_cache *c, int32_t mamba_idx);
void *kr_cache_k_layer(const struct kr_cache *c, int32_t attn_idx);
void *kr_cache_v_layer(const struct kr_cache *c, int32_t attn_idx);
void *kr_cache_mla_layer(const struct kr_cache *c, int32_t mla_idx);

/* A sequence's hold on the caches: one slot and a growing block table. */
struct kr_seq_cache {
    int32_t slot;      /* -1 when none */
    int32_t n_blocks;
    int32_t cap_blocks;
    int32_t *blocks;   /* [n_blocks] */
    int32_t n_pos;     /* tokens already in the caches */
};

/* Takes a slot for a new sequence. */
enum kr_status kr_seq_cache_init(struct kr_cache *c, struct kr_seq_cache *s);
/* Grows the block table to hold `n_tokens` positions; KR_AGAIN if the pool is short. */
enum kr_status kr_seq_cache_reserve(struct kr_cache *c, struct kr_seq_cache *s, int32_t n_tokens);
/* Returns everything the sequence holds to the pools. Safe to call again on a released struct
 * (slot -1); a struct never passed to kr_seq_cache_init must not be released. */
void kr_seq_cache_release(struct kr_cache *c, struct kr_seq_cache *s);
/* Gives `dst` (a struct holding nothing) what a forked sequence needs to go on from the first
 * `n_pos` positions of `src`: a slot with a copy of src's state, src's full blocks shared (one more
 * reference each) and a copy of its partial last block. On failure (KR_AGAIN when the pools are
 * short, or the copy's error) dst holds nothing (slot -1). */
enum kr_status kr_seq_cache_fork(struct kr_cache *c, const struct kr_seq_cache *src, int32_t n_pos,
                                 struct kr_seq_cache *dst);

/* Debug check of the pools' ownership, through KR_ASSERT: every slot is either free or held by
 * exactly one of the `n_held` sequence caches held(user, 0..n_held) returns, every block's
 * reference count equals the number of block-table entries naming it, and free blocks have none. */
void kr_cache_check_owners(const struct kr_cache *c, int32_t n_held,
                           const struct kr_seq_cache *(*held)(void *user, int32_t i), void *user);

#ifdef __cplusplus
}
#endif
