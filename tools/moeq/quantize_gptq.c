/* moeq quantize --method gptq: options and driver (see quantize_gptq.h and src/quant). */
#include "quantize_gptq.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <string.h>

#include "quant/gptq_model.h"

void gptq_cli_defaults(gptq_cli *g) {
    memset(g, 0, sizeof *g);
    g->nsamples = 128;
    g->seqlen = 512;
    g->seed = 0;
    g->block_size = 128;
    g->min_expert_tokens = 32;
    g->percdamp = 0.01;
    g->sampling = "chunks";
    g->groups = "dynamic";
    g->mode = "sequential";
    g->fallback = "block";
    g->mse_weight = "plain";
}

/* The writer keeps modules matching an --ignore pattern unquantized: GPTQ skips them too, so the
 * blocks after them are calibrated on what the checkpoint computes. */
typedef struct {
    pcre2_code **re;
    int n;
} ignore_set;

static bool want_module(void *user, const char *module) {
    ignore_set *s = user;
    bool keep = true;
    for (int i = 0; i < s->n && keep; i++) {
        pcre2_match_data *md = pcre2_match_data_create_from_pattern(s->re[i], NULL);
        if (!md) continue;
        keep = pcre2_match(s->re[i], (PCRE2_SPTR)module, PCRE2_ZERO_TERMINATED, 0, 0, md, NULL) < 0;
        pcre2_match_data_free(md);
    }
    return keep;
}

moeq_status gptq_cli_run(const char *model_dir, const char *out_dir, mq_quantize_opts *o,
                         const char *calib, const gptq_cli *g, bool quiet,
                         mq_quantize_stats *stats) {
    mq_gptq_model_opts go;
    mq_gptq_model_opts_init(&go, &o->spec);
    go.spec.mse = !g->no_mse;
    o->spec.mse = go.spec.mse;   /* the writer checks its spec against GPTQ's */
    go.no_fuse = o->no_fuse;
    go.gptq.percdamp = g->percdamp;
    go.gptq.block_size = (int32_t)g->block_size;
    go.gptq.mse_weight = strcmp(g->mse_weight, "hessian") == 0 ? MQ_GPTQ_MSE_HDIAG
                         : strcmp(g->mse_weight, "obq") == 0   ? MQ_GPTQ_MSE_OBQ
                         : strcmp(g->mse_weight, "gptq") == 0  ? MQ_GPTQ_MSE_LOOP
                                                               : MQ_GPTQ_MSE_PLAIN;
    if (g->act_order && g->no_act_order)
        return mq_err(MOEQ_E_ARG, "--act-order and --no-act-order exclude each other");
    /* measured on olmoe-tiny and qwen2moe-tiny (docs/gptq_results.md): act order helps INT4
     * g128 a little and hurts NVFP4's 16-column groups */
    go.gptq.act_order = g->act_order || (!g->no_act_order && o->spec.scheme == MQ_QS_INT4);
    go.gptq.groups = g->static_groups || strcmp(g->groups, "static") == 0 ? MQ_GPTQ_GROUPS_STATIC
                     : strcmp(g->groups, "gidx") == 0                     ? MQ_GPTQ_GROUPS_GIDX
                                                                          : MQ_GPTQ_GROUPS_DYNAMIC;
    go.mode = strcmp(g->mode, "nonsequential") == 0 ? MQ_GPTQ_NONSEQUENTIAL : MQ_GPTQ_SEQUENTIAL;
    if (g->true_sequential && go.mode == MQ_GPTQ_NONSEQUENTIAL)
        return mq_err(MOEQ_E_ARG, "--true-sequential needs --gptq-mode sequential");
    go.true_sequential = g->true_sequential;
    go.min_expert_tokens = g->min_expert_tokens;
    go.fallback = strcmp(g->fallback, "rtn") == 0 ? MQ_FALLBACK_RTN : MQ_FALLBACK_BLOCK;
    if (go.gptq.groups == MQ_GPTQ_GROUPS_GIDX && !go.gptq.act_order)
        return mq_err(MOEQ_E_ARG, "--groups gidx needs --act-order");
    if (go.gptq.groups == MQ_GPTQ_GROUPS_GIDX && o->spec.scheme != MQ_QS_INT4)
        return mq_err(MOEQ_E_ARG, "--groups gidx stores g_idx, which only INT4 checkpoints hold");

    ignore_set ig = {0};
    pcre2_code *re[64];
    for (int i = 0; i < o->n_ignore && i < 64; i++) {
        int err;
        PCRE2_SIZE off;
        re[ig.n] = pcre2_compile((PCRE2_SPTR)o->ignore[i], PCRE2_ZERO_TERMINATED, 0, &err, &off, NULL);
        if (re[ig.n]) ig.n++;   /* a bad pattern is reported by the writer */
    }
    ig.re = re;
    if (ig.n) {
        go.want = want_module;
        go.want_user = &ig;
    }

    mq_calib_opts co;
    mq_calib_opts_init(&co);
    co.path = calib;
    co.nsamples = g->nsamples;
    co.seqlen = g->seqlen;
    co.seed = (uint64_t)g->seed;
    co.bos = g->calib_bos;
    co.mode = strcmp(g->sampling, "random") == 0 ? MQ_CALIB_RANDOM
              : strcmp(g->sampling, "docs") == 0 ? MQ_CALIB_DOCS
                                                 : MQ_CALIB_CHUNKS;
    char *report = g->report ? mq_strdup(g->report) : mq_path_join(out_dir, "gptq_report.json");
    mq_gptq_results res;
    moeq_status st = report ? mq_gptq_quantize_checkpoint(model_dir, out_dir, o, &go, &co, report, &res, stats)
                            : mq_err(MOEQ_E_NOMEM, "out of memory");
    for (int i = 0; i < ig.n; i++) pcre2_code_free(re[i]);
    if (!st && !quiet) {
        int64_t fb = 0, worse = 0;
        double lg = 0, lr = 0;
        for (int64_t i = 0; i < res.n; i++) {
            fb += res.r[i].how != MQ_HOW_GPTQ;
            if (res.r[i].how == MQ_HOW_RTN) continue;
            lg += res.r[i].stats.loss;
            lr += res.r[i].stats.rtn_loss;
            worse += res.r[i].stats.loss > res.r[i].stats.rtn_loss;
        }
        cli_progress_finish();
        printf("gptq: %lld samples, %lld tokens; %lld Linears (%lld experts below %lld tokens: %s); "
               "layer loss %.4g vs RTN %.4g (%lld worse); %.1f s (forward %.1f, Hessians %.1f, "
               "GPTQ %.1f)\nreport: %s\n",
               (long long)res.samples, (long long)res.tokens, (long long)res.n, (long long)fb,
               (long long)go.min_expert_tokens, go.fallback == MQ_FALLBACK_RTN ? "rtn" : "block Hessian",
               lg, lr, (long long)worse, res.seconds_total, res.seconds_forward,
               res.seconds_hessian, res.seconds_gptq, report);
    }
    mq_gptq_results_free(&res);
    free(report);
    return st;
}
