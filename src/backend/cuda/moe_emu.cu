/*
 * A SIMT emulator of the MoE op's kernels (moe_kernels.cuh compiled as host code with MQM_EMU),
 * so that the tests run the kernels' own source on machines without a GPU (CI, the development
 * host). Every CUDA thread of a block is a coroutine (ucontext) on the calling thread, switched at
 * __syncthreads and __syncwarp; the warp collectives are exchanges through a per-warp buffer with
 * the semantics the PTX manual
 * gives them: shfl.xor; ldmatrix.m8n8 (.x2, .x4: lane l receives row l / 4, elements 2 (l % 4)
 * and 2 (l % 4) + 1 of each matrix, whose rows the lanes 8q..8q+7 address); mma.m16n8k16
 * row.col bf16 with fp32 accumulators (the fragment layout of moe_dev.cuh; the 16 products and
 * the accumulator summed in double and rounded once, where the tensor cores may round otherwise:
 * so the bf16 path's values here are not the card's bits, the exact path's are); cp.async is a
 * plain copy. Blocks run one after the other. The driver (mq_gpu_moe_emulate) mirrors moe.cu's
 * upload and call on host memory: the same layout builders, tile plans and launch shapes.
 */
#define MQM_EMU 1

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <ucontext.h>

#include <atomic>
#include <functional>
#include <map>
#include <string>
#include <vector>

extern "C" {
#include "backend/gpu.h"
#include "kernels/moe_ffn.h"
}

namespace mqm_emu {

/* CUDA threads as coroutines on the calling thread: one block at a time, each thread runs until it
 * waits at a barrier, then the next one runs (deterministic, and far cheaper than OS threads). */
struct Co {
    ucontext_t ctx;
    unsigned tid;
    bool done;
};

struct Barrier {
    int n = 0, count = 0;
    unsigned gen = 0;
};

struct Block {
    uint3 bid, bdim, gdim;
    std::vector<uint4> dyn;
    std::map<std::string, std::vector<uint64_t>> stat;
    Barrier bar;
    std::vector<Barrier> wbar;
    std::vector<std::vector<uint64_t>> wx;   /* per warp: 2 buffers x 32 lanes x 8 words */
    std::vector<unsigned> wphase;            /* per thread: its warp collectives so far */
};

static ucontext_t g_sched;
static std::vector<Co> g_co;
static Co *g_cur = nullptr;
static Block *g_b = nullptr;
static std::function<void()> *g_body = nullptr;
static std::vector<char> g_stacks;
constexpr size_t STACK = (size_t)256 << 10;

__attribute__((noinline)) void yield() { swapcontext(&g_cur->ctx, &g_sched); }
inline void wait(Barrier &b) {
    const unsigned g = b.gen;
    if (++b.count == b.n) {
        b.count = 0;
        b.gen++;
        return;
    }
    while (b.gen == g) yield();
}

inline unsigned tid() { return g_cur->tid; }
inline uint3 thread_idx() { return make_uint3(tid(), 0, 0); }
inline uint3 block_idx() { return g_b->bid; }
inline uint3 block_dim() { return g_b->bdim; }
inline uint3 grid_dim() { return g_b->gdim; }
inline void syncthreads() { wait(g_b->bar); }
inline void syncwarp() { wait(g_b->wbar[tid() / 32]); }
inline uint8_t *dyn_smem() { return (uint8_t *)g_b->dyn.data(); }
inline void *static_smem(const char *name, size_t n) {
    std::vector<uint64_t> &v = g_b->stat[name];
    if (v.empty()) v.assign((n + 7) / 8, 0);
    return v.data();
}
/* The exchange buffer of this thread's next warp collective (two alternate, so one barrier per
 * collective suffices: a buffer is written again only after every lane passed the collective
 * that follows its last use). */
inline uint64_t *xbuf() {
    const unsigned t = tid();
    return g_b->wx[t / 32].data() + (size_t)(g_b->wphase[t]++ & 1) * 256;
}

template <typename T> T shfl_xor(unsigned, T v, int o) {
    const int lane = (int)(tid() % 32);
    uint64_t *x = xbuf();
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    x[lane * 8] = u;
    syncwarp();
    const uint64_t r = x[(lane ^ o) * 8];
    T out;
    memcpy(&out, &r, sizeof out);
    return out;
}

template <typename T, typename U> T atomic_add(T *p, U v) {
    const T old = *p;
    *p = (T)(old + (T)v);
    return old;
}

inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
    const uint64_t in = (uint64_t)x | (uint64_t)y << 32;
    uint32_t r = 0;
    for (int n = 0; n < 4; n++) r |= (uint32_t)((in >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
    return r;
}

inline uint16_t bf16_bits(float f) {
    const __nv_bfloat16 h = __float2bfloat16_rn(f);
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}
inline uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t r = 0;
    for (int h = 0; h < 2; h++) {
        const float fa = u2f((a >> (16 * h)) << 16), fb = u2f((b >> (16 * h)) << 16), fc = u2f((c >> (16 * h)) << 16);
        const float v = (float)((double)fa * (double)fb + (double)fc);   /* exact where the op uses it */
        r |= (uint32_t)bf16_bits(v) << (16 * h);
    }
    return r;
}

inline void copy16(void *d, const void *s) { memcpy(d, s, 16); }

inline void ldmatrix(int n, const void *p, uint32_t *r0, uint32_t *r1, uint32_t *r2, uint32_t *r3) {
    const int lane = (int)(tid() % 32);
    uint64_t *x = xbuf();
    x[lane * 8] = (uint64_t)(uintptr_t)p;
    syncwarp();
    uint32_t *r[4] = {r0, r1, r2, r3};
    for (int q = 0; q < n; q++) {
        const uint8_t *row = (const uint8_t *)(uintptr_t)x[(q * 8 + lane / 4) * 8];
        memcpy(r[q], row + (lane % 4) * 4, 4);
    }
}

inline float half_of(uint64_t w, int half) { return u2f((uint32_t)((w >> (16 * half)) & 0xffffu) << 16); }

inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    const int lane = (int)(tid() % 32), g = lane / 4, t = lane % 4;
    uint64_t *x = xbuf();
    uint64_t *me = x + lane * 8;
    for (int i = 0; i < 4; i++) me[i] = a[i];
    me[4] = b0;
    me[5] = b1;
    syncwarp();
    for (int q = 0; q < 4; q++) {
        const int row = g + 8 * (q >> 1), col = 2 * t + (q & 1);
        double sum = 0;
        for (int k = 0; k < 16; k++) {
            const int ai = (k >= 8) * 4 + (row >= 8) * 2 + (k & 1);
            const double av = half_of(x[((row % 8) * 4 + (k % 8) / 2) * 8 + (ai >> 1)], ai & 1);
            const double bv = half_of(x[(col * 4 + (k % 8) / 2) * 8 + 4 + (k >= 8)], k & 1);
            sum += av * bv;
        }
        c[q] = (float)(sum + (double)c[q]);
    }
}

/* swapcontext returns twice: kept in functions of their own, whose callers' variables it does
 * not concern */
__attribute__((noinline)) void resume(Co *c) {
    g_cur = c;
    swapcontext(&g_sched, &c->ctx);
}

inline void co_entry() {
    (*g_body)();
    g_cur->done = true;
}

__attribute__((noinline)) void co_setup(Co *c, unsigned t) {
    c->tid = t;
    c->done = false;
    getcontext(&c->ctx);
    c->ctx.uc_stack.ss_sp = g_stacks.data() + (size_t)t * STACK;
    c->ctx.uc_stack.ss_size = STACK;
    c->ctx.uc_link = &g_sched;
    makecontext(&c->ctx, co_entry, 0);
}

/* Runs body in every thread of every block of the grid (blocks one after the other). */
template <typename F> void launch(dim3 grid, dim3 block, size_t smem, F body) {
    const unsigned n = block.x, nw = (n + 31) / 32;
    std::function<void()> fn = body;
    g_body = &fn;
    if (g_stacks.size() < n * STACK) g_stacks.assign(n * STACK, 0);
    g_co.resize(n);
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                Block b;
                b.bid = make_uint3(x, y, z);
                b.bdim = make_uint3(n, 1, 1);
                b.gdim = make_uint3(grid.x, grid.y, grid.z);
                b.dyn.assign(smem / 16 + 1, make_uint4(0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu));
                b.bar.n = (int)n;
                b.wbar.assign(nw, Barrier());
                for (Barrier &w : b.wbar) w.n = 32;
                b.wx.assign(nw, std::vector<uint64_t>(2 * 32 * 8, 0));
                b.wphase.assign(n, 0);
                g_b = &b;
                for (unsigned t = 0; t < n; t++) co_setup(&g_co[t], t);
                for (bool left = true; left;) {
                    left = false;
                    for (unsigned t = 0; t < n; t++) {
                        if (g_co[t].done) continue;
                        resume(&g_co[t]);
                        left = left || !g_co[t].done;
                    }
                }
                g_b = nullptr;
            }
    g_body = nullptr;
}

}  // namespace mqm_emu

#define threadIdx (::mqm_emu::thread_idx())
#define blockIdx (::mqm_emu::block_idx())
#define blockDim (::mqm_emu::block_dim())
#define gridDim (::mqm_emu::grid_dim())
#define __syncthreads() ::mqm_emu::syncthreads()
#define __syncwarp() ::mqm_emu::syncwarp()
#define __shfl_xor_sync(m, v, o) ::mqm_emu::shfl_xor(m, v, o)
#define __ldcg(p) (*(p))
#define atomicAdd(p, v) ::mqm_emu::atomic_add(p, v)
#define __threadfence() std::atomic_thread_fence(std::memory_order_seq_cst)
#define __byte_perm(x, y, s) ::mqm_emu::byte_perm(x, y, s)
#define __float_as_uint(f) ::mqm_emu::f2u(f)
#define __uint_as_float(u) ::mqm_emu::u2f(u)
#define __int_as_float(i) ::mqm_emu::u2f((uint32_t)(i))
#define __float2int_rn(f) ((int)lrintf(f))
#define MQ_DYN_SMEM(name) uint8_t *name = ::mqm_emu::dyn_smem()
#define MQ_SHARED(T, name) T &name = *(T *)::mqm_emu::static_smem(#name, sizeof(T))
#define MQ_SHARED_ARR(T, name, dims) auto &name = *(T(*) dims)::mqm_emu::static_smem(#name, sizeof(T dims))

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
