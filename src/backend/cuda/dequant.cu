/*
 * A quantized weight decoded on the device (backend/gpu.h, mq_gpu_kvattn_set_quantized): only its
 * codes (a byte each, as mq_qtensor holds them) and group parameters cross the bus, and each value
 * is dequant_kernels.cuh's (quant_dev.cuh's dequant_step(group_step(...)), the device twins of
 * formats' mq_dequant_value: the same fp32 operations), so the result is mq_dequantize's (what the
 * loader gives the CPU), bit for bit; the emulator runs the same kernel (kvattn_emu.cu). NVFP4, INT4 (symmetric or asymmetric, act-order g_idx too) and MXFP4; K-quants stay the
 * host's (MOEQ_E_UNSUPPORTED).
 */
#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/dequant_kernels.cuh"

moeq_status mq_cu_dequantize(mq_gpu *g, const mq_qtensor *q, float *dev, const char *what) {
    moeq_status st = dequant_check(q, what);
    if (st) return st;
    const size_t n = (size_t)(q->rows * q->cols), np = (size_t)(q->rows * q->n_groups);
    uint8_t *codes = NULL;
    mq_gparams *params = NULL;
    int32_t *gi = NULL;
    cudaStream_t s = g->stream[0];
    st = CU(cudaSetDevice(g->device));
    if (!st) st = cu_alloc(&codes, n, what);
    if (!st) st = cu_alloc(&params, np, what);
    if (!st && q->g_idx) st = cu_alloc(&gi, (size_t)q->cols, what);
    if (!st) st = CU(cudaMemcpyAsync(codes, q->codes, n, cudaMemcpyHostToDevice, s));
    if (!st) st = CU(cudaMemcpyAsync(params, q->params, np * sizeof(mq_gparams), cudaMemcpyHostToDevice, s));
    if (!st && gi) st = CU(cudaMemcpyAsync(gi, q->g_idx, (size_t)q->cols * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    if (!st) {
        k_dequant<<<dequant_blocks((int64_t)n), DEQUANT_THREADS, 0, s>>>(dev, codes, params, gi, q->spec,
                                                                        q->global_scale, q->rows, q->cols, q->n_groups,
                                                                        q->group_size);
        st = CU_LAUNCHED("k_dequant");
    }
    moeq_status w = CU(cudaStreamSynchronize(s));   /* the host's tensor may go once this returns */
    if (!st) st = w;
    mq_cu_free(codes);
    mq_cu_free(params);
    mq_cu_free(gi);
    return st;
}
