/*
 * Small fp32 vector kernels for the forward pass and the evaluator: dot products and GEMV (plain
 * and transposed), axpy, RoPE, exp, softmax, log-sum-exp, KL divergence of two logits rows,
 * RMSNorm and SwiGLU.
 *
 * Twins with bit-identical results: a scalar reference (src/kernels/cpu/ref/vec_ref.c) that
 * performs, element by element, the very operations (fmaf included) of the AVX2+FMA kernels
 * (src/kernels/cpu/x86/vec_avx2.c; vec_avx512.c holds both 8-lane accumulators in one zmm) and
 * of the NEON ones (src/kernels/cpu/arm/vec_neon.c, an 8-lane accumulator as two q registers).
 * Reductions use a fixed lane layout: element i of a dot product goes to lane i % 8 of accumulator (i / 8) % 2 (a last partial block counts as zero-padded); the
 * two accumulators are added lane-wise and the 8 lanes reduced as (l + l+4), then (l + l+2), then
 * (l + l+1). Results therefore depend only on the inputs, never on the thread count or the ISA.
 *
 * exp: exp(x) = 2^n * p(r) with n = round(x * log2 e), r = x - n ln2 (two fma steps) and
 * Cephes' degree-7 polynomial for p; 2^n is applied as two exact power-of-two factors so that
 * results in the subnormal range round once, like expf. Inputs are clamped to [-104, 88.75]:
 * -inf and anything below -103.97 give +0, anything above 88.7228 gives +inf, NaN stays NaN. The
 * error against libm's expf is at most 2 ulp for normal results (tests/test_vec_kernels.c).
 */
#ifndef MOEQ_KERNELS_VEC_H
#define MOEQ_KERNELS_VEC_H

#include "core/core.h"

typedef struct {
    /* sum a[i] * b[i] in the lane layout above */
    float (*dot)(const float *a, const float *b, int64_t n);
    /* y[r] = alpha * dot(W + r * ldw, x, n) for r < rows (each row exactly as dot) */
    void (*gemv)(const float *W, int64_t ldw, int64_t rows, const float *x, int64_t n, float alpha,
                 float *y);
    /* y[j] = sum over i < rows of a[i] * V[i * ldv + j], j < n: y starts at +0 and takes one
     * fmaf per row in row order (exactly axpy row after row) */
    void (*gemv_t)(const float *V, int64_t ldv, int64_t rows, const float *a, int64_t n, float *y);
    /* y[i] = fmaf(a, x[i], y[i]) */
    void (*axpy)(float a, const float *x, float *y, int64_t n);
    /* rotate_half RoPE of one head in place: for i < half, with a = x[i], b = x[i + half]:
     * x[i] = a * c[i] - b * s[i], x[i + half] = b * c[i] + a * s[i] (products rounded, no fma) */
    void (*rope)(float *x, int64_t half, const float *c, const float *s);
    /* y[i] = exp(x[i]) (y may alias x) */
    void (*exp)(const float *x, float *y, int64_t n);
    /* In place: x[i] = exp(x[i] - max) / sum, the sum of the exponentials in the lane layout
     * (fp32), max as maxps folds it (NaNs other than x[0] ignored). n >= 1. */
    void (*softmax)(float *x, int64_t n);
    /* max + log(sum exp(x[i] - max)): the differences and their exponentials in double
     * (mq_vec_exp_sum_term, relative error below 1e-15), summed in double lanes of 4 (the low
     * and high half of each 8-block to two accumulators, added lane-wise, then (l + l+2),
     * (l + l+1)). The maximum ignores NaNs except x[0] (like a scalar `if (x > m)` loop); a
     * non-finite maximum is returned as it is. *argmax (may be NULL): the first index holding the
     * maximum (0 when none does). n >= 1. */
    double (*logsumexp)(const float *x, int64_t n, int32_t *argmax);
    /* KL(p_b || p_m) of two logits rows given their log-sum-exps: the sum over i of
     * exp(a) * (a - b), a = (double)lb[i] - lse_b, b = (double)lm[i] - lse_m, exp as
     * mq_vec_exp_sum_term, the product rounded and summed in logsumexp's double lanes. Exactly 0
     * for identical rows. */
    double (*kl)(const float *lb, double lse_b, const float *lm, double lse_m, int64_t n);
    /* out[i] = w[i] * (x[i] * inv), inv = 1 / sqrtf((float)(ss / n) + eps), ss = sum of x^2 in
     * double (the logsumexp lane layout). out may alias x. */
    void (*rmsnorm)(const float *x, int64_t n, const float *w, float eps, float *out);
    /* g[i] = (g[i] / (1 + exp(-g[i]))) * u[i] */
    void (*swiglu)(float *g, const float *u, int64_t n);
} mq_vec_kernels;

extern const mq_vec_kernels mq_vec_ref;
#if defined(__x86_64__) || defined(__i386__)
extern const mq_vec_kernels mq_vec_avx2;
/* src/kernels/cpu/x86/vec_avx512.c, when mq_cpu_has_avx512() */
extern const mq_vec_kernels mq_vec_avx512;
#endif
#if defined(__aarch64__)
extern const mq_vec_kernels mq_vec_neon;   /* src/kernels/cpu/arm/vec_neon.c, every AArch64 CPU */
#endif
/* The kernels to use now (src/kernels/kernels.c: the row of mq_cpu_isa()): AVX-512 or AVX2, the
 * best the CPU has (NEON on Arm64), when mq_force_ref() is off. */
const mq_vec_kernels *mq_vec(void);

/* The scalar exp of both twins (one lane of the AVX2 kernel). */
float mq_vec_expf(float x);
/* silu(g) = g / (1 + mq_vec_expf(-g)): the SwiGLU of the dense MLP and of the MoE kernels. */
float mq_vec_silu(float g);
/* exp(d) for d <= 0 as logsumexp's terms (one double lane): d below -708 counts as -708, NaN
 * stays NaN; relative error below 1e-15 up to d = 709. */
double mq_vec_exp_sum_term(double d);

#endif
