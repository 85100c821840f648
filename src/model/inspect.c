/* moeq_inspect_json: a checkpoint's facts from config.json and the safetensors headers, no
 * weights read (what `moeq inspect` prints and the Python package returns). */
#include "core/json.h"
#include "io/safetensors.h"
#include "model/model.h"

moeq_status moeq_inspect_json(const char *model_dir, char **out) {
    *out = NULL;
    mq_config c;
    moeq_status st = mq_config_load(model_dir, &c);
    if (st) return st;
    mq_st *s = NULL;
    if ((st = mq_st_open_dir(model_dir, &s))) {
        mq_config_free(&c);
        return st;
    }
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "model_type", c.model_type);
    mq_json_add_num(j, "layers", c.n_layers);
    mq_json_add_num(j, "hidden_size", (double)c.D);
    mq_json_add_num(j, "experts", c.n_experts);
    mq_json_add_num(j, "experts_per_token", c.top_k);
    mq_json_add_num(j, "vocab_size", (double)c.vocab);
    int64_t total = 0, active = 0;
    mq_config_param_counts(&c, &total, &active);
    mq_json_add_num(j, "parameters", (double)total);
    mq_json_add_num(j, "active_parameters", (double)active);
    if (c.quant_method) cJSON_AddStringToObject(j, "quant_method", c.quant_method);
    if (c.quant_format) cJSON_AddStringToObject(j, "quant_format", c.quant_format);
    mq_config_free(&c);
    int64_t params = 0, bytes = 0;
    const size_t n = mq_st_count(s);
    for (size_t t = 0; t < n; t++) {
        const mq_tensor_view *x = mq_st_at(s, t);
        params += x->numel;
        bytes += (int64_t)x->nbytes;
    }
    mq_json_add_num(j, "tensors", (double)n);
    mq_json_add_num(j, "tensor_elements", (double)params);
    mq_json_add_num(j, "tensor_bytes", (double)bytes);
    mq_st_close(s);
    *out = mq_json_take_text(j);
    return *out ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory");
}
