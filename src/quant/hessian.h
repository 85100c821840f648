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
} mq_hessian;

moeq_status mq_hessian_init(mq_hessian *h, int64_t K, const char *what);
void mq_hessian_free(mq_hessian *h);
/* Adds the rows of x [rows, K], over the pool (serially when called from a pool task). */
void mq_hessian_add(mq_hessian *h, const float *x, int64_t rows);
/* dst += src (sums and counts); same K. */
void mq_hessian_merge(mq_hessian *dst, const mq_hessian *src);
/* out [K, K] = (2/n) sum, both triangles; all zero when n == 0. */
void mq_hessian_get(const mq_hessian *h, float *out);

#endif
