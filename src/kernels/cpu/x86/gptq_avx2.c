/*
 * AVX2 twins of GPTQ's per-column steps in src/kernels/cpu/ref/gptq_ref.c (mq_gptq_qdq_column and
 * mq_gptq_column_errors_ref): the same IEEE operations in the same order per element, so codes,
 * dequantized values and scaled errors are bit-identical; only the two squared-error sums are
 * accumulated in another order. E2M1 gives the values of formats.md's decision thresholds (ties
 * to even) by rounding at each binade's spacing (e2m1_value8); INT4 rounds with roundps (nearest
 * even, as rintf in the default mode).
 */
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/x86/gptq_x86.h"
#include "kernels/gptq_kernels.h"

/* 8 int32 lanes (0..255) to 8 bytes. */
static inline void store_u8x8(uint8_t *out, __m256i v) {
    __m128i p16 = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(p16, p16));
}

/* E2M1's grid value of a = |y| as the decision thresholds of mq_gptq_qdq_column give it (ties
 * to even): a rounded at its binade's spacing, 0.5 below 2, 1 in [2, 4) and 2 from 4 on (the
 * scalings are powers of two, so exact), capped at 6; a <= 0.25 and NaN give 0. A third of the
 * instructions of seven compares and their masked sums. *ge2: a >= 2 (for the code). */
static inline __m256 e2m1_value8(__m256 a, __m256 *ge2) {
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    const __m256 g2 = _mm256_cmp_ps(a, two, _CMP_GE_OQ);
    const __m256 g4 = _mm256_cmp_ps(a, _mm256_set1_ps(4.0f), _CMP_GE_OQ);
    const __m256 up = _mm256_blendv_ps(_mm256_blendv_ps(two, one, g2), half, g4);
    const __m256 down = _mm256_blendv_ps(_mm256_blendv_ps(half, one, g2), two, g4);
    enum { nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC };   /* a constant for clang */
    __m256 v = _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(a, up), nearest), down);
    v = _mm256_min_ps(v, _mm256_set1_ps(6.0f));
    *ge2 = g2;
    return _mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(0.25f), _CMP_GT_OQ), v);
}

/* 8 lanes of mq_gptq_qdq_column; code NULL: the values alone (the in-loop search). */
static inline __attribute__((always_inline)) void qdq8(const mq_qspec *s, const float *step,
                                                       const float *zero, const float *x,
                                                       uint8_t *code, float *dq) {
    const __m256 sign = _mm256_set1_ps(-0.0f), zf = _mm256_setzero_ps();
    const __m256 st = _mm256_loadu_ps(step);
    if (s->scheme == MQ_QS_INT4) {
        const bool asym = s->asym;
        const __m256 lo = _mm256_set1_ps(asym ? 0.0f : -8.0f), hi = _mm256_set1_ps(asym ? 15.0f : 7.0f);
        const __m256 eight = _mm256_set1_ps(8.0f);
        __m256 z = asym ? _mm256_loadu_ps(zero) : zf;
        __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x), st),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, z), lo), hi);
        q = _mm256_blendv_ps(q, z, _mm256_cmp_ps(st, zf, _CMP_EQ_OQ));
        __m256 cf = asym ? q : _mm256_add_ps(q, eight);
        __m256i c = _mm256_cvttps_epi32(cf);
        if (code) store_u8x8(code, c);
        __m256 back = _mm256_sub_ps(_mm256_cvtepi32_ps(c), asym ? z : eight);
        _mm256_storeu_ps(dq, _mm256_mul_ps(back, st));
        return;
    }
    __m256 y = _mm256_div_ps(_mm256_loadu_ps(x), st);
    __m256 sg = _mm256_and_ps(sign, y), ge2;
    const __m256 v = e2m1_value8(_mm256_andnot_ps(sign, y), &ge2);
    const __m256 zs = _mm256_cmp_ps(st, zf, _CMP_EQ_OQ);
    if (code) {
        /* the index from the value: 2v up to 2 (0..4), above it the value's exponent and first
         * mantissa bit (3 -> 5, 4 -> 6, 6 -> 7) */
        const __m256i low = _mm256_cvttps_epi32(_mm256_add_ps(v, v));
        const __m256i high = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(v), 22),
                                              _mm256_set1_epi32(252));
        __m256i c = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(low), _mm256_castsi256_ps(high), ge2));
        c = _mm256_or_si256(c, _mm256_srli_epi32(_mm256_castps_si256(sg), 28));
        store_u8x8(code, _mm256_andnot_si256(_mm256_castps_si256(zs), c));
    }
    __m256 d = _mm256_mul_ps(_mm256_or_ps(v, sg), st);
    _mm256_storeu_ps(dq, _mm256_andnot_ps(zs, d));
}

void mq_gptq_qdq_column_avx2(const mq_qspec *s, const float *step, const float *zero,
                             const float *x, int64_t n, uint8_t *code, float *dq) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) qdq8(s, step + i, s->asym ? zero + i : zero, x + i, code + i, dq + i);
    if (i < n) mq_gptq_qdq_column(s, step + i, zero + i, x + i, n - i, code + i, dq + i);
}

double mq_gptq_column_errors_avx2(const float *x, const float *q, float upp, float *w0, int64_t n,
                                  float *e, double *dsq) {
    const __m256 u = _mm256_set1_ps(upp);
    __m256 se = _mm256_setzero_ps(), sd = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) gptq_errors8(x, q, u, w0, e, i, &se, &sd);
    return gptq_errors_finish(se, sd, x, q, upp, w0, i, n, e, dsq);
}

/* The column step of mq_gptq_loop_scores_ref for 8 * nv rows from i0: q = qdq(w), the scaled
 * errors e_b and their squares added to the rows' scores (in double, as the reference). */
static inline void loop_column_step(const mq_qspec *s, float ubb, int nv, int64_t i0,
                                    const float *step, const float *zero, const float *w,
                                    float *q, float *eb, double *score) {
    for (int64_t i = i0; i < i0 + 8 * nv; i += 8)   /* the search needs the values alone */
        qdq8(s, step + i, s->asym ? zero + i : zero, w + i, NULL, q + i);
    const __m256 u = _mm256_set1_ps(ubb);
    for (int64_t i = i0; i < i0 + 8 * nv; i += 8) {
        __m256 ev = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(q + i)), u);
        _mm256_storeu_ps(eb + i, ev);
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(ev));
        __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(ev, 1));
        _mm256_storeu_pd(score + i, _mm256_add_pd(_mm256_loadu_pd(score + i), _mm256_mul_pd(lo, lo)));
        _mm256_storeu_pd(score + i + 4, _mm256_add_pd(_mm256_loadu_pd(score + i + 4), _mm256_mul_pd(hi, hi)));
    }
}

/* mq_gptq_loop_scores_ref for 32 rows (nv = 4) or 8 rows (nv = 1) from i0: each row's value of
 * column b stays in a register while the errors of the earlier columns are subtracted in order
 * (the same products and differences as the reference, which subtracts column by column). The
 * accumulators are plain locals, dead before the call in the column step, so that they live in
 * registers. */
static void loop_scores_rows(const mq_qspec *s, const float *ucol, int64_t G, const float *x,
                             int64_t ld, int64_t i0, int nv, const float *step, const float *zero,
                             float *e, float *w, float *q, double *score) {
    for (int64_t i = i0; i < i0 + 8 * nv; i++) score[i] = 0;
    for (int64_t b = 0; b < G; b++) {
        const float *ub = ucol + b * G, *ea = e + i0, *xb = x + b * ld + i0;
        if (nv == 4) {
            __m256 a0 = _mm256_loadu_ps(xb), a1 = _mm256_loadu_ps(xb + 8);
            __m256 a2 = _mm256_loadu_ps(xb + 16), a3 = _mm256_loadu_ps(xb + 24);
            for (int64_t a = 0; a < b; a++, ea += ld) {
                const __m256 u = _mm256_broadcast_ss(ub + a);
                a0 = _mm256_sub_ps(a0, _mm256_mul_ps(u, _mm256_loadu_ps(ea)));
                a1 = _mm256_sub_ps(a1, _mm256_mul_ps(u, _mm256_loadu_ps(ea + 8)));
                a2 = _mm256_sub_ps(a2, _mm256_mul_ps(u, _mm256_loadu_ps(ea + 16)));
                a3 = _mm256_sub_ps(a3, _mm256_mul_ps(u, _mm256_loadu_ps(ea + 24)));
            }
            _mm256_storeu_ps(w + i0, a0);
            _mm256_storeu_ps(w + i0 + 8, a1);
            _mm256_storeu_ps(w + i0 + 16, a2);
            _mm256_storeu_ps(w + i0 + 24, a3);
        } else {
            __m256 a0 = _mm256_loadu_ps(xb);
            for (int64_t a = 0; a < b; a++, ea += ld)
                a0 = _mm256_sub_ps(a0, _mm256_mul_ps(_mm256_broadcast_ss(ub + a), _mm256_loadu_ps(ea)));
            _mm256_storeu_ps(w + i0, a0);
        }
        loop_column_step(s, ub[b], nv, i0, step, zero, w, q, e + b * ld, score);
    }
}

void mq_gptq_loop_scores_avx2(const mq_qspec *s, const float *ucol, int64_t G, const float *x,
                              int64_t ld, int64_t n, const float *step, const float *zero,
                              float *work, uint8_t *code, double *score) {
    gptq_loop_scores_run(s, ucol, G, x, ld, n, step, zero, work, code, score, 8, loop_scores_rows,
                         mq_gptq_loop_scores_ref);
}

const mq_gptq_kernels mq_gptq_kernels_avx2 = {mq_gptq_qdq_column_avx2, mq_gptq_column_errors_avx2,
                                              mq_gptq_loop_scores_avx2};
