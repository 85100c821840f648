/*
 * Quantized MoE feed-forward op: internal layout, kernel interface and the entry points the model
 * runtime uses (the public op is moeq_moe_ffn in include/moeq.h, which documents the semantics).
 *
 * Packed layout. Every weight matrix W [rows, cols] (rows = outputs, cols = K = reduction) is a
 * sequence of row blocks of 8 rows; rows is always a multiple of 16 (group sizes divide D and F),
 * so kernels work on tile pairs of two row blocks (16 rows). A row block of K columns is
 *   codes:  K/8 chunks of 32 bytes; chunk c, byte 4*l + i (lane l = row 0..7, i = 0..3) holds
 *           the code of (row l, col 8c+i) in its low nibble and of (row l, col 8c+4+i) in its
 *           high nibble -- so one 32-byte load gives, after a mask and a shift, four consecutive
 *           columns of all 8 rows per 32-bit lane: the operand shape of _mm256_maddubs_epi16;
 *   scales: K/group entries of 8 (one per row): fp32 (INT4) or the E4M3 byte (NVFP4);
 *   padding to 64 bytes.
 * gate_up interleaves its halves: tile pair i = (gate rows 8i..8i+7, up rows 8i..8i+7), so the
 * SwiGLU of 8 outputs happens in registers. down keeps the natural order (pair i = rows 16i..).
 *
 * Integer arithmetic. Weights are used as unsigned bytes u = value + offset: INT4 u = q + 8
 * (the code itself), NVFP4 u = 2*e2m1 + 12 (0..24, via a 16-entry table). Activations are
 * quantized per block of B columns (INT4 B = 32, NVFP4 B = 16; mq_qact below) to int16 split
 * into two int8 planes (about 90 dB per block). Plain int8 blocks (as llama.cpp's Q8_0) reach only
 * ~45 dB on Gaussian inputs and ~41 dB on the heavier-tailed SwiGLU output, i.e. ~40 dB end to end,
 * so the op uses the split form for both GEMMs; the kernels support both.
 * A block's exact integer product is I = dot(u, v) - corr (|I| < 2^24, exact in fp32), and
 *   y[r] = sum_blocks fma(float(I), sw[r, block] * sa[block], acc) / div
 * with div = 1 (INT4) or 2 * global_scale (NVFP4; the 2 undoes the doubled E2M1 values).
 */
#ifndef MOEQ_KERNELS_MOE_FFN_H
#define MOEQ_KERNELS_MOE_FFN_H

#include "core/core.h"

#define MQ_MOE_RB 8      /* rows per row block */
#define MQ_MOE_NT 4      /* tokens per micro-tile (kernels take any count; this is the tile) */

/* One packed matrix. */
typedef struct {
    const uint8_t *data;   /* row block 0 (64-byte aligned) */
    size_t rb_bytes;       /* bytes per row block */
    int32_t rows, cols;    /* rows % 16 == 0, cols % group == 0 */
    int32_t group;         /* columns per weight scale: INT4 group size, NVFP4 16 */
    int32_t nvfp4;         /* 0: INT4 with fp32 scales; 1: NVFP4 with E4M3 scales */
    float div[2];          /* divisor of the results of the first / second row block of a pair */
} mq_pmat;

/* Bytes of one packed row block of K columns. */
size_t mq_moe_rb_bytes(int32_t cols, int32_t group, int nvfp4);

/* Where the codes and scales of one [rows, cols] source matrix are. The scale of (row r, group g)
 * is read at scales + (r * (cols / group) + g) * scale_stride: a float for INT4, a byte (E4M3) for
 * NVFP4 (the stride lets callers pass arrays of structs such as mq_gparams). */
typedef struct {
    const uint8_t *codes;    /* [rows, cols] */
    const uint8_t *scales;
    size_t scale_stride;
} mq_moe_src;

/* Packs rows [row0, row0 + 8) of src into one row block at dst. Codes must be 0..15 (validated
 * by the caller). */
void mq_moe_pack_rb(const mq_moe_src *src, int32_t cols, int32_t group, int nvfp4, int64_t row0,
                    uint8_t *dst);

/* Quantized activation rows. Per block of B columns:
 *  int8 (q2 == NULL):  q = rne(x * 127 / amax), scale = amax / 127;
 *  int16 split (q2):   v = rne(x * 32512 / amax) in -32512..32512 is kept as two int8 planes,
 *                      q = floor((v + 128) / 256) (-127..127) and q2 = v - 256 q (-128..127),
 *                      scale = amax / 32512; the kernels compute 256 dot(u, q) + dot(u, q2).
 *  corr = offset * sum(v) (offset: 8 for INT4, 12 for NVFP4). A block containing NaN or Inf gets
 *  scale NaN (its products become NaN); a block with amax < 2^-100 is all zero. */
typedef struct {
    int8_t *q;             /* [rows, ld] */
    int8_t *q2;            /* [rows, ld] low plane, or NULL for plain int8 */
    float *scale;          /* [rows, ld / B] */
    int32_t *corr;         /* [rows, ld / B] */
    int64_t ld;            /* row stride of q / q2 (elements); scale/corr stride is ld / B */
    int32_t block;         /* B */
    int32_t offset;        /* weight offset: 8 (INT4) or 12 (NVFP4) */
} mq_qact;

/* Kernel set: a scalar reference and an AVX2+FMA twin with bit-identical results. */
typedef struct {
    /* Quantizes n (a multiple of A->block) values x into row `row` of A, starting at column col0
     * (a multiple of A->block). */
    void (*quant_act)(const float *x, int64_t n, const mq_qact *A, int64_t row, int64_t col0);
    /* For tile pairs [pair0, pair1) of W and m activation rows (A row act_rows[i], or row0 + i
     * when act_rows is NULL): plain: out[i*ldo + 16*pair + r] = row (16 pair + r) result;
     * swiglu: out[i*ldo + 8*(pair - pair0) + r] = silu(gate_r) * up_r (r = 0..7). */
    void (*gemm)(const mq_pmat *W, int64_t pair0, int64_t pair1, const mq_qact *A,
                 const int32_t *act_rows, int64_t row0, int64_t m, float *out, int64_t ldo,
                 int swiglu);
} mq_moe_kernels;

extern const mq_moe_kernels mq_moe_kernels_ref;
#if defined(__x86_64__) || defined(__i386__)
extern const mq_moe_kernels mq_moe_kernels_avx2;
#endif
/* The kernels the op uses now: AVX2 when the CPU has it and mq_force_ref() is off. */
const mq_moe_kernels *mq_moe_kernels_active(void);

/* exp(x) and silu(x) exactly as the kernels compute them (a Cephes-style polynomial; the AVX2
 * kernels evaluate the same operations lane-wise). */
float mq_moe_expf(float x);
float mq_moe_silu(float x);

/* ---- entry points for the model runtime ------------------------------------------------------- */
/* One MoE layer as the runtime holds it: packed experts plus the fp32 routing tensors (borrowed,
 * they must outlive the layer) and the routing options. */
typedef struct {
    moeq_moe_experts *experts;      /* owned */
    const float *router;            /* [E, D] */
    const float *router_bias;       /* [E] or NULL */
    const float *shared_gate;       /* [D] or NULL */
    int32_t top_k;
    moeq_moe_scoring scoring;
    int32_t renormalize;
    float route_scale;
} mq_moe_layer;

/* out [T, D] = the layer applied to x [T, D]. */
moeq_status mq_moe_layer_forward(const mq_moe_layer *L, const float *x, int64_t T, float *out);
void mq_moe_layer_free(mq_moe_layer *L);   /* frees the experts, keeps the borrowed tensors */

/* Streaming read bandwidth of this machine on the pool (GB/s), reading `bytes` repeatedly for at
 * least min_seconds (bench helper). */
double mq_measure_read_gbps(size_t bytes, double min_seconds);

#endif
