/*
 * GPTQ over a whole model: calibration forward passes with the model's capture hooks, per-Linear
 * Hessians (routed experts from exactly their routed tokens, shared experts and attention from
 * all tokens), GPTQ per transformer block, the quantized (dequantized) weights written back into
 * the model, and a checkpoint through the export driver.
 *
 * Modes: MQ_GPTQ_SEQUENTIAL (default) quantizes block l from the inputs produced by the already
 * quantized blocks 0..l-1; MQ_GPTQ_NONSEQUENTIAL takes every Hessian from the unquantized model
 * (torchao's OLMoE flow). Both run one block at a time, so peak memory is one block's Hessians
 * plus the calibration activations.
 *
 * Weights that read one activation share one Hessian and one factorisation: q/k/v; gate/up of the
 * dense MLP and of the shared expert; each routed expert's gate/up. NVFP4 global scales are fused
 * the same way (joint amax), as the export driver and vLLM do; all weights of a block run in one
 * parallel GPTQ call (experts in parallel).
 *
 * Routed experts that received fewer than min_expert_tokens calibration tokens fall back to:
 *   MQ_FALLBACK_BLOCK (default): the Hessians of all tokens that reached the MoE block: for
 *     gate/up the Hessian of the block input, for down the Hessian of the expert's own
 *     intermediate activations silu(x Wg^T) * (x Wu^T) computed on every block token;
 *   MQ_FALLBACK_RTN: round to nearest with the same spec and global scale.
 * Never a failure of the run.
 */
#ifndef MOEQ_GPTQ_MODEL_H
#define MOEQ_GPTQ_MODEL_H

#include "export/quantize.h"
#include "model/model.h"
#include "quant/calib.h"
#include "quant/gptq.h"
#include "quant/hessian.h"

typedef enum { MQ_GPTQ_SEQUENTIAL = 0, MQ_GPTQ_NONSEQUENTIAL } mq_gptq_mode;
typedef enum { MQ_FALLBACK_BLOCK = 0, MQ_FALLBACK_RTN } mq_expert_fallback;

typedef struct {
    mq_qspec spec;                  /* the checkpoint's spec (conventions of its format) */
    mq_gptq_opts gptq;
    mq_gptq_mode mode;
    bool true_sequential;           /* sequential only: a block's attention is quantized first and
                                       its MLP/experts calibrated on the quantized attention's
                                       output (one more forward pass per block) */
    int64_t min_expert_tokens;      /* default 32 */
    mq_expert_fallback fallback;
    bool no_fuse;                   /* one NVFP4 global scale per tensor */
    /* Which Linear modules to quantize (NULL: every decoder Linear). */
    bool (*want)(void *user, const char *module);
    void *want_user;
} mq_gptq_model_opts;

/* The defaults measured in docs/gptq_results.md: the spec with the MSE scale search on,
 * sequential, percdamp 0.01, block 128, dynamic groups, act-order for INT4 only (it hurts
 * NVFP4's 16-column groups), experts below 32 tokens on the block Hessian. */
void mq_gptq_model_opts_init(mq_gptq_model_opts *o, const mq_qspec *spec);

/* How one Linear was quantized. */
typedef enum { MQ_HOW_GPTQ = 0, MQ_HOW_GPTQ_BLOCK_HESSIAN, MQ_HOW_RTN } mq_gptq_how;
const char *mq_gptq_how_name(mq_gptq_how h);   /* "gptq", "gptq-block-hessian", "rtn" */

typedef struct {
    char *module;                   /* HF module name */
    int layer, expert;              /* expert: -1 unless a routed expert */
    int64_t tokens;                 /* calibration rows of its Hessian (own tokens for experts) */
    mq_gptq_how how;
    mq_gptq_stats stats;            /* loss/rtn_loss NaN for RTN */
    mq_qtensor q;                   /* moved out by mq_gptq_take */
} mq_gptq_result;

typedef struct {
    mq_gptq_result *r;
    int64_t n, cap;
    int64_t samples, tokens;        /* calibration */
    double seconds_forward, seconds_hessian, seconds_gptq, seconds_total;
} mq_gptq_results;

/* Quantizes every wanted decoder Linear of m with GPTQ on the calibration set. The model's fp32
 * weights are replaced by their dequantized values (so m is the fake-quantized model afterwards).
 * Progress: mq_progress("gptq", ...) over samples and blocks. Interrupt: MOEQ_E_INTERRUPTED. */
moeq_status mq_gptq_model(moeq_model *m, const mq_calib_set *calib, const mq_gptq_model_opts *o,
                          mq_gptq_results *out);
void mq_gptq_results_free(mq_gptq_results *r);
mq_gptq_result *mq_gptq_results_find(const mq_gptq_results *r, const char *module);

/* An mq_weight_step_fn for the export driver (user: mq_gptq_results *): hands over the GPTQ
 * result of `module` after checking its shape, scheme and NVFP4 global scale against what the
 * driver asks for. */
moeq_status mq_gptq_take(void *user, const char *module, const float *w, int64_t rows,
                         int64_t cols, const mq_qspec *spec, float global_scale, mq_qtensor *out);

/* The JSON report: settings, calibration, timings and one record per Linear (tokens, GPTQ loss
 * vs RTN loss, damping, time), written atomically. */
moeq_status mq_gptq_report_write(const mq_gptq_results *r, const mq_gptq_model_opts *o,
                                 const mq_calib_opts *calib, const char *path);

/* The whole `moeq quantize --method gptq`: open the model, load the calibration data, run
 * mq_gptq_model, write the checkpoint with the export driver (qo->step is set here) and then,
 * when report_path is not NULL, the report (it may be inside out_dir). results keep the
 * statistics (the quantized tensors are handed to the writer); free them in any case. */
moeq_status mq_gptq_quantize_checkpoint(const char *model_dir, const char *out_dir,
                                        mq_quantize_opts *qo, const mq_gptq_model_opts *go,
                                        const mq_calib_opts *co, const char *report_path,
                                        mq_gptq_results *results, mq_quantize_stats *stats);

#endif
