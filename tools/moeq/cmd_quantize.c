/*
 * moeq quantize MODEL_DIR --out OUT_DIR --scheme nvfp4|nvfp4a16|int4 [options]: round-to-nearest
 * quantization of every decoder Linear into a checkpoint vLLM loads (compressed-tensors, ModelOpt
 * NVFP4 or GPTQ v1). W4A4 (--scheme nvfp4) also calibrates the activation scales on --calib text.
 * --method gptq runs GPTQ on --calib (its flags: quantize_gptq.c). Memory budget, dry run and
 * resume: --max-memory, --dry-run, --resume. The flags become moeq_quant_options and
 * moeq_quantize (include/moeq.h) does the work.
 */
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "quantize_gptq.h"

/* --quiet: the per-layer lines go, warnings stay. */
static void warnings_only(void *user, int level, const char *msg) {
    (void)user;
    if (level > 0) fprintf(stderr, "moeq: warning: %s\n", msg);
}

static void print_bytes(const char *what, int64_t b, const char *note) {
    printf("  %-34s %9.2f GB%s%s\n", what, (double)b / 1e9, note ? "  " : "", note ? note : "");
}

/* --dry-run: what the run would hold and cost. */
static void print_plan(const char *model, const moeq_quant_plan *p) {
    static const char *const storage[] = {"auto", "memory (fp32)", "work files (fp32)", "memory (bf16)"};
    printf("plan for %s: %d layers\n", model, p->layers);
    if (moeq_dist_size() > 1)
        printf("memory of each of %d ranks (anonymous; budget %.2f GB per rank):\n", moeq_dist_size(),
               (double)p->budget / 1e9);
    else
        printf("memory (anonymous; budget %.2f GB):\n", (double)p->budget / 1e9);
    char note[96];
    snprintf(note, sizeof note, "in %s", storage[p->activations_storage & 3]);
    print_bytes("calibration activations", p->activations, note);
    print_bytes("routing", p->routing, NULL);
    print_bytes("attention state and KV cache", p->state, NULL);
    print_bytes("one layer's attention", p->attention, "weights, Hessians, factors, the writer's queue");
    if (p->chunk > 0) {
        snprintf(note, sizeof note, "%d expert%s at a time, %d chunk%s per layer, up to %d samples "
                 "per batch", p->chunk, p->chunk > 1 ? "s" : "", p->n_chunks, p->n_chunks > 1 ? "s" : "",
                 p->sample_batch);
        print_bytes("one expert chunk", p->expert_chunk, note);
    }
    print_bytes("shared expert / dense MLP", p->ffn_other, NULL);
    if (p->read_ahead > 0) print_bytes("read ahead", p->read_ahead, "the next expert chunk or layer's attention, in the two above");
    if (p->snapshot_copy > 0) print_bytes("activation snapshot", p->snapshot_copy, "a copy written behind the next layer");
    print_bytes("peak", p->peak, NULL);
    if (p->attention_passes > 0)
        printf("passes per layer: %d over the attention (%s), %d per expert chunk / MLP "
               "(%scalibration%s)\n", p->attention_passes,
               p->attention_passes > 2   ? "the unquantized model's stream, the quantized one's unquantized for the "
                                           "Hessians, then quantized"
               : p->attention_passes > 1 ? "unquantized for the Hessians, then quantized"
                                         : "unquantized",
               p->ffn_passes, p->ffn_passes > 2 ? "the unquantized model's output, " : "",
               p->ffn_passes > 1 ? ", then the quantized output" : " and output");
    printf("disk: checkpoint %.2f GB, work files up to %.2f GB\n", (double)p->disk_output / 1e9,
           (double)p->disk_work / 1e9);
    if (p->flops_forward + p->flops_hessian + p->flops_gptq > 0) {
        printf("compute: forward %.3g TFLOP, Hessians %.3g TFLOP, GPTQ %.3g TFLOP\n",
               p->flops_forward / 1e12, p->flops_hessian / 1e12, p->flops_gptq / 1e12);
        printf("estimated time on this machine (sgemm %.0f GFLOP/s): %.0f s (%.2f h)\n",
               p->sgemm_gflops, p->seconds, p->seconds / 3600);
    }
}

int cmd_quantize(int argc, char **argv) {
    const char *out = NULL, *scheme = NULL, *method = "rtn", *format = "compressed-tensors";
    const char *max_shard = NULL, *calib = NULL, *max_memory = NULL, *work_dir = NULL, *calib_field = NULL;
    const char *activations = "auto", *device = NULL, *revision = NULL, *scale_search = NULL;
    const char *gguf_rest = NULL, *rotate = "none", *gpu_precision = NULL, *int4_sign = NULL;
    int64_t group = 0, calib_tokens = 65536, expert_chunk = 0, rotate_block = 0;
    double mpi_timeout = 0, headroom = 0;
    bool sym = false, asym = false, force = false, quiet = false, mse = false, no_fuse = false, gpu_tf32 = false;
    bool reference = false, group_seen = false, resume = false, dry_run = false, drop_mtp = false;
    cli_list ignore = {0};
    gptq_cli gq;
    gptq_cli_defaults(&gq);
    const cli_opt opts[] = {
        {"--out", OPT_STRING, &out, "OUT_DIR", "output checkpoint directory (required)", NULL, 0, 0, NULL},
        {"--scheme", OPT_CHOICE, &scheme, NULL,
         "nvfp4 = W4A4 (needs --calib), nvfp4a16 = weight-only NVFP4, int4 = weight-only INT4",
         "nvfp4|nvfp4a16|int4", 0, 0, NULL},
        {"--group-size", OPT_INT, &group, "G", "INT4 group size: 32, 64, 128 (default) or -1 = per "
         "channel; NVFP4 is always 16", NULL, -1, 1 << 20, &group_seen},
        {"--sym", OPT_FLAG, &sym, NULL, "INT4 symmetric (default): codes -8..7 times the group's "
         "scale (see --int4-scale-sign)", NULL, 0, 0, NULL},
        {"--int4-scale-sign", OPT_CHOICE, &int4_sign, NULL, "symmetric INT4: signed (default) = "
         "amax/8, negative where the group's largest magnitude is positive, so that it gets the "
         "code -8 either way (llama.cpp's Q4_0 does the same; engines need nothing); positive = "
         "amax/7.5 (amax/7 with --reference, which keeps positive scales)", "signed|positive", 0, 0, NULL},
        {"--asym", OPT_FLAG, &asym, NULL, "INT4 asymmetric: scale = (max-min)/15, zero point", NULL,
         0, 0, NULL},
        {"--method", OPT_CHOICE, &method, NULL, "round to nearest (default) or GPTQ "
         "(needs --calib)", "rtn|gptq", 0, 0, NULL},
        {"--format", OPT_CHOICE, &format, NULL, "checkpoint layout (default compressed-tensors)",
         "compressed-tensors|modelopt|gptq|gguf", 0, 0, NULL},
        {"--gguf-rest", OPT_CHOICE, &gguf_rest, NULL, "--format gguf: the unquantized 2-D tensors "
         "(embeddings, lm_head, ignored Linears) in their source dtype (auto, the default) or as "
         "given; norms, biases and routers are F32", "auto|f32|f16|bf16|q8_0", 0, 0, NULL},
        {"--ignore", OPT_LIST, &ignore, "REGEX", "keep Linears whose module name matches "
         "unquantized (repeatable; PCRE2, unanchored)", NULL, 0, 0, NULL},
        {"--rotate", OPT_CHOICE, &rotate, NULL, "residual: rotate the residual stream by a "
         "block-diagonal randomized Hadamard folded into the weights (norms folded first; the "
         "checkpoint computes the same function, an engine needs nothing; a tied lm_head is "
         "untied); default none", "none|residual", 0, 0, NULL},
        {"--rotate-block", OPT_INT, &rotate_block, "B", "--rotate: channels per Hadamard block, a "
         "power of two dividing the hidden size (default: the group size, NVFP4 16, INT4 128; 64 "
         "per channel)", NULL, 2, 1 << 20, NULL},
        {"--mse", OPT_FLAG, &mse, NULL, "search each group's scale (17 points, 0.70-1.10 x max) for "
         "the least squared error", NULL, 0, 0, NULL},
        {"--no-fuse", OPT_FLAG, &no_fuse, NULL, "one NVFP4 global scale per tensor (vLLM wants them "
         "shared by q/k/v and gate/up: only for experiments)", NULL, 0, 0, NULL},
        {"--reference", OPT_FLAG, &reference, NULL, "the conventions of shared/fixtures/reference.json: "
         "INT4 amax/7 with F32 scales; NVFP4 per-tensor global scales, block scales >= 2^-9", NULL,
         0, 0, NULL},
        {"--calib", OPT_STRING, &calib, "FILE", "calibration text or JSONL (either may be .gz) for the W4A4 "
         "activation scales and the GPTQ Hessians",
         NULL, 0, 0, NULL},
        {"--calib-field", OPT_STRING, &calib_field, "NAME", "the JSONL records' field to read (default "
         "text, else messages); a chat messages list becomes \"role: content\" lines", NULL, 0, 0, NULL},
        {"--calib-tokens", OPT_INT, &calib_tokens, "N", "calibration tokens (default 65536)", NULL,
         1, (int64_t)1 << 40, NULL},
        {"--max-shard-size", OPT_STRING, &max_shard, "N", "largest shard (bytes, or 500MB, 5GB, "
         "2GiB; default 5GB)", NULL, 0, 0, NULL},
        {"--force", OPT_FLAG, &force, NULL, "replace OUT_DIR if it exists", NULL, 0, 0, NULL},
        {"--max-memory", OPT_STRING, &max_memory, "SIZE", "memory the run may use (e.g. 6GB; "
         "default 85% of the available memory); planned before any compute", NULL, 0, 0, NULL},
        {"--dry-run", OPT_FLAG, &dry_run, NULL, "print the plan (memory per part, expert chunk, "
         "FLOPs, estimated time, disk) and stop", NULL, 0, 0, NULL},
        {"--drop-mtp", OPT_FLAG, &drop_mtp, NULL, "leave out the multi-token-prediction layers "
         "(DeepSeek-V3's num_nextn_predict_layers; default: passed through unchanged)", NULL, 0, 0,
         NULL},
        {"--resume", OPT_FLAG, &resume, NULL, "continue an interrupted run (same model, options "
         "and calibration) from its last finished layer", NULL, 0, 0, NULL},
        {"--work-dir", OPT_STRING, &work_dir, "DIR", "where a run keeps its work until it "
         "finishes (default OUT_DIR.moeq-work; on OUT_DIR's file system)", NULL, 0, 0, NULL},
        {"--expert-chunk", OPT_INT, &expert_chunk, "N", "routed experts loaded at once (default: "
         "as many as --max-memory allows; the result does not depend on it)", NULL, 1, 1 << 20, NULL},
        {"--activations", OPT_CHOICE, &activations, NULL, "calibration activations in memory, in "
         "work files (same result) or in bf16 (half the memory, slightly different result); "
         "default auto: memory while it fits", "auto|ram|disk|bf16", 0, 0, NULL},
        CLI_REVISION_OPT(revision),
        {"--scale-search", OPT_STRING, &scale_search, "LO:HI[:N]", "the MSE scale search's range as multiples "
         "of the max-based scale (default 0.90:1.50:25 for nvfp4 with GPTQ, else 0.70:1.10:17)", NULL, 0, 0, NULL},
        {"--global-scale-headroom", OPT_DOUBLE, &headroom, "H", "NVFP4: the global scale leaves the "
         "largest block scales room up to H times their max-based value below E4M3's 448 (default "
         "1: none), for a --scale-search above 1", NULL, 0, 0, NULL},
        {"--device", OPT_STRING, &device, "DEV", "where GPTQ factors and quantizes: cpu (default), "
         "cuda or cuda:N (a build with -DMOEQ_CUDA=ON; codes agree with the CPU's but for "
         "weights on a rounding threshold)", NULL, 0, 0, NULL},
        {"--gpu-precision", OPT_CHOICE, &gpu_precision, NULL, "with --device cuda: the arithmetic of "
         "the GPU's calibration products and Hessian sums: fp32 (default; the CPU's bits), tf32x3 "
         "(three TF32 tensor-core products from each input's hi and lo halves: about fp32's "
         "accuracy) or tf32 (one: 10-bit mantissas, fastest; also the attention's scores and "
         "GPTQ's updates)",
         "fp32|tf32x3|tf32", 0, 0, NULL},
        {"--gpu-tf32", OPT_FLAG, &gpu_tf32, NULL, "the same as --gpu-precision tf32", NULL, 0, 0, NULL},
        {"--mpi-timeout", OPT_DOUBLE, &mpi_timeout, "SECONDS", "under mpirun: how long a rank waits "
         "for the others at a step before the job stops (default 3600)", NULL, 0, 0, NULL},
        {"--quiet", OPT_FLAG, &quiet, NULL, "no progress bar and no summary", NULL, 0, 0, NULL},
        GPTQ_CLI_OPTS(gq),
    };
    const cli_command cmd = {
        "quantize", "MODEL_DIR --out OUT_DIR --scheme nvfp4|nvfp4a16|int4 [options]",
        "Quantizes every decoder Linear (attention, dense and expert MLPs) by round to nearest or\n"
        "GPTQ (--method gptq --calib FILE: per-expert Hessians from the tokens routed to each\n"
        "expert) and writes a checkpoint that vLLM loads. One streaming pass over the model, layer\n"
        "by layer, routed experts a chunk at a time, within --max-memory (planned first; see\n"
        "--dry-run). Routers, shared_expert_gate, embeddings, norms and lm_head stay in the source\n"
        "dtype and are listed in the config's ignore list. NVFP4 global scales are shared by\n"
        "q/k/v, by gate/up and by each expert's gate/up, as vLLM requires.\n"
        "The checkpoint is assembled in OUT_DIR.moeq-work and renamed to OUT_DIR when complete;\n"
        "an interrupted run (Ctrl-C, a crash, a kill) continues with the same command and --resume.",
        opts, (int)(sizeof opts / sizeof opts[0]), 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!out) return cli_usage_error("quantize", "--out OUT_DIR is required");
    if (!scheme) return cli_usage_error("quantize", "--scheme is required (nvfp4, nvfp4a16 or int4)");
    if (sym && asym) return cli_usage_error("quantize", "--sym and --asym exclude each other");
    if (int4_sign && (asym || strcmp(scheme, "int4") != 0))
        return cli_usage_error("quantize", "--int4-scale-sign is for symmetric INT4 (--scheme int4 without --asym)");
    if (int4_sign && reference && !strcmp(int4_sign, "signed"))
        return cli_usage_error("quantize", "--int4-scale-sign signed: --reference keeps reference.json's positive scales");
    bool nv = strcmp(scheme, "int4") != 0;
    moeq_ckpt_format fmt = strcmp(format, "modelopt") == 0 ? MOEQ_FORMAT_MODELOPT
                           : strcmp(format, "gptq") == 0  ? MOEQ_FORMAT_GPTQ
                           : strcmp(format, "gguf") == 0  ? MOEQ_FORMAT_GGUF
                                                          : MOEQ_FORMAT_COMPRESSED_TENSORS;
    if (gguf_rest && fmt != MOEQ_FORMAT_GGUF) return cli_usage_error("quantize", "--gguf-rest needs --format gguf");
    if (nv && fmt == MOEQ_FORMAT_GPTQ)
        return cli_usage_error("quantize", "--format gptq holds INT4 only");
    if (!nv && fmt == MOEQ_FORMAT_MODELOPT)
        return cli_usage_error("quantize", "--format modelopt holds NVFP4 only");
    if (nv && (asym || (group_seen && group != 16)))
        return cli_usage_error("quantize", "NVFP4 is symmetric with groups of 16 (--group-size/--asym are for int4)");
    if (!nv && group_seen && group == 0)
        return cli_usage_error("quantize", "--group-size must be positive or -1");
    bool w4a4 = strcmp(scheme, "nvfp4") == 0;
    if (w4a4 && !calib)
        return cli_usage_error("quantize", "--scheme nvfp4 (W4A4) needs --calib FILE for its activation "
                               "scales; --scheme nvfp4a16 is weight-only");
    if (gq.threads) moeq_set_threads((int)gq.threads);
    bool gptq = strcmp(method, "gptq") == 0;
    if (gptq && !calib) return cli_usage_error("quantize", "--method gptq needs --calib FILE");
    if (calib_field && !calib) return cli_usage_error("quantize", "--calib-field needs --calib FILE");
    if (!w4a4 && !gptq && calib)
        return cli_usage_error("quantize", "--calib is only used by --scheme nvfp4 and --method gptq");
    moeq_quant_options o;
    moeq_quant_options_init(&o);
    uint64_t shard = 0;
    if (max_shard && !cli_parse_size(max_shard, &shard))
        return cli_usage_error("quantize", "--max-shard-size: cannot read '%s'", max_shard);
    o.scheme = w4a4 ? MOEQ_QUANT_NVFP4 : nv ? MOEQ_QUANT_NVFP4A16 : MOEQ_QUANT_INT4;
    o.method = gptq ? MOEQ_QUANT_GPTQ : MOEQ_QUANT_RTN;
    o.format = fmt;
    o.gguf_rest = gguf_rest;
    o.max_shard_bytes = (int64_t)shard;
    if (!nv && group_seen) o.group_size = (int32_t)group;
    o.asym = asym;
    if (int4_sign) o.int4_scale_sign = strcmp(int4_sign, "signed") ? MOEQ_INT4_SCALE_POSITIVE : MOEQ_INT4_SCALE_SIGNED;
    o.mse = mse;
    o.no_fuse = no_fuse;
    o.global_scale_headroom = headroom;
    o.reference = reference;
    o.ignore = ignore.items;
    o.n_ignore = ignore.n;
    o.calib = calib;
    o.calib_field = calib_field;
    o.calib_tokens = calib_tokens;
    o.force = force;
    uint64_t mem = 0;
    if (max_memory && !cli_parse_size(max_memory, &mem))
        return cli_usage_error("quantize", "--max-memory: cannot read '%s'", max_memory);
    o.max_memory = (int64_t)mem;
    o.work_dir = work_dir;
    o.resume = resume;
    o.dry_run = dry_run;
    o.drop_mtp = drop_mtp;
    o.rotate = strcmp(rotate, "residual") == 0 ? MOEQ_ROTATE_RESIDUAL : MOEQ_ROTATE_NONE;
    o.rotate_block = (int32_t)rotate_block;
    o.expert_chunk = (int32_t)expert_chunk;
    if (device && strcmp(device, "cpu") && strcmp(device, "cuda") &&
        !(strncmp(device, "cuda:", 5) == 0 && device[5] && strspn(device + 5, "0123456789") == strlen(device + 5)))
        return cli_usage_error("quantize", "--device %s: expected cpu, cuda or cuda:N", device);
    o.device = device;
    if (gpu_tf32 && gpu_precision && strcmp(gpu_precision, "tf32"))
        return cli_usage_error("quantize", "--gpu-tf32 and --gpu-precision %s disagree", gpu_precision);
    if (gpu_tf32) gpu_precision = "tf32";
    if (gpu_precision && strcmp(gpu_precision, "fp32") && (!device || !strcmp(device, "cpu")))
        return cli_usage_error("quantize", "--gpu-%s needs --device cuda", gpu_tf32 ? "tf32" : "precision");
    if (gpu_precision) moeq_quant_options_set(&o, "gpu-precision", gpu_precision);   /* a checked choice */
    if (mpi_timeout < 0) return cli_usage_error("quantize", "--mpi-timeout must be >= 0 seconds");
    o.mpi_timeout = mpi_timeout;
    /* parsed by the library's option setter; range checks are moeq_quantize's */
    if (scale_search && (moeq_quant_options_set(&o, "scale-search", scale_search) || !(o.scale_lo > 0) ||
                         !(o.scale_hi > 0)))
        return cli_usage_error("quantize", "--scale-search %s: expected LO:HI or LO:HI:N, e.g. 0.9:1.5", scale_search);
    o.activations = strcmp(activations, "ram") == 0    ? MOEQ_ACT_STORAGE_RAM
                    : strcmp(activations, "disk") == 0 ? MOEQ_ACT_STORAGE_DISK
                    : strcmp(activations, "bf16") == 0 ? MOEQ_ACT_STORAGE_BF16
                                                       : MOEQ_ACT_STORAGE_AUTO;

    cli_install_sigint();
    cli_progress_enable(quiet);
    if (quiet) moeq_set_log(warnings_only, NULL);
    moeq_quant_result res;
    moeq_status st = MOEQ_OK;
    rc = gptq_cli_apply(&gq, &o);
    const char *model_dir = rc < 0 ? cli_checkpoint_dir("quantize", pos[0], revision) : NULL;
    if (rc < 0 && !model_dir) rc = CLI_FAIL;
    if (rc < 0) st = moeq_quantize(model_dir, out, &o, &res);
    free(ignore.items);
    if (rc >= 0) return rc;
    if (dry_run && (st == MOEQ_OK || st == MOEQ_E_NOMEM)) print_plan(model_dir, &res.plan);
    if (st) return cli_fail("quantize", st);
    if (dry_run) return CLI_OK;
    if (gptq && !quiet) gptq_cli_print(&res, &o, out);
    cli_progress_finish();
    if (!quiet)
        printf("%s: %lld Linears quantized (%s %s, %lld weights), %lld kept; %lld tensors, %.1f MB, "
               "%.1f s, peak memory %.2f GB%s\n", out, (long long)res.linears_quantized, scheme, format,
               (long long)res.weights_quantized, (long long)res.linears_kept,
               (long long)res.tensors_written, (double)res.bytes_written / 1e6, res.seconds,
               (double)res.peak_anon_bytes / 1e9, res.layers_resumed ? " (resumed)" : "");
    return CLI_OK;
}
