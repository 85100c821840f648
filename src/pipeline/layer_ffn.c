/*
 * A layer's FFN stage: the routed experts a chunk at a time (read, calibrated, quantized,
 * written, run quantized and freed, so a layer's experts never have to fit at once), the
 * fallbacks of experts that saw too few calibration tokens, with several ranks each rank's share
 * of the experts; the shared expert and the dense MLP as one unit over every token. With a GPU,
 * which of the experts' inputs and outputs stay on the device between the attention and the
 * experts (the same bits as the host's copies). The batches that run a chunk's experts over the
 * samples are in layer_expert_batches.c.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dist/dist.h"
#include "core/env.h"
#include "pipeline/layer_internal.h"

/* The fallback Hessian of an expert's down projection (MQ_HOW_GPTQ_BLOCK_HESSIAN) is taken from
 * the first samples' tokens until this many: the shape of the distribution, not every token. */
enum { FALLBACK_TOKENS = 8192 };

/* ---- the FFN stage: routed experts in chunks ------------------------------------------------- */

static mq_ffn_source hessian_source(const mq_pipe *p) {
    if (p->seq && !p->tseq) return (mq_ffn_source){true, p->sel_a, p->w_a, false};
    return (mq_ffn_source){false, p->tseq ? p->sel_b : p->sel_a, p->tseq ? p->w_b : p->w_a, false};
}

static mq_ffn_source output_source(const mq_pipe *p) {
    return (mq_ffn_source){false, p->seq ? p->sel_b : p->sel_a, p->seq ? p->w_b : p->w_a, false};
}

mq_ffn_source mq_pipe_fp_source(const mq_pipe *p) { return (mq_ffn_source){false, p->sel_f, p->w_f, true}; }

/* A sample's FFN input: a view of XN, or the FFN norm of the boundary (XF's for the unquantized
 * stream) into scratch. */
const float *mq_pipe_ffn_input(mq_pipe *p, int l, const mq_ffn_source *src, int64_t s, float *scratch) {
    const int64_t T = p->calib.len[s], D = p->c->D;
    if (src->from_xn) return mq_actbuf_view(&p->XN, (size_t)(s * p->LD), (size_t)(T * D), scratch);
    const float *h =
        mq_actbuf_view(src->fp ? &p->XF : mq_pipe_out_buf(p), (size_t)(s * p->LD), (size_t)(T * D), scratch);
    mq_ffn_norm(p->m, l, h, T, scratch);   /* in place when h was converted into scratch */
    return scratch;
}

/* ---- the routed experts on the GPU: where their inputs and outputs live ----------------------- */

/* Whether layer l's routed experts run on the GPU with their outputs combined there (p->gout):
 * one process, every chunk plain once read, and a pass whose rows may stay on the device. */
bool mq_pipe_experts_on_device(const mq_pipe *p, int l, bool replay) {
    const int E = p->c->n_experts;
    const int C = p->mp.chunk > 0 && p->mp.chunk < E ? p->mp.chunk : E;
    if (!p->gpu || p->ranks > 1 || !p->m->layers[l].is_moe) return false;
    bool plain = true;   /* once read: the weights are not in memory yet */
    for (int e0 = 0; e0 < E; e0 += C) plain &= mq_pipe_experts_plain_as(p, l, e0, e0 + C < E ? e0 + C : E, false);
    return plain && (p->seq || replay || (!p->o->act_quant && !p->o->expert_weighting));
}

void mq_pipe_gpu_ffn_inputs_free(mq_pipe *p) {
    p->xn_device_only = false;   /* its only copy goes (a layer's end, or a host step took it) */
    mq_gpu_buf_free(p->gffn_xn);
    mq_gpu_buf_free(p->gffn_h);
    mq_gpu_buf_free(p->gbound);
    p->gffn_xn = p->gffn_h = p->gbound = NULL;
}

/* The activation buffer that receives h (the boundary after attention): the input buffer itself
 * in memory, its double on disk (so the snapshot of the layer's input stays intact). */
mq_actbuf *mq_pipe_out_buf(mq_pipe *p) { return p->X.kind == MQ_ACT_DISK ? &p->X2 : &p->X; }

/* Whether the FFN's outputs of layer l may be added to the boundary on the GPU (p->gbound) and
 * come back as the next boundary: the combined outputs are the whole FFN (no shared expert, no
 * unquantized stream beside) and the boundary is plain page-locked fp32 (not bf16 or a file). The
 * add is the host's add_out, one fp32 add a value: the same bits, without the host's pass over
 * the whole boundary (gigabytes a layer at real size). MOEQ_DEBUG_GPU_RESIDUAL=0 turns it off. */
static bool residual_on_device(mq_pipe *p) {
    const char *env = mq_env(MQ_ENV_GPU_RESIDUAL);
    if (env && strcmp(env, "0") == 0) return false;
    const mq_actbuf *hb = mq_pipe_out_buf(p);
    return p->c->shared_ffn == 0 && !p->target && hb->kind == MQ_ACT_RAM && hb->pinned;
}

/* The GPU attention's results that only the device reads stay there: a host copy of them would
 * cross the bus for nothing (every sample's activations, each pass). The result of the pass
 * that gives the boundary (h), where the FFN's outputs are added to it on the device (gbound) and
 * the host reads none of it before: sequential calibration's Hessians read the kept FFN input
 * (XN), its output pass the device's FFN input. The kept FFN input (XN) where everything of the
 * layer reads it on the device, unless a host step needs it after all: mq_pipe_xn_to_host then
 * (the experts' fallback of a shared Hessian). MOEQ_DEBUG_GPU_HOST_COPIES=1 makes every copy as
 * before. */
static bool host_copies_forced(void) {
    const char *env = mq_env(MQ_ENV_GPU_HOST_COPIES);
    return env && strcmp(env, "1") == 0;
}

bool mq_pipe_boundary_device_only(const mq_pipe *p, bool pass_a) {
    return !host_copies_forced() && !pass_a && p->seq && !p->tseq && p->gbound;
}

bool mq_pipe_xn_device_only(const mq_pipe *p) {
    const mq_pipeline_opts *o = p->o;
    return !host_copies_forced() && p->gffn_xn && p->XN.kind == MQ_ACT_RAM && p->XN.pinned && p->ranks <= 1 &&
           !p->target && !o->act_quant && !o->expert_weighting && p->c->shared_ffn == 0;
}

/* A device buffer laid out as the activations (sample s at s * LD) into their page-locked host
 * copy, every sample, one wait (also after a failed copy: nothing is left in flight). */
static moeq_status gpu_acts_to_host(mq_pipe *p, mq_gpu_buf *b, mq_actbuf *dst) {
    moeq_status st = MOEQ_OK;
    for (int64_t s = 0; s < p->calib.n && !st; s++)
        st = mq_gpu_buf_read_async(b, s * p->LD, p->calib.len[s] * p->c->D, mq_actbuf_ptr(dst, (size_t)(s * p->LD)));
    moeq_status ss = mq_gpu_sync(p->gpu);
    return st ? st : ss;
}

/* XN's host copy from the device's, where the attention left it there only. */
moeq_status mq_pipe_xn_to_host(mq_pipe *p, int l) {
    if (!p->xn_device_only) return MOEQ_OK;
    moeq_status st = gpu_acts_to_host(p, p->gffn_xn, &p->XN);
    if (!st) p->xn_device_only = p->layers[l].gpu_xn_device_only = false;
    return st;
}

/* An activation-sized buffer on the device where it fits in a quarter of the free memory, else
 * none (*out stays NULL: the host's copy serves). */
static moeq_status gpu_acts_buf_if_room(mq_pipe *p, mq_gpu_buf **out) {
    const int64_t n = p->calib.n * p->LD;
    mq_gpu_info gi;
    mq_gpu_get_info(p->gpu, &gi);
    if ((int64_t)sizeof(float) * n > (int64_t)(gi.mem_free / 4)) return MOEQ_OK;
    moeq_status st = mq_gpu_buf_new(p->gpu, n, out);
    return st == MOEQ_E_NOMEM ? MOEQ_OK : st;
}

/* With the attention and the routed experts of layer l on the GPU, the experts' inputs stay there
 * from the attention (the FFN input it computed, sample s at s * LD) instead of going up again
 * from the host: the kept FFN input of pass A (sequential calibration) and the FFN norm of the
 * boundary it leaves (pass B, or the only pass). The experts then read the GPU's FFN norm, whose
 * double sum of squares may round apart from the CPU's in rare rows: so every batch of such a run
 * takes them from here, whatever its size. Where they do not fit beside the experts (a quarter of
 * the free memory), the host's go up as before. */
moeq_status mq_pipe_gpu_ffn_inputs_new(mq_pipe *p, int l, bool replay) {
    mq_pipe_gpu_ffn_inputs_free(p);
    if (!p->gin_ready) {   /* not this layer's input */
        mq_gpu_buf_free(p->gin);
        p->gin = NULL;
    }
    if (!mq_pipe_experts_on_device(p, l, replay)) return MOEQ_OK;
    const bool xn = !replay && p->seq && !p->tseq;
    const int64_t n = p->calib.n * p->LD;
    mq_gpu_info gi;
    mq_gpu_get_info(p->gpu, &gi);
    if ((int64_t)sizeof(float) * n * (xn ? 2 : 1) > (int64_t)(gi.mem_free / 4)) return MOEQ_OK;
    moeq_status st = xn ? mq_gpu_buf_new(p->gpu, n, &p->gffn_xn) : MOEQ_OK;
    if (!st) st = mq_gpu_buf_new(p->gpu, n, &p->gffn_h);
    if (st == MOEQ_E_NOMEM) {   /* the device's memory went elsewhere meanwhile: the host's go up */
        mq_pipe_gpu_ffn_inputs_free(p);
        return MOEQ_OK;
    }
    if (st) {
        mq_pipe_gpu_ffn_inputs_free(p);
        return st;
    }
    /* the boundary too, where it fits in the same share (else the host adds) */
    if (residual_on_device(p)) st = gpu_acts_buf_if_room(p, &p->gbound);
    /* and the layer's input, unless the layer before left it there: its first attention pass
     * keeps it for the second (the same X), which then need not send it up again */
    if (!st && p->gbound && !p->gin && !host_copies_forced()) st = gpu_acts_buf_if_room(p, &p->gin);
    return st;
}

/* The block Hessian of the fallback: every token's FFN input, one update per sample. */
static moeq_status block_hessian(mq_pipe *p, int l, float **out) {
    mq_ffn_source src = hessian_source(p);
    mq_hessian h;
    moeq_status st = mq_hessian_init(&h, p->c->D, "the MoE block's Hessian");
    float *scratch = mq_alloc_array((size_t)p->LD, sizeof(float), "FFN input");
    if (!st && !scratch) st = MOEQ_E_NOMEM;
    double t0 = mq_now(), c0 = mq_cpu_now();
    for (int64_t s = 0; s < p->calib.n && !st; s++) {
        if ((st = mq_pipe_check_interrupt())) break;
        mq_hessian_add(&h, mq_pipe_ffn_input(p, l, &src, s, scratch), p->calib.len[s]);
    }
    p->layers[l].hessian += mq_now() - t0;
    p->layers[l].cpu_hessian += mq_cpu_now() - c0;
    mq_free(scratch);
    if (st) {
        mq_hessian_free(&h);
        return st;
    }
    mq_hessian_get(&h, h.sum);
    *out = h.sum;
    return MOEQ_OK;
}

/* Hessian of expert e's down input had every token been routed to it: its gate/up on the first
 * FALLBACK_TOKENS tokens, whole samples (each product over the whole pool). */
static moeq_status fallback_down_one(mq_pipe *p, int l, int e, mq_slot *dn, float *g, float *u,
                                     float *scratch) {
    const mq_layer *ly = &p->m->layers[l];
    const int64_t F = ly->exp_gate[e].out;
    mq_ffn_source src = hessian_source(p);
    moeq_status st = mq_hessian_init(&dn->h, F, "fallback down Hessian");
    for (int64_t s = 0, used = 0; s < p->calib.n && used < FALLBACK_TOKENS && !st; s++) {
        const int64_t T = p->calib.len[s];
        used += T;
        const float *x = mq_pipe_ffn_input(p, l, &src, s, scratch);
        st = mq_mlp_forward(&ly->exp_gate[e], &ly->exp_up[e], NULL, x, T, g, u, NULL);
        if (!st) mq_hessian_add(&dn->h, g, T);
    }
    if (!st) st = mq_slot_form(p, dn);
    return st;
}

static moeq_status fallback_down(mq_pipe *p, int l, mq_slot *dn, int e0, int e1) {
    const int64_t Lmax = p->calib.max_len, F = p->c->moe_ffn;
    float *g = mq_alloc_array((size_t)(Lmax * F), sizeof(float), "fallback activations");
    float *u = mq_alloc_array((size_t)(Lmax * F), sizeof(float), "fallback activations");
    float *scratch = mq_alloc_array((size_t)p->LD, sizeof(float), "FFN input");
    moeq_status st = g && u && scratch ? MOEQ_OK : MOEQ_E_NOMEM;
    double t0 = mq_now(), c0 = mq_cpu_now();
    for (int e = e0; e < e1 && !st; e++)
        if (dn[e].nw && dn[e].how == MQ_HOW_GPTQ_BLOCK_HESSIAN) st = fallback_down_one(p, l, e, &dn[e], g, u, scratch);
    p->layers[l].hessian += mq_now() - t0;
    p->layers[l].cpu_hessian += mq_cpu_now() - c0;
    mq_free(g);
    mq_free(u);
    mq_free(scratch);
    return st;
}

/* W4A4: experts that saw no calibration token take the layer's largest expert amax at the same
 * site (gate/up input, down input), as engines that keep one activation scale per layer do. */
static moeq_status unseen_expert_scales(mq_pipe *p, const mq_slot *gu, const mq_slot *dn, int E) {
    for (int site = 0; site < 2; site++) {
        const mq_slot *v = site == 0 ? gu : dn;
        float mx = 0;
        for (int e = 0; e < E; e++) mx = fmaxf(mx, v[e].amax);
        if (!(mx > 0)) continue;
        for (int e = 0; e < E; e++) {
            if (v[e].amax > 0) continue;
            for (int k = 0; k < v[e].nw; k++) {
                moeq_status st = mq_ckpt_writer_put_input_scale(p->w, v[e].w[k]->name, mx);
                if (st) return st;
            }
        }
    }
    return MOEQ_OK;
}

/* mq_lazy_load_ex's test: a weight of a Linear that one of n gate/up and down slots quantizes. */
typedef struct {
    const mq_slot *gu, *dn;
    int n;
} quantized_in;

static bool is_quantized_in(float **dest, void *user) {
    const quantized_in *q = user;
    for (int i = 0; i < q->n; i++)
        for (int k = 0; k < 3; k++)
            if ((k < q->gu[i].nw && dest == &q->gu[i].w[k]->w) || (k < q->dn[i].nw && dest == &q->dn[i].w[k]->w))
                return true;
    return false;
}

/* An expert's work on its rank, in FLOPs: its calibration grows with its routed tokens (part 0:
 * gate/up and down in every pass, the Hessian updates) and its GPTQ does not (part 1: the
 * factorisations, the column loops and each refinement pass, counted twice: GPTQ runs at about
 * half the GEMMs' FLOP rate, rank 0's stages on OLMoE-1B-7B shapes). */
static void expert_flops(const mq_pipe *p, int64_t tokens, double part[2]) {
    const double D = p->c->D, F = p->c->moe_ffn;
    const mq_pipeline_opts *o = p->o;
    const double per_token = 2 * F * D * (p->seq ? 5 : 3) + (o->gptq ? D * D + F * F : 0);
    const double loop = 4 * F * D * D + 2 * D * F * F;   /* gate/up and down column loops */
    part[0] = (double)tokens * per_token;
    part[1] = o->gptq ? 2 * ((loop + D * D * D + F * F * F) * (o->spec.mse ? 1.3 : 1.0) * (1 + o->n_damp_sweep) +
                             loop * o->g.refine_passes)
                      : 0;
}

/* Each expert's work for the ranks' shares (mq_dist_share_weighted), in MFLOP: expert_flops, the
 * GPTQ part weighted by share_gptq. With the old constant (tokens plus half the mean) the ranks
 * with many lightly routed experts got the most GPTQ and the others waited for them. No token
 * counts (a resumed layer's replay): equal shares. The same on every rank: every rank has every
 * token's routing. */
static void expert_costs(const mq_pipe *p, const int64_t *tokens, int E, int64_t *cost) {
    int64_t total = 0;
    for (int e = 0; e < E; e++) total += tokens[e];
    for (int e = 0; e < E; e++) {
        double f[2];
        expert_flops(p, tokens[e], f);
        cost[e] = total > 0 ? (int64_t)((f[0] + f[1] * p->share_gptq) * 1e-6) + 1 : 0;
    }
}

/* Several ranks, MOEQ_DIST_SHARES=measured (p->fit_shares; an experiment, the default shares by
 * FLOPs): the weight of GPTQ in the next layer's shares from this layer's seconds. The FLOPs may
 * say too little about a rank's time (GPTQ's column loops run far from the products' rate, by
 * how much depends on the machine): a rank r that spent w[r] seconds on its experts' calibration
 * and GPTQ, x[r] and g[r] FLOPs of each, gives w[r] = a x[r] + b g[r]; a, b by least squares over
 * the ranks, and GPTQ's weight becomes (b / a) against the FLOPs' 1, damped (the geometric mean
 * with the weight before) and kept within [1/8, 8]. Every rank fits the same numbers in the same
 * order, so they agree on the shares; the shares change the speed only (the checkpoint is the
 * same for any split). It is not the default: where it was tried the ranks waited little with
 * either shares and it did not help; it is meant for runs whose ranks wait long at the experts'
 * hand-over. */
static void fit_shares(mq_pipe *p, const double *w, const double *x, const double *g) {
    double xx = 0, xg = 0, gg = 0, xw = 0, gw = 0;
    for (int r = 0; r < p->ranks; r++) {
        xx += x[r] * x[r], xg += x[r] * g[r], gg += g[r] * g[r];
        xw += x[r] * w[r], gw += g[r] * w[r];
    }
    const double det = xx * gg - xg * xg;
    if (!(det > 1e-9 * xx * gg)) return;   /* the ranks' mixes too alike to tell the parts apart */
    const double a = (gg * xw - xg * gw) / det, b = (xx * gw - xg * xw) / det;
    if (!(a > 0 && b > 0)) return;
    double ratio = sqrt(p->share_gptq * (b / a));
    ratio = ratio < 0.125 ? 0.125 : ratio > 8 ? 8 : ratio;
    if (mq_env(MQ_ENV_DIST_PROFILE) && p->rank == 0)
        mq_info("experts' shares: GPTQ weighted %.3g x its FLOPs (fit %.3g)", ratio, b / a);
    p->share_gptq = ratio;
}

moeq_status mq_pipe_routed_experts(mq_pipe *p, int l, bool replay) {
    const mq_config *c = p->c;
    const int E = c->n_experts, K = c->top_k;
    const mq_pipeline_opts *o = p->o;
    mq_layer *ly = &p->m->layers[l];
    mq_slot *gu = calloc((size_t)E, sizeof *gu), *dn = calloc((size_t)E, sizeof *dn);
    int64_t *tokens = calloc((size_t)E, sizeof *tokens);
    if (!gu || !dn || !tokens) {
        free(gu);
        free(dn);
        free(tokens);
        return mq_err(MOEQ_E_NOMEM, "out of memory for %d experts", E);
    }
    mq_ffn_source hs = hessian_source(p);
    int64_t *fit = calloc((size_t)E, sizeof *fit);   /* ... before the held-out samples */
    for (int64_t s = 0; s < p->calib.n && !replay; s++) {   /* routed tokens of each expert */
        const int32_t *sel = hs.sel + s * p->calib.max_len * K;
        for (int64_t j = 0; j < p->calib.len[s] * K; j++) tokens[sel[j]]++;
        if (s + 1 == mq_first_held_out_sample(p->calib.n) && fit) memcpy(fit, tokens, (size_t)E * sizeof *fit);
    }
    /* several ranks: each calibrates and quantizes its share of the experts over every token,
     * then every rank runs every quantized expert on its share of the samples */
    const bool dist = p->ranks > 1;
    int64_t own_lo = 0, own_hi = E;
    int64_t *cost = calloc((size_t)E, sizeof *cost);
    if (!cost) {
        free(gu), free(dn), free(tokens), free(fit);
        return mq_err(MOEQ_E_NOMEM, "out of memory for %d experts", E);
    }
    expert_costs(p, tokens, E, cost);
    if (dist) mq_dist_share_weighted(cost, E, p->rank, p->ranks, &own_lo, &own_hi);
    /* each rank's FLOPs by part, for fit_shares */
    const bool measure = dist && p->fit_shares && p->calibrate && !replay && o->gptq;
    double *rank_x = measure ? calloc((size_t)(2 * p->ranks), sizeof *rank_x) : NULL;
    double *rank_g = rank_x ? rank_x + p->ranks : NULL;
    for (int r = 0; rank_x && r < p->ranks; r++) {
        int64_t lo, hi;
        mq_dist_share_weighted(cost, E, r, p->ranks, &lo, &hi);
        for (int64_t e = lo; e < hi; e++) {
            double f[2];
            expert_flops(p, tokens[e], f);
            rank_x[r] += f[0], rank_g[r] += f[1];
        }
    }
    const double t_work = mq_now();
    bool need_block = false;
    for (int e = 0; e < E; e++) {
        mq_slot_set(p, &gu[e], e, false, &ly->exp_gate[e], &ly->exp_up[e], NULL);
        mq_slot_set(p, &dn[e], e, true, &ly->exp_down[e], NULL, NULL);
        for (int r = 0; dist && r < p->ranks; r++) {
            int64_t lo, hi;
            mq_dist_share_weighted(cost, E, r, p->ranks, &lo, &hi);
            if (e >= lo && e < hi) mq_slot_own(&gu[e], r), mq_slot_own(&dn[e], r);
        }
        gu[e].tokens = dn[e].tokens = tokens[e];
        gu[e].hold = dn[e].hold = fit ? fit[e] : 0;
        if (o->gptq && tokens[e] < o->min_expert_tokens) {
            mq_how h = o->fallback_rtn ? MQ_HOW_RTN : MQ_HOW_GPTQ_BLOCK_HESSIAN;
            gu[e].how = dn[e].how = h;
            need_block |= h == MQ_HOW_GPTQ_BLOCK_HESSIAN && gu[e].nw > 0 && mq_slot_mine(p, &gu[e]);
        }
    }
    free(tokens);
    free(cost);
    moeq_status st = fit && (!measure || rank_x) ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory for %d experts", E);
    free(fit);
    float *block_H = NULL;
    if (!st && need_block && !replay) {   /* the fallback's inputs, on the host */
        st = mq_pipe_xn_to_host(p, l);
        if (!st) st = block_hessian(p, l, &block_H);
    }
    const int C = p->mp.chunk > 0 && p->mp.chunk < E ? p->mp.chunk : E;
    const bool calib = p->calibrate && !replay;
    /* one process on a GPU: the experts' outputs are combined there, over every chunk, and read
     * back once; the passes that give them must keep their rows there (batch_run's dev_rows) */
    if (!st && mq_pipe_experts_on_device(p, l, replay)) st = mq_gpu_buf_new(p->gpu, p->calib.n * p->LD, &p->gout);
    p->layers[l].gpu_combined = p->gout != NULL;
    for (int e0 = (int)own_lo; e0 < own_hi && !st; e0 += C) {
        const int e1 = e0 + C < own_hi ? e0 + C : (int)own_hi;
        if ((st = mq_pipe_read_part(p, l, MQ_PART_EXPERTS, e0, e1, NULL, NULL))) break;
        /* the next chunk while this one computes, during the last the next layer's attention (one
         * process: else only the page cache) */
        const int e2 = e1 + C < own_hi ? e1 + C : (int)own_hi;
        if (e1 < own_hi) mq_lazy_prefetch(p->lz, l, MQ_PART_EXPERTS, e1, e2);
        if (e1 < own_hi && !dist && !replay) st = mq_pipe_start_ahead(p, l, MQ_PART_EXPERTS, e1, e2);
        else if (!dist && !replay && l + 1 < p->plan.n_layers)
            st = mq_pipe_start_ahead(p, l + 1, mq_pipe_attention_parts(p, l + 1), 0, 0);
        if (st) break;
        /* one process on a GPU: the chunk's experts go up once, gate, up and down, for both
         * passes and GPTQ (which leaves the dequantized weights there) */
        if (p->gpu && !dist && !replay && calib) {
            mq_gpu_mlp *m = NULL;
            double t0 = mq_now(), c0 = mq_cpu_now();   /* the upload, as the forward's */
            if (p->gx_ahead && p->gx_ahead_l == l && e0 == 0 && e1 == p->gx_ahead_e1) {
                m = p->gx_ahead;   /* sent during the attention (experts_ahead) */
                p->gx_ahead = NULL;
                p->layers[l].gpu_experts_ahead = true;
            } else {
                st = mq_pipe_gpu_experts(p, l, e0, e1, true, mq_plan_batch_rows(p, e1 - e0), &m);
            }
            p->layers[l].forward += mq_now() - t0;
            p->layers[l].cpu_forward += mq_cpu_now() - c0;
            p->gx = m;
            p->gx_e0 = e0;
            p->gx_e1 = e1;
            if (st) break;
        }
        for (int e = e0; e < e1 && !st && calib; e++)
            if (!(st = mq_slot_hessian(p, &gu[e]))) st = mq_slot_hessian(p, &dn[e]);
        /* calibration: Hessians (and amax) from the experts' routed tokens; without sequential
         * calibration (and alone) this pass also gives the layer's output */
        /* asymmetric calibration in one process: the unquantized stream's expert outputs come
         * with the calibration pass where it can give them (it has most of their gate/up rows) */
        bool fp_done = false;
        if (!st && calib)
            st = mq_pipe_experts_pass(p, l, e0, e1, hs, !p->seq && !dist, o->gptq, o->act_quant, gu, dn, false,
                                      p->target && !dist ? &fp_done : NULL);
        /* else the unquantized stream's outputs of the chunk's experts in a pass of their own,
         * before their weights change (a replay: before the quantized ones are read back) */
        if (!st && p->target && !dist && !fp_done)
            st = mq_pipe_experts_pass(p, l, e0, e1, mq_pipe_fp_source(p), true, false, false, gu, dn, false, NULL);
        if (!st && calib && o->gptq) st = fallback_down(p, l, dn, e0, e1);
        for (int e = e0; e < e1 && calib; e++) {
            moeq_status fa = mq_slot_form_timed(p, l, &gu[e]), fb = mq_slot_form_timed(p, l, &dn[e]);
            if (!st) st = fa ? fa : fb;
        }
        if (!st && calib && p->target) st = mq_pipe_target_slots(p, l, gu + e0, e1 - e0, dn + e0, e1 - e0);
        if (!st && !replay) {
            /* gate/up slots then down slots of the chunk, in one run */
            mq_slot *q = calloc((size_t)(2 * (e1 - e0)), sizeof *q);
            if (!q) st = mq_err(MOEQ_E_NOMEM, "out of memory");
            for (int e = e0; !st && e < e1; e++) {
                q[e - e0] = gu[e];
                q[(e1 - e0) + (e - e0)] = dn[e];
            }
            if (!st) st = mq_pipe_quantize_slots(p, l, q, 2 * (e1 - e0), block_H);
            for (int e = e0; q && e < e1; e++) {   /* mq_pipe_quantize_slots took the Hessians */
                mq_slot *qa = &q[e - e0], *qb = &q[(e1 - e0) + (e - e0)];
                gu[e].H = dn[e].H = gu[e].Hh = dn[e].Hh = NULL;
                mq_hessian_free(&qa->h);
                mq_hessian_free(&qb->h);
                gu[e].h = dn[e].h = (mq_hessian){0};
                /* results held for mq_pipe_share_slots (several ranks) */
                memcpy(gu[e].q, qa->q, sizeof gu[e].q);
                memcpy(gu[e].qs, qa->qs, sizeof gu[e].qs);
                gu[e].held = qa->held;
                memcpy(dn[e].q, qb->q, sizeof dn[e].q);
                memcpy(dn[e].qs, qb->qs, sizeof dn[e].qs);
                dn[e].held = qb->held;
            }
            free(q);
        } else if (!st && replay && p->seq) {
            st = mq_pipe_read_back_slots(p, gu + e0, e1 - e0);
            if (!st) st = mq_pipe_read_back_slots(p, dn + e0, e1 - e0);
        }
        /* the output of the quantized experts on the quantized attention's FFN input */
        if (!dist && !st && p->seq)
            st = mq_pipe_experts_pass(p, l, e0, e1, output_source(p), true, false, false, gu, dn, false, NULL);
        if (!dist && !st && replay && !p->seq)
            st = mq_pipe_experts_pass(p, l, e0, e1, output_source(p), true, false, false, gu, dn, false, NULL);
        /* the chunk's writes, while the device runs the pass just queued */
        moeq_status ws = mq_pipe_write_pending(p, !st);
        if (!st) st = ws;
        for (int e = e0; e < e1; e++) {
            mq_slot_drop_sums(&gu[e]);
            mq_slot_drop_sums(&dn[e]);
        }
        {   /* freeing waits for the device to finish the chunk's quantized pass: forward time */
            double t0 = mq_now(), c0 = mq_cpu_now();
            mq_gpu_mlp_free(p->gx);
            p->layers[l].forward += mq_now() - t0;
            p->layers[l].cpu_forward += mq_cpu_now() - c0;
        }
        p->gx = NULL;
        mq_pipe_drop_part(p, l, MQ_PART_EXPERTS, e0, e1);
        p->layers[l].chunks++;
        if (!st && mq_fault_point("chunk", l, (e0 - (int)own_lo) / C))
            st = mq_err(MOEQ_E_IO, "layer %d, expert chunk %d: injected fault (MOEQ_DEBUG_FAULT)", l, (e0 - (int)own_lo) / C);
        if (!dist) mq_pipe_progress(p, p->mp_units.expert * (e1 - e0));
    }
    if (dist) {
        /* every expert from its owner, chunk by chunk in expert order; each rank's samples
         * through them (unquantized ones without sequential calibration). With sequential
         * calibration a quantized Linear's weights are its dequantized codes: only the others
         * are read from the checkpoint. */
        char step[48];
        snprintf(step, sizeof step, "layer %d: experts", l);
        const double work = mq_now() - t_work;   /* this rank's experts, before it waits */
        st = mq_dist_agree(st, step);
        if (!st && measure) {
            int64_t us = (int64_t)(work * 1e6), most, *all = calloc((size_t)p->ranks, sizeof *all);
            double *w = calloc((size_t)p->ranks, sizeof *w);
            st = all && w ? mq_dist_gather_i64(us, &most, all, step) : mq_err(MOEQ_E_NOMEM, "out of memory");
            for (int r = 0; !st && r < p->ranks; r++) w[r] = (double)all[r] * 1e-6;
            if (!st) fit_shares(p, w, rank_x, rank_g);
            free(all);
            free(w);
        }
        for (int e0 = 0; e0 < E && !st; e0 += C) {
            const int e1 = e0 + C < E ? e0 + C : E;
            quantized_in qi = {gu + e0, dn + e0, e1 - e0};
            /* asymmetric calibration: every expert's source weights, for the unquantized stream's
             * outputs of this rank's samples first */
            st = mq_pipe_read_part(p, l, MQ_PART_EXPERTS, e0, e1, p->seq && !p->target ? is_quantized_in : NULL, &qi);
            if (!st && p->target)
                st = mq_pipe_experts_pass(p, l, e0, e1, mq_pipe_fp_source(p), true, false, false, gu, dn, true, NULL);
            st = mq_dist_agree(st, step);
            if (!st) st = mq_pipe_share_slots(p, l, gu + e0, e1 - e0);
            if (!st) st = mq_pipe_share_slots(p, l, dn + e0, e1 - e0);
            if (!st) st = mq_pipe_experts_pass(p, l, e0, e1, output_source(p), true, false, false, gu, dn, true, NULL);
            mq_pipe_drop_part(p, l, MQ_PART_EXPERTS, e0, e1);
            mq_pipe_progress(p, p->mp_units.expert * (e1 - e0));
        }
    }
    if (!st && o->act_quant && !replay && p->w) st = unseen_expert_scales(p, gu, dn, E);
    if (p->gpu && mq_env(MQ_ENV_PROFILE)) mq_expert_batches_profile_log(l);
    if (p->gout) {   /* the combined outputs into OUT, or added to the boundary there */
        double t0 = mq_now(), c0 = mq_cpu_now();
        mq_actbuf *dst = &p->OUT;
        if (p->gbound && !st) {
            st = mq_gpu_buf_add(p->gout, p->gbound, p->calib.n * p->LD);
            dst = mq_pipe_out_buf(p);
            p->layers[l].gpu_residual = !st;
        }
        if (!st) st = gpu_acts_to_host(p, p->gout, dst);
        else mq_gpu_sync(p->gpu);   /* nothing left in flight */
        p->layers[l].forward += mq_now() - t0;
        p->layers[l].cpu_forward += mq_cpu_now() - c0;
        /* the boundary there is the next layer's input (gin), X's bits */
        if (!st && p->layers[l].gpu_residual && !host_copies_forced()) {
            mq_gpu_buf_free(p->gin);
            p->gin = p->gout;
            p->gin_ready = true;
        } else {
            mq_gpu_buf_free(p->gout);
        }
        p->gout = NULL;
    }
    mq_pipe_gpu_ffn_inputs_free(p);
    mq_gpu_mlp_free(p->gx_ahead);   /* not taken (a failure before its chunk) */
    p->gx_ahead = NULL;
    mq_free(block_H);
    free(rank_x);
    for (int e = 0; e < E; e++) {
        mq_slot_free(&gu[e]);
        mq_slot_free(&dn[e]);
    }
    free(gu);
    free(dn);
    return st;
}

/* ---- shared expert and dense MLP: one unit over all tokens ----------------------------------- */

/* One pass of the samples through the unit: Hessians and amax (calibration), and/or its output
 * into OUT. */
/* Asymmetric calibration's scratch of mlp_pass (calibration): the unquantized stream's FFN input
 * and its gate/up, [Lmax, D] and [Lmax, F] twice; NULL members without it. */
typedef struct {
    float *xs, *hg, *hu;
} fp_scratch;

static moeq_status mlp_pass(mq_pipe *p, int l, bool shared, mq_slot *sl, mq_ffn_source src, bool calib,
                            bool out, float *xs, float *hg, float *hu, float *y, float *sgate, bool own,
                            const fp_scratch *fs) {
    mq_layer *ly = &p->m->layers[l];
    mq_linear *g = shared ? &ly->sh_gate : &ly->gate, *u = shared ? &ly->sh_up : &ly->up,
              *d = shared ? &ly->sh_down : &ly->down;
    const int64_t D = p->c->D, F = g->out;
    moeq_status st = MOEQ_OK;
    const int64_t s_lo = own ? p->s_lo : 0, s_hi = own ? p->s_hi : p->calib.n;
    for (int64_t s = s_lo; s < s_hi && !st; s++) {
        if ((st = mq_pipe_check_interrupt())) break;
        const int64_t T = p->calib.len[s];
        double t0 = mq_now(), c0 = mq_cpu_now();
        const float *x = mq_pipe_ffn_input(p, l, &src, s, xs);
        st = mq_mlp_forward(g, u, d, x, T, hg, hu, out ? y : NULL);
        double t1 = mq_now(), c1 = mq_cpu_now();
        if (!st && calib) {
            if (sl[0].h.sum) st = mq_slot_add(&sl[0], x, T);
            if (sl[1].h.sum && !st) st = mq_slot_add(&sl[1], hg, T);
            if (p->o->act_quant) {
                mq_amax_update(&sl[0].amax, x, T * D);
                mq_amax_update(&sl[1].amax, hg, T * F);
            }
        }
        if (!st && calib && fs && fs->xs) {   /* the same tokens of the unquantized stream */
            const mq_ffn_source f = mq_pipe_fp_source(p);
            const float *xf = mq_pipe_ffn_input(p, l, &f, s, fs->xs);
            st = mq_mlp_forward(g, u, NULL, xf, T, fs->hg, fs->hu, NULL);
            if (!st) {
                mq_slot_cross(&sl[0], xf, x, T);
                mq_slot_cross(&sl[1], fs->hg, hg, T);
            }
        }
        double t2 = mq_now(), c2 = mq_cpu_now();
        if (!st && out) {
            float *o = mq_actbuf_ptr(src.fp ? &p->OUTF : &p->OUT, (size_t)(s * p->LD));
            if (shared) mq_shared_expert_add(p->m, l, x, T, y, sgate, o);
            else memcpy(o, y, sizeof(float) * (size_t)(T * D));
        }
        p->layers[l].forward += (t1 - t0) + (mq_now() - t2);
        p->layers[l].cpu_forward += (c1 - c0) + (mq_cpu_now() - c2);
        p->layers[l].hessian += t2 - t1;
        p->layers[l].cpu_hessian += c2 - c1;
    }
    return st;
}

/* The shared expert or the dense MLP: one unit over every token. */
moeq_status mq_pipe_mlp_unit(mq_pipe *p, int l, bool shared, bool replay) {
    mq_layer *ly = &p->m->layers[l];
    const unsigned part = shared ? MQ_PART_SHARED : MQ_PART_MLP;
    moeq_status st = mq_pipe_read_part(p, l, part, 0, 0, NULL, NULL);
    if (st) return st;
    mq_linear *g = shared ? &ly->sh_gate : &ly->gate;
    mq_slot sl[2];
    mq_slot_set(p, &sl[0], -1, false, g, shared ? &ly->sh_up : &ly->up, NULL);
    mq_slot_set(p, &sl[1], -1, true, shared ? &ly->sh_down : &ly->down, NULL, NULL);
    const bool dist = p->ranks > 1;
    /* rank 0 has the attention's q */
    if (dist) mq_slot_own(&sl[0], p->ranks - 1), mq_slot_own(&sl[1], p->ranks - 1);
    const int64_t Lmax = p->calib.max_len, D = p->c->D, F = g->out;
    float *xs = mq_alloc_array((size_t)p->LD, sizeof(float), "FFN input");
    float *hg = mq_alloc_array((size_t)(Lmax * F), sizeof(float), "MLP activations");
    float *hu = mq_alloc_array((size_t)(Lmax * F), sizeof(float), "MLP activations");
    float *y = mq_alloc_array((size_t)(Lmax * D), sizeof(float), "MLP output");
    float *sgate = mq_alloc_array((size_t)Lmax, sizeof(float), "shared expert gate");
    if (!xs || !hg || !hu || !y || !sgate) st = MOEQ_E_NOMEM;
    fp_scratch fs = {NULL, NULL, NULL};
    if (!st && p->target) {
        fs.xs = mq_alloc_array((size_t)p->LD, sizeof(float), "unquantized FFN input");
        fs.hg = mq_alloc_array((size_t)(Lmax * F), sizeof(float), "unquantized MLP activations");
        fs.hu = mq_alloc_array((size_t)(Lmax * F), sizeof(float), "unquantized MLP activations");
        if (!fs.xs || !fs.hg || !fs.hu) st = MOEQ_E_NOMEM;
    }
    /* asymmetric calibration: first the unquantized stream's output of the unit (the source
     * weights, before anything changes them), of this rank's samples */
    const mq_ffn_source fsrc = mq_pipe_fp_source(p);
    if (!st && p->target) st = mlp_pass(p, l, shared, sl, fsrc, false, true, xs, hg, hu, y, sgate, dist, NULL);
    if (!st && p->calibrate && !replay && mq_slot_mine(p, &sl[0])) {
        /* calibration; without sequential calibration (and alone) it also gives the output */
        for (int i = 0; i < 2 && !st; i++) st = mq_slot_hessian(p, &sl[i]);
        if (!st)
            st = mlp_pass(p, l, shared, sl, hessian_source(p), true, !p->seq && !dist, xs, hg, hu, y, sgate, false, &fs);
        for (int i = 0; i < 2; i++) {
            sl[i].tokens = sl[i].h.n;
            moeq_status fst = mq_slot_form_timed(p, l, &sl[i]);
            if (!st) st = fst;
        }
        if (!st && p->target) st = mq_pipe_target_slots(p, l, sl, 2, NULL, 0);
        if (!st) st = mq_pipe_quantize_slots(p, l, sl, 2, NULL);
    } else if (!st && replay) {
        if (p->seq) st = mq_pipe_read_back_slots(p, sl, 2);
        else st = mlp_pass(p, l, shared, sl, output_source(p), false, true, xs, hg, hu, y, sgate, false, NULL);
    }
    if (dist && !replay) {
        /* from its owner to every rank; then each rank's samples through it */
        char step[48];
        snprintf(step, sizeof step, "layer %d: %s", l, shared ? "shared expert" : "MLP");
        st = mq_dist_agree(st, step);
        if (!st) st = mq_pipe_share_slots(p, l, sl, 2);
        if (!st) st = mlp_pass(p, l, shared, sl, output_source(p), false, true, xs, hg, hu, y, sgate, true, NULL);
    } else if (!st && p->seq) {
        /* the quantized unit's output on the quantized attention's FFN input */
        st = mlp_pass(p, l, shared, sl, output_source(p), false, true, xs, hg, hu, y, sgate, false, NULL);
    }
    for (int i = 0; i < 2; i++) mq_slot_free(&sl[i]);
    MQ_RELEASE_EACH(fs.xs, fs.hg, fs.hu, xs, hg, hu, y, sgate);
    mq_pipe_drop_part(p, l, part, 0, 0);
    mq_pipe_progress(p, shared ? p->mp_units.shared : p->mp_units.mlp);
    return st;
}
