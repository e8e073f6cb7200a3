/* POST /v1/responses over a chat completions session: the request's translation into a chat body,
 * and the answer's translation into a response object or the Responses stream's events (see
 * responses.h). */
#include "responses.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"

#define RESP_MAX_METADATA 16  /* OpenAI's bound: 16 pairs, keys up to 64 and values up to 512 chars */
#define RESP_MAX_TOP_LOGPROBS 20

struct fcall {                /* a function call of the answer */
    char *call_id;            /* the chat tool call's id */
    char *name;
    char *args;               /* arguments so far */
    size_t args_len, args_cap;
    int32_t out_index;        /* its place in `output` */
};

struct kr_resp {
    json_t *req;              /* the Responses body, for what the answer echoes */
    /* the session's sink and the transport's, which r forwards to */
    struct kr_sess_sink sink;
    const struct kr_sess_sink *to;
    void *to_user;
    /* the answer, as it is built (streams) */
    bool streaming;
    bool broken;              /* an event could not be built or sent: the stream ends as out of memory */
    int64_t seq;              /* sequence_number of the next event */
    char id[64];              /* resp_..., from the chat id */
    int64_t created;
    char model[256];
    bool started;             /* response.created went out */
    int32_t n_out;            /* output items opened */
    /* the message item: opened at the first text, closed by a function call or the end */
    bool msg_open, msg_done;
    int32_t msg_index;
    char *text;
    size_t text_len, text_cap;
    json_t *lps;              /* the message's logprobs (array), or NULL without logprobs */
    json_t *lps_pending;      /* logprobs of tokens whose text has not been sent yet */
    /* function calls, by the chat's tool call index */
    struct fcall *calls;
    int32_t n_calls, cap_calls;
    int32_t open_call;        /* the call whose arguments are streaming, -1 none */
    /* the end */
    char finish[32];
    json_t *usage;            /* the chat usage object */
    json_t *error;            /* an error event's error object */
};

/* ---- helpers ------------------------------------------------------------------------------------ */

static void oset(bool *ok, json_t *o, const char *k, json_t *v)
{
    if (!v || json_object_set_new(o, k, v) != 0) {
        *ok = false;
    }
}

static void apush(bool *ok, json_t *a, json_t *v)
{
    if (!v || json_array_append_new(a, v) != 0) {
        *ok = false;
    }
}

static json_t *jcopy(const json_t *v)
{
    return v ? json_deep_copy(v) : json_null();
}

static bool grow(char **buf, size_t *len, size_t *cap, const char *add, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t nc = (*len + n + 1) * 2;
        char *nb = kr_realloc(*buf, nc);
        if (!nb) {
            return false;
        }
        *buf = nb;
        *cap = nc;
    }
    memcpy(*buf + *len, add, n);
    *len += n;
    (*buf)[*len] = 0;
    return true;
}

/* ---- lifetime ----------------------------------------------------------------------------------- */

struct kr_resp *kr_resp_create(void)
{
    struct kr_resp *r = kr_calloc(1, sizeof *r);
    if (r) {
        r->open_call = -1;
        r->msg_index = -1;
    }
    return r;
}

void kr_resp_free(struct kr_resp *r)
{
    if (!r) {
        return;
    }
    json_decref(r->req);
    kr_free(r->text);
    json_decref(r->lps);
    json_decref(r->lps_pending);
    for (int32_t i = 0; i < r->n_calls; i++) {
        kr_free(r->calls[i].call_id);
        kr_free(r->calls[i].name);
        kr_free(r->calls[i].args);
    }
    kr_free(r->calls);
    json_decref(r->usage);
    json_decref(r->error);
    kr_free(r);
}

/* ---- the request -------------------------------------------------------------------------------- */

#define bad(e, param, ...) kr_oai_error((e), KR_OAI_INVALID, (param), __VA_ARGS__)

/* The text of a content given as a string or as a list of text parts (input_text, output_text,
 * text, refusal); other parts are refused by name. NULL with *st set when refused or out of memory. */
static json_t *content_text(const json_t *c, const char *param, struct kr_oai_error *e, enum kr_status *st)
{
    if (json_is_string(c)) {
        json_t *s = json_stringn_nocheck(json_string_value(c), json_string_length(c));
        *st = s ? KR_OK : KR_ERR_NOMEM;
        return s;
    }
    if (!json_is_array(c)) {
        *st = bad(e, param, "'%s' must be a string or a list of content parts", param);
        return NULL;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    size_t i;
    const json_t *part;
    json_array_foreach(c, i, part) {
        char p[64];
        snprintf(p, sizeof p, "%s[%zu]", param, i);
        const char *type = json_string_value(json_object_get(part, "type"));
        if (!json_is_object(part) || !type) {
            kr_free(buf);
            *st = bad(e, p, "'%s' must be an object with a 'type'", p);
            return NULL;
        }
        if (strcmp(type, "input_text") != 0 && strcmp(type, "output_text") != 0 && strcmp(type, "text") != 0 &&
            strcmp(type, "refusal") != 0) {
            kr_free(buf);
            *st = bad(e, p, "content parts of type '%s' are not supported: this server reads text only (%s)", type,
                      p);
            return NULL;
        }
        const json_t *t = json_object_get(part, strcmp(type, "refusal") == 0 ? "refusal" : "text");
        if (!json_is_string(t)) {
            kr_free(buf);
            *st = bad(e, p, "'%s' needs a string '%s'", p, strcmp(type, "refusal") == 0 ? "refusal" : "text");
            return NULL;
        }
        if (!grow(&buf, &len, &cap, json_string_value(t), json_string_length(t))) {
            kr_free(buf);
            *st = KR_ERR_NOMEM;
            return NULL;
        }
    }
    json_t *s = json_stringn_nocheck(buf ? buf : "", len);
    kr_free(buf);
    *st = s ? KR_OK : KR_ERR_NOMEM;
    return s;
}

/* The last message of `msgs` when it is an assistant message that function calls may join. */
static json_t *assistant_tail(json_t *msgs)
{
    const size_t n = json_array_size(msgs);
    json_t *m = n ? json_array_get(msgs, n - 1) : NULL;
    const char *role = json_string_value(json_object_get(m, "role"));
    return role && !strcmp(role, "assistant") ? m : NULL;
}

static enum kr_status input_items(const json_t *input, json_t *msgs, struct kr_oai_error *e)
{
    bool ok = true;
    size_t i;
    const json_t *it;
    json_array_foreach(input, i, it) {
        char p[48];
        snprintf(p, sizeof p, "input[%zu]", i);
        if (!json_is_object(it)) {
            return bad(e, p, "'%s' must be an object (a message or an item)", p);
        }
        const char *type = json_string_value(json_object_get(it, "type"));
        const json_t *role = json_object_get(it, "role");
        enum kr_status st;
        if ((!type && role) || (type && !strcmp(type, "message"))) {
            const char *rs = json_string_value(role);
            if (!rs || (strcmp(rs, "user") && strcmp(rs, "system") && strcmp(rs, "developer") && strcmp(rs, "assistant"))) {
                char pr[64];
                snprintf(pr, sizeof pr, "%s.role", p);
                return bad(e, pr, "'%s' must be one of user, system, developer, assistant", pr);
            }
            char pc[64];
            snprintf(pc, sizeof pc, "%s.content", p);
            json_t *text = content_text(json_object_get(it, "content"), pc, e, &st);
            if (!text) {
                return st;
            }
            apush(&ok, msgs, json_pack("{s:s, s:o}", "role", rs, "content", text));
        } else if (type && !strcmp(type, "function_call")) {
            const json_t *cid = json_object_get(it, "call_id"), *name = json_object_get(it, "name"),
                         *args = json_object_get(it, "arguments");
            if (!json_is_string(cid) || !json_is_string(name) || !json_is_string(args)) {
                return bad(e, p, "'%s' (a function_call) needs string 'call_id', 'name' and 'arguments'", p);
            }
            /* calls join the assistant message before them (a response's message and calls) */
            json_t *m = assistant_tail(msgs);
            if (!m) {
                apush(&ok, msgs, json_pack("{s:s, s:n}", "role", "assistant", "content"));
                m = ok ? assistant_tail(msgs) : NULL;
            }
            json_t *calls = m ? json_object_get(m, "tool_calls") : NULL;
            if (m && !calls) {
                oset(&ok, m, "tool_calls", json_array());
                calls = ok ? json_object_get(m, "tool_calls") : NULL;
            }
            if (calls) {
                apush(&ok, calls,
                      json_pack("{s:O, s:s, s:{s:O, s:O}}", "id", cid, "type", "function", "function", "name", name,
                                "arguments", args));
            }
        } else if (type && !strcmp(type, "function_call_output")) {
            const json_t *cid = json_object_get(it, "call_id");
            if (!json_is_string(cid)) {
                return bad(e, p, "'%s' (a function_call_output) needs a string 'call_id'", p);
            }
            char po[64];
            snprintf(po, sizeof po, "%s.output", p);
            json_t *out = content_text(json_object_get(it, "output"), po, e, &st);
            if (!out) {
                return st;
            }
            json_t *m = json_pack("{s:s, s:O, s:o}", "role", "tool", "tool_call_id", cid, "content", out);
            apush(&ok, msgs, m);
        } else if (type && (!strcmp(type, "reasoning") || !strcmp(type, "item_reference"))) {
            return bad(e, p, "input items of type '%s' are not supported: this server keeps no responses and "
                             "produces no reasoning items (%s)", type, p);
        } else if (type) {
            return bad(e, p, "input items of type '%s' are not supported (%s): send messages, function_call and "
                             "function_call_output items", type, p);
        } else {
            return bad(e, p, "'%s' needs a 'role' or a 'type'", p);
        }
        if (!ok) {
            return KR_ERR_NOMEM;
        }
    }
    return KR_OK;
}

static enum kr_status tools_of(const json_t *tools, json_t *out, struct kr_oai_error *e)
{
    if (!json_is_array(tools)) {
        return bad(e, "tools", "'tools' must be a list");
    }
    bool ok = true;
    size_t i;
    const json_t *t;
    json_array_foreach(tools, i, t) {
        char p[48];
        snprintf(p, sizeof p, "tools[%zu]", i);
        const char *type = json_string_value(json_object_get(t, "type"));
        if (!json_is_object(t) || !type) {
            return bad(e, p, "'%s' must be an object with a 'type'", p);
        }
        if (strcmp(type, "function") != 0) {
            return bad(e, p, "tools of type '%s' are not supported: only function tools (%s)", type, p);
        }
        if (!json_is_string(json_object_get(t, "name"))) {
            char pn[64];
            snprintf(pn, sizeof pn, "%s.name", p);
            return bad(e, pn, "'%s' must be a string", pn);
        }
        json_t *fn = json_object();
        const char *keys[] = {"name", "description", "parameters", "strict"};
        for (size_t k = 0; fn && k < sizeof keys / sizeof keys[0]; k++) {
            const json_t *v = json_object_get(t, keys[k]);
            if (v && !json_is_null(v)) {
                oset(&ok, fn, keys[k], json_deep_copy(v));
            }
        }
        apush(&ok, out, json_pack("{s:s, s:o}", "type", "function", "function", fn));
    }
    return ok ? KR_OK : KR_ERR_NOMEM;
}

static enum kr_status tool_choice_of(const json_t *tc, json_t *chat, struct kr_oai_error *e)
{
    bool ok = true;
    if (json_is_string(tc)) {
        oset(&ok, chat, "tool_choice", json_deep_copy(tc));
        return ok ? KR_OK : KR_ERR_NOMEM;
    }
    const char *type = json_string_value(json_object_get(tc, "type"));
    if (json_is_object(tc) && type && !strcmp(type, "function") && json_is_string(json_object_get(tc, "name"))) {
        oset(&ok, chat, "tool_choice",
             json_pack("{s:s, s:{s:O}}", "type", "function", "function", "name", json_object_get(tc, "name")));
        return ok ? KR_OK : KR_ERR_NOMEM;
    }
    if (json_is_object(tc) && type) {
        return bad(e, "tool_choice", "'tool_choice' of type '%s' is not supported: use none, auto, required or "
                                     "{\"type\": \"function\", \"name\": ...}", type);
    }
    return bad(e, "tool_choice", "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"name\": ...}");
}

static enum kr_status text_format_of(const json_t *text, json_t *chat, struct kr_oai_error *e)
{
    if (!json_is_object(text)) {
        return bad(e, "text", "'text' must be an object");
    }
    const json_t *verb = json_object_get(text, "verbosity");
    if (verb && !json_is_null(verb) && !(json_is_string(verb) && !strcmp(json_string_value(verb), "medium"))) {
        return bad(e, "text.verbosity", "'text.verbosity' is not supported (only \"medium\")");
    }
    const json_t *f = json_object_get(text, "format");
    if (!f || json_is_null(f)) {
        return KR_OK;
    }
    const char *type = json_string_value(json_object_get(f, "type"));
    if (!json_is_object(f) || !type) {
        return bad(e, "text.format", "'text.format' must be an object with a 'type'");
    }
    bool ok = true;
    if (!strcmp(type, "text")) {
        return KR_OK;
    }
    if (!strcmp(type, "json_object")) {
        oset(&ok, chat, "response_format", json_pack("{s:s}", "type", "json_object"));
    } else if (!strcmp(type, "json_schema")) {
        const json_t *schema = json_object_get(f, "schema"), *name = json_object_get(f, "name");
        if (!json_is_object(schema)) {
            return bad(e, "text.format.schema", "'text.format.schema' must be a JSON Schema object");
        }
        json_t *js = json_pack("{s:O}", "schema", schema);
        if (js && json_is_string(name)) {
            oset(&ok, js, "name", json_deep_copy(name));
        }
        const json_t *strict = json_object_get(f, "strict");
        if (js && json_is_boolean(strict)) {
            oset(&ok, js, "strict", json_deep_copy(strict));
        }
        oset(&ok, chat, "response_format", json_pack("{s:s, s:o}", "type", "json_schema", "json_schema", js));
    } else {
        return bad(e, "text.format.type", "'text.format.type' '%s' is not supported: use text, json_object or "
                                          "json_schema", type);
    }
    return ok ? KR_OK : KR_ERR_NOMEM;
}

/* Fields understood and not implemented: refused by name when given a value other than their
 * default. */
static enum kr_status refuse_unsupported(const json_t *o, struct kr_oai_error *e)
{
    static const struct {
        const char *key;
        const char *why;
    } never[] = {
        {"previous_response_id", "this server keeps no responses: send the whole conversation in 'input'"},
        {"conversation", "this server keeps no conversations: send the whole conversation in 'input'"},
        {"prompt", "this server has no stored prompt templates"},
        {"reasoning", "this server has no reasoning controls"},
        {"max_tool_calls", "bound the calls with 'parallel_tool_calls' instead"},
        {"context_management", "this server does not compact conversations"},
    };
    for (size_t i = 0; i < sizeof never / sizeof never[0]; i++) {
        const json_t *v = json_object_get(o, never[i].key);
        if (v && !json_is_null(v)) {
            return bad(e, never[i].key, "'%s' is not supported: %s", never[i].key, never[i].why);
        }
    }
    const json_t *store = json_object_get(o, "store");
    if (store && !json_is_null(store) && !json_is_false(store)) {
        return bad(e, "store", "'store' is not supported: this server keeps no responses; send \"store\": false");
    }
    const json_t *bg = json_object_get(o, "background");
    if (bg && !json_is_null(bg) && !json_is_false(bg)) {
        return bad(e, "background", "'background' is not supported: responses are answered while the client waits");
    }
    const json_t *tr = json_object_get(o, "truncation");
    if (tr && !json_is_null(tr) && !(json_is_string(tr) && !strcmp(json_string_value(tr), "disabled"))) {
        return bad(e, "truncation", "'truncation' is not supported (only \"disabled\": an input longer than the "
                                    "context is refused)");
    }
    const json_t *tier = json_object_get(o, "service_tier");
    if (tier && !json_is_null(tier) && !(json_is_string(tier) && !strcmp(json_string_value(tier), "auto"))) {
        return bad(e, "service_tier", "'service_tier' is not supported (only \"auto\")");
    }
    const json_t *so = json_object_get(o, "stream_options");
    if (so && !json_is_null(so)) {
        const json_t *ob = json_object_get(so, "include_obfuscation");
        if (!json_is_object(so) || (ob && !json_is_null(ob) && !json_is_false(ob))) {
            return bad(e, "stream_options", "'stream_options' is not supported (only include_obfuscation false)");
        }
    }
    return KR_OK;
}

enum kr_status kr_resp_request(struct kr_resp *r, const char *body, size_t len, char **chat_out, size_t *chat_len,
                               struct kr_oai_error *e)
{
    *chat_out = NULL;
    *chat_len = 0;
    json_error_t je;
    bool oom = false;
    json_t *o = kr_oai_json_loadb(body, len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je, &oom);
    if (!o) {
        if (oom) {
            return KR_ERR_NOMEM;
        }
        return kr_oai_error(e, KR_OAI_INVALID, "", "malformed JSON: %s at line %d column %d", je.text, je.line,
                            je.column);
    }
    r->req = o;
    if (!json_is_object(o)) {
        return bad(e, "", "The request body must be a JSON object");
    }
    enum kr_status st = refuse_unsupported(o, e);
    if (st != KR_OK) {
        return st;
    }
    json_t *chat = json_object(), *msgs = json_array();
    bool ok = chat && msgs;
    if (!ok || json_object_set(chat, "messages", msgs) != 0) { /* msgs keeps its own reference */
        json_decref(chat);
        json_decref(msgs);
        return KR_ERR_NOMEM;
    }
    /* instructions: a system message first */
    const json_t *ins = json_object_get(o, "instructions");
    if (ins && !json_is_null(ins)) {
        if (!json_is_string(ins)) {
            st = bad(e, "instructions", "'instructions' must be a string");
            goto out;
        }
        apush(&ok, msgs, json_pack("{s:s, s:O}", "role", "system", "content", ins));
        if (!ok) {
            goto out;
        }
    }
    const json_t *input = json_object_get(o, "input");
    if (json_is_string(input)) {
        apush(&ok, msgs, json_pack("{s:s, s:O}", "role", "user", "content", input));
    } else if (json_is_array(input)) {
        if ((st = input_items(input, msgs, e)) != KR_OK) {
            goto out;
        }
    } else {
        st = bad(e, "input", input ? "'input' must be a string or a list of items" : "'input' is required");
        goto out;
    }
    if (ok && json_array_size(msgs) == 0) {
        st = bad(e, "input", "'input' must not be empty");
        goto out;
    }
    /* tools and the choice of them */
    const json_t *tools = json_object_get(o, "tools");
    if (tools && !json_is_null(tools)) {
        json_t *ct = json_array();
        if (!ct) {
            ok = false;
            goto out;
        }
        st = tools_of(tools, ct, e);
        oset(&ok, chat, "tools", ct);
        if (st != KR_OK || !ok) {
            goto out;
        }
    }
    const json_t *tc = json_object_get(o, "tool_choice");
    if (tc && !json_is_null(tc) && (st = tool_choice_of(tc, chat, e)) != KR_OK) {
        goto out;
    }
    const json_t *text = json_object_get(o, "text");
    if (text && !json_is_null(text) && (st = text_format_of(text, chat, e)) != KR_OK) {
        goto out;
    }
    /* logprobs: top_logprobs, and include's message.output_text.logprobs */
    bool want_lp = false;
    const json_t *inc = json_object_get(o, "include");
    if (inc && !json_is_null(inc)) {
        if (!json_is_array(inc)) {
            st = bad(e, "include", "'include' must be a list");
            goto out;
        }
        size_t i;
        const json_t *v;
        json_array_foreach(inc, i, v) {
            char p[40];
            snprintf(p, sizeof p, "include[%zu]", i);
            if (!json_is_string(v) || strcmp(json_string_value(v), "message.output_text.logprobs") != 0) {
                st = bad(e, p, "'%s' is not supported (only \"message.output_text.logprobs\")", p);
                goto out;
            }
            want_lp = true;
        }
    }
    const json_t *tlp = json_object_get(o, "top_logprobs");
    if (tlp && !json_is_null(tlp)) {
        if (!json_is_integer(tlp) || json_integer_value(tlp) < 0 || json_integer_value(tlp) > RESP_MAX_TOP_LOGPROBS) {
            st = bad(e, "top_logprobs", "'top_logprobs' must be an integer from 0 to 20");
            goto out;
        }
        want_lp = true;
        oset(&ok, chat, "top_logprobs", json_deep_copy(tlp));
    }
    if (want_lp) {
        oset(&ok, chat, "logprobs", json_true());
    }
    const json_t *md = json_object_get(o, "metadata");
    if (md && !json_is_null(md)) {
        const char *k;
        const json_t *v;
        bool good = json_is_object(md) && json_object_size(md) <= RESP_MAX_METADATA;
        json_object_foreach((json_t *)md, k, v) {
            good = good && json_is_string(v) && strlen(k) <= 64 && json_string_length(v) <= 512;
        }
        if (!good) {
            st = bad(e, "metadata", "'metadata' must be an object of at most 16 string values (keys up to 64 and "
                                    "values up to 512 characters)");
            goto out;
        }
    }
    /* the rest under the chat names: OpenAI's, then vLLM's sampling extras */
    static const char *const same[] = {"model", "stream", "temperature", "top_p", "parallel_tool_calls", "user",
                                       "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                                       "frequency_penalty", "stop", "ignore_eos", "min_tokens", "logit_bias",
                                       "skip_special_tokens", "chat_template_kwargs", "cache_salt"};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        const json_t *v = json_object_get(o, same[i]);
        if (v && !json_is_null(v)) {
            oset(&ok, chat, same[i], json_deep_copy(v));
        }
    }
    const json_t *mot = json_object_get(o, "max_output_tokens");
    if (mot && !json_is_null(mot)) {
        oset(&ok, chat, "max_completion_tokens", json_deep_copy(mot));
    }
    if (json_is_true(json_object_get(o, "stream"))) {
        oset(&ok, chat, "stream_options", json_pack("{s:b}", "include_usage", 1)); /* for response.completed */
    }
    if (!ok) {
        st = KR_ERR_NOMEM;
        goto out;
    }
    json_decref(msgs);
    *chat_out = kr_oai_dump(chat);
    chat = NULL;
    if (!*chat_out) {
        return KR_ERR_NOMEM;
    }
    *chat_len = strlen(*chat_out);
    return KR_OK;
out:
    json_decref(chat);
    json_decref(msgs);
    return st != KR_OK ? st : KR_ERR_NOMEM;
}

void kr_resp_error_param(const struct kr_resp *r, struct kr_oai_error *e)
{
    (void)r;
    static const struct {
        const char *chat, *resp;
    } names[] = {
        {"max_completion_tokens", "max_output_tokens"},
        {"max_tokens", "max_output_tokens"},
        {"response_format", "text.format"},
        {"messages", "input"},
        {"tools", "tools"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const size_t n = strlen(names[i].chat);
        if (!strncmp(e->param, names[i].chat, n) && (e->param[n] == 0 || e->param[n] == '.' || e->param[n] == '[')) {
            char p[sizeof e->param];
            if (!strcmp(names[i].chat, "messages")) {
                snprintf(p, sizeof p, "input"); /* instructions shift the indices: name the whole input */
            } else {
                snprintf(p, sizeof p, "%s%s", names[i].resp, e->param + n);
            }
            snprintf(e->param, sizeof e->param, "%s", p);
            return;
        }
    }
}

/* ---- the answer: items ---------------------------------------------------------------------------- */

static const char *finish_status(const struct kr_resp *r)
{
    if (r->error) {
        return "failed";
    }
    return !strcmp(r->finish, "length") ? "incomplete" : "completed";
}

static json_t *message_item(const struct kr_resp *r, const char *status)
{
    bool ok = true;
    char id[80];
    snprintf(id, sizeof id, "msg_%s", r->id + 5);
    json_t *part = json_pack("{s:s, s:s#, s:[]}", "type", "output_text", "text", r->text ? r->text : "",
                             (int)r->text_len, "annotations");
    if (part && r->lps) {
        oset(&ok, part, "logprobs", json_deep_copy(r->lps));
    } else if (part) {
        oset(&ok, part, "logprobs", json_array());
    }
    json_t *item = json_pack("{s:s, s:s, s:s, s:s, s:[o]}", "id", id, "type", "message", "status", status, "role",
                             "assistant", "content", part);
    if (!ok) {
        json_decref(item);
        return NULL;
    }
    return item;
}

static json_t *call_item(const struct kr_resp *r, const struct fcall *c, const char *status, bool with_args)
{
    char id[96];
    snprintf(id, sizeof id, "fc_%s_%d", r->id + 5, c->out_index);
    return json_pack("{s:s, s:s, s:s, s:s, s:s, s:s#}", "id", id, "type", "function_call", "status", status,
                     "call_id", c->call_id ? c->call_id : "", "name", c->name ? c->name : "", "arguments",
                     with_args && c->args ? c->args : "", with_args ? (int)c->args_len : 0);
}

/* The response object: `output` in order of output_index; status from the end, or in_progress. */
static json_t *response_object(const struct kr_resp *r, const char *status, bool final)
{
    bool ok = true;
    const json_t *q = r->req;
    json_t *o = json_object();
    if (!o) {
        return NULL;
    }
    oset(&ok, o, "id", json_string(r->id));
    oset(&ok, o, "object", json_string("response"));
    oset(&ok, o, "created_at", json_integer(r->created));
    oset(&ok, o, "status", json_string(status));
    oset(&ok, o, "background", json_false());
    if (final && r->error) {
        const json_t *code = json_object_get(r->error, "code");
        const json_t *msg = json_object_get(r->error, "message");
        oset(&ok, o, "error", json_pack("{s:o, s:o}", "code", json_is_string(code) ? json_deep_copy(code)
                                                                                   : json_string("server_error"),
                                        "message", json_is_string(msg) ? json_deep_copy(msg) : json_string("")));
    } else {
        oset(&ok, o, "error", json_null());
    }
    oset(&ok, o, "incomplete_details",
         final && !strcmp(status, "incomplete") ? json_pack("{s:s}", "reason", "max_output_tokens") : json_null());
    oset(&ok, o, "instructions", jcopy(json_object_get(q, "instructions")));
    oset(&ok, o, "max_output_tokens", jcopy(json_object_get(q, "max_output_tokens")));
    oset(&ok, o, "max_tool_calls", json_null());
    oset(&ok, o, "model", json_string(r->model));
    json_t *out = json_array();
    oset(&ok, o, "output", out);
    if (final && ok) { /* out lives in o */
        const char *item_status = !strcmp(status, "incomplete") ? "incomplete" : "completed";
        for (int32_t k = 0; k < r->n_out; k++) {
            if (k == r->msg_index) {
                apush(&ok, out, message_item(r, item_status));
            }
            for (int32_t c = 0; c < r->n_calls; c++) {
                if (r->calls[c].out_index == k) {
                    apush(&ok, out, call_item(r, &r->calls[c], item_status, true));
                }
            }
        }
    }
    const json_t *ptc = json_object_get(q, "parallel_tool_calls");
    oset(&ok, o, "parallel_tool_calls", json_is_boolean(ptc) ? json_deep_copy(ptc) : json_true());
    oset(&ok, o, "previous_response_id", json_null());
    oset(&ok, o, "prompt_cache_key", jcopy(json_object_get(q, "prompt_cache_key")));
    oset(&ok, o, "reasoning", json_pack("{s:n, s:n}", "effort", "summary"));
    oset(&ok, o, "safety_identifier", jcopy(json_object_get(q, "safety_identifier")));
    oset(&ok, o, "service_tier", json_string("default"));
    oset(&ok, o, "store", json_false());
    const json_t *temp = json_object_get(q, "temperature"), *top_p = json_object_get(q, "top_p");
    oset(&ok, o, "temperature", json_is_number(temp) ? json_deep_copy(temp) : json_real(1.0));
    const json_t *text = json_object_get(q, "text");
    oset(&ok, o, "text", json_is_object(text) && json_is_object(json_object_get(text, "format"))
                             ? json_deep_copy(text)
                             : json_pack("{s:{s:s}, s:s}", "format", "type", "text", "verbosity", "medium"));
    const json_t *tc = json_object_get(q, "tool_choice");
    oset(&ok, o, "tool_choice", tc && !json_is_null(tc) ? json_deep_copy(tc) : json_string("auto"));
    const json_t *tools = json_object_get(q, "tools");
    oset(&ok, o, "tools", json_is_array(tools) ? json_deep_copy(tools) : json_array());
    const json_t *tlp = json_object_get(q, "top_logprobs");
    oset(&ok, o, "top_logprobs", json_is_integer(tlp) ? json_deep_copy(tlp) : json_integer(0));
    oset(&ok, o, "top_p", json_is_number(top_p) ? json_deep_copy(top_p) : json_real(1.0));
    oset(&ok, o, "truncation", json_string("disabled"));
    if (final && r->usage) {
        const json_int_t in = json_integer_value(json_object_get(r->usage, "prompt_tokens"));
        const json_int_t outn = json_integer_value(json_object_get(r->usage, "completion_tokens"));
        const json_int_t cached =
            json_integer_value(json_object_get(json_object_get(r->usage, "prompt_tokens_details"), "cached_tokens"));
        oset(&ok, o, "usage",
             json_pack("{s:I, s:{s:I}, s:I, s:{s:I}, s:I}", "input_tokens", (json_int_t)in, "input_tokens_details",
                       "cached_tokens", (json_int_t)cached, "output_tokens", (json_int_t)outn, "output_tokens_details",
                       "reasoning_tokens", (json_int_t)0, "total_tokens", (json_int_t)(in + outn)));
    } else {
        oset(&ok, o, "usage", json_null());
    }
    oset(&ok, o, "user", jcopy(json_object_get(q, "user")));
    const json_t *md = json_object_get(q, "metadata");
    oset(&ok, o, "metadata", json_is_object(md) ? json_deep_copy(md) : json_object());
    if (!ok) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* Takes the chat answer's id, created and model. */
static void take_head(struct kr_resp *r, const json_t *chat)
{
    const char *id = json_string_value(json_object_get(chat, "id"));
    const char *dash = id ? strchr(id, '-') : NULL;
    snprintf(r->id, sizeof r->id, "resp_%s", dash ? dash + 1 : (id ? id : "0"));
    r->created = json_integer_value(json_object_get(chat, "created"));
    const char *model = json_string_value(json_object_get(chat, "model"));
    snprintf(r->model, sizeof r->model, "%s", model ? model : "");
}

static struct fcall *call_at(struct kr_resp *r, int32_t index)
{
    if (index < 0 || index >= 1024) {
        return NULL;
    }
    if (index >= r->cap_calls) {
        int32_t nc = index + 8;
        struct fcall *n = kr_realloc(r->calls, (size_t)nc * sizeof *n);
        if (!n) {
            return NULL;
        }
        memset(n + r->cap_calls, 0, (size_t)(nc - r->cap_calls) * sizeof *n);
        r->calls = n;
        r->cap_calls = nc;
    }
    if (index >= r->n_calls) {
        for (int32_t i = r->n_calls; i <= index; i++) {
            r->calls[i].out_index = -1;
        }
        r->n_calls = index + 1;
    }
    return &r->calls[index];
}

static bool set_str(char **dst, const json_t *v)
{
    if (!json_is_string(v) || *dst) {
        return true;
    }
    *dst = kr_strndup(json_string_value(v), json_string_length(v));
    return *dst != NULL;
}

/* ---- the answer: whole ------------------------------------------------------------------------------ */

static char *whole_response(struct kr_resp *r, const char *body, size_t len)
{
    json_error_t je;
    bool oom = false;
    json_t *chat = kr_oai_json_loadb(body, len, 0, &je, &oom);
    if (!chat) {
        return NULL;
    }
    take_head(r, chat);
    const json_t *ch = json_array_get(json_object_get(chat, "choices"), 0);
    const json_t *msg = json_object_get(ch, "message");
    const char *fr = json_string_value(json_object_get(ch, "finish_reason"));
    snprintf(r->finish, sizeof r->finish, "%s", fr ? fr : "stop");
    bool ok = true;
    const json_t *content = json_object_get(msg, "content");
    const json_t *calls = json_object_get(msg, "tool_calls");
    const json_t *lps = json_object_get(json_object_get(ch, "logprobs"), "content");
    if (json_is_array(lps)) {
        r->lps = json_deep_copy(lps);
        ok = r->lps != NULL;
    }
    if (json_is_string(content)) {
        ok = ok && grow(&r->text, &r->text_len, &r->text_cap, json_string_value(content), json_string_length(content));
    }
    if (r->text_len > 0 || json_array_size(calls) == 0) {
        r->msg_index = r->n_out++;
    }
    size_t i;
    const json_t *tc;
    json_array_foreach(calls, i, tc) {
        struct fcall *c = call_at(r, (int32_t)i);
        const json_t *fn = json_object_get(tc, "function");
        const json_t *args = json_object_get(fn, "arguments");
        ok = ok && c && set_str(&c->call_id, json_object_get(tc, "id")) && set_str(&c->name, json_object_get(fn, "name")) &&
             (!json_is_string(args) ||
              grow(&c->args, &c->args_len, &c->args_cap, json_string_value(args), json_string_length(args)));
        if (c) {
            c->out_index = r->n_out++;
        }
    }
    const json_t *usage = json_object_get(chat, "usage");
    if (usage) {
        r->usage = json_deep_copy(usage);
        ok = ok && r->usage;
    }
    json_decref(chat);
    if (!ok) {
        return NULL;
    }
    return kr_oai_dump(response_object(r, finish_status(r), true));
}

/* ---- the answer: events ------------------------------------------------------------------------------ */

/* Sends one event {"type": name, "sequence_number": n, ...fields} (fields consumed). */
static void event(struct kr_resp *r, const char *name, json_t *fields)
{
    if (r->broken || !r->to) {
        json_decref(fields);
        return;
    }
    bool ok = fields != NULL;
    json_t *ev = json_pack("{s:s, s:I}", "type", name, "sequence_number", (json_int_t)r->seq++);
    if (ev && fields && json_object_update(ev, fields) != 0) {
        ok = false;
    }
    json_decref(fields);
    char *text = ev && ok ? kr_oai_dump(ev) : (json_decref(ev), NULL);
    if (!text) {
        r->broken = true;
        return;
    }
    const bool sent = r->to->stream_event_named ? r->to->stream_event_named(r->to_user, name, text, strlen(text))
                                                : r->to->stream_event(r->to_user, text, strlen(text));
    kr_oai_free(text);
    if (!sent) {
        r->broken = true;
    }
}

static void begin_events(struct kr_resp *r, const json_t *chunk)
{
    if (r->started) {
        return;
    }
    r->started = true;
    take_head(r, chunk);
    json_t *resp = response_object(r, "in_progress", false);
    event(r, "response.created", json_pack("{s:o}", "response", resp));
    resp = response_object(r, "in_progress", false);
    event(r, "response.in_progress", json_pack("{s:o}", "response", resp));
}

static void close_message(struct kr_resp *r)
{
    if (!r->msg_open) {
        return;
    }
    r->msg_open = false;
    r->msg_done = true;
    char id[80];
    snprintf(id, sizeof id, "msg_%s", r->id + 5);
    if (r->lps_pending && r->lps) {
        if (json_array_extend(r->lps, r->lps_pending) != 0) {
            r->broken = true;
        }
        json_array_clear(r->lps_pending);
    }
    event(r, "response.output_text.done",
          json_pack("{s:s, s:i, s:i, s:s#, s:o}", "item_id", id, "output_index", r->msg_index, "content_index", 0,
                    "text", r->text ? r->text : "", (int)r->text_len, "logprobs",
                    r->lps ? json_deep_copy(r->lps) : json_array()));
    json_t *item = message_item(r, "completed");
    json_t *part = item ? json_incref(json_array_get(json_object_get(item, "content"), 0)) : NULL;
    event(r, "response.content_part.done",
          json_pack("{s:s, s:i, s:i, s:o}", "item_id", id, "output_index", r->msg_index, "content_index", 0, "part",
                    part));
    event(r, "response.output_item.done",
          json_pack("{s:i, s:o}", "output_index", r->msg_index, "item", item));
}

static void close_call(struct kr_resp *r)
{
    if (r->open_call < 0) {
        return;
    }
    const struct fcall *c = &r->calls[r->open_call];
    r->open_call = -1;
    char id[96];
    snprintf(id, sizeof id, "fc_%s_%d", r->id + 5, c->out_index);
    event(r, "response.function_call_arguments.done",
          json_pack("{s:s, s:i, s:s, s:s#}", "item_id", id, "output_index", c->out_index, "name", c->name ? c->name : "",
                    "arguments", c->args ? c->args : "", (int)c->args_len));
    json_t *item = call_item(r, c, "completed", true);
    event(r, "response.output_item.done", json_pack("{s:i, s:o}", "output_index", c->out_index, "item", item));
}

static void open_message(struct kr_resp *r)
{
    if (r->msg_open || r->msg_done) {
        return;
    }
    close_call(r);
    r->msg_open = true;
    r->msg_index = r->n_out++;
    char id[80];
    snprintf(id, sizeof id, "msg_%s", r->id + 5);
    event(r, "response.output_item.added",
          json_pack("{s:i, s:{s:s, s:s, s:s, s:s, s:[]}}", "output_index", r->msg_index, "item", "id", id, "type",
                    "message", "status", "in_progress", "role", "assistant", "content"));
    event(r, "response.content_part.added",
          json_pack("{s:s, s:i, s:i, s:{s:s, s:s, s:[], s:[]}}", "item_id", id, "output_index", r->msg_index,
                    "content_index", 0, "part", "type", "output_text", "text", "", "annotations", "logprobs"));
}

static void on_text(struct kr_resp *r, const char *s, size_t n, const json_t *lps)
{
    if (json_is_array(lps) && json_array_size(lps)) {
        if (!r->lps) {
            r->lps = json_array();
        }
        if (!r->lps_pending) {
            r->lps_pending = json_array();
        }
        if (!r->lps || !r->lps_pending || json_array_extend(r->lps_pending, (json_t *)lps) != 0) {
            r->broken = true;
            return;
        }
    }
    if (n == 0) {
        return;
    }
    if (r->msg_done) {
        return; /* text after the message was closed for a function call: an answer has one message
                   item, as the whole response has */
    }
    open_message(r);
    if (!grow(&r->text, &r->text_len, &r->text_cap, s, n)) {
        r->broken = true;
        return;
    }
    char id[80];
    snprintf(id, sizeof id, "msg_%s", r->id + 5);
    json_t *dl = r->lps_pending ? r->lps_pending : json_array();
    r->lps_pending = NULL;
    if (r->lps && dl && json_array_extend(r->lps, dl) != 0) {
        r->broken = true;
    }
    event(r, "response.output_text.delta",
          json_pack("{s:s, s:i, s:i, s:s#, s:o}", "item_id", id, "output_index", r->msg_index, "content_index", 0,
                    "delta", s, (int)n, "logprobs", dl ? dl : json_array()));
}

static void on_call_delta(struct kr_resp *r, const json_t *tc)
{
    const json_t *idx = json_object_get(tc, "index");
    struct fcall *c = call_at(r, json_is_integer(idx) ? (int32_t)json_integer_value(idx) : 0);
    if (!c) {
        r->broken = true;
        return;
    }
    const int32_t ci = (int32_t)(c - r->calls);
    const json_t *fn = json_object_get(tc, "function");
    if (!set_str(&c->call_id, json_object_get(tc, "id")) || !set_str(&c->name, json_object_get(fn, "name"))) {
        r->broken = true;
        return;
    }
    if (c->out_index < 0) {
        close_message(r);
        close_call(r);
        c->out_index = r->n_out++;
        r->open_call = ci;
        json_t *item = call_item(r, c, "in_progress", false);
        event(r, "response.output_item.added", json_pack("{s:i, s:o}", "output_index", c->out_index, "item", item));
    }
    const json_t *args = json_object_get(fn, "arguments");
    if (json_is_string(args) && json_string_length(args) > 0) {
        if (!grow(&c->args, &c->args_len, &c->args_cap, json_string_value(args), json_string_length(args))) {
            r->broken = true;
            return;
        }
        char id[96];
        snprintf(id, sizeof id, "fc_%s_%d", r->id + 5, c->out_index);
        event(r, "response.function_call_arguments.delta",
              json_pack("{s:s, s:i, s:O}", "item_id", id, "output_index", c->out_index, "delta", args));
    }
}

static void on_chunk(struct kr_resp *r, const json_t *chunk)
{
    const json_t *err = json_object_get(chunk, "error");
    if (json_is_object(err)) {
        if (!r->error && !(r->error = json_deep_copy(err))) {
            r->broken = true;
            return;
        }
        const json_t *code = json_object_get(err, "code"), *msg = json_object_get(err, "message"),
                     *param = json_object_get(err, "param");
        event(r, "error",
              json_pack("{s:o, s:o, s:o}", "code", code ? json_deep_copy(code) : json_null(), "message",
                        json_is_string(msg) ? json_deep_copy(msg) : json_string(""), "param",
                        param ? json_deep_copy(param) : json_null()));
        return;
    }
    begin_events(r, chunk);
    const json_t *usage = json_object_get(chunk, "usage");
    if (json_is_object(usage)) {
        json_decref(r->usage);
        r->usage = json_deep_copy(usage);
        if (!r->usage) {
            r->broken = true;
            return;
        }
    }
    const json_t *ch = json_array_get(json_object_get(chunk, "choices"), 0);
    if (!ch) {
        return;
    }
    const json_t *delta = json_object_get(ch, "delta");
    const json_t *content = json_object_get(delta, "content");
    on_text(r, json_is_string(content) ? json_string_value(content) : "",
            json_is_string(content) ? json_string_length(content) : 0,
            json_object_get(json_object_get(ch, "logprobs"), "content"));
    size_t i;
    const json_t *tc;
    json_array_foreach(json_object_get(delta, "tool_calls"), i, tc) {
        on_call_delta(r, tc);
    }
    const char *fr = json_string_value(json_object_get(ch, "finish_reason"));
    if (fr) {
        snprintf(r->finish, sizeof r->finish, "%s", fr);
    }
}

static void finish_events(struct kr_resp *r)
{
    if (!r->started) {
        json_t *empty = json_object();
        begin_events(r, empty);
        json_decref(empty);
    }
    if (!r->error && r->n_out == 0) {
        open_message(r); /* an empty answer is one empty message, as the whole response has */
    }
    close_message(r);
    close_call(r);
    const char *status = finish_status(r);
    json_t *resp = response_object(r, status, true);
    event(r, !strcmp(status, "failed") ? "response.failed"
             : !strcmp(status, "incomplete") ? "response.incomplete"
                                              : "response.completed",
          json_pack("{s:o}", "response", resp));
}

/* ---- the sink ------------------------------------------------------------------------------------- */

static void s_begin(void *user)
{
    struct kr_resp *r = user;
    r->streaming = true;
    r->to->stream_begin(r->to_user);
}

static bool s_event(void *user, const char *json, size_t len)
{
    struct kr_resp *r = user;
    if (r->broken) {
        return true; /* the end says so */
    }
    json_error_t je;
    bool oom = false;
    json_t *chunk = kr_oai_json_loadb(json, len, 0, &je, &oom);
    if (!chunk) {
        return false; /* nothing changed: the session sends it again */
    }
    on_chunk(r, chunk);
    json_decref(chunk);
    return true;
}

static void s_done(void *user, int status, const char *body, size_t len)
{
    struct kr_resp *r = user;
    if (r->streaming) {
        if (status == 200 && !r->broken) {
            finish_events(r);
        }
        r->to->done(r->to_user, status == 200 && !r->broken ? 200 : 500, "", 0);
        return;
    }
    if (status != 200 || !body) {
        r->to->done(r->to_user, status, body, len); /* errors are the same objects */
        return;
    }
    char *resp = whole_response(r, body, len);
    r->to->done(r->to_user, resp ? 200 : 500, resp, resp ? strlen(resp) : 0);
    kr_oai_free(resp);
}

const struct kr_sess_sink *kr_resp_sink(struct kr_resp *r, const struct kr_sess_sink *to, void *to_user)
{
    r->to = to;
    r->to_user = to_user;
    r->sink = (struct kr_sess_sink){.stream_begin = s_begin, .stream_event = s_event, .done = s_done};
    return &r->sink;
}
