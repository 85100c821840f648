/*
 * NEON kernels of the quantized MoE feed-forward op for every AArch64 CPU (Advanced SIMD is part
 * of the base architecture): the body in moe_neon_body.h with widening multiply-accumulates.
 * Twins of src/kernels/cpu/ref/moe_ref.c, bit-identical (tests/test_moe_ffn_kernels.c).
 */
#define MQ_NEON_DOT 0
#include "kernels/cpu/arm/moe_neon_body.h"

const mq_moe_kernels mq_moe_kernels_neon = {quant_act_neon, gemm_neon};
