/*
 * Shared pieces of the moeq command line: option tables, usage text, exit codes, the progress
 * bar and Ctrl-C handling. Each subcommand lives in cmd_<name>.c and is listed in main.c.
 */
#ifndef MOEQ_CLI_H
#define MOEQ_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "moeq.h"

/* Exit codes: 0 success, 1 the job failed (bad input file, numeric error, ...), 2 bad usage,
 * 130 interrupted by Ctrl-C (after printing the partial result). */
enum { CLI_OK = 0, CLI_FAIL = 1, CLI_USAGE = 2, CLI_INTERRUPTED = 130 };

typedef enum {
    OPT_FLAG,     /* bool: present or not */
    OPT_INT,      /* int64_t */
    OPT_DOUBLE,   /* double */
    OPT_STRING,   /* const char * */
    OPT_LIST,     /* cli_list: repeatable string */
    OPT_CHOICE,   /* const char *, one of choices ("a|b|c") */
} cli_opt_kind;

typedef struct {
    const char **items;
    int n;
} cli_list;

typedef struct {
    const char *name;       /* "--max-length" */
    cli_opt_kind kind;
    void *dest;
    const char *metavar;    /* "L" (ignored for flags) */
    const char *help;
    const char *choices;    /* OPT_CHOICE: "nvfp4|nvfp4a16|int4" */
    int64_t min, max;       /* OPT_INT bounds (min > max: unbounded) */
    bool *seen;             /* optional: set when given */
} cli_opt;

typedef struct {
    const char *name;          /* "eval" */
    const char *synopsis;      /* "MODEL_DIR --task wikitext --data FILE [options]" */
    const char *description;   /* one paragraph */
    const cli_opt *opts;
    int n_opts;
    int min_positional, max_positional;
    const char *positional_names;   /* "MODEL_DIR" */
} cli_command;

/* Parses argv (argv[0] is the subcommand name). Positional arguments are stored in pos (up to
 * max_positional). Returns -1 when parsing succeeded, else the exit code to return (0 after
 * --help, 2 after a usage error, with the message printed). */
int cli_parse(const cli_command *cmd, int argc, char **argv, const char **pos, int *n_pos);
void cli_usage(const cli_command *cmd, FILE *to);
/* Prints "moeq <cmd>: <message>" to stderr and returns CLI_USAGE. */
int cli_usage_error(const char *cmd, const char *fmt, ...);
/* Prints "moeq <cmd>: error: <moeq_last_error()>" and returns CLI_FAIL (or CLI_INTERRUPTED). */
int cli_fail(const char *cmd, moeq_status st);

/* MODEL_DIR as typed: an existing path as it is (a .gguf file too: moeq_model_open reads it in
 * place), else a Hugging Face hub id resolved in the local cache at revision (NULL: main); NULL
 * after printing the error (return CLI_FAIL). The result lives until the process ends. */
const char *cli_model_dir(const char *cmd, const char *arg, const char *revision);
/* The same for commands that need a checkpoint directory (quantize and its benchmarks: the
 * pipeline reads config.json and safetensors shards): a .gguf file is imported first
 * (cli_gguf_model_dir). */
const char *cli_checkpoint_dir(const char *cmd, const char *arg, const char *revision);
/* A .gguf MODEL (cmd_export_gguf.c): moeq_import_gguf into a temporary directory removed at exit;
 * NULL after printing the error. cli_is_gguf: a .gguf name or the GGUF magic. */
const char *cli_gguf_model_dir(const char *cmd, const char *path);
int cli_is_gguf(const char *path);
/* The flags several commands share, with one help text. */
#define CLI_THREADS_OPT(var)                                                                       \
    {"--threads", OPT_INT, &(var), "N", "worker threads (default: every CPU it may use)", NULL, 0,   \
     1024, NULL}
#define CLI_DEQUANTIZE_OPT(var)                                                                    \
    {"--dequantize", OPT_FLAG, &(var), NULL, CLI_HELP_DEQUANTIZE, NULL, 0, 0, NULL}
#define CLI_JSON_OPT(var)                                                                          \
    {"--json", OPT_FLAG, &(var), NULL, "print one JSON object on stdout", NULL, 0, -1, NULL}
#define CLI_CTX_OPT(var, help) {"--ctx", OPT_INT, &(var), "N", help, NULL, 0, 1 << 24, NULL}
#define CLI_TEMPLATE_OPT(var)                                                                      \
    {"--template", OPT_STRING, &(var), "NAME", "a named chat template of the model (default: "      \
     "\"default\", or the only one)", NULL, 0, 0, NULL}
#define CLI_REVISION_OPT(var)                                                                      \
    {"--revision", OPT_STRING, &(var), "REV", "MODEL_DIR given as a hub id (org/name): the branch, " \
     "tag or commit of the local Hugging Face cache to use (default main)", NULL, 0, 0, NULL}

/* A flag of a library option table (moeq_quant_option_info, moeq_eval_option_info) as parsed,
 * until its value goes to the setter by name: the command builds its cli_opt from the row
 * (cli_table_opt: kind, range, metavar and help are the library's) and hands what was given to
 * the setter as text (cli_table_value), the same text a binding would give. */
typedef struct {
    const moeq_option_info *info;
    char name[48];   /* "--" key */
    bool seen, on;
    int64_t i;
    double d;
    const char *s;
    cli_list list;
} cli_table_flag;
/* f's row read into f (info set, the rest zeroed) and its cli_opt. */
cli_opt cli_table_opt(cli_table_flag *f, const moeq_option_info *info);
/* The value given, as the setter reads it ("true" for a switch; NULL for a list). */
const char *cli_table_value(const cli_table_flag *f, char *buf, size_t cap);
/* The usage error for a value the setter refused, with what the library's "KEY=VALUE: expected
 * ..." message says it wants: "--KEY VALUE: expected ..." (quantize's form), or quoted
 * "--KEY: cannot read 'VALUE': expected ..." (eval's, whose values are paths and sizes). */
int cli_table_refused(const char *cmd, const cli_table_flag *f, const char *v, bool quoted);
/* The flag of t[0..n) with this key, or NULL; cli_table_given: given on the command line. */
const cli_table_flag *cli_table_find(const cli_table_flag *t, int n, const char *key);
bool cli_table_given(const cli_table_flag *t, int n, const char *key);

/* A command's flags: the rows of a library table (info(0), info(1), ... until NULL:
 * moeq_quant_option_info, moeq_eval_option_info, moeq_gen_option_info) and the command's own
 * flags, each own flag placed in --help before the row whose key is `before` (NULL: after the
 * last row). t[0..n) are the rows as parsed, opts[0..n_opts) the cli_command's options. */
typedef struct {
    const char *before;
    cli_opt opt;
} cli_own_flag;
enum { CLI_TABLE_MAX = 112, CLI_OWN_MAX = 24 };
typedef struct {
    cli_table_flag t[CLI_TABLE_MAX];
    int n;
    cli_opt opts[CLI_TABLE_MAX + CLI_OWN_MAX];
    int n_opts;
} cli_table;
/* false after printing why when the table outgrows CLI_TABLE_MAX, there are more than CLI_OWN_MAX
 * own flags, or a `before` names no row (a library this command does not know). */
bool cli_table_build(cli_table *tb, const char *cmd, const moeq_option_info *(*info)(int), const cli_own_flag *own,
                     int n_own);
/* The generation flags given (t[0..n), the rows of moeq_gen_option_info) into o, after
 * moeq_gen_options_init: greedy unless a flag that asks for sampling (the row's identity) was
 * given, then from temperature 1, each given value through moeq_gen_options_set. A refused value,
 * or greedy (--greedy) together with a sampling flag, is a usage error naming the flag: returns
 * its exit code, else -1. */
int cli_gen_options(const char *cmd, const cli_table_flag *t, int n, bool greedy, moeq_gen_options *o);
/* A session's device (moeq generate, moeq chat): the three flags' rows, and their values (each
 * may be NULL: not given) into o through moeq_session_options_set, --gpu-precision and
 * --max-gpu-memory only with --device cuda: a usage error's exit code naming the flag, else -1. */
#define CLI_DEVICE_OPT(var)                                                                        \
    {"--device", OPT_STRING, &(var), "DEV", "where the model runs: cpu (the default), cuda or "    \
     "cuda:N (every layer, its KV cache and the output layer on that GPU; a build with CUDA)",    \
     NULL, 0, 0, NULL}
#define CLI_PRECISION_OPT(var)                                                                     \
    {"--gpu-precision", OPT_CHOICE, &(var), NULL, "with --device cuda: fp32 (the default: the "    \
     "CPU's results up to the order of sums), tf32x3, tf32, or bf16 (the routed experts on the "  \
     "tensor cores, the rest as tf32)", "fp32|tf32x3|tf32|bf16", 0, 0, NULL}
#define CLI_GPUMEM_OPT(var)                                                                        \
    {"--max-gpu-memory", OPT_STRING, &(var), "SIZE", "with --device cuda: GPU memory the session " \
     "may hold (e.g. 20GB; default: the card's free memory)", NULL, 0, 0, NULL}
int cli_session_options(const char *cmd, const char *device, const char *precision, const char *max_memory,
                        moeq_session_options *o);

/* Progress bar with ETA on stderr: enabled when stderr is a terminal and quiet is false. */
void cli_progress_enable(bool quiet);
void cli_progress_finish(void);
/* Installs a SIGINT handler that asks the library to stop (moeq_interrupt); a second Ctrl-C
 * kills the process. */
void cli_install_sigint(void);

/* Path of the shared fixtures folder ($MOEQ_SHARED or <repo>/../shared); NULL if missing. */
const char *cli_shared_dir(void);
/* "OpenBLAS <kernel set>", saying so where the CLI chose the set (main.c's blas_reexec). */
const char *cli_blas_kernels(void);

/* "5GB", "500MB", "2GiB", "1048576" -> bytes (K/M/G/T decimal, KiB/MiB/GiB/TiB binary, B
 * optional, case ignored); false for anything else. */
bool cli_parse_size(const char *s, uint64_t *out);
/* "2,4,8,16": up to max counts, each in [lo, hi], into out; the number read, or -1 if malformed. */
int cli_parse_counts(const char *s, int *out, int max, int lo, int hi);

/* A growing byte buffer, p[0..n) NUL-terminated after every put ({0}: empty; free(p)). */
typedef struct {
    char *p;
    size_t n, cap;
} cli_buf;
/* Appends s[0..n); false when out of memory (b unchanged). */
bool cli_buf_put(cli_buf *b, const char *s, size_t n);

/* JSON-safe printing of a string (with quotes). */
void cli_print_json_string(FILE *f, const char *s);
/* The same for s[0..n), which may hold NUL bytes (a byte-level token can decode to one). */
void cli_print_json_bytes(FILE *f, const char *s, size_t n);

/* Process resource use (getrusage): peak resident set size in bytes, and CPU seconds (user +
 * system, all threads) so far. */
int64_t cli_peak_rss_bytes(void);
double cli_cpu_seconds(void);
/* The median of v[0..n), n <= 64 (the mean of the middle two for even n; v is not changed): the
 * benchmarks' figure over repeated rounds. */
double cli_median(const double *v, int n);
/* The last-level cache's bytes (sysconf), 0 when unknown: bandwidth probes read several times it. */
size_t cli_llc_bytes(void);

/* The help of the options eval and generate share (how a quantized checkpoint runs). */
#define CLI_HELP_DEQUANTIZE "run a quantized checkpoint dequantized in fp32 (default: packed, on the quantized kernels)"
#define CLI_HELP_ACT_QUANT                                                                         \
    "emulate activation quantization on the inputs of the quantized Linears (implies the "        \
    "dequantized path): nvfp4 = W4A4 (one global scale per call, E4M3 per 16); q8_0 = "             \
    "llama.cpp's CPU rounding of the activations of its Q4_0/Q4_1/NVFP4/Q8_0 matmuls "              \
    "(per row, blocks of 32, d = amax/127 stored as fp16, x*127/amax rounded half to "              \
    "even; on a .gguf the Linears stored Q4_0/Q4_1/Q5_0/Q5_1/NVFP4/Q8_0, lm_head included, and "   \
    "Q8_K for its K-quant Linears (blocks of 256, fp32 d); on an unquantized model every "          \
    "decoder Linear; not emulated: llama.cpp's summation order, the F16/BF16 rounding of the "      \
    "activations of F16/BF16 weights, its F16 KV cache and flash attention; docs/gguf.md)"
/* One stderr line on a model's resident weights (packed or fp32, and what fp32 would take)
 * and the process's peak RSS. */
void cli_report_memory(const char *cmd, const moeq_model_info *info);

#endif
