/*
 * AVX-512F/BW/VL kernels of the quantized MoE feed-forward op (int16 lanes within a block, for
 * CPUs without VNNI: Skylake-SP/X, Cascade Lake has VNNI): the body in moe_avx512_body.h. Called
 * only when the CPU reports the extensions (mq_cpu_has_avx512()). Twins of
 * src/kernels/cpu/ref/moe_ref.c, bit-identical (tests/test_moe_ffn_kernels.c).
 */
#define MQ_AVX512_VNNI 0
#include "kernels/cpu/x86/moe_avx512_body.h"

const mq_moe_kernels mq_moe_kernels_avx512 = {quant_act_avx512, gemm_avx512};
