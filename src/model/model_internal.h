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
/* A valid cache's entry for the layer's experts / the Linear named name: made from its stored
 * layout (checked) over the mapped blob, and true; else false (none there; a layout failing its
 * checks also stops the cache's use for the rest of this open). Every one taken or packed here
 * is recorded (put: packed here, so the cache is written again; borrowed until commit), in load
 * order. */
bool mq_pack_cache_get_experts(mq_pack_cache *c, const char *name, moeq_moe_experts **out);
bool mq_pack_cache_get_weight(mq_pack_cache *c, const char *name, struct mq_packed_weight **out);
moeq_status mq_pack_cache_put_experts(mq_pack_cache *c, const char *name, const moeq_moe_experts *w);
moeq_status mq_pack_cache_put_weight(mq_pack_cache *c, const char *name,
                                     const struct mq_packed_weight *w);
/* Whether p is inside the mapped cache (such blobs are not freed). */
bool mq_pack_cache_owns(const mq_pack_cache *c, const void *p);
/* Writes the cache (temporary name, renamed) when this load packed anything; then it is no
 * longer needed but for the mapped blobs (close it with the model). */
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
