/*
 * AVX-512F vector kernels (src/kernels/vec.h), twins of src/kernels/cpu/ref/vec_ref.c with
 * bit-identical results, called only when mq_cpu_has_avx512(). The reductions' lane layout (two
 * 8-lane fp32 accumulators by block parity; for the double sums, the low and high half of each
 * 8-block) is exactly one zmm: fp32 lanes 0-7 are the even accumulator and 8-15 the odd one;
 * double lanes 0-3 and 4-7 the two halves. So a 16-float step here is two 8-float steps of the
 * AVX2 kernels (vec_avx2.c), and a tail touches exactly the lanes the AVX2 kernels touch (the
 * write masks below), with zeros beyond n where they load zeros. The row-parallel kernels
 * (gemv: 8 rows, gemv_t: 128 columns at a time) keep each output's own order of operations.
 */
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/x86/exp_avx512.h"
#include "kernels/cpu/x86/vec_reduce_avx2.h"
#include "kernels/cpu/vec_edges.h"
#include "kernels/vec.h"

#define INLINE static inline __attribute__((always_inline))

/* The first k of 16 lanes (0 <= k <= 16). */
INLINE __mmask16 first(int64_t k) { return (__mmask16)(k >= 16 ? 0xffff : (1u << k) - 1u); }
/* The lanes of the 8-blocks a tail of k (0 < k < 16) elements touches. */
INLINE __mmask16 blocks(int64_t k) { return (__mmask16)(k > 8 ? 0xffff : 0x00ff); }

/* The halves of a zmm (lanes 0-7, 8-15; doubles 0-3, 4-7). */
INLINE __m256 lo8(__m512 v) { return _mm512_castps512_ps256(v); }
INLINE __m256 hi8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

/* The AVX2 twins' reductions of the two accumulators a zmm holds. */
INLINE float hsum16(__m512 v) { return mq_hsum8_avx2(lo8(v), hi8(v)); }
INLINE double hsum8d(__m512d v) { return mq_hsum4d_avx2(_mm512_castpd512_pd256(v), _mm512_extractf64x4_pd(v, 1)); }

static float dot_avx512(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        __mmask16 m = first(n - i);
        __m512 va = _mm512_maskz_loadu_ps(m, a + i), vb = _mm512_maskz_loadu_ps(m, b + i);
        acc = _mm512_mask3_fmadd_ps(va, vb, acc, blocks(n - i));
    }
    return hsum16(acc);
}

/* Eight rows of W against x at once (x loaded once per block); each row as dot_avx512. */
static void dot8(const float *W, int64_t ldw, const float *x, int64_t n, float alpha, float *y) {
    __m512 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 xv = _mm512_loadu_ps(x + i);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            /* the next eight rows, one line each per step: GEMV streams W once */
            _mm_prefetch((const char *)(W + (8 + r) * ldw + i), _MM_HINT_T0);
            acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(W + r * ldw + i), xv, acc[r]);
        }
    }
    if (i < n) {
        __mmask16 m = first(n - i), k = blocks(n - i);
        __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++)
            acc[r] = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(m, W + r * ldw + i), xv, acc[r], k);
    }
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) y[r] = alpha * hsum16(acc[r]);
}

MQ_VEC_GEMV(avx512, 8, dot8)

static void axpy_avx512(float a, const float *x, float *y, int64_t n) {
    __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        __mmask16 m = first(n - i);
        __m512 v = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, v);
    }
}

/* Columns in blocks of 128 held in eight accumulators over all rows, then blocks of 16 (the last
 * masked); every column takes its fmas in row order from +0. */
static void gemv_t_avx512(const float *V, int64_t ldv, int64_t rows, const float *a, int64_t n,
                          float *y) {
    int64_t j = 0;
    for (; j + 128 <= n; j += 128) {
        __m512 c[8];
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) c[u] = _mm512_setzero_ps();
        for (int64_t i = 0; i < rows; i++) {
            const float *v = V + i * ldv + j;
            __m512 ai = _mm512_set1_ps(a[i]);
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) c[u] = _mm512_fmadd_ps(ai, _mm512_loadu_ps(v + 16 * u), c[u]);
        }
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) _mm512_storeu_ps(y + j + 16 * u, c[u]);
    }
    for (; j < n; j += 16) {
        __mmask16 m = first(n - j);
        __m512 c = _mm512_setzero_ps();
        for (int64_t i = 0; i < rows; i++)
            c = _mm512_fmadd_ps(_mm512_set1_ps(a[i]), _mm512_maskz_loadu_ps(m, V + i * ldv + j), c);
        _mm512_mask_storeu_ps(y + j, m, c);
    }
}

static void rope_avx512(float *x, int64_t half, const float *c, const float *s) {
    for (int64_t i = 0; i < half; i += 16) {
        __mmask16 m = first(half - i);
        __m512 a = _mm512_maskz_loadu_ps(m, x + i), b = _mm512_maskz_loadu_ps(m, x + half + i);
        __m512 vc = _mm512_maskz_loadu_ps(m, c + i), vs = _mm512_maskz_loadu_ps(m, s + i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_sub_ps(_mm512_mul_ps(a, vc), _mm512_mul_ps(b, vs)));
        _mm512_mask_storeu_ps(x + half + i, m, _mm512_add_ps(_mm512_mul_ps(b, vc), _mm512_mul_ps(a, vs)));
    }
}

static void exp_avx512(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = first(n - i);
        _mm512_mask_storeu_ps(y + i, m, mq_exp_avx512(_mm512_maskz_loadu_ps(m, x + i)));
    }
}

/* vec_avx2.c's max_avx2: the two parity accumulators seeded with x[0] (lanes 0-7 and 8-15),
 * each max taken as maxps(value, accumulator), folded in its order. */
static float max_avx512(const float *x, int64_t n) {
    __m512 x0 = _mm512_set1_ps(x[0]), m = x0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + i), m);
    if (i < n) {
        __m512 v = _mm512_mask_loadu_ps(x0, first(n - i), x + i);
        m = _mm512_mask_max_ps(m, blocks(n - i), v, m);
    }
    return mq_hmax8_avx2(lo8(m), hi8(m));
}

static void softmax_avx512(float *x, int64_t n) {
    __m512 mx = _mm512_set1_ps(max_avx512(x, n));
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = mq_exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mx));
        _mm512_storeu_ps(x + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        __mmask16 m = first(n - i);
        __m512 e = _mm512_maskz_mov_ps(m, mq_exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), mx)));
        _mm512_mask_storeu_ps(x + i, m, e);
        acc = _mm512_mask_add_ps(acc, blocks(n - i), acc, e);
    }
    __m512 sum = _mm512_set1_ps(hsum16(acc));
    for (i = 0; i < n; i += 16) {
        __mmask16 m = first(n - i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), sum));
    }
}

/* exp(v - mx) of 8 floats (m: the lanes inside n) as 8 doubles, +0 outside m. */
INLINE __m512d exp8d(const float *p, __mmask8 m, __m512d mx) {
    __m512d d = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, p)), mx);
    return _mm512_maskz_mov_pd(m, mq_expd_avx512(d));
}

static double logsumexp_avx512(const float *x, int64_t n, int32_t *argmax) {
    float mxf = max_avx512(x, n);
    if (argmax) {
        __m512 mx = _mm512_set1_ps(mxf);
        int64_t am = 0, i = 0;
        for (; i + 16 <= n; i += 16)
            if (_mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mx, _CMP_EQ_OQ)) break;
        am = vec_first_equal_from(i, x, n, mxf);
        *argmax = (int32_t)am;
    }
    if (!isfinite(mxf)) return (double)mxf;
    __m512d mx = _mm512_set1_pd((double)mxf), d = _mm512_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) d = _mm512_add_pd(d, exp8d(x + i, 0xff, mx));
    if (i < n) d = _mm512_add_pd(d, exp8d(x + i, (__mmask8)((1u << (n - i)) - 1u), mx));
    return (double)mxf + log(hsum8d(d));
}

/* exp(a) * (a - b) of 8 lanes, a = lb - lse_b, b = lm - lse_m; +0 outside m. */
INLINE __m512d kl_term8(const float *lb, const float *lm, __mmask8 m, __m512d zb, __m512d zm) {
    __m512d a = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, lb)), zb);
    __m512d b = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, lm)), zm);
    return _mm512_maskz_mov_pd(m, _mm512_mul_pd(mq_expd_avx512(a), _mm512_sub_pd(a, b)));
}

static double kl_avx512(const float *lb, double lse_b, const float *lm, double lse_m, int64_t n) {
    __m512d zb = _mm512_set1_pd(lse_b), zm = _mm512_set1_pd(lse_m), d = _mm512_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) d = _mm512_add_pd(d, kl_term8(lb + i, lm + i, 0xff, zb, zm));
    if (i < n) d = _mm512_add_pd(d, kl_term8(lb + i, lm + i, (__mmask8)((1u << (n - i)) - 1u), zb, zm));
    return hsum8d(d);
}

static void rmsnorm_avx512(const float *x, int64_t n, const float *w, float eps, float *out) {
    __m512d d = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += 8) {
        __mmask8 m = (__mmask8)(n - i >= 8 ? 0xff : (1u << (n - i)) - 1u);
        __m512d v = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, x + i));
        d = _mm512_fmadd_pd(v, v, d);   /* exact product, one rounding: as the reference */
    }
    float var = (float)(hsum8d(d) / (double)n);
    float invf = 1.0f / sqrtf(var + eps);
    __m512 inv = _mm512_set1_ps(invf);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = first(n - i);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i),
                                 _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
        _mm512_mask_storeu_ps(out + i, m, v);
    }
}

static void swiglu_avx512(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = first(n - i);
        __m512 y = _mm512_mul_ps(mq_silu_avx512(_mm512_maskz_loadu_ps(m, g + i)),
                                 _mm512_maskz_loadu_ps(m, u + i));
        _mm512_mask_storeu_ps(g + i, m, y);
    }
}

const mq_vec_kernels mq_vec_avx512 = MQ_VEC_KERNELS_OF(avx512);
