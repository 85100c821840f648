/*
 * Generation's device code (backend/cuda/decode.cu, dequant.cu) run by the SIMT emulator on the
 * host (backend/gpu.h: mq_gpu_kvattn_emulate, mq_gpu_dequantize_emulate; kvattn_emu.cu), so its
 * kernels' own source is checked without a GPU, in every CUDA build (in a build without CUDA the
 * cases skip):
 *   attention   one layer of a fixture through decode.cu's steps (its kernels, launch shapes
 *               and order; the products a host GEMM of the operands mq_cu_product gives cuBLAS)
 *               against model/forward.c's mq_attention_forward of the whole sequence: the
 *               attention's contribution (x_out - x_in), the FFN input and the routing.
 *               Shapes: OLMoE (q/k norms over all heads), a Qwen2-MoE layer (q/k/v biases,
 *               grouped KV heads), Qwen3-MoE (per-head q/k norms, grouped KV heads), Mixtral
 *               (grouped KV heads), sliding windows shorter than the sequence, clip_qkv, more
 *               visible keys than the attention's block has threads;
 *   KV cache    a prefill of some tokens, then decode steps of one token at the later positions,
 *               must give the bits of the whole sequence in one call (every kernel is a function
 *               of its row and the cache), and the emulated device memory is NaN until written
 *               and guarded at both ends of every buffer: a read of a cache row never written,
 *               or a write outside a buffer of decode.cu's sizes, fails the case;
 *   dequant     the device's decoding of NVFP4 (both global-scale conventions), INT4 (symmetric,
 *               asymmetric, act-order) and MXFP4: mq_dequantize's bits.
 *
 * Tolerance of the attention against the CPU (fp32; u = 2^-24): every operation but the sums is
 * the CPU's (the norms with the sum of squares in double, RoPE from the same tables, clip, moeq's
 * expf); the sums run in another order. Two fp32 orders of a sum of K terms differ by at most
 * 2 gamma_K <= 2.01 K u of the terms' magnitudes, here K <= 256 (D, H * hd; the scores hd, P V
 * the positions): 3.1e-5. Four such sums lie in a chain on the attention's path (q/k/v, the
 * scores, P V, o), with magnitudes of the size of the results in these layers (no large
 * cancellation: measured below), so 2e-4 of the largest contribution bounds the difference; the
 * FFN input, a norm of the sum with the residual, the same bound relative to its largest value.
 * A token's routing must be the CPU's wherever the CPU's k-th and next probabilities are more
 * than 1e-4 apart, its weights within 1e-4.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/gpu.h"
#include "formats/formats.h"
#include "gpu_attn_twin.h"
#include "harness.h"
#include "model/model.h"

#define TOL 2e-4

static void need_emulator(void) {
    if (!mq_gpu_built()) SKIP("this build has no CUDA backend (the emulator compiles its kernels)");
}

typedef struct {
    const char *dir;
    int layer;
    int64_t window;   /* > 0: the layer made a sliding-window one */
    float clip;       /* > 0: clip_qkv */
    int64_t T, prefill;
} att_case;

/* The emulated layer on x0 [T, D] in calls of n[0..calls): the result, FFN input and routing. */
static void emulate(const mq_gpu_attn_shape *sh, const mq_gpu_attn_weights *w, const float *x0, int64_t T,
                    const int64_t *n, int calls, float *x, float *ffn, int32_t *sel, float *wt) {
    memcpy(x, x0, sizeof(float) * (size_t)(T * sh->D));
    const bool route = w->router != NULL;
    ASSERT_OK(mq_gpu_kvattn_emulate(sh, w, n, calls, x, ffn, route ? sel : NULL, route ? wt : NULL));
}

static void attention_case(const att_case *k) {
    moeq_model_options opt = {.no_tokenizer = 1};
    moeq_model *m = NULL;
    const char *dir = mq_test_repo(k->dir);
    if (moeq_model_open(dir, &opt, &m) != MOEQ_OK) FAIL("%s: %s", dir, moeq_last_error());
    mq_config *c = &m->cfg;
    if (k->window > 0) {
        c->sliding_window = (int32_t)k->window;
        c->layer_sliding[k->layer] = 1;
    }
    if (k->clip > 0) c->clip_qkv = k->clip;
    const int64_t T = k->T, D = c->D, E = c->n_experts;
    const bool moe = m->layers[k->layer].is_moe;
    const int64_t K = moe ? c->top_k : 0;
    const size_t TD = (size_t)(T * D);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T);
    for (int64_t i = 0; i < T; i++) ids[i] = (int32_t)((i * 7919 + 13) % c->vocab);
    float *x0 = malloc(sizeof(float) * TD), *xc = malloc(sizeof(float) * TD);
    ASSERT_OK(mq_embed(m, ids, T, x0));
    for (size_t i = 0; i < TD; i++) x0[i] *= 30.0f;   /* activations of a later layer's size */
    memcpy(xc, x0, sizeof(float) * TD);

    /* the CPU: the whole sequence in one call */
    mq_state *st = NULL;
    ASSERT_OK(mq_state_new(m, (int32_t)T, &st));
    ASSERT_OK(mq_attention_forward(m, st, k->layer, xc, T, 0, NULL));
    float *cfin = malloc(sizeof(float) * TD), *probs = malloc(sizeof(float) * (size_t)(T * E + 1));
    float *cw = malloc(sizeof(float) * (size_t)(T * K + 1));
    int32_t *cs = malloc(sizeof(int32_t) * (size_t)(T * K + 1));
    mq_ffn_norm(m, k->layer, xc, T, cfin);
    if (moe) mq_moe_route(m, k->layer, cfin, T, probs, cs, cw);

    /* the emulated device: one call, then a prefill and single decode steps */
    mq_gpu_attn_shape sh;
    mq_gpu_attn_weights w;
    mq_test_attn_twin(m, st, k->layer, T, k->window, &sh, &w);
    float *xa = malloc(sizeof(float) * TD), *fa = malloc(sizeof(float) * TD);
    float *xb = malloc(sizeof(float) * TD), *fb = malloc(sizeof(float) * TD);
    float *wa = malloc(sizeof(float) * (size_t)(T * K + 1)), *wb = malloc(sizeof(float) * (size_t)(T * K + 1));
    int32_t *sa = malloc(sizeof(int32_t) * (size_t)(T * K + 1)), *sb = malloc(sizeof(int32_t) * (size_t)(T * K + 1));
    const int64_t whole = T;
    emulate(&sh, &w, x0, T, &whole, 1, xa, fa, sa, wa);
    int64_t *steps = malloc(sizeof(int64_t) * (size_t)T);
    ASSERT_TRUE(k->prefill > 0 && k->prefill + 3 < T);
    int calls = 0;
    steps[calls++] = k->prefill;
    steps[calls++] = 3;   /* several tokens at a later position too */
    for (int64_t p = k->prefill + 3; p < T; p++) steps[calls++] = 1;
    emulate(&sh, &w, x0, T, steps, calls, xb, fb, sb, wb);
    mq_test_same_floats(xa, xb, (int64_t)TD, "prefill + decode steps against one call: x");
    mq_test_same_floats(fa, fb, (int64_t)TD, "prefill + decode steps against one call: FFN input");
    if (moe) {
        mq_test_same_floats(wa, wb, T * K, "prefill + decode steps against one call: routing weights");
        ASSERT_TRUE(memcmp(sa, sb, sizeof(int32_t) * (size_t)(T * K)) == 0);
    }

    /* against the CPU: the attention's contribution, the FFN input, the routing */
    float *dg = malloc(sizeof(float) * TD), *dc = malloc(sizeof(float) * TD);
    for (size_t i = 0; i < TD; i++) {
        dg[i] = xa[i] - x0[i];
        dc[i] = xc[i] - x0[i];
    }
    const double e_att = mq_test_rel_maxdiff(dg, dc, TD), e_fin = mq_test_rel_maxdiff(fa, cfin, TD);
    if (!(e_att <= TOL)) FAIL("%s layer %d: the attention differs from the CPU's by %.3e", k->dir, k->layer, e_att);
    if (!(e_fin <= TOL)) FAIL("%s layer %d: the FFN input differs from the CPU's by %.3e", k->dir, k->layer, e_fin);
    double e_w = 0;
    int64_t checked = 0;
    for (int64_t t = 0; moe && t < T; t++) {
        /* the CPU's margin between the k-th and the next probability */
        const float *p = probs + t * E;
        float kth = INFINITY, next = -INFINITY;
        for (int64_t j = 0; j < K; j++) kth = fminf(kth, p[cs[t * K + j]]);
        for (int64_t e = 0; e < E; e++) {
            bool in = false;
            for (int64_t j = 0; j < K; j++) in = in || cs[t * K + j] == e;
            if (!in && p[e] > next) next = p[e];
        }
        if (kth - next <= 1e-4f) continue;
        checked++;
        for (int64_t j = 0; j < K; j++) {
            if (sa[t * K + j] != cs[t * K + j])
                FAIL("%s layer %d: token %lld routes to expert %d, the CPU's to %d (margin %.2e)", k->dir, k->layer,
                     (long long)t, sa[t * K + j], cs[t * K + j], (double)(kth - next));
            e_w = fmax(e_w, fabs((double)wa[t * K + j] - (double)cw[t * K + j]));
        }
    }
    printf("    %-30s layer %d T=%-3lld prefill %-3lld window %-3lld: attention %.2e, FFN input %.2e, "
           "routing weights %.2e (%lld of %lld tokens)\n", k->dir, k->layer, (long long)T, (long long)k->prefill,
           (long long)k->window, e_att, e_fin, e_w, (long long)checked, (long long)(moe ? T : 0));
    if (!(e_w <= 1e-4)) FAIL("%s layer %d: routing weights differ from the CPU's by %.3e", k->dir, k->layer, e_w);
    if (moe) ASSERT_TRUE(checked > T / 2);   /* the routing was compared at all */
    MQ_FREE_EACH(ids, x0, xc, cfin, probs, cw, cs, xa, fa, xb, fb, wa, wb, sa, sb, steps, dg, dc);
    mq_state_free(st);
    moeq_model_free(m);
}

static void test_attention_olmoe(void) {
    need_emulator();
    /* q/k norms over all heads, H = KV */
    attention_case(&(att_case){"models/olmoe-tiny", 0, 0, 0, 24, 17});
    /* a sliding window shorter than the sequence, clip_qkv */
    attention_case(&(att_case){"models/olmoe-tiny", 2, 7, 0.8f, 26, 9});
}

static void test_attention_grouped_kv(void) {
    need_emulator();
    /* Qwen2-MoE: q/k/v biases, 2 KV heads for 4 */
    attention_case(&(att_case){"tests/data/qwen2moe-dense-tiny", 0, 0, 0, 24, 16});
    /* Qwen3-MoE: per-head q/k norms; a window of 5 */
    attention_case(&(att_case){"tests/data/qwen3moe-tiny", 1, 5, 0, 22, 12});
    /* Mixtral: grouped KV heads, a window the prefill crosses */
    attention_case(&(att_case){"tests/data/mixtral-tiny", 1, 9, 0, 20, 14});
}

/* More visible keys than a block has threads (ATT_THREADS = 128: each thread several keys in the
 * scores, the softmax's reductions over partial sums), full and windowed. */
static void test_attention_long(void) {
    need_emulator();
    attention_case(&(att_case){"tests/data/qwen3moe-tiny", 0, 0, 0, 150, 140});
    attention_case(&(att_case){"tests/data/mixtral-tiny", 0, 131, 0, 150, 137});
}

/* The refusals of the emulated entry point (decode.cu's checks). */
static void test_attention_args(void) {
    need_emulator();
    float t[4] = {0};
    const mq_gpu_attn_shape odd = {.D = 4, .H = 2, .KV = 1, .hd = 3, .max_T = 2, .rope_cos = t, .rope_sin = t};
    const mq_gpu_attn_weights w = {.norm = t};
    const int64_t n = 1;
    ASSERT_EQ_INT(MOEQ_E_SHAPE, mq_gpu_kvattn_emulate(&odd, &w, &n, 1, t, NULL, NULL, NULL));
    const mq_gpu_attn_shape sh = {.D = 4, .H = 2, .KV = 1, .hd = 2, .max_T = 2, .rope_cos = t, .rope_sin = t};
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_kvattn_emulate(&sh, &w, &n, 1, t, NULL, NULL, NULL));
}

/* q = RTN of random weights [rows, cols] under s (act_order: columns in random groups), decoded
 * by the emulated device and by mq_dequantize. */
static void dequant_case(const char *what, mq_qspec s, int64_t rows, int64_t cols, float gs, bool act_order) {
    float *w = mq_test_weights(rows, cols, 77);
    mq_qtensor q;
    ASSERT_OK(mq_quantize_rtn(&s, w, rows, cols, gs, what, &q));
    if (act_order) {
        q.g_idx = mq_alloc_array((size_t)cols, sizeof(int32_t), what);
        ASSERT_TRUE(q.g_idx != NULL);
        uint64_t r = 99;
        for (int64_t c = 0; c < cols; c++) q.g_idx[c] = (int32_t)(mq_test_xorshift(&r) % (uint64_t)q.n_groups);
    }
    float *want = malloc(sizeof(float) * (size_t)(rows * cols)), *got = malloc(sizeof(float) * (size_t)(rows * cols));
    mq_dequantize(&q, want);
    ASSERT_OK(mq_gpu_dequantize_emulate(&q, got));
    mq_test_same_floats(want, got, rows * cols, what);
    /* every code of the format appears (the decoder's whole table is checked) */
    bool seen[16] = {false};
    for (int64_t i = 0; i < rows * cols; i++) seen[q.codes[i] & 15] = true;
    for (int c = 0; c < 16; c++)
        if (!seen[c] && !(s.scheme == MQ_QS_INT4 && !s.asym && c == 0)) FAIL("%s: code %d never appears", what, c);
    mq_qtensor_free(&q);
    MQ_FREE_EACH(w, want, got);
}

static void test_dequant(void) {
    need_emulator();
    mq_qspec nv = mq_qspec_default(MQ_QS_NVFP4);
    dequant_case("NVFP4", nv, 40, 256, 0.0f, false);
    nv.nvfp4_conv = MQ_NVFP4_MUL;
    dequant_case("NVFP4, multiplier global scale", nv, 40, 256, 0.0f, false);
    mq_qspec i4 = mq_qspec_default(MQ_QS_INT4);
    i4.group_size = 32;
    dequant_case("INT4 symmetric", i4, 7, 96, 0.0f, false);   /* a tail past the last whole block */
    dequant_case("INT4 symmetric, act-order", i4, 24, 128, 0.0f, true);
    i4.asym = true;
    dequant_case("INT4 asymmetric", i4, 33, 128, 0.0f, false);
    dequant_case("INT4 asymmetric, act-order", i4, 24, 128, 0.0f, true);
    dequant_case("MXFP4", mq_qspec_default(MQ_QS_MXFP4), 40, 256, 0.0f, false);
    /* a K-quant is decoded on the host: refused */
    mq_qtensor k = {.spec = {.scheme = MQ_QS_KQUANT}, .rows = 1, .cols = 32, .group_size = 32, .n_groups = 1};
    float out[32];
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, mq_gpu_dequantize_emulate(&k, out));
}

TEST_MAIN(T(test_attention_olmoe), T(test_attention_grouped_kv), T(test_attention_long), T(test_attention_args), T(test_dequant))
