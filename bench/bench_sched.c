/* Scheduler overhead: host time the engine spends per step planning and building the batch
 * (admission, preemption checks, block reservations, batch arrays), with N sequences decoding.
 * The model forward is excluded; a tiny checkpoint keeps the run short. */
#include "engine.h"

#include "alloc.h"
#include "log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void on_event(const struct kr_event *ev, void *user)
{
    (void)ev;
    (void)user;
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : "tests/fixtures/nemotron_h/nh_moe";
    const int32_t n_seq = argc > 2 ? atoi(argv[2]) : 256;
    const int32_t n_gen = argc > 3 ? atoi(argv[3]) : 64;
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    kr_backend_t be = kr_backend_cpu_create(0);
    struct kr_model *m = NULL;
    struct kr_err err = {{0}};
    if (kr_model_load(dir, be, &m, &err) != KR_OK) {
        fprintf(stderr, "bench_sched: %s\n", err.msg);
        return 1;
    }
    struct kr_engine_config cfg;
    kr_engine_config_default(&cfg);
    cfg.max_num_seqs = n_seq;
    cfg.max_num_batched_tokens = 8192;
    cfg.cache_bytes = (size_t)1 << 30;
    struct kr_engine *e = NULL;
    if (kr_engine_create(m, &cfg, &e, &err) != KR_OK) {
        fprintf(stderr, "bench_sched: %s\n", err.msg);
        return 1;
    }
    int32_t prompt[32];
    for (int i = 0; i < 32; i++) {
        prompt[i] = 3 + i;
    }
    struct kr_sampling s;
    kr_sampling_default(&s);
    s.temperature = 0.0f;
    s.max_tokens = n_gen;
    s.ignore_eos = true;
    for (int32_t i = 0; i < n_seq; i++) {
        struct kr_request_params p = {.prompt = prompt, .n_prompt = 32, .n = 1, .sampling = s, .cb = on_event};
        uint64_t id;
        if (kr_engine_submit(e, &p, &id, &err) != KR_OK) {
            fprintf(stderr, "bench_sched: %s\n", err.msg);
            return 1;
        }
    }
    kr_engine_wait_idle(e);
    struct kr_engine_stats st;
    kr_engine_get_stats(e, &st);
    printf("sequences %d, generated %d each: %llu steps, scheduling %.1f us/step on average "
           "(%.2f us per running sequence)\n",
           n_seq, n_gen, (unsigned long long)st.steps, st.step_sched_us_total / (double)st.steps,
           st.step_sched_us_total / (double)st.steps / n_seq);
    kr_engine_free(e);
    kr_model_free(m);
    kr_backend_free(be);
    return 0;
}
