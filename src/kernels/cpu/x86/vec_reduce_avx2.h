/*
 * The reductions of vec.h's lane layout on AVX2 registers, shared by the AVX2 and AVX-512 vector
 * kernels (vec_avx2.c, vec_avx512.c: a zmm holds the two 8-lane accumulators, so its halves go
 * through these very steps): the two accumulators combined lane-wise (a1 first for the max, as
 * maxps(value, accumulator) folds), then (l + l+4), (l + l+2), (l + l+1). Include only from
 * files compiled with -mavx2.
 */
#ifndef MOEQ_KERNELS_X86_VEC_REDUCE_AVX2_H
#define MOEQ_KERNELS_X86_VEC_REDUCE_AVX2_H

#include <immintrin.h>

static inline __attribute__((always_inline)) float mq_hsum8_avx2(__m256 a0, __m256 a1) {
    __m256 v = _mm256_add_ps(a0, a1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* The double lanes: the low and high half of each 8-block in d0 and d1. */
static inline __attribute__((always_inline)) double mq_hsum4d_avx2(__m256d d0, __m256d d1) {
    __m256d v = _mm256_add_pd(d0, d1);
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}

/* max_ref's fold of the two parity accumulators, each step maxps(value, accumulator). */
static inline __attribute__((always_inline)) float mq_hmax8_avx2(__m256 m0, __m256 m1) {
    __m256 v = _mm256_max_ps(m1, m0);
    __m128 s = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_max_ps(_mm_movehl_ps(s, s), s);
    s = _mm_max_ss(_mm_shuffle_ps(s, s, 1), s);
    return _mm_cvtss_f32(s);
}

#endif
