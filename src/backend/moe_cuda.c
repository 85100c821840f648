/* The public face of the GPU MoE op (moeq_moe_cuda_* in include/moeq.h) over gpu.h's mq_gpu_moe:
 * a layer owns its device context. Without CUDA mq_gpu_open fails with the build's message. */
#include "backend/gpu.h"
#include "kernels/moe_ffn.h"

struct moeq_moe_cuda {
    mq_gpu *g;
    mq_gpu_moe *m;
    int64_t D;
};

static const char *k_cu = "moe_ffn_cuda";

moeq_status moeq_moe_cuda_create(int device, const moeq_moe_experts_desc *d,
                                 const moeq_moe_zero_points *zero_points,
                                 const moeq_moe_ffn_args *routing, moeq_moe_cuda **out) {
    if (!out) return mq_err(MOEQ_E_ARG, "%s: out is NULL", k_cu);
    *out = NULL;
    moeq_status st = moeq_moe_experts_check(d);
    if (st) return st;
    if (!routing) return mq_err(MOEQ_E_ARG, "%s: routing is NULL", k_cu);
    if ((st = mq_moe_routing_check(k_cu, routing, d->n_experts, d->hidden, d->shared_ffn))) return st;
    moeq_moe_cuda *c = mq_alloc_zero(sizeof *c, "moe_ffn_cuda");
    if (!c) return MOEQ_E_NOMEM;
    c->D = d->hidden;
    st = mq_gpu_open(device, &c->g);
    if (!st) st = mq_gpu_moe_upload(c->g, d, zero_points, routing, &c->m);
    if (st) {
        moeq_moe_cuda_free(c);
        return st;
    }
    *out = c;
    return MOEQ_OK;
}

moeq_status moeq_moe_cuda_ffn(moeq_moe_cuda *m, const moeq_tensor_ref *x, moeq_moe_cuda_math math,
                              float *out, size_t out_capacity) {
    if (!m) return mq_err(MOEQ_E_ARG, "%s: layer is NULL", k_cu);
    if (!x) return mq_err(MOEQ_E_ARG, "%s: x is NULL", k_cu);
    if (math != MOEQ_MOE_CUDA_BF16 && math != MOEQ_MOE_CUDA_FP32)
        return mq_err(MOEQ_E_ARG, "%s: math %d (expected MOEQ_MOE_CUDA_BF16 or _FP32)", k_cu, (int)math);
    int64_t T;
    moeq_status st = mq_moe_x_check(k_cu, x, m->D, &T);
    if (st) return st;
    if (T == 0) return MOEQ_OK;
    const size_t need = (size_t)T * (size_t)m->D;
    if (!out) return mq_err(MOEQ_E_ARG, "%s: out is NULL", k_cu);
    if (out_capacity < need)
        return mq_err(MOEQ_E_ARG, "%s: out holds %zu floats, [%lld, %lld] needs %zu", k_cu, out_capacity,
                      (long long)T, (long long)m->D, need);
    return mq_gpu_moe_ffn(m->m, x->data, T, math == MOEQ_MOE_CUDA_FP32 ? MQ_GPU_MOE_FP32 : MQ_GPU_MOE_BF16, out);
}

moeq_status moeq_moe_cuda_sync(moeq_moe_cuda *m) {
    if (!m) return mq_err(MOEQ_E_ARG, "%s: layer is NULL", k_cu);
    return mq_gpu_sync(m->g);
}

size_t moeq_moe_cuda_bytes(const moeq_moe_cuda *m) { return m ? mq_gpu_moe_bytes(m->m) : 0; }

void moeq_moe_cuda_free(moeq_moe_cuda *m) {
    if (!m) return;
    mq_gpu_moe_free(m->m);
    mq_gpu_close(m->g);
    mq_free(m);
}
