/*
 * One decoder layer of the pipeline (see pipeline.h for the stages): mq_pipe_layer runs the
 * attention stage (layer_attention.c), then the FFN stage (layer_ffn.c), adds the FFN's outputs
 * to the boundary and writes what the model's forward lacks; the exchanges of samples between
 * ranks that the stages share are here too. layer_internal.h says which file holds what.
 *
 * The calibration forward of every sample is the model's own forward cut into its parts
 * (model.h: mq_attention_forward, mq_ffn_norm, mq_moe_route, mq_mlp_forward,
 * mq_shared_expert_add), with routed experts run on the same blocks of rows, so the values equal
 * a whole-model forward bit for bit; Hessians get one update per sample, in sample order
 * (IST-DASLab gptq's add_batch per forward), and the experts' outputs are summed per token in
 * increasing expert order, as the forward sums them.
 *
 * Memory: a layer's attention is loaded alone; routed experts are loaded, calibrated, quantized,
 * written and freed a chunk at a time (mq_mem_plan.chunk), so a layer never has to fit at once.
 */
#include <stdlib.h>
#include <string.h>

#include "dist/dist.h"
#include "core/env.h"
#include "kernels/vec.h"
#include "pipeline/layer_internal.h"

void mq_pipe_progress(mq_pipe *p, int64_t units) {
    mq_engine_progress_add(&p->progress, units);
}

moeq_status mq_pipe_check_interrupt(void) {
    return moeq_interrupted() ? mq_err(MOEQ_E_INTERRUPTED, "quantization interrupted") : MOEQ_OK;
}
/* ---- the layer ----------------------------------------------------------------------------- */

moeq_status mq_pipe_share_rows(mq_pipe *p, void *base, size_t per_sample, const char *step) {
    moeq_status st = MOEQ_OK;
    for (int r = 0; r < p->ranks && !st; r++) {
        int64_t lo, hi;
        mq_dist_share(p->calib.n, r, p->ranks, &lo, &hi);
        if (hi > lo) st = mq_dist_bcast((char *)base + (size_t)lo * per_sample, (size_t)(hi - lo) * per_sample, r, step);
    }
    return st;
}

moeq_status mq_pipe_share_samples(mq_pipe *p, mq_actbuf *b, const char *step) {
    size_t es;
    char *base = mq_actbuf_raw(b, 0, &es);
    return mq_pipe_share_rows(p, base, (size_t)p->LD * es, step);
}

moeq_status mq_pipe_gather_samples(mq_pipe *p, mq_actbuf *b, const char *step) {
    size_t es;
    char *base = mq_actbuf_raw(b, 0, &es);
    const size_t per = (size_t)p->LD * es;
    moeq_status st = MOEQ_OK;
    for (int r = 1; r < p->ranks && !st; r++) {
        int64_t lo, hi;
        mq_dist_share(p->calib.n, r, p->ranks, &lo, &hi);
        if (hi <= lo || (p->rank != 0 && p->rank != r)) continue;
        char *at = base + (size_t)lo * per;
        st = p->rank == 0 ? mq_dist_recv(at, (size_t)(hi - lo) * per, r, step)
                          : mq_dist_send(at, (size_t)(hi - lo) * per, 0, step);
    }
    return st;
}

/* zero_out and add_out go over the pool a sample at a time (gigabytes a layer at real size; each
 * value is set or added alone, so the bytes do not depend on the threads). */
static void zero_out_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    mq_pipe *p = ctx;
    const int64_t s = p->s_lo + i;
    memset(mq_actbuf_ptr(&p->OUT, (size_t)(s * p->LD)), 0, sizeof(float) * (size_t)(p->calib.len[s] * p->c->D));
    if (p->target)
        memset(mq_actbuf_ptr(&p->OUTF, (size_t)(s * p->LD)), 0, sizeof(float) * (size_t)(p->calib.len[s] * p->c->D));
}

static void zero_out(mq_pipe *p) {   /* the samples whose outputs this rank computes */
    if (p->s_hi > p->s_lo) mq_parallel_for(p->s_hi - p->s_lo, zero_out_task, p);
}

typedef struct {
    mq_pipe *p;
    mq_actbuf *h, *out;
} add_out_job;

static void add_out_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    const add_out_job *j = ctx;
    const int64_t s = j->p->s_lo + i;
    const size_t off = (size_t)(s * j->p->LD);
    mq_vec()->axpy(1.0f, mq_actbuf_ptr(j->out, off), mq_actbuf_ptr(j->h, off), j->p->calib.len[s] * j->p->c->D);
}

/* boundary h += out, sample by sample (x += out, as the forward adds the FFN's output), for
 * this rank's samples: the quantized stream's (mq_pipe_out_buf += OUT) and the unquantized one's
 * (XF += OUTF). */
static void add_out(mq_pipe *p, mq_actbuf *h, mq_actbuf *out) {
    const mq_vec_kernels *vk = mq_vec();
    const int64_t D = p->c->D;
    float *tmp = NULL;
    if (h->kind != MQ_ACT_BF16) {
        add_out_job j = {p, h, out};
        if (p->s_hi > p->s_lo) mq_parallel_for(p->s_hi - p->s_lo, add_out_task, &j);
        return;
    }
    tmp = mq_alloc_array((size_t)p->LD, sizeof(float), "boundary");
    for (int64_t s = p->s_lo; s < p->s_hi; s++) {
        size_t off = (size_t)(s * p->LD), n = (size_t)(p->calib.len[s] * D);
        const float *o = mq_actbuf_ptr(out, off);
        if (!tmp) continue;   /* out of memory: caught by the caller's check below */
        mq_actbuf_view(h, off, n, tmp);   /* bf16: converted into tmp */
        vk->axpy(1.0f, o, tmp, (int64_t)n);
        mq_actbuf_put(h, off, n, tmp);
    }
    mq_free(tmp);
}

moeq_status mq_pipe_layer(mq_pipe *p, int l, bool replay) {
    double t0 = mq_now(), c0 = mq_cpu_now(), w0, x0, pool0 = mq_pool_seconds(), sim0[2];
    mq_dist_seconds(&w0, &x0);
    mq_pool_simulated(&sim0[0], &sim0[1]);
    mq_layer *ly = &p->m->layers[l];
    /* the source is read ahead of the compute: the first expert chunk during the attention, the
     * next chunk during each chunk (mq_pipe_routed_experts), the next layer's attention during
     * the FFN */
    if (ly->is_moe) {   /* the page cache's part (converted ahead too with MOEQ_READ_AHEAD=1:
                           mq_pipe_attention_stage) */
        int64_t lo = 0, hi = p->c->n_experts;
        if (p->ranks > 1) mq_dist_share(p->c->n_experts, p->rank, p->ranks, &lo, &hi);
        const int C = p->mp.chunk > 0 ? p->mp.chunk : p->c->n_experts;
        mq_lazy_prefetch(p->lz, l, MQ_PART_EXPERTS, (int)lo, (int)(lo + C < hi ? lo + C : hi));
    }
    moeq_status st = mq_pipe_attention_stage(p, l, replay);
    /* GPTQ's kept scratch goes with each stage (here, after the routed experts and after the FFN):
     * the plan counts one stage's (K = the attention's widest input; DeepSeek-V3's o_proj, 16384,
     * is 2.3x its experts' 7168) */
    mq_gptq_release_scratch();
    if (!st && l + 1 < p->c->n_layers)
        mq_lazy_prefetch(p->lz, l + 1, mq_pipe_attention_parts(p, l + 1), 0, 0);
    if (!st) {
        /* OUT gathers the FFN's outputs, unless the GPU's combined ones overwrite all of it */
        if (!mq_pipe_experts_on_device(p, l, replay) || p->target) zero_out(p);
        if (ly->is_moe) {
            st = mq_pipe_routed_experts(p, l, replay);
            mq_gptq_release_scratch();
            if (!st && p->c->shared_ffn > 0) st = mq_pipe_mlp_unit(p, l, true, replay);
        } else {
            st = mq_pipe_mlp_unit(p, l, false, replay);
        }
    }
    mq_gptq_release_scratch();   /* the dense or shared FFN's */
    if (!st && !p->layers[l].gpu_residual) add_out(p, mq_pipe_out_buf(p), &p->OUT);
    if (!st && p->target) add_out(p, &p->XF, &p->OUTF);
    if (p->ranks > 1) {
        /* each rank goes on with its samples; rank 0 gathers the boundary for its snapshot */
        char step[48];
        snprintf(step, sizeof step, "layer %d: outputs", l);
        st = mq_dist_agree(st, step);
        if (!st && !replay && l + 1 < p->plan.n_layers) st = mq_pipe_gather_samples(p, mq_pipe_out_buf(p), step);
        if (!st && !replay && l + 1 < p->plan.n_layers && p->target) st = mq_pipe_gather_samples(p, &p->XF, step);
    }
    if (!st) mq_actbuf_swap(&p->X, &p->X2);   /* files: the next layer reads what this one wrote */
    if (!st && !replay) st = mq_pipe_layer_rtn(p, l);   /* Linears the model's forward lacks */
    if (!st && !replay) st = mq_pipe_write_passthrough(p, l);
    mq_pipe_drop_part(p, l, MQ_PART_FFN_NORM | MQ_PART_ROUTER | MQ_PART_SHARED | MQ_PART_MLP, 0, 0);
    if (!st && p->w) {   /* the writer's queue, the layer's last (usually done by now) */
        const double tw = mq_now(), cw = mq_cpu_now();
        st = mq_ckpt_writer_flush(p->w);
        if (mq_env(MQ_ENV_PROFILE)) mq_info("layer %d write: %.3f s waiting for the writer's queue", l, mq_now() - tw);
        p->layers[l].write += mq_now() - tw;
        p->layers[l].cpu_write += mq_cpu_now() - cw;
    }
    p->layers[l].total += mq_now() - t0;
    p->layers[l].cpu_total += mq_cpu_now() - c0;
    p->layers[l].pooled += mq_pool_seconds() - pool0;
    double sim1[2];   /* bench quantize --simulate-threads */
    mq_pool_simulated(&sim1[0], &sim1[1]);
    p->layers[l].sim_tasks += sim1[0] - sim0[0];
    p->layers[l].sim_span += sim1[1] - sim0[1];
    double w1, x1;
    mq_dist_seconds(&w1, &x1);
    p->layers[l].wait += w1 - w0;
    p->layers[l].exchange += x1 - x0;
    return st;
}
