#pragma once
/* A lane of worker threads at a lower CPU priority, for the preparation of large requests (parsing
 * and tokenizing megabytes). libuv's pool has four threads and one FIFO queue: four large
 * preparations took every worker, and every small request queued behind them for seconds, while
 * their tokenizing took the cores from the engine. Large requests go here instead: they queue
 * among themselves, run at nice +10 (the engine, the loop and small preparations win the CPU), and
 * libuv's pool stays free for the rest.
 *
 * Work runs on a lane thread; `after` runs on the loop thread, as with uv_queue_work, with status 0,
 * or UV_ECANCELED for work still queued when the lane stopped. */
#include <pthread.h>
#include <stdbool.h>
#include <uv.h>

struct kr_lane_work {
    struct kr_lane_work *next;
    void (*work)(struct kr_lane_work *w);
    void (*after)(struct kr_lane_work *w, int status);
    int status;
    void *data;
};

#define KR_LANE_MAX_THREADS 8

struct kr_lane {
    uv_async_t done;             /* wakes the loop for finished work */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct kr_lane_work *qh, *qt; /* waiting */
    struct kr_lane_work *dh, *dt; /* finished: `after` due on the loop */
    pthread_t th[KR_LANE_MAX_THREADS];
    int n_threads;
    int nice;
    int queued;                  /* waiting or running (loop thread's view) */
    bool stop;
};

/* Starts n_threads (1..KR_LANE_MAX_THREADS) threads at `nice` on loop. 0 or a libuv/pthread error. */
int kr_lane_start(struct kr_lane *l, uv_loop_t *loop, int n_threads, int nice);
/* Queues w (loop thread). */
void kr_lane_submit(struct kr_lane *l, struct kr_lane_work *w);
/* Stops the threads once their current work is done; queued work gets `after` with UV_ECANCELED and
 * finished work its `after`, before it returns; the lane's handle is closed.
 * Loop thread. */
void kr_lane_stop(struct kr_lane *l);
