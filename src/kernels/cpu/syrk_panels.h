/*
 * The deterministic Hessian update's data layout, shared by its SIMD kernels
 * (x86/gemm_det_avx2.c, x86/gemm_det_avx512.c, arm/gemm_det_neon.c): X goes in blocks of
 * SYRK_ROWS rows, repacked by SYRK_SC-column panels (P[panel][r][SYRK_SC], zero past K), which
 * the kernels' tiles of SYRK_SR rows read sequentially; the elements the tiles leave are the
 * scalar chain, one fmaf per row in row order from C, as the reference computes every element.
 * What differs between the kernels is only their tiles.
 */
#ifndef MOEQ_KERNELS_CPU_SYRK_PANELS_H
#define MOEQ_KERNELS_CPU_SYRK_PANELS_H

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { SYRK_SR = 6, SYRK_SC = 16, SYRK_ROWS = 64 };

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

#endif
