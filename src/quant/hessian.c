/*
 * GPTQ Hessian accumulation (see hessian.h): fp32 sums on the lower triangle, one fmaf chain per
 * element over the rows in order (kernels/gemm_det.h: the same sums however the rows are cut
 * into calls), H = (2/n) sum x x^T formed at the end (IST-DASLab gptq.py add_batch, without its
 * running rescaling, which only changes rounding).
 */
#include "quant/hessian.h"

#include <string.h>

#include "kernels/gemm_det.h"

moeq_status mq_hessian_init(mq_hessian *h, int64_t K, const char *what) {
    memset(h, 0, sizeof *h);
    size_t n;
    if (K <= 0 || !mq_mul_size((size_t)K, (size_t)K, &n))
        return mq_err(MOEQ_E_SHAPE, "%s: Hessian size %lld", what, (long long)K);
    h->sum = mq_alloc_zero(n * sizeof(float), what);
    if (!h->sum) return MOEQ_E_NOMEM;
    h->K = K;
    return MOEQ_OK;
}

void mq_hessian_free(mq_hessian *h) {
    if (!h) return;
    mq_free(h->sum);
    memset(h, 0, sizeof *h);
}

void mq_hessian_add(mq_hessian *h, const float *x, int64_t rows) {
    if (rows <= 0) return;
    mq_syrk_det_acc_pool(h->K, rows, x, h->K, h->sum, h->K);
    h->n += rows;
}

void mq_hessian_merge(mq_hessian *dst, const mq_hessian *src) {
    MQ_ASSERT(dst->K == src->K);
    const int64_t K = dst->K;
    for (int64_t a = 0; a < K; a++)
        for (int64_t b = 0; b <= a; b++) dst->sum[a * K + b] += src->sum[a * K + b];
    dst->n += src->n;
}

void mq_hessian_get(const mq_hessian *h, float *out) {
    const int64_t K = h->K;
    const float scale = h->n > 0 ? 2.0f / (float)h->n : 0.0f;
    for (int64_t a = 0; a < K; a++)
        for (int64_t b = 0; b <= a; b++) out[a * K + b] = out[b * K + a] = scale * h->sum[a * K + b];
}
