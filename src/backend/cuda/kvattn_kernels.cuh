/*
 * The attention of generation over a KV cache (decode.cu, mq_gpu_kvattn_run): its kernels and
 * the order it queues them in, in one header that decode.cu includes for the device and
 * kvattn_emu.cu includes under the SIMT emulator (simt_emu.cuh, MQM_EMU), so that the tests run
 * the same source on the host: what differs is only the Dev a layer runs on (kv_layer_steps).
 *
 * Attention (k_attend_cached): one block per (new token i, query head h), kept simple on purpose:
 * the query at position p = p0 + i sees cache rows [lo, p] (lo = p - window + 1 under a sliding
 * window, else 0) of KV head h / (H / KV). Each score is one fmaf chain over the head's
 * dimensions times the softmax scale 1/sqrt(hd), written into the block's row of the scratch S;
 * the block's maximum, the exponentials with moeq's expf (vec_dev.cuh) and their sum are tree
 * reductions in shared memory; each output dimension is one fmaf chain over the visible keys in
 * key order of p_j v_j, p_j = e_j / sum (the CPU's softmax then P V, summed in another order).
 * So a token's result does not depend on the tokens beside it in the call: prefill in one call
 * and token by token give the same bits in the fp32 mode (tests/test_gpu_generate.c,
 * tests/test_gpu_kvattn_emu.c).
 */
#ifndef MOEQ_BACKEND_CUDA_KVATTN_KERNELS_CUH
#define MOEQ_BACKEND_CUDA_KVATTN_KERNELS_CUH

#include <math.h>
#include <stdint.h>

extern "C" {
#include "backend/gpu.h"
}
#include "backend/cuda/attn_kernels.cuh"
#include "backend/cuda/kern_qual.cuh"
#include "backend/cuda/vec_dev.cuh"

namespace {

enum { ATT_THREADS = 128 };

/* Block (i, h): new token i (position p0 + i), query head h; q [n, H*hd], the caches [max_T,
 * KV*hd], out [n, H*hd], S [n * H, ldS] scratch (ldS >= p0 + n). */
MQ_KERNEL0 k_attend_cached(const float *q, const float *kc, const float *vc, float *out, float *S, int64_t ldS,
                           int64_t p0, int64_t H, int64_t KV, int64_t hd, int64_t window, float scale) {
    const int64_t i = blockIdx.x, h = blockIdx.y, p = p0 + i;
    const int64_t kvh = h / (H / KV), QD = H * hd, KVD = KV * hd;
    const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0, hi = p + 1;
    const float *qv = q + i * QD + h * hd;
    float *row = S + (i * H + h) * ldS;
    MQ_SHARED_ARR(float, red, [ATT_THREADS]);
    float m = -INFINITY;
    for (int64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const float *kv = kc + j * KVD + kvh * hd;
        float s = 0.0f;
        for (int64_t d = 0; d < hd; d++) s = fmaf(qv[d], kv[d], s);
        s = s * scale;
        row[j] = s;
        m = s > m ? s : m;
    }
    const float mx = block_max(red, m);
    float sum = 0.0f;
    for (int64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) {   /* each thread its own keys again */
        const float e = mqd::vec_expf(row[j] - mx);
        row[j] = e;
        sum += e;
    }
    const float total = block_sum(red, sum);
    /* the row's exponentials, written by every thread above, are visible after the barriers */
    const float *vh = vc + kvh * hd;
    for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int64_t j = lo; j < hi; j++) acc = fmaf(row[j] / total, vh[j * KVD + d], acc);
        out[i * QD + h * hd + d] = acc;
    }
}

/* pos[t] = p0 + t: the rows' positions for k_rope. */
MQ_KERNEL0 k_positions(int32_t *pos, int64_t n, int64_t p0) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) pos[t] = (int32_t)(p0 + t);
}

/* A layer's weights and caches (device memory; host memory under the emulator). */
struct KvLayer {
    bool set;
    unsigned have;    /* bit i: Linear i (q, k, v, o) given */
    bool has_bq, has_bk, has_bv, has_bo;
    int64_t window;
    float *norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *bo, *qn, *kn, *fnorm, *router;
    float *kc, *vc;   /* [max_T, KV*hd] each */
};

/* One call of mq_gpu_kvattn_run on layer L: n new tokens at positions p0.., x [n, D] the residual
 * (in place), xf [n, D] the FFN input (or NULL); the scratch of mq_gpu_kvattn (xn [n, D], q and
 * att [n, H*hd], y [n, D], S [n * H, max_T], pos [n]; with route the logits [n, E], rsel and rw
 * [n, top_k]) and the RoPE tables [max_T, hd / 2]. */
struct KvStep {
    const mq_gpu_attn_shape *sh;
    const KvLayer *L;
    int64_t n, p0;
    float *x, *xf;
    float *xn, *q, *att, *y, *S;
    int32_t *pos;
    const float *cos_t, *sin_t;
    bool route;
    float *logits, *rw;
    int32_t *rsel;
};

/* y [R, n_out] (row stride n_out) = x [R, n_in] W^T (+ b): the product, then the bias. */
template <class Dev>
moeq_status kv_linear(Dev &dev, const float *x, int64_t R, const float *W, int64_t n_out, int64_t n_in, const float *b,
                      float *y) {
    moeq_status st = dev.product(R, n_out, n_in, x, W, y, n_out);
    if (!st && b) st = dev.launch("k_bias", k_bias, grid_for(R * n_out), 256, y, b, R, n_out);
    return st;
}

/* The layer's work in the CPU forward's order (src/model/forward.c's attention_block): RMSNorm
 * of x (the sum of squares in double); q, k, v = the projections of it (+ biases), k and v written
 * straight into the cache at rows p0.. (as forward.c writes them into its cache); the q/k norms,
 * clip_qkv on q, k and v, RoPE of q and k at the tokens' positions; attention; o projection (+
 * bias); the residual add; then, as asked, the FFN norm and the routing. Dev::launch(name,
 * kernel, grid, block, args...) runs a kernel (decode.cu: queued on stream 0, the launch's error
 * checked), Dev::product(M, N, K, A, B, C, ldc) is mq_cu_product's C [M, N] = A [M, K] B [N, K]^T. */
template <class Dev> moeq_status kv_layer_steps(Dev &dev, const KvStep &k) {
    const mq_gpu_attn_shape *sh = k.sh;
    const KvLayer *L = k.L;
    const int64_t n = k.n, p0 = k.p0, D = sh->D, H = sh->H, KV = sh->KV, hd = sh->hd;
    const int64_t QD = H * hd, KVD = KV * hd;
    float *kc = L->kc + p0 * KVD, *vc = L->vc + p0 * KVD;   /* the new rows of the caches */
    moeq_status st = dev.launch("k_positions", k_positions, dim3((unsigned)((n + 255) / 256)), 256, k.pos, n, p0);
    if (!st) st = dev.launch("k_rmsnorm", k_rmsnorm, (unsigned)n, NORM_THREADS, k.xn, k.x, n, D, L->norm, sh->eps);
    if (!st) st = kv_linear(dev, k.xn, n, L->wq, QD, D, L->has_bq ? L->bq : NULL, k.q);
    if (!st) st = kv_linear(dev, k.xn, n, L->wk, KVD, D, L->has_bk ? L->bk : NULL, kc);
    if (!st) st = kv_linear(dev, k.xn, n, L->wv, KVD, D, L->has_bv ? L->bv : NULL, vc);
    if (!st && sh->qk_norm) {
        const bool full = sh->qk_norm == 1;
        const int64_t qr = full ? n : n * H, kr = full ? n : n * KV;
        st = dev.launch("k_rmsnorm", k_rmsnorm, (unsigned)qr, NORM_THREADS, k.q, k.q, qr, full ? QD : hd, L->qn,
                        sh->eps);
        if (!st)
            st = dev.launch("k_rmsnorm", k_rmsnorm, (unsigned)kr, NORM_THREADS, kc, kc, kr, full ? KVD : hd, L->kn,
                            sh->eps);
    }
    if (!st && sh->clip_qkv > 0) {
        st = dev.launch("k_clip", k_clip, grid_for(n * QD), 256, k.q, n * QD, sh->clip_qkv);
        if (!st) st = dev.launch("k_clip", k_clip, grid_for(n * KVD), 256, kc, n * KVD, sh->clip_qkv);
        if (!st) st = dev.launch("k_clip", k_clip, grid_for(n * KVD), 256, vc, n * KVD, sh->clip_qkv);
    }
    if (!st) st = dev.launch("k_rope", k_rope, grid_for(n * QD / 2), 256, k.q, n, H, hd, k.pos, k.cos_t, k.sin_t);
    if (!st) st = dev.launch("k_rope", k_rope, grid_for(n * KVD / 2), 256, kc, n, KV, hd, k.pos, k.cos_t, k.sin_t);
    if (!st) {
        const float scale = (float)(1.0 / sqrt((double)hd));
        st = dev.launch("k_attend_cached", k_attend_cached, dim3((unsigned)n, (unsigned)H), ATT_THREADS, k.q, L->kc,
                        L->vc, k.att, k.S, sh->max_T, p0, H, KV, hd, L->window, scale);
    }
    if (!st) st = kv_linear(dev, k.att, n, L->wo, D, QD, L->has_bo ? L->bo : NULL, k.y);
    if (!st) st = dev.launch("k_add", k_add, grid_for(n * D), 256, k.x, k.y, n * D);
    if (!st && k.xf) st = dev.launch("k_rmsnorm", k_rmsnorm, (unsigned)n, NORM_THREADS, k.xf, k.x, n, D, L->fnorm, sh->eps);
    if (!st && k.route) st = kv_linear(dev, k.xf, n, L->router, sh->E, D, NULL, k.logits);
    if (!st && k.route)
        st = dev.launch("k_route_softmax", k_route_softmax, (unsigned)((n + 127) / 128), 128, k.logits, n, sh->E,
                        sh->top_k, sh->norm_topk, k.rsel, k.rw);
    return st;
}

}  // namespace

#endif
