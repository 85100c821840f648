/*
 * The one process-wide thread pool. mq_parallel_for hands out task indices through an atomic
 * counter; the caller works too. Work is always split into the same tasks whatever the pool size,
 * and each task's result is computed by one thread, so results never depend on the thread count.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "core.h"

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv_work;
    pthread_cond_t cv_done;
    pthread_mutex_t submit;   /* one job at a time from any user thread */
    int size;                 /* threads including the caller */
    pthread_t *workers;       /* size - 1 */
    uint64_t generation;
    uint64_t start_generation;   /* generation when the workers were started */
    int shutdown;
    int pending;              /* workers still running the current job */
    mq_task_fn fn;
    void *ctx;
    int64_t n_tasks;
    atomic_int_fast64_t next;
} mq_pool;

static mq_pool g_pool = {.mu = PTHREAD_MUTEX_INITIALIZER,
                         .cv_work = PTHREAD_COND_INITIALIZER,
                         .cv_done = PTHREAD_COND_INITIALIZER,
                         .submit = PTHREAD_MUTEX_INITIALIZER};
static int g_requested_threads = 0;            /* 0: number of CPUs */
static _Thread_local int tl_thread = -1;       /* pool thread index while running a job */

static void run_tasks(int thread) {
    int saved = tl_thread;
    tl_thread = thread;
    for (;;) {
        int64_t t = atomic_fetch_add(&g_pool.next, 1);
        if (t >= g_pool.n_tasks) break;
        g_pool.fn(g_pool.ctx, t, thread);
    }
    tl_thread = saved;
}

static void *worker_main(void *arg) {
    int thread = (int)(intptr_t)arg;
    pthread_mutex_lock(&g_pool.mu);
    /* the jobs before this pool's start are not this worker's: a pool restarted by
     * moeq_set_threads starts with the generation counter past 0, and a worker that began at 0
     * took a round of a finished (or, racing, the next) job and counted it off `pending` twice,
     * so mq_parallel_for could return while another worker still ran a task */
    uint64_t seen = g_pool.start_generation;
    for (;;) {
        while (!g_pool.shutdown && g_pool.generation == seen) pthread_cond_wait(&g_pool.cv_work, &g_pool.mu);
        if (g_pool.shutdown) break;
        seen = g_pool.generation;
        pthread_mutex_unlock(&g_pool.mu);
        run_tasks(thread);
        pthread_mutex_lock(&g_pool.mu);
        if (--g_pool.pending == 0) pthread_cond_signal(&g_pool.cv_done);
    }
    pthread_mutex_unlock(&g_pool.mu);
    return NULL;
}

/* The online CPUs, unless MOEQ_THREADS says otherwise (e.g. 1 under an emulator, where
 * contended locks crawl). */
static int default_threads(void) {
    const char *e = getenv("MOEQ_THREADS");
    if (e && *e) {
        char *end;
        long v = strtol(e, &end, 10);
        if (!*end && v >= 1 && v <= 1024) return (int)v;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void pool_stop(void) {
    if (!g_pool.workers) {   /* a pool of one (or none yet): the next use starts it anew */
        g_pool.size = 0;
        return;
    }
    pthread_mutex_lock(&g_pool.mu);
    g_pool.shutdown = 1;
    pthread_cond_broadcast(&g_pool.cv_work);
    pthread_mutex_unlock(&g_pool.mu);
    for (int i = 0; i < g_pool.size - 1; i++) pthread_join(g_pool.workers[i], NULL);
    free(g_pool.workers);
    g_pool.workers = NULL;
    g_pool.shutdown = 0;
    g_pool.size = 0;
}

/* Starts the workers on first use; falls back to fewer threads if creation fails. */
static void pool_start(void) {
    int want = g_requested_threads > 0 ? g_requested_threads : default_threads();
    if (want > 1024) want = 1024;
    g_pool.size = 1;
    if (want <= 1) return;
    g_pool.start_generation = g_pool.generation;   /* no job is in flight: submit is held */
    g_pool.workers = calloc((size_t)want - 1, sizeof(pthread_t));
    if (!g_pool.workers) return;
    for (int i = 1; i < want; i++) {
        if (pthread_create(&g_pool.workers[i - 1], NULL, worker_main, (void *)(intptr_t)i) != 0) break;
        g_pool.size = i + 1;
    }
}

void moeq_set_threads(int n) {
    pthread_mutex_lock(&g_pool.submit);
    g_requested_threads = n > 0 ? n : 0;
    pool_stop();
    pthread_mutex_unlock(&g_pool.submit);
}

int moeq_threads(void) {
    if (g_pool.size > 0) return g_pool.size;
    return g_requested_threads > 0 ? g_requested_threads : default_threads();
}

int mq_pool_size(void) { return moeq_threads(); }

void mq_parallel_for(int64_t n_tasks, mq_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (tl_thread >= 0 || n_tasks == 1) {   /* nested or trivial: run here */
        int thread = tl_thread >= 0 ? tl_thread : 0;
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t, thread);
        return;
    }
    pthread_mutex_lock(&g_pool.submit);
    if (g_pool.size == 0) pool_start();
    if (g_pool.size <= 1) {
        pthread_mutex_unlock(&g_pool.submit);
        tl_thread = 0;
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        tl_thread = -1;
        return;
    }
    pthread_mutex_lock(&g_pool.mu);
    g_pool.fn = fn;
    g_pool.ctx = ctx;
    g_pool.n_tasks = n_tasks;
    atomic_store(&g_pool.next, 0);
    g_pool.pending = g_pool.size - 1;
    g_pool.generation++;
    pthread_cond_broadcast(&g_pool.cv_work);
    pthread_mutex_unlock(&g_pool.mu);

    run_tasks(0);

    pthread_mutex_lock(&g_pool.mu);
    while (g_pool.pending > 0) pthread_cond_wait(&g_pool.cv_done, &g_pool.mu);
    g_pool.fn = NULL;
    pthread_mutex_unlock(&g_pool.mu);
    pthread_mutex_unlock(&g_pool.submit);
}
