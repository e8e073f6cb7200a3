/* The wire format of a multi-node group (wire.h): frame headers, a payload writer and reader with
 * explicit little-endian integers, and the messages that carry more than a few fields. */
#include "wire.h"

#include "alloc.h"

#include <string.h>

const char *kr_wire_type_name(uint32_t type)
{
    static const char *const names[] = {"?",    "HELLO", "WELCOME", "REFUSE", "BLOB",  "START", "READY",
                                        "PLAN", "DONE",  "REDUCE",  "GATHER", "ABORT", "BYE"};
    return type < sizeof names / sizeof names[0] ? names[type] : "?";
}

static void le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static void le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t rd64(const uint8_t *p)
{
    return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32;
}

void kr_wire_header_put(uint8_t out[KR_WIRE_HEADER], enum kr_wire_type type, uint64_t len)
{
    le32(out, KR_WIRE_MAGIC);
    out[4] = (uint8_t)(KR_WIRE_VERSION & 0xff);
    out[5] = (uint8_t)(KR_WIRE_VERSION >> 8);
    out[6] = (uint8_t)((unsigned)type & 0xff);
    out[7] = (uint8_t)((unsigned)type >> 8);
    le64(out + 8, len);
}

enum kr_status kr_wire_header_get(const uint8_t in[KR_WIRE_HEADER], uint32_t *type, uint64_t *len, struct kr_err *err)
{
    const uint32_t magic = rd32(in);
    const unsigned version = (unsigned)in[4] | (unsigned)in[5] << 8;
    *type = (uint32_t)in[6] | (uint32_t)in[7] << 8;
    *len = rd64(in + 8);
    if (magic != KR_WIRE_MAGIC) {
        return kr_err_set(err, KR_ERR_FORMAT, "not a krait frame (magic 0x%08x, want 0x%08x)", magic, KR_WIRE_MAGIC);
    }
    if (version != KR_WIRE_VERSION) {
        return kr_err_set(err, KR_ERR_FORMAT, "wire version %u, this build speaks %u", version, KR_WIRE_VERSION);
    }
    if (*type < KR_WIRE_HELLO || *type > KR_WIRE_BYE) {
        return kr_err_set(err, KR_ERR_FORMAT, "unknown frame type %u", *type);
    }
    const bool data = *type == KR_WIRE_REDUCE || *type == KR_WIRE_GATHER;
    const uint64_t max = data ? KR_WIRE_MAX_DATA : KR_WIRE_MAX_CONTROL;
    if (*len > max) {
        return kr_err_set(err, KR_ERR_FORMAT, "a %s frame of %llu bytes (at most %llu)", kr_wire_type_name(*type),
                          (unsigned long long)*len, (unsigned long long)max);
    }
    return KR_OK;
}

/* ---- payload writer and reader ---------------------------------------------------------------- */

void kr_wire_buf_free(struct kr_wire_buf *b)
{
    kr_free(b->p);
    memset(b, 0, sizeof *b);
}

static uint8_t *grow(struct kr_wire_buf *b, size_t n)
{
    if (b->nomem) {
        return NULL;
    }
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n) {
            cap *= 2;
        }
        uint8_t *p = kr_realloc(b->p, cap);
        if (!p) {
            b->nomem = true;
            return NULL;
        }
        b->p = p;
        b->cap = cap;
    }
    uint8_t *at = b->p + b->len;
    b->len += n;
    return at;
}

void kr_wire_put_u8(struct kr_wire_buf *b, uint8_t v)
{
    uint8_t *p = grow(b, 1);
    if (p) {
        *p = v;
    }
}

void kr_wire_put_u32(struct kr_wire_buf *b, uint32_t v)
{
    uint8_t *p = grow(b, 4);
    if (p) {
        le32(p, v);
    }
}

void kr_wire_put_i32(struct kr_wire_buf *b, int32_t v)
{
    kr_wire_put_u32(b, (uint32_t)v);
}

void kr_wire_put_i64(struct kr_wire_buf *b, int64_t v)
{
    uint8_t *p = grow(b, 8);
    if (p) {
        le64(p, (uint64_t)v);
    }
}

void kr_wire_put_str(struct kr_wire_buf *b, const char *s)
{
    size_t n = strlen(s);
    n = n > KR_WIRE_MAX_STR ? KR_WIRE_MAX_STR : n;
    kr_wire_put_u32(b, (uint32_t)n);
    uint8_t *p = grow(b, n);
    if (p) {
        memcpy(p, s, n);
    }
}

static const uint8_t *take(struct kr_wire_rd *r, size_t n)
{
    if (r->bad || n > r->len - r->off) {
        r->bad = true;
        return NULL;
    }
    const uint8_t *p = r->p + r->off;
    r->off += n;
    return p;
}

uint8_t kr_wire_get_u8(struct kr_wire_rd *r)
{
    const uint8_t *p = take(r, 1);
    return p ? *p : 0;
}

uint32_t kr_wire_get_u32(struct kr_wire_rd *r)
{
    const uint8_t *p = take(r, 4);
    return p ? rd32(p) : 0;
}

int32_t kr_wire_get_i32(struct kr_wire_rd *r)
{
    return (int32_t)kr_wire_get_u32(r);
}

int64_t kr_wire_get_i64(struct kr_wire_rd *r)
{
    const uint8_t *p = take(r, 8);
    return p ? (int64_t)rd64(p) : 0;
}

void kr_wire_get_str(struct kr_wire_rd *r, char *out, size_t cap)
{
    out[0] = 0;
    const uint32_t n = kr_wire_get_u32(r);
    if (n > KR_WIRE_MAX_STR) {
        r->bad = true;
        return;
    }
    const uint8_t *p = take(r, n);
    if (p && cap > 0) {
        const size_t k = n < cap - 1 ? n : cap - 1;
        memcpy(out, p, k);
        out[k] = 0;
        for (size_t i = 0; i < k; i++) { /* a message to print: no control bytes */
            if ((unsigned char)out[i] < 0x20 || out[i] == 0x7f) {
                out[i] = '?';
            }
        }
    }
}

bool kr_wire_rd_done(const struct kr_wire_rd *r)
{
    return !r->bad && r->off == r->len;
}

/* ---- messages ----------------------------------------------------------------------------------- */

void kr_wire_put_hello(struct kr_wire_buf *b, const struct kr_wire_field *f, int32_t n)
{
    kr_wire_put_u32(b, (uint32_t)n);
    for (int32_t i = 0; i < n; i++) {
        kr_wire_put_str(b, f[i].name);
        kr_wire_put_i64(b, f[i].value);
    }
}

enum kr_status kr_wire_get_hello(struct kr_wire_rd *r, struct kr_wire_field *f, int32_t cap, int32_t *n,
                                 struct kr_err *err)
{
    const uint32_t k = kr_wire_get_u32(r);
    if (r->bad || k > (uint32_t)cap) {
        return kr_err_set(err, KR_ERR_FORMAT, "a HELLO of %u fields (at most %d)", k, cap);
    }
    for (uint32_t i = 0; i < k; i++) {
        kr_wire_get_str(r, f[i].name, sizeof f[i].name);
        f[i].value = kr_wire_get_i64(r);
    }
    if (!kr_wire_rd_done(r)) {
        return kr_err_set(err, KR_ERR_FORMAT, "a malformed HELLO (%zu bytes)", r->len);
    }
    *n = (int32_t)k;
    return KR_OK;
}

void kr_wire_put_plan_cache(struct kr_wire_buf *b, const struct kr_cache_plan *p)
{
    kr_wire_put_i32(b, p->n_slots);
    kr_wire_put_i32(b, p->n_blocks);
    kr_wire_put_i32(b, p->block_size);
    kr_wire_put_u8(b, p->prefix ? 1 : 0);
    kr_wire_put_i32(b, p->n_snaps);
    kr_wire_put_i32(b, p->state_interval);
}

enum kr_status kr_wire_get_plan_cache(struct kr_wire_rd *r, struct kr_cache_plan *p, struct kr_err *err)
{
    memset(p, 0, sizeof *p);
    p->n_slots = kr_wire_get_i32(r);
    p->n_blocks = kr_wire_get_i32(r);
    p->block_size = kr_wire_get_i32(r);
    p->prefix = kr_wire_get_u8(r) != 0;
    p->n_snaps = kr_wire_get_i32(r);
    p->state_interval = kr_wire_get_i32(r);
    if (!kr_wire_rd_done(r) || p->n_slots < 0 || p->n_blocks < 0 || p->block_size < 1 || p->n_snaps < 0 ||
        p->state_interval < 0 || p->n_slots > (1 << 24) || p->n_snaps > (1 << 24)) {
        return kr_err_set(err, KR_ERR_FORMAT, "a malformed cache plan (%d slots, %d blocks of %d, %d snapshots)",
                          p->n_slots, p->n_blocks, p->block_size, p->n_snaps);
    }
    return KR_OK;
}

static void put_array(struct kr_wire_buf *b, const int32_t *a, int64_t n)
{
    if (!a) {
        kr_wire_put_i32(b, -1);
        return;
    }
    kr_wire_put_i32(b, (int32_t)n);
    uint8_t *p = grow(b, (size_t)n * 4);
    for (int64_t i = 0; p && i < n; i++) {
        le32(p + 4 * i, (uint32_t)a[i]);
    }
}

void kr_wire_put_step(struct kr_wire_buf *b, const struct kr_wire_copy *ops, int32_t n_ops, bool lost,
                      const struct kr_batch *bt, int mtp, const int32_t *src_row)
{
    kr_wire_put_u8(b, lost ? 1 : 0);
    kr_wire_put_u32(b, (uint32_t)n_ops);
    for (int32_t i = 0; i < n_ops; i++) {
        kr_wire_put_i32(b, ops[i].kind);
        kr_wire_put_i32(b, ops[i].src);
        kr_wire_put_i32(b, ops[i].dst);
    }
    kr_wire_put_i32(b, bt->n_tok);
    kr_wire_put_i32(b, bt->n_seq);
    kr_wire_put_i32(b, bt->max_blocks);
    kr_wire_put_i32(b, bt->n_out);
    kr_wire_put_i32(b, bt->ctx_bound);
    kr_wire_put_u8(b, (uint8_t)mtp);
    put_array(b, bt->tokens, bt->n_tok);
    put_array(b, bt->pos, bt->n_tok);
    put_array(b, bt->seq_tok0, (int64_t)bt->n_seq + 1);
    put_array(b, bt->seq_pos0, bt->n_seq);
    put_array(b, bt->seq_slot, bt->n_seq);
    put_array(b, bt->block_table, (int64_t)bt->n_seq * bt->max_blocks);
    put_array(b, bt->out_tok, bt->n_out);
    put_array(b, bt->tok_state_slot, bt->n_tok);
    put_array(b, mtp ? src_row : NULL, bt->n_tok);
}

void kr_wire_step_free(struct kr_wire_step *s)
{
    kr_free(s->ops);
    kr_free(s->arena);
    memset(s, 0, sizeof *s);
}

enum kr_status kr_wire_get_step(struct kr_wire_rd *r, struct kr_wire_step *s, struct kr_err *err)
{
    memset(s, 0, sizeof *s);
    s->lost = kr_wire_get_u8(r) != 0;
    const uint32_t n_ops = kr_wire_get_u32(r);
    if (r->bad || (uint64_t)n_ops * 12 > r->len - r->off) {
        return kr_err_set(err, KR_ERR_FORMAT, "a PLAN with %u copies in %zu bytes", n_ops, r->len);
    }
    if (n_ops && !(s->ops = kr_malloc((size_t)n_ops * sizeof *s->ops))) {
        return kr_err_set(err, KR_ERR_NOMEM, "out of memory for a PLAN's %u copies", n_ops);
    }
    s->n_ops = (int32_t)n_ops;
    for (uint32_t i = 0; i < n_ops; i++) {
        s->ops[i].kind = kr_wire_get_i32(r);
        s->ops[i].src = kr_wire_get_i32(r);
        s->ops[i].dst = kr_wire_get_i32(r);
    }
    struct kr_batch *b = &s->b;
    b->n_tok = kr_wire_get_i32(r);
    b->n_seq = kr_wire_get_i32(r);
    b->max_blocks = kr_wire_get_i32(r);
    b->n_out = kr_wire_get_i32(r);
    b->ctx_bound = kr_wire_get_i32(r);
    s->mtp = kr_wire_get_u8(r);
    if (s->mtp > KR_WIRE_MTP_FROM_HEAD) {
        kr_wire_step_free(s);
        return kr_err_set(err, KR_ERR_FORMAT, "a PLAN asks for pass kind %d (0..2)", s->mtp);
    }
    if (r->bad || b->n_tok < 0 || b->n_seq < 0 || b->max_blocks < 0 || b->n_out < 0 || b->ctx_bound < 0 ||
        b->n_tok > (1 << 24) || b->n_seq > (1 << 24) || b->n_out > b->n_tok ||
        (int64_t)b->n_seq * b->max_blocks > (1 << 28)) {
        kr_wire_step_free(s);
        return kr_err_set(err, KR_ERR_FORMAT, "a PLAN with impossible counts (%d tokens, %d sequences, %d blocks each, "
                          "%d outputs)", b->n_tok, b->n_seq, b->max_blocks, b->n_out);
    }
    enum { N_ARRAYS = 9 };
    const int64_t want[N_ARRAYS] = {b->n_tok, b->n_tok, (int64_t)b->n_seq + 1, b->n_seq, b->n_seq,
                                    (int64_t)b->n_seq * b->max_blocks, b->n_out, b->n_tok, b->n_tok};
    static const char *const names[N_ARRAYS] = {"tokens", "pos", "seq_tok0", "seq_pos0", "seq_slot", "block_table",
                                                "out_tok", "tok_state_slot", "src_row"};
    /* the arrays present (an absent one is a count of -1) fit in what is left of the payload, 4 bytes a
     * value, each checked before it is read: the arena is bounded by the frame */
    int64_t total = 0;
    for (int i = 0; i < N_ARRAYS; i++) {
        total += want[i];
    }
    const int64_t room = (int64_t)((r->len - r->off) / 4);
    total = total < room ? total : room;
    if (!(s->arena = kr_malloc((size_t)(total ? total : 1) * 4))) {
        kr_wire_step_free(s);
        return kr_err_set(err, KR_ERR_NOMEM, "out of memory for a PLAN's arrays");
    }
    const int32_t *arrays[N_ARRAYS];
    int32_t *at = s->arena;
    for (int i = 0; i < N_ARRAYS; i++) {
        const int32_t n = kr_wire_get_i32(r);
        if (n == -1) {
            arrays[i] = NULL;
            continue;
        }
        if (r->bad || n != want[i]) {
            kr_wire_step_free(s);
            return kr_err_set(err, KR_ERR_FORMAT, "a PLAN's %s has %d values, want %lld", names[i], n, (long long)want[i]);
        }
        if ((uint64_t)n * 4 > r->len - r->off) {
            kr_wire_step_free(s);
            return kr_err_set(err, KR_ERR_FORMAT, "a PLAN's %s (%d values) exceeds its %zu bytes", names[i], n, r->len);
        }
        for (int32_t j = 0; j < n; j++) {
            at[j] = kr_wire_get_i32(r);
        }
        arrays[i] = at;
        at += n;
    }
    if (!kr_wire_rd_done(r)) {
        kr_wire_step_free(s);
        return kr_err_set(err, KR_ERR_FORMAT, "a malformed PLAN (%zu bytes, %zu read)", r->len, r->off);
    }
    b->tokens = arrays[0];
    b->pos = arrays[1];
    b->seq_tok0 = arrays[2];
    b->seq_pos0 = arrays[3];
    b->seq_slot = arrays[4];
    b->block_table = arrays[5];
    b->out_tok = arrays[6];
    b->tok_state_slot = arrays[7]; /* the drafts' kept Mamba states: validated with the batch by the forward */
    s->src_row = arrays[8];        /* checked by the MTP pass against the rows it holds */
    if ((s->mtp != KR_WIRE_STEP) != (s->src_row != NULL)) {
        kr_wire_step_free(s);
        return kr_err_set(err, KR_ERR_FORMAT, "a PLAN for %s %s hidden-state rows", s->mtp ? "an MTP pass" : "a step",
                          s->mtp ? "without" : "with");
    }
    if (b->seq_tok0 && (b->seq_tok0[0] != 0 || b->seq_tok0[b->n_seq] != b->n_tok)) {
        kr_wire_step_free(s);
        return kr_err_set(err, KR_ERR_FORMAT, "a PLAN whose sequences do not cover its %d tokens", b->n_tok);
    }
    for (int32_t j = 0; b->seq_tok0 && j < b->n_seq; j++) {
        if (b->seq_tok0[j] > b->seq_tok0[j + 1]) {
            kr_wire_step_free(s);
            return kr_err_set(err, KR_ERR_FORMAT, "a PLAN whose sequence %d ends before it starts", j);
        }
    }
    return KR_OK;
}
