/*
 * moeq bench forward: the fp32 forward pass's prefill and decode speed, with the FLOP rate it
 * achieves (2 * the active Linear weights per token plus causal attention, see
 * mq_config_forward_flops) next to this machine's sgemm rate measured in the same run.
 */
#include <stdio.h>
#include <stdlib.h>

#include "commands.h"
#include "cli.h"
#include "model/model.h"

int bench_forward(int argc, char **argv) {
    bool json = false;
    int64_t tokens = 512, decode = 64, reps = 3, threads = 0;
    cli_opt opts[] = {
        {"--tokens", OPT_INT, &tokens, "N", "prefill prompt length (default 512, at most the "
                                            "model's context)", NULL, 1, 1 << 20, NULL},
        {"--decode", OPT_INT, &decode, "N", "decode steps timed after the prompt (default 64)", NULL,
         1, 1 << 20, NULL},
        {"--reps", OPT_INT, &reps, "R", "prefill repetitions, the best is reported (default 3)",
         NULL, 1, 1000, NULL},
        {"--threads", OPT_INT, &threads, "N", "worker threads (default: every CPU it may use)", NULL, 0, 1024,
         NULL},
        {"--json", OPT_FLAG, &json, NULL, "print one JSON object on stdout", NULL, 0, -1, NULL},
    };
    cli_command cmd = {"bench forward", "MODEL_DIR [--tokens N] [--decode N] [--json]",
                       "Times the fp32 forward pass: a prefill of --tokens tokens (all logits), then "
                       "--decode single-token steps ending at the same context length. Reports "
                       "tokens/s, achieved GFLOP/s and the machine's sgemm GFLOP/s.",
                       opts, (int)(sizeof opts / sizeof opts[0]), 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos = 0;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (threads > 0) moeq_set_threads((int)threads);

    moeq_model *m = NULL;
    moeq_model_options mo = {.no_tokenizer = 1};
    if (!(pos[0] = cli_model_dir("bench forward", pos[0], NULL))) return CLI_FAIL;
    moeq_status st = moeq_model_open(pos[0], &mo, &m);
    if (st) return cli_fail("bench forward", st);
    const mq_config *c = &m->cfg;
    int64_t T = tokens < c->max_pos ? tokens : c->max_pos;
    int64_t nd = decode < T ? decode : T - 1;
    if (nd < 1) nd = 1;
    int64_t p0 = T - nd > 0 ? T - nd : 1;
    int64_t V = c->vocab;

    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(T + nd));
    float *logits = malloc(sizeof(float) * (size_t)(T * V));
    moeq_session *s = NULL;
    if (!ids || !logits) {
        free(ids);
        free(logits);
        moeq_model_free(m);
        fprintf(stderr, "moeq bench forward: out of memory\n");
        return CLI_FAIL;
    }
    uint32_t r = 12345;
    for (int64_t i = 0; i < T + nd; i++) {
        r = r * 1664525u + 1013904223u;
        ids[i] = (int32_t)((r >> 8) % (uint32_t)V);
    }
    st = moeq_session_create(m, (int32_t)(T > p0 + nd ? T : p0 + nd), &s);

    double t_prefill = 1e30, t_decode = 0;
    for (int64_t k = 0; !st && k < reps; k++) {
        moeq_session_reset(s);
        double t0 = mq_now();
        st = moeq_session_forward(s, ids, (int32_t)T, logits);
        double dt = mq_now() - t0;
        if (dt < t_prefill) t_prefill = dt;
    }
    if (!st) {
        moeq_session_reset(s);
        st = moeq_session_forward(s, ids, (int32_t)p0, NULL);
        double t0 = mq_now();
        for (int64_t i = 0; !st && i < nd; i++) st = moeq_session_forward(s, ids + p0 + i, 1, logits);
        t_decode = mq_now() - t0;
    }
    moeq_session_free(s);
    free(ids);
    free(logits);
    if (st) {
        int ret = cli_fail("bench forward", st);
        moeq_model_free(m);
        return ret;
    }
    double f_prefill = mq_config_forward_flops(c, T, 0);
    double f_decode = 0;
    for (int64_t i = 0; i < nd; i++) f_decode += mq_config_forward_flops(c, 1, p0 + i);
    double sgemm = mq_measure_sgemm_gflops(1024, 1.0);
    int64_t total = 0, active = 0;
    mq_config_param_counts(c, &total, &active);

    double pre_tps = (double)T / t_prefill, dec_tps = (double)nd / t_decode;
    double pre_gf = f_prefill / t_prefill * 1e-9, dec_gf = f_decode / t_decode * 1e-9;
    if (json) {
        printf("{\"model\": ");
        cli_print_json_string(stdout, pos[0]);
        printf(", \"model_type\": \"%s\", \"threads\": %d, \"params\": %lld, \"active_params\": %lld, "
               "\"prefill_tokens\": %lld, \"prefill_seconds\": %.6f, \"prefill_tokens_per_s\": %.2f, "
               "\"prefill_gflops\": %.3f, \"decode_tokens\": %lld, \"decode_context\": %lld, "
               "\"decode_seconds\": %.6f, \"decode_tokens_per_s\": %.2f, \"decode_gflops\": %.3f, "
               "\"sgemm_gflops\": %.3f}\n",
               c->model_type, moeq_threads(), (long long)total, (long long)active, (long long)T,
               t_prefill, pre_tps, pre_gf, (long long)nd, (long long)p0, t_decode, dec_tps, dec_gf,
               sgemm);
    } else {
        printf("model           %s (%s, %.2fM params, %.2fM active per token)\n", pos[0],
               c->model_type, (double)total * 1e-6, (double)active * 1e-6);
        printf("threads         %d\n", moeq_threads());
        printf("prefill         %lld tokens in %.4f s: %.1f tokens/s, %.2f GFLOP/s\n", (long long)T,
               t_prefill, pre_tps, pre_gf);
        printf("decode          %lld tokens (context %lld..%lld) in %.4f s: %.1f tokens/s, %.2f "
               "GFLOP/s\n", (long long)nd, (long long)p0, (long long)(p0 + nd), t_decode, dec_tps,
               dec_gf);
        printf("sgemm           %.2f GFLOP/s (OpenBLAS 1024^3, same run)\n", sgemm);
        printf("prefill / sgemm %.1f%%\n", 100.0 * pre_gf / sgemm);
    }
    moeq_model_free(m);
    return CLI_OK;
}
