/*
 * The one process-wide thread pool. mq_parallel_for hands out task indices through an atomic
 * counter; the caller works too. Work is always split into the same tasks whatever the pool size,
 * and each task's result is computed by one thread, so results never depend on the thread count.
 */
#define _GNU_SOURCE   /* sched_getaffinity, pthread_setaffinity_np */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "core.h"
#include "core/env.h"

/*
 * Hand-off: the caller publishes a job and bumps `generation`; workers that finished a job a
 * moment ago are still spinning on that counter and start at once, the others sleep on cv_work
 * and are woken only when some are asleep (`sleepers`). The caller spins on `pending` the same
 * way before it sleeps on cv_done. A job costs no lock when the workers are awake: with every
 * worker taking the one mutex to wake and again to check in, a job of 16 threads spent tens to
 * hundreds of microseconds in handing over (more on a VM), which the many short jobs of the
 * forward and the GPU's result unpacking paid each time.
 *
 * No lost wake-up: a worker counts itself in `sleepers` and then reads `generation`; the caller
 * bumps `generation` and then reads `sleepers` (all sequentially consistent): one of the two
 * sees the other's write. A sleeper registers under `mu`, which the caller takes to broadcast.
 */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv_work;
    pthread_cond_t cv_done;
    pthread_mutex_t submit;   /* one job at a time from any user thread */
    int size;                 /* threads including the caller */
    pthread_t *workers;       /* size - 1 */
    atomic_uint_fast64_t generation;
    uint64_t start_generation;   /* generation when the workers were started */
    atomic_int shutdown;
    atomic_int pending;       /* workers still running the current job */
    atomic_int sleepers;      /* workers asleep (or going to sleep) on cv_work */
    mq_task_fn fn;
    void *ctx;
    int64_t n_tasks;
    atomic_int_fast64_t next;
} mq_pool;

static mq_pool g_pool = {.mu = PTHREAD_MUTEX_INITIALIZER,
                         .cv_work = PTHREAD_COND_INITIALIZER,
                         .cv_done = PTHREAD_COND_INITIALIZER,
                         .submit = PTHREAD_MUTEX_INITIALIZER};
static int g_requested_threads = 0;            /* 0: default_threads() */
static _Thread_local int tl_thread = -1;       /* pool thread index while running a job */

/* How long a worker waits for the next job, and the caller for the workers, before sleeping:
 * long enough for back-to-back jobs, short enough not to hold idle cores while the caller does
 * serial work or waits for a device (GOMP and OpenBLAS spin similarly). */
#define SPIN_SECONDS 200e-6

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Spins until ready(arg) (returns true) or the spin time is over (false). */
static bool spin_until(bool (*ready)(const void *arg), const void *arg) {
    double t0 = -1;
    for (int i = 0;; i++) {
        if (ready(arg)) return true;
        cpu_relax();
        if ((i & 63) == 63) {   /* the clock now and then: pause lasts 10-150 cycles by CPU */
            double t = mq_now();
            if (t0 < 0) t0 = t;
            else if (t - t0 > SPIN_SECONDS) return false;
        }
    }
}

/* a job after generation *seen, or the pool stopping */
static bool job_published(const void *seen) {
    return atomic_load(&g_pool.generation) != *(const uint64_t *)seen || atomic_load(&g_pool.shutdown);
}

static bool job_done(const void *unused) {
    (void)unused;
    return atomic_load(&g_pool.pending) == 0;
}

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

/* The CPUs this process may run on (taskset, a container's cpuset, mpirun's binding), or 0 where
 * that cannot be read. */
static int allowed_cpus(cpu_set_t *mask) {
#if defined(__linux__)
    CPU_ZERO(mask);
    if (sched_getaffinity(0, sizeof *mask, mask) == 0) return CPU_COUNT(mask);
#else
    (void)mask;
#endif
    return 0;
}

/* MOEQ_PIN_THREADS=1: worker i runs only on the i-th allowed CPU (counting from 0, modulo their
 * number), the caller stays free (threads it creates later inherit its mask, and it runs on the
 * CPU left over). A measuring knob: without it the scheduler can stack two workers on one CPU for
 * a while after a wake-up, and a loop of one task a thread then waits for the one that shared its
 * CPU. Off by default: processes sharing a host (mpirun's ranks unbound) would pin onto the same
 * CPUs. */
static void pin_worker(int thread) {
#if defined(__linux__)
    const char *e = mq_env(MQ_ENV_PIN_THREADS);
    cpu_set_t mask;
    const int n = e && *e == '1' ? allowed_cpus(&mask) : 0;
    if (n < 2) return;
    for (int c = 0, k = -1; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &mask) || ++k != thread % n) continue;
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(c, &one);
        pthread_setaffinity_np(pthread_self(), sizeof one, &one);   /* a failure leaves it unpinned */
        return;
    }
#else
    (void)thread;
#endif
}

static void *worker_main(void *arg) {
    int thread = (int)(intptr_t)arg;
    pin_worker(thread);
    /* the jobs before this pool's start are not this worker's: a pool restarted by
     * moeq_set_threads starts with the generation counter past 0, and a worker that began at 0
     * took a round of a finished (or, racing, the next) job and counted it off `pending` twice,
     * so mq_parallel_for could return while another worker still ran a task */
    pthread_mutex_lock(&g_pool.mu);
    uint64_t seen = g_pool.start_generation;
    pthread_mutex_unlock(&g_pool.mu);
    for (;;) {
        if (!spin_until(job_published, &seen)) {
            pthread_mutex_lock(&g_pool.mu);
            atomic_fetch_add(&g_pool.sleepers, 1);
            while (!atomic_load(&g_pool.shutdown) && atomic_load(&g_pool.generation) == seen)
                pthread_cond_wait(&g_pool.cv_work, &g_pool.mu);
            atomic_fetch_sub(&g_pool.sleepers, 1);
            pthread_mutex_unlock(&g_pool.mu);
        }
        if (atomic_load(&g_pool.shutdown)) break;
        seen = atomic_load(&g_pool.generation);
        run_tasks(thread);
        if (atomic_fetch_sub(&g_pool.pending, 1) == 1) {   /* the last: the caller may be asleep */
            pthread_mutex_lock(&g_pool.mu);
            pthread_cond_signal(&g_pool.cv_done);
            pthread_mutex_unlock(&g_pool.mu);
        }
    }
    return NULL;
}

/* The CPUs this process may run on (as nproc counts them: under taskset, a cpuset or mpirun's
 * binding to a core, not the machine's), unless MOEQ_THREADS says otherwise (e.g. 1 under an
 * emulator, where contended locks crawl). */
static int default_threads(void) {
    const char *e = mq_env(MQ_ENV_THREADS);
    if (e && *e) {
        char *end;
        long v = strtol(e, &end, 10);
        if (!*end && v >= 1 && v <= 1024) return (int)v;
    }
    cpu_set_t mask;
    const int allowed = allowed_cpus(&mask);
    if (allowed > 0) return allowed;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void pool_stop(void) {
    if (!g_pool.workers) {   /* a pool of one (or none yet): the next use starts it anew */
        g_pool.size = 0;
        return;
    }
    pthread_mutex_lock(&g_pool.mu);
    atomic_store(&g_pool.shutdown, 1);
    pthread_cond_broadcast(&g_pool.cv_work);
    pthread_mutex_unlock(&g_pool.mu);
    for (int i = 0; i < g_pool.size - 1; i++) pthread_join(g_pool.workers[i], NULL);
    free(g_pool.workers);
    g_pool.workers = NULL;
    atomic_store(&g_pool.shutdown, 0);
    g_pool.size = 0;
}

/* Starts the workers on first use; falls back to fewer threads if creation fails. */
static void pool_start(void) {
    int want = g_requested_threads > 0 ? g_requested_threads : default_threads();
    if (want > 1024) want = 1024;
    g_pool.size = 1;
    if (want <= 1) return;
    g_pool.start_generation = atomic_load(&g_pool.generation);   /* no job is in flight: submit is held */
    g_pool.workers = calloc((size_t)want - 1, sizeof(pthread_t));
    if (!g_pool.workers) return;
    for (int i = 1; i < want; i++) {
        if (pthread_create(&g_pool.workers[i - 1], NULL, worker_main, (void *)(intptr_t)i) != 0) break;
        g_pool.size = i + 1;
    }
}

void moeq_set_threads(int n) {
    mq_env_reload();   /* MOEQ_THREADS and MOEQ_PIN_THREADS as they are now, for the new pool */
    pthread_mutex_lock(&g_pool.submit);
    g_requested_threads = n > 0 ? n : 0;
    pool_stop();
    pthread_mutex_unlock(&g_pool.submit);
}

int moeq_threads(void) {
    if (g_pool.size > 0) return g_pool.size;
    return g_requested_threads > 0 ? g_requested_threads : default_threads();
}

static int g_sim_threads;           /* mq_pool_simulate's P, 0: off */
static double g_sim_tasks, g_sim_span;   /* under g_sim_mu: a prefetch thread may run loops too */
static pthread_mutex_t g_sim_mu = PTHREAD_MUTEX_INITIALIZER;

int mq_pool_size(void) { return g_sim_threads > 0 ? g_sim_threads : moeq_threads(); }

static _Atomic int64_t g_pool_ns;   /* mq_pool_seconds */

void mq_pool_simulate(int P) {
    pthread_mutex_lock(&g_sim_mu);
    g_sim_threads = P > 0 ? P : 0;
    g_sim_tasks = g_sim_span = 0;
    mq_clock_simulating(P > 0);
    pthread_mutex_unlock(&g_sim_mu);
}

void mq_pool_simulated(double *tasks_seconds, double *simulated_seconds) {
    pthread_mutex_lock(&g_sim_mu);
    *tasks_seconds = g_sim_tasks;
    *simulated_seconds = g_sim_span;
    pthread_mutex_unlock(&g_sim_mu);
}

double mq_schedule_makespan(const double *dur, int64_t n, int P) {
    if (P < 1) P = 1;
    double *free_at = calloc((size_t)P, sizeof *free_at), span = 0;
    if (!free_at) return 0;
    for (int64_t t = 0; t < n; t++) {
        int w = 0;   /* the first free worker takes the next task (the pool's counter) */
        for (int q = 1; q < P; q++)
            if (free_at[q] < free_at[w]) w = q;
        free_at[w] += dur[t];
        if (free_at[w] > span) span = free_at[w];
    }
    free(free_at);
    return span;
}

/* A top-level loop under mq_pool_simulate: its tasks in turn on this thread (index 0), each
 * timed by the thread's CPU clock (mq_cpu_now while simulating), so other processes' load on the
 * machine does not lengthen them; the loop then takes the schedule's span on mq_now. */
static void simulate_loop(int64_t n_tasks, mq_task_fn fn, void *ctx) {
    double *dur = malloc(sizeof(double) * (size_t)n_tasks), sum = 0;
    const double w0 = mq_now();
    tl_thread = 0;   /* nested loops run inline, as inside a pool task */
    for (int64_t t = 0; t < n_tasks; t++) {
        const double a = mq_cpu_now();
        fn(ctx, t, 0);
        if (dur) dur[t] = mq_cpu_now() - a;
        sum += dur ? dur[t] : 0;
    }
    tl_thread = -1;
    const double wall = mq_now() - w0;
    const double span = dur ? mq_schedule_makespan(dur, n_tasks, g_sim_threads) : wall;
    free(dur);
    if (wall > span) mq_clock_skip(wall - span);   /* the loop took P threads' time (mq_now) */
    pthread_mutex_lock(&g_sim_mu);
    g_sim_tasks += sum;
    g_sim_span += span;
    pthread_mutex_unlock(&g_sim_mu);
}

double mq_pool_seconds(void) { return (double)atomic_load(&g_pool_ns) * 1e-9; }

static void pool_time_add(double t0) { atomic_fetch_add(&g_pool_ns, (int64_t)((mq_now() - t0) * 1e9)); }

void mq_parallel_for(int64_t n_tasks, mq_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (tl_thread >= 0 || n_tasks == 1) {   /* nested or trivial: run here */
        int thread = tl_thread >= 0 ? tl_thread : 0;
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t, thread);
        return;
    }
    const double t0 = mq_now();
    if (g_sim_threads > 0) {
        simulate_loop(n_tasks, fn, ctx);
        pool_time_add(t0);
        return;
    }
    pthread_mutex_lock(&g_pool.submit);
    if (g_pool.size == 0) pool_start();
    if (g_pool.size <= 1) {
        pthread_mutex_unlock(&g_pool.submit);
        tl_thread = 0;
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        tl_thread = -1;
        pool_time_add(t0);
        return;
    }
    g_pool.fn = fn;
    g_pool.ctx = ctx;
    g_pool.n_tasks = n_tasks;
    atomic_store(&g_pool.next, 0);
    atomic_store(&g_pool.pending, g_pool.size - 1);
    atomic_fetch_add(&g_pool.generation, 1);   /* publishes the job (sequentially consistent) */
    const bool woke = atomic_load(&g_pool.sleepers) > 0;
    if (woke) {
        pthread_mutex_lock(&g_pool.mu);
        pthread_cond_broadcast(&g_pool.cv_work);
        pthread_mutex_unlock(&g_pool.mu);
    }

    run_tasks(0);

    /* a woken worker is often queued on this CPU (the scheduler's wake-affinity) and would wait
     * for the spin to end: after a wake-up the caller sleeps at once */
    if (woke || !spin_until(job_done, NULL)) {
        pthread_mutex_lock(&g_pool.mu);
        while (atomic_load(&g_pool.pending) > 0) pthread_cond_wait(&g_pool.cv_done, &g_pool.mu);
        pthread_mutex_unlock(&g_pool.mu);
    }
    g_pool.fn = NULL;
    pthread_mutex_unlock(&g_pool.submit);
    pool_time_add(t0);
}

typedef struct {
    mq_range_fn fn;
    void *ctx;
    int64_t n, step;
} range_job;

static void range_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    const range_job *j = ctx;
    const int64_t lo = t * j->step, hi = j->n - lo < j->step ? j->n : lo + j->step;
    j->fn(j->ctx, lo, hi);
}

void mq_parallel_ranges(int64_t n, int64_t step, bool pool, mq_range_fn fn, void *ctx) {
    range_job j = {fn, ctx, n, step};
    const int64_t nt = (n + step - 1) / step;
    if (pool) mq_parallel_for(nt, range_task, &j);
    else
        for (int64_t t = 0; t < nt; t++) range_task(&j, t, 0);
}
