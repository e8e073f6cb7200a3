#pragma once
/* kr_cache: the per-sequence caches of a model in backend memory, planned once at creation.
 *  - a slot pool for Mamba layers: per slot and M layer, the conv state [K-1, conv_dim] and the
 *    fp32 SSM state [Hm, P, N];
 *  - a block pool for attention layers: fixed-size blocks of `block_size` token rows, per block
 *    and * layer K and V rows [block_size, n_kv_head, head_dim], and per D/+ layer latent rows
 *    [block_size, kv_lora + rope (+ index_head_dim for D)]. A sequence owns one block table that
 *    indexes every layer's pool.
 * Allocation is LIFO free lists; the scheduler decides who gets what. Engine thread only. */
#include <stdbool.h>
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
    int64_t *mla_row;         /* [n_mla] per cached token of each latent layer: elements of `act`
                                 bytes, or with fp8 bytes (the packed row) */
    int64_t mla_key_off;      /* where a D layer's index key starts in its row (same units) */
    bool fp8;                 /* packed FP8 pools (--kv-cache-dtype fp8 on a backend that stores
                                 the bytes, kr_backend_kv_fp8_packed): K/V a byte per value, latent
                                 rows as krk/ops.h krk_fp8_latent_bytes + krk_fp8_key_bytes */
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
    int32_t n_state_slots;    /* n_slots running + the prefix cache's snapshot slots */
    struct kr_prefix *prefix; /* the prefix cache (prefix.c), NULL when off */
    /* (optional) told of every block (kind 0) and slot (kind 1) copy after it is made: the other
     * ranks of a tensor-parallel group replay them (engine/ranks.h); an error fails the copy */
    enum kr_status (*on_copy)(void *user, int kind, int32_t src, int32_t dst);
    void *on_copy_user;
};

/* Bytes one state slot and one block cost across all layers of model `m` with blocks of
 * `block_size` tokens (what the memory plan divides a budget by), with the model's cache dtype
 * (kr_model_set_kv_cache_dtype, which must come first). */
void kr_cache_unit_bytes(const struct kr_model *m, int32_t block_size, size_t *slot_bytes, size_t *block_bytes);

/* Creates caches for `m` with `n_slots` state slots and `n_blocks` blocks of `block_size` tokens
 * (block_size >= 1; pools a model does not need are empty), without a prefix cache. */
enum kr_status kr_cache_create(const struct kr_model *m, int32_t n_slots, int32_t n_blocks, int32_t block_size,
                               struct kr_cache **out);

/* The pools with a prefix cache (prefix.c): `n_snaps` more state slots, apart from the n_slots
 * that running sequences take, hold Mamba state snapshots. */
struct kr_cache_plan {
    int32_t n_slots, n_blocks, block_size;
    bool prefix;              /* keep full blocks and state snapshots for reuse */
    int32_t n_snaps;          /* snapshot slots (0 for models without Mamba layers) */
    int32_t state_interval;   /* a snapshot every this many prompt tokens (a multiple of block_size; 0: none) */
};
enum kr_status kr_cache_create_plan(const struct kr_model *m, const struct kr_cache_plan *plan, struct kr_cache **out);
void kr_cache_free(struct kr_cache *c);

/* Bytes of backend memory held by the pools. */
size_t kr_cache_bytes(const struct kr_cache *c);

/* Takes one state slot for a running sequence; KR_AGAIN when none is free. */
enum kr_status kr_cache_slot_alloc(struct kr_cache *c, int32_t *slot);
void kr_cache_slot_free(struct kr_cache *c, int32_t slot);
/* Takes `n` blocks into ids[0..n) with one reference each, evicting cached prefixes the pool
 * needs first (never a block a sequence holds); all or nothing; KR_AGAIN when fewer are free. */
enum kr_status kr_cache_blocks_alloc(struct kr_cache *c, int32_t n, int32_t *ids);
/* Drops one reference from each block; a block nobody holds returns to the pool, or, when it is
 * a registered full block of a model without Mamba layers, stays cached (evictable, LRU). */
void kr_cache_blocks_free(struct kr_cache *c, int32_t n, const int32_t *ids);
/* Adds one reference to a held block (prefix sharing between sequences). */
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
/* Gives back the blocks of the table beyond the first `n_tokens` positions (rows written past
 * them, such as refused speculative drafts, are dropped with them). */
void kr_seq_cache_trim(struct kr_cache *c, struct kr_seq_cache *s, int32_t n_tokens);
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
 * exactly one of the `n_held` sequence caches held(user, 0..n_held) returns or one snapshot,
 * every block's reference count equals the number of block-table entries naming it (sequences'
 * and snapshots'), free blocks have none and are not registered, and cached blocks nobody holds
 * are registered and on the LRU list. */
void kr_cache_check_owners(const struct kr_cache *c, int32_t n_held,
                           const struct kr_seq_cache *(*held)(void *user, int32_t i), void *user);

/* ---- the prefix cache (prefix.c) ---------------------------------------------------------------
 *
 * Full blocks are known by a chain hash of every token up to their end (keyed SipHash-2-4 over the
 * previous hash and the block's tokens, seeded by the request's cache salt): a registered block is
 * found by the hash of a new prompt's prefix and shared (one more reference). Models with Mamba
 * layers cannot start from blocks alone: they restore a state snapshot, a frozen sequence cache
 * (a snapshot slot with the conv and SSM states after p tokens, references to the full blocks
 * before p, its own copy of the partial block) with the p tokens it stands for, compared in full
 * on a hit. Snapshots are taken at a grid of positions, at hinted positions (the boundary before a
 * chat's last user turn), at the end of each prompt and when a sequence ends or is preempted.
 * Everything cached and held by nobody is evicted least recently used when the pools need room. */

/* The chain hashes of a token sequence: h[0] is the seed (kr_prefix_seed), h[j] the hash of the
 * first j full blocks. Fills h[from..n_blocks] (h[0..from) must hold already). */
void kr_prefix_hashes(const struct kr_cache *c, const int32_t *toks, int32_t from, int32_t n_blocks, uint64_t *h);
/* The seed of a cache salt of n bytes (n = 0: the common seed); different salts never share entries. */
uint64_t kr_prefix_seed(const struct kr_cache *c, const char *salt, size_t n);

/* A new sequence's caches, restored from the longest cached prefix of toks[0..n_lookup) when there
 * is one (h: its hashes, h[0..n_lookup / block_size]): dst gets a slot (and the state it had after
 * *hit tokens), shared full blocks and a copy of the partial block; *hit is 0 on a miss. Counts the
 * query. KR_AGAIN when no slot is free (dst then holds nothing). */
enum kr_status kr_prefix_admit(struct kr_cache *c, const int32_t *toks, int32_t n_lookup, const uint64_t *h,
                               struct kr_seq_cache *dst, int32_t *hit);
/* Registers the sequence's full blocks [from, to) (hashes h[from + 1 .. to]) so that others find
 * them; a hash already registered for another block leaves this one unregistered. */
void kr_prefix_register(struct kr_cache *c, const struct kr_seq_cache *s, int32_t from, int32_t to, const uint64_t *h);
/* Whether a snapshot of toks[0..p) exists (touching it). */
bool kr_prefix_has_snapshot(struct kr_cache *c, const int32_t *toks, int32_t p, const uint64_t *h);
/* Takes a snapshot of the sequence's state after its first s->n_pos tokens, a copy (the sequence
 * goes on); skipped without error when one exists or there is no room (no free block for the
 * partial block's copy). Models without Mamba layers keep no snapshots. */
enum kr_status kr_prefix_snapshot(struct kr_cache *c, const struct kr_seq_cache *s, const int32_t *toks, const uint64_t *h);
/* Releases a sequence whose caches are sound (it finished, was cancelled or preempted), keeping
 * what it computed: its state becomes a snapshot (its slot and blocks handed over, no copy) and
 * its full blocks stay registered. s then holds nothing. */
void kr_prefix_release(struct kr_cache *c, struct kr_seq_cache *s, const int32_t *toks, const uint64_t *h);
/* Evicts cached entries nobody holds, least recently used first, until `want` blocks are free or
 * nothing is left to evict (no-op without a prefix cache). */
void kr_prefix_reclaim(struct kr_cache *c, int32_t want);
/* Evicts everything cached that nobody holds (tests; pools whole afterwards when nothing runs). */
void kr_prefix_clear(struct kr_cache *c);

struct kr_prefix_stats {
    uint64_t queries;         /* prompt tokens looked up */
    uint64_t hits;            /* of those, tokens restored from the cache */
    uint64_t block_only;      /* tokens that matched registered blocks beyond the deepest usable
                                 snapshot (Mamba models: blocks without a state to go on from) */
    uint64_t snapshots;       /* snapshots taken */
    uint64_t evicted_snapshots, evicted_blocks;
    int32_t n_snaps, snaps_used;   /* snapshot slots, of which holding a snapshot */
    int32_t blocks_cached;    /* blocks nobody holds kept for reuse */
    size_t snap_bytes;        /* one snapshot's state */
};
void kr_prefix_get_stats(const struct kr_cache *c, struct kr_prefix_stats *st);

#ifdef __cplusplus
}
#endif
