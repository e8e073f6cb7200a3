/* Fuzz harness: a request body as the server prepares it (server/session.c kr_sess_prepare, which
 * parses it with api/openai-parse.c kr_oai_parse and validates every field), for each endpoint
 * that takes one: POST /v1/completions, /v1/chat/completions, /v1/responses, /tokenize and
 * /detokenize. The
 * environment is the default model's (models/tiny-hybrid: its tokenizer, chat template and
 * vocabulary for constrained decoding), loaded once; jansson allocates through kr_malloc as in
 * krait, and each preparation runs under a 64 MiB request-memory limit. A prepared request is
 * started against an engine that refuses it (queue full), so that the answer, an OpenAI error
 * object, is built too. Every answer, success or error, must be one JSON object with a status that
 * fits it. */
/* fuzz-max-len: 8192 (tools/fuzz.sh passes it as -max_len) */
#include "fuzz.h"

#include "alloc.h"
#include "chat.h"
#include "grammar.h"
#include "log.h"
#include "metrics.h"
#include "session.h"
#include "tokenizer.h"

#include <jansson.h>
#include <stdint.h>
#include <string.h>

static struct kr_tokenizer *g_tok;
static struct kr_chat *g_chat;
static struct kr_grammar_vocab *g_gvocab;
static struct kr_metrics g_met;
static struct kr_sess_env g_env;

static enum kr_status refuse_submit(void *ctx, const struct kr_request_params *p, uint64_t *req_id, struct kr_err *err)
{
    (void)ctx;
    (void)p;
    (void)req_id;
    snprintf(err->msg, sizeof err->msg, "the queue is full");
    return KR_ERR_BUSY;
}

static void no_cancel(void *ctx, uint64_t req_id)
{
    (void)ctx;
    (void)req_id;
}

static void no_cancel_choice(void *ctx, uint64_t req_id, int32_t index)
{
    (void)ctx;
    (void)req_id;
    (void)index;
}

static bool not_failed(void *ctx)
{
    (void)ctx;
    return false;
}

static const struct kr_sess_engine_i k_engine = {
    .submit = refuse_submit, .cancel = no_cancel, .cancel_choice = no_cancel_choice, .failed = not_failed};

static void never_posted(void *user, struct kr_sess_event *ev)
{
    (void)user;
    (void)ev;
    KR_FUZZ_CHECK(false, "an engine event without an engine");
}

/* ---- a sink that checks the one answer ------------------------------------------------------------ */

struct answer {
    int n_done;
};

static void sink_begin(void *user)
{
    (void)user;
    KR_FUZZ_CHECK(false, "a stream began although the engine refused the request");
}

static bool sink_event(void *user, const char *json, size_t len)
{
    (void)user;
    (void)json;
    (void)len;
    KR_FUZZ_CHECK(false, "a stream event although the engine refused the request");
    return true;
}

static void sink_done(void *user, int status, const char *body, size_t len)
{
    struct answer *a = user;
    a->n_done++;
    KR_FUZZ_CHECK(status == 200 || (status >= 400 && status < 600), "status %d", status);
    if (!body) {
        KR_FUZZ_CHECK(status == 500, "no body with status %d", status);
        return;
    }
    json_error_t je;
    json_t *j = json_loadb(body, len, 0, &je);
    KR_FUZZ_CHECK(json_is_object(j), "an answer that is not a JSON object: %.*s", (int)(len < 200 ? len : 200), body);
    if (status >= 400) {
        json_t *e = json_object_get(j, "error");
        KR_FUZZ_CHECK(json_is_object(e) && json_is_string(json_object_get(e, "message")), "an error without a message");
    }
    json_decref(j);
}

static bool sink_event_named(void *user, const char *name, const char *json, size_t len)
{
    (void)name;
    return sink_event(user, json, len);
}

static const struct kr_sess_sink k_sink = {
    .stream_begin = sink_begin, .stream_event = sink_event, .stream_event_named = sink_event_named, .done = sink_done};

/* ---- the harness ---------------------------------------------------------------------------------- */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    json_set_alloc_funcs(kr_malloc, kr_free); /* as krait does (server/main.c) */
    kr_log_set_level(KR_LOG_LEVEL_ERROR);
    char model[4096];
    snprintf(model, sizeof model, "%s/models/tiny-hybrid", kr_fuzz_source_dir());
    struct kr_err err = {0};
    if (kr_tokenizer_load(model, NULL, &g_tok, &err) != KR_OK || kr_chat_load(g_tok, NULL, &g_chat, &err) != KR_OK ||
        !g_chat) {
        fprintf(stderr, "fuzz_request: %s: %s\n", model, g_chat || err.msg[0] ? err.msg : "no chat template");
        abort();
    }
    const int32_t eos = kr_tokenizer_eos_id(g_tok);
    if (kr_grammar_vocab_create(g_tok, &eos, eos >= 0, &g_gvocab, &err) != KR_OK) {
        fprintf(stderr, "fuzz_request: %s\n", err.msg);
        abort();
    }
    kr_metrics_init(&g_met);
    g_env = (struct kr_sess_env){
        .engine = &k_engine,
        .tok = g_tok,
        .chat = g_chat,
        .gvocab = g_gvocab,
        .vocab = kr_tokenizer_n_vocab(g_tok),
        .max_model_len = 4096,
        .snapshot_hints = true,
        .max_bytes_per_token = kr_tokenizer_max_bytes_per_token(g_tok),
        .max_request_memory = (size_t)64 << 20,
        .model_name = "tiny-hybrid",
        .met = &g_met,
        .post = never_posted,
    };
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const enum kr_sess_kind kinds[] = {KR_SESS_COMPLETIONS, KR_SESS_CHAT, KR_SESS_RESPONSES, KR_SESS_TOKENIZE,
                                              KR_SESS_DETOKENIZE};
    /* a cache per input: compiled constraints must not carry over from one input to the next */
    KR_FUZZ_CHECK(kr_grammar_cache_create(1, &g_env.grammars) == KR_OK, "out of memory");
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        struct kr_sess *s = kr_sess_create(&g_env, kinds[k], 0.0);
        KR_FUZZ_CHECK(s, "out of memory");
        (void)kr_sess_prepare(s, (const char *)data, size);
        struct answer a = {0};
        kr_sess_start(s, &k_sink, &a);
        KR_FUZZ_CHECK(a.n_done == 1, "%d answers", a.n_done);
        kr_sess_release(s);
    }
    kr_grammar_cache_destroy(g_env.grammars);
    g_env.grammars = NULL;
    return 0;
}
