/*
 * Scalar reference of the dot products over GGUF rows read in place (kernels/ggml_mat.h): the
 * operations of the AVX2+FMA twin (cpu/x86/ggml_dot_avx2.c) lane by lane, fmaf included: four
 * accumulators of 8 lanes (independent chains, so a row streams at the memory's pace instead of
 * one fma's latency), element i of a BF16 row into accumulator (i % 32) / 8, lane i % 8; Q8_0's
 * block b (element 8k + l of it into lane l) summed and then scaled into accumulator b % 4 by one
 * fma; the accumulators merged as (0 + 1) + (2 + 3), the lanes reduced as (l + l+4), (l + l+2),
 * (l + l+1). Several rows and tokens (bf16_rows): each pair's dot product alone.
 */
#include <math.h>

#include "kernels/ggml_mat.h"

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static float lanes_sum(const float *t) {
    float s[4];
    for (int l = 0; l < 4; l++) s[l] = t[l] + t[l + 4];
    return (s[0] + s[2]) + (s[1] + s[3]);
}

/* The four accumulators of 8 lanes into one: (acc0 + acc1) + (acc2 + acc3) lane by lane. */
static void acc_merge(float acc[4][8], float *t) {
    for (int l = 0; l < 8; l++) t[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
}

static float ref_dot_q8_0(const uint8_t *row, const float *x, int64_t nb) {
    float acc[4][8] = {{0}}, t[8];
    for (int64_t b = 0; b < nb; b++, row += 34, x += 32) {
        const float d = mq_f16_to_f32(rd16(row));
        for (int l = 0; l < 8; l++) {
            float a = (float)(int8_t)row[2 + l] * x[l];
            for (int k = 1; k < 4; k++) a = fmaf((float)(int8_t)row[2 + 8 * k + l], x[8 * k + l], a);
            acc[b % 4][l] = fmaf(d, a, acc[b % 4][l]);
        }
    }
    acc_merge(acc, t);
    return lanes_sum(t);
}

static float ref_dot_bf16(const uint8_t *row, const float *x, int64_t n) {
    float acc[4][8] = {{0}}, t[8];
    for (int64_t i = 0; i < n; i += 8)
        for (int l = 0; l < 8; l++)
            acc[(i % 32) / 8][l] = fmaf(mq_bf16_to_f32(rd16(row + 2 * (i + l))), x[i + l],
                                        acc[(i % 32) / 8][l]);
    acc_merge(acc, t);
    return lanes_sum(t);
}

static void ref_dot_bf16_rows(const uint8_t *const *rows, int64_t nr, const float *x, int64_t ldx,
                              int64_t T, int64_t n, float *y, int64_t ldy) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < nr; r++) y[t * ldy + r] = ref_dot_bf16(rows[r], x + t * ldx, n);
}

const mq_ggml_dot_kernels mq_ggml_dot_ref = {ref_dot_q8_0, ref_dot_bf16, ref_dot_bf16_rows};

