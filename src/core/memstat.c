/*
 * Memory figures of the process and the machine, read from /proc (Linux; 0 elsewhere), and a
 * watcher thread that records the peak of the process's anonymous resident memory: the figure
 * the streaming pipeline plans and reports (file-backed pages of the mmapped source checkpoint
 * and of spilled work files are the kernel's page cache and do not count).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"

/* The value in kB of "key:" in a /proc file, in bytes; -1 when absent. */
static int64_t proc_kb(const char *path, const char *key) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[256];
    size_t klen = strlen(key);
    int64_t v = -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, klen) == 0 && line[klen] == ':') {
            v = strtoll(line + klen + 1, NULL, 10) * 1024;
            break;
        }
    }
    fclose(f);
    return v;
}

int64_t mq_mem_anon_bytes(void) {
    int64_t v = proc_kb("/proc/self/status", "RssAnon");
    return v < 0 ? 0 : v;
}

int64_t mq_mem_total_bytes(void) {
    int64_t v = proc_kb("/proc/meminfo", "MemTotal");
    return v < 0 ? 0 : v;
}

int64_t mq_mem_available_bytes(void) {
    int64_t v = proc_kb("/proc/meminfo", "MemAvailable");
    return v < 0 ? mq_mem_total_bytes() : v;
}

int64_t moeq_default_memory_budget(void) {
    int64_t avail = mq_mem_available_bytes(), total = mq_mem_total_bytes();
    int64_t b = (int64_t)(0.85 * (double)(avail > 0 ? avail : total));
    if (total > 0 && b > total - ((int64_t)2 << 30)) b = total - ((int64_t)2 << 30);
    return b > ((int64_t)1 << 30) ? b : ((int64_t)1 << 30);
}

/* ---- the watcher ------------------------------------------------------------------------- */
enum { WATCH_PERIOD_MS = 10 };

static pthread_mutex_t g_watch_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_t g_watch_thread;
static int g_watch_users;
static atomic_bool g_watch_stop;
static atomic_llong g_watch_peak, g_watch_peak_total;

static void watch_sample(void) {
    long long v = (long long)mq_mem_anon_bytes();
    long long p = atomic_load(&g_watch_peak);
    while (v > p && !atomic_compare_exchange_weak(&g_watch_peak, &p, v)) {
    }
    p = atomic_load(&g_watch_peak_total);
    while (v > p && !atomic_compare_exchange_weak(&g_watch_peak_total, &p, v)) {
    }
}

static void *watch_main(void *arg) {
    (void)arg;
    const struct timespec ts = {0, WATCH_PERIOD_MS * 1000000L};
    while (!atomic_load(&g_watch_stop)) {
        watch_sample();
        nanosleep(&ts, NULL);
    }
    return NULL;
}

void mq_mem_watch_start(void) {
    pthread_mutex_lock(&g_watch_lock);
    if (g_watch_users++ == 0) {
        atomic_store(&g_watch_stop, false);
        atomic_store(&g_watch_peak, 0);
        atomic_store(&g_watch_peak_total, 0);
        if (pthread_create(&g_watch_thread, NULL, watch_main, NULL) != 0) g_watch_users = 0;
    }
    pthread_mutex_unlock(&g_watch_lock);
    watch_sample();
}

void mq_mem_watch_stop(void) {
    pthread_mutex_lock(&g_watch_lock);
    if (g_watch_users > 0 && --g_watch_users == 0) {
        atomic_store(&g_watch_stop, true);
        pthread_join(g_watch_thread, NULL);
    }
    pthread_mutex_unlock(&g_watch_lock);
}

int64_t mq_mem_watch_take_peak(void) {
    watch_sample();
    long long p = atomic_exchange(&g_watch_peak, 0);
    watch_sample();   /* the next interval starts at the current level */
    return (int64_t)p;
}

int64_t mq_mem_watch_peak(void) {
    watch_sample();
    return (int64_t)atomic_load(&g_watch_peak_total);
}
