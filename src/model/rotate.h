/*
 * A rotation of the residual stream folded into the weights (moeq quantize --rotate residual;
 * QuaRot's R1 / SpinQuant's R1, block-diagonal as MR-GPTQ's transforms).
 *
 * R = diag(s) H_bd, H_bd block-diagonal with Sylvester Hadamard blocks of b (a power of two that
 * divides D) normalised by 1/sqrt(b), s a fixed random sign per channel; R^T R = I. Every hidden
 * state x [D] (a row) becomes x R. The model computes the same function in exact arithmetic when
 *   - each RMSNorm feeding the stream's readers has its weight g folded into those readers and is
 *     set to ones (an RMSNorm without weight commutes with R: ||x R|| = ||x||);
 *   - readers (q/k/v, router, expert and shared-expert gate/up, shared_expert_gate, dense MLP
 *     gate/up; lm_head with the final norm) get W' = W diag(g) R (Linear W [out, in], y = x W^T);
 *   - writers (o_proj, every down projection) get W' = R^T W and their biases b' = R^T b;
 *   - the embeddings E' = E R.
 * Biases of readers act on outputs and stay; q/k norms act on q/k outputs and stay.
 */
#ifndef MOEQ_MODEL_ROTATE_H
#define MOEQ_MODEL_ROTATE_H

#include "model/model.h"

/* The signs' seed of moeq quantize --rotate (part of the checkpoint's identity). */
#define MQ_ROTATE_SEED 0x5152u

typedef enum {
    MQ_ROT_NONE = 0,      /* untouched */
    MQ_ROT_READ_ATTN,     /* W diag(input_layernorm) R */
    MQ_ROT_READ_FFN,      /* W diag(post_attention_layernorm) R */
    MQ_ROT_READ_FINAL,    /* lm_head: W diag(model.norm) R */
    MQ_ROT_WRITE,         /* R^T W (rows are the stream's channels) */
    MQ_ROT_WRITE_BIAS,    /* R^T b */
    MQ_ROT_EMBED,         /* E R */
    MQ_ROT_NORM,          /* a folded RMSNorm weight: ones */
} mq_rot_kind;

struct mq_rotation {
    int64_t D;
    int block;            /* b */
    int n_layers;
    float *sign;          /* [D]: +-1 */
    float *norms;         /* [(2 n_layers + 1) D]: per layer input, post-attention; the final */
};

/* Why the model of config c cannot be rotated exactly with blocks of `block` (MOEQ_E_UNSUPPORTED
 * or MOEQ_E_ARG with a message naming the reason), else MOEQ_OK. */
moeq_status mq_rotation_check(const mq_config *c, int block);
/* Reads every RMSNorm weight the rotation folds from st (fp32 copies) and draws the signs from
 * seed. c must have passed mq_rotation_check. */
moeq_status mq_rotation_init(mq_rotation *r, const mq_config *c, const mq_st *st, int block,
                             uint64_t seed);
void mq_rotation_free(mq_rotation *r);
/* What the rotation does to the tensor of that (hub) name, and its layer (-1 outside). */
mq_rot_kind mq_rot_classify(const char *tensor, int *layer);
/* Transforms x [rows, cols] (fp32, row-major, as on disk) of kind k in place; the shape must fit
 * the kind (readers and the embeddings cols == D, writers rows == D, vectors rows * cols == D),
 * else MOEQ_E_SHAPE naming the tensor. */
moeq_status mq_rotation_apply(const mq_rotation *r, mq_rot_kind k, int layer, float *x,
                              int64_t rows, int64_t cols, const char *name);
/* x[D] <- x R (a hidden state; also R^T v for a column v, H being symmetric). */
void mq_rotation_vec(const mq_rotation *r, float *x);

#endif
