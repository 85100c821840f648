#define _GNU_SOURCE   /* mincore, usleep, sched_getaffinity */
/* Core services: status names, errors, the pool, GEMM determinism, half conversions, atomic files. */
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/core.h"
#include "core/env.h"
#include "harness.h"

static void test_status_names(void) {
    ASSERT_EQ_STR("MOEQ_E_FORMAT", moeq_status_name(MOEQ_E_FORMAT));
    ASSERT_EQ_STR("unknown", moeq_status_name((moeq_status)-999));
    ASSERT_EQ_INT(MOEQ_E_IO, mq_err(MOEQ_E_IO, "%s: boom", "x.bin"));
    ASSERT_EQ_STR("x.bin: boom", moeq_last_error());
    mq_err_prefix(MOEQ_E_IO, "loading %s", "m");
    ASSERT_EQ_STR("loading m: x.bin: boom", moeq_last_error());
}

typedef struct {
    int64_t *out;
} sq_ctx;
static void square_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    ((sq_ctx *)ctx)->out[t] = t * t;
}

/* Under qemu-user (MOEQ_CROSS, an emulated cross build) contended locks crawl on a busy host:
 * the tests there keep to one thread. */
static int max_threads(int want) { return getenv("MOEQ_CROSS") ? 1 : want; }

static void test_pool_covers_every_task(void) {
    int64_t out[1000];
    for (int threads = 1; threads <= max_threads(4); threads++) {
        moeq_set_threads(threads);
        memset(out, 0xff, sizeof out);
        sq_ctx c = {out};
        mq_parallel_for(1000, square_task, &c);
        for (int i = 0; i < 1000; i++) ASSERT_EQ_INT((int64_t)i * i, out[i]);
    }
    moeq_set_threads(0);
}

/* mq_parallel_ranges: pieces of `piece` covering [0, n) once each, the last one shorter, on the
 * pool or in order on the caller; n = 0 calls nothing. */
typedef struct {
    int64_t *hits, *los, *his;   /* [n]: how often each index was covered, its piece (checked
                                    on the caller's thread: a failed assert jumps) */
} range_ctx;
static void range_cover(void *ctx, int64_t lo, int64_t hi) {
    const range_ctx *c = ctx;
    for (int64_t i = lo; i < hi; i++) c->hits[i]++, c->los[i] = lo, c->his[i] = hi;
}

static void test_parallel_ranges_cover_once(void) {
    int64_t hits[1000], los[1000], his[1000];
    const int64_t ns[] = {0, 1, 7, 64, 999, 1000};
    for (int threads = 1; threads <= max_threads(3); threads += 2)
        for (size_t k = 0; k < sizeof ns / sizeof *ns; k++)
            for (int pool = 0; pool < 2; pool++) {
                moeq_set_threads(threads);
                memset(hits, 0, sizeof hits);
                range_ctx c = {hits, los, his};
                mq_parallel_ranges(ns[k], 64, pool, range_cover, &c);
                for (int64_t i = 0; i < 1000; i++) ASSERT_EQ_INT(i < ns[k] ? 1 : 0, hits[i]);
                for (int64_t i = 0; i < ns[k]; i++) {
                    ASSERT_EQ_INT(i / 64 * 64, los[i]);
                    ASSERT_EQ_INT((i / 64 + 1) * 64 < ns[k] ? (i / 64 + 1) * 64 : ns[k], his[i]);
                }
            }
    moeq_set_threads(0);
}

/* mq_find_name: every name of a sorted list found at its index, absent ones (before, between,
 * after, a prefix) not, and an empty list. */
static const char *name_of(const void *ctx, size_t i) { return ((const char *const *)ctx)[i]; }

static void test_sorted_find(void) {
    static const char *const names[] = {"a.bias", "a.weight", "b", "b.weight", "mlp.0", "mlp.10", "mlp.2"};
    const size_t n = sizeof names / sizeof *names;
    for (size_t i = 0; i < n; i++) ASSERT_EQ_INT((int64_t)i, mq_find_name(names[i], n, name_of, names));
    const char *absent[] = {"", "a", "a.c", "mlp.1", "mlp.3", "z"};
    for (size_t i = 0; i < sizeof absent / sizeof *absent; i++)
        ASSERT_EQ_INT(-1, mq_find_name(absent[i], n, name_of, names));
    ASSERT_EQ_INT(-1, mq_find_name("a.bias", 0, name_of, names));
}

/* The simulated schedule: tasks in index order, each to the first free worker (hand-made cases),
 * and mq_pool_simulate's loops: P reported, every task once on the caller (thread 0), nested
 * loops inline, the simulated seconds between the longest task and the tasks' sum (and at least
 * the sum over P); tasks that spin for a known time on the thread's CPU clock (the one simulated
 * tasks are timed by) give known durations, however loaded the machine. */
typedef struct {
    int64_t *count;
    int *threads_seen;
    double spin;   /* CPU seconds */
    useconds_t sleep;
} sim_ctx;

static void sim_task(void *vctx, int64_t t, int thread) {
    const sim_ctx *c = vctx;
    c->count[t]++;
    if (thread != 0) *c->threads_seen = thread;
    const double a = mq_cpu_now();
    while (mq_cpu_now() - a < c->spin) {
    }
    if (c->sleep) usleep(c->sleep);
}

static void sim_outer_task(void *vctx, int64_t t, int thread) {
    (void)t;
    (void)thread;
    mq_parallel_for(3, sim_task, vctx);   /* nested: inline, not a loop of its own */
}

static void test_pool_simulation(void) {
    const double a[5] = {4, 1, 1, 1, 1};
    ASSERT_NEAR(4.0, mq_schedule_makespan(a, 5, 2), 0);      /* 4 | 1+1+1+1 */
    ASSERT_NEAR(8.0, mq_schedule_makespan(a, 5, 1), 0);
    const double b[4] = {1, 1, 1, 3};
    ASSERT_NEAR(4.0, mq_schedule_makespan(b, 4, 2), 0);      /* 1+1+... the long one last: 1 + 3 */
    ASSERT_NEAR(3.0, mq_schedule_makespan(b, 4, 8), 0);
    ASSERT_NEAR(0.0, mq_schedule_makespan(b, 0, 4), 0);

    int64_t count[8] = {0};
    int seen = 0;
    sim_ctx c = {count, &seen, 0.02, 0};   /* 20 ms a task */
    mq_pool_simulate(4);
    ASSERT_EQ_INT(4, mq_pool_size());
    const double t0 = mq_now(), c0 = mq_cpu_now();
    mq_parallel_for(8, sim_task, &c);   /* 8 x 20 ms on 4 threads: 40 ms */
    const double dt = mq_now() - t0, dc = mq_cpu_now() - c0;
    double tasks, span;
    mq_pool_simulated(&tasks, &span);
    for (int t = 0; t < 8; t++) ASSERT_EQ_INT(1, count[t]);
    ASSERT_EQ_INT(0, seen);
    ASSERT_TRUE(tasks >= 0.16 && span >= 0.04 && span >= tasks / 4 - 1e-9 && span <= tasks / 2);
    /* the simulated clock moved by the schedule's seconds, not the tasks' sum (160 ms spun) */
    ASSERT_TRUE(dt >= span - 1e-6 && dt < span + 0.02);
    ASSERT_TRUE(dc >= tasks - 1e-6 && dc < tasks + 0.02);   /* this thread's CPU: the tasks' */
    /* waiting is not work: 8 tasks sleeping 20 ms each take next to nothing on the CPU clock, as
     * a task the machine's other processes hold up does not take longer */
    c.spin = 0;
    c.sleep = 20000;
    mq_pool_simulate(4);
    mq_parallel_for(8, sim_task, &c);
    mq_pool_simulated(&tasks, &span);
    ASSERT_TRUE(tasks < 0.02 && span <= tasks + 1e-9);
    c.sleep = 0;
    memset(count, 0, sizeof count);
    mq_parallel_for(2, sim_outer_task, &c);   /* two tasks, each running the inner loop inline */
    for (int t = 0; t < 3; t++) ASSERT_EQ_INT(2, count[t]);
    mq_pool_simulate(0);
    mq_pool_simulated(&tasks, &span);
    ASSERT_NEAR(0.0, tasks + span, 0);   /* stopping resets */
    ASSERT_EQ_INT(moeq_threads(), mq_pool_size());
}

/* The pool's hand-off (pool.c): jobs back to back (workers still spinning), after pauses longer
 * than the spin (workers asleep), of 0, 1, fewer and more tasks than threads, from two user
 * threads at once and across a restart: every task of every job runs exactly once, and its
 * writes are seen by the caller when mq_parallel_for returns. */
enum { HANDOFF_MAX = 97 };
typedef struct {
    _Atomic int runs[HANDOFF_MAX];
    int64_t value[HANDOFF_MAX];
    int64_t stamp;
} handoff_ctx;

static void handoff_task(void *vctx, int64_t t, int thread) {
    (void)thread;
    handoff_ctx *c = vctx;
    atomic_fetch_add(&c->runs[t], 1);
    c->value[t] = c->stamp * 1000 + t;   /* a plain write: the return must publish it */
}

static int handoff_jobs(int jobs, uint32_t seed) {
    handoff_ctx *c = calloc(1, sizeof *c);
    int bad = 0;
    for (int j = 0; j < jobs && !bad; j++) {
        seed = seed * 1103515245u + 12345u;
        const int64_t n = (int64_t)((seed >> 8) % HANDOFF_MAX);
        for (int i = 0; i < HANDOFF_MAX; i++) atomic_store(&c->runs[i], 0);
        c->stamp = j + 1;
        if ((seed >> 20) % 8 == 0) usleep(1000);   /* past the spin: the workers sleep */
        mq_parallel_for(n, handoff_task, c);
        for (int64_t i = 0; i < HANDOFF_MAX; i++)
            if (atomic_load(&c->runs[i]) != (i < n) || (i < n && c->value[i] != c->stamp * 1000 + i)) bad = 1;
    }
    free(c);
    return bad;
}

static void *handoff_thread(void *arg) {
    *(int *)arg = handoff_jobs(400, 7);
    return NULL;
}

static void test_pool_handoff(void) {
    for (int threads = 2; threads <= max_threads(5); threads += 3) {
        moeq_set_threads(threads);
        ASSERT_EQ_INT(0, handoff_jobs(600, 1));
        pthread_t th;
        int other = -1;
        ASSERT_EQ_INT(0, pthread_create(&th, NULL, handoff_thread, &other));
        int mine = handoff_jobs(400, 3);
        pthread_join(th, NULL);
        ASSERT_EQ_INT(0, mine);
        ASSERT_EQ_INT(0, other);
    }
    moeq_set_threads(0);
}

static void test_gemm_matches_naive_and_is_thread_independent(void) {
    const int M = 300, N = 517, K = 129;
    float *A = malloc(sizeof(float) * M * K), *B = malloc(sizeof(float) * N * K);
    float *C1 = malloc(sizeof(float) * M * N), *C2 = malloc(sizeof(float) * M * N);
    uint32_t s = 1;
    for (int i = 0; i < M * K; i++) A[i] = (float)((s = s * 1103515245u + 12345u) >> 16) / 65536.0f - 0.5f;
    for (int i = 0; i < N * K; i++) B[i] = (float)((s = s * 1103515245u + 12345u) >> 16) / 65536.0f - 0.5f;
    moeq_set_threads(1);
    mq_gemm_nt(M, N, K, 1.0f, A, K, B, K, 0.0f, C1, N);
    moeq_set_threads(max_threads(3));
    mq_gemm_nt(M, N, K, 1.0f, A, K, B, K, 0.0f, C2, N);
    moeq_set_threads(0);
    ASSERT_TRUE(memcmp(C1, C2, sizeof(float) * M * N) == 0);
    for (int i = 0; i < M; i += 37)
        for (int j = 0; j < N; j += 41) {
            double acc = 0;
            for (int k = 0; k < K; k++) acc += (double)A[i * K + k] * B[j * K + k];
            ASSERT_NEAR(acc, C1[i * N + j], 1e-4);
        }
    free(A); free(B); free(C1); free(C2);
}

/* MOEQ_THREADS sets the pool's default size (bad values are ignored). */
static void test_threads_from_environment(void) {
    const char *env = getenv("MOEQ_THREADS");
    char saved[32] = "";
    if (env) snprintf(saved, sizeof saved, "%s", env);
    setenv("MOEQ_THREADS", "3", 1);
    moeq_set_threads(0);
    ASSERT_EQ_INT(3, moeq_threads());
    setenv("MOEQ_THREADS", "x", 1);
    moeq_set_threads(0);
    cpu_set_t all, one;
    ASSERT_TRUE(sched_getaffinity(0, sizeof all, &all) == 0);
    ASSERT_EQ_INT(CPU_COUNT(&all), moeq_threads());   /* the CPUs it may run on, as nproc */
    /* restricted to one CPU (as taskset -c or mpirun's binding to a core would): one thread */
    int first = 0;
    while (!CPU_ISSET(first, &all)) first++;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    ASSERT_TRUE(sched_setaffinity(0, sizeof one, &one) == 0);
    moeq_set_threads(0);
    ASSERT_EQ_INT(1, moeq_threads());
    ASSERT_TRUE(sched_setaffinity(0, sizeof all, &all) == 0);
    if (env) setenv("MOEQ_THREADS", saved, 1);   /* the run's own setting, for the cases after */
    else unsetenv("MOEQ_THREADS");
    moeq_set_threads(0);
}

/* MOEQ_PIN_THREADS=1: each worker runs on its own allowed CPU (the i-th for worker i), the caller
 * keeps the process's mask. */
typedef struct {
    int count[64], cpu[64];   /* per task: the CPUs its thread may use, the first of them */
    int thread[64];
} pin_probe;

static void pin_probe_task(void *ctx, int64_t t, int thread) {
    pin_probe *p = ctx;
    cpu_set_t m;
    CPU_ZERO(&m);
    sched_getaffinity(0, sizeof m, &m);   /* 0: the calling thread */
    p->count[t] = CPU_COUNT(&m);
    p->cpu[t] = -1;
    for (int c = 0; c < CPU_SETSIZE && p->cpu[t] < 0; c++)
        if (CPU_ISSET(c, &m)) p->cpu[t] = c;
    p->thread[t] = thread;
    usleep(2000);   /* long enough that every worker takes some */
}

static void test_pinned_workers(void) {
    cpu_set_t all;
    ASSERT_TRUE(sched_getaffinity(0, sizeof all, &all) == 0);
    const int n = CPU_COUNT(&all);
    if (n < 2) {
        printf("  (skipped: one CPU)\n");
        return;
    }
    int nth[CPU_SETSIZE], k = 0;   /* the allowed CPUs in order */
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &all)) nth[k++] = c;
    setenv("MOEQ_PIN_THREADS", "1", 1);
    moeq_set_threads(3);
    pin_probe p;
    mq_parallel_for(64, pin_probe_task, &p);
    int by_workers = 0;
    for (int t = 0; t < 64; t++) {
        if (p.thread[t] == 0) {
            ASSERT_EQ_INT(n, p.count[t]);
        } else {
            ASSERT_EQ_INT(1, p.count[t]);
            ASSERT_EQ_INT(nth[p.thread[t] % n], p.cpu[t]);
            by_workers++;
        }
    }
    ASSERT_TRUE(by_workers > 0);
    unsetenv("MOEQ_PIN_THREADS");
    moeq_set_threads(3);   /* a new pool: unpinned */
    mq_parallel_for(64, pin_probe_task, &p);
    for (int t = 0; t < 64; t++) ASSERT_EQ_INT(n, p.count[t]);
    moeq_set_threads(0);
}

static void test_half_conversions(void) {
    ASSERT_EQ_HEX(0x3f80, mq_f32_to_bf16(1.0f));
    ASSERT_EQ_HEX(0x3f80, mq_f32_to_bf16(1.00390625f));      /* tie to even: stays */
    ASSERT_EQ_HEX(0x3f82, mq_f32_to_bf16(1.01171875f));      /* tie to even: rounds up */
    ASSERT_NEAR(1.0, mq_bf16_to_f32(0x3f80), 0);
    ASSERT_EQ_HEX(0x3c00, mq_f32_to_f16(1.0f));
    ASSERT_EQ_HEX(0x7bff, mq_f32_to_f16(65504.0f));
    ASSERT_EQ_HEX(0x7c00, mq_f32_to_f16(65520.0f));          /* rounds to inf */
    ASSERT_EQ_HEX(0x0001, mq_f32_to_f16(0x1p-24f));          /* smallest subnormal */
    ASSERT_EQ_HEX(0x0000, mq_f32_to_f16(0x1p-25f));          /* tie to even: zero */
    ASSERT_EQ_HEX(0x0002, mq_f32_to_f16(0x1.8p-24f));        /* 1.5 ulp: tie to even -> 2 */
    ASSERT_EQ_HEX(0x8000, mq_f32_to_f16(-0.0f));
    ASSERT_NEAR(0x1p-24, mq_f16_to_f32(0x0001), 0);
    ASSERT_NEAR(-2.0, mq_f16_to_f32(0xc000), 0);
    for (uint32_t h = 0; h < 0x7c00; h++) ASSERT_EQ_HEX(h, mq_f32_to_f16(mq_f16_to_f32((uint16_t)h)));
}

static void test_atomic_file_leaves_nothing_on_abort(void) {
    const char *dir = mq_test_tmpdir();
    char path[700];
    snprintf(path, sizeof path, "%s/out.bin", dir);
    mq_atomic_file af;
    ASSERT_OK(mq_atomic_open(&af, path));
    ASSERT_OK(mq_atomic_write(&af, "abc", 3));
    mq_atomic_abort(&af);
    ASSERT_FALSE(mq_file_exists(path));
    ASSERT_OK(mq_write_file_atomic(path, "hello", 5));
    char *buf;
    size_t n;
    ASSERT_OK(mq_read_file(path, &buf, &n));
    ASSERT_EQ_INT(5, n);
    ASSERT_EQ_STR("hello", buf);
    free(buf);
    ASSERT_STATUS(MOEQ_E_IO, mq_read_file("/nonexistent/zzz", &buf, &n));
    ASSERT_ERROR_MENTIONS("/nonexistent/zzz");
}

/* Pages of [p, p + n) in memory, out of all of them (mincore). */
static double resident(const void *p, size_t n) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), np = (n + page - 1) / page;
    unsigned char *v = malloc(np);
    ASSERT_TRUE(v != NULL);
    ASSERT_EQ_INT(0, mincore((void *)p, n, v));
    size_t k = 0;
    for (size_t i = 0; i < np; i++) k += v[i] & 1;
    free(v);
    return (double)k / (double)np;
}

/* mq_touch_pages faults in every page of its regions (a region of odd length ending inside a
 * page, one of several pieces, a NULL one skipped), with several threads, and nothing beside. */
static void test_touch_pages(void) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), n = (size_t)12 << 20;
    char *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_TRUE(m != MAP_FAILED);
    if (m == MAP_FAILED) return;
    (void)madvise(m, n, MADV_NOHUGEPAGE);   /* page by page, so the untouched rest stays out */
    if (resident(m, n) > 0) {
        munmap(m, n);
        SKIP("fresh anonymous pages are resident here before any touch");
    }
    moeq_set_threads(max_threads(3));
    void *base[3] = {m, NULL, m + 8 * page};
    const size_t bytes[3] = {5 * page + 123, 4 * page, (size_t)5 << 20};   /* [8 pages, +5 MB) */
    mq_touch_pages(base, bytes, 3);
    moeq_set_threads(0);
    ASSERT_TRUE(resident(m, 6 * page) == 1.0);
    ASSERT_TRUE(resident(m + 6 * page, 2 * page) == 0.0);   /* between the regions */
    ASSERT_TRUE(resident(m + 8 * page, (size_t)5 << 20) == 1.0);
    ASSERT_TRUE(resident(m + 8 * page + ((size_t)5 << 20), n - 8 * page - ((size_t)5 << 20)) == 0.0);
    for (size_t k = 0; k < n; k += 997) ASSERT_TRUE(m[k] == 0);
    munmap(m, n);
}

/* Whether [p, p + n) is mapped (mincore fails with ENOMEM on an unmapped page). */
static bool mapped(const void *p, size_t n) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    unsigned char *v = malloc((n + page - 1) / page);
    ASSERT_TRUE(v != NULL);
    const bool m = mincore((void *)p, n, v) == 0;
    free(v);
    return m;
}

/* Freed blocks of 1 MB or more are handed out again for the same size (the same mapping, zeroed
 * for mq_alloc_zero, on the pool), and never make the process hold more than it would without:
 * a request they cannot serve first unmaps kept blocks of at least its size; mq_mem_release
 * unmaps the rest. */
static void test_recycling(void) {
    const char *off = getenv("MOEQ_RECYCLE");
    if (off && off[0] == '0') SKIP("MOEQ_RECYCLE=0");
    mq_mem_release();
    ASSERT_EQ_INT(0, (long long)mq_mem_kept_bytes());
    const size_t a = (size_t)5 << 20, b = (size_t)7 << 20;
    unsigned char *x = mq_alloc(a, "x");
    ASSERT_TRUE(x != NULL);
    const char *poison = getenv("MOEQ_ALLOC_POISON");
    if (poison && poison[0] == '1') {   /* the poisoned runs do fill what mq_alloc gives */
        size_t other = 0;
        for (size_t k = 0; k < a; k++) other += x[k] != 0xff;
        ASSERT_EQ_INT(0, (long long)other);
    }
    memset(x, 0x5a, a);
    mq_free(x);
    ASSERT_EQ_INT((long long)a, (long long)mq_mem_kept_bytes());
    ASSERT_TRUE(mapped(x, a));
    moeq_set_threads(max_threads(3));
    unsigned char *y = mq_alloc_zero(a, "y");
    ASSERT_TRUE(y == x);
    ASSERT_EQ_INT(0, (long long)mq_mem_kept_bytes());
    size_t nonzero = 0;
    for (size_t k = 0; k < a; k++) nonzero += y[k] != 0;
    ASSERT_EQ_INT(0, (long long)nonzero);
    mq_free(y);
    unsigned char *z = mq_alloc(b, "z");   /* another size: the kept block is unmapped first */
    ASSERT_TRUE(z != NULL);
    ASSERT_EQ_INT(0, (long long)mq_mem_kept_bytes());
    mq_free(z);
    ASSERT_EQ_INT((long long)b, (long long)mq_mem_kept_bytes());
    mq_mem_release();
    ASSERT_EQ_INT(0, (long long)mq_mem_kept_bytes());
    ASSERT_TRUE(!mapped(z, b));
    moeq_set_threads(0);
}

/* mq_prefetch reads a mapped file ahead: pages dropped from the page cache are back after it
 * (the kernel reads them in the background: waited for, up to 10 s). Skips where the pages
 * cannot be dropped (tmpfs, or a file system that keeps them). */
static void test_prefetch_reads_ahead(void) {
    /* qemu-user (MOEQ_CROSS) takes madvise's hints without passing them to the host */
    if (getenv("MOEQ_CROSS")) SKIP("under qemu-user madvise(MADV_WILLNEED) is not passed on");
    char path[4096];
    snprintf(path, sizeof path, "%s/prefetch.bin", mq_test_tmpdir());
    const size_t n = (size_t)16 << 20;
    unsigned char *buf = malloc(n);
    ASSERT_TRUE(buf != NULL);
    for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(i * 2654435761u >> 24);
    int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    ASSERT_TRUE(fd >= 0);
    ASSERT_TRUE(write(fd, buf, n) == (ssize_t)n);
    ASSERT_EQ_INT(0, fsync(fd));
    ASSERT_EQ_INT(0, posix_fadvise(fd, 0, (off_t)n, POSIX_FADV_DONTNEED));
    close(fd);
    mq_map m;
    ASSERT_EQ_INT(MOEQ_OK, mq_map_file(path, &m));
    const double before = resident(m.data, m.size);
    if (before > 0.5) {
        mq_unmap(&m);
        unlink(path);
        free(buf);
        SKIP("the file's pages stay in memory here (%.0f%% after POSIX_FADV_DONTNEED)", 100 * before);
    }
    mq_prefetch((const unsigned char *)m.data + 4096 + 17, m.size - 8192);   /* unaligned ends */
    double after = 0;
    for (int i = 0; i < 1000 && (after = resident(m.data, m.size)) < 0.99; i++) usleep(10000);
    printf("  resident before %.3f, after mq_prefetch %.3f\n", before, after);
    ASSERT_TRUE(after >= 0.99);
    ASSERT_TRUE(memcmp(m.data, buf, n) == 0);
    mq_prefetch(NULL, 0);   /* a hint: nothing to do, nothing fails */
    mq_unmap(&m);
    unlink(path);
    free(buf);
}

/* The advice on OpenBLAS's kernel set: only sets without AVX2 on a CPU with AVX2 and FMA, in
 * OpenBLAS's spelling of either case; SkylakeX with AVX-512, else Haswell. */
static void test_blas_advice(void) {
    ASSERT_TRUE(mq_blas_advice_for("Prescott", true, true) && !strcmp(mq_blas_advice_for("Prescott", true, true), "SkylakeX"));
    ASSERT_TRUE(!strcmp(mq_blas_advice_for("PRESCOTT", true, false), "Haswell"));
    ASSERT_TRUE(!strcmp(mq_blas_advice_for("Sandybridge", true, false), "Haswell"));   /* AVX without AVX2 */
    ASSERT_TRUE(!strcmp(mq_blas_advice_for("Nehalem", true, true), "SkylakeX"));
    ASSERT_TRUE(!strcmp(mq_blas_advice_for("Unknown", true, false), "Haswell"));
    ASSERT_TRUE(mq_blas_advice_for("Prescott", false, false) == NULL);   /* the CPU has nothing better */
    ASSERT_TRUE(mq_blas_advice_for("Haswell", true, true) == NULL);      /* OpenBLAS's own choice for Zen */
    ASSERT_TRUE(mq_blas_advice_for("SkylakeX", true, true) == NULL);
    ASSERT_TRUE(mq_blas_advice_for("Cooperlake", true, true) == NULL);
    ASSERT_TRUE(mq_blas_advice_for("Zen", true, false) == NULL);
    ASSERT_TRUE(mq_blas_advice_for("armv8", false, false) == NULL);
    ASSERT_TRUE(mq_blas_advice_for(NULL, true, true) == NULL);
    ASSERT_TRUE(moeq_blas_kernels() && *moeq_blas_kernels());
}

/* Environment switches (core/env.h): read from a snapshot taken again at a job's start; a
 * measurement aid's new MOEQ_DEBUG_* name wins over its earlier name, which still works alone. */
static void test_env_switches(void) {
    char keep[64] = "", keep_old[64] = "";   /* the run's own settings, put back at the end */
    const bool had = getenv("MOEQ_DEBUG_SNAPSHOT_EVERY"), had_old = getenv("MOEQ_SNAPSHOT_EVERY");
    if (had) snprintf(keep, sizeof keep, "%s", getenv("MOEQ_DEBUG_SNAPSHOT_EVERY"));
    if (had_old) snprintf(keep_old, sizeof keep_old, "%s", getenv("MOEQ_SNAPSHOT_EVERY"));
    unsetenv("MOEQ_DEBUG_SNAPSHOT_EVERY");
    setenv("MOEQ_SNAPSHOT_EVERY", "3", 1);
    mq_env_reload();
    ASSERT_TRUE(mq_env(MQ_ENV_SNAPSHOT_EVERY) && !strcmp(mq_env(MQ_ENV_SNAPSHOT_EVERY), "3"));
    setenv("MOEQ_DEBUG_SNAPSHOT_EVERY", "5", 1);
    ASSERT_TRUE(!strcmp(mq_env(MQ_ENV_SNAPSHOT_EVERY), "3"));   /* the snapshot until a job starts */
    mq_env_reload();
    ASSERT_TRUE(!strcmp(mq_env(MQ_ENV_SNAPSHOT_EVERY), "5"));
    unsetenv("MOEQ_DEBUG_SNAPSHOT_EVERY");
    unsetenv("MOEQ_SNAPSHOT_EVERY");
    mq_env_reload();
    ASSERT_TRUE(mq_env(MQ_ENV_SNAPSHOT_EVERY) == NULL && !mq_env_set(MQ_ENV_SNAPSHOT_EVERY));
    if (had) setenv("MOEQ_DEBUG_SNAPSHOT_EVERY", keep, 1);
    if (had_old) setenv("MOEQ_SNAPSHOT_EVERY", keep_old, 1);
    mq_env_reload();
}

TEST_MAIN(T(test_status_names), T(test_pool_covers_every_task), T(test_parallel_ranges_cover_once), T(test_sorted_find), T(test_pool_handoff), T(test_threads_from_environment), T(test_pinned_workers),
          T(test_gemm_matches_naive_and_is_thread_independent), T(test_half_conversions),
          T(test_atomic_file_leaves_nothing_on_abort), T(test_prefetch_reads_ahead), T(test_touch_pages), T(test_recycling),
          T(test_blas_advice), T(test_pool_simulation), T(test_env_switches))
