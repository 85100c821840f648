/*
 * vec.h's exps lane-wise, written once for every SIMD twin. The instruction-set header that
 * includes this file (x86/exp_avx2.h, x86/exp_avx512.h, arm/exp_neon.h) first names the two
 * functions (EXP_F, EXPD_D) and their vector types (VF: fp32 lanes, VD: fp64 lanes) and maps the
 * lane operations below onto its intrinsics; this file defines the functions and then forgets
 * every one of those names, so the next width can be included after it. The steps are those of
 * mq_vec_expf and mq_vec_exp_sum_term (src/kernels/cpu/ref/vec_ref.c) with the same constants
 * (exp_coef.h), lane by lane, so every twin's exp is the reference's to the bit.
 *
 * The operations, on VF (F_) and VD (D_): SET1(c); MAX(a, b) and MIN(a, b), where a NaN b passes
 * through; MUL, ADD, SUB; FMA(a, b, c) = a b + c and FNMA(a, b, c) = c - a b, each rounded once;
 * RINT (to nearest, ties to even); F_FLOOR; F_POW2(n) and D_POW2(n) = 2^n for integral lanes n
 * in the normal range, from the exponent bits.
 */
#include "kernels/cpu/exp_coef.h"

/* mq_vec_expf: clamped (NaN passes), n = rint(x log2 e), r = x - n ln2 in two fused steps, the
 * polynomial, and 2^n as two exact power-of-two factors (n1 = floor(n / 2), n - n1), so results
 * in the subnormal range round once, as expf's. */
static inline __attribute__((always_inline)) VF EXP_F(VF x) {
    x = F_MAX(F_SET1(EXP_LO), x);
    x = F_MIN(F_SET1(EXP_HI), x);
    const VF n = F_RINT(F_MUL(x, F_SET1(EXP_LOG2E)));
    VF r = F_FNMA(n, F_SET1(EXP_LN2_HI), x);
    r = F_FNMA(n, F_SET1(EXP_LN2_LO), r);
    VF p = F_SET1(EXP_POLY[0]);
#pragma GCC unroll 8
    for (int k = 1; k < EXP_POLY_N; k++) p = F_FMA(p, r, F_SET1(EXP_POLY[k]));
    const VF y = F_ADD(F_FMA(p, F_MUL(r, r), r), F_SET1(1.0f));
    const VF n1 = F_FLOOR(F_MUL(n, F_SET1(0.5f)));
    return F_MUL(F_MUL(y, F_POW2(n1)), F_POW2(F_SUB(n, n1)));
}

#ifdef EXPD_D
/* mq_vec_exp_sum_term: d clamped at EXPD_LO (NaN passes), the same reduction, the Taylor
 * polynomial, one exact scale by 2^n. */
static inline __attribute__((always_inline)) VD EXPD_D(VD d) {
    d = D_MAX(D_SET1(EXPD_LO), d);
    const VD n = D_RINT(D_MUL(d, D_SET1(EXPD_LOG2E)));
    VD r = D_FNMA(n, D_SET1(EXPD_LN2_HI), d);
    r = D_FNMA(n, D_SET1(EXPD_LN2_LO), r);
    VD p = D_SET1(EXPD_TAYLOR[EXPD_TAYLOR_N - 1]);
    for (int k = EXPD_TAYLOR_N - 2; k >= 0; k--) p = D_FMA(p, r, D_SET1(EXPD_TAYLOR[k]));
    return D_MUL(p, D_POW2(n));
}
#endif

#undef EXP_F
#undef EXPD_D
#undef VF
#undef VD
#undef F_SET1
#undef F_MAX
#undef F_MIN
#undef F_MUL
#undef F_ADD
#undef F_SUB
#undef F_FMA
#undef F_FNMA
#undef F_RINT
#undef F_FLOOR
#undef F_POW2
#undef D_SET1
#undef D_MAX
#undef D_MUL
#undef D_FMA
#undef D_FNMA
#undef D_RINT
#undef D_POW2
