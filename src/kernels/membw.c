/*
 * Streaming read bandwidth of this machine (for `moeq bench moe-ffn`): every pool thread reads a
 * fixed slice of a large buffer (on transparent huge pages, like the packed experts), summing
 * 64-bit words, repeated until min_seconds pass; the best pass counts. Plain C: the hardware
 * prefetchers follow a sequential stream well (software prefetch made this loop slower here).
 */
#define _DEFAULT_SOURCE   /* madvise(MADV_HUGEPAGE) */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kernels/moe_ffn.h"

enum { SLICES = 64 };

typedef struct {
    const uint64_t *buf;
    size_t words;
    uint64_t sums[SLICES];
} bw_ctx;

static void bw_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    bw_ctx *c = ctx;
    size_t n = c->words / SLICES, i0 = (size_t)task * n;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = i0; i + 4 <= i0 + n; i += 4) {
        s0 += c->buf[i];
        s1 += c->buf[i + 1];
        s2 += c->buf[i + 2];
        s3 += c->buf[i + 3];
    }
    c->sums[task] = s0 + s1 + s2 + s3;
}

double mq_measure_read_gbps(size_t bytes, double min_seconds) {
    bw_ctx c;
    memset(&c, 0, sizeof c);
    const size_t huge = (size_t)2 << 20;
    bytes = (bytes + huge - 1) & ~(huge - 1);
    c.words = bytes / 8;
    if (c.words < SLICES * 4) return 0.0;
    uint64_t *buf = aligned_alloc(huge, bytes);
    if (!buf) return 0.0;
#ifdef MADV_HUGEPAGE
    madvise(buf, bytes, MADV_HUGEPAGE);
#endif
    for (size_t i = 0; i < c.words; i++) buf[i] = i * 0x9E3779B97F4A7C15ull;
    c.buf = buf;
    double best = 0.0, t_end = mq_now() + min_seconds;
    int reps = 0;
    do {
        double t0 = mq_now();
        mq_parallel_for(SLICES, bw_task, &c);
        double dt = mq_now() - t0;
        double gbps = (double)(c.words / SLICES * SLICES) * 8.0 / dt * 1e-9;
        if (gbps > best) best = gbps;
        reps++;
    } while (mq_now() < t_end || reps < 3);
    free(buf);
    return best;
}
