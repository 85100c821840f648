/*
 * The AVX2+FMA deterministic GEMM (see kernels/gemm_det.h). A panel of 16 rows of A is packed
 * k-major (Ap[k][16], rows past M zero) so one k gives two vectors of 8 rows; six rows of B are
 * read in place, one broadcast per row and k. The 6 x 2 accumulators hold C for 16 rows x 6
 * columns; each lane takes exactly one fma per k, in k order, from +0: the scalar chain of the
 * reference, element for element. K is not blocked (a split sum would change the order); the
 * packed panel (16 x K floats, 128 KiB at K = 2048) stays in L2 while the six-row groups of B
 * stream past it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/det_common.h"
#include "kernels/gemm_det.h"

enum { MR = 16, NR = 6 };

/* The one micro-kernel of the GEMM's and the Hessian update's tiles: nr (<= 6) pairs of chains
 * of 8 lanes, acc[r][h] += v[k * vs + 8 h ..] * b[r][k * bs] for k < n, one fma per lane and k in
 * k order. v: the 16 lanes' stream (the packed panel of A, vs = MR; a panel of P, vs = SC); b[r]:
 * chain r's broadcast stream (a row of B, bs = 1; a row's lane of P, bs = SC). Inlined with a
 * constant nr, so the accumulators and pointers stay in registers. */
static inline __attribute__((always_inline)) void fma_chains(__m256 acc[][2], int nr, int64_t n,
                                                             const float *v, int64_t vs,
                                                             const float *const *b, int64_t bs) {
    for (int64_t k = 0; k < n; k++) {
        const __m256 v0 = _mm256_load_ps(v + k * vs), v1 = _mm256_load_ps(v + k * vs + 8);
#pragma GCC unroll 6
        for (int r = 0; r < nr; r++) {
            const __m256 bk = _mm256_broadcast_ss(b[r] + k * bs);
            acc[r][0] = _mm256_fmadd_ps(v0, bk, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(v1, bk, acc[r][1]);
        }
    }
}

/* nr (<= 6) columns of C from +0: the chains over nr rows of B, their lanes into C. */
static inline __attribute__((always_inline)) void tile(const float *ap, int64_t K, const float *B,
                                                       int64_t ldb, int nr, float *C, int64_t ldc,
                                                       int64_t m) {
    __m256 v[NR][2];
    const float *b[NR];
#pragma GCC unroll 6
    for (int r = 0; r < nr; r++) {
        v[r][0] = v[r][1] = _mm256_setzero_ps();
        b[r] = B + r * ldb;
    }
    fma_chains(v, nr, K, ap, MR, b, 1);
    float t[NR][MR];
#pragma GCC unroll 6
    for (int r = 0; r < nr; r++) {
        _mm256_storeu_ps(t[r], v[r][0]);
        _mm256_storeu_ps(t[r] + 8, v[r][1]);
    }
    det_store_cols(&t[0][0], MR, nr, C, ldc, m);
}

/* The 16 x 6 tile: twelve accumulators in registers. */
static void tile6(const float *ap, int64_t K, const float *B, int64_t ldb, float *C, int64_t ldc,
                  int64_t m) {
    tile(ap, K, B, ldb, NR, C, ldc, m);
}

/* A tile of nr < 6 columns (the last group): the same chains, one column at a time. */
static void tile_n(const float *ap, int64_t K, const float *B, int64_t ldb, int nr, float *C,
                   int64_t ldc, int64_t m) {
    for (int r = 0; r < nr; r++) tile(ap, K, B + r * ldb, ldb, 1, C + r, ldc, m);
}

static void tiles(const float *ap, int64_t K, const float *B, int64_t ldb, int nr, float *C,
                  int64_t ldc, int64_t m) {
    if (nr == NR) tile6(ap, K, B, ldb, C, ldc, m);
    else tile_n(ap, K, B, ldb, nr, C, ldc, m);
}

enum { KSTACK = 4096 };   /* panels up to this K live on the stack (256 KiB) */

void mq_gemm_det_nt_avx2(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *B, int64_t ldb, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    if (K > KSTACK) {   /* rare: no scratch to fit the panel; the reference is the same values */
        mq_gemm_det_nt_ref(M, N, K, A, lda, B, ldb, C, ldc);
        return;
    }
    _Alignas(32) static _Thread_local float ap[KSTACK * MR];
    det_gemm_run(M, N, K, A, lda, B, ldb, C, ldc, MR, NR, ap, tiles);
}

/* ---- the Hessian update ------------------------------------------------------------------------ */
/* Tiles of 6 rows (i) by 16 columns (j) of C, the columns contiguous in C: per row r of X two
 * loads of X[r][j0..j0+15] and six broadcasts of X[r][i0..i0+5], one fma per element and row, in
 * row order, continuing from C. X goes in blocks of rows repacked by 16-column panels
 * (P[panel][r][16], one page per panel and block instead of one per row), so the tiles read it
 * sequentially; the chain of every element runs on across the blocks unchanged. Tiles reach past
 * the diagonal in the last panel of a row group (elements above the diagonal, never read). */
enum { SR = SYRK_SR, SC = SYRK_SC, ROWS_BLK = SYRK_ROWS };


/* Rows [i0, i0 + nr) (nr <= 6) x columns [j0, j0 + 16) of C, continuing from C. Pi: the panels
 * the broadcasts (rows i) come from, Pj: those of the 16 columns j (the same panels for the
 * Hessian, the two streams' inputs for the cross sum). */
static inline __attribute__((always_inline)) void syrk_rows(int64_t n, const float *Pi, const float *Pj,
                                                            int64_t i0, int nr, int64_t j0, float *C,
                                                            int64_t ldc) {
    const int64_t pstride = ROWS_BLK * SC;   /* floats per panel */
    float *c[SR];
    const float *b[SR];
    __m256 a[SR][2];
#pragma GCC unroll 6
    for (int t = 0; t < nr; t++) {
        c[t] = C + (i0 + t) * ldc + j0;
        b[t] = Pi + ((i0 + t) / SC) * pstride + (i0 + t) % SC;
        a[t][0] = _mm256_loadu_ps(c[t]);
        a[t][1] = _mm256_loadu_ps(c[t] + 8);
    }
    fma_chains(a, nr, n, Pj + (j0 / SC) * pstride, SC, b, SC);
#pragma GCC unroll 6
    for (int t = 0; t < nr; t++) {
        _mm256_storeu_ps(c[t], a[t][0]);
        _mm256_storeu_ps(c[t] + 8, a[t][1]);
    }
}

static void syrk_tile6(int64_t n, const float *Pi, const float *Pj, int64_t i0, int64_t j0, float *C, int64_t ldc) {
    syrk_rows(n, Pi, Pj, i0, SR, j0, C, ldc);
}

/* A row group of nr < 6 rows (the last of a range) over one full panel: the same chains. */
static void syrk_tile_n(int64_t n, const float *P, const float *Pj, int64_t i0, int nr, int64_t j0, float *C,
                        int64_t ldc) {
    for (int t = 0; t < nr; t++) syrk_rows(n, P, Pj, i0 + t, 1, j0, C, ldc);
}

/* Rows [i0, i1) of C: whole 16-column panels while they reach the diagonal (det_common.h's
 * syrk_run does the rest). */
static int64_t syrk_tiles(int64_t n, const float *P, int64_t i0, int64_t i1, int64_t K,
                          int64_t panels, float *C, int64_t ldc) {
    (void)panels;
    int64_t j0 = 0;
    for (; j0 + SC <= K && j0 <= i1 - 1; j0 += SC) {
        if (i1 - i0 == SR) syrk_tile6(n, P, P, i0, j0, C, ldc);
        else syrk_tile_n(n, P, P, i0, (int)(i1 - i0), j0, C, ldc);
    }
    return j0;
}

void mq_syrk_det_acc_avx2(int64_t K, int64_t n, const float *X, int64_t ldx, float *C,
                          int64_t ldc, int64_t row0, int64_t row1) {
    syrk_acc_twin(K, n, X, ldx, C, ldc, row0, row1, 32, syrk_tiles);
}

/* ---- the cross sum of two streams (mq_cross_det_acc) ------------------------------------------- */


/* rows [i0, i1) of C over the columns [0, full) of whole panels */
static void cross_tiles(int64_t n, const float *PA, const float *PB, int64_t i0, int64_t i1, int64_t full,
                        float *C, int64_t ldc) {
    for (int64_t j0 = 0; j0 < full; j0 += SC) {
        if (i1 - i0 == SR) syrk_tile6(n, PA, PB, i0, j0, C, ldc);
        else syrk_tile_n(n, PA, PB, i0, (int)(i1 - i0), j0, C, ldc);
    }
}

void mq_cross_det_acc_avx2(int64_t K, int64_t n, const float *A, int64_t lda, const float *B,
                           int64_t ldb, float *C, int64_t ldc, int64_t row0, int64_t row1) {
    cross_acc_twin(K, n, A, lda, B, ldb, C, ldc, row0, row1, 32, cross_tiles);
}

const mq_det_kernels mq_det_avx2 = {mq_gemm_det_nt_avx2, mq_syrk_det_acc_avx2, mq_cross_det_acc_avx2};
