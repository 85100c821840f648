/*
 * AVX-512 twin of the dot products over GGUF rows read in place (kernels/ggml_mat.h): the single
 * dot products are the AVX2 twin's; bf16_rows computes a tile of TR rows by TT tokens at once, so
 * that a loaded stretch of x serves TR rows and a converted stretch of a row TT tokens (one row
 * against one token at a time streamed every token's x once a row: a bf16 lm_head in place ran
 * at about a third of the cores' sgemm rate). Each pair keeps the AVX2 twin's four 8-lane
 * accumulators as two 16-lane registers, [acc0 | acc1] and [acc2 | acc3]: elements i..i+15 of a
 * step of 32 go into the first, i+16..i+31 into the second, so every lane takes the same fmas in
 * the same order; a tail of 8 or 24 elements updates only the lanes the AVX2 twin's tail does
 * (masked). The end is the AVX2 twin's: (acc0 + acc1) + (acc2 + acc3), then the lanes reduced as
 * (l + l+4), (l + l+2), (l + l+1). The results are the reference's bits.
 */
#if !defined(__clang__)   /* GCC only: the tile loops unrolled so the accumulators stay in registers */
#pragma GCC optimize("O3")
#endif

#include <immintrin.h>

#include "kernels/ggml_mat.h"

#define INLINE static inline __attribute__((always_inline))

enum { TR = 4, TT = 3 };   /* a tile: 2 x TR x TT accumulators, TR + TT operands (31 registers) */

INLINE __m512 bf16x16(const uint8_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE __m512 bf16x16_mask(const uint8_t *p, __mmask16 k) {
    const __m256i h = _mm256_maskz_loadu_epi16(k, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The AVX2 twin's end of one pair: (acc0 + acc1) + (acc2 + acc3), the 8 lanes reduced. */
INLINE float pair_end(__m512 a01, __m512 a23) {
    const __m256 s01 = _mm256_add_ps(_mm512_castps512_ps256(a01),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a01), 1)));
    const __m256 s23 = _mm256_add_ps(_mm512_castps512_ps256(a23),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a23), 1)));
    const __m256 t = _mm256_add_ps(s01, s23);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* nr rows x nt tokens (compile-time constants in each instantiation below). */
INLINE void tile(const uint8_t *const *rows, const float *x, int64_t ldx, int64_t n, float *y,
                 int64_t ldy, const int nr, const int nt) {
    __m512 acc[TR][TT][2];
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 3
        for (int t = 0; t < nt; t++) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m512 w[TR], xv[TT];
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) w[r] = bf16x16(rows[r] + 2 * (i + 16 * h));
#pragma GCC unroll 3
            for (int t = 0; t < nt; t++) xv[t] = _mm512_loadu_ps(x + t * ldx + i + 16 * h);
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++)
#pragma GCC unroll 3
                for (int t = 0; t < nt; t++) acc[r][t][h] = _mm512_fmadd_ps(w[r], xv[t], acc[r][t][h]);
        }
    if (i < n) {   /* 8, 16 or 24 elements: acc0 (and acc1, acc2) as the AVX2 twin's tail */
        const int64_t left = n - i;
        const __mmask16 k[2] = {(__mmask16)(left >= 16 ? 0xFFFF : 0x00FF),
                                (__mmask16)(left > 16 ? 0x00FF : 0)};
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            if (!k[h]) continue;
            __m512 w[TR], xv[TT];
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) w[r] = bf16x16_mask(rows[r] + 2 * (i + 16 * h), k[h]);
#pragma GCC unroll 3
            for (int t = 0; t < nt; t++) xv[t] = _mm512_maskz_loadu_ps(k[h], x + t * ldx + i + 16 * h);
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++)
#pragma GCC unroll 3
                for (int t = 0; t < nt; t++)
                    acc[r][t][h] = _mm512_mask3_fmadd_ps(w[r], xv[t], acc[r][t][h], k[h]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 3
        for (int t = 0; t < nt; t++) y[t * ldy + r] = pair_end(acc[r][t][0], acc[r][t][1]);
}

#define TILE_FN(R, T)                                                                              \
    static __attribute__((noinline)) void tile_##R##_##T(const uint8_t *const *rows, const float *x, \
                                                         int64_t ldx, int64_t n, float *y,         \
                                                         int64_t ldy) {                            \
        tile(rows, x, ldx, n, y, ldy, R, T);                                                       \
    }
TILE_FN(1, 1) TILE_FN(1, 2) TILE_FN(1, 3)
TILE_FN(2, 1) TILE_FN(2, 2) TILE_FN(2, 3)
TILE_FN(3, 1) TILE_FN(3, 2) TILE_FN(3, 3)
TILE_FN(4, 1) TILE_FN(4, 2) TILE_FN(4, 3)

typedef void (*tile_fn)(const uint8_t *const *, const float *, int64_t, int64_t, float *, int64_t);
static const tile_fn k_tiles[TR][TT] = {{tile_1_1, tile_1_2, tile_1_3}, {tile_2_1, tile_2_2, tile_2_3},
                                        {tile_3_1, tile_3_2, tile_3_3}, {tile_4_1, tile_4_2, tile_4_3}};

/* Groups of TR rows; in each, the tokens TT at a time (the group's rows stay in L1 while x
 * streams past). */
static void dot_bf16_rows(const uint8_t *const *rows, int64_t nr, const float *x, int64_t ldx, int64_t T,
                          int64_t n, float *y, int64_t ldy) {
    for (int64_t r0 = 0; r0 < nr; r0 += TR) {
        const int64_t rr = nr - r0 < TR ? nr - r0 : TR;
        for (int64_t t0 = 0; t0 < T; t0 += TT) {
            const int64_t tt = T - t0 < TT ? T - t0 : TT;
            k_tiles[rr - 1][tt - 1](rows + r0, x + t0 * ldx, ldx, n, y + t0 * ldy + r0, ldy);
        }
    }
}

const mq_ggml_dot_kernels mq_ggml_dot_avx512 = {mq_ggml_dot_q8_0_avx2, mq_ggml_dot_bf16_avx2, dot_bf16_rows};
