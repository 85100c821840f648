/*
 * Emulated NVFP4 activation quantization (moeq_model_options.act_quant) checked layer by layer
 * against slow obvious code in double precision. The hooks report each Linear's input before the
 * quantizer; from those inputs and the layer's weights the test recomputes, with
 * mq_nvfp4_act_qdq applied exactly where the W4A4 recipe puts it:
 *   - the O input = causal attention of q/k/v computed from qdq(QKV input) (one quantized copy
 *     for the three; RoPE, q/k norms, GQA, bias as the model has them);
 *   - every down-projection input = silu(gate(qdq(x))) * up(qdq(x)), a routed expert's x being
 *     its routed rows only (one global scale per expert), the shared expert's all rows;
 *   - the layer output = x + o(qdq(att)) + the MLP / MoE with qdq on each down input; routers
 *     and shared_expert_gate on the unquantized normed input;
 *   - the logits = lm_head(final_norm(x)) with no quantizer.
 * Each check also asserts the unquantized recomputation is clearly off, so it cannot pass by
 * accident. Then: only Linears stored quantized get the quantizer on a quantized checkpoint,
 * and wikitext perplexity moves by a small amount with act_quant and not at all without it.
 * The same layer-by-layer recomputation with llama.cpp's Q8_0 rounding (MOEQ_ACT_QUANT_Q8_0,
 * row-local: a routed expert's rows round as in the whole input), and its KL on an INT4 g32
 * checkpoint: the expected size, independent of the thread count; on a checkpoint imported from
 * GGUF it follows each matrix's ggml type (lm_head included).
 */
#include <stdlib.h>

#include "pipeline/pipeline.h"
#include "capture.h"
#include "formats/formats.h"
#include "harness.h"
#include "model/model.h"

enum { T = 12 };
static const double TOL = 2e-5;    /* fp32 forward vs double recomputation, relative to max */
/* the quantizer's effect is at least this: NVFP4 1e-3; Q8_0 (steps of amax/127 per 32) 1e-4 */
static double SEEN = 1e-3;
static int g_kind = MOEQ_ACT_QUANT_NVFP4;   /* the quantizer under test (moeq_act_quant) */
/* each Linear's own rounding, as a GGUF's ggml types give it (K-quants Q8_K, the others Q8_0),
 * rather than g_kind everywhere */
static bool g_by_linear = false;

/* The capture of site and expert (one layer's captures). */
static const mq_test_capture *find(const mq_test_captures *cs, int site, int expert) {
    const mq_test_capture *c = mq_test_find_capture(cs, -1, site, expert);
    if (!c) FAIL("no capture for site %d expert %d", site, expert);
    return c;
}

/* ---- reference pieces (double) -------------------------------------------------------------- */
/* The rounding the input of Linear l gets (mq_actq) when q (the quantized recomputation). */
static int kind_of(const mq_linear *l, bool q) {
    return !q ? MQ_ACTQ_NONE : g_by_linear ? l->act_q : MQ_ACTQ_MODEL;
}

/* A quantize-dequantized copy of x [rows, cols] (kind: mq_actq), or a plain copy (none). */
static float *qcopy(const float *x, int64_t rows, int64_t cols, int kind) {
    float *y = malloc(sizeof(float) * (size_t)(rows * cols + 1));
    memcpy(y, x, sizeof(float) * (size_t)(rows * cols));
    if (kind == MQ_ACTQ_Q8_K)
        mq_q8_k_act_qdq(y, rows, cols);
    else if (kind && g_kind == MOEQ_ACT_QUANT_Q8_0)
        mq_q8_0_act_qdq(y, rows, cols);
    else if (kind)
        mq_nvfp4_act_qdq(y, rows, cols);
    return y;
}

/* y [rows, out] = x W^T + b. */
static double *lin(const mq_linear *l, const float *x, int64_t rows) {
    double *y = malloc(sizeof(double) * (size_t)(rows * l->out));
    for (int64_t t = 0; t < rows; t++)
        for (int64_t o = 0; o < l->out; o++) {
            double s = l->bias ? l->bias[o] : 0;
            for (int64_t i = 0; i < l->in; i++) s += (double)x[t * l->in + i] * l->w[o * l->in + i];
            y[t * l->out + o] = s;
        }
    return y;
}

static void rms(double *x, int64_t rows, int64_t n, const float *w, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0, *v = x + r * n;
        for (int64_t i = 0; i < n; i++) ss += v[i] * v[i];
        double inv = 1.0 / sqrt(ss / (double)n + eps);
        for (int64_t i = 0; i < n; i++) v[i] = w[i] * v[i] * inv;
    }
}

static double silu(double v) { return v / (1.0 + exp(-v)); }

/* max |ref - got| / max |ref| */
static double relerr(const double *ref, const float *got, int64_t n) {
    double m = 0, d = 0;
    for (int64_t i = 0; i < n; i++) {
        m = fmax(m, fabs(ref[i]));
        d = fmax(d, fabs(ref[i] - got[i]));
    }
    return m > 0 ? d / m : d;
}

static void check(const char *what, int layer, const double *ref_q, const double *ref_plain,
                  const float *got, int64_t n) {
    double e = relerr(ref_q, got, n), e0 = relerr(ref_plain, got, n);
    if (!(e < TOL)) FAIL("layer %d %s: differs from the recomputation by %.3g", layer, what, e);
    if (!(e0 > SEEN))
        FAIL("layer %d %s: the unquantized recomputation is as close (%.3g): no quantizer seen",
             layer, what, e0);
}

/* The attention output [T, H*hd] from the QKV input (quantized or not). */
static double *attention(const moeq_model *m, const mq_layer *ly, const float *xqkv, bool q) {
    const mq_config *c = &m->cfg;
    int64_t D = c->D, H = c->n_heads, KV = c->n_kv_heads, hd = c->head_dim, half = hd / 2;
    float *xq = qcopy(xqkv, T, D, kind_of(&ly->q, q)), *xk = qcopy(xqkv, T, D, kind_of(&ly->k, q));
    float *xv = qcopy(xqkv, T, D, kind_of(&ly->v, q));
    double *Q = lin(&ly->q, xq, T), *K = lin(&ly->k, xk, T), *V = lin(&ly->v, xv, T);
    free(xq);
    free(xk);
    free(xv);
    if (c->qk_norm == MQ_QKNORM_FULL) {
        rms(Q, T, H * hd, ly->q_norm, c->rms_eps);
        rms(K, T, KV * hd, ly->k_norm, c->rms_eps);
    } else if (c->qk_norm == MQ_QKNORM_HEAD) {
        rms(Q, T * H, hd, ly->q_norm, c->rms_eps);
        rms(K, T * KV, hd, ly->k_norm, c->rms_eps);
    }
    if (c->clip_qkv > 0) {
        double *b[3] = {Q, K, V};
        int64_t n[3] = {T * H * hd, T * KV * hd, T * KV * hd};
        for (int i = 0; i < 3; i++)
            for (int64_t j = 0; j < n[i]; j++) b[i][j] = fmax(-c->clip_qkv, fmin(c->clip_qkv, b[i][j]));
    }
    double *bufs[2] = {Q, K};
    int64_t heads[2] = {H, KV};
    for (int b = 0; b < 2; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < heads[b]; h++)
                for (int64_t i = 0; i < half; i++) {
                    double a = (double)t / pow(c->rope_theta, (double)(2 * i) / (double)hd);
                    double *v = bufs[b] + (t * heads[b] + h) * hd, x0 = v[i], x1 = v[i + half];
                    v[i] = x0 * cos(a) - x1 * sin(a);
                    v[i + half] = x1 * cos(a) + x0 * sin(a);
                }
    double *att = calloc((size_t)(T * H * hd), sizeof(double)), p[T];
    for (int64_t h = 0; h < H; h++) {
        int64_t g = h / (H / KV);
        for (int64_t t = 0; t < T; t++) {
            double mx = -INFINITY, sum = 0;
            for (int64_t s = 0; s <= t; s++) {
                double d = 0;
                for (int64_t i = 0; i < hd; i++) d += Q[(t * H + h) * hd + i] * K[(s * KV + g) * hd + i];
                p[s] = d / sqrt((double)hd);
                mx = fmax(mx, p[s]);
            }
            for (int64_t s = 0; s <= t; s++) sum += p[s] = exp(p[s] - mx);
            for (int64_t s = 0; s <= t; s++)
                for (int64_t i = 0; i < hd; i++)
                    att[(t * H + h) * hd + i] += p[s] / sum * V[(s * KV + g) * hd + i];
        }
    }
    free(Q);
    free(K);
    free(V);
    return att;
}

/* silu(gate(x)) * up(x) [rows, F] with x quantized or not. */
static double *swiglu_in(const mq_linear *g, const mq_linear *u, const float *x, int64_t rows,
                         bool q) {
    float *xg = qcopy(x, rows, g->in, kind_of(g, q)), *xu = qcopy(x, rows, g->in, kind_of(u, q));
    double *a = lin(g, xg, rows), *b = lin(u, xu, rows);
    for (int64_t i = 0; i < rows * g->out; i++) a[i] = silu(a[i]) * b[i];
    free(xg);
    free(xu);
    free(b);
    return a;
}

/* down(qdq(h)) from a captured down input h [rows, F]. */
static double *down_of(const mq_linear *d, const float *h, int64_t rows, bool q) {
    float *hin = qcopy(h, rows, d->in, kind_of(d, q));
    double *y = lin(d, hin, rows);
    free(hin);
    return y;
}

/* ---- one layer ------------------------------------------------------------------------------ */
/* Checks layer l (x_in -> x_out) and the inputs its hooks captured against the recomputation
 * with the quantizer (must match) and without it (must not). */
static void check_layer(const moeq_model *m, int l, const float *x_in, const float *x_out,
                        const mq_test_captures *cs) {
    const mq_config *c = &m->cfg;
    const mq_layer *ly = &m->layers[l];
    int64_t D = c->D, Q = (int64_t)c->n_heads * c->head_dim;
    /* hooks see the unquantized QKV input: RMSNorm(x) */
    const mq_test_capture *cq = find(cs, MQ_SITE_QKV, -1), *co = find(cs, MQ_SITE_O, -1);
    if (!cq || !co) return;
    double *xn = malloc(sizeof(double) * (size_t)(T * D));
    for (int64_t i = 0; i < T * D; i++) xn[i] = x_in[i];
    rms(xn, T, D, ly->attn_norm, c->rms_eps);
    if (!(relerr(xn, cq->x, T * D) < TOL)) FAIL("layer %d: the QKV hook does not see RMSNorm(x)", l);
    free(xn);

    double *att_q = attention(m, ly, cq->x, true), *att_p = attention(m, ly, cq->x, false);
    check("attention output (O input)", l, att_q, att_p, co->x, T * Q);
    free(att_q);
    free(att_p);

    /* residual after attention, from the captured O input */
    double *o_q = down_of(&ly->o, co->x, T, true), *o_p = down_of(&ly->o, co->x, T, false);
    double *h = malloc(sizeof(double) * (size_t)(T * D)), *hn = malloc(sizeof(double) * (size_t)(T * D));
    for (int64_t i = 0; i < T * D; i++) hn[i] = h[i] = x_in[i] + o_q[i];
    rms(hn, T, D, ly->ffn_norm, c->rms_eps);
    float *hnf = malloc(sizeof(float) * (size_t)(T * D));
    for (int64_t i = 0; i < T * D; i++) hnf[i] = (float)hn[i];

    double *ffn_q = calloc((size_t)(T * D), sizeof(double)), *ffn_p = calloc((size_t)(T * D), sizeof(double));
    if (!ly->is_moe) {
        const mq_test_capture *cm = find(cs, MQ_SITE_MLP, -1), *cd = find(cs, MQ_SITE_MLP_DOWN, -1);
        if (!cm || !cd) return;
        if (!(relerr(hn, cm->x, T * D) < TOL)) FAIL("layer %d: the MLP hook does not see RMSNorm(h)", l);
        double *a = swiglu_in(&ly->gate, &ly->up, cm->x, T, true);
        double *b = swiglu_in(&ly->gate, &ly->up, cm->x, T, false);
        check("MLP down input", l, a, b, cd->x, T * c->ffn);
        free(a);
        free(b);
        double *yq = down_of(&ly->down, cd->x, T, true), *yp = down_of(&ly->down, cd->x, T, false);
        memcpy(ffn_q, yq, sizeof(double) * (size_t)(T * D));
        memcpy(ffn_p, yp, sizeof(double) * (size_t)(T * D));
        free(yq);
        free(yp);
    } else {
        int64_t E = c->n_experts, K = c->top_k, F = c->moe_ffn;
        /* routing on the unquantized normed input */
        int sel[T][8];
        double wt[T][8];
        for (int64_t t = 0; t < T; t++) {
            double pr[64], mx = -INFINITY, sum = 0, ws = 0;
            for (int64_t e = 0; e < E; e++) {
                pr[e] = 0;
                for (int64_t i = 0; i < D; i++) pr[e] += hn[t * D + i] * ly->router[e * D + i];
                mx = fmax(mx, pr[e]);
            }
            for (int64_t e = 0; e < E; e++) sum += pr[e] = exp(pr[e] - mx);
            for (int64_t k = 0; k < K; k++) {
                int b = -1;
                for (int64_t e = 0; e < E; e++) {
                    bool taken = false;
                    for (int64_t j = 0; j < k; j++) taken |= sel[t][j] == e;
                    if (!taken && (b < 0 || pr[e] > pr[b])) b = (int)e;
                }
                sel[t][k] = b;
                ws += wt[t][k] = pr[b] / sum;
            }
            if (c->norm_topk_prob)
                for (int64_t k = 0; k < K; k++) wt[t][k] /= ws;
        }
        int whole_differs = 0;
        for (int64_t e = 0; e < E; e++) {
            const mq_test_capture *ci = find(cs, MQ_SITE_EXPERT, (int)e), *cd = find(cs, MQ_SITE_EXPERT_DOWN, (int)e);
            if (!ci || !cd) return;
            int64_t rows = 0, tok[T];
            for (int64_t t = 0; t < T; t++)
                for (int64_t k = 0; k < K; k++)
                    if (sel[t][k] == e) tok[rows++] = t;
            ASSERT_EQ_INT(rows, ci->rows);
            if (rows != ci->rows || rows == 0) continue;
            double *xr = malloc(sizeof(double) * (size_t)(rows * D));
            for (int64_t r = 0; r < rows; r++)
                for (int64_t i = 0; i < D; i++) xr[r * D + i] = hn[tok[r] * D + i];
            if (!(relerr(xr, ci->x, rows * D) < TOL)) FAIL("layer %d expert %lld: routed rows", l, (long long)e);
            free(xr);
            double *a = swiglu_in(&ly->exp_gate[e], &ly->exp_up[e], ci->x, rows, true);
            double *b = swiglu_in(&ly->exp_gate[e], &ly->exp_up[e], ci->x, rows, false);
            check("expert down input", l, a, b, cd->x, rows * F);
            free(a);
            free(b);
            /* one scale per expert: quantizing the routed rows inside the whole input (one
             * global scale for all tokens) gives another result for some expert */
            /* the whole input with the routed rows as the expert got them (a recomputed row
             * may round to the other side of a half step) */
            float *whole = malloc(sizeof(float) * (size_t)(T * D));
            memcpy(whole, hnf, sizeof(float) * (size_t)(T * D));
            for (int64_t r = 0; r < rows; r++)
                memcpy(whole + tok[r] * D, ci->x + r * D, sizeof(float) * (size_t)D);
            float *all = qcopy(whole, T, D, kind_of(&ly->exp_gate[e], true));
            free(whole);
            double e_all = 0;
            {
                float *rows_all = malloc(sizeof(float) * (size_t)(rows * D));
                for (int64_t r = 0; r < rows; r++)
                    memcpy(rows_all + r * D, all + tok[r] * D, sizeof(float) * (size_t)D);
                double *ga = lin(&ly->exp_gate[e], rows_all, rows), *ua = lin(&ly->exp_up[e], rows_all, rows);
                for (int64_t i = 0; i < rows * F; i++) ga[i] = silu(ga[i]) * ua[i];
                e_all = relerr(ga, cd->x, rows * F);
                free(ga);
                free(ua);
                free(rows_all);
            }
            free(all);
            whole_differs += e_all > 10 * TOL;
            double *yq = down_of(&ly->exp_down[e], cd->x, rows, true);
            double *yp = down_of(&ly->exp_down[e], cd->x, rows, false);
            for (int64_t r = 0; r < rows; r++) {
                int64_t t = tok[r];
                double w = 0;
                for (int64_t k = 0; k < K; k++)
                    if (sel[t][k] == e) w = wt[t][k];
                for (int64_t i = 0; i < D; i++) {
                    ffn_q[t * D + i] += w * yq[r * D + i];
                    ffn_p[t * D + i] += w * yp[r * D + i];
                }
            }
            free(yq);
            free(yp);
        }
        if (g_kind == MOEQ_ACT_QUANT_NVFP4 && whole_differs == 0)
            FAIL("layer %d: no expert tells per-expert from whole-input scales", l);
        if (g_kind == MOEQ_ACT_QUANT_Q8_0 && whole_differs > 0)   /* row-local: no difference */
            FAIL("layer %d: Q8_0 of the routed rows differs from Q8_0 of the whole input", l);
        if (c->shared_ffn > 0) {
            const mq_test_capture *ci = find(cs, MQ_SITE_SHARED, -1), *cd = find(cs, MQ_SITE_SHARED_DOWN, -1);
            if (!ci || !cd) return;
            if (!(relerr(hn, ci->x, T * D) < TOL)) FAIL("layer %d: the shared expert input", l);
            double *a = swiglu_in(&ly->sh_gate, &ly->sh_up, ci->x, T, true);
            double *b = swiglu_in(&ly->sh_gate, &ly->sh_up, ci->x, T, false);
            check("shared expert down input", l, a, b, cd->x, T * c->shared_ffn);
            free(a);
            free(b);
            double *yq = down_of(&ly->sh_down, cd->x, T, true), *yp = down_of(&ly->sh_down, cd->x, T, false);
            for (int64_t t = 0; t < T; t++) {
                double g = 1;
                if (c->shared_gate) {
                    double z = 0;
                    for (int64_t i = 0; i < D; i++) z += hn[t * D + i] * ly->sh_gate_w[i];
                    g = 1 / (1 + exp(-z));
                }
                for (int64_t i = 0; i < D; i++) {
                    ffn_q[t * D + i] += g * yq[t * D + i];
                    ffn_p[t * D + i] += g * yp[t * D + i];
                }
            }
            free(yq);
            free(yp);
        }
    }
    /* the layer output; the plain reference leaves out the quantizer of o and the down inputs */
    double *ref_q = malloc(sizeof(double) * (size_t)(T * D)), *ref_p = malloc(sizeof(double) * (size_t)(T * D));
    for (int64_t i = 0; i < T * D; i++) {
        ref_q[i] = o_q[i] + ffn_q[i];
        ref_p[i] = o_p[i] + ffn_p[i];
    }
    float *delta = malloc(sizeof(float) * (size_t)(T * D));
    for (int64_t i = 0; i < T * D; i++) delta[i] = x_out[i] - x_in[i];
    check("output - input", l, ref_q, ref_p, delta, T * D);
    free(delta);
    free(ref_q);
    free(ref_p);
    free(ffn_q);
    free(ffn_p);
    free(o_q);
    free(o_p);
    free(h);
    free(hn);
    free(hnf);
}

static void layers_at(const char *path, const char *name) {
    moeq_model_options mo = {.no_tokenizer = 1, .act_quant = g_kind};
    moeq_model *m = mq_test_open_model(path, &mo);
    if (!m) return;
    ASSERT_TRUE(m->cfg.sliding_window == 0 || m->cfg.sliding_window >= T);
    ASSERT_TRUE(m->cfg.n_experts <= 64 && m->cfg.top_k <= 8);
    int64_t D = m->cfg.D, V = m->cfg.vocab;
    int32_t ids[T];
    for (int i = 0; i < T; i++) ids[i] = (int32_t)((i * 7919 + 13) % V);
    float *x = malloc(sizeof(float) * (size_t)(T * D)), *xin = malloc(sizeof(float) * (size_t)(T * D));
    mq_state *st = NULL;
    ASSERT_OK(mq_state_new(m, T, &st));
    ASSERT_OK(mq_embed(m, ids, T, x));
    for (int l = 0; l < m->cfg.n_layers; l++) {
        mq_test_captures cs = {.n = 0};
        mq_hooks hk = {mq_test_on_capture, &cs};
        memcpy(xin, x, sizeof(float) * (size_t)(T * D));
        ASSERT_OK(mq_forward_layers(m, st, x, T, 0, l, l + 1, &hk));
        check_layer(m, l, xin, x, &cs);
        mq_test_free_captures(&cs);
    }
    /* the logits: lm_head(final_norm(x)), lm_head's input rounded where it is marked */
    double *xn = malloc(sizeof(double) * (size_t)(T * D)), *ref = malloc(sizeof(double) * (size_t)(T * V));
    for (int64_t i = 0; i < T * D; i++) xn[i] = x[i];
    rms(xn, T, D, m->final_norm, m->cfg.rms_eps);
    if (m->lm_head_act_q) {
        float *xf = malloc(sizeof(float) * (size_t)(T * D));
        for (int64_t i = 0; i < T * D; i++) xf[i] = (float)xn[i];
        float *xr = qcopy(xf, T, D, g_by_linear ? m->lm_head_act_q : MQ_ACTQ_MODEL);
        for (int64_t i = 0; i < T * D; i++) xn[i] = xr[i];
        free(xf);
        free(xr);
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t v = 0; v < V; v++) {
            double s = 0;
            for (int64_t i = 0; i < D; i++) s += xn[t * D + i] * m->lm_head[v * D + i];
            ref[t * V + v] = s;
        }
    float *lg = malloc(sizeof(float) * (size_t)(T * V));
    moeq_session *ss = NULL;
    ASSERT_OK(moeq_session_create(m, T, &ss));
    ASSERT_OK(moeq_session_forward(ss, ids, T, lg));
    double e = relerr(ref, lg, T * V);
    if (!(e < TOL)) FAIL("%s: logits differ from lm_head(final_norm(x)) by %.3g", name, e);
    moeq_session_free(ss);
    mq_state_free(st);
    free(lg);
    free(ref);
    free(xn);
    free(x);
    free(xin);
    moeq_model_free(m);
}

static void layers_for(const char *name) { layers_at(mq_test_model(name), name); }

static void test_layers_olmoe(void) { layers_for("olmoe-tiny"); }
static void test_layers_qwen2moe(void) { layers_for("qwen2moe-tiny"); }
static void test_layers_llama(void) { layers_for("llama-tiny"); }

/* The same recomputation with llama.cpp's Q8_0 rounding (mq_q8_0_act_qdq, row by row) in the
 * same places. */
static void q8_0_layers_for(const char *name) {
    g_kind = MOEQ_ACT_QUANT_Q8_0;
    SEEN = 1e-4;
    layers_for(name);
    g_kind = MOEQ_ACT_QUANT_NVFP4;
    SEEN = 1e-3;
}
static void test_q8_0_layers_olmoe(void) { q8_0_layers_for("olmoe-tiny"); }
static void test_q8_0_layers_qwen2moe(void) { q8_0_layers_for("qwen2moe-tiny"); }
static void test_q8_0_layers_llama(void) { q8_0_layers_for("llama-tiny"); }

/* On a quantized checkpoint the quantizer follows the stored weights: an ignored o_proj and the
 * (never quantized) routers keep fp32 inputs. qwen2moe-tiny (with a shared expert), or the
 * bundled olmoe-tiny when the shared folder is absent. */
static void test_only_quantized_linears(void) {
    char src[1024], dir[1024];
    snprintf(src, sizeof src, "%s",
             mq_test_model(mq_test_have_shared() ? "qwen2moe-tiny" : "olmoe-tiny"));
    snprintf(dir, sizeof dir, "%s/q", mq_test_tmpdir());
    mq_pipeline_opts q;
    mq_pipeline_opts_init(&q, MQ_QS_NVFP4, MQ_FMT_CT);
    const char *ign[1] = {"model\\.layers\\.1\\.self_attn\\.o_proj"};
    q.ignore = ign;
    q.n_ignore = 1;
    ASSERT_OK(mq_pipeline_run(src, dir, &q, NULL));
    moeq_model_options mo = {.no_tokenizer = 1, .act_quant = MOEQ_ACT_QUANT_NVFP4};
    moeq_model *m = mq_test_open_model(dir, &mo);
    if (!m) return;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const mq_layer *ly = &m->layers[l];
        ASSERT_TRUE(ly->q.act_q && ly->k.act_q && ly->v.act_q);
        ASSERT_EQ_INT(l != 1, ly->o.act_q);
        for (int e = 0; e < m->cfg.n_experts; e++)
            ASSERT_TRUE(ly->exp_gate[e].act_q && ly->exp_up[e].act_q && ly->exp_down[e].act_q);
        if (m->cfg.shared_ffn > 0 || mq_test_have_shared())
            ASSERT_TRUE(ly->sh_gate.act_q && ly->sh_up.act_q && ly->sh_down.act_q);
    }
    moeq_model_free(m);
    mo.act_quant = MOEQ_ACT_QUANT_NONE;
    ASSERT_OK(moeq_model_open(dir, &mo, &m));
    if (m) ASSERT_FALSE(m->layers[0].q.act_q || m->layers[0].exp_down[0].act_q);
    moeq_model_free(m);
}

/* W4A4 emulation on the unquantized model: the perplexity moves a little; without act_quant the
 * result is the default model's bit for bit. */
static void eval_perplexity(const moeq_docs *docs, const moeq_eval_options *o, const char *what) {
    char d[1024];
    snprintf(d, sizeof d, "%s", mq_test_model("olmoe-tiny"));
    moeq_model *def = NULL, *none = NULL, *aq = NULL;
    moeq_model_options mo = {0};
    ASSERT_OK(moeq_model_open(d, NULL, &def));
    ASSERT_OK(moeq_model_open(d, &mo, &none));
    mo.act_quant = MOEQ_ACT_QUANT_NVFP4;
    ASSERT_OK(moeq_model_open(d, &mo, &aq));
    if (!def || !none || !aq) return;
    moeq_eval_result r0, r1, r2;
    ASSERT_OK(moeq_eval(def, docs, o, &r0));
    ASSERT_OK(moeq_eval(none, docs, o, &r1));
    ASSERT_OK(moeq_eval(aq, docs, o, &r2));
    double change = r2.word_perplexity / r0.word_perplexity - 1;
    printf("  olmoe-tiny, %s: word perplexity %.6f, with NVFP4 activations %.6f (%+.3f%%)\n", what,
           r0.word_perplexity, r2.word_perplexity, 100 * change);
    ASSERT_TRUE(r0.loglikelihood == r1.loglikelihood);
    if (!(change > 0.002 && change < 0.15))
        FAIL("%s: NVFP4 activations change the word perplexity by %+.4f%% (expected +0.2%% .. +15%%)",
             what, 100 * change);
    moeq_model_free(def);
    moeq_model_free(none);
    moeq_model_free(aq);
}

static void test_eval_perplexity(void) { mq_test_on_eval_text(0, eval_perplexity); }

/* The same on the repository's own held-out text. */
static void test_eval_perplexity_demo_text(void) { mq_test_on_eval_text(1, eval_perplexity); }

/* Q8_0 activations (llama.cpp's) on an RTN INT4 g32 checkpoint, i.e. the Linears llama.cpp runs
 * as Q4_0: the rounding enters where the weight rounding does, with steps of amax/127 per 32
 * inputs against amax/7.5 per 32 weights, so its KL to the same checkpoint in fp32 is about
 * (7.5/127)^2 = 3.5e-3 times the weights' own KL to the unquantized model, up to a factor for the
 * activations' heavier tails (docs/gguf.md, "The tolerance"; on data/demo-eval.txt 1.8 times
 * that for olmoe-tiny, 3.7 for qwen2moe-tiny; llama.cpp's own Q8_0 gave 1.3-1.9 on wikitext).
 * Accepted: 1 to 6 times (no rounding gives 0; blocks of 256 or 4-bit steps are far outside).
 * And the result is bit-identical for 1 and 3 threads. */
static void q8_0_eval_for(const char *name) {
    char src[1024], dir[1024];
    snprintf(src, sizeof src, "%s", mq_test_model(name));
    snprintf(dir, sizeof dir, "%s/g32", mq_test_tmpdir());
    mq_pipeline_opts q;
    mq_pipeline_opts_init(&q, MQ_QS_INT4, MQ_FMT_CT);
    q.spec.group_size = 32;
    ASSERT_OK(mq_pipeline_run(src, dir, &q, NULL));
    moeq_docs *docs = mq_test_demo_docs();
    moeq_model *base = NULL, *w = NULL, *wq = NULL;
    moeq_model_options mo = {0};
    ASSERT_OK(moeq_model_open(src, &mo, &base));
    ASSERT_OK(moeq_model_open(dir, &mo, &w));
    mo.act_quant = MOEQ_ACT_QUANT_Q8_0;
    ASSERT_OK(moeq_model_open(dir, &mo, &wq));
    if (!docs || !base || !w || !wq) return;
    ASSERT_EQ_INT(MOEQ_ACT_QUANT_Q8_0, moeq_model_get_info(wq)->act_quant);
    ASSERT_EQ_INT(0, moeq_model_get_info(wq)->packed_linears);
    moeq_eval_options o = mq_test_text_eval(512, NULL);
    o.prefix_token = 0;
    moeq_eval_result rw, rq, rq1;
    o.kl_base = base;
    ASSERT_OK(moeq_eval(w, docs, &o, &rw));
    o.kl_base = w;
    int threads = moeq_threads();
    moeq_set_threads(getenv("MOEQ_CROSS") ? 1 : 3);   /* qemu-user: contended locks crawl */
    ASSERT_OK(moeq_eval(wq, docs, &o, &rq));
    moeq_set_threads(1);
    ASSERT_OK(moeq_eval(wq, docs, &o, &rq1));
    moeq_set_threads(threads);
    double expect = (7.5 / 127) * (7.5 / 127) * rw.kl_mean, ratio = rq.kl_mean / expect;
    printf("  %s RTN INT4 g32: KL(weights) %.5f; Q8_0 activations: KL %.3g = %.2f x (7.5/127)^2 "
           "x KL(weights), perplexity %+.4f%%\n", name, rw.kl_mean, rq.kl_mean, ratio,
           100 * (rq.token_perplexity / rw.token_perplexity - 1));
    if (!(ratio > 1.0 && ratio < 6.0))
        FAIL("%s: Q8_0 activations give KL %.3g, %.2f times the expected %.3g (1 .. 6)", name,
             rq.kl_mean, ratio, expect);
    /* the thread count changes nothing */
    if (!(rq.loglikelihood == rq1.loglikelihood && rq.kl_mean == rq1.kl_mean))
        FAIL("%s: 3 threads give loglikelihood %.17g KL %.17g, 1 thread %.17g %.17g", name,
             rq.loglikelihood, rq.kl_mean, rq1.loglikelihood, rq1.kl_mean);
    moeq_docs_free(docs);
    moeq_model_free(base);
    moeq_model_free(w);
    moeq_model_free(wq);
}
static void test_q8_0_eval_olmoe(void) { q8_0_eval_for("olmoe-tiny"); }
static void test_q8_0_eval_qwen2moe(void) { q8_0_eval_for("qwen2moe-tiny"); }

/* A checkpoint imported from GGUF: q8_0 follows each matrix's ggml type (gguf_types.json): the
 * Q4_0 Linears of an INT4 g32 export but not its BF16 lm_head; with --gguf-rest q8_0 every Linear
 * and lm_head; with --gguf-rest bf16 none. The Q4_0 file's logits equal the checkpoint's. */
static void open_imported(const char *gguf, const char *dir, moeq_model **m) {
    ASSERT_OK(moeq_import_gguf(gguf, dir));
    moeq_model_options mo = {.no_tokenizer = 1, .act_quant = MOEQ_ACT_QUANT_Q8_0};
    ASSERT_OK(moeq_model_open(dir, &mo, m));
}

static int count_act_q(const moeq_model *m, int *n_linears) {
    int n = 0;
    *n_linears = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const mq_layer *ly = &m->layers[l];
        const mq_linear *v[4] = {&ly->q, &ly->k, &ly->v, &ly->o};
        for (int i = 0; i < 4; i++) n += v[i]->act_q, ++*n_linears;
        for (int e = 0; ly->is_moe && e < m->cfg.n_experts; e++) {
            const mq_linear *x[3] = {&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e]};
            for (int i = 0; i < 3; i++) n += x[i]->act_q, ++*n_linears;
        }
    }
    return n;
}

static void test_q8_0_follows_gguf_types(void) {
    char src[1024], tmp[1024], p[1200], d[1200];
    snprintf(src, sizeof src, "%s", mq_test_model("olmoe-tiny"));
    snprintf(tmp, sizeof tmp, "%s", mq_test_tmpdir());
    snprintf(d, sizeof d, "%s/g32", tmp);
    mq_pipeline_opts q;
    mq_pipeline_opts_init(&q, MQ_QS_INT4, MQ_FMT_GPTQ);
    q.spec.group_size = 32;
    ASSERT_OK(mq_pipeline_run(src, d, &q, NULL));
    const char *rest[3] = {"auto", "q8_0", "bf16"};
    const int want_all[3] = {1, 1, 0}, want_head[3] = {0, 1, 0};
    moeq_model *ref = NULL;
    moeq_model_options mo = {.no_tokenizer = 1, .act_quant = MOEQ_ACT_QUANT_Q8_0};
    ASSERT_OK(moeq_model_open(d, &mo, &ref));
    if (!ref) return;
    for (int k = 0; k < 3; k++) {
        snprintf(p, sizeof p, "%s/%s.gguf", tmp, rest[k]);
        ASSERT_OK(moeq_export_gguf(k == 0 ? d : src, p, rest[k]));
        char imp[1300];
        snprintf(imp, sizeof imp, "%s/imp-%s", tmp, rest[k]);
        moeq_model *m = NULL;
        open_imported(p, imp, &m);
        if (!m) return;
        int n, n_act = count_act_q(m, &n);
        if (n_act != (want_all[k] ? n : 0))
            FAIL("--gguf-rest %s: %d of %d Linears get Q8_0 inputs, expected %d", rest[k], n_act, n,
                 want_all[k] ? n : 0);
        ASSERT_EQ_INT(want_head[k], m->lm_head_act_q);
        if (k == 0) {   /* the same Q4_0 codes: the checkpoint's logits bit for bit */
            enum { N = 24 };
            int32_t ids[N];
            for (int i = 0; i < N; i++) ids[i] = (int32_t)((i * 389 + 5) % m->cfg.vocab);
            ASSERT_EQ_INT(m->cfg.vocab, ref->cfg.vocab);
            float *a = mq_test_logits(m, ids, N), *b = mq_test_logits(ref, ids, N);
            ASSERT_TRUE(memcmp(a, b, sizeof(float) * N * (size_t)m->cfg.vocab) == 0);
            free(a);
            free(b);
        }
        moeq_model_free(m);
    }
    moeq_model_free(ref);
}

/* A K-quant GGUF (llama.cpp's Q4_K_M mixture, RTN): llama.cpp gives its K-quant matmuls Q8_K
 * activations (blocks of 256, fp32 d) and its Q8_0 attn_k/attn_v Q8_0 ones; every layer is
 * recomputed with each Linear's own rounding (q and k/v of one input rounded two ways), the
 * Q6_K lm_head's input in Q8_K too. */
static void test_q8_k_layers_gguf(void) {
    char src[1024], p[1200];
    snprintf(src, sizeof src, "%s", mq_test_model("olmoe-tiny"));
    snprintf(p, sizeof p, "%s/q4_k_m.gguf", mq_test_tmpdir());
    moeq_quant_options o;
    moeq_quant_options_init(&o);
    o.scheme = MOEQ_QUANT_Q4_K_M;
    o.method = MOEQ_QUANT_RTN;
    o.format = MOEQ_FORMAT_GGUF;
    moeq_quant_result r;
    ASSERT_OK(moeq_quantize(src, p, &o, &r));
    moeq_model_options mo = {.no_tokenizer = 1, .act_quant = MOEQ_ACT_QUANT_Q8_0};
    moeq_model *m = mq_test_open_model(p, &mo);
    if (!m) return;
    for (int l = 0; l < m->cfg.n_layers; l++) {   /* llama.cpp's Q4_K_M for 8 experts */
        const mq_layer *ly = &m->layers[l];
        ASSERT_EQ_INT(MQ_ACTQ_Q8_K, ly->q.act_q);
        ASSERT_EQ_INT(MQ_ACTQ_MODEL, ly->k.act_q);
        ASSERT_EQ_INT(MQ_ACTQ_MODEL, ly->v.act_q);
        ASSERT_EQ_INT(MQ_ACTQ_Q8_K, ly->o.act_q);
        for (int e = 0; e < m->cfg.n_experts; e++) {
            ASSERT_EQ_INT(MQ_ACTQ_Q8_K, ly->exp_gate[e].act_q);
            ASSERT_EQ_INT(MQ_ACTQ_Q8_K, ly->exp_down[e].act_q);
        }
    }
    ASSERT_EQ_INT(MQ_ACTQ_Q8_K, m->lm_head_act_q);
    moeq_model_free(m);
    g_kind = MOEQ_ACT_QUANT_Q8_0;
    g_by_linear = true;
    SEEN = 1e-4;
    layers_at(p, "olmoe-tiny q4_k_m.gguf");
    g_kind = MOEQ_ACT_QUANT_NVFP4;
    g_by_linear = false;
    SEEN = 1e-3;
}

TEST_MAIN(T(test_layers_olmoe), T(test_layers_qwen2moe), T(test_layers_llama),
          T(test_only_quantized_linears), T(test_eval_perplexity),
          T(test_eval_perplexity_demo_text),
          T(test_q8_0_layers_olmoe), T(test_q8_0_layers_qwen2moe), T(test_q8_0_layers_llama),
          T(test_q8_0_eval_olmoe), T(test_q8_0_eval_qwen2moe),
          T(test_q8_0_follows_gguf_types), T(test_q8_k_layers_gguf))
