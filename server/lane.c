#include "lane.h"

#include "log.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <sys/prctl.h>

static void push(struct kr_lane_work **h, struct kr_lane_work **t, struct kr_lane_work *w)
{
    w->next = NULL;
    if (*t) {
        (*t)->next = w;
    } else {
        *h = w;
    }
    *t = w;
}

static void *lane_main(void *arg)
{
    prctl(PR_SET_NAME, "kr-lane", 0, 0, 0); /* a name for top -H and /proc/PID/task */
    struct kr_lane *l = arg;
    /* a thread's own nice value (Linux: setpriority on the thread id) */
    if (setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), l->nice) != 0) {
        KR_LOG_DEBUG("lane: cannot lower the priority of a worker thread");
    }
    pthread_mutex_lock(&l->mu);
    for (;;) {
        while (!l->qh && !l->stop) {
            pthread_cond_wait(&l->cv, &l->mu);
        }
        if (l->stop) {
            break;
        }
        struct kr_lane_work *w = l->qh;
        l->qh = w->next;
        if (!l->qh) {
            l->qt = NULL;
        }
        pthread_mutex_unlock(&l->mu);
        w->work(w);
        w->status = 0;
        pthread_mutex_lock(&l->mu);
        push(&l->dh, &l->dt, w);
        uv_async_send(&l->done);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

static void on_done(uv_async_t *a)
{
    struct kr_lane *l = a->data;
    pthread_mutex_lock(&l->mu);
    struct kr_lane_work *w = l->dh;
    l->dh = l->dt = NULL;
    pthread_mutex_unlock(&l->mu);
    while (w) {
        struct kr_lane_work *next = w->next;
        l->queued--;
        w->after(w, w->status);
        w = next;
    }
}

int kr_lane_start(struct kr_lane *l, uv_loop_t *loop, int n_threads, int nice)
{
    *l = (struct kr_lane){.nice = nice};
    if (n_threads < 1 || n_threads > KR_LANE_MAX_THREADS || uv_async_init(loop, &l->done, on_done) != 0) {
        return -1;
    }
    l->done.data = l;
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    for (; l->n_threads < n_threads; l->n_threads++) {
        if (pthread_create(&l->th[l->n_threads], NULL, lane_main, l) != 0) {
            kr_lane_stop(l);
            return -1;
        }
    }
    return 0;
}

void kr_lane_submit(struct kr_lane *l, struct kr_lane_work *w)
{
    l->queued++;
    pthread_mutex_lock(&l->mu);
    push(&l->qh, &l->qt, w);
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

static void lane_closed(uv_handle_t *h)
{
    (void)h;
}

void kr_lane_stop(struct kr_lane *l)
{
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    for (int i = 0; i < l->n_threads; i++) {
        pthread_join(l->th[i], NULL);
    }
    l->n_threads = 0;
    /* what never ran is cancelled, after what finished */
    for (struct kr_lane_work *w = l->qh; w; w = w->next) {
        w->status = UV_ECANCELED;
    }
    if (l->qh) {
        if (l->dt) {
            l->dt->next = l->qh;
        } else {
            l->dh = l->qh;
        }
        l->dt = l->qt;
        l->qh = l->qt = NULL;
    }
    on_done(&l->done);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv);
    uv_close((uv_handle_t *)&l->done, lane_closed);
}
