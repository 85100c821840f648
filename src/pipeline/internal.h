/*
 * Shared state of the pipeline's files: pipeline.c (the driver), layer.c (one decoder layer; its
 * stages' files in layer_internal.h), memplan.c (the memory plan), workdir.c (manifest,
 * activation snapshots, resume), report.c.
 */
#ifndef MOEQ_PIPELINE_INTERNAL_H
#define MOEQ_PIPELINE_INTERNAL_H

#include <cjson/cJSON.h>

#include "backend/gpu.h"
#include "export/writer.h"
#include "model/model.h"
#include "model/rotate.h"
#include "pipeline/pipeline.h"
#include "pipeline/plan.h"
#include "quant/hessian.h"
#include "stream/engine.h"

/* Activations of every calibration sample at the layer boundary, [S][Lmax][D] (rows past a
 * sample's length unused), are the streaming engine's boundary store (stream/boundary.h). */

/* How one Linear was quantized (the report's "method"). */
typedef enum { MQ_HOW_GPTQ = 0, MQ_HOW_GPTQ_BLOCK_HESSIAN, MQ_HOW_RTN } mq_how;
const char *mq_how_name(mq_how h);   /* "gptq", "gptq-block-hessian", "rtn" */

typedef struct {
    char *module;
    int layer, expert;            /* expert -1 unless a routed expert */
    int64_t tokens;               /* calibration rows of its Hessian */
    mq_how how;
    mq_gptq_stats stats;          /* loss/rtn_loss NaN for RTN */
    const char *type;             /* a K-quant file's block type ("q4_K"), else NULL */
} mq_mod_report;

typedef struct {
    int layer;
    double forward, hessian, gptq, write, total;   /* seconds */
    double attention;             /* the part of forward in the attention passes */
    /* process CPU seconds of the same stages (mq_layer_stats) */
    double cpu_forward, cpu_hessian, cpu_gptq, cpu_write, cpu_total, cpu_attention;
    double read, cpu_read;        /* reading the layer's weights into fp32 (and freeing them) */
    double wait, exchange;        /* several ranks: waiting for the others, moving data */
    double pooled;                /* of total: in the pool's parallel loops (mq_pool_seconds) */
    double sim_tasks, sim_span;   /* under mq_pool_simulate: the loops' task seconds, their schedule */
    double snapshot;              /* the work directory's record of the layer and the snapshot of
                                     the boundary after it (written, synced) */
    double snapshot_sync, snapshot_copy;   /* of which: waiting for the record before, the boundary copied */
    int64_t peak_anon;
    int chunks;
    int linears;                  /* quantized Linears written */
    /* with a GPU: expert batches whose rows stayed on the device, those of them that read their
     * inputs where the GPU attention left them; the outputs combined there (report, tests) */
    int gpu_device_batches, gpu_kept_inputs;
    bool gpu_combined;
    bool gpu_experts_ahead;       /* its first expert chunk went up during the attention */
    bool gpu_residual;            /* the FFN's outputs were added to the boundary there */
    bool gpu_h_device_only;       /* the attention's result (the boundary) was not copied back */
    bool gpu_xn_device_only;      /* nor the kept FFN input, all through the layer */
    int gpu_inputs_from_device;   /* attention passes that took X from the device (gin) */
    cJSON *modules;               /* the layer's module records (report), owned */
} mq_layer_report;

/* ---- expert-balanced calibration (balance.c) ---- */
/* Streams candidate samples through the unquantized model and counts the tokens each routes to
 * each expert of each MoE layer: buffers for groups of up to `group` samples of up to max_len
 * tokens, routed experts loaded `chunk` at a time (0: all). */
typedef struct {
    mq_lazy_model *lz;
    moeq_model *m;
    int64_t G, Lmax;
    int chunk;
    int *moe_index;               /* [n_layers]: the layer's place among the MoE layers, or -1 */
    int n_moe, last_moe;          /* MoE layers; the last one (the pass stops there) */
    float *x, *xn, *out;          /* [G][Lmax][D] */
    float *probs, *wt, *mlp_scratch, *scratch;
    int32_t *sel;                 /* [G][Lmax][K] */
    int64_t *rows, *start;        /* the rows of each expert, sorted by expert */
    size_t per_thread;
    mq_state *state;
} mq_balance_counter;
moeq_status mq_balance_counter_init(mq_balance_counter *k, mq_lazy_model *lz, int64_t group,
                                    int64_t max_len, int chunk);
void mq_balance_counter_free(mq_balance_counter *k);
/* Samples [s0, s0 + g) of pool: counts[s][moe layer][expert] += tokens routed there (counts
 * [pool.n][n_moe][E], zeroed by the caller). progress(user, g) after each layer up to the last
 * MoE layer (the pass ends there). */
moeq_status mq_balance_count_group(mq_balance_counter *k, const mq_calib_set *pool, int64_t s0,
                                   int64_t g, int32_t *counts, void (*progress)(void *, int64_t),
                                   void *user);
/* Greedy choice of `want` of the n candidates (rows of `width` counts) maximising the sum of
 * log(1 + total count) over the columns; chosen[want] in increasing order. */
moeq_status mq_balance_select(const int32_t *counts, int64_t n, int64_t width, int64_t want,
                              int64_t *chosen);
struct mq_pipe;
#define MQ_BALANCE_RECORD "calib-choice.json"   /* in the work directory */
/* p->calib holds the candidates: keeps the o->calib.nsamples chosen (a dry run, or a model
 * without routed experts: the first ones), after planning the run's memory (MOEQ_E_NOMEM as the
 * run would give). Several ranks each stream their share of the candidates. */
moeq_status mq_pipe_balance(struct mq_pipe *p);
/* --target-bpw (kquant_budget.c): a probe of the unquantized model measures each tensor group's
 * sensitivity to each block type, and p->recipe.table gets the types that meet the budget (its
 * record in p->budget_json). Before the plan. */
moeq_status mq_pipe_kquant_budget(struct mq_pipe *p);

typedef struct mq_pipe {
    const mq_pipeline_opts *o;
    const char *model_dir;
    char *out_dir;                /* without trailing slashes */
    char *work_dir, *build_dir;   /* build_dir: work_dir/out, the checkpoint being assembled */
    cJSON *src_config;
    /* the source's config.json read once (pipeline.c read_source): its FP8 block size, and its
     * mq_config where the run needs one (calibration takes it into the lazy model, the
     * rotation reads it) */
    mq_fp8_blocks src_fp8;
    mq_config src_cfg;
    bool mixtral;
    mq_st *st;                    /* the source (borrowed from lz when calibrating) */
    mq_lazy_model *lz;            /* NULL for plain RTN */
    bool rotated;                 /* the residual stream is rotated (o->rotate_block): every
                                     weight read from the source goes through rot */
    mq_rotation rot;
    int64_t rot_bytes;            /* the largest rotated tensor written unquantized: its bytes in
                                     the source dtype plus an fp32 piece (memory plan) */
    moeq_model *m;
    const mq_config *c;
    mq_out_plan plan;
    mq_gguf_recipe recipe;         /* K-quants: each tensor's type (kquant_recipe in pipeline.c) */
    int8_t *recipe_table;          /* --target-bpw's choice (recipe.table), else NULL */
    cJSON *budget_json;            /* --target-bpw's choice and sensitivities, for the report */
    int *decl_layer;              /* layer of each output tensor (-1 global) */
    uint8_t *item_done;           /* [plan.n_items] written by this run */
    mq_ckpt_writer *w;
    mq_ckpt_opts ckpt_opts;
    uint64_t plan_bytes;          /* tensor data of the checkpoint */
    mq_calib_set calib;
    bool calibrate, seq, tseq;
    mq_mem_plan mp;
    int64_t LD;                   /* Lmax * D: values per sample in the buffers */
    mq_actbuf X, X2, XN, OUT;     /* X2: the next boundary when X is a file (else X is updated) */
    /* asymmetric calibration (o->target_share > 0, sequential): the unquantized model's stream
     * beside the quantized one: XF its boundary (updated in place: h after the attention, then
     * the boundary after the layer), OUTF its FFN outputs, sel_f/w_f its routing
     * (layer_attention.c) */
    bool target;
    mq_actbuf XF, OUTF;
    int32_t *sel_f;
    float *w_f;
    int32_t *sel_a, *sel_b;       /* [S][Lmax][K] */
    float *w_a, *w_b;
    mq_state *state;
    mq_gpu *gpu;                  /* GPTQ's device (o->device >= 0), else NULL */
    struct mq_gpu_opening *opening;   /* the device being opened beside the start (pipeline.c) */
    mq_gpu_attn *gatt;            /* the attention's calibration forward on that device (made at
                                     the first layer it can run, layer_attention.c), else NULL */
    mq_gpu_mlp *gx;               /* routed experts [gx_e0, gx_e1) on that device for a whole
                                     chunk: both calibration passes and GPTQ's inputs, which GPTQ
                                     replaces by the dequantized weights (layer_ffn.c,
                                     layer_quantize.c), else NULL */
    int gx_e0, gx_e1;
    mq_gpu_mlp *gx_ahead;         /* layer gx_ahead_l's first expert chunk, [0, gx_ahead_e1), read
                                     and sent up while its attention ran (layer_attention.c
                                     experts_ahead), for mq_pipe_routed_experts to take as gx,
                                     else NULL */
    int gx_ahead_l, gx_ahead_e1;
    mq_readahead ahead;           /* parts of a layer being read on the CPU ahead of their stage
                                     (layer_read.c mq_pipe_start_ahead; the engine's slot) */
    struct mq_pending_write *pending;   /* a GPU chunk's quantized Linears still to be written
                                           while the device runs its quantized pass
                                           (layer_quantize.c) */
    mq_gpu_buf *gout;             /* the routed experts' FFN outputs of a layer on that device,
                                     combined there and read back once (layer_ffn.c), else
                                     NULL */
    mq_gpu_buf *gffn_xn, *gffn_h; /* the routed experts' inputs as the GPU attention left them
                                     there (the kept FFN input; the FFN norm of the boundary after
                                     attention), Lmax rows a sample, else NULL (layer_ffn.c) */
    mq_gpu_buf *gin;              /* the layer's input (X) on the device too, laid out as those:
                                     kept by its first attention pass for the second, or handed
                                     on by the layer before (its boundary there, layer_ffn.c) */
    bool gin_ready;               /* gin holds the next attention's input (X's bits) */
    bool xn_device_only;          /* XN's host copy was not made: gffn_xn holds the layer's kept
                                     FFN input (layer_ffn.c mq_pipe_xn_to_host) */
    mq_gpu_buf *gbound;           /* the boundary after attention there too, laid out as those,
                                     for the residual add of the FFN's outputs on the device
                                     (layer_ffn.c mq_pipe_gpu_ffn_inputs_new), else NULL */
    /* ranks (src/dist; pipeline.h "Distributed runs"): this process is `rank` of `ranks`; rank
     * 0 alone has the writer and the work directory (p->w NULL elsewhere) */
    int rank, ranks;
    int64_t s_lo, s_hi;           /* the samples whose FFN outputs this rank computes */
    /* progress, in the plan's estimated MFLOP (the engine's counter) */
    mq_engine_progress progress;
    int64_t units_run0;           /* units done when this run's first layer began (the rate of
                                     the ETA counts this run's work only, not resumed layers) */
    struct {
        int64_t attention_sample;   /* one sample through a layer's attention */
        int64_t expert;             /* one routed expert: calibration, GPTQ, output */
        int64_t mlp, shared;        /* a dense layer's MLP; a MoE layer's shared expert (the
                                       first k layers of DeepSeek-V3 are dense, 9x as wide) */
        int64_t rtn_layer;          /* plain RTN of one layer */
    } mp_units;
    /* report */
    mq_layer_report *layers;      /* [n_layers] */
    int layers_done;              /* layers finished (this run or before) */
    double since_snapshot;        /* seconds of layers since the last activation snapshot */
    /* the layer loop on the engine (pipeline.c run_layers): a resume's replay of finished layers,
     * what its log line adds, and when the layers that are not replays started */
    bool replay;
    char replay_from[96];
    double t_layers;
    double snapshot_cost;         /* seconds the last one took to write (workdir.c) */
    struct mq_snap_job *snap_bg;  /* a snapshot being written behind the next layer, or NULL */
    struct mq_rec_job *rec_bg;    /* a layer's record being made durable behind the next, or NULL */
    double share_gptq;            /* several ranks: the weight of an expert's GPTQ against its
                                     tokens' calibration in the shares of the experts, relative to
                                     their FLOPs (1; fitted to the seconds measured on the ranks
                                     with fit_shares: layer_ffn.c) */
    bool fit_shares;              /* MOEQ_DIST_SHARES=measured as rank 0 has it (every rank gathers
                                     and fits alike, whatever its own environment) */
    float *snap_spare;            /* the last snapshot's copy buffer, kept for the next (the plan
                                     counts it for the whole run: a fresh one costs the kernel's
                                     zeroing of gigabytes on the layers' path) */
    size_t snap_spare_n;          /* its floats */
    int first_layer;              /* where this run started */
    mq_pipeline_result *res;
    cJSON *manifest;
    int lock_fd;
    bool work_fresh;              /* this run made the work directory */
    bool rank_dir;                /* a rank past 0 made its own directory for activation files */
    char *balance_record;         /* the expert-balanced choice (balance.c), kept in the work
                                     directory as calib-choice.json for a resume; NULL: none */
} mq_pipe;

/* fp32 values of a rotated unquantized tensor converted at once (layer_quantize.c) */
#define MQ_ROT_PIECE ((int64_t)1 << 20)

/* ---- memplan.c ---- */
/* Plans chunk, batch and activation storage within o->max_memory (or the default share); the
 * progress units. MOEQ_E_NOMEM naming what does not fit. */
moeq_status mq_plan_memory(mq_pipe *p);
/* Expert rows a batch of the chunk of C experts holds: at least one sample's worst case, and
 * enough blocks to keep every thread busy. */
int64_t mq_plan_batch_rows(const mq_pipe *p, int64_t C);
/* What one decoder layer of c needs on the GPU at the least (memplan.c, from gpu.h's
 * arithmetic), samples of max_len tokens, a lane of batch_rows rows: the attention object, its
 * stage (Hessian sums, the first expert's weights, GPTQ), one expert's or the shared/dense MLP's
 * stage, least = attention + the larger stage; per_expert: each further expert of a chunk. */
typedef struct {
    int64_t attention, attention_stage, expert, least, per_expert;
} mq_gpu_layer_need;
mq_gpu_layer_need mq_plan_gpu_layer(const mq_config *c, int64_t max_len, int64_t batch_rows, const mq_qspec *s,
                                    const mq_gptq_opts *o);
/* Bytes the checkpoint writer may queue (memplan.c). */
int64_t mq_plan_write_behind(const mq_pipe *p);
/* Measures this machine's sgemm rate and estimates the run's time from the plan's FLOPs. */
void mq_plan_estimate_time(mq_pipe *p);

/* ---- layer.c (and layer_quantize.c: plain RTN, pass-through) ---- */
/* One decoder layer: calibration passes, quantization, writes, the next boundary's activations.
 * replay: the layer was finished by an earlier run; only recompute the activations after it from
 * what the checkpoint holds. */
moeq_status mq_pipe_layer(mq_pipe *p, int l, bool replay);
/* Plain RTN of layer l (no calibration): fusion group by group from the source tensors. */
moeq_status mq_pipe_layer_rtn(mq_pipe *p, int l);
/* Pass-through tensors (and kept Linears) of layer l (-1: the global ones). */
moeq_status mq_pipe_write_passthrough(mq_pipe *p, int l);
void mq_pipe_progress(mq_pipe *p, int64_t units);
/* Several ranks: each rank's share of the samples of b (mq_dist_share) to every rank; the same
 * for any array of per_sample bytes per sample; the others' shares of b to rank 0. */
moeq_status mq_pipe_share_samples(mq_pipe *p, mq_actbuf *b, const char *step);
moeq_status mq_pipe_share_rows(mq_pipe *p, void *base, size_t per_sample, const char *step);
moeq_status mq_pipe_gather_samples(mq_pipe *p, mq_actbuf *b, const char *step);

/* ---- workdir.c ---- */
moeq_status mq_work_prepare(mq_pipe *p);       /* lock; fresh or resume checks; writer opened */
moeq_status mq_work_layer_done(mq_pipe *p, int l);   /* manifest (+ activation snapshot) */
/* The snapshot written behind the last layer: named in the manifest once complete (the end of a
 * run that stops early, fails or is interrupted). */
moeq_status mq_work_snapshot_wait(mq_pipe *p);
/* Waits for what runs behind the layers (a layer's record, a snapshot) where a run ends without
 * mq_work_snapshot_wait (its errors only warned). */
void mq_work_join(mq_pipe *p);
/* The activations at the input of a layer from the snapshot the manifest names, if it is good and
 * at most layer l (the layers after it are then replayed): *at = that layer, else 0. */
moeq_status mq_work_load_boundary(mq_pipe *p, int l, int *at);
/* The global tensors (embeddings, final norm, lm_head): written by the interrupted run? / record
 * that they are. */
bool mq_work_globals_done(const mq_pipe *p);
moeq_status mq_work_globals_written(mq_pipe *p);
void mq_work_release(mq_pipe *p, bool keep);   /* unlock; remove the work dir unless keep */
/* Reading what an interrupted run left, apart from a run (the resume uses these; so does the fuzz
 * target tests/fuzz/fuzz_workdir.c). mq_work_manifest_parse: the manifest's text is JSON of this
 * version with an identity and a layers array, else MOEQ_E_FORMAT naming path. */
moeq_status mq_work_manifest_parse(const char *path, const char *text, size_t len, cJSON **out);
/* NULL when the manifest's identity is `identity` (source files, options, calibration, plan),
 * else the first difference as a phrase (malloc'ed). */
char *mq_work_identity_diff(const cJSON *manifest, const cJSON *identity);
typedef struct {
    moeq_status (*verify)(void *user, const char *tensor, uint32_t crc);   /* the data has this CRC */
    int (*count)(void *user, int layer);   /* tensors the plan has in a layer (-1: the globals) */
    void *user;
} mq_work_check;
/* The finished layers the manifest records that check out: records 0, 1, ... in order, at most
 * n_layers, each with every tensor's CRC verified and the plan's count; the first that does not
 * (and the ones after it) is dropped from the manifest with a warning naming path and why, to be
 * redone; so are the globals' record when it does not check out. Returns the layers kept. */
int mq_work_layers_check(cJSON *manifest, const char *path, int n_layers, const mq_work_check *chk);
/* The activation snapshot the manifest names: the layer at whose input it was taken (>= 1) and
 * its CRC; false when there is none or the record is malformed. */
bool mq_work_boundary(const cJSON *manifest, int *layer, uint32_t *crc);
typedef struct {
    int layer;
    int64_t samples, D;
    const int64_t *len;           /* [samples] tokens of each sample */
    int streams;                  /* 2 with the unquantized target's stream */
    uint32_t crc;                 /* the manifest's */
} mq_acts_shape;
typedef void (*mq_acts_put_fn)(void *user, int64_t row, const float *v, size_t n);
/* Reads the snapshot at path (tmp: room for the longest row), handing row r (sample r % samples
 * of stream r / samples, len * D values) to put as it is read; true when the file is exactly
 * this shape's, of this layer, and its CRC is the manifest's (else what put got is garbage). */
bool mq_work_acts_read(const char *path, const mq_acts_shape *a, float *tmp, mq_acts_put_fn put, void *user);
/* Test-only fault points: MOEQ_DEBUG_FAULT="<where>:<a>[:<b>]" kills the process (SIGKILL) there;
 * with MOEQ_DEBUG_FAULT_MODE=error it returns true instead (the caller fails with an injected error),
 * with MOEQ_DEBUG_FAULT_MODE=hang it sleeps for ever; MOEQ_DEBUG_FAULT_RANK=R: only on rank R. */
bool mq_fault_point(const char *where, int a, int b);

/* ---- report.c ---- */
/* A layer's stage seconds as the object "seconds" of parent (the report's layers and totals, the
 * work manifest's records; returned), and back from one (a resume: what is missing reads 0). */
cJSON *mq_layer_seconds_put(cJSON *parent, const mq_layer_report *lr);
void mq_layer_seconds_get(mq_layer_report *lr, const cJSON *parent);
cJSON *mq_mod_report_json(const mq_mod_report *r);
/* The JSON report into path and, when html_path, the page drawn from it (report_html.c). */
moeq_status mq_report_write(const mq_pipe *p, const char *path, const char *html_path);
/* The run's effective settings as quant_options.def's RECORD column lists them: the report's
 * "settings" (identity false), or also what only the resume check needs (the manifest's
 * "options", identity true). */
cJSON *mq_settings_json(const mq_pipe *p, bool identity);
moeq_status mq_report_html_write(const cJSON *report, const char *path);

#endif
