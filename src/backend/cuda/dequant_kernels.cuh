/*
 * The device's decoding of a quantized weight (dequant.cu, mq_cu_dequantize): its kernel, the
 * checks of the tensor and the launch shape, in one header that dequant.cu includes for the
 * device and kvattn_emu.cu under the SIMT emulator (MQM_EMU), so that the tests run the same
 * source on the host. Each value is quant_dev.cuh's dequant_step(group_step(...)), the device
 * twins of formats' mq_dequant_value: the same fp32 operations, so the result is mq_dequantize's,
 * bit for bit.
 */
#ifndef MOEQ_BACKEND_CUDA_DEQUANT_KERNELS_CUH
#define MOEQ_BACKEND_CUDA_DEQUANT_KERNELS_CUH

#include <stdint.h>

#include "backend/cuda/kern_qual.cuh"
#include "backend/cuda/quant_dev.cuh"

namespace {

constexpr int DEQUANT_THREADS = 256;
constexpr int64_t DEQUANT_MAX_BLOCKS = 65536;

/* w [rows, cols] from codes [rows, cols], params [rows, ng] and the column's group. */
MQ_KERNEL0 k_dequant(float *w, const uint8_t *codes, const mq_gparams *params, const int32_t *g_idx, mq_qspec s,
                     float gs, int64_t rows, int64_t cols, int64_t ng, int64_t G) {
    const int64_t n = rows * cols;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / cols, c = i % cols, grp = g_idx ? g_idx[c] : c / G;
        const mq_gparams p = params[r * ng + grp];
        w[i] = mqd::dequant_step(s, mqd::group_step(s, gs, p), p.zero, codes[i]);
    }
}

/* Whether the device decodes q: its scheme, shape and act-order groups (errors name `what`). */
moeq_status dequant_check(const mq_qtensor *q, const char *what) {
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
    return MOEQ_OK;
}

/* The blocks of DEQUANT_THREADS for n values (a grid-stride loop past DEQUANT_MAX_BLOCKS). */
unsigned dequant_blocks(int64_t n) {
    const int64_t b = (n + DEQUANT_THREADS - 1) / DEQUANT_THREADS;
    return (unsigned)(b < DEQUANT_MAX_BLOCKS ? b : DEQUANT_MAX_BLOCKS);
}

}  // namespace

#endif
