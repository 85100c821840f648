/*
 * libFuzzer target for the safetensors reader: any input must give MOEQ_OK or MOEQ_E_FORMAT,
 * never a crash or an out-of-bounds read (built with ASan/UBSan), and every view it hands out
 * must lie inside the input. Build: cmake -DCMAKE_C_COMPILER=clang -DMOEQ_BUILD_FUZZ=ON; run:
 *   build-fuzz/fuzz_safetensors -dict=tests/fuzz/safetensors.dict -max_len=4096 CORPUS_DIR
 */
#include <stdlib.h>
#include <string.h>

#include "io/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    mq_st *st = NULL;
    moeq_status s = mq_st_open_buffer(data, size, "fuzz", &st);
    if (s != MOEQ_OK) {
        if (s != MOEQ_E_FORMAT || !strstr(moeq_last_error(), "fuzz")) abort();
        return 0;
    }
    float tmp[64];
    for (size_t i = 0; i < mq_st_count(st); i++) {
        const mq_tensor_view *v = mq_st_at(st, i);
        if (v->nbytes && (v->data < data || v->data + v->nbytes > data + size)) abort();
        if (v->nbytes != (size_t)v->numel * moeq_dtype_size(v->dtype)) abort();
        if (mq_st_find(st, v->name) != v) abort();
        if (v->numel <= 64) (void)mq_tensor_to_f32(v, tmp);
    }
    mq_st_close(st);
    return 0;
}
