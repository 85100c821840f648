/* Process-wide plumbing: progress and log callbacks, the interrupt flag, CPU features, time. */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "core/env.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

static moeq_progress_fn g_progress;
static void *g_progress_user;
static moeq_log_fn g_log;
static void *g_log_user;
static volatile sig_atomic_t g_interrupt;
static int g_force_ref = -1;   /* -1: not decided yet (read MOEQ_FORCE_REF) */
static int g_avx512_off = -1;  /* -1: not decided yet (read MOEQ_NO_AVX512) */

void moeq_set_progress(moeq_progress_fn fn, void *user) {
    g_progress = fn;
    g_progress_user = user;
}

void mq_progress(const char *label, int64_t done, int64_t total) {
    if (g_progress) g_progress(g_progress_user, label, done, total);
}

void moeq_set_log(moeq_log_fn fn, void *user) {
    g_log = fn;
    g_log_user = user;
}

void mq_log(int level, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (g_log)
        g_log(g_log_user, level, buf);
    else
        fprintf(stderr, "moeq: %s%s\n", level > 0 ? "warning: " : "", buf);
}

void moeq_interrupt(void) { g_interrupt = 1; }
void moeq_clear_interrupt(void) { g_interrupt = 0; }
int moeq_interrupted(void) { return g_interrupt != 0; }

void moeq_set_force_ref(int on) { g_force_ref = on ? 1 : 0; }

bool mq_force_ref(void) {
    if (g_force_ref < 0) {
        const char *e = mq_env(MQ_ENV_FORCE_REF);
        g_force_ref = (e && *e && strcmp(e, "0") != 0) ? 1 : 0;
    }
    return g_force_ref == 1;
}

bool mq_cpu_has_avx2_fma(void) {
#if defined(__x86_64__) || defined(__i386__)
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return cached == 1;
#else
    return false;
#endif
}

void mq_set_avx512_off(int off) { g_avx512_off = off < 0 ? -1 : off ? 1 : 0; }

static bool avx512_off(void) {
    if (g_avx512_off < 0) {
        const char *e = mq_env(MQ_ENV_NO_AVX512);
        g_avx512_off = (e && *e && strcmp(e, "0") != 0) ? 1 : 0;
    }
    return g_avx512_off == 1;
}

/* 0: none, 1: F/BW/VL, 2: also VNNI (libgcc's detection checks that the OS saves the zmm and
 * mask registers, XCR0, before it reports any AVX-512 feature). */
static int avx512_level(void) {
#if defined(__x86_64__) || defined(__i386__)
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = mq_cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") &&
                 __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
        if (cached && __builtin_cpu_supports("avx512vnni")) cached = 2;
    }
    return cached;
#else
    return 0;
#endif
}

bool mq_cpu_has_avx512(void) { return avx512_level() >= 1 && !avx512_off(); }
bool mq_cpu_has_avx512_vnni(void) { return avx512_level() >= 2 && !avx512_off(); }

bool mq_cpu_has_neon_dot(void) {
#if defined(__aarch64__) && defined(__linux__)
    static int cached = -1;
    if (cached < 0) cached = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
    return cached == 1;
#else
    return false;
#endif
}

mq_isa mq_cpu_isa(void) {
    if (mq_force_ref()) return MQ_ISA_REF;
#if defined(__aarch64__)
    return mq_cpu_has_neon_dot() ? MQ_ISA_NEON_DOT : MQ_ISA_NEON;
#else
    if (mq_cpu_has_avx512_vnni()) return MQ_ISA_AVX512_VNNI;
    if (mq_cpu_has_avx512()) return MQ_ISA_AVX512;
    return mq_cpu_has_avx2_fma() ? MQ_ISA_AVX2 : MQ_ISA_REF;
#endif
}

const char *moeq_cpu_kernels(void) {
    if (mq_force_ref()) return "scalar (forced)";
#if defined(__aarch64__)
    return mq_cpu_has_neon_dot() ? "neon+dotprod" : "neon";
#endif
    if (mq_cpu_has_avx512_vnni()) return "avx512+vnni";
    if (mq_cpu_has_avx512()) return "avx512";
    if (avx512_level() > 0) return "avx2+fma (avx512 off)";
    return mq_cpu_has_avx2_fma() ? "avx2+fma" : "scalar";
}

static _Atomic int64_t g_skipped_ns;   /* mq_clock_skip's sum */

double mq_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    const int64_t skipped = atomic_load_explicit(&g_skipped_ns, memory_order_relaxed);
    return (double)ts.tv_sec + 1e-9 * (double)(ts.tv_nsec - skipped);
}

void mq_clock_skip(double seconds) {
    if (seconds > 0) atomic_fetch_add_explicit(&g_skipped_ns, (int64_t)(seconds * 1e9), memory_order_relaxed);
}

static _Atomic int g_thread_cpu;   /* mq_clock_simulating */

void mq_clock_simulating(bool on) { atomic_store(&g_thread_cpu, on ? 1 : 0); }

double mq_cpu_now(void) {
    struct timespec ts;
    clock_gettime(atomic_load(&g_thread_cpu) ? CLOCK_THREAD_CPUTIME_ID : CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
