/*
 * The formats' own SIMD twins (x86-64 AVX2+FMA, src/formats/cpu/x86/): the candidate searches of
 * the MSE scales (formats.h's mq_mse_sse_ref) and of the K-quant block fits (kquant.h's
 * mq_kq_*_ref; the IQ4 table types' also AVX-512). Each is bit-identical to its scalar
 * reference, which its caller runs on other hosts, without AVX2 and FMA, or under
 * MOEQ_FORCE_REF (the AVX2 one instead of AVX-512 under MOEQ_NO_AVX512); only those callers
 * and the twin tests include this header, so the formats' interface names no ISA.
 */
#ifndef MOEQ_FORMATS_SIMD_H
#define MOEQ_FORMATS_SIMD_H

#include "formats/formats.h"
#include "formats/kquant.h"

/* AVX2 twin (src/formats/cpu/x86/quant_avx2.c; only when mq_cpu_has_avx2_fma()):
 * bit-identical sse (the same operations per value and candidate, 8 candidates per vector). */
void mq_mse_sse_avx2(const mq_qspec *s, const float *step, const float *zero, int nc,
                     const float *x, int64_t n, int64_t stride, const float *h, double *sse);

/* AVX2 twin (src/formats/cpu/x86/kquant_avx2.c; only when mq_cpu_has_avx2_fma()): bit-identical
 * sse (the same operations per value and candidate, 8 candidates per vector), every type. */
void mq_kq_sse_avx2(const mq_kq_info *t, const float *step, const float *off, int nc,
                    const float *x, int64_t n, int64_t stride, const float *w, double *sse);

/* AVX2 twin (kquant_avx2.c; only when mq_cpu_has_avx2_fma()): bit-identical outputs. */
void mq_kq_asym_trials_avx2(const float *x, int64_t n, int64_t stride, const float *w,
                            const mq_kq_sums *s, const float *iscale, int nt, float *D, float *sc,
                            float *mn, double *e);

/* AVX2 twin (kquant_avx2.c; only when mq_cpu_has_avx2_fma()): bit-identical sums. */
void mq_kq_sym_trials_avx2(const float *x, int64_t n, int64_t stride, const float *w, int nmax,
                           const float *iscale, int nt, float *sumlx, float *suml2);

/* AVX2 twin (kquant_avx2.c; only when mq_cpu_has_avx2_fma()): bit-identical sums. */
void mq_kq_table_trials_avx2(const int8_t *tab, const float *x, int64_t n, int64_t stride,
                             const float *w, const float *iscale, int nt, float *sxt, float *stt);

/* AVX2 twin (kquant_avx2.c; only when mq_cpu_has_avx2_fma()) of a table type's rounding
 * (mq_kq_qdq, or mq_kq_qdq_column when per_value: step[i] for value i): the codes and values of
 * values 0 .. m - 1, bit-identical, m = n rounded down to a multiple of 8, which it returns (the
 * caller rounds the rest). code or dq may be NULL. */
int64_t mq_kq_qdq_table_avx2(const int8_t *tab, const float *step, bool per_value, const float *x,
                             int64_t n, uint8_t *code, float *dq);

/* AVX-512 twins (src/formats/cpu/x86/kquant_avx512.c; only when mq_cpu_has_avx512()) of the
 * table types' scoring (mq_kq_sse_ref for a t with a table: no offsets) and of their fit's
 * trials: bit-identical, 16 candidates or trials per vector, the arrays as the references'. */
void mq_kq_sse_table_avx512(const mq_kq_info *t, const float *step, int nc, const float *x,
                            int64_t n, int64_t stride, const float *w, double *sse);
void mq_kq_table_trials_avx512(const int8_t *tab, const float *x, int64_t n, int64_t stride,
                               const float *w, const float *iscale, int nt, float *sxt, float *stt);

#endif
