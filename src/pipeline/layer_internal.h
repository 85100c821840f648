/*
 * Shared declarations of the files of one decoder layer, which layer.c drives (mq_pipe_layer):
 *   layer_read.c            the source's weights of each part read for its stage, and ahead of it
 *   layer_slots.c           slots: the Linears that share one input's Hessian, and that Hessian
 *   layer_quantize.c        GPTQ/RTN of the slots, the checkpoint's writes, plain RTN, pass-through
 *   layer_attention.c       the attention stage (CPU or GPU), its Hessians across ranks
 *   layer_ffn.c             the FFN stage: routed experts by chunk, shared expert, dense MLP
 *   layer_expert_batches.c  a chunk of routed experts over every sample, in batches
 * What the pipeline's other files call is declared in internal.h.
 */
#ifndef MOEQ_PIPELINE_LAYER_INTERNAL_H
#define MOEQ_PIPELINE_LAYER_INTERNAL_H

#include "pipeline/internal.h"

/* MOEQ_E_INTERRUPTED once the run is asked to stop (checked between samples and tensors). */
moeq_status mq_pipe_check_interrupt(void);

/* ---- layer_read.c ---- */
/* Starts reading parts `what` of layer l (experts [e0, e1)) ahead of their stage, where the plan
 * reads ahead (mp.read_ahead) and nothing else is being read ahead. */
moeq_status mq_pipe_start_ahead(mq_pipe *p, int l, unsigned what, int e0, int e1);
/* The parts the attention stage reads. */
unsigned mq_pipe_attention_parts(const mq_pipe *p, int l);
/* Parts `what` of layer l into fp32 (alloc_only: those whose buffers are only allocated), timed as
 * the layer's read; freed by mq_pipe_drop_part. */
moeq_status mq_pipe_read_part(mq_pipe *p, int l, unsigned what, int e0, int e1,
                              bool (*alloc_only)(float **dest, void *user), void *user);
void mq_pipe_drop_part(mq_pipe *p, int l, unsigned what, int e0, int e1);

/* ---- layer_slots.c: the Linears that read one input and share its Hessian ---- */
typedef struct {
    mq_linear *w[3];
    const mq_plan_item *it[3];
    int nw;                       /* Linears of the slot that the plan quantizes */
    int expert;                   /* routed expert, else -1 */
    bool down;                    /* reads the SwiGLU product (an MLP's down projection) */
    mq_how how;
    mq_hessian h;                 /* the sum while calibrating (on the GPU: h.n, and h.sum
                                     receives H at the end) */
    mq_gpu_hessians *gh;          /* the sum on the GPU (runs with a device), else NULL */
    float *H;                     /* the Hessian GPTQ uses (NULL: RTN or the block Hessian) */
    float *Hh;                    /* damping sweep: the Hessian of the held-out rows, else NULL */
    int64_t hold;                 /* damping sweep, routed expert: its rows before the held-out
                                     samples */
    int64_t n_fit, n_held;        /* damping sweep: rows before / of the held-out samples */
    int64_t tokens;
    float amax;                   /* W4A4: the input's amax over the calibration */
    float *G;                     /* asymmetric calibration: sum x_f x_q^T over the Hessian's rows
                                     (mq_cross_det_acc), else NULL */
    int64_t g_rows;
    int owner;                    /* the rank that calibrates and quantizes it */
    int lown[3];                  /* the rank that quantizes each of its Linears (owner, or with
                                     several ranks one each for the attention's Linears; each
                                     such rank then holds the slot's Hessian) */
    bool held;                    /* with several ranks: its results wait in q/qs for
                                     mq_pipe_share_slots */
    mq_qtensor q[3];
    mq_gptq_stats qs[3];
} mq_slot;

/* Whether this rank quantizes a Linear of slot s (and so holds its Hessian). */
bool mq_slot_mine(const mq_pipe *p, const mq_slot *s);
/* The slot and all its Linears to rank r. */
void mq_slot_own(mq_slot *s, int r);
/* The Linears among a, b, c (NULL or unnamed: none) that the plan quantizes, owned by this rank. */
void mq_slot_set(mq_pipe *p, mq_slot *s, int expert, bool down, mq_linear *a, mq_linear *b,
                 mq_linear *c);
/* Frees the Hessian sums and H (the held results stay); mq_slot_free frees all of it. */
void mq_slot_drop_sums(mq_slot *s);
void mq_slot_free(mq_slot *s);
/* The damping sweep's first held-out sample of n. */
int64_t mq_first_held_out_sample(int64_t n);
/* Starts the Hessian sum of a slot GPTQ will use (and the cross sum beside it, asymmetric
 * calibration). */
moeq_status mq_slot_hessian(mq_pipe *p, mq_slot *s);
/* Adds rows [rows, K] to the slot's sum; to its cross sum, the two streams' rows of the same
 * tokens. */
moeq_status mq_slot_add(mq_slot *s, const float *x, int64_t rows);
void mq_slot_cross(mq_slot *s, const float *xf, const float *xq, int64_t rows);
/* Asymmetric calibration: the GPTQ slots of a[0..na) and b[0..nb) moved toward the unquantized
 * model's outputs (timed as the GPTQ stage). */
moeq_status mq_pipe_target_slots(mq_pipe *p, int l, mq_slot *a, int na, mq_slot *b, int nb);
/* Whether a slot's Hessian stays on the GPU for GPTQ, formed there from its sum. */
bool mq_slot_keeps_device_sum(const mq_pipe *p, const mq_slot *s);
/* The Hessian from the sum, in place; _timed counts it as the layer's Hessian stage. */
moeq_status mq_slot_form(const mq_pipe *p, mq_slot *s);
moeq_status mq_slot_form_timed(mq_pipe *p, int l, mq_slot *s);
/* *a = max(*a, max |x|) over n values (a NaN never wins). */
void mq_amax_update(float *a, const float *x, int64_t n);

/* ---- layer_quantize.c ---- */
/* Quantizes every Linear of slots[0..n) this rank owns and writes it (several ranks: holds it for
 * mq_pipe_share_slots); block_H: the MoE block's Hessian of the fallback's gate/up slots. */
moeq_status mq_pipe_quantize_slots(mq_pipe *p, int l, mq_slot *slots, int n, float *block_H);
/* A replay: the slots' quantized weights read back from the checkpoint. */
moeq_status mq_pipe_read_back_slots(mq_pipe *p, mq_slot *slots, int n);
/* Several ranks: each quantized Linear from its owner to every rank, then written and recorded. */
moeq_status mq_pipe_share_slots(mq_pipe *p, int l, mq_slot *slots, int n);
/* Writes and records a GPU chunk's pending Linears (write false: only frees them). */
moeq_status mq_pipe_write_pending(mq_pipe *p, bool write);

/* ---- layer_attention.c ---- */
/* The attention stage of layer l: its calibration passes and the quantization of its Linears
 * (replay: only the passes, from what the checkpoint holds). */
moeq_status mq_pipe_attention_stage(mq_pipe *p, int l, bool replay);

/* ---- layer_ffn.c ---- */
/* Where a step of the FFN stage takes its inputs: the kept FFN input (XN) or the FFN norm of the
 * boundary after attention, and which routing. */
typedef struct {
    bool from_xn;
    const int32_t *sel;
    const float *w;
    bool fp;                      /* the unquantized stream's (asymmetric calibration): the FFN
                                     norm of XF, its routing, the outputs into OUTF */
} mq_ffn_source;

/* The unquantized stream's source (asymmetric calibration). */
mq_ffn_source mq_pipe_fp_source(const mq_pipe *p);
/* Sample s's FFN input from src: a view of XN, or the FFN norm of the boundary into scratch. */
const float *mq_pipe_ffn_input(mq_pipe *p, int l, const mq_ffn_source *src, int64_t s,
                               float *scratch);
/* The activation buffer that receives h (the boundary after attention), to which the FFN's
 * outputs are added: the next boundary. */
mq_actbuf *mq_pipe_out_buf(mq_pipe *p);
/* Whether layer l's routed experts run on the GPU with their outputs combined there. */
bool mq_pipe_experts_on_device(const mq_pipe *p, int l, bool replay);
/* The device buffers that hold the experts' inputs from the GPU attention (p->gffn_xn, gffn_h,
 * gbound and gin): made for layer l where they fit, or freed. */
moeq_status mq_pipe_gpu_ffn_inputs_new(mq_pipe *p, int l, bool replay);
void mq_pipe_gpu_ffn_inputs_free(mq_pipe *p);
/* Whether the GPU attention's boundary (h) / kept FFN input (XN) need no host copy. */
bool mq_pipe_boundary_device_only(const mq_pipe *p, bool pass_a);
bool mq_pipe_xn_device_only(const mq_pipe *p);
/* XN's host copy from the device's, where the attention left it there only. */
moeq_status mq_pipe_xn_to_host(mq_pipe *p, int l);
/* The FFN stage of layer l: its routed experts; the shared expert or the dense MLP. */
moeq_status mq_pipe_routed_experts(mq_pipe *p, int l, bool replay);
moeq_status mq_pipe_mlp_unit(mq_pipe *p, int l, bool shared, bool replay);

/* ---- layer_expert_batches.c ---- */
/* Every sample (own: this rank's) through experts [e0, e1) in batches: Hessians and amax into the
 * gate/up and down slots gu, dn, and/or (down) the outputs combined into OUT or OUTF. */
moeq_status mq_pipe_experts_pass(mq_pipe *p, int l, int e0, int e1, mq_ffn_source src, bool down,
                                 bool hess, bool amax, mq_slot *gu, mq_slot *dn, bool own,
                                 bool *fp_done);
/* Whether experts [e0, e1) are plain fp32 Linears the GPU can run (read: once their weights are
 * in memory); the chunk's experts on the GPU where they are, else *out NULL. */
bool mq_pipe_experts_plain_as(const mq_pipe *p, int l, int e0, int e1, bool read);
moeq_status mq_pipe_gpu_experts(mq_pipe *p, int l, int e0, int e1, bool down, int64_t rows,
                                mq_gpu_mlp **out);
/* MOEQ_DEBUG_PROFILE with a GPU: logs the seconds of layer l's expert batches by step, then zeroes
 * them. */
void mq_expert_batches_profile_log(int l);

#endif
