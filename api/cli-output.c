#include "cli-output.h"

#include "alloc.h"
#include "openai.h"

#include <jansson.h>
#include <string.h>

static json_t *id_array(const int32_t *ids, int32_t n)
{
    json_t *a = json_array();
    for (int32_t i = 0; a && i < n; i++) {
        if (json_array_append_new(a, json_integer(ids[i])) != 0) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

/* json_dumps allocates with jansson's allocator; hand the caller a kr_malloc copy. */
static char *dump(json_t *root)
{
    if (!root) {
        return NULL;
    }
    char *s = json_dumps(root, JSON_COMPACT | JSON_REAL_PRECISION(9));
    json_decref(root);
    if (!s) {
        return NULL;
    }
    char *r = kr_strdup(s);
    kr_oai_free(s);
    return r;
}

char *kr_cli_generate_json(const struct kr_generate_result *r)
{
    json_t *root = json_object();
    json_t *lps = json_array();
    if (!root || !lps) {
        json_decref(root);
        json_decref(lps);
        return NULL;
    }
    for (int32_t i = 0; i < r->n_tokens; i++) {
        json_array_append_new(lps, json_real(r->logprobs[i]));
    }
    json_object_set_new(root, "model", json_string(r->model));
    json_object_set_new(root, "prompt_token_ids", id_array(r->prompt, r->n_prompt));
    json_object_set_new(root, "token_ids", id_array(r->tokens, r->n_tokens));
    json_object_set_new(root, "logprobs", lps);
    json_object_set_new(root, "finish_reason", json_string(r->finish_reason));
    json_t *timing = json_object();
    json_object_set_new(timing, "elapsed_ms", json_real(r->elapsed_ms));
    json_object_set_new(root, "timing", timing);
    return dump(root);
}

char *kr_cli_logprobs_json(const char *model, const int32_t *prompt, int32_t n_prompt, const float *lp, int64_t vocab,
                           int32_t n_top)
{
    json_t *root = json_object();
    json_t *plp = json_array();
    json_t *tops = json_array();
    if (!root || !plp || !tops) {
        json_decref(root);
        json_decref(plp);
        json_decref(tops);
        return NULL;
    }
    json_array_append_new(plp, json_null());
    for (int32_t t = 1; t < n_prompt; t++) {
        json_array_append_new(plp, json_real(lp[(int64_t)(t - 1) * vocab + prompt[t]]));
    }
    if (n_top > vocab) {
        n_top = (int32_t)vocab;
    }
    int32_t *best = kr_malloc((size_t)(n_top > 0 ? n_top : 1) * sizeof(int32_t));
    for (int32_t t = 0; best && t < n_prompt; t++) {
        const float *row = lp + (int64_t)t * vocab;
        /* partial selection of the n_top largest (ties: lower id first) */
        int32_t k = 0;
        for (int64_t v = 0; v < vocab && n_top > 0; v++) {
            int32_t j;
            if (k < n_top) {
                j = k++;
            } else if (row[v] > row[best[n_top - 1]]) {
                j = n_top - 1;
            } else {
                continue;
            }
            best[j] = (int32_t)v;
            while (j > 0 && row[best[j]] > row[best[j - 1]]) { /* strict: equal values keep the lower id first */
                int32_t tmp = best[j];
                best[j] = best[j - 1];
                best[j - 1] = tmp;
                j--;
            }
        }
        json_t *row_j = json_array();
        for (int32_t i = 0; i < k; i++) {
            json_t *pair = json_pack("{s:i, s:f}", "id", best[i], "logprob", (double)row[best[i]]);
            json_array_append_new(row_j, pair);
        }
        json_array_append_new(tops, row_j);
    }
    kr_free(best);
    json_object_set_new(root, "model", json_string(model));
    json_object_set_new(root, "prompt_token_ids", id_array(prompt, n_prompt));
    json_object_set_new(root, "prompt_logprobs", plp);
    json_object_set_new(root, "top_logprobs", tops);
    return dump(root);
}
