/*
 * NEON deterministic GEMM and Hessian update (see kernels/gemm_det.h), twins of
 * src/kernels/cpu/ref/gemm_det_ref.c: every element of C takes exactly the reference's fmaf chain
 * (FMLA, one rounding), one step per k (or per row of X) in order, so the results are bit for bit
 * the reference's, as with the AVX2 kernels, whose blocking this follows at NEON's width.
 * GEMM: a panel of 16 rows of A packed k-major (Ap[k][16], rows past M zero), four q registers per
 * k, against six rows of B read in place (one broadcast per row and k): 24 accumulators for a
 * 16 x 6 tile of C. K is not blocked (a split sum would change the order).
 * Hessian update: tiles of 6 rows (i) x 16 columns (j) of C, X repacked per block of rows into
 * 16-column panels so the tiles read it sequentially; tiles may reach past the diagonal in the last
 * panel of a row group (elements above it, never read; gemm_det.h allows it).
 */
#include <arm_neon.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/det_common.h"
#include "kernels/gemm_det.h"

enum { MR = 16, NR = 6 };

/* A 16 x nr tile (nr <= 6); the full width is instantiated separately so its 24 accumulators
 * stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *ap, int64_t K, const float *B,
                                                      int64_t ldb, const int nr, float *C,
                                                      int64_t ldc, int64_t m) {
    float32x4_t c[NR][4];
#pragma GCC unroll 6
    for (int r = 0; r < nr; r++) c[r][0] = c[r][1] = c[r][2] = c[r][3] = vdupq_n_f32(0.0f);
    for (int64_t k = 0; k < K; k++) {
        const float *a = ap + k * MR;
        const float32x4_t a0 = vld1q_f32(a), a1 = vld1q_f32(a + 4), a2 = vld1q_f32(a + 8),
                          a3 = vld1q_f32(a + 12);
#pragma GCC unroll 6
        for (int r = 0; r < nr; r++) {
            const float32x4_t b = vld1q_dup_f32(B + r * ldb + k);
            c[r][0] = vfmaq_f32(c[r][0], a0, b);
            c[r][1] = vfmaq_f32(c[r][1], a1, b);
            c[r][2] = vfmaq_f32(c[r][2], a2, b);
            c[r][3] = vfmaq_f32(c[r][3], a3, b);
        }
    }
    /* C[i][r] for i < m from c[r][0..3] (rows 0-3, ..., 12-15) */
    float t[NR][MR];
#pragma GCC unroll 6
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < 4; q++) vst1q_f32(t[r] + 4 * q, c[r][q]);
    det_store_cols(&t[0][0], MR, nr, C, ldc, m);
}

static __attribute__((noinline)) void tile6(const float *ap, int64_t K, const float *B,
                                            int64_t ldb, float *C, int64_t ldc, int64_t m) {
    tile(ap, K, B, ldb, NR, C, ldc, m);
}

static __attribute__((noinline)) void tile_n(const float *ap, int64_t K, const float *B,
                                             int64_t ldb, int nr, float *C, int64_t ldc,
                                             int64_t m) {
    tile(ap, K, B, ldb, nr, C, ldc, m);
}

static void tiles(const float *ap, int64_t K, const float *B, int64_t ldb, int nr, float *C,
                  int64_t ldc, int64_t m) {
    if (nr == NR) tile6(ap, K, B, ldb, C, ldc, m);
    else tile_n(ap, K, B, ldb, nr, C, ldc, m);
}

enum { KSTACK = 4096 };   /* panels up to this K live in thread-local storage (256 KiB) */

void mq_gemm_det_nt_neon(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *B, int64_t ldb, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    if (K > KSTACK) {   /* rare: the panel does not fit; the reference gives the same values */
        mq_gemm_det_nt_ref(M, N, K, A, lda, B, ldb, C, ldc);
        return;
    }
    _Alignas(64) static _Thread_local float ap[KSTACK * MR];
    det_gemm_run(M, N, K, A, lda, B, ldb, C, ldc, MR, NR, ap, tiles);
}

/* ---- the Hessian update ------------------------------------------------------------------------ */
enum { SR = SYRK_SR, SC = SYRK_SC, ROWS_BLK = SYRK_ROWS };


/* Rows i0 .. i0 + nr - 1 (nr <= 6) of C by the 16 columns j0 .. j0 + 15: per row r of X, the
 * panel's 16 values of X[r][j] and one broadcast of X[r][i] per row of the tile, one fma per
 * element, continuing from C. */
static inline __attribute__((always_inline)) void syrk_tile(int64_t n, const float *P, int64_t i0,
                                                           const int nr, int64_t j0, float *C,
                                                           int64_t ldc) {
    const int64_t pstride = ROWS_BLK * SC;   /* floats per panel */
    const float *vj = P + (j0 / SC) * pstride;
    const float *bi[SR];
    float32x4_t c[SR][4];
    for (int t = 0; t < SR; t++)   /* rows past nr are never used; set for the compiler */
        for (int q = 0; q < 4; q++) c[t][q] = vdupq_n_f32(0.0f);
#pragma GCC unroll 6
    for (int t = 0; t < nr; t++) {
        bi[t] = P + ((i0 + t) / SC) * pstride + (i0 + t) % SC;
        const float *ct = C + (i0 + t) * ldc + j0;
        for (int q = 0; q < 4; q++) c[t][q] = vld1q_f32(ct + 4 * q);
    }
    for (int64_t r = 0; r < n; r++) {
        const int64_t o = r * SC;
        const float32x4_t v0 = vld1q_f32(vj + o), v1 = vld1q_f32(vj + o + 4),
                          v2 = vld1q_f32(vj + o + 8), v3 = vld1q_f32(vj + o + 12);
#pragma GCC unroll 6
        for (int t = 0; t < nr; t++) {
            const float32x4_t b = vld1q_dup_f32(bi[t] + o);
            c[t][0] = vfmaq_f32(c[t][0], v0, b);
            c[t][1] = vfmaq_f32(c[t][1], v1, b);
            c[t][2] = vfmaq_f32(c[t][2], v2, b);
            c[t][3] = vfmaq_f32(c[t][3], v3, b);
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < nr; t++) {
        float *ct = C + (i0 + t) * ldc + j0;
        for (int q = 0; q < 4; q++) vst1q_f32(ct + 4 * q, c[t][q]);
    }
}

static __attribute__((noinline)) void syrk_tile6(int64_t n, const float *P, int64_t i0,
                                                 int64_t j0, float *C, int64_t ldc) {
    syrk_tile(n, P, i0, SR, j0, C, ldc);
}

static __attribute__((noinline)) void syrk_tile_n(int64_t n, const float *P, int64_t i0, int nr,
                                                  int64_t j0, float *C, int64_t ldc) {
    syrk_tile(n, P, i0, nr, j0, C, ldc);
}

/* Rows [i0, i1) of C: whole 16-column panels while they reach the diagonal (det_common.h's
 * syrk_run does the rest). */
static int64_t syrk_tiles(int64_t n, const float *P, int64_t i0, int64_t i1, int64_t K,
                          int64_t panels, float *C, int64_t ldc) {
    (void)panels;
    int64_t j0 = 0;
    for (; j0 + SC <= K && j0 <= i1 - 1; j0 += SC) {
        if (i1 - i0 == SR) syrk_tile6(n, P, i0, j0, C, ldc);
        else syrk_tile_n(n, P, i0, (int)(i1 - i0), j0, C, ldc);
    }
    return j0;
}

void mq_syrk_det_acc_neon(int64_t K, int64_t n, const float *X, int64_t ldx, float *C,
                          int64_t ldc, int64_t row0, int64_t row1) {
    syrk_acc_twin(K, n, X, ldx, C, ldc, row0, row1, 64, syrk_tiles);
}

/* no cross sum twin: the reference's chains (the same values) */
const mq_det_kernels mq_det_neon = {mq_gemm_det_nt_neon, mq_syrk_det_acc_neon, mq_cross_det_acc_ref};
