/* moeq: the command-line front end. Each subcommand is one function in cmd_<name>.c. */
#define _POSIX_C_SOURCE 200809L
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} g_commands[] = {
    {"inspect", cmd_inspect, "show a checkpoint's architecture, tensors, dtypes and sizes"},
    {"tokenize", cmd_tokenize, "turn text into token ids with the model's tokenizer"},
    {"generate", cmd_generate, "generate text from a prompt"},
    {"chat", cmd_chat, "chat with the model through its chat template"},
    {"serve", cmd_serve, "an OpenAI-compatible HTTP server (completions, chat, streaming)"},
    {"eval", cmd_eval, "wikitext perplexity and KL divergence, exactly as lm-eval"},
    {"quantize", cmd_quantize, "quantize a model (RTN or GPTQ) into NVFP4 or INT4 checkpoints"},
    {"bench", cmd_bench, "benchmarks: forward, gptq, moe-ffn, tokenizer"},
    {"export-gguf", cmd_export_gguf, "convert a checkpoint into one GGUF file for llama.cpp"},
};

static void usage(FILE *to) {
    fprintf(to, "moeq %s - quantize Mixture-of-Experts LLMs (GPTQ/RTN -> NVFP4, INT4), "
                "evaluate them and run them\n\nusage: moeq <command> [options]\n\ncommands:\n",
            moeq_version());
    for (size_t i = 0; i < sizeof g_commands / sizeof g_commands[0]; i++)
        fprintf(to, "  %-10s %s\n", g_commands[i].name, g_commands[i].summary);
    fprintf(to, "\n'moeq <command> --help' describes a command's options.\n");
}

/* Ranks past 0 of an mpirun job: rank 0 speaks for the job; the others only warn (and print
 * their error when they stop). */
static void rank_log(void *user, int level, const char *msg) {
    (void)user;
    if (level > 0) fprintf(stderr, "moeq (rank %d): warning: %s\n", moeq_dist_rank(), msg);
}

/* Commands that split their work over the ranks of an mpirun job. */
static int run_command(int i, int argc, char **argv) {
    const bool dist = !strcmp(g_commands[i].name, "quantize") || !strcmp(g_commands[i].name, "bench") ||
                      !strcmp(g_commands[i].name, "eval");
    if (dist) {
        moeq_status st = moeq_dist_start();
        if (st) return cli_fail(g_commands[i].name, st);
        if (moeq_dist_rank() > 0) {
            moeq_set_log(rank_log, NULL);
            if (!freopen("/dev/null", "w", stdout)) return cli_fail(g_commands[i].name, MOEQ_E_IO);
        }
    }
    int rc = g_commands[i].run(argc, argv);
    if (dist) {
        fflush(stdout);
        moeq_dist_stop();
    }
    return rc;
}

/* OpenBLAS runs kernels weaker than this CPU (it did not know the model: moeq_blas_coretype_advice)
 * and reads OPENBLAS_CORETYPE only when it loads: run again, once, with the set that suits the
 * CPU. A set OPENBLAS_CORETYPE is the user's choice and is kept. MOEQ_BLAS_REEXEC carries the
 * set OpenBLAS chose, for --version and the benchmarks' headers. */
static void blas_reexec(char **argv) {
    const char *ct = moeq_blas_coretype_advice();
    if (!ct || getenv("OPENBLAS_CORETYPE") || getenv("MOEQ_BLAS_REEXEC")) return;
    if (setenv("MOEQ_BLAS_REEXEC", moeq_blas_kernels(), 1) || setenv("OPENBLAS_CORETYPE", ct, 1)) return;
    execv("/proc/self/exe", argv);
    unsetenv("OPENBLAS_CORETYPE");   /* no new process: carry on with what OpenBLAS chose */
    unsetenv("MOEQ_BLAS_REEXEC");
    fprintf(stderr, "moeq: warning: OpenBLAS runs its %s kernels on this CPU; OPENBLAS_CORETYPE=%s would be "
            "several times faster\n", moeq_blas_kernels(), ct);
}

int main(int argc, char **argv) {
    blas_reexec(argv);
    if (argc < 2) {
        usage(stderr);
        return CLI_USAGE;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return CLI_OK;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("moeq %s\nCPU kernels: %s\nBLAS: %s\nGPU backend: %s\nMPI: %s\n", moeq_version(), moeq_cpu_kernels(),
               cli_blas_kernels(), moeq_gpu_backend_built() ? "CUDA (--device cuda)" : "none (built without CUDA)",
               moeq_dist_built() ? "Open MPI (mpirun -np N moeq quantize ...)" : "none (built without MPI)");
        return CLI_OK;
    }
    for (size_t i = 0; i < sizeof g_commands / sizeof g_commands[0]; i++)
        if (!strcmp(argv[1], g_commands[i].name)) return run_command((int)i, argc - 1, argv + 1);
    fprintf(stderr, "moeq: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return CLI_USAGE;
}
