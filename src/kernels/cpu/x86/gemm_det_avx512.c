/*
 * The AVX-512F deterministic GEMM (see kernels/gemm_det.h), called only when mq_cpu_has_avx512():
 * gemm_det_avx2.c's scheme on 16-lane registers. A panel of 32 rows of A is packed k-major
 * (Ap[k][32], rows past M zero) so one k gives two vectors of 16 rows; twelve rows of B are read
 * in place, one broadcast per row and k. The 12 x 2 accumulators hold C for 32 rows x 12
 * columns; each lane takes exactly one fma per k, in k order, from +0: the scalar chain of the
 * reference, element for element. A last panel of at most 16 rows runs one-vector tiles (half
 * the work). K is not blocked (a split sum would change the order); the panel (32 x K floats,
 * 256 KiB at K = 2048, per thread on the heap) stays in L2 while the groups of B stream past it.
 */
/* -O3 unrolls the tile loops completely, so the accumulators stay in registers. */
#if !defined(__clang__)   /* GCC only (clang, the fuzz build's compiler, has no such pragma) */
#pragma GCC optimize("O3")
#endif

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/det_common.h"
#include "kernels/gemm_det.h"

enum { MR = 32, NR = 12 };

/* C[i][r] = lane i of the accumulators of column r (v[r][h]: rows 16h..16h+15). */
static void store_tile(__m512 v[][2], int nv, int nr, float *C, int64_t ldc, int64_t m) {
    _Alignas(64) float t[NR][MR];
    for (int r = 0; r < nr; r++)
        for (int h = 0; h < nv; h++) _mm512_store_ps(t[r] + 16 * h, v[r][h]);
    det_store_cols(&t[0][0], MR, nr, C, ldc, m);
}

/* nv vectors of 16 rows x nr (<= 12) columns; the panel holds MR floats per k. */
static inline __attribute__((always_inline)) void tile(const float *ap, int64_t K, const float *B,
                                                       int64_t ldb, float *C, int64_t ldc,
                                                       int64_t m, const int nv, const int nr) {
    __m512 c[NR][2];
#pragma GCC unroll 12
    for (int r = 0; r < nr; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m512 a0 = _mm512_load_ps(ap + k * MR);
        const __m512 a1 = nv == 2 ? _mm512_load_ps(ap + k * MR + 16) : a0;
#pragma GCC unroll 12
        for (int r = 0; r < nr; r++) {
            const __m512 b = _mm512_set1_ps(B[r * ldb + k]);
            c[r][0] = _mm512_fmadd_ps(a0, b, c[r][0]);
            if (nv == 2) c[r][1] = _mm512_fmadd_ps(a1, b, c[r][1]);
        }
    }
    store_tile(c, nv, nr, C, ldc, m);
}

/* One out-of-line instantiation per (vectors, columns), so each keeps its accumulators in
 * registers. */
typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int64_t);
#define TILE_FN(NV, NC)                                                                            \
    static __attribute__((noinline)) void tile_##NV##_##NC(const float *ap, int64_t K,             \
                                                           const float *B, int64_t ldb, float *C,  \
                                                           int64_t ldc, int64_t m) {               \
        tile(ap, K, B, ldb, C, ldc, m, NV, NC);                                                    \
    }
#define TILE_FNS(NV)                                                                               \
    TILE_FN(NV, 1) TILE_FN(NV, 2) TILE_FN(NV, 3) TILE_FN(NV, 4) TILE_FN(NV, 5) TILE_FN(NV, 6)     \
    TILE_FN(NV, 7) TILE_FN(NV, 8) TILE_FN(NV, 9) TILE_FN(NV, 10) TILE_FN(NV, 11) TILE_FN(NV, 12)
TILE_FNS(1)
TILE_FNS(2)
#define TILE_ROW(NV)                                                                               \
    {tile_##NV##_1, tile_##NV##_2, tile_##NV##_3, tile_##NV##_4,  tile_##NV##_5,  tile_##NV##_6,  \
     tile_##NV##_7, tile_##NV##_8, tile_##NV##_9, tile_##NV##_10, tile_##NV##_11, tile_##NV##_12}
static const tile_fn k_tiles[2][NR] = {TILE_ROW(1), TILE_ROW(2)};

static void tiles(const float *ap, int64_t K, const float *B, int64_t ldb, int nr, float *C,
                  int64_t ldc, int64_t m) {
    k_tiles[m > 16][nr - 1](ap, K, B, ldb, C, ldc, m);
}

/* The packed panel, per thread, grown as needed (kept for the thread's next calls). */
static _Thread_local float *tl_ap;
static _Thread_local size_t tl_cap;

void mq_gemm_det_nt_avx512(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                           const float *B, int64_t ldb, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    const size_t need = (size_t)K * MR;
    if (!syrk_scratch(&tl_ap, &tl_cap, need, 64, 2)) {   /* no scratch: the reference gives the same values */
        mq_gemm_det_nt_ref(M, N, K, A, lda, B, ldb, C, ldc);
        return;
    }
    det_gemm_run(M, N, K, A, lda, B, ldb, C, ldc, MR, NR, tl_ap, tiles);
}

/* ---- the Hessian update ------------------------------------------------------------------------ */
/* gemm_det_avx2.c's scheme (its comment says why the rows of X are repacked by 16-column
 * panels, P[panel][r][16]) with tiles of 6 rows (i) by 32 columns (j): two adjacent panels, so
 * per row r of X two loads and six broadcasts feed twelve zmm accumulators, one fma per element
 * and row, in row order, continuing from C. Where 32 columns do not fit, 16-column tiles, then
 * the scalar chain, as the AVX2 kernel; tiles reach past the diagonal (elements above it, never
 * read). */
enum { SR = SYRK_SR, SC = SYRK_SC, ROWS_BLK = SYRK_ROWS };


/* rows [i0, i0 + nr) x columns [j0, j0 + 16 nv) of C; nr <= 6, nv 1 or 2. The rows' values come
 * from the panels P, the columns' from Pj (P itself for the Hessian, the other stream for the
 * cross sum). */
static inline __attribute__((always_inline)) void syrk_tile(int64_t n, const float *P, const float *Pj,
                                                            int64_t i0, int64_t j0, float *C, int64_t ldc,
                                                            const int nr, const int nv) {
    const int64_t pstride = ROWS_BLK * SC;   /* floats per panel */
    const float *vj = Pj + (j0 / SC) * pstride;
    const float *bi[SR];
    __m512 a[SR][2];
#pragma GCC unroll 6
    for (int t = 0; t < nr; t++) {
        bi[t] = P + ((i0 + t) / SC) * pstride + (i0 + t) % SC;
        const float *c = C + (i0 + t) * ldc + j0;
        a[t][0] = _mm512_loadu_ps(c);
        a[t][1] = nv == 2 ? _mm512_loadu_ps(c + 16) : a[t][0];
    }
    for (int64_t r = 0; r < n; r++) {
        const int64_t o = r * SC;
        const __m512 v0 = _mm512_load_ps(vj + o);
        const __m512 v1 = nv == 2 ? _mm512_load_ps(vj + pstride + o) : v0;
#pragma GCC unroll 6
        for (int t = 0; t < nr; t++) {
            const __m512 b = _mm512_set1_ps(bi[t][o]);
            a[t][0] = _mm512_fmadd_ps(v0, b, a[t][0]);
            if (nv == 2) a[t][1] = _mm512_fmadd_ps(v1, b, a[t][1]);
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < nr; t++) {
        float *c = C + (i0 + t) * ldc + j0;
        _mm512_storeu_ps(c, a[t][0]);
        if (nv == 2) _mm512_storeu_ps(c + 16, a[t][1]);
    }
}

static __attribute__((noinline)) void syrk_tile_6x32(int64_t n, const float *P, const float *Pj,
                                                     int64_t i0, int64_t j0, float *C, int64_t ldc) {
    syrk_tile(n, P, Pj, i0, j0, C, ldc, SR, 2);
}
static __attribute__((noinline)) void syrk_tile_6x16(int64_t n, const float *P, const float *Pj,
                                                     int64_t i0, int64_t j0, float *C, int64_t ldc) {
    syrk_tile(n, P, Pj, i0, j0, C, ldc, SR, 1);
}
/* A row group of nr < 6 rows (the last of a range): one row at a time, the same chains. */
static __attribute__((noinline)) void syrk_tile_rows(int64_t n, const float *P, const float *Pj,
                                                     int64_t i0, int nr, int64_t j0, float *C,
                                                     int64_t ldc, int nv) {
    for (int t = 0; t < nr; t++) {
        if (nv == 2) syrk_tile(n, P, Pj, i0 + t, j0, C, ldc, 1, 2);
        else syrk_tile(n, P, Pj, i0 + t, j0, C, ldc, 1, 1);
    }
}

/* Rows [i0, i1) of C over the columns [0, full) of whole panels: 32-column tiles, then a
 * 16-column one (the cross sum's tiles, cross_run). */
static void cross_tiles(int64_t n, const float *P, const float *Pj, int64_t i0, int64_t i1,
                        int64_t full, float *C, int64_t ldc) {
    const int nr = (int)(i1 - i0);
    int64_t j0 = 0;
    for (; j0 + 2 * SC <= full; j0 += 2 * SC) {
        if (nr == SR) syrk_tile_6x32(n, P, Pj, i0, j0, C, ldc);
        else syrk_tile_rows(n, P, Pj, i0, nr, j0, C, ldc, 2);
    }
    for (; j0 + SC <= full; j0 += SC) {
        if (nr == SR) syrk_tile_6x16(n, P, Pj, i0, j0, C, ldc);
        else syrk_tile_rows(n, P, Pj, i0, nr, j0, C, ldc, 1);
    }
}

/* Rows [i0, i1) of C: 32-column tiles while they lie in the row and in the packed panels, then
 * 16-column ones (det_common.h's syrk_run does the rest). */
static int64_t syrk_tiles(int64_t n, const float *P, int64_t i0, int64_t i1, int64_t K,
                          int64_t panels, float *C, int64_t ldc) {
    const int nr = (int)(i1 - i0);
    int64_t j0 = 0;
    for (; j0 + 2 * SC <= K && j0 + 2 * SC <= panels * SC && j0 <= i1 - 1; j0 += 2 * SC) {
        if (nr == SR) syrk_tile_6x32(n, P, P, i0, j0, C, ldc);
        else syrk_tile_rows(n, P, P, i0, nr, j0, C, ldc, 2);
    }
    for (; j0 + SC <= K && j0 <= i1 - 1; j0 += SC) {
        if (nr == SR) syrk_tile_6x16(n, P, P, i0, j0, C, ldc);
        else syrk_tile_rows(n, P, P, i0, nr, j0, C, ldc, 1);
    }
    return j0;
}

void mq_syrk_det_acc_avx512(int64_t K, int64_t n, const float *X, int64_t ldx, float *C,
                            int64_t ldc, int64_t row0, int64_t row1) {
    syrk_acc_twin(K, n, X, ldx, C, ldc, row0, row1, 64, syrk_tiles);
}

/* ---- the cross sum of two streams (mq_cross_det_acc) ------------------------------------------- */
/* The Hessian's tiles with the rows' values from A's panels and the columns' from B's, over every
 * column (no triangle), through the twins' shared driver (det_common.h's cross_run). */

void mq_cross_det_acc_avx512(int64_t K, int64_t n, const float *A, int64_t lda, const float *B,
                             int64_t ldb, float *C, int64_t ldc, int64_t row0, int64_t row1) {
    cross_acc_twin(K, n, A, lda, B, ldb, C, ldc, row0, row1, 64, cross_tiles);
}

const mq_det_kernels mq_det_avx512 = {mq_gemm_det_nt_avx512, mq_syrk_det_acc_avx512,
                                      mq_cross_det_acc_avx512};
