/*
 * AVX-512 kernels of the quantized MoE feed-forward op with VNNI (VPDPBUSD: Cascade Lake, Ice
 * Lake, Sapphire Rapids and later Xeons, AMD Zen 4 and later): the body in moe_avx512_body.h.
 * This file alone is compiled with -mavx512vnni and its kernels are called only when the CPU
 * reports it (mq_cpu_has_avx512_vnni()). Twins of src/kernels/cpu/ref/moe_ref.c, bit-identical
 * (tests/test_moe_ffn_kernels.c).
 */
#define MQ_AVX512_VNNI 1
#include "kernels/cpu/x86/moe_avx512_body.h"

const mq_moe_kernels mq_moe_kernels_avx512_vnni = {quant_act_avx512, gemm_avx512};
