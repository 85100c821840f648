/*
 * AVX2+FMA kernels of the quantized MoE feed-forward op, twins of src/kernels/cpu/ref/moe_ref.c
 * (same operations in the same order, bit-identical results). Layout and integer scheme: see
 * src/kernels/moe_ffn.h. The micro-tile is one tile pair (16 weight rows) x up to 4 activation
 * rows: one 32-byte load gives 4 columns of 8 rows per nibble half; _mm256_maddubs_epi16 multiplies
 * them by a broadcast 4-column activation quad and the int16 sums of one block (at most 4 maddubs
 * pairs of <= 2*24*127, or 8 of <= 2*15*127, so no saturation) are widened once per block with
 * _mm256_madd_epi16. The approach follows the classic int8-activation dot products of llama.cpp's
 * Q4_0 x Q8_0 and torchao's 8-bit-activation kernels, with our own interleaved layout.
 */
/* -O3 completely unrolls the tile loops before scalar replacement, so the accumulators stay in
 * registers (at -O2 the arrays are unrolled too late and live on the stack). */
#if !defined(__clang__)   /* GCC only (clang, the fuzz build's compiler, has no such pragma) */
#pragma GCC optimize("O3")
#endif

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/moe_common.h"
#include "kernels/cpu/x86/exp_avx2.h"
#include "kernels/moe_ffn.h"

#define INLINE static inline __attribute__((always_inline))

enum { PF_AHEAD = 24 << 10 };



INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* A chunk of 8 columns of both row blocks of a pair (their weights' low and high nibbles l0, h0
 * and l1, h1) times an activation row's 8 codes at xq (two broadcast quads): the int16 sums of
 * row block 0 to *a0, of row block 1 to *a1. */
INLINE void dot_chunk(__m256i *a0, __m256i *a1, __m256i l0, __m256i h0, __m256i l1, __m256i h1,
                      const int8_t *xq) {
    const __m256i q0 = bcast4(xq), q1 = bcast4(xq + 4);
    *a0 = _mm256_add_epi16(*a0, _mm256_maddubs_epi16(l0, q0));
    *a0 = _mm256_add_epi16(*a0, _mm256_maddubs_epi16(h0, q1));
    *a1 = _mm256_add_epi16(*a1, _mm256_maddubs_epi16(l1, q0));
    *a1 = _mm256_add_epi16(*a1, _mm256_maddubs_epi16(h1, q1));
}

/* 8 E4M3 bytes -> fp32: the magnitude bits shifted into an fp32 exponent/mantissa are the value
 * times 2^-120 (E4M3 subnormals land on fp32 subnormals), so one exact multiply finishes it.
 * Without negative scales (the usual case: block scales are amax / 6) the sign needs no work. */
INLINE __m256 e4m3x8(const uint8_t *p, int neg) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i bits = _mm256_slli_epi32(v, 20);
    if (neg) {
        __m256i mag = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7f)), 20);
        __m256i sgn = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
        bits = _mm256_or_si256(mag, sgn);
    }
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}

/* The 8 INT4 scales of group g of a row block (fp32, or exact 16-bit storage). */
INLINE __m256 int4_scales(const uint8_t *s, int64_t g, int stype) {
    if (stype == MQ_MOE_S_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g * 16)));
    if (stype == MQ_MOE_S_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + g * 16))), 16));
    return _mm256_loadu_ps((const float *)s + g * 8);
}

/* ---- activation quantization ---------------------------------------------------------------- */
INLINE float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

INLINE int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* Packs nv vectors of int32 (each in -128..127) to 8 * nv int8 in column order at dst. */
INLINE void store_i8(const __m256i *c, int nv, int8_t *dst) {
    /* packs work per 128-bit lane; the permute restores column order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    if (nv == 4) {
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(p, order));
    } else {
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_setzero_si256());
        p = _mm256_permutevar8x32_epi32(p, order);
        _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(p));
    }
}

static void quant_act_avx2(const float *x, int64_t n, const mq_qact *A, int64_t row,
                           int64_t col0) {
    const int32_t B = A->block, nv = B / 8;   /* 2 or 4 vectors per block */
    const int split = A->q2 != NULL;
    const moe_qact_dst d = moe_qact_at(A, row, col0);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < n / B; b++) {
        const float *v = x + b * B;
        __m256 vx[4], amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int j = 0; j < nv; j++) {
            vx[j] = _mm256_loadu_ps(v + 8 * j);
            __m256 a = _mm256_and_ps(vx[j], absmask);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            amax = _mm256_max_ps(amax, a);
        }
        const float m = hmax8(amax);
        if (moe_qact_unscaled(&d, b, B, m, _mm256_movemask_ps(nan) != 0)) continue;
        __m256 inv = _mm256_set1_ps(d.qmax / m);
        __m256i sum = _mm256_setzero_si256(), c[4], lo[4];
        for (int j = 0; j < nv; j++) {
            c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(vx[j], inv));
            sum = _mm256_add_epi32(sum, c[j]);
            if (split) {
                __m256i hi = _mm256_srai_epi32(_mm256_add_epi32(c[j], _mm256_set1_epi32(128)), 8);
                lo[j] = _mm256_sub_epi32(c[j], _mm256_slli_epi32(hi, 8));
                c[j] = hi;
            }
        }
        store_i8(c, nv, d.q + b * B);
        if (split) store_i8(lo, nv, d.q2 + b * B);
        d.sc[b] = m / d.qmax;
        d.cr[b] = hsum8i(sum) * A->offset;
    }
}

/* ---- GEMM micro-tile -------------------------------------------------------------------------- */
/* One tile pair x nt activation rows, with the epilogue: o[t] receives 8 SwiGLU outputs or the 16
 * row results of activation row t. */
INLINE void tile(const mq_pmat *W, int64_t pair, const mq_qact *A, const int64_t *arow,
                 float *const *o, int swiglu, size_t ahead, const uint8_t *next, const int nt,
                 const int nvfp4, const int split) {
    /* Software prefetch into L2 of the pair PF_AHEAD bytes ahead (whole pairs, at least the next),
     * at the pace this pair is consumed; past the matrix's last pair the stream continues at
     * `next`, where this thread reads next (the matrix's successor in memory usually is not).
     * Decode streams each expert from DRAM and the hardware prefetchers alone fall short: without
     * this prefetch one token takes 1.6-1.9x as long, with every other line left out 1.3-1.5x;
     * 8-32 KiB ahead read equally fast, 96 KiB and the T0 hint slower; continuing into `next`
     * saved 0-7% at one token (in-process A/B, 2 threads). */
    const moe_pair pr = moe_pair_at(W, pair, next, ahead);
    const moe_blocks k = moe_blocks_of(W, A, nvfp4);
    const int8_t *aq[MQ_MOE_NT], *aq2[MQ_MOE_NT];
    const float *as[MQ_MOE_NT];
    const int32_t *ac[MQ_MOE_NT];
    moe_act_rows(A, arow, nt, split, k.lds, aq, aq2, as, ac);
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), k256 = _mm256_set1_epi16(256);
    const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    __m256 f[2][MQ_MOE_NT];
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) f[0][t] = f[1][t] = _mm256_setzero_ps();
    int64_t g = 0;
    int in_group = 0;
    for (int64_t b = 0; b < k.nb; b++) {
        __m256i acc[2][MQ_MOE_NT], acc2[2][MQ_MOE_NT];
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            acc[0][t] = acc[1][t] = _mm256_setzero_si256();
            if (split) acc2[0][t] = acc2[1][t] = _mm256_setzero_si256();
        }
#pragma GCC unroll 4
        for (int c = 0; c < k.CH; c++) {
            const size_t off = (size_t)(b * k.CH + c) * 32;
            if (pr.pf) {
                /* the next pair, into L2, at the pace this pair is consumed (step < 128) */
                const uint8_t *p = pr.pf + (size_t)(b * k.CH + c) * pr.pf_step;
                _mm_prefetch((const char *)p, _MM_HINT_T1);
                _mm_prefetch((const char *)p + 64, _MM_HINT_T1);
            }
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(pr.rb0 + off));
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(pr.rb1 + off));
            __m256i l0 = _mm256_and_si256(v0, m4), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
            __m256i l1 = _mm256_and_si256(v1, m4), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
            if (nvfp4) {
                l0 = _mm256_shuffle_epi8(lut, l0);
                h0 = _mm256_shuffle_epi8(lut, h0);
                l1 = _mm256_shuffle_epi8(lut, l1);
                h1 = _mm256_shuffle_epi8(lut, h1);
            }
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) {
                const size_t at = (size_t)(b * k.B + c * 8);
                dot_chunk(&acc[0][t], &acc[1][t], l0, h0, l1, h1, aq[t] + at);
                if (split) dot_chunk(&acc2[0][t], &acc2[1][t], l0, h0, l1, h1, aq2[t] + at);
            }
        }
        __m256 sw0, sw1;
        if (nvfp4) {
            sw0 = e4m3x8(pr.s0 + b * 8, k.neg);
            sw1 = e4m3x8(pr.s1 + b * 8, k.neg);
        } else {
            sw0 = int4_scales(pr.s0, g, k.stype);
            sw1 = int4_scales(pr.s1, g, k.stype);
            if (++in_group == k.bpg) {
                in_group = 0;
                g++;
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            __m256 sa = _mm256_set1_ps(as[t][b]);
            __m256i cr = _mm256_set1_epi32(ac[t][b]);
            __m256i i0 = _mm256_madd_epi16(acc[0][t], ones), i1 = _mm256_madd_epi16(acc[1][t], ones);
            if (split) {
                i0 = _mm256_add_epi32(_mm256_madd_epi16(acc[0][t], k256), _mm256_madd_epi16(acc2[0][t], ones));
                i1 = _mm256_add_epi32(_mm256_madd_epi16(acc[1][t], k256), _mm256_madd_epi16(acc2[1][t], ones));
            }
            i0 = _mm256_sub_epi32(i0, cr);
            i1 = _mm256_sub_epi32(i1, cr);
            f[0][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(sw0, sa), f[0][t]);
            f[1][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(sw1, sa), f[1][t]);
        }
    }
    const __m256 d0 = _mm256_set1_ps(W->div[0]), d1 = _mm256_set1_ps(W->div[1]);
    const __m256 u0 = _mm256_set1_ps(W->mul[0]), u1 = _mm256_set1_ps(W->mul[1]);
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) {
        __m256 y0 = _mm256_div_ps(_mm256_mul_ps(f[0][t], u0), d0);
        __m256 y1 = _mm256_div_ps(_mm256_mul_ps(f[1][t], u1), d1);
        if (swiglu) {
            _mm256_storeu_ps(o[t], _mm256_mul_ps(mq_silu_avx2(y0), y1));
        } else {
            _mm256_storeu_ps(o[t], y0);
            _mm256_storeu_ps(o[t] + 8, y1);
        }
    }
}

/* moe_common.h's instantiations of `tile`. */
MOE_TILE_FNS(1)
MOE_TILE_FNS(2)
MOE_TILE_FNS(3)
MOE_TILE_FNS(4)
static const moe_tile_fn k_tiles[2][2][MQ_MOE_NT] = {
    {{tile_1_0_0, tile_2_0_0, tile_3_0_0, tile_4_0_0}, {tile_1_0_1, tile_2_0_1, tile_3_0_1, tile_4_0_1}},
    {{tile_1_1_0, tile_2_1_0, tile_3_1_0, tile_4_1_0}, {tile_1_1_1, tile_2_1_1, tile_3_1_1, tile_4_1_1}},
};

static void gemm_avx2(const mq_pmat *W, int64_t pair0, int64_t pair1, const mq_qact *A,
                      const int32_t *act_rows, int64_t row0, int64_t m, float *out, int64_t ldo,
                      int swiglu, const uint8_t *next) {
    moe_gemm_run(W, pair0, pair1, A, act_rows, row0, m, out, ldo, swiglu, next,
                 k_tiles[W->nvfp4 != 0][A->q2 != NULL], MQ_MOE_NT, PF_AHEAD);
}

const mq_moe_kernels mq_moe_kernels_avx2 = {quant_act_avx2, gemm_avx2};
