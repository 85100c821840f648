/*
 * Reading a Linear stored in one of llama.cpp's block types (formats/kquant.h), the layout only
 * --format gguf's work checkpoint holds (export/layout_ggml.c writes it):
 *     P.weight_<type> U8 [N, (K / block) * bytes]     e.g. P.weight_q4_K
 * the type in the name (Q5_0 and Q5_K rows of the same width would be alike otherwise). The rows
 * unpack into the same mq_qtensor (codes, sub-block steps and offsets) GPTQ made.
 */
#include <stdio.h>
#include <string.h>

#include "ckpt/layout.h"
#include "formats/kquant.h"

bool mq_layout_ggml_suffix(const char *suffix, mq_kq_type *t) {
    mq_kq_type k;
    if (strncmp(suffix, "weight_", 7) || !mq_kq_parse(suffix + 7, &k)) return false;
    if (t) *t = k;
    return true;
}

bool mq_layout_ggml_name(char *buf, size_t n, const char *module, mq_kq_type t) {
    return snprintf(buf, n, "%s.weight_%s", module, mq_kq_name(t)) < (int)n;
}

const mq_tensor_view *mq_layout_ggml_find(const char *module, mq_lookup_fn lookup, void *user, mq_kq_type *t) {
    char name[1024];
    for (int k = 0; k < MQ_KQ_COUNT; k++) {
        if (!mq_layout_ggml_name(name, sizeof name, module, (mq_kq_type)k)) return NULL;
        const mq_tensor_view *v = lookup(user, name);
        if (v) {
            if (t) *t = (mq_kq_type)k;
            return v;
        }
    }
    return NULL;
}

moeq_status mq_layout_ggml_read(const char *module, int64_t rows, int64_t cols, mq_lookup_fn lookup, void *user,
                                mq_qtensor *out) {
    memset(out, 0, sizeof *out);
    mq_kq_type k;
    const mq_tensor_view *v = mq_layout_ggml_find(module, lookup, user, &k);
    if (!v) return mq_err(MOEQ_E_NOTFOUND, "module '%s': no GGUF block tensor", module);
    const mq_kq_info *t = mq_kq_info_of(k);
    const int64_t rb = cols / t->block * t->bytes, per = t->block / t->sub;
    if (v->dtype != MOEQ_DT_U8 || v->ndim != 2 || cols % t->block || v->shape[0] != rows || v->shape[1] != rb)
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': expected U8 [%lld, %lld] (%s rows of %lld values)", v->file,
                      v->name, (long long)rows, (long long)rb, t->name, (long long)cols);
    const mq_qspec s = mq_kq_spec(k);
    moeq_status st = mq_qtensor_init_unset(out, &s, rows, cols, module);
    if (st) return st;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < cols / t->block; b++)
            mq_kq_unpack_block(t, v->data + r * rb + b * t->bytes, out->params + r * out->n_groups + b * per,
                               out->codes + r * cols + b * t->block);
    return MOEQ_OK;
}
