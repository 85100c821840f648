/*
 * The quantization pipeline: one streaming pass over a Hugging Face checkpoint, layer by layer,
 * that drives the model (lazy loading, the calibration forward), quant (GPTQ, RTN) and export
 * (the checkpoint writer), within a memory budget, resumable after a crash.
 *
 * Per decoder layer, for GPTQ (sequential, the default):
 *   load the layer's attention (fp32, from the mapped source);
 *   pass A: every calibration sample through the unquantized attention; q/k/v and o Hessians;
 *           the FFN input of every token kept (XN) and routed once;
 *   quantize q/k/v/o, write them, continue with their dequantized values;
 *   pass B: every sample through the quantized attention: h (the next input, less the FFN) and
 *           the FFN input's routing;
 *   experts in chunks (then the shared expert, or the dense MLP): load, Hessians from exactly
 *           each expert's routed tokens of XN, GPTQ, write, then the quantized experts' outputs
 *           on h's FFN input summed into OUT in increasing expert order; free;
 *   the next layer's input is h + OUT; the layer's pass-through tensors are written; the work
 *           directory records the layer (tensor CRCs, report) and the activations.
 * Non-sequential GPTQ calibrates everything on the unquantized model (no pass B); true-sequential
 * takes the FFN Hessians from pass B; RTN needs no calibration (group by group, no forward);
 * W4A4 (act_quant) records each Linear's input amax during the calibration passes (RTN W4A4: the
 * unquantized model's passes over the first calib_tokens tokens).
 * The unquantized target (target_share, asymmetric calibration; sequential, not true-sequential):
 * the unquantized model's stream runs beside (XF): each sample's attention before pass A's (every
 * Linear input kept to pair with pass A's, G = sum x_f x_q^T beside each Hessian), the experts' and
 * the MLP's outputs from the source weights into OUTF before GPTQ; each GPTQ Linear's weights move
 * by mq_gptq_target before it is quantized; XF + OUTF is the stream's next input.
 *
 * Every sample's forward is exactly the model's forward (src/model): the same blocks of rows go
 * through the same GEMMs, Hessians get one update per sample in sample order, outputs are summed
 * in the forward's order; so the checkpoint does not depend on the expert chunk size, the number
 * of threads, the memory budget or on being resumed, and equals the whole-model reference loop
 * (tests/reference) bit for bit.
 */
#ifndef MOEQ_PIPELINE_H
#define MOEQ_PIPELINE_H

#include "export/gguf_export.h"
#include "export/layout.h"
#include "quant/calib.h"
#include "quant/gptq.h"
#include "stream/boundary.h"


typedef struct {
    /* the checkpoint */
    mq_qspec spec;                 /* scheme in the format's conventions (mq_pipeline_opts_init) */
    mq_ckpt_format format;
    bool act_quant;                /* NVFP4 W4A4: activation scales from calibration */
    bool no_fuse;                  /* one NVFP4 global scale per tensor */
    const char *const *ignore;     /* PCRE2 patterns of Linears kept unquantized */
    int n_ignore;
    size_t max_shard_bytes;        /* 0: 5 GB */
    bool force;                    /* replace an existing OUT_DIR */
    mq_gguf_rest gguf_rest;        /* MQ_FMT_GGUF: storage of the unquantized tensors */
    /* MQ_QS_KQUANT (spec.kq the file type's base): llama.cpp's mixture of that file type
     * (gguf_export_recipe.c), or every Linear spec.kq; target_bpw > 0: types chosen to meet
     * that many bits per parameter (kquant_budget.c) */
    bool kq_mixture;
    double target_bpw;
    /* the method */
    bool gptq;                     /* GPTQ (else RTN) */
    mq_gptq_opts g;
    bool sequential;               /* GPTQ: each layer calibrated on the quantized layers before */
    bool true_sequential;          /* sequential: the FFN calibrated on the quantized attention */
    int64_t min_expert_tokens;     /* experts with fewer routed tokens use the fallback */
    bool fallback_rtn;             /* ... round to nearest (else the MoE block's Hessians) */
    int expert_weighting;          /* routed tokens' Hessian updates times 1 (0), their gate
                                      score (1) or its square (2) */
    float target_share;            /* asymmetric calibration: the share of the correction toward the
                                      unquantized model's outputs (mq_gptq_target); 0: none */
    double damp_sweep[8];          /* percdamp candidates chosen by held-out loss (n 0: none) */
    int n_damp_sweep;
    mq_calib_opts calib;           /* GPTQ calibration samples (calib.path: the file) */
    bool calib_balance;            /* calib.nsamples chosen from calib_pool candidates so that the
                                      experts get tokens evenly (balance.c) */
    int64_t calib_pool;            /* 0: 4 x calib.nsamples */
    const char *act_calib;         /* RTN W4A4: the calibration text */
    int64_t act_calib_tokens;      /* RTN W4A4: its first N tokens, in chunks of 512 */
    /* resources */
    int64_t max_memory;            /* bytes of anonymous memory; 0: a share of the machine's */
    int64_t max_gpu_memory;        /* with a device: bytes of GPU memory; 0: the card's free memory */
    const char *work_dir;          /* NULL: OUT_DIR.moeq-work beside OUT_DIR */
    bool resume;                   /* continue the run the work directory holds */
    bool dry_run;                  /* plan only */
    bool drop_mtp;                 /* leave out the MTP layers (plan.h) */
    /* the residual-stream rotation (model/rotate.h) with Hadamard blocks of rotate_block; -1:
     * the default block (the scheme's group size, halved until it divides the hidden size);
     * 0: none */
    int rotate_block;
    int expert_chunk;              /* experts loaded at once; 0: as many as the budget allows */
    mq_act_storage act_storage;
    int device;                    /* GPTQ on GPU `device` (backend/gpu.h); -1: on the CPU */
    moeq_gpu_precision gpu_precision;   /* that GPU's products and Hessian sums (mq_gpu_set_precision) */
    double mpi_timeout;            /* seconds a rank waits for the others (src/dist); 0: 3600 */
    const char *report_path;       /* JSON report (NULL: none) */
    const char *report_html_path;  /* the same drawn as an HTML page (NULL: none; needs report_path) */
    int32_t stop_after;            /* benchmarks: stop after this many layers (0: all); the run
                                      then writes no checkpoint and keeps no work directory */
} mq_pipeline_opts;

/* Defaults for a scheme and format: the spec in the format's conventions (CT: NVFP4 divisor
 * global scale, INT4 BF16 scales; ModelOpt: multiplier global scale; GPTQ: F16 scales, zero
 * points >= 1), RTN, GPTQ settings of mq_gptq_opts_default, sequential, min_expert_tokens 32,
 * block-Hessian fallback, calibration 128 x 512. */
void mq_pipeline_opts_init(mq_pipeline_opts *o, mq_qscheme scheme, mq_ckpt_format format);
/* The options moeq_quantize runs with for po (its defaults resolved: scale search, refinement,
 * act-order...); po must have passed moeq_quantize's checks (the benchmarks use the defaults). */
void mq_pipeline_opts_from(const moeq_quant_options *po, mq_pipeline_opts *o);

/* The plan: what the run holds in memory (bytes of anonymous memory) and what it costs. */
typedef struct {
    int64_t budget;                /* the limit it was planned for */
    int64_t activations;           /* calibration activations at the layer boundary */
    int64_t routing;               /* every token's experts and weights */
    int64_t state;                 /* attention state, KV cache, forward scratch */
    int64_t attention;             /* a layer's attention weights, Hessians and factors, and the
                                      checkpoint writer's queue */
    int64_t expert_chunk;          /* one chunk of experts: weights, Hessians, factors, codes */
    int64_t ffn_other;             /* shared expert or dense MLP, block Hessian, batch scratch */
    int64_t snapshot_copy;         /* the activation snapshot's copy, written behind the next
                                      layer (0: written in place, the layers wait) */
    int64_t read_ahead;            /* the largest part read ahead (mq_pipe_start_ahead): an expert
                                      chunk's fp32 weights beside the attention and beside the
                                      chunk before, or the next layer's attention beside the last
                                      chunk; counted in both (0: off) */
    int64_t peak;                  /* the largest sum of the above at any stage */
    int32_t chunk;                 /* experts per chunk (0: no routed experts) */
    int32_t n_chunks;              /* chunks per MoE layer */
    int32_t batch;                 /* samples whose expert rows are computed together */
    int32_t attention_passes;      /* per layer */
    int32_t ffn_passes;            /* per expert chunk / MLP */
    mq_act_storage storage;        /* resolved */
    double flops_forward, flops_hessian, flops_gptq;   /* the whole run */
    double sgemm_gflops;           /* this machine, measured for the estimate */
    double seconds;                /* estimated wall time */
    int64_t disk_output;           /* the checkpoint */
    int64_t disk_work;             /* work files beside it (activations) */
    int32_t layers;                /* decoder layers */
    int64_t samples, tokens;       /* calibration */
    /* GPU memory (moeq_quant_plan's gpu_* say what each holds) */
    int64_t gpu_budget, gpu_least, gpu_attention, gpu_attention_stage, gpu_expert;
    int32_t gpu_chunk;
    int64_t gpu_ahead_reserve;   /* the first chunk read ahead during the attention: kept out of the free memory until it is up */
} mq_mem_plan;

/* One finished layer (seconds, peak anonymous memory). */
typedef struct {
    double forward, attention, hessian, gptq, write, total;
    /* process CPU seconds of the same stages: over the wall seconds, the cores kept busy (the
     * pool's idle workers sleep) */
    double cpu_forward, cpu_attention, cpu_hessian, cpu_gptq, cpu_write, cpu_total;
    double wait, exchange;         /* several ranks: waiting for the others, moving data */
    int64_t peak_anon;
    int32_t chunks;
    double read, cpu_read;         /* the source's weights read and converted to fp32, and freed */
    double pooled;                 /* of total: in the pool's parallel loops; the rest (less wait and
                                      exchange) ran on one thread */
    double sim_tasks, sim_span;    /* under mq_pool_simulate: the loops' task seconds, their schedule */
} mq_layer_stats;

typedef struct {
    int64_t n_quantized, n_kept;   /* Linear modules */
    int64_t quantized_params;
    int64_t n_tensors;
    uint64_t bytes_written;        /* tensor data of the checkpoint */
    /* the CRCs of the tensors this run wrote, in the plan's order, combined (rank 0): equal for
     * runs that wrote the same bytes, e.g. the first layers at any thread count (--stop-after) */
    uint32_t tensors_crc;
    int64_t tensors_written;
    mq_mem_plan plan;
    int64_t peak_anon;             /* measured peak anonymous memory */
    int32_t layers_resumed;        /* layers taken over from the interrupted run */
    /* GPTQ */
    int64_t samples, tokens;
    int64_t linears, fallbacks, worse_than_rtn;
    double loss, rtn_loss;
    double seconds_forward, seconds_hessian, seconds_gptq, seconds_write, seconds_total;
    double seconds_read;   /* the source's weights read into fp32 */
    mq_layer_stats layer[512];     /* the first 512 layers run */
    int32_t layers_run;
    int32_t ranks;                 /* processes of the run (src/dist) */
    /* expert-balanced calibration: candidates, experts (over MoE layers) with fewer than
     * min_expert_tokens tokens and the fewest tokens of any, [0] from the first samples, [1]
     * from the chosen ones; seconds of the choice */
    int64_t balance_pool, balance_under[2], balance_least[2];
    double balance_seconds;
    int64_t rank_peak[64];         /* measured peak anonymous memory of the first 64 ranks */
    int64_t gpu_peak;              /* with a device: the peak GPU memory moeq held */
} mq_pipeline_result;

/* Quantizes model_dir into out_dir (see the top of this file). Errors before any work: bad
 * options, out_dir (MOEQ_E_EXISTS unless force; never model_dir), the source (unknown
 * architecture, missing or misshapen tensors, already quantized), a budget too small for the
 * plan (MOEQ_E_NOMEM naming what does not fit and what is needed), a work directory left by an
 * interrupted run without resume (MOEQ_E_EXISTS), a resume whose source, options or calibration
 * differ (MOEQ_E_ARG saying what differs). dry_run: fills result->plan and returns. An error or
 * interrupt after the first finished layer keeps the work directory for resume. */
moeq_status mq_pipeline_run(const char *model_dir, const char *out_dir, const mq_pipeline_opts *o,
                            mq_pipeline_result *result);

#endif
