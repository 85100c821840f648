/*
 * Hessian sums on the GPU, bit-identical to the CPU's (quant/hessian.h, kernels/gemm_det.h):
 * every element of the lower triangle is one fmaf chain over the rows in order, continued
 * across calls, so neither the tiling here nor how the rows arrive changes a bit. (In the TF32
 * modes, mq_gpu_set_precision, the updates are cuBLAS GEMMs on tensor cores instead: mq_cu_gram_add.)
 *
 * The update is mq_cu_gram_add: tile_det.cuh's k_det (SYRK), tiles above the diagonal exiting at once.
 */
#include <string.h>

#include <vector>

#include "backend/cuda/cuda_internal.cuh"

namespace {

enum { STAGE_FLOATS = 16 << 20 };

/* H = scale * sum, both triangles (mq_hessian_get). */
__global__ void k_hessian_form(float *H, const float *sum, int64_t K, float scale) {
    const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t a = (int64_t)blockIdx.y * blockDim.y + threadIdx.y;
    if (a >= K || b >= K) return;
    H[a * K + b] = b <= a ? scale * sum[a * K + b] : scale * sum[b * K + a];
}

}  // namespace

struct mq_gpu_hessians {
    mq_gpu *g;
    std::vector<int64_t> K, n;
    std::vector<float *> sum;
    float *stage;
    int64_t stage_floats;   /* its size: the first call's rows, at most STAGE_FLOATS */
};

extern "C" moeq_status mq_gpu_hessians_new(mq_gpu *g, int64_t n, const int64_t *K, mq_gpu_hessians **out) {
    *out = NULL;
    moeq_status st = CU(cudaSetDevice(g->device));
    if (st) return st;
    mq_gpu_hessians *hs = new (std::nothrow) mq_gpu_hessians;
    if (!hs) return mq_err(MOEQ_E_NOMEM, "out of memory");
    hs->g = g;
    hs->stage = NULL;
    hs->stage_floats = 0;
    hs->K.assign(K, K + n);
    hs->n.assign((size_t)n, 0);
    hs->sum.assign((size_t)n, NULL);
    for (int64_t i = 0; i < n && !st; i++) {
        if (K[i] <= 0) {
            st = mq_err(MOEQ_E_SHAPE, "GPU Hessian %lld: size %lld", (long long)i, (long long)K[i]);
            break;
        }
        st = cu_alloc(&hs->sum[i], (size_t)(K[i] * K[i]), "Hessian sum");
        if (!st) st = CU(cudaMemsetAsync(hs->sum[i], 0, (size_t)(K[i] * K[i]) * sizeof(float), g->stream[0]));
    }
    if (st) {
        mq_gpu_hessians_free(hs);
        return st;
    }
    *out = hs;
    return MOEQ_OK;
}

extern "C" void mq_gpu_hessians_free(mq_gpu_hessians *hs) {
    if (!hs) return;
    cudaSetDevice(hs->g->device);
    cudaStreamSynchronize(hs->g->stream[0]);
    for (float *p : hs->sum) mq_cu_free(p);
    mq_cu_free(hs->stage);
    delete hs;
}

extern "C" moeq_status mq_gpu_hessians_add(mq_gpu_hessians *hs, int64_t i, const float *x, int64_t rows) {
    if (i < 0 || i >= (int64_t)hs->K.size()) return mq_err(MOEQ_E_ARG, "GPU Hessian %lld of %zu", (long long)i, hs->K.size());
    if (rows <= 0) return MOEQ_OK;
    const int64_t K = hs->K[i];
    if (STAGE_FLOATS / K < 1) return mq_err(MOEQ_E_SHAPE, "GPU Hessian: rows of %lld values are too long", (long long)K);
    cudaStream_t s = hs->g->stream[0];
    moeq_status st = CU(cudaSetDevice(hs->g->device));
    /* the rows' staging area only when rows come from the host (most sums get theirs on the
     * device: the pipeline makes a layer's worth of these objects), as large as the first call's
     * rows need (a sample's, a few MB; not 64 MB per object under --max-gpu-memory) */
    if (!st && hs->stage && hs->stage_floats < K) {   /* a longer row than the stage was made for */
        st = CU(cudaStreamSynchronize(s));
        mq_cu_free(hs->stage);
        hs->stage = NULL;
    }
    if (!st && !hs->stage) {
        const int64_t want = rows < STAGE_FLOATS / K ? rows * K : STAGE_FLOATS / K * K;
        st = cu_alloc(&hs->stage, (size_t)want, "Hessian rows");
        if (!st) hs->stage_floats = want;
    }
    const int64_t per = hs->stage_floats / K > 0 ? hs->stage_floats / K : 1;
    for (int64_t r0 = 0; r0 < rows && !st; r0 += per) {
        const int64_t n = rows - r0 < per ? rows - r0 : per;
        /* the stage is reused: the previous chunk's kernel must be done reading it */
        st = mq_cu_upload(hs->g, hs->stage, x + r0 * K, (size_t)(n * K) * sizeof(float));
        if (!st) st = mq_cu_gram_add(hs->g, s, hs->sum[i], hs->stage, n, K);
    }
    if (!st) hs->n[i] += rows;
    return st;
}

moeq_status mq_gpu_hessians_add_device(mq_gpu_hessians *hs, int64_t i, const float *x, int64_t rows, cudaStream_t s) {
    if (i < 0 || i >= (int64_t)hs->K.size()) return mq_err(MOEQ_E_ARG, "GPU Hessian %lld of %zu", (long long)i, hs->K.size());
    if (rows <= 0) return MOEQ_OK;
    moeq_status st = mq_cu_gram_add(hs->g, s, hs->sum[i], x, rows, hs->K[i]);
    if (!st) hs->n[i] += rows;
    return st;
}

extern "C" moeq_status mq_gpu_hessians_get(mq_gpu_hessians *hs, int64_t i, float *H, int64_t *n) {
    if (i < 0 || i >= (int64_t)hs->K.size()) return mq_err(MOEQ_E_ARG, "GPU Hessian %lld of %zu", (long long)i, hs->K.size());
    const int64_t K = hs->K[i];
    cudaStream_t s = hs->g->stream[0];
    float *tmp = NULL;
    moeq_status st = CU(cudaSetDevice(hs->g->device));
    if (!st) st = cu_alloc(&tmp, (size_t)(K * K), "Hessian");
    if (!st) {
        const float scale = hs->n[i] > 0 ? 2.0f / (float)hs->n[i] : 0.0f;
        dim3 blk(32, 8);
        k_hessian_form<<<dim3((unsigned)((K + 31) / 32), (unsigned)((K + 7) / 8)), blk, 0, s>>>(tmp, hs->sum[i], K, scale);
        st = CU_LAUNCHED("k_hessian_form");
    }
    if (!st) st = CU(cudaMemcpyAsync(H, tmp, (size_t)(K * K) * sizeof(float), cudaMemcpyDeviceToHost, s));
    if (!st) st = CU(cudaStreamSynchronize(s));
    mq_cu_free(tmp);
    if (!st && n) *n = hs->n[i];
    return st;
}

extern "C" moeq_status mq_gpu_hessians_set(mq_gpu_hessians *hs, int64_t i, const float *sum, int64_t n) {
    if (i < 0 || i >= (int64_t)hs->K.size()) return mq_err(MOEQ_E_ARG, "GPU Hessian %lld of %zu", (long long)i, hs->K.size());
    if (n < 0) return mq_err(MOEQ_E_ARG, "GPU Hessian %lld: %lld rows", (long long)i, (long long)n);
    const int64_t K = hs->K[i];
    moeq_status st = CU(cudaSetDevice(hs->g->device));
    /* on stream 0, after the zeroing mq_gpu_hessians_new queued there and before the kernels that
     * read the sum: a plain cudaMemcpy goes on the legacy stream, which the non-blocking streams
     * do not wait for (and it may return before its last piece has landed) */
    cudaStream_t s = hs->g->stream[0];
    if (!st) st = CU(cudaMemcpyAsync(hs->sum[i], sum, (size_t)(K * K) * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st) st = CU(cudaStreamSynchronize(s));
    if (!st) hs->n[i] = n;
    return st;
}

const float *mq_gpu_hessians_sum(const mq_gpu_hessians *hs, int64_t i, int64_t *K, int64_t *n) {
    if (!hs || i < 0 || i >= (int64_t)hs->K.size()) return NULL;
    if (K) *K = hs->K[i];
    if (n) *n = hs->n[i];
    return hs->sum[i];
}
