#include "chat.h"

#include "alloc.h"
#include "chat-dsv32.h"
#include "chat-template.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

struct kr_chat {
    struct kr_chat_template *tpl;
    char *bos, *eos;
    bool has_developer;        /* the template names the 'developer' role: such messages go as they are */
    enum kr_tool_format tool_format; /* what the template's text teaches (NONE: it shows no format) */
    bool dsv32;                /* no template: DeepSeek-V3.2's encoder (chat-dsv32.c) renders */
};

static enum kr_status read_file(const char *path, char **out, size_t *len, struct kr_err *err)
{
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        return kr_err_set(err, KR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *buf = n >= 0 ? kr_malloc((size_t)n + 1) : NULL;
    if (n >= 0 && !buf) {
        fclose(fp);
        return kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory reading it", path);
    }
    if (!buf || fread(buf, 1, (size_t)n, fp) != (size_t)n) {
        kr_free(buf);
        fclose(fp);
        return kr_err_set(err, KR_ERR_IO, "%s: cannot read", path);
    }
    fclose(fp);
    buf[n] = 0;
    *out = buf;
    *len = (size_t)n;
    return KR_OK;
}

enum kr_status kr_chat_load(const struct kr_tokenizer *tok, const char *template_file, struct kr_chat **out,
                            struct kr_err *err)
{
    *out = NULL;
    char *src = NULL;
    size_t len = 0;
    const char *what = template_file ? template_file : "tokenizer_config.json chat_template";
    if (template_file) {
        const enum kr_status st = read_file(template_file, &src, &len, err);
        if (st != KR_OK) {
            return st;
        }
    } else {
        const char *t = kr_tokenizer_chat_template(tok);
        if (!t) {
            return KR_OK;
        }
        len = strlen(t);
        src = kr_strndup(t, len);
        if (!src) {
            return kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", what);
        }
    }
    struct kr_chat *c = kr_calloc(1, sizeof *c);
    if (!c) {
        kr_free(src);
        return kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", what);
    }
    enum kr_status st = kr_chat_template_compile(src, len, &c->tpl, err);
    /* OpenAI's `developer` role replaces `system` for newer models; a template written before it
     * (DeepSeek-V3's among them) only looks for "system" and would drop such messages silently, so
     * they are handed to it as system messages unless the template mentions the role itself */
    c->has_developer = memmem(src, len, "developer", 9) != NULL;
    c->tool_format = kr_tool_format_detect(src, NULL);
    kr_free(src);
    if (st != KR_OK) {
        kr_err_prefix(err, "%s", what);
        kr_free(c);
        return st;
    }
    const char *b = kr_tokenizer_bos_token(tok), *e = kr_tokenizer_eos_token(tok);
    c->bos = b ? kr_strdup(b) : NULL;
    c->eos = e ? kr_strdup(e) : NULL;
    if ((b && !c->bos) || (e && !c->eos)) { /* the template would render without them */
        kr_chat_free(c);
        return kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory", what);
    }
    *out = c;
    return KR_OK;
}

enum kr_status kr_chat_builtin(const char *model_type, struct kr_chat **out, struct kr_err *err)
{
    *out = NULL;
    if (!model_type || strcmp(model_type, "deepseek_v32") != 0) {
        return KR_OK;
    }
    struct kr_chat *c = kr_calloc(1, sizeof *c);
    if (!c) {
        return kr_err_set(err, KR_ERR_NOMEM, "DeepSeek-V3.2's prompt format: out of memory");
    }
    c->dsv32 = true;
    c->tool_format = KR_TOOL_FORMAT_DEEPSEEK_V32;
    *out = c;
    return KR_OK;
}

enum kr_tool_format kr_chat_tool_format(const struct kr_chat *c, const char *model_type)
{
    if (c && c->tool_format != KR_TOOL_FORMAT_NONE) {
        return c->tool_format;
    }
    return kr_tool_format_detect(NULL, model_type);
}

void kr_chat_free(struct kr_chat *c)
{
    if (!c) {
        return;
    }
    kr_chat_template_free(c->tpl);
    kr_free(c->bos);
    kr_free(c->eos);
    kr_free(c);
}

/* Turns a message's tool_calls[].function.arguments strings into the objects they spell (an
 * empty string into {}), as vLLM hands them to templates: qwen3_coder templates (Nemotron 3,
 * Qwen3-Coder) iterate `arguments|items`, which only a mapping has. A string that is not a JSON
 * object stays as it is. False when out of memory. */
static bool arguments_as_objects(json_t *m)
{
    json_t *calls = json_object_get(m, "tool_calls");
    for (size_t i = 0; i < json_array_size(calls); i++) {
        json_t *fn = json_object_get(json_array_get(calls, i), "function");
        json_t *args = json_object_get(fn, "arguments");
        if (!json_is_string(args)) {
            continue;
        }
        json_error_t je;
        json_t *obj = json_string_length(args) == 0
                          ? json_object()
                          : json_loadb(json_string_value(args), json_string_length(args), 0, &je);
        if (json_is_object(obj)) {
            if (json_object_set_new(fn, "arguments", obj) != 0) {
                return false;
            }
        } else {
            json_decref(obj);
        }
    }
    return true;
}

/* A copy of messages whose array contents (text parts) are joined into strings, and whose
 * `developer` roles become `system` when the template knows no developer role. For a template
 * that teaches qwen3_coder, call arguments are objects (arguments_as_objects). */
static json_t *normalize(const struct kr_chat *c, json_t *messages, struct kr_oai_error *e)
{
    json_t *out = json_deep_copy(messages);
    if (!out) {
        kr_oai_error(e, KR_OAI_INTERNAL, "", "out of memory");
        return NULL;
    }
    size_t i;
    json_t *m;
    json_array_foreach(out, i, m)
    {
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!c->has_developer && role && !strcmp(role, "developer") &&
            json_object_set_new(m, "role", json_string("system")) != 0) {
            json_decref(out);
            kr_oai_error(e, KR_OAI_INTERNAL, "", "out of memory");
            return NULL;
        }
        if (c->tool_format == KR_TOOL_FORMAT_QWEN3_CODER && !arguments_as_objects(m)) {
            json_decref(out);
            kr_oai_error(e, KR_OAI_INTERNAL, "", "out of memory");
            return NULL;
        }
        json_t *content = json_object_get(m, "content");
        if (!json_is_array(content)) {
            continue;
        }
        char *buf = NULL;
        size_t len = 0;
        size_t j;
        json_t *part;
        json_array_foreach(content, j, part)
        {
            json_t *text = json_object_get(part, "text");
            if (!json_is_string(text)) {
                continue; /* the parser already rejected non-text parts */
            }
            const size_t tl = json_string_length(text);
            char *nb = kr_realloc(buf, len + tl + 2);
            if (!nb) {
                kr_free(buf);
                json_decref(out);
                kr_oai_error(e, KR_OAI_INTERNAL, "", "out of memory");
                return NULL;
            }
            buf = nb;
            if (len) {
                buf[len++] = '\n';
            }
            memcpy(buf + len, json_string_value(text), tl);
            len += tl;
            buf[len] = 0;
        }
        const int set = json_object_set_new(m, "content", json_stringn(buf ? buf : "", len));
        kr_free(buf);
        if (set != 0) { /* the parts would be rendered as they are */
            json_decref(out);
            kr_oai_error(e, KR_OAI_INTERNAL, "", "out of memory");
            return NULL;
        }
    }
    return out;
}

/* chat_template_kwargs' `thinking` or `enable_thinking` (the names vLLM and SGLang take), truthy as
 * Python sees it. */
static bool thinking(const json_t *kwargs)
{
    const char *const keys[2] = {"thinking", "enable_thinking"};
    for (int i = 0; i < 2; i++) {
        const json_t *v = json_object_get(kwargs, keys[i]);
        if (json_is_true(v) || (json_is_integer(v) && json_integer_value(v) != 0) ||
            (json_is_real(v) && json_real_value(v) != 0) || (json_is_string(v) && json_string_length(v) > 0) ||
            (json_is_array(v) && json_array_size(v) > 0) || (json_is_object(v) && json_object_size(v) > 0)) {
            return true;
        }
    }
    return false;
}

static enum kr_status continue_final(json_t *msgs, bool continue_final_message, char **text, size_t *len,
                                     struct kr_oai_error *e);

enum kr_status kr_chat_render(const struct kr_chat *c, json_t *messages, json_t *tools, bool add_generation_prompt,
                              bool continue_final_message, json_t *kwargs, char **text, size_t *len,
                              struct kr_oai_error *e)
{
    json_t *msgs = normalize(c, messages, e);
    if (!msgs) {
        return KR_ERR_NOMEM;
    }
    if (c->dsv32) {
        struct kr_buf_s b = {0};
        const enum kr_status st = kr_dsv32_render(msgs, tools, thinking(kwargs), &b, e);
        if (st != KR_OK) {
            kr_bs_free(&b);
            json_decref(msgs);
            return st;
        }
        *text = b.p;
        *len = b.len;
        return continue_final(msgs, continue_final_message, text, len, e);
    }
    struct kr_chat_params p = {.messages = msgs, .tools = tools, .add_generation_prompt = add_generation_prompt && !continue_final_message,
                               .bos_token = c->bos, .eos_token = c->eos, .extra = kwargs};
    struct kr_err err = {0};
    enum kr_status st = kr_chat_template_render(c->tpl, &p, text, len, &err);
    if (st != KR_OK) {
        json_decref(msgs);
        kr_oai_error(e, st == KR_ERR_NOMEM ? KR_OAI_INTERNAL : KR_OAI_INVALID, "messages",
                     "the chat template failed: %s", err.msg);
        return st == KR_ERR_NOMEM ? st : KR_ERR_INVAL;
    }
    return continue_final(msgs, continue_final_message, text, len, e);
}

/* With continue_final_message, cuts the text right after the last message's content (the
 * assistant turn left open, as transformers does). Consumes msgs; frees *text on failure. */
static enum kr_status continue_final(json_t *msgs, bool continue_final_message, char **text, size_t *len,
                                     struct kr_oai_error *e)
{
    if (continue_final_message) {
        json_t *last = json_array_get(msgs, json_array_size(msgs) - 1);
        json_t *content = json_object_get(last, "content");
        const char *cs = json_string_value(content);
        const size_t cl = json_string_length(content);
        char *hit = NULL;
        for (char *p2 = *text; cs && cl && (p2 = memmem(p2, *len - (size_t)(p2 - *text), cs, cl)); p2++) {
            hit = p2;
        }
        if (!hit) {
            json_decref(msgs);
            kr_free(*text);
            *text = NULL;
            kr_oai_error(e, KR_OAI_INVALID, "continue_final_message",
                         "the final message's content does not appear in the rendered prompt");
            return KR_ERR_INVAL;
        }
        *len = (size_t)(hit - *text) + cl;
        (*text)[*len] = 0;
    }
    json_decref(msgs);
    return KR_OK;
}
