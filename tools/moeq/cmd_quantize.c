/*
 * moeq quantize MODEL_DIR --out OUT_DIR --scheme nvfp4|nvfp4a16|int4 [options]: round-to-nearest
 * quantization of every decoder Linear into a checkpoint vLLM loads (compressed-tensors, ModelOpt
 * NVFP4 or GPTQ v1; see src/export/quantize.h). W4A4 (--scheme nvfp4) also calibrates the
 * activation scales on --calib text with the fp32 model. --method gptq runs GPTQ on --calib
 * (quantize_gptq.c) and hands its tensors to the same writer.
 */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "core/core.h"
#include "export/act_amax.h"
#include "export/quantize.h"
#include "quantize_gptq.h"

/* "5GB", "500MB", "64KiB", "1048576" -> bytes (KB/MB/GB decimal, KiB/MiB/GiB binary). */
static bool parse_size(const char *s, size_t *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || !(v > 0)) return false;
    while (*end == ' ') end++;
    static const struct { const char *suf; double mul; } units[] = {
        {"", 1}, {"B", 1}, {"K", 1e3}, {"KB", 1e3}, {"M", 1e6}, {"MB", 1e6}, {"G", 1e9},
        {"GB", 1e9}, {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}};
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        size_t n = strlen(units[i].suf);
        bool same = strlen(end) == n;
        for (size_t k = 0; same && k < n; k++)
            same = toupper((unsigned char)end[k]) == toupper((unsigned char)units[i].suf[k]);
        if (same) {
            double b = v * units[i].mul;
            if (b < 1 || b > 1e18) return false;
            *out = (size_t)b;
            return true;
        }
    }
    return false;
}

static float amax_lookup(void *user, const char *module) {
    return mq_act_amax_get(user, module);
}

/* W4A4: activation amax of every Linear input over the first calib_tokens tokens of calib. */
static moeq_status calibrate(const char *model_dir, const char *calib, int64_t calib_tokens,
                             mq_act_amax **out) {
    moeq_model *m = NULL;
    char *text = NULL;
    size_t len = 0;
    int32_t *ids = NULL;
    size_t n = 0;
    moeq_status s = moeq_model_open(model_dir, NULL, &m);
    if (!s && !moeq_model_tokenizer(m))
        s = mq_err(MOEQ_E_NOTFOUND, "%s: no tokenizer.json to tokenize the calibration text", model_dir);
    if (!s) s = mq_read_file(calib, &text, &len);
    if (!s) {
        s = moeq_tokenizer_encode(moeq_model_tokenizer(m), text, len, &ids, &n);
        if (s) mq_err_prefix(s, "%s", calib);
    }
    if (!s && n == 0) s = mq_err(MOEQ_E_ARG, "%s: the calibration text has no tokens", calib);
    if (!s) {
        int64_t chunk = m->cfg.max_pos > 0 && m->cfg.max_pos < 512 ? m->cfg.max_pos : 512;
        int64_t use = (int64_t)n < calib_tokens ? (int64_t)n : calib_tokens;
        s = mq_act_amax_collect(m, ids, use, chunk, out);
    }
    free(ids);
    free(text);
    moeq_model_free(m);
    return s;
}

int cmd_quantize(int argc, char **argv) {
    const char *out = NULL, *scheme = NULL, *method = "rtn", *format = "compressed-tensors";
    const char *max_shard = NULL, *calib = NULL;
    int64_t group = 0, calib_tokens = 65536;
    bool sym = false, asym = false, force = false, quiet = false, mse = false, no_fuse = false;
    bool reference = false, group_seen = false;
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
        {"--sym", OPT_FLAG, &sym, NULL, "INT4 symmetric (default): scale = amax/7.5", NULL, 0, 0, NULL},
        {"--asym", OPT_FLAG, &asym, NULL, "INT4 asymmetric: scale = (max-min)/15, zero point", NULL,
         0, 0, NULL},
        {"--method", OPT_CHOICE, &method, NULL, "round to nearest (default) or GPTQ "
         "(needs --calib)", "rtn|gptq", 0, 0, NULL},
        {"--format", OPT_CHOICE, &format, NULL, "checkpoint layout (default compressed-tensors)",
         "compressed-tensors|modelopt|gptq", 0, 0, NULL},
        {"--ignore", OPT_LIST, &ignore, "REGEX", "keep Linears whose module name matches "
         "unquantized (repeatable; PCRE2, unanchored)", NULL, 0, 0, NULL},
        {"--mse", OPT_FLAG, &mse, NULL, "search each group's scale (17 points, 0.70-1.10 x max) for "
         "the least squared error", NULL, 0, 0, NULL},
        {"--no-fuse", OPT_FLAG, &no_fuse, NULL, "one NVFP4 global scale per tensor (vLLM wants them "
         "shared by q/k/v and gate/up: only for experiments)", NULL, 0, 0, NULL},
        {"--reference", OPT_FLAG, &reference, NULL, "the conventions of shared/fixtures/reference.json: "
         "INT4 amax/7 with F32 scales; NVFP4 per-tensor global scales, block scales >= 2^-9", NULL,
         0, 0, NULL},
        {"--calib", OPT_STRING, &calib, "FILE", "calibration text (or JSONL) for the W4A4 "
         "activation scales and the GPTQ Hessians",
         NULL, 0, 0, NULL},
        {"--calib-tokens", OPT_INT, &calib_tokens, "N", "calibration tokens (default 65536)", NULL,
         1, (int64_t)1 << 40, NULL},
        {"--max-shard-size", OPT_STRING, &max_shard, "N", "largest shard (bytes, or 500MB, 5GB, "
         "2GiB; default 5GB)", NULL, 0, 0, NULL},
        {"--force", OPT_FLAG, &force, NULL, "replace OUT_DIR if it exists", NULL, 0, 0, NULL},
        {"--quiet", OPT_FLAG, &quiet, NULL, "no progress bar and no summary", NULL, 0, 0, NULL},
        GPTQ_CLI_OPTS(gq),
    };
    const cli_command cmd = {
        "quantize", "MODEL_DIR --out OUT_DIR --scheme nvfp4|nvfp4a16|int4 [options]",
        "Quantizes every decoder Linear (attention, dense and expert MLPs) by round to nearest or\n"
        "GPTQ (--method gptq --calib FILE: per-expert Hessians from the tokens routed to each\n"
        "expert, one transformer block at a time) and writes a checkpoint that vLLM loads.\n"
        "Routers, shared_expert_gate, embeddings, norms and lm_head stay in the source dtype and\n"
        "are listed in the config's ignore list. NVFP4 global scales are shared by q/k/v, by\n"
        "gate/up and by each expert's gate/up, as vLLM requires.\n"
        "The checkpoint is written to a temporary directory renamed to OUT_DIR when complete.",
        opts, (int)(sizeof opts / sizeof opts[0]), 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!out) return cli_usage_error("quantize", "--out OUT_DIR is required");
    if (!scheme) return cli_usage_error("quantize", "--scheme is required (nvfp4, nvfp4a16 or int4)");
    if (sym && asym) return cli_usage_error("quantize", "--sym and --asym exclude each other");
    bool nv = strcmp(scheme, "int4") != 0;
    mq_ckpt_format fmt = strcmp(format, "modelopt") == 0 ? MQ_FMT_MODELOPT
                         : strcmp(format, "gptq") == 0  ? MQ_FMT_GPTQ
                                                        : MQ_FMT_CT;
    if (nv && fmt == MQ_FMT_GPTQ)
        return cli_usage_error("quantize", "--format gptq holds INT4 only");
    if (!nv && fmt == MQ_FMT_MODELOPT)
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
    if (!w4a4 && !gptq && calib)
        return cli_usage_error("quantize", "--calib is only used by --scheme nvfp4 and --method gptq");
    mq_quantize_opts o;
    mq_quantize_opts_init(&o, nv ? MQ_QS_NVFP4 : MQ_QS_INT4, fmt);
    if (max_shard && !parse_size(max_shard, &o.max_shard_bytes))
        return cli_usage_error("quantize", "--max-shard-size: cannot read '%s'", max_shard);
    if (!nv && group_seen) o.spec.group_size = (int32_t)group;
    o.spec.asym = asym;
    o.spec.mse = mse;
    o.no_fuse = no_fuse;
    if (reference) {
        /* reference.json: NVFP4 per-tensor scales, block scales clamped to [2^-9, 448];
         * INT4 symmetric amax/7, scales kept in F32 (GPTQ stores F16 whatever) */
        o.no_fuse = true;
        o.spec.nvfp4_scale_min = 0x1p-9f;
        o.spec.int4_sym_div = 7.0f;
        if (fmt == MQ_FMT_CT) o.spec.scale_dtype = MOEQ_DT_F32;
    }
    o.act_quant = w4a4;
    o.ignore = ignore.items;
    o.n_ignore = ignore.n;
    o.force = force;

    cli_install_sigint();
    cli_progress_enable(quiet);
    double t0 = mq_now();
    mq_act_amax *amax = NULL;
    moeq_status st = MOEQ_OK;
    if (w4a4) {
        st = calibrate(pos[0], calib, calib_tokens, &amax);
        o.input_amax = amax_lookup;
        o.amax_user = amax;
    }
    mq_quantize_stats stats;
    memset(&stats, 0, sizeof stats);
    if (!st && gptq) st = gptq_cli_run(pos[0], out, &o, calib, &gq, quiet, &stats);
    else if (!st) st = mq_quantize_checkpoint(pos[0], out, &o, &stats);
    mq_act_amax_free(amax);
    free(ignore.items);
    if (st) return cli_fail("quantize", st);
    cli_progress_finish();
    if (!quiet)
        printf("%s: %lld Linears quantized (%s %s, %lld weights), %lld kept; %lld tensors, %.1f MB, "
               "%.1f s\n", out, (long long)stats.n_quantized, scheme, mq_ckpt_format_name(fmt),
               (long long)stats.quantized_params, (long long)stats.n_kept,
               (long long)stats.n_tensors, (double)stats.bytes_written / 1e6, mq_now() - t0);
    return CLI_OK;
}
