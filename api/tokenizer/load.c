/* Loading a tokenizer: tokenizer.json (normalizers, pre-tokenizers, decoders, the post-processor, the
 * BPE model and its added tokens) and tokenizer_config.json (BOS/EOS, the chat template), from memory
 * or from files; the lookups (vocabulary size, id <-> piece, special tokens). */
#define _POSIX_C_SOURCE 200809L

#include "impl.h"

#include "alloc.h"
#include "file.h"

#include <jansson.h>

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

/* ---- loading: helpers -------------------------------------------------------------------------- */

static bool jbool(const json_t *o, const char *key, bool def)
{
    const json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : def;
}

/* A string member (NULL when absent or null); anything else is an error. */
static enum kr_status jstr(const json_t *o, const char *key, const char *where, const char **out, size_t *len,
                           bool required, struct kr_err *err)
{
    const json_t *v = json_object_get(o, key);
    *out = NULL;
    if (len) {
        *len = 0;
    }
    if (!v || json_is_null(v)) {
        if (required) {
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing string \"%s\"", where, key);
        }
        return KR_OK;
    }
    if (!json_is_string(v)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: \"%s\" must be a string", where, key);
    }
    *out = json_string_value(v);
    if (len) {
        *len = json_string_length(v);
    }
    return KR_OK;
}

/* A single character member (Metaspace replacement, Strip content, ...). */
static enum kr_status jchar(const json_t *o, const char *key, const char *where, uint32_t def, uint32_t *out,
                            struct kr_err *err)
{
    const char *s;
    size_t n;
    enum kr_status st = jstr(o, key, where, &s, &n, false, err);
    if (st != KR_OK) {
        return st;
    }
    if (!s) {
        *out = def;
        return KR_OK;
    }
    uint32_t cp;
    if (n == 0 || kr_utf8_validate(s, n) != n || kr_utf8_next(s, &cp) != n) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: \"%s\" must be a single character", where, key);
    }
    *out = cp;
    return KR_OK;
}

static enum kr_status jsize(const json_t *o, const char *key, const char *where, size_t *out, struct kr_err *err)
{
    const json_t *v = json_object_get(o, key);
    if (!json_is_integer(v) || json_integer_value(v) < 0) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: \"%s\" must be a non-negative integer", where, key);
    }
    *out = (size_t)json_integer_value(v);
    return KR_OK;
}

static const char *jtype(const json_t *o)
{
    const json_t *v = json_object_get(o, "type");
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static enum kr_status parse_pattern(struct kr_tokenizer *t, const json_t *o, const char *where, struct pattern *p,
                                    struct kr_err *err)
{
    const json_t *pat = json_object_get(o, "pattern");
    const json_t *s = json_object_get(pat, "String"), *r = json_object_get(pat, "Regex");
    if (json_is_string(s)) {
        p->lit_len = json_string_length(s);
        p->lit = kr_strndup(json_string_value(s), p->lit_len);
        return p->lit ? KR_OK : KR_ERR_NOMEM;
    }
    if (json_is_string(r)) {
        return tok_compile_regex(t, json_string_value(r), json_string_length(r), &p->re, where, err);
    }
    return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: \"pattern\" must be {\"String\": ...} or {\"Regex\": ...}",
                      where);
}

static void pattern_free(struct pattern *p)
{
    kr_free(p->lit);
    pcre2_code_free(p->re);
}

static enum kr_status parse_behavior(const json_t *o, const char *where, enum split_behavior def,
                                     enum split_behavior *out, struct kr_err *err)
{
    const json_t *v = json_object_get(o, "behavior");
    if (!v) {
        *out = def;
        return KR_OK;
    }
    static const char *names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
    for (int i = 0; i < 5; i++) {
        if (json_is_string(v) && strcmp(json_string_value(v), names[i]) == 0) {
            *out = (enum split_behavior)i;
            return KR_OK;
        }
    }
    return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: unknown split behavior", where);
}

static enum kr_status parse_prepend_scheme(const json_t *o, const char *where, enum prepend_scheme *out,
                                           struct kr_err *err)
{
    const json_t *v = json_object_get(o, "prepend_scheme");
    if (!v) { /* files older than prepend_scheme carry add_prefix_space */
        *out = jbool(o, "add_prefix_space", true) ? PREPEND_ALWAYS : PREPEND_NEVER;
        return KR_OK;
    }
    const char *s = json_is_string(v) ? json_string_value(v) : "";
    if (strcmp(s, "always") == 0) {
        *out = PREPEND_ALWAYS;
    } else if (strcmp(s, "first") == 0) {
        *out = PREPEND_FIRST;
    } else if (strcmp(s, "never") == 0) {
        *out = PREPEND_NEVER;
    } else {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: unknown prepend_scheme", where);
    }
    return KR_OK;
}

static enum kr_status sub_array(const json_t *o, const char *key, const char *where, const json_t **arr,
                                struct kr_err *err)
{
    *arr = json_object_get(o, key);
    if (!json_is_array(*arr)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: \"%s\" must be an array", where, key);
    }
    return KR_OK;
}

static enum kr_status str_member(const json_t *o, const char *key, const char *where, char **out, size_t *len,
                                 struct kr_err *err)
{
    const char *s;
    enum kr_status st = jstr(o, key, where, &s, len, true, err);
    if (st != KR_OK) {
        return st;
    }
    *out = kr_strndup(s, *len);
    return *out ? KR_OK : KR_ERR_NOMEM;
}

/* ---- loading: normalizers, pre-tokenizers, decoders ---------------------------------------------- */

static void normalizer_clear(struct normalizer *nz)
{
    for (size_t i = 0; i < nz->n_sub; i++) {
        normalizer_clear(&nz->sub[i]);
    }
    kr_free(nz->sub);
    kr_free(nz->str);
    pattern_free(&nz->pat);
}

static enum kr_status parse_normalizer(struct kr_tokenizer *t, const json_t *o, const char *where,
                                       struct normalizer *nz, struct kr_err *err)
{
    const char *type = jtype(o);
    if (!type) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing \"type\"", where);
    }
    static const struct { const char *name; enum norm_type type; } simple[] = {
        {"NFC", NORM_NFC}, {"NFD", NORM_NFD}, {"NFKC", NORM_NFKC}, {"NFKD", NORM_NFKD},
        {"Lowercase", NORM_LOWERCASE}, {"StripAccents", NORM_STRIP_ACCENTS}, {"ByteLevel", NORM_BYTE_LEVEL},
    };
    for (size_t i = 0; i < sizeof(simple) / sizeof(simple[0]); i++) {
        if (strcmp(type, simple[i].name) == 0) {
            nz->type = simple[i].type;
            return KR_OK;
        }
    }
    if (strcmp(type, "Strip") == 0) {
        nz->type = NORM_STRIP;
        nz->left = jbool(o, "strip_left", true);
        nz->right = jbool(o, "strip_right", true);
        return KR_OK;
    }
    if (strcmp(type, "Prepend") == 0 || strcmp(type, "Append") == 0) {
        nz->type = type[0] == 'P' ? NORM_PREPEND : NORM_APPEND;
        return str_member(o, type[0] == 'P' ? "prepend" : "append", where, &nz->str, &nz->str_len, err);
    }
    if (strcmp(type, "Replace") == 0) {
        nz->type = NORM_REPLACE;
        enum kr_status st = str_member(o, "content", where, &nz->str, &nz->str_len, err);
        return st == KR_OK ? parse_pattern(t, o, where, &nz->pat, err) : st;
    }
    if (strcmp(type, "Sequence") == 0) {
        nz->type = NORM_SEQUENCE;
        const json_t *arr;
        enum kr_status st = sub_array(o, "normalizers", where, &arr, err);
        if (st != KR_OK) {
            return st;
        }
        nz->sub = kr_calloc(json_array_size(arr) + 1, sizeof(*nz->sub));
        if (!nz->sub) {
            return KR_ERR_NOMEM;
        }
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char w[512];
            snprintf(w, sizeof(w), "%s.normalizers[%zu]", where, i);
            nz->n_sub = i + 1;
            if ((st = parse_normalizer(t, json_array_get(arr, i), w, &nz->sub[i], err)) != KR_OK) {
                return st;
            }
        }
        return KR_OK;
    }
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: %s: unsupported normalizer type \"%s\"", where, type);
}

static void pretok_clear(struct pretok *pt)
{
    for (size_t i = 0; i < pt->n_sub; i++) {
        pretok_clear(&pt->sub[i]);
    }
    kr_free(pt->sub);
    pattern_free(&pt->pat);
}

static const char GPT2_REGEX[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char WHITESPACE_REGEX[] = "\\w+|[^\\w\\s]+";

static enum kr_status parse_pretok(struct kr_tokenizer *t, const json_t *o, const char *where, struct pretok *pt,
                                   struct kr_err *err)
{
    const char *type = jtype(o);
    enum kr_status st = KR_OK;
    if (!type) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing \"type\"", where);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        pt->type = PT_BYTE_LEVEL;
        pt->add_prefix_space = jbool(o, "add_prefix_space", true);
        pt->use_regex = jbool(o, "use_regex", true);
        if (pt->use_regex && !t->re_gpt2) {
            st = tok_compile_regex(t, GPT2_REGEX, strlen(GPT2_REGEX), &t->re_gpt2, where, err);
        }
        return st;
    }
    if (strcmp(type, "Split") == 0) {
        pt->type = PT_SPLIT;
        pt->invert = jbool(o, "invert", false);
        if ((st = parse_behavior(o, where, SPLIT_ISOLATED, &pt->behavior, err)) != KR_OK) {
            return st;
        }
        if (!json_object_get(o, "behavior")) {
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing \"behavior\"", where);
        }
        return parse_pattern(t, o, where, &pt->pat, err);
    }
    if (strcmp(type, "Digits") == 0) {
        pt->type = PT_DIGITS;
        pt->individual_digits = jbool(o, "individual_digits", false);
        return KR_OK;
    }
    if (strcmp(type, "Metaspace") == 0) {
        pt->type = PT_METASPACE;
        pt->split = jbool(o, "split", true);
        if ((st = jchar(o, "replacement", where, 0x2581, &pt->ch, err)) != KR_OK) {
            return st;
        }
        return parse_prepend_scheme(o, where, &pt->prepend, err);
    }
    if (strcmp(type, "Whitespace") == 0) {
        pt->type = PT_WHITESPACE;
        if (!t->re_whitespace) {
            st = tok_compile_regex(t, WHITESPACE_REGEX, strlen(WHITESPACE_REGEX), &t->re_whitespace, where, err);
        }
        return st;
    }
    if (strcmp(type, "WhitespaceSplit") == 0) {
        pt->type = PT_WHITESPACE_SPLIT;
        return KR_OK;
    }
    if (strcmp(type, "Punctuation") == 0) {
        pt->type = PT_PUNCTUATION;
        return parse_behavior(o, where, SPLIT_ISOLATED, &pt->behavior, err);
    }
    if (strcmp(type, "BertPreTokenizer") == 0) {
        pt->type = PT_BERT;
        return KR_OK;
    }
    if (strcmp(type, "CharDelimiterSplit") == 0) {
        pt->type = PT_CHAR_DELIMITER;
        if (!json_object_get(o, "delimiter")) {
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing \"delimiter\"", where);
        }
        return jchar(o, "delimiter", where, 0, &pt->ch, err);
    }
    if (strcmp(type, "Sequence") == 0) {
        pt->type = PT_SEQUENCE;
        const json_t *arr;
        if ((st = sub_array(o, "pretokenizers", where, &arr, err)) != KR_OK) {
            return st;
        }
        pt->sub = kr_calloc(json_array_size(arr) + 1, sizeof(*pt->sub));
        if (!pt->sub) {
            return KR_ERR_NOMEM;
        }
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char w[512];
            snprintf(w, sizeof(w), "%s.pretokenizers[%zu]", where, i);
            pt->n_sub = i + 1;
            if ((st = parse_pretok(t, json_array_get(arr, i), w, &pt->sub[i], err)) != KR_OK) {
                return st;
            }
        }
        return KR_OK;
    }
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: %s: unsupported pre-tokenizer type \"%s\"", where,
                      type);
}

static void decoder_clear(struct decoder *d)
{
    for (size_t i = 0; i < d->n_sub; i++) {
        decoder_clear(&d->sub[i]);
    }
    kr_free(d->sub);
    kr_free(d->str);
    pattern_free(&d->pat);
}

static enum kr_status parse_decoder(struct kr_tokenizer *t, const json_t *o, const char *where, struct decoder *d,
                                    struct kr_err *err)
{
    const char *type = jtype(o);
    enum kr_status st;
    if (!type) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing \"type\"", where);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        d->type = DEC_BYTE_LEVEL;
        return KR_OK;
    }
    if (strcmp(type, "ByteFallback") == 0) {
        d->type = DEC_BYTE_FALLBACK;
        return KR_OK;
    }
    if (strcmp(type, "Fuse") == 0) {
        d->type = DEC_FUSE;
        return KR_OK;
    }
    if (strcmp(type, "Metaspace") == 0) {
        d->type = DEC_METASPACE;
        if ((st = jchar(o, "replacement", where, 0x2581, &d->ch, err)) != KR_OK) {
            return st;
        }
        return parse_prepend_scheme(o, where, &d->prepend, err);
    }
    if (strcmp(type, "Replace") == 0) {
        d->type = DEC_REPLACE;
        if ((st = str_member(o, "content", where, &d->str, &d->str_len, err)) != KR_OK) {
            return st;
        }
        return parse_pattern(t, o, where, &d->pat, err);
    }
    if (strcmp(type, "Strip") == 0) {
        d->type = DEC_STRIP;
        if ((st = jchar(o, "content", where, ' ', &d->ch, err)) != KR_OK ||
            (st = jsize(o, "start", where, &d->start, err)) != KR_OK) {
            return st;
        }
        return jsize(o, "stop", where, &d->stop, err);
    }
    if (strcmp(type, "BPEDecoder") == 0) {
        d->type = DEC_BPE;
        const char *s;
        size_t n;
        if ((st = jstr(o, "suffix", where, &s, &n, false, err)) != KR_OK) {
            return st;
        }
        d->str = kr_strndup(s ? s : "</w>", s ? n : 4);
        d->str_len = s ? n : 4;
        return d->str ? KR_OK : KR_ERR_NOMEM;
    }
    if (strcmp(type, "Sequence") == 0) {
        d->type = DEC_SEQUENCE;
        const json_t *arr;
        if ((st = sub_array(o, "decoders", where, &arr, err)) != KR_OK) {
            return st;
        }
        d->sub = kr_calloc(json_array_size(arr) + 1, sizeof(*d->sub));
        if (!d->sub) {
            return KR_ERR_NOMEM;
        }
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char w[512];
            snprintf(w, sizeof(w), "%s.decoders[%zu]", where, i);
            d->n_sub = i + 1;
            if ((st = parse_decoder(t, json_array_get(arr, i), w, &d->sub[i], err)) != KR_OK) {
                return st;
            }
        }
        return KR_OK;
    }
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: %s: unsupported decoder type \"%s\"", where, type);
}

/* ---- loading: post-processor ----------------------------------------------------------------------- */

static void post_clear(struct postproc *pp)
{
    for (size_t i = 0; i < pp->n_sub; i++) {
        post_clear(&pp->sub[i]);
    }
    kr_free(pp->sub);
    for (size_t i = 0; i < pp->n_items; i++) {
        kr_free(pp->items[i].ids);
    }
    kr_free(pp->items);
}

static enum kr_status post_add_item(struct postproc *pp, bool is_seq, const int32_t *ids, size_t n)
{
    struct post_item *v = kr_realloc(pp->items, (pp->n_items + 1) * sizeof(*v));
    if (!v) {
        return KR_ERR_NOMEM;
    }
    pp->items = v;
    struct post_item *it = &v[pp->n_items++];
    *it = (struct post_item){is_seq, NULL, n};
    if (n) {
        it->ids = kr_malloc(n * sizeof(int32_t));
        if (!it->ids) {
            it->n_ids = 0;
            return KR_ERR_NOMEM;
        }
        memcpy(it->ids, ids, n * sizeof(int32_t));
    }
    pp->is_template = true;
    return KR_OK;
}

/* ["</s>", 2] pairs of RobertaProcessing / BertProcessing. */
static enum kr_status pair_id(const json_t *o, const char *key, const char *where, int32_t *id, struct kr_err *err)
{
    const json_t *v = json_object_get(o, key);
    const json_t *i = json_array_get(v, 1);
    if (!json_is_array(v) || !json_is_integer(i)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: \"%s\" must be [token, id]", where, key);
    }
    *id = (int32_t)json_integer_value(i);
    return KR_OK;
}

static enum kr_status parse_post(const json_t *o, const char *where, struct postproc *pp, struct kr_err *err)
{
    const char *type = jtype(o);
    enum kr_status st;
    if (!type) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: missing \"type\"", where);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        return KR_OK;
    }
    if (strcmp(type, "RobertaProcessing") == 0 || strcmp(type, "BertProcessing") == 0) {
        int32_t cls = -1, sep = -1;
        if ((st = pair_id(o, "cls", where, &cls, err)) != KR_OK || (st = pair_id(o, "sep", where, &sep, err)) != KR_OK) {
            return st;
        }
        if ((st = post_add_item(pp, false, &cls, 1)) != KR_OK || (st = post_add_item(pp, true, NULL, 0)) != KR_OK) {
            return st;
        }
        return post_add_item(pp, false, &sep, 1);
    }
    if (strcmp(type, "TemplateProcessing") == 0) {
        const json_t *single, *specials = json_object_get(o, "special_tokens");
        if ((st = sub_array(o, "single", where, &single, err)) != KR_OK) {
            return st;
        }
        for (size_t i = 0; i < json_array_size(single); i++) {
            const json_t *it = json_array_get(single, i);
            const json_t *sp = json_object_get(json_object_get(it, "SpecialToken"), "id");
            if (json_object_get(it, "Sequence")) {
                const json_t *sid = json_object_get(json_object_get(it, "Sequence"), "id");
                if (!json_is_string(sid) || strcmp(json_string_value(sid), "A") != 0) {
                    return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s.single[%zu]: a single-sequence "
                                      "template can only use sequence A", where, i);
                }
                st = post_add_item(pp, true, NULL, 0);
            } else if (json_is_string(sp)) {
                const json_t *def = json_object_get(specials, json_string_value(sp));
                const json_t *ids = json_object_get(def, "ids");
                if (!json_is_array(ids)) {
                    return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: special token \"%s\" is not defined "
                                      "in special_tokens", where, json_string_value(sp));
                }
                size_t n = json_array_size(ids);
                int32_t tmp[64];
                if (n > 64) {
                    return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: %s: special token \"%s\" has more "
                                      "than 64 ids", where, json_string_value(sp));
                }
                for (size_t k = 0; k < n; k++) {
                    const json_t *x = json_array_get(ids, k);
                    if (!json_is_integer(x)) {
                        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s: special token \"%s\": ids must "
                                          "be integers", where, json_string_value(sp));
                    }
                    tmp[k] = (int32_t)json_integer_value(x);
                }
                st = post_add_item(pp, false, tmp, n);
            } else {
                return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: %s.single[%zu]: expected SpecialToken or "
                                  "Sequence", where, i);
            }
            if (st != KR_OK) {
                return st;
            }
        }
        pp->is_template = true;
        return KR_OK;
    }
    if (strcmp(type, "Sequence") == 0) {
        const json_t *arr;
        if ((st = sub_array(o, "processors", where, &arr, err)) != KR_OK) {
            return st;
        }
        pp->sub = kr_calloc(json_array_size(arr) + 1, sizeof(*pp->sub));
        if (!pp->sub) {
            return KR_ERR_NOMEM;
        }
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char w[512];
            snprintf(w, sizeof(w), "%s.processors[%zu]", where, i);
            pp->n_sub = i + 1;
            if ((st = parse_post(json_array_get(arr, i), w, &pp->sub[i], err)) != KR_OK) {
                return st;
            }
        }
        return KR_OK;
    }
    return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: %s: unsupported post-processor type \"%s\"", where,
                      type);
}

/* ---- loading: model ------------------------------------------------------------------------------ */

static void init_byte_alphabet(struct kr_tokenizer *t)
{
    /* GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the others to 256 + k. */
    int k = 0;
    for (int i = 0; i < 0x144; i++) {
        t->char_byte[i] = -1;
    }
    for (int b = 0; b < 256; b++) {
        bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        uint32_t cp = keep ? (uint32_t)b : (uint32_t)(256 + k++);
        char tmp[4];
        size_t l = kr_utf8_put(cp, tmp);
        memcpy(t->bytes_char[b], tmp, l);
        t->bytes_char_len[b] = (uint8_t)l;
        t->char_byte[cp] = (int16_t)b;
    }
}

static enum kr_status load_bpe(struct kr_tokenizer *t, const json_t *model, struct kr_err *err)
{
    const char *type = jtype(model);
    enum kr_status st;
    if (!json_is_object(model)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: missing \"model\" object");
    }
    if (type ? strcmp(type, "BPE") != 0 : !json_object_get(model, "merges")) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: model: unsupported model type \"%s\" (only BPE "
                          "is implemented)", type ? type : "(untyped)");
    }
    const json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout) && !(json_is_number(dropout) && json_number_value(dropout) == 0.0)) {
        return kr_err_set(err, KR_ERR_UNSUPPORTED, "tokenizer.json: model: BPE dropout is a training option and "
                          "is not supported");
    }
    const json_t *vocab = json_object_get(model, "vocab"), *merges = json_object_get(model, "merges");
    if (!json_is_object(vocab)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.vocab: expected an object of token -> id");
    }
    if (!json_is_array(merges)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.merges: expected an array");
    }
    size_t total = 0, n = json_object_size(vocab);
    const char *key;
    const json_t *val;
    int64_t max_id = -1;
    json_object_foreach((json_t *)vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 || json_integer_value(val) >= INT32_MAX) {
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.vocab[\"%.64s\"]: id must be an integer "
                              "in [0, 2^31-1)", key);
        }
        if (json_integer_value(val) > max_id) {
            max_id = json_integer_value(val);
        }
        total += strlen(key) + 1;
    }
    t->pool = kr_malloc(total + 1);
    if (!t->pool || (st = tok_smap_init(&t->vocab, n)) != KR_OK) {
        return KR_ERR_NOMEM;
    }
    char *w = t->pool;
    json_object_foreach((json_t *)vocab, key, val) {
        size_t l = strlen(key);
        memcpy(w, key, l + 1);
        if ((st = tok_smap_put(&t->vocab, w, l, (int32_t)json_integer_value(val))) != KR_OK) {
            return st;
        }
        w += l + 1;
    }
    t->n_ids = (int32_t)(max_id + 1);

    const char *s;
    size_t l;
    t->unk_id = -1;
    if ((st = jstr(model, "unk_token", "model", &s, &l, false, err)) != KR_OK) {
        return st;
    }
    if (s && !tok_smap_get(&t->vocab, s, l, &t->unk_id)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.unk_token \"%.64s\" is not in the vocabulary", s);
    }
    if ((st = jstr(model, "continuing_subword_prefix", "model", &s, &l, false, err)) != KR_OK) {
        return st;
    }
    if (s && !(t->cont_prefix = kr_strndup(s, l))) {
        return KR_ERR_NOMEM;
    }
    t->cont_prefix_len = l;
    if ((st = jstr(model, "end_of_word_suffix", "model", &s, &l, false, err)) != KR_OK) {
        return st;
    }
    if (s && !(t->eow_suffix = kr_strndup(s, l))) {
        return KR_ERR_NOMEM;
    }
    t->eow_suffix_len = l;
    /* merges */
    size_t nm = json_array_size(merges);
    size_t cap = 16;
    while (cap < nm * 2) {
        cap *= 2;
    }
    t->merges.slots = kr_calloc(cap, sizeof(*t->merges.slots));
    if (!t->merges.slots) {
        return KR_ERR_NOMEM;
    }
    t->merges.cap = cap;
    struct kr_buf_s cat = {0};
    for (size_t i = 0; i < nm; i++) {
        const json_t *m = json_array_get(merges, i);
        const char *a, *b;
        size_t la, lb;
        if (json_is_string(m)) {
            a = json_string_value(m);
            const char *sp = memchr(a, ' ', json_string_length(m));
            if (!sp) {
                kr_bs_free(&cat);
                return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.merges[%zu]: \"%.64s\" is not \"a b\"",
                                  i, a);
            }
            la = (size_t)(sp - a);
            b = sp + 1;
            lb = json_string_length(m) - la - 1;
        } else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
                   json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            la = json_string_length(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            lb = json_string_length(json_array_get(m, 1));
        } else {
            kr_bs_free(&cat);
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.merges[%zu]: expected \"a b\" or [a, b]", i);
        }
        int32_t ia, ib, inew;
        cat.len = 0;
        kr_bs_append(&cat, a, la);
        /* HF builds the merged token as a + b[len(continuing_subword_prefix)..] */
        size_t skip = t->cont_prefix_len;
        if (skip > lb) {
            kr_bs_free(&cat);
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.merges[%zu]: \"%.*s\" is shorter than the "
                              "continuing_subword_prefix", i, (int)(lb > 64 ? 64 : lb), b);
        }
        kr_bs_append(&cat, b + skip, lb - skip);
        if (cat.oom || !cat.p) { /* a merged token missing a piece would be refused, or be another */
            kr_bs_free(&cat);
            return kr_err_set(err, KR_ERR_NOMEM, "tokenizer.json: out of memory building the merges");
        }
        if (!tok_smap_get(&t->vocab, a, la, &ia) || !tok_smap_get(&t->vocab, b, lb, &ib) ||
            !tok_smap_get(&t->vocab, cat.p, cat.len, &inew)) {
            st = kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: model.merges[%zu]: \"%.*s\" + \"%.*s\": a token "
                            "of this merge is not in the vocabulary", i, (int)(la > 64 ? 64 : la), a,
                            (int)(lb > 64 ? 64 : lb), b);
            kr_bs_free(&cat);
            return st;
        }
        uint64_t k = (((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib) + 1;
        struct mmap_slot *slot = tok_mmap_find(&t->merges, k);
        if (!slot->key) {
            t->merges.n++;
        }
        *slot = (struct mmap_slot){k, (int32_t)i, inew};
    }
    kr_bs_free(&cat);

    t->fuse_unk = jbool(model, "fuse_unk", false);
    t->byte_fallback = jbool(model, "byte_fallback", false);
    t->ignore_merges = jbool(model, "ignore_merges", false);
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof(name), "<0x%02X>", b);
        if (!tok_smap_get(&t->vocab, name, 6, &t->byte_ids[b])) {
            t->byte_ids[b] = -1;
        }
    }
    return KR_OK;
}

static enum kr_status load_added(struct kr_tokenizer *t, const json_t *arr, struct kr_err *err)
{
    if (!arr || json_is_null(arr)) {
        return KR_OK;
    }
    if (!json_is_array(arr)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: \"added_tokens\" must be an array");
    }
    size_t n = json_array_size(arr);
    t->added = kr_calloc(n + 1, sizeof(*t->added));
    if (!t->added || tok_smap_init(&t->added_map, n) != KR_OK) {
        return KR_ERR_NOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *o = json_array_get(arr, i);
        const json_t *id = json_object_get(o, "id");
        const json_t *content = json_object_get(o, "content");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= INT32_MAX ||
            !json_is_string(content)) {
            return kr_err_set(err, KR_ERR_FORMAT, "tokenizer.json: added_tokens[%zu]: needs an integer \"id\" and a "
                              "string \"content\"", i);
        }
        struct added_token *at = &t->added[t->n_added];
        at->len = json_string_length(content);
        if (at->len == 0) {
            continue; /* HF ignores empty added tokens */
        }
        at->content = kr_strndup(json_string_value(content), at->len);
        if (!at->content) {
            return KR_ERR_NOMEM;
        }
        t->n_added++;
        at->special = jbool(o, "special", false);
        at->lstrip = jbool(o, "lstrip", false);
        at->rstrip = jbool(o, "rstrip", false);
        at->single_word = jbool(o, "single_word", false);
        at->normalized = jbool(o, "normalized", !at->special);
        int32_t vid;
        /* HF gives an added token the id its content already has in the vocabulary */
        at->id = tok_smap_get(&t->added_map, at->content, at->len, &vid) ? vid
                 : tok_smap_get(&t->vocab, at->content, at->len, &vid) ? vid
                                                                   : (int32_t)json_integer_value(id);
        if (tok_smap_put(&t->added_map, at->content, at->len, at->id) != KR_OK) {
            return KR_ERR_NOMEM;
        }
        if (at->id >= t->n_ids) {
            t->n_ids = at->id + 1;
        }
    }
    return KR_OK;
}

/* Builds the id tables and the two added-token tries (special tokens first, as HF orders them). */
static enum kr_status build_tables(struct kr_tokenizer *t, struct kr_err *err)
{
    size_t n = (size_t)(t->n_ids > 0 ? t->n_ids : 1);
    t->id_str = kr_calloc(n, sizeof(*t->id_str));
    t->id_len = kr_calloc(n, sizeof(*t->id_len));
    t->id_special = kr_calloc(n, sizeof(*t->id_special));
    if (!t->id_str || !t->id_len || !t->id_special) {
        return KR_ERR_NOMEM;
    }
    for (size_t i = 0; i < t->vocab.cap; i++) {
        const struct smap_slot *s = &t->vocab.slots[i];
        if (s->key) {
            t->id_str[s->val] = s->key;
            t->id_len[s->val] = s->len;
        }
    }
    struct smap special = {0};
    enum kr_status st = tok_smap_init(&special, t->n_added + 1);
    for (size_t i = 0; i < t->n_added && st == KR_OK; i++) {
        const struct added_token *at = &t->added[i];
        t->id_str[at->id] = at->content;
        t->id_len[at->id] = (uint32_t)at->len;
        if (at->special) {
            st = tok_smap_put(&special, at->content, at->len, 1);
        }
    }
    for (int32_t i = 0; i < t->n_ids && st == KR_OK; i++) {
        int32_t one;
        t->id_special[i] = t->id_str[i] && tok_smap_get(&special, t->id_str[i], t->id_len[i], &one);
    }
    kr_free(special.slots);
    if (st != KR_OK) {
        return st;
    }
    /* normalized tokens are matched in their normalized form */
    struct ctx c = {.t = t, .err = err};
    st = tok_rx_open(&c.rx, t, err);
    for (int pass = 0; pass < 2 && st == KR_OK; pass++) {
        for (size_t i = 0; i < t->n_added && st == KR_OK; i++) {
            struct added_token *at = &t->added[i];
            if (at->special != (pass == 0)) {
                continue;
            }
            if (!at->normalized) {
                at->match = at->content;
                at->match_len = at->len;
                st = tok_trie_insert(&t->trie_raw, at->match, at->match_len, (int32_t)i);
                continue;
            }
            const char *s = at->content;
            size_t l = at->len;
            if (t->norm) {
                st = tok_normalize(&c, t->norm, &s, &l);
            }
            if (st == KR_OK) {
                at->match = kr_strndup(s, l);
                at->match_len = l;
                st = at->match ? tok_trie_insert(&t->trie_norm, at->match, l, (int32_t)i) : KR_ERR_NOMEM;
            }
        }
    }
    kr_free(c.ranges.v);
    kr_bs_free(&c.buf);
    tok_arena_free(&c.arena);
    tok_rx_close(&c.rx);
    return st;
}

/* ---- loading: tokenizer_config.json ------------------------------------------------------------- */

static int32_t lookup_id(const struct kr_tokenizer *t, const char *s, size_t n)
{
    int32_t id;
    if (tok_smap_get(&t->added_map, s, n, &id) || tok_smap_get(&t->vocab, s, n, &id)) {
        return id;
    }
    return -1;
}

/* A special token entry of tokenizer_config.json: a string or {"content": ...}; NULL when null. */
static const char *config_token(const json_t *cfg, const char *key)
{
    const json_t *v = json_object_get(cfg, key);
    if (json_is_object(v)) {
        v = json_object_get(v, "content");
    }
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static enum kr_status load_config(struct kr_tokenizer *t, const json_t *cfg, struct kr_err *err)
{
    const char *bos = config_token(cfg, "bos_token"), *eos = config_token(cfg, "eos_token");
    if ((bos && !(t->bos_token = kr_strdup(bos))) || (eos && !(t->eos_token = kr_strdup(eos)))) {
        return KR_ERR_NOMEM;
    }
    t->bos_id = bos ? lookup_id(t, bos, strlen(bos)) : -1;
    t->eos_id = eos ? lookup_id(t, eos, strlen(eos)) : -1;
    const json_t *tpl = json_object_get(cfg, "chat_template");
    if (json_is_array(tpl)) {
        const json_t *found = NULL;
        for (size_t i = 0; i < json_array_size(tpl); i++) {
            const json_t *e = json_array_get(tpl, i);
            const json_t *name = json_object_get(e, "name");
            if (json_is_string(name) && strcmp(json_string_value(name), "default") == 0) {
                found = json_object_get(e, "template");
            }
        }
        tpl = found;
    }
    if (json_is_string(tpl) && !(t->chat_template = kr_strdup(json_string_value(tpl)))) {
        return KR_ERR_NOMEM;
    }
    /* transformers (TokenizersBackend.update_post_processor): an explicit add_bos_token /
     * add_eos_token replaces the post-processor by "[bos] $A [eos]". */
    const json_t *ab = json_object_get(cfg, "add_bos_token"), *ae = json_object_get(cfg, "add_eos_token");
    if (!ab && !ae) {
        return KR_OK;
    }
    bool add_bos = json_is_true(ab) && bos, add_eos = json_is_true(ae) && eos;
    if ((add_bos && t->bos_id < 0) || (add_eos && t->eos_id < 0)) {
        return kr_err_set(err, KR_ERR_FORMAT, "tokenizer_config.json: %s \"%s\" is not a token of tokenizer.json",
                          add_bos && t->bos_id < 0 ? "bos_token" : "eos_token",
                          add_bos && t->bos_id < 0 ? bos : eos);
    }
    if (t->post) {
        post_clear(t->post);
        memset(t->post, 0, sizeof(*t->post));
    } else if (!(t->post = kr_calloc(1, sizeof(*t->post)))) {
        return KR_ERR_NOMEM;
    }
    enum kr_status st = KR_OK;
    if (add_bos) {
        st = post_add_item(t->post, false, &t->bos_id, 1);
    }
    if (st == KR_OK) {
        st = post_add_item(t->post, true, NULL, 0);
    }
    if (st == KR_OK && add_eos) {
        st = post_add_item(t->post, false, &t->eos_id, 1);
    }
    return st;
}

/* ---- loading: entry points ---------------------------------------------------------------------- */

void kr_tokenizer_free(struct kr_tokenizer *t)
{
    if (!t) {
        return;
    }
    kr_free(t->pool);
    kr_free(t->vocab.slots);
    kr_free(t->id_str);
    kr_free(t->id_len);
    kr_free(t->id_special);
    kr_free(t->merges.slots);
    kr_free(t->cont_prefix);
    kr_free(t->eow_suffix);
    for (size_t i = 0; i < t->n_added; i++) {
        if (t->added[i].match != t->added[i].content) {
            kr_free(t->added[i].match);
        }
        kr_free(t->added[i].content);
    }
    kr_free(t->added);
    kr_free(t->added_map.slots);
    kr_free(t->trie_raw.nodes);
    kr_free(t->trie_norm.nodes);
    if (t->norm) {
        normalizer_clear(t->norm);
        kr_free(t->norm);
    }
    if (t->pretok) {
        pretok_clear(t->pretok);
        kr_free(t->pretok);
    }
    if (t->dec) {
        decoder_clear(t->dec);
        kr_free(t->dec);
    }
    if (t->post) {
        post_clear(t->post);
        kr_free(t->post);
    }
    pcre2_code_free(t->re_gpt2);
    pcre2_code_free(t->re_whitespace);
    pcre2_general_context_free(t->gctx);
    kr_free(t->bos_token);
    kr_free(t->eos_token);
    kr_free(t->chat_template);
    kr_free(t);
}

static enum kr_status parse_json(const char *text, size_t len, const char *name, size_t flags, json_t **out,
                                 struct kr_err *err)
{
    json_error_t je;
    const uint64_t failed = kr_alloc_thread_failures();
    kr_alloc_shield(1); /* jansson's lexer overflows its buffer when a growth fails (kr_alloc_shield) */
    *out = json_loadb(text, len, JSON_ALLOW_NUL | flags, &je);
    kr_alloc_shield(0);
    /* jansson 2.14 reports some failed allocations as syntax errors, and drops the byte it was saving
     * when a string buffer cannot grow (a parse that succeeds with a damaged string): the allocations
     * that failed on this thread decide (kr_oai_json_loadb) */
    if (kr_alloc_thread_failures() != failed || (!*out && json_error_code(&je) == json_error_out_of_memory)) {
        json_decref(*out);
        *out = NULL;
        return kr_err_set(err, KR_ERR_NOMEM, "%s: out of memory while parsing", name);
    }
    if (!*out) {
        return kr_err_set(err, KR_ERR_FORMAT, "%s: line %d column %d: %s", name, je.line, je.column, je.text);
    }
    if (!json_is_object(*out)) {
        json_decref(*out);
        *out = NULL;
        return kr_err_set(err, KR_ERR_FORMAT, "%s: the top level must be an object", name);
    }
    return KR_OK;
}

enum kr_status kr_tokenizer_load_mem(const char *json, size_t len, const char *config_json, size_t config_len,
                                     struct kr_tokenizer **out, struct kr_err *err)
{
    json_t *root = NULL, *cfg = NULL;
    struct kr_tokenizer *t = NULL;
    enum kr_status st;
    *out = NULL;
    if ((st = parse_json(json, len, "tokenizer.json", 0, &root, err)) != KR_OK) {
        goto fail;
    }
    if (config_json && (st = parse_json(config_json, config_len, "tokenizer_config.json",
                                  JSON_DECODE_INT_AS_REAL /* model_max_length can exceed int64 */, &cfg, err)) != KR_OK) {
        goto fail;
    }
    st = KR_ERR_NOMEM;
    t = kr_calloc(1, sizeof(*t));
    if (!t || !(t->gctx = pcre2_general_context_create(tok_pcre_malloc, tok_pcre_free, NULL))) {
        goto fail;
    }
    t->bos_id = t->eos_id = t->unk_id = -1;
    init_byte_alphabet(t);
    if ((st = load_bpe(t, json_object_get(root, "model"), err)) != KR_OK) {
        goto fail;
    }
    const json_t *v = json_object_get(root, "normalizer");
    if (v && !json_is_null(v)) {
        st = KR_ERR_NOMEM;
        if (!(t->norm = kr_calloc(1, sizeof(*t->norm))) || (st = parse_normalizer(t, v, "normalizer", t->norm, err)) != KR_OK) {
            goto fail;
        }
    }
    v = json_object_get(root, "pre_tokenizer");
    if (v && !json_is_null(v)) {
        st = KR_ERR_NOMEM;
        if (!(t->pretok = kr_calloc(1, sizeof(*t->pretok))) ||
            (st = parse_pretok(t, v, "pre_tokenizer", t->pretok, err)) != KR_OK) {
            goto fail;
        }
    }
    v = json_object_get(root, "decoder");
    if (v && !json_is_null(v)) {
        st = KR_ERR_NOMEM;
        if (!(t->dec = kr_calloc(1, sizeof(*t->dec))) || (st = parse_decoder(t, v, "decoder", t->dec, err)) != KR_OK) {
            goto fail;
        }
    }
    v = json_object_get(root, "post_processor");
    if (v && !json_is_null(v)) {
        st = KR_ERR_NOMEM;
        if (!(t->post = kr_calloc(1, sizeof(*t->post))) ||
            (st = parse_post(v, "post_processor", t->post, err)) != KR_OK) {
            goto fail;
        }
    }
    if ((st = load_added(t, json_object_get(root, "added_tokens"), err)) != KR_OK ||
        (st = build_tables(t, err)) != KR_OK) {
        goto fail;
    }
    if (cfg && (st = load_config(t, cfg, err)) != KR_OK) {
        goto fail;
    }
    tok_stream_setup(t);
    json_decref(root);
    json_decref(cfg);
    *out = t;
    return KR_OK;
fail:
    if (st == KR_ERR_NOMEM) {
        kr_err_set(err, st, "tokenizer: out of memory while loading");
    }
    json_decref(root);
    json_decref(cfg);
    kr_tokenizer_free(t);
    return st;
}

/* The largest tokenizer file read (tokenizer.json of large vocabularies is tens of MB; the limit
 * only stops a wrong path from reading something huge). */
#define KR_TOK_FILE_MAX ((size_t)1 << 30)

static bool file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

enum kr_status kr_tokenizer_load(const char *path, const char *config_path, struct kr_tokenizer **out,
                                 struct kr_err *err)
{
    struct stat sb;
    char *tok_path = NULL, *cfg_path = NULL, *tpl_path = NULL, *text = NULL, *cfg = NULL, *tpl = NULL;
    size_t len = 0, cfg_len = 0, tpl_len = 0;
    enum kr_status st = KR_ERR_NOMEM;
    *out = NULL;
    if (stat(path, &sb) != 0) {
        return kr_err_set(err, KR_ERR_IO, "%s: %s", path, strerror(errno));
    }
    size_t pl = strlen(path);
    char *dir = kr_strdup(path);
    if (!dir) {
        goto fail;
    }
    if (S_ISDIR(sb.st_mode)) {
        tok_path = kr_malloc(pl + 32);
        if (!tok_path) {
            goto fail;
        }
        snprintf(tok_path, pl + 32, "%s/tokenizer.json", path);
    } else {
        tok_path = kr_strdup(path);
        char *slash = strrchr(dir, '/');
        if (!tok_path) {
            goto fail;
        }
        if (slash) {
            *slash = '\0';
        } else {
            strcpy(dir, ".");
        }
    }
    if (config_path) {
        cfg_path = kr_strdup(config_path);
    } else {
        cfg_path = kr_malloc(strlen(dir) + 32);
        if (cfg_path) {
            snprintf(cfg_path, strlen(dir) + 32, "%s/tokenizer_config.json", dir);
        }
    }
    tpl_path = kr_malloc(strlen(dir) + 32);
    if (!cfg_path || !tpl_path) {
        goto fail;
    }
    snprintf(tpl_path, strlen(dir) + 32, "%s/chat_template.jinja", dir);
    if ((st = kr_file_read(tok_path, KR_TOK_FILE_MAX, &text, &len, err)) != KR_OK) {
        goto fail;
    }
    if ((config_path || file_exists(cfg_path)) &&
        (st = kr_file_read(cfg_path, KR_TOK_FILE_MAX, &cfg, &cfg_len, err)) != KR_OK) {
        goto fail;
    }
    if ((st = kr_tokenizer_load_mem(text, len, cfg, cfg_len, out, err)) != KR_OK) {
        kr_err_prefix(err, "%s", tok_path);
        goto fail;
    }
    /* transformers >= 4.43 may keep the template in its own file */
    if (!(*out)->chat_template && file_exists(tpl_path)) {
        if ((st = kr_file_read(tpl_path, KR_TOK_FILE_MAX, &tpl, &tpl_len, err)) != KR_OK) {
            kr_tokenizer_free(*out);
            *out = NULL;
            goto fail;
        }
        (*out)->chat_template = tpl;
        tpl = NULL;
    }
    st = KR_OK;
fail:
    if (st == KR_ERR_NOMEM) {
        /* what ran out, named by the step that found it, else where */
        if (err && err->msg[0]) {
            if (!strstr(err->msg, path)) {
                kr_err_prefix(err, "%s", path);
            }
        } else {
            kr_err_set(err, st, "%s: out of memory while loading the tokenizer", path);
        }
    }
    kr_free(dir);
    kr_free(tok_path);
    kr_free(cfg_path);
    kr_free(tpl_path);
    kr_free(text);
    kr_free(cfg);
    kr_free(tpl);
    return st;
}

/* ---- lookups ---------------------------------------------------------------------------------------- */

/* How many times a normalizer may shrink a text (0: without bound). Unicode normalization and case
 * mapping shrink a text at most threefold in UTF-8 bytes (composing a Hangul syllable from its
 * jamo); 4 leaves room. Prepending or appending only adds. */
static size_t norm_shrink(const struct normalizer *nz)
{
    if (!nz) {
        return 1;
    }
    switch (nz->type) {
    case NORM_NFC:
    case NORM_NFD:
    case NORM_NFKC:
    case NORM_NFKD:
    case NORM_LOWERCASE:
        return 4;
    case NORM_PREPEND:
    case NORM_APPEND:
    case NORM_BYTE_LEVEL:
        return 1;
    case NORM_REPLACE: /* a literal replaced by a non-empty text shrinks by at most their ratio */
        if (!nz->pat.re && nz->pat.lit_len > 0 && nz->str_len > 0) {
            return (nz->pat.lit_len + nz->str_len - 1) / nz->str_len;
        }
        return 0;
    case NORM_SEQUENCE: {
        size_t f = 1;
        for (size_t i = 0; i < nz->n_sub && f; i++) {
            const size_t g = norm_shrink(&nz->sub[i]);
            f = g && f <= SIZE_MAX / g ? f * g : 0;
        }
        return f;
    }
    default: /* STRIP, STRIP_ACCENTS, REPLACE: may drop any amount of text */
        return 0;
    }
}

/* Whether a pre-tokenizer keeps every byte of its input in some piece. */
static bool pretok_keeps_all(const struct pretok *pt)
{
    if (!pt) {
        return true;
    }
    switch (pt->type) {
    case PT_BYTE_LEVEL:
    case PT_DIGITS:
    case PT_METASPACE:
        return true;
    case PT_SPLIT:
    case PT_PUNCTUATION:
        return pt->behavior != SPLIT_REMOVED;
    case PT_SEQUENCE:
        for (size_t i = 0; i < pt->n_sub; i++) {
            if (!pretok_keeps_all(&pt->sub[i])) {
                return false;
            }
        }
        return true;
    default: /* WHITESPACE, WHITESPACE_SPLIT, BERT, CHAR_DELIMITER drop whitespace or the delimiter */
        return false;
    }
}

size_t kr_tokenizer_max_bytes_per_token(const struct kr_tokenizer *t)
{
    const size_t shrink = norm_shrink(t->norm);
    bool all_bytes = t->byte_fallback; /* unknown text becomes <0xXX> tokens, never a (fused) unknown */
    for (int b = 0; b < 256 && all_bytes; b++) {
        all_bytes = t->byte_ids[b] >= 0;
    }
    if (!shrink || !pretok_keeps_all(t->pretok) || (t->unk_id >= 0 && t->fuse_unk && !all_bytes)) {
        return 0;
    }
    size_t longest = 4; /* an unknown character */
    for (size_t i = 0; i < t->n_added; i++) {
        if (t->added[i].lstrip || t->added[i].rstrip) {
            return 0; /* it takes any run of whitespace beside it */
        }
        longest = t->added[i].len > longest ? t->added[i].len : longest;
        longest = t->added[i].match_len > longest ? t->added[i].match_len : longest;
    }
    for (int32_t id = 0; id < t->n_ids; id++) {
        longest = t->id_str[id] && t->id_len[id] > longest ? t->id_len[id] : longest;
    }
    /* a piece of the vocabulary stands for at most as many input bytes as it has (byte-level and
     * Metaspace alphabets spell a byte with one or more), plus a continuation prefix or
     * end-of-word suffix it does not spell */
    longest += t->cont_prefix_len + t->eow_suffix_len;
    return longest <= SIZE_MAX / shrink ? longest * shrink : 0;
}

int32_t kr_tokenizer_n_vocab(const struct kr_tokenizer *t)
{
    return t->n_ids;
}

const char *kr_tokenizer_id_to_piece(const struct kr_tokenizer *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_ids || !t->id_str[id]) {
        return NULL;
    }
    if (len) {
        *len = t->id_len[id];
    }
    return t->id_str[id];
}

int32_t kr_tokenizer_piece_to_id(const struct kr_tokenizer *t, const char *piece, size_t len)
{
    return lookup_id(t, piece, len);
}

bool kr_tokenizer_is_special(const struct kr_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_ids && t->id_special[id];
}

int32_t kr_tokenizer_bos_id(const struct kr_tokenizer *t)
{
    return t->bos_id;
}

int32_t kr_tokenizer_eos_id(const struct kr_tokenizer *t)
{
    return t->eos_id;
}

const char *kr_tokenizer_bos_token(const struct kr_tokenizer *t)
{
    return t->bos_token;
}

const char *kr_tokenizer_eos_token(const struct kr_tokenizer *t)
{
    return t->eos_token;
}

const char *kr_tokenizer_chat_template(const struct kr_tokenizer *t)
{
    return t->chat_template;
}
