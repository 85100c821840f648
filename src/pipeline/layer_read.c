/*
 * A layer's read stage: the source's weights of a layer part (the attention, the FFN norm and
 * router, a chunk of routed experts, the shared expert or the dense MLP) converted into fp32 just
 * before the stage that needs them and freed after it, and read ahead of that stage where the
 * plan asks for it. Kept apart from the stages so that every read counts as the layer's read
 * stage, and so that a read-ahead is always finished or cancelled before its parts are touched.
 */
#include <stdlib.h>
#include <sys/resource.h>

#include "pipeline/layer_internal.h"
#include "core/env.h"

/* Read-ahead (the plan's mp.read_ahead; MOEQ_READ_AHEAD=1 only, see memplan.c
 * read_ahead_wanted for why): parts `what` of layer l (experts [e0, e1)) converted on a thread
 * of the lowest priority while the pool computes, so that their read finds them done, or
 * nearly: it converts what is left on the pool. A MoE layer's first expert chunk goes
 * during its attention, each next chunk during the one before, the next layer's attention
 * during the last chunk. The read stage is bound by memory (bf16 in, fp32 out: more of the
 * pool's threads add little to it) and waits for a disk where the source is not in the page
 * cache, so it is worth taking off the compute's path (the callers ask the page cache to read
 * the same parts ahead, mq_lazy_prefetch, which is all that is done where the sources need more
 * than a conversion: mq_lazy_ahead_start). */
moeq_status mq_pipe_start_ahead(mq_pipe *p, int l, unsigned what, int e0, int e1) {
    if (p->mp.read_ahead <= 0 || p->ahead.a || ((what & MQ_PART_EXPERTS) && e0 >= e1)) return MOEQ_OK;
    const double t0 = mq_now(), c0 = mq_cpu_now();   /* the buffers' allocation: the read's */
    moeq_status st = mq_readahead_start(&p->ahead, p->lz, l, what, e0, e1);
    p->layers[l].read += mq_now() - t0;
    p->layers[l].cpu_read += mq_cpu_now() - c0;
    return st;
}

/* The parts mq_pipe_attention_stage reads. */
unsigned mq_pipe_attention_parts(const mq_pipe *p, int l) {
    return MQ_PART_ATTN | MQ_PART_FFN_NORM | (p->m->layers[l].is_moe ? MQ_PART_ROUTER : 0);
}

/* The source's weights of a layer part, read into fp32 (mq_lazy_load_ex) or freed, timed as the
 * layer's read stage; a read-ahead of exactly these parts is finished first (one that overlaps
 * them otherwise is cancelled: no part may be read while its buffers are being filled). */
moeq_status mq_pipe_read_part(mq_pipe *p, int l, unsigned what, int e0, int e1,
                              bool (*alloc_only)(float **dest, void *user), void *user) {
    double t0 = mq_now(), c0 = mq_cpu_now();
    struct rusage r0, r1;
    const bool prof = mq_env(MQ_ENV_PROFILE) != NULL;
    if (prof) getrusage(RUSAGE_SELF, &r0);
    moeq_status st = MOEQ_OK;
    int64_t by_thread = -1, pieces = 0;
    /* through alloc_only a part is allocated, not read: a read-ahead of it is cancelled */
    st = mq_readahead_take(&p->ahead, p->lz, l, what, e0, e1, !alloc_only, &by_thread, &pieces);
    if (!st) st = mq_lazy_load_ex(p->lz, l, what, e0, e1, alloc_only, user);
    p->layers[l].read += mq_now() - t0;
    p->layers[l].cpu_read += mq_cpu_now() - c0;
    if (prof && !getrusage(RUSAGE_SELF, &r1)) {   /* page faults: the source's mapping, fresh buffers */
        char ahead[96] = "";
        if (by_thread >= 0)
            snprintf(ahead, sizeof ahead, "; read ahead, %lld of %lld pieces by its thread", (long long)by_thread,
                     (long long)pieces);
        mq_info("layer %d read, part %u experts %d..%d: %.3f s (%.1f cores busy), %ld minor faults%s", l, what,
                e0, e1, mq_now() - t0, (mq_cpu_now() - c0) / (mq_now() - t0 + 1e-9), r1.ru_minflt - r0.ru_minflt,
                ahead);
    }
    return st;
}

void mq_pipe_drop_part(mq_pipe *p, int l, unsigned what, int e0, int e1) {
    double t0 = mq_now(), c0 = mq_cpu_now();
    mq_lazy_release(p->lz, l, what, e0, e1);
    p->layers[l].read += mq_now() - t0;
    p->layers[l].cpu_read += mq_cpu_now() - c0;
}
