/*
 * FP8 block-quantized source checkpoints (see fp8.h): the quantization_config checks and the
 * block dequantization (codes through formats' mq_e4m3_decode).
 */
#include "io/fp8.h"

#include "formats/formats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- quantization_config -------------------------------------------------------------------- */

static bool block_side(const cJSON *v, int32_t *out) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= 1 && d <= MQ_FP8_MAX_BLOCK) || d != floor(d)) return false;
    *out = (int32_t)d;
    return true;
}

moeq_status mq_fp8_parse_qconfig(const cJSON *qc, const char *path, mq_fp8_blocks *out) {
    memset(out, 0, sizeof *out);
    if (!cJSON_IsObject(qc)) return MOEQ_OK;
    const cJSON *method = cJSON_GetObjectItemCaseSensitive(qc, "quant_method");
    if (!cJSON_IsString(method) || strcmp(method->valuestring, "fp8") != 0) return MOEQ_OK;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(qc, "fmt");
    if (fmt && (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, "e4m3") != 0)) {
        char *text = cJSON_PrintUnformatted(fmt);
        moeq_status s = mq_err(MOEQ_E_UNSUPPORTED, "%s: quantization_config.fmt %s is not supported "
                               "(FP8 sources are read in \"e4m3\" only)", path, text ? text : "?");
        free(text);
        return s;
    }
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(qc, "activation_scheme");
    if (act && (!cJSON_IsString(act) || strcmp(act->valuestring, "dynamic") != 0)) {
        char *text = cJSON_PrintUnformatted(act);
        moeq_status s = mq_err(MOEQ_E_UNSUPPORTED, "%s: quantization_config.activation_scheme %s is "
                               "not supported (FP8 sources are read with \"dynamic\" activations, "
                               "which carry no input scales)", path, text ? text : "?");
        free(text);
        return s;
    }
    const cJSON *bs = cJSON_GetObjectItemCaseSensitive(qc, "weight_block_size");
    if (!bs)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: quantization_config (quant_method \"fp8\") has no "
                      "weight_block_size: only block-quantized FP8 (weight_scale_inv per block) is "
                      "read", path);
    mq_fp8_blocks b = {0, 0};
    if (!cJSON_IsArray(bs) || cJSON_GetArraySize(bs) != 2 ||
        !block_side(cJSON_GetArrayItem(bs, 0), &b.rows) ||
        !block_side(cJSON_GetArrayItem(bs, 1), &b.cols)) {
        char *text = cJSON_PrintUnformatted(bs);
        moeq_status s = mq_err(MOEQ_E_FORMAT, "%s: quantization_config.weight_block_size %s is not "
                               "[rows, cols] with two integers in 1..%d", path, text ? text : "?",
                               MQ_FP8_MAX_BLOCK);
        free(text);
        return s;
    }
    *out = b;
    return MOEQ_OK;
}

moeq_status mq_fp8_read_dir_config(const char *dir, mq_fp8_blocks *out) {
    memset(out, 0, sizeof *out);
    char *path = mq_path_join(dir, "config.json");
    if (!path) return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status s = MOEQ_OK;
    if (mq_file_exists(path)) {
        char *text = NULL;
        size_t len = 0;
        s = mq_read_file(path, &text, &len);
        cJSON *root = s ? NULL : cJSON_ParseWithLength(text, len);
        free(text);
        if (cJSON_IsObject(root))
            s = mq_fp8_parse_qconfig(cJSON_GetObjectItemCaseSensitive(root, "quantization_config"),
                                     path, out);
        cJSON_Delete(root);
    }
    free(path);
    return s;
}

/* ---- dequantization -------------------------------------------------------------------------- */

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

moeq_status mq_fp8_dequant_rows(const mq_tensor_view *w, int64_t r0, int64_t nr, float *out) {
    const mq_tensor_view *s = w->scale_inv;
    if (!s || w->ndim != 2 || w->dtype != MOEQ_DT_F8_E4M3 || w->block_rows < 1 || w->block_cols < 1)
        return mq_err(MOEQ_E_ARG, "tensor '%s' is not an FP8 block-quantized weight", w->name);
    const int64_t R = w->shape[0], C = w->shape[1], br = w->block_rows, bc = w->block_cols;
    const int64_t SC = (C + bc - 1) / bc;
    if (r0 < 0 || nr < 0 || r0 + nr > R)
        return mq_err(MOEQ_E_ARG, "tensor '%s': rows [%lld, %lld) outside its %lld rows", w->name,
                      (long long)r0, (long long)(r0 + nr), (long long)R);
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
