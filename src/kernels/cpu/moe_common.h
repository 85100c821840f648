/*
 * What the MoE op's SIMD twins (x86/moe_avx2.c, x86/moe_avx512_body.h, arm/moe_neon_body.h)
 * and the scalar reference (ref/moe_ref.c) share besides their instructions: the walk of a GEMM
 * call over blocks of activation rows, tile pairs and micro-tiles; a tile's view of its pair and
 * blocks; where its software prefetch reads; the rows' activation planes; and where quant_act
 * writes a row and what it writes for a block it cannot scale. Free of any instruction set, so
 * each twin includes it under its own flags.
 */
#ifndef MOEQ_KERNELS_CPU_MOE_COMMON_H
#define MOEQ_KERNELS_CPU_MOE_COMMON_H

#include <math.h>
#include <string.h>

#include "kernels/moe_ffn.h"

enum { MOE_TILE_MAX = 8 };   /* the most activation rows a twin's micro-tile takes (AVX-512) */

/* A twin's micro-tile: tile pair `pair` of W x nt (the instantiation's count) activation rows
 * arow[], the results to o[t] (8 SwiGLU outputs or 16 row results); `ahead`: how far on its
 * software prefetch reads (0: none). */
typedef void (*moe_tile_fn)(const mq_pmat *W, int64_t pair, const mq_qact *A, const int64_t *arow,
                            float *const *o, int swiglu, size_t ahead, const uint8_t *next);

/* One out-of-line instantiation of the including twin's always-inline `tile` per (token count,
 * scheme, activation planes), so each keeps its accumulators in registers: tile_NT_NV_SP. */
#define MOE_TILE_FN(NT, NV, SP)                                                                    \
    static __attribute__((noinline)) void tile_##NT##_##NV##_##SP(                                 \
        const mq_pmat *W, int64_t pair, const mq_qact *A, const int64_t *arow, float *const *o,    \
        int swiglu, size_t ahead, const uint8_t *next) {                                           \
        tile(W, pair, A, arow, o, swiglu, ahead, next, NT, NV, SP);                                \
    }
#define MOE_TILE_FNS(NT) MOE_TILE_FN(NT, 0, 0) MOE_TILE_FN(NT, 0, 1) MOE_TILE_FN(NT, 1, 0) MOE_TILE_FN(NT, 1, 1)

/* Where the tile of pair `pair` (its first row block at rb0) prefetches: the pair `ahead` bytes on
 * (whole pairs, at least the next), past the matrix's last pair continuing at `next`, where the
 * calling thread reads next (NULL: nowhere); NULL when ahead is 0. */
static inline const uint8_t *moe_prefetch_at(const mq_pmat *W, int64_t pair, const uint8_t *rb0,
                                             const uint8_t *next, size_t ahead) {
    if (!ahead) return NULL;
    const size_t pair_bytes = 2 * W->rb_bytes;
    const int64_t dist = (int64_t)((ahead + pair_bytes - 1) / pair_bytes);
    const int64_t npairs = W->rows / 16;
    return pair + dist < npairs ? rb0 + (size_t)dist * pair_bytes
           : next ? next + (size_t)(pair + dist - npairs) * pair_bytes
                  : NULL;
}

/* The activation planes, scales and corrections (ac may be NULL) of the tile's nt rows (lds: the
 * scales' row stride, A->ld over the block the weights' scheme takes). */
static inline __attribute__((always_inline)) void moe_act_rows(const mq_qact *A, const int64_t *arow,
                                                               int nt, int split, int64_t lds,
                                                               const int8_t **aq, const int8_t **aq2,
                                                               const float **as, const int32_t **ac) {
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) {
        aq[t] = A->q + arow[t] * A->ld;
        aq2[t] = split ? A->q2 + arow[t] * A->ld : NULL;
        as[t] = A->scale + arow[t] * lds;
        if (ac) ac[t] = A->corr + arow[t] * lds;
    }
}

/* Where quant_act writes row `row` of A from column col0: the int8 plane(s), the blocks' scales
 * and corrections, and the largest code (int16 split: 32512, int8: 127). */
typedef struct {
    int8_t *q, *q2;
    float *sc;
    int32_t *cr;
    float qmax;
} moe_qact_dst;
static inline moe_qact_dst moe_qact_at(const mq_qact *A, int64_t row, int64_t col0) {
    const int32_t B = A->block;
    const int split = A->q2 != NULL;
    return (moe_qact_dst){A->q + row * A->ld + col0, split ? A->q2 + row * A->ld + col0 : NULL,
                          A->scale + row * (A->ld / B) + col0 / B,
                          A->corr + row * (A->ld / B) + col0 / B, split ? 32512.0f : 127.0f};
}

/* quant_act's blocks without a scale: one holding a NaN (nan) or an infinity, whose products a
 * NaN scale poisons, and one whose largest magnitude m is below 2^-100 (scale 0). Their codes and
 * correction are 0. Returns whether block b is one of them (then written). */
static inline int moe_qact_unscaled(const moe_qact_dst *d, int64_t b, int32_t B, float m, int nan) {
    const int bad = nan || m == INFINITY;
    if (!bad && m >= 0x1p-100f) return 0;
    memset(d->q + b * B, 0, (size_t)B);
    if (d->q2) memset(d->q2 + b * B, 0, (size_t)B);
    d->sc[b] = bad ? NAN : 0.0f;
    d->cr[b] = 0;
    return 1;
}

/* How a tile walks a row block: activation blocks of B columns (NVFP4 16: one E4M3 scale each;
 * INT4 32) in CH chunks of 8 columns, nb of them per row, bpg per weight group; the weights'
 * scale storage and sign, and the activation scales' row stride lds. */
typedef struct {
    int B, CH, bpg, stype, neg;
    int64_t nb, lds;
} moe_blocks;
static inline __attribute__((always_inline)) moe_blocks moe_blocks_of(const mq_pmat *W, const mq_qact *A,
                                                                      int nvfp4) {
    const int B = nvfp4 ? 16 : 32;
    return (moe_blocks){B, B / 8, nvfp4 ? 1 : W->group / B, W->stype, W->neg_scales, W->cols / B,
                        A->ld / B};
}

/* The x86 twins' view of tile pair `pair`: its two row blocks and their scales, and where and by
 * how much per chunk its software prefetch moves (moe_prefetch_at; NULL: none). */
typedef struct {
    const uint8_t *rb0, *rb1, *s0, *s1, *pf;
    size_t pf_step;
} moe_pair;
static inline __attribute__((always_inline)) moe_pair moe_pair_at(const mq_pmat *W, int64_t pair,
                                                                  const uint8_t *next, size_t ahead) {
    const uint8_t *rb0 = W->data + (size_t)(2 * pair) * W->rb_bytes, *rb1 = rb0 + W->rb_bytes;
    const size_t nch = (size_t)(W->cols / 8);
    return (moe_pair){rb0, rb1, rb0 + (size_t)W->cols * 4, rb1 + (size_t)W->cols * 4,
                      moe_prefetch_at(W, pair, rb0, next, ahead), (2 * W->rb_bytes + nch - 1) / nch};
}

/* mq_moe_kernels' gemm over the twin's micro-tiles fns[nt - 1] of up to ntmax rows: blocks of 64
 * activation rows stay in L2 while the pairs stream by, and each pair's 16 rows stay in L1 across
 * the block's tiles; the first tile of a block prefetches `ahead` bytes on. */
static inline void moe_gemm_run(const mq_pmat *W, int64_t pair0, int64_t pair1, const mq_qact *A,
                                const int32_t *act_rows, int64_t row0, int64_t m, float *out,
                                int64_t ldo, int swiglu, const uint8_t *next, const moe_tile_fn *fns,
                                int ntmax, size_t ahead) {
    for (int64_t ib = 0; ib < m; ib += 64) {
        const int64_t ie = ib + 64 < m ? ib + 64 : m;
        for (int64_t pair = pair0; pair < pair1; pair++) {
            for (int64_t i0 = ib; i0 < ie; i0 += ntmax) {
                const int nt = ie - i0 < ntmax ? (int)(ie - i0) : ntmax;
                int64_t arow[MOE_TILE_MAX];
                float *o[MOE_TILE_MAX];
                for (int t = 0; t < nt; t++) {
                    arow[t] = act_rows ? act_rows[i0 + t] : row0 + i0 + t;
                    o[t] = out + (i0 + t) * ldo + (swiglu ? 8 * (pair - pair0) : 16 * pair);
                }
                fns[nt - 1](W, pair, A, arow, o, swiglu, i0 == ib ? ahead : 0, next);
            }
        }
    }
}

#endif
