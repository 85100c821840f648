/*
 * exp and SiLU for 4 fp32 lanes and exp for 2 double lanes, shared by the NEON MoE kernels
 * (moe_neon_body.h) and the NEON vector kernels (vec_neon.c): lane-wise twins of mq_vec_expf,
 * mq_vec_silu and mq_vec_exp_sum_term (src/kernels/cpu/ref/vec_ref.c), the exps exp_lanes.h's, as
 * exp_avx2.h's on half its width.
 * AArch64 only (Advanced SIMD is part of the base architecture).
 */
#ifndef MOEQ_KERNELS_ARM_EXP_NEON_H
#define MOEQ_KERNELS_ARM_EXP_NEON_H

#include <arm_neon.h>

/* exp_lanes.h's lane operations on q registers: FMAX/FMIN pass a NaN second operand through,
 * FRINTN rounds to nearest even as nearbyintf does, FRINTM is floor, and FMLA/FMLS (a + b c,
 * a - b c, one rounding) are fmaf(b, c, a) and fmaf(-b, c, a). */
#define VF float32x4_t
#define VD float64x2_t
#define F_SET1(c) vdupq_n_f32(c)
#define F_MAX(a, b) vmaxq_f32(a, b)
#define F_MIN(a, b) vminq_f32(a, b)
#define F_MUL(a, b) vmulq_f32(a, b)
#define F_ADD(a, b) vaddq_f32(a, b)
#define F_SUB(a, b) vsubq_f32(a, b)
#define F_FMA(a, b, c) vfmaq_f32(c, a, b)
#define F_FNMA(a, b, c) vfmsq_f32(c, a, b)
#define F_RINT(a) vrndnq_f32(a)
#define F_FLOOR(a) vrndmq_f32(a)
#define F_POW2(n) vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23))
#define D_SET1(c) vdupq_n_f64(c)
#define D_MAX(a, b) vmaxq_f64(a, b)
#define D_MUL(a, b) vmulq_f64(a, b)
#define D_FMA(a, b, c) vfmaq_f64(c, a, b)
#define D_FNMA(a, b, c) vfmsq_f64(c, a, b)
#define D_RINT(a) vrndnq_f64(a)
#define D_POW2(n) vreinterpretq_f64_s64(vshlq_n_s64(vaddq_s64(vcvtq_s64_f64(n), vdupq_n_s64(1023)), 52))
/* mq_exp_neon: 4 lanes of mq_vec_expf; mq_expd_neon: 2 lanes of mq_vec_exp_sum_term */
#define EXP_F mq_exp_neon
#define EXPD_D mq_expd_neon
#include "kernels/cpu/exp_lanes.h"

/* silu(g) = g / (1 + exp(-g)), lane-wise as mq_vec_silu (FDIV is IEEE division). */
static inline __attribute__((always_inline)) float32x4_t mq_silu_neon(float32x4_t g) {
    float32x4_t e = mq_exp_neon(vnegq_f32(g));
    return vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.0f), e));
}

#endif
