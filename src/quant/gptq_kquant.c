/*
 * GPTQ into llama.cpp's K-quant grids (formats/kquant.h): the column loop of gptq.c rounds each
 * column to the exact grid the GGUF block will hold, with the error feedback across the whole
 * row as for any scheme. What differs is when and over what the scales are chosen: a K-quant
 * sub-block's step is an integer multiple of its block's fp16 super-scale, so the params of all
 * the sub-blocks of a block (256 columns; 32 for the Q5_0/Q5_1/Q8_0 fallbacks) are chosen
 * together, when the block's first column is reached (dynamic groups: from the columns' current
 * values, the error feedback of every column before included) or before the loop (static: from
 * the original weights). The choice is formats' block fit (mq_kq_fit_block): each sub-block's
 * scale and min by weighted least squares, then the super-scales searched over the spec's MSE
 * grid with every sub-block's neighbouring multipliers, each scored on the exact grid, the
 * squared error of column j weighted as the search of the other schemes weighs it
 * (mq_gptq_mse_weight: GPTQ's remaining loss 1/[H_F^-1]_jj by default, or diag(H)); dead columns
 * weigh nothing. The codes the loop then writes are the codes the file holds: the groups' steps
 * and offsets are the block's own (d * sc, dmin * m), so packing them loses nothing.
 */
#include "formats/kquant.h"
#include "quant/gptq_internal.h"

#include <string.h>

int64_t mq_gptq_param_span(const mq_qspec *s, int64_t group_size) {
    return s->scheme == MQ_QS_KQUANT ? mq_kq_info_of(s->kq)->block : group_size;
}

/* The weights of the block's columns (processing positions pos[]) into sc->hw. */
static const float *block_weights(const loop_state *L, const int64_t *pos, int64_t c0, int64_t n) {
    float *hw = L->sc->hw;
    for (int64_t u = 0; u < n; u++)
        hw[u] = L->f->dead[c0 + u] ? 0.0f
              : !L->s->mse || L->mse_weight == MQ_GPTQ_MSE_PLAIN ? 1.0f
                                                                   : column_weight(L, pos[u]);
    return hw;
}

/* Each row's block fit from x [n][nr] (column u of row i at x[u * nr + i]) into the groups of
 * block b. only >= 0: only that group (of the block's) is ready; the others keep the block's
 * super-scales d and dmin in their params (scale, zero) and are marked KQ_PENDING, to be chosen
 * when their first column comes (mq_kq_fit_sub). */
static void fit_rows(const loop_state *L, int64_t b, const float *x, const float *hw, int64_t only) {
    const mq_kq_info *t = mq_kq_info_of(L->s->kq);
    scratch *sc = L->sc;
    const int64_t nr = L->nr, per = t->block / t->sub, g0 = b * per;
    mq_gparams g[16];
    for (int64_t i = 0; i < nr; i++) {
        float d, dmin;
        mq_kq_fit_block_d(t, L->s, x + i, nr, hw, g, &d, &dmin);
        for (int64_t j = 0; j < per; j++) {
            const int64_t k = (g0 + j) * nr + i;
            if (only >= 0 && g0 + j != only) {
                sc->gp[k] = (mq_gparams){d, dmin, 0, 0};
                continue;
            }
            sc->gp[k] = g[j];
            sc->step[k] = g[j].scale;
            sc->zero[k] = g[j].zero;
        }
    }
    for (int64_t j = 0; j < per; j++) sc->ready[g0 + j] = only < 0 || g0 + j == only ? 1 : KQ_PENDING;
}

/* The current values of columns c0 .. c0 + n of the row block into sc->tmp [n][nr], the errors
 * of the columns before p that have not reached them yet added (as group_params_dynamic does);
 * their processing positions into sc->pos. */
static void current_values(const loop_state *L, int64_t c0, int64_t n, int64_t p) {
    scratch *sc = L->sc;
    const int64_t nr = L->nr, K = L->K;
    for (int64_t u = 0; u < n; u++) {
        const int64_t q = sc->pos[u] = pos_of(L->f, c0 + u);
        float *out = sc->tmp + u * nr;
        memcpy(out, sc->wt + q * nr, (size_t)nr * sizeof(float));
        const int64_t from = q < L->s1 ? p : q < L->b1 ? L->s0 : L->b0;
        for (int64_t k = from; k < p; k++) {
            const float u_kq = L->f->U[k * K + q];
            const float *e = sc->et + (k - L->b0) * nr;
            for (int64_t i = 0; i < nr; i++) out[i] -= u_kq * e[i];
        }
    }
}

/* Dynamic groups: at the first column reached of a block, the block's fit from every column's
 * current value fixes its fp16 super-scales (and this sub-block's multipliers); each later
 * sub-block's multipliers are chosen again when its own first column comes, from its columns'
 * values then, the error feedback of every column before included (as INT4's dynamic groups of
 * 32): the block's first fit saw them before most of that feedback. */
void mq_gptq_kq_params_dynamic(const loop_state *L, int64_t g, int64_t p) {
    const mq_kq_info *t = mq_kq_info_of(L->s->kq);
    scratch *sc = L->sc;
    const int64_t nr = L->nr, n = t->block, per = t->block / t->sub, b = g / per;
    if (sc->ready[g] != KQ_PENDING) {
        current_values(L, b * n, n, p);
        fit_rows(L, b, sc->tmp, block_weights(L, sc->pos, b * n, n), g);
        return;
    }
    const int64_t c0 = g * t->sub;
    current_values(L, c0, t->sub, p);
    const float *hw = block_weights(L, sc->pos, c0, t->sub);
    for (int64_t i = 0; i < nr; i++) {
        const int64_t k = g * nr + i;
        mq_gparams gp;
        mq_kq_fit_sub(t, L->s, sc->tmp + i, nr, hw, sc->gp[k].scale, sc->gp[k].zero, &gp);
        sc->gp[k] = gp;
        sc->step[k] = gp.scale;
        sc->zero[k] = gp.zero;
    }
    sc->ready[g] = 1;
}

void mq_gptq_kq_params_static(const loop_state *L, const float *w, int64_t r0) {
    const mq_kq_info *t = mq_kq_info_of(L->s->kq);
    scratch *sc = L->sc;
    const int64_t nr = L->nr, K = L->K, n = t->block;
    for (int64_t b = 0; b < K / n; b++) {
        for (int64_t u = 0; u < n; u++) {
            sc->pos[u] = pos_of(L->f, b * n + u);
            const bool dead = L->f->dead[b * n + u];
            for (int64_t i = 0; i < nr; i++) sc->tmp[u * nr + i] = dead ? 0.0f : w[(r0 + i) * K + b * n + u];
        }
        fit_rows(L, b, sc->tmp, block_weights(L, sc->pos, b * n, n), -1);
    }
}

void mq_gptq_kq_rtn_row(const mq_qspec *s, const float *row, int64_t cols, float *q) {
    const mq_kq_info *t = mq_kq_info_of(s->kq);
    mq_gparams g[16];
    uint8_t c[256];
    for (int64_t b = 0; b < cols / t->block; b++) {
        mq_kq_quantize_row(t, s, row + b * t->block, t->block, NULL, g, c);
        mq_kq_dequant_row(t, g, c, t->block, q + b * t->block);
    }
}
