/*
 * Slots: the Linears of a layer that read one input and share its Hessian (q/k/v, o_proj, an
 * expert's gate/up, its down projection, ...). Which rank owns a slot, its Hessian sum (on the
 * run's GPU where it has one: the same bits as the CPU's sum), the cross sum of asymmetric
 * calibration beside it and the correction of the weights from that, and the Hessian GPTQ reads,
 * formed from the sum. Every stage calibrates through slots (attention, routed experts, shared
 * expert, dense MLP), and the quantize stage (layer_quantize.c) quantizes them.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels/gemm_det.h"
#include "core/env.h"
#include "pipeline/layer_internal.h"

/* Whether this rank quantizes a Linear of slot s (and so holds its Hessian). */
bool mq_slot_mine(const mq_pipe *p, const mq_slot *s) {
    for (int k = 0; k < s->nw; k++)
        if (s->lown[k] == p->rank) return true;
    return s->nw == 0 && s->owner == p->rank;
}

/* The slot and all its Linears to rank r. */
void mq_slot_own(mq_slot *s, int r) { s->owner = s->lown[0] = s->lown[1] = s->lown[2] = r; }

void mq_slot_set(mq_pipe *p, mq_slot *s, int expert, bool down, mq_linear *a, mq_linear *b,
                 mq_linear *c) {
    memset(s, 0, sizeof *s);
    mq_slot_own(s, p->rank);   /* alone: everything is this process's */
    s->expert = expert;
    s->down = down;
    s->how = p->o->gptq ? MQ_HOW_GPTQ : MQ_HOW_RTN;
    mq_linear *ls[3] = {a, b, c};
    for (int i = 0; i < 3; i++) {
        if (!ls[i] || !ls[i]->name) continue;
        const mq_plan_item *it = mq_out_plan_find(&p->plan, ls[i]->name);
        if (!it || !it->quantize) continue;
        s->w[s->nw] = ls[i];
        s->it[s->nw++] = it;
    }
}

/* The Hessian sums and H (the held results stay). */
void mq_slot_drop_sums(mq_slot *s) {
    mq_free(s->G);
    s->G = NULL;
    mq_gpu_hessians_free(s->gh);
    s->gh = NULL;
    mq_hessian_free(&s->h);
    mq_free(s->H);
    s->H = NULL;
    mq_free(s->Hh);
    s->Hh = NULL;
}

void mq_slot_free(mq_slot *s) {
    for (int k = 0; k < 3; k++) mq_qtensor_free(&s->q[k]);
    s->held = false;
    mq_slot_drop_sums(s);
}

/* The damping sweep's first held-out sample: the last eighth of the samples (at least one) are
 * held out, the rows GPTQ's damping is chosen on. */
int64_t mq_first_held_out_sample(int64_t n) { return n - (n / 8 > 1 ? n / 8 : 1); }

/* Starts the Hessian sum of a slot GPTQ will use: on the run's GPU when it has one (the same
 * bits as the CPU's sum, backend/gpu.h). */
moeq_status mq_slot_hessian(mq_pipe *p, mq_slot *s) {
    if (!s->nw || s->how != MQ_HOW_GPTQ || !mq_slot_mine(p, s)) return MOEQ_OK;
    char what[200];
    snprintf(what, sizeof what, "Hessian of %s", s->w[0]->name);
    moeq_status st;
    if (p->o->n_damp_sweep > 0) {   /* the damping sweep holds out the last samples' rows */
        int64_t hold = 0;
        for (int64_t i = 0; i < mq_first_held_out_sample(p->calib.n); i++) hold += p->calib.len[i];
        st = mq_hessian_init_split(&s->h, s->w[0]->in, s->expert >= 0 ? s->hold : hold, what);
    } else {
        st = mq_hessian_init(&s->h, s->w[0]->in, what);
    }
    if (!st && p->gpu) st = mq_gpu_hessians_new(p->gpu, 1, &s->h.K, &s->gh);
    if (!st && p->target) {   /* the cross sum beside it */
        /* zero as it comes (a fresh mapping): its pages are first touched by the sum's tasks on
         * the pool, not by a memset on one core here (K x K floats for every expert's input of
         * every layer) */
        s->G = mq_alloc_zero(sizeof(float) * (size_t)(s->h.K * s->h.K), "asymmetric calibration's cross sum");
        if (!s->G) return MOEQ_E_NOMEM;
        s->g_rows = 0;
    }
    return st;
}

/* G += x_f^T x_q for rows of the two streams that read the same token, in the Hessian's row
 * order (each element one fmaf chain over the rows, however they are grouped into calls). */
void mq_slot_cross(mq_slot *s, const float *xf, const float *xq, int64_t rows) {
    if (!s->G || rows <= 0) return;
    mq_cross_det_acc_pool(s->h.K, rows, xf, s->h.K, xq, s->h.K, s->G, s->h.K);
    s->g_rows += rows;
}

/* Asymmetric calibration: each GPTQ slot's weights moved toward the unquantized model's outputs
 * (mq_gptq_target_many: the slots' factorisations, solves and products over the pool together,
 * the values of one mq_gptq_target each) before GPTQ quantizes them; G is freed. Timed as the
 * GPTQ stage. */
static double target_cost(const mq_slot *s) {
    double K = (double)s->w[0]->in, rows = 0;
    for (int k = 0; k < s->nw; k++) rows += (double)s->w[k]->out;
    return K * K * (K + rows);
}

/* slots a[0..na) and b[0..nb) (a chunk's gate/up and down slots) */
moeq_status mq_pipe_target_slots(mq_pipe *p, int l, mq_slot *a, int na, mq_slot *b, int nb) {
    double t0 = mq_now(), c0 = mq_cpu_now();
    const int n = na + nb;
    mq_slot **work = calloc((size_t)(n + 1), sizeof *work);
    mq_gptq_target_job *jobs = calloc((size_t)(n + 1), sizeof *jobs);
    float *(*w)[3] = calloc((size_t)(n + 1), sizeof *w);
    int64_t (*rows)[3] = calloc((size_t)(n + 1), sizeof *rows);
    moeq_status st = work && jobs && w && rows ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory in layer %d", l);
    int m = 0;
    for (int i = 0; i < n && !st; i++) {
        mq_slot *x = i < na ? &a[i] : &b[i - na];
        if (x->G && x->H && x->how == MQ_HOW_GPTQ && x->g_rows > 0) work[m++] = x;
    }
    for (int i = 1; i < m; i++)   /* costliest first: the long factorisations before the short ones */
        for (int k = i; k > 0 && target_cost(work[k - 1]) < target_cost(work[k]); k--) {
            mq_slot *t = work[k];
            work[k] = work[k - 1];
            work[k - 1] = t;
        }
    for (int i = 0; i < m && !st; i++) {
        const mq_slot *x = work[i];
        for (int k = 0; k < x->nw; k++) {
            w[i][k] = x->w[k]->w;
            rows[i][k] = x->w[k]->out;
        }
        jobs[i] = (mq_gptq_target_job){x->H, x->G, x->w[0]->in, x->g_rows, p->o->target_share, p->o->g.percdamp,
                                       w[i], rows[i], x->nw, x->w[0]->name};
    }
    double sec[3] = {0, 0, 0};
    if (!st) st = mq_gptq_target_many(jobs, m, sec);
    for (int i = 0; i < n; i++) {
        mq_slot *x = i < na ? &a[i] : &b[i - na];
        mq_free(x->G);
        x->G = NULL;
    }
    MQ_FREE_EACH(work, jobs, w, rows);
    if (mq_env(MQ_ENV_PROFILE))
        mq_info("layer %d target corrections, %d Linear inputs: %.2f s (%.1f cores busy; factorisations %.2f, "
                "solves %.2f, products %.2f s)", l, m, mq_now() - t0, (mq_cpu_now() - c0) / (mq_now() - t0 + 1e-9),
                sec[0], sec[1], sec[2]);
    p->layers[l].gptq += mq_now() - t0;
    p->layers[l].cpu_gptq += mq_cpu_now() - c0;
    return st;
}

/* Adds rows [rows, K] to the slot's sum. With a GPU: from one thread at a time. */
moeq_status mq_slot_add(mq_slot *s, const float *x, int64_t rows) {
    if (!s->gh) {
        mq_hessian_add(&s->h, x, rows);
        return MOEQ_OK;
    }
    s->h.n += rows;
    return mq_gpu_hessians_add(s->gh, 0, x, rows);
}

/* Whether a slot's Hessian stays on the GPU for GPTQ, formed there from its sum (one process:
 * with several ranks the sums travel between them through host memory). */
bool mq_slot_keeps_device_sum(const mq_pipe *p, const mq_slot *s) {
    return s->gh && p->ranks <= 1 && s->how == MQ_HOW_GPTQ && !s->h.fit;
}

/* The Hessian from the sum, formed in place (the sum's buffer becomes H); a sum GPTQ reads on
 * the GPU stays there (s->H NULL, s->gh kept). */
moeq_status mq_slot_form(const mq_pipe *p, mq_slot *s) {
    if (!s->h.sum) return MOEQ_OK;
    if (mq_slot_keeps_device_sum(p, s)) return MOEQ_OK;
    moeq_status st = MOEQ_OK;
    if (s->gh) {
        st = mq_gpu_hessians_get(s->gh, 0, s->h.sum, NULL);
        mq_gpu_hessians_free(s->gh);
        s->gh = NULL;
    } else if (s->h.fit) {
        mq_hessian_get_split(&s->h, s->h.sum, s->h.fit, &s->n_fit, &s->n_held);
        s->Hh = s->h.fit;
        s->h.fit = NULL;
    } else {
        mq_hessian_get(&s->h, s->h.sum);
    }
    s->H = s->h.sum;
    s->h.sum = NULL;
    return st;
}

/* mq_slot_form timed as the layer's Hessian stage (the forming is O(K^2) on the pool). */
moeq_status mq_slot_form_timed(mq_pipe *p, int l, mq_slot *s) {
    double t0 = mq_now(), c0 = mq_cpu_now();
    moeq_status st = mq_slot_form(p, s);
    p->layers[l].hessian += mq_now() - t0;
    p->layers[l].cpu_hessian += mq_cpu_now() - c0;
    return st;
}

void mq_amax_update(float *a, const float *x, int64_t n) {
    if (n <= 0) return;
    float v = mq_absmax(x, n);
    if (v > *a) *a = v;   /* a NaN never wins */
}
