/*
 * A decoder layer's self-attention on the GPU for the calibration passes (backend/gpu.h,
 * mq_gpu_attn_*): what src/model/forward.c's attention_block computes for a whole sample from
 * position 0. Everything of a sample stays on the device from its upload to the residual sum;
 * the q/k/v and o inputs go from there into the Hessian sums (hessian.cu's fmaf chains), so
 * nothing but the sample itself crosses the bus.
 *
 * The element-wise parts are the CPU's operations in the CPU's order: RMSNorm with the sum of
 * squares in double (vec_ref.c's rmsnorm_ref; only the order of the double sum differs, which
 * changes the rounded fp32 variance almost never), rotate-half RoPE from the host's tables, the
 * softmax with moeq's own expf and an IEEE division. The projections (q/k/v, o, the router) are
 * tile_det.cuh's fmaf chains, the scores and P V fp32 cuBLAS GEMMs (default math: never TF32),
 * and the softmax sum is a tree, so values differ from OpenBLAS's in the last bits; the GPTQ
 * codes downstream agree with the CPU's except where a value lands within rounding of a decision
 * threshold.
 *
 * Samples go through in groups of up to `rows` tokens (mq_gpu_attn_run_samples): one upload, the
 * row-wise work (norms, projections, RoPE from each row's position, routing, the Hessian sums in
 * row order) over the whole group, the attention itself sample by sample, one synchronisation.
 * Every row-wise step is a function of its row alone and the scores are per sample, so a sample's
 * bits do not depend on the group it went in (a 500-token document alone filled few SMs and paid
 * some 50 launches and a synchronisation). In the TF32 modes (mq_gpu_set_precision) the projections
 * are cuBLAS GEMMs, whose kernel may depend on the group's rows: the groups are then a fixed
 * function of the samples' lengths, so runs stay deterministic.
 *
 * Attention: a block of queries at a time against the keys up to its last query (the blocks
 * above the diagonal are never computed); for each position j within a KV group, the scores of
 * query head g * group + j against KV head g for every g as one strided batched GEMM (S = scale
 * Q K^T, the masked keys within the block then get probability 0), a softmax kernel per row over
 * the visible keys [lo, hi), then out = P V as another batched GEMM.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <new>

#include "backend/cuda/attn_kernels.cuh"
#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/tile_det.cuh"
#include "backend/cuda/vec_dev.cuh"

namespace {

enum { SOFTMAX_THREADS = 256 };
/* The scores buffer holds at most this many floats (the heads are then done in parts). */
constexpr int64_t SCORES_FLOATS = (int64_t)1 << 28;
/* Tokens of a group (at least the longest sample): 16K rows of the row-wise work fill the GPU,
 * and its buffers take about 1 GB at a hidden size of 2048. MOEQ_DEBUG_GPU_ATTN_ROWS sets it (tests). */
constexpr int64_t GROUP_ROWS = 16384;

/* Row i of head blockIdx.y's scores S [T, T] (query i, key j at S[i * T + j]): softmax over the
 * keys [lo, i] a query sees, zero elsewhere. */
__global__ void k_softmax_causal(float *S, int64_t ld, int64_t stride, int64_t q0, int64_t k0, int64_t window) {
    /* row i of head blockIdx.y: query q0 + i against keys k0 .. k0 + ld - 1 */
    const int64_t i = blockIdx.x, q = q0 + i;
    float *row = S + (int64_t)blockIdx.y * stride + i * ld;
    const int64_t lo = (window > 0 && q - window + 1 > k0 ? q - window + 1 : k0) - k0, hi = q + 1 - k0;
    __shared__ float red[SOFTMAX_THREADS];
    float m = row[lo];
    for (int64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) m = row[j] > m ? row[j] : m;
    const float mx = block_max(red, m);
    float sum = 0.0f;
    for (int64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const float e = mqd::vec_expf(row[j] - mx);
        row[j] = e;
        sum += e;
    }
    const float total = block_sum(red, sum);
    for (int64_t j = threadIdx.x; j < ld; j += blockDim.x) row[j] = j >= lo && j < hi ? row[j] / total : 0.0f;
}

}  // namespace

/* MOEQ_DEBUG_GPU_PROFILE=1: each phase's time summed over the groups (the device synchronised at each
 * mark), printed on stderr when the twin is freed. */
enum { PH_UPLOAD, PH_NORM, PH_QKV, PH_ATTEND, PH_OUT, PH_ROUTE, PH_DOWNLOAD, N_PHASES };
static const char *const PHASE_NAMES[N_PHASES] = {"upload", "norm+H", "q/k/v", "attend", "o+H", "ffn+route",
                                                  "download"};

struct mq_gpu_attn {
    mq_gpu *g;
    bool profile;
    double t_mark, phase_s[N_PHASES];
    int64_t runs, groups;
    mq_gpu_attn_shape sh;
    int64_t QD, KVD;              /* H * hd, KV * hd */
    int64_t rows;                 /* tokens of a group */
    int64_t heads_per_call;       /* KV heads whose scores fit the buffer at max_T */
    int64_t window;               /* the current layer's */
    bool has[13];                 /* which optional weights the layer has (biases, q/k norms, router) */
    float *norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *bo, *qn, *kn, *fnorm, *router;
    float *logits, *rw;           /* [rows, E], [rows, top_k] */
    int32_t *rsel;                /* [rows, top_k] */
    int32_t *pos, *pos_h;         /* [rows] each row's position in its sample (device; pinned host) */
    float *cos_t, *sin_t;
    float *x, *xn, *q, *k, *v, *att, *y, *S;
};

extern "C" void mq_gpu_attn_free(mq_gpu_attn *a) {
    if (!a) return;
    if (a->profile && a->runs > 0)
        for (int i = 0; i < N_PHASES; i++)
            fprintf(stderr, "gpu attention: %-9s %9.2f ms in %lld samples, %lld groups\n", PHASE_NAMES[i],
                    a->phase_s[i] * 1e3, (long long)a->runs, (long long)a->groups);
    cudaSetDevice(a->g->device);
    cudaStreamSynchronize(a->g->stream[0]);
    float *bufs[] = {a->norm, a->wq, a->wk, a->wv, a->wo, a->bq, a->bk, a->bv, a->bo, a->qn, a->kn, a->fnorm,
                     a->router, a->logits, a->rw, a->cos_t, a->sin_t, a->x, a->xn, a->q, a->k, a->v, a->att,
                     a->y, a->S};
    for (float *p : bufs) mq_cu_free(p);
    mq_cu_free(a->rsel);
    mq_cu_free(a->pos);
    if (a->pos_h) cudaFreeHost(a->pos_h);
    delete a;
}

/* The buffers of a group of a->rows tokens. */
static moeq_status group_alloc(mq_gpu_attn *a) {
    const int64_t R = a->rows, D = a->sh.D;
    moeq_status st = cu_alloc(&a->x, (size_t)(R * D), "attention input");
    if (!st) st = cu_alloc(&a->xn, (size_t)(R * D), "attention input");
    if (!st) st = cu_alloc(&a->q, (size_t)(R * a->QD), "queries");
    if (!st) st = cu_alloc(&a->k, (size_t)(R * a->KVD), "keys");
    if (!st) st = cu_alloc(&a->v, (size_t)(R * a->KVD), "values");
    if (!st) st = cu_alloc(&a->att, (size_t)(R * a->QD), "attention output");
    if (!st) st = cu_alloc(&a->y, (size_t)(R * D), "o_proj output");
    if (!st) st = cu_alloc(&a->pos, (size_t)R, "token positions");
    if (!st) st = CU(cudaMallocHost(&a->pos_h, sizeof(int32_t) * (size_t)R));
    if (!st && a->sh.E > 0 && a->sh.top_k > 0) {
        st = cu_alloc(&a->logits, (size_t)(R * a->sh.E), "router logits");
        if (!st) st = cu_alloc(&a->rw, (size_t)(R * a->sh.top_k), "routing weights");
        if (!st) st = cu_alloc(&a->rsel, (size_t)(R * a->sh.top_k), "routing");
    }
    return st;
}

static void group_free(mq_gpu_attn *a) {
    float **bufs[] = {&a->x, &a->xn, &a->q, &a->k, &a->v, &a->att, &a->y, &a->logits, &a->rw};
    for (float **p : bufs) {
        mq_cu_free(*p);
        *p = NULL;
    }
    mq_cu_free(a->rsel);
    mq_cu_free(a->pos);
    if (a->pos_h) cudaFreeHost(a->pos_h);
    a->rsel = a->pos = a->pos_h = NULL;
}

extern "C" moeq_status mq_gpu_attn_new(mq_gpu *g, const mq_gpu_attn_shape *sh, mq_gpu_attn **out) {
    *out = NULL;
    if (sh->D <= 0 || sh->H <= 0 || sh->KV <= 0 || sh->hd <= 0 || sh->hd % 2 || sh->H % sh->KV || sh->max_T <= 0)
        return mq_err(MOEQ_E_SHAPE, "GPU attention: D %lld, %lld heads, %lld KV heads, head dim %lld, %lld tokens",
                      (long long)sh->D, (long long)sh->H, (long long)sh->KV, (long long)sh->hd, (long long)sh->max_T);
    moeq_status st = CU(cudaSetDevice(g->device));
    if (st) return st;
    mq_gpu_attn *a = new (std::nothrow) mq_gpu_attn;
    if (!a) return mq_err(MOEQ_E_NOMEM, "out of memory");
    memset((void *)a, 0, sizeof *a);
    a->g = g;
    a->sh = *sh;
    a->sh.rope_cos = a->sh.rope_sin = NULL;
    a->profile = mq_env(MQ_ENV_GPU_PROFILE) != NULL;
    a->QD = sh->H * sh->hd;
    a->KVD = sh->KV * sh->hd;
    const int64_t T = sh->max_T, D = sh->D, tt = T * T;
    a->heads_per_call = SCORES_FLOATS / tt < sh->KV ? SCORES_FLOATS / tt : sh->KV;
    if (a->heads_per_call < 1) a->heads_per_call = 1;
    const char *env = mq_env(MQ_ENV_GPU_ATTN_ROWS);
    const int64_t want = env && atoll(env) > 0 ? atoll(env) : GROUP_ROWS;
    a->rows = want > T ? want : T;
    if (!env) {
        /* groups of GROUP_ROWS where they take at most a quarter of the free memory, else what
         * that quarter holds (at least one sample): the planners count one sample's rows, and
         * what a bound leaves beyond that is the GPTQ waves' and the expert chunks' too */
        const bool route = sh->E > 0 && sh->top_k > 0;
        const int64_t per_row =
            (int64_t)sizeof(float) * (3 * D + 2 * a->QD + 2 * a->KVD + 1 + (route ? sh->E + 2 * sh->top_k : 0));
        const int64_t fit = (int64_t)(mq_cu_mem_free(g) / 4) / per_row;
        if (a->rows > fit) a->rows = fit > T ? fit : T;
    }
    const size_t half_tab = (size_t)(T * (sh->hd / 2));
    cudaStream_t s = g->stream[0];
    if (!st) st = cu_alloc(&a->norm, (size_t)D, "attention norm");
    if (!st) st = cu_alloc(&a->wq, (size_t)(a->QD * D), "q_proj weight");
    if (!st) st = cu_alloc(&a->wk, (size_t)(a->KVD * D), "k_proj weight");
    if (!st) st = cu_alloc(&a->wv, (size_t)(a->KVD * D), "v_proj weight");
    if (!st) st = cu_alloc(&a->wo, (size_t)(D * a->QD), "o_proj weight");
    if (!st) st = cu_alloc(&a->bq, (size_t)a->QD, "q_proj bias");
    if (!st) st = cu_alloc(&a->bk, (size_t)a->KVD, "k_proj bias");
    if (!st) st = cu_alloc(&a->bv, (size_t)a->KVD, "v_proj bias");
    if (!st) st = cu_alloc(&a->bo, (size_t)D, "o_proj bias");
    if (!st) st = cu_alloc(&a->qn, (size_t)a->QD, "q norm");
    if (!st) st = cu_alloc(&a->kn, (size_t)a->KVD, "k norm");
    if (!st) st = cu_alloc(&a->cos_t, half_tab, "RoPE table");
    if (!st) st = cu_alloc(&a->sin_t, half_tab, "RoPE table");
    if (!st) st = cu_alloc(&a->S, (size_t)(a->heads_per_call * tt), "attention scores");
    if (!st) st = cu_alloc(&a->fnorm, (size_t)D, "FFN norm");
    if (!st && sh->E > 0 && sh->top_k > 0) st = cu_alloc(&a->router, (size_t)(sh->E * D), "router weight");
    if (!st) {
        st = group_alloc(a);
        if (st == MOEQ_E_NOMEM && a->rows > T) {   /* short of memory: groups of one sample's length */
            group_free(a);
            a->rows = T;
            st = group_alloc(a);
        }
    }
    if (!st) st = CU(cudaMemcpyAsync(a->cos_t, sh->rope_cos, half_tab * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st) st = CU(cudaMemcpyAsync(a->sin_t, sh->rope_sin, half_tab * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st) st = CU(cudaStreamSynchronize(s));
    if (st) {
        mq_gpu_attn_free(a);
        return st;
    }
    *out = a;
    return MOEQ_OK;
}

extern "C" moeq_status mq_gpu_attn_set(mq_gpu_attn *a, const mq_gpu_attn_weights *w) {
    const int64_t D = a->sh.D, QD = a->QD, KVD = a->KVD, hd = a->sh.hd;
    const int64_t qn = a->sh.qk_norm == 1 ? QD : hd, kn = a->sh.qk_norm == 1 ? KVD : hd;
    if (!w->norm || !w->q || !w->k || !w->v || !w->o || (a->sh.qk_norm && (!w->q_norm || !w->k_norm)))
        return mq_err(MOEQ_E_ARG, "GPU attention: a weight is missing");
    struct {
        float *dst;
        const float *src;
        int64_t n;
    } up[] = {{a->norm, w->norm, D},   {a->wq, w->q, QD * D},     {a->wk, w->k, KVD * D},
              {a->wv, w->v, KVD * D},  {a->wo, w->o, D * QD},     {a->bq, w->q_bias, QD},
              {a->bk, w->k_bias, KVD}, {a->bv, w->v_bias, KVD},   {a->bo, w->o_bias, D},
              {a->qn, w->q_norm, qn},  {a->kn, w->k_norm, kn},   {a->fnorm, w->ffn_norm, D},
              {a->router, w->router, a->sh.E * D}};
    if (w->router && !a->router) return mq_err(MOEQ_E_ARG, "GPU attention: a router, but made without experts");
    cudaStream_t s = a->g->stream[0];
    moeq_status st = CU(cudaSetDevice(a->g->device));
    for (int i = 0; i < 13 && !st; i++) {
        a->has[i] = up[i].src != NULL;
        if (up[i].src)
            st = CU(cudaMemcpyAsync(up[i].dst, up[i].src, (size_t)up[i].n * sizeof(float), cudaMemcpyHostToDevice, s));
    }
    a->window = w->window;
    /* the host's buffers may change once this returns */
    if (!st) st = CU(cudaStreamSynchronize(s));
    return st;
}

namespace {

void mark(mq_gpu_attn *a, int phase) {
    if (!a->profile) return;
    cudaStreamSynchronize(a->g->stream[0]);
    const double t = mq_now();
    if (phase >= 0) a->phase_s[phase] += t - a->t_mark;
    a->t_mark = t;
}

/* y [R, n_out] = x [R, n_in] W^T (+ b), row-major: each output one fmaf chain (tile_det.cuh), so
 * a row's values do not depend on the rows beside it. */
moeq_status linear(mq_gpu_attn *a, const float *x, int64_t R, const float *W, int64_t n_out, int64_t n_in,
                   const float *b, float *y) {
    cudaStream_t s = a->g->stream[0];
    moeq_status st = mq_cu_product(a->g, 0, R, n_out, n_in, x, W, y, n_out);
    if (!st && b) {
        k_bias<<<grid_for(R * n_out), 256, 0, s>>>(y, b, R, n_out);
        st = CU_LAUNCHED("k_bias");
    }
    return st;
}

/* Queries a block at a time: a block's keys end at its last query (and start at its first
 * query's window), so the scores above the diagonal blocks are never computed (of T = 2048 in
 * blocks of 256, 36 of 64 blocks' worth). */
constexpr int64_t QUERY_BLOCK = 256;

/* The attention of one sample of T tokens: q [T, H*hd], k, v [T, KV*hd] -> out [T, H*hd]. */
moeq_status attend(mq_gpu_attn *a, int64_t T, const float *q, const float *k, const float *v, float *out) {
    const mq_gpu_attn_shape *sh = &a->sh;
    const int64_t hd = sh->hd, group = sh->H / sh->KV, ldq = a->QD, ldk = a->KVD;
    const float scale = (float)(1.0 / sqrt((double)hd)), one = 1.0f, zero = 0.0f;
    cublasHandle_t h = a->g->blas[0];
    moeq_status st = MOEQ_OK;
    for (int64_t q0 = 0; q0 < T && !st; q0 += QUERY_BLOCK) {
        const int64_t nq = T - q0 < QUERY_BLOCK ? T - q0 : QUERY_BLOCK;
        const int64_t k0 = a->window > 0 && q0 - a->window + 1 > 0 ? q0 - a->window + 1 : 0, nk = q0 + nq - k0;
        const int64_t blk = nq * nk;   /* a head's scores: [nq queries, nk keys] row-major */
        for (int64_t j = 0; j < group && !st; j++) {
            for (int64_t g0 = 0; g0 < sh->KV && !st; g0 += a->heads_per_call) {
                const int nb = (int)(sh->KV - g0 < a->heads_per_call ? sh->KV - g0 : a->heads_per_call);
                const int64_t h0 = g0 * group + j;   /* query heads h0, h0 + group, ... against KV heads g0, g0 + 1, ... */
                /* S_b^T (column-major [nk keys, nq queries]) = K_g^T-view times Q_h: S[i * nk + j] = q_(q0+i) . k_(k0+j) */
                st = CUBLAS(cublasSgemmStridedBatched(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)nk, (int)nq, (int)hd, &scale,
                                                      k + k0 * ldk + g0 * hd, (int)ldk, hd, q + q0 * ldq + h0 * hd,
                                                      (int)ldq, group * hd, &zero, a->S, (int)nk, blk, nb));
                if (!st) {
                    k_softmax_causal<<<dim3((unsigned)nq, (unsigned)nb), SOFTMAX_THREADS, 0, a->g->stream[0]>>>(
                        a->S, nk, blk, q0, k0, a->window);
                    st = CU_LAUNCHED("k_softmax_causal");
                }
                /* out_h rows q0.. [nq, hd] (row-major, ld H*hd) = P_h V_g rows k0.. */
                if (!st)
                    st = CUBLAS(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)hd, (int)nq, (int)nk, &one,
                                                          v + k0 * ldk + g0 * hd, (int)ldk, hd, a->S, (int)nk, blk,
                                                          &zero, out + q0 * ldq + h0 * hd, (int)ldq, group * hd, nb));
            }
        }
    }
    return st;
}

/* The group's rows of samples [i0, i1) (`rows`, the samples back to back) into device buffer b,
 * each sample at its ffn_dev_off (NULL b: nothing). */
moeq_status rows_to_buf(mq_gpu_buf *b, const float *rows, const mq_gpu_attn_sample *smp, int64_t i0, int64_t i1,
                        int64_t D, cudaStream_t s) {
    float *d = b ? mq_gpu_buf_device(b, NULL) : NULL;
    moeq_status st = MOEQ_OK;
    for (int64_t i = i0, r = 0; d && i < i1 && !st; r += smp[i].T, i++)
        st = CU(cudaMemcpyAsync(d + smp[i].ffn_dev_off, rows + r * D, (size_t)(smp[i].T * D) * sizeof(float),
                                cudaMemcpyDeviceToDevice, s));
    return st;
}

/* Samples [i0, i1) of s, R tokens, through the layer (see mq_gpu_attn_run_samples). */
moeq_status run_group(mq_gpu_attn *a, const mq_gpu_attn_sample *smp, int64_t i0, int64_t i1, int64_t R,
                      const mq_gpu_attn_io *io, bool meanwhile) {
    const mq_gpu_attn_shape *sh = &a->sh;
    const int64_t D = sh->D, QD = a->QD, KVD = a->KVD, hd = sh->hd, K = sh->top_k;
    cudaStream_t s = a->g->stream[0];
    moeq_status st = MOEQ_OK;
    bool route = false, ffn = io->ffn_dev != NULL;
    for (int64_t i = i0; i < i1; i++) {
        route |= smp[i].sel || smp[i].w;
        ffn |= smp[i].ffn_in || smp[i].sel || smp[i].w;
    }
    mark(a, -1);
    float *x_from = io->x_from ? mq_gpu_buf_device(io->x_from, NULL) : NULL;
    float *x_keep = io->x_keep ? mq_gpu_buf_device(io->x_keep, NULL) : NULL;
    for (int64_t i = i0, r = 0; i < i1 && !st; r += smp[i].T, i++) {
        const size_t bytes = (size_t)(smp[i].T * D) * sizeof(float);
        for (int64_t t = 0; t < smp[i].T; t++) a->pos_h[r + t] = (int32_t)t;
        if (x_from)
            st = CU(cudaMemcpyAsync(a->x + r * D, x_from + smp[i].ffn_dev_off, bytes, cudaMemcpyDeviceToDevice, s));
        else
            st = CU(cudaMemcpyAsync(a->x + r * D, smp[i].x, bytes, cudaMemcpyHostToDevice, s));
        if (!st && x_keep)
            st = CU(cudaMemcpyAsync(x_keep + smp[i].ffn_dev_off, a->x + r * D, bytes, cudaMemcpyDeviceToDevice, s));
    }
    if (!st) st = CU(cudaMemcpyAsync(a->pos, a->pos_h, (size_t)R * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    mark(a, PH_UPLOAD);
    if (!st) {
        k_rmsnorm<<<(unsigned)R, NORM_THREADS, 0, s>>>(a->xn, a->x, R, D, a->norm, sh->eps);
        st = CU_LAUNCHED("k_rmsnorm");
    }
    if (!st && io->hq) st = mq_gpu_hessians_add_device(io->hq, 0, a->xn, R, s);
    for (int64_t i = i0, r = 0; i < i1 && !st; r += smp[i].T, i++)
        if (smp[i].xn)
            st = CU(cudaMemcpyAsync(smp[i].xn, a->xn + r * D, (size_t)(smp[i].T * D) * sizeof(float),
                                    cudaMemcpyDeviceToHost, s));
    mark(a, PH_NORM);
    if (!st) st = linear(a, a->xn, R, a->wq, QD, D, a->has[5] ? a->bq : NULL, a->q);
    if (!st) st = linear(a, a->xn, R, a->wk, KVD, D, a->has[6] ? a->bk : NULL, a->k);
    if (!st) st = linear(a, a->xn, R, a->wv, KVD, D, a->has[7] ? a->bv : NULL, a->v);
    if (!st && sh->qk_norm) {
        const bool full = sh->qk_norm == 1;
        k_rmsnorm<<<(unsigned)(full ? R : R * sh->H), NORM_THREADS, 0, s>>>(a->q, a->q, full ? R : R * sh->H,
                                                                           full ? QD : hd, a->qn, sh->eps);
        k_rmsnorm<<<(unsigned)(full ? R : R * sh->KV), NORM_THREADS, 0, s>>>(a->k, a->k, full ? R : R * sh->KV,
                                                                            full ? KVD : hd, a->kn, sh->eps);
        st = CU_LAUNCHED("k_rmsnorm");
    }
    if (!st && sh->clip_qkv > 0) {
        k_clip<<<grid_for(R * QD), 256, 0, s>>>(a->q, R * QD, sh->clip_qkv);
        k_clip<<<grid_for(R * KVD), 256, 0, s>>>(a->k, R * KVD, sh->clip_qkv);
        k_clip<<<grid_for(R * KVD), 256, 0, s>>>(a->v, R * KVD, sh->clip_qkv);
        st = CU_LAUNCHED("k_clip");
    }
    if (!st) {
        k_rope<<<grid_for(R * QD / 2), 256, 0, s>>>(a->q, R, sh->H, hd, a->pos, a->cos_t, a->sin_t);
        k_rope<<<grid_for(R * KVD / 2), 256, 0, s>>>(a->k, R, sh->KV, hd, a->pos, a->cos_t, a->sin_t);
        st = CU_LAUNCHED("k_rope");
    }
    mark(a, PH_QKV);
    for (int64_t i = i0, r = 0; i < i1 && !st; r += smp[i].T, i++)
        st = attend(a, smp[i].T, a->q + r * QD, a->k + r * KVD, a->v + r * KVD, a->att + r * QD);
    mark(a, PH_ATTEND);
    if (!st && io->ho) st = mq_gpu_hessians_add_device(io->ho, 0, a->att, R, s);
    for (int64_t i = i0, r = 0; i < i1 && !st; r += smp[i].T, i++)
        if (smp[i].att)
            st = CU(cudaMemcpyAsync(smp[i].att, a->att + r * QD, (size_t)(smp[i].T * QD) * sizeof(float),
                                    cudaMemcpyDeviceToHost, s));
    if (!st) st = linear(a, a->att, R, a->wo, D, QD, a->has[8] ? a->bo : NULL, a->y);
    if (!st) {
        k_add<<<grid_for(R * D), 256, 0, s>>>(a->x, a->y, R * D);
        st = CU_LAUNCHED("k_add");
    }
    mark(a, PH_OUT);
    if (!st && ffn) {   /* the FFN input into xn (no longer needed) */
        k_rmsnorm<<<(unsigned)R, NORM_THREADS, 0, s>>>(a->xn, a->x, R, D, a->fnorm, sh->eps);
        st = CU_LAUNCHED("k_rmsnorm");
    }
    if (!st && route) st = linear(a, a->xn, R, a->router, sh->E, D, NULL, a->logits);
    if (!st && route) {
        k_route_softmax<<<(unsigned)((R + 127) / 128), 128, 0, s>>>(a->logits, R, sh->E, K, sh->norm_topk,
                                                                     a->rsel, a->rw);
        st = CU_LAUNCHED("k_route_softmax");
    }
    /* the result kept on the device for the FFN's residual add, the FFN input for the experts */
    if (!st) st = rows_to_buf(io->h_dev, a->x, smp, i0, i1, D, s);
    if (!st) st = rows_to_buf(io->ffn_dev, a->xn, smp, i0, i1, D, s);
    mark(a, PH_ROUTE);
    for (int64_t i = i0, r = 0; i < i1 && !st; r += smp[i].T, i++) {
        const mq_gpu_attn_sample *m = &smp[i];
        const size_t tk = (size_t)(m->T * K), td = (size_t)(m->T * D);
        if (m->ffn_in) st = CU(cudaMemcpyAsync(m->ffn_in, a->xn + r * D, td * sizeof(float), cudaMemcpyDeviceToHost, s));
        if (!st && m->sel)
            st = CU(cudaMemcpyAsync(m->sel, a->rsel + r * K, tk * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
        if (!st && m->w) st = CU(cudaMemcpyAsync(m->w, a->rw + r * K, tk * sizeof(float), cudaMemcpyDeviceToHost, s));
        if (!st && m->y) st = CU(cudaMemcpyAsync(m->y, a->x + r * D, td * sizeof(float), cudaMemcpyDeviceToHost, s));
    }
    /* the host's own work while the device runs the group; the group is waited for even when
     * the queueing failed part way (nothing of it is left in flight) */
    if (meanwhile && io->meanwhile) {
        moeq_status m = io->meanwhile(io->meanwhile_user);
        if (!st) st = m;
    }
    moeq_status w = CU(cudaStreamSynchronize(s));
    if (!st) st = w;
    mark(a, PH_DOWNLOAD);
    a->runs += i1 - i0;
    a->groups++;
    return st;
}

}  // namespace

extern "C" int64_t mq_gpu_attn_rows(const mq_gpu_attn *a) { return a->rows; }

extern "C" moeq_status mq_gpu_attn_run_samples(mq_gpu_attn *a, const mq_gpu_attn_sample *smp, int64_t n,
                                               const mq_gpu_attn_io *io) {
    const mq_gpu_attn_shape *sh = &a->sh;
    const int64_t D = sh->D;
    int64_t nbuf = 0, nh = 0, nxf = 0, nxk = 0;
    if (io->ffn_dev) mq_gpu_buf_device(io->ffn_dev, &nbuf);
    if (io->h_dev) mq_gpu_buf_device(io->h_dev, &nh);
    if (io->x_from) mq_gpu_buf_device(io->x_from, &nxf);
    if (io->x_keep) mq_gpu_buf_device(io->x_keep, &nxk);
    for (int64_t i = 0; i < n; i++) {   /* everything checked before anything runs */
        const mq_gpu_attn_sample *m = &smp[i];
        if (m->T <= 0 || m->T > sh->max_T)
            return mq_err(MOEQ_E_ARG, "GPU attention: sample %lld has %lld tokens, made for 1..%lld", (long long)i,
                          (long long)m->T, (long long)sh->max_T);
        if (((m->ffn_in || io->ffn_dev || m->sel || m->w) && !a->has[11]) || ((m->sel || m->w) && !a->has[12]))
            return mq_err(MOEQ_E_ARG, "GPU attention: the FFN input or routing of a layer without %s",
                          !a->has[11] ? "an FFN norm" : "a router");
        /* the sample's rows at ffn_dev_off in each buffer it goes to or comes from */
        const struct {
            const mq_gpu_buf *b;
            int64_t n;
            const char *what;
        } at[4] = {{io->ffn_dev, nbuf, "FFN input"}, {io->h_dev, nh, "result"}, {io->x_from, nxf, "input"},
                   {io->x_keep, nxk, "input"}};
        for (int k = 0; k < 4; k++)
            if (at[k].b && (m->ffn_dev_off < 0 || m->ffn_dev_off + m->T * D > at[k].n))
                return mq_err(MOEQ_E_ARG, "GPU attention: %s at %lld past a buffer of %lld", at[k].what,
                              (long long)m->ffn_dev_off, (long long)at[k].n);
        if (!io->x_from && !m->x) return mq_err(MOEQ_E_ARG, "GPU attention: sample %lld has no input", (long long)i);
    }
    moeq_status st = CU(cudaSetDevice(a->g->device));
    for (int64_t i0 = 0; i0 < n && !st;) {   /* groups of whole samples up to a->rows tokens */
        int64_t i1 = i0, R = 0;
        while (i1 < n && R + smp[i1].T <= a->rows) R += smp[i1++].T;
        st = run_group(a, smp, i0, i1, R, io, i0 == 0);
        i0 = i1;
    }
    return st;
}
