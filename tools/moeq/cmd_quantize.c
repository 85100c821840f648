/*
 * moeq quantize MODEL_DIR --out OUT_DIR --scheme nvfp4|nvfp4a16|int4|q4_k_m|... [options]:
 * round-to-nearest quantization of every decoder Linear into a checkpoint vLLM loads
 * (compressed-tensors, ModelOpt NVFP4 or GPTQ v1), or a GGUF file (--format gguf; llama.cpp's
 * K-quants only there). W4A4 (--scheme nvfp4) also calibrates the activation scales on --calib text.
 * --method gptq runs GPTQ on --calib. Memory budget, dry run and resume: --max-memory, --dry-run,
 * --resume. The flags are the library's option table (moeq_quant_option_info): each one given
 * goes to moeq_quant_options_set by its name, and moeq_quantize (include/moeq.h) does the work.
 * This file adds the flags of the command itself (--out, --revision, --quiet, --threads) and the
 * combinations refused as usage errors before any work.
 */
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

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
    if (p->gpu_least > 0) {
        if (p->gpu_budget > 0) printf("GPU memory (budget %.2f GB):\n", (double)p->gpu_budget / 1e9);
        else printf("GPU memory (no GPU here and no --max-gpu-memory: no budget):\n");
        print_bytes("attention", p->gpu_attention, "weights, a group of one sample's tokens, kept");
        print_bytes("its stage", p->gpu_attention_stage, "Hessian sums, the first expert, GPTQ");
        print_bytes("one expert's stage", p->gpu_expert, "weights, Hessian sums, rows, GPTQ");
        snprintf(note, sizeof note, "%d expert%s at a time; batches and GPTQ waves take the rest", p->gpu_chunk,
                 p->gpu_chunk == 1 ? "" : "s");
        print_bytes("one layer needs at least", p->gpu_least, p->gpu_chunk > 0 ? note : NULL);
    }
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

/* Hands a given flag to the library: its value as text, read by the same code a binding's value
 * is; the usage error names the flag. */
static int table_apply(const cli_table_flag *f, moeq_quant_options *o) {
    char text[64];
    if (f->info->kind == MOEQ_OPTION_LIST) {
        moeq_quant_options_set_ignore(o, f->list.items, f->list.n);
        return -1;
    }
    const char *v = cli_table_value(f, text, sizeof text);
    return moeq_quant_options_set(o, f->info->key, v) == MOEQ_OK ? -1 : cli_table_refused("quantize", f, v, false);
}

static int fail(const char *msg) {
    cli_progress_finish();
    fprintf(stderr, "moeq quantize: error: %s\n", msg);
    return CLI_FAIL;
}

/* The combinations GPTQ cannot run, checked only with --method gptq: CLI_USAGE or CLI_FAIL
 * (moeq_quantize refuses the latter too, naming the option fields; here they name the flags),
 * else -1. */
static int check_gptq(const cli_table_flag *t, int n, const moeq_quant_options *o) {
    if (o->method != MOEQ_QUANT_GPTQ) return -1;
    if (cli_table_given(t, n, "calib-pool") && !o->gptq.calib_balance)
        return cli_usage_error("quantize", "--calib-pool is the pool --calib-balance experts chooses from");
    if (cli_table_given(t, n, "calib-pool") && o->gptq.calib_pool < o->gptq.nsamples)
        return cli_usage_error("quantize", "--calib-pool %lld: fewer candidates than --nsamples %lld",
                               (long long)o->gptq.calib_pool, (long long)o->gptq.nsamples);
    if (o->gptq.target_unquantized > 0 && o->gptq.mode == MOEQ_GPTQ_NONSEQUENTIAL)
        return fail("--target unquantized needs --gptq-mode sequential");
    if (o->gptq.target_unquantized > 0 && o->gptq.true_sequential)
        return fail("--target unquantized runs with sequential calibration, not --true-sequential");
    if (cli_table_given(t, n, "act-order") && cli_table_given(t, n, "no-act-order"))
        return fail("--act-order and --no-act-order exclude each other");
    if (o->gptq.true_sequential && o->gptq.mode == MOEQ_GPTQ_NONSEQUENTIAL)
        return fail("--true-sequential needs --gptq-mode sequential");
    bool act_order = o->gptq.act_order > 0 || (o->gptq.act_order < 0 && o->scheme == MOEQ_QUANT_INT4);
    if (o->gptq.groups == MOEQ_GPTQ_GROUPS_GIDX && !act_order) return fail("--groups gidx needs --act-order");
    if (o->gptq.groups == MOEQ_GPTQ_GROUPS_GIDX && o->scheme != MOEQ_QUANT_INT4)
        return fail("--groups gidx stores g_idx, which only INT4 checkpoints hold");
    return -1;
}

/* The combinations refused before any work (the flags' values are in o already). */
static int check_flags(const cli_table_flag *t, int n, const moeq_quant_options *o) {
    if (cli_table_given(t, n, "sym") && cli_table_given(t, n, "asym"))
        return cli_usage_error("quantize", "--sym and --asym exclude each other");
    const bool kq = o->scheme >= MOEQ_QUANT_Q3_K;
    const bool nv = !kq && o->scheme != MOEQ_QUANT_INT4;
    if (kq && o->format != MOEQ_FORMAT_GGUF)
        return cli_usage_error("quantize", "--scheme %s: llama.cpp's K-quants are GGUF types (--format gguf)",
                               cli_table_find(t, n, "scheme")->s);
    if (kq && (cli_table_given(t, n, "group-size") || cli_table_given(t, n, "asym") || cli_table_given(t, n, "sym") || cli_table_given(t, n, "int4-scale-sign")))
        return cli_usage_error("quantize", "--scheme %s: the K-quants' blocks, scales and mins are llama.cpp's "
                               "(--group-size/--sym/--asym/--int4-scale-sign are for int4)", cli_table_find(t, n, "scheme")->s);
    if (cli_table_given(t, n, "target-bpw") && !kq)
        return cli_usage_error("quantize", "--target-bpw chooses among llama.cpp's K-quants (--scheme q4_k_m, ...)");
    if (cli_table_given(t, n, "int4-scale-sign") && (o->asym || nv))
        return cli_usage_error("quantize", "--int4-scale-sign is for symmetric INT4 (--scheme int4 without --asym)");
    if (cli_table_given(t, n, "int4-scale-sign") && o->reference && o->int4_scale_sign == MOEQ_INT4_SCALE_SIGNED)
        return cli_usage_error("quantize", "--int4-scale-sign signed: --reference keeps reference.json's positive scales");
    if (cli_table_given(t, n, "gguf-rest") && o->format != MOEQ_FORMAT_GGUF)
        return cli_usage_error("quantize", "--gguf-rest needs --format gguf");
    if (nv && o->format == MOEQ_FORMAT_GPTQ) return cli_usage_error("quantize", "--format gptq holds INT4 only");
    if (!nv && o->format == MOEQ_FORMAT_MODELOPT)
        return cli_usage_error("quantize", "--format modelopt holds NVFP4 only");
    if (nv && (o->asym || (cli_table_given(t, n, "group-size") && o->group_size != 16)))
        return cli_usage_error("quantize", "NVFP4 is symmetric with groups of 16 (--group-size/--asym are for int4)");
    if (!nv && cli_table_given(t, n, "group-size") && o->group_size == 0)
        return cli_usage_error("quantize", "--group-size must be positive or -1");
    const bool w4a4 = o->scheme == MOEQ_QUANT_NVFP4, gptq = o->method == MOEQ_QUANT_GPTQ;
    if (w4a4 && !o->calib)
        return cli_usage_error("quantize", "--scheme nvfp4 (W4A4) needs --calib FILE for its activation "
                               "scales; --scheme nvfp4a16 is weight-only");
    if (gptq && !o->calib) return cli_usage_error("quantize", "--method gptq needs --calib FILE");
    if (o->calib_field && !o->calib) return cli_usage_error("quantize", "--calib-field needs --calib FILE");
    if (!w4a4 && !gptq && o->calib)
        return cli_usage_error("quantize", "--calib is only used by --scheme nvfp4 and --method gptq");
    const char *dev = o->device;
    if (dev && strcmp(dev, "cpu") && strcmp(dev, "cuda") &&
        !(strncmp(dev, "cuda:", 5) == 0 && dev[5] && strspn(dev + 5, "0123456789") == strlen(dev + 5)))
        return cli_usage_error("quantize", "--device %s: expected cpu, cuda or cuda:N", dev);
    const cli_table_flag *prec = cli_table_find(t, n, "gpu-precision");
    const bool tf32 = cli_table_given(t, n, "gpu-tf32");
    if (tf32 && prec && prec->seen && strcmp(prec->s, "tf32"))
        return cli_usage_error("quantize", "--gpu-tf32 and --gpu-precision %s disagree", prec->s);
    if (o->gpu_precision != MOEQ_GPU_FP32 && (!dev || !strcmp(dev, "cpu")))
        return cli_usage_error("quantize", "--gpu-%s needs --device cuda", tf32 ? "tf32" : "precision");
    return check_gptq(t, n, o);
}

/* The GPTQ lines of the summary: calibration, fallbacks, losses, timings and the report path. */
static void print_gptq(const moeq_quant_result *r, const moeq_quant_options *o, const char *out_dir) {
    cli_progress_finish();
    if (r->balance_candidates > 0)
        printf("calibration: %lld of %lld candidates chosen across experts in %.1f s; experts below %lld "
               "tokens %lld -> %lld, the fewest tokens %lld -> %lld (against the first %lld)\n",
               (long long)r->gptq_samples, (long long)r->balance_candidates, r->balance_seconds,
               (long long)o->gptq.min_expert_tokens,
               (long long)r->balance_under[0], (long long)r->balance_under[1], (long long)r->balance_fewest[0],
               (long long)r->balance_fewest[1], (long long)r->gptq_samples);
    printf("gptq: %lld samples, %lld tokens; %lld Linears (%lld experts below %lld tokens: %s); "
           "layer loss %.4g vs RTN %.4g (%lld worse); %.1f s (forward %.1f, Hessians %.1f, "
           "GPTQ %.1f)\nreport: ",
           (long long)r->gptq_samples, (long long)r->gptq_tokens, (long long)r->gptq_linears,
           (long long)r->gptq_fallback_linears, (long long)o->gptq.min_expert_tokens,
           o->gptq.expert_fallback == MOEQ_EXPERT_FALLBACK_RTN ? "rtn" : "block Hessian",
           r->gptq_loss, r->gptq_rtn_loss, (long long)r->gptq_worse_than_rtn, r->gptq_seconds,
           r->gptq_seconds_forward, r->gptq_seconds_hessian, r->gptq_seconds_solve);
    /* the path moeq_quantize wrote, formed by the same function */
    char *report = moeq_quant_report_path(out_dir, o);
    printf("%s\n", report ? report : "(none)");
    moeq_string_free(report);
    if (o->gptq.report_html) printf("report page: %s\n", o->gptq.report_html);
}

int cmd_quantize(int argc, char **argv) {
    const char *out = NULL, *revision = NULL;
    bool quiet = false;
    int64_t threads = 0;
    /* the command's own flags keep their places in --help */
    const cli_own_flag own[] = {
        {"scheme", {"--out", OPT_STRING, &out, "OUT_DIR", "output checkpoint directory (required)", NULL, 0, 0, NULL}},
        {"scale-search", CLI_REVISION_OPT(revision)},
        {"nsamples", {"--quiet", OPT_FLAG, &quiet, NULL, "no progress bar and no summary", NULL, 0, 0, NULL}},
        {NULL, {"--threads", OPT_INT, &threads, "N", "worker threads (default: every CPU it may use)", NULL, 1, 1024,
                NULL}},
    };
    static cli_table tb;
    if (!cli_table_build(&tb, "quantize", moeq_quant_option_info, own, (int)(sizeof own / sizeof own[0])))
        return CLI_FAIL;
    cli_table_flag *t = tb.t;
    const int n = tb.n;
    const cli_command cmd = {
        "quantize", "MODEL_DIR --out OUT_DIR --scheme nvfp4|nvfp4a16|int4|q3_k..q6_k|q3_k_m|q4_k_m|q5_k_m|iq4_nl|iq4_xs [options]",
        "Quantizes every decoder Linear (attention, dense and expert MLPs) by round to nearest or\n"
        "GPTQ (--method gptq --calib FILE: per-expert Hessians from the tokens routed to each\n"
        "expert) and writes a checkpoint that vLLM loads. One streaming pass over the model, layer\n"
        "by layer, routed experts a chunk at a time, within --max-memory (planned first; see\n"
        "--dry-run). Routers, shared_expert_gate, embeddings, norms and lm_head stay in the source\n"
        "dtype and are listed in the config's ignore list. NVFP4 global scales are shared by\n"
        "q/k/v, by gate/up and by each expert's gate/up, as vLLM requires.\n"
        "The checkpoint is assembled in OUT_DIR.moeq-work and renamed to OUT_DIR when complete;\n"
        "an interrupted run (Ctrl-C, a crash, a kill) continues with the same command and --resume.",
        tb.opts, tb.n_opts, 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    const cli_table_flag *ignore = cli_table_find(t, n, "ignore");
    moeq_quant_options o;
    moeq_quant_options_init(&o);
    /* in the table's order, so that a later alias (--static-groups, --gpu-tf32) wins */
    for (int i = 0; i < n && rc < 0; i++)
        if (t[i].seen) rc = table_apply(&t[i], &o);
    if (rc < 0 && !out) rc = cli_usage_error("quantize", "--out OUT_DIR is required");
    if (rc < 0 && !cli_table_given(t, n, "scheme"))
        rc = cli_usage_error("quantize", "--scheme is required (nvfp4, nvfp4a16, int4, or with --format gguf "
                             "q3_k .. q6_k, q3_k_m, q4_k_m, q5_k_m, iq4_nl, iq4_xs)");
    if (rc < 0 && threads) moeq_set_threads((int)threads);
    if (rc < 0) rc = check_flags(t, n, &o);
    moeq_quant_result res;
    moeq_status st = MOEQ_OK;
    const char *model_dir = NULL;
    if (rc < 0) {
        cli_install_sigint();
        cli_progress_enable(quiet);
        if (quiet) moeq_set_log(warnings_only, NULL);
        model_dir = cli_checkpoint_dir("quantize", pos[0], revision);
        if (!model_dir) rc = CLI_FAIL;
    }
    if (rc < 0) st = moeq_quantize(model_dir, out, &o, &res);
    if (ignore) free(ignore->list.items);
    if (rc >= 0) return rc;
    if (o.dry_run && (st == MOEQ_OK || st == MOEQ_E_NOMEM)) print_plan(model_dir, &res.plan);
    if (st) return cli_fail("quantize", st);
    if (o.dry_run) return CLI_OK;
    if (o.method == MOEQ_QUANT_GPTQ && !quiet) print_gptq(&res, &o, out);
    cli_progress_finish();
    if (!quiet) {
        const cli_table_flag *format = cli_table_find(t, n, "format");
        printf("%s: %lld Linears quantized (%s %s, %lld weights), %lld kept; %lld tensors, %.1f MB, "
               "%.1f s, peak memory %.2f GB%s\n", out, (long long)res.linears_quantized,
               cli_table_find(t, n, "scheme")->s, format->seen ? format->s : "compressed-tensors",
               (long long)res.weights_quantized, (long long)res.linears_kept,
               (long long)res.tensors_written, (double)res.bytes_written / 1e6, res.seconds,
               (double)res.peak_anon_bytes / 1e9, res.layers_resumed ? " (resumed)" : "");
    }
    return CLI_OK;
}
