/*
 * The streaming engine: one layer-by-layer pass over a model (or two in lockstep) that does not
 * know which client drives it. Quantize (src/pipeline/: calibration, Hessians, GPTQ, the writer)
 * and eval (src/eval/stream.c: windows, logits, scores) are its two clients.
 *
 * What it owns: the layer iteration (every row unit through layer l before any through l + 1;
 * with two streams, stream 1's layer l before stream 0's), each layer's weights loaded through the
 * lazy model and released after it, the next step's read ahead while this one runs, the boundary
 * store's pair swapped after each layer (boundary.h), progress in row units with an ETA
 * (mq_progress), and Ctrl-C polled between items and between layers. What a client brings: the
 * parts it wants loaded, and its callbacks per layer (begin_layer, run_item or run_layer,
 * end_layer, layer_done). The memory plan stays the client's (it knows its scratch); the engine's
 * part of it is one layer's weights (two with read-ahead) and the boundary's rows.
 */
#ifndef MOEQ_STREAM_ENGINE_H
#define MOEQ_STREAM_ENGINE_H

#include <stdatomic.h>
#include <pthread.h>

#include "model/model.h"
#include "stream/boundary.h"

enum { MQ_ENGINE_STREAMS = 2 };

/* ---- read-ahead: one set of parts read on a background thread ahead of its load ------------- */
typedef struct {
    mq_lazy_ahead *a;   /* NULL: idle */
    const mq_lazy_model *lz;
    int l, e0, e1;
    unsigned what;
} mq_readahead;

/* Starts reading parts `what` of layer l (experts [e0, e1)) of lz ahead; nothing when the slot is
 * busy, lz is NULL or there is nothing to read. */
moeq_status mq_readahead_start(mq_readahead *r, mq_lazy_model *lz, int l, unsigned what, int e0,
                               int e1);
/* Before parts `what` of layer l of lz are loaded: a read-ahead of exactly them is finished (they
 * then count as loaded) where finish_ok, one that overlaps them is cancelled; by_thread and pieces
 * (may be NULL) say how much its thread did. */
moeq_status mq_readahead_take(mq_readahead *r, const mq_lazy_model *lz, int l, unsigned what,
                              int e0, int e1, bool finish_ok, int64_t *by_thread,
                              int64_t *pieces);
void mq_readahead_cancel(mq_readahead *r);

/* ---- progress: row units done of a total, printed by the thread that made it -------------- */
typedef struct {
    const char *label;
    atomic_int_fast64_t done;
    int64_t total;
    pthread_t caller;
} mq_engine_progress;

/* Counts from 0 of total (more may be added to total before the first unit); the calling thread
 * is the one that prints. */
void mq_engine_progress_init(mq_engine_progress *pr, const char *label, int64_t total);
void mq_engine_progress_add(mq_engine_progress *pr, int64_t units);
/* Seconds left at the rate since `mark` units were done, `elapsed` seconds ago (0 before any). */
double mq_engine_progress_eta(const mq_engine_progress *pr, int64_t mark, double elapsed);

/* ---- items over the pool ------------------------------------------------------------------- */
/* fn(user, item, worker) for items [0, n), each once, on `workers` tasks taking items in turn
 * (worker: the task's index, for its scratch); fewer items than workers run one at a time on the
 * caller with the whole pool inside them. Stops at the first failure (its status and message are
 * returned) or at Ctrl-C (MOEQ_E_INTERRUPTED). The order in which items run is not fixed: fn's
 * results must not depend on it. */
moeq_status mq_engine_items(int64_t n, int workers,
                            moeq_status (*fn)(void *user, int64_t item, int worker), void *user);

/* ---- the layer loop ------------------------------------------------------------------------- */
typedef struct {
    void *user;
    int n_streams;                          /* 1, or 2 in lockstep */
    int first, end;                         /* layers [first, end) */
    int n_layers[MQ_ENGINE_STREAMS];        /* a stream runs the layers it has */
    mq_lazy_model *lz[MQ_ENGINE_STREAMS];   /* where parts() are loaded from; NULL: nothing loaded */
    /* The parts of stream k's layer l loaded (every routed expert) before begin_layer and released
     * after end_layer, or after begin_layer with release_after_begin (it took them: a GPU's
     * upload); NULL or 0: the client loads its own. */
    unsigned (*parts)(void *user, int k, int l);
    bool release_after_begin;
    bool read_ahead;                        /* the next step's parts read while this one runs */
    /* Per step (stream k, layer l): begin_layer, then run_item for every item [0, n_items) over
     * `workers` tasks (mq_engine_items) or else run_layer, then end_layer (always, once begun). */
    moeq_status (*begin_layer)(void *user, int k, int l);
    moeq_status (*run_item)(void *user, int k, int l, int64_t item, int worker);
    moeq_status (*run_layer)(void *user, int k, int l);
    void (*end_layer)(void *user, int k, int l);
    int64_t n_items;
    int workers;
    /* after layer l of every stream, with its seconds (the client's records, a snapshot, ranks) */
    moeq_status (*layer_done)(void *user, int l, double seconds);
    /* stream k's boundary pair: swapped after each layer where file-backed; NULL: the client's */
    mq_actbuf *cur[MQ_ENGINE_STREAMS], *next[MQ_ENGINE_STREAMS];
    /* Ctrl-C polled before each layer: the error's message; NULL: not polled there (a client
     * whose ranks must agree first polls inside its steps) */
    const char *interrupt_msg;
} mq_engine_client;

/* Runs layers [first, end) of every stream; returns the first failure. */
moeq_status mq_engine_run(const mq_engine_client *c);

#endif
