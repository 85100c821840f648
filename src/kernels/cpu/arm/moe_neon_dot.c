/*
 * NEON kernels of the quantized MoE feed-forward op with the dot-product extension (SDOT, Armv8.2
 * and later where implemented: Neoverse N1/V1/V2, Graviton 2-4, Grace, Cortex-A55/A76 and up,
 * Apple M1 and up): the body in moe_neon_body.h. This file alone is compiled with
 * -march=armv8.2-a+dotprod and its kernels are called only when the CPU reports the extension
 * (mq_cpu_has_neon_dot()). Twins of src/kernels/cpu/ref/moe_ref.c, bit-identical
 * (tests/test_moe_ffn_kernels.c).
 */
#define MQ_NEON_DOT 1
#include "kernels/cpu/arm/moe_neon_body.h"

const mq_moe_kernels mq_moe_kernels_neon_dot = {quant_act_neon, gemm_neon};
