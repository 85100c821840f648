/*
 * The constants of vec.h's two exps, one copy for the scalar reference (src/kernels/cpu/ref/
 * vec_ref.c: mq_vec_expf, mq_vec_exp_sum_term) and every SIMD twin (exp_lanes.h), so the twins
 * cannot drift apart. Free of any instruction set.
 *
 * fp32 (Cephes' expf scheme): x clamped to [EXP_LO, EXP_HI] (below -103.98 expf rounds to +0,
 * above 88.7228 it overflows; both bounds keep n within [-150, 128], so each half of the split
 * scale 2^n is a normal number), n = rint(x log2 e), r = x - n ln2 in two fused steps (LN2_HI
 * exact in few bits), then the degree-7 polynomial y = (p(r) r^2 + r) + 1 with p's coefficients
 * EXP_POLY, highest first.
 * fp64 (the log-sum-exp terms, d <= 0 for a sum whose largest term is 1): d clamped at -708
 * (terms below 1e-307 cannot change such a sum), the same reduction, then the degree-12 Taylor
 * polynomial of exp on |r| <= ln2 / 2 (relative error a few 1e-16), EXPD_TAYLOR[k] = 1 / k!.
 */
#ifndef MOEQ_KERNELS_CPU_EXP_COEF_H
#define MOEQ_KERNELS_CPU_EXP_COEF_H

static const float EXP_LO = -104.0f, EXP_HI = 88.75f;
static const float EXP_LOG2E = 1.44269504088896341f;
static const float EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;
enum { EXP_POLY_N = 6 };
static const float EXP_POLY[EXP_POLY_N] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static const double EXPD_LO = -708.0, EXPD_LOG2E = 1.4426950408889634;
static const double EXPD_LN2_HI = 6.93147180369123816490e-01, EXPD_LN2_LO = 1.90821492927058770002e-10;
enum { EXPD_TAYLOR_N = 13 };
static const double EXPD_TAYLOR[EXPD_TAYLOR_N] = {
    1.0,          1.0,           1.0 / 2,        1.0 / 6,         1.0 / 24,
    1.0 / 120,    1.0 / 720,     1.0 / 5040,     1.0 / 40320,     1.0 / 362880,
    1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600};

#endif
