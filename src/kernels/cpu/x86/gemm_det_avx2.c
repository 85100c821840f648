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
#include <string.h>

#include "kernels/gemm_det.h"

enum { MR = 16, NR = 6 };

static void store_tile(__m256 v[][2], int nr, float *C, int64_t ldc, int64_t m) {
    float t[NR][MR];
    for (int r = 0; r < nr; r++) {
        _mm256_storeu_ps(t[r], v[r][0]);
        _mm256_storeu_ps(t[r] + 8, v[r][1]);
    }
    for (int64_t i = 0; i < m; i++)
        for (int r = 0; r < nr; r++) C[i * ldc + r] = t[r][i];
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

/* Ap[k][i] = A[i][k] for the panel's rows (zero past m). */
static void pack(const float *A, int64_t lda, int64_t m, int64_t K, float *ap) {
    if (m < MR) memset(ap, 0, sizeof(float) * (size_t)(K * MR));
    for (int64_t i = 0; i < m; i++) {
        const float *a = A + i * lda;
        for (int64_t k = 0; k < K; k++) ap[k * MR + i] = a[k];
    }
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
    for (int64_t i0 = 0; i0 < M; i0 += MR) {
        int64_t m = M - i0 < MR ? M - i0 : MR;
        pack(A + i0 * lda, lda, m, K, ap);
        for (int64_t j0 = 0; j0 < N; j0 += NR) {
            int nr = (int)(N - j0 < NR ? N - j0 : NR);
            if (nr == NR) tile6(ap, K, B + j0 * ldb, ldb, C + i0 * ldc + j0, ldc, m);
            else tile_n(ap, K, B + j0 * ldb, ldb, nr, C + i0 * ldc + j0, ldc, m);
        }
    }
}
