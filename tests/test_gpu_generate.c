/*
 * Sessions on a CUDA device (moeq_session_create_ex with a device; `moeq generate --device cuda`)
 * against the CPU's sessions (moeq_session_forward on the same model): a prompt's logits in one
 * prefill, then 8 decode steps' logits; the decode steps against the whole sequence in one call
 * (the KV cache on the device); greedy generation; the refusals. The GPU cases skip with a
 * message where there is no GPU or no CUDA build; the refusals without a GPU run everywhere.
 *
 * The tolerance of the fp32 mode (test_gpu_eval.c's, derived there; u = 2^-24): a logit differs
 * from the CPU's by at most eps = (2 gamma_D + n_layers * 6 * lambda sqrt(K) u) * Z, with Z =
 * max|final norm weight| sqrt(D) max_i ||lm_head_i||_2 bounding sum_k |x_k W_ik| after the final
 * norm, gamma_D = D u / (1 - D u) for lm_head's two fp32 sums (rigorous), and for each of the 6
 * products a layer chains onto the residual (q/k/v, scores, P V, o, gate/up, down) Higham and
 * Mary's probabilistic bound lambda sqrt(K) u of a sum of K terms (lambda = 6, K the longest sum:
 * the hidden size, the FFN widths, the positions attended, H * hd), the layers' perturbations
 * adding up along the residual without amplification (an assumption; test_gpu_eval measures
 * evaluations far inside it). The bf16 mode (the routed experts on the bf16 tensor cores, the
 * rest as tf32) adds per term 3 * 2^-9 (weights, activations and the SwiGLU output rounded to
 * bf16) in the layers and 2 * 2^-11 in the tf32 head, a loose worst case.
 *
 * Quantized checkpoints (olmoe-tiny as NVFP4 and INT4, made here): the GPU's experts are the CPU
 * packed kernels' arithmetic bit for bit for the same routing (docs/gpu.md), but its attention
 * Linears run in fp32 on the dequantized weights where the CPU's packed path rounds their
 * inputs to 16-bit integer blocks. So the GPU is compared with the CPU session of the packed
 * model within eps + 2 d, d the largest logit difference between the CPU's packed and
 * dequantized sessions on the same tokens (measured here): the packed path's input rounding, of
 * which the GPU keeps only the experts' part (a measured bound, justified by that inclusion; the
 * factor 2 for the attention's share being as large as the whole in the worst case).
 *
 * A routing choice between two experts within rounding of each other would be a discrete change
 * outside these bounds; with these fixtures' tokens none is near (the CPU's top-k margins are
 * printed when a comparison fails).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/gpu.h"
#include "core/core.h"
#include "harness.h"
#include "model/model.h"
#include "pipeline/pipeline.h"

enum { N_PROMPT = 24, N_STEPS = 8, N_GREEDY = 16 };

static void need_gpu(void) {
    if (!mq_gpu_built()) SKIP("this build has no CUDA backend (configure with -DMOEQ_CUDA=ON)");
    if (mq_gpu_probe(0) != MOEQ_OK) SKIP("no usable GPU: %s", moeq_last_error());
}

static moeq_model *open_model(const char *dir, int packed) {
    moeq_model_options o = {.keep_packed = packed};
    return mq_test_open_model(dir, &o);
}

/* The header's eps for model m (opened with fp32 weights) at precision p over T positions. */
static double logit_eps(const moeq_model *m, moeq_gpu_precision p, int64_t T) { return mq_test_logit_eps(m, p, T); }

/* Token ids for the comparisons: spread over the vocabulary, the same every run. */
static void test_ids(int32_t *ids, int n, int32_t V) {
    uint64_t r = 12345;
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(mq_test_xorshift(&r) % (uint64_t)V);
}

/* logits [N_PROMPT + N_STEPS, V]: the prompt's rows in one call, then one step per token. */
static void run_steps(moeq_session *s, const int32_t *ids, int32_t V, float *logits) {
    ASSERT_OK(moeq_session_forward(s, ids, N_PROMPT, logits));
    for (int i = 0; i < N_STEPS; i++)
        ASSERT_OK(moeq_session_forward(s, ids + N_PROMPT + i, 1, logits + (size_t)(N_PROMPT + i) * (size_t)V));
    ASSERT_EQ_INT(N_PROMPT + N_STEPS, moeq_session_pos(s));
}

static moeq_session *session(const moeq_model *m, int device, moeq_gpu_precision p) {
    moeq_session_options o;
    moeq_session_options_init(&o);
    o.device = device;
    o.gpu_precision = p;
    moeq_session *s = NULL;
    ASSERT_OK(moeq_session_create_ex(m, N_PROMPT + N_STEPS + N_GREEDY, &o, &s));
    return s;
}

static double max_abs_diff(const float *a, const float *b, size_t n) {
    double d = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - (double)b[i]);
        if (isnan(e)) return e;   /* fails every bound */
        if (e > d) d = e;
    }
    return d;
}

/* Greedy ids after the prompt ids[0 .. N_PROMPT) from session s. */
static void greedy(moeq_session *s, const int32_t *ids, int32_t V, int32_t *out) {
    float *l = malloc((size_t)V * sizeof *l);
    ASSERT_OK(moeq_session_forward(s, ids, N_PROMPT - 1, NULL));
    ASSERT_OK(moeq_session_forward(s, ids + N_PROMPT - 1, 1, l));
    for (int i = 0; i < N_GREEDY; i++) {
        out[i] = mq_test_argmax(l, V);
        if (i + 1 < N_GREEDY) ASSERT_OK(moeq_session_forward(s, &out[i], 1, l));
    }
    free(l);
}

/* Model m on the GPU at precision p against the CPU session of ref (the same model, or the
 * packed one), within tol: the prefill and decode rows; in fp32 the whole sequence at once
 * within eps of the steps (the KV cache) and greedy ids equal to the CPU's (`greedy_too`). */
static void check(const char *name, const moeq_model *m, const moeq_model *ref, moeq_gpu_precision p, double tol,
                  double eps, int greedy_too) {
    const int32_t V = m->cfg.vocab, n = N_PROMPT + N_STEPS;
    int32_t ids[N_PROMPT + N_STEPS];
    test_ids(ids, n, V);
    const size_t nl = (size_t)n * (size_t)V;
    float *lc = malloc(nl * sizeof *lc), *lg = malloc(nl * sizeof *lg), *la = malloc(nl * sizeof *la);
    moeq_session *c = session(ref, -1, MOEQ_GPU_FP32), *g = session(m, 0, p);
    ASSERT_TRUE(strncmp(moeq_session_device(g), "cuda:0 ", 7) == 0);
    run_steps(c, ids, V, lc);
    run_steps(g, ids, V, lg);
    const double d_pre = max_abs_diff(lc, lg, (size_t)N_PROMPT * (size_t)V);
    const double d_dec = max_abs_diff(lc + (size_t)N_PROMPT * (size_t)V, lg + (size_t)N_PROMPT * (size_t)V,
                                      (size_t)N_STEPS * (size_t)V);
    printf("  %-16s %-5s prefill max|dlogit| %.3g, decode %.3g (bound %.3g)\n", name,
           mq_gpu_precision_name(p), d_pre, d_dec, tol);
    ASSERT_TRUE(d_pre <= tol);
    ASSERT_TRUE(d_dec <= tol);
    if (p == MOEQ_GPU_FP32) {
        /* the whole sequence in one call: the cache's keys and values are those of the steps */
        moeq_session_reset(g);
        ASSERT_EQ_INT(0, moeq_session_pos(g));
        ASSERT_OK(moeq_session_forward(g, ids, n, la));
        const double d_all = max_abs_diff(lg, la, nl);
        printf("  %-16s one call against steps: max|dlogit| %.3g (bound %.3g)\n", name, d_all, eps);
        ASSERT_TRUE(d_all <= eps);
    }
    if (greedy_too) {
        int32_t gc[N_GREEDY], gg[N_GREEDY];
        moeq_session_reset(c);
        moeq_session_reset(g);
        greedy(c, ids, V, gc);
        greedy(g, ids, V, gg);
        for (int i = 0; i < N_GREEDY; i++) ASSERT_EQ_INT(gc[i], gg[i]);
    }
    moeq_session_free(c);
    moeq_session_free(g);
    free(lc);
    free(lg);
    free(la);
}

/* An unquantized fixture in fp32 (greedy ids too) and bf16. */
static void check_fixture(const char *dir, const char *name) {
    moeq_model *m = open_model(dir, 0);
    const int64_t T = N_PROMPT + N_STEPS + N_GREEDY;
    const double e32 = logit_eps(m, MOEQ_GPU_FP32, T), e16 = logit_eps(m, MOEQ_GPU_BF16, T);
    check(name, m, m, MOEQ_GPU_FP32, e32, e32, 1);
    check(name, m, m, MOEQ_GPU_BF16, e16, e32, 0);
    moeq_model_free(m);
}

static void test_olmoe(void) {
    need_gpu();
    check_fixture(mq_test_model("olmoe-tiny"), "olmoe-tiny");
}

/* A fixture of the shared folder (skipped without it). */
static void check_shared_fixture(const char *name) {
    need_gpu();
    if (!mq_test_have_shared()) SKIP("the shared fixtures folder is missing (MOEQ_SHARED)");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", mq_test_model(name));
    check_fixture(dir, name);
}

static void test_qwen2moe(void) { check_shared_fixture("qwen2moe-tiny"); }

static void test_llama(void) { check_shared_fixture("llama-tiny"); }

/* olmoe-tiny quantized to `scheme` here (attention Linears too), run from its codes: against the
 * CPU's packed session within the header's eps + 2 d; opened packed (the attention Linears' codes
 * decoded on the device) or dequantized (the loader's fp32 weights go up), the GPU session gives
 * the same bits: the device's decoder is mq_dequantize's twin. */
static void check_quantized(mq_qscheme scheme, int64_t group, const char *name) {
    need_gpu();
    char *dir = mq_path_join(mq_test_tmpdir(), name);
    mq_pipeline_opts q;
    mq_pipeline_opts_init(&q, scheme, MQ_FMT_CT);
    if (group > 0) q.spec.group_size = group;
    ASSERT_OK(mq_pipeline_run(mq_test_model("olmoe-tiny"), dir, &q, NULL));
    moeq_model *mp = open_model(dir, 1), *md = open_model(dir, 0);
    ASSERT_TRUE(mp->n_packed > 0);
    const int32_t V = md->cfg.vocab, n = N_PROMPT + N_STEPS;
    int32_t ids[N_PROMPT + N_STEPS];
    test_ids(ids, n, V);
    const size_t nl = (size_t)n * (size_t)V;
    float *lp = malloc(nl * sizeof *lp), *ld = malloc(nl * sizeof *ld), *g1 = malloc(nl * sizeof *g1);
    moeq_session *sp = session(mp, -1, MOEQ_GPU_FP32), *sd = session(md, -1, MOEQ_GPU_FP32);
    run_steps(sp, ids, V, lp);
    run_steps(sd, ids, V, ld);
    const double d = max_abs_diff(lp, ld, nl), eps = logit_eps(md, MOEQ_GPU_FP32, N_PROMPT + N_STEPS + N_GREEDY);
    printf("  %-16s CPU packed against dequantized: max|dlogit| %.3g\n", name, d);
    ASSERT_TRUE(d > 0 && isfinite(d));   /* the packed path rounds its inputs */
    moeq_session_free(sp);
    moeq_session_free(sd);
    check(name, mp, mp, MOEQ_GPU_FP32, eps + 2 * d, eps, 0);
    /* the model opened dequantized: the same weights on the device, the same bits */
    moeq_session *a = session(mp, 0, MOEQ_GPU_FP32), *b = session(md, 0, MOEQ_GPU_FP32);
    run_steps(a, ids, V, g1);
    run_steps(b, ids, V, lp);
    mq_test_same_floats(g1, lp, (int64_t)nl, "GPU logits, model opened packed / dequantized");
    moeq_session_free(a);
    moeq_session_free(b);
    /* bf16: the looser bound, the packed path's rounding on top */
    check(name, mp, mp, MOEQ_GPU_BF16, logit_eps(md, MOEQ_GPU_BF16, N_PROMPT + N_STEPS + N_GREEDY) + 2 * d, eps, 0);
    moeq_model_free(mp);
    moeq_model_free(md);
    free(lp);
    free(ld);
    free(g1);
    free(dir);
}

static void test_nvfp4(void) { check_quantized(MQ_QS_NVFP4, 0, "olmoe-nvfp4"); }
static void test_int4(void) { check_quantized(MQ_QS_INT4, 32, "olmoe-int4"); }

/* A bound too small for the model is refused before anything goes up, naming the bytes. */
static void test_memory_bound(void) {
    need_gpu();
    moeq_model *m = open_model(mq_test_model("olmoe-tiny"), 1);
    moeq_session_options o;
    moeq_session_options_init(&o);
    ASSERT_OK(moeq_session_options_set(&o, "device", "cuda:0"));
    ASSERT_OK(moeq_session_options_set(&o, "max-gpu-memory", "1MB"));
    moeq_session *s = (moeq_session *)&o;   /* set to NULL on failure */
    ASSERT_STATUS(MOEQ_E_NOMEM, moeq_session_create_ex(m, 64, &o, &s));
    ASSERT_TRUE(s == NULL);
    ASSERT_ERROR_MENTIONS("GB on the GPU");
    ASSERT_ERROR_MENTIONS("--max-gpu-memory");
    moeq_model_free(m);
}

/* ---- everywhere: the options and the refusals ------------------------------------------------ */
static void test_options(void) {
    moeq_session_options o;
    moeq_session_options_init(&o);
    ASSERT_EQ_INT(-1, o.device);
    ASSERT_EQ_INT(MOEQ_GPU_FP32, o.gpu_precision);
    ASSERT_EQ_INT(0, o.max_gpu_memory);
    ASSERT_OK(moeq_session_options_set(&o, "device", "cuda:3"));
    ASSERT_EQ_INT(3, o.device);
    ASSERT_OK(moeq_session_options_set(&o, "device", "cpu"));
    ASSERT_EQ_INT(-1, o.device);
    ASSERT_OK(moeq_session_options_set(&o, "gpu-precision", "bf16"));
    ASSERT_EQ_INT(MOEQ_GPU_BF16, o.gpu_precision);
    ASSERT_OK(moeq_session_options_set(&o, "max-gpu-memory", "2GiB"));
    ASSERT_EQ_INT((int64_t)2 << 30, o.max_gpu_memory);
    ASSERT_STATUS(MOEQ_E_ARG, moeq_session_options_set(&o, "device", "gpu"));
    ASSERT_ERROR_MENTIONS("device=gpu");
    ASSERT_STATUS(MOEQ_E_ARG, moeq_session_options_set(&o, "gpu-precision", "fp16"));
    ASSERT_ERROR_MENTIONS("gpu-precision=fp16");
    ASSERT_STATUS(MOEQ_E_ARG, moeq_session_options_set(&o, "threads", "4"));
    ASSERT_ERROR_MENTIONS("threads");
}

/* Without a GPU (or a CUDA build) a device is MOEQ_E_UNSUPPORTED, nothing made; a model the GPU
 * pieces lack is refused first, naming what it has, with or without a GPU. */
static void test_refusals(void) {
    moeq_model *m = open_model(mq_test_model("olmoe-tiny"), 1);
    moeq_session_options o;
    moeq_session_options_init(&o);
    o.device = 0;
    moeq_session *s = (moeq_session *)&o;
    if (!mq_gpu_built() || mq_gpu_probe(0) != MOEQ_OK) {
        ASSERT_STATUS(MOEQ_E_UNSUPPORTED, moeq_session_create_ex(m, 64, &o, &s));
        ASSERT_TRUE(s == NULL);
        ASSERT_ERROR_MENTIONS("cuda:0");
    }
    o.device = 999;   /* no such device: refused the same way on a GPU machine */
    s = (moeq_session *)&o;
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, moeq_session_create_ex(m, 64, &o, &s));
    ASSERT_TRUE(s == NULL);
    /* a bad precision value through the struct */
    o.device = 0;
    o.gpu_precision = 7;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_session_create_ex(m, 64, &o, &s));
    moeq_model_free(m);
    /* the emulated activation quantizer: the GPU session lacks it */
    moeq_model_options mo = {.act_quant = MOEQ_ACT_QUANT_NVFP4};
    m = mq_test_open_model(mq_test_model("olmoe-tiny"), &mo);
    o.gpu_precision = MOEQ_GPU_FP32;
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, moeq_session_create_ex(m, 64, &o, &s));
    ASSERT_ERROR_MENTIONS("act-quant");
    moeq_model_free(m);
    /* the CPU is the default, and NULL options are the CPU */
    m = open_model(mq_test_model("olmoe-tiny"), 1);
    moeq_session_options_init(&o);
    ASSERT_OK(moeq_session_create_ex(m, 8, &o, &s));
    ASSERT_EQ_STR("cpu", moeq_session_device(s));
    moeq_session_free(s);
    ASSERT_OK(moeq_session_create_ex(m, 8, NULL, &s));
    ASSERT_EQ_STR("cpu", moeq_session_device(s));
    moeq_session_free(s);
    moeq_model_free(m);
}

TEST_MAIN(T(test_options), T(test_refusals), T(test_memory_bound), T(test_olmoe), T(test_qwen2moe), T(test_llama),
          T(test_nvfp4), T(test_int4))
