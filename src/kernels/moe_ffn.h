/*
 * Quantized MoE feed-forward op: internal layout, kernel interface and the entry points the model
 * runtime uses (the public op is moeq_moe_ffn in include/moeq.h, which documents the semantics).
 *
 * Packed layout. Every weight matrix W [rows, cols] (rows = outputs, cols = K = reduction) is a
 * sequence of row blocks of 8 rows; rows is always a multiple of 16 (group sizes divide D and F;
 * a packed dense Linear pads), so kernels work on tile pairs of two row blocks (16 rows). A row
 * block of K columns is
 *   codes:  K/8 chunks of 32 bytes; chunk c, byte 4*l + i (lane l = row 0..7, i = 0..3) holds
 *           the code of (row l, col 8c+i) in its low nibble and of (row l, col 8c+4+i) in its
 *           high nibble -- so one 32-byte load gives, after a mask and a shift, four consecutive
 *           columns of all 8 rows per 32-bit lane: the operand shape of _mm256_maddubs_epi16;
 *   scales: K/group entries of 8 (one per row): INT4 fp16/bf16 when lossless, else fp32; NVFP4
 *           the E4M3 byte;
 *   padding to 64 bytes. Row blocks follow each other, so a tile pair is one contiguous stream
 *   and the kernels prefetch a pair some 24 KiB ahead into L2 while they work on the current one.
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
 *   y[r] = sum_blocks fma(float(I), sw[r, block] * sa[block], acc) * mul / div
 * with mul = div = 1 (INT4); NVFP4 div = 2 * global_scale (compressed-tensors divisor) or mul =
 * global_scale, div = 2 (ModelOpt multiplier); the 2 undoes the doubled E2M1 values.
 *
 * Runtime integration (src/model is not touched here; the lead wires it):
 *  - MoE layer: mq_moe_experts_from_qtensors(gate[E], up[E], down[E], E, shared gate/up/down or
 *    NULL, "model.layers.N.mlp", &experts) once at load; then per forward fill an mq_moe_layer
 *    {experts, router [E, D], selection bias or NULL, shared_expert_gate [D] or NULL, top_k,
 *    scoring, renormalize, route_scale} and call mq_moe_layer_forward(&L, x, T, out). Resident
 *    bytes: moeq_moe_experts_bytes(). MOEQ_E_UNSUPPORTED (asymmetric INT4, act-order, other
 *    schemes/groups) means: keep the dequantized fp32 path for that layer.
 *  - Any other quantized Linear (attention, dense MLP): mq_packed_weight_from_qtensor() into
 *    mq_linear.qw, mq_packed_weight_forward(qw, x, T, y) then add the bias; free with
 *    mq_packed_weight_free().
 */
#ifndef MOEQ_KERNELS_MOE_FFN_H
#define MOEQ_KERNELS_MOE_FFN_H

#include "core/core.h"
#include "formats/formats.h"

#define MQ_MOE_RB 8      /* rows per row block */
#define MQ_MOE_NT 4      /* tokens per micro-tile (kernels take any count; this is the tile) */

/* Storage of the per-group weight scales inside a row block. INT4 scales are stored in 16 bits
 * when every scale of the tensor set is exactly representable (checkpoints keep BF16 or F16
 * scales), else in fp32; NVFP4 keeps the E4M3 byte. */
typedef enum { MQ_MOE_S_F32 = 0, MQ_MOE_S_F16, MQ_MOE_S_BF16, MQ_MOE_S_E4M3 } mq_moe_stype;
size_t mq_moe_stype_bytes(mq_moe_stype t);

/* One packed matrix. */
typedef struct {
    const uint8_t *data;   /* row block 0 (64-byte aligned) */
    size_t rb_bytes;       /* bytes per row block */
    int32_t rows, cols;    /* packed rows (a multiple of 16), cols % group == 0 */
    int32_t group;         /* columns per weight scale: INT4 group size, NVFP4 16 */
    int32_t nvfp4;         /* 0: INT4; 1: NVFP4 */
    int32_t stype;         /* mq_moe_stype of the scales */
    float mul[2], div[2];  /* row block h of a pair: result = acc * mul[h] / div[h] */
    int32_t neg_scales;    /* NVFP4: some E4M3 scale has its sign bit set (slower decode) */
} mq_pmat;

/* Bytes of one packed row block of K columns. */
size_t mq_moe_rb_bytes(int32_t cols, int32_t group, mq_moe_stype st);

/* Where the codes and scales of one [rows, cols] source matrix are. The scale of (row r, group g)
 * is read at scales + (r * (cols / group) + g) * scale_stride: a float for INT4, a byte (E4M3) for
 * NVFP4 (the stride lets callers pass arrays of structs such as mq_gparams). */
typedef struct {
    const uint8_t *codes;    /* [rows, cols] */
    const uint8_t *scales;
    size_t scale_stride;
    float global_scale;      /* NVFP4 */
    int global_mul;          /* NVFP4: 0 = divisor (compressed-tensors weight_global_scale),
                                1 = multiplier (ModelOpt weight_scale_2) */
} mq_moe_src;

/* Packs rows [row0, row0 + 8) of src into one row block at dst; rows >= src_rows are padding
 * (weight 0). Codes must be 0..15 and INT4 scales representable in st (checked by the caller). */
void mq_moe_pack_rb(const mq_moe_src *src, int64_t src_rows, int32_t cols, int32_t group, int nvfp4,
                    mq_moe_stype st, int64_t row0, uint8_t *dst);

/* ---- packed experts ---------------------------------------------------------------------------- */
typedef struct {
    int32_t ffn;
    mq_pmat gate_up;   /* 2F rows, gate/up row blocks interleaved */
    mq_pmat down;      /* D rows */
} mq_pexpert;

struct moeq_moe_experts {
    moeq_moe_scheme scheme;
    int32_t group, E, D, F, Fs;
    int32_t n_mats;        /* E, plus 1 for the shared expert (last) */
    mq_pexpert *ex;
    uint8_t *blob;
    size_t blob_bytes;
};

/* The unpacked weights of one expert (the shared one included): gate and up [ffn, D], down
 * [D, ffn]. */
typedef struct {
    int32_t ffn;
    mq_moe_src gate, up, down;
} mq_moe_expert_src;

/* Validates the values (codes 0..15, finite scales, E4M3 not NaN, NVFP4 global scales finite and
 * > 0) and packs E routed experts plus, when has_shared, src[E] as the shared expert. `what`
 * prefixes error messages; names[3] name gate, up and down (e.g. "gate_up" with up_row_offset F
 * for the fused descriptor, so rows are reported in the fused numbering). */
typedef struct {
    const char *what;
    const char *gate, *up, *down;
    int up_row_offset;     /* report up rows as row + F (fused gate_up numbering) */
} mq_moe_names;
moeq_status mq_moe_experts_build(int nvfp4, int32_t group, int32_t E, int32_t D,
                                 const mq_moe_expert_src *src, int has_shared,
                                 const mq_moe_names *names, moeq_moe_experts **out);

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

/* Kernel set: a scalar reference and SIMD twins (AVX2+FMA, AVX-512, NEON) with bit-identical
 * results. */
typedef struct {
    /* Quantizes n (a multiple of A->block) values x into row `row` of A, starting at column col0
     * (a multiple of A->block). */
    void (*quant_act)(const float *x, int64_t n, const mq_qact *A, int64_t row, int64_t col0);
    /* For tile pairs [pair0, pair1) of W and m activation rows (A row act_rows[i], or row0 + i
     * when act_rows is NULL): plain: out[i*ldo + 16*pair + r] = row (16 pair + r) result;
     * swiglu: out[i*ldo + 8*(pair - pair0) + r] = silu(gate_r) * up_r (r = 0..7).
     * next: where the calling thread reads next once W's rows run out (the first pair of its next
     * work item, in another matrix), or NULL: a prefetch hint only, never dereferenced. */
    void (*gemm)(const mq_pmat *W, int64_t pair0, int64_t pair1, const mq_qact *A,
                 const int32_t *act_rows, int64_t row0, int64_t m, float *out, int64_t ldo,
                 int swiglu, const uint8_t *next);
} mq_moe_kernels;

extern const mq_moe_kernels mq_moe_kernels_ref;
#if defined(__x86_64__) || defined(__i386__)
extern const mq_moe_kernels mq_moe_kernels_avx2;
/* AVX-512 twins (moe_avx512_body.h): F/BW/VL only when mq_cpu_has_avx512(), with VNNI only when
 * mq_cpu_has_avx512_vnni(). */
extern const mq_moe_kernels mq_moe_kernels_avx512;
extern const mq_moe_kernels mq_moe_kernels_avx512_vnni;
#endif
#if defined(__aarch64__)
/* NEON twins (src/kernels/cpu/arm/): every AArch64 CPU; with SDOT only when
 * mq_cpu_has_neon_dot(). */
extern const mq_moe_kernels mq_moe_kernels_neon;
extern const mq_moe_kernels mq_moe_kernels_neon_dot;
#endif
/* The kernels the op uses now (src/kernels/kernels.c: the row of mq_cpu_isa()): AVX-512 (with
 * VNNI) or AVX2, the best the CPU has (on Arm NEON, with SDOT when the CPU has it), when
 * mq_force_ref() is off. */
const mq_moe_kernels *mq_moe_kernels_active(void);


/* The op's argument checks, shared with the GPU op (moeq_moe_cuda_*): the routing arguments of a
 * layer of E experts of width D with a shared expert of width Fs (0: none), and x, F32 [T, D]
 * (T into *T). Messages start with `op`. */
moeq_status mq_moe_routing_check(const char *op, const moeq_moe_ffn_args *a, int64_t E, int64_t D, int32_t Fs);
moeq_status mq_moe_x_check(const char *op, const moeq_tensor_ref *x, int64_t D, int64_t *T);

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
    int32_t n_group, topk_group;    /* group-limited selection (moeq_moe_ffn_args); 0: none */
} mq_moe_layer;

/* The op's expert choice for one token (the scalar routine the op runs; tests compare it with
 * an obvious implementation): scores s[e] = p[e] + bias[e] (bias may be NULL), restricted to the
 * topk_group best of n_group groups when n_group > 1 (group score: its two largest s), then the
 * k largest, slot j the j-th largest, ties to the lower index, NaN below every number. taken:
 * scratch of E bytes. */
void mq_moe_select(const float *p, const float *bias, int64_t E, int32_t k, int32_t n_group,
                   int32_t topk_group, uint8_t *taken, int32_t *sel);

/* out [T, D] = the layer applied to x [T, D]. */
moeq_status mq_moe_layer_forward(const mq_moe_layer *L, const float *x, int64_t T, float *out);
void mq_moe_layer_free(mq_moe_layer *L);   /* frees the experts, keeps the borrowed tensors */

/* Experts of one MoE layer from the formats module's quantized tensors: gate[e], up[e] [F, D] and
 * down[e] [D, F] for e < E; sh_gate/sh_up/sh_down the shared expert (all NULL when none). All
 * share one scheme (NVFP4, or symmetric INT4 with a group that is a multiple of 32) and group
 * size, without act-order; NVFP4 global scales follow each tensor's spec.nvfp4_conv (gate and up
 * may differ). MOEQ_E_UNSUPPORTED otherwise, so the caller keeps its dequantized path. `what`
 * (e.g. "model.layers.3.mlp") prefixes messages. The tensors are not referenced afterwards. */
moeq_status mq_moe_experts_from_qtensors(const mq_qtensor *gate, const mq_qtensor *up,
                                         const mq_qtensor *down, int32_t E,
                                         const mq_qtensor *sh_gate, const mq_qtensor *sh_up,
                                         const mq_qtensor *sh_down, const char *what,
                                         moeq_moe_experts **out);

/* A dense Linear kept packed (model.h's struct mq_packed_weight), e.g. attention projections or
 * a dense MLP of a quantized checkpoint. Rows are padded to a multiple of 16 internally. */
struct mq_packed_weight {
    mq_pmat W;
    uint8_t *blob;
    size_t bytes;
    int32_t out, in;
    /* Asymmetric blocks (a GGUF's Q4_K and Q4_1, ggml_mat.h): weight (r, c) = W's symmetric INT4
     * value + off[r * (in / 32) + c / 32], so y[t, r] gains dot(off row r, the sums of x[t]'s
     * blocks of 32) (fp32 sums and vec.h's dot, in a fixed order). NULL: none. off_at: its
     * byte offset in blob (the cache keeps it). */
    const float *off;
    size_t off_at;
};
moeq_status mq_packed_weight_from_qtensor(const mq_qtensor *q, const char *name,
                                          struct mq_packed_weight **out);
void mq_packed_weight_free(struct mq_packed_weight *w);
size_t mq_packed_weight_bytes(const struct mq_packed_weight *w);
/* y [T, out] = x [T, in] W^T (no bias), on the pool, activations as split int16 blocks (the same
 * numerics as the MoE op), plus the offsets' term when off is set. */
moeq_status mq_packed_weight_forward(const struct mq_packed_weight *w, const float *x, int64_t T,
                                     float *y);
/* y[k] = x W_k^T for n (1..MQ_LIN_MAX) Linears of one input width and scheme (INT4 or NVFP4),
 * on one quantization of x and one pool loop: each y[k] has exactly the bits of
 * mq_packed_weight_forward(w[k], x, T, y[k]) (a layer's q, k and v at decode: one wake-up of
 * the pool instead of three). MOEQ_E_ARG for other widths or schemes. */
enum { MQ_LIN_MAX = 3 };
moeq_status mq_packed_weights_forward(const struct mq_packed_weight *const *w, int n,
                                      const float *x, int64_t T, float *const *y);

/* Frees the op's cached scratch workspace (kept between calls; sized by the largest call). */
void mq_moe_workspace_free(void);

/* Streaming read bandwidth of this machine on the pool (GB/s), reading `bytes` repeatedly for at
 * least min_seconds (bench helper). */
double mq_measure_read_gbps(size_t bytes, double min_seconds);

#endif
