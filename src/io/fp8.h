/*
 * FP8 block-quantized source checkpoints (DeepSeek-V3/R1, Qwen3-*-FP8, ...): config.json says
 *   "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
 *                           "activation_scheme": "dynamic"}
 * and each quantized Linear X stores X.weight as F8_E4M3 [rows, cols] with X.weight_scale_inv
 * (F32, or BF16/F16 in some releases) [ceil(rows / br), ceil(cols / bc)]; the weight is
 *   w[r][c] = e4m3(X.weight[r][c]) * X.weight_scale_inv[r / br][c / bc]      (fp32 product)
 * with partial blocks at the bottom and right edges. Everything else (embeddings, norms,
 * routers, lm_head) is stored in a float dtype as usual.
 *
 * mq_st_open_dir (ckpt/source.h) reads the directory's config.json and, for such a checkpoint,
 * links every F8_E4M3 weight view to its scale and to the checkpoint readers' decoder
 * (mq_tensor_view.scale_inv and .dequant, mq_st_link_fp8; the arithmetic in ckpt/fp8.c), so
 * that mq_tensor_to_f32 returns the dequantized weight to every reader (model loader, lazy
 * loader, quantize pipeline, inspect).
 *
 * E4M3 here is float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities,
 * S.1111.111 is NaN, largest finite value 448, subnormals m * 2^-9.
 */
#ifndef MOEQ_IO_FP8_H
#define MOEQ_IO_FP8_H

#include "io/safetensors.h"

/* Rows [r0, r0 + nr) of the FP8 block-quantized weight w (a view with w->scale_inv set, as
 * mq_st_open_dir makes them; 2-D [rows, cols]) as fp32 into out[nr * cols], through the view's
 * decoder. A scale that is not finite or a NaN code is MOEQ_E_FORMAT naming the tensor and where. */
moeq_status mq_fp8_dequant_rows(const mq_tensor_view *w, int64_t r0, int64_t nr, float *out);

#endif
