/*
 * GPTQ's column kernels: the scalar references (src/kernels/cpu/ref/gptq_ref.c) and their AVX2 and
 * AVX-512 twins (src/kernels/cpu/x86/gptq_avx2.c, gptq_avx512.c), one row each of the family's
 * table (mq_gptq_kernels, kernels.c; the loop in src/quant/gptq.c calls through mq_gptq_cpu()).
 * They take only the formats' types, so nothing here needs quant/. Tests: tests/test_gptq.c
 * compares each twin with its reference.
 */
#ifndef MOEQ_KERNELS_GPTQ_KERNELS_H
#define MOEQ_KERNELS_GPTQ_KERNELS_H

#include "formats/formats.h"

/* Quantize-dequantize of n values with precomputed group steps (mq_group_step) and zero points:
 * bit-identical to mq_qdq_n, without per-value branches (the column step of the loop). */
void mq_gptq_qdq_column(const mq_qspec *s, const float *step, const float *zero, const float *x,
                        int64_t n, uint8_t *code, float *dq);

/* The loop's per-column error step: e = (x - q) / upp; ||w0 - q||^2 added to *dsq; w0 = q.
 * Returns ||e||^2. */
double mq_gptq_column_errors_ref(const float *x, const float *q, float upp, float *w0, int64_t n,
                                 float *e, double *dsq);
/* AVX2 twins (src/kernels/cpu/x86/gptq_avx2.c; call only when mq_cpu_has_avx2_fma()): codes,
 * values and e bit-identical to the scalar versions; the sums in another order. */
void mq_gptq_qdq_column_avx2(const mq_qspec *s, const float *step, const float *zero,
                             const float *x, int64_t n, uint8_t *code, float *dq);
double mq_gptq_column_errors_avx2(const float *x, const float *q, float upp, float *w0, int64_t n,
                                  float *e, double *dsq);

/* GPTQ's in-loop scale search (MQ_GPTQ_MSE_LOOP): the score of one candidate quantizer of a
 * group, for n rows at once. x [G][ld]: the group's current values in processing order (row i of
 * column a at x[a*ld + i]); ucol [G][G]: U restricted to the group's columns (upper), stored by
 * column: ucol[b][a] = U_ab for a <= b, so that column b is contiguous; step/zero:
 * the candidate of each row (as mq_gptq_qdq_column). For each row, in order of b:
 *     w_b = x_b - U_0b e_0 - ... - U_(b-1)b e_(b-1)   (subtracted in that order)
 *     q_b = qdq(w_b);  e_b = (w_b - q_b) / U_bb;  score += (double)e_b * e_b
 * i.e. the group's columns quantized with each error fed back to the later ones, as the column
 * loop does; the score is the group's share of the GPTQ loss. work: (G + 2) * ld floats;
 * code: ld bytes. */
void mq_gptq_loop_scores_ref(const mq_qspec *s, const float *ucol, int64_t G, const float *x,
                             int64_t ld, int64_t n, const float *step, const float *zero,
                             float *work, uint8_t *code, double *score);
/* AVX2 twin (call only when mq_cpu_has_avx2_fma()): bit-identical scores. */
void mq_gptq_loop_scores_avx2(const mq_qspec *s, const float *ucol, int64_t G, const float *x,
                              int64_t ld, int64_t n, const float *step, const float *zero,
                              float *work, uint8_t *code, double *score);
/* AVX-512 twins (src/kernels/cpu/x86/gptq_avx512.c; call only when mq_cpu_has_avx512()): codes,
 * values, e and scores bit-identical to the scalar versions, the column step's two sums to the
 * AVX2 twin's. */
void mq_gptq_qdq_column_avx512(const mq_qspec *s, const float *step, const float *zero,
                               const float *x, int64_t n, uint8_t *code, float *dq);
double mq_gptq_column_errors_avx512(const float *x, const float *q, float upp, float *w0,
                                    int64_t n, float *e, double *dsq);
void mq_gptq_loop_scores_avx512(const mq_qspec *s, const float *ucol, int64_t G, const float *x,
                                int64_t ld, int64_t n, const float *step, const float *zero,
                                float *work, uint8_t *code, double *score);

/* The family's table: a row per instruction set (kernels.c), the reference under
 * mq_force_ref(), AVX-512 where the CPU has it, else AVX2+FMA, else the reference (the NEON rows
 * are the reference). Every row's codes, values, e and scores are the reference's bit for bit;
 * the SIMD rows' two sums of the error step are in their own order (the same in both). */
typedef struct {
    void (*qdq)(const mq_qspec *s, const float *step, const float *zero, const float *x, int64_t n,
                uint8_t *code, float *dq);
    double (*errors)(const float *x, const float *q, float upp, float *w0, int64_t n, float *e,
                     double *dsq);
    void (*loop_scores)(const mq_qspec *s, const float *ucol, int64_t G, const float *x, int64_t ld,
                        int64_t n, const float *step, const float *zero, float *work, uint8_t *code,
                        double *score);
} mq_gptq_kernels;

extern const mq_gptq_kernels mq_gptq_kernels_ref;      /* src/kernels/cpu/ref/gptq_ref.c */
#if defined(__x86_64__) || defined(__i386__)
extern const mq_gptq_kernels mq_gptq_kernels_avx2;     /* src/kernels/cpu/x86/gptq_avx2.c */
extern const mq_gptq_kernels mq_gptq_kernels_avx512;   /* src/kernels/cpu/x86/gptq_avx512.c */
#endif
/* The row of the instruction set the kernels use now (mq_cpu_isa()). */
const mq_gptq_kernels *mq_gptq_cpu(void);

#endif
