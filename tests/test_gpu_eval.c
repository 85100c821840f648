/*
 * moeq_eval on a CUDA device (moeq_eval_options.device) against the CPU's evaluation, and the
 * evaluation's device kernels against their CPU twins.
 *
 * Twins (bit-identical unless said): the final norm (vec.h's rmsnorm); the row statistics of
 * given logits (mq_logsumexp, its argmax, mq_entropy_row, mq_kl_rows); the dense MLP's add onto
 * the residual and the shared expert's gated add (mq_shared_expert_add; its sigmoid takes the
 * device's expf, within 2 ulp of libm's: compared within 1e-6 relative); lm_head's cuBLAS product
 * within its rigorous bound gamma_D sum_k |x_k W_ik| of the exact logits.
 *
 * The tolerance of a whole evaluation (u = 2^-24, Z = max|final norm weight| sqrt(D)
 * max_i ||lm_head_i||_2, which bounds sum_k |x_k W_ik| after the final norm):
 *  - a logit differs from the CPU's by at most eps = (h + n_layers * P * p) * Z:
 *    h, the head's product: 2 gamma_D (fp32; both orders within gamma_D = D u / (1 - D u) of the
 *    exact sum, rigorous); p, each of the P = 6 products a layer chains onto the residual stream
 *    (q/k/v, scores, P V, o, gate/up, down), as Higham and Mary's probabilistic bound for a sum
 *    of K terms, lambda sqrt(K) u with lambda = 6, K the longest sum (hidden size, FFN widths,
 *    window length), the perturbations of the layers adding up along the residual without
 *    amplification (an assumption: what is measured stays far below);
 *    tf32x3: per term 3 * 2^-22 more (the hi/lo split, lo*lo dropped) and three sums;
 *    tf32: per term 2 * 2^-11 (both inputs rounded to 10-bit mantissas), worst case;
 *    bf16 (the routed experts on the MoE op, the rest as tf32): per term of the experts'
 *    products 2 * 2^-9 (weights and activations rounded to 8-bit mantissas) and 2^-9 more for the
 *    SwiGLU output rounded before the down product, worst case;
 *  - log-softmax moves by at most 2 max|dz|, so a token's log-likelihood by 2 eps: |dLL| <=
 *    2 eps N over N tokens, likewise per document (the relative form: 2 eps / mean |ll|);
 *  - entropy: |dH| = |Cov_p(dz, log p)| <= 2 eps E_p|log p + H| <= 4 eps H;
 *  - KL(p_b || p_m): |dKL| <= 2 eps_b (KL + 2 TV) + 2 eps_m TV <= 2 eps (KL + 3).
 * A routing choice between two experts within rounding of each other is outside such a bound
 * (a discrete change); the sums over a document absorb the rare one.
 * In fp32 the results do not depend on how windows are grouped on the device (bit for bit).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "backend/gpu.h"
#include "core/core.h"
#include "io/safetensors.h"
#include "eval/eval.h"
#include "harness.h"
#include "kernels/vec.h"
#include "model/model.h"
#include "pipeline/pipeline.h"

void mq_eval_set_gpu_group_rows(int64_t rows);   /* src/eval/eval_gpu.c, for tests */
void mq_eval_set_gpu_resident(bool on);

/* ---- helpers --------------------------------------------------------------------------------- */
static uint64_t g_rng = 1;
static double rnd_unit(void) {
    mq_test_xorshift(&g_rng);
    return ((double)(g_rng >> 11) + 0.5) * 0x1p-53;
}
static float rnd_f(double scale) { return (float)(scale * (2.0 * rnd_unit() - 1.0)); }
static float *rnd_array(int64_t n, double scale) {
    float *x = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = rnd_f(scale);
    return x;
}

static int gpu_present(void) { return mq_gpu_built() && mq_gpu_probe(0) == MOEQ_OK; }

static void need_gpu(void) {
    if (!mq_gpu_built()) SKIP("this build has no CUDA backend (configure with -DMOEQ_CUDA=ON)");
    if (mq_gpu_probe(0) != MOEQ_OK) SKIP("no usable GPU: %s", moeq_last_error());
}

static int same_bits_d(double a, double b) { return memcmp(&a, &b, sizeof a) == 0; }

static moeq_model *open_as(const char *dir, int stream) {
    moeq_model_options o = {.stream = stream};
    return mq_test_open_model(dir, &o);
}

/* Three documents of calibration text of different lengths (several windows each at L = 64). */
static moeq_docs *text_docs(void) {
    static const int len[] = {900, 1500, 200};
    return mq_test_calib_docs(len, 3);
}

enum { L_TEST = 64 };

static void eval_opts(moeq_eval_options *o, double *ll, int device, int prec) {
    *o = mq_test_text_eval(L_TEST, NULL);
    o->doc_loglikelihood = ll;
    o->entropy = 1;
    o->device = device;
    o->gpu_precision = prec;
}

/* ---- the derived tolerance ------------------------------------------------------------------ */
/* eps of the header for the model in dir at precision p (a bound of any logit's difference). */
static double logit_eps(const char *dir, moeq_gpu_precision p) {
    moeq_model *m = open_as(dir, 0);
    const double eps = mq_test_logit_eps(m, p, L_TEST);
    moeq_model_free(m);
    return eps;
}

typedef struct {
    double rel_ll, rel_ll_bound, worst_doc, ent, kl;   /* measured, for the log */
} deviation;

/* a (GPU) against b (CPU) within eps: total and per-document log-likelihood, entropy, KL. */
static deviation check_within(const moeq_eval_result *a, const moeq_eval_result *b, const double *lla,
                              const double *llb, const int64_t *ntok, int n_docs, double eps, double eps_b) {
    deviation dv = {0};
    ASSERT_EQ_INT(b->tokens, a->tokens);
    ASSERT_EQ_INT(b->documents, a->documents);
    const double N = (double)b->tokens;
    dv.rel_ll = fabs(a->loglikelihood - b->loglikelihood) / fabs(b->loglikelihood);
    dv.rel_ll_bound = 2 * eps * N / fabs(b->loglikelihood);
    ASSERT_NEAR(b->loglikelihood, a->loglikelihood, 2 * eps * N);
    for (int d = 0; d < n_docs; d++) {
        ASSERT_NEAR(llb[d], lla[d], 2 * eps * (double)ntok[d]);
        if (ntok[d] > 0) dv.worst_doc = fmax(dv.worst_doc, fabs(lla[d] - llb[d]) / (2 * eps * (double)ntok[d]));
    }
    if (b->has_entropy) {
        ASSERT_TRUE(a->has_entropy);
        ASSERT_NEAR(b->entropy_mean, a->entropy_mean, 4 * eps * b->entropy_mean);
        dv.ent = fabs(a->entropy_mean - b->entropy_mean) / b->entropy_mean;
    }
    if (b->has_kl) {
        ASSERT_TRUE(a->has_kl);
        const double e = fmax(eps, eps_b);
        ASSERT_NEAR(b->kl_mean, a->kl_mean, 2 * e * (b->kl_mean + 3));
        dv.kl = fabs(a->kl_mean - b->kl_mean);
        ASSERT_NEAR(b->base_loglikelihood, a->base_loglikelihood, 2 * eps_b * N);
        ASSERT_NEAR(b->top1_changed, a->top1_changed, 0.02);
    }
    return dv;
}

static void assert_same(const moeq_eval_result *a, const moeq_eval_result *b, const double *lla, const double *llb,
                        int n_docs) {
    ASSERT_TRUE(same_bits_d(a->loglikelihood, b->loglikelihood));
    ASSERT_TRUE(same_bits_d(a->entropy_mean, b->entropy_mean));
    ASSERT_EQ_INT(a->has_kl, b->has_kl);
    if (a->has_kl) {
        ASSERT_TRUE(same_bits_d(a->kl_mean, b->kl_mean));
        ASSERT_TRUE(same_bits_d(a->kl_p99, b->kl_p99));
        ASSERT_TRUE(a->top1_changed == b->top1_changed);
    }
    for (int d = 0; d < n_docs; d++) ASSERT_TRUE(same_bits_d(lla[d], llb[d]));
}

/* ---- everywhere --------------------------------------------------------------------------------- */
/* The derived bounds of every fixture, stated: eps per logit and the relative tolerance of the
 * total log-likelihood it gives on the test's documents (2 eps N / |LL|), per precision. */
static void test_derived_bounds(void) {
    const char *names[] = {"olmoe-tiny", "qwen2moe-tiny", "llama-tiny", "mixtral-tiny", "qwen3moe-tiny",
                           "qwen2moe-dense-tiny"};
    moeq_docs *docs = text_docs();
    for (int i = 0; i < 6; i++) {
        char dir[1024];
        if (i < 3 && i > 0 && !mq_test_have_shared()) continue;
        snprintf(dir, sizeof dir, "%s", i < 3 ? mq_test_model(names[i]) : mq_test_with_tokenizer(names[i]));
        moeq_model *m = open_as(dir, 1);
        double ll[3];
        moeq_eval_options o;
        moeq_eval_result r;
        eval_opts(&o, ll, -1, 0);
        ASSERT_OK(moeq_eval(m, docs, &o, &r));
        printf("  %-20s %lld tokens, mean |ll| %.3f:", names[i], (long long)r.tokens,
               fabs(r.loglikelihood) / (double)r.tokens);
        const char *pn[4] = {"fp32", "tf32x3", "tf32", "bf16"};
        for (int p = 0; p < 4; p++) {
            const double eps = logit_eps(dir, (moeq_gpu_precision)p);
            ASSERT_TRUE(eps > 0 && isfinite(eps));
            printf("  %s eps %.3g rel LL %.3g", pn[p], eps, 2 * eps * (double)r.tokens / fabs(r.loglikelihood));
        }
        printf("\n");
        moeq_model_free(m);
    }
    moeq_docs_free(docs);
}

static void test_options(void) {
    moeq_eval_options o;
    moeq_eval_options_init(&o);
    ASSERT_EQ_INT(-1, o.device);
    ASSERT_EQ_INT(MOEQ_GPU_FP32, o.gpu_precision);
    ASSERT_OK(moeq_eval_options_set(&o, "device", "cuda:1"));
    ASSERT_EQ_INT(1, o.device);
    ASSERT_OK(moeq_eval_options_set(&o, "device", "cpu"));
    ASSERT_EQ_INT(-1, o.device);
    ASSERT_EQ_INT(MOEQ_E_ARG, moeq_eval_options_set(&o, "device", "gpu"));
    ASSERT_ERROR_MENTIONS("--device gpu");
    ASSERT_OK(moeq_eval_options_set(&o, "gpu-precision", "tf32"));
    ASSERT_EQ_INT(MOEQ_GPU_TF32, o.gpu_precision);
    ASSERT_OK(moeq_eval_options_set(&o, "gpu-precision", "bf16"));
    ASSERT_EQ_INT(MOEQ_GPU_BF16, o.gpu_precision);
    ASSERT_EQ_INT(MOEQ_E_ARG, moeq_eval_options_set(&o, "gpu-precision", "fp16"));
}

/* What the GPU lacks is refused before any work, on any machine; no device is a clear error. */
static void test_refusals(void) {
    moeq_docs *docs = text_docs();
    moeq_eval_options o;
    moeq_eval_result r;
    double ll[3];
    /* multi-head latent attention */
    moeq_model *m = open_as(mq_test_with_tokenizer("deepseekv3-tiny"), 1);
    eval_opts(&o, ll, 0, 0);
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("deepseek_v3");
    ASSERT_ERROR_MENTIONS("--device cpu");
    moeq_model_free(m);
    /* the emulated activation quantizer */
    moeq_model_options mo = {.stream = 1, .act_quant = MOEQ_ACT_QUANT_NVFP4};
    ASSERT_OK(moeq_model_open(mq_test_model("olmoe-tiny"), &mo, &m));
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("--act-quant");
    moeq_model_free(m);
    /* a --kl-base the GPU lacks */
    moeq_model *ok = open_as(mq_test_model("olmoe-tiny"), 1);
    ASSERT_OK(moeq_model_open(mq_test_model("olmoe-tiny"), &mo, &m));
    o.kl_base = m;
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, moeq_eval(ok, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("--kl-base");
    o.kl_base = NULL;
    moeq_model_free(m);
    /* no device here: the error names it */
    if (!gpu_present()) {
        ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, moeq_eval(ok, docs, &o, &r));
        ASSERT_ERROR_MENTIONS("cuda:0");
    }
    o.device = 999;
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, moeq_eval(ok, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("cuda:999");
    moeq_model_free(ok);
    moeq_docs_free(docs);
}

/* ---- the twins ------------------------------------------------------------------------------------ */
static void test_twin_final_norm(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t Ds[3] = {67, 256, 2048}, n = 19;
    for (int i = 0; i < 3; i++) {
        const int64_t D = Ds[i];
        float *x = rnd_array(n * D, 3.0), *w = rnd_array(D, 1.5), *cpu = malloc((size_t)(n * D) * 4),
              *gpu = malloc((size_t)(n * D) * 4);
        for (int64_t r = 0; r < n; r++) mq_vec()->rmsnorm(x + r * D, D, w, 1e-6f, cpu + r * D);
        ASSERT_OK(mq_gpu_rmsnorm_rows(g, x, n, D, w, 1e-6f, gpu));
        ASSERT_TRUE(memcmp(cpu, gpu, (size_t)(n * D) * 4) == 0);
        free(x), free(w), free(cpu), free(gpu);
    }
    mq_gpu_close(g);
}

static void test_twin_row_stats(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t Vs[2] = {4099, 4096}, n = 37;
    for (int vi = 0; vi < 2; vi++) {
        const int64_t V = Vs[vi];
        float *l = rnd_array(n * V, 6.0), *lb = rnd_array(n * V, 6.0), *zeros = calloc((size_t)V, 4);
        int32_t *tgt = malloc((size_t)n * 4);
        for (int64_t r = 0; r < n; r++) tgt[r] = (int32_t)(rnd_unit() * (double)V);
        l[3 * V + 100] = l[3 * V + 4000] = 50.0f;   /* a tie for the maximum: the first index */
        for (int64_t i = 0; i < V; i += 7) l[5 * V + i] = -INFINITY;   /* terms that vanish */
        for (int64_t i = 0; i < V; i++) lb[7 * V + i] = l[7 * V + i];   /* KL exactly 0 */
        mq_gpu_row_stats *st = calloc((size_t)n, sizeof *st);
        ASSERT_OK(mq_gpu_row_stats_of(g, l, lb, n, V, tgt, true, st));
        for (int64_t r = 0; r < n; r++) {
            const float *row = l + r * V, *rb = lb + r * V;
            int32_t am = -1, amb = -1;
            const double lse = mq_logsumexp(row, V, &am), lse_b = mq_logsumexp(rb, V, &amb);
            ASSERT_TRUE(same_bits_d(lse, st[r].lse));
            ASSERT_TRUE(same_bits_d(lse_b, st[r].lse_b));
            ASSERT_EQ_INT(am, st[r].argmax);
            ASSERT_EQ_INT(amb, st[r].argmax_b);
            ASSERT_TRUE(row[tgt[r]] == st[r].target && rb[tgt[r]] == st[r].target_b);
            const double ent = mq_entropy_row(row, lse, zeros, V);
            ASSERT_TRUE(same_bits_d(ent, log((double)V) - st[r].ent_kl));
            ASSERT_TRUE(same_bits_d(mq_kl_rows(rb, lse_b, row, lse, V), st[r].kl));
        }
        ASSERT_EQ_INT(100, st[3].argmax);
        ASSERT_TRUE(st[7].kl == 0.0);
        free(l), free(lb), free(zeros), free(tgt), free(st);
    }
    mq_gpu_close(g);
}

/* A dense MLP onto the residual (fmaf by 1) and a shared expert's gated add, against forward.c. */
static void test_twin_mlp_add(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t D = 67, F = 40, ns[2] = {3, 50};
    float *wg = rnd_array(F * D, 0.2), *wu = rnd_array(F * D, 0.2), *wd = rnd_array(D * F, 0.2);
    float *gate = rnd_array(D, 0.3);
    mq_linear lg = {.out = F, .in = D, .w = wg, .det = true}, lu = {.out = F, .in = D, .w = wu, .det = true},
              ld = {.out = D, .in = F, .w = wd, .det = true};
    mq_layer ly;
    memset(&ly, 0, sizeof ly);
    ly.sh_gate_w = gate;
    moeq_model fake;
    memset(&fake, 0, sizeof fake);
    fake.cfg.D = (int32_t)D;
    fake.layers = &ly;
    for (int i = 0; i < 2; i++) {
        const int64_t n = ns[i];
        float *xn = rnd_array(n * D, 1.0), *base = rnd_array(n * D, 1.0);
        float *hg = malloc((size_t)(n * F) * 4), *hu = malloc((size_t)(n * F) * 4), *y = malloc((size_t)(n * D) * 4);
        float *cpu = malloc((size_t)(n * D) * 4), *gpu = malloc((size_t)(n * D) * 4), *sg = malloc((size_t)n * 4);
        int32_t *ident = malloc((size_t)n * 4);
        for (int64_t t = 0; t < n; t++) ident[t] = (int32_t)t;
        ASSERT_OK(mq_mlp_forward(&lg, &lu, &ld, xn, n, hg, hu, y));
        mq_gpu_mlp *m = NULL;
        mq_gpu_buf *bx = NULL, *bo = NULL, *bg = NULL;
        const float *pg = wg, *pu = wu, *pd = wd;
        ASSERT_OK(mq_gpu_mlp_new(g, 1, D, F, &pg, &pu, &pd, 16, &m));
        ASSERT_OK(mq_gpu_buf_new(g, n * D, &bx));
        ASSERT_OK(mq_gpu_buf_new(g, n * D, &bo));
        ASSERT_OK(mq_gpu_buf_new(g, D, &bg));
        ASSERT_OK(mq_gpu_buf_write(bx, 0, n * D, xn));
        ASSERT_OK(mq_gpu_buf_write(bg, 0, D, gate));
        ASSERT_OK(mq_gpu_mlp_inputs_from(m, bx, n));
        ASSERT_OK(mq_gpu_mlp_rows_index(m, ident, n));
        ASSERT_OK(mq_gpu_mlp_reserve_kept(m, n));
        ASSERT_OK(mq_gpu_mlp_run_indexed(m, 0, 0, n, true, NULL, NULL));
        for (int gated = 0; gated < 2; gated++) {
            /* CPU: the residual's axpy by 1 of the dense MLP, or mq_shared_expert_add */
            memcpy(cpu, base, (size_t)(n * D) * 4);
            fake.cfg.shared_gate = gated;
            if (gated) mq_shared_expert_add(&fake, 0, xn, n, y, sg, cpu);
            else
                for (int64_t t = 0; t < n; t++) mq_vec()->axpy(1.0f, y + t * D, cpu + t * D, D);
            ASSERT_OK(mq_gpu_buf_write(bo, 0, n * D, base));
            ASSERT_OK(mq_gpu_mlp_add_kept(m, bo, bx, gated ? bg : NULL, n));
            ASSERT_OK(mq_gpu_buf_read(bo, 0, n * D, gpu));
            if (!gated) ASSERT_TRUE(memcmp(cpu, gpu, (size_t)(n * D) * 4) == 0);
            else
                for (int64_t k = 0; k < n * D; k++) ASSERT_NEAR(cpu[k], gpu[k], 1e-6 * (fabs(cpu[k]) + fabs(y[k])));
        }
        /* the zeroing of a buffer's values */
        ASSERT_OK(mq_gpu_buf_zero(bo, D, D));
        ASSERT_OK(mq_gpu_buf_read(bo, 0, n * D, gpu));
        for (int64_t k = D; k < 2 * D; k++) ASSERT_TRUE(gpu[k] == 0.0f);
        mq_gpu_buf_free(bx), mq_gpu_buf_free(bo), mq_gpu_buf_free(bg);
        mq_gpu_mlp_free(m);
        free(xn), free(base), free(hg), free(hu), free(y), free(cpu), free(gpu), free(sg), free(ident);
    }
    free(wg), free(wu), free(wd), free(gate);
    mq_gpu_close(g);
}

/* lm_head's product within gamma_D sum |x W| of the exact logits, its statistics the CPU's of
 * those logits, in chunks of rows (fp32, then with a temperature). */
static void test_twin_head(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t D = 300, V = 1003, n = 45;
    float *W = rnd_array(V * D, 0.1), *norm = rnd_array(D, 1.0), *x = rnd_array(n * D, 2.0);
    float *xn = malloc((size_t)(n * D) * 4), *lg = malloc((size_t)(n * V) * 4), *zeros = calloc((size_t)V, 4);
    int32_t *tgt = malloc((size_t)n * 4);
    for (int64_t r = 0; r < n; r++) tgt[r] = (int32_t)(r * 17 % V);
    for (int64_t r = 0; r < n; r++) mq_vec()->rmsnorm(x + r * D, D, norm, 1e-5f, xn + r * D);
    mq_gpu_head *h = NULL;
    ASSERT_OK(mq_gpu_head_new(g, D, V, norm, 1e-5f, W, 16, &h));   /* 16 rows a product: 3 chunks */
    ASSERT_EQ_INT(16, mq_gpu_head_rows(h));
    mq_gpu_row_stats *st = calloc((size_t)n, sizeof *st);
    const double u = 0x1p-24, gamma = (double)D * u / (1 - (double)D * u);
    const float temps[2] = {1.0f, 0.7f};
    for (int ti = 0; ti < 2; ti++) {
        ASSERT_OK(mq_gpu_head_score(h, NULL, x, NULL, n, tgt, temps[ti], true, st, lg));
        for (int64_t r = 0; r < n; r++) {
            for (int64_t v = 0; v < V; v++) {
                double exact = 0, mag = 0;
                for (int64_t k = 0; k < D; k++) {
                    exact += (double)xn[r * D + k] * (double)W[v * D + k];
                    mag += fabs((double)xn[r * D + k] * (double)W[v * D + k]);
                }
                /* the division by T: one more rounding */
                const double got = (double)lg[r * V + v] * (double)temps[ti];
                ASSERT_NEAR(exact, got, gamma * mag + 0x1p-23 * fabs(got));
            }
            int32_t am = -1;
            const float *row = lg + r * V;
            const double lse = mq_logsumexp(row, V, &am);
            ASSERT_TRUE(same_bits_d(lse, st[r].lse));
            ASSERT_EQ_INT(am, st[r].argmax);
            ASSERT_TRUE(row[tgt[r]] == st[r].target);
            ASSERT_TRUE(same_bits_d(mq_entropy_row(row, lse, zeros, V), log((double)V) - st[r].ent_kl));
        }
    }
    mq_gpu_head_free(h);
    free(W), free(norm), free(x), free(xn), free(lg), free(zeros), free(tgt), free(st);
    mq_gpu_close(g);
}

/* ---- whole evaluations --------------------------------------------------------------------------- */
static void log_dev(const char *what, const char *mode, const deviation *d) {
    printf("  %-16s %-7s |dLL|/|LL| %.3g (bound %.3g), worst document at %.3g of its bound, entropy rel %.3g",
           what, mode, d->rel_ll, d->rel_ll_bound, d->worst_doc, d->ent);
    if (d->kl > 0) printf(", |dKL| %.3g", d->kl);
    printf("\n");
}

/* The GPU's evaluation of dir against the CPU's: fp32, fp32 in groups of one window (the same
 * bits), tf32x3 and tf32 within their bounds; against itself as --kl-base: KL 0 exactly. */
static void check_family(const char *dir, const char *name, int whole_too) {
    moeq_docs *docs = text_docs();
    moeq_model *m = open_as(dir, 1), *m2 = open_as(dir, 1);
    double ll_c[3], ll_g[3], ll_s[3];
    int64_t ntok[3];
    moeq_eval_options o;
    moeq_eval_result rc, rg, rs;
    eval_opts(&o, ll_c, -1, 0);
    o.doc_tokens = ntok;
    ASSERT_OK(moeq_eval(m, docs, &o, &rc));
    ASSERT_TRUE(rc.tokens > 300 && isfinite(rc.loglikelihood));
    ASSERT_EQ_STR("", rc.device);
    const moeq_gpu_precision precs[4] = {MOEQ_GPU_FP32, MOEQ_GPU_TF32X3, MOEQ_GPU_TF32, MOEQ_GPU_BF16};
    const char *pn[4] = {"fp32", "tf32x3", "tf32", "bf16"};
    for (int p = 0; p < 4; p++) {
        const double eps = logit_eps(dir, precs[p]);
        eval_opts(&o, ll_g, 0, precs[p]);
        ASSERT_OK(moeq_eval(m, docs, &o, &rg));
        ASSERT_TRUE(strstr(rg.device, "cuda:0") != NULL && strstr(rg.device, pn[p]) != NULL);
        deviation dv = check_within(&rg, &rc, ll_g, ll_c, ntok, 3, eps, eps);
        log_dev(name, pn[p], &dv);
        /* the fast mode's stated deviation (docs/gpu.md), far inside its worst-case bound: the
         * total log-likelihood within 1% of the CPU's fp32 one */
        if (precs[p] == MOEQ_GPU_BF16) ASSERT_TRUE(dv.rel_ll <= 1e-2);
        if (p == 0) {
            /* groups of one window: the same bits */
            mq_eval_set_gpu_group_rows(1);
            eval_opts(&o, ll_s, 0, precs[p]);
            ASSERT_OK(moeq_eval(m, docs, &o, &rs));
            mq_eval_set_gpu_group_rows(0);
            assert_same(&rg, &rs, ll_g, ll_s, 3);
            /* the boundary on the host, its rows up and back at every layer: the same bits */
            mq_eval_set_gpu_resident(false);
            eval_opts(&o, ll_s, 0, precs[p]);
            ASSERT_OK(moeq_eval(m, docs, &o, &rs));
            mq_eval_set_gpu_resident(true);
            assert_same(&rg, &rs, ll_g, ll_s, 3);
            /* against itself as the base: the same logits, KL 0 */
            eval_opts(&o, ll_s, 0, precs[p]);
            o.kl_base = m2;
            ASSERT_OK(moeq_eval(m, docs, &o, &rs));
            ASSERT_TRUE(rs.has_kl && rs.kl_mean == 0.0 && rs.top1_changed == 0.0);
            ASSERT_TRUE(same_bits_d(rs.base_loglikelihood, rs.loglikelihood));
            ASSERT_TRUE(same_bits_d(rs.loglikelihood, rg.loglikelihood));
            if (whole_too) {   /* loaded whole: the same layers from memory, the same bits */
                moeq_model *w = open_as(dir, 0);
                eval_opts(&o, ll_s, 0, precs[p]);
                ASSERT_OK(moeq_eval(w, docs, &o, &rs));
                ASSERT_EQ_INT(0, rs.plan.streamed);
                assert_same(&rg, &rs, ll_g, ll_s, 3);
                moeq_model_free(w);
            }
        }
    }
    moeq_model_free(m2);
    moeq_model_free(m);
    moeq_docs_free(docs);
}

/* A bf16 copy of checkpoint src in tmp/name (every F32 tensor rounded to bf16; config and
 * tokenizer copied). malloc'ed path. */
static char *bf16_copy(const char *src, const char *name) {
    char *dir = mq_path_join(mq_test_tmpdir(), name);
    ASSERT_TRUE(dir && mkdir(dir, 0755) == 0);
    const char *files[] = {"config.json", "tokenizer.json", "tokenizer_config.json"};
    for (int i = 0; i < 3; i++) {
        char *from = mq_path_join(src, files[i]), *to = mq_path_join(dir, files[i]), *text = NULL;
        size_t len = 0;
        if (mq_read_file(from, &text, &len) == MOEQ_OK) ASSERT_OK(mq_write_file_atomic(to, text, len));
        free(text);
        free(from);
        free(to);
    }
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_dir_files(src, &st));
    mq_st_writer *w = mq_stw_new();
    for (size_t i = 0; i < mq_st_count(st); i++) {
        const mq_tensor_view *v = mq_st_at(st, i);
        if (v->dtype != MOEQ_DT_F32) {
            ASSERT_OK(mq_stw_add(w, v->name, v->dtype, v->ndim, v->shape, v->data, v->nbytes));
            continue;
        }
        float *f = malloc(sizeof(float) * (size_t)v->numel);
        uint16_t *h = malloc(sizeof(uint16_t) * (size_t)v->numel);
        ASSERT_TRUE(f && h);
        ASSERT_OK(mq_tensor_to_f32(v, f));
        for (int64_t j = 0; j < v->numel; j++) h[j] = mq_f32_to_bf16(f[j]);
        ASSERT_OK(mq_stw_add(w, v->name, MOEQ_DT_BF16, v->ndim, v->shape, h, sizeof(uint16_t) * (size_t)v->numel));
        free(f);
        free(h);
    }
    mq_test_write_model_st(w, dir);
    mq_st_close(st);
    return dir;
}

/* m's evaluation of docs on GPU 0 at precision prec against the CPU's (fp32), both with base as
 * --kl-base (NULL: none), within check_within's bounds for eps and eps_b. */
static deviation cpu_against_gpu(const moeq_model *m, const moeq_model *base, const moeq_docs *docs, int prec,
                                 double eps, double eps_b) {
    double ll_c[3], ll_g[3];
    int64_t ntok[3];
    moeq_eval_options o;
    moeq_eval_result rc, rg;
    eval_opts(&o, ll_c, -1, 0);
    o.kl_base = base;
    o.doc_tokens = ntok;
    ASSERT_OK(moeq_eval(m, docs, &o, &rc));
    eval_opts(&o, ll_g, 0, prec);
    o.kl_base = base;
    ASSERT_OK(moeq_eval(m, docs, &o, &rg));
    return check_within(&rg, &rc, ll_g, ll_c, ntok, 3, eps, eps_b);
}

/* A bf16 checkpoint in the bf16 mode: its experts go up as stored (no fp32 copy on the host);
 * against the CPU's fp32 evaluation of the same bf16 values, within the mode's stated 1%. */
static void test_bf16_source(void) {
    need_gpu();
    char *dir = bf16_copy(mq_test_model("olmoe-tiny"), "olmoe-bf16");
    moeq_docs *docs = text_docs();
    moeq_model *m = open_as(dir, 1);
    deviation dv = cpu_against_gpu(m, NULL, docs, MOEQ_GPU_BF16, logit_eps(dir, MOEQ_GPU_BF16),
                                   logit_eps(dir, MOEQ_GPU_BF16));
    log_dev("olmoe-tiny bf16", "bf16", &dv);
    ASSERT_TRUE(dv.rel_ll <= 1e-2);
    moeq_model_free(m);
    moeq_docs_free(docs);
    free(dir);
}

static void test_olmoe(void) {
    need_gpu();
    check_family(mq_test_model("olmoe-tiny"), "olmoe-tiny", 1);
}
static void test_qwen2moe(void) {
    need_gpu();
    if (!mq_test_have_shared()) SKIP("the shared fixtures folder is missing (MOEQ_SHARED)");
    check_family(mq_test_model("qwen2moe-tiny"), "qwen2moe-tiny", 0);
}
static void test_llama(void) {
    need_gpu();
    if (!mq_test_have_shared()) SKIP("the shared fixtures folder is missing (MOEQ_SHARED)");
    check_family(mq_test_model("llama-tiny"), "llama-tiny", 1);
}
static void test_bundled_families(void) {
    need_gpu();
    const char *names[] = {"mixtral-tiny", "qwen3moe-tiny", "qwen2moe-dense-tiny"};
    char dir[1024];
    for (int i = 0; i < 3; i++) {
        snprintf(dir, sizeof dir, "%s", mq_test_with_tokenizer(names[i]));
        check_family(dir, names[i], 0);
    }
}

/* A quantized checkpoint (INT4, dequantized as it streams) beside its source as --kl-base: the
 * GPU's KL, base and model log-likelihoods within the bound of the CPU's; the boundary in files
 * gives the in-memory run's bits; the saved logits of a GPU run read back by a GPU run give KL 0;
 * opened packed, it is refused. */
static void test_quantized_kl(void) {
    need_gpu();
    const char *src = mq_test_model("olmoe-tiny");
    char *dir = mq_path_join(mq_test_tmpdir(), "olmoe-int4");
    mq_pipeline_opts q;
    mq_pipeline_opts_init(&q, MQ_QS_INT4, MQ_FMT_CT);
    q.spec.group_size = 32;
    ASSERT_OK(mq_pipeline_run(src, dir, &q, NULL));
    moeq_docs *docs = text_docs();
    moeq_model *m = open_as(dir, 1), *b = open_as(src, 1);
    double ll_c[3], ll_g[3], ll_f[3], kl_c[3], kl_g[3];
    int64_t ntok[3];
    moeq_eval_options o;
    moeq_eval_result rc, rg, rf;
    eval_opts(&o, ll_c, -1, 0);
    o.kl_base = b;
    o.doc_kl = kl_c;
    o.doc_tokens = ntok;
    ASSERT_OK(moeq_eval(m, docs, &o, &rc));
    ASSERT_TRUE(rc.has_kl && rc.kl_mean > 0);
    eval_opts(&o, ll_g, 0, 0);
    o.kl_base = b;
    o.doc_kl = kl_g;
    ASSERT_OK(moeq_eval(m, docs, &o, &rg));
    const double eps = logit_eps(dir, MOEQ_GPU_FP32), eps_b = logit_eps(src, MOEQ_GPU_FP32);
    deviation dv = check_within(&rg, &rc, ll_g, ll_c, ntok, 3, eps, eps_b);
    log_dev("olmoe-int4 / KL", "fp32", &dv);
    /* the boundary in files */
    eval_opts(&o, ll_f, 0, 0);
    o.kl_base = b;
    o.dry_run = 1;
    ASSERT_OK(moeq_eval(m, docs, &o, &rf));
    o.dry_run = 0;
    o.max_memory = rf.plan.peak_bytes - rf.plan.boundary_bytes * 3 / 2;
    ASSERT_OK(moeq_eval(m, docs, &o, &rf));
    ASSERT_EQ_INT(0, rf.plan.boundary_in_memory[0] + rf.plan.boundary_in_memory[1]);
    assert_same(&rg, &rf, ll_g, ll_f, 3);
    /* saved logits, written and read on the device */
    char *path = mq_path_join(mq_test_tmpdir(), "gpu.topk");
    eval_opts(&o, ll_f, 0, 0);
    o.save_logits = path;
    ASSERT_OK(moeq_eval(m, docs, &o, &rf));
    ASSERT_TRUE(same_bits_d(rf.loglikelihood, rg.loglikelihood));
    eval_opts(&o, ll_f, 0, 0);
    o.kl_logits = path;
    ASSERT_OK(moeq_eval(m, docs, &o, &rf));
    ASSERT_TRUE(rf.has_kl && fabs(rf.kl_mean) < 1e-9 && rf.top1_changed == 0.0);
    free(path);
    moeq_model_free(m);
    /* packed: refused, saying how to open it */
    moeq_model_options po = {.stream = 1, .keep_packed = 1};
    ASSERT_OK(moeq_model_open(dir, &po, &m));
    eval_opts(&o, ll_f, 0, 0);
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, moeq_eval(m, docs, &o, &rf));
    ASSERT_ERROR_MENTIONS("keep_packed");
    moeq_model_free(m);
    moeq_model_free(b);
    moeq_docs_free(docs);
    free(dir);
}

/* Two different models (qwen2moe-tiny against llama-tiny as base): KL within the bound. */
static void test_kl_pair(void) {
    need_gpu();
    if (!mq_test_have_shared()) SKIP("the shared fixtures folder is missing (MOEQ_SHARED)");
    char md[1024], bd[1024];
    snprintf(md, sizeof md, "%s", mq_test_model("qwen2moe-tiny"));
    snprintf(bd, sizeof bd, "%s", mq_test_model("llama-tiny"));
    moeq_docs *docs = text_docs();
    moeq_model *m = open_as(md, 1), *b = open_as(bd, 1);
    deviation dv = cpu_against_gpu(m, b, docs, 0, logit_eps(md, MOEQ_GPU_FP32), logit_eps(bd, MOEQ_GPU_FP32));
    log_dev("qwen2moe/llama KL", "fp32", &dv);
    moeq_model_free(m);
    moeq_model_free(b);
    moeq_docs_free(docs);
}

TEST_MAIN(T(test_bf16_source), T(test_options), T(test_derived_bounds), T(test_refusals), T(test_twin_final_norm), T(test_twin_row_stats), T(test_twin_mlp_add),
          T(test_twin_head), T(test_olmoe), T(test_qwen2moe), T(test_llama), T(test_bundled_families),
          T(test_quantized_kl), T(test_kl_pair))
