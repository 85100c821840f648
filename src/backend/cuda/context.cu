/* The GPU context: device selection, streams and library handles, errors and allocation. */
#include <stdio.h>
#include <string.h>

#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/tile_det.cuh"

extern "C" bool mq_gpu_built(void) { return true; }

moeq_status mq_cu_fail(cudaError_t e, const char *what, const char *file, int line) {
    moeq_status st = e == cudaErrorMemoryAllocation ? MOEQ_E_NOMEM : MOEQ_E_DEVICE;
    return mq_err(st, "CUDA: %s: %s (%s:%d)", what, cudaGetErrorString(e), file, line);
}

static const char *cublas_name(cublasStatus_t e) {
    switch (e) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "invalid value";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "architecture mismatch";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "execution failed";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "internal error";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "not supported";
    default: return "error";
    }
}

moeq_status mq_cublas_fail(cublasStatus_t e, const char *what, const char *file, int line) {
    return mq_err(e == CUBLAS_STATUS_ALLOC_FAILED ? MOEQ_E_NOMEM : MOEQ_E_DEVICE,
                  "cuBLAS: %s: %s (status %d, %s:%d)", what, cublas_name(e), (int)e, file, line);
}

moeq_status mq_cusolver_fail(cusolverStatus_t e, const char *what, const char *file, int line) {
    return mq_err(e == CUSOLVER_STATUS_ALLOC_FAILED ? MOEQ_E_NOMEM : MOEQ_E_DEVICE,
                  "cuSOLVER: %s: status %d (%s:%d)", what, (int)e, file, line);
}

/* ---- the device memory moeq holds, and its bound (mq_gpu_set_memory_limit) --------------------
 * Every allocation of the backend goes through mq_cu_alloc (cudaMalloc) or mq_cu_alloc_async (the
 * stream-ordered pool), which count it per device: in use, the pool's reserve (what it keeps of
 * freed blocks for the next call), their peak. With a bound, an allocation that would take the
 * sum over it first gives the pool's reserve back, then fails as out of memory naming the bound,
 * and mq_gpu_get_info's free memory is what is left under it, so every size the backend and the
 * pipeline choose from it (GPTQ's waves, expert batches, lanes) stays within. The CUDA context and
 * the libraries' own workspaces (cuBLAS, cuSOLVER's are ours) are not counted. */
namespace {
enum { MEM_DEVICES = 64 };
struct mem_acct {
    std::mutex mu;
    std::unordered_map<void *, size_t> sync_live, pool_live;
    size_t sync_used = 0, pool_used = 0, peak = 0, limit = 0;
};
mem_acct g_mem[MEM_DEVICES];

mem_acct *acct_of_current(int *dev_out) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= MEM_DEVICES) {
        (void)cudaGetLastError();
        return NULL;
    }
    if (dev_out) *dev_out = dev;
    return &g_mem[dev];
}

/* The pool's reserve on device dev: at least what is in use from it. */
size_t pool_reserved(int dev, size_t pool_used) {
    cudaMemPool_t pool;
    uint64_t res = 0;
    if (cudaDeviceGetDefaultMemPool(&pool, dev) != cudaSuccess ||
        cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &res) != cudaSuccess) {
        (void)cudaGetLastError();
        return pool_used;
    }
    return (size_t)res > pool_used ? (size_t)res : pool_used;
}

void pool_trim(int dev, size_t keep) {
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess) {
        cudaDeviceSynchronize();
        cudaMemPoolTrimTo(pool, keep);
    }
    (void)cudaGetLastError();
}

/* Whether `bytes` more fit under the bound (taken under a's lock); the pool's reserve is given
 * back first where that makes room. */
bool fits_bound(mem_acct *a, int dev, size_t bytes, bool from_pool) {
    if (!a->limit) return true;
    const size_t used = a->sync_used + a->pool_used;
    if (used + bytes > a->limit) return false;
    const size_t res = pool_reserved(dev, a->pool_used);
    /* a pool allocation may come out of the reserve; a plain one needs room beside it */
    const size_t need = from_pool ? (res > a->pool_used + bytes ? res : a->pool_used + bytes) : res + bytes;
    if (a->sync_used + need <= a->limit) return true;
    pool_trim(dev, 0);
    return true;   /* the reserve beyond what is in use is back: used + bytes <= limit */
}

void note_peak(mem_acct *a, int dev) {
    const size_t now = a->sync_used + pool_reserved(dev, a->pool_used);
    if (now > a->peak) a->peak = now;
}

moeq_status over_bound(const mem_acct *a, size_t bytes, const char *what) {
    return mq_err(MOEQ_E_NOMEM, "GPU: %s: %.3f GB more would exceed the GPU memory bound of %.3f GB "
                  "(--max-gpu-memory; %.3f GB in use)", what, (double)bytes / 1e9, (double)a->limit / 1e9,
                  (double)(a->sync_used + a->pool_used) / 1e9);
}
}   // namespace

moeq_status mq_cu_alloc_async(void **p, size_t bytes, cudaStream_t s, const char *what) {
    *p = NULL;
    if (bytes == 0) bytes = 1;
    /* counted as the pool maps it: in whole 2 MiB pages, so that its reserve stays under the bound */
    const size_t counted = (bytes + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
    int dev = 0;
    mem_acct *a = acct_of_current(&dev);
    if (a) {
        std::lock_guard<std::mutex> lk(a->mu);
        if (!fits_bound(a, dev, counted, true)) return over_bound(a, counted, what);
    }
    cudaError_t e = cudaMallocAsync(p, bytes, s);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *p = NULL;
        return mq_err(e == cudaErrorMemoryAllocation ? MOEQ_E_NOMEM : MOEQ_E_DEVICE,
                      "GPU: %s: cannot allocate %.2f GB: %s", what, (double)bytes / 1e9, cudaGetErrorString(e));
    }
    if (a) {
        std::lock_guard<std::mutex> lk(a->mu);
        a->pool_live[*p] = counted;
        a->pool_used += counted;
        note_peak(a, dev);
    }
    return MOEQ_OK;
}

void mq_cu_free_async(void *p, cudaStream_t s) {
    if (!p) return;
    cudaFreeAsync(p, s);
    int dev = 0;
    mem_acct *a = acct_of_current(&dev);
    if (!a) return;
    std::lock_guard<std::mutex> lk(a->mu);
    auto it = a->pool_live.find(p);
    if (it == a->pool_live.end()) return;
    a->pool_used -= it->second;
    a->pool_live.erase(it);
}

size_t mq_cu_mem_free(mq_gpu *g) {
    size_t free_b = 0, total_b = 0;
    if (cudaSetDevice(g->device) != cudaSuccess || cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    if (g->device < 0 || g->device >= MEM_DEVICES) return free_b;
    mem_acct *a = &g_mem[g->device];
    std::lock_guard<std::mutex> lk(a->mu);
    /* what the pool keeps from earlier calls is free for the next ones too */
    free_b += pool_reserved(g->device, a->pool_used) - a->pool_used;
    if (a->limit) {
        const size_t used = a->sync_used + a->pool_used, left = used < a->limit ? a->limit - used : 0;
        if (left < free_b) free_b = left;
    }
    const int64_t reserve = __atomic_load_n(&g->sizing_reserve, __ATOMIC_RELAXED);
    const size_t keep = reserve > 0 ? (size_t)reserve : 0;
    return free_b > keep ? free_b - keep : 0;
}

extern "C" void mq_gpu_set_sizing_reserve(mq_gpu *g, int64_t bytes) {
    if (g) __atomic_store_n(&g->sizing_reserve, bytes > 0 ? bytes : 0, __ATOMIC_RELAXED);
}

extern "C" void mq_gpu_set_memory_limit(mq_gpu *g, int64_t bytes) {
    if (!g || g->device < 0 || g->device >= MEM_DEVICES) return;
    mem_acct *a = &g_mem[g->device];
    std::lock_guard<std::mutex> lk(a->mu);
    a->limit = bytes > 0 ? (size_t)bytes : 0;
}

extern "C" void mq_gpu_memory(mq_gpu *g, int64_t *used, int64_t *peak, int64_t *limit) {
    int64_t u = 0, pk = 0, l = 0;
    if (g && g->device >= 0 && g->device < MEM_DEVICES && cudaSetDevice(g->device) == cudaSuccess) {
        mem_acct *a = &g_mem[g->device];
        std::lock_guard<std::mutex> lk(a->mu);
        u = (int64_t)(a->sync_used + pool_reserved(g->device, a->pool_used));
        pk = (int64_t)a->peak;
        l = (int64_t)a->limit;
    }
    if (used) *used = u;
    if (peak) *peak = pk;
    if (limit) *limit = l;
}

extern "C" void mq_gpu_memory_reset_peak(mq_gpu *g) {
    if (!g || g->device < 0 || g->device >= MEM_DEVICES || cudaSetDevice(g->device) != cudaSuccess) return;
    mem_acct *a = &g_mem[g->device];
    std::lock_guard<std::mutex> lk(a->mu);
    a->peak = a->sync_used + pool_reserved(g->device, a->pool_used);
}

moeq_status mq_cu_alloc(void **p, size_t bytes, const char *what) {
    *p = NULL;
    if (bytes == 0) bytes = 1;
    int dev = 0;
    mem_acct *a = acct_of_current(&dev);
    if (a) {
        std::lock_guard<std::mutex> lk(a->mu);
        if (!fits_bound(a, dev, bytes, false)) return over_bound(a, bytes, what);
    }
    cudaError_t e = cudaMalloc(p, bytes);
    if (e == cudaErrorMemoryAllocation) {
        /* the stream-ordered pool of the GPTQ calls keeps what they freed: give it back, retry */
        (void)cudaGetLastError();
        int dev = 0;
        cudaMemPool_t pool;
        if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess) {
            cudaDeviceSynchronize();
            cudaMemPoolTrimTo(pool, 0);
        }
        e = cudaMalloc(p, bytes);
    }
    if (e == cudaSuccess) {
        if (a) {
            std::lock_guard<std::mutex> lk(a->mu);
            a->sync_live[*p] = bytes;
            a->sync_used += bytes;
            note_peak(a, dev);
        }
        return MOEQ_OK;
    }
    (void)cudaGetLastError();   /* clear the sticky-free allocation error */
    *p = NULL;
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    return mq_err(e == cudaErrorMemoryAllocation ? MOEQ_E_NOMEM : MOEQ_E_DEVICE,
                  "GPU: %s: cannot allocate %.2f GB (%.2f GB free of %.2f GB): %s", what,
                  (double)bytes / 1e9, (double)free_b / 1e9, (double)total_b / 1e9,
                  cudaGetErrorString(e));
}

void mq_cu_free(void *p) {
    if (!p) return;
    cudaFree(p);
    /* the device the pointer is on: the accounts are few, a pointer is in one */
    for (int d = 0; d < MEM_DEVICES; d++) {
        mem_acct *a = &g_mem[d];
        std::lock_guard<std::mutex> lk(a->mu);
        auto it = a->sync_live.find(p);
        if (it == a->sync_live.end()) continue;
        a->sync_used -= it->second;
        a->sync_live.erase(it);
        return;
    }
}

extern "C" moeq_status mq_gpu_probe(int device) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        return mq_err(MOEQ_E_UNSUPPORTED, "cuda:%d: no CUDA device (%s)", device,
                      e != cudaSuccess ? cudaGetErrorString(e) : "the driver reports none");
    }
    if (device < 0 || device >= n)
        return mq_err(MOEQ_E_UNSUPPORTED, "cuda:%d: this machine has %d CUDA device%s (cuda:0%s)",
                      device, n, n == 1 ? "" : "s", n == 1 ? "" : " ..");
    return MOEQ_OK;
}

extern "C" moeq_status mq_gpu_open(int device, mq_gpu **out) {
    *out = NULL;
    moeq_status pst = mq_gpu_probe(device);
    if (pst) return pst;
    mq_gpu *g = (mq_gpu *)calloc(1, sizeof *g);
    if (!g) return mq_err(MOEQ_E_NOMEM, "out of memory");
    g->device = device;
    moeq_status st = CU(cudaSetDevice(device));
    cudaDeviceProp prop;
    if (!st) st = CU(cudaGetDeviceProperties(&prop, device));
    if (!st) {
        g->info.device = device;
        snprintf(g->info.name, sizeof g->info.name, "%.95s", prop.name);
        g->info.cc_major = prop.major;
        g->info.cc_minor = prop.minor;
        g->info.sm_count = prop.multiProcessorCount;
    }
    for (int i = 0; i < MQ_GPU_STREAMS && !st; i++) {
        st = CU(cudaStreamCreateWithFlags(&g->stream[i], cudaStreamNonBlocking));
        if (!st) st = CUBLAS(cublasCreate(&g->blas[i]));
        if (!st) st = CUBLAS(cublasSetStream(g->blas[i], g->stream[i]));
        /* fp32 products: the default math mode never takes the TF32 tensor-core path */
        if (!st) st = CUBLAS(cublasSetMathMode(g->blas[i], CUBLAS_DEFAULT_MATH));
        if (!st) st = CUSOLVER(cusolverDnCreate(&g->solver[i]));
        if (!st) st = CUSOLVER(cusolverDnSetStream(g->solver[i], g->stream[i]));
    }
    for (int i = 0; i < 2 && !st; i++) st = CU(cudaEventCreateWithFlags(&g->ev[i], cudaEventDisableTiming));
    if (!st) st = CU(cudaStreamCreateWithFlags(&g->copy, cudaStreamNonBlocking));
    if (!st) {
        /* GPTQ's per-call arenas come from the stream-ordered pool, which keeps freed memory for
         * the next call (mq_cu_alloc trims it when a plain allocation needs the room) */
        cudaMemPool_t pool;
        uint64_t keep = UINT64_MAX;
        st = CU(cudaDeviceGetDefaultMemPool(&pool, device));
        if (!st) st = CU(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    }
    if (st) {
        mq_gpu_close(g);
        return st;
    }
    *out = g;
    return MOEQ_OK;
}

extern "C" void mq_gpu_close(mq_gpu *g) {
    if (!g) return;
    cudaSetDevice(g->device);
    cudaDeviceSynchronize();
    for (int i = 0; i < MQ_GPU_STREAMS; i++) {
        mq_cu_free(g->ws[i]);
        if (g->solver[i]) cusolverDnDestroy(g->solver[i]);
        if (g->blas[i]) cublasDestroy(g->blas[i]);
        if (g->stream[i]) cudaStreamDestroy(g->stream[i]);
    }
    for (int i = 0; i < 2; i++)
        if (g->ev[i]) cudaEventDestroy(g->ev[i]);
    if (g->copy) cudaStreamDestroy(g->copy);
    if (g->pin) cudaFreeHost(g->pin);
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, g->device) == cudaSuccess) cudaMemPoolTrimTo(pool, 0);
    mq_gpu_set_memory_limit(g, 0);   /* the bound is this handle's */
    free(g);
}

extern "C" void mq_gpu_get_info(mq_gpu *g, mq_gpu_info *info) {
    *info = g->info;
    size_t free_b = 0, total_b = 0;
    cudaSetDevice(g->device);
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
        const int64_t keep = __atomic_load_n(&g->sizing_reserve, __ATOMIC_RELAXED);
        info->mem_free = (int64_t)free_b > keep ? (int64_t)free_b - keep : 0;
        info->mem_total = (int64_t)total_b;
    }
    /* under a bound: what is left under it, and the bound as the card's size */
    int64_t used = 0, peak = 0, limit = 0;
    mq_gpu_memory(g, &used, &peak, &limit);
    if (limit > 0) {
        const int64_t left = (int64_t)mq_cu_mem_free(g);
        info->mem_free = left < info->mem_free ? left : info->mem_free;
        info->mem_total = limit < info->mem_total ? limit : info->mem_total;
    }
}

extern "C" void *mq_gpu_host_alloc(mq_gpu *g, size_t bytes) {
    void *p = NULL;
    if (!g || cudaSetDevice(g->device) != cudaSuccess) return NULL;
    if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();   /* not sticky: the caller falls back to pageable memory */
        return NULL;
    }
    return p;
}

extern "C" void mq_gpu_host_free(void *p) {
    if (p) cudaFreeHost(p);
}

extern "C" bool mq_gpu_host_register(mq_gpu *g, void *p, size_t bytes) {
    if (!g || !p || !bytes || cudaSetDevice(g->device) != cudaSuccess) return false;
    if (cudaHostRegister(p, bytes, cudaHostRegisterPortable) != cudaSuccess) {
        cudaGetLastError();   /* not sticky: the memory stays pageable */
        return false;
    }
    return true;
}

extern "C" void mq_gpu_host_unregister(void *p) {
    if (p) cudaHostUnregister(p);
}

extern "C" moeq_status mq_gpu_sync(mq_gpu *g) {
    moeq_status st = CU(cudaSetDevice(g->device));
    if (!st) st = CU(cudaDeviceSynchronize());
    return st;
}

extern "C" void mq_gpu_force_det_tile(mq_gpu *g, int tile) { g->det_tile = tile; }

extern "C" moeq_status mq_gpu_set_precision(mq_gpu *g, moeq_gpu_precision p) {
    /* the handles' math mode serves the calls made straight to cuBLAS (the attention's scores,
     * GPTQ's updates): TF32 only in the tf32 mode; tf32x3 asks for it per call */
    moeq_status st = CU(cudaSetDevice(g->device));
    for (int i = 0; i < MQ_GPU_STREAMS && !st; i++)
        st = CUBLAS(cublasSetMathMode(g->blas[i], p == MOEQ_GPU_TF32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    if (!st) g->precision = p;
    return st;
}

namespace {
/* The TF32 value nearest x (ties to even: 10 of the 23 mantissa bits kept), so that the tensor
 * cores, which may truncate, take it exactly. Infinities and NaN pass; a value that would round
 * past the largest finite one is truncated instead. */
__device__ inline float tf32_nearest(float x) {
    const uint32_t u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return x;
    uint32_t r = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
    if ((r & 0x7f800000u) == 0x7f800000u) r = u & 0xffffe000u;
    return __uint_as_float(r);
}

/* x = hi + lo + r: hi = tf32(x), lo = tf32(x - hi) (x - hi is exact), |r| <= 2^-22 |x|. */
__global__ void k_tf32_split(const float *__restrict__ x, int64_t n, float *__restrict__ hi, float *__restrict__ lo) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float v = x[i], h = tf32_nearest(v);
        hi[i] = h;
        lo[i] = tf32_nearest(v - h);
    }
}

moeq_status tf32_split(cudaStream_t s, const float *x, int64_t n, float *hi, float *lo) {
    const int64_t blocks = (n + 255) / 256;
    k_tf32_split<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, s>>>(x, n, hi, lo);
    return CU_LAUNCHED("k_tf32_split");
}

/* Column-major C [m, n] (ldc) = op(A) op(B) + beta C on TF32 tensor cores, asked for by this
 * call's compute type (the handle's math mode stays fp32). */
moeq_status tf32_gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
                      const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    const float one = 1.0f;
    return CUBLAS(cublasGemmEx(h, ta, tb, (int)m, (int)n, (int)k, &one, A, CUDA_R_32F, (int)lda, B, CUDA_R_32F,
                               (int)ldb, &beta, C, CUDA_R_32F, (int)ldc, CUBLAS_COMPUTE_32F_FAST_TF32,
                               CUBLAS_GEMM_DEFAULT));
}

/* tf32x3 splits its inputs in blocks of at most this many floats per half (32 MB): the scratch
 * a call takes from the stream-ordered pool stays small whatever the rows. */
constexpr int64_t SPLIT_BLOCK = (int64_t)1 << 23;
}   // namespace

/* tf32x3: C = A B^T from three TF32 products per block, the small terms first, each added in fp32:
 * lo(A) hi(B) + hi(A) lo(B) + hi(A) hi(B). The blocks are a function of the shapes alone. */
static moeq_status product_tf32x3(mq_gpu *g, int j, int64_t M, int64_t N, int64_t K, const float *A, const float *B,
                                  float *C, int64_t ldc) {
    const int64_t rb = SPLIT_BLOCK / K > 0 ? SPLIT_BLOCK / K : 1, am = M < rb ? M : rb, bn = N < rb ? N : rb;
    cudaStream_t s = g->stream[j];
    cublasHandle_t h = g->blas[j];
    float *buf = NULL;
    moeq_status st = mq_cu_alloc_async((void **)&buf, (size_t)(2 * (am + bn) * K) * sizeof(float), s, "tf32x3 halves");
    if (st) return st;
    float *ah = buf, *al = ah + am * K, *bh = al + am * K, *bl = bh + bn * K;
    for (int64_t n0 = 0; n0 < N && !st; n0 += bn) {
        const int64_t nn = N - n0 < bn ? N - n0 : bn;
        st = tf32_split(s, B + n0 * K, nn * K, bh, bl);
        for (int64_t m0 = 0; m0 < M && !st; m0 += am) {
            const int64_t mm = M - m0 < am ? M - m0 : am;
            float *c = C + m0 * ldc + n0;
            /* column-major: C^T [nn, mm] = B-block^T-view [nn, K] times A-block^T-view [K, mm] */
            if (!st) st = tf32_split(s, A + m0 * K, mm * K, ah, al);
            if (!st) st = tf32_gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, nn, mm, K, bh, K, al, K, 0.0f, c, ldc);
            if (!st) st = tf32_gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, nn, mm, K, bl, K, ah, K, 1.0f, c, ldc);
            if (!st) st = tf32_gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, nn, mm, K, bh, K, ah, K, 1.0f, c, ldc);
        }
    }
    mq_cu_free_async(buf, s);
    return st;
}

/* tf32x3: C += X^T X in blocks of rows, each as lo^T hi + hi^T lo + hi^T hi. */
static moeq_status gram_tf32x3(mq_gpu *g, int j, float *C, const float *X, int64_t n, int64_t K) {
    const int64_t rb = SPLIT_BLOCK / K > 0 ? SPLIT_BLOCK / K : 1, bm = n < rb ? n : rb;
    cudaStream_t s = g->stream[j];
    cublasHandle_t h = g->blas[j];
    float *buf = NULL;
    moeq_status st = mq_cu_alloc_async((void **)&buf, (size_t)(2 * bm * K) * sizeof(float), s, "tf32x3 halves");
    if (st) return st;
    float *xh = buf, *xl = xh + bm * K;
    for (int64_t r0 = 0; r0 < n && !st; r0 += bm) {
        const int64_t rows = n - r0 < bm ? n - r0 : bm;
        /* column-major: C [K, K] += X-block^T-view [K, rows] times its transpose */
        st = tf32_split(s, X + r0 * K, rows * K, xh, xl);
        if (!st) st = tf32_gemm(h, CUBLAS_OP_N, CUBLAS_OP_T, K, K, rows, xl, K, xh, K, 1.0f, C, K);
        if (!st) st = tf32_gemm(h, CUBLAS_OP_N, CUBLAS_OP_T, K, K, rows, xh, K, xl, K, 1.0f, C, K);
        if (!st) st = tf32_gemm(h, CUBLAS_OP_N, CUBLAS_OP_T, K, K, rows, xh, K, xh, K, 1.0f, C, K);
    }
    mq_cu_free_async(buf, s);
    return st;
}

moeq_status mq_cu_product_det(const mq_gpu *g, cudaStream_t s, int64_t M, int64_t N, int64_t K, const float *A,
                              const float *B, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return MOEQ_OK;
    mqd::det_launch<false>(s, mqd::det_tile(false, M, N, g->info.sm_count, g->det_tile), M, N, K, K, A, B, C, ldc);
    return CU_LAUNCHED("k_det (product)");
}

moeq_status mq_cu_product(mq_gpu *g, int j, int64_t M, int64_t N, int64_t K, const float *A, const float *B,
                          float *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return MOEQ_OK;
    if (g->precision == MOEQ_GPU_FP32) return mq_cu_product_det(g, g->stream[j], M, N, K, A, B, C, ldc);
    if (g->precision == MOEQ_GPU_TF32X3) return product_tf32x3(g, j, M, N, K, A, B, C, ldc);
    const float one = 1.0f, zero = 0.0f;
    const mq_cu_sgemm_ops o = mq_cu_product_ops(M, N, K, A, B, C, ldc);
    return CUBLAS(cublasSgemm(g->blas[j], o.ta, o.tb, o.m, o.n, o.k, &one, o.A, o.lda, o.B, o.ldb, &zero, o.C, o.ldc));
}

moeq_status mq_cu_gram_add(mq_gpu *g, cudaStream_t s, float *C, const float *X, int64_t n, int64_t K) {
    if (n <= 0) return MOEQ_OK;
    if (g->precision == MOEQ_GPU_FP32) {
        mqd::det_launch<true>(s, mqd::det_tile(true, K, K, g->info.sm_count, g->det_tile), K, K, n, K, X, X, C, K);
        return CU_LAUNCHED("k_det (syrk)");
    }
    int j = 0;   /* the handle of stream s */
    while (j < MQ_GPU_STREAMS - 1 && g->stream[j] != s) j++;
    if (g->stream[j] != s) return mq_err(MOEQ_E_ARG, "GPU Hessian update on a stream of no handle");
    if (g->precision == MOEQ_GPU_TF32X3) return gram_tf32x3(g, j, C, X, n, K);
    /* column-major: C [K, K] += X^T-view [K, n] times its transpose (C is symmetric) */
    const float one = 1.0f;
    return CUBLAS(cublasSgemm(g->blas[j], CUBLAS_OP_N, CUBLAS_OP_T, (int)K, (int)K, (int)n, &one, X, (int)K, X, (int)K,
                              &one, C, (int)K));
}

extern "C" moeq_status mq_gpu_measure(mq_gpu *g, double *sgemm_gflops, double *bandwidth_gbs) {
    /* sgemm: n = 8192 fp32 in the current math mode, the median of 5 after a warm-up; bandwidth:
     * a 2 GB device-to-device copy, bytes read plus written */
    const int n = 8192;
    const size_t nn = (size_t)n * n, copy_b = (size_t)1 << 30;
    float *a = NULL, *b = NULL, *c = NULL;
    void *x = NULL, *y = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    double t[5];
    const float one = 1.0f, zero = 0.0f;
    cudaStream_t s = g->stream[0];
    moeq_status st = CU(cudaSetDevice(g->device));
    if (!st) st = cu_alloc(&a, nn, "sgemm benchmark");
    if (!st) st = cu_alloc(&b, nn, "sgemm benchmark");
    if (!st) st = cu_alloc(&c, nn, "sgemm benchmark");
    if (!st) st = mq_cu_alloc(&x, copy_b, "bandwidth benchmark");
    if (!st) st = mq_cu_alloc(&y, copy_b, "bandwidth benchmark");
    if (!st) st = CU(cudaMemsetAsync(a, 0, nn * 4, s));
    if (!st) st = CU(cudaMemsetAsync(b, 0, nn * 4, s));
    if (!st) st = CU(cudaMemsetAsync(x, 1, copy_b, s));
    if (!st) st = CU(cudaEventCreate(&e0));
    if (!st) st = CU(cudaEventCreate(&e1));
    for (int phase = 0; phase < 2 && !st; phase++) {
        for (int r = -1; r < 5 && !st; r++) {
            st = CU(cudaEventRecord(e0, s));
            if (!st && phase == 0)
                st = CUBLAS(cublasSgemm(g->blas[0], CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, n, b, n, &zero, c, n));
            if (!st && phase == 1) st = CU(cudaMemcpyAsync(y, x, copy_b, cudaMemcpyDeviceToDevice, s));
            if (!st) st = CU(cudaEventRecord(e1, s));
            if (!st) st = CU(cudaEventSynchronize(e1));
            float ms = 0;
            if (!st) st = CU(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 0) t[r] = ms * 1e-3;
        }
        if (st) break;
        for (int i = 1; i < 5; i++)   /* median of 5 */
            for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
                double v = t[j];
                t[j] = t[j - 1];
                t[j - 1] = v;
            }
        if (phase == 0) *sgemm_gflops = 2.0 * n * (double)n * n / t[2] * 1e-9;
        else *bandwidth_gbs = 2.0 * (double)copy_b / t[2] * 1e-9;
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    mq_cu_free(a);
    mq_cu_free(b);
    mq_cu_free(c);
    mq_cu_free(x);
    mq_cu_free(y);
    return st;
}

enum { PIN_PIECE = 64 << 20, PIN_DIRECT = 1 << 20 };

moeq_status mq_cu_stage_upload(mq_cu_stage *st, cudaStream_t s, void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return MOEQ_OK;
    const int k = st->next;
    moeq_status r = MOEQ_OK;
    if (st->pending[k]) {   /* its last copy has left */
        r = CU(cudaEventSynchronize(st->done[k]));
        st->pending[k] = false;
        if (r) return r;
    }
    if (!st->done[k] && (r = CU(cudaEventCreateWithFlags(&st->done[k], cudaEventDisableTiming)))) return r;
    if (bytes > st->cap[k]) {   /* a quarter more than asked: batches of a pass differ a little */
        if (st->buf[k]) cudaFreeHost(st->buf[k]);
        st->buf[k] = NULL;
        st->cap[k] = 0;
        const size_t cap = bytes + bytes / 4;
        if ((r = CU(cudaMallocHost(&st->buf[k], cap)))) return r;
        st->cap[k] = cap;
    }
    memcpy(st->buf[k], src, bytes);
    r = CU(cudaMemcpyAsync(dst, st->buf[k], bytes, cudaMemcpyHostToDevice, s));
    if (!r) r = CU(cudaEventRecord(st->done[k], s));
    st->pending[k] = !r;
    st->next = k ^ 1;
    return r;
}

void mq_cu_stage_free(mq_cu_stage *st) {
    for (int k = 0; k < 2; k++) {
        if (st->pending[k]) cudaEventSynchronize(st->done[k]);
        if (st->done[k]) cudaEventDestroy(st->done[k]);
        if (st->buf[k]) cudaFreeHost(st->buf[k]);
    }
    memset(st, 0, sizeof *st);
}

moeq_status mq_cu_pinned(mq_gpu *g, size_t *piece) {
    *piece = PIN_PIECE;
    if (g->pin_cap >= 2 * (size_t)PIN_PIECE) return MOEQ_OK;
    if (g->pin) cudaFreeHost(g->pin);
    g->pin = NULL;
    g->pin_cap = 0;
    moeq_status st = CU(cudaMallocHost(&g->pin, 2 * (size_t)PIN_PIECE));
    if (!st) g->pin_cap = 2 * (size_t)PIN_PIECE;
    return st;
}

namespace {
struct copy_job {
    char *dst;
    const char *src;
    size_t n, per;
};
void copy_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    const copy_job *c = (const copy_job *)ctx;
    const size_t a = (size_t)t * c->per, b = a + c->per < c->n ? a + c->per : c->n;
    memcpy(c->dst + a, c->src + a, b - a);
}
}  // namespace

namespace {
struct upload_piece {
    char *dst;                    /* on the device */
    const char *src;              /* on the host */
    size_t at, n;                 /* its place in the pinned half, its bytes */
};
struct upload_fill {
    char *half;
    const upload_piece *piece;
    int64_t n_pieces;
};
enum { FILL_TASK = 1 << 20 };
/* task t: bytes [t MB, (t + 1) MB) of the half, from whichever pieces hold them */
void fill_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    const upload_fill *f = (const upload_fill *)ctx;
    const size_t a = (size_t)t * FILL_TASK, b = a + FILL_TASK;
    for (int64_t i = 0; i < f->n_pieces; i++) {
        const upload_piece *p = &f->piece[i];
        const size_t lo = a > p->at ? a : p->at, hi = b < p->at + p->n ? b : p->at + p->n;
        if (lo < hi) memcpy(f->half + lo, p->src + (lo - p->at), hi - lo);
    }
}
}  // namespace

moeq_status mq_cu_upload_many(mq_gpu *g, int64_t n, void *const *dst, const void *const *src, const size_t *bytes) {
    cudaStream_t s = g->copy;
    size_t piece = 0;
    moeq_status st = mq_cu_pinned(g, &piece);
    if (st) return st;
    char *half[2] = {(char *)g->pin, (char *)g->pin + piece};
    bool busy[2] = {false, false};
    std::vector<upload_piece> pieces;
    int k = 0;
    size_t fill = 0;
    auto flush = [&]() -> moeq_status {
        if (pieces.empty()) return MOEQ_OK;
        if (busy[k]) {   /* its last pieces have left */
            moeq_status w = CU(cudaEventSynchronize(g->ev[k]));
            if (w) return w;
        }
        upload_fill f = {half[k], pieces.data(), (int64_t)pieces.size()};
        mq_parallel_for((int64_t)((fill + FILL_TASK - 1) / FILL_TASK), fill_task, &f);
        for (const upload_piece &p : pieces) {
            moeq_status c = CU(cudaMemcpyAsync(p.dst, half[k] + p.at, p.n, cudaMemcpyHostToDevice, s));
            if (c) return c;
        }
        moeq_status r = CU(cudaEventRecord(g->ev[k], s));
        busy[k] = true;
        k ^= 1;
        fill = 0;
        pieces.clear();
        return r;
    };
    try {
        for (int64_t i = 0; i < n && !st; i++)
            for (size_t off = 0; off < bytes[i] && !st;) {
                const size_t take = bytes[i] - off < piece - fill ? bytes[i] - off : piece - fill;
                pieces.push_back({(char *)dst[i] + off, (const char *)src[i] + off, fill, take});
                fill += take;
                off += take;
                if (fill == piece) st = flush();
            }
    } catch (const std::bad_alloc &) {
        st = mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    if (!st) st = flush();
    /* the pinned halves are reused by the next upload or download: wait until both are free */
    for (int i = 0; i < 2; i++) {
        moeq_status w = busy[i] ? CU(cudaEventSynchronize(g->ev[i])) : MOEQ_OK;
        if (!st) st = w;
    }
    return st;
}

moeq_status mq_cu_upload(mq_gpu *g, void *dst, const void *src, size_t bytes) {
    cudaStream_t s = g->stream[0];
    if (bytes <= PIN_DIRECT) return CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
    size_t piece = 0;
    moeq_status st = mq_cu_pinned(g, &piece);
    if (st) return st;
    char *half[2] = {(char *)g->pin, (char *)g->pin + piece};
    bool busy[2] = {false, false};
    for (size_t off = 0, k = 0; off < bytes && !st; off += piece, k++) {
        const size_t n = bytes - off < piece ? bytes - off : piece;
        char *h = half[k % 2];
        if (busy[k % 2] && (st = CU(cudaEventSynchronize(g->ev[k % 2])))) break;   /* its last piece has left */
        copy_job c = {h, (const char *)src + off, n, (size_t)4 << 20};
        mq_parallel_for((int64_t)((n + c.per - 1) / c.per), copy_task, &c);
        if ((st = CU(cudaMemcpyAsync((char *)dst + off, h, n, cudaMemcpyHostToDevice, s)))) break;
        if ((st = CU(cudaEventRecord(g->ev[k % 2], s)))) break;
        busy[k % 2] = true;
    }
    /* the pinned halves are reused by the next upload or download: wait until both are free */
    for (int i = 0; i < 2 && !st; i++)
        if (busy[i]) st = CU(cudaEventSynchronize(g->ev[i]));
    return st;
}
