/*
 * The streaming engine's read-ahead slot (engine.h): one set of a lazy model's layer parts read
 * on a thread of the lowest priority (mq_lazy_ahead_start) while the pool computes, finished by
 * the load that wants exactly those parts or cancelled by one that touches some of them (no part
 * may be read while its buffers are being filled). Quantize reads the next expert chunk or the
 * next layer's attention ahead, eval on the GPU the next layer.
 */
#include "stream/engine.h"

moeq_status mq_readahead_start(mq_readahead *r, mq_lazy_model *lz, int l, unsigned what, int e0,
                               int e1) {
    if (r->a || !lz || !what || ((what & MQ_PART_EXPERTS) && e0 >= e1)) return MOEQ_OK;
    moeq_status st = mq_lazy_ahead_start(lz, l, what, e0, e1, &r->a);
    r->lz = lz, r->l = l, r->what = what, r->e0 = e0, r->e1 = e1;
    return st;
}

moeq_status mq_readahead_take(mq_readahead *r, const mq_lazy_model *lz, int l, unsigned what,
                              int e0, int e1, bool finish_ok, int64_t *by_thread,
                              int64_t *pieces) {
    if (!r->a || r->lz != lz || r->l != l || !(r->what & what)) return MOEQ_OK;
    const bool same = finish_ok && r->what == what &&
                      (!(what & MQ_PART_EXPERTS) || (r->e0 == e0 && r->e1 == e1));
    moeq_status st = MOEQ_OK;
    if (same) st = mq_lazy_ahead_finish(r->a, by_thread, pieces);
    else mq_lazy_ahead_cancel(r->a);
    r->a = NULL;
    return st;
}

void mq_readahead_cancel(mq_readahead *r) {
    if (r->a) mq_lazy_ahead_cancel(r->a);
    r->a = NULL;
}
