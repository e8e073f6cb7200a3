#pragma once
/* Constrained decoding as the engine takes it: a compiled grammar (api/grammar.h) and the server's
 * token vocabulary behind the engine's struct kr_constraint (engine/engine.h), which knows no
 * grammar. Each choice of a request gets its own matcher; masks come from the grammar's shared,
 * lock-free mask cache. */
#include "engine.h"
#include "grammar.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fills *out with a constraint over grammar g (takes a reference of its own: the caller keeps
 * its) and vocabulary v (borrowed: it must outlive every request that uses it, as the server's
 * does). Masks are written for the engine's vocabulary size: ids beyond v's vocabulary are never
 * allowed, and a vocabulary larger than the model's is cut to it. Hand *out to kr_engine_submit,
 * which releases it; after a failed submit, the caller calls out->iface->release(out->ctx).
 * Returns KR_OK or KR_ERR_NOMEM. Any thread. */
enum kr_status kr_constrain_create(struct kr_grammar *g, const struct kr_grammar_vocab *v, struct kr_constraint *out);

#ifdef __cplusplus
}
#endif
