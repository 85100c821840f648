/*
 * Scalar number codecs: FP4 E2M1, FP8 E4M3 (float8_e4m3fn), E8M0, and rounding to a storage dtype.
 * E2M1 follows compressed-tensors cast_to_fp4 / torchao _f32_to_floatx_unpacked (decision
 * thresholds on |x|, ties to even, sign kept); E4M3 ports the bit algorithm of c10's
 * fp8e4m3fn_from_fp32_value, with a saturating clamp in front (torchao_gptq.md section 11,
 * formats.md section 2.0). No vendor intrinsics: they may round twice.
 */
#include <math.h>

#include "formats/formats.h"

/* The codecs themselves are codecs_inline.h's, which the GPU's device code compiles too. */
uint8_t mq_e2m1_encode(float x) { return mq_e2m1_encode_inl(x); }
float mq_e2m1_decode(uint8_t code) { return mq_e2m1_decode_inl(code); }
/* Built from its bits, without libm: FP8 sources decode every weight through it. */
float mq_e4m3_decode(uint8_t bits) { return mq_e4m3_decode_inl(bits); }
uint8_t mq_e8m0_encode_ceil(float x) { return mq_e8m0_encode_ceil_inl(x); }
float mq_e8m0_decode(uint8_t bits) { return mq_e8m0_decode_inl(bits); }

float mq_round_to_dtype(float x, moeq_dtype dt) {
    switch (dt) {
    case MOEQ_DT_BF16: return mq_bf16_to_f32(mq_f32_to_bf16(x));
    case MOEQ_DT_F16:
        if (fabsf(x) > 65504.0f) return x > 0 ? 65504.0f : -65504.0f;
        return mq_f16_to_f32(mq_f32_to_f16(x));
    default: return x;
    }
}
