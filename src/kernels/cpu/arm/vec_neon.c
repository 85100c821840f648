/*
 * NEON vector kernels (src/kernels/vec.h), twins of src/kernels/cpu/ref/vec_ref.c with
 * bit-identical results, as the AVX2 ones: every reduction keeps vec.h's lane layout (an 8-lane
 * fp32 accumulator is two q registers, lanes 0-3 and 4-7; logsumexp's 4 double lanes are two),
 * the exp is exp_neon.h's lane-wise twin of mq_vec_expf, and the operations come in the same
 * order (FMLA where the reference calls fmaf, separate FMUL/FADD elsewhere; this file is built
 * with -ffp-contract=off). The vector loops cover whole blocks of 8 (16 for the dot products);
 * a last partial block finishes in the reference's own scalar steps on the stored lanes, which
 * is the same arithmetic. Advanced SIMD is base AArch64: these run on every Arm64 CPU.
 */
#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/arm/exp_neon.h"
#include "kernels/cpu/vec_edges.h"
#include "kernels/vec.h"

#define INLINE static inline __attribute__((always_inline))

/* One 8-lane fp32 accumulator of vec.h's layout. */
typedef struct {
    float32x4_t lo, hi;
} f8;

INLINE f8 f8_zero(void) { return (f8){vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }
INLINE f8 f8_load(const float *p) { return (f8){vld1q_f32(p), vld1q_f32(p + 4)}; }
INLINE void f8_store(float *p, f8 v) {
    vst1q_f32(p, v.lo);
    vst1q_f32(p + 4, v.hi);
}
INLINE f8 f8_fma(f8 acc, f8 a, f8 b) {
    return (f8){vfmaq_f32(acc.lo, a.lo, b.lo), vfmaq_f32(acc.hi, a.hi, b.hi)};
}

/* vec_ref's reduce_add8: (a0 + a1) lane-wise, then (l + l+4), (l + l+2), (l + l+1). */
static float reduce_add8(const float a0[8], const float a1[8]) {
    float32x4_t lo = vaddq_f32(vld1q_f32(a0), vld1q_f32(a1));
    float32x4_t hi = vaddq_f32(vld1q_f32(a0 + 4), vld1q_f32(a1 + 4));
    float32x4_t v = vaddq_f32(lo, hi);
    float32x2_t w = vadd_f32(vget_low_f32(v), vget_high_f32(v));
    return vget_lane_f32(w, 0) + vget_lane_f32(w, 1);
}

/* vec_ref's reduce_add4d over d[2][4]. */
static double reduce_add4d(const double d[2][4]) {
    float64x2_t a = vaddq_f64(vld1q_f64(d[0]), vld1q_f64(d[1]));
    float64x2_t b = vaddq_f64(vld1q_f64(d[0] + 2), vld1q_f64(d[1] + 2));
    float64x2_t v = vaddq_f64(a, b);
    return vgetq_lane_f64(v, 0) + vgetq_lane_f64(v, 1);
}

/* The reference's scalar steps for elements [i, n) of a dot product, then its zero padding. */
static float dot_finish(const float *a, const float *b, int64_t i, int64_t n, float acc[2][8]) {
    for (; i < n; i++) {
        float *c = &acc[(i / 8) & 1][i % 8];
        *c = fmaf(a[i], b[i], *c);
    }
    for (; i % 8; i++) {
        float *c = &acc[(i / 8) & 1][i % 8];
        *c = fmaf(0.0f, 0.0f, *c);
    }
    return reduce_add8(acc[0], acc[1]);
}

static float dot_neon(const float *a, const float *b, int64_t n) {
    f8 a0 = f8_zero(), a1 = f8_zero();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = f8_fma(a0, f8_load(a + i), f8_load(b + i));
        a1 = f8_fma(a1, f8_load(a + i + 8), f8_load(b + i + 8));
    }
    float acc[2][8];
    f8_store(acc[0], a0);
    f8_store(acc[1], a1);
    return dot_finish(a, b, i, n, acc);
}

/* Four rows of W against x at once (x loaded once per block); each row exactly as dot_neon. */
static void dot4(const float *W, int64_t ldw, const float *x, int64_t n, float alpha, float *y) {
    f8 acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = f8_zero();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        f8 xa = f8_load(x + i), xb = f8_load(x + i + 8);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const float *w = W + r * ldw + i;
            __builtin_prefetch(w + 4 * ldw, 0, 3);   /* GEMV streams W once */
            acc[r][0] = f8_fma(acc[r][0], f8_load(w), xa);
            acc[r][1] = f8_fma(acc[r][1], f8_load(w + 8), xb);
        }
    }
    for (int r = 0; r < 4; r++) {
        float st[2][8];
        f8_store(st[0], acc[r][0]);
        f8_store(st[1], acc[r][1]);
        y[r] = alpha * dot_finish(W + r * ldw, x, i, n, st);
    }
}

MQ_VEC_GEMV(neon, 4, dot4)

static void axpy_neon(float a, const float *x, float *y, int64_t n) {
    const float32x4_t va = vdupq_n_f32(a);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vfmaq_f32(vld1q_f32(y + i), va, vld1q_f32(x + i)));
    vec_axpy_from(i, a, x, y, n);
}

/* Columns in blocks of 32 held in eight accumulators over all rows, then blocks of 4, then
 * single columns; every column takes its fmas in row order (as axpy row after row). */
static void gemv_t_neon(const float *V, int64_t ldv, int64_t rows, const float *a, int64_t n,
                        float *y) {
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        float32x4_t c[8];
        for (int k = 0; k < 8; k++) c[k] = vdupq_n_f32(0.0f);
        for (int64_t i = 0; i < rows; i++) {
            const float *v = V + i * ldv + j;
            const float32x4_t ai = vdupq_n_f32(a[i]);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) c[k] = vfmaq_f32(c[k], ai, vld1q_f32(v + 4 * k));
        }
        for (int k = 0; k < 8; k++) vst1q_f32(y + j + 4 * k, c[k]);
    }
    for (; j + 4 <= n; j += 4) {
        float32x4_t c = vdupq_n_f32(0.0f);
        for (int64_t i = 0; i < rows; i++) c = vfmaq_f32(c, vdupq_n_f32(a[i]), vld1q_f32(V + i * ldv + j));
        vst1q_f32(y + j, c);
    }
    for (; j < n; j++) {
        float c = 0.0f;
        for (int64_t i = 0; i < rows; i++) c = fmaf(a[i], V[i * ldv + j], c);
        y[j] = c;
    }
}

static void rope_neon(float *x, int64_t half, const float *c, const float *s) {
    int64_t i = 0;
    for (; i + 4 <= half; i += 4) {
        float32x4_t a = vld1q_f32(x + i), b = vld1q_f32(x + half + i);
        float32x4_t vc = vld1q_f32(c + i), vs = vld1q_f32(s + i);
        vst1q_f32(x + i, vsubq_f32(vmulq_f32(a, vc), vmulq_f32(b, vs)));
        vst1q_f32(x + half + i, vaddq_f32(vmulq_f32(b, vc), vmulq_f32(a, vs)));
    }
    vec_rope_from(i, x, half, c, s);
}

static void exp_neon(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, mq_exp_neon(vld1q_f32(x + i)));
    vec_exp_from(i, x, y, n);
}

/* maxps(v, m) = v > m ? v : m (a NaN v is skipped, a NaN m kept), lane-wise. */
INLINE float32x4_t maxps(float32x4_t v, float32x4_t m) { return vbslq_f32(vcgtq_f32(v, m), v, m); }
static inline float maxs(float v, float m) { return v > m ? v : m; }

/* vec_ref's max_ref: two 8-lane accumulators by block parity seeded with x[0], then its tree. */
static float max_neon(const float *x, int64_t n) {
    const float32x4_t x0 = vdupq_n_f32(x[0]);
    f8 m0 = {x0, x0}, m1 = {x0, x0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        m0 = (f8){maxps(vld1q_f32(x + i), m0.lo), maxps(vld1q_f32(x + i + 4), m0.hi)};
        m1 = (f8){maxps(vld1q_f32(x + i + 8), m1.lo), maxps(vld1q_f32(x + i + 12), m1.hi)};
    }
    float m[2][8];
    f8_store(m[0], m0);
    f8_store(m[1], m1);
    for (; i < n; i++) {
        float *c = &m[(i / 8) & 1][i % 8];
        *c = maxs(x[i], *c);
    }
    float v[8];
    for (int l = 0; l < 8; l++) v[l] = maxs(m[1][l], m[0][l]);
    for (int l = 0; l < 4; l++) v[l] = maxs(v[l + 4], v[l]);
    for (int l = 0; l < 2; l++) v[l] = maxs(v[l + 2], v[l]);
    return maxs(v[1], v[0]);
}

static void softmax_neon(float *x, int64_t n) {
    const float mx = max_neon(x, n);
    const float32x4_t vmx = vdupq_n_f32(mx);
    f8 acc[2] = {f8_zero(), f8_zero()};
    int64_t i = 0;
    for (int k = 0; i + 8 <= n; i += 8, k ^= 1) {
        float32x4_t lo = mq_exp_neon(vsubq_f32(vld1q_f32(x + i), vmx));
        float32x4_t hi = mq_exp_neon(vsubq_f32(vld1q_f32(x + i + 4), vmx));
        vst1q_f32(x + i, lo);
        vst1q_f32(x + i + 4, hi);
        acc[k].lo = vaddq_f32(acc[k].lo, lo);
        acc[k].hi = vaddq_f32(acc[k].hi, hi);
    }
    float a[2][8];
    f8_store(a[0], acc[0]);
    f8_store(a[1], acc[1]);
    for (; i < n; i++) {
        x[i] = mq_vec_expf(x[i] - mx);
        float *c = &a[(i / 8) & 1][i % 8];
        *c = *c + x[i];
    }
    const float sum = reduce_add8(a[0], a[1]);
    const float32x4_t vs = vdupq_n_f32(sum);
    for (i = 0; i + 4 <= n; i += 4) vst1q_f32(x + i, vdivq_f32(vld1q_f32(x + i), vs));
    for (; i < n; i++) x[i] = x[i] / sum;
}

/* The 8 floats at p widened to doubles minus mx, as 4 pairs: lanes 0-1, 2-3, 4-5, 6-7. */
INLINE void widen8(const float *p, float64x2_t mx, float64x2_t o[4]) {
    float32x4_t lo = vld1q_f32(p), hi = vld1q_f32(p + 4);
    o[0] = vsubq_f64(vcvt_f64_f32(vget_low_f32(lo)), mx);
    o[1] = vsubq_f64(vcvt_high_f64_f32(lo), mx);
    o[2] = vsubq_f64(vcvt_f64_f32(vget_low_f32(hi)), mx);
    o[3] = vsubq_f64(vcvt_high_f64_f32(hi), mx);
}

/* logsumexp's double lanes d[2][4] (element j of an 8-block to d[j / 4][j % 4]) as q registers:
 * dq[0] = d[0][0..1], dq[1] = d[0][2..3], dq[2] = d[1][0..1], dq[3] = d[1][2..3]. */
INLINE void store_d(const float64x2_t dq[4], double d[2][4]) {
    vst1q_f64(d[0], dq[0]);
    vst1q_f64(d[0] + 2, dq[1]);
    vst1q_f64(d[1], dq[2]);
    vst1q_f64(d[1] + 2, dq[3]);
}

static double logsumexp_neon(const float *x, int64_t n, int32_t *argmax) {
    const float mxf = max_neon(x, n);
    if (argmax) {
        int64_t am = 0, i = 0;
        const float32x4_t vm = vdupq_n_f32(mxf);
        for (; i + 4 <= n; i += 4)
            if (vmaxvq_u32(vceqq_f32(vld1q_f32(x + i), vm))) break;
        am = vec_first_equal_from(i, x, n, mxf);
        *argmax = (int32_t)am;
    }
    if (!isfinite(mxf)) return (double)mxf;
    const float64x2_t mx = vdupq_n_f64((double)mxf);
    float64x2_t dq[4];
    for (int k = 0; k < 4; k++) dq[k] = vdupq_n_f64(0.0);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        float64x2_t v[4];
        widen8(x + i, mx, v);
        for (int k = 0; k < 4; k++) dq[k] = vaddq_f64(dq[k], mq_expd_neon(v[k]));
    }
    double d[2][4];
    store_d(dq, d);
    for (; i < n; i++) {
        int j = (int)(i % 8);
        d[j / 4][j % 4] += mq_vec_exp_sum_term((double)x[i] - (double)mxf);
    }
    return (double)mxf + log(reduce_add4d(d));
}

static double kl_neon(const float *lb, double lse_b, const float *lm, double lse_m, int64_t n) {
    const float64x2_t zb = vdupq_n_f64(lse_b), zm = vdupq_n_f64(lse_m);
    float64x2_t dq[4];
    for (int k = 0; k < 4; k++) dq[k] = vdupq_n_f64(0.0);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        float64x2_t a[4], b[4];
        widen8(lb + i, zb, a);
        widen8(lm + i, zm, b);
        for (int k = 0; k < 4; k++)
            dq[k] = vaddq_f64(dq[k], vmulq_f64(mq_expd_neon(a[k]), vsubq_f64(a[k], b[k])));
    }
    double d[2][4];
    store_d(dq, d);
    for (; i < n; i++) {
        int j = (int)(i % 8);
        double a = (double)lb[i] - lse_b, b = (double)lm[i] - lse_m;
        d[j / 4][j % 4] += mq_vec_exp_sum_term(a) * (a - b);
    }
    for (; i % 8; i++) {   /* the reference's padding: +0 */
        int j = (int)(i % 8);
        d[j / 4][j % 4] += 0.0;
    }
    return reduce_add4d(d);
}

static void rmsnorm_neon(const float *x, int64_t n, const float *w, float eps, float *out) {
    float64x2_t dq[4];
    for (int k = 0; k < 4; k++) dq[k] = vdupq_n_f64(0.0);
    int64_t i = 0;
    const float64x2_t zero = vdupq_n_f64(0.0);
    for (; i + 8 <= n; i += 8) {
        float64x2_t v[4];
        widen8(x + i, zero, v);   /* x - 0 = x exactly */
        for (int k = 0; k < 4; k++) dq[k] = vfmaq_f64(dq[k], v[k], v[k]);   /* exact product */
    }
    double d[2][4];
    store_d(dq, d);
    for (; i < n; i++) {
        int j = (int)(i % 8);
        d[j / 4][j % 4] += (double)x[i] * (double)x[i];
    }
    const float var = (float)(reduce_add4d(d) / (double)n);
    const float invf = 1.0f / sqrtf(var + eps);
    const float32x4_t inv = vdupq_n_f32(invf);
    for (i = 0; i + 4 <= n; i += 4)
        vst1q_f32(out + i, vmulq_f32(vld1q_f32(w + i), vmulq_f32(vld1q_f32(x + i), inv)));
    vec_norm_scale_from(i, x, w, invf, out, n);
}

static void swiglu_neon(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        vst1q_f32(g + i, vmulq_f32(mq_silu_neon(vld1q_f32(g + i)), vld1q_f32(u + i)));
    vec_swiglu_from(i, g, u, n);
}

const mq_vec_kernels mq_vec_neon = MQ_VEC_KERNELS_OF(neon);
