/*
 * exp and SiLU for 4 fp32 lanes, shared by the NEON MoE kernels (moe_neon_body.h) and the NEON
 * vector kernels (vec_neon.c): lane-wise twins of mq_vec_expf and mq_vec_silu
 * (src/kernels/cpu/ref/vec_ref.c), the same operations as exp_avx2.h on half its width.
 * AArch64 only (Advanced SIMD is part of the base architecture).
 */
#ifndef MOEQ_KERNELS_ARM_EXP_NEON_H
#define MOEQ_KERNELS_ARM_EXP_NEON_H

#include <arm_neon.h>

/* 4 lanes of mq_vec_expf. FMAX/FMIN pass a NaN through, FRINTN rounds to nearest even as
 * nearbyintf does, and FMLS (a - b * c, one rounding) is fmaf(-b, c, a). */
static inline __attribute__((always_inline)) float32x4_t mq_exp4_neon(float32x4_t x) {
    x = vmaxq_f32(vdupq_n_f32(-104.0f), x);
    x = vminq_f32(vdupq_n_f32(88.75f), x);
    float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    float32x4_t y = vaddq_f32(vfmaq_f32(r, p, vmulq_f32(r, r)), vdupq_n_f32(1.0f));
    /* 2^n as two exact power-of-two factors (n1 = floor(n / 2), n2 = n - n1) */
    float32x4_t n1 = vrndmq_f32(vmulq_f32(n, vdupq_n_f32(0.5f)));
    float32x4_t n2 = vsubq_f32(n, n1);
    const int32x4_t bias = vdupq_n_s32(127);
    int32x4_t e1 = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n1), bias), 23);
    int32x4_t e2 = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n2), bias), 23);
    return vmulq_f32(vmulq_f32(y, vreinterpretq_f32_s32(e1)), vreinterpretq_f32_s32(e2));
}

/* silu(g) = g / (1 + exp(-g)), lane-wise as mq_vec_silu (FDIV is IEEE division). */
static inline __attribute__((always_inline)) float32x4_t mq_silu4_neon(float32x4_t g) {
    float32x4_t e = mq_exp4_neon(vnegq_f32(g));
    return vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.0f), e));
}

#endif
