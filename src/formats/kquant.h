/*
 * llama.cpp's block types with sub-block scales (the K-quants Q3_K, Q4_K, Q5_K, Q6_K) and the
 * 32-value types they fall back to (Q4_0, Q5_0, Q5_1, Q8_0) as a quantization grid moeq rounds to
 * itself: the exact values a GGUF block holds, their byte layout (ggml-common.h's block structs,
 * written field by field), and the search that picks a block's scales.
 *
 * One block of `block` values (256 for the K-quants, 32 for the others) has fp16 super-scales d
 * (and dmin) and `block / sub` sub-blocks with integer multipliers; sub-block j's values are
 *     asymmetric (Q4_K, Q5_K):  step_j * code - off_j,     step_j = d * sc_j, off_j = dmin * m_j
 *                (Q5_1):        step * code - off,         step = d, off = -m
 *     symmetric  (Q3_K, Q6_K):  step_j * (code - zero),    step_j = d * mult(sc_j)
 *                (Q4_0, Q5_0, Q8_0):  step * (code - zero), step = d
 * each product and difference one fp32 operation in that order, which is ggml's dequantization
 * (dequantize_row_*: d1 * q - m1, d * sc * q, dl * q, x0 * d, x0 * d + m), so a block decodes to
 * the same floats in moeq and in ggml. step_j = d * mult is exact in fp32 (11 + 8 significant bits).
 *
 * In moeq's canonical quantized tensor (formats.h's mq_qtensor with scheme MQ_QS_KQUANT) a
 * sub-block is a group: mq_gparams.scale = step_j, .zero = off_j (0 when symmetric),
 * .scale_code = the stored sub-scale (Q4_K/Q5_K: 0..63; Q6_K: int8 bits; Q3_K: the 6-bit stored
 * value, mult + 32), .min_code = m_j (Q4_K/Q5_K); codes are the stored unsigned codes (0..qmax).
 * d and dmin are implied (step_j / mult_j, off_j / m_j): a block packs from its groups alone.
 *
 * Byte layouts (little endian), value i of the block:
 *   Q3_K 110 B: hmask[32] qs[64] scales[12] d. Low 2 bits in qs[(i/128)*32 + i%32] at bit
 *        2*((i%128)/32); high bit (code >= 4) in hmask[i%32] bit i/32. 16 sub-blocks of 16: 6-bit
 *        value j in scales[j%8] (low nibble for j < 8, high for j >= 8) and bits 2*(j/4) of
 *        scales[8 + j%4] (its top two bits); mult = value - 32.
 *   Q4_K 144 B: d dmin scales[12] qs[128]. Code in qs[(i/64)*32 + i%32], low nibble when
 *        (i/32) is even. 8 sub-blocks of 32; scales/mins as get_scale_min_k4.
 *   Q5_K 176 B: d dmin scales[12] qh[32] qs[128]: as Q4_K plus the fifth bit in qh[i%32] bit i/32.
 *   Q6_K 210 B: ql[128] qh[64] scales[16] (int8) d. For h = i/128, r = i%128: low nibble in
 *        ql[64h + r%64] (low half when r < 64), high 2 bits in qh[32h + r%32] bits 2*(r/32);
 *        16 sub-blocks of 16; code - 32.
 *   Q5_0  22 B: d qh[4] qs[16]: value j < 16 low nibble of qs[j], j >= 16 high nibble of qs[j-16];
 *        fifth bit j of the u32 qh; code - 16.
 *   Q5_1  24 B: d m qh[4] qs[16]: as Q5_0, value code * d + m.
 *   Q8_0  34 B: d qs[32] int8; code - 128 (codes 1..255: int8 -127..127 as ggml's quantizer).
 *   Q4_0  18 B: d qs[16]: value j < 16 low nibble of qs[j], j >= 16 high nibble; code - 8.
 *
 * The non-uniform types: a code is an index into the 16 integers of mq_kq_iq4_table (ggml's
 * kvalues_iq4nl), value step * table[code] (ggml: dl * kvalues_iq4nl[q], dl = d * (ls - 32) or d):
 *   IQ4_NL 18 B: d qs[16], the nibbles as Q4_0's.
 *   IQ4_XS 136 B: d scales_h(u16) scales_l[4] qs[128]. 8 sub-blocks of 32: the 6-bit stored
 *        scale ls of sub-block j has its low 4 bits in scales_l[j/2] (low nibble for even j) and
 *        its high 2 in scales_h bits 2j; mult = ls - 32 (as Q3_K: .scale_code = ls). Value i of
 *        sub-block j: qs[16j + i%16], low nibble for i < 16.
 */
#ifndef MOEQ_FORMATS_KQUANT_H
#define MOEQ_FORMATS_KQUANT_H

#include "formats/formats.h"

typedef struct {
    const char *name;       /* ggml's: "q4_K" */
    uint32_t ggml_type;     /* ggml.h's number */
    int block;              /* values per block */
    int sub;                /* values per sub-block (one step) */
    int bytes;              /* bytes per block */
    int qmin, qmax;         /* codes qmin..qmax (Q8_0: 1..255, ggml's int8 -127..127; else 0..) */
    int zero;               /* symmetric: value = step * (code - zero); -1: asymmetric */
    int mult_lo, mult_hi;   /* sub-scale multipliers (mult = 0 unused: no sub-scales) */
    int min_hi;             /* largest min multiplier (Q4_K/Q5_K 63; 0: none) */
    const int8_t *table;    /* IQ4: the value of each code (qmax + 1 ascending); NULL: uniform */
} mq_kq_info;

/* ggml's kvalues_iq4nl: the 16 values of the IQ4_NL / IQ4_XS codes, ascending. */
extern const int8_t mq_kq_iq4_table[16];

const mq_kq_info *mq_kq_info_of(mq_kq_type t);
/* mq_qspec_default(MQ_QS_KQUANT) for type t (group_size its sub-block; no MSE search). */
mq_qspec mq_kq_spec(mq_kq_type t);
/* "q4_k", "q4_K", ... (either case); false when not a K-quant or fallback type. */
bool mq_kq_parse(const char *name, mq_kq_type *t);
const char *mq_kq_name(mq_kq_type t);
/* Bits per weight of the stored blocks (e.g. Q4_K 4.5). */
double mq_kq_bpw(mq_kq_type t);
/* The type whose ggml number is ggml_type (false: none of these). */
bool mq_kq_of_ggml(uint32_t ggml_type, mq_kq_type *t);

/* The sub-scale multiplier of a stored sub-scale code (Q6_K: the int8; Q3_K: code - 32; Q4_K,
 * Q5_K: the code; types without sub-scales: 1). */
int mq_kq_mult(const mq_kq_info *t, uint8_t scale_code);

/* Value of one code in a sub-block with params g (the dequantization's operations). */
static inline float mq_kq_value(const mq_kq_info *t, const mq_gparams *g, uint8_t code) {
    if (t->table) return g->scale * (float)t->table[code];
    return t->zero < 0 ? g->scale * (float)code - g->zero : g->scale * (float)((int)code - t->zero);
}

/* Round n values to the grid of a sub-block with step `step` and offset `off` (the nearest code,
 * ties to even, clamped to qmin..qmax; step 0: the code of the value 0 or -off; a table type:
 * the code whose table value is nearest x / step, a tie to the lower). code and dq may be
 * NULL. Per value a step and offset (GPTQ's column: one row each): mq_kq_qdq_column. */
void mq_kq_qdq(const mq_kq_info *t, float step, float off, const float *x, int64_t n,
               uint8_t *code, float *dq);
void mq_kq_qdq_column(const mq_kq_info *t, const float *step, const float *off, const float *x,
                      int64_t n, uint8_t *code, float *dq);

/* The scales of one block of t->block values x[i * stride] (w: t->block non-negative weights of
 * the squared error, contiguous; NULL: plain squared error) into g[0 .. block/sub): each
 * sub-block's step and offset fitted by weighted least squares over a grid of trial scales (as
 * ggml's make_qkx2_quants / make_qx_quants; a table type: trials that put the largest value near
 * either end of the table, each refitted for its nearest codes), then the fp16 super-scales and the integer
 * sub-scales: with s->mse the super-scale searched over the spec's grid (mse_lo .. mse_hi times
 * the max-based one, mse_steps points) and each sub-block's multipliers among the neighbours of
 * their rounded values, each candidate scored by the weighted squared error of the values
 * rounded to its exact grid; without, ggml's own choice (max / 63 and rounding). Deterministic;
 * non-finite x is the caller's to reject. */
void mq_kq_fit_block(const mq_kq_info *t, const mq_qspec *s, const float *x, int64_t stride,
                     const float *w, mq_gparams *g);

/* mq_kq_fit_block, also giving the block's fp16 super-scales: d (every sub-block's step is d
 * times its multiplier) and dmin (Q4_K/Q5_K: every offset is dmin times its min; else 0). */
void mq_kq_fit_block_d(const mq_kq_info *t, const mq_qspec *s, const float *x, int64_t stride,
                       const float *w, mq_gparams *g, float *d, float *dmin);
/* One sub-block of t->sub values x[i * stride] (w: their weights, or NULL) under the fixed
 * super-scales d and dmin of its block: its continuous fit as mq_kq_fit_block's, then the
 * multipliers (and mins) within 2 of the rounded ones (with s->mse; else the rounded ones), each
 * scored by the weighted squared error on the exact grid. GPTQ chooses a sub-block so when its
 * first column comes, the super-scales having been fixed at the block's first. */
void mq_kq_fit_sub(const mq_kq_info *t, const mq_qspec *s, const float *x, int64_t stride,
                   const float *w, float d, float dmin, mq_gparams *g);

/* The grid errors of nc candidate grids of one sub-block (step[c], off[c]: as mq_kq_qdq's):
 * sse[c] = sum over i = 0..n-1, in that order, in double, of (w[i] * d) * d (w NULL: d * d),
 * d = (double)x[i * stride] - the value of x's code on that grid. The block search scores every
 * candidate through this. step, off and sse hold nc rounded up to a multiple of 8 entries (the
 * lanes past nc are read and written but meaningless). */
void mq_kq_sse_ref(const mq_kq_info *t, const float *step, const float *off, int nc, const float *x,
                   int64_t n, int64_t stride, const float *w, double *sse);

/* The sub-block's own numbers the asymmetric fit's trials share (see mq_kq_asym_trials_ref). */
typedef struct {
    float min;            /* the values' min (clamped to 0 from above when clamp) */
    float sum_w, sum_x;   /* sum of w[i], of w[i] * x[i] (float, in order) */
    int nmax;             /* the largest code */
    bool clamp;           /* the grid must reach 0 (the K-quants' unsigned mins) */
} mq_kq_sums;
/* The asymmetric sub-block fit's trials (ggml's make_qkx2_quants): for trial k < nt, codes
 * l_i = rint(iscale[k] * (x_i - min)) clamped to 0..nmax, the float sums over i in order of
 * w_i l_i, (w_i l_i) l_i and (w_i l_i) x_i (w NULL: 1) give D[k] = sum_w sum_ll - sum_l^2 and
 * the least-squares sc[k], mn[k] (mn 0 and sc = sum_xl / sum_ll when clamp and mn > 0), and
 * e[k] the sum in double of (w_i d_i) d_i, d_i = sc l_i + mn - x_i in float. Where !(D[k] > 0)
 * the others are meaningless. The arrays hold nt rounded up to a multiple of 8. */
void mq_kq_asym_trials_ref(const float *x, int64_t n, int64_t stride, const float *w,
                           const mq_kq_sums *s, const float *iscale, int nt, float *D, float *sc,
                           float *mn, double *e);

/* The symmetric sub-block fit's trials (ggml's make_qx_quants): for trial k < nt, codes
 * l_i = rint(iscale[k] * x_i) clamped to -nmax..nmax-1 and the float sums over i in order of
 * (w_i x_i) l_i into sumlx[k] and (w_i l_i) l_i into suml2[k] (w NULL: 1). The arrays hold nt
 * rounded up to a multiple of 8. */
void mq_kq_sym_trials_ref(const float *x, int64_t n, int64_t stride, const float *w, int nmax,
                          const float *iscale, int nt, float *sumlx, float *suml2);

/* The table fit's trials (kquant.c's fit_table; tab: 16 ascending values): for trial k < nt,
 * codes l_i = the table index nearest x_i * iscale[k] (mq_kq_qdq's rounding) and the float
 * sums over i in order of (w_i x_i) t_i into sxt[k] and (w_i t_i) t_i into stt[k],
 * t_i = tab[l_i] (w NULL: 1). The arrays hold nt rounded up to a multiple of 8. */
void mq_kq_table_trials_ref(const int8_t *tab, const float *x, int64_t n, int64_t stride,
                            const float *w, const float *iscale, int nt, float *sxt, float *stt);

/* Packs one block from its groups (t->block / t->sub params) and t->block codes. false when the
 * groups imply no single fp16 d (and dmin) or a code or multiplier is out of range (not from
 * this file's fit). */
bool mq_kq_pack_block(const mq_kq_info *t, const mq_gparams *g, const uint8_t *codes, uint8_t *blk);
/* The inverse: groups and codes of one block (any bytes decode; values as ggml's). */
void mq_kq_unpack_block(const mq_kq_info *t, const uint8_t *blk, mq_gparams *g, uint8_t *codes);

/* Round-to-nearest of one row of cols values (a multiple of t->block): each block fitted
 * (mq_kq_fit_block, w per column or NULL) and rounded; params [cols / t->sub], codes [cols]. */
void mq_kq_quantize_row(const mq_kq_info *t, const mq_qspec *s, const float *x, int64_t cols,
                        const float *w, mq_gparams *params, uint8_t *codes);
/* The row's values: out[i] = mq_kq_value of code i in its sub-block. */
void mq_kq_dequant_row(const mq_kq_info *t, const mq_gparams *params, const uint8_t *codes,
                       int64_t cols, float *out);

#endif
