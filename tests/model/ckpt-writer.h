#pragma once
/* Writes small synthetic checkpoints (config.json + safetensors) for loader tests: a tensor list
 * that tests mutate (drop, rename, reshape, retype) before writing, filled with seeded random
 * values. */
#include <stdbool.h>
#include <stdint.h>

#include "dtype.h"

#define CKW_MAX 256

struct ckw_tensor {
    char name[160];
    enum kr_dtype dt;
    int n_dim;
    int64_t shape[4];
};

struct ckw {
    struct ckw_tensor t[CKW_MAX];
    int n;
    /* projections (2-D tensors other than the embedding) get values of standard deviation
     * 1/sqrt(columns), as trained models have, instead of the fixed +-0.25: activations then stay
     * O(1) through wide layers */
    bool fan_in_scale;
};

/* The tensors of the tiny nemotron_h model described by CKW_TINY_CONFIG (pattern "M*-E"),
 * under `prefix` ("backbone." or "model."), per-expert layout, BF16. */
void ckw_tiny_nemotron(struct ckw *w, const char *prefix);
/* Appends a tensor. */
struct ckw_tensor *ckw_add(struct ckw *w, const char *name, enum kr_dtype dt, int n_dim, const int64_t *shape);
/* Finds / removes by name; remove returns 0 when found. */
struct ckw_tensor *ckw_get(struct ckw *w, const char *name);
int ckw_remove(struct ckw *w, const char *name);
/* Writes the tensors (in list order) as one safetensors file. */
void ckw_write(const struct ckw *w, const char *path);
/* Writes `text` to `path`. */
void ckw_write_text(const char *path, const char *text);
/* Makes a fresh temporary directory; returns its path (static storage per call site is fine). */
void ckw_tmpdir(char *out, size_t n);
/* Copies directory `src` into the existing directory `dst` (links followed), then, when `file` is
 * given, replaces the first `from` in dst/file with `to` (of the same length in binary files, so that
 * offsets stay valid). */
void ckw_copy_edit(const char *src, const char *dst, const char *file, const char *from, const char *to);
/* Removes a directory tree created by ckw_tmpdir. */
void ckw_rmtree(const char *dir);

/* config.json of the tiny model; %s is replaced by the time_step_limit upper bound spelling and
 * the pattern: use ckw_tiny_config(). */
void ckw_tiny_config(char *out, size_t n, const char *pattern_json, const char *limit_hi);

/* The dimensions of a synthetic hybrid checkpoint (nemotron_h names; the hybrid layout of
 * MODEL_SPEC §6 for D layers). */
struct ckw_shape {
    int64_t hidden, vocab, ffn;
    int64_t heads, kv_heads, head_dim;                    /* '*' GQA (heads also the D layers') */
    int64_t q_lora, kv_lora, nope, rope, v_dim, idx_heads, idx_dim; /* 'D' */
    int64_t m_heads, m_head_dim, m_groups, m_state;       /* 'M' */
};

/* Adds every tensor of a `pattern` model (letters M, *, D, -) of shape `d` to `w`, in layer order. */
void ckw_hybrid_tensors(struct ckw *w, const char *pattern, const struct ckw_shape *d);

/* Writes into `dir` a synthetic hybrid checkpoint (pattern "MD-D", hidden 256, vocab 512) whose D
 * layers have DeepSeek-V3.2's attention dimensions: q_lora 256, kv_lora 512, nope 128, rope 64,
 * v 128, 16 heads, an indexer of 16 heads x 128, index_topk 64; random weights as ckw_write. */
void ckw_dsa_real_shapes(const char *dir);
