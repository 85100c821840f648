/*
 * A session on a CUDA device (session_gpu.h): model/forward.c's mq_forward_layers, final norm
 * and lm_head for new tokens, every layer resident on the GPU, driven through the backend's C
 * interface (backend/gpu.h) as the evaluation's driver (eval/eval_gpu.c) drives it for whole
 * windows, here over a KV cache.
 *
 * Per layer, in the CPU forward's order: the attention over the cache (mq_gpu_kvattn: norm,
 * q/k/v, the new keys and values appended, causal attention, o, residual) and the FFN input;
 * then the FFN as eval_gpu.c runs it: the routed experts as one GPU MoE op (quantized experts as
 * stored, codes and scales read from the checkpoint's files, mq_gpu_experts_read; unquantized ones
 * in bf16 with MOEQ_GPU_BF16), or as fp32 expert sets routed on the device and laid out on the
 * host (forward.c's moe_block order, mq_gpu_routes_run); the gated shared expert after them;
 * the residual add; a dense MLP straight onto the residual. Attention Linears the model holds
 * packed (a quantized checkpoint opened with keep_packed) go up as their codes and are decoded on
 * the device into fp32 weights (mq_gpu_kvattn_set_quantized: mq_dequantize's bits); other packed
 * Linears (shared experts, dense MLPs, K-quants) are read from the checkpoint as fp32 on the host
 * (ckpt's mq_load_linear_weight: the loader's own dequantization, bit for bit).
 * TODO(issue 55): run them packed on the device (the weights are fp32 there today).
 *
 * The tokens of a call go through in pieces of at most mq_gpu_kvattn_rows rows, each piece
 * through every layer before the next: the cache then holds what the CPU's does. Every step is a
 * function of its row (the attention of its position's keys), so in fp32 one call of n tokens and
 * n calls of one give the same bits.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/gpu.h"
#include "ckpt/layout.h"
#include "ckpt/source.h"
#include "eval/eval_gpu.h"
#include "runtime/session_gpu.h"

enum {
    PIECE_ROWS = 512,    /* new tokens a pass over the layers (fewer where the scores need it) */
    EXPERT_ROWS = 2048   /* the fp32 expert sets' rows a product (their lanes' scratch) */
};

/* How a MoE layer's routed experts run. */
enum { EX_NONE = 0, EX_CODES, EX_BF16, EX_FP32 };

typedef struct {
    int experts;            /* EX_* */
    mq_gpu_moe *moe;        /* EX_CODES, EX_BF16: the MoE op (routing on the device) */
    mq_gpu_mlp *set;        /* EX_FP32: the expert set, routed by the attention's router */
    mq_gpu_mlp *shared;     /* the shared expert, or NULL */
    mq_gpu_mlp *dense;      /* a dense layer's MLP, or NULL */
    mq_gpu_buf *gate;       /* [D]: the shared expert's gate, or NULL */
} gpu_layer;

struct mq_session_gpu {
    const moeq_model *m;
    mq_gpu *g;
    moeq_gpu_precision prec;
    int moe_math;             /* MQ_GPU_MOE_FP32 or _BF16 */
    mq_state *st;             /* the host's RoPE tables */
    mq_st *own;               /* the checkpoint's tensors where the model does not keep them mapped */
    mq_gpu_kvattn *att;
    gpu_layer *L;             /* [n_layers] */
    mq_gpu_head *head;
    mq_gpu_buf *h, *xn, *out; /* [rows, D] each: the residual stream, the FFN input, the FFN output */
    int64_t rows;
    /* host scratch of a piece */
    mq_gpu_routes rt;         /* the routing and the fp32 expert sets' layout */
    int32_t *targets;
    float *hx;
    mq_gpu_row_stats *stats;
    char desc[160];
};

const char *mq_session_gpu_describe(const mq_session_gpu *G) { return G->desc; }

void mq_session_gpu_close(mq_session_gpu *G) {
    if (!G) return;
    if (G->L)
        for (int l = 0; l < G->m->cfg.n_layers; l++) {
            gpu_layer *L = &G->L[l];
            mq_gpu_moe_free(L->moe);
            mq_gpu_mlp_free(L->set);
            mq_gpu_mlp_free(L->shared);
            mq_gpu_mlp_free(L->dense);
            mq_gpu_buf_free(L->gate);
        }
    mq_gpu_kvattn_free(G->att);
    mq_gpu_head_free(G->head);
    mq_gpu_buf_free(G->h);
    mq_gpu_buf_free(G->xn);
    mq_gpu_buf_free(G->out);
    mq_gpu_close(G->g);
    mq_state_free(G->st);
    mq_st_close(G->own);
    mq_gpu_routes_free(&G->rt);
    MQ_FREE_EACH(G->L, G->targets, G->stats);
    mq_free(G->hx);
    free(G);
}

/* ---- the weights ------------------------------------------------------------------------------ */
/* The checkpoint's tensors (opened on first use): where the Linears the model holds packed and
 * the experts' codes are read from. */
static moeq_status source(mq_session_gpu *G, const mq_st **out) {
    if (G->m->mapped) {
        *out = G->m->mapped;
        return MOEQ_OK;
    }
    if (!G->own) {
        moeq_status s = mq_st_open_dir(G->m->dir, &G->own);
        if (s) return mq_err_prefix(s, "%s: reading the quantized weights for the GPU", G->m->dir);
    }
    *out = G->own;
    return MOEQ_OK;
}

/* lin's fp32 weight [out, in]: the model's own, or read from the checkpoint into *tmp (the
 * caller frees it with mq_free after the upload). */
static moeq_status weight_f32(mq_session_gpu *G, const mq_linear *lin, const float **w, float **tmp) {
    *tmp = NULL;
    *w = lin->w;
    if (lin->w) return MOEQ_OK;
    if (!lin->name) return mq_err(MOEQ_E_ARG, "GPU session: a Linear without a name or weights");
    const mq_st *st;
    moeq_status s = source(G, &st);
    if (s) return s;
    if (!(*tmp = mq_alloc_array((size_t)lin->out, (size_t)lin->in * sizeof(float), lin->name))) return MOEQ_E_NOMEM;
    s = mq_load_linear_weight(st, lin->name, lin->out, lin->in, *tmp, NULL);
    if (s) {
        mq_free(*tmp);
        *tmp = NULL;
        return s;
    }
    *w = *tmp;
    return MOEQ_OK;
}

static const mq_tensor_view *lookup(void *user, const char *name) { return mq_st_find((const mq_st *)user, name); }

/* Whether lin (not loaded as fp32) is stored in a quantized layout whose codes the device decodes
 * (compressed-tensors NVFP4 or INT4, ModelOpt NVFP4, GPTQ). */
static bool decoded_on_device(mq_session_gpu *G, const mq_linear *lin) {
    const mq_st *st;
    if (!lin->name || source(G, &st)) return false;
    const mq_linear_kind k = mq_layout_detect(lin->name, lookup, (void *)st);
    return k == MQ_LIN_CT_NVFP4 || k == MQ_LIN_CT_INT4 || k == MQ_LIN_MODELOPT_NVFP4 || k == MQ_LIN_GPTQ;
}

/* Attention Linear `which` of layer l from its codes, decoded on the device. */
static moeq_status decode_on_device(mq_session_gpu *G, int l, int which, const mq_linear *lin) {
    const mq_st *st;
    mq_qtensor q;
    moeq_status s = source(G, &st);
    if (s) return s;
    s = mq_layout_read(lin->name, lin->out, lin->in, lookup, (void *)st, &q);
    if (!s) s = mq_gpu_kvattn_set_quantized(G->att, l, which, &q);
    mq_qtensor_free(&q);
    return s;
}

/* The expert set's n Linears' fp32 weights into w[0 .. n) (tmp[i] what was read for them). */
static moeq_status weights_f32(mq_session_gpu *G, const mq_linear *lins, int64_t n, const float **w, float **tmp) {
    moeq_status s = MOEQ_OK;
    for (int64_t i = 0; i < n && !s; i++) s = weight_f32(G, &lins[i], &w[i], &tmp[i]);
    return s;
}

/* How layer l's routed experts will run: as stored (every expert's three Linears stored NVFP4
 * with groups of 16 or INT4 with groups of 32 or more, without act-order), else fp32 weights on
 * the bf16 op or the fp32 expert sets. *bytes: what they take on the device (the op's packed
 * codes and scales as counted here are within a few percent of mq_gpu_moe_bytes). */
static int experts_kind(mq_session_gpu *G, int l, int64_t rows, int64_t *bytes) {
    const mq_config *c = &G->m->cfg;
    const mq_layer *ly = &G->m->layers[l];
    const int64_t E = c->n_experts, D = c->D, F = c->moe_ffn, n = 3 * E * F * D;
    bool stored = ly->exp_gate != NULL;
    for (int64_t e = 0; stored && e < E; e++)
        stored = ly->exp_gate[e].stored_quantized && ly->exp_up[e].stored_quantized &&
                 ly->exp_down[e].stored_quantized && ly->exp_gate[e].name;
    const mq_st *st = NULL;
    mq_linear_qinfo qi;
    if (stored && !source(G, &st) && !mq_linear_qinfo_get(st, ly->exp_gate[0].name, &qi) && !qi.act_order &&
        ((qi.scheme == MQ_QS_NVFP4 && qi.group_size == 16) ||
         (qi.scheme == MQ_QS_INT4 && qi.group_size >= 32 && qi.group_size % 32 == 0))) {
        const int64_t groups = n / qi.group_size;
        *bytes = n / 2 + groups * (qi.scheme == MQ_QS_NVFP4 ? 1 : 4 + (qi.asym ? 1 : 0)) + 3 * E * 4;
        return EX_CODES;
    }
    if (G->prec == MOEQ_GPU_BF16) {
        *bytes = n * 2;
        return EX_BF16;
    }
    const int64_t r = rows * c->top_k < EXPERT_ROWS ? rows * c->top_k : EXPERT_ROWS;
    *bytes = mq_gpu_mlp_bytes(E, D, F, true, r, 1);
    return EX_FP32;
}

/* An MLP of one expert (a shared expert, a dense MLP) up to the device in fp32. */
static moeq_status one_mlp(mq_session_gpu *G, const mq_linear *gate, const mq_linear *up, const mq_linear *down,
                           mq_gpu_mlp **out) {
    const float *w[3];
    float *tmp[3] = {NULL, NULL, NULL};
    moeq_status s = weight_f32(G, gate, &w[0], &tmp[0]);
    if (!s) s = weight_f32(G, up, &w[1], &tmp[1]);
    if (!s) s = weight_f32(G, down, &w[2], &tmp[2]);
    if (!s) s = mq_gpu_mlp_new(G->g, 1, G->m->cfg.D, gate->out, &w[0], &w[1], &w[2], G->rows, out);
    MQ_RELEASE_EACH(tmp[0], tmp[1], tmp[2]);
    return s;
}

/* Layer l's routed experts up to the device as `kind` says (EX_CODES falls back to fp32 weights
 * where the op cannot take them as stored). */
static moeq_status upload_experts(mq_session_gpu *G, int l, int kind) {
    const mq_config *c = &G->m->cfg;
    const mq_layer *ly = &G->m->layers[l];
    gpu_layer *L = &G->L[l];
    const int64_t E = c->n_experts, D = c->D, F = c->moe_ffn;
    moeq_moe_ffn_args r = {.router = {.data = ly->router, .dtype = MOEQ_DT_F32, .ndim = 2, .shape = {E, D},
                                      .nbytes = (size_t)(E * D) * sizeof(float)},
                           .top_k = c->top_k, .scoring = MOEQ_MOE_SOFTMAX, .renormalize = c->norm_topk_prob,
                           .route_scale = 1.0f};
    if (!ly->router) return mq_err(MOEQ_E_ARG, "layer %d: the router is not loaded", l);
    moeq_status s = MOEQ_OK;
    if (kind == EX_CODES) {
        const mq_st *st;
        mq_gpu_experts x;
        s = source(G, &st);
        if (!s) s = mq_gpu_experts_read(st, c, ly, l, &x);
        if (!s) {
            s = mq_gpu_moe_upload(G->g, &x.desc, x.has_zp ? &x.zp : NULL, &r, &L->moe);
            mq_gpu_experts_free(&x);
            L->experts = EX_CODES;
            return s;
        }
        if (s != MOEQ_E_UNSUPPORTED) return s;
        mq_info("%s; layer %d's experts go to the GPU as fp32 weights", moeq_last_error(), l);
        kind = G->prec == MOEQ_GPU_BF16 ? EX_BF16 : EX_FP32;
    }
    const float **w = calloc((size_t)(3 * E), sizeof *w);
    float **tmp = calloc((size_t)(3 * E), sizeof *tmp);
    if (!w || !tmp) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!s) s = weights_f32(G, ly->exp_gate, E, w, tmp);
    if (!s) s = weights_f32(G, ly->exp_up, E, w + E, tmp + E);
    if (!s) s = weights_f32(G, ly->exp_down, E, w + 2 * E, tmp + 2 * E);
    const int64_t rows = G->rows * c->top_k < EXPERT_ROWS ? G->rows * c->top_k : EXPERT_ROWS;
    if (!s && kind == EX_BF16)
        s = mq_gpu_moe_upload_dense(G->g, E, D, F, 0, (const void *const *)w, (const void *const *)(w + E),
                                    (const void *const *)(w + 2 * E), &r, &L->moe);
    else if (!s)
        s = mq_gpu_mlp_new(G->g, E, D, F, w, w + E, w + 2 * E, rows, &L->set);
    for (int64_t i = 0; tmp && i < 3 * E; i++) mq_free(tmp[i]);
    free(tmp);
    free((void *)w);
    L->experts = kind;
    return s;
}

/* Layer l up to the device: its experts, shared expert or dense MLP, then its attention (with
 * the router where the host lays the experts' rows out). */
static moeq_status upload_layer(mq_session_gpu *G, int l, int kind) {
    const mq_config *c = &G->m->cfg;
    const mq_layer *ly = &G->m->layers[l];
    gpu_layer *L = &G->L[l];
    if (!ly->attn_norm || !ly->ffn_norm) return mq_err(MOEQ_E_ARG, "GPU layer %d: its norms are not loaded", l);
    moeq_status s = MOEQ_OK;
    if (ly->is_moe) {
        s = upload_experts(G, l, kind);
        if (!s && c->shared_ffn > 0) s = one_mlp(G, &ly->sh_gate, &ly->sh_up, &ly->sh_down, &L->shared);
        if (!s && c->shared_ffn > 0 && c->shared_gate) {
            if (!ly->sh_gate_w) return mq_err(MOEQ_E_ARG, "GPU layer %d: shared_expert_gate not loaded", l);
            s = mq_gpu_buf_new(G->g, c->D, &L->gate);
            if (!s) s = mq_gpu_buf_write(L->gate, 0, c->D, ly->sh_gate_w);
        }
    } else {
        s = one_mlp(G, &ly->gate, &ly->up, &ly->down, &L->dense);
    }
    const mq_linear *lin[4] = {&ly->q, &ly->k, &ly->v, &ly->o};
    const float *w[4] = {NULL, NULL, NULL, NULL};
    float *tmp[4] = {NULL, NULL, NULL, NULL};
    bool dev[4] = {false, false, false, false};
    for (int i = 0; i < 4 && !s; i++) {
        dev[i] = !lin[i]->w && decoded_on_device(G, lin[i]);
        if (!dev[i]) s = weight_f32(G, lin[i], &w[i], &tmp[i]);
    }
    if (!s) {
        const mq_gpu_attn_weights aw = {
            .norm = ly->attn_norm, .q = w[0], .k = w[1], .v = w[2], .o = w[3], .q_bias = ly->q.bias,
            .k_bias = ly->k.bias, .v_bias = ly->v.bias, .o_bias = ly->o.bias, .q_norm = ly->q_norm,
            .k_norm = ly->k_norm, .window = c->layer_sliding && c->layer_sliding[l] ? c->sliding_window : 0,
            .ffn_norm = ly->ffn_norm, .router = L->experts == EX_FP32 ? ly->router : NULL};
        s = mq_gpu_kvattn_set(G->att, l, &aw);
    }
    MQ_RELEASE_EACH(tmp[0], tmp[1], tmp[2], tmp[3]);
    for (int i = 0; i < 4 && !s; i++)
        if (dev[i]) s = decode_on_device(G, l, i, lin[i]);
    return s ? mq_err_prefix(s, "GPU layer %d", l) : MOEQ_OK;
}

/* The output layer: the final norm and lm_head (the model's fp32, or read from the checkpoint). */
static moeq_status upload_head(mq_session_gpu *G) {
    const moeq_model *m = G->m;
    const mq_config *c = &m->cfg;
    if (!m->final_norm) return mq_err(MOEQ_E_ARG, "%s: the final norm is not loaded", m->dir);
    const float *W = m->lm_head;
    float *tmp = NULL;
    moeq_status s = MOEQ_OK;
    if (!W) {
        mq_linear head = {.out = c->vocab, .in = c->D,
                          .name = (char *)(c->tie_embeddings ? "model.embed_tokens" : "lm_head")};
        s = weight_f32(G, &head, &W, &tmp);
    }
    if (!s) s = mq_gpu_head_new(G->g, c->D, c->vocab, m->final_norm, c->rms_eps, W, G->rows, &G->head);
    mq_free(tmp);
    return s;
}

/* ---- open ------------------------------------------------------------------------------------- */
moeq_status mq_session_gpu_open(const moeq_model *m, int32_t max_tokens, const moeq_session_options *o,
                                mq_session_gpu **out) {
    *out = NULL;
    const mq_config *c = &m->cfg;
    char buf[160];
    const char *why = mq_gpu_model_lacks(m, true, buf, sizeof buf);
    if (why)
        return mq_err(MOEQ_E_UNSUPPORTED, "--device cuda: %s has %s, which GPU generation lacks; run it on the CPU "
                      "(--device cpu)", m->dir ? m->dir : "the model", why);
    if (o->gpu_precision < MOEQ_GPU_FP32 || o->gpu_precision > MOEQ_GPU_BF16)
        return mq_err(MOEQ_E_ARG, "session: gpu_precision %d (fp32 0, tf32x3 1, tf32 2, bf16 3)", o->gpu_precision);
    if (max_tokens <= 0) return mq_err(MOEQ_E_ARG, "session: %d positions", max_tokens);
    moeq_status s = mq_gpu_probe(o->device);   /* no device: fail before anything is made */
    if (s) return s;
    mq_session_gpu *G = calloc(1, sizeof *G);
    if (!G) return mq_err(MOEQ_E_NOMEM, "out of memory");
    G->m = m;
    G->prec = (moeq_gpu_precision)o->gpu_precision;
    G->moe_math = G->prec == MOEQ_GPU_BF16 ? MQ_GPU_MOE_BF16 : MQ_GPU_MOE_FP32;
    const int nl = c->n_layers;
    const int64_t D = c->D, V = c->vocab, K = c->n_experts > 0 ? c->top_k : 0;
    mq_gpu_attn_shape sh = {.D = D, .H = c->n_heads, .KV = c->n_kv_heads, .hd = c->head_dim, .max_T = max_tokens,
                            .eps = c->rms_eps,
                            .qk_norm = c->qk_norm == MQ_QKNORM_FULL ? 1 : c->qk_norm == MQ_QKNORM_HEAD ? 2 : 0,
                            .clip_qkv = c->clip_qkv, .E = c->n_experts, .top_k = K, .norm_topk = c->norm_topk_prob};
    G->rows = mq_gpu_kvattn_rows_for(&sh, PIECE_ROWS);
    s = mq_gpu_open(o->device, &G->g);
    if (!s) mq_gpu_set_memory_limit(G->g, o->max_gpu_memory);
    /* bf16: the routed experts on the MoE op's tensor cores, everything else as tf32 (as eval's) */
    if (!s) s = mq_gpu_set_precision(G->g, G->prec == MOEQ_GPU_BF16 ? MOEQ_GPU_TF32 : G->prec);
    if (!s) s = mq_state_new_ex(m, max_tokens, false, &G->st);
    if (!s && !(G->L = calloc((size_t)nl, sizeof *G->L))) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    int *kind = s ? NULL : calloc((size_t)nl, sizeof *kind);
    if (!s && !kind) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    /* the plan: every layer's bytes on the device before anything goes up */
    int64_t experts = 0, mlps = 0;
    int routed = 0;
    for (int l = 0; l < nl && !s; l++) {
        const mq_layer *ly = &m->layers[l];
        int64_t b = 0;
        if (ly->is_moe) {
            kind[l] = experts_kind(G, l, G->rows, &b);
            experts += b;
            routed += kind[l] == EX_FP32;
            if (c->shared_ffn > 0) mlps += mq_gpu_mlp_bytes(1, D, c->shared_ffn, true, G->rows, 1) + D * 4;
        } else {
            mlps += mq_gpu_mlp_bytes(1, D, c->ffn, true, G->rows, 1);
        }
    }
    if (!s) {
        const int64_t att = mq_gpu_kvattn_bytes(&sh, nl, routed, G->rows);
        const int64_t head = (V * D + D + G->rows * (D + V) + 4 * G->rows) * 4, bufs = 3 * G->rows * D * 4;
        /* the cuBLAS workspaces and the MoE op's scratch are not in the sums above */
        const int64_t slack = (int64_t)256 << 20;
        const int64_t need = att + experts + mlps + head + bufs + slack;
        mq_gpu_info info;
        mq_gpu_get_info(G->g, &info);
        if (need > info.mem_free)
            s = mq_err(MOEQ_E_NOMEM, "--device cuda:%d: the model needs about %.3f GB on the GPU for %d positions "
                       "(attention and KV cache %.3f, routed experts %.3f, other MLPs %.3f, output layer %.3f, "
                       "work space %.3f), and %s %.3f GB", o->device, need / 1e9, max_tokens, att / 1e9,
                       experts / 1e9, mlps / 1e9, head / 1e9, (bufs + slack) / 1e9,
                       o->max_gpu_memory > 0 ? "--max-gpu-memory leaves" : "the device has free", info.mem_free / 1e9);
    }
    if (!s) {
        const float *cs, *sn;
        mq_state_rope_tables(G->st, &cs, &sn);
        sh.rope_cos = cs;
        sh.rope_sin = sn;
        s = mq_gpu_kvattn_new(G->g, &sh, nl, G->rows, &G->att);
    }
    for (int l = 0; l < nl && !s; l++) s = upload_layer(G, l, kind[l]);
    free(kind);
    if (!s) s = upload_head(G);
    if (!s) s = mq_gpu_buf_new(G->g, G->rows * D, &G->h);
    if (!s) s = mq_gpu_buf_new(G->g, G->rows * D, &G->xn);
    if (!s) s = mq_gpu_buf_new(G->g, G->rows * D, &G->out);
    if (!s) {
        const size_t R = (size_t)G->rows;
        const bool routes = mq_gpu_routes_alloc(&G->rt, G->rows, K, c->n_experts);
        G->targets = calloc(R, sizeof *G->targets);
        G->stats = malloc(R * sizeof *G->stats);
        G->hx = mq_alloc_array(R, (size_t)D * sizeof(float), "GPU session rows");
        if (!routes || !G->targets || !G->stats || !G->hx)
            s = mq_err(MOEQ_E_NOMEM, "out of memory for the GPU session's pieces of %lld rows", (long long)G->rows);
    }
    /* the checkpoint's files were only needed for the upload */
    mq_st_close(G->own);
    G->own = NULL;
    if (!s) {
        mq_gpu_info info;
        mq_gpu_get_info(G->g, &info);
        snprintf(G->desc, sizeof G->desc, "cuda:%d %s (%s)", info.device, info.name, mq_gpu_precision_name(G->prec));
    }
    if (s) {
        mq_session_gpu_close(G);
        return s;
    }
    *out = G;
    return MOEQ_OK;
}

/* ---- the forward -------------------------------------------------------------------------------- */
/* Layer l's FFN on the piece's R rows: the FFN input in G->xn, the residual stream in G->h. */
static moeq_status ffn(mq_session_gpu *G, int l, int64_t R) {
    const mq_config *c = &G->m->cfg;
    gpu_layer *L = &G->L[l];
    const int64_t D = c->D, E = c->n_experts, K = c->top_k;
    moeq_status s = MOEQ_OK;
    if (L->dense) {   /* the dense MLP onto the residual, one fmaf by 1 (the CPU's axpy) */
        s = mq_gpu_one_mlp_rows(L->dense, G->xn, G->rt.ident, R);
        return s ? s : mq_gpu_mlp_add_kept(L->dense, G->h, G->xn, NULL, R);
    }
    if (L->moe) {
        s = mq_gpu_moe_ffn_buf(L->moe, G->xn, R, L->experts == EX_BF16 ? MQ_GPU_MOE_BF16 : G->moe_math, G->out);
    } else {
        s = mq_gpu_routes_run(&G->rt, L->set, G->xn, G->out, R, D, K, E);
    }
    if (!s && L->shared) s = mq_gpu_one_mlp_rows(L->shared, G->xn, G->rt.ident, R);
    if (!s && L->shared) s = mq_gpu_mlp_add_kept(L->shared, G->out, G->xn, L->gate, R);
    if (!s) s = mq_gpu_buf_add(G->h, G->out, R * D);
    return s;
}

moeq_status mq_session_gpu_forward(mq_session_gpu *G, const float *x, int64_t n, int64_t pos, float *logits) {
    const mq_config *c = &G->m->cfg;
    const int64_t D = c->D, V = c->vocab;
    moeq_status s = MOEQ_OK;
    for (int64_t r0 = 0; r0 < n && !s; r0 += G->rows) {
        const int64_t R = n - r0 < G->rows ? n - r0 : G->rows;
        s = mq_gpu_buf_write(G->h, 0, R * D, x + r0 * D);
        for (int l = 0; l < c->n_layers && !s; l++) {
            const bool host_routing = G->L[l].experts == EX_FP32;
            s = mq_gpu_kvattn_run(G->att, l, G->h, R, pos + r0, G->xn, host_routing ? G->rt.sel : NULL,
                                  host_routing ? G->rt.w : NULL);
            if (!s) s = ffn(G, l, R);
            if (s) s = mq_err_prefix(s, "GPU layer %d", l);
        }
        if (!s && logits) {
            s = mq_gpu_buf_read(G->h, 0, R * D, G->hx);
            if (!s)
                s = mq_gpu_head_score(G->head, NULL, G->hx, NULL, R, G->targets, 1.0f, false, G->stats,
                                      logits + r0 * V);
        }
    }
    return s;
}
