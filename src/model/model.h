/*
 * Model configuration, weights and the fp32 reference forward pass.
 *
 * Families: llama (dense), olmoe (q_norm/k_norm over the whole projection), qwen2_moe (q/k/v
 * bias, shared expert with sigmoid gate), qwen3_moe (per-head q/k norm), mixtral
 * (block_sparse_moe.experts.N.w1/w2/w3), deepseek_v3 / kimi_k2 (multi-head latent attention,
 * sigmoid group-limited routing with a selection bias, shared experts, dense first layers, YaRN).
 * Experts fused on disk (experts.gate_up_proj [E,2F,D], experts.down_proj [E,D,F]) are accepted
 * too.
 *
 * Dimension vocabulary: T tokens, D hidden, F ffn width, E experts, K top-k, V vocab.
 * Every weight matrix is [out, in] row-major, as on disk.
 */
#ifndef MOEQ_MODEL_H
#define MOEQ_MODEL_H

#include "core/core.h"
#include "io/safetensors.h"
#include "ckpt/source.h"

typedef enum {
    MQ_ARCH_LLAMA = 0,
    MQ_ARCH_OLMOE,
    MQ_ARCH_QWEN2_MOE,
    MQ_ARCH_QWEN3_MOE,
    MQ_ARCH_MIXTRAL,
    MQ_ARCH_DEEPSEEK_V3,   /* deepseek_v3 and kimi_k2 */
} mq_arch;

typedef enum {
    MQ_QKNORM_NONE = 0,
    MQ_QKNORM_FULL,   /* olmoe: RMSNorm over the whole q (H*hd) / k (KV*hd) projection */
    MQ_QKNORM_HEAD,   /* qwen3: RMSNorm over each head (hd) */
} mq_qknorm;

typedef struct {
    mq_arch arch;
    char model_type[32];
    int32_t vocab, D, n_layers, n_heads, n_kv_heads, head_dim;
    int32_t ffn;                 /* dense MLP width (llama; qwen2_moe mlp_only_layers) */
    int32_t n_experts, top_k, moe_ffn;
    bool norm_topk_prob;         /* renormalise the top-k routing weights */
    int32_t shared_ffn;          /* 0: no shared expert */
    bool shared_gate;            /* sigmoid(shared_expert_gate(x)) scales the shared expert */
    bool qkv_bias;               /* q/k/v_proj have a bias */
    bool o_bias;                 /* o_proj has a bias (llama/olmoe/qwen3 attention_bias) */
    bool mlp_bias;               /* dense gate/up/down have a bias (llama mlp_bias) */
    mq_qknorm qk_norm;
    float clip_qkv;              /* olmoe: clamp q/k/v to [-c, c] after the norms; 0 = off */
    float rms_eps;
    double rope_theta;
    int32_t max_pos;
    int32_t sliding_window;      /* window of the layers marked in layer_sliding (0: none) */
    bool tie_embeddings;
    int32_t bos, eos, pad;       /* -1 when absent; eos is the first of eos_ids */
    int32_t n_eos, eos_ids[8];   /* every id that ends generation (eos_token_id may be a list) */
    uint8_t *layer_is_moe;       /* [n_layers] */
    uint8_t *layer_sliding;      /* [n_layers]: 1 = sliding-window attention */
    char *quant_method;          /* quantization_config.quant_method, or NULL */
    char *quant_format;          /* quantization_config.format, or NULL ("e4m3" for FP8) */
    /* An FP8 block-quantized source (quant_method "fp8", io/fp8.h): weight_block_size; its
     * weights load dequantized to fp32, as an unquantized model's. 0 otherwise. */
    int32_t fp8_block_rows, fp8_block_cols;
    /* Multi-head latent attention (deepseek_v3): q = q_b(norm(q_a x)) (or q_proj x when
     * q_lora_rank is 0), [kv | k_rot] = kv_a x, [k_nope | v] per head = kv_b(norm(kv)); a head's
     * key is [k_nope, rope(k_rot)] with k_rot shared by all heads. head_dim is then
     * qk_nope + qk_rope (the q/k head), v_head_dim the value head; n_kv_heads == n_heads. */
    bool mla;
    int32_t q_lora_rank, kv_lora_rank, qk_nope, qk_rope;
    int32_t v_head_dim;          /* every family: the value head (== head_dim but for MLA) */
    int32_t rope_dim;            /* dimensions RoPE rotates per head (head_dim; MLA qk_rope) */
    bool rope_interleave;        /* MLA: rotary pairs (x0, x1), (x2, x3), ... instead of halves */
    /* YaRN RoPE (rope_type "yarn", deepseek_v3): inverse frequencies blended between
     * extrapolation and interpolation by factor, cos/sin scaled by rope_attn_factor. */
    bool yarn;
    double yarn_factor, yarn_beta_fast, yarn_beta_slow;
    int32_t yarn_orig_max_pos;
    bool yarn_truncate;
    double rope_attn_factor;     /* cos/sin multiplier (1 without YaRN) */
    double attn_scale;           /* softmax scale: 1/sqrt(head_dim), MLA YaRN times mscale^2 */
    /* Routing of deepseek_v3: sigmoid scores, the selection bias e_score_correction_bias (it
     * chooses, it never weights), experts in n_group groups of which the topk_group with the
     * largest sum of their two best biased scores are eligible, renormalised (norm_topk_prob,
     * + 1e-20) weights times routed_scale. Softmax families: sigmoid_router false, n_group 1,
     * routed_scale 1. */
    bool sigmoid_router, router_bias;
    int32_t n_group, topk_group;
    float routed_scale;
    int32_t n_mtp;               /* num_nextn_predict_layers: layers n_layers .. n_layers +
                                    n_mtp - 1 of the checkpoint (multi-token prediction), never
                                    run; passed through or dropped by the quantizer */
} mq_config;

/* Parses config.json text. Unknown model_type, missing or inconsistent fields: MOEQ_E_FORMAT or
 * MOEQ_E_UNSUPPORTED with a message naming the file and field(s). */
moeq_status mq_config_parse(const char *json, size_t len, const char *path, mq_config *out);
/* The same from config.json already parsed (root: its object; not modified). */
moeq_status mq_config_from_json(const cJSON *root, const char *path, mq_config *out);
/* Reads and parses MODEL_DIR/config.json (a missing directory or file is MOEQ_E_NOTFOUND). */
moeq_status mq_config_load(const char *dir, mq_config *out);
void mq_config_free(mq_config *c);
/* Supported model_type values, for messages: "llama, olmoe, qwen2_moe, qwen3_moe, mixtral,
 * deepseek_v3, kimi_k2". */
const char *mq_supported_model_types(void);
/* Parameter counts implied by the config (what an unquantized checkpoint holds; tied embeddings
 * counted once). active: what one token uses, i.e. the total less the routed experts outside the
 * top_k (embeddings and lm_head included, as model cards count them). */
void mq_config_param_counts(const mq_config *c, int64_t *total, int64_t *active);
/* FLOPs of one forward of T new tokens after pos cached ones: 2 * (every Linear's in*out that the
 * tokens use, lm_head included, embedding lookup excluded) + causal attention (QK^T and PV). */
double mq_config_forward_flops(const mq_config *c, int64_t T, int64_t pos);

/* A linear layer y = x W^T + b. The weight is fp32 [out, in] (bf16 upcast on load, or a
 * dequantized checkpoint), or kept packed for the quantized kernels (qw != NULL, w == NULL).
 * Routed experts of a layer run packed through mq_layer.pexperts instead (their w and qw are
 * then both NULL). */
struct mq_packed_weight;   /* defined by the quantized-kernel module (kernels/moe_ffn.h) */
/* Which emulated activation rounding a Linear's input gets (mq_linear.act_q): none; the model's
 * act_quant (NVFP4, or llama.cpp's Q8_0 for the weight types whose vec_dot_type is Q8_0/Q8_1);
 * llama.cpp's Q8_K (act_quant q8_0 on a GGUF Linear of a K-quant type, vec_dot_type Q8_K). */
enum mq_actq { MQ_ACTQ_NONE = 0, MQ_ACTQ_MODEL = 1, MQ_ACTQ_Q8_K = 2 };
struct mq_ggml_mat;        /* a GGUF matrix read in place (kernels/ggml_mat.h) */
typedef struct {
    int64_t out, in;
    float *w;                        /* [out, in], owned; NULL when packed */
    float *bias;                     /* [out] or NULL */
    struct mq_packed_weight *qw;     /* owned, or NULL */
    struct mq_ggml_mat *gw;          /* a GGUF file's blocks, mapped (owned struct), or NULL */
    char *name;                      /* HF module name, e.g. "model.layers.0.self_attn.q_proj" */
    bool stored_quantized;           /* the checkpoint holds this weight quantized */
    uint8_t act_q;                   /* the emulated activation quantizer on its input: mq_actq */
    bool det;                        /* fp32 products through mq_gemm_det_nt (a row's output
                                        then does not depend on which rows share the call,
                                        kernels/gemm_det.h; mq_model_det_experts) */
} mq_linear;

/* y[T, out] = x[T, in] @ W^T (+ bias), fp32 or packed. Fails only for the packed kernels'
 * scratch (MOEQ_E_NOMEM). */
moeq_status mq_linear_forward(const mq_linear *l, const float *x, int64_t T, float *y);

typedef struct {
    float *attn_norm, *ffn_norm;     /* [D] */
    mq_linear q, k, v, o;            /* MLA: q is q_proj (no q LoRA), k and v unused */
    float *q_norm, *k_norm;          /* FULL: [H*hd] / [KV*hd]; HEAD: [hd]; else NULL */
    mq_linear q_a, q_b, kv_a, kv_b;  /* MLA: [q_lora, D], [H*hd, q_lora], [kv_lora + rope, D],
                                        [H*(nope + v_hd), kv_lora] (q_a/q_b unused without q LoRA) */
    float *q_a_norm, *kv_a_norm;     /* MLA: [q_lora], [kv_lora] */
    bool vb_act_q;                   /* MLA, act_quant q8_0 on a GGUF whose attn_v_b llama.cpp runs
                                        on Q8_0 inputs: each head's latent attention output rounded
                                        before kv_b's v rows (llama.cpp's absorbed MLA) */
    float *router_bias;              /* [E]: e_score_correction_bias, or NULL */
    bool is_moe;
    mq_linear gate, up, down;        /* dense MLP */
    float *router;                   /* [E, D] fp32 */
    mq_linear *exp_gate, *exp_up, *exp_down;   /* [E] each: gate/up [F, D], down [D, F] */
    mq_linear sh_gate, sh_up, sh_down;         /* shared expert */
    float *sh_gate_w;                /* [D]: shared_expert_gate weight (1 output) */
    /* Packed routed experts (and the shared expert) of a quantized MoE layer run by the fused MoE
     * op; NULL: the fp32 path over exp_* / sh_*. */
    moeq_moe_experts *pexperts;
} mq_layer;

/* A layer's Linears outside the routed experts, in this order: q k v o, gate up down, q_a q_b
 * kv_a kv_b, sh_gate sh_up sh_down (those the layer does not use have no name). */
enum { MQ_LAYER_LINEARS = 14 };
static inline void mq_layer_linears(mq_layer *ly, mq_linear *v[MQ_LAYER_LINEARS]) {
    mq_linear *const all[MQ_LAYER_LINEARS] = {&ly->q,   &ly->k,    &ly->v,    &ly->o,    &ly->gate,
                                              &ly->up,  &ly->down, &ly->q_a,  &ly->q_b,  &ly->kv_a,
                                              &ly->kv_b, &ly->sh_gate, &ly->sh_up, &ly->sh_down};
    for (int i = 0; i < MQ_LAYER_LINEARS; i++) v[i] = all[i];
}

struct moeq_model {
    mq_config cfg;
    moeq_model_info info;
    char *dir;
    float *embed;                    /* [V, D] */
    float *final_norm;               /* [D] */
    float *lm_head;                  /* [V, D]; == embed when tied */
    /* A .gguf opened with keep_packed: the embeddings and lm_head read in place from the file's
     * blocks (NULL otherwise; embed/lm_head are then NULL), and the mapping they and the Linears'
     * gw point into, kept open. */
    struct mq_ggml_mat *embed_g, *head_g;
    /* head_g's blocks copied out of the mapping onto 2 MiB pages (head_to_anon in load.c), or
     * NULL: the one matrix a decoded token reads whole that is not in the pack cache. */
    uint8_t *head_copy;
    size_t head_copy_bytes;
    mq_st *mapped;
    struct mq_pack_cache *pcache;    /* the repacked blobs' cache (model/pack_cache.c), or NULL */
    mq_layer *layers;                /* [n_layers] */
    moeq_tokenizer *tok;             /* NULL if not loaded */
    char *quant_scheme;              /* NULL, or the scheme of a quantized checkpoint */
    int act_quant;                   /* moeq_act_quant */
    uint8_t lm_head_act_q;           /* mq_actq on lm_head's input (mq_final_norm): a GGUF whose
                                        output.weight llama.cpp runs on Q8_0 or Q8_K */
    int n_packed;                    /* Linears running packed (each expert weight counts) */
    struct mq_lazy_model *lazy;      /* moeq_model_options.stream: the lazy model that owns this
                                        one (its weights are loaded a layer at a time), else NULL */
    struct cJSON *gguf_types;        /* a .gguf opened directly: each matrix's ggml type by HF
                                        name (io/gguf_hf.h; what an imported checkpoint keeps in
                                        gguf_types.json), else NULL */
};

/* ---- lazy loading (the streaming pipeline) ------------------------------------------------------ */
/* A model whose structure is known (config.json parsed, every tensor of the checkpoint found and
 * its shape checked, as moeq_model_open does) but whose weights stay in the mapped files until a
 * part of a layer is asked for: then those tensors are converted to fp32 (dequantized when stored
 * quantized) into the model's usual fields, and freed again on release. The embedding table is
 * read row by row; lm_head is never loaded. */
typedef struct mq_lazy_model mq_lazy_model;
enum {
    MQ_PART_EMBED = 1u << 0,      /* the embedding table */
    MQ_PART_HEAD = 1u << 7,       /* final norm and lm_head (a tied lm_head is the embeddings:
                                     load MQ_PART_EMBED with it) */
    MQ_PART_GLOBAL = MQ_PART_EMBED | MQ_PART_HEAD,
    MQ_PART_ATTN = 1u << 1,       /* input norm, q/k/v/o (+ biases), q/k norms */
    MQ_PART_FFN_NORM = 1u << 2,   /* post-attention norm */
    MQ_PART_ROUTER = 1u << 3,     /* router, shared_expert_gate */
    MQ_PART_MLP = 1u << 4,        /* dense MLP */
    MQ_PART_SHARED = 1u << 5,     /* shared expert */
    MQ_PART_EXPERTS = 1u << 6,    /* routed experts [e0, e1) */
    MQ_PART_LAYER = MQ_PART_ATTN | MQ_PART_FFN_NORM | MQ_PART_ROUTER | MQ_PART_MLP |
                    MQ_PART_SHARED | MQ_PART_EXPERTS,   /* a whole decoder layer */
};
moeq_status mq_lazy_open(const char *dir, bool tokenizer, mq_lazy_model **out);
/* The same with dir's config already read: *cfg is taken (left zeroed), config.json not read
 * again (the quantize pipeline reads its source's once). */
moeq_status mq_lazy_open_config(const char *dir, mq_config *cfg, bool tokenizer, mq_lazy_model **out);
void mq_lazy_close(mq_lazy_model *lz);
/* The model (cfg, layers with names and shapes; weights NULL until loaded). Borrowed. */
moeq_model *mq_lazy_model_of(mq_lazy_model *lz);
const mq_st *mq_lazy_st(const mq_lazy_model *lz);
/* Loads (idempotent) / frees the parts `what` of layer l; experts only those in [e0, e1). */
moeq_status mq_lazy_load(mq_lazy_model *lz, int layer, unsigned what, int e0, int e1);
void mq_lazy_release(mq_lazy_model *lz, int layer, unsigned what, int e0, int e1);
/* mq_lazy_load, but the weights whose destination (&lin->w, ...) alloc_only(dest, user) names
 * only get their fp32 buffer, left unset (their values are about to be written: dequantized
 * results). */
moeq_status mq_lazy_load_ex(mq_lazy_model *lz, int layer, unsigned what, int e0, int e1,
                            bool (*alloc_only)(float **dest, void *user), void *user);
/* Starts reading the source bytes mq_lazy_load would read for the same arguments in the
 * background (mq_prefetch), so that a later load finds them in the page cache. */
void mq_lazy_prefetch(const mq_lazy_model *lz, int layer, unsigned what, int e0, int e1);
/* Read-ahead: mq_lazy_ahead_start allocates the fp32 buffers mq_lazy_load would fill for the
 * same arguments and converts them on a thread of its own at the lowest priority (SCHED_IDLE:
 * it runs on cores the pool leaves idle and yields to it at once), piece by piece;
 * mq_lazy_ahead_finish converts the pieces still left on the pool, waits for the thread's last
 * one and returns the conversion's status (the parts then count as loaded: mq_lazy_load finds
 * them there; by_thread and pieces, when not NULL, receive how many pieces its thread converted
 * and how many there were); mq_lazy_ahead_cancel stops it and frees the buffers. Both free a. Until finished the parts'
 * fields hold buffers being filled: nothing may read them. Sources that need more than a
 * conversion (stored quantized, FP8 block-scaled, a rotation set) are not read ahead: *out is
 * then NULL and the load does it all. */
typedef struct mq_lazy_ahead mq_lazy_ahead;
moeq_status mq_lazy_ahead_start(mq_lazy_model *lz, int layer, unsigned what, int e0, int e1,
                                mq_lazy_ahead **out);
moeq_status mq_lazy_ahead_finish(mq_lazy_ahead *a, int64_t *by_thread, int64_t *pieces);
void mq_lazy_ahead_cancel(mq_lazy_ahead *a);
/* fp32 bytes mq_lazy_load would allocate for the same arguments. */
int64_t mq_lazy_bytes(const mq_lazy_model *lz, int layer, unsigned what, int e0, int e1);
/* From now on every weight the lazy model loads, and every embedding row, is rotated as rotate.h
 * says (r borrowed, outliving lz; NULL: none). Set before the first load. */
typedef struct mq_rotation mq_rotation;   /* model/rotate.h */
void mq_lazy_set_rotation(mq_lazy_model *lz, const mq_rotation *r);
/* Quantized Linears of a whole layer loaded at once (MQ_PART_LAYER, every expert) are packed for
 * the quantized kernels as moeq_model_open's keep_packed packs them (the same bytes), instead of
 * dequantized to fp32; loads of parts of a layer still dequantize. Set before the first load. */
void mq_lazy_set_packed(mq_lazy_model *lz, bool on);
bool mq_lazy_packed(const mq_lazy_model *lz);   /* set, and the checkpoint is quantized */
/* The lazy model behind a model opened with moeq_model_options.stream, else NULL. */
mq_lazy_model *mq_model_lazy(const moeq_model *m);
/* Resident bytes a whole layer takes once loaded (packed or fp32, as the lazy model loads it;
 * packed weights estimated from their codes and scales), and the final norm with lm_head
 * (the embeddings when tied). */
int64_t mq_lazy_layer_bytes(const mq_lazy_model *lz, int layer);
int64_t mq_lazy_head_bytes(const mq_lazy_model *lz);
/* Tests: mq_lazy_load converts in pieces of this many values (0, the default: 2 MB of fp32). */
void mq_lazy_set_piece(mq_lazy_model *lz, int64_t values);
/* x[T, D] = embedding rows of ids, read from the mapping (ids checked; rotated when set). */
moeq_status mq_lazy_embed(const mq_lazy_model *lz, const int32_t *ids, int64_t T, float *x);

/* Routed experts through mq_gemm_det_nt (mq_linear.det): their outputs then do not depend on
 * how their rows are grouped, which the pipeline's calibration needs (it batches rows across
 * samples) and which lazily opened models have on. The default of moeq_model_open is off: the
 * OpenBLAS and GEMV paths are faster for a forward that runs one sequence at a time. */
void mq_model_det_experts(moeq_model *m, bool on);

/* ---- forward pass ----------------------------------------------------------------------------- */
/* Where the calibration hooks see a Linear's input. For routed experts the rows are exactly the
 * tokens routed to that expert (routing weights not applied); for the shared expert all tokens. */
typedef enum {
    MQ_SITE_QKV = 0,     /* input of q/k/v (after attn norm) */
    MQ_SITE_O,           /* input of o_proj (attention output) */
    MQ_SITE_MLP,         /* dense gate/up input */
    MQ_SITE_MLP_DOWN,    /* dense down input: silu(gate)*up */
    MQ_SITE_EXPERT,      /* expert e gate/up input */
    MQ_SITE_EXPERT_DOWN, /* expert e down input */
    MQ_SITE_SHARED,      /* shared expert gate/up input */
    MQ_SITE_SHARED_DOWN, /* shared expert down input */
    MQ_SITE_FFN,         /* the MLP/MoE block input of every token (after the FFN norm) */
    MQ_SITE_Q_B,         /* MLA: q_b_proj input (q_a_layernorm of q_a_proj) */
    MQ_SITE_KV_B,        /* MLA: kv_b_proj input (kv_a_layernorm of the latent) */
    MQ_SITE_COUNT
} mq_site;

/* Called synchronously on the forward's calling thread with x [rows, cols] (borrowed: valid only
 * during the call) while the layer runs; x must not be modified. Fixed order per layer:
 *   QKV, O, FFN, then MLP, MLP_DOWN (dense layer)   (MLA: QKV, [Q_B], KV_B, O, FFN, ...; QKV is
 *                                                   the input of q_proj / q_a_proj and kv_a_proj)
 *   or EXPERT 0, EXPERT_DOWN 0, ..., EXPERT E-1, EXPERT_DOWN E-1, [SHARED, SHARED_DOWN] (MoE).
 * expert is the expert index for EXPERT/EXPERT_DOWN and -1 otherwise. Every expert is reported,
 * with rows = 0 when no token was routed to it; its rows are its tokens in increasing order. */
typedef void (*mq_capture_fn)(void *user, int layer, mq_site site, int expert, const float *x,
                              int64_t rows, int64_t cols);
typedef struct {
    mq_capture_fn fn;
    void *user;
} mq_hooks;

/* With packed weights (moeq_model_options.keep_packed) hooks are refused: MOEQ_E_UNSUPPORTED.
 * With act_quant, hooks see each Linear's input before the emulated activation quantizer (the
 * high-precision activation, as calibration observers record it). */

/* KV cache and scratch for sequences of up to max_tokens positions. */
typedef struct mq_state mq_state;
moeq_status mq_state_new(const moeq_model *m, int32_t max_tokens, mq_state **out);
/* moe_scratch false: no scratch for the fp32 routed experts (a state that only runs
 * mq_attention_forward). KV caches are made per layer when a layer first runs. */
moeq_status mq_state_new_ex(const moeq_model *m, int32_t max_tokens, bool moe_scratch,
                            mq_state **out);
/* Bytes a state of max_tokens positions comes to once it has run a full window through one layer
 * (scratch, one layer's KV cache, RoPE tables), for memory plans; moe_fp32: with the fp32
 * routed experts' scratch. An estimate from the same sizes the state allocates. */
int64_t mq_state_bytes(const moeq_model *m, int32_t max_tokens, bool moe_fp32);
void mq_state_free(mq_state *s);
void mq_state_reset(mq_state *s);
/* Frees layer l's KV cache (made again when the layer runs). */
void mq_state_drop_layer(mq_state *s, int l);
/* Where a prefill's standard attention spends its wall seconds (MOEQ_DEBUG_PROFILE measurements): acc,
 * if not NULL, gets each call's seconds added by part; NULL stops it. */
enum { MQ_ATT_NORM, MQ_ATT_QKV, MQ_ATT_QK_ROPE, MQ_ATT_SCORES, MQ_ATT_O, MQ_ATT_RESIDUAL, MQ_ATT_HOOKS, MQ_ATT_PARTS };
void mq_state_profile(mq_state *s, double *acc);
/* The state's RoPE tables, [max_tokens, head_dim / 2] each (what the attention rotates by). */
void mq_state_rope_tables(const mq_state *s, const float **cos, const float **sin);

/* x[T, D] = embedding rows of ids (ids validated against the vocabulary). */
moeq_status mq_embed(const moeq_model *m, const int32_t *ids, int64_t T, float *x);
/* Runs decoder layers [l0, l1) on x[T, D] in place, for positions pos .. pos+T-1, writing the
 * state's KV cache of those layers at those positions (pos may not exceed what each layer's
 * cache holds; a smaller pos overwrites, so one state serves many windows without a reset).
 * pos + T <= max_tokens. hooks may be NULL. Results do not depend on the thread count. */
moeq_status mq_forward_layers(const moeq_model *m, mq_state *s, float *x, int64_t T, int64_t pos,
                              int l0, int l1, const mq_hooks *hooks);
/* The parts of one decoder layer, for callers that run a layer piece by piece (the streaming
 * pipeline); each does exactly what mq_forward_layers does for that part.
 *   mq_attention_forward  x[T, D] += attention(x) at positions pos.. (hooks: QKV, O)
 *   mq_ffn_norm           xn[T, D] = the layer's FFN RMSNorm of x
 *   mq_moe_route          router logits of xn into probs[T, E] (scratch), then the top-k experts
 *                         sel[T, K] and their weights w[T, K]
 *   mq_mlp_forward        y[n, D] = down(silu(gate x) * up x) on x[n, in] (y NULL: stop after
 *                         the product, left in g[n, F]; u[n, F] is scratch). The forward runs a
 *                         routed expert on blocks of at most MQ_MOE_ROWS of its routed rows (in
 *                         token order) and the dense MLP / shared expert on all T rows; a caller
 *                         that cuts the rows the same way gets the same values.
 *   mq_shared_expert_add  out[T, D] += sigmoid(shared_expert_gate xn) * sy (or 1 * sy without the
 *                         gate); sgate[T] scratch
 * The forward sums a token's routed experts into a zeroed out[t] with mq_vec()->axpy(w, y, out)
 * in increasing expert order, then adds the shared expert, then x += out. */
enum { MQ_MOE_ROWS = 128 };
moeq_status mq_attention_forward(const moeq_model *m, mq_state *s, int l, float *x, int64_t T,
                                 int64_t pos, const mq_hooks *hooks);
void mq_ffn_norm(const moeq_model *m, int l, const float *x, int64_t T, float *xn);
void mq_moe_route(const moeq_model *m, int l, const float *xn, int64_t T, float *probs,
                  int32_t *sel, float *w);
moeq_status mq_mlp_forward(const mq_linear *gate, const mq_linear *up, const mq_linear *down,
                           const float *x, int64_t n, float *g, float *u, float *y);
void mq_shared_expert_add(const moeq_model *m, int l, const float *xn, int64_t T, const float *sy,
                          float *sgate, float *out);

/* mq_final_norm: the final RMSNorm in place on x[T, D] (then, with lm_head_act_q, the Q8_0
 * rounding llama.cpp gives lm_head's input). mq_lm_head: logits[T, V] = x @ lm_head^T
 * (nothing when logits is NULL); fails only for a mapped lm_head's row buffers (MOEQ_E_NOMEM). */
void mq_final_norm(const moeq_model *m, float *x, int64_t T);
moeq_status mq_lm_head(const moeq_model *m, const float *x, int64_t T, float *logits);

#endif
