#include "cache-impl.h"

#include "alloc.h"
#include "array.h"
#include "log.h"

#include <string.h>

enum kr_status kr_cache_create(const struct kr_model *m, int32_t n_slots, int32_t n_blocks, int32_t block_size,
                               struct kr_cache **out)
{
    const struct kr_cache_plan plan = {.n_slots = n_slots, .n_blocks = n_blocks, .block_size = block_size};
    return kr_cache_create_plan(m, &plan, out);
}

/* Bytes per cached K/V value and per latent row (D layers with the index key), for packed FP8 pools
 * or the backend's elements. */
static bool packed_fp8(const struct kr_model *m)
{
    return m->kv_fp8 && kr_backend_kv_fp8_packed(m->be);
}

static size_t kv_elt_bytes(const struct kr_model *m)
{
    return packed_fp8(m) ? 1 : kr_backend_cache_elt_size(m->be);
}

static size_t latent_row_bytes(const struct kr_model *m, bool dsa)
{
    const struct kr_model_config *cfg = &m->cfg;
    if (packed_fp8(m)) {
        return (size_t)(krk_fp8_latent_bytes(cfg->kv_lora, cfg->qk_rope) +
                        (dsa ? krk_fp8_key_bytes(cfg->idx_head_dim) : 0));
    }
    return (size_t)(cfg->kv_lora + cfg->qk_rope + (dsa ? cfg->idx_head_dim : 0)) * kr_backend_cache_elt_size(m->be);
}

enum kr_status kr_cache_create_plan(const struct kr_model *m, const struct kr_cache_plan *plan, struct kr_cache **out)
{
    const struct kr_model_config *cfg = &m->cfg;
    const int32_t n_slots = plan->n_slots, n_blocks = plan->n_blocks, block_size = plan->block_size;
    const int32_t n_snaps = plan->prefix && m->n_mamba > 0 ? plan->n_snaps : 0;
    if (n_slots < 1 || n_blocks < 0 || block_size < 1 || n_snaps < 0 || n_snaps > INT32_MAX - n_slots) {
        return KR_ERR_INVAL;
    }
    const int32_t n_state = n_slots + n_snaps; /* running slots, then the snapshot pool's */
    struct kr_cache *c = kr_calloc(1, sizeof *c);
    if (!c) {
        return KR_ERR_NOMEM;
    }
    enum kr_status st = KR_ERR_NOMEM;
    const size_t act = kr_backend_cache_elt_size(m->be);
    c->be = m->be;
    c->act = act;
    c->n_slots = n_slots;
    c->n_blocks = n_blocks;
    c->block_size = block_size;
    c->n_mamba = m->n_mamba;
    c->n_attn = m->n_attn;
    c->fp8 = packed_fp8(m);
    if (c->n_mamba) {
        c->conv_slot_bytes = (size_t)(cfg->m_conv - 1) * (size_t)cfg->m_conv_dim * act;
        c->ssm_slot_bytes = (size_t)(cfg->m_heads * cfg->m_head_dim * cfg->m_state) * sizeof(float);
        c->conv_layer_bytes = (size_t)n_state * c->conv_slot_bytes;
        c->ssm_layer_bytes = (size_t)n_state * c->ssm_slot_bytes;
        if ((st = kr_backend_buf_alloc(c->be, c->conv_layer_bytes * (size_t)c->n_mamba, &c->conv)) != KR_OK ||
            (st = kr_backend_buf_alloc(c->be, c->ssm_layer_bytes * (size_t)c->n_mamba, &c->ssm)) != KR_OK) {
            goto fail;
        }
    }
    if (c->n_attn) {
        c->kv_layer_bytes =
            (size_t)n_blocks * (size_t)block_size * (size_t)(cfg->n_kv_head * cfg->head_dim) * kv_elt_bytes(m);
        if ((st = kr_backend_buf_alloc(c->be, c->kv_layer_bytes * (size_t)c->n_attn, &c->k)) != KR_OK ||
            (st = kr_backend_buf_alloc(c->be, c->kv_layer_bytes * (size_t)c->n_attn, &c->v)) != KR_OK) {
            goto fail;
        }
    }
    c->n_mla = m->n_mla;
    if (c->n_mla) {
        c->mla_row = kr_calloc((size_t)c->n_mla, sizeof *c->mla_row);
        c->mla_off = kr_calloc((size_t)c->n_mla, sizeof *c->mla_off);
        if (!c->mla_row || !c->mla_off) {
            st = KR_ERR_NOMEM;
            goto fail;
        }
        size_t total = 0;
        for (int32_t i = 0; i < cfg->n_layer + m->n_mtp; i++) { /* the MTP head's blocks have caches too */
            const struct kr_layer *L = &m->layers[i];
            if (L->type != KR_LAYER_DSA && L->type != KR_LAYER_MLA) {
                continue;
            }
            const size_t row_bytes = latent_row_bytes(m, L->mla.has_indexer); /* index keys where indexed */
            c->mla_row[L->cache_idx] = (int64_t)(c->fp8 ? row_bytes : row_bytes / act);
            c->mla_off[L->cache_idx] = total;
            total += (size_t)n_blocks * (size_t)block_size * row_bytes;
        }
        c->mla_key_off = c->fp8 ? krk_fp8_latent_bytes(cfg->kv_lora, cfg->qk_rope) : cfg->kv_lora + cfg->qk_rope;
        if ((st = kr_backend_buf_alloc(c->be, total, &c->mla)) != KR_OK) {
            goto fail;
        }
    }
    c->free_slots = kr_malloc((size_t)n_slots * sizeof(int32_t));
    c->free_blocks = kr_malloc((size_t)(n_blocks ? n_blocks : 1) * sizeof(int32_t));
    c->block_ref = kr_calloc((size_t)(n_blocks ? n_blocks : 1), sizeof(int32_t));
    if (!c->free_slots || !c->free_blocks || !c->block_ref) {
        st = KR_ERR_NOMEM;
        goto fail;
    }
    /* stacks pop from the end: lowest ids first */
    for (int32_t i = 0; i < n_slots; i++) {
        c->free_slots[i] = n_slots - 1 - i;
    }
    c->n_free_slots = n_slots;
    for (int32_t i = 0; i < n_blocks; i++) {
        c->free_blocks[i] = n_blocks - 1 - i;
    }
    c->n_free_blocks = n_blocks;
    c->n_state_slots = n_state;
    if ((st = kr_prefix_create(c, plan)) != KR_OK) {
        goto fail;
    }
    kr_backend_graph_reset(m->be); /* no captured step may outlive the pools it points into */
    *out = c;
    return KR_OK;
fail:
    kr_cache_free(c);
    return st;
}

void kr_cache_free(struct kr_cache *c)
{
    if (!c) {
        return;
    }
    kr_backend_graph_reset(c->be); /* captured steps point into these pools */
    kr_prefix_free(c);
    kr_backend_buf_free(c->be, &c->conv);
    kr_backend_buf_free(c->be, &c->ssm);
    kr_backend_buf_free(c->be, &c->k);
    kr_backend_buf_free(c->be, &c->v);
    kr_backend_buf_free(c->be, &c->mla);
    kr_free(c->mla_row);
    kr_free(c->mla_off);
    kr_free(c->free_slots);
    kr_free(c->free_blocks);
    kr_free(c->block_ref);
    kr_free(c);
}

size_t kr_cache_bytes(const struct kr_cache *c)
{
    return c->conv.size + c->ssm.size + c->k.size + c->v.size + c->mla.size;
}

enum kr_status kr_cache_slot_alloc(struct kr_cache *c, int32_t *slot)
{
    if (c->n_free_slots == 0) {
        return KR_AGAIN;
    }
    *slot = c->free_slots[--c->n_free_slots];
    return KR_OK;
}

void kr_cache_slot_free(struct kr_cache *c, int32_t slot)
{
    KR_ASSERT(slot >= 0 && slot < c->n_state_slots && c->n_free_slots < c->n_slots);
    c->free_slots[c->n_free_slots++] = slot;
}

enum kr_status kr_cache_blocks_alloc(struct kr_cache *c, int32_t n, int32_t *ids)
{
    if (n > c->n_free_blocks) {
        kr_prefix_reclaim(c, n);
    }
    if (n > c->n_free_blocks) {
        return KR_AGAIN;
    }
    for (int32_t i = 0; i < n; i++) {
        ids[i] = c->free_blocks[--c->n_free_blocks];
        KR_ASSERT(c->block_ref[ids[i]] == 0);
        c->block_ref[ids[i]] = 1;
    }
    return KR_OK;
}

void kr_cache_block_unref(struct kr_cache *c, int32_t id)
{
    KR_ASSERT(id >= 0 && id < c->n_blocks && c->block_ref[id] > 0);
    if (--c->block_ref[id] == 0 && !kr_prefix_block_unheld(c, id)) {
        KR_ASSERT(c->n_free_blocks < c->n_blocks);
        c->free_blocks[c->n_free_blocks++] = id;
    }
}

void kr_cache_blocks_free(struct kr_cache *c, int32_t n, const int32_t *ids)
{
    for (int32_t i = n - 1; i >= 0; i--) {
        kr_cache_block_unref(c, ids[i]);
        kr_prefix_seq_unref(c, ids[i]);
    }
}

void kr_cache_block_ref(struct kr_cache *c, int32_t id)
{
    KR_ASSERT(id >= 0 && id < c->n_blocks && c->block_ref[id] > 0);
    kr_prefix_seq_ref(c, id);
    c->block_ref[id]++;
}

void kr_cache_unit_bytes(const struct kr_model *m, int32_t block_size, size_t *slot_bytes, size_t *block_bytes)
{
    const struct kr_model_config *cfg = &m->cfg;
    const size_t act = kr_backend_cache_elt_size(m->be);
    size_t sb = 0, bb = 0;
    const size_t kv_elt = kv_elt_bytes(m);
    if (m->n_mamba) {
        sb = (size_t)m->n_mamba * ((size_t)(cfg->m_conv - 1) * (size_t)cfg->m_conv_dim * act +
                                   (size_t)(cfg->m_heads * cfg->m_head_dim * cfg->m_state) * sizeof(float));
    }
    bb += (size_t)m->n_attn * 2 * (size_t)block_size * (size_t)(cfg->n_kv_head * cfg->head_dim) * kv_elt;
    for (int32_t i = 0; i < cfg->n_layer + m->n_mtp; i++) {
        const struct kr_layer *L = &m->layers[i];
        if (L->type == KR_LAYER_DSA || L->type == KR_LAYER_MLA) {
            bb += (size_t)block_size * latent_row_bytes(m, L->mla.has_indexer);
        }
    }
    *slot_bytes = sb;
    *block_bytes = bb;
}

enum kr_status kr_cache_block_copy(struct kr_cache *c, int32_t src, int32_t dst)
{
    enum kr_status st = KR_OK;
    const size_t kvb = c->n_blocks ? c->kv_layer_bytes / (size_t)c->n_blocks : 0;
    for (int32_t l = 0; l < c->n_attn && st == KR_OK; l++) {
        char *k = kr_cache_k_layer(c, l), *v = kr_cache_v_layer(c, l);
        st = kr_backend_copy_d2d(c->be, k + (size_t)dst * kvb, k + (size_t)src * kvb, kvb);
        if (st == KR_OK) {
            st = kr_backend_copy_d2d(c->be, v + (size_t)dst * kvb, v + (size_t)src * kvb, kvb);
        }
    }
    for (int32_t l = 0; l < c->n_mla && st == KR_OK; l++) {
        const size_t bb = (size_t)c->block_size * (size_t)c->mla_row[l] * (c->fp8 ? 1 : c->act);
        char *p = kr_cache_mla_layer(c, l);
        st = kr_backend_copy_d2d(c->be, p + (size_t)dst * bb, p + (size_t)src * bb, bb);
    }
    return st == KR_OK && c->on_copy ? c->on_copy(c->on_copy_user, 0, src, dst) : st;
}

enum kr_status kr_cache_slot_copy(struct kr_cache *c, int32_t src, int32_t dst)
{
    enum kr_status st = KR_OK;
    for (int32_t l = 0; l < c->n_mamba && st == KR_OK; l++) {
        char *conv = kr_cache_conv_layer(c, l);
        char *ssm = (char *)kr_cache_ssm_layer(c, l);
        st = kr_backend_copy_d2d(c->be, conv + (size_t)dst * c->conv_slot_bytes, conv + (size_t)src * c->conv_slot_bytes,
                                 c->conv_slot_bytes);
        if (st == KR_OK) {
            st = kr_backend_copy_d2d(c->be, ssm + (size_t)dst * c->ssm_slot_bytes, ssm + (size_t)src * c->ssm_slot_bytes,
                                     c->ssm_slot_bytes);
        }
    }
    return st == KR_OK && c->on_copy ? c->on_copy(c->on_copy_user, 1, src, dst) : st;
}

void *kr_cache_conv_layer(const struct kr_cache *c, int32_t i)
{
    return (char *)c->conv.ptr + (size_t)i * c->conv_layer_bytes;
}

float *kr_cache_ssm_layer(const struct kr_cache *c, int32_t i)
{
    return (float *)((char *)c->ssm.ptr + (size_t)i * c->ssm_layer_bytes);
}

void *kr_cache_k_layer(const struct kr_cache *c, int32_t i)
{
    return (char *)c->k.ptr + (size_t)i * c->kv_layer_bytes;
}

void *kr_cache_v_layer(const struct kr_cache *c, int32_t i)
{
    return (char *)c->v.ptr + (size_t)i * c->kv_layer_bytes;
}

void *kr_cache_mla_layer(const struct kr_cache *c, int32_t i)
{
    return (char *)c->mla.ptr + c->mla_off[i];
}

enum kr_status kr_seq_cache_init(struct kr_cache *c, struct kr_seq_cache *s)
{
    memset(s, 0, sizeof *s);
    s->slot = -1;
    return kr_cache_slot_alloc(c, &s->slot);
}

enum kr_status kr_seq_cache_reserve(struct kr_cache *c, struct kr_seq_cache *s, int32_t n_tokens)
{
    if (c->n_attn == 0 && c->n_mla == 0) {
        return KR_OK; /* no paged pool: nothing to reserve */
    }
    int32_t need = (n_tokens + c->block_size - 1) / c->block_size;
    if (need <= s->n_blocks) {
        return KR_OK;
    }
    if (KR_ARRAY_RESERVE(s->blocks, s->cap_blocks, need, 4) != KR_OK) {
        return KR_ERR_NOMEM;
    }
    enum kr_status st = kr_cache_blocks_alloc(c, need - s->n_blocks, s->blocks + s->n_blocks);
    if (st == KR_OK) {
        s->n_blocks = need;
    }
    return st;
}

void kr_seq_cache_trim(struct kr_cache *c, struct kr_seq_cache *s, int32_t n_tokens)
{
    const int32_t keep = n_tokens <= 0 ? 0 : (n_tokens + c->block_size - 1) / c->block_size;
    if (s->n_blocks > keep) {
        kr_cache_blocks_free(c, s->n_blocks - keep, s->blocks + keep);
        s->n_blocks = keep;
    }
}

void kr_seq_cache_release(struct kr_cache *c, struct kr_seq_cache *s)
{
    if (s->slot >= 0) {
        kr_cache_slot_free(c, s->slot);
    }
    if (s->n_blocks) {
        kr_cache_blocks_free(c, s->n_blocks, s->blocks);
    }
    kr_free(s->blocks);
    memset(s, 0, sizeof *s);
    s->slot = -1;
}

enum kr_status kr_seq_cache_fork(struct kr_cache *c, const struct kr_seq_cache *src, int32_t n_pos,
                                 struct kr_seq_cache *dst)
{
    enum kr_status st = kr_seq_cache_init(c, dst);
    if (st != KR_OK) {
        dst->slot = -1;
        return st;
    }
    st = kr_cache_slot_copy(c, src->slot, dst->slot);
    if (st == KR_OK && (c->n_attn || c->n_mla)) {
        const int32_t full = n_pos / c->block_size;
        const bool partial = n_pos % c->block_size != 0;
        const int32_t need = full + (partial ? 1 : 0);
        int32_t *nb = kr_malloc((size_t)(need ? need : 1) * sizeof(int32_t));
        st = nb ? KR_OK : KR_ERR_NOMEM;
        if (st == KR_OK && partial) {
            st = kr_cache_blocks_alloc(c, 1, nb + full);
            if (st == KR_OK && (st = kr_cache_block_copy(c, src->blocks[full], nb[full])) != KR_OK) {
                kr_cache_blocks_free(c, 1, nb + full);
            }
        }
        if (st == KR_OK) {
            for (int32_t j = 0; j < full; j++) {
                nb[j] = src->blocks[j];
                kr_cache_block_ref(c, nb[j]);
            }
            kr_free(dst->blocks);
            dst->blocks = nb;
            dst->n_blocks = need;
            dst->cap_blocks = need;
        } else {
            kr_free(nb);
        }
    }
    if (st != KR_OK) {
        kr_seq_cache_release(c, dst);
        return st;
    }
    dst->n_pos = n_pos;
    return KR_OK;
}

void kr_cache_check_owners(const struct kr_cache *c, int32_t n_held,
                           const struct kr_seq_cache *(*held)(void *user, int32_t i), void *user)
{
    int32_t *slot_owner = kr_calloc((size_t)c->n_state_slots, sizeof(int32_t));
    int32_t *refs = kr_calloc((size_t)(c->n_blocks ? c->n_blocks : 1), sizeof(int32_t));
    KR_ASSERT(slot_owner && refs);
    for (int32_t i = 0; i < c->n_free_slots; i++) {
        KR_ASSERT(slot_owner[c->free_slots[i]]++ == 0);
    }
    for (int32_t i = 0; i < n_held; i++) {
        const struct kr_seq_cache *s = held(user, i);
        KR_ASSERT(s->slot >= 0 && slot_owner[s->slot]++ == 0);
        for (int32_t j = 0; j < s->n_blocks; j++) {
            refs[s->blocks[j]]++;
        }
    }
    KR_ASSERT(c->n_free_slots + n_held == c->n_slots); /* the running pool keeps its size */
    kr_prefix_check(c, slot_owner, refs);               /* snapshots' slots and blocks; cached blocks: -2 */
    for (int32_t i = 0; i < c->n_state_slots; i++) {
        KR_ASSERT(slot_owner[i] == 1); /* free or owned, exactly once */
    }
    for (int32_t i = 0; i < c->n_free_blocks; i++) {
        KR_ASSERT(refs[c->free_blocks[i]] == 0 && c->block_ref[c->free_blocks[i]] == 0);
        KR_ASSERT(!c->prefix || !kr_prefix_block_registered(c, c->free_blocks[i]));
        refs[c->free_blocks[i]] = -1; /* listed once */
    }
    for (int32_t b = 0; b < c->n_blocks; b++) {
        if (refs[b] >= 0) {
            KR_ASSERT(refs[b] == c->block_ref[b] && refs[b] > 0);
        }
    }
    kr_free(slot_owner);
    kr_free(refs);
}
