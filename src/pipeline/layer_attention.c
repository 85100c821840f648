/*
 * A layer's attention stage. Pass A runs every sample through the unquantized attention, whose
 * hooks give each Linear's input for its Hessian (and amax); the attention's slots are then
 * quantized (layer_quantize.c). Pass B (sequential calibration) runs the quantized attention.
 * The pass that gives the FFN's inputs leaves them, with their routing, for the FFN stage. On the
 * CPU through the model's own mq_attention_forward, or on the GPU twin (mq_gpu_attn) where the
 * layer fits it; with several ranks each rank runs its share of the samples and the Hessians are
 * summed across ranks in sample order (a relay of bands on the CPU, a gather on the owner with a
 * GPU), as one process sums them.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dist/dist.h"
#include "core/env.h"
#include "kernels/gemm_det.h"
#include "pipeline/layer_internal.h"

/* ---- the attention stage ---------------------------------------------------------------------- */

typedef struct {
    mq_slot *qkv, *o;
    float *arena_qkv, *arena_o;   /* the hook's inputs, copied for the Hessian updates */
    int64_t rows_qkv, rows_o;
    /* multi-head latent attention: q_b_proj and kv_b_proj read the normed latents (their own
     * Hessians); qkv is then q_a_proj (or q_proj) with kv_a_proj_with_mqa */
    mq_slot *qb, *kvb;
    float *arena_qb, *arena_kvb;
    int64_t rows_qb, rows_kvb;
    bool store;                   /* several ranks: the arenas hold every sample of this rank's
                                     share (at: the sample's place), sent to the slots' owners */
    int64_t at, Lmax;
    bool amax;
    /* asymmetric calibration: while fp is set the hooks see the unquantized stream's sample,
     * whose inputs go to farena_* (laid out as the arenas: one sample, or with store the
     * rank's samples) to pair with the quantized stream's */
    bool fp;
    float *farena_qkv, *farena_o, *farena_qb, *farena_kvb;
} att_capture;

static void on_attention(void *user, int layer, mq_site site, int expert, const float *x,
                         int64_t rows, int64_t cols) {
    (void)layer;
    (void)expert;
    att_capture *c = user;
    if (c->fp) {
        float *fa = site == MQ_SITE_QKV ? c->farena_qkv : site == MQ_SITE_O ? c->farena_o
                  : site == MQ_SITE_Q_B ? c->farena_qb : site == MQ_SITE_KV_B ? c->farena_kvb : NULL;
        if (fa && rows > 0) mq_copy_floats(fa + c->at * c->Lmax * cols, x, (size_t)(rows * cols));
        return;
    }
    mq_slot *s = site == MQ_SITE_QKV ? c->qkv : site == MQ_SITE_O ? c->o
               : site == MQ_SITE_Q_B ? c->qb : site == MQ_SITE_KV_B ? c->kvb : NULL;
    if (!s || rows <= 0) return;
    float *arena = site == MQ_SITE_QKV ? c->arena_qkv : site == MQ_SITE_O ? c->arena_o
                 : site == MQ_SITE_Q_B ? c->arena_qb : c->arena_kvb;
    int64_t *nr = site == MQ_SITE_QKV ? &c->rows_qkv : site == MQ_SITE_O ? &c->rows_o
                : site == MQ_SITE_Q_B ? &c->rows_qb : &c->rows_kvb;
    if (arena && (s->h.sum || c->store)) {
        mq_copy_floats(arena + c->at * c->Lmax * cols, x, (size_t)(rows * cols));
        *nr = rows;
    }
    if (c->amax) mq_amax_update(&s->amax, x, rows * cols);
}

/* Sample s's routing in the layer's [S][Lmax][K] arrays: its experts, their weights. */
static int32_t *sel_of(int32_t *sel, const mq_pipe *p, int64_t s) {
    return sel + s * p->calib.max_len * p->c->top_k;
}
static float *wt_of(float *w, const mq_pipe *p, int64_t s) {
    return w + s * p->calib.max_len * p->c->top_k;
}

typedef struct {
    float *xt;                    /* [Lmax, D] the sample being run */
    float *xn;                    /* [Lmax, D] its FFN input */
    float *xf;                    /* [Lmax, D] asymmetric calibration: the unquantized stream's */
    float *probs;                 /* [Lmax, E] router scratch */
    bool gpu;                     /* the attention runs on p->gatt */
    bool pinned;                  /* xt and xn are page-locked (mq_gpu_host_alloc) */
    bool ahead;                   /* this pass reads and sends up the first expert chunk while
                                     the device runs it (experts_ahead) */
    double *prof;                 /* MOEQ_DEBUG_PROFILE: seconds of the inputs' copies, the FFN norm
                                     and routing, the outputs' copies [3], or NULL */
} att_scratch;

/* MOEQ_DEBUG_PROFILE's attention-stage parts (att_scratch.prof): the seconds since *t to part k. */
static void att_prof_add(const att_scratch *sc, int k, double *t) {
    if (!sc->prof) return;
    const double now = mq_now();
    sc->prof[k] += now - *t;
    *t = now;
}

/* Whether layer l's attention can run on the GPU: the standard attention of the families the
 * GPU twin implements, fp32 weights, no emulated activation quantizer (its amax and rounding
 * stay on the CPU). */
static bool gpu_attention_fits(const mq_pipe *p, int l) {
    const mq_config *c = p->c;
    const mq_layer *ly = &p->m->layers[l];
    const bool family = c->arch == MQ_ARCH_LLAMA || c->arch == MQ_ARCH_OLMOE || c->arch == MQ_ARCH_QWEN2_MOE ||
                        c->arch == MQ_ARCH_QWEN3_MOE || c->arch == MQ_ARCH_MIXTRAL;
    return p->gpu && family && !p->o->act_quant && ly->q.w && ly->k.w && ly->v.w && ly->o.w &&
           !ly->q.act_q && !ly->o.act_q && mq_env(MQ_ENV_GPU_ATTENTION_OFF) == NULL;
}

/* Uploads layer l's attention weights (as they are now: the quantized ones for pass B) to the
 * GPU twin, made at the first call. */
static moeq_status gpu_attention_set(mq_pipe *p, int l) {
    const mq_config *c = p->c;
    const mq_layer *ly = &p->m->layers[l];
    moeq_status st = MOEQ_OK;
    if (!p->gatt) {
        mq_gpu_attn_shape sh = {.D = c->D, .H = c->n_heads, .KV = c->n_kv_heads, .hd = c->head_dim,
                                .max_T = p->calib.max_len, .eps = c->rms_eps,
                                .qk_norm = c->qk_norm == MQ_QKNORM_FULL ? 1 : c->qk_norm == MQ_QKNORM_HEAD ? 2 : 0,
                                .clip_qkv = c->clip_qkv, .E = c->n_experts, .top_k = c->top_k,
                                .norm_topk = c->norm_topk_prob};
        mq_state_rope_tables(p->state, &sh.rope_cos, &sh.rope_sin);
        if ((st = mq_gpu_attn_new(p->gpu, &sh, &p->gatt))) return st;
    }
    mq_gpu_attn_weights w = {.norm = ly->attn_norm, .q = ly->q.w, .k = ly->k.w, .v = ly->v.w, .o = ly->o.w,
                             .q_bias = ly->q.bias, .k_bias = ly->k.bias, .v_bias = ly->v.bias,
                             .o_bias = ly->o.bias, .q_norm = ly->q_norm, .k_norm = ly->k_norm,
                             .window = c->layer_sliding[l] ? c->sliding_window : 0,
                             .ffn_norm = ly->ffn_norm, .router = ly->is_moe ? ly->router : NULL};
    return mq_gpu_attn_set(p->gatt, &w);
}

/* One process on a GPU uploads each chunk of a layer's routed experts in mq_pipe_routed_experts,
 * where the device waits for the host to read (bf16 -> fp32) and send them. The first chunk
 * instead goes while the layer's last attention pass runs there (mq_gpu_attn_io.meanwhile), so
 * the device does not sit idle through its read and upload. The plan counts the chunk's weights
 * beside the attention stage (memplan.c). MOEQ_DEBUG_EXPERTS_AHEAD=0 turns it off. */
static int first_chunk_end(const mq_pipe *p) {
    const int E = p->c->n_experts;
    return p->mp.chunk > 0 && p->mp.chunk < E ? p->mp.chunk : E;
}

static bool experts_ahead_wanted(const mq_pipe *p, int l, bool replay) {
    const char *env = mq_env(MQ_ENV_EXPERTS_AHEAD);
    if (env && strcmp(env, "0") == 0) return false;
    /* as mq_pipe_routed_experts uploads: calibration in one process, experts plain once read */
    return p->gpu && p->ranks <= 1 && !replay && p->calibrate && p->m->layers[l].is_moe &&
           mq_pipe_experts_plain_as(p, l, 0, first_chunk_end(p), false);
}

typedef struct {
    mq_pipe *p;
    int l;
    double seconds, cpu;          /* its wall and CPU time, which the attention's do not count */
} ahead_job;

static moeq_status experts_ahead(void *user) {
    ahead_job *j = user;
    mq_pipe *p = j->p;
    const int e1 = first_chunk_end(p);
    const double t0 = mq_now(), c0 = mq_cpu_now();
    moeq_status st = mq_pipe_read_part(p, j->l, MQ_PART_EXPERTS, 0, e1, NULL, NULL);
    const double t1 = mq_now(), c1 = mq_cpu_now();
    mq_gpu_mlp *m = NULL;
    if (!st) st = mq_pipe_gpu_experts(p, j->l, 0, e1, true, mq_plan_batch_rows(p, e1), &m);
    p->layers[j->l].forward += mq_now() - t1;   /* the upload, as the forward's
                                                   (mq_pipe_routed_experts) */
    p->layers[j->l].cpu_forward += mq_cpu_now() - c1;
    mq_gpu_mlp_free(p->gx_ahead);
    p->gx_ahead = m;
    p->gx_ahead_l = j->l;
    p->gx_ahead_e1 = e1;
    j->seconds += mq_now() - t0;
    j->cpu += mq_cpu_now() - c0;
    return st;
}

/* attention_pass on the GPU: the samples in batches of up to one group of the GPU twin
 * (mq_gpu_attn_rows tokens), each batch one call. Where the activations are page-locked
 * (alloc_activations) a sample goes up from them and its results come back into them directly;
 * otherwise through sc's page-locked rows (Lmax tokens a batch). */
static moeq_status attention_pass_gpu(mq_pipe *p, int l, bool pass_a, att_capture *cap, att_scratch *sc) {
    const mq_config *c = p->c;
    const bool moe = p->m->layers[l].is_moe;
    const int64_t D = c->D, Q = (int64_t)c->n_heads * c->head_dim, Lmax = p->calib.max_len;
    const int64_t s_lo = p->ranks > 1 ? p->s_lo : 0, s_hi = p->ranks > 1 ? p->s_hi : p->calib.n;
    /* what follows the attention (below) on the GPU too: only the results come back */
    const bool keep_xn = pass_a && p->seq && !p->tseq, keep_h = !pass_a || !p->seq;
    /* ... and of those the host's copies, unless only the device reads them */
    const bool host_xn = keep_xn && !(moe && mq_pipe_xn_device_only(p)),
               host_h = keep_h && !(moe && mq_pipe_boundary_device_only(p, pass_a));
    if (keep_xn) p->xn_device_only = p->layers[l].gpu_xn_device_only = !host_xn;
    if (keep_h) p->layers[l].gpu_h_device_only = !host_h;
    mq_actbuf *hb = mq_pipe_out_buf(p);
    /* X from the device where it is there (gin), else from the host, kept there for pass B */
    mq_gpu_buf *x_from = p->gin && p->gin_ready ? p->gin : NULL;
    mq_gpu_buf *x_keep = !x_from && p->gin && pass_a && p->seq ? p->gin : NULL;
    const bool x_direct = p->X.pinned || x_from, h_direct = !host_h || hb->pinned, n_direct = !host_xn || p->XN.pinned;
    const bool staged = !x_direct || !h_direct || !n_direct;
    const int64_t rows_max = staged ? Lmax : mq_gpu_attn_rows(p->gatt);
    mq_gpu_attn_io io = {.ffn_dev = keep_xn ? p->gffn_xn : keep_h && moe ? p->gffn_h : NULL,
                         .h_dev = keep_h && moe && !keep_xn ? p->gbound : NULL, .x_from = x_from, .x_keep = x_keep};
    if (cap && !cap->store) {   /* the hooks' work done there: Hessian sums on the device */
        io.hq = cap->qkv->gh;
        io.ho = cap->o->gh;
    }
    ahead_job ahead = {p, l, 0, 0};
    if (sc->ahead) {
        io.meanwhile = experts_ahead;
        io.meanwhile_user = &ahead;
        mq_gpu_set_sizing_reserve(p->gpu, p->mp.gpu_ahead_reserve);
    }
    int64_t n_max = rows_max < s_hi - s_lo ? rows_max : s_hi - s_lo;
    mq_gpu_attn_sample *smp = mq_alloc_array((size_t)(n_max > 0 ? n_max : 1), sizeof *smp, "attention samples");
    if (!smp) return MOEQ_E_NOMEM;
    moeq_status st = MOEQ_OK;
    for (int64_t s0 = s_lo, s1; s0 < s_hi && !st; s0 = s1) {
        if ((st = mq_pipe_check_interrupt())) break;
        double t0 = mq_now(), c0 = mq_cpu_now();
        int64_t n = 0, rows = 0;
        for (s1 = s0; s1 < s_hi && rows + p->calib.len[s1] <= rows_max; s1++) {
            const int64_t T = p->calib.len[s1];
            const size_t off = (size_t)(s1 * p->LD);
            float *xt = staged ? sc->xt + rows * D : NULL, *xn = staged ? sc->xn + rows * D : NULL;
            mq_gpu_attn_sample *m = &smp[n++];
            memset(m, 0, sizeof *m);
            m->T = T;
            if (x_from) {
                m->x = NULL;
            } else if (x_direct) {
                m->x = mq_actbuf_ptr(&p->X, off);
            } else {   /* bf16 or mapped: converted or copied into the staging rows */
                const float *v = mq_actbuf_view(&p->X, off, (size_t)(T * D), xt);
                if (v != xt) mq_copy_floats(xt, v, (size_t)(T * D));
                m->x = xt;
            }
            if (host_h) m->y = hb->pinned ? mq_actbuf_ptr(hb, off) : xt;
            if (host_xn) m->ffn_in = p->XN.pinned ? mq_actbuf_ptr(&p->XN, off) : xn;
            if (cap && cap->store) {   /* several ranks: the inputs kept for the Linears' owners */
                const int64_t at = s1 - s_lo;
                if (cap->arena_qkv) m->xn = cap->arena_qkv + at * Lmax * D;
                if (cap->arena_o) m->att = cap->arena_o + at * Lmax * Q;
            }
            if (moe && keep_xn) m->sel = sel_of(p->sel_a, p, s1), m->w = wt_of(p->w_a, p, s1);
            if (moe && keep_h)
                m->sel = sel_of(pass_a ? p->sel_a : p->sel_b, p, s1), m->w = wt_of(pass_a ? p->w_a : p->w_b, p, s1);
            m->ffn_dev_off = (int64_t)off;
            rows += T;
        }
        if (io.hq) cap->qkv->h.n += rows;
        if (io.ho) cap->o->h.n += rows;
        ahead.seconds = ahead.cpu = 0;
        st = mq_gpu_attn_run_samples(p->gatt, smp, n, &io);
        /* once: with the first group; the chunk is up then, in the memory in use: no reserve
         * for it any more (it would count the same bytes twice) */
        if (io.meanwhile) mq_gpu_set_sizing_reserve(p->gpu, 0);
        io.meanwhile = NULL;
        for (int64_t i = 0, r = 0; i < n && !st; r += smp[i].T, i++) {   /* the staged results */
            const size_t off = (size_t)((s0 + i) * p->LD), nv = (size_t)(smp[i].T * D);
            if (host_h && !hb->pinned) mq_actbuf_put(hb, off, nv, sc->xt + r * D);
            if (host_xn && !p->XN.pinned) mq_actbuf_put(&p->XN, off, nv, sc->xn + r * D);
        }
        /* the experts' read and upload meanwhile are counted as theirs (experts_ahead) */
        const double wall = mq_now() - t0 - ahead.seconds, cpu = mq_cpu_now() - c0 - ahead.cpu;
        p->layers[l].forward += wall;
        p->layers[l].cpu_forward += cpu;
        p->layers[l].attention += wall;
        p->layers[l].cpu_attention += cpu;
        mq_pipe_progress(p, p->mp_units.attention_sample * n * (p->ranks > 1 ? p->ranks : 1));
    }
    mq_free(smp);
    if (!st && x_keep) p->gin_ready = true;   /* for pass B */
    if (!st && x_from) p->layers[l].gpu_inputs_from_device++;
    return st;
}

/* Asymmetric calibration: sample s of the unquantized stream through the layer's attention (its
 * unquantized weights): h back into XF, its routing into sel_f / w_f; with cap, each Linear's
 * input into cap's farena_* for the quantized stream's pass that follows. */
static moeq_status fp_attention_sample(mq_pipe *p, int l, int64_t s, att_scratch *sc, att_capture *cap) {
    const int64_t T = p->calib.len[s], D = p->c->D;
    const size_t off = (size_t)(s * p->LD);
    double t = sc->prof ? mq_now() : 0;
    const float *x = mq_actbuf_view(&p->XF, off, (size_t)(T * D), sc->xf);
    if (x != sc->xf) mq_copy_floats(sc->xf, x, (size_t)(T * D));
    att_prof_add(sc, 0, &t);
    mq_hooks hooks = {on_attention, cap};
    if (cap) cap->fp = true;
    moeq_status st = mq_attention_forward(p->m, p->state, l, sc->xf, T, 0, cap ? &hooks : NULL);
    if (cap) cap->fp = false;
    if (st) return st;
    if (sc->prof) t = mq_now();
    mq_actbuf_put(&p->XF, off, (size_t)(T * D), sc->xf);
    att_prof_add(sc, 2, &t);
    if (p->m->layers[l].is_moe) {
        mq_ffn_norm(p->m, l, sc->xf, T, sc->xn);
        mq_moe_route(p->m, l, sc->xn, T, sc->probs, sel_of(p->sel_f, p, s), wt_of(p->w_f, p, s));
    }
    att_prof_add(sc, 1, &t);
    return MOEQ_OK;
}

/* The unquantized stream through the layer's attention without captures (a resumed run's
 * replay of a finished layer: before its quantized weights are read back). */
static moeq_status fp_attention_pass(mq_pipe *p, int l, att_scratch *sc) {
    moeq_status st = MOEQ_OK;
    double t0 = mq_now(), c0 = mq_cpu_now();
    for (int64_t s = 0; s < p->calib.n && !st; s++)
        if (!(st = mq_pipe_check_interrupt())) st = fp_attention_sample(p, l, s, sc, NULL);
    p->layers[l].forward += mq_now() - t0;
    p->layers[l].cpu_forward += mq_cpu_now() - c0;
    p->layers[l].attention += mq_now() - t0;
    p->layers[l].cpu_attention += mq_cpu_now() - c0;
    return st;
}

/* Runs every sample through the layer's attention. capture: pass A (hooks). Where the results go
 * depends on the mode (pipeline.h). */
static moeq_status attention_pass(mq_pipe *p, int l, bool pass_a, att_capture *cap,
                                  att_scratch *sc) {
    if (sc->gpu) return attention_pass_gpu(p, l, pass_a, cap, sc);
    const bool moe = p->m->layers[l].is_moe;
    const int64_t D = p->c->D;
    mq_hooks hooks = {on_attention, cap};
    moeq_status st = MOEQ_OK;
    /* several ranks: each runs its share of the samples */
    const int64_t s_lo = p->ranks > 1 ? p->s_lo : 0, s_hi = p->ranks > 1 ? p->s_hi : p->calib.n;
    for (int64_t s = s_lo; s < s_hi && !st; s++) {
        if ((st = mq_pipe_check_interrupt())) break;
        int64_t T = p->calib.len[s];
        double t0 = mq_now(), c0 = mq_cpu_now(), tp = t0;
        const float *x = mq_actbuf_view(&p->X, (size_t)(s * p->LD), (size_t)(T * D), sc->xt);
        if (x != sc->xt) mq_copy_floats(sc->xt, x, (size_t)(T * D));   /* bf16: converted there */
        att_prof_add(sc, 0, &tp);
        if (cap) {
            cap->rows_qkv = cap->rows_o = cap->rows_qb = cap->rows_kvb = 0;
            cap->at = cap->store ? s - s_lo : 0;
        }
        const bool keep_xn = pass_a && p->seq && !p->tseq, keep_h = !pass_a || !p->seq;
        /* asymmetric calibration: the unquantized stream's sample first, its inputs kept */
        if (p->target && pass_a && cap) st = fp_attention_sample(p, l, s, sc, cap);
        if (!st) st = mq_attention_forward(p->m, p->state, l, sc->xt, T, 0, cap ? &hooks : NULL);
        double t1 = mq_now(), c1 = mq_cpu_now();
        if (!st && cap && !cap->store) {   /* each update over the whole pool */
            if (cap->rows_qkv) st = mq_slot_add(cap->qkv, cap->arena_qkv, cap->rows_qkv);
            if (cap->rows_o && !st) st = mq_slot_add(cap->o, cap->arena_o, cap->rows_o);
            if (cap->rows_qb && !st) st = mq_slot_add(cap->qb, cap->arena_qb, cap->rows_qb);
            if (cap->rows_kvb && !st) st = mq_slot_add(cap->kvb, cap->arena_kvb, cap->rows_kvb);
        }
        if (!st && cap && !cap->store && p->target) {   /* the cross sums, paired token for token */
            mq_slot_cross(cap->qkv, cap->farena_qkv, cap->arena_qkv, cap->rows_qkv);
            mq_slot_cross(cap->o, cap->farena_o, cap->arena_o, cap->rows_o);
            if (cap->qb) mq_slot_cross(cap->qb, cap->farena_qb, cap->arena_qb, cap->rows_qb);
            if (cap->kvb) mq_slot_cross(cap->kvb, cap->farena_kvb, cap->arena_kvb, cap->rows_kvb);
        }
        double t2 = mq_now(), c2 = mq_cpu_now();
        tp = t2;
        if (!st) {
            if (keep_xn) {   /* the FFN input, kept for the experts' Hessians */
                mq_ffn_norm(p->m, l, sc->xt, T, sc->xn);
                att_prof_add(sc, 1, &tp);
                mq_actbuf_put(&p->XN, (size_t)(s * p->LD), (size_t)(T * D), sc->xn);
                att_prof_add(sc, 2, &tp);
                if (moe) mq_moe_route(p->m, l, sc->xn, T, sc->probs, sel_of(p->sel_a, p, s), wt_of(p->w_a, p, s));
            } else if (keep_h) {   /* h: the next boundary, less the FFN */
                mq_actbuf_put(mq_pipe_out_buf(p), (size_t)(s * p->LD), (size_t)(T * D), sc->xt);
                att_prof_add(sc, 2, &tp);
                if (moe) {
                    mq_ffn_norm(p->m, l, sc->xt, T, sc->xn);
                    mq_moe_route(p->m, l, sc->xn, T, sc->probs,
                                 sel_of(pass_a ? p->sel_a : p->sel_b, p, s),
                                 wt_of(pass_a ? p->w_a : p->w_b, p, s));
                }
            }
        }
        double t3 = mq_now(), c3 = mq_cpu_now();
        att_prof_add(sc, 1, &tp);
        p->layers[l].forward += (t1 - t0) + (t3 - t2);
        p->layers[l].cpu_forward += (c1 - c0) + (c3 - c2);
        p->layers[l].attention += (t1 - t0) + (t3 - t2);
        p->layers[l].cpu_attention += (c1 - c0) + (c3 - c2);
        p->layers[l].hessian += t2 - t1;
        p->layers[l].cpu_hessian += c2 - c1;
        mq_pipe_progress(p, p->mp_units.attention_sample * (p->ranks > 1 ? p->ranks : 1));
    }
    return st;
}

/* The distinct ranks that quantize a Linear of s (at least its owner), in increasing order. */
static int slot_owners(const mq_slot *s, int out[3]) {
    int n = 0;
    for (int k = 0; k < (s->nw > 0 ? s->nw : 1); k++) {
        const int r = s->nw > 0 ? s->lown[k] : s->owner;
        bool seen = false;
        for (int i = 0; i < n; i++) seen |= out[i] == r;
        if (!seen) out[n++] = r;
    }
    for (int a = 1; a < n; a++)
        for (int b = a; b > 0 && out[b - 1] > out[b]; b--) {
            const int t = out[b];
            out[b] = out[b - 1];
            out[b - 1] = t;
        }
    return n;
}

/* Several ranks: the Hessian of slot s from the inputs every rank kept of its samples (arena:
 * this rank's, width values per row), added on the owner in sample order, as one process adds
 * them. */
static moeq_status gather_hessian(mq_pipe *p, int l, mq_slot *s, const float *arena, int64_t width) {
    if (!s->nw || s->how != MQ_HOW_GPTQ) return MOEQ_OK;
    const int64_t Lmax = p->calib.max_len;
    char step[64];
    snprintf(step, sizeof step, "layer %d: inputs of %s", l, s->w[0]->name);
    float *tmp = mq_slot_mine(p, s) ? mq_alloc_array((size_t)(Lmax * width), sizeof(float), "attention inputs") : NULL;
    moeq_status st = mq_slot_mine(p, s) && !tmp ? MOEQ_E_NOMEM : MOEQ_OK;
    st = mq_dist_agree(st, step);
    for (int r = 0; r < p->ranks && !st; r++) {
        int64_t lo, hi;
        mq_dist_share(p->calib.n, r, p->ranks, &lo, &hi);
        for (int64_t t = lo; t < hi && !st; t++) {
            const int64_t rows = p->calib.len[t];
            const size_t bytes = sizeof(float) * (size_t)(rows * width);
            const float *x = r == p->rank ? arena + (t - lo) * Lmax * width : tmp;
            if (r == p->rank) {   /* to every other rank that quantizes one of its Linears */
                int own[3];
                for (int i = 0, n = slot_owners(s, own); i < n && !st; i++)
                    if (own[i] != p->rank) st = mq_dist_send(x, bytes, own[i], step);
            } else if (mq_slot_mine(p, s)) {
                st = mq_dist_recv(tmp, bytes, r, step);
            }
            if (mq_slot_mine(p, s) && !st) {
                double t0 = mq_now(), c0 = mq_cpu_now();
                st = mq_slot_add(s, x, rows);
                p->layers[l].hessian += mq_now() - t0;
                p->layers[l].cpu_hessian += mq_cpu_now() - c0;
            }
        }
    }
    mq_free(tmp);
    return st;
}

/* The first row of band r of a K x K lower triangle cut into n bands of equal area (row i has
 * i + 1 elements), so every band is about the same work. */
static int64_t band_start(int64_t K, int r, int n) {
    if (r <= 0) return 0;
    if (r >= n) return K;
    return (int64_t)llround((double)K * sqrt((double)r / (double)n));
}

/* Several ranks, on the CPU: the Hessian of slot s as a relay over the ranks in rank order,
 * which is sample order (contiguous shares). The lower triangle is cut into bands of rows of
 * equal area; rank 0 sums its samples' rows into band 0 and hands the band to rank 1, which goes
 * on with its samples (mq_syrk_det_acc: every element the same chain of fmaf in row order as
 * one process's) and hands it on, while rank 0 starts band 1, and so on: every rank works on its
 * own samples only, the bands pipeline through (idle at the start and end: (N - 1) bands of
 * RELAY_BANDS_PER_RANK * N), and what moves is the sum, K x K per rank, not every sample's
 * inputs. The last rank then sends the whole sum to each other rank that quantizes one of the
 * slot's Linears. */
enum { RELAY_BANDS_PER_RANK = 8 };

/* The relay itself: C, this rank's K x K buffer of the slot's sum, goes from rank to rank band by
 * band, each rank adding its samples' rows (arena: their inputs, width values a row) into the
 * band; with farena (the unquantized stream's inputs of the same rows) the cross sum's square in
 * bands of equal rows, else the Hessian's lower triangle in bands of equal area. Then the sum,
 * complete on the last rank, goes to the others that quantize one of the slot's Linears. */
static moeq_status relay_sum(mq_pipe *p, int l, const mq_slot *s, float *C, const float *farena, const float *arena,
                             int64_t width, const char *step) {
    const int64_t Lmax = p->calib.max_len, K = width;
    const int last = p->ranks - 1;
    moeq_status st = MOEQ_OK;
    int64_t lo, hi;
    mq_dist_share(p->calib.n, p->rank, p->ranks, &lo, &hi);
    int64_t nb = (int64_t)RELAY_BANDS_PER_RANK * p->ranks;
    if (nb > K) nb = K;
    for (int64_t b = 0; b < nb && !st; b++) {
        const int64_t a = farena ? K * b / nb : band_start(K, (int)b, (int)nb);
        const int64_t e = farena ? K * (b + 1) / nb : band_start(K, (int)b + 1, (int)nb);
        const size_t bytes = sizeof(float) * (size_t)((e - a) * K);
        if (e <= a) continue;
        if (p->rank > 0) st = mq_dist_recv(C + a * K, bytes, p->rank - 1, step);
        double t0 = mq_now(), c0 = mq_cpu_now();
        for (int64_t t = lo; t < hi && !st; t++) {
            const float *x = arena + (t - lo) * Lmax * width;
            if (farena)
                mq_cross_det_acc_pool_rows(K, p->calib.len[t], farena + (t - lo) * Lmax * width, width, x, width, C,
                                           K, a, e);
            else
                mq_syrk_det_acc_pool_rows(K, p->calib.len[t], x, width, C, K, a, e);
        }
        p->layers[l].hessian += mq_now() - t0;
        p->layers[l].cpu_hessian += mq_cpu_now() - c0;
        if (!st && p->rank < last) st = mq_dist_send(C + a * K, bytes, p->rank + 1, step);
    }
    int own[3];
    const int n_own = slot_owners(s, own);
    for (int i = 0; i < n_own && !st; i++) {
        if (own[i] == last) continue;
        const size_t bytes = sizeof(float) * (size_t)(K * K);
        if (p->rank == last) st = mq_dist_send(C, bytes, own[i], step);
        else if (p->rank == own[i]) st = mq_dist_recv(C, bytes, last, step);
    }
    return st;
}

static moeq_status split_hessian(mq_pipe *p, int l, mq_slot *s, const float *arena, int64_t width) {
    if (!s->nw || s->how != MQ_HOW_GPTQ) return MOEQ_OK;
    char step[64];
    snprintf(step, sizeof step, "layer %d: Hessian of %s", l, s->w[0]->name);
    mq_hessian part = {0};   /* the relay's sum on a rank that does not quantize the slot */
    moeq_status st = mq_slot_mine(p, s) ? MOEQ_OK : mq_hessian_init(&part, width, "a Hessian in relay");
    st = mq_dist_agree(st, step);
    if (!st) st = relay_sum(p, l, s, mq_slot_mine(p, s) ? s->h.sum : part.sum, NULL, arena, width, step);
    if (!st && mq_slot_mine(p, s))
        for (int64_t t = 0; t < p->calib.n; t++) s->h.n += p->calib.len[t];
    mq_hessian_free(&part);
    return st;
}

/* Several ranks, asymmetric calibration: the cross sum G of slot s by the same relay (every
 * element the one process's fmaf chain over the rows in sample order); farena / arena: this
 * rank's samples' inputs of the unquantized and the quantized stream. */
static moeq_status split_cross(mq_pipe *p, int l, mq_slot *s, const float *farena, const float *arena, int64_t width) {
    if (!s->nw || s->how != MQ_HOW_GPTQ) return MOEQ_OK;
    char step[64];
    snprintf(step, sizeof step, "layer %d: cross sum of %s", l, s->w[0]->name);
    /* the relay's sum on a rank that does not quantize the slot (the owners' G is zeroed already) */
    float *part = mq_slot_mine(p, s) ? NULL
                                     : mq_alloc_zero(sizeof(float) * (size_t)(width * width), "a cross sum in relay");
    moeq_status st = mq_slot_mine(p, s) || part ? MOEQ_OK : MOEQ_E_NOMEM;
    st = mq_dist_agree(st, step);
    if (!st) st = relay_sum(p, l, s, mq_slot_mine(p, s) ? s->G : part, farena, arena, width, step);
    if (!st && mq_slot_mine(p, s)) {
        s->g_rows = 0;
        for (int64_t t = 0; t < p->calib.n; t++) s->g_rows += p->calib.len[t];
    }
    mq_free(part);
    return st;
}

/* Several ranks: what the FFN's calibration reads of every sample (pipeline.h), from the rank
 * that computed it to every rank: the FFN inputs (or the boundary after attention) and their
 * routing. */
static moeq_status share_ffn_inputs(mq_pipe *p, int l) {
    char step[48];
    snprintf(step, sizeof step, "layer %d: FFN inputs", l);
    const bool from_xn = p->seq && !p->tseq;
    moeq_status st = mq_pipe_share_samples(p, from_xn ? &p->XN : mq_pipe_out_buf(p), step);
    if (!st && p->m->layers[l].is_moe) {
        const bool b = p->tseq;   /* pass B's routing */
        const size_t per = (size_t)(p->calib.max_len * p->c->top_k);
        st = mq_pipe_share_rows(p, b ? p->sel_b : p->sel_a, per * sizeof(int32_t), step);
        if (!st) st = mq_pipe_share_rows(p, b ? p->w_b : p->w_a, per * sizeof(float), step);
    }
    if (!st && p->target) {   /* the unquantized stream's boundary after attention, and its routing */
        st = mq_pipe_share_samples(p, &p->XF, step);
        const size_t per = (size_t)(p->calib.max_len * p->c->top_k);
        if (!st && p->m->layers[l].is_moe) st = mq_pipe_share_rows(p, p->sel_f, per * sizeof(int32_t), step);
        if (!st && p->m->layers[l].is_moe) st = mq_pipe_share_rows(p, p->w_f, per * sizeof(float), step);
    }
    return st;
}

moeq_status mq_pipe_attention_stage(mq_pipe *p, int l, bool replay) {
    const mq_config *c = p->c;
    mq_layer *ly = &p->m->layers[l];
    const int64_t Lmax = p->calib.max_len, D = c->D, Q = (int64_t)c->n_heads * c->v_head_dim;
    moeq_status st = mq_pipe_read_part(p, l, mq_pipe_attention_parts(p, l), 0, 0, NULL, NULL);
    /* the first expert chunk while the attention computes */
    if (!st && ly->is_moe && p->ranks <= 1 && !replay)
        st = mq_pipe_start_ahead(p, l, MQ_PART_EXPERTS, 0, first_chunk_end(p));
    if (st) return st;
    /* slots: q/k/v (MLA: q_a or q_proj with kv_a), o; MLA also q_b and kv_b */
    mq_slot sl[4];
    const int n_sl = c->mla ? 4 : 2;
    const int64_t width[4] = {D, Q, c->q_lora_rank, c->kv_lora_rank};
    if (c->mla) {
        mq_slot_set(p, &sl[0], -1, false, c->q_lora_rank > 0 ? &ly->q_a : &ly->q, &ly->kv_a, NULL);
        mq_slot_set(p, &sl[2], -1, false, &ly->q_b, NULL, NULL);
        mq_slot_set(p, &sl[3], -1, false, &ly->kv_b, NULL, NULL);
    } else {
        mq_slot_set(p, &sl[0], -1, false, &ly->q, &ly->k, &ly->v);
    }
    mq_slot_set(p, &sl[1], -1, false, &ly->o, NULL, NULL);
    if (p->ranks > 1) {   /* every rank runs the attention; its Linears are quantized apart */
        int next = 0;
        for (int i = 0; i < n_sl; i++) {
            sl[i].owner = next % p->ranks;
            for (int k = 0; k < sl[i].nw; k++) sl[i].lown[k] = next++ % p->ranks;
        }
    }
    att_capture cap = {.qkv = &sl[0], .o = &sl[1], .amax = p->o->act_quant};
    if (c->mla) {
        cap.qb = &sl[2];
        cap.kvb = &sl[3];
    }
    att_scratch sc = {0};
    sc.gpu = gpu_attention_fits(p, l);
    if (sc.gpu) {   /* page-locked: each sample's input and results cross the bus at its speed */
        sc.xt = mq_gpu_host_alloc(p->gpu, sizeof(float) * (size_t)(Lmax * D));
        sc.xn = sc.xt ? mq_gpu_host_alloc(p->gpu, sizeof(float) * (size_t)(Lmax * D)) : NULL;
        sc.pinned = sc.xn != NULL;
        if (!sc.pinned) mq_gpu_host_free(sc.xt);
    }
    if (!sc.pinned) {
        sc.xt = mq_alloc_array((size_t)Lmax, (size_t)D * sizeof(float), "attention input");
        sc.xn = mq_alloc_array((size_t)Lmax, (size_t)D * sizeof(float), "FFN input");
    }
    sc.probs = mq_alloc_array((size_t)Lmax, (size_t)(c->n_experts > 0 ? c->n_experts : 1) * sizeof(float),
                              "router probabilities");
    if (p->target) sc.xf = mq_alloc_array((size_t)Lmax, (size_t)D * sizeof(float), "unquantized attention input");
    if (!sc.xt || !sc.xn || !sc.probs || (p->target && !sc.xf)) st = MOEQ_E_NOMEM;
    /* MOEQ_DEBUG_PROFILE on the CPU: where the stage's seconds go, logged at its end */
    double prof_model[MQ_ATT_PARTS] = {0}, prof_pipe[3] = {0};
    const bool prof = mq_env(MQ_ENV_PROFILE) && !sc.gpu;
    if (prof) {
        mq_state_profile(p->state, prof_model);
        sc.prof = prof_pipe;
    }
    const double t_stage = mq_now();
    const bool pass_a = !replay || !p->seq;
    if (!st && sc.gpu && pass_a) st = gpu_attention_set(p, l);
    if (!st) {
        if (sc.gpu) st = mq_pipe_gpu_ffn_inputs_new(p, l, replay);
        else mq_pipe_gpu_ffn_inputs_free(p);
    }
    if (!st && !replay) {
        for (int i = 0; i < n_sl && !st; i++) st = mq_slot_hessian(p, &sl[i]);
        /* several ranks: every rank keeps the inputs of its samples for the owners */
        const bool dist = p->ranks > 1;
        const int64_t keep = dist ? p->s_hi - p->s_lo : 1;
        const bool need0 = dist ? sl[0].nw && sl[0].how == MQ_HOW_GPTQ : sl[0].h.sum != NULL;
        const bool need1 = dist ? sl[1].nw && sl[1].how == MQ_HOW_GPTQ : sl[1].h.sum != NULL;
        cap.store = dist;
        cap.Lmax = Lmax;
        if (!st && need0 && keep > 0)
            cap.arena_qkv = mq_alloc_array((size_t)(keep * Lmax), (size_t)D * sizeof(float), "q/k/v inputs");
        if (!st && need1 && keep > 0)
            cap.arena_o = mq_alloc_array((size_t)(keep * Lmax), (size_t)Q * sizeof(float), "o_proj inputs");
        if (!st && keep > 0 && ((need0 && !cap.arena_qkv) || (need1 && !cap.arena_o))) st = MOEQ_E_NOMEM;
        for (int i = 2; i < n_sl && !st && keep > 0; i++) {   /* the latent slots of MLA */
            const bool need = dist ? sl[i].nw && sl[i].how == MQ_HOW_GPTQ : sl[i].h.sum != NULL;
            float **a = i == 2 ? &cap.arena_qb : &cap.arena_kvb;
            if (need && !(*a = mq_alloc_array((size_t)(keep * Lmax),
                                              (size_t)width[i] * sizeof(float),
                                              "latent attention inputs")))
                st = MOEQ_E_NOMEM;
        }
        /* asymmetric calibration: the unquantized stream's inputs per slot with a cross sum, as
         * the quantized one's (one process: one sample; several ranks: the rank's samples, every
         * rank, for the relay of the sums) */
        float **fa[4] = {&cap.farena_qkv, &cap.farena_o, &cap.farena_qb, &cap.farena_kvb};
        for (int i = 0; i < n_sl && !st && p->target && keep > 0; i++) {
            const bool need = dist ? sl[i].nw && sl[i].how == MQ_HOW_GPTQ : sl[i].G != NULL;
            if (need && !(*fa[i] = mq_alloc_array((size_t)(keep * Lmax), (size_t)width[i] * sizeof(float),
                                                  "unquantized attention inputs")))
                st = MOEQ_E_NOMEM;
        }
        if (!st) {   /* faulted in on the pool in 2 MB pieces, not by the first sample's copies (actbuf.c) */
            float *ar[8] = {cap.arena_qkv, cap.arena_o, cap.arena_qb, cap.arena_kvb,
                            cap.farena_qkv, cap.farena_o, cap.farena_qb, cap.farena_kvb};
            const int64_t wd[8] = {width[0], width[1], width[2], width[3], width[0], width[1], width[2], width[3]};
            void *base[8];
            size_t bytes[8];
            int64_t nb = 0;
            for (int i = 0; i < 8; i++)
                if (ar[i]) base[nb] = ar[i], bytes[nb++] = (size_t)(keep * Lmax * wd[i]) * sizeof(float);
            mq_touch_pages(base, bytes, nb);
        }
        /* pass A: the unquantized attention (nothing needed of it in a sequential replay); the
         * layer's last unless sequential */
        sc.ahead = !p->seq && experts_ahead_wanted(p, l, replay);
        if (!st) st = attention_pass(p, l, true, &cap, &sc);
        sc.ahead = false;
        if (dist) {
            char step[48];
            snprintf(step, sizeof step, "layer %d: attention inputs", l);
            st = mq_dist_agree(st, step);
            /* on the CPU every rank sums a band of each Hessian; a GPU sums them on the owner */
            moeq_status (*sum)(mq_pipe *, int, mq_slot *, const float *, int64_t) =
                p->gpu ? gather_hessian : split_hessian;
            if (!st) st = sum(p, l, &sl[0], cap.arena_qkv, D);
            if (!st) st = sum(p, l, &sl[1], cap.arena_o, Q);
            if (!st && n_sl > 2) st = sum(p, l, &sl[2], cap.arena_qb, width[2]);
            if (!st && n_sl > 3) st = sum(p, l, &sl[3], cap.arena_kvb, width[3]);
            const float *qa[4] = {cap.arena_qkv, cap.arena_o, cap.arena_qb, cap.arena_kvb};
            for (int i = 0; i < n_sl && !st && p->target; i++) st = split_cross(p, l, &sl[i], *fa[i], qa[i], width[i]);
            for (int i = 0; i < n_sl && !st && p->o->act_quant; i++)
                st = mq_dist_max_f32(&sl[i].amax, step);
        }
        for (int i = 0; i < n_sl; i++) {
            sl[i].tokens = sl[i].h.n;
            moeq_status fs = mq_slot_form_timed(p, l, &sl[i]);
            if (!st) st = fs;
        }
        if (!st && p->target) st = mq_pipe_target_slots(p, l, sl, n_sl, NULL, 0);
        if (!st) st = mq_pipe_quantize_slots(p, l, sl, n_sl, NULL);
        if (p->ranks > 1) {
            char step[48];
            snprintf(step, sizeof step, "layer %d: attention", l);
            st = mq_dist_agree(st, step);
            if (!st) st = mq_pipe_share_slots(p, l, sl, n_sl);
        }
    } else if (!st && replay) {
        if (p->target) st = fp_attention_pass(p, l, &sc);   /* before the weights are read back */
        if (!st && p->seq) st = mq_pipe_read_back_slots(p, sl, n_sl);
        else if (!st) st = attention_pass(p, l, true, NULL, &sc);
    }
    /* pass B: the quantized attention */
    if (!st && p->seq && sc.gpu) st = gpu_attention_set(p, l);
    sc.ahead = p->seq && experts_ahead_wanted(p, l, replay);
    if (!st && p->seq) st = attention_pass(p, l, false, NULL, &sc);
    if (p->ranks > 1 && !replay) {
        char step[48];
        snprintf(step, sizeof step, "layer %d: attention", l);
        st = mq_dist_agree(st, step);
        if (!st) st = share_ffn_inputs(p, l);
    }
    if (prof) {   /* the attention_block parts include the unquantized stream's samples */
        mq_state_profile(p->state, NULL);
        mq_info("layer %d attention stage %.2f s: inputs %.2f, attention norm %.2f, q/k/v %.2f, q/k norm and RoPE "
                "%.2f, scores %.2f, o_proj %.2f, residual %.2f, hooks %.2f, FFN norm and routing %.2f, outputs "
                "%.2f s (the rest: Hessians, GPTQ, other ranks)", l, mq_now() - t_stage, prof_pipe[0],
                prof_model[MQ_ATT_NORM], prof_model[MQ_ATT_QKV], prof_model[MQ_ATT_QK_ROPE],
                prof_model[MQ_ATT_SCORES], prof_model[MQ_ATT_O], prof_model[MQ_ATT_RESIDUAL],
                prof_model[MQ_ATT_HOOKS], prof_pipe[1], prof_pipe[2]);
    }
    for (int i = 0; i < n_sl; i++) mq_slot_free(&sl[i]);
    MQ_RELEASE_EACH(cap.arena_qkv, cap.arena_o, cap.arena_qb, cap.arena_kvb, cap.farena_qkv, cap.farena_o,
                    cap.farena_qb, cap.farena_kvb, sc.xf);
    if (sc.pinned) {
        mq_gpu_host_free(sc.xt);
        mq_gpu_host_free(sc.xn);
    } else {
        mq_free(sc.xt);
        mq_free(sc.xn);
    }
    mq_free(sc.probs);
    /* the layer's input on the device has served both passes: the FFN's room */
    mq_gpu_buf_free(p->gin);
    p->gin = NULL;
    p->gin_ready = false;
    mq_pipe_drop_part(p, l, MQ_PART_ATTN, 0, 0);
    mq_state_drop_layer(p->state, l);
    return st;
}
