/*
 * exp_lanes.h's exps and SiLU on X86_W-bit registers (256: AVX2+FMA, 512: AVX-512F), the
 * intrinsics' names built from the width: the including header (exp_avx2.h, exp_avx512.h) sets
 * X86_W, X86_ROUND (the rounding instruction: round on AVX, roundscale on AVX-512) and X86_ISA
 * (the functions' suffix), and gets mq_exp_<isa> (fp32 lanes of mq_vec_expf), mq_expd_<isa>
 * (fp64 lanes of mq_vec_exp_sum_term) and mq_silu_<isa> (fp32 lanes of mq_vec_silu).
 */
#define X86_CAT_(a, b, c) a##b##c
#define X86_CAT(a, b, c) X86_CAT_(a, b, c)
#define X86_OP_(op) X86_CAT(_mm, X86_W, _##op)
#define X86_OP(op) X86_OP_(op)          /* _mm<W>_<op> */
#define X86_CAST_(t) X86_CAT(castsi, X86_W, _##t)
#define X86_CAST(t) X86_OP(X86_CAST_(t))   /* _mm<W>_castsi<W>_<t>: integer bits as t lanes */
#define X86_XOR X86_OP(X86_CAT(xor_si, X86_W, ))
#define X86_NAME(f) X86_CAT(f, _, X86_ISA)

#define VF X86_CAT(__m, X86_W, )
#define VD X86_CAT(__m, X86_W, d)
#define F_SET1(c) X86_OP(set1_ps)(c)
#define F_MAX(a, b) X86_OP(max_ps)(a, b)
#define F_MIN(a, b) X86_OP(min_ps)(a, b)
#define F_MUL(a, b) X86_OP(mul_ps)(a, b)
#define F_ADD(a, b) X86_OP(add_ps)(a, b)
#define F_SUB(a, b) X86_OP(sub_ps)(a, b)
#define F_FMA(a, b, c) X86_OP(fmadd_ps)(a, b, c)
#define F_FNMA(a, b, c) X86_OP(fnmadd_ps)(a, b, c)
#define F_RINT(a) X86_OP(X86_CAT(X86_ROUND, _ps, ))(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define F_FLOOR(a) X86_OP(X86_CAT(X86_ROUND, _ps, ))(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
/* 2^n: (n + 127) << 23 as the lanes' bits */
#define F_POW2(n) \
    X86_CAST(ps)(X86_OP(slli_epi32)(X86_OP(add_epi32)(X86_OP(cvtps_epi32)(n), X86_OP(set1_epi32)(127)), 23))
#define D_SET1(c) X86_OP(set1_pd)(c)
#define D_MAX(a, b) X86_OP(max_pd)(a, b)
#define D_MUL(a, b) X86_OP(mul_pd)(a, b)
#define D_FMA(a, b, c) X86_OP(fmadd_pd)(a, b, c)
#define D_FNMA(a, b, c) X86_OP(fnmadd_pd)(a, b, c)
#define D_RINT(a) X86_OP(X86_CAT(X86_ROUND, _pd, ))(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* 2^n: n narrowed to int32 lanes and widened back, (n + 1023) << 52 as the lanes' bits (1023 in
 * each 64-bit lane: two int32 1023s shifted down by 32) */
#define D_POW2(n)                                                                                  \
    X86_CAST(pd)(X86_OP(slli_epi64)(X86_OP(add_epi64)(X86_OP(cvtepi32_epi64)(X86_OP(cvtpd_epi32)(n)), \
                                                      X86_OP(srli_epi64)(X86_OP(set1_epi32)(1023), 32)), 52))

#define EXP_F X86_NAME(mq_exp)
#define EXPD_D X86_NAME(mq_expd)
#include "kernels/cpu/exp_lanes.h"

/* silu(g) = g / (1 + exp(-g)), lane-wise as mq_vec_silu (-g: the sign bit flipped). */
static inline __attribute__((always_inline)) X86_CAT(__m, X86_W, ) X86_NAME(mq_silu)(X86_CAT(__m, X86_W, ) g) {
    const X86_CAT(__m, X86_W, i) sign = X86_OP(set1_epi32)((int)0x80000000u);
    const X86_CAT(__m, X86_W, ) ng = X86_CAST(ps)(X86_XOR(X86_OP(X86_CAT(castps_si, X86_W, ))(g), sign));
    return X86_OP(div_ps)(g, X86_OP(add_ps)(X86_OP(set1_ps)(1.0f), X86_NAME(mq_exp)(ng)));
}

#undef X86_CAT_
#undef X86_CAT
#undef X86_OP_
#undef X86_OP
#undef X86_CAST_
#undef X86_CAST
#undef X86_XOR
#undef X86_NAME
