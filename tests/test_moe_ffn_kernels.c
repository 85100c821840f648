/*
 * MoE FFN kernels one by one: activation quantization (int8 and split int16) against its
 * definition and each SIMD twin (AVX2; on Arm NEON, and NEON with SDOT where the CPU has it) vs
 * the scalar reference bit for bit (NaN, Inf, zero, tiny blocks included); the packed GEMM
 * against a double-precision dot product of dequantized weights and activations, and each twin vs
 * the reference bit for bit over schemes, group sizes, token counts, pair ranges and both
 * epilogues; every E4M3 scale byte; the polynomial exp/silu against libm.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kernels/moe_ffn.h"
#include "kernels/vec.h"

static uint64_t g_rng = 7;
static uint32_t rnd(void) {
    mq_test_xorshift(&g_rng);
    return (uint32_t)(g_rng >> 11);
}
static float rnd_sym(void) { return (float)(rnd() & 0xffffff) * 0x1p-23f - 1.0f; }

/* The SIMD twins this CPU can run (the reference excluded), NULL-terminated, with their names. */
enum { MAX_TWINS = 5 };
static int simd_twins(const mq_moe_kernels *k[MAX_TWINS], const char *name[MAX_TWINS]) {
    int n = 0;
#if MQ_TEST_X86
    if (mq_cpu_has_avx2_fma()) k[n] = &mq_moe_kernels_avx2, name[n++] = "avx2";
    if (mq_cpu_has_avx512()) k[n] = &mq_moe_kernels_avx512, name[n++] = "avx512";
    if (mq_cpu_has_avx512_vnni()) k[n] = &mq_moe_kernels_avx512_vnni, name[n++] = "avx512+vnni";
    static int told;
    if (!told++ && !mq_cpu_has_avx512_vnni())
        fprintf(stderr, "  no AVX-512%s on this CPU (or MOEQ_NO_AVX512): the avx512%s twins are not run\n",
                mq_cpu_has_avx512() ? " VNNI" : "", mq_cpu_has_avx512() ? "+vnni" : "");
#endif
#if MQ_TEST_ARM
    k[n] = &mq_moe_kernels_neon, name[n++] = "neon";   /* every AArch64 CPU */
    if (mq_cpu_has_neon_dot()) k[n] = &mq_moe_kernels_neon_dot, name[n++] = "neon+dotprod";
    else fprintf(stderr, "  no dotprod on this CPU: the neon+dotprod twin is not run\n");
#endif
    k[n] = NULL, name[n] = NULL;
    return n;
}

typedef struct {
    int8_t q[2][256], q2[2][256];
    float scale[2][16];
    int32_t corr[2][16];
} act_buf;

static mq_qact act_of(act_buf *b, int which, int B, int split, int offset) {
    mq_qact a = {b->q[which], split ? b->q2[which] : NULL, b->scale[which], b->corr[which], 256, B,
                 offset};
    return a;
}

static void test_quant_act_definition_and_twins(void) {
    const mq_moe_kernels *tw[MAX_TWINS];
    const char *tn[MAX_TWINS];
    if (!simd_twins(tw, tn)) SKIP("no SIMD twin on this CPU");
    float x[256];
    for (int rep = 0; rep < 40; rep++) {
        for (int i = 0; i < 256; i++) x[i] = rnd_sym() * (rep % 3 == 0 ? 1e4f : 1.0f);
        if (rep == 1) x[3] = NAN;                               /* block 0 poisoned */
        if (rep == 2) x[40] = INFINITY;                         /* block 1 (B=32) poisoned */
        if (rep == 3) memset(x + 64, 0, 32 * sizeof(float));    /* zero block */
        if (rep == 4)
            for (int i = 96; i < 128; i++) x[i] = 1e-25f;       /* small, above 2^-100: quantized */
        if (rep == 5)
            for (int i = 128; i < 160; i++) x[i] = 0x1p-110f;   /* tiny: treated as zero */
        for (int B = 16; B <= 32; B += 16)
            for (int split = 0; split < 2; split++)
            for (int ti = 0; tw[ti]; ti++) {
                act_buf b;
                memset(&b, 0x55, sizeof b);
                mq_qact r = act_of(&b, 0, B, split, 8), v = act_of(&b, 1, B, split, 8);
                mq_moe_kernels_ref.quant_act(x, 256, &r, 0, 0);
                tw[ti]->quant_act(x, 256, &v, 0, 0);
                if (memcmp(b.q[0], b.q[1], 256) != 0) FAIL("%s: q differs (B %d split %d rep %d)", tn[ti], B, split, rep);
                if (split) ASSERT_TRUE(memcmp(b.q2[0], b.q2[1], 256) == 0);
                ASSERT_TRUE(memcmp(b.scale[0], b.scale[1], sizeof(float) * (size_t)(256 / B)) == 0);
                ASSERT_TRUE(memcmp(b.corr[0], b.corr[1], sizeof(int32_t) * (size_t)(256 / B)) == 0);
                /* the definition: v = q (or 256 q + q2), |x - v * scale| <= scale / 2 */
                for (int blk = 0; blk < 256 / B; blk++) {
                    float sc = b.scale[0][blk];
                    int32_t sum = 0, bad = 0;
                    for (int i = blk * B; i < (blk + 1) * B; i++) bad |= !isfinite(x[i]);
                    if (bad) {
                        ASSERT_TRUE(isnan(sc));
                        continue;
                    }
                    for (int i = blk * B; i < (blk + 1) * B; i++) {
                        int32_t val = split ? 256 * b.q[0][i] + b.q2[0][i] : b.q[0][i];
                        if (split) ASSERT_TRUE(b.q[0][i] >= -127 && b.q[0][i] <= 127);
                        sum += val;
                        double err = fabs((double)x[i] - (double)val * sc);
                        /* half a step, plus the fp32 rounding of x * (qmax / amax); blocks below
                         * 2^-100 are zero */
                        if (sc == 0.0f ? !(val == 0 && fabs(x[i]) < 0x1p-100)
                                       : !(err <= (0.5 + fabs((double)val) * 0x1p-22) * sc)) FAIL("block %d col %d: |%g - %d * %g| = %g", blk, i, x[i], val, sc, err);
                    }
                    ASSERT_EQ_INT(8 * sum, b.corr[0][blk]);
                    if (rep == 5 && blk == 128 / B) ASSERT_TRUE(sc == 0.0f);
                }
            }
    }
}

/* ---- GEMM ------------------------------------------------------------------------------------- */
typedef struct {
    int nvfp4, group, split, rows, K, m;
    mq_moe_stype stype;   /* INT4 scale storage */
    int global_mul;       /* NVFP4 global scale convention */
} gemm_case;

static double wval(const gemm_case *c, const uint8_t *codes, const void *scales, int r, int k) {
    uint8_t q = codes[r * c->K + k];
    int g = k / c->group, ng = c->K / c->group;
    if (c->nvfp4) return mq_test_e2m1_dec(q) * mq_test_e4m3_dec(((const uint8_t *)scales)[r * ng + g]);
    return ((int)q - 8) * (double)((const float *)scales)[r * ng + g];
}

static void run_gemm_case(const gemm_case *c, const mq_moe_kernels *const *tw, const char *const *tn) {
    const int R = c->rows, K = c->K, m = c->m, B = c->nvfp4 ? 16 : 32, ng = K / c->group;
    uint8_t *codes = malloc((size_t)R * K);
    void *scales = malloc((size_t)R * ng * 4);
    for (int i = 0; i < R * K; i++) codes[i] = (uint8_t)(rnd() & 15);
    for (int i = 0; i < R * ng; i++) {
        /* any non-NaN byte; negative ones (sign bit) in every other case */
        if (c->nvfp4) ((uint8_t *)scales)[i] = (uint8_t)((rnd() % 0x7f) | (c->global_mul && (rnd() & 1) ? 0x80 : 0));
        else {
            float f = rnd_sym() * 0.1f;   /* made exact in the storage type under test */
            if (c->stype == MQ_MOE_S_F16) f = mq_f16_to_f32(mq_f32_to_f16(f));
            if (c->stype == MQ_MOE_S_BF16) f = mq_bf16_to_f32(mq_f32_to_bf16(f));
            ((float *)scales)[i] = f;
        }
    }
    const mq_moe_stype st = c->nvfp4 ? MQ_MOE_S_E4M3 : c->stype;
    size_t rbb = mq_moe_rb_bytes(K, c->group, st);
    uint8_t *W = mq_alloc(rbb * (size_t)(R / 8), "test W");
    mq_moe_src src = {codes, scales, c->nvfp4 ? 1 : 4, 1.0f, 0};
    for (int rb = 0; rb < R / 8; rb++)
        mq_moe_pack_rb(&src, R, K, c->group, c->nvfp4, st, rb * 8, W + rb * rbb);
    /* NVFP4: y = acc / (2 gs) (divisor convention) or acc * g / 2 (multiplier convention) */
    const float gs = 3.0f;
    const float mul = c->nvfp4 && c->global_mul ? gs : 1.0f;
    const float div = c->nvfp4 ? (c->global_mul ? 2.0f : 2 * gs) : 1.0f;
    int neg = 0;
    for (int i = 0; c->nvfp4 && i < R * ng; i++) neg |= ((uint8_t *)scales)[i] >> 7;
    mq_pmat P = {W, rbb, R, K, c->group, c->nvfp4, st, {mul, mul}, {div, div}, neg};
    /* activations: rows in reverse order through act_rows, to exercise the indirection */
    const int arows = m + 3;
    float *x = malloc(sizeof(float) * (size_t)arows * K);
    for (int i = 0; i < arows * K; i++) x[i] = rnd_sym();
    int8_t *q = malloc((size_t)arows * K * 2);
    float *sc = malloc(sizeof(float) * (size_t)arows * (K / B));
    int32_t *cr = malloc(sizeof(int32_t) * (size_t)arows * (K / B));
    mq_qact A = {q, c->split ? q + arows * K : NULL, sc, cr, K, B, c->nvfp4 ? 12 : 8};
    for (int i = 0; i < arows; i++) mq_moe_kernels_ref.quant_act(x + (size_t)i * K, K, &A, i, 0);
    int32_t *rows = malloc(sizeof(int32_t) * (size_t)m);
    for (int i = 0; i < m; i++) rows[i] = arows - 1 - i;
    const int np = R / 16, p0 = np > 1 ? 1 : 0;
    for (int swiglu = 0; swiglu < 2; swiglu++) {
        const int ldo = swiglu ? 8 * (np - p0) : R;
        float *o1 = calloc((size_t)m * ldo, sizeof(float)), *o2 = calloc((size_t)m * ldo, sizeof(float));
        mq_moe_kernels_ref.gemm(&P, p0, np, &A, rows, 0, m, o1, ldo, swiglu, NULL);
        for (int ti = 0; tw[ti]; ti++) {
            memset(o2, 0, sizeof(float) * (size_t)m * ldo);
            tw[ti]->gemm(&P, p0, np, &A, rows, 0, m, o2, ldo, swiglu, P.data);
            if (memcmp(o1, o2, sizeof(float) * (size_t)m * ldo) != 0) {
                int j = 0;
                while (o1[j] == o2[j]) j++;
                FAIL("nvfp4 %d group %d split %d stype %d m %d swiglu %d: ref %.9g %s %.9g at %d",
                     c->nvfp4, c->group, c->split, (int)c->stype, m, swiglu, o1[j], tn[ti], o2[j], j);
            }
        }
        /* independent: double dot of dequantized weights and dequantized activations */
        for (int i = 0; i < m; i++) {
            const int ar = rows[i];
            for (int p = p0; p < np; p++) {
                double y[16], mag[16];
                for (int l = 0; l < 16; l++) {
                    /* packed in natural order: pair p = rows 16p..16p+15; with swiglu the
                     * first 8 act as gate and the next 8 as up */
                    const int r = 16 * p + l;
                    double acc = 0, am = 0;
                    for (int k = 0; k < K; k++) {
                        int blk = k / B;
                        double v = c->split ? 256.0 * q[ar * K + k] + A.q2[ar * K + k] : q[ar * K + k];
                        double term = wval(c, codes, scales, r, k) * v * sc[ar * (K / B) + blk];
                        acc += term;
                        am += fabs(term);
                    }
                    const double f = !c->nvfp4 ? 1.0 : c->global_mul ? gs : 1.0 / gs;
                    y[l] = acc * f;
                    mag[l] = am * f;
                }
                for (int l = 0; l < (swiglu ? 8 : 16); l++) {
                    /* fp32 block sums: errors of ~1e-6 of the sum of |terms| (mag), carried
                     * through silu(g) * u with |silu'| < 1.1 */
                    double want = y[l], tol = 1e-6 * mag[l];
                    if (swiglu) {
                        double sg = y[l] / (1.0 + exp(-y[l]));
                        want = sg * y[l + 8];
                        tol = 1e-6 * (1.1 * mag[l] * fabs(y[l + 8]) + fabs(sg) * mag[l + 8]) + 1e-30;
                    }
                    float got = swiglu ? o1[i * ldo + 8 * (p - p0) + l] : o1[i * ldo + 16 * p + l];
                    if (!(fabs(got - want) <= tol))
                        FAIL("nvfp4 %d group %d split %d swiglu %d row %d pair %d lane %d: %.9g vs %.9g",
                             c->nvfp4, c->group, c->split, swiglu, i, p, l, got, want);
                }
            }
        }
        free(o1);
        free(o2);
    }
    free(codes); free(scales); mq_free(W); free(x); free(q); free(sc); free(cr); free(rows);
}

static void test_gemm_reference_and_twins(void) {
    const mq_moe_kernels *tw[MAX_TWINS];
    const char *tn[MAX_TWINS];
    const int ntw = simd_twins(tw, tn);
    const int groups[4] = {16, 32, 64, 128};
    for (int gi = 0; gi < 4; gi++)
        for (int split = 0; split < 2; split++)
            for (int m = 1; m <= 9; m += (m < 5 ? 1 : 4)) {
                /* INT4: the three scale storages in turn; NVFP4: both global conventions */
                gemm_case c = {gi == 0, groups[gi], split, 48, 256, m, (mq_moe_stype)(m % 3), m & 1};
                run_gemm_case(&c, tw, tn);
            }
    /* token counts around the AVX-512 kernels' tile of 8 activation rows */
    static const int ms[5] = {7, 8, 15, 16, 17};
    for (int nv = 0; nv < 2; nv++)
        for (int mi = 0; mi < 5; mi++) {
            const int m = ms[mi];
            gemm_case c = {nv, nv ? 16 : 32, 1, 32, 128, m, (mq_moe_stype)(m % 3), m & 1};
            run_gemm_case(&c, tw, tn);
        }
    /* more than one block of 64 activation rows (the kernels' outer loop), both schemes */
    for (int nv = 0; nv < 2; nv++) {
        gemm_case c = {nv, nv ? 16 : 64, 1, 32, 128, 70, MQ_MOE_S_BF16, 1};
        run_gemm_case(&c, tw, tn);
    }
    if (!ntw) SKIP("no SIMD twin on this CPU: reference checked against doubles only");
}

/* Every non-NaN E4M3 byte through the NVFP4 kernels: codes 2 (= 1.0) and activations 1.0 give
 * 16 * 2 * 127 * (e4m3(b) * (1/127)) / (2 * gs) per 16-column block. */
static void test_every_e4m3_scale(void) {
    const int K = 16;
    uint8_t codes[16 * 16];
    uint8_t scales[16];
    memset(codes, 2, sizeof codes);
    float x[16];
    for (int i = 0; i < 16; i++) x[i] = 1.0f;
    int8_t q[32];
    float sc[1];
    int32_t cr[1];
    mq_qact A = {q, NULL, sc, cr, K, 16, 12};
    mq_moe_kernels_ref.quant_act(x, K, &A, 0, 0);
    size_t rbb = mq_moe_rb_bytes(K, 16, MQ_MOE_S_E4M3);
    uint8_t *W = mq_alloc(2 * rbb, "test W");
    const mq_moe_kernels *ks[1 + MAX_TWINS] = {&mq_moe_kernels_ref};
    const char *tn[MAX_TWINS];
    simd_twins(ks + 1, tn);
    for (int b0 = 0; b0 < 256; b0 += 16) {
        for (int r = 0; r < 16; r++) scales[r] = (uint8_t)(b0 + r);
        if (b0 == 0x70 || b0 == 0xf0) scales[15] = 0x00;   /* 0x7f / 0xff are NaN */
        mq_moe_src src = {codes, scales, 1, 1.0f, 0};
        mq_moe_pack_rb(&src, 16, K, 16, 1, MQ_MOE_S_E4M3, 0, W);
        mq_moe_pack_rb(&src, 16, K, 16, 1, MQ_MOE_S_E4M3, 8, W + rbb);
        mq_pmat P = {W, rbb, 16, K, 16, 1, MQ_MOE_S_E4M3, {1.0f, 1.0f}, {2.0f, 2.0f}, b0 >= 0x80};
        for (int ki = 0; ks[ki]; ki++) {
            float out[16];
            ks[ki]->gemm(&P, 0, 1, &A, NULL, 0, 1, out, 16, 0, NULL);
            for (int r = 0; r < 16; r++) {
                double want = 16.0 * 2 * 127 * mq_test_e4m3_dec(scales[r]) * (double)sc[0] / 2.0;
                if (!(fabs(out[r] - want) <= 1e-6 * fabs(want)))
                    FAIL("kernel %d scale byte 0x%02x: %.9g vs %.9g", ki, scales[r], out[r], want);
            }
        }
    }
    mq_free(W);
}

/* The SwiGLU activation the kernels use (its exp is tested against libm in test_vec_kernels). */
static void test_silu(void) {
    ASSERT_NEAR(0.0, mq_vec_silu(-200.0f), 1e-30);
    ASSERT_REL(200.0, mq_vec_silu(200.0f), 1e-7);
    ASSERT_REL(0.7310585786300049, mq_vec_silu(1.0f), 3e-7);
    ASSERT_REL(-0.2689414213699951, mq_vec_silu(-1.0f), 3e-7);
    ASSERT_TRUE(isnan(mq_vec_silu(NAN)));
}

/* The op takes the best twin the CPU runs, the reference when forced; moeq_cpu_kernels names it. */
static void test_dispatch(void) {
    moeq_set_force_ref(1);
    ASSERT_TRUE(mq_moe_kernels_active() == &mq_moe_kernels_ref);
    ASSERT_TRUE(strcmp(moeq_cpu_kernels(), "scalar (forced)") == 0);
    moeq_set_force_ref(0);
    const mq_moe_kernels *want = &mq_moe_kernels_ref;
    const char *name = "scalar";
#if MQ_TEST_X86
    if (mq_cpu_has_avx2_fma()) want = &mq_moe_kernels_avx2, name = "avx2+fma";
    if (mq_cpu_has_avx512()) want = &mq_moe_kernels_avx512, name = "avx512";
    if (mq_cpu_has_avx512_vnni()) want = &mq_moe_kernels_avx512_vnni, name = "avx512+vnni";
#endif
#if MQ_TEST_ARM
    want = mq_cpu_has_neon_dot() ? &mq_moe_kernels_neon_dot : &mq_moe_kernels_neon;
    name = mq_cpu_has_neon_dot() ? "neon+dotprod" : "neon";
#endif
    fprintf(stderr, "  CPU kernels: %s\n", moeq_cpu_kernels());
    ASSERT_TRUE(mq_moe_kernels_active() == want);
    /* under MOEQ_NO_AVX512 an AVX-512 host says "avx2+fma (avx512 off)" */
    const char *env = getenv("MOEQ_NO_AVX512");
    size_t cmp = env && *env && strcmp(env, "0") != 0 ? strlen(name) : strlen(name) + 1;
    if (strncmp(moeq_cpu_kernels(), name, cmp) != 0) FAIL("kernel set %s, expected %s", moeq_cpu_kernels(), name);
#if MQ_TEST_X86
    /* MOEQ_NO_AVX512's switch: the AVX2 set on an AVX-512 host, named so */
    const int had512 = mq_cpu_has_avx512();
    mq_set_avx512_off(1);
    ASSERT_TRUE(!mq_cpu_has_avx512() && !mq_cpu_has_avx512_vnni());
    if (mq_cpu_has_avx2_fma()) {
        ASSERT_TRUE(mq_moe_kernels_active() == &mq_moe_kernels_avx2);
        const char *want_name = had512 ? "avx2+fma (avx512 off)" : "avx2+fma";
        if (strncmp(moeq_cpu_kernels(), want_name, strlen(want_name) + (had512 ? 1 : 0)) != 0)
            FAIL("kernel set %s with AVX-512 off, expected %s", moeq_cpu_kernels(), want_name);
    }
    mq_set_avx512_off(-1);
    ASSERT_TRUE(mq_cpu_has_avx512() == had512);
#endif
}

/* mq_moe_pack_rb byte for byte against the layout element by element (moe_ffn.h): column k of
 * row l in byte (k / 8) * 32 + l * 4 + k % 4, the low nibble for k % 8 < 4, else the high one;
 * padding rows past src_rows with weight 0's code (NVFP4 0, INT4 8) and scale 0; the scales after
 * the codes, group g of row l at (g * 8 + l) * its size, zeros to 64 bytes. NVFP4 with E4M3 bytes,
 * INT4 with F16. */
static void test_pack_rb_layout(void) {
    enum { K = 96, ROWS = 13 };
    uint8_t codes[ROWS * K], e4m3[ROWS * (K / 16)];
    float f32s[ROWS * (K / 32)];
    for (int i = 0; i < ROWS * K; i++) codes[i] = (uint8_t)(rnd() % 16);
    for (int i = 0; i < ROWS * (K / 16); i++) e4m3[i] = (uint8_t)(1 + rnd() % 0x7e);
    for (int i = 0; i < ROWS * (K / 32); i++) f32s[i] = (float)(1 + rnd() % 1000) * 0x1p-10f;
    for (int nvfp4 = 0; nvfp4 < 2; nvfp4++) {
        const int32_t group = nvfp4 ? 16 : 32, ng = K / group;
        const mq_moe_stype st = nvfp4 ? MQ_MOE_S_E4M3 : MQ_MOE_S_F16;
        const size_t sb = nvfp4 ? 1 : 2, rbb = mq_moe_rb_bytes(K, group, st);
        ASSERT_TRUE(rbb == (((size_t)K * 4 + (size_t)ng * 8 * sb + 63) & ~(size_t)63));   /* padded to 64 bytes */
        mq_moe_src src = {codes, nvfp4 ? e4m3 : (const uint8_t *)f32s, nvfp4 ? 1 : 4, 1.0f, 0};
        uint8_t got[2][K * 4 + (K / 16) * 8 * 2], want[K * 4 + (K / 16) * 8 * 2];
        for (int rb = 0; rb < 2; rb++) {
            memset(got[rb], 0xA5, sizeof got[rb]);   /* every byte must be written */
            mq_moe_pack_rb(&src, ROWS, K, group, nvfp4, st, rb * 8, got[rb]);
            memset(want, 0, rbb);
            for (int l = 0; l < 8; l++) {
                const int r = rb * 8 + l;
                for (int k = 0; k < K; k++) {
                    const uint8_t v = r < ROWS ? codes[r * K + k] : nvfp4 ? 0 : 8;
                    want[(k / 8) * 32 + l * 4 + k % 4] |= (uint8_t)(k % 8 < 4 ? v : v << 4);
                }
                for (int g = 0; g < ng && r < ROWS; g++) {
                    uint8_t *o = want + K * 4 + ((size_t)g * 8 + (size_t)l) * sb;
                    if (nvfp4) {
                        *o = e4m3[r * ng + g];
                    } else {
                        const uint16_t h = mq_f32_to_f16(f32s[r * ng + g]);
                        memcpy(o, &h, 2);
                    }
                }
            }
            for (size_t i = 0; i < rbb; i++)
                if (got[rb][i] != want[i])
                    FAIL("%s row block %d byte %zu: 0x%02x, the layout's 0x%02x", nvfp4 ? "nvfp4" : "int4", rb,
                         i, got[rb][i], want[i]);
        }
    }
}

TEST_MAIN(T(test_quant_act_definition_and_twins), T(test_gemm_reference_and_twins),
          T(test_every_e4m3_scale), T(test_silu), T(test_dispatch), T(test_pack_rb_layout))
