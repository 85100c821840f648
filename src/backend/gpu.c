/* What the GPU backend does the same with or without CUDA: parsing --device, naming modes, and
 * the arithmetic of what its objects take on the device (the memory plan's, gpu.h). */
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

/* ---- planning: each sum follows the allocations of the .cu file named (bytes requested) ------- */

int64_t mq_gpu_attn_bytes(const mq_gpu_attn_shape *sh, int64_t rows) {
    /* attention.cu mq_gpu_attn_new and group_alloc */
    const int64_t D = sh->D, QD = sh->H * sh->hd, KVD = sh->KV * sh->hd, T = sh->max_T, tt = T * T;
    const bool route = sh->E > 0 && sh->top_k > 0;
    int64_t heads = MQ_GPU_ATTN_SCORES_FLOATS / tt < sh->KV ? MQ_GPU_ATTN_SCORES_FLOATS / tt : sh->KV;
    if (heads < 1) heads = 1;
    const int64_t R = rows > 0 ? (rows > T ? rows : T) : (MQ_GPU_ATTN_GROUP_ROWS > T ? MQ_GPU_ATTN_GROUP_ROWS : T);
    int64_t f = D + QD * D + 2 * KVD * D + D * QD + QD + 2 * KVD + D + QD + KVD +   /* weights, biases, norms */
                2 * (T * (sh->hd / 2)) + heads * tt + D + (route ? sh->E * D : 0);  /* RoPE, scores, FFN norm, router */
    f += R * (3 * D + 2 * QD + 2 * KVD) + R;                                         /* a group's rows, positions */
    if (route) f += R * (sh->E + 2 * sh->top_k);                                     /* logits, weights, choices */
    return f * 4;
}

int64_t mq_gpu_mlp_bytes(int64_t E, int64_t D, int64_t F, bool down, int64_t max_rows, int lanes) {
    /* mlp.cu mq_gpu_mlp_new and lane_alloc */
    const int64_t r = max_rows > 0 ? max_rows : 1;
    return E * (down ? 3 : 2) * D * F * 4 + (int64_t)(lanes > 0 ? lanes : 1) * (r * (2 * D + 2 * F) * 4 + r * 4);
}

int64_t mq_gpu_hessians_bytes(int64_t K) { return K * K * 4; }   /* hessian.cu: the sum */

int64_t mq_gpu_kvattn_rows_for(const mq_gpu_attn_shape *sh, int64_t rows) {
    /* decode.cu: a call's scores [rows, H, max_T] stay within MQ_GPU_KVATTN_SCORES_FLOATS */
    int64_t r = rows > 0 ? rows : 1, fit = MQ_GPU_KVATTN_SCORES_FLOATS / (sh->H * sh->max_T);
    r = r < sh->max_T ? r : sh->max_T;
    r = r < fit ? r : fit;
    return r > 0 ? r : 1;
}

int64_t mq_gpu_kvattn_bytes(const mq_gpu_attn_shape *sh, int n_layers, int routed, int64_t rows) {
    /* decode.cu mq_gpu_kvattn_new, its layers' weights and caches, and the routers _set adds */
    const int64_t D = sh->D, QD = sh->H * sh->hd, KVD = sh->KV * sh->hd, T = sh->max_T;
    const int64_t R = mq_gpu_kvattn_rows_for(sh, rows);
    const bool route = sh->E > 0 && sh->top_k > 0;
    int64_t f = 2 * (T * (sh->hd / 2)) + R * (2 * D + 2 * QD) + R * sh->H * T + R;   /* RoPE, scratch, positions */
    if (route) f += R * (sh->E + 2 * sh->top_k);
    const int64_t layer = D + QD * D + 2 * KVD * D + D * QD + QD + 2 * KVD + D + QD + KVD + D + 2 * T * KVD;
    f += (int64_t)n_layers * layer + (route ? (int64_t)routed * sh->E * D : 0);
    return f * 4;
}

/* gptq.cu's carver: each piece rounded up to 256 bytes */
static int64_t piece(int64_t bytes) { return (bytes + 255) / 256 * 256; }

int64_t mq_gpu_gptq_bytes(const mq_qspec *s, const mq_gptq_opts *o, int64_t K, int64_t rows) {
    /* gptq.cu lay_factor, lay_set, item_bytes and run_wave's own pieces, for one Hessian */
    const bool nvfp4 = s->scheme == MQ_QS_NVFP4, loop = s->mse && o->mse_weight == MQ_GPTQ_MSE_LOOP;
    const int64_t G = mq_qspec_group(s, K), ng = G > 0 ? K / G : 1, ld = rows, kl = K * ld;
    const int64_t B = 32 < K ? 32 : K;   /* gptq.cu's GPU_BLOCK */
    const int64_t gp = (int64_t)sizeof(mq_gparams);
    int64_t b = 0;
    /* the factor: diag, its permuted copy, dead; perm and its inverse; first non-finite, raw
     * diagonal; H (then R), A (L), U */
    b += 2 * piece(K * 4) + piece(K) + (o->act_order ? 2 * piece(K * 4) : 0) + piece(8) + piece(K * 4) +
         3 * piece(K * K * 4);
    /* the set: group metadata; first non-finite; rows, their transpose, the original, codes,
     * a block's errors, steps, zeros, parameters, a group's values (and its errors and U's
     * columns for the in-loop search); packed codes, NVFP4 block codes or parameters, losses */
    b += 2 * piece(ng * G * 4) + piece(ng * 4) + piece(K * 4) + piece(ld * 4) + piece(8);
    b += 3 * piece(kl * 4) + piece(kl) + piece(B * ld * 4) + 2 * piece(ng * ld * 4) + piece(ng * ld * gp) +
         piece(G * ld * 4) + (loop ? piece(G * ld * 4) + piece(ng * G * G * 4) : 0);
    b += piece(kl / 2) + (nvfp4 ? piece(ng * ld) : piece(ng * ld * gp)) + piece(4 * ld * 8);
    b += 8 * 256 + 256;   /* item_bytes' margin (the wave's own pieces), the arena's alignment */
    b = (b + ((int64_t)2 << 20) - 1) / ((int64_t)2 << 20) * ((int64_t)2 << 20);   /* the pool's 2 MiB pages */
    /* cuSOLVER's potrf workspace (cusolverDnSpotrf_bufferSize, kept per stream): a panel of K
     * columns at most, counted as 256 of them */
    b += K * (K < 256 ? K : 256) * 4;
    return b;
}
