/*
 * libFuzzer target for the quantized checkpoint layouts (export/layout.c writes them,
 * ckpt/layout_read.c and ckpt/linear.c read them): a safetensors file whose tensors are compressed-tensors NVFP4 / INT4 (pack-quantized, with zero
 * points, g_idx and weight_shape), ModelOpt NVFP4, GPTQ v1 or dense; every module found in it is
 * described (mq_linear_qinfo_get: what `inspect` and the loaders read first), read back as a
 * 4-bit tensor and loaded as fp32 at the shape the tensors imply, or refused with an input error
 * naming the module or the file; nothing reads outside the input (ASan). Seeds: tests/fuzz/corpus.py
 * (one module of every layout, cut from checkpoints quantized from a generated model).
 */
#include <math.h>

#include "export/layout.h"
#include "fuzz_common.h"

static const mq_tensor_view *lookup(void *user, const char *name) { return mq_st_find((const mq_st *)user, name); }

/* An error of a module's reader names the module or the file ("fuzz-ckpt"). */
static void check(moeq_status s, const char *module, const char *what) {
    if (s == MOEQ_OK) return;
    fuzz_check_error(s, NULL, what);
    const char *msg = moeq_last_error();
    if (!strstr(msg, module) && !strstr(msg, "fuzz-ckpt")) {
        fprintf(stderr, "%s: the error names neither the module '%s' nor the file: %s\n", what, module, msg);
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    mq_st *st = NULL;
    if (mq_st_open_buffer(data, size, "fuzz-ckpt", &st) != MOEQ_OK) return 0;
    for (size_t i = 0; i < mq_st_count(st) && i < 64; i++) {
        const char *name = mq_st_at(st, i)->name;
        const char *dot = strrchr(name, '.');
        if (!dot || dot == name || (size_t)(dot - name) >= 512) continue;
        char module[512];
        memcpy(module, name, (size_t)(dot - name));
        module[dot - name] = '\0';
        /* each module once: at its first tensor */
        bool seen = false;
        for (size_t k = 0; k < i && !seen; k++) {
            const char *o = mq_st_at(st, k)->name;
            seen = !strncmp(o, module, (size_t)(dot - name)) && o[dot - name] == '.';
        }
        if (seen) continue;
        mq_linear_qinfo qi;
        moeq_status s = mq_linear_qinfo_get(st, module, &qi);
        check(s, module, "mq_linear_qinfo_get");
        if (s || qi.rows <= 0 || qi.cols <= 0 || qi.rows > (1 << 16) || qi.cols > (1 << 16) ||
            qi.rows * qi.cols > (1 << 18))
            continue;
        mq_qtensor q;
        s = mq_layout_read(module, qi.rows, qi.cols, lookup, st, &q);
        if (qi.kind != MQ_LIN_DENSE && qi.kind != MQ_LIN_FP8_BLOCK) check(s, module, "mq_layout_read");
        if (!s && (q.rows != qi.rows || q.cols != qi.cols)) abort();
        mq_qtensor_free(&q);
        float *w = malloc((size_t)(qi.rows * qi.cols) * sizeof *w);
        if (!w) abort();
        mq_linear_kind kind;
        s = mq_load_linear_weight(st, module, qi.rows, qi.cols, w, &kind);
        check(s, module, "mq_load_linear_weight");
        if (kind != qi.kind) abort();
        free(w);
    }
    mq_st_close(st);
    return 0;
}
