/*
 * A quantized checkpoint (compressed-tensors, ModelOpt or GPTQ v1 directory, or an unquantized
 * one) converted into one GGUF v3 file that llama.cpp loads: its architecture's KVs, tokenizer,
 * and tensors under llama.cpp's names, the quantized Linears re-blocked without requantizing
 * (INT4 symmetric -> Q4_0, asymmetric -> Q4_1, NVFP4 -> NVFP4 + NAME.scale). docs/gguf.md.
 */
#ifndef MOEQ_EXPORT_GGUF_EXPORT_H
#define MOEQ_EXPORT_GGUF_EXPORT_H

#include <cjson/cJSON.h>

#include "formats/formats.h"
#include "io/gguf_hf.h"
#include "io/gguf_import.h"

/* Storage of the unquantized 2-D tensors (embeddings, lm_head, kept Linears); 1-D tensors
 * (norms, biases) and routers are always F32. */
typedef enum {
    MQ_GGUF_REST_AUTO = 0,   /* the source dtype (F32, F16 or BF16; other dtypes F32) */
    MQ_GGUF_REST_F32,
    MQ_GGUF_REST_F16,
    MQ_GGUF_REST_BF16,
    MQ_GGUF_REST_Q8_0,
} mq_gguf_rest;

/* Parses "auto", "f32", "f16", "bf16", "q8_0". */
bool mq_gguf_rest_parse(const char *s, mq_gguf_rest *out);

/* ---- K-quant files: which tensor gets which of llama.cpp's block types (gguf_export_recipe.c) */

/* llama.cpp's categories of tensors (llama-quant.cpp's tensor_category), and a shared expert's
 * gate, up and down apart from the routed experts' (llama.cpp's ffn_*_shexp: its rules give them
 * their role's type, --target-bpw may choose another). */
typedef enum {
    MQ_GCAT_OTHER = 0, MQ_GCAT_TOKEN_EMBD, MQ_GCAT_OUTPUT, MQ_GCAT_ATTN_Q, MQ_GCAT_ATTN_K,
    MQ_GCAT_ATTN_V, MQ_GCAT_ATTN_OUTPUT, MQ_GCAT_FFN_GATE, MQ_GCAT_FFN_UP, MQ_GCAT_FFN_DOWN,
    MQ_GCAT_FFN_GATE_SHEXP, MQ_GCAT_FFN_UP_SHEXP, MQ_GCAT_FFN_DOWN_SHEXP,
    MQ_GCAT_COUNT
} mq_gguf_cat;

typedef struct {
    mq_kq_type base;       /* the file type's default: Q3_K, Q4_K, Q5_K or Q6_K */
    bool mixture;          /* llama.cpp's rules of its _M file types (Q6_K: its own); false: every
                              decoder Linear base, token_embd and output as --gguf-rest says */
    int n_layers, n_experts;
    bool tied;             /* no lm_head: token_embd is the output too */
    /* chosen types (--target-bpw): [n_layers][MQ_GCAT_COUNT], then token_embd and output; a
     * type, or -1 where the rules decide. NULL: the rules alone */
    const int8_t *table;
    int n_gqa;             /* query heads per KV head (llama.cpp's n_gqa) */
} mq_gguf_recipe;

/* A recipe for the model of config.json (what: its path for messages): its layers, experts and
 * whether its output is token_embd; no table. */
moeq_status mq_gguf_recipe_init(mq_gguf_recipe *r, const cJSON *config, const char *what,
                                mq_kq_type base, bool mixture);

/* The category and layer (-1: none) of a Hugging Face module name (model.layers.3.self_attn.v_proj,
 * ...mlp.experts.5.down_proj, ...block_sparse_moe.experts.1.w2, lm_head, model.embed_tokens). */
mq_gguf_cat mq_gguf_category_hf(const char *module, int *layer);
const char *mq_gguf_cat_name(mq_gguf_cat c);
/* The block type (mq_kq_type) of a tensor of category cat in layer `layer` whose rows have cols
 * values, or -1: not quantized (token_embd and output of a recipe without a mixture: --gguf-rest;
 * rows that no 32-value block divides). */
int mq_gguf_recipe_type(const mq_gguf_recipe *r, mq_gguf_cat cat, int layer, int64_t cols);
/* llama.cpp's fallback of type t (an mq_kq_type) for rows of cols values (Q3_K -> Q4_0, Q4_K ->
 * Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 where 256 does not divide them; -1, F16, where 32 does not). */
int mq_gguf_fallback(int t, int64_t cols);
/* general.file_type for the recipe (llama.cpp's LLAMA_FTYPE numbers; 1024 "guessed" for a table). */
uint32_t mq_gguf_recipe_ftype(const mq_gguf_recipe *r);

/* The model (its config.json, parsed) can be written as GGUF with weights of `scheme`
 * (MQ_QS_NONE: unquantized) and llama.cpp computes what moeq computes: otherwise MOEQ_E_ARG /
 * MOEQ_E_UNSUPPORTED saying why (an architecture llama.cpp has not, NVFP4 where its graph ignores
 * the global scale, a routing llama.cpp hard-codes otherwise, W4A4, rope scaling, ...). */
moeq_status mq_gguf_check_config(const cJSON *config, const char *what, mq_qscheme scheme,
                                 bool act_quant);
/* The same from a model directory. */
moeq_status mq_gguf_check_model(const char *model_dir, mq_qscheme scheme, bool act_quant);

/* Converts the checkpoint directory ckpt_dir into out_path (written as a temporary file in the
 * same directory and renamed when complete; nothing is left on error). Memory: one Linear (one
 * expert of a stacked tensor) at a time. */
moeq_status mq_gguf_export(const char *ckpt_dir, const char *out_path, mq_gguf_rest rest);
/* The same for a checkpoint whose Linears hold llama.cpp's block types: recipe (may be NULL)
 * gives token_embd and output their types (rounded to nearest, moeq's block search), as the
 * Linears' were chosen. */
moeq_status mq_gguf_export_recipe(const char *ckpt_dir, const char *out_path, mq_gguf_rest rest,
                                  const mq_gguf_recipe *recipe);
/* The same with every quantized Linear dequantized (mq_load_linear_weight's fp32 values) and
 * stored as rest says (auto: F32): the same model without llama.cpp's quantized kernels, for
 * checking a quantized file against it. */
moeq_status mq_gguf_export_dequantized(const char *ckpt_dir, const char *out_path, mq_gguf_rest rest);

/* The reverse, a GGUF file written out as a checkpoint directory: io/gguf_import.h. */

/* The tokenizer regexes (mq_gguf_re_llama3, mq_gguf_re_qwen2, mq_gguf_re_deepseek3) are io's,
 * shared with the reader: io/gguf_hf.h. */

#endif
