/*
 * A layer's quantize stage: GPTQ (or round to nearest) of the slots' Linears once their Hessians
 * are formed; the quantized weights written to their planned places in the checkpoint's shards
 * and dequantized back into the model for the passes after (sequential calibration); a GPU
 * chunk's writes left pending while the device runs its quantized pass; with several ranks, each
 * quantized Linear sent from its owner to every rank. Also the Linears that need no calibration:
 * plain RTN and the pass-through tensors (rotated where the run rotates). The tests pin the
 * checkpoint's bytes: the pool packs and writes in any order because every tensor has its
 * planned place, and the records follow in slot order.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dist/dist.h"
#include "core/env.h"
#include "formats/kquant.h"
#include "pipeline/layer_internal.h"

const char *mq_how_name(mq_how h) {
    switch (h) {
    case MQ_HOW_GPTQ: return "gptq";
    case MQ_HOW_GPTQ_BLOCK_HESSIAN: return "gptq-block-hessian";
    default: return "rtn";
    }
}

static void item_mark(mq_pipe *p, const mq_plan_item *it) { p->item_done[it - p->plan.items] = 1; }

/* Whether this rank quantizes the slot's k-th Linear. */
static bool mine_k(const mq_pipe *p, const mq_slot *s, int k) { return s->lown[k] == p->rank; }

/* ---- quantizing slots ------------------------------------------------------------------------- */

/* With act-order g_idx groups every quantized Linear carries g_idx, also the ones rounded to
 * nearest (fallback experts): theirs is the identity grouping. */
static moeq_status identity_gidx(mq_qtensor *q) {
    q->g_idx = mq_alloc_array((size_t)q->cols, sizeof(int32_t), "g_idx");
    if (!q->g_idx) return MOEQ_E_NOMEM;
    for (int64_t k = 0; k < q->cols; k++) q->g_idx[k] = (int32_t)(k / q->group_size);
    return MOEQ_OK;
}

static moeq_status add_module(mq_pipe *p, int l, const mq_slot *s, int k, const mq_gptq_stats *st) {
    if (!p->o->gptq) return MOEQ_OK;
    const mq_qspec *spec = &s->it[k]->spec;
    mq_mod_report r = {s->w[k]->name, l, s->expert, s->tokens, s->how, *st,
                       spec->scheme == MQ_QS_KQUANT ? mq_kq_name(spec->kq) : NULL};
    cJSON *j = mq_mod_report_json(&r);
    if (!j) return mq_err(MOEQ_E_NOMEM, "out of memory");
    cJSON_AddItemToArray(p->layers[l].modules, j);
    return MOEQ_OK;
}

/* Writing one quantized Linear comes in three parts: what must be done in order before (g_idx,
 * the input scale and its warning), the packing and writing to its planned place in the shard
 * files with the dequantized weights for later stages (sequential calibration), which the
 * Linears of a layer do on the pool at once, and the records after, in order. */
static float finish_prepare(mq_pipe *p, const mq_slot *s, int k, mq_qtensor *q, moeq_status *st) {
    const mq_pipeline_opts *o = p->o;
    *st = MOEQ_OK;
    if (o->gptq && o->g.act_order && o->g.groups == MQ_GPTQ_GROUPS_GIDX && !q->g_idx) *st = identity_gidx(q);
    float in_amax = 0;
    if (!*st && o->act_quant) {
        in_amax = s->amax;
        if (!(in_amax > 0) || !isfinite(in_amax)) {
            /* a routed expert that saw no token gets the layer's largest expert amax at its
             * site once every chunk is done (mq_pipe_routed_experts); anything else amax 1 */
            if (s->expert < 0) mq_warn("%s: no calibration activations; input scale from amax 1", s->w[k]->name);
            in_amax = 1.0f;
        }
    }
    return in_amax;
}

/* Packs and writes one Linear's quantized weight (the dequantization is put_and_record's). */
static moeq_status finish_put(mq_pipe *p, const mq_slot *s, int k, const mq_qtensor *q, float in_amax) {
    return p->w ? mq_ckpt_writer_put_linear(p->w, s->w[k]->name, q, in_amax) : MOEQ_OK;
}

static moeq_status finish_record(mq_pipe *p, int l, const mq_slot *s, int k, const mq_gptq_stats *stats) {
    moeq_status st = p->w ? add_module(p, l, s, k, stats) : MOEQ_OK;
    if (!st) item_mark(p, s->it[k]);
    if (!st) mq_fault_point("linear", l, p->layers[l].linears++);
    return st;
}

typedef struct {
    mq_pipe *p;
    const mq_slot *slots;
    const mq_qtensor *q;
    const int *weight;     /* [n] 3 * slot + k */
    const float *amax;     /* [n] */
    moeq_status *st;       /* [n] */
    char (*msg)[320];      /* [n] the message of a failure (the pool thread's error state) */
} put_ctx;

static void put_task(void *vctx, int64_t t, int thread) {
    (void)thread;
    const put_ctx *c = vctx;
    const int j = c->weight[t];
    c->st[t] = finish_put(c->p, &c->slots[j / 3], j % 3, &c->q[j], c->amax[t]);
    if (c->st[t]) snprintf(c->msg[t], sizeof c->msg[t], "%s", moeq_last_error());
}

/* The dequantized weights back into the Linears' host copies (sequential calibration) in pieces
 * of DEQ_ROWS rows of all the written weights, one pool loop: as a part of each weight's own task
 * a write of few weights (the attention's four) would keep as few threads busy. Elementwise: any
 * split, the same values. */
enum { DEQ_ROWS = 64 };

typedef struct {
    const mq_qtensor *q;
    float *w;
    int64_t r0;
} deq_piece;

static void deq_piece_task(void *vctx, int64_t t, int thread) {
    (void)thread;
    const deq_piece *pc = (const deq_piece *)vctx + t;
    mq_dequantize_rows(pc->q, pc->w, pc->r0, pc->r0 + DEQ_ROWS);
}

static moeq_status dequantize_back(mq_pipe *p, int l, const mq_slot *slots, const mq_qtensor *q, const int *weight,
                                   const moeq_status *sts, int m, const bool *in_place) {
    int64_t n = 0;
    for (int t = 0; t < m; t++) {
        const int j = weight[t];
        if (!sts[t] && slots[j / 3].w[j % 3]->w && !(in_place && in_place[j]))
            n += (q[j].rows + DEQ_ROWS - 1) / DEQ_ROWS;
    }
    if (!n) return MOEQ_OK;
    deq_piece *pc = malloc((size_t)n * sizeof *pc);
    if (!pc) return mq_err(MOEQ_E_NOMEM, "out of memory writing layer %d", l);
    n = 0;
    for (int t = 0; t < m; t++) {
        const int j = weight[t];
        float *w = in_place && in_place[j] ? NULL : slots[j / 3].w[j % 3]->w;
        for (int64_t r0 = 0; !sts[t] && w && r0 < q[j].rows; r0 += DEQ_ROWS) pc[n++] = (deq_piece){&q[j], w, r0};
    }
    mq_parallel_for(n, deq_piece_task, pc);
    free(pc);
    return MOEQ_OK;
}

/* Packs and writes the m weights (weight[t] = 3 * slot + k, stats[t] its GPTQ stats) on the pool,
 * then records them in order (the first failure in that order is the one reported). deq: the
 * dequantized weights into the Linears' host copies for the stages after (sequential
 * calibration), unless the device already holds them and the host copy is dropped unread. */
static moeq_status put_and_record(mq_pipe *p, int l, const mq_slot *slots, const mq_qtensor *q, const int *weight,
                                  const float *amax, const mq_gptq_stats *stats, int m, bool deq,
                                  const bool *in_place) {
    moeq_status *sts = calloc((size_t)(m + 1), sizeof *sts);
    char (*msg)[320] = calloc((size_t)(m + 1), sizeof *msg);
    moeq_status st = sts && msg ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory writing layer %d", l);
    double t0 = mq_now(), c0 = mq_cpu_now(), t1 = t0, c1 = c0;
    const uint64_t w0 = mq_pwrite_ns();
    if (!st) {
        put_ctx c = {p, slots, q, weight, amax, sts, msg};
        mq_parallel_for(m, put_task, &c);
        t1 = mq_now(), c1 = mq_cpu_now();
        if (deq && p->seq) st = dequantize_back(p, l, slots, q, weight, sts, m, in_place);
    }
    p->layers[l].write += mq_now() - t0;
    p->layers[l].cpu_write += mq_cpu_now() - c0;
    if (mq_env(MQ_ENV_PROFILE))   /* the write stage's parts (the writer's thread writes meanwhile) */
        mq_info("layer %d write, %d weights: packing %.3f s (%.1f cores busy), dequantizing back %.3f s (%.1f "
                "cores busy); the writer's thread in pwrite meanwhile %.3f s", l, m, t1 - t0,
                (c1 - c0) / (t1 - t0 + 1e-9), mq_now() - t1, (mq_cpu_now() - c1) / (mq_now() - t1 + 1e-9),
                (double)(mq_pwrite_ns() - w0) * 1e-9);
    for (int t = 0; t < m && !st; t++) {
        const int j = weight[t];
        if (sts[t]) st = mq_err(sts[t], "%s", msg[t]);
        else st = finish_record(p, l, &slots[j / 3], j % 3, &stats[t]);
    }
    free(sts);
    free(msg);
    return st;
}

/* A GPU chunk's writes, left until its quantized pass is queued on the device (the host packs
 * and writes while the device computes). The device holds the dequantized weights GPTQ wrote
 * back; the others were dequantized on the host before (device_experts_follow uploads them). */
typedef struct mq_pending_write {
    int l, n, m;
    mq_slot *slots;        /* [n] copies: the Linears and plan items the writes and records name */
    mq_qtensor *q;         /* [3 n + 1], owned */
    int *weight;           /* [m] */
    float *amax;           /* [m] */
    mq_gptq_stats *stats;  /* [m] */
} pending_write;

static void pending_free(pending_write *pw) {
    if (!pw) return;
    for (int j = 0; pw->q && j < 3 * pw->n + 1; j++) mq_qtensor_free(&pw->q[j]);
    MQ_FREE_EACH(pw->q, pw->slots, pw->weight, pw->amax, pw->stats);
    free(pw);
}

/* Writes and records the pending chunk (write: false after a failure: only frees it). */
moeq_status mq_pipe_write_pending(mq_pipe *p, bool write) {
    pending_write *pw = p->pending;
    if (!pw) return MOEQ_OK;
    p->pending = NULL;
    moeq_status st = write ? put_and_record(p, pw->l, pw->slots, pw->q, pw->weight, pw->amax, pw->stats, pw->m, false, NULL)
                           : MOEQ_OK;
    pending_free(pw);
    return st;
}

/* Leaves a GPU chunk's writes for mq_pipe_write_pending; what the device does not hold (round to
 * nearest, fallbacks: not `written`, job -> dequantized on the device) is dequantized on the host
 * now, for device_experts_follow to upload. Takes q, weight, amax and stats when it succeeds. */
static moeq_status defer_slots(mq_pipe *p, int l, const mq_slot *slots, int n, mq_qtensor *q, int *weight,
                               float *amax, mq_gptq_stats *stats, int m, const int *job_of, const bool *written) {
    pending_write *pw = calloc(1, sizeof *pw);
    mq_slot *copy = malloc(sizeof *copy * (size_t)(n + 1));
    if (!pw || !copy) {
        free(pw), free(copy);
        return mq_err(MOEQ_E_NOMEM, "out of memory writing layer %d", l);
    }
    memcpy(copy, slots, sizeof *copy * (size_t)n);
    double t0 = mq_now(), c0 = mq_cpu_now();
    for (int t = 0; t < m; t++) {
        const int j = weight[t];
        mq_linear *lin = slots[j / 3].w[j % 3];
        if (p->seq && lin->w && !(job_of[j] >= 0 && written[job_of[j]])) mq_dequantize(&q[j], lin->w);
    }
    p->layers[l].write += mq_now() - t0;
    p->layers[l].cpu_write += mq_cpu_now() - c0;
    *pw = (pending_write){l, n, m, copy, q, weight, amax, stats};
    pending_free(p->pending);   /* none: each chunk writes its own before the next */
    p->pending = pw;
    return MOEQ_OK;
}

/* finish_linear for the weights of mq_pipe_quantize_slots at once: prepared in order, packed and
 * written on the pool, recorded in order. With `written` (a GPU chunk: job -> dequantized on the
 * device) the packing and writing wait for mq_pipe_write_pending, which then owns q (*took_q). A
 * job with deq wrote its dequantized weights into the Linear's host copy already
 * (mq_pipe_quantize_slots). */
static moeq_status finish_slots(mq_pipe *p, int l, const mq_slot *slots, int n, mq_qtensor *q,
                                const mq_gptq_job *jobs, const int *job_of, const mq_gptq_stats *stats,
                                const bool *written, bool *took_q) {
    *took_q = false;
    int *weight = calloc((size_t)(3 * n + 1), sizeof *weight);
    float *amax = calloc((size_t)(3 * n + 1), sizeof *amax);
    mq_gptq_stats *wst = calloc((size_t)(3 * n + 1), sizeof *wst);
    bool *in_place = calloc((size_t)(3 * n + 1), sizeof *in_place);
    moeq_status st = weight && amax && wst && in_place ? MOEQ_OK
                                                       : mq_err(MOEQ_E_NOMEM, "out of memory writing layer %d", l);
    for (int j = 0; j < 3 * n && !st; j++) in_place[j] = job_of[j] >= 0 && jobs[job_of[j]].deq != NULL;
    int m = 0;
    for (int i = 0; i < n && !st; i++)
        for (int k = 0; k < slots[i].nw && !st; k++) {
            if (!mine_k(p, &slots[i], k)) continue;
            const int j = 3 * i + k;
            amax[m] = finish_prepare(p, &slots[i], k, &q[j], &st);
            wst[m] = job_of[j] >= 0 ? jobs[job_of[j]].stats : stats[j];
            weight[m++] = j;
        }
    if (!st && written) {
        st = defer_slots(p, l, slots, n, q, weight, amax, wst, m, job_of, written);
        if (!st) {
            *took_q = true;
            free(in_place);
            return st;
        }
    } else if (!st) {
        st = put_and_record(p, l, slots, q, weight, amax, wst, m, true, in_place);
    }
    MQ_FREE_EACH(weight, amax, wst, in_place);
    return st;
}

/* The damping sweep of a slot (mq_gptq_damp_sweep): the percdamp among the run's candidates
 * whose GPTQ of the slot's Linears on the fitting rows' Hessian has the least loss on the
 * held-out rows. No held-out row (an expert routed to only in the fitting samples): percdamp. */
static moeq_status sweep_slot(mq_pipe *p, const mq_slot *s, const float *gs, double *damp) {
    const mq_pipeline_opts *o = p->o;
    const int64_t K = s->w[0]->in;
    *damp = o->g.percdamp;
    if (!s->Hh || s->n_held == 0 || s->n_fit == 0) return MOEQ_OK;
    float *fit = mq_alloc_array((size_t)K * (size_t)K, sizeof(float), "damping sweep");
    if (!fit) return MOEQ_E_NOMEM;
    mq_hessian_fit_from_split(s->H, s->Hh, K, s->n_fit, s->n_held, fit);
    const float *w[3];
    int64_t rows[3];
    for (int k = 0; k < s->nw; k++) {
        w[k] = s->w[k]->w;
        rows[k] = s->w[k]->out;
    }
    int best = 0;
    double loss[8];
    moeq_status st = mq_gptq_damp_sweep(&o->spec, &o->g, fit, s->Hh, K, w, rows, gs, s->nw,
                                        o->damp_sweep, o->n_damp_sweep, s->w[0]->name, &best, loss);
    if (!st) *damp = o->damp_sweep[best];
    mq_free(fit);
    return st;
}

/* Quantizes every Linear of slots[0..n): GPTQ with the slot's Hessian (block-fallback gate/up
 * slots with block_H, factorised once for all of them), round to nearest for RTN slots. NVFP4
 * global scales are shared by a slot's Linears (vLLM's fused layers) unless no_fuse. */
/* A slot's NVFP4 global scales (fused: one for its Linears together). */
typedef struct {
    const mq_pipe *p;
    const mq_slot *slots;
    float *gs;   /* [3 n] */
} gscale_ctx;

static void gscale_task(void *vctx, int64_t i, int thread) {
    (void)thread;
    const gscale_ctx *c = vctx;
    const mq_slot *s = &c->slots[i];
    const mq_pipeline_opts *o = c->p->o;
    if (!mq_slot_mine(c->p, s)) return;   /* another rank's */
    float amax = 0, a[3] = {0, 0, 0};
    for (int k = 0; k < s->nw; k++) {
        a[k] = mq_absmax(s->w[k]->w, s->w[k]->out * s->w[k]->in);
        amax = fmaxf(amax, a[k]);
    }
    for (int k = 0; k < s->nw; k++) c->gs[3 * i + k] = mq_nvfp4_global_scale(&o->spec, o->no_fuse ? a[k] : amax);
}

/* The Linear k of slot s as one of the chunk's experts on the GPU (p->gx): 0 gate, 1 up,
 * 2 down; -1 when it is not there. */
static int device_expert_linear(const mq_pipe *p, int l, const mq_slot *s, int k) {
    if (!p->gx || s->expert < p->gx_e0 || s->expert >= p->gx_e1) return -1;
    const mq_layer *ly = &p->m->layers[l];
    const mq_linear *lin = s->w[k];
    return lin == &ly->exp_gate[s->expert] ? 0 : lin == &ly->exp_up[s->expert] ? 1
                                           : lin == &ly->exp_down[s->expert] ? 2 : -1;
}

/* After a sequential chunk's quantization the device's experts must be the dequantized ones, as
 * the host's are: those GPTQ did not replace there (rounded to nearest) go up from the host. */
static moeq_status device_experts_follow(mq_pipe *p, int l, const mq_slot *slots, int n, const int *job_of,
                                         const bool *written) {
    moeq_status st = MOEQ_OK;
    for (int i = 0; i < n && !st; i++)
        for (int k = 0; k < slots[i].nw && !st; k++) {
            const int dk = device_expert_linear(p, l, &slots[i], k), j = job_of[3 * i + k];
            if (dk < 0 || !mine_k(p, &slots[i], k) || (j >= 0 && written[j])) continue;
            st = mq_gpu_mlp_set(p->gx, slots[i].expert - p->gx_e0, dk, slots[i].w[k]->w);
        }
    return st;
}

moeq_status mq_pipe_quantize_slots(mq_pipe *p, int l, mq_slot *slots, int n, float *block_H) {
    const mq_pipeline_opts *o = p->o;
    double t0 = mq_now(), c0 = mq_cpu_now();
    int nf = n + 1;
    const float **Hs = calloc((size_t)nf, sizeof *Hs);
    int64_t *Ks = calloc((size_t)nf, sizeof *Ks);
    const char **names = calloc((size_t)nf, sizeof *names);
    mq_gptq_factor *f = calloc((size_t)nf, sizeof *f);
    mq_gptq_job *jobs = calloc((size_t)(3 * n + 1), sizeof *jobs);
    mq_qtensor *q = calloc((size_t)(3 * n + 1), sizeof *q);
    float *gs = calloc((size_t)(3 * n + 1), sizeof *gs);
    mq_gptq_stats *stats = calloc((size_t)(3 * n + 1), sizeof *stats);
    int *job_of = calloc((size_t)(3 * n + 1), sizeof *job_of);   /* weight -> its GPTQ job */
    bool *written = calloc((size_t)(3 * n + 1), sizeof *written);  /* job -> dequantized on the device */
    moeq_status st = Hs && Ks && names && f && jobs && q && gs && stats && job_of && written
                         ? MOEQ_OK
                         : mq_err(MOEQ_E_NOMEM, "out of memory quantizing layer %d", l);
    int n_jobs = 0;
    bool factored = false;
    if (!st) {   /* the global scales: each slot's weights read on the pool */
        gscale_ctx gc = {p, slots, gs};
        mq_parallel_for(n, gscale_task, &gc);
    }
    for (int i = 0; i < n && !st; i++) {
        mq_slot *s = &slots[i];
        if (!mq_slot_mine(p, s)) continue;   /* another rank's */
        if (!s->nw) continue;
        Ks[i] = s->w[0]->in;
        names[i] = s->w[0]->name;
        if (s->how == MQ_HOW_GPTQ || (s->how == MQ_HOW_GPTQ_BLOCK_HESSIAN && s->down)) Hs[i] = s->H;
        if (s->how == MQ_HOW_GPTQ_BLOCK_HESSIAN && !s->down) {
            Hs[n] = block_H;
            Ks[n] = s->w[0]->in;
            names[n] = "the MoE block's Hessian";
        }
    }
    /* the damping sweep: the swept slots are factorised one by one with their own damping */
    double *damp = o->n_damp_sweep > 0 ? calloc((size_t)nf, sizeof *damp) : NULL;
    const float **swept = o->n_damp_sweep > 0 ? calloc((size_t)nf, sizeof *swept) : NULL;
    if (!st && o->n_damp_sweep > 0 && (!damp || !swept)) st = mq_err(MOEQ_E_NOMEM, "out of memory");
    for (int i = 0; i < n && !st && damp && o->gptq && !p->gpu; i++) {
        mq_slot *s = &slots[i];
        if (!mq_slot_mine(p, s) || s->how != MQ_HOW_GPTQ || !Hs[i] || !s->Hh) continue;
        st = sweep_slot(p, s, gs + 3 * i, &damp[i]);
        swept[i] = Hs[i];
        Hs[i] = NULL;
    }
    const double tf0 = mq_now(), cf0 = mq_cpu_now();
    if (!st && o->gptq && !p->gpu) {
        st = mq_gptq_factor_many(Hs, Ks, nf, &o->g, o->g.rtn_loss, names, f);
        factored = !st;
        for (int i = 0; i < n && !st && swept; i++) {
            if (!swept[i]) continue;
            mq_gptq_opts oi = o->g;
            oi.percdamp = damp[i];
            st = mq_gptq_factor_init(swept[i], Ks[i], &oi, o->g.rtn_loss, names[i], &f[i]);
        }
    }
    free(damp);
    free(swept);
    for (int i = 0; i < n; i++) {   /* the held-out Hessians are no longer needed */
        mq_free(slots[i].Hh);
        slots[i].Hh = NULL;
    }
    if (!p->gpu || st)
        for (int i = 0; i < n; i++) {   /* factored: the Hessians are no longer needed */
            mq_free(slots[i].H);
            slots[i].H = NULL;
        }
    for (int i = 0; i < n && !st; i++) {
        mq_slot *s = &slots[i];
        for (int k = 0; k < s->nw && !st; k++) {
            mq_linear *lin = s->w[k];
            int j = 3 * i + k;
            job_of[j] = -1;
            if (!mine_k(p, s, k)) continue;   /* another rank's Linear of this slot */
            if (s->how == MQ_HOW_RTN) {
                double tr = mq_now();
                st = mq_quantize_rtn(&s->it[k]->spec, lin->w, lin->out, lin->in, gs[j], lin->name, &q[j]);
                stats[j] = (mq_gptq_stats){NAN, NAN, 0, 0, mq_now() - tr};
                continue;
            }
            const mq_gptq_factor *fi = s->how == MQ_HOW_GPTQ_BLOCK_HESSIAN && !s->down ? &f[n] : &f[i];
            job_of[j] = n_jobs;
            /* sequential calibration on the CPU, one process: GPTQ leaves the dequantized weights
             * in the host copy as each row block finishes (while it is in cache), instead of a
             * pass over every weight after the write (bound by memory: each weight read again) */
            float *deq = p->seq && !p->gpu && p->ranks <= 1 ? lin->w : NULL;
            jobs[n_jobs++] = (mq_gptq_job){fi, lin->w, lin->out, gs[j], lin->name, &q[j], deq, {0, 0, 0, 0, 0}, &s->it[k]->spec};
        }
    }
    /* the GPTQ jobs ran into q[] through their out pointers; their stats go back by position */
    if (!st && n_jobs > 0 && p->gpu) {
        /* on the GPU the factorisations are part of the call: job -> its Hessian's index. The
         * Hessians kept on the device are read there, and so are the chunk's expert weights,
         * which the dequantized ones replace for the quantized pass */
        int32_t *job_h = calloc((size_t)n_jobs, sizeof *job_h);
        mq_gpu_hsrc *dH = calloc((size_t)nf, sizeof *dH);
        mq_gpu_wsrc *dW = calloc((size_t)n_jobs, sizeof *dW);
        if (!job_h || !dH || !dW) st = mq_err(MOEQ_E_NOMEM, "out of memory quantizing layer %d", l);
        for (int i = 0; i < n && !st; i++) {
            const mq_slot *s = &slots[i];
            if (mq_slot_mine(p, s) && !Hs[i] && mq_slot_keeps_device_sum(p, s)) dH[i] = (mq_gpu_hsrc){s->gh, 0};
            for (int k = 0; k < s->nw; k++) {
                const int j = job_of[3 * i + k];
                if (!mine_k(p, s, k) || j < 0) continue;
                job_h[j] = s->how == MQ_HOW_GPTQ_BLOCK_HESSIAN && !s->down ? n : i;
                const int dk = device_expert_linear(p, l, s, k);
                if (dk >= 0) dW[j] = (mq_gpu_wsrc){p->gx, s->expert - p->gx_e0, dk, p->seq};
            }
        }
        if (!st) st = mq_gpu_gptq_ex(p->gpu, &o->spec, &o->g, Hs, dH, Ks, names, nf, jobs, dW, job_h, n_jobs);
        for (int j = 0; j < n_jobs && !st && dW; j++)
            if (dW[j].mlp && dW[j].write_back) written[j] = true;
        free(job_h);
        free(dH);
        free(dW);
    } else if (!st && n_jobs > 0) {
        const double tr0 = mq_now(), cr0 = mq_cpu_now();
        /* the batch's seconds (each factor of a batch carries the whole batch's) */
        double fac_sec[3] = {0, 0, 0};
        for (int i = 0; i < nf && factored; i++) {
            fac_sec[0] = fmax(fac_sec[0], f[i].sec_cholesky);
            fac_sec[1] = fmax(fac_sec[1], f[i].sec_inverse);
            fac_sec[2] = fmax(fac_sec[2], f[i].sec_copies);
        }
        st = mq_gptq_run(&o->spec, &o->g, jobs, n_jobs);
        if (mq_env(MQ_ENV_PROFILE))   /* where GPTQ's time goes and how many cores it kept busy */
            mq_info("layer %d GPTQ, %d weights: factors %.2f s (%.1f cores busy; Cholesky %.2f, inverse %.2f, "
                    "copies %.2f s), column loops %.2f s (%.1f cores busy)", l, n_jobs, tr0 - tf0,
                    (cr0 - cf0) / (tr0 - tf0 + 1e-9), fac_sec[0], fac_sec[1], fac_sec[2], mq_now() - tr0,
                    (mq_cpu_now() - cr0) / (mq_now() - tr0 + 1e-9));
    }
    if (p->gpu)
        for (int i = 0; i < n; i++) {
            mq_free(slots[i].H);
            slots[i].H = NULL;
        }
    p->layers[l].gptq += mq_now() - t0;
    p->layers[l].cpu_gptq += mq_cpu_now() - c0;
    /* kept for mq_pipe_share_slots, which every rank runs */
    for (int i = 0; i < n && !st && p->ranks > 1; i++) {
        mq_slot *s = &slots[i];
        for (int k = 0; k < s->nw && !st; k++) {
            if (!mine_k(p, s, k)) continue;
            int j = 3 * i + k;
            s->q[k] = q[j];
            memset(&q[j], 0, sizeof q[j]);
            s->qs[k] = job_of[j] >= 0 ? jobs[job_of[j]].stats : stats[j];
            s->held = true;
        }
    }
    /* a GPU chunk of experts writes while the device runs its quantized pass
     * (mq_pipe_routed_experts) */
    bool took_q = false;
    if (!st && p->ranks <= 1)
        st = finish_slots(p, l, slots, n, q, jobs, job_of, stats, p->gx ? written : NULL, &took_q);
    if (took_q) q = NULL;
    if (!st && p->gx && p->seq) st = device_experts_follow(p, l, slots, n, job_of, written);
    for (int j = 0; q && j < 3 * n + 1; j++) mq_qtensor_free(&q[j]);
    for (int i = 0; factored && i < nf; i++) mq_gptq_factor_free(&f[i]);
    MQ_FREE_EACH(Hs, Ks, names, f, jobs, q, gs, stats, job_of, written);
    return st;
}

/* A resumed run recomputing activations through a finished layer: the quantized weights are read
 * back from the checkpoint (sequential calibration continues with them). */
moeq_status mq_pipe_read_back_slots(mq_pipe *p, mq_slot *slots, int n) {
    moeq_status st = MOEQ_OK;
    for (int i = 0; i < n && !st; i++)
        for (int k = 0; k < slots[i].nw && !st; k++) {
            mq_linear *lin = slots[i].w[k];
            mq_qtensor q;
            st = mq_ckpt_writer_read_linear(p->w, lin->name, lin->out, lin->in, &q);
            if (!st && p->seq) mq_dequantize(&q, lin->w);
            mq_qtensor_free(&q);
        }
    return st;
}

/* ---- several ranks: quantized Linears from their owners to everyone ---------------------------- */

/* One held Linear as bytes: what finish_linear needs on another rank (every rank runs this same
 * build, so the structs travel as they are). */
typedef struct {
    mq_qspec spec;
    int64_t rows, cols, group_size, n_groups, tokens;
    float global_scale, amax;
    int32_t how, has_gidx;
    mq_gptq_stats stats;
} wire_head;

/* 4-bit codes to and from the wire (two to a byte, the first in the low nibble) on the pool, in
 * pieces of WIRE_PIECE codes: a layer's experts are 192 Linears of 2M codes that every rank
 * packs or unpacks between broadcasts, one core each before. */
enum { WIRE_PIECE = 1 << 14 };   /* even: only the last piece of an odd count is odd; olmoe-tiny's experts are 4 */

typedef struct {
    const uint8_t *codes;        /* packing: codes to bytes_out */
    unsigned char *bytes_out;
    const unsigned char *bytes;  /* unpacking: bytes to codes_out */
    uint8_t *codes_out;
    int64_t n;
} wire_codes;

static void wire_codes_task(void *ctx, int64_t a, int64_t e) {
    const wire_codes *w = ctx;
    const int64_t even = (e - a) & ~(int64_t)1;
    if (w->codes) mq_pack_u4_bytes(w->codes + a, even, w->bytes_out + a / 2);
    else mq_unpack_u4_bytes(w->bytes + a / 2, even, w->codes_out + a);
    if (even < e - a) {   /* an odd count's last code: the low nibble of the last byte */
        if (w->codes) w->bytes_out[(e - 1) / 2] = (unsigned char)(w->codes[e - 1] & 15);
        else w->codes_out[e - 1] = w->bytes[(e - 1) / 2] & 15;
    }
}

static void wire_codes_run(wire_codes w) {
    mq_parallel_ranges(w.n, WIRE_PIECE, true, wire_codes_task, &w);
}

static moeq_status wire_pack(const mq_slot *s, int k, void **out, size_t *n) {
    const mq_qtensor *q = &s->q[k];
    wire_head h;
    memset(&h, 0, sizeof h);
    h.spec = q->spec;
    h.rows = q->rows;
    h.cols = q->cols;
    h.group_size = q->group_size;
    h.n_groups = q->n_groups;
    h.tokens = s->tokens;
    h.global_scale = q->global_scale;
    h.amax = s->amax;
    h.how = (int32_t)s->how;
    h.has_gidx = q->g_idx != NULL;
    h.stats = s->qs[k];
    /* every scheme's codes are 4-bit: two to a byte on the wire */
    const size_t n_codes = (size_t)(q->rows * q->cols), nc = (n_codes + 1) / 2;
    const size_t np = (size_t)(q->rows * q->n_groups) * sizeof(mq_gparams);
    const size_t ng = h.has_gidx ? (size_t)q->cols * sizeof(int32_t) : 0;
    *n = sizeof h + nc + np + ng;
    unsigned char *b = malloc(*n);
    if (!b) return mq_err(MOEQ_E_NOMEM, "out of memory sending %s", s->w[k]->name);
    memcpy(b, &h, sizeof h);
    wire_codes_run((wire_codes){q->codes, b + sizeof h, NULL, NULL, (int64_t)n_codes});
    memcpy(b + sizeof h + nc, q->params, np);
    if (ng) memcpy(b + sizeof h + nc + np, q->g_idx, ng);
    *out = b;
    return MOEQ_OK;
}

static moeq_status wire_unpack(mq_slot *s, int k, const void *data, size_t n) {
    const unsigned char *b = data;
    wire_head h;
    if (n < sizeof h) return mq_err(MOEQ_E_FORMAT, "%s: short message from rank %d", s->w[k]->name, s->lown[k]);
    memcpy(&h, b, sizeof h);
    const size_t n_codes = (size_t)(h.rows * h.cols), nc = (n_codes + 1) / 2;
    const size_t np = (size_t)(h.rows * h.n_groups) * sizeof(mq_gparams);
    const size_t ng = h.has_gidx ? (size_t)h.cols * sizeof(int32_t) : 0;
    if (n != sizeof h + nc + np + ng || h.rows != s->w[k]->out || h.cols != s->w[k]->in)
        return mq_err(MOEQ_E_FORMAT, "%s: the message from rank %d does not match its shape", s->w[k]->name, s->lown[k]);
    mq_qtensor *q = &s->q[k];
    moeq_status st = mq_qtensor_init(q, &h.spec, h.rows, h.cols, s->w[k]->name);
    if (st) return st;
    q->group_size = h.group_size;
    q->n_groups = h.n_groups;
    q->global_scale = h.global_scale;
    wire_codes_run((wire_codes){NULL, NULL, b + sizeof h, q->codes, (int64_t)n_codes});
    memcpy(q->params, b + sizeof h + nc, np);
    if (ng) {
        q->g_idx = mq_alloc_array((size_t)h.cols, sizeof(int32_t), "g_idx");
        if (!q->g_idx) return MOEQ_E_NOMEM;
        memcpy(q->g_idx, b + sizeof h + nc + np, ng);
    }
    s->qs[k] = h.stats;
    s->tokens = h.tokens;
    s->amax = h.amax;
    s->how = (mq_how)h.how;
    s->held = true;
    return MOEQ_OK;
}

/* Every rank runs this after the owners quantized slots[0..n) (and agreed on it): each Linear
 * goes from its owner to every rank, in slot order; then each rank finishes it as one process
 * would (rank 0 writes and records it; sequential calibration continues with its dequantized
 * weights everywhere). A local failure still takes part in every exchange, so that no rank waits
 * for one that left. */
moeq_status mq_pipe_share_slots(mq_pipe *p, int l, mq_slot *slots, int n) {
    moeq_status st = MOEQ_OK;
    char step[64];
    snprintf(step, sizeof step, "layer %d: quantized weights", l);
    /* every Linear from its owner, in order (each rank takes part in every step, also after a
     * failure of its own), then their writes and dequantized copies on the pool: one Linear at a
     * time, every rank dequantized all of a layer's experts on one thread */
    for (int i = 0; i < n; i++) {
        mq_slot *s = &slots[i];
        for (int k = 0; k < s->nw; k++) {
            void *buf = NULL;
            size_t len = 0;
            moeq_status ps = MOEQ_OK;
            if (mine_k(p, s, k)) ps = s->held ? wire_pack(s, k, &buf, &len)
                                         : mq_err(MOEQ_E_ARG, "%s: not quantized", s->w[k]->name);
            moeq_status cs = mq_dist_agree(ps, step);   /* the owner could not pack it */
            if (!cs) cs = mq_dist_bcast_blob(&buf, &len, s->lown[k], step);
            if (cs) {
                free(buf);
                st = st ? st : cs;
                goto done;
            }
            if (!mine_k(p, s, k) && !st) st = wire_unpack(s, k, buf, len);
            free(buf);
        }
    }
    mq_qtensor *q = calloc((size_t)(3 * n + 1), sizeof *q);
    int *weight = calloc((size_t)(3 * n + 1), sizeof *weight);
    float *amax = calloc((size_t)(3 * n + 1), sizeof *amax);
    mq_gptq_stats *wst = calloc((size_t)(3 * n + 1), sizeof *wst);
    if (!st && (!q || !weight || !amax || !wst)) st = mq_err(MOEQ_E_NOMEM, "out of memory writing layer %d", l);
    int m = 0;
    for (int i = 0; i < n && !st; i++)
        for (int k = 0; k < slots[i].nw && !st; k++) {
            const int j = 3 * i + k;
            q[j] = slots[i].q[k];   /* moved: freed below */
            memset(&slots[i].q[k], 0, sizeof slots[i].q[k]);
            amax[m] = finish_prepare(p, &slots[i], k, &q[j], &st);
            wst[m] = slots[i].qs[k];
            weight[m++] = j;
        }
    if (!st) st = put_and_record(p, l, slots, q, weight, amax, wst, m, true, NULL);
    for (int j = 0; q && j < 3 * n + 1; j++) mq_qtensor_free(&q[j]);
    MQ_FREE_EACH(q, weight, amax, wst);
done:
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < slots[i].nw; k++) mq_qtensor_free(&slots[i].q[k]);
        slots[i].held = false;
    }
    return st;
}

/* ---- plain RTN and pass-through tensors -------------------------------------------------------- */

/* fp32 copy of rows x cols values of src from element offset on, rotated as the output tensor
 * `name` when the run rotates the residual stream (model/rotate.h). */
static moeq_status load_rotated(const mq_pipe *p, const mq_tensor_view *src, int64_t offset,
                                int64_t rows, int64_t cols, const char *name, float **out) {
    size_t n = (size_t)(rows * cols);
    float *w = mq_alloc_array(n, sizeof(float), name);
    if (!w) return MOEQ_E_NOMEM;
    mq_tensor_view v = *src;
    size_t es = moeq_dtype_size(v.dtype);
    v.data += (size_t)offset * es;
    v.ndim = 2;
    v.shape[0] = rows;
    v.shape[1] = cols;
    v.numel = (int64_t)n;
    v.nbytes = n * es;
    moeq_status s = mq_tensor_to_f32(&v, w);
    if (s) s = mq_err(s, "tensor '%s': cannot convert to fp32", src->name);
    if (!s && p->rotated) {
        int layer;
        mq_rot_kind k = mq_rot_classify(name, &layer);
        s = mq_rotation_apply(&p->rot, k, layer, w, rows, cols, name);
    }
    if (s) {
        mq_free(w);
        return s;
    }
    *out = w;
    return MOEQ_OK;
}

/* fp32 copy of an item's weight from the source (rotated with the run's rotation). */
static moeq_status item_load(const mq_pipe *p, const mq_plan_item *it, float **out) {
    char *name = mq_asprintf("%s.weight", it->module);
    if (!name) return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status s = load_rotated(p, it->src, it->offset, it->rows, it->cols, name, out);
    free(name);
    return s;
}

/* A pass-through tensor or kept Linear that the rotation changes: rotated in fp32, written in
 * its source dtype (rounded to nearest even). */
static moeq_status put_rotated(mq_pipe *p, const char *name, const mq_tensor_view *src,
                               int64_t offset, int64_t rows, int64_t cols) {
    if (src->dtype != MOEQ_DT_F32 && src->dtype != MOEQ_DT_BF16 && src->dtype != MOEQ_DT_F16)
        return mq_err(MOEQ_E_UNSUPPORTED, "rotate: tensor '%s': dtype %s is not F32, BF16 or F16",
                      name, moeq_dtype_name(src->dtype));
    /* fp32 in pieces of whole rows (a writer's rows are its columns' transforms: all at once),
     * the output in the source dtype (mq_pipe.rot_bytes in the memory plan) */
    int layer;
    const bool writer = mq_rot_classify(name, &layer) == MQ_ROT_WRITE;
    const int64_t piece = writer ? rows : (MQ_ROT_PIECE / cols > 0 ? MQ_ROT_PIECE / cols : 1);
    const size_t es = moeq_dtype_size(src->dtype), n = (size_t)(rows * cols);
    uint8_t *out = mq_alloc_array(n, es, name);
    if (!out) return MOEQ_E_NOMEM;
    moeq_status s = MOEQ_OK;
    for (int64_t r0 = 0; r0 < rows && !s; r0 += piece) {
        const int64_t nr = rows - r0 < piece ? rows - r0 : piece;
        float *w;
        if ((s = load_rotated(p, src, offset + r0 * cols, nr, cols, name, &w))) break;
        const size_t k = (size_t)(nr * cols), at = (size_t)(r0 * cols);
        if (src->dtype == MOEQ_DT_F32) {
            memcpy(out + at * 4, w, k * 4);
        } else {
            uint16_t *h = (uint16_t *)(void *)out + at;
            for (size_t i = 0; i < k; i++)
                h[i] = src->dtype == MOEQ_DT_BF16 ? mq_f32_to_bf16(w[i]) : mq_f32_to_f16(w[i]);
        }
        mq_free(w);
    }
    if (!s) s = mq_ckpt_writer_put(p->w, name, src->dtype, out, n * es);
    mq_free(out);
    return s;
}

static bool rotates(const mq_pipe *p, const char *name) {
    int layer;
    return p->rotated && mq_rot_classify(name, &layer) != MQ_ROT_NONE;
}

moeq_status mq_pipe_layer_rtn(mq_pipe *p, int l) {
    if (!p->w) return MOEQ_OK;   /* several ranks: rank 0's work */
    const mq_pipeline_opts *o = p->o;
    const mq_out_plan *pl = &p->plan;
    moeq_status st = MOEQ_OK;
    size_t idx[8];
    for (size_t i = 0; i < pl->n_items && !st; i++) {
        const mq_plan_item *first = &pl->items[i];
        if (first->layer != l || !first->quantize || p->item_done[i]) continue;
        if ((st = mq_pipe_check_interrupt())) break;
        /* the fusion group's members not written yet: its joint amax gives the NVFP4 scale */
        size_t n = 0;
        for (size_t j = i; j < pl->n_items && n < 8; j++)
            if (pl->items[j].group == first->group && pl->items[j].quantize && !p->item_done[j])
                idx[n++] = j;
        float *w[8] = {0};
        float amax = 0;
        double t0 = mq_now(), c0 = mq_cpu_now();
        for (size_t k = 0; k < n && !st; k++) {
            const mq_plan_item *it = &pl->items[idx[k]];
            if ((st = item_load(p, it, &w[k]))) break;
            if ((st = mq_check_finite(w[k], it->rows, it->cols, it->module))) break;
            amax = fmaxf(amax, mq_absmax(w[k], it->rows * it->cols));
        }
        for (size_t k = 0; k < n && !st; k++) {
            const mq_plan_item *it = &pl->items[idx[k]];
            float gs = mq_nvfp4_global_scale(&o->spec, o->no_fuse ? mq_absmax(w[k], it->rows * it->cols) : amax);
            mq_qtensor q;
            st = mq_quantize_rtn(&it->spec, w[k], it->rows, it->cols, gs, it->module, &q);
            if (!st && o->gptq && o->g.act_order && o->g.groups == MQ_GPTQ_GROUPS_GIDX)
                st = identity_gidx(&q);
            if (!st) {
                if (p->lz) mq_info("%s: not part of the model's forward; rounded to nearest", it->module);
                st = mq_ckpt_writer_put_linear(p->w, it->module, &q, o->act_quant ? 1.0f : 0.0f);
            }
            mq_qtensor_free(&q);
            if (!st) p->item_done[idx[k]] = 1;
        }
        for (size_t k = 0; k < n; k++) mq_free(w[k]);
        if (l >= 0) p->layers[l].write += mq_now() - t0;
        if (l >= 0) p->layers[l].cpu_write += mq_cpu_now() - c0;
    }
    return st;
}

moeq_status mq_pipe_write_passthrough(mq_pipe *p, int l) {
    if (!p->w) return MOEQ_OK;   /* several ranks: rank 0's work */
    const mq_out_plan *pl = &p->plan;
    moeq_status st = MOEQ_OK;
    double t0 = mq_now(), c0 = mq_cpu_now();
    for (size_t i = 0; i < pl->n_pass && !st; i++) {
        const mq_plan_pass *t = &pl->pass[i];
        if (t->layer != l) continue;
        if (!t->raw && rotates(p, t->name)) {
            int64_t cols = t->src->ndim >= 1 ? t->src->shape[t->src->ndim - 1] : 1;
            st = put_rotated(p, t->name, t->src, 0, cols ? t->src->numel / cols : 0, cols);
        } else {
            st = mq_ckpt_writer_put(p->w, t->name, t->src->dtype, t->src->data, t->src->nbytes);
        }
    }
    for (size_t i = 0; i < pl->n_items && !st; i++) {
        const mq_plan_item *it = &pl->items[i];
        if (it->layer != l || it->quantize) continue;
        size_t es = moeq_dtype_size(it->src->dtype);
        char *name = mq_asprintf("%s.weight", it->module);
        if (!name) return mq_err(MOEQ_E_NOMEM, "out of memory");
        if (rotates(p, name))
            st = put_rotated(p, name, it->src, it->offset, it->rows, it->cols);
        else
            st = mq_ckpt_writer_put(p->w, name, it->src->dtype, it->src->data + (size_t)it->offset * es,
                                    (size_t)(it->rows * it->cols) * es);
        free(name);
        if (!st) p->item_done[i] = 1;
    }
    if (l >= 0) p->layers[l].write += mq_now() - t0;
    if (l >= 0) p->layers[l].cpu_write += mq_cpu_now() - c0;
    return st;
}
