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

static void store_tile(__m256 v[][2], int nr, float *C, int64_t ldc, int64_t m) {
    float t[NR][MR];
    for (int r = 0; r < nr; r++) {
        _mm256_storeu_ps(t[r], v[r][0]);
        _mm256_storeu_ps(t[r] + 8, v[r][1]);
    }
    det_store_cols(&t[0][0], MR, nr, C, ldc, m);
}

/* The 16 x 6 tile: twelve accumulators in registers. */
static void tile6(const float *ap, int64_t K, const float *B, int64_t ldb, float *C, int64_t ldc,
                  int64_t m) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const float *b0 = B, *b1 = B + ldb, *b2 = B + 2 * ldb, *b3 = B + 3 * ldb, *b4 = B + 4 * ldb,
                *b5 = B + 5 * ldb;
    for (int64_t k = 0; k < K; k++) {
        const __m256 a0 = _mm256_load_ps(ap + k * MR), a1 = _mm256_load_ps(ap + k * MR + 8);
        __m256 b = _mm256_broadcast_ss(b0 + k);
        c00 = _mm256_fmadd_ps(a0, b, c00);
        c01 = _mm256_fmadd_ps(a1, b, c01);
        b = _mm256_broadcast_ss(b1 + k);
        c10 = _mm256_fmadd_ps(a0, b, c10);
        c11 = _mm256_fmadd_ps(a1, b, c11);
        b = _mm256_broadcast_ss(b2 + k);
        c20 = _mm256_fmadd_ps(a0, b, c20);
        c21 = _mm256_fmadd_ps(a1, b, c21);
        b = _mm256_broadcast_ss(b3 + k);
        c30 = _mm256_fmadd_ps(a0, b, c30);
        c31 = _mm256_fmadd_ps(a1, b, c31);
        b = _mm256_broadcast_ss(b4 + k);
        c40 = _mm256_fmadd_ps(a0, b, c40);
        c41 = _mm256_fmadd_ps(a1, b, c41);
        b = _mm256_broadcast_ss(b5 + k);
        c50 = _mm256_fmadd_ps(a0, b, c50);
        c51 = _mm256_fmadd_ps(a1, b, c51);
    }
    __m256 v[NR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    store_tile(v, NR, C, ldc, m);
}

/* A tile of nr < 6 columns (the last group): the same chains, fewer of them. */
static void tile_n(const float *ap, int64_t K, const float *B, int64_t ldb, int nr, float *C,
                   int64_t ldc, int64_t m) {
    __m256 v[NR][2];
    for (int r = 0; r < nr; r++) {
        __m256 c0 = _mm256_setzero_ps(), c1 = c0;
        const float *b = B + r * ldb;
        for (int64_t k = 0; k < K; k++) {
            __m256 bk = _mm256_broadcast_ss(b + k);
            c0 = _mm256_fmadd_ps(_mm256_load_ps(ap + k * MR), bk, c0);
            c1 = _mm256_fmadd_ps(_mm256_load_ps(ap + k * MR + 8), bk, c1);
        }
        v[r][0] = c0;
        v[r][1] = c1;
    }
    store_tile(v, nr, C, ldc, m);
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


/* Pi: the panels the six broadcasts (rows i) come from, Pj: those of the 16 columns j (the same
 * panels for the Hessian, the two streams' inputs for the cross sum). */
static void syrk_tile6(int64_t n, const float *Pi, const float *Pj, int64_t i0, int64_t j0, float *C, int64_t ldc) {
    const float *P = Pi;
    float *c0 = C + i0 * ldc + j0, *c1 = c0 + ldc, *c2 = c1 + ldc, *c3 = c2 + ldc, *c4 = c3 + ldc,
          *c5 = c4 + ldc;
    const int64_t pstride = ROWS_BLK * SC;   /* floats per panel */
    const float *vj = Pj + (j0 / SC) * pstride;
    const float *b0 = P + ((i0 + 0) / SC) * pstride + (i0 + 0) % SC,
                *b1 = P + ((i0 + 1) / SC) * pstride + (i0 + 1) % SC,
                *b2 = P + ((i0 + 2) / SC) * pstride + (i0 + 2) % SC,
                *b3 = P + ((i0 + 3) / SC) * pstride + (i0 + 3) % SC,
                *b4 = P + ((i0 + 4) / SC) * pstride + (i0 + 4) % SC,
                *b5 = P + ((i0 + 5) / SC) * pstride + (i0 + 5) % SC;
    __m256 a00 = _mm256_loadu_ps(c0), a01 = _mm256_loadu_ps(c0 + 8);
    __m256 a10 = _mm256_loadu_ps(c1), a11 = _mm256_loadu_ps(c1 + 8);
    __m256 a20 = _mm256_loadu_ps(c2), a21 = _mm256_loadu_ps(c2 + 8);
    __m256 a30 = _mm256_loadu_ps(c3), a31 = _mm256_loadu_ps(c3 + 8);
    __m256 a40 = _mm256_loadu_ps(c4), a41 = _mm256_loadu_ps(c4 + 8);
    __m256 a50 = _mm256_loadu_ps(c5), a51 = _mm256_loadu_ps(c5 + 8);
    for (int64_t r = 0; r < n; r++) {
        const int64_t o = r * SC;
        const __m256 v0 = _mm256_load_ps(vj + o), v1 = _mm256_load_ps(vj + o + 8);
        __m256 b = _mm256_broadcast_ss(b0 + o);
        a00 = _mm256_fmadd_ps(v0, b, a00);
        a01 = _mm256_fmadd_ps(v1, b, a01);
        b = _mm256_broadcast_ss(b1 + o);
        a10 = _mm256_fmadd_ps(v0, b, a10);
        a11 = _mm256_fmadd_ps(v1, b, a11);
        b = _mm256_broadcast_ss(b2 + o);
        a20 = _mm256_fmadd_ps(v0, b, a20);
        a21 = _mm256_fmadd_ps(v1, b, a21);
        b = _mm256_broadcast_ss(b3 + o);
        a30 = _mm256_fmadd_ps(v0, b, a30);
        a31 = _mm256_fmadd_ps(v1, b, a31);
        b = _mm256_broadcast_ss(b4 + o);
        a40 = _mm256_fmadd_ps(v0, b, a40);
        a41 = _mm256_fmadd_ps(v1, b, a41);
        b = _mm256_broadcast_ss(b5 + o);
        a50 = _mm256_fmadd_ps(v0, b, a50);
        a51 = _mm256_fmadd_ps(v1, b, a51);
    }
    _mm256_storeu_ps(c0, a00), _mm256_storeu_ps(c0 + 8, a01);
    _mm256_storeu_ps(c1, a10), _mm256_storeu_ps(c1 + 8, a11);
    _mm256_storeu_ps(c2, a20), _mm256_storeu_ps(c2 + 8, a21);
    _mm256_storeu_ps(c3, a30), _mm256_storeu_ps(c3 + 8, a31);
    _mm256_storeu_ps(c4, a40), _mm256_storeu_ps(c4 + 8, a41);
    _mm256_storeu_ps(c5, a50), _mm256_storeu_ps(c5 + 8, a51);
}

/* A row group of nr < 6 rows (the last of a range) over one full panel: the same chains. */
static void syrk_tile_n(int64_t n, const float *P, const float *Pj, int64_t i0, int nr, int64_t j0, float *C,
                        int64_t ldc) {
    const int64_t pstride = ROWS_BLK * SC;
    const float *vj = Pj + (j0 / SC) * pstride;
    for (int t = 0; t < nr; t++) {
        float *c = C + (i0 + t) * ldc + j0;
        const float *bi = P + ((i0 + t) / SC) * pstride + (i0 + t) % SC;
        __m256 a0 = _mm256_loadu_ps(c), a1 = _mm256_loadu_ps(c + 8);
        for (int64_t r = 0; r < n; r++) {
            __m256 b = _mm256_broadcast_ss(bi + r * SC);
            a0 = _mm256_fmadd_ps(_mm256_load_ps(vj + r * SC), b, a0);
            a1 = _mm256_fmadd_ps(_mm256_load_ps(vj + r * SC + 8), b, a1);
        }
        _mm256_storeu_ps(c, a0);
        _mm256_storeu_ps(c + 8, a1);
    }
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
