/*
 * AVX2+FMA twins of the dot products over GGUF rows read in place (kernels/ggml_mat.h,
 * mq_ggml_dot_ref in ggml_mat.c): one 8-lane accumulator, element 8k + l of a block in lane l,
 * Q8_0 summed per block (four fmas a lane) and then scaled into the row's accumulator by one fma,
 * the 8 lanes reduced as (l + l+4), (l + l+2), (l + l+1). The reference performs exactly these
 * operations, so the results are the same bits.
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

static float dot_q8_0(const uint8_t *row, const float *x, int64_t nb) {
    __m256 tot = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, row += 34, x += 32) {
        uint16_t h;
        memcpy(&h, row, 2);
        __m256 a = _mm256_mul_ps(i8x8(row + 2), _mm256_loadu_ps(x));
        a = _mm256_fmadd_ps(i8x8(row + 10), _mm256_loadu_ps(x + 8), a);
        a = _mm256_fmadd_ps(i8x8(row + 18), _mm256_loadu_ps(x + 16), a);
        a = _mm256_fmadd_ps(i8x8(row + 26), _mm256_loadu_ps(x + 24), a);
        tot = _mm256_fmadd_ps(_mm256_set1_ps(mq_f16_to_f32(h)), a, tot);
    }
    return hsum(tot);
}

static float dot_bf16(const uint8_t *row, const float *x, int64_t n) {
    __m256 tot = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(row + 2 * i));
        __m256 w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        tot = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + i), tot);
    }
    return hsum(tot);
}

/* Four rows at once: four independent accumulator chains (one FMA chain's latency bounded a row
 * alone), each row's operations those of dot_q8_0 / dot_bf16, so the same bits. */
static void dot_q8_0_x4(const uint8_t *const rows[4], const float *x, int64_t nb, float *out) {
    __m256 tot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++, x += 32) {
        const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8),
                     x2 = _mm256_loadu_ps(x + 16), x3 = _mm256_loadu_ps(x + 24);
        for (int k = 0; k < 4; k++) {
            const uint8_t *row = rows[k] + b * 34;
            uint16_t h;
            memcpy(&h, row, 2);
            __m256 a = _mm256_mul_ps(i8x8(row + 2), x0);
            a = _mm256_fmadd_ps(i8x8(row + 10), x1, a);
            a = _mm256_fmadd_ps(i8x8(row + 18), x2, a);
            a = _mm256_fmadd_ps(i8x8(row + 26), x3, a);
            tot[k] = _mm256_fmadd_ps(_mm256_set1_ps(mq_f16_to_f32(h)), a, tot[k]);
        }
    }
    for (int k = 0; k < 4; k++) out[k] = hsum(tot[k]);
}

INLINE __m256 bf16x8(const uint8_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)(const void *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static void dot_bf16_x4(const uint8_t *const rows[4], const float *x, int64_t n, float *out) {
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
    const uint8_t *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3];
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        t0 = _mm256_fmadd_ps(bf16x8(r0 + 2 * i), xv, t0);
        t1 = _mm256_fmadd_ps(bf16x8(r1 + 2 * i), xv, t1);
        t2 = _mm256_fmadd_ps(bf16x8(r2 + 2 * i), xv, t2);
        t3 = _mm256_fmadd_ps(bf16x8(r3 + 2 * i), xv, t3);
    }
    out[0] = hsum(t0), out[1] = hsum(t1), out[2] = hsum(t2), out[3] = hsum(t3);
}

const mq_ggml_dot_kernels mq_ggml_dot_avx2 = {dot_q8_0, dot_bf16, dot_q8_0_x4, dot_bf16_x4};
