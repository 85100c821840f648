/*
 * moeq bench gptq: GPTQ on one random weight [rows, cols] with a random SPD Hessian, timed
 * (factorisation + column loop) and compared with this machine's sgemm rate, counting
 * rows*cols^2 + cols^3 flops (error updates plus inverse) as in issue 5. --moe also times one
 * OLMoE-1B-7B-shaped MoE layer: 64 experts, gate and up [1024, 2048] sharing one Hessian, down
 * [2048, 1024] (torchao on an H200: 0.94 s for 4096x2048, 65 s for the layer).
 * --device cuda[:N] times the same on the GPU backend (the whole layer in one call), with the
 * GPU's measured sgemm rate and bandwidth, and the single weight's code agreement with the CPU.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zlib.h>

#include "commands.h"
#include "cli.h"
#include <unistd.h>

#include "backend/gpu.h"
#include "pipeline/pipeline.h"
#include "quant/gptq.h"

static uint64_t g_rng;
static float rnd_normal(void) {
    double u[2];
    for (int i = 0; i < 2; i++) {
        g_rng ^= g_rng << 13;
        g_rng ^= g_rng >> 7;
        g_rng ^= g_rng << 17;
        u[i] = ((double)(g_rng >> 11) + 0.5) * 0x1p-53;
    }
    return (float)(sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]));
}

static float *random_matrix(int64_t rows, int64_t cols, float scale) {
    float *m = mq_alloc_array((size_t)rows * (size_t)cols, sizeof(float), "bench matrix");
    if (m)
        for (int64_t i = 0; i < rows * cols; i++) m[i] = scale * rnd_normal();
    return m;
}

/* H = (2/T) X^T X for T = 2K standard normal tokens: SPD and reasonably conditioned. */
static float *random_hessian(int64_t K) {
    int64_t T = 2 * K;
    float *xt = random_matrix(K, T, 1.0f);   /* X^T [K, T] */
    float *h = mq_alloc_array((size_t)K * (size_t)K, sizeof(float), "bench Hessian");
    if (xt && h) mq_gemm_nt(K, K, T, 2.0f / (float)T, xt, T, xt, T, 0.0f, h, K);
    /* exactly symmetric, as mq_hessian_get's H is: a tiled GEMM's X X^T differs between its
     * triangles in rounding (a tenth of the pairs at K = 2048), and the CPU reads one triangle
     * where the GPU reads the other */
    for (int64_t a = 0; h && a < K; a++)
        for (int64_t b = a + 1; b < K; b++) h[a * K + b] = h[b * K + a];
    mq_free(xt);
    return h;
}

typedef struct {
    mq_qspec spec;
    mq_gptq_opts opts;
} bench_cfg;

/* One weight: returns the best wall time over reps (factor + loop), or < 0 on error. */
static uint32_t qtensor_crc(const mq_qtensor *q) {
    uLong c = crc32(0L, Z_NULL, 0);
    c = crc32(c, q->codes, (uInt)(q->rows * q->cols));
    for (int64_t i = 0; i < q->rows * q->n_groups; i++) {
        const mq_gparams *g = &q->params[i];
        c = crc32(c, (const Bytef *)&g->scale, 4);
        c = crc32(c, (const Bytef *)&g->zero, 4);
        c = crc32(c, &g->scale_code, 1);
    }
    return (uint32_t)c;
}

static uint32_t g_last_crc;   /* of time_one's last result */
static double g_best_parts[3];   /* the best run's Cholesky, inverse and copies seconds */

static double time_one(const bench_cfg *b, const float *H, const float *W, int64_t N, int64_t K,
                       int reps, double *factor_s, mq_gptq_stats *stats, double *cores) {
    double best = INFINITY;
    for (int r = 0; r < reps; r++) {
        double t0 = mq_now(), c0 = cli_cpu_seconds();
        mq_gptq_factor f;
        if (mq_gptq_factor_init(H, K, &b->opts, b->opts.rtn_loss, "bench.weight", &f)) return -1;
        double t1 = mq_now();
        const double parts[3] = {f.sec_cholesky, f.sec_inverse, f.sec_copies};
        mq_qtensor q;
        mq_gptq_job j = {&f, W, N, 0, "bench.weight", &q, NULL, {0, 0, 0, 0, 0}, NULL};
        moeq_status st = mq_gptq_run(&b->spec, &b->opts, &j, 1);
        double t2 = mq_now(), c2 = cli_cpu_seconds();
        mq_gptq_factor_free(&f);
        if (st) return -1;
        g_last_crc = qtensor_crc(&q);
        mq_qtensor_free(&q);
        if (t2 - t0 < best) {
            best = t2 - t0;
            *factor_s = t1 - t0;
            *stats = j.stats;
            *cores = (c2 - c0) / (t2 - t0);
            g_best_parts[0] = parts[0];
            g_best_parts[1] = parts[1];
            g_best_parts[2] = parts[2];
        }
    }
    return best;
}

static double time_moe_layer(const bench_cfg *b, int64_t E, int64_t chunk, int64_t F, int64_t D,
                             double *cores, mq_gpu *g, double *host_s, double sim[2]);

/* --simulate-threads P: the weight's factor and column loop on one thread as P threads would split
 * them (mq_pool_simulate), the best of reps by the simulated total; with --moe (experts > 0) the
 * MoE layer too, once: its seconds on one thread are the loops' tasks plus what runs outside them,
 * and P threads would take the loops' simulated seconds plus that. */
static int bench_simulated(const bench_cfg *b, int64_t N, int64_t K, int reps, int P, int64_t experts,
                           int64_t chunk, bool json) {
    float *W = random_matrix(N, K, 0.02f), *H = random_hessian(K);
    if (!W || !H) {
        mq_free(W), mq_free(H);
        return cli_fail("bench gptq", MOEQ_E_NOMEM);
    }
    moeq_set_threads(1);
    double best[5] = {0, 0, 0, 0, INFINITY};   /* factor tasks, span; loop tasks, span; total span */
    moeq_status st = MOEQ_OK;
    for (int r = 0; r < reps && !st; r++) {
        double v[5];
        mq_gptq_factor f;
        mq_pool_simulate(P);
        st = mq_gptq_factor_init(H, K, &b->opts, b->opts.rtn_loss, "bench.weight", &f);
        mq_pool_simulated(&v[0], &v[1]);
        if (st) break;
        mq_pool_simulate(P);
        mq_qtensor q;
        mq_gptq_job j = {&f, W, N, 0, "bench.weight", &q, NULL, {0, 0, 0, 0, 0}, NULL};
        st = mq_gptq_run(&b->spec, &b->opts, &j, 1);
        mq_pool_simulated(&v[2], &v[3]);
        mq_gptq_factor_free(&f);
        if (!st) mq_qtensor_free(&q);
        v[4] = v[1] + v[3];
        if (!st && v[4] < best[4]) memcpy(best, v, sizeof best);
    }
    mq_free(W);
    mq_free(H);
    double moe_p = 0, moe[2] = {0, 0};   /* P threads' seconds (mq_now's); the loops' task seconds, their schedule */
    if (!st && experts > 0) {
        double cores;
        mq_pool_simulate(P);
        moe_p = time_moe_layer(b, experts, chunk, 1024, 2048, &cores, NULL, NULL, moe);
        if (moe_p < 0) st = MOEQ_E_NOMEM;
    }
    mq_pool_simulate(0);
    if (st) return cli_fail("bench gptq", st);
    const double tasks = best[0] + best[2], eff = best[4] > 0 ? tasks / (P * best[4]) : 0;
    const double moe_one = moe_p + moe[0] - moe[1], moe_eff = moe_p > 0 ? moe_one / (P * moe_p) : 0;
    if (json) {
        printf("{\"rows\": %lld, \"cols\": %lld, \"simulated_threads\": %d, \"factor_task_seconds\": %.6f, "
               "\"factor_seconds\": %.6f, \"loop_task_seconds\": %.6f, \"loop_seconds\": %.6f, "
               "\"efficiency\": %.4f", (long long)N, (long long)K, P, best[0], best[1], best[2], best[3], eff);
        if (experts > 0)
            printf(", \"moe_layer_experts\": %lld, \"moe_layer_chunk\": %lld, \"moe_layer_one_thread_seconds\": %.4f, "
                   "\"moe_layer_task_seconds\": %.4f, \"moe_layer_seconds\": %.4f, \"moe_layer_efficiency\": %.4f",
                   (long long)experts, (long long)chunk, moe_one, moe[0], moe_p, moe_eff);
        printf("}\n");
    } else {
        printf("gptq %lldx%lld simulated at %d threads (tasks timed on one thread, handed out as the pool does; the "
               "cores' shared clock and memory not modelled): factor %.4f s of tasks -> %.4f s (%.2f of %dx), "
               "column loop %.4f -> %.4f s (%.2f), weight %.4f -> %.4f s: efficiency %.2f\n", (long long)N,
               (long long)K, P, best[0], best[1], best[1] > 0 ? best[0] / (P * best[1]) : 0, P, best[2], best[3],
               best[3] > 0 ? best[2] / (P * best[3]) : 0, tasks, best[4], eff);
        if (experts > 0)
            printf("moe layer (%lld experts, %lld at a time) simulated at %d threads: %.2f s on one thread (loops' "
                   "tasks %.2f s) -> %.2f s: efficiency %.2f\n", (long long)experts, (long long)chunk, P, moe_one,
                   moe[0], moe_p, moe_eff);
    }
    return CLI_OK;
}

static void sort_doubles(double *v, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
}

/* One weight on the GPU: the median of reps after a warm-up; the last result stays in *q. From
 * host memory (uploads included), or resident: the weight and the Hessian's sum already in GPU
 * memory, as the pipeline has them after its calibration pass (the codes still come back). */
static double time_one_gpu(mq_gpu *g, const bench_cfg *b, const float *H, const float *W, int64_t N,
                           int64_t K, int reps, bool resident, mq_qtensor *q, mq_gptq_stats *stats) {
    double t[1000], best = -1;
    const float *Hs[] = {resident ? NULL : H};
    const int64_t Ks[] = {K};
    const char *hn[] = {"bench.weight"};
    const int32_t jh[] = {0};
    mq_gpu_mlp *m = NULL;
    mq_gpu_hessians *hs = NULL;
    if (resident) {
        const float *w[] = {W};
        /* the weight as an expert's gate [F = N, D = K]; H = (2/2) sum */
        if (mq_gpu_mlp_new(g, 1, K, N, w, w, NULL, 1, &m) || mq_gpu_hessians_new(g, 1, &K, &hs) ||
            mq_gpu_hessians_set(hs, 0, H, 2))
            goto out;
    }
    const mq_gpu_hsrc dh[] = {{hs, 0}};
    const mq_gpu_wsrc dw[] = {{m, 0, 0, false}};
    for (int r = -1; r < reps; r++) {
        mq_gptq_job j = {NULL, W, N, 0, "bench.weight", q, NULL, {0, 0, 0, 0, 0}, NULL};
        double t0 = mq_now();
        if (mq_gpu_gptq_ex(g, &b->spec, &b->opts, Hs, resident ? dh : NULL, Ks, hn, 1, &j, resident ? dw : NULL, jh, 1))
            goto out;
        if (r >= 0) t[r] = mq_now() - t0;
        *stats = j.stats;
        if (r + 1 < reps) mq_qtensor_free(q);
    }
    sort_doubles(t, reps);
    best = t[reps / 2];
out:
    mq_gpu_mlp_free(m);
    mq_gpu_hessians_free(hs);
    return best;
}

/* The experts' gate/up global scales over the pool, as the pipeline takes them (one expert a
 * task; a maximum is exact in any order): one thread reading 32 experts' gate and up weights
 * was ~2% of the 16-thread layer. */
typedef struct {
    const mq_qspec *spec;
    float *const *wg, *const *wu;
    int64_t n;   /* values of each weight */
    float *gs;
} gscale_ctx;

static void gscale_task(void *vctx, int64_t e, int thread) {
    (void)thread;
    const gscale_ctx *c = vctx;
    c->gs[e] = mq_nvfp4_global_scale(c->spec, fmaxf(mq_absmax(c->wg[e], c->n), mq_absmax(c->wu[e], c->n)));
}

/* One MoE layer of E experts, processed `chunk` experts at a time (bounded memory): per chunk,
 * factorise the 2*chunk Hessians in parallel, then run the 3*chunk weights in one parallel
 * loop. Random inputs are made once per chunk slot and reused (values do not change the time). */
/* sim (under mq_pool_simulate, else NULL): the timed part's loops' task seconds and simulated
 * seconds, without the making of the inputs. */
static double time_moe_layer(const bench_cfg *b, int64_t E, int64_t chunk, int64_t F, int64_t D,
                             double *cores, mq_gpu *g, double *host_s, double sim[2]) {
    moeq_status st = MOEQ_OK;
    float *hg[64] = {0}, *hd[64] = {0}, *wg[64] = {0}, *wu[64] = {0}, *wd[64] = {0};
    if (chunk > 64) chunk = 64;
    if (chunk > E) chunk = E;
    fprintf(stderr, "moe layer: making random inputs...\n");
    float *base_g = random_hessian(D), *base_d = random_hessian(F);
    for (int64_t e = 0; e < chunk && base_g && base_d; e++) {
        hg[e] = mq_alloc_array((size_t)(D * D), sizeof(float), "bench");
        hd[e] = mq_alloc_array((size_t)(F * F), sizeof(float), "bench");
        if (!hg[e] || !hd[e]) break;
        memcpy(hg[e], base_g, (size_t)(D * D) * sizeof(float));
        memcpy(hd[e], base_d, (size_t)(F * F) * sizeof(float));
        for (int64_t i = 0; i < D; i++) hg[e][i * D + i] *= 1.0f + 0.1f * fabsf(rnd_normal());
        for (int64_t i = 0; i < F; i++) hd[e][i * F + i] *= 1.0f + 0.1f * fabsf(rnd_normal());
        wg[e] = random_matrix(F, D, 0.02f);
        wu[e] = random_matrix(F, D, 0.02f);
        wd[e] = random_matrix(D, F, 0.02f);
    }
    mq_free(base_g);
    mq_free(base_d);
    mq_gptq_factor *fg = calloc((size_t)chunk, sizeof *fg), *fd = calloc((size_t)chunk, sizeof *fd);
    mq_gptq_job *jobs = calloc((size_t)(3 * chunk), sizeof *jobs);
    mq_qtensor *q = calloc((size_t)(3 * chunk), sizeof *q);
    const char **names = calloc((size_t)chunk, sizeof *names);
    double t = -1;
    if (!fg || !fd || !jobs || !q || !names || !wd[chunk - 1]) goto done;
    int64_t kg[64], kd[64];
    for (int64_t e = 0; e < chunk; e++) {
        names[e] = "bench.expert";
        kg[e] = D;
        kd[e] = F;
    }
    if (g) {
        /* the whole layer in one call: 2E Hessians, 3E weights (the chunk's inputs reused) */
        const float **Hs = calloc((size_t)(2 * E), sizeof *Hs);
        int64_t *Ks = calloc((size_t)(2 * E), sizeof *Ks);
        const char **hn = calloc((size_t)(2 * E), sizeof *hn);
        int32_t *jh = calloc((size_t)(3 * E), sizeof *jh);
        mq_gptq_job *gj = calloc((size_t)(3 * E), sizeof *gj);
        mq_qtensor *gq = calloc((size_t)(3 * E), sizeof *gq);
        double ts[3];
        moeq_status gst = Hs && Ks && hn && jh && gj && gq ? MOEQ_OK : MOEQ_E_NOMEM;
        for (int64_t e = 0; e < E && !gst; e++) {
            const int64_t c = e % chunk;
            Hs[2 * e] = hg[c];
            Hs[2 * e + 1] = hd[c];
            Ks[2 * e] = D;
            Ks[2 * e + 1] = F;
            hn[2 * e] = hn[2 * e + 1] = "bench.expert";
            float gs = mq_nvfp4_global_scale(&b->spec, fmaxf(mq_absmax(wg[c], F * D), mq_absmax(wu[c], F * D)));
            gj[3 * e] = (mq_gptq_job){NULL, wg[c], F, gs, "gate", &gq[3 * e], NULL, {0, 0, 0, 0, 0}, NULL};
            gj[3 * e + 1] = (mq_gptq_job){NULL, wu[c], F, gs, "up", &gq[3 * e + 1], NULL, {0, 0, 0, 0, 0}, NULL};
            gj[3 * e + 2] = (mq_gptq_job){NULL, wd[c], D, 0, "down", &gq[3 * e + 2], NULL, {0, 0, 0, 0, 0}, NULL};
            jh[3 * e] = jh[3 * e + 1] = (int32_t)(2 * e);
            jh[3 * e + 2] = (int32_t)(2 * e + 1);
        }
        /* resident: the experts' weights and Hessian sums in GPU memory, as after the pipeline's
         * calibration pass (H = (2/2) sum) */
        mq_gpu_mlp *m = NULL;
        mq_gpu_hessians *hs = NULL;
        mq_gpu_hsrc *dh = calloc((size_t)(2 * E), sizeof *dh);
        mq_gpu_wsrc *dw = calloc((size_t)(3 * E), sizeof *dw);
        const float **pw = calloc((size_t)(3 * E), sizeof *pw);
        if (!gst && (!dh || !dw || !pw)) gst = MOEQ_E_NOMEM;
        for (int64_t e = 0; e < E && !gst; e++) {
            pw[e] = wg[e % chunk];
            pw[E + e] = wu[e % chunk];
            pw[2 * E + e] = wd[e % chunk];
        }
        if (!gst) gst = mq_gpu_mlp_new(g, E, D, F, pw, pw + E, pw + 2 * E, 1, &m);
        if (!gst) gst = mq_gpu_hessians_new(g, 2 * E, Ks, &hs);
        for (int64_t h = 0; h < 2 * E && !gst; h++) {
            gst = mq_gpu_hessians_set(hs, h, Hs[h], 2);
            dh[h] = (mq_gpu_hsrc){hs, h};
        }
        for (int64_t i = 0; i < 3 * E && !gst; i++) dw[i] = (mq_gpu_wsrc){m, i / 3, (int)(i % 3), false};
        const float **none = calloc((size_t)(2 * E), sizeof *none);
        if (!gst && !none) gst = MOEQ_E_NOMEM;
        for (int pass = 0; pass < 2 && !gst; pass++) {
            const bool res = pass == 0;
            fprintf(stderr, "moe layer on the GPU (%s): %lld experts in one call, warm-up and 3 timed runs...\n",
                    res ? "in GPU memory" : "from host memory", (long long)E);
            for (int r = -1; r < 3 && !gst; r++) {
                double t0 = mq_now();
                gst = mq_gpu_gptq_ex(g, &b->spec, &b->opts, res ? none : Hs, res ? dh : NULL, Ks, hn, 2 * E, gj,
                                     res ? dw : NULL, jh, 3 * E);
                if (r >= 0) ts[r] = mq_now() - t0;
                for (int64_t i = 0; i < 3 * E && !gst; i++) mq_qtensor_free(&gq[i]);
            }
            sort_doubles(ts, 3);
            if (res) t = gst ? -1 : ts[1];
            else *host_s = gst ? -1 : ts[1];
        }
        if (gst) {
            fprintf(stderr, "moe layer on the GPU: %s\n", moeq_last_error());
            t = -1;
        }
        mq_gpu_mlp_free(m);
        mq_gpu_hessians_free(hs);
        *cores = 0;
        free(Hs), free(Ks), free(hn), free(jh), free(gj), free(gq), free(dh), free(dw), free(pw), free(none);
        goto done;
    }
    fprintf(stderr, "moe layer: %lld experts, %lld at a time...\n", (long long)E, (long long)chunk);
    double t0 = mq_now(), c0 = cli_cpu_seconds(), sim0[2] = {0, 0};
    if (sim) mq_pool_simulated(&sim0[0], &sim0[1]);
    for (int64_t e0 = 0; e0 < E && !st; e0 += chunk) {
        int64_t n = E - e0 < chunk ? E - e0 : chunk;
        /* the chunk's 2n Hessians in one call, as the pipeline factors a chunk's slots */
        const float *hs[128];
        int64_t ks[128];
        const char *hn[128];
        mq_gptq_factor fs[128];
        for (int64_t e = 0; e < n; e++) {
            hs[e] = hg[e], hs[n + e] = hd[e];
            ks[e] = kg[e], ks[n + e] = kd[e];
            hn[e] = hn[n + e] = names[e];
        }
        st = mq_gptq_factor_many(hs, ks, 2 * n, &b->opts, b->opts.rtn_loss, hn, fs);
        if (st) break;
        for (int64_t e = 0; e < n; e++) fg[e] = fs[e], fd[e] = fs[n + e];
        /* gate and up share the expert's global scale, as fused checkpoints require */
        float gs[64];
        gscale_ctx gc = {&b->spec, wg, wu, F * D, gs};
        mq_parallel_for(n, gscale_task, &gc);
        for (int64_t e = 0; e < n; e++) {
            jobs[3 * e] = (mq_gptq_job){&fg[e], wg[e], F, gs[e], "gate", &q[3 * e], NULL, {0, 0, 0, 0, 0}, NULL};
            jobs[3 * e + 1] = (mq_gptq_job){&fg[e], wu[e], F, gs[e], "up", &q[3 * e + 1], NULL, {0, 0, 0, 0, 0}, NULL};
            jobs[3 * e + 2] = (mq_gptq_job){&fd[e], wd[e], D, 0, "down", &q[3 * e + 2], NULL, {0, 0, 0, 0, 0}, NULL};
        }
        st = mq_gptq_run(&b->spec, &b->opts, jobs, 3 * n);
        for (int64_t e = 0; e < n; e++) {
            mq_gptq_factor_free(&fg[e]);
            mq_gptq_factor_free(&fd[e]);
        }
        if (!st)
            for (int64_t i = 0; i < 3 * n; i++) mq_qtensor_free(&q[i]);
        fprintf(stderr, "\rmoe layer: %lld/%lld experts, %.1f s", (long long)(e0 + n), (long long)E,
                mq_now() - t0);
    }
    fprintf(stderr, "\n");
    if (!st) t = mq_now() - t0;
    *cores = (cli_cpu_seconds() - c0) / (mq_now() - t0);
    if (sim) {
        mq_pool_simulated(&sim[0], &sim[1]);
        sim[0] -= sim0[0];
        sim[1] -= sim0[1];
    }
done:
    for (int64_t e = 0; e < chunk; e++) {
        mq_free(hg[e]);
        mq_free(hd[e]);
        mq_free(wg[e]);
        mq_free(wu[e]);
        mq_free(wd[e]);
    }
    free(fg);
    free(fd);
    free(jobs);
    free(q);
    free(names);
    return t;
}

/* End to end on a model: the pipeline with the defaults of `moeq quantize --method gptq` (MSE
 * on), the checkpoint written to a temporary directory and removed. */
static moeq_status time_model(const char *dir, const char *calib, const bench_cfg *b,
                              int64_t nsamples, int64_t seqlen, mq_pipeline_result *r, double *total) {
    double t0 = mq_now();
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, b->spec.scheme, MQ_FMT_CT);
    if (b->spec.scheme == MQ_QS_INT4) o.spec.group_size = b->spec.group_size;
    o.spec.mse = true;
    o.gptq = true;
    o.g.mse_weight = o.spec.group_size > 0 ? MQ_GPTQ_MSE_LOOP : MQ_GPTQ_MSE_PLAIN;
    o.g.act_order = b->spec.scheme == MQ_QS_INT4;
    o.calib.path = calib;
    o.calib.nsamples = nsamples;
    o.calib.seqlen = seqlen;
    const char *td = getenv("TMPDIR");
    char tmpl[1024], out[1100];
    snprintf(tmpl, sizeof tmpl, "%s/moeq-bench-XXXXXX", td && *td ? td : "/tmp");
    if (!mkdtemp(tmpl)) return mq_err(MOEQ_E_IO, "cannot make a temporary directory in %s", tmpl);
    snprintf(out, sizeof out, "%s/q", tmpl);
    moeq_status st = mq_pipeline_run(dir, out, &o, r);
    mq_remove_tree(tmpl);
    *total = mq_now() - t0;
    return st;
}

/* --device cuda: the single weight (and the MoE layer) on the GPU, against the GPU's own sgemm
 * and bandwidth; the CPU's result for the code agreement. */
static int bench_gptq_gpu(mq_gpu *g, const bench_cfg *b, int64_t rows, int64_t cols, int64_t reps,
                          int64_t experts, bool json, bool tf32) {
    mq_gpu_info gi;
    mq_gpu_get_info(g, &gi);
    double sgemm = 0, bw = 0;
    if (mq_gpu_measure(g, &sgemm, &bw)) {
        mq_gpu_close(g);
        return cli_fail("bench gptq", MOEQ_E_DEVICE);
    }
    float *W = random_matrix(rows, cols, 0.02f), *H = random_hessian(cols);
    if (!W || !H) return cli_fail("bench gptq", MOEQ_E_NOMEM);
    mq_qtensor qg, qc;
    mq_gptq_stats sg = {0, 0, 0, 0, 0}, sc = {0, 0, 0, 0, 0};
    mq_qtensor qh;
    mq_gptq_stats sh = {0, 0, 0, 0, 0};
    double sec_host = time_one_gpu(g, b, H, W, rows, cols, (int)reps, false, &qh, &sh);
    double sec = sec_host < 0 ? -1 : time_one_gpu(g, b, H, W, rows, cols, (int)reps, true, &qg, &sg);
    if (sec < 0) {
        fprintf(stderr, "bench gptq: %s\n", moeq_last_error());
        mq_gpu_close(g);
        return cli_fail("bench gptq", MOEQ_E_DEVICE);
    }
    double tc = mq_now();
    if (mq_gptq_quantize(&b->spec, &b->opts, H, W, rows, cols, 0, "bench.weight", &qc, NULL, &sc))
        return cli_fail("bench gptq", MOEQ_E_NUMERIC);
    tc = mq_now() - tc;
    int64_t same = 0;
    for (int64_t i = 0; i < rows * cols; i++) same += qc.codes[i] == qg.codes[i];
    const double agree = (double)same / (double)(rows * cols);
    /* from host memory or resident, the same values: the same bits */
    const bool same_paths = memcmp(qh.codes, qg.codes, (size_t)(rows * cols)) == 0 && sh.loss == sg.loss;
    mq_qtensor_free(&qh);
    mq_qtensor_free(&qg);
    mq_qtensor_free(&qc);
    mq_free(W);
    mq_free(H);
    double flops = (double)rows * (double)cols * (double)cols + pow((double)cols, 3);
    double moe_s = -1, moe_cores = 0, moe_host_s = -1;
    if (experts > 0) moe_s = time_moe_layer(b, experts, 8, 1024, 2048, &moe_cores, g, &moe_host_s, NULL);
    mq_gpu_close(g);
    if (experts > 0 && moe_s < 0) return cli_fail("bench gptq", MOEQ_E_DEVICE);
    if (json) {
        printf("{\"device\": \"cuda:%d\", \"gpu\": \"%s\", \"tf32\": %s, \"rows\": %lld, \"cols\": %lld, "
               "\"scheme\": \"%s\", \"act_order\": %s, \"mse\": %s, \"seconds\": %.6f, \"cpu_seconds\": %.6f, "
               "\"gflops\": %.3f, \"gpu_sgemm_gflops\": %.3f, \"gpu_bandwidth_gbs\": %.3f, "
               "\"code_agreement\": %.6f, \"loss\": %.6g, \"cpu_loss\": %.6g, \"host_memory_seconds\": %.6f, "
               "\"resident_equals_host\": %s",
               gi.device, gi.name, tf32 ? "true" : "false", (long long)rows, (long long)cols,
               mq_qscheme_name(b->spec.scheme), b->opts.act_order ? "true" : "false", b->spec.mse ? "true" : "false",
               sec, tc, flops / sec * 1e-9, sgemm, bw, agree, sg.loss, sc.loss, sec_host, same_paths ? "true" : "false");
        if (experts > 0)
            printf(", \"moe_layer_experts\": %lld, \"moe_layer_seconds\": %.4f, \"moe_layer_host_memory_seconds\": %.4f",
                   (long long)experts, moe_s, moe_host_s);
        printf("}\n");
    } else {
        printf("GPU cuda:%d %s: sgemm %.0f GFLOP/s (%s), copy bandwidth %.0f GB/s\n", gi.device, gi.name, sgemm,
               tf32 ? "TF32" : "fp32", bw);
        printf("gptq %s %lldx%lld%s%s: %.4f s on the GPU with the weight and Hessian in its memory, codes back "
               "in host memory (median of %lld; %.1f GFLOP/s = %.1f%% of its sgemm); %.4f s from host memory "
               "(%s codes); %.3f s on the CPU (%d threads): %.1fx\n",
               mq_qscheme_name(b->spec.scheme), (long long)rows, (long long)cols, b->opts.act_order ? ", act-order" : "",
               b->spec.mse ? ", mse" : "", sec, (long long)reps, flops / sec * 1e-9, 100 * flops / sec * 1e-9 / sgemm,
               sec_host, same_paths ? "the same" : "DIFFERENT", tc, moeq_threads(), tc / sec);
        printf("codes equal to the CPU's: %.5f%%; loss GPU %.6g, CPU %.6g (%+.3f%%)\n", 100 * agree, sg.loss, sc.loss,
               100 * (sg.loss - sc.loss) / sc.loss);
        printf("torchao on an H200 GPU: 0.94 s for 4096x2048 nvfp4 (%.0fx)\n", 0.94 / sec);
        if (experts > 0)
            printf("MoE layer, %lld experts (gate/up 1024x2048, down 2048x1024) on the GPU: %.3f s with the "
                   "experts and Hessians in its memory, %.3f s from host memory (torchao on an H200: 65 s, %.0fx)\n",
                   (long long)experts, moe_s, moe_host_s, 65.0 / moe_s);
    }
    return CLI_OK;
}

/* --threads 2,4,8,16: the single weight (and the MoE layer) at each thread count in turn, with
 * the speedup and efficiency against the first count, and whether every count gave the same
 * codes (they must: results never depend on the thread count). */
static int bench_scaling(const bench_cfg *b, int64_t rows, int64_t cols, int reps, int rounds, const int *tl,
                         int nt, int64_t experts, int64_t chunk, bool json) {
    float *W = random_matrix(rows, cols, 0.02f), *H = random_hessian(cols);
    if (!W || !H) return cli_fail("bench gptq", MOEQ_E_NOMEM);
    double sec[32], fac[32], cores[32], moe[32], moe_cores[32], sgemm[32], core_rate[32], core_gflops[32],
        task[32], chol[32], inv[32], copies[32];
    /* each count's figures in every round ([count][round]): the medians are reported */
    double r_sec[32][64], r_fac[32][64], r_cores[32][64], r_moe[32][64], r_moe_cores[32][64], r_sgemm[32][64],
        r_rate[32][64], r_task[32][64], r_chol[32][64], r_inv[32][64], r_copies[32][64];
    uint32_t crc0 = 0;   /* the first run's codes: every run must give them */
    bool same = true;
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < nt; i++) {
            moeq_set_threads(tl[i]);
            r_sgemm[i][r] = mq_measure_sgemm_gflops(1024, 1.0);
            r_rate[i][r] = mq_measure_core_gflops(0.5) / tl[i];   /* per thread, all threads at once */
            mq_gptq_stats st;
            r_sec[i][r] = time_one(b, H, W, rows, cols, reps, &r_fac[i][r], &st, &r_cores[i][r]);
            if (r_sec[i][r] < 0) return cli_fail("bench gptq", MOEQ_E_NUMERIC);
            r_task[i][r] = st.seconds;   /* the column loop's tasks, each one's wall time, summed */
            r_chol[i][r] = g_best_parts[0];
            r_inv[i][r] = g_best_parts[1];
            r_copies[i][r] = g_best_parts[2];
            if (r == 0 && i == 0) crc0 = g_last_crc;
            same &= g_last_crc == crc0;
            r_moe[i][r] = -1;
            r_moe_cores[i][r] = 0;
            if (experts > 0 &&
                (r_moe[i][r] = time_moe_layer(b, experts, chunk, 1024, 2048, &r_moe_cores[i][r], NULL, NULL, NULL)) < 0)
                return cli_fail("bench gptq", MOEQ_E_NOMEM);
            if (rounds > 1) fprintf(stderr, "bench gptq: %d threads done (round %d of %d)\n", tl[i], r + 1, rounds);
            else fprintf(stderr, "bench gptq: %d threads done\n", tl[i]);
        }
    for (int i = 0; i < nt; i++) {
        double rel[64];
        for (int r = 0; r < rounds; r++) rel[r] = r_rate[i][r] / r_rate[0][r];   /* against the round's first */
        sec[i] = cli_median(r_sec[i], rounds);
        fac[i] = cli_median(r_fac[i], rounds);
        cores[i] = cli_median(r_cores[i], rounds);
        moe[i] = cli_median(r_moe[i], rounds);
        moe_cores[i] = cli_median(r_moe_cores[i], rounds);
        sgemm[i] = cli_median(r_sgemm[i], rounds);
        core_rate[i] = cli_median(rel, rounds);
        core_gflops[i] = cli_median(r_rate[i], rounds);
        task[i] = cli_median(r_task[i], rounds);
        chol[i] = cli_median(r_chol[i], rounds);
        inv[i] = cli_median(r_inv[i], rounds);
        copies[i] = cli_median(r_copies[i], rounds);
    }
    mq_free(W);
    mq_free(H);
    const double flops = (double)rows * (double)cols * (double)cols + pow((double)cols, 3);
    if (json) {
        printf("{\"rows\": %lld, \"cols\": %lld, \"same_codes\": %s, \"scaling\": [", (long long)rows,
               (long long)cols, same ? "true" : "false");
        for (int i = 0; i < nt; i++) {
            const double sp = sec[0] / sec[i], eff = sp * tl[0] / tl[i];
            printf("%s{\"threads\": %d, \"seconds\": %.6f, \"factor_seconds\": %.6f, \"cores_used\": %.2f, "
                   "\"speedup\": %.3f, \"efficiency\": %.3f, \"fraction_of_sgemm\": %.4f, \"sgemm_gflops\": %.2f, "
                   "\"core_gflops\": %.2f, \"core_rate\": %.3f, \"loop_task_seconds\": %.6f, "
                   "\"cholesky_seconds\": %.6f, \"inverse_seconds\": %.6f, \"copies_seconds\": %.6f",
                   i ? ", " : "", tl[i], sec[i], fac[i], cores[i], sp, eff, flops / sec[i] * 1e-9 / sgemm[i], sgemm[i],
                   core_gflops[i], core_rate[i], task[i], chol[i], inv[i], copies[i]);
            printf(", \"of_ceiling\": %.3f", core_rate[i] > 0 ? eff / core_rate[i] : 0);
            if (experts > 0)
                printf(", \"moe_layer_seconds\": %.3f, \"moe_layer_efficiency\": %.3f, \"moe_layer_of_ceiling\": %.3f",
                       moe[i], moe[0] / moe[i] * tl[0] / tl[i],
                       core_rate[i] > 0 ? moe[0] / moe[i] * tl[0] / tl[i] / core_rate[i] : 0);
            printf("}");
        }
        printf("]}\n");
        return CLI_OK;
    }
    printf("gptq %s %lldx%lld: scaling against %d threads (best of %d each%s)\n", mq_qscheme_name(b->spec.scheme),
           (long long)rows, (long long)cols, tl[0], reps, rounds > 1 ? "; medians of the rounds, counts in turn" : "");
    printf("threads   weight s  factor s  (chol / inv / copies)  task s  cores busy  speedup  efficiency  of sgemm  sgemm GFLOP/s  core rate%s\n",
           experts > 0 ? "   MoE layer s  cores busy  efficiency" : "");
    for (int i = 0; i < nt; i++) {
        const double sp = sec[0] / sec[i];
        printf("%7d  %9.3f %9.3f (%.3f / %.3f / %.3f) %7.3f %11.2f %8.2fx %11.2f %8.0f%% %14.1f %10.2f", tl[i], sec[i], fac[i],
               chol[i], inv[i], copies[i], task[i], cores[i], sp, sp * tl[0] / tl[i], 100 * flops / sec[i] * 1e-9 / sgemm[i], sgemm[i], core_rate[i]);
        if (experts > 0)
            printf(" %13.2f %11.2f %11.2f", moe[i], moe_cores[i], moe[0] / moe[i] * tl[0] / tl[i]);
        printf("\n");
    }
    printf("(chol / inv / copies: the factor's Cholesky, triangular inverse and the rest (copies, rotation, page faults); task s: the column loop's tasks' wall seconds summed, growing with the thread count where each task "
           "runs slower beside the others; core rate: each thread's single-threaded sgemm rate with all threads "
           "running, against %d threads: the ceiling of compute-bound efficiency on this machine)\n", tl[0]);
    for (int i = 1; i < nt; i++)
        if (core_rate[i] > 0) {
            printf("%d threads, efficiency over the core rate (1.00: as fast as the cores allow): weight %.2f", tl[i],
                   sec[0] / sec[i] * tl[0] / tl[i] / core_rate[i]);
            if (experts > 0) printf(", MoE layer %.2f", moe[0] / moe[i] * tl[0] / tl[i] / core_rate[i]);
            printf("\n");
        }
    printf("codes and scales %s at every thread count\n", same ? "identical" : "DIFFER (a bug)");
    return same ? CLI_OK : CLI_FAIL;
}

int bench_gptq(int argc, char **argv) {
    int64_t rows = 4096, cols = 2048, group = 128, block = 128, reps = 3, rounds = 1, sim_threads = 0;
    const char *threads = NULL;
    int64_t experts = 64, chunk = 32, seed = 1;
    double percdamp = 0.01;
    const char *scheme = "nvfp4", *mse_weight = "gptq";
    bool act_order = false, mse = false, static_groups = false, json = false, moe = false;
    bool rtn_loss = false, tf32 = false;
    const char *model = NULL, *calib = NULL, *device = "cpu";
    int64_t nsamples = 128, seqlen = 512, refine = 0;
    const cli_opt opts[] = {
        {"--rows", OPT_INT, &rows, "N", "output features (default 4096)", NULL, 1, 1 << 20, NULL},
        {"--cols", OPT_INT, &cols, "K", "input features (default 2048)", NULL, 16, 1 << 16, NULL},
        {"--scheme", OPT_CHOICE, &scheme, NULL, "weight format (default nvfp4)", "nvfp4|int4", 0, -1, NULL},
        {"--group", OPT_INT, &group, "G", "INT4 group size (default 128)", NULL, 1, 1 << 16, NULL},
        {"--block-size", OPT_INT, &block, "B", "GPTQ lazy-update block (default 128)", NULL, 1, 1 << 16, NULL},
        {"--percdamp", OPT_DOUBLE, &percdamp, "F", "damping fraction (default 0.01)", NULL, 0, -1, NULL},
        {"--act-order", OPT_FLAG, &act_order, NULL, "columns in decreasing diag(H) order", NULL, 0, -1, NULL},
        {"--static-groups", OPT_FLAG, &static_groups, NULL, "group params from the original weights", NULL, 0, -1, NULL},
        {"--mse", OPT_FLAG, &mse, NULL, "MSE scale search", NULL, 0, -1, NULL},
        {"--mse-weight", OPT_CHOICE, &mse_weight, NULL, "how --mse scores a group (as moeq quantize; default gptq)",
         "gptq|plain|hessian|obq", 0, -1, NULL},
        {"--refine", OPT_INT, &refine, "N", "passes of coordinate descent over the codes after GPTQ "
         "(as moeq quantize --refine; default 0)", NULL, 0, 64, NULL},
        {"--rtn-loss", OPT_FLAG, &rtn_loss, NULL, "also compute the RTN loss (timed)", NULL, 0, -1, NULL},
        {"--reps", OPT_INT, &reps, "R", "timed repetitions, best kept (default 3)", NULL, 1, 1000, NULL},
        {"--threads", OPT_STRING, &threads, "T[,T...]", "threads (default: every CPU it may use); a list such as "
         "2,4,8,16 times each count in turn and prints the scaling against the first", NULL, 0, -1, NULL},
        {"--rounds", OPT_INT, &rounds, "N", "with a --threads list: time the whole list N times in turn "
         "(2,16,2,16,...) and report the medians (default 1)", NULL, 1, 64, NULL},
        {"--seed", OPT_INT, &seed, "S", "random seed (default 1)", NULL, 1, -1, NULL},
        {"--simulate-threads", OPT_INT, &sim_threads, "P", "the single weight (with --moe also the MoE "
         "layer) on one thread as P threads would split it: the factor's and the column loop's task seconds and "
         "the seconds P threads would take, the pool's hand-out simulated (the cores' shared clock and memory "
         "not modelled)", NULL, 2,
         4096, NULL},
        {"--moe", OPT_FLAG, &moe, NULL, "also time one OLMoE-1B-7B-shaped MoE layer", NULL, 0, -1, NULL},
        {"--experts", OPT_INT, &experts, "E", "experts in the --moe layer (default 64)", NULL, 1, 4096, NULL},
        {"--moe-chunk", OPT_INT, &chunk, "C", "experts factorised and run together (default 32, the pipeline's chunk on the 16-core GPU machine)", NULL, 1, 64, NULL},
        {"--model", OPT_STRING, &model, "DIR", "also time GPTQ end to end on a model (load, "
         "calibrate, quantize; no checkpoint written)", NULL, 0, -1, NULL},
        {"--calib", OPT_STRING, &calib, "FILE", "calibration text for --model (default "
         "shared/fixtures/text/calib.txt)", NULL, 0, -1, NULL},
        {"--nsamples", OPT_INT, &nsamples, "N", "--model calibration samples (default 128)", NULL, 1, 1 << 20, NULL},
        {"--seqlen", OPT_INT, &seqlen, "L", "--model tokens per sample (default 512)", NULL, 2, 1 << 20, NULL},
        {"--device", OPT_STRING, &device, "DEV", "cpu (default), cuda or cuda:N: time GPTQ on that GPU "
         "(the CPU runs the single weight once for the code agreement)", NULL, 0, -1, NULL},
        {"--gpu-tf32", OPT_FLAG, &tf32, NULL, "GPU: TF32 tensor cores for the updates (default fp32)", NULL, 0, -1, NULL},
        {"--json", OPT_FLAG, &json, NULL, "print one JSON object on stdout", NULL, 0, -1, NULL},
    };
    const cli_command cmd = {"bench gptq", "[options]",
                             "GPTQ speed on random weights and a random SPD Hessian: seconds and the "
                             "fraction of this machine's sgemm FLOP rate (rows*cols^2 + cols^3 flops).",
                             opts, (int)(sizeof opts / sizeof opts[0]), 0, 0, NULL};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    int tlist[32], nt = 0;
    if (threads) {
        if ((nt = cli_parse_counts(threads, tlist, 32, 1, 4096)) < 1)
            return cli_usage_error("bench gptq", "--threads %s: expected counts such as 2,4,8,16", threads);
        moeq_set_threads(tlist[0]);
    }
    g_rng = 0x9E3779B97F4A7C15ull ^ (uint64_t)seed;

    bench_cfg b;
    b.spec = mq_qspec_default(strcmp(scheme, "int4") == 0 ? MQ_QS_INT4 : MQ_QS_NVFP4);
    if (b.spec.scheme == MQ_QS_INT4) b.spec.group_size = (int32_t)group;
    b.spec.mse = mse;
    b.opts = mq_gptq_opts_default();
    b.opts.block_size = (int32_t)block;
    b.opts.percdamp = percdamp;
    b.opts.act_order = act_order;
    b.opts.groups = static_groups ? MQ_GPTQ_GROUPS_STATIC : MQ_GPTQ_GROUPS_DYNAMIC;
    b.opts.rtn_loss = rtn_loss;
    b.opts.refine_passes = (int32_t)refine;
    b.opts.mse_weight = strcmp(mse_weight, "hessian") == 0 ? MQ_GPTQ_MSE_HDIAG
                        : strcmp(mse_weight, "obq") == 0   ? MQ_GPTQ_MSE_OBQ
                        : strcmp(mse_weight, "gptq") == 0  ? MQ_GPTQ_MSE_LOOP
                                                           : MQ_GPTQ_MSE_PLAIN;

    int dev = -1;
    mq_gpu *g = NULL;
    if (mq_gpu_parse_device(device, &dev)) return cli_usage_error("bench gptq", "%s", moeq_last_error());
    if (dev >= 0) {
        if (model) return cli_usage_error("bench gptq", "--model runs on the CPU; time a model on the GPU "
                                          "with moeq quantize --device");
        if (refine) return cli_usage_error("bench gptq", "--refine runs on the CPU only");
        if (mq_gpu_open(dev, &g)) return cli_fail("bench gptq", MOEQ_E_UNSUPPORTED);
        if (tf32 && mq_gpu_set_precision(g, MOEQ_GPU_TF32)) return cli_fail("bench gptq", MOEQ_E_DEVICE);
        return bench_gptq_gpu(g, &b, rows, cols, reps, moe ? experts : 0, json, tf32);
    }
    if (tf32) return cli_usage_error("bench gptq", "--gpu-tf32 needs --device cuda");
    if (sim_threads > 0) {
        if (threads || model)
            return cli_usage_error("bench gptq", "--simulate-threads times the single weight (and --moe's layer) "
                                   "on one thread: give no --threads or --model");
        return bench_simulated(&b, rows, cols, (int)reps, (int)sim_threads, moe ? experts : 0, chunk, json);
    }
    if (rounds > 1 && nt < 2) return cli_usage_error("bench gptq", "--rounds needs a list to --threads");
    if (nt > 1) {
        if (model) return cli_usage_error("bench gptq", "a --threads list times the weight and --moe, not --model");
        return bench_scaling(&b, rows, cols, (int)reps, (int)rounds, tlist, nt, moe ? experts : 0, chunk, json);
    }
    float *W = random_matrix(rows, cols, 0.02f), *H = random_hessian(cols);
    if (!W || !H) return cli_fail("bench gptq", MOEQ_E_NOMEM);
    double sgemm = mq_measure_sgemm_gflops(1024, 1.0);
    double factor_s = 0;
    mq_gptq_stats stats = {0, 0, 0, 0, 0};
    double cores = 0, moe_cores = 0;
    double sec = time_one(&b, H, W, rows, cols, (int)reps, &factor_s, &stats, &cores);
    mq_free(W);
    mq_free(H);
    if (sec < 0) return cli_fail("bench gptq", MOEQ_E_NUMERIC);
    double flops = (double)rows * (double)cols * (double)cols + pow((double)cols, 3);
    double gflops = flops / sec * 1e-9;
    double moe_s = -1;
    if (moe) {
        moe_s = time_moe_layer(&b, experts, chunk, 1024, 2048, &moe_cores, NULL, NULL, NULL);
        if (moe_s < 0) return cli_fail("bench gptq", MOEQ_E_NOMEM);
    }
    mq_pipeline_result mr;
    memset(&mr, 0, sizeof mr);
    double model_s = -1;
    char calib_buf[4200];
    if (model) {
        if (!calib) {
            const char *sh = cli_shared_dir();
            if (!sh) return cli_usage_error("bench gptq", "--model needs --calib FILE (no shared fixtures)");
            snprintf(calib_buf, sizeof calib_buf, "%s/fixtures/text/calib.txt", sh);
            calib = calib_buf;
        }
        if (!(model = cli_checkpoint_dir("bench gptq", model, NULL))) return CLI_FAIL;
        moeq_status st = time_model(model, calib, &b, nsamples, seqlen, &mr, &model_s);
        if (st) return cli_fail("bench gptq", st);
    }
    if (json) {
        printf("{\"rows\": %lld, \"cols\": %lld, \"scheme\": \"%s\", \"block_size\": %lld, "
               "\"act_order\": %s, \"mse\": %s, \"threads\": %d, \"seconds\": %.6f, "
               "\"factor_seconds\": %.6f, \"gflops\": %.3f, \"sgemm_gflops\": %.3f, "
               "\"fraction_of_sgemm\": %.4f, \"cores_used\": %.2f, \"codes_crc32\": \"%08x\"",
               (long long)rows, (long long)cols, scheme, (long long)block,
               act_order ? "true" : "false", mse ? "true" : "false", moeq_threads(), sec, factor_s,
               gflops, sgemm, gflops / sgemm, cores, (unsigned)g_last_crc);
        if (rtn_loss) printf(", \"loss\": %.6g, \"rtn_loss\": %.6g", stats.loss, stats.rtn_loss);
        if (moe)
            printf(", \"moe_layer_experts\": %lld, \"moe_layer_seconds\": %.3f, \"moe_layer_cores_used\": %.2f",
                   (long long)experts, moe_s, moe_cores);
        if (model)
            printf(", \"model_seconds\": %.3f, \"model_forward_seconds\": %.3f, "
                   "\"model_hessian_seconds\": %.3f, \"model_gptq_seconds\": %.3f, \"model_tokens\": %lld",
                   model_s, mr.seconds_forward, mr.seconds_hessian, mr.seconds_gptq, (long long)mr.tokens);
        printf("}\n");
    } else {
        printf("gptq %s %lldx%lld (block %lld%s%s%s), %d threads: %.3f s (factor %.3f s), "
               "%.1f GFLOP/s = %.0f%% of sgemm (%.1f GFLOP/s); %.2f cores busy\n",
               scheme, (long long)rows, (long long)cols, (long long)block,
               act_order ? ", act-order" : "", mse ? ", mse" : "", static_groups ? ", static" : "",
               moeq_threads(), sec, factor_s, gflops, 100.0 * gflops / sgemm, sgemm, cores);
        if (cores < 0.8 * moeq_threads())
            printf("note: other processes held the cores (%.2f of %d busy for us): times are "
                   "pessimistic\n", cores, moeq_threads());
        if (rtn_loss) printf("loss %.6g vs RTN %.6g\n", stats.loss, stats.rtn_loss);
        printf("torchao on an H200 GPU: 0.94 s for 4096x2048 nvfp4\n");
        if (moe)
            printf("MoE layer, %lld experts (gate/up 1024x2048, down 2048x1024): %.2f s "
                   "(torchao on an H200: 65 s); %.2f cores busy\n", (long long)experts, moe_s, moe_cores);
        if (model)
            printf("%s end to end (%lld tokens, sequential, mse): %.2f s = load + calibration forward "
                   "%.2f s + Hessians %.2f s + GPTQ %.2f s\n", model, (long long)mr.tokens, model_s,
                   mr.seconds_forward, mr.seconds_hessian, mr.seconds_gptq);
    }
    return CLI_OK;
}
