/*
 * Body of the AVX-512 kernels of the quantized MoE feed-forward op, twins of
 * src/kernels/cpu/ref/moe_ref.c with bit-identical results (the same exact integer block products,
 * then the same fp32 operations in the same order as the reference and the AVX2 kernels). Layout
 * and integer scheme: see src/kernels/moe_ffn.h. This file is the body of two translation units,
 * each compiled with its own flags and exporting one kernel set:
 *   moe_avx512.c       MQ_AVX512_VNNI 0, AVX-512F/BW/VL: _mm512_maddubs_epi16 into int16 lanes
 *                      within a block (the AVX2 kernel's bounds: at most 8 pair sums of
 *                      2 * 15 * 128 for INT4, 4 of 2 * 24 * 128 for NVFP4, below 2^15), widened
 *                      once per block with _mm512_madd_epi16;
 *   moe_avx512_vnni.c  MQ_AVX512_VNNI 1, plus AVX512-VNNI: _mm512_dpbusd_epi32 adds the four
 *                      u8 x s8 products of each 32-bit lane to an int32 lane directly (no
 *                      saturation: |I| < 2^24).
 * Both are called only when the CPU reports the extensions (mq_cpu_has_avx512[_vnni]()).
 *
 * One zmm holds the same 32-byte chunk of both row blocks of a tile pair (rb0 in the low half,
 * rb1 in the high half), so a lane's 4 bytes are 4 consecutive columns of one of the pair's 16
 * rows and one broadcast activation quad serves all 16 rows: per chunk and token 2 dot
 * instructions per activation plane where the AVX2 kernel needs 4 (plus 4 adds). The 16 lanes of
 * a result are rows 16 pair + 0..15, the order the plain epilogue stores; the SwiGLU epilogue
 * takes the low half as gate and the high half as up. Tile: one pair x up to 8 activation rows
 * (3 zmm per row with split activations: 24 of the 32 registers). Software prefetch as the AVX2
 * kernel (the pair ~24 KiB ahead into L2, continuing at `next`).
 */
/* -O3 unrolls the tile loops completely, so the accumulators stay in registers. */
#if !defined(__clang__)   /* GCC only (clang, the fuzz build's compiler, has no such pragma) */
#pragma GCC optimize("O3")
#endif

#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/moe_common.h"
#include "kernels/cpu/x86/exp_avx2.h"
#include "core/env.h"
#include "kernels/moe_ffn.h"

#ifndef MQ_AVX512_VNNI
#error "define MQ_AVX512_VNNI (0 or 1) before including moe_avx512_body.h"
#endif

#define INLINE static inline __attribute__((always_inline))

enum { NT512 = 8 };

/* How far ahead the tiles prefetch, in bytes: 24 KiB as the AVX2 kernel, or MOEQ_DEBUG_MOE_PREFETCH_KIB
 * (0 = no software prefetch; a tuning knob for `moeq bench moe-ffn` on new hosts), read once. */
static size_t pf_ahead(void) {
    static _Atomic long cached = -1;   /* threads racing here store the same value */
    long v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v < 0) {
        const char *e = mq_env(MQ_ENV_MOE_PREFETCH_KIB);
        v = e && *e ? strtol(e, NULL, 10) : 24;
        v = v < 0 ? 0 : v > 4096 ? 4096 : v;
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return (size_t)v << 10;
}

/* 16 E4M3 bytes (8 of each row block) -> fp32, as e4m3x8 in moe_avx2.c: the magnitude bits
 * shifted into an fp32 exponent/mantissa are the value times 2^-120, one exact multiply. */
INLINE __m512 e4m3x16(const uint8_t *p0, const uint8_t *p1, int neg) {
    __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p0),
                                   _mm_loadl_epi64((const __m128i *)p1));
    __m512i v = _mm512_cvtepu8_epi32(b);
    __m512i bits = _mm512_slli_epi32(v, 20);
    if (neg) {
        __m512i mag = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7f)), 20);
        __m512i sgn = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
        bits = _mm512_or_si512(mag, sgn);
    }
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}

/* The 16 INT4 scales of group g of both row blocks (fp32, or exact 16-bit storage). */
INLINE __m512 int4_scales16(const uint8_t *s0, const uint8_t *s1, int64_t g, int stype) {
    if (stype == MQ_MOE_S_F32) {
        __m256 a = _mm256_loadu_ps((const float *)s0 + g * 8), b = _mm256_loadu_ps((const float *)s1 + g * 8);
        return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)),
                                                   _mm256_castps_pd(b), 1));
    }
    __m256i h = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(s0 + g * 16))),
        _mm_loadu_si128((const __m128i *)(s1 + g * 16)), 1);
    if (stype == MQ_MOE_S_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* ---- activation quantization ---------------------------------------------------------------- */
static void quant_act_avx512(const float *x, int64_t n, const mq_qact *A, int64_t row,
                             int64_t col0) {
    const int32_t B = A->block, nv = B / 16;   /* 1 or 2 vectors per block */
    const int split = A->q2 != NULL;
    const moe_qact_dst d = moe_qact_at(A, row, col0);
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < n / B; b++) {
        const float *v = x + b * B;
        __m512 vx[2], amax = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (int j = 0; j < nv; j++) {
            vx[j] = _mm512_loadu_ps(v + 16 * j);
            __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(vx[j]),
                                                            _mm512_castps_si512(absmask)));
            nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
            amax = _mm512_max_ps(amax, a);
        }
        /* the maximum of the non-NaN magnitudes does not depend on the order it is taken in */
        const float m = _mm512_reduce_max_ps(amax);
        if (moe_qact_unscaled(&d, b, B, m, nan != 0)) continue;
        /* the reference's nearbyintf(x * inv): one rounded product, then the current (nearest
         * even) rounding of the conversion */
        __m512 inv = _mm512_set1_ps(d.qmax / m);
        __m512i sum = _mm512_setzero_si512();
        for (int j = 0; j < nv; j++) {
            __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(vx[j], inv));
            sum = _mm512_add_epi32(sum, c);
            if (split) {
                __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(c, _mm512_set1_epi32(128)), 8);
                __m512i lo = _mm512_sub_epi32(c, _mm512_slli_epi32(hi, 8));
                _mm_storeu_si128((__m128i *)(d.q2 + b * B + 16 * j), _mm512_cvtepi32_epi8(lo));
                c = hi;
            }
            _mm_storeu_si128((__m128i *)(d.q + b * B + 16 * j), _mm512_cvtepi32_epi8(c));
        }
        d.sc[b] = m / d.qmax;
        d.cr[b] = _mm512_reduce_add_epi32(sum) * A->offset;
    }
}

/* ---- GEMM micro-tile -------------------------------------------------------------------------- */
/* acc += the products of the 64 unsigned weight bytes w and a broadcast activation quad a, summed
 * per 32-bit lane (VNNI) or per 16-bit pair (int16 lanes, widened at the end of the block). */
INLINE __m512i dot4(__m512i acc, __m512i w, __m512i a) {
#if MQ_AVX512_VNNI
    return _mm512_dpbusd_epi32(acc, w, a);
#else
    return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, a));
#endif
}

/* The block's exact integer I per lane: 256 dot(u, q) + dot(u, q2) (split) or dot(u, q), minus
 * corr. */
INLINE __m512i block_int(__m512i acc, __m512i acc2, int split, int32_t corr) {
#if MQ_AVX512_VNNI
    __m512i i = split ? _mm512_add_epi32(_mm512_slli_epi32(acc, 8), acc2) : acc;
#else
    const __m512i ones = _mm512_set1_epi16(1);
    __m512i i = _mm512_madd_epi16(acc, ones);
    if (split) i = _mm512_add_epi32(_mm512_madd_epi16(acc, _mm512_set1_epi16(256)),
                                    _mm512_madd_epi16(acc2, ones));
#endif
    return _mm512_sub_epi32(i, _mm512_set1_epi32(corr));
}

INLINE __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* One tile pair x nt activation rows, with the epilogue: o[t] receives 8 SwiGLU outputs or the 16
 * row results of activation row t. */
INLINE void tile(const mq_pmat *W, int64_t pair, const mq_qact *A, const int64_t *arow,
                 float *const *o, int swiglu, size_t ahead, const uint8_t *next, const int nt,
                 const int nvfp4, const int split) {
    /* the AVX2 kernel's prefetch (moe_avx2.c says why and how far); ahead = 0: none */
    const moe_pair pr = moe_pair_at(W, pair, next, ahead);
    const moe_blocks k = moe_blocks_of(W, A, nvfp4);
    const int8_t *aq[NT512], *aq2[NT512];
    const float *as[NT512];
    const int32_t *ac[NT512];
    moe_act_rows(A, arow, nt, split, k.lds, aq, aq2, as, ac);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i lut = _mm512_broadcast_i32x4(
        _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    __m512 f[NT512];
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) f[t] = _mm512_setzero_ps();
    /* Independent accumulator chains per plane: a VNNI dot's result feeds the next one's
     * accumulator, so with one chain a few activation rows wait on its latency instead of the
     * memory (one decoded token: 8 dependent dots per block). The integer sums are exact, so
     * merging the chains at the block's end gives the same I. NW chains: the nibble half (lo, hi)
     * and, for one row, also the chunk's parity. */
    enum { WMAX = 4 };
    const int NW = !MQ_AVX512_VNNI ? 1 : nt == 1 ? 4 : nt <= 4 ? 2 : 1;
    int64_t g = 0;
    int in_group = 0;
    for (int64_t b = 0; b < k.nb; b++) {
        __m512i acc[WMAX][NT512], acc2[WMAX][NT512];
#pragma GCC unroll 4
        for (int w = 0; w < NW; w++)
#pragma GCC unroll 8
            for (int t = 0; t < nt; t++) {
                acc[w][t] = _mm512_setzero_si512();
                acc2[w][t] = _mm512_setzero_si512();
            }
#pragma GCC unroll 4
        for (int c = 0; c < k.CH; c++) {
            const int wl = NW == 4 ? 2 * (c & 1) : 0, wh = NW == 1 ? 0 : wl + 1;
            const size_t off = (size_t)(b * k.CH + c) * 32;
            if (pr.pf) {
                const uint8_t *p = pr.pf + (size_t)(b * k.CH + c) * pr.pf_step;
                _mm_prefetch((const char *)p, _MM_HINT_T1);
                _mm_prefetch((const char *)p + 64, _MM_HINT_T1);
            }
            __m512i v = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(pr.rb0 + off))),
                _mm256_loadu_si256((const __m256i *)(pr.rb1 + off)), 1);
            __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            if (nvfp4) {
                lo = _mm512_shuffle_epi8(lut, lo);
                hi = _mm512_shuffle_epi8(lut, hi);
            }
#pragma GCC unroll 8
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = aq[t] + b * k.B + c * 8;
                acc[wl][t] = dot4(acc[wl][t], lo, bcast4(xq));
                acc[wh][t] = dot4(acc[wh][t], hi, bcast4(xq + 4));
                if (split) {
                    const int8_t *xq2 = aq2[t] + b * k.B + c * 8;
                    acc2[wl][t] = dot4(acc2[wl][t], lo, bcast4(xq2));
                    acc2[wh][t] = dot4(acc2[wh][t], hi, bcast4(xq2 + 4));
                }
            }
        }
        /* merge the chains: (0 + 1) + (2 + 3), exact int32 sums (VNNI only: NW is 1 otherwise) */
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) {
            if (NW >= 2) {
                acc[0][t] = _mm512_add_epi32(acc[0][t], acc[1][t]);
                acc2[0][t] = _mm512_add_epi32(acc2[0][t], acc2[1][t]);
            }
            if (NW == 4) {
                acc[0][t] = _mm512_add_epi32(acc[0][t], _mm512_add_epi32(acc[2][t], acc[3][t]));
                acc2[0][t] = _mm512_add_epi32(acc2[0][t], _mm512_add_epi32(acc2[2][t], acc2[3][t]));
            }
        }
        __m512 sw;
        if (nvfp4) {
            sw = e4m3x16(pr.s0 + b * 8, pr.s1 + b * 8, k.neg);
        } else {
            sw = int4_scales16(pr.s0, pr.s1, g, k.stype);
            if (++in_group == k.bpg) {
                in_group = 0;
                g++;
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) {
            __m512i i = block_int(acc[0][t], acc2[0][t], split, ac[t][b]);
            f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(sw, _mm512_set1_ps(as[t][b])), f[t]);
        }
    }
    const __m512 dv = _mm512_insertf32x4(
        _mm512_insertf32x4(_mm512_set1_ps(W->div[0]), _mm_set1_ps(W->div[1]), 2),
        _mm_set1_ps(W->div[1]), 3);
    const __m512 uv = _mm512_insertf32x4(
        _mm512_insertf32x4(_mm512_set1_ps(W->mul[0]), _mm_set1_ps(W->mul[1]), 2),
        _mm_set1_ps(W->mul[1]), 3);
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) {
        __m512 y = _mm512_div_ps(_mm512_mul_ps(f[t], uv), dv);
        if (swiglu) {
            __m256 y0 = _mm512_castps512_ps256(y);
            __m256 y1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1));
            _mm256_storeu_ps(o[t], _mm256_mul_ps(mq_silu_avx2(y0), y1));
        } else {
            _mm512_storeu_ps(o[t], y);
        }
    }
}

/* moe_common.h's instantiations of `tile`. */
MOE_TILE_FNS(1)
MOE_TILE_FNS(2)
MOE_TILE_FNS(3)
MOE_TILE_FNS(4)
MOE_TILE_FNS(5)
MOE_TILE_FNS(6)
MOE_TILE_FNS(7)
MOE_TILE_FNS(8)
#define TILE_ROW(NV, SP)                                                                           \
    {tile_1_##NV##_##SP, tile_2_##NV##_##SP, tile_3_##NV##_##SP, tile_4_##NV##_##SP,               \
     tile_5_##NV##_##SP, tile_6_##NV##_##SP, tile_7_##NV##_##SP, tile_8_##NV##_##SP}
static const moe_tile_fn k_tiles[2][2][NT512] = {
    {TILE_ROW(0, 0), TILE_ROW(0, 1)},
    {TILE_ROW(1, 0), TILE_ROW(1, 1)},
};

static void gemm_avx512(const mq_pmat *W, int64_t pair0, int64_t pair1, const mq_qact *A,
                        const int32_t *act_rows, int64_t row0, int64_t m, float *out, int64_t ldo,
                        int swiglu, const uint8_t *next) {
    moe_gemm_run(W, pair0, pair1, A, act_rows, row0, m, out, ldo, swiglu, next,
                 k_tiles[W->nvfp4 != 0][A->q2 != NULL], NT512, pf_ahead());
}
