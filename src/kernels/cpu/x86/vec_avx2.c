/*
 * AVX2+FMA vector kernels (src/kernels/vec.h), twins of src/kernels/cpu/ref/vec_ref.c with
 * bit-identical results: the same lane layout for every reduction, the same exp polynomial and
 * the same operation order. A last partial block of 8 is loaded with a mask (zeros beyond n) and
 * contributes exactly what the reference's padding does.
 */
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/x86/exp_avx2.h"
#include "kernels/cpu/x86/vec_reduce_avx2.h"
#include "kernels/cpu/vec_edges.h"
#include "kernels/vec.h"

#define INLINE static inline __attribute__((always_inline))

/* mask_tail(k): the first k of 8 lanes set (0 < k < 8). */
INLINE __m256i mask_tail(int64_t k) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)k), idx);
}

static float dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc[0]);
        acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc[1]);
    }
    int k = 0;
    if (i + 8 <= n) {
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc[0]);
        i += 8;
        k = 1;
    }
    if (i < n) {
        __m256i m = mask_tail(n - i);
        __m256 va = _mm256_maskload_ps(a + i, m), vb = _mm256_maskload_ps(b + i, m);
        acc[k] = _mm256_fmadd_ps(va, vb, acc[k]);
    }
    return mq_hsum8_avx2(acc[0], acc[1]);
}

/* Four rows of W against x at once (x loaded once per block); each row as dot_avx2. */
static void dot4(const float *W, int64_t ldw, const float *x, int64_t n, float alpha, float *y) {
    const float *w0 = W, *w1 = W + ldw, *w2 = W + 2 * ldw, *w3 = W + 3 * ldw;
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        /* the next four rows, one line each per step: GEMV streams W once, mostly from memory */
        _mm_prefetch((const char *)(w0 + 4 * ldw + i), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + 4 * ldw + i), _MM_HINT_T0);
        _mm_prefetch((const char *)(w2 + 4 * ldw + i), _MM_HINT_T0);
        _mm_prefetch((const char *)(w3 + 4 * ldw + i), _MM_HINT_T0);
        __m256 xa = _mm256_loadu_ps(x + i), xb = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xa, a0);
        b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i + 8), xb, b0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xa, a1);
        b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i + 8), xb, b1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xa, a2);
        b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i + 8), xb, b2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xa, a3);
        b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i + 8), xb, b3);
    }
    /* The rest (under 16) exactly as dot_avx2: a full block to accumulator a, the tail to the
     * accumulator of its block parity. */
    if (i < n) {
        bool full = i + 8 <= n;
        __m256i m = full ? _mm256_set1_epi32(-1) : mask_tail(n - i);
        __m256 xa = _mm256_maskload_ps(x + i, m);
        a0 = _mm256_fmadd_ps(_mm256_maskload_ps(w0 + i, m), xa, a0);
        a1 = _mm256_fmadd_ps(_mm256_maskload_ps(w1 + i, m), xa, a1);
        a2 = _mm256_fmadd_ps(_mm256_maskload_ps(w2 + i, m), xa, a2);
        a3 = _mm256_fmadd_ps(_mm256_maskload_ps(w3 + i, m), xa, a3);
        i += 8;
        if (full && i < n) {
            m = mask_tail(n - i);
            __m256 xb = _mm256_maskload_ps(x + i, m);
            b0 = _mm256_fmadd_ps(_mm256_maskload_ps(w0 + i, m), xb, b0);
            b1 = _mm256_fmadd_ps(_mm256_maskload_ps(w1 + i, m), xb, b1);
            b2 = _mm256_fmadd_ps(_mm256_maskload_ps(w2 + i, m), xb, b2);
            b3 = _mm256_fmadd_ps(_mm256_maskload_ps(w3 + i, m), xb, b3);
        }
    }
    y[0] = alpha * mq_hsum8_avx2(a0, b0);
    y[1] = alpha * mq_hsum8_avx2(a1, b1);
    y[2] = alpha * mq_hsum8_avx2(a2, b2);
    y[3] = alpha * mq_hsum8_avx2(a3, b3);
}

MQ_VEC_GEMV(avx2, 4, dot4)

static void axpy_avx2(float a, const float *x, float *y, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    vec_axpy_from(i, a, x, y, n);
}

/* Columns in blocks of 64 held in eight accumulators over all rows, then blocks of 8, then a
 * masked tail; every column takes its fmas in row order. */
static void gemv_t_avx2(const float *V, int64_t ldv, int64_t rows, const float *a, int64_t n,
                        float *y) {
    int64_t j = 0;
    for (; j + 64 <= n; j += 64) {
        __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
        __m256 c4 = c0, c5 = c0, c6 = c0, c7 = c0;
        for (int64_t i = 0; i < rows; i++) {
            const float *v = V + i * ldv + j;
            __m256 ai = _mm256_set1_ps(a[i]);
            c0 = _mm256_fmadd_ps(ai, _mm256_loadu_ps(v), c0);
            c1 = _mm256_fmadd_ps(ai, _mm256_loadu_ps(v + 8), c1);
            c2 = _mm256_fmadd_ps(ai, _mm256_loadu_ps(v + 16), c2);
            c3 = _mm256_fmadd_ps(ai, _mm256_loadu_ps(v + 24), c3);
            c4 = _mm256_fmadd_ps(ai, _mm256_loadu_ps(v + 32), c4);
            c5 = _mm256_fmadd_ps(ai, _mm256_loadu_ps(v + 40), c5);
            c6 = _mm256_fmadd_ps(ai, _mm256_loadu_ps(v + 48), c6);
            c7 = _mm256_fmadd_ps(ai, _mm256_loadu_ps(v + 56), c7);
        }
        _mm256_storeu_ps(y + j, c0);
        _mm256_storeu_ps(y + j + 8, c1);
        _mm256_storeu_ps(y + j + 16, c2);
        _mm256_storeu_ps(y + j + 24, c3);
        _mm256_storeu_ps(y + j + 32, c4);
        _mm256_storeu_ps(y + j + 40, c5);
        _mm256_storeu_ps(y + j + 48, c6);
        _mm256_storeu_ps(y + j + 56, c7);
    }
    for (; j < n; j += 8) {
        __m256i m = j + 8 <= n ? _mm256_set1_epi32(-1) : mask_tail(n - j);
        __m256 c = _mm256_setzero_ps();
        for (int64_t i = 0; i < rows; i++)
            c = _mm256_fmadd_ps(_mm256_set1_ps(a[i]), _mm256_maskload_ps(V + i * ldv + j, m), c);
        _mm256_maskstore_ps(y + j, m, c);
    }
}

static void rope_avx2(float *x, int64_t half, const float *c, const float *s) {
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
        __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
        _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(a, vc), _mm256_mul_ps(b, vs)));
        _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(b, vc), _mm256_mul_ps(a, vs)));
    }
    vec_rope_from(i, x, half, c, s);
}

static void exp_avx2(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, mq_exp_avx2(_mm256_loadu_ps(x + i)));
    if (i < n) {
        __m256i m = mask_tail(n - i);
        _mm256_maskstore_ps(y + i, m, mq_exp_avx2(_mm256_maskload_ps(x + i, m)));
    }
}

/* max_ref's fold: two accumulators by block parity seeded with x[0]; tail lanes beyond n hold
 * x[0], which changes nothing. */
static float max_avx2(const float *x, int64_t n) {
    __m256 x0 = _mm256_set1_ps(x[0]);
    __m256 m[2] = {x0, x0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        m[0] = _mm256_max_ps(_mm256_loadu_ps(x + i), m[0]);
        m[1] = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m[1]);
    }
    int k = 0;
    if (i + 8 <= n) {
        m[0] = _mm256_max_ps(_mm256_loadu_ps(x + i), m[0]);
        i += 8;
        k = 1;
    }
    if (i < n) {
        __m256i mk = mask_tail(n - i);
        __m256 v = _mm256_blendv_ps(x0, _mm256_maskload_ps(x + i, mk), _mm256_castsi256_ps(mk));
        m[k] = _mm256_max_ps(v, m[k]);
    }
    return mq_hmax8_avx2(m[0], m[1]);
}

static void softmax_avx2(float *x, int64_t n) {
    __m256 mx = _mm256_set1_ps(max_avx2(x, n));
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    int k = 0;
    for (; i + 8 <= n; i += 8, k ^= 1) {
        __m256 e = mq_exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), mx));
        _mm256_storeu_ps(x + i, e);
        acc[k] = _mm256_add_ps(acc[k], e);
    }
    __m256i mk = _mm256_setzero_si256();
    if (i < n) {
        mk = mask_tail(n - i);
        __m256 e = mq_exp_avx2(_mm256_sub_ps(_mm256_maskload_ps(x + i, mk), mx));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mk));
        _mm256_maskstore_ps(x + i, mk, e);
        acc[k] = _mm256_add_ps(acc[k], e);
    }
    __m256 sum = _mm256_set1_ps(mq_hsum8_avx2(acc[0], acc[1]));
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_div_ps(_mm256_loadu_ps(x + i), sum));
    if (i < n) _mm256_maskstore_ps(x + i, mk, _mm256_div_ps(_mm256_maskload_ps(x + i, mk), sum));
}

/* Adds exp(v - mx) of the 8 floats of v to the double lanes (low half to d0, high half to d1);
 * lanes outside keep (all ones in keep) add exactly +0. */
INLINE void add_exp8(__m256 v, __m256d mx, __m256i keep, __m256d *d0, __m256d *d1) {
    __m256d lo = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), mx);
    __m256d hi = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), mx);
    __m256d klo = _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(keep)));
    __m256d khi = _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(keep, 1)));
    *d0 = _mm256_add_pd(*d0, _mm256_and_pd(mq_expd_avx2(lo), klo));
    *d1 = _mm256_add_pd(*d1, _mm256_and_pd(mq_expd_avx2(hi), khi));
}

static double logsumexp_avx2(const float *x, int64_t n, int32_t *argmax) {
    float mxf = max_avx2(x, n);
    if (argmax) {
        __m256 mx = _mm256_set1_ps(mxf);
        int64_t am = 0, i = 0;
        for (; i + 8 <= n; i += 8) {
            int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mx, _CMP_EQ_OQ));
            if (bits) break;
        }
        am = vec_first_equal_from(i, x, n, mxf);
        *argmax = (int32_t)am;
    }
    if (!isfinite(mxf)) return (double)mxf;
    __m256d mx = _mm256_set1_pd((double)mxf);
    __m256d d0 = _mm256_setzero_pd(), d1 = _mm256_setzero_pd();
    const __m256i all = _mm256_set1_epi32(-1);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) add_exp8(_mm256_loadu_ps(x + i), mx, all, &d0, &d1);
    if (i < n) {
        __m256i mk = mask_tail(n - i);
        add_exp8(_mm256_maskload_ps(x + i, mk), mx, mk, &d0, &d1);
    }
    return (double)mxf + log(mq_hsum4d_avx2(d0, d1));
}

/* exp(a) * (a - b) of 4 lanes, a = lb - lse_b, b = lm - lse_m. */
INLINE __m256d kl_term4(__m128 lb, __m128 lm, __m256d lse_b, __m256d lse_m) {
    __m256d a = _mm256_sub_pd(_mm256_cvtps_pd(lb), lse_b);
    __m256d b = _mm256_sub_pd(_mm256_cvtps_pd(lm), lse_m);
    return _mm256_mul_pd(mq_expd_avx2(a), _mm256_sub_pd(a, b));
}

static double kl_avx2(const float *lb, double lse_b, const float *lm, double lse_m, int64_t n) {
    __m256d zb = _mm256_set1_pd(lse_b), zm = _mm256_set1_pd(lse_m);
    __m256d d0 = _mm256_setzero_pd(), d1 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 vb = _mm256_loadu_ps(lb + i), vm = _mm256_loadu_ps(lm + i);
        __m256d t0 = kl_term4(_mm256_castps256_ps128(vb), _mm256_castps256_ps128(vm), zb, zm);
        __m256d t1 = kl_term4(_mm256_extractf128_ps(vb, 1), _mm256_extractf128_ps(vm, 1), zb, zm);
        d0 = _mm256_add_pd(d0, t0);
        d1 = _mm256_add_pd(d1, t1);
    }
    if (i < n) {
        __m256i mk = mask_tail(n - i);
        __m256 vb = _mm256_maskload_ps(lb + i, mk), vm = _mm256_maskload_ps(lm + i, mk);
        __m256d klo = _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(mk)));
        __m256d khi = _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(mk, 1)));
        __m256d t0 = kl_term4(_mm256_castps256_ps128(vb), _mm256_castps256_ps128(vm), zb, zm);
        __m256d t1 = kl_term4(_mm256_extractf128_ps(vb, 1), _mm256_extractf128_ps(vm, 1), zb, zm);
        d0 = _mm256_add_pd(d0, _mm256_and_pd(t0, klo));
        d1 = _mm256_add_pd(d1, _mm256_and_pd(t1, khi));
    }
    return mq_hsum4d_avx2(d0, d1);
}

static void rmsnorm_avx2(const float *x, int64_t n, const float *w, float eps, float *out) {
    __m256d d0 = _mm256_setzero_pd(), d1 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
        __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        d0 = _mm256_fmadd_pd(lo, lo, d0);   /* exact product, one rounding: as the reference */
        d1 = _mm256_fmadd_pd(hi, hi, d1);
    }
    if (i < n) {
        __m256 v = _mm256_maskload_ps(x + i, mask_tail(n - i));
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
        __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        d0 = _mm256_fmadd_pd(lo, lo, d0);
        d1 = _mm256_fmadd_pd(hi, hi, d1);
    }
    float var = (float)(mq_hsum4d_avx2(d0, d1) / (double)n);
    float invf = 1.0f / sqrtf(var + eps);
    __m256 inv = _mm256_set1_ps(invf);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                                _mm256_mul_ps(_mm256_loadu_ps(x + i), inv)));
    vec_norm_scale_from(i, x, w, invf, out, n);
}

INLINE __m256 swiglu8(__m256 g, __m256 u) { return _mm256_mul_ps(mq_silu_avx2(g), u); }

static void swiglu_avx2(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(g + i, swiglu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < n) {
        __m256i m = mask_tail(n - i);
        __m256 y = swiglu8(_mm256_maskload_ps(g + i, m), _mm256_maskload_ps(u + i, m));
        _mm256_maskstore_ps(g + i, m, y);
    }
}

const mq_vec_kernels mq_vec_avx2 = MQ_VEC_KERNELS_OF(avx2);
