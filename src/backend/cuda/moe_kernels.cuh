/*
 * Kernels of the MoE op on the GPU (moe.cu holds the host side): routing with the plan of the
 * grouped GEMMs, the bf16 tensor-core GEMMs over the experts' packed weights (gate_up with its
 * SwiGLU epilogue, down), the exact path's twins of the CPU kernels, the weighted combine, and
 * the packer / dequantizer of the layout (moe_dev.cuh).
 */
#ifndef MOEQ_BACKEND_CUDA_MOE_KERNELS_CUH
#define MOEQ_BACKEND_CUDA_MOE_KERNELS_CUH

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "backend/cuda/moe_dev.cuh"
#include "backend/cuda/vec_dev.cuh"
#include "kernels/route_inline.h"

namespace mqm {

typedef __nv_bfloat16 bf16;

/* One packed matrix as the kernels see it (device pointers). */
struct MoeMat {
    const uint4 *codes;      /* [N/16 strips][K64/64 chunks][32 lanes] */
    const uint8_t *scales;   /* INT4: bf16 [strips][ngs][8][2]; NVFP4: E4M3 [strips][K64/16][8][2] */
    const uint8_t *offs;     /* asymmetric INT4: bf16 -(128 + z), as scales; NULL: symmetric */
    const float *s32;        /* INT4 scales in fp32 [N][K/G] (packed row order) where bf16 would
                                round some; NULL: the bf16 ones are exact */
    int N, K, K64, G, ngs;   /* ngs: scale groups stored per strip */
    int pad_;
    float fmul[2], fdiv[2];  /* bf16 path: row half h (gate 0 / up 1) = acc * fmul[h] / fdiv[h] */
    float xmul[2], xdiv[2];  /* exact path: the CPU kernels' mul / div (doubled E2M1 values) */
};

/* A tile of the grouped GEMMs: rows [row0, row0 + rows) of matrix e's sorted rows. */
struct Tile {
    int e, row0, rows, pad_;
};

MQD uint32_t word_of(const uint4 &w, int kk) {
    return kk == 0 ? w.x : kk == 1 ? w.y : kk == 2 ? w.z : w.w;
}

/* NaN ranks below every number; between equal scores the lower index wins (mq_moe_select's
 * order, kernels/route_inline.h). */
MQD bool score_better(float a, float b) { return mq_route_better(a, b); }

MQD float silu_mul(float g, float u) { return g / (1.0f + mqd::vec_expf(-g)) * u; }

/* ---- routing ------------------------------------------------------------------------------- */
struct RouteArgs {
    const float *x;          /* [T, D] fp32 (device) */
    int64_t T;
    int D, D64, E, E1, k, n_mats;
    const float *router;     /* [E1, D]: the router's rows, then the shared gate's */
    const float *bias;       /* [E] or NULL */
    float *logits;           /* [T, E1]: logits, then the scores in place */
    int32_t *sel;            /* [T, k] */
    float *wt;               /* [T, k] */
    float *gsh;              /* [T]: the shared expert's gate */
    int scoring, renorm, n_group, topk_group, has_sgate, has_shared;
    float route_scale;
    /* the input as the GEMMs read it */
    int exact, B;
    bf16 *xb;                /* bf16 path: [T, D64], zero-padded */
    int16_t *xq;             /* exact path: [T, D] integers, xs [T, D/B] scales */
    float *xs;
    /* the plan */
    int bm;
    int32_t *off;            /* [n_mats + 1] first sorted row of each matrix */
    int32_t *perm;           /* [P] sorted row -> token */
    int32_t *pos;            /* [T, k] sorted row of (token, slot) */
    Tile *tiles;
    int32_t *n_tiles;
    unsigned *ticket;        /* 0 between calls */
};

/* The CPU's quant_act_ref on one block of B values: v = rne(x * 32512 / amax), scale
 * amax / 32512; NaN / Inf in the block: scale NaN; amax < 2^-100: all zero. */
MQD void quant_block(const float *v, int B, int16_t *q, float *s) {
    float amax = 0.0f;
    bool bad = false;
    for (int i = 0; i < B; i++) {
        const float a = fabsf(v[i]);
        if (isnan(a)) bad = true;
        else if (a > amax) amax = a;
    }
    if (amax == INFINITY) bad = true;
    if (bad || !(amax >= 0x1p-100f)) {
        for (int i = 0; i < B; i++) q[i] = 0;
        *s = bad ? __int_as_float(0x7fc00000) : 0.0f;
        return;
    }
    const float inv = 32512.0f / amax;
    for (int i = 0; i < B; i++) q[i] = (int16_t)__float2int_rn(v[i] * inv);
    *s = amax / 32512.0f;
}

/* The GEMMs' input from x: token rows [t0, t1), the calling block's threads. */
MQDF void convert_x(const RouteArgs &a, int64_t t0, int64_t t1) {
    if (a.exact) {
        const int nb = a.D / a.B;
        for (int64_t i = t0 * nb + threadIdx.x; i < t1 * nb; i += blockDim.x) {
            const int64_t t = i / nb, b = i % nb;
            quant_block(a.x + t * a.D + b * a.B, a.B, a.xq + t * a.D + b * a.B, a.xs + t * nb + b);
        }
    } else {
        for (int64_t i = t0 * a.D64 + threadIdx.x; i < t1 * a.D64; i += blockDim.x) {
            const int64_t t = i / a.D64, d = i % a.D64;
            a.xb[i] = __float2bfloat16_rn(d < a.D ? a.x[t * a.D + d] : 0.0f);
        }
    }
}

struct Cand {
    float s;
    int i;   /* -1: none */
};
MQD bool cand_better(const Cand &a, const Cand &b) {
    if (a.i < 0) return false;
    if (b.i < 0) return true;
    if (score_better(a.s, b.s)) return true;
    if (score_better(b.s, a.s)) return false;
    return a.i < b.i;
}
MQD Cand warp_best(Cand c) {
MQ_UNROLL
    for (int o = 16; o > 0; o >>= 1) {
        Cand d;
        d.s = __shfl_xor_sync(0xffffffffu, c.s, o);
        d.i = __shfl_xor_sync(0xffffffffu, c.i, o);
        if (cand_better(d, c)) c = d;
    }
    return c;
}

/* Token t's routing by one warp (mq_moe_select's semantics, the CPU op's weights). taken: E bytes
 * of shared memory of this warp; gs: n_group floats of it. */
MQDF void route_token(const RouteArgs &a, int64_t t, uint8_t *taken, float *gs) {
    const int lane = threadIdx.x & 31, E = a.E;
    float *p = a.logits + t * a.E1;
    if (a.scoring == 0) {
        float mx = -INFINITY;
        for (int e = lane; e < E; e += 32) {
            const float v = __ldcg(p + e);
            if (v > mx) mx = v;
        }
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float l0 = __ldcg(p);
        if (isnan(l0)) mx = l0;   /* the CPU's max starts at logit 0 */
        float sum = 0.0f;
        for (int e = lane; e < E; e += 32) {
            const float v = expf(__ldcg(p + e) - mx);
            p[e] = v;
            sum += v;
        }
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        for (int e = lane; e < E; e += 32) p[e] = p[e] / sum;
    } else {
        for (int e = lane; e < E; e += 32) p[e] = 1.0f / (1.0f + expf(-__ldcg(p + e)));
    }
    __syncwarp();
    for (int e = lane; e < E; e += 32) taken[e] = 0;
    __syncwarp();
    if (a.n_group > 1) {
        const int G = a.n_group, EG = E / G;
        for (int g = lane; g < G; g += 32) {   /* each group's two best, as the CPU scans them */
            gs[g] = mq_route_group_score(p, a.bias, (int64_t)g * EG, (int64_t)(g + 1) * EG);
        }
        __syncwarp();
        for (int j = 0; j < a.topk_group; j++) {
            Cand c = {0.0f, -1};
            for (int g = lane; g < G; g += 32) {
                if (taken[g * EG] & 2) continue;
                const Cand d = {gs[g], g};
                if (cand_better(d, c)) c = d;
            }
            c = warp_best(c);
            if (lane == 0) taken[c.i * EG] |= 2;
            __syncwarp();
        }
        for (int g = lane; g < G; g += 32) {
            const uint8_t off = (taken[g * EG] & 2) ? 0 : 1;
            for (int e = g * EG; e < (g + 1) * EG; e++) taken[e] = off;
        }
        __syncwarp();
    }
    int32_t *sel = a.sel + t * a.k;
    for (int j = 0; j < a.k; j++) {
        Cand c = {0.0f, -1};
        for (int e = lane; e < E; e += 32) {
            if (taken[e]) continue;
            const Cand d = {a.bias ? p[e] + a.bias[e] : p[e], e};
            if (cand_better(d, c)) c = d;
        }
        c = warp_best(c);
        if (lane == 0) {
            taken[c.i] = 1;
            sel[j] = c.i;
        }
        __syncwarp();
    }
    if (lane == 0) {
        float *wt = a.wt + t * a.k, sum = 0.0f;
        for (int j = 0; j < a.k; j++) {
            wt[j] = p[sel[j]];
            sum += wt[j];
        }
        for (int j = 0; j < a.k; j++) {
            if (a.renorm && sum != 0.0f) wt[j] = wt[j] / sum;
            wt[j] *= a.route_scale;
        }
        if (a.has_sgate) a.gsh[t] = 1.0f / (1.0f + expf(-__ldcg(p + E)));
    }
    __syncwarp();
}

/* The plan, by one block after every token is routed: a counting sort of (token, slot) by
 * matrix (the shared expert last, all tokens in order), and the tiles of bm rows. The order of
 * the rows within a matrix may vary from run to run; no result depends on it. */
MQDF void plan_block(const RouteArgs &a, int32_t *sh) {
    const int nm = a.n_mats, tid = threadIdx.x, nt = blockDim.x;
    int32_t *cnt = sh, *cur = sh + nm, *tst = sh + 2 * nm;
    const int64_t Tk = a.T * a.k;
    for (int e = tid; e < nm; e += nt) cnt[e] = 0;
    __syncthreads();
    for (int64_t i = tid; i < Tk; i += nt) atomicAdd(&cnt[__ldcg(a.sel + i)], 1);
    __syncthreads();
    if (tid == 0) {
        if (a.has_shared) cnt[a.E] = (int32_t)a.T;
        int32_t o = 0, ts = 0;
        for (int e = 0; e < nm; e++) {
            a.off[e] = o;
            cur[e] = o;
            tst[e] = ts;
            o += cnt[e];
            ts += (cnt[e] + a.bm - 1) / a.bm;
        }
        a.off[nm] = o;
        *a.n_tiles = ts;
    }
    __syncthreads();
    for (int64_t i = tid; i < Tk; i += nt) {
        const int32_t r = atomicAdd(&cur[__ldcg(a.sel + i)], 1);
        a.perm[r] = (int32_t)(i / a.k);
        a.pos[i] = r;
    }
    if (a.has_shared) {
        const int32_t base = cur[a.E];   /* = off[E]: no routed row lands there */
        for (int64_t t = tid; t < a.T; t += nt) a.perm[base + t] = (int32_t)t;
    }
    __syncthreads();
    for (int e = tid; e < nm; e += nt) {
        const int32_t n = cnt[e], first = cur[e] - (e == a.E && a.has_shared ? 0 : n);
        for (int32_t q = 0; q * a.bm < n; q++) {
            Tile tl;
            tl.e = e;
            tl.row0 = first + q * a.bm;
            tl.rows = n - q * a.bm < a.bm ? n - q * a.bm : a.bm;
            tl.pad_ = 0;
            a.tiles[tst[e] + q] = tl;
        }
    }
}

/* True in every thread of the block that finishes last (the others return); resets the ticket. */
MQDF bool last_block(unsigned *ticket) {
    MQ_SHARED(bool, last);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (last) __threadfence();
    return last;
}

/* Few tokens: the logits here (one warp per router row, every token), the input conversion, then
 * the last block routes every token and plans. 256 threads. */
MQ_KERNEL(256) k_route_small(RouteArgs a) {
    MQ_DYN_SMEM(rsm);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * 8 + warp;
    if (row < a.E1) {
        const float *r = a.router + (int64_t)row * a.D;
        for (int64_t t0 = 0; t0 < a.T; t0 += 4) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int d = lane * 4; d < a.D; d += 128) {
                const float4 rv = *(const float4 *)(r + d);
MQ_UNROLL
                for (int u = 0; u < 4; u++)
                    if (t0 + u < a.T) {
                        const float4 xv = *(const float4 *)(a.x + (t0 + u) * a.D + d);
                        acc[u] = fmaf(rv.x, xv.x, fmaf(rv.y, xv.y, fmaf(rv.z, xv.z, fmaf(rv.w, xv.w, acc[u]))));
                    }
            }
MQ_UNROLL
            for (int u = 0; u < 4; u++) {
                float v = acc[u];
                for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                if (lane == 0 && t0 + u < a.T) a.logits[(t0 + u) * a.E1 + row] = v;
            }
        }
    }
    {   /* this block's share of the input conversion */
        const int64_t per = (a.T + gridDim.x - 1) / gridDim.x, t0 = blockIdx.x * per;
        const int64_t t1 = t0 + per < a.T ? t0 + per : a.T;
        if (t0 < t1) convert_x(a, t0, t1);
    }
    if (!last_block(a.ticket)) return;
    const int eb = (a.E + 15) & ~15;
    uint8_t *taken = rsm + warp * eb;
    float *gs = (float *)(rsm + 8 * eb) + warp * (a.n_group > 1 ? a.n_group : 1);
    for (int64_t t = warp; t < a.T; t += 8) route_token(a, t, taken, gs);
    __syncthreads();
    plan_block(a, (int32_t *)rsm);
    if (threadIdx.x == 0) *a.ticket = 0;
}

/* Many tokens (logits from cuBLAS): a warp routes each token, the block converts its 8 tokens'
 * input, the last block plans. 256 threads. */
MQ_KERNEL(256) k_route_large(RouteArgs a) {
    MQ_DYN_SMEM(rsm);
    const int warp = threadIdx.x >> 5;
    const int64_t t = (int64_t)blockIdx.x * 8 + warp;
    const int eb = (a.E + 15) & ~15;
    uint8_t *taken = rsm + warp * eb;
    float *gs = (float *)(rsm + 8 * eb) + warp * (a.n_group > 1 ? a.n_group : 1);
    if (t < a.T) route_token(a, t, taken, gs);
    const int64_t t1 = (int64_t)blockIdx.x * 8 + 8 < a.T ? (int64_t)blockIdx.x * 8 + 8 : a.T;
    convert_x(a, (int64_t)blockIdx.x * 8, t1);
    if (!last_block(a.ticket)) return;
    plan_block(a, (int32_t *)rsm);
    if (threadIdx.x == 0) *a.ticket = 0;
}

/* ---- bf16 tensor-core GEMMs -------------------------------------------------------------- */
struct GemmArgs {
    const MoeMat *mats;
    const Tile *tiles;
    const int32_t *n_tiles;
    const bf16 *act;         /* activation rows (zero-padded to the matrices' K64) */
    int64_t lda;
    const int32_t *perm;     /* sorted row -> activation row (gate_up), or NULL (down: the row) */
    bf16 *mid;               /* SwiGLU: [P, ldm] */
    int64_t ldm;
    float *y;                /* down: [P, ldy] */
    int64_t ldy;
};

/* Bytes of shared memory of one configuration. */
MQHDC constexpr int gemm_stage_bytes(int MS, int NT, int WO, int WT) {
    return MS * WO * 512 + 2 * MS * WO * 64 + 8 * NT * WT * 128;
}
/* Shared memory after the stages: the E4M3 table (NVFP4), the rows' activation offsets. */
MQHDC constexpr int gemm_extra_bytes(int NT, int WT, bool nv) { return (nv ? 512 : 0) + 8 * 8 * NT * WT; }

/* One block: S = MS*WO strips (16 rows each) of one matrix times a tile of up to BM = 8*NT*WT
 * sorted rows; warp (wo, wt) computes MS strips x NT n8-tiles of tokens. Weights and activations
 * go through a STAGES-deep cp.async pipeline of 64-input chunks; each warp decodes its A
 * fragments in registers and runs mma.m16n8k16 (bf16, fp32 accumulators). */
template <int MS, int NT, int WO, int WT, int STAGES, int MINB, bool NV, bool SWIGLU>
MQ_KERNEL2(32 * WO * WT, MINB) k_gemm(GemmArgs p) {
    constexpr int NTHR = 32 * WO * WT, S = MS * WO, BM = 8 * NT * WT;
    constexpr int CODE_B = S * 512, SC_B = S * 64;
    constexpr int STAGE_B = gemm_stage_bytes(MS, NT, WO, WT);
    constexpr int ACTN = (BM * 8 + NTHR - 1) / NTHR;
    MQ_DYN_SMEM(sm);
    const int tix = blockIdx.y + blockIdx.z * 65535;
    if (tix >= *p.n_tiles) return;
    const Tile tl = p.tiles[tix];
    const MoeMat M = p.mats[tl.e];
    const int strips = M.N >> 4, s0 = blockIdx.x * S;
    if (s0 >= strips) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wo = warp % WO, wt = warp / WO;
    const int nch = M.K64 >> 6;
    const bool asym = !NV && M.offs != nullptr;
    uint16_t *lut = (uint16_t *)(sm + STAGES * STAGE_B);
    if (NV)
        for (int i = tid; i < 256; i += NTHR) lut[i] = (uint16_t)(__float_as_uint(e4m3_value((uint32_t)i)) >> 16);

    /* where each row of the tile reads its activations (-1: no row), in shared memory */
    int64_t *rowsrc = (int64_t *)(sm + STAGES * STAGE_B + (NV ? 512 : 0));
    for (int r = tid; r < BM; r += NTHR)
        rowsrc[r] = r < tl.rows ? (p.perm ? (int64_t)p.perm[tl.row0 + r] : (int64_t)(tl.row0 + r)) * p.lda : -1;
    __syncthreads();

    /* the INT4 scale group at the start of the chunk being loaded, kept without divisions
     * (chunks are loaded in order; a chunk of 64 inputs spans at most two groups of G >= 32) */
    int lg = 0, lg_next = NV ? 0 : M.G;
    auto load = [&](int stage, int c) {
        uint8_t *st = sm + stage * STAGE_B;
        if (!NV)
            while (c * 64 >= lg_next) {
                lg++;
                lg_next += M.G;
            }
        for (int i = tid; i < S * 32; i += NTHR) {
            const int sl = i >> 5, l = i & 31, sg = s0 + sl;
            if (sg < strips) cp_async16(st + sl * 512 + l * 16, M.codes + ((int64_t)sg * nch + c) * 32 + l);
        }
        for (int i = tid; i < S * 4; i += NTHR) {
            const int sl = i >> 2, pc = i & 3, sg = s0 + sl;
            if (sg >= strips) continue;
            if (NV) {
                cp_async16(st + CODE_B + sl * 64 + pc * 16, M.scales + ((int64_t)sg * M.ngs + 4 * c) * 16 + pc * 16);
            } else {
                const int64_t o = ((int64_t)sg * M.ngs + lg) * 32 + pc * 16;
                cp_async16(st + CODE_B + sl * 64 + pc * 16, M.scales + o);
                if (asym) cp_async16(st + CODE_B + SC_B + sl * 64 + pc * 16, M.offs + o);
            }
        }
MQ_UNROLL
        for (int i = 0; i < ACTN; i++) {
            const int idx = tid + i * NTHR, r = idx >> 3, ch = idx & 7;
            if (idx >= BM * 8) break;
            const int64_t src = rowsrc[r];
            if (src >= 0)
                cp_async16(st + CODE_B + 2 * SC_B + r * 128 + ((ch ^ (r & 7)) << 4), p.act + src + c * 64 + ch * 8);
        }
    };

    float acc[MS][NT][4];
MQ_UNROLL
    for (int i = 0; i < MS; i++)
MQ_UNROLL
        for (int j = 0; j < NT; j++)
MQ_UNROLL
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f;

MQ_UNROLL
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nch) load(s, s);
        cp_async_commit();
    }
    const int g = lane >> 2;
    int cg_next = NV ? 0 : M.G;   /* the compute side's next group boundary (input index) */
    for (int c = 0; c < nch; c++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            const int cn = c + STAGES - 1;
            if (cn < nch) load(cn % STAGES, cn);
            cp_async_commit();
        }
        const uint8_t *st = sm + (c % STAGES) * STAGE_B;
        const uint8_t *actb = st + CODE_B + 2 * SC_B;
        uint4 wv[MS];
MQ_UNROLL
        for (int i = 0; i < MS; i++) wv[i] = *(const uint4 *)(st + (wo * MS + i) * 512 + lane * 16);
        if (!NV)
            while (c * 64 >= cg_next) cg_next += M.G;
MQ_UNROLL
        for (int kk = 0; kk < 4; kk++) {
            uint32_t b[NT][2];
            if (NT == 1) {
                const int r = wt * 8 + (lane & 7), chl = kk * 2 + ((lane >> 3) & 1);
                ldmatrix_x2(b[0][0], b[0][1], actb + r * 128 + ((chl ^ (r & 7)) << 4));
            } else {
MQ_UNROLL
                for (int jj = 0; jj < NT / 2; jj++) {
                    const int r = wt * NT * 8 + jj * 16 + ((lane >> 4) << 3) + (lane & 7);
                    const int chl = kk * 2 + ((lane >> 3) & 1);
                    ldmatrix_x4(b[2 * jj][0], b[2 * jj][1], b[2 * jj + 1][0], b[2 * jj + 1][1],
                                actb + r * 128 + ((chl ^ (r & 7)) << 4));
                }
            }
            const int gi = NV ? kk : (c * 64 + kk * 16 >= cg_next ? 1 : 0);
MQ_UNROLL
            for (int i = 0; i < MS; i++) {
                const uint8_t *scp = st + CODE_B + (wo * MS + i) * 64;
                uint32_t a[4];
                if (NV) {
                    const uint32_t pr = *(const uint16_t *)(scp + gi * 16 + g * 2);
                    decode_nvfp4(word_of(wv[i], kk), (uint32_t)lut[pr & 0xffu] * 0x10001u,
                                 (uint32_t)lut[pr >> 8] * 0x10001u, a);
                } else {
                    const uint32_t sw = *(const uint32_t *)(scp + gi * 32 + g * 4);
                    uint32_t og = BF16X2_NEG136, og8 = BF16X2_NEG136;
                    if (asym) {
                        const uint32_t ow = *(const uint32_t *)(scp + SC_B + gi * 32 + g * 4);
                        og = bcast_lo(ow);
                        og8 = bcast_hi(ow);
                    }
                    decode_int4(word_of(wv[i], kk), bcast_lo(sw), bcast_hi(sw), og, og8, a);
                }
MQ_UNROLL
                for (int j = 0; j < NT; j++) mma_bf16(acc[i][j], a, b[j][0], b[j][1]);
            }
        }
    }
    cp_async_wait<0>();

    const int t4 = lane & 3;
MQ_UNROLL
    for (int i = 0; i < MS; i++) {
        const int sg = s0 + wo * MS + i;
        if (sg >= strips) continue;
MQ_UNROLL
        for (int j = 0; j < NT; j++) {
            const int tok0 = wt * NT * 8 + j * 8 + 2 * t4;
MQ_UNROLL
            for (int e = 0; e < 2; e++) {
                const int tok = tok0 + e;
                if (tok >= tl.rows) continue;
                const int64_t row = tl.row0 + tok;
                if (SWIGLU) {
                    const float gt = acc[i][j][e] * M.fmul[0] / M.fdiv[0];
                    const float up = acc[i][j][2 + e] * M.fmul[1] / M.fdiv[1];
                    p.mid[row * p.ldm + sg * 8 + g] = __float2bfloat16_rn(silu_mul(gt, up));
                } else {
                    float *yr = p.y + row * p.ldy + sg * 16 + g;
                    yr[0] = acc[i][j][e] * M.fmul[0] / M.fdiv[0];
                    yr[8] = acc[i][j][2 + e] * M.fmul[0] / M.fdiv[0];
                }
            }
        }
    }
    if (SWIGLU && blockIdx.x == 0) {   /* the padding inputs of down: zero */
        const int F = M.N >> 1, F64 = (F + 63) & ~63, w = F64 - F;
        for (int i = tid; i < tl.rows * w; i += NTHR)
            p.mid[(int64_t)(tl.row0 + i / w) * p.ldm + F + i % w] = __float2bfloat16_rn(0.0f);
    }
}

/* ---- the exact path: the CPU kernels' arithmetic --------------------------------------------- */
/* The signed integer weight of packed row n, input k (INT4 u - z; NVFP4 2 * e2m1) and the scale
 * of its group, as the CPU kernels use them. */
template <bool NV>
MQD int exact_weight(const MoeMat &M, int n, int k) {
    const int strip = n >> 4, r = n & 15, c = k >> 6, kk = (k >> 4) & 3;
    int lane, ai;
    frag_pos(r, k & 15, &lane, &ai);
    const uint32_t w = ((const uint32_t *)M.codes)[(((int64_t)strip * (M.K64 >> 6) + c) * 32 + lane) * 4 + kk];
    if (NV) return e2m1_x2(nvfp4_code(w, ai));
    int z = 8;
    if (M.offs) {
        const uint16_t o = ((const uint16_t *)M.offs)[(((int64_t)strip * M.ngs + k / M.G) * 8 + (r & 7)) * 2 + (r >> 3)];
        z = (int)(-__uint_as_float((uint32_t)o << 16)) - 128;
    }
    return (int)int4_code(w, ai) - z;
}
template <bool NV>
MQD float exact_scale(const MoeMat &M, int n, int k) {
    const int strip = n >> 4, r = n & 15;
    if (NV) return e4m3_value(M.scales[((int64_t)strip * M.ngs + (k >> 4)) * 16 + (r & 7) * 2 + (r >> 3)]);
    if (M.s32) return M.s32[(int64_t)n * (M.K / M.G) + k / M.G];
    const uint16_t s = ((const uint16_t *)M.scales)[(((int64_t)strip * M.ngs + k / M.G) * 8 + (r & 7)) * 2 + (r >> 3)];
    return __uint_as_float((uint32_t)s << 16);
}

struct ExactArgs {
    const MoeMat *mats;
    const Tile *tiles;
    const int32_t *n_tiles;
    const int16_t *q;        /* activation integers [*, ldq] */
    const float *qs;         /* their block scales [*, ldq / B] */
    int64_t ldq;
    const int32_t *perm;     /* sorted row -> activation row, or NULL */
    float *out;              /* SwiGLU: [P, ldo] fp32; down: y [P, ldo] */
    int64_t ldo;
};

/* 16 rows x 64 outputs per block (256 threads: output = tid % 64, rows tid / 64 + 4i): per block
 * of B inputs the exact integer dot, then acc = fmaf(dot, sw * sa, acc) in block order, then
 * acc * mul / div and the SwiGLU: gemm_ref's operations in gemm_ref's order. */
template <bool NV, bool SWIGLU, int B>
MQ_KERNEL(256) k_exact(ExactArgs p) {
    constexpr int BMX = 16;
    MQ_SHARED_ARR(int16_t, v, [BMX][B]);
    MQ_SHARED_ARR(float, sa, [BMX]);
    const int tix = blockIdx.y + blockIdx.z * 65535;
    if (tix >= *p.n_tiles) return;
    const Tile tl = p.tiles[tix];
    const MoeMat M = p.mats[tl.e];
    const int Nout = SWIGLU ? M.N / 2 : M.N, o0 = blockIdx.x * 64;
    if (o0 >= Nout) return;
    const int tid = threadIdx.x, o = o0 + (tid & 63), rl = tid >> 6;
    const bool live = o < Nout;
    const int n0 = SWIGLU ? (o >> 3) * 16 + (o & 7) : o, n1 = n0 + 8;
    float ag[4] = {0.0f, 0.0f, 0.0f, 0.0f}, au[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int nb = M.K / B;
    for (int b = 0; b < nb; b++) {
        __syncthreads();
        for (int i = tid; i < BMX * B; i += 256) {
            const int r = i / B, kk = i % B;
            int16_t val = 0;
            if (r < tl.rows) {
                const int64_t src = p.perm ? p.perm[tl.row0 + r] : tl.row0 + r;
                val = p.q[src * p.ldq + (int64_t)b * B + kk];
            }
            v[r][kk] = val;
        }
        if (tid < BMX) {
            float s = 0.0f;
            if (tid < tl.rows) {
                const int64_t src = p.perm ? p.perm[tl.row0 + tid] : tl.row0 + tid;
                s = p.qs[src * (p.ldq / B) + b];
            }
            sa[tid] = s;
        }
        __syncthreads();
        if (!live) continue;
        int wg[B], wu[B];
MQ_UNROLL
        for (int kk = 0; kk < B; kk++) {
            wg[kk] = exact_weight<NV>(M, n0, b * B + kk);
            if (SWIGLU) wu[kk] = exact_weight<NV>(M, n1, b * B + kk);
        }
        const float sg = exact_scale<NV>(M, n0, b * B), su = SWIGLU ? exact_scale<NV>(M, n1, b * B) : 0.0f;
MQ_UNROLL
        for (int q = 0; q < 4; q++) {
            const int r = rl + 4 * q;
            int dg = 0, du = 0;
MQ_UNROLL
            for (int kk = 0; kk < B; kk++) {
                dg += wg[kk] * (int)v[r][kk];
                if (SWIGLU) du += wu[kk] * (int)v[r][kk];
            }
            ag[q] = fmaf((float)dg, sg * sa[r], ag[q]);
            if (SWIGLU) au[q] = fmaf((float)du, su * sa[r], au[q]);
        }
    }
    if (!live) return;
MQ_UNROLL
    for (int q = 0; q < 4; q++) {
        const int r = rl + 4 * q;
        if (r >= tl.rows) continue;
        float *dst = p.out + (int64_t)(tl.row0 + r) * p.ldo + o;
        const float rg = ag[q] * M.xmul[0] / M.xdiv[0];
        if (SWIGLU) {
            const float ru = au[q] * M.xmul[1] / M.xdiv[1];
            *dst = silu_mul(rg, ru);
        } else {
            *dst = rg;
        }
    }
}

/* rows x cols values (row stride ldx) -> integers q [rows, ldq] and scales [rows, ldq / B]. */
MQ_KERNEL0 k_quant_rows(const float *x, int64_t rows, int cols, int64_t ldx, int B, int16_t *q, float *qs,
                             int64_t ldq) {
    const int nb = cols / B;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * nb; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / nb, b = i % nb;
        quant_block(x + r * ldx + b * B, B, q + r * ldq + b * B, qs + r * (ldq / B) + b);
    }
}

/* out[t] = sum_j wt[t, j] y[pos[t, j]] (+ g[t] y[off[E] + t]), in the CPU's order and operations. */
MQ_KERNEL0 k_combine(const float *y, int64_t D, int64_t T, int k, const int32_t *pos, const float *wt,
                          const float *gsh, const int32_t *off_shared, float *out) {
    const int64_t D4 = D / 4;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < T * D4; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / D4, d = (i % D4) * 4;
        const float w0 = wt[t * k];
        const float4 y0 = *(const float4 *)(y + (int64_t)pos[t * k] * D + d);
        float4 o = make_float4(w0 * y0.x, w0 * y0.y, w0 * y0.z, w0 * y0.w);
        for (int j = 1; j < k; j++) {
            const float w = wt[t * k + j];
            const float4 yj = *(const float4 *)(y + (int64_t)pos[t * k + j] * D + d);
            o.x = o.x + w * yj.x;
            o.y = o.y + w * yj.y;
            o.z = o.z + w * yj.z;
            o.w = o.w + w * yj.w;
        }
        if (off_shared) {
            const float gg = gsh ? gsh[t] : 1.0f;
            const float4 ys = *(const float4 *)(y + ((int64_t)*off_shared + t) * D + d);
            o.x = o.x + gg * ys.x;
            o.y = o.y + gg * ys.y;
            o.z = o.z + gg * ys.z;
            o.w = o.w + gg * ys.w;
        }
        *(float4 *)(out + t * D + d) = o;
    }
}

/* ---- the layout: packing and dequantization ------------------------------------------------ */
/* Packed row n of a gate_up matrix (F > 0) or of down (F = 0) -> canonical row. */
MQHD int64_t canon_row(int64_t n, int64_t F) {
    if (!F) return n;
    const int64_t s = n >> 4, r = n & 15;
    return r < 8 ? s * 8 + r : F + s * 8 + r - 8;
}

/* Codes of n_ex matrices [N, K] (canonical, one byte each) -> the packed words. */
MQ_KERNEL0 k_pack_codes(const uint8_t *src, int n_ex, int N, int K, int K64, int F, int nv, uint32_t *dst) {
    const int nch = K64 >> 6;
    const int64_t per = (int64_t)(N >> 4) * nch * 128, total = per * n_ex;
    for (int64_t w = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; w < total; w += (int64_t)gridDim.x * blockDim.x) {
        const int64_t ex = w / per, rem = w % per;
        const int kk = (int)(rem & 3), lane = (int)((rem >> 2) & 31);
        const int64_t sc = rem >> 7, strip = sc / nch, c = sc % nch;
        const int g = lane >> 2, t = lane & 3;
        uint32_t word = 0;
        for (int ai = 0; ai < 8; ai++) {
            const int r = g + 8 * ((ai >> 1) & 1), kin = (ai >> 2) * 8 + 2 * t + (ai & 1);
            const int64_t k = c * 64 + kk * 16 + kin;
            uint32_t code = 0;
            if (k < K) code = src[(ex * N + canon_row(strip * 16 + r, F)) * K + k];
            word |= nv ? nvfp4_bits(code, ai) : int4_bits(code, ai);
        }
        dst[ex * per + rem] = word;
    }
}

/* Matrix mats[e0 + blockIdx.y] decoded by the fast path's decoders into canonical rows of out
 * (bf16 when outb, else fp32 outf), the weight times fmul/fdiv when `global`, else the bf16 value
 * the MMA multiplies. One warp per (strip, chunk). F: gate_up's F, 0 for down. */
template <bool NV>
MQ_KERNEL0 k_dequant(const MoeMat *mats, int e0, int64_t F, bool global, float *outf, bf16 *outb,
                          int64_t mat_stride) {
    const MoeMat M = mats[e0 + blockIdx.y];
    const int lane = threadIdx.x & 31, nch = M.K64 >> 6, strips = M.N >> 4;
    const int64_t wid = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (wid >= (int64_t)strips * nch) return;
    const int strip = (int)(wid / nch), c = (int)(wid % nch), g = lane >> 2;
    const uint4 wv = M.codes[((int64_t)strip * nch + c) * 32 + lane];
    const int64_t base = (int64_t)blockIdx.y * mat_stride;
    for (int kk = 0; kk < 4; kk++) {
        uint32_t a[4];
        if (NV) {
            const int grp = c * 4 + kk;
            const uint8_t *s = M.scales + ((int64_t)strip * M.ngs + grp) * 16 + g * 2;
            const uint32_t sg = __float_as_uint(e4m3_value(s[0])) >> 16, sg8 = __float_as_uint(e4m3_value(s[1])) >> 16;
            decode_nvfp4(word_of(wv, kk), sg * 0x10001u, sg8 * 0x10001u, a);
        } else {
            const int grp = (c * 64 + kk * 16) / M.G;
            const uint32_t sw = *(const uint32_t *)(M.scales + (((int64_t)strip * M.ngs + grp) * 8 + g) * 4);
            uint32_t og = BF16X2_NEG136, og8 = BF16X2_NEG136;
            if (M.offs) {
                const uint32_t ow = *(const uint32_t *)(M.offs + (((int64_t)strip * M.ngs + grp) * 8 + g) * 4);
                og = bcast_lo(ow);
                og8 = bcast_hi(ow);
            }
            decode_int4(word_of(wv, kk), bcast_lo(sw), bcast_hi(sw), og, og8, a);
        }
        for (int ai = 0; ai < 8; ai++) {
            const int t = lane & 3, r = g + 8 * ((ai >> 1) & 1), kin = (ai >> 2) * 8 + 2 * t + (ai & 1);
            const int k = c * 64 + kk * 16 + kin;
            if (k >= M.K) continue;
            const uint32_t bits = (ai & 1) ? a[ai >> 1] >> 16 : a[ai >> 1] & 0xffffu;
            float v = __uint_as_float(bits << 16);
            const int h = F ? (r >> 3) : 0;
            if (global) v = v * M.fmul[h] / M.fdiv[h];
            const int64_t idx = base + canon_row((int64_t)strip * 16 + r, F) * M.K + k;
            if (outb) outb[idx] = __float2bfloat16_rn(v);
            else outf[idx] = v;
        }
    }
}

}  // namespace mqm

#endif
