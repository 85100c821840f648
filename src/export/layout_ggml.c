/*
 * The checkpoint layout of a Linear quantized to one of llama.cpp's block types (formats/kquant.h:
 * the K-quants and their fallbacks), which only --format gguf writes: the GGUF rows themselves,
 *     P.weight_<type> U8 [N, (K / block) * bytes]     e.g. P.weight_q4_K
 * the type in the name (Q5_0 and Q5_K rows of the same width would be alike otherwise), so the
 * converter copies them into the file as they are and the reader unpacks them into the same
 * mq_qtensor (codes, sub-block steps and offsets) GPTQ made.
 */
#include <stdio.h>
#include <string.h>

#include "export/layout.h"
#include "formats/kquant.h"

bool mq_layout_ggml_suffix(const char *suffix, mq_kq_type *t) {
    mq_kq_type k;
    if (strncmp(suffix, "weight_", 7) || !mq_kq_parse(suffix + 7, &k)) return false;
    if (t) *t = k;
    return true;
}

static bool suffix_name(char *buf, size_t n, const char *module, mq_kq_type t) {
    return snprintf(buf, n, "%s.weight_%s", module, mq_kq_name(t)) < (int)n;
}

moeq_status mq_layout_ggml_describe(const char *module, const mq_qspec *spec, int64_t N, int64_t K,
                                    mq_describe_fn fn, void *user) {
    const mq_kq_info *t = mq_kq_info_of(spec->kq);
    char name[1024];
    if (!suffix_name(name, sizeof name, module, spec->kq)) return mq_err(MOEQ_E_ARG, "module name too long: '%s'", module);
    if (K % t->block)
        return mq_err(MOEQ_E_SHAPE, "module '%s': %s needs in-features %% %d == 0, got %lld", module, t->name,
                      t->block, (long long)K);
    const int64_t shape[2] = {N, K / t->block * t->bytes};
    return fn(user, name, MOEQ_DT_U8, 2, shape);
}

moeq_status mq_layout_ggml_emit(const char *module, const mq_qtensor *q, mq_emit_fn emit, void *user) {
    const mq_kq_info *t = mq_kq_info_of(q->spec.kq);
    char name[1024];
    if (!suffix_name(name, sizeof name, module, q->spec.kq)) return mq_err(MOEQ_E_ARG, "module name too long: '%s'", module);
    const int64_t nb = q->cols / t->block, rb = nb * t->bytes, per = t->block / t->sub;
    uint8_t *blk = mq_alloc_array((size_t)q->rows, (size_t)rb, "GGUF blocks");
    if (!blk) return MOEQ_E_NOMEM;
    for (int64_t r = 0; r < q->rows; r++)
        for (int64_t b = 0; b < nb; b++)
            if (!mq_kq_pack_block(t, q->params + r * q->n_groups + b * per, q->codes + r * q->cols + b * t->block,
                                  blk + r * rb + b * t->bytes)) {
                mq_free(blk);
                return mq_err(MOEQ_E_ARG, "module '%s': row %lld block %lld: its sub-block scales are no "
                              "%s block's", module, (long long)r, (long long)b, t->name);
            }
    const int64_t shape[2] = {q->rows, rb};
    return emit(user, name, MOEQ_DT_U8, 2, shape, blk, (size_t)(q->rows * rb));
}

const mq_tensor_view *mq_layout_ggml_find(const char *module, mq_lookup_fn lookup, void *user, mq_kq_type *t) {
    char name[1024];
    for (int k = 0; k < MQ_KQ_COUNT; k++) {
        if (!suffix_name(name, sizeof name, module, (mq_kq_type)k)) return NULL;
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
