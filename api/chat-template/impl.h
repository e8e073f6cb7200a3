#pragma once
/* The chat-template interpreter's insides, shared by its five files: lex.c (the lexer), parse.c (the
 * parser, and compiling a template), value.c (the arena, values and their Python conversions, JSON
 * in and out, string helpers), eval.c (scopes and lookups, iteration, operators, expressions,
 * statements, and rendering) and builtins.c (calls of globals, methods and macros; filters and
 * tests). Only these files include it; chat-template.h is the interface. The functions they share
 * are prefixed ct_. */
#include "chat-template.h"

#include "unicode.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The lexer follows jinja2/lexer.py (3.1) configured as transformers configures it; the parser
 * follows jinja2/parser.py (precedence: conditional < or < and < not < comparisons < + - < ~ <
 * * / // % < ** < unary -/+ < postfix (attribute, item, call) and filters/tests); the evaluator
 * implements Python's semantics for the values JSON can bring. */

#define MAX_STEPS 10000000L
#define MAX_BYTES (256u << 20)
#define MAX_DEPTH 200
#define MAX_RANGE 100000 /* jinja2.sandbox.MAX_RANGE */
/* Work on text is charged a step per BYTES_PER_STEP bytes it scans (finding, counting, comparing,
 * printing): a loop over a megabyte string is then held to the same budget as a loop over a short
 * one that does a step of work per byte would be. */
#define BYTES_PER_STEP 64

/* ==== arena =================================================================================== */

struct achunk {
    struct achunk *next;
    size_t used, cap;
    _Alignas(16) char data[];
};
struct arena {
    struct achunk *head;
    size_t total;
    bool failed; /* an allocation of the render failed (memory, or MAX_BYTES): what it was for is
                    missing, so the render fails even where the failure was not noticed */
    bool over;   /* one failed for MAX_BYTES: the template's fault (KR_ERR_INVAL), not the server's */
};

/* ==== values ==================================================================================== */

enum vt { V_UNDEF, V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_LIST, V_TUPLE, V_DICT, V_NS, V_FUNC };

struct jstr {
    size_t len;
    char s[]; /* NUL-terminated */
};
struct list;
struct dict;
struct func;
struct value {
    enum vt t;
    union {
        bool b;
        int64_t i;
        double f;
        struct jstr *s;
        struct list *l;   /* V_LIST, V_TUPLE */
        struct dict *d;   /* V_DICT, V_NS */
        struct func *fn;
    } u;
};
struct list {
    size_t n, cap;
    struct value *v;
};
/* A dict keeps its keys in insertion order (Python's dict); past DICT_INDEX_MIN keys a hash index
 * finds them, so that building a dict of n keys is O(n), not O(n^2) (a client's object of 10^5
 * keys took minutes). */
#define DICT_INDEX_MIN 8
struct dict {
    size_t n, cap;
    struct value *k, *v; /* [cap] keys and values, n used, in insertion order */
    uint32_t *slot;      /* [n_slot] 1 + the index of a key, 0 = empty (open addressing); NULL below
                            DICT_INDEX_MIN keys */
    size_t n_slot;       /* a power of two, at least 2 * cap */
};

enum builtin {
    B_RANGE, B_NAMESPACE, B_DICT, B_RAISE, B_STRFTIME, B_CYCLE, B_MACRO,
    /* str methods */
    M_STRIP, M_LSTRIP, M_RSTRIP, M_SPLIT, M_RSPLIT, M_STARTSWITH, M_ENDSWITH, M_UPPER, M_LOWER, M_TITLE,
    M_CAPITALIZE, M_REPLACE, M_FIND, M_RFIND, M_COUNT, M_JOIN, M_ISDIGIT, M_ISALPHA, M_ISALNUM, M_ISSPACE,
    M_ISUPPER, M_ISLOWER,
    /* dict methods */
    M_ITEMS, M_KEYS, M_VALUES, M_GET,
    /* list methods */
    M_INDEX, M_LCOUNT,
    M_UNSAFE, /* a mutating method: calling it is a sandbox violation */
};
struct node;
struct func {
    enum builtin b;
    struct value self;        /* bound object for methods; the list for cycle */
    const struct node *macro; /* B_MACRO */
    const char *name;
};

static inline struct value v_undef(void)
{
    return (struct value){.t = V_UNDEF};
}
static inline struct value v_none(void)
{
    return (struct value){.t = V_NONE};
}
static inline struct value v_bool(bool b)
{
    return (struct value){.t = V_BOOL, .u.b = b};
}
static inline struct value v_int(int64_t i)
{
    return (struct value){.t = V_INT, .u.i = i};
}
static inline struct value v_float(double f)
{
    return (struct value){.t = V_FLOAT, .u.f = f};
}

/* ==== AST ========================================================================================= */

enum nk {
    /* statements */
    N_TEXT, N_OUTPUT, N_IF, N_FOR, N_SET, N_SET_BLOCK, N_MACRO, N_BREAK, N_CONTINUE, N_WITH, N_FILTER_BLOCK,
    N_BODY,
    /* expressions */
    E_CONST, E_NAME, E_LIST, E_TUPLE, E_DICT, E_ATTR, E_ITEM, E_SLICE, E_CALL, E_FILTER, E_TEST, E_NOT, E_NEG,
    E_POS, E_BIN, E_AND, E_OR, E_CMP, E_COND,
};
enum op { OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CAT, OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT,
          OP_GE, OP_IN, OP_NOTIN };

struct node {
    enum nk k;
    int line;
    int op;                  /* E_BIN, E_CMP ops[0]; N_FOR: has else; E_TEST: negated */
    struct value v;          /* E_CONST; N_TEXT text */
    const char *name;        /* E_NAME, E_ATTR, E_FILTER, E_TEST, N_MACRO, N_SET target attr */
    struct node *a, *b, *c;  /* children */
    struct node **kids;      /* list items, call args, bodies, elif chains */
    size_t n_kids;
    const char **knames;     /* keyword argument names / targets / macro params, parallel to kvals */
    struct node **kvals;
    size_t n_kw;
    int *ops;                /* E_CMP: one per comparison */
};

struct kr_chat_template {
    struct arena arena; /* owns every node */
    struct node *body;
};

/* ==== lexer ========================================================================================= */

enum tt { T_DATA, T_VAR_BEGIN, T_VAR_END, T_BLOCK_BEGIN, T_BLOCK_END, T_NAME, T_STRING, T_INT, T_FLOAT, T_OP,
          T_EOF };
struct token {
    enum tt t;
    int line;
    const char *s; /* T_DATA/T_STRING: processed text (arena); T_NAME/T_OP: source text */
    size_t len;
    int64_t i;
    double f;
};
struct lexer {
    struct arena *arena;
    struct kr_err *err;
    const char *src; /* newline-normalized source */
    size_t n, pos;
    int line;
    struct token *toks;
    size_t n_toks, cap_toks;
};

/* ==== evaluator ======================================================================================= */

struct scope {
    struct dict vars;
    struct scope *parent;
};
enum flow { FLOW_NORMAL, FLOW_BREAK, FLOW_CONTINUE };
struct ev {
    struct arena arena;
    struct kr_err *err;
    struct kr_buf_s *out;
    long steps;
    int depth;
    enum kr_status fault; /* a limit a helper without a status met (steps, depth, bytes): set once, with
                             its message in err; every later evaluation fails with it */
    struct scope *root;
    struct scope *scope;            /* innermost scope */
    const struct node *inject_node; /* set/filter blocks: this placeholder evaluates to inject_val */
    struct value inject_val;
    int line;
};
#define STR_OK(v) ((v).t == V_STR) /* a string made by ct_mk_str (else out of memory) */
/* A scratch buffer of the renderer: an append past MAX_BYTES fails (b.oom) instead of growing. */
#define CT_BUF {.limit = MAX_BYTES}

/* tojson's options */
struct json_opts {
    const char *indent; /* NULL: single line */
    const char *item_sep, *key_sep;
    bool sort_keys;
};

/* a call's evaluated arguments: positional, then keyword (names parallel to values) */
struct args {
    struct value *pos;
    size_t n;
    const char **kn;
    struct value *kv;
    size_t nk;
};

/* ==== functions shared between the files ========================================================= */

/* ---- lex.c: the lexer ------------------------------------------------------------------------ */

enum kr_status ct_syntax_err(struct kr_err *err, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
size_t ct_py_space_len(const char *s, size_t n, size_t i);
size_t ct_py_rstrip_len(const char *s, size_t n);
enum kr_status ct_lex(struct lexer *lx);

/* ---- parse.c: the parser --------------------------------------------------------------------- */

extern const char *const ct_FILTERS[]; /* the filters the parser accepts, NULL-terminated */
bool ct_in_list(const char *const *list, const char *s);

/* ---- value.c: the arena, values, Python conversions, JSON, strings --------------------------- */

void *ct_a_alloc(struct arena *a, size_t n);
void ct_a_free(struct arena *a);
enum kr_status ct_rt_err(struct ev *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
enum kr_status ct_oom(struct ev *e);
/* Records a fault (the first one only) with its message; returns it. */
enum kr_status ct_fault(struct ev *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Charges n steps of work; false (the fault recorded) once the render has spent MAX_STEPS. */
bool ct_charge(struct ev *e, uint64_t n);
/* The steps that scanning n bytes costs. */
static inline uint64_t ct_bytes_steps(size_t n)
{
    return 1 + n / BYTES_PER_STEP;
}
/* A string of b's contents, or V_UNDEF (and the arena marked failed) when b lost an append. b is
 * left to the caller. */
struct value ct_mk_str_buf(struct ev *e, const struct kr_buf_s *b);
struct value ct_mk_str(struct ev *e, const char *s, size_t n);
struct value ct_mk_list(struct ev *e, enum vt t, size_t cap);
bool ct_list_push(struct ev *e, struct list *l, struct value v);
struct value ct_mk_dict(struct ev *e, enum vt t);
struct value *ct_dict_find(const struct dict *d, struct value k);
struct value *ct_dict_find_str(const struct dict *d, const char *k);
bool ct_dict_set(struct ev *e, struct dict *d, struct value k, struct value v);
void ct_dict_clear(struct dict *d); /* no keys, the capacity kept */
bool ct_dict_set_str(struct ev *e, struct dict *d, const char *k, struct value v);
struct value ct_mk_func(struct ev *e, enum builtin b, struct value self, const char *name);
const char *ct_type_name(struct value v);
/* Prints v as Python's str() (repr=false) or repr() does. Containers nested deeper than MAX_DEPTH,
 * and printing past the step limit, record a fault. */
void ct_py_str(struct ev *e, struct value v, struct kr_buf_s *b, bool repr);
struct value ct_to_str(struct ev *e, struct value v);
bool ct_truthy(struct value v);
bool ct_is_num(struct value v);
double ct_num(struct value v);
int64_t ct_inum(struct value v);
/* (int64_t)f saturated (NaN: 0): a plain cast of a float out of range is undefined. */
int64_t ct_f2i(double f);
/* Python's ==. With e, each element compared is a step and nesting deeper than MAX_DEPTH records a
 * fault; e may be NULL (dict lookups), then deep values compare unequal. */
bool ct_v_eq(struct ev *e, struct value a, struct value b);
bool ct_v_cmp(struct ev *e, struct value a, struct value b, int *res);
struct value ct_from_json(struct ev *e, const json_t *j);
enum kr_status ct_to_json(struct ev *e, struct value v, const struct json_opts *o, int level, struct kr_buf_s *b);
size_t ct_u8_count(const char *s, size_t n);
size_t ct_u8_offset(const char *s, size_t n, size_t k);
struct value ct_py_strip(struct ev *e, const struct jstr *s, const struct jstr *chars, bool left, bool right);
struct value ct_map_case(struct ev *e, const struct jstr *s, int mode /* 0 lower 1 upper 2 title 3 capitalize */);
struct value ct_str_replace(struct ev *e, const struct jstr *s, const struct jstr *old, const struct jstr *new,
                            int64_t count);
/* The first (or last) occurrence of n in h, in time linear in hn + nn, charged to e. */
const char *ct_memfind(struct ev *e, const char *h, size_t hn, const char *n, size_t nn, bool last);

/* ---- eval.c: lookups, iteration, operators, expressions, statements -------------------------- */

enum kr_status ct_get_attr(struct ev *e, struct value obj, const char *name, struct value *out);
enum kr_status ct_get_item(struct ev *e, struct value obj, struct value key, struct value *out);
enum kr_status ct_iter_list(struct ev *e, struct value v, struct list **out);
enum kr_status ct_arith(struct ev *e, int op, struct value a, struct value b, struct value *out);
enum kr_status ct_contains(struct ev *e, struct value hay, struct value needle, bool *res);
enum kr_status ct_eval(struct ev *e, const struct node *nd, struct value *out);
enum kr_status ct_exec_body(struct ev *e, const struct node *body, struct scope *sc, enum flow *flow);

/* ---- builtins.c: calls, filters and tests ---------------------------------------------------- */

enum kr_status ct_eval_args(struct ev *e, const struct node *nd, struct args *a, size_t skip_first);
enum kr_status ct_call_func(struct ev *e, const struct func *f, const struct args *a, struct value *out);
enum kr_status ct_apply_filter(struct ev *e, const char *name, struct value v, const struct args *a,
                               struct value *out);
enum kr_status ct_apply_test(struct ev *e, const char *name, struct value v, const struct args *a, bool *res);
