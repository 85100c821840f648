/*
 * AVX2 twin of the MSE scale search's scoring (mq_mse_sse_ref in src/formats/quant.c): the
 * candidates of a group go in the 8 lanes, the group's values are walked in order, so every
 * candidate's double sum is accumulated in exactly the scalar order and the scores are
 * bit-identical. Per value and candidate the IEEE operations are those of formats.h's
 * quant_step / dequant_step: y = x / step; E2M1 by the decision thresholds of formats.md (ties
 * to even) or INT4 rint + clamp; x^ = value * step; d = (double)x - (double)x^; sum += d * d
 * (times h). The build is ISO C (no FP contraction), so no multiply-add is fused.
 */
#include <immintrin.h>

#include "formats/cpu/simd.h"

/* E2M1 quantize-dequantize of x over 8 steps (value * step with the sign of x / step). */
static inline __m256 qdq_e2m1(__m256 x, __m256 st) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    __m256 y = _mm256_div_ps(x, st);
    __m256 a = _mm256_andnot_ps(sign, y), sg = _mm256_and_ps(sign, y);
    /* the grid value as the sum of the steps passed (exact): 0.5 x 4, then 1, 1, 2 */
    __m256 v = _mm256_add_ps(
        _mm256_add_ps(_mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(0.25f), _CMP_GT_OQ), half),
                      _mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(0.75f), _CMP_GE_OQ), half)),
        _mm256_add_ps(_mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(1.25f), _CMP_GT_OQ), half),
                      _mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(1.75f), _CMP_GE_OQ), half)));
    v = _mm256_add_ps(
        v, _mm256_add_ps(
               _mm256_add_ps(_mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(2.5f), _CMP_GT_OQ), one),
                             _mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(3.5f), _CMP_GE_OQ), one)),
               _mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(5.0f), _CMP_GT_OQ), two)));
    return _mm256_mul_ps(_mm256_or_ps(v, sg), st);
}

/* INT4 quantize-dequantize: q = clamp(rint(x / step) + zero), x^ = (q - zero) * step (zero = 0
 * and the range -8..7 when symmetric: code - 8 = q exactly). */
static inline __m256 qdq_int4(__m256 x, __m256 st, __m256 z, __m256 lo, __m256 hi) {
    __m256 q = _mm256_round_ps(_mm256_div_ps(x, st), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, z), lo), hi);
    return _mm256_mul_ps(_mm256_sub_ps(q, z), st);
}

/* Scores candidate vectors c0 .. c0 + NV - 1 (of 8) together: NV independent chains of double
 * adds hide their latency, and each lane's sum still runs over the values in order. */
#define MSE_SSE_BLOCK(NV)                                                                          \
    static void mse_sse_##NV(const mq_qspec *s, const float *step, const float *zero,             \
                             const float *x, int64_t n, int64_t stride, const float *h,            \
                             double *sse) {                                                        \
        const bool int4 = s->scheme == MQ_QS_INT4, asym = int4 && s->asym;                         \
        const __m256 lo = _mm256_set1_ps(asym ? 0.0f : -8.0f);                                     \
        const __m256 hi = _mm256_set1_ps(asym ? 15.0f : 7.0f);                                     \
        __m256 st[NV], z[NV], zs[NV];                                                              \
        __m256d acc[2 * NV];                                                                       \
        for (int k = 0; k < NV; k++) {                                                             \
            st[k] = _mm256_loadu_ps(step + 8 * k);                                                 \
            z[k] = asym ? _mm256_loadu_ps(zero + 8 * k) : _mm256_setzero_ps();                    \
            /* a zero step (all-zero group) dequantizes everything to 0 */                        \
            zs[k] = _mm256_cmp_ps(st[k], _mm256_setzero_ps(), _CMP_EQ_OQ);                       \
            acc[2 * k] = acc[2 * k + 1] = _mm256_setzero_pd();                                    \
        }                                                                                          \
        for (int64_t i = 0; i < n; i++) {                                                          \
            const float v = x[i * stride];                                                         \
            const __m256 xv = _mm256_set1_ps(v);                                                   \
            const __m256d vd = _mm256_set1_pd((double)v);                                          \
            const __m256d hv = _mm256_set1_pd(h ? (double)h[i] : 1.0);                             \
            for (int k = 0; k < NV; k++) {                                                         \
                __m256 dq = int4 ? qdq_int4(xv, st[k], z[k], lo, hi) : qdq_e2m1(xv, st[k]);       \
                dq = _mm256_andnot_ps(zs[k], dq);                                                  \
                __m256d d0 = _mm256_sub_pd(vd, _mm256_cvtps_pd(_mm256_castps256_ps128(dq)));       \
                __m256d d1 = _mm256_sub_pd(vd, _mm256_cvtps_pd(_mm256_extractf128_ps(dq, 1)));     \
                d0 = _mm256_mul_pd(d0, d0);                                                        \
                d1 = _mm256_mul_pd(d1, d1);                                                        \
                if (h) { /* h * d^2; without h the scalar adds d^2 itself (1 * d^2 is the same) */ \
                    d0 = _mm256_mul_pd(hv, d0);                                                    \
                    d1 = _mm256_mul_pd(hv, d1);                                                    \
                }                                                                                  \
                acc[2 * k] = _mm256_add_pd(acc[2 * k], d0);                                        \
                acc[2 * k + 1] = _mm256_add_pd(acc[2 * k + 1], d1);                                \
            }                                                                                      \
        }                                                                                          \
        for (int k = 0; k < 2 * NV; k++) _mm256_storeu_pd(sse + 4 * k, acc[k]);                   \
    }
MSE_SSE_BLOCK(1)
MSE_SSE_BLOCK(2)
MSE_SSE_BLOCK(3)
MSE_SSE_BLOCK(4)

void mq_mse_sse_avx2(const mq_qspec *s, const float *step, const float *zero, int nc,
                     const float *x, int64_t n, int64_t stride, const float *h, double *sse) {
    for (int c0 = 0; c0 < nc; c0 += 32) {
        int nv = (nc - c0 + 7) / 8;
        if (nv >= 4) mse_sse_4(s, step + c0, zero + c0, x, n, stride, h, sse + c0);
        else if (nv == 3) mse_sse_3(s, step + c0, zero + c0, x, n, stride, h, sse + c0);
        else if (nv == 2) mse_sse_2(s, step + c0, zero + c0, x, n, stride, h, sse + c0);
        else mse_sse_1(s, step + c0, zero + c0, x, n, stride, h, sse + c0);
    }
}
