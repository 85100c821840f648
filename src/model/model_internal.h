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

/* ---- the packed-layout cache of a .gguf (pack_cache.c) -------------------------------------- */
typedef enum {
    MQ_PACK_CACHE_NONE = 0,   /* no cache (off, or nowhere to write one) */
    MQ_PACK_CACHE_MAPPED,     /* a valid cache mapped: nothing repacked */
    MQ_PACK_CACHE_BUILT,      /* none there: repacked, and written */
    MQ_PACK_CACHE_REBUILT,    /* one there but stale or damaged: ignored, repacked, written again */
} mq_pack_cache_state;
typedef struct mq_pack_cache mq_pack_cache;
/* The cache of the GGUF at src: mapped when valid (every check in pack_cache.c passed), else
 * ready to record; *out NULL when off. Fails only when src cannot be read. */
moeq_status mq_pack_cache_open(const char *src, mq_pack_cache **out);
mq_pack_cache_state mq_pack_cache_state_of(const mq_pack_cache *c);
const char *mq_pack_cache_path(const mq_pack_cache *c);
/* A valid cache's next blob (its size in *bytes), or NULL; the caller then says whether it took
 * it (the planned layout had that size) or not (the cache is then left and written again). */
const uint8_t *mq_pack_cache_peek(const mq_pack_cache *c, size_t *bytes);
void mq_pack_cache_taken(mq_pack_cache *c, bool ok);
/* Records the next blob of this load (borrowed until commit); packed_here: it was not mapped. */
moeq_status mq_pack_cache_add(mq_pack_cache *c, const uint8_t *blob, size_t bytes, bool packed_here);
/* Whether p is inside the mapped cache (such blobs are not freed). */
bool mq_pack_cache_owns(const mq_pack_cache *c, const void *p);
/* Writes the cache (temporary name, renamed) when this load packed anything. */
moeq_status mq_pack_cache_commit(mq_pack_cache *c);
void mq_pack_cache_close(mq_pack_cache *c);

/* ---- a GGUF read in place (load_gguf.c) ---------------------------------------------------------- */
struct mq_ggml_mat;
/* The [rows, cols] GGUF-backed view t as a mapped matrix (io/gguf_hf.h's view: its type, row
 * order and scale): MOEQ_E_UNSUPPORTED when the view is not of a type read in place (K-quants), is
 * merged (deepseek2's kv_b) or is not that shape; the caller then decodes it to fp32. */
moeq_status mq_gguf_map_mat(const mq_tensor_view *t, int64_t rows, int64_t cols,
                            struct mq_ggml_mat **out);
/* A Linear's weight view: Q4_0 / NVFP4 repacked into lin->qw (the packed Linear's kernels),
 * other types read in place through lin->gw; errors as mq_gguf_map_mat. */
moeq_status mq_gguf_map_linear(const mq_tensor_view *t, mq_linear *lin, mq_pack_cache *c);
/* Routed experts v[part * E + e] (part 0 gate, 1 up, 2 down) plus, when shared, v[3E + part],
 * repacked into the MoE op's layout (Q4_0 / NVFP4 only, else MOEQ_E_UNSUPPORTED). */
moeq_status mq_gguf_map_experts(const mq_tensor_view *const *v, int E, bool shared,
                                const char *what, mq_pack_cache *c, moeq_moe_experts **out);
/* Before freeing m's layers: the packed blobs that live in m's mapped cache are detached. */
void mq_gguf_detach_cached(moeq_model *m);

#endif
