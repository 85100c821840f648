/*
 * Round-to-nearest on the GPU and the codec twins: the device functions of quant_dev.cuh applied
 * to whole tensors. RTN is what the pipeline uses for fallback experts and --method rtn; the
 * codec entry point exists so that tests can check every device twin against the CPU's bit for
 * bit.
 */
#include <math.h>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/quant_dev.cuh"

namespace {

__global__ void k_codecs(const float *x, int64_t n, uint8_t *e2m1, uint8_t *e4m3, uint8_t *e8m0,
                         float *bf16, float *f16) {
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (int64_t)gridDim.x * blockDim.x) {
        const float v = x[k];
        e2m1[k] = mqd::e2m1_encode(v);
        e4m3[k] = mqd::e4m3_encode(v);
        e8m0[k] = mqd::e8m0_encode_ceil(v);
        bf16[k] = mqd::round_to_dtype(v, MOEQ_DT_BF16);
        f16[k] = mqd::round_to_dtype(v, MOEQ_DT_F16);
    }
}

/* One thread per (row, group): params, codes. */
__global__ void k_rtn(mq_qspec s, float gs, const float *w, int64_t rows, int64_t cols, int64_t G,
                      uint8_t *codes, mq_gparams *params) {
    const int64_t ng = cols / G;
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= rows * ng) return;
    const int64_t r = t / ng, g = t % ng;
    const float *x = w + r * cols + g * G;
    mq_gparams p;
    mqd::group_params_plain(s, gs, x, G, 1, p);
    params[t] = p;
    const float step = mqd::group_step(s, gs, p);
    for (int64_t c = 0; c < G; c++) codes[r * cols + g * G + c] = mqd::quant_step(s, step, p.zero, x[c]);
}

}  // namespace

extern "C" moeq_status mq_gpu_codecs(mq_gpu *g, const float *x, int64_t n, uint8_t *e2m1, uint8_t *e4m3,
                                     uint8_t *e8m0, float *bf16, float *f16) {
    moeq_status st;
    float *dx = NULL, *db = NULL, *dh = NULL;
    uint8_t *d2 = NULL, *d4 = NULL, *d8 = NULL;
    const size_t N = (size_t)n;
    if ((st = CU(cudaSetDevice(g->device))) || (st = cu_alloc(&dx, N, "codec inputs")) ||
        (st = cu_alloc(&db, N, "codec outputs")) || (st = cu_alloc(&dh, N, "codec outputs")) ||
        (st = cu_alloc(&d2, N, "codec outputs")) || (st = cu_alloc(&d4, N, "codec outputs")) ||
        (st = cu_alloc(&d8, N, "codec outputs")))
        goto out;
    if ((st = CU(cudaMemcpy(dx, x, N * 4, cudaMemcpyHostToDevice)))) goto out;
    k_codecs<<<1024, 256>>>(dx, n, d2, d4, d8, db, dh);
    if ((st = CU_LAUNCHED("k_codecs")) || (st = CU(cudaMemcpy(e2m1, d2, N, cudaMemcpyDeviceToHost))) ||
        (st = CU(cudaMemcpy(e4m3, d4, N, cudaMemcpyDeviceToHost))) ||
        (st = CU(cudaMemcpy(e8m0, d8, N, cudaMemcpyDeviceToHost))) ||
        (st = CU(cudaMemcpy(bf16, db, N * 4, cudaMemcpyDeviceToHost))) ||
        (st = CU(cudaMemcpy(f16, dh, N * 4, cudaMemcpyDeviceToHost))))
        goto out;
out:
    mq_cu_free(dx);
    mq_cu_free(db);
    mq_cu_free(dh);
    mq_cu_free(d2);
    mq_cu_free(d4);
    mq_cu_free(d8);
    return st;
}

extern "C" moeq_status mq_gpu_rtn(mq_gpu *g, const mq_qspec *s, const float *w, int64_t rows, int64_t cols,
                                  float global_scale, const char *tensor, mq_qtensor *out) {
    moeq_status st = mq_qtensor_init(out, s, rows, cols, tensor);
    if (st) return st;
    if ((st = mq_check_finite(w, rows, cols, tensor))) return st;
    if (s->scheme == MQ_QS_NVFP4)
        out->global_scale = global_scale > 0 ? global_scale : mq_nvfp4_global_scale(s, mq_absmax(w, rows * cols));
    const size_t n = (size_t)rows * (size_t)cols, np = (size_t)rows * (size_t)out->n_groups;
    float *dw = NULL;
    uint8_t *dc = NULL;
    mq_gparams *dp = NULL;
    const int64_t tasks = rows * out->n_groups;
    if ((st = CU(cudaSetDevice(g->device))) || (st = cu_alloc(&dw, n, tensor)) || (st = cu_alloc(&dc, n, tensor)) ||
        (st = cu_alloc(&dp, np, tensor)))
        goto out;
    if ((st = CU(cudaMemcpy(dw, w, n * 4, cudaMemcpyHostToDevice)))) goto out;
    k_rtn<<<(unsigned)((tasks + 127) / 128), 128>>>(*s, out->global_scale, dw, rows, cols, out->group_size, dc, dp);
    if ((st = CU_LAUNCHED("k_rtn")) || (st = CU(cudaMemcpy(out->codes, dc, n, cudaMemcpyDeviceToHost))) ||
        (st = CU(cudaMemcpy(out->params, dp, np * sizeof(mq_gparams), cudaMemcpyDeviceToHost))))
        goto out;
out:
    mq_cu_free(dw);
    mq_cu_free(dc);
    mq_cu_free(dp);
    if (st) mq_qtensor_free(out);
    return st;
}
