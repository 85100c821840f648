/* What the GPU backend does the same with or without CUDA: parsing --device, naming modes. */
#include "backend/gpu.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int moeq_gpu_backend_built(void) { return mq_gpu_built() ? 1 : 0; }

const char *mq_gpu_precision_name(moeq_gpu_precision p) {
    return p == MOEQ_GPU_TF32 ? "tf32" : p == MOEQ_GPU_TF32X3 ? "tf32x3" : p == MOEQ_GPU_BF16 ? "bf16" : "fp32";
}

moeq_status mq_gpu_parse_device(const char *s, int *device) {
    *device = -1;
    if (!s || !strcmp(s, "cpu")) return MOEQ_OK;
    if (!strcmp(s, "cuda")) {
        *device = 0;
        return MOEQ_OK;
    }
    if (!strncmp(s, "cuda:", 5) && s[5] >= '0' && s[5] <= '9') {
        char *end;
        errno = 0;
        long v = strtol(s + 5, &end, 10);
        if (!*end && !errno && v >= 0 && v < 1024) {
            *device = (int)v;
            return MOEQ_OK;
        }
    }
    return mq_err(MOEQ_E_ARG, "--device %s: expected cpu, cuda or cuda:N", s);
}
