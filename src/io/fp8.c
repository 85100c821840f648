/*
 * FP8 block-quantized weights (see fp8.h): the view's checks, then the decoder linked to it
 * (mq_st_link_fp8). What the codes mean is the checkpoint readers' (ckpt/fp8.c); which checkpoints are
 * FP8 is config.json's word, read in ckpt/source.c.
 */
#include "io/fp8.h"

moeq_status mq_fp8_dequant_rows(const mq_tensor_view *w, int64_t r0, int64_t nr, float *out) {
    if (!w->scale_inv || !w->dequant || w->ndim != 2 || w->dtype != MOEQ_DT_F8_E4M3 ||
        w->block_rows < 1 || w->block_cols < 1)
        return mq_err(MOEQ_E_ARG, "tensor '%s' is not an FP8 block-quantized weight", w->name);
    const int64_t R = w->shape[0];
    if (r0 < 0 || nr < 0 || r0 + nr > R)
        return mq_err(MOEQ_E_ARG, "tensor '%s': rows [%lld, %lld) outside its %lld rows", w->name,
                      (long long)r0, (long long)(r0 + nr), (long long)R);
    return w->dequant(w, r0, nr, out);
}
