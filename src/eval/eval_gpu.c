/*
 * The evaluation's GPU driver (eval_gpu.h): a layer's weights up once, the windows through it in
 * groups, and the scoring of each window, with the backend's pieces (backend/gpu.h).
 *
 * A group's FFN is the CPU forward's (model/forward.c, ffn_block) step for step, on the device:
 * the routed experts' slots expert-major with the tokens in increasing order within an expert,
 * each token's outputs summed from +0 in increasing expert order (one fmaf each, mq_gpu_mlp_combine),
 * then the shared expert's gate times its output (mq_gpu_mlp_add_kept), then the residual add; a
 * dense MLP's output goes onto the residual as one fmaf by 1 (the CPU's residual axpy).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/gpu.h"
#include "eval/eval_gpu.h"
#include "io/safetensors.h"

static int64_t g_group_rows = 0;
void mq_eval_set_gpu_group_rows(int64_t rows) { g_group_rows = rows; }
static bool g_no_resident = false;
void mq_eval_set_gpu_resident(bool on) { g_no_resident = !on; }

enum { EXPERT_ROWS = 2048, MLP_ROWS = 4096 };   /* the expert sets' rows a product (their lanes' scratch) */

struct mq_eval_gpu {
    mq_eval_ctx *c;
    mq_gpu *g;
    moeq_gpu_precision prec;
    int nm;
    const moeq_model *m[2];
    mq_state *st[2];              /* for the RoPE tables */
    mq_gpu_attn *att[2];
    int64_t rows, Dmax, Kmax, Emax;
    mq_gpu_buf *h, *xn, *out, *gate;   /* [rows, Dmax] x3 (the layer's result, the FFN input, the
                                          FFN output), [Dmax] the shared expert's gate */
    /* the layer being run */
    int k, l;
    mq_gpu_mlp *experts, *shared, *dense;
    mq_gpu_moe *moe;              /* bf16: the routed experts as one MoE op (routing included) */
    int k_begin;                  /* the model of the layer being begun */
    /* the boundary kept on the device (mq_eval_gpu_resident_begin): every window's rows of each
     * model, and a group's input rows */
    mq_gpu_buf *res[2], *xin;
    int64_t res_rows;
    bool gated;
    /* a group's host scratch */
    mq_gpu_attn_sample *smp;      /* [rows]: a window each */
    mq_gpu_routes rt;             /* the routing and the fp32 expert sets' layout */
    /* scoring */
    mq_gpu_head *head[2];
    int64_t head_rows;
    mq_gpu_row_stats *stats;      /* [head_rows] */
    int32_t *targets;             /* [head_rows] */
    float *logits;                /* [head_rows, V]: with saved logits to write or read */
};

/* ---- what the GPU path runs ------------------------------------------------------------------ */
const char *mq_gpu_model_lacks(const moeq_model *m, bool packed_ok, char *buf, size_t n) {
    const mq_config *c = &m->cfg;
    const bool family = c->arch == MQ_ARCH_LLAMA || c->arch == MQ_ARCH_OLMOE || c->arch == MQ_ARCH_QWEN2_MOE ||
                        c->arch == MQ_ARCH_QWEN3_MOE || c->arch == MQ_ARCH_MIXTRAL;
    if (!family || c->mla) {
        snprintf(buf, n, "model_type %s (multi-head latent attention and its routing)", c->model_type);
        return buf;
    }
    if (c->sigmoid_router || c->router_bias || c->n_group > 1 || c->routed_scale != 1.0f)
        return "sigmoid or group-limited routing";
    if (m->act_quant) return "--act-quant (the emulated activation quantizer)";
    if (!packed_ok && (m->n_packed > 0 || (mq_model_lazy(m) && mq_lazy_packed(mq_model_lazy(m)))))
        return "packed quantized weights (open the model with keep_packed off: moeq eval --dequantize; packed GPU "
               "kernels are not written yet)";
    if (c->mlp_bias) return "MLP biases (mlp_bias)";
    if (c->attn_scale != 1.0 / sqrt((double)c->head_dim) || c->rope_dim != c->head_dim || c->rope_interleave ||
        c->v_head_dim != c->head_dim)
        return "a softmax scale, rotary layout or value head other than the standard attention's";
    if (c->head_dim % 2 || c->n_kv_heads <= 0 || c->n_heads % c->n_kv_heads)
        return "an odd head size or query heads not a multiple of the KV heads";
    if (c->n_experts > 0 && c->top_k > 64) return "more than 64 experts per token";
    return NULL;
}

moeq_status mq_eval_gpu_check(const moeq_model *m, const char *role) {
    char buf[160];
    const char *why = mq_gpu_model_lacks(m, false, buf, sizeof buf);
    if (why)
        return mq_err(MOEQ_E_UNSUPPORTED, "--device cuda: %s (%s) has %s, which the GPU evaluation lacks; evaluate it "
                      "on the CPU (--device cpu)", role, m->dir ? m->dir : "model", why);
    return MOEQ_OK;
}

/* ---- open and close -------------------------------------------------------------------------- */
void mq_eval_gpu_close(mq_eval_gpu *G) {
    if (!G) return;
    mq_eval_gpu_layer_end(G);
    for (int k = 0; k < 2; k++) {
        mq_gpu_attn_free(G->att[k]);
        mq_state_free(G->st[k]);
        mq_gpu_head_free(G->head[k]);
    }
    mq_gpu_buf_free(G->h);
    mq_gpu_buf_free(G->xn);
    mq_gpu_buf_free(G->out);
    mq_gpu_buf_free(G->gate);
    for (int k = 0; k < 2; k++) mq_gpu_buf_free(G->res[k]);
    mq_gpu_buf_free(G->xin);
    free(G->smp);
    mq_gpu_routes_free(&G->rt);
    void *host[] = {G->stats, G->targets};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) free(host[i]);
    mq_free(G->logits);
    mq_gpu_close(G->g);
    free(G);
}

moeq_status mq_eval_gpu_open(mq_eval_ctx *c, const moeq_eval_options *o, int nm, const moeq_model *const *m,
                             mq_eval_gpu **out) {
    *out = NULL;
    if (o->gpu_precision < MOEQ_GPU_FP32 || o->gpu_precision > MOEQ_GPU_BF16)
        return mq_err(MOEQ_E_ARG, "eval: gpu_precision %d (fp32 0, tf32x3 1, tf32 2, bf16 3)", o->gpu_precision);
    mq_eval_gpu *G = calloc(1, sizeof *G);
    if (!G) return mq_err(MOEQ_E_NOMEM, "out of memory");
    G->c = c;
    G->nm = nm;
    G->k = G->l = -1;
    G->prec = (moeq_gpu_precision)o->gpu_precision;
    moeq_status s = mq_gpu_open(o->device, &G->g);
    if (!s) mq_gpu_set_memory_limit(G->g, o->max_gpu_memory);   /* --max-gpu-memory, before anything goes up */
    /* bf16: the routed experts on the MoE op's tensor cores, everything else as tf32 */
    if (!s) s = mq_gpu_set_precision(G->g, G->prec == MOEQ_GPU_BF16 ? MOEQ_GPU_TF32 : G->prec);
    int64_t rows = INT64_MAX;
    for (int k = 0; k < nm && !s; k++) {
        const mq_config *cf = &m[k]->cfg;
        G->m[k] = m[k];
        G->Dmax = cf->D > G->Dmax ? cf->D : G->Dmax;
        G->Kmax = cf->top_k > G->Kmax ? cf->top_k : G->Kmax;
        G->Emax = cf->n_experts > G->Emax ? cf->n_experts : G->Emax;
        s = mq_state_new_ex(m[k], c->L, false, &G->st[k]);
        if (s) break;
        mq_gpu_attn_shape sh = {.D = cf->D, .H = cf->n_heads, .KV = cf->n_kv_heads, .hd = cf->head_dim,
                                .max_T = c->L, .eps = cf->rms_eps,
                                .qk_norm = cf->qk_norm == MQ_QKNORM_FULL ? 1 : cf->qk_norm == MQ_QKNORM_HEAD ? 2 : 0,
                                .clip_qkv = cf->clip_qkv, .E = cf->n_experts, .top_k = cf->n_experts ? cf->top_k : 0,
                                .norm_topk = cf->norm_topk_prob};
        mq_state_rope_tables(G->st[k], &sh.rope_cos, &sh.rope_sin);
        s = mq_gpu_attn_new(G->g, &sh, &G->att[k]);
        if (!s && mq_gpu_attn_rows(G->att[k]) < rows) rows = mq_gpu_attn_rows(G->att[k]);
    }
    /* a test's smaller groups, never below a window */
    if (!s && g_group_rows > 0 && g_group_rows < rows) rows = g_group_rows > c->L ? g_group_rows : c->L;
    G->rows = rows;
    const size_t R = (size_t)rows;
    if (!s) s = mq_gpu_buf_new(G->g, rows * G->Dmax, &G->h);
    if (!s) s = mq_gpu_buf_new(G->g, rows * G->Dmax, &G->xn);
    if (!s) s = mq_gpu_buf_new(G->g, rows * G->Dmax, &G->out);
    if (!s) s = mq_gpu_buf_new(G->g, G->Dmax, &G->gate);
    if (!s) {
        G->smp = calloc(R, sizeof *G->smp);
        const bool routes = mq_gpu_routes_alloc(&G->rt, rows, G->Kmax, G->Emax);
        if (!G->smp || !routes)
            s = mq_err(MOEQ_E_NOMEM, "out of memory for the GPU eval's groups of %lld rows", (long long)rows);
    }
    if (s) {
        mq_eval_gpu_close(G);
        return s;
    }
    *out = G;
    return MOEQ_OK;
}

void mq_eval_gpu_describe(const mq_eval_gpu *G, char *buf, size_t n) {
    mq_gpu_info info;
    mq_gpu_get_info(G->g, &info);
    snprintf(buf, n, "cuda:%d %s (%s)", info.device, info.name, mq_gpu_precision_name(G->prec));
}

bool mq_eval_gpu_pin(mq_eval_gpu *G, void *p, size_t bytes) { return mq_gpu_host_register(G->g, p, bytes); }
void mq_eval_gpu_unpin(void *p) { mq_gpu_host_unregister(p); }
int64_t mq_eval_gpu_group_rows(const mq_eval_gpu *G) { return G->rows; }

/* ---- a layer ---------------------------------------------------------------------------------- */
void mq_eval_gpu_layer_end(mq_eval_gpu *G) {
    mq_gpu_mlp_free(G->experts);
    mq_gpu_mlp_free(G->shared);
    mq_gpu_mlp_free(G->dense);
    mq_gpu_moe_free(G->moe);
    G->experts = G->shared = G->dense = NULL;
    G->moe = NULL;
    G->k = G->l = -1;
}

/* An expert set of one MLP (E = 1): the shared expert or a dense MLP. */
static moeq_status one_mlp(mq_eval_gpu *G, const mq_linear *gate, const mq_linear *up, const mq_linear *down,
                           int64_t D, mq_gpu_mlp **out) {
    if (!gate->w || !up->w || !down->w)
        return mq_err(MOEQ_E_ARG, "%s: not loaded as fp32 weights", !gate->w ? gate->name : !up->w ? up->name : down->name);
    const float *g = gate->w, *u = up->w, *d = down->w;
    return mq_gpu_mlp_new(G->g, 1, D, gate->out, &g, &u, &d, G->rows < MLP_ROWS ? G->rows : MLP_ROWS, out);
}

/* Where the device takes layer l's routed experts of model k from in the bf16 mode of a streamed
 * model: their codes as stored (every expert's gate, up and down stored NVFP4 / INT4), their
 * bf16 tensors as stored (a bf16 checkpoint), or the fp32 weights the host loads. */
enum { FROM_FP32 = 0, FROM_CODES, FROM_BF16 };

static const mq_tensor_view *bf16_view(const mq_st *st, const mq_linear *lin) {
    char name[512];
    if (!lin->name || snprintf(name, sizeof name, "%s.weight", lin->name) >= (int)sizeof name) return NULL;
    const mq_tensor_view *v = mq_st_find(st, name);
    if (!v || v->dtype != MOEQ_DT_BF16 || v->ndim != 2 || v->shape[0] != lin->out || v->shape[1] != lin->in ||
        v->scale_inv)
        return NULL;
    return v;
}

static int experts_from(const mq_eval_gpu *G, int k, int l) {
    const moeq_model *m = G->m[k];
    if (G->prec != MOEQ_GPU_BF16 || !mq_model_lazy(m) || l < 0 || l >= m->cfg.n_layers) return FROM_FP32;
    const mq_layer *ly = &m->layers[l];
    if (!ly->is_moe || !ly->exp_gate) return FROM_FP32;
    bool codes = true, bf16 = true;
    const mq_st *st = mq_lazy_st(mq_model_lazy(m));
    for (int64_t e = 0; e < m->cfg.n_experts; e++) {
        const mq_linear *lin[3] = {&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e]};
        for (int i = 0; i < 3; i++) {
            codes &= lin[i]->stored_quantized;
            bf16 &= !lin[i]->stored_quantized && bf16_view(st, lin[i]) != NULL;
        }
    }
    return codes ? FROM_CODES : bf16 ? FROM_BF16 : FROM_FP32;
}

unsigned mq_eval_gpu_layer_parts(const mq_eval_gpu *G, int k, int l) {
    return experts_from(G, k, l) != FROM_FP32 ? MQ_PART_LAYER & ~MQ_PART_EXPERTS : MQ_PART_LAYER;
}

/* bf16: layer l's routed experts as one MoE op: codes and scales as stored (decoded in the op's
 * GEMMs), or fp32 weights rounded to bf16 on the device; routing by the op (softmax top-k,
 * norm_topk_prob), the shared expert kept on the fp32 path. */
static moeq_status moe_op(mq_eval_gpu *G, const moeq_model *m, int l) {
    const mq_config *cf = &m->cfg;
    const mq_layer *ly = &m->layers[l];
    const int64_t E = cf->n_experts;
    moeq_moe_ffn_args r = {.router = {.data = ly->router, .dtype = MOEQ_DT_F32, .ndim = 2, .shape = {E, cf->D},
                                      .nbytes = (size_t)(E * cf->D) * sizeof(float)},
                           .top_k = cf->top_k, .scoring = MOEQ_MOE_SOFTMAX, .renormalize = cf->norm_topk_prob,
                           .route_scale = 1.0f};
    const int from = experts_from(G, G->k_begin, l);
    if (from == FROM_CODES) {
        mq_gpu_experts x;
        moeq_status s = mq_gpu_experts_read(mq_lazy_st(mq_model_lazy(m)), cf, ly, l, &x);
        if (s == MOEQ_E_UNSUPPORTED)
            return mq_err(s, "%s; the GPU MoE op cannot run these experts as stored: evaluate with "
                          "--gpu-precision tf32 (the experts dequantized)", moeq_last_error());
        if (!s) s = mq_gpu_moe_upload(G->g, &x.desc, x.has_zp ? &x.zp : NULL, &r, &G->moe);
        mq_gpu_experts_free(&x);
        return s;
    }
    const void **w = malloc((size_t)(3 * E) * sizeof *w);
    if (!w) return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status s = MOEQ_OK;
    const mq_st *st = from == FROM_BF16 ? mq_lazy_st(mq_model_lazy(m)) : NULL;
    for (int64_t e = 0; e < E && !s; e++) {
        const mq_linear *lin[3] = {&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e]};
        for (int i = 0; i < 3; i++) {
            const mq_tensor_view *v = st ? bf16_view(st, lin[i]) : NULL;
            w[i * E + e] = st ? (v ? (const void *)v->data : NULL) : (const void *)lin[i]->w;
        }
        if (!w[e] || !w[E + e] || !w[2 * E + e])
            s = mq_err(MOEQ_E_ARG, "layer %d, expert %lld: not loaded", l, (long long)e);
    }
    if (!s)
        s = mq_gpu_moe_upload_dense(G->g, E, cf->D, cf->moe_ffn, from == FROM_BF16, w, w + E, w + 2 * E, &r,
                                    &G->moe);
    free(w);
    return s;
}

moeq_status mq_eval_gpu_layer_begin(mq_eval_gpu *G, int k, int l) {
    mq_eval_gpu_layer_end(G);
    const moeq_model *m = G->m[k];
    const mq_config *cf = &m->cfg;
    const mq_layer *ly = &m->layers[l];
    G->k_begin = k;
    if (!ly->q.w || !ly->k.w || !ly->v.w || !ly->o.w || !ly->attn_norm || !ly->ffn_norm)
        return mq_err(MOEQ_E_ARG, "layer %d: its attention is not loaded as fp32 weights", l);
    mq_gpu_attn_weights aw = {.norm = ly->attn_norm, .q = ly->q.w, .k = ly->k.w, .v = ly->v.w, .o = ly->o.w,
                              .q_bias = ly->q.bias, .k_bias = ly->k.bias, .v_bias = ly->v.bias, .o_bias = ly->o.bias,
                              .q_norm = ly->q_norm, .k_norm = ly->k_norm,
                              .window = cf->layer_sliding && cf->layer_sliding[l] ? cf->sliding_window : 0,
                              .ffn_norm = ly->ffn_norm, .router = ly->is_moe ? ly->router : NULL};
    const bool op = ly->is_moe && G->prec == MOEQ_GPU_BF16;
    if (op) aw.router = NULL;   /* the MoE op routes */
    moeq_status s = mq_gpu_attn_set(G->att[k], &aw);
    const int64_t D = cf->D, E = cf->n_experts;
    if (!s && op) {
        s = moe_op(G, m, l);
        if (!s && cf->shared_ffn > 0) s = one_mlp(G, &ly->sh_gate, &ly->sh_up, &ly->sh_down, D, &G->shared);
        G->gated = cf->shared_ffn > 0 && cf->shared_gate;
        if (!s && G->gated && !ly->sh_gate_w) s = mq_err(MOEQ_E_ARG, "layer %d: shared_expert_gate not loaded", l);
        if (!s && G->gated) s = mq_gpu_buf_write(G->gate, 0, D, ly->sh_gate_w);
    } else if (!s && ly->is_moe) {
        const float **w = malloc((size_t)(3 * E) * sizeof *w);
        if (!w) return mq_err(MOEQ_E_NOMEM, "out of memory");
        for (int64_t e = 0; e < E && !s; e++) {
            w[e] = ly->exp_gate[e].w;
            w[E + e] = ly->exp_up[e].w;
            w[2 * E + e] = ly->exp_down[e].w;
            if (!w[e] || !w[E + e] || !w[2 * E + e])
                s = mq_err(MOEQ_E_ARG, "layer %d, expert %lld: not loaded as fp32 weights", l, (long long)e);
        }
        if (!s) s = mq_gpu_mlp_new(G->g, E, D, cf->moe_ffn, w, w + E, w + 2 * E, EXPERT_ROWS, &G->experts);
        free(w);
        if (!s && cf->shared_ffn > 0) s = one_mlp(G, &ly->sh_gate, &ly->sh_up, &ly->sh_down, D, &G->shared);
        G->gated = cf->shared_ffn > 0 && cf->shared_gate;
        if (!s && G->gated && !ly->sh_gate_w) s = mq_err(MOEQ_E_ARG, "layer %d: shared_expert_gate not loaded", l);
        if (!s && G->gated) s = mq_gpu_buf_write(G->gate, 0, D, ly->sh_gate_w);
    } else if (!s) {
        s = one_mlp(G, &ly->gate, &ly->up, &ly->down, D, &G->dense);
    }
    if (s) {
        mq_eval_gpu_layer_end(G);
        return mq_err_prefix(s, "GPU layer %d", l);
    }
    G->k = k;
    G->l = l;
    return MOEQ_OK;
}

bool mq_gpu_routes_alloc(mq_gpu_routes *r, int64_t R, int64_t K, int64_t E) {
    const size_t n = (size_t)R, nk = n * (size_t)(K > 0 ? K : 1), e1 = (size_t)E + 1;
    memset(r, 0, sizeof *r);
    r->sel = malloc(nk * sizeof *r->sel);
    r->w = malloc(nk * sizeof *r->w);
    r->slot = malloc(nk * sizeof *r->slot);
    r->list = malloc(nk * sizeof *r->list);
    r->crow = malloc(nk * sizeof *r->crow);
    r->cw = malloc(nk * sizeof *r->cw);
    r->first = malloc((n + 1) * sizeof *r->first);
    r->tok = malloc(n * sizeof *r->tok);
    r->ident = malloc(n * sizeof *r->ident);
    r->cnt = malloc(e1 * sizeof *r->cnt);
    r->start = malloc(e1 * sizeof *r->start);
    if (!r->sel || !r->w || !r->slot || !r->list || !r->crow || !r->cw || !r->first || !r->tok || !r->ident ||
        !r->cnt || !r->start)
        return false;
    for (int64_t i = 0; i < R; i++) r->ident[i] = (int32_t)i;
    return true;
}

void mq_gpu_routes_free(mq_gpu_routes *r) {
    MQ_FREE_EACH(r->sel, r->w, r->slot, r->list, r->crow, r->cw, r->first, r->tok, r->ident, r->cnt, r->start);
    memset(r, 0, sizeof *r);
}

/* The routed experts' slots and the combine's pairs of R rows. */
static moeq_status route_layout(const mq_gpu_routes *r, int64_t R, int64_t K, int64_t E) {
    int32_t *cnt = r->cnt, *start = r->start;
    for (int64_t e = 0; e <= E; e++) cnt[e] = 0;
    for (int64_t i = 0; i < R * K; i++) {
        if (r->sel[i] < 0 || r->sel[i] >= E)
            return mq_err(MOEQ_E_NUMERIC, "row %lld routed to expert %d of %lld (non-finite router logits?)",
                          (long long)(i / K), r->sel[i], (long long)E);
        cnt[r->sel[i]]++;
    }
    start[0] = 0;
    for (int64_t e = 0; e < E; e++) start[e + 1] = start[e] + cnt[e];
    for (int64_t e = 0; e < E; e++) cnt[e] = start[e];   /* the next slot of each expert */
    for (int64_t t = 0; t < R; t++)
        for (int64_t k = 0; k < K; k++) {
            const int32_t e = r->sel[t * K + k], slot = cnt[e]++;
            r->list[slot] = (int32_t)t;
            r->slot[t * K + k] = slot;
        }
    for (int64_t t = 0; t < R; t++) {
        int32_t order[64];
        const int32_t *sel = r->sel + t * K;
        for (int64_t k = 0; k < K; k++) order[k] = (int32_t)k;
        for (int64_t a = 1; a < K; a++)   /* by expert id */
            for (int64_t b = a; b > 0 && sel[order[b - 1]] > sel[order[b]]; b--) {
                const int32_t x = order[b];
                order[b] = order[b - 1];
                order[b - 1] = x;
            }
        r->tok[t] = t;
        r->first[t] = (int32_t)(t * K);
        for (int64_t k = 0; k < K; k++) {
            r->crow[t * K + k] = r->slot[t * K + order[k]];
            r->cw[t * K + k] = r->w[t * K + order[k]];
        }
    }
    r->first[R] = (int32_t)(R * K);
    return MOEQ_OK;
}

moeq_status mq_gpu_routes_run(mq_gpu_routes *r, mq_gpu_mlp *set, mq_gpu_buf *xn, mq_gpu_buf *out, int64_t R,
                              int64_t D, int64_t K, int64_t E) {
    moeq_status s = mq_gpu_buf_zero(out, 0, R * D);
    if (!s) s = route_layout(r, R, K, E);
    if (!s) s = mq_gpu_mlp_inputs_from(set, xn, R);
    if (!s) s = mq_gpu_mlp_rows_index(set, r->list, R * K);
    if (!s) s = mq_gpu_mlp_reserve_kept(set, R * K);
    for (int64_t e = 0; e < E && !s; e++)
        if (r->start[e + 1] > r->start[e])
            s = mq_gpu_mlp_run_indexed(set, e, r->start[e], r->start[e + 1] - r->start[e], true, NULL, NULL);
    return s ? s : mq_gpu_mlp_combine(set, out, r->tok, r->first, r->crow, r->cw, R);
}

/* One MLP (E = 1) over all R rows of the FFN input, its outputs kept for add_kept. */
static moeq_status one_mlp_rows(mq_eval_gpu *G, mq_gpu_mlp *m, int64_t R) { return mq_gpu_one_mlp_rows(m, G->xn, G->rt.ident, R); }

moeq_status mq_gpu_one_mlp_rows(mq_gpu_mlp *m, mq_gpu_buf *xn, const int32_t *ident, int64_t R) {
    moeq_status s = mq_gpu_mlp_inputs_from(m, xn, R);
    if (!s) s = mq_gpu_mlp_rows_index(m, ident, R);
    if (!s) s = mq_gpu_mlp_reserve_kept(m, R);
    if (!s) s = mq_gpu_mlp_run_indexed(m, 0, 0, R, true, NULL, NULL);
    return s;
}

/* ---- the boundary on the device ---------------------------------------------------------------- */
bool mq_eval_gpu_resident_begin(mq_eval_gpu *G, int64_t rows, const float *const *host, const int64_t *D) {
    mq_gpu_info info;
    mq_gpu_get_info(G->g, &info);
    int64_t need = rows * G->Dmax;   /* the group's input rows */
    for (int k = 0; k < G->nm; k++) need += rows * D[k];
    need *= (int64_t)sizeof(float);
    /* half of what is free now: a layer's weights and the work space come and go beside it */
    if (g_no_resident || rows <= 0 || need > info.mem_free / 2) return false;
    moeq_status s = mq_gpu_buf_new(G->g, G->rows * G->Dmax, &G->xin);
    for (int k = 0; k < G->nm && !s; k++) {
        s = mq_gpu_buf_new(G->g, rows * D[k], &G->res[k]);
        if (!s) s = mq_gpu_buf_write(G->res[k], 0, rows * D[k], host[k]);
    }
    if (s) {   /* not an error: the rows cross the bus each layer instead */
        mq_info("eval: the layer boundary stays on the host (%s)", moeq_last_error());
        for (int k = 0; k < G->nm; k++) {
            mq_gpu_buf_free(G->res[k]);
            G->res[k] = NULL;
        }
        mq_gpu_buf_free(G->xin);
        G->xin = NULL;
        return false;
    }
    G->res_rows = rows;
    return true;
}

moeq_status mq_eval_gpu_resident_read(mq_eval_gpu *G, int k, float *host) {
    if (!G->res[k]) return mq_err(MOEQ_E_ARG, "GPU eval: no boundary on the device");
    return mq_gpu_buf_read(G->res[k], 0, G->res_rows * G->m[k]->cfg.D, host);
}

moeq_status mq_eval_gpu_layer_run(mq_eval_gpu *G, int64_t w0, int64_t w1, float *x) {
    return mq_eval_gpu_layer_run_at(G, w0, w1, x, -1);
}

moeq_status mq_eval_gpu_layer_run_at(mq_eval_gpu *G, int64_t w0, int64_t w1, float *x, int64_t r0) {
    if (G->k < 0) return mq_err(MOEQ_E_ARG, "GPU eval: no layer begun");
    const bool dev = r0 >= 0;
    if (dev && !G->res[G->k]) return mq_err(MOEQ_E_ARG, "GPU eval: no boundary on the device");
    const mq_eval_ctx *c = G->c;
    const moeq_model *m = G->m[G->k];
    const mq_config *cf = &m->cfg;
    const mq_layer *ly = &m->layers[G->l];
    const int64_t D = cf->D, E = cf->n_experts, K = ly->is_moe ? cf->top_k : 0;
    int64_t R = 0, n = 0;
    for (int64_t wi = w0; wi < w1; wi++) {
        const int64_t T = c->win[wi].n_input;
        if (R + T > G->rows || n >= G->rows)
            return mq_err(MOEQ_E_ARG, "GPU eval: windows %lld..%lld hold more than a group's %lld rows", (long long)w0,
                          (long long)w1, (long long)G->rows);
        mq_gpu_attn_sample *sm = &G->smp[n++];
        memset(sm, 0, sizeof *sm);
        sm->x = dev ? NULL : x + R * D;
        sm->T = T;
        sm->ffn_dev_off = R * D;
        if (K && !G->moe) {
            sm->sel = G->rt.sel + R * K;
            sm->w = G->rt.w + R * K;
        }
        R += T;
    }
    if (R == 0) return MOEQ_OK;
    if (dev && r0 + R > G->res_rows)
        return mq_err(MOEQ_E_ARG, "GPU eval: rows %lld..%lld of a boundary of %lld", (long long)r0,
                      (long long)(r0 + R), (long long)G->res_rows);
    const mq_gpu_attn_io io = {.ffn_dev = G->xn, .h_dev = G->h, .x_from = dev ? G->xin : NULL};
    moeq_status s = dev ? mq_gpu_buf_copy(G->xin, 0, G->res[G->k], r0 * D, R * D) : MOEQ_OK;
    if (!s) s = mq_gpu_attn_run_samples(G->att[G->k], G->smp, n, &io);
    if (!s && G->moe) {
        s = mq_gpu_moe_ffn_buf(G->moe, G->xn, R, MQ_GPU_MOE_BF16, G->out);
        if (!s && G->shared) s = one_mlp_rows(G, G->shared, R);
        if (!s && G->shared) s = mq_gpu_mlp_add_kept(G->shared, G->out, G->xn, G->gated ? G->gate : NULL, R);
        if (!s) s = mq_gpu_buf_add(G->h, G->out, R * D);
    } else if (!s && ly->is_moe) {
        s = mq_gpu_routes_run(&G->rt, G->experts, G->xn, G->out, R, D, K, E);
        if (!s && G->shared) s = one_mlp_rows(G, G->shared, R);
        if (!s && G->shared) s = mq_gpu_mlp_add_kept(G->shared, G->out, G->xn, G->gated ? G->gate : NULL, R);
        if (!s) s = mq_gpu_buf_add(G->h, G->out, R * D);
    } else if (!s) {
        s = one_mlp_rows(G, G->dense, R);
        if (!s) s = mq_gpu_mlp_add_kept(G->dense, G->h, G->xn, NULL, R);
    }
    if (!s) s = dev ? mq_gpu_buf_copy(G->res[G->k], r0 * D, G->h, 0, R * D) : mq_gpu_buf_read(G->h, 0, R * D, x);
    return s;
}

/* ---- scoring ------------------------------------------------------------------------------------ */
moeq_status mq_eval_gpu_head_begin(mq_eval_gpu *G) {
    moeq_status s = MOEQ_OK;
    int64_t rows = INT64_MAX;
    for (int k = 0; k < G->nm && !s; k++) {
        const moeq_model *m = G->m[k];
        if (!m->final_norm || !m->lm_head) return mq_err(MOEQ_E_ARG, "%s: the output layer is not loaded", m->dir);
        s = mq_gpu_head_new(G->g, m->cfg.D, m->cfg.vocab, m->final_norm, m->cfg.rms_eps, m->lm_head, 0, &G->head[k]);
        if (!s && mq_gpu_head_rows(G->head[k]) < rows) rows = mq_gpu_head_rows(G->head[k]);
    }
    if (s) return s;
    /* pieces of exactly the heads' rows: each call then makes the products it would make alone */
    G->head_rows = rows;
    G->stats = malloc((size_t)rows * sizeof *G->stats);
    G->targets = malloc((size_t)rows * sizeof *G->targets);
    if (!G->stats || !G->targets) return mq_err(MOEQ_E_NOMEM, "out of memory");
    const mq_eval_ctx *c = G->c;
    if ((c->save_k || c->kl_data) &&
        !(G->logits = mq_alloc_array((size_t)rows * (size_t)c->V, sizeof(float), "GPU eval logits")))
        return MOEQ_E_NOMEM;
    return MOEQ_OK;
}

moeq_status mq_eval_gpu_score_window(mq_eval_gpu *G, int64_t wi, const float *xm, const float *xb) {
    mq_eval_ctx *c = G->c;
    mq_eval_scratch *sc = &c->sc[0];
    moeq_status st = mq_eval_scoring_init(c, sc);
    if (st) return st;
    const mq_window *w = &c->win[wi];
    const int64_t d = c->win_doc[wi], V = c->V, D = c->m->cfg.D, Db = c->base ? c->base->cfg.D : 0;
    const int32_t *T = c->tok[d];
    const size_t rec_size = c->save_k ? mq_logits_record_size(c->save_k) : 0;
    const int64_t g0 = c->tok_off[d] + w->first_target;
    const double log_v = log((double)V);
    double ll = 0;
    for (int64_t p0 = 0; p0 < w->n_score; p0 += G->head_rows) {
        const int64_t rows = w->n_score - p0 < G->head_rows ? w->n_score - p0 : G->head_rows;
        for (int64_t r = 0; r < rows; r++) G->targets[r] = T[w->first_target + p0 + r];
        st = mq_gpu_head_score(G->head[0], c->base ? G->head[1] : NULL, xm + p0 * D, xb ? xb + p0 * Db : NULL, rows,
                               G->targets, c->temperature, c->tok_ent != NULL, G->stats, G->logits);
        if (st) return mq_err_prefix(st, "document %lld", (long long)d + 1);
        /* mq_eval_score_window's per-row work, in its order */
        for (int64_t r = 0; r < rows; r++) {
            const mq_gpu_row_stats *o = &G->stats[r];
            const int64_t t = w->first_target + p0 + r, g = g0 + p0 + r;
            const float *row = G->logits ? G->logits + r * V : NULL;
            const double lse = o->lse;
            if (!isfinite(lse))
                return mq_err(MOEQ_E_NUMERIC, "document %lld, token %lld: non-finite logits", (long long)d + 1,
                              (long long)t);
            ll += (double)o->target - lse;
            if (c->tok_ent) c->tok_ent[g] = log_v - o->ent_kl;
            if (c->save_k) {
                mq_topk(row, V, (int32_t)c->save_k, sc->tk_ids, sc->tk_vals);
                mq_logits_record_encode(sc->rec + (size_t)(p0 + r) * rec_size, lse, sc->tk_ids, sc->tk_vals,
                                        c->save_k);
            }
            if (c->base) {
                if (!isfinite(o->lse_b))
                    return mq_err(MOEQ_E_NUMERIC, "KL base: document %lld, token %lld: non-finite logits",
                                  (long long)d + 1, (long long)t);
                c->tok_kl[g] = o->kl;
                c->tok_changed[g] = o->argmax != o->argmax_b;
                c->tok_llb[g] = (double)o->target_b - o->lse_b;
            } else if (c->kl_data) {
                double lse_b;
                const uint8_t *rec = c->kl_data + MQ_LOGITS_HEADER + (size_t)g * mq_logits_record_size(c->kl_k);
                mq_logits_record_decode(rec, c->kl_k, &lse_b, sc->tk_ids, sc->tk_vals);
                for (uint32_t i = 0; i < c->kl_k; i++)
                    if (sc->tk_ids[i] >= (uint32_t)V)
                        return mq_err(MOEQ_E_FORMAT, "saved logits: token %lld holds id %u outside the vocabulary",
                                      (long long)g, sc->tk_ids[i]);
                c->tok_kl[g] = mq_kl_topk(sc->tk_ids, sc->tk_vals, (int32_t)c->kl_k, lse_b, row, lse, V, sc->mark,
                                          &c->tok_bound[g]);
                c->tok_changed[g] = (uint32_t)o->argmax != sc->tk_ids[0];
            }
        }
    }
    if (c->save_k) {
        const size_t n = (size_t)w->n_score * rec_size;
        const off_t off = (off_t)(MQ_LOGITS_HEADER + (size_t)g0 * rec_size);
        size_t done = 0;
        while (done < n) {
            const ssize_t k = pwrite(c->save_fd, sc->rec + done, n - done, off + (off_t)done);
            if (k <= 0) return mq_err(MOEQ_E_IO, "%s: write failed", c->save_path);
            done += (size_t)k;
        }
    }
    c->win_ll[wi] = ll;
    return MOEQ_OK;
}
