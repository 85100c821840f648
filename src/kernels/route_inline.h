/*
 * The router's softmax choice of experts for one token, as a `static inline` function that C and
 * nvcc both compile: the CPU's forward (src/model/forward.c, route_rows) and the GPU's attention
 * twin (src/backend/cuda/attention.cu, k_route_softmax, one thread a token) run these very lines,
 * so they pick the same experts with the same weights for the same logits.
 *
 * transformers' MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock: softmax over all E logits (the
 * sum in double), the top_k largest probabilities with ties to the lower expert, optionally
 * renormalised to sum to 1. And the grouped choice of DeepSeek-V3's router as the MoE op
 * makes it (src/kernels/moe_ffn.c, mq_moe_select, and its GPU twin in
 * src/backend/cuda/moe_kernels.cuh): the order of scores and a group's score. It sits with the
 * kernels, the floor below both model and backend.
 */
#ifndef MOEQ_KERNELS_ROUTE_INLINE_H
#define MOEQ_KERNELS_ROUTE_INLINE_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __CUDACC__
#define MQ_ROUTE static __host__ __device__ __forceinline__
#else
#define MQ_ROUTE static inline
#endif

/* p[E]: the token's logits, replaced by its probabilities; sel[K], w[K]: the chosen experts, best
 * first, and their (renormalised when norm) probabilities. */
MQ_ROUTE void mq_route_softmax_topk(float *p, int64_t E, int64_t K, bool norm, int32_t *sel,
                                    float *w) {
    float mx = p[0];
    for (int64_t e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
    double sum = 0;
    for (int64_t e = 0; e < E; e++) {
        p[e] = expf(p[e] - mx);
        sum += p[e];
    }
    for (int64_t e = 0; e < E; e++) p[e] = (float)(p[e] / sum);
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            bool taken = false;
            for (int64_t j = 0; j < k; j++) taken |= sel[j] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        sel[k] = (int32_t)best;
        w[k] = p[best];
    }
    if (norm) {
        float ws = 0;
        for (int64_t k = 0; k < K; k++) ws += w[k];
        for (int64_t k = 0; k < K; k++) w[k] /= ws;
    }
}

/* The order of the MoE op's scores: NaN ranks below every number; a tie keeps the earlier (lower)
 * index, since only a strictly better score takes its place. */
MQ_ROUTE bool mq_route_better(float a, float b) { return !isnan(a) && (isnan(b) || a > b); }

/* A group's score in DeepSeek-V3's router: the sum of its two best biased scores, p[e] + bias[e]
 * (bias NULL: p[e]) over the experts e0 .. e1 - 1 (at least two), found in index order. */
MQ_ROUTE float mq_route_group_score(const float *p, const float *bias, int64_t e0, int64_t e1) {
    float b1 = 0.0f, b2 = 0.0f;
    bool h1 = false, h2 = false;
    for (int64_t e = e0; e < e1; e++) {
        const float s = bias ? p[e] + bias[e] : p[e];
        if (!h1 || mq_route_better(s, b1)) {
            b2 = b1;
            h2 = h1;
            b1 = s;
            h1 = true;
        } else if (!h2 || mq_route_better(s, b2)) {
            b2 = s;
            h2 = true;
        }
    }
    return b1 + b2;
}

#endif
