/*
 * exp and SiLU for 8 fp32 lanes and exp for 4 double lanes, shared by the AVX2 vector kernels
 * (vec_avx2.c) and the MoE kernels (moe_avx2.c): lane-wise twins of mq_vec_expf, mq_vec_silu and
 * mq_vec_exp_sum_term (src/kernels/cpu/ref/vec_ref.c), the exps exp_lanes.h's, so both kernel
 * families and their scalar references compute exp with one polynomial.
 * Include only from files compiled with -mavx2 -mfma.
 */
#ifndef MOEQ_KERNELS_X86_EXP_AVX2_H
#define MOEQ_KERNELS_X86_EXP_AVX2_H

#include <immintrin.h>

#define X86_W 256
#define X86_ROUND round
#define X86_ISA avx2
#include "kernels/cpu/x86/exp_x86.h"
#undef X86_W
#undef X86_ROUND
#undef X86_ISA

#endif
