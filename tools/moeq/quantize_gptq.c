/* moeq quantize --method gptq: flags to moeq_quant_options.gptq and the summary (see
 * quantize_gptq.h; the run itself is moeq_quantize). */
#include "quantize_gptq.h"

#include <string.h>

void gptq_cli_defaults(gptq_cli *g) {
    moeq_quant_options d;
    moeq_quant_options_init(&d);
    memset(g, 0, sizeof *g);
    g->nsamples = d.gptq.nsamples;
    g->seqlen = d.gptq.seqlen;
    g->seed = (int64_t)d.gptq.seed;
    g->block_size = d.gptq.block_size;
    g->min_expert_tokens = d.gptq.min_expert_tokens;
    g->percdamp = d.gptq.percdamp;
    g->sampling = "chunks";
    g->groups = "dynamic";
    g->mode = "sequential";
    g->fallback = "block";
    g->mse_weight = "auto";
    g->refine = d.gptq.refine_passes;
    g->expert_weighting = "none";
    g->calib_balance = "none";
}

static int fail(const char *msg) {
    cli_progress_finish();
    fprintf(stderr, "moeq quantize: error: %s\n", msg);
    return CLI_FAIL;
}

int gptq_cli_apply(const gptq_cli *g, moeq_quant_options *o) {
    o->gptq.nsamples = g->nsamples;
    o->gptq.seqlen = g->seqlen;
    o->gptq.sampling = strcmp(g->sampling, "random") == 0 ? MOEQ_CALIB_RANDOM
                       : strcmp(g->sampling, "docs") == 0 ? MOEQ_CALIB_DOCS
                                                          : MOEQ_CALIB_CHUNKS;
    o->gptq.seed = (uint64_t)g->seed;
    o->gptq.calib_bos = g->calib_bos;
    o->gptq.calib_balance = strcmp(g->calib_balance, "experts") == 0 ? MOEQ_CALIB_BALANCE_EXPERTS
                                                                    : MOEQ_CALIB_BALANCE_NONE;
    o->gptq.calib_pool = g->calib_pool;
    o->gptq.percdamp = g->percdamp;
    o->gptq.block_size = (int32_t)g->block_size;
    o->gptq.act_order = g->act_order ? 1 : g->no_act_order ? 0 : -1;
    bool static_groups = g->static_groups || strcmp(g->groups, "static") == 0;
    o->gptq.groups = static_groups                    ? MOEQ_GPTQ_GROUPS_STATIC
                     : strcmp(g->groups, "gidx") == 0 ? MOEQ_GPTQ_GROUPS_GIDX
                                                      : MOEQ_GPTQ_GROUPS_DYNAMIC;
    o->gptq.mse = !g->no_mse;
    o->gptq.mse_weight = strcmp(g->mse_weight, "hessian") == 0 ? MOEQ_GPTQ_MSE_HESSIAN
                         : strcmp(g->mse_weight, "obq") == 0   ? MOEQ_GPTQ_MSE_OBQ
                         : strcmp(g->mse_weight, "gptq") == 0  ? MOEQ_GPTQ_MSE_GPTQ
                         : strcmp(g->mse_weight, "plain") == 0 ? MOEQ_GPTQ_MSE_PLAIN
                                                               : MOEQ_GPTQ_MSE_AUTO;
    o->gptq.mode = strcmp(g->mode, "nonsequential") == 0 ? MOEQ_GPTQ_NONSEQUENTIAL
                                                         : MOEQ_GPTQ_SEQUENTIAL;
    o->gptq.true_sequential = g->true_sequential;
    o->gptq.min_expert_tokens = g->min_expert_tokens;
    o->gptq.expert_fallback = strcmp(g->fallback, "rtn") == 0 ? MOEQ_EXPERT_FALLBACK_RTN
                                                              : MOEQ_EXPERT_FALLBACK_BLOCK;
    o->gptq.report = g->report;
    o->gptq.report_html = g->report_html;
    o->gptq.expert_weighting = strcmp(g->expert_weighting, "gate") == 0 ? MOEQ_EXPERT_WEIGHT_GATE
                               : strcmp(g->expert_weighting, "gate-squared") == 0
                                   ? MOEQ_EXPERT_WEIGHT_GATE_SQUARED
                                   : MOEQ_EXPERT_WEIGHT_NONE;
    o->gptq.clip_search = g->clip_search;
    o->gptq.refine_passes = (int32_t)g->refine;
    o->gptq.refine_scales = g->refine_scales;
    if (g->damp_sweep && moeq_quant_options_set(o, "damp-sweep", g->damp_sweep))
        return cli_usage_error("quantize", "--damp-sweep %s: expected up to 8 damping fractions "
                               ">= 0 separated by commas, e.g. 0.003,0.01,0.03,0.1", g->damp_sweep);
    if (g->target && moeq_quant_options_set(o, "target", g->target))
        return cli_usage_error("quantize", "--target %s: expected quantized, unquantized or unquantized:A "
                               "with A in (0, 1]", g->target);
    if (o->method != MOEQ_QUANT_GPTQ) return -1;
    if (g->calib_pool && !o->gptq.calib_balance)
        return cli_usage_error("quantize", "--calib-pool is the pool --calib-balance experts chooses from");
    if (g->calib_pool && g->calib_pool < g->nsamples)
        return cli_usage_error("quantize", "--calib-pool %lld: fewer candidates than --nsamples %lld",
                               (long long)g->calib_pool, (long long)g->nsamples);
    if (o->gptq.target_unquantized > 0 && o->gptq.mode == MOEQ_GPTQ_NONSEQUENTIAL)
        return fail("--target unquantized needs --gptq-mode sequential");
    if (o->gptq.target_unquantized > 0 && g->true_sequential)
        return fail("--target unquantized runs with sequential calibration, not --true-sequential");
    /* moeq_quantize refuses these too, naming the option fields; here they name the flags */
    if (g->act_order && g->no_act_order)
        return fail("--act-order and --no-act-order exclude each other");
    if (g->true_sequential && o->gptq.mode == MOEQ_GPTQ_NONSEQUENTIAL)
        return fail("--true-sequential needs --gptq-mode sequential");
    bool act_order = g->act_order || (!g->no_act_order && o->scheme == MOEQ_QUANT_INT4);
    if (o->gptq.groups == MOEQ_GPTQ_GROUPS_GIDX && !act_order)
        return fail("--groups gidx needs --act-order");
    if (o->gptq.groups == MOEQ_GPTQ_GROUPS_GIDX && o->scheme != MOEQ_QUANT_INT4)
        return fail("--groups gidx stores g_idx, which only INT4 checkpoints hold");
    return -1;
}

void gptq_cli_print(const moeq_quant_result *r, const moeq_quant_options *o, const char *out_dir) {
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
