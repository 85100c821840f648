/*
 * libFuzzer target for the GGUF reader (io/gguf.c): any input must give MOEQ_OK or
 * MOEQ_E_FORMAT naming the input, never a crash or an out-of-bounds read (ASan/UBSan), and every
 * tensor and KV it hands out must lie inside the input. Build: cmake -DCMAKE_C_COMPILER=clang
 * -DMOEQ_BUILD_FUZZ=ON; run: build-fuzz/fuzz_gguf -dict=tests/fuzz/gguf.dict -max_len=4096 CORPUS
 */
#include <stdlib.h>
#include <string.h>

#include "io/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    mq_gguf *g = NULL;
    moeq_status s = mq_gguf_parse(data, size, "fuzz", &g);
    if (s != MOEQ_OK) {
        if ((s != MOEQ_E_FORMAT && s != MOEQ_E_NOMEM) || !strstr(moeq_last_error(), "fuzz")) abort();
        return 0;
    }
    float tmp[256];
    for (size_t i = 0; i < mq_gguf_tensor_count(g); i++) {
        const mq_gguf_tensor *t = mq_gguf_tensor_at(g, i);
        if (t->data < data || t->data + t->nbytes > data + size) abort();
        if (mq_gguf_find_tensor(g, t->name) != t) abort();
        if (t->numel <= 256 && mq_gguf_tensor_to_f32(t, tmp) != MOEQ_OK) abort();
    }
    for (size_t i = 0; i < mq_gguf_kv_count(g); i++) {
        const mq_gguf_kv *kv = mq_gguf_kv_at(g, i);
        const char *str;
        size_t len;
        double v;
        for (uint64_t j = 0; j < kv->n && j < 8; j++) {
            if (mq_gguf_kv_str_at(kv, j, &str, &len) && (str < (const char *)data || str + len > (const char *)data + size))
                abort();
            (void)mq_gguf_kv_num_at(kv, j, &v);
        }
    }
    mq_gguf_close(g);
    return 0;
}
