/*
 * moeq bench moe-ffn --device cuda: the GPU MoE op (backend/gpu.h's mq_gpu_moe) on random INT4 /
 * NVFP4 experts of Qwen3-30B-A3B's and OLMoE-1B-7B's expert shapes (or --experts/--topk/--hidden/
 * --ffn), the input and output in device memory, varied routing (a pool of inputs, two copies of
 * the experts as two layers, so a call's experts stream from device memory as in decoding).
 * Device time per call: the median over replays of a CUDA graph of many calls. In the same run:
 *  - the card's copy bandwidth (a 1 GiB device-to-device copy, bytes read plus written);
 *  - cuBLAS's bf16 GEMM rate for the same dense FLOPs: [T*k, D] x [D, 2F] and [T*k, F] x [F, D];
 *  - for prefill, the same layer dequantized to bf16 and run through cuBLAS (grouped GEMMs).
 * Decode rows (T <= 64) report the bytes of the distinct experts a call reads per second against
 * the copy bandwidth; prefill rows the FLOP rate (2*T*k*3*F*D) against cuBLAS's.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/gpu.h"
#include "bench.h"
#include "cli.h"
#include "core/core.h"

static uint64_t g_s = 0x9E3779B97F4A7C15ull;
static inline uint64_t rnd64(void) {
    g_s ^= g_s << 13;
    g_s ^= g_s >> 7;
    g_s ^= g_s << 17;
    return g_s;
}
static float rnd_normal(void) {
    float u1 = ((float)(rnd64() >> 40) + 0.5f) * 0x1p-24f, u2 = (float)(rnd64() >> 40) * 0x1p-24f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

typedef struct {
    const char *name;
    int64_t E, k, D, F;
    int renorm;
} shape;

static moeq_tensor_ref ref(const void *p, moeq_dtype dt, int nd, int64_t a, int64_t b, int64_t c, size_t es) {
    moeq_tensor_ref r = {p, dt, nd, {a, b, c, 0}, 0};
    r.nbytes = (size_t)a * (size_t)(nd > 1 ? b : 1) * (size_t)(nd > 2 ? c : 1) * es;
    return r;
}

/* Random canonical experts (codes uniform, INT4 scales bf16-exact, NVFP4 E4M3 scales ~1..8). */
typedef struct {
    uint8_t *guc, *dnc;
    void *gus, *dns;
    float *gg, *dg;
} host_experts;

static void host_free(host_experts *h) {
    free(h->guc), free(h->dnc), free(h->gus), free(h->dns), free(h->gg), free(h->dg);
    memset(h, 0, sizeof *h);
}

static moeq_status make_desc(const shape *s, int nv, int64_t G, host_experts *h, moeq_moe_experts_desc *d) {
    const size_t E = (size_t)s->E, D = (size_t)s->D, F = (size_t)s->F;
    const size_t ngu = E * 2 * F * D, ndn = E * D * F;
    h->guc = malloc(ngu);
    h->dnc = malloc(ndn);
    h->gus = malloc(ngu / (size_t)G * (nv ? 1 : 4));
    h->dns = malloc(ndn / (size_t)G * (nv ? 1 : 4));
    h->gg = malloc(E * 4);
    h->dg = malloc(E * 4);
    if (!h->guc || !h->dnc || !h->gus || !h->dns || !h->gg || !h->dg)
        return mq_err(MOEQ_E_NOMEM, "bench moe-ffn: out of memory for the random experts");
    uint8_t *cs[2] = {h->guc, h->dnc};
    const size_t nc[2] = {ngu, ndn};
    for (int m = 0; m < 2; m++)
        for (size_t i = 0; i < nc[m]; i += 16) {
            const uint64_t r = rnd64();
            for (int j = 0; j < 16 && i + (size_t)j < nc[m]; j++) cs[m][i + (size_t)j] = (uint8_t)((r >> (4 * j)) & 15);
        }
    void *ss[2] = {h->gus, h->dns};
    for (int m = 0; m < 2; m++)
        for (size_t i = 0; i < nc[m] / (size_t)G; i++) {
            if (nv) ((uint8_t *)ss[m])[i] = (uint8_t)(40 + rnd64() % 40);
            else
                ((float *)ss[m])[i] = mq_bf16_to_f32(mq_f32_to_bf16(0.01f + 0.01f * (float)(rnd64() >> 40) * 0x1p-24f));
        }
    for (size_t e = 0; e < E; e++) h->gg[e] = h->dg[e] = 100.0f;
    memset(d, 0, sizeof *d);
    const moeq_dtype sdt = nv ? MOEQ_DT_F8_E4M3 : MOEQ_DT_F32;
    const size_t es = nv ? 1 : 4;
    d->scheme = nv ? MOEQ_MOE_NVFP4 : MOEQ_MOE_INT4;
    d->group_size = (int32_t)G;
    d->n_experts = (int32_t)E;
    d->hidden = (int32_t)D;
    d->ffn = (int32_t)F;
    d->gate_up.codes = ref(h->guc, MOEQ_DT_U8, 3, s->E, 2 * s->F, s->D, 1);
    d->gate_up.scales = ref(h->gus, sdt, 3, s->E, 2 * s->F, s->D / G, es);
    d->down.codes = ref(h->dnc, MOEQ_DT_U8, 3, s->E, s->D, s->F, 1);
    d->down.scales = ref(h->dns, sdt, 3, s->E, s->D, s->F / G, es);
    if (nv) {
        d->gate_up.global_scale = ref(h->gg, MOEQ_DT_F32, 1, s->E, 0, 0, 4);
        d->down.global_scale = ref(h->dg, MOEQ_DT_F32, 1, s->E, 0, 0, 4);
    }
    return MOEQ_OK;
}

/* Distinct experts the top-k of x [T, D] picks (the largest logits: softmax keeps the order). */
static int64_t distinct(const shape *s, const float *router, const float *x, int64_t T, uint8_t *used, float *lg) {
    memset(used, 0, (size_t)s->E);
    mq_gemm_nt(T, s->E, s->D, 1.0f, x, s->D, router, s->D, 0.0f, lg, s->E);
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++) {
        float *l = lg + t * s->E;
        for (int64_t j = 0; j < s->k; j++) {
            int64_t b = 0;
            for (int64_t e = 1; e < s->E; e++)
                if (l[e] > l[b]) b = e;
            n += !used[b];
            used[b] = 1;
            l[b] = -INFINITY;
        }
    }
    return n;
}

static int parse_list(const char *s, int64_t *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *end;
        long long v = strtoll(s, &end, 10);
        if (end == s || v < 1 || v > 1 << 20) return -1;
        out[n++] = v;
        s = end;
        if (*s == ',') s++;
        else if (*s) return -1;
    }
    return n;
}

#define FAILGPU(st)                                                                                \
    do {                                                                                           \
        rc = cli_fail("bench moe-ffn", st);                                                        \
        goto done;                                                                                 \
    } while (0)

int bench_moe_ffn_cuda(const bench_cuda_opts *o) {
    int64_t toks[32];
    int ntok = parse_list(o->tokens ? o->tokens : (o->quick ? "1,8,512" : "1,2,4,8,2048,4096,8192"), toks, 32);
    if (ntok <= 0) return cli_usage_error("bench moe-ffn", "--tokens expects a list like 1,8,2048");
    shape shapes[2];
    int nsh = 0;
    if (o->shape_given) {
        shapes[nsh++] = (shape){"custom", o->E, o->k, o->D, o->F, 1};
    } else {
        if (!strcmp(o->preset, "qwen3-30b-a3b") || !strcmp(o->preset, "both"))
            shapes[nsh++] = (shape){"Qwen3-30B-A3B", 128, 8, 2048, 768, 1};
        if (!strcmp(o->preset, "olmoe-1b-7b") || !strcmp(o->preset, "both"))
            shapes[nsh++] = (shape){"OLMoE-1B-7B", 64, 8, 2048, 1024, 0};
    }
    if (o->quick)
        for (int i = 0; i < nsh; i++) shapes[i].E = shapes[i].E > 16 ? 16 : shapes[i].E, shapes[i].D = 512, shapes[i].F = 256;
    int schemes[2], nsc = 0;
    if (strcmp(o->scheme, "nvfp4")) schemes[nsc++] = 0;
    if (strcmp(o->scheme, "int4")) schemes[nsc++] = 1;
    const int64_t g4 = o->group ? o->group : 128;

    int rc = CLI_OK;
    mq_gpu *g = NULL;
    mq_gpu_moe *layers[2] = {NULL, NULL};
    mq_gpu_buf *xb = NULL, *ob = NULL;
    float *router = NULL, *xs = NULL, *lg = NULL;
    uint8_t *used = NULL;
    host_experts h;
    memset(&h, 0, sizeof h);
    moeq_status st = mq_gpu_open(o->device, &g);
    if (st) FAILGPU(st);
    mq_gpu_info info;
    mq_gpu_get_info(g, &info);
    double sgemm = 0, bw = 0;
    if ((st = mq_gpu_measure(g, &sgemm, &bw))) FAILGPU(st);
    printf("device: %s, %d SMs; copy bandwidth %.0f GB/s (1 GiB device-to-device, read + write); "
           "fp32 sgemm %.1f TFLOP/s\n", info.name, info.sm_count, bw, sgemm * 1e-3);
    fflush(stdout);
    for (int si = 0; si < nsh; si++) {
        const shape *s = &shapes[si];
        for (int ci = 0; ci < nsc; ci++) {
            const int nv = schemes[ci];
            const int64_t G = nv ? 16 : g4;
            if (s->D % G || s->F % G) {
                rc = cli_usage_error("bench moe-ffn", "--group %lld does not divide hidden %lld and ffn %lld",
                                     (long long)G, (long long)s->D, (long long)s->F);
                goto done;
            }
            moeq_moe_experts_desc d;
            if ((st = make_desc(s, nv, G, &h, &d))) FAILGPU(st);
            free(router);
            router = malloc(sizeof(float) * (size_t)(s->E * s->D));
            if (!router) FAILGPU(mq_err(MOEQ_E_NOMEM, "out of memory"));
            for (int64_t i = 0; i < s->E * s->D; i++) router[i] = rnd_normal() * 0.02f;
            moeq_moe_ffn_args a;
            memset(&a, 0, sizeof a);
            a.router = ref(router, MOEQ_DT_F32, 2, s->E, s->D, 0, 4);
            a.top_k = (int32_t)s->k;
            a.scoring = MOEQ_MOE_SOFTMAX;
            a.renormalize = s->renorm;
            a.route_scale = 1.0f;
            double t0 = mq_now();
            for (int l = 0; l < 2; l++)
                if ((st = mq_gpu_moe_upload(g, &d, NULL, &a, &layers[l]))) FAILGPU(st);
            host_free(&h);
            const double ex_bytes = (double)mq_gpu_moe_bytes(layers[0]) / (double)s->E;
            printf("\n%s experts (E=%lld, top-%lld, %lld -> %lld), %s: %.1f MB on the device per layer "
                   "(%.3f bits/weight), 2 layers, uploaded in %.1f s\n",
                   s->name, (long long)s->E, (long long)s->k, (long long)s->D, (long long)s->F,
                   nv ? "nvfp4" : (G == 32 ? "int4 g32" : G == 64 ? "int4 g64" : "int4 g128"),
                   (double)mq_gpu_moe_bytes(layers[0]) * 1e-6, ex_bytes * 8.0 / (3.0 * (double)s->D * (double)s->F),
                   (mq_now() - t0) / 2);
            fflush(stdout);
            for (int ti = 0; ti < ntok; ti++) {
                const int64_t T = toks[ti];
                const int decode = T <= 64;
                const int nx = decode ? 16 : 2;
                const size_t n = (size_t)(nx * T * s->D);
                free(xs);
                xs = malloc(sizeof(float) * n);
                if (!xs) FAILGPU(mq_err(MOEQ_E_NOMEM, "out of memory"));
                for (size_t i = 0; i < n; i++) xs[i] = rnd_normal();
                mq_gpu_buf_free(xb);
                mq_gpu_buf_free(ob);
                xb = ob = NULL;
                if ((st = mq_gpu_buf_new(g, (int64_t)n, &xb)) || (st = mq_gpu_buf_write(xb, 0, (int64_t)n, xs)) ||
                    (st = mq_gpu_buf_new(g, T * s->D, &ob)))
                    FAILGPU(st);
                double ms = 0, alt[4] = {0, 0, 0, 0};
                if ((st = mq_gpu_moe_time(layers, 2, xb, nx, T, ob, MQ_GPU_MOE_BF16, decode ? 200 : 6, 5, &ms)))
                    FAILGPU(st);
                /* the other tile shapes of this regime, for the record */
                for (int c = decode ? 0 : 1; c < (decode ? 2 : 4); c++) {
                    for (int l = 0; l < 2; l++) mq_gpu_moe_force_tiles(layers[l], c);
                    st = mq_gpu_moe_time(layers, 2, xb, nx, T, ob, MQ_GPU_MOE_BF16, decode ? 200 : 6, 3, &alt[c]);
                    for (int l = 0; l < 2; l++) mq_gpu_moe_force_tiles(layers[l], -1);
                    if (st) FAILGPU(st);
                }
                char alts[160];
                int ao = snprintf(alts, sizeof alts, "  [tiles:");
                const char *tn[4] = {"64x8", "128x32", "128x64", "128x128"};
                for (int c = 0; c < 4 && ao < (int)sizeof alts; c++)
                    if (alt[c] > 0) ao += snprintf(alts + ao, sizeof alts - (size_t)ao, " %s %.4f ms", tn[c], alt[c]);
                if (ao < (int)sizeof alts) snprintf(alts + ao, sizeof alts - (size_t)ao, "]");
                const double flops = 2.0 * (double)T * (double)s->k * 3.0 * (double)s->F * (double)s->D;
                if (decode) {
                    free(lg);
                    free(used);
                    lg = malloc(sizeof(float) * (size_t)(T * s->E));
                    used = malloc((size_t)s->E);
                    if (!lg || !used) FAILGPU(mq_err(MOEQ_E_NOMEM, "out of memory"));
                    double dist = 0;
                    for (int i = 0; i < nx; i++) dist += (double)distinct(s, router, xs + (size_t)(i * T * s->D), T, used, lg);
                    dist /= nx;
                    const double gbs = dist * ex_bytes / (ms * 1e-3) * 1e-9;
                    printf("  tokens %5lld  %8.4f ms  %5.1f distinct experts  weights %7.1f GB/s = %.2f x copy bandwidth"
                           "  (%.1f TFLOP/s)%s\n",
                           (long long)T, ms, dist, gbs, gbs / bw, flops / (ms * 1e-3) * 1e-12, alts);
                } else {
                    const int64_t M[2] = {T * s->k, T * s->k}, N[2] = {2 * s->F, s->D}, K[2] = {s->D, s->F};
                    double cub = 0, base = 0;
                    if ((st = mq_gpu_gemm_bf16_time(g, 2, M, N, K, &cub))) FAILGPU(st);
                    if ((st = mq_gpu_moe_time(layers, 2, xb, nx, T, ob, MQ_GPU_MOE_BASELINE, 2, 3, &base))) FAILGPU(st);
                    const double tf = flops / (ms * 1e-3) * 1e-12, tc = flops / (cub * 1e-3) * 1e-12;
                    const double tb = flops / (base * 1e-3) * 1e-12;
                    printf("  tokens %5lld  %8.4f ms  %6.1f TFLOP/s = %.2f x cuBLAS bf16 (%.1f TFLOP/s, %.3f ms)  "
                           "dequantize + cuBLAS: %.3f ms, %.1f TFLOP/s (ours %.2f x faster)%s\n",
                           (long long)T, ms, tf, tf / tc, tc, cub, base, tb, base / ms, alts);
                }
                fflush(stdout);
            }
            for (int l = 0; l < 2; l++) {
                mq_gpu_moe_free(layers[l]);
                layers[l] = NULL;
            }
        }
    }
done:
    host_free(&h);
    for (int l = 0; l < 2; l++) mq_gpu_moe_free(layers[l]);
    mq_gpu_buf_free(xb);
    mq_gpu_buf_free(ob);
    free(router);
    free(xs);
    free(lg);
    free(used);
    mq_gpu_close(g);
    return rc;
}
