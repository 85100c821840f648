/*
 * Checkpoint layouts of one quantized Linear: packing an mq_qtensor into the tensors a serving
 * engine loads (layout.c); unpacking them back is ckpt/layout.h's, below model and export. Spec: ../shared/docs/formats.md sections 2.1-2.4.
 *
 *   compressed-tensors NVFP4 (nvfp4-pack-quantized):
 *       P.weight_packed U8 [N, K/2] (even column in the low nibble), P.weight_scale F8_E4M3
 *       [N, K/16], P.weight_global_scale F32 [1] (divisor 2688/amax), P.input_global_scale F32 [1]
 *       (W4A4 only)
 *   compressed-tensors INT4 (pack-quantized):
 *       P.weight_packed I32 [N, K/8] (unsigned code, LSB first), P.weight_scale [N, K/G] in the
 *       spec's scale dtype, P.weight_shape I64 [2], P.weight_zero_point I32 [ceil(N/8), K/G]
 *       (asym only, packed along the out dim), P.weight_g_idx I32 [K] (act-order only)
 *   ModelOpt NVFP4: P.weight U8 [N, K/2], P.weight_scale F8_E4M3 [N, K/16], P.weight_scale_2 F32 []
 *       (multiplier amax/2688), P.input_scale F32 [] (W4A4 only)
 *   GPTQ v1: P.qweight I32 [K/8, N], P.qzeros I32 [G, N/8] (zero - 1, the v1 quirk), P.scales F16
 *       [G, N], P.g_idx I32 [K]
 *
 * NVFP4 global scales are stored in the format's own convention; a tensor quantized in the other
 * convention is stored as the reciprocal (not bit-exact on reload), so the quantize driver
 * quantizes CT checkpoints in MQ_NVFP4_CT and ModelOpt ones in MQ_NVFP4_MUL.
 */
#ifndef MOEQ_EXPORT_LAYOUT_H
#define MOEQ_EXPORT_LAYOUT_H

#include "ckpt/layout.h"   /* the reading half (the model loader includes it directly) */
#include "formats/formats.h"
#include "io/safetensors.h"

/* MQ_FMT_GGUF: the checkpoint is assembled in compressed-tensors' layout (with F16 INT4 scales)
 * and converted into one GGUF file at the end (export/gguf_export.h); the layouts treat it as CT. */
typedef enum { MQ_FMT_CT = 0, MQ_FMT_MODELOPT, MQ_FMT_GPTQ, MQ_FMT_GGUF } mq_ckpt_format;

const char *mq_ckpt_format_name(mq_ckpt_format f);   /* "compressed-tensors", "modelopt", "gptq", "gguf" */

/* Receives one output tensor; data was allocated with mq_alloc and is owned by the callee from
 * the call on (also when it fails). */
typedef moeq_status (*mq_emit_fn)(void *user, const char *name, moeq_dtype dtype, int ndim,
                                  const int64_t *shape, void *data, size_t nbytes);

/* Emits the tensors of the quantized Linear `module` (e.g. "model.layers.0.mlp.experts.3.w1").
 * input_amax > 0 adds the W4A4 activation scale (NVFP4 only). Shape limits of the format (K % 8,
 * N % 8 for GPTQ, ...) are checked here and reported naming the module. */
moeq_status mq_layout_emit(mq_ckpt_format fmt, const char *module, const mq_qtensor *q,
                           float input_amax, mq_emit_fn emit, void *user);

/* The W4A4 activation scale of an NVFP4 Linear alone, as mq_layout_emit emits it (CT
 * input_global_scale = 2688/amax [1]; ModelOpt input_scale = amax/2688 []). */
moeq_status mq_layout_emit_input_scale(mq_ckpt_format fmt, const char *module, float input_amax,
                                       mq_emit_fn emit, void *user);

/* Receives the name, dtype and shape of one tensor mq_layout_emit would emit. */
typedef moeq_status (*mq_describe_fn)(void *user, const char *name, moeq_dtype dtype, int ndim,
                                      const int64_t *shape);
/* The tensors mq_layout_emit(fmt, module, q, input_amax, ...) emits for a quantized N x K Linear
 * with spec (q->spec), in the same order: g_idx when q carries one (CT INT4; GPTQ always has
 * one), input_scale when input_amax > 0. Errors as mq_layout_emit's for the shape and format. */
moeq_status mq_layout_describe(mq_ckpt_format fmt, const char *module, const mq_qspec *spec,
                               int64_t N, int64_t K, bool g_idx, bool input_scale,
                               mq_describe_fn fn, void *user);

/* llama.cpp's block types (layout_ggml.c; MQ_FMT_GGUF with an MQ_QS_KQUANT spec): the GGUF rows
 * as P.weight_<type> U8 [N, (K / block) * bytes]; ckpt/layout.h reads them back. */
moeq_status mq_layout_ggml_describe(const char *module, const mq_qspec *spec, int64_t N, int64_t K,
                                    mq_describe_fn fn, void *user);
moeq_status mq_layout_ggml_emit(const char *module, const mq_qtensor *q, mq_emit_fn emit, void *user);

#endif
