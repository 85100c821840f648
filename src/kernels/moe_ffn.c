/*
 * The quantized MoE feed-forward op (moeq_moe_ffn, semantics in include/moeq.h): argument
 * validation (the shape function, like ExecuTorch's Meta kernel for llama::quantized_moe_ffn),
 * the public descriptor's weights handed to the packer (moe_pack.c), routing (fp32 router,
 * softmax or sigmoid scores, top-k, renormalisation as in transformers' Mixtral/Qwen2-MoE/OLMoE/
 * DeepSeek-V3 and ExecuTorch's op), a counting sort of (token, slot) pairs by expert, and the work
 * items: fused gate+up GEMM with SwiGLU and re-quantization per (expert, 64 outputs), then the
 * down GEMM per (expert, 128 rows). The whole op is one job on the pool (routing, experts and the
 * final sums hand over through counters, see op_lane). Each token finally sums its slots in slot
 * order, so the result does not depend on the thread count. Also the forward of a packed dense
 * Linear on the same kernels.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/moe_ffn.h"
#include "kernels/route_inline.h"   /* the scores' order and a group's score, the GPU twin's too */
#include "kernels/vec.h"

/* ---- small helpers ------------------------------------------------------------------------- */
static void shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t o = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && o < n; i++)
        o += (size_t)snprintf(buf + o, n - o, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

static bool tref_present(const moeq_tensor_ref *r) { return r->data != NULL; }

/* Checks one tensor argument against the expected dtype and shape. */
static moeq_status check_tref(const char *op, const char *name, const moeq_tensor_ref *r,
                              moeq_dtype dt, int ndim, const int64_t *shape) {
    char want[96], got[96];
    if (!r->data) return mq_err(MOEQ_E_ARG, "%s: %s: data is NULL", op, name);
    if (r->dtype != dt)
        return mq_err(MOEQ_E_ARG, "%s: %s: dtype %s, expected %s", op, name, moeq_dtype_name(r->dtype),
                      moeq_dtype_name(dt));
    /* the shape strings are formatted only for messages: this runs on every op call */
    bool same = r->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = r->shape[i] == shape[i];
    if (!same) {
        shape_str(want, sizeof want, ndim, shape);
        if (r->ndim < 0 || r->ndim > 4)
            return mq_err(MOEQ_E_SHAPE, "%s: %s: ndim %d, expected shape %s", op, name,
                          (int)r->ndim, want);
        shape_str(got, sizeof got, r->ndim, r->shape);
        return mq_err(MOEQ_E_SHAPE, "%s: %s: shape %s, expected %s", op, name, got, want);
    }
    size_t need = moeq_dtype_size(dt);
    for (int i = 0; i < ndim; i++)
        if (!mq_mul_size(need, (size_t)shape[i], &need)) {
            shape_str(got, sizeof got, r->ndim, r->shape);
            return mq_err(MOEQ_E_SHAPE, "%s: %s: shape %s is too large", op, name, got);
        }
    if (r->nbytes < need) {
        shape_str(got, sizeof got, r->ndim, r->shape);
        return mq_err(MOEQ_E_ARG, "%s: %s: buffer of %zu bytes, shape %s %s needs %zu", op, name,
                      r->nbytes, got, moeq_dtype_name(dt), need);
    }
    return MOEQ_OK;
}

static moeq_status check_absent(const char *op, const char *name, const moeq_tensor_ref *r,
                                const char *why) {
    if (tref_present(r)) return mq_err(MOEQ_E_ARG, "%s: %s: must be absent (%s)", op, name, why);
    return MOEQ_OK;
}

/* ---- experts: validation ------------------------------------------------------------------- */
static const char *k_ex = "moe_experts";

/* One quantized weight: E matrices (E = 0: a single matrix without the leading dimension). */
static moeq_status check_qweight(const moeq_moe_experts_desc *d, const char *name,
                                 const moeq_moe_qweight *w, int64_t E, int64_t rows, int64_t cols,
                                 bool fused) {
    char nm[64];
    int64_t sh[3];
    int n = 0;
    if (E > 0) sh[n++] = E;
    sh[n] = rows;
    sh[n + 1] = cols;
    snprintf(nm, sizeof nm, "%s.codes", name);
    moeq_status st = check_tref(k_ex, nm, &w->codes, MOEQ_DT_U8, n + 2, sh);
    if (st) return st;
    sh[n + 1] = cols / d->group_size;
    snprintf(nm, sizeof nm, "%s.scales", name);
    st = check_tref(k_ex, nm, &w->scales,
                    d->scheme == MOEQ_MOE_NVFP4 ? MOEQ_DT_F8_E4M3 : MOEQ_DT_F32, n + 2, sh);
    if (st) return st;
    snprintf(nm, sizeof nm, "%s.global_scale", name);
    if (d->scheme == MOEQ_MOE_INT4) return check_absent(k_ex, nm, &w->global_scale, "INT4");
    /* NVFP4: [E] / [1], or [E, 2] / [2] with separate gate and up scales for gate_up */
    int64_t gs[2] = {E > 0 ? E : 1, 2};
    int gnd = 1;
    if (fused && w->global_scale.data && w->global_scale.ndim == (E > 0 ? 2 : 1) &&
        w->global_scale.shape[w->global_scale.ndim - 1] == 2) {
        if (E > 0) gnd = 2;
        else gs[0] = 2;
    }
    return check_tref(k_ex, nm, &w->global_scale, MOEQ_DT_F32, gnd, gs);
}

moeq_status moeq_moe_experts_check(const moeq_moe_experts_desc *d) {
    if (!d) return mq_err(MOEQ_E_ARG, "%s: descriptor is NULL", k_ex);
    if (d->scheme != MOEQ_MOE_INT4 && d->scheme != MOEQ_MOE_NVFP4)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: scheme %d (expected INT4 or NVFP4)", k_ex,
                      (int)d->scheme);
    if (d->scheme == MOEQ_MOE_NVFP4 && d->group_size != 16)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: group_size %d: NVFP4 needs 16", k_ex,
                      (int)d->group_size);
    if (d->scheme == MOEQ_MOE_INT4 && (d->group_size <= 0 || d->group_size % 32 != 0))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: group_size %d: INT4 needs a positive multiple of 32",
                      k_ex, (int)d->group_size);
    if (d->n_experts < 1) return mq_err(MOEQ_E_ARG, "%s: n_experts %d < 1", k_ex, (int)d->n_experts);
    if (d->hidden < 1) return mq_err(MOEQ_E_ARG, "%s: hidden %d < 1", k_ex, (int)d->hidden);
    if (d->ffn < 1) return mq_err(MOEQ_E_ARG, "%s: ffn %d < 1", k_ex, (int)d->ffn);
    if (d->shared_ffn < 0) return mq_err(MOEQ_E_ARG, "%s: shared_ffn %d < 0", k_ex, (int)d->shared_ffn);
    if (d->nvfp4_global_multiplier != 0 && d->nvfp4_global_multiplier != 1)
        return mq_err(MOEQ_E_ARG, "%s: nvfp4_global_multiplier %d (expected 0 or 1)", k_ex,
                      (int)d->nvfp4_global_multiplier);
    if (d->nvfp4_global_multiplier && d->scheme != MOEQ_MOE_NVFP4)
        return mq_err(MOEQ_E_ARG, "%s: nvfp4_global_multiplier is set for an INT4 layer", k_ex);
    const char *gname = d->scheme == MOEQ_MOE_NVFP4 ? "NVFP4 block" : "group_size";
    if (d->hidden % d->group_size)
        return mq_err(MOEQ_E_SHAPE, "%s: hidden %d is not a multiple of the %s %d", k_ex,
                      (int)d->hidden, gname, (int)d->group_size);
    if (d->ffn % d->group_size)
        return mq_err(MOEQ_E_SHAPE, "%s: ffn %d is not a multiple of the %s %d", k_ex,
                      (int)d->ffn, gname, (int)d->group_size);
    if (d->shared_ffn % d->group_size)
        return mq_err(MOEQ_E_SHAPE, "%s: shared_ffn %d is not a multiple of the %s %d", k_ex,
                      (int)d->shared_ffn, gname, (int)d->group_size);
    const int64_t E = d->n_experts, D = d->hidden, F = d->ffn, Fs = d->shared_ffn;
    moeq_status st = check_qweight(d, "gate_up", &d->gate_up, E, 2 * F, D, true);
    if (!st) st = check_qweight(d, "down", &d->down, E, D, F, false);
    if (st) return st;
    if (Fs > 0) {
        st = check_qweight(d, "shared_gate_up", &d->shared_gate_up, 0, 2 * Fs, D, true);
        if (!st) st = check_qweight(d, "shared_down", &d->shared_down, 0, D, Fs, false);
        return st;
    }
    const moeq_moe_qweight *sw[2] = {&d->shared_gate_up, &d->shared_down};
    const char *sn[2] = {"shared_gate_up", "shared_down"};
    for (int i = 0; i < 2; i++) {
        char nm[64];
        snprintf(nm, sizeof nm, "%s.codes", sn[i]);
        if ((st = check_absent(k_ex, nm, &sw[i]->codes, "shared_ffn is 0"))) return st;
        snprintf(nm, sizeof nm, "%s.scales", sn[i]);
        if ((st = check_absent(k_ex, nm, &sw[i]->scales, "shared_ffn is 0"))) return st;
        snprintf(nm, sizeof nm, "%s.global_scale", sn[i]);
        if ((st = check_absent(k_ex, nm, &sw[i]->global_scale, "shared_ffn is 0"))) return st;
    }
    return MOEQ_OK;
}

/* ---- experts: packing from the descriptor -------------------------------------------------- */
/* Expert e's matrix (e < 0: the shared one, without the leading dimension), from row row_off. */
static mq_moe_src src_of(const moeq_moe_experts_desc *d, const moeq_moe_qweight *w, int64_t e,
                         int64_t rows, int64_t cols, int64_t row_off, int64_t gs_index) {
    const int nvfp4 = d->scheme == MOEQ_MOE_NVFP4;
    const size_t sb = nvfp4 ? 1 : 4;
    const int64_t ng = cols / d->group_size, base = (e < 0 ? 0 : e * rows) + row_off;
    mq_moe_src s;
    s.codes = (const uint8_t *)w->codes.data + (size_t)base * (size_t)cols;
    s.scales = (const uint8_t *)w->scales.data + (size_t)base * (size_t)ng * sb;
    s.scale_stride = sb;
    s.global_scale = nvfp4 ? ((const float *)w->global_scale.data)[gs_index] : 1.0f;
    s.global_mul = d->nvfp4_global_multiplier;
    return s;
}

/* Index of the gate (h = 0) or up (h = 1) global scale of expert e in gate_up.global_scale. */
static int64_t gu_gs_index(const moeq_moe_qweight *w, int64_t e, int h) {
    const moeq_tensor_ref *g = &w->global_scale;
    const bool pairs = g->data && g->shape[g->ndim - 1] == 2 && (g->ndim == 2 || e < 0);
    return pairs ? (e < 0 ? 0 : e) * 2 + h : (e < 0 ? 0 : e);
}

moeq_status moeq_moe_experts_pack(const moeq_moe_experts_desc *d, moeq_moe_experts **out) {
    if (!out) return mq_err(MOEQ_E_ARG, "%s: out is NULL", k_ex);
    *out = NULL;
    moeq_status st = moeq_moe_experts_check(d);
    if (st) return st;
    const int64_t E = d->n_experts, D = d->hidden, F = d->ffn, Fs = d->shared_ffn;
    const int32_t n = (int32_t)E + (Fs > 0);
    mq_moe_expert_src *src = mq_alloc_zero(sizeof *src * (size_t)n, "moe expert sources");
    if (!src) return MOEQ_E_NOMEM;
    for (int32_t i = 0; i < n; i++) {
        const bool sh = i == E;
        const int64_t e = sh ? -1 : i, f = sh ? Fs : F;
        const moeq_moe_qweight *gu = sh ? &d->shared_gate_up : &d->gate_up;
        const moeq_moe_qweight *dn = sh ? &d->shared_down : &d->down;
        src[i].ffn = (int32_t)f;
        src[i].gate = src_of(d, gu, e, 2 * f, D, 0, gu_gs_index(gu, e, 0));
        src[i].up = src_of(d, gu, e, 2 * f, D, f, gu_gs_index(gu, e, 1));
        src[i].down = src_of(d, dn, e, D, f, 0, e < 0 ? 0 : e);
    }
    mq_moe_names names = {k_ex, "gate_up", "gate_up", "down", 1};
    st = mq_moe_experts_build(d->scheme == MOEQ_MOE_NVFP4, d->group_size, (int32_t)E, (int32_t)D,
                              src, Fs > 0, &names, out);
    mq_free(src);
    return st;
}

/* ---- the op: validation -------------------------------------------------------------------- */
static const char *k_op = "moe_ffn";

/* The routing arguments of a layer of E experts of width D (Fs: the shared expert's width, 0 for
 * none): router, selection bias, shared gate, top-k, scoring, renormalisation, route scale,
 * groups. Messages start with `op`. */
moeq_status mq_moe_routing_check(const char *op, const moeq_moe_ffn_args *a, int64_t E, int64_t D, int32_t Fs) {
    moeq_status st;
    if ((st = check_tref(op, "router", &a->router, MOEQ_DT_F32, 2, (int64_t[]){E, D}))) return st;
    if (tref_present(&a->router_bias) &&
        (st = check_tref(op, "router_bias", &a->router_bias, MOEQ_DT_F32, 1, (int64_t[]){E})))
        return st;
    if (tref_present(&a->shared_gate)) {
        if (Fs == 0)
            return mq_err(MOEQ_E_ARG, "%s: shared_gate given but the experts have no shared expert",
                          op);
        if (a->shared_gate.ndim == 2)
            st = check_tref(op, "shared_gate", &a->shared_gate, MOEQ_DT_F32, 2, (int64_t[]){1, D});
        else
            st = check_tref(op, "shared_gate", &a->shared_gate, MOEQ_DT_F32, 1, (int64_t[]){D});
        if (st) return st;
    }
    if (a->top_k < 1 || a->top_k > E)
        return mq_err(MOEQ_E_ARG, "%s: top_k %d: must be in 1..%lld (n_experts)", op,
                      (int)a->top_k, (long long)E);
    if (a->scoring != MOEQ_MOE_SOFTMAX && a->scoring != MOEQ_MOE_SIGMOID)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: scoring %d (expected softmax or sigmoid)", op,
                      (int)a->scoring);
    if (a->renormalize != 0 && a->renormalize != 1)
        return mq_err(MOEQ_E_ARG, "%s: renormalize %d (expected 0 or 1)", op, (int)a->renormalize);
    if (!isfinite(a->route_scale))
        return mq_err(MOEQ_E_ARG, "%s: route_scale %g is not finite", op, (double)a->route_scale);
    if (a->n_group < 0 || (a->n_group > 1 && (E % a->n_group != 0 || E / a->n_group < 2)))
        return mq_err(MOEQ_E_ARG, "%s: n_group %d: must be 0, 1 or divide n_experts %lld into "
                      "groups of at least 2", op, (int)a->n_group, (long long)E);
    if (a->n_group > 1 && (a->topk_group < 1 || a->topk_group > a->n_group))
        return mq_err(MOEQ_E_ARG, "%s: topk_group %d: must be in 1..n_group %d", op,
                      (int)a->topk_group, (int)a->n_group);
    if (a->n_group > 1 && a->top_k > (int64_t)a->topk_group * (E / a->n_group))
        return mq_err(MOEQ_E_ARG, "%s: top_k %d exceeds the %lld experts of topk_group %d groups",
                      op, (int)a->top_k, (long long)(a->topk_group * (E / a->n_group)),
                      (int)a->topk_group);
    return MOEQ_OK;
}

/* x of an op: F32 [T, D], T may be 0 (then data may be NULL); T into *T. */
moeq_status mq_moe_x_check(const char *op, const moeq_tensor_ref *x, int64_t D, int64_t *T) {
    if (x->ndim != 2)
        return mq_err(MOEQ_E_SHAPE, "%s: x: ndim %d, expected 2 ([tokens, %lld])", op,
                      (int)x->ndim, (long long)D);
    *T = x->shape[0];
    if (*T < 0 || *T > INT32_MAX)
        return mq_err(MOEQ_E_SHAPE, "%s: x: %lld tokens", op, (long long)*T);
    if (*T > 0) return check_tref(op, "x", x, MOEQ_DT_F32, 2, (int64_t[]){*T, D});
    if (x->dtype != MOEQ_DT_F32 || x->shape[1] != D)
        return mq_err(MOEQ_E_SHAPE, "%s: x: empty input must be F32 [0, %lld]", op, (long long)D);
    return MOEQ_OK;
}

moeq_status moeq_moe_ffn_check(const moeq_moe_ffn_args *a, int64_t out_shape[2]) {
    if (!a) return mq_err(MOEQ_E_ARG, "%s: args is NULL", k_op);
    if (!out_shape) return mq_err(MOEQ_E_ARG, "%s: out_shape is NULL", k_op);
    const moeq_moe_experts *w = a->experts;
    if (!w) return mq_err(MOEQ_E_ARG, "%s: experts is NULL", k_op);
    const int64_t E = w->E, D = w->D;
    int64_t T;
    moeq_status st;
    if ((st = mq_moe_x_check(k_op, &a->x, D, &T))) return st;
    if ((st = mq_moe_routing_check(k_op, a, E, D, w->Fs))) return st;
    out_shape[0] = T;
    out_shape[1] = D;
    return MOEQ_OK;
}

/* ---- the op: compute ----------------------------------------------------------------------- */
enum {
    PAIRS_A = 8,   /* gate_up tile pairs per task: 64 outputs of gate and of up */
    PAIRS_B = 8,   /* down tile pairs per task: 128 output rows */
    TOK_CHUNK = 8, /* tokens per task of the per-token phases */
};

typedef struct {
    const moeq_moe_experts *w;
    const mq_moe_kernels *K;
    const float *x, *router, *bias, *sgate;
    int64_t T, P;
    int32_t k;
    moeq_moe_scoring scoring;
    int32_t renorm;
    float route_scale;
    int32_t n_group, topk_group;
    float *logits;        /* [T, E] */
    float *gsh;           /* [T] shared expert gate logits, then weights */
    int32_t *sel;         /* [T, k] */
    float *wt;            /* [T, k] */
    int64_t *off;         /* [n_mats + 1] first permuted row of each matrix */
    int32_t *perm_tok;    /* [P] */
    int64_t *pos;         /* [T, k] permuted row of (token, slot) */
    int64_t *cursor;      /* [n_mats] counting-sort cursors */
    int32_t *task_mat, *task_chunk;   /* work items: gate_up ones first, then down ones */
    int64_t n_a, n_items;
    _Atomic int32_t *pending;         /* [n_mats] gate_up items of each matrix not done yet */
    mq_qact xq, mq;       /* x [T, D]; mid [P, Fmax] */
    float *y;             /* [P, D] */
    float *scratch;       /* [threads][scratch_stride] */
    size_t scratch_stride;
    float *out;
} run_ctx;

static float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }


void mq_moe_select(const float *p, const float *bias, int64_t E, int32_t k, int32_t n_group,
                   int32_t topk_group, uint8_t *taken, int32_t *sel) {
    /* taken: bit 0 = not selectable (chosen already, or outside the eligible groups) */
    memset(taken, 0, (size_t)E);
    if (n_group > 1) {
        const int64_t EG = E / n_group;
        /* the groups' scores; bit 1 of a group's first expert marks it chosen */
        for (int32_t j = 0; j < topk_group; j++) {
            int64_t best = -1;
            float bs = 0.0f;
            for (int64_t g = 0; g < n_group; g++) {
                if (taken[g * EG] & 2) continue;
                const float gs = mq_route_group_score(p, bias, g * EG, (g + 1) * EG);
                if (best < 0 || mq_route_better(gs, bs)) {
                    best = g;
                    bs = gs;
                }
            }
            taken[best * EG] |= 2;
        }
        for (int64_t g = 0; g < n_group; g++) {
            uint8_t off = (taken[g * EG] & 2) ? 0 : 1;
            for (int64_t e = g * EG; e < (g + 1) * EG; e++) taken[e] = off;
        }
    }
    for (int32_t j = 0; j < k; j++) {
        int64_t best = -1;
        float bs = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            if (taken[e]) continue;
            float s = bias ? p[e] + bias[e] : p[e];
            if (best < 0 || mq_route_better(s, bs)) {
                best = e;
                bs = s;
            }
        }
        taken[best] = 1;
        sel[j] = (int32_t)best;
    }
}

static void route_token(const run_ctx *c, int64_t t, float *p, uint8_t *taken) {
    const int64_t E = c->w->E;
    const float *lg = c->logits + t * E;
    if (c->scoring == MOEQ_MOE_SOFTMAX) {
        float mx = lg[0], sum = 0.0f;
        for (int64_t e = 1; e < E; e++)
            if (lg[e] > mx) mx = lg[e];
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(lg[e] - mx);
        for (int64_t e = 0; e < E; e++) p[e] = p[e] / sum;
    } else {
        for (int64_t e = 0; e < E; e++) p[e] = sigmoidf(lg[e]);
    }
    int32_t *sel = c->sel + t * c->k;
    float *wt = c->wt + t * c->k, sum = 0.0f;
    mq_moe_select(p, c->bias, E, c->k, c->n_group, c->topk_group, taken, sel);
    for (int32_t j = 0; j < c->k; j++) {
        wt[j] = p[sel[j]];
        sum += wt[j];
    }
    for (int32_t j = 0; j < c->k; j++) {
        if (c->renorm && sum != 0.0f) wt[j] = wt[j] / sum;
        wt[j] *= c->route_scale;
    }
    if (c->sgate) c->gsh[t] = sigmoidf(c->gsh[t]);
}

/* Where work item j starts reading (its first tile pair), or NULL past the last item. */
static const uint8_t *item_start(const run_ctx *c, int64_t j) {
    if (j >= c->n_items) return NULL;
    const mq_pexpert *ex = &c->w->ex[c->task_mat[j]];
    const mq_pmat *W = j < c->n_a ? &ex->gate_up : &ex->down;
    const int64_t p0 = (int64_t)c->task_chunk[j] * (j < c->n_a ? PAIRS_A : PAIRS_B);
    return W->data + (size_t)(2 * p0) * W->rb_bytes;
}

static void phase_a_item(run_ctx *c, int64_t task, int thread) {
    const int32_t e = c->task_mat[task];
    const mq_pexpert *ex = &c->w->ex[e];
    const int64_t p0 = (int64_t)c->task_chunk[task] * PAIRS_A;
    const int64_t np = ex->ffn / 8, p1 = p0 + PAIRS_A < np ? p0 + PAIRS_A : np;
    const int64_t r0 = c->off[e], m = c->off[e + 1] - r0, ldo = 8 * (p1 - p0);
    float *s = c->scratch + (size_t)thread * c->scratch_stride;
    c->K->gemm(&ex->gate_up, p0, p1, &c->xq, c->perm_tok + r0, 0, m, s, ldo, 1,
               item_start(c, task + 1));
    for (int64_t i = 0; i < m; i++) c->K->quant_act(s + i * ldo, ldo, &c->mq, r0 + i, 8 * p0);
}

static void phase_b_item(run_ctx *c, int64_t task) {
    const int32_t e = c->task_mat[task];
    const mq_pexpert *ex = &c->w->ex[e];
    const int64_t D = c->w->D, p0 = (int64_t)c->task_chunk[task] * PAIRS_B;
    const int64_t np = D / 16, p1 = p0 + PAIRS_B < np ? p0 + PAIRS_B : np;
    const int64_t r0 = c->off[e], m = c->off[e + 1] - r0;
    c->K->gemm(&ex->down, p0, p1, &c->mq, NULL, r0, m, c->y + r0 * D, D, 0, item_start(c, task + 1));
}

static int64_t seg_take(_Atomic uint64_t *s, int back) {
    uint64_t v = atomic_load_explicit(s, memory_order_relaxed);
    for (;;) {
        uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
        if (lo >= hi) return -1;
        uint64_t nv = back ? (uint64_t)lo | (uint64_t)(hi - 1) << 32 : (uint64_t)(lo + 1) | (uint64_t)hi << 32;
        if (atomic_compare_exchange_weak(s, &v, nv)) return back ? (int64_t)hi - 1 : (int64_t)lo;
    }
}

enum {
    ROUTE_TOK = 64,   /* router logits piece: ROUTE_TOK tokens x ROUTE_EXP experts */
    ROUTE_EXP = 32,
    COMB_D = 256,     /* combine piece: TOK_CHUNK tokens x COMB_D columns */
};

typedef struct {
    _Atomic int64_t next, done;
    int64_t n;
} mq_phase;

typedef struct {
    run_ctx c;
    mq_phase route, tok, comb;
    _Atomic int32_t planned;
    _Atomic int64_t items_done;
    _Atomic uint64_t *seg;    /* [2][lanes] item ranges lo | hi << 32 of the gate_up and down parts */
    int64_t lanes;
    float *rp;                /* [threads][E] routing probabilities */
    uint8_t *rtaken;          /* [threads][E] */
    int64_t n_rte, n_cd;      /* router expert tiles; combine column pieces */
    int64_t macs_threshold;
} op_ctx;

static int64_t phase_claim(mq_phase *p) {
    if (atomic_load_explicit(&p->next, memory_order_relaxed) >= p->n) return -1;
    int64_t i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
    return i < p->n ? i : -1;
}

/* Waits until *v >= target. Every piece counted by *v was claimed by a running participant, so
 * the wait always ends, whatever the number of threads. */
static void wait_count(_Atomic int64_t *v, int64_t target) {
    for (int spins = 0; atomic_load_explicit(v, memory_order_acquire) < target; spins++)
        if (spins > 64) sched_yield();
}

static void route_piece(op_ctx *o, int64_t i) {
    run_ctx *c = &o->c;
    const int64_t E = c->w->E, D = c->w->D;
    const int64_t t0 = (i / o->n_rte) * ROUTE_TOK, e0 = (i % o->n_rte) * ROUTE_EXP;
    const int64_t m = c->T - t0 < ROUTE_TOK ? c->T - t0 : ROUTE_TOK;
    const int64_t n = E - e0 < ROUTE_EXP ? E - e0 : ROUTE_EXP;
    mq_gemm_nt(m, n, D, 1.0f, c->x + t0 * D, D, c->router + e0 * D, D, 0.0f, c->logits + t0 * E + e0, E);
}

static void token_piece(op_ctx *o, int64_t i, int thread) {
    run_ctx *c = &o->c;
    const int64_t E = c->w->E, D = c->w->D, t0 = i * TOK_CHUNK;
    const int64_t m = c->T - t0 < TOK_CHUNK ? c->T - t0 : TOK_CHUNK;
    if (c->sgate) mq_gemm_nt(m, 1, D, 1.0f, c->x + t0 * D, D, c->sgate, D, 0.0f, c->gsh + t0, 1);
    for (int64_t t = t0; t < t0 + m; t++) {
        route_token(c, t, o->rp + (size_t)thread * E, o->rtaken + (size_t)thread * E);
        c->K->quant_act(c->x + t * D, D, &c->xq, t, 0);
    }
}

/* Work of an item for the lane split (multiply-adds). */
static double item_cost(const run_ctx *c, int64_t i) {
    const int32_t e = c->task_mat[i];
    const double m = (double)(c->off[e + 1] - c->off[e]);
    return m * (i < c->n_a ? (double)PAIRS_A * 16.0 * c->w->D : (double)PAIRS_B * 16.0 * c->w->ex[e].ffn);
}

/* Cuts items [a, b) into lanes contiguous ranges of about equal work. */
static void split_lanes(op_ctx *o, int part, int64_t a, int64_t b) {
    run_ctx *c = &o->c;
    double total = 0;
    for (int64_t i = a; i < b; i++) total += item_cost(c, i);
    double acc = 0;
    int64_t lo = a, i = a;
    for (int64_t l = 0; l < o->lanes; l++) {
        const double goal = total * (double)(l + 1) / (double)o->lanes;
        while (i < b && (l == o->lanes - 1 || acc + 0.5 * item_cost(c, i) < goal)) acc += item_cost(c, i++);
        atomic_store_explicit(&o->seg[part * o->lanes + l], (uint64_t)lo | (uint64_t)i << 32,
                              memory_order_relaxed);
        lo = i;
    }
}

/* Serial step between routing and the experts: counting sort of (token, slot) by matrix, the work
 * items (gate_up + SwiGLU + mid quantization per (matrix, 64 outputs), then down per (matrix,
 * 128 rows), matrices in index order) and their split into lanes. */
static void plan(op_ctx *o) {
    run_ctx *c = &o->c;
    const moeq_moe_experts *w = c->w;
    const int64_t T = c->T, E = w->E, D = w->D, nm = w->n_mats;
    const int32_t k = c->k;
    int64_t *cnt = c->off;
    memset(cnt, 0, sizeof(int64_t) * (size_t)(nm + 1));
    for (int64_t i = 0; i < T * k; i++) cnt[c->sel[i] + 1]++;
    if (w->Fs > 0) cnt[E + 1] = T;
    for (int64_t e = 0; e < nm; e++) cnt[e + 1] += cnt[e];
    int64_t *cur = c->cursor;
    memcpy(cur, c->off, sizeof(int64_t) * (size_t)nm);
    for (int64_t t = 0; t < T; t++)
        for (int32_t j = 0; j < k; j++) {
            int64_t r = cur[c->sel[t * k + j]]++;
            c->perm_tok[r] = (int32_t)t;
            c->pos[t * k + j] = r;
        }
    if (w->Fs > 0)
        for (int64_t t = 0; t < T; t++) c->perm_tok[c->off[E] + t] = (int32_t)t;
    int64_t n = 0;
    for (int64_t e = 0; e < nm; e++) {
        atomic_store_explicit(&c->pending[e], 0, memory_order_relaxed);
        if (c->off[e + 1] == c->off[e]) continue;
        int64_t chunks = (w->ex[e].ffn / 8 + PAIRS_A - 1) / PAIRS_A;
        atomic_store_explicit(&c->pending[e], (int32_t)chunks, memory_order_relaxed);
        for (int64_t i = 0; i < chunks; i++, n++) {
            c->task_mat[n] = (int32_t)e;
            c->task_chunk[n] = (int32_t)i;
        }
    }
    c->n_a = n;
    for (int64_t e = 0; e < nm; e++) {
        if (c->off[e + 1] == c->off[e]) continue;
        int64_t chunks = (D / 16 + PAIRS_B - 1) / PAIRS_B;
        for (int64_t i = 0; i < chunks; i++, n++) {
            c->task_mat[n] = (int32_t)e;
            c->task_chunk[n] = (int32_t)i;
        }
    }
    c->n_items = n;
    split_lanes(o, 0, 0, c->n_a);
    split_lanes(o, 1, c->n_a, c->n_items);
}

static void run_item(op_ctx *o, int64_t i, int thread) {
    run_ctx *c = &o->c;
    const int32_t e = c->task_mat[i];
    if (i < c->n_a) {
        phase_a_item(c, i, thread);
        atomic_fetch_sub_explicit(&c->pending[e], 1, memory_order_release);
    } else {
        for (int spins = 0; atomic_load_explicit(&c->pending[e], memory_order_acquire) > 0; spins++)
            if (spins > 64) sched_yield();
        phase_b_item(c, i);
    }
    atomic_fetch_add_explicit(&o->items_done, 1, memory_order_release);
}

static void combine_piece(op_ctx *o, int64_t i) {
    run_ctx *c = &o->c;
    const int64_t D = c->w->D, E = c->w->E, k = c->k;
    const int64_t d0 = (i % o->n_cd) * COMB_D, d1 = d0 + COMB_D < D ? d0 + COMB_D : D;
    const int64_t t0 = (i / o->n_cd) * TOK_CHUNK;
    for (int64_t t = t0; t < c->T && t < t0 + TOK_CHUNK; t++) {
        float *out = c->out + t * D;
        const float *y0 = c->y + c->pos[t * k] * D;
        const float w0 = c->wt[t * k];
        for (int64_t d = d0; d < d1; d++) out[d] = w0 * y0[d];
        for (int64_t j = 1; j < k; j++) {
            const float *yj = c->y + c->pos[t * k + j] * D;
            const float wj = c->wt[t * k + j];
            for (int64_t d = d0; d < d1; d++) out[d] = out[d] + wj * yj[d];
        }
        if (c->w->Fs > 0) {
            const float *ys = c->y + (c->off[E] + t) * D;
            const float g = c->sgate ? c->gsh[t] : 1.0f;
            for (int64_t d = d0; d < d1; d++) out[d] = out[d] + g * ys[d];
        }
    }
}

/* The whole op as one pool job, one task per lane: routing logits, per-token routing and input
 * quantization, the plan (by whichever participant finishes the last token piece), the experts,
 * the weighted sums. Phases hand over through counters of finished pieces; a participant waits
 * only for pieces another one has claimed and is running, so a slow or missing thread never
 * blocks the others. Each lane drains its own contiguous range of work items front to back, then
 * takes items from the back of the other lanes' ranges: at decode each thread streams long runs
 * of consecutive expert bytes (few hardware-prefetch restarts) and no thread idles at the end.
 * Which participant runs a piece never changes its result. */
static void op_lane(void *ctx, int64_t lane, int thread) {
    op_ctx *o = ctx;
    run_ctx *c = &o->c;
    int64_t i;
    while ((i = phase_claim(&o->route)) >= 0) {
        route_piece(o, i);
        atomic_fetch_add_explicit(&o->route.done, 1, memory_order_release);
    }
    wait_count(&o->route.done, o->route.n);
    while ((i = phase_claim(&o->tok)) >= 0) {
        token_piece(o, i, thread);
        if (atomic_fetch_add_explicit(&o->tok.done, 1, memory_order_acq_rel) + 1 == o->tok.n) {
            plan(o);
            atomic_store_explicit(&o->planned, 1, memory_order_release);
        }
    }
    for (int spins = 0; !atomic_load_explicit(&o->planned, memory_order_acquire); spins++)
        if (spins > 64) sched_yield();
    for (int part = 0; part < 2; part++) {
        while ((i = seg_take(&o->seg[part * o->lanes + lane], 0)) >= 0) run_item(o, i, thread);
        for (int64_t l = 1; l < o->lanes; l++)
            while ((i = seg_take(&o->seg[part * o->lanes + (lane + l) % o->lanes], 1)) >= 0)
                run_item(o, i, thread);
    }
    wait_count(&o->items_done, c->n_items);
    while ((i = phase_claim(&o->comb)) >= 0) combine_piece(o, i);
}

/* One cached workspace for the op's scratch: consecutive calls (layer after layer) reuse it
 * instead of mapping and faulting in fresh pages each time (tens of MB for a long prefill). A
 * concurrent call that finds it busy allocates its own. */
static pthread_mutex_t g_ws_mu = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *g_ws;
static size_t g_ws_size;
static bool g_ws_busy;

static uint8_t *ws_acquire(size_t n, bool *cached) {
    pthread_mutex_lock(&g_ws_mu);
    if (!g_ws_busy) {
        if (g_ws_size < n) {
            mq_free(g_ws);
            g_ws = mq_alloc(n, "moe_ffn workspace");
            g_ws_size = g_ws ? n : 0;
        }
        if (g_ws) {
            g_ws_busy = true;
            pthread_mutex_unlock(&g_ws_mu);
            *cached = true;
            return g_ws;
        }
    }
    pthread_mutex_unlock(&g_ws_mu);
    *cached = false;
    return mq_alloc(n, "moe_ffn workspace");
}

static void ws_release(uint8_t *p, bool cached) {
    if (!cached) {
        mq_free(p);
        return;
    }
    pthread_mutex_lock(&g_ws_mu);
    g_ws_busy = false;
    pthread_mutex_unlock(&g_ws_mu);
}

void mq_moe_workspace_free(void) {
    pthread_mutex_lock(&g_ws_mu);
    if (!g_ws_busy) {
        mq_free(g_ws);
        g_ws = NULL;
        g_ws_size = 0;
    }
    pthread_mutex_unlock(&g_ws_mu);
}

/* Lays out n buffers in the workspace (64-byte aligned pieces). */
static uint8_t *alloc_pieces(size_t n, const size_t *sizes, void **ptrs, bool *cached) {
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        size_t s = (sizes[i] + 63) & ~(size_t)63;
        if (s < sizes[i] || !mq_add_size(total, s, &total)) {
            mq_err(MOEQ_E_NOMEM, "%s: workspace size overflows", k_op);
            return NULL;
        }
    }
    uint8_t *base = ws_acquire(total ? total : 64, cached);
    if (!base) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        ptrs[i] = base + o;
        o += (sizes[i] + 63) & ~(size_t)63;
    }
    return base;
}

static moeq_status moe_run(const moeq_moe_experts *w, const float *x, int64_t T, const float *router,
                            const float *bias, const float *sgate, int32_t k,
                            moeq_moe_scoring scoring, int32_t renorm, float route_scale,
                            int32_t n_group, int32_t topk_group, float *out) {
    if (T == 0) return MOEQ_OK;
    const int64_t E = w->E, D = w->D, nm = w->n_mats;
    const int nvfp4 = w->scheme == MOEQ_MOE_NVFP4;
    const int32_t B = nvfp4 ? 16 : 32;
    const int64_t Fmax = w->Fs > w->F ? w->Fs : w->F;
    int64_t P;
    if (!mq_mul_i64(T, k + (w->Fs > 0), &P)) return mq_err(MOEQ_E_NOMEM, "%s: too many tokens", k_op);
    const int threads = mq_pool_size();
    int64_t max_tasks = 0;
    for (int64_t e = 0; e < nm; e++) {
        int64_t a = (w->ex[e].ffn / 8 + PAIRS_A - 1) / PAIRS_A, b = (D / 16 + PAIRS_B - 1) / PAIRS_B;
        max_tasks += a + b;
    }
    op_ctx o;
    memset(&o, 0, sizeof o);
    run_ctx *c = &o.c;
    *c = (run_ctx){.w = w, .K = mq_moe_kernels_active(), .x = x, .router = router, .bias = bias,
                   .sgate = sgate, .T = T, .P = P, .k = k, .scoring = scoring, .renorm = renorm,
                   .route_scale = route_scale, .n_group = n_group, .topk_group = topk_group,
                   .out = out};
    c->scratch_stride = (size_t)T * 8 * PAIRS_A;
    /* below ~1M multiply-adds waking the other threads costs more than it saves */
    const double macs = (double)T * (double)D *
                        (3.0 * (double)k * (double)w->F + 3.0 * (double)w->Fs);
    o.lanes = macs < 1e6 ? 1 : threads;
    size_t big;
    if (!mq_mul_size((size_t)P, (size_t)(D > Fmax ? D : Fmax) * 4, &big) ||
        !mq_mul_size(c->scratch_stride * 4, (size_t)threads, &big) ||
        !mq_mul_size((size_t)T, (size_t)E * 4, &big))
        return mq_err(MOEQ_E_NOMEM, "%s: %lld tokens need too much memory", k_op, (long long)T);
    enum { NP = 19 };
    void *ptr[NP];
    const size_t sizes[NP] = {
        (size_t)T * E * 4,                   /* logits */
        (size_t)T * 4,                       /* gsh */
        (size_t)T * k * 4,                   /* sel */
        (size_t)T * k * 4,                   /* wt */
        (size_t)(nm + 1) * 8,                /* off */
        (size_t)P * 4,                       /* perm_tok */
        (size_t)T * k * 8,                   /* pos */
        (size_t)max_tasks * 4,               /* task_mat */
        (size_t)max_tasks * 4,               /* task_chunk */
        (size_t)T * D * 2,                   /* xq.q, xq.q2 */
        (size_t)T * (D / B) * 8,             /* xq.scale + corr */
        (size_t)P * Fmax * 2,                /* mq.q, mq.q2 */
        (size_t)P * (Fmax / B) * 8,          /* mq.scale + corr */
        (size_t)P * D * 4,                   /* y */
        c->scratch_stride * 4 * (size_t)threads,
        (size_t)E * 5 * (size_t)threads,     /* routing scratch: probabilities + taken flags */
        (size_t)nm * 8,                      /* counting-sort cursors */
        (size_t)nm * sizeof(_Atomic int32_t),   /* pending */
        (size_t)o.lanes * 2 * sizeof(_Atomic uint64_t),   /* lane ranges */
    };
    bool cached;
    uint8_t *base = alloc_pieces(NP, sizes, ptr, &cached);
    if (!base) return MOEQ_E_NOMEM;
    c->logits = ptr[0];
    c->gsh = ptr[1];
    c->sel = ptr[2];
    c->wt = ptr[3];
    c->off = ptr[4];
    c->perm_tok = ptr[5];
    c->pos = ptr[6];
    c->task_mat = ptr[7];
    c->task_chunk = ptr[8];
    c->xq = (mq_qact){ptr[9], (int8_t *)ptr[9] + T * D, ptr[10], (int32_t *)ptr[10] + T * (D / B), D, B, nvfp4 ? 12 : 8};
    c->mq = (mq_qact){ptr[11], (int8_t *)ptr[11] + P * Fmax, ptr[12], (int32_t *)ptr[12] + P * (Fmax / B),
                      Fmax, B, nvfp4 ? 12 : 8};
    c->y = ptr[13];
    c->scratch = ptr[14];
    o.rp = ptr[15];
    o.rtaken = (uint8_t *)(o.rp + (size_t)E * threads);
    c->cursor = ptr[16];
    c->pending = ptr[17];
    o.seg = ptr[18];
    o.n_rte = (E + ROUTE_EXP - 1) / ROUTE_EXP;
    o.route.n = (T + ROUTE_TOK - 1) / ROUTE_TOK * o.n_rte;
    o.tok.n = (T + TOK_CHUNK - 1) / TOK_CHUNK;
    o.n_cd = (D + COMB_D - 1) / COMB_D;
    o.comb.n = o.tok.n * o.n_cd;
    mq_parallel_for(o.lanes, op_lane, &o);
    ws_release(base, cached);
    return MOEQ_OK;
}

moeq_status moeq_moe_ffn(const moeq_moe_ffn_args *a, float *out, size_t out_capacity) {
    int64_t shape[2];
    moeq_status st = moeq_moe_ffn_check(a, shape);
    if (st) return st;
    size_t need = (size_t)shape[0] * (size_t)shape[1];
    if (shape[0] > 0 && !out) return mq_err(MOEQ_E_ARG, "%s: out is NULL", k_op);
    if (out_capacity < need)
        return mq_err(MOEQ_E_ARG, "%s: out holds %zu floats, [%lld, %lld] needs %zu", k_op,
                      out_capacity, (long long)shape[0], (long long)shape[1], need);
    const float *sg = a->shared_gate.data;
    return moe_run(a->experts, a->x.data, shape[0], a->router.data, a->router_bias.data, sg,
                   a->top_k, a->scoring, a->renormalize, a->route_scale, a->n_group,
                   a->topk_group, out);
}

/* ---- runtime entry points ------------------------------------------------------------------ */
moeq_status mq_moe_layer_forward(const mq_moe_layer *L, const float *x, int64_t T, float *out) {
    if (!L || !L->experts || !L->router || (T > 0 && (!x || !out)))
        return mq_err(MOEQ_E_ARG, "%s: layer, router, x or out is NULL", k_op);
    const moeq_moe_experts *w = L->experts;
    size_t xb = (size_t)T * (size_t)w->D * 4;
    moeq_moe_ffn_args a = {
        .x = {x, MOEQ_DT_F32, 2, {T, w->D}, xb},
        .router = {L->router, MOEQ_DT_F32, 2, {w->E, w->D}, (size_t)w->E * (size_t)w->D * 4},
        .router_bias = {L->router_bias, MOEQ_DT_F32, 1, {w->E}, (size_t)w->E * 4},
        .shared_gate = {L->shared_gate, MOEQ_DT_F32, 1, {w->D}, (size_t)w->D * 4},
        .experts = w, .top_k = L->top_k, .scoring = L->scoring, .renormalize = L->renormalize,
        .route_scale = L->route_scale, .n_group = L->n_group, .topk_group = L->topk_group};
    return moeq_moe_ffn(&a, out, xb / 4);
}

/* ---- packed dense Linear ----------------------------------------------------------------------- */
/* Up to MQ_LIN_MAX Linears of one input width and scheme run on one quantization of x and one
 * pool loop (the q, k and v of a layer: at decode one wake-up of the pool instead of three). Each
 * Linear's results are those of its own call: the same quantized rows, the same tasks. */
typedef struct {
    const struct mq_packed_weight *w[MQ_LIN_MAX];
    float *y[MQ_LIN_MAX];            /* each Linear's output, [T, ldy[i]] */
    int64_t ldy[MQ_LIN_MAX], n_chunks[MQ_LIN_MAX], first[MQ_LIN_MAX + 1];   /* tasks per Linear */
    int n;
    int64_t in, n_tok;               /* input width; token tiles */
    const mq_moe_kernels *K;
    const float *x;
    int64_t T;
    mq_qact A;
    float *bsum;   /* some w->off: [T, in / 32] sums of x's blocks of 32 */
} lin_ctx;

enum { LIN_TOKENS = 64 };

static void lin_quant_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    lin_ctx *c = ctx;
    const int64_t G = c->in / 32;
    for (int64_t t = task * TOK_CHUNK; t < c->T && t < (task + 1) * TOK_CHUNK; t++) {
        c->K->quant_act(c->x + t * c->in, c->in, &c->A, t, 0);
        if (!c->bsum) continue;
        for (int64_t g = 0; g < G; g++) {   /* in column order: the same bits on every split */
            const float *xb = c->x + t * c->in + 32 * g;
            float sum = 0.0f;
            for (int i = 0; i < 32; i++) sum += xb[i];
            c->bsum[t * G + g] = sum;
        }
    }
}

static void lin_gemm_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    lin_ctx *c = ctx;
    int k = 0;
    while (task >= c->first[k + 1]) k++;
    task -= c->first[k];
    const struct mq_packed_weight *w = c->w[k];
    const int64_t np = w->W.rows / 16, p0 = (task % c->n_chunks[k]) * PAIRS_B;
    const int64_t p1 = p0 + PAIRS_B < np ? p0 + PAIRS_B : np;
    const int64_t t0 = (task / c->n_chunks[k]) * LIN_TOKENS;
    const int64_t m = c->T - t0 < LIN_TOKENS ? c->T - t0 : LIN_TOKENS;
    float *y = c->y[k];
    const int64_t ldy = c->ldy[k];
    c->K->gemm(&w->W, p0, p1, &c->A, NULL, t0, m, y + t0 * ldy, ldy, 0, NULL);
    if (!w->off) return;
    const mq_vec_kernels *vk = mq_vec();
    const int64_t G = c->in / 32, r1 = 16 * p1 < w->out ? 16 * p1 : w->out;
    for (int64_t t = t0; t < t0 + m; t++)
        for (int64_t r = 16 * p0; r < r1; r++)
            y[t * ldy + r] += vk->dot(w->off + r * G, c->bsum + t * G, G);
}

moeq_status mq_packed_weights_forward(const struct mq_packed_weight *const *w, int n,
                                      const float *x, int64_t T, float *const *y) {
    if (n < 1 || n > MQ_LIN_MAX || !w || (T > 0 && (!x || !y)))
        return mq_err(MOEQ_E_ARG, "packed linear: NULL argument or %d Linears", n);
    for (int k = 0; k < n; k++)
        if (!w[k] || (T > 0 && !y[k])) return mq_err(MOEQ_E_ARG, "packed linear: NULL argument");
    for (int k = 1; k < n; k++)
        if (w[k]->in != w[0]->in || w[k]->W.nvfp4 != w[0]->W.nvfp4)
            return mq_err(MOEQ_E_ARG, "packed linear: Linears of widths %d and %d or other schemes "
                          "share an input", (int)w[0]->in, (int)w[k]->in);
    if (T <= 0) return MOEQ_OK;
    const int nvfp4 = w[0]->W.nvfp4;
    const int32_t B = nvfp4 ? 16 : 32;
    const int64_t in = w[0]->in;
    bool any_off = false;
    size_t qb, ob[MQ_LIN_MAX] = {0};
    for (int k = 0; k < n; k++) {
        any_off = any_off || w[k]->off;
        if (w[k]->W.rows != w[k]->out && !mq_mul_size((size_t)T, (size_t)w[k]->W.rows * 4, &ob[k]))
            return mq_err(MOEQ_E_NOMEM, "packed linear: %lld tokens need too much memory", (long long)T);
    }
    if (!mq_mul_size((size_t)T, (size_t)in * 2 + (size_t)(in / B) * 8, &qb))
        return mq_err(MOEQ_E_NOMEM, "packed linear: %lld tokens need too much memory", (long long)T);
    enum { NP = 4 + MQ_LIN_MAX };
    void *ptr[NP];
    size_t sizes[NP] = {(size_t)T * (size_t)in * 2, (size_t)T * (size_t)(in / B) * 4,
                        (size_t)T * (size_t)(in / B) * 4, any_off ? (size_t)T * (size_t)(in / 32) * 4 : 0};
    for (int k = 0; k < MQ_LIN_MAX; k++) sizes[4 + k] = ob[k];
    bool cached;
    uint8_t *base = alloc_pieces(NP, sizes, ptr, &cached);
    if (!base) return MOEQ_E_NOMEM;
    lin_ctx c = {.n = n, .in = in, .n_tok = (T + LIN_TOKENS - 1) / LIN_TOKENS,
                 .K = mq_moe_kernels_active(), .x = x, .T = T,
                 .A = {ptr[0], (int8_t *)ptr[0] + T * in, ptr[1], ptr[2], in, B, nvfp4 ? 12 : 8},
                 .bsum = any_off ? ptr[3] : NULL};
    double work = 0;
    for (int k = 0; k < n; k++) {
        const bool direct = w[k]->W.rows == w[k]->out;
        c.w[k] = w[k];
        c.y[k] = direct ? y[k] : ptr[4 + k];
        c.ldy[k] = direct ? w[k]->out : w[k]->W.rows;
        c.n_chunks[k] = (w[k]->W.rows / 16 + PAIRS_B - 1) / PAIRS_B;
        c.first[k + 1] = c.first[k] + c.n_chunks[k] * c.n_tok;
        work += (double)T * (double)w[k]->W.rows * (double)in;
    }
    const int64_t nq = (T + TOK_CHUNK - 1) / TOK_CHUNK, ng = c.first[n];
    if (work < 1e6) {   /* too small to wake the pool */
        for (int64_t i = 0; i < nq; i++) lin_quant_task(&c, i, 0);
        for (int64_t i = 0; i < ng; i++) lin_gemm_task(&c, i, 0);
    } else {
        mq_parallel_for(nq, lin_quant_task, &c);
        mq_parallel_for(ng, lin_gemm_task, &c);
    }
    for (int k = 0; k < n; k++)
        if (c.y[k] != y[k])
            for (int64_t t = 0; t < T; t++)
                memcpy(y[k] + t * w[k]->out, c.y[k] + t * c.ldy[k], sizeof(float) * (size_t)w[k]->out);
    ws_release(base, cached);
    return MOEQ_OK;
}

moeq_status mq_packed_weight_forward(const struct mq_packed_weight *w, const float *x, int64_t T,
                                     float *y) {
    return mq_packed_weights_forward(&w, 1, x, T, &y);
}

void mq_moe_layer_free(mq_moe_layer *L) {
    if (!L) return;
    moeq_moe_experts_free(L->experts);
    L->experts = NULL;
}
