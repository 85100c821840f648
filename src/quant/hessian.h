/*
 * Hessian accumulation for GPTQ: H = (2/n) sum over n input rows x of x x^T, the Hessian of the
 * layer-wise squared error ||x W^T - x Q^T||^2 (formats.md section 4; torchao_gptq.md section 2).
 * The sum is kept in fp32 (one triangle), each element one fmaf per row in row order
 * (mq_syrk_det_acc), so the result does not depend on how the rows are batched into calls, nor on
 * the thread count; scaling happens once at the end.
 */
#ifndef MOEQ_HESSIAN_H
#define MOEQ_HESSIAN_H

#include "core/core.h"

typedef struct {
    int64_t K;
    float *sum;     /* [K, K]: sum x x^T, lower triangle (row-major) */
    int64_t n;      /* rows accumulated */
    /* A held-out split (mq_hessian_init_split): rows from number `hold` on are the held-out
     * ones; fit is a copy of sum taken when row `hold` is reached (NULL: no split). */
    float *fit;
    int64_t hold;
    bool fit_taken;
} mq_hessian;

moeq_status mq_hessian_init(mq_hessian *h, int64_t K, const char *what);
void mq_hessian_free(mq_hessian *h);
/* Adds the rows of x [rows, K], over the pool (serially when called from a pool task). */
void mq_hessian_add(mq_hessian *h, const float *x, int64_t rows);
/* As mq_hessian_init, keeping apart the rows from number `hold` on (the held-out rows of a
 * damping sweep: the caller feeds them last). The whole sum is the same bits as without the
 * split; one more K x K buffer. */
moeq_status mq_hessian_init_split(mq_hessian *h, int64_t K, int64_t hold, const char *what);
/* A split Hessian: whole [K, K] = (2/n) sum (as mq_hessian_get; may be h->sum), held [K, K] =
 * (2/n_held)(sum - sum of the first `hold` rows) (may be h->fit), both triangles; *n_fit and
 * *n_held the row counts (held all zero when no row was held out). */
void mq_hessian_get_split(mq_hessian *h, float *whole, float *held, int64_t *n_fit,
                          int64_t *n_held);
/* fit [K, K] = the Hessian of the rows before the held-out ones, from the split's results:
 * (n whole - n_held held) / n_fit (0 when n_fit is 0). */
void mq_hessian_fit_from_split(const float *whole, const float *held, int64_t K, int64_t n_fit,
                               int64_t n_held, float *fit);
/* x [rows, K]: row r multiplied by sqrt(w[r]) (w >= 0), so that its update to a Hessian adds
 * w[r] x x^T: the gate-score weighting of an expert's routed tokens (MoEQuant's AGQ). */
void mq_hessian_weight_rows(float *x, int64_t rows, int64_t K, const float *w);
/* dst += src (sums and counts); same K. */
void mq_hessian_merge(mq_hessian *dst, const mq_hessian *src);
/* out [K, K] = (2/n) sum, both triangles; all zero when n == 0. */
void mq_hessian_get(const mq_hessian *h, float *out);

#endif
