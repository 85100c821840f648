/*
 * GPTQ on weights W [N, K] with input Hessian H [K, K] (Frantar et al., arXiv 2210.17323;
 * IST-DASLab gptq.py; torchao prototype/gptq: ../shared/docs/torchao_gptq.md sections 3-6).
 *
 * Factor: dead columns (diag 0 -> H_ii = 1, W[:, i] = 0), optional act-order permutation,
 * damping percdamp * mean(diag) (doubled and retried while Cholesky fails), then U with
 * U^T U = H^-1, U upper. The reference computes U = chol(cholesky_inverse(chol(H)), upper). We
 * take the lower Cholesky factor of H with rows and columns reversed, which rotated by 180
 * degrees is an upper R with H = R R^T; then H^-1 = R^-T R^-1, so U = R^-1 (uniqueness of the
 * Cholesky factor) at half the cost: one Cholesky and one triangular inverse, both blocked over
 * fixed tiles on the pool (so a single large Hessian uses every core, deterministically).
 *
 * Column loop: rows are independent, so a task takes a fixed block of rows (mq_gptq_row_block) through all
 * K columns, holding them transposed (Wt[p][i]: one column is contiguous over the rows). Three
 * levels of blocking: blocks of block_size columns whose errors update the trailing columns in
 * one GEMM (the lazy batch update); sub-blocks of SUB_BLOCK columns whose errors update the rest
 * of their block in one GEMM; rank-1 updates inside a sub-block. Quantizing column p:
 *     q = qdq(w_p);  e = (w_p - q) / U_pp;  w_j -= U_pj e  for every later column j.
 * Group parameters are taken when a group's first column is reached, from the current weights
 * of its columns: errors of the current block not yet applied to a column are added on the fly,
 * so the result does not depend on the block sizes (up to float rounding).
 *
 * Losses: with E the matrix of the e above, W0 - Q = E U (U upper), so
 * tr((W0-Q) H' (W0-Q)^T) = ||E||^2 exactly, H' the damped matrix; the loss for the given H is
 * ||E||^2 - damp ||W0-Q||^2 (dead columns contribute nothing to either). The RTN loss is
 * ||D R||^2 - damp ||D||^2 with D = W0 - Q_rtn (one triangular multiply).
 */
#include "quant/gptq_internal.h"
#include "core/env.h"

#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

enum { SUB_BLOCK = 16 };

/* Rows per column-loop task. A row's values do not depend on how rows are grouped (test_gptq
 * checks 64, 128 and 256 give the same codes), so this only moves speed: fewer rows make more
 * tasks for a lone weight (a 4096-row weight is 16 tasks of 256, one per thread at 16) and a
 * smaller slab per thread (256 x K = 2 MB at K = 2048), more reads of U. MOEQ_DEBUG_GPTQ_ROWS (32 to
 * 512, a power of two) sets it for measurements. */
enum { ROW_BLOCK_DEFAULT = 256, ROW_BLOCK_MAX = 512 };
static int g_row_block;
static pthread_once_t g_row_once = PTHREAD_ONCE_INIT;

static void row_block_from_env(void) {
    const char *e = mq_env(MQ_ENV_GPTQ_ROWS);
    const long v = e ? strtol(e, NULL, 10) : 0;
    if (!g_row_block) g_row_block = v >= 32 && v <= ROW_BLOCK_MAX && (v & (v - 1)) == 0 ? (int)v : ROW_BLOCK_DEFAULT;
}

int mq_gptq_row_block(void) {
    pthread_once(&g_row_once, row_block_from_env);
    return g_row_block;
}

void mq_gptq_set_row_block(int rows) {
    pthread_once(&g_row_once, row_block_from_env);
    g_row_block = rows >= 1 && rows <= ROW_BLOCK_MAX ? rows : ROW_BLOCK_DEFAULT;
}


mq_gptq_opts mq_gptq_opts_default(void) {
    mq_gptq_opts o;
    memset(&o, 0, sizeof o);
    o.percdamp = 0.01;
    o.block_size = 128;
    o.act_order = false;
    o.groups = MQ_GPTQ_GROUPS_DYNAMIC;
    o.rtn_loss = true;
    return o;
}
/* ---- column loop -------------------------------------------------------------------------- */

/* Weights of the G columns at processing positions pos[0..G-1] into sc->hw; NULL when the
 * search is plain (or off). */
static const float *group_weights(const loop_state *L, const int64_t *pos) {
    if (!L->s->mse || L->mse_weight == MQ_GPTQ_MSE_PLAIN) return NULL;
    for (int64_t t = 0; t < L->G; t++) L->sc->hw[t] = column_weight(L, pos[t]);
    return L->sc->hw;
}

static void set_params(const loop_state *L, int64_t g, int64_t i, const float *x, int64_t stride,
                       const float *hw) {
    scratch *sc = L->sc;
    mq_gparams *gp = &sc->gp[g * L->nr + i];
    mq_group_params_h(L->s, L->gs, x, L->G, stride, hw, gp);
    sc->step[g * L->nr + i] = mq_group_step(L->s, L->gs, gp);
    sc->zero[g * L->nr + i] = gp->zero;
}

/* GPTQ's in-loop scale search for every row of group g (MQ_GPTQ_MSE_LOOP): each candidate of
 * the MSE grid is scored by quantizing the group's columns in processing order with the error of
 * each fed back to the group's later columns (mq_gptq_loop_scores), as the loop will do. The
 * first least score wins. x [G][nr]: the group's current values, column t at x[t * nr].
 * ucol/ord: see prepare_loop_search. Rows with fewer candidates repeat their last one, which is
 * scored but cannot win again. */
static void set_params_loop(const loop_state *L, int64_t g, const float *x) {
    scratch *sc = L->sc;
    const int64_t G = L->G, nr = L->nr;
    mq_gparams *gp = &sc->gp[g * nr];
    const int64_t nk = L->ncand;
    /* the candidates' steps by candidate, so that the scores of candidate k read one vector;
     * rows with fewer candidates repeat their last one (none: the plain params) */
    const int nmax = mq_group_candidates_rows(L->s, L->gs, x, G, nr, nr, gp, sc->cand, nk, sc->nc,
                                              sc->kstep, sc->kzero);
    for (int64_t i = 0; i < nr; i++) {
        const int last = sc->nc[i] > 0 ? sc->nc[i] - 1 : 0;
        for (int k = last + 1; k < nmax; k++) {
            sc->kstep[k * nr + i] = sc->kstep[last * nr + i];
            sc->kzero[k * nr + i] = sc->kzero[last * nr + i];
        }
        sc->best[i] = INFINITY;
        sc->bestk[i] = -1;
    }
    for (int64_t a = 0; a < G; a++)
        memcpy(sc->wl + a * nr, x + sc->ord[a] * nr, (size_t)nr * sizeof(float));
    for (int k = 0; k < nmax; k++) {
        L->loop_scores(L->s, sc->ucol, G, sc->wl, nr, nr, sc->kstep + k * nr, sc->kzero + k * nr,
                       sc->lwork, sc->lcode, sc->score);
        for (int64_t i = 0; i < nr; i++) {   /* branch-free: which row wins is random */
            const bool win = k < sc->nc[i] && sc->score[i] < sc->best[i];
            sc->best[i] = win ? sc->score[i] : sc->best[i];
            sc->bestk[i] = win ? k : sc->bestk[i];
        }
    }
    for (int64_t i = 0; i < nr; i++) {
        const int k = sc->bestk[i];
        if (k >= 0) gp[i] = sc->cand[i * nk + k];   /* else the plain params stay */
        sc->step[g * nr + i] = k >= 0 ? sc->kstep[k * nr + i] : mq_group_step(L->s, L->gs, &gp[i]);
        sc->zero[g * nr + i] = gp[i].zero;
    }
}

/* Multiplier i of the MSE grid, as formats' search computes it. */
static inline float grid_mult(const mq_qspec *s, int32_t i) {
    return s->mse_steps == 1 ? s->mse_lo
                             : s->mse_lo + (s->mse_hi - s->mse_lo) * (float)i /
                                               (float)(s->mse_steps - 1);
}

/* The clip search (opts.clip_search: INT4 asymmetric with the in-loop scores): the two ends of
 * each group's range [min(x, 0), max(x, 0)] are clipped by multipliers of their own. Three
 * rounds over the grid m_0 .. m_(n-1), each candidate scored as set_params_loop scores: both
 * ends times m (the plain search's candidates, so the same choice), then the low end times m
 * with the high end's best multiplier, then the high end times m with the low end's best. Each
 * round contains the best so far and the first least score wins, so the result never scores
 * worse than the plain search's. */
static void set_params_clip(const loop_state *L, int64_t g, const float *x) {
    scratch *sc = L->sc;
    const mq_qspec *s = L->s;
    const int64_t G = L->G, nr = L->nr;
    mq_gparams *gp = &sc->gp[g * nr];
    for (int64_t i = 0; i < nr; i++) {
        float xmin = 0.0f, xmax = 0.0f;
        for (int64_t t = 0; t < G; t++) {
            float v = x[t * nr + i];
            xmin = v < xmin ? v : xmin;
            xmax = v > xmax ? v : xmax;
        }
        sc->xlo[i] = xmin;
        sc->xhi[i] = xmax;
        sc->blo[i] = sc->bhi[i] = 1.0f;
        sc->best[i] = INFINITY;
        mq_int4_asym_params(s, xmin, xmax, &gp[i]);   /* plain; an all-zero group keeps it */
    }
    for (int64_t a = 0; a < G; a++)
        memcpy(sc->wl + a * nr, x + sc->ord[a] * nr, (size_t)nr * sizeof(float));
    mq_gparams *cand = sc->cand;   /* one per row */
    for (int round = 0; round < 3; round++)
        for (int32_t k = 0; k < s->mse_steps; k++) {
            const float m = grid_mult(s, k);
            for (int64_t i = 0; i < nr; i++) {
                const float a = round == 2 ? sc->blo[i] : m, b = round == 1 ? sc->bhi[i] : m;
                mq_int4_asym_params(s, sc->xlo[i] * a, sc->xhi[i] * b, &cand[i]);
                sc->kstep[i] = cand[i].scale;
                sc->kzero[i] = cand[i].zero;
            }
            L->loop_scores(s, sc->ucol, G, sc->wl, nr, nr, sc->kstep, sc->kzero, sc->lwork,
                           sc->lcode, sc->score);
            for (int64_t i = 0; i < nr; i++)
                if (sc->xhi[i] > sc->xlo[i] && sc->score[i] < sc->best[i]) {
                    sc->best[i] = sc->score[i];
                    gp[i] = cand[i];
                    if (round != 2) sc->blo[i] = m;
                    if (round != 1) sc->bhi[i] = m;
                }
        }
    for (int64_t i = 0; i < nr; i++) {
        sc->step[g * nr + i] = mq_group_step(s, L->gs, &gp[i]);
        sc->zero[g * nr + i] = gp[i].zero;
    }
}

/* The group's columns (positions pos[t]) in processing order (ord) and U restricted to them
 * by column: ucol[b][a] = U[pos[ord[a]]][pos[ord[b]]] for a <= b, 0 below. */
static void prepare_loop_search(const loop_state *L, const int64_t *pos) {
    scratch *sc = L->sc;
    const int64_t G = L->G, K = L->K;
    for (int64_t t = 0; t < G; t++) {   /* insertion sort by position: G is small */
        int64_t j = t;
        for (; j > 0 && pos[sc->ord[j - 1]] > pos[t]; j--) sc->ord[j] = sc->ord[j - 1];
        sc->ord[j] = t;
    }
    for (int64_t a = 0; a < G; a++)
        for (int64_t b = 0; b < G; b++)
            sc->ucol[b * G + a] = b >= a ? L->f->U[pos[sc->ord[a]] * K + pos[sc->ord[b]]] : 0.0f;
}

/* Params of group g, first reached at position p, from the current values of its columns:
 * the stored values minus the errors of the current block that have not reached them yet. */
static void group_params_dynamic(const loop_state *L, int64_t g, int64_t p) {
    scratch *sc = L->sc;
    const int64_t nr = L->nr, K = L->K;
    int64_t *pos = sc->pos;
    for (int64_t t = 0; t < L->G; t++) {
        int64_t q = pos[t] = group_pos(L, g, t);
        float *out = sc->tmp + t * nr;
        memcpy(out, sc->wt + q * nr, (size_t)nr * sizeof(float));
        int64_t from = q < L->s1 ? p : q < L->b1 ? L->s0 : L->b0;
        for (int64_t k = from; k < p; k++) {
            float u = L->f->U[k * K + q];
            const float *e = sc->et + (k - L->b0) * nr;
            for (int64_t i = 0; i < nr; i++) out[i] -= u * e[i];
        }
    }
    if (L->s->mse && L->mse_weight == MQ_GPTQ_MSE_LOOP) {
        prepare_loop_search(L, pos);
        if (L->clip) set_params_clip(L, g, sc->tmp);
        else set_params_loop(L, g, sc->tmp);
    } else {
        const float *hw = group_weights(L, pos);
        for (int64_t i = 0; i < nr; i++) set_params(L, g, i, sc->tmp + i, nr, hw);
    }
    sc->ready[g] = 1;
}

/* Static groups: params from the original weights (dead columns zeroed), original groups. */
static void group_params_static(const loop_state *L, const float *w, int64_t r0) {
    scratch *sc = L->sc;
    const int64_t K = L->K, G = L->G;
    for (int64_t g = 0; g < K / G; g++) {
        for (int64_t t = 0; t < G; t++) sc->pos[t] = pos_of(L->f, g * G + t);
        if (L->s->mse && L->mse_weight == MQ_GPTQ_MSE_LOOP) {
            prepare_loop_search(L, sc->pos);
            for (int64_t t = 0; t < G; t++)
                for (int64_t i = 0; i < L->nr; i++)
                    sc->tmp[t * L->nr + i] = L->f->dead[g * G + t] ? 0.0f : w[(r0 + i) * K + g * G + t];
            if (L->clip) set_params_clip(L, g, sc->tmp);
            else set_params_loop(L, g, sc->tmp);
            continue;
        }
        const float *hw = group_weights(L, sc->pos);
        for (int64_t i = 0; i < L->nr; i++) {
            const float *row = w + (r0 + i) * K;
            for (int64_t t = 0; t < G; t++)
                sc->tmp[t] = L->f->dead[g * G + t] ? 0.0f : row[g * G + t];
            set_params(L, g, i, sc->tmp, 1, hw);
        }
    }
    memset(sc->ready, 1, (size_t)(K / G));
}

/* RTN loss terms of this row block (see the file comment). */
static void rtn_loss_rows(const loop_state *L, const float *w, int64_t r0, task_out *out) {
    scratch *sc = L->sc;
    const int64_t K = L->K, G = L->G, nr = L->nr;
    double dsq = 0;
    for (int64_t i = 0; i < nr; i++) {
        const float *row = w + (r0 + i) * K;
        float *d = sc->d + i * K;
        if (L->s->scheme == MQ_QS_KQUANT) {   /* the loop's working copy is free by now */
            float *q = sc->wt;
            mq_gptq_kq_rtn_row(L->s, row, K, q);
            for (int64_t c = 0; c < K; c++) {
                float v = L->f->dead[c] ? 0.0f : row[c] - q[c];
                d[pos_of(L->f, c)] = v;
                dsq += (double)v * v;
            }
            continue;
        }
        for (int64_t g = 0; g < K / G; g++) {
            mq_gparams gp;
            mq_group_params(L->s, L->gs, row + g * G, G, 1, &gp);
            float step = mq_group_step(L->s, L->gs, &gp);
            for (int64_t c = g * G; c < (g + 1) * G; c++) {
                uint8_t code;
                float q;
                mq_gptq_qdq_column(L->s, &step, &gp.zero, row + c, 1, &code, &q);
                float v = L->f->dead[c] ? 0.0f : row[c] - q;
                d[pos_of(L->f, c)] = v;
                dsq += (double)v * v;
            }
        }
    }
    cblas_strmm(CblasRowMajor, CblasRight, CblasUpper, CblasNoTrans, CblasNonUnit, (int)nr, (int)K,
                1.0f, L->f->R, (int)K, sc->d, (int)K);
    double e2 = 0;
    for (int64_t i = 0; i < nr * K; i++) e2 += (double)sc->d[i] * sc->d[i];
    out->rtn_e2 = e2;
    out->rtn_dsq = dsq;
}

/* Transposed, permuted load of the row block: Wt[pos(c)][i] = W[r0+i][c], dead columns 0; a
 * second copy keeps the original values (W0'). Tiles of 16 rows keep the scattered writes within
 * a few cache lines. */
static void load_rows(const loop_state *L, const float *w, int64_t r0) {
    const int64_t K = L->K, nr = L->nr;
    float *wt = L->sc->wt;
    for (int64_t i0 = 0; i0 < nr; i0 += 16) {
        int64_t i1 = i0 + 16 < nr ? i0 + 16 : nr;
        for (int64_t c = 0; c < K; c++) {
            float *dst = wt + pos_of(L->f, c) * nr;
            const float *src = w + r0 * K + c;
            bool dead = L->f->dead[c];
            for (int64_t i = i0; i < i1; i++) dst[i] = dead ? 0.0f : src[i * K];
        }
    }
    memcpy(L->sc->w0t, wt, (size_t)(K * nr) * sizeof(float));
}

/* out[i][c] = in[pos(c)][i]: transposed block back to rows in the original column order. */
#define DEFINE_UNLOAD(name, type)                                                                  \
    static void name(const loop_state *L, const type *in, type *out, int64_t ld_out) {            \
        const int64_t K = L->K, nr = L->nr;                                                        \
        for (int64_t i0 = 0; i0 < nr; i0 += 16) {                                                  \
            int64_t i1 = i0 + 16 < nr ? i0 + 16 : nr;                                              \
            for (int64_t c = 0; c < K; c++) {                                                      \
                const type *src = in + pos_of(L->f, c) * nr;                                       \
                for (int64_t i = i0; i < i1; i++) out[i * ld_out + c] = src[i];                    \
            }                                                                                      \
        }                                                                                          \
    }
DEFINE_UNLOAD(unload_codes, uint8_t)
DEFINE_UNLOAD(unload_floats, float)

/* Writes codes, params and (if wanted) the dequantized rows of the block to the job's outputs. */
static void store_rows(const loop_state *L, mq_gptq_job *j, int64_t r0) {
    scratch *sc = L->sc;
    const int64_t K = L->K, nr = L->nr;
    mq_qtensor *qt = j->out;
    const int64_t ng = qt->n_groups;
    unload_codes(L, sc->ct, qt->codes + r0 * K, K);
    if (j->deq) unload_floats(L, sc->w0t, j->deq + r0 * K, K);
    for (int64_t i = 0; i < nr; i++)
        for (int64_t g = 0; g < ng; g++) qt->params[(r0 + i) * ng + g] = sc->gp[g * nr + i];
}

/* The refinement (opts.refine_passes): cyclic coordinate descent on GPTQ's own objective
 * tr((W0' - Q) H' (W0' - Q)^T) over the codes, the group parameters fixed (QuantEase, arXiv
 * 2309.01885, on top of GPTQ). With D = W0' - Q and G = D H', the objective as a function of one
 * value q_p of a row is h (q_p - t)^2 + const, t = q_p + G_p / h, h = H'_pp; the nearest value
 * of the group's grid to t (its quantize-dequantize) is the best, so no step raises the
 * objective. A changed value updates the row's G by -(q' - q) H'_p (a rank-1 update over the
 * block). Passes go over the columns in processing order; the row block's share of the loss is
 * then recomputed from scratch (one GEMM), so the stats are exact. Dead columns stay zero. */
/* A group's stored scale for the step `step` (NVFP4: the nearest E4M3 code of the block scale in
 * the spec's convention; INT4: the nearest value of the scale's dtype). false if there is none
 * (a zero or out-of-range result). */
static bool step_params(const mq_qspec *s, float gs, float step, mq_gparams *out) {
    if (s->scheme == MQ_QS_INT4) {   /* signed scales may be negative */
        float v = mq_round_to_dtype(step, s->scale_dtype);
        if (!(s->int4_signed_scale ? v != 0 : v > 0) || !isfinite(v)) return false;
        out->scale = v;
        return true;
    }
    if (!(step > 0) || !isfinite(step)) return false;
    if (s->scheme != MQ_QS_NVFP4) return false;
    float t = s->nvfp4_conv == MQ_NVFP4_MUL ? step / gs : step * gs;
    if (t < s->nvfp4_scale_min || t > 448.0f) return false;
    uint8_t code = mq_e4m3_encode(t);
    if (code == 0) return false;
    out->scale_code = code;
    out->scale = mq_e4m3_decode(code);
    return true;
}

/* The scale step of the refinement (opts.refine_scales): with the codes fixed a group's values
 * are its step times fixed unit values c (NVFP4: E2M1 values; INT4: code - zero), and the
 * objective is the quadratic den (s - s*)^2 + const in the step s, s* = s + (c . G) / (c H' c^T)
 * over the group's columns; the stored scale nearest to s* (the best of the representable ones)
 * replaces the current one when it lowers the objective. Then Q, D and G follow. (Re-choosing
 * the codes with each of the neighbouring scales was measured too: no better, 3x slower.) */
static void refine_scales(const loop_state *L, float *q) {
    scratch *sc = L->sc;
    const mq_gptq_factor *f = L->f;
    const int64_t K = L->K, nr = L->nr, G = L->G;
    int64_t *pos = sc->pos;
    for (int64_t g = 0; g < K / G; g++) {
        for (int64_t t = 0; t < G; t++) pos[t] = group_pos(L, g, t);
        for (int64_t t = 0; t < G; t++)
            for (int64_t u = 0; u < G; u++) sc->hsub[t * G + u] = f->Hp[pos[t] * K + pos[u]];
        for (int64_t t = 0; t < G; t++) {
            const bool dead = f->dead[col_of(f, pos[t])];
            const uint8_t *cp = sc->ct + pos[t] * nr;
            float *cv = sc->cv + t * nr;
            for (int64_t i = 0; i < nr; i++) {
                const mq_gparams *gp = &sc->gp[g * nr + i];
                cv[i] = dead ? 0.0f
                        : L->s->scheme == MQ_QS_INT4
                            ? (L->s->asym ? (float)cp[i] - gp->zero : (float)cp[i] - 8.0f)
                            : mq_e2m1_decode(cp[i]);
            }
        }
        bool any = false;
        for (int64_t i = 0; i < nr; i++) {
            double num = 0, den = 0;
            for (int64_t t = 0; t < G; t++) {
                const double ct = sc->cv[t * nr + i];
                if (ct == 0) continue;
                num += ct * sc->gt[pos[t] * nr + i];
                for (int64_t u = 0; u < G; u++) den += ct * sc->cv[u * nr + i] * sc->hsub[t * G + u];
            }
            float *stp = &sc->step[g * nr + i];
            for (int64_t t = 0; t < G; t++) sc->dv[t * nr + i] = 0.0f;
            if (!(den > 0) || *stp == 0.0f) continue;
            mq_gparams np = sc->gp[g * nr + i];
            if (!step_params(L->s, L->gs, (float)(*stp + num / den), &np)) continue;
            const float ns = mq_group_step(L->s, L->gs, &np);
            const double d = (double)ns - *stp;
            if (!(-2.0 * d * num + d * d * den < 0)) continue;
            sc->gp[g * nr + i] = np;
            *stp = ns;
            for (int64_t t = 0; t < G; t++) {
                float *qv = &q[pos[t] * nr + i];
                const float v = sc->cv[t * nr + i] * ns;   /* the dequantization's product */
                sc->dv[t * nr + i] = v - *qv;
                sc->wt[pos[t] * nr + i] -= v - *qv;
                *qv = v;
            }
            any = true;
        }
        if (!any) continue;
        for (int64_t k = 0; k < K; k++)
            for (int64_t t = 0; t < G; t++) sc->hcols[k * G + t] = f->Hp[k * K + pos[t]];
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)K, (int)nr, (int)G, -1.0f,
                    sc->hcols, (int)G, sc->dv, (int)nr, 1.0f, sc->gt, (int)nr);
    }
}

static void refine_rows(const loop_state *L, const run_ctx *c, const float *w, int64_t r0,
                        task_out *out) {
    scratch *sc = L->sc;
    const mq_gptq_factor *f = L->f;
    const int64_t K = L->K, nr = L->nr, G = L->G;
    load_rows(L, w, r0);   /* wt = W0'; w0t too, so Q is restored from the codes */
    float *q = sc->w0t;
    for (int64_t p = 0; p < K; p++) {
        const int64_t g = L->gidx ? p / G : col_of(f, p) / G;
        float *qp = q + p * nr;
        const uint8_t *cp = sc->ct + p * nr;
        mq_dequant_n(L->s, L->gs, &sc->gp[g * nr], cp, nr, qp);   /* dead: the code's value too */
    }
    /* D into wt (wt = W0' - Q), then Gt = H' Dt. The column loop left W0 - Q = E U (U upper,
     * U^T U = H'^-1), so H' Dt = U^-1 U^-T U^T Et = R Et: one triangular product on the kept E,
     * half the flops of H' Dt (which is used where the factor has no R) */
    for (int64_t i = 0; i < K * nr; i++) sc->wt[i] -= q[i];
    if (f->R)
        cblas_strmm(CblasRowMajor, CblasLeft, CblasUpper, CblasNoTrans, CblasNonUnit, (int)K, (int)nr,
                    1.0f, f->R, (int)K, sc->gt, (int)nr);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)K, (int)nr, (int)K, 1.0f, f->Hp,
                    (int)K, sc->wt, (int)nr, 0.0f, sc->gt, (int)nr);
    /* the loop's buffers, free now: t and qn [nr], dlt [B][nr] the changes of a block */
    float *t = sc->dq, *qn = sc->tmp, *dlt = sc->et;
    const int64_t B = c->block < K ? c->block : K;
    for (int pass = 0; pass < c->o->refine_passes; pass++) {
        /* blocks of B columns, as GPTQ's lazy updates: a change updates G's rows of its block at
         * once (rank 1), the other rows get the block's changes in one GEMM at its end */
        for (int64_t b0 = 0; b0 < K; b0 += B) {
            const int64_t b1 = b0 + B < K ? b0 + B : K;
            bool block_any = false;
            for (int64_t p = b0; p < b1; p++) {
                float *dl = dlt + (p - b0) * nr;
                memset(dl, 0, (size_t)nr * sizeof(float));
                if (f->dead[col_of(f, p)]) continue;
                const int64_t g = L->gidx ? p / G : col_of(f, p) / G;
                const float h = f->Hp[p * K + p];
                float *qp = q + p * nr, *dp = sc->wt + p * nr, *gp = sc->gt + p * nr;
                uint8_t *cp = sc->ct + p * nr;
                for (int64_t i = 0; i < nr; i++) t[i] = qp[i] + gp[i] / h;
                uint8_t code[ROW_BLOCK_MAX];
                L->qdq(L->s, sc->step + g * nr, sc->zero + g * nr, t, nr, code, qn);
                bool any = false;
                for (int64_t i = 0; i < nr; i++) {
                    const float delta = qn[i] - qp[i];
                    dl[i] = delta;
                    if (delta != 0.0f) {
                        any = true;
                        qp[i] = qn[i];
                        cp[i] = code[i];
                        dp[i] -= delta;
                    }
                }
                if (!any) continue;
                block_any = true;
                /* G -= delta H'_p on the block's rows: row k of Gt gets -H'_pk delta */
                cblas_sger(CblasRowMajor, (int)(b1 - b0), (int)nr, -1.0f, f->Hp + p * K + b0, 1, dl, 1,
                           sc->gt + b0 * nr, (int)nr);
            }
            if (!block_any) continue;
            /* the other rows: Gt[k] -= sum over the block's p of H'_kp dlt[p] */
            if (b0 > 0)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)b0, (int)nr, (int)(b1 - b0),
                            -1.0f, f->Hp + b0, (int)K, dlt, (int)nr, 1.0f, sc->gt, (int)nr);
            if (b1 < K)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)(K - b1), (int)nr,
                            (int)(b1 - b0), -1.0f, f->Hp + b1 * K + b0, (int)K, dlt, (int)nr, 1.0f,
                            sc->gt + b1 * nr, (int)nr);
        }
        /* a K-quant sub-block's step is a multiple of its block's fp16 scale: kept */
        if (c->o->refine_scales && L->s->scheme != MQ_QS_KQUANT) refine_scales(L, q);
    }
    /* the objective ||D R||^2 = tr(D H' D^T): G = H' D was kept up to date with every change of
     * D (its rounding drifts by far less than the digits the loss is reported with), so no
     * K^2 x rows product from scratch (a quarter of the refinement's time) */
    double e2 = 0, dsq = 0;
    for (int64_t i = 0; i < K * nr; i++) {
        e2 += (double)sc->wt[i] * sc->gt[i];
        dsq += (double)sc->wt[i] * sc->wt[i];
    }
    out->e2 = e2;
    out->dsq = dsq;
}

static void run_task(void *vctx, int64_t task, int thread) {
    run_ctx *c = vctx;
    if (moeq_interrupted()) return;
    double t0 = mq_now();
    task = c->order[task];
    const task_ref *tr = &c->tasks[task];
    mq_gptq_job *j = &c->jobs[tr->job];
    const mq_gptq_factor *f = j->f;
    scratch *sc = &c->scr[thread];
    mq_qtensor *qt = j->out;
    const int64_t K = f->K, r0 = tr->rb * c->rows;
    const int64_t nr = j->rows - r0 < c->rows ? j->rows - r0 : c->rows;
    const int64_t G = qt->group_size, ng = qt->n_groups, B = c->block;
    const float *U = f->U;
    const mq_qspec *s = j->spec ? j->spec : c->s;
    const bool kq = s->scheme == MQ_QS_KQUANT;
    loop_state L = {s, f, sc, K, nr, G, qt->global_scale,
                    c->o->act_order && c->o->groups == MQ_GPTQ_GROUPS_GIDX, c->o->mse_weight,
                    s->mse_steps > 1 ? s->mse_steps : 1, c->loop_scores,
                    c->o->clip_search && s->mse && c->o->mse_weight == MQ_GPTQ_MSE_LOOP,
                    kq ? mq_gptq_qdq_column : c->qdq,   /* the SIMD twins know INT4 and NVFP4 */
                    0, 0, 0, 0};
    task_out *out = &c->outs[task];

    load_rows(&L, j->w, r0);
    memset(sc->ready, 0, (size_t)ng);
    if (c->o->groups == MQ_GPTQ_GROUPS_STATIC) {
        if (kq) mq_gptq_kq_params_static(&L, j->w, r0);
        else group_params_static(&L, j->w, r0);
    }

    /* the refinement's G = H'D is R E (below): the scaled errors E are kept for it */
    const bool keep_e = c->o->refine_passes > 0 && f->R;
    double e2 = 0, dsq = 0;
    for (L.b0 = 0; L.b0 < K; L.b0 = L.b1) {
        L.b1 = L.b0 + B < K ? L.b0 + B : K;
        for (L.s0 = L.b0; L.s0 < L.b1; L.s0 = L.s1) {
            L.s1 = L.s0 + SUB_BLOCK < L.b1 ? L.s0 + SUB_BLOCK : L.b1;
            for (int64_t p = L.s0; p < L.s1; p++) {
                const int64_t g = L.gidx ? p / G : col_of(f, p) / G;
                if (sc->ready[g] != 1) {
                    if (kq) mq_gptq_kq_params_dynamic(&L, g, p);
                    else group_params_dynamic(&L, g, p);
                }
                float *x = sc->wt + p * nr, *e = sc->et + (p - L.b0) * nr;
                L.qdq(s, sc->step + g * nr, sc->zero + g * nr, x, nr, sc->ct + p * nr, sc->dq);
                e2 += c->errors(x, sc->dq, U[p * K + p], sc->w0t + p * nr, nr, e, &dsq);
                if (keep_e) memcpy(sc->gt + p * nr, e, (size_t)nr * sizeof(float));
                if (p + 1 < L.s1)   /* rank-1 update of the rest of the sub-block */
                    cblas_sger(CblasRowMajor, (int)(L.s1 - p - 1), (int)nr, -1.0f, U + p * K + p + 1,
                               1, e, 1, sc->wt + (p + 1) * nr, (int)nr);
            }
            if (L.s1 < L.b1)
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)(L.b1 - L.s1), (int)nr,
                            (int)(L.s1 - L.s0), -1.0f, U + L.s0 * K + L.s1, (int)K,
                            sc->et + (L.s0 - L.b0) * nr, (int)nr, 1.0f, sc->wt + L.s1 * nr,
                            (int)nr);
        }
        if (L.b1 < K)
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)(K - L.b1), (int)nr,
                        (int)(L.b1 - L.b0), -1.0f, U + L.b0 * K + L.b1, (int)K, sc->et, (int)nr,
                        1.0f, sc->wt + L.b1 * nr, (int)nr);
    }
    out->e2 = e2;
    out->dsq = dsq;
    if (c->o->refine_passes > 0) refine_rows(&L, c, j->w, r0, out);
    /* A dead column (H_ii = 0, set to 1 in H') holds the grid value nearest 0, which is 0 but on
     * an asymmetric K-quant grid: its q^2 (1 + damp) in e2 and q^2 in dsq are in no loss for H */
    for (int64_t cd = 0; cd < K && f->n_dead > 0; cd++) {
        if (!f->dead[cd]) continue;
        const float *qd = sc->w0t + pos_of(f, cd) * nr;
        for (int64_t i = 0; i < nr; i++) out->e2 -= (double)qd[i] * qd[i];
    }
    if (c->o->rtn_loss) rtn_loss_rows(&L, j->w, r0, out);
    store_rows(&L, j, r0);   /* the last use of these rows of w: deq may be w itself */
    out->seconds = mq_now() - t0;
    int64_t done = atomic_fetch_add(&c->done, 1) + 1;
    const mq_gptq_opts *o = c->o;
    if (thread == 0 && o->progress_label)   /* thread 0 is the caller's */
        mq_progress(o->progress_label, o->progress_base + o->progress_span * done / c->n_tasks,
                    o->progress_total);
}

static void scratch_free(scratch *s, int n) {
    if (!s) return;
    for (int i = 0; i < n; i++) {
        MQ_RELEASE_EACH(s[i].wt, s[i].et, s[i].tmp, s[i].dq, s[i].ct, s[i].gp, s[i].step, s[i].zero, s[i].ready,
                        s[i].d, s[i].w0t, s[i].hw, s[i].pos, s[i].ucol, s[i].ord, s[i].wl, s[i].lwork,
                        s[i].lcode, s[i].cand, s[i].nc, s[i].kstep, s[i].kzero, s[i].bestk, s[i].score,
                        s[i].best, s[i].gt, s[i].hsub, s[i].hcols, s[i].cv, s[i].dv, s[i].xlo, s[i].xhi,
                        s[i].blo, s[i].bhi);
    }
    free(s);
}

/* loop: the in-loop scale search's buffers too (ncand candidates per row). */
static scratch *scratch_new(int n, int64_t rows, int64_t K, int64_t B, int64_t G, int64_t ng, bool rtn,
                            bool loop, int64_t ncand, bool refine) {
    scratch *s = calloc((size_t)n, sizeof *s);
    if (!s) {
        mq_err(MOEQ_E_NOMEM, "GPTQ scratch");
        return NULL;
    }
    const size_t rb = (size_t)rows;
    for (int i = 0; i < n; i++) {
        s[i].wt = mq_alloc_array((size_t)K * rb, sizeof(float), "GPTQ working weights");
        s[i].et = mq_alloc_array((size_t)B * rb, sizeof(float), "GPTQ errors");
        s[i].tmp = mq_alloc_array((size_t)G * rb, sizeof(float), "GPTQ group values");
        s[i].dq = mq_alloc_array(rb, sizeof(float), "GPTQ column");
        s[i].ct = mq_alloc((size_t)K * rb, "GPTQ codes");
        s[i].gp = mq_alloc_array((size_t)ng * rb, sizeof(mq_gparams), "GPTQ group params");
        s[i].step = mq_alloc_array((size_t)ng * rb, sizeof(float), "GPTQ group steps");
        s[i].zero = mq_alloc_array((size_t)ng * rb, sizeof(float), "GPTQ group zeros");
        s[i].ready = mq_alloc((size_t)ng, "GPTQ group flags");
        s[i].w0t = mq_alloc_array((size_t)K * rb, sizeof(float), "GPTQ original weights");
        if (rtn) s[i].d = mq_alloc_array((size_t)K * rb, sizeof(float), "GPTQ RTN residual");
        if (refine) {
            s[i].gt = mq_alloc_array((size_t)K * rb, sizeof(float), "GPTQ refinement");
            s[i].hsub = mq_alloc_array((size_t)(G * G), sizeof(float), "GPTQ refinement");
            s[i].hcols = mq_alloc_array((size_t)(K * G), sizeof(float), "GPTQ refinement");
            s[i].cv = mq_alloc_array((size_t)G * rb, sizeof(float), "GPTQ refinement");
            s[i].dv = mq_alloc_array((size_t)G * rb, sizeof(float), "GPTQ refinement");
        }
        s[i].hw = mq_alloc_array((size_t)G, sizeof(float), "GPTQ column weights");
        s[i].pos = mq_alloc_array((size_t)G, sizeof(int64_t), "GPTQ group columns");
        if (loop) {
            s[i].ucol = mq_alloc_array((size_t)(G * G), sizeof(float), "GPTQ group factor");
            s[i].ord = mq_alloc_array((size_t)G, sizeof(int64_t), "GPTQ group order");
            s[i].wl = mq_alloc_array((size_t)G * rb, sizeof(float), "GPTQ group values");
            s[i].lwork = mq_alloc_array((size_t)(G + 2) * rb, sizeof(float), "GPTQ group errors");
            s[i].lcode = mq_alloc(rb, "GPTQ group codes");
            s[i].cand = mq_alloc_array((size_t)ncand * rb, sizeof(mq_gparams), "GPTQ scale candidates");
            s[i].nc = mq_alloc_array(rb, sizeof(int), "GPTQ candidate counts");
            s[i].kstep = mq_alloc_array((size_t)ncand * rb, sizeof(float), "GPTQ candidate steps");
            s[i].kzero = mq_alloc_array((size_t)ncand * rb, sizeof(float), "GPTQ candidate zeros");
            s[i].bestk = mq_alloc_array(rb, sizeof(int), "GPTQ best candidates");
            s[i].score = mq_alloc_array(rb, sizeof(double), "GPTQ candidate scores");
            s[i].best = mq_alloc_array(rb, sizeof(double), "GPTQ best scores");
            s[i].xlo = mq_alloc_array(rb, sizeof(float), "GPTQ clip search");
            s[i].xhi = mq_alloc_array(rb, sizeof(float), "GPTQ clip search");
            s[i].blo = mq_alloc_array(rb, sizeof(float), "GPTQ clip search");
            s[i].bhi = mq_alloc_array(rb, sizeof(float), "GPTQ clip search");
        }
        bool loop_ok = !loop || (s[i].ucol && s[i].ord && s[i].wl && s[i].lwork && s[i].lcode &&
                                 s[i].cand && s[i].nc && s[i].kstep && s[i].kzero && s[i].bestk &&
                                 s[i].score && s[i].best && s[i].xlo && s[i].xhi && s[i].blo &&
                                 s[i].bhi);
        if (!s[i].wt || !s[i].et || !s[i].tmp || !s[i].dq || !s[i].ct || !s[i].gp ||
            !s[i].step || !s[i].zero || !s[i].ready || !s[i].w0t || (rtn && !s[i].d) ||
            (refine && (!s[i].gt || !s[i].hsub || !s[i].hcols || !s[i].cv || !s[i].dv)) ||
            !s[i].hw || !s[i].pos || !loop_ok) {
            scratch_free(s, n);
            return NULL;
        }
    }
    return s;
}

/* The scratch of the last run, kept for the next (mq_gptq_release_scratch frees it). Every run
 * made its slabs afresh before: on a 2-core VM a column-loop task's first run on a thread took
 * 30 ms against 17 ms for the next (the page faults of its 2 MB slabs), and a lone weight at 16
 * threads is one task a thread, every task a first one. A run takes the kept scratch when it is at
 * least as large in every dimension and has every buffer the run needs (its contents are never
 * read before written); otherwise that one is freed before the new one is made, so at most one
 * exists: the pipeline's memory plan counts one run's scratch in every stage that runs GPTQ, and
 * the pipeline frees it after each (the attention, the routed experts, the dense or shared FFN). */
typedef struct {
    int n;
    int64_t rows, K, B, G, ng, ncand;
    bool rtn, loop, refine;
} scratch_shape;

static pthread_mutex_t g_kept_mu = PTHREAD_MUTEX_INITIALIZER;
static scratch *g_kept;
static scratch_shape g_kept_shape;

static bool shape_covers(const scratch_shape *a, const scratch_shape *b) {
    return a->n >= b->n && a->rows >= b->rows && a->K >= b->K && a->B >= b->B && a->G >= b->G &&
           a->ng >= b->ng && a->ncand >= b->ncand && (a->rtn || !b->rtn) && (a->loop || !b->loop) &&
           (a->refine || !b->refine);
}

static scratch *scratch_take(const scratch_shape *want, scratch_shape *got) {
    pthread_mutex_lock(&g_kept_mu);
    scratch *s = g_kept;
    scratch_shape had = g_kept_shape;
    g_kept = NULL;
    pthread_mutex_unlock(&g_kept_mu);
    if (s && shape_covers(&had, want)) {
        *got = had;
        return s;
    }
    scratch_free(s, had.n);   /* too small for this run: gone before the new one is made */
    *got = *want;
    return scratch_new(want->n, want->rows, want->K, want->B, want->G, want->ng, want->rtn, want->loop,
                       want->ncand, want->refine);
}

/* Keeps s for the next run (or frees it where another run's is kept already). */
static void scratch_give(scratch *s, const scratch_shape *shape) {
    if (!s) return;
    pthread_mutex_lock(&g_kept_mu);
    const bool keep = !g_kept;
    if (keep) {
        g_kept = s;
        g_kept_shape = *shape;
    }
    pthread_mutex_unlock(&g_kept_mu);
    if (!keep) scratch_free(s, shape->n);
}

void mq_gptq_release_scratch(void) {
    pthread_mutex_lock(&g_kept_mu);
    scratch *s = g_kept;
    const int n = g_kept_shape.n;
    g_kept = NULL;
    pthread_mutex_unlock(&g_kept_mu);
    scratch_free(s, n);
}

static void free_outs(mq_gptq_job *jobs, int64_t n) {
    for (int64_t i = 0; i < n; i++) mq_qtensor_free(jobs[i].out);
}

moeq_status mq_gptq_run(const mq_qspec *run_spec, const mq_gptq_opts *o, mq_gptq_job *jobs,
                        int64_t n_jobs) {
    moeq_status st = MOEQ_OK;
    for (int64_t i = 0; i < n_jobs; i++) memset(jobs[i].out, 0, sizeof *jobs[i].out);
    if (o->block_size < 1)
        return mq_err(MOEQ_E_ARG, "GPTQ block size %d (must be >= 1)", (int)o->block_size);
    if (!(o->percdamp >= 0))
        return mq_err(MOEQ_E_ARG, "GPTQ percdamp %g (must be >= 0)", o->percdamp);
    int64_t maxK = 1, maxB = 1, maxG = 1, maxNg = 1, n_tasks = 0, ncand = 1;
    bool loop = false;   /* some job's scale search runs GPTQ over its groups (the K-quants' never) */
    const int64_t R = mq_gptq_row_block();   /* rows per task */
    bool gidx = o->act_order && o->groups == MQ_GPTQ_GROUPS_GIDX;
    /* the weights' finiteness checked on the pool */
    const float **wm = calloc((size_t)n_jobs + 1, sizeof *wm);
    int64_t *wn = calloc((size_t)n_jobs + 1, sizeof *wn);
    uint8_t *wok = calloc((size_t)n_jobs + 1, 1);
    if (!wm || !wn || !wok) {
        free(wm), free(wn), free(wok);
        return mq_err(MOEQ_E_NOMEM, "GPTQ weight checks");
    }
    for (int64_t i = 0; i < n_jobs; i++) wm[i] = jobs[i].w, wn[i] = jobs[i].rows * jobs[i].f->K;
    st = mq_all_finite_many(wm, wn, n_jobs, wok);
    free(wm), free(wn);
    if (st) {
        free(wok);
        return st;
    }
    for (int64_t i = 0; i < n_jobs; i++) {
        mq_gptq_job *j = &jobs[i];
        const char *name = j->name ? j->name : "(unnamed)";
        const int64_t K = j->f->K;
        const mq_qspec *s = j->spec ? j->spec : run_spec;
        if ((st = mq_qtensor_init(j->out, s, j->rows, K, name))) goto fail;
        if (!wok[i] && (st = mq_check_finite(j->w, j->rows, K, name))) goto fail;
        if (o->rtn_loss && !j->f->R) {
            st = mq_err(MOEQ_E_ARG, "%s: the RTN loss needs a factor made with want_R", name);
            goto fail;
        }
        if (o->refine_passes > 0 && !j->f->Hp) {
            st = mq_err(MOEQ_E_ARG, "%s: the refinement needs a factor made with refine_passes", name);
            goto fail;
        }
        if (o->clip_search && (s->scheme != MQ_QS_INT4 || !s->asym)) {
            st = mq_err(MOEQ_E_ARG, "%s: the clip search clips the two ends of an asymmetric "
                        "INT4 range apart (it needs INT4 with zero points)", name);
            goto fail;
        }
        if (gidx && s->scheme != MQ_QS_INT4) {
            st = mq_err(MOEQ_E_UNSUPPORTED, "%s: act-order with g_idx groups needs INT4 (use "
                        "static or dynamic groups with %s)", name, mq_qscheme_name(s->scheme));
            goto fail;
        }
        mq_qtensor *q = j->out;
        if (s->scheme == MQ_QS_NVFP4)
            q->global_scale = j->global_scale > 0 && isfinite(j->global_scale)
                                  ? j->global_scale
                                  : mq_nvfp4_global_scale(s, mq_absmax_pool(j->w, j->rows * K));
        if (gidx) {
            q->g_idx = mq_alloc_array((size_t)K, sizeof(int32_t), "GPTQ g_idx");
            if (!q->g_idx) {
                st = mq_err_prefix(MOEQ_E_NOMEM, "%s", name);
                goto fail;
            }
            for (int64_t p = 0; p < K; p++) q->g_idx[col_of(j->f, p)] = (int32_t)(p / q->group_size);
        }
        if (K > maxK) maxK = K;
        if (mq_gptq_param_span(s, q->group_size) > maxG) maxG = mq_gptq_param_span(s, q->group_size);
        if (q->n_groups > maxNg) maxNg = q->n_groups;
        if (s->mse && o->mse_weight == MQ_GPTQ_MSE_LOOP && s->scheme != MQ_QS_KQUANT) {
            loop = true;
            ncand = s->mse_steps > ncand ? s->mse_steps : ncand;
        }
        int64_t B = o->block_size < K ? o->block_size : K;
        if (B > maxB) maxB = B;
        n_tasks += (j->rows + R - 1) / R;
    }
    free(wok);
    wok = NULL;

    task_ref *tasks = mq_alloc_array((size_t)n_tasks + 1, sizeof *tasks, "GPTQ tasks");
    task_out *outs = mq_alloc_zero(((size_t)n_tasks + 1) * sizeof *outs, "GPTQ task results");
    const int nthreads = mq_pool_size();
    const scratch_shape want = {nthreads, R, maxK, maxB, maxG, maxNg, ncand, o->rtn_loss, loop, o->refine_passes > 0};
    scratch_shape shape;
    scratch *scr = scratch_take(&want, &shape);
    if (!tasks || !outs || !scr) {
        mq_free(tasks);
        mq_free(outs);
        scratch_give(scr, &shape);
        st = MOEQ_E_NOMEM;
        goto fail;
    }
    int64_t t = 0;
    for (int64_t i = 0; i < n_jobs; i++)
        for (int64_t rb = 0; rb * R < jobs[i].rows; rb++) tasks[t++] = (task_ref){i, rb};
    /* Costliest first (K^2 per row; ties in task order), so the pool's counter hands out the long
     * tasks of the widest weights before the short ones that fill the gaps at the end. Each task's
     * result is its own, so the order changes no value. */
    int64_t *order = mq_alloc_array((size_t)n_tasks + 1, sizeof *order, "GPTQ task order");
    if (!order) {
        mq_free(tasks);
        mq_free(outs);
        scratch_give(scr, &shape);
        st = MOEQ_E_NOMEM;
        goto fail;
    }
    for (t = 0; t < n_tasks; t++) order[t] = t;
    for (t = 1; t < n_tasks; t++) {   /* insertion sort by K, stable: jobs come with few sizes */
        const int64_t v = order[t], kv = jobs[tasks[v].job].f->K;
        int64_t u = t;
        for (; u > 0 && jobs[tasks[order[u - 1]].job].f->K < kv; u--) order[u] = order[u - 1];
        order[u] = v;
    }

    mq_gptq_blas_single();
    const mq_gptq_kernels *k = mq_gptq_cpu();   /* kernels.c's row of this CPU */
    run_ctx c = {run_spec, o, jobs, tasks, outs, scr, o->block_size, k->qdq,
                 k->errors, k->loop_scores, n_tasks, 0, order, R};
    mq_parallel_for(n_tasks, run_task, &c);
    if (o->progress_label)
        mq_progress(o->progress_label, o->progress_base + o->progress_span, o->progress_total);

    /* Per-job sums in task order: independent of which thread ran what. */
    t = 0;
    for (int64_t i = 0; i < n_jobs; i++) {
        mq_gptq_job *j = &jobs[i];
        double e2 = 0, dsq = 0, re2 = 0, rdsq = 0, sec = 0;
        for (int64_t rb = 0; rb * R < j->rows; rb++, t++) {
            e2 += outs[t].e2;
            dsq += outs[t].dsq;
            re2 += outs[t].rtn_e2;
            rdsq += outs[t].rtn_dsq;
            sec += outs[t].seconds;
        }
        j->stats.loss = e2 - j->f->damp * dsq;
        j->stats.rtn_loss = o->rtn_loss ? re2 - j->f->damp * rdsq : NAN;
        j->stats.percdamp = j->f->percdamp;
        j->stats.n_dead = j->f->n_dead;
        j->stats.seconds = sec;
    }
    mq_free(tasks);
    mq_free(order);
    mq_free(outs);
    scratch_give(scr, &shape);
    if (moeq_interrupted()) {
        st = mq_err(MOEQ_E_INTERRUPTED, "GPTQ interrupted");
        goto fail;
    }
    return MOEQ_OK;

fail:
    free(wok);
    free_outs(jobs, n_jobs);
    return st;
}

moeq_status mq_gptq_quantize(const mq_qspec *s, const mq_gptq_opts *o, const float *H,
                             const float *w, int64_t rows, int64_t cols, float global_scale,
                             const char *name, mq_qtensor *out, float *deq,
                             mq_gptq_stats *stats) {
    memset(out, 0, sizeof *out);
    mq_gptq_factor f;
    moeq_status st = mq_gptq_factor_init(H, cols, o, o->rtn_loss, name, &f);
    if (st) return st;
    mq_gptq_job j = {&f, w, rows, global_scale, name, out, deq, {0, 0, 0, 0, 0}, NULL};
    st = mq_gptq_run(s, o, &j, 1);
    if (!st && stats) *stats = j.stats;
    mq_gptq_factor_free(&f);
    return st;
}

double mq_gptq_loss(const float *H, int64_t K, const float *w, const float *q, int64_t rows) {
    size_t n = (size_t)rows * (size_t)K;
    float *d = mq_alloc_array(n, sizeof(float), "GPTQ loss");
    float *dh = mq_alloc_array(n, sizeof(float), "GPTQ loss");
    double loss = NAN;
    if (d && dh) {
        for (size_t i = 0; i < n; i++) d[i] = w[i] - q[i];
        mq_gemm_nn(rows, K, K, 1.0f, d, K, H, K, 0.0f, dh, K);
        loss = 0;
        for (size_t i = 0; i < n; i++) loss += (double)d[i] * dh[i];
    }
    mq_free(d);
    mq_free(dh);
    return loss;
}

moeq_status mq_gptq_damp_sweep(const mq_qspec *s, const mq_gptq_opts *o, const float *H_fit,
                               const float *H_held, int64_t K, const float *const *w,
                               const int64_t *rows, const float *gs, int nw, const double *cand,
                               int nc, const char *name, int *best, double *loss) {
    *best = -1;
    if (nc < 1 || nw < 1) return mq_err(MOEQ_E_ARG, "%s: damping sweep without candidates", name);
    int64_t maxr = 0;
    for (int k = 0; k < nw; k++) maxr = rows[k] > maxr ? rows[k] : maxr;
    float *deq = mq_alloc_array((size_t)maxr * (size_t)K, sizeof(float), "damping sweep");
    if (!deq) return MOEQ_E_NOMEM;
    mq_gptq_opts oc = *o;
    oc.rtn_loss = false;
    oc.progress_label = NULL;
    moeq_status st = MOEQ_OK;
    double least = INFINITY;
    for (int c = 0; c < nc && !st; c++) {
        oc.percdamp = cand[c];
        mq_gptq_factor f;
        loss[c] = INFINITY;
        /* a candidate whose Cholesky fails even raised is out of the race, not an error */
        if (mq_gptq_factor_init(H_fit, K, &oc, false, name, &f)) continue;
        double sum = 0;
        for (int k = 0; k < nw && !st; k++) {
            mq_qtensor q;
            mq_gptq_job j = {&f, w[k], rows[k], gs ? gs[k] : 0.0f, name, &q, deq, {0, 0, 0, 0, 0}, NULL};
            st = mq_gptq_run(s, &oc, &j, 1);
            mq_qtensor_free(&q);
            if (!st) sum += mq_gptq_loss(H_held, K, w[k], deq, rows[k]);
        }
        mq_gptq_factor_free(&f);
        if (st) break;
        loss[c] = sum;
        if (sum < least) {   /* the first least wins */
            least = sum;
            *best = c;
        }
    }
    mq_free(deq);
    if (!st && *best < 0)
        st = mq_err(MOEQ_E_NUMERIC, "%s: damping sweep: no candidate damping factorises the "
                    "Hessian of the fitting rows", name);
    return st;
}

