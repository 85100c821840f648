/*
 * The scalar element loops of the vector kernels (kernels/vec.h), from element i on: the whole
 * operation in the scalar reference (i = 0, src/kernels/cpu/ref/vec_ref.c) and the elements past
 * the last whole vector in the AVX2, AVX-512 and NEON twins, so a twin's edge is the reference's
 * arithmetic by construction. Free of any instruction set. Products and sums are separate
 * statements, so no compiler contracts them into a multiply-add (the fmaf calls are the fused
 * steps the kernels mean). Also what the twins' GEMVs share (the walk over groups of rows) and the
 * shape of a twin's row of mq_vec_kernels.
 */
#ifndef MOEQ_KERNELS_CPU_VEC_EDGES_H
#define MOEQ_KERNELS_CPU_VEC_EDGES_H

#include <math.h>

#include "kernels/vec.h"

/* y[k] = fmaf(a, x[k], y[k]) */
static inline void vec_axpy_from(int64_t i, float a, const float *x, float *y, int64_t n) {
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

/* rotate_half RoPE of the pairs (x[k], x[k + half]), k >= i */
static inline void vec_rope_from(int64_t i, float *x, int64_t half, const float *c, const float *s) {
    for (; i < half; i++) {
        const float a = x[i], b = x[i + half];
        const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
        x[i] = ac - bs;
        x[i + half] = bc + as;
    }
}

static inline void vec_exp_from(int64_t i, const float *x, float *y, int64_t n) {
    for (; i < n; i++) y[i] = mq_vec_expf(x[i]);
}

/* RMSNorm's last step: out[k] = w[k] * (x[k] * inv) */
static inline void vec_norm_scale_from(int64_t i, const float *x, const float *w, float inv, float *out,
                                       int64_t n) {
    for (; i < n; i++) {
        const float xs = x[i] * inv;
        out[i] = w[i] * xs;
    }
}

static inline void vec_swiglu_from(int64_t i, float *g, const float *u, int64_t n) {
    for (; i < n; i++) g[i] = mq_vec_silu(g[i]) * u[i];
}

/* The first k >= i with x[k] == v, or 0 when there is none (logsumexp's argmax, whose maximum
 * some x[k] holds unless it is NaN). */
static inline int64_t vec_first_equal_from(int64_t i, const float *x, int64_t n, float v) {
    for (; i < n; i++)
        if (x[i] == v) return i;
    return 0;
}

/* y[r] = alpha * dot(W + r * ldw, x, n) for r < rows: groups of R rows through the twin's
 * `block` (x loaded once per step for all R), the rows past the last group through its `dot`.
 * Inlined into the twin's gemv, so both calls are direct. */
static inline __attribute__((always_inline)) void vec_gemv_rows(
    const float *W, int64_t ldw, int64_t rows, const float *x, int64_t n, float alpha, float *y, int R,
    void (*block)(const float *W, int64_t ldw, const float *x, int64_t n, float alpha, float *y),
    float (*dot)(const float *a, const float *b, int64_t n)) {
    int64_t r = 0;
    for (; r + R <= rows; r += R) block(W + r * ldw, ldw, x, n, alpha, y + r);
    for (; r < rows; r++) y[r] = alpha * dot(W + r * ldw, x, n);
}
/* A twin's gemv_<isa>: vec_gemv_rows over its R-row `block` and dot_<isa>. */
#define MQ_VEC_GEMV(isa, R, block)                                                                 \
    static void gemv_##isa(const float *W, int64_t ldw, int64_t rows, const float *x, int64_t n,   \
                           float alpha, float *y) {                                                \
        vec_gemv_rows(W, ldw, rows, x, n, alpha, y, R, block, dot_##isa);                          \
    }

/* A twin's row of mq_vec_kernels, its functions named <operation>_<isa>. */
#define MQ_VEC_KERNELS_OF(isa)                                                                     \
    {.dot = dot_##isa, .gemv = gemv_##isa, .gemv_t = gemv_t_##isa, .axpy = axpy_##isa,             \
     .rope = rope_##isa, .exp = exp_##isa, .softmax = softmax_##isa, .logsumexp = logsumexp_##isa, \
     .kl = kl_##isa, .rmsnorm = rmsnorm_##isa, .swiglu = swiglu_##isa}

#endif
