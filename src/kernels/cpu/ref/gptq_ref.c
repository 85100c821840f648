/*
 * The scalar references of GPTQ's column kernels (kernels/gptq_kernels.h): the definitions the
 * AVX2 and AVX-512 twins (cpu/x86/gptq_*.c) match bit for bit, and the row MQ_ISA_REF of the
 * family's table in kernels.c. The column loop that calls them is quant's (src/quant/gptq.c).
 */
#include <math.h>
#include <string.h>

#include "formats/kquant.h"
#include "kernels/gptq_kernels.h"

/* Column quantize-dequantize with precomputed steps: the same operations, in the same order, as
 * formats.h's mq_qdq_n (quant_step / dequant_step), written without branches so the compiler
 * vectorises it. Tested against mq_qdq_n value for value. */
void mq_gptq_qdq_column(const mq_qspec *s, const float *step, const float *zero, const float *x,
                        int64_t n, uint8_t *code, float *dq) {
    static const float e2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    if (s->scheme == MQ_QS_KQUANT) {
        mq_kq_qdq_column(mq_kq_info_of(s->kq), step, zero, x, n, code, dq);
        return;
    }
    if (s->scheme == MQ_QS_INT4) {
        const float lo = s->asym ? 0.0f : -8.0f, hi = s->asym ? 15.0f : 7.0f;
        for (int64_t i = 0; i < n; i++) {
            float st = step[i], z = s->asym ? zero[i] : 0.0f;
            float q = rintf(x[i] / st) + z;
            q = q < lo ? lo : q > hi ? hi : q;
            if (st == 0.0f) q = z;   /* all-zero group: the zero point (8 when symmetric) */
            uint8_t c = (uint8_t)(int)(s->asym ? q : q + 8.0f);
            code[i] = c;
            dq[i] = (s->asym ? (float)c - z : (float)c - 8.0f) * st;
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        float st = step[i], y = x[i] / st, a = fabsf(y);
        int idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                  (a >= 3.5f) + (a > 5.0f);
        int neg = signbit(y) != 0;
        uint8_t c = (uint8_t)(neg << 3 | idx);
        float v = neg ? -e2m1[idx] : e2m1[idx];
        code[i] = st == 0.0f ? 0 : c;
        dq[i] = st == 0.0f ? 0.0f : v * st;
    }
}

/* e = (x - q) / u_pp (the scaled error, IEEE division as the reference); w0 (the original
 * column) is replaced by q after ||w0 - q||^2 is added to *dsq. Returns ||e||^2. */
double mq_gptq_column_errors_ref(const float *restrict x, const float *restrict q, float upp,
                                 float *restrict w0, int64_t n, float *restrict e, double *dsq) {
    float se = 0, sd = 0;
    for (int64_t i = 0; i < n; i++) {
        e[i] = (x[i] - q[i]) / upp;
        se += e[i] * e[i];
        float d = w0[i] - q[i];
        sd += d * d;
        w0[i] = q[i];
    }
    *dsq += sd;
    return se;
}

/* The score of one candidate per row over a group's columns (gptq_kernels.h says how). */
void mq_gptq_loop_scores_ref(const mq_qspec *s, const float *ucol, int64_t G, const float *x,
                             int64_t ld, int64_t n, const float *step, const float *zero,
                             float *work, uint8_t *code, double *score) {
    float *e = work, *w = work + G * ld, *q = w + ld;
    for (int64_t i = 0; i < n; i++) score[i] = 0;
    for (int64_t b = 0; b < G; b++) {
        memcpy(w, x + b * ld, (size_t)n * sizeof(float));
        for (int64_t a = 0; a < b; a++) {
            const float u = ucol[b * G + a], *ea = e + a * ld;
            for (int64_t i = 0; i < n; i++) w[i] -= u * ea[i];
        }
        mq_gptq_qdq_column(s, step, zero, w, n, code, q);
        const float ubb = ucol[b * G + b];
        float *eb = e + b * ld;
        for (int64_t i = 0; i < n; i++) {
            eb[i] = (w[i] - q[i]) / ubb;
            score[i] += (double)eb[i] * eb[i];
        }
    }
}

const mq_gptq_kernels mq_gptq_kernels_ref = {mq_gptq_qdq_column, mq_gptq_column_errors_ref,
                                              mq_gptq_loop_scores_ref};
