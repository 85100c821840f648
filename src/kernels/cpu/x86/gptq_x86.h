/*
 * What GPTQ's AVX2 and AVX-512 twins (gptq_avx2.c, gptq_avx512.c) share besides their lanes: the
 * column error step's 8-lane block and its end (the AVX-512 twin sums in the AVX2 twin's order,
 * 8 lanes block after block, so it finishes with these very steps), and the in-loop search's walk
 * over groups of rows. Include only from files compiled with -mavx2 -mfma.
 */
#ifndef MOEQ_KERNELS_X86_GPTQ_X86_H
#define MOEQ_KERNELS_X86_GPTQ_X86_H

#include <immintrin.h>

#include "kernels/gptq_kernels.h"

static inline double gptq_hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return (double)_mm_cvtss_f32(a);
}

/* mq_gptq_column_errors_ref's 8 elements from i: e = (x - q) / u and w0 = q stored, the squares
 * of e and of w0 - q added lane-wise to *se and *sd. */
static inline __attribute__((always_inline)) void gptq_errors8(const float *x, const float *q, __m256 u, float *w0,
                                                               float *e, int64_t i, __m256 *se, __m256 *sd) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    const __m256 ev = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), qv), u);
    _mm256_storeu_ps(e + i, ev);
    *se = _mm256_fmadd_ps(ev, ev, *se);
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(w0 + i), qv);
    *sd = _mm256_fmadd_ps(d, d, *sd);
    _mm256_storeu_ps(w0 + i, qv);
}

/* The column error step's end: the elements from i by the reference, the lane sums se and sd
 * reduced and added to theirs; returns ||e||^2, adds ||w0 - q||^2 to *dsq. */
static inline double gptq_errors_finish(__m256 se, __m256 sd, const float *x, const float *q, float upp, float *w0,
                                        int64_t i, int64_t n, float *e, double *dsq) {
    double tail_d = 0;
    double r = gptq_hsum8(se) + (i < n ? mq_gptq_column_errors_ref(x + i, q + i, upp, w0 + i, n - i, e + i, &tail_d) : 0);
    *dsq += gptq_hsum8(sd) + tail_d;
    return r;
}

/* A twin's rows of mq_gptq_loop_scores from i0: nv registers of lanes each (e, w, q: the work's
 * errors, current column and its quantized values). */
typedef void (*gptq_rows_fn)(const mq_qspec *s, const float *ucol, int64_t G, const float *x, int64_t ld,
                             int64_t i0, int nv, const float *step, const float *zero, float *e, float *w,
                             float *q, double *score);
/* mq_gptq_loop_scores through a twin of `lanes` lanes a register: groups of 4 registers of rows,
 * then of 1 (rows are independent), the rest (under `lanes`) through `rest`, the next lower
 * twin. */
static inline __attribute__((always_inline)) void gptq_loop_scores_run(
    const mq_qspec *s, const float *ucol, int64_t G, const float *x, int64_t ld, int64_t n, const float *step,
    const float *zero, float *work, uint8_t *code, double *score, int lanes, gptq_rows_fn rows,
    void (*rest)(const mq_qspec *, const float *, int64_t, const float *, int64_t, int64_t, const float *,
                 const float *, float *, uint8_t *, double *)) {
    float *e = work, *w = work + G * ld, *q = w + ld;
    int64_t i = 0;
    for (; i + 4 * lanes <= n; i += 4 * lanes) rows(s, ucol, G, x, ld, i, 4, step, zero, e, w, q, score);
    for (; i + lanes <= n; i += lanes) rows(s, ucol, G, x, ld, i, 1, step, zero, e, w, q, score);
    if (i < n) rest(s, ucol, G, x + i, ld, n - i, step + i, zero + i, work + i, code + i, score + i);
}

#endif
