/*
 * Scalar reference twins of the vector kernels (src/kernels/vec.h): each function performs the
 * operations of the AVX2+FMA kernels (src/kernels/cpu/x86/vec_avx2.c) lane by lane, in the same
 * order and with fmaf where they fuse, so both give bit-identical results. Also the dispatcher.
 *
 * exp follows the classic Cephes expf scheme (round to n = x log2 e, reduce by n ln2 in two
 * parts, degree-7 polynomial, scale by 2^n); the clamping and the split scale are ours. The
 * constants are exp_coef.h's, the SIMD twins' too (exp_lanes.h).
 */
#include <math.h>
#include <string.h>

#include "kernels/cpu/exp_coef.h"
#include "kernels/cpu/vec_edges.h"
#include "kernels/vec.h"

/* Lane layout of the reductions (see vec.h). */
enum { LANES = 8 };

static float pow2i(float k) {   /* 2^k for an integral k in [-126, 127] */
    uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

float mq_vec_expf(float x) {
    if (x != x) return x + x;   /* NaN: the AVX2 lanes propagate it through the polynomial */
    x = EXP_LO > x ? EXP_LO : x;   /* maxps(lo, x) */
    x = EXP_HI < x ? EXP_HI : x;   /* minps(hi, x) */
    float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(-n, EXP_LN2_HI, x);
    r = fmaf(-n, EXP_LN2_LO, r);
    float p = EXP_POLY[0];
    for (int k = 1; k < EXP_POLY_N; k++) p = fmaf(p, r, EXP_POLY[k]);
    float y = fmaf(p, r * r, r) + 1.0f;
    float n1 = floorf(n * 0.5f), n2 = n - n1;
    return (y * pow2i(n1)) * pow2i(n2);
}

/* (a0 + a1) lane-wise, then (l + l+4), (l + l+2), (l + l+1). */
static float reduce_add8(const float a0[LANES], const float a1[LANES]) {
    float v[LANES];
    for (int l = 0; l < LANES; l++) v[l] = a0[l] + a1[l];
    for (int l = 0; l < 4; l++) v[l] = v[l] + v[l + 4];
    for (int l = 0; l < 2; l++) v[l] = v[l] + v[l + 2];
    return v[0] + v[1];
}

/* Double lanes: element j of an 8-block goes to accumulator j / 4, lane j % 4. */
static double reduce_add4d(const double d[2][4]) {
    double v[4];
    for (int l = 0; l < 4; l++) v[l] = d[0][l] + d[1][l];
    for (int l = 0; l < 2; l++) v[l] = v[l] + v[l + 2];
    return v[0] + v[1];
}

static float dot_ref(const float *a, const float *b, int64_t n) {
    float acc[2][LANES] = {{0}};
    for (int64_t i = 0; i < n; i++) {
        float *c = &acc[(i / LANES) & 1][i % LANES];
        *c = fmaf(a[i], b[i], *c);
    }
    /* zero padding of a last partial block: fmaf(0, 0, c) turns -0 into +0 */
    for (int64_t i = n; i % LANES; i++) {
        float *c = &acc[(i / LANES) & 1][i % LANES];
        *c = fmaf(0.0f, 0.0f, *c);
    }
    return reduce_add8(acc[0], acc[1]);
}

static void gemv_ref(const float *W, int64_t ldw, int64_t rows, const float *x, int64_t n,
                     float alpha, float *y) {
    for (int64_t r = 0; r < rows; r++) y[r] = alpha * dot_ref(W + r * ldw, x, n);
}

static void axpy_ref(float a, const float *x, float *y, int64_t n) {
    vec_axpy_from(0, a, x, y, n);
}

static void gemv_t_ref(const float *V, int64_t ldv, int64_t rows, const float *a, int64_t n,
                       float *y) {
    for (int64_t j = 0; j < n; j++) y[j] = 0.0f;
    for (int64_t i = 0; i < rows; i++) axpy_ref(a[i], V + i * ldv, y, n);
}

static void rope_ref(float *x, int64_t half, const float *c, const float *s) {
    vec_rope_from(0, x, half, c, s);
}

static void exp_ref(const float *x, float *y, int64_t n) {
    vec_exp_from(0, x, y, n);
}

/* The maximum as two maxps accumulators (block parity) seeded with x[0] fold it, then the
 * lane tree. maxps(v, m) = v > m ? v : m, so a NaN v is skipped. */
static float max_ref(const float *x, int64_t n) {
    float m[2][LANES];
    for (int l = 0; l < LANES; l++) m[0][l] = m[1][l] = x[0];
    for (int64_t i = 0; i < n; i++) {
        float *c = &m[(i / LANES) & 1][i % LANES];
        *c = x[i] > *c ? x[i] : *c;
    }
    float v[LANES];
    for (int l = 0; l < LANES; l++) v[l] = m[1][l] > m[0][l] ? m[1][l] : m[0][l];
    for (int l = 0; l < 4; l++) v[l] = v[l + 4] > v[l] ? v[l + 4] : v[l];
    for (int l = 0; l < 2; l++) v[l] = v[l + 2] > v[l] ? v[l + 2] : v[l];
    return v[1] > v[0] ? v[1] : v[0];
}

static void softmax_ref(float *x, int64_t n) {
    float mx = max_ref(x, n);
    float acc[2][LANES] = {{0}};
    for (int64_t i = 0; i < n; i++) {
        x[i] = mq_vec_expf(x[i] - mx);
        float *c = &acc[(i / LANES) & 1][i % LANES];
        *c = *c + x[i];
    }
    float sum = reduce_add8(acc[0], acc[1]);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] / sum;
}

/* exp of a double d <= 0 for a sum whose largest term is 1 (exp_coef.h). NaN stays NaN. */
double mq_vec_exp_sum_term(double d) {
    if (d != d) return d + d;
    d = EXPD_LO > d ? EXPD_LO : d;   /* maxpd(lo, d) */
    double n = nearbyint(d * EXPD_LOG2E);
    double r = fma(-n, EXPD_LN2_HI, d);
    r = fma(-n, EXPD_LN2_LO, r);
    double p = EXPD_TAYLOR[EXPD_TAYLOR_N - 1];
    for (int k = EXPD_TAYLOR_N - 2; k >= 0; k--) p = fma(p, r, EXPD_TAYLOR[k]);
    uint64_t bits = (uint64_t)((int64_t)n + 1023) << 52;
    double scale;
    memcpy(&scale, &bits, 8);
    return p * scale;
}

static double logsumexp_ref(const float *x, int64_t n, int32_t *argmax) {
    float mx = max_ref(x, n);
    if (argmax) *argmax = (int32_t)vec_first_equal_from(0, x, n, mx);
    if (!isfinite(mx)) return (double)mx;
    double d[2][4] = {{0}};
    for (int64_t i = 0; i < n; i++) {
        int j = (int)(i % LANES);
        d[j / 4][j % 4] += mq_vec_exp_sum_term((double)x[i] - (double)mx);
    }
    return (double)mx + log(reduce_add4d(d));
}

static double kl_ref(const float *lb, double lse_b, const float *lm, double lse_m, int64_t n) {
    double d[2][4] = {{0}};
    for (int64_t i = 0; i < n; i++) {
        int j = (int)(i % LANES);
        double a = (double)lb[i] - lse_b, b = (double)lm[i] - lse_m;
        d[j / 4][j % 4] += mq_vec_exp_sum_term(a) * (a - b);
    }
    for (int64_t i = n; i % LANES; i++) {   /* the masked lanes of a last partial block add +0 */
        int j = (int)(i % LANES);
        d[j / 4][j % 4] += 0.0;
    }
    return reduce_add4d(d);
}

static void rmsnorm_ref(const float *x, int64_t n, const float *w, float eps, float *out) {
    double d[2][4] = {{0}};
    for (int64_t i = 0; i < n; i++) {
        int j = (int)(i % LANES);
        d[j / 4][j % 4] += (double)x[i] * (double)x[i];   /* exact product: as fma_pd */
    }
    float var = (float)(reduce_add4d(d) / (double)n);
    float inv = 1.0f / sqrtf(var + eps);
    vec_norm_scale_from(0, x, w, inv, out, n);
}

float mq_vec_silu(float g) { return g / (1.0f + mq_vec_expf(-g)); }

static void swiglu_ref(float *g, const float *u, int64_t n) {
    vec_swiglu_from(0, g, u, n);
}

const mq_vec_kernels mq_vec_ref = MQ_VEC_KERNELS_OF(ref);
