/*
 * moeq bench moe-ffn: speed of the quantized MoE feed-forward op (moeq_moe_ffn) on random INT4 or
 * NVFP4 experts, per token count, in two routings:
 *   fixed:  the same input every iteration, so the same experts (as llama.cpp's test-backend-ops
 *           MUL_MAT_ID perf case, where the chosen experts' weights stay in cache);
 *   varied: a different input every iteration from a pool, so different experts, whose weights
 *           stream from memory as in real decoding across layers (all E experts are allocated).
 * GFLOP/s counts 2*T*k*(2F*D + D*F) (routed experts only); GB/s counts the packed bytes of the
 * distinct experts each call uses. The same run measures this machine's sgemm rate (OpenBLAS) and
 * streaming read bandwidth, and prints our figures as ratios of both. On a shared host the read
 * bandwidth a VM gets changes from second to second (here 38 or 67 GB/s, with other tenants'
 * traffic), so it is measured again right after each row and the row's bandwidth ratio uses the
 * larger of the measurements just before and just after it (the conservative choice).
 * On a host whose last-level cache holds much of that (the GPU machine's Xeon has 300 MiB of L3),
 * both would measure the cache: the bandwidth probes then read at least 4x the L3 size, and
 * varied routing cycles through as many copies of the experts ("layers", as decoding does) as
 * make 4x the L3 size, so that its weights stream from memory there too (the machine line says
 * how many; one copy where the experts are 4x the L3 already, as on the development host).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "commands.h"
#include "cli.h"
#include "core/core.h"
#include "backend/gpu.h"
#include "kernels/moe_ffn.h"

typedef struct {
    int64_t E, k, D, F, group, threads;
    int nvfp4;
} shape;

static uint64_t g_s = 88172645463325252ull;   /* bench_rnd64's state: the same inputs every run */

/* Random packed experts of the given shape (bench_random_experts). */
static moeq_status make_experts(const shape *s, moeq_moe_experts **out) {
    bench_experts h;
    moeq_moe_experts_desc d;
    moeq_status st = bench_random_experts(s->E, s->D, s->F, s->group, s->nvfp4, &g_s, &h, &d);
    if (!st) st = moeq_moe_experts_pack(&d, out);
    bench_experts_free(&h);
    return st;
}

/* Bytes of the last-level cache (L3; 0 where the C library does not say). */
typedef struct {
    int64_t tokens;
    const char *routing;
    double ms, gflops, gbps, cpu_gflops;
    double bw_near;   /* read bandwidth measured around this row (GB/s) */
} result;

/* Process CPU seconds (all threads): on a shared machine the wall-clock rate also measures the
 * other jobs, so the bench also reports flops per CPU-second times the thread count. */
static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double load_average(void) {
    double l = -1.0;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = -1.0;
        fclose(f);
    }
    return l;
}

int bench_moe_ffn(int argc, char **argv) {
    int64_t E = 128, k = 8, D = 2048, F = 768, threads = 2, group = 0;
    double seconds = 1.0;
    const char *tokens_s = NULL, *scheme = NULL, *routing_s = "both", *device_s = "cpu";
    const char *preset = "both";
    bool json = false, quick = false, seen_shape[4] = {false, false, false, false};
    const cli_opt opts[] = {
        {"--device", OPT_STRING, &device_s, "DEV", "cpu (default) or cuda[:N]: the GPU op (bench_moe_ffn_cuda.c)", NULL, 0, -1, NULL},
        {"--preset", OPT_CHOICE, &preset, NULL, "cuda: expert shapes (default both; --experts etc. override)",
         "qwen3-30b-a3b|olmoe-1b-7b|both", 0, -1, NULL},
        {"--experts", OPT_INT, &E, "E", "number of routed experts (default 128)", NULL, 1, 4096, &seen_shape[0]},
        {"--topk", OPT_INT, &k, "K", "experts per token (default 8)", NULL, 1, 4096, &seen_shape[1]},
        {"--hidden", OPT_INT, &D, "D", "hidden size (default 2048)", NULL, 16, 1 << 16, &seen_shape[2]},
        {"--ffn", OPT_INT, &F, "F", "expert intermediate size (default 768)", NULL, 16, 1 << 16, &seen_shape[3]},
        {"--tokens", OPT_STRING, &tokens_s, "LIST", "token counts, comma separated (default 1,16,512; cuda "
         "1,2,4,8,2048,4096,8192)", NULL, 0, -1, NULL},
        {"--scheme", OPT_CHOICE, &scheme, NULL, "weight scheme (default int4; cuda both)", "int4|nvfp4|both", 0, -1, NULL},
        {"--group", OPT_INT, &group, "G", "INT4 group size (default 32; cuda 128)", NULL, 32, 1 << 16, NULL},
        {"--routing", OPT_CHOICE, &routing_s, NULL, "routings to run (default both)", "fixed|varied|both", 0, -1, NULL},
        {"--threads", OPT_INT, &threads, "N", "threads (default 2)", NULL, 1, 1024, NULL},
        {"--seconds", OPT_DOUBLE, &seconds, "S", "minimum time per measurement (default 1)", NULL, 0, -1, NULL},
        {"--json", OPT_FLAG, &json, NULL, "print one JSON object on stdout", NULL, 0, -1, NULL},
        {"--quick", OPT_FLAG, &quick, NULL, "short machine measurements (smoke tests)", NULL, 0, -1, NULL},
    };
    const cli_command cmd = {"bench moe-ffn", "[options]",
                             "Speed of the quantized MoE FFN op: GFLOP/s and GB/s of weights read, "
                             "fixed and varied routing, against this machine's sgemm rate and read "
                             "bandwidth.",
                             opts, (int)(sizeof opts / sizeof opts[0]), 0, 0, NULL};
    const char *pos[1];
    int npos;
    int rc = cli_parse(&cmd, argc, argv, pos, &npos);
    if (rc >= 0) return rc;
    int dev = -1;
    if (mq_gpu_parse_device(device_s, &dev) != MOEQ_OK) return cli_usage_error(cmd.name, "%s", moeq_last_error());
    if (dev >= 0) {
        if (k > E) return cli_usage_error(cmd.name, "--topk %lld > --experts %lld", (long long)k, (long long)E);
        if (json) return cli_usage_error(cmd.name, "--json is for the CPU op");
        bench_cuda_opts co = {dev, E, k, D, F, seen_shape[0] || seen_shape[1] || seen_shape[2] || seen_shape[3],
                              preset, tokens_s, scheme ? scheme : "both", group, quick};
        cli_install_sigint();
        return bench_moe_ffn_cuda(&co);
    }
    if (!tokens_s) tokens_s = "1,16,512";
    if (!scheme) scheme = "int4";
    if (!strcmp(scheme, "both")) return cli_usage_error(cmd.name, "--scheme both is for --device cuda");
    int64_t toks[32];
    int ntok = bench_parse_tokens(tokens_s, toks, 32);
    if (ntok <= 0) return cli_usage_error(cmd.name, "--tokens expects a list like 1,16,512");
    if (k > E) return cli_usage_error(cmd.name, "--topk %lld > --experts %lld", (long long)k, (long long)E);
    shape s = {E, k, D, F, 0, threads, strcmp(scheme, "nvfp4") == 0};
    s.group = s.nvfp4 ? 16 : (group ? group : 32);
    if (s.nvfp4 && group) return cli_usage_error(cmd.name, "--group applies to int4 only");
    moeq_set_threads((int)threads);
    cli_install_sigint();

    const size_t llc = cli_llc_bytes();
    const size_t probe0 = quick ? (size_t)64 << 20 : (size_t)1 << 30 > 4 * llc ? (size_t)1 << 30 : 4 * llc;
    const size_t probe = quick ? (size_t)64 << 20 : (size_t)256 << 20 > 4 * llc ? (size_t)256 << 20 : 4 * llc;
    double sgemm = quick ? mq_measure_sgemm_gflops(256, 0.05) : mq_measure_sgemm_gflops(2048, 1.0);
    double bw = mq_measure_read_gbps(probe0, quick ? 0.05 : 1.0);
    const double load = load_average();
    if (!json) {
        printf("machine: sgemm %.1f GFLOP/s (OpenBLAS %d^3), read bandwidth %.1f GB/s, %lld threads, "
               "load average %.2f, L3 %.0f MiB\n",
               sgemm, quick ? 256 : 2048, bw, (long long)threads, load, (double)llc / 1048576.0);
        fflush(stdout);
    }
    moeq_moe_experts *w[16] = {NULL};
    double t0 = mq_now();
    moeq_status st = make_experts(&s, &w[0]);
    if (st) return cli_fail("bench moe-ffn", st);
    const size_t packed = moeq_moe_experts_bytes(w[0]);
    int copies = 1;
    if (!quick && strcmp(routing_s, "fixed") != 0)
        while (copies < 16 && (size_t)copies * packed < 4 * llc) copies++;
    for (int i = 1; i < copies; i++)
        if ((st = make_experts(&s, &w[i]))) return cli_fail("bench moe-ffn", st);
    const double ex_bytes = (double)packed / (double)E;
    char copies_s[48] = "";
    if (copies > 1) snprintf(copies_s, sizeof copies_s, ", %d copies for varied routing", copies);
    if (!json)
        printf("experts: %s g%lld, E=%lld k=%lld D=%lld F=%lld, packed %.1f MB (%.2f bits/weight)%s, "
               "made in %.1f s\n",
               s.nvfp4 ? "nvfp4" : "int4", (long long)s.group,
               (long long)E, (long long)k, (long long)D, (long long)F,
               (double)packed * 1e-6, ex_bytes * 8.0 / (3.0 * (double)D * (double)F),
               copies_s,
               mq_now() - t0);

    float *router = malloc(sizeof(float) * (size_t)(E * D));
    for (int64_t i = 0; i < E * D; i++) router[i] = bench_rnd_normal(&g_s);
    int64_t tmax = 0;
    for (int i = 0; i < ntok; i++) tmax = toks[i] > tmax ? toks[i] : tmax;
    /* inputs: a pool big enough that varied routing keeps changing experts */
    int64_t pool = (int64_t)((256u << 20) / ((size_t)tmax * (size_t)D * 4));
    pool = pool < 2 ? 2 : pool > 64 ? 64 : pool;
    float *xs = malloc(sizeof(float) * (size_t)(pool * tmax * D));
    float *out = malloc(sizeof(float) * (size_t)(tmax * D));
    float *logits = malloc(sizeof(float) * (size_t)(tmax * E));
    uint8_t *used = malloc((size_t)E);
    if (!router || !xs || !out || !logits || !used) {
        fprintf(stderr, "moeq bench moe-ffn: out of memory\n");
        return CLI_FAIL;
    }
    for (int64_t i = 0; i < pool * tmax * D; i++) xs[i] = bench_rnd_normal(&g_s);
    int64_t *nused = malloc(sizeof(int64_t) * (size_t)pool);

    result res[64];
    int nres = 0;
    const char *routings[2] = {"fixed", "varied"};
    double bw_before = bw;
    for (int ti = 0; ti < ntok; ti++) {
        const int64_t T = toks[ti];
        for (int64_t p = 0; p < pool; p++)
            nused[p] = bench_distinct_experts(s.E, s.k, s.D, router, xs + p * T * D, T, used, logits);
        for (int ri = 0; ri < 2; ri++) {
            if (strcmp(routing_s, "both") && strcmp(routing_s, routings[ri])) continue;
            const int varied = ri == 1;
            moeq_moe_ffn_args a;
            memset(&a, 0, sizeof a);
            a.router = bench_ref(router, MOEQ_DT_F32, 2, E, D, 0, 4);
            a.experts = w[0];
            a.top_k = (int32_t)k;
            a.scoring = MOEQ_MOE_SOFTMAX;
            a.renormalize = 1;
            a.route_scale = 1.0f;
            a.x = bench_ref(xs, MOEQ_DT_F32, 2, T, D, 0, 4);
            if ((st = moeq_moe_ffn(&a, out, (size_t)(T * D)))) return cli_fail("bench moe-ffn", st);
            double bytes = 0, elapsed = 0, cpu0 = cpu_seconds();
            int64_t reps = 0;
            double t_end = mq_now() + seconds;
            do {
                int64_t p = varied ? (reps + 1) % pool : 0;
                a.x.data = xs + p * T * D;
                if (varied) a.experts = w[(reps + 1) % copies];
                double t1 = mq_now();
                st = moeq_moe_ffn(&a, out, (size_t)(T * D));
                elapsed += mq_now() - t1;
                if (st) return cli_fail("bench moe-ffn", st);
                bytes += (double)nused[p] * ex_bytes;
                reps++;
            } while ((mq_now() < t_end || reps < 3) && !moeq_interrupted());
            double cpu = cpu_seconds() - cpu0;
            double flops = 2.0 * (double)T * (double)k * 3.0 * (double)F * (double)D * (double)reps;
            result *r = &res[nres++];
            r->tokens = T;
            r->routing = routings[ri];
            r->ms = elapsed / (double)reps * 1e3;
            r->gflops = flops / elapsed * 1e-9;
            r->gbps = bytes / elapsed * 1e-9;
            r->cpu_gflops = flops / cpu * (double)threads * 1e-9;
            const double bw_after = mq_measure_read_gbps(probe, quick ? 0.02 : 0.3);
            r->bw_near = bw_before > bw_after ? bw_before : bw_after;
            bw_before = bw_after;
            if (!json) {
                printf("tokens %4lld %-6s %9.3f ms  %7.1f GFLOP/s (%.2f x sgemm)  %6.1f GB/s (%.2f x bw"
                       " %.1f)  [cpu-time rate %.1f]\n",
                       (long long)T, r->routing, r->ms, r->gflops, r->gflops / sgemm, r->gbps,
                       r->gbps / r->bw_near, r->bw_near, r->cpu_gflops);
                fflush(stdout);
            }
            if (moeq_interrupted()) break;
        }
    }
    if (json) {
        printf("{\"scheme\": \"%s\", \"group\": %lld, \"experts\": %lld, \"topk\": %lld, "
               "\"hidden\": %lld, \"ffn\": %lld, \"threads\": %lld, \"packed_bytes\": %zu, "
               "\"load_average\": %.2f, \"sgemm_gflops\": %.3f, \"dram_gbps\": %.3f, \"llc_bytes\": %zu, "
               "\"expert_copies\": %d, \"cpu_kernels\": \"%s\", \"results\": [",
               s.nvfp4 ? "nvfp4" : "int4", (long long)s.group, (long long)E, (long long)k,
               (long long)D, (long long)F, (long long)threads, packed, load,
               sgemm, bw, llc, copies, moeq_cpu_kernels());
        for (int i = 0; i < nres; i++)
            printf("%s{\"tokens\": %lld, \"routing\": \"%s\", \"ms\": %.4f, \"gflops\": %.3f, "
                   "\"gbps\": %.3f, \"x_sgemm\": %.4f, \"dram_gbps_near\": %.3f, \"x_bw\": %.4f, "
                   "\"cpu_gflops\": %.3f}",
                   i ? ", " : "", (long long)res[i].tokens, res[i].routing, res[i].ms, res[i].gflops,
                   res[i].gbps, res[i].gflops / sgemm, res[i].bw_near, res[i].gbps / res[i].bw_near,
                   res[i].cpu_gflops);
        printf("]}\n");
    }
    for (int i = 0; i < copies; i++) moeq_moe_experts_free(w[i]);
    free(router); free(xs); free(out); free(logits); free(used); free(nused);
    return moeq_interrupted() ? CLI_INTERRUPTED : CLI_OK;
}
