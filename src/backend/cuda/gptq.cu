/*
 * GPTQ on the GPU: quant/gptq.c's algorithm (its file comment has the mathematics), laid out for
 * the device.
 *
 * Factor, per Hessian, on MQ_GPU_STREAMS streams at once: dead columns, mean diagonal and the
 * act-order permutation on the host exactly as the CPU computes them; A = H' reversed and damped
 * (a kernel), A = L L^T (cusolverDnSpotrf; the damping is raised and the factorisation retried
 * as on the CPU), R = L rotated by 180 degrees, U = R^-1 (cublasStrsm on the identity).
 *
 * Column loop: the rows of every job that uses one factor form a "set", held transposed in
 * processing order (Wt[p][i]: column p contiguous over the rows, as the CPU's row blocks). One
 * thread per row walks a block of B columns (its B values in shared memory, untouched by other
 * threads, so no barriers): group parameters when a group's first column is reached (the
 * errors of the block not yet applied to a later column are subtracted on the fly, as on the
 * CPU), quantize, error, rank-1 update of the rest of the block. The trailing columns then get
 * the block's errors in one fp32 GEMM per set (a set's results never depend on the other sets
 * of the call). Sets are processed in waves that fit the device's free memory.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/quant_dev.cuh"

namespace {

/* Rows per CTA of the column loop (one thread each); the loop's own block of columns (the lazy
 * updates of the columns after it go through one GEMM per block): 32 keeps each thread's serial
 * in-block work short, whatever --block-size the CPU uses (the result is the same up to
 * rounding); the in-loop search keeps a group's U in shared memory up to this group size. */
constexpr int64_t ROWS_PER_CTA = 32, GPU_BLOCK = 32, MAX_SMEM_GROUP = 128;
enum { MAX_RETRIES = 16 };

/* MOEQ_GPU_PROFILE=1: the time of each phase on stderr (the device synchronised at each mark). */
struct profiler {
    bool on = getenv("MOEQ_GPU_PROFILE") != NULL;
    double t = mq_now();
    void mark(const char *what) {
        if (!on) return;
        cudaDeviceSynchronize();
        double n = mq_now();
        fprintf(stderr, "gpu gptq: %-10s %8.2f ms\n", what, (n - t) * 1e3);
        t = n;
    }
};

/* ---- device views ------------------------------------------------------------------------ */

/* One set: a factor and the stacked rows of its jobs. Arrays [K][ld] are transposed (column p
 * of processing order over the rows). */
struct dset {
    int64_t K, ld, G, ng;
    const float *U;          /* [K][K] upper */
    const int32_t *inv;      /* [K] column -> position (NULL: identity) */
    const uint8_t *dead;     /* [K] original order */
    const float *hdiag;      /* [K] processing order */
    const int32_t *gpos;     /* [ng][G] positions of group g's columns, in column (t) order */
    const int32_t *gord;     /* [ng][G] group g's t indices by increasing position */
    const int32_t *gfirst;   /* [ng] first position of group g */
    const int32_t *pgroup;   /* [K] group of position p */
    const float *gs;         /* [ld] global scale of each row */
    const float *wrow;       /* [ld][K] the weights as given */
    float *wt, *w0t;         /* [K][ld] working values; original values, then the quantized */
    float *et;               /* [B][ld] scaled errors of the current block */
    uint8_t *ct;             /* [K][ld] codes */
    float *step, *zero;      /* [ng][ld] */
    mq_gparams *gp;          /* [ng][ld] */
    float *gv, *ge;          /* [G][ld] a group's values; the in-loop search's errors */
    float *ucol;             /* in-loop search: [ng][G][G], ucol[g][b][a] = U at the positions of
                                group g's a-th and b-th columns in processing order (a <= b) */
    double *e2, *dsq;        /* [ld] */
    double *rtn_e2, *rtn_dsq;   /* [ld] */
};

struct loop_cfg {
    mq_qspec s;
    mq_gptq_mse_weight mse_weight;
    bool dynamic;            /* groups taken in the loop (not static) */
};

/* The MSE search's weight of the column at processing position q (gptq.c column_weight). */
__device__ __forceinline__ float column_weight(const dset &S, mq_gptq_mse_weight w, int64_t q) {
    if (w == MQ_GPTQ_MSE_HDIAG) return S.hdiag[q];
    float u = S.U[q * S.K + q];
    return 1.0f / (u * u);
}

/* Params of group g of row i from its values gv[t * ld + i] (t order): plain, the weighted
 * search (mq_group_params_h) or the in-loop search (gptq.c set_params_loop). */
__device__ void group_params(const dset &S, const loop_cfg &c, int64_t g, int64_t i,
                             mq_gparams &out, const float *ucol, float *e, int64_t es) {
    using namespace mqd;
    const mq_qspec &s = c.s;
    const int64_t G = S.G, ld = S.ld;
    const float gs = S.gs[i];
    const float *x = S.gv + i;
    cand_iter it;
    if (!group_start(s, gs, x, G, ld, out, it)) return;
    const int32_t *pos = S.gpos + g * G;
    mq_gparams best_p = out, cand;
    double best = INFINITY;
    if (c.mse_weight == MQ_GPTQ_MSE_LOOP) {
        const int32_t *ord = S.gord + g * G;
        while (cand_next(it, s, cand)) {
            const float step = group_step(s, gs, cand);
            double score = 0;
            for (int64_t b = 0; b < G; b++) {
                const float *uc = ucol + b * G;
                float w = x[ord[b] * ld];
                for (int64_t a = 0; a < b; a++) w -= uc[a] * e[a * es];
                float q = dequant_step(s, step, cand.zero, quant_step(s, step, cand.zero, w));
                float eb = (w - q) / uc[b];
                e[b * es] = eb;
                score += (double)eb * eb;
            }
            if (score < best) {
                best = score;
                best_p = cand;
            }
        }
    } else {
        const bool weighted = c.mse_weight != MQ_GPTQ_MSE_PLAIN;
        while (cand_next(it, s, cand)) {
            const float step = group_step(s, gs, cand);
            double e = 0;
            for (int64_t t = 0; t < G; t++) {
                float v = x[t * ld];
                double d = (double)v - (double)dequant_step(s, step, cand.zero,
                                                             quant_step(s, step, cand.zero, v));
                double d2 = d * d;
                e += weighted ? (double)column_weight(S, c.mse_weight, pos[t]) * d2 : d2;
            }
            if (e < best) {
                best = e;
                best_p = cand;
            }
        }
    }
    out = best_p;
}

__device__ __forceinline__ void set_group(const dset &S, const loop_cfg &c, int64_t g, int64_t i,
                                          const float *ucol, float *e, int64_t es) {
    mq_gparams p;
    group_params(S, c, g, i, p, ucol, e, es);
    S.gp[g * S.ld + i] = p;
    S.step[g * S.ld + i] = mqd::group_step(c.s, S.gs[i], p);
    S.zero[g * S.ld + i] = p.zero;
}

/* Wt and W0' (dead columns zero) from the rows as given; thread per (row, column). */
__global__ void k_load(const dset *sets) {
    const dset S = sets[blockIdx.z];
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t i = (int64_t)blockIdx.y * blockDim.y + threadIdx.y;
    if (c >= S.K || i >= S.ld) return;
    const int64_t p = S.inv ? S.inv[c] : c;
    float v = S.dead[c] ? 0.0f : S.wrow[i * S.K + c];
    S.wt[p * S.ld + i] = v;
    S.w0t[p * S.ld + i] = v;
}

/* Static groups: every group's params from the original values (gptq.c group_params_static). */
__global__ void k_static_groups(const dset *sets, loop_cfg c) {
    const dset S = sets[blockIdx.y];
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= S.ld) return;
    for (int64_t g = 0; g < S.ng; g++) {
        for (int64_t t = 0; t < S.G; t++) S.gv[t * S.ld + i] = S.w0t[(int64_t)S.gpos[g * S.G + t] * S.ld + i];
        set_group(S, c, g, i, S.ucol ? S.ucol + g * S.G * S.G : NULL, S.ge + i, S.ld);
    }
}

/* ucol of every group (see dset), for the in-loop search. */
__global__ void k_ucol(const dset *sets) {
    const dset S = sets[blockIdx.z];
    const int64_t G = S.G, t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, g = blockIdx.y;
    if (g >= S.ng || t >= G * G) return;
    const int64_t b = t / G, a = t % G;
    const int32_t *pos = S.gpos + g * G, *ord = S.gord + g * G;
    S.ucol[g * G * G + t] = a <= b ? S.U[(int64_t)pos[ord[a]] * S.K + pos[ord[b]]] : 0.0f;
}

/* One block [b0, b0 + B) of the column loop for every row of every set (gptq.c run_task).
 * Shared memory: the block's rows of this CTA (sw[j][tid]), U's diagonal block, and with the
 * in-loop search the group's ucol and the rows' errors. */
__global__ void k_block(const dset *sets, loop_cfg c, int64_t b0, int64_t B, bool smem_group) {
    extern __shared__ float smem[];
    const dset S = sets[blockIdx.y];
    const int64_t T = blockDim.x, tid = threadIdx.x;
    const int64_t i = (int64_t)blockIdx.x * T + tid;
    if (b0 >= S.K || (int64_t)blockIdx.x * T >= S.ld) return;   /* uniform over the CTA */
    const bool row = i < S.ld;   /* the others only help with the shared loads */
    const int64_t K = S.K, ld = S.ld, b1 = b0 + B < K ? b0 + B : K, nb = b1 - b0, G = S.G;
    float *sw = smem, *ub = sw + B * T, *uc = ub + B * B, *ge = uc + G * G;
    for (int64_t k = tid; k < nb * nb; k += T) ub[k] = S.U[(b0 + k / nb) * K + b0 + k % nb];
    if (row)
        for (int64_t j = 0; j < nb; j++) sw[j * T + tid] = S.wt[(b0 + j) * ld + i];
    __syncthreads();
    double e2 = row ? S.e2[i] : 0, dsq = row ? S.dsq[i] : 0;
    for (int64_t p = b0; p < b1; p++) {
        const int64_t g = S.pgroup[p];
        if (c.dynamic && S.gfirst[g] == p) {
            if (smem_group) {
                __syncthreads();
                for (int64_t k = tid; k < G * G; k += T) uc[k] = S.ucol[g * G * G + k];
                __syncthreads();
            }
            if (row) {
                /* the group's current values: later columns of this block are up to date in
                 * sw; columns past it still lack this block's errors */
                for (int64_t t = 0; t < G; t++) {
                    const int64_t q = S.gpos[g * G + t];
                    float v;
                    if (q < b1) {
                        v = sw[(q - b0) * T + tid];
                    } else {
                        v = S.wt[q * ld + i];
                        for (int64_t k = b0; k < p; k++) v -= S.U[k * K + q] * S.et[(k - b0) * ld + i];
                    }
                    S.gv[t * ld + i] = v;
                }
                if (smem_group) set_group(S, c, g, i, uc, ge + tid, T);
                else set_group(S, c, g, i, S.ucol ? S.ucol + g * G * G : NULL, S.ge + i, ld);
            }
        }
        if (!row) continue;
        const int64_t r = p - b0;
        const float st = S.step[g * ld + i], z = S.zero[g * ld + i];
        const float x = sw[r * T + tid];
        const uint8_t code = mqd::quant_step(c.s, st, z, x);
        const float q = mqd::dequant_step(c.s, st, z, code);
        const float e = (x - q) / ub[r * nb + r];
        e2 += (double)e * e;
        const float d = S.w0t[p * ld + i] - q;
        dsq += (double)d * d;
        S.w0t[p * ld + i] = q;
        S.ct[p * ld + i] = code;
        S.et[r * ld + i] = e;
        const float *urow = ub + r * nb;
        for (int64_t j = r + 1; j < nb; j++) sw[j * T + tid] = fmaf(-urow[j], e, sw[j * T + tid]);
    }
    if (row) {
        S.e2[i] = e2;
        S.dsq[i] = dsq;
    }
}

/* RTN residuals D (processing order, transposed, into D) and ||D||^2 per row (gptq.c
 * rtn_loss_rows): params from the rows as given, original groups. */
__global__ void k_rtn_residual(const dset *sets, loop_cfg c, float *const *D) {
    const dset S = sets[blockIdx.y];
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= S.ld) return;
    const mq_qspec &s = c.s;
    const float *row = S.wrow + i * S.K;
    float *d = D[blockIdx.y];
    double dsq = 0;
    for (int64_t g = 0; g < S.K / S.G; g++) {
        mq_gparams gp;
        mqd::group_params_plain(s, S.gs[i], row + g * S.G, S.G, 1, gp);
        const float step = mqd::group_step(s, S.gs[i], gp);
        for (int64_t cc = g * S.G; cc < (g + 1) * S.G; cc++) {
            float q = mqd::dequant_step(s, step, gp.zero, mqd::quant_step(s, step, gp.zero, row[cc]));
            float v = S.dead[cc] ? 0.0f : row[cc] - q;
            const int64_t p = S.inv ? S.inv[cc] : cc;
            d[p * S.ld + i] = v;
            dsq += (double)v * v;
        }
    }
    S.rtn_dsq[i] = dsq;
}

/* rtn_e2[i] = sum_j DR[j][i]^2 (DR transposed [K][ld]). */
__global__ void k_row_sumsq(const dset *sets, float *const *DR) {
    const dset S = sets[blockIdx.y];
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= S.ld) return;
    const float *x = DR[blockIdx.y];
    double e = 0;
    for (int64_t j = 0; j < S.K; j++) {
        float v = x[j * S.ld + i];
        e += (double)v * v;
    }
    S.rtn_e2[i] = e;
}

/* Results back to rows in the original column order: codes into wrow's memory (as bytes),
 * dequantized values into wt's, params row-major. */
__global__ void k_unload(const dset *sets, bool deq) {
    const dset S = sets[blockIdx.z];
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t i = (int64_t)blockIdx.y * blockDim.y + threadIdx.y;
    if (c >= S.K || i >= S.ld) return;
    const int64_t p = S.inv ? S.inv[c] : c;
    ((uint8_t *)S.wrow)[i * S.K + c] = S.ct[p * S.ld + i];
    if (deq) S.wt[i * S.K + c] = S.w0t[p * S.ld + i];
}

__global__ void k_unload_params(const dset *sets, mq_gparams *const *out) {
    const dset S = sets[blockIdx.y];
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= S.ld) return;
    for (int64_t g = 0; g < S.ng; g++) out[blockIdx.y][i * S.ng + g] = S.gp[g * S.ld + i];
}

/* ---- factor kernels ------------------------------------------------------------------------ */

/* The first index of a non-finite value of x[0..n), or n (atomicMin over a 64-bit index). */
__global__ void k_first_nonfinite(const float *x, int64_t n, unsigned long long *first) {
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (int64_t)gridDim.x * blockDim.x)
        if (!isfinite(x[k])) atomicMin(first, (unsigned long long)k);
}

/* A = H' with rows and columns in reverse processing order, lower triangle (gptq.c). */
__global__ void k_build_a(float *A, const float *H, const int32_t *perm, const float *diag,
                          int64_t K, float damp) {
    const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t a = (int64_t)blockIdx.y * blockDim.y + threadIdx.y;
    if (a >= K || b > a) return;
    const int64_t pa = K - 1 - a, ca = perm ? perm[pa] : pa;
    const int64_t pb = K - 1 - b, cb = perm ? perm[pb] : pb;
    A[a * K + b] = a == b ? diag[ca] + damp : H[ca * K + cb];
}

/* R[a][b] = L[K-1-a][K-1-b] for b >= a, 0 below; U = identity. */
__global__ void k_rotate(float *R, const float *L, float *U, int64_t K) {
    const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t a = (int64_t)blockIdx.y * blockDim.y + threadIdx.y;
    if (a >= K || b >= K) return;
    R[a * K + b] = b >= a ? L[(K - 1 - a) * K + (K - 1 - b)] : 0.0f;
    U[a * K + b] = a == b ? 1.0f : 0.0f;
}

__global__ void k_diag_finite(const float *U, int64_t K, int *bad) {
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < K;
         k += (int64_t)gridDim.x * blockDim.x)
        if (!isfinite(U[k * K + k])) *bad = 1;
}

/* ---- host side ----------------------------------------------------------------------------- */

struct diag_ref {
    float d;
    int32_t i;
};

int cmp_diag_desc(const void *a, const void *b) {
    const diag_ref *x = (const diag_ref *)a, *y = (const diag_ref *)b;
    if (x->d != y->d) return x->d > y->d ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* One Hessian's factor on the device, and what the host keeps of it. */
struct factor {
    int64_t K = 0;
    int stream = 0;
    const float *H_host = NULL;
    const char *name = NULL;
    float *dH = NULL, *dA = NULL, *dU = NULL, *dR = NULL;   /* dR aliases dH once factored */
    float *ddiag = NULL;
    int32_t *dperm = NULL, *dinv = NULL;
    uint8_t *ddead = NULL;
    float *dhdiag = NULL;
    float *work = NULL;
    int *dinfo = NULL;
    int lwork = 0;
    std::vector<int32_t> perm, inv;
    std::vector<uint8_t> dead;
    std::vector<float> diag;
    double mean = 0, percdamp = 0, damp = 0;
    int64_t n_dead = 0;
    int attempt = 0;
    bool done = false;
};

void factor_free(factor &f) {
    mq_cu_free(f.dH);
    mq_cu_free(f.dA);
    mq_cu_free(f.ddiag);
    mq_cu_free(f.dperm);
    mq_cu_free(f.dinv);
    mq_cu_free(f.ddead);
    mq_cu_free(f.dhdiag);
    mq_cu_free(f.work);
    mq_cu_free(f.dinfo);
    f.dH = f.dA = f.dU = f.dR = f.ddiag = f.dhdiag = f.work = NULL;
    f.dperm = f.dinv = NULL;
    f.ddead = NULL;
    f.dinfo = NULL;
}

dim3 grid2(int64_t nx, int64_t ny, dim3 blk, int64_t nz = 1) {
    return dim3((unsigned)((nx + blk.x - 1) / blk.x), (unsigned)((ny + blk.y - 1) / blk.y), (unsigned)nz);
}

/* Host part of the factor (dead columns, mean, act order) and the device buffers. */
moeq_status factor_start(mq_gpu *g, const mq_gptq_opts *o, factor &f) {
    const int64_t K = f.K;
    const size_t kk = (size_t)K * (size_t)K;
    moeq_status st;
    f.dead.assign((size_t)K, 0);
    f.diag.resize((size_t)K);
    f.mean = 0;
    f.n_dead = 0;
    for (int64_t i = 0; i < K; i++) {
        float d = f.H_host[i * K + i];
        if (d == 0.0f) {
            f.dead[i] = 1;
            f.n_dead++;
            d = 1.0f;
        }
        f.diag[i] = d;
        f.mean += d;
    }
    f.mean /= (double)K;
    if (o->act_order) {
        std::vector<diag_ref> refs((size_t)K);
        for (int64_t i = 0; i < K; i++) refs[i] = diag_ref{f.diag[i], (int32_t)i};
        qsort(refs.data(), (size_t)K, sizeof(diag_ref), cmp_diag_desc);
        f.perm.resize((size_t)K);
        f.inv.resize((size_t)K);
        for (int64_t p = 0; p < K; p++) {
            f.perm[p] = refs[p].i;
            f.inv[refs[p].i] = (int32_t)p;
        }
    }
    cudaStream_t s = g->stream[f.stream];
    if ((st = cu_alloc(&f.dH, kk, "Hessian")) || (st = cu_alloc(&f.dA, kk, "GPTQ factor")) ||
        (st = cu_alloc(&f.ddiag, (size_t)K, "Hessian diagonal")) ||
        (st = cu_alloc(&f.ddead, (size_t)K, "GPTQ dead columns")) ||
        (st = cu_alloc(&f.dhdiag, (size_t)K, "GPTQ diagonal")) ||
        (st = cu_alloc(&f.dinfo, 1, "cuSOLVER info")))
        return st;
    if ((st = CU(cudaMemcpyAsync(f.dH, f.H_host, kk * sizeof(float), cudaMemcpyHostToDevice, s))) ||
        (st = CU(cudaMemcpyAsync(f.ddiag, f.diag.data(), (size_t)K * sizeof(float), cudaMemcpyHostToDevice, s))) ||
        (st = CU(cudaMemcpyAsync(f.ddead, f.dead.data(), (size_t)K, cudaMemcpyHostToDevice, s))))
        return st;
    std::vector<float> hdiag((size_t)K);
    for (int64_t p = 0; p < K; p++) hdiag[p] = f.diag[o->act_order ? f.perm[p] : p];
    if ((st = CU(cudaMemcpyAsync(f.dhdiag, hdiag.data(), (size_t)K * sizeof(float), cudaMemcpyHostToDevice, s))))
        return st;
    if (o->act_order) {
        if ((st = cu_alloc(&f.dperm, (size_t)K, "GPTQ permutation")) ||
            (st = cu_alloc(&f.dinv, (size_t)K, "GPTQ permutation")) ||
            (st = CU(cudaMemcpyAsync(f.dperm, f.perm.data(), (size_t)K * 4, cudaMemcpyHostToDevice, s))) ||
            (st = CU(cudaMemcpyAsync(f.dinv, f.inv.data(), (size_t)K * 4, cudaMemcpyHostToDevice, s))))
            return st;
    }
    if ((st = CUSOLVER(cusolverDnSpotrf_bufferSize(g->solver[f.stream], CUBLAS_FILL_MODE_UPPER, (int)K,
                                                   f.dA, (int)K, &f.lwork))) ||
        (st = cu_alloc(&f.work, (size_t)(f.lwork > 0 ? f.lwork : 1), "cuSOLVER workspace")))
        return st;
    /* host memory stays valid until the copies ran: the caller synchronises before returning */
    return CU(cudaStreamSynchronize(s));
}

moeq_status factor_attempt(mq_gpu *g, factor &f) {
    const int64_t K = f.K;
    cudaStream_t s = g->stream[f.stream];
    f.damp = (double)(float)(f.percdamp * f.mean);
    dim3 blk(32, 8);
    k_build_a<<<grid2(K, K, blk), blk, 0, s>>>(f.dA, f.dH, f.dperm, f.ddiag, K, (float)(f.percdamp * f.mean));
    moeq_status st = CU_LAUNCHED("k_build_a");
    if (!st) st = CUSOLVER(cusolverDnSpotrf(g->solver[f.stream], CUBLAS_FILL_MODE_UPPER, (int)K, f.dA,
                                            (int)K, f.work, f.lwork, f.dinfo));
    return st;
}

/* R and U from the factor L in dA; dH becomes R. Reports a singular factor. */
moeq_status factor_finish(mq_gpu *g, factor &f, bool keep_R, int *singular) {
    const int64_t K = f.K;
    cudaStream_t s = g->stream[f.stream];
    dim3 blk(32, 8);
    /* dH (the Hessian, no longer needed) becomes R; dA (L) becomes U */
    float *R = f.dH, *L = f.dA, *U = NULL;
    moeq_status st = cu_alloc(&U, (size_t)K * (size_t)K, "GPTQ factor U");
    if (st) return st;
    k_rotate<<<grid2(K, K, blk), blk, 0, s>>>(R, L, U, K);
    if ((st = CU_LAUNCHED("k_rotate"))) {
        mq_cu_free(U);
        return st;
    }
    const float one = 1.0f;
    st = CUBLAS(cublasStrsm(g->blas[f.stream], CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N,
                            CUBLAS_DIAG_NON_UNIT, (int)K, (int)K, &one, R, (int)K, U, (int)K));
    if (st) {
        mq_cu_free(U);
        return st;
    }
    k_diag_finite<<<(unsigned)((K + 255) / 256), 256, 0, s>>>(U, K, f.dinfo);
    mq_cu_free(f.dA);
    f.dA = U;
    f.dU = U;
    f.dR = R;
    if (!keep_R) {
        /* R is read by no one after the stream's work so far: freed in order */
        cudaStreamSynchronize(s);
        mq_cu_free(f.dH);
        f.dH = NULL;
        f.dR = NULL;
    }
    mq_cu_free(f.work);
    f.work = NULL;
    *singular = 0;
    return CU_LAUNCHED("k_diag_finite");
}

/* Factors fs (their streams set), with the CPU's damping retry; messages as gptq.c's. */
moeq_status factor_all(mq_gpu *g, const mq_gptq_opts *o, std::vector<factor> &fs) {
    moeq_status st = MOEQ_OK;
    for (auto &f : fs) {
        f.percdamp = o->percdamp;
        f.attempt = 0;
        f.done = false;
        if ((st = factor_start(g, o, f))) return st;
        int zero = 0;
        if ((st = CU(cudaMemcpyAsync(f.dinfo, &zero, sizeof zero, cudaMemcpyHostToDevice, g->stream[f.stream])))) return st;
    }
    /* Hessians must be finite (gptq.c check_hessian) */
    unsigned long long *first = NULL;
    if ((st = cu_alloc(&first, fs.size() + 1, "finite check"))) return st;
    std::vector<unsigned long long> init(fs.size() + 1, ~0ull);
    st = CU(cudaMemcpy(first, init.data(), init.size() * sizeof(unsigned long long), cudaMemcpyHostToDevice));
    for (size_t k = 0; k < fs.size() && !st; k++) {
        k_first_nonfinite<<<1024, 256, 0, g->stream[fs[k].stream]>>>(fs[k].dH, fs[k].K * fs[k].K, first + k);
        st = CU_LAUNCHED("k_first_nonfinite");
    }
    if (!st) st = CU(cudaDeviceSynchronize());
    if (!st) st = CU(cudaMemcpy(init.data(), first, init.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    mq_cu_free(first);
    if (st) return st;
    for (size_t k = 0; k < fs.size(); k++)
        if (init[k] != ~0ull) {
            const int64_t K = fs[k].K, at = (int64_t)init[k];
            return mq_err(MOEQ_E_NUMERIC, "%s: non-finite Hessian entry %g at (%lld, %lld)", fs[k].name,
                          (double)fs[k].H_host[at], (long long)(at / K), (long long)(at % K));
        }
    for (;;) {
        bool pending = false;
        for (auto &f : fs)
            if (!f.done) {
                pending = true;
                if ((st = factor_attempt(g, f))) return st;
            }
        if (!pending) break;
        if ((st = CU(cudaDeviceSynchronize()))) return st;
        for (auto &f : fs) {
            if (f.done) continue;
            int info = 0;
            if ((st = CU(cudaMemcpy(&info, f.dinfo, sizeof info, cudaMemcpyDeviceToHost)))) return st;
            if (info < 0) return mq_err(MOEQ_E_DEVICE, "%s: cusolverDnSpotrf: argument %d", f.name, -info);
            if (info == 0) {
                f.done = true;
                if (f.attempt > 0)
                    mq_warn("%s: Hessian not positive definite with percdamp %g; raised to %g", f.name,
                            o->percdamp, f.percdamp);
                continue;
            }
            if (f.attempt + 1 >= MAX_RETRIES || f.percdamp * 2 > MQ_GPTQ_MAX_PERCDAMP)
                return mq_err(MOEQ_E_NUMERIC,
                              "%s: Hessian not positive definite even with percdamp raised to %g", f.name,
                              f.percdamp);
            f.attempt++;
            f.percdamp = f.percdamp == 0 ? 1e-4 : f.percdamp * 2;
        }
    }
    for (auto &f : fs) {
        int zero = 0, singular = 0;
        if ((st = CU(cudaMemcpyAsync(f.dinfo, &zero, sizeof zero, cudaMemcpyHostToDevice, g->stream[f.stream]))) ||
            (st = factor_finish(g, f, o->rtn_loss, &singular)))
            return st;
    }
    if ((st = CU(cudaDeviceSynchronize()))) return st;
    for (auto &f : fs) {
        int bad = 0;
        if ((st = CU(cudaMemcpy(&bad, f.dinfo, sizeof bad, cudaMemcpyDeviceToHost)))) return st;
        if (bad) return mq_err(MOEQ_E_NUMERIC, "%s: Cholesky factor of the Hessian is singular", f.name);
    }
    return MOEQ_OK;
}

/* A set on the host: its factor, jobs and device buffers. */
struct hset {
    int f;                      /* index into the wave's factors */
    std::vector<int64_t> jobs;  /* job indices, stacked in this order */
    std::vector<int64_t> row0;  /* first row of each job */
    int64_t ld, G, ng;
    dset d;
    std::vector<void *> owned;
};

void hset_free(hset &h) {
    for (void *p : h.owned) mq_cu_free(p);
    h.owned.clear();
}

template <typename T> moeq_status set_alloc(hset &h, T **p, size_t n, const char *what) {
    moeq_status st = cu_alloc(p, n, what);
    if (!st) h.owned.push_back((void *)*p);
    return st;
}

/* Device bytes of a set of ld rows for factor size K (with its factor: H/R, U and small). */
size_t set_bytes(int64_t K, int64_t ld, int64_t G, int64_t B, bool rtn, bool loop) {
    const size_t kl = (size_t)K * (size_t)ld;
    size_t b = kl * (4 + 4 + 4 + 1) + (size_t)B * ld * 4 + (size_t)(K / G) * ld * (4 + 4 + 12) +
               (size_t)G * ld * 4 * (loop ? 2 : 1) + (size_t)ld * (8 * 4 + 4) +
               (loop ? (size_t)K * G * 4 : 0);
    b += (size_t)K * K * 4 * 3;   /* H (then R), A (then U), U while A is freed */
    return b;
}

/* Group metadata of a set (gptq.c group_pos, the order the in-loop search needs). */
void group_meta(const factor &f, int64_t K, int64_t G, bool gidx, std::vector<int32_t> &gpos,
                std::vector<int32_t> &gord, std::vector<int32_t> &gfirst, std::vector<int32_t> &pgroup) {
    const int64_t ng = K / G;
    const bool perm = !f.perm.empty();
    gpos.resize((size_t)(ng * G));
    gord.resize((size_t)(ng * G));
    gfirst.resize((size_t)ng);
    pgroup.resize((size_t)K);
    for (int64_t g = 0; g < ng; g++) {
        int32_t first = INT32_MAX;
        for (int64_t t = 0; t < G; t++) {
            int32_t q = gidx ? (int32_t)(g * G + t) : perm ? f.inv[g * G + t] : (int32_t)(g * G + t);
            gpos[g * G + t] = q;
            first = q < first ? q : first;
        }
        gfirst[g] = first;
        int32_t *ord = &gord[g * G];
        for (int64_t t = 0; t < G; t++) {   /* insertion sort by position */
            int64_t j = t;
            for (; j > 0 && gpos[g * G + ord[j - 1]] > gpos[g * G + t]; j--) ord[j] = ord[j - 1];
            ord[j] = (int32_t)t;
        }
    }
    for (int64_t p = 0; p < K; p++) {
        int64_t c = perm ? f.perm[p] : p;
        pgroup[p] = (int32_t)(gidx ? p / G : c / G);
    }
}

template <typename T> moeq_status upload(hset &h, T **dst, const std::vector<T> &src, const char *what,
                                         cudaStream_t s) {
    moeq_status st = set_alloc(h, dst, src.size(), what);
    if (!st) st = CU(cudaMemcpyAsync(*dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice, s));
    return st;
}

/* Runs the column loop for the sets of one wave (their factors done). */
moeq_status run_sets(mq_gpu *g, const mq_qspec *s, const mq_gptq_opts *o, std::vector<factor> &fs,
                     std::vector<hset> &sets, mq_gptq_job *jobs) {
    moeq_status st = MOEQ_OK;
    const bool gidx = o->act_order && o->groups == MQ_GPTQ_GROUPS_GIDX;
    const bool loop = s->mse && o->mse_weight == MQ_GPTQ_MSE_LOOP;
    cudaStream_t s0 = g->stream[0];
    profiler prof;
    for (auto &h : sets) {
        factor &f = fs[h.f];
        const int64_t K = f.K, ld = h.ld, G = h.G, ng = h.ng;
        const size_t kl = (size_t)K * (size_t)ld;
        const int64_t B = GPU_BLOCK < K ? GPU_BLOCK : K;
        dset &d = h.d;
        memset(&d, 0, sizeof d);
        d.K = K;
        d.ld = ld;
        d.G = G;
        d.ng = ng;
        d.U = f.dU;
        d.inv = f.dinv;
        d.dead = f.ddead;
        d.hdiag = f.dhdiag;
        std::vector<int32_t> gpos, gord, gfirst, pgroup;
        group_meta(f, K, G, gidx, gpos, gord, gfirst, pgroup);
        std::vector<float> gs((size_t)ld);
        for (size_t k = 0; k < h.jobs.size(); k++)
            for (int64_t r = 0; r < jobs[h.jobs[k]].rows; r++) gs[h.row0[k] + r] = jobs[h.jobs[k]].out->global_scale;
        int32_t *p_gpos, *p_gord, *p_gfirst, *p_pgroup;
        float *p_gs, *wrow;
        if ((st = upload(h, &p_gpos, gpos, "GPTQ groups", s0)) || (st = upload(h, &p_gord, gord, "GPTQ groups", s0)) ||
            (st = upload(h, &p_gfirst, gfirst, "GPTQ groups", s0)) ||
            (st = upload(h, &p_pgroup, pgroup, "GPTQ groups", s0)) || (st = upload(h, &p_gs, gs, "GPTQ scales", s0)))
            return st;
        d.gpos = p_gpos;
        d.gord = p_gord;
        d.gfirst = p_gfirst;
        d.pgroup = p_pgroup;
        d.gs = p_gs;
        if ((st = set_alloc(h, &wrow, kl, "GPTQ weights")) || (st = set_alloc(h, &d.wt, kl, "GPTQ working weights")) ||
            (st = set_alloc(h, &d.w0t, kl, "GPTQ original weights")) || (st = set_alloc(h, &d.ct, kl, "GPTQ codes")) ||
            (st = set_alloc(h, &d.et, (size_t)B * ld, "GPTQ errors")) ||
            (st = set_alloc(h, &d.step, (size_t)ng * ld, "GPTQ steps")) ||
            (st = set_alloc(h, &d.zero, (size_t)ng * ld, "GPTQ zeros")) ||
            (st = set_alloc(h, &d.gp, (size_t)ng * ld, "GPTQ params")) ||
            (st = set_alloc(h, &d.gv, (size_t)G * ld, "GPTQ group values")) ||
            (loop && (st = set_alloc(h, &d.ge, (size_t)G * ld, "GPTQ group errors"))) ||
            (loop && (st = set_alloc(h, &d.ucol, (size_t)ng * G * G, "GPTQ group factors"))) ||
            (st = set_alloc(h, &d.e2, (size_t)ld * 4, "GPTQ losses")))
            return st;
        d.wrow = wrow;
        d.dsq = d.e2 + ld;
        d.rtn_e2 = d.e2 + 2 * ld;
        d.rtn_dsq = d.e2 + 3 * ld;
        if ((st = CU(cudaMemsetAsync(d.e2, 0, (size_t)ld * 4 * sizeof(double), s0)))) return st;
        for (size_t k = 0; k < h.jobs.size(); k++) {
            const mq_gptq_job &j = jobs[h.jobs[k]];
            if ((st = CU(cudaMemcpyAsync(wrow + h.row0[k] * K, j.w, (size_t)(j.rows * K) * sizeof(float),
                                         cudaMemcpyHostToDevice, s0))))
                return st;
        }
    }
    prof.mark("upload");
    dset *dsets = NULL;
    if ((st = cu_alloc(&dsets, sets.size(), "GPTQ sets"))) return st;
    std::vector<dset> hd(sets.size());
    for (size_t k = 0; k < sets.size(); k++) hd[k] = sets[k].d;
    if ((st = CU(cudaMemcpyAsync(dsets, hd.data(), hd.size() * sizeof(dset), cudaMemcpyHostToDevice, s0)))) goto out;
    /* weights must be finite (mq_check_finite) */
    {
        unsigned long long *first = NULL;
        if ((st = cu_alloc(&first, sets.size(), "finite check"))) goto out;
        std::vector<unsigned long long> res(sets.size(), ~0ull);
        st = CU(cudaMemcpyAsync(first, res.data(), res.size() * 8, cudaMemcpyHostToDevice, s0));
        for (size_t k = 0; k < sets.size() && !st; k++) {
            k_first_nonfinite<<<1024, 256, 0, s0>>>(sets[k].d.wrow, sets[k].d.K * sets[k].d.ld, first + k);
            st = CU_LAUNCHED("k_first_nonfinite");
        }
        if (!st) st = CU(cudaMemcpyAsync(res.data(), first, res.size() * 8, cudaMemcpyDeviceToHost, s0));
        if (!st) st = CU(cudaStreamSynchronize(s0));
        mq_cu_free(first);
        for (size_t k = 0; k < sets.size() && !st; k++) {
            if (res[k] == ~0ull) continue;
            const int64_t K = sets[k].d.K, r = (int64_t)res[k] / K, c = (int64_t)res[k] % K;
            size_t jk = 0;
            while (jk + 1 < sets[k].jobs.size() && sets[k].row0[jk + 1] <= r) jk++;
            const mq_gptq_job &j = jobs[sets[k].jobs[jk]];
            st = mq_err(MOEQ_E_NUMERIC, "%s: non-finite weight %g at (%lld, %lld)", j.name ? j.name : "(unnamed)",
                        (double)j.w[(r - sets[k].row0[jk]) * K + c], (long long)(r - sets[k].row0[jk]), (long long)c);
        }
        if (st) goto out;
    }
    {
        const loop_cfg c = {*s, s->mse ? o->mse_weight : MQ_GPTQ_MSE_PLAIN, o->groups != MQ_GPTQ_GROUPS_STATIC};
        const size_t ns = sets.size();
        int64_t maxK = 0, maxld = 0;
        for (auto &h : sets) {
            maxK = h.d.K > maxK ? h.d.K : maxK;
            maxld = h.ld > maxld ? h.ld : maxld;
        }
        dim3 blk2(32, 8);
        /* RTN loss first: D into wt, D R into w0t, before both are loaded */
        if (o->rtn_loss) {
            std::vector<float *> D(ns), DR(ns);
            for (size_t k = 0; k < ns; k++) {
                D[k] = sets[k].d.wt;
                DR[k] = sets[k].d.w0t;
            }
            float **dD = NULL, **dDR = NULL;
            if ((st = cu_alloc(&dD, ns, "GPTQ pointers")) || (st = cu_alloc(&dDR, ns, "GPTQ pointers"))) {
                mq_cu_free(dD);
                goto out;
            }
            st = CU(cudaMemcpyAsync(dD, D.data(), ns * sizeof(float *), cudaMemcpyHostToDevice, s0));
            if (!st) st = CU(cudaMemcpyAsync(dDR, DR.data(), ns * sizeof(float *), cudaMemcpyHostToDevice, s0));
            if (!st) {
                k_rtn_residual<<<dim3((unsigned)((maxld + 63) / 64), (unsigned)ns), 64, 0, s0>>>(dsets, c, dD);
                st = CU_LAUNCHED("k_rtn_residual");
            }
            const float one = 1.0f, zero = 0.0f;
            if (!st) st = CUBLAS(cublasSetStream(g->blas[0], s0));
            for (size_t k = 0; k < ns && !st; k++) {
                const dset &d = sets[k].d;
                st = CUBLAS(cublasSgemm(g->blas[0], CUBLAS_OP_N, CUBLAS_OP_T, (int)d.ld, (int)d.K, (int)d.K, &one,
                                        D[k], (int)d.ld, fs[sets[k].f].dR, (int)d.K, &zero, DR[k], (int)d.ld));
            }
            if (!st) {
                k_row_sumsq<<<dim3((unsigned)((maxld + 63) / 64), (unsigned)ns), 64, 0, s0>>>(dsets, dDR);
                st = CU_LAUNCHED("k_row_sumsq");
            }
            if (!st) st = CU(cudaStreamSynchronize(s0));
            mq_cu_free(dD);
            mq_cu_free(dDR);
            if (st) goto out;
        }
        prof.mark("checks+rtn");
        k_load<<<grid2(maxK, maxld, blk2, (int64_t)ns), blk2, 0, s0>>>(dsets);
        if ((st = CU_LAUNCHED("k_load"))) goto out;
        if (loop) {
            int64_t maxng = 0, maxG = 0;
            for (auto &h : sets) {
                maxng = h.ng > maxng ? h.ng : maxng;
                maxG = h.G > maxG ? h.G : maxG;
            }
            k_ucol<<<dim3((unsigned)((maxG * maxG + 255) / 256), (unsigned)maxng, (unsigned)ns), 256, 0, s0>>>(dsets);
            if ((st = CU_LAUNCHED("k_ucol"))) goto out;
        }
        if (!c.dynamic) {
            k_static_groups<<<dim3((unsigned)((maxld + 63) / 64), (unsigned)ns), 64, 0, s0>>>(dsets, c);
            if ((st = CU_LAUNCHED("k_static_groups"))) goto out;
        }
        /* The loop: blocks of B columns; sets of equal shape share each GEMM call. */
        const int64_t B = GPU_BLOCK < maxK ? GPU_BLOCK : maxK;
        int64_t maxG = 0;
        for (auto &h : sets) maxG = h.G > maxG ? h.G : maxG;
        const bool smem_group = loop && c.dynamic && maxG <= MAX_SMEM_GROUP;
        const size_t smem = (size_t)(B * ROWS_PER_CTA + B * B +
                                     (smem_group ? maxG * maxG + maxG * ROWS_PER_CTA : 0)) * sizeof(float);
        if (smem > 48 * 1024 &&
            (st = CU(cudaFuncSetAttribute(k_block, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem))))
            goto out;
        if ((st = CUBLAS(cublasSetStream(g->blas[0], s0)))) goto out;
        for (int64_t b0 = 0; b0 < maxK && !st; b0 += B) {
            if (moeq_interrupted()) {
                st = mq_err(MOEQ_E_INTERRUPTED, "GPTQ interrupted");
                break;
            }
            k_block<<<dim3((unsigned)((maxld + ROWS_PER_CTA - 1) / ROWS_PER_CTA), (unsigned)ns), ROWS_PER_CTA, smem,
                      s0>>>(dsets, c, b0, B, smem_group);
            if ((st = CU_LAUNCHED("k_block"))) break;
            /* trailing update, one GEMM per set: W[:, b1:] -= E U[b0:b1, b1:]. Not batched: a
             * set's result must not depend on which other sets share the call (cuBLAS may pick
             * another kernel for another batch count), so that chunking experts changes nothing */
            const float minus = -1.0f, one = 1.0f;
            for (size_t k = 0; k < ns && !st; k++) {
                const dset &d = sets[k].d;
                const int64_t b1 = b0 + B < d.K ? b0 + B : d.K;
                if (b1 >= d.K) continue;
                st = CUBLAS(cublasSgemm(g->blas[0], CUBLAS_OP_N, CUBLAS_OP_T, (int)d.ld, (int)(d.K - b1),
                                        (int)(b1 - b0), &minus, d.et, (int)d.ld, d.U + b0 * d.K + b1, (int)d.K,
                                        &one, d.wt + b1 * d.ld, (int)d.ld));
            }
        }
        if (!st) st = CU(cudaStreamSynchronize(s0));
        if (st) goto out;
        prof.mark("loop");
        /* results */
        bool want_deq = false;
        for (auto &h : sets)
            for (int64_t j : h.jobs) want_deq |= jobs[j].deq != NULL;
        k_unload<<<grid2(maxK, maxld, blk2, (int64_t)ns), blk2, 0, s0>>>(dsets, want_deq);
        if ((st = CU_LAUNCHED("k_unload"))) goto out;
        std::vector<mq_gparams *> pp(ns);
        for (size_t k = 0; k < ns; k++) pp[k] = (mq_gparams *)sets[k].d.w0t;   /* free after the loop */
        mq_gparams **dpp = NULL;
        if ((st = cu_alloc(&dpp, ns, "GPTQ pointers"))) goto out;
        st = CU(cudaMemcpyAsync(dpp, pp.data(), ns * sizeof(void *), cudaMemcpyHostToDevice, s0));
        if (!st) {
            k_unload_params<<<dim3((unsigned)((maxld + 63) / 64), (unsigned)ns), 64, 0, s0>>>(dsets, dpp);
            st = CU_LAUNCHED("k_unload_params");
        }
        if (!st) st = CU(cudaStreamSynchronize(s0));
        mq_cu_free(dpp);
        if (st) goto out;
        for (auto &h : sets) {
            const dset &d = h.d;
            std::vector<double> sums((size_t)d.ld * 4);
            if ((st = CU(cudaMemcpy(sums.data(), d.e2, sums.size() * sizeof(double), cudaMemcpyDeviceToHost)))) goto out;
            const factor &f = fs[h.f];
            for (size_t k = 0; k < h.jobs.size(); k++) {
                mq_gptq_job &j = jobs[h.jobs[k]];
                mq_qtensor *q = j.out;
                const int64_t r0 = h.row0[k];
                if ((st = CU(cudaMemcpy(q->codes, (const uint8_t *)d.wrow + r0 * d.K, (size_t)(j.rows * d.K),
                                        cudaMemcpyDeviceToHost))) ||
                    (st = CU(cudaMemcpy(q->params, (const mq_gparams *)d.w0t + r0 * d.ng,
                                        (size_t)(j.rows * d.ng) * sizeof(mq_gparams), cudaMemcpyDeviceToHost))))
                    goto out;
                if (j.deq &&
                    (st = CU(cudaMemcpy(j.deq, d.wt + r0 * d.K, (size_t)(j.rows * d.K) * sizeof(float),
                                        cudaMemcpyDeviceToHost))))
                    goto out;
                double e2 = 0, dsq = 0, re2 = 0, rdsq = 0;
                for (int64_t r = r0; r < r0 + j.rows; r++) {
                    e2 += sums[r];
                    dsq += sums[d.ld + r];
                    re2 += sums[2 * d.ld + r];
                    rdsq += sums[3 * d.ld + r];
                }
                j.stats.loss = e2 - f.damp * dsq;
                j.stats.rtn_loss = o->rtn_loss ? re2 - f.damp * rdsq : NAN;
                j.stats.percdamp = f.percdamp;
                j.stats.n_dead = f.n_dead;
            }
        }
    }
    prof.mark("download");
out:
    mq_cu_free(dsets);
    return st;
}

}  // namespace

extern "C" moeq_status mq_gpu_gptq(mq_gpu *g, const mq_qspec *s, const mq_gptq_opts *o,
                                   const float *const *H, const int64_t *K, const char *const *hnames,
                                   int64_t n_h, mq_gptq_job *jobs, const int32_t *job_h, int64_t n_jobs) {
    moeq_status st = MOEQ_OK;
    for (int64_t i = 0; i < n_jobs; i++) memset(jobs[i].out, 0, sizeof *jobs[i].out);
    if (o->block_size < 1) return mq_err(MOEQ_E_ARG, "GPTQ block size %d (must be >= 1)", (int)o->block_size);
    if (!(o->percdamp >= 0)) return mq_err(MOEQ_E_ARG, "GPTQ percdamp %g (must be >= 0)", o->percdamp);
    const bool gidx = o->act_order && o->groups == MQ_GPTQ_GROUPS_GIDX;
    const bool loop = s->mse && o->mse_weight == MQ_GPTQ_MSE_LOOP;
    const double t_start = mq_now();
    profiler prof;
    if ((st = CU(cudaSetDevice(g->device)))) return st;
    for (int64_t i = 0; i < n_jobs && !st; i++) {
        mq_gptq_job *j = &jobs[i];
        const char *name = j->name ? j->name : "(unnamed)";
        if (job_h[i] < 0 || job_h[i] >= n_h || !H[job_h[i]]) {
            st = mq_err(MOEQ_E_ARG, "%s: no Hessian", name);
            break;
        }
        const int64_t Kj = K[job_h[i]];
        if ((st = mq_qtensor_init(j->out, s, j->rows, Kj, name))) break;
        if (gidx && s->scheme != MQ_QS_INT4) {
            st = mq_err(MOEQ_E_UNSUPPORTED, "%s: act-order with g_idx groups needs INT4 (use static or dynamic "
                        "groups with %s)", name, mq_qscheme_name(s->scheme));
            break;
        }
        if (s->scheme == MQ_QS_NVFP4)
            j->out->global_scale = j->global_scale > 0 && isfinite(j->global_scale)
                                       ? j->global_scale
                                       : mq_nvfp4_global_scale(s, mq_absmax(j->w, j->rows * Kj));
    }
    prof.mark("host prep");
    /* Waves: Hessians in order with their jobs, as many as fit 85% of the free device memory. */
    size_t free_b = 0, total_b = 0;
    if (!st) st = CU(cudaMemGetInfo(&free_b, &total_b));
    const size_t budget = (size_t)(0.85 * (double)free_b);
    std::vector<std::vector<int64_t>> jobs_of((size_t)n_h);
    for (int64_t i = 0; i < n_jobs; i++) jobs_of[(size_t)job_h[i]].push_back(i);
    int64_t h0 = 0;
    while (!st && h0 < n_h) {
        std::vector<factor> fs;
        std::vector<hset> sets;
        size_t used = 0;
        int64_t h1 = h0;
        for (; h1 < n_h; h1++) {
            if (!H[h1] || jobs_of[h1].empty()) continue;
            int64_t rows = 0;
            for (int64_t j : jobs_of[h1]) rows += jobs[j].rows;
            const int64_t G = jobs[jobs_of[h1][0]].out->group_size;
            const int64_t B = GPU_BLOCK < K[h1] ? GPU_BLOCK : K[h1];
            size_t b = set_bytes(K[h1], rows, G, B, o->rtn_loss, loop);
            if (!fs.empty() && used + b > budget) break;
            if (fs.empty() && b > budget) {
                st = mq_err(MOEQ_E_NOMEM, "%s: GPTQ needs %.2f GB of GPU memory; %.2f GB are free", hnames[h1],
                            (double)b / 1e9, (double)free_b / 1e9);
                break;
            }
            used += b;
            factor f;
            f.K = K[h1];
            f.stream = (int)(fs.size() % MQ_GPU_STREAMS);
            f.H_host = H[h1];
            f.name = hnames[h1];
            fs.push_back(f);
            hset h;
            h.f = (int)fs.size() - 1;
            h.ld = rows;
            h.G = G;
            h.ng = K[h1] / G;
            int64_t r = 0;
            for (int64_t j : jobs_of[h1]) {
                h.jobs.push_back(j);
                h.row0.push_back(r);
                r += jobs[j].rows;
            }
            sets.push_back(h);
        }
        profiler prof;
        if (!st) st = factor_all(g, o, fs);
        prof.mark("factor");
        if (!st && gidx)
            for (auto &h : sets)
                for (int64_t j : h.jobs) {
                    mq_qtensor *q = jobs[j].out;
                    q->g_idx = (int32_t *)mq_alloc_array((size_t)q->cols, sizeof(int32_t), "GPTQ g_idx");
                    if (!q->g_idx) {
                        st = MOEQ_E_NOMEM;
                        break;
                    }
                    const factor &f = fs[h.f];
                    for (int64_t p = 0; p < q->cols; p++)
                        q->g_idx[f.perm.empty() ? p : f.perm[p]] = (int32_t)(p / q->group_size);
                }
        if (!st) st = run_sets(g, s, o, fs, sets, jobs);
        cudaDeviceSynchronize();
        for (auto &h : sets) hset_free(h);
        for (auto &f : fs) {
            if (f.dU && f.dA != f.dU) mq_cu_free(f.dU);
            factor_free(f);
        }
        if (o->progress_label && !st)
            mq_progress(o->progress_label, o->progress_base + o->progress_span * (h1 < n_h ? h1 : n_h) / (n_h ? n_h : 1),
                        o->progress_total);
        h0 = h1 > h0 ? h1 : h0 + 1;
    }
    const double sec = mq_now() - t_start;
    double work = 0;
    for (int64_t i = 0; i < n_jobs; i++) work += (double)jobs[i].rows * (double)K[job_h[i] >= 0 ? job_h[i] : 0];
    for (int64_t i = 0; i < n_jobs && !st; i++)
        jobs[i].stats.seconds = work > 0 ? sec * (double)jobs[i].rows * (double)K[job_h[i]] / work : 0;
    if (st)
        for (int64_t i = 0; i < n_jobs; i++) mq_qtensor_free(jobs[i].out);
    return st;
}
