/*
 * NVFP4 activation fake quantization for W4A4 emulation, following torchao's dynamic activation
 * path (NVFP4Tensor with use_dynamic_per_tensor_scale, torchao_gptq.md sections 7 and 11): one
 * per-tensor scale from the amax of the whole 2D activation, E4M3 block scales over 16 inputs
 * clamped to [2^-6, 448], data scaled by the reciprocal r = (1/g)/s, dequant e2m1 * (g * s).
 *
 * Q8_0 activation rounding as llama.cpp's CPU backend applies it to the inputs of its Q4_0, Q4_1
 * (Q8_1: the same values), NVFP4 and Q8_0 matmuls (quantize_row_q8_0 of ggml-cpu's x86 AVX/AVX2
 * path, read in its source): blocks of 32 along each row, d = amax / 127 in fp32, stored as fp16;
 * the values are scaled by 127 / amax (from the unrounded amax, not by 1 / fp16(d)) and rounded
 * half to even; the dot product then sees fp16(d) * q.
 */
#include <math.h>

#include "formats/formats.h"

#define ACT_ROWS_PER_TASK 16

typedef struct act_ctx act_ctx;
struct act_ctx {
    float *x;
    int64_t cols;
    float g, inv_g;                              /* NVFP4: the per-tensor scale, its reciprocal */
    void (*row)(const act_ctx *c, float *row);   /* rounds one row of cols values in place */
};

static void rows_task(void *vctx, int64_t r0, int64_t r1) {
    const act_ctx *c = vctx;
    for (int64_t r = r0; r < r1; r++) c->row(c, c->x + r * c->cols);
}

static void nvfp4_row(const act_ctx *c, float *row) {
    for (int64_t b = 0; b < c->cols; b += 16) {
        int64_t n = c->cols - b < 16 ? c->cols - b : 16;
        float amax = mq_absmax(row + b, n);
        float t = (amax / 6.0f) / c->g;
        t = t < 0x1p-6f ? 0x1p-6f : t > 448.0f ? 448.0f : t;
        float s = mq_e4m3_decode(mq_e4m3_encode(t));
        float rcp = c->inv_g / s;
        float step = c->g * s;
        for (int64_t i = 0; i < n; i++)
            row[b + i] = mq_e2m1_decode(mq_e2m1_encode(row[b + i] * rcp)) * step;
    }
}

void mq_nvfp4_act_qdq(float *x, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    float amax = mq_absmax(x, rows * cols);
    if (!(amax > 0) || !isfinite(amax)) return;
    act_ctx c = {x, cols, amax / 2688.0f, 0.0f, nvfp4_row};
    c.inv_g = 1.0f / c.g;
    if (!(c.g > 0) || !isfinite(c.inv_g)) return;   /* amax too small for the scales: as is */
    mq_parallel_ranges(rows, ACT_ROWS_PER_TASK, true, rows_task, &c);
}

/* One row of mq_q8_0_act_qdq (see formats.h); a block shorter than 32 at the end of the row if
 * n % 32 != 0. */
static void q8_0_row(const act_ctx *c, float *row) {
    const int64_t n = c->cols;
    for (int64_t b = 0; b < n; b += 32) {
        int64_t m = n - b < 32 ? n - b : 32;
        float amax = mq_absmax(row + b, m);
        if (!isfinite(amax)) continue;   /* llama.cpp's block would be meaningless: as is */
        float d = mq_f16_to_f32(mq_f32_to_f16(amax / 127.0f));
        float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        for (int64_t i = 0; i < m; i++) {
            float q = rintf(row[b + i] * id);   /* default rounding mode: half to even */
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
            row[b + i] = d * q;
        }
    }
}

/* One row of mq_q8_k_act_qdq (see formats.h): quantize_row_q8_K_ref's operations per block of
 * 256 (a shorter last block where n % 256 != 0; llama.cpp's K-quant rows have none). */
static void q8_k_row(const act_ctx *c, float *row) {
    const int64_t n = c->cols;
    for (int64_t b = 0; b < n; b += 256) {
        const int64_t m = n - b < 256 ? n - b : 256;
        float *x = row + b, amax = 0.0f, max = 0.0f;
        for (int64_t i = 0; i < m; i++) {   /* the first value of the largest magnitude, signed */
            const float a = fabsf(x[i]);
            if (a > amax) amax = a, max = x[i];
        }
        if (!isfinite(amax) || isnan(mq_absmax(x, m))) continue;   /* meaningless: as is */
        if (amax == 0.0f) continue;   /* d = 0, q = 0: the values are 0 already */
        const float iscale = -127.0f / max, d = 1.0f / iscale;
        for (int64_t i = 0; i < m; i++) {
            float q = (float)(int)rintf(iscale * x[i]);   /* nearest_int: half to even, an int (+0) */
            q = q > 127.0f ? 127.0f : q;
            x[i] = d * q;
        }
    }
}

/* A row or two (decode) is one piece: mq_parallel_for runs it here, with no pool wake-up. */
void mq_q8_k_act_qdq(float *x, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    act_ctx c = {x, cols, 0.0f, 0.0f, q8_k_row};
    mq_parallel_ranges(rows, ACT_ROWS_PER_TASK, true, rows_task, &c);
}

void mq_q8_0_act_qdq(float *x, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    act_ctx c = {x, cols, 0.0f, 0.0f, q8_0_row};
    mq_parallel_ranges(rows, ACT_ROWS_PER_TASK, true, rows_task, &c);
}
