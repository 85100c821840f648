/*
 * A SIMT emulator that runs the backend's CUDA kernels as host code (MQM_EMU), so that the tests
 * check the kernels' own source on machines without a GPU (CI, the development host): moe_emu.cu
 * (the MoE op's kernels) and kvattn_emu.cu (generation's attention over a KV cache, the device's
 * dequantization) include it before the kernels' headers. Every CUDA thread of a block is a
 * coroutine (ucontext) on the calling thread, switched at __syncthreads and __syncwarp; the warp
 * collectives are exchanges through a per-warp buffer with the semantics the PTX manual gives
 * them: shfl.xor; ldmatrix.m8n8 (.x2, .x4: lane l receives row l / 4, elements 2 (l % 4) and
 * 2 (l % 4) + 1 of each matrix, whose rows the lanes 8q..8q+7 address); mma.m16n8k16 row.col
 * bf16 with fp32 accumulators (the fragment layout of moe_dev.cuh; the 16 products and the
 * accumulator summed in double and rounded once, where the tensor cores may round otherwise: so
 * the bf16 path's values here are not the card's bits, the exact path's are); cp.async is a plain
 * copy. Static shared memory (MQ_SHARED, MQ_SHARED_ARR) is one array per name and block, dynamic
 * shared memory is filled with 0xdeadbeef words (a read before a write shows). Blocks run one
 * after the other. Everything here is inline: one scheduler for the whole program.
 */
#ifndef MOEQ_BACKEND_CUDA_SIMT_EMU_CUH
#define MOEQ_BACKEND_CUDA_SIMT_EMU_CUH

#ifndef MQM_EMU
#define MQM_EMU 1
#endif

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

inline ucontext_t g_sched;
inline std::vector<Co> g_co;
inline Co *g_cur = nullptr;
inline Block *g_b = nullptr;
inline std::function<void()> *g_body = nullptr;
inline std::vector<char> g_stacks;
constexpr size_t STACK = (size_t)256 << 10;

__attribute__((noinline)) inline void yield() { swapcontext(&g_cur->ctx, &g_sched); }
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
__attribute__((noinline)) inline void resume(Co *c) {
    g_cur = c;
    swapcontext(&g_sched, &c->ctx);
}

inline void co_entry() {
    (*g_body)();
    g_cur->done = true;
}

__attribute__((noinline)) inline void co_setup(Co *c, unsigned t) {
    c->tid = t;
    c->done = false;
    getcontext(&c->ctx);
    c->ctx.uc_stack.ss_sp = g_stacks.data() + (size_t)t * STACK;
    c->ctx.uc_stack.ss_size = STACK;
    c->ctx.uc_link = &g_sched;
    makecontext(&c->ctx, co_entry, 0);
}

/* Runs body in every thread of every block of the grid (blocks one after the other). */
template <typename F> inline void launch(dim3 grid, dim3 block, size_t smem, F body) {
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

#endif
