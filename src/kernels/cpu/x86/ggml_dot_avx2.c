/*
 * AVX2+FMA twins of the dot products over GGUF rows read in place (kernels/ggml_mat.h,
 * mq_ggml_dot_ref in cpu/ref/ggml_dot_ref.c): four 8-lane accumulators, so that one row streams
 * at the memory's pace (a single fma chain's latency held a mapped BF16 lm_head to about half of
 * it: docs/results/runtime.md); BF16 element i into accumulator (i % 32) / 8, lane i % 8; Q8_0
 * block b summed (four fmas a lane) and then scaled into accumulator b % 4 by one fma; merged as
 * (0 + 1) + (2 + 3), the lanes reduced as (l + l+4), (l + l+2), (l + l+1). The reference performs
 * exactly these operations, so the results are the same bits. A row is read from start to end:
 * interleaving several rows' streams ran slower on a mapped file.
 */
#include <immintrin.h>
#include <string.h>

#include "kernels/ggml_mat.h"

#define INLINE static inline __attribute__((always_inline))

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

INLINE __m256 i8x8(const uint8_t *p) {
    long long v;
    memcpy(&v, p, 8);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(v)));
}

INLINE float merge4(const __m256 *acc) {
    return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

float mq_ggml_dot_q8_0_avx2(const uint8_t *row, const float *x, int64_t nb) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++, row += 34, x += 32) {
        uint16_t h;
        memcpy(&h, row, 2);
        __m256 a = _mm256_mul_ps(i8x8(row + 2), _mm256_loadu_ps(x));
        a = _mm256_fmadd_ps(i8x8(row + 10), _mm256_loadu_ps(x + 8), a);
        a = _mm256_fmadd_ps(i8x8(row + 18), _mm256_loadu_ps(x + 16), a);
        a = _mm256_fmadd_ps(i8x8(row + 26), _mm256_loadu_ps(x + 24), a);
        acc[b % 4] = _mm256_fmadd_ps(_mm256_set1_ps(mq_f16_to_f32(h)), a, acc[b % 4]);
    }
    return merge4(acc);
}

INLINE __m256 bf16x8(const uint8_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)(const void *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

float mq_ggml_dot_bf16_avx2(const uint8_t *row, const float *x, int64_t n) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc[0] = _mm256_fmadd_ps(bf16x8(row + 2 * i), _mm256_loadu_ps(x + i), acc[0]);
        acc[1] = _mm256_fmadd_ps(bf16x8(row + 2 * i + 16), _mm256_loadu_ps(x + i + 8), acc[1]);
        acc[2] = _mm256_fmadd_ps(bf16x8(row + 2 * i + 32), _mm256_loadu_ps(x + i + 16), acc[2]);
        acc[3] = _mm256_fmadd_ps(bf16x8(row + 2 * i + 48), _mm256_loadu_ps(x + i + 24), acc[3]);
    }
    for (; i < n; i += 8)
        acc[(i % 32) / 8] = _mm256_fmadd_ps(bf16x8(row + 2 * i), _mm256_loadu_ps(x + i), acc[(i % 32) / 8]);
    return merge4(acc);
}

static void dot_bf16_rows(const uint8_t *const *rows, int64_t nr, const float *x, int64_t ldx, int64_t T,
                          int64_t n, float *y, int64_t ldy) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < nr; r++) y[t * ldy + r] = mq_ggml_dot_bf16_avx2(rows[r], x + t * ldx, n);
}

const mq_ggml_dot_kernels mq_ggml_dot_avx2 = {mq_ggml_dot_q8_0_avx2, mq_ggml_dot_bf16_avx2, dot_bf16_rows};
