/*
 * A GGUF file read as a Hugging Face checkpoint, in place: what moeq_import_gguf writes out
 * (io/gguf_import.c) and what moeq_model_open reads directly (model/load.c) come from here,
 * so the two cannot drift apart.
 *
 *  - the names: llama.cpp's tensor names (blk.N.attn_q.weight, ...) to the hub's
 *    (model.layers.N.self_attn.q_proj.weight, ...) for llama, olmoe, qwen2moe, qwen3moe, Mixtral
 *    (llama with experts) and deepseek2 (as deepseek_v3);
 *  - the documents: config.json from the architecture's KVs (the routing llama.cpp's graphs
 *    hard-code: olmoe and qwen2moe never renormalise the top-k weights, qwen3moe and Mixtral do),
 *    tokenizer.json from tokenizer.ggml.* (gpt2 model, the pre-tokenizer tokenizer.ggml.pre
 *    names), gguf_types.json (each matrix's ggml type under its HF name: act_quant q8_0 rounds
 *    the inputs of exactly the Linears llama.cpp computes on Q8_0 activations);
 *  - the tensors: one mq_tensor_view per HF tensor, pointing into the mapped file. A stacked
 *    expert tensor [E, F, D] is E views (each expert is a contiguous slice); llama's q/k rows are
 *    un-permuted (HF row h*hd + j*hd/2 + i is GGUF row h*hd + 2i + j); NVFP4 is multiplied by
 *    its NAME.scale (F32 [1], or [E]: expert e's entry); deepseek2's kv_b_proj [H (nope + v),
 *    kv_lora] is merged from attn_k_b {nope, kv_lora, H} (transposed) and attn_v_b {kv_lora, v, H}
 *    (per head the nope rows, then the v rows). Nothing is decoded until a view is converted
 *    (mq_tensor_to_f32 / mq_tensor_range_to_f32), and then only the values asked for.
 *
 * Why here, in io: both model (the loader) and export (the importer) need this, and neither may
 * include the other; io is the floor below both. It is a translation between two containers'
 * metadata and layouts (names, shapes, row orders, the KVs into config.json's keys); what the
 * numbers mean stays with model's config parser, which reads the config.json made here like any
 * other.
 */
#ifndef MOEQ_IO_GGUF_HF_H
#define MOEQ_IO_GGUF_HF_H

#include <stdbool.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "core/core.h"
#include "io/gguf.h"
#include "io/safetensors.h"

/* How the values of a GGUF-backed mq_tensor_view (its .ggml) come out of the file. The view's
 * data/nbytes are the bytes of the (expert's) matrix, shape/numel its HF shape. */
typedef struct mq_ggml_view {
    uint32_t type;      /* MQ_GGML_* of the view's data */
    int64_t row;        /* values per row of the HF tensor (1 for a vector whose entries move) */
    int32_t perm_hd;    /* > 0: llama's q/k, rows in heads of perm_hd rotated as the header says */
    bool scaled;        /* values times scale (NVFP4's NAME.scale) */
    float scale;
    /* deepseek2's kv_b_proj (mla_heads > 0): the view's data is attn_k_b's, v_data attn_v_b's;
     * it converts only whole (mq_tensor_whole_only) */
    int32_t mla_heads, mla_nope, mla_v, mla_rank;
    const uint8_t *v_data;
    uint32_t v_type;
    bool v_scaled;
    float v_scale;
} mq_ggml_view;

/* What a GGUF gives besides its tensors (owned; NULL where not made). */
typedef struct {
    cJSON *config;      /* config.json */
    cJSON *tokenizer;   /* tokenizer.json (when asked for) */
    cJSON *types;       /* gguf_types.json */
} mq_gguf_docs;

void mq_gguf_docs_free(mq_gguf_docs *d);

/* Whether path is a GGUF file: a regular file whose name ends in .gguf or that starts with the
 * GGUF magic (a corrupt .gguf is still one, so that its reader names the problem). */
bool mq_is_gguf_file(const char *path);

/* Maps and parses path and builds its views and documents (tokenizer.json only when tokenizer).
 * The mq_st holds the mapping; its views are named and shaped as the hub's checkpoint of the
 * same model. Errors name the file and the KV or tensor: a corrupt or truncated file
 * MOEQ_E_FORMAT, an architecture, tokenizer or layout moeq does not read MOEQ_E_UNSUPPORTED. On
 * error nothing is left open and docs is zeroed. */
moeq_status mq_st_open_gguf(const char *path, bool tokenizer, mq_st **st, mq_gguf_docs *docs);

/* tokenizer.json of an opened GGUF (path names it in errors). */
moeq_status mq_gguf_hf_tokenizer(const mq_gguf *g, const char *path, cJSON **out);
/* The special ids config.json gets from tokenizer.ggml.* ({"bos_token_id": .., "eos_token_id":
 * .., "pad_token_id": ..}, those present) added to j. */
void mq_gguf_hf_special_ids(const mq_gguf *g, cJSON *j);

/* Values [k0, k1) (row-major, HF order) of a GGUF-backed view into out; a merged kv_b only whole.
 * mq_tensor_to_f32 / mq_tensor_range_to_f32 call this for views with .ggml set. */
moeq_status mq_ggml_view_to_f32(const mq_tensor_view *t, int64_t k0, int64_t k1, float *out);

/* tokenizer.json's Split regexes of Llama 3 ("llama-bpe") and Qwen2 ("qwen2"). */
extern const char mq_gguf_re_llama3[];
extern const char mq_gguf_re_qwen2[];
/* DeepSeek-V3's three Split regexes ("deepseek-v3"), CR and LF as characters */
extern const char *const mq_gguf_re_deepseek3[3];

#endif
