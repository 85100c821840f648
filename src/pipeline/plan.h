/*
 * The output plan of a quantization run, made from the source checkpoint's tensor list before
 * any weight is read: which tensors are decoder Linears (2D float "*.weight" under model.layers.,
 * plus fused expert tensors split per expert with the hub names), which of them are quantized
 * (routers, shared_expert_gate and --ignore matches stay unquantized; a vLLM fusion group —
 * q/k/v, gate/up, w1/w3 — is quantized all or nothing), which tensors pass through unchanged,
 * and every output tensor's name, dtype and shape in output order: the global tensors
 * (embeddings, final norm, lm_head) first, then layer by layer its pass-through tensors and its
 * Linears. The checkpoint writer lays its shards out from that list.
 *
 * An FP8 block-quantized source's F8_E4M3 weights are Linears like float ones (their
 * *.weight_scale_inv tensors are consumed, neither Linears nor passed through); what of them stays
 * unquantized is written as BF16 (see mq_out_plan.dq).
 */
#ifndef MOEQ_PIPELINE_PLAN_H
#define MOEQ_PIPELINE_PLAN_H

#include "export/layout.h"
#include "io/fp8.h"   /* FP8 block-quantized sources' weights */
#include "io/safetensors.h"

typedef struct {
    char *module;                 /* output module name (its tensors: module + ".weight", ...) */
    char *src_module;             /* the module as the source names it (Mixtral may differ) */
    const mq_tensor_view *src;
    int64_t offset;               /* first element inside src (fused experts) */
    int64_t rows, cols;
    int layer;                    /* -1: outside model.layers */
    bool quantize;
    bool user_ignored;
    int group;                    /* fusion group */
    mq_qspec spec;                /* quantize: its scheme (the run's, or its own type in a mixed
                                     K-quant file: mq_plan_opts.spec_for) */
} mq_plan_item;

typedef struct {
    char *name;                   /* output tensor name */
    const mq_tensor_view *src;
    int layer;                    /* -1: outside the decoder layers (MTP layers too) */
    bool raw;                     /* an MTP tensor: its bytes as the source has them */
} mq_plan_pass;

typedef struct {
    mq_ckpt_format format;
    mq_qspec spec;
    bool g_idx;                   /* quantized INT4 layouts carry g_idx (act-order groups) */
    bool input_scale;             /* W4A4: an activation scale per quantized Linear */
    const char *const *ignore;    /* PCRE2 patterns */
    int n_ignore;
    /* Multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers): the tensors of
     * model.layers.N for N >= mtp_from (> 0; 0 = none) are no Linears: they pass through
     * unchanged, FP8 ones with their scales (raw), among the global tensors, or with drop_mtp
     * are left out (n_mtp_dropped counts them). */
    int mtp_from;
    bool drop_mtp;
    /* A tied model rotated (model/rotate.h): lm_head.weight, absent from the source, is written
     * from the embeddings (its src the embeddings' view; the rotation makes it differ) */
    bool untie_lm_head;
    /* Each quantized Linear's own spec (NULL: every one spec): false keeps it unquantized */
    bool (*spec_for)(void *user, const mq_plan_item *it, mq_qspec *spec);
    void *spec_user;
} mq_plan_opts;

typedef struct {
    mq_plan_item *items;          /* in source name order */
    size_t n_items, cap_items;
    mq_plan_pass *pass;           /* in source name order */
    size_t n_pass, cap_pass;
    int n_groups;
    char **group_keys;
    int n_layers;                 /* 1 + the largest layer index seen */
    size_t *by_name;              /* item indices sorted by module name */
    mq_tensor_decl *decls;        /* every output tensor, in output order */
    char **decl_names;            /* owned names of decls */
    size_t n_decls, cap_decls;
    int64_t quantized_params;
    int n_mtp_pass, n_mtp_dropped;   /* MTP tensors passed through / left out */
    /* FP8 block-quantized sources (io/fp8.h): a tensor that is written unquantized (a router,
     * shared_expert_gate, an --ignore'd Linear, an FP8 lm_head) is written dequantized as BF16.
     * Its item's or pass-through's src is then one of these views (owned, BF16, in memory from
     * the plan on); dequant_bytes is their total size. Quantized FP8 items keep the source view,
     * which mq_tensor_to_f32 dequantizes. */
    mq_tensor_view **dq;
    size_t n_dq, cap_dq;
    int64_t dequant_bytes;
} mq_out_plan;

/* Builds the plan (mixtral: the source is a Mixtral checkpoint, whose MoE blocks are written
 * under block_sparse_moe). Bad ignore patterns, a Linear the scheme cannot hold (named, with the
 * advice to --ignore it): MOEQ_E_ARG / MOEQ_E_SHAPE. */
moeq_status mq_out_plan_build(const mq_st *st, bool mixtral, const mq_plan_opts *o,
                              mq_out_plan *p);
void mq_out_plan_free(mq_out_plan *p);
/* The item whose output or source module name is `module`; NULL when absent. */
const mq_plan_item *mq_out_plan_find(const mq_out_plan *p, const char *module);

/* The fusion group tag of a Linear leaf name ("q_proj" -> "qkv", "gate_proj"/"up_proj" ->
 * "gate_up", "w1"/"w3" -> "w13", "q_a_proj"/"kv_a_proj_with_mqa" -> "q_a"), or NULL. */
const char *mq_fusion_tag(const char *leaf);

#endif
