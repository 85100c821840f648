/*
 * moeq_eval on a CUDA device (moeq_eval_options.device >= 0): the streamed forward's layer pass
 * and its scoring on the GPU backend's pieces (backend/gpu.h), driven by stream.c. Layer by
 * layer, each model's layer weights (fp32, as the loader left them in m->layers[l]) go up once;
 * the windows go through in groups of whole windows: attention, FFN norm and routing
 * (mq_gpu_attn_run_samples, a window a sample from position 0), the routed experts over all of
 * the group's rows (gathered on the device) and their combine, the shared expert (gated) or the
 * dense MLP, the residual; only the group's rows cross the bus, once each way. Scoring: the final
 * norm, lm_head and the per-token statistics of each window on the device (mq_gpu_head_score),
 * summed on the host in mq_eval_score_window's order.
 *
 * What differs from the CPU's results is only the order of the products' sums: see
 * docs/eval.md and tests/test_gpu_eval.c for the tolerance. Every step is a function of its row
 * (or window) alone, so in fp32 the results do not depend on how windows are grouped.
 */
#ifndef MOEQ_EVAL_GPU_H
#define MOEQ_EVAL_GPU_H

#include "backend/gpu.h"
#include "eval/eval_run.h"

typedef struct mq_eval_gpu mq_eval_gpu;

/* What the GPU path cannot run, checked before any work: MOEQ_E_UNSUPPORTED naming the feature
 * of model m (role: "the model", "--kl-base") - a family without GPU kernels (multi-head latent
 * attention), sigmoid or group-limited routing, the emulated activation quantizer, packed
 * quantized weights (keep_packed), MLP biases, a nonstandard softmax scale or rotary layout. */
moeq_status mq_eval_gpu_check(const moeq_model *m, const char *role);

/* The same checks for any GPU driver (generation too): what m has that the GPU pieces lack, a
 * phrase (in buf where it names the model type), or NULL; packed_ok: packed quantized weights
 * are fine (the driver reads the checkpoint's codes itself). */
const char *mq_gpu_model_lacks(const moeq_model *m, bool packed_ok, char *buf, size_t n);

/* Opens device o->device with o->gpu_precision for the nm models of c (their per-layer
 * attention twins, the group buffers). */
moeq_status mq_eval_gpu_open(mq_eval_ctx *c, const moeq_eval_options *o, int nm, const moeq_model *const *m,
                             mq_eval_gpu **out);
void mq_eval_gpu_close(mq_eval_gpu *G);
/* "cuda:N NAME (precision)" for the result. */
void mq_eval_gpu_describe(const mq_eval_gpu *G, char *buf, size_t n);
/* Page-locks host memory the groups go up from and come back into (best effort; false: it
 * stays pageable); undone by mq_eval_gpu_unpin. */
bool mq_eval_gpu_pin(mq_eval_gpu *G, void *p, size_t bytes);
void mq_eval_gpu_unpin(void *p);
/* Rows of windows a group holds at most (at least the longest window). */
int64_t mq_eval_gpu_group_rows(const mq_eval_gpu *G);

/* Layer l of model k: its weights (loaded in m->layers[l]) up to the device; the host's copy
 * may be freed when this returns. */
moeq_status mq_eval_gpu_layer_begin(mq_eval_gpu *G, int k, int l);
/* The windows [w0, w1) through the layer: x holds their rows back to back (host; rows of the
 * model's D), replaced by the layer's output. */
moeq_status mq_eval_gpu_layer_run(mq_eval_gpu *G, int64_t w0, int64_t w1, float *x);
void mq_eval_gpu_layer_end(mq_eval_gpu *G);

/* The boundary on the device: every window's rows of each model (host[k]: rows x D[k], the
 * embeddings or a resumed layer's output) go up once and stay there from layer to layer, so that
 * only the weights cross the bus; false (nothing kept) where they would take more than half of
 * the device's free memory. Then mq_eval_gpu_layer_run_at runs windows [w0, w1) on the device's
 * rows from r0 (their first row) in place, and mq_eval_gpu_resident_read brings model k's rows
 * back (before the scores or a snapshot). */
bool mq_eval_gpu_resident_begin(mq_eval_gpu *G, int64_t rows, const float *const *host, const int64_t *D);
moeq_status mq_eval_gpu_layer_run_at(mq_eval_gpu *G, int64_t w0, int64_t w1, float *x, int64_t r0);
moeq_status mq_eval_gpu_resident_read(mq_eval_gpu *G, int k, float *host);

/* Scoring: every model's final norm and lm_head (loaded) up to the device; the host's copies may
 * be freed when this returns. */
moeq_status mq_eval_gpu_head_begin(mq_eval_gpu *G);
/* Window wi from the hidden states of its scored rows before the final norm (xm the model's, xb
 * the base's or NULL): what mq_eval_score_window sets, from the device's per-token values. */
moeq_status mq_eval_gpu_score_window(mq_eval_gpu *G, int64_t wi, const float *xm, const float *xb);

/* Tests: groups of at most this many rows (0: the default); at least one window each. */
void mq_eval_set_gpu_group_rows(int64_t rows);
/* Tests: false keeps the boundary on the host (each group's rows cross the bus every layer). */
void mq_eval_set_gpu_resident(bool on);

/* The parts of layer l of model k (MQ_PART_*) the host loads for mq_eval_gpu_layer_begin: the
 * whole layer, or without the routed experts where the GPU reads their codes itself (bf16, a
 * streamed checkpoint whose experts are stored NVFP4 or INT4). */
unsigned mq_eval_gpu_layer_parts(const mq_eval_gpu *G, int k, int l);

/* The host's half of the routed experts on the fp32 expert sets (mq_gpu_mlp), forward.c's
 * moe_block order, for up to R rows of K choices among E experts: the routing sel, w [R, K] (the
 * attention writes it), the expert-major slots (tokens in increasing order within an expert:
 * list [R*K] the token of each slot, slot [R, K] the slot of each choice, start [E + 1] each
 * expert's first slot; cnt [E + 1] scratch), the combine's pairs (tok [R] = t, first [R + 1],
 * crow/cw [R*K]: each token's slots and weights in increasing expert order), and ident [R] =
 * 0 .. R - 1 (mq_gpu_one_mlp_rows). _alloc: false where memory runs out (the caller names what
 * for; _free releases what was had). */
typedef struct {
    int32_t *sel;
    float *w;
    int32_t *cnt, *start, *list, *slot;
    int64_t *tok;
    int32_t *first, *crow, *ident;
    float *cw;
} mq_gpu_routes;
bool mq_gpu_routes_alloc(mq_gpu_routes *r, int64_t R, int64_t K, int64_t E);
void mq_gpu_routes_free(mq_gpu_routes *r);
/* out [R, D] (device) = the routed experts of `set` on the R rows of the FFN input xn, the
 * routing r->sel, r->w of R rows: out zeroed, the layout, the experts' rows, each token's sum.
 * MOEQ_E_NUMERIC for an expert id out of range. */
moeq_status mq_gpu_routes_run(mq_gpu_routes *r, mq_gpu_mlp *set, mq_gpu_buf *xn, mq_gpu_buf *out, int64_t R,
                              int64_t D, int64_t K, int64_t E);
/* One MLP (an expert set of E = 1: a shared expert, a dense MLP) over the R rows of D values at
 * the start of xn (device), its outputs kept for mq_gpu_mlp_add_kept; ident [R] = 0 .. R - 1. */
moeq_status mq_gpu_one_mlp_rows(mq_gpu_mlp *m, mq_gpu_buf *xn, const int32_t *ident, int64_t R);

/* A quantized checkpoint's routed experts of one layer in the GPU MoE op's canonical form
 * (eval_gpu_experts.c): codes and scales as stored, read from st by each expert Linear's name. */
typedef struct {
    moeq_moe_experts_desc desc;
    moeq_moe_zero_points zp;
    bool has_zp;
    uint8_t *gu_codes, *dn_codes, *gu_scales, *dn_scales, *gu_zero, *dn_zero;
    float *gu_global, *dn_global;
} mq_gpu_experts;
/* MOEQ_E_UNSUPPORTED where the op cannot take them (another scheme, act-order groups, experts
 * stored unlike each other): the caller loads them as fp32 instead. */
moeq_status mq_gpu_experts_read(const mq_st *st, const mq_config *cf, const mq_layer *ly, int l, mq_gpu_experts *x);
void mq_gpu_experts_free(mq_gpu_experts *x);

#endif
