/*
 * Host-side pieces of the MoE op on the GPU shared by moe.cu and the emulator (moe_emu.cu): the
 * geometry of the packed layout (moe_dev.cuh), the scales laid out for the kernels, the global
 * scale factors, the tile shapes of the bf16 GEMMs and which one a call takes.
 */
#ifndef MOEQ_BACKEND_CUDA_MOE_HOST_CUH
#define MOEQ_BACKEND_CUDA_MOE_HOST_CUH

#include <string.h>

#include <algorithm>
#include <vector>

#include "backend/cuda/moe_kernels.cuh"

namespace mqm {

constexpr int ROUTE_SMALL_T = 32;   /* up to this many tokens the routing kernel makes the logits */
constexpr int EXACT_BM = 16;        /* rows per tile of the exact kernels */

/* Dynamic shared memory of the routing kernels: 8 warps' taken flags and group scores, or the
 * plan's three counters per matrix. */
inline size_t route_smem(int E, int n_group, int n_mats) {
    const size_t eb = (size_t)((E + 15) & ~15);
    const size_t r = 8 * eb + 8 * (size_t)std::max(1, n_group) * 4, p = (size_t)3 * n_mats * 4;
    return std::max(r, p);
}

/* Tile shapes: MS strips x NT n8-tiles per warp, WO x WT warps, STAGES-deep pipeline. */
struct Cfg {
    int MS, NT, WO, WT, STAGES, MINB;
    int S() const { return MS * WO; }
    int BM() const { return 8 * NT * WT; }
    int threads() const { return 32 * WO * WT; }
    size_t smem(bool nv) const {
        return (size_t)STAGES * gemm_stage_bytes(MS, NT, WO, WT) + gemm_extra_bytes(NT, WT, nv);
    }
};
constexpr Cfg CFG_DECODE = {1, 1, 4, 1, 8, 4};    /* 64 rows x 8 tokens, 128 threads */
constexpr Cfg CFG_MID = {2, 2, 4, 2, 4, 2};       /* 128 x 32, 256 threads */
constexpr Cfg CFG_M64 = {2, 4, 4, 2, 4, 2};       /* 128 x 64 */
constexpr Cfg CFG_PREFILL = {2, 8, 4, 2, 4, 2};   /* 128 x 128 */

/* ---- geometry and host-side parts of the layout ----------------------------------------------- */
struct Geom {
    int N, K, K64, ngs, fused_F;   /* fused_F: gate_up's F (row order), 0 for down */
    size_t codes, scales, offs, s32;
};

inline size_t align256(size_t v) { return (v + 255) & ~(size_t)255; }

inline Geom geom_of(int nv, int G, int N, int K, int fused_F, bool asym, bool s32) {
    Geom q;
    q.N = N;
    q.K = K;
    q.K64 = (K + 63) & ~63;
    q.fused_F = fused_F;
    const size_t strips = (size_t)N / 16;
    q.codes = strips * (size_t)(q.K64 / 64) * 512;
    if (nv) {
        q.ngs = q.K64 / 16;
        q.scales = strips * (size_t)q.ngs * 16;
    } else {
        q.ngs = (q.K64 + G - 1) / G + 1;
        q.scales = strips * (size_t)q.ngs * 32;
    }
    q.offs = asym ? q.scales : 0;
    q.s32 = s32 ? (size_t)N * (size_t)(K / G) * 4 : 0;
    return q;
}

/* One matrix's canonical scales (and zero points) laid out for the kernels. */
inline void build_scales(const Geom &q, int nv, int G, const uint8_t *scales_src, const uint8_t *zero_src,
                  std::vector<uint8_t> &sc, std::vector<uint8_t> &of, std::vector<float> &s32) {
    const int strips = q.N / 16, ngk = q.K / G;
    sc.assign(q.scales, 0);
    of.assign(q.offs, 0);
    if (q.s32) s32.assign(q.s32 / 4, 0.0f);
    for (int s = 0; s < strips; s++)
        for (int grp = 0; grp < q.ngs; grp++)
            for (int g = 0; g < 8; g++)
                for (int h = 0; h < 2; h++) {
                    const int64_t n = (int64_t)s * 16 + g + 8 * h, cr = canon_row(n, q.fused_F);
                    if (nv) {
                        if (grp < ngk) sc[(((size_t)s * q.ngs + grp) * 8 + g) * 2 + h] = scales_src[cr * ngk + grp];
                        continue;
                    }
                    float f = 0.0f;
                    if (grp < ngk) memcpy(&f, scales_src + ((size_t)cr * ngk + grp) * 4, 4);
                    const uint16_t b = mq_f32_to_bf16(f);
                    const size_t o = ((((size_t)s * q.ngs + grp) * 8 + g) * 2 + h) * 2;
                    memcpy(&sc[o], &b, 2);
                    if (q.offs) {
                        const int z = grp < ngk ? zero_src[cr * ngk + grp] : 8;
                        const uint16_t ob = mq_f32_to_bf16(-(float)(128 + z));
                        memcpy(&of[o], &ob, 2);
                    }
                    if (q.s32 && grp < ngk && h == 0) {
                        for (int hh = 0; hh < 2; hh++) {
                            const int64_t nn = (int64_t)s * 16 + g + 8 * hh, cc = canon_row(nn, q.fused_F);
                            float v;
                            memcpy(&v, scales_src + ((size_t)cc * ngk + grp) * 4, 4);
                            s32[(size_t)nn * ngk + grp] = v;
                        }
                    }
                }
}

inline bool all_bf16_exact(const float *s, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float r = mq_bf16_to_f32(mq_f32_to_bf16(s[i]));
        if (memcmp(&r, &s[i], 4) != 0) return false;
    }
    return true;
}

/* INT4 scales the bf16 layout cannot hold exactly: then every matrix also gets fp32 scales. */
inline bool needs_s32(const moeq_moe_experts_desc *d, int nv, int64_t E, int64_t D, int64_t F, int64_t Fs, int64_t G) {
    if (nv) return false;
    return !all_bf16_exact((const float *)d->gate_up.scales.data, E * 2 * F * (D / G)) ||
           !all_bf16_exact((const float *)d->down.scales.data, E * D * (F / G)) ||
           (Fs > 0 && (!all_bf16_exact((const float *)d->shared_gate_up.scales.data, 2 * Fs * (D / G)) ||
                       !all_bf16_exact((const float *)d->shared_down.scales.data, D * (Fs / G))));
}

/* A layer's matrices, geo: the nm gate_up ones (index E: the shared expert's, Fs wide), then the
 * nm down ones; and their one blob, part by part (all codes, then all scales, ...) so that the
 * routed experts' codes follow each other (pack_codes writes them as one array): part j of
 * matrix i at at[i * 4 + j], each 256-byte aligned. Returns the blob's size; *parts: the parts'
 * bytes without the alignment. */
inline size_t layer_layout(int nv, int G, int64_t nm, int64_t E, int64_t D, int64_t F, int64_t Fs, bool asym,
                           bool s32, std::vector<Geom> &geo, std::vector<size_t> &at, size_t *parts) {
    geo.assign((size_t)nm * 2, Geom());
    for (int64_t i = 0; i < nm; i++) {
        const int64_t f = i == E ? Fs : F;
        geo[i] = geom_of(nv, G, (int)(2 * f), (int)D, (int)f, asym, s32);
        geo[nm + i] = geom_of(nv, G, (int)D, (int)f, 0, asym, s32);
    }
    at.assign(geo.size() * 4, 0);
    size_t total = 0;
    *parts = 0;
    for (int j = 0; j < 4; j++)
        for (size_t i = 0; i < geo.size(); i++) {
            const size_t part = j == 0 ? geo[i].codes : j == 1 ? geo[i].scales : j == 2 ? geo[i].offs : geo[i].s32;
            at[i * 4 + j] = total;
            total += align256(part);
            *parts += part;
        }
    return total;
}

/* Matrix i's entry of the kernels' table (zeroed first; the factors are the caller's): its parts
 * in the blob at layer_layout's offsets, and its shape. */
inline void mat_at(MoeMat &M, const uint8_t *blob, const std::vector<size_t> &at, const Geom &q, size_t i, int G,
                   bool asym, bool s32) {
    memset(&M, 0, sizeof M);
    M.codes = (const uint4 *)(blob + at[i * 4]);
    M.scales = blob + at[i * 4 + 1];
    M.offs = asym ? blob + at[i * 4 + 2] : nullptr;
    M.s32 = s32 ? (const float *)(blob + at[i * 4 + 3]) : nullptr;
    M.N = q.N;
    M.K = q.K;
    M.K64 = q.K64;
    M.G = G;
    M.ngs = q.ngs;
}

/* The bf16 path's two grouped GEMMs: gate_up reads the activation rows xb (row stride D64)
 * through perm and writes the SwiGLU rows mid (F64m); down reads mid and writes y (D). mats: the
 * nm gate_up matrices, then the nm down ones. */
inline void gemm_args(const MoeMat *mats, int nm, const Tile *tiles, const int32_t *n_tiles, const int32_t *perm,
                      const bf16 *xb, int64_t D64, bf16 *mid, int64_t F64m, float *y, int64_t D, GemmArgs *gu,
                      GemmArgs *dn) {
    memset(gu, 0, sizeof *gu);
    gu->mats = mats;
    gu->tiles = tiles;
    gu->n_tiles = n_tiles;
    gu->act = xb;
    gu->lda = D64;
    gu->perm = perm;
    gu->mid = mid;
    gu->ldm = F64m;
    *dn = *gu;
    dn->mats = mats + nm;
    dn->act = mid;
    dn->lda = F64m;
    dn->perm = nullptr;
    dn->y = y;
    dn->ldy = D;
}

/* The exact path's two: gate_up reads the activation integers xq and their scales xs (row
 * stride D) through perm and writes the fp32 SwiGLU rows midf (Fmax); down reads them
 * requantized (midq, mids) and writes y (D). */
inline void exact_args(const MoeMat *mats, int nm, const Tile *tiles, const int32_t *n_tiles, const int32_t *perm,
                       const int16_t *xq, const float *xs, int64_t D, float *midf, const int16_t *midq,
                       const float *mids, int64_t Fmax, float *y, ExactArgs *gu, ExactArgs *dn) {
    gu->mats = mats;
    gu->tiles = tiles;
    gu->n_tiles = n_tiles;
    gu->q = xq;
    gu->qs = xs;
    gu->ldq = D;
    gu->perm = perm;
    gu->out = midf;
    gu->ldo = Fmax;
    *dn = *gu;
    dn->mats = mats + nm;
    dn->q = midq;
    dn->qs = mids;
    dn->ldq = Fmax;
    dn->perm = nullptr;
    dn->out = y;
    dn->ldo = D;
}

/* build_scales of matrix i of a layer's list (geo: the nm gate_up matrices, then the nm down
 * ones; index E of each half is the shared expert's), from the descriptor's scales and zero
 * points (zp may be NULL). */
inline void build_scales_of(const moeq_moe_experts_desc *d, const moeq_moe_zero_points *zp, const Geom &q,
                            size_t i, int64_t nm, int64_t E, int nv, int G, std::vector<uint8_t> &sc,
                            std::vector<uint8_t> &of, std::vector<float> &sv) {
    const bool gu = (int64_t)i < nm;
    const int64_t e = (int64_t)i % nm;
    const bool sh = e == E;
    const moeq_moe_qweight *w = gu ? (sh ? &d->shared_gate_up : &d->gate_up) : (sh ? &d->shared_down : &d->down);
    const size_t per = (size_t)q.N * (size_t)(q.K / G) * (nv ? 1 : 4);
    const uint8_t *ssrc = (const uint8_t *)w->scales.data + (sh ? 0 : per * (size_t)e);
    const uint8_t *zsrc = NULL;
    if (zp) {
        const moeq_tensor_ref *z = gu ? (sh ? &zp->shared_gate_up : &zp->gate_up) : (sh ? &zp->shared_down : &zp->down);
        zsrc = (const uint8_t *)z->data + (sh ? 0 : (size_t)q.N * (size_t)(q.K / G) * (size_t)e);
    }
    build_scales(q, nv, G, ssrc, zsrc, sc, of, sv);
}

/* Index of expert e's (h = 0 gate, 1 up) global scale in gate_up.global_scale (e < 0: shared). */
inline int64_t gs_index(const moeq_tensor_ref *g, int64_t e, int h) {
    const bool pairs = g->data && g->shape[g->ndim - 1] == 2 && (g->ndim == 2 || e < 0);
    return pairs ? (e < 0 ? 0 : e) * 2 + h : (e < 0 ? 0 : e);
}

inline void set_factors(MoeMat &M, int nv, int mult, const float gs[2]) {
    for (int h = 0; h < 2; h++) {
        M.fmul[h] = M.fdiv[h] = M.xmul[h] = M.xdiv[h] = 1.0f;
        if (!nv) continue;
        if (mult) {
            M.fmul[h] = gs[h];
            M.xmul[h] = gs[h];
            M.xdiv[h] = 2.0f;
        } else {
            M.fdiv[h] = gs[h];
            M.xdiv[h] = 2.0f * gs[h];
        }
    }
}

/* Which tile shape: by the rows a routed expert gets on average (a tile's unused rows cost
 * tensor-core work, a narrower tile decodes each weight for fewer rows). */
inline int pick_cfg(int force, int64_t T, int k, int E) {
    if (force >= 0) return force;
    const double r = (double)T * k / E;
    return r <= 8.0 ? 0 : r <= 48.0 ? 1 : r <= 160.0 ? 2 : 3;
}
inline int cfg_bm(int c) {
    return c == 0 ? CFG_DECODE.BM() : c == 1 ? CFG_MID.BM() : c == 2 ? CFG_M64.BM() : CFG_PREFILL.BM();
}

inline dim3 tile_grid(int64_t x, int64_t tiles) {
    const int64_t y = std::min<int64_t>(tiles, 65535), z = (tiles + 65534) / 65535;
    return dim3((unsigned)x, (unsigned)std::max<int64_t>(y, 1), (unsigned)std::max<int64_t>(z, 1));
}

}  // namespace mqm

#endif
