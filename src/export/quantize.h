/*
 * Model-level quantization driver: reads an unquantized Hugging Face checkpoint, quantizes every
 * decoder Linear (attention projections, dense/shared/routed expert MLPs) with a replaceable
 * per-weight step (round to nearest by default; GPTQ plugs in its own), keeps routers,
 * shared_expert_gate, embeddings, norms and lm_head in their source dtype and lists every
 * unquantized Linear in the config's ignore list, and writes a checkpoint vLLM loads:
 * compressed-tensors (NVFP4 / INT4), ModelOpt NVFP4 or GPTQ v1 (formats.md section 2).
 *
 * NVFP4 global scales are fused as vLLM requires (one per q/k/v, per gate/up of the dense MLP
 * and of the shared expert, per expert's gate/up or w1/w3), from the joint amax of the source
 * weights. Output is written into a temporary directory beside OUT_DIR and renamed at the end; a
 * failure or an interrupt (moeq_interrupt) removes it.
 */
#ifndef MOEQ_EXPORT_QUANTIZE_H
#define MOEQ_EXPORT_QUANTIZE_H

#include "export/layout.h"

/* Quantizes one weight w [rows, cols] (finite, checked by the driver) into out (which it
 * initialises). global_scale: the NVFP4 global scale chosen by the driver (fused); 1 otherwise. */
typedef moeq_status (*mq_weight_step_fn)(void *user, const char *module, const float *w,
                                         int64_t rows, int64_t cols, const mq_qspec *spec,
                                         float global_scale, mq_qtensor *out);
/* The calibration amax of the input of a Linear (W4A4 activation scales); <= 0 if unknown. */
typedef float (*mq_input_amax_fn)(void *user, const char *module);

typedef struct {
    mq_qspec spec;               /* scheme and its options */
    mq_ckpt_format format;
    bool act_quant;              /* NVFP4 W4A4: input scales + input_activations in the config */
    bool no_fuse;                /* one NVFP4 global scale per tensor (the fixture reference) */
    const char *const *ignore;   /* PCRE2 patterns; a module whose name matches stays unquantized */
    int n_ignore;
    size_t max_shard_bytes;      /* 0: 5 GB */
    bool force;                  /* replace an existing OUT_DIR */
    mq_weight_step_fn step;      /* NULL: round to nearest (mq_quantize_rtn) */
    void *step_user;
    mq_input_amax_fn input_amax; /* required when act_quant */
    void *amax_user;
} mq_quantize_opts;

/* Defaults for a scheme and format: the spec in the format's conventions (CT: NVFP4 divisor
 * global scale, INT4 BF16 scales; ModelOpt: multiplier global scale; GPTQ: F16 scales, zero
 * points >= 1). */
void mq_quantize_opts_init(mq_quantize_opts *o, mq_qscheme scheme, mq_ckpt_format format);

typedef struct {
    int64_t n_quantized, n_kept;      /* Linear modules */
    int64_t quantized_params;         /* weights quantized */
    int64_t n_tensors;                /* tensors written */
    size_t bytes_written;             /* tensor data bytes */
} mq_quantize_stats;

/* The output directory: never model_dir, existing only with force (and then a directory).
 * MOEQ_E_EXISTS / MOEQ_E_ARG naming out_dir; *exists (may be NULL) tells whether it exists. */
moeq_status mq_quantize_check_out(const char *model_dir, const char *out_dir, bool force,
                                  bool *exists);

moeq_status mq_quantize_checkpoint(const char *model_dir, const char *out_dir,
                                   const mq_quantize_opts *o, mq_quantize_stats *stats);

/* The fusion group tag of a Linear leaf name ("q_proj" -> "qkv", "gate_proj"/"up_proj" ->
 * "gate_up", "w1"/"w3" -> "w13", "q_a_proj"/"kv_a_proj_with_mqa" -> "q_a"), or NULL. */
const char *mq_fusion_tag(const char *leaf);

#endif
