/* Dispatch of the deterministic GEMM (see gemm_det.h) and its pool split over column tiles. */
#include "kernels/gemm_det.h"

void mq_gemm_det_nt(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                    int64_t ldb, float *C, int64_t ldc) {
#if defined(__x86_64__) || defined(__i386__)
    if (mq_cpu_has_avx2_fma() && !mq_force_ref()) {
        mq_gemm_det_nt_avx2(M, N, K, A, lda, B, ldb, C, ldc);
        return;
    }
#endif
    mq_gemm_det_nt_ref(M, N, K, A, lda, B, ldb, C, ldc);
}

enum { TILE_N = 96 };

typedef struct {
    int64_t M, N, K, lda, ldb, ldc;
    const float *A, *B;
    float *C;
} det_job;

static void det_tile(void *ctx, int64_t t, int thread) {
    (void)thread;
    const det_job *j = ctx;
    int64_t n0 = t * TILE_N, n = j->N - n0 < TILE_N ? j->N - n0 : TILE_N;
    mq_gemm_det_nt(j->M, n, j->K, j->A, j->lda, j->B + n0 * j->ldb, j->ldb, j->C + n0, j->ldc);
}

void mq_gemm_det_nt_pool(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *B, int64_t ldb, float *C, int64_t ldc) {
    det_job j = {M, N, K, lda, ldb, ldc, A, B, C};
    mq_parallel_for((N + TILE_N - 1) / TILE_N, det_tile, &j);
}
