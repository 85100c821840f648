/*
 * moeq bench generate: llama-bench's measurements for moeq's packed runtime, and llama-bench
 * itself on the same file when a llama.cpp build is there, rounds alternated, medians and ratios.
 *
 * A round of moeq opens the model (keep_packed: a .gguf in place, the packed-layout cache mapped
 * when valid), prefills --prompt random ids with the last position's logits (llama-bench's pp),
 * then decodes --gen ids one at a time from an empty context with their logits (its tg).
 * The figures: load seconds (the open; the first round may build the cache, so it is reported
 * apart), prompt and decode tokens/s, resident weights and peak RSS; the machine's read
 * bandwidth (src/kernels/membw.c) and the bytes a decoded token reads (every resident weight but
 * the routed experts not chosen: top_k of n_experts of them), so decode is also given as a share
 * of bandwidth / bytes-per-token, the speed a memory-bound decoder cannot pass.
 * llama-bench (-p, -n, -t, -r 1, JSON output) runs as a child between moeq's rounds; its load is
 * the wall time of a run of one generated token and no prompt, less that token's time, and its
 * peak memory the child's ru_maxrss.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <spawn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "commands.h"
#include "kernels/ggml_mat.h"
#include "kernels/moe_ffn.h"
#include "model/model.h"

extern char **environ;

#define MAX_REPS 64

typedef struct {
    double load, pp, tg;   /* seconds; tokens/s */
    int64_t rss;           /* bytes (llama.cpp: the child's peak) */
} round_t;

/* Resident bytes of one Linear's weight (packed, mapped or fp32). */
static double linear_bytes(const mq_linear *l) {
    return l->qw   ? (double)mq_packed_weight_bytes(l->qw)
           : l->gw ? (double)mq_ggml_mat_bytes(l->gw)
           : l->w  ? 4.0 * (double)l->out * (double)l->in : 0.0;
}

/* Bytes one decoded token reads: every resident weight but the routed experts not chosen (in
 * the fused op or run one by one) and the embedding rows but the token's own (an untied table:
 * a tied one is read whole as lm_head). */
static double bytes_per_token(const moeq_model *m) {
    const moeq_model_info *in = moeq_model_get_info(m);
    double b = (double)in->weight_bytes;
    const mq_config *c = &m->cfg;
    const double V = (double)c->vocab, D = (double)c->D;
    if (!c->tie_embeddings)
        b -= m->embed_g ? (double)mq_ggml_mat_bytes(m->embed_g) * (1.0 - 1.0 / V)
             : m->embed ? 4.0 * (V - 1.0) * D : 0.0;
    for (int l = 0; l < c->n_layers; l++) {
        const moeq_moe_experts *w = m->layers[l].pexperts;
        const mq_layer *ly = &m->layers[l];
        if (!w && ly->is_moe && ly->exp_gate && c->n_experts > 0) {
            double routed = 0;
            for (int e = 0; e < c->n_experts; e++)
                routed += linear_bytes(&ly->exp_gate[e]) + linear_bytes(&ly->exp_up[e]) +
                          linear_bytes(&ly->exp_down[e]);
            b -= routed * (1.0 - (double)c->top_k / (double)c->n_experts);
        }
        if (!w || w->E <= 0) continue;
        double routed = 0;
        for (int e = 0; e < w->E; e++) {
            const mq_pexpert *x = &w->ex[e];
            routed += (double)(x->gate_up.rows / MQ_MOE_RB) * (double)x->gate_up.rb_bytes +
                      (double)(x->down.rows / MQ_MOE_RB) * (double)x->down.rb_bytes;
        }
        b -= routed * (1.0 - (double)c->top_k / (double)w->E);
    }
    return b;
}

static int moeq_round(const char *path, int64_t np, int64_t ng, uint32_t *rng, round_t *r,
                      double *bpt, moeq_model_info *info) {
    moeq_model_options mo = {.keep_packed = 1, .no_tokenizer = 1};
    moeq_model *m = NULL;
    double t0 = mq_now();
    moeq_status st = moeq_model_open(path, &mo, &m);
    r->load = mq_now() - t0;
    if (st) return cli_fail("bench generate", st);
    const int64_t V = m->cfg.vocab, ctx = np > ng ? np : ng;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)ctx);
    float *logits = malloc(sizeof(float) * (size_t)V);
    moeq_session *s = NULL;
    if (!ids || !logits) st = mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!st) st = moeq_session_create(m, (int32_t)ctx, &s);
    for (int64_t i = 0; !st && i < ctx; i++) {
        *rng = *rng * 1664525u + 1013904223u;
        ids[i] = (int32_t)((*rng >> 8) % (uint32_t)V);
    }
    if (!st) {   /* prompt: the last position's logits only, as llama-bench's pp */
        t0 = mq_now();
        if (np > 1) st = moeq_session_forward(s, ids, (int32_t)np - 1, NULL);
        if (!st) st = moeq_session_forward(s, ids + np - 1, 1, logits);
        r->pp = (double)np / (mq_now() - t0);
    }
    if (!st) moeq_session_reset(s);
    if (!st) {
        t0 = mq_now();
        for (int64_t i = 0; !st && i < ng; i++) st = moeq_session_forward(s, ids + i, 1, logits);
        r->tg = (double)ng / (mq_now() - t0);
    }
    r->rss = cli_peak_rss_bytes();
    *bpt = bytes_per_token(m);
    *info = *moeq_model_get_info(m);
    moeq_session_free(s);
    free(ids);
    free(logits);
    moeq_model_free(m);
    return st ? cli_fail("bench generate", st) : CLI_OK;
}

/* Runs llama-bench with args; its JSON's avg_ts per test into pp/tg (-1 when absent), the wall
 * seconds and the child's peak RSS. Returns false when it could not run. */
static bool llama_run(const char *bin, const char *model, int64_t np, int64_t ng, int threads,
                      double *pp, double *tg, double *wall, int64_t *rss) {
    char out[] = "/tmp/moeq-llama-bench-XXXXXX";
    int fd = mkstemp(out);
    if (fd < 0) return false;
    char sp[32], sg[32], st[32];
    snprintf(sp, sizeof sp, "%lld", (long long)np);
    snprintf(sg, sizeof sg, "%lld", (long long)ng);
    snprintf(st, sizeof st, "%d", threads);
    char *argv[] = {(char *)bin, "-m", (char *)model, "-p", sp, "-n", sg, "-t", st, "-r", "1",
                    "-o", "json", NULL};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fd, 1);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    pid_t pid;
    double t0 = mq_now();
    int rc = posix_spawn(&pid, bin, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fd);
    int status = 0;
    struct rusage ru;
    bool ok = rc == 0 && wait4(pid, &status, 0, &ru) == pid && WIFEXITED(status) &&
              WEXITSTATUS(status) == 0;
    *wall = mq_now() - t0;
    *rss = ok ? (int64_t)ru.ru_maxrss * 1024 : 0;
    *pp = *tg = -1;
    size_t n;
    char *text = NULL;
    if (ok && mq_read_file(out, &text, &n)) text = NULL;
    unlink(out);
    cJSON *j = text ? cJSON_Parse(text) : NULL;
    free(text);
    const cJSON *t;
    cJSON_ArrayForEach(t, j) {
        const cJSON *a = cJSON_GetObjectItem(t, "n_prompt"), *b = cJSON_GetObjectItem(t, "n_gen"),
                    *v = cJSON_GetObjectItem(t, "avg_ts");
        if (!cJSON_IsNumber(a) || !cJSON_IsNumber(b) || !cJSON_IsNumber(v)) continue;
        if (a->valuedouble > 0) *pp = v->valuedouble;
        else if (b->valuedouble > 0) *tg = v->valuedouble;
    }
    cJSON_Delete(j);
    return ok && (np == 0 || *pp > 0) && (ng == 0 || *tg > 0);
}

static double med(const round_t *r, int n, size_t field) {
    double v[MAX_REPS];
    for (int i = 0; i < n; i++) memcpy(&v[i], (const char *)&r[i] + field, sizeof(double));
    return cli_median(v, n);
}

int bench_generate(int argc, char **argv) {
    int64_t np = 512, ng = 128, reps = 3, threads = 0;
    const char *cache = NULL, *llama = NULL;
    bool no_llama = false, json = false;
    cli_opt opts[] = {
        {"--prompt", OPT_INT, &np, "N", "prompt tokens, one prefill call (llama-bench -p; default 512)",
         NULL, 1, 1 << 20, NULL},
        {"--gen", OPT_INT, &ng, "N", "tokens decoded one at a time (llama-bench -n; default 128)",
         NULL, 1, 1 << 20, NULL},
        {"--reps", OPT_INT, &reps, "R", "rounds of each program, alternated (default 3; medians)",
         NULL, 1, MAX_REPS, NULL},
        {"--threads", OPT_INT, &threads, "N", "threads of both (default: every CPU it may use)",
         NULL, 0, 1024, NULL},
        {"--cache", OPT_STRING, &cache, "DIR", "the packed-layout cache's folder, 'off' for none "
                                               "(default: beside the model, else $XDG_CACHE_HOME/moeq)",
         NULL, 0, -1, NULL},
        {"--llama-bench", OPT_STRING, &llama, "PATH", "llama-bench to compare with (default "
                                                       "/work/llama.cpp/build/bin/llama-bench when there)",
         NULL, 0, -1, NULL},
        {"--no-llama", OPT_FLAG, &no_llama, NULL, "moeq alone", NULL, 0, -1, NULL},
        {"--json", OPT_FLAG, &json, NULL, "print one JSON object on stdout", NULL, 0, -1, NULL},
    };
    cli_command cmd = {"bench generate", "MODEL [--prompt N] [--gen N] [--reps R] [--threads N]",
                       "llama-bench's figures for moeq's packed runtime on MODEL (a .gguf or a "
                       "checkpoint folder): load seconds, prompt and decode tokens/s, resident "
                       "weights and peak RSS, decode against the machine's read bandwidth; and "
                       "llama-bench on the same .gguf, rounds alternated, medians and ratios.",
                       opts, (int)(sizeof opts / sizeof opts[0]), 1, 1, "MODEL"};
    const char *pos[1];
    int n_pos = 0;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    moeq_set_threads((int)threads);
    const int nt = mq_pool_size();
    moeq_status st = moeq_set_pack_cache_dir(!cache ? NULL : !strcmp(cache, "off") ? "" : cache);
    if (st) return cli_fail("bench generate", st);
    const char *path = pos[0];
    const size_t len = strlen(path);
    const bool gguf = len > 5 && !strcmp(path + len - 5, ".gguf");
    const char *def = "/work/llama.cpp/build/bin/llama-bench";
    if (!llama && access(def, X_OK) == 0) llama = def;
    if (no_llama) llama = NULL;
    if (!llama) fprintf(stderr, "moeq bench generate: no llama-bench (--llama-bench PATH): moeq alone\n");
    else if (!gguf) fprintf(stderr, "moeq bench generate: %s is no .gguf: llama-bench skipped\n", path);
    const bool with_llama = llama && gguf;

    round_t mq[MAX_REPS], ll[MAX_REPS];
    double ll_load[MAX_REPS], bpt = 0;
    moeq_model_info info = {0};
    uint32_t rng = 1234567u;
    for (int i = 0; i < reps; i++) {
        if ((rc = moeq_round(path, np, ng, &rng, &mq[i], &bpt, &info)) != CLI_OK) return rc;
        fprintf(stderr, "moeq bench generate: moeq round %d: load %.3f s, pp %.2f t/s, tg %.2f t/s\n",
                i + 1, mq[i].load, mq[i].pp, mq[i].tg);
        if (!with_llama) continue;
        double w0, w1, p0, g0, p1, g1;
        int64_t r0 = 0, r1 = 0;
        if (!llama_run(llama, path, np, ng, nt, &p0, &g0, &w0, &r0) ||
            !llama_run(llama, path, 0, 1, nt, &p1, &g1, &w1, &r1)) {
            fprintf(stderr, "moeq bench generate: %s failed on %s\n", llama, path);
            return CLI_FAIL;
        }
        ll[i] = (round_t){0, p0, g0, r0 > r1 ? r0 : r1};
        ll_load[i] = w1 - 1.0 / g1;
        fprintf(stderr, "moeq bench generate: llama round %d: load %.3f s, pp %.2f t/s, tg %.2f t/s\n",
                i + 1, ll_load[i], p0, g0);
    }
    const double gbps = mq_measure_read_gbps((size_t)1 << 29, 1.0);
    const double m_load = med(mq + (reps > 1), reps - (reps > 1), offsetof(round_t, load));
    const double m_pp = med(mq, (int)reps, offsetof(round_t, pp)), m_tg = med(mq, (int)reps, offsetof(round_t, tg));
    const double bound = gbps * 1e9 / bpt;
    double l_load = 0, l_pp = 0, l_tg = 0;
    int64_t l_rss = 0;
    if (with_llama) {
        l_load = cli_median(ll_load, (int)reps);
        l_pp = med(ll, (int)reps, offsetof(round_t, pp));
        l_tg = med(ll, (int)reps, offsetof(round_t, tg));
        for (int i = 0; i < reps; i++) l_rss = ll[i].rss > l_rss ? ll[i].rss : l_rss;
    }
    const int64_t m_rss = mq[reps - 1].rss;   /* before the bandwidth probe's buffer */
    if (json) {
        printf("{\"model\": ");
        cli_print_json_string(stdout, path);
        printf(", \"threads\": %d, \"prompt\": %lld, \"gen\": %lld, \"reps\": %lld, "
               "\"read_gbps\": %.3f, \"bytes_per_token\": %.0f, \"moeq\": {\"load_first_s\": %.4f, "
               "\"load_s\": %.4f, \"pp_tps\": %.3f, \"tg_tps\": %.3f, \"tg_of_bound\": %.4f, "
               "\"weight_bytes\": %lld, \"peak_rss\": %lld}",
               nt, (long long)np, (long long)ng, (long long)reps, gbps, bpt, mq[0].load, m_load,
               m_pp, m_tg, m_tg / bound, (long long)info.weight_bytes, (long long)m_rss);
        if (with_llama)
            printf(", \"llama\": {\"load_s\": %.4f, \"pp_tps\": %.3f, \"tg_tps\": %.3f, "
                   "\"peak_rss\": %lld}, \"ratios\": {\"pp\": %.4f, \"tg\": %.4f, \"load\": %.4f, "
                   "\"peak_rss\": %.4f}",
                   l_load, l_pp, l_tg, (long long)l_rss, m_pp / l_pp, m_tg / l_tg, m_load / l_load,
                   (double)m_rss / (double)l_rss);
        printf("}\n");
        return CLI_OK;
    }
    printf("model %s, %d threads, pp%lld / tg%lld, %lld rounds (medians)\n", path, nt, (long long)np,
           (long long)ng, (long long)reps);
    printf("read bandwidth %.2f GB/s; a decoded token reads %.1f MB: bound %.2f tokens/s\n", gbps,
           bpt / 1e6, bound);
    printf("%-8s %10s %10s %12s %12s %12s %12s\n", "", "load s", "load 1st", "pp t/s", "tg t/s",
           "weights MiB", "peak MiB");
    printf("%-8s %10.3f %10.3f %12.2f %12.2f %12.1f %12.1f   (tg %.0f%% of the bound)\n", "moeq",
           m_load, mq[0].load, m_pp, m_tg, (double)info.weight_bytes / 1048576.0,
           (double)m_rss / 1048576.0, 100.0 * m_tg / bound);
    if (with_llama) {
        printf("%-8s %10.3f %10s %12.2f %12.2f %12s %12.1f   (tg %.0f%% of the bound)\n", "llama",
               l_load, "", l_pp, l_tg, "", (double)l_rss / 1048576.0, 100.0 * l_tg / bound);
        printf("moeq / llama.cpp: prompt %.2fx, decode %.2fx, load %.2fx, peak memory %.2fx\n",
               m_pp / l_pp, m_tg / l_tg, m_load / l_load, (double)m_rss / (double)l_rss);
    }
    return CLI_OK;
}
