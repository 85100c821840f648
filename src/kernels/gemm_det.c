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

void mq_cross_det_acc(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                      float *C, int64_t ldc, int64_t i0, int64_t i1) {
    mq_det()->cross_acc(K, n, A, lda, B, ldb, C, ldc, i0, i1);
}

/* Blocks of SYRK_ROWS rows [i0, i1) of C to the pool: the Hessian update's widest (the
 * triangle's last rows) first, the cross sum's in order. */
enum { SYRK_ROWS = 48 };

typedef struct {
    int64_t K, n, lda, ldb, ldc, i0, i1;
    const float *A, *B;   /* the Hessian update reads A alone */
    float *C;
    int cross;
} rows_job;

static void rows_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    const rows_job *j = ctx;
    const int64_t nb = (j->i1 - j->i0 + SYRK_ROWS - 1) / SYRK_ROWS;
    const int64_t a = j->i0 + (j->cross ? t : nb - 1 - t) * SYRK_ROWS;
    const int64_t b = a + SYRK_ROWS < j->i1 ? a + SYRK_ROWS : j->i1;
    if (j->cross) mq_cross_det_acc(j->K, j->n, j->A, j->lda, j->B, j->ldb, j->C, j->ldc, a, b);
    else mq_syrk_det_acc(j->K, j->n, j->A, j->lda, j->C, j->ldc, a, b);
}

static void rows_pool(rows_job *j) {
    if (j->K <= 0 || j->n <= 0 || j->i1 <= j->i0) return;
    mq_parallel_for((j->i1 - j->i0 + SYRK_ROWS - 1) / SYRK_ROWS, rows_task, j);
}

void mq_syrk_det_acc_pool_rows(int64_t K, int64_t n, const float *X, int64_t ldx, float *C,
                               int64_t ldc, int64_t i0, int64_t i1) {
    rows_job j = {K, n, ldx, 0, ldc, i0, i1, X, NULL, C, 0};
    rows_pool(&j);
}

void mq_syrk_det_acc_pool(int64_t K, int64_t n, const float *X, int64_t ldx, float *C,
                          int64_t ldc) {
    mq_syrk_det_acc_pool_rows(K, n, X, ldx, C, ldc, 0, K);
}

void mq_cross_det_acc_pool_rows(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                                float *C, int64_t ldc, int64_t i0, int64_t i1) {
    rows_job j = {K, n, lda, ldb, ldc, i0, i1, A, B, C, 1};
    rows_pool(&j);
}

void mq_cross_det_acc_pool(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                           float *C, int64_t ldc) {
    mq_cross_det_acc_pool_rows(K, n, A, lda, B, ldb, C, ldc, 0, K);
}
