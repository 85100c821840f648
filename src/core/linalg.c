/*
 * Deterministic GEMM over the pool. OpenBLAS runs single-threaded inside each task; the output is
 * cut into a fixed grid of tiles (independent of the thread count), so every element is computed
 * the same way whatever the number of threads.
 */
#include <cblas.h>
#include <pthread.h>
#include <stdlib.h>

#include "core.h"

enum { TILE_M = MQ_GEMM_TILE_M, TILE_N = MQ_GEMM_TILE_N };

static pthread_once_t g_blas_once = PTHREAD_ONCE_INIT;
static void blas_single_thread(void) { openblas_set_num_threads(1); }

typedef struct {
    int64_t M, N, K;
    float alpha, beta;
    const float *A, *B;
    float *C;
    int64_t lda, ldb, ldc;
    int trans_b;
    int64_t tiles_n;
} gemm_job;

static void gemm_tile(void *ctx, int64_t task, int thread) {
    (void)thread;
    const gemm_job *j = ctx;
    int64_t tm = task / j->tiles_n, tn = task % j->tiles_n;
    int64_t m0 = tm * TILE_M, n0 = tn * TILE_N;
    int64_t m = j->M - m0 < TILE_M ? j->M - m0 : TILE_M;
    int64_t n = j->N - n0 < TILE_N ? j->N - n0 : TILE_N;
    const float *B = j->trans_b ? j->B + n0 * j->ldb : j->B + n0;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, j->trans_b ? CblasTrans : CblasNoTrans, (int)m, (int)n,
                (int)j->K, j->alpha, j->A + m0 * j->lda, (int)j->lda, B, (int)j->ldb, j->beta,
                j->C + m0 * j->ldc + n0, (int)j->ldc);
}

static void gemm_run(gemm_job *j) {
    pthread_once(&g_blas_once, blas_single_thread);
    if (j->M <= 0 || j->N <= 0) return;
    int64_t tiles_m = (j->M + TILE_M - 1) / TILE_M;
    j->tiles_n = (j->N + TILE_N - 1) / TILE_N;
    mq_parallel_for(tiles_m * j->tiles_n, gemm_tile, j);
}

void mq_gemm_nt(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    gemm_job j = {M, N, K, alpha, beta, A, B, C, lda, ldb, ldc, 1, 0};
    gemm_run(&j);
}

void mq_gemm_nn(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    gemm_job j = {M, N, K, alpha, beta, A, B, C, lda, ldb, ldc, 0, 0};
    gemm_run(&j);
}

double mq_measure_sgemm_gflops(int n, double min_seconds) {
    size_t nn = (size_t)n * (size_t)n;
    float *a = mq_alloc_array(nn, sizeof(float), "sgemm A");
    float *b = mq_alloc_array(nn, sizeof(float), "sgemm B");
    float *c = mq_alloc_array(nn, sizeof(float), "sgemm C");
    double best = 0;
    if (a && b && c) {
        uint32_t s = 12345;
        for (size_t i = 0; i < nn; i++) {
            s = s * 1664525u + 1013904223u;
            a[i] = (float)(s >> 8) * 0x1p-24f - 0.5f;
            b[i] = a[(i * 7) % nn];
        }
        /* The machine's reference rate: plain OpenBLAS with its own threads (as many as our pool),
         * so our kernels' ratios are measured against the library at its best, not our tiling. */
        pthread_once(&g_blas_once, blas_single_thread);
        openblas_set_num_threads(moeq_threads());
        /* The size: n, or on a slow host (an emulator: qemu takes minutes for a few 1024^3
         * products) the first of 128, 256, ... whose product takes over an eighth of the time. */
        int m = n < 128 ? n : 128;
        for (;;) {
            double t0 = mq_now();
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 1.0f, a, m, b, m, 0.0f, c, m);
            if (m >= n || mq_now() - t0 > min_seconds / 8) break;
            m = 2 * m < n ? 2 * m : n;
        }
        double t_end = mq_now() + min_seconds;
        int reps = 0;
        do {
            double t0 = mq_now();
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 1.0f, a, m, b, m, 0.0f,
                        c, m);
            double dt = mq_now() - t0;
            double g = 2.0 * m * (double)m * m / dt * 1e-9;
            if (g > best) best = g;
            reps++;
        } while (mq_now() < t_end || reps < 3);
        openblas_set_num_threads(1);
    }
    mq_free(a);
    mq_free(b);
    mq_free(c);
    return best;
}

/* mq_measure_core_gflops: one task per thread, each until the common deadline; a thread that took
 * a second task after the deadline adds nothing. */
enum { CORE_N = 256 };

typedef struct {
    double t_end;
    double *rate;   /* [tasks] GFLOP/s of each task */
} core_job;

static void core_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    core_job *j = ctx;
    const size_t nn = (size_t)CORE_N * CORE_N;
    float *a = mq_alloc_array(3 * nn, sizeof(float), "sgemm buffers");
    j->rate[task] = 0;
    if (!a) return;
    for (size_t i = 0; i < 3 * nn; i++) a[i] = (float)(i % 61) * 0x1p-6f - 0.4f;   /* first touch here */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, CORE_N, CORE_N, CORE_N, 1.0f, a, CORE_N,
                a + nn, CORE_N, 0.0f, a + 2 * nn, CORE_N);   /* warm */
    const double t0 = mq_now();
    int64_t reps = 0;
    while (mq_now() < j->t_end) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, CORE_N, CORE_N, CORE_N, 1.0f, a, CORE_N,
                    a + nn, CORE_N, 0.0f, a + 2 * nn, CORE_N);
        reps++;
    }
    const double dt = mq_now() - t0;
    if (reps > 0 && dt > 0) j->rate[task] = 2.0 * CORE_N * CORE_N * (double)CORE_N * (double)reps / dt * 1e-9;
    mq_free(a);
}

double mq_measure_core_gflops(double seconds) {
    pthread_once(&g_blas_once, blas_single_thread);
    const int n = mq_pool_size();
    double *rate = calloc((size_t)n, sizeof *rate);
    if (!rate) return 0;
    core_job j = {mq_now() + seconds, rate};
    mq_parallel_for(n, core_task, &j);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += rate[i];
    free(rate);
    return sum;
}
