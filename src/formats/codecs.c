/*
 * Scalar number codecs: FP4 E2M1, FP8 E4M3 (float8_e4m3fn), E8M0, and rounding to a storage dtype.
 * E2M1 follows compressed-tensors cast_to_fp4 / torchao _f32_to_floatx_unpacked (decision
 * thresholds on |x|, ties to even, sign kept); E4M3 ports the bit algorithm of c10's
 * fp8e4m3fn_from_fp32_value, with a saturating clamp in front (torchao_gptq.md section 11,
 * formats.md section 2.0). No vendor intrinsics: they may round twice.
 */
#include <math.h>
#include <string.h>

#include "formats/formats.h"

static const float e2m1_values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint8_t mq_e2m1_encode(float x) {
    uint8_t sign = (f32_bits(x) >> 28) & 0x8;
    float a = fabsf(x);
    uint8_t idx;
    /* The midpoints 0.25, 1.25, 2.5, 5 tie to the even code below, 0.75, 1.75, 3.5 to the even
     * code above; NaN fails every comparison and lands on 6. */
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

float mq_e2m1_decode(uint8_t code) {
    float v = e2m1_values[code & 7];
    return (code & 8) ? -v : v;
}

/* Built from its bits, without libm (FP8 sources decode every weight through it): a normal code
 * is (1 + m/8) 2^(e-7), a subnormal m 2^-9, both exact in fp32. */
float mq_e4m3_decode(uint8_t bits) {
    if ((bits & 0x7F) == 0x7F) return NAN;
    uint32_t e = (bits >> 3) & 0xFu, m = bits & 7u;
    float v = e == 0 ? (float)m * 0x1p-9f : f32_from_bits((e + 120u) << 23 | m << 20);
    return (bits & 0x80) ? -v : v;
}

uint8_t mq_e8m0_encode_ceil(float x) {
    if (isnan(x)) return 0xFF;
    if (!(x > 0x1p-127f)) return 0;
    if (x >= 0x1p127f) return 254;
    int e;
    float m = frexpf(x, &e);   /* x = m * 2^e, m in [0.5, 1) */
    int k = (m == 0.5f) ? e - 1 : e;   /* exact power of two stays, else round up */
    return (uint8_t)(k + 127);
}

float mq_e8m0_decode(uint8_t bits) {
    if (bits == 0xFF) return NAN;
    return ldexpf(1.0f, (int)bits - 127);
}

float mq_round_to_dtype(float x, moeq_dtype dt) {
    switch (dt) {
    case MOEQ_DT_BF16: return mq_bf16_to_f32(mq_f32_to_bf16(x));
    case MOEQ_DT_F16:
        if (fabsf(x) > 65504.0f) return x > 0 ? 65504.0f : -65504.0f;
        return mq_f16_to_f32(mq_f32_to_f16(x));
    default: return x;
    }
}
