/*
 * Scalar reference kernels of the quantized MoE feed-forward op: int8 block quantization of
 * activations and the packed-weight GEMM with its SwiGLU epilogue (layout and integer scheme in
 * src/kernels/moe_ffn.h). They read the same packed layout as the AVX2 twins and perform the same
 * floating-point operations in the same order (exact integer block dots, one fp32 multiply and one
 * fused multiply-add per block, IEEE division), so both give bit-identical results; tests compare
 * them and check both against a dense fp32 computation on dequantized weights.
 */
#include <math.h>
#include <string.h>

#include "kernels/cpu/moe_common.h"
#include "kernels/moe_ffn.h"
#include "kernels/vec.h"

/* 2 * e2m1(code) + 12: the NVFP4 weight as an unsigned byte (offset 12). */
static const uint8_t k_nvfp4_u[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                      12, 11, 10, 9, 8, 6, 4, 0};

static float e4m3_value(uint8_t b) {
    int e = (b >> 3) & 15, m = b & 7;
    float v = e == 0 ? (float)m * 0x1p-9f : ldexpf(1.0f + (float)m * 0.125f, e - 7);
    return (b & 0x80) ? -v : v;
}

static void quant_act_ref(const float *x, int64_t n, const mq_qact *A, int64_t row, int64_t col0) {
    const int32_t B = A->block;
    const int split = A->q2 != NULL;
    const moe_qact_dst d = moe_qact_at(A, row, col0);
    for (int64_t b = 0; b < n / B; b++) {
        const float *v = x + b * B;
        float amax = 0.0f;
        int bad = 0;
        for (int32_t i = 0; i < B; i++) {
            float a = fabsf(v[i]);
            if (isnan(a)) bad = 1;
            else if (a > amax) amax = a;
        }
        if (moe_qact_unscaled(&d, b, B, amax, bad)) continue;
        int32_t sum = 0;
        float inv = d.qmax / amax;
        for (int32_t i = 0; i < B; i++) {
            int32_t c = (int32_t)nearbyintf(v[i] * inv);
            sum += c;
            if (split) {
                int32_t hi = (c + 128 + 32768) / 256 - 128;   /* floor((c + 128) / 256) */
                d.q[b * B + i] = (int8_t)hi;
                d.q2[b * B + i] = (int8_t)(c - 256 * hi);
            } else {
                d.q[b * B + i] = (int8_t)c;
            }
        }
        d.sc[b] = amax / d.qmax;
        d.cr[b] = sum * A->offset;
    }
}

/* The weight of packed row block rb, lane l, column k as the unsigned integer the dot uses. */
static inline int32_t wcode(const uint8_t *rb, int l, int64_t k, int nvfp4) {
    uint8_t byte = rb[(k / 8) * 32 + l * 4 + (k % 4)];
    uint8_t c = (k % 8) < 4 ? (byte & 15) : (byte >> 4);
    return nvfp4 ? k_nvfp4_u[c] : c;
}

static inline float wscale(const uint8_t *rb, const mq_pmat *W, int l, int64_t g) {
    const uint8_t *s = rb + (size_t)W->cols * 4;
    const size_t i = (size_t)(g * 8 + l);
    uint16_t h;
    float f;
    switch (W->stype) {
        case MQ_MOE_S_E4M3: return e4m3_value(s[i]);
        case MQ_MOE_S_F16: memcpy(&h, s + 2 * i, 2); return mq_f16_to_f32(h);
        case MQ_MOE_S_BF16: memcpy(&h, s + 2 * i, 2); return mq_bf16_to_f32(h);
        default: memcpy(&f, s + 4 * i, 4); return f;
    }
}

static void gemm_ref(const mq_pmat *W, int64_t pair0, int64_t pair1, const mq_qact *A,
                     const int32_t *act_rows, int64_t row0, int64_t m, float *out, int64_t ldo,
                     int swiglu, const uint8_t *next) {
    (void)next;   /* a prefetch hint */
    const int32_t B = A->block;
    const int64_t K = W->cols, nb = K / B, lds = A->ld / B;
    for (int64_t pair = pair0; pair < pair1; pair++) {
        for (int64_t i = 0; i < m; i++) {
            int64_t ar = act_rows ? act_rows[i] : row0 + i;
            const int8_t *q = A->q + ar * A->ld, *q2 = A->q2 ? A->q2 + ar * A->ld : NULL;
            const float *sa = A->scale + ar * lds;
            const int32_t *cr = A->corr + ar * lds;
            float res[2][MQ_MOE_RB];
            for (int h = 0; h < 2; h++) {
                const uint8_t *rb = W->data + (size_t)(2 * pair + h) * W->rb_bytes;
                for (int l = 0; l < MQ_MOE_RB; l++) {
                    float acc = 0.0f;
                    for (int64_t b = 0; b < nb; b++) {
                        int32_t dot = 0, dot2 = 0;
                        for (int64_t k = b * B; k < (b + 1) * B; k++) {
                            dot += wcode(rb, l, k, W->nvfp4) * q[k];
                            if (q2) dot2 += wcode(rb, l, k, W->nvfp4) * q2[k];
                        }
                        if (q2) dot = 256 * dot + dot2;
                        float sw = wscale(rb, W, l, b * B / W->group);
                        acc = fmaf((float)(dot - cr[b]), sw * sa[b], acc);
                    }
                    res[h][l] = acc * W->mul[h] / W->div[h];
                }
            }
            float *o = out + i * ldo;
            for (int l = 0; l < MQ_MOE_RB; l++) {
                if (swiglu) {
                    o[8 * (pair - pair0) + l] = mq_vec_silu(res[0][l]) * res[1][l];
                } else {
                    o[16 * pair + l] = res[0][l];
                    o[16 * pair + 8 + l] = res[1][l];
                }
            }
        }
    }
}

const mq_moe_kernels mq_moe_kernels_ref = {quant_act_ref, gemm_ref};
