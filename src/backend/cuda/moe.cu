/*
 * The quantized MoE feed-forward op on the GPU (gpu.h's mq_gpu_moe_*): the CPU op's semantics
 * (include/moeq.h, moeq_moe_ffn) on experts packed once into the layout of moe_dev.cuh.
 *
 * A call: the router's logits in fp32 (a warp per router row for up to ROUTE_SMALL_T tokens,
 * else cuBLAS sgemm without TF32); per token softmax or sigmoid, the group-limited top-k with the
 * selection bias, the weights (mq_moe_select's rules); the last routing block sorts the (token,
 * slot) pairs by expert and cuts the tiles of the grouped GEMMs. Then
 *  - bf16 mode: x in bf16; gate_up as one grouped GEMM on the tensor cores (mma.m16n8k16, fp32
 *    accumulators, the 4-bit weights decoded to bf16 in registers) with SwiGLU in the epilogue,
 *    the result rounded to bf16; down likewise into fp32 rows; four tile shapes by the expected
 *    rows per expert (64 outputs x 8 rows for decoding up to 128 x 128 for prefill; every shape
 *    gives the same bits, each output being one chain of tensor-core steps over k);
 *  - fp32 mode (exact): the CPU kernels' arithmetic, operation for operation: activations as
 *    16-bit integers per block of 32 (INT4) or 16 (NVFP4) inputs, exact integer block dots, one
 *    fp32 multiply and fused multiply-add per block in block order, acc * mul / div, moeq's SwiGLU;
 *    given the same routing the output is the CPU op's, bit for bit;
 * and the weighted sum per token in slot order, the gated shared expert last (the CPU's order).
 * Everything runs on the context's stream 0; nothing waits for the device unless a host pointer
 * is given (then the call returns with the result in place). moe_emu.cu runs the same kernels on
 * the CPU for the tests of machines without a GPU.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <new>
#include <vector>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/moe_host.cuh"
#include "backend/cuda/moe_kernels.cuh"

extern "C" {
#include "kernels/moe_ffn.h"
}

using namespace mqm;

namespace {

constexpr size_t CUBLAS_WS = (size_t)32 << 20;

struct Ws {
    int64_t T, P;                 /* capacity */
    float *xd, *logits, *wt, *gsh, *y, *outd;
    int32_t *sel, *pos, *off, *perm, *n_tiles;
    unsigned *ticket;
    Tile *tiles;
    int64_t max_tiles;
    bf16 *xb, *mid;
    /* exact mode (allocated on first use) */
    int64_t xT, xP;
    int16_t *xq, *midq;
    float *xs, *midf, *mids;
    /* dequantize + cuBLAS (allocated on first use) */
    int64_t bP;
    bf16 *wgu, *wdn, *xsort;
    float *hbuf;
    void **ptrs;                  /* [6 * n_mats] device pointer arrays of the grouped GEMMs */
};

}  // namespace

struct mq_gpu_moe {
    mq_gpu *g;
    cudaStream_t s;
    cublasHandle_t blas;
    void *blas_ws;
    int nv, G, B, E, D, F, Fs, n_mats, asym;
    int D64, Fmax, F64m;
    /* routing */
    int k, scoring, renorm, n_group, topk_group, E1, has_sgate;
    float route_scale;
    float *router, *bias;
    /* weights */
    uint8_t *blob;
    size_t blob_bytes, resident;
    MoeMat *d_mats;               /* [2 * n_mats]: gate_up of each matrix, then down */
    std::vector<MoeMat> h_mats;
    Ws ws;
    int64_t last_T;
    int force_cfg;                /* mq_gpu_moe_force_tiles: a tile shape for every call, or -1 */
    bool dense;                   /* mq_gpu_moe_upload_dense: bf16 weights in ws.wgu / ws.wdn, no codes */
};

namespace {

moeq_status set_dev(mq_gpu_moe *m) { return CU(cudaSetDevice(m->g->device)); }

bool is_device_ptr(const void *p) {
    cudaPointerAttributes at;
    if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged;
}

const char *k_up = "moe_experts";

/* ---- value checks (the CPU packer's messages) --------------------------------------------- */
moeq_status check_codes(const uint8_t *c, int64_t E, int64_t rows, int64_t cols, const char *tensor) {
    const int64_t n = E * rows * cols;
    for (int64_t i = 0; i < n;) {
        if (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, c + i, 8);
            if (!(w & 0xF0F0F0F0F0F0F0F0ull)) {
                i += 8;
                continue;
            }
        }
        if (c[i] > 15) {
            const int64_t e = i / (rows * cols), r = i / cols % rows, k = i % cols;
            char ex[40] = "";
            if (E > 1 || strncmp(tensor, "shared_", 7)) snprintf(ex, sizeof ex, "expert %lld ", (long long)e);
            return mq_err(MOEQ_E_FORMAT, "%s: %s.codes: %srow %lld col %d: code %d > 15", k_up, tensor, ex,
                          (long long)r, (int)k, c[i]);
        }
        i++;
    }
    return MOEQ_OK;
}

moeq_status check_scales(const moeq_tensor_ref *s, int nv, int64_t E, int64_t rows, int64_t ng, const char *tensor,
                         bool shared) {
    const int64_t n = E * rows * ng;
    for (int64_t i = 0; i < n; i++) {
        bool ok;
        if (nv) ok = (((const uint8_t *)s->data)[i] & 0x7f) != 0x7f;
        else ok = isfinite(((const float *)s->data)[i]);
        if (ok) continue;
        char ex[40] = "";
        if (!shared) snprintf(ex, sizeof ex, "expert %lld ", (long long)(i / (rows * ng)));
        return mq_err(MOEQ_E_NUMERIC, "%s: %s.scales: %srow %lld group %d: %s", k_up, tensor, ex,
                      (long long)(i / ng % rows), (int)(i % ng), nv ? "E4M3 NaN" : "not finite");
    }
    return MOEQ_OK;
}

moeq_status check_global(float gs, const char *tensor, int64_t e) {
    if (gs > 0.0f && isfinite(gs) && isfinite(2.0f * gs)) return MOEQ_OK;
    if (e >= 0)
        return mq_err(MOEQ_E_NUMERIC, "%s: %s.global_scale: expert %lld: %g (must be finite and > 0)", k_up, tensor,
                      (long long)e, (double)gs);
    return mq_err(MOEQ_E_NUMERIC, "%s: %s.global_scale: %g (must be finite and > 0)", k_up, tensor, (double)gs);
}

/* The zero points of asymmetric INT4: U8 codes 0..15 shaped as the scales. */
moeq_status check_zero_ref(const moeq_tensor_ref *z, const char *name, int64_t E, int64_t rows, int64_t ng) {
    int64_t sh[3];
    int nd = 0;
    if (E > 0) sh[nd++] = E;
    sh[nd++] = rows;
    sh[nd++] = ng;
    if (!z->data) return mq_err(MOEQ_E_ARG, "%s: zero_points.%s: data is NULL", k_up, name);
    if (z->dtype != MOEQ_DT_U8)
        return mq_err(MOEQ_E_ARG, "%s: zero_points.%s: dtype %s, expected U8", k_up, name, moeq_dtype_name(z->dtype));
    bool same = z->ndim == nd;
    for (int i = 0; same && i < nd; i++) same = z->shape[i] == sh[i];
    if (!same)
        return mq_err(MOEQ_E_SHAPE, "%s: zero_points.%s: expected shape [%s%lld, %lld]", k_up, name,
                      E > 0 ? "E, " : "", (long long)rows, (long long)ng);
    const int64_t n = (E > 0 ? E : 1) * rows * ng;
    if (z->nbytes < (size_t)n)
        return mq_err(MOEQ_E_ARG, "%s: zero_points.%s: buffer of %zu bytes, needs %lld", k_up, name, z->nbytes,
                      (long long)n);
    const uint8_t *c = (const uint8_t *)z->data;
    for (int64_t i = 0; i < n; i++)
        if (c[i] > 15)
            return mq_err(MOEQ_E_FORMAT, "%s: zero_points.%s: entry %lld: %d > 15", k_up, name, (long long)i, c[i]);
    return MOEQ_OK;
}

/* n_ex matrices of geometry q, their codes one after the other at dst (q.codes is a multiple of
 * 512 bytes, so the blob's 256-byte alignment adds no gap between them). */
moeq_status pack_codes(mq_gpu_moe *m, const uint8_t *src, int n_ex, const Geom &q, uint8_t *dst) {
    const size_t per = (size_t)q.N * (size_t)q.K;
    int batch = (int)std::max<size_t>(1, ((size_t)256 << 20) / std::max<size_t>(per, 1));
    batch = std::min(batch, n_ex);
    uint8_t *stage = NULL;
    moeq_status st = cu_alloc(&stage, per * (size_t)batch, "MoE weight upload");
    for (int e0 = 0; e0 < n_ex && !st; e0 += batch) {
        const int n = std::min(batch, n_ex - e0);
        st = CU(cudaMemcpyAsync(stage, src + per * (size_t)e0, per * (size_t)n, cudaMemcpyHostToDevice, m->s));
        const int64_t words = (int64_t)n * (q.N / 16) * (q.K64 / 64) * 128;
        if (!st) {
            k_pack_codes<<<(unsigned)std::min<int64_t>((words + 255) / 256, 65536), 256, 0, m->s>>>(
                stage, n, q.N, q.K, q.K64, q.fused_F, m->nv, (uint32_t *)(dst + q.codes * (size_t)e0));
            st = CU_LAUNCHED("k_pack_codes");
        }
        if (!st) st = CU(cudaStreamSynchronize(m->s));
    }
    mq_cu_free(stage);
    return st;
}

/* ---- workspace -------------------------------------------------------------------------------- */
template <typename T> moeq_status ws_grow(T **p, size_t n, const char *what) {
    mq_cu_free(*p);
    *p = NULL;
    return cu_alloc(p, n ? n : 1, what);
}

int64_t rows_of(const mq_gpu_moe *m, int64_t T) { return T * m->k + (m->Fs > 0 ? T : 0); }

moeq_status ensure_ws(mq_gpu_moe *m, int64_t T) {
    Ws &w = m->ws;
    if (T <= w.T) return MOEQ_OK;
    const int64_t P = rows_of(m, T), Tk = T * m->k;
    moeq_status st = MOEQ_OK;
    const char *what = "MoE workspace";
    if (!st) st = ws_grow(&w.xd, (size_t)(T * m->D), what);
    if (!st) st = ws_grow(&w.outd, (size_t)(T * m->D), what);
    if (!st) st = ws_grow(&w.logits, (size_t)(T * m->E1), what);
    if (!st) st = ws_grow(&w.sel, (size_t)Tk, what);
    if (!st) st = ws_grow(&w.pos, (size_t)Tk, what);
    if (!st) st = ws_grow(&w.wt, (size_t)Tk, what);
    if (!st) st = ws_grow(&w.gsh, (size_t)T, what);
    if (!st) st = ws_grow(&w.perm, (size_t)P, what);
    w.max_tiles = P / 8 + std::min<int64_t>(m->n_mats, P) + 1;
    if (!st) st = ws_grow(&w.tiles, (size_t)w.max_tiles, what);
    if (!st) st = ws_grow(&w.xb, (size_t)(T * m->D64), what);
    if (!st) st = ws_grow(&w.mid, (size_t)(P * m->F64m), what);
    if (!st) st = ws_grow(&w.y, (size_t)(P * m->D), what);
    if (!st && !w.off) st = cu_alloc(&w.off, (size_t)m->n_mats + 1, what);
    if (!st && !w.n_tiles) st = cu_alloc(&w.n_tiles, 1, what);
    if (!st && !w.ticket) {
        st = cu_alloc(&w.ticket, 1, what);
        if (!st) st = CU(cudaMemsetAsync(w.ticket, 0, sizeof(unsigned), m->s));
    }
    if (!st) st = CU(cudaMemsetAsync(w.mid, 0, (size_t)(P * m->F64m) * sizeof(bf16), m->s));
    if (!st) {
        w.T = T;
        w.P = P;
    } else {
        w.T = w.P = 0;
    }
    return st;
}

moeq_status ensure_exact(mq_gpu_moe *m, int64_t T) {
    Ws &w = m->ws;
    if (T <= w.xT) return MOEQ_OK;
    const int64_t P = rows_of(m, T);
    const char *what = "MoE workspace (fp32 mode)";
    moeq_status st = ws_grow(&w.xq, (size_t)(T * m->D), what);
    if (!st) st = ws_grow(&w.xs, (size_t)(T * (m->D / m->B)), what);
    if (!st) st = ws_grow(&w.midf, (size_t)(P * m->Fmax), what);
    if (!st) st = ws_grow(&w.midq, (size_t)(P * m->Fmax), what);
    if (!st) st = ws_grow(&w.mids, (size_t)(P * (m->Fmax / m->B)), what);
    w.xT = st ? 0 : T;
    w.xP = st ? 0 : P;
    return st;
}

void ws_free(Ws &w) {
    void *ps[] = {w.xd, w.logits, w.wt, w.gsh, w.y, w.outd, w.sel, w.pos, w.off, w.perm, w.n_tiles, w.ticket,
                  w.tiles, w.xb, w.mid, w.xq, w.midq, w.xs, w.midf, w.mids, w.wgu, w.wdn, w.xsort, w.hbuf, w.ptrs};
    for (void *p : ps) mq_cu_free(p);
    memset(&w, 0, sizeof w);
}

/* ---- the call --------------------------------------------------------------------------------- */
RouteArgs route_args(mq_gpu_moe *m, const float *xd, int64_t T, bool exact, int bm) {
    Ws &w = m->ws;
    RouteArgs a;
    memset(&a, 0, sizeof a);
    a.x = xd;
    a.T = T;
    a.D = m->D;
    a.D64 = m->D64;
    a.E = m->E;
    a.E1 = m->E1;
    a.k = m->k;
    a.n_mats = m->n_mats;
    a.router = m->router;
    a.bias = m->bias;
    a.logits = w.logits;
    a.sel = w.sel;
    a.wt = w.wt;
    a.gsh = w.gsh;
    a.scoring = m->scoring;
    a.renorm = m->renorm;
    a.n_group = m->n_group;
    a.topk_group = m->topk_group;
    a.has_sgate = m->has_sgate;
    a.has_shared = m->Fs > 0;
    a.route_scale = m->route_scale;
    a.exact = exact;
    a.B = m->B;
    a.xb = w.xb;
    a.xq = w.xq;
    a.xs = w.xs;
    a.bm = bm;
    a.off = w.off;
    a.perm = w.perm;
    a.pos = w.pos;
    a.tiles = w.tiles;
    a.n_tiles = w.n_tiles;
    a.ticket = w.ticket;
    return a;
}

moeq_status run_routing(mq_gpu_moe *m, const float *xd, int64_t T, bool exact, int bm) {
    const RouteArgs a = route_args(m, xd, T, exact, bm);
    const size_t sm = route_smem(m->E, m->n_group, m->n_mats);
    if (T <= ROUTE_SMALL_T) {
        k_route_small<<<(unsigned)((m->E1 + 7) / 8), 256, sm, m->s>>>(a);
        return CU_LAUNCHED("k_route_small");
    }
    const float one = 1.0f, zero = 0.0f;
    moeq_status st = CUBLAS(cublasSgemm(m->blas, CUBLAS_OP_T, CUBLAS_OP_N, m->E1, (int)T, m->D, &one, m->router,
                                        m->D, xd, m->D, &zero, m->ws.logits, m->E1));
    if (st) return st;
    k_route_large<<<(unsigned)((T + 7) / 8), 256, sm, m->s>>>(a);
    return CU_LAUNCHED("k_route_large");
}

template <int MS, int NT, int WO, int WT, int STAGES, int MINB, bool NV, bool SWIGLU>
moeq_status launch_gemm(mq_gpu_moe *m, const GemmArgs &p, int64_t max_strips, int64_t max_tiles) {
    constexpr Cfg c = {MS, NT, WO, WT, STAGES, MINB};
    const dim3 grid = tile_grid((max_strips + c.S() - 1) / c.S(), max_tiles);
    k_gemm<MS, NT, WO, WT, STAGES, MINB, NV, SWIGLU><<<grid, c.threads(), c.smem(NV), m->s>>>(p);
    return CU_LAUNCHED("k_gemm");
}

template <int MS, int NT, int WO, int WT, int STAGES, int MINB, bool NV>
moeq_status set_attr_one() {
    constexpr Cfg c = {MS, NT, WO, WT, STAGES, MINB};
    moeq_status st = CU(cudaFuncSetAttribute(k_gemm<MS, NT, WO, WT, STAGES, MINB, NV, true>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)c.smem(NV)));
    if (!st)
        st = CU(cudaFuncSetAttribute(k_gemm<MS, NT, WO, WT, STAGES, MINB, NV, false>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, (int)c.smem(NV)));
    return st;
}

#define CFG_ARGS(c) c.MS, c.NT, c.WO, c.WT, c.STAGES, c.MINB

moeq_status set_attrs(bool nv) {
    moeq_status st;
    if (nv) {
        st = set_attr_one<CFG_ARGS(CFG_DECODE), true>();
        if (!st) st = set_attr_one<CFG_ARGS(CFG_MID), true>();
        if (!st) st = set_attr_one<CFG_ARGS(CFG_M64), true>();
        if (!st) st = set_attr_one<CFG_ARGS(CFG_PREFILL), true>();
    } else {
        st = set_attr_one<CFG_ARGS(CFG_DECODE), false>();
        if (!st) st = set_attr_one<CFG_ARGS(CFG_MID), false>();
        if (!st) st = set_attr_one<CFG_ARGS(CFG_M64), false>();
        if (!st) st = set_attr_one<CFG_ARGS(CFG_PREFILL), false>();
    }
    return st;
}

template <bool NV>
moeq_status run_gemms_cfg(mq_gpu_moe *m, int cfg, const GemmArgs &gu, const GemmArgs &dn, int64_t gu_strips,
                          int64_t dn_strips, int64_t tiles) {
    moeq_status st;
    switch (cfg) {
        case 0:
            st = launch_gemm<CFG_ARGS(CFG_DECODE), NV, true>(m, gu, gu_strips, tiles);
            if (!st) st = launch_gemm<CFG_ARGS(CFG_DECODE), NV, false>(m, dn, dn_strips, tiles);
            return st;
        case 1:
            st = launch_gemm<CFG_ARGS(CFG_MID), NV, true>(m, gu, gu_strips, tiles);
            if (!st) st = launch_gemm<CFG_ARGS(CFG_MID), NV, false>(m, dn, dn_strips, tiles);
            return st;
        case 2:
            st = launch_gemm<CFG_ARGS(CFG_M64), NV, true>(m, gu, gu_strips, tiles);
            if (!st) st = launch_gemm<CFG_ARGS(CFG_M64), NV, false>(m, dn, dn_strips, tiles);
            return st;
        default:
            st = launch_gemm<CFG_ARGS(CFG_PREFILL), NV, true>(m, gu, gu_strips, tiles);
            if (!st) st = launch_gemm<CFG_ARGS(CFG_PREFILL), NV, false>(m, dn, dn_strips, tiles);
            return st;
    }
}

template <bool NV, int B>
moeq_status run_exact(mq_gpu_moe *m, int64_t T) {
    Ws &w = m->ws;
    const int64_t P = rows_of(m, T), tiles = P / EXACT_BM + std::min<int64_t>(m->n_mats, P) + 1;
    ExactArgs a, b;
    exact_args(m->d_mats, m->n_mats, w.tiles, w.n_tiles, w.perm, w.xq, w.xs, m->D, w.midf, w.midq, w.mids, m->Fmax,
               w.y, &a, &b);
    k_exact<NV, true, B><<<tile_grid((m->Fmax + 63) / 64, tiles), 256, 0, m->s>>>(a);
    moeq_status st = CU_LAUNCHED("k_exact (gate_up)");
    if (st) return st;
    const int64_t nq = P * (m->Fmax / B);
    k_quant_rows<<<(unsigned)std::min<int64_t>((nq + 255) / 256, 65536), 256, 0, m->s>>>(
        w.midf, P, m->Fmax, m->Fmax, B, w.midq, w.mids, m->Fmax);
    if ((st = CU_LAUNCHED("k_quant_rows"))) return st;
    k_exact<NV, false, B><<<tile_grid((m->D + 63) / 64, tiles), 256, 0, m->s>>>(b);
    return CU_LAUNCHED("k_exact (down)");
}

moeq_status run_combine(mq_gpu_moe *m, int64_t T, float *outd) {
    Ws &w = m->ws;
    const int64_t n = T * (m->D / 4);
    k_combine<<<(unsigned)std::min<int64_t>((n + 255) / 256, 65536), 256, 0, m->s>>>(
        w.y, m->D, T, m->k, w.pos, w.wt, m->has_sgate ? w.gsh : nullptr, m->Fs > 0 ? w.off + m->E : nullptr, outd);
    return CU_LAUNCHED("k_combine");
}

/* The op on device pointers, queued on the stream (no waiting). */
moeq_status forward_dev(mq_gpu_moe *m, const float *xd, int64_t T, int math, float *outd) {
    const bool exact = math == MQ_GPU_MOE_FP32;
    const int cfg = pick_cfg(m->force_cfg, T, m->k, m->E);
    moeq_status st = run_routing(m, xd, T, exact, exact ? EXACT_BM : cfg_bm(cfg));
    if (st) return st;
    if (exact) {
        if (m->nv) st = run_exact<true, 16>(m, T);
        else st = run_exact<false, 32>(m, T);
    } else {
        Ws &w = m->ws;
        const int64_t P = rows_of(m, T), bm = cfg_bm(cfg);
        const int64_t tiles = P / bm + std::min<int64_t>(m->n_mats, P) + 1;
        GemmArgs gu, dn;
        gemm_args(m->d_mats, m->n_mats, w.tiles, w.n_tiles, w.perm, w.xb, m->D64, w.mid, m->F64m, w.y, m->D, &gu, &dn);
        const int64_t gu_strips = 2 * (int64_t)std::max(m->F, m->Fs) / 16, dn_strips = m->D / 16;
        st = m->nv ? run_gemms_cfg<true>(m, cfg, gu, dn, gu_strips, dn_strips, tiles)
                   : run_gemms_cfg<false>(m, cfg, gu, dn, gu_strips, dn_strips, tiles);
    }
    if (!st) st = run_combine(m, T, outd);
    if (!st) m->last_T = T;
    return st;
}

moeq_status forward_baseline(mq_gpu_moe *m, const float *xd, int64_t T, float *outd);   /* below */

}  // namespace

/* ---- C interface ------------------------------------------------------------------------------ */
extern "C" void mq_gpu_moe_free(mq_gpu_moe *m) {
    if (!m) return;
    cudaSetDevice(m->g->device);
    cudaStreamSynchronize(m->s);
    ws_free(m->ws);
    mq_cu_free(m->blob);
    mq_cu_free(m->d_mats);
    mq_cu_free(m->router);
    mq_cu_free(m->bias);
    mq_cu_free(m->blas_ws);
    if (m->blas) cublasDestroy(m->blas);
    delete m;
}

extern "C" size_t mq_gpu_moe_bytes(const mq_gpu_moe *m) { return m ? m->resident : 0; }

extern "C" void mq_gpu_moe_force_tiles(mq_gpu_moe *m, int shape) {
    if (m) m->force_cfg = shape >= 0 && shape < 4 ? shape : -1;
}

/* The router's settings of the op's arguments (both uploads). */
static void take_routing(mq_gpu_moe *m, const moeq_moe_ffn_args *r) {
    m->k = r->top_k;
    m->scoring = r->scoring == MOEQ_MOE_SIGMOID;
    m->renorm = r->renormalize;
    m->route_scale = r->route_scale;
    m->n_group = r->n_group > 1 ? r->n_group : 0;
    m->topk_group = r->n_group > 1 ? r->topk_group : 0;
}

extern "C" moeq_status mq_gpu_moe_upload(mq_gpu *g, const moeq_moe_experts_desc *d, const moeq_moe_zero_points *zp,
                                         const moeq_moe_ffn_args *r, mq_gpu_moe **out) {
    if (!out) return mq_err(MOEQ_E_ARG, "%s: out is NULL", k_up);
    *out = NULL;
    if (!g) return mq_err(MOEQ_E_ARG, "%s: GPU context is NULL", k_up);
    moeq_status st = moeq_moe_experts_check(d);
    if (st) return st;
    const int nv = d->scheme == MOEQ_MOE_NVFP4;
    const int64_t E = d->n_experts, D = d->hidden, F = d->ffn, Fs = d->shared_ffn, G = d->group_size;
    if (!r) return mq_err(MOEQ_E_ARG, "moe_ffn_cuda: routing args is NULL");
    if ((st = mq_moe_routing_check("moe_ffn_cuda", r, E, D, (int32_t)Fs))) return st;
    if (zp) {
        if (nv) return mq_err(MOEQ_E_ARG, "%s: zero points are for INT4 (the layer is NVFP4)", k_up);
        if ((st = check_zero_ref(&zp->gate_up, "gate_up", E, 2 * F, D / G)) ||
            (st = check_zero_ref(&zp->down, "down", E, D, F / G)))
            return st;
        if (Fs > 0 && ((st = check_zero_ref(&zp->shared_gate_up, "shared_gate_up", 0, 2 * Fs, D / G)) ||
                       (st = check_zero_ref(&zp->shared_down, "shared_down", 0, D, Fs / G))))
            return st;
    }
    /* values, as the CPU packer checks them */
    if ((st = check_codes((const uint8_t *)d->gate_up.codes.data, E, 2 * F, D, "gate_up")) ||
        (st = check_codes((const uint8_t *)d->down.codes.data, E, D, F, "down")) ||
        (st = check_scales(&d->gate_up.scales, nv, E, 2 * F, D / G, "gate_up", false)) ||
        (st = check_scales(&d->down.scales, nv, E, D, F / G, "down", false)))
        return st;
    if (Fs > 0 && ((st = check_codes((const uint8_t *)d->shared_gate_up.codes.data, 1, 2 * Fs, D, "shared_gate_up")) ||
                   (st = check_codes((const uint8_t *)d->shared_down.codes.data, 1, D, Fs, "shared_down")) ||
                   (st = check_scales(&d->shared_gate_up.scales, nv, 1, 2 * Fs, D / G, "shared_gate_up", true)) ||
                   (st = check_scales(&d->shared_down.scales, nv, 1, D, Fs / G, "shared_down", true))))
        return st;
    const int64_t nm = E + (Fs > 0);
    std::vector<float> ggu((size_t)nm * 2, 1.0f), gdn((size_t)nm, 1.0f);
    if (nv) {
        for (int64_t i = 0; i < nm; i++) {
            const bool sh = i == E;
            const moeq_moe_qweight *gu = sh ? &d->shared_gate_up : &d->gate_up, *dn = sh ? &d->shared_down : &d->down;
            const int64_t e = sh ? -1 : i;
            for (int h = 0; h < 2; h++) ggu[2 * i + h] = ((const float *)gu->global_scale.data)[gs_index(&gu->global_scale, e, h)];
            gdn[i] = ((const float *)dn->global_scale.data)[sh ? 0 : i];
            const char *gn = sh ? "shared_gate_up" : "gate_up", *dnn = sh ? "shared_down" : "down";
            if ((st = check_global(ggu[2 * i], gn, e)) || (st = check_global(ggu[2 * i + 1], gn, e)) ||
                (st = check_global(gdn[i], dnn, e)))
                return st;
        }
    }
    const bool s32 = needs_s32(d, nv, E, D, F, Fs, G);

    mq_gpu_moe *m = new (std::nothrow) mq_gpu_moe();
    if (!m) return mq_err(MOEQ_E_NOMEM, "out of memory");
    m->g = g;
    m->s = g->stream[0];
    m->force_cfg = -1;
    m->nv = nv;
    m->G = (int)G;
    m->B = nv ? 16 : 32;
    m->E = (int)E;
    m->D = (int)D;
    m->F = (int)F;
    m->Fs = (int)Fs;
    m->n_mats = (int)nm;
    m->asym = zp != NULL;
    m->D64 = (int)((D + 63) & ~63);
    m->Fmax = (int)std::max(F, Fs);
    m->F64m = (m->Fmax + 63) & ~63;
    take_routing(m, r);
    m->has_sgate = r->shared_gate.data != NULL;
    m->E1 = (int)E + m->has_sgate;

    st = CU(cudaSetDevice(g->device));
    if (!st) st = CUBLAS(cublasCreate(&m->blas));
    if (!st) st = CUBLAS(cublasSetStream(m->blas, m->s));
    if (!st) st = CUBLAS(cublasSetMathMode(m->blas, CUBLAS_PEDANTIC_MATH));
    if (!st) st = mq_cu_alloc(&m->blas_ws, CUBLAS_WS, "cuBLAS workspace");
    if (!st) st = CUBLAS(cublasSetWorkspace(m->blas, m->blas_ws, CUBLAS_WS));
    if (!st) st = set_attrs(nv);
    /* routing tensors: the router's rows, then the shared gate's */
    if (!st) st = cu_alloc(&m->router, (size_t)(m->E1 * D), "MoE router");
    if (!st) st = CU(cudaMemcpyAsync(m->router, r->router.data, (size_t)(E * D) * 4, cudaMemcpyHostToDevice, m->s));
    if (!st && m->has_sgate)
        st = CU(cudaMemcpyAsync(m->router + E * D, r->shared_gate.data, (size_t)D * 4, cudaMemcpyHostToDevice, m->s));
    if (!st && r->router_bias.data) {
        st = cu_alloc(&m->bias, (size_t)E, "MoE router bias");
        if (!st) st = CU(cudaMemcpyAsync(m->bias, r->router_bias.data, (size_t)E * 4, cudaMemcpyHostToDevice, m->s));
    }
    /* the blob: codes, scales, zero points, exact scales of every matrix */
    std::vector<Geom> geo;
    std::vector<size_t> at;
    size_t parts = 0;
    const size_t total = layer_layout(nv, (int)G, nm, E, D, F, Fs, m->asym, s32, geo, at, &parts);
    m->resident += parts;
    if (!st) st = mq_cu_alloc((void **)&m->blob, total, "MoE experts on the GPU");
    m->blob_bytes = total;
    if (!st) {
        m->h_mats.resize(geo.size());
        for (size_t i = 0; i < geo.size(); i++) {
            MoeMat &M = m->h_mats[i];
            mat_at(M, m->blob, at, geo[i], i, (int)G, m->asym, s32);
            const int64_t e = (int64_t)i % nm;
            const bool gu = (int64_t)i < nm;
            const float gs2[2] = {gu ? ggu[2 * e] : gdn[e], gu ? ggu[2 * e + 1] : gdn[e]};
            set_factors(M, nv, d->nvfp4_global_multiplier, gs2);
        }
        st = cu_alloc(&m->d_mats, geo.size(), "MoE matrix table");
        if (!st)
            st = CU(cudaMemcpyAsync(m->d_mats, m->h_mats.data(), geo.size() * sizeof(MoeMat), cudaMemcpyHostToDevice, m->s));
    }
    /* codes: packed on the device from the canonical bytes */
    if (!st) st = pack_codes(m, (const uint8_t *)d->gate_up.codes.data, (int)E, geo[0], m->blob + at[0]);
    if (!st) st = pack_codes(m, (const uint8_t *)d->down.codes.data, (int)E, geo[nm], m->blob + at[nm * 4]);
    if (!st && Fs > 0) st = pack_codes(m, (const uint8_t *)d->shared_gate_up.codes.data, 1, geo[E], m->blob + at[E * 4]);
    if (!st && Fs > 0)
        st = pack_codes(m, (const uint8_t *)d->shared_down.codes.data, 1, geo[nm + E], m->blob + at[(nm + E) * 4]);
    /* scales: laid out here */
    std::vector<uint8_t> sc, of;
    std::vector<float> sv;
    for (size_t i = 0; i < geo.size() && !st; i++) {
        const Geom &q = geo[i];
        build_scales_of(d, zp, q, i, nm, E, nv, (int)G, sc, of, sv);
        st = CU(cudaMemcpy(m->blob + at[i * 4 + 1], sc.data(), q.scales, cudaMemcpyHostToDevice));
        if (!st && q.offs) st = CU(cudaMemcpy(m->blob + at[i * 4 + 2], of.data(), q.offs, cudaMemcpyHostToDevice));
        if (!st && q.s32) st = CU(cudaMemcpy(m->blob + at[i * 4 + 3], sv.data(), q.s32, cudaMemcpyHostToDevice));
    }
    if (!st) st = CU(cudaStreamSynchronize(m->s));
    if (st) {
        mq_gpu_moe_free(m);
        return st;
    }
    *out = m;
    return MOEQ_OK;
}

/* The op's input and output where the caller's pointers are host memory: x staged into the
 * workspace (xd), the result computed into it (od) and copied back by io_out. */
struct MoeIo {
    const float *xd;
    float *od;
    bool xdev, odev;
};

static moeq_status io_in(mq_gpu_moe *m, const float *x, int64_t T, float *out, MoeIo *io) {
    io->xdev = is_device_ptr(x);
    io->odev = is_device_ptr(out);
    io->xd = io->xdev ? x : m->ws.xd;
    io->od = io->odev ? out : m->ws.outd;
    if (io->xdev) return MOEQ_OK;
    return CU(cudaMemcpyAsync(m->ws.xd, x, (size_t)(T * m->D) * 4, cudaMemcpyHostToDevice, m->s));
}

/* After the forward (its status st): the result to host memory, then the stream synchronized
 * when a host buffer was involved (or always: `sync`). */
static moeq_status io_out(mq_gpu_moe *m, moeq_status st, const MoeIo &io, float *out, int64_t T, bool sync) {
    if (!st && !io.odev) st = CU(cudaMemcpyAsync(out, io.od, (size_t)(T * m->D) * 4, cudaMemcpyDeviceToHost, m->s));
    if (!st && (sync || !io.odev || !io.xdev)) st = CU(cudaStreamSynchronize(m->s));
    return st;
}

extern "C" moeq_status mq_gpu_moe_ffn(mq_gpu_moe *m, const float *x, int64_t T, int math, float *out) {
    if (!m) return mq_err(MOEQ_E_ARG, "moe_ffn_cuda: layer is NULL");
    if (T < 0) return mq_err(MOEQ_E_SHAPE, "moe_ffn_cuda: x: %lld tokens", (long long)T);
    if (math != MQ_GPU_MOE_BF16 && math != MQ_GPU_MOE_FP32)
        return mq_err(MOEQ_E_ARG, "moe_ffn_cuda: math %d (expected bf16 0 or fp32 1)", math);
    if (T == 0) return MOEQ_OK;
    if (!x) return mq_err(MOEQ_E_ARG, "moe_ffn_cuda: x is NULL");
    if (!out) return mq_err(MOEQ_E_ARG, "moe_ffn_cuda: out is NULL");
    moeq_status st = set_dev(m);
    if (!st) st = ensure_ws(m, T);
    if (!st && math == MQ_GPU_MOE_FP32) st = ensure_exact(m, T);
    if (st) return st;
    MoeIo io;
    st = io_in(m, x, T, out, &io);
    if (!st && m->dense && math != MQ_GPU_MOE_BF16)
        st = mq_err(MOEQ_E_UNSUPPORTED, "moe_ffn_cuda: a layer of dense (bf16) experts runs in bf16 only");
    if (!st) st = m->dense ? forward_baseline(m, io.xd, T, io.od) : forward_dev(m, io.xd, T, math, io.od);
    return io_out(m, st, io, out, T, false);
}

extern "C" moeq_status mq_gpu_moe_last_routing(mq_gpu_moe *m, int32_t *sel, float *wt, float *gshared) {
    if (!m || !m->last_T) return mq_err(MOEQ_E_ARG, "moe_ffn_cuda: no call yet");
    const size_t Tk = (size_t)(m->last_T * m->k);
    moeq_status st = set_dev(m);
    if (!st) st = CU(cudaStreamSynchronize(m->s));
    if (!st && sel) st = CU(cudaMemcpy(sel, m->ws.sel, Tk * 4, cudaMemcpyDeviceToHost));
    if (!st && wt) st = CU(cudaMemcpy(wt, m->ws.wt, Tk * 4, cudaMemcpyDeviceToHost));
    if (!st && gshared && m->has_sgate)
        st = CU(cudaMemcpy(gshared, m->ws.gsh, (size_t)m->last_T * 4, cudaMemcpyDeviceToHost));
    return st;
}

namespace {
template <bool NV>
moeq_status dequant_launch(mq_gpu_moe *m, int mat, int count, int64_t F, bool global, float *outf, bf16 *outb,
                           int64_t stride) {
    const MoeMat &M = m->h_mats[mat];
    const int64_t warps = (int64_t)(M.N / 16) * (M.K64 / 64);
    k_dequant<NV><<<dim3((unsigned)((warps + 7) / 8), (unsigned)count), 256, 0, m->s>>>(m->d_mats, mat, F, global, outf,
                                                                                       outb, stride);
    return CU_LAUNCHED("k_dequant");
}
}  // namespace

extern "C" moeq_status mq_gpu_moe_dequant(mq_gpu_moe *m, int64_t expert, int which, float *out) {
    if (!m || expert < 0 || expert >= m->n_mats || (which != 0 && which != 1) || !out)
        return mq_err(MOEQ_E_ARG, "moe_ffn_cuda: dequant: bad expert %lld or matrix %d", (long long)expert, which);
    const int mat = (int)(which ? m->n_mats + expert : expert);
    const MoeMat &M = m->h_mats[mat];
    const size_t n = (size_t)M.N * (size_t)M.K;
    float *d = NULL;
    moeq_status st = set_dev(m);
    if (!st) st = cu_alloc(&d, n, "dequantized matrix");
    const int64_t F = which ? 0 : M.N / 2;
    if (!st) st = m->nv ? dequant_launch<true>(m, mat, 1, F, false, d, nullptr, 0)
                        : dequant_launch<false>(m, mat, 1, F, false, d, nullptr, 0);
    if (!st) st = CU(cudaMemcpyAsync(out, d, n * 4, cudaMemcpyDeviceToHost, m->s));
    if (!st) st = CU(cudaStreamSynchronize(m->s));
    mq_cu_free(d);
    return st;
}

/* ---- the baseline: dequantize to bf16, then cuBLAS ------------------------------------------- */
namespace {
__global__ void k_gather_bf16(const bf16 *src, int64_t ld_src, const int32_t *perm, int64_t P, int64_t D, bf16 *dst) {
    const int64_t D8 = D / 8;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < P * D8; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t p = i / D8, c = i % D8;
        *(uint4 *)(dst + p * D + c * 8) = *(const uint4 *)(src + (int64_t)perm[p] * ld_src + c * 8);
    }
}
/* mid[p] = bf16(silu(h[p, :F]) * h[p, F:2F]), F of row p's matrix (shared rows from off_shared). */
__global__ void k_swiglu_rows(const float *h, int64_t ldh, int64_t P, int F, int Fs, const int32_t *off_shared,
                              bf16 *mid, int64_t ldm) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < P * ldm; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t p = i / ldm, f = i % ldm;
        const int Fp = off_shared && p >= *off_shared ? Fs : F;
        if (f >= Fp) continue;
        mid[p * ldm + f] = __float2bfloat16_rn(silu_mul(h[p * ldh + f], h[p * ldh + Fp + f]));
    }
}

moeq_status ensure_baseline(mq_gpu_moe *m, int64_t T) {
    Ws &w = m->ws;
    const int64_t P = rows_of(m, T);
    moeq_status st = MOEQ_OK;
    if (!w.wgu) {
        size_t ngu = 0, ndn = 0;
        for (int i = 0; i < m->n_mats; i++) {
            ngu += (size_t)m->h_mats[i].N * m->h_mats[i].K;
            ndn += (size_t)m->h_mats[m->n_mats + i].N * m->h_mats[m->n_mats + i].K;
        }
        st = cu_alloc(&w.wgu, ngu, "bf16 experts (baseline)");
        if (!st) st = cu_alloc(&w.wdn, ndn, "bf16 experts (baseline)");
        if (!st) st = cu_alloc(&w.ptrs, (size_t)6 * m->n_mats, "baseline pointers");
    }
    if (!st && P > w.bP) {
        st = ws_grow(&w.xsort, (size_t)(P * m->D), "baseline rows");
        if (!st) st = ws_grow(&w.hbuf, (size_t)(P * 2 * m->Fmax), "baseline rows");
        w.bP = st ? 0 : P;
    }
    return st;
}

/* Grouped C_i = A_i^T B_i (column-major: C [n_out, m_i] = W_i [K, n_out]^T X_i [K, m_i]). */
moeq_status grouped_gemm(mq_gpu_moe *m, int n, const int *mo, const int *mi, const int *kk, const void *const *A,
                         const void *const *B, void *const *C, const int *ldc, cudaDataType_t ct, void **dptrs) {
    if (n == 0) return MOEQ_OK;
    std::vector<const void *> hp((size_t)3 * n);
    for (int i = 0; i < n; i++) {
        hp[i] = A[i];
        hp[n + i] = B[i];
        hp[2 * n + i] = C[i];
    }
    moeq_status st = CU(cudaMemcpyAsync(dptrs, hp.data(), hp.size() * sizeof(void *), cudaMemcpyHostToDevice, m->s));
    if (st) return st;
    std::vector<cublasOperation_t> ta((size_t)n, CUBLAS_OP_T), tb((size_t)n, CUBLAS_OP_N);
    std::vector<float> one((size_t)n, 1.0f), zero((size_t)n, 0.0f);
    std::vector<int> gsz((size_t)n, 1);
    cublasStatus_t bs = cublasGemmGroupedBatchedEx(
        m->blas, ta.data(), tb.data(), mo, mi, kk, one.data(), (const void *const *)dptrs, CUDA_R_16BF, kk,
        (const void *const *)(dptrs + n), CUDA_R_16BF, kk, zero.data(), (void *const *)(dptrs + 2 * n), ct, ldc, n,
        gsz.data(), CUBLAS_COMPUTE_32F);
    if (bs == CUBLAS_STATUS_SUCCESS) return MOEQ_OK;
    for (int i = 0; i < n && !st; i++)   /* one GEMM each where the grouped call is not offered */
        st = CUBLAS(cublasGemmEx(m->blas, CUBLAS_OP_T, CUBLAS_OP_N, mo[i], mi[i], kk[i], &one[0], A[i], CUDA_R_16BF,
                                 kk[i], B[i], CUDA_R_16BF, kk[i], &zero[0], C[i], ct, ldc[i], CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
    return st;
}

moeq_status forward_baseline(mq_gpu_moe *m, const float *xd, int64_t T, float *outd) {
    Ws &w = m->ws;
    moeq_status st = ensure_baseline(m, T);
    if (!st) st = run_routing(m, xd, T, false, 128);
    if (st) return st;
    const int nm = m->n_mats;
    std::vector<int32_t> off((size_t)nm + 1);
    st = CU(cudaMemcpyAsync(off.data(), w.off, off.size() * 4, cudaMemcpyDeviceToHost, m->s));
    if (!st) st = CU(cudaStreamSynchronize(m->s));
    /* every matrix to bf16 (the routed ones in one launch each; a dense layer holds them so) */
    const size_t gu_el = (size_t)2 * m->F * m->D, dn_el = (size_t)m->D * m->F;
    if (!st && !m->dense) st = m->nv ? dequant_launch<true>(m, 0, m->E, m->F, true, nullptr, w.wgu, (int64_t)gu_el)
                        : dequant_launch<false>(m, 0, m->E, m->F, true, nullptr, w.wgu, (int64_t)gu_el);
    if (!st && !m->dense) st = m->nv ? dequant_launch<true>(m, nm, m->E, 0, true, nullptr, w.wdn, (int64_t)dn_el)
                        : dequant_launch<false>(m, nm, m->E, 0, true, nullptr, w.wdn, (int64_t)dn_el);
    if (!st && !m->dense && m->Fs > 0)
        st = m->nv ? dequant_launch<true>(m, m->E, 1, m->Fs, true, nullptr, w.wgu + gu_el * m->E, 0)
                   : dequant_launch<false>(m, m->E, 1, m->Fs, true, nullptr, w.wgu + gu_el * m->E, 0);
    if (!st && !m->dense && m->Fs > 0)
        st = m->nv ? dequant_launch<true>(m, nm + m->E, 1, 0, true, nullptr, w.wdn + dn_el * m->E, 0)
                   : dequant_launch<false>(m, nm + m->E, 1, 0, true, nullptr, w.wdn + dn_el * m->E, 0);
    const int64_t P = rows_of(m, T);
    if (!st) {
        k_gather_bf16<<<(unsigned)std::min<int64_t>((P * m->D / 8 + 255) / 256, 65536), 256, 0, m->s>>>(
            w.xb, m->D64, w.perm, P, m->D, w.xsort);
        st = CU_LAUNCHED("k_gather_bf16");
    }
    std::vector<int> mo, mi, kk, ldc;
    std::vector<const void *> A, B;
    std::vector<void *> C;
    for (int pass = 0; pass < 2 && !st; pass++) {
        mo.clear(), mi.clear(), kk.clear(), ldc.clear(), A.clear(), B.clear(), C.clear();
        for (int e = 0; e < nm; e++) {
            const int rows = off[e + 1] - off[e];
            if (!rows) continue;
            const int f = e == m->E ? m->Fs : m->F;
            if (pass == 0) {
                mo.push_back(2 * f);
                kk.push_back(m->D);
                A.push_back(w.wgu + gu_el * e);
                B.push_back(w.xsort + (size_t)off[e] * m->D);
                C.push_back(w.hbuf + (size_t)off[e] * 2 * m->Fmax);
                ldc.push_back(2 * m->Fmax);
            } else {
                mo.push_back(m->D);
                kk.push_back(f);
                A.push_back(w.wdn + dn_el * e);
                B.push_back(w.mid + (size_t)off[e] * m->Fmax);
                C.push_back(w.y + (size_t)off[e] * m->D);
                ldc.push_back(m->D);
            }
            mi.push_back(rows);
        }
        if (pass == 1) {   /* down reads its rows with the stride of its own K */
            for (size_t i = 0; i < B.size(); i++) (void)i;
        }
        st = grouped_gemm(m, (int)mo.size(), mo.data(), mi.data(), kk.data(), A.data(), B.data(), C.data(),
                          ldc.data(), CUDA_R_32F, w.ptrs + (size_t)pass * 3 * nm);
        if (!st && pass == 0) {
            /* mid packed with row stride F (routed) for cuBLAS: rows of one matrix are contiguous */
            const int64_t n = P * m->Fmax;
            k_swiglu_rows<<<(unsigned)std::min<int64_t>((n + 255) / 256, 65536), 256, 0, m->s>>>(
                w.hbuf, 2 * m->Fmax, P, m->F, m->Fs, m->Fs > 0 ? w.off + m->E : nullptr, w.mid, m->Fmax);
            st = CU_LAUNCHED("k_swiglu_rows");
        }
    }
    if (!st) st = run_combine(m, T, outd);
    return st;
}
}  // namespace

extern "C" moeq_status mq_gpu_moe_ffn_baseline(mq_gpu_moe *m, const float *x, int64_t T, float *out) {
    if (!m || T < 0 || (T > 0 && (!x || !out))) return mq_err(MOEQ_E_ARG, "moe_ffn_cuda baseline: bad arguments");
    if (T == 0) return MOEQ_OK;
    if (m->Fs > 0 && m->Fs != m->F)
        return mq_err(MOEQ_E_UNSUPPORTED, "moe_ffn_cuda baseline: shared_ffn %d != ffn %d", m->Fs, m->F);
    moeq_status st = set_dev(m);
    if (!st) st = ensure_ws(m, T);
    if (st) return st;
    MoeIo io;
    st = io_in(m, x, T, out, &io);
    if (!st) st = forward_baseline(m, io.xd, T, io.od);
    return io_out(m, st, io, out, T, true);
}

/* ---- timing (bench) --------------------------------------------------------------------------- */
extern "C" moeq_status mq_gpu_moe_time(mq_gpu_moe *const *layers, int n_layers, mq_gpu_buf *x, int n_x, int64_t T,
                                       mq_gpu_buf *out, int mode, int calls, int rounds, double *ms) {
    *ms = 0;
    if (!layers || n_layers < 1 || !x || n_x < 1 || T < 1 || !out || calls < 1 || rounds < 1)
        return mq_err(MOEQ_E_ARG, "moe_ffn_cuda time: bad arguments");
    mq_gpu_moe *m0 = layers[0];
    const int64_t D = m0->D;
    int64_t nx = 0, no = 0;
    float *xd = mq_gpu_buf_device(x, &nx), *od = mq_gpu_buf_device(out, &no);
    if (nx < (int64_t)n_x * T * D || no < T * D) return mq_err(MOEQ_E_ARG, "moe_ffn_cuda time: buffers too small");
    moeq_status st = set_dev(m0);
    for (int i = 0; i < n_layers && !st; i++) {
        st = ensure_ws(layers[i], T);
        if (!st && mode == MQ_GPU_MOE_FP32) st = ensure_exact(layers[i], T);
    }
    const bool base = mode == 2;
    /* warm-up: every layer and input once */
    for (int i = 0; i < std::max(n_layers, n_x) && !st; i++) {
        mq_gpu_moe *m = layers[i % n_layers];
        const float *xi = xd + (int64_t)(i % n_x) * T * D;
        st = base ? forward_baseline(m, xi, T, od) : forward_dev(m, xi, T, mode, od);
    }
    if (!st) st = CU(cudaStreamSynchronize(m0->s));
    cudaEvent_t e0 = NULL, e1 = NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    if (!st) st = CU(cudaEventCreate(&e0));
    if (!st) st = CU(cudaEventCreate(&e1));
    std::vector<double> t;
    if (!st && !base) {
        st = CU(cudaStreamBeginCapture(m0->s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < calls && !st; i++)
            st = forward_dev(layers[i % n_layers], xd + (int64_t)(i % n_x) * T * D, T, mode, od);
        cudaGraph_t gcap = NULL;
        const moeq_status st2 = CU(cudaStreamEndCapture(m0->s, &gcap));
        graph = gcap;
        if (!st) st = st2;
        if (!st) st = CU(cudaGraphInstantiate(&exec, graph, 0));
        if (!st) st = CU(cudaGraphLaunch(exec, m0->s));
        for (int r = 0; r < rounds && !st; r++) {
            float f = 0;
            st = CU(cudaEventRecord(e0, m0->s));
            if (!st) st = CU(cudaGraphLaunch(exec, m0->s));
            if (!st) st = CU(cudaEventRecord(e1, m0->s));
            if (!st) st = CU(cudaEventSynchronize(e1));
            if (!st) st = CU(cudaEventElapsedTime(&f, e0, e1));
            t.push_back((double)f / calls);
        }
    }
    for (int r = 0; r < rounds && !st && base; r++) {
        float f = 0;
        st = CU(cudaEventRecord(e0, m0->s));
        for (int i = 0; i < calls && !st; i++)
            st = forward_baseline(layers[i % n_layers], xd + (int64_t)(i % n_x) * T * D, T, od);
        if (!st) st = CU(cudaEventRecord(e1, m0->s));
        if (!st) st = CU(cudaEventSynchronize(e1));
        if (!st) st = CU(cudaEventElapsedTime(&f, e0, e1));
        t.push_back((double)f / calls);
    }
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (!st && !t.empty()) {
        std::sort(t.begin(), t.end());
        *ms = t[t.size() / 2];
    }
    return st;
}

namespace {
__global__ void k_fill_bf16(bf16 *p, int64_t n, uint32_t seed) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        p[i] = __float2bfloat16_rn(((float)(h & 0xffff) - 32768.0f) * (1.0f / 32768.0f));
    }
}
}  // namespace

extern "C" moeq_status mq_gpu_gemm_bf16_time(mq_gpu *g, int n, const int64_t *M, const int64_t *N, const int64_t *K,
                                             double *ms) {
    *ms = 0;
    size_t na = 0, nb = 0, nc = 0;
    for (int i = 0; i < n; i++) {
        na = std::max(na, (size_t)(M[i] * K[i]));
        nb = std::max(nb, (size_t)(N[i] * K[i]));
        nc = std::max(nc, (size_t)(M[i] * N[i]));
    }
    bf16 *a = NULL, *b = NULL, *c = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    cudaStream_t s = g->stream[0];
    cublasHandle_t h = g->blas[0];
    moeq_status st = CU(cudaSetDevice(g->device));
    if (!st) st = cu_alloc(&a, na, "bf16 GEMM benchmark");
    if (!st) st = cu_alloc(&b, nb, "bf16 GEMM benchmark");
    if (!st) st = cu_alloc(&c, nc, "bf16 GEMM benchmark");
    if (!st) {
        k_fill_bf16<<<4096, 256, 0, s>>>(a, (int64_t)na, 0x1234u);
        k_fill_bf16<<<4096, 256, 0, s>>>(b, (int64_t)nb, 0x9876u);
        st = CU_LAUNCHED("k_fill_bf16");
    }
    if (!st) st = CU(cudaEventCreate(&e0));
    if (!st) st = CU(cudaEventCreate(&e1));
    const float one = 1.0f, zero = 0.0f;
    std::vector<double> t;
    for (int r = -2; r < 7 && !st; r++) {
        st = CU(cudaEventRecord(e0, s));
        for (int i = 0; i < n && !st; i++)   /* C [M, N] = A [M, K] B [N, K]^T, row-major */
            st = CUBLAS(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)N[i], (int)M[i], (int)K[i], &one, b, CUDA_R_16BF,
                                     (int)K[i], a, CUDA_R_16BF, (int)K[i], &zero, c, CUDA_R_16BF, (int)N[i],
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        if (!st) st = CU(cudaEventRecord(e1, s));
        if (!st) st = CU(cudaEventSynchronize(e1));
        float f = 0;
        if (!st) st = CU(cudaEventElapsedTime(&f, e0, e1));
        if (r >= 0) t.push_back(f);
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    mq_cu_free(a);
    mq_cu_free(b);
    mq_cu_free(c);
    if (!st) {
        std::sort(t.begin(), t.end());
        *ms = t[t.size() / 2];
    }
    return st;
}

/* ---- dense experts: bf16 weights and cuBLAS (an unquantized model's fast evaluation) ----------- */
namespace {
__global__ void k_to_bf16(const float *in, bf16 *out, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(in[i]);
}

/* rows x cols fp32 (host) into dst bf16 (device), through the staging buffer stage [n_stage]. */
moeq_status upload_bf16(mq_gpu_moe *m, const float *src, int64_t n, float *stage, int64_t n_stage, bf16 *dst) {
    moeq_status st = MOEQ_OK;
    for (int64_t i = 0; i < n && !st; i += n_stage) {
        const int64_t k = std::min(n_stage, n - i);
        st = CU(cudaMemcpyAsync(stage, src + i, (size_t)k * 4, cudaMemcpyHostToDevice, m->s));
        if (st) break;
        k_to_bf16<<<(unsigned)std::min<int64_t>((k + 255) / 256, 65536), 256, 0, m->s>>>(stage, dst + i, k);
        st = CU_LAUNCHED("k_to_bf16");
        if (!st) st = CU(cudaStreamSynchronize(m->s));   /* the staging buffer is reused */
    }
    return st;
}
}  // namespace

extern "C" moeq_status mq_gpu_moe_upload_dense(mq_gpu *g, int64_t E, int64_t D, int64_t F, int bf16_src,
                                               const void *const *gate, const void *const *up,
                                               const void *const *down, const moeq_moe_ffn_args *r,
                                               mq_gpu_moe **out) {
    if (!out) return mq_err(MOEQ_E_ARG, "%s: out is NULL", k_up);
    *out = NULL;
    if (!g || !gate || !up || !down || !r) return mq_err(MOEQ_E_ARG, "%s: NULL argument", k_up);
    if (E < 1 || E > INT32_MAX || D < 8 || D % 8 || D > INT32_MAX || F < 1 || F > INT32_MAX / 2)
        return mq_err(MOEQ_E_SHAPE, "%s: %lld experts of hidden %lld, ffn %lld (hidden a multiple of 8)", k_up,
                      (long long)E, (long long)D, (long long)F);
    for (int64_t e = 0; e < E; e++)
        if (!gate[e] || !up[e] || !down[e]) return mq_err(MOEQ_E_ARG, "%s: expert %lld: NULL weight", k_up, (long long)e);
    moeq_status st = mq_moe_routing_check("moe_ffn_cuda", r, E, D, 0);
    if (st) return st;
    mq_gpu_moe *m = new (std::nothrow) mq_gpu_moe();
    if (!m) return mq_err(MOEQ_E_NOMEM, "out of memory");
    m->g = g;
    m->s = g->stream[0];
    m->force_cfg = -1;
    m->dense = true;
    m->nv = 0;
    m->G = m->B = 32;
    m->E = (int)E;
    m->D = (int)D;
    m->F = (int)F;
    m->Fs = 0;
    m->n_mats = (int)E;
    m->D64 = (int)((D + 63) & ~63);
    m->Fmax = (int)F;
    m->F64m = (m->Fmax + 63) & ~63;
    take_routing(m, r);
    m->has_sgate = 0;
    m->E1 = (int)E;
    m->h_mats.resize((size_t)(2 * E));
    for (int64_t e = 0; e < E; e++) {
        memset(&m->h_mats[e], 0, sizeof(MoeMat));
        memset(&m->h_mats[E + e], 0, sizeof(MoeMat));
        m->h_mats[e].N = (int)(2 * F);
        m->h_mats[e].K = (int)D;
        m->h_mats[E + e].N = (int)D;
        m->h_mats[E + e].K = (int)F;
    }
    st = CU(cudaSetDevice(g->device));
    if (!st) st = CUBLAS(cublasCreate(&m->blas));
    if (!st) st = CUBLAS(cublasSetStream(m->blas, m->s));
    if (!st) st = mq_cu_alloc(&m->blas_ws, CUBLAS_WS, "cuBLAS workspace");
    if (!st) st = CUBLAS(cublasSetWorkspace(m->blas, m->blas_ws, CUBLAS_WS));
    if (!st) st = set_attrs(false);
    if (!st) st = cu_alloc(&m->router, (size_t)(E * D), "MoE router");
    if (!st) st = CU(cudaMemcpyAsync(m->router, r->router.data, (size_t)(E * D) * 4, cudaMemcpyHostToDevice, m->s));
    if (!st && r->router_bias.data) {
        st = cu_alloc(&m->bias, (size_t)E, "MoE router bias");
        if (!st) st = CU(cudaMemcpyAsync(m->bias, r->router_bias.data, (size_t)E * 4, cudaMemcpyHostToDevice, m->s));
    }
    Ws &w = m->ws;
    const int64_t FD = F * D;
    if (!st) st = cu_alloc(&w.wgu, (size_t)(E * 2 * FD), "bf16 experts");
    if (!st) st = cu_alloc(&w.wdn, (size_t)(E * FD), "bf16 experts");
    if (!st) st = cu_alloc(&w.ptrs, (size_t)6 * E, "grouped GEMM pointers");
    float *stage = nullptr;
    if (!st && !bf16_src) st = cu_alloc(&stage, (size_t)FD, "expert staging");
    for (int64_t e = 0; e < E && !st; e++) {
        const void *src[3] = {gate[e], up[e], down[e]};
        bf16 *dst[3] = {w.wgu + e * 2 * FD, w.wgu + e * 2 * FD + FD, w.wdn + e * FD};
        for (int i = 0; i < 3 && !st; i++)   /* bf16 as stored, or fp32 rounded on the device */
            st = bf16_src ? CU(cudaMemcpyAsync(dst[i], src[i], (size_t)FD * sizeof(bf16), cudaMemcpyHostToDevice, m->s))
                          : upload_bf16(m, (const float *)src[i], FD, stage, FD, dst[i]);
    }
    if (!st) st = CU(cudaStreamSynchronize(m->s));
    mq_cu_free(stage);
    m->resident = (size_t)(E * 3 * FD) * sizeof(bf16);
    if (st) {
        mq_gpu_moe_free(m);
        return st;
    }
    *out = m;
    return MOEQ_OK;
}

extern "C" moeq_status mq_gpu_moe_ffn_buf(mq_gpu_moe *m, mq_gpu_buf *x, int64_t T, int math, mq_gpu_buf *out) {
    if (!m || !x || !out) return mq_err(MOEQ_E_ARG, "moe_ffn_cuda: NULL argument");
    int64_t nx = 0, no = 0;
    float *xd = mq_gpu_buf_device(x, &nx), *od = mq_gpu_buf_device(out, &no);
    if (T < 0 || T * m->D > nx || T * m->D > no)
        return mq_err(MOEQ_E_SHAPE, "moe_ffn_cuda: %lld rows of %d do not fit the buffers (%lld, %lld values)",
                      (long long)T, m->D, (long long)nx, (long long)no);
    if (T == 0) return MOEQ_OK;
    if (math != MQ_GPU_MOE_BF16 && math != MQ_GPU_MOE_FP32)
        return mq_err(MOEQ_E_ARG, "moe_ffn_cuda: math %d (expected bf16 0 or fp32 1)", math);
    if (m->dense && math != MQ_GPU_MOE_BF16)
        return mq_err(MOEQ_E_UNSUPPORTED, "moe_ffn_cuda: a layer of dense (bf16) experts runs in bf16 only");
    moeq_status st = set_dev(m);
    if (!st) st = ensure_ws(m, T);
    if (!st && math == MQ_GPU_MOE_FP32) st = ensure_exact(m, T);
    if (!st) st = m->dense ? forward_baseline(m, xd, T, od) : forward_dev(m, xd, T, math, od);
    return st;
}
