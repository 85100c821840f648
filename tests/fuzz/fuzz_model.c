/*
 * libFuzzer target for a checkpoint folder as the model loader reads it (model/load.c through
 * moeq_model_open): config.json with its quantization_config, and model.safetensors holding the
 * compressed-tensors, ModelOpt, GPTQ or plain layouts, cut at a FUZZ_SEP line (fuzz_common.h).
 * Opening gives MOEQ_OK or an input error naming the folder, a file in it or the tensor at fault;
 * an opened model runs a forward of three tokens (packed kernels where the layout allows) inside
 * its buffers (ASan).
 * Seeds: tests/fuzz/corpus.py (a one-layer model of 48 ids quantized into each layout).
 */
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *part[2];
    size_t len[2];
    fuzz_split(data, size, 2, part, len);
    fuzz_file(0, "config.json", part[0], len[0]);
    fuzz_file(1, "model.safetensors", part[1], len[1]);
    moeq_model_options o;
    memset(&o, 0, sizeof o);
    o.keep_packed = size % 2;   /* either way the input's tail byte says */
    moeq_model *m = NULL;
    moeq_status s = moeq_model_open(fuzz_dir(), &o, &m);
    if (s != MOEQ_OK) {
        /* the folder, a file of it, or the tensor or module at fault (a missing tensor has no file) */
        fuzz_check_error(s, NULL, "moeq_model_open");
        const char *msg = moeq_last_error();
        if (!strstr(msg, fuzz_dir()) && !strstr(msg, "tensor '") && !strstr(msg, "module '")) {
            fprintf(stderr, "moeq_model_open: the error names neither the folder nor a tensor: %s\n", msg);
            abort();
        }
        return 0;
    }
    const moeq_model_info *info = moeq_model_get_info(m);
    moeq_session *se = NULL;
    if (info->vocab_size >= 3 && info->vocab_size <= (1 << 16) && moeq_session_create(m, 4, &se) == MOEQ_OK) {
        const int32_t ids[3] = {0, 1, 2};
        float *logits = malloc(sizeof(float) * 3 * (size_t)info->vocab_size);
        if (!logits) abort();
        s = moeq_session_forward(se, ids, 3, logits);
        if (s != MOEQ_OK && s != MOEQ_E_NUMERIC && s != MOEQ_E_NOMEM) {
            fprintf(stderr, "forward: %s: %s\n", moeq_status_name(s), moeq_last_error());
            abort();
        }
        free(logits);
        moeq_session_free(se);
    }
    moeq_model_free(m);
    return 0;
}
