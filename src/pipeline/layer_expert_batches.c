/*
 * The routed experts' batches: every sample through a chunk of experts, the samples grouped so
 * that each expert runs one product over all of its rows in the batch (mq_gemm_det_nt, whose
 * values do not depend on the grouping), then the Hessian updates, amax and the combine of each
 * token's outputs in increasing expert order. On the CPU as blocks of rows on the pool; on the
 * GPU with the rows, their Hessian sums and the combine kept on the device where the run allows.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels/gemm_det.h"
#include "core/env.h"
#include "kernels/vec.h"
#include "pipeline/layer_internal.h"

/* One band of rows of one expert's Hessian sum (or cross sum): expert << 34 | cross << 33 |
 * down << 32 | band, its cost. */
typedef struct {
    int64_t code, cost;
} hband;

/* A batch of samples whose rows for the chunk's experts are computed together: the rows are
 * laid out expert by expert (each expert's rows of every sample of the batch, sample after
 * sample, tokens in order), so each expert runs one call over all of them. Its products are
 * mq_gemm_det_nt's, whose values do not depend on how the rows are grouped: the same as the
 * model's forward gives running the samples one at a time. */
typedef struct ex_batch {
    mq_pipe *p;
    int l, e0, e1;
    int64_t s0, nb;
    mq_ffn_source src;
    bool down, hess, amax;
    bool cross;                   /* asymmetric calibration: the cross sums beside the Hessians,
                                     from the unquantized stream's rows of the same tokens */
    mq_actbuf *out;               /* where the outputs are summed: OUT, or OUTF (src.fp) */
    mq_slot *gu, *dn;             /* [E] */
    const float **xin;            /* [nb] */
    float *xin_buf;               /* [nb][LD] */
    const float **xinf;           /* cross: [nb] the unquantized stream's FFN inputs */
    float *xinf_buf;              /* cross: [nb][LD] */
    float *xgf, *hgf, *huf;       /* cross: [rows][D / F / F] its rows, gate/up of them */
    int32_t *cnt;                 /* [nb][C] rows of each expert in each sample */
    int64_t *pos;                 /* [nb][C] first row of (sample, expert) */
    int64_t *ebase;               /* [C + 1] first row of each expert */
    int32_t *tok, *tsample;       /* [rows] token and sample of each row */
    float *rw;                    /* [rows] expert weighting: each row's Hessian weight */
    int32_t *tok_row;             /* [nb][Lmax][K] row of (token, k), -1 outside the chunk */
    float *xg, *hg, *hu, *yg;     /* [rows][D / F / F / D] */
    int64_t *tasks, n_tasks;      /* expert << 32 | block of TASK_ROWS rows */
    mq_gpu_mlp *gmlp;             /* the chunk's experts on the GPU (runs with a device), or NULL */
    int32_t *grow;                /* [rows] GPU: each row's place in the batch's uploaded inputs */
    int64_t rows_cap;             /* the most rows any batch of the pass holds */
    int64_t *xrows, *xfirst;      /* [nb] GPU: the rows of each sample's uploaded input, its first */
    hband *htasks;                /* the CPU's Hessian bands (batch_hessian_bands) */
    int64_t n_htasks;
    int64_t *ctok;                /* [nb * Lmax] GPU combine: each token's output row, */
    int32_t *cfirst, *crow;       /* [nb * Lmax + 1] its first pair, [rows] the pairs' rows */
    float *cw;                    /* [rows] and weights, in the CPU combine's order */
    bool all_dev;                 /* GPU: as many samples in one batch as the device holds, the
                                     rows only there, the inputs up nb_in samples at a time */
    int64_t nb_in;                /* samples xin_buf holds */
    const struct ex_batch *pair;  /* the unquantized stream's outputs run beside a cross batch
                                     (batch_run_fp): that batch, whose rows of the same tokens and
                                     experts give their gate/up */
} ex_batch;

/* The FFN inputs of samples [g0, g0 + n) of the batch into xin_buf (which holds n): the whole
 * batch at once, or with all_dev nb_in samples at a time, each group then up to the device. */
typedef struct {
    ex_batch *b;
    int64_t g0;
} inputs_group;

static void group_inputs_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    const inputs_group *g = ctx;
    ex_batch *b = g->b;
    b->xin[g->g0 + i] = mq_pipe_ffn_input(b->p, b->l, &b->src, b->s0 + g->g0 + i, b->xin_buf + i * b->p->LD);
    if (b->cross) {
        const mq_ffn_source fs = mq_pipe_fp_source(b->p);
        b->xinf[g->g0 + i] = mq_pipe_ffn_input(b->p, b->l, &fs, b->s0 + g->g0 + i, b->xinf_buf + i * b->p->LD);
    }
}

static moeq_status batch_inputs_device(ex_batch *b) {
    moeq_status st = mq_gpu_mlp_inputs_reserve(b->gmlp, b->xfirst[b->nb - 1] + b->xrows[b->nb - 1]);
    for (int64_t g0 = 0; g0 < b->nb && !st; g0 += b->nb_in) {
        const int64_t n = b->nb - g0 < b->nb_in ? b->nb - g0 : b->nb_in;
        inputs_group g = {b, g0};
        mq_parallel_for(n, group_inputs_task, &g);
        for (int64_t i = g0; i < g0 + n && !st; i++)
            st = mq_gpu_mlp_inputs_put(b->gmlp, b->xfirst[i], b->xin[i], b->xrows[i]);
    }
    return st;
}

/* A block of up to TASK_ROWS rows of one expert of the chunk (any cut gives the same values):
 * gathered, then gate, up, SwiGLU (and down). */
enum { TASK_ROWS = 256 };
static void batch_rows_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    mq_pipe *p = b->p;
    const int64_t D = p->c->D, F = p->c->moe_ffn;
    const mq_layer *ly = &p->m->layers[b->l];
    const int64_t ce = b->tasks[task] >> 32, blk = b->tasks[task] & 0xffffffff;
    const int64_t e = b->e0 + ce, r0 = b->ebase[ce] + blk * TASK_ROWS;
    const int64_t n = b->ebase[ce + 1] - r0 < TASK_ROWS ? b->ebase[ce + 1] - r0 : TASK_ROWS;
    for (int64_t r = r0; r < r0 + n; r++)
        memcpy(b->xg + r * D, b->xin[b->tsample[r]] + (int64_t)b->tok[r] * D, sizeof(float) * (size_t)D);
    (void)mq_mlp_forward(&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e], b->xg + r0 * D, n,
                         b->hg + r0 * F, b->hu + r0 * F, b->down ? b->yg + r0 * D : NULL);
    if (b->cross) {   /* the same tokens of the unquantized stream, its down input by gate/up */
        for (int64_t r = r0; r < r0 + n; r++)
            memcpy(b->xgf + r * D, b->xinf[b->tsample[r]] + (int64_t)b->tok[r] * D, sizeof(float) * (size_t)D);
        (void)mq_mlp_forward(&ly->exp_gate[e], &ly->exp_up[e], NULL, b->xgf + r0 * D, n, b->hgf + r0 * F,
                             b->huf + r0 * F, NULL);
    }
}

/* With the experts on the GPU: a block's rows gathered here, the MLP run there. */
static void batch_gather_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    const int64_t D = b->p->c->D;
    const int64_t ce = b->tasks[task] >> 32, blk = b->tasks[task] & 0xffffffff;
    const int64_t r0 = b->ebase[ce] + blk * TASK_ROWS;
    const int64_t n = b->ebase[ce + 1] - r0 < TASK_ROWS ? b->ebase[ce + 1] - r0 : TASK_ROWS;
    for (int64_t r = r0; r < r0 + n; r++)
        memcpy(b->xg + r * D, b->xin[b->tsample[r]] + (int64_t)b->tok[r] * D, sizeof(float) * (size_t)D);
}

/* amax and the expert weighting of one expert's rows, before any Hessian update reads them (the
 * weighted rows are not read again) */
static void batch_prep_task(void *ctx, int64_t ce, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    const int64_t D = b->p->c->D, F = b->p->c->moe_ffn;
    mq_slot *gu = &b->gu[b->e0 + ce], *dn = &b->dn[b->e0 + ce];
    const int64_t r0 = b->ebase[ce], n = b->ebase[ce + 1] - r0;
    if (n == 0) return;
    if (b->amax) {
        mq_amax_update(&gu->amax, b->xg + r0 * D, n * D);
        mq_amax_update(&dn->amax, b->hg + r0 * F, n * F);
    }
    if (b->hess && b->p->o->expert_weighting) {
        if (gu->h.sum) mq_hessian_weight_rows(b->xg + r0 * D, n, D, b->rw + r0);
        if (dn->h.sum) mq_hessian_weight_rows(b->hg + r0 * F, n, F, b->rw + r0);
    }
}

/* One expert's Hessian updates and amax over the batch: its rows are the batch's samples in
 * order, so one update adds what one update per sample would (quant/hessian.h). */
static moeq_status batch_hessian_one(ex_batch *b, int64_t ce) {
    const int64_t D = b->p->c->D, F = b->p->c->moe_ffn;
    mq_slot *gu = &b->gu[b->e0 + ce], *dn = &b->dn[b->e0 + ce];
    const int64_t r0 = b->ebase[ce], n = b->ebase[ce + 1] - r0;
    if (n == 0) return MOEQ_OK;
    batch_prep_task(b, ce, 0);
    moeq_status st = MOEQ_OK;
    if (b->hess && gu->h.sum) st = mq_slot_add(gu, b->xg + r0 * D, n);
    if (b->hess && dn->h.sum && !st) st = mq_slot_add(dn, b->hg + r0 * F, n);
    if (b->cross && !st) {
        mq_slot_cross(gu, b->xgf + r0 * D, b->xg + r0 * D, n);
        mq_slot_cross(dn, b->hgf + r0 * F, b->hg + r0 * F, n);
    }
    return st;
}

static void batch_hessian_task(void *ctx, int64_t ce, int thread) {
    (void)thread;
    (void)batch_hessian_one(ctx, ce);   /* the CPU's sums cannot fail */
}

/* The CPU's expert Hessians as bands of HBAND rows of every expert's sums, so a chunk of few (or
 * unevenly routed) experts still keeps every core busy: each element's sum is the same fmaf chain
 * over the expert's rows whichever band computes it (kernels/gemm_det.h). */
enum { HBAND = 96 };

static bool banded_hessians(const ex_batch *b) {
    for (int64_t ce = 0; ce < b->e1 - b->e0; ce++) {
        const mq_slot *gu = &b->gu[b->e0 + ce], *dn = &b->dn[b->e0 + ce];
        if ((gu->h.sum && (gu->h.fit || gu->gh)) || (dn->h.sum && (dn->h.fit || dn->gh))) return false;
    }
    return true;
}

static void batch_band_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    const int64_t code = b->htasks[t].code, ce = code >> 34, band = code & 0xffffffff;
    const bool down = (code >> 32) & 1, cross = (code >> 33) & 1;
    const int64_t K = down ? b->p->c->moe_ffn : b->p->c->D;
    const mq_slot *s = down ? &b->dn[b->e0 + ce] : &b->gu[b->e0 + ce];
    const int64_t r0 = b->ebase[ce], n = b->ebase[ce + 1] - r0;
    const float *x = (down ? b->hg : b->xg) + r0 * K;
    const int64_t i0 = band * HBAND, i1 = i0 + HBAND < K ? i0 + HBAND : K;
    if (cross) mq_cross_det_acc(K, n, (down ? b->hgf : b->xgf) + r0 * K, K, x, K, s->G, K, i0, i1);
    else mq_syrk_det_acc(K, n, x, K, s->h.sum, K, i0, i1);
}

static int cmp_band(const void *a, const void *b) {
    const hband *x = a, *y = b;
    if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
    return x->code < y->code ? -1 : x->code > y->code;
}

/* The bands of every routed expert's sums, the costliest (rows x width) first: the pool's
 * counter then hands out the long tasks before the short ones that fill the gaps. */
static void batch_hessian_bands(ex_batch *b) {
    const int64_t C = b->e1 - b->e0, D = b->p->c->D, F = b->p->c->moe_ffn;
    b->n_htasks = 0;
    for (int64_t ce = 0; ce < C && b->hess; ce++) {
        const int64_t n = b->ebase[ce + 1] - b->ebase[ce];
        if (n == 0) continue;
        for (int down = 0; down < 2; down++) {
            const int64_t K = down ? F : D;
            const mq_slot *s = &(down ? b->dn : b->gu)[b->e0 + ce];
            if (!s->h.sum) continue;
            for (int64_t k = 0; k * HBAND < K; k++) {
                const int64_t i1 = (k + 1) * HBAND < K ? (k + 1) * HBAND : K;
                b->htasks[b->n_htasks++] = (hband){ce << 34 | (int64_t)down << 32 | k, n * i1};
                if (b->cross && s->G)   /* a band of the cross sum: every column */
                    b->htasks[b->n_htasks++] = (hband){ce << 34 | (int64_t)1 << 33 | (int64_t)down << 32 | k, n * K};
            }
        }
    }
    qsort(b->htasks, (size_t)b->n_htasks, sizeof *b->htasks, cmp_band);
    mq_parallel_for(C, batch_prep_task, b);
    mq_parallel_for(b->n_htasks, batch_band_task, b);
    for (int64_t ce = 0; ce < C; ce++) {
        const int64_t n = b->ebase[ce + 1] - b->ebase[ce];
        if (b->hess && b->gu[b->e0 + ce].h.sum) b->gu[b->e0 + ce].h.n += n;
        if (b->hess && b->dn[b->e0 + ce].h.sum) b->dn[b->e0 + ce].h.n += n;
        if (b->cross && b->gu[b->e0 + ce].G) b->gu[b->e0 + ce].g_rows += n;
        if (b->cross && b->dn[b->e0 + ce].G) b->dn[b->e0 + ce].g_rows += n;
    }
}

/* out[t] += w * y over the token's experts of the chunk, in increasing expert order. */
static void batch_combine_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    mq_pipe *p = b->p;
    const int64_t s = b->s0 + i, T = p->calib.len[s], K = p->c->top_k, D = p->c->D;
    const int32_t *sel = b->src.sel + s * p->calib.max_len * K;
    const float *w = b->src.w + s * p->calib.max_len * K;
    const int32_t *tr = b->tok_row + i * p->calib.max_len * K;
    float *out = mq_actbuf_ptr(b->out, (size_t)(s * p->LD));
    const mq_vec_kernels *vk = mq_vec();
    for (int64_t t = 0; t < T; t++) {
        int32_t order[64];
        int64_t kk = 0;
        for (int64_t k = 0; k < K && kk < 64; k++)
            if (tr[t * K + k] >= 0) order[kk++] = (int32_t)k;
        for (int64_t a = 1; a < kk; a++)   /* insertion sort by expert id */
            for (int64_t c = a; c > 0 && sel[t * K + order[c - 1]] > sel[t * K + order[c]]; c--) {
                int32_t tmp = order[c];
                order[c] = order[c - 1];
                order[c - 1] = tmp;
            }
        for (int64_t k = 0; k < kk; k++)
            vk->axpy(w[t * K + order[k]], b->yg + (int64_t)tr[t * K + order[k]] * D, out + t * D, D);
    }
}

static void batch_free(ex_batch *b) {
    MQ_FREE_EACH(b->xin, b->xinf, b->cnt, b->pos, b->ebase, b->xrows, b->xfirst);
    MQ_RELEASE_EACH(b->xin_buf, b->xinf_buf, b->xgf, b->hgf, b->huf, b->tok, b->tsample, b->rw, b->tok_row,
                    b->xg, b->hg, b->hu, b->yg, b->tasks, b->grow, b->htasks, b->ctok, b->cfirst, b->crow,
                    b->cw);
}

/* Buffers for batches of up to nb samples and `rows` expert rows of a chunk of C experts. */
/* host_rows false: the rows live on the device only (all_dev), so their host buffers are not
 * made; xin_buf holds nb_in samples. */
static moeq_status batch_alloc(ex_batch *b, const mq_pipe *p, int64_t nb, int64_t C, int64_t rows, int64_t nb_in,
                               bool host_rows, bool cross) {
    const mq_config *c = p->c;
    const int64_t Lmax = p->calib.max_len, K = c->top_k, D = c->D, F = c->moe_ffn;
    const int64_t hr = host_rows ? rows : 0;
    b->nb_in = nb_in;
    b->xin = calloc((size_t)nb, sizeof *b->xin);
    b->xin_buf = mq_alloc_array((size_t)(nb_in * p->LD), sizeof(float), "expert inputs");
    b->cnt = calloc((size_t)(nb * C), sizeof *b->cnt);
    b->pos = calloc((size_t)(nb * C), sizeof *b->pos);
    b->ebase = calloc((size_t)(C + 1), sizeof *b->ebase);
    b->tok = mq_alloc_array((size_t)rows + 1, sizeof(int32_t), "expert rows");
    b->tsample = mq_alloc_array((size_t)rows + 1, sizeof(int32_t), "expert rows");
    b->rw = mq_alloc_array((size_t)rows + 1, sizeof(float), "expert rows");
    b->tok_row = mq_alloc_array((size_t)(nb * Lmax * K), sizeof(int32_t), "expert rows");
    b->xg = mq_alloc_array((size_t)hr + 1, (size_t)D * sizeof(float), "expert inputs");
    b->hg = mq_alloc_array((size_t)hr + 1, (size_t)F * sizeof(float), "expert activations");
    b->hu = mq_alloc_array((size_t)hr + 1, (size_t)F * sizeof(float), "expert activations");
    b->yg = mq_alloc_array((size_t)hr + 1, (size_t)D * sizeof(float), "expert outputs");
    b->tasks = mq_alloc_array((size_t)(C + rows / 256 + 1), sizeof(int64_t), "expert tasks");
    b->grow = mq_alloc_array((size_t)rows + 1, sizeof(int32_t), "expert rows");
    b->xrows = calloc((size_t)nb, sizeof *b->xrows);
    b->xfirst = calloc((size_t)nb, sizeof *b->xfirst);
    b->htasks = mq_alloc_array((size_t)(2 * C * ((c->D + HBAND - 1) / HBAND + (F + HBAND - 1) / HBAND) + 1),
                               sizeof(hband), "expert Hessian bands");
    if (cross) {   /* asymmetric calibration: the unquantized stream's inputs and rows */
        b->xinf = calloc((size_t)nb, sizeof *b->xinf);
        b->xinf_buf = mq_alloc_array((size_t)(nb_in * p->LD), sizeof(float), "unquantized expert inputs");
        b->xgf = mq_alloc_array((size_t)hr + 1, (size_t)D * sizeof(float), "unquantized expert inputs");
        b->hgf = mq_alloc_array((size_t)hr + 1, (size_t)F * sizeof(float), "unquantized expert activations");
        b->huf = mq_alloc_array((size_t)hr + 1, (size_t)F * sizeof(float), "unquantized expert activations");
        if (!b->xinf || !b->xinf_buf || !b->xgf || !b->hgf || !b->huf) {
            batch_free(b);
            return mq_err(MOEQ_E_NOMEM, "out of memory for the expert batch scratch");
        }
    }
    if (p->gout) {
        b->ctok = mq_alloc_array((size_t)(nb * Lmax) + 1, sizeof(int64_t), "expert combine");
        b->cfirst = mq_alloc_array((size_t)(nb * Lmax) + 1, sizeof(int32_t), "expert combine");
        b->crow = mq_alloc_array((size_t)rows + 1, sizeof(int32_t), "expert combine");
        b->cw = mq_alloc_array((size_t)rows + 1, sizeof(float), "expert combine");
    }
    if (!b->htasks || !b->xin || !b->xin_buf || !b->cnt || !b->pos || !b->ebase || !b->tok || !b->tsample ||
        !b->rw || !b->tok_row || !b->xg || !b->hg || !b->hu || !b->yg || !b->tasks || !b->grow || !b->xrows ||
        !b->xfirst || (p->gout && (!b->ctok || !b->cfirst || !b->crow || !b->cw))) {
        batch_free(b);
        return mq_err(MOEQ_E_NOMEM, "out of memory for the expert batch scratch");
    }
    return MOEQ_OK;
}

/* The batch's token outputs combined on the GPU into p->gout (batch_combine_task's order and
 * arithmetic: each token's experts of the chunk by increasing id, one axpy each). */
static moeq_status batch_combine_device(ex_batch *b) {
    mq_pipe *p = b->p;
    const int64_t K = p->c->top_k, Lmax = p->calib.max_len;
    int64_t n_tok = 0, np = 0;
    for (int64_t i = 0; i < b->nb; i++) {
        const int64_t s = b->s0 + i, T = p->calib.len[s];
        const int32_t *sel = b->src.sel + s * Lmax * K;
        const float *w = b->src.w + s * Lmax * K;
        const int32_t *tr = b->tok_row + i * Lmax * K;
        for (int64_t t = 0; t < T; t++) {
            int32_t order[64];
            int64_t kk = 0;
            for (int64_t k = 0; k < K && kk < 64; k++)
                if (tr[t * K + k] >= 0) order[kk++] = (int32_t)k;
            if (!kk) continue;
            for (int64_t a = 1; a < kk; a++)   /* insertion sort by expert id */
                for (int64_t c = a; c > 0 && sel[t * K + order[c - 1]] > sel[t * K + order[c]]; c--) {
                    int32_t tmp = order[c];
                    order[c] = order[c - 1];
                    order[c - 1] = tmp;
                }
            b->ctok[n_tok] = s * Lmax + t;
            b->cfirst[n_tok++] = (int32_t)np;
            for (int64_t k = 0; k < kk; k++) {
                b->crow[np] = tr[t * K + order[k]];
                b->cw[np++] = w[t * K + order[k]];
            }
        }
    }
    b->cfirst[n_tok] = (int32_t)np;
    return mq_gpu_mlp_combine(b->gmlp, p->gout, b->ctok, b->cfirst, b->crow, b->cw, n_tok);
}

/* Runs samples [s0, s0 + nb) through experts [e0, e1): inputs, the rows of each expert (tokens
 * in order, as the forward groups them), gate/up (and down), then Hessians / amax / combine. */
/* MOEQ_DEBUG_PROFILE=1 with a GPU: the experts' batches' seconds by step, logged per layer
 * (mq_pipe_routed_experts): FFN inputs, routing bookkeeping, inputs up, the experts on the device
 * (to their end), the combine. */
static double g_ex_prof[5];

void mq_expert_batches_profile_log(int l) {
    mq_info("layer %d experts on the GPU: FFN inputs %.2f s, routing %.2f s, inputs up %.2f s, experts %.2f s, "
            "combine %.2f s", l, g_ex_prof[0], g_ex_prof[1], g_ex_prof[2], g_ex_prof[3], g_ex_prof[4]);
    memset(g_ex_prof, 0, sizeof g_ex_prof);
}

/* The batch's routing bookkeeping, sample by sample on the pool (each sample writes only its own
 * counts, and rows from its own place in every expert's rows: the same layout in any order).
 * Counts: rows of each (sample, expert of the chunk). */
static void batch_count_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    const mq_pipe *p = b->p;
    const int64_t C = b->e1 - b->e0, K = p->c->top_k, s = b->s0 + i;
    const int32_t *sel = b->src.sel + s * p->calib.max_len * K;
    int32_t *cnt = b->cnt + i * C;
    memset(cnt, 0, sizeof(int32_t) * (size_t)C);
    for (int64_t j = 0; j < p->calib.len[s] * K; j++)
        if (sel[j] >= b->e0 && sel[j] < b->e1) cnt[sel[j] - b->e0]++;
}

/* Each row's token, sample and Hessian weight, and each (token, k)'s row, from the sample's first
 * row of every expert (pos). */
static void batch_fill_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    const mq_pipe *p = b->p;
    const int64_t C = b->e1 - b->e0, K = p->c->top_k, Lmax = p->calib.max_len;
    const int64_t s = b->s0 + i, T = p->calib.len[s];
    const int32_t *sel = b->src.sel + s * Lmax * K;
    const float *gw = b->src.w + s * Lmax * K;
    const int ew = p->o->expert_weighting;
    int32_t *tr = b->tok_row + i * Lmax * K;
    int64_t *next = b->pos + i * C;   /* advanced while filling, rebuilt below */
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e = sel[t * K + k];
            if (e < b->e0 || e >= b->e1) {
                tr[t * K + k] = -1;
                continue;
            }
            int64_t r = next[e - b->e0]++;
            b->tok[r] = (int32_t)t;
            b->tsample[r] = (int32_t)i;
            b->rw[r] = ew == 2 ? gw[t * K + k] * gw[t * K + k] : gw[t * K + k];
            tr[t * K + k] = (int32_t)r;
        }
    for (int64_t e = 0; e < C; e++) next[e] -= b->cnt[i * C + e];
}

/* The batch's rows: expert by expert, each expert's rows of every sample in order (the counts,
 * each expert's first row, each row's token and sample), and the row blocks' tasks. */
static void batch_layout(ex_batch *b) {
    const int64_t C = b->e1 - b->e0;
    mq_parallel_for(b->nb, batch_count_task, b);
    b->ebase[0] = 0;
    for (int64_t e = 0; e < C; e++) {
        int64_t r = b->ebase[e];
        for (int64_t i = 0; i < b->nb; i++) {
            b->pos[i * C + e] = r;
            r += b->cnt[i * C + e];
        }
        b->ebase[e + 1] = r;
    }
    mq_parallel_for(b->nb, batch_fill_task, b);
    /* The blocks largest first: the pool hands tasks out in order, and each expert's last block
     * holds 1 to 255 rows, so in expert order a full block could start last while the other
     * threads idle. Every block writes only its own rows: the order changes no value. */
    b->n_tasks = 0;
    for (int64_t e = 0; e < C; e++)
        for (int64_t blk = 0; blk < (b->ebase[e + 1] - b->ebase[e]) / TASK_ROWS; blk++)
            b->tasks[b->n_tasks++] = e << 32 | blk;
    for (int64_t rest = TASK_ROWS - 1; rest > 0; rest--)
        for (int64_t e = 0; e < C; e++) {
            const int64_t rows = b->ebase[e + 1] - b->ebase[e];
            if (rows % TASK_ROWS == rest) b->tasks[b->n_tasks++] = e << 32 | rows / TASK_ROWS;
        }
}

/* A block of the unquantized stream's output rows (batch_run_fp): a row whose token the paired
 * cross batch routed to the same expert takes that batch's SwiGLU of gate/up (the same
 * deterministic products of the same input: the same bits); the others are gathered and run
 * through gate/up here; then down over the block, as batch_rows_task computes every row. */
static void batch_rows_fp_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    const ex_batch *q = b->pair;
    mq_pipe *p = b->p;
    const int64_t D = p->c->D, F = p->c->moe_ffn, K = p->c->top_k, Lmax = p->calib.max_len;
    const mq_layer *ly = &p->m->layers[b->l];
    const int64_t ce = b->tasks[task] >> 32, blk = b->tasks[task] & 0xffffffff;
    const int32_t e = (int32_t)(b->e0 + ce);
    const int64_t r0 = b->ebase[ce] + blk * TASK_ROWS;
    const int64_t n = b->ebase[ce + 1] - r0 < TASK_ROWS ? b->ebase[ce + 1] - r0 : TASK_ROWS;
    int32_t *from = b->grow + r0;   /* each row's row in q, or -1 */
    int64_t m = 0;                  /* rows to compute, gathered at the block's start */
    for (int64_t r = r0; r < r0 + n; r++) {
        const int64_t i = b->tsample[r], t = b->tok[r];
        const int32_t *qsel = q->src.sel + (b->s0 + i) * Lmax * K + t * K;
        const int32_t *qrow = q->tok_row + i * Lmax * K + t * K;
        int32_t at = -1;
        for (int64_t k = 0; k < K && at < 0; k++)
            if (qsel[k] == e) at = qrow[k];
        from[r - r0] = at;
        if (at < 0)
            memcpy(b->xg + (r0 + m++) * D, b->xin[i] + t * D, sizeof(float) * (size_t)D);
    }
    if (m) (void)mq_mlp_forward(&ly->exp_gate[e], &ly->exp_up[e], NULL, b->xg + r0 * D, m, b->hg + r0 * F,
                                b->hu + r0 * F, NULL);
    /* computed rows to their places (last first: a row's place is at or after its gathered one),
     * then the paired batch's */
    for (int64_t j = n - 1, c = m - 1; j >= 0; j--)
        if (from[j] < 0) {
            if (c != j) memcpy(b->hg + (r0 + j) * F, b->hg + (r0 + c) * F, sizeof(float) * (size_t)F);
            c--;
        }
    for (int64_t j = 0; j < n; j++)
        if (from[j] >= 0) memcpy(b->hg + (r0 + j) * F, q->hgf + (int64_t)from[j] * F, sizeof(float) * (size_t)F);
    (void)mq_linear_forward(&ly->exp_down[e], b->hg + r0 * F, n, b->yg + r0 * D);
}

/* The unquantized stream's expert outputs for the samples of the cross batch q, into OUTF: the
 * separate pass (mq_pipe_experts_pass with mq_pipe_fp_source) computed gate/up of every row
 * again; here the rows q has computed for the same (token, expert) are reused. Same rows,
 * products and combine: the same bits (tests/test_pipeline.c against the reference loop). */
static void batch_run_fp(ex_batch *b, const ex_batch *q) {
    mq_pipe *p = b->p;
    double t0 = mq_now(), c0 = mq_cpu_now();
    b->s0 = q->s0;
    b->nb = q->nb;
    b->pair = q;
    for (int64_t i = 0; i < b->nb; i++) b->xin[i] = q->xinf[i];   /* XF's FFN inputs, made by q */
    batch_layout(b);
    mq_parallel_for(b->n_tasks, batch_rows_fp_task, b);
    mq_parallel_for(b->nb, batch_combine_task, b);
    p->layers[b->l].forward += mq_now() - t0;
    p->layers[b->l].cpu_forward += mq_cpu_now() - c0;
}

static moeq_status batch_run(ex_batch *b, mq_pipe *p, int l) {
    const int64_t C = b->e1 - b->e0, Lmax = p->calib.max_len;
    double t0 = mq_now(), c0 = mq_cpu_now();
    /* On the GPU the rows stay there, their Hessians summed on the device, unless the CPU must see
     * them (amax, weighted rows): only the samples' FFN inputs and the rows' indices go up, or
     * only the indices where the inputs are there already (din, mq_pipe_gpu_ffn_inputs_new). */
    const bool dev_rows = b->gmlp && !b->amax && !(b->hess && p->o->expert_weighting);
    mq_gpu_buf *din = !dev_rows ? NULL : b->src.from_xn ? p->gffn_xn : p->gffn_h;
    if (!b->all_dev && !din) {   /* all_dev: below, in groups */
        inputs_group g = {b, 0};
        mq_parallel_for(b->nb, group_inputs_task, &g);
    }
    double tp = mq_now();
    g_ex_prof[0] += tp - t0;
    batch_layout(b);
    moeq_status st = MOEQ_OK;
    p->layers[l].gpu_device_batches += dev_rows;
    p->layers[l].gpu_kept_inputs += din != NULL;
    if (dev_rows) {   /* the same values as batch_rows_task's (backend/gpu.h) */
        const int64_t D = p->c->D;
        int64_t at = 0;
        for (int64_t i = 0; i < b->nb; i++) {
            b->xrows[i] = p->calib.len[b->s0 + i];
            b->xfirst[i] = din ? (b->s0 + i) * Lmax : at;
            at += b->xrows[i];
        }
        for (int64_t r = 0; r < b->ebase[C]; r++) b->grow[r] = (int32_t)(b->xfirst[b->tsample[r]] + b->tok[r]);
        double tq = mq_now();
        g_ex_prof[1] += tq - tp;
        if (din) st = mq_gpu_mlp_inputs_from(b->gmlp, din, p->calib.n * Lmax);
        else st = b->all_dev ? batch_inputs_device(b) : mq_gpu_mlp_inputs(b->gmlp, b->xin, b->xrows, b->nb);
        /* room for the pass's largest batch at once: a larger one later would wait for the device */
        if (!st && b->all_dev && b->down && p->gout) st = mq_gpu_mlp_reserve_kept(b->gmlp, b->rows_cap);
        /* the whole batch's row indices up at once, unless the outputs come back to the host */
        const bool indexed = !b->down || p->gout;
        if (!st && indexed) st = mq_gpu_mlp_rows_index(b->gmlp, b->grow, b->ebase[C]);
        tp = mq_now();
        g_ex_prof[2] += tp - tq;
        for (int64_t ce = 0; ce < C && !st; ce++) {
            mq_slot *gu = &b->gu[b->e0 + ce], *dn = &b->dn[b->e0 + ce];
            const int64_t r0 = b->ebase[ce], n = b->ebase[ce + 1] - r0;
            mq_gpu_hessians *hin = b->hess && gu->h.sum ? gu->gh : NULL, *hdn = b->hess && dn->h.sum ? dn->gh : NULL;
            if (indexed)   /* down: the outputs stay there for the combine */
                st = mq_gpu_mlp_run_indexed(b->gmlp, ce, r0, n, b->down, hin, hdn);
            else
                st = mq_gpu_mlp_run_rows(b->gmlp, ce, b->grow + r0, n, NULL, NULL, b->down ? b->yg + r0 * D : NULL,
                                         hin, hdn);
            if (hin) gu->h.n += n;
            if (hdn) dn->h.n += n;
        }
        if (!st) st = mq_gpu_mlp_join(b->gmlp);   /* the experts ran on several streams */
        if (mq_env(MQ_ENV_PROFILE) && !st) st = mq_gpu_sync(p->gpu);
        tq = mq_now();
        g_ex_prof[3] += tq - tp;
        if (!st && b->down && p->gout) st = batch_combine_device(b);
        g_ex_prof[4] += mq_now() - tq;
        if (st) return st;
    } else if (b->gmlp) {
        const int64_t D = p->c->D, F = p->c->moe_ffn;
        mq_parallel_for(b->n_tasks, batch_gather_task, b);
        for (int64_t ce = 0; ce < C && !st; ce++) {
            const int64_t r0 = b->ebase[ce], n = b->ebase[ce + 1] - r0;
            st = mq_gpu_mlp_run(b->gmlp, ce, b->xg + r0 * D, n, b->hg + r0 * F, NULL,
                                b->down ? b->yg + r0 * D : NULL, NULL, NULL);
        }
        if (st) return st;
    } else {
        mq_parallel_for(b->n_tasks, batch_rows_task, b);
    }
    double t1 = mq_now(), c1 = mq_cpu_now();
    if (dev_rows)
        ;   /* summed on the device already */
    else if ((b->hess || b->amax) && p->gpu)   /* the GPU's sums in turn, each on the device */
        for (int64_t ce = 0; ce < C && !st; ce++) st = batch_hessian_one(b, ce);
    else if ((b->hess || b->amax) && banded_hessians(b))
        batch_hessian_bands(b);
    else if (b->hess || b->amax)
        mq_parallel_for(C, batch_hessian_task, b);
    if (st) return st;
    double t2 = mq_now(), c2 = mq_cpu_now();
    if (b->down && p->gout && !dev_rows)   /* mq_pipe_routed_experts keeps gout to runs that
                                              allow it */
        return mq_err(MOEQ_E_UNSUPPORTED, "layer %d: experts' outputs on the GPU but not their rows", l);
    if (b->down && !p->gout) mq_parallel_for(b->nb, batch_combine_task, b);
    double t3 = mq_now(), c3 = mq_cpu_now();
    p->layers[l].forward += (t1 - t0) + (t3 - t2);
    p->layers[l].cpu_forward += (c1 - c0) + (c3 - c2);
    p->layers[l].hessian += t2 - t1;
    p->layers[l].cpu_hessian += c2 - c1;
    return MOEQ_OK;
}

/* Rows of sample s for experts [e0, e1). */
static int64_t sample_rows(const mq_pipe *p, const mq_ffn_source *src, int64_t s, int e0, int e1) {
    const int64_t K = p->c->top_k;
    const int32_t *sel = src->sel + s * p->calib.max_len * K;
    int64_t n = 0;
    for (int64_t j = 0; j < p->calib.len[s] * K; j++) n += sel[j] >= e0 && sel[j] < e1;
    return n;
}

/* The chunk's experts on the GPU when they are plain deterministic fp32 Linears (the weights as
 * they are now: unquantized, or dequantized for the quantized output); else *out stays NULL and
 * the CPU runs them. read: their weights must be in memory (false: whether they will be plain
 * once read, as mq_pipe_routed_experts asks before reading them). */
bool mq_pipe_experts_plain_as(const mq_pipe *p, int l, int e0, int e1, bool read) {
    const mq_layer *ly = &p->m->layers[l];
    bool plain = true;
    for (int e = e0; e < e1; e++) {
        const mq_linear *lin[3] = {&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e]};
        for (int k = 0; k < 3; k++) plain &= (lin[k]->w || !read) && lin[k]->det && !lin[k]->qw && !lin[k]->bias;
    }
    return plain;
}
static bool experts_plain(const mq_pipe *p, int l, int e0, int e1) {
    return mq_pipe_experts_plain_as(p, l, e0, e1, true);
}

moeq_status mq_pipe_gpu_experts(mq_pipe *p, int l, int e0, int e1, bool down, int64_t rows, mq_gpu_mlp **out) {
    *out = NULL;
    if (p->gx && p->gx_e0 == e0 && p->gx_e1 == e1) {   /* the chunk's, on the device already */
        *out = p->gx;
        return MOEQ_OK;
    }
    const mq_layer *ly = &p->m->layers[l];
    const int n = e1 - e0;
    const float **w = calloc((size_t)(3 * n), sizeof *w);
    if (!w) return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (int e = e0; e < e1; e++) {
        const mq_linear *lin[3] = {&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e]};
        for (int k = 0; k < 3; k++) w[k * n + (e - e0)] = lin[k]->w;
    }
    const bool plain = experts_plain(p, l, e0, e1);
    moeq_status st = MOEQ_OK;
    if (plain)
        st = mq_gpu_mlp_new(p->gpu, n, p->c->D, p->c->moe_ffn, w, w + n, down ? w + 2 * n : NULL, rows, out);
    free(w);
    return st;
}

/* The GPU's expert batches: how many rows (token, expert) pairs one batch may hold on the device,
 * a third of its free memory at 2 D floats per row, 4 when down runs (its kept output, and
 * the tokens' inputs, fewer than the rows), at most GPU_BATCH_MAX_ROWS for the host's per-row
 * bookkeeping (24 bytes a row: 100 MB). MOEQ_DEBUG_GPU_BATCH_ROWS=N sets it (the tests' small batches).
 * Unless MOEQ_DEBUG_GPU_BATCH=plan (mq_pipe_experts_pass). */
enum { GPU_BATCH_MAX_ROWS = 1 << 22, GPU_DEVICE_BATCHES_DEFAULT = 1 };
#define GPU_BATCH_HOST_ROUTES ((int64_t)1 << 23)

static int64_t gpu_batch_rows(const mq_pipe *p, bool down) {
    const char *env = mq_env(MQ_ENV_GPU_BATCH_ROWS);
    if (env && atoll(env) > 0) return atoll(env);
    mq_gpu_info gi;
    mq_gpu_get_info(p->gpu, &gi);
    const int64_t per_row = (int64_t)sizeof(float) * p->c->D * (down ? 2 : 1) * 2;
    int64_t rows = gi.mem_free / 3 / per_row;
    if (rows > GPU_BATCH_MAX_ROWS) rows = GPU_BATCH_MAX_ROWS;
    return rows > 1 ? rows : 1;
}

/* Every sample through experts [e0, e1), in batches of as many samples as the plan's rows hold
 * (enough rows for every thread; which samples go together does not change any value) or, on the
 * GPU, as the device holds. own: only this rank's samples (outputs with several ranks), else all
 * of them. */
/* fp_done (asked for, else NULL): a cross pass on the CPU gives the unquantized stream's outputs
 * of the same samples too, batch by batch (batch_run_fp), and says so in *fp_done; else they
 * need their own pass with mq_pipe_fp_source. */
moeq_status mq_pipe_experts_pass(mq_pipe *p, int l, int e0, int e1, mq_ffn_source src, bool down,
                                 bool hess, bool amax, mq_slot *gu, mq_slot *dn, bool own, bool *fp_done) {
    const int64_t s_lo = own ? p->s_lo : 0, s_hi = own ? p->s_hi : p->calib.n;
    if (s_hi <= s_lo) return MOEQ_OK;
    int64_t nb = p->mp.batch > 0 ? p->mp.batch : 1;
    if (nb > s_hi - s_lo) nb = s_hi - s_lo;
    const int64_t plan_rows = mq_plan_batch_rows(p, e1 - e0);
    int64_t rows_cap = plan_rows, nb_in = nb;
    /* On the GPU (unless MOEQ_DEBUG_GPU_BATCH=plan) every expert's GEMMs take as many rows as the device
     * holds instead of the CPU threads' batches, which are sized to keep the host's threads busy
     * and leave the GPU's GEMMs small: possible where the rows stay on the device (batch_run's
     * dev_rows) and the outputs are combined there. Fewer, larger products keep the device busier,
     * and the bytes are the same either way (test_gpu_pipeline compares both, killed and resumed
     * too), so it is the default; MOEQ_DEBUG_GPU_BATCH=plan takes the CPU plan's batches. */
    const char *gb = mq_env(MQ_ENV_GPU_BATCH);
    const bool dev_batches = gb ? strcmp(gb, "plan") != 0 : GPU_DEVICE_BATCHES_DEFAULT;
    /* the experts on the device: plain ones go up for this pass, quantized ones are there already
     * (p->gx: GPTQ left their dequantized weights there for the output pass) */
    const bool on_dev = experts_plain(p, l, e0, e1) || (p->gx && p->gx_e0 == e0 && p->gx_e1 == e1);
    /* the rows stay on the device (batch_run's dev_rows), else the batches take their inputs from
     * the host, which then needs XN's host copy */
    const bool dev_rows = p->gpu && on_dev && !amax && !(hess && p->o->expert_weighting);
    const bool all_dev = dev_rows && dev_batches && (!down || p->gout);
    if (src.from_xn && !dev_rows) {
        moeq_status xs = mq_pipe_xn_to_host(p, l);
        if (xs) return xs;
    }
    if (all_dev) {
        int64_t worst = 1, total = 0;
        for (int64_t s = s_lo; s < s_hi; s++) {
            const int64_t r = sample_rows(p, &src, s, e0, e1);
            total += r;
            if (r > worst) worst = r;
        }
        rows_cap = gpu_batch_rows(p, down);
        if (rows_cap < worst) rows_cap = worst;   /* one sample always fits */
        if (rows_cap > total) rows_cap = total > 0 ? total : 1;
        /* the host's per-sample bookkeeping (tok_row and the combine's, about 16 bytes per
         * token and route) stays under GPU_BATCH_HOST_ROUTES */
        const int64_t per_sample = p->calib.max_len * p->c->top_k;
        int64_t nb_cap = GPU_BATCH_HOST_ROUTES / (per_sample > 0 ? per_sample : 1);
        if (nb_cap < nb) nb_cap = nb;
        nb = s_hi - s_lo < nb_cap ? s_hi - s_lo : nb_cap;
    }
    ex_batch b, bf;
    memset(&b, 0, sizeof b);
    memset(&bf, 0, sizeof bf);
    const bool cross = hess && p->target;
    const bool with_fp = fp_done && cross && !all_dev && !p->gpu;
    if (fp_done) *fp_done = with_fp;
    moeq_status st = batch_alloc(&b, p, nb, e1 - e0, rows_cap, nb_in, !all_dev, cross);
    if (st) return st;
    const mq_ffn_source fsrc = mq_pipe_fp_source(p);
    if (with_fp) {
        if ((st = batch_alloc(&bf, p, nb, e1 - e0, rows_cap, 1, true, false))) {
            batch_free(&b);
            return st;
        }
        bf.p = p;
        bf.l = l;
        bf.e0 = e0;
        bf.e1 = e1;
        bf.src = fsrc;
        bf.down = true;
        bf.out = &p->OUTF;
        bf.gu = gu;
        bf.dn = dn;
    }
    b.all_dev = all_dev;
    b.rows_cap = rows_cap;
    b.p = p;
    b.l = l;
    b.e0 = e0;
    b.e1 = e1;
    b.src = src;
    b.down = down;
    b.hess = hess;
    b.amax = amax;
    b.cross = cross;
    b.out = src.fp ? &p->OUTF : &p->OUT;
    b.gu = gu;
    b.dn = dn;
    if (p->gpu && (st = mq_pipe_gpu_experts(p, l, e0, e1, down, plan_rows, &b.gmlp))) {
        batch_free(&b);
        return st;
    }
    for (int64_t s0 = s_lo; s0 < s_hi && !st; s0 += b.nb) {
        if ((st = mq_pipe_check_interrupt())) break;
        int64_t rows = sample_rows(p, &src, s0, e0, e1);
        b.s0 = s0;
        b.nb = 1;   /* one sample always fits: rows_cap holds a sample's worst case */
        int64_t rows_f = with_fp ? sample_rows(p, &fsrc, s0, e0, e1) : 0;
        while (b.nb < nb && s0 + b.nb < s_hi) {
            int64_t r = sample_rows(p, &src, s0 + b.nb, e0, e1);
            int64_t rf = with_fp ? sample_rows(p, &fsrc, s0 + b.nb, e0, e1) : 0;
            if (rows + r > rows_cap || rows_f + rf > rows_cap) break;
            rows += r;
            rows_f += rf;
            b.nb++;
        }
        st = batch_run(&b, p, l);
        if (!st && with_fp) batch_run_fp(&bf, &b);
    }
    if (b.gmlp != p->gx) mq_gpu_mlp_free(b.gmlp);
    batch_free(&b);
    if (with_fp) batch_free(&bf);
    return st;
}
