/*
 * Checkpoint layouts of one quantized Linear: packing an mq_qtensor into the tensors a serving
 * engine loads, and unpacking them back. Spec: ../shared/docs/formats.md sections 2.1-2.4.
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

/* Looks a tensor up by its full name; NULL when absent. */
typedef const mq_tensor_view *(*mq_lookup_fn)(void *user, const char *name);

/* What a checkpoint holds for one Linear module. */
typedef enum {
    MQ_LIN_ABSENT = 0,    /* no tensor of the module */
    MQ_LIN_DENSE,         /* P.weight in a float dtype */
    MQ_LIN_CT_NVFP4,
    MQ_LIN_CT_INT4,
    MQ_LIN_MODELOPT_NVFP4,
    MQ_LIN_GPTQ,
    MQ_LIN_GGML,          /* P.weight_<type>: GGUF rows of a llama.cpp block type (--format gguf's
                             K-quants; layout_ggml.c) */
    MQ_LIN_FP8_BLOCK,     /* P.weight F8_E4M3 with P.weight_scale_inv per block (io/fp8.h): an
                             FP8 source, loaded dequantized, never packed */
} mq_linear_kind;

mq_linear_kind mq_layout_detect(const char *module, mq_lookup_fn lookup, void *user);

/* Rebuilds the mq_qtensor of a quantized Linear with `rows` x `cols` (the shape the model config
 * implies; checked against the tensors). Every shape, dtype and code is validated: a malformed
 * tensor is MOEQ_E_FORMAT naming the tensor. out is initialised here; free it with
 * mq_qtensor_free (also after an error). */
moeq_status mq_layout_read(const char *module, int64_t rows, int64_t cols, mq_lookup_fn lookup,
                           void *user, mq_qtensor *out);

/* Tensor name suffixes of every layout (for recognising quantization tensors in a checkpoint). */
bool mq_layout_is_quant_suffix(const char *suffix);

/* ---- llama.cpp's block types (layout_ggml.c; MQ_FMT_GGUF with an MQ_QS_KQUANT spec) --------- */
/* "weight_q4_K" and the like (t: its type; may be NULL). */
bool mq_layout_ggml_suffix(const char *suffix, mq_kq_type *t);
moeq_status mq_layout_ggml_describe(const char *module, const mq_qspec *spec, int64_t N, int64_t K,
                                    mq_describe_fn fn, void *user);
moeq_status mq_layout_ggml_emit(const char *module, const mq_qtensor *q, mq_emit_fn emit, void *user);
/* The module's block tensor (its type in *t), NULL when it has none. */
const mq_tensor_view *mq_layout_ggml_find(const char *module, mq_lookup_fn lookup, void *user,
                                          mq_kq_type *t);
moeq_status mq_layout_ggml_read(const char *module, int64_t rows, int64_t cols,
                                mq_lookup_fn lookup, void *user, mq_qtensor *out);

/* ---- for the model loader and inspect ------------------------------------------------------ */
/* The fp32 weight w [rows, cols] of the Linear `module` of st, whatever its storage: a float
 * `module.weight`, or any quantized layout above, dequantized exactly as mq_dequantize does (so
 * quantize -> write -> load is bit-identical to the in-memory fake quantization), or an FP8
 * block-quantized weight (its scale linked by mq_st_open_dir; unlinked: MOEQ_E_FORMAT). kind may
 * be NULL. MOEQ_E_NOTFOUND when the module has no tensor. */
moeq_status mq_load_linear_weight(const mq_st *st, const char *module, int64_t rows, int64_t cols,
                                  float *w, mq_linear_kind *kind);

typedef struct {
    mq_linear_kind kind;
    mq_qscheme scheme;         /* MQ_QS_NONE for a dense weight */
    int64_t rows, cols;        /* from the tensors */
    int64_t group_size;
    bool asym, act_order, has_input_scale;
    mq_kq_type kq;             /* MQ_LIN_GGML: the block type */
    double bits_per_weight;    /* stored bytes of the module's weight tensors * 8 / (rows * cols) */
} mq_linear_qinfo;

/* Describes the Linear `module` of st from its tensors (shapes inferred, scales not read). */
moeq_status mq_linear_qinfo_get(const mq_st *st, const char *module, mq_linear_qinfo *out);
/* "dense", "nvfp4 (compressed-tensors)", ... */
const char *mq_linear_kind_name(mq_linear_kind k);

#endif
