/*
 * exp and SiLU for 16 fp32 lanes and exp for 8 double lanes, for the AVX-512 vector kernels
 * (vec_avx512.c): lane-wise twins of mq_vec_expf, mq_vec_silu and mq_vec_exp_sum_term
 * (src/kernels/cpu/ref/vec_ref.c), the operations of mq_exp8_avx2 (exp_avx2.h) and vec_avx2.c's
 * expd4 on wider registers. Include only from files compiled with -mavx512f.
 */
#ifndef MOEQ_KERNELS_X86_EXP_AVX512_H
#define MOEQ_KERNELS_X86_EXP_AVX512_H

#include <immintrin.h>

/* 16 lanes of mq_vec_expf. */
static inline __attribute__((always_inline)) __m512 mq_exp16_avx512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);   /* NaN x passes (second operand) */
    x = _mm512_min_ps(_mm512_set1_ps(88.75f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512 n1 = _mm512_roundscale_ps(_mm512_mul_ps(n, _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 n2 = _mm512_sub_ps(n, n1);
    const __m512i bias = _mm512_set1_epi32(127);
    __m512i e1 = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n1), bias), 23);
    __m512i e2 = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n2), bias), 23);
    return _mm512_mul_ps(_mm512_mul_ps(y, _mm512_castsi512_ps(e1)), _mm512_castsi512_ps(e2));
}

/* silu(g) = g / (1 + exp(-g)), lane-wise as mq_vec_silu. */
static inline __attribute__((always_inline)) __m512 mq_silu16_avx512(__m512 g) {
    __m512 ng = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u)));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), mq_exp16_avx512(ng)));
}

/* 8 lanes of mq_vec_exp_sum_term (vec_avx2.c's expd4). */
static inline __attribute__((always_inline)) __m512d mq_expd8_avx512(__m512d d) {
    d = _mm512_max_pd(_mm512_set1_pd(-708.0), d);   /* NaN d passes */
    __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(d, _mm512_set1_pd(1.4426950408889634)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), d);
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);
    static const double c[13] = {1.0,         1.0,          1.0 / 2,       1.0 / 6,
                                 1.0 / 24,    1.0 / 120,    1.0 / 720,     1.0 / 5040,
                                 1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800,
                                 1.0 / 479001600};
    __m512d p = _mm512_set1_pd(c[12]);
    for (int k = 11; k >= 0; k--) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(c[k]));
    __m512i e = _mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(n));
    e = _mm512_slli_epi64(_mm512_add_epi64(e, _mm512_set1_epi64(1023)), 52);
    return _mm512_mul_pd(p, _mm512_castsi512_pd(e));
}

#endif
