/*
 * Number formats and weight quantization schemes: FP4 E2M1, FP8 E4M3 (and E8M0), NVFP4
 * (E2M1 values, one E4M3 scale per 16 inputs, one FP32 global scale), INT4 (symmetric or
 * asymmetric, groups of 32/64/128 or per channel), MXFP4 (E8M0 scale per 32).
 * Specs: ../shared/docs/formats.md section 2, ../shared/docs/torchao_gptq.md section 11.
 *
 * The canonical in-memory quantized tensor is mq_qtensor (unpacked codes + per-group params);
 * every checkpoint layout (compressed-tensors, ModelOpt, GPTQ) packs from and unpacks to it, so a
 * quantize -> write -> load round trip is bit-identical to the in-memory fake quantization.
 *
 * Conventions (compressed-tensors): NVFP4 global_scale gs = 448*6/amax is a *divisor*:
 *   block scale s = E4M3(gs * block_amax / 6);  code = E2M1(x * gs / s);  x^ = e2m1(code) * s / gs
 */
#ifndef MOEQ_FORMATS_H
#define MOEQ_FORMATS_H

#include "core/core.h"

/* ---- scalar codecs (bit-exact, IEEE, no fast-math) ------------------------------------------ */
/* E2M1 code = sign<<3 | idx, idx -> {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Round to nearest, ties to even;
 * |x| > 6 saturates to 6; negative values that round to zero keep the sign (0x8). */
uint8_t mq_e2m1_encode(float x);
float mq_e2m1_decode(uint8_t code);
/* E4M3 (float8_e4m3fn): round to nearest even, saturating at +-448, subnormals down to 2^-9,
 * NaN -> 0x7F. */
uint8_t mq_e4m3_encode(float x);
float mq_e4m3_decode(uint8_t bits);
/* E8M0 (power of two 2^(e-127)), used by MXFP4 scales. */
uint8_t mq_e8m0_encode_ceil(float x);
float mq_e8m0_decode(uint8_t bits);

/* ---- schemes ----------------------------------------------------------------------------- */
typedef enum { MQ_QS_NONE = 0, MQ_QS_NVFP4, MQ_QS_INT4, MQ_QS_MXFP4 } mq_qscheme;

typedef struct {
    mq_qscheme scheme;
    int32_t group_size;      /* NVFP4: 16; MXFP4: 32; INT4: 32/64/128, or -1 = one group per row */
    bool asym;               /* INT4 only: scale=(max-min)/15, integer zero point */
    float int4_sym_div;      /* INT4 sym: scale = amax / div; 7 (no clipping) or 7.5 (CT/GPTQ) */
    moeq_dtype scale_dtype;  /* INT4: dtype the scale is stored in (BF16/F16/F32); scales are
                                rounded to it before quantizing so loads are bit-identical */
    bool mse;                /* search each group's scale over a shrink grid (least squared error) */
    int32_t mse_steps;       /* grid points (default 17) */
    float mse_lo, mse_hi;    /* grid range as multiples of the max-based scale (0.70 .. 1.10) */
} mq_qspec;

/* Defaults for a scheme (group_size 16 for NVFP4, 128 for INT4, 32 for MXFP4). */
mq_qspec mq_qspec_default(mq_qscheme scheme);
/* Checks the spec against a weight shape: group divides cols, NVFP4 cols % 16 == 0, ...
 * Errors name the tensor. */
moeq_status mq_qspec_check(const mq_qspec *s, int64_t rows, int64_t cols, const char *tensor);
int64_t mq_qspec_group(const mq_qspec *s, int64_t cols);   /* effective group size */

/* NVFP4 global scale (divisor) from the absolute max of the (fused) tensor: 448*6/amax,
 * 1.0 when amax is 0 or not finite. */
float mq_nvfp4_global_scale(float amax);

/* Quantization parameters of one group (one row x group_size columns). */
typedef struct {
    float scale;         /* NVFP4/MXFP4: the decoded block scale; INT4: the (storage-rounded) scale */
    float zero;          /* INT4 asym: integer zero point (q = round(x/scale) + zero); else 0 */
    uint8_t scale_code;  /* NVFP4: E4M3 bits; MXFP4: E8M0 bits */
} mq_gparams;

/* Computes a group's params from its n values (x[i*stride]). global_scale is used by NVFP4. */
void mq_group_params(const mq_qspec *s, float global_scale, const float *x, int64_t n,
                     int64_t stride, mq_gparams *out);
/* Code of one value (NVFP4/MXFP4: 4-bit E2M1 code; INT4: unsigned 0..15, i.e. q+8 when symmetric,
 * q in 0..15 with the zero point when asymmetric) and its dequantized value. */
uint8_t mq_quant_value(const mq_qspec *s, float global_scale, const mq_gparams *g, float x);
float mq_dequant_value(const mq_qspec *s, float global_scale, const mq_gparams *g, uint8_t code);
/* Quantize-dequantize n values that each have their own group params (GPTQ's per-column step:
 * one column, all rows). codes may be NULL. */
void mq_qdq_n(const mq_qspec *s, float global_scale, const mq_gparams *g, const float *x,
              int64_t n, uint8_t *codes, float *deq);

/* ---- quantized tensors ----------------------------------------------------------------------- */
typedef struct {
    mq_qspec spec;
    int64_t rows, cols;      /* weight [rows = out features, cols = in features] */
    int64_t group_size;      /* effective */
    int64_t n_groups;        /* cols / group_size */
    float global_scale;      /* NVFP4 divisor (1 otherwise) */
    uint8_t *codes;          /* [rows, cols] unpacked codes */
    mq_gparams *params;      /* [rows, n_groups] */
    int32_t *g_idx;          /* [cols] group of each column (act-order); NULL = col / group_size */
} mq_qtensor;

moeq_status mq_qtensor_init(mq_qtensor *q, const mq_qspec *s, int64_t rows, int64_t cols,
                            const char *tensor);
void mq_qtensor_free(mq_qtensor *q);
/* Round-to-nearest quantization of w [rows, cols]. A NaN or Inf weight is MOEQ_E_NUMERIC naming
 * the tensor and the position. */
moeq_status mq_quantize_rtn(const mq_qspec *s, const float *w, int64_t rows, int64_t cols,
                            float global_scale, const char *tensor, mq_qtensor *out);
/* w [rows, cols] = dequantized values, exactly as a loader of the written checkpoint computes. */
void mq_dequantize(const mq_qtensor *q, float *w);
/* Absolute max of n values; NaN if any is NaN. */
float mq_absmax(const float *x, int64_t n);

#endif
