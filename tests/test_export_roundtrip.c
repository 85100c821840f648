/* quantize -> write -> moeq_model_open: every Linear of the loaded model is bit-identical to the
 * in-memory RTN fake quantization of the source weight (with the global scale the writer chose),
 * every unquantized tensor is the source's, and the forward pass runs. One case per format. */
#include <stdlib.h>

#include "export/act_amax.h"
#include "export/quantize.h"
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

static void check_model(const char *src_dir, const mq_quantize_opts *o, const char *tag) {
    char out[1024];
    snprintf(out, sizeof out, "%s/%s", mq_test_tmpdir(), tag);
    ASSERT_OK(mq_quantize_checkpoint(src_dir, out, o, NULL));
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
    mq_quantize_opts o;
    mq_quantize_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_CT);
    check_model(fixture("olmoe-tiny"), &o, "olmoe-ct-nvfp4");
}

static void test_modelopt_nvfp4_qwen2moe(void) {
    mq_quantize_opts o;
    mq_quantize_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_MODELOPT);
    o.spec.mse = true;
    check_model(fixture("qwen2moe-tiny"), &o, "qwen2moe-modelopt");
}

static void test_ct_int4_asym_qwen2moe(void) {
    mq_quantize_opts o;
    mq_quantize_opts_init(&o, MQ_QS_INT4, MQ_FMT_CT);
    o.spec.group_size = 64;
    o.spec.asym = true;
    check_model(fixture("qwen2moe-tiny"), &o, "qwen2moe-ct-int4");
}

static void test_gptq_llama(void) {
    mq_quantize_opts o;
    mq_quantize_opts_init(&o, MQ_QS_INT4, MQ_FMT_GPTQ);
    o.spec.group_size = 32;
    check_model(fixture("llama-tiny"), &o, "llama-gptq");
}

static void test_fused_mixtral(void) {
    mq_quantize_opts o;
    mq_quantize_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_CT);
    check_model(mq_test_repo("tests/data/mixtral-tiny-fused"), &o, "mixtral-fused");
    mq_quantize_opts_init(&o, MQ_QS_INT4, MQ_FMT_CT);
    o.spec.group_size = 16;   /* expert width 48 */
    check_model(mq_test_repo("tests/data/qwen2moe-dense-tiny-fused"), &o, "qwen2moe-dense-fused");
}

/* Calibration amax: one value per hook site, shared by the Linears that read it; experts with no
 * token take the layer's largest; the table outlives the model. */
typedef struct {
    float qkv0, exp_seen[8];
    int calls;
} raw;
static void raw_hook(void *user, int layer, mq_site site, int expert, const float *x, int64_t rows,
                     int64_t cols) {
    raw *r = user;
    r->calls++;
    if (layer != 1 || rows == 0) return;
    if (site == MQ_SITE_QKV) r->qkv0 = fmaxf(r->qkv0, mq_absmax(x, rows * cols));
    if (site == MQ_SITE_EXPERT) r->exp_seen[expert] = fmaxf(r->exp_seen[expert], mq_absmax(x, rows * cols));
}

static void test_activation_amax(void) {
    moeq_model *m;
    moeq_model_options mo = {0};
    mo.no_tokenizer = 1;
    ASSERT_OK(moeq_model_open(fixture("olmoe-tiny"), &mo, &m));
    if (!m) return;
    int32_t ids[40];
    for (int i = 0; i < 40; i++) ids[i] = (i * 97 + 11) % 4096;
    mq_act_amax *a;
    ASSERT_OK(mq_act_amax_collect(m, ids, 40, 16, &a));
    /* an independent pass over the same chunks, capturing the raw inputs */
    raw r = {0};
    mq_state *st;
    ASSERT_OK(mq_state_new(m, 16, &st));
    float x[16 * 256];
    mq_hooks h = {raw_hook, &r};
    for (int off = 0; off < 40; off += 16) {
        int T = 40 - off < 16 ? 40 - off : 16;
        ASSERT_OK(mq_embed(m, ids + off, T, x));
        ASSERT_OK(mq_forward_layers(m, st, x, T, 0, 0, m->cfg.n_layers, &h));
    }
    mq_state_free(st);
    moeq_model_free(m);   /* lookups work after the model is gone */
    ASSERT_TRUE(r.calls > 0);
    ASSERT_TRUE(r.qkv0 > 0);
    ASSERT_NEAR(r.qkv0, mq_act_amax_get(a, "model.layers.1.self_attn.q_proj"), 0);
    ASSERT_NEAR(r.qkv0, mq_act_amax_get(a, "model.layers.1.self_attn.v_proj"), 0);
    float mx = 0;
    for (int e = 0; e < 8; e++) mx = fmaxf(mx, r.exp_seen[e]);
    for (int e = 0; e < 8; e++) {
        char name[128];
        snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.up_proj", e);
        ASSERT_NEAR(r.exp_seen[e] > 0 ? r.exp_seen[e] : mx, mq_act_amax_get(a, name), 0);
        snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.gate_proj", e);
        ASSERT_NEAR(r.exp_seen[e] > 0 ? r.exp_seen[e] : mx, mq_act_amax_get(a, name), 0);
    }
    ASSERT_NEAR(0, mq_act_amax_get(a, "model.layers.1.mlp.gate"), 0);
    mq_act_amax_free(a);
}

TEST_MAIN(T(test_activation_amax), T(test_ct_nvfp4_olmoe), T(test_modelopt_nvfp4_qwen2moe), T(test_ct_int4_asym_qwen2moe),
          T(test_gptq_llama), T(test_fused_mixtral))
