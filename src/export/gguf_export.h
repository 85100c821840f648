/*
 * A quantized checkpoint (compressed-tensors, ModelOpt or GPTQ v1 directory, or an unquantized
 * one) converted into one GGUF v3 file that llama.cpp loads: its architecture's KVs, tokenizer,
 * and tensors under llama.cpp's names, the quantized Linears re-blocked without requantizing
 * (INT4 symmetric -> Q4_0, asymmetric -> Q4_1, NVFP4 -> NVFP4 + NAME.scale). docs/gguf.md.
 */
#ifndef MOEQ_EXPORT_GGUF_EXPORT_H
#define MOEQ_EXPORT_GGUF_EXPORT_H

#include <cjson/cJSON.h>

#include "formats/formats.h"
#include "io/gguf_hf.h"
#include "io/gguf_import.h"

/* Storage of the unquantized 2-D tensors (embeddings, lm_head, kept Linears); 1-D tensors
 * (norms, biases) and routers are always F32. */
typedef enum {
    MQ_GGUF_REST_AUTO = 0,   /* the source dtype (F32, F16 or BF16; other dtypes F32) */
    MQ_GGUF_REST_F32,
    MQ_GGUF_REST_F16,
    MQ_GGUF_REST_BF16,
    MQ_GGUF_REST_Q8_0,
} mq_gguf_rest;

/* Parses "auto", "f32", "f16", "bf16", "q8_0". */
bool mq_gguf_rest_parse(const char *s, mq_gguf_rest *out);

/* The model (its config.json, parsed) can be written as GGUF with weights of `scheme`
 * (MQ_QS_NONE: unquantized) and llama.cpp computes what moeq computes: otherwise MOEQ_E_ARG /
 * MOEQ_E_UNSUPPORTED saying why (an architecture llama.cpp has not, NVFP4 where its graph ignores
 * the global scale, a routing llama.cpp hard-codes otherwise, W4A4, rope scaling, ...). */
moeq_status mq_gguf_check_config(const cJSON *config, const char *what, mq_qscheme scheme,
                                 bool act_quant);
/* The same from a model directory. */
moeq_status mq_gguf_check_model(const char *model_dir, mq_qscheme scheme, bool act_quant);

/* Converts the checkpoint directory ckpt_dir into out_path (written as a temporary file in the
 * same directory and renamed when complete; nothing is left on error). Memory: one Linear (one
 * expert of a stacked tensor) at a time. */
moeq_status mq_gguf_export(const char *ckpt_dir, const char *out_path, mq_gguf_rest rest);
/* The same with every quantized Linear dequantized (mq_load_linear_weight's fp32 values) and
 * stored as rest says (auto: F32): the same model without llama.cpp's quantized kernels, for
 * checking a quantized file against it. */
moeq_status mq_gguf_export_dequantized(const char *ckpt_dir, const char *out_path, mq_gguf_rest rest);

/* The reverse, a GGUF file written out as a checkpoint directory: io/gguf_import.h. */

/* The tokenizer regexes (mq_gguf_re_llama3, mq_gguf_re_qwen2, mq_gguf_re_deepseek3) are io's,
 * shared with the reader: io/gguf_hf.h. */

#endif
