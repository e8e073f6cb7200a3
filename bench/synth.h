#pragma once
/* Synthetic nemotron_h checkpoints of realistic width with random bf16 weights, for benchmarks:
 * random weights run at the speed of trained ones. */
#include <stdint.h>

struct synth_spec {
    const char *pattern;   /* e.g. "M-M*M-M-" */
    int64_t vocab, dim;
    int64_t m_heads, m_head_dim, m_groups, m_state, m_conv, m_chunk;
    int64_t n_head, n_kv_head, head_dim;
    int64_t ffn;
    int64_t n_expert, n_used, moe_ffn, shared_ffn;
};

/* Writes DIR/config.json and DIR/model.safetensors; returns 0 or -1 with a message on stderr. */
int synth_write(const char *dir, const struct synth_spec *s);
