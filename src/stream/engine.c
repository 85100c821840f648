/*
 * The streaming engine's layer loop (engine.h): steps (stream k, layer l) in lockstep order, each
 * one's weights loaded through the lazy model (the next step's read ahead where asked), the
 * client's callbacks around its rows, the boundary pair swapped after it; the items of a step
 * spread over the pool; progress in row units. The engine decides no value a client computes:
 * the order in which items run is free, so a client whose item results do not depend on it (each
 * window's forward, each sample's) gets the same bytes at any thread count or budget.
 */
#include <stdio.h>
#include <string.h>

#include "stream/engine.h"

/* ---- progress ------------------------------------------------------------------------------ */
void mq_engine_progress_init(mq_engine_progress *pr, const char *label, int64_t total) {
    pr->label = label;
    atomic_store(&pr->done, 0);
    pr->total = total;
    pr->caller = pthread_self();
}

void mq_engine_progress_add(mq_engine_progress *pr, int64_t units) {
    int64_t done = atomic_fetch_add(&pr->done, units) + units;
    /* a plan's estimate of the units may fall short: never past the total */
    if (done > pr->total) done = pr->total;
    /* the callback is the caller's: printed from its thread only, the others' rows counted */
    if (pthread_equal(pthread_self(), pr->caller)) mq_progress(pr->label, done, pr->total);
}

double mq_engine_progress_eta(const mq_engine_progress *pr, int64_t mark, double elapsed) {
    int64_t done = atomic_load(&pr->done);
    if (done > pr->total) done = pr->total;
    const int64_t ran = done - mark;
    return ran > 0 ? elapsed * (double)(pr->total - done) / (double)ran : 0;
}

/* ---- items over the pool ------------------------------------------------------------------- */
typedef struct {
    moeq_status (*fn)(void *user, int64_t item, int worker);
    void *user;
    int64_t n;
    atomic_int_fast64_t next;
    atomic_int failed;
    moeq_status err;
    char msg[1024];
} items_job;

static void items_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    items_job *j = ctx;
    for (;;) {
        if (atomic_load(&j->failed) || moeq_interrupted()) return;
        const int64_t i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n) return;
        const moeq_status s = j->fn(j->user, i, (int)t);
        if (s) {
            int expected = 0;   /* the first failure's message, from its thread */
            if (atomic_compare_exchange_strong(&j->failed, &expected, 1)) {
                j->err = s;
                snprintf(j->msg, sizeof j->msg, "%s", moeq_last_error());
            }
            return;
        }
    }
}

moeq_status mq_engine_items(int64_t n, int workers,
                            moeq_status (*fn)(void *user, int64_t item, int worker), void *user) {
    items_job j = {.fn = fn, .user = user, .n = n};
    atomic_store(&j.next, 0);
    atomic_store(&j.failed, 0);
    if (workers < 1) workers = 1;
    /* Fewer items than workers: one item at a time with the whole pool inside it, instead of
     * idle threads. */
    if (n < workers) items_task(&j, 0, 0);
    else mq_parallel_for(workers, items_task, &j);
    if (atomic_load(&j.failed)) return mq_err(j.err, "%s", j.msg);
    if (moeq_interrupted()) return MOEQ_E_INTERRUPTED;
    return MOEQ_OK;
}

/* ---- the layer loop ------------------------------------------------------------------------- */
typedef struct {
    const mq_engine_client *c;
    int k, l;
} step_items;

static moeq_status step_item(void *user, int64_t item, int worker) {
    const step_items *j = user;
    return j->c->run_item(j->c->user, j->k, j->l, item, worker);
}

static int experts_of(const mq_lazy_model *lz) { return mq_lazy_model_of((mq_lazy_model *)lz)->cfg.n_experts; }

static unsigned parts_of(const mq_engine_client *c, int k, int l) {
    return c->lz[k] && c->parts ? c->parts(c->user, k, l) : 0;
}

/* The step after (k, l) in lockstep order, false at the end. */
static bool next_step(const mq_engine_client *c, int k, int l, int *nk, int *nl) {
    for (;;) {
        if (--k < 0) {
            k = c->n_streams - 1;
            if (++l >= c->end) return false;
        }
        if (l < c->n_layers[k]) {
            *nk = k, *nl = l;
            return true;
        }
    }
}

static moeq_status run_step(const mq_engine_client *c, mq_readahead *ra, int k, int l) {
    mq_lazy_model *lz = c->lz[k];
    const unsigned parts = parts_of(c, k, l);
    const int E = parts ? experts_of(lz) : 0;
    moeq_status s = MOEQ_OK;
    bool held = false;
    if (parts) {
        s = mq_readahead_take(ra, lz, l, parts, 0, E, true, NULL, NULL);
        if (!s) s = mq_lazy_load(lz, l, parts, 0, E);
        held = true;
    }
    if (!s && c->begin_layer) s = c->begin_layer(c->user, k, l);
    if (held && c->release_after_begin) {   /* the client holds them now (a device's copy) */
        mq_lazy_release(lz, l, parts, 0, E);
        held = false;
    }
    int nk, nl;
    if (!s && c->read_ahead && next_step(c, k, l, &nk, &nl)) {
        const unsigned np = parts_of(c, nk, nl);
        if (np) s = mq_readahead_start(ra, c->lz[nk], nl, np, 0, experts_of(c->lz[nk]));
    }
    if (!s && c->run_item) {
        step_items j = {c, k, l};
        s = mq_engine_items(c->n_items, c->workers, step_item, &j);
    } else if (!s && c->run_layer) {
        s = c->run_layer(c->user, k, l);
    }
    if (c->end_layer) c->end_layer(c->user, k, l);
    if (held) mq_lazy_release(lz, l, parts, 0, E);
    if (!s && c->cur[k]) mq_actbuf_swap(c->cur[k], c->next[k]);
    return s;
}

moeq_status mq_engine_run(const mq_engine_client *c) {
    mq_readahead ra = {0};
    moeq_status s = MOEQ_OK;
    for (int l = c->first; l < c->end && !s; l++) {
        if (c->interrupt_msg && moeq_interrupted()) {
            s = mq_err(MOEQ_E_INTERRUPTED, "%s", c->interrupt_msg);
            break;
        }
        const double t0 = mq_now();
        for (int k = c->n_streams - 1; k >= 0 && !s; k--)
            if (l < c->n_layers[k]) s = run_step(c, &ra, k, l);
        if (!s && c->layer_done) s = c->layer_done(c->user, l, mq_now() - t0);
    }
    mq_readahead_cancel(&ra);
    return s;
}
