/*
 * exp and SiLU for 16 fp32 lanes and exp for 8 double lanes, for the AVX-512 vector kernels
 * (vec_avx512.c): lane-wise twins of mq_vec_expf, mq_vec_silu and mq_vec_exp_sum_term
 * (src/kernels/cpu/ref/vec_ref.c), exp_lanes.h's exps on the registers of exp_avx2.h's twice as
 * wide. Include only from files compiled with -mavx512f.
 */
#ifndef MOEQ_KERNELS_X86_EXP_AVX512_H
#define MOEQ_KERNELS_X86_EXP_AVX512_H

#include <immintrin.h>

#define X86_W 512
#define X86_ROUND roundscale
#define X86_ISA avx512
#include "kernels/cpu/x86/exp_x86.h"
#undef X86_W
#undef X86_ROUND
#undef X86_ISA

#endif
