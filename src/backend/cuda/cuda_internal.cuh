/*
 * What the CUDA files of the backend share: the context behind mq_gpu and the error helpers
 * that turn a failed CUDA, cuBLAS or cuSOLVER call into a moeq error naming the call.
 */
#ifndef MOEQ_BACKEND_CUDA_INTERNAL_CUH
#define MOEQ_BACKEND_CUDA_INTERNAL_CUH

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

extern "C" {
#include "backend/gpu.h"
}
#include "core/env.h"

/* Independent factorisations run on this many streams at once (each with its own handles). */
enum { MQ_GPU_STREAMS = 8 };

struct mq_gpu {
    int device;
    mq_gpu_info info;
    cudaStream_t stream[MQ_GPU_STREAMS];
    cublasHandle_t blas[MQ_GPU_STREAMS];
    cusolverDnHandle_t solver[MQ_GPU_STREAMS];
    void *ws[MQ_GPU_STREAMS];       /* cuSOLVER workspaces, kept between calls (grow only) */
    size_t ws_cap[MQ_GPU_STREAMS];
    void *pin;                      /* pinned host memory the results come back through */
    size_t pin_cap;
    cudaEvent_t ev[2];              /* its two halves' copies */
    cudaStream_t copy;              /* mq_cu_upload_many's: its copies run beside the work that
                                       stream 0 has queued (attention while experts go up) */
    int det_tile;                   /* tile_det.cuh's tile, forced (tests); 0: by the grid's size */
    moeq_gpu_precision precision;   /* mq_gpu_set_precision: of the products and Hessian sums */
    int64_t sizing_reserve;         /* mq_gpu_set_sizing_reserve: kept out of the free memory
                                       that sizes are chosen from */
};

moeq_status mq_cu_fail(cudaError_t e, const char *what, const char *file, int line);
moeq_status mq_cublas_fail(cublasStatus_t e, const char *what, const char *file, int line);
moeq_status mq_cusolver_fail(cusolverStatus_t e, const char *what, const char *file, int line);

/* Each evaluates to MOEQ_OK or the error (message set), for `if ((st = CU(...))) goto out;`. */
#define CU(call)                                                                                  \
    ([&]() -> moeq_status {                                                                        \
        cudaError_t e_ = (call);                                                                   \
        return e_ == cudaSuccess ? MOEQ_OK : mq_cu_fail(e_, #call, __FILE__, __LINE__);           \
    }())
#define CUBLAS(call)                                                                              \
    ([&]() -> moeq_status {                                                                        \
        cublasStatus_t e_ = (call);                                                                \
        return e_ == CUBLAS_STATUS_SUCCESS ? MOEQ_OK : mq_cublas_fail(e_, #call, __FILE__, __LINE__); \
    }())
#define CUSOLVER(call)                                                                            \
    ([&]() -> moeq_status {                                                                        \
        cusolverStatus_t e_ = (call);                                                              \
        return e_ == CUSOLVER_STATUS_SUCCESS ? MOEQ_OK                                             \
                                             : mq_cusolver_fail(e_, #call, __FILE__, __LINE__);     \
    }())
/* After a kernel launch: the launch error, if any. */
#define CU_LAUNCHED(what) CU(cudaGetLastError())

/* cudaMalloc that names what it allocates in the out-of-memory message. */
moeq_status mq_cu_alloc(void **p, size_t bytes, const char *what);
template <typename T> static inline moeq_status cu_alloc(T **p, size_t n, const char *what) {
    return mq_cu_alloc((void **)p, n * sizeof(T), what);
}
void mq_cu_free(void *p);
/* cudaMallocAsync / cudaFreeAsync on stream s, counted and bounded as mq_cu_alloc's (context.cu). */
moeq_status mq_cu_alloc_async(void **p, size_t bytes, cudaStream_t s, const char *what);
void mq_cu_free_async(void *p, cudaStream_t s);
/* The device's free memory for this process's next allocations: the driver's, plus what the
 * stream-ordered pool keeps of freed blocks, at most what the bound leaves (mq_gpu_set_memory_limit). */
size_t mq_cu_mem_free(mq_gpu *g);

/* Host memory to the device through the pinned buffer (g->pin): pieces copied on the host pool
 * into one half while the other half's piece travels; faster than a pageable copy. Stream 0;
 * returns once the host data has been taken (the last piece may still be travelling). Small
 * copies go straight. */
moeq_status mq_cu_upload(mq_gpu *g, void *dst, const void *src, size_t bytes);
/* n uploads through the pinned halves back to back (dst[i] <- src[i], bytes[i]): each half
 * filled from as many of them as fit, on the pool, while the other half travels, so many small
 * ones (a chunk's expert weights, 8 MB each) keep the bus busy instead of waiting each for its
 * own. On the copy stream, beside whatever stream 0 runs; returns once every piece has arrived,
 * so work queued after it on any stream sees the data. */
moeq_status mq_cu_upload_many(mq_gpu *g, int64_t n, void *const *dst, const void *const *src, const size_t *bytes);
/* Small host arrays (a batch's row indices, the combine's pairs) up in stream order without
 * waiting for the work queued before them: each call copies into one of two pinned buffers of
 * the stage's own and queues the copy on s, returning before it runs; the host waits only for
 * the copy two calls back through the same buffer (zero-initialised; mq_cu_stage_free after
 * the stream's work is done). */
struct mq_cu_stage {
    void *buf[2];
    size_t cap[2];
    cudaEvent_t done[2];
    bool pending[2];
    int next;
};
moeq_status mq_cu_stage_upload(mq_cu_stage *st, cudaStream_t s, void *dst, const void *src, size_t bytes);
void mq_cu_stage_free(mq_cu_stage *st);
/* The pinned buffer, two halves of `piece` bytes (allocated on first use). */
moeq_status mq_cu_pinned(mq_gpu *g, size_t *piece);

/* Device views of the objects of the C interface (NULL / false for a bad index): expert e's
 * Linear k of an mq_gpu_mlp and its shape; sum i of an mq_gpu_hessians (K[i], rows so far). */
float *mq_gpu_mlp_weight(mq_gpu_mlp *m, int64_t e, int k);
bool mq_gpu_mlp_shape(const mq_gpu_mlp *m, int64_t e, int k, int64_t *rows, int64_t *cols);
/* The expert set's kept batch outputs (mq_gpu_mlp_run_indexed with keep): rows of D values, the
 * room for *rows of them (0 and NULL before any was kept); read them on stream 0 after a join. */
float *mq_gpu_mlp_kept(mq_gpu_mlp *m, int64_t *rows, int64_t *D);
/* The context an expert set or a buffer was made on. */
mq_gpu *mq_gpu_mlp_gpu(const mq_gpu_mlp *m);
mq_gpu *mq_gpu_buf_gpu(const mq_gpu_buf *b);
const float *mq_gpu_hessians_sum(const mq_gpu_hessians *hs, int64_t i, int64_t *K, int64_t *n);
/* An mq_gpu_buf's device memory and its size in floats (n may be NULL). */
float *mq_gpu_buf_device(mq_gpu_buf *b, int64_t *n);

/* The calibration's products and Hessian updates, on stream g->stream[j] (cuBLAS handle j):
 * tile_det.cuh's fmaf chains (every output one chain in k order: the CPU's bits, whatever the
 * tiling or the rows beside it), or in the TF32 modes cuBLAS on TF32 tensor cores (deterministic
 * for the same shapes on one GPU, fp32 sums): one product of the inputs' TF32 values, or
 * (tf32x3) three, hi*hi + hi*lo + lo*hi, of their hi and lo halves.
 *   mq_cu_product: C [M, N] (row stride ldc) = A [M, K] B [N, K]^T, row-major;
 *   mq_cu_gram_add: C [K, K] += X^T X over the n rows of X [n, K]: the lower triangle (with
 *   the TF32 modes both; only the lower one is read). */
/* The cublasSgemm operands of mq_cu_product's cuBLAS modes (column-major: C^T [N, M] = the
 * B^T-view [N, K] times the A^T-view [K, M]); the SIMT emulator (kvattn_emu.cu) runs a host GEMM
 * of the same operands, so a wrong transpose or leading dimension shows there too. */
struct mq_cu_sgemm_ops {
    cublasOperation_t ta, tb;
    int m, n, k;
    const float *A;
    int lda;
    const float *B;
    int ldb;
    float *C;
    int ldc;
};
static inline mq_cu_sgemm_ops mq_cu_product_ops(int64_t M, int64_t N, int64_t K, const float *A, const float *B,
                                                float *C, int64_t ldc) {
    return {CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)M, (int)K, B, (int)K, A, (int)K, C, (int)ldc};
}
moeq_status mq_cu_product(mq_gpu *g, int j, int64_t M, int64_t N, int64_t K, const float *A, const float *B,
                          float *C, int64_t ldc);
/* mq_cu_product's fmaf chains whatever the precision mode (mq_gpu_gemm_det), on stream s. */
moeq_status mq_cu_product_det(const mq_gpu *g, cudaStream_t s, int64_t M, int64_t N, int64_t K, const float *A,
                              const float *B, float *C, int64_t ldc);
moeq_status mq_cu_gram_add(mq_gpu *g, cudaStream_t s, float *C, const float *X, int64_t n, int64_t K);

/* q's values, mq_dequantize's bits, into dev [q->rows, q->cols] (dequant.cu; what names it in
 * errors); waits for them. MOEQ_E_UNSUPPORTED for a scheme the device does not decode. */
moeq_status mq_cu_dequantize(mq_gpu *g, const mq_qtensor *q, float *dev, const char *what);

/* mq_gpu_hessians_add for rows already on the device (x: rows x K, on stream s, which must not
 * change x before the kernel has read it: later work on s is ordered after it). A sum is updated
 * on one stream at a time, stream 0 ordered after it before the sum is read. */
moeq_status mq_gpu_hessians_add_device(mq_gpu_hessians *hs, int64_t i, const float *x, int64_t rows, cudaStream_t s);

#endif
