/*
 * The parts of the checkpoint -> GGUF converter its files share (gguf_export.h is the interface):
 * gguf_export_config.c reads the architecture from config.json, gguf_export_vocab.c the
 * tokenizer, gguf_export_recipe.c picks the K-quant mixtures' types, gguf_export.c plans and
 * writes the tensors.
 */
#ifndef MOEQ_EXPORT_GGUF_EXPORT_INTERNAL_H
#define MOEQ_EXPORT_GGUF_EXPORT_INTERNAL_H

#include "export/gguf_export.h"

typedef struct {
    const char *arch;          /* llama.cpp's: llama, olmoe, qwen2moe, qwen3moe, deepseek2 */
    const char *model_type;
    bool mixtral, permute_qk;
    int64_t D, L, H, KV, HD, FF, E, K, FF_EXP, FF_SH, ctx, vocab;
    double eps, theta;
    bool tie, norm_topk;
    /* deepseek2 (mla): latent widths, routing, YaRN */
    bool mla, interleave, yarn;
    int64_t q_lora, kv_lora, nope, rope, vhd, n_shared, first_dense, n_group, topk_group, mtp, yarn_orig;
    double routed_scale, yarn_factor, yarn_a, yarn_lm;   /* yarn_a, yarn_lm: yarn_kvs */
} arch_cfg;

/* A config.json member, NULL when absent or null. */
static inline const cJSON *item(const cJSON *c, const char *k) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(c, k);
    return x && !cJSON_IsNull(x) ? x : NULL;
}

static inline bool flag(const cJSON *c, const char *k, bool dflt) {
    const cJSON *x = item(c, k);
    return x && cJSON_IsBool(x) ? cJSON_IsTrue(x) : dflt;
}

/* config.json of a model: its architecture as llama.cpp's graph runs it, or a refusal naming the
 * difference (MOEQ_E_UNSUPPORTED / MOEQ_E_FORMAT). */
moeq_status mq_gguf_read_arch(const cJSON *c, const char *what, arch_cfg *a);
/* dir/name parsed (required: MOEQ_E_NOTFOUND when absent; else *out NULL then). */
moeq_status mq_gguf_read_json(const char *dir, const char *name, bool required, cJSON **out);

typedef struct {
    int64_t n;             /* entries: vocab_size (every id below it) */
    char **tok;
    size_t *len;
    int32_t *type;         /* 1 normal, 3 control, 4 user defined, 5 unused (padding) */
    char **merges;
    size_t *mlen;
    int64_t n_merges;
    const char *pre;
    int32_t bos, eos, pad; /* -1: none */
    bool add_bos;
} vocab;

/* The tokenizer of dir (tokenizer.json, or Kimi's tiktoken.model) as llama.cpp's gpt2 vocabulary
 * of vocab_size ids. */
moeq_status mq_gguf_read_vocab(const char *dir, const cJSON *cfg, int64_t vocab_size, vocab *v);
void mq_gguf_vocab_free(vocab *v);

#endif
