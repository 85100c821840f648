/*
 * The checkpoint layout of a Linear quantized to one of llama.cpp's block types (formats/kquant.h:
 * the K-quants and their fallbacks), which only --format gguf writes: the GGUF rows themselves,
 *     P.weight_<type> U8 [N, (K / block) * bytes]     e.g. P.weight_q4_K
 * the type in the name (Q5_0 and Q5_K rows of the same width would be alike otherwise), so the
 * converter copies them into the file as they are (ckpt/layout_ggml_read.c reads them back).
 */
#include <stdio.h>
#include <string.h>

#include "export/layout.h"
#include "formats/kquant.h"

moeq_status mq_layout_ggml_describe(const char *module, const mq_qspec *spec, int64_t N, int64_t K,
                                    mq_describe_fn fn, void *user) {
    const mq_kq_info *t = mq_kq_info_of(spec->kq);
    char name[1024];
    if (!mq_layout_ggml_name(name, sizeof name, module, spec->kq)) return mq_err(MOEQ_E_ARG, "module name too long: '%s'", module);
    if (K % t->block)
        return mq_err(MOEQ_E_SHAPE, "module '%s': %s needs in-features %% %d == 0, got %lld", module, t->name,
                      t->block, (long long)K);
    const int64_t shape[2] = {N, K / t->block * t->bytes};
    return fn(user, name, MOEQ_DT_U8, 2, shape);
}

moeq_status mq_layout_ggml_emit(const char *module, const mq_qtensor *q, mq_emit_fn emit, void *user) {
    const mq_kq_info *t = mq_kq_info_of(q->spec.kq);
    char name[1024];
    if (!mq_layout_ggml_name(name, sizeof name, module, q->spec.kq)) return mq_err(MOEQ_E_ARG, "module name too long: '%s'", module);
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
