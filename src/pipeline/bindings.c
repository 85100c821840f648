/*
 * The C API for other languages (the Python package in python/ binds it with ctypes): options
 * set by the CLI's flag names as strings, so no binding mirrors a struct layout; results and a
 * model's facts as JSON strings.
 */
#include <ctype.h>
#include <stdio.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "backend/gpu.h"
#include "io/safetensors.h"
#include "model/model.h"

size_t moeq_quant_options_size(void) { return sizeof(moeq_quant_options); }
size_t moeq_quant_result_size(void) { return sizeof(moeq_quant_result); }
size_t moeq_eval_options_size(void) { return sizeof(moeq_eval_options); }
size_t moeq_eval_result_size(void) { return sizeof(moeq_eval_result); }
void moeq_string_free(char *s) { free(s); }

static moeq_status bad(const char *key, const char *value, const char *want) {
    return mq_err(MOEQ_E_ARG, "%s=%s: expected %s", key, value, want);
}

static moeq_status get_int(const char *key, const char *v, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi) return bad(key, v, "an integer in range");
    *out = x;
    return MOEQ_OK;
}

static moeq_status get_double(const char *key, const char *v, double *out) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end || errno || !isfinite(x)) return bad(key, v, "a number");
    *out = x;
    return MOEQ_OK;
}

static moeq_status get_bool(const char *key, const char *v, int *out) {
    if (!strcmp(v, "1") || !strcmp(v, "true") || !strcmp(v, "True")) *out = 1;
    else if (!strcmp(v, "0") || !strcmp(v, "false") || !strcmp(v, "False")) *out = 0;
    else return bad(key, v, "true or false");
    return MOEQ_OK;
}

/* A byte count: digits with an optional K/M/G/T (powers of 1000) or KiB/MiB/GiB/TiB suffix. */
static moeq_status get_size(const char *key, const char *v, int64_t *out) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || errno || !(x >= 0)) return bad(key, v, "a size such as 6GB");
    double m = 1;
    const char *u = end;
    if (*u) {
        const char c = (char)toupper((unsigned char)*u);
        m = c == 'K' ? 1e3 : c == 'M' ? 1e6 : c == 'G' ? 1e9 : c == 'T' ? 1e12 : 0;
        if (m == 0) return bad(key, v, "a size such as 6GB");
        if (!strcmp(u + 1, "iB")) m = c == 'K' ? 1024.0 : c == 'M' ? 1048576.0 : c == 'G' ? 1073741824.0 : 1099511627776.0;
        else if (u[1] && strcmp(u + 1, "B")) return bad(key, v, "a size such as 6GB");
    }
    *out = (int64_t)(x * m);
    return MOEQ_OK;
}

static int pick(const char *v, const char *const *names, int n) {
    for (int i = 0; i < n; i++)
        if (!strcmp(v, names[i])) return i;
    return -1;
}

moeq_status moeq_quant_options_set(moeq_quant_options *o, const char *key, const char *v) {
    if (!o || !key || !v) return mq_err(MOEQ_E_ARG, "moeq_quant_options_set: NULL argument");
    int64_t i = 0;
    int b = 0, k;
    moeq_status st = MOEQ_OK;
    if (!strcmp(key, "scheme")) {
        static const char *const n[] = {"nvfp4", "nvfp4a16", "int4"};
        if ((k = pick(v, n, 3)) < 0) return bad(key, v, "nvfp4, nvfp4a16 or int4");
        o->scheme = k == 0 ? MOEQ_QUANT_NVFP4 : k == 1 ? MOEQ_QUANT_NVFP4A16 : MOEQ_QUANT_INT4;
    } else if (!strcmp(key, "method")) {
        static const char *const n[] = {"rtn", "gptq"};
        if ((k = pick(v, n, 2)) < 0) return bad(key, v, "rtn or gptq");
        o->method = k ? MOEQ_QUANT_GPTQ : MOEQ_QUANT_RTN;
    } else if (!strcmp(key, "format")) {
        static const char *const n[] = {"compressed-tensors", "modelopt", "gptq", "gguf"};
        if ((k = pick(v, n, 4)) < 0) return bad(key, v, "compressed-tensors, modelopt, gptq or gguf");
        o->format = (moeq_ckpt_format)k;
    } else if (!strcmp(key, "group-size")) {
        if (!(st = get_int(key, v, 0, 1 << 20, &i))) o->group_size = (int32_t)i;
    } else if (!strcmp(key, "asym")) {
        st = get_bool(key, v, &o->asym);
    } else if (!strcmp(key, "int4-scale-sign")) {
        static const char *const n[] = {"auto", "signed", "positive"};
        if ((k = pick(v, n, 3)) < 0) return bad(key, v, "auto, signed or positive");
        o->int4_scale_sign = (moeq_int4_scale_sign)k;
    } else if (!strcmp(key, "scale-search")) {
        char *end;
        o->scale_lo = strtod(v, &end);
        if (*end == ':') o->scale_hi = strtod(end + 1, &end);
        else end = (char *)"x";
        if (*end == ':') o->scale_steps = (int32_t)strtol(end + 1, &end, 10);
        if (*end) return bad(key, v, "LO:HI or LO:HI:N");
    } else if (!strcmp(key, "global-scale-headroom")) {
        st = get_double(key, v, &o->global_scale_headroom);
    } else if (!strcmp(key, "reference")) {
        st = get_bool(key, v, &o->reference);
    } else if (!strcmp(key, "no-fuse")) {
        st = get_bool(key, v, &o->no_fuse);
    } else if (!strcmp(key, "calib")) {
        o->calib = v;
    } else if (!strcmp(key, "calib-field")) {
        o->calib_field = v;
    } else if (!strcmp(key, "calib-tokens")) {
        st = get_int(key, v, 1, (int64_t)1 << 40, &o->calib_tokens);
    } else if (!strcmp(key, "max-shard-size")) {
        st = get_size(key, v, &o->max_shard_bytes);
    } else if (!strcmp(key, "force")) {
        st = get_bool(key, v, &o->force);
    } else if (!strcmp(key, "max-memory")) {
        st = get_size(key, v, &o->max_memory);
    } else if (!strcmp(key, "work-dir")) {
        o->work_dir = v;
    } else if (!strcmp(key, "resume")) {
        st = get_bool(key, v, &o->resume);
    } else if (!strcmp(key, "dry-run")) {
        st = get_bool(key, v, &o->dry_run);
    } else if (!strcmp(key, "drop-mtp")) {
        st = get_bool(key, v, &o->drop_mtp);
    } else if (!strcmp(key, "rotate")) {
        static const char *const n[] = {"none", "residual"};
        if ((k = pick(v, n, 2)) < 0) return bad(key, v, "none or residual");
        o->rotate = (moeq_rotation_kind)k;
    } else if (!strcmp(key, "rotate-block")) {
        if (!(st = get_int(key, v, 0, 1 << 20, &i))) o->rotate_block = (int32_t)i;
    } else if (!strcmp(key, "expert-chunk")) {
        if (!(st = get_int(key, v, 0, 1 << 20, &i))) o->expert_chunk = (int32_t)i;
    } else if (!strcmp(key, "activations")) {
        static const char *const n[] = {"auto", "ram", "disk", "bf16"};
        if ((k = pick(v, n, 4)) < 0) return bad(key, v, "auto, ram, disk or bf16");
        o->activations = (moeq_act_storage)k;
    } else if (!strcmp(key, "device")) {
        o->device = v;
    } else if (!strcmp(key, "gpu-precision")) {
        static const char *const n[] = {"fp32", "tf32x3", "tf32"};
        if ((k = pick(v, n, 3)) < 0) return bad(key, v, "fp32, tf32x3 or tf32");
        o->gpu_precision = (moeq_gpu_precision)k;
    } else if (!strcmp(key, "gpu-tf32")) {   /* the same as gpu-precision tf32 */
        int on = 0;
        if (!(st = get_bool(key, v, &on))) o->gpu_precision = on ? MOEQ_GPU_TF32 : MOEQ_GPU_FP32;
    } else if (!strcmp(key, "nsamples")) {
        st = get_int(key, v, 1, 1 << 24, &o->gptq.nsamples);
    } else if (!strcmp(key, "seqlen")) {
        st = get_int(key, v, 2, 1 << 24, &o->gptq.seqlen);
    } else if (!strcmp(key, "calib-sampling")) {
        static const char *const n[] = {"chunks", "random", "docs"};
        if ((k = pick(v, n, 3)) < 0) return bad(key, v, "chunks, random or docs");
        o->gptq.sampling = (moeq_calib_sampling)k;
    } else if (!strcmp(key, "calib-balance")) {
        static const char *const n[] = {"none", "experts"};
        if ((k = pick(v, n, 2)) < 0) return bad(key, v, "none or experts");
        o->gptq.calib_balance = (moeq_calib_balance)k;
    } else if (!strcmp(key, "calib-pool")) {
        st = get_int(key, v, 0, 1 << 24, &o->gptq.calib_pool);
    } else if (!strcmp(key, "seed")) {
        if (!(st = get_int(key, v, 0, INT64_MAX, &i))) o->gptq.seed = (uint64_t)i;
    } else if (!strcmp(key, "calib-bos")) {
        st = get_bool(key, v, &o->gptq.calib_bos);
    } else if (!strcmp(key, "percdamp")) {
        st = get_double(key, v, &o->gptq.percdamp);
    } else if (!strcmp(key, "block-size")) {
        if (!(st = get_int(key, v, 1, 1 << 16, &i))) o->gptq.block_size = (int32_t)i;
    } else if (!strcmp(key, "act-order")) {
        if (!(st = get_bool(key, v, &b))) o->gptq.act_order = b;
    } else if (!strcmp(key, "groups")) {
        static const char *const n[] = {"dynamic", "static", "gidx"};
        if ((k = pick(v, n, 3)) < 0) return bad(key, v, "dynamic, static or gidx");
        o->gptq.groups = (moeq_gptq_groups)k;
    } else if (!strcmp(key, "mse")) {
        st = get_bool(key, v, &o->gptq.mse);
        o->mse = o->gptq.mse;
    } else if (!strcmp(key, "mse-weight")) {
        static const char *const n[] = {"plain", "hessian", "obq", "gptq"};
        if ((k = pick(v, n, 4)) < 0) return bad(key, v, "plain, hessian, obq or gptq");
        o->gptq.mse_weight = (moeq_gptq_mse_weight)k;
    } else if (!strcmp(key, "gptq-mode")) {
        static const char *const n[] = {"sequential", "nonsequential"};
        if ((k = pick(v, n, 2)) < 0) return bad(key, v, "sequential or nonsequential");
        o->gptq.mode = k ? MOEQ_GPTQ_NONSEQUENTIAL : MOEQ_GPTQ_SEQUENTIAL;
    } else if (!strcmp(key, "true-sequential")) {
        st = get_bool(key, v, &o->gptq.true_sequential);
    } else if (!strcmp(key, "min-expert-tokens")) {
        st = get_int(key, v, 0, INT64_MAX, &o->gptq.min_expert_tokens);
    } else if (!strcmp(key, "expert-fallback")) {
        static const char *const n[] = {"block", "rtn"};
        if ((k = pick(v, n, 2)) < 0) return bad(key, v, "block or rtn");
        o->gptq.expert_fallback = k ? MOEQ_EXPERT_FALLBACK_RTN : MOEQ_EXPERT_FALLBACK_BLOCK;
    } else if (!strcmp(key, "expert-weighting")) {
        static const char *const n[] = {"none", "gate", "gate-squared"};
        if ((k = pick(v, n, 3)) < 0) return bad(key, v, "none, gate or gate-squared");
        o->gptq.expert_weighting = (moeq_expert_weighting)k;
    } else if (!strcmp(key, "refine")) {
        if (!(st = get_int(key, v, 0, 64, &i))) o->gptq.refine_passes = (int32_t)i;
    } else if (!strcmp(key, "target")) {
        /* quantized | unquantized | unquantized:A, A in (0, 1] */
        double a = 0.5;
        if (!strcmp(v, "quantized")) {
            a = 0;
        } else if (strncmp(v, "unquantized", 11) != 0 || (v[11] && v[11] != ':')) {
            return bad(key, v, "quantized, unquantized or unquantized:A with A in (0, 1]");
        } else if (v[11] == ':') {
            char *end;
            errno = 0;
            a = strtod(v + 12, &end);
            if (end == v + 12 || *end || errno || !(a > 0 && a <= 1))
                return bad(key, v, "quantized, unquantized or unquantized:A with A in (0, 1]");
        }
        o->gptq.target_unquantized = a;
    } else if (!strcmp(key, "refine-scales")) {
        st = get_bool(key, v, &o->gptq.refine_scales);
    } else if (!strcmp(key, "clip-search")) {
        st = get_bool(key, v, &o->gptq.clip_search);
    } else if (!strcmp(key, "damp-sweep")) {
        /* F,F,...: up to 8 candidates; "" or "none": no sweep */
        int32_t n = 0;
        const char *q = v;
        while (*q && strcmp(v, "none")) {
            char *end;
            errno = 0;
            double x = strtod(q, &end);
            if (end == q || errno || !isfinite(x) || x < 0 || n == 8 || (*end && *end != ','))
                return bad(key, v, "up to 8 damping fractions >= 0 separated by commas");
            o->gptq.damp_sweep[n++] = x;
            q = *end ? end + 1 : end;
        }
        o->gptq.n_damp_sweep = n;
    } else if (!strcmp(key, "report")) {
        o->gptq.report = v;
    } else if (!strcmp(key, "report-html")) {
        o->gptq.report_html = v;
    } else if (!strcmp(key, "gguf-rest")) {
        static const char *const n[] = {"auto", "f32", "f16", "bf16", "q8_0"};
        if ((k = pick(v, n, 5)) < 0) return bad(key, v, "auto, f32, f16, bf16 or q8_0");
        o->gguf_rest = n[k];
    } else {
        return mq_err(MOEQ_E_ARG, "unknown quantize option '%s' (the names of moeq quantize's flags)", key);
    }
    return st;
}

moeq_status moeq_eval_options_set(moeq_eval_options *o, const char *key, const char *v) {
    if (!o || !key || !v) return mq_err(MOEQ_E_ARG, "moeq_eval_options_set: NULL argument");
    int64_t i = 0;
    double d = 0;
    moeq_status st = MOEQ_OK;
    if (!strcmp(key, "task")) {
        static const char *const n[] = {"wikitext", "text"};
        int k = pick(v, n, 2);
        if (k < 0) return bad(key, v, "wikitext or text");
        o->task = k ? MOEQ_TASK_TEXT : MOEQ_TASK_WIKITEXT;
    } else if (!strcmp(key, "max-length")) {
        if (!(st = get_int(key, v, 0, 1 << 24, &i))) o->max_length = (int32_t)i;
    } else if (!strcmp(key, "limit")) {
        st = get_int(key, v, 0, INT64_MAX, &o->limit);
    } else if (!strcmp(key, "add-bos")) {
        st = get_bool(key, v, &o->add_bos);
    } else if (!strcmp(key, "temperature")) {
        if (!(st = get_double(key, v, &d)) && !(d > 0)) st = bad(key, v, "a positive number");
        if (!st) o->temperature = d;
    } else if (!strcmp(key, "entropy")) {
        st = get_bool(key, v, &o->entropy);
    } else if (!strcmp(key, "kl-logits")) {
        o->kl_logits = v;
    } else if (!strcmp(key, "save-logits")) {
        o->save_logits = v;
    } else if (!strcmp(key, "device")) {
        st = mq_gpu_parse_device(v, &o->device);
    } else if (!strcmp(key, "gpu-precision")) {
        static const char *const n[] = {"fp32", "tf32x3", "tf32"};
        int k = pick(v, n, 3);
        if (k < 0) return bad(key, v, "fp32, tf32x3 or tf32");
        o->gpu_precision = k;
    } else {
        return mq_err(MOEQ_E_ARG, "unknown eval option '%s' (the names of moeq eval's flags)", key);
    }
    return st;
}

void moeq_quant_options_set_ignore(moeq_quant_options *o, const char *const *patterns, int32_t n) {
    o->ignore = patterns;
    o->n_ignore = n;
}

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

void moeq_eval_options_set_base(moeq_eval_options *o, const moeq_model *base) { o->kl_base = base; }

static char *to_text(cJSON *j) {
    char *s = j ? cJSON_PrintUnformatted(j) : NULL;
    cJSON_Delete(j);
    return s;
}

/* Numbers as %.17g (cJSON's own printing may drop the last bit), non-finite as null. */
static void add_num(cJSON *j, const char *k, double v) {
    char t[40];
    if (!isfinite(v)) {
        cJSON_AddNullToObject(j, k);
        return;
    }
    snprintf(t, sizeof t, "%.17g", v);
    cJSON_AddRawToObject(j, k, t);
}

char *moeq_quant_result_json(const moeq_quant_result *r) {
    cJSON *j = cJSON_CreateObject();
    if (!j || !r) return to_text(j);
    add_num(j, "linears_quantized", (double)r->linears_quantized);
    add_num(j, "linears_kept", (double)r->linears_kept);
    add_num(j, "weights_quantized", (double)r->weights_quantized);
    add_num(j, "tensors_written", (double)r->tensors_written);
    add_num(j, "bytes_written", (double)r->bytes_written);
    add_num(j, "seconds", r->seconds);
    add_num(j, "gptq_samples", (double)r->gptq_samples);
    add_num(j, "gptq_tokens", (double)r->gptq_tokens);
    add_num(j, "gptq_linears", (double)r->gptq_linears);
    add_num(j, "gptq_fallback_linears", (double)r->gptq_fallback_linears);
    add_num(j, "gptq_worse_than_rtn", (double)r->gptq_worse_than_rtn);
    add_num(j, "gptq_loss", r->gptq_loss);
    add_num(j, "gptq_rtn_loss", r->gptq_rtn_loss);
    add_num(j, "peak_anon_bytes", (double)r->peak_anon_bytes);
    add_num(j, "layers_resumed", r->layers_resumed);
    if (r->balance_candidates > 0) {
        cJSON *b = cJSON_AddObjectToObject(j, "balance");
        add_num(b, "candidates", (double)r->balance_candidates);
        add_num(b, "experts_under_first", (double)r->balance_under[0]);
        add_num(b, "experts_under_chosen", (double)r->balance_under[1]);
        add_num(b, "fewest_tokens_first", (double)r->balance_fewest[0]);
        add_num(b, "fewest_tokens_chosen", (double)r->balance_fewest[1]);
        add_num(b, "seconds", r->balance_seconds);
    }
    cJSON *p = cJSON_AddObjectToObject(j, "plan");
    add_num(p, "budget_bytes", (double)r->plan.budget);
    add_num(p, "peak_bytes", (double)r->plan.peak);
    add_num(p, "expert_chunk", r->plan.chunk);
    add_num(p, "estimated_seconds", r->plan.seconds);
    add_num(p, "disk_output_bytes", (double)r->plan.disk_output);
    return to_text(j);
}

char *moeq_eval_result_json(const moeq_eval_result *r) {
    cJSON *j = cJSON_CreateObject();
    if (!j || !r) return to_text(j);
    add_num(j, "word_perplexity", r->word_perplexity);
    add_num(j, "byte_perplexity", r->byte_perplexity);
    add_num(j, "bits_per_byte", r->bits_per_byte);
    add_num(j, "token_perplexity", r->token_perplexity);
    add_num(j, "loglikelihood", r->loglikelihood);
    add_num(j, "tokens", (double)r->tokens);
    add_num(j, "words", (double)r->words);
    add_num(j, "bytes", (double)r->bytes);
    add_num(j, "documents", (double)r->documents);
    add_num(j, "seconds", r->seconds);
    cJSON_AddBoolToObject(j, "interrupted", r->interrupted != 0);
    if (r->has_kl) {
        add_num(j, "kl_mean", r->kl_mean);
        add_num(j, "kl_p99", r->kl_p99);
        add_num(j, "top1_changed", r->top1_changed);
        add_num(j, "kl_tokens", (double)r->kl_tokens);
    }
    if (r->has_base) add_num(j, "base_word_perplexity", r->base_word_perplexity);
    if (r->has_entropy) add_num(j, "entropy_mean", r->entropy_mean);
    if (r->device[0]) cJSON_AddStringToObject(j, "device", r->device);
    return to_text(j);
}

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
    add_num(j, "layers", c.n_layers);
    add_num(j, "hidden_size", (double)c.D);
    add_num(j, "experts", c.n_experts);
    add_num(j, "experts_per_token", c.top_k);
    add_num(j, "vocab_size", (double)c.vocab);
    int64_t total = 0, active = 0;
    mq_config_param_counts(&c, &total, &active);
    add_num(j, "parameters", (double)total);
    add_num(j, "active_parameters", (double)active);
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
    add_num(j, "tensors", (double)n);
    add_num(j, "tensor_elements", (double)params);
    add_num(j, "tensor_bytes", (double)bytes);
    mq_st_close(s);
    *out = to_text(j);
    return *out ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory");
}
