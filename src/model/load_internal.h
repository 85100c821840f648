/*
 * What load.c (whole models) and load_lazy.c (the lazy model) share: the list of tensors a model
 * wants, and the steps of an open.
 */
#ifndef MOEQ_MODEL_LOAD_INTERNAL_H
#define MOEQ_MODEL_LOAD_INTERNAL_H

#include "io/gguf_hf.h"
#include "model/model_internal.h"

/* One fp32 destination filled from (a slice of) one checkpoint tensor. */
typedef struct {
    char *name;
    int ndim;
    int64_t shape[3];
    float **dest;
    int64_t off, count;   /* elements [off, off + count) of the tensor */
    int layer;            /* -1 for the embeddings, final norm and lm_head */
    const mq_tensor_view *t;
    char *module;         /* a Linear's weight: its module name (may be stored quantized) */
    bool quantized;       /* module.weight absent, a quantized layout present */
    mq_linear *lin;       /* the decoder Linear this weight belongs to, or NULL */
    int expert;           /* routed expert index, n_experts for the shared expert, else -1 */
    int part;             /* expert weights: 0 gate, 1 up, 2 down */
    bool packed;          /* kept packed: no fp32 copy is made */
    unsigned what;        /* the MQ_PART_* it belongs to (lazy loading) */
    int64_t bytes;        /* fp32 bytes of its destination */
} want;

typedef struct {
    want *w;
    size_t n, cap;
    bool oom;
    unsigned what;        /* MQ_PART_* of the wants being added */
} want_list;


moeq_status mq_want_piece_to_f32(const want *w, int64_t k0, int64_t k1);
void mq_want_free(want_list *L);
moeq_status mq_pack_layers(want_list *L, const mq_st *st, moeq_model *m, int l0, int l1,
                           int *n_fallback, mq_pack_cache *c);
moeq_status mq_open_tokenizer(const char *path, const mq_gguf_docs *docs, moeq_tokenizer **tok);
moeq_status mq_open_source(const char *path, bool tokenizer, mq_config *given, mq_config *cfg,
                           mq_st **st, mq_gguf_docs *docs);
void mq_fill_info(moeq_model *m);
moeq_status mq_check_wants(want_list *L, const mq_st *st, const moeq_model *m, const char *dir);
moeq_status mq_build_wants(want_list *L, const mq_st *st, moeq_model *m);
moeq_status mq_map_float_head(want_list *L, moeq_model *m, bool mark);

#endif
