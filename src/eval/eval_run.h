/*
 * The state of one moeq_eval run, shared by its two forwards: ppl.c runs each window through a
 * whole model in memory (a pool task per window), stream.c runs every window through layer l
 * before layer l + 1 with the weights read a layer at a time (models opened with stream). Both
 * hand the final-normed hidden states of a window's scored rows to mq_eval_score_window, so the
 * scores, their order of summation and the results are the same.
 */
#ifndef MOEQ_EVAL_RUN_H
#define MOEQ_EVAL_RUN_H

#include <stdatomic.h>

#include "eval/eval.h"
#include "model/model.h"

enum { CHUNK = 128 }; /* lm_head rows per call: bounds the [rows, vocab] logits scratch */

/* Per-thread scratch. The forward part (states, hidden states, window ids) serves the whole-model
 * forward; the scoring part (logits and what scoring needs) both forwards. */
typedef struct {
    bool ready, scoring_ready;
    mq_state *st, *st_base;
    float *x, *xb;    /* [L, D] hidden states of the model / the base */
    float *lg, *lgb;  /* [CHUNK, V] logits */
    int32_t *ids;     /* [L] window input */
    uint8_t *mark;    /* [V] for mq_kl_topk */
    uint32_t *tk_ids; /* [k] */
    float *tk_vals;   /* [k] */
    uint8_t *rec;     /* [L * record] a window's saved records */
    float *zeros;     /* [V] for mq_entropy_row */
} mq_eval_scratch;

typedef struct {
    const moeq_model *m, *base;
    const moeq_docs *docs;
    moeq_eval_task task;
    int32_t L, prefix;
    int add_bos;
    int64_t V, n_docs;
    int32_t **tok;      /* [n_docs] token ids */
    int64_t *ntok;      /* [n_docs] */
    int64_t *tok_off;   /* [n_docs + 1] global index of each document's first token */
    int64_t *win_first; /* [n_docs + 1] each document's first window */
    mq_window *win;
    int32_t *win_doc;
    int64_t n_win;
    double *win_ll;
    uint8_t *win_done;
    float temperature;  /* 1: logits unchanged */
    double *tok_ent;    /* entropy per scored token (global index), or NULL */
    /* KL per scored token (global index) */
    bool kl;
    double *tok_kl, *tok_bound;
    double *tok_llb;    /* the base's log-likelihood of each scored token (kl_base) */
    uint8_t *tok_changed;
    /* saved logits: writing (save_fd >= 0) and reading (kl_data) */
    int save_fd;
    uint32_t save_k;
    const char *save_path;
    const uint8_t *kl_data;
    uint32_t kl_k;
    mq_eval_scratch *sc;
    int n_sc;
    atomic_int_fast64_t tokens_done;
    int64_t tokens_total;
    atomic_int failed;
    moeq_status err;
    char errmsg[1024];
    uint64_t ids_checksum;   /* of every document's token ids (stream.c's resume identity) */
    /* Ranks of an mpirun job: this rank runs windows [w_lo, w_hi) (all of them in one process)
     * and rank 0 gathers the scores (ppl.c) */
    int64_t w_lo, w_hi;
} mq_eval_ctx;

/* Records the first failure of a pool task (the message lives in that thread's last error). */
void mq_eval_task_fail(mq_eval_ctx *c, moeq_status st);
/* Allocates s's scoring part (idempotent). */
moeq_status mq_eval_scoring_init(mq_eval_ctx *c, mq_eval_scratch *s);
/* Scores window wi from the final-normed hidden states of its scored rows: xm (the model's,
 * [n_score, D]) and xb (the base's, or NULL without kl_base); sets win_ll[wi], the per-token
 * arrays and the saved logits' records. */
moeq_status mq_eval_score_window(mq_eval_ctx *c, mq_eval_scratch *s, int64_t wi, const float *xm,
                                 const float *xb);

/* The streamed forward (stream.c): every window through the models opened with stream, layer by
 * layer, then scored; fills win_ll and win_done as the whole-model forward does. A model opened
 * whole (the base, say) runs its layers from memory in the same passes. */
moeq_status mq_eval_stream(mq_eval_ctx *c, const moeq_eval_options *o, moeq_eval_result *res);
/* The plan alone (moeq_eval_options.dry_run): res->plan filled, nothing run. */
moeq_status mq_eval_stream_plan_only(mq_eval_ctx *c, const moeq_eval_options *o, moeq_eval_result *res);

#endif
