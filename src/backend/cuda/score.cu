/*
 * The evaluation's device pieces (backend/gpu.h, "the evaluation's pieces"): the FFN sums the
 * calibration pieces leave to the host (a dense MLP's or the shared expert's output onto the
 * residual or the routed sum) and the scoring of a window's rows: final RMSNorm, lm_head and the
 * per-row statistics of mq_eval_score_window.
 *
 * The element-wise and reduction parts are the CPU's kernels (kernels/vec.h) operation for
 * operation: vec.h's reductions put element i into lane i % 8 (of accumulator (i / 8) % 2 for the
 * fp32 ones, of the low or high double half for the double ones) and fold the lanes in a fixed
 * order, so a row here is worked by 8 threads, thread j the sequential chain of lane j, and one of
 * them folds the lanes as the CPU does. The products are fmaf or a rounded product then a rounded
 * sum exactly where the CPU's are (the backend is built with -fmad=false). The double exp of the
 * log-sum-exp terms is mq_vec_exp_sum_term's polynomial; the one log of a row is taken on the
 * host with the CPU's libm, the device's log not being correctly rounded either. So the final norm
 * and the statistics of given logits are the CPU's bits; lm_head is a cuBLAS product, the only
 * part whose sums run in another order.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <new>

#include "backend/cuda/cuda_internal.cuh"

namespace {

constexpr int LANES = 8;               /* vec.h's lanes: threads per row */
constexpr int ROWS_PER_BLOCK = 16;     /* 128 threads a block */
constexpr int64_t HEAD_ROWS_MAX = 2048;

/* vec_ref.c's reduce_add4d over the 8 double lanes of a row (lane j is d[j / 4][j % 4]). */
__device__ __forceinline__ double fold4d(const double *lane) {
    double v[4];
    for (int l = 0; l < 4; l++) v[l] = lane[l] + lane[l + 4];
    for (int l = 0; l < 2; l++) v[l] = v[l] + v[l + 2];
    return v[0] + v[1];
}

/* vec_ref.c's reduce_add8 over the fp32 lanes of both accumulators (a0[l], a1[l]). */
__device__ __forceinline__ float fold8(const float *a0, const float *a1) {
    float v[LANES];
    for (int l = 0; l < LANES; l++) v[l] = a0[l] + a1[l];
    for (int l = 0; l < 4; l++) v[l] = v[l] + v[l + 4];
    for (int l = 0; l < 2; l++) v[l] = v[l] + v[l + 2];
    return v[0] + v[1];
}

/* mq_vec_exp_sum_term: exp of a double d <= 0 (clamped at -708), degree-12 Taylor polynomial on
 * the reduced argument, exact scale by 2^n. */
__device__ __forceinline__ double exp_sum_term(double d) {
    if (d != d) return d + d;
    d = -708.0 > d ? -708.0 : d;
    const double n = rint(d * 1.4426950408889634);
    double r = fma(-n, 6.93147180369123816490e-01, d);
    r = fma(-n, 1.90821492927058770002e-10, r);
    const double c[13] = {1.0,          1.0,           1.0 / 2,        1.0 / 6,        1.0 / 24,
                          1.0 / 120,    1.0 / 720,     1.0 / 5040,     1.0 / 40320,    1.0 / 362880,
                          1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600};
    double p = c[12];
    for (int k = 11; k >= 0; k--) p = fma(p, r, c[k]);
    const unsigned long long bits = (unsigned long long)((long long)n + 1023) << 52;
    return p * __longlong_as_double((long long)bits);
}

__global__ void k_zero(float *x, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = 0.0f;
}

/* gs[t] = 1 / (1 + expf(-dot(gate, xn[t]))) for t < n: the dot as vec.h's dot (gemv_ref with
 * alpha 1), 8 threads a row. */
__global__ void k_gate(float *gs, const float *xn, const float *gate, int64_t n, int64_t D) {
    __shared__ float acc[ROWS_PER_BLOCK][2][LANES];
    const int r = threadIdx.x / LANES, j = threadIdx.x % LANES;
    const int64_t t = (int64_t)blockIdx.x * ROWS_PER_BLOCK + r;
    float a0 = 0.0f, a1 = 0.0f;
    if (t < n) {
        const float *x = xn + t * D;
        int64_t i = j;
        for (; i < D; i += LANES) {
            if ((i / LANES) & 1) a1 = fmaf(gate[i], x[i], a1);
            else a0 = fmaf(gate[i], x[i], a0);
        }
        /* the zero padding of a last partial block: fmaf(0, 0, c) */
        if (D % LANES && j >= D % LANES) {
            const int64_t last = D / LANES;   /* the partial block's index */
            if (last & 1) a1 = fmaf(0.0f, 0.0f, a1);
            else a0 = fmaf(0.0f, 0.0f, a0);
        }
    }
    acc[r][0][j] = a0;
    acc[r][1][j] = a1;
    __syncthreads();
    if (t < n && j == 0) {
        const float s = 1.0f * fold8(acc[r][0], acc[r][1]);
        gs[t] = 1.0f / (1.0f + expf(-s));
    }
}

/* out[t * D + d] = fmaf(gs ? gs[t] : 1, y[t * D + d], out[t * D + d]) for t < n. */
__global__ void k_axpy_rows(float *out, const float *y, const float *gs, int64_t n, int64_t D) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * D; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = fmaf(gs ? gs[i / D] : 1.0f, y[i], out[i]);
}

/* vec.h's rmsnorm of each row of x [n, D] into out (may be x), 8 threads a row. */
__global__ void k_rmsnorm_lanes(float *out, const float *x, int64_t n, int64_t D, const float *w, float eps) {
    __shared__ double lane[ROWS_PER_BLOCK][LANES];
    __shared__ float inv_s[ROWS_PER_BLOCK];
    const int r = threadIdx.x / LANES, j = threadIdx.x % LANES;
    const int64_t t = (int64_t)blockIdx.x * ROWS_PER_BLOCK + r;
    const float *xr = x + t * D;
    double d = 0.0;
    if (t < n)
        for (int64_t i = j; i < D; i += LANES) d += (double)xr[i] * (double)xr[i];
    lane[r][j] = d;
    __syncthreads();
    if (j == 0 && t < n) {
        const float var = (float)(fold4d(lane[r]) / (double)D);
        inv_s[r] = 1.0f / sqrtf(var + eps);
    }
    __syncthreads();
    if (t >= n) return;
    const float inv = inv_s[r];
    float *o = out + t * D;
    for (int64_t i = j; i < D; i += LANES) o[i] = w[i] * (xr[i] * inv);
}

__global__ void k_divide(float *x, int64_t n, float by) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = x[i] / by;
}

/* Of each logits row [n, V]: vec.h's logsumexp parts (the maximum as max_ref folds it, the first
 * index holding it, the sum of the double terms in the double lanes) and the target's logit. */
__global__ void k_row_lse(const float *L, int64_t n, int64_t V, const int32_t *target, float *mx_out,
                          double *sum_out, int32_t *am_out, float *tgt_out) {
    __shared__ float m[ROWS_PER_BLOCK][2][LANES];
    __shared__ double lane[ROWS_PER_BLOCK][LANES];
    __shared__ int64_t first[ROWS_PER_BLOCK][LANES];
    __shared__ float mx_s[ROWS_PER_BLOCK];
    const int r = threadIdx.x / LANES, j = threadIdx.x % LANES;
    const int64_t t = (int64_t)blockIdx.x * ROWS_PER_BLOCK + r;
    const float *x = L + (t < n ? t : 0) * V;
    float m0 = x[0], m1 = x[0];
    if (t < n)
        for (int64_t i = j; i < V; i += LANES) {
            if ((i / LANES) & 1) m1 = x[i] > m1 ? x[i] : m1;
            else m0 = x[i] > m0 ? x[i] : m0;
        }
    m[r][0][j] = m0;
    m[r][1][j] = m1;
    __syncthreads();
    if (j == 0) {
        float v[LANES];
        for (int l = 0; l < LANES; l++) v[l] = m[r][1][l] > m[r][0][l] ? m[r][1][l] : m[r][0][l];
        for (int l = 0; l < 4; l++) v[l] = v[l + 4] > v[l] ? v[l + 4] : v[l];
        for (int l = 0; l < 2; l++) v[l] = v[l + 2] > v[l] ? v[l + 2] : v[l];
        mx_s[r] = v[1] > v[0] ? v[1] : v[0];
    }
    __syncthreads();
    const float mx = mx_s[r];
    int64_t f = -1;
    double d = 0.0;
    if (t < n) {
        for (int64_t i = j; i < V; i += LANES)
            if (x[i] == mx) {
                f = i;
                break;
            }
        if (isfinite(mx))
            for (int64_t i = j; i < V; i += LANES) d += exp_sum_term((double)x[i] - (double)mx);
    }
    first[r][j] = f;
    lane[r][j] = d;
    __syncthreads();
    if (j == 0 && t < n) {
        int64_t am = -1;
        for (int l = 0; l < LANES; l++)
            if (first[r][l] >= 0 && (am < 0 || first[r][l] < am)) am = first[r][l];
        mx_out[t] = mx;
        sum_out[t] = fold4d(lane[r]);
        am_out[t] = (int32_t)(am < 0 ? 0 : am);
        tgt_out[t] = x[target[t]];
    }
}

/* vec.h's kl of two rows given their log-sum-exps, lane j's terms exp(a) * (a - b) (the product
 * rounded, then summed), the masked lanes of a last partial block adding +0. b of row t is
 * lm[t][i] - lse_m[t], or with lm NULL 0 - lse_m0 (the entropy's uniform row: zeros, log V). */
__device__ __forceinline__ double kl_lane(const float *lb, double lse_b, const float *lm, double lse_m, int64_t V,
                                          int j) {
    double d = 0.0;
    for (int64_t i = j; i < V; i += LANES) {
        const double a = (double)lb[i] - lse_b, b = (lm ? (double)lm[i] : (double)0.0f) - lse_m;
        d += exp_sum_term(a) * (a - b);
    }
    if (V % LANES && j >= V % LANES) d += 0.0;
    return d;
}

/* Per row t: with lb, KL(p_b || p_m) into kl[t]; with entropy, the KL of the model's row to the
 * uniform one (zeros, log V) into ent[t]. */
__global__ void k_row_kl(const float *L, const float *Lb, int64_t n, int64_t V, const double *lse, const double *lse_b,
                         double log_v, bool entropy, double *kl, double *ent) {
    __shared__ double lane[2][ROWS_PER_BLOCK][LANES];
    const int r = threadIdx.x / LANES, j = threadIdx.x % LANES;
    const int64_t t = (int64_t)blockIdx.x * ROWS_PER_BLOCK + r;
    double dk = 0.0, de = 0.0;
    if (t < n) {
        if (Lb) dk = kl_lane(Lb + t * V, lse_b[t], L + t * V, lse[t], V, j);
        if (entropy) de = kl_lane(L + t * V, lse[t], NULL, log_v, V, j);
    }
    lane[0][r][j] = dk;
    lane[1][r][j] = de;
    __syncthreads();
    if (j == 0 && t < n) {
        if (Lb) kl[t] = fold4d(lane[0][r]);
        if (entropy) ent[t] = fold4d(lane[1][r]);
    }
}

unsigned grid_of(int64_t n) {
    const int64_t b = (n + 255) / 256;
    return (unsigned)(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

unsigned row_blocks(int64_t n) { return (unsigned)((n + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK); }

/* The per-row scratch of the statistics: device arrays of `cap` rows and their pinned mirrors. */
struct stats_buf {
    int64_t cap;
    float *mx, *tgt;
    double *sum, *lse, *kl, *ent;
    int32_t *am, *target;
    void *host;       /* pinned: mx, tgt, sum, kl, ent, am, lse (the host's) in that order */
};

size_t stats_host_bytes(int64_t cap) { return (size_t)cap * (2 * sizeof(float) + 4 * sizeof(double) + sizeof(int32_t)); }

void stats_free(stats_buf *s) {
    mq_cu_free(s->mx);
    mq_cu_free(s->tgt);
    mq_cu_free(s->sum);
    mq_cu_free(s->lse);
    mq_cu_free(s->kl);
    mq_cu_free(s->ent);
    mq_cu_free(s->am);
    mq_cu_free(s->target);
    if (s->host) cudaFreeHost(s->host);
    memset(s, 0, sizeof *s);
}

moeq_status stats_alloc(stats_buf *s, int64_t cap) {
    memset(s, 0, sizeof *s);
    s->cap = cap;
    const size_t c = (size_t)cap;
    moeq_status st = cu_alloc(&s->mx, c, "row maxima");
    if (!st) st = cu_alloc(&s->tgt, c, "target logits");
    if (!st) st = cu_alloc(&s->sum, c, "row sums");
    if (!st) st = cu_alloc(&s->lse, c, "row log-sum-exps");
    if (!st) st = cu_alloc(&s->kl, c, "row KLs");
    if (!st) st = cu_alloc(&s->ent, c, "row entropies");
    if (!st) st = cu_alloc(&s->am, c, "row argmaxes");
    if (!st) st = cu_alloc(&s->target, c, "row targets");
    if (!st) st = CU(cudaMallocHost(&s->host, stats_host_bytes(cap)));
    if (st) stats_free(s);
    return st;
}

struct stats_host {
    float *mx, *tgt;
    double *sum, *kl, *ent, *lse;
    int32_t *am;
};

stats_host host_view(const stats_buf *s) {
    char *p = (char *)s->host;
    const size_t c = (size_t)s->cap;
    stats_host h;
    h.sum = (double *)p;
    h.kl = h.sum + c;
    h.ent = h.kl + c;
    h.lse = h.ent + c;
    h.mx = (float *)(h.lse + c);
    h.tgt = h.mx + c;
    h.am = (int32_t *)(h.tgt + c);
    return h;
}

/* The log-sum-exp parts of n rows of L on the device (stream s) and back into the host mirror;
 * the host then takes each row's log-sum-exp as mq_logsumexp does. */
moeq_status lse_rows(cudaStream_t s, const float *L, int64_t n, int64_t V, stats_buf *b) {
    k_row_lse<<<row_blocks(n), ROWS_PER_BLOCK * LANES, 0, s>>>(L, n, V, b->target, b->mx, b->sum, b->am, b->tgt);
    moeq_status st = CU_LAUNCHED("k_row_lse");
    const stats_host h = host_view(b);
    if (!st) st = CU(cudaMemcpyAsync(h.mx, b->mx, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost, s));
    if (!st) st = CU(cudaMemcpyAsync(h.tgt, b->tgt, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost, s));
    if (!st) st = CU(cudaMemcpyAsync(h.sum, b->sum, (size_t)n * sizeof(double), cudaMemcpyDeviceToHost, s));
    if (!st) st = CU(cudaMemcpyAsync(h.am, b->am, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    if (!st) st = CU(cudaStreamSynchronize(s));
    for (int64_t i = 0; i < n && !st; i++)   /* logsumexp_ref's last line, with the host's log */
        h.lse[i] = isfinite(h.mx[i]) ? (double)h.mx[i] + log(h.sum[i]) : (double)h.mx[i];
    return st;
}

/* The statistics of n rows of logits L (and Lb, or NULL) already on the device, whose targets
 * are in b->target (bb: the base's scratch, with Lb). */
moeq_status rows_stats(cudaStream_t s, const float *L, const float *Lb, int64_t n, int64_t V, bool entropy,
                       stats_buf *b, stats_buf *bb, mq_gpu_row_stats *out) {
    moeq_status st = lse_rows(s, L, n, V, b);
    if (!st && Lb) {
        st = CU(cudaMemcpyAsync(bb->target, b->target, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToDevice, s));
        if (!st) st = lse_rows(s, Lb, n, V, bb);
    }
    const stats_host h = host_view(b), hb = bb ? host_view(bb) : h;
    if (!st && (entropy || Lb)) {
        st = CU(cudaMemcpyAsync(b->lse, h.lse, (size_t)n * sizeof(double), cudaMemcpyHostToDevice, s));
        if (!st && Lb) st = CU(cudaMemcpyAsync(bb->lse, hb.lse, (size_t)n * sizeof(double), cudaMemcpyHostToDevice, s));
        if (!st) {
            k_row_kl<<<row_blocks(n), ROWS_PER_BLOCK * LANES, 0, s>>>(L, Lb, n, V, b->lse, Lb ? bb->lse : NULL,
                                                                      log((double)V), entropy, b->kl, b->ent);
            st = CU_LAUNCHED("k_row_kl");
        }
        if (!st && Lb) st = CU(cudaMemcpyAsync(h.kl, b->kl, (size_t)n * sizeof(double), cudaMemcpyDeviceToHost, s));
        if (!st && entropy) st = CU(cudaMemcpyAsync(h.ent, b->ent, (size_t)n * sizeof(double), cudaMemcpyDeviceToHost, s));
        if (!st) st = CU(cudaStreamSynchronize(s));
    }
    for (int64_t i = 0; i < n && !st; i++) {
        mq_gpu_row_stats *o = &out[i];
        memset(o, 0, sizeof *o);
        o->lse = h.lse[i];
        o->argmax = h.am[i];
        o->target = h.tgt[i];
        if (entropy) o->ent_kl = h.ent[i];
        if (Lb) {
            o->lse_b = hb.lse[i];
            o->argmax_b = hb.am[i];
            o->target_b = hb.tgt[i];
            o->kl = h.kl[i];
        }
    }
    return st;
}

moeq_status check_targets(const int32_t *target, int64_t n, int64_t V) {
    for (int64_t i = 0; i < n; i++)
        if (target[i] < 0 || target[i] >= V)
            return mq_err(MOEQ_E_ARG, "GPU scoring: row %lld's target %d outside the vocabulary of %lld",
                          (long long)i, target[i], (long long)V);
    return MOEQ_OK;
}

}  // namespace


/* ---- the FFN's sums -------------------------------------------------------------------------- */
extern "C" moeq_status mq_gpu_buf_zero(mq_gpu_buf *b, int64_t off, int64_t n) {
    int64_t cap = 0;
    float *d = mq_gpu_buf_device(b, &cap);
    if (off < 0 || n < 0 || off + n > cap)
        return mq_err(MOEQ_E_ARG, "GPU buffer: zeroing values %lld..%lld of %lld", (long long)off, (long long)(off + n),
                      (long long)cap);
    mq_gpu *g = mq_gpu_buf_gpu(b);
    moeq_status st = CU(cudaSetDevice(g->device));
    if (st || n == 0) return st;
    k_zero<<<grid_of(n), 256, 0, g->stream[0]>>>(d + off, n);
    return CU_LAUNCHED("k_zero");
}

extern "C" moeq_status mq_gpu_mlp_add_kept(mq_gpu_mlp *m, mq_gpu_buf *out, const mq_gpu_buf *xn, const mq_gpu_buf *gate,
                                           int64_t n) {
    int64_t kept = 0, D = 0, n_out = 0, n_xn = 0, n_gate = 0;
    const float *y = mq_gpu_mlp_kept(m, &kept, &D);
    float *o = mq_gpu_buf_device(out, &n_out);
    const float *x = gate ? mq_gpu_buf_device((mq_gpu_buf *)xn, &n_xn) : NULL;
    const float *gw = gate ? mq_gpu_buf_device((mq_gpu_buf *)gate, &n_gate) : NULL;
    if (n <= 0) return MOEQ_OK;
    if (!y || n > kept) return mq_err(MOEQ_E_ARG, "GPU experts: %lld rows to add, %lld kept", (long long)n, (long long)kept);
    if (n * D > n_out || (gate && (n * D > n_xn || n_gate < D)))
        return mq_err(MOEQ_E_ARG, "GPU experts: %lld rows of %lld values past a buffer", (long long)n, (long long)D);
    mq_gpu *g = mq_gpu_mlp_gpu(m);
    cudaStream_t s = g->stream[0];
    moeq_status st = CU(cudaSetDevice(g->device));
    if (!st) st = mq_gpu_mlp_join(m);   /* the kept rows' lanes */
    float *gs = NULL;
    if (!st && gate) {
        st = mq_cu_alloc_async((void **)&gs, (size_t)n * sizeof(float), s, "shared expert gates");
        if (!st) {
            k_gate<<<row_blocks(n), ROWS_PER_BLOCK * LANES, 0, s>>>(gs, x, gw, n, D);
            st = CU_LAUNCHED("k_gate");
        }
    }
    if (!st) {
        k_axpy_rows<<<grid_of(n * D), 256, 0, s>>>(o, y, gs, n, D);
        st = CU_LAUNCHED("k_axpy_rows");
    }
    mq_cu_free_async(gs, s);
    return st;
}

/* ---- the output layer ------------------------------------------------------------------------ */
struct mq_gpu_head {
    mq_gpu *g;
    int64_t D, V, rows;
    float eps;
    float *norm, *W;          /* [D], [V, D] */
    float *x, *logits;        /* [rows, D], [rows, V] */
    stats_buf st;
};

extern "C" void mq_gpu_head_free(mq_gpu_head *h) {
    if (!h) return;
    cudaSetDevice(h->g->device);
    cudaStreamSynchronize(h->g->stream[0]);
    mq_cu_free(h->norm);
    mq_cu_free(h->W);
    mq_cu_free(h->x);
    mq_cu_free(h->logits);
    stats_free(&h->st);
    delete h;
}

extern "C" int64_t mq_gpu_head_rows(const mq_gpu_head *h) { return h->rows; }

extern "C" moeq_status mq_gpu_head_new(mq_gpu *g, int64_t D, int64_t V, const float *norm, float eps,
                                       const float *lm_head, int64_t max_rows, mq_gpu_head **out) {
    *out = NULL;
    if (D <= 0 || V <= 0 || !norm || !lm_head)
        return mq_err(MOEQ_E_ARG, "GPU output layer: hidden size %lld, vocabulary %lld, weights %s", (long long)D,
                      (long long)V, norm && lm_head ? "given" : "missing");
    moeq_status st = CU(cudaSetDevice(g->device));
    if (st) return st;
    mq_gpu_head *h = new (std::nothrow) mq_gpu_head;
    if (!h) return mq_err(MOEQ_E_NOMEM, "out of memory");
    memset((void *)h, 0, sizeof *h);
    h->g = g;
    h->D = D;
    h->V = V;
    h->eps = eps;
    st = cu_alloc(&h->norm, (size_t)D, "final norm");
    if (!st) st = cu_alloc(&h->W, (size_t)(V * D), "lm_head");
    if (!st) st = mq_cu_upload(g, h->norm, norm, (size_t)D * sizeof(float));
    if (!st) st = mq_cu_upload(g, h->W, lm_head, (size_t)(V * D) * sizeof(float));
    if (!st) st = CU(cudaStreamSynchronize(g->stream[0]));   /* the host's buffers may go */
    /* a fixed number of rows (not the free memory's), so that a row's product is the same in
     * every run: halved only where the device cannot hold them */
    int64_t rows = max_rows > 0 ? max_rows : HEAD_ROWS_MAX;
    for (; !st;) {
        h->rows = rows;
        st = cu_alloc(&h->x, (size_t)(rows * D), "scored rows");
        if (!st) st = cu_alloc(&h->logits, (size_t)(rows * V), "logits");
        if (!st) st = stats_alloc(&h->st, rows);
        if (st != MOEQ_E_NOMEM || max_rows > 0 || rows == 1) break;
        mq_cu_free(h->x);
        mq_cu_free(h->logits);
        h->x = h->logits = NULL;
        rows /= 2;
        st = MOEQ_OK;
    }
    if (st) {
        mq_gpu_head_free(h);
        return st;
    }
    *out = h;
    return MOEQ_OK;
}

namespace {

/* rows [0, c) of h->x (uploaded from x) through the final norm and lm_head into h->logits. */
moeq_status head_logits(mq_gpu_head *h, const float *x, int64_t c, float temperature) {
    mq_gpu *g = h->g;
    cudaStream_t s = g->stream[0];
    const int64_t D = h->D, V = h->V;
    moeq_status st = CU(cudaMemcpyAsync(h->x, x, (size_t)(c * D) * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st) {
        k_rmsnorm_lanes<<<row_blocks(c), ROWS_PER_BLOCK * LANES, 0, s>>>(h->x, h->x, c, D, h->norm, h->eps);
        st = CU_LAUNCHED("k_rmsnorm_lanes");
    }
    if (!st && g->precision == MOEQ_GPU_FP32) {
        /* column-major: logits^T [V, c] = W^T-view [V, D] times x^T-view [D, c]; the handle's
         * default math: fp32, never TF32 */
        const float one = 1.0f, zero = 0.0f;
        st = CUBLAS(cublasSgemm(g->blas[0], CUBLAS_OP_T, CUBLAS_OP_N, (int)V, (int)c, (int)D, &one, h->W, (int)D,
                                h->x, (int)D, &zero, h->logits, (int)V));
    } else if (!st) {
        st = mq_cu_product(g, 0, c, V, D, h->x, h->W, h->logits, V);
    }
    if (!st && temperature != 1.0f) {
        k_divide<<<grid_of(c * V), 256, 0, s>>>(h->logits, c * V, temperature);
        st = CU_LAUNCHED("k_divide");
    }
    return st;
}

}  // namespace

extern "C" moeq_status mq_gpu_head_score(mq_gpu_head *h, mq_gpu_head *base, const float *x, const float *xb, int64_t n,
                                         const int32_t *target, float temperature, bool entropy,
                                         mq_gpu_row_stats *stats, float *logits) {
    if (base && (!xb || base->V != h->V || base->g != h->g))
        return mq_err(MOEQ_E_ARG, "GPU scoring: a base output layer of vocabulary %lld (the model's %lld)%s",
                      (long long)base->V, (long long)h->V, xb ? "" : " without its rows");
    moeq_status st = check_targets(target, n, h->V);
    if (st) return st;
    mq_gpu *g = h->g;
    cudaStream_t s = g->stream[0];
    const int64_t rows = base && base->rows < h->rows ? base->rows : h->rows, V = h->V;
    st = CU(cudaSetDevice(g->device));
    for (int64_t r0 = 0; r0 < n && !st; r0 += rows) {
        const int64_t c = n - r0 < rows ? n - r0 : rows;
        st = head_logits(h, x + r0 * h->D, c, temperature);
        if (!st && base) st = head_logits(base, xb + r0 * base->D, c, 1.0f);
        if (!st) st = CU(cudaMemcpyAsync(h->st.target, target + r0, (size_t)c * sizeof(int32_t), cudaMemcpyHostToDevice, s));
        if (!st)
            st = rows_stats(s, h->logits, base ? base->logits : NULL, c, V, entropy, &h->st, base ? &base->st : NULL,
                            stats + r0);
        if (!st && logits)
            st = CU(cudaMemcpyAsync(logits + r0 * V, h->logits, (size_t)(c * V) * sizeof(float), cudaMemcpyDeviceToHost, s));
        if (!st && logits) st = CU(cudaStreamSynchronize(s));
    }
    return st;
}

/* ---- the twins' entry points ------------------------------------------------------------------ */
extern "C" moeq_status mq_gpu_rmsnorm_rows(mq_gpu *g, const float *x, int64_t n, int64_t D, const float *w, float eps,
                                           float *out) {
    float *dx = NULL, *dw = NULL;
    cudaStream_t s = g->stream[0];
    moeq_status st = CU(cudaSetDevice(g->device));
    if (!st) st = cu_alloc(&dx, (size_t)(n * D), "norm rows");
    if (!st) st = cu_alloc(&dw, (size_t)D, "norm weight");
    if (!st) st = CU(cudaMemcpyAsync(dx, x, (size_t)(n * D) * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st) st = CU(cudaMemcpyAsync(dw, w, (size_t)D * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st && n > 0) {
        k_rmsnorm_lanes<<<row_blocks(n), ROWS_PER_BLOCK * LANES, 0, s>>>(dx, dx, n, D, dw, eps);
        st = CU_LAUNCHED("k_rmsnorm_lanes");
    }
    if (!st) st = CU(cudaMemcpyAsync(out, dx, (size_t)(n * D) * sizeof(float), cudaMemcpyDeviceToHost, s));
    if (!st) st = CU(cudaStreamSynchronize(s));
    mq_cu_free(dx);
    mq_cu_free(dw);
    return st;
}

extern "C" moeq_status mq_gpu_row_stats_of(mq_gpu *g, const float *l, const float *lb, int64_t n, int64_t V,
                                           const int32_t *target, bool entropy, mq_gpu_row_stats *stats) {
    moeq_status st = check_targets(target, n, V);
    if (st || n <= 0) return st;
    float *dl = NULL, *dlb = NULL;
    stats_buf b, bb;
    memset(&b, 0, sizeof b);
    memset(&bb, 0, sizeof bb);
    cudaStream_t s = g->stream[0];
    st = CU(cudaSetDevice(g->device));
    if (!st) st = cu_alloc(&dl, (size_t)(n * V), "logits");
    if (!st && lb) st = cu_alloc(&dlb, (size_t)(n * V), "base logits");
    if (!st) st = stats_alloc(&b, n);
    if (!st && lb) st = stats_alloc(&bb, n);
    if (!st) st = CU(cudaMemcpyAsync(dl, l, (size_t)(n * V) * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st && lb) st = CU(cudaMemcpyAsync(dlb, lb, (size_t)(n * V) * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st) st = CU(cudaMemcpyAsync(b.target, target, (size_t)n * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    if (!st) st = rows_stats(s, dl, dlb, n, V, entropy, &b, lb ? &bb : NULL, stats);
    cudaStreamSynchronize(s);
    mq_cu_free(dl);
    mq_cu_free(dlb);
    stats_free(&b);
    stats_free(&bb);
    return st;
}
