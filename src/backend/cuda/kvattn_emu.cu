/*
 * Generation's device code under the SIMT emulator (simt_emu.cuh), for the tests of machines
 * without a GPU (tests/test_gpu_kvattn_emu.c):
 *  - mq_gpu_kvattn_emulate: decode.cu's mq_gpu_kvattn_run on host memory, the same steps
 *    (kvattn_kernels.cuh's kv_layer_steps: its kernels' source, launch shapes and order) with the
 *    products by a host GEMM of the operands mq_cu_product gives cuBLAS (cuda_internal.cuh's
 *    mq_cu_product_ops; each output one fmaf chain in k order, as the fp32 mode's tile_det.cuh
 *    sums). Buffers are mq_gpu_kvattn_new's, of the sizes it allocates, filled with NaN (device
 *    memory holds garbage until written: a read of a value not written shows) between guards
 *    that must be intact after every kernel (a write outside a buffer is an error naming it).
 *  - mq_gpu_dequantize_emulate: dequant.cu's mq_cu_dequantize, dequant_kernels.cuh's kernel and
 *    launch shape.
 */
#include <stdio.h>

#include <algorithm>

/* before the emulator's macros: formats' codecs are host-and-device functions of CUDA's own
 * intrinsics (__float_as_uint), which the emulator's macros would make host-only */
#include "backend/cuda/cuda_internal.cuh"
extern "C" {
#include "formats/formats.h"
#include "quant/gptq.h"
}

#include "backend/cuda/simt_emu.cuh"

/* the device twins in a namespace of their own here (inline host functions, as moe_emu.cu's) */
#define mqd mqd_emulated
#include "backend/cuda/dequant_kernels.cuh"
#include "backend/cuda/kvattn_kernels.cuh"

namespace {

constexpr uint32_t FILL = 0x7fc0dead;   /* a quiet NaN: the never-written values */
constexpr size_t GUARD = 8192;          /* words before and after each buffer: a few rows of the tests' shapes */

/* The emulated device's memory: buffers of 4-byte words, each NaN-filled between two guards. */
struct EmuMem {
    struct Buf {
        std::string name;
        std::vector<uint32_t> w;
        size_t n;
    };
    std::vector<Buf> bufs;   /* a Buf's words stay where they are as the list grows (moved vectors) */

    template <typename T> T *alloc(const char *name, int64_t n) {
        static_assert(sizeof(T) == 4, "4-byte words");
        bufs.push_back(Buf{name, std::vector<uint32_t>((size_t)n + 2 * GUARD, FILL), (size_t)n});
        return (T *)(bufs.back().w.data() + GUARD);
    }
    /* an upload: n values of src (NULL: left unwritten, as decode.cu leaves an absent bias) */
    float *upload(const char *name, const float *src, int64_t n) {
        float *d = alloc<float>(name, n);
        if (src) memcpy(d, src, (size_t)n * sizeof(float));
        return d;
    }
    moeq_status check(const char *after) const {
        for (const Buf &b : bufs)
            for (size_t i = 0; i < 2 * GUARD; i++) {
                const size_t at = i < GUARD ? i : b.n + i;   /* the guard before, then the one after */
                if (b.w[at] != FILL)
                    return mq_err(MOEQ_E_DEVICE, "emulated GPU: %s wrote outside %s (%zu values) at %lld", after,
                                  b.name.c_str(), b.n, (long long)at - (long long)GUARD);
            }
        return MOEQ_OK;
    }
};

/* cublasSgemm on host memory (column-major, alpha 1, beta 0), its argument checks included. */
moeq_status host_sgemm(const mq_cu_sgemm_ops &o) {
    const bool na = o.ta == CUBLAS_OP_N, nb = o.tb == CUBLAS_OP_N;
    if (o.m < 0 || o.n < 0 || o.k < 0 || o.lda < std::max(1, na ? o.m : o.k) || o.ldb < std::max(1, nb ? o.k : o.n) ||
        o.ldc < std::max(1, o.m))
        return mq_err(MOEQ_E_ARG, "emulated cublasSgemm: m %d n %d k %d, lda %d ldb %d ldc %d (CUBLAS_STATUS_INVALID_VALUE)",
                      o.m, o.n, o.k, o.lda, o.ldb, o.ldc);
    for (int j = 0; j < o.n; j++)
        for (int i = 0; i < o.m; i++) {
            float acc = 0.0f;
            for (int l = 0; l < o.k; l++) {
                const float a = na ? o.A[i + (size_t)l * o.lda] : o.A[l + (size_t)i * o.lda];
                const float b = nb ? o.B[l + (size_t)j * o.ldb] : o.B[j + (size_t)l * o.ldb];
                acc = fmaf(a, b, acc);
            }
            o.C[i + (size_t)j * o.ldc] = acc;
        }
    return MOEQ_OK;
}

/* kv_layer_steps on the emulator: each kernel runs to its end, then the guards are checked. */
struct EmuDev {
    const EmuMem *mem;
    template <class... P, class... A>
    moeq_status launch(const char *name, void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
        if (block.y != 1 || block.z != 1) return mq_err(MOEQ_E_ARG, "emulated GPU: %s: a block of more than x", name);
        mqm_emu::launch(grid, block, 0, [&] { kernel(args...); });
        return mem->check(name);
    }
    moeq_status product(int64_t M, int64_t N, int64_t K, const float *A, const float *B, float *C, int64_t ldc) {
        if (M <= 0 || N <= 0) return MOEQ_OK;   /* mq_cu_product's */
        const moeq_status st = host_sgemm(mq_cu_product_ops(M, N, K, A, B, C, ldc));
        return st ? st : mem->check("a product");
    }
};

}  // namespace

extern "C" moeq_status mq_gpu_kvattn_emulate(const mq_gpu_attn_shape *sh, const mq_gpu_attn_weights *w,
                                             const int64_t *n, int calls, float *x, float *ffn, int32_t *sel,
                                             float *wt) {
    int64_t most = 0, total = 0;
    for (int c = 0; c < calls; c++) {
        if (n[c] <= 0) return mq_err(MOEQ_E_ARG, "emulated GPU KV attention: call %d of %lld tokens", c, (long long)n[c]);
        most = std::max(most, n[c]);
        total += n[c];
    }
    /* mq_gpu_kvattn_new's checks, _set's, _run's */
    if (sh->D <= 0 || sh->H <= 0 || sh->KV <= 0 || sh->hd <= 0 || sh->hd % 2 || sh->H % sh->KV || sh->max_T <= 0 ||
        !sh->rope_cos || !sh->rope_sin || calls <= 0 || total > sh->max_T)
        return mq_err(MOEQ_E_SHAPE, "emulated GPU KV attention: D %lld, %lld heads, %lld KV heads, head dim %lld, "
                      "%lld positions, %lld tokens", (long long)sh->D, (long long)sh->H, (long long)sh->KV,
                      (long long)sh->hd, (long long)sh->max_T, (long long)total);
    if (!w->norm || !w->ffn_norm || !w->q || !w->k || !w->v || !w->o || (sh->qk_norm && (!w->q_norm || !w->k_norm)))
        return mq_err(MOEQ_E_ARG, "emulated GPU KV attention: a weight is missing");
    const bool route = sel || wt;
    if (route && (!sel || !wt || !w->router || !ffn || !(sh->E > 0 && sh->top_k > 0)))
        return mq_err(MOEQ_E_ARG, "emulated GPU KV attention: routing needs a router, the FFN input and both outputs");
    const int64_t D = sh->D, H = sh->H, T = sh->max_T, QD = sh->H * sh->hd, KVD = sh->KV * sh->hd, hd = sh->hd;
    const int64_t R = mq_gpu_kvattn_rows_for(sh, most), E = sh->E, K = sh->top_k;
    if (most > R)
        return mq_err(MOEQ_E_ARG, "emulated GPU KV attention: %lld tokens a call, at most %lld", (long long)most,
                      (long long)R);
    EmuMem mem;
    float *cos_t = mem.upload("RoPE table", sh->rope_cos, T * (hd / 2));
    float *sin_t = mem.upload("RoPE table", sh->rope_sin, T * (hd / 2));
    KvStep k = {};
    k.sh = sh;
    k.cos_t = cos_t;
    k.sin_t = sin_t;
    k.xn = mem.alloc<float>("attention input", R * D);
    k.q = mem.alloc<float>("queries", R * QD);
    k.att = mem.alloc<float>("attention output", R * QD);
    k.y = mem.alloc<float>("o_proj output", R * D);
    k.S = mem.alloc<float>("attention scores", R * H * T);
    k.pos = mem.alloc<int32_t>("token positions", R);
    if (E > 0 && K > 0) {
        k.logits = mem.alloc<float>("router logits", R * E);
        k.rw = mem.alloc<float>("routing weights", R * K);
        k.rsel = mem.alloc<int32_t>("routing", R * K);
    }
    const int64_t qn = sh->qk_norm == 1 ? QD : hd, kn = sh->qk_norm == 1 ? KVD : hd;
    KvLayer L = {};
    L.norm = mem.upload("norm", w->norm, D);
    L.wq = mem.upload("q_proj", w->q, QD * D);
    L.wk = mem.upload("k_proj", w->k, KVD * D);
    L.wv = mem.upload("v_proj", w->v, KVD * D);
    L.wo = mem.upload("o_proj", w->o, D * QD);
    L.bq = mem.upload("q bias", w->q_bias, QD);
    L.bk = mem.upload("k bias", w->k_bias, KVD);
    L.bv = mem.upload("v bias", w->v_bias, KVD);
    L.bo = mem.upload("o bias", w->o_bias, D);
    L.qn = mem.upload("q_norm", w->q_norm, qn);
    L.kn = mem.upload("k_norm", w->k_norm, kn);
    L.fnorm = mem.upload("ffn_norm", w->ffn_norm, D);
    if (w->router) L.router = mem.upload("router", w->router, E * D);
    L.kc = mem.alloc<float>("K cache", T * KVD);
    L.vc = mem.alloc<float>("V cache", T * KVD);
    L.has_bq = w->q_bias != NULL;
    L.has_bk = w->k_bias != NULL;
    L.has_bv = w->v_bias != NULL;
    L.has_bo = w->o_bias != NULL;
    L.window = w->window;
    L.have = 15u;
    L.set = true;
    k.L = &L;
    k.route = route;
    EmuDev dev = {&mem};
    moeq_status st = MOEQ_OK;
    int64_t p0 = 0;
    for (int c = 0; c < calls && !st; p0 += n[c], c++) {
        char what[32];
        snprintf(what, sizeof what, "x of call %d", c);
        k.x = mem.upload(what, x + p0 * D, n[c] * D);
        k.xf = ffn ? mem.alloc<float>("FFN input", n[c] * D) : NULL;
        k.n = n[c];
        k.p0 = p0;
        st = kv_layer_steps(dev, k);
        if (st) break;
        memcpy(x + p0 * D, k.x, (size_t)(n[c] * D) * sizeof(float));
        if (ffn) memcpy(ffn + p0 * D, k.xf, (size_t)(n[c] * D) * sizeof(float));
        if (route) {
            memcpy(sel + p0 * K, k.rsel, (size_t)(n[c] * K) * sizeof(int32_t));
            memcpy(wt + p0 * K, k.rw, (size_t)(n[c] * K) * sizeof(float));
        }
    }
    return st;
}

extern "C" moeq_status mq_gpu_dequantize_emulate(const mq_qtensor *q, float *out) {
    moeq_status st = dequant_check(q, "emulated GPU dequantization");
    if (st) return st;
    const int64_t n = q->rows * q->cols;
    EmuMem mem;
    float *w = mem.alloc<float>("weights", n);
    /* the codes, params and g_idx as mq_cu_dequantize uploads them: its arrays' bytes */
    const uint8_t *cp = q->codes;
    const mq_gparams *pp = q->params;
    const int32_t *gp = q->g_idx;
    const mq_qspec spec = q->spec;
    const float gs = q->global_scale;
    const int64_t rows = q->rows, cols = q->cols, ng = q->n_groups, G = q->group_size;
    mqm_emu::launch(dim3(dequant_blocks(n)), dim3(DEQUANT_THREADS), 0,
                    [&] { k_dequant(w, cp, pp, gp, spec, gs, rows, cols, ng, G); });
    st = mem.check("k_dequant");
    if (!st) memcpy(out, w, (size_t)n * sizeof(float));
    return st;
}
