/*
 * GPTQ Hessian accumulation (see hessian.h): fp32 sums on the lower triangle, one fmaf chain per
 * element over the rows in order (kernels/gemm_det.h: the same sums however the rows are cut
 * into calls), H = (2/n) sum x x^T formed at the end (IST-DASLab gptq.py add_batch, without its
 * running rescaling, which only changes rounding).
 */
#include "quant/hessian.h"

#include <math.h>
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

moeq_status mq_hessian_init_split(mq_hessian *h, int64_t K, int64_t hold, const char *what) {
    moeq_status st = mq_hessian_init(h, K, what);
    if (st) return st;
    h->fit = mq_alloc_array((size_t)K * (size_t)K, sizeof(float), what);
    if (!h->fit) {
        mq_hessian_free(h);
        return MOEQ_E_NOMEM;
    }
    h->hold = hold;
    return MOEQ_OK;
}

void mq_hessian_free(mq_hessian *h) {
    if (!h) return;
    MQ_RELEASE_EACH(h->fit, h->sum);
    memset(h, 0, sizeof *h);
}

/* The copy of the sum at the held-out boundary. */
static void take_fit(mq_hessian *h) {
    memcpy(h->fit, h->sum, (size_t)h->K * (size_t)h->K * sizeof(float));
    h->fit_taken = true;
}

void mq_hessian_add(mq_hessian *h, const float *x, int64_t rows) {
    if (rows <= 0) return;
    if (h->fit && !h->fit_taken && h->n + rows > h->hold) {
        /* the rows before the boundary, the copy, then the rest: the same fmaf chains as one
         * call (the sum does not depend on how the rows are cut) */
        const int64_t a = h->hold - h->n;
        if (a > 0) mq_syrk_det_acc_pool(h->K, a, x, h->K, h->sum, h->K);
        take_fit(h);
        if (rows > a) mq_syrk_det_acc_pool(h->K, rows - a, x + a * h->K, h->K, h->sum, h->K);
        h->n += rows;
        return;
    }
    mq_syrk_det_acc_pool(h->K, rows, x, h->K, h->sum, h->K);
    h->n += rows;
}

/* Forming H from the sum is O(K^2) per Linear (64 experts of K = 2048 are a gigabyte a layer): row
 * blocks of the lower triangle on the pool, each in square tiles so the mirrored writes stay in
 * cache. Element (a, b), a >= b, is read once and written with its mirror (b, a) by the block of
 * row a only, so the blocks touch disjoint elements and every output may be the sum's buffer
 * itself (the upper triangle, written, is never read). */
enum { FORM_TILE = 32 };

typedef struct {
    const float *sum, *fit;   /* fit: the split's copy at the boundary, or NULL */
    float *whole, *held;
    int64_t K;
    float scale, sh;
} form_job;

static void form_task(void *ctx, int64_t a0, int64_t a1) {
    const form_job *j = ctx;
    const int64_t K = j->K;
    for (int64_t b0 = 0; b0 < a1; b0 += FORM_TILE) {
        const int64_t b1 = b0 + FORM_TILE < K ? b0 + FORM_TILE : K;
        for (int64_t a = a0; a < a1; a++)
            for (int64_t b = b0; b < b1 && b <= a; b++) {
                const float v = j->sum[a * K + b];
                if (j->held) {
                    const float w = j->sh * (v - j->fit[a * K + b]);
                    j->held[a * K + b] = j->held[b * K + a] = w;
                }
                j->whole[a * K + b] = j->whole[b * K + a] = j->scale * v;
            }
    }
}

static void form(const mq_hessian *h, float *whole, float *held, float sh) {
    form_job j = {h->sum, h->fit, whole, held, h->K, h->n > 0 ? 2.0f / (float)h->n : 0.0f, sh};
    mq_parallel_ranges(h->K, FORM_TILE, true, form_task, &j);
}

void mq_hessian_get_split(mq_hessian *h, float *whole, float *held, int64_t *n_fit,
                          int64_t *n_held) {
    if (!h->fit_taken) take_fit(h);   /* every row was before the boundary */
    const int64_t nf = h->n < h->hold ? h->n : h->hold, nh = h->n - nf;
    form(h, whole, held, nh > 0 ? 2.0f / (float)nh : 0.0f);
    *n_fit = nf;
    *n_held = nh;
}

void mq_hessian_fit_from_split(const float *whole, const float *held, int64_t K, int64_t n_fit,
                               int64_t n_held, float *fit) {
    const double n = (double)(n_fit + n_held);
    for (int64_t i = 0; i < K * K; i++)
        fit[i] = n_fit > 0 ? (float)((n * whole[i] - (double)n_held * held[i]) / (double)n_fit) : 0.0f;
}

void mq_hessian_weight_rows(float *x, int64_t rows, int64_t K, const float *w) {
    for (int64_t r = 0; r < rows; r++) {
        const float f = sqrtf(w[r]);
        for (int64_t k = 0; k < K; k++) x[r * K + k] *= f;
    }
}

void mq_hessian_merge(mq_hessian *dst, const mq_hessian *src) {
    MQ_ASSERT(dst->K == src->K);
    const int64_t K = dst->K;
    for (int64_t a = 0; a < K; a++)
        for (int64_t b = 0; b <= a; b++) dst->sum[a * K + b] += src->sum[a * K + b];
    dst->n += src->n;
}

void mq_hessian_get(const mq_hessian *h, float *out) { form(h, out, NULL, 0.0f); }
