/* OpenAI responses: completions and chat completions as JSON or SSE chunks (choices, logprobs,
 * usage), the model list and error bodies, and the UTF-8 repair they rely on. The requests are
 * parsed in openai-parse.c.
 *
 * Responses are built with jansson; every string that may come from detokenization is made valid
 * UTF-8 (U+FFFD per maximal invalid subpart, as Python's errors="replace") before it is encoded,
 * because json_stringn() silently returns NULL on invalid UTF-8. */
#define _POSIX_C_SOURCE 200809L

#include "openai.h"

#include "alloc.h"
#include "utf8.h"

#include <jansson.h>

#include <math.h>
#include <string.h>

#define OAI_DUMP_FLAGS   (JSON_COMPACT | JSON_REAL_PRECISION(9)) /* 9 significant digits round-trip float32 */
#define OAI_LOGPROB_MIN  (-9999.0) /* vLLM: max(logprob, -9999.0), -inf included */

/* ---- UTF-8 ----------------------------------------------------------------------------------- */

/* Scans s[0..n): returns the byte length of its sanitized form (invalid subparts become U+FFFD),
 * writing it to `dst` when not NULL (dst needs 3 * n bytes at most). Counts code points in *n_cp
 * and reports whether the input was already valid. */
static size_t utf8_sanitize(const char *s, size_t n, char *dst, size_t *n_cp, bool *valid)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, out = 0, cp = 0;
    bool ok = true;
    while (i < n) {
        size_t len; /* of the character, or of the maximal invalid subpart (Unicode §3.9, as Python) */
        uint32_t c;
        if (kr_utf8_scan(u + i, n - i, &len, &c) == KR_UTF8_CHAR) {
            if (dst) {
                memcpy(dst + out, s + i, len);
            }
            out += len;
            i += len;
        } else {
            if (dst) {
                memcpy(dst + out, "\xEF\xBF\xBD", 3);
            }
            out += 3;
            i += len;
            ok = false;
        }
        cp++;
    }
    if (n_cp) {
        *n_cp = cp;
    }
    if (valid) {
        *valid = ok;
    }
    return out;
}

size_t kr_oai_utf8_count(const char *s, size_t n)
{
    size_t cp = 0;
    if (s) {
        utf8_sanitize(s, n, NULL, &cp, NULL);
    }
    return cp;
}

/* Calls `fn` with a valid-UTF-8 view of s[0..n) (a sanitized copy when needed). Returns fn's value,
 * or -1 when the copy cannot be allocated. */
typedef int (*utf8_view_fn)(const char *s, size_t n, void *user);

static int with_valid_utf8(const char *s, size_t n, utf8_view_fn fn, void *user)
{
    if (!s) {
        s = "";
        n = 0;
    }
    bool valid;
    size_t out_len = utf8_sanitize(s, n, NULL, NULL, &valid);
    if (valid) {
        return fn(s, n, user);
    }
    char *buf = kr_malloc(out_len + 1);
    if (!buf) {
        return -1;
    }
    utf8_sanitize(s, n, buf, NULL, NULL);
    buf[out_len] = 0;
    int rc = fn(buf, out_len, user);
    kr_free(buf);
    return rc;
}

static int make_string_cb(const char *s, size_t n, void *user)
{
    *(json_t **)user = json_stringn_nocheck(s, n);
    return 0;
}

/* A JSON string from arbitrary bytes (NULL = ""); NULL only on OOM. */
static json_t *jstr(const char *s, size_t n)
{
    json_t *j = NULL;
    with_valid_utf8(s, n, make_string_cb, &j);
    return j;
}

/* A JSON string, or null when s is NULL. */
static json_t *jstr_or_null(const char *s)
{
    return s ? jstr(s, strlen(s)) : json_null();
}

struct set_key_ctx {
    json_t *obj;
    json_t *value;
};

static int set_key_cb(const char *s, size_t n, void *user)
{
    struct set_key_ctx *c = user;
    json_t *v = c->value;
    c->value = NULL;
    return json_object_setn_new_nocheck(c->obj, s, n, v);
}

/* obj[key] = value with an arbitrary-bytes key; steals `value`. Returns 0 or -1. */
static int set_bytes_key(json_t *obj, const char *key, size_t key_len, json_t *value)
{
    if (!value) {
        return -1;
    }
    struct set_key_ctx c = {obj, value};
    int rc = with_valid_utf8(key, key_len, set_key_cb, &c);
    json_decref(c.value); /* still set only when the copy could not be allocated */
    return rc;
}

/* ---- response building ----------------------------------------------------------------------- */

/* Object/array setters that remember a failure (OOM) instead of returning it at every call; they
 * steal `v` (and release it on failure), as json_*_set_new do. */
static void oset(bool *ok, json_t *o, const char *key, json_t *v)
{
    if (json_object_set_new(o, key, v) != 0) {
        *ok = false;
    }
}

static void apush(bool *ok, json_t *a, json_t *v)
{
    if (json_array_append_new(a, v) != 0) {
        *ok = false;
    }
}

/* A log-probability: NaN -> null, -inf and anything below -9999 -> -9999.0 (vLLM), +inf -> null. */
static json_t *jlogprob(float v)
{
    if (isnan(v) || (isinf(v) && v > 0)) {
        return json_null();
    }
    double d = v < OAI_LOGPROB_MIN ? OAI_LOGPROB_MIN : (double)v;
    return json_real(d);
}

static json_t *jint_array(const int32_t *v, int32_t n)
{
    json_t *a = json_array();
    bool ok = a != NULL;
    for (int32_t i = 0; ok && i < n; i++) {
        apush(&ok, a, json_integer(v[i]));
    }
    if (!ok) {
        json_decref(a);
        return NULL;
    }
    return a;
}

static json_t *jusage(const struct kr_oai_usage *u)
{
    json_t *o = json_object();
    bool ok = o != NULL;
    oset(&ok, o, "prompt_tokens", json_integer(u->prompt_tokens));
    oset(&ok, o, "completion_tokens", json_integer(u->completion_tokens));
    oset(&ok, o, "total_tokens", json_integer((json_int_t)u->prompt_tokens + u->completion_tokens));
    if (!ok) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* vLLM's stop_reason: the stop string hit, else the stop token id hit, else null. */
static json_t *jstop_reason(const struct kr_oai_choice *c)
{
    if (c->stop_reason_str) {
        return jstr_or_null(c->stop_reason_str);
    }
    if (c->stop_reason_id >= 0) {
        return json_integer(c->stop_reason_id);
    }
    return json_null();
}

/* The head every response and chunk shares: id, object, created, model. */
static json_t *jhead(bool *ok, const char *id, const char *object, int64_t created, const char *model)
{
    json_t *o = json_object();
    if (!o) {
        *ok = false;
        return NULL;
    }
    oset(ok, o, "id", jstr_or_null(id ? id : ""));
    oset(ok, o, "object", json_string(object));
    oset(ok, o, "created", json_integer(created));
    oset(ok, o, "model", jstr_or_null(model ? model : ""));
    return o;
}

/* Serializes `j` into a buffer from jansson's allocator (malloc unless json_set_alloc_funcs was
 * called, so the caller frees it with free()), between `prefix` and `suffix`, and releases `j`.
 * NULL when building (`ok` false) or dumping failed. The size is measured first and the text dumped
 * into an exact buffer: json_dumps() grows a buffer and, in jansson 2.14, ignores a failed growth
 * while writing an object key, which yields a truncated document instead of NULL. */
static char *finish_framed(json_t *j, bool ok, const char *prefix, const char *suffix)
{
    char *out = NULL;
    size_t n = ok && j ? json_dumpb(j, NULL, 0, OAI_DUMP_FLAGS) : 0;
    if (n > 0) {
        size_t np = strlen(prefix), ns = strlen(suffix);
        json_malloc_t mf;
        json_free_t ff;
        json_get_alloc_funcs(&mf, &ff);
        out = mf(np + n + ns + 1);
        if (out) {
            memcpy(out, prefix, np);
            if (json_dumpb(j, out + np, n, OAI_DUMP_FLAGS) != n) {
                ff(out);
                out = NULL;
            } else {
                memcpy(out + np + n, suffix, ns + 1);
            }
        }
    }
    json_decref(j);
    return out;
}

char *kr_oai_dump(json_t *j)
{
    return finish_framed(j, j != NULL, "", "");
}

json_t *kr_oai_json_loadb(const char *buf, size_t len, size_t flags, json_error_t *je, bool *oom)
{
    const uint64_t failed = kr_alloc_thread_failures();
    kr_alloc_shield(1); /* jansson's lexer overflows its buffer when a growth fails (kr_alloc_shield) */
    json_t *j = json_loadb(buf, len, flags, je);
    kr_alloc_shield(0);
    *oom = kr_alloc_thread_failures() != failed || (!j && json_error_code(je) == json_error_out_of_memory);
    if (*oom) {
        json_decref(j); /* parsed, but perhaps with a string missing the bytes it could not save */
        j = NULL;
    }
    return j;
}

void kr_oai_free(void *p)
{
    if (p) {
        json_malloc_t mf;
        json_free_t ff;
        json_get_alloc_funcs(&mf, &ff);
        ff(p);
    }
}

static char *finish(json_t *j, bool ok)
{
    return finish_framed(j, ok, "", "");
}

/* One SSE event: "data: <json>\n\n". */
static char *finish_sse(json_t *j, bool ok)
{
    return finish_framed(j, ok, "data: ", "\n\n");
}

/* ---- completions logprobs -------------------------------------------------------------------- */

/* {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} */
struct cmpl_lp {
    json_t *obj, *tokens, *token_logprobs, *top_logprobs, *text_offset;
};

static json_t *cmpl_lp_new(bool *ok, struct cmpl_lp *lp)
{
    lp->obj = json_object();
    lp->tokens = json_array();
    lp->token_logprobs = json_array();
    lp->top_logprobs = json_array();
    lp->text_offset = json_array();
    /* the object takes the arrays; our pointers stay valid (borrowed) while it lives, and are not
     * used once *ok is false */
    oset(ok, lp->obj, "tokens", lp->tokens);
    oset(ok, lp->obj, "token_logprobs", lp->token_logprobs);
    oset(ok, lp->obj, "top_logprobs", lp->top_logprobs);
    oset(ok, lp->obj, "text_offset", lp->text_offset);
    return lp->obj;
}

/* Where each completions token sits in the text it belongs to (text_offset, in code points). With a
 * text: a token whose bytes are the text's next ones is there and moves the cursor past them; one
 * that is not (a special token the text skips, such as the prompt's BOS, or a token past a stop
 * string) sits at the cursor and moves nothing, so that offsets never decrease and every token with
 * text starts where its offset points. Without a text (a stream's delta, whose text may lag its
 * tokens): each token counts its own code points. */
struct cmpl_pos {
    const char *text;   /* [len] the whole choice text, or NULL */
    size_t len;
    size_t cur;         /* bytes of text before the cursor */
    size_t sync;        /* the last cursor that was not inside a character */
    int64_t sync_cp;    /* code points of text[0..sync) */
    int64_t offset;     /* without a text: code points so far */
};

/* The offset of token x, and the cursor past it. */
static int64_t cmpl_pos_take(struct cmpl_pos *p, const struct kr_oai_token *x)
{
    const size_t n = x->text ? x->text_len : 0;
    if (!p->text) {
        const int64_t at = p->offset;
        p->offset += (int64_t)kr_oai_utf8_count(x->text, n);
        return at;
    }
    const int64_t at = p->sync_cp + (int64_t)kr_oai_utf8_count(p->text + p->sync, p->cur - p->sync);
    if (n > 0 && n <= p->len - p->cur && memcmp(p->text + p->cur, x->text, n) == 0) {
        p->cur += n;
        /* counting restarts only where a character starts: a token may end inside one */
        if (p->cur == p->len || ((unsigned char)p->text[p->cur] & 0xC0) != 0x80) {
            p->sync_cp += (int64_t)kr_oai_utf8_count(p->text + p->sync, p->cur - p->sync);
            p->sync = p->cur;
        }
    }
    return at;
}

/* Moves the cursor to byte `at` of the text (where the generated tokens begin, after an echo). */
static void cmpl_pos_seek(struct cmpl_pos *p, size_t at)
{
    p->sync = p->cur = at <= p->len ? at : p->len;
    p->sync_cp = (int64_t)kr_oai_utf8_count(p->text, p->cur);
}

/* Appends the entries of `v` [n], their text_offset from `pos`. `first_null` forces null logprob
 * and top_logprobs on entry 0 (the first prompt token has no logprob). An entry with a NaN logprob
 * and no alternatives gets null top_logprobs. */
static void cmpl_lp_add(bool *ok, struct cmpl_lp *lp, const struct kr_oai_logprob *v, int32_t n,
                        bool first_null, struct cmpl_pos *pos)
{
    for (int32_t i = 0; i < n && *ok; i++) {
        const struct kr_oai_logprob *x = &v[i];
        bool null_entry = (first_null && i == 0) || (isnan(x->tok.logprob) && x->n_top == 0);
        apush(ok, lp->tokens, jstr(x->tok.text, x->tok.text_len));
        apush(ok, lp->token_logprobs, first_null && i == 0 ? json_null() : jlogprob(x->tok.logprob));
        if (null_entry) {
            apush(ok, lp->top_logprobs, json_null());
        } else {
            json_t *top = json_object();
            if (!top) {
                *ok = false;
            }
            for (int32_t k = 0; k < x->n_top && *ok; k++) {
                if (set_bytes_key(top, x->top[k].text ? x->top[k].text : "",
                                  x->top[k].text ? x->top[k].text_len : 0,
                                  jlogprob(x->top[k].logprob)) != 0) {
                    *ok = false;
                }
            }
            apush(ok, lp->top_logprobs, top);
        }
        apush(ok, lp->text_offset, json_integer(cmpl_pos_take(pos, &x->tok)));
    }
}

/* ---- chat logprobs --------------------------------------------------------------------------- */

static json_t *jbytes(const struct kr_oai_token *t)
{
    const unsigned char *b = t->bytes;
    size_t n = t->n_bytes;
    if (!b) { /* no raw bytes given: the UTF-8 bytes of the text, as vLLM's token.encode() */
        b = (const unsigned char *)(t->text ? t->text : "");
        n = t->text ? t->text_len : 0;
    }
    json_t *a = json_array();
    bool ok = a != NULL;
    for (size_t i = 0; i < n && ok; i++) {
        apush(&ok, a, json_integer(b[i]));
    }
    if (!ok) {
        json_decref(a);
        return NULL;
    }
    return a;
}

/* {"token", "logprob", "bytes"} */
static json_t *chat_token(bool *ok, const struct kr_oai_token *t)
{
    json_t *o = json_object();
    if (!o) {
        *ok = false;
        return NULL;
    }
    oset(ok, o, "token", jstr(t->text, t->text_len));
    json_t *lp = jlogprob(t->logprob);
    oset(ok, o, "logprob", lp);
    oset(ok, o, "bytes", jbytes(t));
    return o;
}

/* {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]} */
static json_t *chat_logprobs(bool *ok, const struct kr_oai_logprob *v, int32_t n)
{
    json_t *o = json_object();
    json_t *content = json_array();
    if (!o || !content) {
        *ok = false;
    }
    for (int32_t i = 0; i < n && *ok; i++) {
        json_t *entry = chat_token(ok, &v[i].tok);
        json_t *top = json_array();
        if (!top) {
            *ok = false;
        }
        for (int32_t k = 0; k < v[i].n_top && *ok; k++) {
            apush(ok, top, chat_token(ok, &v[i].top[k]));
        }
        oset(ok, entry, "top_logprobs", top);
        apush(ok, content, entry);
    }
    oset(ok, o, "content", content);
    return o;
}

/* ---- prompt logprobs (vLLM) ------------------------------------------------------------------- */

/* {"logprob", "rank", "decoded_token"} */
static json_t *vllm_logprob(bool *ok, const struct kr_oai_token *t)
{
    json_t *o = json_object();
    if (!o) {
        *ok = false;
        return NULL;
    }
    oset(ok, o, "logprob", jlogprob(t->logprob));
    oset(ok, o, "rank", t->rank > 0 ? json_integer(t->rank) : json_null());
    oset(ok, o, "decoded_token", jstr(t->text, t->text_len));
    return o;
}

/* vLLM's prompt_logprobs: [null, {"<id>": {logprob, rank, decoded_token}, ...}, ...], one entry per
 * prompt token; after the first, the prompt token itself, then its row's k likeliest (once each). */
static json_t *prompt_logprobs_json(bool *ok, const struct kr_oai_completion *c)
{
    if (!c->prompt_logprobs) {
        return json_null(); /* asked for but not computed: the answer already failed */
    }
    json_t *a = json_array();
    if (!a) {
        *ok = false;
        return NULL;
    }
    apush(ok, a, json_null());
    for (int32_t i = 1; i < c->n_prompt_ids && *ok; i++) {
        const struct kr_oai_logprob *x = &c->prompt_logprobs[i];
        json_t *d = json_object();
        if (!d) {
            *ok = false;
            break;
        }
        char key[16];
        snprintf(key, sizeof key, "%d", x->tok.id);
        oset(ok, d, key, vllm_logprob(ok, &x->tok));
        for (int32_t k = 0; k < x->n_top && *ok; k++) {
            snprintf(key, sizeof key, "%d", x->top[k].id);
            if (!json_object_get(d, key)) {
                oset(ok, d, key, vllm_logprob(ok, &x->top[k]));
            }
        }
        apush(ok, a, d);
    }
    return a;
}

/* ---- completions ----------------------------------------------------------------------------- */

static json_t *cmpl_choice(bool *ok, const struct kr_oai_completion *c, const struct kr_oai_choice *ch)
{
    json_t *o = json_object();
    if (!o) {
        *ok = false;
        return NULL;
    }
    bool echo = c->prompt_text != NULL;
    oset(ok, o, "index", json_integer(ch->index));
    /* the choice text: the echoed prompt, then what was generated */
    const size_t np = echo ? c->prompt_text_len : 0, nt = ch->text ? ch->text_len : 0;
    char *buf = kr_malloc(np + nt + 1);
    if (!buf) {
        *ok = false;
        return o;
    }
    if (np) {
        memcpy(buf, c->prompt_text, np);
    }
    if (nt) {
        memcpy(buf + np, ch->text, nt);
    }
    oset(ok, o, "text", jstr(buf, np + nt));
    if (ch->logprobs) {
        struct cmpl_lp lp;
        oset(ok, o, "logprobs", cmpl_lp_new(ok, &lp));
        struct cmpl_pos pos = {.text = buf, .len = np + nt};
        if (echo && c->prompt_logprobs) {
            cmpl_lp_add(ok, &lp, c->prompt_logprobs, c->n_prompt_ids, true, &pos);
        }
        cmpl_pos_seek(&pos, np); /* generated tokens index the choice text after the echoed prompt */
        cmpl_lp_add(ok, &lp, ch->logprobs, ch->n_logprobs, false, &pos);
    } else {
        oset(ok, o, "logprobs", json_null());
    }
    kr_free(buf);
    oset(ok, o, "finish_reason", jstr_or_null(ch->finish_reason));
    oset(ok, o, "stop_reason", jstop_reason(ch));
    if (c->prompt_logprobs_out) {
        oset(ok, o, "prompt_logprobs", prompt_logprobs_json(ok, c)); /* vLLM: per completions choice */
    }
    if (c->return_token_ids) {
        /* vLLM puts both on each completions choice */
        oset(ok, o, "token_ids",
             ch->token_ids || ch->n_tokens == 0 ? jint_array(ch->token_ids, ch->n_tokens) : json_null());
        oset(ok, o, "prompt_token_ids",
             c->prompt_ids ? jint_array(c->prompt_ids, c->n_prompt_ids) : json_null());
    }
    return o;
}

char *kr_oai_completion_json(const struct kr_oai_completion *c)
{
    bool ok = true;
    json_t *o = jhead(&ok, c->id, "text_completion", c->created, c->model);
    json_t *choices = json_array();
    if (!choices) {
        ok = false;
    }
    for (int32_t i = 0; i < c->n_choices && ok; i++) {
        const struct kr_oai_completion *pc =
            c->prompts && c->choices_per_prompt > 0 ? &c->prompts[i / c->choices_per_prompt] : c;
        apush(&ok, choices, cmpl_choice(&ok, pc, &c->choices[i]));
    }
    oset(&ok, o, "choices", choices);
    oset(&ok, o, "usage", jusage(&c->usage));
    return finish(o, ok);
}

char *kr_oai_completion_chunk_at(const char *id, int64_t created, const char *model,
                                 const struct kr_oai_choice *delta, int64_t text_offset)
{
    bool ok = true;
    json_t *o = jhead(&ok, id, "text_completion", created, model);
    json_t *choices = json_array();
    json_t *ch = json_object();
    if (!choices || !ch) {
        ok = false;
    }
    oset(&ok, ch, "index", json_integer(delta->index));
    oset(&ok, ch, "text", jstr(delta->text, delta->text_len));
    if (delta->logprobs) {
        struct cmpl_lp lp;
        oset(&ok, ch, "logprobs", cmpl_lp_new(&ok, &lp));
        struct cmpl_pos pos = {.offset = text_offset};
        cmpl_lp_add(&ok, &lp, delta->logprobs, delta->n_logprobs, false, &pos);
    } else {
        oset(&ok, ch, "logprobs", json_null());
    }
    oset(&ok, ch, "finish_reason", jstr_or_null(delta->finish_reason));
    oset(&ok, ch, "stop_reason", jstop_reason(delta));
    if (delta->token_ids) {
        oset(&ok, ch, "token_ids", jint_array(delta->token_ids, delta->n_tokens));
    }
    apush(&ok, choices, ch);
    oset(&ok, o, "choices", choices);
    if (delta->usage) {
        oset(&ok, o, "usage", jusage(delta->usage));
    }
    return finish_sse(o, ok);
}

char *kr_oai_completion_chunk(const char *id, int64_t created, const char *model,
                              const struct kr_oai_choice *delta)
{
    return kr_oai_completion_chunk_at(id, created, model, delta, 0);
}

/* ---- chat ------------------------------------------------------------------------------------ */

/* [{index?, id, type, function: {name, arguments}}]: a message's calls (with_index false) or a
 * delta's pieces (id, type and name only where given). */
static json_t *jtool_calls(bool *ok, const struct kr_oai_tool_call *v, int32_t n, bool delta)
{
    json_t *a = json_array();
    if (!a) {
        *ok = false;
        return NULL;
    }
    for (int32_t i = 0; i < n; i++) {
        json_t *t = json_object(), *fn = json_object();
        if (!t || !fn) {
            *ok = false;
            json_decref(t);
            json_decref(fn);
            break;
        }
        if (delta) {
            oset(ok, t, "index", json_integer(v[i].index));
        }
        if (v[i].id) {
            oset(ok, t, "id", json_string(v[i].id));
            oset(ok, t, "type", json_string("function"));
        }
        if (v[i].name) {
            oset(ok, fn, "name", jstr(v[i].name, strlen(v[i].name)));
        }
        if (!delta || v[i].args) {
            oset(ok, fn, "arguments", jstr(v[i].args ? v[i].args : "", v[i].args_len));
        }
        oset(ok, t, "function", fn);
        apush(ok, a, t);
    }
    return a;
}

char *kr_oai_chat_json(const struct kr_oai_completion *c)
{
    bool ok = true;
    json_t *o = jhead(&ok, c->id, "chat.completion", c->created, c->model);
    json_t *choices = json_array();
    if (!choices) {
        ok = false;
    }
    for (int32_t i = 0; i < c->n_choices && ok; i++) {
        const struct kr_oai_choice *ch = &c->choices[i];
        json_t *cj = json_object();
        json_t *msg = json_object();
        if (!cj || !msg) {
            ok = false;
        }
        oset(&ok, cj, "index", json_integer(ch->index));
        oset(&ok, msg, "role", json_string("assistant"));
        oset(&ok, msg, "content", ch->content_null ? json_null() : jstr(ch->text, ch->text_len));
        if (ch->n_tool_calls > 0) {
            oset(&ok, msg, "tool_calls", jtool_calls(&ok, ch->tool_calls, ch->n_tool_calls, false));
        }
        oset(&ok, cj, "message", msg);
        oset(&ok, cj, "logprobs",
             ch->logprobs ? chat_logprobs(&ok, ch->logprobs, ch->n_logprobs) : json_null());
        oset(&ok, cj, "finish_reason", jstr_or_null(ch->finish_reason));
        oset(&ok, cj, "stop_reason", jstop_reason(ch));
        if (c->return_token_ids) {
            oset(&ok, cj, "token_ids",
                 ch->token_ids || ch->n_tokens == 0 ? jint_array(ch->token_ids, ch->n_tokens) : json_null());
        }
        apush(&ok, choices, cj);
    }
    oset(&ok, o, "choices", choices);
    oset(&ok, o, "usage", jusage(&c->usage));
    if (c->prompt_logprobs_out) {
        oset(&ok, o, "prompt_logprobs", prompt_logprobs_json(&ok, c)); /* vLLM: top level for chat */
    }
    if (c->return_token_ids) {
        /* vLLM puts the chat prompt's ids on the response, not on each choice */
        oset(&ok, o, "prompt_token_ids",
             c->prompt_ids ? jint_array(c->prompt_ids, c->n_prompt_ids) : json_null());
    }
    return finish(o, ok);
}

char *kr_oai_chat_chunk(const char *id, int64_t created, const char *model, const struct kr_oai_choice *delta,
                        bool first)
{
    bool ok = true;
    json_t *o = jhead(&ok, id, "chat.completion.chunk", created, model);
    json_t *choices = json_array();
    json_t *ch = json_object();
    json_t *d = json_object();
    if (!choices || !ch || !d) {
        ok = false;
    }
    oset(&ok, ch, "index", json_integer(delta->index));
    if (first) {
        oset(&ok, d, "role", json_string("assistant"));
    }
    /* the final chunk carries an empty delta unless it still has text; a tool-call piece carries no
     * content (null in the first chunk, as OpenAI) */
    if (delta->n_tool_calls > 0) {
        if (first) {
            oset(&ok, d, "content", json_null());
        }
        oset(&ok, d, "tool_calls", jtool_calls(&ok, delta->tool_calls, delta->n_tool_calls, true));
    } else if (first || delta->text_len > 0 || !delta->finish_reason) {
        oset(&ok, d, "content", jstr(delta->text, delta->text_len));
    }
    oset(&ok, ch, "delta", d);
    oset(&ok, ch, "logprobs",
         delta->logprobs ? chat_logprobs(&ok, delta->logprobs, delta->n_logprobs) : json_null());
    oset(&ok, ch, "finish_reason", jstr_or_null(delta->finish_reason));
    oset(&ok, ch, "stop_reason", jstop_reason(delta));
    if (delta->token_ids) {
        oset(&ok, ch, "token_ids", jint_array(delta->token_ids, delta->n_tokens));
    }
    apush(&ok, choices, ch);
    oset(&ok, o, "choices", choices);
    if (delta->usage) {
        oset(&ok, o, "usage", jusage(delta->usage));
    }
    return finish_sse(o, ok);
}

char *kr_oai_usage_chunk(const char *id, int64_t created, const char *model, bool chat,
                         const struct kr_oai_usage *u)
{
    bool ok = true;
    json_t *o = jhead(&ok, id, chat ? "chat.completion.chunk" : "text_completion", created, model);
    oset(&ok, o, "choices", json_array());
    oset(&ok, o, "usage", jusage(u));
    return finish_sse(o, ok);
}

/* ---- models and errors ----------------------------------------------------------------------- */

/* One model object: {"id", "object": "model", "created", "owned_by", "root", "max_model_len"}. */
static json_t *model_object(bool *ok, const char *name, int64_t created, int64_t max_model_len)
{
    json_t *m = json_object();
    if (!m) {
        *ok = false;
        return NULL;
    }
    oset(ok, m, "id", jstr_or_null(name ? name : ""));
    oset(ok, m, "object", json_string("model"));
    oset(ok, m, "created", json_integer(created));
    oset(ok, m, "owned_by", json_string("krait"));
    oset(ok, m, "root", jstr_or_null(name ? name : ""));
    oset(ok, m, "max_model_len", json_integer(max_model_len));
    return m;
}

char *kr_oai_models_json(const char *name, int64_t created, int64_t max_model_len)
{
    bool ok = true;
    json_t *o = json_object();
    json_t *data = json_array();
    if (!o || !data) {
        ok = false;
    }
    oset(&ok, o, "object", json_string("list"));
    apush(&ok, data, model_object(&ok, name, created, max_model_len));
    oset(&ok, o, "data", data);
    return finish(o, ok);
}

char *kr_oai_model_json(const char *name, int64_t created, int64_t max_model_len)
{
    bool ok = true;
    return finish(model_object(&ok, name, created, max_model_len), ok);
}

char *kr_oai_error_json(const struct kr_oai_error *e)
{
    bool ok = true;
    json_t *o = json_object();
    json_t *err = json_object();
    if (!o || !err) {
        ok = false;
    }
    /* the fields are fixed-size buffers: bound the reads even if one lacks its terminator */
    oset(&ok, err, "message", jstr(e->message, strnlen(e->message, sizeof e->message)));
    oset(&ok, err, "type", jstr(e->type, strnlen(e->type, sizeof e->type)));
    size_t np = strnlen(e->param, sizeof e->param), nc = strnlen(e->code, sizeof e->code);
    oset(&ok, err, "param", np ? jstr(e->param, np) : json_null());
    oset(&ok, err, "code", nc ? jstr(e->code, nc) : json_null());
    oset(&ok, o, "error", err);
    return finish(o, ok);
}
