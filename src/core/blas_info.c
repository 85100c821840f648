/*
 * Which kernels OpenBLAS runs, and the OPENBLAS_CORETYPE that suits this CPU when they are weaker
 * than it. OpenBLAS's DYNAMIC_ARCH builds (Debian's) pick their kernels by CPU model when the
 * library loads. Before 0.3.25 they fell back to the Prescott (SSE3) kernels on an Intel model
 * they did not know (OpenBLAS issue 4267): Debian 12's 0.3.21 on Xeons newer than it (Emerald and
 * Granite Rapids), or in a VM that hides the model. Those kernels run sgemm about 4x slower than
 * the AVX2 ones (two threads of this project's AVX-512 host: 48 GFLOP/s against 184-342 with
 * OPENBLAS_CORETYPE=Haswell or SkylakeX), and with them GPTQ's updates and factorisations and
 * the attention's products. OpenBLAS reads the variable only when it loads, so only a new
 * process can act on the advice: the CLI re-executes itself with it (tools/moeq/main.c).
 */
#define _POSIX_C_SOURCE 200809L
#include <cblas.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core.h"
#include "core/env.h"

/* OpenBLAS's kernel sets without AVX2 (the names its openblas_get_corename gives, in any case). */
static const char *const g_pre_avx2[] = {
    "unknown", "katmai", "coppermine", "northwood", "prescott", "banias", "atom", "core2", "penryn",
    "dunnington", "nehalem", "sandybridge", "athlon", "opteron", "opteron_sse3", "barcelona", "bobcat",
    "bulldozer", "piledriver", "steamroller", "nano",
};

const char *mq_blas_advice_for(const char *core, bool avx2_fma, bool avx512) {
    if (!core || !avx2_fma) return NULL;
    for (size_t i = 0; i < sizeof g_pre_avx2 / sizeof g_pre_avx2[0]; i++)
        if (!strcasecmp(core, g_pre_avx2[i])) return avx512 ? "SkylakeX" : "Haswell";
    return NULL;
}

/* OpenBLAS's SkylakeX kernels use AVX-512 F, CD, BW, DQ and VL (libgcc checks that the OS saves
 * the zmm state before it reports any of them). */
static bool cpu_has_skylakex(void) {
#if defined(__x86_64__)
    return mq_cpu_has_avx512() && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq");
#else
    return false;
#endif
}

const char *moeq_blas_kernels(void) {
    const char *c = openblas_get_corename();
    return c && *c ? c : "unknown";
}

const char *moeq_blas_coretype_advice(void) {
    /* MOEQ_DEBUG_BLAS_PRETEND_CORE: the kernel set to judge instead of OpenBLAS's (tests) */
    const char *pretend = mq_env(MQ_ENV_BLAS_PRETEND_CORE);
    return mq_blas_advice_for(pretend && *pretend ? pretend : moeq_blas_kernels(), mq_cpu_has_avx2_fma(),
                              cpu_has_skylakex());
}
