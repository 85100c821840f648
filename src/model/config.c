/*
 * config.json -> mq_config for the supported families. Field names and defaults follow the
 * transformers 5.x configuration classes (LlamaConfig, OlmoeConfig, Qwen2MoeConfig,
 * Qwen3MoeConfig, MixtralConfig, DeepseekV3Config; kimi_k2 configs have DeepSeek-V3's layout). A
 * null value counts as absent (but for deepseek_v3's q_lora_rank, where null means a plain
 * q_proj, as in DeepseekV3Config). Every problem found is collected and reported in one message.
 * YaRN follows transformers' _compute_yarn_parameters and DeepseekV3Attention's softmax scale
 * (yarn_get_mscale(factor, mscale_all_dim)^2).
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/source.h"
#include "model/model_internal.h"

static const struct {
    const char *name;
    mq_arch arch;
} g_types[] = {
    {"llama", MQ_ARCH_LLAMA},         {"olmoe", MQ_ARCH_OLMOE},     {"qwen2_moe", MQ_ARCH_QWEN2_MOE},
    {"qwen3_moe", MQ_ARCH_QWEN3_MOE}, {"mixtral", MQ_ARCH_MIXTRAL},
    {"deepseek_v3", MQ_ARCH_DEEPSEEK_V3}, {"kimi_k2", MQ_ARCH_DEEPSEEK_V3},
};

const char *mq_supported_model_types(void) {
    return "llama, olmoe, qwen2_moe, qwen3_moe, mixtral, deepseek_v3, kimi_k2";
}

/* ---- typed field access ------------------------------------------------------------------ */
typedef struct {
    const cJSON *root;
    mq_problems *p;
} fields;

static const cJSON *field(const fields *f, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(f->root, key);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

/* Integer field; absent: def if !required, else a problem. */
static int32_t get_int(const fields *f, const char *key, bool required, int32_t def) {
    const cJSON *v = field(f, key);
    if (!v) {
        if (required) mq_problems_add(f->p, "missing field '%s'", key);
        return def;
    }
    double d = v->valuedouble;
    if (!cJSON_IsNumber(v) || d != floor(d) || d < -2147483648.0 || d > 2147483647.0) {
        mq_problems_add(f->p, "field '%s' must be an integer", key);
        return def;
    }
    return (int32_t)d;
}

/* The field when present and of its type (is), else NULL: a problem "must be <what>" when of
 * another type. */
static const cJSON *typed_field(const fields *f, const char *key, cJSON_bool (*is)(const cJSON *), const char *what) {
    const cJSON *v = field(f, key);
    if (v && !is(v)) {
        mq_problems_add(f->p, "field '%s' must be %s", key, what);
        return NULL;
    }
    return v;
}

static double get_num(const fields *f, const char *key, double def) {
    const cJSON *v = typed_field(f, key, cJSON_IsNumber, "a number");
    return v ? v->valuedouble : def;
}

static bool get_bool(const fields *f, const char *key, bool def) {
    const cJSON *v = typed_field(f, key, cJSON_IsBool, "true or false");
    return v ? cJSON_IsTrue(v) : def;
}

static const char *get_str(const fields *f, const char *key) {
    const cJSON *v = typed_field(f, key, cJSON_IsString, "a string");
    return v ? v->valuestring : NULL;
}

/* A missing required field was reported already by get_int. */
static void require_positive(const fields *f, const char *key, int32_t v) {
    if (v <= 0 && field(f, key)) mq_problems_add(f->p, "field '%s' must be positive (got %d)", key, v);
}

/* ---- pieces ------------------------------------------------------------------------------ */
/* yarn_get_mscale of transformers (0.1 * m * ln(scale) + 1 above scale 1). */
static double yarn_mscale(double scale, double m) {
    return scale <= 1 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

/* The YaRN parameters of rope_parameters / rope_scaling object rp (named src), as
 * _compute_yarn_parameters reads them: factor (absent: max_position_embeddings over
 * original_max_position_embeddings), beta_fast / beta_slow (0 or absent: 32 / 1), truncate, and the
 * cos/sin factor attention_factor (absent: mscale(factor, mscale) / mscale(factor, mscale_all_dim)
 * when both are set, else mscale(factor)). */
static void parse_yarn(const fields *rp, const char *src, mq_config *c) {
    c->yarn = true;
    c->yarn_orig_max_pos = get_int(rp, "original_max_position_embeddings", false, c->max_pos);
    if (c->yarn_orig_max_pos <= 0)
        mq_problems_add(rp->p, "%s.original_max_position_embeddings must be positive", src);
    double ratio = c->yarn_orig_max_pos > 0 ? (double)c->max_pos / c->yarn_orig_max_pos : 1.0;
    c->yarn_factor = get_num(rp, "factor", ratio);
    if (!(c->yarn_factor > 0) || !isfinite(c->yarn_factor))
        mq_problems_add(rp->p, "%s.factor must be a positive number", src);
    c->yarn_beta_fast = get_num(rp, "beta_fast", 0.0);
    c->yarn_beta_slow = get_num(rp, "beta_slow", 0.0);
    if (c->yarn_beta_fast == 0) c->yarn_beta_fast = 32;
    if (c->yarn_beta_slow == 0) c->yarn_beta_slow = 1;
    if (!(c->yarn_beta_fast > 0) || !(c->yarn_beta_slow > 0))
        mq_problems_add(rp->p, "%s.beta_fast and beta_slow must be positive", src);
    c->yarn_truncate = get_bool(rp, "truncate", true);
    double ms = get_num(rp, "mscale", 0.0), msa = get_num(rp, "mscale_all_dim", 0.0);
    double af = get_num(rp, "attention_factor", NAN);
    if (isnan(af))
        af = ms != 0 && msa != 0
                 ? yarn_mscale(c->yarn_factor, ms) / yarn_mscale(c->yarn_factor, msa)
                 : yarn_mscale(c->yarn_factor, 1.0);
    if (!isfinite(af) || af <= 0)
        mq_problems_add(rp->p, "%s.attention_factor must be positive", src);
    c->rope_attn_factor = af;
    /* DeepseekV3Attention: softmax scale times mscale(factor, mscale_all_dim)^2 */
    if (c->mla && msa != 0) {
        double m = yarn_mscale(c->yarn_factor, msa);
        c->attn_scale *= m * m;
    }
}

/* RoPE: rope_parameters (transformers 5) or rope_scaling (4.x) and top-level rope_theta; the
 * default rotation, and YaRN where allow_yarn (deepseek_v3). */
static void parse_rope(const fields *f, double def_theta, bool allow_yarn, mq_config *c) {
    c->rope_theta = get_num(f, "rope_theta", def_theta);
    const char *src = "rope_parameters";
    const cJSON *rp = field(f, src);
    if (!rp) rp = field(f, src = "rope_scaling");
    if (rp && !cJSON_IsObject(rp)) {
        mq_problems_add(f->p, "field '%s' must be an object", src);
        rp = NULL;
    }
    if (rp) {
        fields sub = {rp, f->p};
        c->rope_theta = get_num(&sub, "rope_theta", c->rope_theta);
        const char *type = get_str(&sub, "rope_type");
        if (!type) type = get_str(&sub, "type");
        if (type && allow_yarn && !strcmp(type, "yarn"))
            parse_yarn(&sub, src, c);
        else if (type && strcmp(type, "default") != 0)
            mq_problems_add(f->p, "%s.rope_type '%s' is not supported (only 'default' RoPE is%s)",
                            src, type, allow_yarn ? ", and 'yarn'" : "");
        double prf = get_num(&sub, "partial_rotary_factor", 1.0);
        if (prf != 1.0)
            mq_problems_add(f->p, "%s.partial_rotary_factor %g is not supported (only 1)", src, prf);
    }
    double prf = get_num(f, "partial_rotary_factor", 1.0);
    if (prf != 1.0) mq_problems_add(f->p, "partial_rotary_factor %g is not supported (only 1)", prf);
    if (!(c->rope_theta > 0)) mq_problems_add(f->p, "rope_theta must be positive");
}

/* eos_token_id: an integer or a list of integers. */
static void parse_eos(const fields *f, mq_config *c) {
    c->n_eos = 0;
    const cJSON *v = field(f, "eos_token_id");
    if (v && cJSON_IsArray(v)) {
        const cJSON *e;
        cJSON_ArrayForEach(e, v) {
            int64_t id;
            if (!cJSON_IsNumber(e) || !mq_int_of(e->valuedouble, INT32_MIN, INT32_MAX, &id)) {
                mq_problems_add(f->p, "field 'eos_token_id' must hold integers");
                break;
            }
            if (c->n_eos < 8) c->eos_ids[c->n_eos++] = (int32_t)id;
        }
    } else {
        int32_t id = get_int(f, "eos_token_id", false, -1);
        if (id >= 0) c->eos_ids[c->n_eos++] = id;
    }
    c->eos = c->n_eos > 0 ? c->eos_ids[0] : -1;
    c->bos = get_int(f, "bos_token_id", false, -1);
    c->pad = get_int(f, "pad_token_id", false, -1);
}

/* qwen2_moe / qwen3_moe: which layers are sparse, which use sliding-window attention. */
static void parse_qwen_layers(const fields *f, mq_config *c) {
    int32_t step = get_int(f, "decoder_sparse_step", false, 1);
    if (step <= 0) mq_problems_add(f->p, "field 'decoder_sparse_step' must be positive");
    const cJSON *only = field(f, "mlp_only_layers");
    for (int i = 0; i < c->n_layers; i++)
        c->layer_is_moe[i] = c->n_experts > 0 && step > 0 && (i + 1) % step == 0;
    if (only) {
        const cJSON *e;
        if (!cJSON_IsArray(only)) mq_problems_add(f->p, "field 'mlp_only_layers' must be a list");
        else
            cJSON_ArrayForEach(e, only) {
                double d = e->valuedouble;
                if (!cJSON_IsNumber(e) || d != floor(d) || d < 0 || d >= c->n_layers) {
                    mq_problems_add(f->p, "mlp_only_layers: %s is not a layer index (0..%d)",
                                    cJSON_IsNumber(e) ? "value" : "entry", c->n_layers - 1);
                    break;
                }
                c->layer_is_moe[(int)d] = 0;
            }
    }
    bool use_sw = get_bool(f, "use_sliding_window", false);
    int32_t window = get_int(f, "sliding_window", false, 0);
    int32_t max_window_layers = get_int(f, "max_window_layers", false, c->n_layers);
    const cJSON *types = field(f, "layer_types");
    if (types) {
        if (!cJSON_IsArray(types) || cJSON_GetArraySize(types) != c->n_layers) {
            mq_problems_add(f->p, "field 'layer_types' must list num_hidden_layers = %d entries",
                            c->n_layers);
            return;
        }
        int i = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, types) {
            const char *t = cJSON_IsString(e) ? e->valuestring : "";
            if (!strcmp(t, "sliding_attention")) c->layer_sliding[i] = 1;
            else if (strcmp(t, "full_attention") != 0)
                mq_problems_add(f->p, "layer_types[%d] '%s' is not supported", i, t);
            i++;
        }
    } else if (use_sw) {
        for (int i = max_window_layers; i < c->n_layers; i++) c->layer_sliding[i] = 1;
    }
    bool any = false;
    for (int i = 0; i < c->n_layers; i++) any |= c->layer_sliding[i] != 0;
    if (any) {
        if (window <= 0) mq_problems_add(f->p, "sliding-window layers need a positive 'sliding_window'");
        c->sliding_window = window;
    }
}

/* The expert count goes by two names across transformers versions (qwen3_moe configs written by
 * transformers 5 say num_local_experts); the family's usual name comes first. */
static int32_t n_experts_field(const fields *f, const char *name, const char *alias) {
    if (field(f, name) || !field(f, alias)) return get_int(f, name, true, 0);
    return get_int(f, alias, true, 0);
}

static void fill_all(uint8_t *v, int n, uint8_t x) {
    for (int i = 0; i < n; i++) v[i] = x;
}

/* An integer field that may be null: absent gives def, null gives null_v. */
static int32_t get_int_or_null(const fields *f, const char *key, int32_t def, int32_t null_v) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(f->root, key);
    if (!v) return def;
    if (cJSON_IsNull(v)) return null_v;
    return get_int(f, key, false, def);
}

/* A string field that, when present, must be one value (the only one implemented). */
static void expect_str(const fields *f, const char *key, const char *only) {
    const char *v = get_str(f, key);
    if (v && strcmp(v, only) != 0)
        mq_problems_add(f->p, "%s '%s' is not supported (only '%s')", key, v, only);
}

/* deepseek_v3 / kimi_k2 (DeepseekV3Config): MLA shapes, routing, dense first layers, MTP. */
static void parse_deepseek(const fields *f, mq_config *c, bool have_layers) {
    mq_problems *P = f->p;
    c->mla = true;
    c->q_lora_rank = get_int_or_null(f, "q_lora_rank", 1536, 0);   /* null: plain q_proj */
    if (c->q_lora_rank < 0 || (c->q_lora_rank == 0 && field(f, "q_lora_rank")))
        mq_problems_add(P, "field 'q_lora_rank' must be positive or null (got %d)", c->q_lora_rank);
    c->kv_lora_rank = get_int(f, "kv_lora_rank", true, 0);
    c->qk_nope = get_int(f, "qk_nope_head_dim", true, 0);
    c->qk_rope = get_int(f, "qk_rope_head_dim", true, 0);
    c->v_head_dim = get_int(f, "v_head_dim", true, 0);
    require_positive(f, "kv_lora_rank", c->kv_lora_rank);
    require_positive(f, "qk_nope_head_dim", c->qk_nope);
    require_positive(f, "v_head_dim", c->v_head_dim);
    if (field(f, "qk_rope_head_dim") && (c->qk_rope <= 0 || c->qk_rope % 2 != 0))
        mq_problems_add(P, "field 'qk_rope_head_dim' must be a positive even number (got %d)",
                        c->qk_rope);
    /* the q/k head is [nope, rope]; transformers' head_dim field is the rotary width */
    c->head_dim = c->qk_nope + c->qk_rope;
    c->rope_dim = c->qk_rope;
    c->attn_scale = c->head_dim > 0 ? 1.0 / sqrt((double)c->head_dim) : 1.0;
    if (c->n_kv_heads != c->n_heads)
        mq_problems_add(P, "num_key_value_heads %d must equal num_attention_heads %d (multi-head "
                        "latent attention)", c->n_kv_heads, c->n_heads);
    c->rope_interleave = get_bool(f, "rope_interleave", true);
    c->qkv_bias = c->o_bias = get_bool(f, "attention_bias", false);   /* q_a, kv_a and o_proj */

    c->n_experts = get_int(f, "n_routed_experts", true, 0);
    c->top_k = get_int(f, "num_experts_per_tok", true, 0);
    c->moe_ffn = get_int(f, "moe_intermediate_size", true, 0);
    c->ffn = get_int(f, "intermediate_size", false, 0);
    int32_t n_shared = get_int_or_null(f, "n_shared_experts", 1, 0);
    if (n_shared < 0) mq_problems_add(P, "field 'n_shared_experts' must not be negative");
    else if ((int64_t)n_shared * c->moe_ffn > INT32_MAX)   /* before the multiply: no overflow */
        mq_problems_add(P, "n_shared_experts %d x moe_intermediate_size %d is too large",
                        n_shared, c->moe_ffn);
    else c->shared_ffn = n_shared * c->moe_ffn;
    c->norm_topk_prob = get_bool(f, "norm_topk_prob", true);
    c->routed_scale = (float)get_num(f, "routed_scaling_factor", 2.5);
    if (!isfinite(c->routed_scale) || c->routed_scale <= 0)
        mq_problems_add(P, "field 'routed_scaling_factor' must be a positive number");
    c->sigmoid_router = c->router_bias = true;
    if (c->n_experts > 1024)
        mq_problems_add(P, "n_routed_experts %d is not supported (at most 1024)", c->n_experts);
    c->n_group = get_int_or_null(f, "n_group", 8, 1);
    c->topk_group = get_int_or_null(f, "topk_group", 4, c->n_group);
    if (c->n_group <= 0)
        mq_problems_add(P, "field 'n_group' must be positive (got %d)", c->n_group);
    else if (c->n_experts > 0 && c->n_experts % c->n_group != 0)
        mq_problems_add(P, "n_routed_experts %d is not a multiple of n_group %d", c->n_experts,
                        c->n_group);
    else if (c->n_experts > 0 && c->n_experts / c->n_group < 2)
        mq_problems_add(P, "n_group %d leaves fewer than 2 experts per group (n_routed_experts %d; "
                        "a group scores by its two best)", c->n_group, c->n_experts);
    if (c->topk_group <= 0 || (c->n_group > 0 && c->topk_group > c->n_group))
        mq_problems_add(P, "field 'topk_group' must be in 1..n_group %d (got %d)", c->n_group,
                        c->topk_group);
    else if (c->n_group > 0 && c->n_experts > 0 && c->n_experts % c->n_group == 0 &&
             c->top_k > (int64_t)c->topk_group * (c->n_experts / c->n_group))
        mq_problems_add(P, "num_experts_per_tok %d exceeds the %d experts of topk_group %d groups",
                        c->top_k, c->topk_group * (c->n_experts / c->n_group), c->topk_group);
    expect_str(f, "scoring_func", "sigmoid");
    expect_str(f, "topk_method", "noaux_tc");
    int32_t freq = get_int(f, "moe_layer_freq", false, 1);
    if (freq != 1) mq_problems_add(P, "moe_layer_freq %d is not supported (only 1)", freq);
    int32_t first = get_int(f, "first_k_dense_replace", false, 3);
    if (first < 0 || (c->n_layers > 0 && first > c->n_layers))
        mq_problems_add(P, "field 'first_k_dense_replace' must be in 0..num_hidden_layers %d (got "
                        "%d)", c->n_layers, first);
    else if (have_layers)
        for (int i = 0; i < c->n_layers; i++) c->layer_is_moe[i] = i >= first;
    if (first > 0 && c->ffn <= 0)
        mq_problems_add(P, "dense layers (first_k_dense_replace %d) need a positive "
                        "'intermediate_size'", first);
    const char *mtp = field(f, "num_nextn_predict_layers") || !field(f, "num_mtp_layers")
                          ? "num_nextn_predict_layers" : "num_mtp_layers";
    c->n_mtp = get_int(f, mtp, false, 0);
    if (c->n_mtp < 0 || c->n_mtp > 64)
        mq_problems_add(P, "field '%s' must be in 0..64 (got %d)", mtp, c->n_mtp);
}

moeq_status mq_config_parse(const char *json, size_t len, const char *path, mq_config *out) {
    memset(out, 0, sizeof *out);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return mq_err(MOEQ_E_FORMAT, "%s: not a JSON object", path);
    }
    moeq_status st = mq_config_from_json(root, path, out);
    cJSON_Delete(root);
    return st;
}

moeq_status mq_config_from_json(const cJSON *root, const char *path, mq_config *out) {
    memset(out, 0, sizeof *out);
    if (!cJSON_IsObject(root)) return mq_err(MOEQ_E_FORMAT, "%s: not a JSON object", path);
    mq_problems probs;
    mq_problems_init(&probs);
    fields f = {root, &probs};
    mq_config *c = out;
    moeq_status st = MOEQ_OK;

    const char *type = get_str(&f, "model_type");
    if (!type) {
        st = mq_err(MOEQ_E_FORMAT, "%s: missing field 'model_type' (supported: %s)", path,
                    mq_supported_model_types());
        goto done;
    }
    bool known = false;
    for (size_t i = 0; i < sizeof g_types / sizeof g_types[0]; i++)
        if (!strcmp(type, g_types[i].name)) {
            c->arch = g_types[i].arch;
            known = true;
        }
    if (!known) {
        st = mq_err(MOEQ_E_UNSUPPORTED, "%s: model_type '%s' is not supported (supported: %s)",
                    path, type, mq_supported_model_types());
        goto done;
    }
    snprintf(c->model_type, sizeof c->model_type, "%s", type);

    c->vocab = get_int(&f, "vocab_size", true, 0);
    c->D = get_int(&f, "hidden_size", true, 0);
    c->n_layers = get_int(&f, "num_hidden_layers", true, 0);
    c->n_heads = get_int(&f, "num_attention_heads", true, 0);
    c->n_kv_heads = get_int(&f, "num_key_value_heads", false, c->n_heads);
    require_positive(&f, "vocab_size", c->vocab);
    require_positive(&f, "hidden_size", c->D);
    require_positive(&f, "num_hidden_layers", c->n_layers);
    require_positive(&f, "num_attention_heads", c->n_heads);
    require_positive(&f, "num_key_value_heads", c->n_kv_heads);
    if (c->n_heads > 0 && c->n_kv_heads > 0 && c->n_heads % c->n_kv_heads != 0)
        mq_problems_add(&probs, "num_attention_heads %d is not a multiple of num_key_value_heads %d",
                        c->n_heads, c->n_kv_heads);
    int32_t def_hd = 0;
    if (c->n_heads > 0 && c->D > 0) {
        def_hd = c->D / c->n_heads;
        if (!field(&f, "head_dim") && c->D % c->n_heads != 0 && c->arch != MQ_ARCH_DEEPSEEK_V3)
            mq_problems_add(&probs, "hidden_size %d is not a multiple of num_attention_heads %d "
                            "and head_dim is not given", c->D, c->n_heads);
    }
    c->head_dim = get_int(&f, "head_dim", false, def_hd);
    if ((field(&f, "head_dim") || def_hd > 0) && (c->head_dim <= 0 || c->head_dim % 2 != 0) &&
        c->arch != MQ_ARCH_DEEPSEEK_V3)   /* its head_dim field is the rotary width */
        mq_problems_add(&probs, "head_dim must be a positive even number (got %d)", c->head_dim);

    const char *act = get_str(&f, "hidden_act");
    if (act && strcmp(act, "silu") != 0)
        mq_problems_add(&probs, "hidden_act '%s' is not supported (only silu)", act);
    c->tie_embeddings = get_bool(&f, "tie_word_embeddings", false);
    parse_eos(&f, c);

    /* Defaults of each transformers config class. */
    double def_eps = 1e-6, def_theta = 10000.0;
    int32_t def_max_pos = 2048;
    switch (c->arch) {
    case MQ_ARCH_OLMOE: def_eps = 1e-5; def_max_pos = 4096; break;
    case MQ_ARCH_MIXTRAL: def_eps = 1e-5; def_theta = 1e6; def_max_pos = 4096 * 32; break;
    case MQ_ARCH_QWEN2_MOE:
    case MQ_ARCH_QWEN3_MOE: def_max_pos = 32768; break;
    case MQ_ARCH_DEEPSEEK_V3: def_max_pos = 4096; break;
    case MQ_ARCH_LLAMA: break;
    }
    c->rms_eps = (float)get_num(&f, "rms_norm_eps", def_eps);
    if (!(c->rms_eps > 0)) mq_problems_add(&probs, "rms_norm_eps must be positive");
    c->max_pos = get_int(&f, "max_position_embeddings", false, def_max_pos);
    require_positive(&f, "max_position_embeddings", c->max_pos);

    if (c->n_layers > 0 && c->n_layers <= 1 << 20) {
        c->layer_is_moe = calloc((size_t)c->n_layers, 1);
        c->layer_sliding = calloc((size_t)c->n_layers, 1);
        if (!c->layer_is_moe || !c->layer_sliding) {
            st = mq_err(MOEQ_E_NOMEM, "%s: out of memory", path);
            goto done;
        }
    } else if (c->n_layers > 1 << 20) {
        mq_problems_add(&probs, "num_hidden_layers %d is implausible", c->n_layers);
    }
    bool have_layers = c->layer_is_moe != NULL;
    c->n_group = c->topk_group = 1;
    c->routed_scale = 1.0f;

    switch (c->arch) {
    case MQ_ARCH_LLAMA:
        c->ffn = get_int(&f, "intermediate_size", true, 0);
        require_positive(&f, "intermediate_size", c->ffn);
        c->qkv_bias = c->o_bias = get_bool(&f, "attention_bias", false);
        c->mlp_bias = get_bool(&f, "mlp_bias", false);
        break;
    case MQ_ARCH_OLMOE:
        c->n_experts = get_int(&f, "num_experts", true, 0);
        c->top_k = get_int(&f, "num_experts_per_tok", true, 0);
        c->moe_ffn = get_int(&f, "intermediate_size", true, 0);
        c->norm_topk_prob = get_bool(&f, "norm_topk_prob", false);
        c->qkv_bias = c->o_bias = get_bool(&f, "attention_bias", false);
        c->qk_norm = MQ_QKNORM_FULL;
        c->clip_qkv = (float)get_num(&f, "clip_qkv", 0.0);
        if (c->clip_qkv < 0) mq_problems_add(&probs, "clip_qkv must not be negative");
        if (have_layers) fill_all(c->layer_is_moe, c->n_layers, 1);
        break;
    case MQ_ARCH_MIXTRAL: {
        c->n_experts = n_experts_field(&f, "num_local_experts", "num_experts");
        c->top_k = get_int(&f, "num_experts_per_tok", true, 0);
        c->moe_ffn = get_int(&f, "intermediate_size", true, 0);
        c->norm_topk_prob = true;   /* MixtralSparseMoeBlock always renormalises */
        c->sliding_window = get_int(&f, "sliding_window", false, 0);
        if (c->sliding_window < 0) mq_problems_add(&probs, "sliding_window must not be negative");
        if (have_layers) {
            fill_all(c->layer_is_moe, c->n_layers, 1);
            fill_all(c->layer_sliding, c->n_layers, c->sliding_window > 0);
        }
        break;
    }
    case MQ_ARCH_QWEN2_MOE:
    case MQ_ARCH_QWEN3_MOE:
        c->n_experts = n_experts_field(&f, "num_experts", "num_local_experts");
        c->top_k = get_int(&f, "num_experts_per_tok", true, 0);
        c->moe_ffn = get_int(&f, "moe_intermediate_size", true, 0);
        c->ffn = get_int(&f, "intermediate_size", false, 0);
        c->norm_topk_prob = get_bool(&f, "norm_topk_prob", false);
        if (c->arch == MQ_ARCH_QWEN2_MOE) {
            c->shared_ffn = get_int(&f, "shared_expert_intermediate_size", true, 0);
            require_positive(&f, "shared_expert_intermediate_size", c->shared_ffn);
            c->shared_gate = true;
            c->qkv_bias = get_bool(&f, "qkv_bias", true);
        } else {
            c->qkv_bias = c->o_bias = get_bool(&f, "attention_bias", false);
            c->qk_norm = MQ_QKNORM_HEAD;
        }
        if (have_layers) {
            parse_qwen_layers(&f, c);
            bool any_dense = false;
            for (int i = 0; i < c->n_layers; i++) any_dense |= !c->layer_is_moe[i];
            if (any_dense && c->ffn <= 0)
                mq_problems_add(&probs, "dense layers (mlp_only_layers / decoder_sparse_step) need "
                                "a positive 'intermediate_size'");
        }
        break;
    case MQ_ARCH_DEEPSEEK_V3:
        parse_deepseek(&f, c, have_layers);
        break;
    }
    if (!c->mla) {
        c->v_head_dim = c->rope_dim = c->head_dim;
        c->attn_scale = c->head_dim > 0 ? 1.0 / sqrt((double)c->head_dim) : 1.0;
    }
    c->rope_attn_factor = 1.0;
    parse_rope(&f, def_theta, c->arch == MQ_ARCH_DEEPSEEK_V3, c);
    if (c->arch != MQ_ARCH_LLAMA) {
        const char *ne = c->arch == MQ_ARCH_DEEPSEEK_V3 ? "n_routed_experts"
                         : field(&f, "num_experts") ? "num_experts" : "num_local_experts";
        require_positive(&f, ne, c->n_experts);
        require_positive(&f, "num_experts_per_tok", c->top_k);
        require_positive(&f, c->arch == MQ_ARCH_MIXTRAL || c->arch == MQ_ARCH_OLMOE
                                     ? "intermediate_size" : "moe_intermediate_size",
                         c->moe_ffn);
        if (c->top_k > 64)
            mq_problems_add(&probs, "num_experts_per_tok %d is not supported (at most 64)", c->top_k);
        if (c->top_k > c->n_experts && c->n_experts > 0)
            mq_problems_add(&probs, "num_experts_per_tok %d exceeds the number of experts %d",
                            c->top_k, c->n_experts);
    }

    const cJSON *q = field(&f, "quantization_config");
    if (q && cJSON_IsObject(q)) {
        fields qf = {q, &probs};
        const char *m = get_str(&qf, "quant_method");
        const char *fmt = get_str(&qf, "format");
        c->quant_method = mq_strdup(m ? m : "unknown");
        c->quant_format = fmt ? mq_strdup(fmt) : NULL;
        /* an FP8 block-quantized source: its block size (a bad fp8 block is an error of its own) */
        mq_fp8_blocks b;
        if ((st = mq_fp8_parse_qconfig(q, path, &b))) goto done;
        c->fp8_block_rows = b.rows;
        c->fp8_block_cols = b.cols;
        if (b.rows > 0 && !c->quant_format) c->quant_format = mq_strdup("e4m3");
    }

    if (probs.n > 0) st = mq_problems_error(&probs, MOEQ_E_FORMAT, "%s", path);

done:
    mq_problems_free(&probs);
    if (st != MOEQ_OK) mq_config_free(out);
    return st;
}

void mq_config_free(mq_config *c) {
    if (!c) return;
    MQ_FREE_EACH(c->layer_is_moe, c->layer_sliding, c->quant_method, c->quant_format);
    c->layer_is_moe = c->layer_sliding = NULL;
    c->quant_method = c->quant_format = NULL;
}

/* ---- derived figures ------------------------------------------------------------------- */
typedef struct {
    int64_t attn, dense, router, expert, shared;   /* Linear weights (in*out), per layer */
    int64_t other;                                 /* norms and biases of one layer */
} layer_params;

static layer_params count_layer(const mq_config *c, int layer) {
    int64_t D = c->D, q = (int64_t)c->n_heads * c->head_dim, kv = (int64_t)c->n_kv_heads * c->head_dim;
    layer_params p = {0};
    p.attn = D * q + 2 * D * kv + q * D;
    p.other = 2 * D;
    if (c->mla) {
        int64_t H = c->n_heads, qh = H * c->head_dim, r = c->kv_lora_rank;
        p.attn = c->q_lora_rank > 0 ? D * c->q_lora_rank + (int64_t)c->q_lora_rank * qh : D * qh;
        p.attn += D * (r + c->qk_rope) + r * H * (c->qk_nope + c->v_head_dim) +
                  H * c->v_head_dim * D;
        p.other += r + c->q_lora_rank;   /* kv_a / q_a layernorms */
        if (c->qkv_bias) p.other += c->q_lora_rank + r + c->qk_rope;
        if (c->o_bias) p.other += D;
    } else {
        if (c->qkv_bias) p.other += q + 2 * kv;
        if (c->o_bias) p.other += D;
    }
    if (c->qk_norm == MQ_QKNORM_FULL) p.other += q + kv;
    if (c->qk_norm == MQ_QKNORM_HEAD) p.other += 2 * (int64_t)c->head_dim;
    if (c->layer_is_moe && c->layer_is_moe[layer]) {
        p.router = (int64_t)c->n_experts * D;
        if (c->router_bias) p.other += c->n_experts;
        p.expert = 3 * D * c->moe_ffn;
        if (c->shared_ffn > 0) p.shared = 3 * D * c->shared_ffn + (c->shared_gate ? D : 0);
    } else {
        p.dense = 3 * D * c->ffn;
        if (c->mlp_bias) p.other += 2 * (int64_t)c->ffn + D;
    }
    return p;
}

void mq_config_param_counts(const mq_config *c, int64_t *total, int64_t *active) {
    int64_t VD = (int64_t)c->vocab * c->D;
    int64_t t = VD + c->D + (c->tie_embeddings ? 0 : VD);
    int64_t a = t;   /* embeddings counted whole, as model cards do */
    for (int l = 0; l < c->n_layers; l++) {
        layer_params p = count_layer(c, l);
        int64_t common = p.attn + p.dense + p.router + p.shared + p.other;
        t += common + p.expert * c->n_experts;
        a += common + p.expert * c->top_k;
    }
    if (total) *total = t;
    if (active) *active = a;
}

double mq_config_forward_flops(const mq_config *c, int64_t T, int64_t pos) {
    double per_token = (double)c->vocab * c->D;   /* lm_head */
    double attn = 0;
    /* Keys seen by the T new tokens together: sum over i of (pos + i + 1), capped by a window. */
    for (int l = 0; l < c->n_layers; l++) {
        layer_params p = count_layer(c, l);
        per_token += (double)(p.attn + p.dense + p.router + p.shared + p.expert * c->top_k);
        double keys = 0;
        int64_t w = c->layer_sliding && c->layer_sliding[l] ? c->sliding_window : 0;
        for (int64_t i = 0; i < T; i++) {
            int64_t k = pos + i + 1;
            keys += (double)(w > 0 && k > w ? w : k);
        }
        /* QK^T and PV, 2 flops per MAC */
        attn += 2.0 * keys * (double)(c->head_dim + c->v_head_dim) * c->n_heads;
    }
    return 2.0 * per_token * (double)T + attn;
}
