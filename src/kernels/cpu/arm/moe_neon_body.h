/*
 * Body of the NEON kernels of the quantized MoE feed-forward op, twins of
 * src/kernels/cpu/ref/moe_ref.c with bit-identical results (the same integer block products,
 * then the same fp32 operations in the same order). Layout and integer scheme: see
 * src/kernels/moe_ffn.h. This file is the body of two translation units, each compiled with its
 * own flags and exporting one kernel set:
 *   moe_neon.c      MQ_NEON_DOT 0, base AArch64 Advanced SIMD: widening multiply-accumulates
 *                   (SMLAL/SMLAL2) into int16 lanes within a block, pairwise-widened at its end;
 *   moe_neon_dot.c  MQ_NEON_DOT 1, -march=armv8.2-a+dotprod: SDOT (by element), called only when
 *                   the CPU reports it (mq_cpu_has_neon_dot()).
 *
 * A 32-byte chunk of a row block is two q registers of 4 rows x 4 columns per 32-bit lane (low
 * nibbles: columns 0-3 of the chunk, high nibbles: columns 4-7): the operand shape of SDOT, whose
 * lane r then sums row r's four products. Nibbles are split with AND/USHR and mapped by one TBL
 * (vqtbl1q_s8) to *signed* weights: INT4 q = code - 8, NVFP4 2 * e2m1 (-12..12). The reference
 * uses unsigned u = w + offset and subtracts corr = offset * sum(v); dot(w, v) is the same
 * integer I, so no correction is needed here (A->offset must be the scheme's, as moe_ffn.h says).
 * Bounds of the int16 lanes (no SDOT): |w| <= 12, |a| <= 128, at most 8 products per lane per
 * block (INT4: B = 32, |w| <= 8 -> 8192; NVFP4: B = 16, 4 products -> 6144).
 *
 * Tile: one row block (8 rows) x up to 4 activation rows at a time (2 for split activations
 * without SDOT, whose int16 accumulators take twice the registers), so the 32 q registers hold
 * the int accumulators (2 per token and plane; 4 with int16 lanes), the fp32 accumulators (2 per
 * token) and the unpacked chunk; a tile pair is its two row blocks in turn, the gate half parked
 * in a small buffer until the SwiGLU epilogue. Software prefetch mirrors the AVX2 kernel (the
 * pair ~24 KiB ahead, PRFM to L2); its distance is not tuned for any Arm core.
 */
#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/arm/exp_neon.h"
#include "kernels/cpu/moe_common.h"
#include "kernels/moe_ffn.h"

#ifndef MQ_NEON_DOT
#error "define MQ_NEON_DOT (0 or 1) before including moe_neon_body.h"
#endif

#define INLINE static inline __attribute__((always_inline))

enum { PF_AHEAD = 24 << 10 };

/* Signed weight of each 4-bit code: INT4 code - 8; NVFP4 2 * e2m1(code) (k_nvfp4_u - 12). */
static const int8_t k_w_int4[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
static const int8_t k_w_nvfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ---- activation quantization ---------------------------------------------------------------- */
INLINE int8x8_t narrow8(int32x4_t a, int32x4_t b) {
    return vmovn_s16(vcombine_s16(vmovn_s32(a), vmovn_s32(b)));
}

static void quant_act_neon(const float *x, int64_t n, const mq_qact *A, int64_t row,
                           int64_t col0) {
    const int32_t B = A->block, nv = B / 4;   /* 4 or 8 vectors per block */
    const int split = A->q2 != NULL;
    const moe_qact_dst d = moe_qact_at(A, row, col0);
    for (int64_t b = 0; b < n / B; b++) {
        const float *v = x + b * B;
        float32x4_t vx[8], amax = vdupq_n_f32(0.0f);
        uint32x4_t ordered = vdupq_n_u32(~0u);
        for (int j = 0; j < nv; j++) {
            vx[j] = vld1q_f32(v + 4 * j);
            float32x4_t a = vabsq_f32(vx[j]);
            ordered = vandq_u32(ordered, vceqq_f32(a, a));   /* clear in a NaN lane */
            amax = vmaxq_f32(amax, a);
        }
        const float m = vmaxvq_f32(amax);
        if (moe_qact_unscaled(&d, b, B, m, vminvq_u32(ordered) == 0)) continue;
        const float32x4_t inv = vdupq_n_f32(d.qmax / m);
        int32x4_t sum = vdupq_n_s32(0);
        for (int j = 0; j < nv; j += 2) {   /* 8 columns per step */
            /* FCVTNS: round to nearest, ties to even, as nearbyintf */
            int32x4_t c0 = vcvtnq_s32_f32(vmulq_f32(vx[j], inv));
            int32x4_t c1 = vcvtnq_s32_f32(vmulq_f32(vx[j + 1], inv));
            sum = vaddq_s32(sum, vaddq_s32(c0, c1));
            if (split) {
                /* hi = floor((c + 128) / 256) by an arithmetic shift, lo = c - 256 hi */
                int32x4_t h0 = vshrq_n_s32(vaddq_s32(c0, vdupq_n_s32(128)), 8);
                int32x4_t h1 = vshrq_n_s32(vaddq_s32(c1, vdupq_n_s32(128)), 8);
                vst1_s8(d.q2 + b * B + 4 * j,
                        narrow8(vsubq_s32(c0, vshlq_n_s32(h0, 8)), vsubq_s32(c1, vshlq_n_s32(h1, 8))));
                c0 = h0;
                c1 = h1;
            }
            vst1_s8(d.q + b * B + 4 * j, narrow8(c0, c1));
        }
        d.sc[b] = m / d.qmax;
        d.cr[b] = vaddvq_s32(sum) * A->offset;
    }
}

/* ---- weight scales ------------------------------------------------------------------------- */
/* 8 E4M3 bytes -> fp32, as e4m3x8 of moe_avx2.c: the magnitude bits placed at fp32's exponent and
 * mantissa (<< 20) are the value times 2^-120 (E4M3 subnormals land on fp32 subnormals), so one
 * exact multiply finishes it; the sign bit needs work only when some scale is negative. */
INLINE void e4m3x8(const uint8_t *p, int neg, float32x4_t out[2]) {
    uint16x8_t v = vmovl_u8(vld1_u8(p));
    if (neg)
        v = vorrq_u16(vshlq_n_u16(vandq_u16(v, vdupq_n_u16(0x7f)), 4),
                      vshlq_n_u16(vandq_u16(v, vdupq_n_u16(0x80)), 8));
    else
        v = vshlq_n_u16(v, 4);
    const float32x4_t k = vdupq_n_f32(0x1p120f);
    out[0] = vmulq_f32(vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16)), k);
    out[1] = vmulq_f32(vreinterpretq_f32_u32(vshll_high_n_u16(v, 16)), k);
}

/* The 8 INT4 scales of group g of a row block (fp32, or exact 16-bit storage). */
INLINE void int4_scales(const uint8_t *s, int64_t g, int stype, float32x4_t out[2]) {
    if (stype == MQ_MOE_S_F16) {
        float16x8_t h = vreinterpretq_f16_u8(vld1q_u8(s + g * 16));
        out[0] = vcvt_f32_f16(vget_low_f16(h));
        out[1] = vcvt_high_f32_f16(h);
    } else if (stype == MQ_MOE_S_BF16) {
        uint16x8_t h = vld1q_u16((const uint16_t *)(const void *)(s + g * 16));
        out[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
        out[1] = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
    } else {
        out[0] = vld1q_f32((const float *)(const void *)s + g * 8);
        out[1] = vld1q_f32((const float *)(const void *)s + g * 8 + 4);
    }
}

INLINE int8x16_t bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return vreinterpretq_s8_s32(vdupq_n_s32(v));
}

#if !MQ_NEON_DOT
/* A chunk of 8 columns of both row blocks of a pair (their weights l0, h0 and l1, h1, decoded)
 * times an activation row's 8 codes at xq (two broadcast quads), added to its int16 sums a[0..3]
 * (rows 0-1, 2-3, 4-5, 6-7): lane j of a row pair's vector is row 2k + j / 4, column j % 4 (+ 4). */
INLINE void mlal_chunk(int16x8_t a[4], int8x16_t l0, int8x16_t h0, int8x16_t l1, int8x16_t h1,
                       const int8_t *xq) {
    const int8x16_t q0 = bcast4(xq), q1 = bcast4(xq + 4);
    a[0] = vmlal_s8(vmlal_s8(a[0], vget_low_s8(l0), vget_low_s8(q0)), vget_low_s8(h0), vget_low_s8(q1));
    a[1] = vmlal_high_s8(vmlal_high_s8(a[1], l0, q0), h0, q1);
    a[2] = vmlal_s8(vmlal_s8(a[2], vget_low_s8(l1), vget_low_s8(q0)), vget_low_s8(h1), vget_low_s8(q1));
    a[3] = vmlal_high_s8(vmlal_high_s8(a[3], l1, q0), h1, q1);
}
#endif

/* ---- GEMM micro-tile -------------------------------------------------------------------------- */
/* Row block rb (half h of its pair) x nt activation rows: y[t][0..7] = the 8 row results of
 * activation row t (acc * mul[h] / div[h]). pf: where to prefetch this row block's share of the
 * pair ahead (NULL: none), pf_step bytes per chunk. */
INLINE void rb_tile(const mq_pmat *W, const uint8_t *rb, int h, const mq_qact *A,
                    const int64_t *arow, float *const *y, const uint8_t *pf, size_t pf_step,
                    const int nt, const int nvfp4, const int split) {
    const moe_blocks k = moe_blocks_of(W, A, nvfp4);
    const uint8_t *s = rb + (size_t)W->cols * 4;
    const int8_t *aq[MQ_MOE_NT], *aq2[MQ_MOE_NT];
    const float *as[MQ_MOE_NT];
    moe_act_rows(A, arow, nt, split, k.lds, aq, aq2, as, NULL);
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    const int8x16_t lut = vld1q_s8(nvfp4 ? k_w_nvfp4 : k_w_int4);
    float32x4_t f[MQ_MOE_NT][2];
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) f[t][0] = f[t][1] = vdupq_n_f32(0.0f);
    float32x4_t sw[2];
    int64_t g = 0;
    int in_group = 0;
    if (!nvfp4) int4_scales(s, 0, k.stype, sw);
    for (int64_t b = 0; b < k.nb; b++) {
#if MQ_NEON_DOT
        int32x4_t acc[MQ_MOE_NT][2], acc2[MQ_MOE_NT][2];   /* rows 0-3, 4-7 */
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            acc[t][0] = acc[t][1] = vdupq_n_s32(0);
            if (split) acc2[t][0] = acc2[t][1] = vdupq_n_s32(0);
        }
#else
        int16x8_t acc[MQ_MOE_NT][4], acc2[MQ_MOE_NT][4];   /* rows 0-1, 2-3, 4-5, 6-7 */
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = vdupq_n_s16(0);
            if (split) acc2[t][0] = acc2[t][1] = acc2[t][2] = acc2[t][3] = vdupq_n_s16(0);
        }
#endif
#pragma GCC unroll 4
        for (int c = 0; c < k.CH; c++) {
            const size_t off = (size_t)(b * k.CH + c) * 32;
            if (pf) __builtin_prefetch(pf + (size_t)(b * k.CH + c) * pf_step, 0, 2);
            uint8x16_t v0 = vld1q_u8(rb + off), v1 = vld1q_u8(rb + off + 16);
            int8x16_t l0 = vqtbl1q_s8(lut, vandq_u8(v0, m4)), h0 = vqtbl1q_s8(lut, vshrq_n_u8(v0, 4));
            int8x16_t l1 = vqtbl1q_s8(lut, vandq_u8(v1, m4)), h1 = vqtbl1q_s8(lut, vshrq_n_u8(v1, 4));
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = aq[t] + b * k.B + c * 8;
#if MQ_NEON_DOT
                /* lane 0 of a: the chunk's columns 0-3 (low nibbles), lane 1: columns 4-7 */
                int8x8_t a = vld1_s8(xq);
                acc[t][0] = vdotq_lane_s32(vdotq_lane_s32(acc[t][0], l0, a, 0), h0, a, 1);
                acc[t][1] = vdotq_lane_s32(vdotq_lane_s32(acc[t][1], l1, a, 0), h1, a, 1);
                if (split) {
                    int8x8_t a2 = vld1_s8(aq2[t] + b * k.B + c * 8);
                    acc2[t][0] = vdotq_lane_s32(vdotq_lane_s32(acc2[t][0], l0, a2, 0), h0, a2, 1);
                    acc2[t][1] = vdotq_lane_s32(vdotq_lane_s32(acc2[t][1], l1, a2, 0), h1, a2, 1);
                }
#else
                mlal_chunk(acc[t], l0, h0, l1, h1, xq);
                if (split) mlal_chunk(acc2[t], l0, h0, l1, h1, aq2[t] + b * k.B + c * 8);
#endif
            }
        }
        if (nvfp4) {
            e4m3x8(s + b * 8, k.neg, sw);
        } else if (in_group == k.bpg) {   /* the next group's scales */
            in_group = 0;
            int4_scales(s, ++g, k.stype, sw);
        }
        in_group++;
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
#if MQ_NEON_DOT
            int32x4_t i0 = acc[t][0], i1 = acc[t][1];
            if (split) {
                i0 = vaddq_s32(vshlq_n_s32(i0, 8), acc2[t][0]);
                i1 = vaddq_s32(vshlq_n_s32(i1, 8), acc2[t][1]);
            }
#else
            int32x4_t i0 = vpaddq_s32(vpaddlq_s16(acc[t][0]), vpaddlq_s16(acc[t][1]));
            int32x4_t i1 = vpaddq_s32(vpaddlq_s16(acc[t][2]), vpaddlq_s16(acc[t][3]));
            if (split) {
                i0 = vaddq_s32(vshlq_n_s32(i0, 8),
                               vpaddq_s32(vpaddlq_s16(acc2[t][0]), vpaddlq_s16(acc2[t][1])));
                i1 = vaddq_s32(vshlq_n_s32(i1, 8),
                               vpaddq_s32(vpaddlq_s16(acc2[t][2]), vpaddlq_s16(acc2[t][3])));
            }
#endif
            /* fma(float(I), sw * sa, acc), as the reference */
            const float32x4_t sa = vdupq_n_f32(as[t][b]);
            f[t][0] = vfmaq_f32(f[t][0], vcvtq_f32_s32(i0), vmulq_f32(sw[0], sa));
            f[t][1] = vfmaq_f32(f[t][1], vcvtq_f32_s32(i1), vmulq_f32(sw[1], sa));
        }
    }
    const float32x4_t mul = vdupq_n_f32(W->mul[h]), div = vdupq_n_f32(W->div[h]);
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) {
        vst1q_f32(y[t], vdivq_f32(vmulq_f32(f[t][0], mul), div));
        vst1q_f32(y[t] + 4, vdivq_f32(vmulq_f32(f[t][1], mul), div));
    }
}

/* One tile pair x nt activation rows with the epilogue: o[t] receives 8 SwiGLU outputs or the
 * 16 row results of activation row t. */
INLINE void tile(const mq_pmat *W, int64_t pair, const mq_qact *A, const int64_t *arow,
                 float *const *o, int swiglu, size_t ahead, const uint8_t *next, const int nt,
                 const int nvfp4, const int split) {
    const uint8_t *rb0 = W->data + (size_t)(2 * pair) * W->rb_bytes;
    /* the pair PF_AHEAD bytes ahead (at least the next), past the matrix's end continuing at
     * `next`, at the pace this pair is consumed: one line per chunk of each row block */
    const size_t pair_bytes = 2 * W->rb_bytes, nch = (size_t)W->cols / 8;
    const uint8_t *pf = moe_prefetch_at(W, pair, rb0, next, ahead);
    const size_t pf_step = (pair_bytes + 2 * nch - 1) / (2 * nch);
    float g[MQ_MOE_NT][8], u[MQ_MOE_NT][8];
    float *y0[MQ_MOE_NT], *y1[MQ_MOE_NT];
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) {
        y0[t] = swiglu ? g[t] : o[t];
        y1[t] = swiglu ? u[t] : o[t] + 8;
    }
    rb_tile(W, rb0, 0, A, arow, y0, pf, pf_step, nt, nvfp4, split);
    rb_tile(W, rb0 + W->rb_bytes, 1, A, arow, y1, pf ? pf + nch * pf_step : NULL, pf_step, nt,
            nvfp4, split);
    if (swiglu) {
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            vst1q_f32(o[t], vmulq_f32(mq_silu_neon(vld1q_f32(g[t])), vld1q_f32(u[t])));
            vst1q_f32(o[t] + 4, vmulq_f32(mq_silu_neon(vld1q_f32(g[t] + 4)), vld1q_f32(u[t] + 4)));
        }
    }
}

/* moe_common.h's instantiations of `tile`. Without SDOT split tiles take at most 2 tokens
 * (NT_SPLIT). */
#define NT_SPLIT (MQ_NEON_DOT ? 4 : 2)
MOE_TILE_FNS(1)
MOE_TILE_FNS(2)
#if MQ_NEON_DOT
MOE_TILE_FNS(3)
MOE_TILE_FNS(4)
#define SPLIT_3_4(NV) tile_3_##NV##_1, tile_4_##NV##_1
#else
MOE_TILE_FN(3, 0, 0) MOE_TILE_FN(3, 1, 0) MOE_TILE_FN(4, 0, 0) MOE_TILE_FN(4, 1, 0)
#define SPLIT_3_4(NV) NULL, NULL   /* never called: split tiles end at NT_SPLIT */
#endif
static const moe_tile_fn k_tiles[2][2][MQ_MOE_NT] = {
    {{tile_1_0_0, tile_2_0_0, tile_3_0_0, tile_4_0_0}, {tile_1_0_1, tile_2_0_1, SPLIT_3_4(0)}},
    {{tile_1_1_0, tile_2_1_0, tile_3_1_0, tile_4_1_0}, {tile_1_1_1, tile_2_1_1, SPLIT_3_4(1)}},
};

static void gemm_neon(const mq_pmat *W, int64_t pair0, int64_t pair1, const mq_qact *A,
                      const int32_t *act_rows, int64_t row0, int64_t m, float *out, int64_t ldo,
                      int swiglu, const uint8_t *next) {
    const int split = A->q2 != NULL;
    moe_gemm_run(W, pair0, pair1, A, act_rows, row0, m, out, ldo, swiglu, next,
                 k_tiles[W->nvfp4 != 0][split], split ? NT_SPLIT : MQ_MOE_NT, PF_AHEAD);
}
