/*
 * A source checkpoint directory as model, export and the pipeline read it: config.json (read
 * from disk here only; mq_read_file_watch in core counts the reads, so that a test sees a
 * quantize run read it once), the FP8 block quantization its quantization_config declares (io/fp8.h has the
 * weights' format), and the safetensors opened with an FP8 checkpoint's weights linked to their
 * scales.
 */
#ifndef MOEQ_CKPT_SOURCE_H
#define MOEQ_CKPT_SOURCE_H

#include <cjson/cJSON.h>

#include "io/safetensors.h"

/* DIR/config.json's text (*text malloc'd, NUL-terminated) and its path (*path malloc'd, for
 * messages; may be NULL). A directory that does not exist, or has no config.json:
 * MOEQ_E_NOTFOUND saying which. */
moeq_status mq_config_file_read(const char *dir, char **path, char **text, size_t *len);
/* The same parsed: a JSON object, else MOEQ_E_FORMAT naming the file. */
moeq_status mq_config_file_parse(const char *dir, char **path, cJSON **root);

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

/* The decoder mq_st_link_fp8 links to an FP8 block-quantized weight (ckpt/fp8.c): rows
 * [r0, r0 + nr) of w (checked by io's mq_fp8_dequant_rows) as fp32 into out[nr * cols], each code
 * times its block's scale; a scale that is not finite or a NaN code is MOEQ_E_FORMAT naming the
 * tensor and where. */
moeq_status mq_fp8_block_dequant(const mq_tensor_view *w, int64_t r0, int64_t nr, float *out);

/* A checkpoint directory's tensors (mq_st_open_dir_files); for an FP8 block-quantized checkpoint
 * (its config.json read for that) each weight linked to its scale with mq_st_link_fp8, and a bad
 * quantization_config is that function's error. */
moeq_status mq_st_open_dir(const char *dir, mq_st **out);
/* The same for a caller that has read the config: b is its FP8 block size (zeros: not FP8). */
moeq_status mq_st_open_dir_blocks(const char *dir, mq_fp8_blocks b, mq_st **out);

#endif
