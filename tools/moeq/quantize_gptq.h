/*
 * The GPTQ part of `moeq quantize --method gptq`: its options (spliced into the option table of
 * cmd_quantize.c with GPTQ_CLI_OPTS), their translation into moeq_quant_options.gptq, and the
 * summary printed after the run (moeq_quantize does the work).
 */
#ifndef MOEQ_QUANTIZE_GPTQ_H
#define MOEQ_QUANTIZE_GPTQ_H

#include "cli.h"

typedef struct {
    int64_t nsamples, seqlen, seed, block_size, min_expert_tokens, threads, refine;
    double percdamp;
    const char *sampling, *groups, *mode, *fallback, *report, *mse_weight, *report_html;
    const char *expert_weighting, *damp_sweep, *target, *calib_balance;
    int64_t calib_pool;
    bool calib_bos, act_order, no_act_order, static_groups, no_mse, true_sequential, clip_search;
    bool refine_scales;
} gptq_cli;

/* The defaults of moeq_quant_options_init, as flags. */
void gptq_cli_defaults(gptq_cli *g);

#define GPTQ_CLI_OPTS(g)                                                                           \
    {"--nsamples", OPT_INT, &(g).nsamples, "N", "GPTQ: calibration samples (default 128)", NULL, 1, 1 << 24, NULL}, \
    {"--seqlen", OPT_INT, &(g).seqlen, "L", "GPTQ: tokens per sample (default 512)", NULL, 2, 1 << 20, NULL}, \
    {"--calib-sampling", OPT_CHOICE, &(g).sampling, NULL, "GPTQ: consecutive chunks of the text "  \
     "(default), random windows (--seed) or one document (JSONL record / line) per sample",      \
     "chunks|random|docs", 0, 0, NULL},                                                            \
    {"--seed", OPT_INT, &(g).seed, "S", "GPTQ: seed of --calib-sampling random (default 0)", NULL, 0, -1, NULL}, \
    {"--calib-balance", OPT_CHOICE, &(g).calib_balance, NULL, "GPTQ: the first --nsamples samples "  \
     "(none, default), or --nsamples of --calib-pool candidates chosen so that the routed experts "  \
     "get tokens evenly (experts: one unquantized forward of the candidates first)",                \
     "none|experts", 0, 0, NULL},                                                                    \
    {"--calib-pool", OPT_INT, &(g).calib_pool, "N", "GPTQ, --calib-balance experts: candidate "      \
     "samples to choose from (default 4 x --nsamples; fewer when the text has fewer)", NULL, 1, 1 << 24, NULL}, \
    {"--calib-bos", OPT_FLAG, &(g).calib_bos, NULL, "GPTQ: start every sample with BOS", NULL, 0, 0, NULL}, \
    {"--percdamp", OPT_DOUBLE, &(g).percdamp, "F", "GPTQ: damping, fraction of mean(diag H) "      \
     "(default 0.01; raised automatically while Cholesky fails)", NULL, 0, 0, NULL},              \
    {"--block-size", OPT_INT, &(g).block_size, "B", "GPTQ: lazy-update block (default 128)", NULL, 1, 1 << 20, NULL}, \
    {"--act-order", OPT_FLAG, &(g).act_order, NULL, "GPTQ: columns in decreasing diag(H) order "  \
     "(default for int4)", NULL, 0, 0, NULL},                                                     \
    {"--no-act-order", OPT_FLAG, &(g).no_act_order, NULL, "GPTQ: columns in their natural order "  \
     "(default for nvfp4)", NULL, 0, 0, NULL},                                                    \
    {"--groups", OPT_CHOICE, &(g).groups, NULL, "GPTQ: group scales from the updated weights "    \
     "when the group is reached (dynamic, default), from the original weights (static), or "     \
     "act-order groups with g_idx (int4)", "dynamic|static|gidx", 0, 0, NULL},                   \
    {"--static-groups", OPT_FLAG, &(g).static_groups, NULL, "GPTQ: same as --groups static", NULL, 0, 0, NULL}, \
    {"--no-mse", OPT_FLAG, &(g).no_mse, NULL, "GPTQ: no MSE scale search (on by default with "     \
     "--method gptq)", NULL, 0, 0, NULL},                                                         \
    {"--mse-weight", OPT_CHOICE, &(g).mse_weight, NULL, "GPTQ: how the MSE scale search scores "   \
     "a group: by running GPTQ over the group's columns (gptq; the default, except plain for "     \
     "INT4 --group-size -1), plain squared error (plain), weighted by diag(H) (hessian) or by "     \
     "GPTQ's remaining loss 1/[H_F^-1]_jj (obq)", "gptq|plain|hessian|obq", 0, 0, NULL},           \
    {"--gptq-mode", OPT_CHOICE, &(g).mode, NULL, "GPTQ: each block calibrated on the outputs of "  \
     "the quantized blocks before it (default), or every Hessian from the unquantized model",     \
     "sequential|nonsequential", 0, 0, NULL},                                                      \
    {"--true-sequential", OPT_FLAG, &(g).true_sequential, NULL, "GPTQ: within a block, quantize "  \
     "attention first and calibrate the MLP/experts on its quantized output", NULL, 0, 0, NULL},   \
    {"--min-expert-tokens", OPT_INT, &(g).min_expert_tokens, "N", "GPTQ: experts with fewer "     \
     "calibration tokens use --expert-fallback (default 32)", NULL, 0, -1, NULL},                  \
    {"--expert-fallback", OPT_CHOICE, &(g).fallback, NULL, "GPTQ: Hessians of all tokens of the "  \
     "MoE block (default) or round to nearest", "block|rtn", 0, 0, NULL},                          \
    {"--expert-weighting", OPT_CHOICE, &(g).expert_weighting, NULL, "GPTQ: each routed token's "   \
     "update to its expert's Hessians times 1 (none, default), its gate score (gate: MoEQuant's "  \
     "AGQ) or its square (gate-squared: the weight of the token's squared output error)",          \
     "none|gate|gate-squared", 0, 0, NULL},                                                        \
    {"--refine", OPT_INT, &(g).refine, "N", "GPTQ: N passes of coordinate descent over the codes " \
     "after GPTQ, on its own layer objective with the group scales kept (default 2; 0 with "       \
     "--device cuda)", NULL, 0, 64, NULL}, \
    {"--refine-scales", OPT_FLAG, &(g).refine_scales, NULL, "GPTQ, with --refine: after each pass " \
     "over the codes, each group's scale moved to the stored value nearest to its least-squares "  \
     "optimum for them (when that lowers the objective)", NULL, 0, 0, NULL},                       \
    {"--clip-search", OPT_FLAG, &(g).clip_search, NULL, "GPTQ, INT4 --asym: the MSE scale search " \
     "clips the low and the high end of each group's range apart (about 3x the search's cost)",    \
     NULL, 0, 0, NULL},                                                                            \
    {"--damp-sweep", OPT_STRING, &(g).damp_sweep, "F,F,...", "GPTQ: damping candidates (up to 8, " \
     "e.g. 0.003,0.01,0.03,0.1); each Linear input takes the one whose GPTQ on the first 7/8 of "   \
     "the samples has the least loss on the last 1/8, then GPTQ runs on all samples with it",      \
     NULL, 0, 0, NULL},                                                                            \
    {"--target", OPT_STRING, &(g).target, "quantized|unquantized[:A]", "GPTQ: what each Linear's "    \
     "GPTQ aims at: A of the way to the unquantized model's outputs (unquantized: A 0.5, the "      \
     "default on the CPU in sequential mode; asymmetric calibration, one more forward of each "     \
     "layer), or its own outputs on the quantized model's inputs (quantized: textbook GPTQ, what "  \
     "--device cuda, nonsequential, --true-sequential, --expert-weighting and --damp-sweep run)",   \
     NULL, 0, 0, NULL},                                                                             \
    {"--report", OPT_STRING, &(g).report, "FILE", "GPTQ: JSON report (default "                    \
     "OUT_DIR/gptq_report.json; with --format gguf OUT.gptq_report.json beside the file)", NULL, 0, 0, NULL},                                               \
    {"--report-html", OPT_STRING, &(g).report_html, "FILE", "GPTQ: the report also as one "           \
     "self-contained HTML page of plots (no scripts, nothing from the network)", NULL, 0, 0, NULL},   \
    {"--threads", OPT_INT, &(g).threads, "N", "worker threads (default: every CPU it may use)", NULL, 1, 1024, NULL}

/* Fills o->gptq from the flags. Returns -1, or CLI_FAIL after printing the error of a flag
 * combination that GPTQ cannot run (checked only with --method gptq). */
int gptq_cli_apply(const gptq_cli *g, moeq_quant_options *o);

/* The GPTQ lines of the summary: calibration, fallbacks, losses, timings and the report path. */
void gptq_cli_print(const moeq_quant_result *r, const moeq_quant_options *o, const char *out_dir);

#endif
