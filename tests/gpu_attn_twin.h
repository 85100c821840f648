/*
 * The GPU attention twins' shape and weights for a layer of a model opened with fp32 weights
 * (tests/test_gpu.c on a device, tests/test_gpu_kvattn_emu.c under the emulator).
 */
#ifndef MOEQ_TESTS_GPU_ATTN_TWIN_H
#define MOEQ_TESTS_GPU_ATTN_TWIN_H

#include "backend/gpu.h"
#include "model/model.h"

/* Layer `layer` of m for samples of up to max_T tokens (window: the layer's sliding window, 0:
 * none); the RoPE tables are st's. */
static inline void mq_test_attn_twin(const moeq_model *m, mq_state *st, int layer, int64_t max_T, int64_t window,
                                     mq_gpu_attn_shape *sh, mq_gpu_attn_weights *w) {
    const mq_config *c = &m->cfg;
    const mq_layer *ly = &m->layers[layer];
    *sh = (mq_gpu_attn_shape){.D = c->D, .H = c->n_heads, .KV = c->n_kv_heads, .hd = c->head_dim, .max_T = max_T,
                              .eps = c->rms_eps,
                              .qk_norm = c->qk_norm == MQ_QKNORM_FULL ? 1 : c->qk_norm == MQ_QKNORM_HEAD ? 2 : 0,
                              .clip_qkv = c->clip_qkv, .E = c->n_experts, .top_k = c->top_k,
                              .norm_topk = c->norm_topk_prob};
    mq_state_rope_tables(st, &sh->rope_cos, &sh->rope_sin);
    *w = (mq_gpu_attn_weights){.norm = ly->attn_norm, .q = ly->q.w, .k = ly->k.w, .v = ly->v.w, .o = ly->o.w,
                               .q_bias = ly->q.bias, .k_bias = ly->k.bias, .v_bias = ly->v.bias,
                               .o_bias = ly->o.bias, .q_norm = ly->q_norm, .k_norm = ly->k_norm, .window = window,
                               .ffn_norm = ly->ffn_norm, .router = ly->is_moe ? ly->router : NULL};
}

#endif
