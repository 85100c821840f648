/*
 * Loading any Linear of a checkpoint as fp32 (dense float weights, or the quantized layouts of
 * layout_read.c dequantized exactly like mq_dequantize) and describing its storage for `inspect`.
 * The model loader calls mq_load_linear_weight for every Linear, so moeq's own checkpoints and
 * compressed-tensors / ModelOpt / GPTQ-v1 ones from other tools load the same way.
 */
#include <string.h>

#include "ckpt/layout.h"
#include "formats/kquant.h"

static const mq_tensor_view *st_lookup(void *user, const char *name) {
    return mq_st_find((const mq_st *)user, name);
}

const char *mq_linear_kind_name(mq_linear_kind k) {
    switch (k) {
    case MQ_LIN_DENSE: return "dense";
    case MQ_LIN_CT_NVFP4: return "nvfp4 (compressed-tensors)";
    case MQ_LIN_CT_INT4: return "int4 (compressed-tensors)";
    case MQ_LIN_MODELOPT_NVFP4: return "nvfp4 (modelopt)";
    case MQ_LIN_GPTQ: return "int4 (gptq)";
    case MQ_LIN_GGML: return "ggml blocks (gguf)";
    case MQ_LIN_FP8_BLOCK: return "fp8 (block scales)";
    default: return "absent";
    }
}

moeq_status mq_load_linear_weight(const mq_st *st, const char *module, int64_t rows, int64_t cols,
                                  float *w, mq_linear_kind *kind) {
    mq_linear_kind k = mq_layout_detect(module, st_lookup, (void *)st);
    if (kind) *kind = k;
    if (k == MQ_LIN_ABSENT)
        return mq_err(MOEQ_E_NOTFOUND, "module '%s': no weight tensor in the checkpoint", module);
    if (k == MQ_LIN_DENSE || k == MQ_LIN_FP8_BLOCK) {
        char name[1024];
        snprintf(name, sizeof name, "%s.weight", module);
        const mq_tensor_view *t = mq_st_find(st, name);
        if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols)
            return mq_err(MOEQ_E_SHAPE, "%s: tensor '%s': expected shape [%lld, %lld]", t->file, name,
                          (long long)rows, (long long)cols);
        if (k == MQ_LIN_FP8_BLOCK && !t->scale_inv)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s' has a block scale '%s_scale_inv' but the "
                          "checkpoint was not opened as FP8 block-quantized (config.json "
                          "quantization_config with quant_method \"fp8\" and weight_block_size)",
                          t->file, name, name);
        return mq_tensor_to_f32(t, w);
    }
    mq_qtensor q;
    moeq_status s = mq_layout_read(module, rows, cols, st_lookup, (void *)st, &q);
    if (!s) mq_dequantize(&q, w);
    mq_qtensor_free(&q);
    return s;
}

static const mq_tensor_view *get(const mq_st *st, const char *module, const char *suffix) {
    char name[1024];
    if (snprintf(name, sizeof name, "%s.%s", module, suffix) >= (int)sizeof name) return NULL;
    return mq_st_find(st, name);
}

static size_t bytes_of(const mq_st *st, const char *module, const char *const *suffixes) {
    size_t n = 0;
    for (; *suffixes; suffixes++) {
        const mq_tensor_view *t = get(st, module, *suffixes);
        if (t) n += t->nbytes;
    }
    return n;
}

static moeq_status bad_shape(const mq_tensor_view *t) {
    return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': unexpected shape for its layout", t->file, t->name);
}

moeq_status mq_linear_qinfo_get(const mq_st *st, const char *module, mq_linear_qinfo *out) {
    memset(out, 0, sizeof *out);
    out->kind = mq_layout_detect(module, st_lookup, (void *)st);
    const mq_tensor_view *t;
    switch (out->kind) {
    case MQ_LIN_ABSENT:
        return mq_err(MOEQ_E_NOTFOUND, "module '%s': no weight tensor in the checkpoint", module);
    case MQ_LIN_DENSE:
        t = get(st, module, "weight");
        if (t->ndim != 2) return bad_shape(t);
        out->rows = t->shape[0];
        out->cols = t->shape[1];
        out->bits_per_weight = 8.0 * (double)moeq_dtype_size(t->dtype);
        return MOEQ_OK;
    case MQ_LIN_FP8_BLOCK: {
        t = get(st, module, "weight");
        if (t->ndim != 2) return bad_shape(t);
        out->rows = t->shape[0];
        out->cols = t->shape[1];
        out->group_size = t->block_cols;
        static const char *const w[] = {"weight", "weight_scale_inv", NULL};
        out->bits_per_weight = 8.0 * (double)bytes_of(st, module, w) /
                               ((double)out->rows * (double)out->cols);
        return MOEQ_OK;
    }
    case MQ_LIN_GGML: {
        t = mq_layout_ggml_find(module, st_lookup, (void *)st, &out->kq);
        const mq_kq_info *k = mq_kq_info_of(out->kq);
        if (t->ndim != 2 || t->shape[1] % k->bytes) return bad_shape(t);
        out->scheme = MQ_QS_KQUANT;
        out->rows = t->shape[0];
        out->cols = t->shape[1] / k->bytes * k->block;
        out->group_size = k->sub;
        out->asym = k->zero < 0;
        out->bits_per_weight = mq_kq_bpw(out->kq);
        return MOEQ_OK;
    }
    case MQ_LIN_CT_NVFP4:
    case MQ_LIN_MODELOPT_NVFP4: {
        bool ct = out->kind == MQ_LIN_CT_NVFP4;
        t = get(st, module, ct ? "weight_packed" : "weight");
        if (t->ndim != 2) return bad_shape(t);
        out->scheme = MQ_QS_NVFP4;
        out->rows = t->shape[0];
        out->cols = 2 * t->shape[1];
        out->group_size = 16;
        out->has_input_scale = get(st, module, ct ? "input_global_scale" : "input_scale") != NULL;
        static const char *const ct_w[] = {"weight_packed", "weight_scale", "weight_global_scale", NULL};
        static const char *const mo_w[] = {"weight", "weight_scale", "weight_scale_2", NULL};
        out->bits_per_weight = 8.0 * (double)bytes_of(st, module, ct ? ct_w : mo_w) /
                               ((double)out->rows * (double)out->cols);
        return MOEQ_OK;
    }
    case MQ_LIN_CT_INT4:
    case MQ_LIN_GPTQ: {
        bool ct = out->kind == MQ_LIN_CT_INT4;
        t = get(st, module, ct ? "weight_packed" : "qweight");
        const mq_tensor_view *sc = get(st, module, ct ? "weight_scale" : "scales");
        if (t->ndim != 2) return bad_shape(t);
        if (!sc || sc->ndim != 2)
            return mq_err(MOEQ_E_FORMAT, "module '%s': INT4 scales missing or not 2-D", module);
        out->scheme = MQ_QS_INT4;
        out->rows = ct ? t->shape[0] : t->shape[1];
        out->cols = 8 * (ct ? t->shape[1] : t->shape[0]);
        int64_t G = ct ? sc->shape[1] : sc->shape[0];
        out->group_size = G == 1 ? -1 : (G > 0 ? out->cols / G : 0);
        if (ct) {
            out->asym = get(st, module, "weight_zero_point") != NULL;
            out->act_order = get(st, module, "weight_g_idx") != NULL;
            static const char *const w[] = {"weight_packed", "weight_scale", "weight_zero_point",
                                            "weight_g_idx", "weight_shape", NULL};
            out->bits_per_weight = 8.0 * (double)bytes_of(st, module, w) /
                                   ((double)out->rows * (double)out->cols);
            return MOEQ_OK;
        }
        /* GPTQ: the full reader settles asym and act-order from qzeros and g_idx */
        mq_qtensor q;
        moeq_status s = mq_layout_read(module, out->rows, out->cols, st_lookup, (void *)st, &q);
        if (!s) {
            out->asym = q.spec.asym;
            out->act_order = q.g_idx != NULL;
        }
        mq_qtensor_free(&q);
        static const char *const w[] = {"qweight", "qzeros", "scales", "g_idx", NULL};
        out->bits_per_weight = 8.0 * (double)bytes_of(st, module, w) /
                               ((double)out->rows * (double)out->cols);
        return s;
    }
    }
    return MOEQ_OK;
}
