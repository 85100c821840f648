/*
 * The deterministic products of the GPU backend (kernels/gemm_det.h's contract): every output is
 * one fmaf chain over k in increasing order, so the result does not depend on the tiling, and is
 * the CPU's bit for bit.
 *
 *   k_det_nt:   C [M, N] = A [M, K] B [N, K]^T, each chain from +0 (mq_gemm_det_nt);
 *   k_det_syrk: C [K, K] += X^T X over the rows of X [n, K], lower triangle only, each chain
 *               continued from C's value (mq_syrk_det_acc).
 *
 * A CTA computes a TILE x TILE block of C (128, 64 or 32: the smaller ones where the larger leave
 * SMs idle, a few experts' rows or a 1024-wide Hessian) with 256 threads, (TILE/16)^2 outputs
 * each (rows ty*H + {0..H-1} and TILE/2 + ty*H + {0..H-1}, H = TILE/32, columns likewise with tx,
 * so the shared-memory reads have no bank conflicts: float4s at 128); k goes in slabs of 8
 * through two shared buffers, the next slab loaded into registers while the current one is
 * multiplied. Rows and columns past the edges are zero-filled
 * and never stored; k past K is never multiplied (nk), since even fmaf(0, 0, -0) would turn a
 * chain's -0 into +0. Products of 128-tiles whose slabs are all whole and aligned take
 * k_det_nt128, the same layout and chains in fewer registers (two CTAs an SM).
 */
#ifndef MOEQ_BACKEND_CUDA_TILE_DET_CUH
#define MOEQ_BACKEND_CUDA_TILE_DET_CUH

#include <stdint.h>

namespace mqd {

constexpr int DT_BK = 8, DT_THREADS = 256;

/* V consecutive floats from p (16-, 8- or 4-byte aligned), zeros for p == nullptr. */
template <int V>
__device__ __forceinline__ void dt_vload(const float *p, float *r) {
    if constexpr (V == 4) {
        const float4 v = p ? *(const float4 *)p : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
    } else if constexpr (V == 2) {
        const float2 v = p ? *(const float2 *)p : make_float2(0.0f, 0.0f);
        r[0] = v.x, r[1] = v.y;
    } else {
        r[0] = p ? *p : 0.0f;
    }
}

/* One slab: V = TILE/32 values a thread of A's and of B's tile, as [k][m] in shared memory. NT:
 * A and B rows hold k (thread t: row t / (8/V), k (t % (8/V)) * V + 0..V-1); SYRK: X rows are k
 * (thread t: k t/32, columns (t%32)*V + 0..V-1). */
template <bool SYRK, int TILE>
__device__ __forceinline__ void dt_load(const float *A, const float *B, int64_t M, int64_t N, int64_t K,
                                        int64_t lda, int64_t i0, int64_t j0, int64_t k0, bool vec, float *ra,
                                        float *rb) {
    constexpr int V = TILE / 32, PER_ROW = DT_BK / V;
    const int t = threadIdx.x;
    if (!SYRK) {
        const int64_t r = t / PER_ROW, kq = k0 + (t % PER_ROW) * V;
        const int64_t ia = i0 + r, jb = j0 + r;
        if (vec && kq + V <= K) {   /* V values in one load (aligned: vec says lda and the bases are) */
            dt_vload<V>(ia < M ? A + ia * lda + kq : nullptr, ra);
            dt_vload<V>(jb < N ? B + jb * lda + kq : nullptr, rb);
            return;
        }
#pragma unroll
        for (int u = 0; u < V; u++) {
            const int64_t k = kq + u;
            ra[u] = ia < M && k < K ? A[ia * lda + k] : 0.0f;
            rb[u] = jb < N && k < K ? B[jb * lda + k] : 0.0f;
        }
    } else {
        /* A = B = X [K rows (the chains' k), lda columns]; M = N = the sum's size */
        const int64_t k = k0 + (t >> 5), c = (t & 31) * V;
        if (vec && i0 + c + V <= M && j0 + c + V <= N) {
            dt_vload<V>(k < K ? A + k * lda + i0 + c : nullptr, ra);
            dt_vload<V>(k < K ? B + k * lda + j0 + c : nullptr, rb);
            return;
        }
#pragma unroll
        for (int u = 0; u < V; u++) {
            ra[u] = k < K && i0 + c + u < M ? A[k * lda + i0 + c + u] : 0.0f;
            rb[u] = k < K && j0 + c + u < N ? B[k * lda + j0 + c + u] : 0.0f;
        }
    }
}

template <bool SYRK, int TILE>
__device__ __forceinline__ void dt_store(float (*as)[TILE], float (*bs)[TILE], const float *ra, const float *rb) {
    constexpr int V = TILE / 32, PER_ROW = DT_BK / V;
    const int t = threadIdx.x;
    if (!SYRK) {
        const int r = t / PER_ROW, kq = (t % PER_ROW) * V;
#pragma unroll
        for (int u = 0; u < V; u++) {
            as[kq + u][r] = ra[u];
            bs[kq + u][r] = rb[u];
        }
    } else {
        const int kk = t >> 5, c = (t & 31) * V;
#pragma unroll
        for (int u = 0; u < V; u++) {
            as[kk][c + u] = ra[u];
            bs[kk][c + u] = rb[u];
        }
    }
}

/* Row (or column) of a thread's u-th output within the tile: two halves of H = TILE/32 each,
 * at ty*H and TILE/2 + ty*H (conflict-free shared-memory reads). */
template <int TILE>
__device__ __forceinline__ int dt_at(int t16, int u) {
    constexpr int H = TILE / 32;
    return u < H ? t16 * H + u : TILE / 2 + t16 * H + u - H;
}

/* A thread's 8 values of A and of B in slab row (ra, rb) of a 128-wide tile, as float4 reads:
 * the columns ty*4.. and 64 + ty*4.. of A's row, tx*4.. and 64 + tx*4.. of B's (dt_at<128>). */
__device__ __forceinline__ void dt_frag128(const float *ra, const float *rb, int tx, int ty, float (&a)[8],
                                           float (&b)[8]) {
    const float4 a0 = *(const float4 *)&ra[ty * 4], a1 = *(const float4 *)&ra[64 + ty * 4];
    const float4 b0 = *(const float4 *)&rb[tx * 4], b1 = *(const float4 *)&rb[64 + tx * 4];
    a[0] = a0.x, a[1] = a0.y, a[2] = a0.z, a[3] = a0.w, a[4] = a1.x, a[5] = a1.y, a[6] = a1.z, a[7] = a1.w;
    b[0] = b0.x, b[1] = b0.y, b[2] = b0.z, b[3] = b0.w, b[4] = b1.x, b[5] = b1.y, b[6] = b1.z, b[7] = b1.w;
}

/* One k of a thread's R x R chains: acc[u][v] = fmaf(a[u], b[v], acc[u][v]). */
template <int R>
__device__ __forceinline__ void dt_outer(float (&acc)[R][R], const float (&a)[R], const float (&b)[R]) {
#pragma unroll
    for (int u = 0; u < R; u++)
#pragma unroll
        for (int v = 0; v < R; v++) acc[u][v] = fmaf(a[u], b[v], acc[u][v]);
}

/* NT: C = A B^T (lda = K for both). SYRK: C (ldc = M = N) += X^T X, X [K, lda]. A CTA computes a
 * TILE x TILE block of C, R x R outputs a thread (R = TILE/16). */
template <bool SYRK, int TILE>
__global__ void __launch_bounds__(DT_THREADS, 2) k_det(int64_t M, int64_t N, int64_t K, int64_t lda, const float *A,
                                                      const float *B, float *C, int64_t ldc, bool vec) {
    constexpr int R = TILE / 16, V = TILE / 32;
    const int64_t i0 = (int64_t)blockIdx.y * TILE, j0 = (int64_t)blockIdx.x * TILE;
    if (SYRK && j0 > i0) return;   /* above the diagonal */
    __shared__ __align__(16) float as[2][DT_BK][TILE];
    __shared__ __align__(16) float bs[2][DT_BK][TILE];
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    float acc[R][R];
#pragma unroll
    for (int u = 0; u < R; u++)
#pragma unroll
        for (int v = 0; v < R; v++) {
            if (!SYRK) {
                acc[u][v] = 0.0f;
            } else {
                const int64_t i = i0 + dt_at<TILE>(ty, u), j = j0 + dt_at<TILE>(tx, v);
                acc[u][v] = i < M && j < N && j <= i ? C[i * ldc + j] : 0.0f;
            }
        }
    float ra[V], rb[V];
    dt_load<SYRK, TILE>(A, B, M, N, K, lda, i0, j0, 0, vec, ra, rb);
    dt_store<SYRK, TILE>(as[0], bs[0], ra, rb);
    __syncthreads();
    int buf = 0;
    for (int64_t k0 = 0; k0 < K; k0 += DT_BK) {
        const bool more = k0 + DT_BK < K;
        if (more) dt_load<SYRK, TILE>(A, B, M, N, K, lda, i0, j0, k0 + DT_BK, vec, ra, rb);
        const int nk = K - k0 < DT_BK ? (int)(K - k0) : DT_BK;
        auto step = [&](int kk) {
            float a[R], b[R];
            if constexpr (TILE == 128) {   /* float4 reads */
                dt_frag128(as[buf][kk], bs[buf][kk], tx, ty, a, b);
            } else {
#pragma unroll
                for (int u = 0; u < R; u++) {
                    a[u] = as[buf][kk][dt_at<TILE>(ty, u)];
                    b[u] = bs[buf][kk][dt_at<TILE>(tx, u)];
                }
            }
            dt_outer<R>(acc, a, b);
        };
        if (nk == DT_BK) {   /* a whole slab, unrolled: shared-memory offsets become constants */
#pragma unroll
            for (int kk = 0; kk < DT_BK; kk++) step(kk);
        } else {
            for (int kk = 0; kk < nk; kk++) step(kk);
        }
        if (more) {
            dt_store<SYRK, TILE>(as[buf ^ 1], bs[buf ^ 1], ra, rb);
            __syncthreads();
            buf ^= 1;
        }
    }
#pragma unroll
    for (int u = 0; u < R; u++) {
        const int64_t i = i0 + dt_at<TILE>(ty, u);
        if (i >= M) continue;
#pragma unroll
        for (int v = 0; v < R; v++) {
            const int64_t j = j0 + dt_at<TILE>(tx, v);
            if (j < N && (!SYRK || j <= i)) C[i * ldc + j] = acc[u][v];
        }
    }
}

/* NT with 128 x 128 tiles where every slab is whole and aligned (K % 8 == 0, `vec`): k_det's
 * chains and layout with each thread's two load rows as pointers set once (k_det recomputes
 * 64-bit row offsets every slab: 144 registers, one CTA an SM; this one stays within 128, two),
 * float4 stores where C's rows allow (cvec), padded shared rows. 16% faster on an H200 (36.7 ->
 * 42.7 TFLOP/s on a 32768 x 1024 x 2048 product, cuBLAS 49-50), the same bits. */
static __global__ void __launch_bounds__(DT_THREADS, 2) k_det_nt128(int64_t M, int64_t N, int64_t K, const float *A,
                                                                   const float *B, float *C, int64_t ldc, bool cvec) {
    /* rows padded by 4 floats: a warp's transposing stores (two k rows, 16 columns each) hit
     * 32 banks instead of 16 twice (42.7 against 41.0 TFLOP/s) */
    constexpr int TILE = 128, R = 8, PADDED = TILE + 4;
    const int64_t i0 = (int64_t)blockIdx.y * TILE, j0 = (int64_t)blockIdx.x * TILE;
    __shared__ __align__(16) float as[2][DT_BK][PADDED];
    __shared__ __align__(16) float bs[2][DT_BK][PADDED];
    const int t = threadIdx.x, tx = t & 15, ty = t >> 4;
    const int lr = t >> 1, lk = (t & 1) * 4;   /* the row this thread loads, its first k of the slab */
    const float *pa = i0 + lr < M ? A + (i0 + lr) * K + lk : nullptr;
    const float *pb = j0 + lr < N ? B + (j0 + lr) * K + lk : nullptr;
    float acc[R][R];
#pragma unroll
    for (int u = 0; u < R; u++)
#pragma unroll
        for (int v = 0; v < R; v++) acc[u][v] = 0.0f;
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 ra = pa ? *(const float4 *)pa : zero4, rb = pb ? *(const float4 *)pb : zero4;
    auto store = [&](int b) {
        as[b][lk][lr] = ra.x, as[b][lk + 1][lr] = ra.y, as[b][lk + 2][lr] = ra.z, as[b][lk + 3][lr] = ra.w;
        bs[b][lk][lr] = rb.x, bs[b][lk + 1][lr] = rb.y, bs[b][lk + 2][lr] = rb.z, bs[b][lk + 3][lr] = rb.w;
    };
    store(0);
    __syncthreads();
    int buf = 0;
    for (int64_t k0 = 0; k0 < K; k0 += DT_BK) {
        const bool more = k0 + DT_BK < K;
        if (more) {
            ra = pa ? *(const float4 *)(pa + k0 + DT_BK) : zero4;
            rb = pb ? *(const float4 *)(pb + k0 + DT_BK) : zero4;
        }
#pragma unroll
        for (int kk = 0; kk < DT_BK; kk++) {
            float a[R], b[R];
            dt_frag128(as[buf][kk], bs[buf][kk], tx, ty, a, b);
            dt_outer<R>(acc, a, b);
        }
        if (more) {
            store(buf ^ 1);
            __syncthreads();
            buf ^= 1;
        }
    }
#pragma unroll
    for (int u = 0; u < R; u++) {
        const int64_t i = i0 + dt_at<TILE>(ty, u);
        if (i >= M) continue;
        float *c = C + i * ldc;
#pragma unroll
        for (int h = 0; h < 2; h++) {   /* columns tx*4 + 0..3 and 64 + tx*4 + 0..3 */
            const int64_t j = j0 + h * 64 + tx * 4;
            if (cvec && j + 4 <= N) {
                *(float4 *)(c + j) = make_float4(acc[u][4 * h], acc[u][4 * h + 1], acc[u][4 * h + 2], acc[u][4 * h + 3]);
            } else {
#pragma unroll
                for (int v = 0; v < 4; v++)
                    if (j + v < N) c[j + v] = acc[u][4 * h + v];
            }
        }
    }
}

/* The tile for an M x N output (the lower triangle for SYRK), from what an H200 measured (132
 * SMs, tilebench; docs/results/gpu.md; two 128-tile CTAs fit an SM since the launch bounds say so):
 * - products: 128 while its CTAs come near one per SM (2048 x 1024 x 2048: 128 CTAs at 29
 *   TFLOP/s against 20 with 64), else 64 while a quarter of the SMs get one (256 x 1024: 64
 *   CTAs of 64 at 8.2 against 6.8 with 32), else 32;
 * - SYRK: every CTA walks all the rows, so the few 128-tiles of a 2048-wide sum (136) leave
 *   most of the GPU waiting on them (18.9 TFLOP/s against 24.3 with 64) and 32-tiles starve on
 *   shared memory (7.6): 128 only from four CTAs per SM up (a 4096-wide sum), else 64 from half
 *   the SMs up, else 32.
 * `force` (tests) picks one. Every tile computes the same chains, so the choice changes the speed
 * only. */
inline int det_tile(bool syrk, int64_t M, int64_t N, int sm_count, int force) {
    if (force == 128 || force == 64 || force == 32) return force;
    auto ctas = [&](int t) {
        const int64_t tm = (M + t - 1) / t, tn = (N + t - 1) / t;
        return syrk ? tm * (tm + 1) / 2 : tm * tn;
    };
    if (syrk) return ctas(128) >= 4 * (int64_t)sm_count ? 128 : 2 * ctas(64) >= sm_count ? 64 : 32;
    return 10 * ctas(128) >= 9 * (int64_t)sm_count ? 128 : 4 * ctas(64) >= sm_count ? 64 : 32;
}

template <bool SYRK>
inline void det_launch(cudaStream_t s, int tile, int64_t M, int64_t N, int64_t K, int64_t lda, const float *A,
                       const float *B, float *C, int64_t ldc) {
    const dim3 grid((unsigned)((N + tile - 1) / tile), (unsigned)((M + tile - 1) / tile));
    /* whole-vector loads where every row starts on a vector boundary (the loads, not the sums,
     * change: the same bits) */
    const int64_t vb = 4 * (tile / 32);
    const bool vec = lda % (tile / 32) == 0 && (uintptr_t)A % vb == 0 && (uintptr_t)B % vb == 0;
    if (!SYRK && tile == 128 && vec && lda == K && K % DT_BK == 0) {
        const bool cvec = ldc % 4 == 0 && (uintptr_t)C % 16 == 0;
        k_det_nt128<<<grid, DT_THREADS, 0, s>>>(M, N, K, A, B, C, ldc, cvec);
    } else if (tile == 128) k_det<SYRK, 128><<<grid, DT_THREADS, 0, s>>>(M, N, K, lda, A, B, C, ldc, vec);
    else if (tile == 64) k_det<SYRK, 64><<<grid, DT_THREADS, 0, s>>>(M, N, K, lda, A, B, C, ldc, vec);
    else k_det<SYRK, 32><<<grid, DT_THREADS, 0, s>>>(M, N, K, lda, A, B, C, ldc, vec);
}

}  // namespace mqd

#endif
