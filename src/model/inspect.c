/*
 * moeq_inspect_json: a checkpoint's facts from config.json (read once) and the safetensors
 * headers, no weight read: what `moeq inspect` prints (tools/moeq/cmd_inspect.c renders this
 * JSON as text) and the Python package returns.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/layout.h"
#include "core/json.h"
#include "io/safetensors.h"
#include "model/model.h"

/* Orders names with digit runs compared as numbers (layers.2 before layers.10). */
static int natural_cmp(const char *a, const char *b) {
    while (*a && *b) {
        if (isdigit((unsigned char)*a) && isdigit((unsigned char)*b)) {
            char *ea, *eb;
            unsigned long long x = strtoull(a, &ea, 10), y = strtoull(b, &eb, 10);
            if (x != y) return x < y ? -1 : 1;
            a = ea;
            b = eb;
            continue;
        }
        if (*a != *b) return (unsigned char)*a < (unsigned char)*b ? -1 : 1;
        a++;
        b++;
    }
    return *a ? 1 : *b ? -1 : 0;
}

static int cmp_views(const void *x, const void *y) {
    const mq_tensor_view *a = *(const mq_tensor_view *const *)x, *b = *(const mq_tensor_view *const *)y;
    return natural_cmp(a->name, b->name);
}

static int cmp_names(const void *x, const void *y) { return natural_cmp(*(char *const *)x, *(char *const *)y); }

static const char *arch_notes(const mq_config *c) {
    switch (c->arch) {
    case MQ_ARCH_LLAMA: return "dense";
    case MQ_ARCH_OLMOE: return "MoE, q/k RMSNorm over the whole projection";
    case MQ_ARCH_QWEN2_MOE: return "MoE with a shared expert (sigmoid gate), q/k/v bias";
    case MQ_ARCH_QWEN3_MOE: return "MoE, per-head q/k RMSNorm";
    case MQ_ARCH_MIXTRAL: return "MoE (block_sparse_moe)";
    case MQ_ARCH_DEEPSEEK_V3: return "MoE, multi-head latent attention, sigmoid group-limited routing";
    }
    return "";
}

/* The architecture's figures (config.json as mq_config reads it). */
static void add_config(cJSON *j, const mq_config *c) {
    int n_moe = 0;
    for (int l = 0; l < c->n_layers; l++) n_moe += c->layer_is_moe[l];
    cJSON_AddStringToObject(j, "model_type", c->model_type);
    cJSON_AddStringToObject(j, "architecture", arch_notes(c));
    const mq_json_num sizes[] = {
        {"layers", c->n_layers},
        {"moe_layers", n_moe},
        {"hidden_size", (double)c->D},
        {"experts", c->n_experts},
        {"experts_per_token", c->top_k},
        {"vocab_size", (double)c->vocab},
        {"context", c->max_pos},
    };
    mq_json_add_nums(j, sizes, sizeof sizes / sizeof *sizes);
    cJSON *a = cJSON_AddObjectToObject(j, "attention");
    const mq_json_num heads[] = {{"heads", c->n_heads}, {"kv_heads", c->n_kv_heads}, {"head_dim", c->head_dim}};
    mq_json_add_nums(a, heads, 3);
    cJSON_AddBoolToObject(a, "qkv_bias", c->qkv_bias);
    cJSON_AddBoolToObject(a, "sliding_window", c->sliding_window > 0);
    if (c->mla) {
        cJSON *m = cJSON_AddObjectToObject(j, "latent_attention");
        const mq_json_num ranks[] = {
            {"q_lora_rank", c->q_lora_rank},
            {"kv_lora_rank", c->kv_lora_rank},
            {"qk_nope_head_dim", c->qk_nope},
            {"qk_rope_head_dim", c->qk_rope},
            {"v_head_dim", c->v_head_dim},
        };
        mq_json_add_nums(m, ranks, sizeof ranks / sizeof *ranks);
        cJSON_AddBoolToObject(m, "rope_interleave", c->rope_interleave);
    }
    cJSON *r = cJSON_AddObjectToObject(j, "rope");
    mq_json_add_num(r, "theta", c->rope_theta);
    if (c->yarn) {
        const mq_json_num yarn[] = {
            {"factor", c->yarn_factor},
            {"original_context", c->yarn_orig_max_pos},
            {"attention_factor", c->rope_attn_factor},
            {"softmax_scale", c->attn_scale},
        };
        mq_json_add_nums(cJSON_AddObjectToObject(r, "yarn"), yarn, sizeof yarn / sizeof *yarn);
    }
    if (n_moe > 0) {
        mq_json_add_num(j, "expert_ffn", c->moe_ffn);
        cJSON_AddBoolToObject(j, "norm_topk_prob", c->norm_topk_prob);
        if (c->shared_ffn > 0) {
            mq_json_add_num(j, "shared_expert_ffn", c->shared_ffn);
            cJSON_AddBoolToObject(j, "shared_expert_gate", c->shared_gate);
        }
        if (c->sigmoid_router) {
            cJSON *g = cJSON_AddObjectToObject(j, "sigmoid_routing");
            cJSON_AddBoolToObject(g, "selection_bias", c->router_bias);
            mq_json_add_num(g, "groups", c->n_group);
            mq_json_add_num(g, "topk_group", c->topk_group);
            mq_json_add_num(g, "scale", (double)c->routed_scale);
        }
    }
    if (n_moe < c->n_layers) mq_json_add_num(j, "dense_ffn", c->ffn);
    cJSON_AddBoolToObject(j, "tied_embeddings", c->tie_embeddings);
    int64_t total = 0, active = 0;
    mq_config_param_counts(c, &total, &active);
    mq_json_add_num(j, "parameters", (double)total);
    mq_json_add_num(j, "active_parameters", (double)active);
    if (c->quant_method) cJSON_AddStringToObject(j, "quant_method", c->quant_method);
    if (c->quant_format) cJSON_AddStringToObject(j, "quant_format", c->quant_format);
}

/* The tensors: counts and bytes, per dtype, and DeepSeek-V3's multi-token-prediction layers
 * (past num_hidden_layers, never run, kept by quantize). */
static void add_tensors(cJSON *j, const mq_config *c, const mq_st *sf) {
    int64_t numel[MOEQ_DT_COUNT] = {0}, bytes[MOEQ_DT_COUNT] = {0}, params = 0, all = 0, mtp_n = 0, mtp_b = 0;
    const size_t n = mq_st_count(sf);
    for (size_t i = 0; i < n; i++) {
        const mq_tensor_view *t = mq_st_at(sf, i);
        numel[t->dtype] += t->numel;
        bytes[t->dtype] += (int64_t)t->nbytes;
        params += t->numel;
        all += (int64_t)t->nbytes;
        int l;
        if (sscanf(t->name, "model.layers.%d.", &l) == 1 && l >= c->n_layers) {
            mtp_n++;
            mtp_b += (int64_t)t->nbytes;
        }
    }
    mq_json_add_num(j, "tensors", (double)n);
    mq_json_add_num(j, "tensor_elements", (double)params);
    mq_json_add_num(j, "tensor_bytes", (double)all);
    if (c->arch == MQ_ARCH_DEEPSEEK_V3) {
        cJSON *m = cJSON_AddObjectToObject(j, "mtp");
        mq_json_add_num(m, "layers", c->n_mtp);
        mq_json_add_num(m, "tensors", (double)mtp_n);
        mq_json_add_num(m, "bytes", (double)mtp_b);
    }
    cJSON *d = cJSON_AddArrayToObject(j, "dtypes");
    for (int k = 0; k < MOEQ_DT_COUNT; k++) {
        if (!bytes[k] && !numel[k]) continue;
        cJSON *x = cJSON_CreateObject();
        cJSON_AddStringToObject(x, "dtype", moeq_dtype_name((moeq_dtype)k));
        mq_json_add_num(x, "values", (double)numel[k]);
        mq_json_add_num(x, "bytes", (double)bytes[k]);
        cJSON_AddItemToArray(d, x);
    }
}

static void add_tensor_list(cJSON *j, const mq_st *sf) {
    const size_t n = mq_st_count(sf);
    const mq_tensor_view **v = malloc(sizeof *v * (n ? n : 1));
    cJSON *a = cJSON_AddArrayToObject(j, "tensor_list");
    if (!v || !a) {
        free(v);
        return;
    }
    for (size_t i = 0; i < n; i++) v[i] = mq_st_at(sf, i);
    qsort(v, n, sizeof *v, cmp_views);
    for (size_t i = 0; i < n; i++) {
        cJSON *x = cJSON_CreateObject();
        cJSON_AddStringToObject(x, "name", v[i]->name);
        cJSON_AddStringToObject(x, "dtype", moeq_dtype_name(v[i]->dtype));
        cJSON *s = cJSON_AddArrayToObject(x, "shape");
        for (int d = 0; d < v[i]->ndim; d++) cJSON_AddItemToArray(s, cJSON_CreateNumber((double)v[i]->shape[d]));
        mq_json_add_num(x, "bytes", (double)v[i]->nbytes);
        cJSON_AddItemToArray(a, x);
    }
    free(v);
}

/* Module name of a tensor that carries a weight: P.weight (2-D), P.weight_packed, P.qweight. */
static char *weight_module(const mq_tensor_view *t) {
    const char *dot = strrchr(t->name, '.');
    if (!dot) return NULL;
    const char *suf = dot + 1;
    if ((!strcmp(suf, "weight") && t->ndim == 2) || !strcmp(suf, "weight_packed") || !strcmp(suf, "qweight"))
        return mq_strndup(t->name, (size_t)(dot - t->name));
    return NULL;
}

/* The storage of every 2-D weight: one summary per kind ("storage"), and with list each weight
 * in natural order ("weight_list"). */
static moeq_status add_storage(cJSON *j, const mq_st *sf, bool list) {
    struct {
        int64_t n, weights;
        double bits;
    } sum[MQ_LIN_FP8_BLOCK + 1];
    memset(sum, 0, sizeof sum);
    size_t n = 0, cnt = mq_st_count(sf);
    char **mods = malloc(sizeof *mods * (cnt ? cnt : 1));
    if (!mods) return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (size_t i = 0; i < cnt; i++) {
        char *m = weight_module(mq_st_at(sf, i));
        if (m) mods[n++] = m;
    }
    qsort(mods, n, sizeof *mods, cmp_names);
    cJSON *wl = list ? cJSON_AddArrayToObject(j, "weight_list") : NULL;
    moeq_status s = MOEQ_OK;
    for (size_t i = 0; i < n && !s; i++) {
        mq_linear_qinfo qi;
        if ((s = mq_linear_qinfo_get(sf, mods[i], &qi))) break;
        if (wl) {
            char g[32] = "-";
            if (qi.scheme != MQ_QS_NONE) snprintf(g, sizeof g, "%lld", (long long)qi.group_size);
            if (qi.kind == MQ_LIN_FP8_BLOCK) {
                const mq_tensor_view *t = NULL;
                char wn[1024];
                if (snprintf(wn, sizeof wn, "%s.weight", mods[i]) < (int)sizeof wn) t = mq_st_find(sf, wn);
                if (t) snprintf(g, sizeof g, "%dx%d", t->block_rows, t->block_cols);
            }
            cJSON *x = cJSON_CreateObject();
            cJSON_AddStringToObject(x, "module", mods[i]);
            cJSON_AddStringToObject(x, "storage", mq_linear_kind_name(qi.kind));
            cJSON_AddStringToObject(x, "group", g);
            mq_json_add_num(x, "bits_per_weight", qi.bits_per_weight);
            cJSON_AddItemToArray(wl, x);
        }
        sum[qi.kind].n++;
        sum[qi.kind].weights += qi.rows * qi.cols;
        sum[qi.kind].bits += qi.bits_per_weight * (double)qi.rows * (double)qi.cols;
    }
    for (size_t i = 0; i < n; i++) free(mods[i]);
    free(mods);
    cJSON *a = cJSON_AddArrayToObject(j, "storage");
    for (int k = MQ_LIN_DENSE; k <= MQ_LIN_FP8_BLOCK && !s; k++) {
        if (!sum[k].n) continue;
        cJSON *x = cJSON_CreateObject();
        cJSON_AddStringToObject(x, "storage", mq_linear_kind_name((mq_linear_kind)k));
        mq_json_add_num(x, "weights", (double)sum[k].n);
        mq_json_add_num(x, "values", (double)sum[k].weights);
        mq_json_add_num(x, "bits_per_weight", sum[k].bits / (double)sum[k].weights);
        cJSON_AddItemToArray(a, x);
    }
    return s;
}

moeq_status moeq_inspect_json_ex(const char *model_dir, unsigned flags, char **out) {
    if (!out) return mq_err(MOEQ_E_ARG, "moeq_inspect_json: out is NULL");
    *out = NULL;
    if (flags & ~(MOEQ_INSPECT_TENSORS | MOEQ_INSPECT_WEIGHTS))
        return mq_err(MOEQ_E_ARG, "moeq_inspect_json_ex: unknown flags %#x", flags);
    char *path = NULL;
    cJSON *root = NULL;
    moeq_status st = mq_config_file_parse(model_dir, &path, &root);
    mq_config c;
    memset(&c, 0, sizeof c);
    if (!st) st = mq_config_from_json(root, path, &c);
    mq_st *sf = NULL;
    if (!st) st = mq_st_open_dir_blocks(model_dir, (mq_fp8_blocks){c.fp8_block_rows, c.fp8_block_cols}, &sf);
    cJSON *j = st ? NULL : cJSON_CreateObject();
    if (j) {
        add_config(j, &c);
        add_tensors(j, &c, sf);
        const cJSON *q = cJSON_GetObjectItemCaseSensitive(root, "quantization_config");
        if (cJSON_IsObject(q)) cJSON_AddItemToObject(j, "quantization_config", cJSON_Duplicate(q, 1));
        st = add_storage(j, sf, flags & MOEQ_INSPECT_WEIGHTS);
        if (!st && (flags & MOEQ_INSPECT_TENSORS)) add_tensor_list(j, sf);
    }
    mq_st_close(sf);
    mq_config_free(&c);
    cJSON_Delete(root);
    free(path);
    if (st) {
        cJSON_Delete(j);
        return st;
    }
    *out = mq_json_take_text(j);
    return *out ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory");
}

moeq_status moeq_inspect_json(const char *model_dir, char **out) { return moeq_inspect_json_ex(model_dir, 0, out); }
