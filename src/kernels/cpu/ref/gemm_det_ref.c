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
