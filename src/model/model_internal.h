/*
 * Helpers private to src/model: a collector of problems (config fields, tensors) reported
 * together in one error message.
 */
#ifndef MOEQ_MODEL_INTERNAL_H
#define MOEQ_MODEL_INTERNAL_H

#include "model/model.h"

typedef struct {
    char *buf;      /* "; "-separated problems */
    size_t len, cap;
    int n;          /* problems added */
    int n_shown;    /* problems that fit into the message */
} mq_problems;

void mq_problems_init(mq_problems *p);
void mq_problems_free(mq_problems *p);
void mq_problems_add(mq_problems *p, const char *fmt, ...) MQ_PRINTF(2, 3);
/* Sets the last error to "<prefix>: N problem(s): a; b; c (and K more)" and returns st. */
moeq_status mq_problems_error(const mq_problems *p, moeq_status st, const char *prefix_fmt, ...)
    MQ_PRINTF(3, 4);

/* ---- a GGUF read in place (load_gguf.c) ---------------------------------------------------------- */
struct mq_ggml_mat;
/* The [rows, cols] GGUF-backed view t as a mapped matrix (io/gguf_hf.h's view: its type, row
 * order and scale): MOEQ_E_UNSUPPORTED when the view is not of a type read in place (K-quants), is
 * merged (deepseek2's kv_b) or is not that shape; the caller then decodes it to fp32. */
moeq_status mq_gguf_map_mat(const mq_tensor_view *t, int64_t rows, int64_t cols,
                            struct mq_ggml_mat **out);
/* A Linear's weight view: Q4_0 / NVFP4 repacked into lin->qw (the packed Linear's kernels),
 * other types read in place through lin->gw; errors as mq_gguf_map_mat. */
moeq_status mq_gguf_map_linear(const mq_tensor_view *t, mq_linear *lin);
/* Routed experts v[part * E + e] (part 0 gate, 1 up, 2 down) plus, when shared, v[3E + part],
 * repacked into the MoE op's layout (Q4_0 / NVFP4 only, else MOEQ_E_UNSUPPORTED). */
moeq_status mq_gguf_map_experts(const mq_tensor_view *const *v, int E, bool shared,
                                const char *what, moeq_moe_experts **out);

#endif
