/*
 * GGUF -> a Hugging Face checkpoint directory moeq's loader opens (config.json, tokenizer.json,
 * model.safetensors in F32), so that eval, generate and tokenize run on llama.cpp's files:
 * the config from the architecture's KVs (routing as llama.cpp's graph hard-codes it: olmoe and
 * qwen2moe never renormalise the top-k weights, qwen3moe and Mixtral do), every tensor decoded
 * with io/gguf.c's block decoders (NVFP4 times its NAME.scale), stacked experts split, llama's
 * q/k rows permuted back (HF row h*hd + j*hd/2 + i = GGUF row h*hd + 2i + j), and the tokenizer
 * rebuilt from tokenizer.ggml.* (gpt2 model; pre-tokenizer from tokenizer.ggml.pre). The whole
 * model is held in fp32 while the file is written. gguf_types.json records each matrix's ggml
 * type under its HF name ({"model.layers.0.mlp.experts.3.up_proj.weight": "q4_0", ...; a tied
 * lm_head.weight gets token_embd's}), so that act_quant q8_0 rounds the inputs of exactly the
 * Linears llama.cpp computes with Q8_0 activations (model/load.c).
 *
 * deepseek2 (llama.cpp's DeepSeek-V3 / Kimi K2 layout, models/deepseek2.cpp) -> deepseek_v3:
 * attn_k_b {nope, kv_lora, H} and attn_v_b {kv_lora, v, H} merged back into kv_b_proj (per head
 * the nope rows, k_b transposed, then the v rows); rope_interleave true, since llama.cpp rotates
 * adjacent pairs (a checkpoint written without it comes back with its rotary rows in that order,
 * the same function); the routing from the expert_* KVs; YaRN's cos/sin factor and softmax scale
 * as llama.cpp derives them from rope.scaling.attn_factor and yarn_log_multiplier. kv_b_proj's
 * entry in gguf_types.json names both types ("f32+q4_0"), which act_quant q8_0 does not round:
 * llama.cpp's Q8_0 rounding there falls on q_nope and on the attention's latent output, inside
 * the absorbed attention, not on kv_b's input.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "export/gguf_export.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "io/tokenizer.h"

typedef struct {
    const char *arch;
    bool mixtral;
    uint32_t D, L, H, KV, HD, FF, E, K, FF_EXP, FF_SH, ctx, vocab;
    float eps, theta;
    /* deepseek2 */
    bool mla, norm_topk, yarn;
    uint32_t q_lora, kv_lora, nope, rope, vhd, n_shared, first_dense, n_group, topk_group, nextn, yarn_orig;
    float routed_scale, yarn_factor, yarn_a, yarn_lm;   /* yarn_lm: yarn_log_multiplier / 0.1 */
} gcfg;

static moeq_status akey_u32(const mq_gguf *g, const char *arch, const char *k, bool required, uint32_t *v) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, k);
    moeq_status s = mq_gguf_get_u32(g, key, v);
    if (s == MOEQ_E_NOTFOUND && !required) return MOEQ_OK;
    return s;
}

static moeq_status akey_f32(const mq_gguf *g, const char *arch, const char *k, float *v) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, k);
    moeq_status s = mq_gguf_get_f32(g, key, v);
    return s == MOEQ_E_NOTFOUND ? MOEQ_OK : s;
}

/* The deepseek2 KVs as llama.cpp's loader reads them (models/deepseek2.cpp), the common ones
 * (sizes, heads, context) read by read_cfg. */
static moeq_status read_deepseek2(const mq_gguf *g, const char *path, gcfg *c) {
    const char *A = c->arch;
    c->mla = true;
    c->KV = c->H;   /* head_count_kv 1 is the absorbed form's shared latent */
    uint32_t kl = 0, vl = 0, klm = 0, vlm = 0, gating = 0;
    c->n_group = c->topk_group = 1;
    c->routed_scale = 0;
    moeq_status s;
    if ((s = akey_u32(g, A, "attention.kv_lora_rank", true, &c->kv_lora)) ||
        (s = akey_u32(g, A, "attention.q_lora_rank", false, &c->q_lora)) ||
        (s = akey_u32(g, A, "attention.key_length", true, &kl)) ||
        (s = akey_u32(g, A, "attention.value_length", true, &vl)) ||
        (s = akey_u32(g, A, "attention.key_length_mla", false, &klm)) ||
        (s = akey_u32(g, A, "attention.value_length_mla", false, &vlm)) ||
        (s = akey_u32(g, A, "rope.dimension_count", true, &c->rope)) ||
        (s = akey_u32(g, A, "expert_count", true, &c->E)) || (s = akey_u32(g, A, "expert_used_count", true, &c->K)) ||
        (s = akey_u32(g, A, "expert_feed_forward_length", true, &c->FF_EXP)) ||
        (s = akey_u32(g, A, "expert_shared_count", true, &c->n_shared)) ||
        (s = akey_u32(g, A, "leading_dense_block_count", false, &c->first_dense)) ||
        (s = akey_u32(g, A, "expert_gating_func", false, &gating)) ||
        (s = akey_u32(g, A, "expert_group_count", false, &c->n_group)) ||
        (s = akey_u32(g, A, "expert_group_used_count", false, &c->topk_group)) ||
        (s = akey_u32(g, A, "nextn_predict_layers", false, &c->nextn)) ||
        (s = akey_f32(g, A, "expert_weights_scale", &c->routed_scale)))
        return s;
    char key[160];
    snprintf(key, sizeof key, "%s.expert_weights_norm", A);
    c->norm_topk = false;
    if ((s = mq_gguf_get_bool(g, key, &c->norm_topk)) && s != MOEQ_E_NOTFOUND) return s;
    /* files without the *_mla lengths hold attn_kv_b and run it unabsorbed: heads of key_length */
    uint32_t hk = klm ? klm : kl, hv = vlm ? vlm : vl;
    if (!c->kv_lora || !c->rope || hk <= c->rope || !hv || !c->E || !c->K || c->first_dense > c->L ||
        !c->n_group || c->E % c->n_group || c->topk_group > c->n_group || c->nextn >= c->L)
        return mq_err(MOEQ_E_FORMAT, "%s: deepseek2 KVs out of range (latent ranks, head lengths, experts, "
                      "groups, leading dense blocks)", path);
    if (gating != 2)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: deepseek2 with expert_gating_func %u: moeq runs DeepSeek-V3's "
                      "sigmoid routing (2) only", path, gating);
    c->L -= c->nextn;   /* block_count counts the MTP layers, which are not read */
    c->nope = hk - c->rope;
    c->vhd = hv;
    c->HD = c->rope;
    if (c->n_group <= 1) c->topk_group = c->n_group = 1;
    if (!c->routed_scale) c->routed_scale = 1;   /* llama.cpp: 0 = no scaling */
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", A);
    if ((s = mq_gguf_get_f32(g, key, &c->eps))) return s;
    c->theta = 10000.0f;
    if ((s = akey_f32(g, A, "rope.freq_base", &c->theta))) return s;
    const char *rt;
    size_t rl;
    snprintf(key, sizeof key, "%s.rope.scaling.type", A);
    if ((s = mq_gguf_get_str(g, key, &rt, &rl)) && s != MOEQ_E_NOTFOUND) return s;
    if (!s && !(rl == 4 && !memcmp(rt, "none", 4))) {
        if (!(rl == 4 && !memcmp(rt, "yarn", 4)))
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: rope scaling '%.*s' is not read (yarn)", path, (int)rl, rt);
        c->yarn = true;
        c->yarn_orig = c->ctx;
        c->yarn_a = 1;
        if ((s = akey_f32(g, A, "rope.scaling.factor", &c->yarn_factor)) ||
            (s = akey_u32(g, A, "rope.scaling.original_context_length", false, &c->yarn_orig)) ||
            (s = akey_f32(g, A, "rope.scaling.attn_factor", &c->yarn_a)) ||
            (s = akey_f32(g, A, "rope.scaling.yarn_log_multiplier", &c->yarn_lm)))
            return s;
        c->yarn_lm /= 0.1f;   /* in float, as llama.cpp cancels its converter's factor */
        if (!(c->yarn_factor > 1) || !c->yarn_orig || !(c->yarn_a > 0))
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: YaRN factor %g, original context %u, attn_factor %g are not read",
                          path, (double)c->yarn_factor, c->yarn_orig, (double)c->yarn_a);
    }
    const mq_gguf_kv *toks = mq_gguf_find_kv(g, "tokenizer.ggml.tokens");
    if (!toks || toks->type != MQ_GGUF_ARRAY || toks->arr_type != MQ_GGUF_STRING)
        return mq_err(MOEQ_E_FORMAT, "%s: no tokenizer.ggml.tokens string array", path);
    c->vocab = (uint32_t)toks->n;
    return akey_u32(g, A, "vocab_size", false, &c->vocab);
}

/* deepseek_v3's config.json of a deepseek2 file. YaRN: llama.cpp multiplies cos/sin by a (the
 * attn_factor) and the softmax scale by (a g(m))^2 with m the log multiplier (by g(1)^2 a^2 and
 * cos/sin by a g(1) without one); transformers by attention_factor and g(mscale_all_dim)^2. */
static void deepseek_config(const gcfg *c, cJSON *j) {
    if (c->q_lora) cJSON_AddNumberToObject(j, "q_lora_rank", c->q_lora);
    else cJSON_AddNullToObject(j, "q_lora_rank");
    cJSON_AddNumberToObject(j, "kv_lora_rank", c->kv_lora);
    cJSON_AddNumberToObject(j, "qk_nope_head_dim", c->nope);
    cJSON_AddNumberToObject(j, "qk_rope_head_dim", c->rope);
    cJSON_AddNumberToObject(j, "v_head_dim", c->vhd);
    cJSON_AddBoolToObject(j, "rope_interleave", true);
    cJSON_AddBoolToObject(j, "attention_bias", false);
    cJSON_AddNumberToObject(j, "n_routed_experts", c->E);
    cJSON_AddNumberToObject(j, "num_experts_per_tok", c->K);
    cJSON_AddNumberToObject(j, "moe_intermediate_size", c->FF_EXP);
    cJSON_AddNumberToObject(j, "n_shared_experts", c->n_shared);
    cJSON_AddNumberToObject(j, "first_k_dense_replace", c->first_dense);
    cJSON_AddNumberToObject(j, "n_group", c->n_group);
    cJSON_AddNumberToObject(j, "topk_group", c->topk_group);
    cJSON_AddBoolToObject(j, "norm_topk_prob", c->norm_topk);
    cJSON_AddNumberToObject(j, "routed_scaling_factor", c->routed_scale);
    cJSON_AddStringToObject(j, "scoring_func", "sigmoid");
    cJSON_AddStringToObject(j, "topk_method", "noaux_tc");
    cJSON_AddNumberToObject(j, "num_nextn_predict_layers", 0);
    cJSON *rp = cJSON_AddObjectToObject(j, "rope_parameters");
    cJSON_AddNumberToObject(rp, "rope_theta", c->theta);
    if (!c->yarn) {
        cJSON_AddStringToObject(rp, "rope_type", "default");
        return;
    }
    cJSON_AddStringToObject(rp, "rope_type", "yarn");
    cJSON_AddNumberToObject(rp, "factor", c->yarn_factor);
    cJSON_AddNumberToObject(rp, "original_max_position_embeddings", c->yarn_orig);
    cJSON_AddNumberToObject(rp, "beta_fast", 32);   /* llama.cpp's deepseek2 reads neither */
    cJSON_AddNumberToObject(rp, "beta_slow", 1);
    double f = c->yarn_factor, g1 = 0.1 * log(f) + 1;
    if (c->yarn_lm != 0 && c->yarn_a == 1) {   /* DeepSeek-V3's and Kimi K2's: exact */
        cJSON_AddNumberToObject(rp, "mscale", c->yarn_lm);
        cJSON_AddNumberToObject(rp, "mscale_all_dim", c->yarn_lm);
        return;
    }
    double cs = c->yarn_lm != 0 ? c->yarn_a : c->yarn_a * g1;                       /* cos/sin factor */
    double sm = c->yarn_lm != 0 ? c->yarn_a * (0.1 * c->yarn_lm * log(f) + 1) : cs;   /* sqrt of the scale's */
    cJSON_AddNumberToObject(rp, "attention_factor", cs);
    cJSON_AddNumberToObject(rp, "mscale", 1);
    cJSON_AddNumberToObject(rp, "mscale_all_dim", (sm - 1) / (0.1 * log(f)));
}

static moeq_status read_cfg(const mq_gguf *g, const char *path, gcfg *c) {
    memset(c, 0, sizeof *c);
    const char *a;
    size_t al;
    moeq_status s = mq_gguf_get_str(g, "general.architecture", &a, &al);
    if (s) return s;
    static const char *const archs[] = {"llama", "olmoe", "qwen2moe", "qwen3moe", "deepseek2"};
    for (int i = 0; i < 5; i++)
        if (al == strlen(archs[i]) && !memcmp(a, archs[i], al)) c->arch = archs[i];
    if (!c->arch)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: architecture '%.*s': moeq reads llama, olmoe, qwen2moe, qwen3moe and deepseek2 GGUF files",
                      path, (int)al, a);
    const char *A = c->arch;
    if ((s = akey_u32(g, A, "embedding_length", true, &c->D)) || (s = akey_u32(g, A, "block_count", true, &c->L)) ||
        (s = akey_u32(g, A, "attention.head_count", true, &c->H)) ||
        (s = akey_u32(g, A, "feed_forward_length", true, &c->FF)) ||
        (s = akey_u32(g, A, "context_length", true, &c->ctx)))
        return s;
    c->KV = c->H;
    if ((s = akey_u32(g, A, "attention.head_count_kv", false, &c->KV))) return s;
    if (!c->H || !c->KV || c->H % c->KV || !c->D || !c->L) return mq_err(MOEQ_E_FORMAT, "%s: bad head or layer counts", path);
    if (!strcmp(A, "deepseek2")) return read_deepseek2(g, path, c);
    c->HD = c->D / c->H;
    uint32_t rot = 0;
    if ((s = akey_u32(g, A, "attention.key_length", false, &c->HD)) || (s = akey_u32(g, A, "expert_count", false, &c->E)) ||
        (s = akey_u32(g, A, "expert_used_count", false, &c->K)) ||
        (s = akey_u32(g, A, "expert_feed_forward_length", false, &c->FF_EXP)) ||
        (s = akey_u32(g, A, "expert_shared_feed_forward_length", false, &c->FF_SH)) ||
        (s = akey_u32(g, A, "rope.dimension_count", false, &rot)))
        return s;
    if (rot && rot != c->HD)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: partial rotary embeddings (%u of %u) are not read", path, rot, c->HD);
    char key[160];
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", A);
    if ((s = mq_gguf_get_f32(g, key, &c->eps))) return s;
    c->theta = 10000.0f;
    snprintf(key, sizeof key, "%s.rope.freq_base", A);
    if ((s = mq_gguf_get_f32(g, key, &c->theta)) && s != MOEQ_E_NOTFOUND) return s;
    snprintf(key, sizeof key, "%s.rope.scaling.type", A);
    if (mq_gguf_find_kv(g, key)) return mq_err(MOEQ_E_UNSUPPORTED, "%s: rope scaling is not read", path);
    const mq_gguf_kv *toks = mq_gguf_find_kv(g, "tokenizer.ggml.tokens");
    if (!toks || toks->type != MQ_GGUF_ARRAY || toks->arr_type != MQ_GGUF_STRING)
        return mq_err(MOEQ_E_FORMAT, "%s: no tokenizer.ggml.tokens string array", path);
    c->vocab = (uint32_t)toks->n;
    if ((s = akey_u32(g, A, "vocab_size", false, &c->vocab))) return s;
    c->mixtral = !strcmp(A, "llama") && c->E > 0;
    if (strcmp(A, "llama") && (!c->E || !c->K)) return mq_err(MOEQ_E_FORMAT, "%s: %s without experts", path, A);
    return MOEQ_OK;
}

static cJSON *make_config(const gcfg *c, const mq_gguf *g, bool tied) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return NULL;
    const char *mt = c->mla ? "deepseek_v3" : c->mixtral ? "mixtral" : !strcmp(c->arch, "llama") ? "llama"
                     : !strcmp(c->arch, "olmoe")                        ? "olmoe"
                     : !strcmp(c->arch, "qwen2moe")                     ? "qwen2_moe"
                                                                        : "qwen3_moe";
    cJSON_AddStringToObject(j, "model_type", mt);
    cJSON_AddNumberToObject(j, "hidden_size", c->D);
    cJSON_AddNumberToObject(j, "num_hidden_layers", c->L);
    cJSON_AddNumberToObject(j, "num_attention_heads", c->H);
    cJSON_AddNumberToObject(j, "num_key_value_heads", c->KV);
    cJSON_AddNumberToObject(j, "head_dim", c->HD);
    cJSON_AddNumberToObject(j, "intermediate_size", c->FF);
    cJSON_AddNumberToObject(j, "max_position_embeddings", c->ctx);
    cJSON_AddNumberToObject(j, "vocab_size", c->vocab);
    cJSON_AddNumberToObject(j, "rms_norm_eps", c->eps);
    cJSON_AddNumberToObject(j, "rope_theta", c->theta);
    cJSON_AddStringToObject(j, "hidden_act", "silu");
    cJSON_AddBoolToObject(j, "tie_word_embeddings", tied);
    if (c->mla) deepseek_config(c, j);
    if (c->E && !c->mla) {
        cJSON_AddNumberToObject(j, c->mixtral ? "num_local_experts" : "num_experts", c->E);
        cJSON_AddNumberToObject(j, "num_experts_per_tok", c->K);
    }
    /* the routing llama.cpp's graphs hard-code */
    if (!strcmp(c->arch, "olmoe") || !strcmp(c->arch, "qwen2moe")) cJSON_AddBoolToObject(j, "norm_topk_prob", false);
    if (!strcmp(c->arch, "qwen3moe")) cJSON_AddBoolToObject(j, "norm_topk_prob", true);
    if (!strcmp(c->arch, "qwen2moe") || !strcmp(c->arch, "qwen3moe")) {
        cJSON_AddNumberToObject(j, "moe_intermediate_size", c->FF_EXP ? c->FF_EXP : c->FF);
        cJSON_AddNumberToObject(j, "decoder_sparse_step", 1);
    }
    if (!strcmp(c->arch, "qwen2moe")) {
        cJSON_AddNumberToObject(j, "shared_expert_intermediate_size", c->FF_SH ? c->FF_SH : c->FF);
        cJSON_AddBoolToObject(j, "qkv_bias", mq_gguf_find_tensor(g, "blk.0.attn_q.bias") != NULL);
    }
    uint32_t id;
    if (!mq_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &id)) cJSON_AddNumberToObject(j, "bos_token_id", id);
    if (!mq_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &id)) cJSON_AddNumberToObject(j, "eos_token_id", id);
    if (!mq_gguf_get_u32(g, "tokenizer.ggml.padding_token_id", &id)) cJSON_AddNumberToObject(j, "pad_token_id", id);
    return j;
}

static cJSON *byte_level(bool use_regex) {
    cJSON *b = cJSON_CreateObject();
    cJSON_AddStringToObject(b, "type", "ByteLevel");
    cJSON_AddBoolToObject(b, "add_prefix_space", false);
    cJSON_AddBoolToObject(b, "trim_offsets", true);
    cJSON_AddBoolToObject(b, "use_regex", use_regex);
    return b;
}

static char *strn(const char *s, size_t n) { return mq_strndup(s, n); }

/* tokenizer.json from tokenizer.ggml.*: BPE vocab (padding entries left out), merges, the
 * special and user-defined tokens as added tokens, the pre-tokenizer tokenizer.ggml.pre names. */
static moeq_status make_tokenizer(const mq_gguf *g, const char *path, cJSON **out) {
    *out = NULL;
    const char *m, *pre;
    size_t ml, pl;
    moeq_status s = mq_gguf_get_str(g, "tokenizer.ggml.model", &m, &ml);
    if (s) return s;
    if (ml != 4 || memcmp(m, "gpt2", 4))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: tokenizer.ggml.model '%.*s': moeq reads byte-level BPE (gpt2)", path, (int)ml, m);
    if ((s = mq_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pl))) {
        if (s != MOEQ_E_NOTFOUND) return s;
        pre = "default", pl = 7;
    }
    const char *re = NULL, *const *splits = &re;
    int n_splits = 1;
    if ((pl == 5 && !memcmp(pre, "gpt-2", 5)) || (pl == 4 && !memcmp(pre, "olmo", 4)) || (pl == 7 && !memcmp(pre, "default", 7)))
        re = "";
    else if (pl == 9 && !memcmp(pre, "llama-bpe", 9)) re = mq_gguf_re_llama3;
    else if (pl == 5 && !memcmp(pre, "qwen2", 5)) re = mq_gguf_re_qwen2;
    else if (pl == 11 && !memcmp(pre, "deepseek-v3", 11)) re = mq_gguf_re_deepseek3[0], splits = mq_gguf_re_deepseek3, n_splits = 3;
    /* Kimi K2's tiktoken split in moeq's PCRE2 spelling (this tokenizer.json is for moeq alone);
     * tiktoken takes a piece that is a token whole: ignore_merges */
    const bool kimi = pl == 7 && !memcmp(pre, "kimi-k2", 7);
    if (kimi) re = mq_tokenizer_kimi_split;
    if (!re) return mq_err(MOEQ_E_UNSUPPORTED, "%s: tokenizer.ggml.pre '%.*s' is not one moeq rebuilds (gpt-2, olmo, "
                           "llama-bpe, qwen2, deepseek-v3, kimi-k2)", path, (int)pl, pre);
    const mq_gguf_kv *toks = mq_gguf_find_kv(g, "tokenizer.ggml.tokens"), *types = mq_gguf_find_kv(g, "tokenizer.ggml.token_type");
    const mq_gguf_kv *merges = mq_gguf_find_kv(g, "tokenizer.ggml.merges");
    if (!merges || merges->type != MQ_GGUF_ARRAY || merges->arr_type != MQ_GGUF_STRING)
        return mq_err(MOEQ_E_FORMAT, "%s: no tokenizer.ggml.merges string array", path);
    cJSON *t = cJSON_CreateObject(), *added = cJSON_AddArrayToObject(t, "added_tokens");
    cJSON_AddStringToObject(t, "version", "1.0");
    cJSON_AddNullToObject(t, "normalizer");
    if (re[0]) {
        cJSON *seq = cJSON_CreateObject(), *list = cJSON_AddArrayToObject(seq, "pretokenizers");
        cJSON_AddStringToObject(seq, "type", "Sequence");
        for (int i = 0; i < n_splits; i++) {
            cJSON *sp = cJSON_CreateObject();
            cJSON_AddStringToObject(sp, "type", "Split");
            cJSON *pat = cJSON_AddObjectToObject(sp, "pattern");
            cJSON_AddStringToObject(pat, "Regex", splits[i]);
            cJSON_AddStringToObject(sp, "behavior", "Isolated");
            cJSON_AddBoolToObject(sp, "invert", false);
            cJSON_AddItemToArray(list, sp);
        }
        cJSON_AddItemToArray(list, byte_level(false));
        cJSON_AddItemToObject(t, "pre_tokenizer", seq);
    } else {
        cJSON_AddItemToObject(t, "pre_tokenizer", byte_level(true));
    }
    cJSON_AddItemToObject(t, "decoder", byte_level(true));
    cJSON *model = cJSON_AddObjectToObject(t, "model"), *vocab = cJSON_AddObjectToObject(model, "vocab");
    cJSON_AddStringToObject(model, "type", "BPE");
    if (kimi) cJSON_AddBoolToObject(model, "ignore_merges", true);
    cJSON *mer = cJSON_AddArrayToObject(model, "merges");
    for (uint64_t i = 0; i < toks->n; i++) {
        const char *ts;
        size_t tl;
        double ty = 1;
        mq_gguf_kv_str_at(toks, i, &ts, &tl);
        if (types) mq_gguf_kv_num_at(types, i, &ty);
        if (ty == 5) continue;   /* padding rows */
        char *name = strn(ts, tl);
        if (!name) break;
        if (!cJSON_GetObjectItemCaseSensitive(vocab, name)) cJSON_AddNumberToObject(vocab, name, (double)i);
        if (ty == 3 || ty == 4) {
            cJSON *a = cJSON_CreateObject();
            cJSON_AddNumberToObject(a, "id", (double)i);
            cJSON_AddStringToObject(a, "content", name);
            cJSON_AddBoolToObject(a, "single_word", false);
            cJSON_AddBoolToObject(a, "lstrip", false);
            cJSON_AddBoolToObject(a, "rstrip", false);
            cJSON_AddBoolToObject(a, "normalized", false);
            cJSON_AddBoolToObject(a, "special", ty == 3);
            cJSON_AddItemToArray(added, a);
        }
        free(name);
    }
    for (uint64_t i = 0; i < merges->n; i++) {
        const char *ms;
        size_t mlen;
        mq_gguf_kv_str_at(merges, i, &ms, &mlen);
        char *x = strn(ms, mlen);
        if (!x) break;
        cJSON_AddItemToArray(mer, cJSON_CreateString(x));
        free(x);
    }
    *out = t;
    return MOEQ_OK;
}

/* deepseek2's blk.l.r -> deepseek_v3's name (attn_k_b: the kv_b_proj it is merged into). */
static bool hf_name_deepseek(const char *r, int l, int64_t e, char *out, size_t n, bool *stacked) {
    static const char *const plain[][2] = {
        {"attn_norm.weight", "input_layernorm.weight"}, {"ffn_norm.weight", "post_attention_layernorm.weight"},
        {"attn_q_a.weight", "self_attn.q_a_proj.weight"}, {"attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"},
        {"attn_q_b.weight", "self_attn.q_b_proj.weight"}, {"attn_q.weight", "self_attn.q_proj.weight"},
        {"attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight"},
        {"attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"},
        {"attn_kv_b.weight", "self_attn.kv_b_proj.weight"}, {"attn_k_b.weight", "self_attn.kv_b_proj.weight"},
        {"attn_output.weight", "self_attn.o_proj.weight"}, {"ffn_gate.weight", "mlp.gate_proj.weight"},
        {"ffn_up.weight", "mlp.up_proj.weight"}, {"ffn_down.weight", "mlp.down_proj.weight"},
        {"ffn_gate_inp.weight", "mlp.gate.weight"}, {"exp_probs_b.bias", "mlp.gate.e_score_correction_bias"},
        {"ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight"},
        {"ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight"},
        {"ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight"},
    };
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++)
        if (!strcmp(r, plain[i][0])) return snprintf(out, n, "model.layers.%d.%s", l, plain[i][1]), true;
    static const char *const ex[3][2] = {{"ffn_gate_exps.weight", "gate_proj"}, {"ffn_up_exps.weight", "up_proj"},
                                         {"ffn_down_exps.weight", "down_proj"}};
    for (int i = 0; i < 3; i++)
        if (!strcmp(r, ex[i][0])) {
            *stacked = true;
            return snprintf(out, n, "model.layers.%d.mlp.experts.%lld.%s.weight", l, (long long)e, ex[i][1]), true;
        }
    return false;
}

/* A tensor decoded to f32, times its NAME.scale (NVFP4's global multiplier) when there is one. */
static moeq_status decode_scaled(const mq_gguf *g, const char *path, const mq_gguf_tensor *t, float **out) {
    *out = NULL;
    float *f = mq_alloc_array((size_t)t->numel, sizeof(float), t->name);
    if (!f) return MOEQ_E_NOMEM;
    moeq_status s = mq_gguf_tensor_to_f32(t, f);
    size_t nl = strlen(t->name);
    char sname[160];
    snprintf(sname, sizeof sname, "%.*s.scale", (int)(nl > 7 ? nl - 7 : 0), t->name);
    const mq_gguf_tensor *sc = nl > 7 && !strcmp(t->name + nl - 7, ".weight") ? mq_gguf_find_tensor(g, sname) : NULL;
    if (!s && sc) {
        float v;
        if (sc->numel != 1 || sc->type != MQ_GGML_F32) s = mq_err(MOEQ_E_FORMAT, "%s: '%s' is not one F32", path, sname);
        else if (!(s = mq_gguf_tensor_to_f32(sc, &v)))
            for (int64_t k = 0; k < t->numel; k++) f[k] *= v;
    }
    if (s) mq_free(f);
    else *out = f;
    return s;
}

/* kv_b_proj [H * (nope + v), kv_lora] of layer l from attn_k_b {nope, kv_lora, H} (transposed
 * back) and attn_v_b {kv_lora, v, H}; its gguf_types.json entry names both types. */
static moeq_status merge_kv_b(const mq_gguf *g, const char *path, const gcfg *c, const mq_gguf_tensor *kb, int l,
                              mq_st_writer *w, cJSON *types) {
    char vn[96], hn[128];
    snprintf(vn, sizeof vn, "blk.%d.attn_v_b.weight", l);
    const mq_gguf_tensor *vb = mq_gguf_find_tensor(g, vn);
    int64_t nope = c->nope, r = c->kv_lora, v = c->vhd, H = c->H, hb = nope + v;
    if (!vb) return mq_err(MOEQ_E_FORMAT, "%s: '%s' without '%s'", path, kb->name, vn);
    if (kb->n_dims != 3 || kb->ne[0] != nope || kb->ne[1] != r || kb->ne[2] != H || vb->n_dims != 3 ||
        vb->ne[0] != r || vb->ne[1] != v || vb->ne[2] != H)
        return mq_err(MOEQ_E_SHAPE, "%s: '%s' / '%s' are not {%lld, %lld, %lld} / {%lld, %lld, %lld}", path, kb->name,
                      vn, (long long)nope, (long long)r, (long long)H, (long long)r, (long long)v, (long long)H);
    float *fk = NULL, *fv = NULL, *kv = mq_alloc_array((size_t)(H * hb * r), sizeof(float), "kv_b_proj");
    moeq_status s = kv ? decode_scaled(g, path, kb, &fk) : MOEQ_E_NOMEM;
    if (!s) s = decode_scaled(g, path, vb, &fv);
    for (int64_t h = 0; !s && h < H; h++)
        for (int64_t cc = 0; cc < r; cc++) {
            for (int64_t i = 0; i < nope; i++) kv[(h * hb + i) * r + cc] = fk[(h * r + cc) * nope + i];
            for (int64_t j = 0; j < v; j++) kv[(h * hb + nope + j) * r + cc] = fv[(h * v + j) * r + cc];
        }
    mq_free(fk);
    mq_free(fv);
    if (s) {
        mq_free(kv);
        return s;
    }
    const char *tk = NULL, *tv = NULL;
    mq_ggml_type_info(kb->type, &tk, NULL, NULL);
    mq_ggml_type_info(vb->type, &tv, NULL, NULL);
    char both[64];
    snprintf(both, sizeof both, "%s+%s", tk, tv);
    snprintf(hn, sizeof hn, "model.layers.%d.self_attn.kv_b_proj.weight", l);
    if (!cJSON_AddStringToObject(types, hn, both)) {
        mq_free(kv);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    int64_t shape[2] = {H * hb, r};
    return mq_stw_add_owned(w, hn, MOEQ_DT_F32, 2, shape, kv, (size_t)(H * hb * r) * sizeof(float));
}

/* The HF name of a GGUF tensor (expert e of a stacked one); NULL: not a weight moeq maps. */
static bool hf_name(const gcfg *c, const char *gn, int64_t e, char *out, size_t n, bool *stacked) {
    static const char *const plain[][2] = {
        {"attn_norm.weight", "input_layernorm.weight"}, {"ffn_norm.weight", "post_attention_layernorm.weight"},
        {"attn_q.weight", "self_attn.q_proj.weight"}, {"attn_k.weight", "self_attn.k_proj.weight"},
        {"attn_v.weight", "self_attn.v_proj.weight"}, {"attn_output.weight", "self_attn.o_proj.weight"},
        {"attn_q.bias", "self_attn.q_proj.bias"}, {"attn_k.bias", "self_attn.k_proj.bias"},
        {"attn_v.bias", "self_attn.v_proj.bias"}, {"attn_q_norm.weight", "self_attn.q_norm.weight"},
        {"attn_k_norm.weight", "self_attn.k_norm.weight"}, {"ffn_gate.weight", "mlp.gate_proj.weight"},
        {"ffn_up.weight", "mlp.up_proj.weight"}, {"ffn_down.weight", "mlp.down_proj.weight"},
        {"ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"},
        {"ffn_gate_shexp.weight", "mlp.shared_expert.gate_proj.weight"},
        {"ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"},
        {"ffn_down_shexp.weight", "mlp.shared_expert.down_proj.weight"},
    };
    *stacked = false;
    if (!strcmp(gn, "token_embd.weight")) return snprintf(out, n, "model.embed_tokens.weight"), true;
    if (!strcmp(gn, "output_norm.weight")) return snprintf(out, n, "model.norm.weight"), true;
    if (!strcmp(gn, "output.weight")) return snprintf(out, n, "lm_head.weight"), true;
    int l, used = 0;
    if (sscanf(gn, "blk.%d.%n", &l, &used) != 1 || used == 0) return false;
    const char *r = gn + used;
    if (c->mla) return hf_name_deepseek(r, l, e, out, n, stacked);
    const char *blk = c->mixtral ? "block_sparse_moe" : "mlp";
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++)
        if (!strcmp(r, plain[i][0])) return snprintf(out, n, "model.layers.%d.%s", l, plain[i][1]), true;
    if (!strcmp(r, "ffn_gate_inp.weight")) return snprintf(out, n, "model.layers.%d.%s.gate.weight", l, blk), true;
    static const char *const ex[3][3] = {{"ffn_gate_exps.weight", "gate_proj", "w1"},
                                         {"ffn_up_exps.weight", "up_proj", "w3"},
                                         {"ffn_down_exps.weight", "down_proj", "w2"}};
    for (int i = 0; i < 3; i++)
        if (!strcmp(r, ex[i][0])) {
            *stacked = true;
            return snprintf(out, n, "model.layers.%d.%s.experts.%lld.%s.weight", l, blk, (long long)e,
                            c->mixtral ? ex[i][2] : ex[i][1]), true;
        }
    return false;
}

moeq_status mq_gguf_import(const char *gguf_path, const char *out_dir) {
    mq_gguf *g;
    moeq_status s = mq_gguf_open(gguf_path, &g);
    if (s) return s;
    gcfg c;
    cJSON *cfg = NULL, *tok = NULL, *types = NULL;
    mq_st_writer *w = mq_stw_new();
    char *p = NULL;
    if (!w) {
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    if ((s = read_cfg(g, gguf_path, &c)) || (s = make_tokenizer(g, gguf_path, &tok))) goto done;
    bool tied = !mq_gguf_find_tensor(g, "output.weight");
    if (!(cfg = make_config(&c, g, tied)) || !(types = cJSON_CreateObject())) {
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    for (size_t i = 0; !s && i < mq_gguf_tensor_count(g); i++) {
        const mq_gguf_tensor *t = mq_gguf_tensor_at(g, i);
        size_t nl = strlen(t->name);
        if ((nl > 6 && !strcmp(t->name + nl - 6, ".scale")) || (nl > 12 && !strcmp(t->name + nl - 12, ".input_scale")))
            continue;   /* applied to its weight; activation scales are llama.cpp's business */
        if (c.mla) {
            int l = -1, used = 0;
            if (sscanf(t->name, "blk.%d.%n", &l, &used) == 1 && used > 0 && l >= (int)c.L) {
                continue;   /* the MTP layers (nextn_predict_layers), which moeq does not run */
            }
            if (l >= 0 && !strcmp(t->name + used, "attn_v_b.weight")) continue;   /* merged with attn_k_b */
            if (l >= 0 && !strcmp(t->name + used, "attn_k_b.weight")) {
                s = merge_kv_b(g, gguf_path, &c, t, l, w, types);
                continue;
            }
        }
        char hn[300];
        bool stacked;
        if (!hf_name(&c, t->name, 0, hn, sizeof hn, &stacked)) {
            s = mq_err(MOEQ_E_UNSUPPORTED, "%s: tensor '%s' has no place in a %s model moeq runs", gguf_path, t->name, c.arch);
            break;
        }
        const char *tname = NULL;
        mq_ggml_type_info(t->type, &tname, NULL, NULL);
        for (int64_t e = 0; t->n_dims >= 2 && e < (stacked ? t->ne[2] : 1); e++) {
            char en[300];
            if (stacked) hf_name(&c, t->name, e, en, sizeof en, &stacked);
            if (!cJSON_AddStringToObject(types, stacked ? en : hn, tname)) s = MOEQ_E_NOMEM;
            if (tied && !strcmp(t->name, "token_embd.weight") &&
                !cJSON_AddStringToObject(types, "lm_head.weight", tname))
                s = MOEQ_E_NOMEM;
        }
        if (s) {
            s = mq_err(s, "out of memory");
            break;
        }
        float *f = mq_alloc_array((size_t)t->numel, sizeof(float), t->name);
        if (!f) {
            s = MOEQ_E_NOMEM;
            break;
        }
        if ((s = mq_gguf_tensor_to_f32(t, f))) {
            mq_free(f);
            break;
        }
        int64_t E = t->n_dims == 3 ? t->ne[2] : 1, rows = t->n_dims >= 2 ? t->ne[1] : 1, cols = t->ne[0];
        char sname[160];
        snprintf(sname, sizeof sname, "%.*s.scale", (int)(nl - 7), t->name);
        const mq_gguf_tensor *sc = nl > 7 && !strcmp(t->name + nl - 7, ".weight") ? mq_gguf_find_tensor(g, sname) : NULL;
        if (sc) {
            float sv[4096];
            if (sc->numel != E || sc->type != MQ_GGML_F32 || E > 4096) {
                mq_free(f);
                s = mq_err(MOEQ_E_FORMAT, "%s: '%s' has %lld values for %lld matrices", gguf_path, sname,
                           (long long)sc->numel, (long long)E);
                break;
            }
            mq_gguf_tensor_to_f32(sc, sv);
            for (int64_t k = 0; k < t->numel; k++) f[k] *= sv[k / (rows * cols)];
        }
        /* llama: q/k rows back in HF's order */
        int64_t heads = 0;
        if (!strcmp(c.arch, "llama") && strstr(t->name, ".attn_q.")) heads = c.H;
        if (!strcmp(c.arch, "llama") && strstr(t->name, ".attn_k.")) heads = c.KV;
        if (heads > 0) {
            int64_t per = t->n_dims == 1 ? 1 : cols;   /* biases: one value per row */
            int64_t R = t->n_dims == 1 ? t->numel : rows, hd = R / heads;
            float *tmp = mq_alloc_array((size_t)t->numel, sizeof(float), t->name);
            if (!tmp) {
                mq_free(f);
                s = MOEQ_E_NOMEM;
                break;
            }
            for (int64_t gr = 0; gr < R; gr++) {
                int64_t h = gr / hd, k = gr % hd, hr = h * hd + (k % 2) * (hd / 2) + k / 2;
                memcpy(tmp + hr * per, f + gr * per, (size_t)per * sizeof(float));
            }
            mq_free(f);
            f = tmp;
        }
        if (!stacked) {
            int64_t shape[2] = {rows, cols};
            int nd = t->n_dims == 1 ? 1 : 2;
            if (t->n_dims == 1) shape[0] = cols;
            if (strstr(t->name, "ffn_gate_inp_shexp")) nd = 2, shape[0] = 1, shape[1] = cols;   /* HF [1, D] */
            s = mq_stw_add_owned(w, hn, MOEQ_DT_F32, nd, shape, f, (size_t)t->numel * sizeof(float));
            continue;
        }
        for (int64_t e = 0; !s && e < E; e++) {
            hf_name(&c, t->name, e, hn, sizeof hn, &stacked);
            int64_t shape[2] = {rows, cols};
            s = mq_stw_add(w, hn, MOEQ_DT_F32, 2, shape, f + e * rows * cols, (size_t)(rows * cols) * sizeof(float));
        }
        mq_free(f);
    }
    if (s) goto done;
    if (mkdir(out_dir, 0755) != 0 && !mq_dir_exists(out_dir)) {
        s = mq_err(MOEQ_E_IO, "%s: cannot create the directory", out_dir);
        goto done;
    }
    if (!(p = mq_path_join(out_dir, "model.safetensors"))) {
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    if ((s = mq_stw_write(w, p))) goto done;
    const char *names[3] = {"config.json", "tokenizer.json", "gguf_types.json"};
    cJSON *docs[3] = {cfg, tok, types};
    for (int i = 0; !s && i < 3; i++) {
        char *text = cJSON_Print(docs[i]);
        char *fp = mq_path_join(out_dir, names[i]);
        s = text && fp ? mq_write_file_atomic(fp, text, strlen(text)) : mq_err(MOEQ_E_NOMEM, "out of memory");
        free(text);
        free(fp);
    }
done:
    free(p);
    mq_stw_free(w);
    cJSON_Delete(cfg);
    cJSON_Delete(tok);
    cJSON_Delete(types);
    mq_gguf_close(g);
    return s;
}
