/* The prefix cache (cache.h): registered full blocks found by the chain hash of their tokens, and
 * Mamba state snapshots. Engine thread only, like the pools it lives in. */
#include "cache-impl.h"

#include "alloc.h"
#include "array.h"
#include "log.h"

#include <sodium.h>
#include <string.h>

/* A snapshot: a frozen sequence cache and the tokens it stands for. */
struct snap {
    struct kr_seq_cache sc;  /* a slot of the snapshot pool, blocks (references), n_pos = p */
    int32_t *toks;           /* [p] */
    uint64_t seed;           /* the chain's seed (cache salt) */
    uint64_t key;            /* h[p / block_size]: its bucket */
    uint64_t stamp;          /* last use (LRU) */
    int32_t next;            /* bucket chain, or the free list */
    bool live, pinned;       /* pinned: being restored from, not evictable */
};

struct kr_prefix {
    bool keep_blocks;        /* no Mamba layers: blocks nobody holds stay cached while registered */
    bool snapshots;          /* Mamba layers: states are snapshotted */
    int32_t state_interval;
    int32_t n_snaps, snaps_used;
    struct snap *snap;       /* [n_snaps] */
    int32_t snap_free;       /* free list of snap[] */
    int32_t *slot_stack;     /* [n_snaps] free slots of the snapshot pool */
    int32_t n_slot_free;
    int32_t *sbucket;        /* [smask + 1] heads of snapshot chains */
    uint32_t smask;
    uint64_t *bhash;         /* [n_blocks] hash of a registered block */
    uint8_t *breg;           /* [n_blocks] registered */
    int32_t *bbucket;        /* [bmask + 1] heads of block chains */
    uint32_t bmask;
    int32_t *bnext;          /* [n_blocks] */
    int32_t *lprev, *lnext;  /* [n_blocks] LRU list of cached blocks nobody holds, oldest first */
    int32_t lhead, ltail, n_lru;
    int32_t *sref;           /* [n_blocks] references held by snapshots */
    int32_t pinned_only;     /* blocks held by snapshots alone (block_ref == sref > 0) */
    uint64_t clock;
    unsigned char key[crypto_shorthash_KEYBYTES];
    unsigned char *buf;      /* 8 + 4 * block_size bytes: one hash's input */
    struct kr_prefix_stats st;
};

static uint32_t pow2_at_least(int64_t n)
{
    uint32_t p = 16;
    while ((int64_t)p < n && p < (1u << 30)) {
        p <<= 1;
    }
    return p;
}

enum kr_status kr_prefix_create(struct kr_cache *c, const struct kr_cache_plan *plan)
{
    if (!plan->prefix) {
        return KR_OK;
    }
    if (sodium_init() < 0) {
        KR_LOG_ERROR("prefix cache: libsodium failed to initialise");
        return KR_ERR_INTERNAL;
    }
    struct kr_prefix *p = kr_calloc(1, sizeof *p);
    if (!p) {
        return KR_ERR_NOMEM;
    }
    c->prefix = p;
    p->snapshots = c->n_mamba > 0 && plan->n_snaps > 0;
    p->keep_blocks = c->n_mamba == 0;
    p->state_interval = plan->state_interval;
    p->n_snaps = p->snapshots ? plan->n_snaps : 0;
    const int32_t nb = c->n_blocks > 0 ? c->n_blocks : 1;
    p->bmask = pow2_at_least(nb) - 1;
    p->smask = pow2_at_least(2 * (int64_t)p->n_snaps) - 1;
    p->snap = kr_calloc((size_t)(p->n_snaps ? p->n_snaps : 1), sizeof *p->snap);
    p->slot_stack = kr_malloc((size_t)(p->n_snaps ? p->n_snaps : 1) * sizeof(int32_t));
    p->sbucket = kr_malloc(((size_t)p->smask + 1) * sizeof(int32_t));
    p->bhash = kr_calloc((size_t)nb, sizeof(uint64_t));
    p->breg = kr_calloc((size_t)nb, 1);
    p->bbucket = kr_malloc(((size_t)p->bmask + 1) * sizeof(int32_t));
    p->bnext = kr_malloc((size_t)nb * sizeof(int32_t));
    p->lprev = kr_malloc((size_t)nb * sizeof(int32_t));
    p->lnext = kr_malloc((size_t)nb * sizeof(int32_t));
    p->sref = kr_calloc((size_t)nb, sizeof(int32_t));
    p->buf = kr_malloc(8 + 4 * (size_t)c->block_size);
    if (!p->snap || !p->slot_stack || !p->sbucket || !p->bhash || !p->breg || !p->bbucket || !p->bnext ||
        !p->lprev || !p->lnext || !p->sref || !p->buf) {
        return KR_ERR_NOMEM; /* kr_cache_free frees what was allocated */
    }
    for (uint32_t i = 0; i <= p->smask; i++) {
        p->sbucket[i] = -1;
    }
    for (uint32_t i = 0; i <= p->bmask; i++) {
        p->bbucket[i] = -1;
    }
    /* snapshot structs on a free list; the snapshot pool's slots follow the running ones */
    for (int32_t i = 0; i < p->n_snaps; i++) {
        p->snap[i].next = i + 1 < p->n_snaps ? i + 1 : -1;
        p->snap[i].sc.slot = -1;
        p->slot_stack[i] = c->n_slots + p->n_snaps - 1 - i;
    }
    p->snap_free = p->n_snaps ? 0 : -1;
    p->n_slot_free = p->n_snaps;
    p->lhead = p->ltail = -1;
    randombytes_buf(p->key, sizeof p->key);
    p->st.n_snaps = p->n_snaps;
    p->st.snap_bytes = (size_t)c->n_mamba * (c->conv_slot_bytes + c->ssm_slot_bytes);
    return KR_OK;
}

static void snap_drop(struct kr_cache *c, int32_t i);

void kr_prefix_free(struct kr_cache *c)
{
    struct kr_prefix *p = c->prefix;
    if (!p) {
        return;
    }
    if (p->snap) {
        for (int32_t i = 0; i < p->n_snaps; i++) {
            kr_free(p->snap[i].sc.blocks);
            kr_free(p->snap[i].toks);
        }
    }
    kr_free(p->snap);
    kr_free(p->slot_stack);
    kr_free(p->sbucket);
    kr_free(p->bhash);
    kr_free(p->breg);
    kr_free(p->bbucket);
    kr_free(p->bnext);
    kr_free(p->lprev);
    kr_free(p->lnext);
    kr_free(p->sref);
    kr_free(p->buf);
    kr_free(p);
    c->prefix = NULL;
}

/* ---- hashes ------------------------------------------------------------------------------------ */

static uint64_t hash_bytes(const struct kr_prefix *p, const unsigned char *in, size_t n)
{
    unsigned char out[crypto_shorthash_BYTES];
    crypto_shorthash(out, in, n, p->key);
    uint64_t h;
    memcpy(&h, out, sizeof h);
    return h;
}

uint64_t kr_prefix_seed(const struct kr_cache *c, const char *salt, size_t n)
{
    const struct kr_prefix *p = c->prefix;
    if (!p) {
        return 0;
    }
    /* short salts (and none) on the stack: an unsalted request never depends on an allocation, whose
     * failure would give it a seed of its own and so blocks no later request can find */
    unsigned char local[256];
    unsigned char *in = n + 1 <= sizeof local ? local : kr_malloc(n + 1);
    if (!in) { /* a salted request must never share an unsalted seed: one of its own */
        uint64_t h;
        randombytes_buf(&h, sizeof h);
        return h;
    }
    in[0] = n ? 1 : 0; /* "" and no salt are the same; a salt never equals them */
    if (n) {
        memcpy(in + 1, salt, n);
    }
    const uint64_t h = hash_bytes(p, in, n + 1);
    if (in != local) {
        kr_free(in);
    }
    return h;
}

void kr_prefix_hashes(const struct kr_cache *c, const int32_t *toks, int32_t from, int32_t n_blocks, uint64_t *h)
{
    struct kr_prefix *p = c->prefix;
    if (!p) {
        return;
    }
    const size_t tb = 4 * (size_t)c->block_size;
    for (int32_t j = from > 0 ? from : 1; j <= n_blocks; j++) {
        memcpy(p->buf, &h[j - 1], 8);
        memcpy(p->buf + 8, toks + (size_t)(j - 1) * (size_t)c->block_size, tb);
        h[j] = hash_bytes(p, p->buf, 8 + tb);
    }
}

/* ---- the block registry and the LRU list ------------------------------------------------------------ */

static int32_t block_find(const struct kr_prefix *p, uint64_t h)
{
    for (int32_t i = p->bbucket[h & p->bmask]; i >= 0; i = p->bnext[i]) {
        if (p->bhash[i] == h) {
            return i;
        }
    }
    return -1;
}

static void block_unregister(struct kr_prefix *p, int32_t id)
{
    int32_t *link = &p->bbucket[p->bhash[id] & p->bmask];
    while (*link != id) {
        KR_ASSERT(*link >= 0);
        link = &p->bnext[*link];
    }
    *link = p->bnext[id];
    p->breg[id] = 0;
}

static void lru_unlink(struct kr_prefix *p, int32_t id)
{
    if (p->lprev[id] >= 0) {
        p->lnext[p->lprev[id]] = p->lnext[id];
    } else {
        p->lhead = p->lnext[id];
    }
    if (p->lnext[id] >= 0) {
        p->lprev[p->lnext[id]] = p->lprev[id];
    } else {
        p->ltail = p->lprev[id];
    }
    p->n_lru--;
}

bool kr_prefix_block_unheld(struct kr_cache *c, int32_t id)
{
    struct kr_prefix *p = c->prefix;
    if (!p || !p->breg[id]) {
        return false;
    }
    if (!p->keep_blocks) {
        block_unregister(p, id);
        return false;
    }
    p->lprev[id] = p->ltail;
    p->lnext[id] = -1;
    if (p->ltail >= 0) {
        p->lnext[p->ltail] = id;
    } else {
        p->lhead = id;
    }
    p->ltail = id;
    p->n_lru++;
    return true;
}

bool kr_prefix_block_registered(const struct kr_cache *c, int32_t id)
{
    return c->prefix && c->prefix->breg[id];
}

void kr_prefix_seq_ref(struct kr_cache *c, int32_t id)
{
    struct kr_prefix *p = c->prefix;
    if (p && p->sref[id] > 0 && c->block_ref[id] == p->sref[id]) {
        p->pinned_only--; /* a sequence holds it now too */
    }
}

void kr_prefix_seq_unref(struct kr_cache *c, int32_t id)
{
    struct kr_prefix *p = c->prefix;
    if (p && p->sref[id] > 0 && c->block_ref[id] == p->sref[id]) {
        p->pinned_only++; /* the last sequence let go: only snapshots hold it */
    }
}

/* A snapshot takes one more reference to a held block. */
static void snap_ref(struct kr_cache *c, int32_t id)
{
    c->block_ref[id]++;
    c->prefix->sref[id]++;
}

/* A snapshot lets go of a block. */
static void snap_unref(struct kr_cache *c, int32_t id)
{
    struct kr_prefix *p = c->prefix;
    p->pinned_only -= c->block_ref[id] == p->sref[id];
    p->sref[id]--;
    kr_cache_block_unref(c, id);
    p->pinned_only += p->sref[id] > 0 && c->block_ref[id] == p->sref[id];
}

void kr_prefix_block_revive(struct kr_cache *c, int32_t id)
{
    struct kr_prefix *p = c->prefix;
    KR_ASSERT(p && p->breg[id] && c->block_ref[id] == 0);
    lru_unlink(p, id);
}

void kr_prefix_register(struct kr_cache *c, const struct kr_seq_cache *s, int32_t from, int32_t to, const uint64_t *h)
{
    struct kr_prefix *p = c->prefix;
    if (!p) {
        return;
    }
    to = to < s->n_blocks ? to : s->n_blocks;
    for (int32_t j = from; j < to; j++) {
        const int32_t id = s->blocks[j];
        if (p->breg[id] || block_find(p, h[j + 1]) >= 0) {
            continue;
        }
        p->bhash[id] = h[j + 1];
        p->breg[id] = 1;
        uint32_t b = (uint32_t)(h[j + 1] & p->bmask);
        p->bnext[id] = p->bbucket[b];
        p->bbucket[b] = id;
    }
}

/* ---- snapshots -------------------------------------------------------------------------------------- */

static struct snap *snap_find(struct kr_prefix *p, const int32_t *toks, int32_t pos, const uint64_t *h,
                              int32_t block_size)
{
    const uint64_t key = h[pos / block_size];
    for (int32_t i = p->sbucket[key & p->smask]; i >= 0; i = p->snap[i].next) {
        struct snap *s = &p->snap[i];
        if (s->key == key && s->seed == h[0] && s->sc.n_pos == pos &&
            memcmp(s->toks, toks, (size_t)pos * sizeof *toks) == 0) {
            return s;
        }
    }
    return NULL;
}

bool kr_prefix_has_snapshot(struct kr_cache *c, const int32_t *toks, int32_t pos, const uint64_t *h)
{
    struct kr_prefix *p = c->prefix;
    struct snap *s = p && p->snapshots ? snap_find(p, toks, pos, h, c->block_size) : NULL;
    if (s) {
        s->stamp = ++p->clock;
    }
    return s != NULL;
}

/* Unlinks snapshot i from its bucket and gives back everything it holds. */
static void snap_drop(struct kr_cache *c, int32_t i)
{
    struct kr_prefix *p = c->prefix;
    struct snap *s = &p->snap[i];
    int32_t *link = &p->sbucket[s->key & p->smask];
    while (*link != i) {
        KR_ASSERT(*link >= 0);
        link = &p->snap[*link].next;
    }
    *link = s->next;
    for (int32_t j = s->sc.n_blocks - 1; j >= 0; j--) {
        snap_unref(c, s->sc.blocks[j]);
    }
    p->slot_stack[p->n_slot_free++] = s->sc.slot;
    kr_free(s->sc.blocks);
    kr_free(s->toks);
    memset(s, 0, sizeof *s);
    s->sc.slot = -1;
    s->next = p->snap_free;
    p->snap_free = i;
    p->snaps_used--;
    p->st.evicted_snapshots++;
}

/* The least recently used snapshot that is not pinned, or -1. */
static int32_t snap_lru(const struct kr_prefix *p)
{
    int32_t best = -1;
    for (int32_t i = 0; i < p->n_snaps; i++) {
        const struct snap *s = &p->snap[i];
        if (s->live && !s->pinned && (best < 0 || s->stamp < p->snap[best].stamp)) {
            best = i;
        }
    }
    return best;
}

/* A free snapshot struct (evicting the least recently used one when none is), or -1. */
static int32_t snap_take(struct kr_cache *c)
{
    struct kr_prefix *p = c->prefix;
    if (p->snap_free < 0) {
        const int32_t v = snap_lru(p);
        if (v < 0) {
            return -1;
        }
        snap_drop(c, v);
    }
    const int32_t i = p->snap_free;
    p->snap_free = p->snap[i].next;
    return i;
}

/* Makes snapshot i (filled: sc, toks, seed, key) findable. */
static void snap_publish(struct kr_cache *c, int32_t i)
{
    struct kr_prefix *p = c->prefix;
    struct snap *s = &p->snap[i];
    s->live = true;
    s->pinned = false;
    s->stamp = ++p->clock;
    const uint32_t b = (uint32_t)(s->key & p->smask);
    s->next = p->sbucket[b];
    p->sbucket[b] = i;
    p->snaps_used++;
    p->st.snapshots++;
}

static void snap_giveback(struct kr_prefix *p, int32_t i)
{
    p->snap[i].next = p->snap_free;
    p->snap_free = i;
}

enum kr_status kr_prefix_snapshot(struct kr_cache *c, const struct kr_seq_cache *src, const int32_t *toks,
                                  const uint64_t *h)
{
    struct kr_prefix *p = c->prefix;
    const int32_t pos = src->n_pos;
    if (!p || !p->snapshots || pos <= 0 || src->slot < 0) {
        return KR_OK;
    }
    if (kr_prefix_has_snapshot(c, toks, pos, h)) {
        return KR_OK;
    }
    const int32_t i = snap_take(c);
    if (i < 0) {
        return KR_OK;
    }
    struct snap *s = &p->snap[i];
    const bool paged = c->n_attn || c->n_mla;
    const int32_t full = paged ? pos / c->block_size : 0;
    const bool partial = paged && pos % c->block_size != 0;
    const int32_t nb = full + (partial ? 1 : 0);
    s->toks = kr_malloc((size_t)pos * sizeof *toks);
    s->sc.blocks = kr_malloc((size_t)(nb ? nb : 1) * sizeof(int32_t));
    enum kr_status st = s->toks && s->sc.blocks ? KR_OK : KR_ERR_NOMEM;
    if (st == KR_OK && partial) {
        st = kr_cache_blocks_alloc(c, 1, s->sc.blocks + full);
        if (st == KR_OK && (st = kr_cache_block_copy(c, src->blocks[full], s->sc.blocks[full])) != KR_OK) {
            kr_cache_blocks_free(c, 1, s->sc.blocks + full);
        }
    }
    if (st == KR_OK) {
        /* the pool's slot last: the block allocation above may have evicted snapshots */
        KR_ASSERT(p->n_slot_free > 0);
        s->sc.slot = p->slot_stack[--p->n_slot_free];
        if ((st = kr_cache_slot_copy(c, src->slot, s->sc.slot)) != KR_OK) {
            p->slot_stack[p->n_slot_free++] = s->sc.slot;
            if (partial) {
                kr_cache_blocks_free(c, 1, s->sc.blocks + full);
            }
        }
    }
    if (st != KR_OK) {
        kr_free(s->toks);
        kr_free(s->sc.blocks);
        memset(s, 0, sizeof *s);
        s->sc.slot = -1;
        snap_giveback(p, i);
        return st == KR_AGAIN ? KR_OK : st; /* no room for the partial block: no snapshot */
    }
    for (int32_t j = 0; j < full; j++) {
        s->sc.blocks[j] = src->blocks[j];
        snap_ref(c, src->blocks[j]);
    }
    if (partial) { /* allocated for the snapshot alone */
        p->sref[s->sc.blocks[full]] = 1;
        p->pinned_only++;
    }
    s->sc.n_blocks = s->sc.cap_blocks = nb;
    s->sc.n_pos = pos;
    memcpy(s->toks, toks, (size_t)pos * sizeof *toks);
    s->seed = h[0];
    s->key = h[pos / c->block_size];
    snap_publish(c, i);
    return KR_OK;
}

void kr_prefix_release(struct kr_cache *c, struct kr_seq_cache *sq, const int32_t *toks, const uint64_t *h)
{
    struct kr_prefix *p = c->prefix;
    const int32_t pos = sq->n_pos;
    if (!p || sq->slot < 0) {
        kr_seq_cache_release(c, sq);
        return;
    }
    const bool paged = c->n_attn || c->n_mla;
    if (paged) {
        kr_prefix_register(c, sq, 0, pos / c->block_size, h);
    }
    if (!p->snapshots || pos <= 0 || kr_prefix_has_snapshot(c, toks, pos, h)) {
        kr_seq_cache_release(c, sq);
        return;
    }
    const int32_t i = snap_take(c);
    int32_t *copy = i >= 0 ? kr_malloc((size_t)pos * sizeof *toks) : NULL;
    if (!copy) {
        if (i >= 0) {
            snap_giveback(p, i);
        }
        kr_seq_cache_release(c, sq);
        return;
    }
    /* blocks reserved beyond the position go back; the slot changes pool (no copy): the snapshot
     * keeps the sequence's slot and one of the snapshot pool's goes to the running pool instead */
    const int32_t nb = paged ? (pos + c->block_size - 1) / c->block_size : 0;
    if (sq->n_blocks > nb) {
        kr_cache_blocks_free(c, sq->n_blocks - nb, sq->blocks + nb);
        sq->n_blocks = nb;
    }
    KR_ASSERT(p->n_slot_free > 0);
    kr_cache_slot_free(c, p->slot_stack[--p->n_slot_free]);
    struct snap *s = &p->snap[i];
    s->sc = *sq;
    for (int32_t j = 0; j < s->sc.n_blocks; j++) { /* the sequence's references become the snapshot's */
        const int32_t id = s->sc.blocks[j];
        p->sref[id]++;
        p->pinned_only += c->block_ref[id] == p->sref[id];
    }
    memcpy(copy, toks, (size_t)pos * sizeof *toks);
    s->toks = copy;
    s->seed = h[0];
    s->key = h[pos / c->block_size];
    snap_publish(c, i);
    memset(sq, 0, sizeof *sq);
    sq->slot = -1;
}

/* ---- lookup ----------------------------------------------------------------------------------------- */

/* Full blocks of toks[0..n_lookup) registered as a chain from the first. */
static int32_t chain_blocks(const struct kr_cache *c, int32_t n_lookup, const uint64_t *h)
{
    int32_t L = 0;
    if (c->n_attn || c->n_mla) {
        while (L < n_lookup / c->block_size && block_find(c->prefix, h[L + 1]) >= 0) {
            L++;
        }
    }
    return L;
}

/* The deepest snapshot of a prefix of toks[0..n_lookup), or NULL. */
static struct snap *deepest_snapshot(const struct kr_cache *c, const int32_t *toks, int32_t n_lookup,
                                     const uint64_t *h)
{
    struct kr_prefix *p = c->prefix;
    const int32_t B = c->block_size;
    struct snap *best = NULL;
    for (int32_t j = n_lookup / B; j >= 0 && !best; j--) {
        for (int32_t i = p->sbucket[h[j] & p->smask]; i >= 0; i = p->snap[i].next) {
            struct snap *s = &p->snap[i];
            const int32_t pos = s->sc.n_pos;
            if (s->key == h[j] && s->seed == h[0] && pos / B == j && pos <= n_lookup &&
                (!best || pos > best->sc.n_pos) && memcmp(s->toks, toks, (size_t)pos * sizeof *toks) == 0) {
                best = s;
            }
        }
    }
    return best;
}

enum kr_status kr_prefix_admit(struct kr_cache *c, const int32_t *toks, int32_t n_lookup, const uint64_t *h,
                               struct kr_seq_cache *dst, int32_t *hit)
{
    struct kr_prefix *p = c->prefix;
    *hit = 0;
    enum kr_status st = kr_seq_cache_init(c, dst);
    if (st != KR_OK || !p || n_lookup <= 0) {
        if (st != KR_OK) {
            dst->slot = -1;
        }
        return st;
    }
    p->st.queries += (uint64_t)n_lookup;
    const int32_t B = c->block_size;
    const int32_t L = chain_blocks(c, n_lookup, h); /* blocks: the longest registered chain */
    if (!p->snapshots) {
        if (p->keep_blocks && L > 0 && KR_ARRAY_RESERVE(dst->blocks, dst->cap_blocks, L, 4) == KR_OK) {
            for (int32_t j = 0; j < L; j++) {
                const int32_t id = block_find(p, h[j + 1]);
                if (c->block_ref[id] == 0) {
                    kr_prefix_block_revive(c, id);
                    c->block_ref[id] = 1;
                } else {
                    kr_cache_block_ref(c, id);
                }
                dst->blocks[j] = id;
            }
            dst->n_blocks = L;
            dst->n_pos = L * B;
            *hit = L * B;
            p->st.hits += (uint64_t)*hit;
        }
        return KR_OK;
    }
    /* Mamba layers: the deepest snapshot of a prefix of toks[0..n_lookup) */
    struct snap *best = deepest_snapshot(c, toks, n_lookup, h);
    if (best) {
        /* dst already holds a slot: the fork takes its own, so give this one back first */
        kr_seq_cache_release(c, dst);
        best->pinned = true;
        best->stamp = ++p->clock;
        st = kr_seq_cache_fork(c, &best->sc, best->sc.n_pos, dst);
        best->pinned = false;
        if (st == KR_OK) {
            *hit = best->sc.n_pos;
        } else if ((st = kr_seq_cache_init(c, dst)) != KR_OK) { /* no room for the partial block: a miss */
            dst->slot = -1;
            return st;
        }
    }
    p->st.hits += (uint64_t)*hit;
    if (L * B > *hit) {
        p->st.block_only += (uint64_t)(L * B - *hit);
    }
    return KR_OK;
}

/* ---- eviction --------------------------------------------------------------------------------------- */

void kr_prefix_reclaim(struct kr_cache *c, int32_t want)
{
    struct kr_prefix *p = c->prefix;
    if (!p) {
        return;
    }
    while (c->n_free_blocks < want) {
        if (p->n_lru > 0) {
            const int32_t id = p->lhead;
            lru_unlink(p, id);
            block_unregister(p, id);
            c->free_blocks[c->n_free_blocks++] = id;
            p->st.evicted_blocks++;
            continue;
        }
        const int32_t v = snap_lru(p);
        if (v < 0) {
            return;
        }
        snap_drop(c, v);
    }
}

void kr_prefix_clear(struct kr_cache *c)
{
    struct kr_prefix *p = c->prefix;
    if (!p) {
        return;
    }
    kr_prefix_reclaim(c, c->n_blocks + 1); /* everything evictable */
    for (int32_t v; (v = snap_lru(p)) >= 0;) {
        snap_drop(c, v);
    }
}

void kr_prefix_get_stats(const struct kr_cache *c, struct kr_prefix_stats *st)
{
    const struct kr_prefix *p = c->prefix;
    if (!p) {
        memset(st, 0, sizeof *st);
        return;
    }
    *st = p->st;
    st->snaps_used = p->snaps_used;
    st->blocks_cached = p->n_lru + p->pinned_only;
}

void kr_prefix_check(const struct kr_cache *c, int32_t *slot_owner, int32_t *refs)
{
    const struct kr_prefix *p = c->prefix;
    if (!p) {
        return;
    }
    int32_t live = 0;
    for (int32_t i = 0; i < p->n_slot_free; i++) {
        KR_ASSERT(slot_owner[p->slot_stack[i]]++ == 0);
    }
    for (int32_t i = 0; i < p->n_snaps; i++) {
        const struct snap *s = &p->snap[i];
        if (!s->live) {
            continue;
        }
        live++;
        KR_ASSERT(!s->pinned && s->sc.slot >= 0 && slot_owner[s->sc.slot]++ == 0);
        KR_ASSERT(s->key == 0 || s->sc.n_pos > 0);
        for (int32_t j = 0; j < s->sc.n_blocks; j++) {
            refs[s->sc.blocks[j]]++;
        }
    }
    {
        int32_t *sr = kr_calloc((size_t)(c->n_blocks ? c->n_blocks : 1), sizeof(int32_t));
        KR_ASSERT(sr);
        for (int32_t i = 0; i < p->n_snaps; i++) {
            for (int32_t j = 0; p->snap[i].live && j < p->snap[i].sc.n_blocks; j++) {
                sr[p->snap[i].sc.blocks[j]]++;
            }
        }
        int32_t only = 0;
        for (int32_t id = 0; id < c->n_blocks; id++) {
            KR_ASSERT(sr[id] == p->sref[id]);
            only += sr[id] > 0 && c->block_ref[id] == sr[id];
        }
        KR_ASSERT(only == p->pinned_only);
        kr_free(sr);
    }
    KR_ASSERT(live == p->snaps_used && live + p->n_slot_free == p->n_snaps);
    /* cached blocks nobody holds: registered, on the list once */
    int32_t n = 0;
    for (int32_t id = p->lhead; id >= 0; id = p->lnext[id]) {
        KR_ASSERT(p->breg[id] && c->block_ref[id] == 0 && refs[id] == 0);
        refs[id] = -2;
        n++;
    }
    KR_ASSERT(n == p->n_lru);
    for (int32_t id = 0; id < c->n_blocks; id++) {
        if (p->breg[id]) {
            KR_ASSERT(block_find(p, p->bhash[id]) == id);
        }
    }
}
