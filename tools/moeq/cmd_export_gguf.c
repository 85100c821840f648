/* moeq export-gguf CKPT_DIR OUT.gguf, and `moeq inspect FILE.gguf` (through include/moeq.h). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"

int cli_is_gguf(const char *path) {
    size_t n = strlen(path);
    if (n > 5 && !strcmp(path + n - 5, ".gguf")) return 1;
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    char magic[4] = {0};
    size_t got = fread(magic, 1, 4, f);
    fclose(f);
    return got == 4 && !memcmp(magic, "GGUF", 4);
}

static char g_import_dirs[4][1024];
static char g_import_files[4][4][1200];   /* made before any signal can need them */
static volatile sig_atomic_t g_n_import;

/* The temporary checkpoints hold config.json, tokenizer.json, model.safetensors and
 * gguf_types.json only (moeq_import_gguf). Only unlink and rmdir: also run from a signal. */
static void remove_imports(void) {
    for (int i = 0; i < g_n_import; i++) {
        for (int f = 0; f < 4; f++) unlink(g_import_files[i][f]);
        rmdir(g_import_dirs[i]);
    }
}

/* A run killed by SIGTERM, SIGHUP or SIGPIPE (e.g. `| head`) removes them too, then dies of the
 * signal as it would have. */
static void on_fatal_signal(int sig) {
    remove_imports();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void install_cleanup(void) {
    atexit(remove_imports);
    const int sigs[] = {SIGTERM, SIGHUP, SIGPIPE};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction sa, old;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_fatal_signal;
        sigemptyset(&sa.sa_mask);
        /* a signal the caller chose to ignore stays ignored */
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_IGN) continue;
        sigaction(sigs[i], &sa, NULL);
    }
}

const char *cli_gguf_model_dir(const char *cmd, const char *path) {
    if (g_n_import == 4) {
        fprintf(stderr, "moeq %s: error: too many GGUF models\n", cmd);
        return NULL;
    }
    const char *t = getenv("TMPDIR");
    char *d = g_import_dirs[g_n_import];
    snprintf(d, sizeof g_import_dirs[0], "%s/moeq-gguf-XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(d)) {
        fprintf(stderr, "moeq %s: error: cannot create a temporary directory %s\n", cmd, d);
        return NULL;
    }
    static const char *const files[] = {"config.json", "tokenizer.json", "model.safetensors",
                                        "gguf_types.json"};
    for (int f = 0; f < 4; f++)
        snprintf(g_import_files[g_n_import][f], sizeof g_import_files[0][0], "%.1000s/%s", d, files[f]);
    if (!g_n_import) install_cleanup();
    g_n_import++;
    moeq_status st = moeq_import_gguf(path, d);
    if (st) {
        cli_fail(cmd, st);
        return NULL;
    }
    return d;
}

int cli_inspect_gguf(const char *path, int tensors) {
    char *text;
    moeq_status st = moeq_gguf_describe(path, tensors, &text);
    if (st) return cli_fail("inspect", st);
    fputs(text, stdout);
    free(text);
    return CLI_OK;
}

int cmd_export_gguf(int argc, char **argv) {
    const char *rest = NULL;
    bool quiet = false, force = false, dequant = false;
    const cli_opt opts[] = {
        {"--gguf-rest", OPT_CHOICE, &rest, NULL, "the unquantized 2-D tensors in their source dtype "
         "(auto, the default) or as given; norms, biases and routers are F32", "auto|f32|f16|bf16|q8_0",
         0, 0, NULL},
        {"--dequantize", OPT_FLAG, &dequant, NULL, "write the quantized Linears dequantized (F32, or "
         "as --gguf-rest says): the same model on llama.cpp's float kernels, to measure its quantized "
         "kernels against", NULL, 0, 0, NULL},
        {"--force", OPT_FLAG, &force, NULL, "replace OUT.gguf if it exists", NULL, 0, 0, NULL},
        {"--quiet", OPT_FLAG, &quiet, NULL, "no progress bar and no summary", NULL, 0, 0, NULL},
    };
    const cli_command cmd = {
        "export-gguf", "CKPT_DIR OUT.gguf [--gguf-rest auto|f32|f16|bf16|q8_0]",
        "Converts a checkpoint (compressed-tensors, ModelOpt, GPTQ v1 or unquantized; llama,\n"
        "mixtral, olmoe, qwen2_moe, qwen3_moe) into one GGUF v3 file that llama.cpp loads, without\n"
        "requantizing: INT4 symmetric -> Q4_0 (bit-exact when the scales are f16, as\n"
        "`quantize --format gguf` makes them), asymmetric -> Q4_1, NVFP4 -> NVFP4 with its global\n"
        "scale (llama and qwen3moe only). What llama.cpp would compute differently is refused.",
        opts, (int)(sizeof opts / sizeof opts[0]), 2, 2, "CKPT_DIR OUT.gguf"};
    const char *pos[2];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    FILE *f = fopen(pos[1], "rb");
    if (f) {
        fclose(f);
        if (!force) {
            fprintf(stderr, "moeq export-gguf: error: %s: already exists (use --force to replace it)\n", pos[1]);
            return CLI_FAIL;
        }
    }
    cli_progress_enable(quiet);
    cli_install_sigint();
    moeq_status st = dequant ? moeq_export_gguf_dequantized(pos[0], pos[1], rest) : moeq_export_gguf(pos[0], pos[1], rest);
    cli_progress_finish();
    if (st) return cli_fail("export-gguf", st);
    if (!quiet) printf("wrote %s\n", pos[1]);
    return CLI_OK;
}
