/*
 * The JSON report of a run: settings, calibration, the memory plan, per-layer seconds and peak
 * anonymous memory, and one record per quantized Linear (tokens of its Hessian, method, GPTQ loss
 * against the RTN loss, damping, dead columns, seconds), with totals. Written atomically.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/internal.h"

static void json_num(cJSON *o, const char *k, double v) {
    if (isfinite(v)) cJSON_AddNumberToObject(o, k, v);
    else cJSON_AddNullToObject(o, k);
}

/* A layer's stage seconds under the names the report and the work manifest give them. */
static const struct {
    const char *key;
    size_t at;   /* the double's offset in mq_layer_report */
} k_stages[] = {
    {"total", offsetof(mq_layer_report, total)},      {"forward", offsetof(mq_layer_report, forward)},
    {"hessians", offsetof(mq_layer_report, hessian)}, {"gptq", offsetof(mq_layer_report, gptq)},
    {"write", offsetof(mq_layer_report, write)},      {"read", offsetof(mq_layer_report, read)},
};
enum { N_STAGES = sizeof k_stages / sizeof *k_stages };

cJSON *mq_layer_seconds_put(cJSON *parent, const mq_layer_report *lr) {
    cJSON *s = cJSON_AddObjectToObject(parent, "seconds");
    for (int i = 0; i < N_STAGES; i++)
        cJSON_AddNumberToObject(s, k_stages[i].key, *(const double *)((const char *)lr + k_stages[i].at));
    return s;
}

void mq_layer_seconds_get(mq_layer_report *lr, const cJSON *parent) {
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(parent, "seconds");
    for (int i = 0; i < N_STAGES; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, k_stages[i].key);
        double *x = (double *)((char *)lr + k_stages[i].at);
        *x = cJSON_IsNumber(v) && isfinite(v->valuedouble) ? v->valuedouble : 0.0;
    }
}

cJSON *mq_mod_report_json(const mq_mod_report *x) {
    cJSON *m = cJSON_CreateObject();
    if (!m) return NULL;
    cJSON_AddStringToObject(m, "module", x->module);
    cJSON_AddNumberToObject(m, "layer", x->layer);
    if (x->expert >= 0) cJSON_AddNumberToObject(m, "expert", x->expert);
    cJSON_AddNumberToObject(m, "tokens", (double)x->tokens);
    cJSON_AddStringToObject(m, "method", mq_how_name(x->how));
    if (x->type) cJSON_AddStringToObject(m, "type", x->type);
    json_num(m, "loss", x->stats.loss);
    json_num(m, "rtn_loss", x->stats.rtn_loss);
    if (x->how != MQ_HOW_RTN) {
        cJSON_AddNumberToObject(m, "percdamp", x->stats.percdamp);
        cJSON_AddNumberToObject(m, "dead_columns", (double)x->stats.n_dead);
    }
    cJSON_AddNumberToObject(m, "seconds", x->stats.seconds);
    return m;
}

/* ---- the settings of a run (quant_options.def's RECORD column) ---------------------------- */

static const char *mq_gptq_mse_weight_name(mq_gptq_mse_weight w) {
    return w == MQ_GPTQ_MSE_HDIAG ? "hessian" : w == MQ_GPTQ_MSE_OBQ ? "obq"
                                  : w == MQ_GPTQ_MSE_LOOP ? "gptq" : "plain";
}

static const char *mq_gptq_groups_name(mq_gptq_groups g) {
    return g == MQ_GPTQ_GROUPS_STATIC ? "static" : g == MQ_GPTQ_GROUPS_GIDX ? "g_idx" : "dynamic";
}

static cJSON *mq_strings_json(const char *const *s, int n) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateString(s[i]));
    return a;
}

/* The K-quant file's recipe as the CLI names it: "q4_k_m", "q6_k", ... */
static const char *mq_pipe_recipe_name(const mq_pipeline_opts *o) {
    static const char *const mixed[MQ_KQ_COUNT] = {"q3_k_m", "q4_k_m", "q5_k_m", "q6_k",
                                                   [MQ_KQ_IQ4_NL] = "iq4_nl", [MQ_KQ_IQ4_XS] = "iq4_xs"};
    static const char *const pure[MQ_KQ_COUNT] = {"q3_k", "q4_k", "q5_k", "q6_k"};
    const char *n = (unsigned)o->spec.kq < MQ_KQ_COUNT ? (o->kq_mixture ? mixed : pure)[o->spec.kq] : NULL;
    return n ? n : "?";
}

static cJSON *mq_scale_search_json(const mq_qspec *q) {
    cJSON *a = cJSON_CreateArray();
    if (!a) return NULL;
    cJSON_AddItemToArray(a, cJSON_CreateNumber(q->mse_lo));
    cJSON_AddItemToArray(a, cJSON_CreateNumber(q->mse_hi));
    cJSON_AddItemToArray(a, cJSON_CreateNumber(q->mse_steps));
    return a;
}

enum { MQ_REC_ALL, MQ_REC_ID };
#define MQ_REC_NUM(j, k, v) cJSON_AddNumberToObject(j, k, v)
#define MQ_REC_BOOL(j, k, v) cJSON_AddBoolToObject(j, k, (v) != 0)
#define MQ_REC_STR(j, k, v) cJSON_AddStringToObject(j, k, v)
#define MQ_REC_ITEM(j, k, v) cJSON_AddItemToObject(j, k, v)
#define REC(where, type, key, value, when)                                                         \
    if ((identity || where == MQ_REC_ALL) && (when)) MQ_REC_##type(j, key, value);
#define NOREC

cJSON *mq_settings_json(const mq_pipe *p, bool identity) {
    const mq_pipeline_opts *o = p->o;
    cJSON *j = cJSON_CreateObject();
    if (!j) return NULL;
#define MQ_QOPT(name, kind, p1, p2, field, def, metavar, ident, record, help) record
#include "pipeline/quant_options.def"
#undef MQ_QOPT
    if (identity) {   /* conventions of the format, set by none of the options */
        cJSON_AddNumberToObject(j, "int4_zero_min", o->spec.int4_zero_min);
        cJSON_AddNumberToObject(j, "nvfp4_conv", o->spec.nvfp4_conv);
    }
    return j;
}
#undef REC
#undef NOREC

static cJSON *plan_json(const mq_mem_plan *mp) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "budget_bytes", (double)mp->budget);
    cJSON_AddNumberToObject(j, "planned_peak_bytes", (double)mp->peak);
    cJSON_AddNumberToObject(j, "activations_bytes", (double)mp->activations);
    cJSON_AddNumberToObject(j, "routing_bytes", (double)mp->routing);
    cJSON_AddNumberToObject(j, "state_bytes", (double)mp->state);
    cJSON_AddNumberToObject(j, "attention_bytes", (double)mp->attention);
    cJSON_AddNumberToObject(j, "expert_chunk_bytes", (double)mp->expert_chunk);
    cJSON_AddNumberToObject(j, "shared_or_dense_bytes", (double)mp->ffn_other);
    cJSON_AddNumberToObject(j, "snapshot_copy_bytes", (double)mp->snapshot_copy);
    cJSON_AddNumberToObject(j, "expert_chunk", mp->chunk);
    cJSON_AddNumberToObject(j, "chunks_per_layer", mp->n_chunks);
    cJSON_AddNumberToObject(j, "sample_batch", mp->batch);
    cJSON_AddStringToObject(j, "activation_storage", mq_act_storage_name(mp->storage));
    cJSON_AddNumberToObject(j, "flops_forward", mp->flops_forward);
    cJSON_AddNumberToObject(j, "flops_hessians", mp->flops_hessian);
    cJSON_AddNumberToObject(j, "flops_gptq", mp->flops_gptq);
    cJSON_AddNumberToObject(j, "sgemm_gflops", mp->sgemm_gflops);
    cJSON_AddNumberToObject(j, "estimated_seconds", mp->seconds);
    return j;
}

moeq_status mq_report_write(const mq_pipe *p, const char *path, const char *html_path) {
    const mq_pipeline_opts *o = p->o;
    const mq_pipeline_result *r = p->res;
    cJSON *j = cJSON_CreateObject();
    /* what ran it: the last bits of OpenBLAS's sums depend on its kernel set (checkpoints from
     * hosts with different sets can differ there; never with the thread or rank count) */
    cJSON *host = cJSON_AddObjectToObject(j, "host");
    cJSON_AddStringToObject(host, "moeq", moeq_version());
    cJSON_AddStringToObject(host, "cpu_kernels", moeq_cpu_kernels());
    cJSON_AddStringToObject(host, "blas_kernels", moeq_blas_kernels());
    cJSON_AddItemToObject(j, "settings", mq_settings_json(p, false));
    cJSON *cal = cJSON_AddObjectToObject(j, "calibration");
    const char *cfile = o->gptq ? o->calib.path : o->act_calib;
    if (cfile) cJSON_AddStringToObject(cal, "file", cfile);
    if (o->gptq) {
        cJSON_AddStringToObject(cal, "sampling", o->calib.mode == MQ_CALIB_RANDOM ? "random"
                                                 : o->calib.mode == MQ_CALIB_DOCS ? "docs" : "chunks");
        cJSON_AddNumberToObject(cal, "seqlen", (double)o->calib.seqlen);
        cJSON_AddStringToObject(cal, "balance", o->calib_balance ? "experts" : "none");
        if (r->balance_pool > 0) {   /* the choice was made (a pool larger than the samples) */
            cJSON *b = cJSON_AddObjectToObject(cal, "balance_choice");
            cJSON_AddNumberToObject(b, "candidates", (double)r->balance_pool);
            cJSON_AddNumberToObject(b, "min_expert_tokens", (double)(o->min_expert_tokens));
            /* [the first samples, the chosen ones] over every MoE layer's experts */
            cJSON *u = cJSON_AddArrayToObject(b, "experts_under_min_tokens");
            cJSON *f = cJSON_AddArrayToObject(b, "fewest_tokens");
            for (int i = 0; i < 2; i++) {
                cJSON_AddItemToArray(u, cJSON_CreateNumber((double)r->balance_under[i]));
                cJSON_AddItemToArray(f, cJSON_CreateNumber((double)r->balance_least[i]));
            }
            cJSON_AddNumberToObject(b, "seconds", r->balance_seconds);
        }
    }
    cJSON_AddNumberToObject(cal, "samples", (double)r->samples);
    cJSON_AddNumberToObject(cal, "tokens", (double)r->tokens);
    cJSON_AddItemToObject(j, "plan", plan_json(&r->plan));
    const mq_layer_report all = {.total = r->seconds_total, .forward = r->seconds_forward,
                                 .hessian = r->seconds_hessian, .gptq = r->seconds_gptq,
                                 .write = r->seconds_write, .read = r->seconds_read};
    cJSON_AddNumberToObject(mq_layer_seconds_put(j, &all), "balance", r->balance_seconds);
    cJSON_AddNumberToObject(j, "peak_anon_bytes", (double)r->peak_anon);
    cJSON_AddNumberToObject(j, "layers_resumed", r->layers_resumed);
    if (p->budget_json) cJSON_AddItemToObject(j, "kquant_budget", cJSON_Duplicate(p->budget_json, 1));
    cJSON *layers = cJSON_AddArrayToObject(j, "layers");
    cJSON *mods = cJSON_AddArrayToObject(j, "modules");
    for (int l = 0; l < p->plan.n_layers; l++) {
        const mq_layer_report *lr = &p->layers[l];
        cJSON *x = cJSON_CreateObject();
        cJSON_AddNumberToObject(x, "layer", l);
        mq_layer_seconds_put(x, lr);
        cJSON_AddNumberToObject(x, "peak_anon_bytes", (double)lr->peak_anon);
        cJSON_AddNumberToObject(x, "expert_chunks", lr->chunks);
        if (p->gpu) {   /* where the routed experts' rows, inputs and outputs lived */
            cJSON *g = cJSON_AddObjectToObject(x, "gpu");
            cJSON_AddNumberToObject(g, "expert_batches_on_device", lr->gpu_device_batches);
            cJSON_AddNumberToObject(g, "batches_with_inputs_from_attention", lr->gpu_kept_inputs);
            cJSON_AddBoolToObject(g, "outputs_combined_on_device", lr->gpu_combined);
            cJSON_AddBoolToObject(g, "first_experts_sent_during_attention", lr->gpu_experts_ahead);
            cJSON_AddBoolToObject(g, "residual_added_on_device", lr->gpu_residual);
            cJSON_AddBoolToObject(g, "boundary_only_on_device", lr->gpu_h_device_only);
            cJSON_AddBoolToObject(g, "ffn_input_only_on_device", lr->gpu_xn_device_only);
            cJSON_AddNumberToObject(g, "attention_inputs_from_device", lr->gpu_inputs_from_device);
        }
        cJSON_AddItemToArray(layers, x);
        const cJSON *m;
        cJSON_ArrayForEach(m, lr->modules) cJSON_AddItemToArray(mods, cJSON_Duplicate(m, 1));
    }
    cJSON *sum = cJSON_AddObjectToObject(j, "summary");
    cJSON_AddNumberToObject(sum, "modules", (double)r->linears);
    cJSON_AddNumberToObject(sum, "expert_fallbacks", (double)r->fallbacks);
    cJSON_AddNumberToObject(sum, "gptq_loss_total", r->loss);
    cJSON_AddNumberToObject(sum, "rtn_loss_total", r->rtn_loss);
    cJSON_AddNumberToObject(sum, "modules_worse_than_rtn", (double)r->worse_than_rtn);
    char *text = cJSON_Print(j);
    moeq_status st = html_path && text ? mq_report_html_write(j, html_path) : MOEQ_OK;
    cJSON_Delete(j);
    if (!text) return mq_err(MOEQ_E_NOMEM, "out of memory writing %s", path);
    size_t len = strlen(text);
    text[len] = '\n';   /* cJSON_Print leaves room for the NUL only: write len bytes + newline */
    if (!st) st = mq_write_file_atomic(path, text, len + 1);
    free(text);
    return st;
}
