/* K-quant codecs (formats/kquant.h): hand-made blocks of Q4_K, Q6_K, Q3_K, Q5_0, IQ4_XS and IQ4_NL with every
 * byte and some values worked out by hand from ggml-common.h's layouts, pack/unpack round trips
 * of random blocks of every type decoded by io's independent decoders (gguf.c, ggml's
 * dequantize_row_* transcribed), and the scale search. */
#include <stdlib.h>

#include "formats/kquant.h"
#include "formats/cpu/simd.h"
#include "harness.h"
#include "io/gguf.h"

static uint32_t rng = 777;
static uint32_t rnd_u32(void) {
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng;
}
static float rnd_gauss(void) {
    double u = (rnd_u32() + 1.0) / 4294967297.0, v = (rnd_u32() + 1.0) / 4294967297.0;
    return (float)(sqrt(-2 * log(u)) * cos(6.283185307179586 * v));
}

/* The groups a block of type t has when its fp16 scales are d (dmin) and its multipliers mult
 * (mins): as the file holds them. */
static void groups_of(const mq_kq_info *t, float d, float dmin, const int *mult, const int *mins, mq_gparams *g) {
    for (int j = 0; j < t->block / t->sub; j++) {
        uint8_t c = t->mult_lo == -128 ? (uint8_t)(int8_t)mult[j] : t->mult_lo < 0 ? (uint8_t)(mult[j] + 32)
                                                                                     : (uint8_t)mult[j];
        g[j] = (mq_gparams){d * (float)mult[j], t->zero < 0 ? dmin * (float)mins[j] : 0.0f, c,
                            (uint8_t)(mins ? mins[j] : 0)};
    }
}

/* io's decoder (ggml's dequantize_row_*) of one block against the codec's values, bit for bit */
static void check_decodes(const mq_kq_info *t, const uint8_t *blk, const mq_gparams *g, const uint8_t *codes) {
    float a[256], b[256];
    ASSERT_OK(mq_ggml_dequantize(t->ggml_type, blk, t->block, a));
    mq_kq_dequant_row(t, g, codes, t->block, b);
    for (int i = 0; i < t->block; i++)
        if (memcmp(&a[i], &b[i], 4)) FAIL("%s value %d: ggml decodes %.9g, the codec %.9g", t->name, i, a[i], b[i]);
}

static void test_q4_k_by_hand(void) {
    const mq_kq_info *t = mq_kq_info_of(MQ_KQ_Q4_K);
    const int sc[8] = {1, 2, 3, 4, 5, 6, 7, 63}, mn[8] = {0, 1, 2, 3, 60, 61, 62, 63};
    mq_gparams g[8];
    groups_of(t, 0.5f, 0.25f, sc, mn, g);
    uint8_t codes[256], blk[144];
    for (int i = 0; i < 256; i++) codes[i] = (uint8_t)(i % 16);
    ASSERT_TRUE(mq_kq_pack_block(t, g, codes, blk));
    /* d 0.5 = f16 0x3800, dmin 0.25 = 0x3400, little endian */
    const uint8_t head[16] = {0x00, 0x38, 0x00, 0x34,
                              /* scales[0..3]: sc[j] | (sc[j+4] >> 4) << 6 */
                              0x01, 0x02, 0x03, 0xC4,
                              /* scales[4..7]: mn[j] | (mn[j+4] >> 4) << 6 */
                              0xC0, 0xC1, 0xC2, 0xC3,
                              /* scales[8..11]: (sc[j+4] & 15) | (mn[j+4] & 15) << 4 */
                              0xC5, 0xD6, 0xE7, 0xFF};
    for (int i = 0; i < 16; i++) ASSERT_EQ_HEX(head[i], blk[i]);
    /* qs[32 c + l]: value 64 c + l in the low nibble, 64 c + 32 + l in the high; both l % 16 */
    for (int k = 0; k < 128; k++) ASSERT_EQ_HEX(0x11 * ((k % 32) % 16), blk[16 + k]);
    float y[256];
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_Q4_K, blk, 256, y));
    ASSERT_EQ_INT(0, y[0] != 0.0f);                   /* 0.5*1*0 - 0.25*0 */
    ASSERT_NEAR(456.75, y[255], 0);                   /* 0.5*63*15 - 0.25*63 */
    ASSERT_NEAR(-10.0, y[130], 0);                    /* sub-block 4: 0.5*5*2 - 0.25*60 */
    check_decodes(t, blk, g, codes);
    mq_gparams g2[8];
    uint8_t c2[256];
    mq_kq_unpack_block(t, blk, g2, c2);
    ASSERT_EQ_INT(0, memcmp(c2, codes, 256));
    for (int j = 0; j < 8; j++) {
        ASSERT_EQ_INT(sc[j], g2[j].scale_code);
        ASSERT_EQ_INT(mn[j], g2[j].min_code);
        ASSERT_NEAR(g[j].scale, g2[j].scale, 0);
        ASSERT_NEAR(g[j].zero, g2[j].zero, 0);
    }
}

static void test_q6_k_by_hand(void) {
    const mq_kq_info *t = mq_kq_info_of(MQ_KQ_Q6_K);
    int sc[16];
    for (int j = 0; j < 16; j++) sc[j] = j - 8;
    mq_gparams g[16];
    groups_of(t, 0.125f, 0, sc, NULL, g);
    uint8_t codes[256], blk[210];
    for (int i = 0; i < 256; i++) codes[i] = (uint8_t)(i % 64);
    ASSERT_TRUE(mq_kq_pack_block(t, g, codes, blk));
    /* ql[64 h + k]: value 128 h + k (low nibble) and 128 h + k + 64 (high): both code k */
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 64; k++) ASSERT_EQ_HEX(0x11 * (k & 15), blk[64 * h + k]);
    /* qh[32 h + t]: the top 2 bits of values t, t+32, t+64, t+96: t/16, 2 + t/16, t/16, 2 + t/16 */
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 32; k++) ASSERT_EQ_HEX(k < 16 ? 0x88 : 0xDD, blk[128 + 32 * h + k]);
    for (int j = 0; j < 16; j++) ASSERT_EQ_HEX((uint8_t)(int8_t)(j - 8), blk[192 + j]);
    ASSERT_EQ_HEX(0x00, blk[208]);
    ASSERT_EQ_HEX(0x30, blk[209]);   /* 0.125 = f16 0x3000 */
    float y[256];
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_Q6_K, blk, 256, y));
    ASSERT_NEAR(32.0, y[0], 0);       /* 0.125 * -8 * (0 - 32) */
    ASSERT_NEAR(27.125, y[255], 0);   /* 0.125 * 7 * (63 - 32) */
    ASSERT_NEAR(-1.0, y[100], 0);     /* sub-block 6: 0.125 * -2 * (36 - 32) */
    check_decodes(t, blk, g, codes);
}

static void test_q3_k_by_hand(void) {
    const mq_kq_info *t = mq_kq_info_of(MQ_KQ_Q3_K);
    int mult[16];
    for (int j = 0; j < 16; j++) mult[j] = 4 * j + 1 - 32;   /* stored 6-bit value 4j + 1 */
    mq_gparams g[16];
    groups_of(t, 0.25f, 0, mult, NULL, g);
    uint8_t codes[256], blk[110];
    for (int i = 0; i < 256; i++) codes[i] = (uint8_t)(i % 8);
    ASSERT_TRUE(mq_kq_pack_block(t, g, codes, blk));
    /* hmask[t]: values t + 32 b all have code t % 8: its high bit in every bit or none */
    for (int k = 0; k < 32; k++) ASSERT_EQ_HEX(k % 8 >= 4 ? 0xFF : 0x00, blk[k]);
    /* qs: the low 2 bits (t % 4) at all four shifts */
    for (int k = 0; k < 64; k++) ASSERT_EQ_HEX(0x55 * ((k % 32) % 4), blk[32 + k]);
    /* scales: low nibbles of 4j+1 (j < 8 low half, j >= 8 high half), then the top 2 bits */
    const uint8_t sc[12] = {0x11, 0x55, 0x99, 0xDD, 0x11, 0x55, 0x99, 0xDD, 0xE4, 0xE4, 0xE4, 0xE4};
    for (int k = 0; k < 12; k++) ASSERT_EQ_HEX(sc[k], blk[96 + k]);
    ASSERT_EQ_HEX(0x00, blk[108]);
    ASSERT_EQ_HEX(0x34, blk[109]);
    float y[256];
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_Q3_K, blk, 256, y));
    ASSERT_NEAR(31.0, y[0], 0);     /* 0.25 * -31 * (0 - 4) */
    ASSERT_NEAR(21.75, y[255], 0);  /* 0.25 * 29 * (7 - 4) */
    ASSERT_NEAR(-3.75, y[77], 0);   /* sub-block 4: 0.25 * -15 * (5 - 4) */
    check_decodes(t, blk, g, codes);
}

static void test_q5_0_by_hand(void) {
    const mq_kq_info *t = mq_kq_info_of(MQ_KQ_Q5_0);
    mq_gparams g = {-2.0f, 0.0f, 1, 0};
    uint8_t codes[32], blk[22];
    for (int i = 0; i < 32; i++) codes[i] = (uint8_t)i;
    ASSERT_TRUE(mq_kq_pack_block(t, &g, codes, blk));
    const uint8_t head[6] = {0x00, 0xC0, 0x00, 0x00, 0xFF, 0xFF};   /* d -2 = 0xC000; qh bits 16..31 */
    for (int i = 0; i < 6; i++) ASSERT_EQ_HEX(head[i], blk[i]);
    for (int j = 0; j < 16; j++) ASSERT_EQ_HEX(0x11 * j, blk[6 + j]);
    float y[32];
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_Q5_0, blk, 32, y));
    ASSERT_NEAR(32.0, y[0], 0);
    ASSERT_NEAR(-30.0, y[31], 0);
    check_decodes(t, blk, &g, codes);
}

/* IQ4_XS: scales_l's nibbles (even sub-blocks low), scales_h's 2-bit pairs, the codes' nibbles
 * (the first 16 values of a sub-block low) and values d * (ls - 32) * kvalues_iq4nl[code]. */
static void test_iq4_xs_by_hand(void) {
    const mq_kq_info *t = mq_kq_info_of(MQ_KQ_IQ4_XS);
    const int ls[8] = {0, 17, 33, 48, 63, 32, 1, 47};   /* stored; mult = ls - 32 */
    int mult[8];
    for (int j = 0; j < 8; j++) mult[j] = ls[j] - 32;
    mq_gparams g[8];
    groups_of(t, 0.5f, 0, mult, NULL, g);
    uint8_t codes[256], blk[136];
    for (int i = 0; i < 256; i++) codes[i] = i % 32 < 16 ? 3 : 12;
    ASSERT_TRUE(mq_kq_pack_block(t, g, codes, blk));
    /* d 0.5 = 0x3800; scales_h: pairs 0,1,2,3,3,2,0,2 from bit 0 = 0x8BE4; scales_l: low nibbles
     * 0,1 | 1,0 | 15,0 | 1,15 */
    const uint8_t head[8] = {0x00, 0x38, 0xE4, 0x8B, 0x10, 0x01, 0x0F, 0xF1};
    for (int i = 0; i < 8; i++) ASSERT_EQ_HEX(head[i], blk[i]);
    for (int k = 0; k < 128; k++) ASSERT_EQ_HEX(0xC3, blk[8 + k]);
    float y[256];
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_IQ4_XS, blk, 256, y));
    ASSERT_NEAR(1040.0, y[0], 0);          /* 0.5 * -32 * -65 */
    ASSERT_NEAR(-397.5, y[48], 0);         /* sub-block 1, second half: 0.5 * -15 * 53 */
    ASSERT_NEAR(821.5, y[4 * 32 + 20], 0); /* 0.5 * 31 * 53 */
    ASSERT_NEAR(0.0, y[5 * 32 + 3], 0);    /* ls 32: multiplier 0 */
    ASSERT_NEAR(-487.5, y[7 * 32 + 1], 0);  /* 0.5 * 15 * -65 */
    check_decodes(t, blk, g, codes);
    mq_gparams g2[8];
    uint8_t c2[256];
    mq_kq_unpack_block(t, blk, g2, c2);
    ASSERT_EQ_INT(0, memcmp(c2, codes, 256));
    for (int j = 0; j < 8; j++) {
        ASSERT_EQ_INT(ls[j], g2[j].scale_code);
        ASSERT_NEAR(g[j].scale, g2[j].scale, 0);
    }
}

/* IQ4_NL: Q4_0's nibble order with the table's values. */
static void test_iq4_nl_by_hand(void) {
    const mq_kq_info *t = mq_kq_info_of(MQ_KQ_IQ4_NL);
    mq_gparams g = {-0.25f, 0.0f, 1, 0};
    uint8_t codes[32], blk[18];
    for (int i = 0; i < 32; i++) codes[i] = (uint8_t)(i < 16 ? i : 31 - i);
    ASSERT_TRUE(mq_kq_pack_block(t, &g, codes, blk));
    ASSERT_EQ_HEX(0x00, blk[0]);
    ASSERT_EQ_HEX(0xB4, blk[1]);   /* -0.25 = f16 0xB400 */
    for (int j = 0; j < 16; j++) ASSERT_EQ_HEX(j | (15 - j) << 4, blk[2 + j]);
    float y[32];
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_IQ4_NL, blk, 32, y));
    ASSERT_NEAR(31.75, y[0], 0);    /* -0.25 * -127 */
    ASSERT_NEAR(-28.25, y[16], 0);  /* -0.25 * 113 */
    ASSERT_NEAR(-9.5, y[20], 0);    /* code 11: -0.25 * 38 */
    check_decodes(t, blk, &g, codes);
}

/* Rounding to the table: the nearest value of x / step, a tie to the lower, clamped at the ends,
 * negative steps mirrored, step 0 the code of value 1 (nearest 0). */
static void test_iq4_rounding(void) {
    const mq_kq_info *t = mq_kq_info_of(MQ_KQ_IQ4_NL);
    const float x[8] = {0.0f, -4.5f, 200.0f, -115.5f, 100.0f, -300.0f, 13.2f, 101.5f};
    const uint8_t want[8] = {8, 7, 15, 0, 14, 0, 9, 15};
    uint8_t c[8];
    float dq[8];
    mq_kq_qdq(t, 1.0f, 0.0f, x, 8, c, dq);
    for (int i = 0; i < 8; i++) {
        ASSERT_EQ_INT(want[i], c[i]);
        ASSERT_NEAR((double)mq_kq_iq4_table[want[i]], dq[i], 0);
    }
    const float y = 20.0f;
    mq_kq_qdq(t, -2.0f, 0.0f, &y, 1, c, dq);
    ASSERT_EQ_INT(7, c[0]);   /* 20 / -2 = -10 */
    ASSERT_NEAR(20.0, dq[0], 0);
    mq_kq_qdq(t, 0.0f, 0.0f, &y, 1, c, dq);
    ASSERT_EQ_INT(8, c[0]);
    ASSERT_NEAR(0.0, dq[0], 0);
}

/* Random fp16 scales, multipliers and codes of every type: pack -> the same groups and codes
 * unpacked, and ggml's decoder gives the codec's values. */
static void test_random_round_trips(void) {
    for (int ty = 0; ty < MQ_KQ_COUNT; ty++) {
        const mq_kq_info *t = mq_kq_info_of((mq_kq_type)ty);
        for (int rep = 0; rep < 200; rep++) {
            const float d = mq_f16_to_f32(mq_f32_to_f16(rnd_gauss() * 0.01f));
            const float dmin = mq_f16_to_f32(mq_f32_to_f16(fabsf(rnd_gauss()) * 0.01f));
            int mult[16], mins[16];
            for (int j = 0; j < 16; j++) {
                mult[j] = t->mult_hi ? t->mult_lo + (int)(rnd_u32() % (uint32_t)(t->mult_hi - t->mult_lo + 1)) : 1;
                mins[j] = t->min_hi ? (int)(rnd_u32() % 64) : 0;
            }
            mq_gparams g[16];
            groups_of(t, d, dmin, mult, mins, g);
            if (!t->mult_hi && t->zero < 0) g[0].zero = -mq_f16_to_f32(mq_f32_to_f16(rnd_gauss()));   /* Q5_1's m */
            uint8_t codes[256], blk[256], c2[256];
            for (int i = 0; i < t->block; i++) codes[i] = (uint8_t)(t->qmin + rnd_u32() % (uint32_t)(t->qmax - t->qmin + 1));
            if (!mq_kq_pack_block(t, g, codes, blk)) FAIL("%s: block %d does not pack", t->name, rep);
            mq_gparams g2[16];
            mq_kq_unpack_block(t, blk, g2, c2);
            ASSERT_EQ_INT(0, memcmp(c2, codes, (size_t)t->block));
            for (int j = 0; j < t->block / t->sub; j++) {
                ASSERT_NEAR(g[j].scale, g2[j].scale, 0);
                ASSERT_NEAR(g[j].zero, g2[j].zero, 0);
                if (t->mult_hi) ASSERT_EQ_INT(g[j].scale_code, g2[j].scale_code);
                if (t->min_hi) ASSERT_EQ_INT(g[j].min_code, g2[j].min_code);
            }
            check_decodes(t, blk, g, codes);
            uint8_t blk2[256];   /* unpack -> pack: the same bytes */
            ASSERT_TRUE(mq_kq_pack_block(t, g2, c2, blk2));
            ASSERT_EQ_INT(0, memcmp(blk, blk2, (size_t)t->bytes));
        }
    }
}

/* Groups that imply no single fp16 d (or dmin), or codes out of range, do not pack. */
static void test_pack_refuses(void) {
    const mq_kq_info *t = mq_kq_info_of(MQ_KQ_Q4_K);
    int sc[8] = {1, 2, 3, 4, 5, 6, 7, 8}, mn[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    mq_gparams g[8];
    uint8_t codes[256] = {0}, blk[144];
    groups_of(t, 0.5f, 0.25f, sc, mn, g);
    ASSERT_TRUE(mq_kq_pack_block(t, g, codes, blk));
    g[3].scale = 0.5f * 4.0f + 0x1p-10f;   /* sub-block 3 on another d */
    ASSERT_FALSE(mq_kq_pack_block(t, g, codes, blk));
    groups_of(t, 0.1f, 0.25f, sc, mn, g);   /* 0.1 is no fp16 */
    ASSERT_FALSE(mq_kq_pack_block(t, g, codes, blk));
    groups_of(t, 0.5f, 0.25f, sc, mn, g);
    codes[9] = 16;
    ASSERT_FALSE(mq_kq_pack_block(t, g, codes, blk));
}

static double sse(const float *a, const float *b, int n, const float *w) {
    double e = 0;
    for (int i = 0; i < n; i++) e += (w ? w[i] : 1.0) * ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    return e;
}

/* The fitted rows pack and decode to what the codec says; the search on the exact grid is never
 * worse than ggml's one-shot rounding (up to the grid's own multiplier 1 not being exactly 1),
 * weights move the error where they are large, and bits per weight are the layouts'. */
static void test_fit(void) {
    const double bpw[MQ_KQ_COUNT] = {3.4375, 4.5, 5.5, 6.5625, 5.5, 6.0, 8.5, 4.5, 4.5, 4.25};
    for (int ty = 0; ty < MQ_KQ_COUNT; ty++) {
        const mq_kq_info *t = mq_kq_info_of((mq_kq_type)ty);
        ASSERT_NEAR(bpw[ty], mq_kq_bpw((mq_kq_type)ty), 0);
        enum { N = 1024 };
        float x[N], w[N], yp[N], ym[N], yw[N];
        for (int i = 0; i < N; i++) {
            x[i] = rnd_gauss() * (i % 97 == 0 ? 4.0f : 1.0f) * 0.02f + (ty == MQ_KQ_Q5_1 ? 0.01f : 0.0f);
            w[i] = i % 7 == 0 ? 50.0f : 1.0f;
        }
        mq_gparams g[N / 16];
        uint8_t c[N], blk[N / 32 * 34];   /* the largest: Q8_0 */
        mq_qspec plain = mq_kq_spec((mq_kq_type)ty), mse = plain;
        mse.mse = true;
        double e[3];
        const mq_qspec *sp[3] = {&plain, &mse, &mse};
        float *ys[3] = {yp, ym, yw};
        for (int k = 0; k < 3; k++) {
            mq_kq_quantize_row(t, sp[k], x, N, k == 2 ? w : NULL, g, c);
            mq_kq_dequant_row(t, g, c, N, ys[k]);
            for (int b = 0; b < N / t->block; b++)
                if (!mq_kq_pack_block(t, g + b * (t->block / t->sub), c + b * t->block, blk + b * t->bytes))
                    FAIL("%s: fitted block %d does not pack", t->name, b);
            float dec[N];
            ASSERT_OK(mq_ggml_dequantize(t->ggml_type, blk, N, dec));
            ASSERT_EQ_INT(0, memcmp(dec, ys[k], sizeof dec));
            e[k] = sse(x, ys[k], N, NULL);
        }
        if (!(e[1] <= e[0] * 1.001)) FAIL("%s: the search's error %.6g above the plain fit's %.6g", t->name, e[1], e[0]);
        if (!(sse(x, yw, N, w) <= sse(x, ym, N, w))) FAIL("%s: weights did not lower the weighted error", t->name);
        /* a sane quantizer: relative error of the order 2^-bits */
        const double rel = sqrt(e[1] / sse(x, (float[N]){0}, N, NULL));
        if (!(rel < pow(2.0, -(double)mq_kq_bpw((mq_kq_type)ty) + 3.0)))
            FAIL("%s: relative error %.4g", t->name, rel);
    }
}

/* quantize_row_q8_K_ref of ggml-quants.c, transcribed (nearest_int's magic-number rounding),
 * then d * q: what llama.cpp's K-quant dot products see of an activation. */
static void ref_q8_k(const float *x, float *y) {
    float max = 0, amax = 0;
    for (int j = 0; j < 256; ++j) {
        float ax = fabsf(x[j]);
        if (ax > amax) {
            amax = ax;
            max = x[j];
        }
    }
    if (!amax) {
        for (int j = 0; j < 256; ++j) y[j] = 0;
        return;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < 256; ++j) {
        float val = iscale * x[j] + 12582912.f;
        int i;
        memcpy(&i, &val, sizeof i);
        int v = (i & 0x007fffff) - 0x00400000;
        v = v < 127 ? v : 127;
        y[j] = (1 / iscale) * (float)v;
    }
}

static void test_q8_k_activations(void) {
    enum { R = 6, C = 512 };
    static float x[R * C], want[R * C];
    for (int i = 0; i < R * C; i++) x[i] = rnd_gauss() * (i % 211 == 0 ? 20.0f : 1.0f) * (i < C ? 1e-3f : 1.0f);
    for (int j = 0; j < 256; j++) x[2 * C + j] = 0;                           /* an all-zero block */
    x[3 * C + 7] = -40.0f;                                                     /* a negative max */
    for (int j = 0; j < 256; j++) x[4 * C + 256 + j] = (float)(j - 128) * 0.5f; /* ties: iscale*x = k + 1/2 */
    for (int i = 0; i < R * C; i += 256) ref_q8_k(x + i, want + i);
    float *got = malloc(sizeof x);
    memcpy(got, x, sizeof x);
    mq_q8_k_act_qdq(got, R, C);
    for (int i = 0; i < R * C; i++)
        if (memcmp(&got[i], &want[i], 4)) FAIL("value %d: %.9g, ggml's %.9g (x %.9g)", i, got[i], want[i], x[i]);
    float inf[256] = {0};   /* a block with an infinity is left as it is */
    inf[3] = INFINITY;
    inf[4] = 2.0f;
    mq_q8_k_act_qdq(inf, 1, 256);
    ASSERT_NEAR(2.0, inf[4], 0);
    free(got);
}

static void test_names(void) {
    mq_kq_type t;
    ASSERT_TRUE(mq_kq_parse("q4_k", &t));
    ASSERT_EQ_INT(MQ_KQ_Q4_K, t);
    ASSERT_TRUE(mq_kq_parse("Q6_K", &t));
    ASSERT_EQ_INT(MQ_KQ_Q6_K, t);
    ASSERT_TRUE(mq_kq_parse("q8_0", &t));
    ASSERT_EQ_INT(MQ_KQ_Q8_0, t);
    ASSERT_FALSE(mq_kq_parse("q4_k_m", &t));
    ASSERT_FALSE(mq_kq_parse("q4", &t));
    ASSERT_TRUE(mq_kq_of_ggml(11, &t));
    ASSERT_EQ_INT(MQ_KQ_Q3_K, t);
    for (int ty = 0; ty < MQ_KQ_COUNT; ty++) {   /* io's type table agrees on every size */
        const mq_kq_info *k = mq_kq_info_of((mq_kq_type)ty);
        int64_t blk;
        size_t bb;
        const char *name;
        ASSERT_TRUE(mq_ggml_type_info(k->ggml_type, &name, &blk, &bb));
        ASSERT_EQ_STR(k->name, name);
        ASSERT_EQ_INT(k->block, blk);
        ASSERT_EQ_INT(k->bytes, (int64_t)bb);
    }
}

/* The AVX2 scoring of candidate grids is bit-identical to the scalar reference, for every type
 * (asymmetric, symmetric with signed steps, Q8_0's codes from 1, IQ4's tables), candidate counts
 * that fill 1 to 4 vectors partly and more, zero steps, values far off the grid (clamped codes),
 * strides, weights or none. */
static void test_sse_twin(void) {
    if (!mq_cpu_has_avx2_fma()) SKIP("no AVX2+FMA");
    enum { NC = 70 };
    static float x[64 * 3], w[64], step[NC + 8], off[NC + 8];
    static double a[NC + 8], b[NC + 8];
    for (int tr = 0; tr < 800; tr++) {
        const mq_kq_info *t = mq_kq_info_of((mq_kq_type)(tr % MQ_KQ_COUNT));
        const int nc = 1 + (tr * 7) % NC, n = 1 + tr % 64, stride = 1 + tr % 3;
        for (int i = 0; i < n * stride; i++) x[i] = rnd_gauss() * 0.02f * (i % 13 == 0 ? 8.0f : 1.0f);
        for (int i = 0; i < n; i++) w[i] = (float)(rnd_u32() % 1000) / 250.0f;
        for (int c = 0; c < nc + 8; c++) {
            const float sc = 0.02f / (float)(t->qmax + 1) * (0.3f + (float)(rnd_u32() % 1000) / 400.0f);
            step[c] = t->zero >= 0 && c % 3 == 1 ? -sc : sc;   /* signed steps on symmetric grids */
            off[c] = t->zero < 0 ? sc * (float)(rnd_u32() % 12) : 0.0f;
            if (c % 11 == 4) step[c] = 0;
        }
        const float *wp = tr % 2 ? w : NULL;
        mq_kq_sse_ref(t, step, off, nc, x, n, stride, wp, a);
#if MQ_TEST_X86
        mq_kq_sse_avx2(t, step, off, nc, x, n, stride, wp, b);
#else
        memcpy(b, a, sizeof(double) * (size_t)nc);   /* unreachable: skipped without AVX2 */
#endif
        for (int c = 0; c < nc; c++)
            if (memcmp(&a[c], &b[c], sizeof(double)) != 0)
                FAIL("trial %d %s candidate %d: ref %.17g, avx2 %.17g", tr, t->name, c, a[c], b[c]);
    }
}

/* The AVX2 trials of the asymmetric sub-block fit are bit-identical to the scalar reference
 * (every output of the trials with D > 0), with and without weights and the clamp, strided, for
 * trial counts that fill 1 to 3 vectors partly and more, and values all of one sign. */
static void test_asym_trials_twin(void) {
    if (!mq_cpu_has_avx2_fma()) SKIP("no AVX2+FMA");
    enum { NT = 40 };
    static float x[64 * 3], w[64], is[NT], D[2][NT], sc[2][NT], mn[2][NT];
    static double e[2][NT];
    int checked = 0;
    for (int tr = 0; tr < 600; tr++) {
        const int n = 2 + tr % 63, stride = 1 + tr % 3, nt = 1 + (tr * 5) % NT, nmax = tr % 3 ? 15 : 31;
        const float shift = tr % 4 == 0 ? 0.05f : 0.0f;   /* all positive: the clamp's case */
        for (int i = 0; i < n * stride; i++) x[i] = rnd_gauss() * 0.02f + shift;
        for (int i = 0; i < n; i++) w[i] = (float)(rnd_u32() % 1000) / 250.0f;
        const float *wp = tr % 2 ? w : NULL;
        mq_kq_sums s = {x[0], 0, 0, nmax, tr % 3 != 2};
        for (int i = 0; i < n; i++) {
            const float v = x[i * stride], wi = wp ? wp[i] : 1.0f;
            s.min = v < s.min ? v : s.min;
            s.sum_w += wi;
            s.sum_x += wi * v;
        }
        if (s.clamp && s.min > 0) s.min = 0;
        for (int k = 0; k < nt; k++) is[k] = ((float)nmax - 1.0f + 0.1f * (float)(k % 21)) / 0.1f;
        mq_kq_asym_trials_ref(x, n, stride, wp, &s, is, nt, D[0], sc[0], mn[0], e[0]);
#if MQ_TEST_X86
        mq_kq_asym_trials_avx2(x, n, stride, wp, &s, is, nt, D[1], sc[1], mn[1], e[1]);
#endif
        for (int k = 0; k < nt; k++) {
            if (memcmp(&D[0][k], &D[1][k], sizeof(float))) FAIL("trial %d/%d: D %.9g vs %.9g", tr, k, D[0][k], D[1][k]);
            if (!(D[0][k] > 0)) continue;
            checked++;
            if (memcmp(&sc[0][k], &sc[1][k], sizeof(float)) || memcmp(&mn[0][k], &mn[1][k], sizeof(float)) ||
                memcmp(&e[0][k], &e[1][k], sizeof(double)))
                FAIL("trial %d/%d: ref %.9g %.9g %.17g, avx2 %.9g %.9g %.17g", tr, k, sc[0][k], mn[0][k],
                     e[0][k], sc[1][k], mn[1][k], e[1][k]);
        }
    }
    ASSERT_TRUE(checked > 1000);
}

/* The AVX2 trials of the symmetric sub-block fit are bit-identical to the scalar reference, for
 * Q3_K's and Q6_K's code ranges, with and without weights, strided, codes clamped at both ends. */
static void test_sym_trials_twin(void) {
    if (!mq_cpu_has_avx2_fma()) SKIP("no AVX2+FMA");
    enum { NT = 40 };
    static float x[64 * 3], w[64], is[NT], a[2][NT], b[2][NT];
    for (int tr = 0; tr < 600; tr++) {
        const int n = 1 + tr % 64, stride = 1 + tr % 3, nt = 1 + (tr * 5) % NT, nmax = tr % 2 ? 4 : 32;
        for (int i = 0; i < n * stride; i++) x[i] = rnd_gauss() * 0.02f;
        for (int i = 0; i < n; i++) w[i] = (float)(rnd_u32() % 1000) / 250.0f;
        const float *wp = tr % 3 ? w : NULL;
        /* around nmax / 0.04: the largest values clamped on both sides */
        for (int k = 0; k < nt; k++) is[k] = -((float)nmax + 0.1f * (float)(k % 19 - 9)) / (0.04f * (tr % 4 ? 1 : -1));
        mq_kq_sym_trials_ref(x, n, stride, wp, nmax, is, nt, a[0], a[1]);
#if MQ_TEST_X86
        mq_kq_sym_trials_avx2(x, n, stride, wp, nmax, is, nt, b[0], b[1]);
#endif
        for (int k = 0; k < nt; k++)
            if (memcmp(&a[0][k], &b[0][k], sizeof(float)) || memcmp(&a[1][k], &b[1][k], sizeof(float)))
                FAIL("trial %d/%d: ref %.9g %.9g, avx2 %.9g %.9g", tr, k, a[0][k], a[1][k], b[0][k], b[1][k]);
    }
}

/* Values that test a table grid's rounding at its edges for steps step[0..nsteps): for each
 * step, a tie at every midpoint between neighbouring table values (x / step exactly the
 * midpoint: the steps are powers of two), each side of it by one ulp, 0 and -0, subnormals,
 * values beyond either end, huge ones whose quotient overflows to infinity, and FLT_MAX. The
 * rest random. Returns how many values it set (at most cap). */
static int table_edge_values(const float *steps, int nsteps, float *x, int cap) {
    const int8_t *tab = mq_kq_iq4_table;
    int n = 0;
    for (int s = 0; s < nsteps && n + 40 <= cap; s++)
        for (int m = 0; m < 15; m++) {
            const float mid = 0.5f * (float)(tab[m] + tab[m + 1]) * steps[s];
            x[n++] = mid;
            if (m % 2 == 0) x[n++] = nextafterf(mid, (m % 4 ? 1.0f : -1.0f) * INFINITY);
        }
    const float special[] = {0.0f, -0.0f, 1e-40f, -1e-42f, 500.0f, -500.0f, 1e30f, -1e30f, 3.4e38f, -3.4e38f,
                             127.0f, -127.0f, 113.0f};
    for (size_t i = 0; i < sizeof special / sizeof *special && n < cap; i++) x[n++] = special[i];
    while (n < cap) x[n++] = rnd_gauss() * 40.0f;
    return n;
}

/* The SIMD scorers of the table types (AVX2; AVX-512 where the CPU has it) are bit-identical to
 * the scalar reference at the table's edges (table_edge_values: ties, zeros, huge values),
 * signed steps and zero steps (+0 and -0), every candidate count that leaves a partial vector,
 * strides, weights or none; the values are shuffled so each call sees a different mix. A tie's
 * two codes have the same error, so which one a kernel takes shows in the trials' sums
 * (test_table_trials_twin), not here. */
static void test_table_sse_twin(void) {
    if (!mq_cpu_has_avx2_fma()) SKIP("no AVX2+FMA");
    enum { NC = 72, NX = 256 };
    static float x[NX * 2], xs[NX * 2], w[NX], step[NC + 8], off[NC + 8];   /* off: 0, no offsets */
    static double a[NC + 8], b[NC + 8];
    const float base[] = {1.0f, 0.25f, -0.5f, 2.0f, 1.0f / 1024, -4.0f, 0.0f, -0.0f, 1e-30f, -1e-38f};
    const int nb = (int)(sizeof base / sizeof *base);
    const int nx = table_edge_values(base, 6, x, NX);
    int ties = 0;
    for (int i = 0; i < nx; i++)
        for (int m = 0; m < 15; m++) ties += x[i] == 0.5f * (float)(mq_kq_iq4_table[m] + mq_kq_iq4_table[m + 1]);
    ASSERT_TRUE(ties >= 15);   /* the step-1 ties at least */
    for (int tr = 0; tr < 400; tr++) {
        const mq_kq_info *t = mq_kq_info_of(tr % 2 ? MQ_KQ_IQ4_XS : MQ_KQ_IQ4_NL);
        const int nc = 1 + (tr * 5) % NC, n = 1 + (tr * 37) % 96, stride = 1 + tr % 2;
        for (int i = 0; i < n * stride; i++) xs[i] = x[rnd_u32() % (uint32_t)nx];
        for (int i = 0; i < n; i++) w[i] = (float)(rnd_u32() % 1000) / 250.0f;
        for (int c = 0; c < nc + 8; c++)
            step[c] = c < nb && tr % 3 == 0 ? base[c] : base[rnd_u32() % (uint32_t)nb] * (c % 2 ? 1.0f : 1.5f);
        const float *wp = tr % 4 < 2 ? w : NULL;
        mq_kq_sse_ref(t, step, off, nc, xs, n, stride, wp, a);
        for (int isa = 0; isa < 2; isa++) {
            if (isa && !mq_cpu_has_avx512()) break;
            memset(b, 0xff, sizeof b);
#if MQ_TEST_X86
            if (isa) mq_kq_sse_table_avx512(t, step, nc, xs, n, stride, wp, b);
            else mq_kq_sse_avx2(t, step, off, nc, xs, n, stride, wp, b);
#endif
            for (int c = 0; c < nc; c++)
                if (memcmp(&a[c], &b[c], sizeof(double)) != 0)
                    FAIL("trial %d %s candidate %d (step %g) %s: ref %.17g, simd %.17g", tr, t->name, c, step[c],
                         isa ? "avx512" : "avx2", a[c], b[c]);
            for (int c = nc; c < (nc + 7) / 8 * 8 && isa; c++)   /* masked lanes leave the tail */
                ASSERT_TRUE(b[c] != b[c]);
        }
    }
}

/* The table fit's SIMD trials (AVX2; AVX-512 where the CPU has it) are bit-identical to the
 * scalar reference: the fit's own inverse scales (both ends of the table) and ones that put
 * values exactly on midpoints, at edge values, every trial count up to 3 vectors of 16 and a
 * partial one, strides, weights or none. */
static void test_table_trials_twin(void) {
    if (!mq_cpu_has_avx2_fma()) SKIP("no AVX2+FMA");
    enum { NT = 56, NX = 128 };
    static float x[NX * 3], xs[NX * 3], w[NX], is[NT], ref[2][NT], simd[2][NT];
    const float steps[] = {1.0f, 0.5f, 4.0f};
    const int nx = table_edge_values(steps, 3, x, NX);
    for (int tr = 0; tr < 400; tr++) {
        const int n = 1 + (tr * 13) % 64, stride = 1 + tr % 3, nt = 1 + (tr * 7) % NT;
        for (int i = 0; i < n * stride; i++) xs[i] = x[rnd_u32() % (uint32_t)nx] * 0.01f;
        for (int i = 0; i < n; i++) w[i] = (float)(rnd_u32() % 1000) / 250.0f;
        const float *wp = tr % 2 ? w : NULL;
        for (int k = 0; k < nt; k++) {
            const int e = k % 2, kk = k % 17 - 8;   /* fit_table's trials */
            is[k] = tr % 3 == 0 ? (float)(1 << (k % 8)) * 100.0f
                                : 1.0f / (0.5f / ((float)(e ? mq_kq_iq4_table[15] : mq_kq_iq4_table[0]) + (float)kk));
        }
        mq_kq_table_trials_ref(mq_kq_iq4_table, xs, n, stride, wp, is, nt, ref[0], ref[1]);
        for (int isa = 0; isa < 2; isa++) {
            if (isa && !mq_cpu_has_avx512()) break;
#if MQ_TEST_X86
            if (isa) mq_kq_table_trials_avx512(mq_kq_iq4_table, xs, n, stride, wp, is, nt, simd[0], simd[1]);
            else mq_kq_table_trials_avx2(mq_kq_iq4_table, xs, n, stride, wp, is, nt, simd[0], simd[1]);
#endif
            for (int k = 0; k < nt; k++)
                if (memcmp(&ref[0][k], &simd[0][k], sizeof(float)) || memcmp(&ref[1][k], &simd[1][k], sizeof(float)))
                    FAIL("trial %d/%d %s: ref %.9g %.9g, simd %.9g %.9g", tr, k, isa ? "avx512" : "avx2",
                         ref[0][k], ref[1][k], simd[0][k], simd[1][k]);
        }
    }
}

/* The AVX2 rounding to a table (mq_kq_qdq_table_avx2, which mq_kq_qdq and mq_kq_qdq_column
 * call for IQ4) gives the scalar reference's codes and values bit for bit: at ties (where the
 * lower code must win), zeros, huge values and subnormals, with one step and with a step per
 * value (0, -0, negative, tiny among them), counts with and without a tail left to the scalar,
 * codes or values alone. */
static void test_table_qdq_twin(void) {
    if (!mq_cpu_has_avx2_fma()) SKIP("no AVX2+FMA");
    enum { NX = 200 };
    static float x[NX], xs[NX], st[NX], dq[3][NX];
    static uint8_t code[3][NX];
    const float steps[] = {1.0f, -0.5f, 2.0f, 0.0f, -0.0f, 1.0f / 1024, 1e-38f};
    const int ns = (int)(sizeof steps / sizeof *steps), nx = table_edge_values(steps, 3, x, NX);
    const mq_kq_info *t = mq_kq_info_of(MQ_KQ_IQ4_XS);
    int lower_ties = 0;
    for (int tr = 0; tr < 300; tr++) {
        const int n = 1 + (tr * 11) % NX, per = tr % 2;
        for (int i = 0; i < n; i++) {
            xs[i] = tr < 2 ? x[i % nx] : x[rnd_u32() % (uint32_t)nx];
            st[i] = tr < 2 ? 1.0f : steps[rnd_u32() % (uint32_t)ns];
        }
        const float s1 = tr < 2 ? 1.0f : steps[tr % ns];
        for (int run = 0; run < 2; run++) {   /* the reference, then the dispatch (AVX2) */
            moeq_set_force_ref(run == 0);
            if (per) mq_kq_qdq_column(t, st, st /* offsets: unused by a table */, xs, n, code[run], dq[run]);
            else mq_kq_qdq(t, s1, 0.0f, xs, n, code[run], dq[run]);
        }
        moeq_set_force_ref(0);
        memset(code[2], 0xff, sizeof code[2]);
        int64_t m = 0;
#if MQ_TEST_X86
        m = mq_kq_qdq_table_avx2(t->table, per ? st : &s1, per, xs, n, code[2], NULL);
        ASSERT_EQ_INT(n / 8 * 8, (int)m);
        ASSERT_EQ_INT(n / 8 * 8, (int)mq_kq_qdq_table_avx2(t->table, per ? st : &s1, per, xs, n, NULL, dq[2]));
#endif
        for (int i = 0; i < n; i++) {
            if (code[0][i] != code[1][i] || memcmp(&dq[0][i], &dq[1][i], sizeof(float)))
                FAIL("trial %d value %d (x %g, step %g): ref %d %g, simd %d %g", tr, i, xs[i], per ? st[i] : s1,
                     code[0][i], dq[0][i], code[1][i], dq[1][i]);
            if (i < m && (code[0][i] != code[2][i] || memcmp(&dq[0][i], &dq[2][i], sizeof(float))))
                FAIL("trial %d value %d: the kernel alone %d %g, ref %d %g", tr, i, code[2][i], dq[2][i],
                     code[0][i], dq[0][i]);
            if (i >= m && code[2][i] != 0xff) FAIL("trial %d: the kernel wrote code %d past %d", tr, i, (int)m);
            const float q = (per ? st[i] : s1) != 0.0f ? xs[i] / (per ? st[i] : s1) : 0.0f;
            for (int k = 0; k < 15; k++)   /* a tie: the lower code */
                if (q == 0.5f * (float)(t->table[k] + t->table[k + 1])) {
                    ASSERT_EQ_INT(k, code[1][i]);
                    lower_ties++;
                }
        }
    }
    ASSERT_TRUE(lower_ties >= 15);
}

static bool same_groups(const mq_gparams *a, const mq_gparams *b) {
    return !memcmp(&a->scale, &b->scale, sizeof(float)) && !memcmp(&a->zero, &b->zero, sizeof(float)) &&
           a->scale_code == b->scale_code && a->min_code == b->min_code;
}

/* The block search gives the same groups with the SIMD scorers (AVX-512's where the CPU has it,
 * and AVX2's) as with the scalar reference (MOEQ_FORCE_REF's switch), for every type, with and
 * without weights, strided. */
static void test_fit_simd_same(void) {
    if (!mq_cpu_has_avx2_fma()) SKIP("no AVX2+FMA");
    enum { N = 512, ST = 3 };
    static float x[N * ST], w[N];
    for (int i = 0; i < N * ST; i++) x[i] = rnd_gauss() * 0.02f * (i % 37 == 0 ? 5.0f : 1.0f);
    for (int i = 0; i < N; i++) w[i] = 0.5f + (float)(rnd_u32() % 100) / 20.0f;
    for (int ty = 0; ty < MQ_KQ_COUNT; ty++) {
        const mq_kq_info *t = mq_kq_info_of((mq_kq_type)ty);
        mq_qspec s = mq_kq_spec((mq_kq_type)ty);
        s.mse = true;
        for (int k = 0; k < 2; k++) {
            mq_gparams g[3][16];
            float d[3], dmin[3];
            mq_gparams gs[3] = {{0}};
            for (int run = 0; run < 3; run++) {   /* SIMD, the reference, AVX2 alone */
                moeq_set_force_ref(run == 1);
                mq_set_avx512_off(run == 2);
                mq_kq_fit_block_d(t, &s, x, ST, k ? w : NULL, g[run], &d[run], &dmin[run]);
                mq_kq_fit_sub(t, &s, x + 5, ST, k ? w : NULL, d[run], dmin[run], &gs[run]);
            }
            moeq_set_force_ref(0);
            mq_set_avx512_off(-1);
            for (int run = 0; run < 3; run += 2) {
                for (int j = 0; j < t->block / t->sub; j++) ASSERT_TRUE(same_groups(&g[1][j], &g[run][j]));
                ASSERT_EQ_INT(0, memcmp(d + 1, d + run, sizeof(float)));
                ASSERT_EQ_INT(0, memcmp(dmin + 1, dmin + run, sizeof(float)));
                ASSERT_TRUE(same_groups(&gs[1], &gs[run]));
            }
            ASSERT_TRUE(t->mult_hi != 0 ? d[0] != 0.0f : g[0][0].scale != 0.0f);   /* a real fit */
        }
    }
}

TEST_MAIN(T(test_q4_k_by_hand), T(test_q6_k_by_hand), T(test_q3_k_by_hand), T(test_q5_0_by_hand),
          T(test_iq4_xs_by_hand), T(test_iq4_nl_by_hand), T(test_iq4_rounding),
          T(test_random_round_trips), T(test_pack_refuses), T(test_fit), T(test_names), T(test_q8_k_activations),
          T(test_sse_twin), T(test_asym_trials_twin),
          T(test_sym_trials_twin), T(test_table_sse_twin), T(test_table_trials_twin), T(test_table_qdq_twin),
          T(test_fit_simd_same))
