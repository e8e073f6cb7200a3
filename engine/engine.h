#pragma once
/* kr_engine: the batching engine. It owns a model's caches and runs on its own thread:
 * continuous batching under a per-step token budget, chunked prefill, decodes first, FCFS
 * admission, preemption by recompute when the cache pools run out, cancellation, n > 1 choices
 * that share the prompt's prefill, and sampling. Requests are submitted and cancelled from any
 * thread; results come back as events through the request's callback, called on the engine
 * thread (the callback must not block: the server queues them and wakes its loop). */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model.h"
#include "sampler.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kr_engine;
struct kr_cluster;

/* Speculative decoding: each step a decoding sequence feeds its next token followed by up to k
 * drafted tokens, the step gives the logits after each of them, and the sequence keeps the drafts
 * that the sampler would have drawn anyway, one by one, plus the token drawn where the first draft
 * is refused (or after the last one): between 1 and k + 1 tokens per step, each distributed
 * exactly as plain decoding draws it (a draft is one token, so drawing from the row and keeping the
 * draft when the draw equals it is the rejection sampling of a one-token proposal). Mamba layers
 * keep their state after every drafted token (struct kr_batch.tok_state_slot, in slots of the pool
 * set aside for it) and the sequence goes on from the one after its last kept token; the cache rows
 * of refused drafts are released. */
#define KR_SPEC_MAX_TOKENS 16
enum kr_spec_method {
    KR_SPEC_OFF = 0,
    KR_SPEC_NGRAM = 1,   /* prompt lookup: the tokens that followed the latest earlier occurrence of the
                            sequence's last n tokens (n from ngram_max down to ngram_min) */
    KR_SPEC_MTP = 2,     /* the model's multi-token-prediction head (kr_model_load_opts.mtp), run after each
                            step over the step's tokens, then again over its own drafts for the next ones */
};
struct kr_spec_config {
    enum kr_spec_method method;
    int32_t k;                  /* drafted tokens per step, 1..KR_SPEC_MAX_TOKENS */
    int32_t ngram_min, ngram_max; /* KR_SPEC_NGRAM: 1 <= ngram_min <= ngram_max */
};

/* --batch-invariant: prefill chunks end at multiples of this many tokens from the prompt's start (a
 * multiple of the SSD's 64-token chunk, so that the scan's tiles fall alike however a prompt is cut) */
#define KR_INVARIANT_CHUNK 256

struct kr_engine_config {
    int32_t max_num_seqs;           /* sequences running at once (each choice of n counts) */
    int32_t max_num_batched_tokens; /* tokens per step (decodes + prefill chunks) */
    int32_t max_queued_requests;    /* requests waiting for admission beyond which submit says BUSY; 0 = no limit */
    int32_t max_model_len;          /* prompt + generated tokens per sequence; 0 = the model's max_position_embeddings */
    int32_t block_size;             /* tokens per cache block */
    size_t cache_bytes;             /* byte budget for all cache pools (slots + blocks) */
    int32_t n_slots;                /* state slots (0 = max_num_seqs) */
    bool debug_checks;              /* verify slot/block ownership after every step (tests) */
    int32_t backend_sampling;       /* 1: sample on the backend (one launch per step), 0: on the host,
                                       -1: on the backend when it is a GPU (KRAIT_BACKEND_SAMPLING=0|1 overrides) */
    bool prefix_caching;            /* reuse cached prefixes (engine/cache.h): full blocks and, for Mamba
                                       layers, state snapshots */
    int32_t prefix_state_interval;  /* a state snapshot every this many prompt tokens (a multiple of
                                       block_size; 0: none on a grid) */
    int32_t prefix_snapshots;       /* snapshot slots beside the running ones; -1: an eighth of the budget
                                       left after the running slots, at most 1024 */
    struct kr_spec_config spec;     /* speculative decoding (method KR_SPEC_OFF: none) */
    bool batch_invariant;           /* --batch-invariant (the backend's mode set already): prompts are cut
                                       into chunks at multiples of KR_INVARIANT_CHUNK from their start and
                                       never one token short of their end, a preempted sequence recomputes
                                       its generated tokens one a step, cached prefixes end at least two
                                       tokens short of it, Mamba models keep no prefix cache (a snapshot
                                       taken after decoded tokens is not what a prefill computes), and
                                       speculative decoding is refused */
    struct kr_cluster *cluster;     /* (optional) the leader's link to the ranks on other nodes
                                       (engine/cluster.h): they get the cache plan and every step;
                                       NULL: every rank is in this process */
};

/* Defaults: 256 seqs, 2048 tokens per step, no queue limit, block 16, 256 MiB of cache, prefix caching
 * on with a state snapshot every 2048 tokens and automatic snapshot slots. */
void kr_engine_config_default(struct kr_engine_config *c);

enum kr_event_type {
    KR_EVENT_TOKEN = 0,          /* one generated token of one choice */
    KR_EVENT_PROMPT_LOGPROBS = 1, /* the prompt's log-probabilities (once, before the first token) */
    KR_EVENT_FINISH = 2,         /* a choice ended; last event of that choice */
    KR_EVENT_ERROR = 3,          /* the request failed; last event of the request */
};

enum kr_finish_reason {
    KR_FINISH_LENGTH = 0,    /* max_tokens or max_model_len reached */
    KR_FINISH_STOP = 1,      /* EOS, a stop token id, or a constrained text that is complete */
    KR_FINISH_CANCELLED = 2, /* kr_engine_cancel */
    KR_FINISH_NOMEM = 3,     /* memory ran out where the choice could only be ended (a preempted choice
                                that could not be queued again): an error for the client, not an end */
};

struct kr_usage {
    int32_t prompt_tokens;
    int32_t completion_tokens; /* of this choice */
};

/* An event. Pointers are borrowed for the duration of the callback only. */
struct kr_event {
    enum kr_event_type type;
    uint64_t req_id;
    void *user;                 /* the submitter's pointer */
    int32_t index;              /* choice index (0..n-1) */
    /* KR_EVENT_TOKEN */
    int32_t token;
    double queue_s;             /* first token of a choice: seconds from submission to its first admission */
    float logprob;              /* log-probability of `token` under the model (raw distribution) */
    int32_t n_top;              /* alternatives when logprobs > 0 */
    const int32_t *top_ids;     /* [n_top] */
    const float *top_logprobs;  /* [n_top] */
    /* KR_EVENT_PROMPT_LOGPROBS: rows for positions 1..n_prompt-1 (position 0 has none) */
    int32_t n_prompt;
    const float *prompt_logprobs;     /* [n_prompt] log-probability of prompt[t] given prompt[0..t); [0] = NaN */
    const int32_t *prompt_top_ids;    /* [n_prompt, k] */
    const float *prompt_top_logprobs; /* [n_prompt, k] */
    const int32_t *prompt_ranks;      /* [n_prompt] rank of prompt[t] in its row (1 = the likeliest); [0] = 0 */
    int32_t prompt_top_k;
    /* KR_EVENT_FINISH */
    enum kr_finish_reason finish;
    int32_t stop_token;         /* the EOS/stop id that ended it, or -1 */
    struct kr_usage usage;
    /* KR_EVENT_ERROR */
    enum kr_status status;
    const char *message;
    bool device_lost;           /* the device failed for good with this error (kr_engine_failed, which
                                 * may turn true only after the event is delivered) */
};

typedef void (*kr_event_cb)(const struct kr_event *ev, void *user);

/* ---- constrained decoding ------------------------------------------------------------------------
 * A request may constrain what it generates (structured outputs: a JSON Schema, a regex, a
 * grammar). The engine knows no grammar: it holds the constraint through this interface, which
 * the caller implements (the server over api/grammar.h's matcher and token masks). Each choice of
 * the request gets its own matcher, made when the choice samples its first token and freed when
 * it ends (finished, cancelled, failed); a preempted choice keeps its matcher, which stays in step
 * with the tokens it keeps. Before each of its tokens the engine asks for the allowed-token mask,
 * the sampler makes every other token impossible, and the chosen token advances the matcher; when
 * the matcher says the text is complete the choice finishes with KR_FINISH_STOP. End-of-sequence
 * ids are allowed exactly where the constraint allows them (where the text can end), and never
 * with ignore_eos. Every call below is made on the engine thread, except `release`, which may also
 * come from the thread that calls kr_engine_free. */
struct kr_constraint_i {
    /* Creates *m, a matcher at the start of the constraint. */
    enum kr_status (*start)(void *ctx, void **m, struct kr_err *err);
    /* Writes mask[0 .. (vocab + 31) / 32): bit id % 32 of word id / 32 set for every token id that
     * may come next (bits of ids the constraint does not know, up to vocab, clear). m unchanged. */
    enum kr_status (*fill_mask)(void *ctx, void *m, uint32_t *mask, int64_t vocab, struct kr_err *err);
    /* Advances m by the chosen token; *done when the text is complete and nothing may follow. A
     * token the constraint does not allow is KR_ERR_INVAL, m unchanged. */
    enum kr_status (*accept)(void *ctx, void *m, int32_t token, bool *done, struct kr_err *err);
    /* Frees a matcher; NULL is a no-op. */
    void (*stop)(void *ctx, void *m);
    /* Drops the engine's hold on ctx, once, when the request is freed. */
    void (*release)(void *ctx);
};

/* A constraint: iface NULL for none. */
struct kr_constraint {
    const struct kr_constraint_i *iface;
    void *ctx;
};

struct kr_request_params {
    const int32_t *prompt;      /* [n_prompt] token ids (copied) */
    int32_t n_prompt;
    int32_t n;                  /* choices (>= 1) */
    struct kr_sampling sampling;
    kr_event_cb cb;
    void *user;
    const char *cache_salt;     /* [cache_salt_len] bytes, or NULL: requests with different salts share
                                   no cached prefix */
    size_t cache_salt_len;
    const int32_t *snapshot_at; /* [n_snapshot_at] prompt positions worth a state snapshot (the
                                   boundary before a chat's last user turn), or NULL */
    int32_t n_snapshot_at;
    struct kr_constraint constraint; /* constrained decoding (iface NULL: none); on KR_OK the engine
                                        holds ctx and calls release once, on an error the caller
                                        keeps it */
};

/* Plans the cache pools for `m` within cfg->cache_bytes, allocates them and starts the engine
 * thread. The model is borrowed (must outlive the engine). Logs the memory plan. */
enum kr_status kr_engine_create(struct kr_model *m, const struct kr_engine_config *cfg, struct kr_engine **out,
                                struct kr_err *err);
/* The same over a tensor-parallel group: ranks[0..n_ranks) are the ranks' models, joined to one
 * group in rank order (kr_backend_set_tp) and loaded; rank 0 is the engine's model. The engine
 * plans each step once, every rank runs it on its thread, only rank 0 samples; a failed rank fails
 * the group for good (kr_engine_failed). */
enum kr_status kr_engine_create_group(struct kr_model *const *ranks, int32_t n_ranks,
                                      const struct kr_engine_config *cfg, struct kr_engine **out, struct kr_err *err);

/* Stops the thread (in-flight requests get KR_FINISH_CANCELLED) and frees everything. */
void kr_engine_free(struct kr_engine *e);

/* Queues a request; any thread. Checks it synchronously: KR_ERR_INVAL (with a message) for
 * invalid parameters, KR_ERR_TOO_LONG for a request that can never fit (prompt + max_tokens beyond
 * max_model_len, or more cache than the whole pool); KR_ERR_BUSY when max_queued_requests are
 * already waiting; KR_ERR_CUDA once the device failed for good (kr_engine_failed).
 * On success *req_id identifies it and events follow on the engine thread. */
enum kr_status kr_engine_submit(struct kr_engine *e, const struct kr_request_params *p, uint64_t *req_id,
                                struct kr_err *err);

/* Cancels a request in whatever state; any thread. Its choices end with KR_FINISH_CANCELLED and
 * everything it held is freed on the engine thread. Unknown or finished ids are ignored. */
void kr_engine_cancel(struct kr_engine *e, uint64_t req_id);

/* Cancels one choice of a request (e.g. a stop string matched in its text); the other choices go
 * on. Any thread. */
void kr_engine_cancel_choice(struct kr_engine *e, uint64_t req_id, int32_t index);

/* Blocks until no request is queued or running (tests, shutdown). */
void kr_engine_wait_idle(struct kr_engine *e);

/* Counters for metrics; any thread (a consistent snapshot). */
struct kr_engine_stats {
    int32_t running;            /* sequences holding caches */
    int32_t waiting;            /* sequences waiting for admission (incl. preempted) */
    uint64_t preemptions;
    uint64_t prompt_tokens;     /* prompt tokens prefilled (recomputation included) */
    uint64_t generation_tokens; /* tokens sampled */
    uint64_t steps;
    int32_t slots_total, slots_free;
    int32_t blocks_total, blocks_free;
    size_t slot_bytes, block_bytes;
    double step_sched_us_last;  /* host time spent planning and building the last step's batch (µs) */
    double step_sched_us_total; /* the same, summed over all steps */
    double step_gap_us_total;   /* host time between back-to-back steps: from a step's results being back
                                   (sampled ids or logits on the host) to the next step's launch (µs) */
    uint64_t step_gaps;         /* steps that followed another at once (what step_gap_us_total sums over) */
    uint64_t masks;             /* allowed-token masks made for constrained rows (constrained decoding) */
    double mask_us_total;       /* host time spent making them (µs) */
    bool prefix_caching;
    uint64_t prefix_queries;    /* prompt tokens looked up in the prefix cache */
    uint64_t prefix_hits;       /* of those, tokens found (not computed again) */
    uint64_t prefix_block_only; /* tokens that matched cached blocks beyond the deepest usable state snapshot */
    uint64_t prefix_snapshots;  /* state snapshots taken */
    uint64_t prefix_evicted_snapshots, prefix_evicted_blocks;
    int32_t snapshots_total, snapshots_used;
    int32_t blocks_cached;      /* blocks nobody holds, kept for reuse (counted in blocks_free's complement) */
    size_t snapshot_bytes;
    /* speculative decoding: steps in which a sequence verified drafts, the drafted tokens, the
     * drafts kept, and the drafts kept at each position (the first draft, the second, ...) */
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted_tokens;
    uint64_t spec_accepted_per_pos[KR_SPEC_MAX_TOKENS];
    int32_t spec_slots;         /* state slots set aside for the drafts' states */
    int32_t spec_k;             /* drafted tokens per step at most (0: speculative decoding off) */
};
void kr_engine_get_stats(struct kr_engine *e, struct kr_engine_stats *s);

/* Whether the device failed for good (a sticky error): every request since ended with
 * KR_EVENT_ERROR of status KR_ERR_CUDA and submit refuses with KR_ERR_CUDA. Any thread.
 * KRAIT_FAULT_STEP=N (or N:fatal) makes step attempt N fail as a transient (or lost-device)
 * error would, for tests of both paths. */
bool kr_engine_failed(struct kr_engine *e);

/* The engine's caches (for tests that check that pools are full again). Engine must be idle. */
struct kr_cache *kr_engine_cache(struct kr_engine *e);

#ifdef __cplusplus
}
#endif
