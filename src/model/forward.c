/*
 * The fp32 reference forward pass, following transformers 5.x (LlamaDecoderLayer and the
 * Olmoe/Qwen2Moe/Qwen3Moe/Mixtral variants):
 *   x += o_proj(attention(rope(qk_norm(q_proj(n1(x)))), rope(qk_norm(k_proj(n1(x)))), v_proj(n1(x))))
 *   x += mlp(n2(x))  or  moe(n2(x))
 * RMSNorm: w * (x * rsqrt(mean(x^2) + eps)). RoPE uses the rotate_half convention with
 * inv_freq = 1 / theta^(2i/hd) computed in fp32. Attention: causal (optionally sliding window),
 * softmax in fp32 after max subtraction, scale 1/sqrt(hd). MoE: fp32 router, softmax over all
 * experts, top-k (ties to the lower index), optional renormalisation; each routed expert's output
 * is scaled by its weight and the contributions are summed in increasing expert order, as
 * transformers' index_add_ loop does; the qwen2_moe shared expert is scaled by
 * sigmoid(shared_expert_gate(x)) and added last.
 *
 * Threads: Linear layers through mq_gemm_nt (fixed tiles; q/k/v as one set of tile tasks);
 * attention split into (head, query block) tasks and the routed experts into (expert, row block)
 * tasks, so every value is computed by the same operations whatever the thread count.
 *
 * Speed: the element-wise and reduction work (RMSNorm, RoPE, softmax, SwiGLU, residual adds,
 * the MoE combine) runs on the vector kernels of src/kernels/vec.h, whose AVX2 and scalar twins
 * agree bit for bit. Attention of a block of >= ATT_GEMM_ROWS queries: QK^T and PV as GEMMs,
 * masked keys with weight 0; fewer rows (decode): a GEMV over the visible keys and a transposed
 * GEMV for PV. Calls with fewer than SMALL_T new tokens (decode) do everything on the calling
 * thread with GEMVs: the tiled GEMM would pack whole weight matrices for one row, and waking the
 * pool costs more than such steps take. The weighted sums of the MoE combine and the shared
 * expert use fmaf (one rounding where transformers rounds the product first).
 *
 * Packed weights (moeq_model_options.keep_packed): a Linear with qw runs mq_packed_weight_forward
 * (+ bias); a MoE layer with pexperts runs mq_moe_layer_forward, the kernels' fused op with the
 * same routing (fp32 router, softmax over all experts, top-k with ties to the lower index,
 * optional renormalisation, shared expert scaled by sigmoid(shared_expert_gate x)). Everything
 * else (attention, norms, lm_head, unsupported layers) stays as above.
 *
 * deepseek_v3 (DeepseekV3Attention / DeepseekV3TopkRouter of transformers 5.17): multi-head latent
 * attention, q = q_b(rmsnorm(q_a xn)) (or q_proj xn), [c | k_rot] = kv_a xn, [k_nope | v] per head
 * = kv_b(rmsnorm(c)) (both latent norms with eps 1e-6, as the module's default); RoPE on the last
 * qk_rope dimensions of each q head and on k_rot, shared by every head's key; rope_interleave
 * rotates pairs (x0, x1), (x2, x3).. and leaves them de-interleaved (evens then odds) as
 * apply_rotary_pos_emb_interleave does, which q.k does not see; the KV cache holds the expanded
 * per-head keys and values. YaRN: inverse frequencies of _compute_yarn_parameters in fp32, cos/sin
 * times the attention factor, softmax scale mq_config.attn_scale. Routing: sigmoid of the fp32
 * router logits, selection on score + e_score_correction_bias among the experts of the topk_group
 * groups with the largest sums of their two best biased scores (the others masked with -inf),
 * weights the unbiased scores, renormalised (sum + 1e-20) and times routed_scaling_factor; the
 * shared experts (no gate) are added after the routed ones.
 *
 * Activation quantization (act_quant, fp32 path only): mq_nvfp4_act_qdq on the input of each
 * Linear marked act_q, over the whole 2D input of the call: q/k/v share one quantized copy of
 * the normed input, each routed expert quantizes its own routed rows (one global scale per
 * expert, as torchao's grouped MoE path), the shared expert all rows. MOEQ_ACT_QUANT_Q8_0 puts
 * mq_q8_0_act_qdq (llama.cpp's per-row blocks of 32) in the same places, and on a GGUF's K-quant
 * Linears mq_q8_k_act_qdq (blocks of 256; q/k/v or gate/up of other types each round their own
 * copy). Routers,
 * shared_expert_gate and lm_head always see fp32. Hooks are called before the quantizer.
 * A deepseek2 GGUF's Q4_0/Q8_0 attn_v_b (vb_act_q): llama.cpp attends over the normed latents and
 * multiplies each head's latent output, Q8_0-rounded, by attn_v_b; that layer then runs the same
 * way (latents cached per layer, kv_b's v rows applied after the rounding), which is the same
 * function as the expanded attention up to rounding.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "formats/formats.h"
#include "kernels/gemm_det.h"
#include "kernels/ggml_mat.h"
#include "kernels/moe_ffn.h"
#include "kernels/route_inline.h"
#include "kernels/vec.h"
#include "model/model_internal.h"

enum {
    ATT_QB = 64,     /* query rows per attention task */
    MOE_ROWS = MQ_MOE_ROWS,   /* routed rows per expert task */
    SMALL_T = 4,      /* fewer new tokens: GEMVs and every task on the calling thread (decode) */
    ATT_GEMM_ROWS = 4 /* query rows from which a block's QK^T and PV go through the GEMM */
};

struct mq_state {
    const moeq_model *m;
    int32_t max_tokens;
    int64_t kv_dim;              /* n_kv_heads * head_dim: a key row of the cache */
    int64_t v_dim;               /* n_kv_heads * v_head_dim: a value row (== kv_dim but MLA) */
    float **kc, **vc;            /* [n_layers] -> [max_tokens, kv_dim / v_dim] */
    float **lc;                  /* [n_layers] -> [max_tokens, kv_lora]: latents (vb_act_q) */
    int64_t *filled;             /* [n_layers]: positions present in the cache */
    float *rope_cos, *rope_sin;  /* [max_tokens, rope_dim / 2] */
    float *qa, *ckv, *lat, *kvb; /* MLA scratch: [cap, q_lora], [cap, kv_lora + rope] (the latent
                                    normed in place, then its rotary key), [cap, kv_lora] (the
                                    normed latents, kv_b's input), [cap, H*(nope+v)] */

    int64_t cap;                 /* rows the scratch below holds */
    float *xn, *q, *att, *tmp, *g, *u;   /* k and v go straight into the KV cache */
    float *rlog, *rw;            /* router probabilities [cap, E], top-k weights [cap, K] */
    int32_t *rsel;               /* top-k experts [cap, K] */
    int32_t *cnt, *start;        /* [E], [E + 1] */
    int32_t *slot_tok;           /* [cap * K]: token of each expert-major slot */
    int32_t *tok_slot;           /* [cap, K]: slot of each (token, k) */
    float *xg, *hg, *hu, *yg;    /* expert-major slots [cap * K, D or F] */
    float *sgate;                /* [cap] shared expert gate logits */
    float *aq;                   /* act_quant: [cap, D] quantized copy of an MLP input */
    float *xq, *hq;              /* act_quant: quantized expert inputs [cap * K, D / FE] */
    int64_t *tasks;              /* MoE tasks: expert << 32 | row block */
    int64_t n_tasks_cap;

    bool moe_fp32;               /* some MoE layer runs the fp32 experts (needs the scratch above) */
    double *prof;                /* [MQ_ATT_PARTS] seconds by part, or NULL (mq_state_profile) */
    int n_thr;                   /* per-thread attention scratch */
    float *scores;               /* [n_thr, ATT_QB * max_tokens] */
};

/* ---- small kernels ------------------------------------------------------------------------- */
/* The emulated activation quantizer of a Linear marked `kind` (mq_actq) on x[rows, cols] in
 * place: llama.cpp's Q8_K row by row, or the model's: NVFP4 over the whole 2D input of the call,
 * or llama.cpp's Q8_0 rounding row by row. */
static void act_qdq(const moeq_model *m, int kind, float *x, int64_t rows, int64_t cols) {
    if (kind == MQ_ACTQ_Q8_K)
        mq_q8_k_act_qdq(x, rows, cols);
    else if (m->act_quant == MOEQ_ACT_QUANT_Q8_0)
        mq_q8_0_act_qdq(x, rows, cols);
    else
        mq_nvfp4_act_qdq(x, rows, cols);
}

/* Row-wise work of a prefill (norms, RoPE, the residual add) in blocks of rows on the pool: each
 * row is computed alone, so the blocks change no value; at 16 threads these serial passes took
 * a tenth of a 512-token attention. Small calls stay on the calling thread. */
enum { ROWS_TASK = 32, ROWS_POOL_MIN = 1 << 16 };   /* rows per task; values for the pool */

typedef struct {
    const float *x, *w;
    float *out;
    int64_t rows, n;
    float eps;
} norm_job;

static void norm_rows(void *ctx, int64_t r0, int64_t r1) {
    const norm_job *j = ctx;
    const mq_vec_kernels *vk = mq_vec();
    for (int64_t r = r0; r < r1; r++) vk->rmsnorm(j->x + r * j->n, j->n, j->w, j->eps, j->out + r * j->n);
}

/* Row-wise RMSNorm of x[rows, n] into out (may alias x). The mean of squares is accumulated in
 * double and rounded, then everything is fp32 as in LlamaRMSNorm. */
static void rmsnorm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *out) {
    norm_job j = {x, w, out, rows, n, eps};
    mq_parallel_ranges(rows, ROWS_TASK, rows * n >= ROWS_POOL_MIN, norm_rows, &j);
}

typedef struct {
    const float *x;
    float *y;
} axpy_job;

static void axpy_range(void *ctx, int64_t a, int64_t b) {
    const axpy_job *j = ctx;
    mq_vec()->axpy(1.0f, j->x + a, j->y + a, b - a);
}

/* y += x over n values (elementwise: any split gives the same sums) */
static void residual_add(const float *x, float *y, int64_t n) {
    axpy_job j = {x, y};
    mq_parallel_ranges(n, ROWS_POOL_MIN, true, axpy_range, &j);
}

/* g = silu(g) * u over n values. */
static void swiglu(float *g, const float *u, int64_t n) { mq_vec()->swiglu(g, u, n); }

/* y[T, N] = x[T, K] @ W[N, K]^T. Up to SMALL_T rows run as GEMVs on the calling thread: the
 * tiled GEMM would pack all of W for one row, and waking the pool costs more than the work. */
static void matmul_nt(const float *x, int64_t T, const float *W, int64_t N, int64_t K, float *y) {
    if (T < SMALL_T) {
        const mq_vec_kernels *vk = mq_vec();
        for (int64_t t = 0; t < T; t++) vk->gemv(W, K, N, x + t * K, K, 1.0f, y + t * N);
    } else {
        mq_gemm_nt(T, N, K, 1.0f, x, K, W, K, 0.0f, y, N);
    }
}

/* Runs tasks [0, n) of fn: on the pool, or for small problems on the calling thread (the tasks
 * are the same either way, so are the results). */
static void run_tasks(int64_t n, mq_task_fn fn, void *ctx, bool small) {
    if (!small) {
        mq_parallel_for(n, fn, ctx);
        return;
    }
    for (int64_t t = 0; t < n; t++) fn(ctx, t, 0);
}

static void add_bias(const mq_linear *l, float *y, int64_t T) {
    if (!l->bias) return;
    const mq_vec_kernels *vk = mq_vec();
    for (int64_t t = 0; t < T; t++) vk->axpy(1.0f, l->bias, y + t * l->out, l->out);   /* y + b */
}

moeq_status mq_linear_forward(const mq_linear *l, const float *x, int64_t T, float *y) {
    if (l->qw || l->gw) {
        moeq_status st = l->qw ? mq_packed_weight_forward(l->qw, x, T, y)
                               : mq_ggml_mat_forward(l->gw, x, T, y);
        if (st) return mq_err_prefix(st, "%s", l->name);
    } else if (l->det) {
        MQ_ASSERT(l->w != NULL);
        mq_gemm_det_nt_pool(T, l->out, l->in, x, l->in, l->w, l->in, y, l->out);
    } else {
        MQ_ASSERT(l->w != NULL);
        matmul_nt(x, T, l->w, l->out, l->in, y);
    }
    add_bias(l, y, T);
    return MOEQ_OK;
}

static void hook(const mq_hooks *h, int layer, mq_site site, int expert, const float *x,
                 int64_t rows, int64_t cols) {
    if (h && h->fn) h->fn(h->user, layer, site, expert, x, rows, cols);
}

/* ---- state --------------------------------------------------------------------------------- */
static void scratch_free(mq_state *s) {
    float **f[] = {&s->xn, &s->q,  &s->att, &s->tmp, &s->g,     &s->u,  &s->rlog,
                   &s->rw, &s->xg, &s->hg,  &s->hu,  &s->yg, &s->sgate, &s->aq, &s->xq, &s->hq,
                   &s->qa, &s->ckv, &s->lat, &s->kvb};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        mq_free(*f[i]);
        *f[i] = NULL;
    }
    int32_t **ip[] = {&s->rsel, &s->cnt, &s->start, &s->slot_tok, &s->tok_slot};
    for (size_t i = 0; i < sizeof ip / sizeof ip[0]; i++) {
        mq_free(*ip[i]);
        *ip[i] = NULL;
    }
    mq_free(s->tasks);
    s->tasks = NULL;
    s->cap = 0;
}

/* Makes the scratch hold T rows (grows only; never per token). */
static moeq_status scratch_reserve(mq_state *s, int64_t T) {
    if (T <= s->cap) return MOEQ_OK;
    scratch_free(s);
    const mq_config *c = &s->m->cfg;
    size_t R = (size_t)T, D = (size_t)c->D, Q = (size_t)c->n_heads * (size_t)c->head_dim;
    size_t F = (size_t)(c->ffn > c->shared_ffn ? c->ffn : c->shared_ffn);
    /* packed MoE layers bring their own scratch (the kernels' workspace) */
    size_t E = s->moe_fp32 ? (size_t)c->n_experts : 0, K = (size_t)c->top_k, FE = (size_t)c->moe_ffn;
    const char *w = "forward scratch";
    s->xn = mq_alloc_array(R, D * 4, w);
    size_t QV = (size_t)c->n_heads * (size_t)c->v_head_dim;
    s->q = mq_alloc_array(R, Q * 4, w);
    s->att = mq_alloc_array(R, (Q > QV ? Q : QV) * 4, w);
    s->tmp = mq_alloc_array(R, D * 4, w);
    bool ok = s->xn && s->q && s->att && s->tmp;
    if (c->mla) {
        size_t qa = (size_t)(c->q_lora_rank > 0 ? c->q_lora_rank : 1);
        s->qa = mq_alloc_array(R, qa * 4, w);
        s->ckv = mq_alloc_array(R, (size_t)(c->kv_lora_rank + c->qk_rope) * 4, w);
        s->lat = mq_alloc_array(R, (size_t)c->kv_lora_rank * 4, w);
        size_t kvb = (size_t)c->n_heads * (size_t)(c->qk_nope + c->v_head_dim);
        s->kvb = mq_alloc_array(R, kvb * 4, w);
        ok = ok && s->qa && s->ckv && s->lat && s->kvb;
    }
    if (F > 0) {
        s->g = mq_alloc_array(R, F * 4, w);
        s->u = mq_alloc_array(R, F * 4, w);
        ok = ok && s->g && s->u;
    }
    if (E > 0) {
        s->rlog = mq_alloc_array(R, E * 4, w);
        s->rw = mq_alloc_array(R, K * 4, w);
        s->rsel = mq_alloc_array(R, K * 4, w);
        s->cnt = mq_alloc_array(E, 4, w);
        s->start = mq_alloc_array(E + 1, 4, w);
        s->slot_tok = mq_alloc_array(R * K, 4, w);
        s->tok_slot = mq_alloc_array(R * K, 4, w);
        s->xg = mq_alloc_array(R * K, D * 4, w);
        s->hg = mq_alloc_array(R * K, FE * 4, w);
        s->hu = mq_alloc_array(R * K, FE * 4, w);
        s->yg = mq_alloc_array(R * K, D * 4, w);
        s->sgate = mq_alloc_array(R, 4, w);
        s->n_tasks_cap = (int64_t)(E + R * K / MOE_ROWS + 1);
        s->tasks = mq_alloc_array((size_t)s->n_tasks_cap, sizeof(int64_t), w);
        ok = ok && s->rlog && s->rw && s->rsel && s->cnt && s->start && s->slot_tok &&
             s->tok_slot && s->xg && s->hg && s->hu && s->yg && s->sgate && s->tasks;
    }
    if (s->m->act_quant) {
        s->aq = mq_alloc_array(R, D * 4, w);
        ok = ok && s->aq;
        if (E > 0) {
            s->xq = mq_alloc_array(R * K, D * 4, w);
            s->hq = mq_alloc_array(R * K, FE * 4, w);
            ok = ok && s->xq && s->hq;
        }
    }
    if (!ok) {
        scratch_free(s);
        return MOEQ_E_NOMEM;
    }
    s->cap = T;
    return MOEQ_OK;
}

static moeq_status scores_reserve(mq_state *s) {
    int n = mq_pool_size();
    if (n <= s->n_thr) return MOEQ_OK;
    mq_free(s->scores);
    s->scores = mq_alloc_array((size_t)n * ATT_QB, (size_t)s->max_tokens * 4, "attention scratch");
    s->n_thr = s->scores ? n : 0;
    return s->scores ? MOEQ_OK : MOEQ_E_NOMEM;
}

/* The KV cache of a layer, made when the layer first runs (a state that runs one layer at a
 * time, as the streaming pipeline's, holds one layer's cache). */
static moeq_status kv_reserve(mq_state *s, int l) {
    if (s->kc[l]) return MOEQ_OK;
    s->kc[l] = mq_alloc_array((size_t)s->max_tokens, (size_t)s->kv_dim * 4, "KV cache");
    s->vc[l] = mq_alloc_array((size_t)s->max_tokens, (size_t)s->v_dim * 4, "KV cache");
    if (s->kc[l] && s->vc[l]) return MOEQ_OK;
    mq_state_drop_layer(s, l);
    return mq_err(MOEQ_E_NOMEM, "out of memory for the KV cache of layer %d (%d positions)", l,
                  s->max_tokens);
}

void mq_state_profile(mq_state *s, double *acc) { s->prof = acc; }

void mq_state_drop_layer(mq_state *s, int l) {
    mq_free(s->kc[l]);
    mq_free(s->vc[l]);
    s->kc[l] = s->vc[l] = NULL;
    s->filled[l] = 0;
}

int64_t mq_state_bytes(const moeq_model *m, int32_t max_tokens, bool moe_fp32) {
    const mq_config *c = &m->cfg;
    const int64_t R = max_tokens, D = c->D, Q = (int64_t)c->n_heads * c->head_dim;
    const int64_t QV = (int64_t)c->n_heads * c->v_head_dim;
    const int64_t F = c->ffn > c->shared_ffn ? c->ffn : c->shared_ffn;
    const int64_t E = moe_fp32 ? c->n_experts : 0, K = c->top_k, FE = c->moe_ffn;
    int64_t f = R * (2 * D + Q + (Q > QV ? Q : QV));                 /* xn, tmp, q, att */
    if (c->mla)
        f += R * ((c->q_lora_rank > 0 ? c->q_lora_rank : 1) + 2 * c->kv_lora_rank + c->qk_rope +
                  (int64_t)c->n_heads * (c->qk_nope + c->v_head_dim));
    f += 2 * R * F;                                                   /* g, u */
    if (E > 0) f += R * (E + 3 * K + 1) + 2 * E + R * K * (2 * D + 2 * FE) + R * K / 2;
    if (m->act_quant) f += R * D + (E > 0 ? R * K * (D + FE) : 0);
    f += R * (int64_t)c->n_kv_heads * (c->head_dim + c->v_head_dim);   /* one layer's KV cache */
    f += R * c->rope_dim;                                             /* RoPE tables */
    f += (int64_t)mq_pool_size() * ATT_QB * R;                        /* attention scores */
    return 4 * f;
}

moeq_status mq_state_new(const moeq_model *m, int32_t max_tokens, mq_state **out) {
    return mq_state_new_ex(m, max_tokens, true, out);
}

moeq_status mq_state_new_ex(const moeq_model *m, int32_t max_tokens, bool moe_scratch,
                            mq_state **out) {
    *out = NULL;
    if (max_tokens <= 0) return mq_err(MOEQ_E_ARG, "max_tokens must be positive (got %d)", max_tokens);
    const mq_config *c = &m->cfg;
    mq_state *s = calloc(1, sizeof *s);
    if (!s) return mq_err(MOEQ_E_NOMEM, "out of memory");
    s->m = m;
    s->max_tokens = max_tokens;
    s->kv_dim = (int64_t)c->n_kv_heads * c->head_dim;
    s->v_dim = (int64_t)c->n_kv_heads * c->v_head_dim;
    for (int l = 0; moe_scratch && l < c->n_layers; l++)
        s->moe_fp32 |= m->layers[l].is_moe && !m->layers[l].pexperts;
    s->kc = calloc((size_t)c->n_layers, sizeof(float *));
    s->vc = calloc((size_t)c->n_layers, sizeof(float *));
    s->lc = calloc((size_t)c->n_layers, sizeof(float *));
    s->filled = calloc((size_t)c->n_layers, sizeof(int64_t));
    int64_t half = c->rope_dim / 2;
    s->rope_cos = mq_alloc_array((size_t)max_tokens, (size_t)half * 4, "rope table");
    s->rope_sin = mq_alloc_array((size_t)max_tokens, (size_t)half * 4, "rope table");
    bool ok = s->kc && s->vc && s->lc && s->filled && s->rope_cos && s->rope_sin;
    if (!ok) {
        mq_state_free(s);
        return mq_err(MOEQ_E_NOMEM, "out of memory for a state of %d positions", max_tokens);
    }
    /* Like transformers' default rotary embedding: the exponent 2i/hd and the power are fp32,
     * and so is pos * inv_freq. YaRN: _compute_yarn_parameters' blend in fp32, its correction
     * range in double, cos/sin times the attention factor. */
    float theta = (float)c->rope_theta, af = (float)c->rope_attn_factor;
    double lo = 0, hi = 0;
    if (c->yarn) {
        const double dim = c->rope_dim, lb = 2 * log(c->rope_theta);
        const double two_pi = 2 * 3.14159265358979323846;   /* 2 * math.pi */
        lo = dim * log(c->yarn_orig_max_pos / (c->yarn_beta_fast * two_pi)) / lb;
        hi = dim * log(c->yarn_orig_max_pos / (c->yarn_beta_slow * two_pi)) / lb;
        if (c->yarn_truncate) {
            lo = floor(lo);
            hi = ceil(hi);
        }
        lo = lo > 0 ? lo : 0;
        hi = hi < dim - 1 ? hi : dim - 1;
        if (lo == hi) hi += 0.001;
    }
    for (int64_t i = 0; i < half; i++) {
        float pf = powf(theta, (float)(2 * i) / (float)c->rope_dim);
        float inv = 1.0f / pf;
        if (c->yarn) {
            float interp = 1.0f / ((float)c->yarn_factor * pf);
            float ramp = ((float)i - (float)lo) / (float)(hi - lo);
            ramp = ramp < 0 ? 0.0f : ramp > 1 ? 1.0f : ramp;
            float extra = 1.0f - ramp;
            inv = interp * (1.0f - extra) + inv * extra;
        }
        for (int32_t p = 0; p < max_tokens; p++) {
            float a = (float)p * inv;
            s->rope_cos[(int64_t)p * half + i] = cosf(a) * af;
            s->rope_sin[(int64_t)p * half + i] = sinf(a) * af;
        }
    }
    *out = s;
    return MOEQ_OK;
}

void mq_state_free(mq_state *s) {
    if (!s) return;
    for (int l = 0; l < s->m->cfg.n_layers; l++) {
        if (s->kc) mq_free(s->kc[l]);
        if (s->vc) mq_free(s->vc[l]);
        if (s->lc) mq_free(s->lc[l]);
    }
    MQ_FREE_EACH(s->kc, s->vc, s->lc, s->filled);
    MQ_RELEASE_EACH(s->rope_cos, s->rope_sin, s->scores);
    scratch_free(s);
    free(s);
}

void mq_state_rope_tables(const mq_state *s, const float **cos, const float **sin) {
    *cos = s->rope_cos;
    *sin = s->rope_sin;
}

void mq_state_reset(mq_state *s) {
    for (int l = 0; l < s->m->cfg.n_layers; l++) s->filled[l] = 0;
}

/* ---- embeddings, head ---------------------------------------------------------------------- */
moeq_status mq_embed(const moeq_model *m, const int32_t *ids, int64_t T, float *x) {
    int64_t D = m->cfg.D;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= m->cfg.vocab)
            return mq_err(MOEQ_E_ARG, "token id %d at position %lld is outside the vocabulary "
                          "(0..%d)", ids[t], (long long)t, m->cfg.vocab - 1);
    for (int64_t t = 0; t < T; t++)
        if (m->embed_g) mq_ggml_mat_row(m->embed_g, ids[t], x + t * D);
        else memcpy(x + t * D, m->embed + (int64_t)ids[t] * D, (size_t)D * 4);
    return MOEQ_OK;
}

void mq_final_norm(const moeq_model *m, float *x, int64_t T) {
    rmsnorm(x, T, m->cfg.D, m->final_norm, m->cfg.rms_eps, x);
    if (m->lm_head_act_q) act_qdq(m, m->lm_head_act_q, x, T, m->cfg.D);   /* x feeds lm_head only */
}

moeq_status mq_lm_head(const moeq_model *m, const float *x, int64_t T, float *logits) {
    if (!logits) return MOEQ_OK;
    if (m->head_g) return mq_ggml_mat_forward(m->head_g, x, T, logits);
    matmul_nt(x, T, m->lm_head, m->cfg.vocab, m->cfg.D, logits);
    return MOEQ_OK;
}

/* ---- attention ----------------------------------------------------------------------------- */
typedef struct {
    const mq_state *s;
    float *x;
    int64_t n_heads, pos;
} rope_job;

static void rope_rows(void *ctx, int64_t t0, int64_t t1) {
    const rope_job *j = ctx;
    const int64_t hd = j->s->m->cfg.head_dim, half = hd / 2;
    const mq_vec_kernels *vk = mq_vec();
    for (int64_t t = t0; t < t1; t++) {
        const float *cs = j->s->rope_cos + (j->pos + t) * half, *sn = j->s->rope_sin + (j->pos + t) * half;
        for (int64_t h = 0; h < j->n_heads; h++) vk->rope(j->x + (t * j->n_heads + h) * hd, half, cs, sn);
    }
}

/* rotate_half RoPE on x[T, n_heads, hd] for positions pos.. */
static void rope(const mq_state *s, float *x, int64_t T, int64_t n_heads, int64_t pos) {
    rope_job j = {s, x, n_heads, pos};
    mq_parallel_ranges(T, ROWS_TASK, T * n_heads * s->m->cfg.head_dim >= ROWS_POOL_MIN, rope_rows, &j);
}

typedef struct {
    mq_state *s;
    int layer;
    int64_t T, pos, n_qb;
    float scale;
} att_job;

static void attention_task(void *ctx, int64_t task, int thread) {
    const att_job *j = ctx;
    mq_state *s = j->s;
    const mq_config *c = &s->m->cfg;
    int64_t H = c->n_heads, hd = c->head_dim, ldq = H * hd, ldk = s->kv_dim, ldv = s->v_dim;
    int64_t vd = c->v_head_dim, ldo = H * vd;
    /* the last query blocks (the most keys under the causal mask) of every head first, so the
     * cheap first blocks fill the end instead of one head's costliest waiting there */
    int64_t b = j->n_qb - 1 - task / H, h = task % H;
    int64_t kvh = h / (H / c->n_kv_heads);
    int64_t i0 = b * ATT_QB, rows = j->T - i0 < ATT_QB ? j->T - i0 : ATT_QB;
    int64_t window = c->layer_sliding[j->layer] ? c->sliding_window : 0;
    /* Keys [k0, k1) cover every row of the block. */
    int64_t k1 = j->pos + i0 + rows;
    int64_t k0 = window > 0 && j->pos + i0 - window + 1 > 0 ? j->pos + i0 - window + 1 : 0;
    int64_t nk = k1 - k0;
    float *S = s->scores + (int64_t)thread * ATT_QB * s->max_tokens;
    const float *kc = s->kc[j->layer] + k0 * ldk + kvh * hd;
    const float *vc = s->vc[j->layer] + k0 * ldv + kvh * vd;
    const float *q = s->q + i0 * ldq + h * hd;
    float *out = s->att + i0 * ldo + h * vd;
    const mq_vec_kernels *vk = mq_vec();
    bool gemm = rows >= ATT_GEMM_ROWS;
    if (gemm) mq_gemm_nt(rows, nk, hd, j->scale, q, ldq, kc, ldk, 0.0f, S, nk);
    for (int64_t r = 0; r < rows; r++) {
        float *sr = S + r * nk;
        int64_t p = j->pos + i0 + r;   /* this query's position */
        int64_t lo = window > 0 && p - window + 1 > k0 ? p - window + 1 - k0 : 0;
        int64_t hi = p + 1 - k0;       /* keys [lo, hi) are visible */
        if (!gemm) vk->gemv(kc + lo * ldk, ldk, hi - lo, q + r * ldq, hd, j->scale, sr + lo);
        vk->softmax(sr + lo, hi - lo);
        if (gemm) {   /* the masked keys take part in the GEMM with weight 0 */
            memset(sr, 0, sizeof(float) * (size_t)lo);
            memset(sr + hi, 0, sizeof(float) * (size_t)(nk - hi));
        } else {      /* a few rows: out = sum of p_i v_i over the visible keys, in key order */
            vk->gemv_t(vc + lo * ldv, ldv, hi - lo, sr + lo, vd, out + r * ldo);
        }
    }
    if (gemm) mq_gemm_nn(rows, vd, nk, 1.0f, S, nk, vc, ldv, 0.0f, out, ldo);
}

/* q, k and v projections of one layer. fp32 weights with enough rows run as one set of pool
 * tasks (one wake-up instead of three): core's GEMM grid over the three products, each tile
 * computed by mq_gemm_nt on that tile alone (which, nested in a task, runs on this thread), so the
 * values are those of mq_gemm_nt on each whole product. */
enum { QKV_TILE_M = MQ_GEMM_TILE_M, QKV_TILE_N = MQ_GEMM_TILE_N };

typedef struct {
    const mq_linear *l[3];
    const float *x;
    float *y[3];
    int64_t T, tm, tn[3];   /* row tiles, column tiles of each product */
} qkv_job;

static void qkv_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    const qkv_job *j = ctx;
    int p = 0;
    while (task >= j->tm * j->tn[p]) task -= j->tm * j->tn[p++];
    const mq_linear *l = j->l[p];
    int64_t m0 = task / j->tn[p] * QKV_TILE_M, n0 = task % j->tn[p] * QKV_TILE_N;
    int64_t m = j->T - m0 < QKV_TILE_M ? j->T - m0 : QKV_TILE_M;
    int64_t n = l->out - n0 < QKV_TILE_N ? l->out - n0 : QKV_TILE_N;
    mq_gemm_nt(m, n, l->in, 1.0f, j->x + m0 * l->in, l->in, l->w + n0 * l->in, l->in, 0.0f,
               j->y[p] + m0 * l->out + n0, l->out);
}

static moeq_status qkv_forward(const mq_layer *ly, const float *x, int64_t T, float *q, float *k,
                               float *v) {
    const struct mq_packed_weight *pw[3] = {ly->q.qw, ly->k.qw, ly->v.qw};
    if (pw[0] && pw[1] && pw[2] && pw[1]->in == pw[0]->in && pw[2]->in == pw[0]->in &&
        pw[1]->W.nvfp4 == pw[0]->W.nvfp4 && pw[2]->W.nvfp4 == pw[0]->W.nvfp4) {
        /* packed alike: one quantization of x and one pool loop for the three */
        float *y[3] = {q, k, v};
        moeq_status st = mq_packed_weights_forward(pw, 3, x, T, y);
        if (st) return mq_err_prefix(st, "%s", ly->q.name);
        add_bias(&ly->q, q, T);
        add_bias(&ly->k, k, T);
        add_bias(&ly->v, v, T);
        return MOEQ_OK;
    }
    if (T < SMALL_T || !ly->q.w || !ly->k.w || !ly->v.w) {
        moeq_status st = mq_linear_forward(&ly->q, x, T, q);
        if (!st) st = mq_linear_forward(&ly->k, x, T, k);
        if (!st) st = mq_linear_forward(&ly->v, x, T, v);
        return st;
    }
    qkv_job j = {{&ly->q, &ly->k, &ly->v}, x, {q, k, v}, T, (T + QKV_TILE_M - 1) / QKV_TILE_M, {0}};
    int64_t n_tasks = 0;
    for (int p = 0; p < 3; p++) {
        j.tn[p] = (j.l[p]->out + QKV_TILE_N - 1) / QKV_TILE_N;
        n_tasks += j.tm * j.tn[p];
    }
    mq_parallel_for(n_tasks, qkv_task, &j);
    for (int p = 0; p < 3; p++) add_bias(j.l[p], j.y[p], T);
    return MOEQ_OK;
}

/* The rotary part rp[rope_dim] of one head at position p: de-interleaved first when the
 * checkpoint's pairs are adjacent (rope_interleave), then the rotate_half rotation. tmp: scratch
 * of rope_dim floats. */
static void mla_rope(const mq_state *s, float *rp, int64_t p, float *tmp) {
    const mq_config *c = &s->m->cfg;
    const int64_t half = c->rope_dim / 2;
    if (c->rope_interleave) {
        for (int64_t i = 0; i < half; i++) {
            tmp[i] = rp[2 * i];
            tmp[half + i] = rp[2 * i + 1];
        }
        memcpy(rp, tmp, sizeof(float) * (size_t)c->rope_dim);
    }
    mq_vec()->rope(rp, half, s->rope_cos + p * half, s->rope_sin + p * half);
}

/* Multi-head latent attention (see the file comment); x += o_proj(attention) as the standard
 * block does, with the hooks QKV (q_a / q_proj and kv_a input), Q_B, KV_B and O. */
/* vb_act_q: head h's attention over the cached normed latents (keys as cached), its latent output
 * Q8_0-rounded, then kv_b's v rows of the head: what llama.cpp's absorbed MLA computes. */
typedef struct {
    mq_state *s;
    int l;
    int64_t T, pos;
    float scale;
} latent_job;

enum { LATENT_MAX = 4096 };   /* kv_lora_rank bound of vb_act_q (load.c) */

static void latent_attention_task(void *ctx, int64_t h, int thread) {
    const latent_job *j = ctx;
    mq_state *s = j->s;
    const mq_config *c = &s->m->cfg;
    int64_t H = c->n_heads, hd = c->head_dim, nope = c->qk_nope, vd = c->v_head_dim;
    int64_t r = c->kv_lora_rank;
    const mq_vec_kernels *vk = mq_vec();
    float *S = s->scores + (int64_t)thread * ATT_QB * s->max_tokens, o[LATENT_MAX];
    const float *vb = s->m->layers[j->l].kv_b.w + (h * (nope + vd) + nope) * r;
    for (int64_t t = 0; t < j->T; t++) {
        int64_t n = j->pos + t + 1;   /* causal: keys [0, n) */
        vk->gemv(s->kc[j->l] + h * hd, s->kv_dim, n, s->q + (t * H + h) * hd, hd, j->scale, S);
        vk->softmax(S, n);
        vk->gemv_t(s->lc[j->l], r, n, S, r, o);
        mq_q8_0_act_qdq(o, 1, r);
        vk->gemv(vb, r, vd, o, r, 1.0f, s->att + (t * H + h) * vd);
    }
}

static moeq_status mla_attention_block(const moeq_model *m, mq_state *s, int l, float *x,
                                       int64_t T, int64_t pos, const mq_hooks *hk) {
    const mq_config *c = &m->cfg;
    const mq_layer *ly = &m->layers[l];
    const int64_t D = c->D, H = c->n_heads, hd = c->head_dim, nope = c->qk_nope, rd = c->rope_dim;
    const int64_t vd = c->v_head_dim, r = c->kv_lora_rank, ra = r + rd, kvw = nope + vd;
    const float lat_eps = 1e-6f;   /* DeepseekV3RMSNorm(q_lora_rank / kv_lora_rank): default eps */
    rmsnorm(x, T, D, ly->attn_norm, c->rms_eps, s->xn);
    hook(hk, l, MQ_SITE_QKV, -1, s->xn, T, D);
    /* xn feeds only q_a (q_proj) and kv_a: quantized in place, once for both */
    const int kx = ly->q.act_q ? ly->q.act_q : ly->q_a.act_q ? ly->q_a.act_q : ly->kv_a.act_q;
    if (kx) act_qdq(m, kx, s->xn, T, D);
    moeq_status st;
    if (c->q_lora_rank > 0) {
        const int64_t qr = c->q_lora_rank;
        if ((st = mq_linear_forward(&ly->q_a, s->xn, T, s->qa))) return st;
        rmsnorm(s->qa, T, qr, ly->q_a_norm, lat_eps, s->qa);
        hook(hk, l, MQ_SITE_Q_B, -1, s->qa, T, qr);
        if (ly->q_b.act_q) act_qdq(m, ly->q_b.act_q, s->qa, T, qr);
        st = mq_linear_forward(&ly->q_b, s->qa, T, s->q);
    } else {
        st = mq_linear_forward(&ly->q, s->xn, T, s->q);
    }
    if (!st) st = mq_linear_forward(&ly->kv_a, s->xn, T, s->ckv);
    if (st) return st;
    /* the latent's norm in place; its rotary key k_rot stays behind it in each row */
    for (int64_t t = 0; t < T; t++)
        rmsnorm(s->ckv + t * ra, 1, r, ly->kv_a_norm, lat_eps, s->ckv + t * ra);
    /* kv_b reads the normed latents as one [T, r] matrix */
    float *lat = s->lat;
    for (int64_t t = 0; t < T; t++) memcpy(lat + t * r, s->ckv + t * ra, sizeof(float) * (size_t)r);
    hook(hk, l, MQ_SITE_KV_B, -1, lat, T, r);
    if (ly->kv_b.act_q) act_qdq(m, ly->kv_b.act_q, lat, T, r);
    if ((st = mq_linear_forward(&ly->kv_b, lat, T, s->kvb))) return st;

    /* keys [k_nope, rope(k_rot)] and values per head, into the cache at these positions */
    float *kc = s->kc[l] + pos * s->kv_dim, *vc = s->vc[l] + pos * s->v_dim;
    float tmp[256];
    MQ_ASSERT(rd <= 256);
    for (int64_t t = 0; t < T; t++) {
        float *kr = s->ckv + t * ra + r;
        mla_rope(s, kr, pos + t, tmp);
        for (int64_t h = 0; h < H; h++) {
            const float *src = s->kvb + (t * H + h) * kvw;
            float *kd = kc + t * s->kv_dim + h * hd;
            memcpy(kd, src, sizeof(float) * (size_t)nope);
            memcpy(kd + nope, kr, sizeof(float) * (size_t)rd);
            memcpy(vc + t * s->v_dim + h * vd, src + nope, sizeof(float) * (size_t)vd);
            mla_rope(s, s->q + (t * H + h) * hd + nope, pos + t, tmp);
        }
    }
    if (ly->vb_act_q) {
        if (!s->lc[l])
            s->lc[l] = mq_alloc_array((size_t)s->max_tokens, (size_t)r * 4, "latent cache");
        if (!s->lc[l]) return MOEQ_E_NOMEM;
        memcpy(s->lc[l] + pos * r, lat, sizeof(float) * (size_t)(T * r));
        latent_job lj = {s, l, T, pos, (float)c->attn_scale};
        run_tasks(H, latent_attention_task, &lj, T < SMALL_T);
    } else {
        att_job j = {s, l, T, pos, (T + ATT_QB - 1) / ATT_QB, (float)c->attn_scale};
        run_tasks(H * j.n_qb, attention_task, &j, T < SMALL_T);
    }

    hook(hk, l, MQ_SITE_O, -1, s->att, T, H * vd);
    if (ly->o.act_q) act_qdq(m, ly->o.act_q, s->att, T, H * vd);
    if ((st = mq_linear_forward(&ly->o, s->att, T, s->tmp))) return st;
    residual_add(s->tmp, x, T * D);
    return MOEQ_OK;
}

/* MOEQ_DEBUG_PROFILE's attention parts: the seconds since *t to part k, *t moved on. */
static void prof_add(mq_state *s, int k, double *t) {
    if (!s->prof) return;
    const double now = mq_now();
    s->prof[k] += now - *t;
    *t = now;
}

static moeq_status attention_block(const moeq_model *m, mq_state *s, int l, float *x, int64_t T,
                                   int64_t pos, const mq_hooks *hk) {
    if (kv_reserve(s, l)) return MOEQ_E_NOMEM;
    if (m->cfg.mla) return mla_attention_block(m, s, l, x, T, pos, hk);
    const mq_config *c = &m->cfg;
    const mq_layer *ly = &m->layers[l];
    int64_t D = c->D, H = c->n_heads, KV = c->n_kv_heads, hd = c->head_dim;
    double t = s->prof ? mq_now() : 0;
    rmsnorm(x, T, D, ly->attn_norm, c->rms_eps, s->xn);
    prof_add(s, MQ_ATT_NORM, &t);
    hook(hk, l, MQ_SITE_QKV, -1, s->xn, T, D);
    prof_add(s, MQ_ATT_HOOKS, &t);
    /* k and v of these positions are computed in place in the cache (same [T, KV*hd] layout) */
    float *k = s->kc[l] + pos * s->kv_dim, *v = s->vc[l] + pos * s->kv_dim;
    moeq_status st;
    if (ly->q.act_q == ly->k.act_q && ly->q.act_q == ly->v.act_q) {
        /* xn feeds only q/k/v: quantized in place, once for the three */
        if (ly->q.act_q) act_qdq(m, ly->q.act_q, s->xn, T, D);
        st = qkv_forward(ly, s->xn, T, s->q, k, v);
    } else {   /* a GGUF's mixture (Q4_K q, Q8_0 k and v): each its own rounding of xn */
        const mq_linear *lin[3] = {&ly->q, &ly->k, &ly->v};
        float *out[3] = {s->q, k, v};
        st = MOEQ_OK;
        for (int p = 0; p < 3 && !st; p++) {
            const float *in = s->xn;
            if (lin[p]->act_q) {
                memcpy(s->aq, s->xn, sizeof(float) * (size_t)(T * D));
                act_qdq(m, lin[p]->act_q, s->aq, T, D);
                in = s->aq;
            }
            st = mq_linear_forward(lin[p], in, T, out[p]);
        }
    }
    if (st) return st;
    prof_add(s, MQ_ATT_QKV, &t);
    if (c->qk_norm == MQ_QKNORM_FULL) {
        rmsnorm(s->q, T, H * hd, ly->q_norm, c->rms_eps, s->q);
        rmsnorm(k, T, KV * hd, ly->k_norm, c->rms_eps, k);
    } else if (c->qk_norm == MQ_QKNORM_HEAD) {
        rmsnorm(s->q, T * H, hd, ly->q_norm, c->rms_eps, s->q);
        rmsnorm(k, T * KV, hd, ly->k_norm, c->rms_eps, k);
    }
    if (c->clip_qkv > 0) {
        float lim = c->clip_qkv;
        float *bufs[3] = {s->q, k, v};
        int64_t n[3] = {T * H * hd, T * KV * hd, T * KV * hd};
        for (int b = 0; b < 3; b++)
            for (int64_t i = 0; i < n[b]; i++)
                bufs[b][i] = bufs[b][i] < -lim ? -lim : bufs[b][i] > lim ? lim : bufs[b][i];
    }
    rope(s, s->q, T, H, pos);
    rope(s, k, T, KV, pos);
    prof_add(s, MQ_ATT_QK_ROPE, &t);

    att_job j = {s, l, T, pos, (T + ATT_QB - 1) / ATT_QB, (float)c->attn_scale};
    run_tasks(H * j.n_qb, attention_task, &j, T < SMALL_T);
    prof_add(s, MQ_ATT_SCORES, &t);

    hook(hk, l, MQ_SITE_O, -1, s->att, T, H * hd);
    prof_add(s, MQ_ATT_HOOKS, &t);
    if (ly->o.act_q) act_qdq(m, ly->o.act_q, s->att, T, H * hd);
    if ((st = mq_linear_forward(&ly->o, s->att, T, s->tmp))) return st;
    prof_add(s, MQ_ATT_O, &t);
    residual_add(s->tmp, x, T * D);
    prof_add(s, MQ_ATT_RESIDUAL, &t);
    return MOEQ_OK;
}

/* ---- feed-forward -------------------------------------------------------------------------- */
/* SwiGLU MLP of xn[T, D] into out[T, D] (g, u: [T, F] scratch; aq: [T, D] scratch for the
 * quantized input, as xn may be needed afterwards). */
static moeq_status mlp(const moeq_model *m, const mq_linear *gate, const mq_linear *up,
                       const mq_linear *down, const float *xn, int64_t T, float *g, float *u,
                       float *aq, float *out,
                       const mq_hooks *hk, int l, mq_site site_in, mq_site site_down) {
    hook(hk, l, site_in, -1, xn, T, gate->in);
    const float *xin = xn;
    /* gate and up: one rounded copy, or each its own where a GGUF gives them other types */
    if (gate->act_q) {
        memcpy(aq, xn, sizeof(float) * (size_t)(T * gate->in));
        act_qdq(m, gate->act_q, aq, T, gate->in);
        xin = aq;
    }
    moeq_status st = mq_linear_forward(gate, xin, T, g);
    if (!st && up->act_q != gate->act_q) {
        xin = xn;
        if (up->act_q) {
            memcpy(aq, xn, sizeof(float) * (size_t)(T * gate->in));
            act_qdq(m, up->act_q, aq, T, gate->in);
            xin = aq;
        }
    }
    if (!st) st = mq_linear_forward(up, xin, T, u);
    if (st) return st;
    swiglu(g, u, T * gate->out);
    hook(hk, l, site_down, -1, g, T, gate->out);
    if (down->act_q) act_qdq(m, down->act_q, g, T, gate->out);
    return mq_linear_forward(down, g, T, out);
}

/* Softmax over all experts, then top-k (ties to the lower index) and optional renormalisation;
 * or (sigmoid_router) deepseek_v3's group-limited choice on the biased sigmoid scores. */
static void route(const mq_config *c, const float *bias, float *probs, int64_t T, int32_t *sel,
                  float *w);

/* The router's logits in pieces of ROUTER_ROWS tokens (every expert in each), one pool loop: in
 * core's grid of 256-row tiles a 512-token sample's router was 2 tasks, so at 16 threads 14 waited
 * for it once a sample and pass. 64 rows: 8 tasks there for 1.1x the work of 256-row tiles (1.5
 * against 1.36 ms on one core here for 512 x 64 x 2048; 32 rows took 1.75 ms). Each piece's
 * product is one call of its own (nested in a task: on that thread), the same for any thread
 * count. */
enum { ROUTER_ROWS = 64 };

typedef struct {
    const float *x, *W;
    int64_t E, D;
    float *y;
} router_job;

static void router_rows(void *ctx, int64_t t0, int64_t t1) {
    const router_job *j = ctx;
    mq_gemm_nt(t1 - t0, j->E, j->D, 1.0f, j->x + t0 * j->D, j->D, j->W, j->D, 0.0f, j->y + t0 * j->E, j->E);
}

void mq_moe_route(const moeq_model *m, int l, const float *xn, int64_t T, float *probs,
                  int32_t *sel, float *w) {
    const mq_config *c = &m->cfg;
    if (T < SMALL_T) {
        matmul_nt(xn, T, m->layers[l].router, c->n_experts, c->D, probs);
    } else {
        router_job j = {xn, m->layers[l].router, c->n_experts, c->D, probs};
        mq_parallel_ranges(T, ROUTER_ROWS, true, router_rows, &j);
    }
    route(c, m->layers[l].router_bias, probs, T, sel, w);
}

moeq_status mq_mlp_forward(const mq_linear *gate, const mq_linear *up, const mq_linear *down,
                              const float *x, int64_t n, float *g, float *u, float *y) {
    moeq_status st = mq_linear_forward(gate, x, n, g);
    if (!st) st = mq_linear_forward(up, x, n, u);
    if (st) return st;
    swiglu(g, u, n * gate->out);
    return y ? mq_linear_forward(down, g, n, y) : MOEQ_OK;
}

/* DeepseekV3TopkRouter on one token's logits p[E] (sigmoid scores left in p): the topk_group
 * groups whose two best biased scores sum highest, then the top K biased scores inside them
 * (the other experts masked with -inf), weights the unbiased scores. Ties go to the lower index. */
static void route_sigmoid(const mq_config *c, const float *bias, float *p, int32_t *st, float *wt) {
    const int64_t E = c->n_experts, K = c->top_k, G = c->n_group, EG = E / G;
    float sc[1024], gs[1024];   /* biased scores [E], group scores [G] (the config caps E below) */
    uint8_t keep[1024];
    for (int64_t e = 0; e < E; e++) {
        p[e] = 1.0f / (1.0f + expf(-p[e]));
        sc[e] = bias ? p[e] + bias[e] : p[e];
    }
    for (int64_t g = 0; g < G; g++) {
        float b1 = -INFINITY, b2 = -INFINITY;   /* the group's best two */
        for (int64_t e = g * EG; e < (g + 1) * EG; e++) {
            if (sc[e] > b1) {
                b2 = b1;
                b1 = sc[e];
            } else if (sc[e] > b2) {
                b2 = sc[e];
            }
        }
        gs[g] = b1 + b2;
        keep[g] = 0;
    }
    for (int64_t k = 0; k < c->topk_group; k++) {
        int64_t best = -1;
        for (int64_t g = 0; g < G; g++)
            if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
        if (best < 0) break;   /* topk_group <= n_group (config) */
        keep[best] = 1;
    }
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            if (!keep[e / EG]) continue;
            bool taken = false;
            for (int64_t j = 0; j < k; j++) taken |= st[j] == e;
            if (!taken && (best < 0 || sc[e] > sc[best])) best = e;
        }
        if (best < 0) best = 0;   /* not reached: top_k <= topk_group * E / n_group (config) */
        st[k] = (int32_t)best;
        wt[k] = p[best];
    }
    float ws = 0;
    for (int64_t k = 0; k < K; k++) ws += wt[k];
    for (int64_t k = 0; k < K; k++) {
        if (c->norm_topk_prob) wt[k] /= ws + 1e-20f;
        wt[k] *= c->routed_scale;
    }
}

static void route_rows(const mq_config *c, const float *bias, float *probs, int64_t t0, int64_t t1,
                       int32_t *sel, float *w) {
    int64_t E = c->n_experts, K = c->top_k;
    for (int64_t t = t0; t < t1; t++) {
        if (c->sigmoid_router) {
            route_sigmoid(c, bias, probs + t * E, sel + t * K, w + t * K);
            continue;
        }
        mq_route_softmax_topk(probs + t * E, E, K, c->norm_topk_prob, sel + t * K, w + t * K);
    }
}

typedef struct {
    const mq_config *c;
    const float *bias;
    float *probs;
    int32_t *sel;
    float *w;
} route_job;

static void route_range(void *ctx, int64_t t0, int64_t t1) {
    const route_job *j = ctx;
    route_rows(j->c, j->bias, j->probs, t0, t1, j->sel, j->w);
}

/* Every token alone (any split gives the same choices), in blocks of rows on the pool. */
static void route(const mq_config *c, const float *bias, float *probs, int64_t T, int32_t *sel,
                  float *w) {
    route_job j = {c, bias, probs, sel, w};
    mq_parallel_ranges(T, ROWS_TASK, T * c->n_experts >= ROWS_POOL_MIN / 4, route_range, &j);
}

/* Stages of the routed experts: all at once, or (activation quantization, whose global scale
 * spans all of an expert's rows) in three passes with a per-expert quantization between them. */
enum { EX_ALL = 0, EX_GATHER, EX_GATE_UP, EX_DOWN };

typedef struct {
    const moeq_model *m;
    mq_state *s;
    int layer;
    int stage;
} moe_job;

/* One expert on up to MOE_ROWS of its routed rows: gather, gate/up, SwiGLU, down. The expert
 * Linears are fp32 here (packed experts run through pexperts), so they cannot fail. */
static void expert_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    const moe_job *j = ctx;
    mq_state *s = j->s;
    const mq_config *c = &j->m->cfg;
    const mq_layer *ly = &j->m->layers[j->layer];
    int64_t code = s->tasks[task];
    int64_t e = code >> 32, r0 = (code & 0xffffffff) * MOE_ROWS;
    int64_t n = s->cnt[e] - r0 < MOE_ROWS ? s->cnt[e] - r0 : MOE_ROWS;
    int64_t D = c->D, F = c->moe_ffn, s0 = s->start[e] + r0;
    bool all = j->stage == EX_ALL;
    if (all || j->stage == EX_GATHER)
        for (int64_t r = 0; r < n; r++)
            memcpy(s->xg + (s0 + r) * D, s->xn + (int64_t)s->slot_tok[s0 + r] * D, (size_t)D * 4);
    if (all) {   /* through mq_mlp_forward, as the streaming pipeline runs the experts */
        (void)mq_mlp_forward(&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e], s->xg + s0 * D,
                                n, s->hg + s0 * F, s->hu + s0 * F, s->yg + s0 * D);
        return;
    }
    if (j->stage == EX_GATE_UP) {
        const float *xin = ly->exp_gate[e].act_q ? s->xq : s->xg;
        (void)mq_linear_forward(&ly->exp_gate[e], xin + s0 * D, n, s->hg + s0 * F);
        (void)mq_linear_forward(&ly->exp_up[e], xin + s0 * D, n, s->hu + s0 * F);
        swiglu(s->hg + s0 * F, s->hu + s0 * F, n * F);
    }
    if (j->stage == EX_DOWN) {
        const float *hin = ly->exp_down[e].act_q ? s->hq : s->hg;
        (void)mq_linear_forward(&ly->exp_down[e], hin + s0 * F, n, s->yg + s0 * D);
    }
}

/* Activation quantization of expert e's routed rows before the stage j->stage: a copy, so the
 * hooks still see the unquantized inputs. */
static void expert_qdq_task(void *ctx, int64_t e, int thread) {
    (void)thread;
    const moe_job *j = ctx;
    mq_state *s = j->s;
    const mq_layer *ly = &j->m->layers[j->layer];
    int64_t n = s->cnt[e], s0 = s->start[e], D = j->m->cfg.D, F = j->m->cfg.moe_ffn;
    if (n == 0) return;
    if (j->stage == EX_GATE_UP && ly->exp_gate[e].act_q) {
        memcpy(s->xq + s0 * D, s->xg + s0 * D, sizeof(float) * (size_t)(n * D));
        act_qdq(j->m, ly->exp_gate[e].act_q, s->xq + s0 * D, n, D);
    } else if (j->stage == EX_DOWN && ly->exp_down[e].act_q) {
        memcpy(s->hq + s0 * F, s->hg + s0 * F, sizeof(float) * (size_t)(n * F));
        act_qdq(j->m, ly->exp_down[e].act_q, s->hq + s0 * F, n, F);
    }
}

/* The packed layer: the kernels' fused op with the model's routing. */
static moeq_status moe_block_packed(const moeq_model *m, mq_state *s, int l, int64_t T, float *out) {
    const mq_config *c = &m->cfg;
    const mq_layer *ly = &m->layers[l];
    mq_moe_layer L = {.experts = ly->pexperts,
                      .router = ly->router,
                      .router_bias = ly->router_bias,
                      .shared_gate = c->shared_gate ? ly->sh_gate_w : NULL,
                      .top_k = c->top_k,
                      .scoring = c->sigmoid_router ? MOEQ_MOE_SIGMOID : MOEQ_MOE_SOFTMAX,
                      .renormalize = c->norm_topk_prob ? 1 : 0,
                      .route_scale = c->routed_scale,
                      .n_group = c->n_group,
                      .topk_group = c->topk_group};
    moeq_status st = mq_moe_layer_forward(&L, s->xn, T, out);
    return st ? mq_err_prefix(st, "layer %d", l) : MOEQ_OK;
}

static moeq_status moe_block(const moeq_model *m, mq_state *s, int l, int64_t T, float *out,
                             const mq_hooks *hk) {
    const mq_config *c = &m->cfg;
    const mq_layer *ly = &m->layers[l];
    if (ly->pexperts) return moe_block_packed(m, s, l, T, out);
    int64_t D = c->D, E = c->n_experts, K = c->top_k, F = c->moe_ffn;
    const mq_vec_kernels *vk = mq_vec();
    mq_moe_route(m, l, s->xn, T, s->rlog, s->rsel, s->rw);

    /* Expert-major slots, tokens in increasing order within each expert. */
    for (int64_t e = 0; e < E; e++) s->cnt[e] = 0;
    for (int64_t i = 0; i < T * K; i++) s->cnt[s->rsel[i]]++;
    s->start[0] = 0;
    for (int64_t e = 0; e < E; e++) s->start[e + 1] = s->start[e] + s->cnt[e];
    int64_t n_tasks = 0;
    for (int64_t e = 0; e < E; e++) {
        for (int64_t b = 0; b * MOE_ROWS < s->cnt[e]; b++) s->tasks[n_tasks++] = e << 32 | b;
        s->cnt[e] = 0;   /* refilled below */
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e = s->rsel[t * K + k];
            int32_t slot = s->start[e] + s->cnt[e]++;
            s->slot_tok[slot] = (int32_t)t;
            s->tok_slot[t * K + k] = slot;
        }
    moe_job j = {m, s, l, EX_ALL};
    bool small = T < SMALL_T;
    if (!s->xq) {
        run_tasks(n_tasks, expert_task, &j, small);
    } else {
        j.stage = EX_GATHER;
        run_tasks(n_tasks, expert_task, &j, small);
        for (j.stage = EX_GATE_UP; j.stage <= EX_DOWN; j.stage++) {
            run_tasks(E, expert_qdq_task, &j, small);
            run_tasks(n_tasks, expert_task, &j, small);
        }
    }
    for (int64_t e = 0; e < E; e++) {
        hook(hk, l, MQ_SITE_EXPERT, (int)e, s->xg + (int64_t)s->start[e] * D, s->cnt[e], D);
        hook(hk, l, MQ_SITE_EXPERT_DOWN, (int)e, s->hg + (int64_t)s->start[e] * F, s->cnt[e], F);
    }

    /* out[t] = sum over the token's experts in increasing expert order of w * y. */
    for (int64_t t = 0; t < T; t++) {
        int32_t order[64], *sel = s->rsel + t * K;
        int64_t kk = K < 64 ? K : 64;
        for (int64_t k = 0; k < kk; k++) order[k] = (int32_t)k;
        for (int64_t a = 1; a < kk; a++)   /* insertion sort by expert id */
            for (int64_t b = a; b > 0 && sel[order[b - 1]] > sel[order[b]]; b--) {
                int32_t tmp = order[b];
                order[b] = order[b - 1];
                order[b - 1] = tmp;
            }
        float *o = out + t * D;
        for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
        for (int64_t k = 0; k < kk; k++) {
            float w = s->rw[t * K + order[k]];
            const float *y = s->yg + (int64_t)s->tok_slot[t * K + order[k]] * D;
            vk->axpy(w, y, o, D);
        }
    }

    if (c->shared_ffn > 0) {
        float *sy = s->yg;   /* routed outputs are consumed; reuse for the shared expert */
        moeq_status st = mlp(m, &ly->sh_gate, &ly->sh_up, &ly->sh_down, s->xn, T, s->g, s->u, s->aq,
                             sy, hk, l, MQ_SITE_SHARED, MQ_SITE_SHARED_DOWN);
        if (st) return st;
        mq_shared_expert_add(m, l, s->xn, T, sy, s->sgate, out);
    }
    return MOEQ_OK;
}

void mq_shared_expert_add(const moeq_model *m, int l, const float *xn, int64_t T, const float *sy,
                          float *sgate, float *out) {
    const mq_config *c = &m->cfg;
    const int64_t D = c->D;
    if (c->shared_gate) matmul_nt(xn, T, m->layers[l].sh_gate_w, 1, D, sgate);
    for (int64_t t = 0; t < T; t++) {
        float gsc = c->shared_gate ? 1.0f / (1.0f + expf(-sgate[t])) : 1.0f;
        mq_vec()->axpy(gsc, sy + t * D, out + t * D, D);
    }
}


static moeq_status ffn_block(const moeq_model *m, mq_state *s, int l, float *x, int64_t T,
                             const mq_hooks *hk) {
    const mq_config *c = &m->cfg;
    const mq_layer *ly = &m->layers[l];
    rmsnorm(x, T, c->D, ly->ffn_norm, c->rms_eps, s->xn);
    hook(hk, l, MQ_SITE_FFN, -1, s->xn, T, c->D);
    moeq_status st;
    if (ly->is_moe)
        st = moe_block(m, s, l, T, s->tmp, hk);
    else
        st = mlp(m, &ly->gate, &ly->up, &ly->down, s->xn, T, s->g, s->u, s->aq, s->tmp, hk, l,
                 MQ_SITE_MLP, MQ_SITE_MLP_DOWN);
    if (st) return st;
    residual_add(s->tmp, x, T * c->D);
    return MOEQ_OK;
}

void mq_ffn_norm(const moeq_model *m, int l, const float *x, int64_t T, float *xn) {
    rmsnorm(x, T, m->cfg.D, m->layers[l].ffn_norm, m->cfg.rms_eps, xn);
}

moeq_status mq_attention_forward(const moeq_model *m, mq_state *s, int l, float *x, int64_t T,
                                 int64_t pos, const mq_hooks *hooks) {
    if (s->m != m) return mq_err(MOEQ_E_ARG, "mq_attention_forward: the state was made for another model");
    if (T <= 0) return MOEQ_OK;
    if (pos < 0 || pos + T > s->max_tokens || pos > s->filled[l])
        return mq_err(MOEQ_E_ARG, "layer %d: positions %lld..%lld do not fit the state", l,
                      (long long)pos, (long long)(pos + T - 1));
    if (scratch_reserve(s, T) || scores_reserve(s))
        return mq_err(MOEQ_E_NOMEM, "out of memory for the forward scratch of %lld tokens",
                      (long long)T);
    moeq_status st = attention_block(m, s, l, x, T, pos, hooks);
    if (!st) s->filled[l] = pos + T;
    return st;
}

moeq_status mq_forward_layers(const moeq_model *m, mq_state *s, float *x, int64_t T, int64_t pos,
                              int l0, int l1, const mq_hooks *hooks) {
    if (s->m != m) return mq_err(MOEQ_E_ARG, "mq_forward_layers: the state was made for another model");
    if (T <= 0) return MOEQ_OK;
    if (pos < 0 || pos + T > s->max_tokens)
        return mq_err(MOEQ_E_ARG, "positions %lld..%lld do not fit a state of %d tokens",
                      (long long)pos, (long long)(pos + T - 1), s->max_tokens);
    if (l0 < 0 || l1 > m->cfg.n_layers || l0 > l1)
        return mq_err(MOEQ_E_ARG, "layer range [%d, %d) is outside 0..%d", l0, l1, m->cfg.n_layers);
    if (hooks && hooks->fn && m->n_packed > 0)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: calibration hooks need the dequantized fp32 path, "
                      "but the model was opened with keep_packed (%d Linears packed)", m->dir,
                      m->n_packed);
    for (int l = l0; l < l1; l++)
        if (pos > s->filled[l])
            return mq_err(MOEQ_E_ARG, "layer %d: position %lld follows a gap (the cache holds %lld)",
                          l, (long long)pos, (long long)s->filled[l]);
    if (scratch_reserve(s, T) || scores_reserve(s))
        return mq_err(MOEQ_E_NOMEM, "out of memory for the forward scratch of %lld tokens",
                      (long long)T);
    for (int l = l0; l < l1; l++) {
        moeq_status st = attention_block(m, s, l, x, T, pos, hooks);
        if (!st) st = ffn_block(m, s, l, x, T, hooks);
        if (st) return st;
        s->filled[l] = pos + T;
    }
    return MOEQ_OK;
}
