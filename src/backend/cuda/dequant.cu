/*
 * A quantized weight decoded on the device (backend/gpu.h, mq_gpu_kvattn_set_quantized): only its
 * codes (a byte each, as mq_qtensor holds them) and group parameters cross the bus, and each value
 * is quant_dev.cuh's dequant_step(group_step(...)), the device twins of formats' mq_dequant_value:
 * the same fp32 operations, so the result is mq_dequantize's (what the loader gives the CPU), bit
 * for bit. NVFP4, INT4 (symmetric or asymmetric, act-order g_idx too) and MXFP4; K-quants stay the
 * host's (MOEQ_E_UNSUPPORTED).
 */
#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/quant_dev.cuh"

namespace {

/* w [rows, cols] from codes [rows, cols], params [rows, ng] and the column's group. */
__global__ void k_dequant(float *w, const uint8_t *codes, const mq_gparams *params, const int32_t *g_idx,
                          mq_qspec s, float gs, int64_t rows, int64_t cols, int64_t ng, int64_t G) {
    const int64_t n = rows * cols;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / cols, c = i % cols, grp = g_idx ? g_idx[c] : c / G;
        const mq_gparams p = params[r * ng + grp];
        w[i] = mqd::dequant_step(s, mqd::group_step(s, gs, p), p.zero, codes[i]);
    }
}

}  // namespace

moeq_status mq_cu_dequantize(mq_gpu *g, const mq_qtensor *q, float *dev, const char *what) {
    if (q->spec.scheme != MQ_QS_NVFP4 && q->spec.scheme != MQ_QS_INT4 && q->spec.scheme != MQ_QS_MXFP4)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: scheme %s is decoded on the host", what, mq_qscheme_name(q->spec.scheme));
    if (q->rows <= 0 || q->cols <= 0 || q->group_size <= 0 || q->n_groups <= 0 ||
        (!q->g_idx && q->n_groups * q->group_size != q->cols))
        return mq_err(MOEQ_E_SHAPE, "%s: [%lld, %lld] in %lld groups of %lld", what, (long long)q->rows,
                      (long long)q->cols, (long long)q->n_groups, (long long)q->group_size);
    for (int64_t c = 0; q->g_idx && c < q->cols; c++)
        if (q->g_idx[c] < 0 || q->g_idx[c] >= q->n_groups)
            return mq_err(MOEQ_E_FORMAT, "%s: column %lld in group %d of %lld", what, (long long)c, q->g_idx[c],
                          (long long)q->n_groups);
    const size_t n = (size_t)(q->rows * q->cols), np = (size_t)(q->rows * q->n_groups);
    uint8_t *codes = NULL;
    mq_gparams *params = NULL;
    int32_t *gi = NULL;
    cudaStream_t s = g->stream[0];
    moeq_status st = CU(cudaSetDevice(g->device));
    if (!st) st = cu_alloc(&codes, n, what);
    if (!st) st = cu_alloc(&params, np, what);
    if (!st && q->g_idx) st = cu_alloc(&gi, (size_t)q->cols, what);
    if (!st) st = CU(cudaMemcpyAsync(codes, q->codes, n, cudaMemcpyHostToDevice, s));
    if (!st) st = CU(cudaMemcpyAsync(params, q->params, np * sizeof(mq_gparams), cudaMemcpyHostToDevice, s));
    if (!st && gi) st = CU(cudaMemcpyAsync(gi, q->g_idx, (size_t)q->cols * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    if (!st) {
        const int64_t blocks = ((int64_t)n + 255) / 256 < 65536 ? ((int64_t)n + 255) / 256 : 65536;
        k_dequant<<<(unsigned)blocks, 256, 0, s>>>(dev, codes, params, gi, q->spec, q->global_scale, q->rows, q->cols,
                                                  q->n_groups, q->group_size);
        st = CU_LAUNCHED("k_dequant");
    }
    moeq_status w = CU(cudaStreamSynchronize(s));   /* the host's tensor may go once this returns */
    if (!st) st = w;
    mq_cu_free(codes);
    mq_cu_free(params);
    mq_cu_free(gi);
    return st;
}
