/*
 * The device half of GPTQ on the GPU (gptq.cu has the host side and the file comment on the
 * method): the sets' device views, the column loop's kernels (k_block, a thread per row; k_warp,
 * a warp per row), the packing of the results and the factor's kernels. Included by gptq.cu
 * only: everything here is in its unnamed namespace.
 */
#ifndef MOEQ_BACKEND_CUDA_GPTQ_KERNELS_CUH
#define MOEQ_BACKEND_CUDA_GPTQ_KERNELS_CUH

#include <math.h>
#include <stdint.h>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/quant_dev.cuh"

namespace {

/* Rows per CTA of the column loop (one thread each); the loop's own block of columns (the lazy
 * updates of the columns after it go through one GEMM per block): 32 keeps each thread's serial
 * in-block work short, whatever --block-size the CPU uses (the result is the same up to
 * rounding); the in-loop search keeps a group's U in shared memory up to this group size. */
constexpr int64_t ROWS_PER_CTA = 32, GPU_BLOCK = 32, MAX_SMEM_GROUP = 128;

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

/* ---- the column loop, a warp per row ------------------------------------------------------------
 * k_block above keeps a row's block of columns in one thread: few threads, each walking the
 * block and every group search alone. k_warp gives a row a warp instead, lane j holding column
 * b0 + j of the block: a column is quantized by its lane and its error goes to the later lanes
 * by a shuffle, each applying it with the same fmaf; a group search scores its candidates on
 * the lanes at once, each candidate exactly as group_params scores it, and keeps the first of
 * the least scores, as the serial search does. So every value is k_block's, bit for bit, with 32
 * times the threads. The block's columns go in and out of the transposed arrays through a
 * shared tile, so the loads and stores stay coalesced. */
constexpr int WARP_ROWS = 16;   /* rows (warps) per CTA */
constexpr int64_t WARP_MAX_ROWS = 32768;   /* a call's rows below which k_warp is used (run_loop) */

/* Candidate c of the search (quant.c's cand_iter, by index): false when c is a repeat of c - 1
 * (the iterator skips it) or past the end (*end set). */
__device__ bool cand_at(const mqd::cand_iter &it, const mq_qspec &s, int32_t c, mq_gparams &out, bool &end) {
    using namespace mqd;
    end = false;
    if (it.dense) {
        const unsigned code = it.code + (unsigned)c;
        if (code > it.last) {
            end = true;
            return false;
        }
        out.scale = e4m3_value((uint8_t)code);
        out.zero = 0.0f;
        out.scale_code = (uint8_t)code;
        return true;
    }
    if (c >= s.mse_steps) {
        end = true;
        return false;
    }
    mq_gparams prev;
    for (int k = 0; k < 2; k++) {
        const int32_t at = c - 1 + k;
        if (at < 0) continue;
        mq_gparams &p = k ? out : prev;
        const float m = grid_m(s, at);
        if (s.scheme == MQ_QS_NVFP4) {
            const uint8_t code = nvfp4_code(s, it.t0, m);
            p.scale = e4m3_value(code);
            p.zero = 0.0f;
            p.scale_code = code;
        } else {
            params_scaled(s, it.gs, it.amax, it.xmin, it.xmax, m, p);
        }
    }
    return !(c > 0 && out.scale == prev.scale && out.zero == prev.zero);
}

/* group_params of row i for the warp: the group's values gv[0..G) (t order, shared by the
 * lanes), the candidates spread over the lanes. Every lane returns the params. */
__device__ void warp_group_params(const dset &S, const loop_cfg &c, int64_t g, int64_t i, const float *gv,
                                  const float *uc, int lane, mq_gparams &out) {
    using namespace mqd;
    const mq_qspec &s = c.s;
    const int64_t G = S.G;
    const float gs = S.gs[i];
    cand_iter it;
    if (!group_start(s, gs, gv, G, 1, out, it)) return;
    const int32_t *pos = S.gpos + g * G, *ord = S.gord + g * G;
    double best = INFINITY;
    int32_t best_c = INT32_MAX;
    float e[MAX_SMEM_GROUP];
    for (int32_t k = lane;; k += 32) {
        mq_gparams cand;
        bool end;
        if (!cand_at(it, s, k, cand, end)) {
            if (end) break;
            continue;
        }
        const float step = group_step(s, gs, cand);
        double score = 0;
        if (c.mse_weight == MQ_GPTQ_MSE_LOOP) {
            for (int64_t b = 0; b < G; b++) {
                const float *ucb = uc + b * G;
                float w = gv[ord[b]];
                for (int64_t a = 0; a < b; a++) w -= ucb[a] * e[a];
                float q = dequant_step(s, step, cand.zero, quant_step(s, step, cand.zero, w));
                float eb = (w - q) / ucb[b];
                e[b] = eb;
                score += (double)eb * eb;
            }
        } else {
            const bool weighted = c.mse_weight != MQ_GPTQ_MSE_PLAIN;
            for (int64_t t = 0; t < G; t++) {
                float v = gv[t];
                double d = (double)v - (double)dequant_step(s, step, cand.zero, quant_step(s, step, cand.zero, v));
                double d2 = d * d;
                score += weighted ? (double)column_weight(S, c.mse_weight, pos[t]) * d2 : d2;
            }
        }
        if (score < best) {   /* a lane's candidates rise: its first least one */
            best = score;
            best_c = k;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {   /* the least score, then the first candidate */
        const double ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int32_t oc = __shfl_xor_sync(0xffffffffu, best_c, o);
        if (ob < best || (ob == best && oc < best_c)) {
            best = ob;
            best_c = oc;
        }
    }
    if (best_c == INT32_MAX) return;   /* no score below infinity: the plain params */
    bool end;
    cand_at(it, s, best_c, out, end);
}

__global__ void k_warp(const dset *sets, loop_cfg c, int64_t b0, bool smem_uc) {
    extern __shared__ float smem[];
    const dset S = sets[blockIdx.y];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, R = WARP_ROWS;
    const int64_t rbase = (int64_t)blockIdx.x * R;
    if (b0 >= S.K || rbase >= S.ld) return;   /* uniform over the CTA */
    const int64_t K = S.K, ld = S.ld, G = S.G, B = GPU_BLOCK;
    const int64_t b1 = b0 + B < K ? b0 + B : K, nb = b1 - b0;
    const int64_t i = rbase + warp;
    const bool row = i < ld;
    const int T = blockDim.x;
    float *ub = smem;                     /* [nb][nb] U's diagonal block */
    float *tile = ub + B * B;             /* [B][R + 1] the block's columns of the CTA's rows */
    float *wv = tile + B * (R + 1);       /* [R][32] a warp's current values */
    float *eb = wv + R * 32;              /* [R][32] a warp's errors so far */
    float *gvb = eb + R * 32;             /* [R][G] a warp's group values */
    float *uc = gvb + R * G;              /* [G][G] the group's ucol (in-loop search) */
    for (int64_t k = threadIdx.x; k < nb * nb; k += T) ub[k] = S.U[(b0 + k / nb) * K + b0 + k % nb];
    /* w and w0 in: column-major tiles, rows contiguous */
    float w = 0.0f, w0 = 0.0f;
    for (int pass = 0; pass < 2; pass++) {
        const float *src = pass ? S.w0t : S.wt;
        for (int64_t k = threadIdx.x; k < nb * R; k += T) {
            const int64_t jj = k / R, rr = k % R;
            tile[jj * (R + 1) + rr] = rbase + rr < ld ? src[(b0 + jj) * ld + rbase + rr] : 0.0f;
        }
        __syncthreads();
        const float v = lane < nb ? tile[lane * (R + 1) + warp] : 0.0f;
        if (pass) w0 = v;
        else w = v;
        __syncthreads();
    }
    double e2 = row && lane == 0 ? S.e2[i] : 0, dsq = row && lane == 0 ? S.dsq[i] : 0;
    float my_q = 0.0f, my_e = 0.0f, my_code = 0.0f;
    float st = 0.0f, z = 0.0f;
    int64_t g_cur = -1;
    for (int64_t p = b0; p < b1; p++) {
        const int64_t g = S.pgroup[p], r = p - b0;
        if (c.dynamic && S.gfirst[g] == p) {
            if (smem_uc) {
                __syncthreads();
                for (int64_t k = threadIdx.x; k < G * G; k += T) uc[k] = S.ucol[g * G * G + k];
                __syncthreads();
            }
            if (row) {
                float *mv = wv + warp * 32, *me = eb + warp * 32, *gv = gvb + warp * G;
                mv[lane] = w;
                me[lane] = my_e;   /* lanes < r: this block's errors so far */
                __syncwarp();
                /* the group's current values: later columns of this block are up to date in the
                 * lanes; columns past it still lack this block's errors */
                for (int64_t t = lane; t < G; t += 32) {
                    const int64_t q = S.gpos[g * G + t];
                    float v;
                    if (q < b1) {
                        v = mv[q - b0];
                    } else {
                        v = S.wt[q * ld + i];
                        for (int64_t k = b0; k < p; k++) v -= S.U[k * K + q] * me[k - b0];
                    }
                    gv[t] = v;
                }
                __syncwarp();
                mq_gparams P;
                warp_group_params(S, c, g, i, gv, smem_uc ? uc : (S.ucol ? S.ucol + g * G * G : NULL), lane, P);
                st = mqd::group_step(c.s, S.gs[i], P);
                z = P.zero;
                g_cur = g;
                if (lane == 0) {
                    S.gp[g * ld + i] = P;
                    S.step[g * ld + i] = st;
                    S.zero[g * ld + i] = z;
                }
                __syncwarp();
            }
        }
        if (!row) continue;
        if (g != g_cur) {
            st = S.step[g * ld + i];
            z = S.zero[g * ld + i];
            g_cur = g;
        }
        float e_t = 0.0f, d_t = 0.0f;
        if (lane == r) {
            const uint8_t code = mqd::quant_step(c.s, st, z, w);
            const float q = mqd::dequant_step(c.s, st, z, code);
            e_t = (w - q) / ub[r * nb + r];
            d_t = w0 - q;
            my_q = q;
            my_e = e_t;
            my_code = (float)code;
        }
        const float e_all = __shfl_sync(0xffffffffu, e_t, (int)r), d_all = __shfl_sync(0xffffffffu, d_t, (int)r);
        if (lane == 0) {
            e2 += (double)e_all * e_all;
            dsq += (double)d_all * d_all;
        }
        if (lane > r && lane < nb) w = fmaf(-ub[r * nb + lane], e_all, w);
    }
    /* the block's quantized values, codes and errors out through the tile */
    for (int pass = 0; pass < 3; pass++) {
        __syncthreads();
        if (lane < nb) tile[lane * (R + 1) + warp] = pass == 0 ? my_q : pass == 1 ? my_e : my_code;
        __syncthreads();
        for (int64_t k = threadIdx.x; k < nb * R; k += T) {
            const int64_t jj = k / R, rr = k % R;
            if (rbase + rr >= ld) continue;
            const float v = tile[jj * (R + 1) + rr];
            if (pass == 0) S.w0t[(b0 + jj) * ld + rbase + rr] = v;
            else if (pass == 1) S.et[jj * ld + rbase + rr] = v;
            else S.ct[(b0 + jj) * ld + rbase + rr] = (uint8_t)v;
        }
    }
    if (row && lane == 0) {
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

/* Results in the original column order, rows as given: codes two to a byte, the lower nibble
 * first (pc [ld][K/2]); with deq the dequantized rows into wt's memory ([ld][K]; wt is not read
 * after the loop). Thread per (row, byte). */
__global__ void k_pack_codes(const dset *sets, uint8_t *const *pc, bool deq) {
    const dset S = sets[blockIdx.z];
    const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t i = (int64_t)blockIdx.y * blockDim.y + threadIdx.y;
    if (2 * b >= S.K || i >= S.ld) return;
    const int64_t c0 = 2 * b, c1 = c0 + 1;
    const int64_t p0 = S.inv ? S.inv[c0] : c0, p1 = S.inv ? S.inv[c1] : c1;
    pc[blockIdx.z][i * (S.K / 2) + b] = mq_u4_pair(S.ct[p0 * S.ld + i], S.ct[p1 * S.ld + i]);
    if (deq) {
        S.wt[i * S.K + c0] = S.w0t[p0 * S.ld + i];
        S.wt[i * S.K + c1] = S.w0t[p1 * S.ld + i];
    }
}

/* Group params row by row: NVFP4's as their E4M3 code alone (pb [ld][ng]; the scale is that
 * code's value and the zero 0, gptq.c's params), the others whole (pp [ld][ng]). */
__global__ void k_pack_params(const dset *sets, uint8_t *const *pb, mq_gparams *const *pp) {
    const dset S = sets[blockIdx.y];
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= S.ld) return;
    for (int64_t g = 0; g < S.ng; g++) {
        const mq_gparams p = S.gp[g * S.ld + i];
        if (pb[blockIdx.y]) pb[blockIdx.y][i * S.ng + g] = p.scale_code;
        else pp[blockIdx.y][i * S.ng + g] = p;
    }
}

/* ---- factor kernels ------------------------------------------------------------------------ */

/* The first index of a non-finite value of x[0..n), or n (atomicMin over a 64-bit index). */
__global__ void k_first_nonfinite(const float *x, int64_t n, unsigned long long *first) {
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (int64_t)gridDim.x * blockDim.x)
        if (!isfinite(x[k])) atomicMin(first, (unsigned long long)k);
}

/* max |x| over n values as the bits of a non-negative float (their order is the values'). */
__global__ void k_absmax_bits(const float *x, int64_t n, unsigned *out) {
    unsigned m = 0;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (int64_t)gridDim.x * blockDim.x)
        m = max(m, __float_as_uint(fabsf(x[k])));
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) atomicMax(out, m);
}

__global__ void k_diag(const float *H, int64_t K, float *d) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k < K) d[k] = H[k * K + k];
}

/* H = scale * sum, both triangles from the lower (mq_hessian_get's values). */
__global__ void k_form(float *H, const float *sum, int64_t K, float scale) {
    const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t a = (int64_t)blockIdx.y * blockDim.y + threadIdx.y;
    if (a >= K || b >= K) return;
    H[a * K + b] = b <= a ? scale * sum[a * K + b] : scale * sum[b * K + a];
}

/* H's upper triangle from its lower one, in place: a Hessian from host memory is read as a
 * device sum is (k_form), so that the same lower triangle gives the same bits whichever way it
 * came (an H whose triangles differ in rounding, as a GEMM's X X^T may, factored as given gave
 * other codes than the same values passed as a device sum). */
__global__ void k_mirror_lower(float *H, int64_t K) {
    const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t a = (int64_t)blockIdx.y * blockDim.y + threadIdx.y;
    if (a >= K || b <= a || b >= K) return;
    H[a * K + b] = H[b * K + a];
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

}  // namespace

#endif
