/* The engine's constraint interface over api/grammar.h (constrain.h). */
#include "constrain.h"

#include "alloc.h"

#include <string.h>

/* One request's constraint: its grammar and the vocabulary masks are made for. */
struct con {
    struct kr_grammar *g;              /* one reference */
    const struct kr_grammar_vocab *v;  /* borrowed (the server's) */
    int32_t words;                     /* words of a mask of v */
};

/* One choice's matcher, and a mask of v's width when that is wider than the engine's. */
struct con_m {
    struct kr_grammar_matcher *m;
    uint32_t *wide; /* [words] or NULL */
};

static enum kr_status con_start(void *ctx, void **out, struct kr_err *err)
{
    const struct con *c = ctx;
    struct con_m *cm = kr_calloc(1, sizeof *cm);
    if (!cm) {
        return kr_err_set(err, KR_ERR_NOMEM, "out of memory");
    }
    const enum kr_status st = kr_grammar_matcher_create(c->g, &cm->m, err);
    if (st != KR_OK) {
        kr_free(cm);
        return st;
    }
    *out = cm;
    return KR_OK;
}

static enum kr_status con_fill(void *ctx, void *m, uint32_t *mask, int64_t vocab, struct kr_err *err)
{
    const struct con *c = ctx;
    struct con_m *cm = m;
    const int64_t words = (vocab + 31) / 32;
    if (c->words <= words) {
        KR_TRY(kr_grammar_matcher_fill_mask(cm->m, c->v, mask, err));
        memset(mask + c->words, 0, (size_t)(words - c->words) * sizeof *mask);
    } else {
        /* the tokenizer knows more ids than the model has rows: the ones beyond are cut off */
        if (!cm->wide && !(cm->wide = kr_malloc((size_t)c->words * sizeof *cm->wide))) {
            return kr_err_set(err, KR_ERR_NOMEM, "out of memory");
        }
        KR_TRY(kr_grammar_matcher_fill_mask(cm->m, c->v, cm->wide, err));
        memcpy(mask, cm->wide, (size_t)words * sizeof *mask);
    }
    if (vocab % 32) {
        mask[words - 1] &= (1u << (vocab % 32)) - 1u;
    }
    return KR_OK;
}

static enum kr_status con_accept(void *ctx, void *m, int32_t token, bool *done, struct kr_err *err)
{
    const struct con *c = ctx;
    struct con_m *cm = m;
    bool accepted = false;
    KR_TRY(kr_grammar_matcher_accept_token(cm->m, c->v, token, &accepted, err));
    if (!accepted) {
        return kr_err_set(err, KR_ERR_INVAL, "token %d does not continue the constrained text", token);
    }
    *done = kr_grammar_matcher_is_done(cm->m);
    return KR_OK;
}

static void con_stop(void *ctx, void *m)
{
    struct con_m *cm = m;
    if (cm) {
        kr_grammar_matcher_destroy(cm->m);
        kr_free(cm->wide);
        kr_free(cm);
    }
}

static void con_release(void *ctx)
{
    struct con *c = ctx;
    kr_grammar_free(c->g);
    kr_free(c);
}

static const struct kr_constraint_i con_iface = {
    .start = con_start,
    .fill_mask = con_fill,
    .accept = con_accept,
    .stop = con_stop,
    .release = con_release,
};

enum kr_status kr_constrain_create(struct kr_grammar *g, const struct kr_grammar_vocab *v, struct kr_constraint *out)
{
    struct con *c = kr_calloc(1, sizeof *c);
    if (!c) {
        return KR_ERR_NOMEM;
    }
    c->g = kr_grammar_retain(g);
    c->v = v;
    c->words = kr_grammar_vocab_mask_words(v);
    *out = (struct kr_constraint){.iface = &con_iface, .ctx = c};
    return KR_OK;
}
