/* Scoring math of the evaluator: log-sum-exp, exact KL, top-k selection, the top-k KL
 * approximation and its error bound, numpy's percentile, and the saved-logits file format.
 * References: closed forms worked out by hand, slow long-double loops written here, numpy
 * values. */
#include <stdlib.h>

#include "eval/eval.h"
#include "harness.h"

static uint32_t g_rng = 12345;
static double urand(void) { /* uniform in [0, 1) */
    g_rng = g_rng * 1664525u + 1013904223u;
    return (double)(g_rng >> 8) / 16777216.0;
}
static double nrand(void) { /* standard normal (Box-Muller) */
    double u = urand() + 1e-12, v = urand();
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static long double slow_lse(const float *l, int64_t V) {
    long double s = 0;
    for (int64_t v = 0; v < V; v++) s += expl((long double)l[v]);
    return logl(s);
}

static long double slow_kl(const float *lb, const float *lm, int64_t V) {
    long double zb = slow_lse(lb, V), zm = slow_lse(lm, V), kl = 0;
    for (int64_t v = 0; v < V; v++) {
        long double pb = expl(lb[v] - zb);
        kl += pb * ((lb[v] - zb) - (lm[v] - zm));
    }
    return kl;
}

static void test_kl_hand_case(void) {
    /* p = softmax(0, 1, 2), q = softmax(2, 1, 0) = p reversed. log(p_i / q_i) = (l_i - (2 - l_i))
     * = 2 l_i - 2, so KL = sum p_i (2 l_i - 2) = 2 (p_3 - p_1) = 2 (e^2 - 1) / (1 + e + e^2). */
    const float lb[3] = {0, 1, 2}, lm[3] = {2, 1, 0};
    double e = exp(1.0), want = 2 * (e * e - 1) / (1 + e + e * e);
    ASSERT_NEAR(1.1504207, want, 1e-7); /* the closed form, evaluated by hand */
    int32_t am = -1;
    double zb = mq_logsumexp(lb, 3, &am);
    ASSERT_EQ_INT(2, am);
    ASSERT_NEAR(log(1 + e + e * e), zb, 1e-7); /* expf terms: ~1e-8 */
    double zm = mq_logsumexp(lm, 3, &am);
    ASSERT_EQ_INT(0, am);
    ASSERT_NEAR(want, mq_kl_rows(lb, zb, lm, zm, 3), 1e-7);
    ASSERT_TRUE(mq_kl_rows(lb, zb, lb, zb, 3) == 0.0); /* exactly zero against itself */
    /* top-k with k = V is the exact KL; k = 1 coarsens to {token 2, rest} */
    uint32_t ids[3];
    float vals[3];
    uint8_t mark[3] = {0};
    double bound = -1;
    mq_topk(lb, 3, 3, ids, vals);
    ASSERT_NEAR(want, mq_kl_topk(ids, vals, 3, zb, lm, zm, 3, mark, &bound), 1e-7);
    ASSERT_TRUE(bound == 0.0);
    mq_topk(lb, 3, 1, ids, vals);
    double p3 = e * e / (1 + e + e * e), q3 = 1 / (1 + e + e * e);
    double coarse = p3 * log(p3 / q3) + (1 - p3) * log((1 - p3) / (1 - q3));
    ASSERT_NEAR(coarse, mq_kl_topk(ids, vals, 1, zb, lm, zm, 3, mark, &bound), 1e-7);
    ASSERT_TRUE(coarse < want);
    ASSERT_TRUE(want - coarse <= bound);
    for (int i = 0; i < 3; i++) ASSERT_EQ_INT(0, mark[i]);
}

static void test_logsumexp_and_argmax(void) {
    enum { V = 1000 };
    float l[V];
    for (int trial = 0; trial < 20; trial++) {
        double off = trial < 10 ? 0 : 3000.0 * (trial - 15); /* far outside exp's range */
        for (int v = 0; v < V; v++) l[v] = (float)(off + 8 * nrand());
        l[trial * 7] = l[trial * 7 + 3] = (float)(off + 100); /* a tie for the maximum */
        int32_t am = -1;
        double z = mq_logsumexp(l, V, &am);
        ASSERT_EQ_INT(trial * 7, am); /* first index of the maximum */
        long double mx = l[am], s = 0;
        for (int v = 0; v < V; v++) s += expl((long double)l[v] - mx);
        ASSERT_NEAR((double)(mx + logl(s)), z, 1e-9 * fabs(off + 100));
    }
    l[5] = NAN;
    ASSERT_FALSE(isfinite(mq_logsumexp(l, V, NULL))); /* a NaN anywhere: not finite */
    l[0] = NAN;
    ASSERT_FALSE(isfinite(mq_logsumexp(l, V, NULL)));
}

static int cmp_entry(const void *a, const void *b) {
    const float *x = a, *y = b; /* (value, id) pairs packed as two floats */
    if (x[0] != y[0]) return x[0] > y[0] ? -1 : 1;
    return x[1] < y[1] ? -1 : x[1] > y[1];
}

static void test_topk_matches_sort(void) {
    enum { V = 777 };
    float l[V], pairs[V][2];
    uint32_t ids[64];
    float vals[64];
    for (int trial = 0; trial < 30; trial++) {
        for (int v = 0; v < V; v++) {
            l[v] = (float)floor(nrand() * 4) / 4; /* coarse values: many ties */
            pairs[v][0] = l[v];
            pairs[v][1] = (float)v;
        }
        qsort(pairs, V, sizeof pairs[0], cmp_entry);
        int32_t k = 1 + trial * 2;
        mq_topk(l, V, k, ids, vals);
        for (int32_t i = 0; i < k; i++) {
            ASSERT_EQ_INT((int)pairs[i][1], ids[i]);
            ASSERT_TRUE(vals[i] == pairs[i][0]);
        }
    }
}

static void test_kl_rows_against_slow_loop(void) {
    enum { V = 4096 };
    float *lb = malloc(sizeof(float) * V), *lm = malloc(sizeof(float) * V);
    for (int trial = 0; trial < 10; trial++) {
        double sigma = 0.01 * (1 << trial);
        for (int v = 0; v < V; v++) {
            lb[v] = (float)(3 * nrand());
            lm[v] = (float)(lb[v] + sigma * nrand());
        }
        double zb = mq_logsumexp(lb, V, NULL), zm = mq_logsumexp(lm, V, NULL);
        long double want = slow_kl(lb, lm, V);
        ASSERT_NEAR((double)want, mq_kl_rows(lb, zb, lm, zm, V), 1e-9 + 1e-6 * (double)want);
        ASSERT_TRUE(mq_kl_rows(lb, zb, lb, zb, V) == 0.0);
    }
    free(lb);
    free(lm);
}

/* Entropy of a row against -sum p log p in long double: uniform (log V), peaked, random. */
static void test_entropy_row_against_slow_loop(void) {
    enum { V = 4096 };
    float *l = malloc(sizeof(float) * V), *zeros = calloc(V, sizeof(float));
    for (int trial = 0; trial < 6; trial++) {
        for (int v = 0; v < V; v++)
            l[v] = trial == 0 ? 1.5f : trial == 1 ? (v == 7 ? 40.0f : 0.0f) : (float)(trial * nrand());
        double z = mq_logsumexp(l, V, NULL);
        long double zl = 0, h = 0;
        for (int v = 0; v < V; v++) zl += expl((long double)l[v]);
        zl = logl(zl);
        for (int v = 0; v < V; v++) h -= expl(l[v] - zl) * (l[v] - zl);
        ASSERT_NEAR((double)h, mq_entropy_row(l, z, zeros, V), 1e-9 + 1e-7 * (double)h);
        if (trial == 0) ASSERT_NEAR(log((double)V), mq_entropy_row(l, z, zeros, V), 1e-9);
    }
    free(l);
    free(zeros);
}

/* The top-k approximation: never above the exact KL, below it by at most the reported bound,
 * exact when the model changes only the top-k logits or when k = V. */
static void test_kl_topk_approximation(void) {
    enum { V = 4096, K = 32 };
    float *lb = malloc(sizeof(float) * V), *lm = malloc(sizeof(float) * V), vals[V];
    uint32_t *ids = malloc(sizeof(uint32_t) * V);
    uint8_t *mark = calloc(V, 1);
    double worst_rel = 0;
    for (int trial = 0; trial < 40; trial++) {
        double temp = 1 + trial % 4, sigma = 0.05 * (1 + trial % 5);
        for (int v = 0; v < V; v++) {
            lb[v] = (float)(temp * nrand());
            lm[v] = (float)(lb[v] + sigma * nrand());
        }
        double zb = mq_logsumexp(lb, V, NULL), zm = mq_logsumexp(lm, V, NULL);
        double exact = mq_kl_rows(lb, zb, lm, zm, V), bound = -1;
        mq_topk(lb, V, K, ids, vals);
        double approx = mq_kl_topk(ids, vals, K, zb, lm, zm, V, mark, &bound);
        ASSERT_TRUE(approx <= exact + 1e-12);
        ASSERT_TRUE(exact - approx <= bound + 1e-12);
        ASSERT_TRUE(approx >= 0);
        double rel = (exact - approx) / exact;
        if (rel > worst_rel) worst_rel = rel;
        /* sharper distributions (temperature 4): the k tokens hold most of the mass */
        if (temp == 4) ASSERT_TRUE(rel < 0.5);
        mq_topk(lb, V, V, ids, vals);
        ASSERT_NEAR(exact, mq_kl_topk(ids, vals, V, zb, lm, zm, V, mark, &bound), 1e-9);
        ASSERT_TRUE(bound == 0.0);
        /* change only the base's top-k logits: the rest conditionals agree, the gap vanishes */
        mq_topk(lb, V, K, ids, vals);
        memcpy(lm, lb, sizeof(float) * V);
        for (int i = 0; i < K; i++) lm[ids[i]] += (float)(0.3 * nrand());
        zm = mq_logsumexp(lm, V, NULL);
        exact = mq_kl_rows(lb, zb, lm, zm, V);
        ASSERT_NEAR(exact, mq_kl_topk(ids, vals, K, zb, lm, zm, V, mark, NULL),
                    1e-9 + 1e-6 * exact);
    }
    for (int v = 0; v < V; v++) ASSERT_EQ_INT(0, mark[v]);
    fprintf(stderr, "  top-%d KL on N(0, t^2) logits, V=%d: worst relative underestimate %.3f\n", K,
            V, worst_rel);
    free(lb);
    free(lm);
    free(ids);
    free(mark);
}

static void test_percentile_like_numpy(void) {
    double v[100];
    for (int i = 0; i < 100; i++) v[i] = 100 - i;         /* 100 .. 1, unsorted on purpose */
    ASSERT_NEAR(99.01, mq_percentile(v, 100, 99), 1e-12); /* numpy.percentile(range(1,101), 99) */
    ASSERT_NEAR(50.5, mq_percentile(v, 100, 50), 1e-12);
    ASSERT_NEAR(100, mq_percentile(v, 100, 100), 0);
    ASSERT_NEAR(1, mq_percentile(v, 100, 0), 0);
    double w[2] = {10, 0};
    ASSERT_NEAR(9.9, mq_percentile(w, 2, 99), 1e-12);
    double one[1] = {3.5};
    ASSERT_NEAR(3.5, mq_percentile(one, 1, 99), 0);
    ASSERT_TRUE(isnan(mq_percentile(one, 0, 99)));
}

static void test_logits_file_format(void) {
    mq_logits_header h = {.vocab = 4096,
                          .k = 3,
                          .max_length = 512,
                          .flags = 1,
                          .prefix = 0,
                          .tokens = 2,
                          .documents = 1,
                          .ids_checksum = 0x0123456789abcdefull};
    size_t rec = mq_logits_record_size(3), size = MQ_LOGITS_HEADER + 2 * rec;
    ASSERT_EQ_INT(32, rec);
    uint8_t *buf = calloc(size, 1);
    mq_logits_header_encode(&h, buf);
    ASSERT_TRUE(memcmp(buf, "MQTOPKLG", 8) == 0);
    ASSERT_EQ_INT(1, buf[8]);     /* version, little-endian */
    ASSERT_EQ_HEX(0x00, buf[12]); /* vocab 4096 = 0x1000 */
    ASSERT_EQ_HEX(0x10, buf[13]);
    ASSERT_EQ_HEX(0xef, buf[48]); /* checksum low byte first */
    const uint32_t ids[3] = {7, 4095, 0};
    const float vals[3] = {3.25f, -1e-30f, -INFINITY};
    mq_logits_record_encode(buf + MQ_LOGITS_HEADER, -12.5, ids, vals, 3);
    ASSERT_EQ_HEX(0xc0, buf[MQ_LOGITS_HEADER + 7]); /* -12.5 = 0xC029000000000000 */
    ASSERT_EQ_HEX(0x29, buf[MQ_LOGITS_HEADER + 6]);
    double lse;
    uint32_t ids2[3];
    float vals2[3];
    mq_logits_record_decode(buf + MQ_LOGITS_HEADER, 3, &lse, ids2, vals2);
    ASSERT_TRUE(lse == -12.5);
    ASSERT_TRUE(memcmp(ids, ids2, sizeof ids) == 0 && memcmp(vals, vals2, sizeof vals) == 0);

    mq_logits_header g;
    ASSERT_OK(mq_logits_header_decode("f.bin", buf, size, &g));
    ASSERT_EQ_INT(4096, g.vocab);
    ASSERT_EQ_INT(3, g.k);
    ASSERT_EQ_INT(512, g.max_length);
    ASSERT_EQ_INT(1, g.flags);
    ASSERT_EQ_INT(2, g.tokens);
    ASSERT_EQ_HEX(0x0123456789abcdefull, g.ids_checksum);
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_logits_header_decode("f.bin", buf, size - 1, &g));
    ASSERT_ERROR_MENTIONS("f.bin: ");
    ASSERT_ERROR_MENTIONS("truncated");
    buf[20] ^= 1; /* max_length changed behind the header checksum */
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_logits_header_decode("f.bin", buf, size, &g));
    ASSERT_ERROR_MENTIONS("checksum");
    buf[20] ^= 1;
    buf[8] = 2;
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, mq_logits_header_decode("f.bin", buf, size, &g));
    ASSERT_ERROR_MENTIONS("version 2");
    buf[0] = 'X';
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_logits_header_decode("f.bin", buf, size, &g));
    ASSERT_ERROR_MENTIONS("not a moeq logits file");
    free(buf);
    /* FNV-1a 64 reference values ("" and "a") */
    ASSERT_EQ_HEX(0xcbf29ce484222325ull, mq_fnv1a(MQ_FNV_INIT, "", 0));
    ASSERT_EQ_HEX(0xaf63dc4c8601ec8cull, mq_fnv1a(MQ_FNV_INIT, "a", 1));
}

TEST_MAIN(T(test_kl_hand_case), T(test_logsumexp_and_argmax), T(test_topk_matches_sort),
          T(test_kl_rows_against_slow_loop), T(test_entropy_row_against_slow_loop), T(test_kl_topk_approximation),
          T(test_percentile_like_numpy), T(test_logits_file_format))
