/*
 * The public quantization entry point (moeq_quantize in include/moeq.h): checks the public
 * options (named, defaulted and read in options.c's table), translates them into the pipeline's
 * (pipeline/pipeline.h), runs it and gives the result (also as JSON for the bindings). Settings
 * follow `moeq quantize` exactly (the CLI is a thin layer over this file).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/gpu.h"
#include "core/json.h"
#include "dist/dist.h"
#include "io/gguf_hf.h"
#include "formats/kquant.h"
#include "pipeline/pipeline.h"

#define BAD(...) mq_err(MOEQ_E_ARG, "moeq_quantize: " __VA_ARGS__)

static moeq_status check_gptq(const moeq_quant_options *o) {
    if (o->gptq.nsamples < 1)
        return BAD("gptq.nsamples must be >= 1, got %lld", (long long)o->gptq.nsamples);
    if (o->gptq.seqlen < 2)
        return BAD("gptq.seqlen must be >= 2, got %lld", (long long)o->gptq.seqlen);
    if ((unsigned)o->gptq.sampling > MOEQ_CALIB_DOCS)
        return BAD("gptq.sampling: unknown value %d", (int)o->gptq.sampling);
    if ((unsigned)o->gptq.calib_balance > MOEQ_CALIB_BALANCE_EXPERTS)
        return BAD("gptq.calib_balance: unknown value %d", (int)o->gptq.calib_balance);
    if (o->gptq.calib_pool < 0 || (o->gptq.calib_pool > 0 && o->gptq.calib_pool < o->gptq.nsamples))
        return BAD("gptq.calib_pool must be 0 (4 x nsamples) or >= gptq.nsamples (%lld), got %lld",
                   (long long)o->gptq.nsamples, (long long)o->gptq.calib_pool);
    if (o->gptq.calib_pool > 0 && !o->gptq.calib_balance)
        return BAD("gptq.calib_pool is the pool gptq.calib_balance chooses from: set calib_balance");
    if (!isfinite(o->gptq.percdamp) || o->gptq.percdamp < 0)
        return BAD("gptq.percdamp must be finite and >= 0, got %g", o->gptq.percdamp);
    if (o->gptq.block_size < 1)
        return BAD("gptq.block_size must be >= 1, got %d", o->gptq.block_size);
    if (o->gptq.act_order < -1 || o->gptq.act_order > 1)
        return BAD("gptq.act_order must be -1 (per scheme), 0 or 1, got %d", o->gptq.act_order);
    if ((unsigned)o->gptq.groups > MOEQ_GPTQ_GROUPS_GIDX)
        return BAD("gptq.groups: unknown value %d", (int)o->gptq.groups);
    if (o->gptq.mse_weight < MOEQ_GPTQ_MSE_AUTO || o->gptq.mse_weight > MOEQ_GPTQ_MSE_GPTQ)
        return BAD("gptq.mse_weight: unknown value %d", (int)o->gptq.mse_weight);
    if ((unsigned)o->gptq.mode > MOEQ_GPTQ_NONSEQUENTIAL)
        return BAD("gptq.mode: unknown value %d", (int)o->gptq.mode);
    if ((unsigned)o->gptq.expert_fallback > MOEQ_EXPERT_FALLBACK_RTN)
        return BAD("gptq.expert_fallback: unknown value %d", (int)o->gptq.expert_fallback);
    if (o->gptq.min_expert_tokens < 0)
        return BAD("gptq.min_expert_tokens must be >= 0, got %lld",
                   (long long)o->gptq.min_expert_tokens);
    if ((unsigned)o->gptq.expert_weighting > MOEQ_EXPERT_WEIGHT_GATE_SQUARED)
        return BAD("gptq.expert_weighting: unknown value %d", (int)o->gptq.expert_weighting);
    if (o->gptq.clip_search && (o->scheme != MOEQ_QUANT_INT4 || !o->asym || !o->gptq.mse))
        return BAD("gptq.clip_search clips the two ends of an asymmetric INT4 range apart: it "
                   "needs scheme MOEQ_QUANT_INT4 with asym and gptq.mse");
    if (o->gptq.clip_search && o->group_size < 0)
        return BAD("gptq.clip_search scores by GPTQ's in-loop search, which per-channel INT4 "
                   "(group_size -1) does not run");
    if (o->gptq.refine_passes < -1 || o->gptq.refine_passes > 64)
        return BAD("gptq.refine_passes must be -1 (the default) or 0 .. 64, got %d",
                   (int)o->gptq.refine_passes);
    if (o->gptq.refine_scales && o->gptq.refine_passes == 0)
        return BAD("gptq.refine_scales refines the scales between passes of gptq.refine_passes (>= 1)");
    const double tu = o->gptq.target_unquantized;
    if (!(tu == -1 || (tu >= 0 && tu <= 1)))
        return BAD("gptq.target_unquantized must be -1 (the default), 0 (off) or a share in (0, 1], got %g", tu);
    if (tu > 0 && o->gptq.mode == MOEQ_GPTQ_NONSEQUENTIAL)
        return BAD("gptq.target_unquantized pairs the quantized and the unquantized model's inputs: it "
                   "needs gptq.mode sequential (nonsequential calibrates on the unquantized model alone)");
    if (tu > 0 && o->gptq.true_sequential)
        return BAD("gptq.target_unquantized runs with sequential calibration, not true_sequential");
    if (tu > 0 && o->device)
        return BAD("gptq.target_unquantized (--target unquantized) runs on the CPU only (leave device unset)");
    if (tu > 0 && (o->gptq.expert_weighting || o->gptq.n_damp_sweep))
        return BAD("gptq.target_unquantized: not with gptq.expert_weighting or gptq.damp_sweep (their Hessians "
                   "are not the ones the correction pairs with)");
    if (o->gptq.n_damp_sweep < 0 || o->gptq.n_damp_sweep > 8)
        return BAD("gptq.n_damp_sweep must be 0 .. 8, got %d", (int)o->gptq.n_damp_sweep);
    for (int32_t i = 0; i < o->gptq.n_damp_sweep; i++)
        if (!isfinite(o->gptq.damp_sweep[i]) || o->gptq.damp_sweep[i] < 0)
            return BAD("gptq.damp_sweep[%d] must be finite and >= 0, got %g", (int)i,
                       o->gptq.damp_sweep[i]);
    if (o->gptq.n_damp_sweep > 0 && o->gptq.nsamples < 2)
        return BAD("gptq.damp_sweep holds out the last 1/8 of the samples: it needs gptq.nsamples >= 2");
    if (o->gptq.true_sequential && o->gptq.mode != MOEQ_GPTQ_SEQUENTIAL)
        return BAD("gptq.true_sequential needs gptq.mode MOEQ_GPTQ_SEQUENTIAL");
    bool int4 = o->scheme == MOEQ_QUANT_INT4;
    bool act_order = o->gptq.act_order < 0 ? int4 : o->gptq.act_order != 0;
    if (o->gptq.groups == MOEQ_GPTQ_GROUPS_GIDX && !act_order)
        return BAD("gptq.groups MOEQ_GPTQ_GROUPS_GIDX needs gptq.act_order");
    if (o->gptq.groups == MOEQ_GPTQ_GROUPS_GIDX && !int4)
        return BAD("gptq.groups MOEQ_GPTQ_GROUPS_GIDX stores g_idx, which only INT4 checkpoints "
                   "hold");
    return MOEQ_OK;
}

/* Every field of the public options; messages name the field. */
static moeq_status check_options(const moeq_quant_options *o) {
    if (o->scheme == MOEQ_QUANT_SCHEME_UNSET)
        return BAD("scheme is required (MOEQ_QUANT_NVFP4, MOEQ_QUANT_NVFP4A16 or MOEQ_QUANT_INT4)");
    if (o->scheme < MOEQ_QUANT_NVFP4 || o->scheme > MOEQ_QUANT_IQ4_XS)
        return BAD("scheme: unknown value %d", (int)o->scheme);
    const bool kq = o->scheme >= MOEQ_QUANT_Q3_K;
    if (kq && o->format != MOEQ_FORMAT_GGUF)
        return BAD("scheme: llama.cpp's K-quants are GGUF block types (format MOEQ_FORMAT_GGUF)");
    if (kq && (o->asym || o->int4_scale_sign || o->group_size || o->reference || o->global_scale_headroom))
        return BAD("asym, int4_scale_sign, group_size, reference, global_scale_headroom: a K-quant's blocks, "
                   "scales and mins are llama.cpp's");
    if (kq && o->device) return BAD("device: GPTQ into K-quants runs on the CPU (leave device unset)");
    if (kq && mq_dist_size() > 1) return BAD("scheme: K-quants are quantized in one process (not under mpirun)");
    if (kq && o->method == MOEQ_QUANT_GPTQ && (o->gptq.n_damp_sweep || o->gptq.clip_search))
        return BAD("gptq.damp_sweep, gptq.clip_search: not with K-quants");
    if (o->target_bpw != 0 && !(kq && o->target_bpw >= 1 && o->target_bpw <= 16))
        return BAD("target_bpw %g: a K-quant scheme's budget of 1 .. 16 bits per parameter", o->target_bpw);
    if ((unsigned)o->method > MOEQ_QUANT_GPTQ)
        return BAD("method: unknown value %d", (int)o->method);
    mq_gguf_rest rest;
    if (o->gguf_rest && !mq_gguf_rest_parse(o->gguf_rest, &rest))
        return BAD("gguf_rest: \"%s\": expected auto, f32, f16, bf16 or q8_0", o->gguf_rest);
    if (o->gguf_rest && o->format != MOEQ_FORMAT_GGUF) return BAD("gguf_rest is only for format MOEQ_FORMAT_GGUF");
    if ((unsigned)o->format > MOEQ_FORMAT_GGUF)
        return BAD("format: unknown value %d", (int)o->format);
    if ((unsigned)o->rotate > MOEQ_ROTATE_RESIDUAL)
        return BAD("rotate: unknown value %d", (int)o->rotate);
    if (o->rotate_block && (o->rotate_block < 2 || (o->rotate_block & (o->rotate_block - 1))))
        return BAD("rotate_block must be a power of two >= 2 (0: the default), got %d",
                   (int)o->rotate_block);
    if (o->rotate_block && o->rotate == MOEQ_ROTATE_NONE)
        return BAD("rotate_block is set but rotate is MOEQ_ROTATE_NONE");
    bool nv = !kq && o->scheme != MOEQ_QUANT_INT4;
    if (nv && o->format == MOEQ_FORMAT_GPTQ) return BAD("format MOEQ_FORMAT_GPTQ holds INT4 only");
    if (!nv && o->format == MOEQ_FORMAT_MODELOPT)
        return BAD("format MOEQ_FORMAT_MODELOPT holds NVFP4 only");
    if (nv && o->asym) return BAD("asym: NVFP4 is symmetric (asym is for INT4)");
    if ((unsigned)o->int4_scale_sign > MOEQ_INT4_SCALE_POSITIVE)
        return BAD("int4_scale_sign: unknown value %d", (int)o->int4_scale_sign);
    if (o->int4_scale_sign && (nv || o->asym))
        return BAD("int4_scale_sign is for symmetric INT4 (%s)", nv ? "NVFP4 has E4M3 block scales" : "asym has zero points");
    if (o->int4_scale_sign == MOEQ_INT4_SCALE_SIGNED && o->reference)
        return BAD("int4_scale_sign signed: reference keeps reference.json's positive amax/7 scales");
    if (nv && o->group_size != 0 && o->group_size != 16)
        return BAD("group_size: NVFP4 has groups of 16, got %d", o->group_size);
    if (!nv && o->group_size < -1)
        return BAD("group_size must be positive, -1 (per row) or 0 (default 128), got %d",
                   o->group_size);
    if (o->scheme == MOEQ_QUANT_NVFP4 && !o->calib)
        return BAD("scheme MOEQ_QUANT_NVFP4 (W4A4) needs calib for its activation scales");
    if (o->method == MOEQ_QUANT_GPTQ && !o->calib) return BAD("method MOEQ_QUANT_GPTQ needs calib");
    if (o->calib && o->scheme != MOEQ_QUANT_NVFP4 && o->method != MOEQ_QUANT_GPTQ)
        return BAD("calib is only used by scheme MOEQ_QUANT_NVFP4 and method MOEQ_QUANT_GPTQ");
    if (o->calib_field && !o->calib) return BAD("calib_field is set but calib is not");
    if (o->scale_lo != 0 || o->scale_hi != 0 || o->scale_steps != 0) {
        if (!(o->scale_lo > 0) || !(o->scale_hi >= o->scale_lo) || !isfinite(o->scale_hi) || o->scale_hi > 64)
            return BAD("scale search %g:%g: expected 0 < LO <= HI <= 64", o->scale_lo, o->scale_hi);
        if (o->scale_steps < 0 || o->scale_steps > 1024)
            return BAD("scale search steps %d: expected 1 .. 1024 (0: 17)", (int)o->scale_steps);
    }
    if (!(o->global_scale_headroom == 0 || (o->global_scale_headroom >= 1 && o->global_scale_headroom <= 16)))
        return BAD("global_scale_headroom %g: expected 1 .. 16 (0: none)", o->global_scale_headroom);
    if (o->global_scale_headroom > 1 && o->scheme == MOEQ_QUANT_INT4)
        return BAD("global_scale_headroom is NVFP4's (INT4 has no global scale)");
    if (o->gptq.report_html && o->method != MOEQ_QUANT_GPTQ)
        return BAD("gptq.report_html: the report is GPTQ's (method gptq)");
    if (o->calib_tokens < 1)
        return BAD("calib_tokens must be >= 1, got %lld", (long long)o->calib_tokens);
    if (o->max_shard_bytes < 0)
        return BAD("max_shard_bytes must be >= 0 (0: 5 GB), got %lld",
                   (long long)o->max_shard_bytes);
    if (o->n_ignore < 0 || (o->n_ignore > 0 && !o->ignore))
        return BAD("ignore: %d patterns but no array", o->n_ignore);
    for (int32_t i = 0; i < o->n_ignore; i++)
        if (!o->ignore[i]) return BAD("ignore[%d] is NULL", i);
    if (o->max_memory < 0) return BAD("max_memory must be >= 0 (0: a share of the machine's), got %lld",
                                      (long long)o->max_memory);
    if (o->max_gpu_memory < 0)
        return BAD("max_gpu_memory must be >= 0 (0: the card's free memory), got %lld", (long long)o->max_gpu_memory);
    if (o->expert_chunk < 0) return BAD("expert_chunk must be >= 0 (0: from max_memory), got %d",
                                        o->expert_chunk);
    int dev = -1;
    if (o->device && mq_gpu_parse_device(o->device, &dev))
        return BAD("device: \"%s\": expected cpu, cuda or cuda:N", o->device);
    if (o->gpu_precision < MOEQ_GPU_FP32 || o->gpu_precision > MOEQ_GPU_TF32)
        return BAD("gpu_precision %d: expected MOEQ_GPU_FP32, MOEQ_GPU_TF32X3 or MOEQ_GPU_TF32", (int)o->gpu_precision);
    if (o->gpu_precision && dev < 0)
        return BAD("gpu_precision %s: a GPU's precision mode (set device cuda)", mq_gpu_precision_name(o->gpu_precision));
    if (dev >= 0 && o->method != MOEQ_QUANT_GPTQ)
        return BAD("device %s: only method gptq runs on a GPU (round to nearest is not worth "
                   "the transfer)", o->device);
    if (dev >= 0 && o->method == MOEQ_QUANT_GPTQ &&
        (o->gptq.expert_weighting || o->gptq.clip_search || o->gptq.n_damp_sweep ||
         o->gptq.refine_passes > 0 || o->gptq.refine_scales))
        return BAD("device %s: gptq.expert_weighting, gptq.clip_search, gptq.damp_sweep and "
                   "gptq.refine_passes run on the CPU only (leave device unset)", o->device);
    if (o->method == MOEQ_QUANT_GPTQ && o->gptq.n_damp_sweep && mq_dist_size() > 1)
        return BAD("gptq.damp_sweep runs in one process (not under mpirun with several ranks)");
    if (!(o->mpi_timeout >= 0)) return BAD("mpi_timeout must be >= 0 seconds (0: 3600), got %g", o->mpi_timeout);
    if ((unsigned)o->activations > MOEQ_ACT_STORAGE_BF16)
        return BAD("activations: unknown value %d", (int)o->activations);
    return o->method == MOEQ_QUANT_GPTQ ? check_gptq(o) : MOEQ_OK;
}

/* The pipeline's options, as `moeq quantize` sets them. */
void mq_pipeline_opts_from(const moeq_quant_options *po, mq_pipeline_opts *o) {
    mq_ckpt_format fmt = po->format == MOEQ_FORMAT_MODELOPT ? MQ_FMT_MODELOPT
                         : po->format == MOEQ_FORMAT_GPTQ   ? MQ_FMT_GPTQ
                         : po->format == MOEQ_FORMAT_GGUF   ? MQ_FMT_GGUF
                                                            : MQ_FMT_CT;
    const bool kq = po->scheme >= MOEQ_QUANT_Q3_K;
    bool nv = !kq && po->scheme != MOEQ_QUANT_INT4;
    mq_pipeline_opts_init(o, kq ? MQ_QS_KQUANT : nv ? MQ_QS_NVFP4 : MQ_QS_INT4, fmt);
    if (kq) {   /* the base type of the K-quant scheme and whether llama.cpp's mixture applies */
        static const mq_kq_type base[9] = {MQ_KQ_Q3_K, MQ_KQ_Q4_K, MQ_KQ_Q5_K, MQ_KQ_Q6_K, MQ_KQ_Q3_K,
                                           MQ_KQ_Q4_K, MQ_KQ_Q5_K, MQ_KQ_IQ4_NL, MQ_KQ_IQ4_XS};
        o->spec = mq_kq_spec(base[po->scheme - MOEQ_QUANT_Q3_K]);
        o->kq_mixture = po->scheme >= MOEQ_QUANT_Q3_K_M || po->scheme == MOEQ_QUANT_Q6_K;
        o->target_bpw = po->target_bpw;
    }
    o->max_shard_bytes = (size_t)po->max_shard_bytes;
    if (!nv && po->group_size != 0) o->spec.group_size = po->group_size;
    o->spec.asym = po->asym != 0;
    o->spec.int4_signed_scale = !nv && !po->asym && !po->reference &&
                                po->int4_scale_sign != MOEQ_INT4_SCALE_POSITIVE;
    /* GPTQ searches scales by default */
    o->spec.mse = po->method == MOEQ_QUANT_GPTQ ? po->gptq.mse != 0 : po->mse != 0;
    if (po->scale_lo > 0) {
        o->spec.mse_lo = (float)po->scale_lo;
        o->spec.mse_hi = (float)po->scale_hi;
        if (po->scale_steps > 0) o->spec.mse_steps = po->scale_steps;
    } else if (po->method == MOEQ_QUANT_GPTQ && kq) {
        /* the K-quants' super-scale, both ways around the max-based one (sub-block multipliers
         * also move one step either way in the search) */
        o->spec.mse_lo = 0.85f;
        o->spec.mse_hi = 1.15f;
        o->spec.mse_steps = 13;
    } else if (po->method == MOEQ_QUANT_GPTQ && nv) {
        /* issue 15 (docs/results/gptq_results.md): NVFP4 block scales searched both ways around the
         * max-based one lowered GPTQ's KL on every fixture, at the same cost */
        o->spec.mse_lo = 0.9f;
        o->spec.mse_hi = 1.5f;
        o->spec.mse_steps = 25;
    }
    o->no_fuse = po->no_fuse != 0;
    o->spec.nvfp4_headroom = (float)po->global_scale_headroom;
    if (po->reference) {
        /* reference.json: NVFP4 per-tensor scales, block scales clamped to [2^-9, 448];
         * INT4 symmetric amax/7, scales kept in F32 (GPTQ stores F16 whatever) */
        o->no_fuse = true;
        o->spec.nvfp4_scale_min = 0x1p-9f;
        o->spec.int4_sym_div = 7.0f;
        if (fmt == MQ_FMT_CT) o->spec.scale_dtype = MOEQ_DT_F32;
    }
    o->act_quant = po->scheme == MOEQ_QUANT_NVFP4;
    o->ignore = po->ignore;
    o->n_ignore = (int)po->n_ignore;
    o->force = po->force != 0;
    if (po->gguf_rest) mq_gguf_rest_parse(po->gguf_rest, &o->gguf_rest);   /* checked before */
    o->max_memory = po->max_memory;
    o->max_gpu_memory = po->max_gpu_memory;
    o->work_dir = po->work_dir;
    o->resume = po->resume != 0;
    o->dry_run = po->dry_run != 0;
    o->drop_mtp = po->drop_mtp != 0;
    o->rotate_block = po->rotate == MOEQ_ROTATE_RESIDUAL ? (po->rotate_block ? po->rotate_block : -1) : 0;
    o->expert_chunk = po->expert_chunk;
    o->device = -1;
    if (po->device) mq_gpu_parse_device(po->device, &o->device);   /* checked before */
    /* under mpirun, plain "cuda" is one GPU per rank of a machine */
    if (po->device && !strcmp(po->device, "cuda") && mq_dist_size() > 1) o->device = mq_dist_local_rank();
    o->gpu_precision = po->gpu_precision;
    o->mpi_timeout = po->mpi_timeout;
    o->act_storage = po->activations == MOEQ_ACT_STORAGE_RAM    ? MQ_ACT_RAM
                     : po->activations == MOEQ_ACT_STORAGE_DISK ? MQ_ACT_DISK
                     : po->activations == MOEQ_ACT_STORAGE_BF16 ? MQ_ACT_BF16
                                                                : MQ_ACT_AUTO;
    if (o->act_quant && po->method != MOEQ_QUANT_GPTQ) {
        o->act_calib = po->calib;
        o->act_calib_tokens = po->calib_tokens;
    }
    if (po->method != MOEQ_QUANT_GPTQ) return;
    o->gptq = true;
    o->g.percdamp = po->gptq.percdamp;
    o->g.block_size = po->gptq.block_size;
    /* the scale search scores candidates by running GPTQ over the group (docs/results/gptq_results.md:
     * lower KL in three of four cases, equal in the fourth); with one group per row that would
     * be GPTQ over whole rows once per candidate, so those keep the plain squared error */
    o->g.mse_weight = po->gptq.mse_weight == MOEQ_GPTQ_MSE_HESSIAN ? MQ_GPTQ_MSE_HDIAG
                      : po->gptq.mse_weight == MOEQ_GPTQ_MSE_OBQ   ? MQ_GPTQ_MSE_OBQ
                      : po->gptq.mse_weight == MOEQ_GPTQ_MSE_GPTQ  ? MQ_GPTQ_MSE_LOOP
                      : po->gptq.mse_weight == MOEQ_GPTQ_MSE_PLAIN ? MQ_GPTQ_MSE_PLAIN
                      : kq                                         ? MQ_GPTQ_MSE_OBQ   /* block fits: no loop */
                      : o->spec.group_size > 0                     ? MQ_GPTQ_MSE_LOOP
                                                                   : MQ_GPTQ_MSE_PLAIN;
    /* measured on olmoe-tiny and qwen2moe-tiny (docs/results/gptq_results.md): act order helps INT4
     * g128 a little and hurts NVFP4's 16-column groups */
    o->g.act_order = po->gptq.act_order < 0 ? o->spec.scheme == MQ_QS_INT4 : po->gptq.act_order != 0;
    o->g.groups = po->gptq.groups == MOEQ_GPTQ_GROUPS_STATIC ? MQ_GPTQ_GROUPS_STATIC
                  : po->gptq.groups == MOEQ_GPTQ_GROUPS_GIDX ? MQ_GPTQ_GROUPS_GIDX
                                                             : MQ_GPTQ_GROUPS_DYNAMIC;
    o->sequential = po->gptq.mode != MOEQ_GPTQ_NONSEQUENTIAL;
    o->true_sequential = po->gptq.true_sequential != 0;
    o->min_expert_tokens = po->gptq.min_expert_tokens;
    o->fallback_rtn = po->gptq.expert_fallback == MOEQ_EXPERT_FALLBACK_RTN;
    o->expert_weighting = (int)po->gptq.expert_weighting;
    o->g.clip_search = po->gptq.clip_search != 0;
    /* issue 15 (docs/results/gptq_results.md): 2 passes lowered the KL of every fixture, NVFP4 (with the
     * scale search above) and INT4; the GPU twin has no refinement */
    o->g.refine_passes = po->gptq.refine_passes >= 0 ? po->gptq.refine_passes : o->device < 0 ? 2 : 0;
    o->g.refine_scales = po->gptq.refine_scales != 0;
    /* issue 15 (docs/results/gptq_results.md): half the correction toward the unquantized model lowered
     * the KL of every fixture, NVFP4 and INT4, by 13-21%; the default where it runs (sequential
     * GPTQ on the CPU without the options whose Hessians it does not pair), off elsewhere */
    const bool target_runs = po->method == MOEQ_QUANT_GPTQ && o->device < 0 && o->sequential &&
                             !o->true_sequential && !o->expert_weighting && !po->gptq.n_damp_sweep;
    const double tu = po->gptq.target_unquantized;
    o->target_share = tu > 0 ? (float)tu : tu < 0 && target_runs ? 0.5f : 0.0f;
    o->n_damp_sweep = po->gptq.n_damp_sweep;
    for (int i = 0; i < po->gptq.n_damp_sweep; i++) o->damp_sweep[i] = po->gptq.damp_sweep[i];
    o->calib.path = po->calib;
    o->calib.field = po->calib_field;
    o->calib.nsamples = po->gptq.nsamples;
    o->calib.seqlen = po->gptq.seqlen;
    o->calib.seed = po->gptq.seed;
    o->calib.bos = po->gptq.calib_bos != 0;
    o->calib_balance = po->gptq.calib_balance == MOEQ_CALIB_BALANCE_EXPERTS;
    o->calib_pool = po->gptq.calib_pool;
    o->calib.mode = po->gptq.sampling == MOEQ_CALIB_RANDOM ? MQ_CALIB_RANDOM
                    : po->gptq.sampling == MOEQ_CALIB_DOCS ? MQ_CALIB_DOCS
                                                           : MQ_CALIB_CHUNKS;
}

static void plan_out(const mq_mem_plan *mp, moeq_quant_plan *q) {
    q->budget = mp->budget;
    q->peak = mp->peak;
    q->activations = mp->activations;
    q->routing = mp->routing;
    q->state = mp->state;
    q->attention = mp->attention;
    q->expert_chunk = mp->expert_chunk;
    q->ffn_other = mp->ffn_other;
    q->snapshot_copy = mp->snapshot_copy;
    q->read_ahead = mp->read_ahead;
    q->chunk = mp->chunk;
    q->n_chunks = mp->n_chunks;
    q->sample_batch = mp->batch;
    q->attention_passes = mp->attention_passes;
    q->ffn_passes = mp->ffn_passes;
    q->activations_storage = mp->storage == MQ_ACT_DISK   ? MOEQ_ACT_STORAGE_DISK
                             : mp->storage == MQ_ACT_BF16 ? MOEQ_ACT_STORAGE_BF16
                                                          : MOEQ_ACT_STORAGE_RAM;
    q->layers = mp->layers;
    q->flops_forward = mp->flops_forward;
    q->flops_hessian = mp->flops_hessian;
    q->flops_gptq = mp->flops_gptq;
    q->sgemm_gflops = mp->sgemm_gflops;
    q->seconds = mp->seconds;
    q->disk_output = mp->disk_output;
    q->disk_work = mp->disk_work;
    q->gpu_budget = mp->gpu_budget;
    q->gpu_least = mp->gpu_least;
    q->gpu_attention = mp->gpu_attention;
    q->gpu_attention_stage = mp->gpu_attention_stage;
    q->gpu_expert = mp->gpu_expert;
    q->gpu_chunk = mp->gpu_chunk;
}

char *moeq_quant_report_path(const char *out_dir, const moeq_quant_options *opts) {
    if (!out_dir || !opts || opts->method != MOEQ_QUANT_GPTQ || opts->dry_run) return NULL;
    /* a GGUF output is one file, so the report goes beside it, not into it */
    return opts->gptq.report                  ? mq_strdup(opts->gptq.report)
           : opts->format == MOEQ_FORMAT_GGUF ? mq_asprintf("%s.gptq_report.json", out_dir)
                                              : mq_path_join(out_dir, "gptq_report.json");
}

moeq_status moeq_quantize(const char *model_dir, const char *out_dir,
                          const moeq_quant_options *opts, moeq_quant_result *result) {
    if (result) memset(result, 0, sizeof *result);
    if (!model_dir || !out_dir || !opts)
        return BAD("%s is NULL", !model_dir ? "model_dir" : !out_dir ? "out_dir" : "opts");
    moeq_status st = check_options(opts);
    if (st) return st;
    /* the pipeline plans shards and plain or quantized Linears of a checkpoint directory; a GGUF
     * read in place has neither */
    if (mq_is_gguf_file(model_dir))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: a GGUF file: moeq_quantize reads a checkpoint directory "
                      "(moeq_import_gguf makes one; the CLI's quantize does that itself)", model_dir);
    mq_pipeline_opts o;
    mq_pipeline_opts_from(opts, &o);
    /* GGUF: what llama.cpp would compute otherwise is refused before any work, by the pipeline
     * when it reads the source's config.json (once) */
    char *report = NULL;
    if (opts->method == MOEQ_QUANT_GPTQ && !opts->dry_run) {
        if (!(report = moeq_quant_report_path(out_dir, opts))) return mq_err(MOEQ_E_NOMEM, "out of memory");
        o.report_path = report;
        o.report_html_path = opts->gptq.report_html;
    }
    mq_pipeline_result r;
    st = mq_pipeline_run(model_dir, out_dir, &o, &r);
    free(report);
    if (st && !(opts->dry_run && result)) return st;
    if (!result) return st;
    moeq_quant_result res;
    memset(&res, 0, sizeof res);
    plan_out(&r.plan, &res.plan);
    if (st) {
        *result = res;   /* a dry run's plan, also when it does not fit */
        return st;
    }
    res.linears_quantized = r.n_quantized;
    res.linears_kept = r.n_kept;
    res.weights_quantized = r.quantized_params;
    res.tensors_written = r.n_tensors;
    res.bytes_written = (int64_t)r.bytes_written;
    res.seconds = r.seconds_total;
    res.peak_anon_bytes = r.peak_anon;
    res.layers_resumed = r.layers_resumed;
    res.ranks = r.ranks;
    memcpy(res.rank_peak_anon_bytes, r.rank_peak, sizeof res.rank_peak_anon_bytes);
    res.balance_candidates = r.balance_pool;
    for (int i = 0; i < 2; i++) {
        res.balance_under[i] = r.balance_under[i];
        res.balance_fewest[i] = r.balance_least[i];
    }
    res.balance_seconds = r.balance_seconds;
    res.gpu_peak_bytes = r.gpu_peak;
    if (opts->method == MOEQ_QUANT_GPTQ) {
        res.gptq_samples = r.samples;
        res.gptq_tokens = r.tokens;
        res.gptq_linears = r.linears;
        res.gptq_fallback_linears = r.fallbacks;
        res.gptq_worse_than_rtn = r.worse_than_rtn;
        res.gptq_loss = r.loss;
        res.gptq_rtn_loss = r.rtn_loss;
        res.gptq_seconds = r.seconds_total;
        res.gptq_seconds_forward = r.seconds_forward;
        res.gptq_seconds_hessian = r.seconds_hessian;
        res.gptq_seconds_solve = r.seconds_gptq;
    }
    *result = res;
    return MOEQ_OK;
}

size_t moeq_quant_result_size(void) { return sizeof(moeq_quant_result); }

char *moeq_quant_result_json(const moeq_quant_result *r) {
    cJSON *j = cJSON_CreateObject();
    if (!j || !r) return mq_json_take_text(j);
    const mq_json_num totals[] = {
        {"linears_quantized", (double)r->linears_quantized},
        {"linears_kept", (double)r->linears_kept},
        {"weights_quantized", (double)r->weights_quantized},
        {"tensors_written", (double)r->tensors_written},
        {"bytes_written", (double)r->bytes_written},
        {"seconds", r->seconds},
        {"gptq_samples", (double)r->gptq_samples},
        {"gptq_tokens", (double)r->gptq_tokens},
        {"gptq_linears", (double)r->gptq_linears},
        {"gptq_fallback_linears", (double)r->gptq_fallback_linears},
        {"gptq_worse_than_rtn", (double)r->gptq_worse_than_rtn},
        {"gptq_loss", r->gptq_loss},
        {"gptq_rtn_loss", r->gptq_rtn_loss},
        {"peak_anon_bytes", (double)r->peak_anon_bytes},
        {"layers_resumed", r->layers_resumed},
    };
    mq_json_add_nums(j, totals, sizeof totals / sizeof *totals);
    if (r->balance_candidates > 0) {
        const mq_json_num balance[] = {
            {"candidates", (double)r->balance_candidates},
            {"experts_under_first", (double)r->balance_under[0]},
            {"experts_under_chosen", (double)r->balance_under[1]},
            {"fewest_tokens_first", (double)r->balance_fewest[0]},
            {"fewest_tokens_chosen", (double)r->balance_fewest[1]},
            {"seconds", r->balance_seconds},
        };
        mq_json_add_nums(cJSON_AddObjectToObject(j, "balance"), balance, sizeof balance / sizeof *balance);
    }
    const mq_json_num plan[] = {
        {"budget_bytes", (double)r->plan.budget},
        {"peak_bytes", (double)r->plan.peak},
        {"expert_chunk", r->plan.chunk},
        {"estimated_seconds", r->plan.seconds},
        {"disk_output_bytes", (double)r->plan.disk_output},
    };
    mq_json_add_nums(cJSON_AddObjectToObject(j, "plan"), plan, sizeof plan / sizeof *plan);
    return mq_json_take_text(j);
}
