/*
 * The kernel families' tables of CPU implementations, one row per instruction set (mq_isa, from
 * the CPU's features detected once and the MOEQ_FORCE_REF / MOEQ_NO_AVX512 switches), in the way
 * ggml's type_traits_cpu gives each format its functions: a caller asks its family for the set
 * of now (mq_vec(), mq_det(), mq_moe_kernels_active()) and calls through it, and a family without
 * a twin for an instruction set names the next lower one it has. Every row of every table agrees
 * bit for bit with the scalar reference (the family headers say how; the tests in the "kernel
 * twins" table of docs/kernels-and-hosts.md compare them). The rows of another architecture stay
 * NULL: mq_cpu_isa() never returns them.
 */
#include "kernels/gemm_det.h"
#include "kernels/moe_ffn.h"
#include "kernels/vec.h"

static const mq_vec_kernels *const k_vec[MQ_ISA_COUNT] = {
    [MQ_ISA_REF] = &mq_vec_ref,
#if defined(__x86_64__) || defined(__i386__)
    [MQ_ISA_AVX2] = &mq_vec_avx2,
    [MQ_ISA_AVX512] = &mq_vec_avx512,
    [MQ_ISA_AVX512_VNNI] = &mq_vec_avx512,
#endif
#if defined(__aarch64__)
    [MQ_ISA_NEON] = &mq_vec_neon,
    [MQ_ISA_NEON_DOT] = &mq_vec_neon,
#endif
};

static const mq_det_kernels *const k_det[MQ_ISA_COUNT] = {
    [MQ_ISA_REF] = &mq_det_ref,
#if defined(__x86_64__) || defined(__i386__)
    [MQ_ISA_AVX2] = &mq_det_avx2,
    [MQ_ISA_AVX512] = &mq_det_avx512,
    [MQ_ISA_AVX512_VNNI] = &mq_det_avx512,
#endif
#if defined(__aarch64__)
    [MQ_ISA_NEON] = &mq_det_neon,
    [MQ_ISA_NEON_DOT] = &mq_det_neon,
#endif
};

static const mq_moe_kernels *const k_moe[MQ_ISA_COUNT] = {
    [MQ_ISA_REF] = &mq_moe_kernels_ref,
#if defined(__x86_64__) || defined(__i386__)
    [MQ_ISA_AVX2] = &mq_moe_kernels_avx2,
    [MQ_ISA_AVX512] = &mq_moe_kernels_avx512,
    [MQ_ISA_AVX512_VNNI] = &mq_moe_kernels_avx512_vnni,
#endif
#if defined(__aarch64__)
    [MQ_ISA_NEON] = &mq_moe_kernels_neon,
    [MQ_ISA_NEON_DOT] = &mq_moe_kernels_neon_dot,
#endif
};

const mq_vec_kernels *mq_vec(void) { return k_vec[mq_cpu_isa()]; }
const mq_det_kernels *mq_det(void) { return k_det[mq_cpu_isa()]; }
const mq_moe_kernels *mq_moe_kernels_active(void) { return k_moe[mq_cpu_isa()]; }
