#pragma once
/* The wire format between the nodes of a multi-node group (engine/cluster.c): one TCP connection
 * between the leader (node 0) and each worker carries every message as a frame
 *
 *     u32 magic "KRTW" | u16 version | u16 type | u64 payload bytes | payload
 *
 * Integers are little-endian whatever the host; floats (collectives) travel as the host holds them
 * (IEEE-754, and every node of a group is one architecture). Strings are u32 length + bytes. A
 * frame whose magic or version differs, whose type is unknown or whose length is beyond its type's
 * bound is refused before anything is allocated, and so is a payload that does not decode exactly.
 *
 *   type        from    payload
 *   HELLO       worker  u32 n, n x (str name, i64 value): the worker's configuration, compared
 *                       field by field with the leader's (every field must be present on both)
 *   WELCOME     leader  (none): the worker joined
 *   REFUSE      leader  str why: the worker was refused (it exits with that message)
 *   BLOB        leader  the bytes of kr_cluster_bcast_blob
 *   START       leader  the cache plan: i32 n_slots, n_blocks, block_size, u8 prefix, i32 n_snaps,
 *                       i32 state_interval
 *   READY       worker  i32 status, str why: the worker's ranks have their caches (or why not)
 *   PLAN        leader  one step: u8 copies_lost, u32 n_copies, n_copies x (i32 kind, src, dst),
 *                       i32 n_tok, n_seq, max_blocks, n_out, ctx_bound, then the batch's arrays
 *                       u8 what (0 a step, 1 an MTP head pass over the step's residual stream,
 *                       2 one over the head's own outputs), then the batch's arrays tokens, pos,
 *                       seq_tok0, seq_pos0, seq_slot, block_table, out_tok, tok_state_slot
 *                       (speculative decoding's kept states), src_row (an MTP pass's hidden-state
 *                       rows), each as i32 count (-1: NULL) + count x i32
 *   DONE        worker  i32 status, str why: the worker's ranks finished the step
 *   REDUCE      both    n x f32: a node's partial sum (worker), the group's sum (leader)
 *   GATHER      both    a node's columns of every row (worker), every row whole (leader)
 *   ABORT       both    str why: the sender left the group; every collective fails
 *   BYE         leader  (none): the group shuts down (the worker exits 0) */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "batch.h"
#include "cache.h"
#include "status.h"

#define KR_WIRE_MAGIC       0x5754524bu /* "KRTW" as bytes */
#define KR_WIRE_VERSION     2 /* 2: PLAN carries tok_state_slot and MTP passes */
#define KR_WIRE_HEADER      16
#define KR_WIRE_MAX_CONTROL ((uint64_t)256 << 20) /* bytes of any frame but REDUCE and GATHER */
#define KR_WIRE_MAX_DATA    ((uint64_t)16 << 30)  /* REDUCE and GATHER: read into buffers of known size */
#define KR_WIRE_MAX_STR     4096
#define KR_WIRE_MAX_FIELDS  256

enum kr_wire_type {
    KR_WIRE_HELLO = 1,
    KR_WIRE_WELCOME,
    KR_WIRE_REFUSE,
    KR_WIRE_BLOB,
    KR_WIRE_START,
    KR_WIRE_READY,
    KR_WIRE_PLAN,
    KR_WIRE_DONE,
    KR_WIRE_REDUCE,
    KR_WIRE_GATHER,
    KR_WIRE_ABORT,
    KR_WIRE_BYE,
};

/* "HELLO", ... for messages; "?" for an unknown type. */
const char *kr_wire_type_name(uint32_t type);

/* A frame header: encoded into 16 bytes, or decoded and checked (KR_ERR_FORMAT with a message
 * naming what is wrong). */
void kr_wire_header_put(uint8_t out[KR_WIRE_HEADER], enum kr_wire_type type, uint64_t len);
enum kr_status kr_wire_header_get(const uint8_t in[KR_WIRE_HEADER], uint32_t *type, uint64_t *len, struct kr_err *err);

/* ---- payload writer and reader ---------------------------------------------------------------- */

/* A growing payload. A failed allocation is remembered (nomem) and later puts do nothing. */
struct kr_wire_buf {
    uint8_t *p;
    size_t len, cap;
    bool nomem;
};
void kr_wire_buf_free(struct kr_wire_buf *b);
void kr_wire_put_u8(struct kr_wire_buf *b, uint8_t v);
void kr_wire_put_u32(struct kr_wire_buf *b, uint32_t v);
void kr_wire_put_i32(struct kr_wire_buf *b, int32_t v);
void kr_wire_put_i64(struct kr_wire_buf *b, int64_t v);
void kr_wire_put_str(struct kr_wire_buf *b, const char *s);

/* Reads a payload (borrowed); a read past its end sets `bad` and returns zeros. */
struct kr_wire_rd {
    const uint8_t *p;
    size_t len, off;
    bool bad;
};
uint8_t kr_wire_get_u8(struct kr_wire_rd *r);
uint32_t kr_wire_get_u32(struct kr_wire_rd *r);
int32_t kr_wire_get_i32(struct kr_wire_rd *r);
int64_t kr_wire_get_i64(struct kr_wire_rd *r);
/* Copies a string into out[cap] (truncated; bad when longer than KR_WIRE_MAX_STR). */
void kr_wire_get_str(struct kr_wire_rd *r, char *out, size_t cap);
/* Whether the payload was read exactly: nothing short, nothing left over. */
bool kr_wire_rd_done(const struct kr_wire_rd *r);

/* ---- messages ----------------------------------------------------------------------------------- */

/* One field of a HELLO: a name and a value (fingerprints as their 64 bits). */
struct kr_wire_field {
    char name[48];
    int64_t value;
};

void kr_wire_put_hello(struct kr_wire_buf *b, const struct kr_wire_field *f, int32_t n);
/* Decodes into f[cap]; KR_ERR_FORMAT when malformed or longer than cap. */
enum kr_status kr_wire_get_hello(struct kr_wire_rd *r, struct kr_wire_field *f, int32_t cap, int32_t *n,
                                 struct kr_err *err);

void kr_wire_put_plan_cache(struct kr_wire_buf *b, const struct kr_cache_plan *p);
enum kr_status kr_wire_get_plan_cache(struct kr_wire_rd *r, struct kr_cache_plan *p, struct kr_err *err);

/* A copy rank 0 made between steps (engine/ranks.h): a block (kind 0) or a slot (kind 1). */
struct kr_wire_copy {
    int32_t kind, src, dst;
};

void kr_wire_put_step(struct kr_wire_buf *b, const struct kr_wire_copy *ops, int32_t n_ops, bool lost,
                      const struct kr_batch *bt, int mtp, const int32_t *src_row);

/* A decoded PLAN: the batch's arrays point into `arena` (owned; kr_wire_step_free). */
/* What a PLAN asks for: a step, or an MTP head pass over the step's residual stream or over the
 * head's own last outputs (kr_model_mtp_forward), its rows taking hidden-state rows src_row. */
enum { KR_WIRE_STEP = 0, KR_WIRE_MTP_FROM_STEP = 1, KR_WIRE_MTP_FROM_HEAD = 2 };
struct kr_wire_step {
    struct kr_batch b;
    int mtp;                  /* KR_WIRE_STEP, KR_WIRE_MTP_FROM_STEP or KR_WIRE_MTP_FROM_HEAD */
    const int32_t *src_row;   /* an MTP pass's [b.n_tok] (in arena); NULL for a step */
    struct kr_wire_copy *ops; /* [n_ops] */
    int32_t n_ops;
    bool lost;
    int32_t *arena;
};
/* Decodes a PLAN, checking every count against the frame and the batch's own counts (the
 * arrays' contents are checked by the forward pass). KR_ERR_FORMAT with a message. */
enum kr_status kr_wire_get_step(struct kr_wire_rd *r, struct kr_wire_step *s, struct kr_err *err);
void kr_wire_step_free(struct kr_wire_step *s);
