/*
 * The streaming engine's boundary store: the activations that cross from one decoder layer to the
 * next, for every row unit a client streams (quantize's calibration samples, eval's windows),
 * fp32 in memory, fp32 in a file of a work directory mapped shared (the kernel writes it back and
 * evicts it under memory pressure: a spill that costs no anonymous memory), or bf16 in memory.
 * A file-backed boundary is a pair (read one, write the other: mq_actbuf_swap after each layer),
 * so the file of the last finished layer stays intact until the next one is.
 */
#ifndef MOEQ_STREAM_BOUNDARY_H
#define MOEQ_STREAM_BOUNDARY_H

#include "backend/gpu.h"
#include "core/core.h"

typedef enum {
    MQ_ACT_AUTO = 0,   /* in memory when the budget allows, else spilled to the work directory */
    MQ_ACT_RAM,        /* fp32 in memory */
    MQ_ACT_DISK,       /* fp32 in files of the work directory (mapped; the page cache holds them) */
    MQ_ACT_BF16,       /* bf16 in memory: half the memory, changes the results slightly */
} mq_act_storage;
const char *mq_act_storage_name(mq_act_storage s);   /* "auto", "ram", "disk", "bf16" */

/* n values: fp32 in memory or in a mapped work file, or bf16 in memory. */
typedef struct {
    mq_act_storage kind;          /* RAM, DISK or BF16 */
    float *f;                     /* RAM / DISK */
    uint16_t *h;                  /* BF16 */
    size_t n;                     /* values */
    int fd;
    char *path;                   /* DISK */
    bool keep;                    /* DISK: the file outlives the buffer (a resumable run's) */
    bool pinned;                  /* RAM, page-locked for the GPU (mq_actbuf_pin) */
} mq_actbuf;

/* A new buffer of n values (zeros; a DISK file is created or truncated at path). */
moeq_status mq_actbuf_init(mq_actbuf *b, mq_act_storage kind, size_t n, const char *path,
                           const char *what);
/* A DISK buffer on the file at path, made n values long if it is not; its contents (a resumed
 * run's) are kept, and the file stays when the buffer is freed. */
moeq_status mq_actbuf_open_kept(mq_actbuf *b, size_t n, const char *path, const char *what);
void mq_actbuf_free(mq_actbuf *b);
/* A DISK buffer's pages written to its file and the file synced; other kinds: nothing. */
moeq_status mq_actbuf_sync(mq_actbuf *b);
/* The two buffers of a file-backed boundary change roles (the next layer reads what this one
 * wrote); in-memory boundaries are updated in place and stay. */
void mq_actbuf_swap(mq_actbuf *cur, mq_actbuf *next);
/* Page-locks a RAM buffer for GPU g (the calibration passes copy every sample to and from it);
 * anything else, or a refusal, leaves it as it was. */
void mq_actbuf_pin(mq_actbuf *b, mq_gpu *g);
/* Sample s's n values: a pointer into the buffer (fp32 kinds) or converted into scratch. */
const float *mq_actbuf_view(const mq_actbuf *b, size_t off, size_t n, float *scratch);
/* Writes n values at off (no copy when src already is the buffer's own memory). */
void mq_actbuf_put(mq_actbuf *b, size_t off, size_t n, const float *src);
/* dst = src, n floats, over the pool for large n (activations of a sample). */
void mq_copy_floats(float *dst, const float *src, size_t n);
/* A writable fp32 pointer (fp32 kinds only). */
float *mq_actbuf_ptr(mq_actbuf *b, size_t off);
/* The storage itself at value off (fp32 or bf16; *elem_bytes tells), for moving it between ranks. */
void *mq_actbuf_raw(mq_actbuf *b, size_t off, size_t *elem_bytes);

#endif
