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

static uint64_t g_s = 0x9E3779B97F4A7C15ull;   /* bench_rnd64's state: the same inputs every run */

typedef struct {
    const char *name;
    int64_t E, k, D, F;
    int renorm;
} shape;

#define FAILGPU(st)                                                                                \
    do {                                                                                           \
        rc = cli_fail("bench moe-ffn", st);                                                        \
        goto done;                                                                                 \
    } while (0)

int bench_moe_ffn_cuda(const bench_cuda_opts *o) {
    int64_t toks[32];
    int ntok = bench_parse_tokens(o->tokens ? o->tokens : (o->quick ? "1,8,512" : "1,2,4,8,2048,4096,8192"), toks, 32);
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
    bench_experts h;
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
            if ((st = bench_random_experts(s->E, s->D, s->F, G, nv, &g_s, &h, &d))) FAILGPU(st);
            free(router);
            router = malloc(sizeof(float) * (size_t)(s->E * s->D));
            if (!router) FAILGPU(mq_err(MOEQ_E_NOMEM, "out of memory"));
            for (int64_t i = 0; i < s->E * s->D; i++) router[i] = bench_rnd_normal(&g_s) * 0.02f;
            moeq_moe_ffn_args a;
            memset(&a, 0, sizeof a);
            a.router = bench_ref(router, MOEQ_DT_F32, 2, s->E, s->D, 0, 4);
            a.top_k = (int32_t)s->k;
            a.scoring = MOEQ_MOE_SOFTMAX;
            a.renormalize = s->renorm;
            a.route_scale = 1.0f;
            double t0 = mq_now();
            for (int l = 0; l < 2; l++)
                if ((st = mq_gpu_moe_upload(g, &d, NULL, &a, &layers[l]))) FAILGPU(st);
            bench_experts_free(&h);
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
                for (size_t i = 0; i < n; i++) xs[i] = bench_rnd_normal(&g_s);
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
                    for (int i = 0; i < nx; i++) dist += (double)bench_distinct_experts(s->E, s->k, s->D, router, xs + (size_t)(i * T * s->D), T, used, lg);
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
    bench_experts_free(&h);
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
