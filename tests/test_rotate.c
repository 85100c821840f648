/*
 * The residual-stream rotation (src/model/rotate.c, moeq quantize --rotate residual): the
 * transform against the Hadamard matrix written out by its definition, orthogonality, the
 * classification of the hub's tensor names, the refusals, and the model: every fixture family
 * rotated in memory by the product's per-tensor transform computes the original logits within
 * an fp32 tolerance derived below, while the same rotation without the norm fold does not.
 */
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "model/model.h"
#include "model/rotate.h"

/* R[i][j] of diag(s) H_bd / sqrt(b) by definition: (-1)^popcount(i & j) inside a block. */
static double r_ref(const float *s, int b, int i, int j) {
    if (i / b != j / b) return 0;
    int x = (i % b) & (j % b), par = 0;
    while (x) {
        par ^= x & 1;
        x >>= 1;
    }
    return s[i] * (par ? -1.0 : 1.0) / sqrt((double)b);
}

static void test_matrix_and_orthogonality(void) {
    enum { D = 48 };
    static const int blocks[] = {2, 8, 16};
    float sign[D];
    for (int i = 0; i < D; i++) sign[i] = (i * 7 + i / 5) % 3 == 0 ? -1.0f : 1.0f;
    for (size_t bi = 0; bi < sizeof blocks / sizeof blocks[0]; bi++) {
        const int b = blocks[bi];
        mq_rotation r = {.D = D, .block = b, .n_layers = 0, .sign = sign};
        static float R[D][D];
        for (int i = 0; i < D; i++) {   /* row i of R = e_i R */
            memset(R[i], 0, sizeof R[i]);
            R[i][i] = 1;
            mq_rotation_vec(&r, R[i]);
        }
        for (int i = 0; i < D; i++)
            for (int j = 0; j < D; j++) ASSERT_NEAR(r_ref(sign, b, i, j), R[i][j], 1e-7);
        for (int i = 0; i < D; i++)
            for (int j = 0; j < D; j++) {
                double d = 0;
                for (int k = 0; k < D; k++) d += (double)R[k][i] * R[k][j];   /* (R^T R)_ij */
                ASSERT_NEAR(i == j ? 1.0 : 0.0, d, 1e-6);
            }
        /* a writer's R^T W, done on whole rows, is the same transform down every column */
        enum { C = 5 };
        float W[D * C], col[D];
        for (int i = 0; i < D * C; i++) W[i] = (float)((i * 37) % 11) - 5.0f;
        float W0[D * C];
        memcpy(W0, W, sizeof W);
        ASSERT_OK(mq_rotation_apply(&r, MQ_ROT_WRITE, 0, W, D, C, "w"));
        for (int c = 0; c < C; c++) {
            for (int i = 0; i < D; i++) {
                double v = 0;
                for (int k = 0; k < D; k++) v += r_ref(sign, b, k, i) * W0[k * C + c];
                col[i] = (float)v;
            }
            for (int i = 0; i < D; i++) ASSERT_NEAR(col[i], W[i * C + c], 1e-5);
        }
    }
}

static void test_classify(void) {
    static const struct {
        const char *name;
        mq_rot_kind k;
        int layer;
    } cases[] = {
        {"model.embed_tokens.weight", MQ_ROT_EMBED, -1},
        {"model.norm.weight", MQ_ROT_NORM, -1},
        {"lm_head.weight", MQ_ROT_READ_FINAL, -1},
        {"model.layers.3.input_layernorm.weight", MQ_ROT_NORM, 3},
        {"model.layers.3.post_attention_layernorm.weight", MQ_ROT_NORM, 3},
        {"model.layers.12.self_attn.q_proj.weight", MQ_ROT_READ_ATTN, 12},
        {"model.layers.0.self_attn.k_proj.weight", MQ_ROT_READ_ATTN, 0},
        {"model.layers.0.self_attn.v_proj.weight", MQ_ROT_READ_ATTN, 0},
        {"model.layers.0.self_attn.q_proj.bias", MQ_ROT_NONE, 0},   /* an output's */
        {"model.layers.0.self_attn.q_norm.weight", MQ_ROT_NONE, 0},
        {"model.layers.0.self_attn.k_norm.weight", MQ_ROT_NONE, 0},
        {"model.layers.0.self_attn.o_proj.weight", MQ_ROT_WRITE, 0},
        {"model.layers.0.self_attn.o_proj.bias", MQ_ROT_WRITE_BIAS, 0},
        {"model.layers.1.mlp.gate.weight", MQ_ROT_READ_FFN, 1},
        {"model.layers.1.mlp.gate.e_score_correction_bias", MQ_ROT_NONE, 1},
        {"model.layers.1.mlp.experts.7.gate_proj.weight", MQ_ROT_READ_FFN, 1},
        {"model.layers.1.mlp.experts.7.up_proj.weight", MQ_ROT_READ_FFN, 1},
        {"model.layers.1.mlp.experts.7.down_proj.weight", MQ_ROT_WRITE, 1},
        {"model.layers.1.mlp.shared_expert.gate_proj.weight", MQ_ROT_READ_FFN, 1},
        {"model.layers.1.mlp.shared_expert.down_proj.weight", MQ_ROT_WRITE, 1},
        {"model.layers.1.mlp.shared_expert_gate.weight", MQ_ROT_READ_FFN, 1},
        {"model.layers.2.mlp.gate_proj.weight", MQ_ROT_READ_FFN, 2},
        {"model.layers.2.mlp.down_proj.weight", MQ_ROT_WRITE, 2},
        {"model.layers.2.mlp.down_proj.bias", MQ_ROT_WRITE_BIAS, 2},
        {"model.layers.2.mlp.up_proj.bias", MQ_ROT_NONE, 2},
        {"model.layers.5.block_sparse_moe.gate.weight", MQ_ROT_READ_FFN, 5},
        {"model.layers.5.block_sparse_moe.experts.0.w1.weight", MQ_ROT_READ_FFN, 5},
        {"model.layers.5.block_sparse_moe.experts.0.w3.weight", MQ_ROT_READ_FFN, 5},
        {"model.layers.5.block_sparse_moe.experts.0.w2.weight", MQ_ROT_WRITE, 5},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int layer = -7;
        mq_rot_kind k = mq_rot_classify(cases[i].name, &layer);
        if (k != cases[i].k || layer != cases[i].layer)
            FAIL("%s: kind %d layer %d, expected %d and %d", cases[i].name, (int)k, layer,
                 (int)cases[i].k, cases[i].layer);
    }
}

static void test_refusals(void) {
    mq_config c;
    memset(&c, 0, sizeof c);
    c.arch = MQ_ARCH_OLMOE;
    c.D = 256;
    snprintf(c.model_type, sizeof c.model_type, "olmoe");
    ASSERT_OK(mq_rotation_check(&c, 64));
    ASSERT_OK(mq_rotation_check(&c, 256));
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_rotation_check(&c, 48));    /* not a power of two */
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_rotation_check(&c, 512));   /* does not divide 256 */
    ASSERT_TRUE(strstr(moeq_last_error(), "hidden size 256") != NULL);
    c.mla = true;
    c.arch = MQ_ARCH_DEEPSEEK_V3;
    snprintf(c.model_type, sizeof c.model_type, "deepseek_v3");
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, mq_rotation_check(&c, 64));
    ASSERT_TRUE(strstr(moeq_last_error(), "latent attention") != NULL);
    c.mla = false;
    c.arch = MQ_ARCH_LLAMA;
    char q[] = "compressed-tensors";
    c.quant_method = q;
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, mq_rotation_check(&c, 64));
    ASSERT_TRUE(strstr(moeq_last_error(), "quantized") != NULL);
}

/* ---- the model --------------------------------------------------------------------------------- */

static void rot(const mq_rotation *r, const char *tensor, float *x, int64_t rows, int64_t cols,
                bool fold) {
    int layer;
    mq_rot_kind k = mq_rot_classify(tensor, &layer);
    if (!fold && k == MQ_ROT_NORM) return;   /* the negative control: norms left as they were */
    ASSERT_TRUE(k != MQ_ROT_NONE);
    ASSERT_OK(mq_rotation_apply(r, k, layer, x, rows, cols, tensor));
}

static void rot_linear(const mq_rotation *r, const mq_linear *l, bool fold) {
    char n[300];
    snprintf(n, sizeof n, "%s.weight", l->name);
    rot(r, n, l->w, l->out, l->in, fold);
    if (l->bias) {
        snprintf(n, sizeof n, "%s.bias", l->name);
        int layer;
        if (mq_rot_classify(n, &layer) != MQ_ROT_NONE) rot(r, n, l->bias, 1, l->out, fold);
    }
}

/* Rotates every weight of m in memory (the per-tensor transform the loaders apply). */
static void rotate_model(moeq_model *m, const mq_rotation *r, bool fold) {
    const mq_config *c = &m->cfg;
    const int64_t D = c->D, V = c->vocab;
    char n[160];
    if (m->lm_head == m->embed) {   /* untie, as the pipeline does */
        m->lm_head = mq_alloc_array((size_t)(V * D), sizeof(float), "lm_head");
        ASSERT_TRUE(m->lm_head != NULL);
        memcpy(m->lm_head, m->embed, sizeof(float) * (size_t)(V * D));
        m->cfg.tie_embeddings = false;
    }
    rot(r, "model.embed_tokens.weight", m->embed, V, D, fold);
    rot(r, "lm_head.weight", m->lm_head, V, D, fold);
    rot(r, "model.norm.weight", m->final_norm, 1, D, fold);
    for (int l = 0; l < c->n_layers; l++) {
        mq_layer *ly = &m->layers[l];
        snprintf(n, sizeof n, "model.layers.%d.input_layernorm.weight", l);
        rot(r, n, ly->attn_norm, 1, D, fold);
        snprintf(n, sizeof n, "model.layers.%d.post_attention_layernorm.weight", l);
        rot(r, n, ly->ffn_norm, 1, D, fold);
        rot_linear(r, &ly->q, fold);
        rot_linear(r, &ly->k, fold);
        rot_linear(r, &ly->v, fold);
        rot_linear(r, &ly->o, fold);
        if (!ly->is_moe) {
            rot_linear(r, &ly->gate, fold);
            rot_linear(r, &ly->up, fold);
            rot_linear(r, &ly->down, fold);
            continue;
        }
        snprintf(n, sizeof n, "model.layers.%d.mlp.gate.weight", l);
        rot(r, n, ly->router, c->n_experts, D, fold);
        for (int e = 0; e < c->n_experts; e++) {
            rot_linear(r, &ly->exp_gate[e], fold);
            rot_linear(r, &ly->exp_up[e], fold);
            rot_linear(r, &ly->exp_down[e], fold);
        }
        if (c->shared_ffn > 0) {
            rot_linear(r, &ly->sh_gate, fold);
            rot_linear(r, &ly->sh_up, fold);
            rot_linear(r, &ly->sh_down, fold);
            if (ly->sh_gate_w) {
                snprintf(n, sizeof n, "model.layers.%d.mlp.shared_expert_gate.weight", l);
                rot(r, n, ly->sh_gate_w, 1, D, fold);
            }
        }
    }
}

static void check_model(const char *name, int block) {
    const char *dir = mq_test_model(name);
    char path[1024];
    snprintf(path, sizeof path, "%s", dir);
    moeq_model_options opt = {.no_tokenizer = 1};
    moeq_model *m0 = NULL, *m1 = NULL, *m2 = NULL;
    ASSERT_OK(moeq_model_open(path, &opt, &m0));
    ASSERT_OK(moeq_model_open(path, &opt, &m1));
    ASSERT_OK(moeq_model_open(path, &opt, &m2));
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_dir(path, &st));
    mq_rotation r;
    ASSERT_OK(mq_rotation_check(&m0->cfg, block));
    ASSERT_OK(mq_rotation_init(&r, &m0->cfg, st, block, MQ_ROTATE_SEED));
    rotate_model(m1, &r, true);
    rotate_model(m2, &r, false);
    enum { T = 48 };
    int32_t ids[T];
    for (int t = 0; t < T; t++) ids[t] = (int32_t)((t * 977 + 13) % m0->cfg.vocab);
    float *a = mq_test_logits(m0, ids, T), *b = mq_test_logits(m1, ids, T), *c = mq_test_logits(m2, ids, T);
    const size_t n = (size_t)T * (size_t)m0->cfg.vocab;
    double amax = 0, d1 = 0, d2 = 0;
    size_t nonfinite = 0;   /* counted apart: a NaN would pass a max that skips it */
    for (size_t i = 0; i < n; i++) {
        const double x = a[i], e1 = fabs(x - b[i]), e2 = fabs(x - c[i]);
        nonfinite += !isfinite(x) || !isfinite(e1) || !isfinite(e2);
        if (fabs(x) > amax) amax = fabs(x);
        if (e1 > d1) d1 = e1;
        if (e2 > d2) d2 = e2;
    }
    if (nonfinite) FAIL("%s: %zu logits of the models are not finite", name, nonfinite);
    /* The tolerance: every rotated weight carries up to (log2 b + 2) fp32 roundings (the
     * butterflies, the 1/sqrt(b) scale, the norm product), relative u = 2^-24 each, and every
     * product of the forward is summed in another order over D terms (sqrt(D) u typical). The
     * errors of the 2 L + 1 sublayers add and the residual stream carries them to the logits,
     * amplified by the attention's and routers' softmax (a budget of 2x for that): tol =
     * 2 (2 L + 1) (log2 b + 2 + sqrt(D)) u max|logit|, about 20x the differences measured. A
     * rotation without the norm fold misses it by 1000x and more. */
    const double u = 0x1p-24, L = m0->cfg.n_layers, D = (double)m0->cfg.D;
    const double tol = 2 * (2 * L + 1) * (log2((double)block) + 2 + sqrt(D)) * u * amax;
    fprintf(stderr, "  %s, blocks of %d: max |logit| %.3f, rotated max |diff| %.3g (tolerance "
            "%.3g), without the norm fold %.3g\n", name, block, amax, d1, tol, d2);
    if (!(d1 <= tol)) FAIL("%s: the rotated model's logits differ by %g > %g", name, d1, tol);
    if (!(d2 > 100 * tol)) FAIL("%s: the control without the norm fold differs by only %g", name, d2);
    free(a);
    free(b);
    free(c);
    mq_rotation_free(&r);
    mq_st_close(st);
    moeq_model_free(m0);
    moeq_model_free(m1);
    moeq_model_free(m2);
}

static void test_olmoe_logits(void) {
    check_model("olmoe-tiny", 64);
    check_model("olmoe-tiny", 256);
}
static void test_qwen2moe_logits(void) { check_model("qwen2moe-tiny", 32); }
static void test_llama_logits(void) { check_model("llama-tiny", 16); }

TEST_MAIN(T(test_matrix_and_orthogonality), T(test_classify), T(test_refusals),
          T(test_olmoe_logits), T(test_qwen2moe_logits), T(test_llama_logits))
