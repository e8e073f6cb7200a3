#pragma once
/* The batching engine's insides, shared by its three files: engine.c (intake, cancellation, events,
 * the engine thread and the public API), step.c (admission, preemption, forking, the step's batch
 * and its results) and sample.c (sampling, stop conditions, log-probabilities). Only these files
 * include it. */
#include "engine.h"

#include "cache.h"
#include "ngram.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

/* ---- sequence state machine --------------------------------------------------------------------
 *
 *   WAITING ──admit──▶ PREFILL ──last token fed──▶ DECODE ──EOS/stop/length──▶ DONE
 *      ▲                  │                          │
 *      └────preempt───────┴──────────────────────────┘   (caches freed; recomputed later)
 *   FORK_WAIT ──choice 0 finished its prefill──▶ DECODE (forked state) or WAITING (no room: recompute)
 *   any state ──cancel──▶ DONE
 *
 * Only the engine thread touches sequences. A sequence holds a state slot and blocks exactly in
 * PREFILL and DECODE. */
enum kr_seq_state {
    KR_SEQ_WAITING = 0, /* queued for admission; holds no cache (new, or preempted) */
    KR_SEQ_FORK_WAIT,   /* choice i > 0 of an n > 1 request, waiting for choice 0's prefill */
    KR_SEQ_PREFILL,     /* admitted; feeding toks[n_fed..n_toks) in chunks */
    KR_SEQ_DECODE,      /* one token per step */
    KR_SEQ_DONE,        /* terminal; holds nothing */
};

struct req;

struct seq {
    struct req *req;
    int32_t index;               /* choice index */
    enum kr_seq_state state;
    struct kr_seq_cache cache;   /* slot, blocks, n_pos (== n_fed while admitted) */
    int32_t *toks;               /* [n_toks] prompt followed by generated tokens */
    int32_t n_toks, cap_toks;
    int32_t n_gen;               /* generated tokens */
    int32_t n_fed;               /* tokens of toks in the caches */
    struct kr_token_counts counts;
    struct kr_rng rng;
    uint64_t admit_seq;          /* admission order (preemption picks the latest) */
    double admitted_us;          /* first admission (0 before) */
    uint64_t arrival;            /* request order (FCFS) */
    uint64_t *bh;                /* [n_bh] prefix hashes of toks: bh[0] the seed, bh[j] j full blocks */
    int32_t n_bh, cap_bh;
    int32_t n_reg;               /* full blocks of its table registered in the prefix cache */
    void *cm;                    /* its constraint's matcher (constrained requests), made before its
                                    first token; NULL before, and once the choice ended */
    /* speculative decoding, within one step: the drafts it feeds after its next token, and the
     * state slots holding the Mamba states after each fed token: spec_held[i] after token i (the
     * last one is the sequence's own slot), spec_held[spec_cur] being cache.slot */
    int32_t spec_n;
    int32_t spec_cur;
    int32_t spec_draft[KR_SPEC_MAX_TOKENS];
    int32_t spec_held[KR_SPEC_MAX_TOKENS + 1];
    /* MTP drafting: the draft the MTP head made after the step that ended at mtp_step (e->steps then)
     * with n_fed == mtp_at, and the row of m->mtp_g holding its final-normed output */
    int32_t mtp_draft, mtp_at, mtp_g_row;
    struct kr_ngram ngram;       /* n-gram drafting: the index of toks for prompt lookup */
    uint64_t mtp_step;
};

struct req {
    uint64_t id;
    kr_event_cb cb;
    void *user;
    double submitted_us;
    int32_t n_prompt;
    int32_t n;
    struct kr_sampling s;
    struct seq *seqs;            /* [n] */
    int32_t n_done;
    bool prompt_lp_sent;
    float *plp;                  /* [n_prompt] prompt logprobs (when requested) */
    int32_t *plp_ids;            /* [n_prompt, k] */
    float *plp_top;              /* [n_prompt, k] */
    int32_t *plp_rank;           /* [n_prompt] rank of each prompt token in its row (1 = the likeliest) */
    int32_t plp_rows;            /* rows accumulated */
    uint64_t seed;               /* prefix-cache seed of its cache salt */
    int32_t *snap_at;            /* [n_snap_at] ascending prompt positions for state snapshots */
    int32_t n_snap_at;
    struct kr_constraint con;    /* constrained decoding (iface NULL: none); held, released with r */
    struct req *next_in;         /* inbox link */
};

struct kr_ranks;

struct kr_engine {
    struct kr_model *m;          /* borrowed; rank 0 of a tensor-parallel group */
    struct kr_ranks *ranks;      /* the group's other ranks (engine/ranks.h); NULL alone */
    struct kr_cache *cache;
    struct kr_engine_config cfg;
    size_t slot_bytes, block_bytes;

    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;         /* work arrived or stop */
    pthread_cond_t idle_cv;      /* signalled when the engine becomes idle */
    bool stop;
    bool idle;
    struct req *inbox_head, *inbox_tail; /* submitted, not yet seen by the engine thread */
    struct cancel *cancels;      /* [cap_cancels] cancellations queued by any thread */
    int32_t n_cancels, cap_cancels;
    struct cancel *cancels_w;    /* [cap_cancels_w] the engine thread's batch: swapped with `cancels`
                                    under the lock, so that every pending cancel is taken each
                                    iteration without copying or allocating */
    int32_t cap_cancels_w;
    bool failed;                 /* the device failed for good: every request fails, submit refuses */
    char failed_msg[256];
    int64_t fault_step;          /* KRAIT_FAULT_STEP: the step attempt that fails (0 = none; tests) */
    bool fault_fatal;            /* ... as a device that is lost for good */
    uint64_t step_attempts;
    atomic_uint_fast64_t next_id;
    atomic_int queued;           /* requests submitted and not yet admitted (admission limit) */
    struct kr_engine_stats stats; /* under lock */

    /* engine thread only */
    struct req **reqs;           /* live requests */
    int32_t n_reqs, cap_reqs;
    struct req **dead;           /* retired requests, freed at the end of the step */
    int32_t n_dead, cap_dead;
    struct seq **waiting;        /* FCFS: preempted first, then by arrival */
    int32_t n_waiting, cap_waiting;
    struct seq **running;        /* PREFILL and DECODE, by admission order */
    int32_t n_running, cap_running;
    uint64_t admit_counter, arrival_counter;
    uint64_t preemptions, prompt_tokens, gen_tokens, steps;
    double t_step_done;          /* when the last step's results were back (0: the engine idled since) */
    struct kr_sampler_scratch scratch;
    /* step buffers */
    int32_t cap_tok, cap_seq, cap_bt;
    int32_t *b_tokens, *b_pos, *b_out, *b_tok0, *b_pos0, *b_slot, *b_bt, *b_nsched;
    int32_t *b_nout; /* [cap_seq] output rows of each sequence of the step, fixed as the batch is built
                        (a sequence cancelled mid-step no longer says how many it had) */
    struct seq **b_seqs;
    float *logits;
    size_t cap_logits;
    float *lp_row;
    int32_t top_ids[KR_MAX_TOP_LOGPROBS];
    float top_lps[KR_MAX_TOP_LOGPROBS];
    /* sampling on the backend (GPU): per-step rows, penalty lists and results */
    bool dev_sample;
    int32_t cap_srows;
    struct seq **s_seqs;           /* [n] the sequence of each output row */
    uint8_t *s_host;               /* [n] 1: the row is sampled on the host (a fork, logit_bias) */
    struct krk_sample_row *srows;
    int32_t *s_out, *s_top_ids;
    int32_t *s_rows;               /* [n] the output row each sampling sequence samples */
    float *s_lp, *s_top_lp;
    int64_t cap_pen;
    int32_t *pen_ids, *pen_count;
    uint8_t *pen_flags;
    /* constrained decoding: the step's allowed-token masks, filled once the step's forward pass
     * is launched (on a GPU they are computed while the device works) */
    int32_t mask_words;            /* (vocab + 31) / 32 */
    uint32_t *masks;               /* [cap_masks + 1, mask_words]: one row per constrained output row
                                      of the step, and a last one for masks made while sampling (the
                                      n > 1 choices that fork from their prompt's row) */
    int32_t cap_masks;
    int32_t *row_mask;             /* [cap_row_mask] per output row: its row of masks, or -1 */
    int32_t cap_row_mask;
    uint64_t n_masks;              /* masks made, and the host time spent on them (µs) */
    double mask_us;
    /* speculative decoding (spec.c) */
    int32_t spec_slots;            /* slots of the pool set aside for the drafts' states */
    int32_t *b_keep;               /* [cap_tok] the step's tok_state_slot */
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted;
    uint64_t spec_accepted_pos[KR_SPEC_MAX_TOKENS];
    int32_t *mtp_i;                /* MTP passes: their batch arrays (int32) and logits */
    size_t cap_mtp_i;
    float *mtp_logits;
    size_t cap_mtp_logits;
    /* events held back while the device works (see emit) */
    bool defer_events;
    struct pending_ev *outbox;
    int32_t n_outbox, cap_outbox;
};

/* A cancellation: a whole request (index -1) or one choice. */
struct cancel {
    uint64_t id;
    int32_t index;
};

/* An event waiting in the outbox, with copies of what it borrows. */
struct pending_ev {
    struct kr_event ev;
    kr_event_cb cb;
    int32_t top_ids[KR_MAX_TOP_LOGPROBS];
    float top_lps[KR_MAX_TOP_LOGPROBS];
    char msg[512];
};


#define PUSH(e, list, p, front) eng_ptr_push((void ***)&(e)->list, &(e)->n_##list, &(e)->cap_##list, (p), (front))
#define REMOVE(e, list, p) eng_ptr_remove((void **)(e)->list, &(e)->n_##list, (p))

/* engine.c: the lists, events and the end of requests */
enum kr_status eng_ptr_push(void ***arr, int32_t *n, int32_t *cap, void *p, bool front);
void eng_ptr_remove(void **arr, int32_t *n, void *p);
enum kr_status eng_waiting_insert(struct kr_engine *e, struct seq *s); /* by arrival (FCFS) */
enum kr_status eng_seq_append(struct seq *s, int32_t tok);
void eng_flush_events(struct kr_engine *e);                            /* the outbox, in order */
void eng_emit(struct kr_engine *e, struct req *r, struct kr_event *ev);
void eng_release_seq(struct kr_engine *e, struct seq *s, bool keep);   /* its caches (kept for reuse
                                                                           when sound), its list */
void eng_req_free(struct req *r);
void eng_retire(struct kr_engine *e, struct req *r);                   /* freed after the step */
void eng_free_dead(struct kr_engine *e);
void eng_finish_seq(struct kr_engine *e, struct seq *s, enum kr_finish_reason why, int32_t stop_token);
const uint64_t *eng_seq_hashes(struct kr_engine *e, struct seq *s, int32_t n_pos); /* NULL: out of memory */
void eng_fail_req(struct kr_engine *e, struct req *r, enum kr_status st, const char *msg);
void eng_apply_pending_cancels(struct kr_engine *e);                   /* mid-step, before sampling */
void eng_fail_everything(struct kr_engine *e, const char *why);         /* the device is lost */

/* sample.c */
void eng_emit_token(struct kr_engine *e, struct seq *s, int32_t tok, float logprob, const int32_t *top_ids,
                    const float *top_lps);
/* mask: the allowed tokens of a constrained s this step (NULL: made here when s is constrained) */
void eng_sample_and_emit(struct kr_engine *e, struct seq *s, const float *logits, const uint32_t *mask);
void eng_seq_con_end(struct seq *s);                                   /* frees its matcher */
/* Fills the masks of the step's constrained rows (seqs[i] samples output row rows[i], n rows of
 * n_out); a request whose mask cannot be made fails. */
void eng_fill_step_masks(struct kr_engine *e, struct seq **seqs, const int32_t *rows, int32_t n, int32_t n_out);
/* The mask of output row i this step, or NULL. */
const uint32_t *eng_row_mask(const struct kr_engine *e, int32_t i);
enum kr_status eng_ensure_sample_buffers(struct kr_engine *e, int32_t n, int64_t n_pen);
enum kr_status eng_sample_on_backend(struct kr_engine *e, struct seq **seqs, const uint8_t *host, int32_t n,
                                      int32_t *n_top_out); /* row i's mask: eng_row_mask(e, i) */
void eng_prompt_logprobs_rows(struct kr_engine *e, struct req *r, int32_t p0, int32_t n, const float *rows);

/* spec.c: speculative decoding */
/* Drafts for decoding sequence s this step, planned after its next token got its cache room:
 * proposes at most `max` tokens, grows its block table for them and takes the state slots that
 * keep the Mamba states after them (never the slots that waiting sequences may be admitted to);
 * sets s->spec_n (0 when nothing was proposed or there is no room) and returns it. */
int32_t eng_spec_plan(struct kr_engine *e, struct seq *s, int32_t max);
/* After the step: samples s's rows (1 + s->spec_n of them, `rows` [.., vocab] on the host) in order,
 * keeping drafts while the draw equals them, and leaves s in the state after its kept tokens. */
void eng_spec_verify(struct kr_engine *e, struct seq *s, const float *rows);
/* Gives back the draft state slots s holds other than its own (no-op outside a step). */
void eng_spec_end(struct kr_engine *e, struct seq *s);
/* MTP drafting. After a step (its batch b, its sequences e->b_seqs[0..ns)): the MTP head's pass over
 * every row of the step whose next token is now known, which writes the head's cache rows and gives
 * each sequence that goes on decoding its first draft for the next step. */
void eng_mtp_after_step(struct kr_engine *e, const struct kr_batch *b, int32_t ns);
/* While planning, once eng_spec_plan gave the decodes their room: the passes of the MTP head over its
 * own drafts that make the drafts after the first (one pass per drafted position). */
void eng_mtp_chain(struct kr_engine *e, int32_t ns);

/* step.c */
void eng_run_step(struct kr_engine *e);
/* The step's forward pass on every rank (rank 0's logits to `logits` when not NULL). */
enum kr_status eng_forward(struct kr_engine *e, const struct kr_batch *b, float *logits, struct kr_err *err);
void eng_check_invariants(struct kr_engine *e);
