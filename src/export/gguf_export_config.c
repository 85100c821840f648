/*
 * The architecture of a checkpoint from its config.json, as llama.cpp's graphs run it (llama,
 * Mixtral, olmoe, qwen2moe, qwen3moe, deepseek2), and the refusals of what they would compute
 * otherwise (docs/gguf.md). Part of the checkpoint -> GGUF converter (gguf_export.c).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "export/gguf_export_internal.h"

/* ---- the architecture from config.json -------------------------------------------------------- */



static bool num(const cJSON *c, const char *k, double *v) {
    const cJSON *x = item(c, k);
    if (!x || !cJSON_IsNumber(x)) return false;
    *v = x->valuedouble;
    return true;
}

/* Held to the int32 range: no config size is larger, and sums and products of two stay in int64. */
static int64_t inum(const cJSON *c, const char *k, int64_t dflt) {
    double v;
    if (!num(c, k, &v)) return dflt;
    int64_t i = mq_clamp_i64(v);
    return i > INT32_MAX ? INT32_MAX : i < INT32_MIN ? INT32_MIN : i;
}

/* dflt when absent, null_val when null (transformers' configs spell "all" / "none" as null) */
static int64_t inum_null(const cJSON *c, const char *k, int64_t dflt, int64_t null_val) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(c, k);
    return x && cJSON_IsNull(x) ? null_val : inum(c, k, dflt);
}


/* yarn_get_mscale of transformers. */
static double yarn_g(double f, double m) { return f <= 1 ? 1.0 : 0.1 * m * log(f) + 1.0; }

/* The two YaRN KVs of deepseek2 for transformers' cos/sin factor A and softmax scale G^2/sqrt(d).
 * llama.cpp (llama-context.cpp, models/deepseek2.cpp), with a = rope.scaling.attn_factor and
 * m = yarn_log_multiplier / 0.1: cos/sin times a, softmax scale a^2 g(m)^2 / sqrt(d) (m != 0),
 * or a g(1) and (a g(1))^2 / sqrt(d) (no multiplier). DeepSeek-V3 and Kimi K2 (mscale ==
 * mscale_all_dim, so A = 1) get a = 1 and m = mscale_all_dim, what its converter writes. */
static void yarn_kvs(double f, double A, double G, double *a, double *lm) {
    if (A == G) {   /* m would be 0: the branch without the multiplier */
        *a = A / yarn_g(f, 1.0);
        *lm = 0;
        return;
    }
    *a = A;
    *lm = (G / A - 1.0) / (0.1 * log(f));
}

/* deepseek_v3 / kimi_k2 as llama.cpp's deepseek2: what its graph computes, or a refusal naming
 * the difference. */
static moeq_status read_deepseek(const cJSON *c, const char *what, arch_cfg *a) {
    a->arch = "deepseek2";
    a->mla = true;
    a->D = inum(c, "hidden_size", 0);
    a->L = inum(c, "num_hidden_layers", 0);
    a->H = inum(c, "num_attention_heads", 0);
    a->KV = a->H;
    a->FF = inum(c, "intermediate_size", 0);
    a->E = inum(c, "n_routed_experts", 0);
    a->K = inum(c, "num_experts_per_tok", 0);
    a->FF_EXP = inum(c, "moe_intermediate_size", 0);
    a->n_shared = inum_null(c, "n_shared_experts", 1, 0);
    a->ctx = inum(c, "max_position_embeddings", 0);
    a->vocab = inum(c, "vocab_size", 0);
    a->tie = flag(c, "tie_word_embeddings", false);
    a->norm_topk = flag(c, "norm_topk_prob", true);
    a->q_lora = inum(c, "q_lora_rank", 0);
    a->kv_lora = inum(c, "kv_lora_rank", 0);
    a->nope = inum(c, "qk_nope_head_dim", 0);
    a->rope = inum(c, "qk_rope_head_dim", 0);
    a->vhd = inum(c, "v_head_dim", 0);
    a->HD = a->nope + a->rope;
    a->first_dense = inum(c, "first_k_dense_replace", 3);
    a->n_group = inum_null(c, "n_group", 8, 1);
    a->topk_group = inum_null(c, "topk_group", 4, a->n_group);
    a->mtp = inum(c, "num_nextn_predict_layers", 0);
    a->interleave = flag(c, "rope_interleave", true);
    a->routed_scale = 2.5;
    num(c, "routed_scaling_factor", &a->routed_scale);
    if (a->D <= 0 || a->L <= 0 || a->H <= 0 || a->vocab <= 0 || a->ctx <= 0 || a->kv_lora <= 0 || a->nope <= 0 ||
        a->rope <= 0 || a->rope % 2 || a->vhd <= 0 || a->q_lora < 0 || a->E <= 0 || a->K <= 0 || a->FF_EXP <= 0 ||
        a->n_shared < 0 || a->first_dense < 0 || a->first_dense > a->L || a->n_group <= 0 || a->E % a->n_group ||
        a->topk_group <= 0 || a->topk_group > a->n_group || a->mtp < 0 || a->D > UINT32_MAX || a->vocab > INT32_MAX)
        return mq_err(MOEQ_E_FORMAT, "%s: config.json: missing or bad %s sizes (hidden_size, layers, heads, "
                      "kv_lora_rank, qk_nope/rope/v head dims, experts, n_group, first_k_dense_replace)", what,
                      a->model_type);
    if (!num(c, "rms_norm_eps", &a->eps)) return mq_err(MOEQ_E_FORMAT, "%s: config.json has no rms_norm_eps", what);
    /* transformers' q_a/kv_a layernorms keep their default eps 1e-6; llama.cpp uses rms_norm_eps */
    if ((float)a->eps != 1e-6f)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: rms_norm_eps %g: llama.cpp's deepseek2 graph uses it for the "
                      "latent norms too, which transformers runs with 1e-6", what, a->eps);
    if (flag(c, "attention_bias", false))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: attention_bias: llama.cpp's deepseek2 graph has no attention biases", what);
    if (a->FF <= 0 && a->first_dense > 0)
        return mq_err(MOEQ_E_FORMAT, "%s: config.json: dense layers without intermediate_size", what);
    const cJSON *rp = item(c, "rope_parameters");
    if (!rp) rp = item(c, "rope_scaling");
    a->theta = 10000.0;
    if (!num(c, "rope_theta", &a->theta) && rp) num(rp, "rope_theta", &a->theta);
    const cJSON *rt = rp ? item(rp, "rope_type") : NULL;
    if (rp && !rt) rt = item(rp, "type");
    if (rt && !cJSON_IsString(rt))
        return mq_err(MOEQ_E_FORMAT, "%s: rope_type is not a string", what);
    if (rt && !strcmp(rt->valuestring, "yarn")) {
        double bf = 32, bs = 1, ms = 0, msa = 0, A = NAN;
        a->yarn = true;
        a->yarn_orig = inum(rp, "original_max_position_embeddings", a->ctx);
        a->yarn_factor = a->yarn_orig > 0 ? (double)a->ctx / (double)a->yarn_orig : 0;
        num(rp, "factor", &a->yarn_factor);
        num(rp, "beta_fast", &bf);
        num(rp, "beta_slow", &bs);
        num(rp, "mscale", &ms);
        num(rp, "mscale_all_dim", &msa);
        num(rp, "attention_factor", &A);
        if ((bf != 32 && bf != 0) || (bs != 1 && bs != 0))
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: YaRN beta_fast %g, beta_slow %g: llama.cpp's deepseek2 reads "
                          "neither and uses 32 and 1", what, bf, bs);
        if (!(a->yarn_factor > 1) || a->yarn_orig <= 0 || !flag(rp, "truncate", true))
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: YaRN with factor %g, original context %lld%s is not written to "
                          "GGUF by moeq", what, a->yarn_factor, (long long)a->yarn_orig,
                          flag(rp, "truncate", true) ? "" : " and truncate false");
        if (isnan(A)) A = ms != 0 && msa != 0 ? yarn_g(a->yarn_factor, ms) / yarn_g(a->yarn_factor, msa)
                                               : yarn_g(a->yarn_factor, 1.0);
        double G = msa != 0 ? yarn_g(a->yarn_factor, msa) : 1.0;
        if (!(A > 0) || !(G > 0))
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: YaRN attention factor %g, mscale %g: not positive", what, A, G);
        yarn_kvs(a->yarn_factor, A, G, &a->yarn_a, &a->yarn_lm);
    } else if (rt && strcmp(rt->valuestring, "default")) {
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: rope scaling '%s' is not written to GGUF by moeq (default, yarn)",
                      what, rt->valuestring);
    }
    return MOEQ_OK;
}

moeq_status mq_gguf_read_arch(const cJSON *c, const char *what, arch_cfg *a) {
    memset(a, 0, sizeof *a);
    const cJSON *mt = item(c, "model_type");
    if (!mt || !cJSON_IsString(mt)) return mq_err(MOEQ_E_FORMAT, "%s: config.json has no model_type", what);
    a->model_type = mt->valuestring;
    if (!strcmp(a->model_type, "llama")) a->arch = "llama", a->permute_qk = true;
    else if (!strcmp(a->model_type, "mixtral")) a->arch = "llama", a->permute_qk = true, a->mixtral = true;
    else if (!strcmp(a->model_type, "olmoe")) a->arch = "olmoe";
    else if (!strcmp(a->model_type, "qwen2_moe")) a->arch = "qwen2moe";
    else if (!strcmp(a->model_type, "qwen3_moe")) a->arch = "qwen3moe";
    else if (!strcmp(a->model_type, "deepseek_v3") || !strcmp(a->model_type, "kimi_k2"))
        return read_deepseek(c, what, a);
    else
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: model_type '%s' has no GGUF mapping in moeq (llama, mixtral, "
                      "olmoe, qwen2_moe, qwen3_moe, deepseek_v3, kimi_k2)", what, a->model_type);
    a->D = inum(c, "hidden_size", 0);
    a->L = inum(c, "num_hidden_layers", 0);
    a->H = inum(c, "num_attention_heads", 0);
    a->KV = inum(c, "num_key_value_heads", a->H);
    a->HD = inum(c, "head_dim", a->H > 0 ? a->D / a->H : 0);
    a->FF = inum(c, "intermediate_size", 0);
    a->E = a->mixtral ? inum(c, "num_local_experts", 0) : inum(c, "num_experts", 0);
    a->K = inum(c, "num_experts_per_tok", 0);
    a->FF_EXP = inum(c, "moe_intermediate_size", 0);
    a->FF_SH = inum(c, "shared_expert_intermediate_size", 0);
    a->ctx = inum(c, "max_position_embeddings", 0);
    a->vocab = inum(c, "vocab_size", 0);
    a->tie = flag(c, "tie_word_embeddings", false);
    a->norm_topk = flag(c, "norm_topk_prob", false);
    if (a->D <= 0 || a->L <= 0 || a->H <= 0 || a->KV <= 0 || a->HD <= 0 || a->vocab <= 0 || a->ctx <= 0 ||
        a->D > UINT32_MAX || a->vocab > INT32_MAX || a->H % a->KV)
        return mq_err(MOEQ_E_FORMAT, "%s: config.json: missing or bad hidden_size, num_hidden_layers, heads, "
                      "vocab_size or max_position_embeddings", what);
    if (!num(c, "rms_norm_eps", &a->eps)) return mq_err(MOEQ_E_FORMAT, "%s: config.json has no rms_norm_eps", what);
    const cJSON *rp = item(c, "rope_parameters");
    if (!rp) rp = item(c, "rope_scaling");
    a->theta = 10000.0;
    if (!num(c, "rope_theta", &a->theta) && rp) num(rp, "rope_theta", &a->theta);
    if (rp) {
        const cJSON *rt = item(rp, "rope_type");
        if (!rt) rt = item(rp, "type");
        if (rt && (!cJSON_IsString(rt) || strcmp(rt->valuestring, "default")))
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: rope scaling '%s' is not written to GGUF by moeq", what,
                          cJSON_IsString(rt) ? rt->valuestring : "?");
    }
    return MOEQ_OK;
}

static bool has_dense_layers(const cJSON *c) {
    const cJSON *m = item(c, "mlp_only_layers");
    if (m && cJSON_IsArray(m) && cJSON_GetArraySize(m) > 0) return true;
    return inum(c, "decoder_sparse_step", 1) != 1;
}

moeq_status mq_gguf_check_config(const cJSON *c, const char *what, mq_qscheme scheme, bool act_quant) {
    arch_cfg a;
    moeq_status s = mq_gguf_read_arch(c, what, &a);
    if (s) return s;
    const cJSON *act = item(c, "hidden_act");
    if (act && cJSON_IsString(act) && strcmp(act->valuestring, "silu"))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: hidden_act '%s': llama.cpp's %s graph uses SiLU", what,
                      act->valuestring, a.arch);
    if (act_quant)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: W4A4 (NVFP4 activations) cannot be written as GGUF: llama.cpp "
                      "quantizes activations its own way (use --scheme nvfp4a16)", what);
    if (scheme == MQ_QS_NVFP4 && (!strcmp(a.arch, "olmoe") || !strcmp(a.arch, "qwen2moe")))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: NVFP4 cannot be written as GGUF for %s: llama.cpp's %s graph does "
                      "not apply the per-tensor global scale of the experts (use --scheme int4)", what,
                      a.model_type, a.arch);
    if (scheme == MQ_QS_NVFP4 && a.mla)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: NVFP4 cannot be written as GGUF for %s: llama.cpp's deepseek2 graph "
                      "applies no global scale to q_a/q_b/kv_a, the latent products or the experts (use --scheme "
                      "int4)", what, a.model_type);
    if (scheme == MQ_QS_MXFP4) return mq_err(MOEQ_E_UNSUPPORTED, "%s: MXFP4 has no GGUF export in moeq", what);
    if (!strcmp(a.arch, "qwen2moe")) {
        if (a.norm_topk)
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: qwen2_moe with norm_topk_prob true: llama.cpp's qwen2moe graph "
                          "never renormalises the top-k router weights, so it would compute another model", what);
        if (has_dense_layers(c))
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: qwen2_moe with dense layers (mlp_only_layers, decoder_sparse_step): "
                          "llama.cpp's qwen2moe graph has MoE layers only", what);
        if (flag(c, "use_sliding_window", false))
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: sliding-window attention is not written to GGUF by moeq", what);
    }
    if (!strcmp(a.arch, "qwen3moe")) {
        if (!a.norm_topk)
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: qwen3_moe with norm_topk_prob false: llama.cpp's qwen3moe graph "
                          "always renormalises the top-k router weights", what);
        if (has_dense_layers(c))
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: qwen3_moe with dense layers: llama.cpp's qwen3moe graph has MoE "
                          "layers only", what);
    }
    if (!strcmp(a.arch, "olmoe")) {
        if (a.norm_topk)
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: olmoe with norm_topk_prob true: llama.cpp's olmoe graph never "
                          "renormalises the top-k router weights", what);
        if (item(c, "clip_qkv"))
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: olmoe with clip_qkv: llama.cpp's olmoe graph does not clip", what);
    }
    if (flag(c, "mlp_bias", false))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: MLP biases are not written to GGUF by moeq", what);
    if ((a.E > 0) != (a.K > 0) || (strcmp(a.arch, "llama") && a.E <= 0))
        return mq_err(MOEQ_E_FORMAT, "%s: config.json: expert count and experts per token do not fit %s", what,
                      a.model_type);
    return MOEQ_OK;
}

moeq_status mq_gguf_read_json(const char *dir, const char *name, bool required, cJSON **out) {
    *out = NULL;
    char *path = mq_path_join(dir, name);
    if (!path) return mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!required && !mq_file_exists(path)) {
        free(path);
        return MOEQ_OK;
    }
    char *text;
    size_t len;
    moeq_status s = mq_read_file(path, &text, &len);
    if (!s) {
        *out = cJSON_ParseWithLength(text, len);
        free(text);
        if (!*out) s = mq_err(MOEQ_E_FORMAT, "%s: not valid JSON", path);
    }
    free(path);
    return s;
}

moeq_status mq_gguf_check_model(const char *model_dir, mq_qscheme scheme, bool act_quant) {
    cJSON *c;
    moeq_status s = mq_gguf_read_json(model_dir, "config.json", true, &c);
    if (s) return s;
    s = mq_gguf_check_config(c, model_dir, scheme, act_quant);
    cJSON_Delete(c);
    return s;
}
