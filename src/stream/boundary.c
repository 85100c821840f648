/*
 * The boundary store of the streaming engine (boundary.h): activations at the layer boundary,
 * fp32 in memory, fp32 in a file of the work directory mapped shared (the kernel writes it back
 * and evicts it under memory pressure: a spill that costs no anonymous memory), or bf16 in
 * memory. Quantize keeps its calibration samples here, eval its windows' rows.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "stream/boundary.h"

static moeq_status open_file(mq_actbuf *b, size_t n, const char *path, const char *what, int flags);

moeq_status mq_actbuf_init(mq_actbuf *b, mq_act_storage kind, size_t n, const char *path,
                           const char *what) {
    memset(b, 0, sizeof *b);
    b->kind = kind;
    b->n = n;
    b->fd = -1;
    if (n == 0) return MOEQ_OK;
    /* In memory: the pages faulted in now, on the pool in 2 MB pieces (each its own huge page),
     * instead of by the first layer's copies of 256 KB, where the piece that first touched a huge
     * page zeroed all 2 MB of it and took ten times the others: the slowest piece set each copy's
     * time, and the first layer's outputs and hooks ran at 2 of 16 threads (simulated). */
    if (kind != MQ_ACT_DISK) {
        const size_t elem = kind == MQ_ACT_BF16 ? sizeof(uint16_t) : sizeof(float);
        void *base = mq_alloc_array(n, elem, what);
        if (!base) return MOEQ_E_NOMEM;
        if (kind == MQ_ACT_BF16) b->h = base;
        else b->kind = MQ_ACT_RAM, b->f = base;
        const size_t bytes = n * elem;
        mq_touch_pages(&base, &bytes, 1);
        return MOEQ_OK;
    }
    return open_file(b, n, path, what, O_TRUNC);
}

/* The DISK kind: the file at path (flags: O_TRUNC for a fresh one) sized and mapped. */
static moeq_status open_file(mq_actbuf *b, size_t n, const char *path, const char *what, int flags) {
    b->path = mq_strdup(path);
    if (!b->path) return MOEQ_E_NOMEM;
    b->fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | flags, 0644);
    if (b->fd < 0) {
        moeq_status s = mq_err(MOEQ_E_IO, "%s: cannot create the %s file: %s", path, what, strerror(errno));
        mq_actbuf_free(b);
        return s;
    }
    size_t bytes = n * sizeof(float);
    struct stat sb;
    if (fstat(b->fd, &sb) != 0 || (size_t)sb.st_size != bytes) {
        if (ftruncate(b->fd, (off_t)bytes) != 0) {
            moeq_status s = mq_err(MOEQ_E_IO, "%s: cannot size the %s file to %zu bytes: %s", path,
                                   what, bytes, strerror(errno));
            mq_actbuf_free(b);
            return s;
        }
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, b->fd, 0);
    if (p == MAP_FAILED) {
        moeq_status s = mq_err(MOEQ_E_IO, "%s: cannot map the %s file: %s", path, what, strerror(errno));
        mq_actbuf_free(b);
        return s;
    }
    b->f = p;
    return MOEQ_OK;
}

moeq_status mq_actbuf_open_kept(mq_actbuf *b, size_t n, const char *path, const char *what) {
    memset(b, 0, sizeof *b);
    b->kind = MQ_ACT_DISK;
    b->n = n;
    b->fd = -1;
    b->keep = true;
    if (n == 0) return mq_err(MOEQ_E_ARG, "%s: an empty %s file", path, what);
    return open_file(b, n, path, what, 0);
}

moeq_status mq_actbuf_sync(mq_actbuf *b) {
    if (b->kind != MQ_ACT_DISK || !b->f) return MOEQ_OK;
    if (msync(b->f, b->n * sizeof(float), MS_SYNC) != 0 || fdatasync(b->fd) != 0)
        return mq_err(MOEQ_E_IO, "%s: sync failed: %s", b->path, strerror(errno));
    return MOEQ_OK;
}

void mq_actbuf_swap(mq_actbuf *cur, mq_actbuf *next) {
    if (cur->kind != MQ_ACT_DISK) return;
    mq_actbuf t = *cur;
    *cur = *next;
    *next = t;
}

void mq_actbuf_pin(mq_actbuf *b, mq_gpu *g) {
    if (!g || b->kind != MQ_ACT_RAM || !b->f || b->pinned) return;
    /* the pages faulted in on the pool before the driver walks them single-threaded (44 GB:
     * 10.5 s pinned untouched) */
    void *base = b->f;
    const size_t bytes = b->n * sizeof(float);
    mq_touch_pages(&base, &bytes, 1);
    b->pinned = mq_gpu_host_register(g, b->f, b->n * sizeof(float));
}

void mq_actbuf_free(mq_actbuf *b) {
    if (b->pinned) mq_gpu_host_unregister(b->f);
    if (b->kind == MQ_ACT_DISK) {
        if (b->f) munmap(b->f, b->n * sizeof(float));
        if (b->fd >= 0) close(b->fd);
        if (b->path && !b->keep) unlink(b->path);
    } else {
        mq_free(b->f);
        mq_free(b->h);
    }
    free(b->path);
    memset(b, 0, sizeof *b);
    b->fd = -1;
}

/* A sample's activations are tens of megabytes at real size (2048 tokens x 2048 values): one
 * core copies them at a few GB/s, which the GPU's calibration waits for sample by sample, so
 * copies and conversions go over the pool in pieces of COPY_PIECE values (each value is moved or
 * rounded alone: the same bytes whatever the pieces). */
enum { COPY_PIECE = 1 << 16 };   /* 256 KB: a 512-token sample of 2048 values is 16 pieces */

typedef struct {
    float *f;              /* fp32 side */
    uint16_t *h;           /* bf16 side, or NULL: fp32 to fp32 */
    const float *src;      /* fp32 source (to bf16 or fp32), or NULL: bf16 h to f */
    size_t n;
} copy_job;

static void copy_piece(void *ctx, int64_t lo, int64_t hi) {
    const copy_job *j = ctx;
    const size_t a = (size_t)lo, e = (size_t)hi;
    if (!j->h)
        memcpy(j->f + a, j->src + a, (e - a) * sizeof(float));
    else if (j->src)
        for (size_t i = a; i < e; i++) j->h[i] = mq_f32_to_bf16(j->src[i]);
    else
        for (size_t i = a; i < e; i++) j->f[i] = mq_bf16_to_f32(j->h[i]);
}

static void copy_run(copy_job *j) { mq_parallel_ranges((int64_t)j->n, COPY_PIECE, j->n > COPY_PIECE, copy_piece, j); }

void mq_copy_floats(float *dst, const float *src, size_t n) {
    if (dst == src || n == 0) return;
    copy_job j = {dst, NULL, src, n};
    copy_run(&j);
}

const float *mq_actbuf_view(const mq_actbuf *b, size_t off, size_t n, float *scratch) {
    if (b->kind != MQ_ACT_BF16) return b->f + off;
    copy_job j = {scratch, b->h + off, NULL, n};
    copy_run(&j);
    return scratch;
}

void mq_actbuf_put(mq_actbuf *b, size_t off, size_t n, const float *src) {
    if (b->kind == MQ_ACT_BF16) {
        copy_job j = {NULL, b->h + off, src, n};
        copy_run(&j);
    } else {
        mq_copy_floats(b->f + off, src, n);
    }
}

float *mq_actbuf_ptr(mq_actbuf *b, size_t off) {
    MQ_ASSERT(b->kind != MQ_ACT_BF16);
    return b->f + off;
}

void *mq_actbuf_raw(mq_actbuf *b, size_t off, size_t *elem_bytes) {
    *elem_bytes = b->kind == MQ_ACT_BF16 ? sizeof(uint16_t) : sizeof(float);
    return b->kind == MQ_ACT_BF16 ? (void *)(b->h + off) : (void *)(b->f + off);
}

const char *mq_act_storage_name(mq_act_storage s) {
    switch (s) {
    case MQ_ACT_RAM: return "ram";
    case MQ_ACT_DISK: return "disk";
    case MQ_ACT_BF16: return "bf16";
    default: return "auto";
    }
}
