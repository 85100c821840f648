/*
 * The test reference of the pipeline's GPTQ: the whole-model loop of IST-DASLab's gptq on a model
 * loaded in full (moeq_model_open), calibration forward passes through the model's capture hooks
 * (mq_forward_layers), per-Linear Hessians (routed experts from exactly their routed tokens,
 * shared experts and attention from all tokens), GPTQ per transformer block, the dequantized
 * weights written back into the model. It is what moeq's GPTQ was before the streaming pipeline
 * (src/pipeline) replaced it, kept as the independent implementation the pipeline's checkpoints
 * must equal bit for bit (tests/test_pipeline.c). Not part of the library.
 *
 * Modes: REF_SEQUENTIAL (default) quantizes block l from the inputs produced by the already
 * quantized blocks 0..l-1; REF_NONSEQUENTIAL takes every Hessian from the unquantized model
 * (torchao's OLMoE flow). Both run one block at a time, so peak memory is one block's Hessians
 * plus the calibration activations.
 *
 * Weights that read one activation share one Hessian and one factorisation: q/k/v; gate/up of the
 * dense MLP and of the shared expert; each routed expert's gate/up. NVFP4 global scales are fused
 * the same way (joint amax), as the export driver and vLLM do; all weights of a block run in one
 * parallel GPTQ call (experts in parallel).
 *
 * Routed experts that received fewer than min_expert_tokens calibration tokens fall back to:
 *   REF_FALLBACK_BLOCK (default): the Hessians of all tokens that reached the MoE block: for
 *     gate/up the Hessian of the block input (one update per sample of every token's FFN input),
 *     for down the Hessian of the expert's own intermediate activations silu(x Wg^T) * (x Wu^T)
 *     computed on the first samples' tokens (8192 of them);
 *   REF_FALLBACK_RTN: round to nearest with the same spec and global scale.
 * Never a failure of the run.
 */
#ifndef MOEQ_TEST_GPTQ_MODEL_REF_H
#define MOEQ_TEST_GPTQ_MODEL_REF_H

#include "model/model.h"
#include "quant/calib.h"
#include "quant/gptq.h"
#include "quant/hessian.h"

typedef enum { REF_SEQUENTIAL = 0, REF_NONSEQUENTIAL } ref_gptq_mode;
typedef enum { REF_FALLBACK_BLOCK = 0, REF_FALLBACK_RTN } ref_expert_fallback;

typedef struct {
    mq_qspec spec;                  /* the checkpoint's spec (conventions of its format) */
    mq_gptq_opts gptq;
    ref_gptq_mode mode;
    bool true_sequential;           /* sequential only: a block's attention is quantized first and
                                       its MLP/experts calibrated on the quantized attention's
                                       output (one more forward pass per block) */
    int64_t min_expert_tokens;      /* default 32 */
    ref_expert_fallback fallback;
    bool no_fuse;                   /* one NVFP4 global scale per tensor */
    /* Sequential (not true-sequential) only, the pipeline's --target unquantized:asym
     * (mq_gptq_target): GPTQ on W + asym W (G - H)(H + damping)^-1 instead of W, G = sum x_f x_q^T,
     * x_f the unquantized model's input of the same token (an unquantized activation stream runs
     * beside the quantized one), x_q the quantized stream's; a routed expert pairs its routed
     * tokens, its down input taken from x_f through its unquantized gate and up. 0: off. */
    float asym;
    /* Which Linear modules to quantize (NULL: every decoder Linear). */
    bool (*want)(void *user, const char *module);
    void *want_user;
} ref_gptq_opts;

/* The defaults measured in docs/results/gptq_results.md: the spec with the MSE scale search on,
 * sequential, percdamp 0.01, block 128, dynamic groups, act-order for INT4 only (it hurts
 * NVFP4's 16-column groups), experts below 32 tokens on the block Hessian. */
void ref_gptq_opts_init(ref_gptq_opts *o, const mq_qspec *spec);

/* How one Linear was quantized. */
typedef enum { REF_HOW_GPTQ = 0, REF_HOW_GPTQ_BLOCK_HESSIAN, REF_HOW_RTN } ref_how;
const char *ref_how_name(ref_how h);   /* "gptq", "gptq-block-hessian", "rtn" */

typedef struct {
    char *module;                   /* HF module name */
    int layer, expert;              /* expert: -1 unless a routed expert */
    int64_t tokens;                 /* calibration rows of its Hessian (own tokens for experts) */
    ref_how how;
    mq_gptq_stats stats;            /* loss/rtn_loss NaN for RTN */
    mq_qtensor q;                   /* moved out by mq_gptq_take */
} ref_gptq_result;

typedef struct {
    ref_gptq_result *r;
    int64_t n, cap;
    int64_t samples, tokens;        /* calibration */
    double seconds_forward, seconds_hessian, seconds_gptq, seconds_total;
} ref_gptq_results;

/* Quantizes every wanted decoder Linear of m with GPTQ on the calibration set. The model's fp32
 * weights are replaced by their dequantized values (so m is the fake-quantized model afterwards).
 * Progress: mq_progress("gptq", ...) over samples and blocks. Interrupt: MOEQ_E_INTERRUPTED. */
moeq_status ref_gptq_model(moeq_model *m, const mq_calib_set *calib, const ref_gptq_opts *o,
                          ref_gptq_results *out);
void ref_gptq_results_free(ref_gptq_results *r);
ref_gptq_result *ref_gptq_results_find(const ref_gptq_results *r, const char *module);

#endif
