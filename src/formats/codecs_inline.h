/*
 * The scalar number codecs as `static inline` functions that C and nvcc both compile: the CPU's
 * codecs (src/formats/codecs.c, quant.c) and the GPU's device twins (src/backend/cuda/
 * quant_dev.cuh) are these very lines, so their codes agree by construction. Plain C11 (no
 * headers beyond <stdint.h>, <string.h> and <math.h>): under nvcc every function is
 * __host__ __device__, and the bit casts use the device's intrinsics in device code.
 *
 * E2M1 follows compressed-tensors cast_to_fp4 / torchao _f32_to_floatx_unpacked (decision
 * thresholds on |x|, ties to even, sign kept); E4M3 the bit algorithm of c10's
 * fp8e4m3fn_from_fp32_value with a saturating clamp in front (formats.md section 2.0).
 */
#ifndef MOEQ_FORMATS_CODECS_INLINE_H
#define MOEQ_FORMATS_CODECS_INLINE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define MQ_CODEC static __host__ __device__ __forceinline__
#else
#define MQ_CODEC static inline
#endif

#ifdef __CUDA_ARCH__
MQ_CODEC uint32_t mq_codec_f32_bits(float f) { return __float_as_uint(f); }
MQ_CODEC float mq_codec_f32_from_bits(uint32_t u) { return __uint_as_float(u); }
#else
MQ_CODEC uint32_t mq_codec_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
MQ_CODEC float mq_codec_f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif

/* E2M1 magnitude of a 3-bit index: {0, 0.5, 1, 1.5, 2, 3, 4, 6}. */
MQ_CODEC float mq_e2m1_value(int idx) {
    switch (idx & 7) {
    case 0: return 0.0f;
    case 1: return 0.5f;
    case 2: return 1.0f;
    case 3: return 1.5f;
    case 4: return 2.0f;
    case 5: return 3.0f;
    case 6: return 4.0f;
    default: return 6.0f;
    }
}

/* E2M1 code = sign<<3 | idx. Round to nearest, ties to even; |x| > 6 saturates to 6; negative
 * values that round to zero keep the sign (0x8). The midpoints 0.25, 1.25, 2.5, 5 tie to the even
 * code below, 0.75, 1.75, 3.5 to the even code above; NaN fails every comparison and lands on 6. */
MQ_CODEC uint8_t mq_e2m1_encode_inl(float x) {
    const uint8_t sign = (uint8_t)((mq_codec_f32_bits(x) >> 28) & 0x8);
    const float a = fabsf(x);
    uint8_t idx;
    if (a <= 0.25f) idx = 0;
    else if (a < 0.75f) idx = 1;
    else if (a <= 1.25f) idx = 2;
    else if (a < 1.75f) idx = 3;
    else if (a <= 2.5f) idx = 4;
    else if (a < 3.5f) idx = 5;
    else if (a <= 5.0f) idx = 6;
    else idx = 7;
    return (uint8_t)(sign | idx);
}

MQ_CODEC float mq_e2m1_decode_inl(uint8_t code) {
    const float v = mq_e2m1_value(code & 7);
    return (code & 8) ? -v : v;
}

/* E4M3 (float8_e4m3fn): round to nearest even, saturating at +-448 (also for +-Inf), subnormals
 * down to 2^-9, NaN -> 0x7F. Every case computed and the answer selected (no branches: the
 * scale searches encode several scales per group of every row). */
MQ_CODEC uint8_t mq_e4m3_encode(float x) {
    const uint32_t bits = mq_codec_f32_bits(x);
    const uint32_t sign = (bits >> 24) & 0x80u, a = bits & 0x7fffffffu;
    /* below 2^-6 a subnormal k 2^-9: adding 2^14 leaves exactly the bits of k in the low
     * mantissa, rounded to nearest even by the FPU */
    const float sum = mq_codec_f32_from_bits(a) + 0x1p14f;
    const uint32_t sub = mq_codec_f32_bits(sum) - (141u << 23);
    /* normal: rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits, ties to
     * even (add 0x7FFFF plus the lowest kept bit, then drop 20 bits) */
    const uint32_t norm = (a + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
    uint32_t r = a < (121u << 23) ? sub : norm;
    r = a >= 0x43E00000u ? 0x7Eu : r;   /* 448 and beyond, infinities too */
    return (uint8_t)(a > 0x7F800000u ? 0x7Fu : (sign | r));   /* NaN of either sign: 0x7F */
}

/* The value of a non-negative E4M3 code, built from its bits without libm: (1 + m/8) 2^(e-7), or
 * m 2^-9 for e = 0 (both exact in fp32); 0x7F is NaN. */
MQ_CODEC float mq_e4m3_value(uint8_t code) {
    const uint32_t e = (uint32_t)(code >> 3) & 0xFu, m = code & 7u;
    if ((code & 0x7F) == 0x7F) return mq_codec_f32_from_bits(0x7fc00000u);
    if (e == 0) return (float)m * 0x1p-9f;
    return mq_codec_f32_from_bits((e + 120u) << 23 | m << 20);
}

MQ_CODEC float mq_e4m3_decode_inl(uint8_t bits) {
    if ((bits & 0x7F) == 0x7F) return mq_codec_f32_from_bits(0x7fc00000u);   /* either sign */
    const float v = mq_e4m3_value((uint8_t)(bits & 0x7F));
    return (bits & 0x80) ? -v : v;
}

/* E8M0 (2^(e-127), 0xFF = NaN): the smallest power of two >= x, clamped to [2^-127, 2^127]. */
MQ_CODEC uint8_t mq_e8m0_encode_ceil_inl(float x) {
    if (isnan(x)) return 0xFF;
    if (!(x > 0x1p-127f)) return 0;
    if (x >= 0x1p127f) return 254;
    int e;
    const float m = frexpf(x, &e);   /* x = m * 2^e, m in [0.5, 1) */
    const int k = (m == 0.5f) ? e - 1 : e;   /* an exact power of two stays, else round up */
    return (uint8_t)(k + 127);
}

MQ_CODEC float mq_e8m0_decode_inl(uint8_t bits) {
    if (bits == 0xFF) return mq_codec_f32_from_bits(0x7fc00000u);
    return ldexpf(1.0f, (int)bits - 127);
}

/* INT4/E2M1 codes two to a byte, the first in the low nibble (every checkpoint layout's packing,
 * formats.md sections 2.1-2.4). */
MQ_CODEC uint8_t mq_u4_pair(uint8_t first, uint8_t second) {
    return (uint8_t)((first & 0xF) | (second & 0xF) << 4);
}
MQ_CODEC uint8_t mq_u4_first(uint8_t b) { return (uint8_t)(b & 0xF); }
MQ_CODEC uint8_t mq_u4_second(uint8_t b) { return (uint8_t)(b >> 4); }

/* The code of x in a group whose step is `step` (see formats.h's mq_group_step): INT4 (int4 != 0)
 * rounds x / step half to even and clamps, to q + 8 (symmetric) or q + zero in 0..15 (asym);
 * E2M1 (NVFP4, MXFP4) encodes x / step. A zero step gives the code of 0. */
MQ_CODEC uint8_t mq_code_of_step(int int4, int asym, float step, float zero, float x) {
    if (int4) {
        if (step == 0.0f) return asym ? (uint8_t)zero : 8;
        float q = rintf(x / step);   /* default rounding mode: half to even */
        if (asym) {
            q += zero;
            q = q < 0.0f ? 0.0f : q > 15.0f ? 15.0f : q;
            return (uint8_t)q;
        }
        q = q < -8.0f ? -8.0f : q > 7.0f ? 7.0f : q;
        return (uint8_t)(int)(q + 8.0f);
    }
    if (step == 0.0f) return 0;
    return mq_e2m1_encode_inl(x / step);
}

/* The dequantized value of a code: (code - zero or 8) * step (INT4), e2m1(code) * step. */
MQ_CODEC float mq_value_of_code(int int4, int asym, float step, float zero, uint8_t code) {
    if (int4) {
        const float q = asym ? (float)code - zero : (float)code - 8.0f;
        return q * step;
    }
    return mq_e2m1_decode_inl(code) * step;
}

#endif
