/*
 * The MoE op's kernels (moe_kernels.cuh) under the SIMT emulator (simt_emu.cuh), for the tests
 * of machines without a GPU. The driver (mq_gpu_moe_emulate) mirrors moe.cu's upload and call on
 * host memory: the same layout builders, tile plans and launch shapes.
 */
extern "C" {
#include "backend/gpu.h"
#include "kernels/moe_ffn.h"
}

#include "backend/cuda/simt_emu.cuh"

/* the kernels in namespaces of their own here: the same names as moe.cu's would be one symbol
 * (inline functions), and the linker would keep one of the two */
#define mqm mqm_emulated
#define mqd mqd_emulated
#include "backend/cuda/moe_host.cuh"
#include "backend/cuda/moe_kernels.cuh"

using namespace mqm;

namespace {

template <typename T> T *halloc(std::vector<std::vector<uint8_t>> &keep, size_t n) {
    keep.emplace_back(n * sizeof(T) + 256, 0);
    uintptr_t p = (uintptr_t)keep.back().data();
    return (T *)((p + 255) & ~(uintptr_t)255);
}

struct EmuLayer {
    std::vector<std::vector<uint8_t>> keep;
    int nv, G, B, E, D, F, Fs, nm, k, E1, Fmax, F64m, D64;
    std::vector<MoeMat> mats;
    float *router, *bias;
};

moeq_status emu_build(const moeq_moe_experts_desc *d, const moeq_moe_zero_points *zp, const moeq_moe_ffn_args *r,
                      EmuLayer &L) {
    moeq_status st = moeq_moe_experts_check(d);
    if (!st) st = mq_moe_routing_check("moe_ffn_emulated", r, d->n_experts, d->hidden, d->shared_ffn);
    if (st) return st;
    const int nv = d->scheme == MOEQ_MOE_NVFP4;
    const int64_t E = d->n_experts, D = d->hidden, F = d->ffn, Fs = d->shared_ffn, G = d->group_size;
    L.nv = nv;
    L.G = (int)G;
    L.B = nv ? 16 : 32;
    L.E = (int)E;
    L.D = (int)D;
    L.F = (int)F;
    L.Fs = (int)Fs;
    L.nm = (int)(E + (Fs > 0));
    L.k = r->top_k;
    L.Fmax = (int)std::max(F, Fs);
    L.F64m = (L.Fmax + 63) & ~63;
    L.D64 = (int)((D + 63) & ~63);
    const int64_t nm = L.nm;
    const bool s32 = needs_s32(d, nv, E, D, F, Fs, G);
    std::vector<Geom> geo;
    std::vector<size_t> at;
    size_t parts = 0;
    const size_t total = layer_layout(nv, (int)G, nm, E, D, F, Fs, zp != NULL, s32, geo, at, &parts);
    uint8_t *blob = halloc<uint8_t>(L.keep, total);
    L.mats.resize(geo.size());
    for (size_t i = 0; i < geo.size(); i++) {
        MoeMat &M = L.mats[i];
        mat_at(M, blob, at, geo[i], i, (int)G, zp != NULL, s32);
        const int64_t e = (int64_t)i % nm;
        const bool gu = (int64_t)i < nm;
        float gs2[2] = {1.0f, 1.0f};
        if (nv) {
            const bool sh = e == E;
            const moeq_moe_qweight *w = gu ? (sh ? &d->shared_gate_up : &d->gate_up) : (sh ? &d->shared_down : &d->down);
            for (int h = 0; h < 2; h++)
                gs2[h] = ((const float *)w->global_scale.data)[gu ? gs_index(&w->global_scale, sh ? -1 : e, h) : (sh ? 0 : e)];
        }
        set_factors(M, nv, d->nvfp4_global_multiplier, gs2);
    }
    /* codes: the packing kernel, emulated */
    struct PackJob {
        const uint8_t *src;
        int n_ex;
        size_t gi;
    } jobs[4] = {{(const uint8_t *)d->gate_up.codes.data, (int)E, 0},
                 {(const uint8_t *)d->down.codes.data, (int)E, (size_t)nm},
                 {(const uint8_t *)d->shared_gate_up.codes.data, 1, (size_t)E},
                 {(const uint8_t *)d->shared_down.codes.data, 1, (size_t)(nm + E)}};
    for (int j = 0; j < (Fs > 0 ? 4 : 2); j++) {
        const Geom &q = geo[jobs[j].gi];
        uint32_t *dst = (uint32_t *)(blob + at[jobs[j].gi * 4]);
        const uint8_t *src = jobs[j].src;
        const int n_ex = jobs[j].n_ex;
        mqm_emu::launch(dim3(2, 1, 1), dim3(256, 1, 1), 0,
                        [&] { k_pack_codes(src, n_ex, q.N, q.K, q.K64, q.fused_F, nv, dst); });
    }
    std::vector<uint8_t> sc, of;
    std::vector<float> sv;
    for (size_t i = 0; i < geo.size(); i++) {
        const Geom &q = geo[i];
        build_scales_of(d, zp, q, i, nm, E, nv, (int)G, sc, of, sv);
        memcpy(blob + at[i * 4 + 1], sc.data(), q.scales);
        if (q.offs) memcpy(blob + at[i * 4 + 2], of.data(), q.offs);
        if (q.s32) memcpy(blob + at[i * 4 + 3], sv.data(), q.s32);
    }
    L.E1 = (int)E + (r->shared_gate.data != NULL);
    L.router = halloc<float>(L.keep, (size_t)(L.E1 * D));
    memcpy(L.router, r->router.data, (size_t)(E * D) * 4);
    if (r->shared_gate.data) memcpy(L.router + E * D, r->shared_gate.data, (size_t)D * 4);
    L.bias = NULL;
    if (r->router_bias.data) {
        L.bias = halloc<float>(L.keep, (size_t)E);
        memcpy(L.bias, r->router_bias.data, (size_t)E * 4);
    }
    return MOEQ_OK;
}

template <int MS, int NT, int WO, int WT, int STAGES, int MINB, bool NV>
void emu_gemms(const GemmArgs &gu, const GemmArgs &dn, int64_t gu_strips, int64_t dn_strips, int64_t tiles) {
    constexpr Cfg c = {MS, NT, WO, WT, STAGES, MINB};
    mqm_emu::launch(tile_grid((gu_strips + c.S() - 1) / c.S(), tiles), dim3(c.threads(), 1, 1), c.smem(NV),
                    [&] { k_gemm<MS, NT, WO, WT, STAGES, MINB, NV, true>(gu); });
    mqm_emu::launch(tile_grid((dn_strips + c.S() - 1) / c.S(), tiles), dim3(c.threads(), 1, 1), c.smem(NV),
                    [&] { k_gemm<MS, NT, WO, WT, STAGES, MINB, NV, false>(dn); });
}

#define EMU_CFG(c) c.MS, c.NT, c.WO, c.WT, c.STAGES, c.MINB

template <bool NV>
void emu_gemms_cfg(int cfg, const GemmArgs &gu, const GemmArgs &dn, int64_t gs, int64_t ds, int64_t tiles) {
    switch (cfg) {
        case 0: emu_gemms<EMU_CFG(CFG_DECODE), NV>(gu, dn, gs, ds, tiles); break;
        case 1: emu_gemms<EMU_CFG(CFG_MID), NV>(gu, dn, gs, ds, tiles); break;
        case 2: emu_gemms<EMU_CFG(CFG_M64), NV>(gu, dn, gs, ds, tiles); break;
        default: emu_gemms<EMU_CFG(CFG_PREFILL), NV>(gu, dn, gs, ds, tiles); break;
    }
}

template <bool NV, int B>
void emu_exact(const EmuLayer &L, const MoeMat *mats, const Tile *tiles_p, const int32_t *n_tiles, const int16_t *xq,
               const float *xs, const int32_t *perm, float *midf, int16_t *midq, float *mids, float *y, int64_t P,
               int64_t tiles) {
    ExactArgs a, b;
    exact_args(mats, L.nm, tiles_p, n_tiles, perm, xq, xs, L.D, midf, midq, mids, L.Fmax, y, &a, &b);
    mqm_emu::launch(tile_grid((L.Fmax + 63) / 64, tiles), dim3(256, 1, 1), 0, [&] { k_exact<NV, true, B>(a); });
    mqm_emu::launch(dim3(2, 1, 1), dim3(256, 1, 1), 0,
                    [&] { k_quant_rows(midf, P, L.Fmax, L.Fmax, B, midq, mids, L.Fmax); });
    mqm_emu::launch(tile_grid((L.D + 63) / 64, tiles), dim3(256, 1, 1), 0, [&] { k_exact<NV, false, B>(b); });
}

}  // namespace

extern "C" moeq_status mq_gpu_moe_emulate(const moeq_moe_experts_desc *d, const moeq_moe_zero_points *zp,
                                          const moeq_moe_ffn_args *r, const float *x, int64_t T, int math, int tiles,
                                          float *out, int32_t *sel_out, float *wt_out, float *gsh_out) {
    EmuLayer L;
    moeq_status st = emu_build(d, zp, r, L);
    if (st || T <= 0) return st;
    const bool exact = math == MQ_GPU_MOE_FP32;
    const int64_t P = T * L.k + (L.Fs > 0 ? T : 0), Tk = T * L.k;
    std::vector<std::vector<uint8_t>> &K = L.keep;
    float *xd = halloc<float>(K, (size_t)(T * L.D)), *logits = halloc<float>(K, (size_t)(T * L.E1));
    memcpy(xd, x, (size_t)(T * L.D) * 4);
    int32_t *sel = halloc<int32_t>(K, (size_t)Tk), *pos = halloc<int32_t>(K, (size_t)Tk);
    float *wt = halloc<float>(K, (size_t)Tk), *gsh = halloc<float>(K, (size_t)T);
    int32_t *off = halloc<int32_t>(K, (size_t)L.nm + 1), *perm = halloc<int32_t>(K, (size_t)P);
    int32_t *n_tiles = halloc<int32_t>(K, 1);
    unsigned *ticket = halloc<unsigned>(K, 1);
    *ticket = 0;
    const int64_t max_tiles = P / 8 + std::min<int64_t>(L.nm, P) + 1;
    Tile *tl = halloc<Tile>(K, (size_t)max_tiles);
    bf16 *xb = halloc<bf16>(K, (size_t)(T * L.D64)), *mid = halloc<bf16>(K, (size_t)(P * L.F64m));
    memset((void *)mid, 0, (size_t)(P * L.F64m) * sizeof(bf16));
    int16_t *xq = halloc<int16_t>(K, (size_t)(T * L.D)), *midq = halloc<int16_t>(K, (size_t)(P * L.Fmax));
    float *xs = halloc<float>(K, (size_t)(T * (L.D / L.B))), *midf = halloc<float>(K, (size_t)(P * L.Fmax));
    float *mids = halloc<float>(K, (size_t)(P * (L.Fmax / L.B))), *y = halloc<float>(K, (size_t)(P * L.D));
    float *o = halloc<float>(K, (size_t)(T * L.D));
    const int cfg = pick_cfg(tiles, T, L.k, L.E);
    const int bm = exact ? EXACT_BM : cfg_bm(cfg);
    RouteArgs a;
    memset(&a, 0, sizeof a);
    a.x = xd;
    a.T = T;
    a.D = L.D;
    a.D64 = L.D64;
    a.E = L.E;
    a.E1 = L.E1;
    a.k = L.k;
    a.n_mats = L.nm;
    a.router = L.router;
    a.bias = L.bias;
    a.logits = logits;
    a.sel = sel;
    a.wt = wt;
    a.gsh = gsh;
    a.scoring = r->scoring == MOEQ_MOE_SIGMOID;
    a.renorm = r->renormalize;
    a.n_group = r->n_group > 1 ? r->n_group : 0;
    a.topk_group = r->n_group > 1 ? r->topk_group : 0;
    a.has_sgate = r->shared_gate.data != NULL;
    a.has_shared = L.Fs > 0;
    a.route_scale = r->route_scale;
    a.exact = exact;
    a.B = L.B;
    a.xb = xb;
    a.xq = xq;
    a.xs = xs;
    a.bm = bm;
    a.off = off;
    a.perm = perm;
    a.pos = pos;
    a.tiles = tl;
    a.n_tiles = n_tiles;
    a.ticket = ticket;
    const size_t rsm = route_smem(L.E, a.n_group, L.nm);
    if (T <= ROUTE_SMALL_T) {
        mqm_emu::launch(dim3((unsigned)((L.E1 + 7) / 8), 1, 1), dim3(256, 1, 1), rsm, [&] { k_route_small(a); });
    } else {
        for (int64_t t = 0; t < T; t++)   /* cuBLAS's product: some fp32 order */
            for (int e = 0; e < L.E1; e++) {
                float acc = 0.0f;
                for (int dd = 0; dd < L.D; dd++) acc = fmaf(L.router[(size_t)e * L.D + dd], xd[t * L.D + dd], acc);
                logits[t * L.E1 + e] = acc;
            }
        mqm_emu::launch(dim3((unsigned)((T + 7) / 8), 1, 1), dim3(256, 1, 1), rsm, [&] { k_route_large(a); });
    }
    const MoeMat *mats = L.mats.data();
    if (exact) {
        const int64_t tiles_b = P / EXACT_BM + std::min<int64_t>(L.nm, P) + 1;
        if (L.nv) emu_exact<true, 16>(L, mats, tl, n_tiles, xq, xs, perm, midf, midq, mids, y, P, tiles_b);
        else emu_exact<false, 32>(L, mats, tl, n_tiles, xq, xs, perm, midf, midq, mids, y, P, tiles_b);
    } else {
        const int64_t tiles_b = P / bm + std::min<int64_t>(L.nm, P) + 1;
        GemmArgs gu, dn;
        gemm_args(mats, L.nm, tl, n_tiles, perm, xb, L.D64, mid, L.F64m, y, L.D, &gu, &dn);
        const int64_t gs = 2 * (int64_t)std::max(L.F, L.Fs) / 16, ds = L.D / 16;
        if (L.nv) emu_gemms_cfg<true>(cfg, gu, dn, gs, ds, tiles_b);
        else emu_gemms_cfg<false>(cfg, gu, dn, gs, ds, tiles_b);
    }
    const float *gshp = a.has_sgate ? gsh : nullptr;
    const int32_t *offs = L.Fs > 0 ? off + L.E : nullptr;
    mqm_emu::launch(dim3(2, 1, 1), dim3(256, 1, 1), 0,
                    [&] { k_combine(y, L.D, T, L.k, pos, wt, gshp, offs, o); });
    memcpy(out, o, (size_t)(T * L.D) * 4);
    if (sel_out) memcpy(sel_out, sel, (size_t)Tk * 4);
    if (wt_out) memcpy(wt_out, wt, (size_t)Tk * 4);
    if (gsh_out && a.has_sgate) memcpy(gsh_out, gsh, (size_t)T * 4);
    return MOEQ_OK;
}

extern "C" moeq_status mq_gpu_moe_emulate_dequant(const moeq_moe_experts_desc *d, const moeq_moe_zero_points *zp,
                                                  const moeq_moe_ffn_args *r, int64_t expert, int which, float *out) {
    EmuLayer L;
    moeq_status st = emu_build(d, zp, r, L);
    if (st) return st;
    if (expert < 0 || expert >= L.nm || (which != 0 && which != 1))
        return mq_err(MOEQ_E_ARG, "moe_ffn_emulated: dequant: bad expert %lld or matrix %d", (long long)expert, which);
    const int mat = (int)(which ? L.nm + expert : expert);
    const MoeMat &M = L.mats[(size_t)mat];
    const int64_t warps = (int64_t)(M.N / 16) * (M.K64 / 64), F = which ? 0 : M.N / 2;
    const MoeMat *mats = L.mats.data();
    if (L.nv)
        mqm_emu::launch(dim3((unsigned)((warps + 7) / 8), 1, 1), dim3(256, 1, 1), 0,
                        [&] { k_dequant<true>(mats, mat, F, false, out, nullptr, 0); });
    else
        mqm_emu::launch(dim3((unsigned)((warps + 7) / 8), 1, 1), dim3(256, 1, 1), 0,
                        [&] { k_dequant<false>(mats, mat, F, false, out, nullptr, 0); });
    return MOEQ_OK;
}
