/*
 * The vector kernels of src/kernels/vec.h: the exp against libm's expf (ulp bound over a dense
 * sweep of its whole range, and the special values softmax meets), logsumexp's double exp
 * against exp, every kernel of the scalar
 * reference against a slow obvious double-precision computation written here, and the SIMD twins
 * (AVX2 and, where the CPU has it, AVX-512 on x86-64; NEON on Arm64) bit for bit against the reference on lengths with every tail
 * size, unaligned pointers and special values, and the whole forward pass on either twin (and on
 * 1 or 2 threads).
 */
#include <stdlib.h>

#include "harness.h"
#include "kernels/vec.h"

static uint32_t g_rng = 12345;
static float frand(void) {   /* uniform in [-1, 1) */
    g_rng = g_rng * 1664525u + 1013904223u;
    return (float)(g_rng >> 8) * 0x1p-23f - 1.0f;
}

/* Distance in units in the last place between two non-negative floats (inf counts as the
 * float after FLT_MAX). */
static int64_t ulp_dist(float a, float b) {
    return llabs((long long)mq_test_f32_bits(a) - (long long)mq_test_f32_bits(b));
}

/* The SIMD twin this CPU runs (AVX2+FMA on x86-64, NEON on every Arm64 CPU), or NULL. */
static const char *g_twin = "SIMD";
static const mq_vec_kernels *simd_twin(void) {
#if MQ_TEST_X86
    g_twin = "AVX2";
    if (mq_cpu_has_avx512()) return g_twin = "AVX-512", &mq_vec_avx512;
    if (mq_cpu_has_avx2_fma()) return &mq_vec_avx2;
#endif
#if MQ_TEST_ARM
    g_twin = "NEON";
    return &mq_vec_neon;
#endif
    return NULL;
}

static const mq_vec_kernels *simd_or_skip(void) {
    const mq_vec_kernels *k = simd_twin();
    if (!k) SKIP("no AVX2+FMA on this CPU");
    return k;
}

/* Same float bits, or both NaN. */
static void assert_same(const float *a, const float *b, int64_t n, const char *what, int64_t len) {
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i]) && isnan(b[i])) continue;
        if (mq_test_f32_bits(a[i]) != mq_test_f32_bits(b[i]))
            FAIL("%s (n=%lld): element %lld: reference %.9g (0x%08x), %s %.9g (0x%08x)", what,
                 (long long)len, (long long)i, a[i], mq_test_f32_bits(a[i]), g_twin, b[i], mq_test_f32_bits(b[i]));
    }
}

/* ---- exp against libm --------------------------------------------------------------------- */
static void test_expf_ulp_vs_libm(void) {
    /* Every 61st float from -104 to 88.75 (about 36 million values). */
    int64_t worst_normal = 0, worst_sub = 0, n = 0;
    float worst_x = 0;
    uint32_t neg_lo = mq_test_f32_bits(-104.0f), pos_hi = mq_test_f32_bits(88.75f);
    for (int side = 0; side < 2; side++) {
        uint32_t start = side ? 0x00000000u : 0x80000000u, end = side ? pos_hi : neg_lo;
        for (uint32_t u = start; u <= end; u += 61) {
            float x = mq_test_f32_from_bits(u), want = expf(x), got = mq_vec_expf(x);
            int64_t d = ulp_dist(want, got);
            if (want >= 0x1p-126f) {
                if (d > worst_normal) worst_normal = d, worst_x = x;
            } else if (d > worst_sub) {
                worst_sub = d;
            }
            n++;
        }
    }
    fprintf(stderr, "  exp vs expf: %lld values, max %lld ulp (normal results, at x = %.9g), "
            "%lld ulp (subnormal results)\n", (long long)n, (long long)worst_normal, worst_x,
            (long long)worst_sub);
    ASSERT_TRUE(worst_normal <= 2);
    ASSERT_TRUE(worst_sub <= 1);
    /* Edges of the range, exactly */
    ASSERT_TRUE(mq_vec_expf(88.7228394f) == expf(88.7228394f) ||
                ulp_dist(mq_vec_expf(88.7228394f), expf(88.7228394f)) <= 2);
    ASSERT_TRUE(isinf(mq_vec_expf(88.73f)) && isinf(expf(88.73f)));
    ASSERT_TRUE(isinf(mq_vec_expf(1e30f)));
    ASSERT_EQ_HEX(mq_test_f32_bits(expf(-103.9f)), mq_test_f32_bits(mq_vec_expf(-103.9f)));   /* subnormal 2^-149-ish */
    ASSERT_EQ_HEX(0u, mq_test_f32_bits(mq_vec_expf(-104.0f)));
    ASSERT_EQ_HEX(0u, mq_test_f32_bits(mq_vec_expf(-1e30f)));
}

static void test_expf_specials(void) {
    const mq_vec_kernels *ks[2] = {&mq_vec_ref, simd_twin()};
    float x[9] = {-INFINITY, INFINITY, NAN, 0.0f, -0.0f, -87.5f, -100.0f, 1.0f, -1.0f};
    for (int k = 0; k < 2 && ks[k]; k++) {
        float y[9];
        ks[k]->exp(x, y, 9);
        ASSERT_EQ_HEX(0u, mq_test_f32_bits(y[0]));          /* exp(-inf) = +0: masked softmax positions */
        ASSERT_TRUE(isinf(y[1]) && y[1] > 0);
        ASSERT_TRUE(isnan(y[2]));
        ASSERT_EQ_HEX(mq_test_f32_bits(1.0f), mq_test_f32_bits(y[3]));  /* exp(0) = 1 exactly: the row maximum */
        ASSERT_EQ_HEX(mq_test_f32_bits(1.0f), mq_test_f32_bits(y[4]));
        ASSERT_TRUE(ulp_dist(y[5], expf(-87.5f)) <= 1);   /* gradual underflow like expf */
        ASSERT_TRUE(ulp_dist(y[6], expf(-100.0f)) <= 1);
        ASSERT_TRUE(ulp_dist(y[7], expf(1.0f)) <= 2);
        ASSERT_TRUE(ulp_dist(y[8], expf(-1.0f)) <= 2);
    }
}

/* logsumexp's double exp terms against libm's exp. */
static void test_exp_sum_term(void) {
    double worst = 0;
    for (int i = 0; i <= 200000; i++) {
        double d = -708.0 * i / 200000 - (i % 7) * 1e-9;
        if (d < -708.0) d = -708.0;
        double want = exp(d), got = mq_vec_exp_sum_term(d), e = fabs(got - want) / want;
        worst = e > worst ? e : worst;
    }
    fprintf(stderr, "  exp sum term vs exp: max relative error %.3g\n", worst);
    ASSERT_TRUE(worst < 1e-15);
    ASSERT_TRUE(mq_vec_exp_sum_term(0.0) == 1.0);
    ASSERT_TRUE(mq_vec_exp_sum_term(-INFINITY) == mq_vec_exp_sum_term(-708.0));   /* negligible */
    ASSERT_TRUE(mq_vec_exp_sum_term(-INFINITY) < 1e-307);
    ASSERT_TRUE(isnan(mq_vec_exp_sum_term(NAN)));
}

/* ---- the reference against obvious double-precision math ---------------------------------- */
static void test_ref_against_double(void) {
    enum { N = 1000 };
    float a[N], b[N], w[N], y[N], u[N];
    for (int i = 0; i < N; i++) a[i] = 3 * frand(), b[i] = frand(), w[i] = 1 + frand() / 2;
    for (int n = 1; n <= N; n = n * 3 + 1) {
        double d = 0, ss = 0;
        for (int i = 0; i < n; i++) d += (double)a[i] * b[i], ss += (double)a[i] * a[i];
        ASSERT_NEAR(d, mq_vec_ref.dot(a, b, n), 1e-5 * (1 + sqrt((double)n)));

        /* gemv: rows of W = a shifted */
        float g[8];
        mq_vec_ref.gemv(a, 1, 4, b, n > 3 ? n - 3 : n, 0.5f, g);
        for (int r = 0; r < 4; r++) {
            int64_t len = n > 3 ? n - 3 : n;
            double e = 0;
            for (int64_t i = 0; i < len; i++) e += (double)a[r + i] * b[i];
            ASSERT_NEAR(0.5 * e, g[r], 1e-5 * (1 + sqrt((double)n)));
        }

        /* softmax */
        memcpy(y, a, sizeof(float) * (size_t)n);
        mq_vec_ref.softmax(y, n);
        double mx = a[0], s = 0;
        for (int i = 0; i < n; i++) mx = a[i] > mx ? a[i] : mx;
        for (int i = 0; i < n; i++) s += exp((double)a[i] - mx);
        for (int i = 0; i < n; i++) ASSERT_NEAR(exp((double)a[i] - mx) / s, y[i], 1e-6);

        /* log-sum-exp and argmax */
        int32_t am = -1;
        double lse = mq_vec_ref.logsumexp(a, n, &am);
        ASSERT_NEAR(mx + log(s), lse, 1e-13);
        ASSERT_TRUE(a[am] == (float)mx);
        for (int i = 0; i < am; i++) ASSERT_TRUE(a[i] < a[am]);

        /* KL between the softmaxes of a and a perturbed copy */
        for (int i = 0; i < n; i++) u[i] = a[i] + 0.1f * b[i];
        double lse_u = mq_vec_ref.logsumexp(u, n, NULL), want_kl = 0;
        for (int i = 0; i < n; i++) {
            double pa = (double)a[i] - lse, pu = (double)u[i] - lse_u;
            want_kl += exp(pa) * (pa - pu);
        }
        ASSERT_NEAR(want_kl, mq_vec_ref.kl(a, lse, u, lse_u, n), 1e-13);
        ASSERT_TRUE(mq_vec_ref.kl(a, lse, a, lse, n) == 0.0);

        /* RMSNorm */
        mq_vec_ref.rmsnorm(a, n, w, 1e-5f, y);
        double inv = 1.0 / sqrt(ss / n + 1e-5);
        for (int i = 0; i < n; i++)
            ASSERT_NEAR(w[i] * a[i] * inv, y[i], 1e-5 * fabs(w[i] * a[i] * inv) + 1e-7);

        /* SwiGLU */
        memcpy(y, a, sizeof(float) * (size_t)n);
        for (int i = 0; i < n; i++) u[i] = b[i];
        mq_vec_ref.swiglu(y, u, n);
        for (int i = 0; i < n; i++) {
            double e = (double)a[i] / (1.0 + exp(-(double)a[i])) * b[i];
            ASSERT_NEAR(e, y[i], 1e-6 * (1 + fabs(e)));
        }

        /* transposed GEMV: V = rows of a (stride 5), weights b */
        int64_t cols = n < 5 ? n : 5, vr = (n - cols) / 5 + 1;
        mq_vec_ref.gemv_t(a, 5, vr, b, cols, g);
        for (int64_t j = 0; j < cols; j++) {
            double e = 0;
            for (int64_t i = 0; i < vr; i++) e += (double)b[i] * a[i * 5 + j];
            ASSERT_NEAR(e, g[j], 1e-5 * (1 + sqrt((double)vr)));
        }

        /* RoPE on a head of 2 * (n / 2) values: rotate_half with rounded products */
        if (n >= 2) {
            int64_t half = n / 2;
            memcpy(y, a, sizeof(float) * (size_t)(2 * half));
            mq_vec_ref.rope(y, half, b, w);
            for (int64_t i = 0; i < half; i++) {
                float ac = a[i] * b[i], bs = a[i + half] * w[i];
                float bc = a[i + half] * b[i], as = a[i] * w[i];
                ASSERT_EQ_HEX(mq_test_f32_bits(ac - bs), mq_test_f32_bits(y[i]));
                ASSERT_EQ_HEX(mq_test_f32_bits(bc + as), mq_test_f32_bits(y[i + half]));
            }
        }

        /* axpy: one fma per element */
        memcpy(y, b, sizeof(float) * (size_t)n);
        mq_vec_ref.axpy(0.75f, a, y, n);
        for (int i = 0; i < n; i++) ASSERT_EQ_HEX(mq_test_f32_bits(fmaf(0.75f, a[i], b[i])), mq_test_f32_bits(y[i]));
    }
    /* the zero-padded tail turns a -0 sum into +0, as the AVX2 masked lanes do */
    float mz[3] = {-0.0f, -0.0f, -0.0f}, pz[3] = {0.0f, 0.0f, 0.0f};
    ASSERT_EQ_HEX(0u, mq_test_f32_bits(mq_vec_ref.dot(mz, pz, 3)));
}

static void test_logsumexp_edges(void) {
    const mq_vec_kernels *ks[2] = {&mq_vec_ref, simd_twin()};
    for (int k = 0; k < 2 && ks[k]; k++) {
        float l[37];
        for (int i = 0; i < 37; i++) l[i] = -INFINITY;
        int32_t am = -1;
        ASSERT_TRUE(isinf(ks[k]->logsumexp(l, 37, &am)) && am == 0);   /* all masked */
        l[20] = 2.0f, l[30] = 2.0f;    /* ties: the lower index */
        ASSERT_NEAR(2.0 + log(2.0), ks[k]->logsumexp(l, 37, &am), 1e-12);
        ASSERT_EQ_INT(20, am);
        l[5] = NAN;                    /* a NaN past x[0]: max ignores it, the sum does not */
        ASSERT_TRUE(isnan(ks[k]->logsumexp(l, 37, &am)));
        ASSERT_EQ_INT(20, am);
        l[0] = NAN;
        ASSERT_TRUE(isnan(ks[k]->logsumexp(l, 37, &am)));
        l[0] = INFINITY, l[5] = 0;
        ASSERT_TRUE(isinf(ks[k]->logsumexp(l, 37, &am)) && am == 0);
    }
}

/* ---- SIMD twin bit for bit ----------------------------------------------------------------- */
static void fill(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = scale * frand();
}

static void check_twin(const mq_vec_kernels *av) {
    const mq_vec_kernels *rf = &mq_vec_ref;
    enum { MAXN = 4100 };
    float *a = malloc(sizeof(float) * (MAXN + 8)), *b = malloc(sizeof(float) * (MAXN + 8));
    float *w = malloc(sizeof(float) * (MAXN + 8)), *y1 = malloc(sizeof(float) * 9 * (MAXN + 8));
    float *y2 = malloc(sizeof(float) * 9 * (MAXN + 8)), *W = malloc(sizeof(float) * 9 * (MAXN + 8));
    int64_t lens[] = {1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 23, 24, 25, 31, 32, 33, 40, 47, 63, 64, 65,
                      100, 255, 256, 257, 511, 512, 4096, 4099};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        int64_t n = lens[li];
        for (int off = 0; off < 3; off += 2) {   /* aligned and unaligned */
            float *x = a + off, *z = b + off, *ww = w + off;
            fill(x, n, 4.0f);
            fill(z, n, 1.0f);
            fill(ww, n, 1.0f);
            float d1 = rf->dot(x, z, n), d2 = av->dot(x, z, n);
            assert_same(&d1, &d2, 1, "dot", n);

            int64_t rows = 1 + (n % 9), ldw = n + 3;
            fill(W, rows * ldw, 1.0f);
            rf->gemv(W + off, ldw, rows, z, n, 0.125f, y1);
            av->gemv(W + off, ldw, rows, z, n, 0.125f, y2);
            assert_same(y1, y2, rows, "gemv", n);
            for (int64_t r = 0; r < rows; r++) {   /* each row exactly as dot */
                float dr = 0.125f * av->dot(W + off + r * ldw, z, n);
                assert_same(&dr, &y2[r], 1, "gemv row vs dot", n);
            }

            /* transposed GEMV: V [rows2, n] with a row stride, against axpy row after row */
            int64_t rows2 = 1 + (n * 7) % 67;
            rf->gemv_t(W + off, ldw, rows2 < 9 ? rows2 : 9, z, n, y1);
            av->gemv_t(W + off, ldw, rows2 < 9 ? rows2 : 9, z, n, y2);
            assert_same(y1, y2, n, "gemv_t", n);
            for (int64_t j = 0; j < n; j++) y1[j] = 0.0f;
            for (int64_t r = 0; r < (rows2 < 9 ? rows2 : 9); r++)
                av->axpy(z[r], W + off + r * ldw, y1, n);
            assert_same(y1, y2, n, "gemv_t vs axpy", n);

            memcpy(y1, z, sizeof(float) * (size_t)n);
            memcpy(y2, z, sizeof(float) * (size_t)n);
            rf->axpy(-1.5f, x, y1, n);
            av->axpy(-1.5f, x, y2, n);
            assert_same(y1, y2, n, "axpy", n);

            /* RoPE: a head of 2n values, cos/sin from z and ww */
            fill(W, 2 * n, 2.0f);
            memcpy(y1, W, sizeof(float) * (size_t)(2 * n));
            memcpy(y2, W, sizeof(float) * (size_t)(2 * n));
            rf->rope(y1, n, z, ww);
            av->rope(y2, n, z, ww);
            assert_same(y1, y2, 2 * n, "rope", n);

            /* exp over the whole clamp range and beyond, specials sprinkled in */
            for (int64_t i = 0; i < n; i++) y1[i] = 110.0f * frand();
            if (n > 3) y1[1] = -INFINITY, y1[2] = NAN, y1[3] = INFINITY;
            memcpy(y2 + MAXN, y1, sizeof(float) * (size_t)n);
            rf->exp(y2 + MAXN, y1, n);
            av->exp(y2 + MAXN, y2, n);
            assert_same(y1, y2, n, "exp", n);

            /* softmax of scores with a wide range (underflowing terms) */
            for (int64_t i = 0; i < n; i++) y1[i] = y2[i] = 30.0f * x[i];
            rf->softmax(y1, n);
            av->softmax(y2, n);
            assert_same(y1, y2, n, "softmax", n);

            int32_t am1 = -1, am2 = -2;
            double l1 = rf->logsumexp(x, n, &am1), l2 = av->logsumexp(x, n, &am2);
            if (memcmp(&l1, &l2, sizeof l1) != 0 || am1 != am2)
                FAIL("logsumexp (n=%lld): reference %.17g @%d, %s %.17g @%d", (long long)n, l1,
                     am1, g_twin, l2, am2);
            if (n > 2) {   /* a tie at the maximum in the tail */
                x[n - 1] = x[am1];
                float keep = x[0];
                x[0] = -1000.0f;
                l1 = rf->logsumexp(x, n, &am1), l2 = av->logsumexp(x, n, &am2);
                if (memcmp(&l1, &l2, sizeof l1) != 0 || am1 != am2)
                    FAIL("logsumexp tie (n=%lld): %.17g @%d vs %.17g @%d", (long long)n, l1, am1,
                         l2, am2);
                x[0] = keep;
            }

            double k1 = rf->kl(x, 3.25, z, -1.5, n), k2 = av->kl(x, 3.25, z, -1.5, n);
            if (memcmp(&k1, &k2, sizeof k1) != 0)
                FAIL("kl (n=%lld): reference %.17g, %s %.17g", (long long)n, k1, g_twin, k2);

            rf->rmsnorm(x, n, ww, 1e-6f, y1);
            av->rmsnorm(x, n, ww, 1e-6f, y2);
            assert_same(y1, y2, n, "rmsnorm", n);

            for (int64_t i = 0; i < n; i++) y1[i] = y2[i] = 40.0f * x[i];   /* exp(-g) overflows */
            rf->swiglu(y1, z, n);
            av->swiglu(y2, z, n);
            assert_same(y1, y2, n, "swiglu", n);
        }
    }
    free(a), free(b), free(w), free(y1), free(y2), free(W);
}

/* Every SIMD twin this CPU runs: AVX2 and, where the CPU has it, AVX-512 (x86-64); NEON. */
static void test_simd_twin(void) {
    simd_or_skip();
#if MQ_TEST_X86
    g_twin = "AVX2";
    check_twin(&mq_vec_avx2);
    if (mq_cpu_has_avx512()) {
        g_twin = "AVX-512";
        check_twin(&mq_vec_avx512);
    } else {
        fprintf(stderr, "  no AVX-512 on this CPU (or MOEQ_NO_AVX512): the AVX-512 twin is not run\n");
    }
#else
    check_twin(simd_twin());
#endif
}

/* The whole forward pass on the reference kernels (MOEQ_FORCE_REF) equals the SIMD one bit for
 * bit: a prefill (GEMM attention path), a 2-token chunk and single-token decode steps (GEMV path),
 * with 1 and 2 threads (1 only under qemu-user, MOEQ_CROSS: contended locks crawl there). */
static float *session_run(moeq_model *m, const int32_t *ids, int threads, int force_ref) {
    enum { P = 37, N = 42 };
    int64_t V = moeq_model_get_info(m)->vocab_size;
    float *out = malloc(sizeof(float) * (size_t)(N * V));
    moeq_set_threads(threads);
    moeq_set_force_ref(force_ref);
    moeq_session *s = NULL;
    ASSERT_OK(moeq_session_create(m, N, &s));
    ASSERT_OK(moeq_session_forward(s, ids, P, out));
    ASSERT_OK(moeq_session_forward(s, ids + P, 2, out + P * V));
    for (int i = P + 2; i < N; i++) ASSERT_OK(moeq_session_forward(s, ids + i, 1, out + i * V));
    moeq_session_free(s);
    moeq_set_force_ref(0);
    moeq_set_threads(0);
    return out;
}

static void test_forward_ref_twin(void) {
    simd_or_skip();
    const int emu = getenv("MOEQ_CROSS") != NULL;
    const char *models[] = {"models/olmoe-tiny", "tests/data/qwen2moe-dense-tiny",
                            "tests/data/qwen3moe-tiny"};
    for (int mi = 0; mi < 3; mi++) {
        moeq_model *m = NULL;
        moeq_model_options opt = {.no_tokenizer = 1};
        ASSERT_OK(moeq_model_open(mq_test_repo(models[mi]), &opt, &m));
        int64_t V = moeq_model_get_info(m)->vocab_size;
        int32_t ids[42];
        for (int i = 0; i < 42; i++) ids[i] = (int32_t)((i * 2654435761u) % (uint32_t)V);
        float *a = session_run(m, ids, 1, 0), *b = session_run(m, ids, 1, 1);
        assert_same(b, a, 42 * V, models[mi], 42);   /* reference vs SIMD */
        if (!emu) {
            float *c = session_run(m, ids, 2, 0);
            assert_same(a, c, 42 * V, models[mi], 42);   /* 1 vs 2 threads */
            free(c);
        }
        free(a), free(b);
        moeq_model_free(m);
    }
}

/* mq_vec() follows mq_force_ref. */
static void test_dispatch(void) {
    moeq_set_force_ref(1);
    ASSERT_TRUE(mq_vec() == &mq_vec_ref);
    moeq_set_force_ref(0);
    ASSERT_TRUE(mq_vec() == (simd_twin() ? simd_twin() : &mq_vec_ref));
}

TEST_MAIN(T(test_expf_ulp_vs_libm), T(test_expf_specials), T(test_exp_sum_term),
          T(test_ref_against_double),
          T(test_logsumexp_edges), T(test_simd_twin), T(test_forward_ref_twin), T(test_dispatch))
