/*
 * exp and SiLU for 8 fp32 lanes, shared by the AVX2 vector kernels (vec_avx2.c) and the MoE
 * kernels (moe_avx2.c): lane-wise twins of mq_vec_expf (src/kernels/cpu/ref/vec_ref.c), so both
 * kernel families and their scalar references compute exp with one polynomial.
 * Include only from files compiled with -mavx2 -mfma.
 */
#ifndef MOEQ_KERNELS_X86_EXP_AVX2_H
#define MOEQ_KERNELS_X86_EXP_AVX2_H

#include <immintrin.h>

/* 8 lanes of mq_vec_expf. */
static inline __attribute__((always_inline)) __m256 mq_exp8_avx2(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);   /* NaN x passes (second operand) */
    x = _mm256_min_ps(_mm256_set1_ps(88.75f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256 n1 = _mm256_floor_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)));
    __m256 n2 = _mm256_sub_ps(n, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    __m256i e1 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n1), bias), 23);
    __m256i e2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n2), bias), 23);
    return _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e1)), _mm256_castsi256_ps(e2));
}

/* silu(g) = g / (1 + exp(-g)), lane-wise as mq_vec_silu. */
static inline __attribute__((always_inline)) __m256 mq_silu8_avx2(__m256 g) {
    __m256 e = mq_exp8_avx2(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

#endif
