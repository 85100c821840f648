/* quantize -> write -> moeq_model_open: every Linear of the loaded model is bit-identical to the
 * in-memory RTN fake quantization of the source weight (with the global scale the writer chose),
 * every unquantized tensor is the source's, and the forward pass runs. One case per format. */
#include <stdlib.h>

#include "pipeline/pipeline.h"
#include "harness.h"
#include "model/model.h"

/* The shared fixture model, or the bundled copy (olmoe-tiny) without the shared folder. */
static const char *fixture(const char *model) {
    static char buf[1024];
    snprintf(buf, sizeof buf, "%s", mq_test_model(model));
    return buf;
}

typedef struct {
    const mq_linear *v[1024];
    int n;
} linears;

static void collect(const moeq_model *m, linears *L) {
    L->n = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const mq_layer *ly = &m->layers[l];
        L->v[L->n++] = &ly->q;
        L->v[L->n++] = &ly->k;
        L->v[L->n++] = &ly->v;
        L->v[L->n++] = &ly->o;
        if (!ly->is_moe) {
            L->v[L->n++] = &ly->gate;
            L->v[L->n++] = &ly->up;
            L->v[L->n++] = &ly->down;
            continue;
        }
        for (int e = 0; e < m->cfg.n_experts; e++) {
            L->v[L->n++] = &ly->exp_gate[e];
            L->v[L->n++] = &ly->exp_up[e];
            L->v[L->n++] = &ly->exp_down[e];
        }
        if (m->cfg.shared_ffn > 0) {
            L->v[L->n++] = &ly->sh_gate;
            L->v[L->n++] = &ly->sh_up;
            L->v[L->n++] = &ly->sh_down;
        }
    }
}

/* The NVFP4 global scale the writer stored for a module (1 for INT4). */
static float stored_global(const mq_st *st, const char *module, mq_ckpt_format fmt) {
    char name[512];
    snprintf(name, sizeof name, "%s.%s", module,
             fmt == MQ_FMT_CT ? "weight_global_scale" : "weight_scale_2");
    const mq_tensor_view *t = mq_st_find(st, name);
    float g = 1.0f;
    if (t) memcpy(&g, t->data, 4);
    return g;
}

static void check_model(const char *src_dir, const mq_pipeline_opts *o, const char *tag) {
    char out[1024];
    snprintf(out, sizeof out, "%s/%s", mq_test_tmpdir(), tag);
    ASSERT_OK(mq_pipeline_run(src_dir, out, o, NULL));
    moeq_model *src = NULL, *q = NULL;
    moeq_model_options mo = {0};
    mo.no_tokenizer = 1;
    ASSERT_OK(moeq_model_open(src_dir, &mo, &src));
    ASSERT_OK(moeq_model_open(out, &mo, &q));
    if (!src || !q) return;
    ASSERT_TRUE(moeq_model_get_info(q)->quant_scheme != NULL);
    mq_st *st;
    ASSERT_OK(mq_st_open_dir(out, &st));
    linears a, b;
    collect(src, &a);
    collect(q, &b);
    ASSERT_EQ_INT(a.n, b.n);
    int checked = 0;
    for (int i = 0; i < a.n && i < b.n; i++) {
        const mq_linear *ls = a.v[i], *lq = b.v[i];
        ASSERT_EQ_STR(ls->name, lq->name);
        size_t n = (size_t)(ls->out * ls->in);
        mq_qtensor t;
        ASSERT_OK(mq_quantize_rtn(&o->spec, ls->w, ls->out, ls->in,
                                  stored_global(st, ls->name, o->format), ls->name, &t));
        float *d = malloc(n * sizeof(float));
        mq_dequantize(&t, d);
        if (memcmp(d, lq->w, n * sizeof(float)) != 0) FAIL("%s: %s differs from in-memory RTN", tag, ls->name);
        else checked++;
        if (ls->bias && (!lq->bias || memcmp(ls->bias, lq->bias, (size_t)ls->out * 4) != 0))
            FAIL("%s: %s bias differs", tag, ls->name);
        mq_qtensor_free(&t);
        free(d);
    }
    ASSERT_EQ_INT(a.n, checked);
    /* unquantized parts are the source's */
    size_t VD = (size_t)src->cfg.vocab * (size_t)src->cfg.D;
    ASSERT_TRUE(memcmp(src->embed, q->embed, VD * 4) == 0);
    ASSERT_TRUE(memcmp(src->lm_head, q->lm_head, VD * 4) == 0);
    for (int l = 0; l < src->cfg.n_layers; l++)
        if (src->layers[l].is_moe)
            ASSERT_TRUE(memcmp(src->layers[l].router, q->layers[l].router,
                               (size_t)src->cfg.n_experts * (size_t)src->cfg.D * 4) == 0);
    /* and it runs */
    moeq_session *s;
    ASSERT_OK(moeq_session_create(q, 8, &s));
    int32_t ids[4] = {5, 17, 300, 42};
    float *logits = malloc(sizeof(float) * 4 * (size_t)q->cfg.vocab);
    ASSERT_OK(moeq_session_forward(s, ids, 4, logits));
    for (int64_t i = 0; i < 4 * (int64_t)q->cfg.vocab; i++)
        if (!isfinite(logits[i])) {
            FAIL("%s: non-finite logit", tag);
            break;
        }
    free(logits);
    moeq_session_free(s);
    mq_st_close(st);
    moeq_model_free(src);
    moeq_model_free(q);
}

static void test_ct_nvfp4_olmoe(void) {
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_CT);
    check_model(fixture("olmoe-tiny"), &o, "olmoe-ct-nvfp4");
}

static void test_modelopt_nvfp4_qwen2moe(void) {
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_MODELOPT);
    o.spec.mse = true;
    check_model(fixture("qwen2moe-tiny"), &o, "qwen2moe-modelopt");
}

static void test_ct_int4_asym_qwen2moe(void) {
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_INT4, MQ_FMT_CT);
    o.spec.group_size = 64;
    o.spec.asym = true;
    check_model(fixture("qwen2moe-tiny"), &o, "qwen2moe-ct-int4");
}

static void test_gptq_llama(void) {
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_INT4, MQ_FMT_GPTQ);
    o.spec.group_size = 32;
    check_model(fixture("llama-tiny"), &o, "llama-gptq");
}

static void test_fused_mixtral(void) {
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_CT);
    check_model(mq_test_repo("tests/data/mixtral-tiny-fused"), &o, "mixtral-fused");
    mq_pipeline_opts_init(&o, MQ_QS_INT4, MQ_FMT_CT);
    o.spec.group_size = 16;   /* expert width 48 */
    check_model(mq_test_repo("tests/data/qwen2moe-dense-tiny-fused"), &o, "qwen2moe-dense-fused");
}

/* W4A4 activation scales: the checkpoint's input_global_scale of each Linear is 2688 / the
 * absolute max of its input over the calibration tokens, as an independent hooked forward of the
 * whole model sees them; experts that saw no token take the layer's largest. */
typedef struct {
    float qkv0, o0, exp_seen[8], down_seen[8];
    int calls;
} raw;
static void raw_hook(void *user, int layer, mq_site site, int expert, const float *x, int64_t rows,
                     int64_t cols) {
    raw *r = user;
    r->calls++;
    if (layer != 1 || rows == 0) return;
    if (site == MQ_SITE_QKV) r->qkv0 = fmaxf(r->qkv0, mq_absmax(x, rows * cols));
    if (site == MQ_SITE_O) r->o0 = fmaxf(r->o0, mq_absmax(x, rows * cols));
    if (site == MQ_SITE_EXPERT) r->exp_seen[expert] = fmaxf(r->exp_seen[expert], mq_absmax(x, rows * cols));
    if (site == MQ_SITE_EXPERT_DOWN)
        r->down_seen[expert] = fmaxf(r->down_seen[expert], mq_absmax(x, rows * cols));
}

static float scale_of(const mq_st *st, const char *module) {
    char name[200];
    snprintf(name, sizeof name, "%s.input_global_scale", module);
    const mq_tensor_view *t = mq_st_find(st, name);
    float v = NAN;
    if (t && t->dtype == MOEQ_DT_F32 && t->nbytes == 4) memcpy(&v, t->data, 4);
    return v;
}

static void test_activation_amax(void) {
    moeq_model *m;
    ASSERT_OK(moeq_model_open(fixture("olmoe-tiny"), NULL, &m));
    if (!m) return;
    /* 40 calibration tokens: the pipeline runs them as one sample */
    char path[1024];
    snprintf(path, sizeof path, "%s/amax-calib.txt", mq_test_tmpdir());
    const char *text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the "
                       "warm mat beside the old fire, and nobody in the quiet house notices any of it.";
    ASSERT_OK(mq_write_file_atomic(path, text, strlen(text)));
    int32_t *ids;
    size_t n_ids;
    ASSERT_OK(moeq_tokenizer_encode(moeq_model_tokenizer(m), text, strlen(text), &ids, &n_ids));
    ASSERT_TRUE(n_ids >= 40);
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_CT);
    o.act_quant = true;
    o.act_calib = path;
    o.act_calib_tokens = 40;
    char out[1100];
    snprintf(out, sizeof out, "%s/amax-out", mq_test_tmpdir());
    ASSERT_OK(mq_pipeline_run(fixture("olmoe-tiny"), out, &o, NULL));
    /* the independent pass, with the expert products the pipeline's calibration uses */
    mq_model_det_experts(m, true);
    raw r = {0};
    mq_state *st;
    ASSERT_OK(mq_state_new(m, 40, &st));
    float x[40 * 256];
    mq_hooks h = {raw_hook, &r};
    ASSERT_OK(mq_embed(m, ids, 40, x));
    ASSERT_OK(mq_forward_layers(m, st, x, 40, 0, 0, m->cfg.n_layers, &h));
    mq_state_free(st);
    moeq_model_free(m);
    free(ids);
    ASSERT_TRUE(r.calls > 0 && r.qkv0 > 0);
    mq_st *ck;
    ASSERT_OK(mq_st_open_dir(out, &ck));
    ASSERT_NEAR(2688.0f / r.qkv0, scale_of(ck, "model.layers.1.self_attn.q_proj"), 0);
    ASSERT_NEAR(2688.0f / r.qkv0, scale_of(ck, "model.layers.1.self_attn.v_proj"), 0);
    ASSERT_NEAR(2688.0f / r.o0, scale_of(ck, "model.layers.1.self_attn.o_proj"), 0);
    float mx = 0, mxd = 0;
    int unseen = 0;
    for (int e = 0; e < 8; e++) {
        mx = fmaxf(mx, r.exp_seen[e]);
        mxd = fmaxf(mxd, r.down_seen[e]);
        unseen += r.exp_seen[e] == 0;
    }
    ASSERT_TRUE(unseen > 0);   /* 40 tokens x top-2 leave experts out: the fallback is exercised */
    for (int e = 0; e < 8; e++) {
        char name[128];
        snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.up_proj", e);
        ASSERT_NEAR(2688.0f / (r.exp_seen[e] > 0 ? r.exp_seen[e] : mx), scale_of(ck, name), 0);
        snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.gate_proj", e);
        ASSERT_NEAR(2688.0f / (r.exp_seen[e] > 0 ? r.exp_seen[e] : mx), scale_of(ck, name), 0);
        snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.down_proj", e);
        ASSERT_NEAR(2688.0f / (r.down_seen[e] > 0 ? r.down_seen[e] : mxd), scale_of(ck, name), 0);
    }
    ASSERT_TRUE(isnan(scale_of(ck, "model.layers.1.mlp.gate")));   /* the router stays bf16 */
    mq_st_close(ck);
}

TEST_MAIN(T(test_activation_amax), T(test_ct_nvfp4_olmoe), T(test_modelopt_nvfp4_qwen2moe), T(test_ct_int4_asym_qwen2moe),
          T(test_gptq_llama), T(test_fused_mixtral))
