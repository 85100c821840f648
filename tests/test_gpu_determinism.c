/*
 * GPTQ on the GPU gives the same bits whichever way its inputs come: a weight and its Hessian in
 * host memory (mq_gpu_gptq), or already on the device as the pipeline holds them after its
 * calibration pass (the weight as an expert's Linear of an mq_gpu_mlp, the Hessian as a device
 * sum, mq_gpu_gptq_ex). `moeq bench gptq --device cuda` once printed "from host memory
 * (DIFFERENT codes)": its Hessian was an sgemm's X X^T, whose two triangles differ in rounding
 * (a tenth of the pairs at K = 2048 with OpenBLAS), and the host path factored the upper triangle
 * as given while a device sum is its lower triangle mirrored. Both now read the lower triangle;
 * these cases give the GPU such a Hessian on purpose (made more lopsided still), in the modes the
 * column loop has, fp32 and TF32, run to run, and fail on any differing code, parameter, global
 * scale or loss. A device sum set with mq_gpu_hessians_set right before the call is read after
 * its copy has landed (it went on the legacy stream before, unordered with the work).
 *
 * Without a GPU (or in a build without CUDA) every case skips with a message.
 */
#include <stdlib.h>

#include "backend/gpu.h"
#include "core/core.h"
#include "harness.h"
#include "quant/gptq.h"

static bool same_float(float a, float b) { return mq_test_f32_bits(a) == mq_test_f32_bits(b); }

static float *weights(int64_t N, int64_t K, uint64_t seed) {
    mq_test_rng = seed;
    float *w = malloc((size_t)(N * K) * sizeof(float));
    for (int64_t i = 0; i < N * K; i++) w[i] = (float)(0.02 * mq_test_rnd_normal() * (mq_test_rnd_unit() < 0.01 ? 6 : 1));
    return w;
}

/* H = (2/T) X X^T of T = 2K random rows with uneven feature scales, as the benchmark makes it (a
 * tiled sgemm: its triangles differ in rounding); then every 7th pair above the diagonal moved by
 * a few ulps more, so the triangles differ whatever the host's BLAS. *asym: pairs that differ. */
static float *lopsided_hessian(int64_t K, uint64_t seed, int64_t *asym) {
    mq_test_rng = seed;
    const int64_t T = 2 * K;
    float *xt = malloc((size_t)(K * T) * sizeof(float)), *h = malloc((size_t)(K * K) * sizeof(float));
    for (int64_t k = 0; k < K; k++) {
        const double s = exp(0.5 * mq_test_rnd_normal());
        for (int64_t t = 0; t < T; t++) xt[k * T + t] = (float)(s * mq_test_rnd_normal());
    }
    mq_gemm_nt(K, K, T, 2.0f / (float)T, xt, T, xt, T, 0.0f, h, K);
    free(xt);
    for (int64_t a = 0; a < K; a++)
        for (int64_t b = a + 1; b < K; b += 7) h[a * K + b] *= 1.0f + 4 * 0x1p-23f;
    *asym = 0;
    for (int64_t a = 0; a < K; a++)
        for (int64_t b = a + 1; b < K; b++) *asym += h[a * K + b] != h[b * K + a];
    return h;
}

typedef struct {
    const char *name;
    mq_qspec s;
    mq_gptq_opts o;
} mode;

static int modes(mode *m) {
    int n = 0;
    m[n] = (mode){"nvfp4", mq_qspec_default(MQ_QS_NVFP4), mq_gptq_opts_default()};
    n++;
    m[n] = (mode){"nvfp4 act-order mse", mq_qspec_default(MQ_QS_NVFP4), mq_gptq_opts_default()};
    m[n].s.mse = true;
    m[n].o.act_order = true;
    n++;
    m[n] = (mode){"int4 g128 act-order g_idx", mq_qspec_default(MQ_QS_INT4), mq_gptq_opts_default()};
    m[n].s.group_size = 128;
    m[n].o.act_order = true;
    m[n].o.groups = MQ_GPTQ_GROUPS_GIDX;
    n++;
    return n;
}

/* What a call gave, compared bit for bit. */
static void expect_same(const char *what, const mq_qtensor *a, const mq_gptq_stats *sa, const mq_qtensor *b,
                        const mq_gptq_stats *sb) {
    const int64_t n = a->rows * a->cols;
    int64_t codes = 0, params = 0;
    for (int64_t i = 0; i < n; i++) codes += a->codes[i] != b->codes[i];
    for (int64_t i = 0; i < a->rows * a->n_groups; i++)
        params += !same_float(a->params[i].scale, b->params[i].scale) ||
                  !same_float(a->params[i].zero, b->params[i].zero) ||
                  a->params[i].scale_code != b->params[i].scale_code;
    if (codes || params)
        FAIL("%s: %lld of %lld codes and %lld of %lld group parameters differ", what, (long long)codes,
             (long long)n, (long long)params, (long long)(a->rows * a->n_groups));
    if (!same_float(a->global_scale, b->global_scale))
        FAIL("%s: global scale %.9g against %.9g", what, (double)a->global_scale, (double)b->global_scale);
    if (!(sa->loss == sb->loss)) FAIL("%s: loss %.17g against %.17g", what, sa->loss, sb->loss);
    ASSERT_TRUE(sa->percdamp == sb->percdamp);
    ASSERT_EQ_INT(sa->n_dead, sb->n_dead);
}

/* One weight [N, K] with H: from host memory twice (run to run), from the device (the Hessian set
 * as a sum of n = 2 rows, so (2/n) sum = H exactly; the weight an expert's gate), and from host
 * memory with H's upper triangle replaced by its lower one (what both read). */
static void host_against_device(mq_gpu *g, const mode *m, const float *H, const float *W, int64_t N, int64_t K,
                                const char *prec) {
    char what[160];
    const int64_t Ks[1] = {K};
    const char *hn[1] = {"det.weight"};
    const int32_t jh[1] = {0};
    mq_qtensor q[4];
    mq_gptq_job j[4];
    for (int r = 0; r < 2; r++) {
        j[r] = (mq_gptq_job){.w = W, .rows = N, .name = "det.weight", .out = &q[r]};
        const float *Hs[1] = {H};
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_gptq(g, &m->s, &m->o, Hs, Ks, hn, 1, &j[r], jh, 1));
    }
    snprintf(what, sizeof what, "%s, %s: from host memory, run to run", m->name, prec);
    expect_same(what, &q[0], &j[0].stats, &q[1], &j[1].stats);

    mq_gpu_mlp *mlp = NULL;
    mq_gpu_hessians *hs = NULL;
    const float *w1[1] = {W};
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_new(g, 1, K, N, w1, w1, NULL, 1, &mlp));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 1, Ks, &hs));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_set(hs, 0, H, 2));   /* right before the call */
    const float *none[1] = {NULL};
    const mq_gpu_hsrc dh[1] = {{hs, 0}};
    const mq_gpu_wsrc dw[1] = {{mlp, 0, 0, false}};
    j[2] = (mq_gptq_job){.w = NULL, .rows = N, .name = "det.weight", .out = &q[2]};
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_gptq_ex(g, &m->s, &m->o, none, dh, Ks, hn, 1, &j[2], dw, jh, 1));
    snprintf(what, sizeof what, "%s, %s: resident on the device against from host memory", m->name, prec);
    expect_same(what, &q[0], &j[0].stats, &q[2], &j[2].stats);

    float *Hl = malloc((size_t)(K * K) * sizeof(float));
    memcpy(Hl, H, (size_t)(K * K) * sizeof(float));
    for (int64_t a = 0; a < K; a++)
        for (int64_t b = a + 1; b < K; b++) Hl[a * K + b] = Hl[b * K + a];
    const float *Hs[1] = {Hl};
    j[3] = (mq_gptq_job){.w = W, .rows = N, .name = "det.weight", .out = &q[3]};
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_gptq(g, &m->s, &m->o, Hs, Ks, hn, 1, &j[3], jh, 1));
    snprintf(what, sizeof what, "%s, %s: H's lower triangle mirrored against H as given", m->name, prec);
    expect_same(what, &q[0], &j[0].stats, &q[3], &j[3].stats);
    free(Hl);
    for (int r = 0; r < 4; r++) mq_qtensor_free(&q[r]);
    mq_gpu_mlp_free(mlp);
    mq_gpu_hessians_free(hs);
}

static void test_host_equals_device(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t N = 512, K = 1024;
    int64_t asym = 0;
    float *H = lopsided_hessian(K, 11, &asym), *W = weights(N, K, 12);
    ASSERT_TRUE(asym > K);   /* the case this test is about */
    mode m[8];
    const int nm = modes(m);
    for (int i = 0; i < nm; i++) host_against_device(g, &m[i], H, W, N, K, "fp32");
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_set_precision(g, MOEQ_GPU_TF32));
    host_against_device(g, &m[0], H, W, N, K, "tf32");
    free(H), free(W);
    mq_gpu_close(g);
}

/* The benchmark's shape (4096 x 2048 NVFP4, its defaults): the case it printed. */
static void test_bench_shape(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t N = 4096, K = 2048;
    int64_t asym = 0;
    float *H = lopsided_hessian(K, 21, &asym), *W = weights(N, K, 22);
    mode m[8];
    modes(m);
    host_against_device(g, &m[0], H, W, N, K, "fp32");
    free(H), free(W);
    mq_gpu_close(g);
}

TEST_MAIN(T(test_host_equals_device), T(test_bench_shape))
