/* Number formats and RTN quantization: hand-made bit vectors, slow brute-force references,
 * hand-computed group params and dequantized values, packing round trips. */
#include <stdlib.h>

#include "formats/formats.h"
#include "formats/cpu/simd.h"
#include "harness.h"
#include "io/gguf.h"

/* ---- slow references -------------------------------------------------------------------- */

/* Nearest E2M1 magnitude by brute force over the 8 values, ties to the even index. */
static uint8_t ref_e2m1(float x) {
    static const double v[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    double a = fabs((double)x);
    int best = 0;
    for (int i = 1; i < 8; i++) {
        double d = fabs(a - v[i]), db = fabs(a - v[best]);
        if (d < db || (d == db && (i % 2) == 0)) best = i;
    }
    return (uint8_t)((signbit(x) ? 8 : 0) | best);
}

/* Value of an E4M3 bit pattern computed from the definition (bias 7, 3 mantissa bits). */
static double ref_e4m3_value(int b) {
    int e = (b >> 3) & 15, m = b & 7;
    double v = e == 0 ? m / 8.0 * pow(2, -6) : (1 + m / 8.0) * pow(2, e - 7);
    return (b & 0x80) ? -v : v;
}

/* Nearest E4M3 by brute force over the 127 non-negative finite codes (ties to even mantissa),
 * saturating at 448. */
static uint8_t ref_e4m3(float x) {
    double a = fabs((double)x);
    int best = 0;
    for (int b = 1; b <= 0x7E; b++) {
        double d = fabs(a - ref_e4m3_value(b)), db = fabs(a - ref_e4m3_value(best));
        if (d < db || (d == db && (b & 1) == 0)) best = b;
    }
    return (uint8_t)((signbit(x) ? 0x80 : 0) | best);
}

static uint32_t rng_state = 12345;
static float rnd_uniform(float lo, float hi) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return lo + (hi - lo) * (float)(rng_state >> 8) / 16777216.0f;
}

/* ---- codecs ---------------------------------------------------------------------------- */

static void test_e2m1_bit_vectors(void) {
    ASSERT_EQ_HEX(0x0, mq_e2m1_encode(0.0f));
    ASSERT_EQ_HEX(0x8, mq_e2m1_encode(-0.0f));
    ASSERT_EQ_HEX(0x8, mq_e2m1_encode(-0.1f));   /* rounds to zero, keeps the sign */
    /* ties: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0 */
    ASSERT_EQ_HEX(0x0, mq_e2m1_encode(0.25f));
    ASSERT_EQ_HEX(0x2, mq_e2m1_encode(0.75f));
    ASSERT_EQ_HEX(0x2, mq_e2m1_encode(1.25f));
    ASSERT_EQ_HEX(0x4, mq_e2m1_encode(1.75f));
    ASSERT_EQ_HEX(0x4, mq_e2m1_encode(2.5f));
    ASSERT_EQ_HEX(0x6, mq_e2m1_encode(3.5f));
    ASSERT_EQ_HEX(0x6, mq_e2m1_encode(5.0f));
    ASSERT_EQ_HEX(0xE, mq_e2m1_encode(-5.0f));
    ASSERT_EQ_HEX(0xC, mq_e2m1_encode(-1.75f));
    /* just beside the ties */
    ASSERT_EQ_HEX(0x1, mq_e2m1_encode(nextafterf(0.25f, 1)));
    ASSERT_EQ_HEX(0x1, mq_e2m1_encode(nextafterf(0.75f, 0)));
    ASSERT_EQ_HEX(0x3, mq_e2m1_encode(nextafterf(1.25f, 2)));
    ASSERT_EQ_HEX(0x5, mq_e2m1_encode(nextafterf(2.5f, 3)));
    ASSERT_EQ_HEX(0x5, mq_e2m1_encode(nextafterf(3.5f, 0)));
    ASSERT_EQ_HEX(0x7, mq_e2m1_encode(nextafterf(5.0f, 6)));
    /* +-6 and beyond saturate */
    ASSERT_EQ_HEX(0x7, mq_e2m1_encode(6.0f));
    ASSERT_EQ_HEX(0x7, mq_e2m1_encode(7.0f));
    ASSERT_EQ_HEX(0x7, mq_e2m1_encode(1e30f));
    ASSERT_EQ_HEX(0x7, mq_e2m1_encode(INFINITY));
    ASSERT_EQ_HEX(0xF, mq_e2m1_encode(-6.0f));
    ASSERT_EQ_HEX(0xF, mq_e2m1_encode(-100.0f));
    static const float vals[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
    for (int c = 0; c < 16; c++) {
        ASSERT_NEAR(vals[c], mq_e2m1_decode((uint8_t)c), 0);
        ASSERT_EQ_HEX(c, mq_e2m1_encode(mq_e2m1_decode((uint8_t)c)));
    }
    ASSERT_TRUE(signbit(mq_e2m1_decode(0x8)));
    for (int i = 0; i < 20000; i++) {
        float x = rnd_uniform(-7.0f, 7.0f);
        if (mq_e2m1_encode(x) != ref_e2m1(x)) FAIL("e2m1(%.9g): 0x%x vs ref 0x%x", x, mq_e2m1_encode(x), ref_e2m1(x));
    }
}

static void test_e4m3_bit_vectors(void) {
    ASSERT_EQ_HEX(0x00, mq_e4m3_encode(0.0f));
    ASSERT_EQ_HEX(0x80, mq_e4m3_encode(-0.0f));
    ASSERT_EQ_HEX(0x38, mq_e4m3_encode(1.0f));
    ASSERT_EQ_HEX(0x38, mq_e4m3_encode(1.0625f));   /* tie between m=0 and m=1 -> even */
    ASSERT_EQ_HEX(0x3A, mq_e4m3_encode(1.1875f));   /* tie between m=1 and m=2 -> even */
    ASSERT_EQ_HEX(0x78, mq_e4m3_encode(256.0f));
    ASSERT_EQ_HEX(0x7D, mq_e4m3_encode(416.0f));
    ASSERT_EQ_HEX(0x7E, mq_e4m3_encode(432.0f));    /* tie 416/448 -> 448 (even) */
    ASSERT_EQ_HEX(0x7E, mq_e4m3_encode(448.0f));
    /* beyond 448: saturate (the plain c10 cast would give NaN from 464 on) */
    ASSERT_EQ_HEX(0x7E, mq_e4m3_encode(449.0f));
    ASSERT_EQ_HEX(0x7E, mq_e4m3_encode(464.0f));
    ASSERT_EQ_HEX(0x7E, mq_e4m3_encode(1e9f));
    ASSERT_EQ_HEX(0x7E, mq_e4m3_encode(INFINITY));
    ASSERT_EQ_HEX(0xFE, mq_e4m3_encode(-448.0f));
    ASSERT_EQ_HEX(0xFE, mq_e4m3_encode(-INFINITY));
    ASSERT_EQ_HEX(0x7F, mq_e4m3_encode(NAN));
    ASSERT_EQ_HEX(0x7F, mq_e4m3_encode(-NAN));
    /* subnormals: k * 2^-9 */
    ASSERT_EQ_HEX(0x01, mq_e4m3_encode(0x1p-9f));
    ASSERT_EQ_HEX(0x04, mq_e4m3_encode(0x1p-7f));
    ASSERT_EQ_HEX(0x08, mq_e4m3_encode(0x1p-6f));     /* smallest normal */
    ASSERT_EQ_HEX(0x00, mq_e4m3_encode(0x1p-10f));    /* half the smallest subnormal: tie -> 0 */
    ASSERT_EQ_HEX(0x01, mq_e4m3_encode(0x1.2p-10f));
    ASSERT_EQ_HEX(0x02, mq_e4m3_encode(0x1.8p-9f));   /* 1.5 ulp: tie -> 2 */
    ASSERT_EQ_HEX(0x02, mq_e4m3_encode(0x1.4p-8f));   /* 2.5 ulp: tie -> 2 */
    ASSERT_EQ_HEX(0x08, mq_e4m3_encode(0x1.ep-7f));   /* 7.5 ulp: tie -> 8 = 2^-6 */
    ASSERT_EQ_HEX(0x87, mq_e4m3_encode(-0x1.cp-7f));  /* -7 * 2^-9 */
    ASSERT_NEAR(0x1p-9, mq_e4m3_decode(0x01), 0);
    ASSERT_NEAR(0x1p-6, mq_e4m3_decode(0x08), 0);
    ASSERT_NEAR(448.0, mq_e4m3_decode(0x7E), 0);
    ASSERT_NEAR(-1.0, mq_e4m3_decode(0xB8), 0);
    ASSERT_TRUE(isnan(mq_e4m3_decode(0x7F)));
    ASSERT_TRUE(isnan(mq_e4m3_decode(0xFF)));
    for (int b = 0; b < 256; b++) {
        if ((b & 0x7F) == 0x7F) continue;
        ASSERT_NEAR(ref_e4m3_value(b), mq_e4m3_decode((uint8_t)b), 0);
        ASSERT_EQ_HEX(b, mq_e4m3_encode(mq_e4m3_decode((uint8_t)b)));
    }
    /* random values over the whole range (log-uniform) and exact midpoints */
    for (int i = 0; i < 5000; i++) {
        float x = ldexpf(rnd_uniform(1.0f, 2.0f), (int)rnd_uniform(-13.0f, 10.0f));
        if (i & 1) x = -x;
        if (mq_e4m3_encode(x) != ref_e4m3(x))
            FAIL("e4m3(%.9g): 0x%x vs ref 0x%x", x, mq_e4m3_encode(x), ref_e4m3(x));
    }
    for (int b = 0; b < 0x7E; b++) {
        float mid = (float)((ref_e4m3_value(b) + ref_e4m3_value(b + 1)) / 2);
        if (mq_e4m3_encode(mid) != ref_e4m3(mid))
            FAIL("e4m3 midpoint %.9g: 0x%x vs ref 0x%x", mid, mq_e4m3_encode(mid), ref_e4m3(mid));
        /* the floats beside each midpoint and each code, of both signs (the branch-free encoder
         * selects between its subnormal, normal and saturating results) */
        const float near[4] = {nextafterf(mid, 0.0f), nextafterf(mid, INFINITY),
                               nextafterf((float)ref_e4m3_value(b), 0.0f),
                               nextafterf((float)ref_e4m3_value(b), INFINITY)};
        for (int k = 0; k < 8; k++) {
            const float x = k < 4 ? near[k] : -near[k - 4];
            if (mq_e4m3_encode(x) != ref_e4m3(x))
                FAIL("e4m3(%a): 0x%x vs ref 0x%x", x, mq_e4m3_encode(x), ref_e4m3(x));
        }
    }
    /* every binade from far below the subnormals to far above 448, 64 mantissas each */
    for (int e = -40; e <= 40; e++)
        for (int m = 0; m < 64; m++) {
            const float x = ldexpf(1.0f + (float)m / 64.0f + 0x1p-20f * (float)(m % 3), e);
            if (mq_e4m3_encode(x) != ref_e4m3(x) || mq_e4m3_encode(-x) != ref_e4m3(-x))
                FAIL("e4m3(%a): 0x%x vs ref 0x%x", x, mq_e4m3_encode(x), ref_e4m3(x));
        }
}

static void test_e8m0_and_storage_rounding(void) {
    ASSERT_EQ_INT(127, mq_e8m0_encode_ceil(1.0f));
    ASSERT_EQ_INT(128, mq_e8m0_encode_ceil(1.5f));
    ASSERT_EQ_INT(127, mq_e8m0_encode_ceil(0.75f));
    ASSERT_EQ_INT(130, mq_e8m0_encode_ceil(8.0f));
    ASSERT_EQ_INT(0, mq_e8m0_encode_ceil(0.0f));
    ASSERT_EQ_INT(0xFF, mq_e8m0_encode_ceil(NAN));
    ASSERT_NEAR(1.0, mq_e8m0_decode(127), 0);
    ASSERT_NEAR(0.25, mq_e8m0_decode(125), 0);
    ASSERT_NEAR(0.142578125, mq_round_to_dtype(1.0f / 7.0f, MOEQ_DT_BF16), 0);
    ASSERT_NEAR(0.142822265625, mq_round_to_dtype(1.0f / 7.0f, MOEQ_DT_F16), 0);
    ASSERT_NEAR(65504.0, mq_round_to_dtype(1e6f, MOEQ_DT_F16), 0);
    ASSERT_NEAR(1.0f / 7.0f, mq_round_to_dtype(1.0f / 7.0f, MOEQ_DT_F32), 0);
}

/* ---- NVFP4 ----------------------------------------------------------------------------- */

static void test_nvfp4_ct_group_by_hand(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    float gs = mq_nvfp4_global_scale(&s, 6.0f);   /* 2688 / 6 */
    ASSERT_NEAR(448.0, gs, 0);
    ASSERT_NEAR(1.0, mq_nvfp4_global_scale(&s, 0.0f), 0);
    ASSERT_NEAR(1.0, mq_nvfp4_global_scale(&s, NAN), 0);
    /* block amax 3: t = 3/6 * 448 = 224 = E4M3 0x76; step = 224/448 = 0.5 */
    float x[16] = {3, -3, 1.25f, 0.5f, -0.75f, 0.1f, 2.0f, 0, 0, 0, 0, 0, 0, 0, 0, -0.0f};
    mq_gparams p;
    mq_group_params(&s, gs, x, 16, 1, &p);
    ASSERT_EQ_HEX(0x76, p.scale_code);
    ASSERT_NEAR(224.0, p.scale, 0);
    ASSERT_NEAR(0.5, mq_group_step(&s, gs, &p), 0);
    /* x/0.5 = 6, -6, 2.5 (tie->2), 1, -1.5, 0.2, 4 */
    static const uint8_t want[7] = {0x7, 0xF, 0x4, 0x2, 0xB, 0x0, 0x6};
    static const float deq[7] = {3, -3, 1.0f, 0.5f, -0.75f, 0, 2.0f};
    for (int i = 0; i < 7; i++) {
        ASSERT_EQ_HEX(want[i], mq_quant_value(&s, gs, &p, x[i]));
        ASSERT_NEAR(deq[i], mq_dequant_value(&s, gs, &p, want[i]), 0);
    }
    ASSERT_EQ_HEX(0x8, mq_quant_value(&s, gs, &p, -0.0f));
    /* all-zero block: scale 0, codes 0, dequant 0, no NaN */
    float z[16] = {0};
    mq_group_params(&s, gs, z, 16, 1, &p);
    ASSERT_EQ_HEX(0, p.scale_code);
    ASSERT_NEAR(0, p.scale, 0);
    ASSERT_EQ_HEX(0, mq_quant_value(&s, gs, &p, 0.0f));
    ASSERT_NEAR(0, mq_dequant_value(&s, gs, &p, 0), 0);
    /* saturation: a block bigger than the tensor amax clamps its scale to 448 and values to 6 */
    float big[16] = {12};
    mq_group_params(&s, gs, big, 16, 1, &p);
    ASSERT_EQ_HEX(0x7E, p.scale_code);
    ASSERT_EQ_HEX(0x7, mq_quant_value(&s, gs, &p, 12.0f));
    /* a tiny non-zero block keeps the smallest subnormal scale instead of 0 */
    float tiny[16] = {1e-6f};
    mq_group_params(&s, gs, tiny, 16, 1, &p);
    ASSERT_EQ_HEX(0x01, p.scale_code);
}

static void test_nvfp4_mul_reference_convention(void) {
    mq_qspec s = mq_qspec_reference(MQ_QS_NVFP4);
    float g = mq_nvfp4_global_scale(&s, 2688.0f);
    ASSERT_NEAR(1.0, g, 0);
    /* block amax 12: t = 12/6/1 = 2 -> E4M3 0x40; step = 2 */
    float x[16] = {12, 5, -7, 0.5f, 1.5f};
    mq_gparams p;
    mq_group_params(&s, g, x, 16, 1, &p);
    ASSERT_EQ_HEX(0x40, p.scale_code);
    ASSERT_NEAR(2.0, mq_group_step(&s, g, &p), 0);
    ASSERT_EQ_HEX(0x4, mq_quant_value(&s, g, &p, 5.0f));    /* 2.5 -> 2 (tie) */
    ASSERT_EQ_HEX(0x6, mq_quant_value(&s, g, &p, 7.0f));    /* 3.5 -> 4 (tie) */
    ASSERT_EQ_HEX(0xE, mq_quant_value(&s, g, &p, -7.0f));   /* -3.5 -> -4 (tie) */
    ASSERT_NEAR(-8.0, mq_dequant_value(&s, g, &p, 0xE), 0);
    /* all-zero block: the [2^-9, 448] clamp gives scale 2^-9, codes still 0 */
    float z[16] = {0};
    mq_group_params(&s, g, z, 16, 1, &p);
    ASSERT_EQ_HEX(0x01, p.scale_code);
    ASSERT_EQ_HEX(0, mq_quant_value(&s, g, &p, 0.0f));
    ASSERT_NEAR(0, mq_dequant_value(&s, g, &p, 0), 0);
}

/* ---- INT4 ------------------------------------------------------------------------------ */

static void test_int4_sym_by_hand(void) {
    mq_qspec s = mq_qspec_reference(MQ_QS_INT4);   /* amax/7, F32 scales */
    s.group_size = 8;
    float x[8] = {7, -3.5f, 0.5f, -1.5f, 2.5f, -0.5f, 1.5f, -7};
    mq_gparams p;
    mq_group_params(&s, 1, x, 8, 1, &p);
    ASSERT_NEAR(1.0, p.scale, 0);
    /* half-even: 0.5->0, -1.5->-2, 2.5->2, -0.5->0, 1.5->2, -3.5->-4 */
    static const int q[8] = {7, -4, 0, -2, 2, 0, 2, -7};
    for (int i = 0; i < 8; i++) {
        ASSERT_EQ_INT(q[i] + 8, mq_quant_value(&s, 1, &p, x[i]));
        ASSERT_NEAR(q[i], mq_dequant_value(&s, 1, &p, (uint8_t)(q[i] + 8)), 0);
    }
    /* div 7.5 (CT/GPTQ): 7.5 -> 8 clamps to 7, -7.5 -> -8 */
    s.int4_sym_div = 7.5f;
    float y[8] = {7.5f, -7.5f, 0, 0, 0, 0, 0, 0};
    mq_group_params(&s, 1, y, 8, 1, &p);
    ASSERT_NEAR(1.0, p.scale, 0);
    ASSERT_EQ_INT(15, mq_quant_value(&s, 1, &p, 7.5f));
    ASSERT_EQ_INT(0, mq_quant_value(&s, 1, &p, -7.5f));
    /* BF16 scale rounded before the codes: 1/7 -> 0.142578125 */
    s.int4_sym_div = 7.0f;
    s.scale_dtype = MOEQ_DT_BF16;
    float w[8] = {1, -1, 0, 0, 0, 0, 0, 0};
    mq_group_params(&s, 1, w, 8, 1, &p);
    ASSERT_NEAR(0.142578125, p.scale, 0);
    ASSERT_EQ_INT(15, mq_quant_value(&s, 1, &p, 1.0f));
    ASSERT_NEAR(0.998046875, mq_dequant_value(&s, 1, &p, 15), 0);
    /* all-zero group */
    float z[8] = {0};
    mq_group_params(&s, 1, z, 8, 1, &p);
    ASSERT_NEAR(0, p.scale, 0);
    ASSERT_EQ_INT(8, mq_quant_value(&s, 1, &p, 0.0f));
    ASSERT_NEAR(0, mq_dequant_value(&s, 1, &p, 8), 0);
}

/* Signed scales: amax / 8, negative when the group's largest magnitude is positive, so that value
 * takes the code -8 (0) either way; a tie keeps the positive scale. Codes worked by hand. */
static void test_int4_signed_by_hand(void) {
    mq_qspec s = mq_qspec_reference(MQ_QS_INT4);   /* F32 scales */
    s.group_size = 8;
    s.int4_signed_scale = true;
    mq_gparams p;
    /* the extreme is +8: scale -1; x / -1 rounded half to even: 8 -> -8, -3.5 -> 4, 0.5 -> -0,
     * 1.5 -> -2, 2.5 -> -2, -7 -> 7, -0.5 -> 0, 6.5 -> -6 */
    float x[8] = {8, -3.5f, 0.5f, 1.5f, 2.5f, -7, -0.5f, 6.5f};
    mq_group_params(&s, 1, x, 8, 1, &p);
    ASSERT_TRUE(p.scale == -1.0f);
    static const int q[8] = {-8, 4, 0, -2, -2, 7, 0, -6};
    for (int i = 0; i < 8; i++) {
        ASSERT_EQ_INT(q[i] + 8, mq_quant_value(&s, 1, &p, x[i]));
        ASSERT_TRUE(mq_dequant_value(&s, 1, &p, (uint8_t)(q[i] + 8)) == -(float)q[i]);
    }
    /* +8 comes back exactly: the positive convention (amax / 7.5) clips it to 7 x 8/7.5 */
    ASSERT_TRUE(mq_dequant_value(&s, 1, &p, 0) == 8.0f);
    /* the extreme is -8: a positive scale, -8 -> code 0 */
    float y[8] = {-8, 7, 1, 0, 0, 0, 0, 0};
    mq_group_params(&s, 1, y, 8, 1, &p);
    ASSERT_TRUE(p.scale == 1.0f);
    ASSERT_EQ_INT(0, mq_quant_value(&s, 1, &p, -8.0f));
    ASSERT_EQ_INT(15, mq_quant_value(&s, 1, &p, 7.0f));
    /* a tie (+4 and -4): positive, +4 -> 8 clamps to 7 */
    float t[8] = {4, -4, 0, 0, 0, 0, 0, 0};
    mq_group_params(&s, 1, t, 8, 1, &p);
    ASSERT_TRUE(p.scale == 0.5f);
    ASSERT_EQ_INT(15, mq_quant_value(&s, 1, &p, 4.0f));
    ASSERT_EQ_INT(0, mq_quant_value(&s, 1, &p, -4.0f));
    /* one-signed positive group: negative scale; BF16 rounds the magnitude, then the sign:
     * 1.1 / 8 = 0.1375 -> bf16 0.1376953125 */
    s.scale_dtype = MOEQ_DT_BF16;
    float u[8] = {1.1f, 0.3f, 0.2f, 0, 0, 0, 0, 0.05f};
    mq_group_params(&s, 1, u, 8, 1, &p);
    ASSERT_TRUE(p.scale == -0.1376953125f);
    ASSERT_EQ_INT(0, mq_quant_value(&s, 1, &p, 1.1f));    /* -7.99 -> -8 */
    ASSERT_EQ_INT(6, mq_quant_value(&s, 1, &p, 0.3f));    /* -2.18 -> -2 */
    ASSERT_EQ_INT(8, mq_quant_value(&s, 1, &p, 0.05f));   /* -0.36 -> 0 */
    /* the search keeps the sign: every candidate of a group is on the same side */
    s.mse = true;
    mq_group_params(&s, 1, u, 8, 1, &p);
    ASSERT_TRUE(p.scale < 0);
    /* all-zero group: scale 0, code 8 */
    float z[8] = {0};
    mq_group_params(&s, 1, z, 8, 1, &p);
    ASSERT_TRUE(p.scale == 0.0f);
    ASSERT_EQ_INT(8, mq_quant_value(&s, 1, &p, 0.0f));
}

static void test_int4_asym_by_hand(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_INT4);
    s.asym = true;
    s.scale_dtype = MOEQ_DT_F32;
    s.group_size = 8;
    /* min -3, max 4.5: scale 7.5/15 = 0.5, zero = round(3/0.5) = 6 */
    float x[8] = {-3, 4.5f, 0.25f, 0.75f, 1.25f, -0.25f, 0, 2};
    mq_gparams p;
    mq_group_params(&s, 1, x, 8, 1, &p);
    ASSERT_NEAR(0.5, p.scale, 0);
    ASSERT_NEAR(6, p.zero, 0);
    static const int q[8] = {0, 15, 6, 8, 8, 6, 6, 10};
    for (int i = 0; i < 8; i++) ASSERT_EQ_INT(q[i], mq_quant_value(&s, 1, &p, x[i]));
    ASSERT_NEAR(1.0, mq_dequant_value(&s, 1, &p, 8), 0);
    ASSERT_NEAR(-3.0, mq_dequant_value(&s, 1, &p, 0), 0);
    /* all positive: the range still includes 0 -> zero point 0 */
    float y[8] = {1, 2, 3, 1.5f, 1, 1, 1, 1};
    mq_group_params(&s, 1, y, 8, 1, &p);
    ASSERT_NEAR(0, p.zero, 0);
    ASSERT_NEAR(0.2, p.scale, 1e-7);
    float z[8] = {0};
    mq_group_params(&s, 1, z, 8, 1, &p);
    ASSERT_NEAR(0, p.scale, 0);
    ASSERT_NEAR(0, mq_dequant_value(&s, 1, &p, mq_quant_value(&s, 1, &p, 0.0f)), 0);
}

/* ---- MSE search ------------------------------------------------------------------------ */

static double sse_of(const mq_qspec *s, float gs, const mq_gparams *p, const float *x, int n) {
    double e = 0;
    for (int i = 0; i < n; i++) {
        double d = (double)x[i] - mq_dequant_value(s, gs, p, mq_quant_value(s, gs, p, x[i]));
        e += d * d;
    }
    return e;
}

static void check_mse_scheme(mq_qspec s, float gs) {
    float x[32];
    for (int trial = 0; trial < 50; trial++) {
        for (int i = 0; i < 32; i++) x[i] = rnd_uniform(-1, 1) * rnd_uniform(0, 1);
        x[trial % 32] = 3.0f;   /* an outlier makes shrinking pay */
        int n = (int)mq_qspec_group(&s, 32);
        mq_gparams rtn, mse;
        s.mse = false;
        mq_group_params(&s, gs, x, n, 1, &rtn);
        s.mse = true;
        mq_group_params(&s, gs, x, n, 1, &mse);
        double e_mse = sse_of(&s, gs, &mse, x, n);
        ASSERT_TRUE(e_mse <= sse_of(&s, gs, &rtn, x, n));
        /* brute force: scale every candidate of the grid by hand; none beats the choice */
        for (int k = 0; k < 17; k++) {
            float m = 0.70f + (1.10f - 0.70f) * (float)k / 16.0f;
            mq_gparams c = rtn;
            if (s.scheme == MQ_QS_NVFP4) {
                float amax = mq_absmax(x, n);
                c.scale_code = mq_e4m3_encode(fminf(gs * (amax / 6.0f) * m, 448.0f));
                c.scale = mq_e4m3_decode(c.scale_code);
            } else {
                c.scale = mq_round_to_dtype(mq_absmax(x, n) / s.int4_sym_div * m, s.scale_dtype);
            }
            if (sse_of(&s, gs, &c, x, n) < e_mse) FAIL("grid point %d beats the MSE choice", k);
        }
    }
}

static void test_mse_search_picks_grid_minimum(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    check_mse_scheme(s, mq_nvfp4_global_scale(&s, 3.0f));
    s = mq_qspec_default(MQ_QS_INT4);
    s.group_size = 32;
    check_mse_scheme(s, 1.0f);
}

/* The grid search written the slow, obvious way: every grid point's params from the formulas of
 * formats.h, every value through the public per-value quantize/dequantize, the weighted squared
 * error summed in double in value order, the first strictly smaller error kept. */
static mq_gparams slow_mse(const mq_qspec *s, float gs, const float *x, int n, int stride,
                           const float *h) {
    float amax = 0, lo = 0, hi = 0;
    for (int i = 0; i < n; i++) {
        float v = x[i * stride];
        if (v < lo) lo = v;
        if (v > hi) hi = v;
        if (fabsf(v) > amax) amax = fabsf(v);
    }
    mq_qspec plain = *s;
    plain.mse = false;
    mq_gparams best_p;
    mq_group_params(&plain, gs, x, n, stride, &best_p);
    if (!(amax > 0)) return best_p;
    double best = INFINITY;
    for (int k = 0; k < s->mse_steps; k++) {
        float m = s->mse_steps == 1 ? s->mse_lo
                                    : s->mse_lo + (s->mse_hi - s->mse_lo) * (float)k /
                                                      (float)(s->mse_steps - 1);
        mq_gparams c = {0, 0, 0, 0};
        if (s->scheme == MQ_QS_NVFP4) {
            float t = amax / 6.0f;
            t = s->nvfp4_conv == MQ_NVFP4_MUL ? t / gs : gs * t;
            t = t * m;
            t = fminf(fmaxf(t, s->nvfp4_scale_min), 448.0f);
            c.scale_code = mq_e4m3_encode(t);
            if (c.scale_code == 0) c.scale_code = 1;
            c.scale = mq_e4m3_decode(c.scale_code);
        } else if (s->scheme == MQ_QS_MXFP4) {
            c.scale_code = mq_e8m0_encode_ceil(amax / 6.0f * m);
            c.scale = mq_e8m0_decode(c.scale_code);
        } else if (!s->asym) {
            float div = s->int4_signed_scale ? 8.0f : s->int4_sym_div;
            c.scale = mq_round_to_dtype(amax / div * m, s->scale_dtype);
            if (c.scale == 0) c.scale = 0x1p-24f;
            if (s->int4_signed_scale && hi > -lo) c.scale = -c.scale;
        } else {
            float l = lo * m, u = hi * m;
            c.scale = mq_round_to_dtype((u - l) / 15.0f, s->scale_dtype);
            if (c.scale == 0) c.scale = mq_round_to_dtype(0x1p-24f, s->scale_dtype);
            c.zero = fminf(fmaxf(rintf(-l / c.scale), (float)s->int4_zero_min), 15.0f);
        }
        double e = 0;
        for (int i = 0; i < n; i++) {
            float v = x[i * stride];
            double d = (double)v - mq_dequant_value(s, gs, &c, mq_quant_value(s, gs, &c, v));
            e += h ? (double)h[i] * (d * d) : d * d;
        }
        if (e < best) {
            best = e;
            best_p = c;
        }
    }
    return best_p;
}

static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* A spec and global scale for trial t: every scheme and convention, default grids and a few
 * others (one not dense enough for the NVFP4 shortcut, one with more candidates than a chunk). */
static mq_qspec trial_spec(int t, float amax_tensor, float *gs) {
    mq_qspec s;
    switch (t % 10) {
    case 0: s = mq_qspec_default(MQ_QS_NVFP4); break;
    case 1: s = mq_qspec_reference(MQ_QS_NVFP4); break;
    case 2: s = mq_qspec_default(MQ_QS_NVFP4); s.mse_steps = 9; s.mse_lo = 0.5f; s.mse_hi = 1.5f; break;
    case 3: s = mq_qspec_default(MQ_QS_INT4); s.int4_signed_scale = t / 10 % 2; break;
    case 4: s = mq_qspec_reference(MQ_QS_INT4); s.group_size = 32; break;
    case 5: s = mq_qspec_default(MQ_QS_INT4); s.asym = true; s.int4_zero_min = (int8_t)(t / 10 % 2); break;
    case 6: s = mq_qspec_default(MQ_QS_INT4); s.scale_dtype = MOEQ_DT_F16; s.group_size = 64; break;
    case 7: s = mq_qspec_default(MQ_QS_MXFP4); break;
    case 8: s = mq_qspec_default(MQ_QS_INT4); s.group_size = 32; s.mse_steps = 70; s.int4_signed_scale = true; break;
    default: s = mq_qspec_reference(MQ_QS_NVFP4); s.mse_lo = 0.2f; s.mse_hi = 1.3f; s.mse_steps = 40; break;
    }
    s.mse = true;
    *gs = mq_nvfp4_global_scale(&s, amax_tensor);
    return s;
}

/* Random group values: magnitudes from 1e-7 (subnormal E4M3 scales) to 10, outliers, zeros,
 * one-signed groups, all-zero groups. */
static void trial_values(int t, float *x, int count) {
    float mag = powf(10.0f, rnd_uniform(-7, 1));
    for (int i = 0; i < count; i++) {
        float v = rnd_uniform(-1, 1) * mag;
        if (rnd_uniform(0, 1) < 0.05f) v *= 8;
        if (rnd_uniform(0, 1) < 0.03f) v = 0;
        x[i] = (t % 7 == 0) ? fabsf(v) : v;
    }
    if (t % 23 == 0) memset(x, 0, (size_t)count * sizeof(float));
}

/* The fast search (candidates precomputed, repeats skipped, scored 8 at a time, AVX2 or scalar)
 * chooses exactly what the slow search chooses, plain and Hessian-weighted, contiguous and
 * strided (GPTQ's transposed groups). */
static void test_mse_search_matches_slow_search(void) {
    static float x[128 * 3], h[128];
    for (int ref = 0; ref < 2; ref++) {
        moeq_set_force_ref(ref);
        for (int t = 0; t < 1500; t++) {
            int stride = t % 3 == 0 ? 3 : 1;
            trial_values(t, x, 128 * stride);
            float amax_tensor = mq_absmax(x, 128 * stride) * rnd_uniform(1, 4);
            if (t % 11 == 0) amax_tensor *= 1e-3f;   /* blocks whose scale saturates at 448 */
            float gs;
            mq_qspec s = trial_spec(t, amax_tensor, &gs);
            int n = (int)mq_qspec_group(&s, 128);
            for (int i = 0; i < n; i++) h[i] = t % 5 == 4 ? 0.0f : rnd_uniform(0, 3);
            const float *hw = t % 2 ? h : NULL;
            mq_gparams want = slow_mse(&s, gs, x, n, stride, hw), got;
            mq_group_params_h(&s, gs, x, n, stride, hw, &got);
            if (bits_of(want.scale) != bits_of(got.scale) || want.zero != got.zero ||
                want.scale_code != got.scale_code) {
                moeq_set_force_ref(0);
                FAIL("trial %d (%s, ref %d): want scale %.9g zero %g code 0x%x, got %.9g %g 0x%x", t,
                     mq_qscheme_name(s.scheme), ref, want.scale, want.zero, want.scale_code,
                     got.scale, got.zero, got.scale_code);
            }
            if (!hw) {   /* mq_group_params is the unweighted search */
                mq_gparams g2;
                mq_group_params(&s, gs, x, n, stride, &g2);
                ASSERT_EQ_HEX(bits_of(got.scale), bits_of(g2.scale));
            }
        }
    }
    moeq_set_force_ref(0);
}

/* Candidates of many rows at once (GPTQ's in-loop search: rows innermost) are each row's own,
 * bit for bit, for every trial spec, on 93 rows (a block of 64, then 29), with all-zero rows,
 * one-signed rows and NaN in a row; and without MSE nothing to search, the plain params. */
static void test_candidates_rows(void) {
    enum { R = 93, LD = 97, N = 128 };
    static float x[N * LD], col[N];
    static mq_gparams cand[R * 72], one[72];
    static float step[72 * R], zero[72 * R];
    mq_gparams plain[R];
    int nc[R];
    for (int t = 0; t < 200; t++) {
        trial_values(t, x, N * LD);
        for (int i = 0; i < R; i += 17)   /* all-zero rows */
            for (int k = 0; k < N; k++) x[k * LD + i + t % 3] = 0.0f;
        if (t % 4 == 1) x[5 * LD + 70] = NAN;
        float amax_tensor = mq_absmax(x, N * LD);
        if (!(amax_tensor > 0)) amax_tensor = 1.0f;
        float gs;
        mq_qspec s = trial_spec(t, amax_tensor * rnd_uniform(1, 4), &gs);
        if (t % 13 == 0) s.mse = false;
        const int n = (int)mq_qspec_group(&s, N), room = s.mse_steps > 1 ? s.mse_steps : 1;
        const int most = mq_group_candidates_rows(&s, gs, x, n, LD, R, plain, cand, room, nc,
                                                  t % 2 ? step : NULL, t % 2 ? zero : NULL);
        int want_most = 0;
        for (int i = 0; i < R; i++) {
            for (int k = 0; k < n; k++) col[k] = x[k * LD + i];
            mq_gparams p;
            const int m = mq_group_candidates(&s, gs, col, n, 1, &p, one);
            if (m != nc[i] || bits_of(p.scale) != bits_of(plain[i].scale) || p.zero != plain[i].zero ||
                p.scale_code != plain[i].scale_code)
                FAIL("trial %d (%s) row %d: %d candidates, plain %.9g, want %d, %.9g", t,
                     mq_qscheme_name(s.scheme), i, nc[i], plain[i].scale, m, p.scale);
            for (int k = 0; k < m; k++) {
                const mq_gparams *c = &cand[i * room + k];
                if (bits_of(c->scale) != bits_of(one[k].scale) || c->zero != one[k].zero ||
                    c->scale_code != one[k].scale_code)
                    FAIL("trial %d row %d candidate %d: %.9g, want %.9g", t, i, k, c->scale, one[k].scale);
                if (t % 2 && (bits_of(step[k * R + i]) != bits_of(mq_group_step(&s, gs, &one[k])) ||
                              zero[k * R + i] != one[k].zero))
                    FAIL("trial %d row %d candidate %d: step %.9g, want %.9g", t, i, k, step[k * R + i],
                         mq_group_step(&s, gs, &one[k]));
            }
            if (t % 2 && m == 0 && bits_of(step[i]) != bits_of(mq_group_step(&s, gs, &p)))
                FAIL("trial %d row %d: plain step %.9g, want %.9g", t, i, step[i], mq_group_step(&s, gs, &p));
            want_most = m > want_most ? m : want_most;
            if (!s.mse) ASSERT_EQ_INT(0, m);
        }
        ASSERT_EQ_INT(want_most, most);
    }
}

/* Hessian weights change the choice: a group whose big value has weight 0 scores only the
 * small ones, so the search shrinks the scale to the bottom of the grid. */
static void test_mse_weighted_by_hand(void) {
    mq_qspec s = mq_qspec_reference(MQ_QS_INT4);   /* amax / 7, F32 scales */
    s.group_size = 8;
    s.mse = true;
    float x[8] = {7, 0.7f, -0.7f, 0.7f, 0.7f, -0.7f, 0.7f, 0.7f};
    float h[8] = {0, 1, 1, 1, 1, 1, 1, 1};
    mq_gparams p, q;
    mq_group_params_h(&s, 1, x, 8, 1, NULL, &p);
    mq_group_params_h(&s, 1, x, 8, 1, h, &q);
    /* unweighted, the outlier 7 keeps the scale near amax / 7 = 1 (step 0.7 would clip it to
     * 4.9) */
    ASSERT_TRUE(p.scale > 0.9f);
    /* weighted: scale m = 0.7 gives step 0.7, the 0.7s exactly representable */
    ASSERT_NEAR(0.7, q.scale, 1e-6);
    double e = 0;
    for (int i = 1; i < 8; i++) {
        double d = x[i] - mq_dequant_value(&s, 1, &q, mq_quant_value(&s, 1, &q, x[i]));
        e += d * d;
    }
    ASSERT_NEAR(0, e, 1e-12);
}

/* The AVX2 scoring of candidates is bit-identical to the scalar reference, for every scheme,
 * candidate counts that fill 1 to 4 vectors partly, zero steps, weights or none. */
static void test_mse_sse_twin(void) {
    if (!mq_cpu_has_avx2_fma()) SKIP("no AVX2+FMA");
    static float x[64 * 5], h[64], step[40], zero[40];
    static double a[40], b[40];
    const mq_qscheme schemes[3] = {MQ_QS_NVFP4, MQ_QS_INT4, MQ_QS_MXFP4};
    for (int t = 0; t < 600; t++) {
        mq_qspec s = mq_qspec_default(schemes[t % 3]);
        s.asym = s.scheme == MQ_QS_INT4 && t % 2;
        int nc = 1 + t % 37, n = 1 + t % 64, stride = 1 + t % 5;
        trial_values(t, x, n * stride);
        float amax = mq_absmax(x, n * stride);
        for (int c = 0; c < 40; c++) {
            step[c] = amax * rnd_uniform(0.05f, 0.3f);
            zero[c] = s.asym ? rintf(rnd_uniform(0, 15)) : 0.0f;
            if (c % 9 == 5) step[c] = 0;
            if (c % 3 == 1 && s.scheme == MQ_QS_INT4 && !s.asym) step[c] = -step[c];   /* signed scales */
        }
        for (int i = 0; i < n; i++) h[i] = rnd_uniform(0, 2);
        const float *hw = t % 2 ? h : NULL;
        mq_mse_sse_ref(&s, step, zero, nc, x, n, stride, hw, a);
#if MQ_TEST_X86
        mq_mse_sse_avx2(&s, step, zero, nc, x, n, stride, hw, b);
#else
        memcpy(b, a, sizeof(double) * (size_t)nc);   /* unreachable: skipped without AVX2 */
#endif
        for (int c = 0; c < nc; c++)
            if (memcmp(&a[c], &b[c], sizeof(double)) != 0)
                FAIL("trial %d candidate %d: ref %.17g, avx2 %.17g", t, c, a[c], b[c]);
    }
}

/* ---- tensors ----------------------------------------------------------------------------- */

static void test_rtn_tensor_and_dequant(void) {
    const int R = 37, C = 64;
    float *w = malloc(sizeof(float) * R * C), *d1 = malloc(sizeof(float) * R * C);
    float *d2 = malloc(sizeof(float) * R * C);
    for (int i = 0; i < R * C; i++) w[i] = rnd_uniform(-2, 2);
    for (int c = 0; c < C; c++) w[5 * C + c] = 0;   /* an all-zero row */
    /* NVFP4 (both global-scale conventions), INT4 symmetric and asymmetric (a zero point per
     * group), MXFP4 */
    mq_qscheme schemes[5] = {MQ_QS_NVFP4, MQ_QS_NVFP4, MQ_QS_INT4, MQ_QS_INT4, MQ_QS_MXFP4};
    for (int k = 0; k < 5; k++) {
        mq_qspec s = mq_qspec_default(schemes[k]);
        if (schemes[k] == MQ_QS_INT4) s.group_size = 32;
        if (k == 1) s.nvfp4_conv = MQ_NVFP4_MUL;
        if (k == 3) s.asym = true;
        mq_qtensor q1, q2;
        moeq_set_threads(1);
        ASSERT_OK(mq_quantize_rtn(&s, w, R, C, 0, "t", &q1));
        moeq_set_threads(getenv("MOEQ_CROSS") ? 1 : 3);   /* qemu-user: contended locks crawl */
        ASSERT_OK(mq_quantize_rtn(&s, w, R, C, 0, "t", &q2));
        moeq_set_threads(0);
        ASSERT_TRUE(memcmp(q1.codes, q2.codes, (size_t)R * C) == 0);
        mq_dequantize(&q1, d1);
        /* dequant equals the per-value path group by group, and the all-zero row stays 0 */
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) {
                const mq_gparams *p = &q1.params[r * q1.n_groups + c / q1.group_size];
                float want = mq_dequant_value(&s, q1.global_scale, p, q1.codes[r * C + c]);
                if (memcmp(&want, &d1[r * C + c], 4)) FAIL("%d,%d: %g vs %g", r, c, want, d1[r * C + c]);
            }
        /* mq_dequant_n (one column of every row, each with its own group) gives the same bits */
        for (int c = 0; c < C; c += 7) {
            mq_gparams gp[37];
            uint8_t cc[37];
            float col[37];
            for (int r = 0; r < R; r++) {
                gp[r] = q1.params[r * q1.n_groups + c / q1.group_size];
                cc[r] = q1.codes[r * C + c];
            }
            mq_dequant_n(&s, q1.global_scale, gp, cc, R, col);
            for (int r = 0; r < R; r++)
                if (memcmp(&col[r], &d1[r * C + c], 4)) FAIL("column %d row %d: %g vs %g", c, r, col[r], d1[r * C + c]);
        }
        for (int c = 0; c < C; c++) ASSERT_NEAR(0, d1[5 * C + c], 0);
        ASSERT_TRUE(mq_test_rel_maxdiff(d1, w, (size_t)R * C) < 0.25);
        /* row ranges (the pipeline's pieces: 5, 10 and the 22 past the end) write exactly their
         * rows, with the whole tensor's values */
        for (int i = 0; i < R * C; i++) d2[i] = -7.0f;
        mq_dequantize_rows(&q1, d2, 5, 15);
        for (int i = 0; i < R * C; i++)
            if (i / C >= 5 && i / C < 15 ? memcmp(&d1[i], &d2[i], 4) : d2[i] != -7.0f) FAIL("rows 5-15: value %d", i);
        mq_dequantize_rows(&q1, d2, 0, 5);
        mq_dequantize_rows(&q1, d2, 15, 64);
        ASSERT_TRUE(memcmp(d1, d2, sizeof(float) * R * C) == 0);
        /* g_idx equal to the default mapping changes nothing */
        q1.g_idx = mq_alloc(sizeof(int32_t) * C, "g_idx");
        for (int c = 0; c < C; c++) q1.g_idx[c] = (int32_t)(c / q1.group_size);
        mq_dequantize(&q1, d2);
        ASSERT_TRUE(memcmp(d1, d2, sizeof(float) * R * C) == 0);
        mq_qtensor_free(&q1);
        mq_qtensor_free(&q2);
    }
    /* NVFP4 global scale from the tensor amax, and an explicit (fused) one is kept */
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_qtensor q;
    ASSERT_OK(mq_quantize_rtn(&s, w, R, C, 0, "t", &q));
    ASSERT_NEAR(2688.0f / mq_absmax(w, R * C), q.global_scale, 0);
    mq_qtensor_free(&q);
    ASSERT_OK(mq_quantize_rtn(&s, w, R, C, 100.0f, "t", &q));
    ASSERT_NEAR(100.0, q.global_scale, 0);
    mq_qtensor_free(&q);
    free(w); free(d1); free(d2);
}

/* The pooled absmax and finiteness checks against the serial ones, with the odd value at chunk
 * edges (chunks of 2^18 values) and in arrays of every size, at 1 and 3 threads. */
static void test_pooled_absmax_and_finite(void) {
    const int64_t n = 3 * (1 << 18) + 77;
    float *x = malloc((size_t)n * sizeof *x);
    ASSERT_TRUE(x != NULL);
    for (int64_t i = 0; i < n; i++) x[i] = (float)((i * 7919) % 1000) * 1e-3f - 0.5f;
    const int64_t spots[] = {0, (1 << 18) - 1, 1 << 18, 2 * (1 << 18) + 5, n - 1};
    for (int pass = 0; pass < 2; pass++) {
        moeq_set_threads(pass == 0 || getenv("MOEQ_CROSS") ? 1 : 3);   /* qemu-user: contended locks crawl */
        for (int k = 0; k < 5; k++) {
            const int64_t at = spots[k];
            const float keep = x[at];
            x[at] = -7.25f;   /* the largest magnitude, here */
            float want = mq_absmax(x, n), got = mq_absmax_pool(x, n);
            ASSERT_TRUE(memcmp(&want, &got, 4) == 0 && got == 7.25f);
            x[at] = NAN;
            ASSERT_TRUE(mq_absmax_pool(x, n) != mq_absmax_pool(x, n));   /* NaN */
            /* three arrays: the whole, an empty one, the part from `at` on */
            const float *arrs[4] = {x, NULL, x + at, x};
            const int64_t ns[4] = {n, 5, n - at, at};   /* the last stops before the NaN */
            uint8_t ok[4];
            ASSERT_OK(mq_all_finite_many(arrs, ns, 4, ok));
            ASSERT_TRUE(!ok[0] && ok[1] && !ok[2] && ok[3]);
            x[at] = INFINITY;
            ASSERT_OK(mq_all_finite_many(arrs, ns, 4, ok));
            ASSERT_TRUE(!ok[0] && ok[1] && !ok[2] && ok[3]);
            x[at] = keep;
            ASSERT_OK(mq_all_finite_many(arrs, ns, 4, ok));
            ASSERT_TRUE(ok[0] && ok[1] && ok[2] && ok[3]);
        }
    }
    moeq_set_threads(0);
    free(x);
}

static void test_nan_inf_is_an_error_naming_the_position(void) {
    float w[4 * 32] = {0};
    w[2 * 32 + 5] = NAN;
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_qtensor q;
    ASSERT_STATUS(MOEQ_E_NUMERIC, mq_quantize_rtn(&s, w, 4, 32, 0, "layers.0.q_proj", &q));
    ASSERT_ERROR_MENTIONS("layers.0.q_proj");
    ASSERT_ERROR_MENTIONS("row 2, column 5");
    mq_qtensor_free(&q);
    w[2 * 32 + 5] = 0;
    w[3 * 32 + 31] = -INFINITY;
    s = mq_qspec_default(MQ_QS_INT4);
    s.group_size = 32;
    ASSERT_STATUS(MOEQ_E_NUMERIC, mq_quantize_rtn(&s, w, 4, 32, 0, "w", &q));
    ASSERT_ERROR_MENTIONS("row 3, column 31");
    mq_qtensor_free(&q);
}

static void test_spec_checks(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    ASSERT_STATUS(MOEQ_E_SHAPE, mq_qspec_check(&s, 4, 40, "odd"));
    ASSERT_ERROR_MENTIONS("odd");
    s = mq_qspec_default(MQ_QS_INT4);
    ASSERT_STATUS(MOEQ_E_SHAPE, mq_qspec_check(&s, 4, 192, "g"));
    s.group_size = -1;
    ASSERT_OK(mq_qspec_check(&s, 4, 192, "g"));
    ASSERT_EQ_INT(192, mq_qspec_group(&s, 192));
    s.group_size = 128;
    ASSERT_NEAR(4.125, mq_qspec_bits_per_weight(&s, 256, 256), 1e-12);
    s = mq_qspec_default(MQ_QS_NVFP4);
    ASSERT_NEAR(4.5 + 32.0 / 65536, mq_qspec_bits_per_weight(&s, 256, 256), 1e-12);
}

static void test_packing_round_trips(void) {
    const uint8_t codes[4] = {0x1, 0x2, 0xF, 0x0};
    uint8_t b[2], back[8];
    mq_pack_u4_bytes(codes, 4, b);
    ASSERT_EQ_HEX(0x21, b[0]);
    ASSERT_EQ_HEX(0x0F, b[1]);
    mq_unpack_u4_bytes(b, 4, back);
    ASSERT_TRUE(memcmp(codes, back, 4) == 0);
    const uint8_t c8[16] = {0, 1, 2, 3, 4, 5, 6, 7, 15, 14, 13, 12, 11, 10, 9, 8};
    uint32_t words[2];
    uint8_t back16[16];
    mq_pack_u4_words(c8, 16, words);
    ASSERT_EQ_HEX(0x76543210u, words[0]);
    ASSERT_EQ_HEX(0x89ABCDEFu, words[1]);
    mq_unpack_u4_words(words, 16, back16);
    ASSERT_TRUE(memcmp(c8, back16, 16) == 0);
    uint8_t all[256], pk[128], un[256];
    for (int i = 0; i < 256; i++) all[i] = (uint8_t)((i * 7 + i / 16) & 15);
    mq_pack_u4_bytes(all, 256, pk);
    mq_unpack_u4_bytes(pk, 256, un);
    ASSERT_TRUE(memcmp(all, un, 256) == 0);
    /* the vector path against its scalar twin: high bits set (only the low four count), every
     * length from 0 to 100 (tails shorter than a vector step), offsets 0..3; and the words */
    uint8_t raw[104], pv[60], pr[60];
    uint32_t wv[13], wr[13];
    uint32_t x = 12345;
    for (int i = 0; i < 104; i++) {
        x = x * 1664525u + 1013904223u;
        raw[i] = (uint8_t)(x >> 24);
    }
    for (int off = 0; off < 4; off++)
        for (int n = 0; n + off <= 100; n += 2) {
            memset(pv, 0xAA, sizeof pv);
            memset(pr, 0xAA, sizeof pr);
            mq_pack_u4_bytes(raw + off, n, pv);
            mq_pack_u4_bytes_ref(raw + off, n, pr);
            ASSERT_TRUE(memcmp(pv, pr, sizeof pv) == 0);
            if (n % 8) continue;
            memset(wv, 0xAA, sizeof wv);
            mq_pack_u4_words(raw + off, n, wv);
            for (int i = 0; i < n / 8; i++) {
                wr[i] = 0;
                for (int j = 0; j < 8; j++) wr[i] |= (uint32_t)(raw[off + 8 * i + j] & 15) << (4 * j);
            }
            ASSERT_TRUE(memcmp(wv, wr, (size_t)n / 2) == 0);
            ASSERT_EQ_HEX(0xAAAAAAAAu, wv[n / 8]);   /* nothing written past the end */
        }
}

static void test_activation_fake_quant(void) {
    /* whole-tensor amax 5.25 -> g = 5.25/2688 = 2^-9 exactly.
     * block 0 (amax 5.25): s = E4M3(0.875 * 512) = 448, step = 0.875
     * block 1 (amax 0.5): t = 0.5/6*512 = 42.67 -> E4M3 44, step = 44/512 = 0.0859375 */
    float x[2 * 32];
    memset(x, 0, sizeof x);
    x[0] = 5.25f;
    x[1] = 1.0f;
    x[2] = -2.0f;
    x[16] = 0.5f;
    x[17] = 0.1f;
    x[18] = -0.2f;
    x[32] = 3.0f;   /* row 1: amax 3 -> t = 0.5*512 = 256, step = 0.5 */
    x[33] = 1.3f;
    mq_nvfp4_act_qdq(x, 2, 32);
    ASSERT_NEAR(5.25, x[0], 0);
    ASSERT_NEAR(0.875, x[1], 0);       /* 1.0 * 1.142857 -> e2m1 1.0 */
    ASSERT_NEAR(-1.75, x[2], 0);       /* -2.2857 -> -2 */
    ASSERT_NEAR(0.515625, x[16], 0);   /* 5.818 -> 6 */
    ASSERT_NEAR(0.0859375, x[17], 0);  /* 1.1636 -> 1 */
    ASSERT_NEAR(-0.171875, x[18], 0);  /* -2.327 -> -2 */
    ASSERT_NEAR(3.0, x[32], 0);
    ASSERT_NEAR(1.5, x[33], 0);        /* 2.6 -> 3 */
    ASSERT_NEAR(0, x[20], 0);
    float z[16] = {0};
    mq_nvfp4_act_qdq(z, 1, 16);
    for (int i = 0; i < 16; i++) ASSERT_NEAR(0, z[i], 0);
}

/* llama.cpp's Q8_0 activation rounding (x86 AVX/AVX2 quantize_row_q8_0) on hand-made blocks; the
 * expected Q8_0 blocks are written out byte by byte (d as fp16 little endian, then 32 int8) and
 * decoded by the GGUF reader: the emulation's output must be those values exactly. */
static void test_q8_0_activation_rounding(void) {
    float x[2 * 64];
    memset(x, 0, sizeof x);
    /* row 0, block 0: amax 127/16, so d = 1/16 exactly (fp16 0x2C00) and x * 127/amax = 16 x */
    const float b0[9] = {7.9375f, 0.15625f, 0.21875f, -0.15625f, -0.03125f,
                         1.0f,    -7.9375f, 0.09375f, 0.1f};
    /* 2.5 -> 2 and -2.5 -> -2 (half to even; roundf would give 3 and -3), 3.5 -> 4, -0.5 -> -0,
     * 1.5 -> 2, 1.6000000238 -> 2 */
    memcpy(x, b0, sizeof b0);
    /* row 0, block 1: amax 1, d = 1/127 -> fp16 0x2008 = 0.00787353515625, x scaled by 127/amax
     * = 127 (not by 1/fp16(d) = 127.00775: 0x1.95264ep-1 * 127 = 100.4961 -> 100, with the fp16
     * reciprocal 100.5022 -> 101) */
    x[32] = -1.0f;
    x[33] = 0.5f;           /* 63.5 -> 64 */
    x[34] = 0x1.95264ep-1f;
    x[35] = 0.25f;          /* 31.75 -> 32 */
    /* row 1, block 0: all zero (d 0). block 1: amax 381 * 2^-24, d = 3 * 2^-24, an fp16
     * subnormal (0x0003), 127/amax = 5592405.5 in fp32 */
    x[96] = 0x1.7dp-16f;
    x[97] = -0x1.8p-17f;   /* -63.500004 -> -64 */
    x[98] = 0x1p-24f;      /* 0.33 -> 0 */
    static const uint8_t want[4][34] = {
        {0x00, 0x2C, 0x7F, 0x02, 0x04, 0xFE, 0x00, 0x10, 0x81, 0x02, 0x02},
        {0x08, 0x20, 0x81, 0x40, 0x64, 0x20},
        {0x00, 0x00},
        {0x03, 0x00, 0x7F, 0xC0, 0x00},
    };
    float dec[4 * 32];
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_Q8_0, want, 4 * 32, dec));
    float got[2 * 64];
    memcpy(got, x, sizeof x);
    mq_q8_0_act_qdq(got, 2, 64);
    for (int i = 0; i < 128; i++)
        if (!(got[i] == dec[i]))
            FAIL("value %d: %a, expected %a (from %a)", i, got[i], dec[i], x[i]);
    ASSERT_NEAR(0.125, got[1], 0);
    ASSERT_NEAR(-0.125, got[3], 0);
    ASSERT_NEAR(0.787353515625, got[34], 0);
    ASSERT_NEAR(-0x1.8p-17, got[97], 0);
    /* ggml's reference quantizer (roundf, the one moeq's Q8_0 weights follow) differs on the tie */
    uint8_t ref[34];
    mq_ggml_put_q8_0(ref, x);
    ASSERT_EQ_INT(3, (int8_t)ref[3]);
    ASSERT_EQ_INT(2, (int8_t)want[0][3]);

    /* rows are independent: the same rows one at a time give the same values */
    float one[64];
    for (int r = 0; r < 2; r++) {
        memcpy(one, x + 64 * r, sizeof one);
        mq_q8_0_act_qdq(one, 1, 64);
        ASSERT_TRUE(memcmp(one, got + 64 * r, sizeof one) == 0);
    }
    /* a tail block of 8 after a full one: amax 0.5, d = fp16(0.5/127) = 0x1C08, x * 254 */
    float t[40] = {0};
    t[32] = 0.5f;
    t[33] = 0.25f;   /* 63.5 -> 64 */
    mq_q8_0_act_qdq(t, 1, 40);
    ASSERT_NEAR(127 * 0.003936767578125, t[32], 0);
    ASSERT_NEAR(64 * 0.003936767578125, t[33], 0);
    ASSERT_NEAR(0, t[0], 0);
    /* a block with an infinity is left as it is */
    float inf[32] = {0};
    inf[0] = INFINITY;
    inf[1] = 0.3f;
    mq_q8_0_act_qdq(inf, 1, 32);
    ASSERT_TRUE(isinf(inf[0]) && inf[1] == 0.3f);
}

TEST_MAIN(T(test_e2m1_bit_vectors), T(test_e4m3_bit_vectors), T(test_e8m0_and_storage_rounding),
          T(test_nvfp4_ct_group_by_hand), T(test_nvfp4_mul_reference_convention),
          T(test_int4_sym_by_hand), T(test_int4_signed_by_hand), T(test_int4_asym_by_hand),
          T(test_mse_search_picks_grid_minimum), T(test_mse_search_matches_slow_search),
          T(test_candidates_rows),
          T(test_mse_weighted_by_hand), T(test_mse_sse_twin), T(test_rtn_tensor_and_dequant),
          T(test_pooled_absmax_and_finite), T(test_nan_inf_is_an_error_naming_the_position), T(test_spec_checks),
          T(test_packing_round_trips), T(test_activation_fake_quant),
          T(test_q8_0_activation_rounding))
