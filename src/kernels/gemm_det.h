/*
 * A GEMM whose every output does not depend on the shape of the call: C[i][j] = the fmaf chain
 *     acc = +0;  for k = 0 .. K-1:  acc = fmaf(A[i][k], B[j][k], acc)
 * (C = A B^T, A [M, K] activations, B [N, K] weights, both row-major as every Linear stores
 * them). OpenBLAS's sgemm gives a row different bits depending on M and on where the row sits in
 * the call, so grouping the same rows differently (the tokens of one sample, or of several)
 * would change results; with this kernel a routed expert gives the same outputs whether its rows
 * come one sample at a time (the model's forward) or many samples together (the pipeline's
 * calibration, which batches rows across samples for GEMMs of a useful size).
 *
 * Twins: the scalar reference (src/kernels/cpu/ref/gemm_det_ref.c) is the chain above written
 * out; the AVX2+FMA kernel (src/kernels/cpu/x86/gemm_det_avx2.c) runs 16 rows of A by 6 rows of
 * B at a time, one fma per element per k in k order, so the two agree bit for bit
 * (tests/test_gemm_det.c); so does the NEON kernel (src/kernels/cpu/arm/gemm_det_neon.c, every
 * Arm64 CPU), with the same blocking. Single-threaded: callers split the work (pool tasks over experts, or
 * mq_gemm_det_nt_pool over fixed column tiles).
 */
#ifndef MOEQ_KERNELS_GEMM_DET_H
#define MOEQ_KERNELS_GEMM_DET_H

#include "core/core.h"

/* C[M, N] (ldc) = A[M, K] (lda) B[N, K]^T (ldb); C is written, never read. */
void mq_gemm_det_nt(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                    int64_t ldb, float *C, int64_t ldc);
/* The same over the pool in tiles of output rows and columns (identical values). */
void mq_gemm_det_nt_pool(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *B, int64_t ldb, float *C, int64_t ldc);

void mq_gemm_det_nt_ref(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                        const float *B, int64_t ldb, float *C, int64_t ldc);
#if defined(__x86_64__) || defined(__i386__)
/* Call only when mq_cpu_has_avx2_fma(). */
void mq_gemm_det_nt_avx2(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *B, int64_t ldb, float *C, int64_t ldc);
/* Call only when mq_cpu_has_avx512() (src/kernels/cpu/x86/gemm_det_avx512.c: 32 x 12 tiles). */
void mq_gemm_det_nt_avx512(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                           const float *B, int64_t ldb, float *C, int64_t ldc);
#endif
#if defined(__aarch64__)
void mq_gemm_det_nt_neon(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *B, int64_t ldb, float *C, int64_t ldc);
#endif

/* The Hessian sum's update with the same property: for the rows i in [i0, i1) of the K x K
 * row-major C and every j <= i,
 *     C[i][j] = fmaf(X[r][i], X[r][j], C[i][j])   for r = 0 .. n-1 in order
 * (X [n, K], ldx), so adding rows in one call or in many, in any grouping, gives the same sums,
 * and so does splitting the rows of C. The AVX2, AVX-512 and NEON twins may also write elements
 * above the diagonal next to it (never read by the Hessian code). Single-threaded; _pool runs all
 * rows over the pool. */
void mq_syrk_det_acc(int64_t K, int64_t n, const float *X, int64_t ldx, float *C, int64_t ldc,
                     int64_t i0, int64_t i1);
void mq_syrk_det_acc_pool(int64_t K, int64_t n, const float *X, int64_t ldx, float *C, int64_t ldc);
/* Rows [i0, i1) of C only, over the pool (several ranks each sum a band of the triangle). */
void mq_syrk_det_acc_pool_rows(int64_t K, int64_t n, const float *X, int64_t ldx, float *C,
                               int64_t ldc, int64_t i0, int64_t i1);
void mq_syrk_det_acc_ref(int64_t K, int64_t n, const float *X, int64_t ldx, float *C, int64_t ldc,
                         int64_t i0, int64_t i1);
#if defined(__x86_64__) || defined(__i386__)
void mq_syrk_det_acc_avx2(int64_t K, int64_t n, const float *X, int64_t ldx, float *C,
                          int64_t ldc, int64_t i0, int64_t i1);
/* Call only when mq_cpu_has_avx512() (6 x 32 tiles). */
void mq_syrk_det_acc_avx512(int64_t K, int64_t n, const float *X, int64_t ldx, float *C,
                            int64_t ldc, int64_t i0, int64_t i1);
#endif
#if defined(__aarch64__)
void mq_syrk_det_acc_neon(int64_t K, int64_t n, const float *X, int64_t ldx, float *C,
                          int64_t ldc, int64_t i0, int64_t i1);
#endif

/* The cross sum of two streams of rows (asymmetric calibration's G = sum x_f x_q^T): for the rows
 * i in [i0, i1) of the K x K row-major C and every j,
 *     C[i][j] = fmaf(A[r][i], B[r][j], C[i][j])   for r = 0 .. n-1 in order
 * (A, B [n, K]), so again any grouping of the rows into calls gives the same sums. The AVX-512 and
 * AVX2 twins (the Hessian update's tiles over two packed streams) serve x86 hosts with them; other
 * hosts take the reference, the same values. Single-threaded; _pool runs all rows over the pool. */
void mq_cross_det_acc(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                      float *C, int64_t ldc, int64_t i0, int64_t i1);
void mq_cross_det_acc_pool(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                           float *C, int64_t ldc);
/* Rows [i0, i1) of C only, over the pool (several ranks each sum a band of the square). */
void mq_cross_det_acc_pool_rows(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                                float *C, int64_t ldc, int64_t i0, int64_t i1);
void mq_cross_det_acc_ref(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                          float *C, int64_t ldc, int64_t i0, int64_t i1);
#if defined(__x86_64__) || defined(__i386__)
void mq_cross_det_acc_avx2(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                           float *C, int64_t ldc, int64_t i0, int64_t i1);
void mq_cross_det_acc_avx512(int64_t K, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                             float *C, int64_t ldc, int64_t i0, int64_t i1);
#endif

/* The family's kernel set (a row of kernels.c's table): the three sums of one instruction set, each
 * bit-identical to its _ref above. NEON has no cross sum twin: its row names the reference's. */
typedef struct {
    void (*gemm_nt)(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                    int64_t ldb, float *C, int64_t ldc);
    void (*syrk_acc)(int64_t K, int64_t n, const float *X, int64_t ldx, float *C, int64_t ldc,
                     int64_t i0, int64_t i1);
    void (*cross_acc)(int64_t K, int64_t n, const float *A, int64_t lda, const float *B,
                      int64_t ldb, float *C, int64_t ldc, int64_t i0, int64_t i1);
} mq_det_kernels;

extern const mq_det_kernels mq_det_ref;   /* src/kernels/cpu/ref/gemm_det_ref.c */
#if defined(__x86_64__) || defined(__i386__)
extern const mq_det_kernels mq_det_avx2;     /* src/kernels/cpu/x86/gemm_det_avx2.c */
extern const mq_det_kernels mq_det_avx512;   /* src/kernels/cpu/x86/gemm_det_avx512.c */
#endif
#if defined(__aarch64__)
extern const mq_det_kernels mq_det_neon;     /* src/kernels/cpu/arm/gemm_det_neon.c */
#endif
/* The set to use now (kernels.c: the row of mq_cpu_isa()). */
const mq_det_kernels *mq_det(void);

#endif
