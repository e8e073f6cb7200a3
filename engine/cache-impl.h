#pragma once
/* What cache.c and prefix.c share: the prefix cache's hooks into the pools. Only these two files
 * include it. */
#include "cache.h"

#include <stdbool.h>
#include <stdint.h>

/* prefix.c: creates c->prefix for the plan (nothing when plan->prefix is off). */
enum kr_status kr_prefix_create(struct kr_cache *c, const struct kr_cache_plan *plan);
void kr_prefix_free(struct kr_cache *c);
/* A block whose last reference went: true when the prefix cache keeps it (registered, evictable),
 * false when it must return to the free pool (it is unregistered first). */
bool kr_prefix_block_unheld(struct kr_cache *c, int32_t id);
/* A sequence takes / drops a reference to a block (the count of blocks only snapshots hold). */
void kr_prefix_seq_ref(struct kr_cache *c, int32_t id);
void kr_prefix_seq_unref(struct kr_cache *c, int32_t id);
/* cache.c: drops one reference (no sequence bookkeeping); a block nobody holds is freed or cached. */
void kr_cache_block_unref(struct kr_cache *c, int32_t id);
/* A block taken from the cache by a new holder (reference 0 -> 1): off the LRU list. */
void kr_prefix_block_revive(struct kr_cache *c, int32_t id);
/* The ownership check's part: each snapshot's slot and blocks (slot_owner and refs counted as in
 * kr_cache_check_owners), registered and LRU blocks consistent. */
bool kr_prefix_block_registered(const struct kr_cache *c, int32_t id);
void kr_prefix_check(const struct kr_cache *c, int32_t *slot_owner, int32_t *refs);
