/* The scalar twin of the deterministic GEMM (see kernels/gemm_det.h): the definition itself. */
#include <math.h>

#include "kernels/gemm_det.h"

void mq_gemm_det_nt_ref(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                        const float *B, int64_t ldb, float *C, int64_t ldc) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            const float *a = A + i * lda, *b = B + j * ldb;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(a[k], b[k], acc);
            C[i * ldc + j] = acc;
        }
}

void mq_syrk_det_acc_ref(int64_t K, int64_t n, const float *X, int64_t ldx, float *C, int64_t ldc,
                         int64_t i0, int64_t i1) {
    (void)K;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = 0; j <= i; j++) {
            float acc = C[i * ldc + j];
            for (int64_t r = 0; r < n; r++) acc = fmaf(X[r * ldx + i], X[r * ldx + j], acc);
            C[i * ldc + j] = acc;
        }
}

void mq_cross_det_acc_ref(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                          float *C, int64_t ldc, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = 0; j < K; j++) {
            float acc = C[i * ldc + j];
            for (int64_t r = 0; r < n; r++) acc = fmaf(A[r * lda + i], B[r * ldb + j], acc);
            C[i * ldc + j] = acc;
        }
}

const mq_det_kernels mq_det_ref = {mq_gemm_det_nt_ref, mq_syrk_det_acc_ref, mq_cross_det_acc_ref};
