/*
 * The MoE feed-forward op on the GPU (moeq_moe_cuda_*; backend/gpu.h's mq_gpu_moe_*) against its
 * CPU twins:
 *   fp32 mode   the CPU op's scalar kernels (mq_moe_kernels_ref: activation blocks, packed GEMM
 *               with SwiGLU, down) driven by the GPU's routing, summed in the CPU op's order:
 *               bit-identical; the CPU op itself (moeq_moe_ffn, its own routing): relative
 *               difference <= 1e-5 (the router's logits are summed in another order);
 *               asymmetric INT4, which the CPU op refuses: the fp64 reference, <= 5e-4 (its
 *               16-bit activation blocks);
 *   bf16 mode   the fp64 reference (dequantized weights, the GPU's routing):
 *               ||out - ref|| / ||ref|| <= 1.6e-2 = 4 * 2^-8: at most four bf16 roundings of
 *               2^-8 relative each lie on a value's path (x, an INT4 weight, the SwiGLU output,
 *               a down weight; NVFP4 weights are exact in bf16);
 *   routing     the experts of a double-precision routing wherever its margin exceeds 1e-5, the
 *               weights within 1e-5;
 *   decoders    every weight as the tensor-core path decodes it: bit-identical to the canonical
 *               value (NVFP4 e2m1 * e4m3; INT4 bf16(bf16(scale) * (u - z))).
 * Shapes: random ones over every format (INT4 groups 32, 64, 128, symmetric and asymmetric, bf16
 * and fp32 scales; NVFP4 with divisor and multiplier global scales), every routing option, the
 * four tile shapes (which must give the same bits) and both routing kernels; experts with 0, 1,
 * 7 and 4096 rows; the MoE layer of each fixture family (Mixtral, Qwen3-MoE, Qwen2-MoE with its
 * gated shared expert, DeepSeek-V3's group-limited sigmoid routing, OLMoE) quantized here.
 * Without a GPU the op's cases run the same kernel source through the emulator
 * (backend/cuda/moe_emu.cu; smaller sizes, the bf16 path's tensor-core sums rounded once per
 * step) with every check above; the cases that need the device itself (upload errors, the public
 * interface, the baseline) skip with a message; in a build without CUDA every GPU case skips.
 * The argument checks run everywhere.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/gpu.h"
#include "formats/formats.h"
#include "harness.h"
#include "io/safetensors.h"
#include "ckpt/source.h"
#include "kernels/moe_ffn.h"

#define TOL_BF16 0.015625      /* 4 * 2^-8 */
#define TOL_FP32_CPU 1e-5
#define TOL_FP32_ASYM 5e-4

/* ---- random data ------------------------------------------------------------------------------ */
static uint64_t g_rng = 1;
static void seed(uint64_t s) { g_rng = s * 0x9E3779B97F4A7C15ull + 7; }
static uint32_t rnd_u32(void) { return (uint32_t)(mq_test_xorshift(&g_rng) >> 16); }
static float rnd_unit(void) { return mq_test_rnd_unitf(&g_rng); }
static float rnd_normal(void) { return mq_test_rnd_normalf(&g_rng); }
static int rnd_int(int n) { return (int)(rnd_u32() % (uint32_t)n); }

/* ---- a layer in canonical form ---------------------------------------------------------------- */
typedef struct {
    int nv, G, asym, mult, E, D, F, Fs;
    uint8_t *c[4];        /* codes: gate_up [E,2F,D], down [E,D,F], shared gate_up [2Fs,D], shared down [D,Fs] */
    void *s[4];           /* scales: F32 (INT4) or E4M3 bytes */
    uint8_t *z[4];        /* asymmetric INT4 zero points, shaped as the scales */
    float *gu_g2, *gu_g1, *dn_g;   /* NVFP4 global scales: gate_up [E, 2] and its gate column [E]; down [E] */
    float sgu_g[2], sdn_g;
    int gs_pairs;
    /* routing */
    float *router, *bias, *sgate;
    int k, scoring, renorm, n_group, topk_group, use_bias, use_sgate;
    float route_scale;
} layer;

static size_t mat_rows(const layer *L, int i) {
    return i == 0 ? (size_t)L->E * 2 * L->F : i == 1 ? (size_t)L->E * L->D : i == 2 ? (size_t)2 * L->Fs : (size_t)L->D;
}
static size_t mat_cols(const layer *L, int i) { return (i == 1 || i == 3) ? (size_t)(i == 1 ? L->F : L->Fs) : (size_t)L->D; }

static void layer_free(layer *L) {
    for (int i = 0; i < 4; i++) {
        free(L->c[i]);
        free(L->s[i]);
        free(L->z[i]);
    }
    free(L->gu_g2);
    free(L->gu_g1);
    free(L->dn_g);
    free(L->router);
    free(L->bias);
    free(L->sgate);
    memset(L, 0, sizeof *L);
}

/* Allocations of every array for the shape (values left to the caller). */
static void layer_alloc(layer *L) {
    for (int i = 0; i < 4; i++) {
        if (i >= 2 && !L->Fs) continue;
        const size_t r = mat_rows(L, i), c = mat_cols(L, i), ng = r * (c / (size_t)L->G);
        L->c[i] = calloc(r * c, 1);
        L->s[i] = calloc(ng, L->nv ? 1 : 4);
        if (L->asym) L->z[i] = calloc(ng, 1);
    }
    L->gu_g2 = malloc(sizeof(float) * 2 * (size_t)L->E);
    L->gu_g1 = malloc(sizeof(float) * (size_t)L->E);
    L->dn_g = malloc(sizeof(float) * (size_t)L->E);
    for (int e = 0; e < L->E; e++) L->gu_g2[2 * e] = L->gu_g2[2 * e + 1] = L->gu_g1[e] = L->dn_g[e] = 1.0f;
    L->sgu_g[0] = L->sgu_g[1] = L->sdn_g = 1.0f;
    L->router = calloc((size_t)L->E * L->D, sizeof(float));
    L->bias = calloc((size_t)L->E, sizeof(float));
    L->sgate = calloc((size_t)L->D, sizeof(float));
}

/* Random codes, scales (bf16-exact when bf16_scales), zero points, global scales and routing. */
static void layer_random(layer *L, int bf16_scales) {
    layer_alloc(L);
    for (int i = 0; i < 4; i++) {
        if (!L->c[i]) continue;
        const size_t r = mat_rows(L, i), c = mat_cols(L, i), ng = r * (c / (size_t)L->G);
        for (size_t j = 0; j < r * c; j++) L->c[i][j] = (uint8_t)(rnd_u32() & 15);
        for (size_t j = 0; j < ng; j++) {
            if (L->nv) {
                uint8_t b = (uint8_t)((40 + rnd_u32() % 40) & 0x7f);
                if (rnd_u32() % 17 == 0) b = (uint8_t)(1 + rnd_u32() % 7);   /* subnormal */
                if (rnd_u32() % 23 == 0) b |= 0x80;                           /* negative */
                ((uint8_t *)L->s[i])[j] = b;
            } else {
                float v = (0.5f + rnd_unit()) * 0.02f * (rnd_u32() % 19 == 0 ? -1.0f : 1.0f);
                if (bf16_scales) v = mq_bf16_to_f32(mq_f32_to_bf16(v));
                ((float *)L->s[i])[j] = v;
            }
            if (L->z[i]) L->z[i][j] = (uint8_t)(rnd_u32() & 15);
        }
    }
    for (int e = 0; e < L->E; e++) {
        L->gu_g2[2 * e] = L->gu_g1[e] = 20.0f + 200.0f * rnd_unit();
        L->gu_g2[2 * e + 1] = L->gs_pairs ? 20.0f + 200.0f * rnd_unit() : L->gu_g2[2 * e];
        L->dn_g[e] = 20.0f + 200.0f * rnd_unit();
    }
    L->sgu_g[0] = 37.5f;
    L->sgu_g[1] = L->gs_pairs ? 91.0f : 37.5f;
    L->sdn_g = 55.0f;
    if (L->mult) {   /* ModelOpt: the global scale multiplies */
        for (int e = 0; e < 2 * L->E; e++) L->gu_g2[e] = 1.0f / L->gu_g2[e];
        for (int e = 0; e < L->E; e++) L->gu_g1[e] = L->gu_g2[2 * e], L->dn_g[e] = 1.0f / L->dn_g[e];
        L->sgu_g[0] = 1.0f / L->sgu_g[0];
        L->sgu_g[1] = 1.0f / L->sgu_g[1];
        L->sdn_g = 1.0f / L->sdn_g;
    }
    for (size_t i = 0; i < (size_t)L->E * L->D; i++) L->router[i] = rnd_normal() * 0.1f;
    for (int e = 0; e < L->E; e++) L->bias[e] = rnd_normal() * 0.05f;
    for (int i = 0; i < L->D; i++) L->sgate[i] = rnd_normal() * 0.05f;
}

static moeq_tensor_ref tref(const void *data, moeq_dtype dt, int ndim, int64_t a, int64_t b, int64_t c) {
    moeq_tensor_ref r = {data, dt, ndim, {a, b, c, 0}, 0};
    size_t n = (size_t)a;
    if (ndim >= 2) n *= (size_t)b;
    if (ndim >= 3) n *= (size_t)c;
    r.nbytes = n * (dt == MOEQ_DT_F32 ? 4 : 1);
    return r;
}

static moeq_moe_qweight qw(const layer *L, int i, const float *gs, int pairs) {
    moeq_moe_qweight w;
    memset(&w, 0, sizeof w);
    const moeq_dtype sdt = L->nv ? MOEQ_DT_F8_E4M3 : MOEQ_DT_F32;
    const int64_t cols = (int64_t)mat_cols(L, i);
    if (i < 2) {
        const int64_t rows = (int64_t)mat_rows(L, i) / L->E;
        w.codes = tref(L->c[i], MOEQ_DT_U8, 3, L->E, rows, cols);
        w.scales = tref(L->s[i], sdt, 3, L->E, rows, cols / L->G);
        if (L->nv) w.global_scale = pairs ? tref(gs, MOEQ_DT_F32, 2, L->E, 2, 0) : tref(gs, MOEQ_DT_F32, 1, L->E, 0, 0);
    } else {
        const int64_t rows = (int64_t)mat_rows(L, i);
        w.codes = tref(L->c[i], MOEQ_DT_U8, 2, rows, cols, 0);
        w.scales = tref(L->s[i], sdt, 2, rows, cols / L->G, 0);
        if (L->nv) w.global_scale = tref(gs, MOEQ_DT_F32, 1, pairs ? 2 : 1, 0, 0);
    }
    return w;
}

static moeq_moe_experts_desc desc_of(const layer *L) {
    moeq_moe_experts_desc d = mq_test_moe_desc(L->nv, L->G, L->E, L->D, L->F, L->Fs);
    d.nvfp4_global_multiplier = L->mult;
    d.gate_up = qw(L, 0, L->gs_pairs ? L->gu_g2 : L->gu_g1, L->gs_pairs);
    d.down = qw(L, 1, L->dn_g, 0);
    if (L->Fs) {
        d.shared_gate_up = qw(L, 2, L->sgu_g, L->gs_pairs);
        d.shared_down = qw(L, 3, &L->sdn_g, 0);
    }
    return d;
}

static moeq_moe_zero_points zeros_of(const layer *L) {
    moeq_moe_zero_points z;
    memset(&z, 0, sizeof z);
    z.gate_up = tref(L->z[0], MOEQ_DT_U8, 3, L->E, 2 * L->F, L->D / L->G);
    z.down = tref(L->z[1], MOEQ_DT_U8, 3, L->E, L->D, L->F / L->G);
    if (L->Fs) {
        z.shared_gate_up = tref(L->z[2], MOEQ_DT_U8, 2, 2 * L->Fs, L->D / L->G, 0);
        z.shared_down = tref(L->z[3], MOEQ_DT_U8, 2, L->D, L->Fs / L->G, 0);
    }
    return z;
}

static moeq_moe_ffn_args args_of(const layer *L, const float *x, int64_t T) {
    moeq_moe_ffn_args a;
    memset(&a, 0, sizeof a);
    a.x = tref(x, MOEQ_DT_F32, 2, T, L->D, 0);
    a.router = tref(L->router, MOEQ_DT_F32, 2, L->E, L->D, 0);
    if (L->use_bias) a.router_bias = tref(L->bias, MOEQ_DT_F32, 1, L->E, 0, 0);
    if (L->use_sgate) a.shared_gate = tref(L->sgate, MOEQ_DT_F32, 1, L->D, 0, 0);
    a.top_k = L->k;
    a.scoring = L->scoring ? MOEQ_MOE_SIGMOID : MOEQ_MOE_SOFTMAX;
    a.renormalize = L->renorm;
    a.route_scale = L->route_scale;
    a.n_group = L->n_group;
    a.topk_group = L->topk_group;
    return a;
}

/* ---- the fp64 reference --------------------------------------------------------------------------- */

/* Expert e's (E: shared) matrix which (0 gate_up [2f, D], 1 down [D, f]) dequantized in double. */
static double *deq(const layer *L, int e, int which) {
    const int sh = e == L->E, i = which + (sh ? 2 : 0), f = sh ? L->Fs : L->F;
    const int64_t rows = which ? L->D : 2 * f, cols = which ? f : L->D, ng = cols / L->G;
    const size_t base = sh ? 0 : (size_t)e * (size_t)(rows * cols), sbase = sh ? 0 : (size_t)e * (size_t)(rows * ng);
    double *w = malloc(sizeof(double) * (size_t)(rows * cols));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < cols; k++) {
            const uint8_t c = L->c[i][base + (size_t)(r * cols + k)];
            const size_t si = sbase + (size_t)(r * ng + k / L->G);
            double v;
            if (L->nv) {
                double gs;
                if (which) gs = sh ? L->sdn_g : L->dn_g[e];
                else gs = sh ? L->sgu_g[r >= f] : L->gu_g2[2 * e + (r >= f)];
                const double s = mq_test_e4m3_dec(((const uint8_t *)L->s[i])[si]);
                v = L->mult ? mq_test_e2m1_dec(c) * s * gs : mq_test_e2m1_dec(c) * s / gs;
            } else {
                const int z = L->asym ? L->z[i][si] : 8;
                v = ((int)c - z) * (double)((const float *)L->s[i])[si];
            }
            w[r * cols + k] = v;
        }
    return w;
}

typedef struct {
    double **gu, **dn;   /* [E + 1] */
} deq_cache;

static void deq_cache_free(deq_cache *c, int n) {
    for (int i = 0; i < n; i++) {
        free(c->gu[i]);
        free(c->dn[i]);
    }
    free(c->gu);
    free(c->dn);
}

static void ref_ffn(const layer *L, deq_cache *dc, int e, const float *x, double *y) {
    const int f = e == L->E ? L->Fs : L->F, D = L->D;
    if (!dc->gu[e]) {
        dc->gu[e] = deq(L, e, 0);
        dc->dn[e] = deq(L, e, 1);
    }
    const double *gu = dc->gu[e], *dn = dc->dn[e];
    double *mid = malloc(sizeof(double) * (size_t)f);
    for (int j = 0; j < f; j++) {
        double g = 0, u = 0;
        for (int d = 0; d < D; d++) {
            g += gu[(size_t)j * D + d] * x[d];
            u += gu[(size_t)(f + j) * D + d] * x[d];
        }
        mid[j] = g / (1.0 + exp(-g)) * u;
    }
    for (int d = 0; d < D; d++) {
        double acc = 0;
        for (int j = 0; j < f; j++) acc += dn[(size_t)d * f + j] * mid[j];
        y[d] = acc;
    }
    free(mid);
}

/* out [T, D] in double for the given routing (sel, wt [T, k]; gsh [T] or NULL). */
static void ref_forward(const layer *L, const float *x, int64_t T, const int32_t *sel, const float *wt,
                        const float *gsh, double *out) {
    deq_cache dc = {calloc((size_t)L->E + 1, sizeof(double *)), calloc((size_t)L->E + 1, sizeof(double *))};
    double *y = malloc(sizeof(double) * (size_t)L->D);
    for (int64_t t = 0; t < T; t++) {
        double *o = out + t * L->D;
        memset(o, 0, sizeof(double) * (size_t)L->D);
        for (int j = 0; j < L->k; j++) {
            ref_ffn(L, &dc, sel[t * L->k + j], x + t * L->D, y);
            for (int d = 0; d < L->D; d++) o[d] += (double)wt[t * L->k + j] * y[d];
        }
        if (L->Fs) {
            ref_ffn(L, &dc, L->E, x + t * L->D, y);
            const double g = L->use_sgate ? (double)gsh[t] : 1.0;
            for (int d = 0; d < L->D; d++) o[d] += g * y[d];
        }
    }
    free(y);
    deq_cache_free(&dc, L->E + 1);
}

static double rel_l2(const float *a, const double *ref, size_t n) {
    double s = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        s += ref[i] * ref[i];
        e += (a[i] - ref[i]) * (a[i] - ref[i]);
    }
    return s > 0 ? sqrt(e / s) : sqrt(e);
}
static double rel_l2f(const float *a, const float *b, size_t n) {
    double s = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        s += (double)b[i] * b[i];
        e += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    }
    return s > 0 ? sqrt(e / s) : sqrt(e);
}

/* ---- the routing in double ------------------------------------------------------------------ */
/* Checks the GPU's choices and weights against a double-precision routing of the same logits
 * (computed here in double): a choice may differ only where the two experts' scores are within
 * 1e-5 of each other; weights of tokens whose choices agree within 1e-5 (relative to the largest). */
static void check_routing(const layer *L, const float *x, int64_t T, const int32_t *sel, const float *wt) {
    const int E = L->E, D = L->D, k = L->k;
    double *p = malloc(sizeof(double) * (size_t)E), *s = malloc(sizeof(double) * (size_t)E);
    int *taken = malloc(sizeof(int) * (size_t)E), *rs = malloc(sizeof(int) * (size_t)k);
    double *rw = malloc(sizeof(double) * (size_t)k);
    int differ = 0;
    for (int64_t t = 0; t < T; t++) {
        double mx = -INFINITY, sum = 0;
        for (int e = 0; e < E; e++) {
            double l = 0;
            for (int d = 0; d < D; d++) l += (double)x[t * D + d] * L->router[(size_t)e * D + d];
            p[e] = l;
            if (l > mx) mx = l;
        }
        for (int e = 0; e < E; e++) {
            if (!L->scoring) sum += p[e] = exp(p[e] - mx);
            else p[e] = 1.0 / (1.0 + exp(-p[e]));
        }
        if (!L->scoring)
            for (int e = 0; e < E; e++) p[e] /= sum;
        for (int e = 0; e < E; e++) s[e] = p[e] + (L->use_bias ? L->bias[e] : 0.0), taken[e] = 0;
        if (L->n_group > 1) mq_test_ref_groups(s, E, L->n_group, L->topk_group, taken);
        double wsum = 0;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || s[e] > s[best])) best = e;
            taken[best] = 1;
            rs[j] = best;
            rw[j] = p[best];
            wsum += rw[j];
        }
        int same = 1;
        for (int j = 0; j < k; j++) {
            const int g = sel[t * k + j];
            if (g < 0 || g >= E) FAIL("token %lld slot %d: expert %d out of range", (long long)t, j, g);
            if (g != rs[j]) {
                same = 0;
                if (!(fabs(s[g] - s[rs[j]]) <= 1e-5))
                    FAIL("token %lld slot %d: GPU chose expert %d (score %.9g), double routing %d (%.9g)",
                         (long long)t, j, g, s[g], rs[j], s[rs[j]]);
            }
        }
        if (!same) {
            differ++;
            continue;
        }
        double wmax = 0;
        for (int j = 0; j < k; j++) {
            rw[j] = (L->renorm && wsum != 0 ? rw[j] / wsum : rw[j]) * L->route_scale;
            if (fabs(rw[j]) > wmax) wmax = fabs(rw[j]);
        }
        for (int j = 0; j < k; j++)
            if (!(fabs(wt[t * k + j] - rw[j]) <= 1e-5 * (wmax > 1e-30 ? wmax : 1.0)))
                FAIL("token %lld slot %d: weight %.9g, double routing %.9g", (long long)t, j, wt[t * k + j], rw[j]);
    }
    if (differ) printf("    (%d tokens with near-tied choices)\n", differ);
    free(p);
    free(s);
    free(taken);
    free(rs);
    free(rw);
}

/* ---- the CPU kernels driven by the GPU's routing ------------------------------------------------ */
/* out [T, D]: for each token the CPU op's operations (quantize x, gate_up + SwiGLU, quantize, down,
 * the weighted sums in slot order, the shared expert last) with the given routing. */
static void cpu_expected(const moeq_moe_experts *w, const float *x, int64_t T, int k, const int32_t *sel,
                         const float *wt, const float *gsh, float *out) {
    const mq_moe_kernels *K = &mq_moe_kernels_ref;
    const int nv = w->scheme == MOEQ_MOE_NVFP4, B = nv ? 16 : 32, offs = nv ? 12 : 8;
    const int D = w->D, Fm = w->Fs > w->F ? w->Fs : w->F, ns = k + (w->Fs > 0);
    int8_t *q = malloc((size_t)D * 2), *mq = malloc((size_t)Fm * 2);
    float *qs = malloc(sizeof(float) * (size_t)(D / B)), *ms = malloc(sizeof(float) * (size_t)(Fm / B));
    int32_t *qc = malloc(sizeof(int32_t) * (size_t)(D / B)), *mc = malloc(sizeof(int32_t) * (size_t)(Fm / B));
    float *h = malloc(sizeof(float) * (size_t)Fm), *y = malloc(sizeof(float) * (size_t)(ns * D));
    const mq_qact xa = {q, q + D, qs, qc, D, B, offs}, ma = {mq, mq + Fm, ms, mc, Fm, B, offs};
    for (int64_t t = 0; t < T; t++) {
        K->quant_act(x + t * D, D, &xa, 0, 0);
        for (int j = 0; j < ns; j++) {
            const mq_pexpert *ex = &w->ex[j < k ? sel[t * k + j] : w->E];
            K->gemm(&ex->gate_up, 0, ex->ffn / 8, &xa, NULL, 0, 1, h, ex->ffn, 1, NULL);
            K->quant_act(h, ex->ffn, &ma, 0, 0);
            K->gemm(&ex->down, 0, D / 16, &ma, NULL, 0, 1, y + (size_t)j * D, D, 0, NULL);
        }
        float *o = out + t * D;
        for (int d = 0; d < D; d++) o[d] = wt[t * k] * y[d];
        for (int j = 1; j < k; j++)
            for (int d = 0; d < D; d++) o[d] = o[d] + wt[t * k + j] * y[(size_t)j * D + d];
        if (w->Fs > 0) {
            const float g = gsh ? gsh[t] : 1.0f;
            for (int d = 0; d < D; d++) o[d] = o[d] + g * y[(size_t)k * D + d];
        }
    }
    free(q);
    free(mq);
    free(qs);
    free(ms);
    free(qc);
    free(mc);
    free(h);
    free(y);
}

static int64_t count_diff_bits(const float *a, const float *b, size_t n, size_t *first) {
    int64_t c = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4) != 0) {
            if (!c) *first = i;
            c++;
        }
    return c;
}

/* ---- the GPU ---------------------------------------------------------------------------------------- */
static mq_gpu *g_gpu;

static mq_gpu *gpu_or_skip(void) {
    if (!mq_gpu_built()) SKIP("this build has no CUDA backend (configure with -DMOEQ_CUDA=ON)");
    if (!g_gpu && mq_gpu_open(0, &g_gpu) != MOEQ_OK) SKIP("no usable GPU: %s", moeq_last_error());
    return g_gpu;
}

/* The op's cases run on the GPU where there is one, else through the emulator (a CUDA build:
 * the same kernel source on the CPU, at smaller sizes); a build without CUDA skips them. */
static int g_emu;
static void gpu_or_emulator(void) {
    if (!mq_gpu_built()) SKIP("this build has no CUDA backend (configure with -DMOEQ_CUDA=ON)");
    if (!g_gpu && mq_gpu_open(0, &g_gpu) != MOEQ_OK) {
        if (!g_emu) printf("    no usable GPU (%s): the kernels run in the emulator\n", moeq_last_error());
        g_emu = 1;
    }
}

static float *make_x(int64_t T, int D, float scale) {
    float *x = malloc(sizeof(float) * (size_t)(T * D));
    for (int64_t i = 0; i < T * D; i++) x[i] = rnd_normal() * scale;
    return x;
}

static void poison(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = NAN;
}

static int all_finite(const float *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(p[i])) return 0;
    return 1;
}

typedef struct {
    double bf16_err, fp32_err, fp32_cpu_err;
    int64_t fp32_bits_differ;
} check_result;

/* One call of the op: on the GPU (m) or through the emulator (m NULL: the layer's descriptor). */
typedef struct {
    mq_gpu_moe *m;
    const moeq_moe_experts_desc *d;
    const moeq_moe_zero_points *zp;
    const moeq_moe_ffn_args *a;
} runner;

static void run_op(const runner *r, const float *x, int64_t T, int math, int tiles, float *out, int32_t *sel,
                   float *wt, float *gsh) {
    if (r->m) {
        mq_gpu_moe_force_tiles(r->m, tiles);
        ASSERT_OK(mq_gpu_moe_ffn(r->m, x, T, math, out));
        ASSERT_OK(mq_gpu_moe_last_routing(r->m, sel, wt, gsh));
        mq_gpu_moe_force_tiles(r->m, -1);
    } else {
        ASSERT_OK(mq_gpu_moe_emulate(r->d, r->zp, r->a, x, T, math, tiles, out, sel, wt, gsh));
    }
}

/* The whole check of one layer on x [T, D]: routing, fp32 mode against the CPU kernels (bits) and
 * the CPU op (or, asymmetric, the fp64 reference), bf16 mode against the fp64 reference, and the
 * bf16 mode's four tile shapes against each other (bits). emu: through the emulator, else on the
 * GPU. */
static check_result check_layer_on(const layer *L, const float *x, int64_t T, const char *label, int emu) {
    check_result res = {0, 0, 0, 0};
    moeq_moe_experts_desc d = desc_of(L);
    moeq_moe_zero_points zp = L->asym ? zeros_of(L) : (moeq_moe_zero_points){0};
    moeq_moe_ffn_args a = args_of(L, x, T);
    runner rn = {NULL, &d, L->asym ? &zp : NULL, &a};
    if (!emu) {
        mq_gpu *g = gpu_or_skip();
        moeq_status st = mq_gpu_moe_upload(g, &d, L->asym ? &zp : NULL, &a, &rn.m);
        if (st) {
            FAIL("%s: upload: %s: %s", label, moeq_status_name(st), moeq_last_error());
            return res;
        }
    }
    const size_t n = (size_t)(T * L->D), tk = (size_t)(T * L->k);
    float *o32 = malloc(sizeof(float) * n), *o16 = malloc(sizeof(float) * n), *want = malloc(sizeof(float) * n);
    float *ot = malloc(sizeof(float) * n);
    int32_t *sel = malloc(sizeof(int32_t) * tk), *sel2 = malloc(sizeof(int32_t) * tk);
    float *wt = malloc(sizeof(float) * tk), *wt2 = malloc(sizeof(float) * tk), *gsh = malloc(sizeof(float) * (size_t)T);
    double *ref = malloc(sizeof(double) * n);
    poison(o32, n);
    poison(o16, n);
    run_op(&rn, x, T, MQ_GPU_MOE_FP32, -1, o32, sel, wt, gsh);
    run_op(&rn, x, T, MQ_GPU_MOE_BF16, -1, o16, sel2, wt2, NULL);
    if (memcmp(sel, sel2, tk * 4) || memcmp(wt, wt2, tk * 4)) FAIL("%s: the routing differs between the modes", label);
    if (!all_finite(o32, n) || !all_finite(o16, n)) FAIL("%s: an output value is not finite (or was not written)", label);
    int shapes_same = 1;
    for (int c = 0; c < 4; c++) {   /* every tile shape: the same bits */
        poison(ot, n);
        run_op(&rn, x, T, MQ_GPU_MOE_BF16, c, ot, sel2, NULL, NULL);
        size_t first = 0;
        const int64_t nd = count_diff_bits(o16, ot, n, &first);
        if (nd) {
            shapes_same = 0;
            FAIL("%s: bf16 tile shape %d differs from the default in %lld values (first at %zu: %.9g vs %.9g)", label,
                 c, (long long)nd, first, ot[first], o16[first]);
        }
    }
    check_routing(L, x, T, sel, wt);
    ref_forward(L, x, T, sel, wt, L->use_sgate ? gsh : NULL, ref);
    res.bf16_err = rel_l2(o16, ref, n);
    res.fp32_err = rel_l2(o32, ref, n);
    if (!(res.bf16_err <= TOL_BF16)) FAIL("%s: bf16 mode: relative error %.3g > %.3g", label, res.bf16_err, TOL_BF16);
    if (L->asym) {
        if (!(res.fp32_err <= TOL_FP32_ASYM))
            FAIL("%s: fp32 mode (asymmetric): relative error %.3g > %.3g", label, res.fp32_err, TOL_FP32_ASYM);
    } else {
        moeq_moe_experts *w = NULL;
        ASSERT_OK(moeq_moe_experts_pack(&d, &w));
        cpu_expected(w, x, T, L->k, sel, wt, L->use_sgate ? gsh : NULL, want);
        size_t first = 0;
        res.fp32_bits_differ = count_diff_bits(o32, want, n, &first);
        if (res.fp32_bits_differ)
            FAIL("%s: fp32 mode differs from the CPU kernels in %lld of %zu values (first at %zu: %.9g vs %.9g)", label,
                 (long long)res.fp32_bits_differ, n, first, o32[first], want[first]);
        /* the CPU op with its own routing */
        moeq_set_force_ref(1);
        a.experts = w;
        ASSERT_OK(moeq_moe_ffn(&a, want, n));
        moeq_set_force_ref(0);
        res.fp32_cpu_err = rel_l2f(o32, want, n);
        if (!(res.fp32_cpu_err <= TOL_FP32_CPU))
            FAIL("%s: fp32 mode against the CPU op: relative difference %.3g > %.3g", label, res.fp32_cpu_err,
                 TOL_FP32_CPU);
        moeq_moe_experts_free(w);
    }
    printf("    %s%-42s T=%-5lld bf16 %.2e  fp32 %.2e  vs CPU op %.1e%s%s\n", emu ? "[emulated] " : "", label,
           (long long)T, res.bf16_err, res.fp32_err, res.fp32_cpu_err,
           L->asym ? " (asym: no CPU twin)" : ", CPU kernels: same bits", shapes_same ? ", 4 tile shapes: same bits" : "");
    free(o32);
    free(o16);
    free(want);
    free(ot);
    free(sel);
    free(sel2);
    free(wt);
    free(wt2);
    free(gsh);
    free(ref);
    mq_gpu_moe_free(rn.m);
    return res;
}

static check_result check_layer(const layer *L, const float *x, int64_t T, const char *label) {
    return check_layer_on(L, x, T, label, g_emu);
}

static const char *scheme_name(const layer *L, char *buf, size_t n) {
    if (L->nv) snprintf(buf, n, "nvfp4 %s", L->mult ? "multiplier" : "divisor");
    else snprintf(buf, n, "int4 g%d %s", L->G, L->asym ? "asym" : "sym");
    return buf;
}

/* ---- cases ------------------------------------------------------------------------------------------- */
/* Argument checks, everywhere: the descriptor's and the routing's errors name the argument. */
static void test_args_without_device(void) {
    seed(1);
    layer L = {.nv = 0, .G = 32, .E = 4, .D = 64, .F = 32, .k = 2, .route_scale = 1.0f};
    layer_random(&L, 1);
    moeq_moe_experts_desc d = desc_of(&L);
    float x[64] = {0};
    moeq_moe_ffn_args a = args_of(&L, x, 1);
    moeq_moe_cuda *c = NULL;
    a.top_k = 0;
    ASSERT_EQ_INT(MOEQ_E_ARG, moeq_moe_cuda_create(0, &d, NULL, &a, &c));
    ASSERT_TRUE(strstr(moeq_last_error(), "moe_ffn_cuda: top_k 0") != NULL);
    a.top_k = 2;
    a.n_group = 3;
    ASSERT_EQ_INT(MOEQ_E_ARG, moeq_moe_cuda_create(0, &d, NULL, &a, &c));
    ASSERT_TRUE(strstr(moeq_last_error(), "n_group 3") != NULL);
    a.n_group = 0;
    d.group_size = 48;
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, moeq_moe_cuda_create(0, &d, NULL, &a, &c));
    ASSERT_TRUE(strstr(moeq_last_error(), "group_size 48") != NULL);
    d = desc_of(&L);
    d.down.codes.shape[2] = 33;
    ASSERT_EQ_INT(MOEQ_E_SHAPE, moeq_moe_cuda_create(0, &d, NULL, &a, &c));
    ASSERT_TRUE(strstr(moeq_last_error(), "down.codes") != NULL);
    d = desc_of(&L);
    moeq_status st = moeq_moe_cuda_create(0, &d, NULL, &a, &c);
    if (!mq_gpu_built() || st != MOEQ_OK) {
        ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, st);
        printf("    without a GPU: %s\n", moeq_last_error());
    } else {
        /* with one: the op's own checks on x and out */
        float out[64];
        moeq_tensor_ref xr = tref(x, MOEQ_DT_F32, 2, 1, 63, 0);
        ASSERT_EQ_INT(MOEQ_E_SHAPE, moeq_moe_cuda_ffn(c, &xr, MOEQ_MOE_CUDA_BF16, out, 64));
        ASSERT_TRUE(strstr(moeq_last_error(), "moe_ffn_cuda: x: shape [1, 63]") != NULL);
        xr = tref(x, MOEQ_DT_F32, 2, 1, 64, 0);
        ASSERT_EQ_INT(MOEQ_E_ARG, moeq_moe_cuda_ffn(c, &xr, MOEQ_MOE_CUDA_BF16, out, 63));
        ASSERT_EQ_INT(MOEQ_E_ARG, moeq_moe_cuda_ffn(c, &xr, (moeq_moe_cuda_math)7, out, 64));
        xr = tref(NULL, MOEQ_DT_F32, 2, 0, 64, 0);
        ASSERT_OK(moeq_moe_cuda_ffn(c, &xr, MOEQ_MOE_CUDA_BF16, NULL, 0));
        moeq_moe_cuda_free(c);
    }
    layer_free(&L);
}

/* Bad values and zero points: the CPU packer's messages. */
static void test_value_errors(void) {
    mq_gpu *g = gpu_or_skip();
    seed(2);
    layer L = {.nv = 0, .G = 32, .asym = 1, .E = 3, .D = 64, .F = 64, .k = 2, .route_scale = 1.0f};
    layer_random(&L, 1);
    moeq_moe_experts_desc d = desc_of(&L);
    moeq_moe_zero_points zp = zeros_of(&L);
    float x[64] = {0};
    moeq_moe_ffn_args a = args_of(&L, x, 1);
    mq_gpu_moe *m = NULL;
    L.c[1][(size_t)2 * 64 * 64 + 5 * 64 + 7] = 16;
    ASSERT_EQ_INT(MOEQ_E_FORMAT, mq_gpu_moe_upload(g, &d, &zp, &a, &m));
    ASSERT_TRUE(strstr(moeq_last_error(), "down.codes: expert 2 row 5 col 7: code 16 > 15") != NULL);
    L.c[1][(size_t)2 * 64 * 64 + 5 * 64 + 7] = 3;
    ((float *)L.s[0])[9] = INFINITY;
    ASSERT_EQ_INT(MOEQ_E_NUMERIC, mq_gpu_moe_upload(g, &d, &zp, &a, &m));
    ASSERT_TRUE(strstr(moeq_last_error(), "gate_up.scales: expert 0 row 4 group 1: not finite") != NULL);
    ((float *)L.s[0])[9] = 0.01f;
    L.z[0][3] = 17;
    ASSERT_EQ_INT(MOEQ_E_FORMAT, mq_gpu_moe_upload(g, &d, &zp, &a, &m));
    ASSERT_TRUE(strstr(moeq_last_error(), "zero_points.gate_up") != NULL);
    L.z[0][3] = 1;
    zp.down.shape[2] = 3;
    ASSERT_EQ_INT(MOEQ_E_SHAPE, mq_gpu_moe_upload(g, &d, &zp, &a, &m));
    ASSERT_TRUE(strstr(moeq_last_error(), "zero_points.down") != NULL);
    zp = zeros_of(&L);
    ASSERT_OK(mq_gpu_moe_upload(g, &d, &zp, &a, &m));
    mq_gpu_moe_free(m);
    layer_free(&L);
    /* NVFP4: zero points refused, a NaN scale and a bad global scale named */
    seed(3);
    layer N = {.nv = 1, .G = 16, .E = 2, .D = 32, .F = 16, .k = 1, .route_scale = 1.0f};
    layer_random(&N, 1);
    d = desc_of(&N);
    a = args_of(&N, x, 1);
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gpu_moe_upload(g, &d, &zp, &a, &m));
    ((uint8_t *)N.s[1])[3] = 0x7f;
    ASSERT_EQ_INT(MOEQ_E_NUMERIC, mq_gpu_moe_upload(g, &d, NULL, &a, &m));
    ASSERT_TRUE(strstr(moeq_last_error(), "down.scales: expert 0 row 3 group 0: E4M3 NaN") != NULL);
    ((uint8_t *)N.s[1])[3] = 0x38;
    N.dn_g[1] = -1.0f;
    ASSERT_EQ_INT(MOEQ_E_NUMERIC, mq_gpu_moe_upload(g, &d, NULL, &a, &m));
    ASSERT_TRUE(strstr(moeq_last_error(), "down.global_scale: expert 1") != NULL);
    layer_free(&N);
}

/* Every weight of L's experts and shared expert (gate_up and down each) as dequant(ctx, expert,
 * which, w) decodes it against the test's own decoders (bf16 scales for INT4), bit for bit; prints
 * the count after tag and the scheme's name. */
static void check_decoded(const layer *L, const char *tag,
                          moeq_status (*dequant)(void *ctx, int e, int which, float *w), void *ctx) {
    int64_t bad = 0, total = 0;
    for (int e = 0; e <= L->E; e++)
        for (int which = 0; which < 2; which++) {
            const int sh = e == L->E, f = sh ? L->Fs : L->F, i = which + (sh ? 2 : 0);
            const int rows = which ? L->D : 2 * f, cols = which ? f : L->D, ng = cols / L->G;
            float *w = malloc(sizeof(float) * (size_t)rows * cols);
            ASSERT_OK(dequant(ctx, e, which, w));
            const size_t base = sh ? 0 : (size_t)e * rows * cols, sb = sh ? 0 : (size_t)e * rows * ng;
            for (int r = 0; r < rows; r++)
                for (int k = 0; k < cols; k++) {
                    const uint8_t c = L->c[i][base + (size_t)r * cols + k];
                    const size_t si = sb + (size_t)r * ng + k / L->G;
                    float want;
                    if (L->nv) {
                        want = (float)(mq_test_e2m1_dec(c) * mq_test_e4m3_dec(((const uint8_t *)L->s[i])[si]));
                    } else {
                        const int z = L->asym ? L->z[i][si] : 8;
                        const float sc = mq_bf16_to_f32(mq_f32_to_bf16(((const float *)L->s[i])[si]));
                        want = mq_bf16_to_f32(mq_f32_to_bf16(sc * (float)((int)c - z)));
                    }
                    const float got = w[(size_t)r * cols + k];
                    total++;
                    if (memcmp(&want, &got, 4) != 0 && !(want == 0 && got == 0)) {
                        if (!bad)
                            printf("    first difference: expert %d matrix %d row %d col %d: %.9g vs %.9g\n", e,
                                   which, r, k, got, want);
                        bad++;
                    }
                }
            free(w);
        }
    char nm[48];
    printf("    %s%-24s %lld weights decoded, %lld differ\n", tag, scheme_name(L, nm, sizeof nm), (long long)total,
           (long long)bad);
    ASSERT_EQ_INT(0, bad);
}

static moeq_status gpu_dequant(void *m, int e, int which, float *w) { return mq_gpu_moe_dequant(m, e, which, w); }

typedef struct {
    const moeq_moe_experts_desc *d;
    const moeq_moe_zero_points *zp;
    const moeq_moe_ffn_args *a;
} emu_dequant_ctx;

static moeq_status emu_dequant(void *ctx, int e, int which, float *w) {
    const emu_dequant_ctx *c = ctx;
    return mq_gpu_moe_emulate_dequant(c->d, c->zp, c->a, e, which, w);
}

/* The bf16 path's decoders: every weight of a few matrices, bit for bit. */
static void test_decoders(void) {
    mq_gpu *g = gpu_or_skip();
    const int cfg[][4] = {{0, 32, 0, 1}, {0, 64, 1, 0}, {0, 128, 0, 0}, {0, 32, 1, 1}, {1, 16, 0, 1}};
    for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++) {
        seed(10 + ci);
        layer L = {.nv = cfg[ci][0], .G = cfg[ci][1], .asym = cfg[ci][2], .E = 3, .D = 128 + cfg[ci][1],
                   .F = 2 * cfg[ci][1] + (cfg[ci][0] ? 16 : 0), .Fs = cfg[ci][1], .k = 1, .route_scale = 1.0f};
        L.D = L.nv ? 80 : L.D;
        layer_random(&L, cfg[ci][3]);
        moeq_moe_experts_desc d = desc_of(&L);
        moeq_moe_zero_points zp = L.asym ? zeros_of(&L) : (moeq_moe_zero_points){0};
        float x[256] = {0};
        moeq_moe_ffn_args a = args_of(&L, x, 1);
        mq_gpu_moe *m = NULL;
        ASSERT_OK(mq_gpu_moe_upload(g, &d, L.asym ? &zp : NULL, &a, &m));
        check_decoded(&L, "", gpu_dequant, m);
        mq_gpu_moe_free(m);
        layer_free(&L);
    }
}

/* Every format at the three tile shapes and both routing kernels. */
static void test_formats(void) {
    gpu_or_emulator();
    const int cfg[][5] = {/* nv, G, asym, mult, bf16 scales */
                          {0, 32, 0, 0, 1}, {0, 64, 0, 0, 0}, {0, 128, 0, 0, 1}, {0, 32, 1, 0, 1},
                          {0, 128, 1, 0, 0}, {1, 16, 0, 0, 0}, {1, 16, 0, 1, 0}};
    const int64_t Ts[] = {3, 20, 200};
    for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++) {
        if (g_emu && ci % 2) continue;   /* the emulator: every other format (test_emulated_op has the rest) */
        seed(100 + ci);
        const int G = cfg[ci][1];
        layer L = {.nv = cfg[ci][0], .G = G, .asym = cfg[ci][2], .mult = cfg[ci][3], .E = 8,
                   .D = G == 128 ? 384 : G == 64 ? 192 : 160, .F = G == 128 ? 256 : G == 64 ? 128 : 96, .k = 2,
                   .scoring = (int)(ci & 1), .renorm = 1, .use_bias = (int)(ci & 1), .route_scale = 1.0f};
        if (L.nv) L.D = 144, L.F = 80;
        if (g_emu) {   /* the emulator: smaller layers (one K chunk pad kept: 96 and 80 inputs) */
            L.D = G == 128 ? 256 : G == 64 ? 128 : L.nv ? 80 : 96;
            L.F = G == 128 ? 128 : G == 64 ? 64 : L.nv ? 48 : 64;
        }
        L.Fs = (ci % 3 == 0) ? L.F : (ci % 3 == 1 ? 2 * L.G : 0);
        L.use_sgate = L.Fs && (ci & 2);
        L.gs_pairs = L.nv && ci == 5;
        layer_random(&L, cfg[ci][4]);
        for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
            if (g_emu && ti == 1) continue;   /* the emulator: 3 and 40 tokens */
            const int64_t T = g_emu && Ts[ti] > 40 ? 40 : Ts[ti];
            float *x = make_x(T, L.D, 1.0f);
            char nm[48], lb[96];
            snprintf(lb, sizeof lb, "%s, %s", scheme_name(&L, nm, sizeof nm), L.Fs ? "shared" : "no shared");
            check_layer(&L, x, T, lb);
            free(x);
        }
        layer_free(&L);
    }
}

/* The four tile shapes of the bf16 path give the same bits (each output is one chain of
 * tensor-core steps over k, whatever rows and outputs share its tile); so do repeated runs. */
static void test_tile_shapes_same_bits(void) {
    mq_gpu *g = gpu_or_skip();
    for (int v = 0; v < 3; v++) {
        seed(150 + (uint64_t)v);
        layer L = {.nv = v == 2, .G = v == 2 ? 16 : v == 1 ? 128 : 32, .asym = v == 1, .E = 6, .D = v == 1 ? 256 : v == 0 ? 224 : 208,
                   .F = v == 1 ? 128 : 96, .Fs = v == 1 ? 0 : 64, .k = 3, .renorm = 1, .use_sgate = v == 0,
                   .route_scale = 1.0f};
        if (L.nv) L.Fs = 48;
        layer_random(&L, 1);
        const int64_t T = 77;
        float *x = make_x(T, L.D, 1.0f);
        moeq_moe_experts_desc d = desc_of(&L);
        moeq_moe_zero_points zp = L.asym ? zeros_of(&L) : (moeq_moe_zero_points){0};
        moeq_moe_ffn_args a = args_of(&L, x, T);
        mq_gpu_moe *m = NULL;
        ASSERT_OK(mq_gpu_moe_upload(g, &d, L.asym ? &zp : NULL, &a, &m));
        const size_t n = (size_t)(T * L.D);
        float *o[5];
        for (int c = 0; c < 5; c++) {
            o[c] = malloc(sizeof(float) * n);
            poison(o[c], n);
            mq_gpu_moe_force_tiles(m, c < 4 ? c : -1);
            ASSERT_OK(mq_gpu_moe_ffn(m, x, T, MQ_GPU_MOE_BF16, o[c]));
            ASSERT_TRUE(all_finite(o[c], n));
        }
        for (int c = 1; c < 5; c++) {
            size_t first = 0;
            const int64_t nd = count_diff_bits(o[0], o[c], n, &first);
            if (nd) FAIL("tile shape %d differs from shape 0 in %lld values (first at %zu: %.9g vs %.9g)", c,
                         (long long)nd, first, o[c][first], o[0][first]);
        }
        char nm[48];
        printf("    %-24s tile shapes 64x8, 128x32, 128x64, 128x128: the same bits\n", scheme_name(&L, nm, sizeof nm));
        for (int c = 0; c < 5; c++) free(o[c]);
        free(x);
        mq_gpu_moe_free(m);
        layer_free(&L);
    }
}

/* Experts with 0, 1, 7 and 4096 rows (k = 1, a gated shared expert beside), then NaN in one token. */
static void test_rows_0_1_7_4096(void) {
    gpu_or_emulator();
    for (int nv = 0; nv < 2; nv++) {
        seed(200 + (uint64_t)nv);
        layer L = {.nv = nv, .G = nv ? 16 : 32, .E = 4, .D = 128, .F = 64, .Fs = 64, .k = 1, .renorm = 1,
                   .use_sgate = 1, .route_scale = 1.0f};
        layer_random(&L, 1);
        memset(L.router, 0, sizeof(float) * (size_t)L.E * L.D);
        for (int e = 0; e < L.E; e++) L.router[(size_t)e * L.D + e] = 8.0f;
        const int64_t T = g_emu ? 8 + 120 : 4104;   /* the emulator: 120 rows for the big expert */
        float *x = make_x(T, L.D, 1.0f);
        int want[4] = {0, 0, 0, 0};
        for (int64_t t = 0; t < T; t++) {
            const int e = t < 1 ? 1 : t < 8 ? 2 : 3;
            for (int j = 0; j < 4; j++) x[t * L.D + j] = j == e ? 1.5f : -1.5f;
            want[e]++;
        }
        check_layer(&L, x, T, nv ? "nvfp4: rows 0 / 1 / 7 / many" : "int4 g32: rows 0 / 1 / 7 / many");
        if (g_emu) {   /* the routing's counts, then the rest needs the GPU */
            int32_t *sel = malloc(sizeof(int32_t) * (size_t)T);
            float *o = malloc(sizeof(float) * (size_t)(T * L.D));
            moeq_moe_experts_desc d = desc_of(&L);
            moeq_moe_ffn_args a = args_of(&L, x, T);
            ASSERT_OK(mq_gpu_moe_emulate(&d, NULL, &a, x, T, MQ_GPU_MOE_BF16, -1, o, sel, NULL, NULL));
            int got[4] = {0, 0, 0, 0};
            for (int64_t t = 0; t < T; t++) got[sel[t]]++;
            for (int e = 0; e < 4; e++) ASSERT_EQ_INT(want[e], got[e]);
            printf("    [emulated] %s: rows per expert %d %d %d %d as routed\n", nv ? "nvfp4" : "int4", got[0], got[1],
                   got[2], got[3]);
            free(sel);
            free(o);
            free(x);
            layer_free(&L);
            continue;
        }
        mq_gpu_moe *m = NULL;
        moeq_moe_experts_desc d = desc_of(&L);
        moeq_moe_ffn_args a = args_of(&L, x, T);
        ASSERT_OK(mq_gpu_moe_upload(gpu_or_skip(), &d, NULL, &a, &m));
        float *o = malloc(sizeof(float) * (size_t)(T * L.D)), *o2 = malloc(sizeof(float) * (size_t)(T * L.D));
        int32_t *sel = malloc(sizeof(int32_t) * (size_t)T);
        ASSERT_OK(mq_gpu_moe_ffn(m, x, T, MQ_GPU_MOE_BF16, o));
        ASSERT_OK(mq_gpu_moe_last_routing(m, sel, NULL, NULL));
        int got[4] = {0, 0, 0, 0};
        for (int64_t t = 0; t < T; t++) got[sel[t]]++;
        for (int e = 0; e < 4; e++) ASSERT_EQ_INT(want[e], got[e]);
        /* run to run: the same bits */
        ASSERT_OK(mq_gpu_moe_ffn(m, x, T, MQ_GPU_MOE_BF16, o2));
        ASSERT_TRUE(memcmp(o, o2, sizeof(float) * (size_t)(T * L.D)) == 0);
        /* a NaN in token 5's input: its row is NaN, every other row as before */
        x[5 * L.D + 77] = NAN;
        for (int mode = 0; mode < 2; mode++) {
            ASSERT_OK(mq_gpu_moe_ffn(m, x, T, mode, o2));
            if (mode == 0) {
                for (int64_t t = 0; t < T; t++)
                    if (t != 5 && memcmp(o + t * L.D, o2 + t * L.D, sizeof(float) * (size_t)L.D))
                        FAIL("row %lld changed with a NaN in row 5", (long long)t);
            }
            for (int dd = 0; dd < L.D; dd++) ASSERT_TRUE(isnan(o2[5 * L.D + dd]));
        }
        printf("    %s: rows per expert %d %d %d %d as routed; run to run identical; NaN stays in its row\n",
               nv ? "nvfp4" : "int4", got[0], got[1], got[2], got[3]);
        free(o);
        free(o2);
        free(sel);
        free(x);
        mq_gpu_moe_free(m);
        layer_free(&L);
    }
}

/* Random shapes, formats and routings. */
static void test_random_shapes(void) {
    gpu_or_emulator();
    const int64_t Ts[] = {1, 2, 3, 5, 8, 13, 31, 33, 64, 150, 300};
    for (int it = 0; it < (g_emu ? 8 : 22); it++) {
        seed(300 + (uint64_t)it);
        layer L;
        memset(&L, 0, sizeof L);
        const int sch = rnd_int(7);
        L.nv = sch >= 5;
        L.mult = sch == 6;
        L.G = L.nv ? 16 : (sch == 0 || sch == 3) ? 32 : sch == 1 ? 64 : 128;
        L.asym = sch == 3 || sch == 4;
        const int unit = L.G;
        L.D = unit * (1 + rnd_int(L.nv ? 20 : (384 / unit)));
        L.F = unit * (1 + rnd_int(L.nv ? 14 : (256 / unit)));
        L.E = 2 + rnd_int(23);
        L.k = 1 + rnd_int(L.E < 6 ? L.E : 6);
        L.Fs = rnd_int(3) == 0 ? unit * (1 + rnd_int(4)) : 0;
        L.scoring = rnd_int(2);
        L.renorm = rnd_int(2);
        L.use_bias = rnd_int(2);
        L.use_sgate = L.Fs && rnd_int(2);
        L.route_scale = rnd_int(2) ? 1.0f : 2.5f;
        L.gs_pairs = L.nv && rnd_int(2);
        if (L.E % 2 == 0 && L.E >= 4 && rnd_int(2)) {
            const int cands[] = {2, 4};
            L.n_group = cands[rnd_int(2)];
            if (L.E % L.n_group || L.E / L.n_group < 2) L.n_group = 2;
            L.topk_group = 1 + rnd_int(L.n_group);
            const int cap = L.topk_group * (L.E / L.n_group);
            if (L.k > cap) L.k = cap;
        }
        layer_random(&L, rnd_int(2));
        int64_t T = Ts[rnd_int((int)(sizeof Ts / sizeof Ts[0]))];
        if (g_emu) {   /* the emulator: smaller */
            T = T > 40 ? 40 : T;
            const int D = L.D > 128 ? (128 / unit) * unit : L.D, F = L.F > 128 ? (128 / unit) * unit : L.F;
            layer_free(&L);
            seed(300 + (uint64_t)it);
            /* a smaller shape, with options of its own */
            L.nv = sch >= 5;
            L.mult = sch == 6;
            L.G = unit;
            L.asym = sch == 3 || sch == 4;
            L.D = D, L.F = F;
            L.E = 2 + (it * 5) % 10;
            L.k = 1 + it % (L.E < 4 ? L.E : 4);
            L.Fs = it % 3 == 0 ? unit : 0;
            L.scoring = it & 1;
            L.renorm = (it >> 1) & 1;
            L.use_bias = (it >> 2) & 1;
            L.use_sgate = L.Fs && (it & 2);
            L.route_scale = it % 4 == 3 ? 2.5f : 1.0f;
            L.gs_pairs = L.nv && (it & 1);
            if (L.E % 4 == 0 && it % 2 == 0) {
                L.n_group = 2;
                L.topk_group = 1;
                if (L.k > L.E / 2) L.k = L.E / 2;
            }
            layer_random(&L, it & 1);
        }
        float *x = make_x(T, L.D, 1.0f);
        char nm[48], lb[128];
        snprintf(lb, sizeof lb, "%s E%d k%d D%d F%d Fs%d%s", scheme_name(&L, nm, sizeof nm), L.E, L.k, L.D, L.F, L.Fs,
                 L.n_group ? " grouped" : "");
        check_layer(&L, x, T, lb);
        free(x);
        layer_free(&L);
    }
}

/* ---- the fixture families' MoE layers, quantized here ------------------------------------------- */
static float *read_f32(const mq_st *st, const char *name, int64_t n) {
    const mq_tensor_view *t = mq_st_find(st, name);
    if (!t) {
        FAIL("tensor %s missing", name);
        return NULL;
    }
    if (t->numel != n) FAIL("tensor %s: %lld values, expected %lld", name, (long long)t->numel, (long long)n);
    float *v = malloc(sizeof(float) * (size_t)n);
    ASSERT_OK(mq_tensor_to_f32(t, v));
    return v;
}

/* Round-to-nearest of w [rows, cols] into L's arrays at matrix index i, rows from row0. */
static void rtn(layer *L, int i, const float *w, int64_t rows, int64_t cols, size_t row0, float nv_global) {
    const int G = L->G;
    const int64_t ng = cols / G;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t gi = 0; gi < ng; gi++) {
            const float *v = w + r * cols + gi * G;
            const size_t si = (row0 + (size_t)r) * (size_t)ng + (size_t)gi;
            uint8_t *c = L->c[i] + (row0 + (size_t)r) * (size_t)cols + gi * G;
            float mn = 0, mx = 0, amax = 0;
            for (int j = 0; j < G; j++) {
                mn = v[j] < mn ? v[j] : mn;
                mx = v[j] > mx ? v[j] : mx;
                amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
            }
            if (L->nv) {
                const uint8_t sc = mq_e4m3_encode(amax / 6.0f * nv_global);
                ((uint8_t *)L->s[i])[si] = sc;
                const float step = mq_e4m3_decode(sc) / nv_global;
                for (int j = 0; j < G; j++) c[j] = step > 0 ? mq_e2m1_encode(v[j] / step) : 0;
            } else if (L->asym) {
                float s = mq_bf16_to_f32(mq_f32_to_bf16((mx - mn) / 15.0f));
                if (!(s > 0)) s = 1e-6f;
                int z = (int)rintf(-mn / s);
                z = z < 0 ? 0 : z > 15 ? 15 : z;
                ((float *)L->s[i])[si] = s;
                L->z[i][si] = (uint8_t)z;
                for (int j = 0; j < G; j++) {
                    int q = (int)rintf(v[j] / s) + z;
                    c[j] = (uint8_t)(q < 0 ? 0 : q > 15 ? 15 : q);
                }
            } else {
                float s = mq_bf16_to_f32(mq_f32_to_bf16(amax / 7.0f));
                if (!(s > 0)) s = 1e-6f;
                ((float *)L->s[i])[si] = s;
                for (int j = 0; j < G; j++) {
                    int q = (int)rintf(v[j] / s) + 8;
                    c[j] = (uint8_t)(q < 0 ? 0 : q > 15 ? 15 : q);
                }
            }
        }
}

static float nv_global_of(const float *w, int64_t n) {
    float amax = 0;
    for (int64_t i = 0; i < n; i++) amax = fabsf(w[i]) > amax ? fabsf(w[i]) : amax;
    return amax > 0 ? 448.0f * 6.0f / amax : 1.0f;
}

typedef struct {
    const char *name, *dir;
    int layer, E, D, F, Fs, k, scoring, renorm, n_group, topk_group, bias, sgate;
    float route_scale;
    const char *prefix, *gate_name, *w_gate, *w_up, *w_down, *shared, *sgate_name, *bias_name;
} family;

static void run_family(const family *fm, int nv, int G, int asym) {
    const char *dir = strcmp(fm->dir, "olmoe-tiny") == 0 ? mq_test_model("olmoe-tiny") : mq_test_repo(fm->dir);
    char path[512];
    snprintf(path, sizeof path, "%s", dir);
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_dir(path, &st));
    layer L = {.nv = nv, .G = G, .asym = asym, .E = fm->E, .D = fm->D, .F = fm->F, .Fs = fm->Fs, .k = fm->k,
               .scoring = fm->scoring, .renorm = fm->renorm, .n_group = fm->n_group, .topk_group = fm->topk_group,
               .use_bias = fm->bias, .use_sgate = fm->sgate, .route_scale = fm->route_scale, .gs_pairs = nv};
    layer_alloc(&L);
    char nm[256];
    const int D = L.D;
    for (int e = 0; e <= L.E; e++) {
        if (e == L.E && !L.Fs) break;
        const int sh = e == L.E, f = sh ? L.Fs : L.F;
        char base[160];
        if (sh) snprintf(base, sizeof base, "model.layers.%d.%s.%s", fm->layer, fm->prefix, fm->shared);
        else snprintf(base, sizeof base, "model.layers.%d.%s.experts.%d", fm->layer, fm->prefix, e);
        snprintf(nm, sizeof nm, "%s.%s.weight", base, fm->w_gate);
        float *wg = read_f32(st, nm, (int64_t)f * D);
        snprintf(nm, sizeof nm, "%s.%s.weight", base, fm->w_up);
        float *wu = read_f32(st, nm, (int64_t)f * D);
        snprintf(nm, sizeof nm, "%s.%s.weight", base, fm->w_down);
        float *wd = read_f32(st, nm, (int64_t)D * f);
        if (!wg || !wu || !wd) return;
        const float gg = nv_global_of(wg, (int64_t)f * D), gu = nv_global_of(wu, (int64_t)f * D),
                    gd = nv_global_of(wd, (int64_t)D * f);
        const size_t r0 = sh ? 0 : (size_t)e * 2 * f, d0 = sh ? 0 : (size_t)e * D;
        rtn(&L, sh ? 2 : 0, wg, f, D, r0, gg);
        rtn(&L, sh ? 2 : 0, wu, f, D, r0 + (size_t)f, gu);
        rtn(&L, sh ? 3 : 1, wd, D, f, d0, gd);
        if (sh) {
            L.sgu_g[0] = gg, L.sgu_g[1] = gu, L.sdn_g = gd;
        } else {
            L.gu_g2[2 * e] = L.gu_g1[e] = gg, L.gu_g2[2 * e + 1] = gu, L.dn_g[e] = gd;
        }
        free(wg);
        free(wu);
        free(wd);
    }
    snprintf(nm, sizeof nm, "model.layers.%d.%s.%s", fm->layer, fm->prefix, fm->gate_name);
    float *r = read_f32(st, nm, (int64_t)L.E * D);
    memcpy(L.router, r, sizeof(float) * (size_t)L.E * D);
    free(r);
    if (fm->bias) {
        snprintf(nm, sizeof nm, "model.layers.%d.%s.%s", fm->layer, fm->prefix, fm->bias_name);
        float *b = read_f32(st, nm, L.E);
        memcpy(L.bias, b, sizeof(float) * (size_t)L.E);
        free(b);
    }
    if (fm->sgate) {
        snprintf(nm, sizeof nm, "model.layers.%d.%s.%s", fm->layer, fm->prefix, fm->sgate_name);
        float *s = read_f32(st, nm, D);
        memcpy(L.sgate, s, sizeof(float) * (size_t)D);
        free(s);
    }
    mq_st_close(st);
    seed(400);
    for (int ti = 0; ti < 2; ti++) {
        if (g_emu && ti && L.D > 64) break;   /* the emulator: OLMoE's wider layer at 4 tokens only */
        const int64_t T = ti ? (g_emu ? 33 : 61) : 4;
        float *x = make_x(T, D, 1.0f);
        char sn[48], lb[128];
        snprintf(lb, sizeof lb, "%s %s", fm->name, scheme_name(&L, sn, sizeof sn));
        check_layer(&L, x, T, lb);
        free(x);
    }
    layer_free(&L);
}

static void test_fixture_families(void) {
    gpu_or_emulator();
    const family fams[] = {
        {"mixtral", "tests/data/mixtral-tiny", 0, 4, 64, 96, 0, 2, 0, 1, 0, 0, 0, 0, 1.0f, "block_sparse_moe", "gate.weight",
         "w1", "w3", "w2", NULL, NULL, NULL},
        {"qwen3_moe", "tests/data/qwen3moe-tiny", 0, 6, 64, 48, 0, 2, 0, 1, 0, 0, 0, 0, 1.0f, "mlp", "gate.weight",
         "gate_proj", "up_proj", "down_proj", NULL, NULL, NULL},
        {"qwen2_moe", "tests/data/qwen2moe-dense-tiny", 0, 4, 64, 48, 64, 2, 0, 0, 0, 0, 0, 1, 1.0f, "mlp",
         "gate.weight", "gate_proj", "up_proj", "down_proj", "shared_expert", "shared_expert_gate.weight", NULL},
        {"deepseek_v3", "tests/data/deepseekv3-tiny", 1, 16, 64, 32, 32, 3, 1, 1, 4, 2, 1, 0, 2.5f, "mlp",
         "gate.weight", "gate_proj", "up_proj", "down_proj", "shared_experts", NULL, "gate.e_score_correction_bias"},
        {"olmoe", "olmoe-tiny", 0, 8, 256, 256, 0, 2, 0, 0, 0, 0, 0, 0, 1.0f, "mlp", "gate.weight", "gate_proj",
         "up_proj", "down_proj", NULL, NULL, NULL},
    };
    for (size_t i = 0; i < sizeof fams / sizeof fams[0]; i++) {
        const family *f = &fams[i];
        run_family(f, 1, 16, 0);
        if (g_emu) continue;   /* the emulator: NVFP4 (test_emulated_op has the INT4 kinds) */
        const int int4_ok = f->F % 32 == 0 && f->Fs % 32 == 0 && f->D % 32 == 0;
        if (int4_ok) run_family(f, 0, 32, 0);
        if (int4_ok && f->F % 128 == 0 && f->D % 128 == 0) run_family(f, 0, 128, 1);
        else if (int4_ok) run_family(f, 0, 32, 1);
    }
}

/* The public interface: the same bits as the backend's call; the benchmark's baseline agrees. */
static void test_public_api_and_baseline(void) {
    mq_gpu *g = gpu_or_skip();
    seed(500);
    layer L = {.nv = 1, .G = 16, .E = 16, .D = 256, .F = 128, .Fs = 128, .k = 4, .renorm = 1, .use_sgate = 1,
               .route_scale = 1.0f};
    layer_random(&L, 0);
    const int64_t T = 300;
    float *x = make_x(T, L.D, 1.0f);
    moeq_moe_experts_desc d = desc_of(&L);
    moeq_moe_ffn_args a = args_of(&L, x, T);
    moeq_moe_cuda *c = NULL;
    ASSERT_OK(moeq_moe_cuda_create(0, &d, NULL, &a, &c));
    ASSERT_TRUE(moeq_moe_cuda_bytes(c) > 0);
    const size_t n = (size_t)(T * L.D);
    float *o1 = malloc(sizeof(float) * n), *o2 = malloc(sizeof(float) * n), *o3 = malloc(sizeof(float) * n);
    ASSERT_OK(moeq_moe_cuda_ffn(c, &a.x, MOEQ_MOE_CUDA_BF16, o1, n));
    mq_gpu_moe *m = NULL;
    ASSERT_OK(mq_gpu_moe_upload(g, &d, NULL, &a, &m));
    ASSERT_OK(mq_gpu_moe_ffn(m, x, T, MQ_GPU_MOE_BF16, o2));
    ASSERT_TRUE(memcmp(o1, o2, sizeof(float) * n) == 0);
    ASSERT_OK(mq_gpu_moe_ffn_baseline(m, x, T, o3));
    int32_t *sel = malloc(sizeof(int32_t) * (size_t)(T * L.k));
    float *wt = malloc(sizeof(float) * (size_t)(T * L.k)), *gsh = malloc(sizeof(float) * (size_t)T);
    ASSERT_OK(mq_gpu_moe_last_routing(m, sel, wt, gsh));
    double *ref = malloc(sizeof(double) * n);
    ref_forward(&L, x, T, sel, wt, gsh, ref);
    const double e_op = rel_l2(o2, ref, n), e_base = rel_l2(o3, ref, n);
    printf("    public interface = backend bits; bf16 op %.2e, dequantize + cuBLAS %.2e against fp64\n", e_op, e_base);
    ASSERT_TRUE(e_base <= TOL_BF16);
    free(o1);
    free(o2);
    free(o3);
    free(sel);
    free(wt);
    free(gsh);
    free(ref);
    free(x);
    mq_gpu_moe_free(m);
    moeq_moe_cuda_free(c);
    layer_free(&L);
}

/* ---- the kernels through the emulator: every machine with a CUDA build, GPU or not ---------- */
static void emu_or_skip(void) {
    if (!mq_gpu_built()) SKIP("this build has no CUDA backend (the emulator compiles its kernels)");
}

/* The decoders through the emulated dequantization kernel. */
static void test_emulated_decoders(void) {
    emu_or_skip();
    const int cfg[][4] = {{0, 32, 0, 1}, {0, 64, 1, 0}, {1, 16, 0, 1}};
    for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++) {
        seed(610 + ci);
        layer L = {.nv = cfg[ci][0], .G = cfg[ci][1], .asym = cfg[ci][2], .E = 2, .D = cfg[ci][0] ? 80 : 2 * cfg[ci][1] + 32 * (cfg[ci][1] == 32),
                   .F = cfg[ci][1], .Fs = cfg[ci][1], .k = 1, .route_scale = 1.0f};
        layer_random(&L, cfg[ci][3]);
        moeq_moe_experts_desc d = desc_of(&L);
        moeq_moe_zero_points zp = L.asym ? zeros_of(&L) : (moeq_moe_zero_points){0};
        float x[256] = {0};
        moeq_moe_ffn_args a = args_of(&L, x, 1);
        emu_dequant_ctx ctx = {&d, L.asym ? &zp : NULL, &a};
        check_decoded(&L, "[emulated] ", emu_dequant, &ctx);
        layer_free(&L);
    }
}

/* The whole op through the emulator: each format, both routing kernels, shared experts, groups. */
static void test_emulated_op(void) {
    emu_or_skip();
    const int cfg[][8] = {/* nv, G, asym, mult, Fs, T, scoring, groups */
                          {0, 32, 0, 0, 1, 5, 0, 0},  {0, 64, 0, 0, 0, 40, 1, 0}, {0, 32, 1, 0, 1, 3, 1, 1},
                          {0, 128, 1, 0, 0, 9, 0, 0}, {1, 16, 0, 0, 1, 36, 0, 0}, {1, 16, 0, 1, 0, 7, 1, 1}};
    for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++) {
        seed(700 + ci);
        const int G = cfg[ci][1];
        layer L = {.nv = cfg[ci][0], .G = G, .asym = cfg[ci][2], .mult = cfg[ci][3], .E = 8,
                   .D = G == 128 ? 128 : G == 64 ? 128 : cfg[ci][0] ? 80 : 96, .F = G == 128 ? 128 : G == 64 ? 64 : cfg[ci][0] ? 48 : 64,
                   .k = 2, .scoring = cfg[ci][6], .renorm = 1, .use_bias = cfg[ci][6], .route_scale = cfg[ci][6] ? 2.5f : 1.0f};
        L.Fs = cfg[ci][4] ? G : 0;
        L.use_sgate = L.Fs && (ci & 1) == 0;
        L.gs_pairs = L.nv;
        if (cfg[ci][7]) L.n_group = 4, L.topk_group = 2;
        layer_random(&L, (int)(ci & 1));
        const int64_t T = cfg[ci][5];
        float *x = make_x(T, L.D, 1.0f);
        char nm[48], lb[96];
        snprintf(lb, sizeof lb, "%s%s%s", scheme_name(&L, nm, sizeof nm), L.Fs ? ", shared" : "",
                 L.n_group ? ", grouped" : "");
        check_layer_on(&L, x, T, lb, 1);
        free(x);
        layer_free(&L);
    }
}

static void test_close(void) {
    if (g_gpu) mq_gpu_close(g_gpu);
    g_gpu = NULL;
}

TEST_MAIN(T(test_args_without_device), T(test_emulated_decoders), T(test_emulated_op), T(test_value_errors), T(test_decoders), T(test_tile_shapes_same_bits),
          T(test_formats),
          T(test_rows_0_1_7_4096), T(test_random_shapes), T(test_fixture_families), T(test_public_api_and_baseline),
          T(test_close))
