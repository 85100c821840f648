/*
 * The element-wise kernels of a decoder layer's attention that the whole-sample twin
 * (attention.cu) and the KV-cached one (decode.cu) share: src/model/forward.c's operations in its
 * order (vec_ref.c's rmsnorm_ref with the sum of squares in double, the bias add, clip_qkv,
 * rotate-half RoPE from the host's tables at each row's position, the residual add) and the
 * router's softmax top-k (kernels/route_inline.h, the CPU forward's very lines). Each is a
 * function of its row alone. In an anonymous namespace: every .cu file that includes this gets
 * its own copy (the backend is built without relocatable device code). The SIMT emulator compiles
 * them as host code too (kern_qual.cuh; kvattn_emu.cu).
 */
#ifndef MOEQ_BACKEND_CUDA_ATTN_KERNELS_CUH
#define MOEQ_BACKEND_CUDA_ATTN_KERNELS_CUH

#include <stdint.h>

#include "backend/cuda/kern_qual.cuh"
#include "kernels/route_inline.h"

namespace {

enum { NORM_THREADS = 256 };

/* out[r] = w * (x[r] * (1 / sqrt(mean(x[r]^2) + eps))), one block of NORM_THREADS per row; out
 * may be x. */
MQ_KERNEL0 k_rmsnorm(float *out, const float *x, int64_t rows, int64_t n, const float *w, float eps) {
    const int64_t r = blockIdx.x;
    if (r >= rows) return;
    const float *xr = x + r * n;
    MQ_SHARED_ARR(double, part, [NORM_THREADS]);
    double d = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d += (double)xr[i] * (double)xr[i];
    part[threadIdx.x] = d;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
        if ((int)threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    const float var = (float)(part[0] / (double)n);
    const float inv = 1.0f / sqrtf(var + eps);
    float *o = out + r * n;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) o[i] = w[i] * (xr[i] * inv);
}

/* y[t, j] += b[j] over T rows of n. */
MQ_KERNEL0 k_bias(float *y, const float *b, int64_t T, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < T * n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = y[i] + b[i % n];
}

MQ_KERNEL0 k_clip(float *x, int64_t n, float lim) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float v = x[i];
        x[i] = v < -lim ? -lim : v > lim ? lim : v;
    }
}

/* rotate-half RoPE of x [R, nh, hd], row r at position pos[r] (vec_ref.c's rope_ref). */
MQ_KERNEL0 k_rope(float *x, int64_t R, int64_t nh, int64_t hd, const int32_t *pos, const float *cs,
                       const float *sn) {
    const int64_t half = hd / 2, n = R * nh * half;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t k = i % half, th = i / half, t = pos[th / nh];
        float *v = x + th * hd;
        const float c = cs[t * half + k], s = sn[t * half + k];
        const float a = v[k], b = v[k + half];
        v[k] = a * c - b * s;
        v[k + half] = b * c + a * s;
    }
}

/* The routing of token t (one thread each): kernels/route_inline.h, the CPU forward's very lines
 * (softmax over the E logits, the sum in double; the top_k largest probabilities with ties to the
 * lower expert, optionally renormalised). The row of logits becomes the probabilities. */
MQ_KERNEL0 k_route_softmax(float *logits, int64_t T, int64_t E, int64_t K, bool norm, int32_t *sel, float *w) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    mq_route_softmax_topk(logits + t * E, E, K, norm, sel + t * K, w + t * K);
}

MQ_KERNEL0 k_add(float *x, const float *y, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = x[i] + y[i];
}

/* The maximum and the sum of v over a block's threads (blockDim.x a power of two), every thread
 * getting the result: trees in red [blockDim.x] of shared memory (free again on return). */
MQD float block_max(float *red, float v) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
        if ((int)threadIdx.x < s && red[threadIdx.x + s] > red[threadIdx.x]) red[threadIdx.x] = red[threadIdx.x + s];
        __syncthreads();
    }
    const float r = red[0];
    __syncthreads();
    return r;
}

MQD float block_sum(float *red, float v) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
        if ((int)threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    const float r = red[0];
    __syncthreads();
    return r;
}

/* Blocks of 256 threads for n elements of a grid-stride loop. */
unsigned grid_for(int64_t n) {
    const int64_t b = (n + 255) / 256;
    return (unsigned)(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

}  // namespace

#endif
