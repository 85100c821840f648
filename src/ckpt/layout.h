/*
 * The checkpoint readers: which layout a quantized Linear of a checkpoint is stored in, its
 * tensors unpacked into an mq_qtensor (layout_read.c), and any Linear as fp32 or described for
 * `inspect` (linear.c). The layouts themselves (tensor names, dtypes, shapes, packing) are the
 * ones export/layout.h writes; ../shared/docs/formats.md sections 2.1-2.4. A floor between io and
 * model: model loads checkpoints and export converts them through it, neither through the other.
 */
#ifndef MOEQ_CKPT_LAYOUT_H
#define MOEQ_CKPT_LAYOUT_H

#include "formats/formats.h"
#include "io/safetensors.h"

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
                             K-quants; layout_ggml_read.c) */
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

/* ---- llama.cpp's block types (layout_ggml_read.c) ------------------------------------------ */
/* "weight_q4_K" and the like (t: its type; may be NULL). */
bool mq_layout_ggml_suffix(const char *suffix, mq_kq_type *t);
/* "<module>.weight_<type>" into buf; false when it does not fit. */
bool mq_layout_ggml_name(char *buf, size_t n, const char *module, mq_kq_type t);
/* The module's block tensor (its type in *t), NULL when it has none. */
const mq_tensor_view *mq_layout_ggml_find(const char *module, mq_lookup_fn lookup, void *user,
                                          mq_kq_type *t);
moeq_status mq_layout_ggml_read(const char *module, int64_t rows, int64_t cols,
                                mq_lookup_fn lookup, void *user, mq_qtensor *out);

/* ---- the model loader, inspect and the GGUF converter (linear.c) --------------------------- */
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
