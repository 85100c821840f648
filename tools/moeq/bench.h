/* What the benchmarks share: bench moe-ffn's random experts, routing count and token list (its
 * CPU half bench_moe_ffn.c and GPU half bench_moe_ffn_cuda.c, bench_moe_common.c) and the GPU
 * half's options (the commands themselves are declared in commands.h). */
#ifndef MOEQ_BENCH_H
#define MOEQ_BENCH_H
#include <stdbool.h>
#include <stdint.h>

#include "moeq.h"

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

/* xorshift64 on *s (nonzero), and a standard normal from two of its draws (Box-Muller). */
uint64_t bench_rnd64(uint64_t *s);
float bench_rnd_normal(uint64_t *s);

/* Random canonical experts in host memory, E experts of gate_up [2F, D] and down [D, F]: codes
 * uniform in 0..15, INT4 scales (group G) bf16-exact floats, NVFP4 (G 16) E4M3 scales ~1..8 and
 * global scales 100. d describes h (moeq_moe_experts_pack, or the GPU's upload). */
typedef struct {
    uint8_t *guc, *dnc;
    void *gus, *dns;
    float *gg, *dg;
} bench_experts;
moeq_status bench_random_experts(int64_t E, int64_t D, int64_t F, int64_t G, bool nvfp4, uint64_t *rng,
                                 bench_experts *h, moeq_moe_experts_desc *d);
void bench_experts_free(bench_experts *h);

/* A tensor reference to p: nd dims of a, b, c, elements of es bytes. */
moeq_tensor_ref bench_ref(const void *p, moeq_dtype dt, int nd, int64_t a, int64_t b, int64_t c, size_t es);

/* How many distinct experts the top-k of x [T, D] picks under router [E, D] (the largest logits:
 * softmax keeps the order); used [E] and logits [T, E] are scratch. */
int64_t bench_distinct_experts(int64_t E, int64_t k, int64_t D, const float *router, const float *x, int64_t T,
                               uint8_t *used, float *logits);

/* "1,16,512": up to max token counts, each in 1 .. 2^20, into out; the number read, or -1. */
int bench_parse_tokens(const char *s, int64_t *out, int max);
#endif
