/* Engine host overhead with N sequences decoding greedily:
 *   - scheduling: host time per step planning and building the batch (admission, preemption checks,
 *     block reservations, batch arrays);
 *   - the gap between back-to-back steps: from a step's results being back on the host to the next
 *     step's launch (results processing, planning, batch building), the time a GPU would sit idle.
 * Usage: bench_sched [MODEL_DIR] [N_SEQ] [N_GEN] [DEVICE]   (DEVICE: cpu (default), cuda, cuda:N)
 * On the CPU a tiny checkpoint keeps the run short; on a GPU the cache takes 80 % of the memory
 * left after loading. */
#include "engine.h"


#include "alloc.h"
#include "clock.h"
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
    const char *device = argc > 4 ? argv[4] : "cpu";
    kr_log_set_level(KR_LOG_LEVEL_WARN);
    kr_backend_t be = NULL;
    struct kr_model *m = NULL;
    struct kr_err err = {0};
    if (kr_backend_create(device, 0, &be, &err) != KR_OK) {
        fprintf(stderr, "bench_sched: %s\n", err.msg);
        return 1;
    }
    if (kr_model_load(dir, be, &m, &err) != KR_OK) {
        fprintf(stderr, "bench_sched: %s\n", err.msg);
        return 1;
    }
    struct kr_engine_config cfg;
    kr_engine_config_default(&cfg);
    cfg.max_num_seqs = n_seq;
    cfg.max_num_batched_tokens = 8192;
    cfg.cache_bytes = (size_t)1 << 30;
    size_t free_b = 0, total_b = 0;
    if (kr_backend_mem_info(be, &free_b, &total_b) == KR_OK) {
        cfg.cache_bytes = free_b / 10 * 8;
    }
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
    const double w0 = kr_clock_us();
    for (int32_t i = 0; i < n_seq; i++) {
        struct kr_request_params p = {.prompt = prompt, .n_prompt = 32, .n = 1, .sampling = s, .cb = on_event};
        uint64_t id;
        if (kr_engine_submit(e, &p, &id, &err) != KR_OK) {
            fprintf(stderr, "bench_sched: %s\n", err.msg);
            return 1;
        }
    }
    kr_engine_wait_idle(e);
    const double wall_us = kr_clock_us() - w0;
    struct kr_engine_stats st;
    kr_engine_get_stats(e, &st);
    const double gap = st.step_gaps ? st.step_gap_us_total / (double)st.step_gaps : 0.0;
    printf("%s, %s: sequences %d, generated %d each: %llu steps in %.1f ms (%.0f tok/s)\n", dir, kr_backend_name(be),
           n_seq, n_gen, (unsigned long long)st.steps, wall_us / 1e3, (double)st.generation_tokens / wall_us * 1e6);
    printf("scheduling %.1f us/step on average (%.2f us per running sequence)\n",
           st.step_sched_us_total / (double)st.steps, st.step_sched_us_total / (double)st.steps / n_seq);
    printf("host gap between back-to-back steps %.1f us on average over %llu steps (%.1f %% of the mean step)\n", gap,
           (unsigned long long)st.step_gaps, st.steps ? gap / (wall_us / (double)st.steps) * 100.0 : 0.0);
    kr_engine_free(e);
    kr_model_free(m);
    kr_backend_free(be);
    return 0;
}
