/* The deterministic GEMM and Hessian sums through the kernel set of now (mq_det(), kernels.c),
 * and their pool splits over tiles of C. */
#include "kernels/gemm_det.h"

void mq_gemm_det_nt(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                    int64_t ldb, float *C, int64_t ldc) {
    mq_det()->gemm_nt(M, N, K, A, lda, B, ldb, C, ldc);
}

/* Tiles of TILE_M rows by TILE_N columns: any split gives these values (every output is its own
 * chain), so rows are cut too: a 512-token sample through a 1024-wide expert was 11 column tiles,
 * 11 tasks for 16 threads (the block-Hessian fallback's products at 0.54 of 16x, simulated). */
enum { TILE_M = 128, TILE_N = 96 };

typedef struct {
    int64_t M, N, K, lda, ldb, ldc, tiles_n;
    const float *A, *B;
    float *C;
} det_job;

static void det_tile(void *ctx, int64_t t, int thread) {
    (void)thread;
    const det_job *j = ctx;
    const int64_t m0 = t / j->tiles_n * TILE_M, n0 = t % j->tiles_n * TILE_N;
    const int64_t m = j->M - m0 < TILE_M ? j->M - m0 : TILE_M, n = j->N - n0 < TILE_N ? j->N - n0 : TILE_N;
    mq_gemm_det_nt(m, n, j->K, j->A + m0 * j->lda, j->lda, j->B + n0 * j->ldb, j->ldb, j->C + m0 * j->ldc + n0,
                   j->ldc);
}

void mq_gemm_det_nt_pool(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *B, int64_t ldb, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    det_job j = {M, N, K, lda, ldb, ldc, (N + TILE_N - 1) / TILE_N, A, B, C};
    mq_parallel_for((M + TILE_M - 1) / TILE_M * j.tiles_n, det_tile, &j);
}

void mq_syrk_det_acc(int64_t K, int64_t n, const float *X, int64_t ldx, float *C, int64_t ldc,
                     int64_t i0, int64_t i1) {
    mq_det()->syrk_acc(K, n, X, ldx, C, ldc, i0, i1);
}

/* Blocks of rows of C to the pool, the widest (last rows of the triangle) first. */
enum { SYRK_ROWS = 48 };

typedef struct {
    int64_t K, n, ldx, ldc, n_blocks;
    const float *X;
    float *C;
} syrk_job;

static void syrk_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    const syrk_job *j = ctx;
    int64_t b = j->n_blocks - 1 - t, i0 = b * SYRK_ROWS;
    int64_t i1 = i0 + SYRK_ROWS < j->K ? i0 + SYRK_ROWS : j->K;
    mq_syrk_det_acc(j->K, j->n, j->X, j->ldx, j->C, j->ldc, i0, i1);
}

void mq_syrk_det_acc_pool(int64_t K, int64_t n, const float *X, int64_t ldx, float *C,
                          int64_t ldc) {
    if (K <= 0 || n <= 0) return;
    syrk_job j = {K, n, ldx, ldc, (K + SYRK_ROWS - 1) / SYRK_ROWS, X, C};
    mq_parallel_for(j.n_blocks, syrk_task, &j);
}

typedef struct {
    int64_t K, n, ldx, ldc, i0, i1;
    const float *X;
    float *C;
} syrk_rows_job;

static void syrk_rows_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    const syrk_rows_job *j = ctx;
    const int64_t nb = (j->i1 - j->i0 + SYRK_ROWS - 1) / SYRK_ROWS;
    int64_t a = j->i0 + (nb - 1 - t) * SYRK_ROWS;   /* the widest rows first */
    int64_t b = a + SYRK_ROWS < j->i1 ? a + SYRK_ROWS : j->i1;
    mq_syrk_det_acc(j->K, j->n, j->X, j->ldx, j->C, j->ldc, a, b);
}

void mq_syrk_det_acc_pool_rows(int64_t K, int64_t n, const float *X, int64_t ldx, float *C,
                               int64_t ldc, int64_t i0, int64_t i1) {
    if (K <= 0 || n <= 0 || i1 <= i0) return;
    syrk_rows_job j = {K, n, ldx, ldc, i0, i1, X, C};
    mq_parallel_for((i1 - i0 + SYRK_ROWS - 1) / SYRK_ROWS, syrk_rows_task, &j);
}

void mq_cross_det_acc(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                      float *C, int64_t ldc, int64_t i0, int64_t i1) {
    mq_det()->cross_acc(K, n, A, lda, B, ldb, C, ldc, i0, i1);
}

typedef struct {
    int64_t K, n, lda, ldb, ldc, i0, i1;
    const float *A, *B;
    float *C;
} cross_job;

static void cross_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    const cross_job *j = ctx;
    const int64_t i0 = j->i0 + t * SYRK_ROWS, i1 = i0 + SYRK_ROWS < j->i1 ? i0 + SYRK_ROWS : j->i1;
    mq_cross_det_acc(j->K, j->n, j->A, j->lda, j->B, j->ldb, j->C, j->ldc, i0, i1);
}

void mq_cross_det_acc_pool_rows(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                                float *C, int64_t ldc, int64_t i0, int64_t i1) {
    if (K <= 0 || n <= 0 || i1 <= i0) return;
    cross_job j = {K, n, lda, ldb, ldc, i0, i1, A, B, C};
    mq_parallel_for((i1 - i0 + SYRK_ROWS - 1) / SYRK_ROWS, cross_task, &j);
}

void mq_cross_det_acc_pool(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                           float *C, int64_t ldc) {
    mq_cross_det_acc_pool_rows(K, n, A, lda, B, ldb, C, ldc, 0, K);
}
