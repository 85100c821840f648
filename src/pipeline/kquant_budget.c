/*
 * --target-bpw B: the block type of each tensor group of a K-quant GGUF file (a layer's q, k, v,
 * o, gate, up, down: a layer's routed experts share their role's type, as llama.cpp's stacked
 * tensors must; a shared expert's gate, up and down are groups of their own, llama.cpp's
 * ffn_*_shexp tensors: always on and gated apart, its Linears move the residual far more per
 * unit of their loss than the routed experts' (13x on qwen2moe-tiny's gate/up), and one gain for
 * the mixed group priced its types wrongly) chosen so that the file holds at most B bits per
 * parameter.
 *
 * Sensitivity of a group to type T: the loss GPTQ minimises, tr((W - Q_T) H (W - Q_T)^T), with
 * H's diagonal (sum over calibration tokens of x_j^2, each Linear's own input: an expert's routed
 * tokens only, so an expert's weight is its use) and Q_T the type's round to nearest (the block
 * fit without search, on a sample of rows, scaled to all of them): the squared error the group
 * adds to its outputs. Those outputs are not in one unit (q's error passes a softmax, down's
 * lands in the residual stream as it is), so each group's loss is carried to the layer's
 * output, the residual stream every layer shares: the layer is run again with the group
 * rounded to Q3_K, and gain = (residual change) / the group's Q3_K loss scales all its types'
 * losses. The residual change is each token's |change|^2 divided by that token's mean square
 * of the layer's output (sum over tokens): every reader of the stream (the next layers, the
 * final norm) sees it through an RMS norm, so an error counts by its size against the token's
 * own stream. The plain |change|^2 summed over tokens ranked q, k, gate and up far below down
 * and o on qwen2moe-tiny, where llama.cpp's KL of files with one role upgraded said the
 * opposite, and missed the goal there; this measure meets it on the three fixtures
 * (docs/results/kquant.md). GPTQ lowers the losses by a similar factor for every type (its
 * report's loss against RTN: 0.3-0.4 on the fixtures), so the ranking holds. Why not the others the issue names: the
 * Hessian's trace ignores the weights' own error; a KL probe on the logits needs a forward of the
 * rest of the model per group and type; GPTQ loss against RTN needs GPTQ per candidate. This
 * costs a forward of a few samples through the unquantized model, one more layer forward per
 * group, a layer at a time (each whole layer in memory once), before the plan, which must know
 * every tensor's size.
 *
 * Choice: a multiple-choice knapsack by its Lagrangian greedy: every group at its cheapest type,
 * then the upgrade with the largest loss removed per added bit, one at a time, while it fits the
 * budget. The output and token_embd (one group when tied) are groups too (head_losses says how
 * their errors are carried to the residual stream's unit: on small models they are a large share
 * of the file, and rules that kept them at Q6_K and the file type's left the Linears under 4
 * bits at a 4.5-bit budget); the F32 norms and routers count in the budget too.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "formats/kquant.h"
#include "pipeline/internal.h"

enum { PROBE_SAMPLES = 16, ROWS_DENSE = 32, ROWS_EXPERT = 8, N_CAND = 6 };

/* A group's candidates are the K-quants, IQ4_XS and Q8_0, cheapest first; a member whose rows
 * are no whole 256-value blocks takes each one's llama.cpp fallback (Q3_K -> Q4_0, IQ4_XS ->
 * IQ4_NL, Q4_K -> Q5_0, ...), whose loss and bits it adds (qwen2moe's 128-input experts' down:
 * Q6_K and Q8_0 are then the same). IQ4_XS (4.25 bits) sits between Q3_K (3.44) and Q4_K (4.5):
 * its non-uniform grid errs less than Q3_K's by far for 0.8 bits more, so a budget near 4.5 bits
 * need not leave most groups at Q3_K. */
static const int cand[N_CAND] = {MQ_KQ_Q3_K, MQ_KQ_IQ4_XS, MQ_KQ_Q4_K, MQ_KQ_Q5_K, MQ_KQ_Q6_K, MQ_KQ_Q8_0};

typedef struct {
    double loss[N_CAND];       /* sensitivity of each candidate */
    double bits[N_CAND];       /* the group's bits with each */
    int64_t params;
    double gain;               /* residual-stream change per unit of the group's loss */
    int pick;                  /* index into cand */
    bool used;
} group;

/* Per Linear input: sum over tokens of x_j^2 (double), by (site, expert). */
typedef struct {
    const mq_config *c;
    double *h[MQ_SITE_COUNT];   /* [E or 1][cols] */
    int64_t cols[MQ_SITE_COUNT];
} probe_sums;

static void capture(void *user, int layer, mq_site site, int expert, const float *x, int64_t rows, int64_t cols) {
    (void)layer;
    probe_sums *ps = user;
    if (!ps->h[site] || cols != ps->cols[site]) return;
    double *h = ps->h[site] + (expert > 0 ? expert : 0) * cols;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++) h[j] += (double)x[r * cols + j] * x[r * cols + j];
}

/* The sensitivities of one Linear added into its group. */
static void linear_losses(const mq_linear *lin, const double *h, bool expert, group *g) {
    if (!lin->name || !lin->w || !h || !g) return;
    g->used = true;
    g->params += lin->out * lin->in;
    const int64_t want = expert ? ROWS_EXPERT : ROWS_DENSE, n = lin->out < want ? lin->out : want;
    float *q = malloc(sizeof(float) * (size_t)lin->in);
    mq_gparams *gp = malloc(sizeof(mq_gparams) * (size_t)(lin->in / 16 + 1));
    uint8_t *c = malloc((size_t)lin->in);
    if (!q || !gp || !c) goto done;
    for (int k = 0; k < N_CAND; k++) {
        const int eff = mq_gguf_fallback(cand[k], lin->in);
        if (eff < 0) {   /* llama.cpp's F16: no loss worth the name, 16 bits */
            g->bits[k] += 16.0 * (double)(lin->out * lin->in);
            continue;
        }
        const mq_kq_info *t = mq_kq_info_of((mq_kq_type)eff);
        const mq_qspec s = mq_kq_spec((mq_kq_type)eff);
        g->bits[k] += mq_kq_bpw((mq_kq_type)eff) * (double)(lin->out * lin->in);
        double e = 0;
        for (int64_t i = 0; i < n; i++) {
            const float *row = lin->w + (i * lin->out / n) * lin->in;   /* evenly spread */
            mq_kq_quantize_row(t, &s, row, lin->in, NULL, gp, c);
            mq_kq_dequant_row(t, gp, c, lin->in, q);
            for (int64_t j = 0; j < lin->in; j++) e += h[j] * ((double)row[j] - q[j]) * ((double)row[j] - q[j]);
        }
        g->loss[k] += e * (double)lin->out / (double)n;
    }
done:
    free(q);
    free(gp);
    free(c);
}

static group *group_of(group *gs, const mq_linear *lin) {
    int layer;
    const mq_gguf_cat cat = mq_gguf_category_hf(lin->name, &layer);
    return layer >= 0 ? &gs[(size_t)layer * MQ_GCAT_COUNT + cat] : NULL;
}

/* Every Linear of layer ly that has weights, into out (room for 16 + 3 E). */
static int layer_linears(const mq_layer *ly, int E, mq_linear **out) {
    mq_linear *all[14] = {(mq_linear *)&ly->q,    (mq_linear *)&ly->k,       (mq_linear *)&ly->v,
                          (mq_linear *)&ly->o,    (mq_linear *)&ly->q_a,     (mq_linear *)&ly->q_b,
                          (mq_linear *)&ly->kv_a, (mq_linear *)&ly->kv_b,    (mq_linear *)&ly->gate,
                          (mq_linear *)&ly->up,   (mq_linear *)&ly->down,    (mq_linear *)&ly->sh_gate,
                          (mq_linear *)&ly->sh_up, (mq_linear *)&ly->sh_down};
    int n = 0;
    for (int k = 0; k < 14; k++)
        if (all[k]->name && all[k]->w) out[n++] = all[k];
    for (int e = 0; e < E; e++) {
        mq_linear *ex[3] = {&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e]};
        for (int k = 0; k < 3; k++)
            if (ex[k]->name && ex[k]->w) out[n++] = ex[k];
    }
    return n;
}

/* The group's Linears rounded to Q3_K (their fallback where the rows want it) in place, the
 * originals into saved[] (NULL: put them back). */
static moeq_status swap_rounded(mq_linear **lins, int n, float **saved, bool back) {
    for (int k = 0; k < n; k++) {
        mq_linear *lin = lins[k];
        const size_t bytes = sizeof(float) * (size_t)(lin->out * lin->in);
        if (back) {
            memcpy(lin->w, saved[k], bytes);
            mq_free(saved[k]);
            saved[k] = NULL;
            continue;
        }
        const int eff = mq_gguf_fallback(MQ_KQ_Q3_K, lin->in);
        if (!(saved[k] = mq_alloc(bytes, "--target-bpw probe"))) return MOEQ_E_NOMEM;
        memcpy(saved[k], lin->w, bytes);
        if (eff < 0) continue;
        const mq_kq_info *t = mq_kq_info_of((mq_kq_type)eff);
        const mq_qspec s = mq_kq_spec((mq_kq_type)eff);
        mq_gparams *gp = malloc(sizeof(mq_gparams) * (size_t)(lin->in / 16 + 1));
        uint8_t *c = malloc((size_t)lin->in);
        if (!gp || !c) {
            free(gp);
            free(c);
            return mq_err(MOEQ_E_NOMEM, "out of memory");
        }
        for (int64_t r = 0; r < lin->out; r++) {
            mq_kq_quantize_row(t, &s, lin->w + r * lin->in, lin->in, NULL, gp, c);
            mq_kq_dequant_row(t, gp, c, lin->in, lin->w + r * lin->in);
        }
        free(gp);
        free(c);
    }
    return MOEQ_OK;
}

/* The residual change of the layer's output xout [T][D] against out, one sample of len tokens:
 * sum over tokens of |out_t - xout_t|^2 / mean_j xout_tj^2 (the change as the RMS norm of the
 * stream's readers sees it). */
static double residual_change(const float *out, const float *xout, int64_t len, int64_t D) {
    double d2 = 0;
    for (int64_t t = 0; t < len; t++) {
        double dt = 0, ms = 0;
        for (int64_t j = t * D; j < (t + 1) * D; j++) {
            const double d = (double)out[j] - xout[j];
            dt += d * d;
            ms += (double)xout[j] * xout[j];
        }
        if (ms > 0) d2 += dt / (ms / (double)D);
    }
    return d2;
}

/* The residual-stream gain of each group of layer l: the layer run on its inputs xin with the
 * group rounded, its residual change over the probe's tokens, divided by the group's Q3_K loss. */
static moeq_status layer_gains(mq_pipe *p, mq_state *st, const float *xin, const float *xout, float *xs,
                               const int64_t *len, int64_t S, int64_t T, int l, group *gs) {
    const moeq_model *m = p->m;
    const mq_layer *ly = &m->layers[l];
    const int E = ly->is_moe ? m->cfg.n_experts : 0;
    const int64_t D = m->cfg.D;
    mq_linear **lins = malloc(sizeof *lins * (size_t)(16 + 3 * E)), **sel = malloc(sizeof *sel * (size_t)(16 + 3 * E));
    float **saved = calloc((size_t)(16 + 3 * E), sizeof *saved);
    moeq_status s = lins && sel && saved ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory");
    const int n = s ? 0 : layer_linears(ly, E, lins);
    for (int cat = 0; cat < MQ_GCAT_COUNT && !s; cat++) {
        group *g = &gs[(size_t)l * MQ_GCAT_COUNT + cat];
        if (!g->used || !(g->loss[0] > 0)) continue;
        int k = 0;
        for (int i = 0; i < n; i++) {
            int li;
            if (mq_gguf_category_hf(lins[i]->name, &li) == (mq_gguf_cat)cat) sel[k++] = lins[i];
        }
        if ((s = swap_rounded(sel, k, saved, false))) {
            for (int i = 0; i < k && saved[i]; i++) mq_free(saved[i]);
            break;
        }
        double d2 = 0;
        for (int64_t i = 0; i < S && !s; i++) {
            float *x = xs + i * T * D;
            memcpy(x, xin + i * T * D, sizeof(float) * (size_t)(len[i] * D));
            s = mq_forward_layers(m, st, x, len[i], 0, l, l + 1, NULL);
            if (!s) d2 += residual_change(x, xout + i * T * D, len[i], D);
        }
        swap_rounded(sel, k, saved, true);
        g->gain = d2 / g->loss[0];
    }
    mq_state_drop_layer(st, l);
    free(lins);
    free(sel);
    free(saved);
    return s;
}

/* Layer l of the lazy model through the probe samples x [S][T][D], the sums taken, each Linear's
 * losses into gs, then each group's gain to the layer's output. */
static moeq_status probe_layer(mq_pipe *p, mq_state *st, float *x, float *xin, float *xs, const int64_t *len,
                               int64_t S, int64_t T, int l, group *gs) {
    const moeq_model *m = p->m;
    const mq_config *c = &m->cfg;
    const mq_layer *ly = &m->layers[l];
    const int E = ly->is_moe ? c->n_experts : 0;
    moeq_status s = mq_lazy_load(p->lz, l, MQ_PART_LAYER, 0, E);
    if (s) return s;
    probe_sums ps = {c, {0}, {0}};
    const mq_linear *site_lin[MQ_SITE_COUNT] = {&ly->q, &ly->o, &ly->gate, &ly->down, E ? &ly->exp_gate[0] : NULL,
                                                 E ? &ly->exp_down[0] : NULL, &ly->sh_gate, &ly->sh_down, NULL,
                                                 &ly->q_b, &ly->kv_b};
    if (c->mla) site_lin[MQ_SITE_QKV] = ly->q_a.name ? &ly->q_a : &ly->q;
    for (int k = 0; k < MQ_SITE_COUNT && !s; k++) {
        if (!site_lin[k] || !site_lin[k]->name) continue;
        const int64_t n = (k == MQ_SITE_EXPERT || k == MQ_SITE_EXPERT_DOWN ? E : 1) * site_lin[k]->in;
        ps.cols[k] = site_lin[k]->in;
        if (!(ps.h[k] = calloc((size_t)n, sizeof(double)))) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    const mq_hooks hooks = {capture, &ps};
    memcpy(xin, x, sizeof(float) * (size_t)(S * T * c->D));
    for (int64_t i = 0; i < S && !s; i++) s = mq_forward_layers(m, st, x + i * T * c->D, len[i], 0, l, l + 1, &hooks);
    mq_state_drop_layer(st, l);
    if (!s) {
        const mq_linear *att[4] = {&ly->q, &ly->k, &ly->v, &ly->o};
        const mq_site att_site[4] = {MQ_SITE_QKV, MQ_SITE_QKV, MQ_SITE_QKV, MQ_SITE_O};
        for (int k = 0; k < 4 && !c->mla; k++) linear_losses(att[k], ps.h[att_site[k]], false, group_of(gs, att[k]));
        if (c->mla) {
            const mq_linear *mla[5] = {&ly->q_a, &ly->q_b, &ly->kv_a, &ly->kv_b, &ly->o};
            const mq_site ms[5] = {MQ_SITE_QKV, MQ_SITE_Q_B, MQ_SITE_QKV, MQ_SITE_KV_B, MQ_SITE_O};
            if (!ly->q_a.name) mla[0] = &ly->q, mla[1] = NULL;
            for (int k = 0; k < 5; k++)
                if (mla[k] && mla[k]->name) linear_losses(mla[k], ps.h[ms[k]], false, group_of(gs, mla[k]));
        }
        const mq_linear *mlp[6] = {&ly->gate, &ly->up, &ly->down, &ly->sh_gate, &ly->sh_up, &ly->sh_down};
        const mq_site mlp_site[6] = {MQ_SITE_MLP, MQ_SITE_MLP, MQ_SITE_MLP_DOWN, MQ_SITE_SHARED, MQ_SITE_SHARED,
                                     MQ_SITE_SHARED_DOWN};
        for (int k = 0; k < 6; k++)
            if (mlp[k]->name) linear_losses(mlp[k], ps.h[mlp_site[k]], false, group_of(gs, mlp[k]));
        for (int e = 0; e < E; e++) {
            const mq_linear *ex[3] = {&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e]};
            for (int k = 0; k < 3; k++)
                linear_losses(ex[k], ps.h[k == 2 ? MQ_SITE_EXPERT_DOWN : MQ_SITE_EXPERT] + (int64_t)e * ex[k]->in, true,
                              group_of(gs, ex[k]));
        }
    }
    for (int k = 0; k < MQ_SITE_COUNT; k++) free(ps.h[k]);
    if (!s) s = layer_gains(p, st, xin, x, xs, len, S, T, l, gs);
    mq_lazy_release(p->lz, l, MQ_PART_LAYER, 0, E);
    return s;
}

/* token_embd, hg[0], and the output, hg[1], as groups (tied: hg[0] alone, its losses as output
 * and as embedding added), their losses in the residual stream's unit of layer_gains with gain 1:
 *   token_embd: each row's squared error divided by the row's mean square, times the row's
 *     count in the probe's tokens (a row is the stream before the first layer: its error is a
 *     residual change of that size). Before the residual change was measured against each
 *     token's stream, the untied token_embd kept the file type's rule: with plain squared errors
 *     the knapsack took it to Q3_K on olmoe-tiny and llama.cpp's KL doubled; against the row's
 *     own size it is valued above most Linears (docs/results/kquant.md);
 *   output: the Linear's loss under the diagonal of its input's Hessian (the final norm of the
 *     last layer's output x, over the probe's tokens), in the logits' unit, divided by the
 *     logits' response to a change d of x measured as layer_gains measures it, |d|^2 / mean_j
 *     x_j^2 = u: |W diag(g) d / rms(x)|^2 ~ u r with r = sum_j g_j^2 |W_j|^2 / D (g the norm's
 *     weight, W_j the output's column j; an isotropic d, the norm's own projection ignored), so
 *     that an output error and a layer's residual change that moves the logits as much weigh the
 *     same.
 * x [S][T][D]: the last layer's outputs (xs: scratch of the same size). */
static moeq_status head_losses(mq_pipe *p, const float *x, float *xs, const mq_calib_set *set, int64_t T, group *hg) {
    const moeq_model *m = p->m;
    const mq_config *c = &m->cfg;
    const int64_t D = c->D, V = c->vocab;
    const bool tied = p->recipe.tied;
    const unsigned what = MQ_PART_HEAD | (tied ? MQ_PART_EMBED : 0);   /* mq_lazy_embed reads rows itself */
    moeq_status s = mq_lazy_load(p->lz, -1, what, 0, 0);
    moeq_model *mm = mq_lazy_model_of(p->lz);
    if (!s && tied) mm->lm_head = mm->embed;   /* as eval's streamed scoring borrows it */
    double *h = calloc((size_t)D, sizeof(double));
    int64_t *count = calloc((size_t)V, sizeof(int64_t));
    float *row = malloc(sizeof(float) * (size_t)(2 * D)), *q = row ? row + D : NULL;   /* a row, its rounding */
    mq_gparams *gp = malloc(sizeof(mq_gparams) * (size_t)(D / 16 + 1));
    uint8_t *cd = malloc((size_t)D);
    if (!s && (!h || !count || !row || !q || !gp || !cd)) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!s && (!m->lm_head || !m->final_norm))
        s = mq_err(MOEQ_E_UNSUPPORTED, "--target-bpw: the model's lm_head is not held as floats");
    for (int64_t i = 0; !s && i < set->n; i++) {
        float *xn = xs + i * T * D;
        memcpy(xn, x + i * T * D, sizeof(float) * (size_t)(set->len[i] * D));
        for (int64_t t = 0; t < set->len[i]; t++) {
            const int32_t id = set->ids[i][t];
            if (id >= 0 && id < V) count[id]++;
        }
        mq_final_norm(m, xn, set->len[i]);
        for (int64_t j = 0; j < set->len[i] * D; j++) h[j % D] += (double)xn[j] * xn[j];
    }
    double wg = 0;   /* sum_j g_j^2 |W_j|^2 */
    for (int64_t v = 0; !s && v < V; v++)
        for (int64_t j = 0; j < D; j++)
            wg += (double)m->final_norm[j] * m->final_norm[j] * m->lm_head[v * D + j] * m->lm_head[v * D + j];
    const double r = wg / (double)D;
    if (!s) {   /* the output's loss through the Linears' measure, then into the residual's unit */
        const mq_linear head = {.out = V, .in = D, .w = m->lm_head, .name = "lm_head"};
        group og;
        memset(&og, 0, sizeof og);
        linear_losses(&head, h, false, &og);
        group *o = tied ? &og : &hg[1];
        if (!tied) *o = og;
        for (int k = 0; k < N_CAND; k++) o->loss[k] = r > 0 ? o->loss[k] / r : 0;
        o->gain = 1;
        if (tied) for (int k = 0; k < N_CAND; k++) hg[0].loss[k] += og.loss[k];
    }
    for (int k = 0; !s && k < N_CAND; k++) {   /* token_embd: the probe's rows */
        const int eff = mq_gguf_fallback(cand[k], D);
        hg[0].bits[k] += (eff >= 0 ? mq_kq_bpw((mq_kq_type)eff) : 16.0) * (double)(V * D);
        if (eff < 0) continue;
        const mq_kq_info *t = mq_kq_info_of((mq_kq_type)eff);
        const mq_qspec sp = mq_kq_spec((mq_kq_type)eff);
        double e = 0;
        for (int32_t v = 0; v < V && !s; v++) {
            if (!count[v]) continue;
            s = mq_lazy_embed(p->lz, &v, 1, row);
            mq_kq_quantize_row(t, &sp, row, D, NULL, gp, cd);
            mq_kq_dequant_row(t, gp, cd, D, q);
            double ev = 0, ms = 0;
            for (int64_t j = 0; j < D; j++) {
                ev += ((double)row[j] - q[j]) * ((double)row[j] - q[j]);
                ms += (double)row[j] * row[j];
            }
            if (ms > 0) e += ev / (ms / (double)D) * (double)count[v];
        }
        hg[0].loss[k] += e;
    }
    hg[0].params = V * D;
    hg[0].used = !s;
    hg[1].used = !s && !tied;
    hg[0].gain = 1;
    mq_lazy_release(p->lz, -1, what, 0, 0);
    free(h);
    free(count);
    free(row);
    free(gp);
    free(cd);
    return s;
}

moeq_status mq_pipe_kquant_budget(mq_pipe *p) {
    const mq_pipeline_opts *o = p->o;
    if (!p->lz)
        return mq_err(MOEQ_E_ARG, "--target-bpw measures each tensor's sensitivity on the calibration text "
                      "(--method gptq --calib FILE)");
    const moeq_model *m = p->m;
    const mq_config *c = &m->cfg;
    const int L = c->n_layers;
    const double t0 = mq_now();
    mq_calib_opts co = o->calib;
    co.nsamples = co.nsamples < PROBE_SAMPLES ? co.nsamples : PROBE_SAMPLES;
    mq_calib_set set;
    memset(&set, 0, sizeof set);
    moeq_status s = mq_calib_load(moeq_model_tokenizer(m), &co, &set);
    if (s) return s;
    const int64_t S = set.n, T = co.seqlen;
    const size_t NG = (size_t)L * MQ_GCAT_COUNT + 2;   /* the layers' groups, token_embd, output */
    group *gs = calloc(NG, sizeof *gs);
    float *x = mq_alloc_array((size_t)(S * T), (size_t)c->D * sizeof(float), "--target-bpw probe");
    float *xin = mq_alloc_array((size_t)(S * T), (size_t)c->D * sizeof(float), "--target-bpw probe");
    float *xs = mq_alloc_array((size_t)(S * T), (size_t)c->D * sizeof(float), "--target-bpw probe");
    mq_state *st = NULL;
    if (!gs || !x || !xin || !xs) s = mq_err(MOEQ_E_NOMEM, "out of memory for the --target-bpw probe");
    if (!s) s = mq_state_new(m, (int32_t)T, &st);
    for (int64_t i = 0; i < S && !s; i++) s = mq_lazy_embed(p->lz, set.ids[i], set.len[i], x + i * T * c->D);
    for (int l = 0; l < L && !s; l++) {
        if (moeq_interrupted()) s = mq_err(MOEQ_E_INTERRUPTED, "interrupted");
        if (!s) s = probe_layer(p, st, x, xin, xs, set.len, S, T, l, gs);
        mq_progress("sensitivity", l + 1, L);
    }
    if (!s) s = head_losses(p, x, xs, &set, T, gs + (size_t)L * MQ_GCAT_COUNT);
    mq_state_free(st);
    mq_free(x);
    mq_free(xin);
    mq_free(xs);
    mq_calib_free(&set);
    for (size_t i = 0; i < NG && gs; i++)   /* losses in the residual's unit */
        for (int k = 0; k < N_CAND; k++) gs[i].loss[k] *= gs[i].gain;
    /* the knapsack */
    int64_t total = 0;
    double bits = 0;
    for (size_t i = 0; !s && i < NG; i++) {
        const group *g = &gs[i];
        if (!g->used) continue;
        total += g->params;
        bits += g->bits[0];
    }
    /* the rest of the file (norms, routers, biases) in F32: the parameters the model holds
     * besides the embeddings and the quantized Linears */
    int64_t all = 0, active = 0;
    mq_config_param_counts(c, &all, &active);
    const int64_t rest = all > total ? all - total : 0;
    bits += 32.0 * (double)rest;
    total += rest;
    const double budget = o->target_bpw * (double)total;
    if (!s && bits > budget)
        s = mq_err(MOEQ_E_ARG, "--target-bpw %g: the smallest file of these types holds %.3f bits per parameter",
                   o->target_bpw, bits / (double)total);
    while (!s) {   /* the upgrade removing most loss per added bit that still fits */
        double best = 0, add = 0;
        group *bg = NULL;
        int bk = -1;
        for (size_t i = 0; i < NG; i++) {
            group *g = &gs[i];
            for (int k = g->used ? g->pick + 1 : N_CAND; k < N_CAND; k++) {
                const double db = g->bits[k] - g->bits[g->pick];
                /* an upgrade that costs no bits (two fallbacks of one size, IQ4_NL and Q4_0) is
                 * taken first where it lowers the loss */
                const double dl = g->loss[g->pick] - g->loss[k];
                const double gain = db > 0 ? dl / db : db == 0 && dl > 0 ? HUGE_VAL : 0;
                if (bits + db <= budget && gain > best) best = gain, bg = g, bk = k, add = db;
            }
        }
        if (!bg) break;
        bg->pick = bk;
        bits += add;
    }
    if (!s) {
        p->recipe_table = malloc((size_t)L * MQ_GCAT_COUNT + 2);
        if (!p->recipe_table) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    if (!s) {
        p->budget_json = cJSON_CreateObject();
        cJSON *arr = p->budget_json ? cJSON_AddArrayToObject(p->budget_json, "tensors") : NULL;
        for (size_t i = 0; i < NG; i++) {   /* the table's order: the layers' groups, token_embd, output */
            const group *g = &gs[i];
            const int l = i < (size_t)L * MQ_GCAT_COUNT ? (int)(i / MQ_GCAT_COUNT) : -1;
            const mq_gguf_cat k = l >= 0 ? (mq_gguf_cat)(i % MQ_GCAT_COUNT)
                                  : i == NG - 2 ? MQ_GCAT_TOKEN_EMBD : MQ_GCAT_OUTPUT;
            p->recipe_table[i] = (int8_t)(g->used ? cand[g->pick] : -1);
            if (!g->used || !arr) continue;
            cJSON *j = cJSON_CreateObject();
            cJSON_AddNumberToObject(j, "layer", l);
            cJSON_AddStringToObject(j, "tensor", mq_gguf_cat_name(k));
            cJSON_AddStringToObject(j, "type", mq_kq_name((mq_kq_type)cand[g->pick]));
            cJSON_AddNumberToObject(j, "params", (double)g->params);
            cJSON_AddNumberToObject(j, "residual_gain", g->gain);
            /* the sensitivity of each candidate: its RTN loss carried to the residual stream */
            cJSON *ls = cJSON_AddObjectToObject(j, "sensitivity");
            for (int c2 = 0; c2 < N_CAND; c2++) cJSON_AddNumberToObject(ls, mq_kq_name((mq_kq_type)cand[c2]), g->loss[c2]);
            cJSON_AddItemToArray(arr, j);
        }
        p->recipe.table = p->recipe_table;
        if (p->budget_json) {
            cJSON_AddNumberToObject(p->budget_json, "target_bpw", o->target_bpw);
            cJSON_AddNumberToObject(p->budget_json, "bpw", bits / (double)total);
            cJSON_AddNumberToObject(p->budget_json, "probe_samples", (double)S);
            cJSON_AddNumberToObject(p->budget_json, "seconds", mq_now() - t0);
        }
        mq_info("--target-bpw %g: %.4f bits per parameter planned (%lld parameters), types chosen by each "
                "group's RTN loss carried to the residual stream, %lld probe samples, %.1f s", o->target_bpw, bits / (double)total,
                (long long)total, (long long)S, mq_now() - t0);
        for (int l = 0; l < L; l++) {
            char line[512];
            int n = 0;
            for (int k = 0; k < MQ_GCAT_COUNT && n < (int)sizeof line - 40; k++) {
                const int8_t t = p->recipe_table[(size_t)l * MQ_GCAT_COUNT + k];
                if (t >= 0) n += snprintf(line + n, sizeof line - (size_t)n, " %s %s", mq_gguf_cat_name((mq_gguf_cat)k),
                                          mq_kq_name((mq_kq_type)t));
            }
            mq_info("  layer %d:%s", l, line);
        }
        const int te = mq_gguf_recipe_type(&p->recipe, MQ_GCAT_TOKEN_EMBD, -1, c->D);
        const int to = mq_gguf_recipe_type(&p->recipe, MQ_GCAT_OUTPUT, -1, c->D);
        mq_info("  token_embd %s%s%s", te >= 0 ? mq_kq_name((mq_kq_type)te) : "-",
                p->recipe.tied ? " (tied: the output too)" : ", output ",
                p->recipe.tied ? "" : to >= 0 ? mq_kq_name((mq_kq_type)to) : "-");
    }
    free(gs);
    return s;
}
