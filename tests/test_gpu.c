/*
 * The GPU backend (src/backend/) against its CPU twins. Every device kernel is compared with the
 * C code it mirrors:
 *   codecs, RTN group parameters       bit-identical (the same IEEE operations in the same order)
 *   Hessian sums                       bit-identical (the same fmaf chain per element)
 *   the experts' MLP (det GEMM, SwiGLU) bit-identical (the same chains, moeq's own expf)
 *   GPTQ factor + column loop          the CPU's codes for >= 99.9% of weights, loss within
 *                                      0.5%: both run the same algorithm in fp32, but cuSOLVER's
 *                                      Cholesky and cuBLAS's GEMMs sum in another order than
 *                                      LAPACK's and OpenBLAS's, so a weight whose value lands
 *                                      within a few ulps of a rounding threshold can take the
 *                                      other code; its error is fed back, so a flip can move
 *                                      later codes of its row (a few per flip at most)
 *   GPTQ run to run, and alone against batched with other weights: bit-identical.
 * Without a GPU (or in a build without CUDA) the GPU cases skip with a message; the device
 * parsing and the errors of the no-GPU paths are tested everywhere.
 */
#include <stdlib.h>

#include "backend/gpu.h"
#include "core/env.h"
#include "gpu_attn_twin.h"
#include "harness.h"
#include "kernels/gemm_det.h"
#include "kernels/vec.h"
#include "model/model.h"
#include "quant/gptq.h"
#include "quant/hessian.h"

/* ---- deterministic random data (the harness's mq_test_rnd_*) ------------------------------- */

/* Inputs [T, K] with correlated features and uneven scales; `dead` columns all zero. */
static float *make_inputs(int64_t T, int64_t K, uint64_t seed, int64_t dead) {
    double *xd = mq_test_correlated_inputs(T, K, seed);
    float *x = malloc((size_t)(T * K) * sizeof(float));
    for (int64_t i = 0; i < T * K; i++) x[i] = i % K < dead ? 0.0f : (float)xd[i];
    free(xd);
    return x;
}

/* The CPU's Hessian of those inputs (mq_hessian_*). */
static float *make_hessian(int64_t K, int64_t T, uint64_t seed, int64_t dead) {
    float *x = make_inputs(T, K, seed, dead);
    mq_hessian h;
    ASSERT_EQ_INT(MOEQ_OK, mq_hessian_init(&h, K, "test"));
    mq_hessian_add(&h, x, T);
    float *H = malloc((size_t)(K * K) * sizeof(float));
    mq_hessian_get(&h, H);
    mq_hessian_free(&h);
    free(x);
    return H;
}

static int same_float(float a, float b) {
    return mq_test_f32_bits(a) == mq_test_f32_bits(b) || (isnan(a) && isnan(b));
}

/* Group params field by field (the struct's padding bytes are not data). */
static int params_equal(const mq_gparams *a, const mq_gparams *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!same_float(a[i].scale, b[i].scale) || !same_float(a[i].zero, b[i].zero) ||
            a[i].scale_code != b[i].scale_code)
            return 0;
    return 1;
}

/* ---- everywhere -------------------------------------------------------------------------------- */

static void test_parse_device(void) {
    int d = 7;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_parse_device("cpu", &d));
    ASSERT_EQ_INT(-1, d);
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_parse_device("cuda", &d));
    ASSERT_EQ_INT(0, d);
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_parse_device("cuda:3", &d));
    ASSERT_EQ_INT(3, d);
    const char *bad[] = {"gpu", "cuda:", "cuda:-1", "cuda:1x", "cuda0", "", "CUDA"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_parse_device(bad[i], &d));
        ASSERT_TRUE(strstr(moeq_last_error(), "--device") != NULL);
    }
}

/* A device that does not exist (or a build without CUDA) is a clean error, never a crash. */
static void test_open_missing_device(void) {
    mq_gpu *g = (mq_gpu *)&g;
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, mq_gpu_open(999, &g));
    ASSERT_TRUE(g == NULL);
    const char *msg = moeq_last_error();
    ASSERT_TRUE(strstr(msg, "cuda:999") != NULL);
    if (!mq_gpu_built()) ASSERT_TRUE(strstr(msg, "-DMOEQ_CUDA=ON") != NULL);
    /* the probe the pipeline runs before opening the device on a thread: the same refusal */
    char open_msg[1024];
    snprintf(open_msg, sizeof open_msg, "%s", msg);
    mq_err(MOEQ_OK, "%s", "");
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, mq_gpu_probe(999));
    ASSERT_EQ_STR(open_msg, moeq_last_error());
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, mq_gpu_probe(-1));
}

/* ---- device twins ------------------------------------------------------------------------------ */

static void test_codecs_bitexact(void) {
    mq_gpu *g = mq_test_open_gpu();
    /* every bf16 bit pattern as a float (all exponents, signs, NaN, Inf, subnormals), the
     * midpoints between neighbours, and random floats */
    const int64_t n = 65536 * 2 + 200000;
    float *x = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < 65536; i++) {
        uint32_t b = (uint32_t)i << 16, m = b | 0x8000u;
        memcpy(&x[2 * i], &b, 4);
        memcpy(&x[2 * i + 1], &m, 4);
    }
    mq_test_rng = 99;
    for (int64_t i = 2 * 65536; i < n; i++) x[i] = (float)(mq_test_rnd_normal() * exp(4 * mq_test_rnd_normal()));
    uint8_t *c2 = malloc((size_t)n), *c4 = malloc((size_t)n), *c8 = malloc((size_t)n);
    float *bf = malloc((size_t)n * 4), *hf = malloc((size_t)n * 4);
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_codecs(g, x, n, c2, c4, c8, bf, hf));
    int64_t bad = 0;
    for (int64_t i = 0; i < n && bad < 5; i++) {
        const float v = x[i];
        int ok = c2[i] == mq_e2m1_encode(v) && c4[i] == mq_e4m3_encode(v) &&
                 c8[i] == mq_e8m0_encode_ceil(v) && same_float(bf[i], mq_round_to_dtype(v, MOEQ_DT_BF16)) &&
                 same_float(hf[i], mq_round_to_dtype(v, MOEQ_DT_F16));
        if (!ok) {
            bad++;
            fprintf(stderr, "  x=%a: e2m1 %x/%x e4m3 %x/%x e8m0 %x/%x bf16 %a/%a f16 %a/%a\n", (double)v, c2[i],
                    mq_e2m1_encode(v), c4[i], mq_e4m3_encode(v), c8[i], mq_e8m0_encode_ceil(v), (double)bf[i],
                    (double)mq_round_to_dtype(v, MOEQ_DT_BF16), (double)hf[i], (double)mq_round_to_dtype(v, MOEQ_DT_F16));
        }
    }
    free(x), free(c2), free(c4), free(c8), free(bf), free(hf);
    mq_gpu_close(g);
    ASSERT_EQ_INT(0, bad);
}

static mq_qspec spec_of(mq_qscheme scheme, int64_t group, bool asym, bool mse) {
    mq_qspec s = mq_qspec_default(scheme);
    if (group) s.group_size = group;
    s.asym = asym;
    s.mse = mse;
    return s;
}

/* symmetric INT4 with signed scales (moeq quantize's default) */
static mq_qspec signed_of(int64_t group, bool mse) {
    mq_qspec s = spec_of(MQ_QS_INT4, group, false, mse);
    s.int4_signed_scale = true;
    return s;
}

static void test_rtn_bitexact(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t N = 192, K = 512;
    float *w = mq_test_weights(N, K, 5);
    w[7] = 0.0f;   /* a zero-ish row segment and an exact zero */
    for (int64_t c = 64; c < 96; c++) w[3 * K + c] = 0.0f;
    mq_qspec specs[] = {
        spec_of(MQ_QS_NVFP4, 0, false, false), spec_of(MQ_QS_NVFP4, 0, false, true),
        mq_qspec_reference(MQ_QS_NVFP4),       spec_of(MQ_QS_INT4, 128, false, false),
        spec_of(MQ_QS_INT4, 32, false, true),  spec_of(MQ_QS_INT4, 64, true, true),
        mq_qspec_reference(MQ_QS_INT4),        spec_of(MQ_QS_MXFP4, 0, false, false),
        signed_of(128, false),                 signed_of(32, true),
    };
    for (size_t k = 0; k < sizeof specs / sizeof specs[0]; k++) {
        mq_qtensor a, b;
        ASSERT_EQ_INT(MOEQ_OK, mq_quantize_rtn(&specs[k], w, N, K, 0, "w", &a));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_rtn(g, &specs[k], w, N, K, 0, "w", &b));
        ASSERT_TRUE(same_float(a.global_scale, b.global_scale));
        if (memcmp(a.codes, b.codes, (size_t)(N * K)) || !params_equal(a.params, b.params, N * a.n_groups))
            FAIL("spec %zu (%s group %lld asym %d mse %d): GPU RTN differs from the CPU's", k,
                 mq_qscheme_name(specs[k].scheme), (long long)a.group_size, specs[k].asym, specs[k].mse);
        mq_qtensor_free(&a);
        mq_qtensor_free(&b);
    }
    /* a NaN is refused with the tensor and position named, as on the CPU */
    w[5 * K + 9] = NAN;
    mq_qtensor q;
    ASSERT_EQ_INT(MOEQ_E_NUMERIC, mq_gpu_rtn(g, &specs[0], w, N, K, 0, "blk.w", &q));
    ASSERT_TRUE(strstr(moeq_last_error(), "blk.w") != NULL);
    free(w);
    mq_gpu_close(g);
}

/* Every tile of the deterministic products (the one the grid picks, and each forced) against the
 * CPU's chains. */
static const int det_tiles[] = {0, 128, 64, 32};

static void hessian_bitexact(int tile);

/* Rows arrive in uneven pieces on the GPU and in one piece on the CPU: the same bits. */
static void test_hessian_bitexact(void) {
    for (int t = 0; t < 4; t++) hessian_bitexact(det_tiles[t]);
}

static void hessian_bitexact(int tile) {
    mq_gpu *g = mq_test_open_gpu();
    mq_gpu_force_det_tile(g, tile);
    const int64_t Ks[] = {200, 384, 64};
    const int64_t T = 1500;
    float *x[3];
    for (int i = 0; i < 3; i++) x[i] = make_inputs(T, Ks[i], 40 + (uint64_t)i, i == 1 ? 3 : 0);
    mq_gpu_hessians *hs = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 3, Ks, &hs));
    const int64_t pieces[] = {37, 1, 500, 962};
    for (int i = 0; i < 3; i++) {
        int64_t r = 0;
        for (int p = 0; p < 4; p++) {
            ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_add(hs, i, x[i] + r * Ks[i], pieces[p]));
            r += pieces[p];
        }
    }
    for (int i = 0; i < 3; i++) {
        const int64_t K = Ks[i];
        mq_hessian h;
        ASSERT_EQ_INT(MOEQ_OK, mq_hessian_init(&h, K, "cpu"));
        mq_hessian_add(&h, x[i], T);
        float *a = malloc((size_t)(K * K) * 4), *b = malloc((size_t)(K * K) * 4);
        mq_hessian_get(&h, a);
        int64_t n = 0;
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_get(hs, i, b, &n));
        ASSERT_EQ_INT(T, n);
        int64_t diff = 0;
        for (int64_t e = 0; e < K * K; e++) diff += !same_float(a[e], b[e]);
        if (diff) FAIL("Hessian %d (K %lld), tile %d: %lld of %lld entries differ from the CPU's", i, (long long)K,
                       tile, (long long)diff, (long long)(K * K));
        free(a), free(b);
        mq_hessian_free(&h);
        free(x[i]);
    }
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_hessians_add(hs, 3, NULL, 1));
    mq_gpu_hessians_free(hs);
    mq_gpu_close(g);
}

/* ---- GPTQ -------------------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    mq_qspec s;
    mq_gptq_opts o;
} gptq_mode;

static int n_modes(gptq_mode *m) {
    int n = 0;
    mq_gptq_opts d = mq_gptq_opts_default();
    m[n++] = (gptq_mode){"nvfp4", spec_of(MQ_QS_NVFP4, 0, false, false), d};
    m[n] = (gptq_mode){"nvfp4 act-order", spec_of(MQ_QS_NVFP4, 0, false, false), d};
    m[n++].o.act_order = true;
    m[n] = (gptq_mode){"nvfp4 act-order static", spec_of(MQ_QS_NVFP4, 0, false, false), d};
    m[n].o.act_order = true;
    m[n++].o.groups = MQ_GPTQ_GROUPS_STATIC;
    m[n] = (gptq_mode){"nvfp4 mse obq", spec_of(MQ_QS_NVFP4, 0, false, true), d};
    m[n++].o.mse_weight = MQ_GPTQ_MSE_OBQ;
    m[n] = (gptq_mode){"nvfp4 mse hdiag", spec_of(MQ_QS_NVFP4, 0, false, true), d};
    m[n++].o.mse_weight = MQ_GPTQ_MSE_HDIAG;
    m[n] = (gptq_mode){"nvfp4 mse loop act-order", spec_of(MQ_QS_NVFP4, 0, false, true), d};
    m[n].o.mse_weight = MQ_GPTQ_MSE_LOOP;
    m[n++].o.act_order = true;
    m[n++] = (gptq_mode){"int4 g128", spec_of(MQ_QS_INT4, 128, false, false), d};
    m[n] = (gptq_mode){"int4 g128 act-order g_idx", spec_of(MQ_QS_INT4, 128, false, false), d};
    m[n].o.act_order = true;
    m[n++].o.groups = MQ_GPTQ_GROUPS_GIDX;
    m[n] = (gptq_mode){"int4 g32 asym mse plain block 64", spec_of(MQ_QS_INT4, 32, true, true), d};
    m[n].o.mse_weight = MQ_GPTQ_MSE_PLAIN;
    m[n++].o.block_size = 64;
    m[n] = (gptq_mode){"int4 g128 signed scales mse loop act-order", signed_of(128, true), d};
    m[n].o.mse_weight = MQ_GPTQ_MSE_LOOP;
    m[n++].o.act_order = true;
    m[n++] = (gptq_mode){"mxfp4", spec_of(MQ_QS_MXFP4, 0, false, false), d};
    return n;
}

static double rel(double a, double b) { return fabs(a - b) / fmax(fabs(b), 1e-30); }

/* GPTQ of one weight on the CPU and on the GPU for every mode: parity as the file comment says. */
static void test_gptq_parity(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t N = 256, K = 512;
    float *H = make_hessian(K, 2048, 11, 2);
    float *w = mq_test_weights(N, K, 12);
    gptq_mode m[16];
    const int nm = n_modes(m);
    for (int k = 0; k < nm; k++) {
        mq_qtensor a, b;
        mq_gptq_stats sa;
        ASSERT_EQ_INT(MOEQ_OK, mq_gptq_quantize(&m[k].s, &m[k].o, H, w, N, K, 0, "w", &a, NULL, &sa));
        mq_gptq_job j = {.w = w, .rows = N, .name = "w", .out = &b};
        const float *Hs[] = {H};
        const int64_t Kk[] = {K};
        const char *hn[] = {"H"};
        const int32_t jh[] = {0};
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_gptq(g, &m[k].s, &m[k].o, Hs, Kk, hn, 1, &j, jh, 1));
        int64_t same = 0, same_p = 0;
        for (int64_t e = 0; e < N * K; e++) same += a.codes[e] == b.codes[e];
        for (int64_t e = 0; e < N * a.n_groups; e++)
            same_p += a.params[e].scale_code == b.params[e].scale_code && same_float(a.params[e].scale, b.params[e].scale);
        const double agree = (double)same / (double)(N * K), agree_p = (double)same_p / (double)(N * a.n_groups);
        printf("  %-34s codes %.5f params %.5f loss cpu %.6g gpu %.6g (%.2e) rtn %.6g/%.6g\n", m[k].name, agree,
               agree_p, sa.loss, j.stats.loss, rel(j.stats.loss, sa.loss), sa.rtn_loss, j.stats.rtn_loss);
        if (agree < 0.999) FAIL("%s: only %.4f%% of codes agree with the CPU's", m[k].name, 100 * agree);
        if (agree_p < 0.995) FAIL("%s: only %.4f%% of group params agree with the CPU's", m[k].name, 100 * agree_p);
        if (rel(j.stats.loss, sa.loss) > 5e-3) FAIL("%s: loss %g vs CPU %g", m[k].name, j.stats.loss, sa.loss);
        /* RTN codes are the CPU's; only the product D R sums in another order */
        if (rel(j.stats.rtn_loss, sa.rtn_loss) > 1e-4) FAIL("%s: RTN loss %g vs CPU %g", m[k].name, j.stats.rtn_loss, sa.rtn_loss);
        ASSERT_EQ_INT(sa.n_dead, j.stats.n_dead);
        ASSERT_TRUE(sa.percdamp == j.stats.percdamp);
        ASSERT_TRUE(same_float(a.global_scale, b.global_scale));
        ASSERT_EQ_INT(a.g_idx != NULL, b.g_idx != NULL);
        if (a.g_idx) ASSERT_TRUE(memcmp(a.g_idx, b.g_idx, (size_t)K * 4) == 0);
        mq_qtensor_free(&a);
        mq_qtensor_free(&b);
    }
    free(H), free(w);
    mq_gpu_close(g);
}

/* The column loop's two kernels, a warp per row (MOEQ_DEBUG_GPU_LOOP=warp; the default for calls of
 * few rows) and a thread per row (MOEQ_DEBUG_GPU_LOOP=thread; many rows), compute the same values in
 * the same order: the same codes, params and losses bit for bit in every mode. */
static void test_gptq_warp_equals_thread(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t N = 200, K = 512;
    float *H = make_hessian(K, 1500, 13, 3);
    float *w = mq_test_weights(N, K, 14);
    gptq_mode m[16];
    const int nm = n_modes(m);
    for (int k = 0; k < nm; k++) {
        mq_qtensor q[2];
        mq_gptq_stats st[2];
        for (int v = 0; v < 2; v++) {
            setenv("MOEQ_DEBUG_GPU_LOOP", v ? "thread" : "warp", 1);
            mq_env_reload();   /* the switches are read at a job's start: this test starts one */
            mq_gptq_job j = {.w = w, .rows = N, .name = "w", .out = &q[v]};
            const float *Hs[] = {H};
            const int64_t Kk[] = {K};
            const char *hn[] = {"H"};
            const int32_t jh[] = {0};
            ASSERT_EQ_INT(MOEQ_OK, mq_gpu_gptq(g, &m[k].s, &m[k].o, Hs, Kk, hn, 1, &j, jh, 1));
            st[v] = j.stats;
        }
        unsetenv("MOEQ_DEBUG_GPU_LOOP");
        mq_env_reload();
        int64_t diff = 0;
        for (int64_t e = 0; e < N * K; e++) diff += q[0].codes[e] != q[1].codes[e];
        if (diff || !params_equal(q[0].params, q[1].params, N * q[0].n_groups))
            FAIL("%s: a warp per row and a thread per row differ (%lld codes)", m[k].name, (long long)diff);
        if (!(st[0].loss == st[1].loss)) FAIL("%s: loss %.17g vs %.17g", m[k].name, st[0].loss, st[1].loss);
        mq_qtensor_free(&q[0]);
        mq_qtensor_free(&q[1]);
    }
    free(H), free(w);
    mq_gpu_close(g);
}

/* Several weights over three Hessians (two sizes) in one call against each Hessian's weights
 * alone, and the call repeated: the same bytes. The weights of one Hessian are stacked into one
 * set whose work depends only on its own data, so chunking a layer's experts differently (the
 * pipeline's --expert-chunk) cannot change a code. */
static void test_gptq_batched_deterministic(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t Ks[] = {256, 512, 256};
    const int64_t rows[] = {96, 128, 64, 200, 32};
    const int32_t jh[] = {0, 1, 0, 2, 1};
    float *H[3], *w[5];
    for (int i = 0; i < 3; i++) H[i] = make_hessian(Ks[i], 1024, 20 + (uint64_t)i, 0);
    for (int i = 0; i < 5; i++) w[i] = mq_test_weights(rows[i], Ks[jh[i]], 30 + (uint64_t)i);
    const char *hn[] = {"H0", "H1", "H2"};
    mq_qspec s = spec_of(MQ_QS_NVFP4, 0, false, true);
    mq_gptq_opts o = mq_gptq_opts_default();
    o.act_order = true;
    o.mse_weight = MQ_GPTQ_MSE_OBQ;
    mq_qtensor all[2][5], one[5];
    mq_gptq_job jobs[5];
    for (int rep = 0; rep < 2; rep++) {
        for (int i = 0; i < 5; i++) jobs[i] = (mq_gptq_job){.w = w[i], .rows = rows[i], .name = "w", .out = &all[rep][i]};
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_gptq(g, &s, &o, (const float *const *)H, Ks, hn, 3, jobs, jh, 5));
    }
    for (int h = 0; h < 3; h++) {
        /* the jobs of Hessian h alone, in their order */
        mq_gptq_job sj[5];
        int idx[5], n = 0;
        int32_t z[5] = {0};
        for (int i = 0; i < 5; i++)
            if (jh[i] == h) {
                idx[n] = i;
                sj[n++] = (mq_gptq_job){.w = w[i], .rows = rows[i], .name = "w", .out = &one[i]};
            }
        const float *Hi[] = {H[h]};
        const int64_t Ki[] = {Ks[h]};
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_gptq(g, &s, &o, Hi, Ki, hn, 1, sj, z, n));
        for (int k = 0; k < n; k++) {
            const int i = idx[k];
            const size_t nc = (size_t)(rows[i] * Ks[h]);
            for (int rep = 0; rep < 2; rep++)
                if (memcmp(all[rep][i].codes, one[i].codes, nc) ||
                    !params_equal(all[rep][i].params, one[i].params, rows[i] * one[i].n_groups))
                    FAIL("weight %d: batched run %d differs from its Hessian's weights alone", i, rep);
        }
    }
    for (int i = 0; i < 5; i++) {
        for (int rep = 0; rep < 2; rep++) mq_qtensor_free(&all[rep][i]);
        mq_qtensor_free(&one[i]);
        free(w[i]);
    }
    for (int i = 0; i < 3; i++) free(H[i]);
    mq_gpu_close(g);
}

/* Damping retry: a rank-deficient Hessian with no damping fails Cholesky; both raise percdamp
 * the same way. Bad inputs are errors naming the tensor, as on the CPU. */
static void test_gptq_retry_and_errors(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t N = 64, K = 128;
    float *x = make_inputs(40, K, 3, 0);   /* 40 tokens: rank 40 < 128 */
    mq_hessian h;
    ASSERT_EQ_INT(MOEQ_OK, mq_hessian_init(&h, K, "t"));
    mq_hessian_add(&h, x, 40);
    float *H = malloc((size_t)(K * K) * 4);
    mq_hessian_get(&h, H);
    mq_hessian_free(&h);
    free(x);
    float *w = mq_test_weights(N, K, 4);
    mq_qspec s = spec_of(MQ_QS_INT4, 32, false, false);
    mq_gptq_opts o = mq_gptq_opts_default();
    o.percdamp = 0;
    mq_qtensor a, b;
    mq_gptq_stats sa;
    ASSERT_EQ_INT(MOEQ_OK, mq_gptq_quantize(&s, &o, H, w, N, K, 0, "w", &a, NULL, &sa));
    const float *Hs[] = {H};
    const int64_t Kk[] = {K};
    const char *hn[] = {"layers.0.mlp.experts.3"};
    const int32_t jh[] = {0};
    mq_gptq_job j = {.w = w, .rows = N, .name = "w", .out = &b};
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_gptq(g, &s, &o, Hs, Kk, hn, 1, &j, jh, 1));
    ASSERT_TRUE(sa.percdamp > 0);
    ASSERT_TRUE(sa.percdamp == j.stats.percdamp);
    mq_qtensor_free(&a);
    mq_qtensor_free(&b);

    /* not positive definite at any damping: -I */
    float *neg = calloc((size_t)(K * K), 4);
    for (int64_t i = 0; i < K; i++) neg[i * K + i] = -1.0f;
    const float *Hn[] = {neg};
    o = mq_gptq_opts_default();
    ASSERT_EQ_INT(MOEQ_E_NUMERIC, mq_gpu_gptq(g, &s, &o, Hn, Kk, hn, 1, &j, jh, 1));
    ASSERT_TRUE(strstr(moeq_last_error(), "layers.0.mlp.experts.3") != NULL);
    ASSERT_TRUE(j.out->codes == NULL);
    /* a non-finite Hessian entry */
    H[5 * K + 7] = INFINITY;
    ASSERT_EQ_INT(MOEQ_E_NUMERIC, mq_gpu_gptq(g, &s, &o, Hs, Kk, hn, 1, &j, jh, 1));
    ASSERT_TRUE(strstr(moeq_last_error(), "layers.0.mlp.experts.3") != NULL);
    H[5 * K + 7] = H[7 * K + 5];
    /* a NaN weight: named with its position */
    w[3 * K + 17] = NAN;
    j.name = "experts.3.up_proj";
    ASSERT_EQ_INT(MOEQ_E_NUMERIC, mq_gpu_gptq(g, &s, &o, Hs, Kk, hn, 1, &j, jh, 1));
    ASSERT_TRUE(strstr(moeq_last_error(), "experts.3.up_proj") != NULL);
    ASSERT_TRUE(strstr(moeq_last_error(), "(3, 17)") != NULL);
    w[3 * K + 17] = 0;
    /* g_idx groups with NVFP4 */
    mq_qspec nv = spec_of(MQ_QS_NVFP4, 0, false, false);
    o.act_order = true;
    o.groups = MQ_GPTQ_GROUPS_GIDX;
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, mq_gpu_gptq(g, &nv, &o, Hs, Kk, hn, 1, &j, jh, 1));
    free(neg), free(H), free(w);
    mq_gpu_close(g);
}

/* Inputs already on the GPU: Hessians as device sums built from rows, the weights as experts'
 * Linears of an mq_gpu_mlp, two experts' gate/up sharing a Hessian and their down projections
 * another. Against the same values from host memory (H from mq_gpu_hessians_get): the same codes,
 * params and losses bit for bit; write_back puts the dequantized weights (the host call's deq)
 * in place of the device's, which mq_gpu_mlp_read returns; bad sources are errors. */
static void test_gptq_device_inputs(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t E = 2, D = 256, F = 128, T = 700;
    float *gw[2], *uw[2], *dw[2];
    for (int e = 0; e < E; e++) {
        gw[e] = mq_test_weights(F, D, 40 + (uint64_t)e);
        uw[e] = mq_test_weights(F, D, 42 + (uint64_t)e);
        dw[e] = mq_test_weights(D, F, 44 + (uint64_t)e);
    }
    const int64_t Ks[4] = {D, D, F, F};   /* gate/up of expert 0, 1; down of 0, 1 */
    mq_gpu_hessians *hs = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 4, Ks, &hs));
    float *Hh[4];
    for (int h = 0; h < 4; h++) {
        float *x = make_inputs(T, Ks[h], 50 + (uint64_t)h, h == 1 ? 3 : 0);   /* dead columns in one */
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_add(hs, h, x, 300));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_add(hs, h, x + 300 * Ks[h], T - 300));
        Hh[h] = malloc((size_t)(Ks[h] * Ks[h]) * 4);
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_get(hs, h, Hh[h], NULL));
        free(x);
    }
    mq_gpu_mlp *m = NULL;
    const float *pg[2] = {gw[0], gw[1]}, *pu[2] = {uw[0], uw[1]}, *pd[2] = {dw[0], dw[1]};
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_new(g, E, D, F, pg, pu, pd, 16, &m));
    const char *hn[4] = {"H0", "H1", "H2", "H3"};
    const int32_t jh[6] = {0, 0, 2, 1, 1, 3};
    gptq_mode md[16];
    const int nm = n_modes(md);
    const int pick[] = {0, 2, 5, 7};   /* plain, act-order static, the in-loop search, INT4 g_idx */
    for (size_t pi = 0; pi < sizeof pick / sizeof pick[0]; pi++) {
        const gptq_mode *mo = &md[pick[pi] < nm ? pick[pi] : 0];
        mq_qtensor a[6], b[6];
        float *deq[6];
        mq_gptq_job ja[6], jb[6];
        mq_gpu_wsrc src[6];
        for (int i = 0; i < 6; i++) {
            const int e = i / 3, k = i % 3;
            const float *w = k == 0 ? gw[e] : k == 1 ? uw[e] : dw[e];
            const int64_t rows = k == 2 ? D : F;
            deq[i] = malloc((size_t)(rows * (k == 2 ? F : D)) * 4);
            ja[i] = (mq_gptq_job){.w = w, .rows = rows, .name = "w", .out = &a[i], .deq = deq[i]};
            jb[i] = (mq_gptq_job){.w = NULL, .rows = rows, .name = "w", .out = &b[i]};
            src[i] = (mq_gpu_wsrc){m, e, k, pi + 1 == sizeof pick / sizeof pick[0]};
        }
        const float *none[4] = {NULL, NULL, NULL, NULL};
        const mq_gpu_hsrc dh[4] = {{hs, 0}, {hs, 1}, {hs, 2}, {hs, 3}};
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_gptq(g, &mo->s, &mo->o, (const float *const *)Hh, Ks, hn, 4, ja, jh, 6));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_gptq_ex(g, &mo->s, &mo->o, none, dh, Ks, hn, 4, jb, src, jh, 6));
        for (int i = 0; i < 6; i++) {
            const int64_t n = a[i].rows * a[i].cols;
            if (memcmp(a[i].codes, b[i].codes, (size_t)n) || !params_equal(a[i].params, b[i].params, a[i].rows * a[i].n_groups))
                FAIL("%s: weight %d from the device differs from the same values from host memory", mo->name, i);
            ASSERT_TRUE(same_float(a[i].global_scale, b[i].global_scale));
            ASSERT_TRUE(ja[i].stats.loss == jb[i].stats.loss);
            ASSERT_TRUE(ja[i].stats.percdamp == jb[i].stats.percdamp);
            ASSERT_EQ_INT(ja[i].stats.n_dead, jb[i].stats.n_dead);
            ASSERT_EQ_INT(a[i].g_idx != NULL, b[i].g_idx != NULL);
            if (src[i].write_back) {   /* the device's weights are now the dequantized ones */
                float *back = malloc((size_t)n * 4);
                ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_read(m, i / 3, i % 3, back));
                int64_t diff = 0;
                for (int64_t t = 0; t < n; t++) diff += !same_float(back[t], deq[i][t]);
                if (diff) FAIL("%s: weight %d written back: %lld values differ from the dequantized ones", mo->name, i,
                               (long long)diff);
                /* and the host's dequantization of the codes (what a resumed run replays with) */
                mq_dequantize(&b[i], back);
                for (int64_t t = 0; t < n; t++) diff += !same_float(back[t], deq[i][t]);
                if (diff) FAIL("%s: weight %d: mq_dequantize differs from the device's in %lld values", mo->name, i,
                               (long long)diff);
                free(back);
            }
            mq_qtensor_free(&a[i]);
            mq_qtensor_free(&b[i]);
            free(deq[i]);
        }
    }
    /* a device weight of the wrong shape, a Hessian index that does not exist */
    mq_qtensor q;
    mq_gptq_job bad = {.rows = F + 1, .name = "experts.0.gate_proj", .out = &q};
    const mq_gpu_wsrc bs = {m, 0, 0, false};
    const float *none[1] = {NULL};
    const mq_gpu_hsrc dh0[1] = {{hs, 0}}, dh9[1] = {{hs, 9}};
    const int32_t z[1] = {0};
    mq_qspec s = spec_of(MQ_QS_NVFP4, 0, false, false);
    mq_gptq_opts o = mq_gptq_opts_default();
    ASSERT_EQ_INT(MOEQ_E_SHAPE, mq_gpu_gptq_ex(g, &s, &o, none, dh0, Ks, hn, 1, &bad, &bs, z, 1));
    ASSERT_TRUE(strstr(moeq_last_error(), "experts.0.gate_proj") != NULL);
    bad.rows = F;
    ASSERT_EQ_INT(MOEQ_E_SHAPE, mq_gpu_gptq_ex(g, &s, &o, none, dh9, Ks, hn, 1, &bad, &bs, z, 1));
    mq_gpu_mlp_free(m);
    mq_gpu_hessians_free(hs);
    for (int e = 0; e < E; e++) free(gw[e]), free(uw[e]), free(dw[e]);
    for (int h = 0; h < 4; h++) free(Hh[h]);
    mq_gpu_close(g);
}

/* ---- the experts' MLP ---------------------------------------------------------------------------- */

static void test_gemm_det_bitexact(void) {
    mq_gpu *g = mq_test_open_gpu();
    /* K % 8 == 0 takes k_det_nt128 at tile 128 (130 x 133: its scalar stores at the ragged edge) */
    const int64_t shapes[][3] = {{37, 70, 100}, {300, 128, 256}, {1, 1024, 2048}, {129, 65, 17}, {2100, 1100, 40},
                                 {130, 133, 64}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0] * 4; k++) {
        mq_gpu_force_det_tile(g, det_tiles[k / (sizeof shapes / sizeof shapes[0])]);
        const size_t sh = k % (sizeof shapes / sizeof shapes[0]);
        const int64_t M = shapes[sh][0], N = shapes[sh][1], K = shapes[sh][2];
        float *A = mq_test_weights(M, K, 70 + sh), *B = mq_test_weights(N, K, 80 + sh);
        float *c1 = malloc((size_t)(M * N) * 4), *c2 = malloc((size_t)(M * N) * 4);
        mq_gemm_det_nt(M, N, K, A, K, B, K, c1, N);
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_gemm_det(g, M, N, K, A, B, c2));
        int64_t diff = 0;
        for (int64_t i = 0; i < M * N; i++) diff += !same_float(c1[i], c2[i]);
        if (diff) FAIL("GEMM %lldx%lldx%lld, tile %d: %lld outputs differ from mq_gemm_det_nt", (long long)M,
                       (long long)N, (long long)K, det_tiles[k / (sizeof shapes / sizeof shapes[0])], (long long)diff);
        free(A), free(B), free(c1), free(c2);
    }
    mq_gpu_close(g);
}

/* Up to 5 experts of deterministic Linears for the GPU MLP's tests: gate and up [F, D] from seeds
 * seed + e and seed + 5 + e (their values times `scale`), down [D, F] from seed + 9 + e. */
typedef struct {
    int64_t E;
    mq_linear gate[5], up[5], down[5];
    const float *pg[5], *pu[5], *pd[5];
} expert_set;

static void experts_make(expert_set *x, int64_t E, int64_t D, int64_t F, uint64_t seed, float scale) {
    ASSERT_TRUE(E <= 5);
    x->E = E;
    for (int64_t e = 0; e < E; e++) {
        x->gate[e] = (mq_linear){.out = F, .in = D, .w = mq_test_weights(F, D, seed + (uint64_t)e), .det = true};
        x->up[e] = (mq_linear){.out = F, .in = D, .w = mq_test_weights(F, D, seed + 5 + (uint64_t)e), .det = true};
        x->down[e] = (mq_linear){.out = D, .in = F, .w = mq_test_weights(D, F, seed + 9 + (uint64_t)e), .det = true};
        for (int64_t i = 0; i < F * D; i++) x->gate[e].w[i] *= scale, x->up[e].w[i] *= scale;
        x->pg[e] = x->gate[e].w, x->pu[e] = x->up[e].w, x->pd[e] = x->down[e].w;
    }
}

static void experts_free(expert_set *x) {
    for (int64_t e = 0; e < x->E; e++) free(x->gate[e].w), free(x->up[e].w), free(x->down[e].w);
}

/* Values of gate/up activations (nF each) and outputs (nD; y NULL: none) whose bits differ. */
static int64_t mlp_diffs(const float *hg, const float *hg2, const float *hu, const float *hu2, int64_t nF,
                         const float *y, const float *y2, int64_t nD) {
    int64_t diff = 0;
    for (int64_t i = 0; i < nF; i++) diff += !same_float(hg[i], hg2[i]) + !same_float(hu[i], hu2[i]);
    for (int64_t i = 0; y && i < nD; i++) diff += !same_float(y[i], y2[i]);
    return diff;
}

/* Experts through the GPU MLP against mq_mlp_forward on deterministic Linears: the same bits,
 * also when the rows come max_rows at a time and without the down product. */
static void test_mlp_bitexact(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t E = 3, D = 96, F = 160, n = 75;
    expert_set xs;
    experts_make(&xs, E, D, F, 90, 40);   /* gate and up times 40: SwiGLU's whole range */
    mq_linear *gate = xs.gate, *up = xs.up, *down = xs.down;
    const float **pg = xs.pg, **pu = xs.pu, **pd = xs.pd;
    float *x = mq_test_weights(n, D, 7);
    for (int64_t i = 0; i < n * D; i++) x[i] *= 50;
    float *hg = malloc((size_t)(n * F) * 4), *hu = malloc((size_t)(n * F) * 4), *y = malloc((size_t)(n * D) * 4);
    float *hg2 = malloc((size_t)(n * F) * 4), *hu2 = malloc((size_t)(n * F) * 4), *y2 = malloc((size_t)(n * D) * 4);
    for (int rep = 0; rep < 2; rep++) {
        mq_gpu_mlp *m = NULL;
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_new(g, E, D, F, pg, pu, rep ? NULL : pd, rep ? n : 32, &m));
        for (int64_t e = 0; e < E; e++) {
            ASSERT_EQ_INT(MOEQ_OK, mq_mlp_forward(&gate[e], &up[e], rep ? NULL : &down[e], x, n, hg, hu, rep ? NULL : y));
            ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_run(m, e, x, n, hg2, hu2, rep ? NULL : y2, NULL, NULL));
            const int64_t diff = mlp_diffs(hg, hg2, hu, hu2, n * F, rep ? NULL : y, y2, n * D);
            if (diff) FAIL("expert %lld (%s): %lld values differ from mq_mlp_forward", (long long)e,
                           rep ? "no down, all rows at once" : "32 rows at a time", (long long)diff);
        }
        if (rep) ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_mlp_run(m, 0, x, n, hg2, hu2, y2, NULL, NULL));   /* no down weights */
        mq_gpu_mlp_free(m);
    }
    experts_free(&xs);
    free(x), free(hg), free(hu), free(y), free(hg2), free(hu2), free(y2);
    mq_gpu_close(g);
}

/* Experts whose weights (11.6 MB each, 174 MB in all) fill the two 64 MB pinned halves of
 * mq_cu_upload_many several times over, one weight split across halves at an unaligned place:
 * every expert's products are still mq_mlp_forward's bits. */
static void test_mlp_large_upload(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t E = 5, D = 1000, F = 2900, n = 8;
    expert_set xs;
    experts_make(&xs, E, D, F, 190, 1);
    float *x = mq_test_weights(n, D, 17);
    float *hg = malloc((size_t)(n * F) * 4), *hu = malloc((size_t)(n * F) * 4), *y = malloc((size_t)(n * D) * 4);
    float *hg2 = malloc((size_t)(n * F) * 4), *hu2 = malloc((size_t)(n * F) * 4), *y2 = malloc((size_t)(n * D) * 4);
    mq_gpu_mlp *m = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_new(g, E, D, F, xs.pg, xs.pu, xs.pd, n, &m));
    for (int64_t e = 0; e < E; e++) {
        ASSERT_EQ_INT(MOEQ_OK, mq_mlp_forward(&xs.gate[e], &xs.up[e], &xs.down[e], x, n, hg, hu, y));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_run(m, e, x, n, hg2, hu2, y2, NULL, NULL));
        const int64_t diff = mlp_diffs(hg, hg2, hu, hu2, n * F, y, y2, n * D);
        if (diff) FAIL("expert %lld of weights uploaded across the pinned halves: %lld values differ", (long long)e,
                       (long long)diff);
    }
    mq_gpu_mlp_free(m);
    experts_free(&xs);
    free(x), free(hg), free(hu), free(y), free(hg2), free(hu2), free(y2);
    mq_gpu_close(g);
}

/* ---- the attention's calibration forward --------------------------------------------------- */

typedef struct {
    float *qkv, *o;   /* the hooks' inputs of the layer */
    int64_t cols_o;
} att_hooks;

static void on_att(void *user, int layer, mq_site site, int expert, const float *x, int64_t rows, int64_t cols) {
    (void)layer, (void)expert;
    att_hooks *h = user;
    float **dst = site == MQ_SITE_QKV ? &h->qkv : site == MQ_SITE_O ? &h->o : NULL;
    if (!dst) return;
    *dst = malloc(sizeof(float) * (size_t)(rows * cols));
    memcpy(*dst, x, sizeof(float) * (size_t)(rows * cols));
}

/* A Hessian of the rows x [n, K] (mq_hessian_get's values) on the CPU. */
static float *cpu_hessian(const float *x, int64_t n, int64_t K) {
    mq_hessian h = {0};
    ASSERT_EQ_INT(MOEQ_OK, mq_hessian_init(&h, K, "cpu"));
    mq_hessian_add(&h, x, n);
    float *H = malloc(sizeof(float) * (size_t)(K * K));
    mq_hessian_get(&h, H);
    mq_hessian_free(&h);
    return H;
}

/* One layer of a fixture through mq_attention_forward and through the GPU twin, from the same
 * input: the output, the hooks' inputs (also as copies) and the Hessian sums of both must agree.
 * Tolerances: the norms and RoPE are the CPU's operations, so the q/k/v input agrees to the
 * rounding of the norm's variance (the double sum's order: 1 ulp at most, 2^-23 relative); the
 * products sum K <= 128 fp32 terms in another order, each sum then within K * 2^-24 of the
 * magnitudes it adds (7.6e-6), and one such difference passes through the softmax and o_proj,
 * so 3e-5 of the largest value bounds the outputs. The Hessians sum those inputs: the same
 * relative bound. */
static moeq_status count_call(void *user) {
    ++*(int *)user;
    return MOEQ_OK;
}
static moeq_status fail_call(void *user) {
    ++*(int *)user;
    return mq_err(MOEQ_E_IO, "the host's work failed (test)");
}

static void attention_case(mq_gpu *g, const char *dir, int64_t T, int layer, int64_t window, float clip) {
    moeq_model_options opt = {.no_tokenizer = 1};
    moeq_model *m = NULL;
    if (moeq_model_open(dir, &opt, &m) != MOEQ_OK) FAIL("%s: %s", dir, moeq_last_error());
    mq_config *c = &m->cfg;
    if (window > 0) {
        c->sliding_window = (int32_t)window;
        c->layer_sliding[layer] = 1;
    }
    if (clip > 0) c->clip_qkv = clip;
    const int64_t D = c->D, Q = (int64_t)c->n_heads * c->head_dim;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T);
    for (int64_t i = 0; i < T; i++) ids[i] = (int32_t)((i * 7919 + 13) % c->vocab);
    float *x = malloc(sizeof(float) * (size_t)(T * D)), *xg = malloc(sizeof(float) * (size_t)(T * D));
    ASSERT_EQ_INT(MOEQ_OK, mq_embed(m, ids, T, x));
    for (int64_t i = 0; i < T * D; i++) x[i] *= 30.0f;   /* activations of a later layer's size */
    float *xg2 = malloc(sizeof(float) * (size_t)(T * D));
    memcpy(xg, x, sizeof(float) * (size_t)(T * D));
    memcpy(xg2, x, sizeof(float) * (size_t)(T * D));
    mq_state *st = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_state_new(m, (int32_t)T, &st));
    att_hooks hk = {0};
    mq_hooks hooks = {on_att, &hk};
    ASSERT_EQ_INT(MOEQ_OK, mq_attention_forward(m, st, layer, x, T, 0, &hooks));
    ASSERT_TRUE(hk.qkv && hk.o);

    const mq_layer *ly = &m->layers[layer];
    mq_gpu_attn_shape sh;
    mq_gpu_attn_weights w;
    mq_test_attn_twin(m, st, layer, T, window, &sh, &w);
    mq_gpu_attn *a = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_attn_new(g, &sh, &a));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_attn_set(a, &w));
    const int64_t Ks[2] = {D, Q};
    mq_gpu_hessians *hq = NULL, *ho = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 1, &Ks[0], &hq));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 1, &Ks[1], &ho));
    float *xn = malloc(sizeof(float) * (size_t)(T * D)), *att = malloc(sizeof(float) * (size_t)(T * Q));
    const int64_t K = ly->is_moe ? c->top_k : 0, E = c->n_experts;
    float *fin = malloc(sizeof(float) * (size_t)(T * D)), *wg = malloc(sizeof(float) * (size_t)(T * K + 1));
    int32_t *sg = malloc(sizeof(int32_t) * (size_t)(T * K + 1));
    /* the FFN input also into a device buffer at an offset of one row (the pipeline's experts
     * read it there): the host copy's bits */
    mq_gpu_buf *fdev = NULL, *hdev = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_new(g, (T + 1) * D, &fdev));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_new(g, (T + 1) * D, &hdev));
    const mq_gpu_attn_sample one = {.x = xg, .y = xg, .T = T, .xn = xn, .att = att, .ffn_in = fin,
                                    .sel = K ? sg : NULL, .w = K ? wg : NULL, .ffn_dev_off = D};
    /* and the result kept there too; the host's work meanwhile called once */
    int calls = 0;
    const mq_gpu_attn_io io = {.hq = hq, .ho = ho, .ffn_dev = fdev, .h_dev = hdev, .meanwhile = count_call,
                               .meanwhile_user = &calls};
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_attn_run_samples(a, &one, 1, &io));
    ASSERT_EQ_INT(1, calls);
    float *fgot = malloc(sizeof(float) * (size_t)(T * D));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_read(fdev, D, T * D, fgot));
    for (int64_t i = 0; i < T * D; i++)
        if (!same_float(fgot[i], fin[i])) FAIL("%s: the FFN input kept on the device differs at %lld", dir, (long long)i);
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_read(hdev, D, T * D, fgot));
    for (int64_t i = 0; i < T * D; i++)
        if (!same_float(fgot[i], xg[i])) FAIL("%s: the result kept on the device differs at %lld", dir, (long long)i);
    free(fgot);
    double e_xn = mq_test_rel_maxdiff(xn, hk.qkv, (size_t)(T * D));
    double e_att = mq_test_rel_maxdiff(att, hk.o, (size_t)(T * Q));
    double e_x = mq_test_rel_maxdiff(xg, x, (size_t)(T * D));
    float *Hq = malloc(sizeof(float) * (size_t)(D * D)), *Ho = malloc(sizeof(float) * (size_t)(Q * Q));
    int64_t nq = 0, no = 0;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_get(hq, 0, Hq, &nq));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_get(ho, 0, Ho, &no));
    ASSERT_EQ_INT(T, nq);
    ASSERT_EQ_INT(T, no);
    float *Cq = cpu_hessian(hk.qkv, T, D), *Co = cpu_hessian(hk.o, T, Q);
    double e_hq = mq_test_rel_maxdiff(Hq, Cq, (size_t)(D * D)), e_ho = mq_test_rel_maxdiff(Ho, Co, (size_t)(Q * Q));
    /* the FFN input and routing of the CPU's result: the norm of values within e_x, so the same
     * bound; a token's choice may differ only where the CPU's k-th and next probabilities are
     * within that of each other */
    float *cfin = malloc(sizeof(float) * (size_t)(T * D)), *probs = malloc(sizeof(float) * (size_t)(T * E + 1));
    float *cw = malloc(sizeof(float) * (size_t)(T * K + 1));
    int32_t *cs = malloc(sizeof(int32_t) * (size_t)(T * K + 1));
    mq_ffn_norm(m, layer, x, T, cfin);
    const double e_fin = mq_test_rel_maxdiff(fin, cfin, (size_t)(T * D));
    int64_t flips = 0, close_calls = 0;
    double e_w = 0;
    if (K) {
        mq_moe_route(m, layer, cfin, T, probs, cs, cw);
        for (int64_t t = 0; t < T; t++) {
            bool same = true;
            for (int64_t k = 0; k < K; k++) same &= cs[t * K + k] == sg[t * K + k];
            if (same) {
                for (int64_t k = 0; k < K; k++)
                    e_w = fmax(e_w, fabs((double)wg[t * K + k] - cw[t * K + k]) / fabs((double)cw[t * K + k]));
                continue;
            }
            /* the CPU's probabilities (probs holds them after the softmax), sorted: a near tie? */
            const float *pr = probs + t * E;
            float kth = pr[cs[t * K + K - 1]], next = -1.0f;
            for (int64_t e = 0; e < E; e++) {
                bool chosen = false;
                for (int64_t k = 0; k < K; k++) chosen |= cs[t * K + k] == e;
                if (!chosen && pr[e] > next) next = pr[e];
            }
            if (fabs((double)kth - next) <= 3e-5 * kth) close_calls++;
            else flips++;
        }
    }
    printf("  %s layer %d, T %lld, window %lld, clip %g: q/k/v input %.2e, o input %.2e, output %.2e, "
           "Hessians %.2e %.2e, FFN input %.2e, routing weights %.2e, near ties %lld\n", dir, layer, (long long)T,
           (long long)window, (double)clip, e_xn, e_att, e_x, e_hq, e_ho, e_fin, e_w, (long long)close_calls);
    if (e_xn > 0x1p-23 || e_att > 3e-5 || e_x > 3e-5 || e_hq > 3e-5 || e_ho > 3e-5 || e_fin > 3e-5 || e_w > 3e-5 ||
        flips)
        FAIL("%s layer %d (T %lld): the GPU attention differs from mq_attention_forward (%lld routing choices)", dir,
             layer, (long long)T, (long long)flips);
    free(cfin), free(probs), free(cw), free(cs), free(fin), free(wg), free(sg);
    /* the input kept on the device by one run and taken from there by the next (x NULL): the
     * first run's bits, and the kept rows are the input's */
    float *y1 = malloc(sizeof(float) * (size_t)(T * D)), *y2 = malloc(sizeof(float) * (size_t)(T * D));
    mq_gpu_buf *xdev = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_new(g, (T + 1) * D, &xdev));
    const mq_gpu_attn_sample keep_s = {.x = xg2, .y = y1, .T = T, .ffn_dev_off = D};
    const mq_gpu_attn_sample from_s = {.y = y2, .T = T, .ffn_dev_off = D};
    const mq_gpu_attn_io keep_io = {.x_keep = xdev}, from_io = {.x_from = xdev};
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_attn_run_samples(a, &keep_s, 1, &keep_io));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_attn_run_samples(a, &from_s, 1, &from_io));
    for (int64_t i = 0; i < T * D; i++)
        if (!same_float(y1[i], xg[i]) || !same_float(y2[i], xg[i]))
            FAIL("%s: the input kept on the device, or taken from there, changed the result at %lld", dir, (long long)i);
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_read(xdev, D, T * D, y1));
    for (int64_t i = 0; i < T * D; i++)
        if (!same_float(y1[i], xg2[i])) FAIL("%s: the input kept on the device differs at %lld", dir, (long long)i);
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_attn_run_samples(a, &from_s, 1, &keep_io));   /* no input at all */
    mq_gpu_buf_free(xdev);
    free(y1), free(y2);
    /* run to run: the same bits */
    const mq_gpu_attn_io none = {0};
    mq_gpu_attn_sample again = {.x = xg2, .y = xg2, .T = T};
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_attn_run_samples(a, &again, 1, &none));
    for (int64_t i = 0; i < T * D; i++)
        if (!same_float(xg[i], xg2[i])) FAIL("%s: the GPU attention differs from run to run at %lld", dir, (long long)i);
    again.T = T + 1;   /* longer than made for */
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_attn_run_samples(a, &again, 1, &none));
    const mq_gpu_attn_sample past = {.x = xg2, .T = T, .ffn_dev_off = 2 * D};   /* past the buffer */
    const mq_gpu_attn_io into = {.ffn_dev = fdev}, into_h = {.h_dev = hdev};
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_attn_run_samples(a, &past, 1, &into));
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_attn_run_samples(a, &past, 1, &into_h));
    /* the host's work failing: its error, once the device has finished */
    const mq_gpu_attn_io failing = {.meanwhile = fail_call, .meanwhile_user = &calls};
    ASSERT_EQ_INT(MOEQ_E_IO, mq_gpu_attn_run_samples(a, &past, 1, &failing));
    ASSERT_EQ_INT(2, calls);
    mq_gpu_buf_free(fdev);
    mq_gpu_buf_free(hdev);
    mq_gpu_hessians_free(hq), mq_gpu_hessians_free(ho);
    mq_gpu_attn_free(a);
    mq_state_free(st);
    free(hk.qkv), free(hk.o), free(ids), free(x), free(xg), free(xg2), free(xn), free(att);
    free(Hq), free(Ho), free(Cq), free(Co);
    moeq_model_free(m);
}

/* Every attention variant of the families: full q/k norms (olmoe), per-head norms and grouped KV
 * heads (qwen3moe), q/k/v biases (qwen2moe), plain (mixtral), a sliding window and clip_qkv; T
 * below and above the CPU's GEMM threshold and across the GPU's query blocks. */
static void test_attention_parity(void) {
    mq_gpu *g = mq_test_open_gpu();
    attention_case(g, mq_test_repo("models/olmoe-tiny"), 48, 0, 0, 0);
    attention_case(g, mq_test_repo("models/olmoe-tiny"), 300, 1, 0, 0);
    attention_case(g, mq_test_repo("models/olmoe-tiny"), 130, 2, 17, 0.8f);
    attention_case(g, mq_test_repo("tests/data/qwen3moe-tiny"), 200, 1, 0, 0);
    attention_case(g, mq_test_repo("tests/data/qwen2moe-dense-tiny"), 160, 0, 0, 0);
    attention_case(g, mq_test_repo("tests/data/mixtral-tiny"), 96, 1, 40, 0);
    /* the scores in blocks of 256 queries (attention.cu): a window that starts the second
     * block's keys at 157, a last block of 244 (olmoe-tiny holds 512 positions) */
    attention_case(g, mq_test_repo("models/olmoe-tiny"), 500, 1, 100, 0);
    mq_gpu_close(g);
}

/* Samples of different lengths in one mq_gpu_attn_run_samples call, in groups of at most 200
 * tokens (MOEQ_DEBUG_GPU_ATTN_ROWS): each sample's output, FFN input (host and device), routing and the
 * Hessian sums are the bits of the same samples run one at a time (every row-wise step is a
 * function of its row, the scores are per sample, the sums take the rows in the same order);
 * a sample longer than the twin was made for is refused before anything runs. */
static void attention_groups_case(mq_gpu *g, const char *dir, int layer) {
    moeq_model_options opt = {.no_tokenizer = 1};
    moeq_model *m = NULL;
    if (moeq_model_open(dir, &opt, &m) != MOEQ_OK) FAIL("%s: %s", dir, moeq_last_error());
    const mq_config *c = &m->cfg;
    enum { NS = 6 };
    const int64_t len[NS] = {48, 130, 7, 100, 64, 1}, D = c->D, Q = (int64_t)c->n_heads * c->head_dim, Tm = 130;
    const int64_t K = m->layers[layer].is_moe ? c->top_k : 0;
    int64_t tot = 0, at[NS];
    for (int i = 0; i < NS; i++) at[i] = tot, tot += len[i];
    float *x0 = malloc(sizeof(float) * (size_t)(tot * D));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)tot);
    for (int64_t i = 0; i < tot; i++) ids[i] = (int32_t)((i * 7919 + 13) % c->vocab);
    ASSERT_EQ_INT(MOEQ_OK, mq_embed(m, ids, tot, x0));
    for (int64_t i = 0; i < tot * D; i++) x0[i] *= 30.0f;
    mq_state *st = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_state_new(m, (int32_t)Tm, &st));
    mq_gpu_attn_shape sh;
    mq_gpu_attn_weights w;
    mq_test_attn_twin(m, st, layer, Tm, 0, &sh, &w);
    setenv("MOEQ_DEBUG_GPU_ATTN_ROWS", "200", 1);
    mq_env_reload();
    mq_gpu_attn *a = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_attn_new(g, &sh, &a));
    unsetenv("MOEQ_DEBUG_GPU_ATTN_ROWS");
    mq_env_reload();
    ASSERT_EQ_INT(200, mq_gpu_attn_rows(a));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_attn_set(a, &w));
    /* [0]: one call for all, [1]: a call per sample */
    float *y[2], *fin[2], *wt[2], *xn[2], *att[2], *H[2][2], *fdev[2];
    int32_t *sel[2];
    mq_gpu_hessians *hq[2], *ho[2];
    mq_gpu_buf *fb[2];
    const int64_t Ks[2] = {D, Q};
    for (int v = 0; v < 2; v++) {
        y[v] = malloc(sizeof(float) * (size_t)(tot * D));
        fin[v] = malloc(sizeof(float) * (size_t)(tot * D));
        xn[v] = malloc(sizeof(float) * (size_t)(tot * D));
        att[v] = malloc(sizeof(float) * (size_t)(tot * Q));
        fdev[v] = malloc(sizeof(float) * (size_t)(tot * D));
        wt[v] = malloc(sizeof(float) * (size_t)(tot * K + 1));
        sel[v] = malloc(sizeof(int32_t) * (size_t)(tot * K + 1));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 1, &Ks[0], &hq[v]));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 1, &Ks[1], &ho[v]));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_new(g, tot * D, &fb[v]));
        mq_gpu_attn_sample smp[NS];
        for (int i = 0; i < NS; i++) {
            smp[i] = (mq_gpu_attn_sample){.x = x0 + at[i] * D, .y = y[v] + at[i] * D, .T = len[i],
                                          .xn = xn[v] + at[i] * D, .att = att[v] + at[i] * Q,
                                          .ffn_in = fin[v] + at[i] * D, .sel = K ? sel[v] + at[i] * K : NULL,
                                          .w = K ? wt[v] + at[i] * K : NULL, .ffn_dev_off = at[i] * D};
        }
        const mq_gpu_attn_io io = {.hq = hq[v], .ho = ho[v], .ffn_dev = fb[v]};
        if (v == 0) ASSERT_EQ_INT(MOEQ_OK, mq_gpu_attn_run_samples(a, smp, NS, &io));
        for (int i = 0; i < NS && v == 1; i++) ASSERT_EQ_INT(MOEQ_OK, mq_gpu_attn_run_samples(a, &smp[i], 1, &io));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_read(fb[v], 0, tot * D, fdev[v]));
        for (int k = 0; k < 2; k++) {
            H[v][k] = malloc(sizeof(float) * (size_t)(Ks[k] * Ks[k]));
            int64_t n = 0;
            ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_get(k ? ho[v] : hq[v], 0, H[v][k], &n));
            ASSERT_EQ_INT(tot, n);
        }
    }
    const struct { const char *what; const void *a, *b; size_t bytes; } cmp[] = {
        {"output", y[0], y[1], sizeof(float) * (size_t)(tot * D)},
        {"q/k/v input", xn[0], xn[1], sizeof(float) * (size_t)(tot * D)},
        {"o input", att[0], att[1], sizeof(float) * (size_t)(tot * Q)},
        {"FFN input", fin[0], fin[1], sizeof(float) * (size_t)(tot * D)},
        {"FFN input on the device", fdev[0], fin[1], sizeof(float) * (size_t)(tot * D)},
        {"routing", sel[0], sel[1], sizeof(int32_t) * (size_t)(tot * K)},
        {"routing weights", wt[0], wt[1], sizeof(float) * (size_t)(tot * K)},
        {"q/k/v Hessian", H[0][0], H[1][0], sizeof(float) * (size_t)(D * D)},
        {"o Hessian", H[0][1], H[1][1], sizeof(float) * (size_t)(Q * Q)}};
    for (size_t i = 0; i < sizeof cmp / sizeof cmp[0]; i++)
        if (memcmp(cmp[i].a, cmp[i].b, cmp[i].bytes))
            FAIL("%s layer %d: the %s of samples run in groups differs from one at a time", dir, layer, cmp[i].what);
    mq_gpu_attn_sample bad[2] = {{.x = x0, .T = 10}, {.x = x0, .T = Tm + 1}};
    const mq_gpu_attn_io io0 = {0};
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_attn_run_samples(a, bad, 2, &io0));
    printf("  %s layer %d: %d samples of 1..130 tokens in groups of <= 200 = one at a time, bit for bit\n", dir,
           layer, NS);
    for (int v = 0; v < 2; v++) {
        free(y[v]), free(fin[v]), free(xn[v]), free(att[v]), free(fdev[v]), free(wt[v]), free(sel[v]);
        free(H[v][0]), free(H[v][1]);
        mq_gpu_hessians_free(hq[v]), mq_gpu_hessians_free(ho[v]);
        mq_gpu_buf_free(fb[v]);
    }
    free(x0), free(ids);
    mq_gpu_attn_free(a);
    mq_state_free(st);
    moeq_model_free(m);
}

static void test_attention_groups(void) {
    mq_gpu *g = mq_test_open_gpu();
    attention_groups_case(g, mq_test_repo("models/olmoe-tiny"), 1);
    attention_groups_case(g, mq_test_repo("tests/data/qwen3moe-tiny"), 0);   /* grouped KV heads, per-head norms */
    attention_groups_case(g, mq_test_repo("tests/data/qwen2moe-dense-tiny"), 0);   /* biases, a dense layer */
    mq_gpu_close(g);
}

/* Rows gathered on the device from uploaded inputs, with the Hessians of the expert's input and
 * of its SwiGLU product summed there: the outputs and both sums are the CPU's bits for the same
 * rows in the same order (mq_mlp_forward, mq_hessian_add), also with fewer rows per call than
 * the expert has; an index outside the inputs is an error. */
static void test_mlp_rows_hessians(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t D = 96, F = 160, n = 75, blocks[2] = {40, 35};
    mq_linear gate = {.out = F, .in = D, .w = mq_test_weights(F, D, 11), .det = true};
    mq_linear up = {.out = F, .in = D, .w = mq_test_weights(F, D, 12), .det = true};
    mq_linear down = {.out = D, .in = F, .w = mq_test_weights(D, F, 13), .det = true};
    for (int64_t i = 0; i < F * D; i++) gate.w[i] *= 40, up.w[i] *= 40;
    float *x = mq_test_weights(n, D, 14);
    for (int64_t i = 0; i < n * D; i++) x[i] *= 50;
    int32_t src[75];
    float *xp = malloc((size_t)(n * D) * 4);
    for (int64_t i = 0; i < n; i++) {
        src[i] = (int32_t)(i * 7 % n);   /* a permutation: 7 and 75 are coprime */
        memcpy(xp + i * D, x + (int64_t)src[i] * D, (size_t)D * 4);
    }
    float *hg = malloc((size_t)(n * F) * 4), *hu = malloc((size_t)(n * F) * 4), *y = malloc((size_t)(n * D) * 4);
    float *y2 = malloc((size_t)(n * D) * 4);
    ASSERT_EQ_INT(MOEQ_OK, mq_mlp_forward(&gate, &up, &down, xp, n, hg, hu, y));
    float *Hx = cpu_hessian(xp, n, D), *Hg = cpu_hessian(hg, n, F);
    const float *pg[1] = {gate.w}, *pu[1] = {up.w}, *pd[1] = {down.w};
    mq_gpu_mlp *m = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_new(g, 1, D, F, pg, pu, pd, 32, &m));
    const float *xs[2] = {x, x + blocks[0] * D};
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_inputs(m, xs, blocks, 2));
    const int64_t Ks[2] = {D, F};
    mq_gpu_hessians *hx = NULL, *hd = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 1, &Ks[0], &hx));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 1, &Ks[1], &hd));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_run_rows(m, 0, src, n, NULL, NULL, y2, hx, hd));
    float *Gx = malloc((size_t)(D * D) * 4), *Gg = malloc((size_t)(F * F) * 4);
    int64_t nx = 0, ng = 0;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_get(hx, 0, Gx, &nx));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_get(hd, 0, Gg, &ng));
    ASSERT_EQ_INT(n, nx);
    ASSERT_EQ_INT(n, ng);
    int64_t diff = 0;
    for (int64_t i = 0; i < n * D; i++) diff += !same_float(y[i], y2[i]);
    if (diff) FAIL("gathered rows: %lld outputs differ from mq_mlp_forward", (long long)diff);
    for (int64_t i = 0; i < D * D; i++) diff += !same_float(Hx[i], Gx[i]);
    for (int64_t i = 0; i < F * F; i++) diff += !same_float(Hg[i], Gg[i]);
    if (diff) FAIL("gathered rows: %lld Hessian entries differ from mq_hessian_add's", (long long)diff);
    src[3] = (int32_t)n;   /* outside the 75 uploaded rows */
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_mlp_run_rows(m, 0, src, n, NULL, NULL, y2, NULL, NULL));
    mq_gpu_hessians_free(hx), mq_gpu_hessians_free(hd);
    mq_gpu_mlp_free(m);
    free(gate.w), free(up.w), free(down.w), free(x), free(xp), free(hg), free(hu), free(y), free(y2);
    free(Hx), free(Hg), free(Gx), free(Gg);
    mq_gpu_close(g);
}

/* The TF32 modes (mq_gpu_set_precision): an expert's products and Hessian sums on tensor cores,
 * each value within what its inputs' conversion allows, against exact sums in double.
 *   tf32: an input keeps 10 of fp32's 23 mantissa bits (rounded or truncated: within 2^-10 of
 *   itself, relative), so a product is within 2^-9 + 2^-20 of the exact one; the fp32 sum of k
 *   of them (the tensor cores may truncate its additions) adds at most k 2^-23 of the sum of
 *   their magnitudes: |got - exact| <= (2^-9 + 2^-20 + k 2^-23) sum |a_i b_i|.
 *   tf32x3: an input is hi + lo + r, hi its nearest TF32 value, lo the nearest to the exact
 *   remainder, |lo| <= 2^-11 (1 + 2^-11) |a|, |r| <= 2^-22 |a|; hi*hi + hi*lo + lo*hi misses lo*lo
 *   and the r terms: at most (3 2^-22 + 2^-30) |a b|. The three products of TF32 values are exact
 *   in fp32 and their terms sum to at most (1 + 2^-9) sum |a_i b_i|; the sums go through the k
 *   additions of a block's GEMM and, in blocks of rows, three more per block (at most 5 blocks
 *   here): |got - exact| <= (3 2^-22 + 2^-30 + (k + 16)(1 + 2^-9) 2^-23) sum |a_i b_i|.
 * The Hessian's 2/n, a rounded float, and its product add 2^-23. The bounds above are worst
 * cases dominated by the sums' k 2^-23; what tells the modes apart is the typical error, so the
 * RMS of (got - exact) / sum |a_i b_i| of tf32x3 must be at most 1/16 of tf32's on the same
 * inputs (the conversion alone makes tf32's about 2^-11 / sqrt(k), tf32x3's a thousandth of it). The same
 * call again gives the same bits, and fp32 again gives the CPU's fmaf chains (mq_mlp_forward).
 * Two shapes: a small one, every value checked; a large one whose inputs, weights and Hessian
 * rows go through the tf32x3 split in more than one block, a sample of the values checked. */
typedef struct {
    double worst_u, worst_h;   /* largest excess over the bound (<= 0: inside) */
    double rms_u, rms_h;       /* RMS of the error relative to sum |a_i b_i| */
} tf32_check;

static void tf32_case(mq_gpu *g, moeq_gpu_precision prec, int64_t D, int64_t F, int64_t n, int64_t stride,
                      tf32_check *out) {
    mq_linear gate = {.out = F, .in = D, .w = mq_test_weights(F, D, 81), .det = true};
    mq_linear up = {.out = F, .in = D, .w = mq_test_weights(F, D, 82), .det = true};
    mq_linear down = {.out = D, .in = F, .w = mq_test_weights(D, F, 83), .det = true};
    float *x = mq_test_weights(n, D, 84);
    for (int64_t i = 0; i < n * D; i++) x[i] *= 50;
    const float *pg[1] = {gate.w}, *pu[1] = {up.w}, *pd[1] = {down.w};
    const int64_t Ks[2] = {D, F};
    float *hg[2], *hu[2], *y[2], *Hx[2];
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_set_precision(g, prec));
    for (int r = 0; r < 2; r++) {   /* the same call twice */
        mq_gpu_mlp *m = NULL;
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_new(g, 1, D, F, pg, pu, pd, 32, &m));
        mq_gpu_hessians *hx = NULL, *hd = NULL;
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 1, &Ks[0], &hx));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 1, &Ks[1], &hd));
        hg[r] = malloc((size_t)(n * F) * 4), hu[r] = malloc((size_t)(n * F) * 4), y[r] = malloc((size_t)(n * D) * 4);
        Hx[r] = malloc((size_t)(D * D) * 4);
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_run(m, 0, x, n, hg[r], hu[r], y[r], hx, hd));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_get(hx, 0, Hx[r], NULL));
        mq_gpu_hessians_free(hx), mq_gpu_hessians_free(hd);
        mq_gpu_mlp_free(m);
    }
    const double c0 = prec == MOEQ_GPU_TF32 ? 0x1p-9 + 0x1p-20 : 3 * 0x1p-22 + 0x1p-30;
    const double per_add = prec == MOEQ_GPU_TF32 ? 0x1p-23 : (1 + 0x1p-9) * 0x1p-23;
    const int64_t slack = prec == MOEQ_GPU_TF32 ? 0 : 16;
    double wu = -1e300, wh = -1e300, su = 0, sh = 0;
    int64_t cu = 0, ch = 0;
    /* the up product (before any activation) and the input's Hessian, every stride-th value */
    for (int64_t v = 0; v < n * F; v += stride) {
        const int64_t i = v / F, f = v % F;
        double ex = 0, mag = 0;
        for (int64_t d = 0; d < D; d++) {
            const double t = (double)x[i * D + d] * up.w[f * D + d];
            ex += t, mag += fabs(t);
        }
        const double err = fabs(hu[0][v] - ex);
        wu = fmax(wu, err - (c0 + (double)(D + slack) * per_add) * mag);
        su += (err / mag) * (err / mag), cu++;
    }
    for (int64_t v = 0; v < D * D; v += stride) {
        const int64_t a = v / D, b = v % D;
        if (b > a) continue;   /* the lower triangle is the sum's */
        double ex = 0, mag = 0;
        for (int64_t r = 0; r < n; r++) {
            const double t = (double)x[r * D + a] * x[r * D + b];
            ex += t, mag += fabs(t);
        }
        const double sc = 2.0 / (double)n, err = fabs(Hx[0][v] - sc * ex);
        wh = fmax(wh, err - (c0 + (double)(n + slack) * per_add + 0x1p-23) * sc * mag);
        sh += (err / (sc * mag)) * (err / (sc * mag)), ch++;
    }
    out->worst_u = wu, out->worst_h = wh;
    out->rms_u = sqrt(su / (double)cu), out->rms_h = sqrt(sh / (double)ch);
    int64_t diff = 0;
    for (int64_t i = 0; i < n * F; i++) diff += !same_float(hg[0][i], hg[1][i]) + !same_float(hu[0][i], hu[1][i]);
    for (int64_t i = 0; i < n * D; i++) diff += !same_float(y[0][i], y[1][i]);
    for (int64_t i = 0; i < D * D; i++) diff += !same_float(Hx[0][i], Hx[1][i]);
    if (diff) FAIL("%s: %lld values differ from one run to the next", mq_gpu_precision_name(prec), (long long)diff);
    if (stride == 1) {   /* fp32 again: the fmaf chains, the CPU's bits */
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_set_precision(g, MOEQ_GPU_FP32));
        float *cg = malloc((size_t)(n * F) * 4), *cuv = malloc((size_t)(n * F) * 4), *cy = malloc((size_t)(n * D) * 4);
        ASSERT_EQ_INT(MOEQ_OK, mq_mlp_forward(&gate, &up, &down, x, n, cg, cuv, cy));
        mq_gpu_mlp *m = NULL;
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_new(g, 1, D, F, pg, pu, pd, 32, &m));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_run(m, 0, x, n, hg[1], hu[1], y[1], NULL, NULL));
        for (int64_t i = 0; i < n * D; i++) diff += !same_float(y[1][i], cy[i]);
        if (diff) FAIL("fp32 again after %s: %lld outputs differ from mq_mlp_forward", mq_gpu_precision_name(prec),
                       (long long)diff);
        mq_gpu_mlp_free(m);
        free(cg), free(cuv), free(cy);
    }
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_set_precision(g, MOEQ_GPU_FP32));
    for (int r = 0; r < 2; r++) free(hg[r]), free(hu[r]), free(y[r]), free(Hx[r]);
    free(x), free(gate.w), free(up.w), free(down.w);
}

static void test_tf32_products(void) {
    mq_gpu *g = mq_test_open_gpu();
    /* small: every value; large: 4096 inputs x 2560 outputs over 2100 rows, so that the up
     * product's weights (2560 x 4096 floats), its rows (2100 x 4096) and the Hessian's rows are
     * more than one of tf32x3's 2^23-float blocks */
    const int64_t shapes[2][4] = {{96, 160, 75, 1}, {4096, 2560, 2100, 4099}};
    for (int c = 0; c < 2; c++) {
        tf32_check t1, t3;
        tf32_case(g, MOEQ_GPU_TF32, shapes[c][0], shapes[c][1], shapes[c][2], shapes[c][3], &t1);
        tf32_case(g, MOEQ_GPU_TF32X3, shapes[c][0], shapes[c][1], shapes[c][2], shapes[c][3], &t3);
        printf("  %lld inputs, %lld rows: worst excess over the bound, up product / Hessian (<= 0): tf32 %.3g / "
               "%.3g, tf32x3 %.3g / %.3g; relative RMS error: tf32 %.3g / %.3g, tf32x3 %.3g / %.3g\n",
               (long long)shapes[c][0], (long long)shapes[c][2], t1.worst_u, t1.worst_h, t3.worst_u, t3.worst_h,
               t1.rms_u, t1.rms_h, t3.rms_u, t3.rms_h);
        if (t1.worst_u > 0 || t1.worst_h > 0) FAIL("tf32: products outside the bound of their inputs' conversion");
        if (t3.worst_u > 0 || t3.worst_h > 0) FAIL("tf32x3: products outside the bound of their inputs' split");
        if (!(t3.rms_u * 16 <= t1.rms_u) || !(t3.rms_h * 16 <= t1.rms_h))
            FAIL("tf32x3's typical error is not 16 times below tf32's: not three products of the halves");
    }
    mq_gpu_close(g);
}

/* The experts' outputs kept on the device and combined there: each token's pairs (row of the kept
 * outputs, weight) in order, one fmaf per pair onto the buffer's value, against the same chain on
 * the CPU from mq_mlp_forward's outputs; a row past the batch is an error. */
static void test_mlp_combine(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t D = 64, F = 96, n = 50, ntok = 30;
    mq_linear gate = {.out = F, .in = D, .w = mq_test_weights(F, D, 61), .det = true};
    mq_linear up = {.out = F, .in = D, .w = mq_test_weights(F, D, 62), .det = true};
    mq_linear down = {.out = D, .in = F, .w = mq_test_weights(D, F, 63), .det = true};
    float *x = mq_test_weights(n, D, 64);
    for (int64_t i = 0; i < n * D; i++) x[i] *= 30;
    float *hg = malloc((size_t)(n * F) * 4), *hu = malloc((size_t)(n * F) * 4), *y = malloc((size_t)(n * D) * 4);
    ASSERT_EQ_INT(MOEQ_OK, mq_mlp_forward(&gate, &up, &down, x, n, hg, hu, y));
    const float *pg[1] = {gate.w}, *pu[1] = {up.w}, *pd[1] = {down.w};
    mq_gpu_mlp *m = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_new(g, 1, D, F, pg, pu, pd, n, &m));
    const float *xs[1] = {x};
    const int64_t rows[1] = {n};
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_inputs(m, xs, rows, 1));
    int32_t src[50];
    for (int64_t i = 0; i < n; i++) src[i] = (int32_t)i;
    /* the rows in two runs, kept at their places */
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_rows_index(m, src, n));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_run_indexed(m, 0, 0, 20, true, NULL, NULL));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_run_indexed(m, 0, 20, n - 20, true, NULL, NULL));
    /* token i -> output row 2 i + 1 of the buffer, pairs: rows (i, i + 7, 3 i mod n) as far as i allows */
    int64_t tok[30];
    int32_t first[31], row[90];
    float w[90], *ref = calloc((size_t)(2 * ntok + 2) * (size_t)D, 4);
    int np = 0;
    for (int64_t i = 0; i < ntok; i++) {
        tok[i] = 2 * i + 1;
        first[i] = np;
        const int32_t r[3] = {(int32_t)i, (int32_t)(i + 7), (int32_t)(3 * i % n)};
        for (int k = 0; k < 1 + (int)(i % 3); k++) {
            row[np] = r[k];
            w[np] = 0.25f + 0.125f * (float)k + (float)i / 64.0f;
            for (int64_t d = 0; d < D; d++)
                ref[tok[i] * D + d] = fmaf(w[np], y[(int64_t)r[k] * D + d], ref[tok[i] * D + d]);
            np++;
        }
    }
    first[ntok] = np;
    mq_gpu_buf *out = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_new(g, (2 * ntok + 2) * D, &out));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_combine(m, out, tok, first, row, w, ntok));
    float *got = malloc((size_t)(2 * ntok + 2) * (size_t)D * 4);
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_read(out, 0, (2 * ntok + 2) * D, got));
    int64_t diff = 0;
    for (int64_t k = 0; k < (2 * ntok + 2) * D; k++) diff += !same_float(got[k], ref[k]);
    if (diff) FAIL("combine: %lld values differ from the CPU's axpy chain", (long long)diff);
    row[0] = (int32_t)n;   /* past the batch */
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_mlp_combine(m, out, tok, first, row, w, ntok));
    mq_gpu_buf_free(out);
    mq_gpu_mlp_free(m);
    free(gate.w), free(up.w), free(down.w), free(x), free(hg), free(hu), free(y), free(ref), free(got);
    mq_gpu_close(g);
}

/* The FFN's outputs added to the boundary on the device (the pipeline's residual there): the
 * host's add_out (mq_vec's axpy by 1) bit for bit, signed zeros, infinities, NaNs, subnormals
 * and rounding ties among the values; n past either buffer is an error. */
static void test_buf_add(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t n = 100003;
    float *a = mq_test_weights(1, n, 71), *b = mq_test_weights(1, n, 72), *got = malloc((size_t)n * 4);
    const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 0x1p-149f, -0x1p-140f, 0x1.fffffep127f,
                             1.0f, 0x1p-24f, 0x1.000002p0f, -0x1p-25f};
    const int ns = (int)(sizeof special / sizeof *special);
    for (int i = 0; i < ns; i++)
        for (int j = 0; j < ns; j++) a[i * ns + j] = special[i], b[i * ns + j] = special[j];
    for (int64_t i = ns * ns; i < n; i += 7) a[i] *= 1e4f;   /* exponents apart: rounded adds */
    mq_gpu_buf *da = NULL, *db = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_new(g, n, &da));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_new(g, n + 5, &db));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_write(da, 0, n, a));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_write(db, 0, n, b));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_add(da, db, n));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_read(da, 0, n, got));
    mq_vec()->axpy(1.0f, b, a, n);   /* a += b as add_out does */
    int64_t diff = 0;
    for (int64_t i = 0; i < n; i++) diff += !same_float(got[i], a[i]);
    if (diff) FAIL("buffer add: %lld of %lld values differ from the host's axpy by 1", (long long)diff, (long long)n);
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_buf_add(da, db, n + 1));
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_buf_add(db, da, n + 5));
    mq_gpu_buf_free(da);
    mq_gpu_buf_free(db);
    free(a), free(b), free(got);
    mq_gpu_close(g);
}

/* Several experts of one set run at once on the device's streams (mq_gpu_mlp's lanes: expert e
 * on lane e % 4; five experts, so lane 0 takes two), each with its own Hessian sums, its rows in
 * pieces of 16 (by the batch's index on the device, or by its own indices) and its outputs kept
 * at their own rows: after mq_gpu_mlp_join every sum and
 * output is the CPU's bits for that expert (mq_mlp_forward, mq_hessian_add), read both through
 * the Hessians (stream 0) and the combine. */
static void test_mlp_lanes(void) {
    mq_gpu *g = mq_test_open_gpu();
    enum { E = 5 };
    const int64_t D = 96, F = 160, n_in = 60;
    mq_linear gate[E], up[E], down[E];
    const float *pg[E], *pu[E], *pd[E];
    for (int e = 0; e < E; e++) {
        gate[e] = (mq_linear){.out = F, .in = D, .w = mq_test_weights(F, D, 100 + 3 * e), .det = true};
        up[e] = (mq_linear){.out = F, .in = D, .w = mq_test_weights(F, D, 101 + 3 * e), .det = true};
        down[e] = (mq_linear){.out = D, .in = F, .w = mq_test_weights(D, F, 102 + 3 * e), .det = true};
        for (int64_t i = 0; i < F * D; i++) gate[e].w[i] *= 40, up[e].w[i] *= 40;
        pg[e] = gate[e].w, pu[e] = up[e].w, pd[e] = down[e].w;
    }
    float *x = mq_test_weights(n_in, D, 99);
    for (int64_t i = 0; i < n_in * D; i++) x[i] *= 50;
    mq_gpu_mlp *m = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_new(g, E, D, F, pg, pu, pd, 16, &m));
    const float *xs[1] = {x};
    const int64_t rows_in[1] = {n_in};
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_inputs(m, xs, rows_in, 1));
    int64_t n[E], r0[E + 1];
    int32_t src[E][64];
    r0[0] = 0;
    for (int e = 0; e < E; e++) {
        n[e] = 23 + 9 * e;   /* 23 .. 59 rows: two to four pieces of 16 */
        for (int64_t i = 0; i < n[e]; i++) src[e][i] = (int32_t)((i * 7 + e) % n_in);
        r0[e + 1] = r0[e] + n[e];
    }
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_reserve_kept(m, r0[E]));
    const int64_t Ks[2] = {D, F};
    mq_gpu_hessians *hx[E], *hd[E];
    for (int e = 0; e < E; e++) {
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 1, &Ks[0], &hx[e]));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_new(g, 1, &Ks[1], &hd[e]));
    }
    /* experts 0-2 from the inputs put up from the host, 3-4 from the same values in a device
     * buffer (mq_gpu_mlp_inputs_from: where the pipeline's GPU attention leaves them), by the
     * batch's index */
    int32_t all[5 * 64];
    for (int e = 0; e < E; e++) memcpy(all + r0[e], src[e], (size_t)n[e] * sizeof(int32_t));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_rows_index(m, all, r0[E]));
    for (int e = 0; e < 3; e++) ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_run_indexed(m, e, r0[e], n[e], true, hx[e], hd[e]));
    mq_gpu_buf *xin = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_new(g, (n_in + 1) * D, &xin));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_write(xin, 0, n_in * D, x));
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_mlp_inputs_from(m, xin, n_in + 2));   /* more rows than it holds */
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_inputs_from(m, xin, n_in));
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_mlp_inputs_put(m, 0, x, 1));   /* not into a buffer's rows */
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_rows_index(m, all, r0[E]));
    for (int e = 3; e < E; e++) ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_run_indexed(m, e, r0[e], n[e], true, hx[e], hd[e]));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_join(m));
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_mlp_run_indexed(m, 0, r0[E] - 2, 3, true, NULL, NULL));   /* past the index */
    all[0] = (int32_t)n_in;   /* outside the inputs: refused before anything goes up */
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_mlp_rows_index(m, all, r0[E]));
    /* the kept outputs through the combine: token t takes row t with weight 1 */
    const int64_t nt = r0[E];
    int64_t *tok = malloc((size_t)nt * sizeof *tok);
    int32_t *first = malloc((size_t)(nt + 1) * sizeof *first), *row = malloc((size_t)nt * sizeof *row);
    float *w = malloc((size_t)nt * 4), *got = malloc((size_t)(nt * D) * 4);
    for (int64_t t = 0; t < nt; t++) tok[t] = t, first[t] = (int32_t)t, row[t] = (int32_t)t, w[t] = 1.0f;
    first[nt] = (int32_t)nt;
    mq_gpu_buf *out = NULL;
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_new(g, nt * D, &out));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_mlp_combine(m, out, tok, first, row, w, nt));
    ASSERT_EQ_INT(MOEQ_OK, mq_gpu_buf_read(out, 0, nt * D, got));
    float *xp = malloc((size_t)(64 * D) * 4), *hg = malloc((size_t)(64 * F) * 4), *hu = malloc((size_t)(64 * F) * 4);
    float *y = malloc((size_t)(64 * D) * 4), *Gx = malloc((size_t)(D * D) * 4), *Gg = malloc((size_t)(F * F) * 4);
    for (int e = 0; e < E; e++) {
        for (int64_t i = 0; i < n[e]; i++) memcpy(xp + i * D, x + (int64_t)src[e][i] * D, (size_t)D * 4);
        ASSERT_EQ_INT(MOEQ_OK, mq_mlp_forward(&gate[e], &up[e], &down[e], xp, n[e], hg, hu, y));
        float *Hx = cpu_hessian(xp, n[e], D), *Hg = cpu_hessian(hg, n[e], F);
        int64_t nx = 0, ng = 0, diff = 0;
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_get(hx[e], 0, Gx, &nx));
        ASSERT_EQ_INT(MOEQ_OK, mq_gpu_hessians_get(hd[e], 0, Gg, &ng));
        ASSERT_EQ_INT(n[e], nx);
        ASSERT_EQ_INT(n[e], ng);
        for (int64_t i = 0; i < n[e] * D; i++) diff += !same_float(fmaf(1.0f, y[i], 0.0f), got[r0[e] * D + i]);
        if (diff) FAIL("lanes: expert %d: %lld outputs differ from mq_mlp_forward", e, (long long)diff);
        for (int64_t i = 0; i < D * D; i++) diff += !same_float(Hx[i], Gx[i]);
        for (int64_t i = 0; i < F * F; i++) diff += !same_float(Hg[i], Gg[i]);
        if (diff) FAIL("lanes: expert %d: %lld Hessian entries differ from mq_hessian_add's", e, (long long)diff);
        free(Hx), free(Hg);
    }
    for (int e = 0; e < E; e++) {
        mq_gpu_hessians_free(hx[e]), mq_gpu_hessians_free(hd[e]);
        free(gate[e].w), free(up[e].w), free(down[e].w);
    }
    mq_gpu_buf_free(out);
    mq_gpu_buf_free(xin);
    mq_gpu_mlp_free(m);
    free(x), free(tok), free(first), free(row), free(w), free(got), free(xp), free(hg), free(hu), free(y);
    free(Gx), free(Gg);
    mq_gpu_close(g);
}

TEST_MAIN(T(test_parse_device), T(test_open_missing_device), T(test_codecs_bitexact), T(test_rtn_bitexact),
          T(test_hessian_bitexact), T(test_gptq_parity), T(test_gptq_warp_equals_thread), T(test_gptq_batched_deterministic),
          T(test_gptq_retry_and_errors), T(test_gptq_device_inputs), T(test_gemm_det_bitexact), T(test_mlp_bitexact), T(test_mlp_large_upload),
          T(test_mlp_rows_hessians), T(test_mlp_combine), T(test_buf_add), T(test_mlp_lanes), T(test_attention_parity),
          T(test_attention_groups), T(test_tf32_products))
