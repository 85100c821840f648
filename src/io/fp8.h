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
 * mq_st_open_dir reads the directory's config.json and, for such a checkpoint, links every
 * F8_E4M3 weight view to its scale (mq_tensor_view.scale_inv, checked here), so that
 * mq_tensor_to_f32 returns the dequantized weight to every reader (model loader, lazy loader,
 * quantize pipeline, inspect).
 *
 * E4M3 here is float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities,
 * S.1111.111 is NaN, largest finite value 448, subnormals m * 2^-9.
 */
#ifndef MOEQ_IO_FP8_H
#define MOEQ_IO_FP8_H

#include <cjson/cJSON.h>

#include "io/safetensors.h"

/* The block size of an FP8 checkpoint's weights (weight_block_size = [rows, cols]); both 0 when
 * the checkpoint is not FP8 block-quantized. */
typedef struct {
    int32_t rows, cols;
} mq_fp8_blocks;

/* Largest block side accepted from a config (real files use 128). */
#define MQ_FP8_MAX_BLOCK 65536

/* quantization_config (the JSON object, may be NULL) of the config file `path` (for messages).
 * A missing object or a quant_method other than "fp8": out zeroed, MOEQ_OK. quant_method "fp8":
 * fmt must be absent or "e4m3" (else MOEQ_E_UNSUPPORTED naming fmt), weight_block_size must be
 * two integers in 1..MQ_FP8_MAX_BLOCK (absent: MOEQ_E_UNSUPPORTED, per-tensor FP8 is not read;
 * malformed: MOEQ_E_FORMAT), activation_scheme absent or "dynamic" (MOEQ_E_UNSUPPORTED
 * otherwise: static schemes carry input scales this reader does not use). */
moeq_status mq_fp8_parse_qconfig(const cJSON *qc, const char *path, mq_fp8_blocks *out);

/* Reads DIR/config.json and parses its quantization_config as above. A directory without
 * config.json, or a config.json that is not a JSON object, gives out zeroed and MOEQ_OK (the
 * config loader reports those itself). */
moeq_status mq_fp8_read_dir_config(const char *dir, mq_fp8_blocks *out);

/* Rows [r0, r0 + nr) of the FP8 block-quantized weight w (a view with w->scale_inv set, as
 * mq_st_open_dir makes them; 2-D [rows, cols]) as fp32 into out[nr * cols]. A scale that is not
 * finite or a NaN code is MOEQ_E_FORMAT naming the tensor and where. */
moeq_status mq_fp8_dequant_rows(const mq_tensor_view *w, int64_t r0, int64_t nr, float *out);

#endif
