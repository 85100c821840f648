/*
 * A GGUF file read as a Hugging Face checkpoint (gguf_hf.h): the architecture's KVs into
 * config.json, tokenizer.ggml.* into tokenizer.json, llama.cpp's tensor names into the hub's, and
 * views that decode the file's blocks in place.
 *
 * deepseek2 (llama.cpp's DeepSeek-V3 / Kimi K2 layout, models/deepseek2.cpp) reads as
 * deepseek_v3: attn_k_b {nope, kv_lora, H} and attn_v_b {kv_lora, v, H} become kv_b_proj (per
 * head the nope rows, k_b transposed, then the v rows); rope_interleave true, since llama.cpp
 * rotates adjacent pairs (a checkpoint written without it comes back with its rotary rows in that
 * order, the same function); the routing from the expert_* KVs; YaRN's cos/sin factor and softmax
 * scale as llama.cpp derives them from rope.scaling.attn_factor and yarn_log_multiplier.
 * kv_b_proj's entry in gguf_types.json names both types ("f32+q4_0"), which act_quant q8_0 does
 * not round: llama.cpp's Q8_0 rounding there falls on q_nope and on the attention's latent
 * output, inside the absorbed attention, not on kv_b's input.
 */
#include "io/gguf_hf.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "io/tokenizer.h"

/* ---- the tokenizer's regexes ----------------------------------------------------------------- */

/* The regexes of the Split pre-tokenizers llama.cpp knows by name (tokenizer.json's spelling). */
const char mq_gguf_re_llama3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char mq_gguf_re_qwen2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* DeepSeek-V3's three Splits (llama.cpp's "deepseek-v3", llama-vocab.cpp): digits in threes,
 * runs of CJK ideographs and kana, then words, punctuation and spaces; CR and LF as characters. */
const char *const mq_gguf_re_deepseek3[3] = {
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
     " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),   /* one pattern, two lines */
};

/* ---- the architecture -------------------------------------------------------------------------- */

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
    mq_gguf_hf_special_ids(g, j);
    return j;
}

void mq_gguf_hf_special_ids(const mq_gguf *g, cJSON *j) {
    uint32_t id;
    if (!mq_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &id)) cJSON_AddNumberToObject(j, "bos_token_id", id);
    if (!mq_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &id)) cJSON_AddNumberToObject(j, "eos_token_id", id);
    if (!mq_gguf_get_u32(g, "tokenizer.ggml.padding_token_id", &id)) cJSON_AddNumberToObject(j, "pad_token_id", id);
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
moeq_status mq_gguf_hf_tokenizer(const mq_gguf *g, const char *path, cJSON **out) {
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
    if (!toks || toks->type != MQ_GGUF_ARRAY || toks->arr_type != MQ_GGUF_STRING)
        return mq_err(MOEQ_E_FORMAT, "%s: no tokenizer.ggml.tokens string array", path);
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
        if (!name) {
            cJSON_Delete(t);
            return mq_err(MOEQ_E_NOMEM, "%s: out of memory rebuilding the tokenizer", path);
        }
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
        if (!x) {
            cJSON_Delete(t);
            return mq_err(MOEQ_E_NOMEM, "%s: out of memory rebuilding the tokenizer", path);
        }
        cJSON_AddItemToArray(mer, cJSON_CreateString(x));
        free(x);
    }
    /* cJSON's adders return NULL without failing the document: a lost entry shows here */
    if (!added || !model || !vocab || !mer || cJSON_GetArraySize(mer) != (int)merges->n) {
        cJSON_Delete(t);
        return mq_err(MOEQ_E_NOMEM, "%s: out of memory rebuilding the tokenizer", path);
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

/* ---- the views ---------------------------------------------------------------------------------- */

/* What an opened GGUF's views point into: the mapped file and their decode descriptions. */
typedef struct {
    mq_gguf *g;
    mq_ggml_view *gv;
} gguf_owner;

static void owner_free(void *p) {
    gguf_owner *o = p;
    if (!o) return;
    mq_gguf_close(o->g);
    free(o->gv);
    free(o);
}

bool mq_is_gguf_file(const char *path) {
    struct stat sb;
    if (!path || stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) return false;
    size_t n = strlen(path);
    if (n > 5 && !strcmp(path + n - 5, ".gguf")) return true;
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    char magic[4] = {0};
    size_t got = fread(magic, 1, 4, f);
    fclose(f);
    return got == 4 && !memcmp(magic, "GGUF", 4);
}

void mq_gguf_docs_free(mq_gguf_docs *d) {
    if (!d) return;
    cJSON_Delete(d->config);
    cJSON_Delete(d->tokenizer);
    cJSON_Delete(d->types);
    memset(d, 0, sizeof *d);
}

/* The dtype a view reports: the float types as themselves, blocks as bytes. */
static moeq_dtype view_dtype(uint32_t type) {
    return type == MQ_GGML_F32 ? MOEQ_DT_F32 : type == MQ_GGML_F16 ? MOEQ_DT_F16 : type == MQ_GGML_BF16 ? MOEQ_DT_BF16 : MOEQ_DT_U8;
}

/* NAME.scale of a NAME.weight (NVFP4's global multiplier, one F32 per matrix: E of them); *sc
 * NULL when there is none. */
static moeq_status find_scale(const mq_gguf *g, const char *path, const mq_gguf_tensor *t, int64_t E,
                              const mq_gguf_tensor **sc) {
    *sc = NULL;
    size_t nl = strlen(t->name);
    if (nl <= 7 || strcmp(t->name + nl - 7, ".weight")) return MOEQ_OK;
    char *sname = mq_asprintf("%.*s.scale", (int)(nl - 7), t->name);
    if (!sname) return mq_err(MOEQ_E_NOMEM, "out of memory");
    const mq_gguf_tensor *s = mq_gguf_find_tensor(g, sname);
    moeq_status st = MOEQ_OK;
    if (s && (s->numel != E || s->type != MQ_GGML_F32))
        st = mq_err(MOEQ_E_FORMAT, "%s: '%s' has %lld values of type %u for %lld matrices (one F32 each)", path, sname,
                    (long long)s->numel, s->type, (long long)E);
    free(sname);
    if (!st) *sc = s;
    return st;
}

static float scale_at(const mq_gguf_tensor *sc, int64_t e) {
    float v = 0;
    mq_ggml_dequantize(MQ_GGML_F32, sc->data + 4 * e, 1, &v);   /* F32, checked by find_scale */
    return v;
}

/* How a GGUF tensor reads: not at all (a scale applied to its weight, an activation scale, a
 * multi-token-prediction layer, attn_v_b merged into attn_k_b's view), as one HF tensor, as E
 * experts, or as deepseek2's merged kv_b_proj. */
typedef enum { T_SKIP, T_ONE, T_STACKED, T_KV_B } tkind;

static moeq_status classify(const gcfg *c, const char *path, const mq_gguf_tensor *t, tkind *k, int *layer) {
    size_t nl = strlen(t->name);
    *k = T_SKIP;
    *layer = -1;
    if ((nl > 6 && !strcmp(t->name + nl - 6, ".scale")) || (nl > 12 && !strcmp(t->name + nl - 12, ".input_scale")))
        return MOEQ_OK;   /* applied to its weight; activation scales are llama.cpp's business */
    int l = -1, used = 0;
    if (sscanf(t->name, "blk.%d.%n", &l, &used) == 1 && used > 0) *layer = l;
    if (c->mla && l >= 0) {
        if (l >= (int)c->L) return MOEQ_OK;   /* the MTP layers (nextn_predict_layers): not run */
        if (!strcmp(t->name + used, "attn_v_b.weight")) return MOEQ_OK;
        if (!strcmp(t->name + used, "attn_k_b.weight")) {
            *k = T_KV_B;
            return MOEQ_OK;
        }
    }
    char hn[300];
    bool stacked;
    if (!hf_name(c, t->name, 0, hn, sizeof hn, &stacked))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: tensor '%s' has no place in a %s model moeq runs", path, t->name, c->arch);
    if (t->n_dims > (stacked ? 3u : 2u))
        return mq_err(MOEQ_E_SHAPE, "%s: tensor '%s' has %u dimensions (a %s has %d)", path, t->name, t->n_dims,
                      stacked ? "stack of experts" : "matrix", stacked ? 3 : 2);
    *k = stacked ? T_STACKED : T_ONE;
    return MOEQ_OK;
}

static moeq_status add_type(cJSON *types, const char *name, const char *type) {
    return cJSON_AddStringToObject(types, name, type) ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory");
}

/* kv_b_proj [H * (nope + v), kv_lora] of layer l as a view over attn_k_b {nope, kv_lora, H} and
 * attn_v_b {kv_lora, v, H}; its gguf_types.json entry names both types. */
static moeq_status kv_b_view(const mq_gguf *g, const char *path, const gcfg *c, const mq_gguf_tensor *kb, int l,
                             mq_tensor_view *v, mq_ggml_view *gv, cJSON *types) {
    char vn[96], hn[128];
    snprintf(vn, sizeof vn, "blk.%d.attn_v_b.weight", l);
    const mq_gguf_tensor *vb = mq_gguf_find_tensor(g, vn);
    const int64_t nope = c->nope, r = c->kv_lora, vd = c->vhd, H = c->H, hb = nope + vd;
    if (!vb) return mq_err(MOEQ_E_FORMAT, "%s: '%s' without '%s'", path, kb->name, vn);
    if (kb->n_dims != 3 || kb->ne[0] != nope || kb->ne[1] != r || kb->ne[2] != H || vb->n_dims != 3 ||
        vb->ne[0] != r || vb->ne[1] != vd || vb->ne[2] != H)
        return mq_err(MOEQ_E_SHAPE, "%s: '%s' / '%s' are not {%lld, %lld, %lld} / {%lld, %lld, %lld}", path, kb->name,
                      vn, (long long)nope, (long long)r, (long long)H, (long long)r, (long long)vd, (long long)H);
    const mq_gguf_tensor *sk, *sv;
    moeq_status s;
    if ((s = find_scale(g, path, kb, 1, &sk)) || (s = find_scale(g, path, vb, 1, &sv))) return s;
    const char *tk = NULL, *tv = NULL;
    mq_ggml_type_info(kb->type, &tk, NULL, NULL);
    mq_ggml_type_info(vb->type, &tv, NULL, NULL);
    char both[64];
    snprintf(both, sizeof both, "%s+%s", tk, tv);
    snprintf(hn, sizeof hn, "model.layers.%d.self_attn.kv_b_proj.weight", l);
    if ((s = add_type(types, hn, both))) return s;
    *gv = (mq_ggml_view){.type = kb->type, .row = r, .scaled = sk != NULL, .scale = sk ? scale_at(sk, 0) : 1.0f,
                         .mla_heads = (int32_t)H, .mla_nope = (int32_t)nope, .mla_v = (int32_t)vd,
                         .mla_rank = (int32_t)r, .v_data = vb->data, .v_type = vb->type, .v_scaled = sv != NULL,
                         .v_scale = sv ? scale_at(sv, 0) : 1.0f};
    if (!(v->name = mq_strdup(hn))) return mq_err(MOEQ_E_NOMEM, "out of memory");
    v->dtype = view_dtype(kb->type);
    v->ndim = 2;
    v->shape[0] = H * hb;
    v->shape[1] = r;
    v->numel = H * hb * r;
    v->data = kb->data;
    v->nbytes = kb->nbytes;
    v->ggml = gv;
    return MOEQ_OK;
}

/* The views of tensor t (one, or one per expert) from v / gv on; *n: how many were made. */
static moeq_status tensor_views(const mq_gguf *g, const char *path, const gcfg *c, bool tied, const mq_gguf_tensor *t,
                                bool stacked, mq_tensor_view *v, mq_ggml_view *gv, cJSON *types, size_t *n) {
    *n = 0;
    const int64_t E = stacked ? t->ne[2] : 1, rows = t->n_dims >= 2 ? t->ne[1] : 1, cols = t->ne[0];
    const char *tname = NULL;
    int64_t blk;
    size_t bb;
    mq_ggml_type_info(t->type, &tname, &blk, &bb);   /* known: the reader checked it */
    moeq_status s = MOEQ_OK;
    char hn[300];
    for (int64_t e = 0; !s && t->n_dims >= 2 && e < E; e++) {
        hf_name(c, t->name, e, hn, sizeof hn, &stacked);
        s = add_type(types, hn, tname);
        if (!s && tied && !strcmp(t->name, "token_embd.weight")) s = add_type(types, "lm_head.weight", tname);
    }
    const mq_gguf_tensor *sc = NULL;
    if (!s) s = find_scale(g, path, t, E, &sc);
    if (s) return s;
    /* llama: q/k rows back in HF's order */
    int64_t heads = 0;
    if (!strcmp(c->arch, "llama") && strstr(t->name, ".attn_q.")) heads = c->H;
    if (!strcmp(c->arch, "llama") && strstr(t->name, ".attn_k.")) heads = c->KV;
    const int64_t R = t->n_dims == 1 ? t->numel : rows;   /* biases: one value per row */
    if (heads > 0 && (R % heads || (R / heads) % 2))
        return mq_err(MOEQ_E_SHAPE, "%s: tensor '%s': %lld rows are not %lld heads of an even size", path, t->name,
                      (long long)R, (long long)heads);
    const size_t mat_bytes = (size_t)(rows * cols / blk) * bb;
    for (int64_t e = 0; e < E; e++) {
        mq_tensor_view *x = &v[e];
        mq_ggml_view *y = &gv[e];
        hf_name(c, t->name, e, hn, sizeof hn, &stacked);
        if (!(x->name = mq_strdup(hn))) return mq_err(MOEQ_E_NOMEM, "out of memory");
        (*n)++;
        *y = (mq_ggml_view){.type = t->type, .row = t->n_dims == 1 ? 1 : cols, .perm_hd = (int32_t)(heads ? R / heads : 0),
                            .scaled = sc != NULL, .scale = sc ? scale_at(sc, e) : 1.0f};
        x->dtype = view_dtype(t->type);
        if (t->n_dims == 1) {
            x->ndim = 1;
            x->shape[0] = cols;
        } else {
            x->ndim = 2;
            x->shape[0] = rows;
            x->shape[1] = cols;
        }
        if (strstr(t->name, "ffn_gate_inp_shexp") && rows == 1) {   /* HF [1, D] */
            x->ndim = 2;
            x->shape[0] = 1;
            x->shape[1] = cols;
        }
        x->numel = rows * cols;
        x->data = t->data + (size_t)e * mat_bytes;
        x->nbytes = mat_bytes;
        x->ggml = y;
    }
    return MOEQ_OK;
}

moeq_status mq_st_open_gguf(const char *path, bool tokenizer, mq_st **out, mq_gguf_docs *docs) {
    *out = NULL;
    memset(docs, 0, sizeof *docs);
    gguf_owner *o = calloc(1, sizeof *o);
    if (!o) return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status s = mq_gguf_open(path, &o->g);
    if (s) {
        free(o);
        return s;
    }
    const mq_gguf *g = o->g;
    mq_tensor_view *v = NULL;
    size_t nv = 0, cap = 0;
    gcfg c;
    if ((s = read_cfg(g, path, &c))) goto fail;
    if (tokenizer && (s = mq_gguf_hf_tokenizer(g, path, &docs->tokenizer))) goto fail;
    bool tied = !mq_gguf_find_tensor(g, "output.weight");
    if (!(docs->config = make_config(&c, g, tied)) || !(docs->types = cJSON_CreateObject())) {
        s = mq_err(MOEQ_E_NOMEM, "%s: out of memory", path);
        goto fail;
    }
    /* two passes: count the views (a stack of experts makes one each), then make them */
    for (size_t i = 0; i < mq_gguf_tensor_count(g); i++) {
        const mq_gguf_tensor *t = mq_gguf_tensor_at(g, i);
        tkind k;
        int l;
        if ((s = classify(&c, path, t, &k, &l))) goto fail;
        cap += k == T_SKIP ? 0 : k == T_STACKED ? (size_t)t->ne[2] : 1;
    }
    v = calloc(cap ? cap : 1, sizeof *v);
    o->gv = calloc(cap ? cap : 1, sizeof *o->gv);
    if (!v || !o->gv) {
        s = mq_err(MOEQ_E_NOMEM, "%s: out of memory for %zu tensor views", path, cap);
        goto fail;
    }
    for (size_t i = 0; i < mq_gguf_tensor_count(g); i++) {
        const mq_gguf_tensor *t = mq_gguf_tensor_at(g, i);
        tkind k;
        int l;
        classify(&c, path, t, &k, &l);   /* as in the first pass */
        size_t n = 0;
        if (k == T_KV_B) {
            s = kv_b_view(g, path, &c, t, l, &v[nv], &o->gv[nv], docs->types);
            n = v[nv].name != NULL;
        } else if (k != T_SKIP) {
            s = tensor_views(g, path, &c, tied, t, k == T_STACKED, &v[nv], &o->gv[nv], docs->types, &n);
        }
        nv += n;
        if (s) goto fail;
    }
    /* the views now belong to the handle (freed with it, also when it fails) */
    s = mq_st_from_views(path, v, nv, o, owner_free, out);
    if (s) mq_gguf_docs_free(docs);
    return s;
fail:
    for (size_t i = 0; i < nv; i++) free((char *)v[i].name);
    free(v);
    owner_free(o);
    mq_gguf_docs_free(docs);
    return s;
}

/* ---- decoding ------------------------------------------------------------------------------- */

/* Values [e0, e0 + n) of contiguous ggml data of `type` into out: F32/F16/BF16 through
 * mq_tensor_to_f32 (its vector paths give the decoder's bits), blocks whole where they fit and
 * the partial ones at the ends through one block on the stack. */
static moeq_status ggml_run(uint32_t type, const uint8_t *data, int64_t e0, int64_t n, float *out) {
    if (n <= 0) return MOEQ_OK;
    if (type == MQ_GGML_F32 || type == MQ_GGML_F16 || type == MQ_GGML_BF16) {
        mq_tensor_view p;
        memset(&p, 0, sizeof p);
        p.name = "(ggml)";
        p.dtype = view_dtype(type);
        const size_t es = moeq_dtype_size(p.dtype);
        p.ndim = 1;
        p.shape[0] = p.numel = n;
        p.data = data + (size_t)e0 * es;
        p.nbytes = (size_t)n * es;
        return mq_tensor_to_f32(&p, out);
    }
    int64_t blk;
    size_t bb;
    if (!mq_ggml_type_info(type, NULL, &blk, &bb) || blk > 256)
        return mq_err(MOEQ_E_FORMAT, "ggml type %u cannot be decoded", type);
    float tmp[256];
    int64_t b = e0 / blk, off = e0 % blk;
    moeq_status s;
    if (off) {
        if ((s = mq_ggml_dequantize(type, data + (size_t)b * bb, blk, tmp))) return s;
        const int64_t k = n < blk - off ? n : blk - off;
        memcpy(out, tmp + off, (size_t)k * sizeof(float));
        out += k, n -= k, b++;
    }
    const int64_t whole = n / blk;
    if (whole) {
        if ((s = mq_ggml_dequantize(type, data + (size_t)b * bb, whole * blk, out))) return s;
        out += whole * blk, n -= whole * blk, b += whole;
    }
    if (n) {
        if ((s = mq_ggml_dequantize(type, data + (size_t)b * bb, blk, tmp))) return s;
        memcpy(out, tmp, (size_t)n * sizeof(float));
    }
    return MOEQ_OK;
}

static void scale_values(float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

/* deepseek2's kv_b_proj whole: per head, attn_k_b's [kv_lora][nope] block decoded and transposed
 * into the nope rows, then attn_v_b's v rows of kv_lora values each. */
static moeq_status kv_b_to_f32(const mq_tensor_view *t, float *out) {
    const mq_ggml_view *g = t->ggml;
    const int64_t H = g->mla_heads, nope = g->mla_nope, vd = g->mla_v, r = g->mla_rank, hb = nope + vd;
    float *kb = mq_alloc_array((size_t)(r * nope), sizeof(float), "attn_k_b of one head");
    if (!kb) return MOEQ_E_NOMEM;
    moeq_status s = MOEQ_OK;
    for (int64_t h = 0; h < H && !s; h++) {
        if ((s = ggml_run(g->type, t->data, h * r * nope, r * nope, kb))) break;
        if (g->scaled) scale_values(kb, r * nope, g->scale);
        for (int64_t c = 0; c < r; c++)
            for (int64_t i = 0; i < nope; i++) out[(h * hb + i) * r + c] = kb[c * nope + i];
        for (int64_t j = 0; j < vd && !s; j++) {
            float *row = out + (h * hb + nope + j) * r;
            if (!(s = ggml_run(g->v_type, g->v_data, (h * vd + j) * r, r, row)) && g->v_scaled)
                scale_values(row, r, g->v_scale);
        }
    }
    mq_free(kb);
    return s;
}

moeq_status mq_ggml_view_to_f32(const mq_tensor_view *t, int64_t k0, int64_t k1, float *out) {
    const mq_ggml_view *g = t->ggml;
    const char *file = t->file ? t->file : "GGUF";
    if (k0 < 0 || k1 < k0 || k1 > t->numel)
        return mq_err(MOEQ_E_ARG, "%s: tensor '%s': values [%lld, %lld) of %lld", file, t->name, (long long)k0,
                      (long long)k1, (long long)t->numel);
    if (g->mla_heads > 0 && (k0 != 0 || k1 != t->numel))
        return mq_err(MOEQ_E_ARG, "%s: tensor '%s' is merged from attn_k_b and attn_v_b and converts only whole",
                      file, t->name);
    moeq_status s = MOEQ_OK;
    if (g->mla_heads > 0) {
        s = kv_b_to_f32(t, out);   /* scales its two parts itself */
    } else if (!g->perm_hd) {
        s = ggml_run(g->type, t->data, k0, k1 - k0, out);
    } else {
        /* HF row h*hd + j*hd/2 + i is GGUF row h*hd + 2i + j: a row (or its part) at a time */
        const int64_t row = g->row, hd = g->perm_hd, half = hd / 2;
        for (int64_t k = k0; k < k1 && !s;) {
            const int64_t r = k / row, c = k % row, len = row - c < k1 - k ? row - c : k1 - k;
            const int64_t i = r % hd, src = r - i + 2 * (i % half) + i / half;
            s = ggml_run(g->type, t->data, src * row + c, len, out + (k - k0));
            k += len;
        }
    }
    /* the importer's order: decoded, then times the scale (one product a value, so the same bits) */
    if (!s && g->scaled && g->mla_heads == 0) scale_values(out, k1 - k0, g->scale);
    return s ? mq_err_prefix(s, "%s: tensor '%s'", file, t->name) : MOEQ_OK;
}
