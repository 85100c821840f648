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
 * NVFP4 has two conventions for the global scale (spec.nvfp4_conv):
 *  - MQ_NVFP4_CT (compressed-tensors, the default): gs = 448*6/amax is a *divisor*.
 *        t = amax_blk / 6;  t = gs * t;  s = E4M3(min(max(t, scale_min), 448))
 *        step = s / gs;  code = E2M1(x / step);  x^ = e2m1(code) * step
 *  - MQ_NVFP4_MUL (ModelOpt weight_scale_2 / torchao per_tensor_scale / the fixture reference):
 *    g = amax / (448*6) is a *multiplier*.
 *        t = amax_blk / 6;  t = t / g;  s = E4M3(min(max(t, scale_min), 448))
 *        step = s * g;  code = E2M1(x / step);  x^ = e2m1(code) * step
 * Every operation above is one IEEE fp32 operation in the order written. A block whose scale
 * is 0 (all-zero block) gets zero codes and dequantizes to 0; a non-zero block whose scale would
 * round to 0 in E4M3 gets the smallest subnormal 2^-9 instead, so it is not wiped out.
 */
#ifndef MOEQ_FORMATS_H
#define MOEQ_FORMATS_H

#include <string.h>

#include "core/core.h"
#include "formats/codecs_inline.h"

/* ---- scalar codecs (bit-exact, IEEE, no fast-math) ------------------------------------------ */
/* E2M1 code = sign<<3 | idx, idx -> {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Round to nearest, ties to even;
 * |x| > 6 saturates to 6; negative values that round to zero keep the sign (0x8). NaN gives 0x7
 * (callers reject NaN before quantizing). */
uint8_t mq_e2m1_encode(float x);
float mq_e2m1_decode(uint8_t code);
/* E4M3 (float8_e4m3fn): round to nearest even, saturating at +-448 (also for +-Inf), subnormals
 * down to 2^-9, NaN -> 0x7F. The bit algorithm of c10's fp8e4m3fn_from_fp32_value with a
 * saturating clamp in front, every case computed and the answer selected (no branches: the
 * scale searches encode several scales per group of every row). */
/* mq_e4m3_encode: static inline in codecs_inline.h (shared with the GPU's device code). */
float mq_e4m3_decode(uint8_t bits);
/* E8M0 (power of two 2^(e-127), 0xFF = NaN), used by MXFP4 scales. encode_ceil gives the smallest
 * power of two >= x (clamped to [2^-127, 2^127]; x <= 0 -> 2^-127). */
uint8_t mq_e8m0_encode_ceil(float x);
float mq_e8m0_decode(uint8_t bits);

/* A float rounded to a storage dtype (F32: unchanged; BF16, F16 round to nearest even; F16
 * saturates at 65504 instead of overflowing). */
float mq_round_to_dtype(float x, moeq_dtype dt);

/* ---- schemes ----------------------------------------------------------------------------- */
/* MQ_QS_KQUANT: one of llama.cpp's block types with an fp16 super-scale (formats/kquant.h). */
typedef enum { MQ_QS_NONE = 0, MQ_QS_NVFP4, MQ_QS_INT4, MQ_QS_MXFP4, MQ_QS_KQUANT } mq_qscheme;
/* The block types of MQ_QS_KQUANT: the K-quants and the 32-value types llama.cpp falls back to
 * where a row is no whole number of 256-value blocks (Q4_0 is Q3_K's; moeq's INT4 scheme writes
 * Q4_0 too, with its own scale conventions), and the non-uniform IQ4_XS (256-value blocks) and
 * its fallback IQ4_NL (32). */
typedef enum {
    MQ_KQ_Q3_K = 0, MQ_KQ_Q4_K, MQ_KQ_Q5_K, MQ_KQ_Q6_K, MQ_KQ_Q5_0, MQ_KQ_Q5_1, MQ_KQ_Q8_0,
    MQ_KQ_Q4_0, MQ_KQ_IQ4_NL, MQ_KQ_IQ4_XS, MQ_KQ_COUNT
} mq_kq_type;
typedef enum { MQ_NVFP4_CT = 0, MQ_NVFP4_MUL } mq_nvfp4_conv;

typedef struct {
    mq_qscheme scheme;
    int32_t group_size;      /* NVFP4: 16; MXFP4: 32; INT4: 32/64/128, or -1 = one group per row */
    bool asym;               /* INT4 only: scale=(max-min)/15, integer zero point */
    int8_t int4_zero_min;    /* INT4 asym: smallest zero point (1 for GPTQ v1, whose stored
                                zero - 1 cannot hold -1); default 0 */
    float int4_sym_div;      /* INT4 sym: scale = amax / div; 7 (no clipping) or 7.5 (CT/GPTQ) */
    bool int4_signed_scale;  /* INT4 sym: scale = amax / 8 with the sign that gives the group's
                                largest magnitude the code -8 (negative when that value is
                                positive; llama.cpp's Q4_0 convention); int4_sym_div unused */
    moeq_dtype scale_dtype;  /* INT4: dtype the scale is stored in (BF16/F16/F32); scales are
                                rounded to it before quantizing so loads are bit-identical */
    mq_nvfp4_conv nvfp4_conv;   /* NVFP4: meaning of the global scale (see the top comment) */
    float nvfp4_scale_min;   /* NVFP4: lower clamp of the block scale before E4M3 rounding;
                                0 = none (an all-zero block gets scale 0) */
    bool mse;                /* search each group's scale over a shrink grid (least squared error) */
    int32_t mse_steps;       /* grid points (default 17) */
    float mse_lo, mse_hi;    /* grid range as multiples of the max-based scale (0.70 .. 1.10) */
    float nvfp4_headroom;    /* NVFP4: the global scale leaves block scales this much room above
                                the max-based one below E4M3's 448 (1 or 0: none; 1.5 lets a
                                scale search up to 1.5 reach every block) */
    mq_kq_type kq;           /* MQ_QS_KQUANT: the block type (group_size is its sub-block) */
} mq_qspec;

/* Defaults for a scheme: NVFP4 group 16, CT convention, no clamp; INT4 group 128, symmetric,
 * div 7.5, BF16 scales; MXFP4 group 32. mse off (grid 17 points, 0.70 .. 1.10). */
mq_qspec mq_qspec_default(mq_qscheme scheme);
/* The conventions of ../shared/fixtures/reference.json: NVFP4 MUL with block scales clamped to
 * [2^-9, 448]; INT4 symmetric amax/7 with F32 scales. */
mq_qspec mq_qspec_reference(mq_qscheme scheme);
/* Checks the spec against a weight shape: group divides cols, NVFP4 cols % 16 == 0, ...
 * Errors name the tensor. */
moeq_status mq_qspec_check(const mq_qspec *s, int64_t rows, int64_t cols, const char *tensor);
int64_t mq_qspec_group(const mq_qspec *s, int64_t cols);   /* effective group size */
/* Storage cost per weight in bits: codes + per-group scale (+ zero point) + global scale. */
double mq_qspec_bits_per_weight(const mq_qspec *s, int64_t rows, int64_t cols);
/* "nvfp4", "int4", "mxfp4" or "none". */
const char *mq_qscheme_name(mq_qscheme scheme);

/* The global scale of an NVFP4 tensor (or fused group of tensors) with absolute max amax, in the
 * spec's convention: CT 448*6/amax, MUL amax/(448*6) (with nvfp4_headroom h > 1: 448*6/(h amax),
 * h amax/(448*6)); 1.0 when amax is 0 or not finite or the
 * result is not a positive finite number. Other schemes: 1.0. */
float mq_nvfp4_global_scale(const mq_qspec *s, float amax);

/* Quantization parameters of one group (one row x group_size columns). */
typedef struct {
    float scale;         /* NVFP4/MXFP4: the decoded block scale; INT4: the (storage-rounded) scale */
    float zero;          /* INT4 asym: integer zero point (q = round(x/scale) + zero); else 0 */
    uint8_t scale_code;  /* NVFP4: E4M3 bits; MXFP4: E8M0 bits; K-quants: the sub-scale */
    uint8_t min_code;    /* K-quants Q4_K/Q5_K: the sub-block's min multiplier (kquant.h) */
} mq_gparams;

/* Computes a group's params from its n values (x[i*stride]). global_scale is used by NVFP4. */
void mq_group_params(const mq_qspec *s, float global_scale, const float *x, int64_t n,
                     int64_t stride, mq_gparams *out);
/* As mq_group_params; with spec.mse the search minimises sum_i h[i] (x_i - q_i)^2 (h: n
 * non-negative weights, contiguous, e.g. the diagonal of a Hessian; NULL = plain squared error).
 * Without spec.mse h is not read. */
void mq_group_params_h(const mq_qspec *s, float global_scale, const float *x, int64_t n,
                       int64_t stride, const float *h, mq_gparams *out);
/* The candidates the MSE search scores for a group, in its order (increasing scale along the
 * grid, repeats removed), into cand (room for s->mse_steps); returns their number. plain gets
 * the max-based params (the result without spec.mse). 0 when there is nothing to search
 * (spec.mse off or an all-zero group): plain is then the result. Lets a caller score the
 * candidates its own way (GPTQ's in-loop search). */
int mq_group_candidates(const mq_qspec *s, float global_scale, const float *x, int64_t n,
                        int64_t stride, mq_gparams *plain, mq_gparams *cand);
/* mq_group_candidates for rows groups at once, each of n values: row i's value t at
 * x[t * ld + i]; row i's candidates at cand + i * room, their number in nc[i], its plain params
 * in plain[i]. Returns the largest number. The same candidates as one call a row, at a fraction
 * of the cost (the grid's constants and NVFP4's code values and steps once a call, a dense
 * grid's codes without a branch). step, zero (both or neither, [room][rows]): candidate k's
 * mq_group_step and zero point of row i at [k * rows + i], for k < nc[i], and for a row
 * without candidates its plain params' at k = 0 (a row-vectorized scorer reads them by
 * candidate). */
int mq_group_candidates_rows(const mq_qspec *s, float global_scale, const float *x, int64_t n,
                             int64_t ld, int64_t rows, mq_gparams *plain, mq_gparams *cand,
                             int64_t room, int *nc, float *step, float *zero);
/* The MSE search's score of nc candidate quantizers of one group (step[c] as mq_group_step,
 * zero[c] the INT4 zero point): sse[c] = sum over i = 0..n-1, in that order, in double, of
 * h[i] * d*d (h NULL: d*d) with d = (double)x[i*stride] - dequant(quant(x[i*stride])). step,
 * zero and sse hold nc rounded up to a multiple of 8 entries (the lanes past nc are read and
 * written but meaningless). */
void mq_mse_sse_ref(const mq_qspec *s, const float *step, const float *zero, int nc,
                    const float *x, int64_t n, int64_t stride, const float *h, double *sse);
/* INT4 asymmetric params of a group clipped to [lo, hi] (lo <= 0 <= hi): scale (hi - lo) / 15
 * rounded to the spec's dtype, zero point round(-lo / scale) clamped to [int4_zero_min, 15];
 * what mq_group_params computes from the group's min and max (times the MSE multiplier). */
void mq_int4_asym_params(const mq_qspec *s, float lo, float hi, mq_gparams *out);
/* The quantization step of a group: the value of one unit of the code grid (NVFP4: s/gs or s*g;
 * INT4 and MXFP4: scale). 0 for an all-zero group. */
static inline float mq_group_step(const mq_qspec *s, float global_scale, const mq_gparams *g) {
    if (s->scheme == MQ_QS_NVFP4)
        return s->nvfp4_conv == MQ_NVFP4_MUL ? g->scale * global_scale : g->scale / global_scale;
    return g->scale;
}
/* Code of one value (NVFP4/MXFP4: 4-bit E2M1 code; INT4: unsigned 0..15, i.e. q+8 when symmetric,
 * q in 0..15 with the zero point when asymmetric) and its dequantized value. */
uint8_t mq_quant_value(const mq_qspec *s, float global_scale, const mq_gparams *g, float x);
float mq_dequant_value(const mq_qspec *s, float global_scale, const mq_gparams *g, uint8_t code);
/* The dequantized values of n codes that each have their own group params (GPTQ's per-column
 * step), as mq_dequant_value gives them, without its call per value. */
void mq_dequant_n(const mq_qspec *s, float global_scale, const mq_gparams *g, const uint8_t *codes,
                  int64_t n, float *out);
/* Quantize-dequantize n values that each have their own group params (GPTQ's per-column step:
 * one column, all rows). codes and deq may each be NULL. */
void mq_qdq_n(const mq_qspec *s, float global_scale, const mq_gparams *g, const float *x,
              int64_t n, uint8_t *codes, float *deq);

/* ---- quantized tensors ----------------------------------------------------------------------- */
typedef struct {
    mq_qspec spec;
    int64_t rows, cols;      /* weight [rows = out features, cols = in features] */
    int64_t group_size;      /* effective */
    int64_t n_groups;        /* cols / group_size */
    float global_scale;      /* NVFP4: in spec.nvfp4_conv's convention (1 otherwise) */
    uint8_t *codes;          /* [rows, cols] unpacked codes */
    mq_gparams *params;      /* [rows, n_groups] */
    int32_t *g_idx;          /* [cols] group of each column (act-order); NULL = col / group_size */
} mq_qtensor;

/* Allocates codes and params (zeroed); global_scale 1, g_idx NULL. */
moeq_status mq_qtensor_init(mq_qtensor *q, const mq_qspec *s, int64_t rows, int64_t cols,
                            const char *tensor);
/* As mq_qtensor_init with codes and params left unset, for a writer that sets every one (the
 * GPU's results: zeroing a layer's worth page by page took longer than its GPTQ). */
moeq_status mq_qtensor_init_unset(mq_qtensor *q, const mq_qspec *s, int64_t rows, int64_t cols,
                                  const char *tensor);
void mq_qtensor_free(mq_qtensor *q);
/* Group of column c. */
static inline int64_t mq_qtensor_group_of(const mq_qtensor *q, int64_t c) {
    return q->g_idx ? q->g_idx[c] : c / q->group_size;
}
/* Fails with MOEQ_E_NUMERIC naming the tensor, row and column of the first NaN/Inf in w. */
moeq_status mq_check_finite(const float *w, int64_t rows, int64_t cols, const char *tensor);
/* Round-to-nearest quantization of w [rows, cols]. global_scale (NVFP4): in the spec's
 * convention, e.g. from the joint amax of a fused group; <= 0 means "from this tensor's amax".
 * A NaN or Inf weight is MOEQ_E_NUMERIC naming the tensor and the position. out is initialised
 * here (free it with mq_qtensor_free, also after an error). */
moeq_status mq_quantize_rtn(const mq_qspec *s, const float *w, int64_t rows, int64_t cols,
                            float global_scale, const char *tensor, mq_qtensor *out);
/* w [rows, cols] = dequantized values, exactly as a loader of the written checkpoint computes. */
void mq_dequantize(const mq_qtensor *q, float *w);
/* Rows [r0, r1) of mq_dequantize's result (r1 past the end: to the end), w the whole tensor's:
 * for callers spreading the rows of several tensors over one pool loop. */
void mq_dequantize_rows(const mq_qtensor *q, float *w, int64_t r0, int64_t r1);
/* Absolute max of n values; NaN if any is NaN. */
float mq_absmax(const float *x, int64_t n);
/* The same on the pool, in fixed chunks (max is exact in any order: the same value). */
float mq_absmax_pool(const float *x, int64_t n);
/* ok[i] = whether the n[i] values of x[i] are all finite (a NULL x[i] or n[i] <= 0 counts as
 * finite), on the pool in chunks; fails only for want of memory. */
moeq_status mq_all_finite_many(const float *const *x, const int64_t *n, int64_t count, uint8_t *ok);

/* ---- 4-bit packing (shared by every checkpoint layout) -------------------------------------- */
/* out[i] = codes[2i] | codes[2i+1] << 4 (first element in the low nibble, each code's low four
 * bits); n even. SSE2 on x86-64; mq_pack_u4_bytes_ref is its scalar twin (MOEQ_FORCE_REF). */
void mq_pack_u4_bytes(const uint8_t *codes, int64_t n, uint8_t *out);
void mq_pack_u4_bytes_ref(const uint8_t *codes, int64_t n, uint8_t *out);
void mq_unpack_u4_bytes(const uint8_t *packed, int64_t n, uint8_t *codes);
/* out[i] = sum_j codes[8i+j] << 4j (LSB first); n % 8 == 0. */
void mq_pack_u4_words(const uint8_t *codes, int64_t n, uint32_t *out);
void mq_unpack_u4_words(const uint32_t *packed, int64_t n, uint8_t *codes);

/* ---- activation fake quantization (W4A4 emulation) ------------------------------------------ */
/* NVFP4 quantize-dequantize of an activation x [rows, cols] in place, as torchao's dynamic
 * activation quantization does: g = amax(x over the whole 2D tensor) / (448*6); per row, blocks
 * of 16 along cols (a shorter tail block if cols % 16 != 0):
 *     s = E4M3(min(max((amax_blk / 6) / g, 2^-6), 448));  r = (1 / g) / s;
 *     code = E2M1(x * r);  x^ = e2m1(code) * (g * s)
 * An all-zero (or non-finite amax) x is left unchanged. */
void mq_nvfp4_act_qdq(float *x, int64_t rows, int64_t cols);
/* Q8_0 quantize-dequantize of x [rows, cols] in place, as llama.cpp's CPU backend (x86 AVX/AVX2
 * quantize_row_q8_0) rounds the activations of its Q4_0/Q4_1/NVFP4/Q8_0 matmuls: per row, blocks
 * of 32 along cols (a shorter tail block if cols % 32 != 0; llama.cpp has none):
 *     d = amax_blk / 127;  q = round_half_even(x * (127 / amax_blk))  (0 if amax_blk == 0);
 *     x^ = f16(d) * q
 * Row-local, so the result does not depend on how rows are batched. A block whose amax is not
 * finite is left unchanged. */
void mq_q8_0_act_qdq(float *x, int64_t rows, int64_t cols);
/* Q8_K quantize-dequantize of x [rows, cols] in place, as llama.cpp rounds the activations of
 * its K-quant matmuls (quantize_row_q8_K, the reference on x86 and elsewhere): per row, blocks
 * of 256 along cols (a shorter tail block if cols % 256 != 0):
 *     max = the block's first value of largest magnitude (signed);  iscale = -127 / max;
 *     q = min(127, round_half_even(iscale * x));  x^ = (1 / iscale) * q   (fp32 d, no fp16)
 * An all-zero block stays 0; one with a NaN or Inf is left unchanged. Row-local. */
void mq_q8_k_act_qdq(float *x, int64_t rows, int64_t cols);

#endif
