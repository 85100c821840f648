/*
 * moeq bench eval: the streamed evaluation's speed and memory at real size. Plans the whole data
 * (every window of every document, a --kl-base in lockstep), then runs the first --limit
 * documents and reports, from that run: tokens/s, the forward's GFLOP/s beside the machine's
 * sgemm rates measured in the same process (the cores' single-threaded rate, which windows run
 * at, and the pool's multi-threaded rate), the planned and measured peak memory, and the time the
 * whole data would take at the measured rate.
 * With --device cuda: the whole data on the GPU (layer by layer, the boundary on the device where
 * it fits), its wall time and tokens/s beside the card's measured rates (cuBLAS bf16 and fp32
 * GEMMs, copy bandwidth) and the FLOPs the run made, as a share of the bf16 rate.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "backend/gpu.h"
#include "commands.h"
#include "cli.h"
#include "core/core.h"

static moeq_status open_streamed(const char *dir, bool packed, moeq_model **m) {
    moeq_model_options o = {.keep_packed = packed, .stream = 1};
    return moeq_model_open(dir, &o, m);
}

static bool wikitext_task(const char *task) { return strcmp(task, "wikitext") == 0; }

/* The whole data on the GPU, beside the card's measured rates. */
static int bench_eval_gpu(const char *dir, const char *kl_base, const char *data, bool wikitext, int64_t max_length,
                          const char *device, const char *precision, bool json) {
    moeq_eval_options o;
    moeq_eval_options_init(&o);
    if (moeq_eval_options_set(&o, "device", device) || moeq_eval_options_set(&o, "gpu-precision", precision))
        return cli_usage_error("bench eval", "%s", moeq_last_error());
    moeq_docs *docs = NULL;
    moeq_model *m = NULL, *base = NULL;
    const double t0 = mq_now();
    moeq_status st = moeq_docs_load(data, wikitext ? MOEQ_DOCS_WIKITEXT : MOEQ_DOCS_WHOLE, &docs);
    if (!st) st = open_streamed(dir, false, &m);
    if (!st && kl_base) st = open_streamed(kl_base, false, &base);
    o.task = wikitext ? MOEQ_TASK_WIKITEXT : MOEQ_TASK_TEXT;
    o.max_length = (int32_t)max_length;
    o.kl_base = base;
    moeq_eval_result r;
    memset(&r, 0, sizeof r);
    if (!st) st = moeq_eval(m, docs, &o, &r);
    const double wall = mq_now() - t0;
    /* the card's rates, measured after the run (the same process, the same card) */
    double gemm_ms = 0, sgemm = 0, bw = 0;
    mq_gpu *g = NULL;
    if (!st) st = mq_gpu_open(o.device, &g);
    if (!st) st = mq_gpu_measure(g, &sgemm, &bw);
    const int64_t M[1] = {8192}, N[1] = {8192}, K[1] = {8192};
    if (!st) st = mq_gpu_gemm_bf16_time(g, 1, M, N, K, &gemm_ms);
    mq_gpu_close(g);
    moeq_model_free(base);
    moeq_model_free(m);
    moeq_docs_free(docs);
    if (st) return cli_fail("bench eval", st);
    const double bf16_tflops = gemm_ms > 0 ? 2.0 * 8192.0 * 8192.0 * 8192.0 / (gemm_ms * 1e-3) * 1e-12 : 0;
    const double run_tflops = r.plan.flops > 0 && r.seconds > 0 ? r.plan.flops / r.seconds * 1e-12 : 0;
    if (json) {
        printf("{\n  \"model\": ");
        cli_print_json_string(stdout, dir);
        printf(",\n  \"kl_base\": %s%s%s,\n", kl_base ? "\"" : "", kl_base ? kl_base : "null", kl_base ? "\"" : "");
        printf("  \"device\": ");
        cli_print_json_string(stdout, r.device);
        printf(",\n  \"tokens\": %lld,\n  \"eval_seconds\": %.6g,\n  \"wall_seconds\": %.6g,\n", (long long)r.tokens,
               r.seconds, wall);
        printf("  \"tokens_per_second\": %.6g,\n  \"flops\": %.6g,\n  \"run_tflops\": %.6g,\n", r.tokens_per_second,
               r.plan.flops, run_tflops);
        printf("  \"cublas_bf16_tflops\": %.6g,\n  \"cublas_sgemm_tflops\": %.6g,\n  \"copy_gbs\": %.6g,\n",
               bf16_tflops, sgemm * 1e-3, bw);
        printf("  \"word_perplexity\": %.9g\n}\n", r.word_perplexity);
    } else {
        printf("bench eval %s%s%s on %s: %lld tokens\n", dir, kl_base ? " against " : "", kl_base ? kl_base : "",
               r.device, (long long)r.tokens);
        printf("  eval %.1f s (%.0f tokens/s), wall %.1f s with loading and tokenizing\n", r.seconds,
               r.tokens_per_second, wall);
        printf("  %.3g TFLOP at %.1f TFLOP/s = %.3f x cuBLAS bf16 (%.1f TFLOP/s, 8192^3); cuBLAS sgemm %.1f TFLOP/s; "
               "copy %.0f GB/s\n", r.plan.flops * 1e-12, run_tflops, bf16_tflops > 0 ? run_tflops / bf16_tflops : NAN,
               bf16_tflops, sgemm * 1e-3, bw);
    }
    return CLI_OK;
}

int bench_eval(int argc, char **argv) {
    const char *data = NULL, *kl_base = NULL, *max_memory = NULL, *task = "wikitext";
    int64_t max_length = 2048, limit = 1, threads = 0;
    bool json = false;
    const char *device = NULL, *precision = "bf16";
    cli_opt opts[] = {
        {"--device", OPT_STRING, &device, "DEV", "cuda or cuda:N: the whole data on the GPU (default: the CPU, "
         "--limit documents)", NULL, 0, 0, NULL},
        {"--gpu-precision", OPT_CHOICE, &precision, NULL, "with --device: as moeq eval's (default bf16)",
         "fp32|tf32x3|tf32|bf16", 0, 0, NULL},
        {"--data", OPT_STRING, &data, "FILE", "the documents (wikitext pages; required)", NULL, 0, 0, NULL},
        {"--task", OPT_CHOICE, &task, NULL, "wikitext (default) or text", "wikitext|text", 0, 0, NULL},
        {"--kl-base", OPT_STRING, &kl_base, "DIR", "a base model in lockstep (KL)", NULL, 0, 0, NULL},
        {"--max-length", OPT_INT, &max_length, "L", "tokens per window (default 2048)", NULL, 1, 1 << 30, NULL},
        {"--limit", OPT_INT, &limit, "N", "documents timed (default 1)", NULL, 1, INT64_MAX, NULL},
        {"--max-memory", OPT_STRING, &max_memory, "SIZE", "the run's budget (default as moeq eval)",
         NULL, 0, 0, NULL},
        {"--threads", OPT_INT, &threads, "N", "worker threads (default: every CPU it may use)", NULL, 0, 1024, NULL},
        {"--json", OPT_FLAG, &json, NULL, "print one JSON object on stdout", NULL, 0, -1, NULL},
    };
    cli_command cmd = {"bench eval", "MODEL_DIR --data FILE [--kl-base DIR] [--limit N] [--json]",
                       "Streams MODEL_DIR (and --kl-base) layer by layer over the first --limit "
                       "documents of --data: tokens/s, the forward's GFLOP/s against the machine's "
                       "sgemm rates, planned and measured peak memory, and the whole data's time at "
                       "that rate (from a plan of every document).",
                       opts, (int)(sizeof opts / sizeof opts[0]), 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos = 0;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!data) return cli_usage_error("bench eval", "--data FILE is required");
    uint64_t mem = 0;
    if (max_memory && !cli_parse_size(max_memory, &mem))
        return cli_usage_error("bench eval", "--max-memory: cannot read '%s'", max_memory);
    if (threads > 0) moeq_set_threads((int)threads);
    const char *dir = cli_model_dir("bench eval", pos[0], NULL);
    if (!dir || (kl_base && !(kl_base = cli_model_dir("bench eval", kl_base, NULL)))) return CLI_FAIL;
    if (device) return bench_eval_gpu(dir, kl_base, data, wikitext_task(task), max_length, device, precision, json);

    moeq_docs *docs = NULL;
    moeq_model *m = NULL, *base = NULL;
    const bool wikitext = strcmp(task, "wikitext") == 0;
    moeq_status st = moeq_docs_load(data, wikitext ? MOEQ_DOCS_WIKITEXT : MOEQ_DOCS_WHOLE, &docs);
    if (!st) st = open_streamed(dir, true, &m);
    if (!st && kl_base) st = open_streamed(kl_base, true, &base);
    moeq_eval_options o;
    moeq_eval_options_init(&o);
    o.task = wikitext ? MOEQ_TASK_WIKITEXT : MOEQ_TASK_TEXT;
    o.max_length = (int32_t)max_length;
    o.kl_base = base;
    o.max_memory = (int64_t)mem;
    moeq_eval_result whole, r;
    memset(&r, 0, sizeof r);
    /* the plan of the whole data, then the timed documents */
    o.dry_run = 1;
    if (!st) st = moeq_eval(m, docs, &o, &whole);
    o.dry_run = 0;
    o.limit = limit;
    if (!st) st = moeq_eval(m, docs, &o, &r);
    if (st) {
        moeq_model_free(base);
        moeq_model_free(m);
        moeq_docs_free(docs);
        return cli_fail("bench eval", st);
    }
    const double pool_gflops = mq_measure_sgemm_gflops(2048, 1.0);
    const double core = r.plan.core_gflops, fwd = r.plan.forward_gflops;
    const double eta_whole = fwd > 0 ? whole.plan.flops / (fwd * 1e9) : NAN;
    if (json) {
        printf("{\n  \"model\": ");
        cli_print_json_string(stdout, dir);
        printf(",\n  \"kl_base\": %s%s%s,\n", kl_base ? "\"" : "", kl_base ? kl_base : "null", kl_base ? "\"" : "");
        printf("  \"threads\": %d,\n  \"documents\": %lld,\n  \"tokens\": %lld,\n  \"seconds\": %.6g,\n",
               r.plan.threads, (long long)r.documents, (long long)r.tokens, r.seconds);
        printf("  \"tokens_per_second\": %.6g,\n  \"forward_gflops\": %.6g,\n  \"core_gflops\": %.6g,\n",
               r.tokens_per_second, fwd, core);
        printf("  \"pool_sgemm_gflops\": %.6g,\n  \"forward_over_core\": %.6g,\n", pool_gflops,
               core > 0 ? fwd / core : NAN);
        printf("  \"peak_planned_bytes\": %lld,\n  \"peak_measured_bytes\": %lld,\n",
               (long long)r.plan.peak_bytes, (long long)r.plan.peak_anon_bytes);
        printf("  \"whole_windows\": %lld,\n  \"whole_rows\": %lld,\n  \"whole_peak_planned_bytes\": %lld,\n",
               (long long)whole.plan.windows, (long long)whole.plan.rows, (long long)whole.plan.peak_bytes);
        printf("  \"whole_disk_bytes\": %lld,\n  \"whole_flops\": %.6g,\n  \"whole_eta_seconds\": %.6g\n}\n",
               (long long)whole.plan.disk_bytes, whole.plan.flops, eta_whole);
    } else {
        printf("bench eval %s%s%s: %lld documents, %lld tokens, %d windows in flight\n", dir,
               kl_base ? " against " : "", kl_base ? kl_base : "", (long long)r.documents,
               (long long)r.tokens, r.plan.threads);
        printf("  %.1f s, %.1f tokens/s\n", r.seconds, r.tokens_per_second);
        printf("  forward %.1f GFLOP/s; cores' sgemm %.1f GFLOP/s (x%.2f); pool sgemm %.1f GFLOP/s (x%.2f)\n",
               fwd, core, core > 0 ? fwd / core : NAN, pool_gflops,
               pool_gflops > 0 ? fwd / pool_gflops : NAN);
        printf("  peak %.2f GB planned, %.2f GB measured\n", r.plan.peak_bytes / 1e9,
               r.plan.peak_anon_bytes / 1e9);
        printf("  the whole data: %lld windows, %lld rows, peak %.2f GB planned, %.2f GB of work files, "
               "%.3g TFLOP: %.0f s (%.2f h) at the measured rate\n",
               (long long)whole.plan.windows, (long long)whole.plan.rows, whole.plan.peak_bytes / 1e9,
               whole.plan.disk_bytes / 1e9, whole.plan.flops / 1e12, eta_whole, eta_whole / 3600);
    }
    moeq_model_free(base);
    moeq_model_free(m);
    moeq_docs_free(docs);
    return CLI_OK;
}
