/*
 * What the deterministic sums' SIMD twins (x86/gemm_det_avx2.c, x86/gemm_det_avx512.c,
 * arm/gemm_det_neon.c) share besides their tiles, free of any instruction set: the GEMM's packed
 * panel of A, the copy of a tile's lanes into C and the walk over C's tiles; the Hessian update's
 * and the cross sum's data layout, their walks and their scalar edges.
 *
 * GEMM: a panel of `mr` rows of A packed k-major (Ap[k][mr], rows past M zero), the tiles of
 * up to `nr` columns of C read B in place; every element of C is the reference's chain.
 *
 * Hessian update: X goes in blocks of
 * SYRK_ROWS rows, repacked by SYRK_SC-column panels (P[panel][r][SYRK_SC], zero past K), which
 * the kernels' tiles of SYRK_SR rows read sequentially; the elements the tiles leave are the
 * scalar chain, one fmaf per row in row order from C, as the reference computes every element.
 * What differs between the kernels is only their tiles.
 */
#ifndef MOEQ_KERNELS_CPU_DET_COMMON_H
#define MOEQ_KERNELS_CPU_DET_COMMON_H

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/gemm_det.h"

enum { SYRK_SR = 6, SYRK_SC = 16, SYRK_ROWS = 64 };

/* ---- the GEMM ---------------------------------------------------------------------------------- */
/* Ap[k][i] = A[i][k] for the panel's m rows (zero past m, up to mr). */
static inline void det_pack_panel(const float *A, int64_t lda, int64_t m, int64_t K, int mr, float *ap) {
    if (m < mr) memset(ap, 0, sizeof(float) * (size_t)(K * mr));
    for (int64_t i = 0; i < m; i++) {
        const float *a = A + i * lda;
        for (int64_t k = 0; k < K; k++) ap[k * mr + i] = a[k];
    }
}

/* C[i][r] = t[r * mr + i] for i < m, r < nr: a tile's lanes (column r of C in t's row r) into C. */
static inline void det_store_cols(const float *t, int mr, int nr, float *C, int64_t ldc, int64_t m) {
    for (int64_t i = 0; i < m; i++)
        for (int r = 0; r < nr; r++) C[i * ldc + r] = t[r * mr + i];
}

/* A twin's tile: m (<= mr) rows of the packed panel ap by nr (<= its widest) rows of B. */
typedef void (*det_tile_fn)(const float *ap, int64_t K, const float *B, int64_t ldb, int nr,
                            float *C, int64_t ldc, int64_t m);
/* C = A B^T by panels of mr rows of A (packed into ap, K * mr floats) and tiles of up to nr_max
 * columns. */
static inline void det_gemm_run(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                                const float *B, int64_t ldb, float *C, int64_t ldc, int mr,
                                int nr_max, float *ap, det_tile_fn tile) {
    for (int64_t i0 = 0; i0 < M; i0 += mr) {
        const int64_t m = M - i0 < mr ? M - i0 : mr;
        det_pack_panel(A + i0 * lda, lda, m, K, mr, ap);
        for (int64_t j0 = 0; j0 < N; j0 += nr_max) {
            const int nr = (int)(N - j0 < nr_max ? N - j0 : nr_max);
            tile(ap, K, B + j0 * ldb, ldb, nr, C + i0 * ldc + j0, ldc, m);
        }
    }
}

/* ---- the Hessian update and the cross sum ------------------------------------------------------ */

/* A thread's scratch goes with the thread: the pool's workers end when moeq_set_threads restarts
 * it, and their buffers stayed behind (LeakSanitizer found them). Each buffer of the including
 * file has a slot, a key whose value is the buffer and whose destructor frees it at thread exit. */
enum { SYRK_SLOTS = 3 };
static pthread_key_t syrk_keys[SYRK_SLOTS];
static bool syrk_keys_ok;
static pthread_once_t syrk_keys_once = PTHREAD_ONCE_INIT;

static inline void syrk_keys_make(void) {
    bool ok = true;
    for (int i = 0; i < SYRK_SLOTS && ok; i++) ok = pthread_key_create(&syrk_keys[i], free) == 0;
    syrk_keys_ok = ok;
}

/* The calling thread's scratch (slot) of at least `floats` floats, kept between calls (NULL when
 * it cannot be had: the caller falls back to the reference, which gives the same values). */
static inline float *syrk_scratch(float **buf, size_t *cap, size_t floats, size_t align, int slot) {
    if (floats > *cap) {
        pthread_once(&syrk_keys_once, syrk_keys_make);
        free(*buf);
        *buf = aligned_alloc(align, (floats * sizeof(float) + align - 1) / align * align);
        *cap = *buf ? floats : 0;
        if (syrk_keys_ok) pthread_setspecific(syrk_keys[slot], *buf);
    }
    return *buf;
}

/* Rows [r0, r0 + rb) of X [n, K] (row stride ldx) into `panels` panels of P. */
static inline void syrk_pack(const float *X, int64_t ldx, int64_t K, int64_t r0, int64_t rb,
                             int64_t panels, float *P) {
    for (int64_t p = 0; p < panels; p++) {
        float *dst = P + p * SYRK_ROWS * SYRK_SC;
        const int64_t c0 = p * SYRK_SC, w = K - c0 < SYRK_SC ? K - c0 : SYRK_SC;
        for (int64_t r = 0; r < rb; r++) {
            memcpy(dst + r * SYRK_SC, X + (r0 + r) * ldx + c0, sizeof(float) * (size_t)w);
            if (w < SYRK_SC) memset(dst + r * SYRK_SC + w, 0, sizeof(float) * (size_t)(SYRK_SC - w));
        }
    }
}

/* C[i][j] for i in [i0, i1), j in [j0, min(j1, i + 1)): the scalar chain over the n packed rows. */
static inline void syrk_edge(int64_t n, const float *P, int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                             float *C, int64_t ldc) {
    const int64_t pstride = SYRK_ROWS * SYRK_SC;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1 && j <= i; j++) {
            const float *pi = P + (i / SYRK_SC) * pstride + i % SYRK_SC;
            const float *pj = P + (j / SYRK_SC) * pstride + j % SYRK_SC;
            float acc = C[i * ldc + j];
            for (int64_t r = 0; r < n; r++) acc = fmaf(pi[r * SYRK_SC], pj[r * SYRK_SC], acc);
            C[i * ldc + j] = acc;
        }
}

/* The cross sum's elements outside whole tiles: C[i][j] for i in [i0, i1), j in [j0, j1), the
 * scalar chain over the n packed rows of A (rows i, panels PA) and B (columns j, panels PB). */
static inline void cross_edge(int64_t n, const float *PA, const float *PB, int64_t i0, int64_t i1, int64_t j0,
                              int64_t j1, float *C, int64_t ldc) {
    const int64_t pstride = SYRK_ROWS * SYRK_SC;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1; j++) {
            const float *pi = PA + (i / SYRK_SC) * pstride + i % SYRK_SC;
            const float *pj = PB + (j / SYRK_SC) * pstride + j % SYRK_SC;
            float acc = C[i * ldc + j];
            for (int64_t r = 0; r < n; r++) acc = fmaf(pi[r * SYRK_SC], pj[r * SYRK_SC], acc);
            C[i * ldc + j] = acc;
        }
}

/* A twin's whole-panel tiles of the Hessian update for the rows [i0, i1) of C (a group of at most
 * SYRK_SR), the panels of P packed up to `panels`; returns the column where they stop (a multiple
 * of SYRK_SC): the scalar chains do the rest up to the diagonal. */
typedef int64_t (*syrk_tiles_fn)(int64_t n, const float *P, int64_t i0, int64_t i1, int64_t K,
                                 int64_t panels, float *C, int64_t ldc);
/* The Hessian update's driver, shared by the SIMD twins: X's rows in blocks of SYRK_ROWS packed
 * into P (the panels of the columns below row1), then for every group of SYRK_SR rows of C the
 * twin's tiles and the scalar chains past them. */
static inline void syrk_run(int64_t K, int64_t n, const float *X, int64_t ldx, float *C, int64_t ldc,
                            int64_t row0, int64_t row1, float *P, syrk_tiles_fn tiles) {
    const int64_t panels = (row1 + SYRK_SC - 1) / SYRK_SC;   /* columns < row1 are all the rows need */
    for (int64_t r0 = 0; r0 < n; r0 += SYRK_ROWS) {
        const int64_t rb = n - r0 < SYRK_ROWS ? n - r0 : SYRK_ROWS;
        syrk_pack(X, ldx, K, r0, rb, panels, P);
        for (int64_t i0 = row0; i0 < row1; i0 += SYRK_SR) {
            const int64_t i1 = i0 + SYRK_SR < row1 ? i0 + SYRK_SR : row1;
            const int64_t j0 = tiles(rb, P, i0, i1, K, panels, C, ldc);
            syrk_edge(rb, P, i0, i1, j0, i1, C, ldc);
        }
    }
}

/* The cross sum's driver, shared by the SIMD twins: X's rows in blocks of SYRK_ROWS, A's panels
 * (the rows of C, up to row1) and B's (every column) packed into PA and PB, then for every group
 * of SYRK_SR rows of C the twin's whole-panel tiles (`tiles`: columns [0, full)) and the scalar
 * chains of the columns past the last whole panel. */
typedef void (*cross_tiles_fn)(int64_t n, const float *PA, const float *PB, int64_t i0, int64_t i1,
                               int64_t full, float *C, int64_t ldc);
static inline void cross_run(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                             float *C, int64_t ldc, int64_t row0, int64_t row1, float *PA, float *PB,
                             cross_tiles_fn tiles) {
    const int64_t pa = (row1 + SYRK_SC - 1) / SYRK_SC, pb = (K + SYRK_SC - 1) / SYRK_SC;
    const int64_t full = K / SYRK_SC * SYRK_SC;
    for (int64_t r0 = 0; r0 < n; r0 += SYRK_ROWS) {
        const int64_t rb = n - r0 < SYRK_ROWS ? n - r0 : SYRK_ROWS;
        syrk_pack(A, lda, K, r0, rb, pa, PA);
        syrk_pack(B, ldb, K, r0, rb, pb, PB);
        for (int64_t i0 = row0; i0 < row1; i0 += SYRK_SR) {
            const int64_t i1 = i0 + SYRK_SR < row1 ? i0 + SYRK_SR : row1;
            tiles(rb, PA, PB, i0, i1, full, C, ldc);
            cross_edge(rb, PA, PB, i0, i1, full, K, C, ldc);
        }
    }
}

/* The including twin's packed streams, per thread, grown as needed (the Hessian's panels, the cross
 * sum's rows of A in the first and of B in the second; scratch slots 0 and 1). */
static _Thread_local float *det_pack_a __attribute__((unused)), *det_pack_b __attribute__((unused));
static _Thread_local size_t det_cap_a __attribute__((unused)), det_cap_b __attribute__((unused));

/* A twin's mq_syrk_det_acc: its tiles over the rows [row0, row1) of C, the panels aligned to
 * `align` bytes; without scratch the reference (the same values). */
static inline void syrk_acc_twin(int64_t K, int64_t n, const float *X, int64_t ldx, float *C,
                                 int64_t ldc, int64_t row0, int64_t row1, size_t align,
                                 syrk_tiles_fn tiles) {
    if (K <= 0 || n <= 0 || row0 >= row1) return;
    const int64_t panels = (row1 + SYRK_SC - 1) / SYRK_SC;
    float *P = syrk_scratch(&det_pack_a, &det_cap_a, (size_t)panels * SYRK_ROWS * SYRK_SC, align, 0);
    if (!P) {
        mq_syrk_det_acc_ref(K, n, X, ldx, C, ldc, row0, row1);
        return;
    }
    syrk_run(K, n, X, ldx, C, ldc, row0, row1, P, tiles);
}

/* A twin's mq_cross_det_acc, likewise. */
static inline void cross_acc_twin(int64_t K, int64_t n, const float *A, int64_t lda, const float *B,
                                  int64_t ldb, float *C, int64_t ldc, int64_t row0, int64_t row1,
                                  size_t align, cross_tiles_fn tiles) {
    if (K <= 0 || n <= 0 || row0 >= row1) return;
    const int64_t pa = (row1 + SYRK_SC - 1) / SYRK_SC, pb = (K + SYRK_SC - 1) / SYRK_SC;
    float *PA = syrk_scratch(&det_pack_a, &det_cap_a, (size_t)pa * SYRK_ROWS * SYRK_SC, align, 0);
    float *PB = PA ? syrk_scratch(&det_pack_b, &det_cap_b, (size_t)pb * SYRK_ROWS * SYRK_SC, align, 1)
                   : NULL;
    if (!PB) {
        mq_cross_det_acc_ref(K, n, A, lda, B, ldb, C, ldc, row0, row1);
        return;
    }
    cross_run(K, n, A, lda, B, ldb, C, ldc, row0, row1, PA, PB, tiles);
}

#endif
