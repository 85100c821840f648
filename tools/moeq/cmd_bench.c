/* moeq bench <what>: benchmarks that print figures and ratios (never pass/fail timing tests). */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} g_benches[] = {
    {"eval", bench_eval,
     "streamed eval at real size: tokens/s, GFLOP/s vs sgemm, peak memory, the whole data's time"},
    {"forward", bench_forward, "fp32 forward: prefill and decode tokens/s, GFLOP/s vs sgemm"},
    {"generate", bench_generate,
     "packed runtime as llama-bench: load, pp and tg tokens/s, memory; llama-bench alternated"},
    {"gen-model", bench_gen_model,
     "writes a random-weight checkpoint with a real model's shapes and config"},
    {"gptq", bench_gptq, "GPTQ on one weight: seconds and fraction of the sgemm FLOP rate"},
    {"quantize", bench_quantize,
     "GPTQ through the streaming pipeline: seconds per layer and stage, memory, whole-model time"},
    {"moe-ffn", bench_moe_ffn, "quantized MoE FFN op: GFLOP/s and GB/s, fixed and varied routing"},
    {"tokenizer", bench_tokenizer, "tokenizer encoding speed (MB/s)"},
};

int cmd_bench(int argc, char **argv) {
    const size_t n = sizeof g_benches / sizeof g_benches[0];
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        FILE *to = argc < 2 ? stderr : stdout;
        fprintf(to, "usage: moeq bench <what> [options]\n\nbenchmarks:\n");
        for (size_t i = 0; i < n; i++) fprintf(to, "  %-10s %s\n", g_benches[i].name, g_benches[i].summary);
        return argc < 2 ? CLI_USAGE : CLI_OK;
    }
    for (size_t i = 0; i < n; i++)
        if (!strcmp(argv[1], g_benches[i].name)) {
            /* which kernels the figures are of (stderr: --json keeps stdout one object); the
             * generator measures nothing */
            if (strcmp(g_benches[i].name, "gen-model") != 0)
                fprintf(stderr, "moeq bench %s: CPU kernels %s, BLAS %s\n", g_benches[i].name, moeq_cpu_kernels(),
                        cli_blas_kernels());
            return g_benches[i].run(argc - 1, argv + 1);
        }
    return cli_usage_error("bench", "unknown benchmark '%s'", argv[1]);
}
