/*
 * GPTQ over whole tiny MoE models through the pipeline (moeq's `quantize --method gptq`), checked
 * from what it writes: the checkpoint's codes against GPTQ on Hessians collected here with our
 * own hooks and summed in double; the report's token counts per expert, the expert fallback and
 * GPTQ loss <= RTN loss for every weight; fused global scales; round-to-nearest fallbacks equal
 * to mq_quantize_rtn; sequential vs nonsequential vs true-sequential.
 */
#include <cjson/cJSON.h>
#include <stdlib.h>

#include "export/layout.h"
#include "harness.h"
#include "model/model.h"
#include "pipeline/pipeline.h"

static moeq_model *open_model(const char *name) {
    return mq_test_open_model(mq_test_model(name), NULL);
}

static int64_t count_diff(const uint8_t *a, const uint8_t *b, int64_t n) {
    int64_t d = 0;
    for (int64_t i = 0; i < n; i++) d += a[i] != b[i];
    return d;
}

typedef struct {
    char out[1100], report[1200];
    mq_st *st;
    cJSON *rep;
    mq_pipeline_result res;
} run;

static void gptq_opts(mq_pipeline_opts *o, mq_qscheme scheme, int64_t nsamples, int64_t seqlen) {
    mq_pipeline_opts_init(o, scheme, MQ_FMT_CT);
    o->gptq = true;
    o->spec.mse = true;
    o->g.mse_weight = MQ_GPTQ_MSE_LOOP;
    o->g.act_order = scheme == MQ_QS_INT4;
    o->calib.path = mq_test_calib_text();
    o->calib.nsamples = nsamples;
    o->calib.seqlen = seqlen;
}

static void run_gptq(const char *model, mq_pipeline_opts *o, run *r) {
    snprintf(r->out, sizeof r->out, "%s/q", mq_test_tmpdir());
    snprintf(r->report, sizeof r->report, "%s/report.json", mq_test_tmpdir());
    o->report_path = r->report;
    ASSERT_OK(mq_pipeline_run(mq_test_model(model), r->out, o, &r->res));
    ASSERT_OK(mq_st_open_dir(r->out, &r->st));
    char *text;
    size_t len;
    ASSERT_OK(mq_read_file(r->report, &text, &len));
    r->rep = cJSON_ParseWithLength(text, len);
    free(text);
    ASSERT_TRUE(r->rep != NULL);
}

static void run_free(run *r) {
    mq_st_close(r->st);
    cJSON_Delete(r->rep);
}

static const mq_tensor_view *st_lookup(void *user, const char *name) { return mq_st_find(user, name); }

static void read_q(const run *r, const mq_linear *l, mq_qtensor *q) {
    ASSERT_OK(mq_layout_read(l->name, l->out, l->in, st_lookup, r->st, q));
}

static const cJSON *mod(const run *r, const char *name) {
    const cJSON *m;
    cJSON_ArrayForEach(m, cJSON_GetObjectItemCaseSensitive(r->rep, "modules")) {
        if (strcmp(cJSON_GetObjectItemCaseSensitive(m, "module")->valuestring, name) == 0) return m;
    }
    FAIL("the report has no module %s", name);
    return NULL;
}

static double num(const cJSON *m, const char *k) {
    return cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(m, k));
}

/* Checks shared by every run: one record per Linear, tokens, methods, losses. */
static void check_run(const moeq_model *m, const run *r, const mq_pipeline_opts *o) {
    const mq_config *c = &m->cfg;
    int64_t want = 0;
    for (int l = 0; l < c->n_layers; l++)
        want += 4 + (m->layers[l].is_moe ? 3 * c->n_experts + (c->shared_ffn ? 3 : 0) : 3);
    const cJSON *mods = cJSON_GetObjectItemCaseSensitive(r->rep, "modules");
    ASSERT_EQ_INT(want, cJSON_GetArraySize(mods));
    int64_t expert_tokens[64] = {0};
    const cJSON *x;
    cJSON_ArrayForEach(x, mods) {
        const char *name = cJSON_GetObjectItemCaseSensitive(x, "module")->valuestring;
        const char *how = cJSON_GetObjectItemCaseSensitive(x, "method")->valuestring;
        const cJSON *ex = cJSON_GetObjectItemCaseSensitive(x, "expert");
        int64_t tokens = (int64_t)num(x, "tokens");
        int layer = (int)num(x, "layer");
        if (strcmp(how, "rtn") != 0 && !(num(x, "loss") <= num(x, "rtn_loss")))
            FAIL("%s: GPTQ loss %g > RTN loss %g", name, num(x, "loss"), num(x, "rtn_loss"));
        if (!ex) ASSERT_EQ_INT(r->res.tokens, tokens);
        else if (strstr(name, "gate_proj")) expert_tokens[layer] += tokens;
        if (ex && tokens < o->min_expert_tokens)
            ASSERT_EQ_STR(o->fallback_rtn ? "rtn" : "gptq-block-hessian", how);
        else
            ASSERT_EQ_STR("gptq", how);
    }
    for (int l = 0; l < c->n_layers; l++)
        if (m->layers[l].is_moe) ASSERT_EQ_INT(c->top_k * r->res.tokens, expert_tokens[l]);
}

/* Fused groups share one NVFP4 global scale in the checkpoint. */
static void check_fused(const moeq_model *m, const run *r) {
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const mq_layer *ly = &m->layers[l];
        mq_qtensor a, b;
        const mq_linear *qkv[3] = {&ly->q, &ly->k, &ly->v};
        read_q(r, qkv[0], &a);
        for (int i = 1; i < 3; i++) {
            read_q(r, qkv[i], &b);
            ASSERT_TRUE(a.global_scale == b.global_scale);
            mq_qtensor_free(&b);
        }
        mq_qtensor_free(&a);
        for (int e = 0; ly->is_moe && e < m->cfg.n_experts; e++) {
            read_q(r, &ly->exp_gate[e], &a);
            read_q(r, &ly->exp_up[e], &b);
            ASSERT_TRUE(a.global_scale == b.global_scale);
            mq_qtensor_free(&a);
            mq_qtensor_free(&b);
        }
    }
}

static void test_olmoe_nvfp4_sequential(void) {
    moeq_model *m = open_model("olmoe-tiny");
    mq_pipeline_opts o;
    gptq_opts(&o, MQ_QS_NVFP4, 8, 64);
    run r;
    run_gptq("olmoe-tiny", &o, &r);
    ASSERT_EQ_INT(512, r.res.tokens);
    check_run(m, &r, &o);
    check_fused(m, &r);
    ASSERT_TRUE(r.res.fallbacks > 0);   /* 512 tokens leave some of the 32 experts without tokens */
    ASSERT_EQ_INT(0, r.res.worse_than_rtn);
    const cJSON *sum = cJSON_GetObjectItemCaseSensitive(r.rep, "summary");
    ASSERT_EQ_INT(r.res.fallbacks, (int64_t)num(sum, "expert_fallbacks"));
    ASSERT_EQ_INT(0, (int64_t)num(sum, "modules_worse_than_rtn"));
    /* a line per layer: seconds and peak memory */
    const cJSON *layers = cJSON_GetObjectItemCaseSensitive(r.rep, "layers");
    ASSERT_EQ_INT(4, cJSON_GetArraySize(layers));
    ASSERT_TRUE(num(cJSON_GetArrayItem(layers, 3), "peak_anon_bytes") > 0);
    run_free(&r);
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

static void check_module(const run *r, const mq_linear *l, const ref_hess *h, int i,
                         const mq_qspec *spec, const mq_gptq_opts *go) {
    const int64_t K = h->K[i];
    float *H = malloc((size_t)(K * K) * sizeof(float));
    for (int64_t k = 0; k < K * K; k++) H[k] = (float)(2.0 * h->sum[i][k] / (double)h->n[i]);
    mq_qtensor x;
    read_q(r, l, &x);
    ASSERT_EQ_INT(h->n[i], (int64_t)num(mod(r, l->name), "tokens"));
    mq_qtensor q;
    mq_gptq_stats st;
    ASSERT_OK(mq_gptq_quantize(spec, go, H, l->w, l->out, l->in, x.global_scale, l->name, &q,
                               NULL, &st));
    int64_t d = count_diff(q.codes, x.codes, l->out * l->in);
    if (d > l->out * l->in / 200)
        FAIL("%s: %lld of %lld codes differ from GPTQ on the independently built Hessian", l->name,
             (long long)d, (long long)(l->out * l->in));
    ASSERT_REL(st.loss, num(mod(r, l->name), "loss"), 0.02);
    mq_qtensor_free(&q);
    mq_qtensor_free(&x);
    free(H);
}

static void test_layer0_hessians_independent(void) {
    moeq_model *ref = open_model("olmoe-tiny");
    mq_pipeline_opts o;
    gptq_opts(&o, MQ_QS_NVFP4, 6, 64);
    o.g.act_order = true;
    mq_calib_set cs;
    ASSERT_OK(mq_calib_load(moeq_model_tokenizer(ref), &o.calib, &cs));
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
    run r;
    run_gptq("olmoe-tiny", &o, &r);
    const mq_layer *ly = &ref->layers[0];
    check_module(&r, &ly->q, &h, 0, &o.spec, &o.g);
    check_module(&r, &ly->v, &h, 0, &o.spec, &o.g);
    check_module(&r, &ly->exp_up[3], &h, 1, &o.spec, &o.g);
    check_module(&r, &ly->exp_down[3], &h, 2, &o.spec, &o.g);
    for (int i = 0; i < 3; i++) free(h.sum[i]);
    free(x);
    mq_state_free(state);
    run_free(&r);
    mq_calib_free(&cs);
    moeq_model_free(ref);
}

/* Fallback to RTN: the experts' codes are exactly mq_quantize_rtn with the fused scale. */
static void test_fallback_rtn(void) {
    moeq_model *ref = open_model("olmoe-tiny");
    mq_pipeline_opts o;
    gptq_opts(&o, MQ_QS_NVFP4, 4, 64);
    o.fallback_rtn = true;
    o.min_expert_tokens = 1000000;   /* every expert */
    run r;
    run_gptq("olmoe-tiny", &o, &r);
    check_run(ref, &r, &o);
    for (int l = 0; l < ref->cfg.n_layers; l++)
        for (int e = 0; e < ref->cfg.n_experts; e++) {
            const mq_linear *g = &ref->layers[l].exp_gate[e], *u = &ref->layers[l].exp_up[e];
            float amax = fmaxf(mq_absmax(g->w, g->out * g->in), mq_absmax(u->w, u->out * u->in));
            mq_qtensor q, x;
            ASSERT_OK(mq_quantize_rtn(&o.spec, u->w, u->out, u->in, mq_nvfp4_global_scale(&o.spec, amax), "u", &q));
            read_q(&r, u, &x);
            ASSERT_EQ_INT(0, count_diff(q.codes, x.codes, u->out * u->in));
            ASSERT_TRUE(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(mod(&r, u->name), "loss")));
            mq_qtensor_free(&q);
            mq_qtensor_free(&x);
        }
    run_free(&r);
    moeq_model_free(ref);
}

/* Codes of every decoder Linear that differ between two runs: of layer 0, and of the rest. */
static void diff_runs(const moeq_model *m, const run *a, const run *b, int64_t *l0_attn,
                      int64_t *l0_ffn, int64_t *later) {
    *l0_attn = *l0_ffn = *later = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const mq_layer *ly = &m->layers[l];
        const mq_linear *ls[4 + 3 * 64];
        int n = 0;
        ls[n++] = &ly->q, ls[n++] = &ly->k, ls[n++] = &ly->v, ls[n++] = &ly->o;
        for (int e = 0; e < m->cfg.n_experts; e++)
            ls[n++] = &ly->exp_gate[e], ls[n++] = &ly->exp_up[e], ls[n++] = &ly->exp_down[e];
        for (int i = 0; i < n; i++) {
            mq_qtensor x, y;
            read_q(a, ls[i], &x);
            read_q(b, ls[i], &y);
            int64_t d = count_diff(x.codes, y.codes, x.rows * x.cols);
            *(l > 0 ? later : i < 4 ? l0_attn : l0_ffn) += d;
            mq_qtensor_free(&x);
            mq_qtensor_free(&y);
        }
    }
}

static void test_nonsequential(void) {
    moeq_model *m = open_model("olmoe-tiny");
    mq_pipeline_opts o;
    gptq_opts(&o, MQ_QS_NVFP4, 4, 64);
    run rs, rn;
    run_gptq("olmoe-tiny", &o, &rs);
    o.sequential = false;
    run_gptq("olmoe-tiny", &o, &rn);
    check_run(m, &rn, &o);
    int64_t a, f, later;
    diff_runs(m, &rs, &rn, &a, &f, &later);
    ASSERT_EQ_INT(0, a + f);   /* layer 0: the same inputs in both modes */
    ASSERT_TRUE(later > 0);
    run_free(&rs);
    run_free(&rn);
    moeq_model_free(m);
}

/* True-sequential: a block's attention is the same as in plain sequential mode (same inputs), its
 * experts are calibrated on the quantized attention's output, so some differ. */
static void test_true_sequential(void) {
    moeq_model *m = open_model("olmoe-tiny");
    mq_pipeline_opts o;
    gptq_opts(&o, MQ_QS_NVFP4, 4, 64);
    o.spec.mse = false;
    run rs, rt;
    run_gptq("olmoe-tiny", &o, &rs);
    o.true_sequential = true;
    run_gptq("olmoe-tiny", &o, &rt);
    check_run(m, &rt, &o);
    check_fused(m, &rt);
    int64_t a, f, later;
    diff_runs(m, &rs, &rt, &a, &f, &later);
    ASSERT_EQ_INT(0, a);
    ASSERT_TRUE(f > 0);
    run_free(&rs);
    run_free(&rt);
    moeq_model_free(m);
}

/* qwen2_moe: shared expert (all tokens), q/k/v bias, renormalised top-k; INT4 with g_idx, which
 * every quantized Linear carries (also round-to-nearest fallbacks, with the identity). */
static void test_qwen2moe_int4_gidx(void) {
    moeq_model *m = open_model("qwen2moe-tiny");
    mq_pipeline_opts o;
    gptq_opts(&o, MQ_QS_INT4, 6, 64);
    o.spec.group_size = 64;
    o.g.act_order = true;
    o.g.groups = MQ_GPTQ_GROUPS_GIDX;
    o.fallback_rtn = true;
    run r;
    run_gptq("qwen2moe-tiny", &o, &r);
    check_run(m, &r, &o);
    ASSERT_EQ_INT(r.res.tokens, (int64_t)num(mod(&r, "model.layers.1.mlp.shared_expert.down_proj"), "tokens"));
    ASSERT_TRUE(r.res.fallbacks > 0);
    for (int l = 0; l < m->cfg.n_layers; l++)
        for (int e = 0; e < m->cfg.n_experts; e++) {
            char name[160];
            snprintf(name, sizeof name, "%s.weight_g_idx", m->layers[l].exp_down[e].name);
            ASSERT_TRUE(mq_st_find(r.st, name) != NULL);
        }
    run_free(&r);
    moeq_model_free(m);
}

TEST_MAIN(T(test_olmoe_nvfp4_sequential), T(test_layer0_hessians_independent), T(test_fallback_rtn),
          T(test_nonsequential), T(test_true_sequential), T(test_qwen2moe_int4_gidx))
