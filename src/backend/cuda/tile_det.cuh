/*
 * The deterministic products of the GPU backend (kernels/gemm_det.h's contract): every output is
 * one fmaf chain over k in increasing order, so the result does not depend on the tiling, and is
 * the CPU's bit for bit.
 *
 *   k_det_nt:   C [M, N] = A [M, K] B [N, K]^T, each chain from +0 (mq_gemm_det_nt);
 *   k_det_syrk: C [K, K] += X^T X over the rows of X [n, K], lower triangle only, each chain
 *               continued from C's value (mq_syrk_det_acc).
 *
 * A CTA computes a 128 x 128 tile of C with 256 threads, 8 x 8 outputs each (rows ty*4 + {0..3}
 * and 64 + ty*4 + {0..3}, columns likewise with tx, so the shared-memory reads are float4s without
 * bank conflicts); k goes in slabs of 8 through two shared buffers, the next slab loaded into
 * registers while the current one is multiplied. Rows and columns past the edges are zero-filled
 * and never stored; k past K is never multiplied (nk), since even fmaf(0, 0, -0) would turn a
 * chain's -0 into +0.
 */
#ifndef MOEQ_BACKEND_CUDA_TILE_DET_CUH
#define MOEQ_BACKEND_CUDA_TILE_DET_CUH

#include <stdint.h>

namespace mqd {

constexpr int DT_TILE = 128, DT_BK = 8, DT_THREADS = 256;

/* One slab: 4 values a thread of A's and of B's tile, as [k][m] in shared memory. NT: A and B
 * rows hold k (thread t: row t/2, k (t%2)*4 + 0..3); SYRK: X rows are k (thread t: k t/32,
 * columns (t%32)*4 + 0..3). */
template <bool SYRK>
__device__ __forceinline__ void dt_load(const float *A, const float *B, int64_t M, int64_t N, int64_t K,
                                        int64_t lda, int64_t i0, int64_t j0, int64_t k0, float ra[4], float rb[4]) {
    const int t = threadIdx.x;
    if (!SYRK) {
        const int64_t r = t >> 1, kq = k0 + (t & 1) * 4;
        const int64_t ia = i0 + r, jb = j0 + r;
        for (int u = 0; u < 4; u++) {
            const int64_t k = kq + u;
            ra[u] = ia < M && k < K ? A[ia * lda + k] : 0.0f;
            rb[u] = jb < N && k < K ? B[jb * lda + k] : 0.0f;
        }
    } else {
        /* A = B = X [K rows (the chains' k), lda columns]; M = N = the sum's size */
        const int64_t k = k0 + (t >> 5), c = (t & 31) * 4;
        for (int u = 0; u < 4; u++) {
            ra[u] = k < K && i0 + c + u < M ? A[k * lda + i0 + c + u] : 0.0f;
            rb[u] = k < K && j0 + c + u < N ? B[k * lda + j0 + c + u] : 0.0f;
        }
    }
}

template <bool SYRK>
__device__ __forceinline__ void dt_store(float (*as)[DT_TILE], float (*bs)[DT_TILE], const float ra[4],
                                         const float rb[4]) {
    const int t = threadIdx.x;
    if (!SYRK) {
        const int r = t >> 1, kq = (t & 1) * 4;
        for (int u = 0; u < 4; u++) {
            as[kq + u][r] = ra[u];
            bs[kq + u][r] = rb[u];
        }
    } else {
        const int kk = t >> 5, c = (t & 31) * 4;
        for (int u = 0; u < 4; u++) {
            as[kk][c + u] = ra[u];
            bs[kk][c + u] = rb[u];
        }
    }
}

/* NT: C = A B^T (lda = K for both). SYRK: C (ldc = M = N) += X^T X, X [K, lda]. */
template <bool SYRK>
__global__ void __launch_bounds__(DT_THREADS) k_det(int64_t M, int64_t N, int64_t K, int64_t lda, const float *A,
                                                      const float *B, float *C, int64_t ldc) {
    const int64_t i0 = (int64_t)blockIdx.y * DT_TILE, j0 = (int64_t)blockIdx.x * DT_TILE;
    if (SYRK && j0 > i0) return;   /* above the diagonal */
    __shared__ __align__(16) float as[2][DT_BK][DT_TILE];
    __shared__ __align__(16) float bs[2][DT_BK][DT_TILE];
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    float acc[8][8];
    for (int u = 0; u < 8; u++)
        for (int v = 0; v < 8; v++) {
            if (!SYRK) {
                acc[u][v] = 0.0f;
            } else {
                const int64_t i = i0 + (u < 4 ? ty * 4 + u : 64 + ty * 4 + u - 4);
                const int64_t j = j0 + (v < 4 ? tx * 4 + v : 64 + tx * 4 + v - 4);
                acc[u][v] = i < M && j < N && j <= i ? C[i * ldc + j] : 0.0f;
            }
        }
    float ra[4], rb[4];
    dt_load<SYRK>(A, B, M, N, K, lda, i0, j0, 0, ra, rb);
    dt_store<SYRK>(as[0], bs[0], ra, rb);
    __syncthreads();
    int buf = 0;
    for (int64_t k0 = 0; k0 < K; k0 += DT_BK) {
        const bool more = k0 + DT_BK < K;
        if (more) dt_load<SYRK>(A, B, M, N, K, lda, i0, j0, k0 + DT_BK, ra, rb);
        const int nk = K - k0 < DT_BK ? (int)(K - k0) : DT_BK;
        for (int kk = 0; kk < nk; kk++) {
            const float4 a0 = *(const float4 *)&as[buf][kk][ty * 4], a1 = *(const float4 *)&as[buf][kk][64 + ty * 4];
            const float4 b0 = *(const float4 *)&bs[buf][kk][tx * 4], b1 = *(const float4 *)&bs[buf][kk][64 + tx * 4];
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            for (int u = 0; u < 8; u++)
                for (int v = 0; v < 8; v++) acc[u][v] = fmaf(a[u], b[v], acc[u][v]);
        }
        if (more) {
            dt_store<SYRK>(as[buf ^ 1], bs[buf ^ 1], ra, rb);
            __syncthreads();
            buf ^= 1;
        }
    }
    for (int u = 0; u < 8; u++) {
        const int64_t i = i0 + (u < 4 ? ty * 4 + u : 64 + ty * 4 + u - 4);
        if (i >= M) continue;
        for (int v = 0; v < 8; v++) {
            const int64_t j = j0 + (v < 4 ? tx * 4 + v : 64 + tx * 4 + v - 4);
            if (j < N && (!SYRK || j <= i)) C[i * ldc + j] = acc[u][v];
        }
    }
}

}  // namespace mqd

#endif
