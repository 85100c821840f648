/* Benchmarks behind `moeq bench <name>`; each takes argv with argv[0] = its own name. */
#ifndef MOEQ_BENCH_H
#define MOEQ_BENCH_H
#include <stdbool.h>
#include <stdint.h>
int bench_eval(int argc, char **argv);
int bench_forward(int argc, char **argv);
int bench_gen_model(int argc, char **argv);
int bench_gptq(int argc, char **argv);
int bench_quantize(int argc, char **argv);
int bench_moe_ffn(int argc, char **argv);
/* bench moe-ffn --device cuda[:N] (bench_moe_ffn_cuda.c): its options after parsing. */
typedef struct {
    int device;
    int64_t E, k, D, F;
    bool shape_given;         /* --experts/--topk/--hidden/--ffn given: that shape, else the preset */
    const char *preset;       /* qwen3-30b-a3b | olmoe-1b-7b | both */
    const char *tokens;       /* NULL: the default list */
    const char *scheme;       /* int4 | nvfp4 | both */
    int64_t group;            /* 0: 128 */
    bool quick;
} bench_cuda_opts;
int bench_moe_ffn_cuda(const bench_cuda_opts *o);
int bench_tokenizer(int argc, char **argv);
#endif
