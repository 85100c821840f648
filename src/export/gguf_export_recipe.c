/*
 * The ggml type of each tensor of a K-quant GGUF file. The mixtures are llama.cpp's
 * (src/llama-quant.cpp, llama_tensor_get_type_impl of the snapshot docs/results/gguf.md names):
 * a tensor's category from its name (attn_v, attn_k, attn_output, ffn_down, ...), its layer, the
 * model's expert count, and the file type's rules:
 *   output (and a tied token_embd):  Q6_K (Q8_0 where its rows are no whole 256-value blocks)
 *   attn_v   Q3_K_M: Q5_K in layers 0-1, else Q4_K; Q4_K_M, Q5_K_M: Q6_K where use_more_bits
 *   ffn_down Q3_K_M: Q5_K in the first L/16 layers, else Q4_K; Q4_K_M, Q5_K_M: Q6_K where
 *            use_more_bits
 *   attn_output  8 experts: Q5_K for Q3_K_M and Q4_K_M; else Q4_K for Q3_K_M
 *   attn_v, attn_k  8 experts: Q8_0 (every file type)
 *   IQ4_NL, IQ4_XS (llama.cpp's rules with an importance matrix, which moeq's GPTQ stands for):
 *            attn_v Q5_K where n_head / n_head_kv >= 4; attn_output Q5_K with 8 experts
 * use_more_bits(i, n) = i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2; then llama.cpp's shape
 * fallback where a row is no whole number of the type's blocks (Q3_K -> Q4_0, Q4_K -> Q5_0,
 * Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL; F16 where not even 32 divides it). --target-bpw replaces the rules
 * by a table of chosen types (pipeline/kquant_budget.c).
 */
#include <stdio.h>
#include <string.h>

#include "export/gguf_export_internal.h"
#include "formats/kquant.h"

moeq_status mq_gguf_recipe_init(mq_gguf_recipe *r, const cJSON *config, const char *what, mq_kq_type base,
                                bool mixture) {
    arch_cfg a;
    moeq_status s = mq_gguf_read_arch(config, what, &a);
    if (s) return s;
    *r = (mq_gguf_recipe){base, mixture, (int)a.L, (int)a.E, a.tie, NULL, a.KV > 0 ? (int)(a.H / a.KV) : 1};
    return MOEQ_OK;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !strcmp(s + n - m, suffix);
}

mq_gguf_cat mq_gguf_category_hf(const char *module, int *layer) {
    *layer = -1;
    if (!strcmp(module, "lm_head")) return MQ_GCAT_OUTPUT;
    if (!strncmp(module, "model.embed_tokens", 18)) return MQ_GCAT_TOKEN_EMBD;
    int l;
    if (sscanf(module, "model.layers.%d.", &l) != 1) return MQ_GCAT_OTHER;
    *layer = l;
    if (ends_with(module, ".self_attn.q_proj")) return MQ_GCAT_ATTN_Q;
    if (ends_with(module, ".self_attn.k_proj")) return MQ_GCAT_ATTN_K;
    if (ends_with(module, ".self_attn.v_proj")) return MQ_GCAT_ATTN_V;
    if (ends_with(module, ".self_attn.o_proj")) return MQ_GCAT_ATTN_OUTPUT;
    /* qwen2moe's mlp.shared_expert, deepseek's mlp.shared_experts */
    const int sh = strstr(module, ".shared_expert") ? MQ_GCAT_FFN_GATE_SHEXP - MQ_GCAT_FFN_GATE : 0;
    if (ends_with(module, "gate_proj") || ends_with(module, ".w1")) return (mq_gguf_cat)(MQ_GCAT_FFN_GATE + sh);
    if (ends_with(module, "up_proj") || ends_with(module, ".w3")) return (mq_gguf_cat)(MQ_GCAT_FFN_UP + sh);
    if (ends_with(module, "down_proj") || ends_with(module, ".w2")) return (mq_gguf_cat)(MQ_GCAT_FFN_DOWN + sh);
    return MQ_GCAT_OTHER;   /* deepseek2's q_a/q_b/kv_a/kv_b: none of llama.cpp's categories */
}

const char *mq_gguf_cat_name(mq_gguf_cat c) {
    static const char *const names[MQ_GCAT_COUNT] = {"other",     "token_embd", "output",         "attn_q",
                                                     "attn_k",    "attn_v",     "attn_output",    "ffn_gate",
                                                     "ffn_up",    "ffn_down",   "ffn_gate_shexp", "ffn_up_shexp",
                                                     "ffn_down_shexp"};
    return c >= 0 && c < MQ_GCAT_COUNT ? names[c] : "other";
}

static bool use_more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

/* llama.cpp's mixture for the file type whose default is base (Q3_K_M, Q4_K_M, Q5_K_M, Q6_K). */
static mq_kq_type mixture(const mq_gguf_recipe *r, mq_gguf_cat cat, int layer) {
    const mq_kq_type b = r->base;
    const bool k3 = b == MQ_KQ_Q3_K, k4 = b == MQ_KQ_Q4_K, k5 = b == MQ_KQ_Q5_K;
    const bool iq4 = b == MQ_KQ_IQ4_NL || b == MQ_KQ_IQ4_XS;
    const bool eight = r->n_experts == 8;
    if (cat >= MQ_GCAT_FFN_GATE_SHEXP) cat = (mq_gguf_cat)(cat - (MQ_GCAT_FFN_GATE_SHEXP - MQ_GCAT_FFN_GATE));
    switch (cat) {
    case MQ_GCAT_OUTPUT: return MQ_KQ_Q6_K;
    case MQ_GCAT_TOKEN_EMBD: return r->tied ? MQ_KQ_Q6_K : b;
    case MQ_GCAT_ATTN_V:
        if (eight) return MQ_KQ_Q8_0;   /* "bumping this to Q8_0 trades just ~128MB" */
        if (k3) return layer < 2 ? MQ_KQ_Q5_K : MQ_KQ_Q4_K;
        if (iq4 && r->n_gqa >= 4) return MQ_KQ_Q5_K;
        if ((k4 || k5) && use_more_bits(layer, r->n_layers)) return MQ_KQ_Q6_K;
        return b;
    case MQ_GCAT_ATTN_K: return eight ? MQ_KQ_Q8_0 : b;
    case MQ_GCAT_FFN_DOWN:
        if (k3) return layer < r->n_layers / 16 ? MQ_KQ_Q5_K : MQ_KQ_Q4_K;
        if ((k4 || k5) && use_more_bits(layer, r->n_layers)) return MQ_KQ_Q6_K;
        return b;
    case MQ_GCAT_ATTN_OUTPUT:
        if (eight) return k3 || k4 || iq4 ? MQ_KQ_Q5_K : b;
        return k3 ? MQ_KQ_Q4_K : b;
    default: return b;
    }
}

int mq_gguf_recipe_type(const mq_gguf_recipe *r, mq_gguf_cat cat, int layer, int64_t cols) {
    int t = -1;
    if (r->table && (cat == MQ_GCAT_TOKEN_EMBD || cat == MQ_GCAT_OUTPUT))
        t = r->table[(size_t)r->n_layers * MQ_GCAT_COUNT + (cat == MQ_GCAT_OUTPUT)];
    else if (r->table && layer >= 0 && layer < r->n_layers)
        t = r->table[(size_t)layer * MQ_GCAT_COUNT + cat];
    if (t < 0 && r->mixture) t = (int)mixture(r, cat, layer);
    if (t < 0 && !r->mixture && cat != MQ_GCAT_TOKEN_EMBD && cat != MQ_GCAT_OUTPUT) t = (int)r->base;
    if (t < 0) return -1;   /* as --gguf-rest says */
    /* llama.cpp's output rule: Q8_0 where the rows are no whole K-quant blocks */
    if (cat == MQ_GCAT_OUTPUT && cols % 256 && mq_kq_info_of((mq_kq_type)t)->block == 256) return MQ_KQ_Q8_0;
    return mq_gguf_fallback(t, cols);
}

int mq_gguf_fallback(int t, int64_t cols) {
    if (cols % mq_kq_info_of((mq_kq_type)t)->block) {   /* tensor_type_fallback */
        switch ((mq_kq_type)t) {
        case MQ_KQ_Q3_K: t = MQ_KQ_Q4_0; break;
        case MQ_KQ_Q4_K: t = MQ_KQ_Q5_0; break;
        case MQ_KQ_Q5_K: t = MQ_KQ_Q5_1; break;
        case MQ_KQ_Q6_K: t = MQ_KQ_Q8_0; break;
        case MQ_KQ_IQ4_XS: t = MQ_KQ_IQ4_NL; break;
        default: break;
        }
        if (cols % 32) return -1;   /* llama.cpp: F16 */
    }
    return t;
}

uint32_t mq_gguf_recipe_ftype(const mq_gguf_recipe *r) {
    if (r->table) return 1024;   /* LLAMA_FTYPE_GUESSED: no file type of llama.cpp's */
    switch (r->base) {   /* LLAMA_FTYPE_MOSTLY_*: the _M mixtures, or the pure types as their _S */
    case MQ_KQ_Q3_K: return r->mixture ? 12 : 11;
    case MQ_KQ_Q4_K: return r->mixture ? 15 : 14;
    case MQ_KQ_Q5_K: return r->mixture ? 17 : 16;
    case MQ_KQ_Q6_K: return 18;
    case MQ_KQ_IQ4_NL: return 25;   /* IQ4_NL and IQ4_XS: only mixtures in llama.cpp */
    case MQ_KQ_IQ4_XS: return 30;
    default: return 1024;
    }
}
