/* Fuzz harness: a checkpoint's config.json (untrusted: it comes with downloaded weights) read into a
 * model config (model/config.c, both layouts: nemotron_h and deepseek_v32), then split for tensor
 * parallelism at sizes 2, 4 and 8 as `--tensor-parallel-size` would. A config that is accepted must
 * describe its layers consistently: the pattern has n_layer letters, each of a known layer type,
 * and the per-type counts add up to n_layer. */
/* fuzz-max-len: 16384 (tools/fuzz.sh passes it as -max_len) */
#include "fuzz.h"

#include "config.h"
#include "json.h"
#include "log.h"

#include <stdint.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kr_log_set_level(KR_LOG_LEVEL_ERROR); /* warnings about odd keys are expected by the thousand */
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kr_json *root = NULL;
    struct kr_err err = {0};
    if (kr_json_parse((const char *)data, size, &root, &err) != KR_OK) {
        return 0;
    }
    struct kr_model_config cfg;
    if (kr_model_config_from_json(&cfg, root, "config.json", &err) == KR_OK) {
        KR_FUZZ_CHECK(cfg.n_layer > 0 && cfg.n_layer <= KR_MAX_LAYERS, "n_layer %d", cfg.n_layer);
        KR_FUZZ_CHECK(strlen(cfg.pattern) == (size_t)cfg.n_layer, "pattern \"%s\" for %d layers", cfg.pattern,
                      cfg.n_layer);
        static const enum kr_layer_type types[] = {KR_LAYER_MAMBA, KR_LAYER_ATTN, KR_LAYER_MLP,
                                                   KR_LAYER_MOE,   KR_LAYER_DSA,  KR_LAYER_MLA};
        int32_t total = 0;
        for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
            total += kr_model_config_count(&cfg, types[i]);
        }
        KR_FUZZ_CHECK(total == cfg.n_layer, "pattern \"%s\": %d layers of known types of %d", cfg.pattern, total,
                      cfg.n_layer);
        for (int32_t size_ = 2; size_ <= 8; size_ *= 2) {
            for (int32_t rank = 0; rank < size_; rank += size_ - 1) {
                struct kr_model_config shard = cfg;
                (void)kr_model_config_shard(&shard, rank, size_, &err);
            }
        }
    }
    kr_json_free(root);
    return 0;
}
