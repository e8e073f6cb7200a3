#pragma once
/* Types shared by every kernel family. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "krk/ops.h"
#include "status.h"

#ifdef __cplusplus
#define KRK_RESTRICT __restrict__
extern "C" {
#else
#define KRK_RESTRICT restrict
#endif

/* One forward step's flattened batch in device memory (see backend/batch.h). Sequences whose
 * seq_slot is negative are padding (CUDA-graph buckets): kernels read and write no cache block and
 * no state slot for them, and their output rows are unspecified (but written). */
struct krk_batch {
    int32_t n_tok;              /* tokens in the step */
    int32_t n_seq;              /* sequences in the step */
    const int32_t *tokens;      /* [n_tok] token ids */
    const int32_t *pos;         /* [n_tok] absolute position of each token */
    const int32_t *tok_seq;     /* [n_tok] index of each token's sequence */
    const int32_t *seq_tok0;    /* [n_seq + 1] first token of each sequence */
    const int32_t *seq_pos0;    /* [n_seq] position of each sequence's first token this step */
    const int32_t *seq_slot;    /* [n_seq] Mamba state slot, < 0 for padding */
    const int32_t *block_table; /* [n_seq, max_blocks] cache block ids */
    int32_t max_blocks;         /* row length of block_table */
    int32_t max_seq_tok;        /* host-known upper bound on the tokens of one sequence this step
                                   (1 for decode-only steps); grids may be sized by it */
    int32_t max_ctx;            /* host-known upper bound on pos + 1 over the batch; 0 when unknown
                                   (graph-captured steps): kernels must then not size grids by it */
    const int32_t *tok_keep;    /* (or NULL) [n_tok] a state slot receiving the Mamba layers' conv and SSM
                                   states after that token, -1 for none (struct kr_batch.tok_state_slot);
                                   a sequence with any runs the SSD as the one-token recurrence, token by
                                   token */
};

/* What a launcher needs beside an op's parameters (struct krk_*_params of krk/ops.h): the stream,
 * the step's batch in device memory, scratch, the tuning variants and the events, all owned by the
 * backend; what is CUDA-only (streams, events) lives here, never in ops.h. Launchers that take a
 * krk_ctx read the fields their comment names; a zeroed tuning variant or event is the launcher's plain
 * path. */
struct krk_ctx {
    cudaStream_t stream;
    struct krk_batch batch;
    void *workspace;        /* scratch of the launcher's *_workspace_bytes() bytes, or NULL when 0 */
    size_t workspace_bytes;
    /* tuning variants (0: the plain kernels) */
    int32_t dsa_score;      /* krk_dsa_index: KRK_DSA_SCORE_* (krk/mla.h) */
    int32_t mla_attn;       /* krk_mla_attention: KRK_MLA_ATTN_* (krk/mla.h) */
    /* --batch-invariant: the launchers that choose their split or path by the step's size (krk_attn,
     * the MLA and DSA kernels) choose by each token's own sequence and context instead */
    bool batch_invariant;
    /* krk_mla_attention: an event recorded after the work that writes the params' idx (on another
     * stream), or NULL; the launcher makes `stream` wait on it after the kernels that do not read idx
     * (the absorption of the queries) and before the first that does (whenever it returns KR_OK) */
    cudaEvent_t idx_ready;
    /* (optional, profiling) the (begin, end) event pairs a launcher records on `stream` around its
     * phases, or NULL: krk_dsa_index [4], krk_ssd [6], krk_mamba [10] (their comments say which) */
    cudaEvent_t *events;
};

/* Number of CUDA devices visible to this process (0 when the driver is missing or no device is
 * present; never fails). */
int krk_device_count(void);

/* Fills `name` (at most `n` bytes) with the name of device `dev` and its compute capability
 * ("NVIDIA H200 sm_90"). Returns KR_ERR_CUDA when the device cannot be queried. */
enum kr_status krk_device_describe(int dev, char *name, int n);
/* Streaming multiprocessors of the device current at the first call (read once; 132 when it cannot
 * be read); launchers size grids that must fill the GPU by it. */
int krk_device_sm_count(void);
/* Launch mode of every kernel launcher (process-wide, off at start): when on, each kernel is
 * launched as a programmatic dependent of the kernel before it in the stream (sm_90): it may become
 * resident and start reading weights while that one drains, and waits for it before touching
 * anything an earlier kernel writes. Set it before issuing or capturing work. */
void krk_set_pdl(bool on);
bool krk_pdl(void);
/* Cache policy of the one-token SSM state update (process-wide, on at start): when on, the state
 * (read and written once a step, never again within it) is loaded and stored with the streaming
 * cache hints (evict first) instead of the default ones. Results are the same either way. */
void krk_set_state_streaming(bool on);
bool krk_state_streaming(void);

#ifdef __cplusplus
}
#endif
