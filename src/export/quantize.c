/*
 * Quantize a Hugging Face checkpoint into a vLLM-loadable one (compressed-tensors, ModelOpt NVFP4,
 * GPTQ v1). Spec: ../shared/docs/formats.md sections 1 (sharding, index) and 2 (layouts, config
 * blocks, fused global scales, what stays unquantized). Plan first (which tensors are Linears,
 * which stay unquantized, the fusion groups), then stream every tensor through the shard writer
 * into a temporary directory that is renamed over OUT_DIR once complete.
 */
#define PCRE2_CODE_UNIT_WIDTH 8

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdarg.h>
#include <math.h>
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "export/quantize.h"

void mq_quantize_opts_init(mq_quantize_opts *o, mq_qscheme scheme, mq_ckpt_format format) {
    memset(o, 0, sizeof *o);
    o->spec = mq_qspec_default(scheme);
    o->format = format;
    if (format == MQ_FMT_MODELOPT) o->spec.nvfp4_conv = MQ_NVFP4_MUL;
    if (format == MQ_FMT_GPTQ) {
        o->spec.scale_dtype = MOEQ_DT_F16;
        o->spec.int4_zero_min = 1;
    }
}

const char *mq_fusion_tag(const char *leaf) {
    static const char *const map[][2] = {
        {"q_proj", "qkv"},   {"k_proj", "qkv"},     {"v_proj", "qkv"},
        {"gate_proj", "gate_up"}, {"up_proj", "gate_up"}, {"w1", "w13"}, {"w3", "w13"},
        {"q_a_proj", "q_a"}, {"kv_a_proj_with_mqa", "q_a"}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (strcmp(leaf, map[i][0]) == 0) return map[i][1];
    return NULL;
}

/* ---- the plan --------------------------------------------------------------------------- */

typedef struct {
    char *module;                 /* output module name (tensor = module + ".weight") */
    const mq_tensor_view *src;
    int64_t offset;               /* first element inside src (fused experts) */
    int64_t rows, cols;
    bool quantize;
    bool user_ignored;
    int group;                    /* fusion group (index into groups), -1 none */
    float global_scale;
} item;

typedef struct {
    char *key;
    float amax;
} fgroup;

typedef struct {
    item *items;
    size_t n, cap;
    fgroup *groups;
    size_t n_groups, cap_groups;
    bool *tensor_is_linear;       /* per source tensor: consumed by items */
} plan;

static void plan_free(plan *p) {
    for (size_t i = 0; i < p->n; i++) free(p->items[i].module);
    for (size_t i = 0; i < p->n_groups; i++) free(p->groups[i].key);
    free(p->items);
    free(p->groups);
    free(p->tensor_is_linear);
    memset(p, 0, sizeof *p);
}

static moeq_status plan_add(plan *p, char *module, const mq_tensor_view *src, int64_t offset,
                            int64_t rows, int64_t cols) {
    if (!module) return mq_err(MOEQ_E_NOMEM, "out of memory");
    if (p->n == p->cap) {
        size_t cap = p->cap ? 2 * p->cap : 64;
        item *v = realloc(p->items, cap * sizeof *v);
        if (!v) {
            free(module);
            return mq_err(MOEQ_E_NOMEM, "out of memory");
        }
        p->items = v;
        p->cap = cap;
    }
    p->items[p->n++] = (item){module, src, offset, rows, cols, true, false, -1, 1.0f};
    return MOEQ_OK;
}

/* Output name of a source tensor or module. Mixtral re-saved by transformers 5 keeps its MoE
 * block under "mlp."; per-expert checkpoints (what vLLM and the hub use) name it
 * "block_sparse_moe.", so its names move back there. */
static char *out_name(const char *name, bool mixtral) {
    int l, n = 0;
    if (mixtral && sscanf(name, "model.layers.%d.mlp.%n", &l, &n) == 1 && n > 0)
        return mq_asprintf("%.*sblock_sparse_moe.%s", n - 4, name, name + n);
    return mq_strdup(name);
}

static char *out_namef(bool mixtral, const char *fmt, ...) MQ_PRINTF(2, 3);
static char *out_namef(bool mixtral, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (k < 0 || k >= (int)sizeof buf) return NULL;
    return out_name(buf, mixtral);
}

static const char *leaf_of(const char *module) {
    const char *d = strrchr(module, '.');
    return d ? d + 1 : module;
}

static bool is_float(moeq_dtype dt) {
    return dt == MOEQ_DT_BF16 || dt == MOEQ_DT_F16 || dt == MOEQ_DT_F32;
}

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

/* Lists the Linears: 2D float "*.weight" under model.layers., plus fused expert tensors split
 * into per-expert modules with the hub names (gate_proj/up_proj/down_proj, Mixtral w1/w3/w2). */
static moeq_status plan_build(plan *p, const mq_st *st, bool mixtral) {
    size_t n = mq_st_count(st);
    p->tensor_is_linear = calloc(n ? n : 1, sizeof(bool));
    if (!p->tensor_is_linear) return mq_err(MOEQ_E_NOMEM, "out of memory");
    const char *gn = mixtral ? "w1" : "gate_proj", *un = mixtral ? "w3" : "up_proj",
               *dn = mixtral ? "w2" : "down_proj";
    for (size_t i = 0; i < n; i++) {
        const mq_tensor_view *t = mq_st_at(st, i);
        if (strncmp(t->name, "model.layers.", 13) != 0 || !is_float(t->dtype)) continue;
        moeq_status s = MOEQ_OK;
        if (t->ndim == 2 && ends_with(t->name, ".weight")) {
            char *src = mq_strndup(t->name, strlen(t->name) - 7);
            char *module = src ? out_name(src, mixtral) : NULL;
            free(src);
            s = plan_add(p, module, t, 0, t->shape[0], t->shape[1]);
        } else if (t->ndim == 3 && (ends_with(t->name, ".experts.gate_up_proj") ||
                                    ends_with(t->name, ".experts.down_proj"))) {
            bool gu = ends_with(t->name, ".gate_up_proj");
            size_t plen = strlen(t->name) - strlen(gu ? ".gate_up_proj" : ".down_proj");
            int64_t E = t->shape[0], R = t->shape[1], C = t->shape[2];
            if (gu && R % 2)
                return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': odd gate_up rows %lld", t->file,
                              t->name, (long long)R);
            for (int64_t e = 0; e < E && !s; e++) {
                if (gu) {
                    int64_t F = R / 2;
                    s = plan_add(p, out_namef(mixtral, "%.*s.%lld.%s", (int)plen, t->name, (long long)e, gn),
                                 t, e * R * C, F, C);
                    if (!s)
                        s = plan_add(p, out_namef(mixtral, "%.*s.%lld.%s", (int)plen, t->name, (long long)e, un),
                                     t, e * R * C + F * C, F, C);
                } else {
                    s = plan_add(p, out_namef(mixtral, "%.*s.%lld.%s", (int)plen, t->name, (long long)e, dn),
                                 t, e * R * C, R, C);
                }
            }
        } else {
            continue;
        }
        if (s) return s;
        p->tensor_is_linear[i] = true;
    }
    return MOEQ_OK;
}

static moeq_status plan_group(plan *p, const char *key, int *out) {
    for (size_t g = 0; g < p->n_groups; g++)
        if (strcmp(p->groups[g].key, key) == 0) {
            *out = (int)g;
            return MOEQ_OK;
        }
    if (p->n_groups == p->cap_groups) {
        size_t cap = p->cap_groups ? 2 * p->cap_groups : 64;
        fgroup *v = realloc(p->groups, cap * sizeof *v);
        if (!v) return mq_err(MOEQ_E_NOMEM, "out of memory");
        p->groups = v;
        p->cap_groups = cap;
    }
    p->groups[p->n_groups].key = mq_strdup(key);
    if (!p->groups[p->n_groups].key) return mq_err(MOEQ_E_NOMEM, "out of memory");
    p->groups[p->n_groups].amax = 0.0f;
    *out = (int)p->n_groups++;
    return MOEQ_OK;
}

/* Routers and the shared-expert gate stay unquantized (vLLM builds them without a quant method);
 * user patterns; then a fusion group is quantized all or nothing. */
static moeq_status plan_select(plan *p, const mq_quantize_opts *o) {
    pcre2_code **re = NULL;
    moeq_status s = MOEQ_OK;
    if (o->n_ignore > 0) {
        re = calloc((size_t)o->n_ignore, sizeof *re);
        if (!re) return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    for (int i = 0; i < o->n_ignore && !s; i++) {
        int code;
        PCRE2_SIZE off;
        re[i] = pcre2_compile((PCRE2_SPTR)o->ignore[i], PCRE2_ZERO_TERMINATED, 0, &code, &off, NULL);
        if (!re[i]) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(code, msg, sizeof msg);
            s = mq_err(MOEQ_E_ARG, "--ignore '%s': bad regular expression at offset %zu: %s",
                       o->ignore[i], (size_t)off, (const char *)msg);
        }
    }
    pcre2_match_data *md = s ? NULL : pcre2_match_data_create(4, NULL);
    if (!s && !md) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    for (size_t k = 0; k < p->n && !s; k++) {
        item *it = &p->items[k];
        const char *leaf = leaf_of(it->module);
        if (strcmp(leaf, "gate") == 0 || strcmp(leaf, "shared_expert_gate") == 0) it->quantize = false;
        for (int i = 0; i < o->n_ignore && it->quantize; i++)
            if (pcre2_match(re[i], (PCRE2_SPTR)it->module, PCRE2_ZERO_TERMINATED, 0, 0, md, NULL) >= 0) {
                it->quantize = false;
                it->user_ignored = true;
            }
        const char *tag = mq_fusion_tag(leaf);
        char *key = tag ? mq_asprintf("%.*s#%s", (int)(leaf - it->module), it->module, tag)
                        : mq_strdup(it->module);
        if (!key) s = mq_err(MOEQ_E_NOMEM, "out of memory");
        else s = plan_group(p, key, &it->group);
        free(key);
    }
    /* all or nothing per fusion group: vLLM needs one scheme per fused layer */
    for (size_t k = 0; k < p->n && !s; k++) {
        if (p->items[k].quantize) continue;
        for (size_t j = 0; j < p->n; j++)
            if (p->items[j].group == p->items[k].group && p->items[j].quantize) {
                mq_warn("%s stays unquantized because '%s' (fused with it in vLLM) does",
                        p->items[j].module, p->items[k].module);
                p->items[j].quantize = false;
            }
    }
    pcre2_match_data_free(md);
    for (int i = 0; re && i < o->n_ignore; i++) pcre2_code_free(re[i]);
    free(re);
    return s;
}

/* fp32 copy of an item's weight. */
static moeq_status item_load(const item *it, float **out) {
    size_t n = (size_t)(it->rows * it->cols);
    float *w = mq_alloc_array(n, sizeof(float), it->module);
    if (!w) return MOEQ_E_NOMEM;
    mq_tensor_view v = *it->src;
    size_t es = moeq_dtype_size(v.dtype);
    v.data += (size_t)it->offset * es;
    v.ndim = 2;
    v.shape[0] = it->rows;
    v.shape[1] = it->cols;
    v.numel = (int64_t)n;
    v.nbytes = n * es;
    moeq_status s = mq_tensor_to_f32(&v, w);
    if (s) {
        mq_free(w);
        return s;
    }
    *out = w;
    return MOEQ_OK;
}

/* NVFP4: joint amax of each fusion group (or of each tensor with no_fuse), then global scales. */
static moeq_status plan_global_scales(plan *p, const mq_quantize_opts *o) {
    if (o->spec.scheme != MQ_QS_NVFP4) return MOEQ_OK;
    for (size_t k = 0; k < p->n; k++) {
        item *it = &p->items[k];
        if (!it->quantize) continue;
        float *w;
        moeq_status s = item_load(it, &w);
        if (s) return s;
        float a = mq_absmax(w, it->rows * it->cols);
        mq_free(w);
        if (isnan(a)) a = 0.0f;   /* the quantizer reports the position of the NaN */
        it->global_scale = a;
        if (a > p->groups[it->group].amax) p->groups[it->group].amax = a;
    }
    for (size_t k = 0; k < p->n; k++) {
        item *it = &p->items[k];
        if (!it->quantize) continue;
        float amax = o->no_fuse ? it->global_scale : p->groups[it->group].amax;
        it->global_scale = mq_nvfp4_global_scale(&o->spec, amax);
    }
    return MOEQ_OK;
}

/* ---- config blocks ------------------------------------------------------------------------ */

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Sorted names of every unquantized Linear, plus lm_head. */
static cJSON *ignore_list(const plan *p) {
    const char **names = malloc((p->n + 1) * sizeof *names);
    cJSON *arr = cJSON_CreateArray();
    if (!names || !arr) {
        free(names);
        cJSON_Delete(arr);
        return NULL;
    }
    size_t n = 0;
    names[n++] = "lm_head";
    for (size_t k = 0; k < p->n; k++)
        if (!p->items[k].quantize) names[n++] = p->items[k].module;
    qsort(names, n, sizeof *names, cmp_str);
    for (size_t i = 0; i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateString(names[i]));
    free(names);
    return arr;
}

static cJSON *ct_args(const mq_qspec *s, bool weights, bool act_order) {
    cJSON *a = cJSON_CreateObject();
    bool nv = s->scheme == MQ_QS_NVFP4;
    cJSON_AddNumberToObject(a, "num_bits", 4);
    cJSON_AddStringToObject(a, "type", nv ? "float" : "int");
    cJSON_AddBoolToObject(a, "symmetric", nv || !s->asym);
    if (nv || s->group_size > 0) cJSON_AddNumberToObject(a, "group_size", nv ? 16 : s->group_size);
    else cJSON_AddNullToObject(a, "group_size");
    cJSON_AddStringToObject(a, "strategy", nv ? "tensor_group" : s->group_size > 0 ? "group" : "channel");
    if (weights) cJSON_AddFalseToObject(a, "dynamic");
    else cJSON_AddStringToObject(a, "dynamic", "local");
    if (act_order) cJSON_AddStringToObject(a, "actorder", "group");
    else cJSON_AddNullToObject(a, "actorder");
    cJSON_AddNullToObject(a, "block_structure");
    cJSON_AddStringToObject(a, "observer", weights && s->mse ? "mse" : nv ? "static_minmax" : "minmax");
    cJSON_AddItemToObject(a, "observer_kwargs", cJSON_CreateObject());
    return a;
}

static cJSON *config_ct(const plan *p, const mq_quantize_opts *o, bool act_order) {
    cJSON *q = cJSON_CreateObject();
    bool nv = o->spec.scheme == MQ_QS_NVFP4;
    cJSON_AddStringToObject(q, "quant_method", "compressed-tensors");
    cJSON_AddStringToObject(q, "format", nv ? "nvfp4-pack-quantized" : "pack-quantized");
    cJSON_AddStringToObject(q, "quantization_status", "compressed");
    cJSON_AddStringToObject(q, "version", "0.12.2");
    cJSON_AddNullToObject(q, "kv_cache_scheme");
    cJSON_AddNullToObject(q, "global_compression_ratio");
    cJSON_AddItemToObject(q, "sparsity_config", cJSON_CreateObject());
    cJSON_AddItemToObject(q, "transform_config", cJSON_CreateObject());
    cJSON_AddItemToObject(q, "ignore", ignore_list(p));
    cJSON *groups = cJSON_AddObjectToObject(q, "config_groups");
    cJSON *g0 = cJSON_AddObjectToObject(groups, "group_0");
    cJSON *targets = cJSON_AddArrayToObject(g0, "targets");
    cJSON_AddItemToArray(targets, cJSON_CreateString("Linear"));
    cJSON_AddItemToObject(g0, "weights", ct_args(&o->spec, true, act_order));
    if (nv && o->act_quant) cJSON_AddItemToObject(g0, "input_activations", ct_args(&o->spec, false, false));
    else cJSON_AddNullToObject(g0, "input_activations");
    cJSON_AddNullToObject(g0, "output_activations");
    cJSON_AddNullToObject(g0, "format");
    return q;
}

static cJSON *modelopt_producer(void) {
    cJSON *pr = cJSON_CreateObject();
    cJSON_AddStringToObject(pr, "name", "modelopt");
    cJSON_AddStringToObject(pr, "version", "0.37.0");
    return pr;
}

/* config.json form (vLLM reads quant_algo, group_size, ignore, kv_cache_scheme). */
static cJSON *config_modelopt(const plan *p, const mq_quantize_opts *o) {
    cJSON *q = cJSON_CreateObject();
    cJSON_AddStringToObject(q, "quant_method", "modelopt");
    cJSON_AddStringToObject(q, "quant_algo", o->act_quant ? "NVFP4" : "W4A16_NVFP4");
    cJSON_AddNumberToObject(q, "group_size", 16);
    cJSON_AddNullToObject(q, "kv_cache_scheme");
    cJSON_AddItemToObject(q, "ignore", ignore_list(p));
    cJSON_AddItemToObject(q, "producer", modelopt_producer());
    return q;
}

/* hf_quant_config.json (the legacy form; group_size, kv_cache_quant_algo, exclude_modules are
 * required by vLLM). */
static cJSON *hf_quant_config(const plan *p, const mq_quantize_opts *o) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddItemToObject(r, "producer", modelopt_producer());
    cJSON *q = cJSON_AddObjectToObject(r, "quantization");
    cJSON_AddStringToObject(q, "quant_algo", o->act_quant ? "NVFP4" : "W4A16_NVFP4");
    cJSON_AddNullToObject(q, "kv_cache_quant_algo");
    cJSON_AddNumberToObject(q, "group_size", 16);
    cJSON_AddItemToObject(q, "exclude_modules", ignore_list(p));
    return r;
}

static cJSON *config_gptq(const mq_quantize_opts *o, bool act_order) {
    cJSON *q = cJSON_CreateObject();
    cJSON_AddStringToObject(q, "quant_method", "gptq");
    cJSON_AddNumberToObject(q, "bits", 4);
    cJSON_AddNumberToObject(q, "group_size", o->spec.group_size > 0 ? o->spec.group_size : -1);
    cJSON_AddBoolToObject(q, "desc_act", act_order);
    cJSON_AddBoolToObject(q, "sym", !o->spec.asym);
    cJSON_AddFalseToObject(q, "lm_head");
    cJSON_AddStringToObject(q, "checkpoint_format", "gptq");
    cJSON_AddStringToObject(q, "pack_dtype", "int32");
    cJSON_AddNumberToObject(q, "damp_percent", 0.01);
    cJSON_AddTrueToObject(q, "true_sequential");
    cJSON_AddFalseToObject(q, "static_groups");
    return q;
}

static moeq_status write_json(const char *dir, const char *name, const cJSON *j) {
    char *text = cJSON_Print(j);
    if (!text) return mq_err(MOEQ_E_NOMEM, "out of memory printing %s", name);
    char *path = mq_path_join(dir, name);
    moeq_status s = path ? mq_write_file_atomic(path, text, strlen(text))
                         : mq_err(MOEQ_E_NOMEM, "out of memory");
    free(path);
    free(text);
    return s;
}

/* ---- files and directories ---------------------------------------------------------------- */

static moeq_status copy_file(const char *src_dir, const char *dst_dir, const char *name) {
    char *src = mq_path_join(src_dir, name), *dst = mq_path_join(dst_dir, name);
    moeq_status s = MOEQ_OK;
    if (!src || !dst) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    else if (mq_file_exists(src)) {
        char *data;
        size_t len;
        s = mq_read_file(src, &data, &len);
        if (!s) {
            s = mq_write_file_atomic(dst, data, len);
            free(data);
        }
    }
    free(src);
    free(dst);
    return s;
}

static const char *const extra_files[] = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
    "chat_template.json"};

/* Renames tmp over out (replacing an existing out when force). */
static moeq_status publish_dir(const char *tmp, const char *out, bool exists) {
    if (!exists) {
        if (rename(tmp, out) != 0)
            return mq_err(MOEQ_E_IO, "%s: cannot rename the finished checkpoint into place: %s", out,
                          strerror(errno));
        return MOEQ_OK;
    }
    char *old = mq_asprintf("%s.old-%ld", out, (long)getpid());
    if (!old) return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status s = MOEQ_OK;
    if (rename(out, old) != 0) {
        s = mq_err(MOEQ_E_IO, "%s: cannot move the existing directory aside: %s", out, strerror(errno));
    } else if (rename(tmp, out) != 0) {
        s = mq_err(MOEQ_E_IO, "%s: cannot rename the finished checkpoint into place: %s", out,
                   strerror(errno));
        if (rename(old, out) != 0) mq_warn("%s: the previous checkpoint is left at %s", out, old);
    } else {
        mq_remove_tree(old);
    }
    free(old);
    return s;
}

/* ---- the driver ----------------------------------------------------------------------------- */

typedef struct {
    mq_shard_writer *sw;
    mq_quantize_stats *stats;
} sink;

static moeq_status sink_emit(void *user, const char *name, moeq_dtype dt, int ndim,
                             const int64_t *shape, void *data, size_t nbytes) {
    sink *k = user;
    k->stats->n_tensors++;
    k->stats->bytes_written += nbytes;
    return mq_shards_add_owned(k->sw, name, dt, ndim, shape, data, nbytes);
}

static moeq_status rtn_step(void *user, const char *module, const float *w, int64_t rows,
                            int64_t cols, const mq_qspec *spec, float global_scale, mq_qtensor *out) {
    (void)user;
    return mq_quantize_rtn(spec, w, rows, cols, global_scale, module, out);
}

static moeq_status write_item(const item *it, const mq_quantize_opts *o, sink *k, bool *act_order) {
    if (!it->quantize) {
        /* unquantized Linear: its bytes in the source dtype (a slice for fused experts) */
        size_t es = moeq_dtype_size(it->src->dtype), n = (size_t)(it->rows * it->cols);
        void *d = mq_alloc_array(n, es, it->module);
        if (!d) return MOEQ_E_NOMEM;
        memcpy(d, it->src->data + (size_t)it->offset * es, n * es);
        char *name = mq_asprintf("%s.weight", it->module);
        if (!name) {
            mq_free(d);
            return mq_err(MOEQ_E_NOMEM, "out of memory");
        }
        int64_t shape[2] = {it->rows, it->cols};
        moeq_status s = sink_emit(k, name, it->src->dtype, 2, shape, d, n * es);
        free(name);
        return s;
    }
    float *w;
    moeq_status s = item_load(it, &w);
    if (s) return s;
    if ((s = mq_check_finite(w, it->rows, it->cols, it->module))) {
        mq_free(w);
        return s;
    }
    mq_qtensor q;
    memset(&q, 0, sizeof q);
    mq_weight_step_fn step = o->step ? o->step : rtn_step;
    s = step(o->step ? o->step_user : NULL, it->module, w, it->rows, it->cols, &o->spec,
             it->global_scale, &q);
    mq_free(w);
    float in_amax = 0.0f;
    if (!s && o->act_quant) {
        in_amax = o->input_amax(o->amax_user, it->module);
        if (!(in_amax > 0) || !isfinite(in_amax)) {
            mq_warn("%s: no calibration activations; input scale from amax 1", it->module);
            in_amax = 1.0f;
        }
    }
    if (!s) s = mq_layout_emit(o->format, it->module, &q, in_amax, sink_emit, k);
    if (!s && q.g_idx) *act_order = true;
    k->stats->n_quantized++;
    k->stats->quantized_params += it->rows * it->cols;
    mq_qtensor_free(&q);
    return s;
}

static moeq_status check_opts(const mq_quantize_opts *o) {
    mq_qscheme sch = o->spec.scheme;
    if (sch != MQ_QS_NVFP4 && sch != MQ_QS_INT4)
        return mq_err(MOEQ_E_ARG, "scheme %s cannot be written as a checkpoint", mq_qscheme_name(sch));
    if (sch == MQ_QS_NVFP4 && o->format == MQ_FMT_GPTQ)
        return mq_err(MOEQ_E_ARG, "--format gptq holds INT4 only (use compressed-tensors or modelopt for NVFP4)");
    if (sch == MQ_QS_INT4 && o->format == MQ_FMT_MODELOPT)
        return mq_err(MOEQ_E_ARG, "--format modelopt holds NVFP4 only (use compressed-tensors or gptq for INT4)");
    if (o->act_quant && sch != MQ_QS_NVFP4)
        return mq_err(MOEQ_E_ARG, "activation quantization is only defined for NVFP4");
    if (o->act_quant && !o->input_amax)
        return mq_err(MOEQ_E_ARG, "W4A4 NVFP4 needs calibration activations for its input scales");
    if (o->format == MQ_FMT_GPTQ && o->spec.asym && o->spec.int4_zero_min < 1)
        return mq_err(MOEQ_E_ARG, "GPTQ v1 cannot store a zero point of 0: set int4_zero_min to 1");
    return MOEQ_OK;
}

static moeq_status read_config(const char *model_dir, cJSON **out, bool *mixtral) {
    char *path = mq_path_join(model_dir, "config.json");
    if (!path) return mq_err(MOEQ_E_NOMEM, "out of memory");
    char *text;
    size_t len;
    moeq_status s = mq_read_file(path, &text, &len);
    if (s) {
        free(path);
        return s;
    }
    cJSON *j = cJSON_ParseWithLength(text, len);
    free(text);
    if (!j || !cJSON_IsObject(j)) {
        cJSON_Delete(j);
        s = mq_err(MOEQ_E_FORMAT, "%s: not a JSON object", path);
    } else if (cJSON_GetObjectItemCaseSensitive(j, "quantization_config")) {
        cJSON_Delete(j);
        s = mq_err(MOEQ_E_UNSUPPORTED, "%s: the model is already quantized (quantization_config); "
                   "quantize an unquantized checkpoint", path);
    } else {
        const cJSON *mt = cJSON_GetObjectItemCaseSensitive(j, "model_type");
        *mixtral = cJSON_IsString(mt) && strcmp(mt->valuestring, "mixtral") == 0;
        *out = j;
    }
    free(path);
    return s;
}

static moeq_status write_all(const mq_st *st, const plan *p, const mq_quantize_opts *o,
                             bool mixtral, const char *tmp, cJSON *config, mq_quantize_stats *stats) {
    mq_shard_writer *sw = NULL;
    size_t max_bytes = o->max_shard_bytes ? o->max_shard_bytes : (size_t)5 << 30;
    moeq_status s = mq_shards_open(tmp, max_bytes, &sw);
    if (s) return s;
    sink k = {sw, stats};
    bool act_order = false;
    int64_t total = (int64_t)(mq_st_count(st) + p->n), done = 0;
    /* non-Linear tensors (and Linears' biases) pass through unchanged, in checkpoint order;
     * Linears follow in plan order (grouped per fused source tensor) */
    for (size_t i = 0; i < mq_st_count(st) && !s; i++, done++) {
        if (moeq_interrupted()) s = mq_err(MOEQ_E_INTERRUPTED, "quantization interrupted");
        if (s || p->tensor_is_linear[i]) continue;
        const mq_tensor_view *t = mq_st_at(st, i);
        char *name = out_name(t->name, mixtral);
        s = name ? mq_shards_add(sw, name, t->dtype, t->ndim, t->shape, t->data, t->nbytes)
                 : mq_err(MOEQ_E_NOMEM, "out of memory");
        free(name);
        stats->n_tensors++;
        stats->bytes_written += t->nbytes;
    }
    for (size_t k2 = 0; k2 < p->n && !s; k2++, done++) {
        if (moeq_interrupted()) {
            s = mq_err(MOEQ_E_INTERRUPTED, "quantization interrupted");
            break;
        }
        s = write_item(&p->items[k2], o, &k, &act_order);
        if (!p->items[k2].quantize) stats->n_kept++;
        mq_progress("quantize", done + 1, total);
    }
    if (!s) s = mq_shards_finish(sw);
    mq_shards_free(sw);
    if (s) return s;
    /* config.json (+ the format's side file) */
    cJSON *qc = o->format == MQ_FMT_CT ? config_ct(p, o, act_order)
                : o->format == MQ_FMT_MODELOPT ? config_modelopt(p, o)
                                               : config_gptq(o, act_order);
    cJSON_AddItemToObject(config, "quantization_config", qc);
    s = write_json(tmp, "config.json", config);
    if (!s && o->format == MQ_FMT_MODELOPT) {
        cJSON *h = hf_quant_config(p, o);
        s = write_json(tmp, "hf_quant_config.json", h);
        cJSON_Delete(h);
    }
    if (!s && o->format == MQ_FMT_GPTQ) s = write_json(tmp, "quantize_config.json", qc);
    return s;
}

moeq_status mq_quantize_check_out(const char *model_dir, const char *out_dir, bool force,
                                  bool *exists_out) {
    size_t olen = strlen(out_dir);
    while (olen > 1 && out_dir[olen - 1] == '/') olen--;
    char *out = mq_strndup(out_dir, olen);
    if (!out) return mq_err(MOEQ_E_NOMEM, "out of memory");
    struct stat sin, sout;
    bool exists = stat(out, &sout) == 0;
    moeq_status s = MOEQ_OK;
    if (exists && stat(model_dir, &sin) == 0 && sin.st_dev == sout.st_dev && sin.st_ino == sout.st_ino)
        s = mq_err(MOEQ_E_ARG, "%s: the output directory is the model directory", out_dir);
    else if (exists && !force)
        s = mq_err(MOEQ_E_EXISTS, "%s: already exists (use --force to replace it)", out_dir);
    else if (exists && !mq_dir_exists(out))
        s = mq_err(MOEQ_E_EXISTS, "%s: exists and is not a directory", out_dir);
    free(out);
    if (exists_out) *exists_out = exists;
    return s;
}

moeq_status mq_quantize_checkpoint(const char *model_dir, const char *out_dir,
                                   const mq_quantize_opts *o, mq_quantize_stats *stats_out) {
    mq_quantize_stats stats;
    memset(&stats, 0, sizeof stats);
    moeq_status s = check_opts(o);
    if (s) return s;
    bool exists = false;
    if ((s = mq_quantize_check_out(model_dir, out_dir, o->force, &exists))) return s;
    size_t olen = strlen(out_dir);
    while (olen > 1 && out_dir[olen - 1] == '/') olen--;
    char *out = mq_strndup(out_dir, olen);
    if (!out) return mq_err(MOEQ_E_NOMEM, "out of memory");
    cJSON *config = NULL;
    bool mixtral = false;
    mq_st *st = NULL;
    plan p;
    memset(&p, 0, sizeof p);
    char *tmp = NULL;
    if ((s = read_config(model_dir, &config, &mixtral))) goto done;
    if ((s = mq_st_open_dir(model_dir, &st))) goto done;
    if ((s = plan_build(&p, st, mixtral))) goto done;
    if ((s = plan_select(&p, o))) goto done;
    for (size_t k = 0; k < p.n; k++)
        if (p.items[k].quantize &&
            (s = mq_qspec_check(&o->spec, p.items[k].rows, p.items[k].cols, p.items[k].module))) {
            mq_err_prefix(s, "%s (leave it unquantized with --ignore)", model_dir);
            goto done;
        }
    if ((s = plan_global_scales(&p, o))) goto done;
    tmp = mq_asprintf("%s.tmp-%ld", out, (long)getpid());
    if (!tmp) {
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    mq_remove_tree(tmp);
    if (mkdir(tmp, 0755) != 0) {
        s = mq_err(MOEQ_E_IO, "%s: cannot create the temporary output directory: %s", tmp,
                   strerror(errno));
        free(tmp);
        tmp = NULL;
        goto done;
    }
    s = write_all(st, &p, o, mixtral, tmp, config, &stats);
    for (size_t i = 0; !s && i < sizeof extra_files / sizeof extra_files[0]; i++)
        s = copy_file(model_dir, tmp, extra_files[i]);
    if (!s) s = publish_dir(tmp, out, exists);
done:
    if (s && tmp) mq_remove_tree(tmp);
    free(tmp);
    plan_free(&p);
    mq_st_close(st);
    cJSON_Delete(config);
    free(out);
    if (stats_out) *stats_out = stats;
    return s;
}
