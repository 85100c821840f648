/*
 * Scalar reference of the dot products over GGUF rows read in place (kernels/ggml_mat.h): the
 * operations of the AVX2+FMA twin (cpu/x86/ggml_dot_avx2.c) lane by lane, fmaf included: element
 * 8k + l of a 32-value block into lane l, Q8_0's block sum scaled into the row's accumulator by
 * one fma, the lanes reduced as (l + l+4), (l + l+2), (l + l+1).
 */
#include <math.h>

#include "kernels/ggml_mat.h"

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static float lanes_sum(const float *t) {
    float s[4];
    for (int l = 0; l < 4; l++) s[l] = t[l] + t[l + 4];
    return (s[0] + s[2]) + (s[1] + s[3]);
}

static float ref_dot_q8_0(const uint8_t *row, const float *x, int64_t nb) {
    float tot[8] = {0};
    for (int64_t b = 0; b < nb; b++, row += 34, x += 32) {
        const float d = mq_f16_to_f32(rd16(row));
        for (int l = 0; l < 8; l++) {
            float a = (float)(int8_t)row[2 + l] * x[l];
            for (int k = 1; k < 4; k++) a = fmaf((float)(int8_t)row[2 + 8 * k + l], x[8 * k + l], a);
            tot[l] = fmaf(d, a, tot[l]);
        }
    }
    return lanes_sum(tot);
}

static float ref_dot_bf16(const uint8_t *row, const float *x, int64_t n) {
    float tot[8] = {0};
    for (int64_t i = 0; i < n; i += 8)
        for (int l = 0; l < 8; l++)
            tot[l] = fmaf(mq_bf16_to_f32(rd16(row + 2 * (i + l))), x[i + l], tot[l]);
    return lanes_sum(tot);
}

/* Four rows at once: each row's dot exactly as above (the SIMD twins interleave the four). */
static void ref_dot_q8_0_x4(const uint8_t *const rows[4], const float *x, int64_t nb, float *out) {
    for (int k = 0; k < 4; k++) out[k] = ref_dot_q8_0(rows[k], x, nb);
}

static void ref_dot_bf16_x4(const uint8_t *const rows[4], const float *x, int64_t n, float *out) {
    for (int k = 0; k < 4; k++) out[k] = ref_dot_bf16(rows[k], x, n);
}

const mq_ggml_dot_kernels mq_ggml_dot_ref = {ref_dot_q8_0, ref_dot_bf16, ref_dot_q8_0_x4,
                                             ref_dot_bf16_x4};

