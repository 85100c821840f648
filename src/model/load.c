/*
 * moeq_model_open: config.json + safetensors weights (bf16/f16/f32 upcast to fp32) + tokenizer.
 * Tensor names are the Hugging Face hub's (model.layers.N.self_attn.q_proj.weight, ...); routed
 * experts are read per expert (mlp.experts.E.gate_proj / Mixtral block_sparse_moe.experts.E.w1)
 * or fused as transformers 5 keeps them (experts.gate_up_proj [E, 2F, D] with the gate rows
 * first, experts.down_proj [E, D, F]); see ../shared/docs/formats.md sections 1 and 2.5.
 * Every missing or misshapen tensor is reported in one error. A Linear stored quantized
 * (compressed-tensors, ModelOpt, GPTQ) is dequantized by mq_load_linear_weight (src/export), or,
 * with keep_packed, read into an mq_qtensor and packed for the quantized kernels
 * (src/kernels/moe_ffn.h, "Runtime integration"): all experts of a MoE layer together into one
 * moeq_moe_experts, other Linears one by one; what the kernels refuse (MOEQ_E_UNSUPPORTED) is
 * dequantized instead, with an info log naming it.
 * deepseek_v3 (DeepseekV3ForCausalLM's names): self_attn.{q_a_proj, q_a_layernorm, q_b_proj |
 * q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}, mlp.gate.{weight,
 * e_score_correction_bias}, mlp.shared_experts.*; the tensors of its multi-token-prediction
 * layers (model.layers.N.* for num_hidden_layers <= N < + num_nextn_predict_layers) are allowed
 * and not loaded.
 * A GGUF file is read in place (io/gguf_hf.h): its views carry the HF names and shapes above and
 * decode their ggml blocks when converted, so everything below treats it as a checkpoint whose
 * tensors are all unquantized (its config.json and tokenizer.json are made in memory; the ggml
 * types go to m->gguf_types for act_quant q8_0).
 */
#define _GNU_SOURCE   /* SCHED_IDLE (the read-ahead thread) */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "ckpt/layout.h"
#include "io/fp8.h"
#include "io/gguf_hf.h"
#include "io/tokenizer.h"
#include "kernels/ggml_mat.h"
#include "kernels/moe_ffn.h"
#include "model/load_internal.h"
#include "model/model_internal.h"
#include "model/rotate.h"

static void want_add(want_list *L, int layer, char *name, int ndim, const int64_t *shape,
                     float **dest, int64_t off, int64_t count) {
    if (!name) {
        L->oom = true;
        return;
    }
    if (L->n == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        want *w = realloc(L->w, cap * sizeof *w);
        if (!w) {
            L->oom = true;
            free(name);
            return;
        }
        L->w = w;
        L->cap = cap;
    }
    want *w = &L->w[L->n++];
    memset(w, 0, sizeof *w);
    w->name = name;
    w->ndim = ndim;
    for (int i = 0; i < ndim; i++) w->shape[i] = shape[i];
    w->dest = dest;
    w->off = off;
    w->count = count;
    w->layer = layer;
    w->expert = -1;
    w->what = L->what;
    w->bytes = count * 4;
}

static void want_vec(want_list *L, int layer, char *name, int64_t n, float **dest) {
    want_add(L, layer, name, 1, &n, dest, 0, n);
}

/* The last want is the weight of Linear `module`, which a quantized checkpoint may store packed. */
static void want_mark_linear(want_list *L, const char *module) {
    if (L->oom || L->n == 0) return;
    L->w[L->n - 1].module = mq_strdup(module);
    if (!L->w[L->n - 1].module) L->oom = true;
}

/* A Linear named `module` (HF module path): module.weight [out, in] and optionally module.bias. */
static void want_linear(want_list *L, int layer, const char *module, int64_t out, int64_t in,
                        bool bias, mq_linear *lin) {
    lin->out = out;
    lin->in = in;
    lin->name = mq_strdup(module);
    if (!lin->name) L->oom = true;
    int64_t shape[2] = {out, in};
    want_add(L, layer, mq_asprintf("%s.weight", module), 2, shape, &lin->w, 0, out * in);
    want_mark_linear(L, module);
    if (!L->oom) L->w[L->n - 1].lin = lin;
    if (bias) want_vec(L, layer, mq_asprintf("%s.bias", module), out, &lin->bias);
}

/* The last want is the weight of a routed expert (e < n_experts) or of the shared expert
 * (e == n_experts); part 0 gate, 1 up, 2 down. */
static void tag_expert(want_list *L, int e, int part) {
    if (L->oom || L->n == 0) return;
    L->w[L->n - 1].expert = e;
    L->w[L->n - 1].part = part;
}

void mq_want_free(want_list *L) {
    for (size_t i = 0; i < L->n; i++) {
        free(L->w[i].name);
        free(L->w[i].module);
    }
    free(L->w);
}

static void fmt_shape(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "[");
    for (int i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
}

/* ---- the tensors each family needs ---------------------------------------------------- */
static bool has(const mq_st *st, const char *name) { return mq_st_find(st, name) != NULL; }

/* Multi-head latent attention (DeepseekV3Attention): q_proj has no bias even with attention_bias;
 * q_a, kv_a and o_proj have it. */
static void want_mla(want_list *L, const mq_config *c, int l, mq_layer *ly) {
    char p[160], m[200];
    int64_t D = c->D, H = c->n_heads, qh = H * c->head_dim, r = c->kv_lora_rank;
    snprintf(p, sizeof p, "model.layers.%d.self_attn", l);
    if (c->q_lora_rank > 0) {
        snprintf(m, sizeof m, "%s.q_a_proj", p);
        want_linear(L, l, m, c->q_lora_rank, D, c->qkv_bias, &ly->q_a);
        want_vec(L, l, mq_asprintf("%s.q_a_layernorm.weight", p), c->q_lora_rank, &ly->q_a_norm);
        snprintf(m, sizeof m, "%s.q_b_proj", p);
        want_linear(L, l, m, qh, c->q_lora_rank, false, &ly->q_b);
    } else {
        snprintf(m, sizeof m, "%s.q_proj", p);
        want_linear(L, l, m, qh, D, false, &ly->q);
    }
    snprintf(m, sizeof m, "%s.kv_a_proj_with_mqa", p);
    want_linear(L, l, m, r + c->qk_rope, D, c->qkv_bias, &ly->kv_a);
    want_vec(L, l, mq_asprintf("%s.kv_a_layernorm.weight", p), r, &ly->kv_a_norm);
    snprintf(m, sizeof m, "%s.kv_b_proj", p);
    want_linear(L, l, m, H * (c->qk_nope + c->v_head_dim), r, false, &ly->kv_b);
    snprintf(m, sizeof m, "%s.o_proj", p);
    want_linear(L, l, m, D, H * c->v_head_dim, c->o_bias, &ly->o);
}

static void want_attention(want_list *L, const mq_config *c, int l, mq_layer *ly) {
    if (c->mla) {
        want_mla(L, c, l, ly);
        return;
    }
    char p[160];
    int64_t D = c->D, q = (int64_t)c->n_heads * c->head_dim, kv = (int64_t)c->n_kv_heads * c->head_dim;
    snprintf(p, sizeof p, "model.layers.%d.self_attn", l);
    char m[200];
    snprintf(m, sizeof m, "%s.q_proj", p);
    want_linear(L, l, m, q, D, c->qkv_bias, &ly->q);
    snprintf(m, sizeof m, "%s.k_proj", p);
    want_linear(L, l, m, kv, D, c->qkv_bias, &ly->k);
    snprintf(m, sizeof m, "%s.v_proj", p);
    want_linear(L, l, m, kv, D, c->qkv_bias, &ly->v);
    snprintf(m, sizeof m, "%s.o_proj", p);
    want_linear(L, l, m, D, q, c->o_bias, &ly->o);
    if (c->qk_norm != MQ_QKNORM_NONE) {
        bool full = c->qk_norm == MQ_QKNORM_FULL;
        want_vec(L, l, mq_asprintf("%s.q_norm.weight", p), full ? q : c->head_dim, &ly->q_norm);
        want_vec(L, l, mq_asprintf("%s.k_norm.weight", p), full ? kv : c->head_dim, &ly->k_norm);
    }
}

/* Routed experts, router and shared expert of one sparse layer. */
static moeq_status want_moe(want_list *L, const mq_st *st, const mq_config *c, int l, mq_layer *ly) {
    int64_t D = c->D, F = c->moe_ffn, E = c->n_experts;
    char mp[160], m[240];
    /* Mixtral's hub layout says block_sparse_moe; transformers 5 re-saves it under mlp. */
    snprintf(mp, sizeof mp, "model.layers.%d.block_sparse_moe", l);
    snprintf(m, sizeof m, "%s.gate.weight", mp);
    bool mixtral_names = c->arch == MQ_ARCH_MIXTRAL && has(st, m);
    if (!mixtral_names) snprintf(mp, sizeof mp, "model.layers.%d.mlp", l);

    ly->exp_gate = calloc((size_t)E, sizeof(mq_linear));
    ly->exp_up = calloc((size_t)E, sizeof(mq_linear));
    ly->exp_down = calloc((size_t)E, sizeof(mq_linear));
    if (!ly->exp_gate || !ly->exp_up || !ly->exp_down)
        return mq_err(MOEQ_E_NOMEM, "layer %d: out of memory for %lld experts", l, (long long)E);

    int64_t rshape[2] = {E, D};
    L->what = MQ_PART_ROUTER;
    want_add(L, l, mq_asprintf("%s.gate.weight", mp), 2, rshape, &ly->router, 0, E * D);
    if (c->router_bias)
        want_vec(L, l, mq_asprintf("%s.gate.e_score_correction_bias", mp), E, &ly->router_bias);
    L->what = MQ_PART_EXPERTS;

    /* Module names are the per-expert hub names whatever the storage, so exports keep them. */
    const char *gn = "gate_proj", *un = "up_proj", *dn = "down_proj";
    char ep[180];
    snprintf(ep, sizeof ep, "%s.experts", mp);
    if (c->arch == MQ_ARCH_MIXTRAL) {
        gn = "w1", un = "w3", dn = "w2";
        snprintf(ep, sizeof ep, "model.layers.%d.block_sparse_moe.experts", l);
    }
    snprintf(m, sizeof m, "%s.experts.gate_up_proj", mp);
    bool fused = has(st, m);
    for (int64_t e = 0; e < E; e++) {
        char n[260];
        snprintf(n, sizeof n, "%s.%lld.%s", ep, (long long)e, gn);
        if (fused) {
            ly->exp_gate[e] = (mq_linear){.out = F, .in = D, .name = mq_strdup(n)};
            snprintf(n, sizeof n, "%s.%lld.%s", ep, (long long)e, un);
            ly->exp_up[e] = (mq_linear){.out = F, .in = D, .name = mq_strdup(n)};
            snprintf(n, sizeof n, "%s.%lld.%s", ep, (long long)e, dn);
            ly->exp_down[e] = (mq_linear){.out = D, .in = F, .name = mq_strdup(n)};
            if (!ly->exp_gate[e].name || !ly->exp_up[e].name || !ly->exp_down[e].name) L->oom = true;
            int64_t gu[3] = {E, 2 * F, D}, dw[3] = {E, D, F};
            want_add(L, l, mq_asprintf("%s.experts.gate_up_proj", mp), 3, gu, &ly->exp_gate[e].w,
                     e * 2 * F * D, F * D);
            tag_expert(L, (int)e, 0);
            want_add(L, l, mq_asprintf("%s.experts.gate_up_proj", mp), 3, gu, &ly->exp_up[e].w,
                     e * 2 * F * D + F * D, F * D);
            tag_expert(L, (int)e, 1);
            want_add(L, l, mq_asprintf("%s.experts.down_proj", mp), 3, dw, &ly->exp_down[e].w,
                     e * D * F, D * F);
            tag_expert(L, (int)e, 2);
        } else {
            /* On disk under mp (block_sparse_moe for hub Mixtral, mlp otherwise). */
            char disk[260];
            snprintf(disk, sizeof disk, "%s.experts.%lld.%s", mp, (long long)e, gn);
            want_linear(L, l, disk, F, D, false, &ly->exp_gate[e]);
            tag_expert(L, (int)e, 0);
            snprintf(disk, sizeof disk, "%s.experts.%lld.%s", mp, (long long)e, un);
            want_linear(L, l, disk, F, D, false, &ly->exp_up[e]);
            tag_expert(L, (int)e, 1);
            snprintf(disk, sizeof disk, "%s.experts.%lld.%s", mp, (long long)e, dn);
            want_linear(L, l, disk, D, F, false, &ly->exp_down[e]);
            tag_expert(L, (int)e, 2);
        }
    }
    if (c->shared_ffn > 0) {
        int64_t S = c->shared_ffn;
        /* qwen2_moe: one shared_expert; deepseek_v3: n_shared_experts fused as shared_experts */
        const char *sn = c->arch == MQ_ARCH_DEEPSEEK_V3 ? "shared_experts" : "shared_expert";
        L->what = MQ_PART_SHARED;
        snprintf(m, sizeof m, "%s.%s.gate_proj", mp, sn);
        want_linear(L, l, m, S, D, false, &ly->sh_gate);
        tag_expert(L, (int)E, 0);
        snprintf(m, sizeof m, "%s.%s.up_proj", mp, sn);
        want_linear(L, l, m, S, D, false, &ly->sh_up);
        tag_expert(L, (int)E, 1);
        snprintf(m, sizeof m, "%s.%s.down_proj", mp, sn);
        want_linear(L, l, m, D, S, false, &ly->sh_down);
        tag_expert(L, (int)E, 2);
        if (c->shared_gate) {
            int64_t gs[2] = {1, D};
            L->what = MQ_PART_ROUTER;
            want_add(L, l, mq_asprintf("%s.shared_expert_gate.weight", mp), 2, gs, &ly->sh_gate_w,
                     0, D);
        }
    }
    return MOEQ_OK;
}

moeq_status mq_build_wants(want_list *L, const mq_st *st, moeq_model *m) {
    const mq_config *c = &m->cfg;
    int64_t V = c->vocab, D = c->D;
    int64_t vd[2] = {V, D};
    L->what = MQ_PART_EMBED;
    want_add(L, -1, mq_strdup("model.embed_tokens.weight"), 2, vd, &m->embed, 0, V * D);
    L->what = MQ_PART_HEAD;
    want_vec(L, -1, mq_strdup("model.norm.weight"), D, &m->final_norm);
    if (!c->tie_embeddings) {
        want_add(L, -1, mq_strdup("lm_head.weight"), 2, vd, &m->lm_head, 0, V * D);
        want_mark_linear(L, "lm_head");
    }
    for (int l = 0; l < c->n_layers; l++) {
        mq_layer *ly = &m->layers[l];
        L->what = MQ_PART_ATTN;
        want_vec(L, l, mq_asprintf("model.layers.%d.input_layernorm.weight", l), D, &ly->attn_norm);
        L->what = MQ_PART_FFN_NORM;
        want_vec(L, l, mq_asprintf("model.layers.%d.post_attention_layernorm.weight", l), D,
                 &ly->ffn_norm);
        L->what = MQ_PART_ATTN;
        want_attention(L, c, l, ly);
        ly->is_moe = c->layer_is_moe[l] != 0;
        if (ly->is_moe) {
            moeq_status s = want_moe(L, st, c, l, ly);
            if (s) return s;
        } else {
            char p[160];
            L->what = MQ_PART_MLP;
            snprintf(p, sizeof p, "model.layers.%d.mlp.gate_proj", l);
            want_linear(L, l, p, c->ffn, D, c->mlp_bias, &ly->gate);
            snprintf(p, sizeof p, "model.layers.%d.mlp.up_proj", l);
            want_linear(L, l, p, c->ffn, D, c->mlp_bias, &ly->up);
            snprintf(p, sizeof p, "model.layers.%d.mlp.down_proj", l);
            want_linear(L, l, p, D, c->ffn, c->mlp_bias, &ly->down);
        }
    }
    if (L->oom) return mq_err(MOEQ_E_NOMEM, "out of memory listing the model's tensors");
    return MOEQ_OK;
}

static const mq_tensor_view *st_lookup(void *user, const char *name) {
    return mq_st_find((const mq_st *)user, name);
}

/* Finds every wanted tensor and checks dtype and shape; one error lists all problems. */
moeq_status mq_check_wants(want_list *L, const mq_st *st, const moeq_model *m, const char *dir) {
    const mq_config *c = &m->cfg;
    mq_problems probs;
    mq_problems_init(&probs);
    /* A layer with none of its tensors present gets one line instead of one per tensor. */
    int *missing = calloc((size_t)c->n_layers + 1, sizeof(int));
    int *total = calloc((size_t)c->n_layers + 1, sizeof(int));
    if (!missing || !total) {
        free(missing);
        free(total);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < L->n; i++) {
        want *w = &L->w[i];
        w->t = mq_st_find(st, w->name);
        /* a GGUF tensor decodes by its ggml type, never through a quantized checkpoint's layout */
        if (w->module && !(w->t && w->t->ggml)) {   /* absent, or U8 for ModelOpt NVFP4, when stored quantized */
            mq_linear_kind k = mq_layout_detect(w->module, st_lookup, (void *)st);
            /* FP8 block weights dequantize through mq_tensor_to_f32 like float ones */
            w->quantized = k != MQ_LIN_ABSENT && k != MQ_LIN_DENSE && k != MQ_LIN_FP8_BLOCK;
            if (w->lin) w->lin->stored_quantized = w->quantized;
        }
        if (w->layer >= 0 && (i == 0 || strcmp(L->w[i - 1].name, w->name) != 0)) {
            total[w->layer]++;
            if (!w->t && !w->quantized) missing[w->layer]++;
        }
    }
    for (int l = 0; l < c->n_layers; l++)
        if (total[l] > 0 && missing[l] == total[l])
            mq_problems_add(&probs, "layer %d: none of its %d tensors are present (config.json "
                            "says num_hidden_layers = %d)", l, total[l], c->n_layers);
    for (size_t i = 0; i < L->n; i++) {
        const want *w = &L->w[i];
        if (i > 0 && strcmp(L->w[i - 1].name, w->name) == 0) continue;   /* fused: once */
        if (w->layer >= 0 && missing[w->layer] == total[w->layer]) continue;
        char exp[96], got[96];
        fmt_shape(exp, sizeof exp, w->ndim, w->shape);
        if (w->quantized) continue;   /* validated when mq_load_linear_weight reads it */
        if (!w->t) {
            mq_problems_add(&probs, "missing tensor '%s' (expected %s)", w->name, exp);
            continue;
        }
        const mq_tensor_view *t = w->t;
        if (mq_tensor_whole_only(t) && w->off == 0 && w->count == t->numel) {
            /* FP8 block-quantized (linked and shape-checked by mq_st_open_dir), or GGUF's merged
             * kv_b (io/gguf_hf.h) */
        } else if (mq_tensor_whole_only(t)) {
            mq_problems_add(&probs, "tensor '%s': %s cannot be split", w->name,
                            t->scale_inv ? "an FP8 block-quantized tensor"
                                         : "a tensor merged from GGUF's attn_k_b and attn_v_b");
            continue;
        } else if (t->ggml) {
            /* a GGUF tensor: every ggml type its reader accepted decodes */
        } else if (t->dtype == MOEQ_DT_F8_E4M3) {
            mq_problems_add(&probs, "tensor '%s' has dtype F8_E4M3 without a block scale (an FP8 "
                            "source needs '%s_scale_inv' and config.json quantization_config "
                            "{\"quant_method\": \"fp8\", \"weight_block_size\": [..]})",
                            w->name, w->name);
            continue;
        } else if (t->dtype != MOEQ_DT_F32 && t->dtype != MOEQ_DT_F16 && t->dtype != MOEQ_DT_BF16) {
            mq_problems_add(&probs, "tensor '%s' has dtype %s (expected BF16, F16 or F32)", w->name,
                            moeq_dtype_name(t->dtype));
            continue;
        }
        bool same = t->ndim == w->ndim;
        for (int d = 0; same && d < w->ndim; d++) same = t->shape[d] == w->shape[d];
        if (!same) {
            fmt_shape(got, sizeof got, t->ndim, t->shape);
            mq_problems_add(&probs, "tensor '%s': expected shape %s, found %s", w->name, exp, got);
        }
    }
    /* Layers beyond num_hidden_layers (and its multi-token-prediction layers). */
    int max_layer = -1;
    const char *example = NULL;
    for (size_t i = 0; i < mq_st_count(st); i++) {
        const char *n = mq_st_at(st, i)->name;
        int l;
        if (sscanf(n, "model.layers.%d.", &l) == 1 && l > max_layer) {
            max_layer = l;
            example = n;
        }
    }
    if (max_layer >= c->n_layers + c->n_mtp) {
        if (c->arch == MQ_ARCH_DEEPSEEK_V3)
            mq_problems_add(&probs, "the checkpoint has tensors for layer %d (e.g. '%s') but "
                            "config.json says num_hidden_layers = %d and num_nextn_predict_layers "
                            "= %d", max_layer, example, c->n_layers, c->n_mtp);
        else
            mq_problems_add(&probs, "the checkpoint has tensors for layer %d (e.g. '%s') but "
                            "config.json says num_hidden_layers = %d", max_layer, example,
                            c->n_layers);
    }
    free(missing);
    free(total);
    moeq_status s = MOEQ_OK;
    if (probs.n > 0) {
        if (c->quant_method)
            s = mq_problems_error(&probs, MOEQ_E_SHAPE, "%s: %s checkpoint (quantization_config "
                                  "quant_method '%s') does not load as fp32", dir, c->model_type,
                                  c->quant_method);
        else
            s = mq_problems_error(&probs, MOEQ_E_SHAPE, "%s: %s checkpoint does not match its "
                                  "config.json", dir, c->model_type);
    }
    mq_problems_free(&probs);
    return s;
}

typedef struct {
    want_list *L;
    moeq_status *status;
} convert_job;

/* Elements [k0, k1) of a want's slice of its checkpoint tensor into its fp32 destination (a GGUF
 * tensor's blocks decoded for just those values); a tensor that converts only whole (FP8
 * block-quantized: its scales go by blocks of rows and columns; GGUF's merged kv_b) whole, with
 * k0 = 0 (check_wants). */
moeq_status mq_want_piece_to_f32(const want *w, int64_t k0, int64_t k1) {
    if (mq_tensor_whole_only(w->t)) return k0 == 0 ? mq_tensor_to_f32(w->t, *w->dest) : MOEQ_OK;
    return mq_tensor_range_to_f32(w->t, w->off + k0, w->off + k1, *w->dest + k0);
}

/* The whole want. */
static moeq_status want_to_f32(const want *w) { return mq_want_piece_to_f32(w, 0, w->count); }

static void convert_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    convert_job *j = ctx;
    const want *w = &j->L->w[i];
    if (w->quantized || w->packed) return;   /* dequantized afterwards (on this thread, for its
                                                 messages), or kept packed */
    if (moeq_interrupted()) {   /* Ctrl-C: the tensors left are not read */
        j->status[i] = MOEQ_E_INTERRUPTED;
        return;
    }
    j->status[i] = want_to_f32(w);
}

static moeq_status load_wants(want_list *L, const mq_st *st) {
    for (size_t i = 0; i < L->n; i++) {
        want *w = &L->w[i];
        if (w->packed) continue;
        *w->dest = mq_alloc_array((size_t)w->count, sizeof(float), w->name);
        if (!*w->dest) return MOEQ_E_NOMEM;
    }
    moeq_status *status = calloc(L->n ? L->n : 1, sizeof *status);
    if (!status) return mq_err(MOEQ_E_NOMEM, "out of memory");
    convert_job j = {L, status};
    mq_parallel_for((int64_t)L->n, convert_task, &j);
    moeq_status s = moeq_interrupted() ? mq_err(MOEQ_E_INTERRUPTED, "loading the weights interrupted") : MOEQ_OK;
    for (size_t i = 0; i < L->n && !s; i++)
        if (status[i]) s = mq_err(status[i], "tensor '%s': cannot convert to fp32", L->w[i].name);
    free(status);
    for (size_t i = 0; i < L->n && !s; i++)
        if (moeq_interrupted()) s = mq_err(MOEQ_E_INTERRUPTED, "loading the weights interrupted");
        else if (L->w[i].quantized && !L->w[i].packed)
            s = mq_load_linear_weight(st, L->w[i].module, L->w[i].shape[0], L->w[i].shape[1],
                                      *L->w[i].dest, NULL);
    return s;
}

/* ---- packed weights (keep_packed) ---------------------------------------------------------- */
/* One quantized Linear outside the MoE experts: packed, or left for dequantization when the
 * kernels refuse it. Reading errors (a malformed tensor) fail the load as the fp32 path would. */
static moeq_status pack_linear(const mq_st *st, want *w, moeq_model *m, int *n_fallback,
                               mq_pack_cache *c) {
    if (mq_pack_cache_get_weight(c, w->module, &w->lin->qw)) {   /* nothing read */
        w->packed = true;
        m->n_packed++;
        return MOEQ_OK;
    }
    mq_qtensor q;
    moeq_status s = mq_layout_read(w->module, w->shape[0], w->shape[1], st_lookup, (void *)st, &q);
    if (!s) s = mq_packed_weight_from_qtensor(&q, w->module, &w->lin->qw);
    mq_qtensor_free(&q);
    if (s == MOEQ_E_UNSUPPORTED) {
        mq_info("%s; it runs dequantized (fp32)", moeq_last_error());
        (*n_fallback)++;
        return MOEQ_OK;
    }
    if (!s) {
        w->packed = true;
        m->n_packed++;
        s = mq_pack_cache_put_weight(c, w->module, w->lin->qw);
    }
    return s;
}

/* The quantized tensors of a MoE layer's expert weights, read on the pool: q[i] from ws[i],
 * status[i] its reading's. */
typedef struct {
    const mq_st *st;
    want **ws;
    mq_qtensor *q;
    moeq_status *status;
} read_job;

static moeq_status read_one(const read_job *j, int64_t i) {
    const want *w = j->ws[i];
    return mq_layout_read(w->module, w->shape[0], w->shape[1], st_lookup, (void *)j->st, &j->q[i]);
}

static void read_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    const read_job *j = ctx;
    j->status[i] = read_one(j, i);
}

/* The routed experts (and shared expert) of MoE layer l, all packed into one moeq_moe_experts,
 * or all left for dequantization. ws: the layer's expert weight wants, [part * E + e] for routed
 * expert e, [3 * E + part] for the shared expert. */
static moeq_status pack_moe_layer(const mq_st *st, want **ws, int n, moeq_model *m, int l,
                                  int *n_fallback, mq_pack_cache *c) {
    const int E = m->cfg.n_experts;
    int nq = 0;
    for (int i = 0; i < n; i++) nq += ws[i] && ws[i]->quantized;
    if (nq == 0) return MOEQ_OK;
    char what[200];
    snprintf(what, sizeof what, "%s", ws[0] ? ws[0]->module : "experts");
    char *cut = strstr(what, ".experts.");
    if (cut) *cut = '\0';
    if (nq < n) {
        mq_info("%s: %d of its %d expert weights are stored quantized, the kernels need all; the "
                "layer's experts run dequantized (fp32)", what, nq, n);
        *n_fallback += nq;
        return MOEQ_OK;
    }
    mq_layer *ly = &m->layers[l];
    if (mq_pack_cache_get_experts(c, what, &ly->pexperts)) {   /* nothing read */
        for (int i = 0; i < n; i++) ws[i]->packed = true;
        m->n_packed += n;
        return MOEQ_OK;
    }
    mq_qtensor *q = calloc((size_t)n, sizeof *q);
    moeq_status *rs = calloc((size_t)n, sizeof *rs);
    if (!q || !rs) {
        free(q);
        free(rs);
        return mq_err(MOEQ_E_NOMEM, "%s: out of memory", what);
    }
    /* every weight read on the pool: one by one on the calling thread, unpacking a layer's
     * codes was a serial stretch of the load as long as the packing itself at 2 threads */
    read_job rj = {st, ws, q, rs};
    mq_parallel_for(n, read_task, &rj);
    moeq_status s = MOEQ_OK;
    for (int i = 0; i < n && !s; i++)
        if (rs[i]) {   /* the first failure in order, read again here for its message */
            mq_qtensor_free(&q[i]);
            s = read_one(&rj, i);
        }
    free(rs);
    if (!s) {
        const mq_qtensor *sh = n > 3 * E ? q + 3 * E : NULL;
        s = mq_moe_experts_from_qtensors(q, q + E, q + 2 * E, E, sh, sh ? sh + 1 : NULL,
                                         sh ? sh + 2 : NULL, what, &ly->pexperts);
        if (s == MOEQ_E_UNSUPPORTED) {
            mq_info("%s; the layer's experts run dequantized (fp32)", moeq_last_error());
            *n_fallback += n;
            s = MOEQ_OK;
        } else if (!s) {
            for (int i = 0; i < n; i++) ws[i]->packed = true;
            m->n_packed += n;
            s = mq_pack_cache_put_experts(c, what, ly->pexperts);
        }
    }
    for (int i = 0; i < n; i++) mq_qtensor_free(&q[i]);
    free(q);
    return s;
}

/* Packs every quantized decoder Linear of layers [l0, l1) the kernels support; the rest stay on
 * the fp32 path. */
moeq_status mq_pack_layers(want_list *L, const mq_st *st, moeq_model *m, int l0, int l1,
                               int *n_fallback, mq_pack_cache *c) {
    const int E = m->cfg.n_experts, nmoe = 3 * E + (m->cfg.shared_ffn > 0 ? 3 : 0);
    want **ws = calloc((size_t)(nmoe > 0 ? nmoe : 1), sizeof *ws);
    if (!ws) return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status s = MOEQ_OK;
    for (int l = l0; l < l1 && !s; l++) {
        if (moeq_interrupted()) {   /* a layer's packing reads its experts: a poll a layer */
            s = mq_err(MOEQ_E_INTERRUPTED, "layer %d: packing its weights interrupted", l);
            break;
        }
        memset(ws, 0, sizeof *ws * (size_t)(nmoe > 0 ? nmoe : 1));
        for (size_t i = 0; i < L->n && !s; i++) {
            want *w = &L->w[i];
            if (w->layer != l || !w->lin) continue;
            if (w->expert >= 0)
                ws[w->expert < E ? w->part * E + w->expert : 3 * E + w->part] = w;
            else if (w->quantized)
                s = pack_linear(st, w, m, n_fallback, c);
        }
        if (!s && m->layers[l].is_moe) s = pack_moe_layer(st, ws, nmoe, m, l, n_fallback, c);
    }
    free(ws);
    return s;
}

static moeq_status pack_quantized(want_list *L, const mq_st *st, moeq_model *m, int *n_fallback) {
    return mq_pack_layers(L, st, m, 0, m->cfg.n_layers, n_fallback, m->pcache);
}

/* ---- a .gguf in place (keep_packed; load_gguf.c) --------------------------------------------- */
/* Whether want w is one whole GGUF tensor (not a slice of a fused one). */
static bool gguf_whole(const want *w) {
    return w->t && w->t->ggml && w->off == 0 && w->count == w->t->numel;
}

/* Each MoE layer's experts repacked, every other Linear, the embeddings and lm_head mapped; what
 * cannot be (K-quants, the merged kv_b, experts of other types) stays for load_wants to decode. */
static moeq_status map_gguf(want_list *L, moeq_model *m, int *n_fallback) {
    const int E = m->cfg.n_experts, nmoe = 3 * E + (m->cfg.shared_ffn > 0 ? 3 : 0);
    const mq_tensor_view **v = calloc((size_t)(nmoe > 0 ? nmoe : 1), sizeof *v);
    want **ws = calloc((size_t)(nmoe > 0 ? nmoe : 1), sizeof *ws);
    moeq_status s = v && ws ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory");
    for (int l = 0; l < m->cfg.n_layers && !s && nmoe > 0; l++) {
        if (!m->layers[l].is_moe) continue;
        memset(ws, 0, sizeof *ws * (size_t)nmoe);
        memset(v, 0, sizeof *v * (size_t)nmoe);
        for (size_t i = 0; i < L->n; i++) {
            want *w = &L->w[i];
            if (w->layer != l || !w->lin || w->expert < 0 || !gguf_whole(w)) continue;
            int k = w->expert < E ? w->part * E + w->expert : 3 * E + w->part;
            ws[k] = w;
            v[k] = w->t;
        }
        char what[64];
        snprintf(what, sizeof what, "model.layers.%d.mlp", l);
        s = mq_gguf_map_experts(v, E, m->cfg.shared_ffn > 0, what, m->pcache,
                                &m->layers[l].pexperts);
        if (s == MOEQ_E_UNSUPPORTED) {   /* its Linears are mapped one by one below */
            mq_info("%s; its experts run through the mapped rows", moeq_last_error());
            s = MOEQ_OK;
        } else if (!s) {
            for (int k = 0; k < nmoe; k++) ws[k]->packed = true;
            m->n_packed += nmoe;
        }
    }
    for (size_t i = 0; i < L->n && !s; i++) {
        want *w = &L->w[i];
        /* F32 stays as it is decoded: a copy of the same bytes, computed as the source's */
        if (w->packed || !gguf_whole(w) || w->ndim != 2 || w->t->ggml->type == MQ_GGML_F32) continue;
        struct mq_ggml_mat **dst = w->dest == &m->embed ? &m->embed_g
                                   : w->dest == &m->lm_head ? &m->head_g : NULL;
        if (!dst && !w->lin) continue;
        s = w->lin ? mq_gguf_map_linear(w->t, w->lin, m->pcache)
                   : mq_gguf_map_mat(w->t, w->shape[0], w->shape[1], dst);
        if (s == MOEQ_E_UNSUPPORTED) {
            mq_info("%s; it is decoded to fp32", moeq_last_error());
            (*n_fallback)++;
            s = MOEQ_OK;
        } else if (!s) {
            w->packed = true;
            m->n_packed += w->lin != NULL;
        }
    }
    free(v);
    free(ws);
    return s;
}

/* lm_head read in place (head_g) is streamed whole for every decoded token, from the file's
 * page-cache pages: mostly 4 KiB pages, which a core streams about a quarter slower than huge
 * pages (TLB misses; the hardware prefetcher stops at each 4 KiB boundary; docs/results/runtime.md).
 * Its blocks are copied once onto anonymous 2 MiB pages, in pieces on the pool, each piece's file
 * pages unmapped from this process after it (MADV_DONTNEED on a file mapping only drops the page
 * table entries), so the resident set does not grow. It costs the fresh pages' faults at load
 * (docs/results/runtime.md has the figures). Failing to map is not an error: the rows are then
 * read in place as before. */
enum { HEAD_PIECE = 8 << 20 };

typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    uintptr_t pmask;
} head_copy_job;

/* A piece [lo, hi): copied, then its whole file pages unmapped (a page shared with a neighbour
 * tensor or piece stays mapped). On the pool: the new pages' faults are most of the cost. */
static void head_copy_piece(void *ctx, int64_t lo, int64_t hi) {
    const head_copy_job *j = ctx;
    const size_t off = (size_t)lo, k = (size_t)(hi - lo);
    memcpy(j->dst + off, j->src + off, k);
    const uintptr_t a = ((uintptr_t)(j->src + off) + j->pmask) & ~j->pmask;
    const uintptr_t b = ((uintptr_t)(j->src + off + k)) & ~j->pmask;
    if (b > a) madvise((void *)a, b - a, MADV_DONTNEED);
}

static void head_to_anon(moeq_model *m) {
    mq_ggml_mat *g = m->head_g;
    if (!g || m->head_copy) return;
    const size_t n = mq_ggml_mat_bytes(g), huge = (size_t)2 << 20;
    const size_t cap = (n + huge - 1) & ~(huge - 1);
    if (n < huge) return;   /* small enough to stay in the caches */
    uint8_t *p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
#ifdef MADV_HUGEPAGE
    madvise(p, cap, MADV_HUGEPAGE);
#endif
    const long pg = sysconf(_SC_PAGESIZE);
    head_copy_job j = {g->data, p, pg > 0 ? (uintptr_t)pg - 1 : 4095};
    mq_parallel_ranges((int64_t)n, HEAD_PIECE, true, head_copy_piece, &j);
    mprotect(p, cap, PROT_READ);
    g->data = p;
    m->head_copy = p;
    m->head_copy_bytes = cap;
}

/* A quantized checkpoint run packed: its BF16 / F16 embeddings and lm_head read in place from the
 * mapped safetensors (no fp32 copy: half the bytes a decoded token reads of lm_head). mark: the
 * wants are then done (a whole open); the lazy model loads its fp32 copies still, unused. */
moeq_status mq_map_float_head(want_list *L, moeq_model *m, bool mark) {
    moeq_status s = MOEQ_OK;
    for (size_t i = 0; i < L->n && !s; i++) {
        want *w = &L->w[i];
        struct mq_ggml_mat **dst = w->dest == &m->embed ? &m->embed_g
                                   : w->dest == &m->lm_head ? &m->head_g : NULL;
        const mq_tensor_view *t = w->t;
        if (!dst || *dst || !t || t->ggml || t->scale_inv || w->off != 0 || w->count != t->numel ||
            t->ndim != 2 || (t->dtype != MOEQ_DT_BF16 && t->dtype != MOEQ_DT_F16))
            continue;
        mq_ggml_mat g;
        s = mq_ggml_mat_init(&g, t->data, t->dtype == MOEQ_DT_BF16 ? MQ_GM_BF16 : MQ_GM_F16,
                             t->shape[0], t->shape[1], 1.0f, 0, t->name);
        if (!s && !(*dst = mq_alloc(sizeof g, "mapped matrix"))) s = MOEQ_E_NOMEM;
        if (!s) {
            **dst = g;
            w->packed = mark;
        }
    }
    return s;
}

/* ---- resident bytes -------------------------------------------------------------------------- */
static void count_linear(const mq_linear *l, int64_t *res, int64_t *f32) {
    int64_t wb = l->out * l->in * 4, bb = l->bias ? l->out * 4 : 0;
    *f32 += wb + bb;
    *res += bb + (l->w ? wb : l->gw ? (int64_t)mq_ggml_mat_bytes(l->gw)
                                    : (int64_t)mq_packed_weight_bytes(l->qw));
}

static void count_bytes(const moeq_model *m, int64_t *res, int64_t *f32) {
    const mq_config *c = &m->cfg;
    int64_t D = c->D, VD = (int64_t)c->vocab * D, vec = 0, q = (int64_t)c->n_heads * c->head_dim,
            kv = (int64_t)c->n_kv_heads * c->head_dim;
    *res = *f32 = 0;
    vec += VD + D + (c->tie_embeddings ? 0 : VD);
    for (int l = 0; l < c->n_layers; l++) {
        const mq_layer *ly = &m->layers[l];
        vec += 2 * D;
        if (ly->q_norm) vec += c->qk_norm == MQ_QKNORM_FULL ? q + kv : 2 * (int64_t)c->head_dim;
        if (c->mla) vec += c->q_lora_rank + c->kv_lora_rank;
        const mq_linear *att[8] = {&ly->q, &ly->k, &ly->v, &ly->o, &ly->q_a, &ly->q_b, &ly->kv_a,
                                   &ly->kv_b};
        for (int i = 0; i < 8; i++)
            if (att[i]->name) count_linear(att[i], res, f32);
        if (!ly->is_moe) {
            count_linear(&ly->gate, res, f32);
            count_linear(&ly->up, res, f32);
            count_linear(&ly->down, res, f32);
            continue;
        }
        vec += (int64_t)c->n_experts * D + (ly->sh_gate_w ? D : 0) +
               (c->router_bias ? c->n_experts : 0);
        for (int e = 0; e < c->n_experts; e++) {
            count_linear(&ly->exp_gate[e], res, f32);
            count_linear(&ly->exp_up[e], res, f32);
            count_linear(&ly->exp_down[e], res, f32);
        }
        if (c->shared_ffn > 0) {
            count_linear(&ly->sh_gate, res, f32);
            count_linear(&ly->sh_up, res, f32);
            count_linear(&ly->sh_down, res, f32);
        }
        if (ly->pexperts) *res += (int64_t)moeq_moe_experts_bytes(ly->pexperts);
    }
    *res += 4 * vec;
    *f32 += 4 * vec;
    /* mapped embeddings / lm_head: their file bytes, not fp32 */
    if (m->embed_g) *res -= VD * 4 - (int64_t)mq_ggml_mat_bytes(m->embed_g);
    if (m->head_g && m->head_g != m->embed_g) *res -= VD * 4 - (int64_t)mq_ggml_mat_bytes(m->head_g);
}

/* Marks the Linears whose input the emulated activation quantizer sees: all decoder Linears of
 * an unquantized model, only those stored quantized in a quantized one. Q8_0 (llama.cpp's blocks
 * of 32) needs each marked Linear's input width to be a multiple of 32. */
static moeq_status check_q8_0_width(const moeq_model *m, const mq_linear *x) {
    if (!x->act_q || x->in % 32 == 0) return MOEQ_OK;
    return mq_err(MOEQ_E_UNSUPPORTED, "%s: act_quant q8_0: %s has %lld inputs, not a multiple of "
                  "32 (llama.cpp's Q8_0 blocks)", m->dir, x->name ? x->name : "a Linear",
                  (long long)x->in);
}

/* A checkpoint imported from GGUF (moeq_import_gguf) records each matrix's ggml type in
 * gguf_types.json; NULL when there is none. (A .gguf opened directly has the same document in
 * m->gguf_types.) */
static moeq_status gguf_types(const moeq_model *m, cJSON **out) {
    *out = NULL;
    char *p = mq_path_join(m->dir, "gguf_types.json"), *text = NULL;
    size_t len = 0;
    if (!p) return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status s = mq_file_exists(p) ? mq_read_file(p, &text, &len) : MOEQ_OK;
    if (!s && text && !(*out = cJSON_ParseWithLength(text, len)))
        s = mq_err(MOEQ_E_FORMAT, "%s: not valid JSON", p);
    free(text);
    free(p);
    return s;
}

/* The activations llama.cpp's CPU backend gives a matmul with a weight of this ggml type (its
 * vec_dot_type): Q8_0 for Q4_0, Q5_0, NVFP4, IQ4_NL and Q8_0; Q8_1 (the same values plus a block
 * sum) for Q4_1 and Q5_1; Q8_K for the K-quants and IQ4_XS; F16/BF16 weights their own type and F32 fp32, both
 * left as they are (MQ_ACTQ_NONE). */
static uint8_t act_kind(const char *v) {
    if (!strcmp(v, "q4_0") || !strcmp(v, "q4_1") || !strcmp(v, "q5_0") || !strcmp(v, "q5_1") ||
        !strcmp(v, "q8_0") || !strcmp(v, "nvfp4") || !strcmp(v, "iq4_nl"))
        return MQ_ACTQ_MODEL;
    if (!strcmp(v, "q3_K") || !strcmp(v, "q4_K") || !strcmp(v, "q5_K") || !strcmp(v, "q6_K") ||
        !strcmp(v, "iq4_xs"))
        return MQ_ACTQ_Q8_K;
    return MQ_ACTQ_NONE;
}

static bool q8_0_type(const char *v) { return act_kind(v) == MQ_ACTQ_MODEL; }

static uint8_t gguf_activations(const cJSON *types, const char *name, const char *suffix) {
    char key[320];
    snprintf(key, sizeof key, "%s%s", name, suffix);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(types, key);
    return act_kind(cJSON_IsString(t) ? t->valuestring : "");
}

/* deepseek2's kv_b_proj comes from attn_k_b and attn_v_b ("TYPE_K+TYPE_V"): llama.cpp's Q8_0
 * rounding falls on q_nope and on the latent attention output, not on kv_b's input; the second
 * is emulated (vb_act_q) */
static bool v_b_q8_0(const cJSON *types, const char *name) {
    char key[320];
    snprintf(key, sizeof key, "%s.weight", name);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(types, key);
    const char *plus = cJSON_IsString(t) ? strchr(t->valuestring, '+') : NULL;
    return plus && q8_0_type(plus + 1);
}

static moeq_status mark_act_quant(moeq_model *m, bool loaded) {
    if (m->act_quant == MOEQ_ACT_QUANT_NONE) return MOEQ_OK;
    bool all = m->cfg.quant_method == NULL || m->cfg.fp8_block_rows > 0;   /* FP8: all fp32 */
    for (int l = 0; l < m->cfg.n_layers; l++) {
        mq_layer *ly = &m->layers[l];
        mq_linear *v[MQ_LAYER_LINEARS];
        mq_layer_linears(ly, v);
        for (int i = 0; i < MQ_LAYER_LINEARS; i++) v[i]->act_q = v[i]->name && (all || v[i]->stored_quantized);
        if (!ly->is_moe) continue;
        for (int e = 0; e < m->cfg.n_experts; e++) {
            mq_linear *x[3] = {&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e]};
            for (int i = 0; i < 3; i++) x[i]->act_q = all || x[i]->stored_quantized;
        }
    }
    if (m->act_quant != MOEQ_ACT_QUANT_Q8_0) return MOEQ_OK;
    /* from a GGUF file: by the type each Linear (and lm_head) has in it */
    cJSON *owned = NULL;
    moeq_status s = m->gguf_types ? MOEQ_OK : gguf_types(m, &owned);
    const cJSON *types = m->gguf_types ? m->gguf_types : owned;
    if (types) m->lm_head_act_q = gguf_activations(types, "lm_head", ".weight");
    for (int l = 0; !s && l < m->cfg.n_layers; l++) {
        mq_layer *ly = &m->layers[l];
        mq_linear *v[MQ_LAYER_LINEARS];
        mq_layer_linears(ly, v);
        for (int i = 0; types && i < MQ_LAYER_LINEARS; i++)
            v[i]->act_q = v[i]->name ? gguf_activations(types, v[i]->name, ".weight") : MQ_ACTQ_NONE;
        for (int i = 0; !s && i < MQ_LAYER_LINEARS; i++) s = check_q8_0_width(m, v[i]);
        ly->vb_act_q = types && m->cfg.mla && ly->kv_b.name && v_b_q8_0(types, ly->kv_b.name);
        int32_t kr = m->cfg.kv_lora_rank;
        /* a lazily opened model loads kv_b in fp32 later (act_quant never packs) */
        if (!s && ly->vb_act_q && (kr % 32 || kr > 4096 || (loaded && !ly->kv_b.w)))
            s = mq_err(MOEQ_E_UNSUPPORTED, "%s: act_quant q8_0: layer %d's latent attention "
                       "output (kv_lora_rank %d) cannot take llama.cpp's Q8_0 rounding (a "
                       "multiple of 32 up to 4096, fp32 weights)", m->dir, l, kr);
        for (int e = 0; !s && ly->is_moe && e < m->cfg.n_experts; e++) {
            mq_linear *x[3] = {&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e]};
            for (int i = 0; types && i < 3; i++)
                x[i]->act_q = x[i]->name ? gguf_activations(types, x[i]->name, ".weight") : MQ_ACTQ_NONE;
            for (int i = 0; !s && i < 3; i++) s = check_q8_0_width(m, x[i]);
            if (!s && x[0]->act_q != x[1]->act_q)   /* the routed experts share one rounded input */
                s = mq_err(MOEQ_E_UNSUPPORTED, "%s: act_quant q8_0: %s and %s take other "
                           "activation types in llama.cpp (not emulated)", m->dir,
                           x[0]->name ? x[0]->name : "gate", x[1]->name ? x[1]->name : "up");
        }
    }
    if (!s && m->lm_head_act_q && m->cfg.D % 32 != 0)
        s = mq_err(MOEQ_E_UNSUPPORTED, "%s: act_quant q8_0: lm_head has %lld inputs, not a "
                   "multiple of 32 (llama.cpp's Q8_0 blocks)", m->dir, (long long)m->cfg.D);
    cJSON_Delete(owned);
    return s;
}

/* ---- open / free --------------------------------------------------------------------------- */
static void linear_free(mq_linear *l) {
    MQ_RELEASE_EACH(l->w, l->gw, l->bias);
    free(l->name);
    mq_packed_weight_free(l->qw);
}

void moeq_model_free(moeq_model *m) {
    if (!m) return;
    if (m->lazy) {   /* a streamed model belongs to its lazy model */
        mq_lazy_close(m->lazy);
        return;
    }
    mq_gguf_detach_cached(m);
    for (int l = 0; m->layers && l < m->cfg.n_layers; l++) {
        mq_layer *ly = &m->layers[l];
        mq_linear *lin[MQ_LAYER_LINEARS];
        mq_layer_linears(ly, lin);
        for (int i = 0; i < MQ_LAYER_LINEARS; i++) linear_free(lin[i]);
        MQ_RELEASE_EACH(ly->attn_norm, ly->ffn_norm, ly->q_norm, ly->k_norm, ly->q_a_norm, ly->kv_a_norm, ly->router,
                        ly->router_bias, ly->sh_gate_w);
        for (int e = 0; e < m->cfg.n_experts; e++) {
            if (ly->exp_gate) linear_free(&ly->exp_gate[e]);
            if (ly->exp_up) linear_free(&ly->exp_up[e]);
            if (ly->exp_down) linear_free(&ly->exp_down[e]);
        }
        MQ_FREE_EACH(ly->exp_gate, ly->exp_up, ly->exp_down);
        moeq_moe_experts_free(ly->pexperts);
    }
    free(m->layers);
    if (m->lm_head != m->embed) mq_free(m->lm_head);
    mq_free(m->embed);
    if (m->head_g != m->embed_g) mq_free(m->head_g);
    mq_free(m->embed_g);
    if (m->head_copy) munmap(m->head_copy, m->head_copy_bytes);
    mq_st_close(m->mapped);
    mq_pack_cache_close(m->pcache);
    mq_free(m->final_norm);
    moeq_tokenizer_free(m->tok);
    cJSON_Delete(m->gguf_types);
    free(m->quant_scheme);
    free(m->dir);
    mq_config_free(&m->cfg);
    free(m);
}

void mq_fill_info(moeq_model *m) {
    const mq_config *c = &m->cfg;
    moeq_model_info *i = &m->info;
    i->model_type = c->model_type;
    i->vocab_size = c->vocab;
    i->hidden_size = c->D;
    i->n_layers = c->n_layers;
    i->n_heads = c->n_heads;
    i->n_kv_heads = c->n_kv_heads;
    i->head_dim = c->head_dim;
    i->intermediate_size = c->ffn;
    i->n_experts = c->n_experts;
    i->n_experts_per_tok = c->top_k;
    i->moe_intermediate_size = c->moe_ffn;
    i->shared_expert_intermediate_size = c->shared_ffn;
    i->max_position_embeddings = c->max_pos;
    i->bos_token_id = c->bos >= 0 ? c->bos : (m->tok ? moeq_tokenizer_bos(m->tok) : -1);
    i->eos_token_id = c->eos >= 0 ? c->eos : (m->tok ? moeq_tokenizer_eos(m->tok) : -1);
    mq_config_param_counts(c, &i->n_params, NULL);
    i->quant_scheme = m->quant_scheme;
}

moeq_status mq_config_load(const char *dir, mq_config *out) {
    memset(out, 0, sizeof *out);
    char *json = NULL, *path = NULL;
    size_t len = 0;
    moeq_status s = mq_config_file_read(dir, &path, &json, &len);   /* counted: ckpt/source.h */
    if (!s) s = mq_config_parse(json, len, path, out);
    free(json);
    free(path);
    return s;
}

static char *scheme_name(const mq_config *c) {
    if (!c->quant_method) return NULL;
    return c->quant_format ? mq_asprintf("%s/%s", c->quant_method, c->quant_format)
                           : mq_strdup(c->quant_method);
}

/* Config and weights of a model path: a checkpoint directory, or a GGUF file read in place
 * (io/gguf_hf.h: the tensors stay in the mapped file; config.json, tokenizer.json when asked for
 * and the ggml types are made in memory, into docs, which the caller frees). config.json goes
 * through the parser as the text moeq_import_gguf would write, so both read the same config. */
/* given: config.json already parsed by the caller (taken over, left zeroed), else NULL: read. */
moeq_status mq_open_source(const char *path, bool tokenizer, mq_config *given, mq_config *cfg,
                               mq_st **st, mq_gguf_docs *docs) {
    memset(docs, 0, sizeof *docs);
    if (!mq_is_gguf_file(path)) {
        moeq_status s = MOEQ_OK;
        if (given) {
            *cfg = *given;
            memset(given, 0, sizeof *given);
        } else {
            s = mq_config_load(path, cfg);
        }
        return s ? s : mq_st_open_dir_blocks(path, (mq_fp8_blocks){cfg->fp8_block_rows, cfg->fp8_block_cols}, st);
    }
    if (given) mq_config_free(given);   /* a .gguf's config comes from its KVs */
    memset(cfg, 0, sizeof *cfg);
    moeq_status s = mq_st_open_gguf(path, tokenizer, st, docs);
    if (s) return s;
    char *text = cJSON_Print(docs->config);
    s = text ? mq_config_parse(text, strlen(text), path, cfg) : mq_err(MOEQ_E_NOMEM, "out of memory");
    free(text);
    return s;
}

/* The tokenizer of a model path (none, without an error, where a directory has none). */
moeq_status mq_open_tokenizer(const char *path, const mq_gguf_docs *docs, moeq_tokenizer **tok) {
    if (docs->tokenizer) return mq_tokenizer_from_json(path, docs->tokenizer, docs->config, tok);
    moeq_status s = MOEQ_OK;
    char *tp = mq_tokenizer_find(path);   /* tokenizer.json, else tiktoken.model */
    if (tp) {
        s = moeq_tokenizer_load(tp, tok);
        if (s) s = mq_err_prefix(s, "%s", path);
    }
    free(tp);
    return s;
}

/* moeq_model_options.stream: the lazy model's structure, weights a layer at a time (eval). The
 * same choices as a whole load: packed where keep_packed would pack, routed experts through the
 * ordinary (not row-independent) products, the activation quantizer's marks. */
static moeq_status open_streamed(const char *dir, const moeq_model_options *o, moeq_model **out) {
    mq_lazy_model *lz = NULL;
    moeq_status s = mq_lazy_open(dir, !o->no_tokenizer, &lz);
    if (s) return s;
    moeq_model *m = mq_lazy_model_of(lz);
    m->lazy = lz;
    m->act_quant = o->act_quant;
    mq_model_det_experts(m, false);
    bool pack = o->keep_packed && m->cfg.quant_method && m->cfg.fp8_block_rows == 0 && !o->act_quant;
    mq_lazy_set_packed(lz, pack);
    if (m->cfg.quant_method && !(m->quant_scheme = scheme_name(&m->cfg)))
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!s) s = mark_act_quant(m, false);
    if (s) {
        moeq_model_free(m);
        return s;
    }
    mq_fill_info(m);
    m->info.act_quant = m->act_quant;
    int64_t peak = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        int64_t b = mq_lazy_layer_bytes(lz, l);
        peak = b > peak ? b : peak;
    }
    /* resident weights: the largest layer and the output layer, as a stream holds them */
    m->info.weight_bytes = peak + mq_lazy_head_bytes(lz);
    m->info.weight_bytes_whole = m->info.weight_bytes_fp32 = mq_lazy_bytes(lz, -1, MQ_PART_GLOBAL, 0, 0);
    for (int l = 0; l < m->cfg.n_layers; l++) {
        m->info.weight_bytes_whole += mq_lazy_layer_bytes(lz, l);
        /* every tensor's fp32 bytes (count_bytes would see no lm_head and no biases: the lazy
         * model loads neither yet) */
        m->info.weight_bytes_fp32 += mq_lazy_bytes(lz, l, MQ_PART_LAYER, 0, m->cfg.n_experts);
    }
    *out = m;
    return MOEQ_OK;
}

moeq_status moeq_model_open(const char *dir, const moeq_model_options *opt, moeq_model **out) {
    if (!out) return mq_err(MOEQ_E_ARG, "moeq_model_open: out is NULL");
    *out = NULL;
    moeq_model_options o = {0};
    if (opt) o = *opt;
    if (o.act_quant != MOEQ_ACT_QUANT_NONE && o.act_quant != MOEQ_ACT_QUANT_NVFP4 &&
        o.act_quant != MOEQ_ACT_QUANT_Q8_0)
        return mq_err(MOEQ_E_ARG, "moeq_model_open: act_quant %d (expected MOEQ_ACT_QUANT_NONE, "
                      "MOEQ_ACT_QUANT_NVFP4 or MOEQ_ACT_QUANT_Q8_0)", o.act_quant);
    if (o.stream) return open_streamed(dir, &o, out);
    moeq_model *m = calloc(1, sizeof *m);
    if (!m) return mq_err(MOEQ_E_NOMEM, "out of memory");
    mq_st *st = NULL;
    want_list L = {0};
    mq_gguf_docs docs;
    moeq_status s = mq_open_source(dir, !o.no_tokenizer, NULL, &m->cfg, &st, &docs);
    m->gguf_types = docs.types;
    docs.types = NULL;
    if (s) goto fail;
    m->dir = mq_strdup(dir);
    m->quant_scheme = scheme_name(&m->cfg);
    m->layers = calloc((size_t)m->cfg.n_layers, sizeof(mq_layer));
    if (!m->layers || !m->dir) {
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto fail;
    }
    m->act_quant = o.act_quant;
    bool pack = o.keep_packed && m->cfg.quant_method && m->cfg.fp8_block_rows == 0;
    if (pack && o.act_quant) {
        mq_info("%s: activation quantization needs the dequantized fp32 path (the packed kernels "
                "are weight-only); keep_packed is ignored", dir);
        pack = false;
    }
    int n_fallback = 0;
    s = mq_build_wants(&L, st, m);
    if (!s) s = mq_check_wants(&L, st, m, dir);
    /* a .gguf: its blocks used in place (the mapping then stays open with the model) */
    bool in_place = o.keep_packed && !o.act_quant && mq_is_gguf_file(dir);
    if (!s && (pack || in_place)) s = mq_pack_cache_open(dir, &m->pcache);
    if (!s && pack) s = pack_quantized(&L, st, m, &n_fallback);
    if (!s && pack && m->n_packed > 0) s = mq_map_float_head(&L, m, true);   /* not all fp32 */
    if (!s && in_place) s = map_gguf(&L, m, &n_fallback);
    if (!s) s = load_wants(&L, st);
    if (!s) s = mark_act_quant(m, true);
    if (s) goto fail;
    if (m->cfg.tie_embeddings) m->lm_head = m->embed, m->head_g = m->embed_g;
    head_to_anon(m);
    mq_want_free(&L);
    L = (want_list){0};
    if (in_place || m->embed_g || m->head_g) m->mapped = st;   /* they point into it */
    else mq_st_close(st);
    st = NULL;
    if (m->pcache && (s = mq_pack_cache_commit(m->pcache)))   /* a cache not written costs time */
        mq_info("%s; the next open repacks again", moeq_last_error());
    s = MOEQ_OK;

    if (!o.no_tokenizer && (s = mq_open_tokenizer(dir, &docs, &m->tok))) goto fail;
    mq_gguf_docs_free(&docs);
    mq_fill_info(m);
    count_bytes(m, &m->info.weight_bytes, &m->info.weight_bytes_fp32);
    m->info.weight_bytes_whole = m->info.weight_bytes;
    m->info.packed_linears = m->n_packed;
    m->info.fallback_linears = n_fallback;
    m->info.act_quant = m->act_quant;
    *out = m;
    return MOEQ_OK;

fail:
    mq_want_free(&L);
    mq_st_close(st);
    mq_gguf_docs_free(&docs);
    moeq_model_free(m);
    return s;
}

const moeq_model_info *moeq_model_get_info(const moeq_model *m) { return m ? &m->info : NULL; }
const moeq_tokenizer *moeq_model_tokenizer(const moeq_model *m) { return m ? m->tok : NULL; }

