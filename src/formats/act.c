/*
 * NVFP4 activation fake quantization for W4A4 emulation, following torchao's dynamic activation
 * path (NVFP4Tensor with use_dynamic_per_tensor_scale, torchao_gptq.md sections 7 and 11): one
 * per-tensor scale from the amax of the whole 2D activation, E4M3 block scales over 16 inputs
 * clamped to [2^-6, 448], data scaled by the reciprocal r = (1/g)/s, dequant e2m1 * (g * s).
 */
#include <math.h>

#include "formats/formats.h"

#define ACT_ROWS_PER_TASK 16

typedef struct {
    float *x;
    int64_t rows, cols;
    float g, inv_g;
} act_ctx;

static void act_task(void *vctx, int64_t task, int thread) {
    (void)thread;
    act_ctx *c = vctx;
    int64_t r1 = (task + 1) * ACT_ROWS_PER_TASK;
    if (r1 > c->rows) r1 = c->rows;
    for (int64_t r = task * ACT_ROWS_PER_TASK; r < r1; r++) {
        float *row = c->x + r * c->cols;
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
}

void mq_nvfp4_act_qdq(float *x, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    float amax = mq_absmax(x, rows * cols);
    if (!(amax > 0) || !isfinite(amax)) return;
    act_ctx c = {x, rows, cols, amax / 2688.0f, 0.0f};
    c.inv_g = 1.0f / c.g;
    if (!(c.g > 0) || !isfinite(c.inv_g)) return;   /* amax too small for the scales: as is */
    mq_parallel_for((rows + ACT_ROWS_PER_TASK - 1) / ACT_ROWS_PER_TASK, act_task, &c);
}
