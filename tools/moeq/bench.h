/* bench moe-ffn's GPU half, shared by bench_moe_ffn.c and bench_moe_ffn_cuda.c (the commands
 * themselves are declared in commands.h). */
#ifndef MOEQ_BENCH_H
#define MOEQ_BENCH_H
#include <stdbool.h>
#include <stdint.h>
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
#endif
