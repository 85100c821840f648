/*
 * The packed runtime (moeq_model_options.keep_packed) against the dequantized fp32 path of the
 * same checkpoint. Checkpoints are written here by the quantize driver (round to nearest) from
 * the fixture models: olmoe-tiny, qwen2moe-tiny and llama-tiny in NVFP4 and INT4 g32/g128
 * (compressed-tensors), qwen2moe in ModelOpt NVFP4. Checked:
 *  - logits of a prefill plus single-token decode steps: max|packed - fp32| / max|fp32| < 2.5e-4
 *    (the kernels quantize activations to int16-split blocks, ~86 dB per op; measured 2.4e-5 ..
 *    5.7e-5 on these models) and greedy generation gives the same tokens;
 *  - packed logits are bit-identical for 1 and 2 threads;
 *  - resident bytes: the fp32 figure is 4 bytes per parameter of the config, the packed one the
 *    unquantized tensors plus 4.5 bits (NVFP4, INT4 g32 with BF16 scales) or 4.125 bits (INT4
 *    g128) per quantized weight, up to row-block padding;
 *  - fallbacks: an asymmetric INT4 checkpoint runs entirely dequantized (bit-identical to the
 *    fp32 path) with an info log naming the tensors and layers; a checkpoint with one asymmetric
 *    attention tensor and one asymmetric expert keeps only that tensor and that MoE layer in
 *    fp32; a GPTQ checkpoint with one act-order (g_idx) tensor keeps that tensor in fp32;
 *  - calibration hooks are refused on a packed model, act_quant disables packing;
 *  - wikitext word perplexity (2 documents, 9372 tokens) of packed vs dequantized within 1e-4
 *    relative (measured 1.5e-7 here; over 8 documents up to 1.9e-5, INT4 g32, where a single
 *    token whose expert choice flips at a near-tie dominates), and bit-identical for 1 and 2
 *    threads.
 */
#include <stdlib.h>

#include "export/layout.h"
#include "harness.h"
#include "kernels/ggml_mat.h"
#include "pipeline/pipeline.h"
#include "model/model.h"

static const char *fixture(const char *model) {
    static char buf[1024];
    snprintf(buf, sizeof buf, "%s", mq_test_model(model));
    return buf;
}

/* ---- checkpoints -------------------------------------------------------------------------- */
typedef struct {
    const char *asym_module;     /* this module (exact name) quantized asymmetric INT4 */
    const char *act_order_module;   /* this module with interleaved act-order groups */
    bool signed_scales;          /* the whole checkpoint with signed INT4 scales (some negative) */
} step_cfg;

/* RTN, except the modules named in step_cfg. An act-order tensor gets g_idx[c] = c % G: each
 * group still holds group_size columns, and its params come from exactly those columns. */
static moeq_status step(void *user, const char *module, const float *w, int64_t rows, int64_t cols,
                        const mq_qspec *spec, float global_scale, mq_qtensor *out) {
    const step_cfg *sc = user;
    mq_qspec s = *spec;
    if (sc->asym_module && !strcmp(module, sc->asym_module)) s.asym = true;
    if (!sc->act_order_module || strcmp(module, sc->act_order_module) != 0)
        return mq_quantize_rtn(&s, w, rows, cols, global_scale, module, out);
    moeq_status st = mq_qtensor_init(out, &s, rows, cols, module);
    if (st) return st;
    int64_t G = out->n_groups, gs = out->group_size;
    out->g_idx = mq_alloc_array((size_t)cols, 4, "g_idx");
    float *tmp = malloc(sizeof(float) * (size_t)gs);
    if (!out->g_idx || !tmp) return MOEQ_E_NOMEM;
    for (int64_t c = 0; c < cols; c++) out->g_idx[c] = (int32_t)(c % G);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < G; g++) {
            for (int64_t i = 0; i < gs; i++) tmp[i] = w[r * cols + g + i * G];
            mq_group_params(&s, out->global_scale, tmp, gs, 1, &out->params[r * G + g]);
        }
        for (int64_t c = 0; c < cols; c++)
            out->codes[r * cols + c] = mq_quant_value(&s, out->global_scale,
                                                      &out->params[r * G + c % G], w[r * cols + c]);
    }
    free(tmp);
    return MOEQ_OK;
}

static moeq_status add_emitted(void *user, const char *name, moeq_dtype dtype, int ndim,
                               const int64_t *shape, void *data, size_t nbytes) {
    return mq_stw_add_owned(user, name, dtype, ndim, shape, data, nbytes);
}

/* Rewrites the one-shard checkpoint in dir with `module` quantized by step() instead of RTN
 * (the layouts the runtime must recognise and fall back on). */
static void restep(const char *src_dir, const char *dir, const char *module, const mq_pipeline_opts *q,
                   const step_cfg *sc) {
    char path[1200], wname[300];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    snprintf(wname, sizeof wname, "%s.weight", module);
    mq_st *src, *ck;
    ASSERT_OK(mq_st_open_dir(src_dir, &src));
    ASSERT_OK(mq_st_open_file(path, &ck));
    const mq_tensor_view *t = mq_st_find(src, wname);
    ASSERT_TRUE(t != NULL && t->ndim == 2);
    float *w = malloc(sizeof(float) * (size_t)t->numel);
    ASSERT_OK(mq_tensor_to_f32(t, w));
    mq_qtensor qt;
    ASSERT_OK(step((void *)sc, module, w, t->shape[0], t->shape[1], &q->spec, 1.0f, &qt));
    free(w);
    mq_st_writer *wr = mq_stw_new();
    size_t plen = strlen(module);
    for (size_t i = 0; i < mq_st_count(ck); i++) {
        const mq_tensor_view *v = mq_st_at(ck, i);
        const char *suffix = v->name + plen + 1;   /* the module's weight tensors go, its bias stays */
        if (strncmp(v->name, module, plen) == 0 && v->name[plen] == '.' &&
            (mq_layout_is_quant_suffix(suffix) || strcmp(suffix, "weight") == 0))
            continue;
        ASSERT_OK(mq_stw_add(wr, v->name, v->dtype, v->ndim, v->shape, v->data, v->nbytes));
    }
    ASSERT_OK(mq_layout_emit(q->format, module, &qt, 0, add_emitted, wr));
    mq_qtensor_free(&qt);
    mq_st_close(ck);
    mq_st_close(src);
    ASSERT_OK(mq_stw_write(wr, path));
    mq_stw_free(wr);
}

/* Writes (once per test run) fixture `model` quantized with scheme/group/format under a tag;
 * with sc, the modules it names are rewritten by step(). */
static const char *checkpoint(const char *model, mq_qscheme scheme, int group, mq_ckpt_format fmt,
                              const step_cfg *sc, const char *tag) {
    static char out[8][1024];
    static int next;
    char *o = out[next++ % 8];
    snprintf(o, 1024, "%s/%s-%s", mq_test_tmpdir(), model, tag);
    mq_pipeline_opts q;
    mq_pipeline_opts_init(&q, scheme, fmt);
    if (group) q.spec.group_size = group;
    if (sc && sc->signed_scales) q.spec.int4_signed_scale = true;
    q.force = true;
    char src[1024];
    snprintf(src, sizeof src, "%s", fixture(model));
    ASSERT_OK(mq_pipeline_run(src, o, &q, NULL));
    if (sc && sc->asym_module) restep(src, o, sc->asym_module, &q, sc);
    if (sc && sc->act_order_module) restep(src, o, sc->act_order_module, &q, sc);
    return o;
}

static moeq_model *open_model(const char *dir, int packed) {
    moeq_model_options mo = {.keep_packed = packed, .no_tokenizer = 1};
    return mq_test_open_model(dir, &mo);
}

/* ---- running ------------------------------------------------------------------------------ */
enum { T_PREFILL = 24, T_DECODE = 8, T_ALL = T_PREFILL + T_DECODE };
static const double LOGIT_TOL = 2.5e-4;   /* max |packed - fp32| / max |fp32| over the logits */

static void test_ids(int32_t *ids, int n, int32_t V) {
    for (int i = 0; i < n; i++) ids[i] = (int32_t)((i * 2654435761u + 17) % (uint32_t)V);
}

/* Logits [T_ALL, V]: one prefill of T_PREFILL tokens, then single-token decode steps. */
static float *run_logits(const moeq_model *m) {
    int32_t V = m->cfg.vocab, ids[T_ALL];
    test_ids(ids, T_ALL, V);
    float *lg = malloc(sizeof(float) * (size_t)T_ALL * (size_t)V);
    moeq_session *s = NULL;
    ASSERT_OK(moeq_session_create(m, T_ALL, &s));
    ASSERT_OK(moeq_session_forward(s, ids, T_PREFILL, lg));
    for (int i = T_PREFILL; i < T_ALL; i++)
        ASSERT_OK(moeq_session_forward(s, ids + i, 1, lg + (size_t)i * (size_t)V));
    moeq_session_free(s);
    return lg;
}

/* n greedy tokens after a 6-token prompt. */
static void greedy(const moeq_model *m, int32_t *out, int n) {
    int32_t V = m->cfg.vocab, ids[6];
    test_ids(ids, 6, V);
    float *lg = malloc(sizeof(float) * (size_t)V);
    moeq_session *s = NULL;
    ASSERT_OK(moeq_session_create(m, 6 + n, &s));
    ASSERT_OK(moeq_session_forward(s, ids, 5, NULL));
    ASSERT_OK(moeq_session_forward(s, ids + 5, 1, lg));
    for (int i = 0; i < n; i++) {
        out[i] = mq_test_argmax(lg, V);
        if (i + 1 < n) ASSERT_OK(moeq_session_forward(s, &out[i], 1, lg));
    }
    moeq_session_free(s);
    free(lg);
}

static int64_t n_quantizable(const moeq_model *m) {
    int64_t n = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const mq_layer *ly = &m->layers[l];
        n += 4 + (ly->is_moe ? 3 * (int64_t)m->cfg.n_experts + (m->cfg.shared_ffn > 0 ? 3 : 0) : 3);
    }
    return n;
}

/* Weights of every quantized decoder Linear (all rows are multiples of 16 here: no padding). */
static void quantized_weights(const moeq_model *m, double *n_weights) {
    *n_weights = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const mq_layer *ly = &m->layers[l];
        const mq_linear *v[7] = {&ly->q, &ly->k, &ly->v, &ly->o, &ly->gate, &ly->up, &ly->down};
        for (int i = 0; i < (ly->is_moe ? 4 : 7); i++) *n_weights += (double)(v[i]->out * v[i]->in);
        if (ly->is_moe)
            *n_weights += 3.0 * m->cfg.n_experts * m->cfg.moe_ffn * m->cfg.D +
                          3.0 * m->cfg.shared_ffn * m->cfg.D;
    }
}

/* Packed vs dequantized on one checkpoint: logits, greedy tokens, threads, resident bytes. */
static void compare(const char *dir, const char *what, double bits_per_weight) {
    moeq_model *p = open_model(dir, 1), *f = open_model(dir, 0);
    if (!p || !f) return;
    const moeq_model_info *ip = moeq_model_get_info(p), *ifp = moeq_model_get_info(f);
    ASSERT_EQ_INT(n_quantizable(p), ip->packed_linears);
    ASSERT_EQ_INT(0, ip->fallback_linears);
    ASSERT_EQ_INT(0, ifp->packed_linears);
    /* resident bytes against independent counts */
    ASSERT_EQ_INT(4 * ifp->n_params, ifp->weight_bytes_fp32);
    ASSERT_EQ_INT(ifp->weight_bytes_fp32, ifp->weight_bytes);
    ASSERT_EQ_INT(ifp->weight_bytes_fp32, ip->weight_bytes_fp32);
    double nq;
    quantized_weights(p, &nq);
    double want = (double)ifp->weight_bytes_fp32 - 4.0 * nq + nq * bits_per_weight / 8.0;
    /* the fixtures' BF16 embeddings and lm_head are read in place: 2 bytes a weight, not 4 */
    ASSERT_TRUE(p->embed_g && p->embed_g->type == MQ_GM_BF16 && !f->embed_g);
    const double head = (double)p->cfg.vocab * p->cfg.D * (p->cfg.tie_embeddings ? 1 : 2);
    ASSERT_REL(want, (double)ip->weight_bytes + 2.0 * head, 0.01);

    moeq_set_threads(1);
    float *a = run_logits(p);
    moeq_set_threads(2);
    float *b = run_logits(p);
    moeq_set_threads(0);
    size_t n = (size_t)T_ALL * (size_t)p->cfg.vocab;
    if (memcmp(a, b, n * sizeof(float)) != 0) FAIL("%s: packed logits differ for 1 and 2 threads", what);
    float *r = run_logits(f);
    double rel = mq_test_rel_maxdiff(a, r, n);
    printf("  %s: packed vs fp32 logits max rel diff %.3g; weights %.2f MiB packed, %.2f MiB fp32\n",
           what, rel, (double)ip->weight_bytes / 1048576.0, (double)ip->weight_bytes_fp32 / 1048576.0);
    if (!(rel < LOGIT_TOL)) FAIL("%s: packed vs fp32 logits differ by %.3g (relative to max |logit|)", what, rel);
    /* and it really is another computation */
    if (memcmp(a, r, n * sizeof(float)) == 0) FAIL("%s: packed logits equal the fp32 ones bit for bit", what);

    int32_t gp[12], gf[12];
    greedy(p, gp, 12);
    greedy(f, gf, 12);
    for (int i = 0; i < 12; i++)
        if (gp[i] != gf[i]) {
            FAIL("%s: greedy token %d: packed %d, fp32 %d", what, i, gp[i], gf[i]);
            break;
        }
    free(a);
    free(b);
    free(r);
    moeq_model_free(p);
    moeq_model_free(f);
}

/* The share of a checkpoint's INT4 group scales (weight_scale tensors) that are negative. */
static double negative_scale_share(const char *dir) {
    mq_st *ck;
    ASSERT_OK(mq_st_open_dir(dir, &ck));
    int64_t neg = 0, all = 0;
    for (size_t i = 0; i < mq_st_count(ck); i++) {
        const mq_tensor_view *v = mq_st_at(ck, i);
        const size_t len = strlen(v->name);
        if (len < 13 || strcmp(v->name + len - 13, ".weight_scale") != 0) continue;
        float *f = malloc(sizeof(float) * (size_t)v->numel);
        ASSERT_OK(mq_tensor_to_f32(v, f));
        for (int64_t k = 0; k < v->numel; k++) neg += f[k] < 0;
        all += v->numel;
        free(f);
    }
    mq_st_close(ck);
    return all ? (double)neg / (double)all : 0;
}

static void compare_schemes(const char *model) {
    compare(checkpoint(model, MQ_QS_NVFP4, 0, MQ_FMT_CT, NULL, "nvfp4"), "nvfp4", 4.5);
    compare(checkpoint(model, MQ_QS_INT4, 32, MQ_FMT_CT, NULL, "int4g32"), "int4 g32", 4.5);
    compare(checkpoint(model, MQ_QS_INT4, 128, MQ_FMT_CT, NULL, "int4g128"), "int4 g128", 4.125);
    /* signed scales: about half of them negative (each group's larger side), none otherwise */
    const step_cfg sg = {.signed_scales = true};
    const char *d = checkpoint(model, MQ_QS_INT4, 128, MQ_FMT_CT, &sg, "int4g128s");
    const double share = negative_scale_share(d);
    if (!(share > 0.3 && share < 0.7)) FAIL("%s signed scales: %.3f of them negative", model, share);
    ASSERT_TRUE(negative_scale_share(checkpoint(model, MQ_QS_INT4, 128, MQ_FMT_CT, NULL, "int4g128")) == 0);
    compare(d, "int4 g128 signed scales", 4.125);
}

static void test_packed_olmoe(void) { compare_schemes("olmoe-tiny"); }
static void test_packed_qwen2moe(void) { compare_schemes("qwen2moe-tiny"); }
static void test_packed_llama(void) { compare_schemes("llama-tiny"); }
static void test_packed_modelopt(void) {
    compare(checkpoint("qwen2moe-tiny", MQ_QS_NVFP4, 0, MQ_FMT_MODELOPT, NULL, "modelopt"),
            "modelopt nvfp4", 4.5);
}

/* ---- fallbacks ----------------------------------------------------------------------------- */
typedef struct {
    char text[16384];
    size_t len;
} log_buf;

static void on_log(void *user, int level, const char *msg) {
    (void)level;
    log_buf *b = user;
    int n = snprintf(b->text + b->len, sizeof b->text - b->len, "%s\n", msg);
    if (n > 0 && b->len + (size_t)n < sizeof b->text) b->len += (size_t)n;
}

static moeq_model *open_logged(const char *dir, log_buf *lb) {
    lb->len = 0;
    lb->text[0] = 0;
    moeq_set_log(on_log, lb);
    moeq_model *m = open_model(dir, 1);
    moeq_set_log(NULL, NULL);
    return m;
}

static void assert_logged(const log_buf *lb, const char *s) {
    if (!strstr(lb->text, s)) FAIL("the info log does not mention '%s':\n%s", s, lb->text);
}

static void test_fallback_asym_all(void) {
    mq_pipeline_opts q;
    mq_pipeline_opts_init(&q, MQ_QS_INT4, MQ_FMT_CT);
    q.spec.asym = true;
    q.spec.group_size = 32;
    char dir[1024], src[1024];
    snprintf(dir, sizeof dir, "%s/qwen2moe-asym", mq_test_tmpdir());
    snprintf(src, sizeof src, "%s", fixture("qwen2moe-tiny"));
    ASSERT_OK(mq_pipeline_run(src, dir, &q, NULL));
    log_buf lb;
    moeq_model *p = open_logged(dir, &lb), *f = open_model(dir, 0);
    if (!p || !f) return;
    const moeq_model_info *ip = moeq_model_get_info(p);
    ASSERT_EQ_INT(0, ip->packed_linears);
    ASSERT_EQ_INT(n_quantizable(p), ip->fallback_linears);
    ASSERT_EQ_INT(ip->weight_bytes_fp32, ip->weight_bytes);
    assert_logged(&lb, "model.layers.0.self_attn.q_proj");
    assert_logged(&lb, "model.layers.3.mlp: expert 0 gate");
    assert_logged(&lb, "asymmetric INT4");
    float *a = run_logits(p), *b = run_logits(f);
    if (memcmp(a, b, sizeof(float) * (size_t)T_ALL * (size_t)p->cfg.vocab) != 0)
        FAIL("an all-fallback model differs from the fp32 path");
    free(a);
    free(b);
    moeq_model_free(p);
    moeq_model_free(f);
}

/* One asymmetric attention tensor and one asymmetric expert down_proj: only that tensor and that
 * MoE layer fall back, the rest runs packed and the whole stays within the tolerance. */
static void test_fallback_mixed(void) {
    step_cfg sc = {"model.layers.1.self_attn.v_proj", NULL, false};
    const char *d1 = checkpoint("qwen2moe-tiny", MQ_QS_INT4, 32, MQ_FMT_CT, &sc, "asym-v");
    step_cfg sc2 = {"model.layers.2.mlp.experts.5.down_proj", NULL, false};
    const char *d2 = checkpoint("qwen2moe-tiny", MQ_QS_INT4, 32, MQ_FMT_CT, &sc2, "asym-expert");
    const char *dirs[2] = {d1, d2};
    for (int k = 0; k < 2; k++) {
        log_buf lb;
        moeq_model *p = open_logged(dirs[k], &lb), *f = open_model(dirs[k], 0);
        if (!p || !f) return;
        const moeq_model_info *ip = moeq_model_get_info(p);
        int64_t moe_n = 3 * (int64_t)p->cfg.n_experts + 3;
        int64_t fb = k == 0 ? 1 : moe_n;
        ASSERT_EQ_INT(fb, ip->fallback_linears);
        ASSERT_EQ_INT(n_quantizable(p) - fb, ip->packed_linears);
        if (k == 0) {
            assert_logged(&lb, "model.layers.1.self_attn.v_proj");
            ASSERT_TRUE(p->layers[1].v.w != NULL && p->layers[1].v.qw == NULL);
            ASSERT_TRUE(p->layers[1].q.w == NULL && p->layers[1].q.qw != NULL);
        } else {
            assert_logged(&lb, "model.layers.2.mlp: expert 5 down");
            ASSERT_TRUE(p->layers[2].pexperts == NULL && p->layers[2].exp_gate[0].w != NULL);
            ASSERT_TRUE(p->layers[1].pexperts != NULL && p->layers[1].exp_gate[0].w == NULL);
        }
        float *a = run_logits(p), *b = run_logits(f);
        double rel = mq_test_rel_maxdiff(a, b, (size_t)T_ALL * (size_t)p->cfg.vocab);
        printf("  mixed fallback %d: max rel diff %.3g\n", k, rel);
        if (!(rel < LOGIT_TOL)) FAIL("mixed fallback %d: logits differ by %.3g", k, rel);
        free(a);
        free(b);
        moeq_model_free(p);
        moeq_model_free(f);
    }
}

static void test_fallback_act_order_gptq(void) {
    step_cfg sc = {NULL, "model.layers.2.mlp.down_proj", false};
    const char *dir = checkpoint("llama-tiny", MQ_QS_INT4, 128, MQ_FMT_GPTQ, &sc, "gptq-actorder");
    log_buf lb;
    moeq_model *p = open_logged(dir, &lb), *f = open_model(dir, 0);
    if (!p || !f) return;
    const moeq_model_info *ip = moeq_model_get_info(p);
    ASSERT_EQ_INT(1, ip->fallback_linears);
    ASSERT_EQ_INT(n_quantizable(p) - 1, ip->packed_linears);
    assert_logged(&lb, "model.layers.2.mlp.down_proj");
    assert_logged(&lb, "act-order");
    ASSERT_TRUE(p->layers[2].down.w != NULL && p->layers[2].down.qw == NULL);
    float *a = run_logits(p), *b = run_logits(f);
    double rel = mq_test_rel_maxdiff(a, b, (size_t)T_ALL * (size_t)p->cfg.vocab);
    printf("  gptq act-order fallback: max rel diff %.3g\n", rel);
    if (!(rel < LOGIT_TOL)) FAIL("gptq act-order fallback: logits differ by %.3g", rel);
    free(a);
    free(b);
    moeq_model_free(p);
    moeq_model_free(f);
}

/* ---- hooks, act_quant, eval --------------------------------------------------------------- */
static void no_op_hook(void *user, int layer, mq_site site, int expert, const float *x,
                       int64_t rows, int64_t cols) {
    (void)user, (void)layer, (void)site, (void)expert, (void)x, (void)rows, (void)cols;
}

static void test_hooks_refused_and_act_quant_unpacks(void) {
    const char *dir = checkpoint("olmoe-tiny", MQ_QS_NVFP4, 0, MQ_FMT_CT, NULL, "nvfp4-hooks");
    moeq_model *p = open_model(dir, 1);
    if (!p) return;
    mq_state *st = NULL;
    ASSERT_OK(mq_state_new(p, 8, &st));
    float *x = calloc((size_t)(4 * p->cfg.D), sizeof(float));
    int32_t ids[4] = {1, 2, 3, 4};
    ASSERT_OK(mq_embed(p, ids, 4, x));
    mq_hooks h = {no_op_hook, NULL};
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, mq_forward_layers(p, st, x, 4, 0, 0, 1, &h));
    ASSERT_ERROR_MENTIONS("keep_packed");
    ASSERT_OK(mq_forward_layers(p, st, x, 4, 0, 0, 1, NULL));   /* without hooks it runs */
    mq_state_free(st);
    free(x);
    moeq_model_free(p);

    moeq_model_options mo = {.keep_packed = 1, .no_tokenizer = 1, .act_quant = MOEQ_ACT_QUANT_NVFP4};
    moeq_model *a = mq_test_open_model(dir, &mo);
    if (!a) return;
    ASSERT_EQ_INT(0, moeq_model_get_info(a)->packed_linears);
    ASSERT_EQ_INT(MOEQ_ACT_QUANT_NVFP4, moeq_model_get_info(a)->act_quant);
    moeq_model_free(a);
    mo.act_quant = 7;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_model_open(dir, &mo, &a));
    ASSERT_ERROR_MENTIONS("act_quant");
}

/* Packed vs dequantized perplexity on docs (the first o->limit documents); 1 and 2 threads give
 * the same log-likelihood. */
static void eval_packed(const moeq_docs *docs, const moeq_eval_options *o, const char *what) {
    const char *dir = checkpoint("olmoe-tiny", MQ_QS_NVFP4, 0, MQ_FMT_CT, NULL, "nvfp4-eval");
    moeq_model_options mo = {.keep_packed = 1};
    moeq_model *p = NULL, *f = NULL;
    ASSERT_OK(moeq_model_open(dir, &mo, &p));
    mo.keep_packed = 0;
    ASSERT_OK(moeq_model_open(dir, &mo, &f));
    if (!p || !f) return;
    moeq_eval_result rp, rp1, rf;
    moeq_set_threads(1);
    ASSERT_OK(moeq_eval(p, docs, o, &rp1));
    moeq_set_threads(2);
    ASSERT_OK(moeq_eval(p, docs, o, &rp));
    moeq_set_threads(0);
    ASSERT_OK(moeq_eval(f, docs, o, &rf));
    if (rp1.loglikelihood != rp.loglikelihood)
        FAIL("%s: packed loglikelihood %.17g with 1 thread, %.17g with 2", what, rp1.loglikelihood,
             rp.loglikelihood);
    printf("  %s (%lld tokens): word perplexity packed %.8g, fp32 %.8g (rel %.3g); "
           "%.0f vs %.0f tokens/s\n", what, (long long)rf.tokens, rp.word_perplexity,
           rf.word_perplexity, fabs(rp.word_perplexity - rf.word_perplexity) / rf.word_perplexity,
           rp.tokens_per_second, rf.tokens_per_second);
    ASSERT_TRUE(rf.tokens > 1000);
    ASSERT_EQ_INT(rf.tokens, rp.tokens);
    ASSERT_REL(rf.word_perplexity, rp.word_perplexity, 1e-4);
    ASSERT_TRUE(rp.word_perplexity != rf.word_perplexity);
    moeq_model_free(p);
    moeq_model_free(f);
}

static void test_eval_wikitext_packed(void) { mq_test_on_eval_text(0, eval_packed); }

/* The same on the repository's own held-out text (text the bundled model generated). */
static void test_eval_demo_text_packed(void) { mq_test_on_eval_text(1, eval_packed); }

TEST_MAIN(T(test_packed_olmoe), T(test_packed_qwen2moe), T(test_packed_llama),
          T(test_packed_modelopt), T(test_fallback_asym_all), T(test_fallback_mixed),
          T(test_fallback_act_order_gptq), T(test_hooks_refused_and_act_quant_unpacks),
          T(test_eval_wikitext_packed), T(test_eval_demo_text_packed))
