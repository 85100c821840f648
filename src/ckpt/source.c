/* A source checkpoint directory's config.json and FP8 linking (see source.h). */
#include "ckpt/source.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- config.json -------------------------------------------------------------------------- */

moeq_status mq_config_file_read(const char *dir, char **path, char **text, size_t *len) {
    *text = NULL;
    *len = 0;
    if (path) *path = NULL;
    if (!dir || !mq_dir_exists(dir))
        return mq_err(MOEQ_E_NOTFOUND, "model directory '%s' not found", dir ? dir : "(null)");
    char *p = mq_path_join(dir, "config.json");
    if (!p) return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status s = MOEQ_OK;
    if (!mq_file_exists(p)) {
        s = mq_err(MOEQ_E_NOTFOUND, "%s: no config.json in the model directory", dir);
    } else {
        s = mq_read_file(p, text, len);
    }
    if (s || !path) free(p);
    else *path = p;
    return s;
}

moeq_status mq_config_file_parse(const char *dir, char **path, cJSON **root) {
    *root = NULL;
    char *text = NULL, *p = NULL;
    size_t len = 0;
    moeq_status s = mq_config_file_read(dir, &p, &text, &len);
    if (s) return s;
    cJSON *j = cJSON_ParseWithLength(text, len);
    free(text);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        s = mq_err(MOEQ_E_FORMAT, "%s: not a JSON object", p);
        free(p);
        return s;
    }
    *root = j;
    if (path) *path = p;
    else free(p);
    return MOEQ_OK;
}

/* ---- FP8: quantization_config -------------------------------------------------------------------- */

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
    const bool there = mq_file_exists(path);
    free(path);
    path = NULL;
    cJSON *root = NULL;
    /* a missing or malformed config.json is the config loader's error to report */
    if (!there || mq_config_file_parse(dir, &path, &root)) return MOEQ_OK;
    moeq_status s;
    s = mq_fp8_parse_qconfig(cJSON_GetObjectItemCaseSensitive(root, "quantization_config"), path, out);
    cJSON_Delete(root);
    free(path);
    return s;
}

/* ---- the tensors ---------------------------------------------------------------------------- */

moeq_status mq_st_open_dir_blocks(const char *dir, mq_fp8_blocks b, mq_st **out) {
    mq_st *st;
    moeq_status s = mq_st_open_dir_files(dir, &st);
    if (s) return s;
    if (b.rows > 0 && (s = mq_st_link_fp8(st, b.rows, b.cols, mq_fp8_block_dequant))) {
        mq_st_close(st);
        return s;
    }
    *out = st;
    return MOEQ_OK;
}

moeq_status mq_st_open_dir(const char *dir, mq_st **out) {
    *out = NULL;
    mq_fp8_blocks b = {0, 0};
    moeq_status s = mq_dir_exists(dir) ? mq_fp8_read_dir_config(dir, &b) : MOEQ_OK;
    return s ? s : mq_st_open_dir_blocks(dir, b, out);
}
