/*
 * moeq_eval_options and moeq_eval_result for other languages (the Python package binds them with
 * ctypes) and the CLI: the options by `moeq eval`'s flag names, as strings, so that no binding
 * mirrors the struct (the defaults, the setter, the description and the settings' JSON generated
 * from the one table in eval_options.def); the result as JSON.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "backend/gpu.h"
#include "core/json.h"
#include "core/optval.h"

size_t moeq_eval_options_size(void) { return sizeof(moeq_eval_options); }
size_t moeq_eval_result_size(void) { return sizeof(moeq_eval_result); }

/* ---- the options that are more than a field ---------------------------------------------- */

/* applied in float (ppl.c), so it must be one: positive and finite */
static moeq_status set_temperature(moeq_eval_options *o, const char *key, const char *v) {
    double d = 0;
    moeq_status st = mq_opt_double(key, v, -HUGE_VAL, HUGE_VAL, &d);
    if (!st && !(d > 0 && isfinite((float)d))) st = mq_opt_bad(key, v, "a positive number");
    if (!st) o->temperature = d;
    return st;
}

/* ---- the generated forms ------------------------------------------------------------------ */

void moeq_eval_options_init(moeq_eval_options *o) {
    memset(o, 0, sizeof *o);
#define MQ_EOPT(key, kind, p1, p2, field, def, metavar, help) o->field = def;
#include "eval/eval_options.def"
#undef MQ_EOPT
    o->prefix_token = -1;   /* the tokenizer's BOS, else its EOS (lm-eval's prefix_token_id) */
}

#define MQ_OPTSET_DEVICE(p1, p2, field) st = mq_gpu_parse_device(v, &o->field);
#define MQ_OPTINFO_DEVICE(p1, p2) MOEQ_OPTION_TEXT, NULL, 0, 0

moeq_status moeq_eval_options_set(moeq_eval_options *o, const char *key, const char *v) {
    if (!o || !key || !v) return mq_err(MOEQ_E_ARG, "moeq_eval_options_set: NULL argument");
    moeq_status st = MOEQ_OK;
#define MQ_EOPT(name, kind, p1, p2, field, def, metavar, help)                                     \
    if (!strcmp(key, name)) {                                                                      \
        MQ_OPTSET_##kind(p1, p2, field) return st;                                                 \
    }
#include "eval/eval_options.def"
#undef MQ_EOPT
    return mq_err(MOEQ_E_ARG, "unknown eval option '%s' (the names of moeq eval's flags)", key);
}

static const moeq_option_info g_eval_options[] = {
#define MQ_EOPT(name, kind, p1, p2, field, def, metavar, help)                                     \
    {name, MQ_OPTINFO_##kind(p1, p2), metavar, help, 0},
#include "eval/eval_options.def"
#undef MQ_EOPT
};

const moeq_option_info *moeq_eval_option_info(int i) {
    const int n = (int)(sizeof g_eval_options / sizeof g_eval_options[0]);
    return i >= 0 && i < n ? &g_eval_options[i] : NULL;
}

/* The settings' JSON: one statement per kind adding o->field to j under k. */
#define MQ_EJSON_BOOL(field) cJSON_AddBoolToObject(j, k, o->field != 0)
#define MQ_EJSON_NUMBER(field) mq_json_add_num(j, k, (double)o->field)
#define MQ_EJSON_SWITCH(p1, p2, field) MQ_EJSON_BOOL(field)
#define MQ_EJSON_INT(p1, p2, field) MQ_EJSON_NUMBER(field)
#define MQ_EJSON_NUM_FN(p1, p2, field) MQ_EJSON_NUMBER(field)
#define MQ_EJSON_SIZE(p1, p2, field) MQ_EJSON_NUMBER(field)
#define MQ_EJSON_TEXT(p1, p2, field)                                                               \
    (o->field ? cJSON_AddStringToObject(j, k, o->field) : cJSON_AddNullToObject(j, k))
#define MQ_EJSON_ENUM(p1, p2, field)                                                               \
    cJSON_AddStringToObject(j, k,                                                                  \
                            mq_opt_choice_name(p2, (int)o->field - (p1), name, sizeof name) ? name : "?")
#define MQ_EJSON_DEVICE(p1, p2, field)                                                             \
    cJSON_AddStringToObject(j, k, device_name(o->field, name, sizeof name))

/* "cpu" for -1, else "cuda:N" (--device's text) */
static const char *device_name(int device, char *buf, size_t cap) {
    if (device < 0) return "cpu";
    snprintf(buf, cap, "cuda:%d", device);
    return buf;
}

char *moeq_eval_settings_json(const moeq_eval_options *o) {
    cJSON *j = cJSON_CreateObject();
    if (!j || !o) return mq_json_take_text(j);
    char k[48], name[48];
#define MQ_EOPT(key, kind, p1, p2, field, def, metavar, help)                                      \
    snprintf(k, sizeof k, "%s", key);                                                              \
    for (char *c = k; *c; c++) *c = *c == '-' ? '_' : *c;                                          \
    MQ_EJSON_##kind(p1, p2, field);
#include "eval/eval_options.def"
#undef MQ_EOPT
    return mq_json_take_text(j);
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
    const mq_json_num totals[] = {
        {"word_perplexity", r->word_perplexity},
        {"byte_perplexity", r->byte_perplexity},
        {"bits_per_byte", r->bits_per_byte},
        {"token_perplexity", r->token_perplexity},
        {"loglikelihood", r->loglikelihood},
        {"tokens", (double)r->tokens},
        {"words", (double)r->words},
        {"bytes", (double)r->bytes},
        {"documents", (double)r->documents},
        {"seconds", r->seconds},
    };
    mq_json_add_nums(j, totals, sizeof totals / sizeof *totals);
    cJSON_AddBoolToObject(j, "interrupted", r->interrupted != 0);
    if (r->has_kl) {
        const mq_json_num kl[] = {
            {"kl_mean", r->kl_mean},
            {"kl_p99", r->kl_p99},
            {"top1_changed", r->top1_changed},
            {"kl_tokens", (double)r->kl_tokens},
        };
        mq_json_add_nums(j, kl, sizeof kl / sizeof *kl);
    }
    if (r->has_base) mq_json_add_num(j, "base_word_perplexity", r->base_word_perplexity);
    if (r->has_entropy) mq_json_add_num(j, "entropy_mean", r->entropy_mean);
    if (r->device[0]) cJSON_AddStringToObject(j, "device", r->device);
    return mq_json_take_text(j);
}
