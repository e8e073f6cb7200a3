#pragma once
/* kr_batch: one forward step over a flattened multi-sequence batch. Each sequence contributes a
 * prefill chunk (several tokens) or one decode token; its tokens are contiguous. Host memory,
 * borrowed by the forward pass for the duration of the call. */
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct kr_batch {
    int32_t n_tok;               /* tokens in this step */
    int32_t n_seq;               /* sequences in this step */
    const int32_t *tokens;       /* [n_tok] token ids */
    const int32_t *pos;          /* [n_tok] absolute position of each token in its sequence */
    const int32_t *seq_tok0;     /* [n_seq + 1] first token index of each sequence; seq_tok0[n_seq] == n_tok */
    const int32_t *seq_pos0;     /* [n_seq] absolute position of the sequence's first token this step
                                    (= tokens already in its caches; 0 starts from empty state) */
    const int32_t *seq_slot;     /* [n_seq] state slot of the sequence (Mamba conv + SSM state) */
    const int32_t *block_table;  /* [n_seq, max_blocks] cache block ids of each sequence, in order */
    int32_t max_blocks;          /* row length of block_table */
    int32_t n_out;               /* tokens whose logits are wanted */
    const int32_t *out_tok;      /* [n_out] token indices (into 0..n_tok-1) whose logits are wanted */
    const int32_t *tok_state_slot; /* (optional, NULL: none) [n_tok] a state slot that receives every Mamba
                                    layer's conv and SSM state after this token (speculative decoding
                                    keeps the state after each draft), -1 for none; a sequence with
                                    any such token runs the recurrence token by token, as decode
                                    steps do, so that its states and outputs are theirs exactly.
                                    Backends without it (kr_backend_can_token_states) refuse it */
    int32_t ctx_bound;           /* (optional, 0: none) a bound on every sequence's context that holds for
                                    every step replaying a captured graph of this shape; kernels of MLA
                                    layers size their grids by it while a graph is captured */
};

#ifdef __cplusplus
}
#endif
