/*
 * moeq_eval_options and moeq_eval_result for other languages (the Python package binds them with
 * ctypes): options set by `moeq eval`'s flag names as strings, so no binding mirrors the struct;
 * the result as JSON.
 */
#include <math.h>
#include <string.h>

#include "backend/gpu.h"
#include "core/json.h"
#include "core/optval.h"

size_t moeq_eval_options_size(void) { return sizeof(moeq_eval_options); }
size_t moeq_eval_result_size(void) { return sizeof(moeq_eval_result); }

moeq_status moeq_eval_options_set(moeq_eval_options *o, const char *key, const char *v) {
    if (!o || !key || !v) return mq_err(MOEQ_E_ARG, "moeq_eval_options_set: NULL argument");
    int64_t i = 0;
    double d = 0;
    moeq_status st = MOEQ_OK;
    if (!strcmp(key, "task")) {
        if (strcmp(v, "wikitext") && strcmp(v, "text")) return mq_opt_bad(key, v, "wikitext or text");
        o->task = strcmp(v, "text") ? MOEQ_TASK_WIKITEXT : MOEQ_TASK_TEXT;
    } else if (!strcmp(key, "max-length")) {
        if (!(st = mq_opt_int(key, v, 0, 1 << 24, &i))) o->max_length = (int32_t)i;
    } else if (!strcmp(key, "limit")) {
        st = mq_opt_int(key, v, 0, INT64_MAX, &o->limit);
    } else if (!strcmp(key, "add-bos")) {
        st = mq_opt_bool(key, v, &o->add_bos);
    } else if (!strcmp(key, "temperature")) {
        if (!(st = mq_opt_double(key, v, -HUGE_VAL, HUGE_VAL, &d)) && !(d > 0))
            st = mq_opt_bad(key, v, "a positive number");
        if (!st) o->temperature = d;
    } else if (!strcmp(key, "entropy")) {
        st = mq_opt_bool(key, v, &o->entropy);
    } else if (!strcmp(key, "kl-logits")) {
        o->kl_logits = v;
    } else if (!strcmp(key, "save-logits")) {
        o->save_logits = v;
    } else if (!strcmp(key, "device")) {
        st = mq_gpu_parse_device(v, &o->device);
    } else if (!strcmp(key, "gpu-precision")) {
        if (!strcmp(v, "fp32")) o->gpu_precision = MOEQ_GPU_FP32;
        else if (!strcmp(v, "tf32x3")) o->gpu_precision = MOEQ_GPU_TF32X3;
        else if (!strcmp(v, "tf32")) o->gpu_precision = MOEQ_GPU_TF32;
        else if (!strcmp(v, "bf16")) o->gpu_precision = MOEQ_GPU_BF16;
        else return mq_opt_bad(key, v, "fp32, tf32x3, tf32 or bf16");
    } else {
        return mq_err(MOEQ_E_ARG, "unknown eval option '%s' (the names of moeq eval's flags)", key);
    }
    return st;
}

void moeq_eval_options_set_base(moeq_eval_options *o, const moeq_model *base) { o->kl_base = base; }

void moeq_eval_options_set_docs(moeq_eval_options *o, double *loglikelihood, int64_t *tokens, double *kl,
                                double *top1_changed, double *base_loglikelihood) {
    o->doc_loglikelihood = loglikelihood;
    o->doc_tokens = tokens;
    o->doc_kl = kl;
    o->doc_top1_changed = top1_changed;
    o->doc_base_loglikelihood = base_loglikelihood;
}

moeq_status moeq_eval_html_flat(const char *path, const char *model, const char *base, const char *data,
                                const moeq_docs *docs, const moeq_eval_result *r, const double *loglikelihood,
                                const double *base_loglikelihood, const double *kl, const double *top1_changed,
                                const int64_t *tokens) {
    moeq_eval_page pg = {model, base, data, docs, r, loglikelihood, base_loglikelihood, kl, top1_changed, tokens};
    return moeq_eval_html(path, &pg);
}

char *moeq_eval_result_json(const moeq_eval_result *r) {
    cJSON *j = cJSON_CreateObject();
    if (!j || !r) return mq_json_take_text(j);
    mq_json_add_num(j, "word_perplexity", r->word_perplexity);
    mq_json_add_num(j, "byte_perplexity", r->byte_perplexity);
    mq_json_add_num(j, "bits_per_byte", r->bits_per_byte);
    mq_json_add_num(j, "token_perplexity", r->token_perplexity);
    mq_json_add_num(j, "loglikelihood", r->loglikelihood);
    mq_json_add_num(j, "tokens", (double)r->tokens);
    mq_json_add_num(j, "words", (double)r->words);
    mq_json_add_num(j, "bytes", (double)r->bytes);
    mq_json_add_num(j, "documents", (double)r->documents);
    mq_json_add_num(j, "seconds", r->seconds);
    cJSON_AddBoolToObject(j, "interrupted", r->interrupted != 0);
    if (r->has_kl) {
        mq_json_add_num(j, "kl_mean", r->kl_mean);
        mq_json_add_num(j, "kl_p99", r->kl_p99);
        mq_json_add_num(j, "top1_changed", r->top1_changed);
        mq_json_add_num(j, "kl_tokens", (double)r->kl_tokens);
    }
    if (r->has_base) mq_json_add_num(j, "base_word_perplexity", r->base_word_perplexity);
    if (r->has_entropy) mq_json_add_num(j, "entropy_mean", r->entropy_mean);
    if (r->device[0]) cJSON_AddStringToObject(j, "device", r->device);
    return mq_json_take_text(j);
}
