/*
 * libFuzzer target for config.json of every family (model/config.c), its quantization_config
 * (compressed-tensors, ModelOpt, GPTQ, FP8 blocks) and the GGUF export's check of it
 * (export/gguf_export.c): MOEQ_OK or an input error naming the file; a parsed config has the
 * positive sizes the loaders index with, and the figures derived from it (parameters, FLOPs) are
 * computed without overflow (UBSan). Seeds: tests/fuzz/corpus.py (every config.json of the
 * fixtures and of checkpoints quantized from them).
 */
#include <cjson/cJSON.h>

#include "export/gguf_export.h"
#include "fuzz_common.h"
#include "model/model.h"

static const char k_path[] = "fuzz-model/config.json";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    mq_config c;
    memset(&c, 0, sizeof c);
    moeq_status s = mq_config_parse((const char *)data, size, k_path, &c);
    if (s != MOEQ_OK) {
        fuzz_check_error(s, k_path, "config.json");
    } else {
        if (c.vocab <= 0 || c.D <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
            c.head_dim <= 0 || !c.layer_is_moe || c.n_heads % c.n_kv_heads)
            abort();
        if (c.arch != MQ_ARCH_LLAMA && (c.n_experts <= 0 || c.top_k <= 0 || c.top_k > c.n_experts || c.moe_ffn <= 0))
            abort();
        for (int l = 0; l < c.n_layers; l++)
            if (!c.layer_is_moe[l] && c.ffn <= 0) abort();
        int64_t total = 0, active = 0;
        mq_config_param_counts(&c, &total, &active);
        (void)mq_config_forward_flops(&c, 2048, 4096);
        mq_config_free(&c);
    }
    /* the GGUF export's check takes the same file as JSON, whatever the parse above made of it */
    cJSON *j = cJSON_ParseWithLength((const char *)data, size);
    if (j) {
        for (int sc = 0; sc < 3; sc++) {
            const mq_qscheme scheme = sc == 0 ? MQ_QS_NVFP4 : sc == 1 ? MQ_QS_INT4 : MQ_QS_NONE;
            s = mq_gguf_check_config(j, "fuzz-model", scheme, sc == 0);
            if (s != MOEQ_OK && s != MOEQ_E_UNSUPPORTED) fuzz_check_error(s, "fuzz-model", "gguf check");
        }
        cJSON_Delete(j);
    }
    return 0;
}
