#pragma once
/* The grammar module's insides, shared by its files: build.c (expressions, lowering to the compiled
 * form, UTF-8 classes, compile-time checks, the GBNF dump), ebnf.c (GBNF text), regex.c (regular
 * expressions), schema.c (JSON Schema, json_object, choice), match.c (the matcher), mask.c (the
 * token trie, masks and their adaptive cache) and cache.c (compiling by kind, the grammar cache). Only these files include it; grammar.h is the interface. Shared functions
 * are prefixed gb_ (building), gx_ (expressions) or gm_ (matching).
 *
 * Compiled form: rules of alternatives of sequences of elements. An element is a byte set (one
 * byte out of a 256-bit set) or a rule reference; every alternative ends with an END element. All
 * front ends build expressions (gx: literals, code-point classes, references, sequences,
 * alternations, repetitions) that gb_finish() lowers to that form: classes over code points
 * become byte-set sequences (UTF-8), repetitions become helper rules, nested alternations become
 * helper rules. */
#include "grammar.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- compiled grammar ------------------------------------------------------------------------ */

enum gelem_kind { GE_END = 0, GE_BYTES = 1, GE_RULE = 2 };

struct gelem {
    uint32_t kind; /* enum gelem_kind */
    uint32_t arg;  /* GE_BYTES: set index; GE_RULE: rule id; GE_END: the rule it ends */
};

struct grule {
    uint32_t alt0;   /* first index into alt_start */
    uint32_t n_alts; /* >= 1 */
    uint32_t name;   /* offset into names */
    int32_t origin;  /* helper rules: the rule written by the user it was made for; else its own id */
};

#define GR_INF UINT32_MAX /* a minimum length that does not exist (rule that matches nothing) */

struct kr_grammar {
    struct gelem *elems;   /* [n_elems] all alternatives, each ending with GE_END */
    uint32_t n_elems;
    uint32_t *alt_start;   /* [n_alts] index into elems of each alternative, grouped by rule */
    uint32_t n_alts;
    struct grule *rules;   /* [n_rules] */
    uint32_t n_rules;
    uint8_t (*sets)[32];   /* [n_sets] byte sets, bit b of byte b / 8 */
    uint32_t n_sets;
    char *names;           /* NUL-separated rule names */
    uint32_t *minlen;      /* [n_rules] fewest bytes a rule matches (GR_INF: none) */
    uint32_t *minrest;     /* [n_elems] fewest bytes from this position to the end of its alternative */
    uint32_t root;
    /* mask.c's per-position token classes for one vocabulary, filled lazily by any thread (the
     * grammar is otherwise immutable); NULL until the first mask */
    _Atomic(struct gm_cache *) cache;
    atomic_int refs;       /* kr_grammar_retain / kr_grammar_free */
};

static inline bool gm_set_has(const struct kr_grammar *g, uint32_t set, uint8_t b)
{
    return (g->sets[set][b >> 3] >> (b & 7)) & 1;
}

static inline const char *gm_rule_name(const struct kr_grammar *g, uint32_t r)
{
    return g->names + g->rules[r].name;
}

/* ---- expressions --------------------------------------------------------------------------- */

enum gx_kind {
    GX_EMPTY, /* matches "" */
    GX_LIT,   /* bytes */
    GX_CLASS, /* one code point out of sorted, disjoint ranges */
    GX_BYTES, /* one sequence of byte sets (a lowered piece of a class) */
    GX_REF,   /* a rule */
    GX_SEQ,
    GX_ALT,
    GX_REP,   /* x{min,max}, max < 0: unbounded */
};

struct gx {
    enum gx_kind kind;
    int32_t helper;  /* lowering: the helper rule made for this expression, -1 */
    int32_t star;    /* lowering: the rule for this expression repeated, -1 */
    struct gx *alts; /* lowering, GX_CLASS: its GX_BYTES alternatives */
    union {
        struct {
            const char *s;
            size_t n;
        } lit;
        struct {
            const uint32_t *r; /* [2 * n] lo, hi pairs */
            size_t n;
        } cls;
        struct {
            const uint32_t *set; /* [n] set indices (interned when lowered) */
            size_t n;
        } bytes;
        struct {
            int32_t rule;
            bool loop; /* the self-reference of a repetition (allowed to recur without input) */
        } ref;
        struct {
            struct gx **v; /* [n] */
            size_t n, cap;
        } list;
        struct {
            struct gx *x;
            int32_t min, max;
        } rep;
    };
};

/* Bounds on what a front end may build: expansion of {m,n} and schema bounds must stay small. */
#define GB_MAX_ELEMS (1u << 21) /* elements of a compiled grammar */
#define GB_MAX_RULES (1u << 19)
#define GB_MAX_REPEAT 10000     /* m and n of {m,n} */

struct gb_rule {
    char *name;
    struct gx *body;   /* NULL until defined */
    int32_t origin;
    int32_t line, col; /* where the user defined it (GBNF), 0 when not from text */
};

/* A grammar under construction: rules whose bodies are expressions, all in one arena. Errors are
 * sticky: the first failure sets st (and err), constructors then return NULL, and gb_finish()
 * reports it. A NULL argument to a constructor means an earlier failure and yields NULL. */
struct gb {
    struct gb_arena *arena;
    struct gb_rule *rules;
    int32_t n_rules, cap_rules;
    enum kr_status st;
    struct kr_err *err;
};

void gb_init(struct gb *b, struct kr_err *err);
void gb_free(struct gb *b);
/* Records the first failure (later ones are ignored); returns st. */
enum kr_status gb_fail(struct gb *b, enum kr_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void *gb_alloc(struct gb *b, size_t n);
char *gb_strndup(struct gb *b, const char *s, size_t n);
/* A new rule named `name` (copied): its id, or -1 after a failure. */
int32_t gb_rule_new(struct gb *b, const char *name);
int32_t gb_rule_find(const struct gb *b, const char *name, size_t len);
void gb_rule_set(struct gb *b, int32_t r, struct gx *body);
/* Lowers every rule, checks the grammar (undefined rules, left recursion, a root that matches
 * nothing) and returns the compiled form. Frees nothing: the caller still calls gb_free(). */
enum kr_status gb_finish(struct gb *b, int32_t root, struct kr_grammar **out);

struct gx *gx_empty(struct gb *b);
struct gx *gx_lit(struct gb *b, const char *s, size_t n);
struct gx *gx_str(struct gb *b, const char *s);
struct gx *gx_char(struct gb *b, uint32_t cp);
/* A class of n [lo, hi] code-point ranges (in any order, may overlap; copied), or its complement
 * over all Unicode scalar values when negate. Surrogates are never members. */
struct gx *gx_class(struct gb *b, const uint32_t *ranges, size_t n, bool negate);
struct gx *gx_ref(struct gb *b, int32_t rule);
struct gx *gx_list(struct gb *b, enum gx_kind kind); /* an empty GX_SEQ or GX_ALT */
struct gx *gx_add(struct gb *b, struct gx *list, struct gx *x);
struct gx *gx_listv(struct gb *b, enum gx_kind kind, struct gx *const *v, size_t n);
struct gx *gx_rep(struct gb *b, struct gx *x, int32_t min, int32_t max);

#define GX_SEQ(b, ...) \
    gx_listv((b), GX_SEQ, (struct gx *[]){__VA_ARGS__}, sizeof((struct gx *[]){__VA_ARGS__}) / sizeof(struct gx *))
#define GX_ALT(b, ...) \
    gx_listv((b), GX_ALT, (struct gx *[]){__VA_ARGS__}, sizeof((struct gx *[]){__VA_ARGS__}) / sizeof(struct gx *))

/* Class helpers over [lo, hi] pair arrays (n pairs): sorts and merges in place, returns the new n. */
size_t gx_ranges_normalize(uint32_t *r, size_t n);

/* ---- regex front end (regex.c), shared with schema.c ----------------------------------------- */

struct gx_regex_opts {
    bool json_string; /* characters are written as JSON string content (escapes for " \ and controls) */
    bool search;      /* JSON Schema `pattern`: unanchored ends match anything (^ and $ anchor) */
};

/* Parses re[0..len) into an expression. Errors name the offset and are prefixed with `where`. */
struct gx *gx_regex(struct gb *b, const char *re, size_t len, const struct gx_regex_opts *o, const char *where);

/* The JSON string content encoding of one code point out of class c: raw UTF-8, except `"`, `\`
 * and control characters, which become their escapes. */
struct gx *gx_json_chars(struct gb *b, struct gx *c);

/* ---- matcher (match.c), used by mask.c --------------------------------------------------------- */

/* Parse stacks are nodes of a tree shared by all stacks (each node: a grammar position and its
 * parent frame), hash-consed so that equal stacks are the same node. Sentinels: */
#define GM_ROOT 0u    /* below the start rule: a stack popped down to it has matched the whole text */
#define GM_BOTTOM 1u  /* below the frame a context-free probe starts from (mask.c) */
#define GM_UNKNOWN 2u /* a probe popped GM_BOTTOM and went on: depends on the frames below */
#define GM_FIRST_NODE 3u

struct gm_node {
    uint32_t pos;    /* index into elems; UINT32_MAX for sentinels */
    uint32_t parent; /* node id */
    uint32_t depth;
    uint32_t slot;   /* index in the hash table (for exact undo) */
};

struct gm_pool {
    struct gm_node *nodes; /* [cap] */
    uint32_t n, cap;
    uint32_t *table;       /* [mask + 1] node ids, 0 = empty (ids < GM_FIRST_NODE are never stored) */
    uint32_t mask;
    uint32_t *mark;        /* [cap] visit stamps of one closure */
    uint32_t gen;
};

/* A set of stack tops: node ids, sorted, distinct. */
struct gm_tops {
    uint32_t *v;
    uint32_t n, cap;
};

struct gm_hist {
    uint32_t *tops; /* [cap] */
    uint32_t n, cap;
    bool ended, fresh;
};

struct kr_grammar_matcher {
    const struct kr_grammar *g;
    struct gm_pool pool;
    struct gm_tops tops;   /* the current state */
    bool ended;            /* an end token was accepted */
    bool fresh;            /* nothing accepted yet (a first token's stripped space, mask.c) */
    struct gm_hist hist[KR_GRAMMAR_MAX_HISTORY]; /* ring of earlier states, newest at hist_head - 1 */
    int32_t hist_head, n_hist;
    uint32_t gc_at;        /* collect unreachable nodes when the pool grows past this */
    /* scratch of one step */
    struct gm_tops out, cur;
    uint32_t *work;
    uint32_t n_work, cap_work;
    struct gm_walk *walk;  /* mask.c's per-matcher scratch, NULL until the first mask */
    bool use_cache;        /* masks use the grammar's adaptive cache (kr_grammar_matcher_set_cache) */
};

/* Pool marks: speculative work appends nodes and then truncates back to a mark, which restores
 * the hash table exactly (nodes leave in the reverse order they came). */
void gm_pool_truncate(struct gm_pool *p, uint32_t n);
/* One step: the tops reached from in[0..n) by byte b, into m->out (m->out.n == 0: rejected). */
enum kr_status gm_step(struct kr_grammar_matcher *m, const uint32_t *in, uint32_t n, uint8_t b,
                       struct kr_err *err);
/* The node (pos, parent) of m's pool, made when new. */
enum kr_status gm_node(struct kr_grammar_matcher *m, uint32_t pos, uint32_t parent, uint32_t *id, struct kr_err *err);
/* The closure of the single node (pos, parent) into m->out. */
enum kr_status gm_start(struct kr_grammar_matcher *m, uint32_t pos, uint32_t parent, struct kr_err *err);
/* Ends the text (an end token): one step of history, then nothing more is accepted. */
enum kr_status gm_end(struct kr_grammar_matcher *m, struct kr_err *err);
void gm_walk_free(struct gm_walk *w);
void gm_cache_free(struct gm_cache *c);
