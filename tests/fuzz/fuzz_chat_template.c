/* libFuzzer harness for the chat-template renderer (api/chat-template/).
 *
 * Input: one selector byte, then the payload.
 *   selector % (1 + n_fixtures) == 0: the payload is a template, optionally followed by
 *       SEPARATOR and a JSON document with the render's variables; the template is compiled and
 *       rendered with them (or with a default conversation when there is no JSON).
 *   otherwise: the payload is the JSON document, rendered by fixture template selector - 1 (the
 *       chat templates of the tokenizer fixtures and models/tiny-hybrid, compiled once).
 * The JSON document is either an array (the messages) or an object with "messages", "tools" and
 * "kwargs" (chat_template_kwargs); bit 7 of the selector sets add_generation_prompt.
 *
 * Anything may fail with an error; nothing may crash, leak, hang past the renderer's limits, or
 * return KR_OK without a NUL-terminated text of the length it reports. */
#define _POSIX_C_SOURCE 200809L

#include "chat-template.h"

#include "alloc.h"

#include <jansson.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef KR_FUZZ_SOURCE_DIR /* the tree the harness was built from (tests/fuzz/CMakeLists.txt) */
#define KR_FUZZ_SOURCE_DIR KR_FUZZ_SOURCE_DIR_DEFAULT
#endif

#define SEPARATOR "\n#JSON#\n"
#define MAX_FIXTURES 8

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct kr_chat_template *g_fixture[MAX_FIXTURES];
static size_t g_n_fixtures;
static json_t *g_default_messages;

static const char *const FIXTURE_CONFIGS[] = {
    "tests/fixtures/tokenizer/deepseek_v3/tokenizer_config.json",
    "tests/fixtures/tokenizer/qwen3/tokenizer_config.json",
    "tests/fixtures/tokenizer/llama3/tokenizer_config.json",
    "models/tiny-hybrid/tokenizer_config.json",
};

static void fail(const char *what)
{
    fprintf(stderr, "fuzz_chat_template: %s\n", what);
    abort();
}

/* Compiles the chat_template of a tokenizer_config.json unless an earlier fixture had the same text. */
static void load_fixture(const char *dir, const char *rel, json_t *seen)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, rel);
    json_error_t je;
    json_t *cfg = json_load_file(path, JSON_DECODE_INT_AS_REAL, &je); /* llama3's model_max_length: 10^30 */
    if (!cfg) {
        fprintf(stderr, "fuzz_chat_template: %s: %s\n", path, je.text);
        abort();
    }
    const json_t *src = json_object_get(cfg, "chat_template");
    if (json_is_string(src) && !json_object_get(seen, json_string_value(src)) && g_n_fixtures < MAX_FIXTURES) {
        struct kr_err err = {0};
        if (kr_chat_template_compile(json_string_value(src), json_string_length(src), &g_fixture[g_n_fixtures],
                                     &err) != KR_OK) {
            fprintf(stderr, "fuzz_chat_template: %s: %s\n", path, err.msg);
            abort();
        }
        g_n_fixtures++;
        json_object_set_new(seen, json_string_value(src), json_true());
    }
    json_decref(cfg);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *dir = getenv("KR_FUZZ_SOURCE_DIR");
    if (!dir || !*dir) {
        dir = KR_FUZZ_SOURCE_DIR;
    }
    json_t *seen = json_object();
    for (size_t i = 0; i < sizeof FIXTURE_CONFIGS / sizeof FIXTURE_CONFIGS[0]; i++) {
        load_fixture(dir, FIXTURE_CONFIGS[i], seen);
    }
    json_decref(seen);
    g_default_messages = json_loads("[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":"
                                    "\"Hi\"},{\"role\":\"assistant\",\"content\":\"Hello!\"},{\"role\":\"user\","
                                    "\"content\":\"Weather?\"}]",
                                    0, NULL);
    if (!g_default_messages) {
        fail("default messages");
    }
    return 0;
}

static void render(const struct kr_chat_template *tpl, const json_t *vars, bool agp)
{
    const json_t *msgs = g_default_messages, *tools = NULL, *extra = NULL;
    if (json_is_array(vars)) {
        msgs = vars;
    } else if (json_is_object(vars)) {
        msgs = json_object_get(vars, "messages");
        tools = json_object_get(vars, "tools");
        extra = json_object_get(vars, "kwargs");
        if (!json_is_array(msgs)) {
            msgs = NULL; /* the renderer takes NULL as no messages */
        }
        if (json_is_null(tools)) {
            tools = NULL;
        }
    }
    struct kr_chat_params p = {
        .messages = msgs,
        .tools = tools,
        .add_generation_prompt = agp,
        .bos_token = "<s>",
        .eos_token = "</s>",
        .extra = extra,
    };
    char *out = NULL;
    size_t len = 0;
    struct kr_err err = {0};
    enum kr_status st = kr_chat_template_render(tpl, &p, &out, &len, &err);
    if (st == KR_OK) {
        if (!out || out[len] != '\0') {
            fail("a rendering is not NUL-terminated at its length");
        }
    } else {
        if (out) {
            fail("a failed render returned text");
        }
        if (!err.msg[0]) {
            fail("a failed render has no message");
        }
        if (st != KR_ERR_INVAL && st != KR_ERR_NOMEM) {
            fprintf(stderr, "status %d: %s\n", (int)st, err.msg);
            fail("a render failed with an unexpected status");
        }
    }
    kr_free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) {
        return 0;
    }
    const uint8_t sel = data[0];
    const char *payload = (const char *)data + 1;
    size_t n = size - 1;
    bool agp = (sel & 0x80) != 0;
    size_t which = (size_t)(sel & 0x7F) % (1 + g_n_fixtures);
    if (which > 0) {
        json_t *vars = json_loadb(payload, n, JSON_DECODE_ANY, NULL);
        if (vars) {
            render(g_fixture[which - 1], vars, agp);
            json_decref(vars);
        }
        return 0;
    }
    /* an arbitrary template, then optionally its variables */
    size_t tpl_len = n;
    const char *json = NULL;
    for (size_t i = 0; i + sizeof SEPARATOR - 1 <= n; i++) {
        if (memcmp(payload + i, SEPARATOR, sizeof SEPARATOR - 1) == 0) {
            tpl_len = i;
            json = payload + i + sizeof SEPARATOR - 1;
            break;
        }
    }
    struct kr_chat_template *tpl = NULL;
    struct kr_err err = {0};
    enum kr_status st = kr_chat_template_compile(payload, tpl_len, &tpl, &err);
    if (st != KR_OK) {
        if (tpl || !err.msg[0] || (st != KR_ERR_FORMAT && st != KR_ERR_NOMEM)) {
            fprintf(stderr, "status %d: %s\n", (int)st, err.msg);
            fail("a failed compile is not a clean KR_ERR_FORMAT");
        }
        return 0;
    }
    json_t *vars = json ? json_loadb(json, n - (size_t)(json - payload), JSON_DECODE_ANY, NULL) : NULL;
    render(tpl, vars, agp);
    json_decref(vars);
    kr_chat_template_free(tpl);
    return 0;
}
