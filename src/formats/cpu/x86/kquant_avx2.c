/*
 * AVX2 twin of the K-quant grid scoring (mq_kq_sse_ref in src/formats/kquant.c): the candidate
 * grids (step, offset) of one sub-block go in the 8 lanes, the sub-block's values are walked in
 * order, so every candidate's double sum is accumulated in exactly the scalar order and the
 * scores are bit-identical. Per value and candidate the IEEE operations are kquant.c's
 * round_code and mq_kq_value: q = rint((x + off) / step) (asymmetric) or rint(x / step) + zero
 * (symmetric), clamped to qmin..qmax, the fixed code of the value 0 when step is 0; x^ = step * q
 * - off or step * (q - zero); d = (double)x - (double)x^; sum += (w * d) * d (no w: d * d). The
 * build is ISO C (no FP contraction), so no multiply-add is fused.
 * A table type (IQ4) rounds x / step to the nearest of its 16 values (a tie to the lower) and
 * x^ = step * value, the rest as the symmetric grids.
 * Also the twins of the sub-block fits' trials (mq_kq_asym_trials_ref, mq_kq_sym_trials_ref,
 * mq_kq_table_trials_ref): the trial inverse scales in the lanes, each lane's float sums over
 * the values in order.
 */
#include <immintrin.h>

#include "formats/cpu/simd.h"

/* A table type's grid (IQ4: 16 ascending integers) as the vectors of the nearest-value lookup:
 * the midpoints between neighbours (0.5f * (tab[m] + tab[m + 1]), kquant.c's nearest_in_table)
 * for a four-level bisection, and the values as floats. */
typedef struct {
    __m256 m7, m3, m11;   /* the first two levels' midpoints, broadcast */
    __m256 l3, l4;        /* level 3: mid[1], mid[5], mid[9], mid[13]; level 4: mid[0], mid[2] .. mid[14] */
    __m256 tlo, thi;      /* the values of codes 0..7 and 8..15 */
} kq_tab8;

static inline kq_tab8 kq_tab8_of(const int8_t *tab) {
    float mid[15], l3[8] = {0}, l4[8], tl[8], th[8];
    for (int m = 0; m < 15; m++) mid[m] = 0.5f * (float)(tab[m] + tab[m + 1]);
    for (int j = 0; j < 4; j++) l3[j] = mid[4 * j + 1];
    for (int j = 0; j < 8; j++) {
        l4[j] = mid[2 * j];
        tl[j] = (float)tab[j];
        th[j] = (float)tab[8 + j];
    }
    return (kq_tab8){_mm256_set1_ps(mid[7]), _mm256_set1_ps(mid[3]), _mm256_set1_ps(mid[11]),
                     _mm256_loadu_ps(l3), _mm256_loadu_ps(l4), _mm256_loadu_ps(tl), _mm256_loadu_ps(th)};
}

/* The code nearest v in each lane: the number of midpoints v exceeds (v > mid, so a tie goes
 * to the lower and NaN to code 0), found by bisection: the code's bits 8, 4, 2, 1 in turn, each
 * from one comparison with the midpoint just below the upper half of what is left. */
static inline __m256i kq_tab_code(const kq_tab8 *T, __m256 v) {
    const __m256 c8 = _mm256_cmp_ps(v, T->m7, _CMP_GT_OQ);
    const __m256 c4 = _mm256_cmp_ps(v, _mm256_blendv_ps(T->m3, T->m11, c8), _CMP_GT_OQ);
    __m256i idx = _mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(c8), _mm256_set1_epi32(8)),
                                  _mm256_and_si256(_mm256_castps_si256(c4), _mm256_set1_epi32(4)));
    const __m256 c2 = _mm256_cmp_ps(v, _mm256_permutevar8x32_ps(T->l3, _mm256_srli_epi32(idx, 2)), _CMP_GT_OQ);
    idx = _mm256_or_si256(idx, _mm256_and_si256(_mm256_castps_si256(c2), _mm256_set1_epi32(2)));
    const __m256 c1 = _mm256_cmp_ps(v, _mm256_permutevar8x32_ps(T->l4, _mm256_srli_epi32(idx, 1)), _CMP_GT_OQ);
    return _mm256_or_si256(idx, _mm256_and_si256(_mm256_castps_si256(c1), _mm256_set1_epi32(1)));
}

/* The table value of code idx: the permutes read idx's low 3 bits (the code within its half),
 * the blend its bit 3 (moved to the sign). */
static inline __m256 kq_tab_at(const kq_tab8 *T, __m256i idx) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(T->tlo, idx), _mm256_permutevar8x32_ps(T->thi, idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

static inline __m256 kq_tab_value(const kq_tab8 *T, __m256 v) { return kq_tab_at(T, kq_tab_code(T, v)); }

/* The grid kinds of kq_sse_body. */
enum { KQ_SYM, KQ_ASYM, KQ_TAB };

/* Scores candidate vectors 0 .. nv - 1 (of 8) together: nv independent chains of double adds
 * hide their latency, and each lane's sum still runs over the values in order. Inlined into
 * callers with constant nv, kind and weighted, so the loops unroll, the sums stay in registers
 * and no test is left in the loop. A table grid (KQ_TAB): x / step (0 where the step is 0, as
 * round_code takes the value 0), its nearest table value tv, x^ = step * tv. */
static inline __attribute__((always_inline)) void
kq_sse_body(const mq_kq_info *t, const float *step, const float *off, const float *x, int64_t n,
            int64_t stride, const float *w, double *sse, const int nv, const int kind,
            const bool weighted) {
    const bool asym = kind == KQ_ASYM;
    const __m256 lo = _mm256_set1_ps((float)t->qmin), hi = _mm256_set1_ps((float)t->qmax);
    const __m256 zp = _mm256_set1_ps(asym ? 0.0f : (float)t->zero);
    /* the code a zero step gives every value (round_code) */
    const __m256 q0 = _mm256_set1_ps((float)(asym ? t->qmin : t->zero));
    kq_tab8 T;
    if (kind == KQ_TAB) T = kq_tab8_of(t->table);
    __m256 st[4], of[4], zs[4];
    __m256d acc[8];
    for (int k = 0; k < nv; k++) {
        st[k] = _mm256_loadu_ps(step + 8 * k);
        of[k] = asym ? _mm256_loadu_ps(off + 8 * k) : _mm256_setzero_ps();
        zs[k] = _mm256_cmp_ps(st[k], _mm256_setzero_ps(), _CMP_EQ_OQ);
        acc[2 * k] = acc[2 * k + 1] = _mm256_setzero_pd();
    }
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i * stride];
        const __m256 xv = _mm256_set1_ps(v);
        const __m256d vd = _mm256_set1_pd((double)v);
        const __m256d wv = _mm256_set1_pd(weighted ? (double)w[i] : 1.0);
#pragma GCC unroll 4
        for (int k = 0; k < nv; k++) {
            __m256 dq;
            if (kind == KQ_TAB) {
                const __m256 q = _mm256_blendv_ps(_mm256_div_ps(xv, st[k]), _mm256_setzero_ps(), zs[k]);
                dq = _mm256_mul_ps(st[k], kq_tab_value(&T, q));
            } else {
                __m256 q = asym ? _mm256_div_ps(_mm256_add_ps(xv, of[k]), st[k]) : _mm256_div_ps(xv, st[k]);
                q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                if (!asym) q = _mm256_add_ps(q, zp);
                q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
                q = _mm256_blendv_ps(q, q0, zs[k]);
                dq = asym ? _mm256_sub_ps(_mm256_mul_ps(st[k], q), of[k]) : _mm256_mul_ps(st[k], _mm256_sub_ps(q, zp));
            }
            __m256d d0 = _mm256_sub_pd(vd, _mm256_cvtps_pd(_mm256_castps256_ps128(dq)));
            __m256d d1 = _mm256_sub_pd(vd, _mm256_cvtps_pd(_mm256_extractf128_ps(dq, 1)));
            if (weighted) { /* (w * d) * d, the scalar's order; without w, d * d (1 * d is d) */
                d0 = _mm256_mul_pd(_mm256_mul_pd(wv, d0), d0);
                d1 = _mm256_mul_pd(_mm256_mul_pd(wv, d1), d1);
            } else {
                d0 = _mm256_mul_pd(d0, d0);
                d1 = _mm256_mul_pd(d1, d1);
            }
            acc[2 * k] = _mm256_add_pd(acc[2 * k], d0);
            acc[2 * k + 1] = _mm256_add_pd(acc[2 * k + 1], d1);
        }
    }
    for (int k = 0; k < 2 * nv; k++) _mm256_storeu_pd(sse + 4 * k, acc[k]);
}

/* One instance per vector count, grid kind and weighting. */
#define KQ_SSE_VARIANT(NAME, NV, KIND, W)                                                          \
    static void NAME(const mq_kq_info *t, const float *step, const float *off, const float *x,   \
                     int64_t n, int64_t stride, const float *w, double *sse) {                    \
        kq_sse_body(t, step, off, x, n, stride, w, sse, NV, KIND, W);                             \
    }
#define KQ_SSE_VARIANTS(NV)                                                                        \
    KQ_SSE_VARIANT(kq_sse_##NV##_sym, NV, KQ_SYM, false)                                           \
    KQ_SSE_VARIANT(kq_sse_##NV##_sym_w, NV, KQ_SYM, true)                                          \
    KQ_SSE_VARIANT(kq_sse_##NV##_asym, NV, KQ_ASYM, false)                                         \
    KQ_SSE_VARIANT(kq_sse_##NV##_asym_w, NV, KQ_ASYM, true)                                        \
    KQ_SSE_VARIANT(kq_sse_##NV##_tab, NV, KQ_TAB, false)                                           \
    KQ_SSE_VARIANT(kq_sse_##NV##_tab_w, NV, KQ_TAB, true)
KQ_SSE_VARIANTS(1)
KQ_SSE_VARIANTS(2)
KQ_SSE_VARIANTS(3)
KQ_SSE_VARIANTS(4)

typedef void (*kq_sse_fn)(const mq_kq_info *, const float *, const float *, const float *, int64_t,
                          int64_t, const float *, double *);

void mq_kq_sse_avx2(const mq_kq_info *t, const float *step, const float *off, int nc,
                    const float *x, int64_t n, int64_t stride, const float *w, double *sse) {
    /* [vectors - 1][kind][weighted] */
    static const kq_sse_fn fns[4][3][2] = {
        {{kq_sse_1_sym, kq_sse_1_sym_w}, {kq_sse_1_asym, kq_sse_1_asym_w}, {kq_sse_1_tab, kq_sse_1_tab_w}},
        {{kq_sse_2_sym, kq_sse_2_sym_w}, {kq_sse_2_asym, kq_sse_2_asym_w}, {kq_sse_2_tab, kq_sse_2_tab_w}},
        {{kq_sse_3_sym, kq_sse_3_sym_w}, {kq_sse_3_asym, kq_sse_3_asym_w}, {kq_sse_3_tab, kq_sse_3_tab_w}},
        {{kq_sse_4_sym, kq_sse_4_sym_w}, {kq_sse_4_asym, kq_sse_4_asym_w}, {kq_sse_4_tab, kq_sse_4_tab_w}},
    };
    const int kind = t->table ? KQ_TAB : t->zero < 0 ? KQ_ASYM : KQ_SYM, weighted = w != NULL;
    for (int c0 = 0; c0 < nc; c0 += 32) {
        const int nv = (nc - c0 + 7) / 8;
        fns[(nv < 4 ? nv : 4) - 1][kind][weighted](t, step + c0, off + c0, x, n, stride, w, sse + c0);
    }
}

/* l = rint(iscale * t) with the scalar's clamp (l < lo ? lo : l > top ? top : l, a -0 kept). */
static inline __m256 kq_code(__m256 iscale, __m256 t, __m256 lo, __m256 top) {
    __m256 l = _mm256_round_ps(_mm256_mul_ps(iscale, t), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    l = _mm256_blendv_ps(l, lo, _mm256_cmp_ps(l, lo, _CMP_LT_OQ));
    return _mm256_blendv_ps(l, top, _mm256_cmp_ps(l, top, _CMP_GT_OQ));
}

/* The trials of NV vectors (of 8) together: the sums of each lane run over the values in order,
 * in float, as the scalar's; the refit and its error per lane (the error in double). */
#define KQ_ASYM_BLOCK(NV)                                                                          \
    static void kq_asym_##NV(const float *x, int64_t n, int64_t stride, const float *w,           \
                             const mq_kq_sums *s, const float *iscale, float *D, float *sc,        \
                             float *mn, double *e) {                                               \
        const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps((float)s->nmax);            \
        __m256 is[NV], sl[NV], sl2[NV], sxl[NV], scv[NV], mnv[NV];                                \
        __m256d acc[2 * NV];                                                                       \
        for (int k = 0; k < NV; k++) {                                                             \
            is[k] = _mm256_loadu_ps(iscale + 8 * k);                                               \
            sl[k] = sl2[k] = sxl[k] = zero;                                                        \
            acc[2 * k] = acc[2 * k + 1] = _mm256_setzero_pd();                                    \
        }                                                                                          \
        for (int64_t i = 0; i < n; i++) {                                                          \
            const float v = x[i * stride];                                                         \
            const __m256 xv = _mm256_set1_ps(v), wv = _mm256_set1_ps(w ? w[i] : 1.0f);             \
            const __m256 t = _mm256_set1_ps(v - s->min);                                           \
            for (int k = 0; k < NV; k++) {                                                         \
                const __m256 l = kq_code(is[k], t, zero, top);                                     \
                const __m256 wl = _mm256_mul_ps(wv, l);                                            \
                sl[k] = _mm256_add_ps(sl[k], wl);                                                  \
                sl2[k] = _mm256_add_ps(sl2[k], _mm256_mul_ps(wl, l));                              \
                sxl[k] = _mm256_add_ps(sxl[k], _mm256_mul_ps(wl, xv));                             \
            }                                                                                      \
        }                                                                                          \
        const __m256 sw = _mm256_set1_ps(s->sum_w), sx = _mm256_set1_ps(s->sum_x);                \
        for (int k = 0; k < NV; k++) {                                                             \
            const __m256 dv = _mm256_sub_ps(_mm256_mul_ps(sw, sl2[k]), _mm256_mul_ps(sl[k], sl[k])); \
            scv[k] = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sw, sxl[k]), _mm256_mul_ps(sx, sl[k])), dv); \
            mnv[k] = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sl2[k], sx), _mm256_mul_ps(sl[k], sxl[k])), dv); \
            if (s->clamp) { /* a positive min: 0, the scale refitted alone */                     \
                const __m256 pos = _mm256_cmp_ps(mnv[k], zero, _CMP_GT_OQ);                        \
                mnv[k] = _mm256_blendv_ps(mnv[k], zero, pos);                                      \
                scv[k] = _mm256_blendv_ps(scv[k], _mm256_div_ps(sxl[k], sl2[k]), pos);             \
            }                                                                                      \
            _mm256_storeu_ps(D + 8 * k, dv);                                                       \
            _mm256_storeu_ps(sc + 8 * k, scv[k]);                                                  \
            _mm256_storeu_ps(mn + 8 * k, mnv[k]);                                                  \
        }                                                                                          \
        for (int64_t i = 0; i < n; i++) {                                                          \
            const float v = x[i * stride];                                                         \
            const __m256 xv = _mm256_set1_ps(v), t = _mm256_set1_ps(v - s->min);                   \
            const __m256d wv = _mm256_set1_pd((double)(w ? w[i] : 1.0f));                          \
            for (int k = 0; k < NV; k++) {                                                         \
                const __m256 l = kq_code(is[k], t, zero, top);                                     \
                const __m256 d = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scv[k], l), mnv[k]), xv); \
                const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(d));                     \
                const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1));                   \
                acc[2 * k] = _mm256_add_pd(acc[2 * k], _mm256_mul_pd(_mm256_mul_pd(wv, d0), d0));  \
                acc[2 * k + 1] = _mm256_add_pd(acc[2 * k + 1], _mm256_mul_pd(_mm256_mul_pd(wv, d1), d1)); \
            }                                                                                      \
        }                                                                                          \
        for (int k = 0; k < 2 * NV; k++) _mm256_storeu_pd(e + 4 * k, acc[k]);                     \
    }
KQ_ASYM_BLOCK(1)
KQ_ASYM_BLOCK(2)
KQ_ASYM_BLOCK(3)

void mq_kq_asym_trials_avx2(const float *x, int64_t n, int64_t stride, const float *w,
                            const mq_kq_sums *s, const float *iscale, int nt, float *D, float *sc,
                            float *mn, double *e) {
    for (int k0 = 0; k0 < nt; k0 += 24) {
        const int nv = (nt - k0 + 7) / 8;
        if (nv >= 3) kq_asym_3(x, n, stride, w, s, iscale + k0, D + k0, sc + k0, mn + k0, e + k0);
        else if (nv == 2) kq_asym_2(x, n, stride, w, s, iscale + k0, D + k0, sc + k0, mn + k0, e + k0);
        else kq_asym_1(x, n, stride, w, s, iscale + k0, D + k0, sc + k0, mn + k0, e + k0);
    }
}

/* The symmetric and the table fits' trials, nv vectors of 8 together: per lane the code value c
 * of x at its trial's inverse scale (symmetric: l = rint(iscale * x) clamped to -nmax..nmax-1;
 * table: the table value nearest x * iscale) and the float sums over the values in order of
 * (w x) c and (w c) c, as the scalars'. Inlined with constant nv and kind. */
static inline __attribute__((always_inline)) void
kq_lx_body(const kq_tab8 *T, int nmax, const float *x, int64_t n, int64_t stride, const float *w,
           const float *iscale, float *sumlx, float *suml2, const int nv, const bool table) {
    const __m256 lo = _mm256_set1_ps((float)-nmax), top = _mm256_set1_ps((float)(nmax - 1));
    __m256 is[3], slx[3], sl2[3];
    for (int k = 0; k < nv; k++) {
        is[k] = _mm256_loadu_ps(iscale + 8 * k);
        slx[k] = sl2[k] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i * stride], wi = w ? w[i] : 1.0f;
        const __m256 xv = _mm256_set1_ps(v), wv = _mm256_set1_ps(wi);
        const __m256 wx = _mm256_set1_ps(wi * v);
        for (int k = 0; k < nv; k++) {
            const __m256 c = table ? kq_tab_value(T, _mm256_mul_ps(xv, is[k])) : kq_code(is[k], xv, lo, top);
            slx[k] = _mm256_add_ps(slx[k], _mm256_mul_ps(wx, c));
            sl2[k] = _mm256_add_ps(sl2[k], _mm256_mul_ps(_mm256_mul_ps(wv, c), c));
        }
    }
    for (int k = 0; k < nv; k++) {
        _mm256_storeu_ps(sumlx + 8 * k, slx[k]);
        _mm256_storeu_ps(suml2 + 8 * k, sl2[k]);
    }
}

#define KQ_LX_VARIANT(NAME, NV, TABLE)                                                             \
    static void NAME(const kq_tab8 *T, int nmax, const float *x, int64_t n, int64_t stride,       \
                     const float *w, const float *iscale, float *sumlx, float *suml2) {            \
        kq_lx_body(T, nmax, x, n, stride, w, iscale, sumlx, suml2, NV, TABLE);                     \
    }
KQ_LX_VARIANT(kq_sym_1, 1, false)
KQ_LX_VARIANT(kq_sym_2, 2, false)
KQ_LX_VARIANT(kq_sym_3, 3, false)
KQ_LX_VARIANT(kq_tab_1, 1, true)
KQ_LX_VARIANT(kq_tab_2, 2, true)
KQ_LX_VARIANT(kq_tab_3, 3, true)

typedef void (*kq_lx_fn)(const kq_tab8 *, int, const float *, int64_t, int64_t, const float *,
                         const float *, float *, float *);

/* Trials k0 .. k0 + 23 at a time by the variant of their vector count. */
static void kq_lx_trials(const kq_lx_fn fns[3], const kq_tab8 *T, int nmax, const float *x, int64_t n,
                         int64_t stride, const float *w, const float *iscale, int nt, float *sumlx,
                         float *suml2) {
    for (int k0 = 0; k0 < nt; k0 += 24) {
        const int nv = (nt - k0 + 7) / 8;
        fns[(nv < 3 ? nv : 3) - 1](T, nmax, x, n, stride, w, iscale + k0, sumlx + k0, suml2 + k0);
    }
}

void mq_kq_sym_trials_avx2(const float *x, int64_t n, int64_t stride, const float *w, int nmax,
                           const float *iscale, int nt, float *sumlx, float *suml2) {
    static const kq_lx_fn fns[3] = {kq_sym_1, kq_sym_2, kq_sym_3};
    kq_lx_trials(fns, NULL, nmax, x, n, stride, w, iscale, nt, sumlx, suml2);
}

void mq_kq_table_trials_avx2(const int8_t *tab, const float *x, int64_t n, int64_t stride,
                             const float *w, const float *iscale, int nt, float *sxt, float *stt) {
    static const kq_lx_fn fns[3] = {kq_tab_1, kq_tab_2, kq_tab_3};
    const kq_tab8 T = kq_tab8_of(tab);
    kq_lx_trials(fns, &T, 0, x, n, stride, w, iscale, nt, sxt, stt);
}

int64_t mq_kq_qdq_table_avx2(const int8_t *tab, const float *step, bool per_value, const float *x,
                             int64_t n, uint8_t *code, float *dq) {
    const kq_tab8 T = kq_tab8_of(tab);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 st = per_value ? _mm256_loadu_ps(step + i) : _mm256_set1_ps(step[0]);
        const __m256 zs = _mm256_cmp_ps(st, _mm256_setzero_ps(), _CMP_EQ_OQ);
        const __m256i c = kq_tab_code(&T, _mm256_blendv_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), st),
                                                           _mm256_setzero_ps(), zs));
        if (dq) _mm256_storeu_ps(dq + i, _mm256_mul_ps(st, kq_tab_at(&T, c)));
        if (code) { /* 8 codes 0..15: to 16 bits, then to bytes, in order */
            const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
            _mm_storel_epi64((__m128i *)(code + i), _mm_packus_epi16(w16, w16));
        }
    }
    return i;
}
