/*
 * AVX-512 twins of the table types' (IQ4_NL, IQ4_XS) grid scoring and fit trials
 * (mq_kq_sse_ref for a type with a table, mq_kq_table_trials_ref; src/formats/kquant.c), called
 * only when mq_cpu_has_avx512(). The operations per value and lane are kquant_avx2.c's on 16
 * lanes: the candidates (or trials) in the lanes, the values walked in order, so each lane's sum
 * (double for the scores, float for the trials) runs in the scalar's order and the results are
 * bit-identical. Rounding to the table: the number of midpoints between neighbouring values
 * that x / step exceeds (a tie to the lower, NaN to code 0), by a bisection whose midpoints and
 * values come from one 16-entry permute each. Lanes past the count are masked off: the arrays
 * need only the references' length (a multiple of 8). ISO C build: no multiply-add is fused.
 */
#include <immintrin.h>

#include "formats/cpu/simd.h"

/* The table's midpoints (0.5f * (tab[m] + tab[m + 1]), m = 0..14, lane 15 unused) and values. */
typedef struct {
    __m512 mid, val;
} kq_tab16;

static inline kq_tab16 kq_tab16_of(const int8_t *tab) {
    float mid[16], val[16];
    for (int m = 0; m < 16; m++) {
        mid[m] = m < 15 ? 0.5f * (float)(tab[m] + tab[m + 1]) : 0.0f;
        val[m] = (float)tab[m];
    }
    return (kq_tab16){_mm512_loadu_ps(mid), _mm512_loadu_ps(val)};
}

/* The table value of the code nearest v per lane: the code's bits 8, 4, 2, 1 in turn, each set
 * where v exceeds the midpoint just below the upper half of what is left (idx | (bit - 1)). */
static inline __m512 kq_tab_value16(const kq_tab16 *T, __m512 v) {
    __m512i idx = _mm512_setzero_si512();
    for (int bit = 8; bit; bit >>= 1) {
        const __m512 m = _mm512_permutexvar_ps(_mm512_or_si512(idx, _mm512_set1_epi32(bit - 1)), T->mid);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ);
        idx = _mm512_mask_or_epi32(idx, gt, idx, _mm512_set1_epi32(bit));
    }
    return _mm512_permutexvar_ps(idx, T->val);
}

/* The lanes of vector k (of 16) that hold one of the first cnt entries. */
static inline __mmask16 lanes(int cnt, int k) {
    const int r = cnt - 16 * k;
    return r >= 16 ? (__mmask16)0xFFFF : r <= 0 ? (__mmask16)0 : (__mmask16)((1u << r) - 1);
}

/* Scores candidates 0 .. cnt - 1 (cnt <= 16 nv) together: x^ = step * (the value nearest
 * x / step; x / step taken as 0 where the step is 0), d = (double)x - (double)x^, each lane's
 * double sum of (w d) d (no w: d d) over the values in order. */
static inline __attribute__((always_inline)) void
kq_tab_sse_body(const kq_tab16 *T, const float *step, int cnt, const float *x, int64_t n,
                int64_t stride, const float *w, double *sse, const int nv, const bool weighted) {
    __m512 st[4];
    __mmask16 zs[4];
    __m512d acc[8];
    for (int k = 0; k < nv; k++) {
        st[k] = _mm512_maskz_loadu_ps(lanes(cnt, k), step + 16 * k);
        zs[k] = _mm512_cmp_ps_mask(st[k], _mm512_setzero_ps(), _CMP_EQ_OQ);
        acc[2 * k] = acc[2 * k + 1] = _mm512_setzero_pd();
    }
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i * stride];
        const __m512 xv = _mm512_set1_ps(v);
        const __m512d vd = _mm512_set1_pd((double)v);
        const __m512d wv = _mm512_set1_pd(weighted ? (double)w[i] : 1.0);
#pragma GCC unroll 4
        for (int k = 0; k < nv; k++) {
            const __m512 q = _mm512_mask_blend_ps(zs[k], _mm512_div_ps(xv, st[k]), _mm512_setzero_ps());
            const __m512 dq = _mm512_mul_ps(st[k], kq_tab_value16(T, q));
            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(dq), 1));
            __m512d d0 = _mm512_sub_pd(vd, _mm512_cvtps_pd(_mm512_castps512_ps256(dq)));
            __m512d d1 = _mm512_sub_pd(vd, _mm512_cvtps_pd(hi));
            if (weighted) { /* (w * d) * d, the scalar's order */
                d0 = _mm512_mul_pd(_mm512_mul_pd(wv, d0), d0);
                d1 = _mm512_mul_pd(_mm512_mul_pd(wv, d1), d1);
            } else {
                d0 = _mm512_mul_pd(d0, d0);
                d1 = _mm512_mul_pd(d1, d1);
            }
            acc[2 * k] = _mm512_add_pd(acc[2 * k], d0);
            acc[2 * k + 1] = _mm512_add_pd(acc[2 * k + 1], d1);
        }
    }
    for (int k = 0; k < nv; k++) {
        const __mmask16 m = lanes(cnt, k);
        _mm512_mask_storeu_pd(sse + 16 * k, (__mmask8)(m & 0xFF), acc[2 * k]);
        _mm512_mask_storeu_pd(sse + 16 * k + 8, (__mmask8)(m >> 8), acc[2 * k + 1]);
    }
}

#define KQ_TAB_SSE_VARIANT(NAME, NV, W)                                                            \
    static void NAME(const kq_tab16 *T, const float *step, int cnt, const float *x, int64_t n,     \
                     int64_t stride, const float *w, double *sse) {                                \
        kq_tab_sse_body(T, step, cnt, x, n, stride, w, sse, NV, W);                                \
    }
KQ_TAB_SSE_VARIANT(kq_tab_sse_1, 1, false)
KQ_TAB_SSE_VARIANT(kq_tab_sse_1_w, 1, true)
KQ_TAB_SSE_VARIANT(kq_tab_sse_2, 2, false)
KQ_TAB_SSE_VARIANT(kq_tab_sse_2_w, 2, true)
KQ_TAB_SSE_VARIANT(kq_tab_sse_3, 3, false)
KQ_TAB_SSE_VARIANT(kq_tab_sse_3_w, 3, true)
KQ_TAB_SSE_VARIANT(kq_tab_sse_4, 4, false)
KQ_TAB_SSE_VARIANT(kq_tab_sse_4_w, 4, true)

typedef void (*kq_tab_sse_fn)(const kq_tab16 *, const float *, int, const float *, int64_t, int64_t,
                              const float *, double *);

void mq_kq_sse_table_avx512(const mq_kq_info *t, const float *step, int nc, const float *x,
                            int64_t n, int64_t stride, const float *w, double *sse) {
    /* [vectors - 1][weighted] */
    static const kq_tab_sse_fn fns[4][2] = {{kq_tab_sse_1, kq_tab_sse_1_w}, {kq_tab_sse_2, kq_tab_sse_2_w},
                                            {kq_tab_sse_3, kq_tab_sse_3_w}, {kq_tab_sse_4, kq_tab_sse_4_w}};
    const kq_tab16 T = kq_tab16_of(t->table);
    for (int c0 = 0; c0 < nc; c0 += 64) {
        const int cnt = nc - c0 < 64 ? nc - c0 : 64, nv = (cnt + 15) / 16;
        fns[nv - 1][w != NULL](&T, step + c0, cnt, x, n, stride, w, sse + c0);
    }
}

/* The table fit's trials 0 .. cnt - 1 (cnt <= 16 NV) together: each lane's float sums over the
 * values in order of (w x) t and (w t) t, t the table value nearest x * iscale. */
#define KQ_TAB_TRIALS(NV)                                                                          \
    static void kq_tab_trials_##NV(const kq_tab16 *T, const float *x, int64_t n, int64_t stride,  \
                                   const float *w, const float *iscale, int cnt, float *sxt,       \
                                   float *stt) {                                                   \
        __m512 is[NV], sx[NV], s2[NV];                                                             \
        for (int k = 0; k < NV; k++) {                                                             \
            is[k] = _mm512_maskz_loadu_ps(lanes(cnt, k), iscale + 16 * k);                         \
            sx[k] = s2[k] = _mm512_setzero_ps();                                                   \
        }                                                                                          \
        for (int64_t i = 0; i < n; i++) {                                                          \
            const float v = x[i * stride], wi = w ? w[i] : 1.0f;                                   \
            const __m512 xv = _mm512_set1_ps(v), wv = _mm512_set1_ps(wi);                          \
            const __m512 wx = _mm512_set1_ps(wi * v);                                              \
            for (int k = 0; k < NV; k++) {                                                         \
                const __m512 tv = kq_tab_value16(T, _mm512_mul_ps(xv, is[k]));                     \
                sx[k] = _mm512_add_ps(sx[k], _mm512_mul_ps(wx, tv));                               \
                s2[k] = _mm512_add_ps(s2[k], _mm512_mul_ps(_mm512_mul_ps(wv, tv), tv));            \
            }                                                                                      \
        }                                                                                          \
        for (int k = 0; k < NV; k++) {                                                             \
            _mm512_mask_storeu_ps(sxt + 16 * k, lanes(cnt, k), sx[k]);                             \
            _mm512_mask_storeu_ps(stt + 16 * k, lanes(cnt, k), s2[k]);                             \
        }                                                                                          \
    }
KQ_TAB_TRIALS(1)
KQ_TAB_TRIALS(2)
KQ_TAB_TRIALS(3)

void mq_kq_table_trials_avx512(const int8_t *tab, const float *x, int64_t n, int64_t stride,
                               const float *w, const float *iscale, int nt, float *sxt, float *stt) {
    const kq_tab16 T = kq_tab16_of(tab);
    for (int k0 = 0; k0 < nt; k0 += 48) {
        const int cnt = nt - k0 < 48 ? nt - k0 : 48, nv = (cnt + 15) / 16;
        if (nv == 3) kq_tab_trials_3(&T, x, n, stride, w, iscale + k0, cnt, sxt + k0, stt + k0);
        else if (nv == 2) kq_tab_trials_2(&T, x, n, stride, w, iscale + k0, cnt, sxt + k0, stt + k0);
        else kq_tab_trials_1(&T, x, n, stride, w, iscale + k0, cnt, sxt + k0, stt + k0);
    }
}
