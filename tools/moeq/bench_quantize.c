/*
 * moeq bench quantize MODEL_DIR: the streaming pipeline's GPTQ (the defaults of `moeq quantize
 * --method gptq`, NVFP4 unless --scheme int4) on the first --layers layers of a model, e.g. a
 * full-size checkpoint from `moeq bench gen-model`: per layer the seconds of the calibration
 * forward (and of its attention part), the Hessians, GPTQ and the writes; the forward's FLOP rate
 * as a fraction of this machine's sgemm measured in the same run; peak anonymous memory (planned
 * and measured: mmapped source pages are not anonymous); and the whole model's time extrapolated
 * from the layers run (their mean per layer times the model's layers), against the published
 * figures of llm-compressor (Qwen3-30B-A3B GPTQ: 3.9 h on one GPU). Nothing is kept.
 *
 * --threads 2,4,8,16 runs it at each thread count in turn and prints, per stage, the seconds per
 * layer, the cores it kept busy (process CPU seconds over wall seconds) and the efficiency against
 * the first count (T1 * n1 / (Tn * n)), and whether every count wrote the same tensor bytes.
 *
 * Under mpirun -np N (src/dist) the run is split over the ranks; --ranks 1,2,4 runs it with the
 * job's first 1, 2 and 4 ranks in turn and prints, for each, the time per layer, every rank's
 * peak memory and the scaling efficiency against the first (T1 * n1 / (Tn * n)).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


#include "commands.h"
#include "cli.h"
#include "backend/gpu.h"
#include "dist/dist.h"
#include "kernels/moe_ffn.h"
#include "model/model.h"
#include "pipeline/pipeline.h"

/* The stages of a layer: wall and CPU seconds summed over the layers run. */
enum { ST_READ, ST_FORWARD, ST_ATTENTION, ST_HESSIAN, ST_GPTQ, ST_WRITE, ST_TOTAL, N_STAGES };
static const char *const stage_name[N_STAGES] = {"read", "forward", "attention", "hessians", "gptq", "write",
                                                 "total"};

static void stage_sums(const mq_pipeline_result *r, double wall[N_STAGES], double cpu[N_STAGES]) {
    memset(wall, 0, sizeof(double) * N_STAGES);
    memset(cpu, 0, sizeof(double) * N_STAGES);
    for (int l = 0; l < r->layers_run; l++) {
        const mq_layer_stats *s = &r->layer[l];
        const double w[N_STAGES] = {s->read, s->forward, s->attention, s->hessian, s->gptq, s->write, s->total};
        const double c[N_STAGES] = {s->cpu_read, s->cpu_forward, s->cpu_attention, s->cpu_hessian, s->cpu_gptq,
                                    s->cpu_write, s->cpu_total};
        for (int k = 0; k < N_STAGES; k++) {
            wall[k] += w[k];
            cpu[k] += c[k];
        }
    }
}

/* One count's figures over the rounds: per stage the median seconds per layer and cores busy. */
typedef struct {
    double sec[N_STAGES], cores[N_STAGES], core_rate, bw_rate;
    double hot;   /* the core rate right after the count's run over the one just before it */
} count_figures;

/* A layer's seconds on one thread: outside the pool's parallel loops, less waiting for other ranks
 * and moving data (Amdahl's serial part: what more threads cannot shorten). */
static double layer_serial(const mq_layer_stats *s) {
    const double v = s->total - s->pooled - s->wait - s->exchange;
    return v > 0 ? v : 0;
}

/* --simulate-threads: the layer's seconds are P threads' (the simulated clock: mq_now), had its
 * loops the simulated schedule and the rest (outside them) stayed serial; on this one thread it
 * took their tasks' sum instead of their schedule. */
static double sim_one_thread(const mq_layer_stats *s) { return s->total + s->sim_tasks - s->sim_span; }

static double sim_efficiency(const mq_layer_stats *s, int P) {
    return s->total > 0 ? sim_one_thread(s) / ((double)P * s->total) : 0;
}

/* A stage's efficiency at P simulated threads: its CPU seconds (one thread's) over P times its
 * seconds on the simulated clock. */
static double sim_stage(double cpu, double seconds, int P) { return seconds > 0 ? cpu / ((double)P * seconds) : 0; }

/* A run's seconds per layer (all stages). */
static double per_layer_total(const mq_pipeline_result *r) {
    double w = 0;
    for (int l = 0; l < r->layers_run; l++) w += r->layer[l].total;
    return r->layers_run > 0 ? w / r->layers_run : 0;
}

/* rs[round * nt + i]: count i's run in each round; core[], hot[] and bw[] the same way. */
static count_figures count_medians(const mq_pipeline_result *rs, const double *core, const double *hot,
                                   const double *bw, int nt, int rounds, int i) {
    double sec[N_STAGES][64], cores[N_STAGES][64], rate[64], bwr[64], hr[64];
    if (rounds > 64) rounds = 64;
    for (int r = 0; r < rounds; r++) {
        const mq_pipeline_result *x = &rs[r * nt + i];
        double w[N_STAGES], c[N_STAGES];
        stage_sums(x, w, c);
        const int run = x->layers_run > 0 ? x->layers_run : 1;
        for (int k = 0; k < N_STAGES; k++) {
            sec[k][r] = w[k] / run;
            cores[k][r] = w[k] > 0 ? c[k] / w[k] : 0;
        }
        rate[r] = core[r * nt] > 0 ? core[r * nt + i] / core[r * nt] : 0;   /* against the round's first count */
        bwr[r] = bw[r * nt] > 0 ? bw[r * nt + i] / bw[r * nt] : 0;
        hr[r] = core[r * nt + i] > 0 ? hot[r * nt + i] / core[r * nt + i] : 0;
    }
    count_figures f;
    for (int k = 0; k < N_STAGES; k++) {
        f.sec[k] = cli_median(sec[k], rounds);
        f.cores[k] = cli_median(cores[k], rounds);
    }
    f.core_rate = cli_median(rate, rounds);
    f.bw_rate = cli_median(bwr, rounds);
    f.hot = cli_median(hr, rounds);
    return f;
}

/* Within round r, the end-to-end efficiency of count i (threads or ranks: n[i]) against the
 * first count. */
static double round_efficiency(const mq_pipeline_result *rs, const int *n, int n_counts, int r, int i) {
    const double t0 = per_layer_total(&rs[r * n_counts]), t = per_layer_total(&rs[r * n_counts + i]);
    return t > 0 ? t0 * n[0] / (t * n[i]) : 0;
}

/* --threads LIST: per stage, seconds per layer, cores busy and efficiency against the first
 * (medians over the rounds), then each round's end-to-end efficiencies (the spread). */
static void print_thread_scaling(const mq_pipeline_result *rs, const int *tl, int nt, int rounds,
                                 const double *core, const double *hot, const double *bw, bool same,
                                 int64_t tensors, int block, bool json) {
    count_figures f[32];
    for (int i = 0; i < nt; i++) f[i] = count_medians(rs, core, hot, bw, nt, rounds, i);
    /* a stage under a thousandth of the layer at both counts (the read, with MOEQ_READ_AHEAD=1) has
     * no efficiency: its ratio of two near-zero times would be noise (NAN: "-", null) */
    double eff[32][N_STAGES];
    for (int i = 0; i < nt; i++)
        for (int k = 0; k < N_STAGES; k++) {
            const bool hidden = f[i].sec[k] < 1e-3 * f[i].sec[ST_TOTAL] && f[0].sec[k] < 1e-3 * f[0].sec[ST_TOTAL];
            eff[i][k] = hidden ? NAN : f[i].sec[k] > 0 ? f[0].sec[k] * tl[0] / (f[i].sec[k] * tl[i]) : 0;
        }
    if (json) {
        printf("{\"same_tensors\": %s, \"tensors_compared\": %lld, \"rounds\": %d, \"block_size\": %d, "
               "\"thread_scaling\": [", same ? "true" : "false", (long long)tensors, rounds, block);
        for (int i = 0; i < nt; i++) {
            printf("%s{\"threads\": %d, \"core_rate\": %.3f, \"bandwidth_rate\": %.3f, \"core_rate_after_run\": %.3f",
                   i ? ", " : "", tl[i], f[i].core_rate, f[i].bw_rate, f[i].hot);
            for (int k = 0; k < N_STAGES; k++) {
                char e[32] = "null", c[32] = "null";
                if (!isnan(eff[i][k])) {
                    snprintf(e, sizeof e, "%.3f", eff[i][k]);
                    snprintf(c, sizeof c, "%.3f", f[i].core_rate > 0 ? eff[i][k] / f[i].core_rate : 0);
                }
                printf(", \"%s\": {\"seconds_per_layer\": %.3f, \"cores_busy\": %.2f, \"efficiency\": %s, "
                       "\"of_ceiling\": %s}",
                       stage_name[k], f[i].sec[k], f[i].cores[k], e, c);
            }
            printf(", \"total_seconds_by_round\": [");
            for (int r = 0; r < rounds; r++) printf("%s%.3f", r ? ", " : "", per_layer_total(&rs[r * nt + i]));
            printf("], \"total_efficiency_by_round\": [");
            for (int r = 0; r < rounds; r++) printf("%s%.3f", r ? ", " : "", round_efficiency(rs, tl, nt, r, i));
            printf("]}");
        }
        printf("]}\n");
        return;
    }
    printf("threads  core rate  bw rate  after run");
    for (int k = 0; k < N_STAGES; k++) printf("  %-22s", stage_name[k]);
    printf("\n                                      ");
    for (int k = 0; k < N_STAGES; k++) printf("  %-22s", "s/layer cores  eff.");
    printf("\n");
    for (int i = 0; i < nt; i++) {
        printf("%7d  %9.2f  %7.2f  %9.2f", tl[i], f[i].core_rate, f[i].bw_rate, f[i].hot);
        for (int k = 0; k < N_STAGES; k++) {
            if (isnan(eff[i][k])) printf("  %7.2f %5.1f %6s  ", f[i].sec[k], f[i].cores[k], "-");
            else printf("  %7.2f %5.1f %6.2f  ", f[i].sec[k], f[i].cores[k], eff[i][k]);
        }
        printf("\n");
    }
    printf("(%s; cores: process CPU seconds over wall seconds; eff.: T(%d) * %d / (T(n) * n); core rate: each "
           "thread's single-threaded sgemm rate with all running, against %d threads, the ceiling of "
           "compute-bound efficiency here; bw rate: the read bandwidth of all the threads per thread, against %d "
           "threads', the ceiling of memory-bound efficiency; after run: each thread's sgemm rate measured again right after "
           "the count's run, over the one just before it (below 1: the cores ran slower once hot, which the core rate, "
           "measured cold, does not see); -: under a thousandth of the layer at both counts)\n",
           rounds > 1 ? "medians of the rounds" : "one round", tl[0], tl[0], tl[0], tl[0]);
    for (int i = 1; i < nt; i++) {   /* how much of what the machine allows each stage reached */
        if (!(f[i].core_rate > 0)) continue;
        printf("%d threads, efficiency over the core rate (1.00: as fast as the cores allow):", tl[i]);
        for (int k = 0; k < N_STAGES; k++) {
            if (isnan(eff[i][k])) printf(" %s -%s", stage_name[k], k + 1 < N_STAGES ? "," : "");
            else printf(" %s %.2f%s", stage_name[k], eff[i][k] / f[i].core_rate, k + 1 < N_STAGES ? "," : "");
        }
        printf("\n");
    }
    if (rounds > 1) {   /* each round's own ratio: how far the machine's drift moves it */
        for (int i = 1; i < nt; i++) {
            printf("end-to-end efficiency of %d threads in each round:", tl[i]);
            for (int r = 0; r < rounds; r++) printf(" %.2f", round_efficiency(rs, tl, nt, r, i));
            printf("\n");
        }
    }
    printf("the %lld tensors written %s at every thread count\n", (long long)tensors, same ? "identical" : "DIFFER (a bug)");
}

int bench_quantize(int argc, char **argv) {
    int64_t layers = 2, nsamples = 128, seqlen = 512, full_layers = 0, rounds = 1, sim_threads = 0, block = 128;
    const char *calib = NULL, *scheme = "nvfp4", *max_memory = NULL, *device = "cpu", *ranks_arg = NULL,
               *threads = NULL, *sampling = "chunks", *mode = "sequential",
               *precision = "fp32", *target = NULL;
    bool json = false, tf32 = false;
    cli_opt opts[] = {
        {"--layers", OPT_INT, &layers, "N", "layers to run (default 2; the rest is extrapolated)",
         NULL, 1, 1 << 20, NULL},
        {"--full-layers", OPT_INT, &full_layers, "N", "layers of the whole model for the "
         "extrapolation (default: the checkpoint's; e.g. 48 for a 2-layer Qwen3-30B-A3B from "
         "bench gen-model)", NULL, 1, 1 << 20, NULL},
        {"--calib", OPT_STRING, &calib, "FILE", "calibration text (default the shared fixtures' "
         "calib.txt, else data/demo-calib.txt)", NULL, 0, -1, NULL},
        {"--nsamples", OPT_INT, &nsamples, "N", "calibration samples (default 128)", NULL, 1, 1 << 20, NULL},
        {"--seqlen", OPT_INT, &seqlen, "L", "tokens per sample (default 512)", NULL, 2, 1 << 20, NULL},
        {"--calib-sampling", OPT_CHOICE, &sampling, NULL, "as moeq quantize's (default chunks; docs: a "
         "document per sample, the seed run's shape)", "chunks|random|docs", 0, -1, NULL},
        {"--gptq-mode", OPT_CHOICE, &mode, NULL, "as moeq quantize's (default sequential)",
         "sequential|nonsequential", 0, -1, NULL},
        {"--scheme", OPT_CHOICE, &scheme, NULL, "weight format (default nvfp4)", "nvfp4|int4", 0, -1, NULL},
        {"--target", OPT_STRING, &target, "quantized|unquantized[:A]", "as moeq quantize's (default "
         "unquantized on the CPU)", NULL, 0, -1, NULL},
        {"--block-size", OPT_INT, &block, "B", "GPTQ's lazy-update block, as moeq quantize's (default 128)",
         NULL, 1, 1 << 16, NULL},
        {"--max-memory", OPT_STRING, &max_memory, "SIZE", "memory budget (default as moeq "
         "quantize)", NULL, 0, -1, NULL},
        {"--threads", OPT_STRING, &threads, "T[,T...]", "worker threads (default: every CPU it may use); a list "
         "such as 2,4,8,16 runs each in turn and prints the scaling table", NULL, 0, -1, NULL},
        {"--device", OPT_STRING, &device, "DEV", "GPTQ on cpu (default), cuda or cuda:N", NULL, 0, -1, NULL},
        {"--gpu-precision", OPT_CHOICE, &precision, NULL, "with a GPU: as moeq quantize's (the GPU's "
         "sgemm measured in TF32 for tf32)", "fp32|tf32x3|tf32", 0, -1, NULL},
        {"--gpu-tf32", OPT_FLAG, &tf32, NULL, "the same as --gpu-precision tf32", NULL, 0, -1, NULL},
        {"--ranks", OPT_STRING, &ranks_arg, "N,N,...", "under mpirun: run with the job's first N ranks "
         "for each N in turn and print the scaling table (default: all ranks)", NULL, 0, -1, NULL},
        {"--rounds", OPT_INT, &rounds, "N", "with a --threads or --ranks list: run the whole list N "
         "times in turn (2,16,2,16,...) and report the medians (this machine's speed can drift by "
         "more than the effect within minutes; default 1)", NULL, 1, 64, NULL},
        {"--simulate-threads", OPT_INT, &sim_threads, "P", "run on one thread as P threads would (their chunk "
         "plans, scratch and task lists) and print the seconds P threads would take, each parallel loop's "
         "tasks timed here and handed out as the pool does: what the work's split allows, without what "
         "sharing the cores' clock and memory costs; every printed second is then P threads' (a simulated "
         "clock), and each stage's efficiency is its one-thread CPU seconds over P times them", NULL, 2, 4096, NULL},
        {"--json", OPT_FLAG, &json, NULL, "print one JSON object on stdout", NULL, 0, -1, NULL},
    };
    cli_command cmd = {"bench quantize", "MODEL_DIR [--layers N] [--json]",
                       "GPTQ through the streaming pipeline on the first --layers layers: seconds "
                       "per stage and layer, the forward's fraction of sgemm, peak anonymous "
                       "memory, and the whole model's extrapolated time.",
                       opts, (int)(sizeof opts / sizeof opts[0]), 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos = 0;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    int tl[32], nt = 1;
    tl[0] = 0;
    if (threads && (nt = cli_parse_counts(threads, tl, 32, 1, 4096)) < 1)
        return cli_usage_error("bench quantize", "--threads %s: expected counts such as 2,4,8,16", threads);
    if (sim_threads > 0 && (nt > 1 || tl[0] > 0))
        return cli_usage_error("bench quantize", "--simulate-threads runs on one thread: give no --threads");
    if (sim_threads > 0 && mq_dist_size() > 1)
        return cli_usage_error("bench quantize", "--simulate-threads is for one process, not under mpirun");
    if (tl[0] > 0) moeq_set_threads(tl[0]);
    if (sim_threads > 0) moeq_set_threads(1);
    char calib_buf[4200];
    if (!calib) {
        const char *sh = cli_shared_dir();
        if (sh) snprintf(calib_buf, sizeof calib_buf, "%s/fixtures/text/calib.txt", sh);
        else snprintf(calib_buf, sizeof calib_buf, "%s/data/demo-calib.txt", MOEQ_SOURCE_DIR);
        calib = calib_buf;
    }
    uint64_t mem = 0;
    if (max_memory && !cli_parse_size(max_memory, &mem))
        return cli_usage_error("bench quantize", "--max-memory: cannot read '%s'", max_memory);
    mq_config cfg;
    if (!(pos[0] = cli_checkpoint_dir("bench quantize", pos[0], NULL))) return CLI_FAIL;
    moeq_status st = mq_config_load(pos[0], &cfg);
    if (st) return cli_fail("bench quantize", st);
    const int n_layers = full_layers > 0 ? (int)full_layers : cfg.n_layers;
    char model_type[32];
    snprintf(model_type, sizeof model_type, "%s", cfg.model_type);
    mq_config_free(&cfg);

    /* exactly what moeq quantize --method gptq runs with (its defaults resolved) */
    int dev = -1;
    if (mq_gpu_parse_device(device, &dev)) return cli_usage_error("bench quantize", "%s", moeq_last_error());
    if (tf32) precision = "tf32";
    if (strcmp(precision, "fp32") && dev < 0)
        return cli_usage_error("bench quantize", "--gpu-%s needs --device cuda", tf32 ? "tf32" : "precision");
    moeq_quant_options qo;
    moeq_quant_options_init(&qo);
    qo.scheme = strcmp(scheme, "int4") == 0 ? MOEQ_QUANT_INT4 : MOEQ_QUANT_NVFP4A16;
    qo.method = MOEQ_QUANT_GPTQ;
    qo.calib = calib;
    qo.gptq.nsamples = nsamples;
    qo.gptq.seqlen = seqlen;
    qo.gptq.sampling = !strcmp(sampling, "docs") ? MOEQ_CALIB_DOCS : !strcmp(sampling, "random") ? MOEQ_CALIB_RANDOM
                                                                                               : MOEQ_CALIB_CHUNKS;
    qo.gptq.mode = !strcmp(mode, "nonsequential") ? MOEQ_GPTQ_NONSEQUENTIAL : MOEQ_GPTQ_SEQUENTIAL;
    qo.gptq.block_size = (int32_t)block;
    qo.max_memory = (int64_t)mem;
    qo.device = dev >= 0 ? device : NULL;
    moeq_quant_options_set(&qo, "gpu-precision", precision);   /* a checked choice */
    if (target && moeq_quant_options_set(&qo, "target", target))
        return cli_usage_error("bench quantize", "--target %s: expected quantized, unquantized or unquantized:A "
                               "with A in (0, 1]", target);
    mq_pipeline_opts o;
    mq_pipeline_opts_from(&qo, &o);
    o.stop_after = (int32_t)layers;
    /* the rank counts to run with */
    const int world = mq_dist_size();
    int ranks[16], n_ranks = 0;
    if (ranks_arg) {
        if ((n_ranks = cli_parse_counts(ranks_arg, ranks, 16, 1, world)) < 1)
            return cli_usage_error("bench quantize", "--ranks %s: expected counts from 1 to %d "
                                   "(mpirun -np) separated by commas", ranks_arg, world);
    } else {
        ranks[n_ranks++] = world;
    }
    if (n_ranks > 1 && nt > 1)
        return cli_usage_error("bench quantize", "give a list to --ranks or to --threads, not to both");
    const int n_counts = n_ranks > nt ? n_ranks : nt;   /* runs a round */
    if (rounds > 1 && n_counts < 2)
        return cli_usage_error("bench quantize", "--rounds needs a list to --threads or --ranks");
    const int n_runs = n_counts * (int)rounds;        /* rs[round * n_counts + i] */
    mq_pipeline_result *rs = calloc((size_t)n_runs, sizeof *rs);
    if (!rs) return cli_fail("bench quantize", MOEQ_E_NOMEM);
    /* the checkpoints go to a temporary directory, made once the flags are checked (removed below) */
    const char *td = getenv("TMPDIR");
    char tmpl[1024], out[1100];
    snprintf(tmpl, sizeof tmpl, "%s/moeq-bench-XXXXXX", td && *td ? td : "/tmp");
    if (!mkdtemp(tmpl)) {
        free(rs);
        return cli_fail("bench quantize", mq_err(MOEQ_E_IO, "cannot make a temporary directory in %s", tmpl));
    }
    snprintf(out, sizeof out, "%s/q", tmpl);
    cli_progress_enable(json || world > 1);
    bool same = true;
    uint32_t crc0 = 0;
    int64_t n0 = 0;   /* the tensors the first run wrote */
    double core[64 * 32] = {0}, bw[64 * 32] = {0}, hot[64 * 32] = {0};
    /* the bandwidth probe reads well beyond the last-level cache */
    const size_t probe = (size_t)256 << 20 > 4 * cli_llc_bytes() ? (size_t)256 << 20 : 4 * cli_llc_bytes();
    /* A fresh process's first measure can read low (docs/results/thread_scaling.md: on the Xeon
     * the rate right after the first count's run was 1.55x the one before it, 0.97-1.09 in every
     * other count and run), and every core rate is against it: one measure discarded first. */
    if (nt > 1) {
        moeq_set_threads(tl[0]);
        (void)mq_measure_core_gflops(0.5);
    }
    for (int run = 0; run < n_runs && !st; run++) {
        const int i = run % n_counts;
        if (nt > 1) {
            moeq_set_threads(tl[i]);
            core[run] = mq_measure_core_gflops(0.5) / tl[i];
            bw[run] = mq_measure_read_gbps(probe, 0.3) / tl[i];
            if (rounds > 1) fprintf(stderr, "bench quantize: %d threads (round %d of %d)\n", tl[i], run / n_counts + 1, (int)rounds);
            else fprintf(stderr, "bench quantize: %d threads\n", tl[i]);
        }
        if ((st = mq_dist_subset(ranks[n_ranks > 1 ? i : 0]))) break;
        /* the rank table: the core rate with this count's ranks all computing at once (each rank's
         * threads; rank 0's figure is printed), the ceiling of the ranks' efficiency as it is of
         * the threads' */
        if ((world > 1 || n_ranks > 1) && mq_dist_size() > 0 && !(st = mq_dist_agree(MOEQ_OK, "core rate")))
            core[run] = mq_measure_core_gflops(0.5) / moeq_threads();
        if (sim_threads > 0) mq_pool_simulate((int)sim_threads);
        if (!st && mq_dist_size() > 0) st = mq_pipeline_run(pos[0], out, &o, &rs[run]);
        if (sim_threads > 0) mq_pool_simulate(0);
        moeq_status bs = mq_dist_subset(0);
        if (!bs) bs = mq_dist_world_barrier("bench quantize");
        if (!st) st = bs;
        /* the same rate again while the cores are hot from the run (a power or thermal limit the
         * half-second measure before it does not reach) */
        if (nt > 1 && !st) hot[run] = mq_measure_core_gflops(0.5) / tl[i];
        if (nt > 1 && !st) {   /* the tensors it wrote, against the first count's */
            if (run == 0) crc0 = rs[run].tensors_crc, n0 = rs[run].tensors_written;
            same &= rs[run].tensors_crc == crc0 && rs[run].tensors_written == n0;
        }
    }
    cli_progress_finish();
    mq_remove_tree(tmpl);
    if (st) {
        free(rs);
        return cli_fail("bench quantize", st);
    }
    if (world > 1 || n_ranks > 1) {   /* the scaling table (medians of the rounds), then the details of the largest run */
        const mq_pipeline_result *last = &rs[(rounds - 1) * n_counts];   /* the last round's, for the memory */
        double t0 = 0;
        printf("ranks  s/layer  efficiency  core rate  of ceiling  peak memory per rank (GB)%s\n",
               rounds > 1 ? "  (medians of the rounds)" : "");
        for (int i = 0; i < n_ranks; i++) {
            double ts[64], rate[64];
            for (int r = 0; r < rounds; r++) {
                ts[r] = per_layer_total(&rs[r * n_counts + i]);
                rate[r] = core[r * n_counts] > 0 ? core[r * n_counts + i] / core[r * n_counts] : 0;
            }
            const double t = cli_median(ts, (int)rounds), cr = cli_median(rate, (int)rounds);
            if (i == 0) t0 = t * ranks[0];
            const double eff = t > 0 ? t0 / (t * ranks[i]) : 0;
            printf("%5d  %7.2f  %10.3f  %9.2f  %10.2f ", ranks[i], t, eff, cr, cr > 0 ? eff / cr : 0);
            for (int r = 0; r < ranks[i] && r < 64; r++) printf(" %.2f", (double)last[i].rank_peak[r] / 1e9);
            printf("\n");
        }
        if (n_ranks > 1)
            printf("(core rate: rank 0's threads' single-threaded sgemm rate with every rank of the count "
                   "computing, against %d rank%s: the ceiling of compute-bound efficiency here; of ceiling: "
                   "efficiency over it)\n", ranks[0], ranks[0] > 1 ? "s" : "");
        for (int i = 1; i < n_ranks && rounds > 1; i++) {   /* each round's own ratio */
            printf("efficiency of %d ranks in each round:", ranks[i]);
            for (int r = 0; r < rounds; r++) printf(" %.3f", round_efficiency(rs, ranks, n_counts, r, i));
            printf("\n");
        }
    }
    if (nt > 1) {
        print_thread_scaling(rs, tl, nt, (int)rounds, core, hot, bw, same, n0, (int)o.g.block_size, json);
        if (json) {
            free(rs);
            return same ? CLI_OK : CLI_FAIL;
        }
    }
    mq_pipeline_result *r = &rs[n_runs - 1];
    double sgemm = mq_measure_sgemm_gflops(1024, 1.0);
    /* with a GPU, its own fp32 GEMM rate and copy bandwidth (medians of 5) in the same run: the
     * figures its forward is read against (0: not measured, said below) */
    double gpu_sgemm = 0, gpu_bw = 0;
    if (dev >= 0) {
        mq_gpu *g = NULL;
        if (mq_gpu_open(dev, &g) || (qo.gpu_precision && mq_gpu_set_precision(g, qo.gpu_precision)) || mq_gpu_measure(g, &gpu_sgemm, &gpu_bw))
            gpu_sgemm = gpu_bw = 0;
        mq_gpu_close(g);
    }
    const int run = r->layers_run;
    double sum = 0, fwd = 0, att = 0, hes = 0, gq = 0, wr = 0, rd = 0;
    mq_layer_stats sim = {0};   /* --simulate-threads: the layers' means */
    for (int l = 0; l < run; l++) {
        const mq_layer_stats *ls = &r->layer[l];
        sum += r->layer[l].total;
        sim.total += ls->total / run;
        sim.sim_tasks += ls->sim_tasks / run;
        sim.sim_span += ls->sim_span / run;
        sim.read += ls->read / run, sim.cpu_read += ls->cpu_read / run;
        sim.forward += ls->forward / run, sim.cpu_forward += ls->cpu_forward / run;
        sim.attention += ls->attention / run, sim.cpu_attention += ls->cpu_attention / run;
        sim.hessian += ls->hessian / run, sim.cpu_hessian += ls->cpu_hessian / run;
        sim.gptq += ls->gptq / run, sim.cpu_gptq += ls->cpu_gptq / run;
        sim.write += ls->write / run, sim.cpu_write += ls->cpu_write / run;
        rd += r->layer[l].read;
        fwd += r->layer[l].forward;
        att += r->layer[l].attention;
        hes += r->layer[l].hessian;
        gq += r->layer[l].gptq;
        wr += r->layer[l].write;
    }
    /* the plan's FLOPs are the whole model's; per layer they are all alike */
    double fwd_flops = r->plan.flops_forward / r->plan.layers * run;
    double frac = fwd > 0 ? fwd_flops / fwd * 1e-9 / sgemm : 0;
    double whole = run > 0 ? sum / run * n_layers : 0;
    if (json) {
        printf("{\"model\": ");
        cli_print_json_string(stdout, pos[0]);
        printf(", \"model_type\": \"%s\", \"layers\": %d, \"layers_run\": %d, \"samples\": %lld, "
               "\"tokens\": %lld, \"threads\": %d, \"expert_chunk\": %d, \"block_size\": %lld, \"per_layer\": [",
               model_type, n_layers, run, (long long)r->samples, (long long)r->tokens,
               moeq_threads(), r->plan.chunk, (long long)o.g.block_size);
        for (int l = 0; l < run; l++)
            printf("%s{\"read\": %.3f, \"forward\": %.3f, \"attention\": %.3f, \"hessians\": %.3f, "
                   "\"gptq\": %.3f, \"write\": %.3f, \"total\": %.3f, \"serial\": %.3f, \"peak_anon_bytes\": %lld}",
                   l ? ", " : "", r->layer[l].read, r->layer[l].forward, r->layer[l].attention, r->layer[l].hessian,
                   r->layer[l].gptq, r->layer[l].write, r->layer[l].total, layer_serial(&r->layer[l]),
                   (long long)r->layer[l].peak_anon);
        printf("], \"forward_gflops\": %.2f, \"sgemm_gflops\": %.2f, \"forward_fraction_of_sgemm\": %.3f, "
               "\"gpu_sgemm_gflops\": %.2f, \"gpu_copy_gbs\": %.2f, "
               "\"peak_anon_bytes\": %lld, \"planned_peak_bytes\": %lld, \"budget_bytes\": %lld, "
               "\"extrapolated_seconds\": %.3f, \"extrapolated_hours\": %.4f",
               fwd > 0 ? fwd_flops / fwd * 1e-9 : 0, sgemm, frac, gpu_sgemm, gpu_bw, (long long)r->peak_anon,
               (long long)r->plan.peak, (long long)r->plan.budget, whole, whole / 3600);
        if (sim_threads > 0) {
            const int P = (int)sim_threads;
            printf(", \"simulated\": {\"threads\": %d, \"one_thread_seconds\": %.3f, \"loop_task_seconds\": %.3f, "
                   "\"loop_seconds\": %.3f, \"predicted_seconds\": %.3f, \"efficiency\": %.3f, \"stages\": {",
                   P, sim_one_thread(&sim), sim.sim_tasks, sim.sim_span, sim.total, sim_efficiency(&sim, P));
            const char *names[6] = {"read", "forward", "attention", "hessians", "gptq", "write"};
            const double secs[6] = {sim.read, sim.forward, sim.attention, sim.hessian, sim.gptq, sim.write};
            const double cpus[6] = {sim.cpu_read, sim.cpu_forward, sim.cpu_attention, sim.cpu_hessian, sim.cpu_gptq,
                                    sim.cpu_write};
            for (int k = 0; k < 6; k++)
                printf("%s\"%s\": {\"seconds\": %.4f, \"cpu_seconds\": %.4f, \"efficiency\": %.3f}", k ? ", " : "",
                       names[k], secs[k], cpus[k], sim_stage(cpus[k], secs[k], P));
            printf("}}");
        }
        printf("}\n");
    } else {
        printf("%s (%s): GPTQ %s on %s%s, %s, %lld samples x %lld tokens (mean; %s), %d threads, %d layers run of "
               "%d, %d experts per chunk\n", pos[0], model_type, scheme, device, qo.gpu_precision ? (qo.gpu_precision == MOEQ_GPU_TF32 ? " in TF32" : " in TF32x3") : "", mode,
               (long long)r->samples, (long long)(r->samples ? r->tokens / r->samples : 0), sampling, moeq_threads(),
               run, n_layers, r->plan.chunk);
        for (int l = 0; l < run; l++)
            printf("  layer %d: %.1f s = read %.1f + forward %.1f (attention %.1f) + Hessians %.1f + GPTQ %.1f + "
                   "write %.1f + waiting for other ranks %.1f + moving data %.1f + other %.1f; peak %.2f GB; "
                   "%.1f s on one thread (outside the pool's loops)\n", l,
                   r->layer[l].total, r->layer[l].read, r->layer[l].forward, r->layer[l].attention, r->layer[l].hessian,
                   r->layer[l].gptq, r->layer[l].write, r->layer[l].wait, r->layer[l].exchange,
                   r->layer[l].total - r->layer[l].read - r->layer[l].forward - r->layer[l].hessian -
                       r->layer[l].gptq - r->layer[l].write - r->layer[l].wait - r->layer[l].exchange,
                   (double)r->layer[l].peak_anon / 1e9, layer_serial(&r->layer[l]));
        printf("per layer: %.1f s (read %.1f, forward %.1f, attention %.1f of it, Hessians %.1f, GPTQ %.1f, "
               "write %.1f)\n", sum / run, rd / run, fwd / run, att / run, hes / run, gq / run, wr / run);
        printf("forward: %.1f GFLOP/s = %.2f x sgemm (%.1f GFLOP/s, OpenBLAS 1024^3, same run)\n",
               fwd > 0 ? fwd_flops / fwd * 1e-9 : 0, frac, sgemm);
        if (dev >= 0 && gpu_sgemm > 0)
            printf("forward on the GPU: %.2f x its %s sgemm (%.1f GFLOP/s, 8192^3; copy bandwidth %.0f GB/s; same "
                   "run)\n", fwd > 0 ? fwd_flops / fwd * 1e-9 / gpu_sgemm : 0, qo.gpu_precision == MOEQ_GPU_TF32 ? "TF32" : "fp32", gpu_sgemm, gpu_bw);
        else if (dev >= 0)
            printf("forward on the GPU: its sgemm was not measured (%s)\n", moeq_last_error());
        printf("peak anonymous memory: %.2f GB (planned %.2f GB, budget %.2f GB)\n",
               (double)r->peak_anon / 1e9, (double)r->plan.peak / 1e9, (double)r->plan.budget / 1e9);
        printf("whole model (%d layers) extrapolated: %.0f s = %.2f h", n_layers, whole, whole / 3600);
        if (strcmp(model_type, "qwen3_moe") == 0)
            printf("; llm-compressor GPTQ of Qwen3-30B-A3B: 3.9 h on one GPU (%.2f x)", 3.9 * 3600 / whole);
        printf("\n");
        if (sim_threads > 0) {
            const int P = (int)sim_threads;
            printf("simulated %d threads (each parallel loop's tasks timed here and handed out as the pool does; not "
                   "modelled: the cores' shared clock and memory; the seconds above are theirs), per layer: the "
                   "loops' %.2f s take %.2f s (%.2f of %dx); with the %.2f s outside them the layer's %.2f s on one "
                   "thread would take %.2f s, efficiency %.2f; by stage: read %.2f, forward %.2f, attention %.2f, "
                   "Hessians %.2f, GPTQ %.2f, write %.2f\n",
                   P, sim.sim_tasks, sim.sim_span, sim.sim_span > 0 ? sim.sim_tasks / (sim.sim_span * (double)P) : 0, P,
                   sim.total - sim.sim_span, sim_one_thread(&sim), sim.total, sim_efficiency(&sim, P),
                   sim_stage(sim.cpu_read, sim.read, P), sim_stage(sim.cpu_forward, sim.forward, P),
                   sim_stage(sim.cpu_attention, sim.attention, P), sim_stage(sim.cpu_hessian, sim.hessian, P),
                   sim_stage(sim.cpu_gptq, sim.gptq, P), sim_stage(sim.cpu_write, sim.write, P));
        }
    }
    free(rs);
    return same ? CLI_OK : CLI_FAIL;
}
