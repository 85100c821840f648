/*
 * Per-token scoring math for the evaluator: log-sum-exp of a logits row, KL divergence between
 * two rows (llama.cpp's perplexity --kl-divergence quantity, KL(p_base || p_model) in nats), top-k
 * selection and the KL from saved top-k logits, and numpy's linear-interpolation percentile.
 * Precision: logits are fp32 (as the model produces them); every sum is accumulated in double
 * after subtracting the row maximum, so a log-probability is exact to about 1e-7 absolute. The
 * log-sum-exp and the KL of every scored token run on the vector kernels (src/kernels/vec.h:
 * exponentials and sums in double, in a fixed lane order).
 */
#include <math.h>
#include <stdlib.h>

#include "eval/eval.h"
#include "kernels/vec.h"

/* The vector kernel: the maximum, then exp(l - max) in fp32 (within 1 ulp of expf) summed in
 * double in a fixed lane order (src/kernels/vec.h). */
double mq_logsumexp(const float *l, int64_t V, int32_t *argmax) {
    return mq_vec()->logsumexp(l, V, argmax);
}

double mq_kl_rows(const float *lb, double lse_b, const float *lm, double lse_m, int64_t V) {
    return mq_vec()->kl(lb, lse_b, lm, lse_m, V);
}

double mq_entropy_row(const float *l, double lse, const float *zeros, int64_t V) {
    return log((double)V) - mq_vec()->kl(l, lse, zeros, log((double)V), V);
}

/* a ranks above b: larger value, or equal value and smaller id. */
static inline bool better(float va, uint32_t ia, float vb, uint32_t ib) {
    return va > vb || (va == vb && ia < ib);
}

/* Min-heap on "better": the root is the worst of the kept entries. */
static void sift_down(uint32_t *ids, float *vals, int32_t n, int32_t i) {
    for (;;) {
        int32_t w = i, a = 2 * i + 1, b = a + 1;
        if (a < n && better(vals[w], ids[w], vals[a], ids[a])) w = a;
        if (b < n && better(vals[w], ids[w], vals[b], ids[b])) w = b;
        if (w == i) return;
        uint32_t ti = ids[i];
        float tv = vals[i];
        ids[i] = ids[w], vals[i] = vals[w];
        ids[w] = ti, vals[w] = tv;
        i = w;
    }
}

void mq_topk(const float *l, int64_t V, int32_t k, uint32_t *ids, float *vals) {
    if (k > V) k = (int32_t)V;
    for (int32_t i = 0; i < k; i++) ids[i] = (uint32_t)i, vals[i] = l[i];
    for (int32_t i = k / 2 - 1; i >= 0; i--) sift_down(ids, vals, k, i);
    for (int64_t v = k; v < V; v++)
        if (l[v] > vals[0]) { /* ids only grow, so an equal value never ranks above the root */
            ids[0] = (uint32_t)v, vals[0] = l[v];
            sift_down(ids, vals, k, 0);
        }
    /* Heap sort: move the worst to the end repeatedly -> decreasing order. */
    for (int32_t n = k; n > 1; n--) {
        uint32_t ti = ids[0];
        float tv = vals[0];
        ids[0] = ids[n - 1], vals[0] = vals[n - 1];
        ids[n - 1] = ti, vals[n - 1] = tv;
        sift_down(ids, vals, n - 1, 0);
    }
}

double mq_kl_topk(const uint32_t *ids, const float *vals, int32_t k, double lse_b, const float *lm,
                  double lse_m, int64_t V, uint8_t *mark, double *bound) {
    double kl = 0, p_top = 0, p_k = 1;
    for (int32_t i = 0; i < k; i++) {
        double lpb = (double)vals[i] - lse_b, lpm = (double)lm[ids[i]] - lse_m;
        double p = exp(lpb);
        kl += p * (lpb - lpm);
        p_top += p;
        p_k = p;
        mark[ids[i]] = 1;
    }
    /* The model's rest mass in log space (it may be far below fp32's range), and its smallest
     * probability there for the bound. */
    float mx = -INFINITY, mn = INFINITY;
    for (int64_t v = 0; v < V; v++)
        if (!mark[v]) {
            if (lm[v] > mx) mx = lm[v];
            if (lm[v] < mn) mn = lm[v];
        }
    double s = 0;
    if (mx > -INFINITY)
        for (int64_t v = 0; v < V; v++)
            if (!mark[v]) s += (double)expf(lm[v] - mx);
    for (int32_t i = 0; i < k; i++) mark[ids[i]] = 0;
    double p_rest = 1.0 - p_top, b = 0;
    if (mx > -INFINITY && p_rest > 0) {
        double log_q_rest = (double)mx - lse_m + log(s);
        double log_p_rest = log1p(-p_top);
        kl += p_rest * (log_p_rest - log_q_rest);
        double log_min_cond = (double)mn - lse_m - log_q_rest; /* min over rest of q / q_rest */
        b = p_rest * (log(p_k) - log_p_rest - log_min_cond);
        if (b < 0) b = 0;
    }
    if (bound) *bound = b;
    return kl;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double mq_percentile(double *v, int64_t n, double q) {
    if (n <= 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    double pos = q / 100.0 * (double)(n - 1);
    int64_t lo = (int64_t)floor(pos);
    if (lo >= n - 1) return v[n - 1];
    double frac = pos - (double)lo, d = v[lo + 1] - v[lo];
    /* numpy's _lerp: from the nearer end, so the ends are exact */
    return frac >= 0.5 ? v[lo + 1] - d * (1.0 - frac) : v[lo] + d * frac;
}
