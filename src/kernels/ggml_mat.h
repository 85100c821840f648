/*
 * Matrices kept in a GGUF file's ggml blocks, mapped, never copied to fp32 (issue 56):
 *
 *  - mq_ggml_mat: one [rows, cols] matrix of ggml blocks (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
 *    NVFP4, and through formats/kquant.h's block unpacking Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K)
 *    read in place. A row is decoded into a small fp32 buffer when used; y = x W^T then
 *    takes one dot product per (row, token) through the vector kernels (kernels/vec.h: a scalar
 *    reference and SIMD twins with one lane layout), so a row is decoded once for all T tokens.
 *    The decoded values are exactly the values io's decoder gives (mq_ggml_dequantize: every
 *    block's value is one product of small integers and an f16/UE4M3 scale, exact in fp32; NVFP4's
 *    global multiplier is applied to each value as the view does), so only the order of the
 *    sums differs from the fp32 path. llama's q/k rows (stored rotated per head, io/gguf_hf.h)
 *    are read through the row map of perm_hd.
 *  - mq_moe_experts_from_ggml: the routed experts of a MoE layer stored Q4_0 or NVFP4 repacked
 *    into the fused MoE op's layout (kernels/moe_ffn.h) a row block at a time, with no fp32 and no
 *    whole-matrix code copy. Q4_0's block (fp16 d, 32 codes q, value (q - 8) d) is INT4 g32
 *    symmetric with code q and scale d stored as f16 (exact: it is an f16). NVFP4's block (4 UE4M3
 *    scales, 64 E2M1 codes) is the op's NVFP4 with E4M3 scale bytes (the sign bit cleared; 0x7F,
 *    which ggml reads as 0, stored as 0) and the file's per-matrix scale as the multiplier.
 */
#ifndef MOEQ_KERNELS_GGML_MAT_H
#define MOEQ_KERNELS_GGML_MAT_H

#include "core/core.h"
#include "kernels/moe_ffn.h"

/* ggml's type numbers this module reads (io/gguf.h's MQ_GGML_*; repeated here so that kernels
 * do not include io). */
enum {
    MQ_GM_F32 = 0, MQ_GM_F16 = 1, MQ_GM_Q4_0 = 2, MQ_GM_Q4_1 = 3, MQ_GM_Q5_0 = 6, MQ_GM_Q5_1 = 7,
    MQ_GM_Q8_0 = 8, MQ_GM_Q3_K = 11, MQ_GM_Q4_K = 12, MQ_GM_Q5_K = 13, MQ_GM_Q6_K = 14,
    MQ_GM_IQ4_NL = 20, MQ_GM_IQ4_XS = 23,
    MQ_GM_BF16 = 30, MQ_GM_NVFP4 = 40,
};

typedef struct mq_ggml_mat {
    const uint8_t *data;   /* row 0's first block (borrowed: the mapped file) */
    uint32_t type;         /* MQ_GM_* */
    int64_t rows, cols;
    size_t row_bytes;      /* bytes of one stored row */
    float scale;           /* every value times this (NVFP4's NAME.scale), 1 otherwise */
    int32_t perm_hd;       /* > 0: HF row h*hd + j*hd/2 + i is stored row h*hd + 2i + j */
} mq_ggml_mat;

/* Whether the module reads type; values per block and bytes per block. */
bool mq_ggml_mat_type_ok(uint32_t type, int64_t *block, size_t *block_bytes);
/* Fills *m for a matrix at data (rows x cols values of type): MOEQ_E_UNSUPPORTED when the type
 * is not read here or cols is not whole blocks (name in the message). */
moeq_status mq_ggml_mat_init(mq_ggml_mat *m, const uint8_t *data, uint32_t type, int64_t rows,
                             int64_t cols, float scale, int32_t perm_hd, const char *name);
/* Bytes of the matrix in the file. */
size_t mq_ggml_mat_bytes(const mq_ggml_mat *m);
/* HF row r's values (cols floats) into out. */
void mq_ggml_mat_row(const mq_ggml_mat *m, int64_t r, float *out);
/* y [T, rows] = x [T, cols] W^T on the pool (inline when called from a pool task). Fails only
 * for the row buffers (MOEQ_E_NOMEM). */
moeq_status mq_ggml_mat_forward(const mq_ggml_mat *m, const float *x, int64_t T, float *y);

/* Dot products of one stored row with x, without decoding it: Q8_0 (nb blocks of 32) and BF16
 * (n a multiple of 8). bf16_rows: the BF16 dot products of up to MQ_GM_BF16_ROWS stored rows with
 * T rows of x, y[t * ldy + r] = bf16(rows[r], x + t * ldx, n), bit for bit (a twin may compute
 * several pairs at once: each pair's operations stay bf16's). A scalar reference, an AVX2+FMA twin
 * with the same bits (the lane layout in cpu/x86/ggml_dot_avx2.c) and an AVX-512 one whose
 * bf16_rows holds a tile of rows and tokens in registers (cpu/x86/ggml_dot_avx512.c). */
enum { MQ_GM_BF16_ROWS = 8 };
typedef struct {
    float (*q8_0)(const uint8_t *row, const float *x, int64_t nb);
    float (*bf16)(const uint8_t *row, const float *x, int64_t n);
    void (*bf16_rows)(const uint8_t *const *rows, int64_t nr, const float *x, int64_t ldx, int64_t T,
                      int64_t n, float *y, int64_t ldy);
} mq_ggml_dot_kernels;
extern const mq_ggml_dot_kernels mq_ggml_dot_ref;
#if defined(__x86_64__) || defined(__i386__)
extern const mq_ggml_dot_kernels mq_ggml_dot_avx2;
extern const mq_ggml_dot_kernels mq_ggml_dot_avx512;
/* the AVX2 twin's single-row products, which the AVX-512 row shares */
float mq_ggml_dot_q8_0_avx2(const uint8_t *row, const float *x, int64_t nb);
float mq_ggml_dot_bf16_avx2(const uint8_t *row, const float *x, int64_t n);
#endif
/* The twin in use (kernels.c's table): AVX-512 or AVX2 as the CPU has them and mq_force_ref() is
 * off, else the reference. */
const mq_ggml_dot_kernels *mq_ggml_dot(void);

/* One expert's three matrices for the repack: gate and up [F, D], down [D, F]. */
typedef struct {
    mq_ggml_mat gate, up, down;
} mq_ggml_expert;

/* Packs E routed experts (plus ex[E] as the shared expert when has_shared) of one type (Q4_0 or
 * NVFP4, the same for all) into the MoE op's layout. MOEQ_E_UNSUPPORTED when the types differ,
 * are other types, or the shapes do not fit the op (D and F multiples of 16 and of the group);
 * what prefixes messages. (A mapped cache's blob is put under a layout by model/pack_cache.c.) */
moeq_status mq_moe_experts_ggml_check(const mq_ggml_expert *ex, int32_t E, int has_shared,
                                      const char *what);   /* the checks alone */
moeq_status mq_moe_experts_from_ggml(const mq_ggml_expert *ex, int32_t E, int has_shared,
                                     const char *what, moeq_moe_experts **out);

/* A dense Linear stored Q4_0 or NVFP4 repacked into the packed Linear's layout (moe_ffn.h's
 * struct mq_packed_weight; rows padded to 16); MOEQ_E_UNSUPPORTED for other types. */
moeq_status mq_packed_weight_ggml_check(const mq_ggml_mat *m, const char *name);   /* checks */
moeq_status mq_packed_weight_from_ggml(const mq_ggml_mat *m, const char *name,
                                       struct mq_packed_weight **out);

#endif
