/*
 * The deterministic GEMM (src/kernels/gemm_det.h): the SIMD kernels (AVX2 and AVX-512; NEON on
 * Arm64) equal the scalar chain of fmaf bit for bit, on shapes with every edge (rows not a
 * multiple of 16 or 32, columns not of 6 or 12, K odd, leading dimensions wider than the rows); a row's values do not depend on how many rows
 * share the call or where it sits among them (what lets the pipeline batch an expert's rows
 * across samples); the pool split gives the same values; the result is a correct product
 * (within the fp32 error bound of a K-term sum, against double).
 */
#include <math.h>
#include <stdlib.h>

#include "harness.h"
#include "kernels/gemm_det.h"

static uint64_t g_rng = 0x2545F4914F6CDD1Dull;
static float rnd(void) {
    mq_test_xorshift(&g_rng);
    return (float)((double)(g_rng >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static float *rand_matrix(int64_t rows, int64_t ld) {
    float *m = malloc(sizeof(float) * (size_t)(rows * ld));
    for (int64_t i = 0; i < rows * ld; i++) m[i] = rnd();
    return m;
}

static void test_avx2_equals_reference(void) {
    if (!mq_cpu_has_avx2_fma() && !MQ_TEST_ARM) SKIP("no AVX2+FMA on this CPU");
    /* the AVX2 tiles are 16 x 6, the AVX-512 ones 32 (or 16) x 12 */
    const int64_t shapes[][3] = {{1, 1, 1},     {3, 5, 7},     {16, 6, 64},    {17, 7, 65},
                                 {33, 13, 255}, {64, 96, 512}, {5, 200, 1031}, {100, 31, 2048},
                                 {32, 12, 33},  {48, 25, 130}, {15, 11, 9},    {95, 36, 17}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        int64_t lda = K + 3, ldb = K + 1, ldc = N + 2;
        float *A = rand_matrix(M, lda), *B = rand_matrix(N, ldb);
        float *c1 = calloc((size_t)(M * ldc), sizeof(float)), *c2 = calloc((size_t)(M * ldc), sizeof(float));
        mq_gemm_det_nt_ref(M, N, K, A, lda, B, ldb, c1, ldc);
#if MQ_TEST_X86
        mq_gemm_det_nt_avx2(M, N, K, A, lda, B, ldb, c2, ldc);
#endif
#if MQ_TEST_ARM
        mq_gemm_det_nt_neon(M, N, K, A, lda, B, ldb, c2, ldc);
#endif
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++)
                if (c1[i * ldc + j] != c2[i * ldc + j])
                    FAIL("%lldx%lldx%lld: C[%lld][%lld] ref %.9g simd %.9g", (long long)M, (long long)N,
                         (long long)K, (long long)i, (long long)j, (double)c1[i * ldc + j],
                         (double)c2[i * ldc + j]);
#if MQ_TEST_X86
        if (mq_cpu_has_avx512()) {
            memset(c2, 0, sizeof(float) * (size_t)(M * ldc));
            mq_gemm_det_nt_avx512(M, N, K, A, lda, B, ldb, c2, ldc);
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < N; j++)
                    if (c1[i * ldc + j] != c2[i * ldc + j])
                        FAIL("%lldx%lldx%lld: C[%lld][%lld] ref %.9g avx512 %.9g", (long long)M,
                             (long long)N, (long long)K, (long long)i, (long long)j,
                             (double)c1[i * ldc + j], (double)c2[i * ldc + j]);
        } else if (s == 0) {
            fprintf(stderr, "  no AVX-512 on this CPU (or MOEQ_NO_AVX512): its twin is not run\n");
        }
#endif
        free(A);
        free(B);
        free(c1);
        free(c2);
    }
}

/* Rows computed in one call of 100 rows, or in calls of 1, 7 and 37 rows at every offset, are
 * the same bits; and the pool split equals the single call. */
static void test_rows_do_not_depend_on_the_call(void) {
    const int64_t M = 100, N = 70, K = 300;
    float *A = rand_matrix(M, K), *B = rand_matrix(N, K);
    float *all = malloc(sizeof(float) * (size_t)(M * N)), *part = malloc(sizeof(float) * (size_t)(M * N));
    mq_gemm_det_nt(M, N, K, A, K, B, K, all, N);
    const int64_t sizes[] = {1, 7, 37};
    for (size_t s = 0; s < 3; s++) {
        for (int64_t i0 = 0; i0 < M; i0 += sizes[s]) {
            int64_t m = M - i0 < sizes[s] ? M - i0 : sizes[s];
            mq_gemm_det_nt(m, N, K, A + i0 * K, K, B, K, part + i0 * N, N);
        }
        ASSERT_TRUE(memcmp(all, part, sizeof(float) * (size_t)(M * N)) == 0);
    }
    memset(part, 0, sizeof(float) * (size_t)(M * N));
    mq_gemm_det_nt_pool(M, N, K, A, K, B, K, part, N);
    ASSERT_TRUE(memcmp(all, part, sizeof(float) * (size_t)(M * N)) == 0);
    {   /* several tiles each way, with partial edge tiles (128 x 96 tiles), at 3 threads */
        const int64_t M2 = 300, N2 = 250, K2 = 64;
        float *A2 = rand_matrix(M2, K2), *B2 = rand_matrix(N2, K2);
        float *one = malloc(sizeof(float) * (size_t)(M2 * N2)), *pool = malloc(sizeof(float) * (size_t)(M2 * N2));
        mq_gemm_det_nt(M2, N2, K2, A2, K2, B2, K2, one, N2);
        const int saved = moeq_threads();
        moeq_set_threads(3);
        for (int64_t i = 0; i < M2 * N2; i++) pool[i] = NAN;
        mq_gemm_det_nt_pool(M2, N2, K2, A2, K2, B2, K2, pool, N2);
        moeq_set_threads(saved);
        ASSERT_TRUE(memcmp(one, pool, sizeof(float) * (size_t)(M2 * N2)) == 0);
        free(A2), free(B2), free(one), free(pool);
    }
    /* a product: |C - exact| <= K u sum |a b| (the classic bound of a K-term fma chain) */
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double exact = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                exact += (double)A[i * K + k] * B[j * K + k];
                mag += fabs((double)A[i * K + k] * B[j * K + k]);
            }
            ASSERT_TRUE(fabs(all[i * N + j] - exact) <= (double)K * 0x1p-24 * mag);
        }
    free(A);
    free(B);
    free(all);
    free(part);
}

/* The Hessian update: AVX2 and AVX-512 equal the scalar chain on the lower triangle; rows added in one call
 * or in uneven pieces, and C's rows split into ranges, give the same sums. */
static void test_syrk_accumulate(void) {
    const int64_t Ks[] = {1, 5, 16, 22, 33, 48, 97, 260};
    for (size_t s = 0; s < sizeof Ks / sizeof Ks[0]; s++) {
        const int64_t K = Ks[s], n = 150, ldx = K + 3;
        float *X = rand_matrix(n, ldx);
        float *c0 = rand_matrix(K, K);   /* accumulating onto existing sums */
        float *a = malloc(sizeof(float) * (size_t)(K * K)), *b = malloc(sizeof(float) * (size_t)(K * K));
        memcpy(a, c0, sizeof(float) * (size_t)(K * K));
        memcpy(b, c0, sizeof(float) * (size_t)(K * K));
        mq_syrk_det_acc_ref(K, n, X, ldx, a, K, 0, K);
        if (mq_cpu_has_avx2_fma() || MQ_TEST_ARM) {
#if MQ_TEST_X86
            mq_syrk_det_acc_avx2(K, n, X, ldx, b, K, 0, K);
#endif
#if MQ_TEST_ARM
            mq_syrk_det_acc_neon(K, n, X, ldx, b, K, 0, K);
#endif
            for (int64_t i = 0; i < K; i++)
                for (int64_t j = 0; j <= i; j++)
                    if (a[i * K + j] != b[i * K + j])
                        FAIL("K %lld: C[%lld][%lld] ref %.9g simd %.9g", (long long)K, (long long)i,
                             (long long)j, (double)a[i * K + j], (double)b[i * K + j]);
        }
#if MQ_TEST_X86
        /* AVX-512: all rows at once, and in two ranges whose cut is no multiple of 6 or 16 */
        if (mq_cpu_has_avx512()) {
            for (int cut = 0; cut < 2; cut++) {
                memcpy(b, c0, sizeof(float) * (size_t)(K * K));
                const int64_t mid = cut ? K / 3 + 1 : K;
                mq_syrk_det_acc_avx512(K, n, X, ldx, b, K, 0, mid);
                mq_syrk_det_acc_avx512(K, n, X, ldx, b, K, mid, K);
                for (int64_t i = 0; i < K; i++)
                    for (int64_t j = 0; j <= i; j++)
                        if (a[i * K + j] != b[i * K + j])
                            FAIL("K %lld cut %lld: C[%lld][%lld] ref %.9g avx512 %.9g", (long long)K,
                                 (long long)mid, (long long)i, (long long)j, (double)a[i * K + j],
                                 (double)b[i * K + j]);
            }
        }
#endif
        memcpy(b, c0, sizeof(float) * (size_t)(K * K));
        const int64_t cuts[] = {0, 1, 38, 39, 100, n};
        for (int c = 0; c < 5; c++)   /* rows in pieces, C's rows in two ranges per piece */
            for (int64_t half = 0; half < 2; half++) {
                int64_t i0 = half ? K / 3 : 0, i1 = half ? K : K / 3;
                mq_syrk_det_acc(K, cuts[c + 1] - cuts[c], X + cuts[c] * ldx, ldx, b, K, i0, i1);
            }
        for (int64_t i = 0; i < K; i++)
            for (int64_t j = 0; j <= i; j++) ASSERT_TRUE(a[i * K + j] == b[i * K + j]);
        memcpy(b, c0, sizeof(float) * (size_t)(K * K));
        mq_syrk_det_acc_pool(K, n, X, ldx, b, K);
        for (int64_t i = 0; i < K; i++)
            for (int64_t j = 0; j <= i; j++) ASSERT_TRUE(a[i * K + j] == b[i * K + j]);
        free(X);
        free(c0);
        free(a);
        free(b);
    }
}

/* The cross sum of two streams: the reference is its definition, checked here against a double
 * sum (each element an fmaf chain of n terms: within n 2^-24 of the sum of |terms| plus the
 * start); the AVX2 and AVX-512 kernels equal it bit for bit, full rows and uneven ranges; rows in pieces
 * and the pool give the same sums. */
static void test_cross_accumulate(void) {
    const int64_t Ks[] = {1, 5, 16, 22, 33, 48, 97, 260};
    for (size_t s = 0; s < sizeof Ks / sizeof Ks[0]; s++) {
        const int64_t K = Ks[s], n = 150, lda = K + 3, ldb = K + 1;
        float *A = rand_matrix(n, lda), *B = rand_matrix(n, ldb);
        float *c0 = rand_matrix(K, K);
        float *a = malloc(sizeof(float) * (size_t)(K * K)), *b = malloc(sizeof(float) * (size_t)(K * K));
        memcpy(a, c0, sizeof(float) * (size_t)(K * K));
        mq_cross_det_acc_ref(K, n, A, lda, B, ldb, a, K, 0, K);
        for (int64_t i = 0; i < K; i++)
            for (int64_t j = 0; j < K; j++) {
                double exact = c0[i * K + j], mag = fabs(exact);
                for (int64_t r = 0; r < n; r++) {
                    exact += (double)A[r * lda + i] * B[r * ldb + j];
                    mag += fabs((double)A[r * lda + i] * B[r * ldb + j]);
                }
                ASSERT_TRUE(fabs(a[i * K + j] - exact) <= (double)n * 0x1p-24 * mag);
            }
#if MQ_TEST_X86
        /* each SIMD twin over the whole square and over uneven row ranges (AVX-512: its 32- and
         * 16-column tiles, the rows left, the edge) */
        typedef void (*cross_fn)(int64_t, int64_t, const float *, int64_t, const float *, int64_t, float *,
                                 int64_t, int64_t, int64_t);
        const struct { cross_fn fn; const char *name; bool have; } twins[2] = {
            {mq_cross_det_acc_avx2, "avx2", mq_cpu_has_avx2_fma()},
            {mq_cross_det_acc_avx512, "avx512", mq_cpu_has_avx512()}};
        for (int w = 0; w < 2; w++)
            for (int cut = 0; cut < 3 && twins[w].have; cut++) {
                memcpy(b, c0, sizeof(float) * (size_t)(K * K));
                const int64_t mid = cut == 0 ? K : cut == 1 ? K / 3 + 1 : K / 2 + 5 < K ? K / 2 + 5 : K;
                twins[w].fn(K, n, A, lda, B, ldb, b, K, 0, mid);
                twins[w].fn(K, n, A, lda, B, ldb, b, K, mid, K);
                for (int64_t i = 0; i < K * K; i++)
                    if (a[i] != b[i])
                        FAIL("K %lld cut %lld: C[%lld][%lld] ref %.9g %s %.9g", (long long)K, (long long)mid,
                             (long long)(i / K), (long long)(i % K), (double)a[i], twins[w].name, (double)b[i]);
            }
        if (!mq_cpu_has_avx512() && s == 0)
            fprintf(stderr, "  no AVX-512 on this CPU (or MOEQ_NO_AVX512): its twin is not run\n");
#endif
        memcpy(b, c0, sizeof(float) * (size_t)(K * K));
        const int64_t cuts[] = {0, 1, 38, 39, 100, n};
        for (int c = 0; c < 5; c++)
            for (int64_t half = 0; half < 2; half++) {
                int64_t i0 = half ? K / 3 : 0, i1 = half ? K : K / 3;
                mq_cross_det_acc(K, cuts[c + 1] - cuts[c], A + cuts[c] * lda, lda, B + cuts[c] * ldb, ldb, b, K, i0, i1);
            }
        for (int64_t i = 0; i < K * K; i++) ASSERT_TRUE(a[i] == b[i]);
        memcpy(b, c0, sizeof(float) * (size_t)(K * K));
        mq_cross_det_acc_pool(K, n, A, lda, B, ldb, b, K);
        for (int64_t i = 0; i < K * K; i++) ASSERT_TRUE(a[i] == b[i]);
        memcpy(b, c0, sizeof(float) * (size_t)(K * K));   /* two bands of rows, as two ranks sum them */
        mq_cross_det_acc_pool_rows(K, n, A, lda, B, ldb, b, K, 0, K / 2);
        mq_cross_det_acc_pool_rows(K, n, A, lda, B, ldb, b, K, K / 2, K);
        for (int64_t i = 0; i < K * K; i++) ASSERT_TRUE(a[i] == b[i]);
        free(A);
        free(B);
        free(c0);
        free(a);
        free(b);
    }
}

TEST_MAIN(T(test_avx2_equals_reference), T(test_rows_do_not_depend_on_the_call),
          T(test_syrk_accumulate), T(test_cross_accumulate))
