/*
 * The kernel families' tables of CPU implementations, one row per instruction set (mq_isa, from
 * the CPU's features detected once and the MOEQ_FORCE_REF / MOEQ_NO_AVX512 switches), in the way
 * ggml's type_traits_cpu gives each format its functions: a caller asks its family for the set
 * of now (mq_vec(), mq_det(), mq_moe_kernels_active(), mq_ggml_dot(), mq_gptq_cpu()) and calls through it, and a family without
 * a twin for an instruction set names the next lower one it has. Every row of every table agrees
 * bit for bit with the scalar reference (the family headers say how; the tests in the "kernel
 * twins" table of docs/kernels-and-hosts.md compare them). The rows of another architecture stay
 * NULL: mq_cpu_isa() never returns them.
 */
#include "kernels/gemm_det.h"
#include "kernels/ggml_mat.h"
#include "kernels/gptq_kernels.h"
#include "kernels/moe_ffn.h"
#include "kernels/vec.h"

/* A table row per instruction set of this architecture (the others stay NULL). */
#if defined(__x86_64__) || defined(__i386__)
#define X86_ROWS(avx2, avx512, vnni) \
    [MQ_ISA_AVX2] = avx2, [MQ_ISA_AVX512] = avx512, [MQ_ISA_AVX512_VNNI] = vnni,
#else
#define X86_ROWS(avx2, avx512, vnni)
#endif
#if defined(__aarch64__)
#define ARM_ROWS(neon, dot) [MQ_ISA_NEON] = neon, [MQ_ISA_NEON_DOT] = dot,
#else
#define ARM_ROWS(neon, dot)
#endif

/* A family's table, one row per instruction set, and its accessor `fn`: the row of mq_cpu_isa(). */
#define FAMILY(T, fn, ref, avx2, avx512, vnni, neon, neon_dot)                                     \
    static const T *const k_##fn[MQ_ISA_COUNT] = {                                                 \
        [MQ_ISA_REF] = ref, X86_ROWS(avx2, avx512, vnni) ARM_ROWS(neon, neon_dot)};                \
    const T *fn(void) { return k_##fn[mq_cpu_isa()]; }

FAMILY(mq_vec_kernels, mq_vec, &mq_vec_ref, &mq_vec_avx2, &mq_vec_avx512, &mq_vec_avx512,
       &mq_vec_neon, &mq_vec_neon)
FAMILY(mq_det_kernels, mq_det, &mq_det_ref, &mq_det_avx2, &mq_det_avx512, &mq_det_avx512,
       &mq_det_neon, &mq_det_neon)
FAMILY(mq_moe_kernels, mq_moe_kernels_active, &mq_moe_kernels_ref, &mq_moe_kernels_avx2,
       &mq_moe_kernels_avx512, &mq_moe_kernels_avx512_vnni, &mq_moe_kernels_neon,
       &mq_moe_kernels_neon_dot)
/* GGUF rows' dot products: AVX2 and AVX-512 twins (VNNI has nothing to add), the reference on Arm */
FAMILY(mq_ggml_dot_kernels, mq_ggml_dot, &mq_ggml_dot_ref, &mq_ggml_dot_avx2, &mq_ggml_dot_avx512,
       &mq_ggml_dot_avx512, &mq_ggml_dot_ref, &mq_ggml_dot_ref)
/* GPTQ's column steps: AVX2 and AVX-512 twins (VNNI has nothing to add), the reference on Arm */
FAMILY(mq_gptq_kernels, mq_gptq_cpu, &mq_gptq_kernels_ref, &mq_gptq_kernels_avx2,
       &mq_gptq_kernels_avx512, &mq_gptq_kernels_avx512, &mq_gptq_kernels_ref, &mq_gptq_kernels_ref)
