/*
 * FP8 block-quantized weights (io/fp8.h has the format): the block dequantization, E4M3 codes
 * (formats' mq_e4m3_decode) times their block's scale, which ckpt/source.c links to each weight
 * view (mq_st_link_fp8) when config.json's quantization_config says the checkpoint is FP8; io's
 * mq_tensor_to_f32 and mq_fp8_dequant_rows check the view and the rows, then call it.
 */
#include <math.h>
#include <string.h>

#include "formats/formats.h"
#include "ckpt/source.h"

static float scale_at(const mq_tensor_view *s, int64_t i) {
    const uint8_t *p = s->data;
    uint16_t h;
    float f;
    switch (s->dtype) {
    case MOEQ_DT_BF16:
        memcpy(&h, p + 2 * i, 2);
        return mq_bf16_to_f32(h);
    case MOEQ_DT_F16:
        memcpy(&h, p + 2 * i, 2);
        return mq_f16_to_f32(h);
    default:   /* F32, checked when the scale was linked */
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
}

moeq_status mq_fp8_block_dequant(const mq_tensor_view *w, int64_t r0, int64_t nr, float *out) {
    const mq_tensor_view *s = w->scale_inv;
    const int64_t C = w->shape[1], br = w->block_rows, bc = w->block_cols;
    const int64_t SC = (C + bc - 1) / bc;
    for (int64_t r = r0; r < r0 + nr; r++) {
        const uint8_t *codes = w->data + r * C;
        float *o = out + (r - r0) * C;
        const int64_t sr = r / br;
        for (int64_t cb = 0; cb < SC; cb++) {
            const float sc = scale_at(s, sr * SC + cb);
            if (!isfinite(sc))
                return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': scale [%lld, %lld] is %g (not "
                              "finite)", s->file ? s->file : "?", s->name, (long long)sr,
                              (long long)cb, (double)sc);
            const int64_t c1 = (cb + 1) * bc < C ? (cb + 1) * bc : C;
            for (int64_t c = cb * bc; c < c1; c++) {
                if ((codes[c] & 0x7F) == 0x7F)
                    return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': NaN code 0x%02X at row %lld, "
                                  "column %lld", w->file ? w->file : "?", w->name, codes[c],
                                  (long long)r, (long long)c);
                o[c] = mq_e4m3_decode(codes[c]) * sc;
            }
        }
    }
    return MOEQ_OK;
}
