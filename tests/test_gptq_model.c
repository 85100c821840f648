/*
 * GPTQ over whole tiny MoE models (src/quant/gptq_model.c): the Hessians the pipeline builds
 * (checked against Hessians collected here with our own hooks and summed in double), token
 * counts per expert, the expert fallback, fused global scales, sequential vs nonsequential, the
 * model left with exactly the dequantized weights, and GPTQ loss <= RTN loss for every weight.
 */
#include <stdlib.h>

#include "harness.h"
#include "quant/gptq_model.h"

static moeq_model *open_model(const char *name) {
    moeq_model *m = NULL;
    ASSERT_OK(moeq_model_open(mq_test_model(name), NULL, &m));
    return m;
}

static void load_calib(const moeq_model *m, int64_t n, int64_t len, mq_calib_set *s) {
    mq_calib_opts o;
    mq_calib_opts_init(&o);
    char path[512];
    snprintf(path, sizeof path, "%s", mq_test_calib_text());
    o.path = path;
    o.nsamples = n;
    o.seqlen = len;
    ASSERT_OK(mq_calib_load(moeq_model_tokenizer(m), &o, s));
}

static int64_t count_diff(const uint8_t *a, const uint8_t *b, int64_t n) {
    int64_t d = 0;
    for (int64_t i = 0; i < n; i++) d += a[i] != b[i];
    return d;
}

/* Checks shared by every run: losses, tokens, weights written back. */
static void check_run(const moeq_model *m, const mq_gptq_results *r, const mq_calib_set *cs,
                      const mq_gptq_model_opts *o) {
    const mq_config *c = &m->cfg;
    int64_t want = 0;
    for (int l = 0; l < c->n_layers; l++)
        want += 4 + (m->layers[l].is_moe ? 3 * c->n_experts + (c->shared_ffn ? 3 : 0) : 3);
    ASSERT_EQ_INT(want, r->n);
    ASSERT_EQ_INT(cs->total, r->tokens);
    int64_t expert_tokens[64] = {0};
    for (int64_t i = 0; i < r->n; i++) {
        const mq_gptq_result *x = &r->r[i];
        if (x->how != MQ_HOW_RTN && !(x->stats.loss <= x->stats.rtn_loss))
            FAIL("%s: GPTQ loss %g > RTN loss %g", x->module, x->stats.loss, x->stats.rtn_loss);
        if (x->expert < 0) ASSERT_EQ_INT(cs->total, x->tokens);
        else if (strstr(x->module, "gate_proj")) expert_tokens[x->layer] += x->tokens;
        if (x->expert >= 0 && x->tokens < o->min_expert_tokens)
            ASSERT_EQ_INT(o->fallback == MQ_FALLBACK_RTN ? MQ_HOW_RTN : MQ_HOW_GPTQ_BLOCK_HESSIAN, x->how);
        else
            ASSERT_EQ_INT(MQ_HOW_GPTQ, x->how);
    }
    for (int l = 0; l < c->n_layers; l++)
        if (m->layers[l].is_moe) ASSERT_EQ_INT(c->top_k * cs->total, expert_tokens[l]);
}

/* The model's weights are exactly the dequantized results; fused groups share a global scale. */
static void check_weights(moeq_model *m, const mq_gptq_results *r) {
    for (int l = 0; l < m->cfg.n_layers; l++) {
        mq_layer *ly = &m->layers[l];
        mq_linear *ls[4] = {&ly->q, &ly->k, &ly->v, &ly->o};
        float gs_q = mq_gptq_results_find(r, ly->q.name)->q.global_scale;
        for (int i = 0; i < 4; i++) {
            const mq_gptq_result *x = mq_gptq_results_find(r, ls[i]->name);
            ASSERT_TRUE(x != NULL);
            float *w = malloc((size_t)(ls[i]->out * ls[i]->in) * sizeof(float));
            mq_dequantize(&x->q, w);
            ASSERT_TRUE(memcmp(w, ls[i]->w, (size_t)(ls[i]->out * ls[i]->in) * sizeof(float)) == 0);
            free(w);
            if (i < 3) ASSERT_TRUE(x->q.global_scale == gs_q);
        }
        if (ly->is_moe)
            for (int e = 0; e < m->cfg.n_experts; e++)
                ASSERT_TRUE(mq_gptq_results_find(r, ly->exp_gate[e].name)->q.global_scale ==
                            mq_gptq_results_find(r, ly->exp_up[e].name)->q.global_scale);
    }
}

static void test_olmoe_nvfp4_sequential(void) {
    moeq_model *m = open_model("olmoe-tiny");
    mq_calib_set cs;
    load_calib(m, 8, 64, &cs);
    mq_qspec spec = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_model_opts o;
    mq_gptq_model_opts_init(&o, &spec);
    mq_gptq_results r;
    ASSERT_OK(mq_gptq_model(m, &cs, &o, &r));
    check_run(m, &r, &cs, &o);
    check_weights(m, &r);
    int fallbacks = 0;
    for (int64_t i = 0; i < r.n; i++) fallbacks += r.r[i].how != MQ_HOW_GPTQ;
    ASSERT_TRUE(fallbacks > 0);   /* 512 tokens leave some of the 32 experts without tokens */
    /* the report names every module and counts the fallbacks */
    char path[512];
    snprintf(path, sizeof path, "%s/report.json", mq_test_tmpdir());
    ASSERT_OK(mq_gptq_report_write(&r, &o, NULL, path));
    char *text;
    size_t len;
    ASSERT_OK(mq_read_file(path, &text, &len));
    ASSERT_TRUE(strstr(text, "\"model.layers.3.mlp.experts.7.down_proj\"") != NULL);
    char want[64];
    snprintf(want, sizeof want, "\"expert_fallbacks\":\t%d", fallbacks);
    ASSERT_TRUE(strstr(text, want) != NULL);
    ASSERT_TRUE(strstr(text, "\"modules_worse_than_rtn\":\t0") != NULL);
    free(text);
    mq_gptq_results_free(&r);
    mq_calib_free(&cs);
    moeq_model_free(m);
}

/* ---- the Hessians of layer 0, collected independently --------------------------------------- */

typedef struct {
    int64_t K[3];
    double *sum[3];   /* QKV, expert e gate/up, expert e down */
    int64_t n[3];
    int expert;
} ref_hess;

static void ref_add(ref_hess *h, int i, const float *x, int64_t rows, int64_t cols) {
    h->K[i] = cols;
    if (!h->sum[i]) h->sum[i] = calloc((size_t)(cols * cols), sizeof(double));
    for (int64_t t = 0; t < rows; t++)
        for (int64_t a = 0; a < cols; a++)
            for (int64_t b = 0; b < cols; b++) h->sum[i][a * cols + b] += (double)x[t * cols + a] * x[t * cols + b];
    h->n[i] += rows;
}

static void ref_capture(void *user, int layer, mq_site site, int expert, const float *x,
                        int64_t rows, int64_t cols) {
    ref_hess *h = user;
    if (layer != 0) return;
    if (site == MQ_SITE_QKV) ref_add(h, 0, x, rows, cols);
    if (site == MQ_SITE_EXPERT && expert == h->expert) ref_add(h, 1, x, rows, cols);
    if (site == MQ_SITE_EXPERT_DOWN && expert == h->expert) ref_add(h, 2, x, rows, cols);
}

static void check_module(const mq_gptq_results *r, const mq_linear *l, const ref_hess *h, int i,
                         const mq_qspec *spec, const mq_gptq_opts *go) {
    const int64_t K = h->K[i];
    float *H = malloc((size_t)(K * K) * sizeof(float));
    for (int64_t k = 0; k < K * K; k++) H[k] = (float)(2.0 * h->sum[i][k] / (double)h->n[i]);
    const mq_gptq_result *x = mq_gptq_results_find(r, l->name);
    ASSERT_TRUE(x != NULL);
    ASSERT_EQ_INT(h->n[i], x->tokens);
    mq_qtensor q;
    mq_gptq_stats st;
    ASSERT_OK(mq_gptq_quantize(spec, go, H, l->w, l->out, l->in, x->q.global_scale, l->name, &q,
                               NULL, &st));
    int64_t d = count_diff(q.codes, x->q.codes, l->out * l->in);
    if (d > l->out * l->in / 200)
        FAIL("%s: %lld of %lld codes differ from GPTQ on the independently built Hessian", l->name,
             (long long)d, (long long)(l->out * l->in));
    ASSERT_REL(st.loss, x->stats.loss, 0.02);
    mq_qtensor_free(&q);
    free(H);
}

static void test_layer0_hessians_independent(void) {
    moeq_model *m = open_model("olmoe-tiny"), *ref = open_model("olmoe-tiny");
    mq_calib_set cs;
    load_calib(m, 6, 64, &cs);
    /* our own capture of layer 0 on the unquantized model */
    ref_hess h;
    memset(&h, 0, sizeof h);
    h.expert = 3;
    mq_state *state;
    ASSERT_OK(mq_state_new(ref, (int32_t)cs.max_len, &state));
    float *x = malloc((size_t)(cs.max_len * ref->cfg.D) * sizeof(float));
    mq_hooks hooks = {ref_capture, &h};
    for (int64_t s = 0; s < cs.n; s++) {
        ASSERT_OK(mq_embed(ref, cs.ids[s], cs.len[s], x));
        ASSERT_OK(mq_forward_layers(ref, state, x, cs.len[s], 0, 0, 1, &hooks));
    }
    ASSERT_TRUE(h.n[1] > 0);   /* expert 3 of layer 0 gets tokens */
    mq_qspec spec = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_model_opts o;
    mq_gptq_model_opts_init(&o, &spec);
    o.gptq.act_order = true;
    mq_gptq_results r;
    ASSERT_OK(mq_gptq_model(m, &cs, &o, &r));
    const mq_layer *ly = &ref->layers[0];
    check_module(&r, &ly->q, &h, 0, &o.spec, &o.gptq);
    check_module(&r, &ly->v, &h, 0, &o.spec, &o.gptq);
    check_module(&r, &ly->exp_up[3], &h, 1, &o.spec, &o.gptq);
    check_module(&r, &ly->exp_down[3], &h, 2, &o.spec, &o.gptq);
    for (int i = 0; i < 3; i++) free(h.sum[i]);
    free(x);
    mq_state_free(state);
    mq_gptq_results_free(&r);
    mq_calib_free(&cs);
    moeq_model_free(m);
    moeq_model_free(ref);
}

/* Fallback to RTN: the experts' results are exactly mq_quantize_rtn with the fused scale. */
static void test_fallback_rtn(void) {
    moeq_model *m = open_model("olmoe-tiny"), *ref = open_model("olmoe-tiny");
    mq_calib_set cs;
    load_calib(m, 4, 64, &cs);
    mq_qspec spec = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_model_opts o;
    mq_gptq_model_opts_init(&o, &spec);
    o.fallback = MQ_FALLBACK_RTN;
    o.min_expert_tokens = 1000000;   /* every expert */
    mq_gptq_results r;
    ASSERT_OK(mq_gptq_model(m, &cs, &o, &r));
    check_run(m, &r, &cs, &o);
    for (int l = 0; l < ref->cfg.n_layers; l++)
        for (int e = 0; e < ref->cfg.n_experts; e++) {
            const mq_linear *g = &ref->layers[l].exp_gate[e], *u = &ref->layers[l].exp_up[e];
            float amax = fmaxf(mq_absmax(g->w, g->out * g->in), mq_absmax(u->w, u->out * u->in));
            mq_qtensor q;
            ASSERT_OK(mq_quantize_rtn(&o.spec, u->w, u->out, u->in, mq_nvfp4_global_scale(&spec, amax), "u", &q));
            const mq_gptq_result *x = mq_gptq_results_find(&r, u->name);
            ASSERT_EQ_INT(0, count_diff(q.codes, x->q.codes, u->out * u->in));
            ASSERT_TRUE(isnan(x->stats.loss));
            mq_qtensor_free(&q);
        }
    mq_gptq_results_free(&r);
    mq_calib_free(&cs);
    moeq_model_free(m);
    moeq_model_free(ref);
}

static void test_nonsequential(void) {
    moeq_model *a = open_model("olmoe-tiny"), *b = open_model("olmoe-tiny");
    mq_calib_set cs;
    load_calib(a, 4, 64, &cs);
    mq_qspec spec = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_model_opts o;
    mq_gptq_model_opts_init(&o, &spec);
    mq_gptq_results rs, rn;
    ASSERT_OK(mq_gptq_model(a, &cs, &o, &rs));
    o.mode = MQ_GPTQ_NONSEQUENTIAL;
    ASSERT_OK(mq_gptq_model(b, &cs, &o, &rn));
    check_run(b, &rn, &cs, &o);
    int64_t later_diff = 0;
    for (int64_t i = 0; i < rs.n; i++) {
        const mq_gptq_result *x = &rs.r[i], *y = mq_gptq_results_find(&rn, x->module);
        int64_t d = count_diff(x->q.codes, y->q.codes, x->q.rows * x->q.cols);
        if (x->layer == 0) ASSERT_EQ_INT(0, d);   /* the same inputs in both modes */
        else later_diff += d;
    }
    ASSERT_TRUE(later_diff > 0);
    mq_gptq_results_free(&rs);
    mq_gptq_results_free(&rn);
    mq_calib_free(&cs);
    moeq_model_free(a);
    moeq_model_free(b);
}

/* True-sequential: a block's attention is the same as in plain sequential mode (same inputs), its
 * experts are calibrated on the quantized attention's output, so some differ. */
static void test_true_sequential(void) {
    moeq_model *a = open_model("olmoe-tiny"), *b = open_model("olmoe-tiny");
    mq_calib_set cs;
    load_calib(a, 4, 64, &cs);
    mq_qspec spec = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_model_opts o;
    mq_gptq_model_opts_init(&o, &spec);
    o.spec.mse = false;
    mq_gptq_results rs, rt;
    ASSERT_OK(mq_gptq_model(a, &cs, &o, &rs));
    o.true_sequential = true;
    ASSERT_OK(mq_gptq_model(b, &cs, &o, &rt));
    check_run(b, &rt, &cs, &o);
    check_weights(b, &rt);
    int64_t mlp_diff = 0;
    for (int64_t i = 0; i < rs.n; i++) {
        const mq_gptq_result *x = &rs.r[i], *y = mq_gptq_results_find(&rt, x->module);
        int64_t d = count_diff(x->q.codes, y->q.codes, x->q.rows * x->q.cols);
        if (x->layer == 0 && strstr(x->module, "self_attn")) ASSERT_EQ_INT(0, d);
        if (x->layer == 0 && !strstr(x->module, "self_attn")) mlp_diff += d;
    }
    ASSERT_TRUE(mlp_diff > 0);
    mq_gptq_results_free(&rs);
    mq_gptq_results_free(&rt);
    mq_calib_free(&cs);
    moeq_model_free(a);
    moeq_model_free(b);
}

/* qwen2_moe: shared expert (all tokens), q/k/v bias, renormalised top-k; INT4 with g_idx. */
static void test_qwen2moe_int4_gidx(void) {
    moeq_model *m = open_model("qwen2moe-tiny");
    mq_calib_set cs;
    load_calib(m, 6, 64, &cs);
    mq_qspec spec = mq_qspec_default(MQ_QS_INT4);
    spec.group_size = 64;
    mq_gptq_model_opts o;
    mq_gptq_model_opts_init(&o, &spec);
    o.gptq.act_order = true;
    o.gptq.groups = MQ_GPTQ_GROUPS_GIDX;
    mq_gptq_results r;
    ASSERT_OK(mq_gptq_model(m, &cs, &o, &r));
    check_run(m, &r, &cs, &o);
    const mq_gptq_result *sh = mq_gptq_results_find(&r, "model.layers.1.mlp.shared_expert.down_proj");
    ASSERT_TRUE(sh != NULL);
    ASSERT_EQ_INT(cs.total, sh->tokens);
    ASSERT_TRUE(sh->q.g_idx != NULL);
    mq_gptq_results_free(&r);
    mq_calib_free(&cs);
    moeq_model_free(m);
}

TEST_MAIN(T(test_olmoe_nvfp4_sequential), T(test_layer0_hessians_independent), T(test_fallback_rtn),
          T(test_nonsequential), T(test_true_sequential), T(test_qwen2moe_int4_gidx))
