/*
 * AVX-512F twins of GPTQ's per-column steps in src/kernels/cpu/ref/gptq_ref.c, called only when
 * mq_cpu_has_avx512(): the operations of gptq_avx2.c on 16 lanes, so codes, dequantized values,
 * scaled errors and the in-loop scores are bit-identical to the scalar versions; the two
 * squared-error sums of the column step are accumulated in the AVX2 twin's order (8 lanes, block
 * after block), so they equal the AVX2 twin's to the bit as well. The masks of the compares are
 * k registers; every value computed under them is the one the AVX2 kernel's blends give.
 */
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/x86/gptq_x86.h"
#include "kernels/gptq_kernels.h"

#define INLINE static inline __attribute__((always_inline))

INLINE __m512 andnot_ps(__m512 a, __m512 b) {   /* ~a & b (AVX-512F has no float andnot) */
    return _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

/* E2M1's grid value of a = |y| as the decision thresholds of mq_gptq_qdq_column give it (ties
 * to even): a rounded at its binade's spacing, 0.5 below 2, 1 in [2, 4) and 2 from 4 on (the
 * scalings are powers of two, so exact), capped at 6; a <= 0.25 and NaN give 0. About a third of
 * the instructions of seven compares and their masked sums. *ge2: a >= 2 (for the code). */
INLINE __m512 e2m1_value16(__m512 a, __mmask16 *ge2) {
    const __mmask16 g2 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.0f), _CMP_GE_OQ);
    const __mmask16 g4 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(4.0f), _CMP_GE_OQ);
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
    const __m512 up = _mm512_mask_blend_ps(g4, _mm512_mask_blend_ps(g2, two, one), half);
    const __m512 down = _mm512_mask_blend_ps(g4, _mm512_mask_blend_ps(g2, half, one), two);
    enum { nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC };   /* a constant for clang */
    __m512 v = _mm512_mul_ps(_mm512_roundscale_ps(_mm512_mul_ps(a, up), nearest), down);
    v = _mm512_min_ps(v, _mm512_set1_ps(6.0f));
    *ge2 = g2;
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_GT_OQ), v);
}

/* 16 lanes of mq_gptq_qdq_column; code NULL: the values alone (the in-loop search). */
INLINE void qdq16(const mq_qspec *s, const float *step, const float *zero, const float *x,
                  uint8_t *code, float *dq) {
    const __m512 st = _mm512_loadu_ps(step), zf = _mm512_setzero_ps();
    const __mmask16 zs = _mm512_cmp_ps_mask(st, zf, _CMP_EQ_OQ);
    if (s->scheme == MQ_QS_INT4) {
        const bool asym = s->asym;
        const __m512 lo = _mm512_set1_ps(asym ? 0.0f : -8.0f), hi = _mm512_set1_ps(asym ? 15.0f : 7.0f);
        const __m512 eight = _mm512_set1_ps(8.0f);
        __m512 z = asym ? _mm512_loadu_ps(zero) : zf;
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x), st),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(q, z), lo), hi);
        q = _mm512_mask_blend_ps(zs, q, z);
        __m512 cf = asym ? q : _mm512_add_ps(q, eight);
        __m512i c = _mm512_cvttps_epi32(cf);
        if (code) _mm_storeu_si128((__m128i *)code, _mm512_cvtepi32_epi8(c));   /* 0..15 */
        __m512 back = _mm512_sub_ps(_mm512_cvtepi32_ps(c), asym ? z : eight);
        _mm512_storeu_ps(dq, _mm512_mul_ps(back, st));
        return;
    }
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 y = _mm512_div_ps(_mm512_loadu_ps(x), st);
    __m512i sg = _mm512_and_si512(_mm512_castps_si512(sign), _mm512_castps_si512(y));
    __mmask16 ge2;
    const __m512 v = e2m1_value16(andnot_ps(sign, y), &ge2);
    if (code) {
        /* the index from the value: 2v up to 2 (0..4), above it the value's exponent and first
         * mantissa bit (3 -> 5, 4 -> 6, 6 -> 7) */
        const __m512i low = _mm512_cvttps_epi32(_mm512_add_ps(v, v));
        const __m512i high = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(v), 22),
                                              _mm512_set1_epi32(252));
        __m512i c = _mm512_or_si512(_mm512_mask_blend_epi32(ge2, low, high), _mm512_srli_epi32(sg, 28));
        _mm_storeu_si128((__m128i *)code, _mm512_cvtepi32_epi8(_mm512_maskz_mov_epi32((__mmask16)~zs, c)));
    }
    __m512 d = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sg)), st);
    _mm512_storeu_ps(dq, _mm512_maskz_mov_ps((__mmask16)~zs, d));
}

void mq_gptq_qdq_column_avx512(const mq_qspec *s, const float *step, const float *zero,
                               const float *x, int64_t n, uint8_t *code, float *dq) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) qdq16(s, step + i, s->asym ? zero + i : zero, x + i, code + i, dq + i);
    if (i < n) mq_gptq_qdq_column(s, step + i, zero + i, x + i, n - i, code + i, dq + i);
}

INLINE __m256 lo8(__m512 v) { return _mm512_castps512_ps256(v); }
INLINE __m256 hi8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

double mq_gptq_column_errors_avx512(const float *x, const float *q, float upp, float *w0,
                                    int64_t n, float *e, double *dsq) {
    const __m512 u = _mm512_set1_ps(upp);
    __m256 se = _mm256_setzero_ps(), sd = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 qv = _mm512_loadu_ps(q + i);
        __m512 ev = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), qv), u);
        _mm512_storeu_ps(e + i, ev);
        __m512 d = _mm512_sub_ps(_mm512_loadu_ps(w0 + i), qv);
        _mm512_storeu_ps(w0 + i, qv);
        /* the AVX2 twin's 8-lane sums: the low 8-block, then the high one */
        se = _mm256_fmadd_ps(lo8(ev), lo8(ev), se);
        se = _mm256_fmadd_ps(hi8(ev), hi8(ev), se);
        sd = _mm256_fmadd_ps(lo8(d), lo8(d), sd);
        sd = _mm256_fmadd_ps(hi8(d), hi8(d), sd);
    }
    if (i + 8 <= n) {
        gptq_errors8(x, q, _mm256_set1_ps(upp), w0, e, i, &se, &sd);
        i += 8;
    }
    return gptq_errors_finish(se, sd, x, q, upp, w0, i, n, e, dsq);
}

/* gptq_avx2.c's loop_column_step for 16 * nv rows from i0, without the codes (the search
 * needs the values alone). */
INLINE void loop_column_step(const mq_qspec *s, float ubb, int nv, int64_t i0, const float *step,
                             const float *zero, const float *w, float *q, float *eb, double *score) {
    for (int64_t i = i0; i < i0 + 16 * nv; i += 16)
        qdq16(s, step + i, s->asym ? zero + i : zero, w + i, NULL, q + i);
    const __m512 u = _mm512_set1_ps(ubb);
    for (int64_t i = i0; i < i0 + 16 * nv; i += 16) {
        __m512 ev = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(q + i)), u);
        _mm512_storeu_ps(eb + i, ev);
        __m512d lo = _mm512_cvtps_pd(lo8(ev)), hi = _mm512_cvtps_pd(hi8(ev));
        _mm512_storeu_pd(score + i, _mm512_add_pd(_mm512_loadu_pd(score + i), _mm512_mul_pd(lo, lo)));
        _mm512_storeu_pd(score + i + 8, _mm512_add_pd(_mm512_loadu_pd(score + i + 8), _mm512_mul_pd(hi, hi)));
    }
}

/* mq_gptq_loop_scores_ref for 64 rows (nv = 4) or 16 rows (nv = 1) from i0, as the AVX2 twin's
 * loop_scores_rows: each row's value of column b stays in a register while the errors of the
 * earlier columns are subtracted in order. */
static void loop_scores_rows(const mq_qspec *s, const float *ucol, int64_t G, const float *x,
                             int64_t ld, int64_t i0, int nv, const float *step, const float *zero,
                             float *e, float *w, float *q, double *score) {
    for (int64_t i = i0; i < i0 + 16 * nv; i++) score[i] = 0;
    for (int64_t b = 0; b < G; b++) {
        const float *ub = ucol + b * G, *ea = e + i0, *xb = x + b * ld + i0;
        if (nv == 4) {
            __m512 a0 = _mm512_loadu_ps(xb), a1 = _mm512_loadu_ps(xb + 16);
            __m512 a2 = _mm512_loadu_ps(xb + 32), a3 = _mm512_loadu_ps(xb + 48);
            for (int64_t a = 0; a < b; a++, ea += ld) {
                const __m512 u = _mm512_set1_ps(ub[a]);
                a0 = _mm512_sub_ps(a0, _mm512_mul_ps(u, _mm512_loadu_ps(ea)));
                a1 = _mm512_sub_ps(a1, _mm512_mul_ps(u, _mm512_loadu_ps(ea + 16)));
                a2 = _mm512_sub_ps(a2, _mm512_mul_ps(u, _mm512_loadu_ps(ea + 32)));
                a3 = _mm512_sub_ps(a3, _mm512_mul_ps(u, _mm512_loadu_ps(ea + 48)));
            }
            _mm512_storeu_ps(w + i0, a0);
            _mm512_storeu_ps(w + i0 + 16, a1);
            _mm512_storeu_ps(w + i0 + 32, a2);
            _mm512_storeu_ps(w + i0 + 48, a3);
        } else {
            __m512 a0 = _mm512_loadu_ps(xb);
            for (int64_t a = 0; a < b; a++, ea += ld)
                a0 = _mm512_sub_ps(a0, _mm512_mul_ps(_mm512_set1_ps(ub[a]), _mm512_loadu_ps(ea)));
            _mm512_storeu_ps(w + i0, a0);
        }
        loop_column_step(s, ub[b], nv, i0, step, zero, w, q, e + b * ld, score);
    }
}

/* The rows past the last 16 as the AVX2 twin computes them (rows are independent). */
void mq_gptq_loop_scores_avx512(const mq_qspec *s, const float *ucol, int64_t G, const float *x,
                                int64_t ld, int64_t n, const float *step, const float *zero,
                                float *work, uint8_t *code, double *score) {
    gptq_loop_scores_run(s, ucol, G, x, ld, n, step, zero, work, code, score, 16, loop_scores_rows,
                         mq_gptq_loop_scores_avx2);
}

const mq_gptq_kernels mq_gptq_kernels_avx512 = {mq_gptq_qdq_column_avx512, mq_gptq_column_errors_avx512,
                                              mq_gptq_loop_scores_avx512};
