/*
 * Calibration activations at the layer boundary (see internal.h): fp32 in memory, fp32 in a
 * file of the work directory mapped shared (the kernel writes it back and evicts it under memory
 * pressure: a spill that costs no anonymous memory), or bf16 in memory.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "pipeline/internal.h"

moeq_status mq_actbuf_init(mq_actbuf *b, mq_act_storage kind, size_t n, const char *path,
                           const char *what) {
    memset(b, 0, sizeof *b);
    b->kind = kind;
    b->n = n;
    b->fd = -1;
    if (n == 0) return MOEQ_OK;
    if (kind == MQ_ACT_BF16) {
        b->h = mq_alloc_array(n, sizeof(uint16_t), what);
        return b->h ? MOEQ_OK : MOEQ_E_NOMEM;
    }
    if (kind != MQ_ACT_DISK) {
        b->kind = MQ_ACT_RAM;
        b->f = mq_alloc_array(n, sizeof(float), what);
        return b->f ? MOEQ_OK : MOEQ_E_NOMEM;
    }
    b->path = mq_strdup(path);
    if (!b->path) return MOEQ_E_NOMEM;
    b->fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (b->fd < 0) {
        moeq_status s = mq_err(MOEQ_E_IO, "%s: cannot create the %s file: %s", path, what, strerror(errno));
        mq_actbuf_free(b);
        return s;
    }
    size_t bytes = n * sizeof(float);
    if (ftruncate(b->fd, (off_t)bytes) != 0) {
        moeq_status s = mq_err(MOEQ_E_IO, "%s: cannot size the %s file to %zu bytes: %s", path,
                               what, bytes, strerror(errno));
        mq_actbuf_free(b);
        return s;
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

void mq_actbuf_free(mq_actbuf *b) {
    if (b->kind == MQ_ACT_DISK) {
        if (b->f) munmap(b->f, b->n * sizeof(float));
        if (b->fd >= 0) close(b->fd);
        if (b->path) unlink(b->path);
    } else {
        mq_free(b->f);
        mq_free(b->h);
    }
    free(b->path);
    memset(b, 0, sizeof *b);
    b->fd = -1;
}

const float *mq_actbuf_view(const mq_actbuf *b, size_t off, size_t n, float *scratch) {
    if (b->kind != MQ_ACT_BF16) return b->f + off;
    for (size_t i = 0; i < n; i++) scratch[i] = mq_bf16_to_f32(b->h[off + i]);
    return scratch;
}

void mq_actbuf_put(mq_actbuf *b, size_t off, size_t n, const float *src) {
    if (b->kind == MQ_ACT_BF16) {
        for (size_t i = 0; i < n; i++) b->h[off + i] = mq_f32_to_bf16(src[i]);
    } else if (b->f + off != src) {
        memcpy(b->f + off, src, n * sizeof(float));
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
